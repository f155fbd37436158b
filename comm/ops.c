#define _GNU_SOURCE
/*
 * Ops: an op's block, the completion of its request, the ring state
 * machines (all-gather, reduce-scatter, all-reduce, broadcast,
 * all-to-all, send / recv: see the overview in comm/world_internal.h),
 * the fingerprints with their inline blocks, and the failure notices.
 * Everything here but ts__comm_op_new, ts__comm_op_free and
 * ts__comm_complete_req runs under the world's progress lock.
 * Calls debug.c, reduce.c and the transport's vtable.
 */
#include "comm/world_internal.h"
#include "tensor/kernels.h" /* the caching pool for scratch blocks */

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ */
/* Requests                                                            */
/* ------------------------------------------------------------------ */

void ts__comm_complete_req(world *w, ts_request *r, ts_status st, const char *msg)
{
    if (w) pthread_mutex_lock(&w->mu);
    r->status = st;
    if (st != TS_OK && msg != r->err) snprintf(r->err, sizeof r->err, "%s", msg && *msg ? msg : ts_status_str(st));
    if (st != TS_OK && !r->err[0]) snprintf(r->err, sizeof r->err, "%s", ts_status_str(st));
    atomic_store(&r->done, 1);
    if (w) {
        pthread_cond_broadcast(&w->cv);
        pthread_mutex_unlock(&w->mu);
    }
}
/* ------------------------------------------------------------------ */
/* Ops on the communication thread                                     */
/* ------------------------------------------------------------------ */

/* An op and what it indexes by rank are one block: 6 W transfer slots
 * ((rs, ag, fp) x (send, recv) x W), W received fingerprints, 2 W held
 * forwards, the W-entry rank map. A world keeps up to OP_CACHE blocks of
 * finished ops (sized for the world; its groups are no larger) for the
 * next ops, under mu: a small collective otherwise spent about as long in
 * the allocator as on the wire. */
#define OP_CACHE 64

static size_t op_block_bytes(int W)
{
    return sizeof(op) + (size_t)(6 * W) * sizeof(xfer) + (size_t)W * sizeof(fp) + (size_t)(3 * W) * sizeof(int);
}

void ts__comm_op_free(op *o)
{
    if (o->scratch) ts__pool_free(o->scratch, o->scratch_bytes);
    else if (o->owned) ts__free(TS_MEM_COMM, o->buf);
    if (o->sscratch) ts__pool_free(o->sscratch, o->sscratch_bytes);
    ts__free(TS_MEM_COMM, o->outs);
    world *w = o->w;
    if (w) {
        pthread_mutex_lock(&w->mu);
        if (w->n_cached < OP_CACHE) {
            o->next = w->op_cache;
            w->op_cache = o;
            w->n_cached++;
            o = NULL;
        }
        pthread_mutex_unlock(&w->mu);
    }
    if (o) ts__free(TS_MEM_COMM, o->fpbuf);
    ts__free(TS_MEM_COMM, o);
}
op *ts__comm_op_new(ts_comm *c, ts_coll_kind kind)
{
    world *w = c->w;
    op *o = NULL;
    if (w) { /* a cached block (ts__comm_op_free), sized for the world */
        pthread_mutex_lock(&w->mu);
        if ((o = w->op_cache)) {
            w->op_cache = o->next;
            w->n_cached--;
        }
        pthread_mutex_unlock(&w->mu);
    }
    unsigned char *fpbuf = NULL; /* a cached op keeps its fingerprint buffer */
    if (o) {
        fpbuf = o->fpbuf;
        memset(o, 0, op_block_bytes(c->size));
    } else {
        o = ts__calloc(TS_MEM_COMM, 1, op_block_bytes(w ? w->t->size : c->size));
    }
    bool check = w && atomic_load(&w->check) && kind != TS_COLL_SEND && kind != TS_COLL_RECV;
    if (o && check && c->size >= 2 && !fpbuf) fpbuf = ts__malloc(TS_MEM_COMM, FPB_BYTES);
    ts_request *r = ts__calloc(TS_MEM_COMM, 1, sizeof *r);
    if (!o || !r || (check && c->size >= 2 && !fpbuf)) {
        ts__free(TS_MEM_COMM, fpbuf);
        ts__free(TS_MEM_COMM, o);
        ts__free(TS_MEM_COMM, r);
        return NULL;
    }
    o->fpbuf = fpbuf;
    size_t nx = (size_t)(6 * c->size);
    xfer *x = (xfer *)(void *)(o + 1);
    o->w = w;
    o->x = x;
    o->theirs = (fp *)(void *)(x + nx);
    o->held = (int *)(void *)(o->theirs + c->size);
    o->map = o->held + 2 * c->size;
    for (int i = 0; i < c->size; i++) o->map[i] = c->map ? c->map[i] : i;
    r->w = w;
    o->req = r;
    o->kind = kind;
    o->W = c->size;
    o->rank = c->rank;
    o->left = (c->rank - 1 + c->size) % c->size;
    o->right = (c->rank + 1) % c->size;
    o->post = 1.0;
    o->check = check;
    o->mine = (fp){.kind = (uint8_t)kind, .dtype = FP_NONE, .rop = FP_NONE, .root = FP_NONE};
    return o;
}
static uint64_t tag_of(const op *o, int step) { return o->tagbase | (uint64_t)(unsigned)step; }
static void on_xfer(void *arg, ts_status st);

