#define _GNU_SOURCE
/*
 * Copy-free collectives over segment lists (coll_direct.h).
 *
 * A call checks its arguments, builds this rank's descriptor (below),
 * starts its all-gather on the group and queues the collective on its
 * channel's worker thread (see "channels"), which finishes that
 * exchange, checks that every rank runs the same collective on the same
 * layout, and then, when every rank announced it can read every peer,
 * reads with process_vm_readv: the peers' parts straight into this
 * rank's segments (all-gather), or this rank's part of every peer's
 * source in pieces of PIECE elements, each converted and added into an
 * accumulation piece in the ring's order (reduce-scatter). The wait, on
 * the caller's thread, blocks until then and collects the peers'
 * acknowledgements, which the worker sent as soon as its reads were done
 * (point to point, this rank's read failure: its rank + 1, 0: none;
 * tagged with the exchange's sequence number), so that every rank
 * returns the same status and none changes its buffers before every
 * reader is done; or, when some rank cannot read, it runs the packed
 * fallback (the same data packed into W-block buffers, a bounded chunk
 * at a time, and the ring collective of comm.h per chunk) in call order.
 *
 * Summation order (comm.c's ring): block b of a reduce-scatter starts at
 * rank b+1 and passes ranks b+2, ..., b+W-1 before rank b adds its own
 * and divides: acc = load(src[b+1] / pre); acc = acc op load(src[b+k] /
 * pre) for k = 2..W (rank b last); out = acc / post converted. Each load
 * converts a source to the output dtype first (as packing would) and then
 * to the accumulation dtype. The same kernels (tensor/kernels.h) as
 * comm.c, so the results are bitwise the ring's.
 *
 * The descriptor, W of them exchanged (int64 each):
 *   [0] MAGIC << 8 | kind       [1] dtype | rop << 8 | readable << 16
 *   [2] nseg                    [3] layout hash (counts, shard offsets)
 *   [4] pid                     [5] pre, [6] post (double bits)
 *   [7] all-gather: shard address
 *   [8 + 2k], [9 + 2k]  reduce-scatter: segment k's source address, dtype
 */
#include "comm/coll_direct.h"

#include "comm/comm_internal.h"
#include "comm/xmem.h"
#include "tensor/kernels.h"
#include "tensor/kernels.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <sys/uio.h>
#include <unistd.h>

#define MAGIC 0x5453444cll /* "TSDL" */
#define HDR 8
#define PIECE 4096 /* reduce-scatter elements per read: 16-32 KiB, stays in L1/L2 */
#define ERRLEN 320
/* The packed fallback's W-chunk buffer (see "fallback"): 16 MiB, or
 * 256 KiB per rank in worlds of more than 64 ranks, so that a ring step's
 * message stays large enough for the network's bandwidth. */
#define TS_DIRECT_FALLBACK_BYTES ((size_t)16 << 20)
#define TS_DIRECT_FALLBACK_MIN_PER_RANK ((size_t)256 << 10)
/* Chunks of the packed fallback in flight at once, each with its buffers. */
#ifndef FALLBACK_DEPTH
#define FALLBACK_DEPTH 2
#endif

enum { K_AG = 1, K_RS = 2 };

typedef struct dseg {
    unsigned char *full;
    ts_dtype dtype;
    int64_t shard_off;
} dseg;

struct ts__direct {
    ts_comm *c;
    int kind, W, rank;
    ts_dtype d;
    ts_reduce_op rop;
    double pre, post;
    const unsigned char *shard_in; /* all-gather */
    unsigned char *shard_out;      /* reduce-scatter */
    bool add; /* reduce-scatter: the result is added into shard_out (ts__direct_reduce_scatter_add) */
    int nseg;
    int64_t shard_numel;
    dseg *segs;
    int64_t *counts; /* nseg x W */
    int64_t *starts; /* nseg x W: where part j starts in full (elements) */
    ts_tensor *desc_in, *desc_out;
    ts_request *desc_req;
    int channel;
    uint64_t gid, t_call;
    uint32_t seq;
    /* the data's move (move(), on the channel's worker or in the wait) */
    ts__direct *qnext;
    bool queued;
    atomic_bool moved;
    bool agreed;   /* every rank runs this collective on this layout */
    bool readable; /* every rank can read every peer: the copy-free path */
    ts_status move_st;
    char move_err[ERRLEN];
    /* the acknowledgements (copy-free path): this rank's status to every
     * peer and theirs (rank + 1 of a failed reader, 0: none), point to
     * point with the exchange's sequence number as tag, sent as soon as
     * the reads are done */
    ts_tensor *ack_out, *ack_in; /* 1 and W int64 */
    ts_request **ack_req;        /* 2W: sends, receives */
    /* the wait */
    bool waited, direct;
    ts_status status;
    char err[ERRLEN];
};

static atomic_int g_enabled = -1; /* -1: not read yet */

void ts__direct_set_enabled(bool on) { atomic_store(&g_enabled, on ? 1 : 0); }

static bool enabled(void)
{
    int e = atomic_load(&g_enabled);
    if (e < 0) {
        const char *v = getenv("TS_COMM_DIRECT");
        int want = v && strcmp(v, "0") == 0 ? 0 : 1;
        int exp = -1;
        atomic_compare_exchange_strong(&g_enabled, &exp, want);
        e = atomic_load(&g_enabled);
    }
    return e != 0;
}

