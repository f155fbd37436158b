/*
 * fully_shard's per-module state (PyTorch's _fsdp_state.py): the
 * "<Type>FSDPModule" vtables that replace a sharded module's, the states'
 * and roots' reference counts, lazy initialization at the root's first
 * forward, the forward wrapper (pre- and post-forward, reshard policy), the
 * autograd markers around a module's inputs and outputs (pre- and
 * post-backward, the end-of-backward callback) and implicit and explicit
 * prefetch.
 * Also the groups of a subtree (ts__fsdp_subtree_groups, ts__fsdp_idle_groups)
 * and the TS_DISTRIBUTED_DEBUG figures when a root is freed.
 * Floor 5 (internal.h, "Floors"): may call floors 1-4 (common.c, repr.c,
 * persist.c, param_group.c).
 */
#include "fully_shard/internal.h"

#include "comm/comm_internal.h"
#include "nn/internal.h"
#include "tensor/internal.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ */
/* The "<Type>FSDPModule" vtables                                     */
/* ------------------------------------------------------------------ */

static ts_status fsdp_forward(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out);
static void fsdp_free(ts_module *m);
static ts_status fsdp_rebase(ts_module *m, const ts_module_vtable *inner);
static ts_status fsdp_call(fsdp_state *st, ts_module_fn fn, int n_in, ts_tensor *const *in, int *n_out,
                           ts_tensor **out);

/* The FSDP vtable's method dispatcher (ts_module_call_method): method k of
 * the original, through the FSDP wrapper when registered. */
static ts_status fsdp_call_method(ts_module *m, int k, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    fsdp_state *st = m->ext;
    if (!st || k < 0 || k >= st->orig_vt->n_methods)
        return ts_error(TS_ERR_INTERNAL, "fully_shard: method %d of %s is out of range", k, ts_module_type_name(m));
    ts_module_fn fn = st->orig_vt->methods[k].fn;
    if (!st->method_wrapped || !st->method_wrapped[k]) return fn(m, n_in, in, n_out, out);
    return fsdp_call(st, fn, n_in, in, n_out, out);
}

/* The rebase slot (ts_checkpoint_module after fully_shard): m's FSDP
 * vtable becomes the one extending `inner`, which extends the original. */
static ts_status fsdp_rebase(ts_module *m, const ts_module_vtable *inner)
{
    fsdp_state *s = m->ext;
    if (!s || !inner || inner->base != s->orig_vt)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "fully_shard: %s can only be re-based onto a vtable extending %s",
                        ts_module_type_name(m), s ? s->orig_vt->type_name : "its original");
    const ts_module_vtable *vt = NULL;
    ts_status st = ts__fsdp_vtable(inner, &vt);
    if (st) return st;
    s->orig_vt = inner;
    m->vtable = vt;
    return TS_OK;
}

/* Every FSDP vtable, and only those, has fsdp_forward as its forward. */
static bool is_fsdp_vt(const ts_module_vtable *vt) { return vt && vt->base && vt->forward == fsdp_forward; }

/* The FSDP slots of vt extending orig: the original's names and
 * functions, called through call_method. */
static void fsdp_fill(ts_module_vtable *vt, const ts_module_vtable *orig)
{
    (void)orig;
    vt->forward = fsdp_forward;
    vt->free = fsdp_free;
    vt->extra_repr = ts__fsdp_extra_repr;
    vt->call_method = fsdp_call_method;
    vt->rebase = fsdp_rebase;
}

/* The FSDP vtables made so far, one per original vtable (no limit on
 * module types). */
static ts__vt_cache g_vts = TS__VT_CACHE_INIT("fully_shard", "FSDPModule", fsdp_fill);

/* The cached FSDP vtable extending orig (made once per original vtable and
 * kept for the life of the process). */
ts_status ts__fsdp_vtable(const ts_module_vtable *orig, const ts_module_vtable **out)
{
    ts_status vst = ts__module_vtable_check("fully_shard", orig, false); /* free: ts__module_check_free */
    if (vst) return vst;
    if (orig->call_method)
        return ts_error(TS_ERR_UNSUPPORTED,
                        "fully_shard: %s has its own method dispatcher (call_method); fully_shard cannot wrap it",
                        orig->type_name);
    return ts__vt_cache_get(&g_vts, orig, out);
}

bool ts_module_is_fsdp(const ts_module *m) { return m && is_fsdp_vt(m->vtable) && m->ext; }

