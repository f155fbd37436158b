/* The nn ops in bfloat16 and float16, forward and backward: layer_norm,
 * softmax, log_softmax, embedding, cross_entropy, dropout and the fused
 * attention. Each is checked two ways:
 *
 *   - against its float32 run on the same values, rounded to the 16-bit
 *     dtype (the ops accumulate in float32 and round once, so most of them
 *     agree bit for bit; see each check);
 *   - in bfloat16 (and float16 for embedding, the only one of these ops
 *     torch 1.13 has on the CPU in float16) against torch 1.13's CPU
 *     results, tests/fixtures/half/nn/ops.bin, written by
 *     tools/reference/make_half_nn.py (its docstring has the exact calls).
 *
 * The inputs are the fixture's (bfloat16 values, converted exactly to
 * float32, and to float16: randn values of magnitude < 5 fit float16's
 * 11-bit mantissa and range exactly).
 *
 * Tolerances: elements are held to
 *
 *     |got - ref| <= ulps * ulp(ref) + ulps * ulp(max|ref|) / 4
 *
 * with ulp() that of the 16-bit dtype at that magnitude (2^-7 relative for
 * bfloat16, 2^-10 for float16, at the bottom of a binade). An op that
 * rounds once from the same float32 value gives the same bits (ulps 0); a
 * different rounding order of float32 intermediates can move a result
 * across a rounding boundary, i.e. by one ulp (ulps 1); an op chain that
 * rounds intermediates to 16 bits (torch rounds after every op of the
 * attention and of log_softmax's steps) carries their error, a few ulps of
 * the tensor's scale. The second term is the scale floor of
 * tests/nn/test_parity.c: a gradient element that cancels to near zero
 * carries the absolute error of its terms, not a relative one. Each limit
 * below states what was measured (TS_HALF_VERBOSE=1 prints it). */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/helpers.h"

/* ------------------------------------------------------------ fixtures */

/* The fixtures are loaded by th_half_fx_open() of tests/helpers.c. */

/* ------------------------------------------------------------ checks */

static ts_tensor *to(ts_tensor *t, ts_dtype dt)
{
    ts_tensor *o;
    bool prev = ts_grad_mode_set(false);
    TH_OK(ts_to_dtype(t, dt, &o));
    ts_grad_mode_set(prev);
    return o;
}

/* The spacing of the 16-bit dtype dt's values at magnitude a (its
 * subnormal spacing below the normal range). */
static double ulp_at(ts_dtype dt, double a)
{
    int mant = dt == TS_BF16 ? 7 : 10, emin = dt == TS_BF16 ? -126 : -14;
    int e = a > 0 ? (int)floor(log2(a)) : emin;
    if (e < emin) e = emin;
    return ldexp(1.0, e - mant);
}

/* Asserts `got` (dtype dt) equals `ref` (dt, or float32 values that are
 * rounded to dt first) within `ulps` (see the top of the file); 0 asks
 * for the same bits. Returns the largest error seen, in the units of the
 * limit (ulp(ref) + ulp(max|ref|) / 4). */
static double expect_close(const char *what, ts_dtype dt, ts_tensor *got, ts_tensor *ref, double ulps)
{
    char s1[96], s2[96];
    cr_assert_eq(ts_tensor_dtype(got), dt, "%s: dtype %s, expected %s", what, ts_dtype_name(ts_tensor_dtype(got)),
                 ts_dtype_name(dt));
    cr_assert_eq(ts_tensor_ndim(got), ts_tensor_ndim(ref), "%s: shape %s, expected %s", what,
                 ts_tensor_shape_str(got, s1, sizeof s1), ts_tensor_shape_str(ref, s2, sizeof s2));
    for (int d = 0; d < ts_tensor_ndim(got); d++)
        cr_assert_eq(ts_tensor_shape(got)[d], ts_tensor_shape(ref)[d], "%s: shape %s, expected %s", what,
                     ts_tensor_shape_str(got, s1, sizeof s1), ts_tensor_shape_str(ref, s2, sizeof s2));
    ts_tensor *r = to(ref, dt); /* float32 references rounded once */
    int64_t n = ts_tensor_numel(got);
    double *g = th_vals_new(got), *rv = th_vals_new(r);
    double scale = 0, worst = 0;
    for (int64_t i = 0; i < n; i++) scale = fmax(scale, fabs(rv[i]));
    int64_t bad = -1;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs(g[i] - rv[i]);
        bool same = g[i] == rv[i] || (isnan(g[i]) && isnan(rv[i]));
        if (!same && isnan(d)) d = INFINITY;
        double unit = ulp_at(dt, fabs(rv[i])) + ulp_at(dt, scale) / 4, e = same ? 0 : d / unit;
        worst = fmax(worst, e);
        bool ok = same || (ulps > 0 && d <= ulps * unit);
        if (!ok && bad < 0) bad = i;
    }
    if (getenv("TS_HALF_VERBOSE"))
        fprintf(stderr, "  %-40s n %4lld  max err %.2f (limit %g)\n", what, (long long)n, worst, ulps);
    cr_assert_eq(bad, -1, "%s: element %lld is %.9g, expected %.9g (%s; max|ref| %.6g, limit %g ulps, worst %.2f)",
                 what, (long long)bad, bad >= 0 ? g[bad] : 0.0, bad >= 0 ? rv[bad] : 0.0, ts_dtype_name(dt), scale,
                 ulps, worst);
    free(g);
    free(rv);
    ts_tensor_free(r);
    return worst;
}

