/*
 * The copy-free collectives (comm/coll_direct.h) on real processes of one
 * host: against the packed fallback (every rank switched to it with
 * ts__direct_set_enabled(false)) and against the values each rank's data
 * must give, bitwise, on 2, 3 and 4 ranks; uneven rows (9 rows over 4
 * ranks, a segment smaller than the world leaving trailing ranks empty),
 * f32 and bf16 (bf16 reduced in f32), SUM, AVG, MAX and divisors; a source
 * missing on one rank (zeros) or on all (zeros, and ts__direct_sourced
 * says so on every rank); ranks that run different collectives or
 * layouts all fail naming both; the accumulating form
 * (ts__direct_reduce_scatter_add) bitwise the plain one followed by a
 * separate add, padding untouched; with cross-memory attach refused
 * (TS_UCX_CMA=0) the packed path gives the same results; the packed
 * path in small chunks (boundaries inside segments) gives the same bits
 * and counts as one collective; what the packed path adds to the pool
 * and the peak RSS stays under ts__direct_fallback_bytes, which the
 * process floor reports where the fallback can happen. This binary is
 * its own rank program (TS_TEST_DIRECT_ROLE, handled by a constructor
 * before Criterion starts); ranks report through their exit code.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <unistd.h>

#include "comm/coll_direct.h"
#include "comm/comm.h"
#include "comm/comm_internal.h"
#include "comm/launch.h"
#include "tensor/kernels.h"
#include "tests/helpers.h"

static int g_rank = -1;

#define RFAIL(code, ...) th_rank_exit(g_rank, (code), __VA_ARGS__)
#define ROK(code, expr) TH_RANK_OK(code, expr)

/* The layout: segment k is rows[k] x cols[k], rank j's part the rows
 * ts_chunk_range gives it, padded in the shard to ceil(rows / W). */
#define NSEG 4
static const int64_t k_rows[NSEG] = {9, 2, 260, 1};
static const int64_t k_cols[NSEG] = {5, 3, 1000, 7};

typedef struct layout {
    int W, me;
    int64_t counts[NSEG][16], off[NSEG], shard_numel, full_numel[NSEG];
    ts__dseg segs[NSEG];
} layout;

static void make_layout(layout *L, int W, int me)
{
    memset(L, 0, sizeof *L);
    L->W = W;
    L->me = me;
    for (int k = 0; k < NSEG; k++) {
        int64_t c = (k_rows[k] + W - 1) / W;
        for (int j = 0; j < W; j++) {
            int64_t r0, n;
            ts_chunk_range(k_rows[k], W, j, &r0, &n);
            L->counts[k][j] = n * k_cols[k];
        }
        L->off[k] = L->shard_numel;
        L->shard_numel += c * k_cols[k];
        L->full_numel[k] = k_rows[k] * k_cols[k];
        L->segs[k] = (ts__dseg){NULL, TS_F32, L->off[k], L->counts[k]};
    }
}

/* Element i of segment k as rank r holds it: distinct, inexact sums. */
static double val(int r, int k, int64_t i)
{
    return (double)(r + 1) * 0.1 + (double)k * 0.37 + (double)(i % 1013) / 7.0 - 20.0;
}

static void fill(void *p, ts_dtype d, int64_t n, int r, int k, int64_t i0)
{
    for (int64_t i = 0; i < n; i++) {
        float f = (float)val(r, k, i0 + i);
        ts__buf_convert(d, (unsigned char *)p + (size_t)i * ts_dtype_size(d), TS_F32, &f, 1);
    }
}

/* ------------------------------------------------------------ all-gather */

