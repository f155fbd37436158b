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

/* A vector file NAME.bin: the raw little-endian values of one or more
 * tensors, concatenated; consumed front to back. */
typedef struct fv_vec {
    char name[128];
    uint8_t *buf;
    size_t len;
    size_t pos;
} fv_vec;

static inline uint8_t *fv_read(const char *file, size_t *len)
{
    char path[512];
    snprintf(path, sizeof path, "%s/rng/%s", TS_FIXTURES_DIR, file);
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "cannot open fixture %s", path);
    cr_assert_eq(fseek(f, 0, SEEK_END), 0);
    long n = ftell(f);
    cr_assert_geq(n, 0);
    cr_assert_eq(fseek(f, 0, SEEK_SET), 0);
    uint8_t *buf = malloc(n ? (size_t)n : 1);
    cr_assert_not_null(buf);
    cr_assert_eq(fread(buf, 1, (size_t)n, f), (size_t)n, "short read of %s", path);
    fclose(f);
    *len = (size_t)n;
    return buf;
}

static inline fv_vec fv_open(const char *name)
{
    fv_vec v;
    char file[160];
    snprintf(v.name, sizeof v.name, "%s", name);
    snprintf(file, sizeof file, "%s.bin", name);
    v.buf = fv_read(file, &v.len);
    v.pos = 0;
    return v;
}

static inline const uint8_t *fv_take(fv_vec *v, size_t nbytes)
{
    cr_assert_leq(v->pos + nbytes, v->len, "%s: wants %zu bytes at %zu of %zu", v->name, nbytes, v->pos, v->len);
    const uint8_t *p = v->buf + v->pos;
    v->pos += nbytes;
    return p;
}

/* Asserts that the whole vector was consumed, and frees it. */
static inline void fv_close(fv_vec *v)
{
    cr_assert_eq(v->pos, v->len, "%s: %zu of %zu bytes compared", v->name, v->pos, v->len);
    free(v->buf);
    v->buf = NULL;
}

static inline void fv_describe(ts_dtype dt, const uint8_t *p, char *out, size_t len)
{
    switch (dt) {
    case TS_F32: {
        float f;
        uint32_t u;
        memcpy(&f, p, 4);
        memcpy(&u, p, 4);
        snprintf(out, len, "%.9g (0x%08" PRIx32 ")", (double)f, u);
        return;
    }
    case TS_F64: {
        double d;
        uint64_t u;
        memcpy(&d, p, 8);
        memcpy(&u, p, 8);
        snprintf(out, len, "%.17g (0x%016" PRIx64 ")", d, u);
        return;
    }
    case TS_I64: {
        int64_t i;
        memcpy(&i, p, 8);
        snprintf(out, len, "%" PRId64, i);
        return;
    }
    default:
        snprintf(out, len, "0x%02x", p[0]);
        return;
    }
}

/* Bytes of one element of `dt` in `got` and `want` at index i, compared
 * bit for bit; fails naming the first difference. */
static inline void fv_expect_bytes(const char *what, ts_dtype dt, const void *got, const void *want, int64_t n)
{
    size_t es = ts_dtype_size(dt);
    const uint8_t *g = got, *w = want;
    for (int64_t i = 0; i < n; i++) {
        if (memcmp(g + (size_t)i * es, w + (size_t)i * es, es) != 0) {
            char gs[64], ws[64];
            fv_describe(dt, g + (size_t)i * es, gs, sizeof gs);
            fv_describe(dt, w + (size_t)i * es, ws, sizeof ws);
            cr_assert_fail("%s: element %" PRId64 " of %" PRId64 " is %s, torch has %s", what, i, n, gs, ws);
        }
    }
}

/* Compares the next numel values of the vector with `t` (row-major). */
static inline void fv_expect_tensor(fv_vec *v, const ts_tensor *t, const char *what)
{
    ts_dtype dt = ts_tensor_dtype(t);
    size_t nb = (size_t)ts_tensor_numel(t) * ts_dtype_size(dt);
    const uint8_t *want = fv_take(v, nb);
    uint8_t *got = malloc(nb ? nb : 1);
    cr_assert_not_null(got);
    ts_status st = ts_tensor_copy_to(t, got, nb);
    cr_assert_eq(st, TS_OK, "%s: copy_to: %s", what, ts_last_error());
    char label[256];
    snprintf(label, sizeof label, "%s: %s", v->name, what);
    fv_expect_bytes(label, dt, got, want, ts_tensor_numel(t));
    free(got);
}

