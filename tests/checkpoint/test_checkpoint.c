/* Sharded checkpoints (checkpoint/checkpoint.h): round trips, resharding
 * from any world to any other and between meshes, optimizer state, bytes
 * read, the index read back with jansson against the files, errors that
 * leave the model unchanged, and atomicity under killed saves.
 *
 * The reference for "equal" is independent of the checkpoint code: each
 * rank thread copies the rows it holds (located with the DTensor of its
 * shard, ts_dtensor_local_offset) of every parameter, buffer and optimizer
 * state into a shared full-size buffer per key (a snapshot); two runs are
 * compared snapshot to snapshot, bit for bit. */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "checkpoint/internal.h"
#include "nn/internal.h"
#include "safetensors/internal.h" /* ts__safetensors_save_hook */
#include "optim/internal.h"
#include "tests/loopback_ranks.h"

/* ------------------------------------------------------------ a model with a buffer */

/* BufAdd: y = x + offset, with "offset" (3,) a buffer. */
typedef struct bufadd {
    ts_module base;
    ts_tensor *offset;
} bufadd;

static ts_status bufadd_forward(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    (void)n_in;
    ts_status st = ts_add(in[0], ((bufadd *)m)->offset, &out[0]);
    if (!st) *n_out = 1;
    return st;
}
static ts_status bufadd_visit(ts_module *m, const ts_module_visitor *v)
{
    return v->buffer ? v->buffer(v->ctx, "offset", &((bufadd *)m)->offset) : TS_OK;
}
static void bufadd_free(ts_module *m)
{
    ts_tensor_free(((bufadd *)m)->offset);
    free(m);
}
static const ts_module_vtable bufadd_vt = {
    .type_name = "BufAdd", .forward = bufadd_forward, .visit = bufadd_visit, .free = bufadd_free};

static ts_status bufadd_new(double base, ts_module **out)
{
    bufadd *b = calloc(1, sizeof *b);
    if (!b) return TS_ERR_NO_MEMORY;
    ts_status st = ts_module_init(&b->base, &bufadd_vt);
    int64_t n = 3;
    if (!st) st = ts_tensor_zeros(TS_F32, 1, &n, &b->offset);
    for (int i = 0; !st && i < 3; i++) ((float *)ts_tensor_data(b->offset))[i] = (float)(base + 0.25 * i);
    if (st) {
        ts_tensor_free(b->offset);
        free(b);
        return st;
    }
    *out = &b->base;
    return TS_OK;
}

enum { OPT_ADAMW = 0, OPT_ADAM_AMS, OPT_SGD_MOM, OPT_NONE };
enum { MESH_1D = 0, MESH_HSDP = 1, MESH_NONE = 2 };

typedef struct model_t {
    ts_module *root;
    ts_optim *opt;
    ts_mesh *mesh;
} model_t;

static void model_free(model_t *m)
{
    ts_optim_free(m->opt);
    ts_module_free(m->root);
    ts_mesh_free(m->mesh);
    memset(m, 0, sizeof *m);
}

/* Sequential(Linear(4, 9), Tanh, Linear(9, hid2), Tanh, Linear(hid2, 3),
 * BufAdd): rows 9, hid2 (5), 3 do not divide by 2, 3 or 4, and 3 < 4.
 * Each Linear is sharded with its own group; the last bias is ignored
 * (outside every group: replicated, saved once by rank 0). */
static bool g_ignore_bias = true;              /* the test's settings for build() */
static _Thread_local bool g_no_buffer = false; /* per rank thread */
static _Thread_local bool g_f64 = false;       /* the model in float64 */

static ts_status build(ts_comm *world, int mesh_kind, int optkind, uint64_t seed, int64_t hid2, model_t *m)
{
    memset(m, 0, sizeof *m);
    /* the default generator is process-wide: rank threads take turns, so
     * that every rank's model holds exactly ts_manual_seed(seed)'s values */
    static pthread_mutex_t rng_mu = PTHREAD_MUTEX_INITIALIZER;
    pthread_mutex_lock(&rng_mu);
    ts_manual_seed(seed);
    ts_module *c[6] = {0};
    ts_status st = ts_linear_new(4, 9, true, &c[0]);
    if (!st) st = ts_tanh_new(&c[1]);
    if (!st) st = ts_linear_new(9, hid2, true, &c[2]);
    if (!st) st = ts_tanh_new(&c[3]);
    if (!st) st = ts_linear_new(hid2, 3, true, &c[4]);
    pthread_mutex_unlock(&rng_mu);
    if (!st && !g_no_buffer) st = bufadd_new(0.01 * (double)seed, &c[5]);
    if (!st) st = ts_sequential_new(g_no_buffer ? 5 : 6, c, &m->root);
    if (st) {
        for (int i = 0; i < 6; i++) ts_module_free(c[i]);
        return st;
    }
    if (g_f64 && (st = ts_module_to_dtype(m->root, TS_F64))) {
        ts_module_free(m->root);
        return st;
    }
    if (mesh_kind != MESH_NONE) {
        int W = ts_comm_size(world);
        if (mesh_kind == MESH_HSDP) {
            int64_t shape[2] = {2, W / 2};
            const char *names[2] = {"replicate", "shard"};
            st = ts_mesh_new(world, "cpu", 2, shape, names, &m->mesh);
        } else {
            int64_t shape[1] = {W};
            const char *names[1] = {"dp"};
            st = ts_mesh_new(world, "cpu", 1, shape, names, &m->mesh);
        }
        ts_tensor *bias = NULL;
        if (!st) st = ts_module_get_parameter(m->root, "4.bias", &bias);
        ts_fsdp_options fo = ts_fsdp_options_default();
        fo.mesh = m->mesh;
        fo.ignored_params = &bias;
        fo.n_ignored_params = g_ignore_bias;
        ts_module *lin[3] = {c[0], c[2], c[4]};
        if (!st) st = ts_fully_shard_each(3, lin, &fo);
        if (!st) st = ts_fully_shard(m->root, &fo);
    }
    if (!st && optkind != OPT_NONE) {
        ts_param_list pl = {0};
        st = ts_module_parameters(m->root, &pl);
        if (!st && optkind == OPT_SGD_MOM) {
            ts_sgd_options so = ts_sgd_options_default();
            so.lr = 0.05;
            so.momentum = 0.9;
            st = ts_sgd_new(pl.n, pl.items, &so, &m->opt);
        } else if (!st) {
            ts_adam_options ao = optkind == OPT_ADAMW ? ts_adamw_options_default() : ts_adam_options_default();
            ao.lr = 0.01;
            ao.amsgrad = optkind == OPT_ADAM_AMS;
            st = optkind == OPT_ADAMW ? ts_adamw_new(pl.n, pl.items, &ao, &m->opt)
                                      : ts_adam_new(pl.n, pl.items, &ao, &m->opt);
        }
        ts_param_list_free(&pl);
    }
    if (st) model_free(m);
    return st;
}

/* One training step on the same batch on every rank. */
static ts_status train_step(model_t *m)
{
    int64_t xs[2] = {8, 4}, ys[2] = {8, 3};
    ts_tensor *x = NULL, *y = NULL, *out = NULL, *loss = NULL;
    ts_status st = ts_tensor_empty(TS_F32, 2, xs, &x);
    if (!st) st = ts_tensor_empty(TS_F32, 2, ys, &y);
    for (int i = 0; !st && i < 32; i++) ((float *)ts_tensor_data(x))[i] = (float)sin(0.37 * i + 0.1);
    for (int i = 0; !st && i < 24; i++) ((float *)ts_tensor_data(y))[i] = (float)cos(0.21 * i);
    if (!st) st = ts_module_call1(m->root, x, &out);
    if (!st) st = ts_mse_loss(out, y, TS_REDUCTION_MEAN, &loss);
    if (!st) st = ts_backward(loss, NULL, false);
    if (!st && m->opt) st = ts_optim_step(m->opt);
    if (!st && m->opt) ts_optim_zero_grad(m->opt, true);
    ts_tensor_free(x);
    ts_tensor_free(y);
    ts_tensor_free(out);
    ts_tensor_free(loss);
    return st;
}

/* ------------------------------------------------------------ snapshots */

#define SNAP_MAX 64
typedef struct snap {
    pthread_mutex_t mu;
    int n;
    struct {
        char key[192];
        ts_dtype dtype;
        int64_t numel;
        unsigned char *data;
        unsigned char *seen; /* per row: written */
        int64_t rows;
    } e[SNAP_MAX];
    int64_t steps;
    int conflicts; /* replicas that held different values */
    char conflict[192];
} snap;

static void snap_init(snap *s)
{
    memset(s, 0, sizeof *s);
    pthread_mutex_init(&s->mu, NULL);
}

static void snap_fini(snap *s)
{
    for (int i = 0; i < s->n; i++) {
        free(s->e[i].data);
        free(s->e[i].seen);
    }
    pthread_mutex_destroy(&s->mu);
}

/* Puts the rows [row0, row0 + local rows) of a tensor of global shape
 * (gnd, gshape) whose local rows are `local`. */
static void snap_put(snap *s, const char *key, ts_tensor *local, int64_t row0, int gnd, const int64_t *gshape)
{
    int64_t numel = 1, rows = gnd ? gshape[0] : 1;
    for (int d = 0; d < gnd; d++) numel *= gshape[d];
    size_t es = ts_dtype_size(ts_tensor_dtype(local));
    int64_t row_numel = rows ? numel / rows : 0;
    pthread_mutex_lock(&s->mu);
    int k = 0;
    while (k < s->n && strcmp(s->e[k].key, key)) k++;
    if (k == s->n && s->n < SNAP_MAX) {
        s->n++;
        snprintf(s->e[k].key, sizeof s->e[k].key, "%s", key);
        s->e[k].dtype = ts_tensor_dtype(local);
        s->e[k].numel = numel;
        s->e[k].rows = rows;
        s->e[k].data = calloc((size_t)numel + 1, es);
        s->e[k].seen = calloc((size_t)rows + 1, 1);
    }
    if (k < SNAP_MAX) {
        int64_t lrows = ts_tensor_ndim(local) ? ts_tensor_shape(local)[0] : 1;
        size_t nb = (size_t)(lrows * row_numel) * es;
        unsigned char *dst = s->e[k].data + (size_t)(row0 * row_numel) * es, *old = NULL;
        if (nb && lrows && s->e[k].seen[row0] && (old = malloc(nb))) memcpy(old, dst, nb);
        if (nb) ts_tensor_copy_to(local, dst, nb);
        if (old && memcmp(old, dst, nb)) {
            s->conflicts++;
            snprintf(s->conflict, sizeof s->conflict, "%s", key);
        }
        free(old);
        for (int64_t r = 0; r < lrows; r++) s->e[k].seen[row0 + r] = 1;
    }
    pthread_mutex_unlock(&s->mu);
}

