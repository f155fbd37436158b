/* ts_fsdp_memory_estimate (fully_shard/memory.c): the components against
 * the model's real tensors on 1, 2 and 4 simulated ranks (uneven chunks
 * included), the predicted peak of a GPT step against the measured
 * TS_MEM_STORAGE peak, and the errors. */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "fully_shard/fully_shard.h"
#include "optim/optim.h"
#include "tensor/internal.h"
#include "tests/loopback_ranks.h"

static pthread_mutex_t g_build_mu = PTHREAD_MUTEX_INITIALIZER;

/* d 12 with 3 heads, vocab 7, block 10: rows of 7, 10, 12, 36 and 48
 * split unevenly over 4 ranks (a chunk of 2 for 7 rows leaves rank 3 one
 * row; 10 rows: chunks of 3, rank 3 gets one). */
static ts_gpt_config small_cfg(void)
{
    ts_gpt_config g = ts_gpt_config_default();
    g.vocab_size = 7, g.block_size = 10, g.n_layer = 2, g.n_head = 3, g.d_model = 12;
    return g;
}

static int shard_gpt(ts_comm *c, ts_mesh **mesh, ts_module **m)
{
    int64_t shape[1] = {ts_comm_size(c)};
    const char *names[1] = {"dp"};
    ts_gpt_config g = small_cfg();
    pthread_mutex_lock(&g_build_mu);
    ts_manual_seed(3);
    ts_status st = ts_gpt_new(&g, m);
    pthread_mutex_unlock(&g_build_mu);
    if (st || ts_mesh_new(c, "cpu", 1, shape, names, mesh)) return 1;
    ts_fsdp_options fo = ts_fsdp_options_default();
    fo.mesh = *mesh;
    for (int l = 0; l < g.n_layer; l++) {
        char name[32];
        ts_module *b;
        snprintf(name, sizeof name, "blocks.%d", l);
        if (ts_module_get_submodule(*m, name, &b) || ts_fully_shard(b, &fo)) return 1;
    }
    return ts_fully_shard(*m, &fo) != TS_OK;
}

static size_t pb(size_t n) { return ts__pool_block_bytes(n); }

/* On each rank: the predicted parameter, gradient, optimizer and group
 * bytes equal what the sharded model's tensors hold after one AdamW step
 * (pool blocks: the groups' sharded buffers, the storages of the shards'
 * gradients, each counted once (a group's gradients are views of one
 * buffer), the state tensors). */
