/*
 * fully_shard's copy-free collectives (comm/coll_direct.h, param_group.c)
 * against its packed path (all-gather buffer and copy-out, packed
 * reduce-scatter input), over W loopback ranks run as threads
 * (tests/loopback_ranks.h; the loopback transport lets them read each
 * other with process_vm_readv, as processes of one host do). The same
 * model is built twice on every rank, one with its groups on the copy-free
 * path and one on the packed path, and trained side by side: after every
 * backward the shard gradients, after every step the shards are equal to
 * the bit. Uneven rows (9 rows over 4 ranks, 2 rows over 3 or 4: empty
 * trailing ranks), SGD and AdamW, bf16 mixed precision (f32 or bf16
 * reduce), offload, HSDP on 2 x 2, gradient accumulation without sync and
 * into existing gradients. Each case also checks that the copy-free
 * model's collectives took the copy-free path (and, with the loopback's
 * reads turned off, the packed fallback, with the same results).
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "fully_shard/fully_shard.h"
#include "fully_shard/internal.h"
#include "optim/optim.h"
#include "tests/loopback_ranks.h"

typedef th_rank rank_ctx;
#define fail th_rank_fail
#define RK_OK TH_RK_OK

#define IN 6
#define HID 9 /* over 4 ranks: 3, 3, 3, 0 rows */
#define OUT 2 /* over 3 or 4 ranks: trailing ranks empty */
#define ROWS 12
#define NP 6

typedef struct mlp {
    ts_module *root, *lin[3];
    ts_tensor *ps[NP];
    ts_optim *opt;
} mlp;

typedef struct cf_arg {
    int steps, accum;
    bool adam, bf16, bf16_reduce, offload, hsdp, keep_grads, no_sync, expect_direct;
    bool separate; /* ts_fsdp_set_separate_reduce_scatter_group on the copy-free model */
    ts_reshard_policy policy;
} cf_arg;

static ts_status mlp_new(ts_mesh *mesh, const cf_arg *a, bool copy_free, mlp *m)
{
    memset(m, 0, sizeof *m);
    ts_status st = th_mlp3_new(5, IN, HID, HID, OUT, &m->root, m->lin);
    if (st) return st;
    ts_fsdp_options o = ts_fsdp_options_default();
    o.mesh = mesh;
    o.reshard_after_forward = a->policy;
    ts_offload_policy pol = ts_offload_policy_default();
    if (a->offload) o.offload_policy = &pol;
    ts_mp_policy mp = ts_mp_policy_default();
    mp.param_dtype = TS_BF16;
    mp.reduce_dtype = a->bf16_reduce ? TS_BF16 : TS_F32;
    mp.output_dtype = TS_F32;
    if (a->bf16) o.mp_policy = &mp;
    if ((st = ts_fully_shard_each(3, m->lin, &o)) || (st = ts_fully_shard(m->root, &o))) return st;
    for (int l = 0; l < 3; l++) ts__fsdp_state_of(m->lin[l])->group->copy_free = copy_free;
    if ((st = th_param_slots(m->root, NP, m->ps))) return st;
    if (a->adam) {
        ts_adam_options ao = ts_adamw_options_default();
        ao.lr = 0.01;
        return ts_adamw_new(NP, m->ps, &ao, &m->opt);
    }
    ts_sgd_options so = ts_sgd_options_default();
    so.lr = 0.05;
    so.momentum = 0.9;
    return ts_sgd_new(NP, m->ps, &so, &m->opt);
}

static ts_status fwd_bwd(mlp *m, ts_tensor *x, ts_tensor *y) { return th_mse_backward(m->root, x, y); }

static int same_bits(rank_ctx *rc, const char *what, int s, int i, const ts_tensor *a, const ts_tensor *b)
{
    return th_rank_same_bits(rc, a, b, "step %d %s %d", s, what, i);
}

static uint64_t n_direct(const mlp *m)
{
    uint64_t n = 0;
    for (int l = 0; l < 3; l++) n += ts__fsdp_state_of(m->lin[l])->group->n_direct;
    return n;
}