/* Posts one transfer of o; len_out non-NULL: a receive of at most len
 * bytes (transport.h, recv_upto), its length written there; iov
 * non-NULL: of the niov pieces instead of buf (sendv, recvv_upto). */
static void post_xv(op *o, int kind, int phase, int step, int peer, void *buf, size_t len, size_t *len_out,
                    const ts_iov *iov, int niov)
{
    if (o->err) return;
    int slot = phase == PH_FP ? 2 : phase == PH_AG ? 1 : 0;
    xfer *x = &o->x[(slot * 2 + kind) * o->W + (phase == PH_FP ? peer : step % o->W)];
    x->o = o;
    x->kind = kind;
    x->phase = phase;
    x->step = step;
    x->peer = peer;
    x->live = true;
    ts_transport *t = o->req->w->t;
    int wire = phase == PH_FP ? (int)FP_STEP : phase == PH_AG && o->rs ? step + o->W - 1 : phase == PH_A2A ? 0 : step;
    uint64_t tag = phase == PH_P2P ? o->tagbase : tag_of(o, wire);
    int wpeer = o->map[peer];
    o->pending++;
    ts_status s;
    if (iov)
        s = kind == K_SEND ? t->vt->sendv(t, wpeer, iov, niov, tag, on_xfer, x)
                           : t->vt->recvv_upto(t, wpeer, iov, niov, tag, on_xfer, x, len_out);
    else
        s = kind == K_SEND ? t->vt->send(t, wpeer, buf, len, tag, on_xfer, x)
            : len_out      ? t->vt->recv_upto(t, wpeer, buf, len, tag, on_xfer, x, len_out)
                           : t->vt->recv(t, wpeer, buf, len, tag, on_xfer, x);
    if (s != TS_OK) {
        x->live = false;
        o->pending--;
        o->err = s;
        snprintf(o->req->err, sizeof o->req->err, "%s", ts_last_error());
    }
}

static void post_x(op *o, int kind, int phase, int step, int peer, void *buf, size_t len, size_t *len_out)
{
    post_xv(o, kind, phase, step, peer, buf, len, len_out, NULL, 0);
}

static void post(op *o, int kind, int phase, int step, int peer, void *buf, size_t len)
{
    post_x(o, kind, phase, step, peer, buf, len, NULL);
}

/* (An inline all-gather's step 0 travels with the fingerprints.) */
static void start_ag(op *o)
{
    o->ag_started = true;
    bool inl = o->inl && !o->rs;
    for (int s = inl; s < o->W - 1; s++) post(o, K_RECV, PH_AG, s, o->left, ts__comm_blk(o, o->rank - s - 1), o->block);
    if (!inl) post(o, K_SEND, PH_AG, 0, o->right, ts__comm_blk(o, o->rank), o->block);
}

