/*
 * Failure modes of the collectives on loopback ranks (threads): ranks that
 * call different collectives (fingerprints), and a rank that never
 * arrives (the deadline's message, and the CPU the survivors use while
 * they wait).
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "tests/loopback_ranks.h"

static ts_tensor *vec(ts_dtype d, int64_t n)
{
    ts_tensor *t = NULL;
    if (ts_tensor_zeros(d, 1, &n, &t) != TS_OK) return NULL;
    return t;
}

/* ------------------------------------------------------------------ */
/* Desynchronised collectives                                          */
/* ------------------------------------------------------------------ */

/* Each case: what every rank runs as collective #1, except the odd rank
 * (the last), and the two descriptions every rank's error must hold. */
typedef enum { MM_KIND, MM_DTYPE, MM_COUNT, MM_OP, MM_ROOT, MM_COUNT_OF_CASES } mm_case;

static const char *const k_case_names[MM_COUNT_OF_CASES] = {"kind", "dtype", "count", "op", "root"};
static const char *const k_want[MM_COUNT_OF_CASES][2] = {
    {"all_gather #1 (float32, 2128)", "barrier #1"},
    {"all_gather #1 (float32, 64)", "all_gather #1 (int32, 64)"},
    {"all_reduce #1 (float32, 64, sum)", "all_reduce #1 (float32, 65, sum)"},
    {"all_reduce #1 (float32, 64, sum)", "all_reduce #1 (float32, 64, max)"},
    {"broadcast #1 (float32, 64, root 0)", "broadcast #1 (float32, 64, root 1)"},
};

static ts_status run_case(th_rank *rc, mm_case k, bool odd)
{
    ts_comm *c = rc->c;
    ts_status s = TS_OK;
    ts_tensor *a = NULL, *b = NULL;
    switch (k) {
    case MM_KIND:
        if (odd) return ts_barrier(c, NULL);
        a = vec(TS_F32, 2128);
        b = vec(TS_F32, 2128 * rc->W);
        s = ts_all_gather_into_tensor(c, b, a, NULL);
        break;
    case MM_DTYPE: /* the same bytes: silently wrong data without the check */
        a = vec(odd ? TS_I32 : TS_F32, 64);
        b = vec(odd ? TS_I32 : TS_F32, 64 * rc->W);
        s = ts_all_gather_into_tensor(c, b, a, NULL);
        break;
    case MM_COUNT:
        a = vec(TS_F32, odd ? 65 : 64);
        s = ts_all_reduce(c, a, TS_REDUCE_SUM, NULL);
        break;
    case MM_OP:
        a = vec(TS_F32, 64);
        s = ts_all_reduce(c, a, odd ? TS_REDUCE_MAX : TS_REDUCE_SUM, NULL);
        break;
    case MM_ROOT:
        a = vec(TS_F32, 64);
        s = ts_broadcast(c, a, odd ? 1 : 0, NULL);
        break;
    default: break;
    }
    ts_tensor_free(a);
    ts_tensor_free(b);
    return s;
}

static int rank_mismatch(th_rank *rc)
{
    mm_case k = *(const mm_case *)rc->arg;
    TH_RK_OK(rc, ts_barrier(rc->c, NULL)); /* #0 agrees */
    double t0 = th_now_s();
    ts_status s = run_case(rc, k, rc->rank == rc->W - 1);
    char err[512];
    snprintf(err, sizeof err, "%s", ts_last_error());
    double dt = th_now_s() - t0;
    if (s != TS_ERR_COMM)
        return th_rank_fail(rc, "%s mismatch -> %s (%s), want TS_ERR_COMM", k_case_names[k], ts_status_name(s), err);
    for (int i = 0; i < 2; i++)
        if (!strstr(err, k_want[k][i]))
            return th_rank_fail(rc, "%s mismatch: the error does not name '%s': %s", k_case_names[k], k_want[k][i],
                                err);
    if (!strstr(err, "desynchronised"))
        return th_rank_fail(rc, "%s mismatch: the error does not say what happened: %s", k_case_names[k], err);
    if (dt > 5.0) return th_rank_fail(rc, "%s mismatch took %.2f s (the deadline is 30 s)", k_case_names[k], dt);
    /* the world has failed: later collectives fail at once */
    s = ts_barrier(rc->c, NULL);
    if (s != TS_ERR_COMM) return th_rank_fail(rc, "later barrier -> %s", ts_status_name(s));
    return 0;
}

Test(comm_failures, each_mismatch_fails_every_rank_naming_both_sides, .timeout = 120)
{
    for (int W = 2; W <= 3; W++)
        for (int k = 0; k < MM_COUNT_OF_CASES; k++) {
            mm_case kc = (mm_case)k;
            th_run_world(W, rank_mismatch, &kc, 30.0);
        }
}

/* The message puts the lower rank first and names the ranks. */
static int rank_mismatch_text(th_rank *rc)
{
    TH_RK_OK(rc, ts_barrier(rc->c, NULL));
    ts_status s = run_case(rc, MM_KIND, rc->rank == 1);
    if (s != TS_ERR_COMM) return th_rank_fail(rc, "-> %s", ts_status_name(s));
    const char *want = "rank 0 runs all_gather #1 (float32, 2128), rank 1 runs barrier #1";
    if (!strstr(ts_last_error(), want)) return th_rank_fail(rc, "'%s' not in: %s", want, ts_last_error());
    return 0;
}

Test(comm_failures, mismatch_message_names_the_ranks, .timeout = 60)
{
    th_run_world(2, rank_mismatch_text, NULL, 30.0);
}

