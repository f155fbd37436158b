#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "fully_shard/fully_shard.h"
#include "fully_shard/grad_scaler.h"
#include "optim/optim.h"
#include "tests/loopback_ranks.h"

/* fully_shard with a ts_mp_policy, on W loopback ranks run as threads
 * (tests/loopback_ranks.h), against the same training done by hand
 * without FSDP, as PyTorch's test_fully_shard_mixed_precision.py does: an
 * float32 master copy of the model, a copy in the compute dtype that gets
 * the master's values cast before every step, the same input and output
 * casts, the gradients converted to the reduce dtype and averaged over
 * the ranks with the comm layer's all-reduce (shard group then replicate
 * group for HSDP, as FSDP reduces), converted to float32 and stepped by
 * the same SGD.
 *
 * Why bit equality is expected: the unsharded parameters are the master
 * values cast once, so forward and backward run the same kernels on the
 * same values. The comm layer reduces bfloat16, float16 and float32 in a
 * float32 accumulator and rounds once; a sum of 16-bit values is exact in
 * float32 (when their exponents lie within 16 binades, as here), so the
 * order of the ring (reduce-scatter in FSDP, all-reduce in the reference)
 * does not matter, and dividing by a power of two is exact. Where the
 * order does matter (float64 or float32 gradients summed over 4 ranks),
 * the case gives a tolerance, justified where it is set. */

typedef th_rank rank_ctx;
#define fail th_rank_fail
#define RK_OK TH_RK_OK
#define RK_EQ TH_RK_EQ

static pthread_mutex_t g_build_mu = PTHREAD_MUTEX_INITIALIZER;

#define KEEP TS_DTYPE_KEEP

/* Sequential(Linear(8, 16), Tanh, Linear(16, 16), Tanh, Linear(16, 4)) */
static ts_status mlp_new(uint64_t seed, ts_module **root, ts_module *lin[3])
{
    pthread_mutex_lock(&g_build_mu);
    ts_manual_seed(seed);
    ts_module *c[5] = {0};
    ts_status st = ts_linear_new(8, 16, true, &c[0]);
    if (!st) st = ts_tanh_new(&c[1]);
    if (!st) st = ts_linear_new(16, 16, true, &c[2]);
    if (!st) st = ts_tanh_new(&c[3]);
    if (!st) st = ts_linear_new(16, 4, true, &c[4]);
    if (!st) st = ts_sequential_new(5, c, root);
    pthread_mutex_unlock(&g_build_mu);
    if (st) return st;
    lin[0] = c[0], lin[1] = c[2], lin[2] = c[4];
    return TS_OK;
}

/* rank-dependent input rows, float32 (rows, 8) */
static ts_tensor *batch(int64_t row0, int64_t rows, double inject)
{
    int64_t shape[2] = {rows, 8};
    ts_tensor *t = NULL;
    if (ts_tensor_empty(TS_F32, 2, shape, &t)) return NULL;
    float *p = ts_tensor_data(t);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < 8; j++) p[r * 8 + j] = (float)sin(0.37 * (double)((row0 + r) * 7 + j) + 0.1);
    if (inject != 0) p[3] = (float)inject;
    return t;
}

/* Replaces every parameter of m by a copy in dtype dt (a leaf requiring
 * grad). */
static ts_status params_to(ts_module *m, ts_dtype dt)
{
    ts_named_params np;
    ts_status st = ts_module_named_parameters(m, &np);
    if (st) return st;
    bool prev = ts_grad_mode_set(false);
    for (int i = 0; i < np.n && !st; i++) {
        ts_tensor *t = *np.items[i].slot, *c = NULL;
        if (ts_tensor_dtype(t) == dt) continue;
        if ((st = ts_to_dtype(t, dt, &c))) break;
        if ((st = ts_tensor_set_requires_grad(c, true))) {
            ts_tensor_free(c);
            break;
        }
        *np.items[i].slot = c;
        ts_tensor_free(t);
    }
    ts_grad_mode_set(prev);
    ts_named_params_free(&np);
    return st;
}

static ts_dtype or_keep(ts_dtype d, ts_dtype dflt) { return d == KEEP ? dflt : d; }

static ts_status cast_to(ts_tensor **x, ts_dtype d)
{
    if (d == KEEP || !ts_dtype_is_float(ts_tensor_dtype(*x)) || ts_tensor_dtype(*x) == d) return TS_OK;
    ts_tensor *y = NULL;
    ts_status st = ts_to_dtype(*x, d, &y);
    if (st) return st;
    ts_tensor_free(*x);
    *x = y;
    return TS_OK;
}

static ts_status cast_in(ts_tensor **x, const ts_mp_policy *p)
{
    return p && p->cast_forward_inputs ? cast_to(x, p->param_dtype) : TS_OK;
}

static ts_status cast_out(ts_tensor **x, const ts_mp_policy *p) { return p ? cast_to(x, p->output_dtype) : TS_OK; }

