#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/helpers.h"

typedef struct names {
    char v[64][96];
    int n;
} names;

static ts_status collect(void *ctx, const char *fqn, ts_module *m)
{
    names *s = ctx;
    snprintf(s->v[s->n++], 96, "%s:%s", fqn, ts_module_type_name(m));
    return TS_OK;
}

static ts_module *mlp(void)
{
    ts_module *k[3], *m;
    TH_OK(ts_linear_new(4, 8, true, &k[0]));
    TH_OK(ts_relu_new(&k[1]));
    TH_OK(ts_linear_new(8, 2, false, &k[2]));
    TH_OK(ts_sequential_new(3, k, &m));
    return m;
}

Test(nn_module, names_follow_pytorch)
{
    th_mem_mark();
    ts_module *m = mlp();
    cr_assert_str_eq(ts_module_type_name(m), "Sequential");
    ts_named_params p;
    TH_OK(ts_module_named_parameters(m, &p));
    cr_assert_eq(p.n, 3);
    cr_assert_str_eq(p.items[0].name, "0.weight");
    cr_assert_str_eq(p.items[1].name, "0.bias");
    cr_assert_str_eq(p.items[2].name, "2.weight");
    cr_assert_eq(p.items[2].owner, ts_container_child(m, 2));
    ts_named_params_free(&p);
    names s = {0};
    TH_OK(ts_module_named_modules(m, collect, &s));
    cr_assert_eq(s.n, 4);
    cr_assert_str_eq(s.v[0], ":Sequential");
    cr_assert_str_eq(s.v[1], "0:Linear");
    cr_assert_str_eq(s.v[2], "1:ReLU");
    cr_assert_str_eq(s.v[3], "2:Linear");
    cr_assert_eq(ts_module_num_parameters(m), 4 * 8 + 8 + 8 * 2);
    ts_module_free(m);
    th_mem_assert_back();
}

Test(nn_module, encoder_and_gpt_names)
{
    ts_encoder_layer_config c = ts_encoder_layer_config_default(8, 2);
    c.dim_feedforward = 16;
    ts_module *enc;
    TH_OK(ts_transformer_encoder_new(&c, 2, &enc));
    ts_named_params p;
    TH_OK(ts_module_named_parameters(enc, &p));
    cr_assert_eq(p.n, 24);
    cr_assert_str_eq(p.items[0].name, "layers.0.self_attn.in_proj_weight");
    cr_assert_str_eq(p.items[3].name, "layers.0.self_attn.out_proj.bias");
    cr_assert_str_eq(p.items[12].name, "layers.1.self_attn.in_proj_weight");
    cr_assert_str_eq(p.items[23].name, "layers.1.norm2.bias");
    ts_named_params_free(&p);
    ts_module_free(enc);

    ts_gpt_config g = ts_gpt_config_default();
    g.vocab_size = 11;
    g.block_size = 8;
    g.n_layer = 2;
    g.n_head = 2;
    g.d_model = 16;
    g.tie_weights = true;
    ts_module *gpt;
    TH_OK(ts_gpt_new(&g, &gpt));
    TH_OK(ts_module_named_parameters(gpt, &p));
    cr_assert_str_eq(p.items[0].name, "tok_emb.weight");
    cr_assert_str_eq(p.items[1].name, "pos_emb.weight");
    cr_assert_str_eq(p.items[2].name, "blocks.0.ln1.weight");
    cr_assert_str_eq(p.items[4].name, "blocks.0.attn.in_proj_weight");
    cr_assert_str_eq(p.items[10].name, "blocks.0.mlp.0.weight");
    cr_assert_str_eq(p.items[12].name, "blocks.0.mlp.2.weight");
    cr_assert_str_eq(p.items[p.n - 1].name, "ln_f.bias", "tied lm_head.weight appears once, as tok_emb.weight");
    ts_named_params_free(&p);
    ts_state_dict *sd;
    TH_OK(ts_module_state_dict(gpt, &sd));
    cr_assert_not_null(ts_state_dict_get(sd, "lm_head.weight"), "state_dict keeps every name");
    cr_assert_eq(ts_tensor_data(ts_state_dict_get(sd, "lm_head.weight")),
                 ts_tensor_data(ts_state_dict_get(sd, "tok_emb.weight")));
    ts_state_dict_free(sd);
    ts_module_free(gpt);
}

