#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "comm/comm_internal.h"
#include "tests/helpers.h"

/* Collectives over the loopback fabric: W ranks as threads of this test,
 * each with its own world (and communication thread). Rank threads never
 * call cr_assert (Criterion's asserts belong to the test's thread): they
 * write the first failure into their slot and the test asserts on it.
 *
 * Values are small integers, exact in every dtype (bf16 keeps 8
 * significant bits), so sums and max/min compare exactly; only divisions
 * (AVG, divide factors) get a tolerance: the dtype's rounding. */

#define MAXW 4

typedef struct rank_ctx rank_ctx;
typedef int (*rank_fn)(rank_ctx *rc);

struct rank_ctx {
    int rank, W;
    ts_comm *c;
    ts_loopback_fabric *f;
    rank_fn fn;
    void *arg;
    char err[512];
    ts_status world_status;
};

static int fail(rank_ctx *rc, const char *fmt, ...) TS_PRINTF(2, 3);
static int fail(rank_ctx *rc, const char *fmt, ...)
{
    if (rc->err[0]) return 1;
    va_list ap;
    va_start(ap, fmt);
    int n = snprintf(rc->err, sizeof rc->err, "rank %d/%d: ", rc->rank, rc->W);
    vsnprintf(rc->err + n, sizeof rc->err - (size_t)n, fmt, ap);
    va_end(ap);
    return 1;
}

