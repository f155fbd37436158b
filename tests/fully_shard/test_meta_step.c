/* fully_shard's runtime on the meta device ([Note: meta step] in
 * fully_shard/param_group.c): a training step of a sharded model whose
 * shards are meta, played inside ts_device_scope_enter(TS_DEVICE_META),
 * runs every hook (unshard, reshard, post-backward reduction, the shard
 * gradients, the optimizer step over the shards) with no collective and
 * no data, and its ledger (tensor/meta.c) gives exactly the storage peak
 * and the pool growth the same step measures on the CPU.
 *
 * Until ts_fully_shard shards a meta-built model, the test shards an eager
 * model and swaps every group's storages (the sharded buffer its shards
 * view, the unsharded parameters' released storages) for meta ones:
 * swap_to_meta below, through the internal headers. */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "fully_shard/internal.h"
#include "nn/nn.h"
#include "optim/optim.h"
#include "tensor/internal.h"

typedef struct step_opts {
    bool bf16;           /* param_dtype bf16, reduce_dtype f32 */
    bool no_reshard;     /* reshard_after_forward false on the blocks */
    int offload;         /* 0 none, 1 pinned, 2 pageable */
    bool ckpt;           /* ts_checkpoint_module on every block */
    int microbatches;    /* > 1: the first ones without gradient sync */
    int copy_free;       /* -1 environment, 0 packed, 1 copy-free */
    bool mlp;            /* a 2-layer MLP instead of the GPT */
    bool prefetch;       /* implicit prefetch, forward and backward */
    int64_t persist;     /* persist_threshold_numel (0: off) */
} step_opts;

typedef struct step_bytes {
    size_t peak, pool; /* the step's storage peak over its start, and the pool's growth */
} step_bytes;

/* ---------------------------------------------------------------- models */

enum { VOCAB = 32, SEQ = 16, BATCH = 2, D_IN = 24, D_HID = 40 };

static ts_module *build(const step_opts *o)
{
    ts_manual_seed(5);
    ts_fsdp_options fo = ts_fsdp_options_default();
    ts_mp_policy mp = ts_mp_policy_default();
    mp.param_dtype = TS_BF16, mp.reduce_dtype = TS_F32;
    if (o->bf16) fo.mp_policy = &mp;
    ts_offload_policy op = ts_offload_policy_default();
    op.pin_memory = o->offload == 1;
    if (o->offload) fo.offload_policy = &op;
    fo.persist_threshold_numel = o->persist;
    ts__fsdp_set_copy_free(o->copy_free);
    ts_module *m = NULL;
    const char *names[3];
    int nb = 0;
    if (o->mlp) {
        ts_module *l0, *l1, *act;
        cr_assert_eq(ts_linear_new(D_IN, D_HID, true, &l0), TS_OK);
        cr_assert_eq(ts_gelu_new(TS_GELU_NONE, &act), TS_OK);
        cr_assert_eq(ts_linear_new(D_HID, VOCAB, true, &l1), TS_OK);
        ts_module *mods[3] = {l0, act, l1};
        cr_assert_eq(ts_sequential_new(3, mods, &m), TS_OK, "%s", ts_last_error());
        names[0] = "0", names[1] = "2";
        nb = 2;
    } else {
        ts_gpt_config g = ts_gpt_config_default();
        g.vocab_size = VOCAB, g.block_size = SEQ, g.n_layer = 2, g.n_head = 2, g.d_model = 16;
        cr_assert_eq(ts_gpt_new(&g, &m), TS_OK);
        names[0] = "blocks.0", names[1] = "blocks.1";
        nb = 2;
    }
    fo.reshard_after_forward = o->no_reshard ? TS_RESHARD_FALSE : TS_RESHARD_AUTO;
    for (int i = 0; i < nb; i++) {
        ts_module *b;
        cr_assert_eq(ts_module_get_submodule(m, names[i], &b), TS_OK);
        if (o->ckpt) cr_assert_eq(ts_checkpoint_module(b), TS_OK, "%s", ts_last_error());
        cr_assert_eq(ts_fully_shard(b, &fo), TS_OK, "%s", ts_last_error());
    }
    fo.reshard_after_forward = TS_RESHARD_AUTO;
    cr_assert_eq(ts_fully_shard(m, &fo), TS_OK, "%s", ts_last_error());
    cr_assert_eq(ts_fsdp_set_implicit_prefetch(m, o->prefetch, o->prefetch), TS_OK);
    ts__fsdp_set_copy_free(-1);
    return m;
}

