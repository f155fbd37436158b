/* Elementwise ops: binary ops with broadcasting, scalar variants, unary
 * math. Values against hand-computed numbers and libm, gradients against
 * finite differences, and the optimized f32 kernels against the reference
 * path (ts__use_reference_kernels). */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "tensor/internal.h"
#include "tests/helpers.h"

/* Gradchecks use TH_GC_EPS / TH_GC_ATOL / TH_GC_RTOL (helpers.h): a wrong
 * formula (a missing factor, a wrong sign, a gradient not reduced over
 * broadcast dims) is off by O(1), far outside them. */

static void assert_near(double got, double want, double tol, const char *what)
{
    cr_assert(fabs(got - want) <= tol || (isnan(got) && isnan(want)), "%s: got %.17g, expected %.17g (tol %g)", what,
              got, want, tol);
}

/* ------------------------------------------------------------ binary ops */

typedef ts_status (*binary_fn)(ts_tensor *, ts_tensor *, ts_tensor **);

typedef struct binop {
    const char *name;
    binary_fn fn;
    char sym;
} binop;

static const binop binops[] = {
    {"add", ts_add, '+'},
    {"sub", ts_sub, '-'},
    {"mul", ts_mul, '*'},
    {"div", ts_div, '/'},
};
#define N_BINOPS ((int)(sizeof binops / sizeof *binops))

static double apply(char sym, double x, double y)
{
    switch (sym) {
    case '+': return x + y;
    case '-': return x - y;
    case '*': return x * y;
    default: return x / y;
    }
}

Test(tensor_elementwise, broadcast_column_by_row)
{
    th_mem_mark();
    /* (3,1) op (1,4) -> (3,4): out[i][j] = a[i] op b[j] */
    int64_t sa[2] = {3, 1}, sb[2] = {1, 4}, so[2] = {3, 4};
    double av[3] = {1.0, -2.0, 0.5}, bv[4] = {2.0, 4.0, -0.25, 8.0};
    for (int dt = 0; dt < 2; dt++) {
        ts_dtype d = dt ? TS_F64 : TS_F32;
        ts_tensor *a = th_tensor(d, 2, sa, av), *b = th_tensor(d, 2, sb, bv);
        for (int k = 0; k < N_BINOPS; k++) {
            ts_tensor *o;
            TH_OK(binops[k].fn(a, b, &o));
            th_assert_shape(o, 2, so);
            cr_assert_eq(ts_tensor_dtype(o), d);
            double got[12];
            th_vals(o, got, 12);
            /* every operand here is exact in float32 and so is each result
             * (powers of two and small integers), so equality is exact */
            for (int i = 0; i < 3; i++)
                for (int j = 0; j < 4; j++)
                    cr_assert_eq(got[i * 4 + j], apply(binops[k].sym, av[i], bv[j]), "%s %s [%d][%d]: %g",
                                 ts_dtype_name(d), binops[k].name, i, j, got[i * 4 + j]);
            ts_tensor_free(o);
        }
        ts_tensor_free(a);
        ts_tensor_free(b);
    }
    th_mem_assert_back();
}

Test(tensor_elementwise, broadcast_trailing_vector_over_batch)
{
    th_mem_mark();
    /* (2,3,4) op (4): the vector repeats over the 6 rows */
    int64_t sa[3] = {2, 3, 4}, sb[1] = {4};
    ts_tensor *a = th_seq(TS_F64, 3, sa, 2.0, false);
    double bv[4] = {1.5, -3.0, 0.25, 7.0};
    ts_tensor *b = th_tensor(TS_F64, 1, sb, bv);
    double x[24];
    th_vals(a, x, 24);
    for (int k = 0; k < N_BINOPS; k++) {
        ts_tensor *o, *o2;
        TH_OK(binops[k].fn(a, b, &o));
        th_assert_shape(o, 3, sa);
        double got[24];
        th_vals(o, got, 24);
        for (int i = 0; i < 24; i++)
            cr_assert_eq(got[i], apply(binops[k].sym, x[i], bv[i % 4]), "%s element %d", binops[k].name, i);
        /* and the other way round: (4) op (2,3,4) */
        TH_OK(binops[k].fn(b, a, &o2));
        th_assert_shape(o2, 3, sa);
        th_vals(o2, got, 24);
        for (int i = 0; i < 24; i++)
            cr_assert_eq(got[i], apply(binops[k].sym, bv[i % 4], x[i]), "%s reversed element %d", binops[k].name, i);
        ts_tensor_free(o);
        ts_tensor_free(o2);
    }
    ts_tensor_free(a);
    ts_tensor_free(b);
    th_mem_assert_back();
}

Test(tensor_elementwise, zero_dim_scalar_operand)
{
    th_mem_mark();
    int64_t sa[2] = {2, 3};
    double av[6] = {1, 2, 3, 4, 5, 6};
    ts_tensor *a = th_tensor(TS_F32, 2, sa, av), *s, *t;
    TH_OK(ts_tensor_scalar(TS_F32, 4.0, &s));
    TH_OK(ts_tensor_scalar(TS_F32, -0.5, &t));
    for (int k = 0; k < N_BINOPS; k++) {
        ts_tensor *o, *o2, *o3;
        double got[6];
        TH_OK(binops[k].fn(a, s, &o));
        th_assert_shape(o, 2, sa);
        th_vals(o, got, 6);
        for (int i = 0; i < 6; i++)
            cr_assert_eq(got[i], apply(binops[k].sym, av[i], 4.0), "%s a op s [%d]", binops[k].name, i);
        TH_OK(binops[k].fn(s, a, &o2));
        th_assert_shape(o2, 2, sa);
        th_vals(o2, got, 6);
        for (int i = 0; i < 6; i++)
            cr_assert_eq(got[i], (double)(float)apply(binops[k].sym, 4.0, av[i]), "%s s op a [%d]", binops[k].name, i);
        /* 0-d op 0-d stays 0-d */
        TH_OK(binops[k].fn(s, t, &o3));
        cr_assert_eq(ts_tensor_ndim(o3), 0);
        double v;
        TH_OK(ts_tensor_item(o3, &v));
        cr_assert_eq(v, apply(binops[k].sym, 4.0, -0.5), "%s 0-d: %g", binops[k].name, v);
        ts_tensor_free(o);
        ts_tensor_free(o2);
        ts_tensor_free(o3);
    }
    ts_tensor_free(a);
    ts_tensor_free(s);
    ts_tensor_free(t);
    th_mem_assert_back();
}

