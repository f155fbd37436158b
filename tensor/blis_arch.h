/*
 * BLIS kernel-set selection from cpuid (private to the tensor layer and its
 * tests). The policy lives in pure functions of a cpu description so that
 * tests can check it for CPUs the build machine is not (Zen 5, Haswell, a
 * CPU without OS support for the zmm state).
 */
#ifndef TS_TENSOR_BLIS_ARCH_H
#define TS_TENSOR_BLIS_ARCH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum ts__cpu_vendor { TS__CPU_OTHER = 0, TS__CPU_INTEL, TS__CPU_AMD, TS__CPU_HYGON } ts__cpu_vendor;

/* What cpuid and XGETBV say. The instruction-set flags are the CPU's; the
 * os_* flags say whether the OS saves the wider register state (XCR0), so a
 * kernel set is runnable only when both hold. */
typedef struct ts__cpu_info {
    ts__cpu_vendor vendor;
    uint32_t family; /* display family (base + extended) */
    uint32_t model;  /* display model */
    bool sse3, ssse3, avx, fma3, fma4, avx2;
    bool avx512f, avx512dq, avx512cd, avx512bw, avx512vl, avx512pf, avx512er;
    bool os_ymm;             /* XCR0 bits 1-2: SSE and AVX state */
    bool os_zmm;             /* XCR0 bits 1-2 and 5-7: also opmask and zmm state */
    bool f16c, avx512bf16;   /* for tensor/kernels.c's conversion paths */
    bool amx_bf16, amx_tile; /* AMX-BF16, AMX-TILE: cpuid 7.0 edx bits 22, 24 */
    bool os_amx;             /* XCR0 bits 17-18: tile config and tile data state */
} ts__cpu_info;

/* Fills `out` from cpuid on this machine (all false off x86). */
void ts__cpu_info_query(ts__cpu_info *out);

/* BLIS arch ids (BLIS's arch_t; BLIS_ARCH_TYPE takes these numbers). */
#define TS__BLIS_ARCH_COUNT 26
/* BLIS's name of arch id `id` ("skx"), or NULL for an id out of range.
 * Static; does not call BLIS. */
const char *ts__blis_arch_id_name(int id);
/* True if the linked BLIS build has the sub-configuration `id` (other ids
 * abort inside BLIS). */
bool ts__blis_arch_configured(int id);
/* True if every instruction the kernel set `id` uses runs on `cpu`. */
bool ts__blis_arch_runnable(int id, const ts__cpu_info *cpu);
/* The fastest configured kernel set that `cpu` runs: skx with AVX-512
 * F/DQ/CD/BW/VL and OS zmm support; with AVX2+FMA and OS ymm support zen3
 * on AMD family >= 0x19, zen2 on family 0x17/0x18, else haswell;
 * sandybridge with AVX; penryn with SSSE3; else generic. -1 if the build
 * has none of them (BLIS_ARCH_TYPE is then left alone). */
int ts__blis_arch_choose(const ts__cpu_info *cpu);

/* The bytes of BLIS's float32 packing buffers that a product touches at
 * most: one MC x KC block of A and one KC x NC block of B per BLIS thread,
 * from the running kernel set's block sizes (skx: 480 x 384 and
 * 384 x 3072, 5.4 MiB a thread). BLIS allocates them at the first product
 * and keeps them; docs/memory.md compares this with the resident set it
 * adds. Initialises BLIS (ts__blis_ensure_init). */
size_t ts__blis_pack_bytes(void);

#endif
