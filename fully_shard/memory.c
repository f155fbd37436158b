/* ts_fsdp_memory_estimate: one training step of the model itself, played
 * on the meta device (fully_shard.h, "memory"; docs/memory.md;
 * docs/fully_shard.md, "Memory").
 *
 * [Note: estimate by meta step]
 * There is no second model of the code here: the estimate calls the
 * model's own forward (its modules, user-defined types included, and
 * fully_shard's hooks: unshard, prefetch, reshard, reduce-scatter, HSDP's
 * all-reduce, the persistent bucket, offload, casts, checkpointing) inside
 * ts_device_scope_enter(TS_DEVICE_META), where every op and every hook
 * takes the pool blocks the real step takes, as meta storages on the
 * thread's ledger (tensor/meta.c; [Note: meta step] in param_group.c), and
 * computes nothing. Two steps are played (the second is measured: the
 * optimizer state and the prefetch order then exist, as in training),
 * with the ledger's peak reset between the phases. The model's own
 * storages (parameters, shards, buffers) are real on a CPU model and
 * meta on a deferred one: they are counted from the model, and the step
 * from the ledger's deltas. What the estimate changes while it plays is
 * put back: the parameters' gradients, fully_shard's per-group leftovers
 * (offload's host gradient buffer, the persistent parameters' last
 * gradients, the reshard-every-N counters, the prefetch order) and the
 * blocks' vtables when it checkpoints them. The optimizer is the
 * estimate's own, over meta stand-ins of the parameters, so that its
 * state is meta even for a CPU model.
 *
 * Floor 7 (internal.h, "Floors"): may call floors 1-6 and explicit.c
 * (ts_fsdp_set_implicit_prefetch). */
#define _GNU_SOURCE
#include "fully_shard/internal.h"

#include "comm/comm_internal.h"
#include "mesh/mesh.h"
#include "nn/nn.h"
#include "optim/optim.h"
#include "tensor/internal.h"

#include <stdlib.h>
#include <string.h>

#define FN "ts_fsdp_memory_estimate"

ts_fsdp_memory_options ts_fsdp_memory_options_default(void)
{
    ts_fsdp_memory_options o;
    memset(&o, 0, sizeof o);
    o.optim = TS_FSDP_OPTIM_ADAM;
    o.world_size = 1;
    o.prefetch = true;
    o.param_dtype = TS_DTYPE_KEEP;
    o.input_dtype = TS_DTYPE_KEEP;
    o.eager_init = true;
    return o;
}

void ts_fsdp_memory_set_floor(ts_fsdp_memory_report *r, size_t floor_bytes)
{
    if (!r) return;
    r->floor_bytes = floor_bytes;
    size_t pool = r->pool_peak_bytes > r->peak_bytes ? r->pool_peak_bytes : r->peak_bytes;
    r->rss_peak_bytes = floor_bytes + pool;
}

/* ------------------------------------------------------------ the model */

static size_t storage_bytes(const ts_storage *s) { return s && !ts_storage_is_released(s) ? s->block_bytes : 0; }

/* Distinct storages, summed once each. */
typedef struct seen_set {
    const ts_storage **s;
    int n, cap;
} seen_set;

static size_t seen_add(seen_set *set, const ts_tensor *t)
{
    const ts_storage *s = t ? ts_tensor_storage(t) : NULL;
    if (!s) return 0;
    for (int i = 0; i < set->n; i++)
        if (set->s[i] == s) return 0;
    if (!ts__fsdp_grow((void **)&set->s, &set->cap, set->n + 1, sizeof *set->s)) return 0;
    set->s[set->n++] = s;
    return storage_bytes(s);
}

/* A block: a module below the root with a group of its own, not inside
 * another block (the modules ts_fsdp_apply_by_type or a loop of
 * ts_fully_shard calls shard). */
typedef struct blk {
    ts_module *m;
    char fqn[TS__FSDP_FQN_MAX];
    const ts_module_vtable *vt, *orig_vt; /* as found, put back after a run that changed them */
} blk;

/* Per group, what a step leaves behind that the estimate puts back. */
typedef struct gsave {
    ts__fsdp_offload off;
    ts_tensor **mine, **reduced; /* n_persist each */
    int fwd_since_reshard;
    bool reduce_grads;
    uint64_t n_direct, n_rs_add, n_grad_adds, n_grad_views;
} gsave;

typedef struct est {
    ts_module *model;
    const ts_fsdp_memory_options *o;
    ts__fsdp_groups_walk gw;
    gsave *gs;
    fsdp_state *root;
    bool had_ctx;
    fsdp_group **ord[3]; /* the root context's orders, as found */
    int n_ord[3], fwd_pos;
    blk *blocks;
    int n_blocks, cap_blocks;
    ts_named_params np;
    ts_tensor **saved_grad; /* np.n */
    ts_param_list pl;       /* what the optimizer takes */
    ts_tensor **shadow;     /* pl.n meta stand-ins */
    ts_tensor *x, *tg;
    int64_t rows;
    size_t model_bytes, param_bytes, group_bytes, ag_bytes;
    size_t model_pinned; /* of model_bytes, pinned blocks (offload's shards): not the pool's */
    size_t *full_sizes;  /* eager start-up: the blocks the pool keeps cached after it ([Note: eager start-up]) */
    int n_full;
    int64_t n_params;
    bool any_ckpt, saved;
    /* the observer of a measured forward */
    bool observing, stepping;
    char open[TS__FSDP_FQN_MAX];
    int64_t at_open, blk_sum;
    int blk_n, in_flight;
} est;