typedef struct mp_case {
    int W;
    bool hsdp;                 /* 2 x (W/2) mesh (replicate, shard) */
    ts_mp_policy root, lin[3]; /* the root's and each Linear's policy */
    int steps;
    double tol; /* 0: bit equality */
    ts_reshard_policy reshard;
    int every_n; /* for TS_RESHARD_EVERY_N */
} mp_case;

/* The reference forward: FSDP's casts by hand around the compute model's
 * layers. */
static ts_status ref_forward(const mp_case *k, ts_module *croot, ts_module *clin[3], ts_tensor *x0, ts_tensor **out)
{
    ts_tensor *x = ts_tensor_retain(x0);
    ts_status st = cast_in(&x, &k->root);
    for (int j = 0; j < 5 && !st; j++) {
        ts_tensor *y = NULL;
        if (j % 2 == 0) {
            const ts_mp_policy *p = &k->lin[j / 2];
            if ((st = cast_in(&x, p))) break;
            if ((st = ts_module_call1(clin[j / 2], x, &y))) break;
            ts_tensor_free(x);
            x = y;
            st = cast_out(&x, p);
        } else {
            if ((st = ts_tanh(x, &y))) break;
            ts_tensor_free(x);
            x = y;
        }
    }
    if (!st) st = cast_out(&x, &k->root);
    if (st) {
        ts_tensor_free(x);
        return st;
    }
    (void)croot;
    *out = x;
    return TS_OK;
}

static int rank_parity(rank_ctx *rc)
{
    const mp_case *k = rc->arg;
    ts_mesh *mesh = NULL;
    if (k->hsdp) {
        int64_t shape[2] = {2, rc->W / 2};
        const char *names[2] = {"rep", "shard"};
        RK_OK(rc, ts_mesh_new(rc->c, "cpu", 2, shape, names, &mesh));
    } else {
        int64_t shape[1] = {rc->W};
        const char *names[1] = {"dp"};
        RK_OK(rc, ts_mesh_new(rc->c, "cpu", 1, shape, names, &mesh));
    }
    ts_module *aroot, *alin[3], *broot, *blin[3], *croot, *clin[3];
    RK_OK(rc, mlp_new(7, &aroot, alin));
    RK_OK(rc, mlp_new(7, &broot, blin));
    RK_OK(rc, mlp_new(7, &croot, clin));
    ts_dtype pd[3], rd[3];
    for (int i = 0; i < 3; i++) {
        pd[i] = or_keep(k->lin[i].param_dtype, TS_F32);
        rd[i] = or_keep(k->lin[i].reduce_dtype, pd[i]);
        RK_OK(rc, params_to(clin[i], pd[i]));
    }
    ts_fsdp_options o = ts_fsdp_options_default();
    o.mesh = mesh;
    o.reshard_after_forward = k->reshard;
    o.reshard_every_n = k->every_n;
    for (int i = 0; i < 3; i++) {
        o.mp_policy = &k->lin[i];
        RK_OK(rc, ts_fully_shard(alin[i], &o));
    }
    o.mp_policy = &k->root;
    RK_OK(rc, ts_fully_shard(aroot, &o));

    ts_named_params an, bn, cn;
    RK_OK(rc, ts_module_named_parameters(aroot, &an));
    RK_OK(rc, ts_module_named_parameters(broot, &bn));
    RK_OK(rc, ts_module_named_parameters(croot, &cn));
    ts_tensor *ap[8], *bp[8];
    for (int i = 0; i < an.n; i++) ap[i] = *an.items[i].slot;
    for (int i = 0; i < bn.n; i++) bp[i] = *bn.items[i].slot;
    ts_sgd_options so = ts_sgd_options_default();
    so.lr = 0.05;
    so.momentum = 0.9;
    ts_optim *aopt = NULL, *bopt = NULL;
    RK_OK(rc, ts_sgd_new(an.n, ap, &so, &aopt));
    RK_OK(rc, ts_sgd_new(bn.n, bp, &so, &bopt));
    ts_comm *sg = k->hsdp ? ts_mesh_group(mesh, "shard") : NULL, *rg = k->hsdp ? ts_mesh_group(mesh, "rep") : NULL;
    int failed = 0;
    for (int step = 0; step < k->steps && !failed; step++) {
        ts_tensor *x = batch((int64_t)rc->rank * 4 + step, 4, 0.0);
        /* FSDP */
        ts_tensor *out = NULL, *loss = NULL;
        RK_OK(rc, ts_module_call1(aroot, x, &out));
        ts_dtype want_out = or_keep(k->root.output_dtype, or_keep(k->lin[2].output_dtype, pd[2]));
        RK_EQ(rc, ts_tensor_dtype(out), want_out);
        RK_OK(rc, ts_sum(out, 0, NULL, false, &loss));
        RK_OK(rc, ts_backward(loss, NULL, false));
        RK_OK(rc, ts_optim_step(aopt));
        ts_optim_zero_grad(aopt, step % 2 == 0);
        /* by hand */
        bool prev = ts_grad_mode_set(false);
        for (int i = 0; i < cn.n; i++) RK_OK(rc, ts_tensor_copy_(*cn.items[i].slot, bp[i]));
        ts_grad_mode_set(prev);
        ts_tensor *cout = NULL, *closs = NULL;
        RK_OK(rc, ref_forward(k, croot, clin, x, &cout));
        RK_EQ(rc, ts_tensor_dtype(cout), want_out);
        RK_OK(rc, ts_sum(cout, 0, NULL, false, &closs));
        RK_OK(rc, ts_backward(closs, NULL, false));
        for (int i = 0; i < cn.n; i++) {
            ts_tensor *cp = *cn.items[i].slot, *g = NULL, *g32 = NULL;
            int li = i / 2; /* weight, bias per Linear */
            RK_OK(rc, ts_to_dtype(ts_tensor_grad(cp), rd[li], &g));
            if (k->hsdp) {
                RK_OK(rc, ts_all_reduce(sg, g, TS_REDUCE_AVG, NULL));
                RK_OK(rc, ts_all_reduce(rg, g, TS_REDUCE_AVG, NULL));
            } else {
                RK_OK(rc, ts_all_reduce(rc->c, g, TS_REDUCE_AVG, NULL));
            }
            RK_OK(rc, ts_to_dtype(g, TS_F32, &g32));
            RK_OK(rc, ts_tensor_set_grad(bp[i], g32));
            ts_tensor_free(g);
            ts_tensor_free(g32);
            ts_tensor_zero_grad(cp, true);
        }
        RK_OK(rc, ts_optim_step(bopt));
        ts_optim_zero_grad(bopt, step % 2 == 0);
        double la, lc;
        RK_OK(rc, ts_tensor_item(loss, &la));
        RK_OK(rc, ts_tensor_item(closs, &lc));
        if (!(la == lc || (k->tol > 0 && fabs(la - lc) <= k->tol * fmax(1.0, fabs(lc)))))
            failed = fail(rc, "step %d: loss %.17g (fsdp) vs %.17g (by hand)", step, la, lc);
        /* the float32 master weights, gathered from the shards */
        ts_state_dict *sd = NULL;
        RK_OK(rc, ts_fsdp_full_state_dict(aroot, false, &sd));
        for (int i = 0; i < bn.n && !failed; i++) {
            ts_tensor *t = ts_state_dict_get(sd, bn.items[i].name);
            if (!t) {
                failed = fail(rc, "no '%s' in the full state dict", bn.items[i].name);
                break;
            }
            RK_EQ(rc, ts_tensor_dtype(t), TS_F32);
            const float *a = ts_tensor_data(t), *b = ts_tensor_data(bp[i]);
            for (int64_t e = 0; e < ts_tensor_numel(t); e++) {
                bool ok = k->tol > 0 ? fabs((double)a[e] - (double)b[e]) <= k->tol * fmax(1.0, fabs((double)b[e]))
                                     : memcmp(&a[e], &b[e], sizeof(float)) == 0;
                if (!ok) {
                    failed = fail(rc, "step %d: '%s'[%lld] = %.9g (fsdp) vs %.9g (by hand)", step, bn.items[i].name,
                                  (long long)e, (double)a[e], (double)b[e]);
                    break;
                }
            }
        }
        ts_state_dict_free(sd);
        ts_tensor_free(x);
        ts_tensor_free(out);
        ts_tensor_free(loss);
        ts_tensor_free(cout);
        ts_tensor_free(closs);
    }
    ts_named_params_free(&an);
    ts_named_params_free(&bn);
    ts_named_params_free(&cn);
    ts_optim_free(aopt);
    ts_optim_free(bopt);
    ts_module_free(aroot);
    ts_module_free(broot);
    ts_module_free(croot);
    ts_mesh_free(mesh);
    return failed;
}