/* Expects `expr` to fail with `status` and a detail containing each of
 * the (one or more) strings. */
#define FV_FAILS(expr, status, ...)                                                                    \
    do {                                                                                               \
        ts_status fv_s_ = (expr);                                                                      \
        cr_assert_eq(fv_s_, (status), "%s -> %s, expected %s (%s)", #expr, ts_status_name(fv_s_),      \
                     ts_status_name(status), ts_last_error());                                         \
        const char *fv_want_[] = {__VA_ARGS__, NULL};                                                  \
        for (int fv_i_ = 0; fv_want_[fv_i_]; fv_i_++)                                                  \
            cr_assert_not_null(strstr(ts_last_error(), fv_want_[fv_i_]), "%s: detail \"%s\" lacks \"%s\"", \
                               #expr, ts_last_error(), fv_want_[fv_i_]);                               \
    } while (0)


/* ------------------------------------------------------------- helpers */

static ts_tensor *empty(ts_dtype dt, int ndim, const int64_t *shape)
{
    ts_tensor *t;
    TH_OK(ts_tensor_empty(dt, ndim, shape, &t));
    return t;
}

static void expect_free(fv_vec *v, ts_tensor *t, const char *what)
{
    fv_expect_tensor(v, t, what);
    ts_tensor_free(t);
}

/* nn.Linear(in, out): weight (out, in) by kaiming_uniform_(a=sqrt(5)),
 * then bias (out) by uniform_(-1/sqrt(in), 1/sqrt(in)). */
static void linear_init(int64_t in, int64_t out, ts_tensor **w, ts_tensor **b)
{
    *w = empty(TS_F32, 2, (int64_t[]){out, in});
    TH_OK(ts_init_kaiming_uniform_(*w, sqrt(5.0), TS_FAN_IN, TS_NL_LEAKY_RELU, NULL));
    if (b) {
        *b = empty(TS_F32, 1, &out);
        double bound = in > 0 ? 1 / sqrt((double)in) : 0;
        TH_OK(ts_uniform_(*b, -bound, bound, NULL));
    }
}

/* ------------------------------------------------------ the acceptance */

Test(tensor_init, linear4x4_seed0_kaiming_uniform_bit_exact)
{
    /* torch.manual_seed(0); nn.Linear(4, 4, bias=False).weight */
    ts_manual_seed(0);
    ts_tensor *t = empty(TS_F32, 2, (int64_t[]){4, 4});
    TH_OK(ts_init_kaiming_uniform_(t, sqrt(5.0), TS_FAN_IN, TS_NL_LEAKY_RELU, NULL));
    uint32_t first;
    memcpy(&first, ts_tensor_data(t), 4);
    cr_assert_eq(first, 0xBB755400u, "first element bits 0x%08x", first);
    fv_vec v = fv_open("linear4x4_seed0_weight");
    expect_free(&v, t, "Linear(4, 4).weight");
    fv_close(&v);
}

/* ------------------------------------------------------------- modules */

Test(tensor_init, linear_weight_then_bias)
{
    ts_tensor *w, *b;
    fv_vec v = fv_open("linear8x8_seed42_weight_bias");
    ts_manual_seed(42);
    linear_init(8, 8, &w, &b);
    expect_free(&v, w, "weight");
    expect_free(&v, b, "bias");
    fv_close(&v);

    v = fv_open("linear64x32_seed0_weight_bias");
    ts_manual_seed(0);
    linear_init(64, 32, &w, &b);
    expect_free(&v, w, "weight");
    expect_free(&v, b, "bias");
    fv_close(&v);
}

Test(tensor_init, sequential_of_two_linears)
{
    ts_tensor *w1, *w2;
    fv_vec v = fv_open("seq2linear4_seed0_weights");
    ts_manual_seed(0);
    linear_init(4, 4, &w1, NULL);
    linear_init(4, 4, &w2, NULL);
    expect_free(&v, w1, "[0].weight");
    expect_free(&v, w2, "[2].weight");
    fv_close(&v);
}

Test(tensor_init, transformer_encoder_layer_parameters)
{
    /* TransformerEncoderLayer(8, 2, dim_feedforward=16), SPEC §9: MHA's
     * out_proj Linear(8, 8) first (its bias drawn, then zeroed), then
     * xavier_uniform_(in_proj_weight (24, 8)), then linear1, linear2 */
    const int64_t e = 8, ff = 16;
    ts_manual_seed(0);
    ts_tensor *out_w, *out_b, *l1w, *l1b, *l2w, *l2b;
    linear_init(e, e, &out_w, &out_b);
    ts_tensor *in_w = empty(TS_F32, 2, (int64_t[]){3 * e, e});
    TH_OK(ts_init_xavier_uniform_(in_w, 1.0, NULL));
    ts_tensor *in_b;
    TH_OK(ts_tensor_zeros(TS_F32, 1, (int64_t[]){3 * e}, &in_b));
    TH_OK(ts_tensor_fill_(out_b, 0.0));
    linear_init(e, ff, &l1w, &l1b);
    linear_init(ff, e, &l2w, &l2b);

    fv_vec v = fv_open("encoderlayer_d8_h2_ff16_seed0_params");
    expect_free(&v, in_w, "self_attn.in_proj_weight");
    expect_free(&v, in_b, "self_attn.in_proj_bias");
    expect_free(&v, out_w, "self_attn.out_proj.weight");
    expect_free(&v, out_b, "self_attn.out_proj.bias");
    expect_free(&v, l1w, "linear1.weight");
    expect_free(&v, l1b, "linear1.bias");
    expect_free(&v, l2w, "linear2.weight");
    expect_free(&v, l2b, "linear2.bias");
    for (int i = 0; i < 2; i++) {
        ts_tensor *ones, *zeros;
        TH_OK(ts_tensor_ones(TS_F32, 1, &e, &ones));
        TH_OK(ts_tensor_zeros(TS_F32, 1, &e, &zeros));
        expect_free(&v, ones, "norm.weight");
        expect_free(&v, zeros, "norm.bias");
    }
    fv_close(&v);
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
    fv_vec v = fv_open("init_kaiming_uniform");
    for (int k = 0; k < 6; k++) {
        const init_case *c = &cases[k];
        ts_manual_seed((uint64_t)k);
        ts_tensor *t = empty(c->dtype, c->ndim, c->shape);
        TH_OK(ts_init_kaiming_uniform_(t, c->a, c->mode, c->nl, NULL));
        char what[32];
        snprintf(what, sizeof what, "case %d", k);
        expect_free(&v, t, what);
    }
    fv_close(&v);
}

Test(tensor_init, kaiming_normal_matches_torch)
{
    static const init_case cases[] = {
        {2, {16, 8}, TS_F32, 0, TS_FAN_IN, TS_NL_RELU},         /* vectorised normal path */
        {2, {3, 4}, TS_F32, 0, TS_FAN_IN, TS_NL_LEAKY_RELU},    /* scalar path */
        {3, {6, 4, 3}, TS_F32, 0, TS_FAN_OUT, TS_NL_RELU},      /* 72: block + tail */
        {2, {5, 5}, TS_F64, 0.1, TS_FAN_IN, TS_NL_LEAKY_RELU},  /* float64 path */
    };
    fv_vec v = fv_open("init_kaiming_normal");
    for (int k = 0; k < 4; k++) {
        const init_case *c = &cases[k];
        ts_manual_seed((uint64_t)k);
        ts_tensor *t = empty(c->dtype, c->ndim, c->shape);
        TH_OK(ts_init_kaiming_normal_(t, c->a, c->mode, c->nl, NULL));
        char what[32];
        snprintf(what, sizeof what, "case %d", k);
        expect_free(&v, t, what);
    }
    fv_close(&v);
}

Test(tensor_init, xavier_uniform_matches_torch)
{
    static const init_case cases[] = {
        {2, {24, 8}, TS_F32, 1.0, 0, 0},
        {3, {3, 5, 2}, TS_F32, 5.0 / 3, 0, 0}, /* gain = calculate_gain('tanh') */
        {2, {7, 3}, TS_F64, 1.0, 0, 0},
    };
    fv_vec v = fv_open("init_xavier_uniform");
    for (int k = 0; k < 3; k++) {
        const init_case *c = &cases[k];
        ts_manual_seed((uint64_t)k);
        ts_tensor *t = empty(c->dtype, c->ndim, c->shape);
        double gain = k == 1 ? ts_init_calculate_gain(TS_NL_TANH, 0) : c->a;
        TH_OK(ts_init_xavier_uniform_(t, gain, NULL));
        char what[32];
        snprintf(what, sizeof what, "case %d", k);
        expect_free(&v, t, what);
    }
    fv_close(&v);
}

Test(tensor_init, xavier_normal_matches_torch)
{
    static const init_case cases[] = {
        {3, {1, 1, 8}, TS_F32, 1.0, 0, 0}, /* MHA's bias_k: scalar path */
        {2, {20, 10}, TS_F32, 0.5, 0, 0},
        {2, {4, 6}, TS_F64, 2.0, 0, 0},
    };
    fv_vec v = fv_open("init_xavier_normal");
    for (int k = 0; k < 3; k++) {
        const init_case *c = &cases[k];
        ts_manual_seed((uint64_t)k);
        ts_tensor *t = empty(c->dtype, c->ndim, c->shape);
        TH_OK(ts_init_xavier_normal_(t, c->a, NULL));
        char what[32];
        snprintf(what, sizeof what, "case %d", k);
        expect_free(&v, t, what);
    }
    fv_close(&v);
}

Test(tensor_init, zero_element_tensors_draw_nothing)
{
    fv_vec v = fv_open("init_zero_element");
    ts_manual_seed(9);
    ts_tensor *a = empty(TS_F32, 2, (int64_t[]){0, 5});
    ts_tensor *b = empty(TS_F32, 2, (int64_t[]){3, 0});
    ts_tensor *c = empty(TS_F32, 2, (int64_t[]){0, 4});
    ts_tensor *d = empty(TS_F32, 1, (int64_t[]){0}); /* 1-d but empty: torch's no-op comes first */
    TH_OK(ts_init_kaiming_uniform_(a, 0, TS_FAN_IN, TS_NL_LEAKY_RELU, NULL));
    TH_OK(ts_init_kaiming_normal_(b, 0, TS_FAN_IN, TS_NL_LEAKY_RELU, NULL));
    TH_OK(ts_init_xavier_uniform_(c, 1.0, NULL));
    TH_OK(ts_init_kaiming_uniform_(d, 0, TS_FAN_IN, TS_NL_LEAKY_RELU, NULL));
    ts_tensor *r;
    TH_OK(ts_rand(TS_F32, 1, (int64_t[]){2}, NULL, &r));
    expect_free(&v, r, "rand(2) after the no-ops");
    fv_close(&v);
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
    fv_vec v = fv_open("init_calculate_gain");
    fv_expect_bytes("calculate_gain", TS_F64, g, fv_take(&v, sizeof g), 10);
    fv_close(&v);
    cr_assert(isnan(ts_init_calculate_gain((ts_nonlinearity)42, 0)));
}

Test(tensor_init, float64_bound_is_not_rounded_to_one_over_sqrt_fan)
{
    /* SPEC §8: for fan 4 the f64 bound is 0.49999999999999994, not 0.5;
     * kaiming_uniform_ on a float64 tensor must use the former. With
     * U53 = x the element is fma(x, 2 * bound, -bound). */
    const double bound = sqrt(3.0) * (sqrt(2.0 / (1 + sqrt(5.0) * sqrt(5.0))) / sqrt(4.0));
    cr_assert_eq(bound, 0.49999999999999994);
    ts_manual_seed(0);
    ts_tensor *t = empty(TS_F64, 2, (int64_t[]){4, 4});
    TH_OK(ts_init_kaiming_uniform_(t, sqrt(5.0), TS_FAN_IN, TS_NL_LEAKY_RELU, NULL));
    ts_manual_seed(0);
    ts_tensor *u = empty(TS_F64, 2, (int64_t[]){4, 4});
    TH_OK(ts_uniform_(u, -bound, bound, NULL));
    cr_assert_eq(memcmp(ts_tensor_data(t), ts_tensor_data(u), 16 * sizeof(double)), 0);
    ts_tensor_free(t);
    ts_tensor_free(u);
}

/* --------------------------------------------------------------- errors */

Test(tensor_init, refuses_fewer_than_two_dims)
{
    ts_tensor *t = empty(TS_F32, 1, (int64_t[]){5});
    FV_FAILS(ts_init_kaiming_uniform_(t, 0, TS_FAN_IN, TS_NL_LEAKY_RELU, NULL), TS_ERR_SHAPE, "kaiming_uniform_",
             "fewer than 2 dimensions", "(5,)");
    FV_FAILS(ts_init_kaiming_normal_(t, 0, TS_FAN_IN, TS_NL_RELU, NULL), TS_ERR_SHAPE, "kaiming_normal_");
    FV_FAILS(ts_init_xavier_uniform_(t, 1.0, NULL), TS_ERR_SHAPE, "xavier_uniform_");
    FV_FAILS(ts_init_xavier_normal_(t, 1.0, NULL), TS_ERR_SHAPE, "xavier_normal_");
    ts_tensor_free(t);
    TH_OK(ts_tensor_empty(TS_F32, 0, NULL, &t));
    FV_FAILS(ts_init_xavier_normal_(t, 1.0, NULL), TS_ERR_SHAPE, "xavier_normal_");
    ts_tensor_free(t);
}

Test(tensor_init, refuses_bad_arguments)
{
    ts_tensor *t = empty(TS_F32, 2, (int64_t[]){3, 3});
    FV_FAILS(ts_init_kaiming_uniform_(t, 0, (ts_fan_mode)7, TS_NL_RELU, NULL), TS_ERR_INVALID_ARGUMENT,
             "kaiming_uniform_", "mode 7");
    FV_FAILS(ts_init_kaiming_normal_(t, 0, TS_FAN_IN, (ts_nonlinearity)99, NULL), TS_ERR_INVALID_ARGUMENT,
             "kaiming_normal_", "nonlinearity 99");
    ts_tensor_free(t);
    t = empty(TS_F32, 2, (int64_t[]){0, 0}); /* torch: float division by zero */
    FV_FAILS(ts_init_xavier_uniform_(t, 1.0, NULL), TS_ERR_INVALID_ARGUMENT, "xavier_uniform_", "(0, 0)");
    ts_tensor_free(t);
    t = empty(TS_I64, 2, (int64_t[]){3, 3});
    FV_FAILS(ts_init_kaiming_uniform_(t, 0, TS_FAN_IN, TS_NL_RELU, NULL), TS_ERR_DTYPE, "uniform_", "int64");
    FV_FAILS(ts_init_xavier_normal_(t, 1.0, NULL), TS_ERR_DTYPE, "normal_", "int64");
    ts_tensor_free(t);
    FV_FAILS(ts_init_xavier_normal_(NULL, 1.0, NULL), TS_ERR_INVALID_ARGUMENT, "xavier_normal_");
}

Test(tensor_init, refuses_released_and_sharded_tensors)
{
    ts_tensor *t = empty(TS_F32, 2, (int64_t[]){4, 4});
    TH_OK(ts_storage_release(ts_tensor_storage(t)));
    FV_FAILS(ts_init_kaiming_uniform_(t, 0, TS_FAN_IN, TS_NL_RELU, NULL), TS_ERR_RELEASED, "kaiming_uniform_");
    FV_FAILS(ts_init_xavier_normal_(t, 1.0, NULL), TS_ERR_RELEASED, "xavier_normal_");
    TH_OK(ts_storage_restore(ts_tensor_storage(t)));
    int meta;
    ts_tensor_set_shard(t, &meta);
    FV_FAILS(ts_init_kaiming_normal_(t, 0, TS_FAN_IN, TS_NL_RELU, NULL), TS_ERR_SHARDED, "kaiming_normal_");
    FV_FAILS(ts_init_xavier_uniform_(t, 1.0, NULL), TS_ERR_SHARDED, "xavier_uniform_");
    ts_tensor_clear_shard(t);
    TH_OK(ts_init_xavier_uniform_(t, 1.0, NULL));
    ts_tensor_free(t);
}

Test(tensor_init, explicit_generator)
{
    ts_generator *g;
    TH_OK(ts_generator_new(0, &g));
    ts_manual_seed(12345); /* the default generator is not used */
    ts_tensor *t = empty(TS_F32, 2, (int64_t[]){4, 4});
    TH_OK(ts_init_kaiming_uniform_(t, sqrt(5.0), TS_FAN_IN, TS_NL_LEAKY_RELU, g));
    fv_vec v = fv_open("linear4x4_seed0_weight");
    expect_free(&v, t, "Linear(4, 4).weight from a generator");
    fv_close(&v);
    ts_generator_free(g);
}