static void run_ag(ts_comm *c, const layout *L, ts_dtype d, bool direct, void **full, int64_t *shard_bytes_out)
{
    size_t es = ts_dtype_size(d);
    unsigned char *shard = calloc((size_t)L->shard_numel + 1, es);
    int64_t b0[NSEG];
    for (int k = 0; k < NSEG; k++) {
        b0[k] = 0;
        for (int j = 0; j < L->me; j++) b0[k] += L->counts[k][j];
        fill(shard + (size_t)L->off[k] * es, d, L->counts[k][L->me], L->me, k, b0[k]);
    }
    ts__dseg segs[NSEG];
    memcpy(segs, L->segs, sizeof segs);
    for (int k = 0; k < NSEG; k++) {
        full[k] = calloc((size_t)L->full_numel[k], es);
        segs[k].full = full[k];
    }
    ts__direct_set_enabled(direct);
    ts__direct *r = NULL;
    ROK(20, ts__direct_all_gather(c, d, shard, L->shard_numel, NSEG, segs, &r));
    ROK(21, ts__direct_wait(r));
    if (ts__direct_was_direct(r) != (direct && L->W > 1))
        RFAIL(22, "all_gather took the %s path", ts__direct_was_direct(r) ? "direct" : "packed");
    ts__direct_free(r);
    ts__direct_set_enabled(true);
    free(shard);
    *shard_bytes_out = L->shard_numel * (int64_t)es;
}

static void check_ag(const layout *L, ts_dtype d, void **full)
{
    size_t es = ts_dtype_size(d);
    for (int k = 0; k < NSEG; k++) {
        int64_t at = 0;
        for (int j = 0; j < L->W; j++) {
            unsigned char want[8];
            for (int64_t i = 0; i < L->counts[k][j]; i++) {
                fill(want, d, 1, j, k, at + i);
                if (memcmp((unsigned char *)full[k] + (size_t)(at + i) * es, want, es))
                    RFAIL(23, "%s all_gather: segment %d element %lld (rank %d's) differs", ts_dtype_name(d), k,
                          (long long)(at + i), j);
            }
            at += L->counts[k][j];
        }
    }
}

static void ag_case(ts_comm *c, const layout *L, ts_dtype d, bool expect_direct)
{
    void *a[NSEG], *b[NSEG];
    int64_t sb;
    run_ag(c, L, d, expect_direct, a, &sb);
    run_ag(c, L, d, false, b, &sb);
    check_ag(L, d, a);
    check_ag(L, d, b);
    for (int k = 0; k < NSEG; k++) {
        if (memcmp(a[k], b[k], (size_t)L->full_numel[k] * ts_dtype_size(d)))
            RFAIL(24, "direct and packed all_gather differ in segment %d", k);
        free(a[k]);
        free(b[k]);
    }
}

/* -------------------------------------------------------- reduce-scatter */

typedef struct rs_cfg {
    ts_dtype out, src;
    ts_reduce_op op;
    double pre, post;
    int missing; /* rank whose segment 1 source is NULL (-1: none, -2: every rank's) */
} rs_cfg;

/* What the accumulating form finds in the shard before it adds: distinct
 * values everywhere (padding included), of the output dtype. */
static unsigned char *rs_init(const layout *L, ts_dtype d)
{
    unsigned char *out = calloc((size_t)L->shard_numel + 1, ts_dtype_size(d));
    fill(out, d, L->shard_numel, L->me + 5, 7, 0);
    return out;
}

/* Runs the reduce-scatter (direct or packed) into a new shard buffer; with
 * add, the accumulating form (ts__direct_reduce_scatter_add) into a shard
 * that holds rs_init's values. */