/* Sharded tensors: every rank puts its rows (HSDP replicas must agree);
 * replicated ones: rank 0's copy (the one a checkpoint holds; the copies
 * of a parameter outside every group may drift apart, fully_shard.h). */
static void snap_put_tensor(snap *s, int rank, const char *key, ts_tensor *t, const ts_tensor *like)
{
    const ts_dtensor *d = ts_fsdp_param_dtensor(like);
    if (!(d && ts_tensor_ndim(t) > 0) && rank != 0) return;
    ts_tensor *lv = NULL;
    if (ts_tensor_local_view(t, &lv)) return;
    if (d && ts_tensor_ndim(t) > 0)
        snap_put(s, key, lv, ts_dtensor_local_offset(d, 0), ts_dtensor_ndim(d), ts_dtensor_shape(d));
    else snap_put(s, key, lv, 0, ts_tensor_ndim(t), ts_tensor_shape(t));
    ts_tensor_free(lv);
}

static const char *const state_names[] = {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"};

static ts_status snap_take(snap *s, int rank, model_t *m)
{
    ts_named_params np = {0};
    ts_status st = ts__module_entries(m->root, true, true, false, &np); /* the slots' own tensors */
    if (st) return st;
    for (int i = 0; i < np.n; i++) snap_put_tensor(s, rank, np.items[i].name, *np.items[i].slot, *np.items[i].slot);
    for (int i = 0; m->opt && i < ts_optim_num_params(m->opt); i++) {
        ts_tensor *p = ts_optim_param(m->opt, i);
        const char *fqn = NULL;
        for (int k = 0; k < np.n && !fqn; k++)
            if (*np.items[k].slot == p) fqn = np.items[k].name;
        for (int n = 0; fqn && n < 5; n++) {
            ts_tensor *t = ts_optim_state(m->opt, i, state_names[n]);
            if (!t) continue;
            char key[192];
            snprintf(key, sizeof key, "optim.%s.%s", fqn, state_names[n]);
            snap_put_tensor(s, rank, key, t, p);
        }
    }
    s->steps = m->opt ? ts_optim_step_count(m->opt) : 0;
    ts_named_params_free(&np);
    return TS_OK;
}

/* Asserts the two snapshots hold the same keys and every row was seen;
 * bitwise, or for float32 within the absolute tolerance rtol when > 0. */
static void snap_assert_equal(const snap *a, const snap *b, double rtol, const char *what)
{
    cr_assert_eq(a->n, b->n, "%s: %d keys vs %d", what, a->n, b->n);
    cr_assert_eq(a->conflicts, 0, "%s: replicas of %s differ", what, a->conflict);
    cr_assert_eq(b->conflicts, 0, "%s: replicas of %s differ", what, b->conflict);
    cr_assert_eq(a->steps, b->steps, "%s: optimizer steps %lld vs %lld", what, (long long)a->steps,
                 (long long)b->steps);
    for (int i = 0; i < a->n; i++) {
        int k = 0;
        while (k < b->n && strcmp(a->e[i].key, b->e[k].key)) k++;
        cr_assert(k < b->n, "%s: key %s missing", what, a->e[i].key);
        cr_assert_eq(a->e[i].numel, b->e[k].numel, "%s: %s numel", what, a->e[i].key);
        for (int64_t r = 0; r < a->e[i].rows; r++)
            cr_assert(a->e[i].seen[r] && b->e[k].seen[r], "%s: %s row %lld not held by any rank", what, a->e[i].key,
                      (long long)r);
        size_t nb = (size_t)a->e[i].numel * ts_dtype_size(a->e[i].dtype);
        if (rtol == 0 || a->e[i].dtype != TS_F32) {
            cr_assert(memcmp(a->e[i].data, b->e[k].data, nb) == 0, "%s: %s differs", what, a->e[i].key);
            continue;
        }
        const float *x = (const float *)a->e[i].data, *y = (const float *)b->e[k].data;
        for (int64_t j = 0; j < a->e[i].numel; j++)
            cr_assert(fabs((double)x[j] - (double)y[j]) <= rtol, "%s: %s[%lld] %.9g vs %.9g", what, a->e[i].key,
                      (long long)j, (double)x[j], (double)y[j]);
    }
}

/* ------------------------------------------------------------ save and load runs */

typedef struct run_arg {
    const char *dir;
    int mesh_kind, optkind, steps;
    uint64_t seed;
    snap *at, *next; /* the state saved / loaded, and after one more step */
    int saved_world; /* loader: the world that saved (for the rank extras) */
    ts_ckpt_info info[TH_MAXW];
    uint64_t expected_bytes[TH_MAXW];
} run_arg;

static ts_status make_extras(int rank, ts_state_dict **ex, ts_state_dict **rex, int64_t v)
{
    ts_tensor *a = NULL, *b = NULL;
    int64_t two = 2;
    ts_status st = ts_state_dict_new(ex);
    if (!st) st = ts_state_dict_new(rex);
    if (!st) st = ts_tensor_zeros(TS_I64, 0, NULL, &a);
    if (!st) st = ts_tensor_zeros(TS_I64, 1, &two, &b);
    if (!st && v) {
        ((int64_t *)ts_tensor_data(a))[0] = v;
        ((int64_t *)ts_tensor_data(b))[0] = 100 + rank;
        ((int64_t *)ts_tensor_data(b))[1] = v * 1000 + rank;
    }
    if (!st) st = ts_state_dict_set(*ex, "data_step", a);
    if (!st) st = ts_state_dict_set(*rex, "rng", b);
    ts_tensor_free(a);
    ts_tensor_free(b);
    return st;
}

/* The end of saver and loader: snapshots m into a->at and, when a->next
 * is set, trains one more step and snapshots it there; then frees the
 * extras and the model. */
static int snap_and_free(th_rank *rc, const run_arg *a, model_t *m, ts_state_dict *ex, ts_state_dict *rex)
{
    TH_RK_OK(rc, snap_take(a->at, rc->rank, m));
    if (a->next) {
        TH_RK_OK(rc, train_step(m));
        TH_RK_OK(rc, snap_take(a->next, rc->rank, m));
    }
    ts_state_dict_free(ex);
    ts_state_dict_free(rex);
    model_free(m);
    return 0;
}

static int saver(th_rank *rc)
{
    run_arg *a = rc->arg;
    model_t m;
    TH_RK_OK(rc, build(rc->c, a->mesh_kind, a->optkind, a->seed, 5, &m));
    for (int i = 0; i < a->steps; i++) TH_RK_OK(rc, train_step(&m));
    ts_state_dict *ex = NULL, *rex = NULL;
    TH_RK_OK(rc, make_extras(rc->rank, &ex, &rex, 7));
    ts_ckpt_options o = ts_ckpt_options_default();
    o.optim = m.opt;
    o.extra = ex;
    o.rank_extra = rex;
    const ts_ckpt_meta meta[2] = {{"model", "tiny-mlp"}, {"note", "seed"}};
    o.metadata = meta;
    o.n_metadata = 2;
    TH_RK_OK(rc, ts_ckpt_save(a->dir, m.root, &o));
    return snap_and_free(rc, a, &m, ex, rex);
}

/* The bytes this rank must read: the local rows of every sharded tensor,
 * every replicated tensor whole, the extras. */
static uint64_t expected_bytes(model_t *m, bool rank_extra)
{
    ts_state_dict *sd = NULL;
    if (ts_module_state_dict(m->root, &sd)) return 0;
    uint64_t b = 0;
    for (int i = 0; i < ts_state_dict_size(sd); i++) {
        ts_tensor *t = ts_state_dict_tensor(sd, i);
        b += (uint64_t)ts_tensor_numel(t) * ts_dtype_size(ts_tensor_dtype(t));
    }
    for (int i = 0; m->opt && i < ts_optim_num_params(m->opt); i++)
        for (int n = 0; n < 5; n++) {
            ts_tensor *t = ts_optim_state(m->opt, i, state_names[n]);
            if (t) b += (uint64_t)ts_tensor_numel(t) * ts_dtype_size(ts_tensor_dtype(t));
        }
    ts_state_dict_free(sd);
    return b + 8 + (rank_extra ? 16 : 0);
}

static int loader(th_rank *rc)
{
    run_arg *a = rc->arg;
    model_t m;
    TH_RK_OK(rc, build(rc->c, a->mesh_kind, a->optkind, 1000 + a->seed, 5, &m));
    ts_state_dict *ex = NULL, *rex = NULL;
    TH_RK_OK(rc, make_extras(rc->rank, &ex, &rex, 0));
    ts_ckpt_options o = ts_ckpt_options_default();
    o.optim = m.opt;
    o.extra = ex;
    o.rank_extra = rex;
    TH_RK_OK(rc, ts_ckpt_load(a->dir, m.root, &o, &a->info[rc->rank]));
    bool same = a->saved_world == rc->W;
    a->expected_bytes[rc->rank] = expected_bytes(&m, same);
    TH_RK_EQ(rc, ((int64_t *)ts_tensor_data(ts_state_dict_get(ex, "data_step")))[0], 7);
    const int64_t *r = ts_tensor_data(ts_state_dict_get(rex, "rng"));
    TH_RK_EQ(rc, r[0], same ? 100 + rc->rank : 0);
    TH_RK_EQ(rc, r[1], same ? 7000 + rc->rank : 0);
    char *v = NULL;
    TH_RK_OK(rc, ts_ckpt_metadata(a->dir, "model", &v));
    if (strcmp(v, "tiny-mlp")) return th_rank_fail(rc, "metadata 'model' is '%s'", v);
    free(v);
    return snap_and_free(rc, a, &m, ex, rex);
}

static char *tmp_dir(void) { return th_tmp_dir("ts_ckpt_test"); }

/* Saves on Ws ranks, loads on Wl ranks, and compares. */
static void reshard_case(int Ws, int ms, int Wl, int ml, int optkind)
{
    char *dir = tmp_dir();
    char ckdir[300];
    snprintf(ckdir, sizeof ckdir, "%s/ck", dir); /* created by the save */
    snap s_at, s_next, l_at, l_next;
    snap_init(&s_at);
    snap_init(&s_next);
    snap_init(&l_at);
    snap_init(&l_next);
    run_arg sa = {
        .dir = ckdir, .mesh_kind = ms, .optkind = optkind, .steps = 2, .seed = 3, .at = &s_at, .next = &s_next};
    th_run_world(Ws, saver, &sa, 30);
    run_arg la = {
        .dir = ckdir, .mesh_kind = ml, .optkind = optkind, .seed = 3, .at = &l_at, .next = &l_next, .saved_world = Ws};
    th_run_world(Wl, loader, &la, 30);
    char what[96];
    snprintf(what, sizeof what, "W %d (mesh %d) -> %d (mesh %d), optimizer %d", Ws, ms, Wl, ml, optkind);
    char what_next[128];
    snprintf(what_next, sizeof what_next, "%s, one step after", what);
    snap_assert_equal(&s_at, &l_at, 0, what);
    /* the next step: bitwise on the same world and mesh. Otherwise the
     * gradient average rounds differently ((g + g + g) / 3 need not be g,
     * every rank computing the same batch here) and Adam's m / sqrt(v)
     * carries that into the update: 1e-6 absolute (parameters are O(1),
     * one step moves them by up to lr = 0.01) */
    if (Ws == Wl && ms == ml) snap_assert_equal(&s_next, &l_next, 0, what_next);
    else snap_assert_equal(&s_next, &l_next, 1e-6, what_next);
    for (int r = 0; r < Wl; r++) {
        cr_assert_eq(la.info[r].saved_world, Ws);
        cr_assert_eq(la.info[r].loaded_world, Wl);
        cr_assert_eq(la.info[r].rank_extra_loaded, Ws == Wl);
        cr_assert_eq(la.info[r].optim_steps, optkind == OPT_NONE ? 0 : 2);
        cr_assert_eq(la.info[r].bytes_read, la.expected_bytes[r], "%s: rank %d read %llu bytes, owns %llu", what, r,
                     (unsigned long long)la.info[r].bytes_read, (unsigned long long)la.expected_bytes[r]);
    }
    snap_fini(&s_at);
    snap_fini(&s_next);
    snap_fini(&l_at);
    snap_fini(&l_next);
    th_rm_rf(ckdir);
    th_rm_rf(dir);
    free(dir);
}

Test(checkpoint, round_trip_same_world, .timeout = 120)
{
    reshard_case(1, MESH_1D, 1, MESH_1D, OPT_ADAMW);
    reshard_case(2, MESH_1D, 2, MESH_1D, OPT_ADAMW);
    reshard_case(4, MESH_1D, 4, MESH_1D, OPT_ADAMW);
    reshard_case(4, MESH_1D, 4, MESH_1D, OPT_SGD_MOM);
}

Test(checkpoint, reshard_adamw, .timeout = 120)
{
    static const int pairs[][2] = {{4, 2}, {4, 3}, {4, 1}, {1, 4}, {3, 2}, {2, 3}, {1, 3}, {3, 4}};
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++)
        reshard_case(pairs[i][0], MESH_1D, pairs[i][1], MESH_1D, OPT_ADAMW);
}