/* ------------------------------------------------------------ op cases */

enum { MAX_IN = 4, MAX_OUT = 5 };

typedef ts_status (*op_fn)(ts_tensor **in, ts_tensor **out);

/* One op of the fixture: its inputs (names in the fixture; those with
 * grad[] set require grad), its upstream gradient (NULL: the output is a
 * scalar loss, gradient 1) and its results: the output, then the
 * gradient of each input that requires grad, in input order. */
typedef struct op_case {
    const char *name;
    int n_in;
    const char *in[MAX_IN];
    bool grad[MAX_IN];
    const char *g;
    int n_out;
    const char *out[MAX_OUT];
    op_fn fn;
} op_case;

static ts_status f_layer_norm(ts_tensor **in, ts_tensor **out)
{
    return ts_layer_norm(in[0], 1, in[1], in[2], 1e-5, out);
}
static ts_status f_softmax(ts_tensor **in, ts_tensor **out) { return ts_softmax(in[0], -1, out); }
static ts_status f_log_softmax(ts_tensor **in, ts_tensor **out) { return ts_log_softmax(in[0], -1, out); }
static ts_status f_embedding(ts_tensor **in, ts_tensor **out) { return ts_embedding(in[0], in[1], out); }
static ts_status f_cross_entropy(ts_tensor **in, ts_tensor **out)
{
    return ts_cross_entropy(in[0], in[1], -100, TS_REDUCTION_MEAN, out);
}

/* torch.manual_seed(2020) right before the dropout (the script's DROP_SEED) */
static ts_status f_dropout(ts_tensor **in, ts_tensor **out)
{
    ts_manual_seed(2020);
    return ts_dropout(in[0], 0.1, true, NULL, out);
}

static ts_tensor *causal_mask(int64_t T)
{
    uint8_t m[64];
    cr_assert(T * T <= 64);
    for (int64_t i = 0; i < T; i++)
        for (int64_t j = 0; j < T; j++) m[i * T + j] = j > i;
    int64_t shape[2] = {T, T};
    ts_tensor *t;
    TH_OK(ts_tensor_from_data(TS_BOOL, 2, shape, m, &t));
    return t;
}

static ts_status attention_p(ts_tensor **in, double p, ts_tensor **out)
{
    ts_tensor *mask = causal_mask(ts_tensor_size(in[0], 1));
    if (p > 0) ts_manual_seed(2020);
    ts_status st = ts_attention(in[0], in[1], in[2], 2, mask, p, true, NULL, out);
    ts_tensor_free(mask);
    return st;
}

static ts_status f_attention(ts_tensor **in, ts_tensor **out) { return attention_p(in, 0.0, out); }
static ts_status f_attention_drop(ts_tensor **in, ts_tensor **out) { return attention_p(in, 0.25, out); }

