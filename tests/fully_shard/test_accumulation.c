/*
 * Gradient accumulation and the microbatching controls (fully_shard.h:
 * ts_fsdp_set_requires_gradient_sync, _requires_all_reduce,
 * _reshard_after_backward, _is_last_backward, _gradient_divide_factor,
 * _force_sum_reduction_for_comms), over W loopback ranks run as threads
 * (tests/loopback_ranks.h). Ported from PyTorch's
 * test/distributed/_composable/fsdp/test_fully_shard_training.py:
 * TestFullyShardGradientAccumulation.test_gradient_accumulation (the model
 * Sequential(Linear, MLP x 3), each MLP and then the root sharded, 3
 * microbatches; modes all / root_only / some_mlps, reshard_after_backward,
 * reduce_scatter_only for HSDP, 1-d and 2-d meshes of 4 ranks, and its
 * exact all-gather / reduce-scatter / all-reduce count formulas) and
 * test_set_reduce_scatter_divide_factor. PyTorch compares against a DDP
 * model fed the same microbatches; here the reference is the same sharded
 * model trained on one batch of K times the size (the brief's invariant:
 * K microbatches equal one batch of K microbatches' rows).
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "fully_shard/fully_shard.h"
#include "optim/optim.h"
#include "tests/loopback_ranks.h"

typedef th_rank rank_ctx;
#define fail th_rank_fail
#define RK_OK TH_RK_OK
#define RK_EQ TH_RK_EQ

static pthread_mutex_t g_build_mu = PTHREAD_MUTEX_INITIALIZER;
static void run_world(int W, th_rank_fn fn, void *arg) { th_run_world(W, fn, arg, 60.0); }

#define D 6    /* the model's width: Linear(D, D), then MLPs D -> H -> D */
#define H 10   /* 10 rows over 4 ranks: uneven shards (3, 3, 3, 1) */
#define NMLP 3 /* FSDP2's num_mlps */
#define NP 14  /* parameters: (1 + 2 * NMLP) Linear layers, weight and bias */

typedef enum mode {
    MODE_SYNC,      /* no flag: every microbatch reduce-scatters into the sharded gradients */
    MODE_ALL,       /* FSDP2's "all": no sync (or no all-reduce) on the whole model but the last microbatch */
    MODE_ROOT_ONLY, /* "root_only": only the root's own group, recurse false */
    MODE_SOME_MLPS, /* "some_mlps": the first two MLPs */
} mode;

typedef struct acc_arg {
    int K, B;  /* microbatches per step, rows per microbatch and rank */
    int iters; /* optimizer steps */
    mode mode;
    bool hsdp;             /* a (2, W/2) mesh */
    bool rs_only;          /* HSDP: set_requires_all_reduce instead of set_requires_gradient_sync */
    bool rab;              /* FSDP2's reshard_after_backward: false sets it to is_last on the flagged modules */
    ts_reshard_policy raf; /* reshard_after_forward of every call (AUTO: FSDP2's True, the root stays) */
    bool bf16;             /* mixed precision: bf16 compute, f32 reduce */
    bool bf16_reduce;      /* mixed precision: f32 compute, bf16 reduce (narrower than the parameters) */
    bool f16_reduce;       /* mixed precision: f32 compute, f16 reduce */
    bool offload;          /* CPU offload policy */
    bool ckpt;             /* every MLP checkpointed (ts_checkpoint_module) before it is sharded */
    bool counts;           /* check FSDP2's collective count formulas */
    double rtol, atol;     /* shard gradients and parameters against the one-batch reference */
    /* a second accumulation run whose gradients must match the first's
     * (mode2 instead of mode; rtol2/atol2) */
    bool vs_mode;
    mode mode2;
    double rtol2, atol2;
} acc_arg;

typedef struct model {
    ts_module *root;
    ts_module *mlp[NMLP];
    ts_tensor *ps[NP];
    ts_optim *opt;
} model;

/* Sequential(Linear(D, D), MLP, MLP, MLP), MLP = Sequential(Linear(D, H),
 * Tanh, Linear(H, D)); each MLP sharded, then the root (which takes the
 * first Linear), as FSDP2's test. SGD with momentum. */
static ts_status model_new(ts_mesh *mesh, const acc_arg *a, model *m)
{
    memset(m, 0, sizeof *m);
    pthread_mutex_lock(&g_build_mu);
    ts_manual_seed(7);
    ts_module *c[1 + NMLP] = {0};
    ts_status st = ts_linear_new(D, D, true, &c[0]);
    for (int i = 0; i < NMLP && !st; i++) {
        ts_module *l[3] = {0};
        st = ts_linear_new(D, H, true, &l[0]);
        if (!st) st = ts_tanh_new(&l[1]);
        if (!st) st = ts_linear_new(H, D, true, &l[2]);
        if (!st) st = ts_sequential_new(3, l, &c[1 + i]);
    }
    if (!st) st = ts_sequential_new(1 + NMLP, c, &m->root);
    pthread_mutex_unlock(&g_build_mu);
    if (st) return st;
    for (int i = 0; i < NMLP; i++) m->mlp[i] = c[1 + i];
    for (int i = 0; i < NMLP && a->ckpt && !st; i++) st = ts_checkpoint_module(m->mlp[i]);
    if (st) return st;
    ts_fsdp_options o = ts_fsdp_options_default();
    o.mesh = mesh;
    o.reshard_after_forward = a->raf;
    ts_mp_policy mp = ts_mp_policy_default();
    mp.param_dtype = TS_BF16;
    mp.reduce_dtype = TS_F32;
    mp.output_dtype = TS_F32;
    if (a->bf16) o.mp_policy = &mp;
    ts_mp_policy narrow = ts_mp_policy_default();
    narrow.reduce_dtype = TS_BF16;
    if (a->bf16_reduce) o.mp_policy = &narrow;
    ts_mp_policy half = ts_mp_policy_default();
    half.reduce_dtype = TS_F16;
    if (a->f16_reduce) o.mp_policy = &half;
    ts_offload_policy off = ts_offload_policy_default();
    if (a->offload) o.offload_policy = &off;
    if ((st = ts_fully_shard_each(NMLP, m->mlp, &o)) || (st = ts_fully_shard(m->root, &o))) return st;
    if ((st = th_param_slots(m->root, NP, m->ps))) return st;
    ts_sgd_options so = ts_sgd_options_default();
    so.lr = 0.05;
    so.momentum = 0.9;
    return ts_sgd_new(NP, m->ps, &so, &m->opt);
}

static void model_free(model *m)
{
    ts_optim_free(m->opt);
    ts_module_free(m->root);
}

