/*
 * Per-dtype buffer kernels of the library: loops over contiguous buffers
 * that the tensor ops, comm, fully_shard and optim share (conversion
 * between dtypes, the reductions of the collectives, accumulation,
 * scaling, torch's 2-norms, and the element conversions inlined into the
 * ops' loops). Not installed; library-internal (`ts__` prefix).
 *
 * Run-time paths. The conversions f32 <-> bf16 and f32 <-> f16 have
 * vector builds chosen from cpuid when first used (functions compiled
 * with __attribute__((target(...))), never with build-wide -m flags):
 *   scalar      plain C (the reference every other path is tested against);
 *   avx2        AVX2 + F16C + FMA: bf16 by integer rounding, 8 lanes;
 *               f16 by F16C's vcvtps2ph / vcvtph2ps;
 *   avx512      AVX-512F: the same with 16 lanes;
 *   avx512bf16  AVX512-BF16: f32 -> bf16 by vcvtne2ps2bf16 (32 lanes).
 * Every path gives the bits of the scalar ts_f32_to_bf16, ts_bf16_to_f32,
 * ts_f32_to_f16 and ts_f16_to_f32 (tensor/half.c) for every input: the
 * lanes where an instruction differs (NaN: vcvtne2ps2bf16 keeps the
 * payload and vcvtps2ph truncates it, where ours write 0x7FC0 and
 * sign | 0x7E00; f32 subnormals, which vcvtne2ps2bf16 flushes to zero)
 * are found with a compare and redone by the scalar code. The vector
 * f16 paths assume MXCSR's DAZ is off (the library never sets it).
 * Each path is used only when the CPU has every instruction it needs and
 * the OS saves the registers (XCR0).
 *
 * TS_KERNELS=scalar|avx2|avx512|avx512bf16 (read once, when a kernel is
 * first used) caps the path: TS_KERNELS=scalar makes every kernel here
 * run the plain C build, so that the whole library can be run on the
 * reference on any machine (.ci/run runs the unit suites so once; the
 * tests also call every path directly). A name the CPU cannot run gives
 * the best path it can, with a warning; an unknown name a warning and
 * the default. Tests use ts__kpath_force() instead.
 */
#ifndef TS_TENSOR_KERNELS_H
#define TS_TENSOR_KERNELS_H

#include "base/internal.h"
#include "tensor/tensor.h"

#include <string.h>

/* The element conversions of ts_f32_to_bf16 & co. (tensor/half.c, which
 * documents their results), inlined so that loops over them vectorise. */
static inline float ts__bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t ts__f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & UINT32_C(0x7FFFFFFF)) > UINT32_C(0x7F800000)) return UINT16_C(0x7FC0);
    return (uint16_t)((u + ((u >> 16) & 1u) + UINT32_C(0x7FFF)) >> 16);
}

/* The dtype an op accumulates in for inputs of dtype d: float32 for
 * float32, bfloat16 and float16 (PyTorch's CPU kernels), float64 for
 * float64; d itself for integer dtypes. */
static inline ts_dtype ts__acc_dtype(ts_dtype d) { return d == TS_BF16 || d == TS_F16 ? TS_F32 : d; }

/* True for the 16-bit floating dtypes. */
static inline bool ts__is_half(ts_dtype d) { return d == TS_BF16 || d == TS_F16; }

/* ------------------------------------------------------------ paths */

typedef enum ts__kpath {
    TS__KPATH_SCALAR = 0,
    TS__KPATH_AVX2,
    TS__KPATH_AVX512,
    TS__KPATH_AVX512BF16,
    TS__KPATH_COUNT
} ts__kpath;

/* "scalar", "avx2", "avx512", "avx512bf16"; NULL out of range. */
const char *ts__kpath_name(ts__kpath p);
/* True if this CPU (and OS) runs path p. The scalar path always runs. */
bool ts__kpath_supported(ts__kpath p);
/* The path the kernels use now: the best one supported, capped by
 * TS_KERNELS and by ts__kpath_force. Thread-safe. */
ts__kpath ts__kpath_active(void);
/* Test hook: caps the active path at p (a path the CPU lacks gives the
 * best one below it); p < 0 removes the cap. Thread-safe; results never
 * depend on the path, only speed does. */
void ts__kpath_force(int p);
/* The path TS_KERNELS=value gives on a CPU whose best path is `best`
 * (NULL or "": best; a name above best or unknown: best, with a warning). */
ts__kpath ts__kpath_parse(const char *value, ts__kpath best);

/* ------------------------------------------------------- conversion */

/* dst[i] = src[i] converted from `sd` to `dd` for i < n (contiguous,
 * non-overlapping unless dd == sd). Conversions are ts__store's
 * (PyTorch's static_cast: to bf16/f16 through float, rounded to nearest
 * even; to integers truncated, saturated, NaN to 0; bool as != 0).
 * f32 <-> bf16 and f32 <-> f16 run on the active path; any alignment. */
void ts__buf_convert(ts_dtype dd, void *dst, ts_dtype sd, const void *src, int64_t n);
/* The same on path p (which must be supported; tests and the bench). */
void ts__buf_convert_on(ts__kpath p, ts_dtype dd, void *dst, ts_dtype sd, const void *src, int64_t n);

/* -------------------------------------------------------- reductions */

/* The element operations of the collectives' reductions (comm's
 * TS_REDUCE_SUM and TS_REDUCE_AVG sum, then divide with ts__buf_div). */