const ts_module_vtable *ts_fsdp_original_vtable(const ts_module *m)
{
    return ts_module_is_fsdp(m) ? ((fsdp_state *)m->ext)->orig_vt : NULL;
}

fsdp_state *ts__fsdp_state_of(const ts_module *m) { return ts_module_is_fsdp(m) ? m->ext : NULL; }

ts_status ts__fsdp_need_state(const char *fn, ts_module *m, fsdp_state **out)
{
    fsdp_state *s = ts__fsdp_state_of(m);
    if (!s)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %s is not an FSDP module (call ts_fully_shard first)", fn,
                        m ? ts_module_type_name(m) : "NULL");
    *out = s;
    return TS_OK;
}

static void ctx_free(fsdp_ctx *c);

/* ------------------------------------------------------------------ */
/* Reference counts                                                   */
/* ------------------------------------------------------------------ */

fsdp_state *ts__fsdp_state_retain(fsdp_state *s)
{
    if (s) atomic_fetch_add(&s->refs, 1);
    return s;
}

void ts__fsdp_state_release(fsdp_state *s)
{
    if (!s || atomic_fetch_sub(&s->refs, 1) != 1) return;
    for (int i = 0; i < s->n_fwd_prefetch; i++) ts__fsdp_state_release(s->fwd_prefetch[i]);
    for (int i = 0; i < s->n_bwd_prefetch; i++) ts__fsdp_state_release(s->bwd_prefetch[i]);
    ts__free(TS_MEM_NN, s->fwd_prefetch);
    ts__free(TS_MEM_NN, s->bwd_prefetch);
    ts__free(TS_MEM_NN, s->method_wrapped);
    ts__fsdp_ign_drop_state(s);
    if (s->ctx && s->ctx->root == s) ctx_free(s->ctx);
    ts__fsdp_group_release(s->group);
    ts__free(TS_MEM_NN, s);
}

static void ctx_free(fsdp_ctx *c)
{
    /* the root's own entry is not retained (it would keep itself alive) */
    for (int i = 0; i < c->n_states; i++)
        if (c->states[i] != c->root) ts__fsdp_state_release(c->states[i]);
    ts__free(TS_MEM_NN, c->states);
    ts__free(TS_MEM_NN, c->post_fwd);
    ts__free(TS_MEM_NN, c->fwd_order);
    ts__free(TS_MEM_NN, c->prev_fwd_order);
    ts__free(TS_MEM_NN, c);
}

/* ------------------------------------------------------------------ */
/* Root, lazy init                                                    */
/* ------------------------------------------------------------------ */

typedef struct init_walk {
    fsdp_ctx *ctx;
} init_walk;

static ts_status init_each(void *vc, const char *fqn, ts_module *m)
{
    init_walk *w = vc;
    fsdp_state *s = ts__fsdp_state_of(m);
    if (!s) return TS_OK;
    if (s->ctx && s->ctx != w->ctx)
        return ts_error(TS_ERR_STATE,
                        "fully_shard: the FSDP state of '%s' (%s) has already been lazily initialized: run forward "
                        "through the root module first",
                        fqn, ts_module_type_name(m));
    for (int i = 0; i < w->ctx->n_states; i++)
        if (w->ctx->states[i] == s) return TS_OK;
    if (!ts__fsdp_grow((void **)&w->ctx->states, &w->ctx->cap_states, w->ctx->n_states + 1, sizeof *w->ctx->states))
        return TS_ERR_NO_MEMORY;
    w->ctx->states[w->ctx->n_states++] = s == w->ctx->root ? s : ts__fsdp_state_retain(s);
    s->ctx = w->ctx;
    snprintf(s->fqn, sizeof s->fqn, "%s", fqn);
    return TS_OK;
}

/* Group names: its modules' names joined by ", " (the root's is ""). */
static void name_groups(fsdp_ctx *c)
{
    for (int i = 0; i < c->n_states; i++) {
        fsdp_group *g = c->states[i]->group;
        if (!g) continue;
        bool first = true;
        for (int j = 0; j < i && first; j++) first = c->states[j]->group != g;
        size_t l = first ? 0 : strlen(g->fqn);
        snprintf(g->fqn + l, sizeof g->fqn - l, "%s%s", first ? "" : ", ", c->states[i]->fqn);
    }
}

