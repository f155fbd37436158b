/*
 * Caller-driven progress (comm/comm.c, "Driving"), over the loopback
 * fabric: W ranks as threads of this test, each with its own world and
 * communication thread. A caller that waits on a request (every blocking
 * collective does) runs the world's progress itself; the communication
 * thread keeps asynchronous requests moving while the caller does not
 * call into the library, also the ones a driving caller left behind.
 * tests/comm/test_progress_dist.c checks the same between processes over
 * UCX, and a wait on a stopped peer.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "tests/loopback_ranks.h"

typedef th_rank rank_ctx;
#define fail th_rank_fail
#define RK_OK TH_RK_OK

static ts_tensor *filled(rank_ctx *rc, int64_t n, float base)
{
    ts_tensor *t = NULL;
    if (ts_tensor_empty(TS_F32, 1, &n, &t) != TS_OK) {
        fail(rc, "ts_tensor_empty: %s", ts_last_error());
        return NULL;
    }
    float *p = ts_tensor_data(t);
    for (int64_t i = 0; i < n; i++) p[i] = base + (float)(i % 7);
    return t;
}

/* Rank r's block of an all-gather: r * 100 + (i % 7). */
static int check_gather(rank_ctx *rc, const char *what, const ts_tensor *out, int64_t n)
{
    const float *p = ts_tensor_data(out);
    for (int j = 0; j < rc->W; j++)
        for (int64_t i = 0; i < n; i++)
            if (p[j * n + i] != (float)(j * 100) + (float)(i % 7))
                return fail(rc, "%s: out[%d][%lld] = %g, want %g", what, j, (long long)i, p[j * n + i],
                            (double)(j * 100) + (double)(i % 7));
    return 0;
}

/* 300 blocking all-reduces and all-gathers of 4 KiB: right, and (nearly)
 * all finished by the caller itself, not handed to the communication
 * thread and back. A caller hands over only after 5 ms without events,
 * which a loaded machine may cause now and then: at least half. */
static int rank_blocking(rank_ctx *rc)
{
    enum { N = 150 };
    uint64_t c0, t0, c1, t1;
    ts__comm_progress_stats(rc->c, &c0, &t0);
    int64_t n = 1024 / rc->W;
    ts_tensor *acc = filled(rc, 1024, 0), *in = filled(rc, n, (float)(rc->rank * 100)), *out = NULL;
    int64_t total = n * rc->W;
    RK_OK(rc, ts_tensor_empty(TS_F32, 1, &total, &out));
    for (int k = 0; k < N; k++) {
        float *a = ts_tensor_data(acc);
        for (int64_t i = 0; i < 1024; i++) a[i] = (float)(rc->rank + k);
        RK_OK(rc, ts_all_reduce(rc->c, acc, TS_REDUCE_SUM, NULL));
        float want = (float)(rc->W * k + rc->W * (rc->W - 1) / 2);
        for (int64_t i = 0; i < 1024; i++)
            if (a[i] != want) return fail(rc, "all_reduce %d: [%lld] = %g, want %g", k, (long long)i, a[i], want);
        memset(ts_tensor_data(out), 0, (size_t)total * sizeof(float));
        RK_OK(rc, ts_all_gather_into_tensor(rc->c, out, in, NULL));
        if (check_gather(rc, "all_gather", out, n)) return 1;
    }
    ts__comm_progress_stats(rc->c, &c1, &t1);
    uint64_t callers = c1 - c0, thread = t1 - t0;
    if (callers + thread != 2 * N)
        return fail(rc, "%llu collectives finished by callers and %llu by the thread, %d submitted",
                    (unsigned long long)callers, (unsigned long long)thread, 2 * N);
    if (callers < N)
        return fail(rc, "callers finished only %llu of %d blocking collectives (the thread %llu)",
                    (unsigned long long)callers, 2 * N, (unsigned long long)thread);
    ts_tensor_free(acc);
    ts_tensor_free(in);
    ts_tensor_free(out);
    return 0;
}

Test(comm_progress, blocking_collectives_are_finished_by_their_caller, .timeout = 60)
{
    th_mem_mark();
    for (int W = 2; W <= 4; W++) th_run_world(W, rank_blocking, NULL, 30.0);
    th_mem_assert_back();
}

/* The hand-over: rank 0 submits an asynchronous all-gather on a group,
 * then drives a blocking all-reduce of the world to completion, and
 * leaves; the other ranks join the all-gather only 30 ms after the
 * all-reduce, while rank 0 sleeps without calling the library. Its
 * communication thread alone completes it (ts_request_test, which does no
 * progress, sees it done); every rank sees it done without waiting. */