/* Forward and backward of rows [row0, row0 + rows) on this rank, the
 * loss being their mean squared error times scale. */
static ts_status fwd_bwd(model *m, int64_t row0, int64_t rows, double scale)
{
    ts_tensor *x = th_batch(row0, rows, D, th_xval), *y = th_batch(row0, rows, D, th_yval);
    ts_tensor *o = NULL, *loss = NULL, *sl = NULL;
    ts_status st = x && y ? TS_OK : TS_ERR_NO_MEMORY;
    if (!st) st = ts_module_call1(m->root, x, &o);
    if (!st) st = ts_mse_loss(o, y, TS_REDUCTION_MEAN, &loss);
    if (!st) st = ts_mul_scalar(loss, scale, &sl);
    if (!st) st = ts_backward(sl, NULL, false);
    ts_tensor_free(x);
    ts_tensor_free(y);
    ts_tensor_free(o);
    ts_tensor_free(loss);
    ts_tensor_free(sl);
    return st;
}

/* FSDP2's set_backward_flags for one microbatch. */
static ts_status set_flags(model *m, const acc_arg *a, mode md, bool last)
{
    ts_status st = TS_OK;
    ts_status (*sync)(ts_module *, bool, bool) =
        a->rs_only ? ts_fsdp_set_requires_all_reduce : ts_fsdp_set_requires_gradient_sync;
    switch (md) {
    case MODE_SYNC: break;
    case MODE_ALL:
        st = sync(m->root, last, true);
        if (!st && !a->rab) st = ts_fsdp_set_reshard_after_backward(m->root, last, true);
        break;
    case MODE_SOME_MLPS:
        for (int i = 0; i < 2 && !st; i++) {
            st = sync(m->mlp[i], last, true);
            if (!st && !a->rab) st = ts_fsdp_set_reshard_after_backward(m->mlp[i], last, true);
        }
        break;
    case MODE_ROOT_ONLY:
        st = sync(m->root, last, false);
        if (!st && !a->rab) st = ts_fsdp_set_reshard_after_backward(m->root, last, false);
        break;
    }
    return st;
}

/* FSDP2's expected counts for one step of K microbatches. */
static void expected_counts(const acc_arg *a, mode md, int64_t *ag, int64_t *rs, int64_t *ar)
{
    int K = a->K;
    int64_t r = NMLP + 1;
    if (md == MODE_SYNC) r = (int64_t)(NMLP + 1) * K;
    else if (md == MODE_SOME_MLPS) r += (int64_t)(NMLP - 2 + 1) * (K - 1);
    else if (md == MODE_ROOT_ONLY) r += (int64_t)NMLP * (K - 1);
    int64_t x = a->hsdp ? r : 0;
    if (a->rs_only) r = (int64_t)(NMLP + 1) * K;
    *rs = r;
    *ar = x;
    int64_t g = NMLP + 1;
    if (a->raf != TS_RESHARD_FALSE) {
        g += NMLP; /* the MLPs again in backward; the root stays unsharded after forward */
        g *= K;
    } else if (a->rab || md == MODE_SYNC) {
        g *= K;
    } else if (md == MODE_ALL) {
        /* reshards only after the last microbatch's backward: nothing more */
    } else if (md == MODE_ROOT_ONLY) {
        g += (int64_t)NMLP * (K - 1);
    }
    *ag = g;
}

static int close_to(rank_ctx *rc, const char *what, int it, int i, const ts_tensor *a, const ts_tensor *b, double rtol,
                    double atol)
{
    if (!a || !b) {
        if (a != b) return fail(rc, "iteration %d, %s %d: only one of the two exists", it, what, i);
        return 0;
    }
    int64_t n = ts_tensor_numel(a);
    if (n != ts_tensor_numel(b))
        return fail(rc, "%s %d: %lld vs %lld elements", what, i, (long long)n, (long long)ts_tensor_numel(b));
    const float *pa = ts_tensor_data(a), *pb = ts_tensor_data(b);
    for (int64_t k = 0; k < n; k++)
        if (!(fabs((double)pa[k] - (double)pb[k]) <= atol + rtol * fabs((double)pa[k])))
            return fail(rc, "iteration %d, %s %d[%lld]: %.9g (reference) vs %.9g (rtol %g, atol %g)", it, what, i,
                        (long long)k, pa[k], pb[k], rtol, atol);
    return 0;
}

/* One step: the reference's one batch of K * B rows, then the K
 * microbatches of B rows of m (scaled 1/K); rank r's rows of microbatch k
 * are rows [k * B, (k + 1) * B) of the reference's rows on that rank. */
static int accumulate(rank_ctx *rc, const acc_arg *a, model *m, mode md, ts_mesh *mesh, int it)
{
    int64_t base = ((int64_t)it * rc->W + rc->rank) * a->K * a->B;
    ts_comm *pg = ts_mesh_group(mesh, a->hsdp ? "shard" : NULL),
            *rg = a->hsdp ? ts_mesh_group(mesh, "replicate") : NULL;
    ts_comm_stats_reset(pg);
    if (rg) ts_comm_stats_reset(rg);
    for (int k = 0; k < a->K; k++) {
        RK_OK(rc, set_flags(m, a, md, k == a->K - 1));
        RK_OK(rc, fwd_bwd(m, base + (int64_t)k * a->B, a->B, 1.0 / a->K));
    }
    if (a->counts) {
        ts_comm_counters cp, cr = {0};
        ts_comm_stats(pg, &cp);
        if (rg) ts_comm_stats(rg, &cr);
        int64_t ag, rs, ar;
        expected_counts(a, md, &ag, &rs, &ar);
        RK_EQ(rc, cp.calls[TS_COLL_ALL_GATHER], ag);
        RK_EQ(rc, cp.calls[TS_COLL_REDUCE_SCATTER], rs);
        RK_EQ(rc, cr.calls[TS_COLL_ALL_REDUCE] + cp.calls[TS_COLL_ALL_REDUCE], ar);
    }
    return 0;
}

