/* Every public op of tensor.h on meta inputs (docs/meta.md), table-driven:
 * inside a meta scope each op gives the CPU op's status, error message,
 * output shapes, dtypes and strides, and its backward the CPU gradients'
 * shapes; outside a scope it fails with TS_ERR_STATE (or, for what reads
 * no data, works); CPU inputs inside a scope give meta outputs of the same
 * geometry. Run under ASan by CI: no path dereferences a meta storage. */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <string.h>

#include "tests/helpers.h"

enum kind { K_NONE, K_RANDN, K_POS, K_IDX, K_BOOL, K_CAUSAL };

typedef struct spec {
    enum kind kind;
    ts_dtype dt;
    int nd;
    int64_t shape[4];
    bool rg;    /* requires grad */
    int64_t hi; /* K_IDX: values in [0, hi) */
} spec;

#define MAX_IN 4
#define MAX_OUT 4

typedef ts_status (*op_fn)(ts_tensor **in, ts_tensor **out, int *n_out);

/* outside: what the op gives on meta inputs outside a meta scope */
enum outside { O_STATE, O_OK };

typedef struct op_case {
    const char *name;
    op_fn fn;
    int n_in;
    spec in[MAX_IN];
    enum outside outside;
} op_case;

/* ------------------------------------------------------------ inputs */

static ts_status make_input(const spec *s, ts_tensor **out)
{
    ts_status st = TS_OK;
    ts_tensor *t = NULL, *u = NULL, *z = NULL;
    bool grad = ts_grad_mode_set(false);
    switch (s->kind) {
    case K_NONE:
        *out = NULL;
        ts_grad_mode_set(grad);
        return TS_OK;
    case K_RANDN:
    case K_POS:
        if (!(st = ts_randn(TS_F64, s->nd, s->shape, NULL, &u))) {
            if (s->kind == K_POS && !(st = ts_abs(u, &z))) {
                ts_tensor_free(u);
                st = ts_add_scalar(z, 0.5, &u);
                ts_tensor_free(z);
            }
            if (!st) st = ts_to_dtype(u, s->dt, &t);
        }
        break;
    case K_IDX:
        if (!(st = ts_randint(0, s->hi, s->nd, s->shape, NULL, &u))) st = ts_to_dtype(u, s->dt, &t);
        break;
    case K_BOOL:
        if (!(st = ts_randn(TS_F32, s->nd, s->shape, NULL, &u)) && !(st = ts_tensor_zeros(TS_F32, 0, NULL, &z)))
            st = ts_gt(u, z, &t);
        ts_tensor_free(z);
        break;
    case K_CAUSAL:
        if (!(st = ts_tril_mask(s->shape[0], 0, &u)) && !(st = ts_tensor_full(TS_BOOL, 0, NULL, 0, &z)))
            st = ts_eq(u, z, &t);
        ts_tensor_free(z);
        break;
    }
    ts_grad_mode_set(grad);
    ts_tensor_free(u);
    if (!st && s->rg) {
        /* a leaf of its own (to_dtype of the same dtype gives u back) */
        ts_tensor *d;
        if (!(st = ts_detach(t, &d))) {
            ts_tensor_free(t);
            t = d;
            st = ts_tensor_set_requires_grad(t, true);
        }
    }
    if (st) {
        ts_tensor_free(t);
        return st;
    }
    *out = t;
    return TS_OK;
}

static void make_inputs(const op_case *c, ts_tensor **in)
{
    for (int i = 0; i < c->n_in; i++) TH_OK(make_input(&c->in[i], &in[i]));
}

static void free_all(int n, ts_tensor **t)
{
    for (int i = 0; i < n; i++) {
        ts_tensor_free(t[i]);
        t[i] = NULL;
    }
}

/* --------------------------------------------------------- geometry */

typedef struct geom {
    bool present;
    ts_dtype dt;
    int nd;
    int64_t shape[TS_MAX_DIMS], strides[TS_MAX_DIMS];
    bool rg;
} geom;

static geom geom_of(const ts_tensor *t)
{
    geom g = {0};
    if (!t) return g;
    g.present = true;
    g.dt = ts_tensor_dtype(t);
    g.nd = ts_tensor_ndim(t);
    memcpy(g.shape, ts_tensor_shape(t), (size_t)g.nd * sizeof(int64_t));
    memcpy(g.strides, ts_tensor_strides(t), (size_t)g.nd * sizeof(int64_t));
    g.rg = ts_tensor_requires_grad(t);
    return g;
}

static const char *shape_s(int nd, const int64_t *shape, char buf[96])
{
    int n = snprintf(buf, 96, "(");
    for (int i = 0; i < nd && n < 90; i++)
        n += snprintf(buf + n, (size_t)(96 - n), i ? ", %lld" : "%lld", (long long)shape[i]);
    snprintf(buf + n, (size_t)(96 - n), ")");
    return buf;
}

static void assert_geom_eq(const char *op, const char *what, int i, geom a, geom b)
{
    char s1[96], s2[96];
    cr_assert_eq(a.present, b.present, "%s: %s %d present %d vs %d", op, what, i, a.present, b.present);
    if (!a.present) return;
    cr_assert_eq(a.dt, b.dt, "%s: %s %d dtype %s vs %s", op, what, i, ts_dtype_name(a.dt), ts_dtype_name(b.dt));
    cr_assert(a.nd == b.nd && !memcmp(a.shape, b.shape, (size_t)a.nd * sizeof(int64_t)), "%s: %s %d shape %s vs %s", op,
              what, i, shape_s(a.nd, a.shape, s1), shape_s(b.nd, b.shape, s2));
    for (int d = 0; d < a.nd; d++)
        if (a.shape[d] > 1)
            cr_assert_eq(a.strides[d], b.strides[d], "%s: %s %d stride of dim %d: %lld vs %lld", op, what, i, d,
                         (long long)a.strides[d], (long long)b.strides[d]);
    cr_assert_eq(a.rg, b.rg, "%s: %s %d requires_grad %d vs %d", op, what, i, a.rg, b.rg);
}

