/*
 * onednn_matmul: GFLOP/s of Debian's oneDNN (libdnnl 2.6.3, the version
 * PyTorch 1.13 bundles as MKL-DNN) bf16 matmul primitive beside the
 * library's ts_matmul in bfloat16, on bench_matmul's shapes, the two
 * alternating repetition by repetition on the same values so that other
 * load on the machine hits both alike. It is the measurement behind
 * docs/bf16-matmul.md's choice about oneDNN; it is not built by meson (the
 * library has no oneDNN dependency). Build (after ninja -C build) and run:
 *
 *   cc -O2 -std=c11 -I. tools/bench/onednn_matmul.c -o onednn_matmul \
 *      build/libtensorshard.a -ldnnl -lblis -ljansson -luv \
 *      $(pkg-config --libs ucx) -lm -lpthread
 *   OMP_NUM_THREADS=1 TS_NUM_THREADS=1 ./onednn_matmul 11
 *
 * Prints, per shape, the median and the best GFLOP/s of REPS timed runs
 * after warm-up, and the implementation oneDNN chose (e.g.
 * brg:avx512_core_bf16). The bf16-output rows are the ones to compare
 * with the library's bf16 matmul (one rounding of a float32 sum).
 */
#define _GNU_SOURCE
#include "tensorshard.h"

#include <oneapi/dnnl/dnnl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CHECK(x) \
    do { \
        dnnl_status_t s_ = (x); \
        if (s_ != dnnl_success) { \
            fprintf(stderr, "%s failed: %d\n", #x, (int)s_); \
            exit(2); \
        } \
    } while (0)

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* A bf16 tensor (rows, cols) over a copy of x with strides (rs, cs), one
 * of them 1: a transposed view when rs == 1. */
static ts_tensor *lib_view(const uint16_t *x, int64_t rows, int64_t cols, int64_t rs, int64_t cs)
{
    ts_tensor *t, *v;
    int64_t shape[2] = {cs == 1 ? rows : cols, cs == 1 ? cols : rows};
    if (ts_tensor_from_data(TS_BF16, 2, shape, x, &t) != TS_OK) exit(2);
    if (cs == 1) return t;
    if (ts_transpose(t, 0, 1, &v) != TS_OK) exit(2);
    ts_tensor_free(t);
    return v;
}

/* C (m, n) = A (m, k) B (k, n); A and B given by strides, as bench_matmul
 * lays them out (the Linear weight W (n, k) read transposed, dY^T). */
static void one(const char *name, int64_t m, int64_t n, int64_t k, int64_t rsa, int64_t csa, int64_t rsb, int64_t csb,
                dnnl_data_type_t cdt, int reps, dnnl_engine_t eng, dnnl_stream_t st)
{
    dnnl_memory_desc_t amd, bmd, cmd;
    dnnl_dims_t ad = {m, k}, bd = {k, n}, cd = {m, n};
    dnnl_dims_t as = {rsa, csa}, bs = {rsb, csb}, cs = {n, 1};
    CHECK(dnnl_memory_desc_init_by_strides(&amd, 2, ad, dnnl_bf16, as));
    CHECK(dnnl_memory_desc_init_by_strides(&bmd, 2, bd, dnnl_bf16, bs));
    CHECK(dnnl_memory_desc_init_by_strides(&cmd, 2, cd, cdt, cs));
    dnnl_matmul_desc_t desc;
    CHECK(dnnl_matmul_desc_init(&desc, &amd, &bmd, NULL, &cmd));
    dnnl_primitive_desc_t pd;
    CHECK(dnnl_primitive_desc_create(&pd, &desc, NULL, eng, NULL));
    const char *impl = "?";
    dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl);
    dnnl_primitive_t prim;
    CHECK(dnnl_primitive_create(&prim, pd));
    size_t asz = (size_t)(rsa > csa ? rsa * m : csa * k), bsz = (size_t)(rsb > csb ? rsb * k : csb * n);
    uint16_t *a = aligned_alloc(64, (asz * 2 + 63) / 64 * 64), *b = aligned_alloc(64, (bsz * 2 + 63) / 64 * 64);
    void *c = aligned_alloc(64, ((size_t)(m * n) * 4 + 63) / 64 * 64);
    for (size_t i = 0; i < asz; i++) a[i] = (uint16_t)(0x3c00 + (i * 7919u) % 512u);
    for (size_t i = 0; i < bsz; i++) b[i] = (uint16_t)(0x3c00 + (i * 104729u) % 512u);
    memset(c, 0, (size_t)(m * n) * 4);
    dnnl_memory_t ma, mb, mc;
    CHECK(dnnl_memory_create(&ma, &amd, eng, a));
    CHECK(dnnl_memory_create(&mb, &bmd, eng, b));
    CHECK(dnnl_memory_create(&mc, &cmd, eng, c));
    dnnl_exec_arg_t args[3] = {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}};
    ts_tensor *la = lib_view(a, m, k, rsa, csa), *lb = lib_view(b, k, n, rsb, csb);
    double t[101], tl[101];
    for (int i = 0; i < reps + 2; i++) {
        double t0 = now_s();
        CHECK(dnnl_primitive_execute(prim, st, 3, args));
        CHECK(dnnl_stream_wait(st));
        double t1 = now_s();
        ts_tensor *o;
        if (ts_matmul(la, lb, &o) != TS_OK) exit(2);
        double t2 = now_s();
        ts_tensor_free(o);
        if (i >= 2) {
            t[i - 2] = t1 - t0;
            tl[i - 2] = t2 - t1;
        }
    }
    ts_tensor_free(la);
    ts_tensor_free(lb);
    qsort(t, (size_t)reps, sizeof *t, cmp_double);
    qsort(tl, (size_t)reps, sizeof *tl, cmp_double);
    double f = 2.0 * (double)m * (double)n * (double)k * 1e-9;
    printf("%-26s %6ld %6ld %6ld  %s out  onednn %6.1f (best %6.1f)  lib %6.1f (best %6.1f)  lib/onednn %.3f  (%s)\n",
           name, (long)m, (long)n, (long)k, cdt == dnnl_bf16 ? "bf16" : "f32 ", f / t[reps / 2], f / t[0],
           f / tl[reps / 2], f / tl[0], t[reps / 2] / tl[reps / 2], impl);
    fflush(stdout);
    dnnl_memory_destroy(ma);
    dnnl_memory_destroy(mb);
    dnnl_memory_destroy(mc);
    dnnl_primitive_destroy(prim);
    dnnl_primitive_desc_destroy(pd);
    free(a);
    free(b);
    free(c);
}