static int components_rank(th_rank *rc)
{
    ts_mesh *mesh = NULL;
    ts_module *m = NULL;
    if (shard_gpt(rc->c, &mesh, &m)) return th_rank_fail(rc, "shard: %s", ts_last_error());
    ts_fsdp_memory_options mo = ts_fsdp_memory_options_default();
    mo.input_ndim = 2, mo.input_shape[0] = 2, mo.input_shape[1] = 8;
    ts_fsdp_memory_report r;
    TH_RK_OK(rc, ts_fsdp_memory_estimate(m, &mo, &r));
    /* the truth from the tensors: sharded buffers per group, gradients and state per parameter */
    size_t param = 0, grad = 0, optim = 0, group = 0, per_param = 0;
    const char *groups[3] = {"", "blocks.0", "blocks.1"};
    for (int i = 0; i < 3; i++) {
        ts_module *g = m;
        if (i) TH_RK_OK(rc, ts_module_get_submodule(m, groups[i], &g));
        ts_fsdp_group_info gi;
        TH_RK_OK(rc, ts_fsdp_group_info_get(g, &gi));
        param += pb((size_t)gi.shard_numel * 4);
    }
    ts_named_params np;
    TH_RK_OK(rc, ts_module_named_parameters(m, &np));
    ts_tensor *ps[64];
    size_t full_by_group[3] = {0};
    for (int i = 0; i < np.n; i++) {
        ps[i] = *np.items[i].slot;
        const ts_dtensor *dt = ts_fsdp_param_dtensor(ps[i]);
        int64_t full = 1;
        const int64_t *fs = ts_dtensor_shape(dt);
        for (int k = 0; k < ts_dtensor_ndim(dt); k++) full *= fs[k];
        int gi = !strncmp(np.items[i].name, "blocks.0.", 9) ? 1 : !strncmp(np.items[i].name, "blocks.1.", 9) ? 2 : 0;
        full_by_group[gi] += pb((size_t)full * 4);
    }
    for (int i = 0; i < 3; i++)
        if (full_by_group[i] > group) group = full_by_group[i];
    ts_adam_options ao = ts_adamw_options_default();
    ts_optim *opt;
    TH_RK_OK(rc, ts_adamw_new(np.n, ps, &ao, &opt));
    int64_t is[2] = {2, 8}, ts_[1] = {16};
    ts_tensor *ids, *tg, *logits, *flat, *loss;
    TH_RK_OK(rc, ts_tensor_zeros(TS_I64, 2, is, &ids));
    TH_RK_OK(rc, ts_tensor_zeros(TS_I64, 1, ts_, &tg));
    int64_t fs[2] = {16, 7};
    TH_RK_OK(rc, ts_module_call1(m, ids, &logits));
    TH_RK_OK(rc, ts_reshape(logits, 2, fs, &flat));
    TH_RK_OK(rc, ts_cross_entropy(flat, tg, -100, TS_REDUCTION_MEAN, &loss));
    TH_RK_OK(rc, ts_backward(loss, NULL, false));
    TH_RK_OK(rc, ts_optim_step(opt));
    ts_storage *seen[64];
    int n_seen = 0;
    for (int i = 0; i < np.n; i++) {
        ts_tensor *g = ts_tensor_grad(ps[i]);
        size_t local = (size_t)ts_tensor_numel(ps[i]) * 4;
        if (!g) return th_rank_fail(rc, "%s has no gradient", np.items[i].name);
        ts_storage *gs = ts_tensor_storage(g);
        int k = 0;
        while (k < n_seen && seen[k] != gs) k++;
        if (k == n_seen) {
            if (n_seen == (int)(sizeof seen / sizeof seen[0]))
                return th_rank_fail(rc, "more than %d gradient storages", n_seen);
            seen[n_seen++] = gs;
            grad += gs->block_bytes;
        }
        per_param += pb(local);
        optim += 2 * pb(local) + pb(4); /* exp_avg, exp_avg_sq, the 0-d step */
    }
    TH_RK_EQ(rc, n_seen, 3); /* one gradient storage per group */
    TH_RK_EQ(rc, r.param_bytes, param);
    TH_RK_EQ(rc, r.grad_bytes, grad);
    TH_RK_EQ(rc, r.optim_bytes, optim);
    /* SGD with momentum: one buffer of the shard's rows per parameter; plain SGD: none */
    ts_fsdp_memory_report rs;
    mo.optim = TS_FSDP_OPTIM_SGD_MOMENTUM;
    TH_RK_OK(rc, ts_fsdp_memory_estimate(m, &mo, &rs));
    TH_RK_EQ(rc, rs.optim_bytes, per_param);
    mo.optim = TS_FSDP_OPTIM_SGD;
    TH_RK_OK(rc, ts_fsdp_memory_estimate(m, &mo, &rs));
    TH_RK_EQ(rc, rs.optim_bytes, 0);
    TH_RK_EQ(rc, rs.peak_bytes + optim, r.peak_bytes); /* the state is live through the whole step */
    TH_RK_EQ(rc, r.group_bytes, group);
    TH_RK_EQ(rc, r.n_blocks, 2);
    TH_RK_EQ(rc, r.groups_in_flight, 2);
    /* a block's activations: more than its checkpointed input, and the whole forward's more than two blocks' */
    if (!(r.block_act_bytes > r.block_act_ckpt_bytes && r.act_bytes > 2 * r.block_act_bytes &&
          r.act_ckpt_bytes < r.act_bytes && r.peak_bytes >= param + optim + grad))
        return th_rank_fail(rc, "activations block %zu (ckpt %zu), all %zu (ckpt %zu), peak %zu", r.block_act_bytes,
                            r.block_act_ckpt_bytes, r.act_bytes, r.act_ckpt_bytes, r.peak_bytes);
    ts_tensor_free(ids), ts_tensor_free(tg), ts_tensor_free(logits), ts_tensor_free(flat), ts_tensor_free(loss);
    ts_optim_free(opt);
    ts_named_params_free(&np);
    ts_module_free(m);
    ts_mesh_free(mesh);
    return 0;
}