static int rank_parity(rank_ctx *rc)
{
    const cf_arg *a = rc->arg;
    ts_mesh *mesh = th_rank_mesh(rc, a->hsdp);
    if (!mesh) return fail(rc, "mesh: %s", ts_last_error());
    mlp cf, ref;
    RK_OK(rc, mlp_new(mesh, a, true, &cf));
    RK_OK(rc, mlp_new(mesh, a, false, &ref));
    if (a->separate) {
        RK_OK(rc, ts_fsdp_set_separate_reduce_scatter_group(cf.root, true));
        for (int l = 0; l < 3; l++)
            if (!ts__fsdp_state_of(cf.lin[l])->group->rsg) return fail(rc, "group %d has no reduce-scatter group", l);
    }
    int64_t rows = ROWS / rc->W;
    for (int s = 0; s < a->steps; s++) {
        for (int k = 0; k < a->accum; k++) {
            ts_tensor *x = th_batch(rc->rank * rows + k, rows, IN, th_xval),
                      *y = th_batch(rc->rank * rows + k, rows, OUT, th_yval);
            bool sync = !a->no_sync || k == a->accum - 1;
            RK_OK(rc, ts_fsdp_set_requires_gradient_sync(cf.root, sync, true));
            RK_OK(rc, ts_fsdp_set_requires_gradient_sync(ref.root, sync, true));
            RK_OK(rc, fwd_bwd(&cf, x, y));
            RK_OK(rc, fwd_bwd(&ref, x, y));
            ts_tensor_free(x);
            ts_tensor_free(y);
            for (int i = 0; i < NP; i++)
                if (same_bits(rc, "gradient", s, i, ts_tensor_grad(cf.ps[i]), ts_tensor_grad(ref.ps[i]))) return 1;
        }
        RK_OK(rc, ts_optim_step(cf.opt));
        RK_OK(rc, ts_optim_step(ref.opt));
        for (int i = 0; i < NP; i++)
            if (same_bits(rc, "parameter", s, i, cf.ps[i], ref.ps[i])) return 1;
        ts_optim_zero_grad(cf.opt, !a->keep_grads);
        ts_optim_zero_grad(ref.opt, !a->keep_grads);
    }
    /* the copy-free model's collectives took the copy-free path (each
     * Linear at least one all-gather and one reduce-scatter per step),
     * the packed one's none */
    uint64_t nd = n_direct(&cf), want = rc->W > 1 && (!a->hsdp || rc->W > 2) ? (uint64_t)(6 * a->steps) : 0;
    if (a->expect_direct ? nd < want : nd != 0)
        return fail(rc, "%llu collectives took the copy-free path (expected %s %llu)", (unsigned long long)nd,
                    a->expect_direct ? "at least" : "exactly", a->expect_direct ? (unsigned long long)want : 0ull);
    if (n_direct(&ref) != 0) return fail(rc, "the packed model took the copy-free path");
    ts_optim_free(cf.opt);
    ts_optim_free(ref.opt);
    ts_module_free(cf.root);
    ts_module_free(ref.root);
    ts_mesh_free(mesh);
    return 0;
}

static void run(int W, cf_arg a)
{
    a.expect_direct = true;
    th_run_world(W, rank_parity, &a, 60.0);
}

Test(fully_shard_copy_free, training_equals_the_packed_path_on_2_3_4_ranks, .timeout = 120)
{
    cf_arg a = {.steps = 3, .accum = 1, .policy = TS_RESHARD_AUTO};
    for (int W = 2; W <= 4; W++) run(W, a);
    a.adam = true;
    a.policy = TS_RESHARD_FALSE;
    run(3, a);
}

Test(fully_shard_copy_free, mixed_precision_equals_the_packed_path, .timeout = 120)
{
    cf_arg a = {.steps = 3, .accum = 1, .bf16 = true, .policy = TS_RESHARD_AUTO};
    run(2, a);
    run(4, a);
    a.bf16_reduce = true; /* bf16 gradients reduced in bf16 (accumulated in f32) */
    run(3, a);
}

Test(fully_shard_copy_free, offload_equals_the_packed_path, .timeout = 120)
{
    cf_arg a = {.steps = 3, .accum = 1, .offload = true, .policy = TS_RESHARD_AUTO};
    run(2, a);
    a.bf16 = true;
    run(3, a);
}

Test(fully_shard_copy_free, hsdp_2x2_equals_the_packed_path, .timeout = 120)
{
    cf_arg a = {.steps = 3, .accum = 1, .hsdp = true, .adam = true, .policy = TS_RESHARD_TRUE};
    run(4, a);
    a.bf16 = true;
    run(4, a);
}

Test(fully_shard_copy_free, accumulation_equals_the_packed_path, .timeout = 120)
{
    cf_arg a = {.steps = 2, .accum = 3, .no_sync = true, .bf16 = true, .policy = TS_RESHARD_AUTO};
    run(3, a); /* microbatches without sync: the gradient accumulates in f32 (acc) */
    a.no_sync = false;
    a.keep_grads = true; /* every reduction adds into an existing gradient */
    a.bf16 = false;
    run(4, a);
}

/* The loopback's reads turned off (as CMA refused between processes):
 * the copy-free groups fall back to the packed ring, same bits. */
Test(fully_shard_copy_free, falls_back_to_the_packed_ring_when_peers_cannot_be_read, .timeout = 120)
{
    setenv("TS_LOOPBACK_DIRECT", "0", 1);
    cf_arg a = {.steps = 3, .accum = 1, .bf16 = true, .policy = TS_RESHARD_AUTO, .expect_direct = false};
    th_run_world(3, rank_parity, &a, 60.0);
    unsetenv("TS_LOOPBACK_DIRECT");
}

/* Reductions on a group of their own (their reads and sums on a thread
 * of their own while the backward goes on): the same bits. */
Test(fully_shard_copy_free, a_separate_reduce_scatter_group_changes_no_bit, .timeout = 120)
{
    cf_arg a = {.steps = 3, .accum = 1, .separate = true, .policy = TS_RESHARD_AUTO};
    run(2, a);
    a.bf16 = true;
    a.hsdp = true;
    run(4, a);
    a.hsdp = false;
    a.no_sync = true;
    a.accum = 2;
    run(3, a);
}