/* Bytes the groups hold in their all-gather and unsharded buffers now. */
static int64_t held(const est *e)
{
    int64_t b = 0;
    for (int i = 0; i < e->gw.n; i++) {
        const fsdp_group *g = e->gw.g[i];
        if (g->ag_buf) b += (int64_t)storage_bytes(ts_tensor_storage(g->ag_buf));
        if (g->ag_in) b += (int64_t)storage_bytes(ts_tensor_storage(g->ag_in));
        for (int k = 0; k < 4; k++)
            if (g->ag_hold[k]) b += (int64_t)storage_bytes(ts_tensor_storage(g->ag_hold[k]));
        for (int k = 0; k < g->n; k++)
            if (g->params[k].U) b += (int64_t)storage_bytes(ts_tensor_storage(g->params[k].U));
    }
    return b;
}

static void observe(void *ctx, const char *what, const char *fqn)
{
    est *e = ctx;
    if (!e->stepping) return;
    int n = 0;
    fsdp_group *rg = e->root ? e->root->group : NULL;
    for (int i = 0; i < e->gw.n; i++) n += e->gw.g[i] != rg && e->gw.g[i]->sharded_state != FSDP_SHARDED;
    if (n > e->in_flight) e->in_flight = n;
    if (!e->observing || !fqn[0]) return;
    int64_t now = (int64_t)ts_meta_get_stats().live - held(e);
    if (!strcmp(what, "pre_forward") && !e->open[0]) {
        bool is_blk = false;
        for (int i = 0; i < e->n_blocks && !is_blk; i++) is_blk = !strcmp(e->blocks[i].fqn, fqn);
        if (!is_blk) return;
        snprintf(e->open, sizeof e->open, "%s", fqn);
        e->at_open = now;
    } else if (!strcmp(what, "post_forward") && !strcmp(e->open, fqn)) {
        e->blk_sum += now - e->at_open;
        e->blk_n++;
        e->open[0] = '\0';
    }
}

typedef struct blk_walk {
    est *e;
    ts_status st;
} blk_walk;

static ts_status find_block(void *ctx, const char *fqn, ts_module *m)
{
    est *e = ctx;
    fsdp_state *s = ts__fsdp_state_of(m);
    if (!fqn[0] || !s || !s->group || (e->root && s->group == e->root->group)) return TS_OK;
    for (int i = 0; i < e->n_blocks; i++) { /* inside a block already found */
        size_t l = strlen(e->blocks[i].fqn);
        if (!strncmp(fqn, e->blocks[i].fqn, l) && fqn[l] == '.') return TS_OK;
    }
    if (!ts__fsdp_grow((void **)&e->blocks, &e->cap_blocks, e->n_blocks + 1, sizeof *e->blocks))
        return TS_ERR_NO_MEMORY;
    blk *b = &e->blocks[e->n_blocks++];
    b->m = m;
    snprintf(b->fqn, sizeof b->fqn, "%s", fqn);
    b->vt = m->vtable;
    b->orig_vt = s->orig_vt;
    e->any_ckpt |= ts_module_is_checkpointed(m);
    return TS_OK;
}

/* ckpt: 0 the blocks as they are, 1 every block checkpointed, 2 none. */
static ts_status set_blocks(est *e, int ckpt)
{
    for (int i = 0; i < e->n_blocks; i++) {
        blk *b = &e->blocks[i];
        fsdp_state *s = ts__fsdp_state_of(b->m);
        b->m->vtable = b->vt, s->orig_vt = b->orig_vt;
        bool is = ts_module_is_checkpointed(b->m);
        if (ckpt == 1 && !is) {
            ts_status st = ts_checkpoint_module(b->m);
            if (st) return st;
        } else if (ckpt == 2 && is) { /* fully_shard's vtable over the original's (the checkpoint's base) */
            const ts_module_vtable *vt = NULL;
            ts_status st = ts__fsdp_vtable(b->orig_vt->base, &vt);
            if (st) return st;
            s->orig_vt = b->orig_vt->base;
            b->m->vtable = vt;
        }
    }
    return TS_OK;
}

/* ------------------------------------------------------------ save, restore */

static fsdp_group ***order_slot(fsdp_ctx *c, int k, int **n, int **cap)
{
    switch (k) {
    case 0: *n = &c->n_post_fwd, *cap = &c->cap_post_fwd; return &c->post_fwd;
    case 1: *n = &c->n_fwd_order, *cap = &c->cap_fwd_order; return &c->fwd_order;
    default: *n = &c->n_prev_fwd_order, *cap = &c->cap_prev_fwd_order; return &c->prev_fwd_order;
    }
}