Test(fully_shard_memory_estimate, components_exact_on_1_rank, .timeout = 60) { th_run_world(1, components_rank, NULL, 30.0); }
Test(fully_shard_memory_estimate, components_exact_on_2_ranks, .timeout = 60) { th_run_world(2, components_rank, NULL, 30.0); }
Test(fully_shard_memory_estimate, components_exact_on_4_ranks_uneven, .timeout = 60)
{
    th_run_world(4, components_rank, NULL, 30.0);
}

/* The predicted peak of a GPT step (one rank, no world: fully_shard on
 * the one-rank mesh) against the measured peak of TS_MEM_STORAGE, after
 * a warm-up step as the benchmark does: within 10% (the bound). */
typedef struct peak_opts {
    bool prefetch, bf16, tied, ckpt;
    int offload; /* 0 none, 1 pinned, 2 pageable */
    double dropout;
    ts_reshard_policy policy;
} peak_opts;

static void peak_case(peak_opts po)
{
    bool prefetch = po.prefetch;
    ts_gpt_config g = ts_gpt_config_default();
    g.vocab_size = 32, g.block_size = 64, g.n_layer = 3, g.n_head = 4, g.d_model = 64;
    g.dropout = po.dropout, g.tie_weights = po.tied;
    ts_manual_seed(1);
    ts_module *m;
    cr_assert_eq(ts_gpt_new(&g, &m), TS_OK);
    ts_fsdp_options fo = ts_fsdp_options_default();
    ts_mp_policy mp = ts_mp_policy_default();
    mp.param_dtype = TS_BF16, mp.reduce_dtype = TS_F32;
    if (po.bf16) fo.mp_policy = &mp;
    ts_offload_policy op = ts_offload_policy_default();
    op.pin_memory = po.offload == 1;
    if (po.offload) fo.offload_policy = &op;
    fo.reshard_after_forward = po.policy;
    for (int l = 0; l < g.n_layer; l++) {
        char name[32];
        ts_module *b;
        snprintf(name, sizeof name, "blocks.%d", l);
        cr_assert_eq(ts_module_get_submodule(m, name, &b), TS_OK);
        if (po.ckpt) cr_assert_eq(ts_checkpoint_module(b), TS_OK, "%s", ts_last_error());
        cr_assert_eq(ts_fully_shard(b, &fo), TS_OK, "%s", ts_last_error());
    }
    fo.reshard_after_forward = TS_RESHARD_AUTO;
    cr_assert_eq(ts_fully_shard(m, &fo), TS_OK, "%s", ts_last_error());
    cr_assert_eq(ts_fsdp_set_implicit_prefetch(m, prefetch, prefetch), TS_OK);
    ts_named_params np;
    cr_assert_eq(ts_module_named_parameters(m, &np), TS_OK);
    ts_tensor *ps[64];
    for (int i = 0; i < np.n; i++) ps[i] = *np.items[i].slot;
    ts_adam_options ao = ts_adamw_options_default();
    ts_optim *opt;
    cr_assert_eq(ts_adamw_new(np.n, ps, &ao, &opt), TS_OK);
    int64_t is[2] = {4, 64}, tsz[1] = {256}, fs[2] = {256, 32};
    ts_tensor *ids, *tg;
    cr_assert_eq(ts_tensor_empty(TS_I64, 2, is, &ids), TS_OK);
    cr_assert_eq(ts_tensor_empty(TS_I64, 1, tsz, &tg), TS_OK);
    int64_t *a = ts_tensor_data(ids), *b = ts_tensor_data(tg);
    for (int i = 0; i < 256; i++) a[i] = (i * 7) % 32, b[i] = (i * 11) % 32;
    size_t measured = 0, base = 0;
    for (int s = 0; s < 2; s++) {
        if (s == 1) {
            ts_mem_reset_peak();
            base = ts_mem_live_bytes(TS_MEM_STORAGE) - ts_mem_live_bytes(TS_MEM_STORAGE); /* 0: peaks are absolute */
        }
        ts_tensor *logits, *flat, *loss;
        cr_assert_eq(ts_module_call1(m, ids, &logits), TS_OK);
        if (ts_tensor_dtype(logits) != TS_F32) { /* the loss in float32, as the benchmark */
            ts_tensor *l32;
            cr_assert_eq(ts_to_dtype(logits, TS_F32, &l32), TS_OK);
            ts_tensor_free(logits);
            logits = l32;
        }
        cr_assert_eq(ts_reshape(logits, 2, fs, &flat), TS_OK);
        cr_assert_eq(ts_cross_entropy(flat, tg, -100, TS_REDUCTION_MEAN, &loss), TS_OK);
        cr_assert_eq(ts_backward(loss, NULL, false), TS_OK);
        cr_assert_eq(ts_optim_step(opt), TS_OK);
        ts_optim_zero_grad(opt, true);
        ts_tensor_free(logits), ts_tensor_free(flat), ts_tensor_free(loss);
    }
    /* the step's storage: the peak less what lives outside the model (the ids and targets) */
    measured = ts_mem_peak_bytes(TS_MEM_STORAGE) - base - pb(256 * 8) * 2;
    ts_fsdp_memory_options mo = ts_fsdp_memory_options_default();
    mo.input_ndim = 2, mo.input_shape[0] = 4, mo.input_shape[1] = 64;
    ts_fsdp_memory_report r;
    cr_assert_eq(ts_fsdp_memory_estimate(m, &mo, &r), TS_OK, "%s", ts_last_error());
    double ratio = (double)r.peak_bytes / (double)measured;
    cr_log_info("prefetch %d bf16 %d dropout %g tied %d policy %d ckpt %d offload %d: predicted %zu, measured %zu, "
                "ratio %.4f", prefetch, po.bf16, po.dropout, po.tied, (int)po.policy, po.ckpt, po.offload, r.peak_bytes,
                measured, ratio);
    cr_expect_eq(r.checkpointed, po.ckpt);
    cr_expect(ratio > 0.9 && ratio < 1.1, "predicted %zu against measured %zu: ratio %.4f", r.peak_bytes, measured, ratio);
    /* checkpointed: the estimate plays nn/checkpoint.c's release of a
     * node's inputs once its backward has run, within half a percent (when
     * it kept them to the end of the step it said 1.014 and 1.010 here) */
    if (po.ckpt)
        cr_expect(ratio > 0.995 && ratio < 1.005, "checkpointed: predicted %zu against measured %zu: ratio %.4f",
                  r.peak_bytes, measured, ratio);
    /* checkpointed blocks keep less (asked of a model whose blocks are not) */
    mo.checkpoint_blocks = true;
    ts_fsdp_memory_report rc;
    cr_assert_eq(ts_fsdp_memory_estimate(m, &mo, &rc), TS_OK);
    cr_expect(rc.checkpointed && (po.ckpt ? rc.peak_bytes == r.peak_bytes : rc.peak_bytes < r.peak_bytes),
              "checkpointed peak %zu against %zu", rc.peak_bytes, r.peak_bytes);
    ts_tensor_free(ids), ts_tensor_free(tg);
    ts_optim_free(opt);
    ts_named_params_free(&np);
    ts_module_free(m);
}