/* The check off (every rank alike): same-size mismatches pass unnoticed,
 * as they did before the check; on again: caught. */
static int rank_check_off(th_rank *rc)
{
    ts__comm_set_check(rc->c, false);
    TH_RK_OK(rc, ts_barrier(rc->c, NULL));
    TH_RK_OK(rc, run_case(rc, MM_OP, rc->rank == rc->W - 1));
    ts__comm_set_check(rc->c, true);
    ts_status s = run_case(rc, MM_OP, rc->rank == rc->W - 1);
    if (s != TS_ERR_COMM) return th_rank_fail(rc, "check on again -> %s", ts_status_name(s));
    return 0;
}

Test(comm_failures, check_can_be_turned_off, .timeout = 60) { th_run_world(2, rank_check_off, NULL, 30.0); }

/* Groups: the group is named, and ranks outside the group fail too. */
static int rank_group_mismatch(th_rank *rc)
{
    int ranks[2] = {0, 1};
    ts_comm *g = NULL;
    TH_RK_OK(rc, ts_comm_new_group(rc->c, 2, ranks, &g));
    ts_status s;
    if (g) {
        ts_tensor *a = vec(TS_F32, 8);
        s = ts_all_reduce(g, a, rc->rank == 1 ? TS_REDUCE_MIN : TS_REDUCE_SUM, NULL);
        ts_tensor_free(a);
        if (s != TS_ERR_COMM) return th_rank_fail(rc, "group all_reduce -> %s", ts_status_name(s));
        if (!strstr(ts_last_error(),
                    "group 1: rank 0 runs all_reduce #0 (float32, 8, sum), rank 1 runs all_reduce #0 "
                    "(float32, 8, min)"))
            return th_rank_fail(rc, "group mismatch: %s", ts_last_error());
        ts_comm_free(g);
    }
    /* the world fails everywhere: rank 2 (outside the group) learns it */
    s = ts_barrier(rc->c, NULL);
    if (s != TS_ERR_COMM) return th_rank_fail(rc, "world barrier after the group's mismatch -> %s", ts_status_name(s));
    if (!strstr(ts_last_error(), "desynchronised")) return th_rank_fail(rc, "barrier: %s", ts_last_error());
    return 0;
}

Test(comm_failures, group_mismatch_fails_the_world, .timeout = 60) { th_run_world(3, rank_group_mismatch, NULL, 30.0); }

/* ------------------------------------------------------------------ */
/* A rank that never arrives                                           */
/* ------------------------------------------------------------------ */

typedef struct {
    double cpu, wall;
} cpu_use;

/* Rank 1 never calls the barrier; the others' deadline (1 s) names the
 * collective, its number and rank 1. */
static int rank_missing(th_rank *rc)
{
    cpu_use *u = rc->arg;
    if (rc->rank == 1) return 0;
    double w0 = th_now_s(), c0 = th_cpu_s();
    ts_status s = ts_barrier(rc->c, NULL);
    if (rc->rank == 0) {
        u->wall = th_now_s() - w0;
        u->cpu = th_cpu_s() - c0;
    }
    if (s != TS_ERR_TIMEOUT) return th_rank_fail(rc, "barrier -> %s, want TS_ERR_TIMEOUT", ts_status_name(s));
    const char *e = ts_last_error();
    if (!strstr(e, "barrier #0") || !strstr(e, "deadline"))
        return th_rank_fail(rc, "the deadline error does not name the collective: %s", e);
    if (!strstr(e, "rank 1")) return th_rank_fail(rc, "the deadline error does not name rank 1: %s", e);
    /* rank 1 is the only rank the message may blame: no other is named
     * as missing ("waiting for rank 2, which has not entered it" would be
     * wrong for W = 3: rank 2 entered) */
    if (strstr(e, "rank 2, which has not entered")) return th_rank_fail(rc, "blames rank 2: %s", e);
    return 0;
}

Test(comm_failures, deadline_names_collective_and_missing_rank, .timeout = 60)
{
    for (int W = 2; W <= 3; W++) {
        cpu_use u = {0, 0};
        th_run_world(W, rank_missing, &u, 1.0);
        /* the waiting ranks sleep: the whole process (every rank's
         * communication thread) used a small part of one core. Bound
         * generous for a loaded machine; spinning would be ~100%. */
        cr_assert_lt(u.cpu, 0.25 * u.wall, "W=%d: %.3f s of CPU in %.3f s of waiting", W, u.cpu, u.wall);
    }
}

/* The deadline setter shortens a world's deadline for later collectives. */
static int rank_setter(th_rank *rc)
{
    ts__comm_set_timeout(rc->c, 0.3);
    if (rc->rank == 1) return 0;
    double t0 = th_now_s();
    ts_tensor *a = vec(TS_F32, 16);
    ts_status s = ts_all_reduce(rc->c, a, TS_REDUCE_SUM, NULL);
    ts_tensor_free(a);
    double dt = th_now_s() - t0;
    if (s != TS_ERR_TIMEOUT) return th_rank_fail(rc, "all_reduce -> %s", ts_status_name(s));
    if (dt > 5.0) return th_rank_fail(rc, "deadline of 0.3 s fired after %.2f s", dt);
    if (!strstr(ts_last_error(), "all_reduce #0") || !strstr(ts_last_error(), "rank 1, which has not entered it"))
        return th_rank_fail(rc, "message: %s", ts_last_error());
    return 0;
}

Test(comm_failures, deadline_setter, .timeout = 60) { th_run_world(2, rank_setter, NULL, 60.0); }