Test(nn_module, train_eval_and_zero_grad)
{
    ts_module *m = mlp();
    cr_assert(m->training);
    ts_module_eval(m);
    cr_assert(!m->training);
    cr_assert(!ts_container_child(m, 1)->training, "eval reaches descendants");
    ts_module_train(m, true);
    cr_assert(ts_container_child(m, 2)->training);
    int64_t xs[2] = {3, 4};
    ts_tensor *x = th_seq(TS_F32, 2, xs, 1.0, false), *y, *l;
    TH_OK(ts_module_call1(m, x, &y));
    TH_OK(ts_sum(y, 0, NULL, false, &l));
    TH_OK(ts_backward(l, NULL, false));
    ts_nn_linear *first = (ts_nn_linear *)ts_container_child(m, 0);
    cr_assert_not_null(ts_tensor_grad(first->weight));
    ts_module_zero_grad(m, false);
    double v;
    int64_t i0[2] = {0, 0};
    TH_OK(ts_tensor_get(ts_tensor_grad(first->weight), i0, &v));
    cr_assert_float_eq(v, 0.0, 0);
    ts_module_zero_grad(m, true);
    cr_assert_null(ts_tensor_grad(first->weight));
    ts_tensor_free(x);
    ts_tensor_free(y);
    ts_tensor_free(l);
    ts_module_free(m);
}

/* A user-defined module: the vtable pattern with a named extra method. */
typedef struct scaler {
    ts_module base;
    ts_tensor *scale;
} scaler;

static ts_status scaler_forward(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    (void)n_in;
    ts_status st = ts_mul(in[0], ((scaler *)m)->scale, &out[0]);
    if (!st) *n_out = 1;
    return st;
}

static ts_status scaler_double(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    (void)m;
    (void)n_in;
    ts_status st = ts_mul_scalar(in[0], 2.0, &out[0]);
    if (!st) *n_out = 1;
    return st;
}

static ts_status scaler_visit(ts_module *m, const ts_module_visitor *v)
{
    return v->param ? v->param(v->ctx, "scale", &((scaler *)m)->scale) : TS_OK;
}

static void scaler_free(ts_module *m)
{
    ts_tensor_free(((scaler *)m)->scale);
    free(m);
}

static const ts_module_method scaler_methods[] = {{"double", scaler_double}};
static const ts_module_vtable scaler_vt = {.type_name = "Scaler",
                                           .forward = scaler_forward,
                                           .visit = scaler_visit,
                                           .free = scaler_free,
                                           .methods = scaler_methods,
                                           .n_methods = 1};

Test(nn_module, user_modules_and_named_methods)
{
    scaler *s = calloc(1, sizeof *s);
    ts_module_init(&s->base, &scaler_vt);
    TH_OK(ts_tensor_full(TS_F32, 0, NULL, 3.0, &s->scale));
    ts_tensor *x, *y, *outs[TS_MODULE_MAX_IO];
    TH_OK(ts_tensor_full(TS_F32, 0, NULL, 5.0, &x));
    TH_OK(ts_module_call1(&s->base, x, &y));
    double v;
    TH_OK(ts_tensor_item(y, &v));
    cr_assert_float_eq(v, 15.0, 0);
    int n;
    TH_OK(ts_module_call_method(&s->base, "double", 1, &x, &n, outs));
    TH_OK(ts_tensor_item(outs[0], &v));
    cr_assert_float_eq(v, 10.0, 0);
    cr_assert_eq(ts_module_call_method(&s->base, "triple", 1, &x, &n, outs + 1), TS_ERR_NOT_FOUND);
    cr_assert(strstr(ts_last_error(), "Scaler") && strstr(ts_last_error(), "triple"), "%s", ts_last_error());
    ts_tensor_free(outs[0]);
    ts_tensor_free(x);
    ts_tensor_free(y);
    ts_module_free(&s->base);
}