static const char *kind_name(int k) { return k == K_AG ? "all_gather" : k == K_RS ? "reduce_scatter" : "?"; }

static bool reducible(ts_dtype d) { return d == TS_F32 || d == TS_F64 || d == TS_BF16 || d == TS_F16; }

static ts__buf_op buf_op(ts_reduce_op rop)
{
    return rop == TS_REDUCE_MAX ? TS__BUF_MAX : rop == TS_REDUCE_MIN ? TS__BUF_MIN : TS__BUF_SUM;
}

/* ------------------------------------------------------------ setup */

static uint64_t mix(uint64_t h, uint64_t v)
{
    h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    return h * 0x100000001b3ull;
}

static void req_free_parts(ts__direct *r)
{
    for (int i = 0; r->ack_req && i < 2 * r->W; i++) ts_request_free(r->ack_req[i]);
    ts__free(TS_MEM_COMM, r->ack_req);
    ts_tensor_free(r->ack_out);
    ts_tensor_free(r->ack_in);
    ts_request_free(r->desc_req);
    ts_tensor_free(r->desc_in);
    ts_tensor_free(r->desc_out);
    ts__free(TS_MEM_COMM, r->segs);
    ts__free(TS_MEM_COMM, r->counts);
    ts__free(TS_MEM_COMM, r->starts);
    ts__free(TS_MEM_COMM, r);
}

static bool enqueue(ts__direct *r);

static ts_status start(const char *fn, int kind, int channel, ts_comm *c, ts_dtype d, const void *shard_in,
                       void *shard_out, bool add, int64_t shard_numel, int nseg, const ts__dseg *segs, ts_reduce_op rop,
                       double pre, double post, ts__direct **out)
{
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL out", fn);
    *out = NULL;
    if (!c) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL group", fn);
    if (shard_numel < 0)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: shard of %lld elements", fn, (long long)shard_numel);
    if (nseg < 0 || (nseg > 0 && !segs))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %d segments%s", fn, nseg, segs ? "" : " and NULL segs");
    int W = ts_comm_size(c), me = ts_comm_rank(c);
    size_t es = ts_dtype_size(d);
    int64_t own = 0;
    for (int k = 0; k < nseg; k++) {
        if (!segs[k].counts) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: segment %d has NULL counts", fn, k);
        if (segs[k].shard_off < 0)
            return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: segment %d: shard offset %lld < 0", fn, k,
                            (long long)segs[k].shard_off);
        for (int j = 0; j < W; j++)
            if (segs[k].counts[j] > 0 && segs[k].shard_off + segs[k].counts[j] > shard_numel)
                return ts_error(TS_ERR_INVALID_ARGUMENT,
                                "%s: segment %d: rank %d's part [%lld, %lld) lies outside the shard of %lld elements",
                                fn, k, j, (long long)segs[k].shard_off,
                                (long long)(segs[k].shard_off + segs[k].counts[j]), (long long)shard_numel);
        int64_t tot = 0;
        for (int j = 0; j < W; j++) {
            if (segs[k].counts[j] < 0)
                return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: segment %d: rank %d's count %lld < 0", fn, k, j,
                                (long long)segs[k].counts[j]);
            tot += segs[k].counts[j];
        }
        if (kind == K_AG && tot > 0 && !segs[k].full)
            return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: segment %d (%lld elements) has no output", fn, k,
                            (long long)tot);
        if (kind == K_RS && segs[k].full && !reducible(segs[k].dtype) && segs[k].dtype != d)
            return ts_error(TS_ERR_DTYPE, "%s: segment %d's source is %s; sources are float or the output's %s", fn, k,
                            ts_dtype_name(segs[k].dtype), ts_dtype_name(d));
        own += segs[k].counts[me];
    }
    if (own > 0 && !(kind == K_AG ? shard_in : shard_out))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL shard for %lld elements of this rank", fn, (long long)own);
    ts__direct *r = ts__calloc(TS_MEM_COMM, 1, sizeof *r);
    if (!r) return TS_ERR_NO_MEMORY;
    r->c = c;
    r->kind = kind;
    r->W = W;
    r->rank = me;
    r->d = d;
    r->rop = rop;
    r->pre = pre;
    r->post = post;
    r->shard_in = shard_in;
    r->shard_out = shard_out;
    r->add = add;
    r->nseg = nseg;
    r->shard_numel = shard_numel;
    size_t nc = (size_t)(nseg ? nseg : 1) * (size_t)W;
    r->segs = ts__calloc(TS_MEM_COMM, (size_t)(nseg ? nseg : 1), sizeof *r->segs);
    r->counts = ts__malloc(TS_MEM_COMM, nc * sizeof *r->counts);
    r->starts = ts__malloc(TS_MEM_COMM, nc * sizeof *r->starts);
    int64_t nd = HDR + (kind == K_RS ? 2 * (int64_t)nseg : 0), nall = nd * W;
    ts_status st = TS_OK;
    if (!r->segs || !r->counts || !r->starts) st = TS_ERR_NO_MEMORY;
    if (!st) st = ts_tensor_new_cpu(false, TS_I64, 1, &nd, &r->desc_in);
    if (!st) st = ts_tensor_new_cpu(false, TS_I64, 1, &nall, &r->desc_out);
    if (st) {
        req_free_parts(r);
        return st;
    }
    uint64_t h = mix(0, (uint64_t)nseg);
    for (int k = 0; k < nseg; k++) {
        r->segs[k] = (dseg){segs[k].full, kind == K_RS && segs[k].full ? segs[k].dtype : d, segs[k].shard_off};
        int64_t at = 0;
        for (int j = 0; j < W; j++) {
            r->counts[(size_t)k * W + j] = segs[k].counts[j];
            r->starts[(size_t)k * W + j] = at;
            at += segs[k].counts[j];
            h = mix(h, (uint64_t)segs[k].counts[j]);
        }
        h = mix(h, (uint64_t)segs[k].shard_off);
    }
    bool readable = enabled() && W > 1;
    for (int j = 0; j < W && readable; j++)
        if (j != me && ts__comm_peer_pid(c, j) == 0) readable = false;
    int64_t *dd = ts_tensor_data(r->desc_in);
    memset(dd, 0, (size_t)nd * sizeof *dd);
    dd[0] = MAGIC << 8 | kind;
    dd[1] = (int64_t)d | (int64_t)rop << 8 | (int64_t)readable << 16;
    dd[2] = nseg;
    memcpy(&dd[3], &h, 8);
    dd[4] = (int64_t)getpid();
    memcpy(&dd[5], &pre, 8);
    memcpy(&dd[6], &post, 8);
    dd[7] = (int64_t)(uintptr_t)shard_in;
    for (int k = 0; k < nseg && kind == K_RS; k++) {
        dd[HDR + 2 * k] = (int64_t)(uintptr_t)r->segs[k].full;
        dd[HDR + 2 * k + 1] = (int64_t)r->segs[k].dtype;
    }
    (void)es;
    r->channel = channel;
    r->gid = ts__comm_gid(c);
    r->seq = ts__comm_next_seq(c);
    r->t_call = ts_now_ns();
    if ((st = ts_all_gather_into_tensor(c, r->desc_out, r->desc_in, &r->desc_req))) {
        req_free_parts(r);
        return st;
    }
    /* counted as what it is, not as the exchange */
    ts__comm_count(c, TS_COLL_ALL_GATHER, -1, -nd * 8);
    if (kind == K_AG) ts__comm_count(c, TS_COLL_ALL_GATHER, 1, shard_numel * (int64_t)ts_dtype_size(d));
    else ts__comm_count(c, TS_COLL_REDUCE_SCATTER, 1, (int64_t)W * shard_numel * (int64_t)ts_dtype_size(d));
    r->queued = W > 1 && enqueue(r); /* else the wait moves the data (one rank: a local copy, no hand-off) */
    *out = r;
    return TS_OK;
}