int main(int argc, char **argv)
{
    int reps = argc > 1 ? atoi(argv[1]) : 7;
    if (reps < 1 || reps > 101) reps = 7;
    dnnl_engine_t eng;
    dnnl_stream_t st;
    CHECK(dnnl_engine_create(&eng, dnnl_cpu, 0));
    CHECK(dnnl_stream_create(&st, eng, dnnl_stream_default_flags));
    const dnnl_version_t *v = dnnl_version();
    printf("oneDNN %d.%d.%d against tensorshard '%s', bf16 matmul, GFLOP/s, median (best) of %d\n", v->major, v->minor,
           v->patch, ts_bf16_gemm_kernel_name(), reps);
    int64_t M = 8192, K = 768, N = 3072;
    for (int o = 0; o < 1; o++) { /* bf16 output only: what ts_matmul gives */
        dnnl_data_type_t cdt = o ? dnnl_f32 : dnnl_bf16;
        one("linear fwd  x @ W^T", M, N, K, K, 1, 1, K, cdt, reps, eng, st);
        one("linear bwd dX = dY @ W", M, K, N, N, 1, K, 1, cdt, reps, eng, st);
        one("linear bwd dW = dY^T @ X", N, K, M, 1, N, K, 1, cdt, reps, eng, st);
        for (int64_t s = 512; s <= 2048; s *= 2)
            one(s == 512        ? "square 512"
                    : s == 1024 ? "square 1024"
                                : "square 2048",
                s, s, s, s, 1, s, 1, cdt, reps, eng, st);
    }
    dnnl_stream_destroy(st);
    dnnl_engine_destroy(eng);
    return 0;
}
