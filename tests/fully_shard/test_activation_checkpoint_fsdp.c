/* Activation checkpointing with fully_shard on 2 loopback ranks (threads
 * of this test, tests/loopback_ranks.h): a GPT with dropout 0.1 whose
 * blocks are checkpointed and sharded, in either order of application,
 * trains bit for bit as the same sharded GPT without checkpointing, with
 * PyTorch's collective counts. Each rank thread has its own default
 * generator (ts_generator_set_thread_default), as a rank process would. */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fully_shard/fully_shard.h"
#include "optim/optim.h"
#include "tests/loopback_ranks.h"

#define V 16
#define T 8
#define L 2

typedef enum order { NO_CKPT, CKPT_THEN_FSDP, FSDP_THEN_CKPT, ROOT_CKPT } order;

typedef struct cfg {
    order ord;
    ts_reshard_policy pol;
} cfg;

static ts_status gpt_build(ts_module **out)
{
    ts_gpt_config c = ts_gpt_config_default();
    c.vocab_size = V, c.block_size = T, c.n_layer = L, c.n_head = 2, c.d_model = 16;
    c.dropout = 0.1;
    ts_manual_seed(3); /* this thread's generator */
    return ts_gpt_new(&c, out);
}

static ts_status block_of(ts_module *m, int l, ts_module **b)
{
    char name[32];
    snprintf(name, sizeof name, "blocks.%d", l);
    return ts_module_get_submodule(m, name, b);
}

/* blocks one group each, then the root; checkpointed as `ord` says */
static ts_status shard(ts_module *m, ts_mesh *mesh, const cfg *c)
{
    ts_fsdp_options o = ts_fsdp_options_default();
    o.mesh = mesh;
    o.reshard_after_forward = c->pol;
    ts_status st = TS_OK;
    ts_module *b[L];
    for (int l = 0; l < L && !st; l++) st = block_of(m, l, &b[l]);
    for (int l = 0; l < L && !st && c->ord == CKPT_THEN_FSDP; l++) st = ts_checkpoint_module(b[l]);
    for (int l = 0; l < L && !st; l++) st = ts_fully_shard(b[l], &o);
    for (int l = 0; l < L && !st && c->ord == FSDP_THEN_CKPT; l++) st = ts_checkpoint_module(b[l]);
    if (!st) st = ts_fully_shard(m, &o);
    if (!st && c->ord == ROOT_CKPT) st = ts_checkpoint_module(m);
    return st;
}

static void tokens(int step, int rank, ts_tensor **ids, ts_tensor **tgt)
{
    int64_t sh[2] = {2, T}, s1[1] = {2 * T};
    ts_tensor_empty(TS_I64, 2, sh, ids);
    ts_tensor_empty(TS_I64, 1, s1, tgt);
    int64_t *a = ts_tensor_data(*ids), *b = ts_tensor_data(*tgt);
    for (int s = 0; s < 2; s++)
        for (int t = 0; t < T; t++) {
            int q = s + 2 * rank + 5 * step;
            a[s * T + t] = (q * 3 + t * 5) % V;
            b[s * T + t] = (q * 3 + (t + 1) * 5) % V;
        }
}

static ts_status fwd_bwd(ts_module *m, ts_tensor *ids, ts_tensor *tgt, ts_comm *g, ts_comm_counters *fwd,
                         ts_comm_counters *all, float *loss_out)
{
    ts_tensor *logits = NULL, *flat = NULL, *loss = NULL;
    int64_t sh[2] = {-1, V};
    ts_comm_stats_reset(g);
    ts_status st = ts_module_call1(m, ids, &logits);
    ts_comm_stats(g, fwd);
    if (!st) st = ts_reshape(logits, 2, sh, &flat);
    if (!st) st = ts_cross_entropy(flat, tgt, -100, TS_REDUCTION_MEAN, &loss);
    if (!st) *loss_out = *(float *)ts_tensor_data(loss);
    if (!st) st = ts_backward(loss, NULL, false);
    ts_comm_stats(g, all);
    ts_tensor_free(logits), ts_tensor_free(flat), ts_tensor_free(loss);
    return st;
}

