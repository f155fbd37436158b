/*
 * Deferred initialization (fully_shard.h, ts_fsdp_materialize;
 * docs/fully_shard.md, "Deferred initialization"): a model whose
 * parameters and buffers are on the meta device is sharded without bytes,
 * then materialized (or filled from a checkpoint). Over W loopback ranks
 * run as threads (tests/loopback_ranks.h), each with its own default
 * generator. The reference is the same model built eagerly from the same
 * seed and sharded the same way: the full state dicts must hold the same
 * bits.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint/checkpoint.h"
#include "fully_shard/fully_shard.h"
#include "nn/internal.h"
#include "optim/optim.h"
#include "tensor/internal.h"
#include "tests/loopback_ranks.h"

#define RK_OK TH_RK_OK
#define RK_EQ TH_RK_EQ
#define TIMEOUT_S 60.0
#define SEED 1234

/* ------------------------------------------------------------------ */
/* Models                                                             */
/* ------------------------------------------------------------------ */

typedef enum model_kind { M_MLP, M_GPT, M_GPT_TIED, M_LINEAR, M_EMB, M_LN, M_MHA, M_ENC, M_USER } model_kind;

/* A user module type with its own initializer (reset_parameters, called
 * by its constructor): a child Linear(5, 6) "fc", a parameter "gain"
 * (7, 3) drawn from a normal, a buffer "scale" (4) drawn from a uniform,
 * a parameter "shift" (5) filled with 0.25. */
typedef struct user_mod {
    ts_module base;
    ts_module *fc;
    ts_tensor *gain, *shift, *scale;
} user_mod;

static ts_status user_reset(ts_module *m)
{
    user_mod *u = (user_mod *)m;
    ts_status st = ts_normal_(u->gain, 0.0, 0.5, NULL);
    if (!st) st = ts_uniform_(u->scale, -2.0, 2.0, NULL);
    if (!st) st = ts_tensor_fill_(u->shift, 0.25);
    return st;
}

static ts_status user_visit(ts_module *m, const ts_module_visitor *v)
{
    user_mod *u = (user_mod *)m;
    ts_status st = TS_OK;
    if (v->param && (st = v->param(v->ctx, "gain", &u->gain))) return st;
    if (v->param && (st = v->param(v->ctx, "shift", &u->shift))) return st;
    if (v->buffer && (st = v->buffer(v->ctx, "scale", &u->scale))) return st;
    if (v->child && (st = v->child(v->ctx, "fc", u->fc))) return st;
    return TS_OK;
}

static void user_free(ts_module *m)
{
    user_mod *u = (user_mod *)m;
    ts_module_free(u->fc);
    ts_tensor_free(u->gain);
    ts_tensor_free(u->shift);
    ts_tensor_free(u->scale);
    free(u);
}

static const ts_module_vtable user_vt = {
    .type_name = "UserInit", .visit = user_visit, .free = user_free, .reset_parameters = user_reset};

static ts_status user_new(ts_module **out)
{
    user_mod *u = calloc(1, sizeof *u);
    if (!u) return TS_ERR_NO_MEMORY;
    ts_status st = ts_module_init(&u->base, &user_vt);
    int64_t g[2] = {7, 3}, sh = 5, sc = 4;
    if (!st) st = ts_linear_new(5, 6, true, &u->fc);
    if (!st) st = ts_param_new(TS_F32, 2, g, &u->gain);
    if (!st) st = ts_param_new(TS_F32, 1, &sh, &u->shift);
    if (!st) st = ts_tensor_empty(TS_F32, 1, &sc, &u->scale);
    if (!st) st = user_reset(&u->base);
    if (st) {
        user_free(&u->base);
        return st;
    }
    *out = &u->base;
    return TS_OK;
}

/* MLP: Sequential(Linear(6, 10), Tanh, Linear(10, 7), Tanh, Linear(7, 5)):
 * 5, 7 and 10 rows, uneven on 2, 3 and 4 ranks. GPT: 2 blocks, d 8. */