static ts_status save_state(est *e)
{
    e->gs = ts__calloc(TS_MEM_OTHER, (size_t)(e->gw.n ? e->gw.n : 1), sizeof *e->gs);
    if (!e->gs) return TS_ERR_NO_MEMORY;
    for (int i = 0; i < e->gw.n; i++) {
        fsdp_group *g = e->gw.g[i];
        gsave *s = &e->gs[i];
        s->off = g->off;
        g->off.grad_host = g->off.stage = NULL;
        s->fwd_since_reshard = g->fwd_since_reshard;
        s->reduce_grads = g->reduce_grads;
        s->n_direct = g->n_direct, s->n_rs_add = g->n_rs_add, s->n_grad_adds = g->n_grad_adds;
        s->n_grad_views = g->n_grad_views;
        if (g->n_persist) {
            s->mine = ts__calloc(TS_MEM_OTHER, (size_t)g->n_persist, sizeof *s->mine);
            s->reduced = ts__calloc(TS_MEM_OTHER, (size_t)g->n_persist, sizeof *s->reduced);
            if (!s->mine || !s->reduced) return TS_ERR_NO_MEMORY;
            for (int k = 0; k < g->n_persist; k++) {
                s->mine[k] = g->persist[k].mine, s->reduced[k] = g->persist[k].reduced;
                g->persist[k].mine = g->persist[k].reduced = NULL;
            }
        }
    }
    fsdp_ctx *c = e->root ? e->root->ctx : NULL;
    e->had_ctx = c != NULL;
    if (c) {
        e->fwd_pos = c->fwd_pos;
        for (int k = 0; k < 3; k++) {
            int *n, *cap;
            fsdp_group **a = *order_slot(c, k, &n, &cap);
            e->n_ord[k] = *n;
            e->ord[k] = ts__calloc(TS_MEM_OTHER, (size_t)(*n ? *n : 1), sizeof(fsdp_group *));
            if (!e->ord[k]) return TS_ERR_NO_MEMORY;
            if (*n) memcpy(e->ord[k], a, (size_t)*n * sizeof(fsdp_group *));
        }
    }
    for (int i = 0; i < e->np.n; i++) { /* the gradients the parameters hold, put back at the end */
        ts_tensor *t = *e->np.items[i].slot;
        e->saved_grad[i] = ts_tensor_retain(ts_tensor_grad(t));
        if (e->saved_grad[i]) ts_tensor_zero_grad(t, true);
    }
    e->saved = true;
    return TS_OK;
}

static void restore_state(est *e)
{
    for (int i = 0; i < e->np.n && e->saved; i++) {
        ts_tensor *t = *e->np.items[i].slot;
        ts_tensor_zero_grad(t, true);
        if (e->saved_grad[i]) (void)ts_tensor_set_grad(t, e->saved_grad[i]);
        ts_tensor_free(e->saved_grad[i]);
        e->saved_grad[i] = NULL;
    }
    if (e->gs)
        for (int i = 0; i < e->gw.n; i++) {
            fsdp_group *g = e->gw.g[i];
            gsave *s = &e->gs[i];
            ts_tensor_free(g->off.grad_host), ts_tensor_free(g->off.stage);
            g->off = s->off;
            g->fwd_since_reshard = s->fwd_since_reshard;
            g->reduce_grads = s->reduce_grads;
            g->n_direct = s->n_direct, g->n_rs_add = s->n_rs_add, g->n_grad_adds = s->n_grad_adds;
            g->n_grad_views = s->n_grad_views;
            for (int k = 0; k < g->n_persist && s->mine; k++) {
                ts_tensor_free(g->persist[k].mine), ts_tensor_free(g->persist[k].reduced);
                g->persist[k].mine = s->mine[k], g->persist[k].reduced = s->reduced[k];
            }
            ts__free(TS_MEM_OTHER, s->mine), ts__free(TS_MEM_OTHER, s->reduced);
        }
    fsdp_ctx *c = e->root ? e->root->ctx : NULL;
    if (c && e->gs) {
        for (int k = 0; k < 3; k++) {
            int *n, *cap;
            fsdp_group ***a = order_slot(c, k, &n, &cap);
            int want = e->had_ctx ? e->n_ord[k] : 0;
            if (!ts__fsdp_grow((void **)a, cap, want, sizeof(fsdp_group *))) want = 0; /* then no order: as new */
            if (want) memcpy(*a, e->ord[k], (size_t)want * sizeof(fsdp_group *));
            *n = want;
        }
        c->fwd_pos = e->had_ctx ? e->fwd_pos : 0;
    }
    for (int k = 0; k < 3; k++) ts__free(TS_MEM_OTHER, e->ord[k]), e->ord[k] = NULL;
    ts__free(TS_MEM_OTHER, e->gs);
    e->gs = NULL;
}

/* ------------------------------------------------------------ the step */

typedef struct run_out {
    int64_t fwd, bwd, opt, act, grad, optim, pool;
    int64_t blk_sum;
    int blk_n, in_flight;
} run_out;

static ts_status make_optim(est *e, ts_optim **out)
{
    if (e->o->optim == TS_FSDP_OPTIM_NONE) {
        *out = NULL;
        return TS_OK;
    }
    if (e->o->optim == TS_FSDP_OPTIM_ADAM) {
        ts_adam_options ao = ts_adamw_options_default();
        return ts_adamw_new(e->pl.n, e->shadow, &ao, out);
    }
    ts_sgd_options so = ts_sgd_options_default();
    if (e->o->optim == TS_FSDP_OPTIM_SGD_MOMENTUM) so.momentum = 0.9;
    return ts_sgd_new(e->pl.n, e->shadow, &so, out);
}

/* What fully_shard's groups keep from one step to the next outside the
 * optimizer: offload's host gradient buffer and landing buffer, the
 * persistent parameters' last gradients. */
static int64_t leftovers(const est *e)
{
    seen_set set = {0};
    int64_t b = 0;
    for (int i = 0; i < e->gw.n; i++) {
        const fsdp_group *g = e->gw.g[i];
        b += (int64_t)seen_add(&set, g->off.grad_host) + (int64_t)seen_add(&set, g->off.stage);
        for (int k = 0; k < g->n_persist; k++)
            b += (int64_t)seen_add(&set, g->persist[k].mine) + (int64_t)seen_add(&set, g->persist[k].reduced);
    }
    ts__free(TS_MEM_NN, set.s);
    return b;
}

