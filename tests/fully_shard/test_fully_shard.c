#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "fully_shard/fully_shard.h"
#include "optim/optim.h"
#include "tests/loopback_ranks.h"

/* fully_shard over W loopback ranks run as threads of this test, each with
 * its own world (see tests/loopback_ranks.h): rank threads never call
 * cr_assert; they return th_rank_fail(...). Models are built under a
 * mutex after ts_manual_seed (the default generator is process-wide), so
 * every rank starts from the same parameters, as a real job does. */

typedef th_rank rank_ctx;
#define fail th_rank_fail
#define RK_OK TH_RK_OK
#define RK_EQ TH_RK_EQ

static pthread_mutex_t g_build_mu = PTHREAD_MUTEX_INITIALIZER;
static void run_world(int W, th_rank_fn fn, void *arg) { th_run_world(W, fn, arg, 60.0); }

/* ------------------------------------------------------------ models */

/* Sequential(Linear(in, hid), Tanh, Linear(hid, hid), Tanh, Linear(hid, out)) */
typedef struct mlp {
    ts_module *root;
    ts_module *lin[3];
} mlp;

static ts_status mlp_new(uint64_t seed, int64_t in, int64_t hid, int64_t out, mlp *m)
{
    pthread_mutex_lock(&g_build_mu);
    ts_manual_seed(seed);
    ts_module *c[5] = {0};
    ts_status st = ts_linear_new(in, hid, true, &c[0]);
    if (!st) st = ts_tanh_new(&c[1]);
    if (!st) st = ts_linear_new(hid, hid, true, &c[2]);
    if (!st) st = ts_tanh_new(&c[3]);
    if (!st) st = ts_linear_new(hid, out, true, &c[4]);
    if (!st) st = ts_sequential_new(5, c, &m->root);
    pthread_mutex_unlock(&g_build_mu);
    if (st) return st;
    m->lin[0] = c[0], m->lin[1] = c[2], m->lin[2] = c[4];
    return TS_OK;
}

static ts_status mse(ts_module *m, ts_tensor *x, ts_tensor *y, ts_tensor **loss)
{
    ts_tensor *o = NULL;
    ts_status st = ts_module_call1(m, x, &o);
    if (st) return st;
    st = ts_mse_loss(o, y, TS_REDUCTION_MEAN, loss);
    ts_tensor_free(o);
    return st;
}

static int close_to(rank_ctx *rc, const char *what, const float *got, const float *want, int64_t n, double tol)
{
    for (int64_t i = 0; i < n; i++)
        if (!(fabs((double)got[i] - (double)want[i]) <= tol * fmax(1.0, fabs((double)want[i]))))
            return fail(rc, "%s[%lld]: got %.9g, want %.9g", what, (long long)i, (double)got[i], (double)want[i]);
    return 0;
}

/* ------------------------------------------------------------ one rank */

/* Seed 003's smoke test: without an initialized world fully_shard uses a
 * one-rank mesh, the type name gains FSDPModule, forward, backward and an
 * optimizer step work, and a second application is refused. */
Test(fully_shard, one_rank_without_world, .timeout = 60)
{
    th_mem_mark();
    ts_manual_seed(0);
    ts_module *c[3] = {0};
    TH_OK(ts_linear_new(4, 8, true, &c[0]));
    TH_OK(ts_relu_new(&c[1]));
    TH_OK(ts_linear_new(8, 4, true, &c[2]));
    ts_module *model = NULL;
    TH_OK(ts_sequential_new(3, c, &model));
    ts_state_dict *before = NULL;
    TH_OK(ts_module_state_dict(model, &before));
    TH_OK(ts_fully_shard(model, NULL));
    cr_assert_str_eq(ts_module_type_name(model), "SequentialFSDPModule");
    cr_assert(ts_module_is_fsdp(model));
    cr_assert_str_eq(ts_fsdp_original_vtable(model)->type_name, "Sequential");
    ts_state_dict *after = NULL;
    TH_OK(ts_module_state_dict(model, &after));
    cr_assert_eq(ts_state_dict_size(before), ts_state_dict_size(after));
    for (int i = 0; i < ts_state_dict_size(before); i++)
        cr_assert_str_eq(ts_state_dict_name(before, i), ts_state_dict_name(after, i));
    ts_state_dict_free(before);
    ts_state_dict_free(after);

    /* the optimizer is built from the sharded parameters, before use */
    ts_named_params np;
    TH_OK(ts_module_named_parameters(model, &np));
    ts_tensor *params[8];
    for (int i = 0; i < np.n; i++) params[i] = *np.items[i].slot;
    ts_sgd_options so = ts_sgd_options_default();
    so.lr = 0.1;
    ts_optim *opt = NULL;
    TH_OK(ts_sgd_new(np.n, params, &so, &opt));
    int64_t xs[2] = {2, 4};
    ts_tensor *x = NULL, *out = NULL, *loss = NULL;
    TH_OK(ts_randn(TS_F32, 2, xs, NULL, &x));
    TH_OK(ts_module_call1(model, x, &out));
    cr_assert_eq(ts_tensor_size(out, 0), 2);
    cr_assert_eq(ts_tensor_size(out, 1), 4);
    TH_OK(ts_sum(out, 0, NULL, false, &loss));
    TH_OK(ts_backward(loss, NULL, false));
    for (int i = 0; i < np.n; i++)
        cr_assert_not_null(ts_tensor_grad(params[i]), "%s has no gradient", np.items[i].name);
    TH_OK(ts_optim_step(opt));
    cr_assert_eq(ts_fully_shard(model, NULL), TS_ERR_ALREADY);
    cr_assert(strstr(ts_last_error(), "fully_shard has already been applied"), "%s", ts_last_error());
    ts_named_params_free(&np);
    ts_optim_free(opt);
    ts_tensor_free(x);
    ts_tensor_free(out);
    ts_tensor_free(loss);
    ts_module_free(model);
    th_mem_assert_back();
}

/* ------------------------------------------------------------ seed 003 */

/* A sharded Linear(8, 8) on W ranks: shard shapes, gradient slices and one
 * SGD step, against an unsharded reference with the same weights and
 * data (seed 003's "sharded step, verified"). */
static int rank_sharded_step(rank_ctx *rc)
{
    ts_mesh *mesh = th_rank_mesh(rc, false);
    if (!mesh) return fail(rc, "mesh: %s", ts_last_error());
    ts_module *ref = NULL, *model = NULL;
    pthread_mutex_lock(&g_build_mu);
    ts_manual_seed(42);
    ts_status s1 = ts_linear_new(8, 8, true, &ref);
    ts_manual_seed(42);
    ts_status s2 = ts_linear_new(8, 8, true, &model);
    pthread_mutex_unlock(&g_build_mu);
    RK_OK(rc, s1);
    RK_OK(rc, s2);
    ts_tensor *x = th_batch(0, 4, 8, th_xval);
    ts_fsdp_options o = ts_fsdp_options_default();
    o.mesh = mesh;
    RK_OK(rc, ts_fully_shard(model, &o));
    ts_nn_linear *lin = (ts_nn_linear *)model, *rl = (ts_nn_linear *)ref;
    int64_t start, len;
    ts_chunk_range(8, rc->W, rc->rank, &start, &len);
    RK_EQ(rc, ts_tensor_size(lin->weight, 0), len);
    RK_EQ(rc, ts_tensor_size(lin->weight, 1), 8);
    RK_EQ(rc, ts_tensor_size(lin->bias, 0), len);
    const ts_dtensor *dt = ts_fsdp_param_dtensor(lin->weight);
    if (!dt) return fail(rc, "the sharded weight carries no DTensor");
    RK_EQ(rc, ts_dtensor_shape(dt)[0], 8);
    RK_EQ(rc, ts_dtensor_placements(dt)[0].kind, TS_PLACEMENT_SHARD);
    RK_EQ(rc, ts_dtensor_local_offset(dt, 0), start);
    ts_tensor *fullw = NULL; /* the DTensor gathers the whole weight (collective) */
    RK_OK(rc, ts_dtensor_full_tensor(dt, &fullw));
    if (close_to(rc, "dtensor full weight", ts_tensor_data(fullw), ts_tensor_data(((ts_nn_linear *)ref)->weight), 64,
                 0))
        return 1;
    ts_tensor_free(fullw);

    ts_tensor *y = NULL, *ly = NULL, *ry = NULL, *rly = NULL;
    RK_OK(rc, ts_module_call1(model, x, &y));
    RK_OK(rc, ts_sum(y, 0, NULL, false, &ly));
    RK_OK(rc, ts_backward(ly, NULL, false));
    RK_OK(rc, ts_module_call1(ref, x, &ry));
    RK_OK(rc, ts_sum(ry, 0, NULL, false, &rly));
    RK_OK(rc, ts_backward(rly, NULL, false));
    /* gradient shards = rows of the full gradient (every rank had the same
     * data, so the average is the gradient itself) */
    ts_tensor *gw = ts_tensor_grad(lin->weight), *gb = ts_tensor_grad(lin->bias);
    if (!gw || !gb) return fail(rc, "no gradient on the shards");
    RK_EQ(rc, ts_tensor_size(gw, 0), len);
    const float *rgw = ts_tensor_data(ts_tensor_grad(rl->weight)), *rgb = ts_tensor_data(ts_tensor_grad(rl->bias));
    if (close_to(rc, "grad weight", ts_tensor_data(gw), rgw + start * 8, len * 8, 1e-6)) return 1;
    if (close_to(rc, "grad bias", ts_tensor_data(gb), rgb + start, len, 1e-6)) return 1;
    /* clipping: the same total norm as the unsharded gradients, and the
     * same clipped values */
    double tot = 0, rtot = 0;
    ts_tensor *rps0[2] = {rl->weight, rl->bias};
    RK_OK(rc, ts_fsdp_clip_grad_norm(model, 0.5, &tot));
    RK_OK(rc, ts_clip_grad_norm(2, rps0, 0.5, &rtot));
    if (!(fabs(tot - rtot) <= 1e-5 * rtot)) return fail(rc, "total norm %.9g, reference %.9g", tot, rtot);
    if (!(rtot > 0.5)) return fail(rc, "the test needs clipping (total %g)", rtot);
    if (close_to(rc, "clipped grad", ts_tensor_data(gw), rgw + start * 8, len * 8, 1e-5)) return 1;
    /* one SGD step on the shards and on the reference */
    ts_sgd_options so = ts_sgd_options_default();
    so.lr = 0.1;
    ts_tensor *ps[2] = {lin->weight, lin->bias}, *rps[2] = {rl->weight, rl->bias};
    ts_optim *opt = NULL, *ropt = NULL;
    RK_OK(rc, ts_sgd_new(2, ps, &so, &opt));
    RK_OK(rc, ts_sgd_new(2, rps, &so, &ropt));
    RK_OK(rc, ts_optim_step(opt));
    RK_OK(rc, ts_optim_step(ropt));
    RK_OK(rc, ts_fsdp_unshard(model, false, NULL));
    RK_EQ(rc, ts_tensor_size(lin->weight, 0), 8);
    if (close_to(rc, "weight after step", ts_tensor_data(lin->weight), ts_tensor_data(rl->weight), 64, 1e-6)) return 1;
    if (close_to(rc, "bias after step", ts_tensor_data(lin->bias), ts_tensor_data(rl->bias), 8, 1e-6)) return 1;
    RK_OK(rc, ts_fsdp_reshard(model));
    RK_EQ(rc, ts_tensor_size(lin->weight, 0), len);
    ts_optim_free(opt);
    ts_optim_free(ropt);
    ts_tensor_free(x);
    ts_tensor_free(y);
    ts_tensor_free(ly);
    ts_tensor_free(ry);
    ts_tensor_free(rly);
    ts_module_free(model);
    ts_module_free(ref);
    ts_mesh_free(mesh);
    return 0;
}