static unsigned char *run_rs(ts_comm *c, const layout *L, const rs_cfg *cf, bool direct, bool expect_direct, bool add)
{
    size_t ses = ts_dtype_size(cf->src), oes = ts_dtype_size(cf->out);
    ts__dseg segs[NSEG];
    memcpy(segs, L->segs, sizeof segs);
    void *src[NSEG];
    for (int k = 0; k < NSEG; k++) {
        src[k] = malloc((size_t)L->full_numel[k] * ses);
        fill(src[k], cf->src, L->full_numel[k], L->me, k, 0);
        segs[k].full = k == 1 && (cf->missing == L->me || cf->missing == -2) ? NULL : src[k];
        segs[k].dtype = cf->src;
    }
    unsigned char *out = add ? rs_init(L, cf->out) : calloc((size_t)L->shard_numel + 1, oes);
    ts__direct_set_enabled(direct);
    ts__direct *r = NULL;
    ROK(30,
        (add ? ts__direct_reduce_scatter_add : ts__direct_reduce_scatter)(c, cf->out, out, L->shard_numel, NSEG, segs,
                                                                          cf->op, cf->pre, cf->post, 0, &r));
    ROK(31, ts__direct_wait(r));
    if (ts__direct_was_direct(r) != (direct && expect_direct && L->W > 1))
        RFAIL(32, "reduce_scatter took the %s path", ts__direct_was_direct(r) ? "direct" : "packed");
    /* whether some rank gave a segment a source: the same answer on every
     * rank, from the exchange, on either path */
    for (int k = 0; k < NSEG; k++)
        if (ts__direct_sourced(r, k) != !(k == 1 && cf->missing == -2))
            RFAIL(33, "segment %d (missing %d): sourced %d", k, cf->missing, (int)ts__direct_sourced(r, k));
    if (ts__direct_sourced(r, -1) || ts__direct_sourced(r, NSEG)) RFAIL(34, "a segment out of range is sourced");
    ts__direct_free(r);
    ts__direct_set_enabled(true);
    for (int k = 0; k < NSEG; k++) free(src[k]);
    return out;
}

/* The reference: every rank's sources packed by hand (converted to the
 * output dtype, zero padded) and reduced with ts_reduce_scatter_tensor. */
static unsigned char *ref_rs(ts_comm *c, const layout *L, const rs_cfg *cf)
{
    size_t oes = ts_dtype_size(cf->out), ses = ts_dtype_size(cf->src);
    int64_t n = L->shard_numel, nall = n * L->W;
    ts_tensor *in = NULL, *out = NULL;
    ROK(40, ts_tensor_zeros(cf->out, 1, &nall, &in));
    ROK(41, ts_tensor_zeros(cf->out, 1, &n, &out));
    for (int k = 0; k < NSEG; k++) {
        if (k == 1 && (cf->missing == L->me || cf->missing == -2)) continue;
        unsigned char *s = malloc((size_t)L->full_numel[k] * ses);
        fill(s, cf->src, L->full_numel[k], L->me, k, 0);
        int64_t at = 0;
        for (int j = 0; j < L->W; j++) {
            ts__buf_convert(cf->out, (unsigned char *)ts_tensor_data(in) + (size_t)(j * n + L->off[k]) * oes, cf->src,
                            s + (size_t)at * ses, L->counts[k][j]);
            at += L->counts[k][j];
        }
        free(s);
    }
    ROK(42, ts_reduce_scatter_tensor(c, out, in, cf->op, cf->pre, cf->post, NULL));
    unsigned char *res = calloc((size_t)n + 1, oes);
    memcpy(res, ts_tensor_data(out), (size_t)n * oes);
    ts_tensor_free(in);
    ts_tensor_free(out);
    return res;
}

