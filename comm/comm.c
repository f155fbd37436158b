/*
 * The public collectives (comm.h): argument checks, setting up an op and
 * its scratch, submission to the world's queue (or the caller's own
 * round), and groups. Calls progress.c, ops.c, reduce.c, debug.c.
 */
#include "comm/world_internal.h"
#include "tensor/kernels.h"
#include "tensor/kernels.h" /* ts__acc_dtype */

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ */
/* Submission                                                          */
/* ------------------------------------------------------------------ */
static void set_fp(op *o, ts_dtype d, int64_t count, unsigned rop, unsigned root)
{
    o->mine.dtype = (uint8_t)d;
    o->mine.count = (uint64_t)count;
    o->mine.rop = (uint8_t)rop;
    o->mine.root = (uint8_t)root;
}

static void op_discard(op *o)
{
    ts__free(TS_MEM_COMM, o->req);
    ts__comm_op_free(o);
}

/* Counts, numbers and submits `o`; waits if r_out is NULL. */
static ts_status submit(ts_comm *c, op *o, size_t bytes, ts_request **r_out)
{
    bool p2p = o->kind == TS_COLL_SEND || o->kind == TS_COLL_RECV;
    pthread_mutex_lock(&c->stats_mu);
    c->stats.calls[o->kind]++;
    c->stats.bytes[o->kind] += bytes;
    uint32_t seq = p2p ? 0 : c->seq++;
    pthread_mutex_unlock(&c->stats_mu);
    /* p2p: tagbase already holds the user tag in the middle field */
    o->tagbase =
        p2p ? (c->gid << GID_SHIFT) | o->tagbase | P2P_STEP : (c->gid << GID_SHIFT) | ((uint64_t)(seq & SEQ_MASK) << 8);
    o->gid = c->gid;
    o->seq = seq;
    o->mine.seq = seq;
    o->bytes = bytes;
    o->submit_ns = ts_now_ns();
    ts_request *r = o->req;
    world *w = c->w;
    if (o->W == 1 || !w || !w->has_thread) {
        /* nothing to exchange: finalize here */
        ts_status st = TS_OK;
        ts__comm_finalize(o);
        ts__comm_log_detail(o, st);
        ts__comm_complete_req(NULL, r, st, NULL);
        ts__comm_op_free(o);
    } else {
        atomic_fetch_add(&w->live, 1);
        pthread_mutex_lock(&w->mu);
        o->next = NULL;
        if (w->queue_tail) w->queue_tail->next = o;
        else w->queue = o;
        w->queue_tail = o;
        atomic_store_explicit(&w->queued, true, memory_order_release);
        pthread_mutex_unlock(&w->mu);
        /* A blocking op is started by its caller, who drives progress in
         * ts_request_wait below. An asynchronous one is started here too
         * (its receives and first sends posted, with one round of
         * progress) when the progress lock is free: the communication
         * thread, which takes over ops no caller drives after a delay
         * (ts__comm_takeover_ns), then need not be woken, unless it sleeps without
         * a timeout (no op was pending) and would not look at this one.
         * When the lock is busy the thread is woken to start it. */
        if (r_out) {
            bool started = false;
            if (ts__comm_takeover_ns() > 0 && ts__comm_prog_trylock(w)) {
                saved_err saved;
                ts__comm_err_save(&saved);
                (void)ts__comm_round(w, false);
                ts__comm_prog_unlock(w);
                ts__comm_err_restore(&saved);
                atomic_store_explicit(&w->caller_ns, ts_now_ns(), memory_order_relaxed);
                started = true;
            }
            if (!started || atomic_load(&w->sleeping)) ts__comm_wake_thread(w);
        }
    }
    if (r_out) {
        *r_out = r;
        return TS_OK;
    }
    ts_status st = ts_request_wait(r);
    ts_request_free(r);
    return st;
}