/* Points t (when it is over old) at ns. */
static void repoint(ts_tensor *t, ts_storage *old, ts_storage *ns)
{
    if (!t || t->storage != old) return;
    ts__storage_retain(ns);
    t->storage = ns;
    t->device = TS_DEVICE_META;
    ts__storage_release_ref(old);
}

/* A meta storage like s (its size, pinned or not), released when s is. */
static ts_storage *meta_like(const ts_storage *s)
{
    ts_storage *ns = NULL;
    cr_assert_eq(ts__storage_new_meta(s->nbytes, &ns), TS_OK);
    if (s->pinned) { /* counted as the pinned block it is */
        ts__meta_ledger_free(ns);
        ns->pinned = true;
        cr_assert_eq(ts__meta_ledger_alloc(ns, ns->nbytes), TS_OK);
    }
    if (s->released) cr_assert_eq(ts_storage_release(ns), TS_OK);
    return ns;
}

/* What fsdpmeta's ts_fully_shard on a meta model will give: every group's
 * sharded buffer (and the shards viewing it) and unsharded parameters
 * meta, on the calling thread's ledger. */
static void swap_to_meta(ts_module *m)
{
    groups_walk w = {0};
    cr_assert_eq(ts__fsdp_subtree_groups(m, &w), TS_OK);
    for (int k = 0; k < w.n; k++) {
        fsdp_group *g = w.g[k];
        for (int i = 0; i < g->n_persist; i++) { /* whole on every rank, outside the group's buffers */
            ts_tensor *t = g->persist[i].t;
            ts_storage *old = t->storage, *ns = meta_like(old);
            repoint(t, old, ns);
            ts__storage_release_ref(ns);
        }
        if (!g->n) continue;
        ts_storage *old = g->sharded->storage, *ns = meta_like(old);
        ts__storage_retain(old); /* kept until every view moved */
        repoint(g->sharded, old, ns);
        for (int i = 0; i < g->n; i++) {
            repoint(g->params[i].S, old, ns);
            repoint(ts_dtensor_local(g->params[i].dt), old, ns);
        }
        ts__storage_release_ref(old);
        ts__storage_release_ref(ns);
        for (int i = 0; i < g->n; i++) {
            ts_tensor *U = g->params[i].U;
            ts_storage *uo = U->storage, *un = meta_like(uo);
            repoint(U, uo, un);
            ts__storage_release_ref(un);
        }
    }
    ts__free(TS_MEM_NN, w.g);
}

/* ------------------------------------------------------------------ step */

static ts_optim *adamw(ts_module *m)
{
    ts_named_params np;
    cr_assert_eq(ts_module_named_parameters(m, &np), TS_OK);
    ts_tensor *ps[64];
    cr_assert(np.n <= 64);
    for (int i = 0; i < np.n; i++) ps[i] = *np.items[i].slot;
    ts_adam_options ao = ts_adamw_options_default();
    ts_optim *opt;
    cr_assert_eq(ts_adamw_new(np.n, ps, &ao, &opt), TS_OK, "%s", ts_last_error());
    ts_named_params_free(&np);
    return opt;
}