static int64_t live_now(void) { return (int64_t)ts_meta_get_stats().live; }
static int64_t peak_now(void) { return (int64_t)ts_meta_get_stats().peak; }

/* Gradient sync of every group on or off (ts_fsdp_set_requires_gradient_sync's flag). */
static void set_sync(est *e, bool sync)
{
    for (int i = 0; i < e->gw.n; i++) e->gw.g[i]->reduce_grads = sync;
}

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* One step (o->microbatches forward/backward passes, the first ones
 * without gradient sync, then the optimizer); measured (phases into r)
 * when r is not NULL. */
static ts_status one_step(est *e, ts_optim *opt, run_out *r, int64_t live0)
{
    int mb = e->o->microbatches > 1 ? e->o->microbatches : 1;
    ts_status st = TS_OK;
    ts_tensor *logits = NULL, *flat = NULL, *loss = NULL;
    if (r) ts_meta_reset_peak();
    for (int k = 0; k < mb && !st; k++) {
        if (mb > 1) set_sync(e, k == mb - 1);
        ts_tensor_free(logits), ts_tensor_free(flat), ts_tensor_free(loss); /* the previous microbatch's */
        logits = flat = loss = NULL;
        int64_t b0 = live_now(), h0 = held(e);
        e->observing = r != NULL && k == 0;
        st = ts_module_call1(e->model, e->x, &logits);
        e->observing = false;
        e->open[0] = '\0';
        if (!st && ts_tensor_dtype(logits) != TS_F32 && ts_dtype_size(ts_tensor_dtype(logits)) == 2) {
            ts_tensor *l32 = NULL; /* the loss in float32, as training loops do */
            st = ts_to_dtype(logits, TS_F32, &l32);
            ts_tensor_free(logits);
            logits = l32;
        }
        if (!st) {
            int64_t numel = ts_tensor_numel(logits);
            if (numel % e->rows || numel == 0)
                st = ts_error(TS_ERR_SHAPE,
                              FN ": the model's output has %lld elements, not a multiple of the input's "
                                 "%lld rows (the loss takes (rows, classes) logits)",
                              (long long)numel, (long long)e->rows);
            int64_t fs[2] = {e->rows, numel / (e->rows ? e->rows : 1)};
            if (!st) st = ts_reshape(logits, 2, fs, &flat);
        }
        if (!st) st = ts_cross_entropy(flat, e->tg, -100, TS_REDUCTION_MEAN, &loss);
        if (!st && r) {
            r->fwd = max64(r->fwd, peak_now() - live0);
            if (k == 0) r->act = live_now() - b0 - (held(e) - h0);
            ts_meta_reset_peak();
        }
        if (!st) st = ts_backward(loss, NULL, false);
        if (!st && r) {
            r->bwd = max64(r->bwd, peak_now() - live0);
            ts_meta_reset_peak();
        }
    }
    if (mb > 1) set_sync(e, true);
    if (!st && r) {
        seen_set set = {0};
        r->grad = 0;
        for (int i = 0; i < e->pl.n; i++) r->grad += (int64_t)seen_add(&set, ts_tensor_grad(e->pl.items[i]));
        ts__free(TS_MEM_NN, set.s);
    }
    for (int i = 0; i < e->pl.n && !st; i++) st = ts_tensor_set_grad(e->shadow[i], ts_tensor_grad(e->pl.items[i]));
    if (!st && opt) st = ts_optim_step(opt);
    if (opt) ts_optim_zero_grad(opt, true);
    for (int i = 0; i < e->pl.n; i++) ts_tensor_zero_grad(e->shadow[i], true);
    for (int i = 0; i < e->np.n; i++) ts_tensor_zero_grad(*e->np.items[i].slot, true);
    ts_tensor_free(logits), ts_tensor_free(flat), ts_tensor_free(loss);
    if (!st && r) r->opt = peak_now() - live0;
    return st;
}

/* Frees what a run's steps left in the groups (the next run starts as the
 * first did) and sets their reshard-every-N counters back. */
static void drop_leftovers(est *e)
{
    for (int i = 0; i < e->gw.n; i++) {
        fsdp_group *g = e->gw.g[i];
        ts_tensor_free(g->off.grad_host), ts_tensor_free(g->off.stage);
        g->off.grad_host = g->off.stage = NULL;
        for (int k = 0; k < g->n_persist; k++) {
            ts_tensor_free(g->persist[k].mine), ts_tensor_free(g->persist[k].reduced);
            g->persist[k].mine = g->persist[k].reduced = NULL;
        }
        if (e->gs) g->fwd_since_reshard = e->gs[i].fwd_since_reshard;
    }
}

