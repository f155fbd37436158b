/*
 * Parameters below the persistence threshold (ts_fsdp_options.
 * persist_threshold_numel; DeepSpeed's stage3_param_persistence_threshold):
 * a call's parameters with fewer elements stay whole in their slots on
 * every rank (replicated: never all-gathered, their optimizer state
 * replicated like them) and their gradients are all-reduced at the end of
 * the backward, every persistent parameter under the root packed into one
 * bucket (one per reduce dtype and reduction plan: usually exactly one).
 *
 * The reduction mirrors a group's (ts__fsdp_reduce_plan): the shard
 * group's collective with its pre- and post-division, then under HSDP the
 * replicate group's, so that a persistent parameter's gradient equals the
 * one its shard would get, bit for bit where the collectives add in the
 * same order. It happens when the group's flags say its gradients are
 * reduced (requires_gradient_sync; under HSDP also requires_all_reduce: a
 * reduction without it is put off whole until one with it, which is the
 * same sum). Between backwards the gradient the last reduction set is kept
 * aside while the next backward accumulates (only the new local part is
 * reduced, then the two are added, as a shard's gradient is accumulated).
 *
 * A parameter a rank has no gradient for is packed as zeros, and after
 * the data the bucket carries one flag per parameter (1 where this rank
 * had a gradient), reduced with it: every rank sets the reduced gradient
 * where any rank had one and none where no rank did (param_group.c's
 * [Note: unused parameters]).
 * Floor 3 (internal.h, "Floors"): may call floors 1-2 (common.c: the
 * registries, growing arrays, ts__fsdp_reduce_plan).
 */
#include "fully_shard/internal.h"

#include "comm/comm_internal.h"

#include "tensor/internal.h"
#include "tensor/kernels.h"

#include <string.h>

static bool is_float(ts_dtype d) { return d == TS_F32 || d == TS_F64 || d == TS_BF16 || d == TS_F16; }

ts_status ts__fsdp_persist_take(const char *fn, ts__fsdp_collect *c, const ts_fsdp_options *o, fsdp_persist **out,
                                int *n_out)
{
    *out = NULL;
    *n_out = 0;
    int64_t thr = o->persist_threshold_numel;
    if (thr <= 0) return TS_OK;
    int k = 0;
    for (int i = 0; i < c->n; i++) {
        ts_tensor *t = c->c[i].t;
        if (ts_tensor_numel(t) >= thr) continue;
        char other[TS__FSDP_FQN_MAX] = "";
        if (ts__fsdp_reg_owner(t, other, sizeof other) || ts_tensor_is_shard(t))
            return ts_error(
                TS_ERR_INVALID_ARGUMENT,
                "%s: parameter '%s' is shared with a parameter already managed by another FSDP group%s%s%s; "
                "for shared (tied) parameters, shard the modules that use it in one call "
                "(ts_fully_shard_group) so that they form one group",
                fn, c->c[i].fqn, *other ? " ('" : "", other, *other ? "')" : "");
        ts_dtype d = ts_tensor_dtype(t);
        if (!is_float(d))
            return ts_error(TS_ERR_DTYPE, "%s: parameter '%s' is %s; only floating-point parameters can be managed", fn,
                            c->c[i].fqn, ts_dtype_name(d));
        if (!ts__is_meta(t) && !ts_tensor_data(t) && ts_tensor_numel(t) > 0)
            return ts_error(TS_ERR_RELEASED, "%s: the storage of parameter '%s' is released", fn, c->c[i].fqn);
        if (o->mp_policy && o->mp_policy->param_dtype != TS_DTYPE_KEEP && o->mp_policy->param_dtype != d)
            return ts_error(TS_ERR_UNSUPPORTED,
                            "%s: parameter '%s' (%lld elements, %s) is below persist_threshold_numel %lld, and "
                            "persistent parameters are not cast to the mixed-precision param_dtype %s: not built; "
                            "set persist_threshold_numel to 0 (or at most %lld) for this call",
                            fn, c->c[i].fqn, (long long)ts_tensor_numel(t), ts_dtype_name(d), (long long)thr,
                            ts_dtype_name(o->mp_policy->param_dtype), (long long)ts_tensor_numel(t));
        if (o->offload_policy)
            return ts_error(TS_ERR_UNSUPPORTED,
                            "%s: parameter '%s' (%lld elements) is below persist_threshold_numel %lld, and persistent "
                            "parameters are not offloaded: not built; set persist_threshold_numel to 0 for a call "
                            "with an offload policy",
                            fn, c->c[i].fqn, (long long)ts_tensor_numel(t), (long long)thr);
        k++;
    }
    if (!k) return TS_OK;
    fsdp_persist *p = ts__calloc(TS_MEM_NN, (size_t)k, sizeof *p);
    if (!p) return TS_ERR_NO_MEMORY;
    int j = 0;
    for (int i = 0; i < c->n; i++) {
        ts_tensor *t = c->c[i].t;
        if (ts_tensor_numel(t) >= thr) continue;
        p[j].fqn = ts__strdup(TS_MEM_NN, c->c[i].fqn);
        if (!p[j].fqn) {
            ts__fsdp_persist_free(p, j);
            return TS_ERR_NO_MEMORY;
        }
        p[j].t = ts_tensor_retain(t);
        p[j].rdtype = o->mp_policy && o->mp_policy->reduce_dtype != TS_DTYPE_KEEP ? o->mp_policy->reduce_dtype
                                                                                  : ts_tensor_dtype(t);
        j++;
    }
    /* from here nothing fails: drop them from the candidates, their slots
     * moved to the persistent parameters (the slot registry reads them) */
    int w = 0;
    j = 0;
    for (int i = 0; i < c->n; i++) {
        if (ts_tensor_numel(c->c[i].t) < thr) {
            p[j].slots = c->c[i].slots;
            p[j].n_slots = c->c[i].n_slots;
            j++;
            ts__free(TS_MEM_NN, c->c[i].owners);
            continue;
        }
        if (w != i) c->c[w] = c->c[i];
        w++;
    }
    c->n = w;
    *out = p;
    *n_out = k;
    return TS_OK;
}