Test(tensor_elementwise, transposed_inputs_match_contiguous_copies)
{
    th_mem_mark();
    /* a = base(4,3)^T is (3,4) with strides (1,3); b = (4,3)^T too, plus a
     * broadcast (3,1) column. Results must equal those of contiguous copies. */
    int64_t sbase[2] = {4, 3}, scol[2] = {3, 1};
    for (int dt = 0; dt < 2; dt++) {
        ts_dtype d = dt ? TS_F64 : TS_F32;
        ts_tensor *base = th_seq(d, 2, sbase, 1.5, false), *base2 = th_seq(d, 2, sbase, -0.75, false);
        ts_tensor *col = th_seq(d, 2, scol, 0.5, false);
        ts_tensor *at, *bt, *ac, *bc;
        TH_OK(ts_transpose(base, 0, 1, &at));
        TH_OK(ts_transpose(base2, 0, 1, &bt));
        cr_assert(!ts_tensor_is_contiguous(at));
        TH_OK(ts_contiguous(at, &ac));
        TH_OK(ts_contiguous(bt, &bc));
        cr_assert(ts_tensor_is_contiguous(ac));
        for (int k = 0; k < N_BINOPS; k++) {
            ts_tensor *o1, *o2, *o3, *o4;
            TH_OK(binops[k].fn(at, bt, &o1));
            TH_OK(binops[k].fn(ac, bc, &o2));
            /* the same arithmetic on the same values: bit-identical */
            th_assert_close(o1, o2, 0, 0);
            TH_OK(binops[k].fn(at, col, &o3));
            TH_OK(binops[k].fn(ac, col, &o4));
            th_assert_close(o3, o4, 0, 0);
            ts_tensor_free(o1);
            ts_tensor_free(o2);
            ts_tensor_free(o3);
            ts_tensor_free(o4);
        }
        /* and by hand: out[i][j] = base[j][i] + base2[j][i] */
        ts_tensor *s;
        TH_OK(ts_add(at, bt, &s));
        double x[12], y[12], got[12];
        th_vals(base, x, 12);
        th_vals(base2, y, 12);
        th_vals(s, got, 12);
        for (int i = 0; i < 3; i++)
            for (int j = 0; j < 4; j++)
                cr_assert_eq(got[i * 4 + j],
                             dt ? x[j * 3 + i] + y[j * 3 + i] : (double)(float)(x[j * 3 + i] + y[j * 3 + i]),
                             "[%d][%d]", i, j);
        ts_tensor_free(s);
        ts_tensor_free(base);
        ts_tensor_free(base2);
        ts_tensor_free(col);
        ts_tensor_free(at);
        ts_tensor_free(bt);
        ts_tensor_free(ac);
        ts_tensor_free(bc);
    }
    th_mem_assert_back();
}

Test(tensor_elementwise, incompatible_shapes_are_refused)
{
    th_mem_mark();
    int64_t sa[2] = {2, 3}, sb[2] = {3, 2};
    ts_tensor *a = th_seq(TS_F32, 2, sa, 1, false), *b = th_seq(TS_F32, 2, sb, 1, false), *o = NULL;
    for (int k = 0; k < N_BINOPS; k++) {
        cr_assert_eq(binops[k].fn(a, b, &o), TS_ERR_SHAPE, "%s", binops[k].name);
        cr_assert_null(o, "out written on failure");
        cr_assert(strstr(ts_last_error(), binops[k].name) != NULL, "%s", ts_last_error());
    }
    ts_tensor_free(a);
    ts_tensor_free(b);
    th_mem_assert_back();
}

Test(tensor_elementwise, scalar_variants)
{
    th_mem_mark();
    int64_t s[1] = {4};
    double xv[4] = {-2.0, 0.5, 3.0, 10.0};
    ts_tensor *x = th_tensor(TS_F64, 1, s, xv), *o;
    double got[4];
    TH_OK(ts_add_scalar(x, 1.25, &o));
    th_vals(o, got, 4);
    for (int i = 0; i < 4; i++) cr_assert_eq(got[i], xv[i] + 1.25, "add_scalar [%d]", i);
    ts_tensor_free(o);
    TH_OK(ts_sub_scalar(x, 1.25, &o));
    th_vals(o, got, 4);
    for (int i = 0; i < 4; i++) cr_assert_eq(got[i], xv[i] - 1.25, "sub_scalar [%d]", i);
    ts_tensor_free(o);
    TH_OK(ts_rsub_scalar(x, 1.25, &o));
    th_vals(o, got, 4);
    for (int i = 0; i < 4; i++) cr_assert_eq(got[i], 1.25 - xv[i], "rsub_scalar [%d]", i);
    ts_tensor_free(o);
    TH_OK(ts_mul_scalar(x, -3.0, &o));
    th_vals(o, got, 4);
    for (int i = 0; i < 4; i++) cr_assert_eq(got[i], xv[i] * -3.0, "mul_scalar [%d]", i);
    ts_tensor_free(o);
    TH_OK(ts_div_scalar(x, 4.0, &o));
    th_vals(o, got, 4);
    for (int i = 0; i < 4; i++) cr_assert_eq(got[i], xv[i] / 4.0, "div_scalar [%d]", i);
    ts_tensor_free(o);
    /* scalar results keep the input dtype */
    ts_tensor *xf = th_tensor(TS_F32, 1, s, xv);
    TH_OK(ts_mul_scalar(xf, 0.5, &o));
    cr_assert_eq(ts_tensor_dtype(o), TS_F32);
    th_vals(o, got, 4);
    for (int i = 0; i < 4; i++) cr_assert_eq(got[i], xv[i] * 0.5, "f32 mul_scalar [%d]", i);
    ts_tensor_free(o);
    ts_tensor_free(xf);
    ts_tensor_free(x);
    th_mem_assert_back();
}