static ts_mp_policy pol(ts_dtype param, ts_dtype reduce, ts_dtype output)
{
    ts_mp_policy p = ts_mp_policy_default();
    p.param_dtype = param;
    p.reduce_dtype = reduce;
    p.output_dtype = output;
    return p;
}

static void run_case(mp_case *k)
{
    if (!k->steps) k->steps = 4;
    th_run_world(k->W, rank_parity, k, 120.0);
}

static mp_case uniform(int W, bool hsdp, ts_dtype param, ts_dtype reduce, double tol)
{
    mp_case k;
    memset(&k, 0, sizeof k);
    k.W = W;
    k.hsdp = hsdp;
    k.root = pol(param, reduce, KEEP);
    for (int i = 0; i < 3; i++) k.lin[i] = k.root;
    k.tol = tol;
    k.reshard = TS_RESHARD_TRUE;
    return k;
}

/* ---------------------------------------- bf16 compute (test_compute_dtype) */

Test(fully_shard_mixed_precision, bf16_one_rank, .timeout = 120)
{
    mp_case k = uniform(1, false, TS_BF16, KEEP, 0);
    run_case(&k);
}

Test(fully_shard_mixed_precision, bf16_two_ranks, .timeout = 120)
{
    mp_case k = uniform(2, false, TS_BF16, KEEP, 0);
    run_case(&k);
}

Test(fully_shard_mixed_precision, bf16_four_ranks, .timeout = 120)
{
    mp_case k = uniform(4, false, TS_BF16, KEEP, 0);
    run_case(&k);
}