void ts__fsdp_persist_free(fsdp_persist *p, int n)
{
    for (int i = 0; i < n; i++) {
        ts__free(TS_MEM_NN, p[i].fqn);
        ts__free(TS_MEM_NN, p[i].slots);
        ts_tensor_free(p[i].t);
        ts_tensor_free(p[i].mine);
        ts_tensor_free(p[i].reduced);
    }
    ts__free(TS_MEM_NN, p);
}

fsdp_persist *ts__fsdp_find_persist(ts__fsdp_groups_walk *w, const ts_tensor *t)
{
    for (int i = 0; i < w->n; i++)
        for (int k = 0; k < w->g[i]->n_persist; k++)
            if (w->g[i]->persist[k].t == t) return &w->g[i]->persist[k];
    return NULL;
}

/* ------------------------------------------------------------------ */
/* The buckets                                                        */
/* ------------------------------------------------------------------ */

typedef struct pb_entry {
    fsdp_persist *p;
    int64_t off; /* in the bucket, elements */
    bool had;    /* it had a local gradient (else packed as zeros); after the reduction: some rank had one
                     (the others get none) */
} pb_entry;

typedef struct fsdp_pbucket {
    ts_comm *pg, *rg; /* rg: HSDP's replicate group, NULL otherwise */
    ts_dtype rdtype;
    fsdp_reduce_plan plan;
    pb_entry *e;
    int n, cap;
    int64_t numel; /* the gradients' elements; the buffer has n more: the flags */
    ts_tensor *buf;
    ts_request *req;
    /* a meta step ([Note: meta step] in param_group.c): the all-reduce was
     * skipped (in flight until finished) and the pool scratch it would
     * hold until then is held as meta storages */
    bool meta;
    ts_tensor *hold[2];
} fsdp_pbucket;

static bool bucket_meta(const fsdp_pbucket *b) { return ts__meta_mode() || ts__is_meta(b->buf); }

static void drop_holds(fsdp_pbucket *b)
{
    for (int i = 0; i < 2; i++) {
        ts_tensor_free(b->hold[i]);
        b->hold[i] = NULL;
    }
}

/* The skipped all-reduce of b over c: its scratch, held as meta storages. */
static ts_status hold_scratch(fsdp_pbucket *b, ts_comm *c)
{
    size_t bytes[2];
    int n = ts__comm_all_reduce_scratch(c, b->rdtype, ts_tensor_numel(b->buf), bytes);
    bool scoped = ts__meta_mode();
    if (!scoped && ts_device_scope_enter(TS_DEVICE_META)) return TS_ERR_INTERNAL;
    ts_status st = TS_OK;
    for (int i = 0; i < n && !st; i++)
        st = ts_tensor_empty(TS_BOOL, 1, (const int64_t[]){(int64_t)bytes[i]}, &b->hold[i]);
    if (!scoped) (void)ts_device_scope_exit();
    return st;
}

