/*
 * fully_shard for a user's own module types (issue 9 §3): no fixed tables
 * of module types or methods, malformed vtables refused with a message,
 * buffers never sharded, ts_module_print and ts_fsdp_summary; and the
 * mistakes that used to train silently (§4), each an error or a warning
 * in the log (captured from stderr).
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fully_shard/fully_shard.h"
#include "optim/optim.h"
#include "tests/log_capture.h"
#include "tests/loopback_ranks.h"

/* ------------------------------------------------------------ a user module */

/* y = x * w (elementwise, w of shape (dim,)), with a buffer counting
 * training forwards and any number of named methods ("m0", "m1", ...),
 * each returning x * w * (k + 1). */
typedef struct umod {
    ts_module base;
    ts_tensor *w;
    ts_tensor *calls; /* buffer: f32 (1,) */
} umod;

static ts_status umod_forward(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    umod *u = (umod *)m;
    TS_CHECK(n_in == 1, TS_ERR_INVALID_ARGUMENT, "UMod: 1 input, got %d", n_in);
    TS_TRY(ts_mul(in[0], u->w, &out[0]));
    *n_out = 1;
    if (m->training) ((float *)ts_tensor_data(u->calls))[0] += 1.0f;
    return TS_OK;
}

static ts_status umod_visit(ts_module *m, const ts_module_visitor *v)
{
    umod *u = (umod *)m;
    ts_status st = v->param ? v->param(v->ctx, "w", &u->w) : TS_OK;
    if (!st && v->buffer) st = v->buffer(v->ctx, "calls", &u->calls);
    return st;
}

static void umod_free(ts_module *m)
{
    umod *u = (umod *)m;
    ts_tensor_free(u->w);
    ts_tensor_free(u->calls);
    free(u);
}

#define N_METHODS 12
static ts_status umod_method(ts_module *m, int k, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    ts_tensor *y = NULL;
    ts_status st = umod_forward(m, n_in, in, n_out, &y);
    if (st) return st;
    st = ts_mul_scalar(y, (double)(k + 1), &out[0]);
    ts_tensor_free(y);
    return st;
}
/* one function per method: the table below names them (no generated bodies) */
static ts_status um0(ts_module *m, int n, ts_tensor *const *i, int *no, ts_tensor **o)
{
    return umod_method(m, 0, n, i, no, o);
}
static ts_status um11(ts_module *m, int n, ts_tensor *const *i, int *no, ts_tensor **o)
{
    return umod_method(m, 11, n, i, no, o);
}
static ts_status umx(ts_module *m, int n, ts_tensor *const *i, int *no, ts_tensor **o)
{
    return umod_method(m, 5, n, i, no, o);
}
static const ts_module_method umod_methods[N_METHODS] = {{"m0", um0}, {"m1", umx}, {"m2", umx},  {"m3", umx},
                                                         {"m4", umx}, {"m5", umx}, {"m6", umx},  {"m7", umx},
                                                         {"m8", umx}, {"m9", umx}, {"m10", umx}, {"m11", um11}};

static const ts_module_vtable umod_vt = {.type_name = "UMod",
                                         .forward = umod_forward,
                                         .visit = umod_visit,
                                         .free = umod_free,
                                         .methods = umod_methods,
                                         .n_methods = N_METHODS};

static ts_status umod_new_vt(const ts_module_vtable *vt, int64_t dim, ts_module **out)
{
    umod *u = calloc(1, sizeof *u);
    TS_CHECK(u, TS_ERR_NO_MEMORY, "UMod: out of memory");
    ts_status st;
    int64_t one = 1;
    TS_TRY_GOTO(st, ts_module_init(&u->base, vt), fail);
    TS_TRY_GOTO(st, ts_param_new(TS_F32, 1, &dim, &u->w), fail);
    TS_TRY_GOTO(st, ts_tensor_fill_(u->w, 2.0), fail);
    TS_TRY_GOTO(st, ts_tensor_zeros(TS_F32, 1, &one, &u->calls), fail);
    *out = &u->base;
    return TS_OK;
fail:
    ts_tensor_free(u->w);
    ts_tensor_free(u->calls);
    free(u);
    return st;
}