/* Inputs and targets (values only on the CPU). */
static void inputs(const step_opts *o, ts_tensor **x, ts_tensor **tg)
{
    int64_t n = BATCH * SEQ, is[2] = {BATCH, SEQ}, xs[2] = {n, D_IN};
    if (o->mlp) cr_assert_eq(ts_tensor_zeros(TS_F32, 2, xs, x), TS_OK);
    else cr_assert_eq(ts_tensor_zeros(TS_I64, 2, is, x), TS_OK);
    cr_assert_eq(ts_tensor_zeros(TS_I64, 1, &n, tg), TS_OK);
    if (!ts__is_meta(*x)) {
        int64_t *t = ts_tensor_data(*tg);
        for (int i = 0; i < n; i++) t[i] = (i * 11) % VOCAB;
        if (!o->mlp) {
            int64_t *a = ts_tensor_data(*x);
            for (int i = 0; i < n; i++) a[i] = (i * 7) % VOCAB;
        } else {
            float *a = ts_tensor_data(*x);
            for (int i = 0; i < n * D_IN; i++) a[i] = (float)((i * 13) % 17) / 17.0f - 0.5f;
        }
    }
}

/* One step: microbatches (the first without gradient sync), AdamW, zero_grad(set_to_none). */
static void step(const step_opts *o, ts_module *m, ts_optim *opt, ts_tensor *x, ts_tensor *tg)
{
    int mb = o->microbatches > 1 ? o->microbatches : 1;
    int64_t fs[2] = {BATCH * SEQ, VOCAB};
    for (int k = 0; k < mb; k++) {
        if (mb > 1) cr_assert_eq(ts_fsdp_set_requires_gradient_sync(m, k == mb - 1, true), TS_OK);
        ts_tensor *logits, *flat, *loss;
        cr_assert_eq(ts_module_call1(m, x, &logits), TS_OK, "%s", ts_last_error());
        if (ts_tensor_dtype(logits) != TS_F32) {
            ts_tensor *l32;
            cr_assert_eq(ts_to_dtype(logits, TS_F32, &l32), TS_OK);
            ts_tensor_free(logits);
            logits = l32;
        }
        cr_assert_eq(ts_reshape(logits, 2, fs, &flat), TS_OK, "%s", ts_last_error());
        cr_assert_eq(ts_cross_entropy(flat, tg, -100, TS_REDUCTION_MEAN, &loss), TS_OK, "%s", ts_last_error());
        ts_tensor_free(logits), ts_tensor_free(flat);
        cr_assert_eq(ts_backward(loss, NULL, false), TS_OK, "%s", ts_last_error());
        ts_tensor_free(loss);
    }
    cr_assert_eq(ts_optim_step(opt), TS_OK, "%s", ts_last_error());
    ts_optim_zero_grad(opt, true);
}

static step_bytes real_step(const step_opts *o)
{
    ts_module *m = build(o);
    ts_optim *opt = adamw(m);
    ts_tensor *x, *tg;
    inputs(o, &x, &tg);
    ts_pool_empty_cache();
    ts_mem_reset_peak();
    size_t live = ts_mem_live_bytes(TS_MEM_STORAGE), pool = ts_mem_live_bytes(TS_MEM_POOL);
    step(o, m, opt, x, tg);
    step_bytes r = {ts_mem_peak_bytes(TS_MEM_STORAGE) - live, ts_mem_peak_bytes(TS_MEM_POOL) - pool};
    ts_tensor_free(x), ts_tensor_free(tg);
    ts_optim_free(opt);
    ts_module_free(m);
    return r;
}