/* One run of an op: status, message, output and gradient geometry. */
typedef struct run {
    ts_status st;
    char msg[512];
    int n_out;
    geom out[MAX_OUT], grad[MAX_IN];
    bool out_meta[MAX_OUT], grad_meta[MAX_IN];
} run;

/* Runs c on inputs `in` (already made), then, when out 0 is a floating
 * tensor that requires grad, a backward from the sum of out 0. */
static run run_op(const op_case *c, ts_tensor **in, bool backward)
{
    run r = {0};
    ts_tensor *out[MAX_OUT] = {0};
    int n_out = 0;
    r.st = c->fn(in, out, &n_out);
    snprintf(r.msg, sizeof r.msg, "%s", r.st ? ts_last_error() : "");
    if (r.st) return r;
    r.n_out = n_out;
    for (int i = 0; i < n_out; i++) {
        r.out[i] = geom_of(out[i]);
        r.out_meta[i] = ts_tensor_device(out[i]) == TS_DEVICE_META;
    }
    if (backward && n_out && out[0] && ts_tensor_requires_grad(out[0]) && ts_dtype_is_float(ts_tensor_dtype(out[0]))) {
        ts_tensor *s;
        TH_OK(ts_sum(out[0], 0, NULL, false, &s));
        TH_OK(ts_backward(s, NULL, false));
        ts_tensor_free(s);
        for (int i = 0; i < c->n_in; i++) {
            ts_tensor *g = in[i] ? ts_tensor_grad(in[i]) : NULL;
            r.grad[i] = geom_of(g);
            r.grad_meta[i] = g && ts_tensor_device(g) == TS_DEVICE_META;
        }
    }
    free_all(n_out, out);
    return r;
}

static void check_case(const op_case *c)
{
    ts_tensor *in[MAX_IN] = {0};
    ts_manual_seed(1);
    /* the CPU reference */
    make_inputs(c, in);
    run cpu = run_op(c, in, true);
    free_all(c->n_in, in);
    /* meta inputs in a meta scope: the CPU's status, message and geometry */
    TH_OK(ts_device_scope_enter(TS_DEVICE_META));
    make_inputs(c, in);
    run meta = run_op(c, in, true);
    TH_OK(ts_device_scope_exit());
    cr_assert_eq(meta.st, cpu.st, "%s: meta %s (%s), cpu %s (%s)", c->name, ts_status_name(meta.st), meta.msg,
                 ts_status_name(cpu.st), cpu.msg);
    cr_assert_str_eq(meta.msg, cpu.msg, "%s: the same message", c->name);
    cr_assert_eq(meta.n_out, cpu.n_out, "%s", c->name);
    for (int i = 0; i < cpu.n_out; i++) {
        assert_geom_eq(c->name, "output", i, meta.out[i], cpu.out[i]);
        if (meta.out[i].present) cr_assert(meta.out_meta[i], "%s: output %d is a meta tensor", c->name, i);
    }
    for (int i = 0; i < c->n_in; i++) {
        assert_geom_eq(c->name, "gradient", i, meta.grad[i], cpu.grad[i]);
        if (meta.grad[i].present) cr_assert(meta.grad_meta[i], "%s: gradient %d is a meta tensor", c->name, i);
    }
    cr_log_info("%s: %s%s%s, %d outputs", c->name, ts_status_name(cpu.st), cpu.st ? ": " : "", cpu.msg, cpu.n_out);
    /* the same meta inputs outside the scope: refused, never a crash */
    for (int i = 0; i < c->n_in; i++)
        if (in[i]) ts_tensor_zero_grad(in[i], true);
    run outside = run_op(c, in, false);
    free_all(c->n_in, in);
    if (c->outside == O_STATE && cpu.st == TS_OK) {
        cr_assert_eq(outside.st, TS_ERR_STATE, "%s outside a scope: %s (%s)", c->name, ts_status_name(outside.st),
                     outside.msg);
        cr_assert(strstr(outside.msg, "is on the meta device (it has no data)"), "%s: %s", c->name, outside.msg);
    } else if (c->outside == O_OK) {
        cr_assert_eq(outside.st, cpu.st, "%s outside a scope: %s (%s)", c->name, ts_status_name(outside.st),
                     outside.msg);
    }
    /* CPU inputs inside a meta scope: meta outputs of the CPU's geometry */
    if (cpu.st == TS_OK) {
        make_inputs(c, in);
        TH_OK(ts_device_scope_enter(TS_DEVICE_META));
        run mixed = run_op(c, in, true);
        TH_OK(ts_device_scope_exit());
        free_all(c->n_in, in);
        cr_assert_eq(mixed.st, TS_OK, "%s on CPU inputs in a meta scope: %s", c->name, mixed.msg);
        for (int i = 0; i < cpu.n_out; i++) assert_geom_eq(c->name, "output (CPU inputs)", i, mixed.out[i], cpu.out[i]);
    }
}

/* ------------------------------------------------------------ the ops */

#define F32(...) \
    { \
        K_RANDN, TS_F32, NDIMS(__VA_ARGS__), {__VA_ARGS__}, true, 0 \
    }
#define NDIMS(...) ((int)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)))
#define T_(kind_, dt_, rg_, ...) \
    { \
        kind_, dt_, NDIMS(__VA_ARGS__), {__VA_ARGS__}, rg_, 0 \
    }
#define IDX(hi_, ...) \
    { \
        K_IDX, TS_I64, NDIMS(__VA_ARGS__), {__VA_ARGS__}, false, hi_ \
    }
#define SCALAR(dt_) \
    { \
        K_RANDN, dt_, 0, {0}, true, 0 \
    }