static int rank_accum(rank_ctx *rc)
{
    const acc_arg *a = rc->arg;
    ts_mesh *mesh = th_rank_mesh(rc, a->hsdp);
    if (!mesh) return fail(rc, "mesh: %s", ts_last_error());
    model ref, m, m2;
    RK_OK(rc, model_new(mesh, a, &ref));
    RK_OK(rc, model_new(mesh, a, &m));
    acc_arg a2 = *a;
    a2.ckpt = false; /* the second run is never checkpointed: checkpointing changes no bit */
    if (a->vs_mode) RK_OK(rc, model_new(mesh, &a2, &m2));
    for (int it = 0; it < a->iters; it++) {
        int64_t base = ((int64_t)it * rc->W + rc->rank) * a->K * a->B;
        RK_OK(rc, fwd_bwd(&ref, base, (int64_t)a->K * a->B, 1.0));
        if (accumulate(rc, a, &m, a->mode, mesh, it)) return 1;
        if (a->vs_mode && accumulate(rc, a, &m2, a->mode2, mesh, it)) return 1;
        for (int i = 0; i < NP; i++) {
            if (!ts_tensor_grad(m.ps[i])) return fail(rc, "iteration %d: parameter %d has no gradient", it, i);
            if (close_to(rc, "gradient", it, i, ts_tensor_grad(ref.ps[i]), ts_tensor_grad(m.ps[i]), a->rtol, a->atol))
                return 1;
            if (a->vs_mode &&
                close_to(rc, "gradient (other mode)", it, i, ts_tensor_grad(m2.ps[i]), ts_tensor_grad(m.ps[i]),
                         a->rtol2, a->atol2))
                return 1;
        }
        RK_OK(rc, ts_optim_step(ref.opt));
        RK_OK(rc, ts_optim_step(m.opt));
        for (int i = 0; i < NP; i++)
            if (close_to(rc, "parameter", it, i, ref.ps[i], m.ps[i], a->rtol, a->atol)) return 1;
        /* alternately dropped and zeroed: accumulation with and without
         * an existing sharded gradient (FSDP2's set_to_none=(iter % 2)) */
        ts_optim_zero_grad(ref.opt, it % 2);
        ts_optim_zero_grad(m.opt, it % 2);
        if (a->vs_mode) {
            RK_OK(rc, ts_optim_step(m2.opt));
            ts_optim_zero_grad(m2.opt, it % 2);
        }
    }
    model_free(&ref);
    model_free(&m);
    if (a->vs_mode) model_free(&m2);
    ts_mesh_free(mesh);
    return 0;
}

/* Tolerance of the f32 runs against the one-batch reference: a shard
 * gradient element is (1/(K B W)) times a sum of K B W <= 48 per-row
 * terms; the reference sums them in one pass per rank, the microbatch
 * runs in K partial sums (each rounded, and scaled by 1/K) added
 * afterwards, before or after the reduction. Reordering a sum of N terms
 * changes it by at most about N * 2^-24 * sum|terms|; here the terms are
 * around 1e-3 and partly cancel to gradients around 1e-4 (sum|terms| /
 * |sum| up to about 10), so the bound is 48 * 6e-8 * 10 = 3e-5 relative.
 * The forward activations are the same row by row in both runs (the
 * GEMM's reduction over the inner dimension does not depend on the number
 * of rows). Measured: at most 1.7e-6 relative (rtol 1e-7 fails on
 * 9.10300878e-05 vs 9.1029935e-05). rtol 3e-5, with atol 1e-8 for
 * elements near zero; a lost or doubled microbatch changes gradients by
 * 25% or more (K = 4) and fails it. */
#define F32_RTOL 3e-5
#define F32_ATOL 1e-8

static acc_arg f32_arg(int K, mode md)
{
    acc_arg a = {.K = K,
                 .B = 3,
                 .iters = 2,
                 .mode = md,
                 .rab = true,
                 .raf = TS_RESHARD_AUTO,
                 .rtol = F32_RTOL,
                 .atol = F32_ATOL};
    return a;
}

/* K = 1, 2, 4 microbatches in each mode equal one batch of K * B rows, on
 * 2 and 4 ranks and a 2 x 2 HSDP mesh. */
Test(fully_shard_accumulation, k_microbatches_equal_one_batch_w2)
{
    int ks[3] = {1, 2, 4};
    for (int i = 0; i < 3; i++)
        for (int md = MODE_SYNC; md <= MODE_ALL; md++) {
            acc_arg a = f32_arg(ks[i], (mode)md);
            run_world(2, rank_accum, &a);
        }
}

Test(fully_shard_accumulation, k_microbatches_equal_one_batch_w4)
{
    int ks[3] = {1, 2, 4};
    for (int i = 0; i < 3; i++)
        for (int md = MODE_SYNC; md <= MODE_ALL; md++) {
            acc_arg a = f32_arg(ks[i], (mode)md);
            run_world(4, rank_accum, &a);
        }
}

Test(fully_shard_accumulation, k_microbatches_equal_one_batch_hsdp)
{
    int ks[3] = {1, 2, 4};
    for (int i = 0; i < 3; i++)
        for (int v = 0; v < 3; v++) { /* sync every microbatch, no sync, reduce-scatter without all-reduce */
            acc_arg a = f32_arg(ks[i], v == 0 ? MODE_SYNC : MODE_ALL);
            a.hsdp = true;
            a.rs_only = v == 2;
            run_world(4, rank_accum, &a);
        }
}

/* FSDP2's test_gradient_accumulation: per mesh (4 ranks, 2 x 2),
 * reshard_after_forward, mode, reshard_after_backward and (HSDP)
 * reduce_scatter_only, the exact counts of all-gathers, reduce-scatters
 * and all-reduces of each step of 3 microbatches of 2 rows, and parity with
 * the one-batch reference, over 2 steps. */
Test(fully_shard_accumulation, fsdp2_collective_counts, .timeout = 120)
{
    ts_reshard_policy rafs[2] = {TS_RESHARD_AUTO, TS_RESHARD_FALSE};
    for (int hsdp = 0; hsdp < 2; hsdp++)
        for (int r = 0; r < 2; r++)
            for (int md = MODE_ALL; md <= MODE_SOME_MLPS; md++)
                for (int rab = 0; rab < 2; rab++)
                    for (int rso = 0; rso < 2; rso++) {
                        /* FSDP2's skips: not common or not applicable */
                        if ((!rab && (rafs[r] != TS_RESHARD_FALSE || md == MODE_SOME_MLPS)) || (!hsdp && rso)) continue;
                        acc_arg a = f32_arg(3, (mode)md);
                        a.B = 2;
                        a.hsdp = hsdp;
                        a.raf = rafs[r];
                        a.rab = rab;
                        a.rs_only = rso;
                        a.counts = true;
                        run_world(4, rank_accum, &a);
                    }
    /* and sync every microbatch, which FSDP2 does not list: K reductions */
    for (int hsdp = 0; hsdp < 2; hsdp++) {
        acc_arg a = f32_arg(3, MODE_SYNC);
        a.hsdp = hsdp;
        a.counts = true;
        run_world(4, rank_accum, &a);
    }
}