static const op_case CASES[] = {
    {"layer_norm", 3, {"x", "w", "b"}, {true, true, true}, "g", 4, {"y", "gx", "gw", "gb"}, f_layer_norm},
    {"softmax", 1, {"x"}, {true}, "g", 2, {"y", "gx"}, f_softmax},
    {"log_softmax", 1, {"x"}, {true}, "g", 2, {"y", "gx"}, f_log_softmax},
    {"embedding", 2, {"w", "idx"}, {true, false}, "g", 2, {"y", "gw"}, f_embedding},
    {"cross_entropy", 2, {"x", "t"}, {true, false}, NULL, 2, {"loss", "gx"}, f_cross_entropy},
    {"dropout", 1, {"x"}, {true}, "g", 2, {"y", "gx"}, f_dropout},
    {"attention", 3, {"q", "k", "v"}, {true, true, true}, "g", 4, {"y", "gq", "gk", "gv"}, f_attention},
    {"attention_drop", 3, {"q", "k", "v"}, {true, true, true}, "g", 4, {"y", "gq", "gk", "gv"}, f_attention_drop},
};

static const op_case *find_case(const char *name)
{
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++)
        if (!strcmp(CASES[i].name, name)) return &CASES[i];
    cr_assert_fail("no case %s", name);
    return NULL;
}

/* The fixture tensor "<case>.<tag>.<what>". */
static ts_tensor *case_tensor(const th_half_fx *f, const op_case *c, const char *tag, const char *what)
{
    char name[128];
    snprintf(name, sizeof name, "%s.%s.%s", c->name, tag, what);
    return th_half_fx_tensor(f, name);
}

/* Runs case c in dtype dt on the fixture's inputs (floating ones converted
 * to dt) with its upstream gradient (converted too): res[0] the output,
 * res[1..] the gradients. */
static void run_case(const th_half_fx *f, const op_case *c, const char *tag, ts_dtype dt, ts_tensor **res)
{
    ts_tensor *in[MAX_IN] = {0};
    for (int i = 0; i < c->n_in; i++) {
        ts_tensor *raw = case_tensor(f, c, tag, c->in[i]);
        if (ts_dtype_is_float(ts_tensor_dtype(raw))) {
            ts_tensor *f32 = to(raw, TS_F32);
            in[i] = to(f32, dt);
            ts_tensor_free(f32);
            ts_tensor_free(raw);
        } else {
            in[i] = raw;
        }
        if (c->grad[i]) TH_OK(ts_tensor_set_requires_grad(in[i], true));
    }
    ts_tensor *y;
    TH_OK(c->fn(in, &y));
    ts_tensor *g = NULL;
    if (c->g) {
        ts_tensor *raw = case_tensor(f, c, tag, c->g), *f32 = to(raw, TS_F32);
        g = to(f32, dt);
        ts_tensor_free(raw);
        ts_tensor_free(f32);
    }
    TH_OK(ts_backward(y, g, false));
    ts_tensor_free(g);
    res[0] = y;
    int k = 1;
    for (int i = 0; i < c->n_in; i++) {
        if (!c->grad[i]) continue;
        ts_tensor *gr = ts_tensor_grad(in[i]);
        cr_assert(gr != NULL, "%s: no gradient for input %s", c->name, c->in[i]);
        res[k++] = ts_tensor_retain(gr);
    }
    cr_assert_eq(k, c->n_out);
    for (int i = 0; i < c->n_in; i++) ts_tensor_free(in[i]);
}

static void free_res(ts_tensor **res, int n)
{
    for (int i = 0; i < n; i++) ts_tensor_free(res[i]);
}

/* Case `name` in dt against its float32 run on the same values, rounded:
 * ulps[j] is the limit of result j (output, then gradients). */
static void check_vs_f32(const char *name, ts_dtype dt, const double *ulps)
{
    th_half_fx f;
    th_half_fx_open(&f, "ops");
    const op_case *c = find_case(name);
    ts_tensor *half[MAX_OUT], *full[MAX_OUT];
    run_case(&f, c, "bf16", dt, half);
    run_case(&f, c, "bf16", TS_F32, full);
    for (int j = 0; j < c->n_out; j++) {
        char what[128];
        snprintf(what, sizeof what, "%s %s %s vs f32 rounded", name, ts_dtype_name(dt), c->out[j]);
        expect_close(what, dt, half[j], full[j], ulps[j]);
    }
    free_res(half, c->n_out);
    free_res(full, c->n_out);
    th_half_fx_close(&f);
}

/* Case `name` against torch 1.13's results of the fixture (tag "bf16" or
 * "f16"). */