static ts_module *umod_new(int64_t dim)
{
    ts_module *m = NULL;
    TH_OK(umod_new_vt(&umod_vt, dim, &m));
    return m;
}

static int g_pre_forward;
static void count_events(void *ctx, const char *event, const char *fqn)
{
    (void)ctx, (void)fqn;
    if (strcmp(event, "pre_forward") == 0) g_pre_forward++;
}

/* ------------------------------------------------------------ §3: no fixed tables */

Test(fully_shard_usability, many_module_types_and_methods, .timeout = 60)
{
    /* 100 module types: more than any fixed table of the past (64) */
    enum { NT = 100 };
    static ts_module_vtable vts[NT];
    static char names[NT][16];
    ts_module *mods[NT];
    for (int i = 0; i < NT; i++) {
        vts[i] = umod_vt;
        snprintf(names[i], sizeof names[i], "T%d", i);
        vts[i].type_name = names[i];
        TH_OK(umod_new_vt(&vts[i], 4, &mods[i]));
        TH_OK(ts_fully_shard(mods[i], NULL));
        char want[32];
        snprintf(want, sizeof want, "T%dFSDPModule", i);
        cr_assert_str_eq(ts_module_type_name(mods[i]), want);
        cr_assert(ts_module_is_fsdp(mods[i]));
    }
    for (int i = 0; i < NT; i++) ts_module_free(mods[i]);

    /* 12 named methods (more than the old 8): the last one wrapped */
    ts_module *m = umod_new(4);
    TH_OK(ts_fully_shard(m, NULL));
    TH_OK(ts_fsdp_register_forward_method(m, "m11"));
    int64_t xs[1] = {4};
    ts_tensor *x = th_seq(TS_F32, 1, xs, 1.0, false), *outs[TS_MODULE_MAX_IO];
    int n = 0;
    ts_fsdp_set_event_hook(count_events, NULL);
    g_pre_forward = 0;
    TH_OK(ts_module_call_method(m, "m11", 1, &x, &n, outs));
    cr_assert_eq(g_pre_forward, 1, "the wrapped method ran through FSDP's pre-forward");
    double got[4], xv[4];
    th_vals(outs[0], got, 4);
    th_vals(x, xv, 4);
    for (int i = 0; i < 4; i++) cr_assert_float_eq(got[i], xv[i] * 2.0 * 12.0, 1e-6);
    ts_tensor_free(outs[0]);
    g_pre_forward = 0;
    TH_OK(ts_module_call_method(m, "m0", 1, &x, &n, outs));
    cr_assert_eq(g_pre_forward, 0, "an unregistered method runs as it is");
    ts_tensor_free(outs[0]);
    ts_fsdp_set_event_hook(NULL, NULL);
    TH_FAILS(ts_fsdp_register_forward_method(m, "m12"), TS_ERR_NOT_FOUND, "m12");
    ts_tensor_free(x);
    ts_module_free(m);

    /* 70 modules sharded into one group (the old limit was 64) */
    enum { NG = 70 };
    ts_module *g[NG];
    for (int i = 0; i < NG; i++) g[i] = umod_new(2);
    TH_OK(ts_fully_shard_group(NG, g, NULL));
    ts_fsdp_group_info info;
    TH_OK(ts_fsdp_group_info_get(g[0], &info));
    cr_assert_eq(info.n_params, NG);
    for (int i = 0; i < NG; i++) ts_module_free(g[i]);
}

static ts_status own_dispatch(ts_module *m, int k, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    return umod_method(m, k, n_in, in, n_out, out);
}

