/* fully_shard_clip: ts_fsdp_clip_grad_norm against ts_clip_grad_norm on the
 * same gradients held unsharded. The gradients are set by hand (the same
 * function of each element's global index on the shards and on the
 * unsharded reference), so that the test measures clipping alone.
 *
 * One rank: the shards are the whole parameters and the two must agree to
 * the bit, total norm and clipped gradients (both use optim's torch-exact
 * norms). Several ranks: each parameter's norm is then
 * sqrt(sum over ranks of local_norm^2) (the squares of the float32 local
 * norms are exact in float64, summed over the ring in float64), where the
 * unsharded norm is one float32 sum of squares in torch's 8-lane order, so
 * the two differ by the rounding of those float32 sums; the bound is
 * derived at tol_for(). */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "fully_shard/fully_shard.h"
#include "optim/optim.h"
#include "tests/loopback_ranks.h"

static pthread_mutex_t g_build_mu = PTHREAD_MUTEX_INITIALIZER;

/* Sequential(Linear(33, 40), Tanh, Linear(40, 7), Tanh, Linear(7, 9), Tanh,
 * Linear(9, 3)): parameters of 1320, 40, 280, 7, 63, 9, 27 and 3
 * elements, so every tail length of the 8-lane norm and several shard
 * splits (3 and 7 rows over 2 and 4 ranks leave a rank empty) occur. */
enum { NLIN = 4 };
static const int64_t k_dims[NLIN + 1] = {33, 40, 7, 9, 3};

static ts_status model_new(ts_module **out, ts_module **lin)
{
    ts_module *c[2 * NLIN - 1] = {0};
    ts_status st = TS_OK;
    pthread_mutex_lock(&g_build_mu);
    ts_manual_seed(3);
    for (int i = 0; i < NLIN && !st; i++) {
        st = ts_linear_new(k_dims[i], k_dims[i + 1], true, &c[2 * i]);
        if (!st && i + 1 < NLIN) st = ts_tanh_new(&c[2 * i + 1]);
    }
    if (!st) st = ts_sequential_new(2 * NLIN - 1, c, out);
    pthread_mutex_unlock(&g_build_mu);
    for (int i = 0; i < NLIN && !st; i++) lin[i] = c[2 * i];
    return st;
}

/* The gradient of parameter p at flat global index k. */
static float gval(int p, int64_t k) { return (float)(sin(0.77 * (double)k + 1.9 * p) * (0.05 + 0.01 * p)); }

/* Sets every parameter's gradient from gval: the rows this rank holds
 * (its shard's offset from the DTensor) or the whole tensor. */
static ts_status set_grads(ts_module *m)
{
    ts_named_params np;
    ts_status st = ts_module_named_parameters(m, &np);
    for (int i = 0; i < np.n && !st; i++) {
        ts_tensor *t = *np.items[i].slot;
        const ts_dtensor *dt = ts_fsdp_param_dtensor(t);
        int64_t row0 = dt ? ts_dtensor_local_offset(dt, 0) : 0;
        int nd = ts_tensor_ndim(t);
        int64_t rowlen = 1;
        for (int d = 1; d < nd; d++) rowlen *= ts_tensor_size(t, d);
        ts_tensor *g = NULL;
        if ((st = ts_tensor_empty(TS_F32, nd, ts_tensor_shape(t), &g))) break;
        float *p = ts_tensor_data(g);
        for (int64_t k = 0; k < ts_tensor_numel(g); k++) p[k] = gval(i, row0 * rowlen + k);
        st = ts_tensor_set_grad(t, g);
        ts_tensor_free(g);
    }
    ts_named_params_free(&np);
    return st;
}

static int64_t largest_param(void)
{
    int64_t m = 0;
    for (int i = 0; i < NLIN; i++) m = k_dims[i] * k_dims[i + 1] > m ? k_dims[i] * k_dims[i + 1] : m;
    return m;
}

/* Relative tolerance between the sharded and the unsharded total norm.
 * With u = 2^-24, a float32 sum of squares of n elements in torch's order
 * adds each square into an accumulator at most n/8 + 8 + 8 times (its lane,
 * the lane sum, the tail), so its relative error is below (n/8 + 16) u
 * (positive terms; first order), plus u for each square; the norm halves
 * that and adds u for sqrt. The sharded per-parameter norm carries the
 * same bound for its largest shard, plus the float64 sum (negligible) and
 * one rounding to float32. The total is a float32 norm of the P
 * per-parameter norms, which both sides compute in the same order from
 * inputs that differ by the above; its own rounding is common to both
 * except for error amplification, bounded by the same relative amount.
 * So |sharded - unsharded| / unsharded <= 2 * ((n/8 + 18) u / 2 + 2 u)
 * + 2 (P + 16) u, with n the largest parameter. */
static double tol_for(int nparams)
{
    const double u = 0x1p-24;
    double n = (double)largest_param();
    return 2 * ((n / 8 + 18) * u / 2 + 2 * u) + 2 * (nparams + 16) * u;
}

typedef struct clip_arg {
    double max_norm;
} clip_arg;

