/*
 * The rings' step-0 blocks inside their fingerprints' messages (comm.c,
 * "Fingerprints": inline blocks), on loopback ranks (threads): results
 * bitwise the same with the block inline, apart and without fingerprints;
 * one message fewer per rank and collective; and every mismatch still
 * fails every rank with the fingerprint's message, whichever side of the
 * threshold each rank's block is on.
 *
 * Each world's threshold is set with ts__comm_set_fp_inline (T = 256
 * bytes here, so that small tensors cross it), not TS_COMM_FP_INLINE.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "tests/loopback_ranks.h"

#define T_INLINE 256 /* bytes: the threshold the cases set */

/* Every rank thread of a world meets here (outside the library). */
static pthread_barrier_t g_meet;
static void meet_init(int W) { pthread_barrier_init(&g_meet, NULL, (unsigned)W); }
static void meet(void) { pthread_barrier_wait(&g_meet); }
static void meet_fini(void) { pthread_barrier_destroy(&g_meet); }

/* A 1-d tensor of n elements of d whose bytes depend on (rank, i, salt):
 * small integers (exact in every dtype) with a sign. */
static ts_tensor *filled(ts_dtype d, int64_t n, int rank, int salt)
{
    ts_tensor *t = NULL;
    if (ts_tensor_empty(d, 1, &n, &t) != TS_OK) return NULL;
    unsigned char *p = ts_tensor_data(t);
    for (int64_t i = 0; i < n; i++) {
        double v = (double)((rank * 7 + i * 3 + salt) % 23) - 11.0;
        switch (d) {
        case TS_F32: ((float *)p)[i] = (float)v; break;
        case TS_F64: ((double *)p)[i] = v; break;
        case TS_BF16: ((uint16_t *)p)[i] = ts_f32_to_bf16((float)v); break;
        case TS_F16: ((uint16_t *)p)[i] = ts_f32_to_f16((float)v); break;
        case TS_I64: ((int64_t *)p)[i] = (int64_t)v; break;
        case TS_I32: ((int32_t *)p)[i] = (int32_t)v; break;
        case TS_BOOL: p[i] = (uint8_t)(v > 0); break;
        default: break;
        }
    }
    return t;
}

static size_t nbytes(const ts_tensor *t) { return (size_t)ts_tensor_numel(t) * ts_dtype_size(ts_tensor_dtype(t)); }

/* ------------------------------------------------------------------ */
/* Results                                                             */
/* ------------------------------------------------------------------ */

/* The collectives whose results are compared, each on per-rank blocks of
 * `n` elements. */
enum { C_AG, C_AG_IN_PLACE, C_AG_LIST, C_RS, C_RS_IN_PLACE, C_AR_SUM, C_AR_AVG, C_AR_MAX, C_BARRIER, C_COUNT };
static const char *const k_cnames[C_COUNT] = {"all_gather",     "all_gather in place",     "all_gather list",
                                              "reduce_scatter", "reduce_scatter in place", "all_reduce sum",
                                              "all_reduce avg", "all_reduce max",          "barrier"};

static bool reducible(ts_dtype d) { return d == TS_F32 || d == TS_F64 || d == TS_BF16 || d == TS_F16 || d == TS_I64; }
static bool floating(ts_dtype d) { return d == TS_F32 || d == TS_F64 || d == TS_BF16 || d == TS_F16; }

/* Runs collective k on c with per-rank blocks of n elements of d; the
 * result's bytes go to *out (malloc'd, *out_len bytes). TS_ERR_UNSUPPORTED
 * (nothing run) when k does not apply to d. */
