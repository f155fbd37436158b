/* tensor_init: torch.nn.init on top of the PyTorch-exact generator,
 * compared bit for bit with torch 1.13 (tests/fixtures/rng, made by
 * tools/reference/make_rng_vectors.py; PROVENANCE.md lists the calls).
 * The bounds are computed in f64 exactly as init.py does, so no tolerance
 * applies. */
#include <math.h>

#include <criterion/criterion.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/helpers.h"

/* ------------------------------------------------------------- helpers */

/* nn.Linear(in, out): weight (out, in) by kaiming_uniform_(a=sqrt(5)),
 * then bias (out) by uniform_(-1/sqrt(in), 1/sqrt(in)). */
static void linear_init(int64_t in, int64_t out, ts_tensor **w, ts_tensor **b)
{
    *w = th_empty(TS_F32, 2, (int64_t[]){out, in});
    TH_OK(ts_init_kaiming_uniform_(*w, sqrt(5.0), TS_FAN_IN, TS_NL_LEAKY_RELU, NULL));
    if (b) {
        *b = th_empty(TS_F32, 1, &out);
        double bound = in > 0 ? 1 / sqrt((double)in) : 0;
        TH_OK(ts_uniform_(*b, -bound, bound, NULL));
    }
}

/* ------------------------------------------------------ the acceptance */

Test(tensor_init, linear4x4_seed0_kaiming_uniform_bit_exact)
{
    /* torch.manual_seed(0); nn.Linear(4, 4, bias=False).weight */
    ts_manual_seed(0);
    ts_tensor *t = th_empty(TS_F32, 2, (int64_t[]){4, 4});
    TH_OK(ts_init_kaiming_uniform_(t, sqrt(5.0), TS_FAN_IN, TS_NL_LEAKY_RELU, NULL));
    uint32_t first;
    memcpy(&first, ts_tensor_data(t), 4);
    cr_assert_eq(first, 0xBB755400u, "first element bits 0x%08x", first);
    th_vec v = th_vec_open("linear4x4_seed0_weight");
    th_vec_expect_free(&v, t, "Linear(4, 4).weight");
    th_vec_close(&v);
}

/* ------------------------------------------------------------- modules */

Test(tensor_init, linear_weight_then_bias)
{
    ts_tensor *w, *b;
    th_vec v = th_vec_open("linear8x8_seed42_weight_bias");
    ts_manual_seed(42);
    linear_init(8, 8, &w, &b);
    th_vec_expect_free(&v, w, "weight");
    th_vec_expect_free(&v, b, "bias");
    th_vec_close(&v);

    v = th_vec_open("linear64x32_seed0_weight_bias");
    ts_manual_seed(0);
    linear_init(64, 32, &w, &b);
    th_vec_expect_free(&v, w, "weight");
    th_vec_expect_free(&v, b, "bias");
    th_vec_close(&v);
}

Test(tensor_init, sequential_of_two_linears)
{
    ts_tensor *w1, *w2;
    th_vec v = th_vec_open("seq2linear4_seed0_weights");
    ts_manual_seed(0);
    linear_init(4, 4, &w1, NULL);
    linear_init(4, 4, &w2, NULL);
    th_vec_expect_free(&v, w1, "[0].weight");
    th_vec_expect_free(&v, w2, "[2].weight");
    th_vec_close(&v);
}

Test(tensor_init, transformer_encoder_layer_parameters)
{
    /* TransformerEncoderLayer(8, 2, dim_feedforward=16), docs/rng.md §9: MHA's
     * out_proj Linear(8, 8) first (its bias drawn, then zeroed), then
     * xavier_uniform_(in_proj_weight (24, 8)), then linear1, linear2 */
    const int64_t e = 8, ff = 16;
    ts_manual_seed(0);
    ts_tensor *out_w, *out_b, *l1w, *l1b, *l2w, *l2b;
    linear_init(e, e, &out_w, &out_b);
    ts_tensor *in_w = th_empty(TS_F32, 2, (int64_t[]){3 * e, e});
    TH_OK(ts_init_xavier_uniform_(in_w, 1.0, NULL));
    ts_tensor *in_b;
    TH_OK(ts_tensor_zeros(TS_F32, 1, (int64_t[]){3 * e}, &in_b));
    TH_OK(ts_tensor_fill_(out_b, 0.0));
    linear_init(e, ff, &l1w, &l1b);
    linear_init(ff, e, &l2w, &l2b);

    th_vec v = th_vec_open("encoderlayer_d8_h2_ff16_seed0_params");
    th_vec_expect_free(&v, in_w, "self_attn.in_proj_weight");
    th_vec_expect_free(&v, in_b, "self_attn.in_proj_bias");
    th_vec_expect_free(&v, out_w, "self_attn.out_proj.weight");
    th_vec_expect_free(&v, out_b, "self_attn.out_proj.bias");
    th_vec_expect_free(&v, l1w, "linear1.weight");
    th_vec_expect_free(&v, l1b, "linear1.bias");
    th_vec_expect_free(&v, l2w, "linear2.weight");
    th_vec_expect_free(&v, l2b, "linear2.bias");
    for (int i = 0; i < 2; i++) {
        ts_tensor *ones, *zeros;
        TH_OK(ts_tensor_ones(TS_F32, 1, &e, &ones));
        TH_OK(ts_tensor_zeros(TS_F32, 1, &e, &zeros));
        th_vec_expect_free(&v, ones, "norm.weight");
        th_vec_expect_free(&v, zeros, "norm.bias");
    }
    th_vec_close(&v);
}