Test(fully_shard_mixed_precision, bf16_reshard_false_and_every_2, .timeout = 120)
{
    mp_case k = uniform(2, false, TS_BF16, KEEP, 0);
    k.reshard = TS_RESHARD_FALSE;
    run_case(&k);
    k.reshard = TS_RESHARD_EVERY_N;
    k.every_n = 2;
    run_case(&k);
}

/* HSDP reduces twice (reduce-scatter over the shard dim, then all-reduce
 * over the replicate dim), each rounding to bfloat16; the reference does
 * the same two reductions, so this is exact too. */
Test(fully_shard_mixed_precision, bf16_hsdp_2x2, .timeout = 120)
{
    mp_case k = uniform(4, true, TS_BF16, KEEP, 0);
    run_case(&k);
}

/* ---------------------------------------- reduce dtype (test_reduce_dtype) */

Test(fully_shard_mixed_precision, bf16_params_f32_reduce_two_ranks, .timeout = 120)
{
    mp_case k = uniform(2, false, TS_BF16, TS_F32, 0);
    run_case(&k);
}

Test(fully_shard_mixed_precision, bf16_params_f32_reduce_four_ranks, .timeout = 120)
{
    mp_case k = uniform(4, false, TS_BF16, TS_F32, 0);
    run_case(&k);
}

Test(fully_shard_mixed_precision, bf16_params_f32_reduce_hsdp_2x2, .timeout = 120)
{
    mp_case k = uniform(4, true, TS_BF16, TS_F32, 0);
    run_case(&k);
}

/* _test_reduce_dtype_bf16_reduce: float32 compute, bfloat16 reduction */
Test(fully_shard_mixed_precision, f32_params_bf16_reduce_four_ranks, .timeout = 120)
{
    mp_case k = uniform(4, false, KEEP, TS_BF16, 0);
    run_case(&k);
}

/* ---------------------------------------- float64 compute (built on the
 * float64 kernels, so the hooks' casts are checked independently of the
 * 16-bit ops) */

Test(fully_shard_mixed_precision, f64_compute_two_ranks, .timeout = 120)
{
    mp_case k = uniform(2, false, TS_F64, KEEP, 0);
    run_case(&k);
}

/* Four float64 gradients summed in two different orders differ by a few
 * float64 ulps; the float32 master weights then round the same way except
 * near a rounding boundary, one float32 ulp (6e-8 relative) per step at
 * most: 1e-6 relative over 4 steps leaves a wide margin while a wrong
 * cast or a missing reduction is off by 1e-3 or more. */
Test(fully_shard_mixed_precision, f64_compute_four_ranks, .timeout = 120)
{
    mp_case k = uniform(4, false, TS_F64, KEEP, 1e-6);
    run_case(&k);
}

Test(fully_shard_mixed_precision, f64_compute_f32_reduce_two_ranks, .timeout = 120)
{
    mp_case k = uniform(2, false, TS_F64, TS_F32, 0);
    run_case(&k);
}

Test(fully_shard_mixed_precision, f64_compute_f32_reduce_hsdp_2x2, .timeout = 120)
{
    mp_case k = uniform(4, true, TS_F64, TS_F32, 1e-6);
    run_case(&k);
}

/* param_dtype equal to the parameters' own and reduce_dtype equal to it:
 * no cast anywhere, the same bits as without a policy (the reference is
 * the plain float32 training). */
Test(fully_shard_mixed_precision, equal_dtypes_add_no_cast, .timeout = 120)
{
    mp_case k = uniform(2, false, TS_F32, TS_F32, 0);
    run_case(&k);
}

/* ---------------------------------------- output and input casts */

/* output_dtype alone (BatchNorm's fix in FSDP2's notes: no param_dtype):
 * the root's outputs come out in float64, the compute stays float32. */
Test(fully_shard_mixed_precision, output_dtype_casts_the_outputs, .timeout = 120)
{
    mp_case k = uniform(2, false, KEEP, KEEP, 0);
    k.root.output_dtype = TS_F64;
    run_case(&k);
}

/* A float32 child inside a bfloat16 parent (test_float16_on_one_submodule
 * the other way round): the middle Linear keeps float32 parameters,
 * casts its bfloat16 inputs up (cast_forward_inputs) and its outputs back
 * down (output_dtype). */
Test(fully_shard_mixed_precision, f32_child_under_bf16_parent, .timeout = 120)
{
    mp_case k = uniform(2, false, TS_BF16, KEEP, 0);
    k.lin[1] = pol(TS_F32, KEEP, TS_BF16);
    run_case(&k);
}

/* test_float16_on_one_submodule: a float32 model with one float16
 * Linear, which casts its inputs down and (output_dtype) its outputs back
 * up for the float32 layers after it. */
Test(fully_shard_mixed_precision, f16_child_under_f32_parent, .timeout = 120)
{
    mp_case k = uniform(2, false, KEEP, KEEP, 0);
    k.lin[1] = pol(TS_F16, KEEP, TS_F32);
    run_case(&k);
}

