/* Modules in bfloat16 and float16: ts_module_to_dtype (PyTorch's
 * model.to(dtype)) and the layers' forward in the dtype of their
 * parameters (Linear, LayerNorm, Embedding, MultiheadAttention, Dropout,
 * GELU, ReLU, Tanh), with a clear error for an input of another dtype. */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/helpers.h"

/* ------------------------------------------------ a module with buffers */

/* A parameter `scale` (3,), a float buffer `running` (3,) and an int64
 * buffer `count` (0-d), as BatchNorm's running stats and counter. */
typedef struct stats_mod {
    ts_module base;
    ts_tensor *scale, *running, *count;
} stats_mod;

static ts_status stats_visit(ts_module *m, const ts_module_visitor *v)
{
    stats_mod *s = (stats_mod *)m;
    ts_status st = TS_OK;
    if (v->param) st = v->param(v->ctx, "scale", &s->scale);
    if (!st && v->buffer && !(st = v->buffer(v->ctx, "running", &s->running)))
        st = v->buffer(v->ctx, "count", &s->count);
    return st;
}

static void stats_free(ts_module *m)
{
    stats_mod *s = (stats_mod *)m;
    ts_tensor_free(s->scale);
    ts_tensor_free(s->running);
    ts_tensor_free(s->count);
    free(s);
}

static const ts_module_vtable stats_vt = {.type_name = "Stats", .visit = stats_visit, .free = stats_free};

static ts_module *stats_new(void)
{
    stats_mod *s = calloc(1, sizeof *s);
    cr_assert(s != NULL);
    TH_OK(ts_module_init(&s->base, &stats_vt));
    int64_t d = 3;
    double sv[3] = {0.5, -1.25, 3.0}, rv[3] = {1.0 / 3.0, 2.0, -0.1};
    TH_OK(ts_param_new(TS_F32, 1, &d, &s->scale));
    bool prev = ts_grad_mode_set(false);
    ts_tensor *tmp = th_tensor(TS_F32, 1, &d, sv);
    TH_OK(ts_tensor_copy_(s->scale, tmp));
    ts_tensor_free(tmp);
    ts_grad_mode_set(prev);
    s->running = th_tensor(TS_F32, 1, &d, rv);
    TH_OK(ts_tensor_zeros(TS_I64, 0, NULL, &s->count));
    return &s->base;
}

/* ------------------------------------------------ ts_module_to_dtype */

/* Sequential(Linear(4, 3), LayerNorm(3), Stats) */
static ts_module *model(void)
{
    ts_module *k[3], *m;
    ts_manual_seed(5);
    TH_OK(ts_linear_new(4, 3, true, &k[0]));
    TH_OK(ts_layer_norm_new(3, 1e-5, true, &k[1]));
    k[2] = stats_new();
    TH_OK(ts_sequential_new(3, k, &m));
    return m;
}