/* ------------------------------------------------------- the functions */

typedef struct init_case {
    int ndim;
    int64_t shape[4];
    ts_dtype dtype;
    double a; /* kaiming: slope; xavier: gain */
    ts_fan_mode mode;
    ts_nonlinearity nl;
} init_case;

Test(tensor_init, kaiming_uniform_matches_torch)
{
    static const init_case cases[] = {
        {2, {4, 4}, TS_F32, 2.23606797749979, TS_FAN_IN, TS_NL_LEAKY_RELU},
        {4, {8, 3, 3, 3}, TS_F32, 0, TS_FAN_IN, TS_NL_LEAKY_RELU},
        {2, {5, 7}, TS_F32, 0, TS_FAN_OUT, TS_NL_RELU},
        {3, {6, 2, 5}, TS_F32, 0.2, TS_FAN_IN, TS_NL_LEAKY_RELU},
        {2, {3, 4}, TS_F32, 0, TS_FAN_IN, TS_NL_TANH},
        {2, {4, 4}, TS_F64, 2.23606797749979, TS_FAN_IN, TS_NL_LEAKY_RELU},
    };
    cr_assert_eq(cases[0].a, sqrt(5.0));
    th_vec v = th_vec_open("init_kaiming_uniform");
    for (int k = 0; k < 6; k++) {
        const init_case *c = &cases[k];
        ts_manual_seed((uint64_t)k);
        ts_tensor *t = th_empty(c->dtype, c->ndim, c->shape);
        TH_OK(ts_init_kaiming_uniform_(t, c->a, c->mode, c->nl, NULL));
        char what[32];
        snprintf(what, sizeof what, "case %d", k);
        th_vec_expect_free(&v, t, what);
    }
    th_vec_close(&v);
}

Test(tensor_init, kaiming_normal_matches_torch)
{
    static const init_case cases[] = {
        {2, {16, 8}, TS_F32, 0, TS_FAN_IN, TS_NL_RELU},        /* vectorised normal path */
        {2, {3, 4}, TS_F32, 0, TS_FAN_IN, TS_NL_LEAKY_RELU},   /* scalar path */
        {3, {6, 4, 3}, TS_F32, 0, TS_FAN_OUT, TS_NL_RELU},     /* 72: block + tail */
        {2, {5, 5}, TS_F64, 0.1, TS_FAN_IN, TS_NL_LEAKY_RELU}, /* float64 path */
    };
    th_vec v = th_vec_open("init_kaiming_normal");
    for (int k = 0; k < 4; k++) {
        const init_case *c = &cases[k];
        ts_manual_seed((uint64_t)k);
        ts_tensor *t = th_empty(c->dtype, c->ndim, c->shape);
        TH_OK(ts_init_kaiming_normal_(t, c->a, c->mode, c->nl, NULL));
        char what[32];
        snprintf(what, sizeof what, "case %d", k);
        th_vec_expect_free(&v, t, what);
    }
    th_vec_close(&v);
}

Test(tensor_init, xavier_uniform_matches_torch)
{
    static const init_case cases[] = {
        {2, {24, 8}, TS_F32, 1.0, 0, 0},
        {3, {3, 5, 2}, TS_F32, 5.0 / 3, 0, 0}, /* gain = calculate_gain('tanh') */
        {2, {7, 3}, TS_F64, 1.0, 0, 0},
    };
    th_vec v = th_vec_open("init_xavier_uniform");
    for (int k = 0; k < 3; k++) {
        const init_case *c = &cases[k];
        ts_manual_seed((uint64_t)k);
        ts_tensor *t = th_empty(c->dtype, c->ndim, c->shape);
        double gain = k == 1 ? ts_init_calculate_gain(TS_NL_TANH, 0) : c->a;
        TH_OK(ts_init_xavier_uniform_(t, gain, NULL));
        char what[32];
        snprintf(what, sizeof what, "case %d", k);
        th_vec_expect_free(&v, t, what);
    }
    th_vec_close(&v);
}