/* Under a mixed-precision policy (bf16 compute, f32 reduce) the no-sync
 * gradients are summed in f32: they then equal the sync-every-microbatch
 * gradients, which add the f32 reductions of the same bf16 gradients, to
 * f32 rounding (sums of K exact bf16 values in another order: rtol 1e-5,
 * atol 1e-9 for elements near zero), whereas summing them in bf16 is off
 * by bf16's 2^-8 = 4e-3 relative (measured: 6e-3 on one element when the
 * accumulation is left in bf16). Against the f32 one-batch reference,
 * computed in bf16 too but on other batch shapes, each per-row term
 * (around 1e-3) carries bf16 rounding of 2^-8, so gradients (around 1e-4,
 * partly cancelling) differ by up to a few 1e-6 absolute (measured 2.1e-6
 * on an element of 6.9e-6): rtol 3e-2, atol 1e-5. One step: after it,
 * parameters that differ by f32 rounding may round to different bf16
 * values. */
Test(fully_shard_accumulation, no_sync_accumulates_in_reduce_dtype)
{
    for (int W = 2; W <= 4; W += 2) {
        acc_arg a = f32_arg(4, MODE_ALL);
        a.iters = 1;
        a.bf16 = true;
        a.rtol = 3e-2, a.atol = 1e-5;
        a.vs_mode = true;
        a.mode2 = MODE_SYNC;
        a.rtol2 = 1e-5, a.atol2 = 1e-9;
        run_world(W, rank_accum, &a);
    }
}

/* A reduce dtype narrower than the parameters' (f32 shards, bf16
 * reduce-scatter) on 4 ranks, where H = 10 rows leave padding: the
 * reduce-scatter input is in bf16 elements, and its padding rows must be
 * zeroed at bf16 offsets (they were zeroed at f32 offsets, past the end of
 * the buffer for the last ranks' blocks). No sync accumulates in bf16 here
 * (the reduce dtype, as FSDP2), sync every microbatch in f32 after each
 * bf16 reduction; the one-batch reference reduces in bf16 too. Each
 * rank's gradient (terms up to about 1e-3) is rounded to bf16 (2^-8
 * relative) before a sum over ranks that partly cancels, and no sync adds
 * K more bf16 roundings: differences of a few 1e-5 absolute (measured
 * 4.6e-5 on an element of 6.9e-4): atol 1e-4, rtol 3e-2. A lost
 * microbatch moves the largest gradients (about 1e-3) by more. */
Test(fully_shard_accumulation, narrow_reduce_dtype_with_padding)
{
    for (int md = MODE_SYNC; md <= MODE_ALL; md++) {
        acc_arg a = f32_arg(2, (mode)md);
        a.iters = 1;
        a.bf16_reduce = true;
        a.rtol = 3e-2, a.atol = 1e-4;
        run_world(4, rank_accum, &a);
    }
}

/* With CPU offload both modes accumulate the same (host shard gradients). */
Test(fully_shard_accumulation, offload)
{
    for (int md = MODE_SYNC; md <= MODE_ALL; md++) {
        acc_arg a = f32_arg(2, (mode)md);
        a.offload = true;
        run_world(2, rank_accum, &a);
        a.hsdp = true;
        a.rs_only = md == MODE_ALL;
        run_world(4, rank_accum, &a);
    }
}

/* ------------------------------------------------------------------ */
/* Divide factors and force-sum                                        */
/* ------------------------------------------------------------------ */

typedef struct div_arg {
    bool hsdp;
    double factor; /* 0: none */
    bool force_sum;
    double rtol, atol;
} div_arg;

/* The gradients with the factor (or force-sum) times factor / N equal the
 * default (averaged) ones: FSDP2's test_set_reduce_scatter_divide_factor
 * (sum over all ranks / f, on a 1-d and a 2 x 2 mesh). */
static int rank_divide(rank_ctx *rc)
{
    const div_arg *d = rc->arg;
    ts_mesh *mesh = th_rank_mesh(rc, d->hsdp);
    if (!mesh) return fail(rc, "mesh: %s", ts_last_error());
    acc_arg a = f32_arg(1, MODE_SYNC);
    a.hsdp = d->hsdp;
    model ref, m;
    RK_OK(rc, model_new(mesh, &a, &ref));
    RK_OK(rc, model_new(mesh, &a, &m));
    ts_module *mods[1 + NMLP] = {m.root, m.mlp[0], m.mlp[1], m.mlp[2]};
    for (int i = 0; i < 1 + NMLP; i++) { /* not recursive: each module's own group */
        if (d->factor > 0) RK_OK(rc, ts_fsdp_set_gradient_divide_factor(mods[i], d->factor));
        RK_OK(rc, ts_fsdp_set_force_sum_reduction_for_comms(mods[i], d->force_sum));
    }
    int64_t base = (int64_t)rc->rank * 3;
    RK_OK(rc, fwd_bwd(&ref, base, 3, 1.0));
    RK_OK(rc, fwd_bwd(&m, base, 3, 1.0));
    double scale = d->factor > 0 ? d->factor / rc->W : 1.0; /* the average is the sum / W */
    for (int i = 0; i < NP; i++) {
        ts_tensor *gr = ts_tensor_grad(m.ps[i]), *sc = NULL;
        if (!gr) return fail(rc, "parameter %d has no gradient", i);
        RK_OK(rc, ts_mul_scalar(gr, scale, &sc));
        int bad = close_to(rc, "gradient", 0, i, ts_tensor_grad(ref.ps[i]), sc, d->rtol, d->atol);
        ts_tensor_free(sc);
        if (bad) return 1;
    }
    model_free(&ref);
    model_free(&m);
    ts_mesh_free(mesh);
    return 0;
}

/* Factor 1 sums, factor 2 on 4 ranks gives twice the average, factor W
 * (the shard group's size under HSDP: AVG then SUM) the average times the
 * replicate size; force-sum, with and without a factor. The sums differ
 * from the averages only by the rounding of a division by W (exact for W
 * a power of two) and of the summation order: rtol 1e-6, atol 1e-7. */
Test(fully_shard_accumulation, divide_factor_and_force_sum)
{
    double factors[4] = {0, 1, 2, 7};
    for (int hsdp = 0; hsdp < 2; hsdp++)
        for (int f = 0; f < 4; f++)
            for (int fs = 0; fs < 2; fs++) {
                div_arg d = {.hsdp = hsdp, .factor = factors[f], .force_sum = fs, .rtol = 1e-6, .atol = 1e-7};
                if (factors[f] == 7) d.rtol = 1e-5; /* 1/7 is inexact: one more rounding per input */
                run_world(4, rank_divide, &d);
            }
    div_arg d = {.factor = 2, .rtol = 1e-6, .atol = 1e-7}; /* factor == the shard group's size */
    run_world(2, rank_divide, &d);
}