static ts_status check_tensor(const char *fn, const char *what, const ts_tensor *t)
{
    if (!t) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL %s", fn, what);
    if (!ts_tensor_is_contiguous(t)) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %s is not contiguous", fn, what);
    if (ts_tensor_numel(t) > 0 && !ts_tensor_data(t))
        return ts_error(TS_ERR_RELEASED, "%s: the storage of %s is released", fn, what);
    return TS_OK;
}

static ts_status check_comm(const char *fn, const ts_comm *c)
{
    if (!c) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL group", fn);
    return TS_OK;
}

/* An all-gather (its own block in place) sends that block with its
 * fingerprint when it is small enough (see Fingerprints). */
static void set_inline_ag(op *o) { o->inl = ts__comm_fp_inline(o); }

ts_status ts_all_gather_into_tensor(ts_comm *c, ts_tensor *out, ts_tensor *in, ts_request **r)
{
    static const char fn[] = "ts_all_gather_into_tensor";
    ts_status s;
    if ((s = check_comm(fn, c)) || (s = check_tensor(fn, "out", out)) || (s = check_tensor(fn, "in", in))) return s;
    if (ts_tensor_dtype(out) != ts_tensor_dtype(in))
        return ts_error(TS_ERR_DTYPE, "%s: out is %s, in is %s", fn, ts_dtype_name(ts_tensor_dtype(out)),
                        ts_dtype_name(ts_tensor_dtype(in)));
    int64_t n = ts_tensor_numel(in);
    if (ts_tensor_numel(out) != n * c->size)
        return ts_error(TS_ERR_SHAPE, "%s: out has %lld elements, expected %d x %lld", fn,
                        (long long)ts_tensor_numel(out), c->size, (long long)n);
    op *o = ts__comm_op_new(c, TS_COLL_ALL_GATHER);
    if (!o) return TS_ERR_NO_MEMORY;
    set_fp(o, ts_tensor_dtype(in), n, FP_NONE, FP_NONE);
    o->block = (size_t)n * ts_dtype_size(ts_tensor_dtype(in));
    o->buf = ts_tensor_data(out);
    o->ag = true;
    if (o->block && ts__comm_blk(o, c->rank) != (unsigned char *)ts_tensor_data(in))
        memmove(ts__comm_blk(o, c->rank), ts_tensor_data(in), o->block);
    set_inline_ag(o);
    return submit(c, o, o->block, r);
}

static ts_status check_reduce(const char *fn, ts_dtype d, ts_reduce_op op_, double pre, double post)
{
    if (!ts__comm_reducible(d)) return ts_error(TS_ERR_DTYPE, "%s: cannot reduce %s", fn, ts_dtype_name(d));
    if ((unsigned)op_ >= TS_REDUCE_OP_COUNT)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: bad reduce op %d", fn, (int)op_);
    if (!(pre > 0) || !(post > 0) || !isfinite(pre) || !isfinite(post))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: divide factors must be finite and > 0 (%g, %g)", fn, pre, post);
    if ((op_ == TS_REDUCE_MAX || op_ == TS_REDUCE_MIN) && (pre != 1.0 || post != 1.0))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: MAX and MIN take no divide factors", fn);
    return TS_OK;
}

/* A scratch block from the caching pool (reused across collectives, so
 * no fresh pages are touched in a step: docs/design.md, "Fresh memory is slow to touch"). */
static unsigned char *scratch(size_t bytes, size_t *got) { return ts__pool_alloc(bytes ? bytes : 1, got); }

/* The op's buffer from the pool; false without memory. */
static bool own_scratch(op *o, size_t bytes)
{
    o->scratch = scratch(bytes, &o->scratch_bytes);
    o->buf = o->scratch;
    o->owned = o->scratch != NULL;
    return o->scratch != NULL;
}

/* Sets up the reduce-scatter phase over a source of W blocks of block_n
 * elements: the stages (up to two accumulation blocks) and step 0's send
 * block, converted when the source is not already in the accumulation
 * dtype or is divided. */