Test(nn_half_modules, to_dtype_converts_floating_params_and_buffers)
{
    th_mem_mark();
    for (int i = 0; i < 2; i++) {
        ts_dtype dt = i ? TS_F16 : TS_BF16;
        ts_module *ref = model(), *m = model();
        ts_tensor *w;
        TH_OK(ts_module_get_parameter(m, "0.weight", &w));
        TH_OK(ts_tensor_set_name(w, "first weight"));
        TH_OK(ts_tensor_set_requires_grad(w, true));
        ts_tensor *b;
        TH_OK(ts_module_get_parameter(m, "1.bias", &b));
        TH_OK(ts_tensor_set_requires_grad(b, false)); /* frozen stays frozen */
        TH_OK(ts_module_to_dtype(m, dt));
        ts_named_params p, pr;
        TH_OK(ts_module_named_parameters(m, &p));
        TH_OK(ts_module_named_parameters(ref, &pr));
        cr_assert_eq(p.n, pr.n);
        for (int k = 0; k < p.n; k++) {
            ts_tensor *t = *p.items[k].slot, *r = *pr.items[k].slot;
            cr_assert_str_eq(p.items[k].name, pr.items[k].name);
            cr_assert_eq(ts_tensor_dtype(t), dt, "%s: %s", p.items[k].name, ts_dtype_name(ts_tensor_dtype(t)));
            cr_assert(ts_tensor_is_leaf(t));
            cr_assert_eq(ts_tensor_requires_grad(t), strcmp(p.items[k].name, "1.bias") != 0, "%s", p.items[k].name);
            /* the values are the f32 ones rounded to dt */
            ts_tensor *rr;
            TH_OK(ts_to_dtype(r, dt, &rr));
            int64_t n = ts_tensor_numel(t);
            uint16_t *a = malloc((size_t)n * 2), *e = malloc((size_t)n * 2);
            TH_OK(ts_tensor_copy_to(t, a, (size_t)n * 2));
            TH_OK(ts_tensor_copy_to(rr, e, (size_t)n * 2));
            cr_assert(memcmp(a, e, (size_t)n * 2) == 0, "%s: values differ from the rounded f32 ones", p.items[k].name);
            free(a);
            free(e);
            ts_tensor_free(rr);
        }
        TH_OK(ts_module_get_parameter(m, "0.weight", &w));
        cr_assert(ts_tensor_name(w) && !strcmp(ts_tensor_name(w), "first weight"), "name kept");
        ts_named_params bufs;
        TH_OK(ts_module_named_buffers(m, &bufs));
        cr_assert_eq(bufs.n, 2);
        cr_assert_str_eq(bufs.items[0].name, "2.running");
        cr_assert_eq(ts_tensor_dtype(*bufs.items[0].slot), dt, "float buffers are converted");
        cr_assert_str_eq(bufs.items[1].name, "2.count");
        cr_assert_eq(ts_tensor_dtype(*bufs.items[1].slot), TS_I64, "integer buffers are kept");
        ts_named_params_free(&bufs);
        ts_named_params_free(&p);
        ts_named_params_free(&pr);
        /* and back to float32: the rounded values, exactly */
        TH_OK(ts_module_to_dtype(m, TS_F32));
        TH_OK(ts_module_get_parameter(m, "2.scale", &w));
        cr_assert_eq(ts_tensor_dtype(w), TS_F32);
        double v[3];
        th_vals(w, v, 3);
        cr_assert(v[0] == 0.5 && v[1] == -1.25 && v[2] == 3.0, "%g %g %g", v[0], v[1], v[2]);
        ts_module_free(m);
        ts_module_free(ref);
    }
    th_mem_assert_back();
}

/* A tied weight stays one tensor (one parameter, in both slots). */
Test(nn_half_modules, to_dtype_keeps_tied_weights_tied)
{
    ts_gpt_config c = ts_gpt_config_default();
    c.vocab_size = 7;
    c.block_size = 4;
    c.n_layer = 1;
    c.n_head = 2;
    c.d_model = 8;
    c.tie_weights = true;
    ts_module *m;
    TH_OK(ts_gpt_new(&c, &m));
    int64_t before = ts_module_num_parameters(m);
    TH_OK(ts_module_to_dtype(m, TS_BF16));
    cr_assert_eq(ts_module_num_parameters(m), before);
    ts_tensor *a, *b;
    TH_OK(ts_module_get_parameter(m, "tok_emb.weight", &a));
    TH_OK(ts_module_get_parameter(m, "lm_head.weight", &b));
    cr_assert_eq(a, b, "lm_head.weight is tok_emb.weight");
    cr_assert_eq(ts_tensor_dtype(a), TS_BF16);
    ts_module_free(m);
}

/* An existing .grad is converted with its parameter (Module._apply). */
Test(nn_half_modules, to_dtype_converts_grads)
{
    ts_module *m = model();
    ts_tensor *w, *g;
    TH_OK(ts_module_get_parameter(m, "2.scale", &w));
    int64_t d = 3;
    double gv[3] = {1.0 / 3.0, 2.0, -7.0};
    g = th_tensor(TS_F32, 1, &d, gv);
    TH_OK(ts_tensor_set_grad(w, g));
    ts_tensor_free(g);
    TH_OK(ts_module_to_dtype(m, TS_BF16));
    TH_OK(ts_module_get_parameter(m, "2.scale", &w));
    cr_assert(ts_tensor_grad(w) != NULL);
    cr_assert_eq(ts_tensor_dtype(ts_tensor_grad(w)), TS_BF16);
    double v[3];
    th_vals(ts_tensor_grad(w), v, 3);
    cr_assert(v[0] == (double)ts_bf16_to_f32(ts_f32_to_bf16((float)(1.0 / 3.0))) && v[1] == 2.0 && v[2] == -7.0);
    ts_module_free(m);
}