Test(fully_shard, sharded_step_matches_unsharded_reference, .timeout = 120)
{
    for (int W = 1; W <= 4; W++) run_world(W, rank_sharded_step, NULL);
}

/* ------------------------------------------------------------ training */

typedef struct train_arg {
    int steps;
    bool hsdp; /* a 2-d (replicate, shard) mesh at W = 4 */
    ts_reshard_policy policy;
    bool prefetch; /* implicit prefetch on */
} train_arg;

#define IN 6
#define HID 10
#define OUT 3
#define ROWS 12 /* global batch; divides by 1, 2, 3 and 4 */

/* SGD with momentum: unlike Adam, its steps scale with the gradient, so a
 * wrong gradient division shows. */
static ts_status make_optim(int n, ts_tensor *const *ps, ts_optim **out)
{
    ts_sgd_options so = ts_sgd_options_default();
    so.lr = 0.05;
    so.momentum = 0.9;
    so.weight_decay = 0.01;
    return ts_sgd_new(n, ps, &so, out);
}

/* Reference: one process, the whole batch, SGD; writes every parameter,
 * flattened in named_parameters order, into ref (at most cap floats). */
static ts_status train_reference(int steps, float *ref, int64_t cap, int64_t *n_out)
{
    mlp m;
    ts_status st = mlp_new(7, IN, HID, OUT, &m);
    if (st) return st;
    ts_named_params np;
    if ((st = ts_module_named_parameters(m.root, &np))) return st;
    ts_tensor *ps[16];
    for (int i = 0; i < np.n; i++) ps[i] = *np.items[i].slot;
    ts_optim *opt = NULL;
    if ((st = make_optim(np.n, ps, &opt))) return st;
    ts_tensor *x = th_batch(0, ROWS, IN, th_xval), *y = th_batch(0, ROWS, OUT, th_yval);
    for (int s = 0; s < steps && !st; s++) {
        ts_tensor *loss = NULL;
        ts_optim_zero_grad(opt, true);
        if (!(st = mse(m.root, x, y, &loss)) && !(st = ts_backward(loss, NULL, false))) st = ts_optim_step(opt);
        ts_tensor_free(loss);
    }
    int64_t n = 0;
    for (int i = 0; i < np.n && !st; i++) {
        int64_t k = ts_tensor_numel(ps[i]);
        if (n + k > cap) return TS_ERR_INDEX;
        memcpy(ref + n, ts_tensor_data(ps[i]), (size_t)k * sizeof(float));
        n += k;
    }
    *n_out = n;
    ts_tensor_free(x);
    ts_tensor_free(y);
    ts_optim_free(opt);
    ts_named_params_free(&np);
    ts_module_free(m.root);
    return st;
}

/* Each rank trains on its slice of the batch; gradients are averaged over
 * the ranks, so W ranks with ROWS/W rows each take the same steps as one
 * process with ROWS rows (the loss is a mean). */
static int rank_train(rank_ctx *rc)
{
    const train_arg *a = rc->arg;
    float ref[512];
    int64_t nref = 0;
    RK_OK(rc, train_reference(a->steps, ref, 512, &nref));
    ts_mesh *mesh = NULL;
    if (a->hsdp) {
        int64_t shape[2] = {2, rc->W / 2};
        const char *names[2] = {"replicate", "shard"};
        RK_OK(rc, ts_mesh_new(rc->c, "cpu", 2, shape, names, &mesh));
    } else if (!(mesh = th_rank_mesh(rc, false))) {
        return fail(rc, "mesh: %s", ts_last_error());
    }
    mlp m;
    RK_OK(rc, mlp_new(7, IN, HID, OUT, &m));
    ts_fsdp_options o = ts_fsdp_options_default();
    o.mesh = mesh;
    o.reshard_after_forward = a->policy;
    o.reshard_every_n = 2;
    RK_OK(rc, ts_fully_shard_each(3, m.lin, &o));
    RK_OK(rc, ts_fully_shard(m.root, &o));
    RK_OK(rc, ts_fsdp_set_implicit_prefetch(m.root, a->prefetch, a->prefetch));
    ts_named_params np;
    RK_OK(rc, ts_module_named_parameters(m.root, &np));
    ts_tensor *ps[16];
    for (int i = 0; i < np.n; i++) ps[i] = *np.items[i].slot;
    ts_optim *opt = NULL;
    RK_OK(rc, make_optim(np.n, ps, &opt));
    /* the data-parallel rank: its slice of the global batch */
    int dp = rc->rank, ndp = rc->W;
    int64_t rows = ROWS / ndp;
    ts_tensor *x = th_batch(dp * rows, rows, IN, th_xval), *y = th_batch(dp * rows, rows, OUT, th_yval);
    for (int s = 0; s < a->steps; s++) {
        ts_tensor *loss = NULL;
        ts_optim_zero_grad(opt, true);
        RK_OK(rc, mse(m.root, x, y, &loss));
        RK_OK(rc, ts_backward(loss, NULL, false));
        RK_OK(rc, ts_optim_step(opt));
        ts_tensor_free(loss);
    }
    ts_state_dict *sd = NULL;
    RK_OK(rc, ts_fsdp_full_state_dict(m.root, false, &sd));
    int64_t n = 0;
    for (int i = 0; i < np.n; i++) {
        ts_tensor *t = ts_state_dict_get(sd, np.items[i].name);
        if (!t) return fail(rc, "full state dict has no '%s'", np.items[i].name);
        char what[128];
        snprintf(what, sizeof what, "W=%d %s", rc->W, np.items[i].name);
        /* the ranks' partial gradient sums differ from the one-process sums
         * in rounding only (about 1e-7 relative per gradient); after 3
         * steps the parameters agree to a few 1e-7 */
        if (close_to(rc, what, ts_tensor_data(t), ref + n, ts_tensor_numel(t), 2e-5)) return 1;
        n += ts_tensor_numel(t);
    }
    RK_EQ(rc, n, nref);
    ts_state_dict_free(sd);
    ts_named_params_free(&np);
    ts_optim_free(opt);
    ts_tensor_free(x);
    ts_tensor_free(y);
    ts_module_free(m.root);
    ts_mesh_free(mesh);
    return 0;
}

Test(fully_shard, training_on_w_ranks_equals_one_process, .timeout = 240)
{
    train_arg a = {.steps = 3, .policy = TS_RESHARD_AUTO, .prefetch = true};
    for (int W = 1; W <= 4; W++) run_world(W, rank_train, &a);
    a.prefetch = false;
    run_world(3, rank_train, &a);
    a.policy = TS_RESHARD_FALSE;
    run_world(2, rank_train, &a);
    a.policy = TS_RESHARD_EVERY_N;
    run_world(2, rank_train, &a);
}

Test(fully_shard, hsdp_training_on_a_2x2_mesh_equals_one_process, .timeout = 120)
{
    train_arg a = {.steps = 3, .hsdp = true, .policy = TS_RESHARD_TRUE, .prefetch = true};
    run_world(4, rank_train, &a);
}

/* ------------------------------------------------------------ counts */

/* Seed 003's three blocks of Sequential(Linear(6, 6), ReLU, Linear(6, 6))
 * under a root Sequential without parameters of its own. */
static ts_status blocks_new(ts_module **root, ts_module **blocks)
{
    pthread_mutex_lock(&g_build_mu);
    ts_manual_seed(0);
    ts_status st = TS_OK;
    for (int b = 0; b < 3 && !st; b++) {
        ts_module *c[3] = {0};
        if (!(st = ts_linear_new(6, 6, false, &c[0])) && !(st = ts_relu_new(&c[1])) &&
            !(st = ts_linear_new(6, 6, false, &c[2])))
            st = ts_sequential_new(3, c, &blocks[b]);
    }
    if (!st) st = ts_sequential_new(3, blocks, root);
    pthread_mutex_unlock(&g_build_mu);
    return st;
}