static int rank_clip(th_rank *rc)
{
    const clip_arg *a = rc->arg;
    ts_module *model = NULL, *ref = NULL, *lin[NLIN], *rlin[NLIN];
    TH_RK_OK(rc, model_new(&model, lin));
    TH_RK_OK(rc, model_new(&ref, rlin));
    int64_t shape[1] = {rc->W};
    const char *names[1] = {"dp"};
    ts_mesh *mesh = NULL;
    TH_RK_OK(rc, ts_mesh_new(rc->c, "cpu", 1, shape, names, &mesh));
    ts_fsdp_options o = ts_fsdp_options_default();
    o.mesh = mesh;
    for (int i = 0; i < NLIN; i++) TH_RK_OK(rc, ts_fully_shard(lin[i], &o));
    TH_RK_OK(rc, ts_fully_shard(model, &o));
    TH_RK_OK(rc, set_grads(model));
    TH_RK_OK(rc, set_grads(ref));

    ts_named_params np, rnp;
    TH_RK_OK(rc, ts_module_named_parameters(model, &np));
    TH_RK_OK(rc, ts_module_named_parameters(ref, &rnp));
    TH_RK_EQ(rc, np.n, rnp.n);
    ts_tensor *rps[2 * NLIN];
    for (int i = 0; i < rnp.n; i++) rps[i] = *rnp.items[i].slot;

    double tot = 0, rtot = 0;
    TH_RK_OK(rc, ts_fsdp_clip_grad_norm(model, a->max_norm, &tot));
    TH_RK_OK(rc, ts_clip_grad_norm(rnp.n, rps, a->max_norm, &rtot));
    if (!(rtot > a->max_norm)) return th_rank_fail(rc, "the test needs clipping (total %g)", rtot);
    double tol = tol_for(np.n);
    if (rc->W == 1) {
        if (memcmp(&tot, &rtot, sizeof tot) != 0)
            return th_rank_fail(rc, "one rank: total norm %.17g, unsharded %.17g (must be the same bits)", tot, rtot);
    } else if (!(fabs(tot - rtot) <= tol * rtot)) {
        return th_rank_fail(rc, "total norm %.9g, unsharded %.9g: relative %.3g above %.3g", tot, rtot,
                            fabs(tot - rtot) / rtot, tol);
    }
    /* every rank holds the same total, to the bit */
    int64_t one = 1;
    ts_tensor *hi = NULL, *lo = NULL;
    TH_RK_OK(rc, ts_tensor_full(TS_F64, 1, &one, tot, &hi));
    TH_RK_OK(rc, ts_tensor_full(TS_F64, 1, &one, tot, &lo));
    TH_RK_OK(rc, ts_all_reduce(rc->c, hi, TS_REDUCE_MAX, NULL));
    TH_RK_OK(rc, ts_all_reduce(rc->c, lo, TS_REDUCE_MIN, NULL));
    if (*(double *)ts_tensor_data(hi) != *(double *)ts_tensor_data(lo))
        return th_rank_fail(rc, "ranks disagree on the total: %.17g to %.17g", *(double *)ts_tensor_data(lo),
                            *(double *)ts_tensor_data(hi));
    ts_tensor_free(hi);
    ts_tensor_free(lo);

    /* the clipped gradients: this rank's rows of the unsharded ones */
    for (int i = 0; i < np.n; i++) {
        ts_tensor *g = ts_tensor_grad(*np.items[i].slot), *rg = ts_tensor_grad(rps[i]);
        if (!g || !rg) return th_rank_fail(rc, "%s has no gradient", np.items[i].name);
        const ts_dtensor *dt = ts_fsdp_param_dtensor(*np.items[i].slot);
        int64_t row0 = dt ? ts_dtensor_local_offset(dt, 0) : 0, rowlen = 1;
        for (int d = 1; d < ts_tensor_ndim(g); d++) rowlen *= ts_tensor_size(g, d);
        const float *gp = ts_tensor_data(g), *rp = (const float *)ts_tensor_data(rg) + row0 * rowlen;
        for (int64_t k = 0; k < ts_tensor_numel(g); k++) {
            bool same = rc->W == 1 ? memcmp(&gp[k], &rp[k], 4) == 0
                                   : fabs((double)gp[k] - (double)rp[k]) <= (tol + 0x1p-22) * fabs((double)rp[k]);
            if (!same)
                return th_rank_fail(rc, "%s[%lld] clipped: %.9g, unsharded %.9g", np.items[i].name,
                                    (long long)(row0 * rowlen + k), (double)gp[k], (double)rp[k]);
        }
    }
    ts_named_params_free(&np);
    ts_named_params_free(&rnp);
    ts_module_free(model);
    ts_module_free(ref);
    ts_mesh_free(mesh);
    return 0;
}

Test(fully_shard_clip, one_rank_same_bits_as_unsharded, .timeout = 60)
{
    clip_arg a = {0.5};
    th_run_world(1, rank_clip, &a, 30.0);
}

Test(fully_shard_clip, two_ranks_within_rounding_bound, .timeout = 60)
{
    clip_arg a = {0.5};
    th_run_world(2, rank_clip, &a, 30.0);
}

Test(fully_shard_clip, four_ranks_within_rounding_bound, .timeout = 60)
{
    clip_arg a = {0.5};
    th_run_world(4, rank_clip, &a, 30.0);
}