struct fsdp_pbuckets {
    fsdp_pbucket *b;
    int n, cap;
};

static bool is_hsdp(const fsdp_group *g) { return g->rg && ts_comm_size(g->rg) > 1; }

static bool same_plan(const fsdp_reduce_plan *a, const fsdp_reduce_plan *b)
{
    return a->rs_op == b->rs_op && a->ar_op == b->ar_op && a->rs_pre == b->rs_pre && a->rs_post == b->rs_post &&
        a->post == b->post;
}

static void buckets_free(fsdp_ctx *c)
{
    struct fsdp_pbuckets *pb = c->pb;
    if (!pb) return;
    for (int i = 0; i < pb->n; i++) {
        fsdp_pbucket *b = &pb->b[i];
        if (b->req) {
            (void)ts_request_wait(b->req);
            ts_request_free(b->req);
        }
        drop_holds(b);
        ts_tensor_free(b->buf);
        ts__free(TS_MEM_NN, b->e);
    }
    ts__free(TS_MEM_NN, pb->b);
    ts__free(TS_MEM_NN, pb);
    c->pb = NULL;
}

/* Calls fn on every distinct group under the root with persistent
 * parameters (whose module is alive). */
typedef ts_status (*group_fn)(fsdp_ctx *c, fsdp_group *g);

static ts_status each_group(fsdp_ctx *c, group_fn fn)
{
    unsigned walk = ++c->persist_walk;
    ts_status st = TS_OK;
    for (int i = 0; i < c->n_states && !st; i++) {
        fsdp_group *g = c->states[i]->group;
        if (!g || !g->n_persist || !c->states[i]->module || g->persist_mark == walk) continue;
        g->persist_mark = walk;
        st = fn(c, g);
    }
    return st;
}

static ts_status begin_group(fsdp_ctx *c, fsdp_group *g)
{
    (void)c;
    for (int k = 0; k < g->n_persist; k++) {
        fsdp_persist *p = &g->persist[k];
        ts_tensor *gr = ts_tensor_grad(p->t);
        if (p->mine && gr == p->mine && !p->reduced) { /* the last reduction's result: aside */
            p->reduced = ts_tensor_retain(gr);
            (void)ts_tensor_set_grad(p->t, NULL);
        }
        ts_tensor_free(p->mine);
        p->mine = NULL;
    }
    return TS_OK;
}

void ts__fsdp_persist_begin_backward(fsdp_ctx *c) { (void)each_group(c, begin_group); }

static ts_status add_group(fsdp_ctx *c, fsdp_group *g)
{
    if (!g->reduce_grads || (is_hsdp(g) && !g->all_reduce_grads)) return TS_OK; /* not now: kept locally */
    if (!c->pb && !(c->pb = ts__calloc(TS_MEM_NN, 1, sizeof *c->pb))) return TS_ERR_NO_MEMORY;
    struct fsdp_pbuckets *pb = c->pb;
    fsdp_reduce_plan plan = ts__fsdp_reduce_plan(g);
    ts_comm *rg = is_hsdp(g) ? g->rg : NULL;
    for (int k = 0; k < g->n_persist; k++) {
        fsdp_persist *p = &g->persist[k];
        if (!ts_tensor_requires_grad(p->t)) continue;
        fsdp_pbucket *b = NULL;
        for (int i = 0; i < pb->n && !b; i++)
            if (pb->b[i].pg == g->pg && pb->b[i].rg == rg && pb->b[i].rdtype == p->rdtype &&
                same_plan(&pb->b[i].plan, &plan))
                b = &pb->b[i];
        if (!b) {
            if (!ts__fsdp_grow((void **)&pb->b, &pb->cap, pb->n + 1, sizeof *pb->b)) return TS_ERR_NO_MEMORY;
            b = &pb->b[pb->n++];
            memset(b, 0, sizeof *b);
            b->pg = g->pg;
            b->rg = rg;
            b->rdtype = p->rdtype;
            b->plan = plan;
        }
        if (!ts__fsdp_grow((void **)&b->e, &b->cap, b->n + 1, sizeof *b->e)) return TS_ERR_NO_MEMORY;
        b->e[b->n++] = (pb_entry){p, b->numel, false};
        b->numel += ts_tensor_numel(p->t);
    }
    return TS_OK;
}