Test(nn_module, wrong_inputs_are_errors)
{
    ts_module *m = mlp();
    int64_t xs[2] = {3, 5};
    ts_tensor *x = th_seq(TS_F32, 2, xs, 1.0, false), *y = NULL;
    cr_assert_eq(ts_module_call1(m, x, &y), TS_ERR_SHAPE);
    cr_assert(strstr(ts_last_error(), "Linear") && strstr(ts_last_error(), "(3, 5)"), "%s", ts_last_error());
    cr_assert_null(y);
    ts_tensor *two[2] = {x, x}, *outs[TS_MODULE_MAX_IO];
    int n;
    cr_assert_eq(ts_module_call(ts_container_child(m, 0), 2, two, &n, outs), TS_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(ts_last_error(), "takes 1 input") != NULL, "%s", ts_last_error());
    cr_assert_eq(ts_module_call(NULL, 1, &x, &n, outs), TS_ERR_INVALID_ARGUMENT);
    ts_tensor_free(x);
    ts_module_free(m);
}

/* ------------------------------------------------ your own module, buffers */

/* y = x * gain, counting training forwards in a buffer (as BatchNorm's
 * num_batches_tracked). Written with the public helpers only. */
typedef struct gain_mod {
    ts_module base;
    ts_tensor *gain;                /* parameter (dim,) */
    ts_tensor *num_batches_tracked; /* buffer, int64 0-d */
    int64_t dim;
} gain_mod;

static ts_status gain_forward(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    gain_mod *g = (gain_mod *)m;
    TS_CHECK(n_in == 1, TS_ERR_INVALID_ARGUMENT, "Gain: forward takes 1 input, got %d", n_in);
    ts_tensor *y = NULL;
    TS_TRY(ts_mul(in[0], g->gain, &y));
    if (m->training) ((int64_t *)ts_tensor_data(g->num_batches_tracked))[0]++;
    out[0] = y;
    *n_out = 1;
    return TS_OK;
}

static ts_status gain_visit(ts_module *m, const ts_module_visitor *v)
{
    gain_mod *g = (gain_mod *)m;
    ts_status st = TS_OK;
    if (v->param) st = v->param(v->ctx, "gain", &g->gain);
    if (!st && v->buffer) st = v->buffer(v->ctx, "num_batches_tracked", &g->num_batches_tracked);
    return st;
}

static void gain_free(ts_module *m)
{
    gain_mod *g = (gain_mod *)m;
    ts_tensor_free(g->gain);
    ts_tensor_free(g->num_batches_tracked);
    free(g);
}

static int gain_extra_repr(const ts_module *m, char *buf, size_t cap)
{
    return snprintf(buf, cap, "dim=%lld", (long long)((const gain_mod *)m)->dim);
}

static const ts_module_vtable gain_vt = {.type_name = "Gain",
                                         .forward = gain_forward,
                                         .visit = gain_visit,
                                         .free = gain_free,
                                         .extra_repr = gain_extra_repr};

static ts_status gain_new(int64_t dim, ts_module **out)
{
    gain_mod *g = calloc(1, sizeof *g);
    TS_CHECK(g != NULL, TS_ERR_NO_MEMORY, "Gain: out of memory");
    ts_status st;
    TS_TRY_GOTO(st, ts_module_init(&g->base, &gain_vt), fail);
    g->dim = dim;
    TS_TRY_GOTO(st, ts_param_new(TS_F32, 1, &dim, &g->gain), fail);
    TS_TRY_GOTO(st, ts_tensor_zeros(TS_I64, 0, NULL, &g->num_batches_tracked), fail);
    TS_TRY_GOTO(st, ts_tensor_fill_(g->gain, 1.0), fail);
    *out = &g->base;
    return TS_OK;
fail:
    ts_tensor_free(g->gain);
    ts_tensor_free(g->num_batches_tracked);
    free(g);
    return st;
}

/* Sequential(Linear(4, 3), Gain(3)) */
static ts_module *gain_model(void)
{
    ts_module *k[2], *m;
    TH_OK(ts_linear_new(4, 3, true, &k[0]));
    TH_OK(gain_new(3, &k[1]));
    TH_OK(ts_sequential_new(2, k, &m));
    return m;
}