static ts_status setup_rs(op *o, const void *src, ts_dtype sd, double pre, size_t block_n)
{
    size_t es = ts_dtype_size(o->acc);
    o->rs = true;
    o->src = src;
    o->src_dtype = sd;
    o->pre = pre;
    o->block_n = block_n;
    o->block = block_n * es;
    if (o->W == 1) return TS_OK;
    bool convert = sd != o->acc || pre != 1.0;
    if ((o->inl = ts__comm_fp_inline(o))) {
        /* step 0 travels with the fingerprints (see Fingerprints): its
         * block is received in front of staging block 0, in fpbuf */
        int extra = (o->W > 2) + convert;
        if (extra) {
            o->sscratch = scratch((size_t)extra * o->block, &o->sscratch_bytes);
            if (!o->sscratch) return TS_ERR_NO_MEMORY;
        }
        o->stage[0] = o->stage[1] = o->fpbuf + FPB_RECV;
        if (o->W > 2) o->stage[1] = o->sscratch;
        if (convert) {
            o->send0 = o->sscratch + (o->W > 2 ? o->block : 0);
            ts__comm_convert_through(o->send0, o->acc, ts__comm_src_blk(o, o->rank - 1), sd, o->acc, pre, 1.0, block_n);
        } else {
            o->send0 = (unsigned char *)(uintptr_t)ts__comm_src_blk(o, o->rank - 1);
        }
        return TS_OK;
    }
    int nstage = o->W - 1 < 2 ? o->W - 1 : 2;
    o->sscratch = scratch((size_t)(nstage + convert) * o->block, &o->sscratch_bytes);
    if (!o->sscratch) return TS_ERR_NO_MEMORY;
    o->stage[0] = o->sscratch;
    o->stage[1] = o->sscratch + (nstage > 1 ? o->block : 0);
    if (convert) {
        o->send0 = o->sscratch + (size_t)nstage * o->block;
        ts__comm_convert_through(o->send0, o->acc, ts__comm_src_blk(o, o->rank - 1), sd, o->acc, pre, 1.0, block_n);
    } else {
        o->send0 = (unsigned char *)(uintptr_t)ts__comm_src_blk(o, o->rank - 1);
    }
    return TS_OK;
}

/* The staging scratch setup_rs takes for a reduce-scatter over a source
 * of W blocks of block_n elements of sd (accumulated in acc): what
 * fully_shard's meta step records (ts__comm_reduce_scatter_scratch). */
static size_t rs_scratch_bytes(ts_comm *c, ts_dtype sd, ts_dtype acc, double pre, size_t block_n)
{
    if (!c || c->size < 2) return 0;
    op *o = ts__comm_op_new(c, TS_COLL_REDUCE_SCATTER);
    if (!o) return 0;
    o->acc = acc;
    o->block = block_n * ts_dtype_size(acc);
    bool convert = sd != acc || pre != 1.0;
    size_t b;
    if (ts__comm_fp_inline(o)) {
        b = (size_t)((o->W > 2) + convert) * o->block;
    } else {
        int nstage = o->W - 1 < 2 ? o->W - 1 : 2;
        b = (size_t)(nstage + convert) * o->block;
    }
    op_discard(o);
    return b;
}

size_t ts__comm_reduce_scatter_scratch(ts_comm *c, ts_dtype d, int64_t n, double pre_div)
{
    return rs_scratch_bytes(c, d, ts__acc_dtype(d), pre_div, (size_t)n);
}

int ts__comm_all_reduce_scratch(ts_comm *c, ts_dtype d, int64_t n, size_t bytes[2])
{
    if (!c || n < 0) return 0;
    int k = 0;
    ts_dtype acc = ts__acc_dtype(d);
    size_t W = (size_t)c->size, bn = ((size_t)n + W - 1) / W, es = ts_dtype_size(acc);
    if (!(acc == d && (size_t)n % W == 0)) {
        size_t b = W * bn * es;
        bytes[k++] = b ? b : 1;
    }
    size_t s = rs_scratch_bytes(c, acc, acc, 1.0, bn);
    if (s) bytes[k++] = s;
    return k;
}