static ts_status play(est *e, int ckpt, run_out *r)
{
    memset(r, 0, sizeof *r);
    drop_leftovers(e);
    ts_status st = set_blocks(e, ckpt);
    ts_optim *opt = NULL;
    if (!st) {
        ts_meta_reset();
        ts_meta_stats s0 = ts_meta_get_stats();
        if (e->n_full) ts__meta_cache_blocks(e->n_full, e->full_sizes);
        int64_t live0 = (int64_t)s0.live, lb = leftovers(e);
        st = make_optim(e, &opt);
        e->stepping = true;
        e->in_flight = 0;
        if (!st) st = one_step(e, opt, NULL, live0); /* the warm-up: optimizer state, prefetch order */
        if (!st) r->optim = live_now() - live0 - leftovers(e) + lb;
        e->blk_sum = 0, e->blk_n = 0, e->in_flight = 0;
        if (!st) st = one_step(e, opt, r, live0);
        e->stepping = false;
        r->blk_sum = e->blk_sum, r->blk_n = e->blk_n, r->in_flight = e->in_flight;
        r->pool = (int64_t)ts_meta_get_stats().pool_peak - (int64_t)s0.pool;
        ts_optim_free(opt);
    }
    drop_leftovers(e);
    ts_status rs = set_blocks(e, 0);
    return st ? st : rs;
}

/* ------------------------------------------------------------ setup */

static ts_status check_options(const ts_fsdp_memory_options *o)
{
    if ((unsigned)o->optim > TS_FSDP_OPTIM_ADAM)
        return ts_error(TS_ERR_INVALID_ARGUMENT, FN ": optim %d is not a ts_fsdp_optim_kind", (int)o->optim);
    if (o->input_ndim < 1 || o->input_ndim > TS_MAX_DIMS)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        FN ": input_ndim %d outside [1, %d] (give the input's shape: (B, T) "
                           "token ids for a GPT)",
                        o->input_ndim, TS_MAX_DIMS);
    for (int i = 0; i < o->input_ndim; i++)
        if (o->input_shape[i] < 1)
            return ts_error(TS_ERR_INVALID_ARGUMENT, FN ": input_shape[%d] is %lld (every size >= 1)", i,
                            (long long)o->input_shape[i]);
    if (o->input_dtype != TS_DTYPE_KEEP && (unsigned)o->input_dtype >= TS_DTYPE_COUNT)
        return ts_error(TS_ERR_INVALID_ARGUMENT, FN ": input_dtype %d is not a dtype", (int)o->input_dtype);
    if (o->world_size < 1 ||
        (o->param_dtype != TS_DTYPE_KEEP && o->param_dtype != TS_F32 && o->param_dtype != TS_BF16 &&
         o->param_dtype != TS_F16))
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        FN ": world_size %d must be >= 1 and param_dtype f32, bf16, f16 or "
                           "TS_DTYPE_KEEP (got %d)",
                        o->world_size, (int)o->param_dtype);
    return TS_OK;
}

typedef struct first_emb {
    bool ids;
} first_emb;

/* The rule for the input's dtype (fully_shard.h, input_dtype): token ids
 * when the root, or one of its direct children, is an Embedding. */
static ts_status find_emb(void *ctx, const char *fqn, ts_module *m)
{
    first_emb *f = ctx;
    if (strchr(fqn, '.')) return TS_OK;
    if (!strcmp(ts__fsdp_own_type(m), "Embedding")) f->ids = true;
    return TS_OK;
}

/* [Note: eager start-up]
 * With eager_init each rank built the whole model, then ts_fully_shard
 * sharded it group by group (the blocks first, the root last, as the
 * calls go): the group's sharded buffer made while every full parameter
 * still lives, each parameter's unsharded tensor made and released in
 * turn (fully_shard/param.c), then the group's full parameters freed.
 * The pool keeps every block it handed out, per size class: what it holds
 * afterwards is, for each class, the most blocks of it live at once. Of
 * those, the sharded buffers are the model's own; the rest are cached
 * blocks that the step's allocations of their classes reuse. This plays
 * those counts and writes the cached blocks into e->full_sizes. */
typedef struct cls_ct {
    size_t bytes;
    int64_t live, peak;
} cls_ct;

static void cls_add(cls_ct *c, int *n, size_t nbytes, int64_t d)
{
    size_t cb = ts__pool_block_bytes(nbytes);
    int i = 0;
    while (i < *n && c[i].bytes != cb) i++;
    if (i == *n) c[(*n)++] = (cls_ct){cb, 0, 0};
    c[i].live += d;
    if (c[i].live > c[i].peak) c[i].peak = c[i].live;
}

static ts_status eager_start_up(est *e)
{
    int cap = 1, n = 0, nf = 0;
    for (int i = 0; i < e->gw.n; i++) cap += 2 * e->gw.g[i]->n + 1;
    cls_ct *c = ts__calloc(TS_MEM_OTHER, (size_t)cap, sizeof *c);
    if (!c) return TS_ERR_NO_MEMORY;
    fsdp_group *rg = e->root ? e->root->group : NULL;
    for (int i = 0; i < e->gw.n; i++)
        for (int k = 0; k < e->gw.g[i]->n; k++) cls_add(c, &n, (size_t)e->gw.g[i]->params[k].numel * e->gw.g[i]->es, 1);
    for (int j = 0; j <= e->gw.n; j++) { /* the blocks in order, the root's group last */
        fsdp_group *g = j < e->gw.n ? e->gw.g[j] : rg;
        if (!g || (j < e->gw.n && g == rg)) continue;
        if (!ts_storage_is_pinned(ts_tensor_storage(g->sharded))) cls_add(c, &n, (size_t)g->shard_numel * g->es, 1);
        for (int k = 0; k < g->n; k++) {
            cls_add(c, &n, (size_t)g->params[k].numel * g->ues, 1);
            cls_add(c, &n, (size_t)g->params[k].numel * g->ues, -1);
        }
        for (int k = 0; k < g->n; k++) cls_add(c, &n, (size_t)g->params[k].numel * g->es, -1);
    }
    int64_t total = 0;
    for (int i = 0; i < n; i++) total += c[i].peak - c[i].live;
    ts__free(TS_MEM_OTHER, e->full_sizes);
    e->full_sizes = ts__calloc(TS_MEM_OTHER, (size_t)(total ? total : 1), sizeof *e->full_sizes);
    if (!e->full_sizes) {
        ts__free(TS_MEM_OTHER, c);
        return TS_ERR_NO_MEMORY;
    }
    for (int i = 0; i < n; i++)
        for (int64_t k = c[i].live; k < c[i].peak; k++) e->full_sizes[nf++] = c[i].bytes;
    e->n_full = nf;
    ts__free(TS_MEM_OTHER, c);
    return TS_OK;
}