static ts_status one(ts_status st, int *n)
{
    *n = st ? 0 : 1;
    return st;
}

static ts_status op_view(ts_tensor **in, ts_tensor **out, int *n)
{
    int64_t s[2] = {-1, 6};
    return one(ts_view(in[0], 2, s, out), n);
}
static ts_status op_view_bad(ts_tensor **in, ts_tensor **out, int *n)
{
    ts_tensor *t;
    ts_status st = ts_transpose(in[0], 0, 1, &t);
    if (st) return st;
    int64_t s[1] = {-1};
    st = ts_view(t, 1, s, out);
    ts_tensor_free(t);
    return one(st, n);
}
static ts_status op_reshape(ts_tensor **in, ts_tensor **out, int *n)
{
    ts_tensor *t;
    ts_status st = ts_transpose(in[0], 0, 1, &t);
    if (st) return st;
    int64_t s[1] = {-1};
    st = ts_reshape(t, 1, s, out);
    ts_tensor_free(t);
    return one(st, n);
}
static ts_status op_reshape_bad(ts_tensor **in, ts_tensor **out, int *n)
{
    int64_t s[2] = {5, 5};
    return one(ts_reshape(in[0], 2, s, out), n);
}
static ts_status op_transpose(ts_tensor **in, ts_tensor **out, int *n)
{
    return one(ts_transpose(in[0], 0, -1, out), n);
}
static ts_status op_permute(ts_tensor **in, ts_tensor **out, int *n)
{
    int d[3] = {2, 0, 1};
    return one(ts_permute(in[0], d, out), n);
}
static ts_status op_narrow(ts_tensor **in, ts_tensor **out, int *n) { return one(ts_narrow(in[0], 1, 1, 2, out), n); }
static ts_status op_narrow_bad(ts_tensor **in, ts_tensor **out, int *n)
{
    return one(ts_narrow(in[0], 1, 3, 9, out), n);
}
static ts_status op_slice(ts_tensor **in, ts_tensor **out, int *n) { return one(ts_slice(in[0], 1, 0, -1, 2, out), n); }
static ts_status op_expand(ts_tensor **in, ts_tensor **out, int *n)
{
    int64_t s[3] = {2, 4, -1};
    return one(ts_expand(in[0], 3, s, out), n);
}
static ts_status op_squeeze(ts_tensor **in, ts_tensor **out, int *n) { return one(ts_squeeze(in[0], 0, out), n); }
static ts_status op_unsqueeze(ts_tensor **in, ts_tensor **out, int *n) { return one(ts_unsqueeze(in[0], 1, out), n); }
static ts_status op_contiguous(ts_tensor **in, ts_tensor **out, int *n)
{
    ts_tensor *t;
    ts_status st = ts_transpose(in[0], 0, 1, &t);
    if (st) return st;
    st = ts_contiguous(t, out);
    ts_tensor_free(t);
    return one(st, n);
}
static ts_status op_clone(ts_tensor **in, ts_tensor **out, int *n) { return one(ts_clone(in[0], out), n); }
static ts_status op_detach(ts_tensor **in, ts_tensor **out, int *n) { return one(ts_detach(in[0], out), n); }
static ts_status op_local_view(ts_tensor **in, ts_tensor **out, int *n)
{
    return one(ts_tensor_local_view(in[0], out), n);
}

static ts_status op_add(ts_tensor **in, ts_tensor **out, int *n) { return one(ts_add(in[0], in[1], out), n); }
static ts_status op_sub(ts_tensor **in, ts_tensor **out, int *n) { return one(ts_sub(in[0], in[1], out), n); }
static ts_status op_mul(ts_tensor **in, ts_tensor **out, int *n) { return one(ts_mul(in[0], in[1], out), n); }
static ts_status op_div(ts_tensor **in, ts_tensor **out, int *n) { return one(ts_div(in[0], in[1], out), n); }
static ts_status op_add_s(ts_tensor **in, ts_tensor **out, int *n) { return one(ts_add_scalar(in[0], 2, out), n); }
static ts_status op_sub_s(ts_tensor **in, ts_tensor **out, int *n) { return one(ts_sub_scalar(in[0], 2, out), n); }
static ts_status op_rsub_s(ts_tensor **in, ts_tensor **out, int *n) { return one(ts_rsub_scalar(in[0], 2, out), n); }
static ts_status op_mul_s(ts_tensor **in, ts_tensor **out, int *n) { return one(ts_mul_scalar(in[0], 2, out), n); }
static ts_status op_div_s(ts_tensor **in, ts_tensor **out, int *n) { return one(ts_div_scalar(in[0], 2, out), n); }
static ts_status op_pow_s(ts_tensor **in, ts_tensor **out, int *n) { return one(ts_pow_scalar(in[0], 3, out), n); }
static ts_status op_neg(ts_tensor **in, ts_tensor **out, int *n) { return one(ts_neg(in[0], out), n); }
static ts_status op_exp(ts_tensor **in, ts_tensor **out, int *n) { return one(ts_exp(in[0], out), n); }
static ts_status op_log(ts_tensor **in, ts_tensor **out, int *n) { return one(ts_log(in[0], out), n); }
static ts_status op_sqrt(ts_tensor **in, ts_tensor **out, int *n) { return one(ts_sqrt(in[0], out), n); }
static ts_status op_rsqrt(ts_tensor **in, ts_tensor **out, int *n) { return one(ts_rsqrt(in[0], out), n); }
static ts_status op_tanh(ts_tensor **in, ts_tensor **out, int *n) { return one(ts_tanh(in[0], out), n); }
static ts_status op_sigmoid(ts_tensor **in, ts_tensor **out, int *n) { return one(ts_sigmoid(in[0], out), n); }
static ts_status op_relu(ts_tensor **in, ts_tensor **out, int *n) { return one(ts_relu(in[0], out), n); }
static ts_status op_abs(ts_tensor **in, ts_tensor **out, int *n) { return one(ts_abs(in[0], out), n); }
static ts_status op_gelu(ts_tensor **in, ts_tensor **out, int *n) { return one(ts_gelu(in[0], TS_GELU_NONE, out), n); }
static ts_status op_gelu_tanh(ts_tensor **in, ts_tensor **out, int *n)
{
    return one(ts_gelu(in[0], TS_GELU_TANH, out), n);
}
static ts_status op_gelu_bad(ts_tensor **in, ts_tensor **out, int *n)
{
    return one(ts_gelu(in[0], (ts_gelu_approx)9, out), n);
}

