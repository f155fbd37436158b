#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "tests/loopback_ranks.h"

/* Collectives over the loopback fabric: W ranks as threads of this test,
 * each with its own world (and communication thread). Rank threads never
 * call cr_assert (Criterion's asserts belong to the test's thread): they
 * write the first failure into their slot and the test asserts on it.
 *
 * Values are small integers, exact in every dtype (bf16 keeps 8
 * significant bits), so sums and max/min compare exactly; only divisions
 * (AVG, divide factors) get a tolerance: the dtype's rounding. */

#define MAXW TH_MAXW
typedef th_rank rank_ctx;
typedef th_rank_fn rank_fn;
#define fail th_rank_fail
#define RK_OK TH_RK_OK

static double g_timeout = 30.0;

/* Runs fn on W ranks; asserts that none failed. */
static void run_world(int W, rank_fn fn, void *arg) { th_run_world(W, fn, arg, g_timeout); }

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
    ts_tensor *a = vec(rc, TS_F32, 3, ag_val, 0), *b = vec(rc, TS_F32, 4, ag_val, 0),
              *e = vec(rc, TS_F64, 3, ag_val, 0);
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
            ts_tensor *t =
                vec(rc, ds[k], 6, rc->rank == root ? bc_val_root : bc_val, rc->rank == root ? root : rc->rank + 10);
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

/* Both collectives in place, as FSDP calls them: the all-gather's input is
 * out's own block, the reduce-scatter's output is in's own block (bf16
 * too, whose accumulation goes through f32). A reduce-scatter output that
 * overlaps another part of its input is refused. */
static int rank_in_place(rank_ctx *rc)
{
    const int64_t n = 5;
    int64_t sf[1] = {n * rc->W};
    ts_dtype dts[2] = {TS_F32, TS_BF16};
    for (int di = 0; di < 2; di++) {
        ts_tensor *full = NULL, *own = NULL;
        RK_OK(rc, ts_tensor_empty(dts[di], 1, sf, &full));
        RK_OK(rc, ts_narrow(full, 0, rc->rank * n, n, &own));
        ts_tensor *src = vec(rc, dts[di], n, ag_val, rc->rank);
        RK_OK(rc, ts_tensor_copy_(own, src));
        RK_OK(rc, ts_all_gather_into_tensor(rc->c, full, own, NULL));
        for (int r = 0; r < rc->W; r++)
            for (int64_t i = 0; i < n; i++)
                if (check_close(rc, "in-place ag", full, r * n + i, ag_val(r, i))) return 1;
        /* every rank now holds the same full tensor: the sum is W times it */
        RK_OK(rc, ts_reduce_scatter_tensor(rc->c, own, full, TS_REDUCE_SUM, 1.0, 1.0, NULL));
        for (int64_t i = 0; i < n; i++)
            if (check_close(rc, "in-place rs", own, i, ag_val(rc->rank, i) * rc->W)) return 1;
        ts_tensor_free(src);
        ts_tensor_free(own);
        ts_tensor_free(full);
    }
    if (rc->W > 1) {
        ts_tensor *full = NULL, *other = NULL;
        RK_OK(rc, ts_tensor_empty(TS_F32, 1, sf, &full));
        RK_OK(rc, ts_narrow(full, 0, ((rc->rank + 1) % rc->W) * n, n, &other));
        if (ts_reduce_scatter_tensor(rc->c, other, full, TS_REDUCE_SUM, 1.0, 1.0, NULL) != TS_ERR_INVALID_ARGUMENT ||
            !strstr(ts_last_error(), "overlaps"))
            return th_rank_fail(rc, "an output over another rank's block was not refused: %s", ts_last_error());
        ts_tensor_free(other);
        ts_tensor_free(full);
    }
    return 0;
}

