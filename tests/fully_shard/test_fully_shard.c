#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

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

/* A rank's deterministic data: x (rows, in), y (rows, out), rows
 * [row0, row0 + rows) of a fixed global batch. */
static double xval(int64_t r, int64_t j) { return sin(0.37 * (double)(r * 7 + j) + 0.1); }
static double yval(int64_t r, int64_t j) { return cos(0.23 * (double)(r * 5 + j)); }

static ts_tensor *batch(int64_t row0, int64_t rows, int64_t cols, double (*f)(int64_t, int64_t))
{
    int64_t shape[2] = {rows, cols};
    ts_tensor *t = NULL;
    if (ts_tensor_empty(TS_F32, 2, shape, &t)) return NULL;
    float *p = ts_tensor_data(t);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < cols; j++) p[r * cols + j] = (float)f(row0 + r, j);
    return t;
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

static ts_mesh *mesh1(rank_ctx *rc)
{
    int64_t shape[1] = {rc->W};
    const char *names[1] = {"dp"};
    ts_mesh *m = NULL;
    if (ts_mesh_new(rc->c, "cpu", 1, shape, names, &m)) return NULL;
    return m;
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
    for (int i = 0; i < np.n; i++) cr_assert_not_null(ts_tensor_grad(params[i]), "%s has no gradient", np.items[i].name);
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
    ts_mesh *mesh = mesh1(rc);
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
    ts_tensor *x = batch(0, 4, 8, xval);
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
    bool hsdp;        /* a 2-d (replicate, shard) mesh at W = 4 */
    ts_reshard_policy policy;
    bool prefetch;    /* implicit prefetch on */
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
    ts_tensor *x = batch(0, ROWS, IN, xval), *y = batch(0, ROWS, OUT, yval);
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
    } else if (!(mesh = mesh1(rc))) {
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
    ts_tensor *x = batch(dp * rows, rows, IN, xval), *y = batch(dp * rows, rows, OUT, yval);
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
    ts_mesh *mesh = mesh1(rc);
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
} ev_arg;

/* PyTorch's TestFullyShardPrefetch model: a root with parameters (an input
 * and an output Linear) around 3 blocks, every module sharded with
 * reshard_after_forward true; the events of the second iteration are
 * checked (the first records the forward order the prefetch follows). */
static int rank_events(rank_ctx *rc)
{
    const ev_arg *a = rc->arg;
    tl_rank = rc->rank;
    ts_mesh *mesh = mesh1(rc);
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
                if (!a->want_bwd[j])
                    return fail(rc, "extra backward event '%s'", g_ev[rc->rank][e]);
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

/* FSDP2-NOTES §2.7: PyTorch's sequence with backward prefetch; with it
 * off, each group is gathered when its own backward starts. Forward
 * prefetch issues the next group's all-gather before the current group
 * computes (before its pre_forward event). */
Test(fully_shard, unshard_and_post_backward_sequence, .timeout = 60)
{
    static const char *fwd_on[] = {"pre_forward root", "unshard root",     "unshard 1.0",      "pre_forward 1.0",
                                   "unshard 1.1",      "pre_forward 1.1", "unshard 1.2",      "pre_forward 1.2",
                                   NULL};
    static const char *bwd_on[] = {"unshard root",       "unshard 1.2",        "unshard 1.1",        "post_backward 1.2",
                                   "unshard 1.0",        "post_backward 1.1", "post_backward 1.0", "post_backward root",
                                   NULL};
    static const char *fwd_off[] = {"pre_forward root", "unshard root",     "pre_forward 1.0", "unshard 1.0",
                                    "pre_forward 1.1",  "unshard 1.1",      "pre_forward 1.2", "unshard 1.2",
                                    NULL};
    static const char *bwd_off[] = {"unshard root",      "unshard 1.2",       "post_backward 1.2", "unshard 1.1",
                                    "post_backward 1.1", "unshard 1.0",       "post_backward 1.0", "post_backward root",
                                    NULL};
    ts_fsdp_set_event_hook(record, NULL);
    ev_arg on = {true, fwd_on, bwd_on}, off = {false, fwd_off, bwd_off};
    run_world(2, rank_events, &on);
    run_world(2, rank_events, &off);
    ts_fsdp_set_event_hook(NULL, NULL);
}