static ts_status op_sum(ts_tensor **in, ts_tensor **out, int *n)
{
    int d[1] = {1};
    return one(ts_sum(in[0], 1, d, false, out), n);
}
static ts_status op_mean(ts_tensor **in, ts_tensor **out, int *n)
{
    int d[2] = {0, -1};
    return one(ts_mean(in[0], 2, d, true, out), n);
}
static ts_status op_amax(ts_tensor **in, ts_tensor **out, int *n)
{
    int d[1] = {-1};
    return one(ts_amax(in[0], 1, d, false, out), n);
}
static ts_status op_sum_bad(ts_tensor **in, ts_tensor **out, int *n)
{
    int d[1] = {5};
    return one(ts_sum(in[0], 1, d, false, out), n);
}
static ts_status op_max_dim(ts_tensor **in, ts_tensor **out, int *n)
{
    ts_status st = ts_max_dim(in[0], 1, false, &out[0], &out[1]);
    *n = st ? 0 : 2;
    return st;
}
static ts_status op_softmax(ts_tensor **in, ts_tensor **out, int *n) { return one(ts_softmax(in[0], 1, out), n); }
static ts_status op_log_softmax(ts_tensor **in, ts_tensor **out, int *n)
{
    return one(ts_log_softmax(in[0], -1, out), n);
}
static ts_status op_softmax_bad(ts_tensor **in, ts_tensor **out, int *n) { return one(ts_softmax(in[0], 4, out), n); }
static ts_status op_masked_softmax(ts_tensor **in, ts_tensor **out, int *n)
{
    return one(ts_scaled_masked_softmax(in[0], in[1], 0.5, out), n);
}
static ts_status op_attention(ts_tensor **in, ts_tensor **out, int *n)
{
    return one(ts_attention(in[0], in[1], in[2], 2, in[3], 0.0, false, NULL, out), n);
}
static ts_status op_attention_drop(ts_tensor **in, ts_tensor **out, int *n)
{
    return one(ts_attention(in[0], in[1], in[2], 2, in[3], 0.3, true, NULL, out), n);
}
static ts_status op_attention_bad(ts_tensor **in, ts_tensor **out, int *n)
{
    return one(ts_attention(in[0], in[1], in[2], 3, in[3], 0.0, false, NULL, out), n);
}
static ts_status op_matmul(ts_tensor **in, ts_tensor **out, int *n) { return one(ts_matmul(in[0], in[1], out), n); }
static ts_status op_linear(ts_tensor **in, ts_tensor **out, int *n)
{
    return one(ts_linear(in[0], in[1], in[2], out), n);
}
static ts_status op_layer_norm(ts_tensor **in, ts_tensor **out, int *n)
{
    return one(ts_layer_norm(in[0], 1, in[1], in[2], 1e-5, out), n);
}
static ts_status op_embedding(ts_tensor **in, ts_tensor **out, int *n)
{
    return one(ts_embedding(in[0], in[1], out), n);
}
static ts_status op_ce_mean(ts_tensor **in, ts_tensor **out, int *n)
{
    return one(ts_cross_entropy(in[0], in[1], -100, TS_REDUCTION_MEAN, out), n);
}
static ts_status op_ce_sum(ts_tensor **in, ts_tensor **out, int *n)
{
    return one(ts_cross_entropy(in[0], in[1], 2, TS_REDUCTION_SUM, out), n);
}
static ts_status op_ce_none(ts_tensor **in, ts_tensor **out, int *n)
{
    return one(ts_cross_entropy(in[0], in[1], -100, TS_REDUCTION_NONE, out), n);
}
static ts_status op_mse(ts_tensor **in, ts_tensor **out, int *n)
{
    return one(ts_mse_loss(in[0], in[1], TS_REDUCTION_MEAN, out), n);
}
static ts_status op_l1(ts_tensor **in, ts_tensor **out, int *n)
{
    return one(ts_l1_loss(in[0], in[1], TS_REDUCTION_SUM, out), n);
}
static ts_status op_dropout(ts_tensor **in, ts_tensor **out, int *n)
{
    return one(ts_dropout(in[0], 0.25, true, NULL, out), n);
}
static ts_status op_dropout_all(ts_tensor **in, ts_tensor **out, int *n)
{
    return one(ts_dropout(in[0], 1.0, true, NULL, out), n);
}
static ts_status op_dropout_bad(ts_tensor **in, ts_tensor **out, int *n)
{
    return one(ts_dropout(in[0], 1.5, true, NULL, out), n);
}
static ts_status op_cat(ts_tensor **in, ts_tensor **out, int *n) { return one(ts_cat(2, in, 1, out), n); }
static ts_status op_split(ts_tensor **in, ts_tensor **out, int *n) { return ts_split(in[0], 2, 1, MAX_OUT, out, n); }
static ts_status op_chunk(ts_tensor **in, ts_tensor **out, int *n) { return ts_chunk(in[0], 3, 0, MAX_OUT, out, n); }
static ts_status op_where(ts_tensor **in, ts_tensor **out, int *n)
{
    return one(ts_where(in[0], in[1], in[2], out), n);
}
static ts_status op_masked_fill(ts_tensor **in, ts_tensor **out, int *n)
{
    return one(ts_masked_fill(in[0], in[1], -1e9, out), n);
}
static ts_status op_to_f64(ts_tensor **in, ts_tensor **out, int *n) { return one(ts_to_dtype(in[0], TS_F64, out), n); }
static ts_status op_to_bf16(ts_tensor **in, ts_tensor **out, int *n)
{
    return one(ts_to_dtype(in[0], TS_BF16, out), n);
}
static ts_status op_eq(ts_tensor **in, ts_tensor **out, int *n) { return one(ts_eq(in[0], in[1], out), n); }
static ts_status op_ne(ts_tensor **in, ts_tensor **out, int *n) { return one(ts_ne(in[0], in[1], out), n); }
static ts_status op_lt(ts_tensor **in, ts_tensor **out, int *n) { return one(ts_lt(in[0], in[1], out), n); }
static ts_status op_le(ts_tensor **in, ts_tensor **out, int *n) { return one(ts_le(in[0], in[1], out), n); }
static ts_status op_gt(ts_tensor **in, ts_tensor **out, int *n) { return one(ts_gt(in[0], in[1], out), n); }
static ts_status op_ge(ts_tensor **in, ts_tensor **out, int *n) { return one(ts_ge(in[0], in[1], out), n); }
static ts_status op_pin(ts_tensor **in, ts_tensor **out, int *n) { return one(ts_tensor_pin_memory(in[0], out), n); }
static ts_status noop_cb(void *ctx, int nn, ts_tensor **grads)
{
    (void)ctx;
    (void)nn;
    (void)grads;
    return TS_OK;
}
static ts_status op_custom(ts_tensor **in, ts_tensor **out, int *n)
{
    return one(ts_autograd_custom(1, in, noop_cb, NULL, NULL, out), n);
}
/* in place: no output */
static ts_status op_copy_(ts_tensor **in, ts_tensor **out, int *n)
{
    (void)out;
    *n = 0;
    return ts_tensor_copy_(in[0], in[1]);
}
static ts_status op_fill_(ts_tensor **in, ts_tensor **out, int *n)
{
    (void)out;
    *n = 0;
    return ts_tensor_fill_(in[0], 3.0);
}
static ts_status op_fill_bad(ts_tensor **in, ts_tensor **out, int *n)
{
    (void)out;
    *n = 0;
    return ts_tensor_fill_(in[0], 1e300);
}
static ts_status op_uniform_(ts_tensor **in, ts_tensor **out, int *n)
{
    (void)out;
    *n = 0;
    return ts_uniform_(in[0], -1, 1, NULL);
}
static ts_status op_normal_(ts_tensor **in, ts_tensor **out, int *n)
{
    (void)out;
    *n = 0;
    return ts_normal_(in[0], 0, 2, NULL);
}
static ts_status op_bernoulli_(ts_tensor **in, ts_tensor **out, int *n)
{
    (void)out;
    *n = 0;
    return ts_bernoulli_(in[0], 0.5, NULL);
}
static ts_status op_kaiming(ts_tensor **in, ts_tensor **out, int *n)
{
    (void)out;
    *n = 0;
    ts_status st = ts_init_kaiming_uniform_(in[0], 2.23, TS_FAN_IN, TS_NL_LEAKY_RELU, NULL);
    return st ? st : ts_init_kaiming_normal_(in[0], 0, TS_FAN_OUT, TS_NL_RELU, NULL);
}
static ts_status op_xavier(ts_tensor **in, ts_tensor **out, int *n)
{
    (void)out;
    *n = 0;
    ts_status st = ts_init_xavier_uniform_(in[0], 1.0, NULL);
    return st ? st : ts_init_xavier_normal_(in[0], 1.0, NULL);
}
static ts_status op_kaiming_bad(ts_tensor **in, ts_tensor **out, int *n)
{
    (void)out;
    *n = 0;
    return ts_init_kaiming_uniform_(in[0], 0, TS_FAN_IN, TS_NL_RELU, NULL);
}