static void check_vs_torch(const char *name, const char *tag, ts_dtype dt, const double *ulps)
{
    th_half_fx f;
    th_half_fx_open(&f, "ops");
    const op_case *c = find_case(name);
    ts_tensor *res[MAX_OUT];
    run_case(&f, c, tag, dt, res);
    for (int j = 0; j < c->n_out; j++) {
        char what[128];
        snprintf(what, sizeof what, "%s %s %s vs torch", name, ts_dtype_name(dt), c->out[j]);
        ts_tensor *ref = case_tensor(&f, c, tag, c->out[j]);
        expect_close(what, dt, res[j], ref, ulps[j]);
        ts_tensor_free(ref);
    }
    free_res(res, c->n_out);
    th_half_fx_close(&f);
}

static const ts_dtype HALVES[2] = {TS_BF16, TS_F16};

/* ------------------------------------------------------------ layer_norm */

/* The 16-bit path runs the f32 row kernels on the values read as float and
 * rounds each result once: the same bits as the f32 run rounded. */
Test(tensor_half_nn_ops, layer_norm_matches_f32_rounded)
{
    static const double ulps[4] = {0, 0, 0, 0};
    for (int i = 0; i < 2; i++) check_vs_f32("layer_norm", HALVES[i], ulps);
}

/* torch 1.13's bf16 layer norm rounds intermediate steps of its affine
 * map in bf16 vectors, so its outputs differ from the once-rounded ones by
 * an ulp here and there, and the gradients inherit that (measured, in the
 * units above: y 1.33, gx 1.5, gw 3.17 (a sum of 12 rows of g * xh whose
 * xh differ by those ulps), gb 1.0). */
Test(tensor_half_nn_ops, layer_norm_bf16_matches_torch)
{
    static const double ulps[4] = {3, 3, 6, 2};
    check_vs_torch("layer_norm", "bf16", TS_BF16, ulps);
}

/* ------------------------------------------------------------ softmax */

/* Forward: the same arithmetic on the same values, the same bits. The
 * backward uses the saved output, which the f32 run keeps unrounded: a
 * half-ulp difference in y moves y * (g - sum(g y)) by about that much
 * (measured 0.8). */
Test(tensor_half_nn_ops, softmax_matches_f32_rounded)
{
    static const double ulps[2] = {0, 2};
    for (int i = 0; i < 2; i++) {
        check_vs_f32("softmax", HALVES[i], ulps);
        check_vs_f32("log_softmax", HALVES[i], ulps);
    }
}

/* The softmax / log_softmax backward along `dim` of a (4, 3, 5) tensor,
 * in double, from the 16-bit output y and cotangent g as they are (the
 * formulas of the op's backward), into a float32 tensor. */
static ts_tensor *softmax_bw_naive(ts_tensor *yh, ts_tensor *gh, int dim, bool lg)
{
    double y[60], g[60], o[60];
    th_vals(yh, y, 60);
    th_vals(gh, g, 60);
    const int64_t sh[3] = {4, 3, 5}, st[3] = {15, 5, 1};
    int a = dim == 0 ? 1 : 0, b = 2; /* the other two dims */
    for (int64_t i = 0; i < sh[a]; i++)
        for (int64_t j = 0; j < sh[b]; j++) {
            int64_t base = i * st[a] + j * st[b];
            double s = 0;
            for (int64_t k = 0; k < sh[dim]; k++)
                s += lg ? g[base + k * st[dim]] : g[base + k * st[dim]] * y[base + k * st[dim]];
            for (int64_t k = 0; k < sh[dim]; k++) {
                int64_t e = base + k * st[dim];
                o[e] = lg ? g[e] - exp(y[e]) * s : y[e] * (g[e] - s);
            }
        }
    return th_tensor(TS_F32, 3, sh, o);
}

/* Over a dim that is not the last (the rows are gathered by a transposed
 * copy, then put back): the forward is still the f32 result rounded; the
 * backward is its formula on the rounded y, rounded once (within 1: float
 * against double arithmetic). Against the f32 run's gradient it may
 * differ much more where y is near 1 and g - sum(g y) cancels. */