Test(fully_shard_memory_estimate, gpt_step_peak_within_10_percent, .timeout = 60) { peak_case((peak_opts){.prefetch = true}); }
Test(fully_shard_memory_estimate, gpt_step_peak_without_prefetch, .timeout = 60) { peak_case((peak_opts){.prefetch = false}); }
Test(fully_shard_memory_estimate, gpt_step_peak_bf16, .timeout = 60) { peak_case((peak_opts){.prefetch = true, .bf16 = true}); }
Test(fully_shard_memory_estimate, gpt_step_peak_dropout, .timeout = 60)
{
    peak_case((peak_opts){.prefetch = true, .dropout = 0.1}); /* attention and MLP masks, the embeddings' dropout */
}
Test(fully_shard_memory_estimate, gpt_step_peak_bf16_dropout, .timeout = 60)
{
    peak_case((peak_opts){.prefetch = true, .bf16 = true, .dropout = 0.1});
}
Test(fully_shard_memory_estimate, gpt_step_peak_tied_weights, .timeout = 60)
{
    peak_case((peak_opts){.prefetch = true, .tied = true}); /* the head's weight is the embedding's, in the root's group */
}
Test(fully_shard_memory_estimate, gpt_step_peak_checkpointed_blocks, .timeout = 60)
{
    peak_case((peak_opts){.prefetch = true, .ckpt = true}); /* ts_checkpoint_module on every block (nn/checkpoint.c) */
}
Test(fully_shard_memory_estimate, gpt_step_peak_checkpointed_bf16_dropout, .timeout = 60)
{
    peak_case((peak_opts){.prefetch = true, .ckpt = true, .bf16 = true, .dropout = 0.1});
}
Test(fully_shard_memory_estimate, gpt_step_peak_offload_pinned, .timeout = 60)
{
    peak_case((peak_opts){.prefetch = true, .offload = 1}); /* host shards and gradients in pinned, page-rounded blocks */
}
Test(fully_shard_memory_estimate, gpt_step_peak_offload_pageable, .timeout = 60)
{
    peak_case((peak_opts){.prefetch = true, .offload = 2});
}
Test(fully_shard_memory_estimate, gpt_step_peak_blocks_stay_unsharded, .timeout = 60)
{
    peak_case((peak_opts){.prefetch = true, .policy = TS_RESHARD_FALSE});
}