/* Packs the local gradients of b's parameters into its buffer (rdtype;
 * zeros for a parameter without one), then the flags. */
static ts_status pack(fsdp_pbucket *b)
{
    int64_t n = b->numel + b->n;
    ts_status st = ts_tensor_empty(b->rdtype, 1, &n, &b->buf);
    if (st) return st;
    unsigned char *buf = ts_tensor_data(b->buf); /* NULL in a meta step: nothing is written */
    size_t es = ts_dtype_size(b->rdtype);
    for (int i = 0; i < b->n && !st; i++) {
        pb_entry *e = &b->e[i];
        ts_tensor *gr = ts_tensor_grad(e->p->t);
        int64_t ne = ts_tensor_numel(e->p->t);
        e->had = gr != NULL;
        double flag = e->had ? 1.0 : 0.0;
        if (buf) ts__buf_convert(b->rdtype, buf + (size_t)(b->numel + i) * es, TS_F64, &flag, 1);
        if (!gr) {
            if (buf) memset(buf + (size_t)e->off * es, 0, (size_t)ne * es);
            continue;
        }
        ts_tensor *cg = NULL;
        bool prev = ts_grad_mode_set(false);
        st = ts_contiguous(gr, &cg);
        ts_grad_mode_set(prev);
        if (st) break;
        if (buf && ts_tensor_data(cg))
            ts__buf_convert(b->rdtype, buf + (size_t)e->off * es, ts_tensor_dtype(cg), ts_tensor_data(cg), ne);
        ts_tensor_free(cg);
    }
    return st;
}

ts_status ts__fsdp_persist_issue(fsdp_ctx *c)
{
    if (c->pb) buckets_free(c); /* left by a failure: dropped */
    ts_status st = each_group(c, add_group);
    struct fsdp_pbuckets *pb = c->pb;
    for (int i = 0; pb && i < pb->n && !st; i++) {
        fsdp_pbucket *b = &pb->b[i];
        TS_TRACE_BEGIN(tp);
        st = pack(b);
        TS_TRACE_END(tp, "fsdp.pack_persistent", "copy");
        if (st) break;
        if (bucket_meta(b)) { /* skipped: complete when finished */
            st = hold_scratch(b, b->pg);
            b->meta = !st;
            continue;
        }
        if (b->plan.rs_pre != 1.0) ts__buf_div(b->rdtype, ts_tensor_data(b->buf), b->numel, b->plan.rs_pre);
        st = ts_all_reduce(b->pg, b->buf, b->plan.rs_op, &b->req);
    }
    if (st) ts__fsdp_persist_discard(c);
    return st;
}

/* True when g (a parameter's .grad) is a contiguous tensor of its own
 * storage that only the parameter holds (the one autograd accumulated):
 * the reduced gradient can be written over it. */
static bool only_holder(const ts_tensor *g)
{
    return atomic_load(&g->refcount) == 1 && atomic_load(&g->storage->refcount) == 1 && ts_tensor_is_contiguous(g) &&
        g->offset == 0 && (ts_tensor_data(g) || ts__is_meta(g)) &&
        ts_tensor_numel(g) * (int64_t)ts_dtype_size(g->dtype) == (int64_t)g->storage->nbytes;
}

/* b's reduced gradients onto its parameters (plus what was set aside). */
static ts_status unpack(fsdp_pbucket *b)
{
    const unsigned char *buf = ts_tensor_data(b->buf);
    size_t es = ts_dtype_size(b->rdtype);
    ts_status st = TS_OK;
    for (int i = 0; i < b->n && !st; i++) {
        pb_entry *e = &b->e[i];
        fsdp_persist *p = e->p;
        if (!e->had) continue;
        ts_tensor *t = p->t, *ng = NULL, *gr = ts_tensor_grad(t);
        ts_dtype d = ts_tensor_dtype(t);
        int64_t ne = ts_tensor_numel(t);
        if (gr && only_holder(gr)) { /* the local gradient nobody else sees: overwritten in place */
            ng = ts_tensor_retain(gr);
        } else if ((st = ts_tensor_empty(d, ts_tensor_ndim(t), ts_tensor_shape(t), &ng))) {
            break;
        }
        if (buf && ts_tensor_data(ng)) ts__buf_convert(d, ts_tensor_data(ng), b->rdtype, buf + (size_t)e->off * es, ne);
        if (p->reduced) { /* the gradient of earlier backwards, already reduced */
            ts_tensor *cr = NULL;
            bool prev = ts_grad_mode_set(false);
            st = ts_contiguous(p->reduced, &cr);
            ts_grad_mode_set(prev);
            if (st) {
                ts_tensor_free(ng);
                break;
            }
            if (ts_tensor_data(ng) && ts_tensor_data(cr)) ts__buf_add(d, ts_tensor_data(ng), ts_tensor_data(cr), ne);
            ts_tensor_free(cr);
            ts_tensor_free(p->reduced);
            p->reduced = NULL;
        }
        st = ts_tensor_set_grad(t, ng);
        ts_tensor_free(p->mine);
        p->mine = st ? NULL : ng; /* the reference from ts_tensor_empty */
        if (st) ts_tensor_free(ng);
    }
    return st;
}