Test(nn_module, buffers_are_in_state_dicts_but_not_parameters)
{
    th_mem_mark();
    ts_module *m = gain_model();
    ts_named_params p;
    TH_OK(ts_module_named_parameters(m, &p));
    cr_assert_eq(p.n, 3);
    cr_assert_str_eq(p.items[2].name, "1.gain");
    for (int i = 0; i < p.n; i++) cr_assert(!p.items[i].is_buffer);
    ts_named_params_free(&p);
    TH_OK(ts_module_named_buffers(m, &p));
    cr_assert_eq(p.n, 1);
    cr_assert_str_eq(p.items[0].name, "1.num_batches_tracked");
    cr_assert(p.items[0].is_buffer);
    ts_named_params_free(&p);
    cr_assert_eq(ts_module_num_parameters(m), 4 * 3 + 3 + 3, "buffers are not parameters");

    /* PyTorch's state_dict order: each module's parameters, then its
     * buffers, then its children */
    ts_state_dict *sd;
    TH_OK(ts_module_state_dict(m, &sd));
    cr_assert_eq(ts_state_dict_size(sd), 4);
    const char *want[] = {"0.weight", "0.bias", "1.gain", "1.num_batches_tracked"};
    for (int i = 0; i < 4; i++) cr_assert_str_eq(ts_state_dict_name(sd, i), want[i]);

    /* a forward in training mode counts; the count loads back */
    int64_t xs[2] = {2, 4};
    ts_tensor *x = th_seq(TS_F32, 2, xs, 1.0, false), *y = NULL;
    TH_OK(ts_module_call1(m, x, &y));
    ts_tensor_free(y);
    ts_tensor *nbt = NULL;
    TH_OK(ts_module_get_buffer(m, "1.num_batches_tracked", &nbt));
    double v;
    TH_OK(ts_tensor_item(nbt, &v));
    cr_assert_float_eq(v, 1.0, 0);
    ts_state_dict *sd2;
    TH_OK(ts_state_dict_new(&sd2));
    ts_tensor *seven = NULL;
    TH_OK(ts_tensor_full(TS_I64, 0, NULL, 7.0, &seven));
    for (int i = 0; i < 3; i++) TH_OK(ts_state_dict_set(sd2, ts_state_dict_name(sd, i), ts_state_dict_tensor(sd, i)));
    TH_OK(ts_state_dict_set(sd2, "1.num_batches_tracked", seven));
    TH_OK(ts_module_load_state_dict(m, sd2, true));
    TH_OK(ts_tensor_item(nbt, &v));
    cr_assert_float_eq(v, 7.0, 0);
    /* strict loading wants the buffer too */
    ts_state_dict *sd3;
    TH_OK(ts_state_dict_new(&sd3));
    for (int i = 0; i < 3; i++) TH_OK(ts_state_dict_set(sd3, ts_state_dict_name(sd, i), ts_state_dict_tensor(sd, i)));
    TH_FAILS(ts_module_load_state_dict(m, sd3, true), TS_ERR_NOT_FOUND, "1.num_batches_tracked");
    ts_state_dict_free(sd3);
    ts_tensor_free(seven);
    ts_state_dict_free(sd2);
    ts_state_dict_free(sd);
    ts_tensor_free(x);
    ts_module_free(m);
    th_mem_assert_back();
}