/* FSDP2 splits a float16 reduction's division (about sqrt(W) before the
 * sum, the rest after) because NCCL sums in float16; our collectives sum
 * float16 in float32 (ts__acc_dtype) and divide before rounding back, so
 * AVG cannot overflow where the average fits: gradients whose average is
 * 2e4 (the loss scaled so), where a float16 sum of 4 ranks (8e4) would be
 * infinite, come out finite. The values are then the float32 reduction's
 * to float16 rounding: each rank's gradient rounded (2^-11 relative),
 * summed with partial cancellation: a few units of float16's spacing at
 * 2e4 (16): atol 1e2, rtol 1e-2. */
static int rank_f16_overflow(rank_ctx *rc)
{
    ts_mesh *mesh = th_rank_mesh(rc, false);
    if (!mesh) return fail(rc, "mesh: %s", ts_last_error());
    acc_arg a = f32_arg(1, MODE_SYNC), h = a;
    h.f16_reduce = true;
    model ref, m;
    RK_OK(rc, model_new(mesh, &a, &ref));
    RK_OK(rc, model_new(mesh, &h, &m));
    int64_t base = (int64_t)rc->rank * 3;
    RK_OK(rc, fwd_bwd(&ref, base, 3, 1.0));
    double mx = 0;
    for (int i = 0; i < NP; i++) {
        const float *g = ts_tensor_data(ts_tensor_grad(ref.ps[i]));
        for (int64_t k = 0; k < ts_tensor_numel(ref.ps[i]); k++) mx = fmax(mx, fabs((double)g[k]));
    }
    int64_t one = 1;
    ts_tensor *t = NULL;
    RK_OK(rc, ts_tensor_full(TS_F64, 1, &one, mx, &t));
    RK_OK(rc, ts_all_reduce(rc->c, t, TS_REDUCE_MAX, NULL));
    mx = *(double *)ts_tensor_data(t);
    ts_tensor_free(t);
    double scale = 2e4 / mx;
    ts_optim_zero_grad(ref.opt, true);
    RK_OK(rc, fwd_bwd(&ref, base, 3, scale));
    RK_OK(rc, fwd_bwd(&m, base, 3, scale));
    for (int i = 0; i < NP; i++) {
        const float *g = ts_tensor_data(ts_tensor_grad(m.ps[i]));
        for (int64_t k = 0; k < ts_tensor_numel(m.ps[i]); k++)
            if (!isfinite(g[k]))
                return fail(rc, "gradient %d[%lld] is %g after the float16 reduction", i, (long long)k, g[k]);
        if (close_to(rc, "gradient", 0, i, ts_tensor_grad(ref.ps[i]), ts_tensor_grad(m.ps[i]), 1e-2, 1e2)) return 1;
    }
    model_free(&ref);
    model_free(&m);
    ts_mesh_free(mesh);
    return 0;
}

Test(fully_shard_accumulation, f16_reduce_does_not_overflow) { run_world(4, rank_f16_overflow, NULL); }

/* ------------------------------------------------------------------ */
/* reshard_after_backward, is_last_backward, errors, summary           */
/* ------------------------------------------------------------------ */

/* reshard_after_forward false and reshard_after_backward false: the first
 * forward all-gathers each group once and no later microbatch
 * all-gathers; reshard_after_backward back to true on the last microbatch
 * leaves everything sharded after it. */
static int rank_no_regather(rank_ctx *rc)
{
    ts_mesh *mesh = th_rank_mesh(rc, false);
    if (!mesh) return fail(rc, "mesh: %s", ts_last_error());
    acc_arg a = f32_arg(4, MODE_ALL);
    a.raf = TS_RESHARD_FALSE;
    model m;
    RK_OK(rc, model_new(mesh, &a, &m));
    ts_comm *pg = ts_mesh_group(mesh, NULL);
    ts_comm_stats_reset(pg);
    for (int k = 0; k < 4; k++) {
        RK_OK(rc, ts_fsdp_set_reshard_after_backward(m.root, k == 3, true));
        RK_OK(rc, fwd_bwd(&m, k * 2, 2, 0.25));
        ts_comm_counters c;
        ts_comm_stats(pg, &c);
        RK_EQ(rc, c.calls[TS_COLL_ALL_GATHER], 1 + NMLP); /* the first forward's only */
        RK_EQ(rc, c.calls[TS_COLL_REDUCE_SCATTER], (int64_t)(1 + NMLP) * (k + 1));
        ts_named_params np; /* the slots hold the full parameters until the last backward */
        RK_OK(rc, ts_module_named_parameters(m.root, &np));
        int sharded = 0;
        for (int i = 0; i < np.n; i++) sharded += ts_tensor_is_shard(*np.items[i].slot);
        ts_named_params_free(&np);
        RK_EQ(rc, sharded, k == 3 ? NP : 0);
    }
    model_free(&m);
    ts_mesh_free(mesh);
    return 0;
}

Test(fully_shard_accumulation, reshard_after_backward_false_no_regather)
{
    run_world(2, rank_no_regather, NULL);
    run_world(4, rank_no_regather, NULL);
}

/* is_last_backward false: the end of the backward leaves the last
 * reduction in flight (the root's: issued last, by the end-of-backward
 * callback), so the root's own parameters have no gradient yet; the next
 * (last) backward applies both, and the result equals two microbatches
 * with the default. */
static int rank_not_last(rank_ctx *rc)
{
    ts_mesh *mesh = th_rank_mesh(rc, false);
    if (!mesh) return fail(rc, "mesh: %s", ts_last_error());
    acc_arg a = f32_arg(2, MODE_SYNC);
    model ref, m;
    RK_OK(rc, model_new(mesh, &a, &ref));
    RK_OK(rc, model_new(mesh, &a, &m));
    int64_t base = (int64_t)rc->rank * 4;
    RK_OK(rc, fwd_bwd(&ref, base, 4, 1.0));
    RK_OK(rc, ts_fsdp_set_is_last_backward(m.root, false));
    RK_OK(rc, fwd_bwd(&m, base, 2, 0.5));
    /* ps[0], ps[1]: the root's Linear (its group is reduced last) */
    for (int i = 0; i < 2; i++)
        if (ts_tensor_grad(m.ps[i])) return fail(rc, "parameter %d got its gradient before the last backward", i);
    for (int i = 2; i < NP; i++)
        if (!ts_tensor_grad(m.ps[i])) return fail(rc, "parameter %d has no gradient after the backward", i);
    char buf[8192];
    size_t len = 0;
    RK_OK(rc, ts_fsdp_summary_str(m.root, buf, sizeof buf, &len));
    if (!strstr(buf, "gradient sync off on 0 of 4 groups; 0 B of unreduced gradients held") ||
        !strstr(buf, "; 1 reduction in flight (is_last_backward false"))
        return fail(rc, "the summary with a reduction in flight:\n%s", buf);
    RK_OK(rc, ts_fsdp_set_is_last_backward(m.root, true));
    RK_OK(rc, fwd_bwd(&m, base + 2, 2, 0.5));
    for (int i = 0; i < NP; i++)
        if (close_to(rc, "gradient", 0, i, ts_tensor_grad(ref.ps[i]), ts_tensor_grad(m.ps[i]), F32_RTOL, F32_ATOL))
            return 1;
    model_free(&ref);
    model_free(&m);
    ts_mesh_free(mesh);
    return 0;
}