Test(fully_shard_usability, malformed_modules_are_errors, .timeout = 60)
{
    /* a vtable that lost its type name after ts_module_init */
    ts_module *m = umod_new(4);
    ts_module_vtable bad = umod_vt;
    bad.type_name = NULL;
    m->vtable = &bad;
    TH_FAILS(ts_fully_shard(m, NULL), TS_ERR_INVALID_ARGUMENT, "no type name");
    bad = umod_vt;
    bad.free = NULL;
    TH_FAILS(ts_fully_shard(m, NULL), TS_ERR_INVALID_ARGUMENT, "UMod", "no free");
    bad = umod_vt;
    bad.call_method = own_dispatch;
    TH_FAILS(ts_fully_shard(m, NULL), TS_ERR_UNSUPPORTED, "UMod has its own method dispatcher");
    m->vtable = NULL;
    TH_FAILS(ts_fully_shard(m, NULL), TS_ERR_INVALID_ARGUMENT, "module 0 has no vtable");
    m->vtable = &umod_vt;
    cr_assert(!ts_module_is_fsdp(m));

    /* a child without vtable inside the tree */
    ts_module *seq = NULL;
    TH_OK(ts_sequential_new(1, &m, &seq));
    m->vtable = NULL;
    TH_FAILS(ts_fully_shard(seq, NULL), TS_ERR_INVALID_ARGUMENT, "child '0'", "no vtable");
    m->vtable = &umod_vt;
    cr_assert(!ts_module_is_fsdp(seq), "nothing changed");
    ts_module_free(seq);

    /* a ModuleList (no forward) sharded, then called: an error, not a crash */
    ts_module *k[2] = {umod_new(2), umod_new(2)}, *list = NULL;
    TH_OK(ts_module_list_new(2, k, &list));
    TH_OK(ts_fully_shard(list, NULL));
    int64_t xs[1] = {2};
    ts_tensor *x = th_seq(TS_F32, 1, xs, 1.0, false), *outs[TS_MODULE_MAX_IO];
    int n = 0;
    TH_FAILS(ts_module_call(list, 1, &x, &n, outs), TS_ERR_UNSUPPORTED, "ModuleListFSDPModule has no forward");
    cr_assert_eq(n, 0);
    ts_tensor_free(x);
    ts_module_free(list);
}

/* ------------------------------------------------------------ §3: buffers, print, summary */

Test(fully_shard_usability, buffers_stay_whole_and_in_state_dicts, .timeout = 60)
{
    th_mem_mark();
    ts_module *k[2] = {umod_new(4), umod_new(4)}, *root = NULL;
    TH_OK(ts_sequential_new(2, k, &root));
    umod *u0 = (umod *)k[0];
    ts_tensor *calls_before = u0->calls;
    TH_OK(ts_fully_shard(k[0], NULL));
    TH_OK(ts_fully_shard(k[1], NULL));
    TH_OK(ts_fully_shard(root, NULL));
    cr_assert_eq(u0->calls, calls_before, "fully_shard leaves a buffer's slot alone");
    cr_assert(!ts_tensor_is_shard(u0->calls));
    cr_assert(ts_tensor_is_shard(u0->w));
    ts_param_list p;
    TH_OK(ts_module_parameters(root, &p));
    cr_assert_eq(p.n, 2, "only the parameters, never the buffers");
    for (int i = 0; i < p.n; i++) cr_assert(ts_tensor_is_shard(p.items[i]));
    ts_optim *opt = NULL;
    TH_OK(ts_sgd_new(p.n, p.items, NULL, &opt));
    ts_param_list_free(&p);
    int64_t xs[1] = {4};
    ts_tensor *x = th_seq(TS_F32, 1, xs, 1.0, false), *y = NULL, *l = NULL;
    TH_OK(ts_module_call1(root, x, &y));
    TH_OK(ts_sum(y, 0, NULL, false, &l));
    TH_OK(ts_backward(l, NULL, false));
    TH_OK(ts_optim_step(opt));
    /* the full state dict has the buffers, whole */
    ts_state_dict *sd = NULL;
    TH_OK(ts_fsdp_full_state_dict(root, false, &sd));
    cr_assert_eq(ts_state_dict_size(sd), 4);
    cr_assert_str_eq(ts_state_dict_name(sd, 1), "0.calls");
    cr_assert_str_eq(ts_state_dict_name(sd, 3), "1.calls");
    double v;
    TH_OK(ts_tensor_get(ts_state_dict_get(sd, "0.calls"), (int64_t[]){0}, &v));
    cr_assert_float_eq(v, 1.0, 0);
    /* and loads back into them */
    ts_tensor *five = NULL;
    TH_OK(ts_tensor_full(TS_F32, 1, (int64_t[]){1}, 5.0, &five));
    TH_OK(ts_state_dict_set(sd, "1.calls", five));
    TH_OK(ts_fsdp_load_full_state_dict(root, sd, true));
    TH_OK(ts_tensor_get(((umod *)k[1])->calls, (int64_t[]){0}, &v));
    cr_assert_float_eq(v, 5.0, 0);
    ts_tensor *t = NULL;
    TH_OK(ts_module_get_buffer(root, "1.calls", &t));
    cr_assert_eq(t, ((umod *)k[1])->calls);
    TH_OK(ts_module_get_parameter(root, "1.w", &t));
    cr_assert(ts_tensor_is_shard(t));
    ts_tensor_free(five);
    ts_state_dict_free(sd);
    ts_tensor_free(l);
    ts_tensor_free(y);
    ts_tensor_free(x);
    ts_optim_free(opt);
    ts_module_free(root);
    th_mem_assert_back();
}