ts_reshard_policy ts__fsdp_resolved_policy(const fsdp_group *g, bool root)
{
    ts_reshard_policy p = g->user_policy;
    if (p == TS_RESHARD_AUTO) p = root ? TS_RESHARD_FALSE : TS_RESHARD_TRUE;
    if (p == TS_RESHARD_EVERY_N && g->every_n == 1) p = TS_RESHARD_TRUE;
    return p;
}

static void resolve_policy(fsdp_group *g, bool root) { g->policy = ts__fsdp_resolved_policy(g, root); }

ts_status ts__fsdp_lazy_init(fsdp_state *st)
{
    if (st->ctx) return TS_OK;
    fsdp_ctx *c = ts__calloc(TS_MEM_NN, 1, sizeof *c);
    if (!c) return TS_ERR_NO_MEMORY;
    c->root = st;
    c->implicit_fwd = c->implicit_bwd = true;
    c->not_last_backward = st->not_last_backward;
    st->ctx = c;
    init_walk w = {c};
    ts_status s = ts_module_named_modules(st->module, init_each, &w);
    if (s) {
        for (int i = 0; i < c->n_states; i++)
            if (c->states[i] != st) c->states[i]->ctx = NULL;
        st->ctx = NULL;
        ctx_free(c);
        return s;
    }
    /* a group shared by a grouped call belongs to several states: it is
     * the root's only when the root's own state holds it */
    for (int i = 0; i < c->n_states; i++)
        if (c->states[i]->group) resolve_policy(c->states[i]->group, false);
    if (st->group) resolve_policy(st->group, true); /* the root's group, even when shared with others */
    name_groups(c);
    return TS_OK;
}

/* ------------------------------------------------------------------ */
/* Backward                                                           */
/* ------------------------------------------------------------------ */

static ts_status final_callback(void *vctx);

static bool order_push(fsdp_group ***arr, int *n, int *cap, fsdp_group *g)
{
    if (!ts__fsdp_grow((void **)arr, cap, *n + 1, sizeof **arr)) return false;
    (*arr)[(*n)++] = g;
    return true;
}

/* The state's group when it has sharded parameters: a group of only
 * persistent parameters (persist.c) needs no unshard, no post-backward
 * marker and no place in the prefetch orders. */
static inline fsdp_group *sharded_group(const fsdp_state *s) { return s->group && s->group->n ? s->group : NULL; }

/* TS_ERR_STATE when the marker's module was freed while its graph lived. */
static ts_status marker_live(const fsdp_state *s)
{
    if (s->module && s->ctx) return TS_OK;
    return ts_error(TS_ERR_STATE, "fully_shard: an FSDP module was freed while an autograd graph through it was alive");
}

/* The pre-backward marker on a module's outputs: unshards its group before
 * its backward runs, prefetches the group that ran before it in forward,
 * and queues the root's end-of-backward work once per backward. */
static ts_status pre_backward_fn(void *vs, int n, ts_tensor **grads)
{
    (void)n, (void)grads;
    fsdp_state *s = vs;
    ts_status live = marker_live(s);
    if (live) return live;
    fsdp_ctx *c = s->ctx;
    ts_status st = TS_OK;
    c->training = FSDP_PRE_BACKWARD;
    if (!c->final_queued) {
        if ((st = ts_autograd_queue_callback(final_callback, c))) return st;
        c->final_queued = true;
        ts__fsdp_persist_begin_backward(c); /* before any gradient reaches a persistent parameter */
    }
    fsdp_group *g = sharded_group(s);
    ts__fsdp_event("pre_backward", s->fqn);
    TS_TRACE_BEGIN(t_hook);
    if (g) {
        if ((st = ts__fsdp_unshard(g)) || (st = ts__fsdp_wait_unshard(g))) return st;
        g->training = FSDP_PRE_BACKWARD;
    }
    /* backward prefetch */
    if (s->explicit_bwd) {
        for (int i = 0; i < s->n_bwd_prefetch && !st; i++)
            if (s->bwd_prefetch[i]->module) st = ts__fsdp_unshard(s->bwd_prefetch[i]->group);
    } else if (g && c->implicit_bwd) {
        /* pop this group's last post-forward index; the one before it is
         * the group to prefetch */
        int at = -1;
        for (int i = c->n_post_fwd - 1; i >= 0 && at < 0; i--)
            if (c->post_fwd[i] == g) at = i;
        if (at >= 0) {
            memmove(&c->post_fwd[at], &c->post_fwd[at + 1], (size_t)(c->n_post_fwd - at - 1) * sizeof *c->post_fwd);
            c->n_post_fwd--;
            if (at > 0) {
                st = ts__fsdp_unshard(c->post_fwd[at - 1]); /* a no-op unless sharded */
            }
        }
    }
    ts__fsdp_trace_hook(t_hook, "fsdp.pre_backward", s->fqn, g);
    return st;
}