static int rank_handover(rank_ctx *rc)
{
    int ranks[TH_MAXW];
    for (int i = 0; i < rc->W; i++) ranks[i] = i;
    ts_comm *g = NULL;
    RK_OK(rc, ts_comm_new_group(rc->c, rc->W, ranks, &g));
    int64_t n = 1000, total = n * rc->W;
    ts_tensor *in = filled(rc, n, (float)(rc->rank * 100)), *out = NULL, *acc = filled(rc, 64, 1);
    RK_OK(rc, ts_tensor_empty(TS_F32, 1, &total, &out));
    uint64_t c0, t0, c1, t1;
    ts__comm_progress_stats(rc->c, &c0, &t0);
    ts_request *r = NULL;
    if (rc->rank == 0) RK_OK(rc, ts_all_gather_into_tensor(g, out, in, &r));
    RK_OK(rc, ts_all_reduce(rc->c, acc, TS_REDUCE_SUM, NULL));
    if (rc->rank != 0) {
        usleep(30000);
        RK_OK(rc, ts_all_gather_into_tensor(g, out, in, &r));
    }
    usleep(300000); /* no call into the library: only the communication thread can progress */
    bool done = false;
    RK_OK(rc, ts_request_test(r, &done));
    if (!done) return fail(rc, "the all-gather left behind did not complete without the caller");
    RK_OK(rc, ts_request_status(r));
    if (check_gather(rc, "all_gather left to the thread", out, n)) return 1;
    ts__comm_progress_stats(rc->c, &c1, &t1);
    /* rank 0 left its all-gather behind: its thread finished it; the late
     * ranks may finish theirs in the round that starts it at submission */
    if (rc->rank == 0 && t1 - t0 < 1)
        return fail(rc, "the communication thread finished none of the collectives (callers %llu)",
                    (unsigned long long)(c1 - c0));
    RK_OK(rc, ts_request_wait(r));
    ts_request_free(r);
    const float *a = ts_tensor_data(acc);
    for (int64_t i = 0; i < 64; i++)
        if (a[i] != (float)rc->W * (1.0f + (float)(i % 7)))
            return fail(rc, "all_reduce: [%lld] = %g", (long long)i, a[i]);
    ts_comm_free(g);
    ts_tensor_free(in);
    ts_tensor_free(out);
    ts_tensor_free(acc);
    return 0;
}

Test(comm_progress, async_request_left_by_a_driving_caller_completes_on_the_thread, .timeout = 60)
{
    for (int W = 2; W <= 3; W++) th_run_world(W, rank_handover, NULL, 30.0);
}

/* Several threads of one rank wait at once (one world, two groups, each
 * waited on by its own thread): they take turns with the progress lock,
 * and one's rounds may finish the other's request; all complete, right. */
typedef struct pair_arg {
    int W;
    ts_comm *g;
    int which;
    char err[256]; /* the thread's first failure ("": none) */
} pair_arg;

static void *pair_thread(void *p)
{
    pair_arg *a = p;
    int64_t n = 256;
    for (int k = 0; k < 100 && !a->err[0]; k++) {
        ts_tensor *t = NULL;
        if (ts_tensor_empty(TS_F32, 1, &n, &t) != TS_OK) {
            snprintf(a->err, sizeof a->err, "thread %d: ts_tensor_empty: %s", a->which, ts_last_error());
            break;
        }
        float *v = ts_tensor_data(t);
        for (int64_t i = 0; i < n; i++) v[i] = (float)(a->which + k) + (float)(i % 7);
        if (ts_all_reduce(a->g, t, TS_REDUCE_SUM, NULL) != TS_OK)
            snprintf(a->err, sizeof a->err, "thread %d all_reduce %d: %s", a->which, k, ts_last_error());
        for (int64_t i = 0; i < n && !a->err[0]; i++)
            if (v[i] != (float)a->W * ((float)(a->which + k) + (float)(i % 7)))
                snprintf(a->err, sizeof a->err, "thread %d all_reduce %d: [%lld] = %g", a->which, k, (long long)i,
                         v[i]);
        ts_tensor_free(t);
    }
    return NULL;
}

static int rank_two_waiters(rank_ctx *rc)
{
    int ranks[TH_MAXW];
    for (int i = 0; i < rc->W; i++) ranks[i] = i;
    ts_comm *g[2] = {NULL, NULL};
    for (int k = 0; k < 2; k++) RK_OK(rc, ts_comm_new_group(rc->c, rc->W, ranks, &g[k]));
    pair_arg a[2] = {{rc->W, g[0], 0, ""}, {rc->W, g[1], 1, ""}};
    pthread_t th[2];
    for (int k = 0; k < 2; k++)
        if (pthread_create(&th[k], NULL, pair_thread, &a[k]) != 0) return fail(rc, "pthread_create");
    for (int k = 0; k < 2; k++) pthread_join(th[k], NULL);
    for (int k = 0; k < 2; k++) ts_comm_free(g[k]);
    for (int k = 0; k < 2; k++)
        if (a[k].err[0]) return fail(rc, "%s", a[k].err);
    return 0;
}

Test(comm_progress, two_threads_of_a_rank_wait_at_once, .timeout = 60)
{
    th_run_world(2, rank_two_waiters, NULL, 30.0);
    th_run_world(3, rank_two_waiters, NULL, 30.0);
}