Test(tensor_init, xavier_normal_matches_torch)
{
    static const init_case cases[] = {
        {3, {1, 1, 8}, TS_F32, 1.0, 0, 0}, /* MHA's bias_k: scalar path */
        {2, {20, 10}, TS_F32, 0.5, 0, 0},
        {2, {4, 6}, TS_F64, 2.0, 0, 0},
    };
    th_vec v = th_vec_open("init_xavier_normal");
    for (int k = 0; k < 3; k++) {
        const init_case *c = &cases[k];
        ts_manual_seed((uint64_t)k);
        ts_tensor *t = th_empty(c->dtype, c->ndim, c->shape);
        TH_OK(ts_init_xavier_normal_(t, c->a, NULL));
        char what[32];
        snprintf(what, sizeof what, "case %d", k);
        th_vec_expect_free(&v, t, what);
    }
    th_vec_close(&v);
}

Test(tensor_init, zero_element_tensors_draw_nothing)
{
    th_vec v = th_vec_open("init_zero_element");
    ts_manual_seed(9);
    ts_tensor *a = th_empty(TS_F32, 2, (int64_t[]){0, 5});
    ts_tensor *b = th_empty(TS_F32, 2, (int64_t[]){3, 0});
    ts_tensor *c = th_empty(TS_F32, 2, (int64_t[]){0, 4});
    ts_tensor *d = th_empty(TS_F32, 1, (int64_t[]){0}); /* 1-d but empty: torch's no-op comes first */
    TH_OK(ts_init_kaiming_uniform_(a, 0, TS_FAN_IN, TS_NL_LEAKY_RELU, NULL));
    TH_OK(ts_init_kaiming_normal_(b, 0, TS_FAN_IN, TS_NL_LEAKY_RELU, NULL));
    TH_OK(ts_init_xavier_uniform_(c, 1.0, NULL));
    TH_OK(ts_init_kaiming_uniform_(d, 0, TS_FAN_IN, TS_NL_LEAKY_RELU, NULL));
    ts_tensor *r;
    TH_OK(ts_rand(TS_F32, 1, (int64_t[]){2}, NULL, &r));
    th_vec_expect_free(&v, r, "rand(2) after the no-ops");
    th_vec_close(&v);
    ts_tensor_free(a);
    ts_tensor_free(b);
    ts_tensor_free(c);
    ts_tensor_free(d);
}

Test(tensor_init, calculate_gain_matches_torch)
{
    double g[10] = {
        ts_init_calculate_gain(TS_NL_LINEAR, 0),
        ts_init_calculate_gain(TS_NL_SIGMOID, 0),
        ts_init_calculate_gain(TS_NL_TANH, 0),
        ts_init_calculate_gain(TS_NL_RELU, 0),
        ts_init_calculate_gain(TS_NL_LEAKY_RELU, 0.01), /* torch's default slope */
        ts_init_calculate_gain(TS_NL_LEAKY_RELU, sqrt(5.0)),
        ts_init_calculate_gain(TS_NL_LEAKY_RELU, 0),
        ts_init_calculate_gain(TS_NL_LEAKY_RELU, 0.2),
        ts_init_calculate_gain(TS_NL_SELU, 0),
        ts_init_calculate_gain(TS_NL_LINEAR, 0), /* 'conv2d' */
    };
    th_vec v = th_vec_open("init_calculate_gain");
    th_vec_expect_bytes("calculate_gain", TS_F64, g, th_vec_take(&v, sizeof g), 10);
    th_vec_close(&v);
    cr_assert(isnan(ts_init_calculate_gain((ts_nonlinearity)42, 0)));
}

Test(tensor_init, float64_bound_is_not_rounded_to_one_over_sqrt_fan)
{
    /* docs/rng.md §8: for fan 4 the f64 bound is 0.49999999999999994, not 0.5;
     * kaiming_uniform_ on a float64 tensor must use the former. With
     * U53 = x the element is fma(x, 2 * bound, -bound). */
    const double bound = sqrt(3.0) * (sqrt(2.0 / (1 + sqrt(5.0) * sqrt(5.0))) / sqrt(4.0));
    cr_assert_eq(bound, 0.49999999999999994);
    ts_manual_seed(0);
    ts_tensor *t = th_empty(TS_F64, 2, (int64_t[]){4, 4});
    TH_OK(ts_init_kaiming_uniform_(t, sqrt(5.0), TS_FAN_IN, TS_NL_LEAKY_RELU, NULL));
    ts_manual_seed(0);
    ts_tensor *u = th_empty(TS_F64, 2, (int64_t[]){4, 4});
    TH_OK(ts_uniform_(u, -bound, bound, NULL));
    cr_assert_eq(memcmp(ts_tensor_data(t), ts_tensor_data(u), 16 * sizeof(double)), 0);
    ts_tensor_free(t);
    ts_tensor_free(u);
}