Test(tensor_half_nn_ops, softmax_over_other_dims_matches_f32_rounded)
{
    int64_t shape[3] = {4, 3, 5};
    for (int i = 0; i < 2; i++)
        for (int dim = 0; dim < 2; dim++)
            for (int lg = 0; lg < 2; lg++) {
                ts_tensor *x0 = th_seq(TS_F32, 3, shape, 4.0, false), *xh = to(x0, HALVES[i]), *x32 = to(xh, TS_F32);
                ts_tensor *c0 = th_seq(TS_F32, 3, shape, -1.0, false), *ch = to(c0, HALVES[i]), *c32 = to(ch, TS_F32);
                TH_OK(ts_tensor_set_requires_grad(xh, true));
                TH_OK(ts_tensor_set_requires_grad(x32, true));
                ts_tensor *yh, *y32;
                TH_OK(lg ? ts_log_softmax(xh, dim, &yh) : ts_softmax(xh, dim, &yh));
                TH_OK(lg ? ts_log_softmax(x32, dim, &y32) : ts_softmax(x32, dim, &y32));
                TH_OK(ts_backward(yh, ch, false));
                TH_OK(ts_backward(y32, c32, false));
                char what[96];
                snprintf(what, sizeof what, "%s dim %d y", lg ? "log_softmax" : "softmax", dim);
                expect_close(what, HALVES[i], yh, y32, 0);
                snprintf(what, sizeof what, "%s dim %d gx", lg ? "log_softmax" : "softmax", dim);
                ts_tensor *ref = softmax_bw_naive(yh, ch, dim, lg);
                expect_close(what, HALVES[i], ts_tensor_grad(xh), ref, 1);
                ts_tensor *t[9] = {x0, xh, x32, c0, ch, c32, yh, y32, ref};
                for (int k = 0; k < 9; k++) ts_tensor_free(t[k]);
            }
}

/* torch 1.13's bf16 softmax is the float softmax rounded (same bits,
 * measured); its log_softmax and both backwards round intermediates in
 * bf16 vectors (products and partial sums, in an order set by the CPU's
 * vector width) and differ by up to an ulp (measured: softmax gx 0.11,
 * log_softmax y 0.67). log_softmax's gx = g - exp(y) sum(g) turns a
 * one-ulp difference of y (2^-6 at |y| ~ 3) into exp(y) |sum(g)| 2^-6,
 * several ulps of a small gradient element (measured 4.0). */
Test(tensor_half_nn_ops, softmax_bf16_matches_torch)
{
    static const double ulps[2] = {1, 1}, log_ulps[2] = {2, 8};
    check_vs_torch("softmax", "bf16", TS_BF16, ulps);
    check_vs_torch("log_softmax", "bf16", TS_BF16, log_ulps);
}

/* ------------------------------------------------------------ embedding */

/* The forward copies rows (same bits). The backward adds the gradient
 * rows one index after the other in the 16-bit dtype, as torch does; rows
 * hit by several indices (up to 4 here) carry up to 3 roundings, against
 * one for the f32 sum rounded: within 2 ulps (measured 1.0). */
Test(tensor_half_nn_ops, embedding_matches_f32_rounded)
{
    static const double ulps[2] = {0, 2};
    for (int i = 0; i < 2; i++) check_vs_f32("embedding", HALVES[i], ulps);
}

/* The same additions in the same order as torch's
 * embedding_dense_backward_cpu: the same bits, bf16 and f16. */
Test(tensor_half_nn_ops, embedding_matches_torch)
{
    static const double ulps[2] = {0, 0};
    check_vs_torch("embedding", "bf16", TS_BF16, ulps);
    check_vs_torch("embedding", "f16", TS_F16, ulps);
}

/* ------------------------------------------------------------ cross_entropy */

/* The loss is taken from the log-probabilities rounded to the dtype (as
 * torch, whose log_softmax output is bf16), the mean in double, rounded
 * once; the gradient is g/count rounded times (exp(lp) - onehot). Both
 * carry the half-ulp rounding of lp (measured: loss 0.8, gx 0.8). */
Test(tensor_half_nn_ops, cross_entropy_matches_f32_rounded)
{
    static const double ulps[2] = {2, 2};
    for (int i = 0; i < 2; i++) check_vs_f32("cross_entropy", HALVES[i], ulps);
}

/* Reductions none and sum (the mean is above): per-row losses are the
 * negated log-probabilities, which are the f32 ones rounded (same bits);
 * the sum and the gradients carry lp's rounding as above. */