Test(nn_module, parameters_list_for_an_optimizer)
{
    th_mem_mark();
    ts_module *m = gain_model();
    ts_nn_linear *lin = (ts_nn_linear *)ts_container_child(m, 0);
    TH_OK(ts_tensor_set_requires_grad(lin->bias, false)); /* frozen: left out */
    ts_param_list p;
    TH_OK(ts_module_parameters(m, &p));
    cr_assert_eq(p.n, 2);
    cr_assert_eq(p.items[0], lin->weight);
    cr_assert_eq(p.items[1], ((gain_mod *)ts_container_child(m, 1))->gain);
    ts_optim *opt = NULL;
    TH_OK(ts_sgd_new(p.n, p.items, NULL, &opt));
    ts_param_list_free(&p);
    cr_assert_eq(p.n, 0);
    cr_assert_null(p.items);
    ts_param_list_free(&p); /* twice is harmless */
    /* the optimizer holds its own references: it still steps after the
     * list is gone */
    int64_t xs[2] = {2, 4};
    ts_tensor *x = th_seq(TS_F32, 2, xs, 1.0, false), *y = NULL, *l = NULL;
    TH_OK(ts_module_call1(m, x, &y));
    TH_OK(ts_sum(y, 0, NULL, false, &l));
    TH_OK(ts_backward(l, NULL, false));
    TH_OK(ts_optim_step(opt));
    ts_optim_free(opt);
    ts_tensor_free(l);
    ts_tensor_free(y);
    ts_tensor_free(x);
    ts_module_free(m);
    TH_FAILS(ts_module_parameters(NULL, &p), TS_ERR_INVALID_ARGUMENT, "NULL");
    th_mem_assert_back();
}

Test(nn_module, param_new_is_a_zero_leaf_that_requires_grad)
{
    int64_t s[2] = {2, 3};
    ts_tensor *t = NULL;
    TH_OK(ts_param_new(TS_F64, 2, s, &t));
    cr_assert(ts_tensor_requires_grad(t));
    cr_assert(ts_tensor_is_leaf(t));
    cr_assert_eq(ts_tensor_dtype(t), TS_F64);
    double v[6];
    th_vals(t, v, 6);
    for (int i = 0; i < 6; i++) cr_assert_float_eq(v[i], 0.0, 0);
    ts_tensor_free(t);
    t = NULL;
    TH_FAILS(ts_param_new(TS_I64, 2, s, &t), TS_ERR_DTYPE, "int64");
    cr_assert_null(t);
    TH_FAILS(ts_param_new(TS_F32, 2, s, NULL), TS_ERR_INVALID_ARGUMENT, "NULL");
}

Test(nn_module, parameter_and_buffer_by_name)
{
    ts_module *m = gain_model();
    ts_tensor *t = NULL;
    TH_OK(ts_module_get_parameter(m, "0.weight", &t));
    cr_assert_eq(t, ((ts_nn_linear *)ts_container_child(m, 0))->weight);
    TH_OK(ts_module_get_parameter(ts_container_child(m, 1), "gain", &t));
    cr_assert_eq(t, ((gain_mod *)ts_container_child(m, 1))->gain);
    t = NULL;
    TH_FAILS(ts_module_get_parameter(m, "1.num_batches_tracked", &t), TS_ERR_NOT_FOUND, "1.num_batches_tracked",
             "it is a buffer");
    TH_FAILS(ts_module_get_buffer(m, "1.gain", &t), TS_ERR_NOT_FOUND, "it is a parameter");
    TH_FAILS(ts_module_get_parameter(m, "0.nothing", &t), TS_ERR_NOT_FOUND, "0.nothing");
    TH_FAILS(ts_module_get_parameter(m, "7.weight", &t), TS_ERR_NOT_FOUND, "'7'");
    cr_assert_null(t);
    TH_FAILS(ts_module_get_parameter(m, NULL, &t), TS_ERR_INVALID_ARGUMENT, "NULL");
    ts_module_free(m);
}