ts_status ts_reduce_scatter_tensor(ts_comm *c, ts_tensor *out, ts_tensor *in, ts_reduce_op rop, double pre_div,
                                   double post_div, ts_request **r)
{
    static const char fn[] = "ts_reduce_scatter_tensor";
    ts_status s;
    if ((s = check_comm(fn, c)) || (s = check_tensor(fn, "out", out)) || (s = check_tensor(fn, "in", in))) return s;
    ts_dtype d = ts_tensor_dtype(in);
    if (ts_tensor_dtype(out) != d)
        return ts_error(TS_ERR_DTYPE, "%s: out is %s, in is %s", fn, ts_dtype_name(ts_tensor_dtype(out)),
                        ts_dtype_name(d));
    if ((s = check_reduce(fn, d, rop, pre_div, post_div))) return s;
    int64_t n = ts_tensor_numel(out);
    if (ts_tensor_numel(in) != n * c->size)
        return ts_error(TS_ERR_SHAPE, "%s: in has %lld elements, expected %d x %lld", fn,
                        (long long)ts_tensor_numel(in), c->size, (long long)n);
    size_t es = ts_dtype_size(d), nb = (size_t)n * es;
    const unsigned char *ip = ts_tensor_data(in), *op_ = ts_tensor_data(out);
    if (n > 0 && op_ < ip + (size_t)c->size * nb && ip < op_ + nb && op_ != ip + (size_t)c->rank * nb)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "%s: out overlaps in other than as in's block %d (the rank's own; in place)", fn, c->rank);
    op *o = ts__comm_op_new(c, TS_COLL_REDUCE_SCATTER);
    if (!o) return TS_ERR_NO_MEMORY;
    set_fp(o, d, n, (unsigned)rop, FP_NONE);
    o->acc = ts__acc_dtype(d);
    o->rop = rop;
    if (setup_rs(o, ip, d, pre_div, (size_t)n) != TS_OK) {
        op_discard(o);
        return TS_ERR_NO_MEMORY;
    }
    o->final_out = ts_tensor_data(out);
    o->final_dtype = d;
    o->post = post_div * (rop == TS_REDUCE_AVG ? c->size : 1);
    return submit(c, o, (size_t)ts_tensor_numel(in) * es, r);
}

/* Reduce-scatter then all-gather. When the tensor is in its accumulation
 * dtype and divides into W blocks, both run on the tensor itself (no
 * copy); otherwise on an accumulation copy padded to W blocks. */
ts_status ts_all_reduce(ts_comm *c, ts_tensor *t, ts_reduce_op rop, ts_request **r)
{
    static const char fn[] = "ts_all_reduce";
    ts_status s;
    if ((s = check_comm(fn, c)) || (s = check_tensor(fn, "t", t))) return s;
    ts_dtype d = ts_tensor_dtype(t);
    if ((s = check_reduce(fn, d, rop, 1.0, 1.0))) return s;
    size_t n = (size_t)ts_tensor_numel(t);
    op *o = ts__comm_op_new(c, TS_COLL_ALL_REDUCE);
    if (!o) return TS_ERR_NO_MEMORY;
    set_fp(o, d, (int64_t)n, (unsigned)rop, FP_NONE);
    o->acc = ts__acc_dtype(d);
    o->rop = rop;
    o->ag = true;
    size_t W = (size_t)c->size, bn = (n + W - 1) / W, es = ts_dtype_size(o->acc);
    if (o->acc == d && n % W == 0) {
        o->buf = ts_tensor_data(t);
    } else {
        if (!own_scratch(o, W * bn * es)) {
            op_discard(o);
            return TS_ERR_NO_MEMORY;
        }
        ts__comm_load_acc(o->buf, o->acc, ts_tensor_data(t), d, n, 1.0);
        memset(o->buf + n * es, 0, (W * bn - n) * es);
        o->out = ts_tensor_data(t);
        o->out_dtype = d;
        o->out_n = n;
    }
    if (setup_rs(o, o->buf, o->acc, 1.0, bn) != TS_OK) {
        op_discard(o);
        return TS_ERR_NO_MEMORY;
    }
    o->final_out = ts__comm_blk(o, c->rank);
    o->final_dtype = o->acc;
    o->post = rop == TS_REDUCE_AVG ? (double)c->size : 1.0;
    return submit(c, o, n * ts_dtype_size(d), r);
}