Test(comm_collectives, all_gather_and_reduce_scatter_in_place, .timeout = 60)
{
    for (int W = 1; W <= 4; W++) run_world(W, rank_in_place, NULL);
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
 * fail with TS_ERR_PEER_FAILED naming it, well within the deadline. It
 * dies only once every survivor has left that barrier: a rank may leave a
 * barrier before its messages to the others were received, and a kill
 * drops those (on a loaded machine the survivors' first barrier then
 * failed instead of the collectives after it). */
static atomic_int g_left_first_barrier;
static int rank_killed(rank_ctx *rc)
{
    RK_OK(rc, ts_barrier(rc->c, NULL));
    int dead = rc->W - 1;
    if (rc->rank == dead) {
        double t0 = wall_s();
        while (atomic_load(&g_left_first_barrier) < rc->W - 1 && wall_s() - t0 < 5.0) sched_yield();
        ts__loopback_kill(rc->f, dead, 0.2);
        return 0;
    }
    atomic_fetch_add(&g_left_first_barrier, 1);
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
    for (int W = 2; W <= 4; W++) {
        atomic_store(&g_left_first_barrier, 0);
        run_world(W, rank_killed, NULL);
    }
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

/* ------------------------------------------------------------------ */
/* Subgroups, list all-gather, all-to-all, send/recv                   */
/* ------------------------------------------------------------------ */

static const int k_g01[] = {0, 1}, k_g23[] = {2, 3}, k_g123[] = {1, 2, 3}, k_g02[] = {0, 2};

static int index_of(const int *ranks, int n, int r)
{
    for (int i = 0; i < n; i++)
        if (ranks[i] == r) return i;
    return -1;
}

/* Makes a group of world and checks membership, rank and size. */
static int make_group(rank_ctx *rc, ts_comm *parent, int prank, int n, const int *ranks, ts_comm **g)
{
    RK_OK(rc, ts_comm_new_group(parent, n, ranks, g));
    int me = index_of(ranks, n, prank);
    if (me < 0) {
        if (*g) return fail(rc, "a non-member got a group");
        return 0;
    }
    if (!*g) return fail(rc, "a member got no group");
    if (ts_comm_rank(*g) != me || ts_comm_size(*g) != n)
        return fail(rc, "group rank %d size %d, want %d %d", ts_comm_rank(*g), ts_comm_size(*g), me, n);
    return 0;
}

static double grp_val(int wrank, int64_t i) { return (double)((wrank * 5 + i * 3) % 13) - 6; }

/* Sum over the world ranks in members of grp_val(r, i) + bias*r. */
static double grp_sum(const int *members, int n, int64_t i)
{
    double s = 0;
    for (int k = 0; k < n; k++) s += grp_val(members[k], i);
    return s;
}

typedef struct grp_case {
    const int *ranks;
    int n;
    ts_comm *g;
    ts_tensor *ar, *ag_in, *ag_out, *bc;
    ts_request *r[3];
} grp_case;

/* 4 ranks: groups {0,1}, {2,3}, {1,2,3}, {0,2} run all-reduce, all-gather
 * and broadcast concurrently with world all-reduces; odd ranks submit
 * their group collectives before the world's, even ranks after. Results
 * against sequential references. Then a subgroup of {1,2,3}. */
static int rank_subgroups(rank_ctx *rc)
{
    enum { N = 37, ITERS = 6 };
    grp_case gc[4] = {
        {.ranks = k_g01, .n = 2}, {.ranks = k_g23, .n = 2}, {.ranks = k_g123, .n = 3}, {.ranks = k_g02, .n = 2}};
    for (int k = 0; k < 4; k++)
        if (make_group(rc, rc->c, rc->rank, gc[k].n, gc[k].ranks, &gc[k].g)) return 1;
    static const int all[] = {0, 1, 2, 3};
    for (int it = 0; it < ITERS; it++) {
        ts_tensor *w = vec(rc, TS_F32, N, grp_val, rc->rank);
        ts_request *wr = NULL;
        if (rc->rank % 2 == 0) RK_OK(rc, ts_all_reduce(rc->c, w, TS_REDUCE_SUM, &wr));
        for (int k = 0; k < 4; k++) {
            grp_case *g = &gc[k];
            if (!g->g) continue;
            int64_t s[1] = {(int64_t)g->n * 3};
            g->ar = vec(rc, k == 1 ? TS_I64 : TS_F64, N, grp_val, rc->rank);
            g->ag_in = vec(rc, TS_F32, 3, ag_val, rc->rank);
            RK_OK(rc, ts_tensor_zeros(TS_F32, 1, s, &g->ag_out));
            g->bc = vec(rc, TS_F32, N, bc_val_root, rc->rank);
            RK_OK(rc, ts_all_reduce(g->g, g->ar, TS_REDUCE_SUM, &g->r[0]));
            RK_OK(rc, ts_all_gather_into_tensor(g->g, g->ag_out, g->ag_in, &g->r[1]));
            RK_OK(rc, ts_broadcast(g->g, g->bc, g->n - 1, &g->r[2]));
        }
        if (rc->rank % 2 == 1) RK_OK(rc, ts_all_reduce(rc->c, w, TS_REDUCE_SUM, &wr));
        RK_OK(rc, ts_request_wait(wr));
        ts_request_free(wr);
        for (int64_t i = 0; i < N; i++)
            if (check_close(rc, "world all_reduce", w, i, grp_sum(all, 4, i))) return 1;
        ts_tensor_free(w);
        for (int k = 0; k < 4; k++) {
            grp_case *g = &gc[k];
            if (!g->g) continue;
            for (int j = 0; j < 3; j++) {
                RK_OK(rc, ts_request_wait(g->r[j]));
                ts_request_free(g->r[j]);
            }
            for (int64_t i = 0; i < N; i++) {
                if (check_close(rc, "group all_reduce", g->ar, i, grp_sum(g->ranks, g->n, i))) return 1;
                /* the root is group rank n-1: world rank ranks[n-1] */
                if (check_close(rc, "group broadcast", g->bc, i, bc_val_root(g->ranks[g->n - 1], i))) return 1;
            }
            for (int m = 0; m < g->n; m++)
                for (int64_t i = 0; i < 3; i++)
                    if (check_close(rc, "group all_gather", g->ag_out, m * 3 + i, ag_val(g->ranks[m], i))) return 1;
            ts_tensor_free(g->ar);
            ts_tensor_free(g->ag_in);
            ts_tensor_free(g->ag_out);
            ts_tensor_free(g->bc);
        }
    }
    /* a subgroup of a subgroup: {0, 2} of {1,2,3} is world {1, 3} */
    if (gc[2].g) {
        static const int sub[] = {0, 2}, sub_world[] = {1, 3};
        ts_comm *s = NULL;
        if (make_group(rc, gc[2].g, ts_comm_rank(gc[2].g), 2, sub, &s)) return 1;
        ts_tensor *t = vec(rc, TS_F32, N, grp_val, rc->rank);
        if (s) {
            RK_OK(rc, ts_all_reduce(s, t, TS_REDUCE_SUM, NULL));
            for (int64_t i = 0; i < N; i++)
                if (check_close(rc, "nested all_reduce", t, i, grp_sum(sub_world, 2, i))) return 1;
        }
        /* the parent still works after its child took an id */
        RK_OK(rc, ts_barrier(gc[2].g, NULL));
        ts_tensor_free(t);
        ts_comm_free(s);
    }
    RK_OK(rc, ts_barrier(rc->c, NULL));
    for (int k = 0; k < 4; k++) ts_comm_free(gc[k].g);
    return 0;
}

Test(comm_groups, subgroups_run_concurrently_with_the_world, .timeout = 120)
{
    th_mem_mark();
    run_world(4, rank_subgroups, NULL);
    th_mem_assert_back();
}

/* Singleton groups, and the one-rank world without init. */
static int rank_singletons(rank_ctx *rc)
{
    for (int r = 0; r < rc->W; r++) {
        ts_comm *g = NULL;
        int one[1] = {r};
        if (make_group(rc, rc->c, rc->rank, 1, one, &g)) return 1;
        if (g) {
            ts_tensor *t = vec(rc, TS_F32, 4, grp_val, rc->rank);
            RK_OK(rc, ts_all_reduce(g, t, TS_REDUCE_SUM, NULL));
            for (int64_t i = 0; i < 4; i++)
                if (check_close(rc, "singleton all_reduce", t, i, grp_val(rc->rank, i))) return 1;
            ts_tensor_free(t);
        }
        ts_comm_free(g);
    }
    /* the whole world, reversed: group rank i is world rank W-1-i */
    int rev[MAXW];
    for (int i = 0; i < rc->W; i++) rev[i] = rc->W - 1 - i;
    ts_comm *g = NULL;
    if (make_group(rc, rc->c, rc->rank, rc->W, rev, &g)) return 1;
    ts_tensor *t = vec(rc, TS_F64, 6, grp_val, rc->rank);
    RK_OK(rc, ts_broadcast(g, t, 0, NULL));
    for (int64_t i = 0; i < 6; i++)
        if (check_close(rc, "reversed broadcast", t, i, grp_val(rc->W - 1, i))) return 1;
    ts_tensor_free(t);
    ts_comm_free(g);
    return 0;
}

Test(comm_groups, singleton_and_reordered_groups, .timeout = 60)
{
    th_mem_mark();
    for (int W = 1; W <= 4; W++) run_world(W, rank_singletons, NULL);
    rank_ctx rc = {.rank = 0, .W = 1, .c = ts_comm_world()};
    cr_assert_eq(rank_singletons(&rc), 0, "%s", rc.err);
    th_mem_assert_back();
}

static int rank_group_errors(rank_ctx *rc)
{
    ts_comm *g = (ts_comm *)rc; /* must be reset to NULL */
    int dup[3] = {0, 1, 0};
    if (rc->W > 1) {
        if (ts_comm_new_group(rc->c, 3, dup, &g) != TS_ERR_INVALID_ARGUMENT || g) return fail(rc, "duplicate accepted");
        if (!strstr(ts_last_error(), "rank 0 appears twice")) return fail(rc, "message: %s", ts_last_error());
    }
    int out_of_range[2] = {0, rc->W};
    g = (ts_comm *)rc;
    if (ts_comm_new_group(rc->c, 2, out_of_range, &g) != TS_ERR_INVALID_ARGUMENT || g)
        return fail(rc, "out of range accepted");
    char want[32];
    snprintf(want, sizeof want, "rank %d", rc->W);
    if (!strstr(ts_last_error(), want)) return fail(rc, "message: %s", ts_last_error());
    int neg[1] = {-1};
    if (ts_comm_new_group(rc->c, 1, neg, &g) != TS_ERR_INVALID_ARGUMENT) return fail(rc, "-1 accepted");
    if (ts_comm_new_group(rc->c, 0, neg, &g) != TS_ERR_INVALID_ARGUMENT) return fail(rc, "n = 0 accepted");
    if (ts_comm_new_group(rc->c, 1, NULL, &g) != TS_ERR_INVALID_ARGUMENT) return fail(rc, "NULL ranks accepted");
    if (ts_comm_new_group(rc->c, 1, neg, NULL) != TS_ERR_INVALID_ARGUMENT) return fail(rc, "NULL out accepted");
    if (ts_comm_new_group(NULL, 1, neg, &g) != TS_ERR_INVALID_ARGUMENT) return fail(rc, "NULL parent accepted");
    ts_comm_free(NULL);
    ts_comm_free(rc->c); /* a world: ignored */
    /* the world still works after the errors */
    RK_OK(rc, ts_barrier(rc->c, NULL));
    return 0;
}

Test(comm_groups, bad_rank_lists, .timeout = 60)
{
    th_mem_mark();
    for (int W = 1; W <= 3; W++) run_world(W, rank_group_errors, NULL);
    th_mem_assert_back();
}

/* ------------------------------------------------------------------ */

static int rank_all_gather_list(rank_ctx *rc)
{
    const int64_t n = 7;
    const ts_dtype ds[] = {TS_F32, TS_I64, TS_BF16, TS_I32, TS_BOOL};
    for (size_t k = 0; k < sizeof ds / sizeof ds[0]; k++) {
        ts_dtype d = ds[k];
        ts_tensor *in = vec(rc, d, n, ag_val, rc->rank);
        ts_tensor *outs[MAXW] = {0};
        for (int i = 0; i < rc->W; i++) RK_OK(rc, ts_tensor_zeros(d, 1, &n, &outs[i]));
        ts_request *r = NULL;
        RK_OK(rc, ts_all_gather(rc->c, rc->W, outs, in, &r));
        RK_OK(rc, ts_request_wait(r));
        ts_request_free(r);
        for (int i = 0; i < rc->W; i++)
            for (int64_t j = 0; j < n; j++) {
                double want = d == TS_BOOL ? ag_val(i, j) != 0 : ag_val(i, j);
                if (check_close(rc, "list all_gather", outs[i], j, want)) return 1;
            }
        /* blocking form, empty tensors */
        ts_tensor *e = vec(rc, d, 0, ag_val, rc->rank), *eo[MAXW] = {0};
        for (int i = 0; i < rc->W; i++) eo[i] = vec(rc, d, 0, ag_val, 0);
        RK_OK(rc, ts_all_gather(rc->c, rc->W, eo, e, NULL));
        for (int i = 0; i < rc->W; i++) {
            ts_tensor_free(outs[i]);
            ts_tensor_free(eo[i]);
        }
        ts_tensor_free(in);
        ts_tensor_free(e);
    }
    /* errors before submission */
    ts_tensor *a = vec(rc, TS_F32, 3, ag_val, 0), *b = vec(rc, TS_F32, 4, ag_val, 0),
              *e = vec(rc, TS_F64, 3, ag_val, 0);
    ts_tensor *outs[MAXW + 1];
    for (int i = 0; i <= MAXW; i++) outs[i] = a;
    if (ts_all_gather(rc->c, rc->W + 1, outs, a, NULL) != TS_ERR_SHAPE) return fail(rc, "count accepted");
    outs[rc->W - 1] = b;
    if (ts_all_gather(rc->c, rc->W, outs, a, NULL) != TS_ERR_SHAPE) return fail(rc, "size accepted");
    outs[rc->W - 1] = e;
    if (ts_all_gather(rc->c, rc->W, outs, a, NULL) != TS_ERR_DTYPE) return fail(rc, "dtype accepted");
    outs[rc->W - 1] = NULL;
    if (ts_all_gather(rc->c, rc->W, outs, a, NULL) != TS_ERR_INVALID_ARGUMENT) return fail(rc, "NULL accepted");
    if (ts_all_gather(rc->c, rc->W, NULL, a, NULL) != TS_ERR_INVALID_ARGUMENT) return fail(rc, "NULL outs accepted");
    ts_tensor_free(a);
    ts_tensor_free(b);
    ts_tensor_free(e);
    return 0;
}

Test(comm_groups, all_gather_list_form, .timeout = 60)
{
    th_mem_mark();
    for (int W = 1; W <= 4; W++) run_world(W, rank_all_gather_list, NULL);
    th_mem_assert_back();
}

/* all-to-all: in block j, element k on rank r = r*100 + j*10 + k. */
static double a2a_val(int rank, int64_t idx, int64_t n)
{
    return (double)(rank * 100 + (n ? idx / n : 0) * 10 + (n ? idx % n : 0));
}

static int a2a_check(rank_ctx *rc, ts_comm *c, ts_dtype d, int64_t n, bool async)
{
    int W = ts_comm_size(c), me = ts_comm_rank(c);
    int64_t s[1] = {W * n};
    ts_tensor *inc = NULL, *out = NULL;
    RK_OK(rc, ts_tensor_empty(d, 1, s, &inc));
    for (int64_t i = 0; i < W * n; i++) {
        double v = a2a_val(me, i, n);
        switch (d) {
        case TS_F32: ((float *)ts_tensor_data(inc))[i] = (float)v; break;
        case TS_F64: ((double *)ts_tensor_data(inc))[i] = v; break;
        case TS_I64: ((int64_t *)ts_tensor_data(inc))[i] = (int64_t)v; break;
        default: return fail(rc, "a2a_check: dtype");
        }
    }
    RK_OK(rc, ts_tensor_zeros(d, 1, s, &out));
    if (async) {
        ts_request *r = NULL;
        RK_OK(rc, ts_all_to_all(c, out, inc, &r));
        RK_OK(rc, ts_request_wait(r));
        ts_request_free(r);
    } else {
        RK_OK(rc, ts_all_to_all(c, out, inc, NULL));
    }
    for (int j = 0; j < W; j++)
        for (int64_t k = 0; k < n; k++)
            if (check_close(rc, "all_to_all", out, j * n + k, (double)(j * 100 + me * 10 + k))) return 1;
    ts_tensor_free(inc);
    ts_tensor_free(out);
    return 0;
}

static int rank_all_to_all(rank_ctx *rc)
{
    const int64_t ns[] = {0, 1, 5, 9};
    for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
        if (a2a_check(rc, rc->c, TS_F64, ns[k], k % 2 == 0)) return 1;
        if (a2a_check(rc, rc->c, TS_I64, ns[k], k % 2 == 1)) return 1;
    }
    /* on a subgroup: the even ranks */
    int ev[MAXW], ne = 0;
    for (int r = 0; r < rc->W; r += 2) ev[ne++] = r;
    ts_comm *g = NULL;
    if (make_group(rc, rc->c, rc->rank, ne, ev, &g)) return 1;
    if (g && a2a_check(rc, g, TS_F32, 3, true)) return 1;
    ts_comm_free(g);
    /* uneven sizes are refused before submission */
    ts_tensor *a = vec(rc, TS_F32, 2 * rc->W + 1, ag_val, 0), *b = vec(rc, TS_F32, 2 * rc->W, ag_val, 0);
    ts_tensor *e = vec(rc, TS_F64, 2 * rc->W, ag_val, 0), *c2 = vec(rc, TS_F32, 2 * rc->W, ag_val, 0);
    if (rc->W > 1 && ts_all_to_all(rc->c, a, a, NULL) != TS_ERR_SHAPE) return fail(rc, "uneven accepted");
    if (ts_all_to_all(rc->c, a, b, NULL) != TS_ERR_SHAPE) return fail(rc, "out size accepted");
    if (ts_all_to_all(rc->c, e, b, NULL) != TS_ERR_DTYPE) return fail(rc, "dtype accepted");
    /* out may be in */
    for (int64_t i = 0; i < 2 * rc->W; i++) ((float *)ts_tensor_data(c2))[i] = (float)a2a_val(rc->rank, i, 2);
    RK_OK(rc, ts_all_to_all(rc->c, c2, c2, NULL));
    for (int j = 0; j < rc->W; j++)
        for (int64_t k = 0; k < 2; k++)
            if (check_close(rc, "in-place all_to_all", c2, j * 2 + k, (double)(j * 100 + rc->rank * 10 + k))) return 1;
    ts_tensor_free(a);
    ts_tensor_free(b);
    ts_tensor_free(e);
    ts_tensor_free(c2);
    return 0;
}

Test(comm_groups, all_to_all, .timeout = 60)
{
    th_mem_mark();
    for (int W = 1; W <= 4; W++) run_world(W, rank_all_to_all, NULL);
    th_mem_assert_back();
}

/* ------------------------------------------------------------------ */

static double p2p_val(int rank, int64_t i) { return (double)(rank * 10 + i); }

/* A ring: each rank sends to the right and receives from the left; then
 * rank 0 sends tags 3, 1, 2 (and 1 again) to rank 1, which receives them
 * as 1, 2, 1, 3; then a ring over the subgroup of odd ranks. */
static int rank_send_recv(rank_ctx *rc)
{
    int W = rc->W, me = rc->rank;
    enum { N = 6 };
    ts_tensor *s = vec(rc, TS_F32, N, p2p_val, me), *t = vec(rc, TS_F32, N, p2p_val, -1);
    ts_request *rs = NULL;
    RK_OK(rc, ts_send(rc->c, s, (me + 1) % W, 7, &rs));
    ts_tensor_free(s); /* the data was copied */
    RK_OK(rc, ts_recv(rc->c, t, (me - 1 + W) % W, 7, NULL));
    RK_OK(rc, ts_request_wait(rs));
    ts_request_free(rs);
    for (int64_t i = 0; i < N; i++)
        if (check_close(rc, "ring recv", t, i, p2p_val((me - 1 + W) % W, i))) return 1;
    ts_tensor_free(t);
    /* out-of-order tags, and two with the same tag in order, with a
     * collective in between */
    if (me == 0) {
        static const int tags[4] = {3, 1, 2, 1};
        ts_request *r[4];
        ts_tensor *v[4];
        for (int k = 0; k < 4; k++) {
            v[k] = vec(rc, TS_I64, 3, p2p_val, 100 + k);
            RK_OK(rc, ts_send(rc->c, v[k], 1, tags[k], &r[k]));
        }
        RK_OK(rc, ts_barrier(rc->c, NULL));
        for (int k = 0; k < 4; k++) {
            RK_OK(rc, ts_request_wait(r[k]));
            ts_request_free(r[k]);
            ts_tensor_free(v[k]);
        }
    } else if (me == 1) {
        RK_OK(rc, ts_barrier(rc->c, NULL));
        static const int tags[4] = {1, 2, 1, 3}, from[4] = {1, 2, 3, 0};
        ts_request *r[4];
        ts_tensor *v[4];
        for (int k = 0; k < 4; k++) {
            v[k] = vec(rc, TS_I64, 3, p2p_val, -1);
            RK_OK(rc, ts_recv(rc->c, v[k], 0, tags[k], &r[k]));
        }
        for (int k = 3; k >= 0; k--) {
            RK_OK(rc, ts_request_wait(r[k]));
            ts_request_free(r[k]);
            for (int64_t i = 0; i < 3; i++)
                if (check_close(rc, "tagged recv", v[k], i, p2p_val(100 + from[k], i))) return 1;
            ts_tensor_free(v[k]);
        }
    } else {
        RK_OK(rc, ts_barrier(rc->c, NULL));
    }
    /* the largest tag, an empty message */
    if (me < 2) {
        ts_tensor *e = vec(rc, TS_F32, 0, p2p_val, 0);
        if (me == 0) RK_OK(rc, ts_send(rc->c, e, 1, TS_P2P_TAG_MAX, NULL));
        else RK_OK(rc, ts_recv(rc->c, e, 0, TS_P2P_TAG_MAX, NULL));
        ts_tensor_free(e);
    }
    /* a ring over the odd ranks (rank translation) */
    int odd[MAXW], no = 0;
    for (int r = 1; r < W; r += 2) odd[no++] = r;
    ts_comm *g = NULL;
    if (make_group(rc, rc->c, me, no, odd, &g)) return 1;
    if (g && no > 1) {
        int gr = ts_comm_rank(g);
        ts_tensor *a = vec(rc, TS_F64, N, p2p_val, me), *b = vec(rc, TS_F64, N, p2p_val, -1);
        ts_request *r = NULL;
        RK_OK(rc, ts_recv(g, b, (gr - 1 + no) % no, 0, &r));
        RK_OK(rc, ts_send(g, a, (gr + 1) % no, 0, NULL));
        RK_OK(rc, ts_request_wait(r));
        ts_request_free(r);
        for (int64_t i = 0; i < N; i++)
            if (check_close(rc, "group ring", b, i, p2p_val(odd[(gr - 1 + no) % no], i))) return 1;
        ts_tensor_free(a);
        ts_tensor_free(b);
    }
    ts_comm_free(g);
    /* counters */
    ts_comm_counters k;
    ts_comm_stats(rc->c, &k);
    if (k.calls[TS_COLL_SEND] < 1 || k.calls[TS_COLL_RECV] < 1 || k.bytes[TS_COLL_SEND] < N * 4)
        return fail(rc, "send/recv not counted");
    /* errors before submission */
    ts_tensor *x = vec(rc, TS_F32, 2, p2p_val, 0);
    if (ts_send(rc->c, x, me, 0, NULL) != TS_ERR_INVALID_ARGUMENT) return fail(rc, "send to self accepted");
    if (ts_recv(rc->c, x, me, 0, NULL) != TS_ERR_INVALID_ARGUMENT) return fail(rc, "recv from self accepted");
    if (ts_send(rc->c, x, W, 0, NULL) != TS_ERR_INVALID_ARGUMENT) return fail(rc, "dst out of range accepted");
    if (ts_recv(rc->c, x, -1, 0, NULL) != TS_ERR_INVALID_ARGUMENT) return fail(rc, "src -1 accepted");
    if (ts_send(rc->c, x, (me + 1) % W, -1, NULL) != TS_ERR_INVALID_ARGUMENT) return fail(rc, "tag -1 accepted");
    if (ts_recv(rc->c, x, (me + 1) % W, TS_P2P_TAG_MAX + 1, NULL) != TS_ERR_INVALID_ARGUMENT)
        return fail(rc, "tag above TS_P2P_TAG_MAX accepted");
    ts_tensor_free(x);
    RK_OK(rc, ts_barrier(rc->c, NULL));
    return 0;
}

Test(comm_groups, send_recv_ring_and_tags, .timeout = 60)
{
    th_mem_mark();
    for (int W = 2; W <= 4; W++) run_world(W, rank_send_recv, NULL);
    th_mem_assert_back();
}

static int rank_new_counters(rank_ctx *rc)
{
    ts_comm_stats_reset(rc->c);
    ts_tensor *in = vec(rc, TS_F32, 4 * rc->W, ag_val, rc->rank), *out = vec(rc, TS_F32, 4 * rc->W, ag_val, 0);
    RK_OK(rc, ts_all_to_all(rc->c, out, in, NULL));
    RK_OK(rc, ts_all_to_all(rc->c, out, in, NULL));
    ts_comm_counters k;
    ts_comm_stats(rc->c, &k);
    if (k.calls[TS_COLL_ALL_TO_ALL] != 2 || k.bytes[TS_COLL_ALL_TO_ALL] != (uint64_t)(2 * 16 * rc->W))
        return fail(rc, "all_to_all counters %llu %llu", (unsigned long long)k.calls[TS_COLL_ALL_TO_ALL],
                    (unsigned long long)k.bytes[TS_COLL_ALL_TO_ALL]);
    ts_tensor_free(in);
    ts_tensor_free(out);
    return 0;
}

Test(comm_groups, counters_of_the_new_kinds, .timeout = 60)
{
    for (int W = 1; W <= 3; W++) run_world(W, rank_new_counters, NULL);
}