#define NO_GRAD(kind_, dt_, ...) \
    { \
        kind_, dt_, NDIMS(__VA_ARGS__), {__VA_ARGS__}, false, 0 \
    }

static const op_case cases[] = {
    /* views */
    {"view", op_view, 1, {F32(2, 3, 4)}, O_STATE},
    {"view (not viewable)", op_view_bad, 1, {F32(2, 3, 4)}, O_STATE},
    {"reshape (copies)", op_reshape, 1, {F32(4, 6)}, O_STATE},
    {"reshape (bad count)", op_reshape_bad, 1, {F32(4, 6)}, O_STATE},
    {"transpose", op_transpose, 1, {F32(2, 3, 4)}, O_STATE},
    {"permute", op_permute, 1, {F32(2, 3, 4)}, O_STATE},
    {"narrow", op_narrow, 1, {F32(4, 5)}, O_STATE},
    {"narrow (out of range)", op_narrow_bad, 1, {F32(4, 5)}, O_STATE},
    {"slice", op_slice, 1, {F32(4, 7)}, O_STATE},
    {"expand", op_expand, 1, {F32(1, 5)}, O_STATE},
    {"squeeze", op_squeeze, 1, {F32(1, 5)}, O_STATE},
    {"unsqueeze", op_unsqueeze, 1, {F32(3, 5)}, O_STATE},
    {"contiguous", op_contiguous, 1, {F32(3, 5)}, O_STATE},
    {"clone", op_clone, 1, {F32(3, 5)}, O_STATE},
    {"detach (reads no data)", op_detach, 1, {F32(3, 5)}, O_OK},
    {"local_view (reads no data)", op_local_view, 1, {F32(3, 5)}, O_OK},
    /* elementwise */
    {"add (broadcast)", op_add, 2, {F32(4, 1, 5), F32(3, 1)}, O_STATE},
    {"add (shapes do not broadcast)", op_add, 2, {F32(4, 5), F32(3, 5)}, O_STATE},
    {"add (promotes bf16 with f32)",
     op_add,
     2,
     {T_(K_RANDN, TS_BF16, true, 4, 5), T_(K_RANDN, TS_F32, true, 4, 5)},
     O_STATE},
    {"add (int64 operands)", op_add, 2, {IDX(5, 3), IDX(5, 3)}, O_STATE},
    {"sub", op_sub, 2, {F32(4, 5), F32(5)}, O_STATE},
    {"mul (f64)", op_mul, 2, {T_(K_RANDN, TS_F64, true, 4, 5), T_(K_RANDN, TS_F64, true, 4, 5)}, O_STATE},
    {"div (f16)", op_div, 2, {T_(K_POS, TS_F16, true, 4, 5), T_(K_POS, TS_F16, true, 5)}, O_STATE},
    {"add_scalar", op_add_s, 1, {F32(4, 5)}, O_STATE},
    {"sub_scalar", op_sub_s, 1, {F32(4, 5)}, O_STATE},
    {"rsub_scalar", op_rsub_s, 1, {F32(4, 5)}, O_STATE},
    {"mul_scalar (bf16)", op_mul_s, 1, {T_(K_RANDN, TS_BF16, true, 4, 5)}, O_STATE},
    {"div_scalar", op_div_s, 1, {F32(4, 5)}, O_STATE},
    {"pow_scalar", op_pow_s, 1, {F32(4, 5)}, O_STATE},
    {"neg", op_neg, 1, {F32(4, 5)}, O_STATE},
    {"exp", op_exp, 1, {F32(4, 5)}, O_STATE},
    {"log", op_log, 1, {T_(K_POS, TS_F32, true, 4, 5)}, O_STATE},
    {"sqrt", op_sqrt, 1, {T_(K_POS, TS_F64, true, 4, 5)}, O_STATE},
    {"rsqrt", op_rsqrt, 1, {T_(K_POS, TS_F32, true, 4, 5)}, O_STATE},
    {"tanh (bf16, strided)", op_tanh, 1, {T_(K_RANDN, TS_BF16, true, 4, 5)}, O_STATE},
    {"sigmoid", op_sigmoid, 1, {F32(4, 5)}, O_STATE},
    {"relu", op_relu, 1, {F32(4, 5)}, O_STATE},
    {"abs", op_abs, 1, {F32(4, 5)}, O_STATE},
    {"gelu", op_gelu, 1, {F32(4, 5)}, O_STATE},
    {"gelu tanh (f16)", op_gelu_tanh, 1, {T_(K_RANDN, TS_F16, true, 4, 5)}, O_STATE},
    {"gelu (bad approximation)", op_gelu_bad, 1, {F32(4, 5)}, O_STATE},
    {"exp (int64)", op_exp, 1, {IDX(3, 4)}, O_STATE},
    /* reductions, softmax */
    {"sum", op_sum, 1, {F32(3, 4, 5)}, O_STATE},
    {"mean keepdim", op_mean, 1, {T_(K_RANDN, TS_BF16, true, 3, 4, 5)}, O_STATE},
    {"amax", op_amax, 1, {F32(3, 4)}, O_STATE},
    {"sum (dim out of range)", op_sum_bad, 1, {F32(3, 4)}, O_STATE},
    {"max over a dim", op_max_dim, 1, {F32(3, 4, 2)}, O_STATE},
    {"softmax (dim 1 of 3)", op_softmax, 1, {F32(3, 4, 5)}, O_STATE},
    {"log_softmax (f16)", op_log_softmax, 1, {T_(K_RANDN, TS_F16, true, 3, 7)}, O_STATE},
    {"softmax (dim out of range)", op_softmax_bad, 1, {F32(3, 4)}, O_STATE},
    {"scaled_masked_softmax", op_masked_softmax, 2, {F32(2, 6, 6), T_(K_CAUSAL, TS_BOOL, false, 6, 6)}, O_STATE},
    {"scaled_masked_softmax (bad mask)",
     op_masked_softmax,
     2,
     {F32(2, 6, 5), T_(K_CAUSAL, TS_BOOL, false, 6, 6)},
     O_STATE},
    /* attention: the fused f32 kernel, the reference (f64), 16-bit */
    {"attention f32 causal",
     op_attention,
     4,
     {F32(2, 6, 8), F32(2, 6, 8), F32(2, 6, 8), T_(K_CAUSAL, TS_BOOL, false, 6, 6)},
     O_STATE},
    {"attention f32 dropout",
     op_attention_drop,
     4,
     {F32(2, 6, 8), F32(2, 6, 8), F32(2, 6, 8), T_(K_CAUSAL, TS_BOOL, false, 6, 6)},
     O_STATE},
    {"attention f64 dropout",
     op_attention_drop,
     4,
     {T_(K_RANDN, TS_F64, true, 2, 5, 4),
      T_(K_RANDN, TS_F64, true, 2, 3, 4),
      T_(K_RANDN, TS_F64, true, 2, 3, 4),
      {K_NONE, TS_BOOL, 0, {0}, false, 0}},
     O_STATE},
    {"attention bf16 dropout",
     op_attention_drop,
     4,
     {T_(K_RANDN, TS_BF16, true, 2, 6, 8), T_(K_RANDN, TS_BF16, true, 2, 6, 8), T_(K_RANDN, TS_BF16, true, 2, 6, 8),
      T_(K_CAUSAL, TS_BOOL, false, 6, 6)},
     O_STATE},
    {"attention (heads do not divide)",
     op_attention_bad,
     4,
     {F32(2, 6, 8), F32(2, 6, 8), F32(2, 6, 8), T_(K_CAUSAL, TS_BOOL, false, 6, 6)},
     O_STATE},
    /* products */
    {"matmul 2-d", op_matmul, 2, {F32(4, 6), F32(6, 3)}, O_STATE},
    {"matmul 1-d @ 2-d", op_matmul, 2, {F32(6), F32(6, 3)}, O_STATE},
    {"matmul 3-d @ 1-d", op_matmul, 2, {F32(2, 4, 6), F32(6)}, O_STATE},
    {"matmul batched broadcast", op_matmul, 2, {F32(2, 1, 4, 6), F32(3, 6, 5)}, O_STATE},
    {"matmul bf16 folded",
     op_matmul,
     2,
     {T_(K_RANDN, TS_BF16, true, 2, 4, 6), T_(K_RANDN, TS_BF16, true, 6, 5)},
     O_STATE},
    {"matmul f16 batched",
     op_matmul,
     2,
     {T_(K_RANDN, TS_F16, true, 2, 4, 6), T_(K_RANDN, TS_F16, true, 2, 6, 5)},
     O_STATE},
    {"matmul (inner sizes differ)", op_matmul, 2, {F32(4, 6), F32(5, 3)}, O_STATE},
    {"matmul (dtypes differ)", op_matmul, 2, {F32(4, 6), T_(K_RANDN, TS_F64, true, 6, 3)}, O_STATE},
    {"linear with bias", op_linear, 3, {F32(2, 3, 6), F32(5, 6), F32(5)}, O_STATE},
    {"linear bf16 with bias",
     op_linear,
     3,
     {T_(K_RANDN, TS_BF16, true, 7, 6), T_(K_RANDN, TS_BF16, true, 5, 6), T_(K_RANDN, TS_BF16, true, 5)},
     O_STATE},
    {"linear no bias (f64)",
     op_linear,
     3,
     {T_(K_RANDN, TS_F64, true, 7, 6), T_(K_RANDN, TS_F64, true, 5, 6), {K_NONE, TS_F64, 0, {0}, false, 0}},
     O_STATE},
    {"linear (bias does not fit)", op_linear, 3, {F32(2, 6), F32(5, 6), F32(4)}, O_STATE},
    /* nn ops */
    {"layer_norm", op_layer_norm, 3, {F32(2, 3, 8), F32(8), F32(8)}, O_STATE},
    {"layer_norm bf16",
     op_layer_norm,
     3,
     {T_(K_RANDN, TS_BF16, true, 3, 8), T_(K_RANDN, TS_BF16, true, 8), T_(K_RANDN, TS_BF16, true, 8)},
     O_STATE},
    {"layer_norm f64 no affine",
     op_layer_norm,
     3,
     {T_(K_RANDN, TS_F64, true, 3, 8), {K_NONE, TS_F64, 0, {0}, false, 0}, {K_NONE, TS_F64, 0, {0}, false, 0}},
     O_STATE},
    {"layer_norm (weight does not fit)", op_layer_norm, 3, {F32(3, 8), F32(7), F32(8)}, O_STATE},
    {"embedding", op_embedding, 2, {F32(10, 4), IDX(10, 2, 3)}, O_STATE},
    {"embedding bf16", op_embedding, 2, {T_(K_RANDN, TS_BF16, true, 10, 4), IDX(10, 5)}, O_STATE},
    {"embedding (1-d weight)", op_embedding, 2, {F32(10), IDX(10, 5)}, O_STATE},
    {"cross_entropy mean", op_ce_mean, 2, {F32(6, 5), IDX(5, 6)}, O_STATE},
    {"cross_entropy sum (ignore 2, f64)", op_ce_sum, 2, {T_(K_RANDN, TS_F64, true, 6, 5), IDX(5, 6)}, O_STATE},
    {"cross_entropy none (bf16)", op_ce_none, 2, {T_(K_RANDN, TS_BF16, true, 6, 5), IDX(5, 6)}, O_STATE},
    {"cross_entropy (targets not int64)", op_ce_mean, 2, {F32(6, 5), F32(6)}, O_STATE},
    {"mse_loss", op_mse, 2, {F32(3, 4), F32(3, 4)}, O_STATE},
    {"l1_loss", op_l1, 2, {F32(3, 4), F32(3, 4)}, O_STATE},
    {"mse_loss (shapes differ)", op_mse, 2, {F32(3, 4), F32(4, 3)}, O_STATE},
    {"dropout", op_dropout, 1, {F32(4, 5)}, O_STATE},
    {"dropout bf16", op_dropout, 1, {T_(K_RANDN, TS_BF16, true, 4, 5)}, O_STATE},
    {"dropout p = 1", op_dropout_all, 1, {F32(4, 5)}, O_STATE},
    {"dropout (p out of range)", op_dropout_bad, 1, {F32(4, 5)}, O_STATE},
    /* shape ops */
    {"cat", op_cat, 2, {F32(2, 3), F32(2, 5)}, O_STATE},
    {"cat (dtypes differ)", op_cat, 2, {F32(2, 3), T_(K_RANDN, TS_F64, true, 2, 5)}, O_STATE},
    {"split", op_split, 1, {F32(3, 7)}, O_STATE},
    {"chunk", op_chunk, 1, {F32(7, 2)}, O_STATE},
    {"where", op_where, 3, {T_(K_BOOL, TS_BOOL, false, 4, 5), F32(4, 5), F32(5)}, O_STATE},
    {"where (condition not bool)", op_where, 3, {F32(4, 5), F32(4, 5), F32(5)}, O_STATE},
    {"masked_fill", op_masked_fill, 2, {F32(2, 6, 6), T_(K_CAUSAL, TS_BOOL, false, 6, 6)}, O_STATE},
    {"to_dtype f64", op_to_f64, 1, {F32(4, 5)}, O_STATE},
    {"to_dtype bf16", op_to_bf16, 1, {F32(4, 5)}, O_STATE},
    {"eq (mixed dtypes)", op_eq, 2, {IDX(3, 4, 5), F32(5)}, O_STATE},
    {"ne", op_ne, 2, {F32(4, 5), F32(4, 5)}, O_STATE},
    {"lt", op_lt, 2, {F32(4, 5), F32(4, 5)}, O_STATE},
    {"le", op_le, 2, {F32(4, 5), F32(4, 5)}, O_STATE},
    {"gt", op_gt, 2, {F32(4, 5), F32(4, 5)}, O_STATE},
    {"ge", op_ge, 2, {F32(4, 5), F32(4, 5)}, O_STATE},
    {"pin_memory", op_pin, 1, {F32(4, 5)}, O_STATE},
    {"autograd_custom (reads no data)", op_custom, 1, {F32(4, 5)}, O_OK},
    /* in place */
    {"copy_", op_copy_, 2, {NO_GRAD(K_RANDN, TS_F32, 4, 5), NO_GRAD(K_RANDN, TS_F64, 5)}, O_STATE},
    {"copy_ (does not broadcast)", op_copy_, 2, {NO_GRAD(K_RANDN, TS_F32, 4, 5), NO_GRAD(K_RANDN, TS_F32, 4)}, O_STATE},
    {"copy_ (into a tensor that requires grad)", op_copy_, 2, {F32(4, 5), F32(4, 5)}, O_STATE},
    {"fill_", op_fill_, 1, {NO_GRAD(K_RANDN, TS_BF16, 4, 5)}, O_OK},
    {"fill_ (value too large)", op_fill_bad, 1, {NO_GRAD(K_RANDN, TS_F16, 4, 5)}, O_OK},
    {"uniform_", op_uniform_, 1, {NO_GRAD(K_RANDN, TS_F32, 4, 5)}, O_OK},
    {"normal_", op_normal_, 1, {NO_GRAD(K_RANDN, TS_F64, 4, 5)}, O_OK},
    {"bernoulli_", op_bernoulli_, 1, {NO_GRAD(K_RANDN, TS_F32, 4, 5)}, O_OK},
    {"bernoulli_ (bf16)", op_bernoulli_, 1, {NO_GRAD(K_RANDN, TS_BF16, 4, 5)}, O_OK},
    {"kaiming", op_kaiming, 1, {NO_GRAD(K_RANDN, TS_F32, 4, 5)}, O_OK},
    {"xavier", op_xavier, 1, {NO_GRAD(K_RANDN, TS_F32, 4, 5, 2)}, O_OK},
    {"kaiming (1-d)", op_kaiming_bad, 1, {NO_GRAD(K_RANDN, TS_F32, 4)}, O_OK},
};