/* The same per-module shape on float64 compute. */
Test(fully_shard_mixed_precision, f32_child_under_f64_parent, .timeout = 120)
{
    mp_case k = uniform(2, false, TS_F64, KEEP, 0);
    k.lin[1] = pol(TS_F32, KEEP, TS_F64);
    run_case(&k);
}

/* cast_forward_inputs false on every module: the float32 input reaches a
 * float64 Linear uncast, which the tensor layer refuses (no implicit
 * promotion), so the cast is what makes the default work. */
static int rank_no_input_cast(rank_ctx *rc)
{
    ts_module *root, *lin[3];
    RK_OK(rc, mlp_new(7, &root, lin));
    ts_mp_policy p = pol(TS_F64, KEEP, KEEP);
    p.cast_forward_inputs = false;
    ts_fsdp_options o = ts_fsdp_options_default();
    o.mp_policy = &p;
    for (int i = 0; i < 3; i++) RK_OK(rc, ts_fully_shard(lin[i], &o));
    RK_OK(rc, ts_fully_shard(root, &o));
    ts_tensor *x = batch(0, 4, 0.0), *out = NULL;
    ts_status st = ts_module_call1(root, x, &out);
    if (st == TS_OK) RK_EQ(rc, ts_tensor_dtype(out), TS_F64); /* a promoting tensor layer would get here */
    else RK_EQ(rc, st, TS_ERR_DTYPE);
    ts_tensor_free(out);
    /* with the cast the same call works and gives float64 */
    p.cast_forward_inputs = true;
    ts_module *root2, *lin2[3];
    RK_OK(rc, mlp_new(7, &root2, lin2));
    for (int i = 0; i < 3; i++) RK_OK(rc, ts_fully_shard(lin2[i], &o));
    RK_OK(rc, ts_fully_shard(root2, &o));
    RK_OK(rc, ts_module_call1(root2, x, &out));
    RK_EQ(rc, ts_tensor_dtype(out), TS_F64);
    ts_tensor_free(out);
    ts_tensor_free(x);
    ts_module_free(root);
    ts_module_free(root2);
    return 0;
}

Test(fully_shard_mixed_precision, cast_forward_inputs, .timeout = 60)
{
    th_run_world(1, rank_no_input_cast, NULL, 30.0);
}

/* Integer inputs are never cast: token ids reach the Embedding as int64
 * under a float64 (or bfloat16) policy. */
static int rank_integer_inputs(rank_ctx *rc)
{
    ts_dtype pdt = *(const ts_dtype *)rc->arg;
    pthread_mutex_lock(&g_build_mu);
    ts_manual_seed(3);
    ts_module *c[2] = {0}, *root = NULL;
    ts_status s = ts_embedding_new(10, 8, &c[0]);
    if (!s) s = ts_linear_new(8, 4, true, &c[1]);
    if (!s) s = ts_sequential_new(2, c, &root);
    pthread_mutex_unlock(&g_build_mu);
    RK_OK(rc, s);
    ts_mp_policy p = pol(pdt, KEEP, KEEP);
    ts_fsdp_options o = ts_fsdp_options_default();
    o.mp_policy = &p;
    RK_OK(rc, ts_fully_shard(root, &o));
    int64_t n = 3;
    ts_tensor *ids = NULL, *out = NULL, *loss = NULL;
    RK_OK(rc, ts_tensor_from_data(TS_I64, 1, &n, (int64_t[]){1, 7, 3}, &ids));
    RK_OK(rc, ts_module_call1(root, ids, &out));
    RK_EQ(rc, ts_tensor_dtype(ids), TS_I64);
    RK_EQ(rc, ts_tensor_dtype(out), pdt);
    RK_OK(rc, ts_sum(out, 0, NULL, false, &loss));
    RK_OK(rc, ts_backward(loss, NULL, false));
    /* the gradients land in the float32 shards */
    ts_named_params np;
    RK_OK(rc, ts_module_named_parameters(root, &np));
    for (int i = 0; i < np.n; i++) {
        ts_tensor *g = ts_tensor_grad(*np.items[i].slot);
        if (!g) return fail(rc, "'%s' has no gradient", np.items[i].name);
        RK_EQ(rc, ts_tensor_dtype(g), TS_F32);
    }
    ts_named_params_free(&np);
    ts_tensor_free(ids);
    ts_tensor_free(out);
    ts_tensor_free(loss);
    ts_module_free(root);
    return 0;
}

Test(fully_shard_mixed_precision, integer_inputs_are_never_cast, .timeout = 60)
{
    ts_dtype d = TS_F64;
    th_run_world(2, rank_integer_inputs, &d, 30.0);
    d = TS_BF16;
    th_run_world(2, rank_integer_inputs, &d, 30.0);
}

/* ---------------------------------------- bytes on the wire */

typedef struct bytes_case {
    ts_dtype param, reduce;
    uint64_t ag, rs; /* out: bytes of one all-gather and one reduce-scatter of the root's group */
} bytes_case;

/* One explicit unshard, then one forward and backward, of a single
 * Linear(16, 16) group; the counters of its mesh's group. */
