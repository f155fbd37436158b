/*
 * Matrix products in bfloat16 and float16 (private to the tensor layer and
 * its tests and benchmarks). C = A B + beta C with every operand in the
 * 16-bit dtype, products summed in float32 and each element of C rounded
 * once (PyTorch's CPU semantics). Kernels:
 *   - TS__HGEMM_SGEMM: the operands are converted to float32 block by block
 *     while they are packed, BLIS's sgemm multiplies the blocks, and the
 *     float32 result is rounded once; runs on every CPU, and is the only
 *     kernel for float16;
 *   - TS__HGEMM_AVX512BF16: a BLIS-style blocked product whose micro-kernel
 *     is vdpbf16ps on operands packed into bf16 pairs (bfloat16 only).
 * AMX-BF16 is not built (docs/bf16-matmul.md says why); CPUs that have it
 * run the AVX512-BF16 kernel. The choice is ts__hgemm_choose's, from
 * cpuid, unless TS_BF16_GEMM_KERNEL says otherwise (tensor.h).
 */
#ifndef TS_TENSOR_GEMM_HALF_H
#define TS_TENSOR_GEMM_HALF_H

#include "tensor/blis_arch.h"
#include "tensor/tensor.h"

typedef enum ts__hgemm_kernel { TS__HGEMM_SGEMM = 0, TS__HGEMM_AVX512BF16, TS__HGEMM_KERNEL_COUNT } ts__hgemm_kernel;

/* "sgemm", "avx512bf16" (static strings; NULL for an unknown kernel). */
const char *ts__hgemm_kernel_name(ts__hgemm_kernel k);
/* True if every instruction kernel k uses runs on cpu (with the OS
 * saving the registers it uses). */
bool ts__hgemm_kernel_runnable(ts__hgemm_kernel k, const ts__cpu_info *cpu);
/* The fastest kernel cpu runs for bfloat16: AVX512-BF16 with AVX-512
 * F/BW/VL, AVX512_BF16 and OS zmm state (AMX or not); else sgemm. */
ts__hgemm_kernel ts__hgemm_choose(const ts__cpu_info *cpu);
/* The kernel bfloat16 products use in this process: TS_BF16_GEMM_KERNEL
 * if set to a kernel this CPU runs, else ts__hgemm_choose's (read once). */
ts__hgemm_kernel ts__hgemm_active(void);

/* C (m, n) = A (m, k) B (k, n) + beta * C in dtype dt (TS_BF16 or TS_F16),
 * general strides in elements, with kernel `kern`: float16 always runs
 * the sgemm kernel, and so does a kernel this CPU cannot run. beta == 0
 * overwrites C without reading it; k == 0 gives C = beta * C rounded. */
void ts__gemm_half_with(ts__hgemm_kernel kern, ts_dtype dt, int64_t m, int64_t n, int64_t k, const uint16_t *a,
                        int64_t rsa, int64_t csa, const uint16_t *b, int64_t rsb, int64_t csb, float beta, uint16_t *c,
                        int64_t rsc, int64_t csc);
/* The reference: the upcast products summed in float32 in the order
 * p = 0 .. k-1, plus beta * C in float32, rounded once to dt. */
void ts__gemm_ref_half(ts_dtype dt, int64_t m, int64_t n, int64_t k, const uint16_t *a, int64_t rsa, int64_t csa,
                       const uint16_t *b, int64_t rsb, int64_t csb, float beta, uint16_t *c, int64_t rsc, int64_t csc);

/* The meta device's ts__gemm_half: counts on the calling thread's meta
 * ledger the pool scratch blocks the product (dt, m, n, k, beta, C's
 * column stride csc) would take and give back, and computes nothing. */
void ts__gemm_half_meta(ts_dtype dt, int64_t m, int64_t n, int64_t k, float beta, int64_t csc);

#endif