ts_status ts_broadcast(ts_comm *c, ts_tensor *t, int root, ts_request **r)
{
    static const char fn[] = "ts_broadcast";
    ts_status s;
    if ((s = check_comm(fn, c)) || (s = check_tensor(fn, "t", t))) return s;
    if (root < 0 || root >= c->size)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: root %d outside [0, %d)", fn, root, c->size);
    op *o = ts__comm_op_new(c, TS_COLL_BROADCAST);
    if (!o) return TS_ERR_NO_MEMORY;
    set_fp(o, ts_tensor_dtype(t), ts_tensor_numel(t), FP_NONE, (unsigned)root);
    o->root = root;
    o->buf = ts_tensor_data(t);
    o->block = (size_t)ts_tensor_numel(t) * ts_dtype_size(ts_tensor_dtype(t));
    return submit(c, o, o->block, r);
}

ts_status ts_barrier(ts_comm *c, ts_request **r)
{
    static const char fn[] = "ts_barrier";
    ts_status s;
    if ((s = check_comm(fn, c))) return s;
    op *o = ts__comm_op_new(c, TS_COLL_BARRIER);
    if (!o) return TS_ERR_NO_MEMORY;
    o->block = 1;
    o->buf = ts__calloc(TS_MEM_COMM, (size_t)c->size, 1);
    o->owned = true;
    o->ag = true;
    if (!o->buf) {
        op_discard(o);
        return TS_ERR_NO_MEMORY;
    }
    set_inline_ag(o);
    return submit(c, o, 0, r);
}
/* ------------------------------------------------------------------ */
/* Subgroups                                                           */
/* ------------------------------------------------------------------ */

/* ts_comm_new_group's ranks: each in parent, none twice. */
static ts_status check_group_ranks(const char *fn, const ts_comm *parent, int n, const int *ranks)
{
    int P = parent->size;
    for (int i = 0; i < n; i++)
        if (ranks[i] < 0 || ranks[i] >= P)
            return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: rank %d (entry %d) outside [0, %d)", fn, ranks[i], i, P);
    for (int i = 0; i < n; i++)
        for (int j = 0; j < i; j++)
            if (ranks[i] == ranks[j])
                return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: rank %d appears twice (entries %d and %d)", fn, ranks[i],
                                j, i);
    return TS_OK;
}

/* ts_comm_new_group's id, agreed on: the largest next free id among
 * parent's members (an all-reduce of parent), into *gid_out. */
static ts_status agree_gid(const char *fn, ts_comm *parent, uint64_t *gid_out)
{
    world *w = parent->w;
    ts_status s;
    ts_tensor *t = NULL;
    int64_t one = 1;
    if ((s = ts_tensor_new_cpu(false, TS_I64, 1, &one, &t))) return s;
    *(int64_t *)ts_tensor_data(t) = (int64_t)(w ? atomic_load(&w->next_gid) : 1);
    s = ts_all_reduce(parent, t, TS_REDUCE_MAX, NULL);
    uint64_t gid = (uint64_t) * (int64_t *)ts_tensor_data(t);
    ts_tensor_free(t);
    if (s) return s;
    if (gid >= GID_LIMIT - 1) /* 0xffff carries the failure notices */
        return ts_error(TS_ERR_UNSUPPORTED, "%s: group id %llu; the tag layout allows %llu groups", fn,
                        (unsigned long long)gid, (unsigned long long)(GID_LIMIT - 2));
    *gid_out = gid;
    return TS_OK;
}