/* Two loopback ranks: a Sequential(Linear(3, 5), UMod(5)), the Linear
 * sharded, then the root; print and summary as rank r sees them. */
typedef struct print_out {
    char repr[2][2048];
    char summary[2][8192];
} print_out;

static int rank_print(th_rank *rc)
{
    print_out *po = rc->arg;
    int64_t W = rc->W;
    const char *dp[1] = {"dp"};
    ts_mesh *mesh = NULL;
    TH_RK_OK(rc, ts_mesh_new(rc->c, "cpu", 1, &W, dp, &mesh));
    ts_module *k[2] = {NULL, NULL}, *root = NULL;
    TH_RK_OK(rc, ts_linear_new(3, 5, true, &k[0]));
    TH_RK_OK(rc, umod_new_vt(&umod_vt, 5, &k[1]));
    TH_RK_OK(rc, ts_sequential_new(2, k, &root));
    ts_fsdp_options o = ts_fsdp_options_default();
    o.mesh = mesh;
    TH_RK_OK(rc, ts_fully_shard(k[0], &o));
    TH_RK_OK(rc, ts_fully_shard(root, &o));
    size_t len = 0;
    TH_RK_OK(rc, ts_module_repr(root, po->repr[rc->rank], sizeof po->repr[0], &len));
    TH_RK_OK(rc, ts_fsdp_summary_str(root, po->summary[rc->rank], sizeof po->summary[0], &len));
    if (len >= sizeof po->summary[0]) return th_rank_fail(rc, "summary of %zu bytes", len);
    ts_module_free(root);
    ts_mesh_free(mesh);
    return 0;
}