Test(tensor_meta_ops, every_op_on_meta_inputs_matches_the_cpu)
{
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) check_case(&cases[i]);
}

/* The accessors that read data fail on a meta tensor inside a scope too;
 * the storage calls (pin, release, restore) and the gradient setters work
 * on the ledger; a meta shard is refused as a shard inside a scope. */
Test(tensor_meta_ops, accessors_and_storage_calls_on_meta_tensors)
{
    TH_OK(ts_device_scope_enter(TS_DEVICE_META));
    ts_meta_reset();
    int64_t s[2] = {3, 1000}, idx[2] = {0, 0};
    ts_tensor *t, *g, *y = NULL;
    TH_OK(ts_tensor_empty(TS_F32, 2, s, &t));
    double v;
    float buf[4];
    cr_assert_eq(ts_tensor_get(t, idx, &v), TS_ERR_STATE, "no data inside a scope either");
    cr_assert_eq(ts_tensor_copy_to(t, buf, sizeof buf), TS_ERR_INVALID_ARGUMENT, "the size check first, as on the CPU");
    cr_assert_eq(ts_tensor_copy_to(t, buf, 0), TS_ERR_INVALID_ARGUMENT);
    size_t live = ts_meta_get_stats().live;
    cr_assert_eq(live, 12288, "12000 bytes: the 12288-byte class");
    TH_OK(ts_storage_pin(ts_tensor_storage(t)));
    cr_assert(ts_tensor_is_pinned(t));
    ts_meta_stats p = ts_meta_get_stats();
    cr_assert_eq(p.live % 4096, 0, "a pinned block is page-rounded");
    cr_assert_geq(p.live, 12000);
    cr_assert_eq(p.cached, 12288, "the pool block went back to the modeled cache");
    TH_OK(ts_storage_release(ts_tensor_storage(t)));
    cr_assert_eq(ts_meta_get_stats().live, 0);
    TH_OK(ts_storage_restore(ts_tensor_storage(t)));
    cr_assert_eq(ts_meta_get_stats().live, p.live);
    /* gradients */
    TH_OK(ts_tensor_set_requires_grad(t, true));
    TH_OK(ts_tensor_empty(TS_F32, 2, s, &g));
    TH_OK(ts_tensor_set_grad(t, g));
    ts_tensor_free(g);
    ts_tensor_zero_grad(t, false);
    TH_OK(ts_device_scope_exit());
    ts_tensor_zero_grad(t, false); /* outside: an initializer, nothing to write */
    ts_tensor_zero_grad(t, true);
    cr_assert_null(ts_tensor_grad(t));
    char str[32];
    cr_assert_str_eq(ts_tensor_shape_str(t, str, sizeof str), "(3, 1000)");
    /* a meta shard */
    ts_tensor_set_shard(t, NULL);
    TH_OK(ts_device_scope_enter(TS_DEVICE_META));
    cr_assert_eq(ts_neg(t, &y), TS_ERR_SHARDED, "inside a scope: refused as a shard, as on the CPU");
    TH_OK(ts_device_scope_exit());
    cr_assert_eq(ts_neg(t, &y), TS_ERR_STATE, "outside: no data");
    cr_assert_null(y);
    ts_tensor_free(t);
    cr_assert_eq(ts_meta_get_stats().live, 0);
}