/* The parameters of groups that did not reduce keep their local
 * gradients (microbatches without sync); a parameter that reduced without
 * a local gradient gets back what was set aside. */
static ts_status restore_group(fsdp_ctx *c, fsdp_group *g)
{
    (void)c;
    for (int k = 0; k < g->n_persist; k++) {
        fsdp_persist *p = &g->persist[k];
        if (!p->reduced || ts_tensor_grad(p->t)) continue;
        if (!g->reduce_grads || (is_hsdp(g) && !g->all_reduce_grads)) continue; /* aside until the sync */
        ts_status st = ts_tensor_set_grad(p->t, p->reduced);
        if (st) return st;
        ts_tensor_free(p->mine);
        p->mine = p->reduced;
        p->reduced = NULL;
    }
    return TS_OK;
}

ts_status ts__fsdp_persist_finish(fsdp_ctx *c)
{
    struct fsdp_pbuckets *pb = c->pb;
    ts_status st = TS_OK;
    for (int i = 0; pb && i < pb->n && !st; i++) {
        fsdp_pbucket *b = &pb->b[i];
        if (b->meta) { /* a meta step: the skipped all-reduce completes; this rank's flags stand */
            b->meta = false;
            drop_holds(b);
            if (b->rg) {
                size_t bytes[2];
                ts__meta_scratch(ts__comm_all_reduce_scratch(b->rg, b->rdtype, ts_tensor_numel(b->buf), bytes), bytes);
            }
            st = unpack(b);
            continue;
        }
        if (!b->req) continue;
        TS_TRACE_BEGIN(tw);
        st = ts_request_wait(b->req);
        ts_request_free(b->req);
        b->req = NULL;
        void *x = ts_tensor_data(b->buf);
        if (!st && b->plan.rs_post != 1.0) ts__buf_div(b->rdtype, x, b->numel, b->plan.rs_post);
        if (!st && b->rg) {
            st = ts_all_reduce(b->rg, b->buf, b->plan.ar_op, NULL);
            if (!st && b->plan.post != 1.0) ts__buf_div(b->rdtype, x, b->numel, b->plan.post);
        }
        TS_TRACE_END(tw, "fsdp.wait_reduce", "wait");
        for (int k = 0; !st && k < b->n; k++) { /* any rank's flag: nonzero after SUM or AVG */
            double f = 0;
            ts__buf_convert(TS_F64, &f, b->rdtype,
                            (const unsigned char *)x + (size_t)(b->numel + k) * ts_dtype_size(b->rdtype), 1);
            b->e[k].had = f != 0;
        }
        if (!st) st = unpack(b);
    }
    if (st) {
        ts__fsdp_persist_discard(c);
        return st;
    }
    buckets_free(c);
    return each_group(c, restore_group);
}

static ts_status discard_group(fsdp_ctx *c, fsdp_group *g)
{
    (void)c;
    for (int k = 0; k < g->n_persist; k++) {
        fsdp_persist *p = &g->persist[k];
        if (p->mine && ts_tensor_grad(p->t) == p->mine) continue; /* already reduced: kept */
        (void)ts_tensor_set_grad(p->t, p->reduced);
        ts_tensor_free(p->mine);
        p->mine = p->reduced;
        p->reduced = NULL;
    }
    return TS_OK;
}

void ts__fsdp_persist_discard(fsdp_ctx *c)
{
    buckets_free(c);
    (void)each_group(c, discard_group);
}