Test(nn_half_modules, to_dtype_errors)
{
    ts_module *m = model();
    cr_assert_eq(ts_module_to_dtype(NULL, TS_BF16), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_module_to_dtype(m, (ts_dtype)99), TS_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(ts_last_error(), "99") != NULL, "%s", ts_last_error());
    cr_assert_eq(ts_module_to_dtype(m, TS_I64), TS_ERR_DTYPE);
    cr_assert(strstr(ts_last_error(), "int64") != NULL, "%s", ts_last_error());
    /* nothing changed */
    ts_tensor *w;
    TH_OK(ts_module_get_parameter(m, "0.weight", &w));
    cr_assert_eq(ts_tensor_dtype(w), TS_F32);
    ts_module_free(m);
}

/* ------------------------------------------------ layers in bf16 / f16 */

static ts_tensor *to(ts_tensor *t, ts_dtype dt)
{
    ts_tensor *o;
    TH_OK(ts_to_dtype(t, dt, &o));
    return o;
}

static void expect_same_bits(const char *what, ts_tensor *a, ts_tensor *b)
{
    cr_assert_eq(ts_tensor_dtype(a), ts_tensor_dtype(b), "%s: dtypes", what);
    int64_t n = ts_tensor_numel(a);
    cr_assert_eq(n, ts_tensor_numel(b), "%s: sizes", what);
    size_t nb = (size_t)n * ts_dtype_size(ts_tensor_dtype(a));
    uint8_t *x = malloc(nb + 1), *y = malloc(nb + 1);
    TH_OK(ts_tensor_copy_to(a, x, nb));
    TH_OK(ts_tensor_copy_to(b, y, nb));
    cr_assert(memcmp(x, y, nb) == 0, "%s: values differ", what);
    free(x);
    free(y);
}

/* LayerNorm, Embedding and Dropout modules converted to bf16 / f16 give
 * what their ops give on the converted parameters (and LayerNorm, whose
 * op rounds once, the f32 module's output rounded). */
Test(nn_half_modules, layers_forward_in_their_dtype)
{
    for (int i = 0; i < 2; i++) {
        ts_dtype dt = i ? TS_F16 : TS_BF16;
        ts_module *ln32, *ln;
        TH_OK(ts_layer_norm_new(6, 1e-5, true, &ln32));
        TH_OK(ts_layer_norm_new(6, 1e-5, true, &ln));
        TH_OK(ts_module_to_dtype(ln, dt));
        int64_t xs[2] = {3, 6};
        ts_tensor *x32 = th_seq(TS_F32, 2, xs, 2.0, false), *xh = to(x32, dt), *xr = to(xh, TS_F32);
        ts_tensor *y32, *yh, *yr;
        TH_OK(ts_module_call1(ln32, xr, &y32));
        TH_OK(ts_module_call1(ln, xh, &yh));
        cr_assert_eq(ts_tensor_dtype(yh), dt);
        yr = to(y32, dt);
        expect_same_bits("LayerNorm", yh, yr);
        ts_tensor_free(y32);
        ts_tensor_free(yh);
        ts_tensor_free(yr);

        ts_module *emb;
        ts_manual_seed(3);
        TH_OK(ts_embedding_new(5, 4, &emb));
        ts_tensor *w32;
        TH_OK(ts_module_get_parameter(emb, "weight", &w32));
        ts_tensor *wh = to(w32, dt);
        TH_OK(ts_module_to_dtype(emb, dt));
        int64_t is[2] = {2, 2};
        int64_t iv[4] = {4, 0, 4, 2};
        ts_tensor *idx, *e, *ee;
        TH_OK(ts_tensor_from_data(TS_I64, 2, is, iv, &idx));
        TH_OK(ts_module_call1(emb, idx, &e));
        TH_OK(ts_embedding(wh, idx, &ee));
        expect_same_bits("Embedding", e, ee);
        ts_tensor_free(e);
        ts_tensor_free(ee);
        ts_tensor_free(wh);
        ts_tensor_free(idx);

        ts_module *drop;
        TH_OK(ts_dropout_new(0.5, &drop));
        TH_OK(ts_module_to_dtype(drop, dt)); /* no parameters: nothing to do */
        ts_manual_seed(9);
        TH_OK(ts_module_call1(drop, xh, &yh));
        ts_manual_seed(9);
        TH_OK(ts_dropout(xh, 0.5, true, NULL, &yr));
        expect_same_bits("Dropout", yh, yr);
        cr_assert_eq(ts_tensor_dtype(yh), dt);
        ts_tensor_free(yh);
        ts_tensor_free(yr);

        ts_module_free(ln32);
        ts_module_free(ln);
        ts_module_free(emb);
        ts_module_free(drop);
        ts_tensor_free(x32);
        ts_tensor_free(xh);
        ts_tensor_free(xr);
    }
}

/* ------------------------------------------------ activations */