static ts_status model_build(model_kind k, ts_module **out)
{
    ts_encoder_layer_config ec = ts_encoder_layer_config_default(8, 2);
    ec.dim_feedforward = 12;
    ec.dropout = 0.0;
    switch (k) {
    case M_LINEAR: return ts_linear_new(7, 9, true, out);
    case M_EMB: return ts_embedding_new(13, 6, out);
    case M_LN: return ts_layer_norm_new(10, 1e-5, true, out);
    case M_MHA: return ts_mha_new(8, 2, 0.0, true, out);
    case M_ENC: return ts_encoder_layer_new(&ec, out);
    case M_USER: return user_new(out);
    default: break;
    }
    if (k == M_MLP) {
        ts_module *c[5] = {0};
        ts_status st;
        if ((st = ts_linear_new(6, 10, true, &c[0])) || (st = ts_tanh_new(&c[1])) ||
            (st = ts_linear_new(10, 7, true, &c[2])) || (st = ts_tanh_new(&c[3])) ||
            (st = ts_linear_new(7, 5, true, &c[4]))) {
            for (int i = 0; i < 5; i++) ts_module_free(c[i]);
            return st;
        }
        return ts_sequential_new(5, c, out); /* owns the children */
    }
    ts_gpt_config cfg = ts_gpt_config_default();
    cfg.vocab_size = 11;
    cfg.block_size = 8;
    cfg.n_layer = 2;
    cfg.n_head = 2;
    cfg.d_model = 8;
    cfg.tie_weights = k == M_GPT_TIED;
    return ts_gpt_new(&cfg, out);
}

/* ------------------------------------------------------------------ */
/* Sharding                                                           */
/* ------------------------------------------------------------------ */

typedef struct run_arg {
    model_kind kind;
    bool hsdp;
    bool mp;         /* mp_policy param_dtype bfloat16 */
    bool offload;    /* offload_policy, pinned */
    bool leftover;   /* the root is not sharded: its own parameters stay outside every group */
    bool ckpt;       /* activation checkpointing on the blocks (GPT) before sharding */
    bool ckpt_after; /* the same, after sharding */
    bool persist;    /* persist_threshold_numel 20: the biases and norms stay whole (outside the groups' buffers) */
    bool by_size;    /* ts_fsdp_apply_by_size(60) instead of sharding each Linear (MLP) */
    const char *dir; /* a checkpoint folder (made by the test) */
} run_arg;

static ts_status shard(ts_module *root, const run_arg *a, ts_mesh *mesh)
{
    ts_fsdp_options o = ts_fsdp_options_default();
    o.mesh = mesh;
    ts_mp_policy mp = ts_mp_policy_default();
    mp.param_dtype = TS_BF16;
    if (a->mp) o.mp_policy = &mp;
    ts_offload_policy off = ts_offload_policy_default();
    if (a->offload) o.offload_policy = &off;
    if (a->persist) o.persist_threshold_numel = 20;
    ts_status st;
    ts_module *blocks = NULL;
    bool gpt = a->kind == M_GPT || a->kind == M_GPT_TIED;
    if (gpt && (st = ts_module_get_submodule(root, "blocks", &blocks))) return st;
    if (a->kind == M_MLP && a->by_size) {
        if ((st = ts_fsdp_apply_by_size(root, 60, &o, NULL))) return st;
    } else if (a->kind == M_MLP) {
        for (int i = 0; i < 5; i += 2)
            if ((st = ts_fully_shard(ts_container_child(root, i), &o))) return st;
    } else if (a->kind == M_USER) {
        ts_module *fc = NULL;
        if ((st = ts_module_get_submodule(root, "fc", &fc)) || (st = ts_fully_shard(fc, &o))) return st;
    } else if (a->kind != M_GPT && a->kind != M_GPT_TIED) {
        /* one layer: the root's group only */
    } else {
        for (int i = 0; a->ckpt && i < ts_container_size(blocks); i++)
            if ((st = ts_checkpoint_module(ts_container_child(blocks, i)))) return st;
        if ((st = ts_fsdp_apply_by_type(root, "Block", &o, NULL))) return st;
        for (int i = 0; a->ckpt_after && i < ts_container_size(blocks); i++)
            if ((st = ts_checkpoint_module(ts_container_child(blocks, i)))) return st;
    }
    return a->leftover ? TS_OK : ts_fully_shard(root, &o);
}

/* The model on the meta device with its initializers recorded: built
 * inside ts_device_scope_enter(TS_DEVICE_META), as a user builds one (the
 * caller seeds first; building on meta draws nothing). */
