/* The models, the meta swap and the training step shared by
 * test_meta_step.c (one rank) and test_meta_step_dist.c (tsrun ranks).
 * The includer defines MS_OK(expr) (expr is TS_OK, else the test fails)
 * and MS_TRUE(cond). */
#ifndef TS_TEST_META_STEP_COMMON_H
#define TS_TEST_META_STEP_COMMON_H

#include "fully_shard/internal.h"
#include "nn/nn.h"
#include "optim/optim.h"
#include "tensor/internal.h"

#include <stdio.h>
#include <string.h>

typedef struct step_opts {
    bool bf16;        /* param_dtype bf16, reduce_dtype f32 */
    bool bf16_reduce; /* param_dtype and reduce_dtype bf16 (comm's reduce-scatter stages a cast) */
    bool no_reshard;  /* reshard_after_forward false on the blocks */
    int offload;      /* 0 none, 1 pinned, 2 pageable */
    bool ckpt;        /* ts_checkpoint_module on every block */
    int microbatches; /* > 1: the first ones without gradient sync */
    int copy_free;    /* -1 environment, 0 packed, 1 copy-free */
    bool mlp;         /* a 2-layer MLP instead of the GPT */
    bool prefetch;    /* implicit prefetch, forward and backward */
    int64_t persist;  /* persist_threshold_numel (0: off) */
    bool hsdp;        /* HSDP over the world: mesh (W, 1), replicate x shard */
    bool explicit_pf; /* explicit prefetch: block 0 forward-prefetches block 1, block 1 backward-prefetches block 0 */
} step_opts;

static ts_mesh *g_ms_mesh; /* the HSDP mesh of the model being built (freed after it) */

typedef struct step_bytes {
    size_t peak, pool; /* the step's storage peak over its start, and the pool's growth */
} step_bytes;

/* ---------------------------------------------------------------- models */

enum { VOCAB = 32, SEQ = 16, BATCH = 2, D_IN = 24, D_HID = 40 };

static inline ts_module *build(const step_opts *o)
{
    ts_manual_seed(5);
    ts_fsdp_options fo = ts_fsdp_options_default();
    ts_mp_policy mp = ts_mp_policy_default();
    mp.param_dtype = TS_BF16, mp.reduce_dtype = TS_F32;
    if (o->bf16_reduce) mp.reduce_dtype = TS_BF16;
    if (o->bf16 || o->bf16_reduce) fo.mp_policy = &mp;
    ts_offload_policy op = ts_offload_policy_default();
    op.pin_memory = o->offload == 1;
    if (o->offload) fo.offload_policy = &op;
    fo.persist_threshold_numel = o->persist;
    if (o->hsdp) {
        int64_t shape[2] = {ts_comm_size(ts_dist_world()), 1};
        const char *names[2] = {"replicate", "shard"};
        /* inside the meta scope: the mesh's groups exchange their own CPU tensors */
        MS_OK(ts_mesh_new(ts_dist_world(), "cpu", 2, shape, names, &g_ms_mesh));
        fo.mesh = g_ms_mesh;
    }
    ts__fsdp_set_copy_free(o->copy_free);
    ts_module *m = NULL;
    const char *names[3];
    int nb = 0;
    if (o->mlp) {
        ts_module *l0, *l1, *act;
        MS_OK(ts_linear_new(D_IN, D_HID, true, &l0));
        MS_OK(ts_gelu_new(TS_GELU_NONE, &act));
        MS_OK(ts_linear_new(D_HID, VOCAB, true, &l1));
        ts_module *mods[3] = {l0, act, l1};
        MS_OK(ts_sequential_new(3, mods, &m));
        names[0] = "0", names[1] = "2";
        nb = 2;
    } else {
        ts_gpt_config g = ts_gpt_config_default();
        g.vocab_size = VOCAB, g.block_size = SEQ, g.n_layer = 2, g.n_head = 2, g.d_model = 16;
        MS_OK(ts_gpt_new(&g, &m));
        names[0] = "blocks.0", names[1] = "blocks.1";
        nb = 2;
    }
    fo.reshard_after_forward = o->no_reshard ? TS_RESHARD_FALSE : TS_RESHARD_AUTO;
    for (int i = 0; i < nb; i++) {
        ts_module *b;
        MS_OK(ts_module_get_submodule(m, names[i], &b));
        if (o->ckpt) MS_OK(ts_checkpoint_module(b));
        MS_OK(ts_fully_shard(b, &fo));
    }
    fo.reshard_after_forward = TS_RESHARD_AUTO;
    MS_OK(ts_fully_shard(m, &fo));
    if (o->explicit_pf) {
        ts_module *b0, *b1;
        MS_OK(ts_module_get_submodule(m, names[0], &b0));
        MS_OK(ts_module_get_submodule(m, names[1], &b1));
        MS_OK(ts_fsdp_set_modules_to_forward_prefetch(b0, 1, &b1));
        MS_OK(ts_fsdp_set_modules_to_backward_prefetch(b1, 1, &b0));
    }
    MS_OK(ts_fsdp_set_implicit_prefetch(m, o->prefetch, o->prefetch));
    ts__fsdp_set_copy_free(-1);
    return m;
}