Test(fully_shard_usability, print_and_summary, .timeout = 60)
{
    static print_out po;
    th_run_world(2, rank_print, &po, 60.0);
    const char *want0 =
        "SequentialFSDPModule(\n"
        "  FSDP: 1 param, 5 elements, 3 per rank + 1 padding in all, mesh (dp=2), reshard after forward: auto (false "
        "for the root, true for the others)\n"
        "  (0): LinearFSDPModule(in_features=3, out_features=5, bias=True; FSDP: 2 params, 20 elements, 12 per rank + "
        "4 padding in all, mesh (dp=2), reshard "
        "after forward: auto (false for the root, true for the others))  weight (3, 3) [shard], bias (3,) [shard]\n"
        "  (1): UMod()  w (3,) [shard], buffer calls (1,)\n"
        ")\n";
    cr_assert_str_eq(po.repr[0], want0, "rank 0 printed\n%s", po.repr[0]);
    cr_assert_not_null(strstr(po.repr[1], "weight (2, 3) [shard], bias (2,) [shard]"), "%s", po.repr[1]);
    cr_assert_not_null(strstr(po.repr[1], "w (2,) [shard]"), "%s", po.repr[1]);
    const char *s0 = po.summary[0], *s1 = po.summary[1];
    cr_assert_not_null(strstr(s0,
                              "FSDP summary of SequentialFSDPModule (rank 0 of mesh (dp=2)): 2 FSDP modules, "
                              "2 groups, 3 parameters (25 elements)"),
                       "%s", s0);
    cr_assert_not_null(strstr(s0,
                              "group '' (SequentialFSDPModule): 1 param, 5 elements, float32, mesh (dp=2), "
                              "reshard after forward: false (auto: the root keeps its parameters)"),
                       "%s", s0);
    cr_assert_not_null(strstr(s0,
                              "group '0' (LinearFSDPModule): 2 params, 20 elements, float32, mesh (dp=2), "
                              "reshard after forward: true (auto)"),
                       "%s", s0);
    /* Linear(3, 5): 5 rows over 2 ranks: 3 and 2, padded to 3 each */
    cr_assert_not_null(strstr(s0,
                              "per rank: 12 elements (0 of them padding on this rank, 4 over all ranks), "
                              "48 B sharded; 96 B while unsharded"),
                       "%s", s0);
    cr_assert_not_null(strstr(s1, "per rank: 12 elements (4 of them padding on this rank, 4 over all ranks)"), "%s",
                       s1);
    char line[256];
    snprintf(line, sizeof line, "  %-40s %-16s %-16s %-16s %s\n", "0.weight", "(5, 3)", "(2, 3)", "(3, 3)", "3");
    cr_assert_not_null(strstr(s1, line), "rank 1 lacks\n%s\nin\n%s", line, s1);
    snprintf(line, sizeof line, "  %-40s %-16s %-16s %-16s %s\n", "1.w", "(5,)", "(3,)", "(3,)", "0");
    cr_assert_not_null(strstr(s0, line), "rank 0 lacks\n%s\nin\n%s", line, s0);
    cr_assert_not_null(strstr(s0, "outside every group (not sharded, whole on every rank): 0 parameters"), "%s", s0);
    cr_assert_not_null(strstr(s0, "buffers (never sharded, whole on every rank): 1, 4 B"), "%s", s0);
}

/* ------------------------------------------------------------ §4 mistakes */

/* An optimizer built before ts_fully_shard: its step fails, naming the
 * parameter. */
Test(fully_shard_usability, optimizer_built_before_fully_shard, .timeout = 60)
{
    ts_module *lin = NULL;
    TH_OK(ts_linear_new(4, 4, true, &lin));
    ts_param_list p;
    TH_OK(ts_module_parameters(lin, &p));
    ts_optim *early = NULL;
    TH_OK(ts_adamw_new(p.n, p.items, NULL, &early));
    ts_param_list_free(&p);
    TH_OK(ts_fully_shard(lin, NULL));
    TH_OK(ts_module_parameters(lin, &p));
    ts_optim *late = NULL;
    TH_OK(ts_adamw_new(p.n, p.items, NULL, &late));
    ts_param_list_free(&p);
    int64_t xs[2] = {2, 4};
    ts_tensor *x = th_seq(TS_F32, 2, xs, 1.0, false), *y = NULL, *l = NULL;
    TH_OK(ts_module_call1(lin, x, &y));
    TH_OK(ts_sum(y, 0, NULL, false, &l));
    TH_OK(ts_backward(l, NULL, false));
    TH_FAILS(ts_optim_step(early), TS_ERR_STATE, "AdamW step", "2 of its 2 parameters", "'weight'",
             "no longer the model's", "after ts_fully_shard");
    cr_assert_eq(ts_optim_step_count(early), 0);
    TH_OK(ts_optim_step(late));
    ts_optim_free(early);
    ts_optim_free(late);
    ts_tensor_free(l);
    ts_tensor_free(y);
    ts_tensor_free(x);
    ts_module_free(lin);
}

/* ts_fully_shard while the launcher says WORLD_SIZE=2 but ts_dist_init
 * was not called (each Criterion test runs in its own process, so the
 * environment set here is this test's own). */
