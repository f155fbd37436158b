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
    if (!st)
        *n_out = 1;
    return st;
}

static ts_status scaler_double(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    (void)m;
    (void)n_in;
    ts_status st = ts_mul_scalar(in[0], 2.0, &out[0]);
    if (!st)
        *n_out = 1;
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