/* Reduce-scatter phase (see the top of comm/world_internal.h): step s receives the
 * partial sum of block rank-s-2 into stage[s%2], adds the source's block,
 * and forwards it at step s+1; the last step (s = W-2) adds to the own
 * block and writes final_out. Step 0 sends the source's block rank-1
 * (send0). A stage is received into again once its forward completed. */
static void start_rs(op *o)
{
    for (int s = o->inl; s < 2 && s < o->W - 1; s++) post(o, K_RECV, PH_RS, s, o->left, o->stage[s], o->block);
    if (!o->inl) post(o, K_SEND, PH_RS, 0, o->right, o->send0, o->block);
}
/* Sends what this rank received on to the right: all-gather's step
 * `step` (the block received at step-1), reduce-scatter's (the stage
 * reduced at step-1), broadcast's. Held until the left neighbour's
 * fingerprint matched this rank's, so that a rank's result only holds
 * data that came through ranks that each checked their left neighbour:
 * every rank then fails within the collective, not only the two around a
 * mismatch. */
static void do_forward(op *o, int phase, int step)
{
    if (phase == PH_AG) post(o, K_SEND, PH_AG, step, o->right, ts__comm_blk(o, o->rank - step), o->block);
    else if (phase == PH_RS) post(o, K_SEND, PH_RS, step, o->right, o->stage[(step - 1) % 2], o->block);
    else post(o, K_SEND, PH_BC, 0, o->right, o->buf, o->block);
}

static void forward(op *o, int phase, int step)
{
    if (o->fp_ok) do_forward(o, phase, step);
    else o->held[o->nheld++] = phase << 8 | step;
}

static void rs_received(op *o, int s)
{
    unsigned char *st = o->stage[s % 2];
    if (s == o->W - 2) {
        ts__comm_reduce_store(o->final_out, o->final_dtype, st, o->acc, ts__comm_src_blk(o, o->rank), o->src_dtype,
                              o->pre, o->rop, o->post, o->block_n);
        o->rs_done = true;
        return;
    }
    ts__comm_accumulate(st, o->acc, ts__comm_src_blk(o, o->rank - s - 2), o->src_dtype, o->pre, o->rop, o->block_n);
    forward(o, PH_RS, s + 1);
}

/* The forward of step k (from stage[(k-1)%2]) completed: that stage takes
 * the receive of step k+1. */
static void rs_sent(op *o, int k)
{
    if (k >= 1 && k + 1 <= o->W - 2) post(o, K_RECV, PH_RS, k + 1, o->left, o->stage[(k - 1) % 2], o->block);
}

static void start_bc(op *o)
{
    o->bc_started = true;
    int pos = (o->rank - o->root + o->W) % o->W;
    if (pos == 0) {
        o->bc_recvd = true;
        if (o->W > 1) {
            o->bc_sent = true;
            post(o, K_SEND, PH_BC, 0, o->right, o->buf, o->block);
        }
    } else {
        post(o, K_RECV, PH_BC, 0, o->left, o->buf, o->block);
    }
}

/* All-to-all: receive block j of the output from rank j, send block j of
 * the input copy to rank j (the own block was copied at submission). */
static void start_a2a(op *o)
{
    if (o->block == 0) return;
    for (int j = 0; j < o->W; j++)
        if (j != o->rank) post(o, K_RECV, PH_A2A, j, j, o->a2a_out + (size_t)j * o->block, o->block);
    for (int k = 1; k < o->W; k++) {
        int j = (o->rank + k) % o->W;
        post(o, K_SEND, PH_A2A, j, j, o->buf + (size_t)j * o->block, o->block);
    }
}

static bool op_done(const op *o)
{
    if (o->kind == TS_COLL_ALL_TO_ALL || o->kind == TS_COLL_SEND || o->kind == TS_COLL_RECV) return true;
    if (o->kind == TS_COLL_BROADCAST) return o->bc_recvd;
    if (o->rs && !o->rs_done) return false;
    if (o->ag && !o->ag_done) return false;
    return true;
}
/* Writes the results out of the op's buffer (after success). A one-rank
 * reduction runs here: its own block is the whole result. */