Test(checkpoint, reshard_adam_amsgrad_and_sgd_momentum, .timeout = 120)
{
    static const int pairs[][2] = {{4, 2}, {4, 3}, {1, 4}, {3, 2}, {2, 3}, {4, 1}};
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++) {
        reshard_case(pairs[i][0], MESH_1D, pairs[i][1], MESH_1D, OPT_ADAM_AMS);
        reshard_case(pairs[i][0], MESH_1D, pairs[i][1], MESH_1D, OPT_SGD_MOM);
    }
}

Test(checkpoint, model_only, .timeout = 60) { reshard_case(4, MESH_1D, 3, MESH_1D, OPT_NONE); }

Test(checkpoint, hsdp_to_1d_and_back, .timeout = 120)
{
    reshard_case(4, MESH_HSDP, 2, MESH_1D, OPT_ADAMW);
    reshard_case(2, MESH_1D, 4, MESH_HSDP, OPT_ADAMW);
    reshard_case(4, MESH_HSDP, 4, MESH_HSDP, OPT_ADAMW);
}

/* ------------------------------------------------------------ interop: the index read with jansson */

static json_t *read_st_header(const char *path, uint64_t *data_start, uint64_t *size)
{
    FILE *f = fopen(path, "rb");
    cr_assert(f, "open %s: %s", path, strerror(errno));
    unsigned char len8[8];
    cr_assert_eq(fread(len8, 1, 8, f), 8u);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = n << 8 | len8[i];
    char *buf = malloc(n + 1);
    cr_assert_eq(fread(buf, 1, n, f), n);
    fseek(f, 0, SEEK_END);
    *size = (uint64_t)ftell(f);
    fclose(f);
    json_error_t e;
    json_t *h = json_loadb(buf, n, 0, &e);
    cr_assert(h, "%s: header: %s", path, e.text);
    free(buf);
    *data_start = 8 + n;
    return h;
}

Test(checkpoint, index_agrees_with_files, .timeout = 60)
{
    char *dir = tmp_dir();
    snap s;
    snap_init(&s);
    run_arg sa = {.dir = dir, .mesh_kind = MESH_1D, .optkind = OPT_ADAMW, .steps = 1, .seed = 5, .at = &s};
    th_run_world(3, saver, &sa, 30);
    char path[512];
    snprintf(path, sizeof path, "%s/index.json", dir);
    json_error_t e;
    json_t *ix = json_load_file(path, 0, &e);
    cr_assert(ix, "index.json: %s", e.text);
    cr_assert_str_eq(json_string_value(json_object_get(ix, "format")), "tensorshard-dcp");
    cr_assert_eq(json_integer_value(json_object_get(ix, "world")), 3);
    cr_assert_str_eq(json_string_value(json_object_get(json_object_get(ix, "optim"), "kind")), "AdamW");
    cr_assert_eq(json_integer_value(json_object_get(json_object_get(ix, "optim"), "steps")), 1);
    cr_assert_str_eq(json_string_value(json_object_get(json_object_get(ix, "metadata"), "model")), "tiny-mlp");
    json_t *files = json_object_get(ix, "files");
    size_t nf = json_array_size(files);
    cr_assert(nf >= 1 && nf <= 3);
    json_t *hdr[3];
    uint64_t start[3], size[3];
    for (size_t f = 0; f < nf; f++) {
        json_t *fj = json_array_get(files, f);
        snprintf(path, sizeof path, "%s/%s", dir, json_string_value(json_object_get(fj, "name")));
        hdr[f] = read_st_header(path, &start[f], &size[f]);
        cr_assert_eq((uint64_t)json_integer_value(json_object_get(fj, "size")), size[f], "%s: size", path);
        /* every tensor of the file is in the index */
        const char *k;
        json_t *v;
        json_object_foreach(hdr[f], k, v)
        {
            if (!strcmp(k, "__metadata__")) continue;
            cr_assert(json_object_get(json_object_get(ix, "tensors"), k), "%s: %s not in the index", path, k);
        }
    }
    /* every piece against its file; the pieces cover every row once */
    const char *key;
    json_t *t;
    int n_keys = 0;
    json_object_foreach(json_object_get(ix, "tensors"), key, t)
    {
        n_keys++;
        json_t *shape = json_object_get(t, "shape");
        const char *dtype = json_string_value(json_object_get(t, "dtype"));
        int64_t rows = json_array_size(shape) ? json_integer_value(json_array_get(shape, 0)) : 1;
        int64_t row_numel = 1;
        for (size_t d = 1; d < json_array_size(shape); d++) row_numel *= json_integer_value(json_array_get(shape, d));
        size_t es = !strcmp(dtype, "F32") ? 4 : !strcmp(dtype, "I64") ? 8 : 0;
        cr_assert(es, "%s: dtype %s", key, dtype);
        const char *kind = json_string_value(json_object_get(t, "kind"));
        unsigned char *cover = calloc((size_t)rows + 1, 1);
        json_t *pieces = json_object_get(t, "pieces");
        for (size_t p = 0; p < json_array_size(pieces); p++) {
            json_t *pj = json_array_get(pieces, p);
            size_t f = (size_t)json_integer_value(json_object_get(pj, "file"));
            int64_t row = json_integer_value(json_object_get(pj, "row")),
                    prow = json_integer_value(json_object_get(pj, "rows"));
            uint64_t off = (uint64_t)json_integer_value(json_object_get(pj, "offset")),
                     len = (uint64_t)json_integer_value(json_object_get(pj, "length"));
            cr_assert(f < nf);
            cr_assert(off + len <= size[f], "%s: piece outside its file", key);
            cr_assert_eq(len, (uint64_t)(prow * row_numel) * es, "%s: length", key);
            json_t *he = json_object_get(hdr[f], key);
            cr_assert(he, "%s: not in file %zu", key, f);
            cr_assert_str_eq(json_string_value(json_object_get(he, "dtype")), dtype);
            json_t *hs = json_object_get(he, "shape"), *ho = json_object_get(he, "data_offsets");
            cr_assert_eq(json_array_size(hs), json_array_size(shape), "%s: ndim", key);
            if (json_array_size(hs)) cr_assert_eq(json_integer_value(json_array_get(hs, 0)), prow, "%s: rows", key);
            for (size_t d = 1; d < json_array_size(hs); d++)
                cr_assert(json_equal(json_array_get(hs, d), json_array_get(shape, d)), "%s: dim %zu", key, d);
            cr_assert_eq(start[f] + (uint64_t)json_integer_value(json_array_get(ho, 0)), off, "%s: offset", key);
            cr_assert_eq(
                (uint64_t)(json_integer_value(json_array_get(ho, 1)) - json_integer_value(json_array_get(ho, 0))), len,
                "%s: data_offsets length", key);
            if (!strcmp(kind, "rank_extra")) continue;
            for (int64_t r = row; r < row + prow; r++) {
                cr_assert(!cover[r], "%s: row %lld saved twice", key, (long long)r);
                cover[r] = 1;
            }
        }
        for (int64_t r = 0; strcmp(kind, "rank_extra") && r < rows; r++)
            cr_assert(cover[r], "%s: row %lld not saved", key, (long long)r);
        free(cover);
    }
    /* 6 weights and biases, the buffer, 3 AdamW states each, 2 extras */
    cr_assert_eq(n_keys, 7 + 6 * 3 + 2);
    for (size_t f = 0; f < nf; f++) json_decref(hdr[f]);
    json_decref(ix);
    snap_fini(&s);
    th_rm_rf(dir);
    free(dir);
}