static void rs_case(ts_comm *c, const layout *L, const rs_cfg *cf, bool expect_direct)
{
    unsigned char *a = run_rs(c, L, cf, true, expect_direct, false), *b = run_rs(c, L, cf, false, false, false),
                  *ref = ref_rs(c, L, cf);
    size_t oes = ts_dtype_size(cf->out);
    for (int k = 0; k < NSEG; k++) {
        size_t at = (size_t)L->off[k] * oes, nb = (size_t)L->counts[k][L->me] * oes;
        if (memcmp(a + at, ref + at, nb) || memcmp(b + at, ref + at, nb))
            RFAIL(
                43,
                "reduce_scatter (%s from %s, op %d, pre %g, post %g, missing %d) segment %d: direct %s, packed %s the "
                "reference",
                ts_dtype_name(cf->out), ts_dtype_name(cf->src), (int)cf->op, cf->pre, cf->post, cf->missing, k,
                memcmp(a + at, ref + at, nb) ? "differs from" : "equals",
                memcmp(b + at, ref + at, nb) ? "differs from" : "equals");
    }
    /* and the sum is what it should be (not only the same on both paths):
     * segment 0's first element for f32 SUM */
    if (cf->out == TS_F32 && cf->src == TS_F32 && cf->op == TS_REDUCE_SUM && cf->pre == 1 && cf->post == 1 &&
        L->counts[0][L->me] > 0) {
        int64_t b0 = 0;
        for (int j = 0; j < L->me; j++) b0 += L->counts[0][j];
        float acc = 0;
        for (int t = 1; t <= L->W; t++) acc += (float)val((L->me + t) % L->W, 0, b0);
        float got;
        memcpy(&got, a + (size_t)L->off[0] * 4, 4);
        if (fabsf(got - acc) > 1e-4f * fabsf(acc) + 1e-5f) RFAIL(44, "sum %g, want %g", got, acc);
    }
    /* the accumulating form, direct and packed: each part is what was
     * there plus the reference's result, added by ts__buf_add as a
     * separate pass would, to the bit; the padding is left alone */
    if (cf->op == TS_REDUCE_SUM || cf->op == TS_REDUCE_AVG) {
        unsigned char *aa = run_rs(c, L, cf, true, expect_direct, true), *ab = run_rs(c, L, cf, false, false, true);
        unsigned char *want = rs_init(L, cf->out);
        for (int k = 0; k < NSEG; k++)
            ts__buf_add(cf->out, want + (size_t)L->off[k] * oes, ref + (size_t)L->off[k] * oes, L->counts[k][L->me]);
        if (memcmp(aa, want, (size_t)L->shard_numel * oes) || memcmp(ab, want, (size_t)L->shard_numel * oes))
            RFAIL(45, "accumulating reduce_scatter (%s from %s, op %d): direct %s, packed %s the separate add",
                  ts_dtype_name(cf->out), ts_dtype_name(cf->src), (int)cf->op,
                  memcmp(aa, want, (size_t)L->shard_numel * oes) ? "differs from" : "equals",
                  memcmp(ab, want, (size_t)L->shard_numel * oes) ? "differs from" : "equals");
        free(aa);
        free(ab);
        free(want);
    }
    free(a);
    free(b);
    free(ref);
}

/* A reduce-scatter on a group and channel of its own moves while the
 * all-gathers of the main group go on in another order on another rank:
 * rank 0 calls the reduce-scatter first, then all-gathers and waits for
 * them; the other ranks all-gather first and call the reduce-scatter
 * only then. On the shared channel rank 0's all-gather would queue
 * behind a reduce-scatter whose exchange waits for ranks that wait for
 * that all-gather (a deadlock until the deadline); on channel 1 it
 * completes, with the reference's bits. */
static void separate_channel(ts_comm *c, const layout *L, bool expect_direct)
{
    int W = L->W;
    int ranks[16];
    for (int j = 0; j < W; j++) ranks[j] = j;
    ts_comm *rsg = NULL;
    ROK(60, ts_comm_new_group(c, W, ranks, &rsg));
    rs_cfg cf = {TS_F32, TS_F32, TS_REDUCE_AVG, 1.0, 1.0, -1};
    ts__dseg segs[NSEG];
    memcpy(segs, L->segs, sizeof segs);
    void *src[NSEG];
    for (int k = 0; k < NSEG; k++) {
        src[k] = malloc((size_t)L->full_numel[k] * 4);
        fill(src[k], TS_F32, L->full_numel[k], L->me, k, 0);
        segs[k].full = src[k];
    }
    unsigned char *out = calloc((size_t)L->shard_numel + 1, 4);
    ts__direct *rs = NULL;
    if (L->me == 0)
        ROK(61, ts__direct_reduce_scatter(rsg, TS_F32, out, L->shard_numel, NSEG, segs, cf.op, 1, 1, 1, &rs));
    ag_case(c, L, TS_F32, expect_direct); /* the main group meanwhile */
    if (L->me != 0)
        ROK(62, ts__direct_reduce_scatter(rsg, TS_F32, out, L->shard_numel, NSEG, segs, cf.op, 1, 1, 1, &rs));
    double t0 = th_now_s();
    while (!ts__direct_done(rs) && th_now_s() - t0 < 20) sched_yield();
    if (!ts__direct_done(rs)) RFAIL(64, "the reduce-scatter on its own channel did not move in 20 s");
    ROK(66, ts__direct_wait(rs));
    if (ts__direct_was_direct(rs) != (expect_direct && W > 1)) RFAIL(68, "took the wrong path");
    unsigned char *ref = ref_rs(c, L, &cf);
    for (int k = 0; k < NSEG; k++) {
        size_t at = (size_t)L->off[k] * 4, nb = (size_t)L->counts[k][L->me] * 4;
        if (memcmp(out + at, ref + at, nb)) RFAIL(69, "separate channel: segment %d differs from the reference", k);
    }
    ts__direct_free(rs);
    free(out);
    for (int k = 0; k < NSEG; k++) free(src[k]);
    free(ref);
    ts_comm_free(rsg);
}