/* FSDP2's test_1f1b_microbatching, simplified: reshard_after_forward
 * false; microbatch 0 forward, microbatch 1 forward, then both backwards,
 * the first with sync off and is_last_backward false, the second the last
 * (and reshard_after_backward false until it): the gradients equal one
 * batch of both microbatches' rows, and after the last backward every
 * parameter is sharded again. */
static int rank_two_forwards(rank_ctx *rc)
{
    ts_mesh *mesh = th_rank_mesh(rc, false);
    if (!mesh) return fail(rc, "mesh: %s", ts_last_error());
    acc_arg a = f32_arg(2, MODE_SYNC);
    a.raf = TS_RESHARD_FALSE;
    model ref, m;
    RK_OK(rc, model_new(mesh, &a, &ref));
    RK_OK(rc, model_new(mesh, &a, &m));
    int64_t base = (int64_t)rc->rank * 4;
    RK_OK(rc, fwd_bwd(&ref, base, 4, 1.0));
    ts_tensor *loss[2] = {0};
    for (int k = 0; k < 2; k++) {
        ts_tensor *x = th_batch(base + 2 * k, 2, D, th_xval), *y = th_batch(base + 2 * k, 2, D, th_yval), *o = NULL,
                  *l = NULL;
        RK_OK(rc, ts_module_call1(m.root, x, &o));
        RK_OK(rc, ts_mse_loss(o, y, TS_REDUCTION_MEAN, &l));
        RK_OK(rc, ts_mul_scalar(l, 0.5, &loss[k]));
        ts_tensor_free(x);
        ts_tensor_free(y);
        ts_tensor_free(o);
        ts_tensor_free(l);
    }
    for (int k = 0; k < 2; k++) {
        RK_OK(rc, ts_fsdp_set_requires_gradient_sync(m.root, k == 1, true));
        RK_OK(rc, ts_fsdp_set_is_last_backward(m.root, k == 1));
        RK_OK(rc, ts_fsdp_set_reshard_after_backward(m.root, k == 1, true));
        RK_OK(rc, ts_backward(loss[k], NULL, false));
        ts_tensor_free(loss[k]);
    }
    for (int i = 0; i < NP; i++)
        if (close_to(rc, "gradient", 0, i, ts_tensor_grad(ref.ps[i]), ts_tensor_grad(m.ps[i]), F32_RTOL, F32_ATOL))
            return 1;
    ts_named_params np;
    RK_OK(rc, ts_module_named_parameters(m.root, &np));
    int sharded = 0;
    for (int i = 0; i < np.n; i++) sharded += ts_tensor_is_shard(*np.items[i].slot);
    ts_named_params_free(&np);
    RK_EQ(rc, sharded, NP);
    model_free(&ref);
    model_free(&m);
    ts_mesh_free(mesh);
    return 0;
}

Test(fully_shard_accumulation, two_forwards_then_two_backwards) { run_world(2, rank_two_forwards, NULL); }

Test(fully_shard_accumulation, is_last_backward_false_keeps_pending) { run_world(2, rank_not_last, NULL); }

Test(fully_shard_accumulation, errors)
{
    ts_module *lin = NULL, *plain = NULL;
    TH_OK(ts_linear_new(4, 4, true, &lin));
    TH_OK(ts_linear_new(4, 4, true, &plain));
    TH_OK(ts_fully_shard(lin, NULL));
    cr_assert_eq(ts_fsdp_set_requires_gradient_sync(plain, false, true), TS_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(ts_last_error(), "Linear") && strstr(ts_last_error(), "not an FSDP module"), "%s",
              ts_last_error());
    cr_assert_eq(ts_fsdp_set_requires_all_reduce(NULL, false, true), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_fsdp_set_reshard_after_backward(plain, false, false), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_fsdp_set_is_last_backward(plain, false), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_fsdp_set_force_sum_reduction_for_comms(plain, true), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_fsdp_set_gradient_divide_factor(plain, 2.0), TS_ERR_INVALID_ARGUMENT);
    double bad[4] = {0.0, -1.0, NAN, INFINITY};
    for (int i = 0; i < 4; i++) {
        cr_assert_eq(ts_fsdp_set_gradient_divide_factor(lin, bad[i]), TS_ERR_INVALID_ARGUMENT, "factor %g", bad[i]);
        cr_assert(strstr(ts_last_error(), "factor"), "%s", ts_last_error());
    }
    /* accepted on a 1-d mesh: changes nothing */
    TH_OK(ts_fsdp_set_requires_all_reduce(lin, false, true));
    ts_fsdp_accum_memory am;
    cr_assert_eq(ts_fsdp_accumulation_memory(NULL, &am), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_fsdp_accumulation_memory(lin, NULL), TS_ERR_INVALID_ARGUMENT);
    ts_module_free(lin);
    ts_module_free(plain);
}

/* The memory each mode costs, as ts_fsdp_accumulation_memory and the
 * summary report it, on 4 ranks and 2 x 2: sync = this rank's padded
 * shard elements * 4 bytes (the gradients are views of one buffer per
 * group in the shard layout), no sync = every full gradient * 4 bytes (bf16 compute
 * with an f32 reduce: still 4, the reduce dtype), partial = the padded
 * shard * 4 bytes under HSDP only. */
