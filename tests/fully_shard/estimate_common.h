/* Shared by the memory-estimate tests (test_memory_estimate.c,
 * test_memory_estimate_dist.c, test_memory_process.c): the training step
 * ts_fsdp_memory_estimate plays (fully_shard.h, "memory"), run for real,
 * and a user-defined module type. The includer defines EC_OK(expr) (expr
 * is TS_OK, else the test or rank fails). */
#ifndef TS_TEST_ESTIMATE_COMMON_H
#define TS_TEST_ESTIMATE_COMMON_H

#include "fully_shard/fully_shard.h"
#include "optim/optim.h"
#include "tensor/internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------ the step */

/* AdamW over the model's parameters (ts_module_parameters). */
static inline ts_optim *ec_adamw(ts_module *m)
{
    ts_param_list pl;
    EC_OK(ts_module_parameters(m, &pl));
    ts_adam_options ao = ts_adamw_options_default();
    ts_optim *opt = NULL;
    EC_OK(ts_adamw_new(pl.n, pl.items, &ao, &opt));
    ts_param_list_free(&pl);
    return opt;
}

/* One training step as the estimate plays it: microbatches passes (the
 * first ones without gradient sync) of forward, logits cast to float32
 * when 16-bit, reshaped to (rows, classes), cross-entropy, backward; the
 * optimizer's step; zero_grad(set_to_none); the last pass's tensors freed
 * after it. Returns the last pass's loss (NaN on the meta device). */
static inline double ec_step(ts_module *m, ts_optim *opt, ts_tensor *x, ts_tensor *tg, int microbatches)
{
    int mb = microbatches > 1 ? microbatches : 1;
    int64_t rows = ts_tensor_numel(tg);
    ts_tensor *logits = NULL, *flat = NULL, *loss = NULL;
    for (int k = 0; k < mb; k++) {
        if (mb > 1) EC_OK(ts_fsdp_set_requires_gradient_sync(m, k == mb - 1, true));
        ts_tensor_free(logits), ts_tensor_free(flat), ts_tensor_free(loss);
        EC_OK(ts_module_call1(m, x, &logits));
        if (ts_tensor_dtype(logits) != TS_F32) {
            ts_tensor *l32;
            EC_OK(ts_to_dtype(logits, TS_F32, &l32));
            ts_tensor_free(logits);
            logits = l32;
        }
        int64_t fs[2] = {rows, ts_tensor_numel(logits) / rows};
        EC_OK(ts_reshape(logits, 2, fs, &flat));
        EC_OK(ts_cross_entropy(flat, tg, -100, TS_REDUCTION_MEAN, &loss));
        EC_OK(ts_backward(loss, NULL, false));
    }
    double v = 0.0 / 0.0;
    if (!ts__is_meta(loss)) EC_OK(ts_tensor_item(loss, &v));
    EC_OK(ts_optim_step(opt));
    ts_optim_zero_grad(opt, true);
    ts_tensor_free(logits), ts_tensor_free(flat), ts_tensor_free(loss);
    return v;
}

/* Inputs (rows of `in` floats, or (B, T) ids when ids) and targets in
 * [0, classes): deterministic values on the CPU. */
static inline void ec_inputs(bool ids, int64_t b, int64_t t_or_in, int64_t classes, int salt, ts_tensor **x,
                             ts_tensor **tg)
{
    int64_t xs[2] = {b, t_or_in}, rows = ids ? b * t_or_in : b;
    EC_OK(ts_tensor_zeros(ids ? TS_I64 : TS_F32, 2, xs, x));
    EC_OK(ts_tensor_zeros(TS_I64, 1, &rows, tg));
    if (ts__is_meta(*x)) return;
    int64_t *t = ts_tensor_data(*tg);
    for (int64_t i = 0; i < rows; i++) t[i] = (i * 11 + salt) % classes;
    if (ids) {
        int64_t *a = ts_tensor_data(*x);
        for (int64_t i = 0; i < b * t_or_in; i++) a[i] = (i * 7 + salt * 3) % classes;
    } else {
        float *a = ts_tensor_data(*x);
        for (int64_t i = 0; i < b * t_or_in; i++) a[i] = (float)((i * 13 + salt) % 17) / 17.0f - 0.5f;
    }
}