ts_status ts__direct_all_gather(ts_comm *c, ts_dtype d, const void *shard, int64_t shard_numel, int nseg,
                                const ts__dseg *segs, ts__direct **out)
{
    return start("ts__direct_all_gather", K_AG, 0, c, d, shard, NULL, false, shard_numel, nseg, segs, TS_REDUCE_SUM,
                 1.0, 1.0, out);
}

static ts_status start_rs(const char *fn, bool add, ts_comm *c, ts_dtype d, void *shard, int64_t shard_numel, int nseg,
                          const ts__dseg *segs, ts_reduce_op rop, double pre, double post, int channel,
                          ts__direct **out)
{
    if (out) *out = NULL;
    if (!reducible(d)) return ts_error(TS_ERR_DTYPE, "%s: cannot reduce into %s", fn, ts_dtype_name(d));
    if ((unsigned)rop >= TS_REDUCE_OP_COUNT)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: bad reduce op %d", fn, (int)rop);
    if (!(pre > 0) || !(post > 0) || !isfinite(pre) || !isfinite(post))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: divide factors must be finite and > 0 (%g, %g)", fn, pre, post);
    if ((rop == TS_REDUCE_MAX || rop == TS_REDUCE_MIN) && (pre != 1.0 || post != 1.0))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: MAX and MIN take no divide factors", fn);
    if (channel != 0 && channel != 1)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: channel %d (0: shared, 1: the reductions' own)", fn, channel);
    return start(fn, K_RS, channel, c, d, NULL, shard, add, shard_numel, nseg, segs, rop, pre, post, out);
}

ts_status ts__direct_reduce_scatter(ts_comm *c, ts_dtype d, void *shard, int64_t shard_numel, int nseg,
                                    const ts__dseg *segs, ts_reduce_op rop, double pre, double post, int channel,
                                    ts__direct **out)
{
    return start_rs("ts__direct_reduce_scatter", false, c, d, shard, shard_numel, nseg, segs, rop, pre, post, channel,
                    out);
}

ts_status ts__direct_reduce_scatter_add(ts_comm *c, ts_dtype d, void *shard, int64_t shard_numel, int nseg,
                                        const ts__dseg *segs, ts_reduce_op rop, double pre, double post, int channel,
                                        ts__direct **out)
{
    return start_rs("ts__direct_reduce_scatter_add", true, c, d, shard, shard_numel, nseg, segs, rop, pre, post,
                    channel, out);
}

/* ------------------------------------------------------------ reads */

/* Reads the remote list into the local list (equal total bytes) from
 * process pid: ts__xmem_readv (xmem.h). */
static int cma_read(pid_t pid, struct iovec *l, size_t nl, struct iovec *rv, size_t nr)
{
    return ts__xmem_readv(pid, l, nl, rv, nr, NULL);
}

static int64_t cnt(const ts__direct *r, int k, int j) { return r->counts[(size_t)k * r->W + j]; }
static int64_t beg(const ts__direct *r, int k, int j) { return r->starts[(size_t)k * r->W + j]; }

/* All-gather: this rank's parts from its shard, every peer's read. */
static ts_status ag_direct(ts__direct *r, const int64_t *desc, int nd, int *bad_peer)
{
    size_t es = ts_dtype_size(r->d);
    for (int k = 0; k < r->nseg; k++) {
        int64_t n = cnt(r, k, r->rank);
        if (n > 0)
            memmove(r->segs[k].full + (size_t)beg(r, k, r->rank) * es, r->shard_in + (size_t)r->segs[k].shard_off * es,
                    (size_t)n * es);
    }
    struct iovec *l = ts__malloc(TS_MEM_COMM, (size_t)(r->nseg ? r->nseg : 1) * 2 * sizeof *l),
                 *rv = l + (r->nseg ? r->nseg : 1);
    if (!l) return TS_ERR_NO_MEMORY;
    ts_status st = TS_OK;
    for (int t = 1; t < r->W && !st; t++) {
        int j = (r->rank + t) % r->W;
        uintptr_t base = (uintptr_t)desc[(size_t)j * nd + 7];
        size_t n = 0;
        for (int k = 0; k < r->nseg; k++) {
            int64_t c = cnt(r, k, j);
            if (c <= 0) continue;
            l[n] = (struct iovec){r->segs[k].full + (size_t)beg(r, k, j) * es, (size_t)c * es};
            rv[n] = (struct iovec){(void *)(base + (size_t)r->segs[k].shard_off * es), (size_t)c * es};
            n++;
        }
        if (!n) continue;
        TS_TRACE_BEGIN(t0);
        int e = cma_read((pid_t)ts__comm_peer_pid(r->c, j), l, n, rv, n);
        TS_TRACE_END(t0, "comm.direct_read", "comm");
        if (e) {
            *bad_peer = j;
            st = ts_error(TS_ERR_COMM, "direct all_gather: rank %d could not read rank %d's shard: %s", r->rank, j,
                          strerror(e));
        }
    }
    ts__free(TS_MEM_COMM, l);
    return st;
}

/* Reduce-scatter: this rank's part of every segment, summed in the ring's
 * order piece by piece (see the top); each finished piece is written into
 * the output, or (r->add) added into it. */
static ts_status rs_direct(ts__direct *r, const int64_t *desc, int nd, int *bad_peer)
{
    ts_dtype rd = r->d, ad = ts__acc_dtype(rd);
    size_t res = ts_dtype_size(rd), aes = ts_dtype_size(ad);
    double post = r->post * (r->rop == TS_REDUCE_AVG ? r->W : 1);
    unsigned char *mem = ts__malloc(TS_MEM_COMM, (size_t)PIECE * 8 * 4);
    if (!mem) return TS_ERR_NO_MEMORY;
    unsigned char *acc = mem, *rbuf = mem + PIECE * 8, *cbuf = rbuf + PIECE * 8, *lbuf = cbuf + PIECE * 8;
    ts_status st = TS_OK;
    uint64_t tread = 0;
    for (int k = 0; k < r->nseg && !st; k++) {
        int64_t n = cnt(r, k, r->rank), b0 = beg(r, k, r->rank);
        unsigned char *out = r->shard_out + (size_t)r->segs[k].shard_off * res;
        for (int64_t i = 0; i < n && !st; i += PIECE) {
            int64_t m = n - i < PIECE ? n - i : PIECE;
            for (int t = 1; t <= r->W && !st; t++) {
                int j = (r->rank + t) % r->W;
                const unsigned char *sp;
                ts_dtype sd;
                if (j == r->rank) {
                    sd = r->segs[k].dtype;
                    sp = r->segs[k].full ? r->segs[k].full + (size_t)(b0 + i) * ts_dtype_size(sd) : NULL;
                } else {
                    uintptr_t a = (uintptr_t)desc[(size_t)j * nd + HDR + 2 * k];
                    sd = (ts_dtype)desc[(size_t)j * nd + HDR + 2 * k + 1];
                    sp = NULL;
                    if (a) {
                        size_t se = ts_dtype_size(sd);
                        struct iovec lv = {rbuf, (size_t)m * se},
                                     rv = {(void *)(a + (size_t)(b0 + i) * se), (size_t)m * se};
                        uint64_t t0 = ts_trace_enabled() ? ts_now_ns() : 0;
                        int e = cma_read((pid_t)ts__comm_peer_pid(r->c, j), &lv, 1, &rv, 1);
                        if (t0) tread += ts_now_ns() - t0;
                        if (e) {
                            *bad_peer = j;
                            st = ts_error(TS_ERR_COMM,
                                          "direct reduce_scatter: rank %d could not read rank %d's source %d: %s",
                                          r->rank, j, k, strerror(e));
                            break;
                        }
                        sp = rbuf;
                    }
                }
                if (!sp) { /* no source: zeros of the output dtype, as packing writes */
                    memset(lbuf, 0, (size_t)m * res);
                    sp = lbuf;
                    sd = rd;
                }
                if (sd != rd) { /* packing's conversion to the output dtype */
                    ts__buf_convert(rd, cbuf, sd, sp, m);
                    sp = cbuf;
                }
                if (t == 1) { /* the block's first contribution: loaded (comm.c's send0) */
                    ts__buf_convert(ad, acc, rd, sp, m);
                    ts__buf_div(ad, acc, m, r->pre);
                } else if (rd == ad && r->pre == 1.0) {
                    ts__buf_reduce(ad, buf_op(r->rop), acc, acc, sp, m);
                } else {
                    ts__buf_convert(ad, lbuf, rd, sp, m);
                    ts__buf_div(ad, lbuf, m, r->pre);
                    ts__buf_reduce(ad, buf_op(r->rop), acc, acc, lbuf, m);
                }
            }
            if (st) break;
            ts__buf_div(ad, acc, m, post);
            if (!r->add) {
                ts__buf_convert(rd, out + (size_t)i * res, ad, acc, m);
            } else if (rd == ad) { /* the finished piece added into out: out + sum, as a separate add would */
                ts__buf_add(rd, out + (size_t)i * res, acc, m);
            } else { /* rounded to the output dtype first, as the separate add's operand is */
                ts__buf_convert(rd, cbuf, ad, acc, m);
                ts__buf_add(rd, out + (size_t)i * res, cbuf, m);
            }
        }
    }
    (void)aes;
    if (tread) {
        uint64_t now = ts_now_ns();
        ts_trace_span("comm.direct_read", "comm", now - tread, now);
    }
    ts__free(TS_MEM_COMM, mem);
    return st;
}

/* ------------------------------------------------------- fallback
 *
 * The packed ring collective over the same data (some pair cannot read),
 * in chunks: rank j's packed block (its parts of every segment, in
 * segment order, zero padded to the largest rank's) is cut into chunks
 * of `chunk` elements, and each chunk is one ring collective over a
 * W-chunk buffer, FALLBACK_DEPTH chunks in flight (packing and unpacking
 * overlap the rings' steps), each slot's buffers the same for every
 * chunk (the last chunk padded with zeros, so that no other size is
 * asked of the pool). The
 * whole packed buffer (W x the block: 295 MiB for GPT-2-small's
 * embeddings) would stay in the caching pool for the process's life;
 * the chunks bound what the fallback adds to about
 * ts__direct_fallback_bytes. Each element meets the same ranks in the
 * same ring order as in one packed collective, so the results are
 * bitwise the same. */

static atomic_size_t g_fallback_budget; /* 0: the default */

void ts__direct_set_fallback_bytes(size_t bytes) { atomic_store(&g_fallback_budget, bytes); }

/* The packed W-chunk buffer's bytes for a group of W ranks. */
static size_t fallback_budget(int W)
{
    size_t b = atomic_load(&g_fallback_budget);
    if (b) return b;
    size_t min_total = (size_t)W * TS_DIRECT_FALLBACK_MIN_PER_RANK;
    return min_total > TS_DIRECT_FALLBACK_BYTES ? min_total : TS_DIRECT_FALLBACK_BYTES;
}

/* Elements of one rank's chunk, for a per-rank block of `block`. */
static int64_t fallback_chunk(int W, size_t es, int64_t block)
{
    int64_t c = (int64_t)(fallback_budget(W) / ((size_t)W * es));
    if (c < 1) c = 1;
    return c < block ? c : block;
}

size_t ts__direct_fallback_bytes(ts_comm *c)
{
    if (!c) return 0;
    int W = ts_comm_size(c), me = ts_comm_rank(c);
    if (W < 2) return 0;
    bool readable = enabled();
    for (int j = 0; j < W && readable; j++)
        if (j != me && ts__comm_peer_pid(c, j) == 0) readable = false;
    if (readable) return 0;
    /* the largest case: 16-bit data reduced in float32 with a divisor
     * (the ring's staging is two blocks and a converted copy, in the
     * accumulation dtype) */
    size_t chunk_bytes = (size_t)fallback_chunk(W, 2, INT64_MAX) * 2;
    return FALLBACK_DEPTH *
        (ts__pool_block_bytes((size_t)W * chunk_bytes) + ts__pool_block_bytes(chunk_bytes) +
         ts__comm_reduce_scatter_scratch(c, TS_BF16, (int64_t)(chunk_bytes / 2), 2.0));
}

/* Copies packed elements [lo, hi) of rank j's block between `packed`
 * (element lo at packed[0]) and the segments: to_packed: from this rank's
 * shard (all-gather's input, j = this rank) or from each segment's source
 * converted to d (reduce-scatter's input: zeros where it has none);
 * else into the segments' full arrays (all-gather's output) or this
 * rank's shard (reduce-scatter's output, added with r->add). */
static void packed_copy(ts__direct *r, int j, int64_t lo, int64_t hi, unsigned char *packed, bool to_packed)
{
    size_t es = ts_dtype_size(r->d);
    int64_t at = 0;
    for (int k = 0; k < r->nseg && at < hi; k++) {
        int64_t n = cnt(r, k, j), a = lo > at ? lo : at, b = hi < at + n ? hi : at + n;
        if (a < b) {
            const dseg *s = &r->segs[k];
            unsigned char *p = packed + (size_t)(a - lo) * es;
            int64_t off = a - at, m = b - a; /* into this part */
            if (r->kind == K_AG && to_packed)
                memcpy(p, r->shard_in + (size_t)(s->shard_off + off) * es, (size_t)m * es);
            else if (r->kind == K_AG) memcpy(s->full + (size_t)(beg(r, k, j) + off) * es, p, (size_t)m * es);
            else if (to_packed && s->full)
                ts__buf_convert(r->d, p, s->dtype, s->full + (size_t)(beg(r, k, j) + off) * ts_dtype_size(s->dtype), m);
            else if (!to_packed && r->add) ts__buf_add(r->d, r->shard_out + (size_t)(s->shard_off + off) * es, p, m);
            else if (!to_packed) memcpy(r->shard_out + (size_t)(s->shard_off + off) * es, p, (size_t)m * es);
        }
        at += n;
    }
}

static ts_status packed(ts__direct *r)
{
    int W = r->W, me = r->rank;
    int64_t block = 0;
    for (int j = 0; j < W; j++) {
        int64_t tot = 0;
        for (int k = 0; k < r->nseg; k++) tot += cnt(r, k, j);
        if (tot > block) block = tot;
    }
    size_t es = ts_dtype_size(r->d);
    int64_t chunk = fallback_chunk(W, es, block), nall = chunk * W;
    int64_t nchunk = chunk ? (block + chunk - 1) / chunk : 1;
    int nslot = nchunk < FALLBACK_DEPTH ? (int)nchunk : FALLBACK_DEPTH;
    /* per slot: a rank's chunk, the W-chunk buffer, the chunk's collective */
    ts_tensor *one[FALLBACK_DEPTH] = {0}, *all[FALLBACK_DEPTH] = {0};
    ts_request *req[FALLBACK_DEPTH] = {0};
    ts_status st = TS_OK;
    for (int i = 0; i < nslot && !st; i++)
        if (!(st = ts_tensor_new_cpu(false, r->d, 1, &chunk, &one[i])))
            st = ts_tensor_new_cpu(false, r->d, 1, &nall, &all[i]);
    /* chunk t goes in slot t % nslot; its result is unpacked when the slot
     * is needed again, or at the end, in chunk order */
    for (int64_t t = 0; t < nchunk + nslot && !st; t++) {
        int64_t u = t - nslot; /* the chunk whose slot t takes */
        int i = (int)(t % nslot);
        if (u >= 0) {
            st = ts_request_wait(req[i]);
            ts_request_free(req[i]);
            req[i] = NULL;
            if (st) break;
            unsigned char *p1 = ts_tensor_data(one[i]), *pa = ts_tensor_data(all[i]);
            if (r->kind == K_AG)
                for (int j = 0; j < W; j++)
                    packed_copy(r, j, u * chunk, (u + 1) * chunk, pa + (size_t)j * chunk * es, false);
            else packed_copy(r, me, u * chunk, (u + 1) * chunk, p1, false);
        }
        if (t >= nchunk) continue;
        int64_t lo = t * chunk, hi = lo + chunk;
        unsigned char *p1 = ts_tensor_data(one[i]), *pa = ts_tensor_data(all[i]);
        if (r->kind == K_AG) {
            memset(p1, 0, (size_t)chunk * es);
            packed_copy(r, me, lo, hi, p1, true);
            st = ts_all_gather_into_tensor(r->c, all[i], one[i], &req[i]);
            ts__comm_count(r->c, TS_COLL_ALL_GATHER, -1, -chunk * (int64_t)es); /* counted at the call */
        } else {
            memset(pa, 0, (size_t)nall * es);
            for (int j = 0; j < W; j++) packed_copy(r, j, lo, hi, pa + (size_t)j * chunk * es, true);
            st = ts_reduce_scatter_tensor(r->c, one[i], all[i], r->rop, r->pre, r->post, &req[i]);
            ts__comm_count(r->c, TS_COLL_REDUCE_SCATTER, -1, -nall * (int64_t)es);
        }
    }
    for (int i = 0; i < nslot; i++) { /* after a failure: the chunks still in flight end before their buffers */
        if (req[i]) (void)ts_request_wait(req[i]);
        ts_request_free(req[i]);
        ts_tensor_free(one[i]);
        ts_tensor_free(all[i]);
    }
    return st;
}

/* ------------------------------------------------------------ wait */

static void desc_str(const int64_t *d, char *buf, size_t n)
{
    int kind = (int)(d[0] & 0xff);
    uint64_t h;
    memcpy(&h, &d[3], 8);
    double pre, post;
    memcpy(&pre, &d[5], 8);
    memcpy(&post, &d[6], 8);
    ts_dtype dt = (ts_dtype)(d[1] & 0xff);
    snprintf(buf, n, "direct %s (%s, %lld segments, layout %016llx, op %d, divisors %g/%g)", kind_name(kind),
             (unsigned)dt < (unsigned)TS_DTYPE_COUNT ? ts_dtype_name(dt) : "?", (long long)d[2], (unsigned long long)h,
             (int)((d[1] >> 8) & 0xff), pre, post);
}

/* The data's move: finishes the exchange, checks that every rank runs the
 * same collective, and, on the copy-free path, reads (its outcome in
 * move_st; the wait acknowledges). Runs on the channel's worker (or in
 * the wait); issues no collective of the group, so that the group's
 * collectives stay in the callers' order. */
static void move(ts__direct *r)
{
    ts_status st = ts_request_wait(r->desc_req);
    if (st) {
        r->move_st = st;
        snprintf(r->move_err, sizeof r->move_err, "%s", ts_last_error());
        return;
    }
    int nd = (int)ts_tensor_numel(r->desc_in);
    const int64_t *all = ts_tensor_data(r->desc_out), *mine = ts_tensor_data(r->desc_in);
    bool readable = true;
    for (int j = 0; j < r->W; j++) {
        const int64_t *d = all + (size_t)j * nd;
        if ((d[0] >> 8) != MAGIC || d[0] != mine[0] || (d[1] & 0xffff) != (mine[1] & 0xffff) || d[2] != mine[2] ||
            d[3] != mine[3] || d[5] != mine[5] || d[6] != mine[6]) {
            char a[160], b[160];
            desc_str(mine, a, sizeof a);
            desc_str(d, b, sizeof b);
            r->move_st =
                ts_error(TS_ERR_COMM, "desynchronised collectives: rank %d runs %s, rank %d runs %s", r->rank, a, j, b);
            snprintf(r->move_err, sizeof r->move_err, "%s", ts_last_error());
            return;
        }
        if (!((d[1] >> 16) & 1)) readable = false;
    }
    r->agreed = true;
    r->readable = readable || r->W == 1;
    if (!r->readable) return; /* the packed fallback, in the wait */
    int bad = -1;
    st = r->kind == K_AG ? ag_direct(r, all, nd, &bad) : rs_direct(r, all, nd, &bad);
    r->move_st = st;
    if (st) snprintf(r->move_err, sizeof r->move_err, "%s", ts_last_error());
    if (r->W > 1) { /* done reading: tell every peer now, not at the wait (no rendezvous of the waits) */
        int64_t one = 1, W = r->W;
        int tag = (int)(r->seq & TS_P2P_TAG_MAX);
        r->ack_req = ts__calloc(TS_MEM_COMM, (size_t)(2 * W), sizeof *r->ack_req);
        ts_status ast = r->ack_req ? TS_OK : TS_ERR_NO_MEMORY;
        if (!ast) ast = ts_tensor_new_cpu(false, TS_I64, 1, &one, &r->ack_out);
        if (!ast) ast = ts_tensor_new_cpu(true, TS_I64, 1, &W, &r->ack_in);
        if (!ast) *(int64_t *)ts_tensor_data(r->ack_out) = st ? r->rank + 1 : 0;
        for (int j = 0; j < r->W && !ast; j++) {
            if (j == r->rank) continue;
            ts_tensor *slot = NULL;
            if ((ast = ts_narrow(r->ack_in, 0, j, 1, &slot))) break;
            ast = ts_recv(r->c, slot, j, tag, &r->ack_req[r->W + j]);
            ts_tensor_free(slot);
            if (!ast) ast = ts_send(r->c, r->ack_out, j, tag, &r->ack_req[j]);
            if (!ast) { /* counted as part of this collective, not as point-to-point traffic */
                ts__comm_count(r->c, TS_COLL_RECV, -1, -8);
                ts__comm_count(r->c, TS_COLL_SEND, -1, -8);
            }
        }
        if (ast && !r->move_st) {
            r->move_st = ast;
            snprintf(r->move_err, sizeof r->move_err, "%s", ts_last_error());
        }
    }
    if (ts_trace_enabled() && r->W > 1) { /* the collective's span, as comm.c's ring collectives have */
        int64_t bytes = (r->kind == K_AG ? 1 : r->W) * r->shard_numel * (int64_t)ts_dtype_size(r->d);
        ts_trace_arg a[6] = {{"kind", kind_name(r->kind), 0},  {"bytes", NULL, bytes},
                             {"group", NULL, (int64_t)r->gid}, {"seq", NULL, (int64_t)r->seq},
                             {"rank", NULL, r->rank},          {"status", ts_status_name(st), 0}};
        ts_trace_span_args(kind_name(r->kind), "comm", r->t_call, ts_now_ns(), 6, a);
    }
}

/* ------------------------------------------------------------ channels
 *
 * One worker thread per channel and process, started at the first
 * collective on it and kept for the process's life (blocked on its
 * condition variable when idle): it moves the data of the collectives
 * queued on its channel, in call order, while their callers compute; a
 * wait blocks until its collective was moved. Channel 0 is shared (a
 * reduce-scatter queued before an all-gather moves first, as collectives
 * on one NCCL communicator), channel 1 serves reductions given their own
 * (ts_fsdp_set_separate_reduce_scatter_group). */
typedef struct worker {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    ts__direct *head, *tail;
    bool started, failed;
} worker;

static worker g_workers[2] = {
    {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, NULL, false, false},
    {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, NULL, false, false},
};

static void *worker_main(void *arg)
{
    worker *w = arg;
    ts_trace_thread_name(w == &g_workers[0] ? "comm-direct" : "comm-direct-rs");
    for (;;) {
        pthread_mutex_lock(&w->mu);
        while (!w->head) pthread_cond_wait(&w->cv, &w->mu);
        ts__direct *r = w->head;
        w->head = r->qnext;
        if (!w->head) w->tail = NULL;
        pthread_mutex_unlock(&w->mu);
        move(r);
        pthread_mutex_lock(&w->mu);
        atomic_store(&r->moved, true);
        pthread_cond_broadcast(&w->cv);
        pthread_mutex_unlock(&w->mu);
    }
    return NULL;
}

/* Queues r on its channel's worker (started here the first time); false
 * when no worker could be started (the wait then moves the data). */
static bool enqueue(ts__direct *r)
{
    worker *w = &g_workers[r->channel];
    pthread_mutex_lock(&w->mu);
    if (!w->started && !w->failed) {
        pthread_t th;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&th, &at, worker_main, w) == 0) w->started = true;
        else w->failed = true;
        pthread_attr_destroy(&at);
    }
    if (!w->started) {
        pthread_mutex_unlock(&w->mu);
        return false;
    }
    r->qnext = NULL;
    if (w->tail) w->tail->qnext = r;
    else w->head = r;
    w->tail = r;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
    return true;
}