/* Every shard's .grad of a and b: the same bits. */
static int grads_equal(th_rank *rc, ts_module *a, ts_module *b, int step)
{
    ts_named_params pa, pb;
    TH_RK_OK(rc, ts_module_named_parameters(a, &pa));
    TH_RK_OK(rc, ts_module_named_parameters(b, &pb));
    int bad = pa.n != pb.n ? th_rank_fail(rc, "%d parameters against %d", pa.n, pb.n) : 0;
    for (int i = 0; i < pa.n && !bad; i++) {
        ts_tensor *ga = ts_tensor_grad(*pa.items[i].slot), *gb = ts_tensor_grad(*pb.items[i].slot);
        if (strcmp(pa.items[i].name, pb.items[i].name) != 0)
            bad = th_rank_fail(rc, "names %s and %s", pa.items[i].name, pb.items[i].name);
        else if (!ga || !gb) bad = th_rank_fail(rc, "step %d: %s has no gradient", step, pa.items[i].name);
        else if (ts_tensor_numel(ga) != ts_tensor_numel(gb) ||
                 memcmp(ts_tensor_data(ga), ts_tensor_data(gb), (size_t)ts_tensor_numel(ga) * sizeof(float)) != 0)
            bad = th_rank_fail(rc, "step %d: %s.grad differs with checkpointing", step, pa.items[i].name);
    }
    ts_named_params_free(&pa);
    ts_named_params_free(&pb);
    return bad;
}

static ts_status sgd_of(ts_module *m, ts_optim **o)
{
    ts_param_list p;
    ts_status st = ts_module_parameters(m, &p);
    if (st) return st;
    ts_sgd_options so = ts_sgd_options_default();
    so.lr = 0.3, so.momentum = 0.9;
    st = ts_sgd_new(p.n, p.items, &so, o);
    ts_param_list_free(&p);
    return st;
}

static int rank_parity(th_rank *rc)
{
    const cfg *c = rc->arg;
    ts_generator *gen = NULL;
    TH_RK_OK(rc, ts_generator_new(1, &gen));
    ts_generator_set_thread_default(gen);
    ts_mesh *mesh = th_rank_mesh(rc, false);
    if (!mesh) return th_rank_fail(rc, "mesh: %s", ts_last_error());
    ts_module *ref = NULL, *m = NULL;
    TH_RK_OK(rc, gpt_build(&ref));
    TH_RK_OK(rc, gpt_build(&m));
    cfg plain = {NO_CKPT, c->pol};
    TH_RK_OK(rc, shard(ref, mesh, &plain));
    TH_RK_OK(rc, shard(m, mesh, c));
    ts_module *b0 = NULL;
    TH_RK_OK(rc, block_of(m, 0, &b0));
    if (c->ord != ROOT_CKPT && strcmp(ts_module_type_name(b0), "BlockCheckpointedFSDPModule") != 0)
        return th_rank_fail(rc, "blocks.0 is a %s", ts_module_type_name(b0));
    ts_optim *oref = NULL, *om = NULL;
    TH_RK_OK(rc, sgd_of(ref, &oref));
    TH_RK_OK(rc, sgd_of(m, &om));
    ts_comm *g = ts_mesh_group(mesh, NULL);
    int bad = 0;
    for (int step = 0; step < 3 && !bad; step++) {
        ts_tensor *ids, *tgt;
        tokens(step, rc->rank, &ids, &tgt);
        ts_comm_counters rf, ra, mf, ma;
        float lr = 0, lm = 0;
        ts_optim_zero_grad(oref, true);
        ts_optim_zero_grad(om, true);
        ts_manual_seed(50 + (uint64_t)(10 * step + rc->rank));
        TH_RK_OK(rc, fwd_bwd(ref, ids, tgt, g, &rf, &ra, &lr));
        ts_manual_seed(50 + (uint64_t)(10 * step + rc->rank));
        TH_RK_OK(rc, fwd_bwd(m, ids, tgt, g, &mf, &ma, &lm));
        ts_tensor_free(ids), ts_tensor_free(tgt);
        if (memcmp(&lr, &lm, sizeof lr) != 0)
            return th_rank_fail(rc, "step %d: loss %.9g without checkpointing, %.9g with", step, (double)lr,
                                (double)lm);
        if ((bad = grads_equal(rc, ref, m, step))) break;
        /* PyTorch's test_fully_shard_comm.py, TestFullyShardCommunication.
         * test_fully_shard_communication_count (a Transformer, each block
         * and the root sharded, num_blocks + 1 groups), with
         * TestFullyShardPrefetch.test_fully_shard_backward_prefetch's
         * "activation checkpointing should not affect the expected FSDP
         * events" (checkpoint_impl composable and utils): forward
         * all-gathers num_blocks + 1; backward all-gathers num_blocks + 1
         * with reshard_after_forward True, num_blocks with the default
         * (the root keeps its parameters), 0 with False; backward
         * reduce-scatters num_blocks + 1. The recompute issues none: the
         * pre-backward unshard already gathered its group. */
        uint64_t ag_b = c->pol == TS_RESHARD_TRUE ? L + 1 : c->pol == TS_RESHARD_FALSE ? 0 : L;
        if (c->ord == ROOT_CKPT) {
            /* the root's checkpoint holds the FSDP blocks: their forward
             * ran without grad (no backward hooks), the recompute gathers
             * each again, and their gradients are reduced at the end of
             * the backward: L+1 gathers in backward whatever the policy
             * of the blocks, except a never-resharded one */
            ag_b = c->pol == TS_RESHARD_FALSE ? 0 : c->pol == TS_RESHARD_TRUE ? L + 1 : L;
        }
        TH_RK_EQ(rc, mf.calls[TS_COLL_ALL_GATHER], L + 1);
        TH_RK_EQ(rc, mf.calls[TS_COLL_REDUCE_SCATTER], 0);
        TH_RK_EQ(rc, ma.calls[TS_COLL_ALL_GATHER] - mf.calls[TS_COLL_ALL_GATHER], ag_b);
        TH_RK_EQ(rc, ma.calls[TS_COLL_REDUCE_SCATTER], L + 1);
        TH_RK_EQ(rc, ma.calls[TS_COLL_ALL_GATHER], ra.calls[TS_COLL_ALL_GATHER]);
        TH_RK_EQ(rc, ma.calls[TS_COLL_REDUCE_SCATTER], ra.calls[TS_COLL_REDUCE_SCATTER]);
        TH_RK_OK(rc, ts_optim_step(oref));
        TH_RK_OK(rc, ts_optim_step(om));
    }
    ts_optim_free(oref), ts_optim_free(om);
    ts_module_free(ref), ts_module_free(m);
    ts_mesh_free(mesh);
    ts_generator_set_thread_default(NULL);
    ts_generator_free(gen);
    return bad;
}