/* ------------------------------------------------------------ unary ops */

typedef ts_status (*unary_fn)(ts_tensor *, ts_tensor **);

static ts_status gelu_erf(ts_tensor *a, ts_tensor **o) { return ts_gelu(a, TS_GELU_NONE, o); }
static ts_status gelu_tanh(ts_tensor *a, ts_tensor **o) { return ts_gelu(a, TS_GELU_TANH, o); }
static ts_status add_s(ts_tensor *a, ts_tensor **o) { return ts_add_scalar(a, 1.5, o); }
static ts_status sub_s(ts_tensor *a, ts_tensor **o) { return ts_sub_scalar(a, 0.75, o); }
static ts_status rsub_s(ts_tensor *a, ts_tensor **o) { return ts_rsub_scalar(a, 2.0, o); }
static ts_status mul_s(ts_tensor *a, ts_tensor **o) { return ts_mul_scalar(a, -2.5, o); }
static ts_status div_s(ts_tensor *a, ts_tensor **o) { return ts_div_scalar(a, 4.0, o); }
static ts_status pow2(ts_tensor *a, ts_tensor **o) { return ts_pow_scalar(a, 2.0, o); }
static ts_status pow3(ts_tensor *a, ts_tensor **o) { return ts_pow_scalar(a, 3.0, o); }
static ts_status pow_half(ts_tensor *a, ts_tensor **o) { return ts_pow_scalar(a, 0.5, o); }
static ts_status pow_m15(ts_tensor *a, ts_tensor **o) { return ts_pow_scalar(a, -1.5, o); }
static ts_status pow0(ts_tensor *a, ts_tensor **o) { return ts_pow_scalar(a, 0.0, o); }

static double r_neg(double x) { return -x; }
static double r_rsqrt(double x) { return 1.0 / sqrt(x); }
static double r_sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }
static double r_relu(double x) { return x > 0 ? x : 0.0; }
static double r_gelu(double x) { return 0.5 * x * (1.0 + erf(x / sqrt(2.0))); }
static double r_gelu_tanh(double x) { return 0.5 * x * (1.0 + tanh(sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x))); }
static double r_add_s(double x) { return x + 1.5; }
static double r_sub_s(double x) { return x - 0.75; }
static double r_rsub_s(double x) { return 2.0 - x; }
static double r_mul_s(double x) { return x * -2.5; }
static double r_div_s(double x) { return x / 4.0; }
static double r_pow2(double x) { return x * x; }
static double r_pow3(double x) { return pow(x, 3.0); }
static double r_pow_half(double x) { return pow(x, 0.5); }
static double r_pow_m15(double x) { return pow(x, -1.5); }
static double r_pow0(double x) { return pow(x, 0.0); }

typedef struct unary_case {
    const char *name;
    unary_fn fn;
    double (*ref)(double);
    bool positive; /* domain needs x > 0 */
} unary_case;

static const unary_case unary_cases[] = {
    {"neg", ts_neg, r_neg, false},
    {"exp", ts_exp, exp, false},
    {"log", ts_log, log, true},
    {"sqrt", ts_sqrt, sqrt, true},
    {"rsqrt", ts_rsqrt, r_rsqrt, true},
    {"tanh", ts_tanh, tanh, false},
    {"sigmoid", ts_sigmoid, r_sigmoid, false},
    {"relu", ts_relu, r_relu, false},
    {"abs", ts_abs, fabs, false},
    {"gelu", gelu_erf, r_gelu, false},
    {"gelu_tanh", gelu_tanh, r_gelu_tanh, false},
    {"add_scalar", add_s, r_add_s, false},
    {"sub_scalar", sub_s, r_sub_s, false},
    {"rsub_scalar", rsub_s, r_rsub_s, false},
    {"mul_scalar", mul_s, r_mul_s, false},
    {"div_scalar", div_s, r_div_s, false},
    {"pow_scalar(2)", pow2, r_pow2, false},
    {"pow_scalar(3)", pow3, r_pow3, false},
    {"pow_scalar(0.5)", pow_half, r_pow_half, true},
    {"pow_scalar(-1.5)", pow_m15, r_pow_m15, true},
    {"pow_scalar(0)", pow0, r_pow0, false},
};
#define N_UNARY ((int)(sizeof unary_cases / sizeof *unary_cases))

/* Inputs for a case: about [-3, 3], or [0.2, 3.2] where the domain needs
 * positive values; none is within 1e-3 of 0 (relu's kink). */
