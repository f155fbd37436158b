/* What the benchmark programs share: an error check that exits, a
 * monotonic clock and the median of a sample. */
#ifndef TS_BENCH_COMMON_H
#define TS_BENCH_COMMON_H

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define CHECK(expr) \
    do { \
        ts_status st_ = (expr); \
        if (st_) { \
            fprintf(stderr, "%s: %s: %s\n", #expr, ts_status_name(st_), ts_last_error()); \
            exit(1); \
        } \
    } while (0)

/* Seconds of CLOCK_MONOTONIC. */
static inline double bench_now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static inline int bench_cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median of v[0..n) (sorts v). */
static inline double bench_median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, bench_cmp_d);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

#endif