typedef enum ts__buf_op { TS__BUF_SUM = 0, TS__BUF_MAX, TS__BUF_MIN, TS__BUF_OP_COUNT } ts__buf_op;

/* out[i] = a[i] op b[i] for i < n; out may be a or b (the same pointer),
 * no other overlap. d is F32, F64, I64, BF16 or F16:
 * - f32, f64: SUM is a + b in the dtype; MAX and MIN give NaN when
 *   either is NaN (a NaN b is taken, else a's), else the larger / smaller
 *   (b when b > a, resp. b < a; so max(-0, +0) is a's zero);
 * - i64: SUM wraps (two's complement), MAX / MIN as for floats;
 * - bf16, f16: each element through f32 (both converted, the f32
 *   operation, rounded once to nearest even; a NaN result is the
 *   dtype's canonical NaN). A sum over W ranks that calls this at every
 *   step rounds W - 1 times, like PyTorch's gloo backend (whose float16
 *   operator+ converts to float, adds and rounds back). comm does not:
 *   it accumulates 16-bit tensors in f32 buffers through every step of
 *   the ring and rounds once at the end (so for 2 ranks it equals gloo;
 *   beyond, it is the more accurate, with W - 1 f32 additions in its
 *   ring order);
 * any other dtype: TS_ASSERT. */
void ts__buf_reduce(ts_dtype d, ts__buf_op op, void *out, const void *a, const void *b, int64_t n);
/* dst[i] += src[i]: ts__buf_reduce(d, TS__BUF_SUM, dst, dst, src, n)
 * (fully_shard's gradient accumulation). */
void ts__buf_add(ts_dtype d, void *dst, const void *src, int64_t n);
/* x[i] = x[i] / div in place, for comm's pre/post divide factors:
 * f32 x / (float)div; f64 x / div; bf16 / f16 through f32 as
 * x / (float)div rounded once; i64 (int64_t)((double)x / div),
 * truncated. div == 1 changes nothing. Division, not a multiplication
 * by the reciprocal, so that results are torch's div_. */
void ts__buf_div(ts_dtype d, void *x, int64_t n, double div);
/* x[i] = x[i] * c in place (clip_grad_norm's grad.mul_(clip_coef)):
 * f32 x * (float)c; f64 x * c; bf16 / f16 through f32 as x * (float)c
 * rounded once. Other dtypes: TS_ASSERT. */
void ts__buf_scale(ts_dtype d, void *x, int64_t n, double c);

/* ------------------------------------------------------------- norms */

/* torch.norm(x, 2) of a contiguous float32 buffer of n elements, to the
 * bit as torch 1.13's CPU kernel computes it (ATen's last-dim path with
 * AVX2 vectors): 8 lane accumulators acc = fma(x, x, acc) over the
 * 8-aligned prefix, summed lane 0 + 1 + ... + 7, then the n % 8 tail as
 * GCC compiled `buffer[0] += x * x` (the first 4 * (t / 4) squares
 * rounded separately and added in order, the rest fused), then sqrt.
 * 0 for n == 0. Measured against torch (tests/fixtures/optim/). */
float ts__buf_norm2_f32(const float *x, int64_t n);
/* The same on path p (supported; the AVX paths are one AVX2+FMA build). */
float ts__buf_norm2_f32_on(ts__kpath p, const float *x, int64_t n);
/* torch.norm(x, 2) of a float64 buffer on path p: one accumulator,
 * acc = fma(x, x, acc) in order, then sqrt (torch on one thread). */
double ts__buf_norm2_f64_on(ts__kpath p, const double *x, int64_t n);

/* ------------------------------------------------------------ buffers
 * The tensor layer's caching pool and the strided-loop helpers, which the
 * buffers of comm/, optim/ and fully_shard/ use too. */

/* Caching pool: blocks are kept for reuse and only returned to the system
 * by ts__pool_empty_cache(). Thread-safe. */
void *ts__pool_alloc(size_t nbytes, size_t *block_bytes_out);
void ts__pool_free(void *p, size_t block_bytes);
/* The bytes of the block ts__pool_alloc(nbytes) hands out (its size
 * class: what TS_MEM_STORAGE counts); nbytes itself when it is too large
 * for any class. fully_shard's memory estimate rounds with it. */
size_t ts__pool_block_bytes(size_t nbytes);
/* The pool's size class of an nbytes allocation (0 <= class <
 * TS__POOL_CLASSES) and its block bytes in *class_bytes_out; -1 when
 * nbytes is too large for any class. The meta ledger models the free
 * lists with it. */
#define TS__POOL_CLASSES 512
int ts__pool_size_class(size_t nbytes, size_t *class_bytes_out);

/* Contiguous strides for shape. */
void ts__contiguous_strides(int ndim, const int64_t *shape, int64_t *strides);

/* Advances a multi-index over dims [0, nd-1) of `shape` (the last dim is
 * the caller's inner loop) and moves each of the nops operands' offsets by
 * its strides; false once every outer index has been visited. */
static inline bool ts__next_outer(int nd, const int64_t *shape, int64_t *idx, int nops, int64_t (*strides)[TS_MAX_DIMS],
                                  int64_t *offs)
{
    for (int d = nd - 2; d >= 0; d--) {
        if (++idx[d] < shape[d]) {
            for (int k = 0; k < nops; k++) offs[k] += strides[k][d];
            return true;
        }
        for (int k = 0; k < nops; k++) offs[k] -= strides[k][d] * (shape[d] - 1);
        idx[d] = 0;
    }
    return false;
}

#endif