/* The same model not sharded yet, with world_size 1: the same prediction
 * as once it is sharded on one rank. */
Test(fully_shard_memory_estimate, unsharded_model_with_options, .timeout = 30)
{
    ts_gpt_config g = small_cfg();
    ts_module *a, *b;
    ts_manual_seed(3);
    cr_assert_eq(ts_gpt_new(&g, &a), TS_OK);
    cr_assert_eq(ts_gpt_new(&g, &b), TS_OK);
    for (int l = 0; l < g.n_layer; l++) {
        char name[32];
        ts_module *blk;
        snprintf(name, sizeof name, "blocks.%d", l);
        cr_assert_eq(ts_module_get_submodule(b, name, &blk), TS_OK);
        cr_assert_eq(ts_fully_shard(blk, NULL), TS_OK);
    }
    cr_assert_eq(ts_fully_shard(b, NULL), TS_OK);
    ts_fsdp_memory_options mo = ts_fsdp_memory_options_default();
    mo.input_ndim = 2, mo.input_shape[0] = 3, mo.input_shape[1] = 9;
    ts_fsdp_memory_report ra, rb;
    cr_assert_eq(ts_fsdp_memory_estimate(a, &mo, &ra), TS_OK, "%s", ts_last_error());
    cr_assert_eq(ts_fsdp_memory_estimate(b, &mo, &rb), TS_OK, "%s", ts_last_error());
    cr_expect_eq(ra.param_bytes, rb.param_bytes);
    cr_expect_eq(ra.optim_bytes, rb.optim_bytes);
    cr_expect_eq(ra.peak_bytes, rb.peak_bytes);
    /* 4 ranks: each holds about a quarter */
    mo.world_size = 4;
    cr_assert_eq(ts_fsdp_memory_estimate(a, &mo, &ra), TS_OK);
    cr_expect(ra.param_bytes < rb.param_bytes / 2, "4 ranks %zu, 1 rank %zu", ra.param_bytes, rb.param_bytes);
    ts_module_free(a);
    ts_module_free(b);
}