/* The storage peak of the step after a warm-up one (the optimizer state
 * then lives), less the input's and targets' blocks: what the estimate's
 * peak_bytes predicts. */
static inline size_t ec_measured_peak(ts_module *m, ts_optim *opt, ts_tensor *x, ts_tensor *tg, int microbatches)
{
    ec_step(m, opt, x, tg, microbatches);
    ts_mem_reset_peak();
    ec_step(m, opt, x, tg, microbatches);
    return ts_mem_peak_bytes(TS_MEM_STORAGE) - ts__pool_block_bytes(ts_storage_nbytes(ts_tensor_storage(x))) -
        ts__pool_block_bytes(ts_storage_nbytes(ts_tensor_storage(tg)));
}

/* ------------------------------------------------------------ a user module type */

/* GatedMLP(d, h), a module type of the test's own (its vtable, its
 * reset_parameters): y = x + down(gelu(gate(x)) * up(x)), gate and up
 * (h, d), down (d, h), no biases, and a buffer "steps" (1) that the
 * forward does not read. */
typedef struct ec_gated {
    ts_module base;
    ts_tensor *gate, *up, *down, *steps;
} ec_gated;

static inline ts_status ec_gated_reset(ts_module *m)
{
    ec_gated *g = (ec_gated *)m;
    ts_status st = ts_normal_(g->gate, 0.0, 0.2, NULL);
    if (!st) st = ts_normal_(g->up, 0.0, 0.2, NULL);
    if (!st) st = ts_normal_(g->down, 0.0, 0.1, NULL);
    if (!st) st = ts_tensor_fill_(g->steps, 0.0);
    return st;
}

static inline ts_status ec_gated_visit(ts_module *m, const ts_module_visitor *v)
{
    ec_gated *g = (ec_gated *)m;
    ts_status st = TS_OK;
    if (v->param && (st = v->param(v->ctx, "gate", &g->gate))) return st;
    if (v->param && (st = v->param(v->ctx, "up", &g->up))) return st;
    if (v->param && (st = v->param(v->ctx, "down", &g->down))) return st;
    if (v->buffer && (st = v->buffer(v->ctx, "steps", &g->steps))) return st;
    return TS_OK;
}

static inline ts_status ec_gated_forward(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    ec_gated *g = (ec_gated *)m;
    if (n_in != 1) return ts_error(TS_ERR_INVALID_ARGUMENT, "GatedMLP: %d inputs (one)", n_in);
    ts_tensor *a = NULL, *b = NULL, *c = NULL, *d = NULL, *e = NULL, *y = NULL;
    ts_status st = ts_linear(in[0], g->gate, NULL, &a);
    if (!st) st = ts_linear(in[0], g->up, NULL, &b);
    if (!st) st = ts_gelu(a, TS_GELU_NONE, &c);
    if (!st) st = ts_mul(c, b, &d);
    if (!st) st = ts_linear(d, g->down, NULL, &e);
    if (!st) st = ts_add(in[0], e, &y);
    ts_tensor_free(a), ts_tensor_free(b), ts_tensor_free(c), ts_tensor_free(d), ts_tensor_free(e);
    if (st) return st;
    out[0] = y;
    *n_out = 1;
    return TS_OK;
}

static inline void ec_gated_free(ts_module *m)
{
    ec_gated *g = (ec_gated *)m;
    ts_tensor_free(g->gate), ts_tensor_free(g->up), ts_tensor_free(g->down), ts_tensor_free(g->steps);
    free(g);
}

static const ts_module_vtable ec_gated_vt = {.type_name = "GatedMLP",
                                             .forward = ec_gated_forward,
                                             .visit = ec_gated_visit,
                                             .free = ec_gated_free,
                                             .reset_parameters = ec_gated_reset};