static ts_status setup(est *e)
{
    ts_module *m = e->model;
    const ts_fsdp_memory_options *o = e->o;
    ts_status st = ts__fsdp_idle_groups(FN, m, &e->gw);
    if (st) return st;
    e->root = ts__fsdp_state_of(m);
    for (int i = 0; i < e->gw.n; i++) {
        const fsdp_group *g = e->gw.g[i];
        size_t u = 0, ag = ts__pool_block_bytes((size_t)(g->shard_numel * g->W) * g->ues);
        for (int k = 0; k < g->n; k++) u += ts__pool_block_bytes((size_t)g->params[k].numel * g->ues);
        if (u > e->group_bytes) e->group_bytes = u;
        if (g->n && ag > e->ag_bytes) e->ag_bytes = ag;
    }
    for (int i = 0; i < e->gw.n; i++) {
        fsdp_group *g = e->gw.g[i];
        if (g->sharded_state != FSDP_SHARDED || ts__fsdp_reduce_in_flight(g) || g->partial)
            return ts_error(TS_ERR_STATE,
                            FN ": group '%s' is %s: estimate between steps (after the optimizer "
                               "step, with every group resharded and no gradient accumulation under way)",
                            g->fqn, g->sharded_state != FSDP_SHARDED ? "unsharded" : "in the middle of a reduction");
        for (int k = 0; k < g->n; k++)
            if (g->params[k].acc || (g->params[k].U && ts_tensor_grad(g->params[k].U)))
                return ts_error(TS_ERR_STATE,
                                FN ": group '%s' holds the unsharded gradient of '%s' (microbatches "
                                   "without gradient sync under way): estimate between steps",
                                g->fqn, g->params[k].fqn);
    }
    if (e->root && e->root->ctx && e->root->ctx->rs_pending)
        return ts_error(TS_ERR_STATE, FN ": a reduction is in flight: estimate between steps");
    if (!e->gw.n && (o->world_size > 1 || o->param_dtype != TS_DTYPE_KEEP))
        return ts_error(TS_ERR_UNSUPPORTED,
                        FN ": the model (%s) is not sharded, and world_size %d / param_dtype %s "
                           "describe a sharding: estimate it sharded (ts_fully_shard first, or "
                           "ts_fsdp_memory_estimate_build for W ranks from one process; "
                           "ts_fsdp_memory_estimate_gpt for the GPT)",
                        ts__fsdp_own_type(m), o->world_size,
                        o->param_dtype == TS_DTYPE_KEEP ? "keep" : ts_dtype_name(o->param_dtype));
    if ((st = ts_module_named_modules(m, find_block, e))) return st;
    if ((st = ts_module_named_parameters(m, &e->np)) || (st = ts_module_parameters(m, &e->pl))) return st;
    e->saved_grad = ts__calloc(TS_MEM_OTHER, (size_t)(e->np.n ? e->np.n : 1), sizeof *e->saved_grad);
    e->shadow = ts__calloc(TS_MEM_OTHER, (size_t)(e->pl.n ? e->pl.n : 1), sizeof *e->shadow);
    e->full_sizes = ts__calloc(TS_MEM_OTHER, (size_t)(e->np.n ? e->np.n : 1), sizeof *e->full_sizes);
    if (!e->saved_grad || !e->shadow || !e->full_sizes) return TS_ERR_NO_MEMORY;
    /* the model's storages: parameters (the groups' sharded buffers, whole ones outside groups) and buffers */
    seen_set set = {0};
    ts_dtype pdt = TS_F32;
    for (int i = 0; i < e->np.n; i++) {
        ts_tensor *t = *e->np.items[i].slot;
        if (i == 0) pdt = ts_tensor_dtype(t);
        size_t b = seen_add(&set, t);
        e->param_bytes += b;
        if (ts_storage_is_pinned(ts_tensor_storage(t))) e->model_pinned += b;
        fsdp_param *fp = ts__fsdp_find_param(&e->gw, t, NULL);
        int64_t full = fp ? fp->numel : ts_tensor_numel(t);
        e->n_params += full;
    }
    e->model_bytes = e->param_bytes;
    ts_named_params bufs = {0};
    if ((st = ts_module_named_buffers(m, &bufs))) {
        ts__free(TS_MEM_NN, set.s);
        return st;
    }
    for (int i = 0; i < bufs.n; i++) e->model_bytes += seen_add(&set, *bufs.items[i].slot);
    ts_named_params_free(&bufs);
    ts__free(TS_MEM_NN, set.s);
    if (e->o->eager_init && e->gw.n && (st = eager_start_up(e))) return st;
    if ((st = save_state(e))) return st;
    /* inside the meta scope from here: the input, the targets, the optimizer's stand-ins */
    first_emb fe = {false};
    (void)ts_module_named_modules(m, find_emb, &fe);
    ts_dtype xd = o->input_dtype != TS_DTYPE_KEEP ? o->input_dtype : fe.ids ? TS_I64 : pdt;
    if ((st = ts_tensor_zeros(xd, o->input_ndim, o->input_shape, &e->x))) return st;
    int64_t numel = ts_tensor_numel(e->x);
    e->rows = xd == TS_I64 || xd == TS_I32 ? numel : numel / o->input_shape[o->input_ndim - 1];
    if ((st = ts_tensor_zeros(TS_I64, 1, &e->rows, &e->tg))) return st;
    for (int i = 0; i < e->pl.n && !st; i++) {
        ts_tensor *p = e->pl.items[i];
        ts_tensor *local = NULL;
        if ((st = ts_tensor_local_view(p, &local))) break;
        st = ts_tensor_zeros(ts_tensor_dtype(local), ts_tensor_ndim(local), ts_tensor_shape(local), &e->shadow[i]);
        ts_tensor_free(local);
        if (!st) st = ts_tensor_set_requires_grad(e->shadow[i], true);
    }
    return st;
}