/* ------------------------------------------------------------ errors */

enum {
    E_NO_DIR,
    E_NO_FILE,
    E_TRUNCATED,
    E_BAD_INDEX,
    E_SHAPE,
    E_DTYPE,
    E_MISSING_EXTRA,
    E_UNEXPECTED,
    E_SGD_INTO_ADAMW,
    E_NONSTRICT_UNEXPECTED,
    E_DTYPE_MODEL,
    E_COUNT
};

typedef struct err_arg {
    const char *dir;
    int kind;
    ts_status want;
    snap *before, *after;
    char msg[TH_MAXW][512];
} err_arg;

static int err_rank(th_rank *rc)
{
    err_arg *a = rc->arg;
    model_t m;
    g_no_buffer = a->kind == E_UNEXPECTED || a->kind == E_NONSTRICT_UNEXPECTED;
    int64_t hid2 = a->kind == E_SHAPE ? 6 : 5;
    g_f64 = a->kind == E_DTYPE_MODEL;
    TH_RK_OK(rc, build(rc->c, MESH_1D, OPT_ADAMW, 77, hid2, &m));
    g_f64 = false;
    if (a->kind != E_DTYPE_MODEL) TH_RK_OK(rc, train_step(&m)); /* its inputs are float32 */
    ts_state_dict *ex = NULL, *rex = NULL;
    TH_RK_OK(rc, make_extras(rc->rank, &ex, &rex, 0));
    if (a->kind == E_DTYPE) { /* the checkpoint's data_step is int64 */
        ts_tensor *f = NULL;
        TH_RK_OK(rc, ts_tensor_zeros(TS_F32, 0, NULL, &f));
        TH_RK_OK(rc, ts_state_dict_set(ex, "data_step", f));
        ts_tensor_free(f);
    }
    if (a->kind == E_MISSING_EXTRA) {
        ts_tensor *f = NULL;
        TH_RK_OK(rc, ts_tensor_zeros(TS_F32, 0, NULL, &f));
        TH_RK_OK(rc, ts_state_dict_set(ex, "not_saved", f));
        ts_tensor_free(f);
    }
    TH_RK_OK(rc, snap_take(a->before, rc->rank, &m));
    ts_ckpt_options o = ts_ckpt_options_default();
    o.optim = m.opt;
    o.extra = ex;
    o.rank_extra = rex;
    o.strict = a->kind != E_NONSTRICT_UNEXPECTED;
    char dir[512];
    snprintf(dir, sizeof dir, "%s%s", a->dir, a->kind == E_NO_DIR ? "/no_such_folder" : "");
    ts_status st = ts_ckpt_load(dir, m.root, &o, NULL);
    snprintf(a->msg[rc->rank], sizeof a->msg[rc->rank], "%s", st ? ts_last_error() : "");
    TH_RK_EQ(rc, st, a->want);
    if (a->kind != E_NONSTRICT_UNEXPECTED) TH_RK_OK(rc, snap_take(a->after, rc->rank, &m));
    ts_state_dict_free(ex);
    ts_state_dict_free(rex);
    model_free(&m);
    g_no_buffer = false;
    return 0;
}