Test(tensor_half_nn_ops, cross_entropy_none_and_sum_match_f32_rounded)
{
    int64_t ls[2] = {5, 7}, ts_[1] = {5};
    double tv[5] = {0, 6, -100, 3, 3};
    for (int i = 0; i < 2; i++)
        for (int red = 0; red < 2; red++) {
            ts_reduction r = red ? TS_REDUCTION_SUM : TS_REDUCTION_NONE;
            ts_tensor *l0 = th_seq(TS_F32, 2, ls, 3.0, false), *lh = to(l0, HALVES[i]), *l32 = to(lh, TS_F32);
            ts_tensor *t = th_tensor(TS_I64, 1, ts_, tv);
            TH_OK(ts_tensor_set_requires_grad(lh, true));
            TH_OK(ts_tensor_set_requires_grad(l32, true));
            ts_tensor *yh, *y32, *gh = NULL, *g32 = NULL;
            TH_OK(ts_cross_entropy(lh, t, -100, r, &yh));
            TH_OK(ts_cross_entropy(l32, t, -100, r, &y32));
            if (!red) {
                double gv[5] = {0.5, -1.25, 2.0, 0.75, 3.0};
                g32 = th_tensor(TS_F32, 1, ts_, gv);
                gh = to(g32, HALVES[i]);
            }
            TH_OK(ts_backward(yh, gh, false));
            TH_OK(ts_backward(y32, g32, false));
            expect_close(red ? "cross_entropy sum loss" : "cross_entropy none losses", HALVES[i], yh, y32, red ? 2 : 0);
            expect_close(red ? "cross_entropy sum gx" : "cross_entropy none gx", HALVES[i], ts_tensor_grad(lh),
                         ts_tensor_grad(l32), 2);
            ts_tensor *all[8] = {l0, lh, l32, t, yh, y32, gh, g32};
            for (int k = 0; k < 8; k++) ts_tensor_free(all[k]);
        }
}

/* torch: bf16 log_softmax (intermediates rounded, see softmax), nll_loss
 * and their backward in bf16 (measured: loss the same bits, gx 0.67). */
Test(tensor_half_nn_ops, cross_entropy_bf16_matches_torch)
{
    static const double ulps[2] = {2, 2};
    check_vs_torch("cross_entropy", "bf16", TS_BF16, ulps);
}

/* ------------------------------------------------------------ dropout */

/* The same draws as float32 (the mask is drawn into a float32 tensor), so
 * with p = 0.5 (scale 2, exact in every dtype) a bf16 or f16 dropout is
 * the f32 dropout rounded, bit for bit, forward and backward. */
Test(tensor_half_nn_ops, dropout_equals_f32_dropout_rounded)
{
    int64_t shape[2] = {7, 19};
    for (int i = 0; i < 2; i++) {
        ts_tensor *x32 = th_seq(TS_F32, 2, shape, 3.0, false), *xh = to(x32, HALVES[i]);
        ts_tensor *g32 = th_seq(TS_F32, 2, shape, -2.0, false), *gh = to(g32, HALVES[i]);
        TH_OK(ts_tensor_set_requires_grad(x32, true));
        TH_OK(ts_tensor_set_requires_grad(xh, true));
        ts_tensor *y32, *yh;
        ts_manual_seed(77);
        TH_OK(ts_dropout(x32, 0.5, true, NULL, &y32));
        ts_manual_seed(77);
        TH_OK(ts_dropout(xh, 0.5, true, NULL, &yh));
        TH_OK(ts_backward(y32, g32, false));
        TH_OK(ts_backward(yh, gh, false));
        expect_close("dropout p=0.5 y", HALVES[i], yh, y32, 0);
        expect_close("dropout p=0.5 gx", HALVES[i], ts_tensor_grad(xh), ts_tensor_grad(x32), 0);
        /* and something was dropped and something kept */
        double *v = th_vals_new(yh), *xv = th_vals_new(xh);
        int zeros = 0, kept = 0;
        for (int64_t k = 0; k < 7 * 19; k++) {
            zeros += v[k] == 0 && xv[k] != 0;
            kept += v[k] == 2 * xv[k] && xv[k] != 0;
        }
        cr_assert(zeros > 20 && kept > 20, "dropout: %d dropped, %d kept of 133", zeros, kept);
        free(v);
        free(xv);
        ts_tensor_free(x32);
        ts_tensor_free(xh);
        ts_tensor_free(g32);
        ts_tensor_free(gh);
        ts_tensor_free(y32);
        ts_tensor_free(yh);
    }
}