static ts_tensor *unary_input(const unary_case *c, ts_dtype d, int ndim, const int64_t *shape, bool rg)
{
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= shape[i];
    double v[64];
    cr_assert(n <= 64);
    for (int64_t i = 0; i < n; i++) {
        double s = 3.0 * sin(0.9 * (double)i + 0.4);
        if (fabs(s) < 1e-3) s = 0.5;
        v[i] = c->positive ? 0.2 + fabs(s) : s;
    }
    ts_tensor *t = th_tensor(d, ndim, shape, v);
    if (rg) TH_OK(ts_tensor_set_requires_grad(t, true));
    return t;
}

Test(tensor_elementwise, unary_values_match_libm)
{
    th_mem_mark();
    int64_t s[2] = {3, 5};
    for (int k = 0; k < N_UNARY; k++) {
        const unary_case *c = &unary_cases[k];
        for (int dt = 0; dt < 2; dt++) {
            ts_dtype d = dt ? TS_F64 : TS_F32;
            ts_tensor *x = unary_input(c, d, 2, s, false), *o;
            TH_OK(c->fn(x, &o));
            th_assert_shape(o, 2, s);
            cr_assert_eq(ts_tensor_dtype(o), d, "%s keeps the dtype", c->name);
            double xv[15], got[15];
            th_vals(x, xv, 15);
            th_vals(o, got, 15);
            for (int i = 0; i < 15; i++) {
                double want = c->ref(xv[i]);
                /* float64: the same libm formula up to association, so a
                 * few ulp (1e-14 relative). float32: the kernels compute in
                 * float (expf, erff, ...), each step within an ulp of
                 * 6e-8 relative; a handful of steps plus the cancellation in
                 * 1 + erf(x) for x near -3 (absolute error ~1e-7 on values
                 * ~4e-3) stay below 2e-6 relative + 1e-6 absolute. */
                double tol = dt ? 1e-14 * fabs(want) + 1e-15 : 2e-6 * fabs(want) + 1e-6;
                char what[64];
                snprintf(what, sizeof what, "%s %s [%d] (x = %g)", c->name, ts_dtype_name(d), i, xv[i]);
                assert_near(got[i], want, tol, what);
            }
            ts_tensor_free(x);
            ts_tensor_free(o);
        }
    }
    th_mem_assert_back();
}