Test(fully_shard_memory_estimate, errors_name_the_problem, .timeout = 30)
{
    ts_module *lin, *gpt;
    ts_gpt_config g = small_cfg();
    cr_assert_eq(ts_linear_new(4, 4, true, &lin), TS_OK);
    cr_assert_eq(ts_gpt_new(&g, &gpt), TS_OK);
    ts_fsdp_memory_options mo = ts_fsdp_memory_options_default();
    mo.input_ndim = 2, mo.input_shape[0] = 2, mo.input_shape[1] = 4;
    ts_fsdp_memory_report r;
    memset(&r, 0x5a, sizeof r);
    ts_fsdp_memory_report before = r;
    cr_expect_eq(ts_fsdp_memory_estimate(lin, &mo, &r), TS_ERR_UNSUPPORTED);
    cr_expect(strstr(ts_last_error(), "Linear") != NULL, "%s", ts_last_error());
    cr_expect_eq(memcmp(&r, &before, sizeof r), 0, "out written on error");
    mo.input_shape[1] = 11; /* block_size 10 */
    cr_expect_eq(ts_fsdp_memory_estimate(gpt, &mo, &r), TS_ERR_SHAPE);
    cr_expect(strstr(ts_last_error(), "11") && strstr(ts_last_error(), "10"), "%s", ts_last_error());
    mo.input_ndim = 1;
    cr_expect_eq(ts_fsdp_memory_estimate(gpt, &mo, &r), TS_ERR_INVALID_ARGUMENT);
    mo.input_ndim = 2, mo.input_shape[1] = 4, mo.world_size = 0;
    cr_expect_eq(ts_fsdp_memory_estimate(gpt, &mo, &r), TS_ERR_INVALID_ARGUMENT);
    cr_expect(strstr(ts_last_error(), "world_size 0") != NULL, "%s", ts_last_error());
    cr_expect_eq(ts_fsdp_memory_estimate(NULL, &mo, &r), TS_ERR_INVALID_ARGUMENT);
    ts_module_free(lin);
    ts_module_free(gpt);
}

/* From a config alone (nothing built): the same report as from the model
 * ts_gpt_new(cfg) makes, for several ranks, bf16 and dropout. */
Test(fully_shard_memory_estimate, from_config_equals_from_model, .timeout = 30)
{
    ts_gpt_config g = small_cfg();
    g.dropout = 0.1, g.tie_weights = true;
    ts_module *m;
    cr_assert_eq(ts_gpt_new(&g, &m), TS_OK);
    ts_fsdp_memory_options mo = ts_fsdp_memory_options_default();
    mo.input_ndim = 2, mo.input_shape[0] = 3, mo.input_shape[1] = 10;
    mo.world_size = 3, mo.param_dtype = TS_BF16;
    ts_fsdp_memory_report a, b;
    cr_assert_eq(ts_fsdp_memory_estimate(m, &mo, &a), TS_OK, "%s", ts_last_error());
    cr_assert_eq(ts_fsdp_memory_estimate_gpt(&g, &mo, &b), TS_OK, "%s", ts_last_error());
    cr_expect_eq(memcmp(&a, &b, sizeof a), 0, "peak %zu vs %zu, params %zu vs %zu", a.peak_bytes, b.peak_bytes,
                 a.param_bytes, b.param_bytes);
    /* the parameter count: 2 blocks of 12 d^2 + 13 d, the tied embedding once, positions, ln_f */
    cr_expect_eq(b.n_params, 2 * (12 * 144 + 13 * 12) + 7 * 12 + 10 * 12 + 24);
    g.n_head = 5; /* 12 is not a multiple of 5 */
    cr_expect_eq(ts_fsdp_memory_estimate_gpt(&g, &mo, &b), TS_ERR_INVALID_ARGUMENT);
    cr_expect(strstr(ts_last_error(), "heads 5") != NULL, "%s", ts_last_error());
    ts_module_free(m);
}