ts_status ts_comm_new_group(ts_comm *parent, int n, const int *ranks, ts_comm **out)
{
    static const char fn[] = "ts_comm_new_group";
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL out", fn);
    *out = NULL;
    ts_status s;
    if ((s = check_comm(fn, parent))) return s;
    if (n < 1 || !ranks) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: empty rank list (n = %d)", fn, n);
    if ((s = check_group_ranks(fn, parent, n, ranks))) return s;
    uint64_t gid = 0;
    if ((s = agree_gid(fn, parent, &gid))) return s;
    world *w = parent->w;
    if (w) {
        uint64_t cur = atomic_load(&w->next_gid);
        while (cur <= gid && !atomic_compare_exchange_weak(&w->next_gid, &cur, gid + 1)) {}
    }
    int me = -1;
    for (int i = 0; i < n; i++)
        if (ranks[i] == parent->rank) me = i;
    if (me < 0) return TS_OK;
    ts_comm *c = ts__calloc(TS_MEM_COMM, 1, sizeof *c);
    int *map = ts__malloc(TS_MEM_COMM, (size_t)n * sizeof *map);
    if (!c || !map) {
        ts__free(TS_MEM_COMM, c);
        ts__free(TS_MEM_COMM, map);
        return TS_ERR_NO_MEMORY;
    }
    for (int i = 0; i < n; i++) map[i] = parent->map ? parent->map[ranks[i]] : ranks[i];
    c->w = w;
    c->rank = me;
    c->size = n;
    c->gid = gid;
    c->is_group = true;
    c->map = map;
    pthread_mutex_init(&c->stats_mu, NULL);
    *out = c;
    return TS_OK;
}

void ts_comm_free(ts_comm *c)
{
    if (!c || !c->is_group) return;
    ts__comm_log_summary(c);
    pthread_mutex_destroy(&c->stats_mu);
    ts__free(TS_MEM_COMM, c->map);
    ts__free(TS_MEM_COMM, c);
}
/* ------------------------------------------------------------------ */
/* List all-gather, all-to-all, point-to-point                         */
/* ------------------------------------------------------------------ */

ts_status ts_all_gather(ts_comm *c, int nout, ts_tensor **outs, ts_tensor *in, ts_request **r)
{
    static const char fn[] = "ts_all_gather";
    ts_status s;
    if ((s = check_comm(fn, c)) || (s = check_tensor(fn, "in", in))) return s;
    if (!outs) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL outs", fn);
    if (nout != c->size) return ts_error(TS_ERR_SHAPE, "%s: %d outputs for a group of %d", fn, nout, c->size);
    ts_dtype d = ts_tensor_dtype(in);
    int64_t n = ts_tensor_numel(in);
    for (int i = 0; i < nout; i++) {
        char what[32];
        snprintf(what, sizeof what, "outs[%d]", i);
        if ((s = check_tensor(fn, what, outs[i]))) return s;
        if (ts_tensor_dtype(outs[i]) != d)
            return ts_error(TS_ERR_DTYPE, "%s: outs[%d] is %s, in is %s", fn, i,
                            ts_dtype_name(ts_tensor_dtype(outs[i])), ts_dtype_name(d));
        if (ts_tensor_numel(outs[i]) != n)
            return ts_error(TS_ERR_SHAPE, "%s: outs[%d] has %lld elements, in %lld", fn, i,
                            (long long)ts_tensor_numel(outs[i]), (long long)n);
    }
    op *o = ts__comm_op_new(c, TS_COLL_ALL_GATHER);
    if (!o) return TS_ERR_NO_MEMORY;
    set_fp(o, d, n, FP_NONE, FP_NONE);
    o->block = (size_t)n * ts_dtype_size(d);
    bool got = own_scratch(o, (size_t)c->size * o->block);
    o->outs = ts__malloc(TS_MEM_COMM, (size_t)c->size * sizeof *o->outs);
    if (!got || !o->outs) {
        op_discard(o);
        return TS_ERR_NO_MEMORY;
    }
    for (int i = 0; i < nout; i++) o->outs[i] = ts_tensor_data(outs[i]);
    o->ag = true;
    if (o->block) memcpy(ts__comm_blk(o, c->rank), ts_tensor_data(in), o->block);
    set_inline_ag(o);
    return submit(c, o, o->block, r);
}