Test(tensor_elementwise, unary_hand_computed_values)
{
    th_mem_mark();
    /* numbers from a calculator / tables, independent of the formulas above */
    struct {
        unary_fn fn;
        double x, want;
        const char *name;
    } cases[] = {
        {ts_exp, 1.0, 2.718281828459045, "exp(1)"},
        {ts_log, 2.718281828459045, 1.0, "log(e)"},
        {ts_sqrt, 2.0, 1.4142135623730951, "sqrt(2)"},
        {ts_rsqrt, 4.0, 0.5, "rsqrt(4)"},
        {ts_tanh, 0.5, 0.46211715726000974, "tanh(0.5)"},
        {ts_sigmoid, 0.0, 0.5, "sigmoid(0)"},
        {ts_sigmoid, 2.0, 0.8807970779778823, "sigmoid(2)"},
        {ts_relu, -1.0, 0.0, "relu(-1)"},
        {ts_relu, 0.0, 0.0, "relu(0)"},
        {ts_relu, 2.5, 2.5, "relu(2.5)"},
        {ts_abs, -2.5, 2.5, "abs(-2.5)"},
        {ts_abs, 0.75, 0.75, "abs(0.75)"},
        {ts_abs, 0.0, 0.0, "abs(0)"},
        {ts_neg, 0.0, -0.0, "neg(0)"},
        {gelu_erf, 1.0, 0.8413447460685429, "gelu(1)"},
        {gelu_erf, -1.0, -0.15865525393145707, "gelu(-1)"},
        {gelu_tanh, 1.0, 0.8411919906082768, "gelu_tanh(1)"},
        {gelu_tanh, -1.0, -0.15880800939172324, "gelu_tanh(-1)"},
        {pow3, 2.0, 8.0, "2^3"},
        {pow_half, 4.0, 2.0, "4^0.5"},
        {pow_m15, 4.0, 0.125, "4^-1.5"},
        {pow0, 0.0, 1.0, "0^0"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        for (int dt = 0; dt < 2; dt++) {
            ts_tensor *x, *o;
            TH_OK(ts_tensor_scalar(dt ? TS_F64 : TS_F32, cases[k].x, &x));
            TH_OK(cases[k].fn(x, &o));
            cr_assert_eq(ts_tensor_ndim(o), 0);
            double v;
            TH_OK(ts_tensor_item(o, &v));
            /* float32 inputs like e are rounded (rel 6e-8), so 1e-6 there */
            assert_near(v, cases[k].want, dt ? 1e-15 : 1e-6, cases[k].name);
            ts_tensor_free(x);
            ts_tensor_free(o);
        }
    }
    th_mem_assert_back();
}

Test(tensor_elementwise, special_values)
{
    th_mem_mark();
    int64_t s[1] = {4};
    double xv[4] = {NAN, INFINITY, -INFINITY, -0.0};
    ts_tensor *x = th_tensor(TS_F32, 1, s, xv), *o;
    double got[4];
    /* relu keeps NaN (as PyTorch does), clamps -inf */
    TH_OK(ts_relu(x, &o));
    th_vals(o, got, 4);
    cr_assert(isnan(got[0]));
    cr_assert_eq(got[1], INFINITY);
    cr_assert_eq(got[2], 0.0);
    ts_tensor_free(o);
    /* sigmoid saturates to exactly 0 and 1 without NaN */
    TH_OK(ts_sigmoid(x, &o));
    th_vals(o, got, 4);
    cr_assert(isnan(got[0]));
    cr_assert_eq(got[1], 1.0);
    cr_assert_eq(got[2], 0.0);
    cr_assert_eq(got[3], 0.5);
    ts_tensor_free(o);
    /* log of a negative number is NaN, of zero -inf */
    double yv[2] = {-1.0, 0.0};
    int64_t s2[1] = {2};
    ts_tensor *y = th_tensor(TS_F64, 1, s2, yv);
    TH_OK(ts_log(y, &o));
    th_vals(o, got, 2);
    cr_assert(isnan(got[0]));
    cr_assert_eq(got[1], -INFINITY);
    ts_tensor_free(o);
    ts_tensor_free(y);
    ts_tensor_free(x);
    th_mem_assert_back();
}

/* abs at NaN, infinities and -0.0, values and gradients, as torch 1.13
 * prints them: abs([nan, inf, -inf, -0.0]) = [nan, inf, inf, 0.0] and the
 * gradient of sum() is [0, 1, -1, 0] (sgn(nan) = 0 there). */
Test(tensor_elementwise, abs_special_values_and_gradients)
{
    th_mem_mark();
    int64_t s[1] = {4};
    double xv[4] = {NAN, INFINITY, -INFINITY, -0.0};
    for (int dt = 0; dt < 2; dt++) {
        ts_tensor *x = th_tensor(dt ? TS_F64 : TS_F32, 1, s, xv), *o, *sum;
        TH_OK(ts_tensor_set_requires_grad(x, true));
        TH_OK(ts_abs(x, &o));
        double got[4], g[4];
        th_vals(o, got, 4);
        cr_assert(isnan(got[0]));
        cr_assert_eq(got[1], INFINITY);
        cr_assert_eq(got[2], INFINITY);
        cr_assert(got[3] == 0.0 && !signbit(got[3]), "abs(-0.0) is +0.0");
        TH_OK(ts_sum(o, 0, NULL, false, &sum));
        TH_OK(ts_backward(sum, NULL, false));
        th_vals(ts_tensor_grad(x), g, 4);
        cr_assert(g[0] == 0.0 && g[1] == 1.0 && g[2] == -1.0 && g[3] == 0.0, "abs' = [%g, %g, %g, %g]", g[0], g[1],
                  g[2], g[3]);
        ts_tensor_free(sum);
        ts_tensor_free(o);
        ts_tensor_free(x);
    }
    th_mem_assert_back();
}

Test(tensor_elementwise, unary_ops_refuse_integer_dtypes)
{
    th_mem_mark();
    int64_t s[1] = {3};
    double v[3] = {1, 2, 3};
    ts_tensor *x = th_tensor(TS_I64, 1, s, v), *o = NULL;
    for (int k = 0; k < N_UNARY; k++) {
        cr_assert_eq(unary_cases[k].fn(x, &o), TS_ERR_DTYPE, "%s", unary_cases[k].name);
        cr_assert_null(o);
        cr_assert(strstr(ts_last_error(), "int64") != NULL, "%s", ts_last_error());
    }
    ts_tensor_free(x);
    th_mem_assert_back();
}

Test(tensor_elementwise, unary_on_non_contiguous_input)
{
    th_mem_mark();
    int64_t s[2] = {4, 3};
    for (int k = 0; k < N_UNARY; k++) {
        ts_tensor *x = unary_input(&unary_cases[k], TS_F32, 2, s, false), *xt, *xc, *o1, *o2;
        TH_OK(ts_transpose(x, 0, 1, &xt));
        TH_OK(ts_contiguous(xt, &xc));
        TH_OK(unary_cases[k].fn(xt, &o1));
        TH_OK(unary_cases[k].fn(xc, &o2));
        /* the strided input takes the reference path (through double), the
         * contiguous one the float kernel: within the float32 tolerance of
         * unary_values_match_libm */
        th_assert_close(o1, o2, 2e-6, 1e-6);
        ts_tensor_free(x);
        ts_tensor_free(xt);
        ts_tensor_free(xc);
        ts_tensor_free(o1);
        ts_tensor_free(o2);
    }
    th_mem_assert_back();
}

/* ------------------------------------------------------------ gradients */

typedef struct bin_ctx {
    binary_fn fn;
    bool transpose_a; /* use a^T (a is stored (n, m)) */
} bin_ctx;

static ts_status gc_binary(ts_tensor **in, ts_tensor **out, void *ctx)
{
    const bin_ctx *c = ctx;
    if (!c->transpose_a) return c->fn(in[0], in[1], out);
    ts_tensor *at;
    ts_status st = ts_transpose(in[0], 0, 1, &at);
    if (st) return st;
    st = c->fn(at, in[1], out);
    ts_tensor_free(at);
    return st;
}

/* A second operand kept away from 0 so that div is smooth. */
static ts_tensor *away_from_zero(ts_dtype d, int ndim, const int64_t *shape, bool rg)
{
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= shape[i];
    double v[64];
    cr_assert(n <= 64);
    for (int64_t i = 0; i < n; i++) v[i] = (i % 2 ? -1.0 : 1.0) * (0.75 + 0.3 * (double)(i % 5));
    ts_tensor *t = th_tensor(d, ndim, shape, v);
    if (rg) TH_OK(ts_tensor_set_requires_grad(t, true));
    return t;
}

Test(tensor_elementwise, binary_gradcheck_with_broadcasting)
{
    th_mem_mark();
    struct {
        int na, nb;
        int64_t sa[3], sb[3];
        bool transpose_a;
    } geo[] = {
        {2, 2, {3, 1}, {1, 4}, false}, /* both broadcast */
        {3, 1, {2, 3, 4}, {4}, false}, /* trailing vector */
        {1, 3, {4}, {2, 3, 4}, false}, /* vector first */
        {2, 0, {2, 3}, {0}, false},    /* 0-d second operand */
        {0, 2, {0}, {2, 3}, false},    /* 0-d first operand */
        {2, 2, {4, 3}, {3, 4}, true},  /* a^T: non-contiguous */
        {2, 2, {4, 3}, {3, 1}, true},  /* a^T with a broadcast column */
        {2, 2, {3, 4}, {3, 4}, false}, /* same shape */
    };
    for (size_t gi = 0; gi < sizeof geo / sizeof *geo; gi++) {
        for (int k = 0; k < N_BINOPS; k++) {
            ts_tensor *in[2];
            in[0] = th_seq(TS_F64, geo[gi].na, geo[gi].sa, 1.3, true);
            in[1] = away_from_zero(TS_F64, geo[gi].nb, geo[gi].sb, true);
            bin_ctx c = {binops[k].fn, geo[gi].transpose_a};
            th_gradcheck(gc_binary, 2, in, &c, TH_GC_EPS, TH_GC_ATOL, TH_GC_RTOL);
            /* the gradients have the shapes of the inputs */
            for (int j = 0; j < 2; j++) {
                cr_assert_not_null(ts_tensor_grad(in[j]), "geometry %zu %s: no grad for input %d", gi, binops[k].name,
                                   j);
                th_assert_shape(ts_tensor_grad(in[j]), ts_tensor_ndim(in[j]), ts_tensor_shape(in[j]));
            }
            ts_tensor_free(in[0]);
            ts_tensor_free(in[1]);
        }
    }
    th_mem_assert_back();
}

Test(tensor_elementwise, binary_gradcheck_one_input_requires_grad)
{
    th_mem_mark();
    int64_t sa[2] = {3, 1}, sb[2] = {1, 4};
    for (int k = 0; k < N_BINOPS; k++) {
        for (int which = 0; which < 2; which++) {
            ts_tensor *in[2];
            in[0] = th_seq(TS_F64, 2, sa, 1.1, which == 0);
            in[1] = away_from_zero(TS_F64, 2, sb, which == 1);
            bin_ctx c = {binops[k].fn, false};
            th_gradcheck(gc_binary, 2, in, &c, TH_GC_EPS, TH_GC_ATOL, TH_GC_RTOL);
            cr_assert_null(ts_tensor_grad(in[1 - which]), "%s: grad for an input that does not require it",
                           binops[k].name);
            ts_tensor_free(in[0]);
            ts_tensor_free(in[1]);
        }
    }
    th_mem_assert_back();
}

Test(tensor_elementwise, binary_gradcheck_eight_dims)
{
    th_mem_mark();
    /* 8-d operands fill the whole node layout for both shapes */
    int64_t sa[8] = {1, 2, 1, 1, 1, 1, 1, 3}, sb[8] = {2, 1, 1, 1, 1, 1, 2, 1};
    for (int k = 0; k < N_BINOPS; k++) {
        ts_tensor *in[2];
        in[0] = th_seq(TS_F64, 8, sa, 1.2, true);
        in[1] = away_from_zero(TS_F64, 8, sb, true);
        bin_ctx c = {binops[k].fn, false};
        th_gradcheck(gc_binary, 2, in, &c, TH_GC_EPS, TH_GC_ATOL, TH_GC_RTOL);
        th_assert_shape(ts_tensor_grad(in[0]), 8, sa);
        th_assert_shape(ts_tensor_grad(in[1]), 8, sb);
        ts_tensor_free(in[0]);
        ts_tensor_free(in[1]);
    }
    th_mem_assert_back();
}

static ts_status gc_permuted_eight_dims(ts_tensor **in, ts_tensor **out, void *ctx)
{
    /* a with its 8 dims reversed (a non-contiguous view) times b */
    (void)ctx;
    int rev[8] = {7, 6, 5, 4, 3, 2, 1, 0};
    ts_tensor *ap;
    ts_status st = ts_permute(in[0], rev, &ap);
    if (st) return st;
    st = ts_mul(ap, in[1], out);
    ts_tensor_free(ap);
    return st;
}

Test(tensor_elementwise, gradcheck_through_eight_dim_permute)
{
    th_mem_mark();
    int64_t sa[8] = {3, 1, 1, 1, 1, 1, 2, 1}, sb[8] = {1, 2, 1, 1, 1, 1, 1, 3};
    ts_tensor *in[2] = {th_seq(TS_F64, 8, sa, 1.0, true), away_from_zero(TS_F64, 8, sb, true)};
    th_gradcheck(gc_permuted_eight_dims, 2, in, NULL, TH_GC_EPS, TH_GC_ATOL, TH_GC_RTOL);
    th_assert_shape(ts_tensor_grad(in[0]), 8, sa);
    ts_tensor_free(in[0]);
    ts_tensor_free(in[1]);
    th_mem_assert_back();
}

static ts_status gc_unary(ts_tensor **in, ts_tensor **out, void *ctx)
{
    const unary_case *c = ctx;
    return c->fn(in[0], out);
}

Test(tensor_elementwise, unary_gradcheck_every_op)
{
    th_mem_mark();
    int64_t s[2] = {3, 4};
    for (int k = 0; k < N_UNARY; k++) {
        ts_tensor *in[1] = {unary_input(&unary_cases[k], TS_F64, 2, s, true)};
        th_gradcheck(gc_unary, 1, in, (void *)&unary_cases[k], TH_GC_EPS, TH_GC_ATOL, TH_GC_RTOL);
        ts_tensor *g = ts_tensor_grad(in[0]);
        cr_assert_not_null(g, "%s: no gradient", unary_cases[k].name);
        th_assert_shape(g, 2, s);
        ts_tensor_free(in[0]);
    }
    th_mem_assert_back();
}

Test(tensor_elementwise, unary_gradient_hand_values)
{
    th_mem_mark();
    /* d/dx at one point, by hand */
    struct {
        unary_fn fn;
        double x, dx;
        const char *name;
    } cases[] = {
        {ts_exp, 0.0, 1.0, "exp'(0)"},     {ts_log, 4.0, 0.25, "log'(4)"},
        {ts_sqrt, 4.0, 0.25, "sqrt'(4)"},  {ts_rsqrt, 4.0, -0.0625, "rsqrt'(4)"},
        {ts_tanh, 0.0, 1.0, "tanh'(0)"},   {ts_sigmoid, 0.0, 0.25, "sigmoid'(0)"},
        {ts_relu, -2.0, 0.0, "relu'(-2)"}, {ts_relu, 2.0, 1.0, "relu'(2)"},
        {ts_relu, 0.0, 0.0, "relu'(0)"},   {ts_abs, -2.0, -1.0, "abs'(-2)"},
        {ts_abs, 3.0, 1.0, "abs'(3)"},     {ts_abs, 0.0, 0.0, "abs'(0)"}, /* torch: grad * sgn(0) = 0 */
        {gelu_erf, 0.0, 0.5, "gelu'(0)"},  {gelu_tanh, 0.0, 0.5, "gelu_tanh'(0)"},
        {pow3, 2.0, 12.0, "(x^3)'(2)"},    {pow0, 2.0, 0.0, "(x^0)'(2)"},
        {rsub_s, 1.0, -1.0, "(2-x)'"},     {div_s, 1.0, 0.25, "(x/4)'"},
        {ts_neg, 1.0, -1.0, "(-x)'"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        for (int dt = 0; dt < 2; dt++) {
            ts_tensor *x, *o;
            TH_OK(ts_tensor_scalar(dt ? TS_F64 : TS_F32, cases[k].x, &x));
            TH_OK(ts_tensor_set_requires_grad(x, true));
            TH_OK(cases[k].fn(x, &o));
            TH_OK(ts_backward(o, NULL, false));
            double g;
            cr_assert_not_null(ts_tensor_grad(x), "%s", cases[k].name);
            TH_OK(ts_tensor_item(ts_tensor_grad(x), &g));
            assert_near(g, cases[k].dx, dt ? 1e-15 : 1e-7, cases[k].name);
            ts_tensor_free(x);
            ts_tensor_free(o);
        }
    }
    th_mem_assert_back();
}

/* ------------------------------------------------------------ random views */

/* A view of logical shape `shape`: transposed storage, a step-2 slice, an
 * expanded size-1 dim, or plain. */
static ts_tensor *random_view(ts_dtype d, int nd, const int64_t *shape, uint32_t *st)
{
    int kind = nd ? (int)(th_lcg(st) % 4) : 0;
    int64_t sh[TS_MAX_DIMS];
    memcpy(sh, shape, (size_t)nd * sizeof *sh);
    ts_tensor *base, *v;
    int dim = nd ? (int)(th_lcg(st) % (uint32_t)nd) : 0;
    if (kind == 1 && nd >= 2) {
        int64_t t = sh[0];
        sh[0] = sh[nd - 1];
        sh[nd - 1] = t;
        base = th_seq(d, nd, sh, 2.0, false);
        TH_OK(ts_transpose(base, 0, nd - 1, &v));
    } else if (kind == 2) {
        sh[dim] = 2 * shape[dim];
        base = th_seq(d, nd, sh, 2.0, false);
        TH_OK(ts_slice(base, dim, 0, sh[dim], 2, &v));
    } else if (kind == 3 && shape[dim] > 1) {
        sh[dim] = 1;
        base = th_seq(d, nd, sh, 2.0, false);
        TH_OK(ts_expand(base, nd, shape, &v));
    } else {
        base = th_seq(d, nd, sh, 2.0, false);
        v = ts_tensor_retain(base);
    }
    ts_tensor_free(base);
    return v;
}

Test(tensor_elementwise, random_views_match_contiguous_copies)
{
    th_mem_mark();
    uint32_t st = 777;
    for (int it = 0; it < 400; it++) {
        int nd = (int)(th_lcg(&st) % 5), na = nd, nb = (int)(th_lcg(&st) % (uint32_t)(nd + 1));
        int64_t out[4], sa[4], sb[4];
        for (int i = 0; i < nd; i++) out[i] = 1 + th_lcg(&st) % 4;
        for (int i = 0; i < na; i++) sa[i] = th_lcg(&st) % 4 ? out[i] : 1;
        for (int i = 0; i < nb; i++) sb[i] = th_lcg(&st) % 4 ? out[nd - nb + i] : 1;
        ts_dtype d = it % 2 ? TS_F64 : TS_F32;
        if (it % 3 == 0) { /* swap which operand has fewer dims */
            int64_t t[4];
            memcpy(t, sa, sizeof t);
            memcpy(sa, sb, sizeof t);
            memcpy(sb, t, sizeof t);
            int tn = na;
            na = nb;
            nb = tn;
        }
        ts_tensor *a = random_view(d, na, sa, &st), *b = random_view(d, nb, sb, &st), *ac, *bc;
        TH_OK(ts_contiguous(a, &ac));
        TH_OK(ts_contiguous(b, &bc));
        const binop *op = &binops[it % N_BINOPS];
        ts_tensor *o1, *o2;
        if (op->sym == '/') { /* keep the divisor away from 0: 2 + b*b */
            ts_tensor *b2, *bb, *bbc;
            TH_OK(ts_mul(b, b, &b2));
            TH_OK(ts_add_scalar(b2, 2.0, &bb));
            TH_OK(ts_contiguous(bb, &bbc));
            TH_OK(op->fn(a, bb, &o1));
            TH_OK(op->fn(ac, bbc, &o2));
            ts_tensor_free(b2);
            ts_tensor_free(bb);
            ts_tensor_free(bbc);
        } else {
            TH_OK(op->fn(a, b, &o1));
            TH_OK(op->fn(ac, bc, &o2));
        }
        /* one IEEE operation per element on the same values: bit-identical */
        th_assert_close(o1, o2, 0, 0);
        /* and a unary op on the strided view against the copy (the strided
         * f32 input takes the reference path: see unary_values_match_libm) */
        const unary_case *u = &unary_cases[it % N_UNARY];
        if (!u->positive) {
            ts_tensor *u1, *u2;
            TH_OK(u->fn(a, &u1));
            TH_OK(u->fn(ac, &u2));
            th_assert_close(u1, u2, 2e-6, 1e-6);
            ts_tensor_free(u1);
            ts_tensor_free(u2);
        }
        ts_tensor_free(o1);
        ts_tensor_free(o2);
        ts_tensor_free(a);
        ts_tensor_free(b);
        ts_tensor_free(ac);
        ts_tensor_free(bc);
    }
    th_mem_assert_back();
}

/* ------------------------------------------------- optimized vs reference */

Test(tensor_elementwise, binary_optimized_matches_reference)
{
    th_mem_mark();
    /* geometries chosen to hit each inner loop of the float kernel: both
     * unit-stride, broadcast b, broadcast a, strided (a^T), and outer
     * broadcasting */
    struct {
        int na, nb;
        int64_t sa[3], sb[3];
        bool transpose_a;
    } geo[] = {
        {2, 2, {5, 7}, {5, 7}, false}, {2, 2, {5, 7}, {5, 1}, false}, {2, 2, {5, 1}, {5, 7}, false},
        {2, 2, {7, 5}, {5, 7}, true},  {3, 1, {2, 3, 4}, {4}, false}, {0, 1, {0}, {6}, false},
        {2, 2, {3, 1}, {1, 4}, false},
    };
    for (size_t gi = 0; gi < sizeof geo / sizeof *geo; gi++) {
        for (int k = 0; k < N_BINOPS; k++) {
            ts_tensor *a = th_seq(TS_F32, geo[gi].na, geo[gi].sa, 2.0, false);
            ts_tensor *b = away_from_zero(TS_F32, geo[gi].nb, geo[gi].sb, false);
            bin_ctx c = {binops[k].fn, geo[gi].transpose_a};
            ts_tensor *in[2] = {a, b};
            /* forward: one IEEE operation per element; computing it in
             * double and rounding to float gives the correctly rounded
             * float result (53 >= 2 * 24 + 2 bits), which is what the float
             * kernel computes: bit-identical (0, 0).
             * backward: the reductions over broadcast dims accumulate in
             * double on both paths; div's db = -g/b * out is two float
             * roundings on one side and one on the other: 2 ulp (1.2e-7),
             * so 2.5e-7 relative + 1e-7 absolute */
            th_assert_kernels_agree(gc_binary, 2, in, &c, 0.8, 0, 0, 2.5e-7, 1e-7);
            ts_tensor_free(a);
            ts_tensor_free(b);
        }
    }
    th_mem_assert_back();
}

Test(tensor_elementwise, unary_optimized_matches_reference)
{
    th_mem_mark();
    int64_t s[3] = {2, 3, 5};
    for (int k = 0; k < N_UNARY; k++) {
        const unary_case *c = &unary_cases[k];
        ts_tensor *x0 = unary_input(c, TS_F32, 3, s, false);
        /* float kernels (expf, erff, tanhf, powf: within 1 ulp) against
         * double libm rounded once; compound formulas (sigmoid, gelu and
         * their derivatives) add a few float roundings, and 1 + erf / 1 - t*t
         * cancel for |x| near 3 (absolute error ~1e-7): 2e-6 relative (about
         * 16 ulp) plus 1e-6 absolute, for values and gradients */
        th_assert_kernels_agree(gc_unary, 1, &x0, (void *)c, 0.8, 2e-6, 1e-6, 2e-6, 1e-6);
        ts_tensor_free(x0);
    }
    th_mem_assert_back();
}

Test(tensor_elementwise, exact_ops_are_bit_identical_across_paths)
{
    th_mem_mark();
    /* neg, sqrt and the scalar ops with float-exact scalars are single IEEE
     * operations: both paths must give the same bits */
    const char *exact[] = {"neg",         "sqrt",       "add_scalar", "sub_scalar",
                           "rsub_scalar", "mul_scalar", "div_scalar", "pow_scalar(2)"};
    int64_t s[1] = {40};
    for (int k = 0; k < N_UNARY; k++) {
        bool is_exact = false;
        for (size_t e = 0; e < sizeof exact / sizeof *exact; e++)
            is_exact |= strcmp(unary_cases[k].name, exact[e]) == 0;
        if (!is_exact) continue;
        ts_tensor *x = unary_input(&unary_cases[k], TS_F32, 1, s, false), *o1, *o2;
        TH_OK(unary_cases[k].fn(x, &o1));
        ts__use_reference_kernels = true;
        TH_OK(unary_cases[k].fn(x, &o2));
        ts__use_reference_kernels = false;
        th_assert_close(o1, o2, 0, 0);
        ts_tensor_free(x);
        ts_tensor_free(o1);
        ts_tensor_free(o2);
    }
    th_mem_assert_back();
}