/* The post-backward marker on a module's inputs: runs after the module's
 * backward (its gradients are all accumulated). */
static ts_status post_backward_fn(void *vs, int n, ts_tensor **grads)
{
    (void)n, (void)grads;
    fsdp_state *s = vs;
    ts_status live = marker_live(s);
    if (live) return live;
    return s->group ? ts__fsdp_post_backward(s->ctx, s->group) : TS_OK;
}

static void marker_release(void *vs) { ts__fsdp_state_release(vs); }

/* End of the backward (queued by the first pre-backward): the
 * post-backward of every group that still holds unsharded gradients (its
 * inputs needed no grad), in reverse order; then, on the last backward
 * (ts_fsdp_set_is_last_backward), every reduction is finished; every group
 * is resharded unless its reshard_after_backward is false. */
static ts_status final_callback(void *vctx)
{
    fsdp_ctx *c = vctx;
    ts_status st = TS_OK;
    for (int i = c->n_states - 1; i >= 0; i--) {
        fsdp_group *g = c->states[i]->group;
        if (!g || !c->states[i]->module) continue;
        ts_status s2 = ts__fsdp_post_backward(c, g);
        if (!st) st = s2;
    }
    /* the persistent parameters' one all-reduce, in flight while the last
     * reduce-scatters finish */
    bool persist = !st;
    if (persist) st = ts__fsdp_persist_issue(c);
    else ts__fsdp_persist_discard(c); /* as a failed backward: the aside gradients back, the local ones dropped */
    bool last = !c->not_last_backward;
    if (last && c->rs_pending) {
        ts_status s2 = ts__fsdp_finish_reduce(c->rs_pending);
        c->rs_pending = NULL;
        if (!st) st = s2;
    }
    for (int i = 0; i < c->n_states; i++) {
        fsdp_group *g = c->states[i]->group;
        if (!g) continue;
        ts_status s2 = last ? ts__fsdp_finish_reduce(g) : TS_OK;
        if (!st) st = s2;
        /* reshard after backward, as PyTorch (drops unused prefetches); a
         * group kept unsharded gets its prefetch completed */
        s2 = g->reshard_after_backward ? ts__fsdp_reshard(g) : ts__fsdp_wait_unshard(g);
        if (!st) st = s2;
        g->training = FSDP_IDLE;
    }
    if (persist) {
        ts_status s2 = ts__fsdp_persist_finish(c);
        if (!st) st = s2;
    }
    if (last) c->n_post_fwd = 0;
    c->hold_pending = !last && c->rs_pending;
    c->final_queued = false;
    c->training = FSDP_IDLE;
    return st;
}

/* ------------------------------------------------------------------ */
/* Forward                                                            */
/* ------------------------------------------------------------------ */

/* Passes the non-NULL tensors of t[0..n) through a custom autograd node
 * with backward `fn` (holding a reference to s); out[i] is the new alias
 * of t[i], NULL where t[i] is (optional inputs and outputs). */
static ts_status wrap_marker(int n, ts_tensor *const *t, ts_autograd_backward_fn fn, fsdp_state *s, ts_tensor **out)
{
    ts_tensor *dense[TS_MODULE_MAX_IO], *wrapped[TS_MODULE_MAX_IO];
    int at[TS_MODULE_MAX_IO], k = 0;
    for (int i = 0; i < n; i++) {
        out[i] = NULL;
        if (t[i]) {
            at[k] = i;
            dense[k++] = t[i];
        }
    }
    if (k == 0) return TS_OK;
    ts_status st = ts_autograd_custom(k, dense, fn, ts__fsdp_state_retain(s), marker_release, wrapped);
    if (st) {
        ts__fsdp_state_release(s);
        return st;
    }
    for (int j = 0; j < k; j++) out[at[j]] = wrapped[j];
    return TS_OK;
}