static ts_status build_meta(model_kind k, ts_module **out)
{
    ts_status st = ts_device_scope_enter(TS_DEVICE_META);
    if (st) return st;
    st = model_build(k, out);
    ts_status ex = ts_device_scope_exit();
    return st ? st : ex;
}

/* The model built eagerly (seeded) or on the meta device, then sharded. */
static ts_status make(th_rank *rc, const run_arg *a, ts_mesh *mesh, bool meta, ts_module **out)
{
    ts_manual_seed(SEED);
    ts_status st = meta ? build_meta(a->kind, out) : model_build(a->kind, out);
    if (!st) st = shard(*out, a, mesh);
    (void)rc;
    return st;
}

/* Every tensor of the two full state dicts has the same bits. */
static int same_state(th_rank *rc, ts_module *ref, ts_module *got, const char *what)
{
    ts_state_dict *a = NULL, *b = NULL;
    RK_OK(rc, ts_fsdp_full_state_dict(ref, false, &a));
    RK_OK(rc, ts_fsdp_full_state_dict(got, false, &b));
    int bad = 0;
    if (ts_state_dict_size(a) != ts_state_dict_size(b))
        bad = th_rank_fail(rc, "%s: %d tensors, %d expected", what, ts_state_dict_size(b), ts_state_dict_size(a));
    for (int i = 0; i < ts_state_dict_size(a) && !bad; i++) {
        const char *name = ts_state_dict_name(a, i);
        bad = th_rank_same_bits(rc, ts_state_dict_tensor(a, i), ts_state_dict_get(b, name), "%s: '%s'", what, name);
    }
    ts_state_dict_free(a);
    ts_state_dict_free(b);
    return bad;
}

static int any_meta(ts_module *m)
{
    ts_named_params np = {0};
    if (ts__module_entries(m, true, true, true, &np)) return -1;
    int n = 0;
    for (int i = 0; i < np.n; i++) n += ts__is_meta(*np.items[i].slot);
    ts_named_params_free(&np);
    return n;
}

/* One forward and backward on token ids or rows, so the model runs. */
static ts_status run_step(ts_module *m, model_kind k)
{
    if (k == M_MLP) return th_mse_backward_rows(m, 0, 3, 6, 5);
    int64_t shape[2] = {2, 8};
    ts_tensor *ids = NULL, *logits = NULL, *loss = NULL;
    ts_status st = ts_tensor_zeros(TS_I64, 2, shape, &ids);
    if (!st) {
        int64_t *d = ts_tensor_data(ids);
        for (int i = 0; i < 16; i++) d[i] = (i * 7) % 11;
        st = ts_module_call1(m, ids, &logits);
    }
    if (!st) st = ts_sum(logits, 0, NULL, false, &loss);
    if (!st) st = ts_backward(loss, NULL, false);
    ts_tensor_free(ids);
    ts_tensor_free(logits);
    ts_tensor_free(loss);
    return st;
}

/* ------------------------------------------------------------------ */
/* Rank bodies                                                        */
/* ------------------------------------------------------------------ */

typedef int (*body_fn)(th_rank *rc, const run_arg *a, ts_mesh *mesh);

typedef struct rank_arg {
    run_arg a;
    body_fn body;
} rank_arg;

static int rank_main(th_rank *rc)
{
    const rank_arg *ra = rc->arg;
    ts_generator *gen = NULL;
    RK_OK(rc, ts_generator_new(SEED, &gen));
    ts_generator *prev = ts_generator_set_thread_default(gen);
    ts_mesh *mesh = th_rank_mesh(rc, ra->a.hsdp);
    int bad = mesh ? ra->body(rc, &ra->a, mesh) : th_rank_fail(rc, "mesh: %s", ts_last_error());
    ts_mesh_free(mesh);
    ts_generator_set_thread_default(prev);
    ts_generator_free(gen);
    return bad;
}

static void run(int W, body_fn body, run_arg a)
{
    rank_arg ra = {a, body};
    th_run_world(W, rank_main, &ra, TIMEOUT_S);
}

/* A sharded checkpoint (ts_ckpt_save) of the eager model, loaded into the
 * meta one; then a full file (ts_ckpt_save_full) and a full state dict
 * into two more meta models. */