/* ------------------------------------------------------------ the ranks */

static void role_coll(bool expect_direct)
{
    g_rank = atoi(getenv("RANK") ? getenv("RANK") : "-1");
    ts_dist_options o = ts_dist_options_default();
    o.timeout_s = 60;
    ROK(11, ts_dist_init(&o));
    ts_comm *c = ts_dist_world();
    int W = ts_comm_size(c), me = ts_comm_rank(c);
    for (int j = 0; j < W; j++)
        if (j != me && expect_direct && ts__comm_peer_pid(c, j) == 0) RFAIL(12, "rank %d not readable", j);
    layout L;
    make_layout(&L, W, me);
    ag_case(c, &L, TS_F32, expect_direct);
    ag_case(c, &L, TS_BF16, expect_direct);
    const rs_cfg cfgs[] = {
        {TS_F32, TS_F32, TS_REDUCE_SUM, 1.0, 1.0, -1},     {TS_F32, TS_F32, TS_REDUCE_AVG, 1.0, 1.0, -1},
        {TS_F32, TS_F32, TS_REDUCE_SUM, 3.0, 2.0, W - 1},  {TS_F32, TS_F32, TS_REDUCE_AVG, 1.5, 1.0, 0},
        {TS_F32, TS_F32, TS_REDUCE_AVG, 1.0, 1.0, -2},     /* no rank has segment 1: zeros, and not sourced */
        {TS_F32, TS_BF16, TS_REDUCE_AVG, 1.0, 1.0, -1},    /* bf16 gradients reduced in f32 */
        {TS_BF16, TS_BF16, TS_REDUCE_SUM, 1.0, 1.0, -1},   /* bf16, accumulated in f32 */
        {TS_BF16, TS_F32, TS_REDUCE_AVG, 2.0, 1.0, 1 % W}, /* f32 sources rounded to bf16 first, as packing */
        {TS_F64, TS_F32, TS_REDUCE_SUM, 1.0, 3.0, -1},     {TS_F32, TS_F32, TS_REDUCE_MAX, 1.0, 1.0, -1},
    };
    for (size_t i = 0; i < sizeof cfgs / sizeof cfgs[0]; i++) rs_case(c, &L, &cfgs[i], expect_direct);
    separate_channel(c, &L, expect_direct);
    /* ranks that disagree: rank 0 runs another layout; every rank fails
     * naming both, and the group still works afterwards */
    layout L2;
    make_layout(&L2, W, me);
    if (me == 0) L2.segs[2].shard_off += 1;
    float *sh = calloc((size_t)L2.shard_numel + 8, 4);
    void *full[NSEG];
    for (int k = 0; k < NSEG; k++) {
        full[k] = calloc((size_t)L2.full_numel[k], 4);
        L2.segs[k].full = full[k];
    }
    ts__direct *r = NULL;
    ROK(50, ts__direct_all_gather(c, TS_F32, sh, L2.shard_numel + 8, NSEG, L2.segs, &r));
    ts_status st = ts__direct_wait(r);
    if (st != TS_ERR_COMM || !strstr(ts_last_error(), "desynchronised"))
        RFAIL(51, "disagreeing layouts: status %s (%s)", ts_status_str(st), ts_last_error());
    ts__direct_free(r);
    /* a reduce-scatter against an all-gather (same descriptor length when
     * no segments): named on every rank */
    if (me == 0) ROK(52, ts__direct_all_gather(c, TS_F32, sh, 0, 0, NULL, &r));
    else ROK(53, ts__direct_reduce_scatter(c, TS_F32, sh, 0, 0, NULL, TS_REDUCE_SUM, 1, 1, 0, &r));
    st = ts__direct_wait(r);
    if (st != TS_ERR_COMM || !strstr(ts_last_error(), "all_gather") || !strstr(ts_last_error(), "reduce_scatter"))
        RFAIL(54, "all_gather against reduce_scatter: status %s (%s)", ts_status_str(st), ts_last_error());
    ts__direct_free(r);
    for (int k = 0; k < NSEG; k++) free(full[k]);
    /* bad arguments: a status and a message, nothing exchanged */
    int64_t neg[16] = {-1};
    ts__dseg bad = {NULL, TS_F32, 0, neg};
    if (ts__direct_all_gather(c, TS_F32, NULL, 100, 1, &bad, &r) != TS_ERR_INVALID_ARGUMENT || r)
        RFAIL(55, "negative count accepted");
    if (ts__direct_reduce_scatter(c, TS_I64, NULL, 0, 0, NULL, TS_REDUCE_SUM, 1, 1, 0, &r) != TS_ERR_DTYPE)
        RFAIL(56, "i64 output accepted");
    if (ts__direct_reduce_scatter(c, TS_F32, NULL, 0, 0, NULL, TS_REDUCE_MAX, 2, 1, 0, &r) != TS_ERR_INVALID_ARGUMENT)
        RFAIL(57, "MAX with a divisor accepted");
    int64_t far[16] = {0};
    far[W - 1] = 5;
    ts__dseg outside = {sh, TS_F32, 98, far};
    if (ts__direct_all_gather(c, TS_F32, sh, 100, 1, &outside, &r) != TS_ERR_INVALID_ARGUMENT ||
        !strstr(ts_last_error(), "outside the shard"))
        RFAIL(58, "a part outside the shard accepted (%s)", ts_last_error());
    free(sh);
    /* the packed fallback in chunks of 37 elements per rank (f32; 74 in
     * bf16): chunk boundaries inside segments and a padded last chunk,
     * the same bits as the reference and the copy-free path */
    ts__direct_set_fallback_bytes((size_t)W * 37 * 4);
    ag_case(c, &L, TS_F32, expect_direct);
    ag_case(c, &L, TS_BF16, expect_direct);
    for (size_t i = 0; i < sizeof cfgs / sizeof cfgs[0]; i++)
        if (i == 2 || i == 4 || i == 5 || i == 7 || i == 9) rs_case(c, &L, &cfgs[i], expect_direct);
    /* counted as one collective of its kind with the shard's bytes, also
     * when the fallback moved it in chunks (then with the default) */
    for (int pass = 0; pass < 2; pass++) {
        ts_comm_stats_reset(c);
        ag_case(c, &L, TS_F32, expect_direct); /* still in step: one direct and one packed all-gather */
        ts_comm_counters cc;
        ts_comm_stats(c, &cc);
        if (cc.calls[TS_COLL_ALL_GATHER] != 2 || cc.bytes[TS_COLL_ALL_GATHER] != 2 * (uint64_t)L.shard_numel * 4 ||
            cc.calls[TS_COLL_ALL_REDUCE] != 0 || cc.calls[TS_COLL_REDUCE_SCATTER] != 0)
            RFAIL(59,
                  "counters (pass %d): all_gather %llu (%llu bytes, want 2 and %llu), all_reduce %llu, "
                  "reduce_scatter %llu",
                  pass, (unsigned long long)cc.calls[TS_COLL_ALL_GATHER],
                  (unsigned long long)cc.bytes[TS_COLL_ALL_GATHER], (unsigned long long)(2 * L.shard_numel * 4),
                  (unsigned long long)cc.calls[TS_COLL_ALL_REDUCE],
                  (unsigned long long)cc.calls[TS_COLL_REDUCE_SCATTER]);
        ts__direct_set_fallback_bytes(0);
    }
    /* the floor counts the fallback's buffers only where it can happen */
    ts_process_floor fl;
    ROK(18, ts_process_floor_get(&fl));
    if ((ts__direct_fallback_bytes(c) > 0) == expect_direct || fl.fallback_bytes != ts__direct_fallback_bytes(c))
        RFAIL(17, "fallback bytes %zu (floor's %zu) with %s peers", ts__direct_fallback_bytes(c), fl.fallback_bytes,
              expect_direct ? "readable" : "unreadable");
    ROK(19, ts_dist_finalize());
    fflush(stderr);
    _exit(0);
}