static int rank_bytes(rank_ctx *rc)
{
    bytes_case *b = rc->arg;
    ts_module *root, *lin[3];
    RK_OK(rc, mlp_new(7, &root, lin));
    int64_t shape[1] = {rc->W};
    ts_mesh *mesh = NULL;
    const char *names[1] = {"dp"};
    RK_OK(rc, ts_mesh_new(rc->c, "cpu", 1, shape, names, &mesh));
    ts_mp_policy p = pol(b->param, b->reduce, KEEP);
    ts_fsdp_options o = ts_fsdp_options_default();
    o.mesh = mesh;
    o.mp_policy = &p;
    RK_OK(rc, ts_fully_shard(root, &o));
    ts_comm *g = ts_mesh_group(mesh, NULL);
    ts_comm_stats_reset(g);
    ts_fsdp_unshard_handle *h = NULL;
    RK_OK(rc, ts_fsdp_unshard(root, false, &h));
    RK_OK(rc, ts_fsdp_reshard(root));
    ts_comm_counters c;
    ts_comm_stats(g, &c);
    RK_EQ(rc, c.calls[TS_COLL_ALL_GATHER], 1);
    if (rc->rank == 0) b->ag = c.bytes[TS_COLL_ALL_GATHER];
    /* the reduce-scatter needs the compute: only where its ops exist */
    ts_tensor *x = batch(0, 2, 0.0), *out = NULL, *loss = NULL;
    ts_comm_stats_reset(g);
    ts_status st = ts_module_call1(root, x, &out);
    if (!st) st = ts_sum(out, 0, NULL, false, &loss);
    if (!st) st = ts_backward(loss, NULL, false);
    RK_OK(rc, st);
    ts_comm_stats(g, &c);
    RK_EQ(rc, c.calls[TS_COLL_REDUCE_SCATTER], 1);
    if (rc->rank == 0) b->rs = c.bytes[TS_COLL_REDUCE_SCATTER];
    ts_tensor_free(x);
    ts_tensor_free(out);
    ts_tensor_free(loss);
    ts_module_free(root);
    ts_mesh_free(mesh);
    return 0;
}

static bytes_case bytes_of(int W, ts_dtype param, ts_dtype reduce)
{
    bytes_case b = {param, reduce, 0, 0};
    th_run_world(W, rank_bytes, &b, 60.0);
    return b;
}

/* The all-gather moves the shard cast to param_dtype: exactly half the
 * bytes of float32 for bfloat16 and float16, twice for float64; the
 * reduce-scatter moves reduce_dtype (param_dtype by default), W padded
 * shards and a flag per parameter after each. The MLP has
 * 8*16+16 + 16*16+16 + 16*4+4 = 484 elements, padded per parameter to
 * multiples of W rows. */
Test(fully_shard_mixed_precision, all_gather_bytes_follow_param_dtype, .timeout = 120)
{
    bytes_case f32 = bytes_of(2, KEEP, KEEP);
    cr_assert_eq(f32.ag, 4 * 242 /* one rank's padded shard: 8*8 + 8 + 8*16 + 8 + 2*16 + 2 */,
                 "float32 all-gather %llu bytes", (unsigned long long)f32.ag);
    /* each block of the reduce-scatter's input is a shard followed by one
     * flag per parameter (6: whether the rank has its gradient, fully_shard
     * [Note: unused parameters]) */
    cr_assert_eq(f32.rs, 2 * (f32.ag + 4 * 6), "the reduce-scatter's input is W shards and their flags: %llu bytes",
                 (unsigned long long)f32.rs);
    bytes_case f64 = bytes_of(2, TS_F64, KEEP);
    cr_assert_eq(f64.ag, 2 * f32.ag);
    cr_assert_eq(f64.rs, 2 * f32.rs);
    bytes_case f64r = bytes_of(2, TS_F64, TS_F32);
    cr_assert_eq(f64r.ag, 2 * f32.ag);
    cr_assert_eq(f64r.rs, f32.rs);
    bytes_case same = bytes_of(2, TS_F32, TS_F32);
    cr_assert_eq(same.ag, f32.ag);
    cr_assert_eq(same.rs, f32.rs);
    bytes_case r16 = bytes_of(2, KEEP, TS_BF16);
    cr_assert_eq(r16.ag, f32.ag);
    cr_assert_eq(r16.rs * 2, f32.rs);
}

/* The same for the 16-bit compute dtypes: bfloat16's all-gather moves
 * exactly half of float32's bytes (issue 10's target), and so does its
 * reduce-scatter unless reduce_dtype is float32. */