static void teardown(est *e)
{
    restore_state(e);
    for (int i = 0; e->shadow && i < e->pl.n; i++) ts_tensor_free(e->shadow[i]);
    ts__free(TS_MEM_OTHER, e->shadow), ts__free(TS_MEM_OTHER, e->saved_grad), ts__free(TS_MEM_OTHER, e->full_sizes);
    ts__free(TS_MEM_NN, e->blocks);
    ts__free(TS_MEM_NN, e->gw.g);
    ts_tensor_free(e->x), ts_tensor_free(e->tg);
    ts_named_params_free(&e->np);
    ts_param_list_free(&e->pl);
}

static size_t nonneg(int64_t v) { return v > 0 ? (size_t)v : 0; }

ts_status ts_fsdp_memory_estimate(ts_module *model, const ts_fsdp_memory_options *o, ts_fsdp_memory_report *out)
{
    if (!model || !o || !out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, FN ": model %p, options %p and out %p must not be NULL", (void *)model,
                        (const void *)o, (void *)out);
    ts_status st = check_options(o);
    if (st) return st;
    ts_gpt_config cfg;
    if (!ts_module_is_fsdp(model) && ts_gpt_get_config(model, &cfg)) /* a GPT not sharded yet: as it will be */
        return ts_fsdp_memory_estimate_gpt(&cfg, o, out);
    est E;
    memset(&E, 0, sizeof E);
    est *e = &E;
    e->model = model, e->o = o;
    /* The step runs on a generator of its own: the checkpointed play saves
     * and restores the thread's default generator around each recompute,
     * and the caller's (often the process-wide one, which other threads
     * may be drawing from) must be neither read nor written. */
    ts_generator *own = NULL;
    if ((st = ts_generator_new(0, &own))) return st;
    ts_generator *callers = ts_generator_set_thread_default(own);
    if ((st = ts_device_scope_enter(TS_DEVICE_META))) {
        ts_generator_set_thread_default(callers);
        ts_generator_free(own);
        return st;
    }
    ts__fsdp_set_observer(observe, e);
    st = setup(e);
    run_out as = {0}, ck = {0}, no = {0};
    bool blocks = e->n_blocks > 0;
    if (!st) st = play(e, 0, &as);
    if (!st && blocks) st = play(e, 1, &ck);
    if (!st && blocks && e->any_ckpt) st = play(e, 2, &no);
    else no = as;
    if (!blocks) ck = as;
    /* the peaks: the sharded model's storages, then the step's */
    ts__fsdp_set_observer(NULL, NULL);
    teardown(e);
    (void)ts_device_scope_exit();
    ts_generator_set_thread_default(callers);
    ts_generator_free(own);
    if (st) return st;
    const run_out *pk = o->checkpoint_blocks ? &ck : &as;
    int64_t base = (int64_t)e->model_bytes;
    ts_fsdp_memory_report r;
    memset(&r, 0, sizeof r);
    r.param_bytes = e->param_bytes;
    r.grad_bytes = nonneg(pk->grad);
    r.optim_bytes = nonneg(pk->optim);
    r.group_bytes = e->group_bytes;
    r.all_gather_bytes = e->ag_bytes;
    r.forward_peak_bytes = nonneg(base + pk->fwd);
    r.backward_peak_bytes = nonneg(base + pk->bwd);
    int64_t p = pk->fwd > pk->bwd ? pk->fwd : pk->bwd;
    if (pk->opt > p) p = pk->opt;
    r.peak_bytes = nonneg(base + p);
    r.pool_peak_bytes = nonneg(base - (int64_t)e->model_pinned + pk->pool); /* pinned blocks are not the pool's */
    if (r.pool_peak_bytes < r.peak_bytes) r.pool_peak_bytes = r.peak_bytes;
    r.checkpointed = o->checkpoint_blocks || e->any_ckpt;
    r.n_blocks = e->n_blocks;
    r.groups_in_flight = pk->in_flight;
    r.act_bytes = nonneg(no.act);
    r.act_ckpt_bytes = nonneg(ck.act);
    r.block_act_bytes = no.blk_n ? nonneg(no.blk_sum / no.blk_n) : 0;
    r.block_act_ckpt_bytes = ck.blk_n ? nonneg(ck.blk_sum / ck.blk_n) : 0;
    r.n_params = e->n_params;
    ts_fsdp_memory_set_floor(&r, ts_process_floor_bytes());
    *out = r;
    return TS_OK;
}