static bool any_requires_grad(int n, ts_tensor *const *t)
{
    for (int i = 0; i < n; i++)
        if (t[i] && ts_tensor_requires_grad(t[i])) return true;
    return false;
}

/* Implicit forward prefetch: the group expected after position `pos` of
 * the last iteration's order (pos = -1: the next one expected now). */
static ts_status forward_prefetch(fsdp_ctx *c, fsdp_state *s)
{
    if (s->explicit_fwd) {
        ts_status st = TS_OK;
        for (int i = 0; i < s->n_fwd_prefetch && !st; i++) {
            if (s->fwd_prefetch[i]->module)
                st = ts__fsdp_unshard(s->fwd_prefetch[i]->group); /* a no-op unless sharded */
        }
        return st;
    }
    if (!c->implicit_fwd || c->fwd_pos >= c->n_prev_fwd_order) return TS_OK;
    fsdp_group *next = c->prev_fwd_order[c->fwd_pos];
    return next->training == FSDP_FORWARD ? TS_OK : ts__fsdp_unshard(next);
}

static void prefetch_advance(fsdp_ctx *c, fsdp_group *g)
{
    /* the current group's place in last iteration's order */
    for (int i = c->fwd_pos; i < c->n_prev_fwd_order; i++)
        if (c->prev_fwd_order[i] == g) {
            c->fwd_pos = i + 1;
            return;
        }
}

static ts_status apply_policy(fsdp_group *g);

/* The end of the iteration root's forward: no all-gather stays in flight;
 * a grouped call some of whose modules did not run gets its post-forward
 * now; after a forward without grad (no backward will follow to reshard)
 * every group is resharded, so that an optimizer step before the next
 * forward cannot leave stale full parameters in use. */
static void root_post_forward(fsdp_ctx *c)
{
    bool no_grad = !ts_grad_mode_enabled();
    for (int i = 0; i < c->n_states; i++) {
        fsdp_group *g = c->states[i]->group;
        if (!g) continue;
        if (g->sharded_state == FSDP_UNSHARDING) (void)ts__fsdp_wait_unshard(g);
        if (g->training == FSDP_FORWARD) {
            ts_logf(TS_LOG_WARN, "fully_shard: %d of the %d modules of the group '%s' ran forward in this iteration",
                    g->ran_forward, g->n_states, g->fqn);
            g->ran_forward = 0;
            g->training = FSDP_IDLE;
            (void)apply_policy(g);
        }
        if (no_grad) (void)ts__fsdp_reshard(g);
    }
    c->iter_root = NULL;
}

/* A backward that failed never ran the end-of-backward callback: drop its
 * reductions in flight and its unsharded gradients (they must not reach
 * the next step's gradients), and reshard. */
static void recover_failed_backward(fsdp_ctx *c)
{
    ts_logf(TS_LOG_WARN, "fully_shard: the last backward did not finish; its partial gradient reductions are dropped");
    for (int i = 0; i < c->n_states; i++) {
        fsdp_group *g = c->states[i]->group;
        if (!g) continue;
        ts__fsdp_discard_reduce(g);
        ts__fsdp_drop_unreduced(g); /* with the gradients microbatches without sync kept */
        g->ran_forward = 0;
        g->training = FSDP_IDLE;
        (void)ts__fsdp_reshard(g);
    }
    ts__fsdp_persist_discard(c);
    c->rs_pending = NULL;
    c->n_post_fwd = 0;
    c->training = FSDP_IDLE;
}

/* Post-forward of a group: a grouped call's group reshards after the last
 * of its modules (each counted once per iteration). */
static ts_status post_forward_reshard(fsdp_state *s, fsdp_group *g)
{
    if (g->n_states > 1) {
        if (!s->ran) {
            s->ran = true;
            g->ran_forward++;
        }
        if (g->ran_forward < g->n_states) return TS_OK;
    }
    g->ran_forward = 0;
    g->training = FSDP_IDLE;
    return apply_policy(g);
}

static ts_status apply_policy(fsdp_group *g)
{
    switch (g->policy) {
    case TS_RESHARD_FALSE: return TS_OK;
    case TS_RESHARD_EVERY_N:
        if (++g->fwd_since_reshard < g->every_n) return TS_OK;
        return ts__fsdp_reshard(g);
    default: return ts__fsdp_reshard(g);
    }
}