void ts__comm_finalize(op *o)
{
    if (o->rs && o->W == 1)
        ts__comm_convert_through(o->final_out, o->final_dtype, o->src, o->src_dtype, o->acc, o->pre, o->post,
                                 o->block_n);
    if (o->out) ts__comm_store_acc(o->out, o->out_dtype, o->buf, o->out_n, 1.0);
    if (o->outs && o->block)
        for (int i = 0; i < o->W; i++) memcpy(o->outs[i], o->buf + (size_t)i * o->block, o->block);
}
void ts__comm_finish(op *o)
{
    world *w = o->req->w;
    ts_status st = o->err;
    if (st == TS_OK) ts__comm_finalize(o);
    o->finished = true;
    ts__comm_log_detail(o, st);
    ts__comm_trace_op(w, o, st);
    atomic_fetch_add_explicit(ts__comm_thread_world == w ? &w->by_thread : &w->by_callers, 1, memory_order_relaxed);
    atomic_fetch_sub(&w->live, 1);
    ts__comm_complete_req(w, o->req, st, o->req->err);
}

static void advance(op *o)
{
    if (o->finished) return;
    world *w = o->req->w;
    if (o->err) {
        /* a peer failure is held until the world has named the rank that
         * failed first (see ts__comm_fail_world): the transfer's own error may name
         * a rank that only exited after failing itself */
        if (o->pending == 0 && !(o->err == TS_ERR_PEER_FAILED && !w->failed)) ts__comm_finish(o);
        return;
    }
    if (o->rs && o->rs_done && o->ag && !o->ag_started && o->pending == 0) start_ag(o);
    if (o->err) {
        if (o->pending == 0 && !(o->err == TS_ERR_PEER_FAILED && !w->failed)) ts__comm_finish(o);
        return;
    }
    if (op_done(o) && o->pending == 0) ts__comm_finish(o);
}
/* ------------------------------------------------------------------ */
/* Fingerprints                                                        */
/* ------------------------------------------------------------------ */

/* Every collective (not send/recv) sends its fingerprint (kind, sequence,
 * dtype, count, reduce op, root: 16 bytes) to its right neighbour
 * (all-to-all and broadcast: every peer), with step FP_STEP of its own
 * tag, and receives its left neighbour's (all-to-all, broadcast: every
 * peer's); it completes only once those arrived and matched. A rank that
 * finds a fingerprint differ from its own fails its world with a message
 * naming both sides and sends a notice to every peer. In the rings
 * (all-gather, reduce-scatter, all-reduce, barrier) a rank forwards what
 * it received only once its left neighbour's fingerprint matched (see
 * forward()): a rank's result then only holds data that passed ranks that
 * each checked their left neighbour, so a result completes only when all
 * ranks agree, and every rank fails within the collective. A broadcast's
 * data flows one way along its chain, so there every pair checks.
 *
 * Inline blocks. A separate 16-byte message cost about 0.3 us per small
 * collective (8-16% of a 4 KiB all-gather), so a ring whose step-0 block
 * is small (fp_inline: at most TS_COMM_FP_INLINE bytes, 16 KiB by
 * default) sends that block in its fingerprint's message, [fingerprint |
 * block], and no step-0 data message: sent as two pieces (the
 * fingerprint, the block where it lies: sendv). The receiver checks the
 * fingerprint before it uses or forwards the block: an all-gather
 * receives the message as pieces, the block straight into its slot
 * (recvv_upto); a reduce-scatter receives it in front of staging block 0,
 * which is then reduced in place.
 * Larger blocks go from and to the caller's buffers without a copy, and
 * their fingerprint stays alone. A fingerprint message is therefore 16
 * bytes or 16 plus a block of at most FP_INLINE_CAP, and every
 * fingerprint receive from the left accepts any of these lengths (the
 * transport's recv_upto): whatever the two sides' sizes, the receiver
 * reads the sender's fingerprint, so a mismatch across the threshold (one
 * block under it, the other over) is caught by the fingerprint like any
 * other, on the rank that receives it, and the others learn it from its
 * notice. (A receive of the exact length would fail with a length error
 * instead, leaving the rank without the peer's fingerprint; and a message
 * of 256 KiB or more takes UCX's shared-memory bypass, which never meets
 * a receive of another size.) Only the left can send a longer message:
 * the rings send to the right alone, broadcast and all-to-all only 16
 * bytes. When fingerprints match, the lengths do too, unless the ranks'
 * TS_COMM_FP_INLINE differ, which fails the collective saying so.
 *
 * A data receive that fails first (a length mismatch) waits for the
 * fingerprint, whose message then wins; large messages take the
 * transport's shared-memory bypass, whose size mismatches would otherwise
 * only end at the deadline. TS_COMM_CHECK=0 turns fingerprints off (every
 * rank alike), and with them the inline blocks. */