Test(nn_module, print_shows_types_shapes_and_extra_repr)
{
    th_mem_mark();
    ts_module *k[3], *inner, *m;
    TH_OK(ts_linear_new(4, 3, true, &k[0]));
    TH_OK(ts_relu_new(&k[1]));
    TH_OK(gain_new(3, &k[2]));
    TH_OK(ts_sequential_new(2, k + 1, &inner));
    ts_module *outer[2] = {k[0], inner};
    TH_OK(ts_sequential_new(2, outer, &m));
    const char *want = "Sequential(\n"
                       "  (0): Linear(in_features=4, out_features=3, bias=True)  weight (3, 4), bias (3,)\n"
                       "  (1): Sequential(\n"
                       "    (0): ReLU()\n"
                       "    (1): Gain(dim=3)  gain (3,), buffer num_batches_tracked int64 ()\n"
                       "  )\n"
                       ")\n";
    char buf[1024];
    size_t len = 0;
    TH_OK(ts_module_repr(m, buf, sizeof buf, &len));
    cr_assert_str_eq(buf, want);
    cr_assert_eq(len, strlen(want));
    /* a small buffer: truncated, NUL-terminated, the whole length told */
    char small[12];
    TH_OK(ts_module_repr(m, small, sizeof small, &len));
    cr_assert_str_eq(small, "Sequential(");
    cr_assert_eq(len, strlen(want));
    TH_OK(ts_module_repr(m, NULL, 0, &len));
    cr_assert_eq(len, strlen(want));
    /* to a FILE */
    FILE *f = tmpfile();
    cr_assert_not_null(f);
    TH_OK(ts_module_print(m, f));
    rewind(f);
    size_t got = fread(buf, 1, sizeof buf - 1, f);
    buf[got] = '\0';
    fclose(f);
    cr_assert_str_eq(buf, want);
    TH_FAILS(ts_module_print(m, NULL), TS_ERR_INVALID_ARGUMENT, "FILE");
    TH_FAILS(ts_module_repr(NULL, buf, sizeof buf, &len), TS_ERR_INVALID_ARGUMENT, "NULL");
    ts_module_free(m);
    th_mem_assert_back();
}

/* ------------------------------------------------ malformed vtables */

static ts_status noop_forward(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    (void)m, (void)n_in, (void)in, (void)n_out, (void)out;
    return TS_OK;
}
static void plain_free(ts_module *m) { free(m); }

Test(nn_module, malformed_vtables_are_errors_not_crashes)
{
    ts_module m;
    static const ts_module_vtable unnamed = {.forward = noop_forward, .free = plain_free};
    TH_FAILS(ts_module_init(&m, &unnamed), TS_ERR_INVALID_ARGUMENT, "no type name");
    cr_assert_null(m.vtable);
    cr_assert_str_eq(ts_module_type_name(&m), "(no vtable)");
    ts_tensor *outs[TS_MODULE_MAX_IO];
    int n = 0;
    TH_FAILS(ts_module_call(&m, 0, NULL, &n, outs), TS_ERR_INVALID_ARGUMENT, "no vtable");
    ts_module_free(&m); /* does nothing */
    ts_named_params p;
    TH_FAILS(ts_module_named_parameters(&m, &p), TS_ERR_INVALID_ARGUMENT, "no vtable");
    char buf[64];
    size_t len;
    TH_OK(ts_module_repr(&m, buf, sizeof buf, &len));
    cr_assert_str_eq(buf, "(no vtable)\n");

    static const ts_module_vtable empty_name = {.type_name = "", .forward = noop_forward, .free = plain_free};
    TH_FAILS(ts_module_init(&m, &empty_name), TS_ERR_INVALID_ARGUMENT, "no type name");
    static const ts_module_vtable no_free = {.type_name = "NoFree", .forward = noop_forward};
    TH_FAILS(ts_module_init(&m, &no_free), TS_ERR_INVALID_ARGUMENT, "NoFree", "no free");
    static const ts_module_method nameless[] = {{NULL, noop_forward}};
    static const ts_module_vtable bad_method = {
        .type_name = "BadMethod", .free = plain_free, .methods = nameless, .n_methods = 1};
    TH_FAILS(ts_module_init(&m, &bad_method), TS_ERR_INVALID_ARGUMENT, "method 0 of BadMethod has no name");
    static const ts_module_method twice[] = {{"go", noop_forward}, {"go", noop_forward}};
    static const ts_module_vtable dup = {.type_name = "Dup", .free = plain_free, .methods = twice, .n_methods = 2};
    TH_FAILS(ts_module_init(&m, &dup), TS_ERR_INVALID_ARGUMENT, "two methods named 'go'");
    static const ts_module_vtable no_list = {.type_name = "NoList", .free = plain_free, .n_methods = 3};
    TH_FAILS(ts_module_init(&m, &no_list), TS_ERR_INVALID_ARGUMENT, "methods is NULL");
    TH_FAILS(ts_module_init(&m, NULL), TS_ERR_INVALID_ARGUMENT, "NULL");
    TH_FAILS(ts_module_init(NULL, &dup), TS_ERR_INVALID_ARGUMENT, "NULL");

    /* a NULL forward is allowed (a container) and calling it says so */
    static const ts_module_vtable no_forward = {.type_name = "NoForward", .free = plain_free};
    ts_module *nf = calloc(1, sizeof *nf);
    TH_OK(ts_module_init(nf, &no_forward));
    TH_FAILS(ts_module_call(nf, 0, NULL, &n, outs), TS_ERR_UNSUPPORTED, "NoForward has no forward");
    /* a vtable whose type name was cleared after init */
    ts_module_vtable changed = no_forward;
    nf->vtable = &changed;
    changed.type_name = NULL;
    cr_assert_str_eq(ts_module_type_name(nf), "(unnamed type)");
    TH_FAILS(ts_module_call(nf, 0, NULL, &n, outs), TS_ERR_INVALID_ARGUMENT, "no type name");
    nf->vtable = &no_forward;
    ts_module_free(nf);

    /* a container whose child lost its vtable: walks fail with a message */
    ts_module *lin = NULL, *seq = NULL;
    TH_OK(ts_linear_new(2, 2, false, &lin));
    TH_OK(ts_sequential_new(1, &lin, &seq));
    const ts_module_vtable *saved = lin->vtable;
    lin->vtable = NULL;
    TH_FAILS(ts_module_named_parameters(seq, &p), TS_ERR_INVALID_ARGUMENT, "child '0'", "no vtable");
    lin->vtable = saved;
    ts_module_free(seq);
}