/* --------------------------------------------------------------- errors */

Test(tensor_init, refuses_fewer_than_two_dims)
{
    ts_tensor *t = th_empty(TS_F32, 1, (int64_t[]){5});
    TH_FAILS(ts_init_kaiming_uniform_(t, 0, TS_FAN_IN, TS_NL_LEAKY_RELU, NULL), TS_ERR_SHAPE, "kaiming_uniform_",
             "fewer than 2 dimensions", "(5,)");
    TH_FAILS(ts_init_kaiming_normal_(t, 0, TS_FAN_IN, TS_NL_RELU, NULL), TS_ERR_SHAPE, "kaiming_normal_");
    TH_FAILS(ts_init_xavier_uniform_(t, 1.0, NULL), TS_ERR_SHAPE, "xavier_uniform_");
    TH_FAILS(ts_init_xavier_normal_(t, 1.0, NULL), TS_ERR_SHAPE, "xavier_normal_");
    ts_tensor_free(t);
    TH_OK(ts_tensor_empty(TS_F32, 0, NULL, &t));
    TH_FAILS(ts_init_xavier_normal_(t, 1.0, NULL), TS_ERR_SHAPE, "xavier_normal_");
    ts_tensor_free(t);
}

Test(tensor_init, refuses_bad_arguments)
{
    ts_tensor *t = th_empty(TS_F32, 2, (int64_t[]){3, 3});
    TH_FAILS(ts_init_kaiming_uniform_(t, 0, (ts_fan_mode)7, TS_NL_RELU, NULL), TS_ERR_INVALID_ARGUMENT,
             "kaiming_uniform_", "mode 7");
    TH_FAILS(ts_init_kaiming_normal_(t, 0, TS_FAN_IN, (ts_nonlinearity)99, NULL), TS_ERR_INVALID_ARGUMENT,
             "kaiming_normal_", "nonlinearity 99");
    ts_tensor_free(t);
    t = th_empty(TS_F32, 2, (int64_t[]){0, 0}); /* torch: float division by zero */
    TH_FAILS(ts_init_xavier_uniform_(t, 1.0, NULL), TS_ERR_INVALID_ARGUMENT, "xavier_uniform_", "(0, 0)");
    ts_tensor_free(t);
    t = th_empty(TS_I64, 2, (int64_t[]){3, 3});
    TH_FAILS(ts_init_kaiming_uniform_(t, 0, TS_FAN_IN, TS_NL_RELU, NULL), TS_ERR_DTYPE, "uniform_", "int64");
    TH_FAILS(ts_init_xavier_normal_(t, 1.0, NULL), TS_ERR_DTYPE, "normal_", "int64");
    ts_tensor_free(t);
    TH_FAILS(ts_init_xavier_normal_(NULL, 1.0, NULL), TS_ERR_INVALID_ARGUMENT, "xavier_normal_");
}

Test(tensor_init, refuses_released_and_sharded_tensors)
{
    ts_tensor *t = th_empty(TS_F32, 2, (int64_t[]){4, 4});
    TH_OK(ts_storage_release(ts_tensor_storage(t)));
    TH_FAILS(ts_init_kaiming_uniform_(t, 0, TS_FAN_IN, TS_NL_RELU, NULL), TS_ERR_RELEASED, "kaiming_uniform_");
    TH_FAILS(ts_init_xavier_normal_(t, 1.0, NULL), TS_ERR_RELEASED, "xavier_normal_");
    TH_OK(ts_storage_restore(ts_tensor_storage(t)));
    int meta;
    ts_tensor_set_shard(t, &meta);
    TH_FAILS(ts_init_kaiming_normal_(t, 0, TS_FAN_IN, TS_NL_RELU, NULL), TS_ERR_SHARDED, "kaiming_normal_");
    TH_FAILS(ts_init_xavier_uniform_(t, 1.0, NULL), TS_ERR_SHARDED, "xavier_uniform_");
    ts_tensor_clear_shard(t);
    TH_OK(ts_init_xavier_uniform_(t, 1.0, NULL));
    ts_tensor_free(t);
}

Test(tensor_init, explicit_generator)
{
    ts_generator *g;
    TH_OK(ts_generator_new(0, &g));
    ts_manual_seed(12345); /* the default generator is not used */
    ts_tensor *t = th_empty(TS_F32, 2, (int64_t[]){4, 4});
    TH_OK(ts_init_kaiming_uniform_(t, sqrt(5.0), TS_FAN_IN, TS_NL_LEAKY_RELU, g));
    th_vec v = th_vec_open("linear4x4_seed0_weight");
    th_vec_expect_free(&v, t, "Linear(4, 4).weight from a generator");
    th_vec_close(&v);
    ts_generator_free(g);
}