static void *slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    cr_assert(f, "%s: %s", path, strerror(errno));
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    void *b = malloc((size_t)n + 1);
    cr_assert_eq(fread(b, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    *len = (size_t)n;
    return b;
}

static void spit(const char *path, const void *b, size_t n)
{
    FILE *f = fopen(path, "wb");
    cr_assert(f);
    cr_assert_eq(fwrite(b, 1, n, f), n);
    fclose(f);
}

/* The name of rank r's file in dir (from the index). */
static void rank_file(const char *dir, int r, char *out, size_t cap)
{
    char ip[512];
    snprintf(ip, sizeof ip, "%s/index.json", dir);
    json_t *ix = json_load_file(ip, 0, NULL);
    cr_assert(ix);
    json_t *files = json_object_get(ix, "files");
    out[0] = '\0';
    for (size_t i = 0; i < json_array_size(files); i++)
        if (json_integer_value(json_object_get(json_array_get(files, i), "rank")) == r)
            snprintf(out, cap, "%s/%s", dir, json_string_value(json_object_get(json_array_get(files, i), "name")));
    json_decref(ix);
    cr_assert(out[0], "no file of rank %d", r);
}

Test(checkpoint, errors_leave_the_model_unchanged, .timeout = 120)
{
    char *dir = tmp_dir(), sgd_dir[300];
    snprintf(sgd_dir, sizeof sgd_dir, "%s/sgd", dir);
    snap s;
    snap_init(&s);
    run_arg sa = {.dir = dir, .mesh_kind = MESH_1D, .optkind = OPT_ADAMW, .steps = 1, .seed = 5, .at = &s};
    th_run_world(2, saver, &sa, 30);
    snap s2;
    snap_init(&s2);
    run_arg sg = {.dir = sgd_dir, .mesh_kind = MESH_1D, .optkind = OPT_SGD_MOM, .steps = 1, .seed = 5, .at = &s2};
    th_run_world(2, saver, &sg, 30);
    char f1[600], ip[512];
    rank_file(dir, 1, f1, sizeof f1);
    snprintf(ip, sizeof ip, "%s/index.json", dir);
    size_t n_f1, n_ip;
    void *b_f1 = slurp(f1, &n_f1), *b_ip = slurp(ip, &n_ip);
    static const struct {
        int kind;
        ts_status want;
        const char *needle; /* in rank 0's or rank 1's message */
    } cases[] = {
        {E_NO_DIR, TS_ERR_IO, "no_such_folder"},
        {E_NO_FILE, TS_ERR_IO, "rank00001-"},
        {E_TRUNCATED, TS_ERR_FORMAT, "rank00001-"},
        {E_BAD_INDEX, TS_ERR_FORMAT, "index.json"},
        {E_SHAPE, TS_ERR_SHAPE, "2.weight"},
        {E_DTYPE, TS_ERR_DTYPE, "extra.data_step"},
        {E_MISSING_EXTRA, TS_ERR_NOT_FOUND, "extra.not_saved"},
        {E_UNEXPECTED, TS_ERR_NOT_FOUND, "5.offset"},
        {E_SGD_INTO_ADAMW, TS_ERR_INVALID_ARGUMENT, "SGD"},
        {E_NONSTRICT_UNEXPECTED, TS_OK, ""},
        {E_DTYPE_MODEL, TS_ERR_DTYPE, "'0.weight' is float32 in the checkpoint, float64 here"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (cases[i].kind == E_NO_FILE) cr_assert_eq(unlink(f1), 0);
        if (cases[i].kind == E_TRUNCATED) spit(f1, b_f1, n_f1 - 12);
        if (cases[i].kind == E_BAD_INDEX) spit(ip, b_ip, n_ip / 2);
        snap before, after;
        snap_init(&before);
        snap_init(&after);
        err_arg ea = {.dir = cases[i].kind == E_SGD_INTO_ADAMW ? sgd_dir : dir,
                      .kind = cases[i].kind,
                      .want = cases[i].want,
                      .before = &before,
                      .after = &after};
        th_run_world(2, err_rank, &ea, 30);
        if (cases[i].want) {
            snap_assert_equal(&before, &after, 0, "a failed load");
            cr_assert(strstr(ea.msg[0], cases[i].needle) || strstr(ea.msg[1], cases[i].needle),
                      "case %zu: '%s' not in the messages '%s' / '%s'", i, cases[i].needle, ea.msg[0], ea.msg[1]);
        }
        snap_fini(&before);
        snap_fini(&after);
        spit(f1, b_f1, n_f1);
        spit(ip, b_ip, n_ip);
    }
    free(b_f1);
    free(b_ip);
    snap_fini(&s);
    snap_fini(&s2);
    th_rm_rf(sgd_dir);
    th_rm_rf(dir);
    free(dir);
}

/* ------------------------------------------------------------ atomicity */

static void *child_rank_main(void *arg)
{
    th_rank *rc = arg;
    rc->fn(rc);
    return NULL;
}

/* A W-rank loopback world in a forked child, without Criterion: returns
 * 0 when every rank's fn succeeded. */
static int child_world(int W, th_rank_fn fn, void *arg)
{
    ts_loopback_fabric *f = NULL;
    if (ts__loopback_fabric_new(W, &f)) return 1;
    th_rank rc[TH_MAXW];
    pthread_t th[TH_MAXW];
    memset(rc, 0, sizeof rc);
    for (int i = 0; i < W; i++) {
        ts_transport *t = NULL;
        rc[i] = (th_rank){.rank = i, .W = W, .f = f, .fn = fn, .arg = arg};
        if (ts__loopback_transport_new(f, i, &t) || ts__world_new(t, 30, &rc[i].c)) return 1;
    }
    for (int i = 0; i < W; i++) pthread_create(&th[i], NULL, child_rank_main, &rc[i]);
    for (int i = 0; i < W; i++) pthread_join(th[i], NULL);
    int bad = 0;
    for (int i = 0; i < W; i++) {
        if (rc[i].err[0]) {
            fprintf(stderr, "%s\n", rc[i].err);
            bad = 1;
        }
        ts__world_free(rc[i].c);
    }
    ts__loopback_fabric_free(f);
    return bad;
}

typedef struct kill_arg {
    const char *dir;
    uint64_t seed;
} kill_arg;

static const char *g_kill_point;
static int g_kill_rank;

static void kill_hook(const char *point, int rank)
{
    if (g_kill_point && !strcmp(point, g_kill_point) && rank == g_kill_rank) raise(SIGKILL);
}

static int g_tmp_kill_rank = -1;
static int tmp_hook(const char *tmp)
{
    /* ts_safetensors_save's temporary file was just created (empty): the
     * rank whose file it is dies here */
    char want[32];
    snprintf(want, sizeof want, "/.rank%05d-", g_tmp_kill_rank);
    if (g_tmp_kill_rank >= 0 && strstr(tmp, want)) raise(SIGKILL);
    return 0;
}

/* A model without optimizer state: its values are those of
 * ts_manual_seed(seed), which the parent rebuilds to compare. */
static int kill_saver(th_rank *rc)
{
    kill_arg *a = rc->arg;
    model_t m;
    TH_RK_OK(rc, build(rc->c, MESH_1D, OPT_ADAMW, a->seed, 5, &m));
    ts_ckpt_options o = ts_ckpt_options_default();
    o.optim = m.opt;
    TH_RK_OK(rc, ts_ckpt_save(a->dir, m.root, &o));
    model_free(&m);
    return 0;
}

/* Forks a child that saves seed's model on 2 ranks into dir; with a kill
 * point the child dies there. Returns the child's pid. */
static pid_t fork_save(const char *dir, uint64_t seed, const char *point, int rank, int tmp_rank)
{
    fflush(NULL);
    pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        g_kill_point = point;
        g_kill_rank = rank;
        g_tmp_kill_rank = tmp_rank;
        ts__ckpt_crash_hook = kill_hook;
        ts__safetensors_save_hook = tmp_hook;
        kill_arg a = {dir, seed};
        _exit(child_world(2, kill_saver, &a) ? 3 : 0);
    }
    return pid;
}

static int wait_child(pid_t pid)
{
    int status = 0;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    return status;
}

/* Which seed's model dir loads as, on one rank without a world: 0 when
 * it is neither's (or fails to load). */
static uint64_t loads_as(const char *dir, uint64_t s1, uint64_t s2)
{
    model_t m, r1, r2;
    cr_assert_eq(build(NULL, MESH_NONE, OPT_NONE, 999, 5, &m), TS_OK);
    ts_status st = ts_ckpt_load(dir, m.root, NULL, NULL);
    cr_assert_eq(st, TS_OK, "the folder does not load after a killed save: %s", ts_last_error());
    cr_assert_eq(build(NULL, MESH_NONE, OPT_NONE, s1, 5, &r1), TS_OK);
    cr_assert_eq(build(NULL, MESH_NONE, OPT_NONE, s2, 5, &r2), TS_OK);
    snap a, b1, b2;
    snap_init(&a);
    snap_init(&b1);
    snap_init(&b2);
    snap_take(&a, 0, &m);
    snap_take(&b1, 0, &r1);
    snap_take(&b2, 0, &r2);
    bool eq1 = true, eq2 = true;
    for (int i = 0; i < a.n; i++) {
        size_t nb = (size_t)a.e[i].numel * ts_dtype_size(a.e[i].dtype);
        eq1 &= !memcmp(a.e[i].data, b1.e[i].data, nb);
        eq2 &= !memcmp(a.e[i].data, b2.e[i].data, nb);
    }
    snap_fini(&a);
    snap_fini(&b1);
    snap_fini(&b2);
    model_free(&m);
    model_free(&r1);
    model_free(&r2);
    return eq1 ? s1 : eq2 ? s2 : 0;
}

static int count_files(const char *dir)
{
    DIR *d = opendir(dir);
    int n = 0;
    struct dirent *de;
    while (d && (de = readdir(d))) n += de->d_name[0] != '.' || (strcmp(de->d_name, ".") && strcmp(de->d_name, ".."));
    if (d) closedir(d);
    return n;
}

Test(checkpoint, killed_saves_leave_a_loadable_checkpoint, .timeout = 120)
{
    char *dir = tmp_dir();
    /* deterministic crash points: before each a previous checkpoint is
     * in place (seed 1), the killed save writes seed 2 */
    static const struct {
        const char *point;
        int rank, tmp_rank;
        bool new_expected;
    } pts[] = {
        {NULL, -1, 0, false}, /* rank 0's temporary file just created */
        {NULL, -1, 1, false}, /* rank 1's */
        {"file_begin", 0, -1, false},   {"file_begin", 1, -1, false}, {"file_done", 0, -1, false},
        {"file_done", 1, -1, false},    {"index_tmp", 0, -1, false},  {"index_synced", 0, -1, false},
        {"index_renamed", 0, -1, true}, {"dir_synced", 0, -1, true},  {"cleaned", 0, -1, true},
    };
    for (size_t i = 0; i < sizeof pts / sizeof pts[0]; i++) {
        cr_assert_eq(wait_child(fork_save(dir, 1, NULL, -1, -1)), 0, "the first save failed");
        int status = wait_child(fork_save(dir, 2, pts[i].point, pts[i].rank, pts[i].tmp_rank));
        cr_assert(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL, "point %zu: the child was not killed (status %d)",
                  i, status);
        uint64_t got = loads_as(dir, 1, 2);
        cr_assert_eq(got, pts[i].new_expected ? 2u : 1u, "killed at %s (rank %d, tmp %d): loads as seed %llu",
                     pts[i].point, pts[i].rank, pts[i].tmp_rank, (unsigned long long)got);
    }
    /* a save after all that: loads as new, and the leftovers are gone */
    cr_assert_eq(wait_child(fork_save(dir, 2, NULL, -1, -1)), 0);
    cr_assert_eq(loads_as(dir, 1, 2), 2u);
    cr_assert_eq(count_files(dir), 3, "index and two rank files expected, %d files", count_files(dir));

    /* random kill times over the length of a save */
    double t0 = th_now_s();
    cr_assert_eq(wait_child(fork_save(dir, 1, NULL, -1, -1)), 0);
    double len = th_now_s() - t0;
    unsigned seed = 12345;
    int olds = 0, news = 0;
    for (int i = 0; i < 24; i++) {
        uint64_t prev = i % 2 ? 2 : 1, next = i % 2 ? 1 : 2;
        pid_t pid = fork_save(dir, next, NULL, -1, -1);
        struct timespec ts = {0, (long)(1e9 * len * 1.2 * (double)rand_r(&seed) / RAND_MAX)};
        nanosleep(&ts, NULL); /* a random point of the save, not a wait for progress */
        kill(pid, SIGKILL);
        int status = wait_child(pid);
        uint64_t got = loads_as(dir, prev, next);
        if (got != prev && got != next && getenv("CK_DEBUG")) {
            char cmd[400];
            snprintf(cmd, sizeof cmd, "ls -la %s; cat %s/index.json | head -30", dir, dir);
            if (system(cmd)) {}
        }
        cr_assert(got == prev || got == next, "random kill %d: loads as neither checkpoint (status %d)", i, status);
        if (WIFEXITED(status))
            cr_assert_eq(got, next, "random kill %d: the save completed but loads as the old one", i);
        olds += got == prev;
        news += got == next;
        if (got == prev) { /* the next trial expects `next` in place: finish it */
            cr_assert_eq(wait_child(fork_save(dir, next, NULL, -1, -1)), 0);
        }
    }
    cr_log_info("random kills: %d left the previous checkpoint, %d the new one", olds, news);
    th_rm_rf(dir);
    free(dir);
}

/* ------------------------------------------------------------ full files, streamed */

typedef struct full_arg {
    const char *path, *path_ref;
    int mode;            /* 0: save the full file and the reference; 1: load it and compare */
    ts_state_dict *want; /* mode 1: the file's tensors (read by the test) */
} full_arg;

static int full_rank(th_rank *rc)
{
    full_arg *a = rc->arg;
    model_t m;
    const char *meta[2] = {"model", "tiny-mlp"};
    const ts_ckpt_meta cmeta[1] = {{"model", "tiny-mlp"}};
    if (a->mode == 0) {
        TH_RK_OK(rc, build(rc->c, MESH_1D, OPT_ADAMW, 11, 5, &m));
        TH_RK_OK(rc, train_step(&m));
        TH_RK_OK(rc, ts_ckpt_save_full(a->path, m.root, cmeta, 1));
        ts_state_dict *sd = NULL;
        TH_RK_OK(rc, ts_fsdp_full_state_dict(m.root, true, &sd));
        if (rc->rank == 0) TH_RK_OK(rc, ts_safetensors_save(a->path_ref, sd, meta, 1));
        ts_state_dict_free(sd);
    } else {
        TH_RK_OK(rc, build(rc->c, MESH_1D, OPT_ADAMW, 12, 5, &m));
        TH_RK_OK(rc, ts_ckpt_load_full(a->path, m.root, true));
        ts_state_dict *sd = NULL;
        TH_RK_OK(rc, ts_fsdp_full_state_dict(m.root, false, &sd));
        TH_RK_EQ(rc, ts_state_dict_size(sd), ts_state_dict_size(a->want));
        for (int i = 0; i < ts_state_dict_size(sd); i++) {
            ts_tensor *x = ts_state_dict_tensor(sd, i), *y = ts_state_dict_get(a->want, ts_state_dict_name(sd, i));
            if (!y || ts_tensor_numel(x) != ts_tensor_numel(y) ||
                memcmp(ts_tensor_data(x), ts_tensor_data(y),
                       (size_t)ts_tensor_numel(x) * ts_dtype_size(ts_tensor_dtype(x))))
                return th_rank_fail(rc, "%s differs after ts_ckpt_load_full", ts_state_dict_name(sd, i));
        }
        ts_state_dict_free(sd);
        /* errors: shape (another model), strict keys (no buffer), nothing changed */
        model_t m2;
        TH_RK_OK(rc, build(rc->c, MESH_1D, OPT_NONE, 13, 6, &m2));
        TH_RK_EQ(rc, ts_ckpt_load_full(a->path, m2.root, true), TS_ERR_SHAPE);
        model_free(&m2);
        g_no_buffer = true;
        TH_RK_OK(rc, build(rc->c, MESH_1D, OPT_NONE, 13, 5, &m2));
        g_no_buffer = false;
        TH_RK_EQ(rc, ts_ckpt_load_full(a->path, m2.root, true), TS_ERR_NOT_FOUND);
        if (!strstr(ts_last_error(), "5.offset")) return th_rank_fail(rc, "message: %s", ts_last_error());
        TH_RK_OK(rc, ts_ckpt_load_full(a->path, m2.root, false));
        model_free(&m2);
    }
    model_free(&m);
    return 0;
}

Test(checkpoint, full_file_streamed_equals_full_state_dict, .timeout = 60)
{
    char *dir = tmp_dir(), p1[300], p2[300];
    snprintf(p1, sizeof p1, "%s/full.safetensors", dir);
    snprintf(p2, sizeof p2, "%s/ref.safetensors", dir);
    full_arg a = {.path = p1, .path_ref = p2, .mode = 0};
    th_run_world(3, full_rank, &a, 30);
    size_t n1, n2;
    void *b1 = slurp(p1, &n1), *b2 = slurp(p2, &n2);
    cr_assert_eq(n1, n2, "ts_ckpt_save_full wrote %zu bytes, ts_safetensors_save of the full state dict %zu", n1, n2);
    cr_assert(memcmp(b1, b2, n1) == 0, "the files differ");
    free(b1);
    free(b2);
    /* loaded on 2 and on 4 ranks: ts_fsdp_full_state_dict gives the file's tensors */
    a.mode = 1;
    TH_OK(ts_safetensors_load(p1, &a.want));
    th_run_world(2, full_rank, &a, 30);
    th_run_world(4, full_rank, &a, 30);
    ts_state_dict_free(a.want);
    unlink(p1);
    unlink(p2);
    th_rm_rf(dir);
    free(dir);
}

/* A model of 6 Linear(64, 64): 6 weights of 16 KiB. */
static ts_status wide_model(ts_module **out)
{
    ts_manual_seed(21);
    ts_module *c[6] = {0};
    ts_status st = TS_OK;
    for (int i = 0; i < 6 && !st; i++) st = ts_linear_new(64, 64, true, &c[i]);
    if (!st) st = ts_sequential_new(6, c, out);
    if (st)
        for (int i = 0; i < 6; i++) ts_module_free(c[i]);
    if (!st) st = ts_fsdp_apply_by_type(*out, "Linear", NULL, NULL);
    if (!st) st = ts_fully_shard(*out, NULL);
    return st;
}

Test(checkpoint, full_file_peak_memory_is_one_tensor, .timeout = 60)
{
    char *dir = tmp_dir(), path[300];
    snprintf(path, sizeof path, "%s/wide.safetensors", dir);
    ts_module *m = NULL, *m2 = NULL;
    TH_OK(wide_model(&m));
    TH_OK(wide_model(&m2));
    const size_t model_bytes = 6 * (64 * 64 + 64) * 4, largest = 64 * 64 * 4;
    size_t base = ts_mem_live_bytes(TS_MEM_STORAGE);
    ts_mem_reset_peak();
    TH_OK(ts_ckpt_save_full(path, m, NULL, 0));
    size_t save_extra = ts_mem_peak_bytes(TS_MEM_STORAGE) - base;
    base = ts_mem_live_bytes(TS_MEM_STORAGE);
    ts_mem_reset_peak();
    TH_OK(ts_ckpt_load_full(path, m2, true));
    size_t load_extra = ts_mem_peak_bytes(TS_MEM_STORAGE) - base;
    cr_log_info("full file: model %zu bytes, largest tensor %zu; peak extra tensor memory: save %zu, load %zu",
                model_bytes, largest, save_extra, load_extra);
    cr_assert(save_extra <= largest + 1024, "save: %zu extra bytes, one tensor is %zu", save_extra, largest);
    cr_assert(load_extra <= largest + 1024, "load: %zu extra bytes, one tensor is %zu", load_extra, largest);
    cr_assert(model_bytes >= 6 * largest);
    /* the loaded model equals the saved one */
    ts_state_dict *a = NULL, *b = NULL;
    TH_OK(ts_fsdp_full_state_dict(m, false, &a));
    TH_OK(ts_fsdp_full_state_dict(m2, false, &b));
    for (int i = 0; i < ts_state_dict_size(a); i++)
        cr_assert(memcmp(ts_tensor_data(ts_state_dict_tensor(a, i)), ts_tensor_data(ts_state_dict_tensor(b, i)),
                         (size_t)ts_tensor_numel(ts_state_dict_tensor(a, i)) * 4) == 0);
    ts_state_dict_free(a);
    ts_state_dict_free(b);
    ts_module_free(m);
    ts_module_free(m2);
    unlink(path);
    th_rm_rf(dir);
    free(dir);
}

/* ------------------------------------------------------------ the index parser */

Test(checkpoint, index_parser_rejects_malformed_indexes)
{
    static const char good[] =
        "{\"format\":\"tensorshard-dcp\",\"version\":1,\"save_id\":\"ab\",\"world\":2,"
        "\"files\":[{\"name\":\"a\",\"rank\":0,\"size\":100},{\"name\":\"b\",\"rank\":1,\"size\":100}],"
        "\"tensors\":{\"w\":{\"kind\":\"model\",\"dtype\":\"F32\",\"shape\":[3,2],\"placements\":[\"Shard(0)\"],"
        "\"pieces\":["
        "{\"file\":0,\"rank\":0,\"row\":0,\"rows\":2,\"offset\":8,\"length\":16},"
        "{\"file\":1,\"rank\":1,\"row\":2,\"rows\":1,\"offset\":8,\"length\":8}]}}}";
    ts__ckpt_index *ix = NULL;
    TH_OK(ts__ckpt_index_parse("good", good, strlen(good), &ix));
    const ts__ckpt_tensor *t = ts__ckpt_index_find(ix, "w");
    cr_assert(t && t->n_pieces == 2 && t->rows == 3 && t->row_bytes == 8);
    cr_assert_null(ts__ckpt_index_find(ix, "v"));
    ts__ckpt_index_free(ix);
    /* each a change of `good`, and a word the message must hold */
    static const struct {
        const char *from, *to, *needle;
    } bad[] = {
        {"\"rows\":1,\"offset\":8", "\"rows\":2,\"offset\":8", "outside"},           /* rows past the end */
        {"\"row\":2,", "\"row\":1,", "overlap"},                                     /* rows 1-2 twice */
        {"\"row\":2,\"rows\":1", "\"row\":2,\"rows\":0", "0 rows"},                  /* a gap / an empty piece */
        {"\"length\":8}", "\"length\":9}", "length"},                                /* bytes for its rows */
        {"\"offset\":8,\"length\":8", "\"offset\":96,\"length\":8", "outside file"}, /* past the file's size */
        {"\"file\":1", "\"file\":2", "file 2"},                                      /* no such file */
        {"\"F32\"", "\"F8\"", "dtype"},
        {"\"model\"", "\"weights\"", "kind"},
        {"\"name\":\"a\"", "\"name\":\"../a\"", "plain file name"},
        {"\"version\":1", "\"version\":3", "version"}, /* 1 and 2 load (docs/checkpoint.md) */
        {"\"world\":2", "\"world\":0", "world"},
        {"[3,2]", "[3,-2]", "shape"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char buf[1024];
        const char *at = strstr(good, bad[i].from);
        cr_assert(at, "case %zu: '%s' not in the good index", i, bad[i].from);
        snprintf(buf, sizeof buf, "%.*s%s%s", (int)(at - good), good, bad[i].to, at + strlen(bad[i].from));
        ix = NULL;
        ts_status st = ts__ckpt_index_parse("bad", buf, strlen(buf), &ix);
        cr_assert_eq(st, TS_ERR_FORMAT, "case %zu (%s): %s", i, bad[i].to, ts_status_name(st));
        cr_assert_null(ix);
        cr_assert(strstr(ts_last_error(), bad[i].needle), "case %zu: '%s' not in '%s'", i, bad[i].needle,
                  ts_last_error());
    }
    /* truncated at every length */
    for (size_t n = 0; n < strlen(good); n++) {
        ix = NULL;
        cr_assert_eq(ts__ckpt_index_parse("cut", good, n, &ix), TS_ERR_FORMAT, "cut at %zu", n);
        cr_assert_null(ix);
    }
}

/* ------------------------------------------------------------ one process, no world */

Test(checkpoint, unsharded_model_round_trip_and_save_errors, .timeout = 60)
{
    char *dir = tmp_dir(), ck[300];
    snprintf(ck, sizeof ck, "%s/ck", dir);
    model_t a, b, other;
    TH_OK(build(NULL, MESH_NONE, OPT_SGD_MOM, 31, 5, &a));
    TH_OK(train_step(&a));
    TH_OK(train_step(&a));
    ts_ckpt_options o = ts_ckpt_options_default();
    o.optim = a.opt;
    TH_OK(ts_ckpt_save(ck, a.root, &o));
    TH_OK(build(NULL, MESH_NONE, OPT_SGD_MOM, 32, 5, &b));
    o.optim = b.opt;
    ts_ckpt_info info;
    TH_OK(ts_ckpt_load(ck, b.root, &o, &info));
    cr_assert_eq(info.saved_world, 1);
    cr_assert_eq(info.optim_steps, 2);
    snap sa, sb;
    snap_init(&sa);
    snap_init(&sb);
    TH_OK(snap_take(&sa, 0, &a));
    TH_OK(snap_take(&sb, 0, &b));
    snap_assert_equal(&sa, &sb, 0, "unsharded round trip");
    /* the next steps agree too (SGD's momentum buffers were restored) */
    TH_OK(train_step(&a));
    TH_OK(train_step(&b));
    snap_fini(&sa);
    snap_fini(&sb);
    snap_init(&sa);
    snap_init(&sb);
    TH_OK(snap_take(&sa, 0, &a));
    TH_OK(snap_take(&sb, 0, &b));
    snap_assert_equal(&sa, &sb, 0, "unsharded, one step after the load");
    snap_fini(&sa);
    snap_fini(&sb);
    /* save errors: an optimizer over other tensors; a folder that is a file */
    TH_OK(build(NULL, MESH_NONE, OPT_ADAMW, 33, 5, &other));
    o.optim = other.opt;
    cr_assert_eq(ts_ckpt_save(ck, a.root, &o), TS_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(ts_last_error(), "not a parameter of the model"), "%s", ts_last_error());
    char file[320];
    snprintf(file, sizeof file, "%s/plain", dir);
    spit(file, "x", 1);
    o.optim = a.opt;
    cr_assert_eq(ts_ckpt_save(file, a.root, &o), TS_ERR_IO);
    cr_assert(strstr(ts_last_error(), "plain"), "%s", ts_last_error());
    unlink(file);
    /* metadata of a folder without it, and of no folder */
    char *v = NULL;
    cr_assert_eq(ts_ckpt_metadata(ck, "model", &v), TS_ERR_NOT_FOUND);
    cr_assert_eq(ts_ckpt_metadata(file, "model", &v), TS_ERR_IO);
    cr_assert_null(v);
    model_free(&a);
    model_free(&b);
    model_free(&other);
    th_rm_rf(ck);
    th_rm_rf(dir);
    free(dir);
}

/* The same on 2 ranks (threads, whose allocations the process-wide
 * counters add up): the peak extra tensor storage of both ranks together
 * stays at about one tensor (rank 0's gathered tensor and a shard in
 * flight for the save; each rank's half of one tensor for the load). */
typedef struct mem_arg {
    const char *path;
    size_t save_extra, load_extra;
} mem_arg;

static int mem_rank(th_rank *rc)
{
    mem_arg *a = rc->arg;
    ts_mesh *mesh = NULL;
    int64_t shape[1] = {rc->W};
    const char *names[1] = {"dp"};
    TH_RK_OK(rc, ts_mesh_new(rc->c, "cpu", 1, shape, names, &mesh));
    ts_module *m[2] = {0};
    for (int k = 0; k < 2; k++) {
        ts_module *c[6] = {0};
        static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
        pthread_mutex_lock(&mu);
        ts_manual_seed(21 + (uint64_t)k);
        for (int i = 0; i < 6; i++) ts_linear_new(64, 64, true, &c[i]);
        pthread_mutex_unlock(&mu);
        TH_RK_OK(rc, ts_sequential_new(6, c, &m[k]));
        ts_fsdp_options fo = ts_fsdp_options_default();
        fo.mesh = mesh;
        TH_RK_OK(rc, ts_fsdp_apply_by_type(m[k], "Linear", &fo, NULL));
        TH_RK_OK(rc, ts_fully_shard(m[k], &fo));
    }
    size_t base = 0;
    for (int phase = 0; phase < 2; phase++) {
        TH_RK_OK(rc, ts_barrier(rc->c, NULL));
        if (rc->rank == 0) {
            base = ts_mem_live_bytes(TS_MEM_STORAGE);
            ts_mem_reset_peak();
        }
        TH_RK_OK(rc, ts_barrier(rc->c, NULL));
        if (phase == 0) TH_RK_OK(rc, ts_ckpt_save_full(a->path, m[0], NULL, 0));
        else TH_RK_OK(rc, ts_ckpt_load_full(a->path, m[1], true));
        TH_RK_OK(rc, ts_barrier(rc->c, NULL));
        if (rc->rank == 0) *(phase ? &a->load_extra : &a->save_extra) = ts_mem_peak_bytes(TS_MEM_STORAGE) - base;
    }
    ts_module_free(m[0]);
    ts_module_free(m[1]);
    ts_mesh_free(mesh);
    return 0;
}

Test(checkpoint, full_file_peak_memory_on_two_ranks, .timeout = 60)
{
    char *dir = tmp_dir(), path[300];
    snprintf(path, sizeof path, "%s/wide.safetensors", dir);
    mem_arg a = {.path = path};
    th_run_world(2, mem_rank, &a, 30);
    const size_t largest = 64 * 64 * 4, model_bytes = 6 * (64 * 64 + 64) * 4;
    cr_log_info(
        "2 ranks: model %zu bytes, largest tensor %zu; peak extra tensor memory of both ranks: save %zu, load %zu",
        model_bytes, largest, a.save_extra, a.load_extra);
    /* the save: rank 0's gathered tensor, plus the rows of the other rank
     * in flight (measured: 16384 + 8192) */
    cr_assert(a.save_extra <= largest + largest / 2 + 1024, "save: %zu extra bytes, one tensor is %zu", a.save_extra,
              largest);
    cr_assert(a.load_extra <= largest + 1024, "load: %zu extra bytes, one tensor is %zu", a.load_extra, largest);
    cr_assert(a.save_extra * 4 < model_bytes && a.load_extra * 4 < model_bytes);
    unlink(path);
    th_rm_rf(dir);
    free(dir);
}

/* ------------------------------------------------------------ review: checksums, hyperparameters, locks, metadata */

/* A one-rank checkpoint of an AdamW model in dir/ck (created); *m is the model saved. */
static void save_one(const char *ck, int optkind, uint64_t seed, model_t *m)
{
    TH_OK(build(NULL, MESH_NONE, optkind, seed, 5, m));
    TH_OK(train_step(m));
    ts_ckpt_options o = ts_ckpt_options_default();
    o.optim = m->opt;
    TH_OK(ts_ckpt_save(ck, m->root, &o));
}

/* The index's piece 0 of key: its file's path, offset and length. */
static void piece_of(const char *dir, const char *key, char *path, size_t cap, uint64_t *off, uint64_t *len)
{
    char ip[512];
    snprintf(ip, sizeof ip, "%s/index.json", dir);
    json_t *ix = json_load_file(ip, 0, NULL);
    cr_assert(ix);
    json_t *p = json_array_get(json_object_get(json_object_get(json_object_get(ix, "tensors"), key), "pieces"), 0);
    cr_assert(p, "no piece of '%s'", key);
    json_t *f = json_array_get(json_object_get(ix, "files"), (size_t)json_integer_value(json_object_get(p, "file")));
    snprintf(path, cap, "%s/%s", dir, json_string_value(json_object_get(f, "name")));
    *off = (uint64_t)json_integer_value(json_object_get(p, "offset"));
    *len = (uint64_t)json_integer_value(json_object_get(p, "length"));
    json_decref(ix);
}

/* One flipped bit inside a tensor's bytes (the file's size, header and
 * index intact) was loaded silently: each piece's checksum is now in the
 * index and checked, and the model is left unchanged. */
Test(checkpoint, corrupted_tensor_byte_is_detected, .timeout = 60)
{
    char *dir = tmp_dir(), ck[300];
    snprintf(ck, sizeof ck, "%s/ck", dir);
    model_t a, b;
    save_one(ck, OPT_ADAMW, 41, &a);
    static const char *const keys[] = {"2.weight", "optim.state.0.weight.exp_avg_sq"};
    for (int k = 0; k < 2; k++) {
        char path[700];
        uint64_t off, len;
        piece_of(ck, keys[k], path, sizeof path, &off, &len);
        size_t n;
        unsigned char *bytes = slurp(path, &n);
        cr_assert(off + len <= n);
        bytes[off + len / 2] ^= 0x10;
        spit(path, bytes, n);
        TH_OK(build(NULL, MESH_NONE, OPT_ADAMW, 42, 5, &b));
        snap before, after;
        snap_init(&before);
        snap_init(&after);
        TH_OK(snap_take(&before, 0, &b));
        ts_ckpt_options o = ts_ckpt_options_default();
        o.optim = b.opt;
        cr_assert_eq(ts_ckpt_load(ck, b.root, &o, NULL), TS_ERR_FORMAT, "a flipped bit in '%s' loaded", keys[k]);
        cr_assert(strstr(ts_last_error(), keys[k]) && strstr(ts_last_error(), "corrupted"), "%s", ts_last_error());
        TH_OK(snap_take(&after, 0, &b));
        snap_assert_equal(&before, &after, 0, "a load of a corrupted file");
        /* the byte put back: it loads, equal to the model saved */
        bytes[off + len / 2] ^= 0x10;
        spit(path, bytes, n);
        free(bytes);
        TH_OK(ts_ckpt_load(ck, b.root, &o, NULL));
        snap sa, sb;
        snap_init(&sa);
        snap_init(&sb);
        TH_OK(snap_take(&sa, 0, &a));
        TH_OK(snap_take(&sb, 0, &b));
        snap_assert_equal(&sa, &sb, 0, "the repaired checkpoint");
        snap_fini(&sa);
        snap_fini(&sb);
        snap_fini(&before);
        snap_fini(&after);
        model_free(&b);
    }
    model_free(&a);
    th_rm_rf(ck);
    th_rm_rf(dir);
    free(dir);
}

/* The header said the optimizer's hyperparameters are recorded; the index
 * held only its kind and step count. */
Test(checkpoint, optimizer_hyperparameters_are_in_the_index, .timeout = 60)
{
    char *dir = tmp_dir(), ck[300];
    snprintf(ck, sizeof ck, "%s/ck", dir);
    for (int k = 0; k < 2; k++) {
        model_t a;
        int kind = k ? OPT_SGD_MOM : OPT_ADAMW;
        TH_OK(build(NULL, MESH_NONE, kind, 43, 5, &a));
        TH_OK(train_step(&a));
        ts_optim_set_lr(a.opt, 0.0123);
        ts_ckpt_options o = ts_ckpt_options_default();
        o.optim = a.opt;
        TH_OK(ts_ckpt_save(ck, a.root, &o));
        char ip[400];
        snprintf(ip, sizeof ip, "%s/index.json", ck);
        json_t *ix = json_load_file(ip, 0, NULL);
        cr_assert(ix);
        json_t *oj = json_object_get(ix, "optim");
        json_t *g = json_array_get(json_object_get(oj, "param_groups"), 0);
        cr_assert(json_is_object(g), "no optim.param_groups[0] in the index");
        cr_assert_eq(json_real_value(json_object_get(g, "lr")), 0.0123);
        ts__optim_hparams hp;
        ts__optim_hparams_get(a.opt, &hp);
        cr_assert_eq(json_real_value(json_object_get(g, "weight_decay")), hp.weight_decay);
        if (k) {
            cr_assert_str_eq(json_string_value(json_object_get(oj, "kind")), "SGD");
            cr_assert_gt(hp.momentum, 0);
            cr_assert_eq(json_real_value(json_object_get(g, "momentum")), hp.momentum);
            cr_assert(json_is_boolean(json_object_get(g, "nesterov")));
        } else {
            cr_assert_str_eq(json_string_value(json_object_get(oj, "kind")), "AdamW");
            json_t *betas = json_object_get(g, "betas");
            cr_assert_eq(json_array_size(betas), 2);
            cr_assert_eq(json_real_value(json_array_get(betas, 0)), hp.beta1);
            cr_assert_eq(json_real_value(json_array_get(betas, 1)), hp.beta2);
            cr_assert_eq(json_real_value(json_object_get(g, "eps")), hp.eps);
            cr_assert(json_is_false(json_object_get(g, "amsgrad")));
        }
        json_decref(ix);
        model_free(&a);
    }
    th_rm_rf(ck);
    th_rm_rf(dir);
    free(dir);
}

/* Two saves into one folder at once removed each other's new files (each
 * one's cleanup keeps only what its own index names): a second save while
 * one holds the folder is refused, and the checkpoint in it stays. */
Test(checkpoint, overlapping_save_into_one_folder_is_refused, .timeout = 60)
{
    char *dir = tmp_dir(), ck[300];
    snprintf(ck, sizeof ck, "%s/ck", dir);
    model_t a, b;
    save_one(ck, OPT_ADAMW, 44, &a);
    TH_OK(build(NULL, MESH_NONE, OPT_ADAMW, 45, 5, &b));
    int fd = open(ck, O_RDONLY | O_DIRECTORY);
    cr_assert_geq(fd, 0);
    cr_assert_eq(flock(fd, LOCK_EX | LOCK_NB), 0); /* as a save in progress holds it */
    ts_ckpt_options o = ts_ckpt_options_default();
    o.optim = b.opt;
    cr_assert_eq(ts_ckpt_save(ck, b.root, &o), TS_ERR_STATE);
    cr_assert(strstr(ts_last_error(), "under way") && strstr(ts_last_error(), ck), "%s", ts_last_error());
    cr_assert_eq(count_files(ck), 2, "the refused save left files: %d", count_files(ck));
    close(fd);
    /* the checkpoint is a's; and with the lock free the save goes through */
    model_t c;
    TH_OK(build(NULL, MESH_NONE, OPT_ADAMW, 46, 5, &c));
    o.optim = c.opt;
    TH_OK(ts_ckpt_load(ck, c.root, &o, NULL));
    snap sa, sc;
    snap_init(&sa);
    snap_init(&sc);
    TH_OK(snap_take(&sa, 0, &a));
    TH_OK(snap_take(&sc, 0, &c));
    snap_assert_equal(&sa, &sc, 0, "the checkpoint after a refused save");
    snap_fini(&sa);
    snap_fini(&sc);
    o.optim = b.opt;
    TH_OK(ts_ckpt_save(ck, b.root, &o));
    model_free(&a);
    model_free(&b);
    model_free(&c);
    th_rm_rf(ck);
    th_rm_rf(dir);
    free(dir);
}

/* Metadata with quotes, backslashes, newlines, control characters and
 * non-ASCII round-trips through the index and every file's __metadata__;
 * a value that is not UTF-8 is refused and the old checkpoint stays. */
Test(checkpoint, odd_metadata_round_trips, .timeout = 60)
{
    char *dir = tmp_dir(), ck[300];
    snprintf(ck, sizeof ck, "%s/ck", dir);
    model_t a;
    save_one(ck, OPT_ADAMW, 47, &a);
    static const char odd_key[] = "vocab \"q\"\n", odd_val[] = "a\"b\\c\nd\te\x01 \xc3\xa9 \xe6\xbc\xa2 {\"x\": 1}";
    char big[70000];
    memset(big, 'z', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    const ts_ckpt_meta meta[2] = {{odd_key, odd_val}, {"big", big}};
    ts_ckpt_options o = ts_ckpt_options_default();
    o.optim = a.opt;
    o.metadata = meta;
    o.n_metadata = 2;
    TH_OK(ts_ckpt_save(ck, a.root, &o));
    char *v = NULL;
    TH_OK(ts_ckpt_metadata(ck, odd_key, &v));
    cr_assert_str_eq(v, odd_val);
    free(v);
    TH_OK(ts_ckpt_metadata(ck, "big", &v));
    cr_assert_eq(strlen(v), sizeof big - 1);
    free(v);
    /* every file's header is valid JSON with the same value */
    char path[700];
    uint64_t off, len;
    piece_of(ck, "0.weight", path, sizeof path, &off, &len);
    uint64_t ds, sz;
    json_t *h = read_st_header(path, &ds, &sz);
    cr_assert(h, "the file's header is not valid JSON");
    cr_assert_str_eq(json_string_value(json_object_get(json_object_get(h, "__metadata__"), odd_key)), odd_val);
    json_decref(h);
    model_t b;
    TH_OK(build(NULL, MESH_NONE, OPT_ADAMW, 48, 5, &b));
    ts_ckpt_options lo = ts_ckpt_options_default();
    lo.optim = b.opt;
    TH_OK(ts_ckpt_load(ck, b.root, &lo, NULL));
    /* not UTF-8: refused, naming the pair; the checkpoint above stays */
    const ts_ckpt_meta bad[1] = {{"vocab", "\xff\xfe"}};
    o.metadata = bad;
    o.n_metadata = 1;
    cr_assert_eq(ts_ckpt_save(ck, a.root, &o), TS_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(ts_last_error(), "UTF-8"), "%s", ts_last_error());
    TH_OK(ts_ckpt_metadata(ck, odd_key, &v));
    cr_assert_str_eq(v, odd_val);
    free(v);
    TH_OK(ts_ckpt_load(ck, b.root, &lo, NULL));
    cr_assert_eq(count_files(ck), 2, "files left by the refused save: %d", count_files(ck));
    model_free(&a);
    model_free(&b);
    th_rm_rf(ck);
    th_rm_rf(dir);
    free(dir);
}

/* Ranks given different folders: rank 1 wrote its file into its own
 * folder, rank 0 did not find it (read as "a rank with nothing to write")
 * and replaced the good checkpoint with an index lacking rank 1's rows.
 * Now every rank fails and the previous checkpoint stays. */
typedef struct split_arg {
    const char *dir0, *dir1;
    ts_status st[2];
    char msg[2][600];
} split_arg;

static int split_saver(th_rank *rc)
{
    split_arg *a = rc->arg;
    model_t m;
    TH_RK_OK(rc, build(rc->c, MESH_1D, OPT_ADAMW, 51, 5, &m));
    TH_RK_OK(rc, train_step(&m));
    ts_ckpt_options o = ts_ckpt_options_default();
    o.optim = m.opt;
    a->st[rc->rank] = ts_ckpt_save(rc->rank ? a->dir1 : a->dir0, m.root, &o);
    snprintf(a->msg[rc->rank], sizeof a->msg[rc->rank], "%s", ts_last_error());
    model_free(&m);
    return 0;
}

Test(checkpoint, ranks_given_different_folders_fail_and_keep_the_checkpoint, .timeout = 60)
{
    char *dir = tmp_dir(), other[300];
    snprintf(other, sizeof other, "%s/other", dir);
    cr_assert_eq(mkdir(other, 0777), 0);
    snap s;
    snap_init(&s);
    run_arg sa = {.dir = dir, .mesh_kind = MESH_1D, .optkind = OPT_ADAMW, .steps = 1, .seed = 5, .at = &s};
    th_run_world(2, saver, &sa, 30);
    char ip[400];
    snprintf(ip, sizeof ip, "%s/index.json", dir);
    size_t n_before, n_after;
    void *before = slurp(ip, &n_before);
    split_arg a = {.dir0 = dir, .dir1 = other};
    th_run_world(2, split_saver, &a, 30);
    cr_assert_eq(a.st[0], TS_ERR_STATE, "rank 0: %s", a.msg[0]);
    cr_assert_eq(a.st[1], TS_ERR_STATE, "rank 1: %s", a.msg[1]);
    cr_assert(strstr(a.msg[0], "same folder"), "%s", a.msg[0]);
    void *after = slurp(ip, &n_after);
    cr_assert(n_before == n_after && !memcmp(before, after, n_before), "the index was replaced");
    cr_assert_eq(count_files(other), 0, "rank 1's file was left in its folder");
    free(before);
    free(after);
    snap_fini(&s);
    rmdir(other);
    th_rm_rf(dir);
    free(dir);
}