/* Whether o (a ring, its block set) sends its step-0 block with its
 * fingerprint: when the block is at most the threshold. Measured
 * (bench_collectives' "fingerprint inline blocks", 2 ranks, UCX shared
 * memory, a loaded machine): inline saves 10-20% up to 2 KiB blocks and
 * 5-12% at 8-16 KiB, for every ring kind, once no block is copied (the
 * message is sent and received as pieces: sendv, recvv_upto). With the
 * block copied into and out of the message, an all-gather lost 3-6% from
 * 8 KiB. */
bool ts__comm_fp_inline(const op *o)
{
    const ts_transport_vtable *vt = o->check ? o->w->t->vt : NULL;
    if (!o->check || o->W < 2 || !o->fpbuf || !vt->recv_upto || !vt->sendv || !vt->recvv_upto ||
        o->kind == TS_COLL_BROADCAST || o->kind == TS_COLL_ALL_TO_ALL)
        return false;
    size_t limit = atomic_load_explicit(&o->w->fp_inline, memory_order_relaxed);
    return limit > 0 && o->block <= limit; /* 0: never, not even an empty block */
}

static const char *const k_rop_names[TS_REDUCE_OP_COUNT] = {"sum", "avg", "max", "min"};
_Static_assert(TS_REDUCE_OP_COUNT == 4, "one name per reduce op");

/* "all_gather #12 (float32, 8512)" */
static void fp_str(const fp *f, char *buf, size_t n)
{
    const char *kind = f->kind < TS_COLL_KIND_COUNT ? ts__comm_kind_names[f->kind] : "an unknown collective";
    int k = snprintf(buf, n, "%s #%u", kind, f->seq);
    if (k < 0 || (size_t)k >= n || f->kind == TS_COLL_BARRIER) return;
    k += snprintf(buf + k, n - (size_t)k, " (%s, %llu", f->dtype != FP_NONE ? ts_dtype_name((ts_dtype)f->dtype) : "-",
                  (unsigned long long)f->count);
    if ((size_t)k < n && f->rop != FP_NONE && f->rop < TS_REDUCE_OP_COUNT)
        k += snprintf(buf + k, n - (size_t)k, ", %s", k_rop_names[f->rop]);
    if ((size_t)k < n && f->root != FP_NONE) k += snprintf(buf + k, n - (size_t)k, ", root %u", f->root);
    if ((size_t)k < n) snprintf(buf + k, n - (size_t)k, ")");
}

void ts__comm_fail_later(world *w, ts_status st, const char *msg, bool notify)
{
    if (w->failed || w->pend_st) return;
    w->pend_st = st;
    w->pend_notify = notify;
    ts__comm_copy_str(w->pend_msg, sizeof w->pend_msg, msg);
}

/* Fails o (and its world, with notices) with msg, as a mismatch does. */
static void fp_fail(op *o, const char *msg)
{
    o->fp_bad = true;
    o->err = TS_ERR_COMM;
    ts__comm_copy_str(o->req->err, sizeof o->req->err, msg);
    ts__comm_fail_later(o->req->w, TS_ERR_COMM, msg, true);
}