Test(fully_shard_usability, fully_shard_before_dist_init, .timeout = 60)
{
    setenv("RANK", "1", 1);
    setenv("WORLD_SIZE", "2", 1);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", "29555", 1);
    ts_module *lin = NULL;
    TH_OK(ts_linear_new(4, 4, true, &lin));
    TH_FAILS(ts_fully_shard(lin, NULL), TS_ERR_STATE, "rank 1 of 2", "ts_dist_init has not been called");
    cr_assert(!ts_module_is_fsdp(lin));
    /* mpirun's variables without MASTER_PORT (which ts_dist_init would
     * need): still several ranks, still refused, and the reason said */
    unsetenv("RANK");
    unsetenv("WORLD_SIZE");
    unsetenv("MASTER_PORT");
    setenv("OMPI_COMM_WORLD_RANK", "0", 1);
    setenv("OMPI_COMM_WORLD_SIZE", "2", 1);
    setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0", 1);
    setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2", 1);
    TH_FAILS(ts_fully_shard(lin, NULL), TS_ERR_STATE, "OMPI_COMM_WORLD_SIZE=2", "ts_dist_init has not been called");
    cr_assert(!ts_module_is_fsdp(lin));
    unsetenv("OMPI_COMM_WORLD_RANK");
    unsetenv("OMPI_COMM_WORLD_SIZE");
    unsetenv("OMPI_COMM_WORLD_LOCAL_RANK");
    unsetenv("OMPI_COMM_WORLD_LOCAL_SIZE");
    setenv("MASTER_PORT", "29555", 1);
    /* one rank said by the launcher: nothing to say */
    setenv("RANK", "0", 1);
    setenv("WORLD_SIZE", "1", 1);
    TH_OK(ts_fully_shard(lin, NULL));
    ts_module_free(lin);
    unsetenv("RANK");
    unsetenv("WORLD_SIZE");
    unsetenv("MASTER_ADDR");
    unsetenv("MASTER_PORT");
}

/* Parameters outside every group next to shards over 2 ranks: a warning
 * at the optimizer's first step (not when they were ignored on purpose). */
typedef struct outside_arg {
    bool ignore;
} outside_arg;

static int rank_outside(th_rank *rc)
{
    outside_arg *a = rc->arg;
    int64_t W = rc->W;
    const char *dp[1] = {"dp"};
    ts_mesh *mesh = NULL;
    TH_RK_OK(rc, ts_mesh_new(rc->c, "cpu", 1, &W, dp, &mesh));
    ts_module *k[2] = {NULL, NULL}, *root = NULL;
    TH_RK_OK(rc, ts_linear_new(4, 4, true, &k[0]));
    TH_RK_OK(rc, ts_linear_new(4, 2, true, &k[1]));
    TH_RK_OK(rc, ts_sequential_new(2, k, &root));
    ts_fsdp_options o = ts_fsdp_options_default();
    o.mesh = mesh;
    ts_nn_linear *head = (ts_nn_linear *)k[1];
    ts_tensor *ign[2] = {head->weight, head->bias};
    if (a->ignore) {
        o.ignored_params = ign;
        o.n_ignored_params = 2;
        TH_RK_OK(rc, ts_fully_shard(root, &o)); /* the root, with the head's parameters left out on purpose */
    } else {
        TH_RK_OK(rc, ts_fully_shard(k[0], &o)); /* the first layer only: the root is not sharded */
    }
    ts_param_list p;
    TH_RK_OK(rc, ts_module_parameters(root, &p));
    ts_optim *opt = NULL;
    TH_RK_OK(rc, ts_sgd_new(p.n, p.items, NULL, &opt));
    ts_param_list_free(&p);
    int64_t xs[2] = {2, 4};
    ts_tensor *x = NULL, *y = NULL, *l = NULL;
    TH_RK_OK(rc, ts_tensor_full(TS_F32, 2, xs, 0.5, &x));
    for (int step = 0; step < 2; step++) {
        TH_RK_OK(rc, ts_module_call1(root, x, &y));
        TH_RK_OK(rc, ts_sum(y, 0, NULL, false, &l));
        TH_RK_OK(rc, ts_backward(l, NULL, false));
        TH_RK_OK(rc, ts_optim_step(opt));
        ts_optim_zero_grad(opt, true);
        ts_tensor_free(l);
        ts_tensor_free(y);
    }
    ts_tensor_free(x);
    ts_optim_free(opt);
    ts_module_free(root);
    ts_mesh_free(mesh);
    return 0;
}

static int count(const char *text, const char *needle)
{
    int n = 0;
    for (const char *p = text; (p = strstr(p, needle)); p += strlen(needle)) n++;
    return n;
}