static int body_load(th_rank *rc, const run_arg *a, ts_mesh *mesh)
{
    ts_module *ref = NULL, *got = NULL;
    int bad = 0;
    RK_OK(rc, make(rc, a, mesh, false, &ref));
    char full[600];
    snprintf(full, sizeof full, "%s/full.safetensors", a->dir);
    RK_OK(rc, ts_ckpt_save(a->dir, ref, NULL));
    RK_OK(rc, ts_ckpt_save_full(full, ref, NULL, 0));
    for (int how = 0; how < 3 && !bad; how++) {
        RK_OK(rc, make(rc, a, mesh, true, &got));
        if (any_meta(got) <= 0) bad = th_rank_fail(rc, "nothing on the meta device after sharding");
        if (!bad && how == 0)
            bad = ts_ckpt_load(a->dir, got, NULL, NULL) ? th_rank_fail(rc, "ts_ckpt_load: %s", ts_last_error()) : 0;
        if (!bad && how == 1)
            bad = ts_ckpt_load_full(full, got, true) ? th_rank_fail(rc, "ts_ckpt_load_full: %s", ts_last_error()) : 0;
        if (!bad && how == 2) {
            ts_state_dict *sd = NULL;
            RK_OK(rc, ts_fsdp_full_state_dict(ref, false, &sd));
            if (ts_fsdp_load_full_state_dict(got, sd, true))
                bad = th_rank_fail(rc, "load_full_state_dict: %s", ts_last_error());
            ts_state_dict_free(sd);
        }
        if (!bad && any_meta(got) != 0) bad = th_rank_fail(rc, "load %d left meta tensors", how);
        static const char *names[3] = {"ts_ckpt_load", "ts_ckpt_load_full", "ts_fsdp_load_full_state_dict"};
        if (!bad) bad = same_state(rc, ref, got, names[how]);
        if (!bad && run_step(got, a->kind)) bad = th_rank_fail(rc, "step after %s: %s", names[how], ts_last_error());
        ts_module_free(got);
        got = NULL;
    }
    ts_module_free(ref);
    return bad;
}

static void run_load(int W, run_arg a)
{
    char *dir = th_tmp_dir("ts_deferred");
    a.dir = dir;
    run(W, body_load, a);
    th_rm_rf(dir);
    free(dir);
}

Test(fully_shard_deferred_init, load_into_meta_mlp_1_to_4_ranks, .timeout = 120)
{
    for (int W = 1; W <= 4; W++) run_load(W, (run_arg){.kind = M_MLP});
}

Test(fully_shard_deferred_init, load_into_meta_gpt, .timeout = 120)
{
    run_load(2, (run_arg){.kind = M_GPT});
    run_load(3, (run_arg){.kind = M_GPT_TIED});
    run_load(4, (run_arg){.kind = M_GPT, .hsdp = true});
}

Test(fully_shard_deferred_init, load_into_meta_policies, .timeout = 120)
{
    run_load(2, (run_arg){.kind = M_GPT, .mp = true});
    run_load(2, (run_arg){.kind = M_GPT, .offload = true});
    run_load(3, (run_arg){.kind = M_GPT, .leftover = true});
    run_load(2, (run_arg){.kind = M_GPT_TIED, .ckpt = true});
    run_load(3, (run_arg){.kind = M_GPT, .ckpt_after = true, .persist = true});
    run_load(2, (run_arg){.kind = M_MLP, .by_size = true});
}

/* Until materialized, everything that needs the values refuses the model,
 * naming the parameter; nothing is changed. */