/* ------------------------------------------------------------------ step */

static inline ts_optim *adamw(ts_module *m)
{
    ts_named_params np;
    MS_OK(ts_module_named_parameters(m, &np));
    ts_tensor *ps[64];
    MS_TRUE(np.n <= 64);
    for (int i = 0; i < np.n; i++) ps[i] = *np.items[i].slot;
    ts_adam_options ao = ts_adamw_options_default();
    ts_optim *opt;
    MS_OK(ts_adamw_new(np.n, ps, &ao, &opt));
    ts_named_params_free(&np);
    return opt;
}

/* Inputs and targets (values only on the CPU). */
static inline void inputs(const step_opts *o, ts_tensor **x, ts_tensor **tg)
{
    int64_t n = BATCH * SEQ, is[2] = {BATCH, SEQ}, xs[2] = {n, D_IN};
    if (o->mlp) MS_OK(ts_tensor_zeros(TS_F32, 2, xs, x));
    else MS_OK(ts_tensor_zeros(TS_I64, 2, is, x));
    MS_OK(ts_tensor_zeros(TS_I64, 1, &n, tg));
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
static inline void step(const step_opts *o, ts_module *m, ts_optim *opt, ts_tensor *x, ts_tensor *tg)
{
    int mb = o->microbatches > 1 ? o->microbatches : 1;
    int64_t fs[2] = {BATCH * SEQ, VOCAB};
    for (int k = 0; k < mb; k++) {
        if (mb > 1) MS_OK(ts_fsdp_set_requires_gradient_sync(m, k == mb - 1, true));
        ts_tensor *logits, *flat, *loss;
        MS_OK(ts_module_call1(m, x, &logits));
        if (ts_tensor_dtype(logits) != TS_F32) {
            ts_tensor *l32;
            MS_OK(ts_to_dtype(logits, TS_F32, &l32));
            ts_tensor_free(logits);
            logits = l32;
        }
        MS_OK(ts_reshape(logits, 2, fs, &flat));
        MS_OK(ts_cross_entropy(flat, tg, -100, TS_REDUCTION_MEAN, &loss));
        ts_tensor_free(logits), ts_tensor_free(flat);
        MS_OK(ts_backward(loss, NULL, false));
        ts_tensor_free(loss);
    }
    MS_OK(ts_optim_step(opt));
    ts_optim_zero_grad(opt, true);
}

static inline step_bytes real_step(const step_opts *o)
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
    ts_mesh_free(g_ms_mesh);
    g_ms_mesh = NULL;
    return r;
}

static inline step_bytes meta_step(const step_opts *o)
{
    MS_OK(ts_device_scope_enter(TS_DEVICE_META)); /* built on meta, sharded by ts_fully_shard (no bytes) */
    ts_module *m = build(o);
    ts_optim *opt = adamw(m);
    ts_tensor *x, *tg;
    inputs(o, &x, &tg);
    MS_TRUE(ts__is_meta(x));
    ts_meta_reset();
    ts_meta_stats before = ts_meta_get_stats();
    step(o, m, opt, x, tg);
    ts_meta_stats after = ts_meta_get_stats();
    /* the shard gradients and AdamW's state are meta: nothing real was made */
    ts_named_params np;
    MS_OK(ts_module_named_parameters(m, &np));
    for (int i = 0; i < np.n; i++) MS_TRUE(ts__is_meta(*np.items[i].slot));
    ts_named_params_free(&np);
    ts_tensor_free(x), ts_tensor_free(tg);
    ts_optim_free(opt);
    ts_module_free(m);
    ts_mesh_free(g_ms_mesh);
    g_ms_mesh = NULL;
    MS_OK(ts_device_scope_exit());
    return (step_bytes){after.peak - before.live, after.pool_peak - before.pool};
}

#endif
