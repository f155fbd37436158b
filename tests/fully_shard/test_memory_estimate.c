/* ts_fsdp_memory_estimate (fully_shard/memory.c: a step played on the
 * meta device through the model's own code): the components against the
 * model's real tensors on 1, 2 and 4 simulated ranks (uneven chunks
 * included), the predicted peak of a GPT step and of a user-defined
 * module type's step against the measured TS_MEM_STORAGE peak, a model
 * estimated then trained giving the bits of one never estimated, a
 * deferred (meta) model's report equal to the CPU model's, hypothetical
 * sharding against real ranks, and the errors. */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "fully_shard/fully_shard.h"
#include "optim/optim.h"
#include "tensor/internal.h"
#include "tests/loopback_ranks.h"

#define EC_OK(expr) cr_assert_eq((expr), TS_OK, "%s: %s", #expr, ts_last_error())
#include "tests/fully_shard/estimate_common.h"

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

Test(fully_shard_memory_estimate, components_exact_on_1_rank, .timeout = 60)
{
    th_run_world(1, components_rank, NULL, 30.0);
}
Test(fully_shard_memory_estimate, components_exact_on_2_ranks, .timeout = 60)
{
    th_run_world(2, components_rank, NULL, 30.0);
}
Test(fully_shard_memory_estimate, components_exact_on_4_ranks_uneven, .timeout = 60)
{
    th_run_world(4, components_rank, NULL, 30.0);
}

/* The predicted peak of a GPT step (one rank, no world: fully_shard on
 * the one-rank mesh) against the measured peak of TS_MEM_STORAGE, after
 * a warm-up step as the benchmark does: equal, since the estimate plays
 * that step (the hand-kept model it replaced was within 10%). */
typedef struct peak_opts {
    bool prefetch, bf16, tied, ckpt;
    int offload; /* 0 none, 1 pinned, 2 pageable */
    double dropout;
    ts_reshard_policy policy;
    int every_n;
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
    fo.reshard_every_n = po.every_n ? po.every_n : 1;
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
    ts_optim *opt = ec_adamw(m);
    ts_tensor *ids, *tg;
    ec_inputs(true, 4, 64, 32, 0, &ids, &tg);
    size_t measured = ec_measured_peak(m, opt, ids, tg, 1);
    ts_fsdp_memory_options mo = ts_fsdp_memory_options_default();
    mo.input_ndim = 2, mo.input_shape[0] = 4, mo.input_shape[1] = 64;
    ts_fsdp_memory_report r;
    cr_assert_eq(ts_fsdp_memory_estimate(m, &mo, &r), TS_OK, "%s", ts_last_error());
    double ratio = (double)r.peak_bytes / (double)measured;
    cr_log_info("prefetch %d bf16 %d dropout %g tied %d policy %d ckpt %d offload %d: predicted %zu, measured %zu, "
                "ratio %.4f",
                prefetch, po.bf16, po.dropout, po.tied, (int)po.policy, po.ckpt, po.offload, r.peak_bytes, measured,
                ratio);
    cr_expect_eq(r.checkpointed, po.ckpt);
    /* the step itself, played on the meta device: the same bytes */
    cr_expect_eq(r.peak_bytes, measured, "predicted %zu against measured %zu: ratio %.4f", r.peak_bytes, measured,
                 ratio);
    /* checkpointed blocks keep less (asked of a model whose blocks are not) */
    mo.checkpoint_blocks = true;
    ts_fsdp_memory_report rc;
    cr_assert_eq(ts_fsdp_memory_estimate(m, &mo, &rc), TS_OK);
    cr_expect(rc.checkpointed && (po.ckpt ? rc.peak_bytes == r.peak_bytes : rc.peak_bytes < r.peak_bytes),
              "checkpointed peak %zu against %zu", rc.peak_bytes, r.peak_bytes);
    ts_tensor_free(ids), ts_tensor_free(tg);
    ts_optim_free(opt);
    ts_module_free(m);
}