static ts_status run_coll(ts_comm *c, int k, ts_dtype d, int64_t n, unsigned char **out, size_t *out_len)
{
    int W = ts_comm_size(c), r = ts_comm_rank(c);
    ts_status s = TS_OK;
    ts_tensor *a = NULL, *b = NULL, *res = NULL;
    ts_tensor *list[TH_MAXW] = {0};
    *out = NULL;
    *out_len = 0;
    if (k >= C_RS && k <= C_AR_MAX && !reducible(d)) return TS_ERR_UNSUPPORTED;
    if (k == C_AR_AVG && !floating(d)) return TS_ERR_UNSUPPORTED;
    switch (k) {
    case C_AG:
        a = filled(d, n, r, 1);
        b = filled(d, n * W, r, 2);
        s = ts_all_gather_into_tensor(c, b, a, NULL);
        res = b;
        break;
    case C_AG_IN_PLACE: {
        b = filled(d, n * W, r, 3);
        ts_tensor *v = NULL;
        int64_t off = (int64_t)r * n;
        if ((s = ts_narrow(b, 0, off, n, &v)) == TS_OK) {
            s = ts_all_gather_into_tensor(c, b, v, NULL);
            ts_tensor_free(v);
        }
        res = b;
        break;
    }
    case C_AG_LIST: {
        a = filled(d, n, r, 4);
        for (int i = 0; i < W; i++) list[i] = filled(d, n, r, 5 + i);
        s = ts_all_gather(c, W, list, a, NULL);
        b = filled(d, n * W, r, 0);
        for (int i = 0; i < W && s == TS_OK; i++)
            memcpy((unsigned char *)ts_tensor_data(b) + (size_t)i * nbytes(list[i]), ts_tensor_data(list[i]),
                   nbytes(list[i]));
        res = b;
        break;
    }
    case C_RS:
        a = filled(d, n * W, r, 6);
        b = filled(d, n, r, 7);
        s = ts_reduce_scatter_tensor(c, b, a, floating(d) ? TS_REDUCE_AVG : TS_REDUCE_SUM, floating(d) ? 2.0 : 1.0,
                                     floating(d) ? 3.0 : 1.0, NULL);
        res = b;
        break;
    case C_RS_IN_PLACE: {
        a = filled(d, n * W, r, 8);
        ts_tensor *v = NULL;
        if ((s = ts_narrow(a, 0, (int64_t)r * n, n, &v)) == TS_OK) {
            s = ts_reduce_scatter_tensor(c, v, a, TS_REDUCE_SUM, 1.0, 1.0, NULL);
            ts_tensor_free(v);
        }
        res = a;
        break;
    }
    case C_AR_SUM:
    case C_AR_AVG:
    case C_AR_MAX:
        a = filled(d, n * W + (n > 1 ? 1 : 0), r, 9); /* uneven: an accumulation copy padded to W blocks */
        s = ts_all_reduce(c, a, k == C_AR_SUM ? TS_REDUCE_SUM : k == C_AR_AVG ? TS_REDUCE_AVG : TS_REDUCE_MAX, NULL);
        res = a;
        break;
    case C_BARRIER: s = ts_barrier(c, NULL); break;
    default: break;
    }
    if (s == TS_OK && res) {
        *out_len = nbytes(res);
        *out = malloc(*out_len ? *out_len : 1);
        if (*out_len) memcpy(*out, ts_tensor_data(res), *out_len);
    }
    ts_tensor_free(a);
    ts_tensor_free(b);
    for (int i = 0; i < W; i++) ts_tensor_free(list[i]);
    return s;
}

static const ts_dtype k_dtypes[] = {TS_F32, TS_F64, TS_BF16, TS_F16, TS_I64, TS_I32, TS_BOOL};
#define NDT ((int)(sizeof k_dtypes / sizeof k_dtypes[0]))

/* Per-rank block sizes in elements around the threshold (and half of it)
 * for a dtype of es bytes: empty, small, just under, at, just over each
 * (the reductions' blocks are in the accumulation dtype: bf16 and f16
 * blocks are twice as many bytes, which moves them across too). */