/* The public macros propagate statuses. */
static ts_status try_twice(ts_status first, ts_status second, int *reached)
{
    TS_TRY(first);
    (*reached)++;
    TS_TRY(second);
    (*reached)++;
    return TS_OK;
}

static ts_status check_positive(int v)
{
    TS_CHECK(v > 0, TS_ERR_INVALID_ARGUMENT, "value %d is not positive", v);
    return TS_OK;
}

static ts_status goto_cleanup(ts_status inner, int *cleaned)
{
    ts_status st;
    TS_TRY_GOTO(st, inner, done);
    st = TS_ERR_ALREADY; /* reached only when inner is OK */
done:
    (*cleaned)++;
    return st;
}

Test(nn_module, status_macros)
{
    int reached = 0, cleaned = 0;
    cr_assert_eq(try_twice(TS_OK, TS_OK, &reached), TS_OK);
    cr_assert_eq(reached, 2);
    reached = 0;
    cr_assert_eq(try_twice(TS_OK, TS_ERR_SHAPE, &reached), TS_ERR_SHAPE);
    cr_assert_eq(reached, 1);
    reached = 0;
    cr_assert_eq(try_twice(TS_ERR_IO, TS_OK, &reached), TS_ERR_IO);
    cr_assert_eq(reached, 0);
    TH_OK(check_positive(3));
    TH_FAILS(check_positive(-2), TS_ERR_INVALID_ARGUMENT, "value -2 is not positive");
    cr_assert_eq(goto_cleanup(TS_ERR_DTYPE, &cleaned), TS_ERR_DTYPE);
    cr_assert_eq(goto_cleanup(TS_OK, &cleaned), TS_ERR_ALREADY);
    cr_assert_eq(cleaned, 2);
}

/* PyTorch's repr of the built-in layers (their extra_repr). */
Test(nn_module, print_builtin_layers_as_pytorch)
{
    th_mem_mark();
    ts_module *emb = NULL, *ln = NULL, *lin = NULL, *inner = NULL, *m = NULL;
    TH_OK(ts_embedding_new(10, 4, &emb));
    TH_OK(ts_layer_norm_new(4, 1e-5, true, &ln));
    TH_OK(ts_linear_new(4, 2, false, &lin));
    TH_OK(ts_sequential_new(1, &lin, &inner));
    ts_module *k[3] = {emb, ln, inner};
    TH_OK(ts_sequential_new(3, k, &m));
    char buf[1024];
    size_t len = 0;
    TH_OK(ts_module_repr(m, buf, sizeof buf, &len));
    cr_assert_str_eq(buf,
                     "Sequential(\n"
                     "  (0): Embedding(10, 4)  weight (10, 4)\n"
                     "  (1): LayerNorm((4,), eps=1e-05, elementwise_affine=True)  weight (4,), bias (4,)\n"
                     "  (2): Sequential(\n"
                     "    (0): Linear(in_features=4, out_features=2, bias=False)  weight (2, 4)\n"
                     "  )\n"
                     ")\n");
    ts_module_free(m);
    th_mem_assert_back();
}