Test(fully_shard_mixed_precision, bf16_all_gather_moves_half_the_bytes, .timeout = 120)
{
    bytes_case f32 = bytes_of(2, KEEP, KEEP);
    bytes_case bf = bytes_of(2, TS_BF16, TS_F32);
    cr_assert_eq(bf.ag * 2, f32.ag, "bfloat16 all-gather %llu bytes, float32 %llu", (unsigned long long)bf.ag,
                 (unsigned long long)f32.ag);
    cr_assert_eq(bf.rs, f32.rs);
    bytes_case bfk = bytes_of(2, TS_BF16, KEEP);
    cr_assert_eq(bfk.ag * 2, f32.ag);
    cr_assert_eq(bfk.rs * 2, f32.rs);
    bytes_case h = bytes_of(2, TS_F16, KEEP);
    cr_assert_eq(h.ag * 2, f32.ag);
    cr_assert_eq(h.rs * 2, f32.rs);
}

/* ---------------------------------------- errors */

static int rank_invalid(rank_ctx *rc)
{
    ts_module *root, *lin[3];
    RK_OK(rc, mlp_new(7, &root, lin));
    ts_fsdp_options o = ts_fsdp_options_default();
    struct {
        ts_mp_policy p;
        ts_status st;
        const char *msg;
    } bad[] = {
        {pol(TS_I64, KEEP, KEEP), TS_ERR_DTYPE, "param_dtype int64 is not a floating-point dtype"},
        {pol(TS_BF16, TS_I32, KEEP), TS_ERR_DTYPE, "reduce_dtype int32 is not a floating-point dtype"},
        {pol(TS_BF16, KEEP, TS_BOOL), TS_ERR_DTYPE, "output_dtype bool is not a floating-point dtype"},
        {pol((ts_dtype)99, KEEP, KEEP), TS_ERR_INVALID_ARGUMENT, "param_dtype 99 is neither a ts_dtype nor"},
        {pol(KEEP, TS_DTYPE_COUNT, KEEP), TS_ERR_INVALID_ARGUMENT, "reduce_dtype 7 is neither"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        o.mp_policy = &bad[i].p;
        RK_EQ(rc, ts_fully_shard(lin[0], &o), bad[i].st);
        if (!strstr(ts_last_error(), bad[i].msg) || !strstr(ts_last_error(), "ts_fully_shard"))
            return fail(rc, "case %zu: %s", i, ts_last_error());
        RK_EQ(rc, ts_module_is_fsdp(lin[0]), 0);
    }
    ts_module_free(root);
    return 0;
}

Test(fully_shard_mixed_precision, invalid_policies_are_clear_errors, .timeout = 60)
{
    th_run_world(1, rank_invalid, NULL, 30.0);
}

/* ---------------------------------------- fp16 with the grad scaler */

/* test_gradient_scaler: float16 compute, float32 master weights and
 * reduction, ts_grad_scaler over the ranks. In step 1, rank 1's input
 * holds an inf: its gradients overflow, every rank skips the step (one
 * all-reduce of the flag), the weights stay and the scale halves; the
 * other steps step. */
static int rank_fp16_scaler(rank_ctx *rc)
{
    ts_module *root, *lin[3];
    RK_OK(rc, mlp_new(7, &root, lin));
    ts_mp_policy p = pol(TS_F16, TS_F32, KEEP);
    ts_fsdp_options o = ts_fsdp_options_default();
    o.mp_policy = &p;
    for (int i = 0; i < 3; i++) RK_OK(rc, ts_fully_shard(lin[i], &o));
    RK_OK(rc, ts_fully_shard(root, &o));
    ts_named_params np;
    RK_OK(rc, ts_module_named_parameters(root, &np));
    ts_tensor *ps[8];
    for (int i = 0; i < np.n; i++) ps[i] = *np.items[i].slot;
    ts_sgd_options so = ts_sgd_options_default();
    so.lr = 0.05;
    ts_optim *opt = NULL;
    RK_OK(rc, ts_sgd_new(np.n, ps, &so, &opt));
    ts_grad_scaler_options sco = ts_grad_scaler_options_default();
    sco.group = rc->c;
    sco.init_scale = 1024.0;
    ts_grad_scaler *sc = NULL;
    RK_OK(rc, ts_grad_scaler_new(&sco, &sc));
    for (int step = 0; step < 3; step++) {
        ts_tensor *x = batch(rc->rank * 4, 4, step == 1 && rc->rank == 1 ? INFINITY : 0.0);
        ts_tensor *out = NULL, *loss = NULL, *scaled = NULL;
        RK_OK(rc, ts_module_call1(root, x, &out));
        RK_EQ(rc, ts_tensor_dtype(out), TS_F16);
        RK_OK(rc, ts_sum(out, 0, NULL, false, &loss));
        RK_OK(rc, ts_grad_scaler_scale(sc, loss, &scaled));
        RK_EQ(rc, ts_tensor_dtype(scaled), TS_F16);
        RK_OK(rc, ts_backward(scaled, NULL, false));
        ts_state_dict *before = NULL;
        RK_OK(rc, ts_fsdp_full_state_dict(root, false, &before));
        bool stepped = false;
        RK_OK(rc, ts_grad_scaler_step(sc, opt, &stepped));
        RK_EQ(rc, stepped, step != 1);
        ts_state_dict *after = NULL;
        RK_OK(rc, ts_fsdp_full_state_dict(root, false, &after));
        int changed = 0;
        for (int i = 0; i < ts_state_dict_size(before); i++) {
            ts_tensor *a = ts_state_dict_get(before, ts_state_dict_name(before, i));
            ts_tensor *b = ts_state_dict_get(after, ts_state_dict_name(before, i));
            changed += memcmp(ts_tensor_data(a), ts_tensor_data(b), (size_t)ts_tensor_numel(a) * 4) != 0;
        }
        if (step == 1) RK_EQ(rc, changed, 0);
        else if (changed == 0) return fail(rc, "step %d changed no weight", step);
        RK_OK(rc, ts_grad_scaler_update(sc));
        RK_EQ(rc, ts_grad_scaler_get_scale(sc), step == 0 ? 1024.0 : 512.0);
        ts_optim_zero_grad(opt, true);
        ts_state_dict_free(before);
        ts_state_dict_free(after);
        ts_tensor_free(x);
        ts_tensor_free(out);
        ts_tensor_free(loss);
        ts_tensor_free(scaled);
    }
    RK_EQ(rc, ts_optim_step_count(opt), 2);
    ts_grad_scaler_free(sc);
    ts_optim_free(opt);
    ts_named_params_free(&np);
    ts_module_free(root);
    return 0;
}

Test(fully_shard_mixed_precision, fp16_scaler_skips_the_step_with_inf, .timeout = 120)
{
    th_run_world(2, rank_fp16_scaler, NULL, 60.0);
}

/* ---------------------------------------- state dicts under a policy */

/* The full state dict holds the float32 master weights (gathered in their
 * own dtype, not in param_dtype), equal to the model's before sharding. */
static int rank_state_dict(rank_ctx *rc)
{
    ts_module *root, *lin[3], *ref, *rlin[3];
    RK_OK(rc, mlp_new(7, &root, lin));
    RK_OK(rc, mlp_new(7, &ref, rlin));
    ts_mp_policy p = pol(TS_BF16, KEEP, KEEP);
    ts_fsdp_options o = ts_fsdp_options_default();
    o.mp_policy = &p;
    for (int i = 0; i < 3; i++) RK_OK(rc, ts_fully_shard(lin[i], &o));
    RK_OK(rc, ts_fully_shard(root, &o));
    ts_state_dict *sd = NULL, *want = NULL;
    RK_OK(rc, ts_fsdp_full_state_dict(root, false, &sd));
    RK_OK(rc, ts_module_state_dict(ref, &want));
    RK_EQ(rc, ts_state_dict_size(sd), ts_state_dict_size(want));
    for (int i = 0; i < ts_state_dict_size(want); i++) {
        ts_tensor *a = ts_state_dict_get(sd, ts_state_dict_name(want, i)),
                  *b = ts_state_dict_get(want, ts_state_dict_name(want, i));
        if (!a) return fail(rc, "missing %s", ts_state_dict_name(want, i));
        RK_EQ(rc, ts_tensor_dtype(a), TS_F32);
        if (memcmp(ts_tensor_data(a), ts_tensor_data(b), (size_t)ts_tensor_numel(b) * 4))
            return fail(rc, "'%s' differs from the unsharded model", ts_state_dict_name(want, i));
    }
    /* and loading it back keeps them */
    RK_OK(rc, ts_fsdp_load_full_state_dict(root, sd, true));
    ts_state_dict *sd2 = NULL;
    RK_OK(rc, ts_fsdp_full_state_dict(root, false, &sd2));
    for (int i = 0; i < ts_state_dict_size(want); i++) {
        ts_tensor *a = ts_state_dict_get(sd2, ts_state_dict_name(want, i)),
                  *b = ts_state_dict_get(want, ts_state_dict_name(want, i));
        if (memcmp(ts_tensor_data(a), ts_tensor_data(b), (size_t)ts_tensor_numel(b) * 4))
            return fail(rc, "'%s' changed by a load", ts_state_dict_name(want, i));
    }
    /* the summary names the policy's dtypes and the unsharded bytes in bfloat16 */
    char buf[8192];
    size_t len = 0;
    RK_OK(rc, ts_fsdp_summary_str(root, buf, sizeof buf, &len));
    if (!strstr(buf, "mixed precision: all-gather and compute in bfloat16, gradients reduced in bfloat16"))
        return fail(rc, "summary:\n%s", buf);
    /* summon with writeback would round the master weights: refused */
    ts_fsdp_summon *s = NULL;
    RK_EQ(rc, ts_fsdp_summon_full_params(root, true, &s), TS_ERR_UNSUPPORTED);
    if (!strstr(ts_last_error(), "bfloat16")) return fail(rc, "message: %s", ts_last_error());
    RK_OK(rc, ts_fsdp_summon_full_params(root, false, &s));
    RK_OK(rc, ts_fsdp_summon_end(s));
    ts_state_dict_free(sd);
    ts_state_dict_free(sd2);
    ts_state_dict_free(want);
    ts_module_free(root);
    ts_module_free(ref);
    return 0;
}

Test(fully_shard_mixed_precision, full_state_dict_holds_the_f32_master, .timeout = 60)
{
    th_run_world(2, rank_state_dict, NULL, 30.0);
}