static step_bytes meta_step(const step_opts *o)
{
    ts_module *m = build(o);
    cr_assert_eq(ts_device_scope_enter(TS_DEVICE_META), TS_OK);
    swap_to_meta(m);
    ts_optim *opt = adamw(m);
    ts_tensor *x, *tg;
    inputs(o, &x, &tg);
    cr_assert(ts__is_meta(x));
    ts_meta_reset();
    ts_meta_stats before = ts_meta_get_stats();
    step(o, m, opt, x, tg);
    ts_meta_stats after = ts_meta_get_stats();
    /* the shard gradients and AdamW's state are meta: nothing real was made */
    ts_named_params np;
    cr_assert_eq(ts_module_named_parameters(m, &np), TS_OK);
    for (int i = 0; i < np.n; i++) cr_expect(ts__is_meta(*np.items[i].slot), "%s is not meta", np.items[i].name);
    ts_named_params_free(&np);
    ts_tensor_free(x), ts_tensor_free(tg);
    ts_optim_free(opt);
    ts_module_free(m);
    cr_assert_eq(ts_device_scope_exit(), TS_OK);
    return (step_bytes){after.peak - before.live, after.pool_peak - before.pool};
}

static void exact(const char *name, step_opts o)
{
    step_bytes r = real_step(&o), e = meta_step(&o);
    cr_log_info("%s: storage peak real %zu meta %zu; pool growth real %zu meta %zu", name, r.peak, e.peak, r.pool,
                e.pool);
    printf("meta_step %-28s peak real %8zu ledger %8zu | pool real %8zu ledger %8zu\n", name, r.peak, e.peak, r.pool,
           e.pool);
    cr_expect_eq(e.peak, r.peak, "%s: the ledger's peak %zu, the real step's %zu", name, e.peak, r.peak);
    cr_expect_eq(e.pool, r.pool, "%s: the ledger's pool growth %zu, the real step's %zu", name, e.pool, r.pool);
}

Test(fully_shard_meta_step, gpt_f32) { exact("gpt f32", (step_opts){.copy_free = 0}); }
Test(fully_shard_meta_step, gpt_f32_prefetch) { exact("gpt f32 prefetch", (step_opts){.copy_free = 0, .prefetch = true}); }
Test(fully_shard_meta_step, mlp_f32) { exact("mlp f32", (step_opts){.copy_free = 0, .mlp = true}); }
Test(fully_shard_meta_step, gpt_bf16) { exact("gpt bf16", (step_opts){.copy_free = 0, .bf16 = true}); }
Test(fully_shard_meta_step, gpt_no_reshard) { exact("gpt no reshard", (step_opts){.copy_free = 0, .no_reshard = true}); }
Test(fully_shard_meta_step, gpt_ckpt) { exact("gpt ckpt", (step_opts){.copy_free = 0, .ckpt = true}); }
Test(fully_shard_meta_step, gpt_nosync) { exact("gpt nosync x2", (step_opts){.copy_free = 0, .microbatches = 2}); }
Test(fully_shard_meta_step, gpt_bf16_nosync) { exact("gpt bf16 nosync x2", (step_opts){.copy_free = 0, .bf16 = true, .microbatches = 2}); }
Test(fully_shard_meta_step, gpt_offload_pinned) { exact("gpt offload pinned", (step_opts){.copy_free = 0, .offload = 1}); }
Test(fully_shard_meta_step, gpt_offload_pageable) { exact("gpt offload pageable", (step_opts){.copy_free = 0, .offload = 2}); }
Test(fully_shard_meta_step, gpt_copy_free) { exact("gpt copy-free", (step_opts){.copy_free = 1}); }
Test(fully_shard_meta_step, gpt_copy_free_bf16_nosync) { exact("gpt copy-free bf16 nosync", (step_opts){.copy_free = 1, .bf16 = true, .microbatches = 2}); }
Test(fully_shard_meta_step, mlp_copy_free_nosync) { exact("mlp copy-free nosync", (step_opts){.copy_free = 1, .mlp = true, .microbatches = 2}); }
Test(fully_shard_meta_step, gpt_persist) { exact("gpt persistent small params", (step_opts){.copy_free = 0, .persist = 64}); }
Test(fully_shard_meta_step, gpt_persist_nosync) { exact("gpt persistent nosync", (step_opts){.copy_free = 0, .persist = 64, .microbatches = 2}); }
