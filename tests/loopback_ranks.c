#define _GNU_SOURCE
#include "tests/loopback_ranks.h"

#include <criterion/criterion.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

int th_rank_fail(th_rank *rc, const char *fmt, ...)
{
    if (rc->err[0]) return 1;
    va_list ap;
    va_start(ap, fmt);
    int n = snprintf(rc->err, sizeof rc->err, "rank %d/%d: ", rc->rank, rc->W);
    vsnprintf(rc->err + n, sizeof rc->err - (size_t)n, fmt, ap);
    va_end(ap);
    return 1;
}

int th_rank_same_bits(th_rank *rc, const ts_tensor *a, const ts_tensor *b, const char *what, ...)
{
    if (!a && !b) return 0;
    char w[160];
    va_list ap;
    va_start(ap, what);
    vsnprintf(w, sizeof w, what, ap);
    va_end(ap);
    if (!a || !b) return th_rank_fail(rc, "%s: only one of the two exists", w);
    if (ts_tensor_numel(a) != ts_tensor_numel(b) || ts_tensor_dtype(a) != ts_tensor_dtype(b))
        return th_rank_fail(rc, "%s: shapes or dtypes differ", w);
    size_t es = ts_dtype_size(ts_tensor_dtype(a));
    const unsigned char *pa = ts_tensor_data(a), *pb = ts_tensor_data(b);
    for (int64_t k = 0; k < ts_tensor_numel(a); k++)
        if (memcmp(pa + (size_t)k * es, pb + (size_t)k * es, es))
            return th_rank_fail(rc, "%s: the bits differ at element %lld", w, (long long)k);
    return 0;
}

static void *rank_main(void *arg)
{
    th_rank *rc = arg;
    rc->fn(rc);
    return NULL;
}

void th_run_world(int W, th_rank_fn fn, void *arg, double timeout_s)
{
    cr_assert(W >= 1 && W <= TH_MAXW, "world size %d outside [1, %d]", W, TH_MAXW);
    ts_loopback_fabric *f = NULL;
    TH_OK(ts__loopback_fabric_new(W, &f));
    th_rank rc[TH_MAXW];
    pthread_t th[TH_MAXW];
    memset(rc, 0, sizeof rc);
    for (int i = 0; i < W; i++) {
        ts_transport *t = NULL;
        TH_OK(ts__loopback_transport_new(f, i, &t));
        rc[i] = (th_rank){.rank = i, .W = W, .f = f, .fn = fn, .arg = arg};
        TH_OK(ts__world_new(t, timeout_s, &rc[i].c));
        cr_assert_eq(ts_comm_rank(rc[i].c), i);
        cr_assert_eq(ts_comm_size(rc[i].c), W);
    }
    for (int i = 0; i < W; i++) cr_assert_eq(pthread_create(&th[i], NULL, rank_main, &rc[i]), 0);
    for (int i = 0; i < W; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < W; i++) ts__world_free(rc[i].c);
    ts__loopback_fabric_free(f);
    for (int i = 0; i < W; i++) cr_assert_eq(rc[i].err[0], '\0', "W=%d: %s", W, rc[i].err);
}

ts_mesh *th_rank_mesh(th_rank *rc, bool hsdp)
{
    ts_mesh *mesh = NULL;
    if (hsdp) {
        int64_t shape[2] = {2, rc->W / 2};
        const char *names[2] = {"replicate", "shard"};
        if (ts_mesh_new(rc->c, "cpu", 2, shape, names, &mesh)) return NULL;
    } else {
        int64_t shape[1] = {rc->W};
        const char *names[1] = {"dp"};
        if (ts_mesh_new(rc->c, "cpu", 1, shape, names, &mesh)) return NULL;
    }
    return mesh;
}