static inline ts_module *ec_gated_new(int64_t d, int64_t h)
{
    ec_gated *g = calloc(1, sizeof *g);
    EC_OK(g ? TS_OK : TS_ERR_NO_MEMORY);
    EC_OK(ts_module_init(&g->base, &ec_gated_vt));
    int64_t gs[2] = {h, d}, ds[2] = {d, h}, one = 1;
    EC_OK(ts_param_new(TS_F32, 2, gs, &g->gate));
    EC_OK(ts_param_new(TS_F32, 2, gs, &g->up));
    EC_OK(ts_param_new(TS_F32, 2, ds, &g->down));
    EC_OK(ts_tensor_empty(TS_F32, 1, &one, &g->steps));
    EC_OK(ec_gated_reset(&g->base));
    return &g->base;
}

enum { EC_IN = 24, EC_D = 40, EC_H = 72, EC_CLASSES = 10, EC_BLOCKS = 3, EC_ROWS = 48 };

typedef struct ec_shard_opts {
    ts_mesh *mesh;            /* NULL: the world's */
    ts_reshard_policy policy; /* the blocks' reshard_after_forward */
    int every_n;              /* TS_RESHARD_EVERY_N's */
    bool bf16;                /* param_dtype bf16, reduce float32 */
    bool ckpt;                /* ts_checkpoint_module on every block */
    bool explicit_pf;         /* block i forward-prefetches i+1, backward-prefetches i-1 */
    bool prefetch;            /* implicit prefetch */
} ec_shard_opts;

/* Linear(EC_IN, EC_D), EC_BLOCKS GatedMLP(EC_D, EC_H), Linear(EC_D,
 * EC_CLASSES) in a Sequential ("0" .. "4"), built with seed 7 (on the
 * meta device inside a meta scope); each block sharded on its own, then
 * the root (sharded false: left unsharded). */
static inline ts_module *ec_user_model(bool sharded, const ec_shard_opts *so)
{
    ts_manual_seed(7);
    ts_module *mods[EC_BLOCKS + 2];
    EC_OK(ts_linear_new(EC_IN, EC_D, true, &mods[0]));
    for (int i = 0; i < EC_BLOCKS; i++) mods[1 + i] = ec_gated_new(EC_D, EC_H);
    EC_OK(ts_linear_new(EC_D, EC_CLASSES, true, &mods[EC_BLOCKS + 1]));
    ts_module *m = NULL;
    EC_OK(ts_sequential_new(EC_BLOCKS + 2, mods, &m));
    if (!sharded) return m;
    ts_fsdp_options fo = ts_fsdp_options_default();
    fo.mesh = so ? so->mesh : NULL;
    ts_mp_policy mp = ts_mp_policy_default();
    mp.param_dtype = TS_BF16, mp.reduce_dtype = TS_F32;
    if (so && so->bf16) fo.mp_policy = &mp;
    fo.reshard_after_forward = so ? so->policy : TS_RESHARD_AUTO;
    fo.reshard_every_n = so && so->every_n ? so->every_n : 1;
    ts_module *blk[EC_BLOCKS];
    for (int i = 0; i < EC_BLOCKS; i++) {
        char name[8];
        snprintf(name, sizeof name, "%d", 1 + i);
        EC_OK(ts_module_get_submodule(m, name, &blk[i]));
        if (so && so->ckpt) EC_OK(ts_checkpoint_module(blk[i]));
        EC_OK(ts_fully_shard(blk[i], &fo));
    }
    fo.reshard_after_forward = TS_RESHARD_AUTO;
    EC_OK(ts_fully_shard(m, &fo));
    if (so && so->explicit_pf)
        for (int i = 0; i < EC_BLOCKS; i++) {
            if (i + 1 < EC_BLOCKS) EC_OK(ts_fsdp_set_modules_to_forward_prefetch(blk[i], 1, &blk[i + 1]));
            if (i > 0) EC_OK(ts_fsdp_set_modules_to_backward_prefetch(blk[i], 1, &blk[i - 1]));
        }
    EC_OK(ts_fsdp_set_implicit_prefetch(m, so ? so->prefetch : true, so ? so->prefetch : true));
    return m;
}

/* The estimate's options for the user model: (EC_ROWS, EC_IN) floats. */
static inline ts_fsdp_memory_options ec_user_options(void)
{
    ts_fsdp_memory_options mo = ts_fsdp_memory_options_default();
    mo.input_ndim = 2, mo.input_shape[0] = EC_ROWS, mo.input_shape[1] = EC_IN;
    return mo;
}

#endif