static int body_errors(th_rank *rc, const run_arg *a, ts_mesh *mesh)
{
    ts_module *m = NULL;
    RK_OK(rc, make(rc, a, mesh, true, &m));
    int bad = 0;
    ts_status st = run_step(m, a->kind);
    if (st != TS_ERR_STATE || !strstr(ts_last_error(), "'0.weight' is on the meta device: call ts_fsdp_materialize"))
        bad = th_rank_fail(rc, "forward: %s: %s", ts_status_name(st), ts_last_error());
    ts_state_dict *sd = NULL;
    if (!bad && (st = ts_fsdp_full_state_dict(m, false, &sd)) != TS_ERR_STATE)
        bad = th_rank_fail(rc, "full_state_dict: %s", ts_status_name(st));
    if (!bad && !strstr(ts_last_error(), "'0.weight' is on the meta device"))
        bad = th_rank_fail(rc, "full_state_dict: %s", ts_last_error());
    ts_fsdp_unshard_handle *h = NULL;
    if (!bad && (st = ts_fsdp_unshard(ts_container_child(m, 2), false, &h)) != TS_ERR_STATE)
        bad = th_rank_fail(rc, "unshard: %s", ts_status_name(st));
    if (!bad && !strstr(ts_last_error(), "weight' is on the meta device"))
        bad = th_rank_fail(rc, "unshard: %s", ts_last_error());
    if (!bad && (st = ts_ckpt_save_full("/nonexistent/x", m, NULL, 0)) != TS_ERR_STATE)
        bad = th_rank_fail(rc, "ckpt_save_full: %s", ts_status_name(st));
    if (!bad && any_meta(m) != 6) bad = th_rank_fail(rc, "%d meta tensors left, 6 expected", any_meta(m));
    /* materialized, it runs (zero-filled parameters until their initializers replay) */
    if (!bad && ts_fsdp_materialize(m)) bad = th_rank_fail(rc, "materialize: %s", ts_last_error());
    if (!bad && any_meta(m) != 0) bad = th_rank_fail(rc, "meta tensors after materialize");
    if (!bad && run_step(m, a->kind)) bad = th_rank_fail(rc, "step: %s", ts_last_error());
    ts_module_free(m);
    return bad;
}

Test(fully_shard_deferred_init, errors_before_materialize, .timeout = 60)
{
    run(2, body_errors, (run_arg){.kind = M_MLP});
}

/* A group mixing meta and real parameters is refused, naming both. */
Test(fully_shard_deferred_init, mixed_group_refused)
{
    ts_module *m = NULL;
    cr_assert_eq(model_build(M_MLP, &m), TS_OK);
    ts_module *lin = ts_container_child(m, 0);
    ts_tensor **w = NULL;
    ts_named_params np = {0};
    cr_assert_eq(ts__module_entries(lin, true, false, false, &np), TS_OK);
    w = np.items[0].slot; /* weight */
    ts_tensor *meta = NULL;
    cr_assert_eq(ts__tensor_new_meta(TS_F32, ts_tensor_ndim(*w), ts_tensor_shape(*w), &meta), TS_OK);
    ts_tensor_free(*w);
    *w = meta;
    ts_named_params_free(&np);
    ts_status st = ts_fully_shard(lin, NULL);
    cr_assert_eq(st, TS_ERR_INVALID_ARGUMENT, "%s", ts_status_name(st));
    cr_assert(strstr(ts_last_error(), "'weight' is on the meta device and 'bias' is not"), "%s", ts_last_error());
    cr_assert_not(ts_module_is_fsdp(lin));
    ts_module_free(m);
}

/* Sharding a meta model allocates no parameter bytes. */
Test(fully_shard_deferred_init, shard_allocates_nothing)
{
    ts_module *m = NULL;
    size_t before = ts_mem_live_bytes(TS_MEM_STORAGE);
    cr_assert_eq(ts_device_scope_enter(TS_DEVICE_META), TS_OK);
    cr_assert_eq(ts_linear_new(512, 512, true, &m), TS_OK);
    cr_assert_eq(ts_device_scope_exit(), TS_OK);
    ts_fsdp_options o = ts_fsdp_options_default();
    ts_offload_policy off = ts_offload_policy_default();
    o.offload_policy = &off;
    cr_assert_eq(ts_fully_shard(m, &o), TS_OK, "%s", ts_last_error());
    size_t after = ts_mem_live_bytes(TS_MEM_STORAGE);
    cr_assert_lt(after, before + 4096, "sharding took %zu bytes", after - before);
    cr_assert_eq(any_meta(m), 2);
    cr_assert_eq(ts_fsdp_materialize(m), TS_OK, "%s", ts_last_error());
    cr_assert_eq(any_meta(m), 0);
    cr_assert_geq(ts_mem_live_bytes(TS_MEM_STORAGE), before + 512 * 513 * 4);
    ts_fsdp_offload_stats s;
    cr_assert_eq(ts_fsdp_offload_stats_get(m, &s), TS_OK);
    cr_assert_eq(s.pinned_groups, 1);
    ts_module_free(m);
}

/* ------------------------------------------------------------------ */
/* Deferred = eager                                                   */
/* ------------------------------------------------------------------ */

/* The model built on meta, sharded and materialized holds the bits of the
 * one built eagerly from the same seed and sharded; the generator ends in
 * the same state (every draw of the eager build was replayed). */