static ts_status count_fsdp(void *ctx, const char *fqn, ts_module *m)
{
    (void)fqn;
    if (ts_module_is_fsdp(m)) ++*(int *)ctx;
    return TS_OK;
}

static int rank_counts(rank_ctx *rc)
{
    const ts_reshard_policy *pol = rc->arg;
    ts_mesh *mesh = th_rank_mesh(rc, false);
    ts_module *root = NULL, *blocks[3];
    RK_OK(rc, blocks_new(&root, blocks));
    ts_fsdp_options o = ts_fsdp_options_default();
    o.mesh = mesh;
    o.reshard_after_forward = *pol;
    RK_OK(rc, ts_fully_shard_each(3, blocks, &o));
    RK_OK(rc, ts_fully_shard(root, &o));
    int units = 0;
    RK_OK(rc, ts_module_named_modules(root, count_fsdp, &units));
    RK_EQ(rc, units, 4);
    ts_fsdp_group_info gi;
    RK_OK(rc, ts_fsdp_group_info_get(root, &gi));
    RK_EQ(rc, gi.n_params, 0);
    ts_comm *g = ts_mesh_group(mesh, NULL);
    ts_comm_stats_reset(g);
    int64_t xs[2] = {2, 6};
    ts_tensor *x = NULL, *out = NULL, *loss = NULL;
    RK_OK(rc, ts_tensor_ones(TS_F32, 2, xs, &x));
    RK_OK(rc, ts_module_call1(root, x, &out));
    ts_comm_counters fwd, bwd;
    ts_comm_stats(g, &fwd);
    RK_OK(rc, ts_sum(out, 0, NULL, false, &loss));
    RK_OK(rc, ts_backward(loss, NULL, false));
    ts_comm_stats(g, &bwd);
    RK_EQ(rc, fwd.calls[TS_COLL_ALL_GATHER], 3);
    RK_EQ(rc, fwd.calls[TS_COLL_REDUCE_SCATTER], 0);
    RK_EQ(rc, bwd.calls[TS_COLL_ALL_GATHER] - fwd.calls[TS_COLL_ALL_GATHER], *pol == TS_RESHARD_FALSE ? 0 : 3);
    RK_EQ(rc, bwd.calls[TS_COLL_REDUCE_SCATTER], 3);
    RK_EQ(rc, bwd.calls[TS_COLL_ALL_REDUCE], 0);
    ts_tensor_free(x);
    ts_tensor_free(out);
    ts_tensor_free(loss);
    ts_module_free(root);
    ts_mesh_free(mesh);
    return 0;
}

/* Three blocks sharded one group each and a root without parameters: the
 * forward issues 3 all-gathers, the backward 3 more and 3 reduce-scatters;
 * with reshard_after_forward false the backward issues no all-gather; the
 * root issues none; the tree holds 4 FSDP modules. */
Test(fully_shard, collective_counts_of_three_blocks, .timeout = 60)
{
    ts_reshard_policy t = TS_RESHARD_TRUE, f = TS_RESHARD_FALSE, a = TS_RESHARD_AUTO;
    run_world(2, rank_counts, &t);
    run_world(2, rank_counts, &f);
    run_world(3, rank_counts, &a);
}

/* ------------------------------------------------------------ events */

#define MAX_EV 64
static _Thread_local int tl_rank = -1;
static char g_ev[TH_MAXW][MAX_EV][64];
static int g_n_ev[TH_MAXW];

static void record(void *ctx, const char *ev, const char *fqn)
{
    (void)ctx;
    if (tl_rank < 0 || g_n_ev[tl_rank] >= MAX_EV) return;
    if (strcmp(ev, "unshard") && strcmp(ev, "post_backward") && strcmp(ev, "pre_forward")) return;
    snprintf(g_ev[tl_rank][g_n_ev[tl_rank]++], 64, "%s %s", ev, *fqn ? fqn : "root");
}

typedef struct ev_arg {
    bool prefetch;
    const char *const *want_fwd, *const *want_bwd;
    bool explicit_lists; /* block i prefetches block i+1 forward, i-1 backward */
} ev_arg;

/* PyTorch's TestFullyShardPrefetch model: a root with parameters (an input
 * and an output Linear) around 3 blocks, every module sharded with
 * reshard_after_forward true; the events of the second iteration are
 * checked (the first records the forward order the prefetch follows). */
static int rank_events(rank_ctx *rc)
{
    const ev_arg *a = rc->arg;
    tl_rank = rc->rank;
    ts_mesh *mesh = th_rank_mesh(rc, false);
    ts_module *blocks[3], *inner = NULL, *root = NULL, *c[3] = {0};
    RK_OK(rc, blocks_new(&inner, blocks));
    pthread_mutex_lock(&g_build_mu);
    ts_status s1 = ts_linear_new(6, 6, true, &c[0]);
    ts_status s2 = ts_linear_new(6, 6, true, &c[2]);
    pthread_mutex_unlock(&g_build_mu);
    RK_OK(rc, s1);
    RK_OK(rc, s2);
    c[1] = inner;
    RK_OK(rc, ts_sequential_new(3, c, &root));
    ts_fsdp_options o = ts_fsdp_options_default();
    o.mesh = mesh;
    o.reshard_after_forward = TS_RESHARD_TRUE;
    RK_OK(rc, ts_fully_shard_each(3, blocks, &o));
    RK_OK(rc, ts_fully_shard(root, &o));
    RK_OK(rc, ts_fsdp_set_implicit_prefetch(root, a->prefetch, a->prefetch));
    if (a->explicit_lists) {
        RK_OK(rc, ts_fsdp_set_modules_to_forward_prefetch(blocks[0], 1, &blocks[1]));
        RK_OK(rc, ts_fsdp_set_modules_to_forward_prefetch(blocks[1], 1, &blocks[2]));
        RK_OK(rc, ts_fsdp_set_modules_to_backward_prefetch(blocks[2], 1, &blocks[1]));
        RK_OK(rc, ts_fsdp_set_modules_to_backward_prefetch(blocks[1], 1, &blocks[0]));
        RK_EQ(rc, ts_fsdp_set_modules_to_forward_prefetch(blocks[0], 1, &inner), TS_ERR_INVALID_ARGUMENT);
    }
    int64_t xs[2] = {2, 6};
    ts_tensor *x = NULL;
    RK_OK(rc, ts_tensor_ones(TS_F32, 2, xs, &x));
    for (int it = 0; it < 2; it++) {
        ts_tensor *out = NULL, *loss = NULL;
        g_n_ev[rc->rank] = 0;
        RK_OK(rc, ts_module_call1(root, x, &out));
        int nf = g_n_ev[rc->rank];
        RK_OK(rc, ts_sum(out, 0, NULL, false, &loss));
        RK_OK(rc, ts_backward(loss, NULL, false));
        if (it == 1) {
            int k = 0;
            for (; a->want_fwd[k]; k++)
                if (k >= nf || strcmp(g_ev[rc->rank][k], a->want_fwd[k]))
                    return fail(rc, "forward event %d: got '%s', want '%s'", k, k < nf ? g_ev[rc->rank][k] : "(none)",
                                a->want_fwd[k]);
            RK_EQ(rc, nf, k);
            int j = 0;
            for (int e = nf; e < g_n_ev[rc->rank]; e++) {
                if (!a->want_bwd[j]) return fail(rc, "extra backward event '%s'", g_ev[rc->rank][e]);
                if (strcmp(g_ev[rc->rank][e], a->want_bwd[j]))
                    return fail(rc, "backward event %d: got '%s', want '%s'", j, g_ev[rc->rank][e], a->want_bwd[j]);
                j++;
            }
            if (a->want_bwd[j]) return fail(rc, "missing backward event '%s'", a->want_bwd[j]);
        }
        ts_tensor_free(out);
        ts_tensor_free(loss);
    }
    ts_tensor_free(x);
    ts_module_free(root);
    ts_mesh_free(mesh);
    tl_rank = -1;
    return 0;
}

/* docs/fully_shard.md, "One step": PyTorch's sequence with backward prefetch; with it
 * off, each group is gathered when its own backward starts. Forward
 * prefetch issues the next group's all-gather before the current group
 * computes (before its pre_forward event). */
Test(fully_shard, unshard_and_post_backward_sequence, .timeout = 60)
{
    static const char *fwd_on[] = {"pre_forward root", "unshard root",    "unshard 1.0",
                                   "pre_forward 1.0",  "unshard 1.1",     "pre_forward 1.1",
                                   "unshard 1.2",      "pre_forward 1.2", NULL};
    static const char *bwd_on[] = {"unshard root",      "unshard 1.2",        "unshard 1.1",
                                   "post_backward 1.2", "unshard 1.0",        "post_backward 1.1",
                                   "post_backward 1.0", "post_backward root", NULL};
    static const char *fwd_off[] = {"pre_forward root", "unshard root",    "pre_forward 1.0",
                                    "unshard 1.0",      "pre_forward 1.1", "unshard 1.1",
                                    "pre_forward 1.2",  "unshard 1.2",     NULL};
    static const char *bwd_off[] = {"unshard root",      "unshard 1.2",        "post_backward 1.2",
                                    "unshard 1.1",       "post_backward 1.1",  "unshard 1.0",
                                    "post_backward 1.0", "post_backward root", NULL};
    /* explicit lists, implicit prefetch off: each block gathers the next
     * right after its own unshard; backward as with the implicit order */
    static const char *fwd_ex[] = {"pre_forward root", "unshard root", "pre_forward 1.0", "unshard 1.0", "unshard 1.1",
                                   "pre_forward 1.1",  "unshard 1.2",  "pre_forward 1.2", NULL};
    ts_fsdp_set_event_hook(record, NULL);
    ev_arg on = {true, fwd_on, bwd_on, false}, off = {false, fwd_off, bwd_off, false},
           ex = {false, fwd_ex, bwd_on, true};
    run_world(2, rank_events, &on);
    run_world(2, rank_events, &off);
    run_world(2, rank_events, &ex);
    ts_fsdp_set_event_hook(NULL, NULL);
}