/* What the packed fallback adds to the process: ranks that cannot read
 * each other (TS_UCX_CMA=0: as ranks on two hosts) all-gather and
 * reduce-scatter 64 MiB (two segments, 48 and 16 MiB, float32) through
 * it; the tensor pool, which keeps every block it ever held, and the
 * peak resident set may grow by ts__direct_fallback_bytes at most (plus
 * 8 MiB of slack for the resident set), not by the packed W-block
 * buffer (64 MiB, and 32 MiB for this rank's block, before chunking).
 * A 2 MiB chunk budget, so that the bound (about 14 MiB at 2 ranks) is
 * well below the data. */
static double vmhwm(void)
{
    ts_process_memory m;
    ROK(70, ts_process_memory_read(&m));
    return (double)m.peak_rss_bytes;
}

static void role_bound(void)
{
    g_rank = atoi(getenv("RANK") ? getenv("RANK") : "-1");
    ts_dist_options o = ts_dist_options_default();
    o.timeout_s = 60;
    ROK(71, ts_dist_init(&o));
    ts_comm *c = ts_dist_world();
    int W = ts_comm_size(c), me = ts_comm_rank(c);
    ts__direct_set_fallback_bytes((size_t)2 << 20);
    const int64_t rows[2] = {3072, 1024}, cols = 4096; /* 48 and 16 MiB */
    int64_t counts[2][16], full_n = (rows[0] + rows[1]) * cols, shard_n = 0;
    ts__dseg segs[2];
    float *full[2], *src[2];
    for (int k = 0; k < 2; k++) {
        for (int j = 0; j < W; j++) {
            int64_t r0, n;
            ts_chunk_range(rows[k], W, j, &r0, &n);
            counts[k][j] = n * cols;
        }
        full[k] = malloc((size_t)(rows[k] * cols) * 4);
        src[k] = malloc((size_t)(rows[k] * cols) * 4);
        if (!full[k] || !src[k]) RFAIL(72, "out of memory");
        for (int64_t i = 0; i < rows[k] * cols; i++) full[k][i] = src[k][i] = (float)(i % 977) + (float)me;
        segs[k] = (ts__dseg){full[k], TS_F32, shard_n, counts[k]};
        shard_n += (rows[k] + W - 1) / W * cols;
    }
    float *shard = calloc((size_t)shard_n, 4);
    if (!shard) RFAIL(72, "out of memory");
    for (int k = 0; k < 2; k++) { /* this rank's part of the all-gather's input */
        int64_t b0 = 0;
        for (int j = 0; j < me; j++) b0 += counts[k][j];
        memcpy(shard + segs[k].shard_off, full[k] + b0, (size_t)counts[k][me] * 4);
    }
    size_t bound = ts__direct_fallback_bytes(c);
    if (bound == 0 || bound * 4 > (size_t)full_n * 4)
        RFAIL(73, "the fallback's bound is %zu bytes for %lld bytes of data", bound, (long long)(full_n * 4));
    size_t pool0 = ts_mem_live_bytes(TS_MEM_POOL);
    double hwm0 = vmhwm();
    ts__direct *r = NULL;
    ROK(74, ts__direct_all_gather(c, TS_F32, shard, shard_n, 2, segs, &r));
    ROK(75, ts__direct_wait(r));
    if (ts__direct_was_direct(r)) RFAIL(76, "the all-gather took the copy-free path");
    ts__direct_free(r);
    for (int k = 0; k < 2; k++) segs[k].full = (unsigned char *)src[k];
    ROK(77, ts__direct_reduce_scatter(c, TS_F32, shard, shard_n, 2, segs, TS_REDUCE_SUM, 1, 1, 0, &r));
    ROK(78, ts__direct_wait(r));
    ts__direct_free(r);
    size_t pool1 = ts_mem_live_bytes(TS_MEM_POOL);
    double hwm1 = vmhwm();
    /* the data is right: rank q's element i is i % 977 + q */
    for (int k = 0; k < 2; k++) {
        int64_t at = 0;
        for (int j = 0; j < W; j++) {
            for (int64_t i = at; i < at + counts[k][j]; i += 4093)
                if (full[k][i] != (float)(i % 977) + (float)j)
                    RFAIL(79, "all_gather: segment %d element %lld", k, (long long)i);
            at += counts[k][j];
        }
        int64_t b0 = 0;
        for (int j = 0; j < me; j++) b0 += counts[k][j];
        for (int64_t i = 0; i < counts[k][me]; i += 4093) {
            float want = 0;
            for (int q = 0; q < W; q++) want += (float)((b0 + i) % 977) + (float)q;
            if (fabsf(shard[segs[k].shard_off + i] - want) > 1e-3f * want)
                RFAIL(80, "reduce_scatter: segment %d element %lld = %g, want %g", k, (long long)i,
                      (double)shard[segs[k].shard_off + i], (double)want);
        }
    }
    if (pool1 - pool0 > bound)
        RFAIL(81, "the packed fallback grew the pool by %.1f MiB (bound %.1f MiB) for %.1f MiB of data",
              (double)(pool1 - pool0) / 1048576.0, (double)bound / 1048576.0, (double)full_n * 4 / 1048576.0);
    if (hwm1 - hwm0 > (double)bound + 8.0 * 1048576.0)
        RFAIL(82, "the packed fallback grew the peak RSS by %.1f MiB (bound %.1f MiB + 8) for %.1f MiB of data",
              (hwm1 - hwm0) / 1048576.0, (double)bound / 1048576.0, (double)full_n * 4 / 1048576.0);
    fprintf(stderr, "rank %d: pool +%.1f MiB, VmHWM +%.1f MiB, bound %.1f MiB\n", me,
            (double)(pool1 - pool0) / 1048576.0, (hwm1 - hwm0) / 1048576.0, (double)bound / 1048576.0);
    ts__direct_set_fallback_bytes(0);
    for (int k = 0; k < 2; k++) {
        free(full[k]);
        free(src[k]);
    }
    free(shard);
    ROK(83, ts_dist_finalize());
    fflush(stderr);
    _exit(0);
}