Test(fully_shard_memory_estimate, gpt_step_peak_exact, .timeout = 60) { peak_case((peak_opts){.prefetch = true}); }
Test(fully_shard_memory_estimate, gpt_step_peak_without_prefetch, .timeout = 60)
{
    peak_case((peak_opts){.prefetch = false});
}
Test(fully_shard_memory_estimate, gpt_step_peak_bf16, .timeout = 60)
{
    peak_case((peak_opts){.prefetch = true, .bf16 = true});
}
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
    peak_case(
        (peak_opts){.prefetch = true, .tied = true}); /* the head's weight is the embedding's, in the root's group */
}
Test(fully_shard_memory_estimate, gpt_step_peak_checkpointed_blocks, .timeout = 60)
{
    peak_case((peak_opts){.prefetch = true,
                          .ckpt = true}); /* ts_checkpoint_module on every block (nn/activation_checkpoint.c) */
}
Test(fully_shard_memory_estimate, gpt_step_peak_checkpointed_bf16_dropout, .timeout = 60)
{
    peak_case((peak_opts){.prefetch = true, .ckpt = true, .bf16 = true, .dropout = 0.1});
}
Test(fully_shard_memory_estimate, gpt_step_peak_offload_pinned, .timeout = 60)
{
    peak_case(
        (peak_opts){.prefetch = true, .offload = 1}); /* host shards and gradients in pinned, page-rounded blocks */
}
Test(fully_shard_memory_estimate, gpt_step_peak_offload_pageable, .timeout = 60)
{
    peak_case((peak_opts){.prefetch = true, .offload = 2});
}
Test(fully_shard_memory_estimate, gpt_step_peak_blocks_stay_unsharded, .timeout = 60)
{
    peak_case((peak_opts){.prefetch = true, .policy = TS_RESHARD_FALSE});
}
Test(fully_shard_memory_estimate, gpt_step_peak_reshard_every_2, .timeout = 60)
{
    peak_case((peak_opts){.prefetch = true, .policy = TS_RESHARD_EVERY_N, .every_n = 2});
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
    /* any module: a Linear is estimated (it was TS_ERR_UNSUPPORTED) */
    cr_expect_eq(ts_fsdp_memory_estimate(lin, &mo, &r), TS_OK, "%s", ts_last_error());
    cr_expect_eq(r.n_params, 20);
    cr_expect_eq(r.param_bytes, pb(64) + pb(16));
    /* the model's own error for an input it refuses, unchanged */
    memset(&r, 0x5a, sizeof r);
    mo.input_shape[1] = 5;
    cr_expect_eq(ts_fsdp_memory_estimate(lin, &mo, &r), TS_ERR_SHAPE);
    cr_expect_eq(memcmp(&r, &before, sizeof r), 0, "out written on error");
    /* a model not sharded, with a sharding described: not a GPT, so it cannot be rebuilt */
    mo.input_shape[1] = 4, mo.world_size = 2;
    cr_expect_eq(ts_fsdp_memory_estimate(lin, &mo, &r), TS_ERR_UNSUPPORTED);
    cr_expect(strstr(ts_last_error(), "Linear") && strstr(ts_last_error(), "ts_fsdp_memory_estimate_build"), "%s",
              ts_last_error());
    mo.world_size = 1;
    mo.input_shape[1] = 11; /* block_size 10 */
    cr_expect_eq(ts_fsdp_memory_estimate(gpt, &mo, &r), TS_ERR_SHAPE);
    cr_expect(strstr(ts_last_error(), "11") && strstr(ts_last_error(), "10"), "%s", ts_last_error());
    mo.input_ndim = 1;
    cr_expect_eq(ts_fsdp_memory_estimate(gpt, &mo, &r), TS_ERR_INVALID_ARGUMENT);
    mo.input_ndim = 2, mo.input_shape[1] = 4, mo.world_size = 0;
    cr_expect_eq(ts_fsdp_memory_estimate(gpt, &mo, &r), TS_ERR_INVALID_ARGUMENT);
    cr_expect(strstr(ts_last_error(), "world_size 0") != NULL, "%s", ts_last_error());
    cr_expect_eq(ts_fsdp_memory_estimate(NULL, &mo, &r), TS_ERR_INVALID_ARGUMENT);
    mo.world_size = 129;
    cr_expect_eq(ts_fsdp_memory_estimate_gpt(&g, &mo, &r), TS_ERR_UNSUPPORTED);
    cr_expect(strstr(ts_last_error(), "129") != NULL, "%s", ts_last_error());
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

/* ------------------------------------------------------------ a user-defined module type */

/* The distinct storages of the tensors, summed once each (pool blocks). */
static size_t storages(int n, ts_tensor *const *t)
{
    const ts_storage *seen[256];
    int ns = 0;
    size_t b = 0;
    for (int i = 0; i < n; i++) {
        const ts_storage *s = t[i] ? ts_tensor_storage(t[i]) : NULL;
        if (!s) continue;
        int k = 0;
        while (k < ns && seen[k] != s) k++;
        if (k < ns) continue;
        cr_assert(ns < 256);
        seen[ns++] = s;
        b += s->block_bytes;
    }
    return b;
}

typedef struct user_case {
    ec_shard_opts so;
    int microbatches;
    bool ask_ckpt; /* estimate with checkpoint_blocks on a model whose blocks are not; measure it checkpointed */
} user_case;

/* GatedMLP blocks (estimate_common.h), each sharded, the root the rest:
 * the estimate's peak is the measured storage peak of the same step, to
 * the byte, and its parameter, gradient and optimizer bytes are the
 * model's tensors'. */
static void user_exact(const char *name, user_case uc)
{
    ts_module *m = ec_user_model(true, &uc.so);
    ts_fsdp_memory_options mo = ec_user_options();
    mo.microbatches = uc.microbatches;
    mo.checkpoint_blocks = uc.ask_ckpt;
    ts_fsdp_memory_report r;
    cr_assert_eq(ts_fsdp_memory_estimate(m, &mo, &r), TS_OK, "%s: %s", name, ts_last_error());
    if (uc.ask_ckpt) { /* the truth: the same model with its blocks checkpointed */
        ts_module_free(m);
        ec_shard_opts so = uc.so;
        so.ckpt = true;
        m = ec_user_model(true, &so);
    }
    ts_optim *opt = ec_adamw(m);
    ts_tensor *x, *tg;
    ec_inputs(false, EC_ROWS, EC_IN, EC_CLASSES, 0, &x, &tg);
    size_t measured = ec_measured_peak(m, opt, x, tg, uc.microbatches);
    cr_log_info("%s: predicted %zu measured %zu", name, r.peak_bytes, measured);
    printf("estimate user %-28s predicted %8zu measured %8zu\n", name, r.peak_bytes, measured);
    cr_expect_eq(r.peak_bytes, measured, "%s: predicted %zu, measured %zu", name, r.peak_bytes, measured);
    cr_expect_eq(r.checkpointed, uc.so.ckpt || uc.ask_ckpt);
    /* the components, from the tensors */
    ts_param_list pl;
    EC_OK(ts_module_parameters(m, &pl));
    cr_expect_eq(r.param_bytes, storages(pl.n, pl.items), "%s: param bytes", name);
    ts_tensor *logits, *flat, *loss;
    EC_OK(ts_module_call1(m, x, &logits));
    int64_t fs[2] = {EC_ROWS, EC_CLASSES};
    EC_OK(ts_reshape(logits, 2, fs, &flat));
    EC_OK(ts_cross_entropy(flat, tg, -100, TS_REDUCTION_MEAN, &loss));
    EC_OK(ts_backward(loss, NULL, false));
    ts_tensor *grads[64], *state[192];
    cr_assert(pl.n <= 64);
    for (int i = 0; i < pl.n; i++) grads[i] = ts_tensor_grad(pl.items[i]);
    cr_expect_eq(r.grad_bytes, storages(pl.n, grads), "%s: grad bytes", name);
    for (int i = 0; i < pl.n; i++) {
        state[3 * i] = ts_optim_state(opt, i, "exp_avg");
        state[3 * i + 1] = ts_optim_state(opt, i, "exp_avg_sq");
        state[3 * i + 2] = ts_optim_state(opt, i, "step");
    }
    cr_expect_eq(r.optim_bytes, storages(3 * pl.n, state), "%s: optimizer bytes", name);
    cr_expect_eq(r.n_blocks, EC_BLOCKS);
    cr_expect_eq(r.n_params,
                 (int64_t)EC_IN * EC_D + EC_D + EC_BLOCKS * 3 * EC_D * EC_H + EC_D * EC_CLASSES + EC_CLASSES);
    cr_expect(r.block_act_bytes > r.block_act_ckpt_bytes && r.act_ckpt_bytes < r.act_bytes,
              "%s: block %zu (ckpt %zu), all %zu (ckpt %zu)", name, r.block_act_bytes, r.block_act_ckpt_bytes,
              r.act_bytes, r.act_ckpt_bytes);
    ts_tensor_free(logits), ts_tensor_free(flat), ts_tensor_free(loss);
    ts_param_list_free(&pl);
    ts_tensor_free(x), ts_tensor_free(tg);
    ts_optim_free(opt);
    ts_module_free(m);
}

Test(fully_shard_memory_estimate, user_module_exact, .timeout = 60)
{
    user_exact("f32", (user_case){.so = {.prefetch = true}});
}
Test(fully_shard_memory_estimate, user_module_exact_no_prefetch, .timeout = 60)
{
    user_exact("no prefetch", (user_case){.so = {.prefetch = false}});
}
Test(fully_shard_memory_estimate, user_module_exact_bf16, .timeout = 60)
{
    user_exact("bf16", (user_case){.so = {.prefetch = true, .bf16 = true}});
}
Test(fully_shard_memory_estimate, user_module_exact_checkpointed, .timeout = 60)
{
    user_exact("checkpointed", (user_case){.so = {.prefetch = true, .ckpt = true}});
}
Test(fully_shard_memory_estimate, user_module_exact_checkpoint_blocks_asked, .timeout = 60)
{
    user_exact("checkpoint_blocks", (user_case){.so = {.prefetch = true}, .ask_ckpt = true});
}
Test(fully_shard_memory_estimate, user_module_exact_reshard_every_2, .timeout = 60)
{
    user_exact("reshard every 2", (user_case){.so = {.prefetch = true, .policy = TS_RESHARD_EVERY_N, .every_n = 2}});
}
Test(fully_shard_memory_estimate, user_module_exact_no_sync_microbatches, .timeout = 60)
{
    user_exact("3 microbatches", (user_case){.so = {.prefetch = true}, .microbatches = 3});
}
Test(fully_shard_memory_estimate, user_module_exact_explicit_prefetch, .timeout = 60)
{
    user_exact("explicit prefetch", (user_case){.so = {.prefetch = false, .explicit_pf = true}});
}

/* Not sharded: the model as it is (no groups), its step measured. */
Test(fully_shard_memory_estimate, user_module_unsharded_exact, .timeout = 60)
{
    ts_module *m = ec_user_model(false, NULL);
    ts_fsdp_memory_options mo = ec_user_options();
    ts_fsdp_memory_report r;
    cr_assert_eq(ts_fsdp_memory_estimate(m, &mo, &r), TS_OK, "%s", ts_last_error());
    ts_optim *opt = ec_adamw(m);
    ts_tensor *x, *tg;
    ec_inputs(false, EC_ROWS, EC_IN, EC_CLASSES, 0, &x, &tg);
    size_t measured = ec_measured_peak(m, opt, x, tg, 1);
    cr_expect_eq(r.peak_bytes, measured, "predicted %zu, measured %zu", r.peak_bytes, measured);
    cr_expect_eq(r.n_blocks, 0);
    cr_expect_eq(r.act_bytes, r.act_ckpt_bytes);
    ts_tensor_free(x), ts_tensor_free(tg);
    ts_optim_free(opt);
    ts_module_free(m);
}

/* The full state (every parameter's bits) after training. */
static void weights_equal(ts_module *a, ts_module *b, const char *what)
{
    ts_state_dict *sa, *sb;
    EC_OK(ts_fsdp_full_state_dict(a, false, &sa));
    EC_OK(ts_fsdp_full_state_dict(b, false, &sb));
    int n = ts_state_dict_size(sa);
    cr_assert_eq(n, ts_state_dict_size(sb));
    for (int i = 0; i < n; i++) {
        const char *k = ts_state_dict_name(sa, i);
        ts_tensor *ta = ts_state_dict_tensor(sa, i), *tb = ts_state_dict_get(sb, k);
        cr_assert(ta && tb, "%s: %s", what, k);
        size_t nb = (size_t)ts_tensor_numel(ta) * ts_dtype_size(ts_tensor_dtype(ta));
        cr_expect_eq(memcmp(ts_tensor_data(ta), ts_tensor_data(tb), nb), 0, "%s: %s differs", what, k);
    }
    ts_state_dict_free(sa);
    ts_state_dict_free(sb);
}

/* Estimating changes nothing: a model estimated (every option: checkpoint
 * asked, microbatches, SGD), holding gradients at the time, then trained,
 * gives the losses and weights of one never estimated, bit for bit; the
 * gradients it held are the same tensors after. */
Test(fully_shard_memory_estimate, estimate_then_train_is_bitwise_train, .timeout = 60)
{
    ec_shard_opts so = {.prefetch = true, .policy = TS_RESHARD_EVERY_N, .every_n = 2};
    ts_module *a = ec_user_model(true, &so), *b = ec_user_model(true, &so);
    ts_optim *oa = ec_adamw(a), *ob = ec_adamw(b);
    ts_tensor *x, *tg;
    ec_inputs(false, EC_ROWS, EC_IN, EC_CLASSES, 3, &x, &tg);
    double la = ec_step(a, oa, x, tg, 1), lb = ec_step(b, ob, x, tg, 1);
    cr_expect_eq(memcmp(&la, &lb, sizeof la), 0);
    /* a holds gradients (a backward without zero_grad) when estimated */
    ts_tensor *logits, *flat, *loss;
    EC_OK(ts_module_call1(a, x, &logits));
    int64_t fs[2] = {EC_ROWS, EC_CLASSES};
    EC_OK(ts_reshape(logits, 2, fs, &flat));
    EC_OK(ts_cross_entropy(flat, tg, -100, TS_REDUCTION_MEAN, &loss));
    EC_OK(ts_backward(loss, NULL, false));
    ts_tensor_free(logits), ts_tensor_free(flat), ts_tensor_free(loss);
    ts_param_list pl;
    EC_OK(ts_module_parameters(a, &pl));
    ts_tensor *held_grads[64];
    for (int i = 0; i < pl.n; i++) held_grads[i] = ts_tensor_grad(pl.items[i]);
    static uint8_t rng_before[TS_GENERATOR_STATE_BYTES], rng_after[TS_GENERATOR_STATE_BYTES];
    ts_fsdp_memory_options mo = ec_user_options();
    ts_fsdp_memory_report r;
    for (int k = 0; k < 4; k++) {
        mo.checkpoint_blocks = k == 1, mo.microbatches = k == 2 ? 2 : 1;
        mo.optim = k == 3 ? TS_FSDP_OPTIM_SGD_MOMENTUM : TS_FSDP_OPTIM_ADAM;
        ts_generator_get_state(NULL, rng_before);
        cr_assert_eq(ts_fsdp_memory_estimate(a, &mo, &r), TS_OK, "%s", ts_last_error());
        ts_generator_get_state(NULL, rng_after);
        cr_expect_eq(memcmp(rng_before, rng_after, TS_GENERATOR_STATE_BYTES), 0, "the generator advanced");
    }
    for (int i = 0; i < pl.n; i++) {
        cr_expect_eq(ts_tensor_grad(pl.items[i]), held_grads[i], "gradient %d not put back", i);
        cr_expect(!ts__is_meta(pl.items[i]));
        ts_tensor_zero_grad(pl.items[i], true);
    }
    ts_param_list_free(&pl);
    for (int s = 0; s < 3; s++) {
        la = ec_step(a, oa, x, tg, s == 1 ? 2 : 1);
        lb = ec_step(b, ob, x, tg, s == 1 ? 2 : 1);
        cr_expect_eq(memcmp(&la, &lb, sizeof la), 0, "step %d: loss %.9g, never estimated %.9g", s, la, lb);
    }
    weights_equal(a, b, "after training");
    ts_tensor_free(x), ts_tensor_free(tg);
    ts_optim_free(oa), ts_optim_free(ob);
    ts_module_free(a), ts_module_free(b);
}

/* A model built on the meta device and sharded (deferred, not
 * materialized) gives the report of the same model built on the CPU;
 * materialized, the same again. */
/* The estimate reads and writes no generator of its caller's: another
 * thread drawing from the process-wide generator all through an estimate
 * that plays checkpointed blocks (whose recomputes save and restore the
 * generator) ends where the same number of draws from the same seed ends.
 * A save and restore of the shared generator would undo the other
 * thread's draws, or read it half-advanced (an invalid state). */
typedef struct drawer {
    atomic_bool stop;
    atomic_bool started; /* set after the first draw */
    uint64_t draws;
} drawer;

static void *draw_until_stopped(void *arg)
{
    drawer *d = arg;
    while (!atomic_load(&d->stop)) {
        (void)ts_generator_random(NULL);
        d->draws++;
        atomic_store(&d->started, true);
    }
    return NULL;
}

Test(fully_shard_memory_estimate, leaves_other_threads_generator_alone, .timeout = 60)
{
    ts_generator *mine;
    cr_assert_eq(ts_generator_new(11, &mine), TS_OK);
    ts_generator *prev = ts_generator_set_thread_default(mine); /* this thread builds on its own */
    ts_module *m = ec_user_model(true, NULL);
    ts_fsdp_memory_options mo = ec_user_options();
    ts_fsdp_memory_report r;
    ts_generator_set_thread_default(NULL); /* now the process-wide one, which the drawer uses */
    ts_manual_seed(99);
    drawer d = {.draws = 0};
    atomic_init(&d.stop, false);
    atomic_init(&d.started, false);
    pthread_t t;
    cr_assert_eq(pthread_create(&t, NULL, draw_until_stopped, &d), 0);
    while (!atomic_load(&d.started)) sched_yield(); /* drawing before the first estimate, even on a loaded machine */
    ts_status st = TS_OK;
    for (int k = 0; k < 4 && !st; k++) {
        mo.checkpoint_blocks = k % 2 == 0;
        st = ts_fsdp_memory_estimate(m, &mo, &r);
    }
    atomic_store(&d.stop, true);
    pthread_join(t, NULL);
    cr_assert_eq(st, TS_OK, "%s", ts_last_error());
    ts_generator *ref;
    cr_assert_eq(ts_generator_new(99, &ref), TS_OK);
    for (uint64_t i = 0; i < d.draws; i++) (void)ts_generator_random(ref);
    cr_log_info("the other thread drew %llu numbers during 4 estimates", (unsigned long long)d.draws);
    cr_expect(d.draws > 0);
    cr_expect_eq(ts_generator_random(NULL), ts_generator_random(ref),
                 "the process-wide generator lost or gained draws");
    ts_generator_set_thread_default(prev);
    ts_generator_free(ref), ts_generator_free(mine);
    ts_module_free(m);
}

Test(fully_shard_memory_estimate, meta_model_same_report_as_cpu, .timeout = 60)
{
    ec_shard_opts so = {.prefetch = true};
    for (int eager = 0; eager < 2; eager++) {
        ts_fsdp_memory_options mo = ec_user_options();
        mo.eager_init = eager;
        ts_module *cpu = ec_user_model(true, &so);
        EC_OK(ts_device_scope_enter(TS_DEVICE_META));
        ts_module *meta = ec_user_model(true, &so);
        EC_OK(ts_device_scope_exit());
        ts_param_list pl;
        EC_OK(ts_module_parameters(meta, &pl));
        cr_assert(ts__is_meta(pl.items[0]));
        ts_param_list_free(&pl);
        ts_fsdp_memory_report rc, rm, rmat;
        cr_assert_eq(ts_fsdp_memory_estimate(cpu, &mo, &rc), TS_OK, "%s", ts_last_error());
        cr_assert_eq(ts_fsdp_memory_estimate(meta, &mo, &rm), TS_OK, "%s", ts_last_error());
        cr_expect_eq(memcmp(&rc, &rm, sizeof rc), 0, "eager %d: peak %zu / %zu, params %zu / %zu, pool %zu / %zu",
                     eager, rc.peak_bytes, rm.peak_bytes, rc.param_bytes, rm.param_bytes, rc.pool_peak_bytes,
                     rm.pool_peak_bytes);
        EC_OK(ts_fsdp_materialize(meta));
        cr_assert_eq(ts_fsdp_memory_estimate(meta, &mo, &rmat), TS_OK, "%s", ts_last_error());
        cr_expect_eq(memcmp(&rc, &rmat, sizeof rc), 0, "materialized: peak %zu / %zu", rmat.peak_bytes, rc.peak_bytes);
        weights_equal(cpu, meta, "materialized after an estimate");
        ts_module_free(cpu), ts_module_free(meta);
    }
}

/* Hypothetical sharding (a virtual world of W ranks, one process) gives
 * rank 0's report of the model really sharded over W loopback ranks. */
typedef struct hyp_arg {
    ts_fsdp_memory_report virt;
} hyp_arg;

static ts_status build_user(void *ctx, ts_mesh *mesh, ts_module **out)
{
    (void)ctx;
    ec_shard_opts so = {.mesh = mesh, .prefetch = true};
    *out = ec_user_model(true, &so);
    return TS_OK;
}

static int hyp_rank(th_rank *rc)
{
    hyp_arg *h = rc->arg;
    ts_mesh *mesh = th_rank_mesh(rc, false);
    if (!mesh) return th_rank_fail(rc, "mesh: %s", ts_last_error());
    ec_shard_opts so = {.mesh = mesh, .prefetch = true};
    pthread_mutex_lock(&g_build_mu);
    ts_module *m = ec_user_model(true, &so);
    pthread_mutex_unlock(&g_build_mu);
    ts_fsdp_memory_options mo = ec_user_options();
    ts_fsdp_memory_report r;
    TH_RK_OK(rc, ts_fsdp_memory_estimate(m, &mo, &r));
    if (rc->rank == 0 && memcmp(&r, &h->virt, sizeof r))
        return th_rank_fail(rc, "real ranks: peak %zu params %zu grads %zu pool %zu; virtual: %zu %zu %zu %zu",
                            r.peak_bytes, r.param_bytes, r.grad_bytes, r.pool_peak_bytes, h->virt.peak_bytes,
                            h->virt.param_bytes, h->virt.grad_bytes, h->virt.pool_peak_bytes);
    ts_module_free(m);
    ts_mesh_free(mesh);
    return 0;
}

Test(fully_shard_memory_estimate, hypothetical_sharding_equals_real_ranks, .timeout = 60)
{
    for (int W = 2; W <= 3; W++) {
        hyp_arg h;
        ts_fsdp_memory_options mo = ec_user_options();
        mo.world_size = W;
        cr_assert_eq(ts_fsdp_memory_estimate_build(build_user, NULL, &mo, &h.virt), TS_OK, "%s", ts_last_error());
        th_run_world(W, hyp_rank, &h, 30.0);
    }
    /* the GPT from its config on 3 ranks: the same as the GPT really sharded, block by block, on 3 ranks */
    ts_fsdp_memory_options mo = ts_fsdp_memory_options_default();
    mo.input_ndim = 2, mo.input_shape[0] = 2, mo.input_shape[1] = 8, mo.world_size = 3;
    ts_fsdp_memory_report g3, g1;
    ts_gpt_config g = small_cfg();
    cr_assert_eq(ts_fsdp_memory_estimate_gpt(&g, &mo, &g3), TS_OK, "%s", ts_last_error());
    mo.world_size = 1;
    cr_assert_eq(ts_fsdp_memory_estimate_gpt(&g, &mo, &g1), TS_OK, "%s", ts_last_error());
    cr_expect(g3.param_bytes < g1.param_bytes / 2 && g3.peak_bytes < g1.peak_bytes,
              "3 ranks %zu / %zu, 1 rank %zu / %zu", g3.param_bytes, g3.peak_bytes, g1.param_bytes, g1.peak_bytes);
}

/* The virtual world moves no data: a collective a build function
 * attempts on it (here a 2-d HSDP mesh, whose groups need an agreement)
 * fails at once with TS_ERR_UNSUPPORTED naming it, and the estimate
 * returns that; no hang. */
static ts_status build_hsdp(void *ctx, ts_mesh *mesh, ts_module **out)
{
    (void)ctx, (void)out;
    int64_t shape[2] = {2, 2};
    const char *names[2] = {"replicate", "shard"};
    ts_mesh *m2 = NULL;
    ts_status st = ts_mesh_new(ts_mesh_group(mesh, "dp"), "cpu", 2, shape, names, &m2);
    ts_mesh_free(m2);
    return st ? st : TS_ERR_INTERNAL;
}

Test(fully_shard_memory_estimate, virtual_world_refuses_collectives, .timeout = 30)
{
    ts_fsdp_memory_options mo = ec_user_options();
    mo.world_size = 4;
    ts_fsdp_memory_report r;
    cr_expect_eq(ts_fsdp_memory_estimate_build(build_hsdp, NULL, &mo, &r), TS_ERR_UNSUPPORTED);
    cr_expect(strstr(ts_last_error(), "virtual communicator") != NULL, "%s", ts_last_error());
}