Test(fully_shard_usability, parameters_outside_every_group_warn, .timeout = 60)
{
    th_log_capture c;
    outside_arg a = {false};
    th_log_capture_begin(&c, TS_LOG_WARN);
    th_run_world(2, rank_outside, &a, 60.0);
    char *log = th_log_capture_end(&c);
    cr_assert_eq(count(log, "are outside every FSDP group"), 2, "one warning per rank, at the first step:\n%s", log);
    cr_assert_not_null(strstr(log, "SGD: 2 of its 4 parameters"), "%s", log);
    cr_assert_not_null(strstr(log, "sharded over 2 ranks"), "%s", log);
    cr_assert_not_null(strstr(log, "shard the root too"), "%s", log);
    free(log);
    a.ignore = true;
    th_log_capture_begin(&c, TS_LOG_WARN);
    th_run_world(2, rank_outside, &a, 60.0);
    log = th_log_capture_end(&c);
    cr_assert_null(strstr(log, "outside every FSDP group"), "ignored parameters are outside on purpose:\n%s", log);
    free(log);
}

/* ts_fsdp_summary to a full device is TS_ERR_IO, not a silent success. */
Test(fully_shard_usability, summary_to_a_full_device_is_an_io_error)
{
    FILE *f = fopen("/dev/full", "w");
    if (!f) cr_skip_test("no /dev/full here");
    ts_module *l = NULL;
    TH_OK(ts_linear_new(3, 3, true, &l));
    TH_OK(ts_fully_shard(l, NULL));
    TH_FAILS(ts_fsdp_summary(l, f), TS_ERR_IO, "ts_fsdp_summary", "No space left");
    fclose(f);
    ts_module_free(l);
}

/* The root sharded before its children: a later call on a child meets
 * slots the root's group manages. The message says to go bottom-up and
 * names both modules (it used to blame tied weights); nothing changes. The
 * same with the root's parameters persistent (below the threshold), and a
 * real tied weight still gets the tied-weight message. */
Test(fully_shard_usability, root_before_children_says_bottom_up, .timeout = 60)
{
    for (int persist = 0; persist < 2; persist++) {
        ts_module *k[2] = {NULL, NULL}, *root = NULL;
        TH_OK(ts_linear_new(4, 4, true, &k[0]));
        TH_OK(ts_linear_new(4, 2, true, &k[1]));
        TH_OK(ts_sequential_new(2, k, &root));
        ts_fsdp_options o = ts_fsdp_options_default();
        o.persist_threshold_numel = persist ? 1000 : 0;
        TH_OK(ts_fully_shard(root, &o));
        ts_tensor *w = ((ts_nn_linear *)k[1])->weight;
        TH_FAILS(ts_fully_shard(k[1], &o), TS_ERR_INVALID_ARGUMENT, "parameter 'weight' of this Linear",
                 "enclosing Sequential", "'1.weight'", "bottom-up", "shard the children");
        cr_assert_null(strstr(ts_last_error(), "tied"), "%s", ts_last_error());
        cr_assert(!ts_module_is_fsdp(k[1]));
        cr_assert_eq(((ts_nn_linear *)k[1])->weight, w, "the slot is unchanged");
        TH_FAILS(ts_fully_shard_group(2, k, &o), TS_ERR_INVALID_ARGUMENT, "enclosing Sequential", "'0.weight'",
                 "bottom-up");
        ts_module_free(root);
    }
    /* a tied weight across two sibling calls is still a tied weight */
    ts_module *a = NULL, *b = NULL;
    TH_OK(ts_linear_new(4, 4, false, &a));
    TH_OK(ts_linear_new(4, 4, false, &b));
    ts_tensor_free(((ts_nn_linear *)b)->weight);
    ((ts_nn_linear *)b)->weight = ts_tensor_retain(((ts_nn_linear *)a)->weight);
    TH_OK(ts_fully_shard(a, NULL));
    TH_FAILS(ts_fully_shard(b, NULL), TS_ERR_INVALID_ARGUMENT, "shared", "tied", "one call");
    cr_assert_null(strstr(ts_last_error(), "bottom-up"), "%s", ts_last_error());
    ts_module_free(a);
    ts_module_free(b);
}