/* ------------------------------------------------------------ errors */

static ts_status lin_pair(uint64_t seed, ts_module **a, ts_module **b)
{
    pthread_mutex_lock(&g_build_mu);
    ts_manual_seed(seed);
    ts_status st = ts_linear_new(8, 8, true, a);
    if (!st) st = ts_linear_new(8, 8, true, b);
    pthread_mutex_unlock(&g_build_mu);
    return st;
}

static int rank_errors(rank_ctx *rc)
{
    ts_mesh *mesh = th_rank_mesh(rc, false);
    ts_fsdp_options o = ts_fsdp_options_default();
    o.mesh = mesh;
    o.reshard_after_forward = TS_RESHARD_TRUE;
    ts_module *a = NULL, *b = NULL;
    RK_OK(rc, lin_pair(1, &a, &b));
    /* bad options: nothing changes */
    ts_fsdp_options bad = o;
    bad.reshard_after_forward = TS_RESHARD_EVERY_N;
    bad.reshard_every_n = 0;
    RK_EQ(rc, ts_fully_shard(a, &bad), TS_ERR_INVALID_ARGUMENT);
    if (!strstr(ts_last_error(), "N >= 1")) return fail(rc, "message: %s", ts_last_error());
    bad = o;
    ts_mp_policy bad_mp = ts_mp_policy_default();
    bad_mp.param_dtype = TS_I64;
    bad.mp_policy = &bad_mp;
    RK_EQ(rc, ts_fully_shard(a, &bad), TS_ERR_DTYPE);
    RK_EQ(rc, ts_module_is_fsdp(a), 0);
    RK_EQ(rc, ts_fully_shard(NULL, &o), TS_ERR_INVALID_ARGUMENT);
    /* a 3-d mesh */
    if (rc->W == 2) {
        int64_t shape[3] = {1, 1, 2};
        const char *names[3] = {"a", "b", "c"};
        ts_mesh *m3 = NULL;
        RK_OK(rc, ts_mesh_new(rc->c, "cpu", 3, shape, names, &m3));
        bad = o;
        bad.mesh = m3;
        RK_EQ(rc, ts_fully_shard(a, &bad), TS_ERR_INVALID_ARGUMENT);
        if (!strstr(ts_last_error(), "3 dims")) return fail(rc, "message: %s", ts_last_error());
        ts_mesh_free(m3);
    }
    /* twice */
    RK_OK(rc, ts_fully_shard(a, &o));
    RK_EQ(rc, ts_fully_shard(a, &o), TS_ERR_ALREADY);
    if (!strstr(ts_last_error(), "fully_shard has already been applied"))
        return fail(rc, "message: %s", ts_last_error());
    /* the layer's own forward on sharded parameters */
    ts_tensor *x = th_batch(0, 2, 8, th_xval), *outs[TS_MODULE_MAX_IO];
    int n = 0;
    ts_status s = ts_fsdp_original_vtable(a)->forward(a, 1, &x, &n, outs);
    RK_EQ(rc, s, TS_ERR_SHARDED);
    if (!strstr(ts_last_error(), "ts_module_call")) return fail(rc, "message: %s", ts_last_error());
    /* inputs of a wrong shape: the layer's error, and the module still
     * works afterwards */
    ts_tensor *xw = th_batch(0, 2, 5, th_xval), *y = NULL;
    RK_EQ(rc, ts_module_call1(a, xw, &y), TS_ERR_SHAPE);
    int64_t start, len;
    ts_chunk_range(8, rc->W, rc->rank, &start, &len);
    RK_EQ(rc, ts_tensor_size(((ts_nn_linear *)a)->weight, 0), len); /* resharded */
    RK_OK(rc, ts_module_call1(a, x, &y));
    ts_tensor_free(y);
    /* a tied weight sharded in two calls */
    ts_nn_linear *lb = (ts_nn_linear *)b;
    ts_module *c = NULL, *d = NULL;
    RK_OK(rc, lin_pair(2, &c, &d));
    ts_nn_linear *lc = (ts_nn_linear *)c, *ld = (ts_nn_linear *)d;
    ts_tensor_free(ld->weight);
    ld->weight = ts_tensor_retain(lc->weight);
    RK_OK(rc, ts_fully_shard(c, &o));
    RK_EQ(rc, ts_fully_shard(d, &o), TS_ERR_INVALID_ARGUMENT);
    if (!strstr(ts_last_error(), "shared") || !strstr(ts_last_error(), "one call"))
        return fail(rc, "message: %s", ts_last_error());
    RK_EQ(rc, ts_module_is_fsdp(d), 0);
    (void)lb;
    ts_tensor_free(x);
    ts_tensor_free(xw);
    ts_module_free(a);
    ts_module_free(b);
    ts_module_free(c);
    ts_module_free(d);
    ts_mesh_free(mesh);
    return 0;
}

Test(fully_shard, errors, .timeout = 60)
{
    th_mem_mark();
    run_world(1, rank_errors, NULL);
    run_world(2, rank_errors, NULL);
    th_mem_assert_back();
}

/* ------------------------------------------------------------ tied weights */

/* Two Linears sharing one weight, sharded together (ts_fully_shard_group):
 * one group; the shared weight's gradient is the sum of both uses, as in
 * an unsharded model. */
static int rank_tied(rank_ctx *rc)
{
    ts_mesh *mesh = th_rank_mesh(rc, false);
    ts_module *a = NULL, *b = NULL, *ra = NULL, *rb = NULL;
    RK_OK(rc, lin_pair(3, &a, &b));
    RK_OK(rc, lin_pair(3, &ra, &rb));
    ts_nn_linear *la = (ts_nn_linear *)a, *lb = (ts_nn_linear *)b, *rla = (ts_nn_linear *)ra, *rlb = (ts_nn_linear *)rb;
    ts_tensor_free(lb->weight);
    lb->weight = ts_tensor_retain(la->weight);
    ts_tensor_free(rlb->weight);
    rlb->weight = ts_tensor_retain(rla->weight);
    ts_fsdp_options o = ts_fsdp_options_default();
    o.mesh = mesh;
    ts_module *both[2] = {a, b};
    RK_OK(rc, ts_fully_shard_group(2, both, &o));
    if (!ts_module_is_fsdp(a) || !ts_module_is_fsdp(b)) return fail(rc, "not both rewritten");
    if (la->weight != lb->weight) return fail(rc, "the tied slots hold different shards");
    ts_fsdp_group_info gi;
    RK_OK(rc, ts_fsdp_group_info_get(a, &gi));
    RK_EQ(rc, gi.n_params, 3); /* the weight once, two biases */
    ts_tensor *x = th_batch(0, 3, 8, th_xval);
    ts_module *mods[2] = {a, b}, *refs[2] = {ra, rb};
    for (int k = 0; k < 2; k++) {
        ts_module **ms = k ? refs : mods;
        ts_tensor *h = NULL, *o2 = NULL, *l = NULL;
        RK_OK(rc, ts_module_call1(ms[0], x, &h));
        RK_OK(rc, ts_module_call1(ms[1], h, &o2));
        RK_OK(rc, ts_sum(o2, 0, NULL, false, &l));
        RK_OK(rc, ts_backward(l, NULL, false));
        ts_tensor_free(h);
        ts_tensor_free(o2);
        ts_tensor_free(l);
    }
    int64_t start, len;
    ts_chunk_range(8, rc->W, rc->rank, &start, &len);
    ts_tensor *g = ts_tensor_grad(la->weight);
    if (!g) return fail(rc, "no gradient on the tied shard");
    if (close_to(rc, "tied grad", ts_tensor_data(g),
                 (const float *)ts_tensor_data(ts_tensor_grad(rla->weight)) + start * 8, len * 8, 1e-5))
        return 1;
    ts_tensor_free(x);
    ts_module_free(a);
    ts_module_free(b);
    ts_module_free(ra);
    ts_module_free(rb);
    ts_mesh_free(mesh);
    return 0;
}

Test(fully_shard, tied_weights_in_one_group, .timeout = 60)
{
    for (int W = 1; W <= 3; W++) run_world(W, rank_tied, NULL);
}

/* ------------------------------------------------------------ policies */

/* reshard_after_forward every 2 forwards: unsharded after the first,
 * resharded after the second; two forwards then one backward give the
 * gradient of the sum of both losses, and gradients accumulate across
 * backwards until zeroed. */