static int sizes_for(size_t es, int64_t out[9])
{
    int64_t t = T_INLINE / (int64_t)es;
    int n = 0;
    out[n++] = 0;
    out[n++] = 3;
    for (int64_t c = t / 2; c <= t; c += t / 2) {
        out[n++] = c - 1;
        out[n++] = c;
        out[n++] = c + 1;
    }
    out[n++] = 2 * t + 5;
    return n;
}

/* Every collective, dtype and size three ways on c: inline (threshold
 * T_INLINE), apart (threshold 0) and without fingerprints; the three
 * results must be the same bytes. */
static int check_results(th_rank *rc, ts_comm *c, const char *where)
{
    for (int di = 0; di < NDT; di++) {
        ts_dtype d = k_dtypes[di];
        int64_t ns[9];
        int nn = sizes_for(ts_dtype_size(d), ns);
        for (int si = 0; si < nn; si++)
            for (int k = 0; k < C_COUNT; k++) {
                unsigned char *res[3] = {0};
                size_t len[3] = {0};
                for (int mode = 0; mode < 3; mode++) {
                    ts__comm_set_check(rc->c, mode != 2);
                    ts__comm_set_fp_inline(rc->c, mode == 0 ? T_INLINE : 0);
                    ts_status s = run_coll(c, k, d, ns[si], &res[mode], &len[mode]);
                    if (s == TS_ERR_UNSUPPORTED) break;
                    if (s != TS_OK) {
                        for (int j = 0; j < 3; j++) free(res[j]);
                        return th_rank_fail(rc, "%s: %s of %s x %lld (mode %d) -> %s: %s", where, k_cnames[k],
                                            ts_dtype_name(d), (long long)ns[si], mode, ts_status_name(s),
                                            ts_last_error());
                    }
                }
                bool same = len[0] == len[1] && len[0] == len[2] &&
                    (!len[0] || (!memcmp(res[0], res[1], len[0]) && !memcmp(res[0], res[2], len[0])));
                for (int j = 0; j < 3; j++) free(res[j]);
                if (!same)
                    return th_rank_fail(rc, "%s: %s of %s x %lld: inline, apart and unchecked results differ", where,
                                        k_cnames[k], ts_dtype_name(d), (long long)ns[si]);
            }
    }
    ts__comm_set_check(rc->c, true);
    return 0;
}

static int rank_results(th_rank *rc)
{
    if (check_results(rc, rc->c, "world")) return 1;
    if (rc->W < 3) return 0;
    /* a group in reverse order, without rank 1 */
    int ranks[TH_MAXW], n = 0;
    for (int i = rc->W - 1; i >= 0; i--)
        if (i != 1) ranks[n++] = i;
    ts_comm *g = NULL;
    TH_RK_OK(rc, ts_comm_new_group(rc->c, n, ranks, &g));
    int bad = g ? check_results(rc, g, "group") : 0;
    ts_comm_free(g);
    return bad;
}

Test(comm_fp_inline, results_bitwise_the_same_inline_apart_and_unchecked, .timeout = 120)
{
    for (int W = 2; W <= 4; W++) th_run_world(W, rank_results, NULL, 30.0);
}

/* ------------------------------------------------------------------ */
/* Messages                                                            */
/* ------------------------------------------------------------------ */

typedef struct {
    int coll;      /* C_AG, C_RS, C_AR_SUM */
    int mode;      /* 0 inline, 1 apart, 2 unchecked */
    int64_t n;     /* per-rank elements (f32) */
    uint64_t sent; /* rank 0: messages of 10 collectives and a barrier */
} msg_case;