static int rank_memory(rank_ctx *rc)
{
    const acc_arg *a = rc->arg;
    ts_mesh *mesh = th_rank_mesh(rc, a->hsdp);
    if (!mesh) return fail(rc, "mesh: %s", ts_last_error());
    model m;
    RK_OK(rc, model_new(mesh, a, &m));
    ts_fsdp_accum_memory am;
    RK_OK(rc, ts_fsdp_accumulation_memory(m.root, &am));
    int64_t full = 0, local = 0, padded = 0;
    ts_module *mods[1 + NMLP] = {m.root, m.mlp[0], m.mlp[1], m.mlp[2]};
    for (int i = 0; i < 1 + NMLP; i++) {
        ts_fsdp_group_info gi;
        RK_OK(rc, ts_fsdp_group_info_get(mods[i], &gi));
        full += gi.numel;
        local += gi.local_numel;
        padded += gi.shard_numel;
    }
    RK_EQ(rc, full, (D * D + D) + NMLP * (D * H + H + H * D + D));
    RK_EQ(rc, am.sync_bytes, padded * 4);
    if (local > padded)
        return fail(rc, "%lld real shard elements, more than the %lld padded", (long long)local, (long long)padded);
    RK_EQ(rc, am.no_sync_bytes, full * 4);
    RK_EQ(rc, am.partial_bytes, a->hsdp ? padded * 4 : 0);
    char buf[8192];
    size_t len = 0;
    RK_OK(rc, ts_fsdp_summary_str(m.root, buf, sizeof buf, &len));
    char want[160];
    double nb = (double)(full * 4); /* as the summary writes sizes */
    if (nb < 1024) snprintf(want, sizeof want, "no sync +%.0f B more", nb);
    else snprintf(want, sizeof want, "no sync +%.1f KiB more", nb / 1024);
    if (!strstr(buf, "gradient accumulation per rank: sync every microbatch") || !strstr(buf, want))
        return fail(rc, "the summary lacks '%s':\n%s", want, buf);
    if (a->hsdp != (strstr(buf, "HSDP without all-reduce") != NULL))
        return fail(rc, "the summary's HSDP partial line (hsdp %d):\n%s", a->hsdp, buf);
    model_free(&m);
    ts_mesh_free(mesh);
    return 0;
}

Test(fully_shard_accumulation, memory_figures)
{
    acc_arg a = f32_arg(1, MODE_SYNC);
    run_world(4, rank_memory, &a);
    a.hsdp = true;
    a.bf16 = true;
    run_world(4, rank_memory, &a);
}

/* ------------------------------------------------------------------ */
/* A user's sequences of calls                                         */
/* ------------------------------------------------------------------ */

/* Checkpointed MLPs (the recompute inside the backward) accumulate as the
 * plain ones, in both modes, with bf16 compute and with offload. */
Test(fully_shard_accumulation, checkpointed_blocks)
{
    for (int md = MODE_SYNC; md <= MODE_ALL; md++) {
        acc_arg a = f32_arg(2, (mode)md);
        a.ckpt = true;
        run_world(2, rank_accum, &a);
        a.offload = true;
        run_world(2, rank_accum, &a);
        a.offload = false;
        /* bf16 compute: loosely against the one-batch reference (2
         * microbatches of bf16 rounding), bit for bit against the same
         * run without checkpointing */
        a.bf16 = true;
        a.iters = 1;
        a.rtol = 1, a.atol = 1e-4;
        a.vs_mode = true, a.mode2 = (mode)md, a.rtol2 = 0, a.atol2 = 0;
        run_world(2, rank_accum, &a);
    }
}

typedef struct seq_arg {
    bool bf16, offload;
    bool set_to_none; /* the zero_grad between the two microbatches */
} seq_arg;

/* FSDP2: a backward with set_requires_gradient_sync(false) reduces
 * nothing and leaves the sharded gradients as they were (none here), so an
 * optimizer step then changes nothing; the unsharded gradients it kept are
 * not the optimizer's (it holds the shards), so zero_grad does not drop
 * them, and the next synced backward reduces both microbatches. */
static int rank_step_between(rank_ctx *rc)
{
    const seq_arg *sa = rc->arg;
    ts_mesh *mesh = th_rank_mesh(rc, false);
    if (!mesh) return fail(rc, "mesh: %s", ts_last_error());
    acc_arg a = f32_arg(2, MODE_ALL);
    a.bf16 = sa->bf16, a.offload = sa->offload;
    /* bf16 compute: against the reference only loosely (2 microbatches of
     * bf16 rounding, see no_sync_accumulates_in_reduce_dtype); exactly
     * against m2 */
    double rtol = sa->bf16 ? 1 : F32_RTOL, atol = sa->bf16 ? 1e-4 : F32_ATOL;
    model ref, m, m2;
    RK_OK(rc, model_new(mesh, &a, &ref));
    RK_OK(rc, model_new(mesh, &a, &m));
    RK_OK(rc, model_new(mesh, &a, &m2));
    int64_t base = (int64_t)rc->rank * 4;
    RK_OK(rc, fwd_bwd(&ref, base, 4, 1.0));
    /* m2: the same two microbatches without the step and zero_grad between */
    RK_OK(rc, ts_fsdp_set_requires_gradient_sync(m2.root, false, true));
    RK_OK(rc, fwd_bwd(&m2, base, 2, 0.5));
    RK_OK(rc, ts_fsdp_set_requires_gradient_sync(m2.root, true, true));
    RK_OK(rc, fwd_bwd(&m2, base + 2, 2, 0.5));
    RK_OK(rc, ts_fsdp_set_requires_gradient_sync(m.root, false, true));
    RK_OK(rc, fwd_bwd(&m, base, 2, 0.5));
    float before[NP][64];
    for (int i = 0; i < NP; i++) {
        if (ts_tensor_grad(m.ps[i])) return fail(rc, "parameter %d has a sharded gradient after a no-sync backward", i);
        memcpy(before[i], ts_tensor_data(m.ps[i]), (size_t)ts_tensor_numel(m.ps[i]) * sizeof(float));
    }
    char buf[8192];
    size_t len = 0;
    RK_OK(rc, ts_fsdp_summary_str(m.root, buf, sizeof buf, &len));
    if (!strstr(buf, "gradient accumulation now: gradient sync off on 4 of 4 groups") ||
        !strstr(buf, "of unreduced gradients held") || strstr(buf, "in flight"))
        return fail(rc, "the summary after a no-sync backward:\n%s", buf);
    RK_OK(rc, ts_optim_step(m.opt));
    for (int i = 0; i < NP; i++)
        if (memcmp(before[i], ts_tensor_data(m.ps[i]), (size_t)ts_tensor_numel(m.ps[i]) * sizeof(float)))
            return fail(rc, "parameter %d changed in a step after a no-sync backward", i);
    ts_optim_zero_grad(m.opt, sa->set_to_none);
    RK_OK(rc, ts_fsdp_set_requires_gradient_sync(m.root, true, true));
    RK_OK(rc, fwd_bwd(&m, base + 2, 2, 0.5));
    RK_OK(rc, ts_fsdp_summary_str(m.root, buf, sizeof buf, &len));
    if (strstr(buf, "gradient accumulation now")) return fail(rc, "the summary after a synced backward:\n%s", buf);
    for (int i = 0; i < NP; i++) {
        if (close_to(rc, "gradient", 0, i, ts_tensor_grad(m2.ps[i]), ts_tensor_grad(m.ps[i]), 0, 0)) return 1;
        if (close_to(rc, "gradient", 0, i, ts_tensor_grad(ref.ps[i]), ts_tensor_grad(m.ps[i]), rtol, atol)) return 1;
    }
    model_free(&ref);
    model_free(&m);
    model_free(&m2);
    ts_mesh_free(mesh);
    return 0;
}

