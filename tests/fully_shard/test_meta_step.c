/* fully_shard's runtime on the meta device ([Note: meta step] in
 * fully_shard/param_group.c): a training step of a sharded model whose
 * shards are meta, played inside ts_device_scope_enter(TS_DEVICE_META),
 * runs every hook (unshard, reshard, post-backward reduction, the shard
 * gradients, the optimizer step over the shards) with no collective and
 * no data, and its ledger (tensor/meta.c) gives exactly the storage peak
 * and the pool growth the same step measures on the CPU.
 *
 * The meta model is built inside the meta scope and sharded by
 * ts_fully_shard (deferred init: meta shards, no bytes); the real one is
 * built eagerly with the same options. */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#define MS_OK(expr) cr_assert_eq((expr), TS_OK, "%s: %s", #expr, ts_last_error())
#define MS_TRUE(cond) cr_assert((cond), "%s", #cond)
#include "tests/fully_shard/meta_step_common.h"

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
Test(fully_shard_meta_step, gpt_f32_prefetch)
{
    exact("gpt f32 prefetch", (step_opts){.copy_free = 0, .prefetch = true});
}
Test(fully_shard_meta_step, mlp_f32) { exact("mlp f32", (step_opts){.copy_free = 0, .mlp = true}); }
Test(fully_shard_meta_step, gpt_bf16) { exact("gpt bf16", (step_opts){.copy_free = 0, .bf16 = true}); }
Test(fully_shard_meta_step, gpt_no_reshard)
{
    exact("gpt no reshard", (step_opts){.copy_free = 0, .no_reshard = true});
}
Test(fully_shard_meta_step, gpt_ckpt) { exact("gpt ckpt", (step_opts){.copy_free = 0, .ckpt = true}); }
Test(fully_shard_meta_step, gpt_nosync) { exact("gpt nosync x2", (step_opts){.copy_free = 0, .microbatches = 2}); }
Test(fully_shard_meta_step, gpt_bf16_nosync)
{
    exact("gpt bf16 nosync x2", (step_opts){.copy_free = 0, .bf16 = true, .microbatches = 2});
}
Test(fully_shard_meta_step, gpt_offload_pinned)
{
    exact("gpt offload pinned", (step_opts){.copy_free = 0, .offload = 1});
}
Test(fully_shard_meta_step, gpt_offload_pageable)
{
    exact("gpt offload pageable", (step_opts){.copy_free = 0, .offload = 2});
}
Test(fully_shard_meta_step, gpt_copy_free) { exact("gpt copy-free", (step_opts){.copy_free = 1}); }
Test(fully_shard_meta_step, gpt_copy_free_bf16_nosync)
{
    exact("gpt copy-free bf16 nosync", (step_opts){.copy_free = 1, .bf16 = true, .microbatches = 2});
}
Test(fully_shard_meta_step, mlp_copy_free_nosync)
{
    exact("mlp copy-free nosync", (step_opts){.copy_free = 1, .mlp = true, .microbatches = 2});
}
Test(fully_shard_meta_step, gpt_persist)
{
    exact("gpt persistent small params", (step_opts){.copy_free = 0, .persist = 64});
}
Test(fully_shard_meta_step, gpt_persist_nosync)
{
    exact("gpt persistent nosync", (step_opts){.copy_free = 0, .persist = 64, .microbatches = 2});
}
Test(fully_shard_meta_step, gpt_bf16_reduce_bf16)
{
    exact("gpt bf16 reduce bf16", (step_opts){.copy_free = 0, .bf16_reduce = true});
}
Test(fully_shard_meta_step, gpt_explicit_prefetch)
{
    exact("gpt explicit prefetch", (step_opts){.copy_free = 0, .explicit_pf = true});
}
Test(fully_shard_meta_step, mlp_explicit_prefetch_copy_free)
{
    exact("mlp explicit prefetch copy-free", (step_opts){.copy_free = 1, .mlp = true, .explicit_pf = true});
}

/* A model that played a meta step is materialized and trains for real:
 * the unsharded parameters the meta step took as meta are released CPU
 * storages again, and a real step runs (its loss finite). */
Test(fully_shard_meta_step, materialize_after_meta_step)
{
    step_opts o = {.copy_free = 0, .microbatches = 2};
    MS_OK(ts_device_scope_enter(TS_DEVICE_META));
    ts_module *m = build(&o);
    ts_tensor *x, *tg;
    inputs(&o, &x, &tg);
    ts_optim *opt = adamw(m);
    step(&o, m, opt, x, tg);
    ts_tensor_free(x), ts_tensor_free(tg);
    ts_optim_free(opt);
    MS_OK(ts_device_scope_exit());
    MS_OK(ts_fsdp_materialize(m));
    inputs(&o, &x, &tg);
    opt = adamw(m);
    step(&o, m, opt, x, tg);
    ts_named_params np;
    MS_OK(ts_module_named_parameters(m, &np));
    for (int i = 0; i < np.n; i++) cr_expect(!ts__is_meta(*np.items[i].slot), "%s is meta", np.items[i].name);
    ts_named_params_free(&np);
    ts_tensor *logits;
    MS_OK(ts_module_call1(m, x, &logits));
    cr_expect(!ts__is_meta(logits));
    double v = 0;
    ts_tensor *flat = NULL;
    MS_OK(ts_reshape(logits, 1, (const int64_t[]){ts_tensor_numel(logits)}, &flat));
    MS_OK(ts_tensor_get(flat, (const int64_t[]){0}, &v));
    cr_expect(v == v, "the logits are NaN");
    ts_tensor_free(flat), ts_tensor_free(logits);
    ts_tensor_free(x), ts_tensor_free(tg);
    ts_optim_free(opt);
    ts_module_free(m);
}