static void run(order o, ts_reshard_policy p)
{
    cfg c = {o, p};
    th_run_world(2, rank_parity, &c, 60.0);
}

Test(fully_shard_checkpoint, checkpoint_then_shard_reshard_true, .timeout = 60)
{
    run(CKPT_THEN_FSDP, TS_RESHARD_TRUE);
}
Test(fully_shard_checkpoint, checkpoint_then_shard_reshard_false, .timeout = 60)
{
    run(CKPT_THEN_FSDP, TS_RESHARD_FALSE);
}
Test(fully_shard_checkpoint, checkpoint_then_shard_reshard_auto, .timeout = 60)
{
    run(CKPT_THEN_FSDP, TS_RESHARD_AUTO);
}
Test(fully_shard_checkpoint, shard_then_checkpoint_reshard_true, .timeout = 60)
{
    run(FSDP_THEN_CKPT, TS_RESHARD_TRUE);
}
Test(fully_shard_checkpoint, shard_then_checkpoint_reshard_false, .timeout = 60)
{
    run(FSDP_THEN_CKPT, TS_RESHARD_FALSE);
}
Test(fully_shard_checkpoint, checkpointed_root_holding_sharded_blocks, .timeout = 60)
{
    run(ROOT_CKPT, TS_RESHARD_TRUE);
}

/* Checkpointing a module that fully_shard wrapped, errors: twice is
 * TS_ERR_ALREADY in either order, and the module keeps its type. */
static int rank_errors(th_rank *rc)
{
    ts_mesh *mesh = th_rank_mesh(rc, false);
    if (!mesh) return th_rank_fail(rc, "mesh: %s", ts_last_error());
    ts_fsdp_options o = ts_fsdp_options_default();
    o.mesh = mesh;
    ts_module *lin = NULL;
    TH_RK_OK(rc, ts_linear_new(4, 4, true, &lin));
    TH_RK_OK(rc, ts_fully_shard(lin, &o));
    TH_RK_OK(rc, ts_checkpoint_module(lin));
    if (strcmp(ts_module_type_name(lin), "LinearCheckpointedFSDPModule") != 0 || !ts_module_is_fsdp(lin) ||
        !ts_module_is_checkpointed(lin))
        return th_rank_fail(rc, "type %s", ts_module_type_name(lin));
    TH_RK_EQ(rc, ts_checkpoint_module(lin), TS_ERR_ALREADY);
    if (!strstr(ts_last_error(), "already checkpointed")) return th_rank_fail(rc, "message: %s", ts_last_error());
    TH_RK_EQ(rc, ts_fully_shard(lin, &o), TS_ERR_ALREADY);
    ts_module_free(lin);
    /* the wrap policy by type finds checkpointed blocks by their own type */
    ts_generator *gen = NULL;
    TH_RK_OK(rc, ts_generator_new(1, &gen));
    ts_generator_set_thread_default(gen); /* gpt_build seeds this thread's own */
    ts_module *g = NULL, *b = NULL;
    TH_RK_OK(rc, gpt_build(&g));
    for (int l = 0; l < L; l++) {
        TH_RK_OK(rc, block_of(g, l, &b));
        TH_RK_OK(rc, ts_checkpoint_module(b));
    }
    int n = 0;
    TH_RK_OK(rc, ts_fsdp_apply_by_type(g, "Block", &o, &n));
    TH_RK_EQ(rc, n, L);
    if (strcmp(ts_module_type_name(b), "BlockCheckpointedFSDPModule") != 0)
        return th_rank_fail(rc, "blocks.%d is a %s", L - 1, ts_module_type_name(b));
    ts_module_free(g);
    ts_generator_set_thread_default(NULL);
    ts_generator_free(gen);
    ts_mesh_free(mesh);
    return 0;
}