__attribute__((constructor)) static void direct_test_role(void)
{
    const char *role = getenv("TS_TEST_DIRECT_ROLE");
    if (!role) return;
    if (strcmp(role, "coll") == 0) role_coll(true);
    if (strcmp(role, "refused") == 0) role_coll(false);
    if (strcmp(role, "bound") == 0) role_bound();
    fprintf(stderr, "unknown TS_TEST_DIRECT_ROLE=%s\n", role);
    _exit(6);
}

static void launch(int W, const char *role)
{
    th_clear_launch_env();
    setenv("TS_TEST_DIRECT_ROLE", role, 1);
    if (strcmp(role, "refused") == 0 || strcmp(role, "bound") == 0) setenv("TS_UCX_CMA", "0", 1);
    ts_launch_result res;
    th_launch_self(W, &res);
    unsetenv("TS_TEST_DIRECT_ROLE");
    unsetenv("TS_UCX_CMA");
    cr_assert_eq(res.exit_code, 0, "rank %d failed: exit %d signal %d", res.failed_rank, res.exit_code,
                 res.failed_signal);
}

Test(comm_coll_direct, equals_the_packed_path_bitwise_on_2_ranks, .timeout = 120) { launch(2, "coll"); }
Test(comm_coll_direct, equals_the_packed_path_bitwise_on_3_ranks, .timeout = 120) { launch(3, "coll"); }
Test(comm_coll_direct, equals_the_packed_path_bitwise_on_4_ranks, .timeout = 120) { launch(4, "coll"); }
Test(comm_coll_direct, falls_back_to_the_packed_path_when_cma_is_refused, .timeout = 120) { launch(3, "refused"); }
Test(comm_coll_direct, packed_fallback_memory_is_bounded_by_its_chunks, .timeout = 120) { launch(2, "bound"); }