ts_status ts_all_to_all(ts_comm *c, ts_tensor *out, ts_tensor *in, ts_request **r)
{
    static const char fn[] = "ts_all_to_all";
    ts_status s;
    if ((s = check_comm(fn, c)) || (s = check_tensor(fn, "out", out)) || (s = check_tensor(fn, "in", in))) return s;
    ts_dtype d = ts_tensor_dtype(in);
    if (ts_tensor_dtype(out) != d)
        return ts_error(TS_ERR_DTYPE, "%s: out is %s, in is %s", fn, ts_dtype_name(ts_tensor_dtype(out)),
                        ts_dtype_name(d));
    int64_t total = ts_tensor_numel(in);
    if (total % c->size != 0)
        return ts_error(TS_ERR_SHAPE, "%s: in has %lld elements, not a multiple of the group size %d", fn,
                        (long long)total, c->size);
    if (ts_tensor_numel(out) != total)
        return ts_error(TS_ERR_SHAPE, "%s: out has %lld elements, in %lld", fn, (long long)ts_tensor_numel(out),
                        (long long)total);
    op *o = ts__comm_op_new(c, TS_COLL_ALL_TO_ALL);
    if (!o) return TS_ERR_NO_MEMORY;
    set_fp(o, d, total, FP_NONE, FP_NONE);
    size_t bytes = (size_t)total * ts_dtype_size(d);
    o->block = bytes / (size_t)c->size;
    if (!own_scratch(o, bytes)) {
        op_discard(o);
        return TS_ERR_NO_MEMORY;
    }
    o->a2a_out = ts_tensor_data(out);
    if (bytes) {
        memcpy(o->buf, ts_tensor_data(in), bytes);
        size_t at = (size_t)c->rank * o->block;
        memcpy(o->a2a_out + at, o->buf + at, o->block);
    }
    return submit(c, o, bytes, r);
}

static unsigned char g_empty[1];

static ts_status p2p(const char *fn, ts_coll_kind kind, ts_comm *c, ts_tensor *t, int peer, int tag, ts_request **r)
{
    ts_status s;
    if ((s = check_comm(fn, c)) || (s = check_tensor(fn, "t", t))) return s;
    const char *who = kind == TS_COLL_SEND ? "dst" : "src";
    if (peer < 0 || peer >= c->size)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %s %d outside [0, %d)", fn, who, peer, c->size);
    if (peer == c->rank) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %s %d is the caller", fn, who, peer);
    if (tag < 0 || tag > TS_P2P_TAG_MAX)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: tag %d outside [0, %d]", fn, tag, TS_P2P_TAG_MAX);
    size_t bytes = (size_t)ts_tensor_numel(t) * ts_dtype_size(ts_tensor_dtype(t));
    op *o = ts__comm_op_new(c, kind);
    if (!o) return TS_ERR_NO_MEMORY;
    o->peer = peer;
    o->block = bytes;
    o->tagbase = (uint64_t)(unsigned)tag << 8;
    if (bytes == 0) {
        o->buf = g_empty;
    } else if (kind == TS_COLL_SEND) {
        if (!own_scratch(o, bytes)) {
            op_discard(o);
            return TS_ERR_NO_MEMORY;
        }
        memcpy(o->buf, ts_tensor_data(t), bytes);
    } else {
        o->buf = ts_tensor_data(t);
    }
    return submit(c, o, bytes, r);
}

ts_status ts_send(ts_comm *c, ts_tensor *t, int dst, int tag, ts_request **r)
{
    return p2p("ts_send", TS_COLL_SEND, c, t, dst, tag, r);
}

ts_status ts_recv(ts_comm *c, ts_tensor *t, int src, int tag, ts_request **r)
{
    return p2p("ts_recv", TS_COLL_RECV, c, t, src, tag, r);
}