static int rank_every_n(rank_ctx *rc)
{
    ts_mesh *mesh = th_rank_mesh(rc, false);
    ts_module *a = NULL, *ref = NULL;
    RK_OK(rc, lin_pair(4, &a, &ref));
    ts_module_free(ref);
    pthread_mutex_lock(&g_build_mu);
    ts_manual_seed(4);
    ts_status s0 = ts_linear_new(8, 8, true, &ref);
    pthread_mutex_unlock(&g_build_mu);
    RK_OK(rc, s0);
    ts_fsdp_options o = ts_fsdp_options_default();
    o.mesh = mesh;
    o.reshard_after_forward = TS_RESHARD_EVERY_N;
    o.reshard_every_n = 2;
    RK_OK(rc, ts_fully_shard(a, &o));
    ts_nn_linear *la = (ts_nn_linear *)a, *lr = (ts_nn_linear *)ref;
    int64_t start, len;
    ts_chunk_range(8, rc->W, rc->rank, &start, &len);
    ts_tensor *x1 = th_batch(0, 2, 8, th_xval), *x2 = th_batch(5, 3, 8, th_xval);
    ts_comm *g = ts_mesh_group(mesh, NULL);
    for (int pass = 0; pass < 2; pass++) {
        ts_comm_stats_reset(g);
        ts_tensor *y1 = NULL, *y2 = NULL, *l1 = NULL, *l2 = NULL, *l = NULL;
        RK_OK(rc, ts_module_call1(a, x1, &y1));
        RK_EQ(rc, ts_tensor_size(la->weight, 0), 8); /* still unsharded */
        RK_OK(rc, ts_module_call1(a, x2, &y2));
        RK_EQ(rc, ts_tensor_size(la->weight, 0), len); /* the 2nd forward resharded */
        RK_OK(rc, ts_sum(y1, 0, NULL, false, &l1));
        RK_OK(rc, ts_sum(y2, 0, NULL, false, &l2));
        RK_OK(rc, ts_add(l1, l2, &l));
        RK_OK(rc, ts_backward(l, NULL, false));
        ts_comm_counters cc;
        ts_comm_stats(g, &cc);
        /* 1 forward + 1 backward: the second forward's pre-backward gathers
         * again; the first's finds the group unsharded, since the inputs
         * need no grad and the reduction waits for the end of backward */
        RK_EQ(rc, cc.calls[TS_COLL_ALL_GATHER], 2);
        RK_EQ(rc, cc.calls[TS_COLL_REDUCE_SCATTER], 1);
        RK_EQ(rc, ts_tensor_size(la->weight, 0), len);
        ts_tensor_free(y1), ts_tensor_free(y2), ts_tensor_free(l1), ts_tensor_free(l2), ts_tensor_free(l);
        /* the reference, once per pass too */
        RK_OK(rc, ts_module_call1(ref, x1, &y1));
        RK_OK(rc, ts_module_call1(ref, x2, &y2));
        RK_OK(rc, ts_sum(y1, 0, NULL, false, &l1));
        RK_OK(rc, ts_sum(y2, 0, NULL, false, &l2));
        RK_OK(rc, ts_add(l1, l2, &l));
        RK_OK(rc, ts_backward(l, NULL, false));
        ts_tensor_free(y1), ts_tensor_free(y2), ts_tensor_free(l1), ts_tensor_free(l2), ts_tensor_free(l);
        /* after pass 1 the gradients hold two passes' sums */
        if (close_to(rc, "grad weight", ts_tensor_data(ts_tensor_grad(la->weight)),
                     (const float *)ts_tensor_data(ts_tensor_grad(lr->weight)) + start * 8, len * 8, 1e-5))
            return 1;
        if (close_to(rc, "grad bias", ts_tensor_data(ts_tensor_grad(la->bias)),
                     (const float *)ts_tensor_data(ts_tensor_grad(lr->bias)) + start, len, 1e-5))
            return 1;
    }
    ts_module_zero_grad(a, true);
    if (ts_tensor_grad(la->weight)) return fail(rc, "zero_grad(set_to_none) left a gradient");
    ts_tensor_free(x1);
    ts_tensor_free(x2);
    ts_module_free(a);
    ts_module_free(ref);
    ts_mesh_free(mesh);
    return 0;
}

Test(fully_shard, reshard_every_n_forwards_and_accumulation, .timeout = 60)
{
    for (int W = 1; W <= 3; W++) run_world(W, rank_every_n, NULL);
}

/* ------------------------------------------------------------ uneven */

static int rank_uneven(rank_ctx *rc)
{
    ts_mesh *mesh = th_rank_mesh(rc, false);
    ts_module *a = NULL;
    pthread_mutex_lock(&g_build_mu);
    ts_manual_seed(5);
    ts_status s0 = ts_linear_new(3, 3, false, &a);
    pthread_mutex_unlock(&g_build_mu);
    RK_OK(rc, s0);
    ts_fsdp_options o = ts_fsdp_options_default();
    o.mesh = mesh;
    RK_OK(rc, ts_fully_shard(a, &o));
    ts_fsdp_group_info gi;
    RK_OK(rc, ts_fsdp_group_info_get(a, &gi));
    RK_EQ(rc, gi.shard_numel, 3);
    RK_EQ(rc, gi.padded_numel, 12);
    RK_EQ(rc, gi.padding, 3);
    RK_EQ(rc, gi.numel, 9);
    ts_nn_linear *l = (ts_nn_linear *)a;
    RK_EQ(rc, ts_tensor_size(l->weight, 0), rc->rank < 3 ? 1 : 0);
    RK_EQ(rc, ts_tensor_size(l->weight, 1), 3);
    RK_EQ(rc, gi.local_numel, rc->rank < 3 ? 3 : 0);
    ts_tensor *x = th_batch(0, 2, 3, th_xval), *y = NULL, *s = NULL;
    RK_OK(rc, ts_module_call1(a, x, &y));
    RK_OK(rc, ts_sum(y, 0, NULL, false, &s));
    RK_OK(rc, ts_backward(s, NULL, false));
    ts_tensor *g = ts_tensor_grad(l->weight);
    if (!g) return fail(rc, "no gradient on the (possibly empty) shard");
    RK_EQ(rc, ts_tensor_size(g, 0), rc->rank < 3 ? 1 : 0);
    ts_tensor_free(x), ts_tensor_free(y), ts_tensor_free(s);
    ts_module_free(a);
    ts_mesh_free(mesh);
    return 0;
}

/* Seed 001's Linear(3, 3) on 4 ranks: rows 1, 1, 1, 0; each rank's
 * segment padded to 3 elements, 12 in all, 3 of them padding. */
Test(fully_shard, uneven_shards_and_padding, .timeout = 60) { run_world(4, rank_uneven, NULL); }

/* ------------------------------------------------------------ explicit */

/* A module with a named extra method: y = x * w (forward) and
 * y = 2 * x * w ("double"). */
typedef struct scale_mod {
    ts_module base;
    ts_tensor *w;
} scale_mod;

static ts_status scale_visit(ts_module *m, const ts_module_visitor *v)
{
    return v->param ? v->param(v->ctx, "w", &((scale_mod *)m)->w) : TS_OK;
}
static void scale_free(ts_module *m)
{
    ts_tensor_free(((scale_mod *)m)->w);
    free(m);
}
static ts_status scale_fwd(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    (void)n_in;
    *n_out = 1;
    return ts_mul(in[0], ((scale_mod *)m)->w, &out[0]);
}
static ts_status scale_double(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    ts_tensor *y = NULL;
    ts_status st = scale_fwd(m, n_in, in, n_out, &y);
    if (st) return st;
    st = ts_add(y, y, &out[0]);
    ts_tensor_free(y);
    return st;
}
static const ts_module_method scale_methods[] = {{"double", scale_double}};
static const ts_module_vtable scale_vt = {.type_name = "Scale",
                                          .forward = scale_fwd,
                                          .visit = scale_visit,
                                          .free = scale_free,
                                          .methods = scale_methods,
                                          .n_methods = 1};

static ts_module *scale_new(void)
{
    scale_mod *m = calloc(1, sizeof *m);
    ts_module_init(&m->base, &scale_vt);
    int64_t n = 6;
    ts_tensor *w = NULL;
    ts_tensor_arange(TS_F32, 1, 7, 1, &w);
    ts_tensor_set_requires_grad(w, true);
    (void)n;
    m->w = w;
    return &m->base;
}

static int rank_explicit(rank_ctx *rc)
{
    ts_mesh *mesh = th_rank_mesh(rc, false);
    ts_fsdp_options o = ts_fsdp_options_default();
    o.mesh = mesh;
    o.reshard_after_forward = TS_RESHARD_TRUE;
    ts_module *m = scale_new();
    RK_OK(rc, ts_fully_shard(m, &o));
    RK_OK(rc, ts_fsdp_register_forward_method(m, "nope") == TS_ERR_NOT_FOUND ? TS_OK : TS_ERR_INTERNAL);
    scale_mod *sm = (scale_mod *)m;
    int64_t start, len;
    ts_chunk_range(6, rc->W, rc->rank, &start, &len);
    /* async unshard: full after the wait, shard again after reshard */
    ts_fsdp_unshard_handle *h = NULL;
    RK_OK(rc, ts_fsdp_unshard(m, true, &h));
    if (!h) return fail(rc, "no handle from an async unshard");
    RK_OK(rc, ts_fsdp_unshard_wait(h));
    RK_EQ(rc, ts_tensor_size(sm->w, 0), 6);
    for (int i = 0; i < 6; i++)
        if (((float *)ts_tensor_data(sm->w))[i] != (float)(i + 1)) return fail(rc, "unsharded w[%d] wrong", i);
    RK_OK(rc, ts_fsdp_reshard(m));
    RK_EQ(rc, ts_tensor_size(sm->w, 0), len);
    /* the named method: refused on shards until registered */
    int64_t xs[1] = {6};
    ts_tensor *x = NULL, *outs[TS_MODULE_MAX_IO];
    RK_OK(rc, ts_tensor_ones(TS_F32, 1, xs, &x));
    int n = 0;
    RK_EQ(rc, ts_module_call_method(m, "double", 1, &x, &n, outs), TS_ERR_SHARDED);
    RK_OK(rc, ts_fsdp_register_forward_method(m, "double"));
    RK_OK(rc, ts_module_call_method(m, "double", 1, &x, &n, outs));
    RK_EQ(rc, n, 1);
    for (int i = 0; i < 6; i++)
        if (((float *)ts_tensor_data(outs[0]))[i] != 2.0f * (float)(i + 1)) return fail(rc, "double[%d] wrong", i);
    RK_EQ(rc, ts_tensor_size(sm->w, 0), len); /* resharded after the method */
    ts_tensor_free(outs[0]);
    /* summon with write-back: every rank doubles w; the shards keep it */
    ts_fsdp_summon *s = NULL;
    RK_OK(rc, ts_fsdp_summon_full_params(m, true, &s));
    RK_EQ(rc, ts_tensor_size(sm->w, 0), 6);
    for (int i = 0; i < 6; i++) ((float *)ts_tensor_data(sm->w))[i] *= 2;
    RK_OK(rc, ts_fsdp_summon_end(s));
    RK_EQ(rc, ts_tensor_size(sm->w, 0), len);
    ts_tensor *lv = NULL;
    RK_OK(rc, ts_tensor_local_view(sm->w, &lv));
    for (int64_t i = 0; i < len; i++)
        if (((float *)ts_tensor_data(lv))[i] != 2.0f * (float)(start + i + 1))
            return fail(rc, "shard after write-back [%lld] = %g", (long long)i, ((float *)ts_tensor_data(lv))[i]);
    ts_tensor_free(lv);
    /* without write-back the edit is dropped */
    RK_OK(rc, ts_fsdp_summon_full_params(m, false, &s));
    for (int i = 0; i < 6; i++) ((float *)ts_tensor_data(sm->w))[i] = -1;
    RK_OK(rc, ts_fsdp_summon_end(s));
    RK_OK(rc, ts_fsdp_unshard(m, false, NULL));
    for (int i = 0; i < 6; i++)
        if (((float *)ts_tensor_data(sm->w))[i] != 2.0f * (float)(i + 1))
            return fail(rc, "edit without write-back kept");
    RK_OK(rc, ts_fsdp_reshard(m));
    ts_tensor_free(x);
    ts_module_free(m);
    ts_mesh_free(mesh);
    return 0;
}