static void check_fp(op *o, int peer)
{
    const fp *a = &o->mine, *b = &o->theirs[peer];
    if (memcmp(a, b, sizeof *a) == 0) {
        if (o->kind == TS_COLL_ALL_TO_ALL || o->kind == TS_COLL_BROADCAST) return; /* all pairs: nothing held */
        o->fp_ok = true;
        for (int i = 0; i < o->nheld && !o->err; i++) do_forward(o, o->held[i] >> 8, o->held[i] & 0xff);
        o->nheld = 0;
        return;
    }
    char sa[96], sb[96], msg[ERR_LEN + 128], grp[32] = "";
    fp_str(a, sa, sizeof sa);
    fp_str(b, sb, sizeof sb);
    if (o->gid) snprintf(grp, sizeof grp, "group %llu: ", (unsigned long long)o->gid);
    bool me_first = o->rank < peer;
    snprintf(msg, sizeof msg, "desynchronised collectives: %srank %d runs %s, rank %d runs %s", grp,
             me_first ? o->rank : peer, me_first ? sa : sb, me_first ? peer : o->rank, me_first ? sb : sa);
    fp_fail(o, msg);
}

/* The left's fingerprint message goes to fpbuf (any length up to an
 * inline block of FP_INLINE_CAP), the other peers' (all-to-all,
 * broadcast) straight to theirs[]. An inline all-gather's block goes
 * straight to its slot (what a longer message holds beyond it, to
 * fpbuf). */
static void post_fp_left(op *o)
{
    o->fp_upto = o->fpbuf && o->req->w->t->vt->recv_upto;
    if (o->inl && !o->rs) {
        ts_iov v[3] = {{o->fpbuf + FPB_RECV - sizeof(fp), sizeof(fp)},
                       {ts__comm_blk(o, o->rank - 1), o->block},
                       {o->fpbuf + FPB_RECV, FP_INLINE_CAP - o->block}};
        post_xv(o, K_RECV, PH_FP, 0, o->left, NULL, 0, &o->fp_rlen, v, 3);
    } else if (o->fp_upto)
        post_x(o, K_RECV, PH_FP, 0, o->left, o->fpbuf + FPB_RECV - sizeof(fp), sizeof(fp) + FP_INLINE_CAP, &o->fp_rlen);
    else post(o, K_RECV, PH_FP, 0, o->left, &o->theirs[o->left], sizeof(fp));
}

static void start_fp(op *o)
{
    if (!o->check || o->W < 2) return;
    if (o->kind == TS_COLL_ALL_TO_ALL || o->kind == TS_COLL_BROADCAST) {
        post_fp_left(o);
        for (int j = 0; j < o->W; j++)
            if (j != o->rank && j != o->left) post(o, K_RECV, PH_FP, 0, j, &o->theirs[j], sizeof(fp));
        for (int j = 0; j < o->W; j++)
            if (j != o->rank) post(o, K_SEND, PH_FP, 0, j, &o->mine, sizeof(fp));
        return;
    }
    post_fp_left(o);
    if (o->inl) { /* [fingerprint | block], from where the block is */
        ts_iov v[2] = {{&o->mine, sizeof(fp)}, {o->rs ? o->send0 : ts__comm_blk(o, o->rank), o->block}};
        post_xv(o, K_SEND, PH_FP, 0, o->right, NULL, 0, NULL, v, 2);
    } else {
        post(o, K_SEND, PH_FP, 0, o->right, &o->mine, sizeof(fp));
    }
}

/* The left's fingerprint message arrived (in fpbuf): checks it and, for
 * an inline ring, takes its block as step 0's receive. */
static void fp_left_received(op *o)
{
    char msg[ERR_LEN], grp[32] = "";
    if (o->gid) snprintf(grp, sizeof grp, "group %llu: ", (unsigned long long)o->gid);
    if (o->fp_rlen < sizeof(fp)) {
        snprintf(msg, sizeof msg, "%srank %d sent rank %d a fingerprint of %zu bytes (want at least %zu)", grp, o->left,
                 o->rank, o->fp_rlen, sizeof(fp));
        fp_fail(o, msg);
        return;
    }
    memcpy(&o->theirs[o->left], o->fpbuf + FPB_RECV - sizeof(fp), sizeof(fp));
    check_fp(o, o->left);
    if (o->err) return;
    size_t want = o->inl ? o->block : 0, got = o->fp_rlen - sizeof(fp);
    if (got != want) { /* the same collective: the ranks' TS_COMM_FP_INLINE differ */
        snprintf(msg, sizeof msg,
                 "%srank %d sent %zu bytes of data with its fingerprint, rank %d expected %zu: is TS_COMM_FP_INLINE "
                 "the same on every rank?",
                 grp, o->left, got, o->rank, want);
        fp_fail(o, msg);
        return;
    }
    if (!o->inl) return;
    if (o->rs) { /* the block landed in staging block 0 */
        rs_received(o, 0);
        return;
    }
    if (o->W > 2) forward(o, PH_AG, 1); /* the block is in its slot */
    if (++o->ag_recvd == o->W - 1) o->ag_done = true;
}