static int rank_messages(th_rank *rc)
{
    msg_case *mc = rc->arg;
    ts__comm_set_check(rc->c, mc->mode != 2);
    ts__comm_set_fp_inline(rc->c, mc->mode == 0 ? T_INLINE : 0);
    TH_RK_OK(rc, ts_barrier(rc->c, NULL));
    meet(); /* every rank's barrier finished: all its sends counted */
    uint64_t before = ts__loopback_sent(rc->f);
    meet();
    for (int i = 0; i < 10; i++) {
        unsigned char *res = NULL;
        size_t len = 0;
        ts_status s = run_coll(rc->c, mc->coll, TS_F32, mc->n, &res, &len);
        free(res);
        if (s != TS_OK) return th_rank_fail(rc, "%s -> %s: %s", k_cnames[mc->coll], ts_status_name(s), ts_last_error());
    }
    TH_RK_OK(rc, ts_barrier(rc->c, NULL));
    meet();
    if (rc->rank == 0) mc->sent = ts__loopback_sent(rc->f) - before;
    meet();
    ts__comm_set_check(rc->c, true);
    return 0;
}

/* Per rank and collective: a ring of W-1 data steps (all-reduce: 2W-2)
 * plus one fingerprint, which inline carries step 0's block: the
 * fingerprints then cost no message, as unchecked; apart, one more. A
 * block over the threshold goes apart even when inline is on. */
Test(comm_fp_inline, inline_saves_one_message_per_rank_and_collective, .timeout = 60)
{
    for (int W = 2; W <= 4; W++) {
        static const int colls[3] = {C_AG, C_RS, C_AR_SUM};
        for (int ci = 0; ci < 3; ci++)
            for (int mode = 0; mode < 3; mode++)
                for (int big = 0; big < 2; big++) {
                    /* f32 blocks of 16 or T_INLINE / 4 + 1 elements (all-reduce: n W + 1 elements, blocks of
                     * n + 1) */
                    msg_case mc = {.coll = colls[ci], .mode = mode, .n = big ? T_INLINE / 4 + 1 : 16};
                    meet_init(W);
                    th_run_world(W, rank_messages, &mc, 30.0);
                    meet_fini();
                    uint64_t steps = colls[ci] == C_AR_SUM ? 2u * (unsigned)(W - 1) : (unsigned)(W - 1);
                    uint64_t per_coll = steps + (mode == 1 || (mode == 0 && big) ? 1 : 0);
                    uint64_t per_barrier = (unsigned)(W - 1) + (mode == 2 ? 0 : mode == 1 ? 1 : 0);
                    uint64_t want = (uint64_t)W * (10 * per_coll + per_barrier);
                    cr_expect_eq(mc.sent, want, "W=%d %s mode %d %s block: %llu messages, want %llu", W,
                                 k_cnames[colls[ci]], mode, big ? "large" : "small", (unsigned long long)mc.sent,
                                 (unsigned long long)want);
                }
    }
}

/* ------------------------------------------------------------------ */
/* Mismatches                                                          */
/* ------------------------------------------------------------------ */

/* The odd rank (the last) runs collective #1 with n_odd elements per
 * block, the others with n; every rank must fail within the collective
 * with the fingerprints' message naming both counts. */
typedef struct {
    int coll; /* C_AG, C_RS, C_AR_SUM */
    int64_t n, n_odd;
    size_t thr_odd;   /* the odd rank's threshold (T_INLINE unless the case is about that) */
    const char *want; /* a phrase every rank's error holds */
} mm_case;