Test(fully_shard_checkpoint, errors_after_fully_shard, .timeout = 60) { th_run_world(2, rank_errors, NULL, 60.0); }

/* ------------------------------------------------ a recompute that fails */

/* Sequential(Flaky(Linear(4, 4)), Flaky(Linear(4, 4))), the same
 * parameters on every rank */
static ts_status flaky_model(ts_module **root, th_flaky **f)
{
    ts_manual_seed(8);
    ts_module *k[2] = {0};
    ts_status st = TS_OK;
    for (int i = 0; i < 2 && !st; i++)
        if (!(st = th_flaky_new(&f[i]))) k[i] = &f[i]->base;
    if (!st) st = ts_sequential_new(2, k, root);
    if (st)
        for (int i = 0; i < 2; i++) ts_module_free(k[i]);
    return st;
}

static ts_status flaky_step(ts_module *root, ts_tensor *x, ts_tensor **loss_out)
{
    ts_tensor *y = NULL, *s = NULL;
    ts_status st = ts_module_call1(root, x, &y);
    if (!st) st = ts_sum(y, 0, NULL, false, &s);
    if (!st) st = ts_backward(s, NULL, false);
    ts_tensor_free(y);
    if (loss_out) *loss_out = s;
    else ts_tensor_free(s);
    return st;
}

/* Both modules checkpointed and sharded on 2 ranks; the recompute of the
 * first fails on every rank (after the second's gradients went to their
 * reduce-scatter): ts_backward fails naming the module, and the next
 * step works and equals the same model without checkpointing. */
static int rank_failure(th_rank *rc)
{
    ts_generator *gen = NULL;
    TH_RK_OK(rc, ts_generator_new(1, &gen));
    ts_generator_set_thread_default(gen);
    ts_mesh *mesh = th_rank_mesh(rc, false);
    if (!mesh) return th_rank_fail(rc, "mesh: %s", ts_last_error());
    ts_fsdp_options o = ts_fsdp_options_default();
    o.mesh = mesh;
    ts_module *m = NULL, *ref = NULL;
    th_flaky *f[2], *rf[2];
    TH_RK_OK(rc, flaky_model(&m, f));
    TH_RK_OK(rc, flaky_model(&ref, rf));
    for (int i = 0; i < 2; i++) {
        TH_RK_OK(rc, ts_checkpoint_module(&f[i]->base));
        TH_RK_OK(rc, ts_fully_shard(&f[i]->base, &o));
        TH_RK_OK(rc, ts_fully_shard(&rf[i]->base, &o));
    }
    TH_RK_OK(rc, ts_fully_shard(m, &o));
    TH_RK_OK(rc, ts_fully_shard(ref, &o));
    int64_t xs[2] = {3, 4};
    ts_tensor *x = NULL;
    TH_RK_OK(rc, ts_tensor_full(TS_F32, 2, xs, 0.5 + rc->rank, &x));
    f[0]->fail_at = 2; /* its recompute */
    ts_status st = flaky_step(m, x, NULL);
    if (st != TS_ERR_STATE || !strstr(ts_last_error(), "FlakyCheckpointed") ||
        !strstr(ts_last_error(), "injected failure"))
        return th_rank_fail(rc, "the failed recompute gave %s: %s", ts_status_name(st), ts_last_error());
    f[0]->fail_at = 0;
    ts_module_zero_grad(m, true);
    TH_RK_OK(rc, flaky_step(m, x, NULL));
    TH_RK_OK(rc, flaky_step(ref, x, NULL));
    int bad = grads_equal(rc, ref, m, 1);
    ts_tensor_free(x);
    ts_module_free(m), ts_module_free(ref);
    ts_mesh_free(mesh);
    ts_generator_set_thread_default(NULL);
    ts_generator_free(gen);
    return bad;
}

Test(fully_shard_checkpoint, failed_recompute_leaves_sharded_model_usable, .timeout = 60)
{
    th_run_world(2, rank_failure, NULL, 60.0);
}