static ts_status fsdp_call_hooks(fsdp_state *s, ts_module_fn fn, int n_in, ts_tensor *const *in, int *n_out,
                                 ts_tensor **out)
{
    ts_module *m = s->module;
    ts_status st = ts__fsdp_lazy_init(s);
    if (st) return st;
    fsdp_ctx *c = s->ctx;
    fsdp_group *g = sharded_group(s);
    if (ts_autograd_in_backward()) {
        /* activation checkpointing's recompute of a checkpointed module
         * that holds this one (ts_checkpoint_module): its forward ran
         * without grad, so none of this module's backward hooks exist;
         * they go on the recomputed graph, whose backward runs next, so
         * that the group is unsharded for it and its gradients are
         * reduce-scattered (and the group resharded) as soon as they are
         * complete, not at the end of the whole backward. No forward
         * bookkeeping (order, prefetch, reshard policy), as PyTorch's
         * pre-forward in PRE_BACKWARD. */
        if (g && ((st = ts__fsdp_unshard(g)) || (st = ts__fsdp_wait_unshard(g)))) return st;
        bool hooks = g && ts_grad_mode_enabled();
        ts_tensor *rin[TS_MODULE_MAX_IO];
        bool rw = hooks && n_in > 0 && n_in <= TS_MODULE_MAX_IO && any_requires_grad(n_in, in);
        if (rw && (st = wrap_marker(n_in, in, post_backward_fn, s, rin))) return st;
        st = fn(m, n_in, rw ? rin : in, n_out, out);
        if (rw)
            for (int i = 0; i < n_in; i++) ts_tensor_free(rin[i]);
        if (st || !hooks || *n_out <= 0 || !any_requires_grad(*n_out, out)) return st;
        ts_tensor *rout[TS_MODULE_MAX_IO];
        if ((st = wrap_marker(*n_out, out, pre_backward_fn, s, rout))) {
            for (int i = 0; i < *n_out; i++) ts_tensor_free(out[i]);
            *n_out = 0;
            return st;
        }
        for (int i = 0; i < *n_out; i++) {
            ts_tensor_free(out[i]);
            out[i] = rout[i];
        }
        return TS_OK;
    }
    bool iter_root = false;
    /* deferred init: a model still on the meta device cannot run, except
     * inside a meta scope (the meta step: param_group.c, [Note: meta step]) */
    if (!c->iter_root && !c->materialized && !ts__meta_mode()) {
        if ((st = ts__fsdp_check_materialized("forward", c->root->module))) return st;
        c->materialized = true;
    }
    if (!c->iter_root) {
        c->iter_root = s;
        iter_root = true;
        if (c->n_fwd_order) { /* this iteration's order becomes the last one's */
            fsdp_group **t = c->prev_fwd_order;
            c->prev_fwd_order = c->fwd_order;
            c->n_prev_fwd_order = c->n_fwd_order;
            c->fwd_order = t;
            c->n_fwd_order = 0;
            /* capacities travel with the arrays */
            int cap = c->cap_fwd_order;
            c->cap_fwd_order = c->cap_prev_fwd_order;
            c->cap_prev_fwd_order = cap;
        }
        c->fwd_pos = 0;
        if (c->training != FSDP_IDLE || (c->rs_pending && !c->hold_pending)) recover_failed_backward(c);
        c->final_queued = false;
        for (int i = 0; i < c->n_states; i++) c->states[i]->ran = false;
    }
    ts__fsdp_event("pre_forward", s->fqn);
    TS_TRACE_BEGIN(t_hook);
    ts_tensor *in2[TS_MODULE_MAX_IO];
    bool wrapped = false;
    if (g) {
        bool first = g->training != FSDP_FORWARD; /* the group's first module in this iteration */
        g->training = FSDP_FORWARD;
        if ((st = ts__fsdp_unshard(g)) || (st = ts__fsdp_wait_unshard(g))) goto fail;
        if (first) {
            if (!order_push(&c->fwd_order, &c->n_fwd_order, &c->cap_fwd_order, g)) {
                st = TS_ERR_NO_MEMORY;
                goto fail;
            }
            prefetch_advance(c, g);
            if (n_in > 0 && ts_grad_mode_enabled() && any_requires_grad(n_in, in)) {
                if ((st = wrap_marker(n_in, in, post_backward_fn, s, in2))) goto fail;
                wrapped = true;
            }
        }
    }
    if ((st = forward_prefetch(c, s))) goto fail;
    ts__fsdp_trace_hook(t_hook, "fsdp.pre_forward", s->fqn, g);
    st = fn(m, n_in, wrapped ? in2 : in, n_out, out);
    if (wrapped)
        for (int i = 0; i < n_in; i++) ts_tensor_free(in2[i]);
    wrapped = false;
    if (st) goto fail;
    ts__fsdp_event("post_forward", s->fqn);
    t_hook = ts_trace_enabled() ? ts_now_ns() : 0;
    if (g) {
        /* the post-forward order serves the backward prefetch: none without grad */
        if (ts_grad_mode_enabled() && !order_push(&c->post_fwd, &c->n_post_fwd, &c->cap_post_fwd, g)) {
            st = TS_ERR_NO_MEMORY;
            goto fail_out;
        }
        if ((st = post_forward_reshard(s, g))) goto fail_out;
    }
    if (*n_out > 0 && ts_grad_mode_enabled() && any_requires_grad(*n_out, out)) {
        ts_tensor *out2[TS_MODULE_MAX_IO];
        if ((st = wrap_marker(*n_out, out, pre_backward_fn, s, out2))) goto fail_out;
        for (int i = 0; i < *n_out; i++) {
            ts_tensor_free(out[i]);
            out[i] = out2[i];
        }
    }
    if (iter_root) root_post_forward(c);
    ts__fsdp_trace_hook(t_hook, "fsdp.post_forward", s->fqn, g);
    return TS_OK;
fail_out:
    for (int i = 0; i < *n_out; i++) ts_tensor_free(out[i]);
    *n_out = 0;
fail:
    if (wrapped)
        for (int i = 0; i < n_in; i++) ts_tensor_free(in2[i]);
    {
        /* leave the group as the policy would after a forward; quiet:
         * the forward's error keeps its detail (docs/design.md, D1) */
        ts__error_quiet_begin();
        if (g && g->training == FSDP_FORWARD) {
            g->ran_forward = 0;
            g->training = FSDP_IDLE;
            if (g->policy != TS_RESHARD_FALSE) (void)ts__fsdp_reshard(g);
        }
        if (iter_root) root_post_forward(c);
        ts__error_quiet_end();
    }
    return st;
}