static int body_same(th_rank *rc, const run_arg *a, ts_mesh *mesh)
{
    ts_module *ref = NULL, *got = NULL;
    uint8_t g_eager[TS_GENERATOR_STATE_BYTES], g_deferred[TS_GENERATOR_STATE_BYTES];
    RK_OK(rc, make(rc, a, mesh, false, &ref));
    ts_generator_get_state(ts_default_generator(), g_eager);
    RK_OK(rc, make(rc, a, mesh, true, &got));
    int bad = any_meta(got) <= 0 ? th_rank_fail(rc, "nothing on the meta device after sharding") : 0;
    if (!bad && ts_fsdp_materialize(got)) bad = th_rank_fail(rc, "materialize: %s", ts_last_error());
    ts_generator_get_state(ts_default_generator(), g_deferred);
    if (!bad && any_meta(got) != 0) bad = th_rank_fail(rc, "meta tensors after materialize");
    if (!bad && memcmp(g_eager, g_deferred, sizeof g_eager))
        bad = th_rank_fail(rc, "the generator's state differs after materialize");
    if (!bad) bad = same_state(rc, ref, got, "deferred");
    if (!bad && (a->kind == M_MLP || a->kind == M_GPT || a->kind == M_GPT_TIED) && run_step(got, a->kind))
        bad = th_rank_fail(rc, "step: %s", ts_last_error());
    ts_module_free(got);
    ts_module_free(ref);
    return bad;
}

Test(fully_shard_deferred_init, every_layer_1_to_4_ranks, .timeout = 240)
{
    static const model_kind kinds[] = {M_LINEAR, M_EMB, M_LN, M_MHA, M_ENC, M_USER, M_MLP, M_GPT, M_GPT_TIED};
    for (int W = 1; W <= 4; W++)
        for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) run(W, body_same, (run_arg){.kind = kinds[k]});
}

Test(fully_shard_deferred_init, hsdp_policies_ties_leftovers_checkpointing, .timeout = 240)
{
    run(4, body_same, (run_arg){.kind = M_GPT, .hsdp = true});
    run(4, body_same, (run_arg){.kind = M_USER, .hsdp = true});
    run(3, body_same, (run_arg){.kind = M_GPT, .mp = true});
    run(3, body_same, (run_arg){.kind = M_GPT, .offload = true});
    run(2, body_same, (run_arg){.kind = M_GPT, .leftover = true});
    run(3, body_same, (run_arg){.kind = M_USER, .leftover = true});
    run(2, body_same, (run_arg){.kind = M_GPT, .ckpt = true});
    run(3, body_same, (run_arg){.kind = M_GPT, .ckpt_after = true, .persist = true});
    run(4, body_same, (run_arg){.kind = M_MLP, .by_size = true});
}

/* A model never sharded materializes whole. */
Test(fully_shard_deferred_init, unsharded_model_materializes_whole, .timeout = 60)
{
    for (int k = M_MLP; k <= M_USER; k++) {
        ts_module *ref = NULL, *got = NULL;
        ts_manual_seed(SEED);
        cr_assert_eq(model_build(k, &ref), TS_OK);
        ts_manual_seed(SEED);
        cr_assert_eq(build_meta(k, &got), TS_OK, "%s", ts_last_error());
        cr_assert_gt(any_meta(got), 0);
        cr_assert_eq(ts_fsdp_materialize(got), TS_OK, "%s", ts_last_error());
        cr_assert_eq(any_meta(got), 0);
        ts_named_params a = {0}, b = {0};
        cr_assert_eq(ts__module_entries(ref, true, true, true, &a), TS_OK);
        cr_assert_eq(ts__module_entries(got, true, true, true, &b), TS_OK);
        cr_assert_eq(a.n, b.n);
        for (int i = 0; i < a.n; i++) {
            const ts_tensor *x = *a.items[i].slot, *y = *b.items[i].slot;
            cr_assert_eq(ts_tensor_numel(x), ts_tensor_numel(y));
            cr_assert_eq(memcmp(ts_tensor_data(x), ts_tensor_data(y),
                                (size_t)ts_tensor_numel(x) * ts_dtype_size(ts_tensor_dtype(x))),
                         0, "kind %d: '%s' differs", k, a.items[i].name);
        }
        ts_named_params_free(&a);
        ts_named_params_free(&b);
        ts_module_free(ref);
        ts_module_free(got);
    }
}