/* The wait's part, on the caller's thread (the group's collectives in
 * call order): the acknowledgement, or the packed fallback. */
static ts_status finish(ts__direct *r)
{
    if (r->queued) {
        worker *w = &g_workers[r->channel];
        pthread_mutex_lock(&w->mu);
        while (!atomic_load(&r->moved)) pthread_cond_wait(&w->cv, &w->mu);
        pthread_mutex_unlock(&w->mu);
    } else {
        move(r);
        atomic_store(&r->moved, true);
    }
    ts_request_free(r->desc_req);
    r->desc_req = NULL;
    if (!r->agreed) return ts_error(r->move_st, "%s", r->move_err); /* every rank knows: no acknowledgement */
    if (r->W == 1) return r->move_st ? ts_error(r->move_st, "%s", r->move_err) : TS_OK;
    if (!r->readable) return packed(r);
    /* every reader done (and who failed): nobody's buffers change before */
    ts_status st = TS_OK;
    int64_t failed = 0;
    for (int i = 0; r->ack_req && i < 2 * r->W; i++) {
        if (!r->ack_req[i]) continue;
        ts_status s2 = ts_request_wait(r->ack_req[i]);
        if (s2 && !st) st = s2;
    }
    if (!r->ack_req && !r->move_st)
        st = ts_error(TS_ERR_INTERNAL, "direct %s: no acknowledgements", kind_name(r->kind));
    for (int j = 0; !st && r->ack_in && j < r->W; j++) {
        int64_t v = ((const int64_t *)ts_tensor_data(r->ack_in))[j];
        if (v > failed) failed = v;
    }
    if (r->move_st) return ts_error(r->move_st, "%s", r->move_err);
    if (st) return st;
    if (failed)
        return ts_error(TS_ERR_COMM, "direct %s: rank %lld failed to read its peers' data", kind_name(r->kind),
                        (long long)(failed - 1));
    r->direct = true;
    return TS_OK;
}

