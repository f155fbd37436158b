/* Shared by the multi-rank unit suites: W loopback ranks run as threads of
 * the test, each with its own world (and communication thread). Rank
 * threads never call cr_assert (Criterion's asserts belong to the test's
 * thread): they record their first failure with th_rank_fail and
 * th_run_world asserts on it after joining them. */
#ifndef TS_TEST_LOOPBACK_RANKS_H
#define TS_TEST_LOOPBACK_RANKS_H

#include "comm/comm_internal.h"
#include "comm/transport.h"
#include "tests/helpers.h"

#define TH_MAXW 4

typedef struct th_rank th_rank;
typedef int (*th_rank_fn)(th_rank *rc);

struct th_rank {
    int rank, W;
    ts_comm *c;
    ts_loopback_fabric *f;
    th_rank_fn fn;
    void *arg;
    char err[512];
    ts_status world_status;
};

/* Records "rank r/W: <message>" as this rank's first failure; returns 1. */
int th_rank_fail(th_rank *rc, const char *fmt, ...) TS_PRINTF(2, 3);

/* 0 when a and b are both NULL or hold the same bits (numel, dtype and
 * data); else records "<what>: ..." (what: printf-style) naming the first
 * differing element, and returns 1. */
int th_rank_same_bits(th_rank *rc, const ts_tensor *a, const ts_tensor *b, const char *what, ...) TS_PRINTF(4, 5);

#define TH_RK_OK(rc, expr) \
    do { \
        ts_status s_ = (expr); \
        if (s_ != TS_OK) return th_rank_fail((rc), "%s -> %s: %s", #expr, ts_status_name(s_), ts_last_error()); \
    } while (0)
#define TH_RK_EQ(rc, a, b) \
    do { \
        long long a_ = (long long)(a), b_ = (long long)(b); \
        if (a_ != b_) return th_rank_fail((rc), "%s:%d: %s = %lld, expected %lld", __FILE__, __LINE__, #a, a_, b_); \
    } while (0)

/* Runs fn on W (<= TH_MAXW) loopback ranks whose worlds have the given
 * collective deadline; asserts that no rank failed. */
void th_run_world(int W, th_rank_fn fn, void *arg, double timeout_s);

/* The rank's device mesh over its whole world: 1-d ("dp") of W ranks, or
 * with hsdp the 2-d ("replicate", "shard") mesh of shape (2, W/2). Owned by
 * the caller (ts_mesh_free); NULL when ts_mesh_new fails (ts_last_error()
 * says why). */
ts_mesh *th_rank_mesh(th_rank *rc, bool hsdp);

#endif