#define RK_OK(rc, expr)                                                                                  \
    do {                                                                                                 \
        ts_status s_ = (expr);                                                                           \
        if (s_ != TS_OK) return fail((rc), "%s -> %s: %s", #expr, ts_status_name(s_), ts_last_error()); \
    } while (0)

static void *rank_main(void *arg)
{
    rank_ctx *rc = arg;
    rc->fn(rc);
    return NULL;
}

static double g_timeout = 30.0;

/* Runs fn on W ranks; asserts that none failed. */
static void run_world(int W, rank_fn fn, void *arg)
{
    ts_loopback_fabric *f = NULL;
    TH_OK(ts__loopback_fabric_new(W, &f));
    rank_ctx rc[MAXW];
    pthread_t th[MAXW];
    memset(rc, 0, sizeof rc);
    for (int i = 0; i < W; i++) {
        ts_transport *t = NULL;
        TH_OK(ts__loopback_transport_new(f, i, &t));
        rc[i] = (rank_ctx){.rank = i, .W = W, .f = f, .fn = fn, .arg = arg};
        TH_OK(ts__world_new(t, g_timeout, &rc[i].c));
        cr_assert_eq(ts_comm_rank(rc[i].c), i);
        cr_assert_eq(ts_comm_size(rc[i].c), W);
    }
    for (int i = 0; i < W; i++) cr_assert_eq(pthread_create(&th[i], NULL, rank_main, &rc[i]), 0);
    for (int i = 0; i < W; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < W; i++) ts__world_free(rc[i].c);
    ts__loopback_fabric_free(f);
    for (int i = 0; i < W; i++) cr_assert_eq(rc[i].err[0], '\0', "W=%d: %s", W, rc[i].err);
}

static const ts_dtype k_dtypes[] = {TS_F32, TS_F64, TS_BF16, TS_F16, TS_I64};
#define NDT ((int)(sizeof k_dtypes / sizeof k_dtypes[0]))

static double get_d(const ts_tensor *t, int64_t i)
{
    const void *p = ts_tensor_data(t);
    switch (ts_tensor_dtype(t)) {
    case TS_F32: return ((const float *)p)[i];
    case TS_F64: return ((const double *)p)[i];
    case TS_BF16: return ts_bf16_to_f32(((const uint16_t *)p)[i]);
    case TS_F16: return ts_f16_to_f32(((const uint16_t *)p)[i]);
    case TS_I64: return (double)((const int64_t *)p)[i];
    case TS_I32: return ((const int32_t *)p)[i];
    case TS_BOOL: return ((const uint8_t *)p)[i];
    default: return NAN;
    }
}

static ts_tensor *vec(rank_ctx *rc, ts_dtype d, int64_t n, double (*val)(int rank, int64_t i), int rank)
{
    double *v = malloc(sizeof(double) * (size_t)(n ? n : 1));
    for (int64_t i = 0; i < n; i++) v[i] = val(rank, i);
    ts_tensor *t = NULL;
    int64_t shape[1] = {n};
    if (ts_tensor_empty(d, 1, shape, &t) != TS_OK) {
        free(v);
        fail(rc, "ts_tensor_empty: %s", ts_last_error());
        return NULL;
    }
    void *p = ts_tensor_data(t);
    for (int64_t i = 0; i < n; i++) {
        switch (d) {
        case TS_F32: ((float *)p)[i] = (float)v[i]; break;
        case TS_F64: ((double *)p)[i] = v[i]; break;
        case TS_BF16: ((uint16_t *)p)[i] = ts_f32_to_bf16((float)v[i]); break;
        case TS_F16: ((uint16_t *)p)[i] = ts_f32_to_f16((float)v[i]); break;
        case TS_I64: ((int64_t *)p)[i] = (int64_t)v[i]; break;
        case TS_I32: ((int32_t *)p)[i] = (int32_t)v[i]; break;
        case TS_BOOL: ((uint8_t *)p)[i] = v[i] != 0; break;
        default: break;
        }
    }
    free(v);
    return t;
}

/* Relative tolerance of a dtype's rounding (one rounding of the result,
 * plus f32 accumulation for the half types). */
static double tol(ts_dtype d)
{
    switch (d) {
    case TS_BF16: return 1.0 / 128;
    case TS_F16: return 1.0 / 1024;
    case TS_F32: return 1e-6;
    case TS_F64: return 1e-14;
    default: return 0;
    }
}

static int check_close(rank_ctx *rc, const char *what, const ts_tensor *t, int64_t i, double want)
{
    double got = get_d(t, i);
    double tl = tol(ts_tensor_dtype(t)) * fmax(1.0, fabs(want));
    if (ts_tensor_dtype(t) == TS_I64 ? got != want : !(fabs(got - want) <= tl))
        return fail(rc, "%s %s [%lld]: got %.9g, want %.9g", what, ts_dtype_name(ts_tensor_dtype(t)), (long long)i, got,
                    want);
    return 0;
}

/* ------------------------------------------------------------------ */

static double ag_val(int rank, int64_t i) { return rank * 8 + (double)(i % 8) - 3; }

static int rank_all_gather(rank_ctx *rc)
{
    const int64_t n = 5;
    for (int k = 0; k < NDT + 2; k++) {
        ts_dtype d = k < NDT ? k_dtypes[k] : (k == NDT ? TS_I32 : TS_BOOL);
        ts_tensor *in = vec(rc, d, n, ag_val, rc->rank);
        ts_tensor *out = NULL;
        int64_t shape[2] = {rc->W, n};
        RK_OK(rc, ts_tensor_zeros(d, 2, shape, &out));
        RK_OK(rc, ts_all_gather_into_tensor(rc->c, out, in, NULL));
        for (int r = 0; r < rc->W; r++) {
            for (int64_t i = 0; i < n; i++) {
                double want = d == TS_BOOL ? ag_val(r, i) != 0 : ag_val(r, i);
                if (check_close(rc, "all_gather", out, r * n + i, want)) return 1;
            }
        }
        ts_tensor_free(in);
        ts_tensor_free(out);
    }
    /* shape and dtype errors are caught before submission */
    ts_tensor *a = vec(rc, TS_F32, 3, ag_val, 0), *b = vec(rc, TS_F32, 4, ag_val, 0), *e = vec(rc, TS_F64, 3, ag_val, 0);
    if (rc->W > 1 && ts_all_gather_into_tensor(rc->c, b, a, NULL) != TS_ERR_SHAPE) return fail(rc, "no shape error");
    if (ts_all_gather_into_tensor(rc->c, e, a, NULL) != TS_ERR_DTYPE) return fail(rc, "no dtype error");
    ts_tensor_free(a);
    ts_tensor_free(b);
    ts_tensor_free(e);
    return 0;
}

/* reduce-scatter input on `rank`: W blocks of n; small signed integers */
static double rs_val(int rank, int64_t i) { return (double)((rank * 7 + i * 3) % 11) - 5; }

static double trunc_div(ts_dtype d, double v, double div) { return d == TS_I64 ? trunc(v / div) : v / div; }

static double reduce_ref(ts_dtype d, ts_reduce_op op, int W, int64_t idx, double pre, double post)
{
    double acc = 0;
    for (int r = 0; r < W; r++) {
        double v = trunc_div(d, rs_val(r, idx), pre);
        if (r == 0) acc = v;
        else if (op == TS_REDUCE_MAX) acc = fmax(acc, v);
        else if (op == TS_REDUCE_MIN) acc = fmin(acc, v);
        else acc += v;
    }
    if (op == TS_REDUCE_AVG) post *= W;
    return trunc_div(d, acc, post);
}

static int rank_reduce_scatter(rank_ctx *rc)
{
    const int64_t n = 5;
    const ts_reduce_op ops[] = {TS_REDUCE_SUM, TS_REDUCE_AVG, TS_REDUCE_MAX, TS_REDUCE_MIN};
    for (int k = 0; k < NDT; k++) {
        ts_dtype d = k_dtypes[k];
        for (int oi = 0; oi < 4; oi++) {
            for (int f = 0; f < 2; f++) {
                if (f && (ops[oi] == TS_REDUCE_MAX || ops[oi] == TS_REDUCE_MIN)) continue;
                double pre = f ? 2.0 : 1.0, post = f ? 1.5 : 1.0;
                ts_tensor *in = vec(rc, d, n * rc->W, rs_val, rc->rank);
                ts_tensor *out = NULL;
                int64_t shape[1] = {n};
                RK_OK(rc, ts_tensor_zeros(d, 1, shape, &out));
                RK_OK(rc, ts_reduce_scatter_tensor(rc->c, out, in, ops[oi], pre, post, NULL));
                for (int64_t i = 0; i < n; i++) {
                    double want = reduce_ref(d, ops[oi], rc->W, rc->rank * n + i, pre, post);
                    if (check_close(rc, "reduce_scatter", out, i, want)) return 1;
                }
                ts_tensor_free(in);
                ts_tensor_free(out);
            }
        }
    }
    ts_tensor *a = vec(rc, TS_F32, 2, rs_val, 0), *b = vec(rc, TS_F32, 2 * rc->W, rs_val, 0);
    if (ts_reduce_scatter_tensor(rc->c, a, b, TS_REDUCE_MAX, 2.0, 1.0, NULL) != TS_ERR_INVALID_ARGUMENT)
        return fail(rc, "MAX accepted a divide factor");
    ts_tensor *bo = vec(rc, TS_BOOL, 2, rs_val, 0), *bi = vec(rc, TS_BOOL, 2 * rc->W, rs_val, 0);
    if (ts_reduce_scatter_tensor(rc->c, bo, bi, TS_REDUCE_SUM, 1.0, 1.0, NULL) != TS_ERR_DTYPE)
        return fail(rc, "bool reduced");
    ts_tensor_free(a);
    ts_tensor_free(b);
    ts_tensor_free(bo);
    ts_tensor_free(bi);
    return 0;
}

static int rank_all_reduce(rank_ctx *rc)
{
    const int64_t sizes[] = {7, 1, 0, 13};
    const ts_reduce_op ops[] = {TS_REDUCE_SUM, TS_REDUCE_AVG, TS_REDUCE_MAX, TS_REDUCE_MIN};
    for (int k = 0; k < NDT; k++) {
        ts_dtype d = k_dtypes[k];
        for (int oi = 0; oi < 4; oi++) {
            for (int si = 0; si < 4; si++) {
                int64_t n = sizes[si];
                ts_tensor *t = vec(rc, d, n, rs_val, rc->rank);
                RK_OK(rc, ts_all_reduce(rc->c, t, ops[oi], NULL));
                for (int64_t i = 0; i < n; i++)
                    if (check_close(rc, "all_reduce", t, i, reduce_ref(d, ops[oi], rc->W, i, 1.0, 1.0))) return 1;
                ts_tensor_free(t);
            }
        }
    }
    return 0;
}

static double bc_val(int rank, int64_t i) { return rank == 0 ? (double)(i + 1) : -(double)(rank + 1); }
static double bc_val_root(int rank, int64_t i) { return (double)(i + 1 + rank); }

static int rank_broadcast(rank_ctx *rc)
{
    const ts_dtype ds[] = {TS_F32, TS_I64, TS_BOOL, TS_BF16};
    for (int root = 0; root < rc->W; root++) {
        for (int k = 0; k < 4; k++) {
            ts_tensor *t = vec(rc, ds[k], 6, rc->rank == root ? bc_val_root : bc_val, rc->rank == root ? root : rc->rank + 10);
            RK_OK(rc, ts_broadcast(rc->c, t, root, NULL));
            for (int64_t i = 0; i < 6; i++) {
                double want = ds[k] == TS_BOOL ? 1.0 : bc_val_root(root, i);
                if (check_close(rc, "broadcast", t, i, want)) return 1;
            }
            ts_tensor_free(t);
        }
    }
    ts_tensor *t = vec(rc, TS_F32, 1, bc_val, 0);
    if (ts_broadcast(rc->c, t, rc->W, NULL) != TS_ERR_INVALID_ARGUMENT) return fail(rc, "bad root accepted");
    ts_tensor_free(t);
    return 0;
}

static int rank_barrier(rank_ctx *rc)
{
    for (int i = 0; i < 20; i++) RK_OK(rc, ts_barrier(rc->c, NULL));
    return 0;
}

Test(comm_collectives, all_gather_every_dtype, .timeout = 60)
{
    th_mem_mark();
    for (int W = 1; W <= 4; W++) run_world(W, rank_all_gather, NULL);
    th_mem_assert_back();
}

Test(comm_collectives, reduce_scatter_every_dtype_and_op, .timeout = 60)
{
    th_mem_mark();
    for (int W = 1; W <= 4; W++) run_world(W, rank_reduce_scatter, NULL);
    th_mem_assert_back();
}

Test(comm_collectives, all_reduce_uneven_sizes, .timeout = 60)
{
    th_mem_mark();
    for (int W = 1; W <= 4; W++) run_world(W, rank_all_reduce, NULL);
    th_mem_assert_back();
}

Test(comm_collectives, broadcast_from_every_root, .timeout = 60)
{
    th_mem_mark();
    for (int W = 1; W <= 4; W++) run_world(W, rank_broadcast, NULL);
    th_mem_assert_back();
}

Test(comm_collectives, barrier, .timeout = 60)
{
    th_mem_mark();
    for (int W = 1; W <= 4; W++) run_world(W, rank_barrier, NULL);
    th_mem_assert_back();
}

/* all-gather then reduce-scatter (SUM) returns the shard times W */
static int rank_ag_rs_identity(rank_ctx *rc)
{
    const int64_t n = 9;
    ts_tensor *shard = vec(rc, TS_F32, n, ag_val, rc->rank), *full = NULL, *back = NULL;
    int64_t sf[1] = {n * rc->W}, sb[1] = {n};
    RK_OK(rc, ts_tensor_empty(TS_F32, 1, sf, &full));
    RK_OK(rc, ts_tensor_empty(TS_F32, 1, sb, &back));
    RK_OK(rc, ts_all_gather_into_tensor(rc->c, full, shard, NULL));
    RK_OK(rc, ts_reduce_scatter_tensor(rc->c, back, full, TS_REDUCE_SUM, 1.0, 1.0, NULL));
    for (int64_t i = 0; i < n; i++)
        if (check_close(rc, "ag+rs", back, i, ag_val(rc->rank, i) * rc->W)) return 1;
    ts_tensor_free(shard);
    ts_tensor_free(full);
    ts_tensor_free(back);
    return 0;
}

Test(comm_collectives, all_gather_then_reduce_scatter_is_w_times_shard, .timeout = 60)
{
    for (int W = 1; W <= 4; W++) run_world(W, rank_ag_rs_identity, NULL);
}

/* ------------------------------------------------------------------ */

static double wall_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int rank_async(rank_ctx *rc)
{
    ts_tensor *t = vec(rc, TS_F64, 10, rs_val, rc->rank);
    ts_request *r = NULL;
    RK_OK(rc, ts_all_reduce(rc->c, t, TS_REDUCE_SUM, &r));
    /* ~200 ms of arithmetic without calling the library */
    volatile double x = 0;
    double t0 = wall_s();
    while (wall_s() - t0 < 0.2)
        for (int i = 0; i < 10000; i++) x = x + 1e-9 * i;
    bool done = false;
    RK_OK(rc, ts_request_test(r, &done));
    if (!done) return fail(rc, "the all-reduce did not progress while the caller computed");
    RK_OK(rc, ts_request_status(r));
    for (int64_t i = 0; i < 10; i++)
        if (check_close(rc, "async all_reduce", t, i, reduce_ref(TS_F64, TS_REDUCE_SUM, rc->W, i, 1, 1))) return 1;
    RK_OK(rc, ts_request_wait(r));
    ts_request_free(r);
    /* several in flight at once complete in order of submission */
    ts_tensor *a = vec(rc, TS_F32, 5, rs_val, rc->rank), *b = vec(rc, TS_F32, 5, rs_val, rc->rank);
    ts_request *ra = NULL, *rb = NULL, *rbar = NULL;
    RK_OK(rc, ts_all_reduce(rc->c, a, TS_REDUCE_MAX, &ra));
    RK_OK(rc, ts_all_reduce(rc->c, b, TS_REDUCE_MIN, &rb));
    RK_OK(rc, ts_barrier(rc->c, &rbar));
    if (ts_request_status(rbar) != TS_OK && ts_request_status(rbar) != TS_ERR_STATE) return fail(rc, "bad status");
    RK_OK(rc, ts_request_wait(rbar));
    RK_OK(rc, ts_request_wait(rb));
    RK_OK(rc, ts_request_wait(ra));
    for (int64_t i = 0; i < 5; i++) {
        if (check_close(rc, "max", a, i, reduce_ref(TS_F32, TS_REDUCE_MAX, rc->W, i, 1, 1))) return 1;
        if (check_close(rc, "min", b, i, reduce_ref(TS_F32, TS_REDUCE_MIN, rc->W, i, 1, 1))) return 1;
    }
    ts_request_free(ra);
    ts_request_free(rb);
    ts_request_free(rbar);
    ts_tensor_free(a);
    ts_tensor_free(b);
    ts_tensor_free(t);
    return 0;
}

Test(comm_collectives, requests_progress_while_the_caller_computes, .timeout = 60)
{
    th_mem_mark();
    for (int W = 2; W <= 4; W++) run_world(W, rank_async, NULL);
    th_mem_assert_back();
}

static int rank_counters(rank_ctx *rc)
{
    ts_comm_stats_reset(rc->c);
    ts_tensor *in = vec(rc, TS_F32, 4, ag_val, rc->rank), *out = NULL, *big = NULL;
    int64_t s[1] = {4 * rc->W};
    RK_OK(rc, ts_tensor_empty(TS_F32, 1, s, &out));
    RK_OK(rc, ts_tensor_empty(TS_F32, 1, s, &big));
    memset(ts_tensor_data(big), 0, (size_t)(4 * rc->W) * 4);
    for (int i = 0; i < 3; i++) RK_OK(rc, ts_all_gather_into_tensor(rc->c, out, in, NULL));
    RK_OK(rc, ts_reduce_scatter_tensor(rc->c, in, big, TS_REDUCE_SUM, 1, 1, NULL));
    RK_OK(rc, ts_all_reduce(rc->c, in, TS_REDUCE_SUM, NULL));
    RK_OK(rc, ts_broadcast(rc->c, in, 0, NULL));
    RK_OK(rc, ts_barrier(rc->c, NULL));
    ts_comm_counters k;
    ts_comm_stats(rc->c, &k);
    const uint64_t calls[TS_COLL_KIND_COUNT] = {3, 1, 1, 1, 1};
    const uint64_t bytes[TS_COLL_KIND_COUNT] = {3 * 16, (uint64_t)(16 * rc->W), 16, 16, 0};
    for (int i = 0; i < TS_COLL_KIND_COUNT; i++) {
        if (k.calls[i] != calls[i]) return fail(rc, "calls[%d] = %llu", i, (unsigned long long)k.calls[i]);
        if (k.bytes[i] != bytes[i]) return fail(rc, "bytes[%d] = %llu", i, (unsigned long long)k.bytes[i]);
    }
    ts_comm_stats_reset(rc->c);
    ts_comm_stats(rc->c, &k);
    for (int i = 0; i < TS_COLL_KIND_COUNT; i++)
        if (k.calls[i] || k.bytes[i]) return fail(rc, "not reset");
    ts_tensor_free(in);
    ts_tensor_free(out);
    ts_tensor_free(big);
    return 0;
}

Test(comm_collectives, counters_per_group, .timeout = 60)
{
    for (int W = 1; W <= 3; W++) run_world(W, rank_counters, NULL);
}

/* ------------------------------------------------------------------ */

/* Rank W-1 dies after a first barrier; the survivors' next collectives
 * fail with TS_ERR_PEER_FAILED naming it, well within the deadline. */
static int rank_killed(rank_ctx *rc)
{
    RK_OK(rc, ts_barrier(rc->c, NULL));
    int dead = rc->W - 1;
    if (rc->rank == dead) {
        ts__loopback_kill(rc->f, dead, 0.2);
        return 0;
    }
    ts_tensor *t = vec(rc, TS_F32, 64, rs_val, rc->rank);
    double t0 = wall_s();
    ts_request *r = NULL;
    RK_OK(rc, ts_all_reduce(rc->c, t, TS_REDUCE_SUM, &r));
    ts_status s = ts_request_wait(r);
    double dt = wall_s() - t0;
    if (s != TS_ERR_PEER_FAILED) return fail(rc, "all_reduce -> %s, want TS_ERR_PEER_FAILED", ts_status_name(s));
    char want[32];
    snprintf(want, sizeof want, "rank %d", dead);
    if (!strstr(ts_last_error(), want)) return fail(rc, "the error does not name the rank: %s", ts_last_error());
    if (dt > 3.0) return fail(rc, "failure took %.2f s", dt);
    ts_request_free(r);
    /* later collectives fail at once */
    t0 = wall_s();
    s = ts_barrier(rc->c, NULL);
    if (s != TS_ERR_PEER_FAILED) return fail(rc, "later barrier -> %s", ts_status_name(s));
    s = ts_all_gather_into_tensor(rc->c, t, t, NULL);
    if (s != TS_ERR_SHAPE && s != TS_ERR_PEER_FAILED) return fail(rc, "later all_gather -> %s", ts_status_name(s));
    if (wall_s() - t0 > 1.0) return fail(rc, "later collectives took %.2f s", wall_s() - t0);
    ts_tensor_free(t);
    return 0;
}

Test(comm_collectives, killed_rank_fails_survivors, .timeout = 60)
{
    th_mem_mark();
    g_timeout = 10.0;
    for (int W = 2; W <= 4; W++) run_world(W, rank_killed, NULL);
    g_timeout = 30.0;
    th_mem_assert_back();
}

/* A rank that never joins: the deadline fails the collective. */
static int rank_deadline(rank_ctx *rc)
{
    if (rc->rank == 1) return 0;
    ts_tensor *t = vec(rc, TS_F32, 8, rs_val, rc->rank);
    double t0 = wall_s();
    ts_status s = ts_all_reduce(rc->c, t, TS_REDUCE_SUM, NULL);
    double dt = wall_s() - t0;
    if (s != TS_ERR_TIMEOUT) return fail(rc, "all_reduce -> %s, want TS_ERR_TIMEOUT", ts_status_name(s));
    if (dt < 0.29 || dt > 2.0) return fail(rc, "deadline after %.2f s", dt);
    s = ts_barrier(rc->c, NULL);
    if (s != TS_ERR_TIMEOUT) return fail(rc, "later barrier -> %s", ts_status_name(s));
    ts_tensor_free(t);
    return 0;
}

Test(comm_collectives, deadline_fails_a_hung_collective, .timeout = 60)
{
    th_mem_mark();
    g_timeout = 0.3;
    run_world(2, rank_deadline, NULL);
    g_timeout = 30.0;
    th_mem_assert_back();
}

/* ------------------------------------------------------------------ */

Test(comm_collectives, one_rank_world_without_init, .timeout = 60)
{
    ts_comm *c = ts_comm_world();
    cr_assert_not_null(c);
    cr_assert_eq(ts_comm_rank(c), 0);
    cr_assert_eq(ts_comm_size(c), 1);
    rank_ctx rc = {.rank = 0, .W = 1, .c = c};
    cr_assert_eq(rank_all_gather(&rc), 0, "%s", rc.err);
    cr_assert_eq(rank_reduce_scatter(&rc), 0, "%s", rc.err);
    cr_assert_eq(rank_all_reduce(&rc), 0, "%s", rc.err);
    cr_assert_eq(rank_broadcast(&rc), 0, "%s", rc.err);
    cr_assert_eq(rank_barrier(&rc), 0, "%s", rc.err);
    ts_tensor *t = th_seq(TS_F32, 1, (int64_t[]){4}, 1.0, false);
    ts_request *r = NULL;
    TH_OK(ts_all_reduce(c, t, TS_REDUCE_SUM, &r));
    bool done = false;
    TH_OK(ts_request_test(r, &done));
    cr_assert(done);
    TH_OK(ts_request_wait(r));
    ts_request_free(r);
    ts_tensor_free(t);
    cr_assert_eq(ts_request_status(NULL), TS_ERR_INVALID_ARGUMENT);
    ts_request_free(NULL);
}