Test(fully_shard, explicit_unshard_summon_and_forward_method, .timeout = 60)
{
    th_mem_mark();
    for (int W = 1; W <= 4; W++) run_world(W, rank_explicit, NULL);
    th_mem_assert_back();
}

/* ------------------------------------------------------------ state dicts */

static int rank_state_dict(rank_ctx *rc)
{
    ts_mesh *mesh = th_rank_mesh(rc, false);
    mlp m, plain, m2;
    RK_OK(rc, mlp_new(11, IN, HID, OUT, &m));
    RK_OK(rc, mlp_new(99, IN, HID, OUT, &plain));
    RK_OK(rc, mlp_new(98, IN, HID, OUT, &m2));
    ts_fsdp_options o = ts_fsdp_options_default();
    o.mesh = mesh;
    RK_OK(rc, ts_fully_shard_each(3, m.lin, &o));
    RK_OK(rc, ts_fully_shard(m.root, &o));
    RK_OK(rc, ts_fully_shard_each(3, m2.lin, &o));
    RK_OK(rc, ts_fully_shard(m2.root, &o));
    ts_state_dict *full = NULL, *r0 = NULL;
    RK_OK(rc, ts_fsdp_full_state_dict(m.root, false, &full));
    RK_OK(rc, ts_fsdp_full_state_dict(m.root, true, &r0));
    RK_EQ(rc, ts_state_dict_size(full), 6);
    RK_EQ(rc, ts_state_dict_size(r0), rc->rank == 0 ? 6 : 0);
    RK_EQ(rc, ts_tensor_size(ts_state_dict_get(full, "2.weight"), 0), HID);
    /* through a safetensors file into an unsharded model */
    char path[128];
    snprintf(path, sizeof path, "/tmp/ts-fsdp-sd-%d-%d.safetensors", (int)getpid(), rc->rank);
    RK_OK(rc, ts_safetensors_save(path, full, NULL, 0));
    ts_state_dict *back = NULL;
    RK_OK(rc, ts_safetensors_load(path, &back));
    unlink(path);
    RK_OK(rc, ts_module_load_state_dict(plain.root, back, true));
    /* and into another sharded model */
    RK_OK(rc, ts_fsdp_load_full_state_dict(m2.root, back, true));
    ts_tensor *x = th_batch(0, 4, IN, th_xval), *y1 = NULL, *y2 = NULL, *y3 = NULL;
    RK_OK(rc, ts_module_call1(m.root, x, &y1));
    RK_OK(rc, ts_module_call1(plain.root, x, &y2));
    RK_OK(rc, ts_module_call1(m2.root, x, &y3));
    if (close_to(rc, "unsharded load", ts_tensor_data(y2), ts_tensor_data(y1), 4 * OUT, 1e-6)) return 1;
    if (close_to(rc, "sharded load", ts_tensor_data(y3), ts_tensor_data(y1), 4 * OUT, 1e-6)) return 1;
    /* errors: a wrong shape, a missing key */
    ts_state_dict *bad = NULL;
    RK_OK(rc, ts_state_dict_new(&bad));
    int64_t sh[2] = {3, 3};
    ts_tensor *t = NULL;
    RK_OK(rc, ts_tensor_zeros(TS_F32, 2, sh, &t));
    RK_OK(rc, ts_state_dict_set(bad, "0.weight", t));
    RK_EQ(rc, ts_fsdp_load_full_state_dict(m2.root, bad, false), TS_ERR_SHAPE);
    if (!strstr(ts_last_error(), "0.weight")) return fail(rc, "message: %s", ts_last_error());
    RK_EQ(rc, ts_fsdp_load_full_state_dict(m2.root, bad, true), TS_ERR_SHAPE);
    /* the right shape in another dtype is refused, never reinterpreted */
    int64_t wsh[2] = {HID, IN};
    ts_tensor *ti = NULL, *tf = NULL;
    RK_OK(rc, ts_tensor_zeros(TS_I32, 2, wsh, &ti));
    RK_OK(rc, ts_state_dict_set(bad, "0.weight", ti));
    RK_EQ(rc, ts_fsdp_load_full_state_dict(m2.root, bad, false), TS_ERR_DTYPE);
    if (!strstr(ts_last_error(), "0.weight") || !strstr(ts_last_error(), "int32"))
        return fail(rc, "message: %s", ts_last_error());
    /* the right shape and dtype, but the other keys are missing (strict) */
    RK_OK(rc, ts_tensor_zeros(TS_F32, 2, wsh, &tf));
    RK_OK(rc, ts_state_dict_set(bad, "0.weight", tf));
    RK_EQ(rc, ts_fsdp_load_full_state_dict(m2.root, bad, true), TS_ERR_NOT_FOUND);
    if (!strstr(ts_last_error(), "0.bias")) return fail(rc, "message: %s", ts_last_error());
    RK_OK(rc, ts_fsdp_load_full_state_dict(m2.root, bad, false));
    ts_tensor_free(ti);
    ts_tensor_free(tf);
    ts_tensor_free(t);
    ts_state_dict_free(bad);
    ts_tensor_free(x), ts_tensor_free(y1), ts_tensor_free(y2), ts_tensor_free(y3);
    ts_state_dict_free(full);
    ts_state_dict_free(r0);
    ts_state_dict_free(back);
    ts_module_free(m.root);
    ts_module_free(m2.root);
    ts_module_free(plain.root);
    ts_mesh_free(mesh);
    return 0;
}

Test(fully_shard, full_state_dict_round_trips, .timeout = 60)
{
    for (int W = 1; W <= 3; W++) run_world(W, rank_state_dict, NULL);
}

/* ------------------------------------------------------------ GPT */

#define GB 4 /* sequences in the global batch */
#define GT 8 /* tokens per sequence */

static ts_status gpt_build(ts_module **out)
{
    ts_gpt_config cfg = ts_gpt_config_default();
    cfg.vocab_size = 16, cfg.block_size = GT, cfg.n_layer = 2, cfg.n_head = 2, cfg.d_model = 16;
    cfg.tie_weights = true;
    pthread_mutex_lock(&g_build_mu);
    ts_manual_seed(3);
    ts_status st = ts_gpt_new(&cfg, out);
    pthread_mutex_unlock(&g_build_mu);
    return st;
}

/* tokens of sequences [s0, s0 + n): ids (n, GT) and next-token targets */
static void gpt_batch(int s0, int n, ts_tensor **ids, ts_tensor **tgt)
{
    int64_t sh[2] = {n, GT}, st[1] = {n * GT};
    ts_tensor_empty(TS_I64, 2, sh, ids);
    ts_tensor_empty(TS_I64, 1, st, tgt);
    int64_t *a = ts_tensor_data(*ids), *b = ts_tensor_data(*tgt);
    for (int s = 0; s < n; s++)
        for (int t = 0; t < GT; t++) {
            a[s * GT + t] = ((s0 + s) * 3 + t * 5) % 16;
            b[s * GT + t] = ((s0 + s) * 3 + (t + 1) * 5) % 16;
        }
}

static ts_status gpt_step(ts_module *m, ts_optim *opt, ts_tensor *ids, ts_tensor *tgt, double *loss_out)
{
    ts_tensor *logits = NULL, *flat = NULL, *loss = NULL;
    ts_optim_zero_grad(opt, true);
    ts_status st = ts_module_call1(m, ids, &logits);
    int64_t sh[2] = {-1, 16};
    if (!st) st = ts_reshape(logits, 2, sh, &flat);
    if (!st) st = ts_cross_entropy(flat, tgt, -100, TS_REDUCTION_MEAN, &loss);
    if (!st) st = ts_tensor_item(loss, loss_out);
    if (!st) st = ts_backward(loss, NULL, false);
    if (!st) st = ts_optim_step(opt);
    ts_tensor_free(logits), ts_tensor_free(flat), ts_tensor_free(loss);
    return st;
}

static ts_status params_of(ts_module *m, ts_tensor **ps, int *n)
{
    ts_named_params np;
    ts_status st = ts_module_named_parameters(m, &np);
    if (st) return st;
    for (int i = 0; i < np.n; i++) ps[i] = *np.items[i].slot;
    *n = np.n;
    ts_named_params_free(&np);
    return TS_OK;
}

/* A tied GPT (lm_head.weight is tok_emb.weight): blocks sharded one group
 * each, the embedding and the head together in one group, then the root;
 * 3 SGD steps on W ranks equal one process on the whole batch. Sharding
 * the embedding alone first is refused when the root (which holds the
 * head) is sharded. */