/* GELU (both approximations), ReLU and Tanh modules take bf16 and f16
 * inputs and give their ops' results in that dtype, forward and backward. */
Test(nn_half_modules, activation_modules_in_bf16_and_f16)
{
    int64_t shape[2] = {3, 7};
    for (int i = 0; i < 2; i++) {
        ts_dtype dt = i ? TS_F16 : TS_BF16;
        ts_module *mods[4];
        TH_OK(ts_gelu_new(TS_GELU_NONE, &mods[0]));
        TH_OK(ts_gelu_new(TS_GELU_TANH, &mods[1]));
        TH_OK(ts_relu_new(&mods[2]));
        TH_OK(ts_tanh_new(&mods[3]));
        for (int k = 0; k < 4; k++) {
            ts_tensor *x32 = th_seq(TS_F32, 2, shape, 3.0, false), *x, *y, *yo;
            TH_OK(ts_to_dtype(x32, dt, &x));
            TH_OK(ts_tensor_set_requires_grad(x, true));
            TH_OK(ts_module_call1(mods[k], x, &y));
            cr_assert_eq(ts_tensor_dtype(y), dt, "%s: output %s", ts_module_type_name(mods[k]),
                         ts_dtype_name(ts_tensor_dtype(y)));
            bool prev = ts_grad_mode_set(false);
            TH_OK(k < 2        ? ts_gelu(x, k ? TS_GELU_TANH : TS_GELU_NONE, &yo)
                      : k == 2 ? ts_relu(x, &yo)
                               : ts_tanh(x, &yo));
            ts_grad_mode_set(prev);
            expect_same_bits(ts_module_type_name(mods[k]), y, yo);
            ts_tensor *g;
            TH_OK(ts_tensor_full(dt, 2, shape, 1.0, &g));
            TH_OK(ts_backward(y, g, false));
            cr_assert(ts_tensor_grad(x) != NULL && ts_tensor_dtype(ts_tensor_grad(x)) == dt);
            ts_tensor_free(g);
            ts_tensor_free(x32);
            ts_tensor_free(x);
            ts_tensor_free(y);
            ts_tensor_free(yo);
        }
        for (int k = 0; k < 4; k++) ts_module_free(mods[k]);
    }
}

/* An input whose dtype differs from the layer's parameters is refused with
 * TS_ERR_DTYPE naming the layer and both dtypes (torch: "mat1 and mat2
 * must have the same dtype", "expected scalar type BFloat16 but found
 * Float"); nothing is promoted. */
Test(nn_half_modules, input_dtype_differing_from_params_is_an_error)
{
    ts_module *lin, *ln, *mha;
    TH_OK(ts_linear_new(4, 3, true, &lin));
    TH_OK(ts_layer_norm_new(4, 1e-5, true, &ln));
    ts_mha_options mo = ts_mha_options_default();
    mo.batch_first = true;
    TH_OK(ts_mha_new_opts(4, 2, &mo, &mha));
    int64_t xs[3] = {1, 2, 4};
    ts_tensor *x32 = th_seq(TS_F32, 3, xs, 1.0, false), *xb = to(x32, TS_BF16), *y = NULL;
    struct {
        ts_module *m;
        const char *type, *param;
    } cases[3] = {
        {lin, "Linear", "weight"}, {ln, "LayerNorm", "weight"}, {mha, "MultiheadAttention", "in_proj_weight"}};
    for (int k = 0; k < 3; k++) {
        for (int dir = 0; dir < 2; dir++) {
            /* dir 0: f32 module, bf16 input; dir 1: bf16 module, f32 input */
            if (dir) TH_OK(ts_module_to_dtype(cases[k].m, TS_BF16));
            ts_tensor *x = dir ? x32 : xb, *in3[3] = {x, x, x}, *outs[TS_MODULE_MAX_IO];
            int n = 0;
            ts_status st = k == 2 ? ts_module_call(cases[k].m, 3, in3, &n, outs) : ts_module_call1(cases[k].m, x, &y);
            cr_assert_eq(st, TS_ERR_DTYPE, "%s: %s", cases[k].type, ts_status_name(st));
            const char *msg = ts_last_error();
            cr_assert(strstr(msg, cases[k].type) && strstr(msg, cases[k].param) && strstr(msg, "float32") &&
                          strstr(msg, "bfloat16"),
                      "%s", msg);
            cr_assert(y == NULL && n == 0);
        }
    }
    ts_tensor_free(x32);
    ts_tensor_free(xb);
    ts_module_free(lin);
    ts_module_free(ln);
    ts_module_free(mha);
}