/* torch 1.13's _dropout in bf16: the same bernoulli draws, the noise
 * divided by (1 - p) in bf16 (scale round(1 / round(0.9)) = 1.109375, not
 * 1/0.9), x * noise rounded: the same bits. */
Test(tensor_half_nn_ops, dropout_bf16_matches_torch)
{
    static const double ulps[2] = {0, 0};
    check_vs_torch("dropout", "bf16", TS_BF16, ulps);
}

/* p = 1 draws nothing and gives zeros; eval mode and p = 0 give the input. */
Test(tensor_half_nn_ops, dropout_edge_probabilities)
{
    int64_t shape[1] = {9};
    for (int i = 0; i < 2; i++) {
        ts_tensor *x32 = th_seq(TS_F32, 1, shape, 1.0, false), *x = to(x32, HALVES[i]), *y;
        ts_tensor_free(x32);
        TH_OK(ts_dropout(x, 1.0, true, NULL, &y));
        double v[9];
        th_vals(y, v, 9);
        for (int k = 0; k < 9; k++) cr_assert(v[k] == 0.0, "p=1: element %d is %g", k, v[k]);
        cr_assert_eq(ts_tensor_dtype(y), HALVES[i]);
        ts_tensor_free(y);
        TH_OK(ts_dropout(x, 0.3, false, NULL, &y));
        cr_assert_eq(y, x, "eval mode returns the input");
        ts_tensor_free(y);
        ts_tensor_free(x);
    }
}

/* ------------------------------------------------------------ attention */

/* The 16-bit path rounds after each of torch's ops (q / sqrt(hd), the
 * scores, the probabilities, the product with v; backward likewise); the
 * f32 run rounds only its results. Each rounding adds up to half an ulp,
 * passed through sums of S = 5 or T = 5 terms (measured, bf16 and f16,
 * with and without dropout: y 1.0, gq 1.33, gk 2.8, gv 1.0; gk sums
 * terms of both signs over the rows). A wrong formula is off by the size
 * of the values, hundreds of these units. */
Test(tensor_half_nn_ops, attention_matches_f32_rounded)
{
    static const double ulps[4] = {2, 3, 6, 2};
    for (int i = 0; i < 2; i++) {
        check_vs_f32("attention", HALVES[i], ulps);
        check_vs_f32("attention_drop", HALVES[i], ulps);
    }
}

/* Against torch's op chain in bf16, the same roundings: what remains is
 * the float32 summation order inside the products and torch's softmax
 * backward, which rounds its products and partial sums in bf16 (see
 * softmax). Measured without / with dropout: y 1.0 / 1.67, gq 1.5 / 2.67,
 * gk 6.2 / 4.8 (the cancelling sum of dA^T qs over the rows carries dA's
 * differences), gv 1.0 / 1.33. */
Test(tensor_half_nn_ops, attention_bf16_matches_torch)
{
    static const double ulps[4] = {4, 6, 12, 3};
    check_vs_torch("attention", "bf16", TS_BF16, ulps);
    check_vs_torch("attention_drop", "bf16", TS_BF16, ulps);
}

/* ------------------------------------------------------------ errors */

Test(tensor_half_nn_ops, mixed_dtypes_are_errors)
{
    int64_t s3[3] = {1, 2, 4}, s1[1] = {4};
    ts_tensor *x32 = th_seq(TS_F32, 3, s3, 1.0, false), *x = to(x32, TS_BF16), *w32 = th_seq(TS_F32, 1, s1, 1.0, false);
    ts_tensor_free(x32);
    ts_tensor *k32 = th_seq(TS_F32, 3, s3, 1.0, false), *y = NULL;
    cr_assert_eq(ts_layer_norm(x, 1, w32, NULL, 1e-5, &y), TS_ERR_DTYPE);
    cr_assert(strstr(ts_last_error(), "float32") && strstr(ts_last_error(), "bfloat16"), "%s", ts_last_error());
    cr_assert_eq(ts_attention(x, k32, k32, 2, NULL, 0.0, false, NULL, &y), TS_ERR_DTYPE);
    cr_assert(strstr(ts_last_error(), "float32") && strstr(ts_last_error(), "bfloat16"), "%s", ts_last_error());
    cr_assert(y == NULL);
    ts_tensor_free(x);
    ts_tensor_free(w32);
    ts_tensor_free(k32);
}