ts_status ts__direct_wait(ts__direct *r)
{
    if (!r) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts__direct_wait: NULL request");
    if (!r->waited) {
        r->waited = true;
        r->status = finish(r);
        if (r->status) snprintf(r->err, sizeof r->err, "%s", ts_last_error());
    }
    if (r->status) return ts_error(r->status, "%s", r->err);
    return TS_OK;
}

bool ts__direct_done(const ts__direct *r) { return r && atomic_load(&r->moved); }

bool ts__direct_was_direct(const ts__direct *r) { return r && r->direct; }

bool ts__direct_sourced(const ts__direct *r, int k)
{
    if (!r || r->kind != K_RS || !r->waited || r->status || !r->agreed || k < 0 || k >= r->nseg) return false;
    int nd = (int)ts_tensor_numel(r->desc_in);
    const int64_t *all = ts_tensor_data(r->desc_out);
    for (int j = 0; j < r->W; j++)
        if (all[(size_t)j * nd + HDR + 2 * k]) return true;
    return false;
}

int64_t ts__direct_desc_numel(bool reduce_scatter, int nseg) { return HDR + (reduce_scatter ? 2 * (int64_t)nseg : 0); }

void ts__direct_free(ts__direct *r)
{
    if (!r) return;
    if (!r->waited) (void)ts__direct_wait(r);
    req_free_parts(r);
}