static int rank_gpt(rank_ctx *rc)
{
    ts_mesh *mesh = th_rank_mesh(rc, false);
    ts_module *ref = NULL, *m = NULL;
    RK_OK(rc, gpt_build(&ref));
    RK_OK(rc, gpt_build(&m));
    ts_fsdp_options o = ts_fsdp_options_default();
    o.mesh = mesh;
    ts_module *b0 = NULL, *b1 = NULL, *emb = NULL, *head = NULL;
    RK_OK(rc, ts_module_get_submodule(m, "blocks.0", &b0));
    RK_OK(rc, ts_module_get_submodule(m, "blocks.1", &b1));
    RK_OK(rc, ts_module_get_submodule(m, "tok_emb", &emb));
    RK_OK(rc, ts_module_get_submodule(m, "lm_head", &head));
    ts_module *blocks[2] = {b0, b1}, *tied[2] = {emb, head};
    RK_OK(rc, ts_fully_shard_each(2, blocks, &o));
    RK_OK(rc, ts_fully_shard_group(2, tied, &o));
    RK_OK(rc, ts_fully_shard(m, &o));
    ts_tensor *ps[64], *rps[64];
    int np = 0, nrp = 0;
    RK_OK(rc, params_of(m, ps, &np));
    RK_OK(rc, params_of(ref, rps, &nrp));
    RK_EQ(rc, np, nrp);
    ts_sgd_options so = ts_sgd_options_default();
    so.lr = 0.3;
    so.momentum = 0.9;
    ts_optim *opt = NULL, *ropt = NULL;
    RK_OK(rc, ts_sgd_new(np, ps, &so, &opt));
    RK_OK(rc, ts_sgd_new(nrp, rps, &so, &ropt));
    int per = GB / rc->W;
    ts_tensor *ids = NULL, *tgt = NULL, *rids = NULL, *rtgt = NULL;
    gpt_batch(rc->rank * per, per, &ids, &tgt);
    gpt_batch(0, GB, &rids, &rtgt);
    for (int s = 0; s < 3; s++) {
        double l = 0, rl = 0;
        RK_OK(rc, gpt_step(m, opt, ids, tgt, &l));
        RK_OK(rc, gpt_step(ref, ropt, rids, rtgt, &rl));
    }
    ts_state_dict *sd = NULL, *rsd = NULL;
    RK_OK(rc, ts_fsdp_full_state_dict(m, false, &sd));
    RK_OK(rc, ts_module_state_dict(ref, &rsd));
    RK_EQ(rc, ts_state_dict_size(sd), ts_state_dict_size(rsd));
    for (int i = 0; i < ts_state_dict_size(rsd); i++) {
        const char *name = ts_state_dict_name(rsd, i);
        ts_tensor *a = ts_state_dict_get(sd, name), *b = ts_state_dict_tensor(rsd, i);
        if (!a) return fail(rc, "no '%s' in the full state dict", name);
        RK_EQ(rc, ts_tensor_numel(a), ts_tensor_numel(b));
        char what[160];
        snprintf(what, sizeof what, "W=%d %s", rc->W, name);
        if (close_to(rc, what, ts_tensor_data(a), ts_tensor_data(b), ts_tensor_numel(a), 2e-5)) return 1;
    }
    ts_state_dict_free(sd);
    ts_state_dict_free(rsd);
    ts_optim_free(opt);
    ts_optim_free(ropt);
    ts_tensor_free(ids), ts_tensor_free(tgt), ts_tensor_free(rids), ts_tensor_free(rtgt);
    ts_module_free(m);
    ts_module_free(ref);
    /* the tied weight sharded with the embedding alone, then the root */
    RK_OK(rc, gpt_build(&m));
    RK_OK(rc, ts_module_get_submodule(m, "tok_emb", &emb));
    RK_OK(rc, ts_fully_shard(emb, &o));
    RK_EQ(rc, ts_fully_shard(m, &o), TS_ERR_INVALID_ARGUMENT);
    if (!strstr(ts_last_error(), "lm_head.weight") || !strstr(ts_last_error(), "one call"))
        return fail(rc, "message: %s", ts_last_error());
    ts_module_free(m);
    ts_mesh_free(mesh);
    return 0;
}

Test(fully_shard, tied_gpt_training_on_w_ranks_equals_one_process, .timeout = 240)
{
    for (int W = 1; W <= 4; W *= 2) run_world(W, rank_gpt, NULL);
}

/* ------------------------------------------------------------ ignored */

/* An ignored parameter stays whole, outside every group: its gradient is
 * this rank's own (not averaged), and the rest is sharded as usual. */
static int rank_ignored(rank_ctx *rc)
{
    ts_mesh *mesh = th_rank_mesh(rc, false);
    ts_module *a = NULL, *ref = NULL;
    RK_OK(rc, lin_pair(6, &a, &ref));
    ts_module_free(ref);
    ts_nn_linear *l = (ts_nn_linear *)a;
    ts_tensor *bias = l->bias;
    ts_fsdp_options o = ts_fsdp_options_default();
    o.mesh = mesh;
    o.ignored_params = &bias;
    o.n_ignored_params = 1;
    RK_OK(rc, ts_fully_shard(a, &o));
    ts_fsdp_group_info gi;
    RK_OK(rc, ts_fsdp_group_info_get(a, &gi));
    RK_EQ(rc, gi.n_params, 1);
    RK_EQ(rc, ts_tensor_size(l->bias, 0), 8);
    if (ts_tensor_is_shard(l->bias) || l->bias != bias) return fail(rc, "the ignored bias was replaced");
    /* rank r sums r + 1 rows: the bias gradient is r + 1, the rank's own */
    ts_tensor *x = th_batch(0, rc->rank + 1, 8, th_xval), *y = NULL, *sum = NULL;
    RK_OK(rc, ts_module_call1(a, x, &y));
    RK_OK(rc, ts_sum(y, 0, NULL, false, &sum));
    RK_OK(rc, ts_backward(sum, NULL, false));
    ts_tensor *gb = ts_tensor_grad(l->bias);
    if (!gb) return fail(rc, "no gradient on the ignored bias");
    for (int i = 0; i < 8; i++)
        if (((float *)ts_tensor_data(gb))[i] != (float)(rc->rank + 1))
            return fail(rc, "ignored bias grad[%d] = %g", i, ((float *)ts_tensor_data(gb))[i]);
    ts_tensor_free(x), ts_tensor_free(y), ts_tensor_free(sum);
    ts_module_free(a);
    ts_mesh_free(mesh);
    return 0;
}

Test(fully_shard, ignored_parameters_stay_whole, .timeout = 60) { run_world(2, rank_ignored, NULL); }

/* ------------------------------------------------------------ regressions */
/* Each of these was a bug found in review (one process, one-rank mesh). */

static ts_module *small_mlp(ts_module **c)
{
    ts_manual_seed(1);
    cr_assert_eq(ts_linear_new(4, 8, true, &c[0]), TS_OK);
    cr_assert_eq(ts_tanh_new(&c[1]), TS_OK);
    cr_assert_eq(ts_linear_new(8, 4, true, &c[2]), TS_OK);
    ts_module *m = NULL;
    cr_assert_eq(ts_sequential_new(3, c, &m), TS_OK);
    return m;
}

static void sum_backward(ts_module *m, ts_tensor *x, ts_status want)
{
    ts_tensor *y = NULL, *l = NULL;
    TH_OK(ts_module_call1(m, x, &y));
    TH_OK(ts_sum(y, 0, NULL, false, &l));
    cr_assert_eq(ts_backward(l, NULL, false), want, "%s", ts_last_error());
    ts_tensor_free(y);
    ts_tensor_free(l);
}

static ts_status fail_backward(void *ctx, int n, ts_tensor **g)
{
    (void)ctx, (void)n, (void)g;
    return ts_error(TS_ERR_INTERNAL, "injected backward failure");
}

static void assert_same_grad(ts_tensor *a, ts_tensor *b)
{
    cr_assert(ts_tensor_grad(a) && ts_tensor_grad(b));
    const float *x = ts_tensor_data(ts_tensor_grad(a)), *y = ts_tensor_data(ts_tensor_grad(b));
    for (int64_t i = 0; i < ts_tensor_numel(a); i++) cr_assert_float_eq(x[i], y[i], 1e-6, "grad[%lld]", (long long)i);
}

/* A backward that fails half way must not leak its reductions into the
 * next step's gradients. */
Test(fully_shard_regressions, failed_backward_is_dropped, .timeout = 60)
{
    th_mem_mark();
    ts_module *c[3], *rc[3];
    ts_module *m = small_mlp(c), *ref = small_mlp(rc);
    TH_OK(ts_fully_shard(c[0], NULL));
    TH_OK(ts_fully_shard(c[2], NULL));
    TH_OK(ts_fully_shard(m, NULL));
    int64_t xs[2] = {2, 4};
    ts_tensor *x = NULL, *xg = NULL, *xf = NULL;
    TH_OK(ts_randn(TS_F32, 2, xs, NULL, &x));
    TH_OK(ts_randn(TS_F32, 2, xs, NULL, &xg));
    TH_OK(ts_tensor_set_requires_grad(xg, true));
    TH_OK(ts_autograd_custom(1, &xg, fail_backward, NULL, NULL, &xf));
    sum_backward(m, xf, TS_ERR_INTERNAL);
    ts_module_zero_grad(m, true);
    sum_backward(m, x, TS_OK);
    sum_backward(ref, x, TS_OK);
    assert_same_grad(((ts_nn_linear *)c[0])->weight, ((ts_nn_linear *)rc[0])->weight);
    assert_same_grad(((ts_nn_linear *)c[2])->bias, ((ts_nn_linear *)rc[2])->bias);
    ts_tensor_free(x), ts_tensor_free(xg), ts_tensor_free(xf);
    ts_module_free(m);
    ts_module_free(ref);
    th_mem_assert_back();
}

/* A forward without grad leaves nothing unsharded: an optimizer step
 * after it is seen by the next forward. */