Test(fully_shard_accumulation, step_and_zero_grad_between_no_sync_microbatches)
{
    seq_arg v[5] = {{.set_to_none = true},
                    {.set_to_none = false},
                    {.bf16 = true, .set_to_none = true},
                    {.offload = true, .set_to_none = true},
                    {.bf16 = true, .offload = true, .set_to_none = false}};
    for (int i = 0; i < 5; i++) run_world(2, rank_step_between, &v[i]);
}

/* clip_grad_norm after K microbatches in either mode, and after backwards
 * that left their last reduction in flight (is_last_backward false on
 * every microbatch), equals the one-batch reference's: the total norm and
 * the clipped gradients (in flight, the root's reduction was left out of
 * the norm and landed unclipped afterwards). */
static int rank_clip(rank_ctx *rc)
{
    const acc_arg *a = rc->arg;
    ts_mesh *mesh = th_rank_mesh(rc, false);
    if (!mesh) return fail(rc, "mesh: %s", ts_last_error());
    model ref, m;
    RK_OK(rc, model_new(mesh, a, &ref));
    RK_OK(rc, model_new(mesh, a, &m));
    int64_t base = (int64_t)rc->rank * a->K * a->B;
    RK_OK(rc, fwd_bwd(&ref, base, (int64_t)a->K * a->B, 1.0));
    for (int k = 0; k < a->K; k++) {
        RK_OK(rc, set_flags(&m, a, a->mode, k == a->K - 1));
        if (a->mode2 == MODE_ALL) RK_OK(rc, ts_fsdp_set_is_last_backward(m.root, false));
        RK_OK(rc, fwd_bwd(&m, base + (int64_t)k * a->B, a->B, 1.0 / a->K));
    }
    double tr = 0, tm = 0;
    RK_OK(rc, ts_fsdp_clip_grad_norm(ref.root, 1e-3, &tr));
    RK_OK(rc, ts_fsdp_clip_grad_norm(m.root, 1e-3, &tm));
    if (!(fabs(tr - tm) <= 1e-4 * tr)) return fail(rc, "total norm %.9g, reference %.9g", tm, tr);
    for (int i = 0; i < NP; i++)
        if (close_to(rc, "clipped gradient", 0, i, ts_tensor_grad(ref.ps[i]), ts_tensor_grad(m.ps[i]), F32_RTOL,
                     F32_ATOL))
            return 1;
    model_free(&ref);
    model_free(&m);
    ts_mesh_free(mesh);
    return 0;
}

Test(fully_shard_accumulation, clip_grad_norm_after_microbatches)
{
    for (int md = MODE_SYNC; md <= MODE_ALL; md++)
        for (int nl = 0; nl < 2; nl++) {
            acc_arg a = f32_arg(2, (mode)md);
            a.mode2 = nl ? MODE_ALL : MODE_SYNC; /* MODE_ALL here: is_last_backward false on every microbatch */
            run_world(2, rank_clip, &a);
        }
}

/* The controls set inside a backward (from a node's backward, here the
 * first to run): as FSDP2, each group's post-backward reads the flag when
 * it runs, so sync turned off there makes the whole backward a no-sync
 * one, and the next backward (sync on) reduces both microbatches. */
typedef struct toggle_ctx {
    ts_module *root;
    bool sync;
} toggle_ctx;

static ts_status toggle_backward(void *vc, int n, ts_tensor **g)
{
    (void)n, (void)g;
    toggle_ctx *t = vc;
    return ts_fsdp_set_requires_gradient_sync(t->root, t->sync, true);
}

static int rank_toggle_mid_backward(rank_ctx *rc)
{
    ts_mesh *mesh = th_rank_mesh(rc, false);
    if (!mesh) return fail(rc, "mesh: %s", ts_last_error());
    acc_arg a = f32_arg(2, MODE_SYNC);
    model ref, m;
    RK_OK(rc, model_new(mesh, &a, &ref));
    RK_OK(rc, model_new(mesh, &a, &m));
    int64_t base = (int64_t)rc->rank * 4;
    RK_OK(rc, fwd_bwd(&ref, base, 4, 1.0));
    for (int k = 0; k < 2; k++) {
        toggle_ctx t = {m.root, k == 1};
        ts_tensor *x = th_batch(base + 2 * k, 2, D, th_xval), *y = th_batch(base + 2 * k, 2, D, th_yval), *o = NULL,
                  *ow = NULL;
        ts_tensor *l = NULL, *sl = NULL;
        RK_OK(rc, ts_module_call1(m.root, x, &o));
        RK_OK(rc, ts_autograd_custom(1, &o, toggle_backward, &t, NULL, &ow));
        RK_OK(rc, ts_mse_loss(ow, y, TS_REDUCTION_MEAN, &l));
        RK_OK(rc, ts_mul_scalar(l, 0.5, &sl));
        RK_OK(rc, ts_backward(sl, NULL, false));
        ts_tensor_free(x), ts_tensor_free(y), ts_tensor_free(o), ts_tensor_free(ow), ts_tensor_free(l);
        ts_tensor_free(sl);
        if (k == 0)
            for (int i = 0; i < NP; i++)
                if (ts_tensor_grad(m.ps[i])) return fail(rc, "parameter %d reduced with sync turned off", i);
    }
    for (int i = 0; i < NP; i++)
        if (close_to(rc, "gradient", 0, i, ts_tensor_grad(ref.ps[i]), ts_tensor_grad(m.ps[i]), F32_RTOL, F32_ATOL))
            return 1;
    model_free(&ref);
    model_free(&m);
    ts_mesh_free(mesh);
    return 0;
}

Test(fully_shard_accumulation, sync_set_inside_the_backward) { run_world(2, rank_toggle_mid_backward, NULL); }