/* t[i] (new references) = in[i] cast to d when floating and of another
 * dtype, else in[i] itself (PyTorch's _cast_fp_tensor). */
static ts_status cast_floating(ts_dtype d, int n, ts_tensor *const *in, ts_tensor **t)
{
    ts_status st = TS_OK;
    for (int i = 0; i < n; i++) {
        ts_dtype di = in[i] ? ts_tensor_dtype(in[i]) : TS_DTYPE_COUNT;
        if (!st && in[i] && ts_dtype_is_float(di) && di != d) st = ts_to_dtype(in[i], d, &t[i]);
        else t[i] = ts_tensor_retain(in[i]);
        if (st) t[i] = NULL;
    }
    if (st)
        for (int i = 0; i < n; i++) ts_tensor_free(t[i]);
    return st;
}

/* The module's forward with the FSDP hooks and the mixed-precision casts
 * around them, in FSDP2's order: the inputs are cast to param_dtype
 * before the pre-forward (so the post-backward marker sees the cast
 * inputs), the outputs to output_dtype after the post-forward. */
static ts_status fsdp_call(fsdp_state *s, ts_module_fn fn, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    const ts_mp_policy *mp = &s->mp;
    ts_tensor *cin[TS_MODULE_MAX_IO];
    bool cast_in = mp->cast_forward_inputs && mp->param_dtype != TS_DTYPE_KEEP && n_in > 0;
    ts_status st;
    if (cast_in) {
        if (n_in > TS_MODULE_MAX_IO)
            return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_module_call: %d inputs (at most %d)", n_in, TS_MODULE_MAX_IO);
        if ((st = cast_floating(mp->param_dtype, n_in, in, cin))) return st;
    }
    st = fsdp_call_hooks(s, fn, n_in, cast_in ? cin : in, n_out, out);
    if (cast_in)
        for (int i = 0; i < n_in; i++) ts_tensor_free(cin[i]);
    if (st || mp->output_dtype == TS_DTYPE_KEEP || *n_out <= 0) return st;
    ts_tensor *cout[TS_MODULE_MAX_IO];
    if ((st = cast_floating(mp->output_dtype, *n_out, out, cout))) {
        for (int i = 0; i < *n_out; i++) ts_tensor_free(out[i]);
        *n_out = 0;
        return st;
    }
    for (int i = 0; i < *n_out; i++) {
        ts_tensor_free(out[i]);
        out[i] = cout[i];
    }
    return TS_OK;
}