Test(fully_shard_regressions, no_grad_forward_then_step, .timeout = 60)
{
    ts_module *c[3], *rc[3];
    ts_module *m = small_mlp(c), *ref = small_mlp(rc);
    TH_OK(ts_fully_shard(m, NULL)); /* the root: reshard_after_forward false */
    ts_tensor *ps[4] = {((ts_nn_linear *)c[0])->weight, ((ts_nn_linear *)c[0])->bias, ((ts_nn_linear *)c[2])->weight,
                        ((ts_nn_linear *)c[2])->bias};
    ts_tensor *rps[4] = {((ts_nn_linear *)rc[0])->weight, ((ts_nn_linear *)rc[0])->bias,
                         ((ts_nn_linear *)rc[2])->weight, ((ts_nn_linear *)rc[2])->bias};
    ts_sgd_options so = ts_sgd_options_default();
    so.lr = 0.5;
    ts_optim *opt = NULL, *ropt = NULL;
    TH_OK(ts_sgd_new(4, ps, &so, &opt));
    TH_OK(ts_sgd_new(4, rps, &so, &ropt));
    int64_t xs[2] = {2, 4};
    ts_tensor *x = NULL;
    TH_OK(ts_randn(TS_F32, 2, xs, NULL, &x));
    ts_module *both[2] = {m, ref};
    ts_optim *opts[2] = {opt, ropt};
    ts_tensor *out[2];
    for (int k = 0; k < 2; k++) {
        sum_backward(both[k], x, TS_OK);
        bool prev = ts_grad_mode_set(false);
        ts_tensor *y = NULL;
        TH_OK(ts_module_call1(both[k], x, &y)); /* evaluation */
        ts_grad_mode_set(prev);
        ts_tensor_free(y);
        TH_OK(ts_optim_step(opts[k]));
        TH_OK(ts_module_call1(both[k], x, &out[k]));
    }
    for (int i = 0; i < 8; i++)
        cr_assert_float_eq(((float *)ts_tensor_data(out[0]))[i], ((float *)ts_tensor_data(out[1]))[i], 1e-6, "out[%d]",
                           i);
    ts_tensor_free(out[0]), ts_tensor_free(out[1]), ts_tensor_free(x);
    ts_optim_free(opt), ts_optim_free(ropt);
    ts_module_free(m), ts_module_free(ref);
}

/* A parameter no gradient reached keeps none (an optimizer then skips it,
 * as with an unsharded model), and a NULL optional input is passed
 * through. */
Test(fully_shard_regressions, unused_parameter_and_null_input, .timeout = 60)
{
    ts_module *m = scale_new(), *extra = NULL;
    TH_OK(ts_linear_new(6, 6, true, &extra)); /* in m's group, never called */
    ts_module *kids[2] = {m, extra}, *root = NULL;
    TH_OK(ts_module_list_new(2, kids, &root));
    ts_fsdp_options o = ts_fsdp_options_default();
    o.reshard_after_forward = TS_RESHARD_TRUE;
    TH_OK(ts_fully_shard_group(2, kids, &o));
    int64_t xs[1] = {6};
    ts_tensor *x = NULL, *in[2], *outs[TS_MODULE_MAX_IO], *l = NULL;
    TH_OK(ts_tensor_ones(TS_F32, 1, xs, &x));
    in[0] = x, in[1] = NULL;
    int n = 0;
    TH_OK(ts_module_call(m, 2, in, &n, outs));
    TH_OK(ts_sum(outs[0], 0, NULL, false, &l));
    TH_OK(ts_backward(l, NULL, false));
    cr_assert_not_null(ts_tensor_grad(((scale_mod *)m)->w));
    cr_assert_null(ts_tensor_grad(((ts_nn_linear *)extra)->weight), "an unused parameter got a gradient");
    ts_tensor_free(outs[0]), ts_tensor_free(l), ts_tensor_free(x);
    ts_module_free(root);
}

/* Handles and detached shards that outlive their module stay safe. */
Test(fully_shard_regressions, handles_outliving_the_module, .timeout = 60)
{
    th_mem_mark();
    ts_module *c[3];
    ts_module *m = small_mlp(c);
    TH_OK(ts_fully_shard(c[0], NULL));
    TH_OK(ts_fully_shard(m, NULL));
    ts_fsdp_unshard_handle *h = NULL;
    TH_OK(ts_fsdp_unshard(m, true, &h));
    ts_state_dict *sd = NULL;
    TH_OK(ts_module_state_dict(m, &sd));
    ts_module_free(m);
    TH_OK(ts_fsdp_unshard_wait(h));
    ts_tensor *w = ts_state_dict_get(sd, "0.weight");
    cr_assert(ts_tensor_is_shard(w));
    cr_assert_null(ts_fsdp_param_dtensor(w));
    ts_state_dict_free(sd);
    m = small_mlp(c);
    TH_OK(ts_fully_shard(m, NULL));
    ts_fsdp_summon *s = NULL;
    TH_OK(ts_fsdp_summon_full_params(m, true, &s));
    ts_module_free(m);
    TH_OK(ts_fsdp_summon_end(s));
    th_mem_assert_back();
}

static int g_unshards;
static void count_unshards(void *ctx, const char *ev, const char *fqn)
{
    (void)ctx, (void)fqn;
    if (!strcmp(ev, "unshard")) g_unshards++;
}

/* A grouped call one of whose modules is skipped in an iteration
 * recovers at the end of that forward; no-grad loops keep memory flat. */
Test(fully_shard_regressions, grouped_module_skipped_and_eval_loop, .timeout = 60)
{
    ts_module *c[3];
    ts_module *m = small_mlp(c);
    ts_module *g[2] = {c[0], c[2]};
    TH_OK(ts_fully_shard_group(2, g, NULL));
    TH_OK(ts_fully_shard(m, NULL));
    int64_t xs[2] = {2, 4}, hs[2] = {2, 8};
    ts_tensor *x = NULL, *h = NULL;
    TH_OK(ts_randn(TS_F32, 2, xs, NULL, &x));
    TH_OK(ts_randn(TS_F32, 2, hs, NULL, &h));
    ts_fsdp_set_event_hook(count_unshards, NULL);
    sum_backward(m, x, TS_OK);
    sum_backward(c[2], h, TS_OK); /* only the second module of the group */
    for (int it = 0; it < 2; it++) {
        g_unshards = 0;
        sum_backward(m, x, TS_OK);
        cr_assert_eq(g_unshards, 2, "iteration %d: %d unshards (root and the group, gathered once each)", it,
                     g_unshards);
        ts_state_dict *sd = NULL;
        TH_OK(ts_fsdp_full_state_dict(m, false, &sd));
        ts_state_dict_free(sd);
    }
    ts_fsdp_set_event_hook(NULL, NULL);
    bool prev = ts_grad_mode_set(false);
    size_t before = 0;
    for (int i = 0; i < 2000; i++) {
        ts_tensor *y = NULL;
        TH_OK(ts_module_call1(m, x, &y));
        ts_tensor_free(y);
        if (i == 0) before = ts_mem_live_bytes(TS_MEM_NN);
    }
    ts_grad_mode_set(prev);
    cr_assert_eq(ts_mem_live_bytes(TS_MEM_NN), before, "no-grad forwards grew TS_MEM_NN from %zu to %zu", before,
                 ts_mem_live_bytes(TS_MEM_NN));
    ts_tensor_free(x), ts_tensor_free(h);
    ts_module_free(m);
}

/* ------------------------------------------------------------ memory */

/* Resharding after forward bounds the parameter memory of a forward: the
 * shards plus about three unsharded blocks (the current one, and the next
 * one's all-gather and copy-out when it is prefetched), as PyTorch's
 * memory test bounds it; without resharding every block stays. (One rank:
 * the storage counters are per process, and the unsharded copies are what
 * is measured.) */
static size_t forward_peak(ts_reshard_policy pol, size_t *block_out)
{
    ts_module *c[4], *root = NULL;
    ts_manual_seed(2);
    for (int i = 0; i < 4; i++) cr_assert_eq(ts_linear_new(256, 256, true, &c[i]), TS_OK);
    TH_OK(ts_sequential_new(4, c, &root));
    ts_fsdp_options o = ts_fsdp_options_default();
    o.reshard_after_forward = pol;
    TH_OK(ts_fully_shard_each(4, c, &o));
    TH_OK(ts_fully_shard(root, &o));
    *block_out = (size_t)(256 * 256 + 256) * 4;
    int64_t xs[2] = {1, 256};
    ts_tensor *x = NULL, *y = NULL;
    TH_OK(ts_tensor_ones(TS_F32, 2, xs, &x));
    bool prev = ts_grad_mode_set(false);
    TH_OK(ts_module_call1(root, x, &y)); /* records the order the prefetch follows */
    ts_tensor_free(y);
    size_t base = ts_mem_live_bytes(TS_MEM_STORAGE);
    ts_mem_reset_peak();
    TH_OK(ts_module_call1(root, x, &y));
    size_t peak = ts_mem_peak_bytes(TS_MEM_STORAGE) - base;
    ts_grad_mode_set(prev);
    ts_tensor_free(y), ts_tensor_free(x);
    ts_module_free(root);
    return peak;
}

Test(fully_shard, forward_memory_is_bounded_by_resharding, .timeout = 60)
{
    size_t block = 0;
    size_t with = forward_peak(TS_RESHARD_TRUE, &block), without = forward_peak(TS_RESHARD_FALSE, &block);
    cr_log_info("forward peak above the shards: reshard %zu B, no reshard %zu B, block %zu B", with, without, block);
    cr_assert_leq(with, 3 * block + 64 * 1024, "reshard after forward: %zu bytes above the shards (block %zu)", with,
                  block);
    cr_assert_geq(without, 4 * block, "without resharding every block should stay: %zu (block %zu)", without, block);
}