void ts__comm_suspect(world *w, int wrank)
{
    if (w->suspect >= 0) return;
    w->suspect = wrank;
    w->suspect_ns = ts_now_ns();
}

static void on_xfer(void *arg, ts_status st)
{
    xfer *x = arg;
    op *o = x->o;
    o->pending--;
    x->live = false;
    if (st != TS_OK && !o->err) {
        o->err = st;
        snprintf(o->req->err, sizeof o->req->err, "%s", ts_last_error());
        if (st == TS_ERR_PEER_FAILED) ts__comm_suspect(o->req->w, o->map[x->peer]);
    }
    if (x->phase == PH_FP) {
        if (st == TS_OK && x->kind == K_RECV) {
            if (x->peer == o->left && o->fp_upto) fp_left_received(o);
            else check_fp(o, x->peer);
        }
        advance(o);
        return;
    }
    if (!o->err && x->kind == K_SEND && x->phase == PH_RS) rs_sent(o, x->step);
    if (!o->err && x->kind == K_RECV) {
        int s = x->step;
        if (x->phase == PH_AG) {
            if (s < o->W - 2) forward(o, PH_AG, s + 1);
            if (++o->ag_recvd == o->W - 1) o->ag_done = true;
        } else if (x->phase == PH_RS) {
            rs_received(o, s);
        } else if (x->phase == PH_BC) {
            o->bc_recvd = true;
            if ((o->rank - o->root + o->W) % o->W < o->W - 1) forward(o, PH_BC, 0);
        }
    }
    advance(o);
}

void ts__comm_start_op(world *w, op *o)
{
    o->deadline_ns = ts_now_ns() + (uint64_t)(atomic_load(&w->deadline_s) * 1e9);
    o->fp_ok = !o->check || o->W < 2 || o->kind == TS_COLL_ALL_TO_ALL || o->kind == TS_COLL_BROADCAST;
    /* the fingerprint first: it then arrives before the data, and the
     * forwards and the all-reduce's second phase, which wait for it, do
     * not (measured: sending it after step 0 cost more at 4 KiB) */
    start_fp(o);
    if (o->kind == TS_COLL_BROADCAST) start_bc(o);
    else if (o->kind == TS_COLL_ALL_TO_ALL) start_a2a(o);
    else if (o->kind == TS_COLL_SEND) post(o, K_SEND, PH_P2P, 0, o->peer, o->buf, o->block);
    else if (o->kind == TS_COLL_RECV) post(o, K_RECV, PH_P2P, 0, o->peer, o->buf, o->block);
    else if (o->rs) start_rs(o);
    else start_ag(o);
    advance(o);
}
/* ------------------------------------------------------------------ */
/* Failure notices                                                     */
/* ------------------------------------------------------------------ */

/* A rank that fails its world because a peer died (once it has named the
 * rank that died first) or because fingerprints differ sends one notice
 * to every other rank, which fails its own world with the same message.
 * Every rank keeps a receive posted for a notice from each peer (tag
 * NOTICE_TAG). This makes every survivor name the same, first-failed
 * rank: a survivor that would otherwise first notice a rank that merely
 * exited after failing (the pid watch checks the ranks in order) learns
 * the real one from that rank's notice, which it sent before exiting; and
 * a rank whose transport found a dead peer waits PEER_GRACE_NS
 * (progress.c) for such a notice (or for the transport to report another
 * death) before naming it, in worlds of 3 ranks or more. */