/* Two children that are one module (a shared block, as a tied layer). */
typedef struct twin {
    ts_module base;
    ts_module *a;
} twin;
static ts_status twin_visit(ts_module *m, const ts_module_visitor *v)
{
    twin *t = (twin *)m;
    ts_status st = v->child ? v->child(v->ctx, "first", t->a) : TS_OK;
    if (!st && v->child) st = v->child(v->ctx, "second", t->a);
    return st;
}
static void twin_free(ts_module *m)
{
    ts_module_free(((twin *)m)->a);
    free(m);
}
static const ts_module_vtable twin_vt = {.type_name = "Twin", .visit = twin_visit, .free = twin_free};

Test(nn_module, print_shared_module_once)
{
    twin *t = calloc(1, sizeof *t);
    TH_OK(ts_module_init(&t->base, &twin_vt));
    TH_OK(ts_linear_new(2, 2, true, &t->a));
    char buf[512];
    size_t len = 0;
    TH_OK(ts_module_repr(&t->base, buf, sizeof buf, &len));
    cr_assert_str_eq(buf,
                     "Twin(\n"
                     "  (first): Linear(in_features=2, out_features=2, bias=True)  weight (2, 2), bias (2,)\n"
                     "  (second): Linear (shared with 'first')\n"
                     ")\n");
    ts_named_params p;
    TH_OK(ts_module_named_parameters(&t->base, &p));
    cr_assert_eq(p.n, 2, "named_parameters visits a shared module once");
    ts_named_params_free(&p);
    ts_module_free(&t->base);
}

/* A module in several slots of one container (nn.Sequential(l, l)) and a
 * module shared by two parents (retained once for the second): it is
 * freed once, by the last owner, and counted once among the parameters. */
Test(nn_module, shared_children_are_freed_once)
{
    th_mem_mark();
    ts_module *l = NULL, *twice = NULL;
    TH_OK(ts_linear_new(3, 3, false, &l));
    TH_OK(ts_sequential_new(2, (ts_module *[]){l, l}, &twice));
    cr_assert_eq(ts_module_num_parameters(twice), 9, "the shared weight counts once");
    int64_t sh[2] = {2, 3};
    ts_tensor *x = NULL, *y = NULL;
    TH_OK(ts_tensor_ones(TS_F32, 2, sh, &x));
    TH_OK(ts_module_call1(twice, x, &y));
    ts_tensor_free(y);
    ts_module_free(twice); /* frees l once: the allocator's check aborts on a second free */

    ts_module *shared = NULL, *a = NULL, *b = NULL;
    TH_OK(ts_linear_new(3, 3, true, &shared));
    TH_OK(ts_sequential_new(1, (ts_module *[]){shared}, &a));
    TH_OK(ts_sequential_new(1, (ts_module *[]){ts_module_retain(shared)}, &b));
    ts_module_free(a);
    TH_OK(ts_module_call1(b, x, &y)); /* still alive: b holds a reference */
    ts_tensor_free(y);
    ts_module_free(b);
    ts_tensor_free(x);
    cr_assert_null(ts_module_retain(NULL));
    th_mem_assert_back();
}

/* ts_module_print to a full device is TS_ERR_IO, not a silent success. */
Test(nn_module, print_to_a_full_device_is_an_io_error)
{
    FILE *f = fopen("/dev/full", "w");
    if (!f) cr_skip_test("no /dev/full here");
    ts_module *l = NULL;
    TH_OK(ts_linear_new(3, 3, true, &l));
    TH_FAILS(ts_module_print(l, f), TS_ERR_IO, "ts_module_print", "No space left");
    fclose(f);
    ts_module_free(l);
}