static ts_status fsdp_forward(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    fsdp_state *s = m->ext;
    if (!s->orig_vt->forward) /* a container such as ModuleList: call its children */
        return ts_error(TS_ERR_UNSUPPORTED, "ts_module_call: %s has no forward (call its children instead)",
                        ts_module_type_name(m));
    return fsdp_call(s, s->orig_vt->forward, n_in, in, n_out, out);
}

static void fsdp_free(ts_module *m)
{
    fsdp_state *s = m->ext;
    if (s->ctx && s->ctx->root == s) ts__fsdp_stats_at_free(m); /* TS_DISTRIBUTED_DEBUG: the root's groups */
    m->vtable = s->orig_vt;
    m->ext = NULL;
    s->module = NULL;
    if (s->group) { /* its slots die with it: nothing may write through them later */
        fsdp_group *g = s->group;
        for (int i = 0; i < g->n; i++)
            for (int k = 0; k < g->params[i].n_slots; k++)
                if (g->params[i].slot_owner[k] == s->index) g->params[i].slots[k] = NULL;
    }
    /* the prefetch lists may form cycles between states: drop them now */
    for (int i = 0; i < s->n_fwd_prefetch; i++) ts__fsdp_state_release(s->fwd_prefetch[i]);
    for (int i = 0; i < s->n_bwd_prefetch; i++) ts__fsdp_state_release(s->bwd_prefetch[i]);
    s->n_fwd_prefetch = s->n_bwd_prefetch = 0;
    ts__module_release(m);
    ts__fsdp_state_release(s);
}

/* ------------------------------------------------------------------ */
/* The groups of a subtree                                            */
/* ------------------------------------------------------------------ */

static ts_status groups_each(void *vc, const char *fqn, ts_module *m)
{
    (void)fqn;
    ts__fsdp_groups_walk *w = vc;
    fsdp_state *s = ts__fsdp_state_of(m);
    if (!s || !s->group) return TS_OK;
    for (int i = 0; i < w->n; i++)
        if (w->g[i] == s->group) return TS_OK;
    if (!ts__fsdp_grow((void **)&w->g, &w->cap, w->n + 1, sizeof *w->g)) return TS_ERR_NO_MEMORY;
    w->g[w->n++] = s->group;
    return TS_OK;
}

ts_status ts__fsdp_subtree_groups(ts_module *m, ts__fsdp_groups_walk *w)
{
    memset(w, 0, sizeof *w);
    ts_status st = ts_module_named_modules(m, groups_each, w);
    if (st) ts__free(TS_MEM_NN, w->g);
    return st;
}

bool ts__fsdp_groups_busy(fsdp_group *const *g, int n)
{
    for (int i = 0; i < n; i++)
        if (g[i]->training == FSDP_FORWARD || ts__fsdp_reduce_in_flight(g[i])) return true;
    return ts_autograd_in_backward();
}

ts_status ts__fsdp_idle_groups(const char *fn, ts_module *m, ts__fsdp_groups_walk *w)
{
    ts_status st = ts__fsdp_subtree_groups(m, w);
    if (st) return st;
    if (ts__fsdp_groups_busy(w->g, w->n)) {
        ts__free(TS_MEM_NN, w->g);
        w->g = NULL;
        return ts_error(TS_ERR_STATE, "%s: not inside a forward or backward", fn);
    }
    return TS_OK;
}

/* TS_DISTRIBUTED_DEBUG: the root's groups' figures when it is freed (repr.c writes them). */
void ts__fsdp_stats_at_free(ts_module *root)
{
    if (ts__dist_debug_level() < 1) return;
    ts__fsdp_groups_walk w;
    if (ts__fsdp_subtree_groups(root, &w)) return;
    uint64_t calls = 0;
    for (int i = 0; i < w.n; i++) calls += w.g[i]->ag_stats.calls + w.g[i]->rs_stats.calls + w.g[i]->ar_stats.calls;
    if (calls) (void)ts__fsdp_print_coll_stats(&w, stderr);
    ts__free(TS_MEM_NN, w.g);
}