#define NOTICE_MAGIC 0x5453464eu /* "NFST" */
static void on_notice(void *arg, ts_status st)
{
    notice_slot *sl = arg;
    world *w = sl->w;
    if (st != TS_OK || w->failed) return; /* cancelled at failure or teardown */
    notice n = sl->n;
    n.msg[sizeof n.msg - 1] = '\0';
    if (n.magic != NOTICE_MAGIC || n.status >= 0 || n.from != sl->peer) {
        ts_logf(TS_LOG_WARN, "comm: rank %d: malformed failure notice from rank %d ignored", w->comm->rank, sl->peer);
        return;
    }
    char msg[ERR_LEN];
    int k = snprintf(msg, sizeof msg, "%s%s", n.msg, n.culprit >= 0 ? " (reported by a peer)" : "");
    (void)k; /* truncated if need be */
    ts__comm_fail_later(w, (ts_status)n.status, msg, false);
}

static void nop_cb(void *arg, ts_status st)
{
    (void)arg;
    (void)st;
}

void ts__comm_post_notices(world *w)
{
    ts_transport *t = w->t;
    w->notices_posted = true;
    if (!w->nslots) return;
    for (int p = 0; p < t->size; p++) {
        if (p == t->rank) continue;
        notice_slot *sl = &w->nslots[p];
        sl->w = w;
        sl->peer = p;
        if (t->vt->recv(t, p, &sl->n, sizeof sl->n, NOTICE_TAG, on_notice, sl) != TS_OK)
            ts_logf(TS_LOG_DEBUG, "comm: rank %d: no notice receive from rank %d: %s", t->rank, p, ts_last_error());
    }
}

static void send_notices(world *w, ts_status st, int culprit, const char *msg)
{
    ts_transport *t = w->t;
    if (!w->nout || !w->notices_posted) return;
    *w->nout = (notice){.magic = NOTICE_MAGIC, .status = st, .from = t->rank, .culprit = culprit};
    ts__comm_copy_str(w->nout->msg, sizeof w->nout->msg, msg);
    for (int p = 0; p < t->size; p++) {
        if (p == t->rank || p == culprit) continue;
        if (t->vt->send(t, p, w->nout, sizeof *w->nout, NOTICE_TAG, nop_cb, NULL) != TS_OK)
            ts_logf(TS_LOG_DEBUG, "comm: rank %d: no notice to rank %d: %s", t->rank, p, ts_last_error());
    }
}
/* req->err = "<op>: <msg>" */
void ts__comm_set_op_err(op *o, const char *msg)
{
    char name[64];
    ts__comm_op_name(o, name, sizeof name);
    size_t a = strlen(name), b = strlen(msg), n = sizeof o->req->err - 1;
    if (a + 2 > n) a = n - 2;
    if (a + 2 + b > n) b = n - a - 2;
    memcpy(o->req->err, name, a);
    memcpy(o->req->err + a, ": ", 2);
    memmove(o->req->err + a + 2, msg, b); /* msg may be req->err's own copy */
    o->req->err[a + 2 + b] = '\0';
}

/* Fails the world: every active and later op completes with `st`; `src`
 * (if any) already holds its own message. A fingerprint mismatch keeps its
 * message too. notify: send the notice to every peer (culprit: the rank
 * that failed, -1 if none). */
void ts__comm_fail_world(world *w, ts_status st, const char *msg, op *src, bool notify, int culprit)
{
    if (w->failed) return;
    w->failed = st;
    ts__comm_copy_str(w->failed_msg, sizeof w->failed_msg, msg);
    if (notify) send_notices(w, st, culprit, msg);
    /* the hook (the store's notice, dist.c) runs before any request
     * completes, so a rank that exits on the error has told the others;
     * only for this rank's own findings: a notice (notify) or its own
     * deadline (src, ts__comm_check_deadlines), not a failure it was told of */
    if (w->fail_hook && (notify || (src && st == TS_ERR_TIMEOUT))) w->fail_hook(w->fail_hook_arg, st, culprit, msg);
    for (op *o = w->active; o; o = o->next) {
        if (o->finished || o == src || o->fp_bad) continue;
        o->err = st;
        ts__comm_set_op_err(o, msg);
    }
    w->t->vt->cancel_all(w->t, st);
    for (op *o = w->active; o; o = o->next) {
        if (o->finished) continue;
        o->pending = 0; /* the transport completed or dropped everything */
        advance(o);
    }
}