/* ------------------------------------------------------------ hypothetical sharding */

ts_status ts_fsdp_memory_estimate_build(ts_fsdp_build_fn build, void *ctx, const ts_fsdp_memory_options *o,
                                        ts_fsdp_memory_report *out)
{
    if (!build || !o || !out)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "ts_fsdp_memory_estimate_build: build %p, options %p and out %p must "
                        "not be NULL",
                        (void *)(uintptr_t)build, (const void *)o, (void *)out);
    ts_status st = check_options(o);
    if (st) return st;
    if (o->world_size > 128)
        return ts_error(TS_ERR_UNSUPPORTED,
                        "ts_fsdp_memory_estimate_build: world_size %d: a virtual world holds at "
                        "most 128 ranks (comm's tag layout)",
                        o->world_size);
    ts_comm *world = NULL;
    ts_mesh *mesh = NULL;
    ts_module *model = NULL;
    if ((st = ts__virtual_world_new(o->world_size, &world))) return st;
    int64_t shape[1] = {o->world_size};
    const char *names[1] = {"dp"};
    st = ts_mesh_new(world, "cpu", 1, shape, names, &mesh);
    ts__fsdp_set_virtual_world(world);
    bool scoped = false;
    if (!st && !(st = ts_device_scope_enter(TS_DEVICE_META))) scoped = true;
    if (!st) {
        st = build(ctx, mesh, &model);
        if (!st && !model)
            st = ts_error(TS_ERR_INVALID_ARGUMENT,
                          "ts_fsdp_memory_estimate_build: the build function returned TS_OK "
                          "and no model");
    }
    if (scoped) (void)ts_device_scope_exit();
    ts_fsdp_memory_options eo = *o;
    eo.world_size = 1, eo.param_dtype = TS_DTYPE_KEEP; /* the model says them now */
    if (!st) st = ts_fsdp_memory_estimate(model, &eo, out);
    ts__fsdp_set_virtual_world(NULL);
    ts_module_free(model);
    ts_mesh_free(mesh);
    ts__world_free(world);
    return st;
}

typedef struct gpt_build {
    const ts_gpt_config *cfg;
    const ts_fsdp_memory_options *o;
} gpt_build;

/* The GPT of cfg, each block its own group and the root the rest. */
static ts_status build_gpt(void *ctx, ts_mesh *mesh, ts_module **out)
{
    gpt_build *b = ctx;
    ts_module *m = NULL;
    ts_status st = ts_gpt_new(b->cfg, &m);
    if (st) return st;
    ts_fsdp_options fo = ts_fsdp_options_default();
    fo.mesh = mesh;
    ts_mp_policy mp = ts_mp_policy_default();
    mp.param_dtype = b->o->param_dtype;
    if (b->o->param_dtype != TS_DTYPE_KEEP) fo.mp_policy = &mp;
    for (int64_t l = 0; l < b->cfg->n_layer && !st; l++) {
        char name[32];
        ts_module *bm = NULL;
        snprintf(name, sizeof name, "blocks.%lld", (long long)l);
        if (!(st = ts_module_get_submodule(m, name, &bm))) st = ts_fully_shard(bm, &fo);
    }
    if (!st) st = ts_fully_shard(m, &fo);
    if (!st) st = ts_fsdp_set_implicit_prefetch(m, b->o->prefetch, b->o->prefetch);
    if (st) {
        ts_module_free(m);
        return st;
    }
    *out = m;
    return TS_OK;
}

ts_status ts_fsdp_memory_estimate_gpt(const ts_gpt_config *cfg, const ts_fsdp_memory_options *o,
                                      ts_fsdp_memory_report *out)
{
    if (!cfg || !o || !out)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "ts_fsdp_memory_estimate_gpt: config %p, options %p and out %p must not be "
                        "NULL",
                        (const void *)cfg, (const void *)o, (void *)out);
    if (cfg->vocab_size <= 0 || cfg->block_size <= 0 || cfg->n_layer < 0 || cfg->n_layer > 4096 || cfg->n_head <= 0 ||
        cfg->d_model <= 0 || cfg->d_model % cfg->n_head || !(cfg->dropout >= 0 && cfg->dropout < 1))
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "ts_fsdp_memory_estimate_gpt: invalid config (vocab %lld, block %lld, "
                        "layers %lld, heads %lld, d_model %lld, dropout %g)",
                        (long long)cfg->vocab_size, (long long)cfg->block_size, (long long)cfg->n_layer,
                        (long long)cfg->n_head, (long long)cfg->d_model, cfg->dropout);
    ts_status st = check_options(o);
    if (st) return st;
    if (o->input_ndim != 2)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "ts_fsdp_memory_estimate_gpt: a GPT's input is (B, T) token ids; got %d "
                        "dims",
                        o->input_ndim);
    if (o->input_shape[1] > cfg->block_size)
        return ts_error(TS_ERR_SHAPE,
                        "ts_fsdp_memory_estimate_gpt: sequence length %lld is longer than the GPT's "
                        "block_size %lld",
                        (long long)o->input_shape[1], (long long)cfg->block_size);
    gpt_build b = {cfg, o};
    return ts_fsdp_memory_estimate_build(build_gpt, &b, o, out);
}