static int rank_mismatch(th_rank *rc)
{
    mm_case *m = rc->arg;
    bool odd = rc->rank == rc->W - 1;
    TH_RK_OK(rc, ts_barrier(rc->c, NULL)); /* #0 agrees (the default threshold on every rank) */
    meet();                                /* a rank still finishing #0 would fail it with #1's mismatch */
    ts__comm_set_fp_inline(rc->c, odd ? m->thr_odd : T_INLINE);
    double t0 = th_now_s();
    unsigned char *res = NULL;
    size_t len = 0;
    ts_status s = run_coll(rc->c, m->coll, TS_F32, odd ? m->n_odd : m->n, &res, &len);
    free(res);
    char err[512];
    snprintf(err, sizeof err, "%s", ts_last_error());
    double dt = th_now_s() - t0;
    if (s != TS_ERR_COMM)
        return th_rank_fail(rc, "%s %lld vs %lld -> %s (%s), want TS_ERR_COMM", k_cnames[m->coll], (long long)m->n,
                            (long long)m->n_odd, ts_status_name(s), err);
    if (!strstr(err, m->want))
        return th_rank_fail(rc, "%s %lld vs %lld: '%s' not in: %s", k_cnames[m->coll], (long long)m->n,
                            (long long)m->n_odd, m->want, err);
    if (m->n != m->n_odd) {
        /* both sides named, as "<kind> #1 (float32, <count>" */
        int64_t cnt[2] = {m->n, m->n_odd};
        for (int i = 0; i < 2; i++) {
            int64_t c = m->coll == C_RS ? cnt[i] : m->coll == C_AR_SUM ? cnt[i] * rc->W + (cnt[i] > 1) : cnt[i];
            char side[96];
            snprintf(side, sizeof side, "%s #1 (float32, %lld",
                     m->coll == C_AG       ? "all_gather"
                         : m->coll == C_RS ? "reduce_scatter"
                                           : "all_reduce",
                     (long long)c);
            if (!strstr(err, side)) return th_rank_fail(rc, "'%s' not in: %s", side, err);
        }
    }
    if (dt > 5.0) return th_rank_fail(rc, "the mismatch took %.2f s (the deadline is 30 s)", dt);
    s = ts_barrier(rc->c, NULL);
    if (s != TS_ERR_COMM) return th_rank_fail(rc, "later barrier -> %s", ts_status_name(s));
    return 0;
}

static void run_mismatches(int64_t n, int64_t n_odd)
{
    static const int colls[3] = {C_AG, C_RS, C_AR_SUM};
    for (int W = 2; W <= 4; W++)
        for (int ci = 0; ci < 3; ci++) {
            mm_case m = {.coll = colls[ci], .n = n, .n_odd = n_odd, .thr_odd = T_INLINE, .want = "desynchronised"};
            meet_init(W);
            th_run_world(W, rank_mismatch, &m, 30.0);
            meet_fini();
        }
}

/* The others' blocks under the threshold (inline), the odd rank's over
 * it (apart): 16-element f32 blocks (64 bytes) against 4 times the
 * threshold. */
Test(comm_fp_inline, mismatch_inline_against_apart, .timeout = 120) { run_mismatches(16, T_INLINE); }

/* The reverse: the others' blocks over, the odd rank's under. */
Test(comm_fp_inline, mismatch_apart_against_inline, .timeout = 120) { run_mismatches(T_INLINE, 16); }

/* Both inline (f32 blocks of 64 and 128 bytes), the odd rank's message
 * longer than the others' block (and shorter): the receive takes any
 * length up to the cap (an all-gather's beyond its slot into the op's
 * buffer). */
Test(comm_fp_inline, mismatch_both_inline_of_other_lengths, .timeout = 120)
{
    run_mismatches(16, T_INLINE / 8);
    run_mismatches(T_INLINE / 8, 16);
}

/* Both apart, the odd rank's data message longer than the others'
 * receive buffer (and shorter): the data receive fails first with a
 * length error, and the fingerprint's message still wins. */
Test(comm_fp_inline, mismatch_both_apart_sender_longer, .timeout = 120)
{
    run_mismatches(T_INLINE, 2 * T_INLINE);
    run_mismatches(2 * T_INLINE, T_INLINE);
}

/* The same collective with thresholds that differ between ranks: a
 * block between them fails every rank saying why. */
Test(comm_fp_inline, thresholds_that_differ_fail_saying_so, .timeout = 60)
{
    for (int W = 2; W <= 4; W++) {
        mm_case m = {.coll = C_AG, .n = 16, .n_odd = 16, .thr_odd = 0, .want = "TS_COMM_FP_INLINE"};
        meet_init(W);
        th_run_world(W, rank_mismatch, &m, 30.0);
        meet_fini();
    }
}
