/* bench_kernels: conversion throughput of tensor/kernels.h's
 * ts__buf_convert per run-time path (f32 <-> bf16, f32 <-> f16), on a
 * buffer that stays in cache and on one that does not, with the ratio
 * against the scalar path measured in the same run. GB/s counts the
 * bytes read plus the bytes written.
 *
 *   bench_kernels [--cache-elems N] [--mem-elems N] [--reps R]
 */
#include "tensor/kernels.h"
#include "tensorshard.h"

#include "bench_common.h"

#include <stdint.h>
#include <string.h>

typedef struct conv {
    const char *name;
    ts_dtype dd, sd;
} conv;

static const conv k_convs[] = {
    {"f32->bf16", TS_BF16, TS_F32},
    {"bf16->f32", TS_F32, TS_BF16},
    {"f32->f16", TS_F16, TS_F32},
    {"f16->f32", TS_F32, TS_F16},
};

/* Median seconds of one conversion of n elements on path p. */
static double time_conv(ts__kpath p, const conv *c, void *dst, const void *src, int64_t n, int reps)
{
    double t[64];
    if (reps > 64) reps = 64;
    ts__buf_convert_on(p, c->dd, dst, c->sd, src, n); /* warm */
    for (int r = 0; r < reps; r++) {
        double t0 = bench_now_s();
        ts__buf_convert_on(p, c->dd, dst, c->sd, src, n);
        t[r] = bench_now_s() - t0;
    }
    return bench_median(t, reps);
}

int main(int argc, char **argv)
{
    int64_t sizes[2] = {16384, 16 << 20};
    int reps = 21;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--cache-elems") && i + 1 < argc) sizes[0] = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--mem-elems") && i + 1 < argc) sizes[1] = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--cache-elems N] [--mem-elems N] [--reps R]\n", argv[0]);
            return strcmp(argv[i], "--help") ? 2 : 0;
        }
    }
    if (sizes[0] <= 0 || sizes[1] <= 0 || reps <= 0) {
        fprintf(stderr, "%s: sizes and reps must be > 0\n", argv[0]);
        return 2;
    }
    int64_t maxn = sizes[0] > sizes[1] ? sizes[0] : sizes[1];
    float *f = malloc((size_t)maxn * 4);
    uint16_t *h = malloc((size_t)maxn * 2);
    float *f2 = malloc((size_t)maxn * 4);
    if (!f || !h || !f2) {
        fprintf(stderr, "%s: out of memory\n", argv[0]);
        return 1;
    }
    uint32_t rng = 1;
    for (int64_t i = 0; i < maxn; i++) {
        rng = rng * 1664525u + 1013904223u;
        f[i] = (float)((int32_t)rng >> 8) * 0x1p-16f;
    }
    ts__buf_convert_on(TS__KPATH_SCALAR, TS_BF16, h, TS_F32, f, maxn);
    printf("# active path: %s (best this CPU runs; TS_KERNELS caps it)\n", ts__kpath_name(ts__kpath_active()));
    for (int p = 0; p < TS__KPATH_COUNT; p++)
        if (!ts__kpath_supported((ts__kpath)p))
            printf("# path %s: skipped (this CPU or OS does not run it)\n", ts__kpath_name((ts__kpath)p));
    printf("%-10s %-10s %12s %10s %10s\n", "conv", "path", "elements", "GB/s", "x scalar");
    for (size_t c = 0; c < sizeof k_convs / sizeof k_convs[0]; c++) {
        const conv *cv = &k_convs[c];
        void *dst = cv->dd == TS_F32 ? (void *)f2 : (void *)h;
        const void *src = cv->sd == TS_F32 ? (const void *)f : (const void *)h;
        size_t bytes_per = ts_dtype_size(cv->dd) + ts_dtype_size(cv->sd);
        for (int s = 0; s < 2; s++) {
            int64_t n = sizes[s];
            int r = s == 0 ? reps * 4 : reps;
            double scalar = 0;
            for (int p = 0; p < TS__KPATH_COUNT; p++) {
                if (!ts__kpath_supported((ts__kpath)p)) continue;
                double t = time_conv((ts__kpath)p, cv, dst, src, n, r);
                double gbs = (double)n * (double)bytes_per / t * 1e-9;
                if (p == 0) scalar = gbs;
                printf("%-10s %-10s %12lld %10.2f %10.2f\n", cv->name, ts__kpath_name((ts__kpath)p), (long long)n, gbs,
                       gbs / scalar);
            }
        }
    }
    free(f);
    free(h);
    free(f2);
    return 0;
}
