/* Neural-network ops: layer_norm, embedding, cross_entropy, mse_loss,
 * dropout. Values against naive formulas and hand-computed numbers,
 * gradients against finite differences, f32 kernels against the reference
 * path. */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "tests/helpers.h"

/* Gradchecks use TH_GC_EPS / TH_GC_ATOL / TH_GC_RTOL (helpers.h):
 * truncation ~1e-12 and rounding ~1e-10 here, while a wrong gradient is off
 * by O(1). */

static double item(ts_tensor *t)
{
    double v;
    TH_OK(ts_tensor_item(t, &v));
    return v;
}

/* ------------------------------------------------------------ layer_norm */

#define LN_EPS 1e-5

/* x (2,3,4) normalized over the last nd (1 or 2) dims */
static void naive_layer_norm(const double *x, int nd, const double *w, const double *b, double *y)
{
    int D = nd == 1 ? 4 : 12, R = 24 / D;
    for (int r = 0; r < R; r++) {
        double mu = 0, var = 0;
        for (int i = 0; i < D; i++) mu += x[r * D + i];
        mu /= D;
        for (int i = 0; i < D; i++) var += (x[r * D + i] - mu) * (x[r * D + i] - mu);
        var /= D; /* biased, as PyTorch */
        for (int i = 0; i < D; i++)
            y[r * D + i] = (x[r * D + i] - mu) / sqrt(var + LN_EPS) * (w ? w[i] : 1.0) + (b ? b[i] : 0.0);
    }
}

Test(tensor_nn_ops, layer_norm_values)
{
    th_mem_mark();
    int64_t sx[3] = {2, 3, 4};
    for (int dt = 0; dt < 2; dt++) {
        ts_dtype d = dt ? TS_F64 : TS_F32;
        ts_tensor *x = th_seq(d, 3, sx, 2.0, false);
        double xv[24];
        th_vals(x, xv, 24);
        for (int nd = 1; nd <= 2; nd++) {
            const int64_t *ps = sx + 3 - nd;
            ts_tensor *w = th_seq(d, nd, ps, 1.5, false), *b = th_seq(d, nd, ps, -0.5, false);
            double wv[12], bv[12];
            th_vals(w, wv, nd == 1 ? 4 : 12);
            th_vals(b, bv, nd == 1 ? 4 : 12);
            for (int combo = 0; combo < 4; combo++) {
                bool uw = combo & 1, ub = combo & 2;
                ts_tensor *y;
                TH_OK(ts_layer_norm(x, nd, uw ? w : NULL, ub ? b : NULL, LN_EPS, &y));
                th_assert_shape(y, 3, sx);
                double got[24], want[24];
                th_vals(y, got, 24);
                naive_layer_norm(xv, nd, uw ? wv : NULL, ub ? bv : NULL, want);
                /* float32: statistics in double, then (x - mu) * rstd * w + b
                 * in float, four roundings of values <= ~5: 1e-6 relative
                 * + 1e-6 absolute */
                double rtol = dt ? 1e-12 : 1e-6, atol = dt ? 1e-12 : 1e-6;
                for (int i = 0; i < 24; i++)
                    cr_assert(fabs(got[i] - want[i]) <= atol + rtol * fabs(want[i]),
                              "%s nd %d weight %d bias %d [%d]: %.9g vs %.9g", ts_dtype_name(d), nd, uw, ub, i, got[i],
                              want[i]);
                ts_tensor_free(y);
            }
            ts_tensor_free(w);
            ts_tensor_free(b);
        }
        ts_tensor_free(x);
    }
    th_mem_assert_back();
}

Test(tensor_nn_ops, layer_norm_hand_values)
{
    th_mem_mark();
    /* row (1, 2, 3, 4): mean 2.5, biased variance 1.25 */
    int64_t s[1] = {4};
    double v[4] = {1, 2, 3, 4};
    ts_tensor *x = th_tensor(TS_F64, 1, s, v), *y;
    TH_OK(ts_layer_norm(x, 1, NULL, NULL, 0.0, &y));
    double got[4];
    th_vals(y, got, 4);
    for (int i = 0; i < 4; i++) cr_assert(fabs(got[i] - (v[i] - 2.5) / sqrt(1.25)) < 1e-15, "[%d] %.17g", i, got[i]);
    ts_tensor_free(y);
    ts_tensor_free(x);
    th_mem_assert_back();
}

typedef struct ln_ctx {
    int nd;
    bool transpose; /* normalize x^T (dims 0 and 1 swapped) */
} ln_ctx;

static ts_status gc_layer_norm(ts_tensor **in, ts_tensor **out, void *ctx)
{
    const ln_ctx *c = ctx;
    ts_tensor *x = in[0], *xt = NULL;
    if (c->transpose) {
        ts_status st = ts_transpose(x, 0, 1, &xt);
        if (st) return st;
        x = xt;
    }
    ts_status st = ts_layer_norm(x, c->nd, in[1], in[2], LN_EPS, out);
    ts_tensor_free(xt);
    return st;
}

Test(tensor_nn_ops, layer_norm_gradcheck)
{
    th_mem_mark();
    int64_t sx[3] = {2, 3, 4}, sxt[3] = {3, 2, 4};
    for (int nd = 1; nd <= 2; nd++)
        for (int combo = 0; combo < 4; combo++)
            for (int tr = 0; tr < 2; tr++) {
                if (tr && nd == 2) continue; /* x^T is (2,3,4) from (3,2,4); keep nd 1 there */
                const int64_t *ps = sx + 3 - nd;
                ts_tensor *in[3];
                in[0] = th_seq(TS_F64, 3, tr ? sxt : sx, 2.0, true);
                in[1] = combo & 1 ? th_seq(TS_F64, nd, ps, 1.5, true) : NULL;
                in[2] = combo & 2 ? th_seq(TS_F64, nd, ps, -0.5, true) : NULL;
                ln_ctx c = {nd, tr};
                th_gradcheck(gc_layer_norm, 3, in, &c, TH_GC_EPS, TH_GC_ATOL, TH_GC_RTOL);
                cr_assert_not_null(ts_tensor_grad(in[0]));
                for (int j = 1; j < 3; j++)
                    if (in[j]) {
                        cr_assert_not_null(ts_tensor_grad(in[j]), "nd %d combo %d: no grad for input %d", nd, combo, j);
                        th_assert_shape(ts_tensor_grad(in[j]), nd, ps);
                    }
                for (int j = 0; j < 3; j++) ts_tensor_free(in[j]);
            }
    th_mem_assert_back();
}

Test(tensor_nn_ops, layer_norm_gradcheck_parameters_only)
{
    th_mem_mark();
    /* x does not require grad: only weight and bias get gradients */
    int64_t sx[3] = {2, 3, 4};
    for (int nd = 1; nd <= 2; nd++) {
        const int64_t *ps = sx + 3 - nd;
        ts_tensor *in[3] = {th_seq(TS_F64, 3, sx, 2.0, false), th_seq(TS_F64, nd, ps, 1.5, true),
                            th_seq(TS_F64, nd, ps, -0.5, true)};
        ln_ctx c = {nd, false};
        th_gradcheck(gc_layer_norm, 3, in, &c, TH_GC_EPS, TH_GC_ATOL, TH_GC_RTOL);
        cr_assert_null(ts_tensor_grad(in[0]));
        th_assert_shape(ts_tensor_grad(in[1]), nd, ps);
        th_assert_shape(ts_tensor_grad(in[2]), nd, ps);
        for (int j = 0; j < 3; j++) ts_tensor_free(in[j]);
    }
    th_mem_assert_back();
}

Test(tensor_nn_ops, layer_norm_optimized_matches_reference)
{
    th_mem_mark();
    int64_t sx[3] = {3, 5, 16};
    for (int nd = 1; nd <= 2; nd++) {
        const int64_t *ps = sx + 3 - nd;
        ts_tensor *x0 = th_seq(TS_F32, 3, sx, 3.0, false), *w0 = th_seq(TS_F32, nd, ps, 1.5, false),
                  *b0 = th_seq(TS_F32, nd, ps, 0.5, false);
        ln_ctx c = {nd, false};
        ts_tensor *in[3] = {x0, w0, b0};
        /* forward: float (x - mu) * rstd * w + b against the same in double
         * rounded once: four float roundings of values up to ~6: 1e-6
         * relative + 1e-6 absolute. backward is computed in double on both
         * paths from the same saved statistics: identical up to the float
         * storage of x (1e-6 as well) */
        th_assert_kernels_agree(gc_layer_norm, 3, in, &c, 0.7, 1e-6, 1e-6, 1e-6, 1e-6);
        ts_tensor_free(x0);
        ts_tensor_free(w0);
        ts_tensor_free(b0);
    }
    th_mem_assert_back();
}

Test(tensor_nn_ops, layer_norm_bad_arguments)
{
    th_mem_mark();
    int64_t sx[2] = {2, 4}, sw[1] = {3};
    ts_tensor *x = th_seq(TS_F32, 2, sx, 1, false), *w = th_seq(TS_F32, 1, sw, 1, false), *o = NULL;
    cr_assert_eq(ts_layer_norm(x, 1, w, NULL, LN_EPS, &o), TS_ERR_SHAPE);
    cr_assert(strstr(ts_last_error(), "(3,)") && strstr(ts_last_error(), "(4,)"), "%s", ts_last_error());
    cr_assert_eq(ts_layer_norm(x, 1, NULL, w, LN_EPS, &o), TS_ERR_SHAPE);
    cr_assert(strstr(ts_last_error(), "bias") != NULL, "%s", ts_last_error());
    cr_assert_eq(ts_layer_norm(x, 0, NULL, NULL, LN_EPS, &o), TS_ERR_SHAPE);
    cr_assert_eq(ts_layer_norm(x, 3, NULL, NULL, LN_EPS, &o), TS_ERR_SHAPE);
    cr_assert_null(o);
    ts_tensor_free(x);
    ts_tensor_free(w);
    th_mem_assert_back();
}

/* ------------------------------------------------------------ embedding */

Test(tensor_nn_ops, embedding_picks_rows)
{
    th_mem_mark();
    int64_t sw[2] = {5, 3}, si[2] = {2, 3};
    double iv[6] = {4, 0, 2, 2, 4, 1};
    ts_tensor *w = th_seq(TS_F32, 2, sw, 1.0, false);
    double wv[15];
    th_vals(w, wv, 15);
    for (int it = 0; it < 2; it++) {
        ts_tensor *idx = th_tensor(it ? TS_I32 : TS_I64, 2, si, iv), *o;
        TH_OK(ts_embedding(w, idx, &o));
        int64_t so[3] = {2, 3, 3};
        th_assert_shape(o, 3, so);
        double got[18];
        th_vals(o, got, 18);
        for (int r = 0; r < 6; r++)
            for (int c = 0; c < 3; c++)
                cr_assert_eq(got[r * 3 + c], wv[(int)iv[r] * 3 + c], "%s indices: out[%d][%d]",
                             ts_dtype_name(ts_tensor_dtype(idx)), r, c);
        ts_tensor_free(o);
        ts_tensor_free(idx);
    }
    /* 0-d index gives one row of shape (3,) */
    ts_tensor *i0, *o;
    TH_OK(ts_tensor_scalar(TS_I64, 3, &i0));
    TH_OK(ts_embedding(w, i0, &o));
    int64_t s3[1] = {3};
    th_assert_shape(o, 1, s3);
    double got[3];
    th_vals(o, got, 3);
    for (int c = 0; c < 3; c++) cr_assert_eq(got[c], wv[9 + c]);
    ts_tensor_free(o);
    ts_tensor_free(i0);
    ts_tensor_free(w);
    th_mem_assert_back();
}

Test(tensor_nn_ops, embedding_repeated_indices_accumulate_gradients)
{
    th_mem_mark();
    int64_t sw[2] = {4, 2}, si[1] = {5};
    double iv[5] = {1, 3, 1, 1, 0};
    for (int dt = 0; dt < 2; dt++) {
        ts_tensor *w = th_seq(dt ? TS_F64 : TS_F32, 2, sw, 1.0, true), *idx = th_tensor(TS_I64, 1, si, iv), *o;
        TH_OK(ts_embedding(w, idx, &o));
        /* cotangent rows 1..5: (1, 10), (2, 20), ... */
        double cv[10];
        for (int r = 0; r < 5; r++) {
            cv[2 * r] = r + 1;
            cv[2 * r + 1] = 10.0 * (r + 1);
        }
        int64_t so[2] = {5, 2};
        ts_tensor *cot = th_tensor(dt ? TS_F64 : TS_F32, 2, so, cv);
        TH_OK(ts_backward(o, cot, false));
        double g[8];
        th_vals(ts_tensor_grad(w), g, 8);
        /* row 0 <- out row 4 (5, 50); row 1 <- rows 0, 2, 3 (1+3+4, 10+30+40);
         * row 2 unused; row 3 <- row 1 (2, 20) */
        double want[8] = {5, 50, 8, 80, 0, 0, 2, 20};
        for (int i = 0; i < 8; i++) cr_assert_eq(g[i], want[i], "grad [%d] = %g", i, g[i]);
        ts_tensor_free(cot);
        ts_tensor_free(o);
        ts_tensor_free(w);
        ts_tensor_free(idx);
    }
    th_mem_assert_back();
}

static ts_status gc_embedding(ts_tensor **in, ts_tensor **out, void *ctx) { return ts_embedding(in[0], ctx, out); }

Test(tensor_nn_ops, embedding_gradcheck)
{
    th_mem_mark();
    int64_t sw[2] = {6, 3}, si[2] = {2, 4};
    double iv[8] = {5, 0, 2, 5, 5, 1, 0, 3};
    ts_tensor *idx = th_tensor(TS_I64, 2, si, iv);
    ts_tensor *in[1] = {th_seq(TS_F64, 2, sw, 1.0, true)};
    th_gradcheck(gc_embedding, 1, in, idx, TH_GC_EPS, TH_GC_ATOL, TH_GC_RTOL);
    th_assert_shape(ts_tensor_grad(in[0]), 2, sw);
    ts_tensor_free(in[0]);
    ts_tensor_free(idx);
    th_mem_assert_back();
}

Test(tensor_nn_ops, embedding_bad_arguments)
{
    th_mem_mark();
    int64_t sw[2] = {4, 2}, si[1] = {3};
    double bad[3] = {0, 4, 1}, neg[3] = {0, -1, 1}, ok[3] = {0, 1, 2};
    ts_tensor *w = th_seq(TS_F32, 2, sw, 1, false), *o = NULL;
    ts_tensor *ib = th_tensor(TS_I64, 1, si, bad), *in = th_tensor(TS_I64, 1, si, neg),
              *fi = th_tensor(TS_F32, 1, si, ok);
    cr_assert_eq(ts_embedding(w, ib, &o), TS_ERR_INDEX);
    cr_assert(strstr(ts_last_error(), "index 4") && strstr(ts_last_error(), "4 rows"), "%s", ts_last_error());
    cr_assert_eq(ts_embedding(w, in, &o), TS_ERR_INDEX);
    cr_assert(strstr(ts_last_error(), "-1") != NULL, "%s", ts_last_error());
    cr_assert_eq(ts_embedding(w, fi, &o), TS_ERR_DTYPE);
    cr_assert_eq(ts_embedding(fi, ib, &o), TS_ERR_SHAPE); /* weight must be 2-d */
    cr_assert_null(o);
    ts_tensor_free(w);
    ts_tensor_free(ib);
    ts_tensor_free(in);
    ts_tensor_free(fi);
    th_mem_assert_back();
}

/* ------------------------------------------------------------ cross_entropy */

#define CE_N 4
#define CE_C 5

/* -log_softmax(logits)[i][t_i], naive in double */
static void naive_ce(const double *x, const int64_t *t, double *li)
{
    for (int i = 0; i < CE_N; i++) {
        double mx = -INFINITY, s = 0;
        for (int c = 0; c < CE_C; c++) mx = fmax(mx, x[i * CE_C + c]);
        for (int c = 0; c < CE_C; c++) s += exp(x[i * CE_C + c] - mx);
        li[i] = -(x[i * CE_C + t[i]] - mx - log(s));
    }
}

Test(tensor_nn_ops, cross_entropy_values)
{
    th_mem_mark();
    int64_t sl[2] = {CE_N, CE_C}, st[1] = {CE_N};
    int64_t tv[CE_N] = {0, 4, 2, 2};
    double tvd[CE_N] = {0, 4, 2, 2};
    for (int dt = 0; dt < 2; dt++) {
        ts_dtype d = dt ? TS_F64 : TS_F32;
        ts_tensor *x = th_seq(d, 2, sl, 3.0, false), *t = th_tensor(TS_I64, 1, st, tvd), *o;
        double xv[CE_N * CE_C], li[CE_N];
        th_vals(x, xv, CE_N * CE_C);
        naive_ce(xv, tv, li);
        /* float32: log_softmax in float (expf, a few roundings of values up
         * to ~8): 1e-6 relative + 1e-6 absolute */
        double tol = dt ? 1e-13 : 2e-6;
        TH_OK(ts_cross_entropy(x, t, -100, TS_REDUCTION_NONE, &o));
        th_assert_shape(o, 1, st);
        double got[CE_N];
        th_vals(o, got, CE_N);
        double sum = 0;
        for (int i = 0; i < CE_N; i++) {
            cr_assert(fabs(got[i] - li[i]) <= tol * (1 + fabs(li[i])), "none [%d]: %.9g vs %.9g", i, got[i], li[i]);
            sum += li[i];
        }
        ts_tensor_free(o);
        TH_OK(ts_cross_entropy(x, t, -100, TS_REDUCTION_SUM, &o));
        cr_assert_eq(ts_tensor_ndim(o), 0);
        cr_assert(fabs(item(o) - sum) <= tol * (1 + sum), "sum: %.9g vs %.9g", item(o), sum);
        ts_tensor_free(o);
        TH_OK(ts_cross_entropy(x, t, -100, TS_REDUCTION_MEAN, &o));
        cr_assert(fabs(item(o) - sum / CE_N) <= tol * (1 + sum), "mean: %.9g vs %.9g", item(o), sum / CE_N);
        ts_tensor_free(o);
        ts_tensor_free(x);
        ts_tensor_free(t);
    }
    th_mem_assert_back();
}

Test(tensor_nn_ops, cross_entropy_hand_value)
{
    th_mem_mark();
    /* logits (0, 0, 0, 0) -> every class has probability 1/4: loss log 4;
     * logits (0, ln 3) with target 1 -> p = 3/4: loss -ln(3/4) */
    int64_t s1[2] = {1, 4}, s2[2] = {1, 2}, st[1] = {1};
    double z[4] = {0, 0, 0, 0}, y[2] = {0, log(3.0)}, t1 = 2, t2 = 1;
    ts_tensor *x1 = th_tensor(TS_F64, 2, s1, z), *x2 = th_tensor(TS_F64, 2, s2, y);
    ts_tensor *ta = th_tensor(TS_I64, 1, st, &t1), *tb = th_tensor(TS_I64, 1, st, &t2), *o;
    TH_OK(ts_cross_entropy(x1, ta, -100, TS_REDUCTION_MEAN, &o));
    cr_assert(fabs(item(o) - log(4.0)) < 1e-15, "%.17g", item(o));
    ts_tensor_free(o);
    TH_OK(ts_cross_entropy(x2, tb, -100, TS_REDUCTION_MEAN, &o));
    cr_assert(fabs(item(o) + log(0.75)) < 1e-15, "%.17g", item(o));
    ts_tensor_free(o);
    ts_tensor_free(x1);
    ts_tensor_free(x2);
    ts_tensor_free(ta);
    ts_tensor_free(tb);
    th_mem_assert_back();
}

Test(tensor_nn_ops, cross_entropy_ignore_index)
{
    th_mem_mark();
    int64_t sl[2] = {CE_N, CE_C}, st[1] = {CE_N};
    double tvd[CE_N] = {1, -1, 3, -1};
    int64_t tv[CE_N] = {1, 0, 3, 0}; /* ignored rows' targets unused below */
    ts_tensor *x = th_seq(TS_F64, 2, sl, 2.0, false), *t = th_tensor(TS_I64, 1, st, tvd), *o;
    double xv[CE_N * CE_C], li[CE_N], got[CE_N];
    th_vals(x, xv, CE_N * CE_C);
    naive_ce(xv, tv, li);
    TH_OK(ts_cross_entropy(x, t, -1, TS_REDUCTION_NONE, &o));
    th_vals(o, got, CE_N);
    cr_assert(fabs(got[0] - li[0]) < 1e-13 && got[1] == 0 && fabs(got[2] - li[2]) < 1e-13 && got[3] == 0,
              "none: %g %g %g %g", got[0], got[1], got[2], got[3]);
    ts_tensor_free(o);
    TH_OK(ts_cross_entropy(x, t, -1, TS_REDUCTION_SUM, &o));
    cr_assert(fabs(item(o) - (li[0] + li[2])) < 1e-13, "sum %.17g", item(o));
    ts_tensor_free(o);
    /* the mean counts only the 2 targets that are not ignored */
    TH_OK(ts_cross_entropy(x, t, -1, TS_REDUCTION_MEAN, &o));
    cr_assert(fabs(item(o) - (li[0] + li[2]) / 2) < 1e-13, "mean %.17g", item(o));
    ts_tensor_free(o);
    /* the ignore index may lie inside [0, C): class 3 is then ignored */
    double t3v[CE_N] = {1, 3, 3, 0};
    ts_tensor *t3 = th_tensor(TS_I64, 1, st, t3v);
    TH_OK(ts_cross_entropy(x, t3, 3, TS_REDUCTION_MEAN, &o));
    cr_assert(fabs(item(o) - (li[0] + li[3]) / 2) < 1e-13, "ignore 3: %.17g vs %.17g", item(o), (li[0] + li[3]) / 2);
    ts_tensor_free(o);
    ts_tensor_free(t3);
    /* every target ignored: the mean is NaN (0/0), as in PyTorch */
    double all[CE_N] = {-1, -1, -1, -1};
    ts_tensor *ta = th_tensor(TS_I64, 1, st, all);
    TH_OK(ts_cross_entropy(x, ta, -1, TS_REDUCTION_MEAN, &o));
    cr_assert(isnan(item(o)), "%g", item(o));
    ts_tensor_free(o);
    TH_OK(ts_cross_entropy(x, ta, -1, TS_REDUCTION_SUM, &o));
    cr_assert_eq(item(o), 0.0);
    ts_tensor_free(o);
    ts_tensor_free(ta);
    ts_tensor_free(x);
    ts_tensor_free(t);
    th_mem_assert_back();
}

typedef struct ce_ctx {
    ts_tensor *targets;
    int64_t ignore;
    ts_reduction red;
} ce_ctx;

static ts_status gc_ce(ts_tensor **in, ts_tensor **out, void *ctx)
{
    const ce_ctx *c = ctx;
    return ts_cross_entropy(in[0], c->targets, c->ignore, c->red, out);
}

Test(tensor_nn_ops, cross_entropy_gradcheck)
{
    th_mem_mark();
    int64_t sl[2] = {CE_N, CE_C}, st[1] = {CE_N};
    double plain[CE_N] = {0, 4, 2, 2}, ign[CE_N] = {1, -100, 4, -100};
    for (int ti = 0; ti < 2; ti++) {
        ts_tensor *t = th_tensor(TS_I64, 1, st, ti ? ign : plain);
        for (int r = 0; r < 3; r++) {
            ts_tensor *in[1] = {th_seq(TS_F64, 2, sl, 2.0, true)};
            ce_ctx c = {t, -100, (ts_reduction)r};
            th_gradcheck(gc_ce, 1, in, &c, TH_GC_EPS, TH_GC_ATOL, TH_GC_RTOL);
            cr_assert_not_null(ts_tensor_grad(in[0]));
            if (ti) {
                /* ignored rows get no gradient at all */
                double g[CE_N * CE_C];
                th_vals(ts_tensor_grad(in[0]), g, CE_N * CE_C);
                for (int c2 = 0; c2 < CE_C; c2++)
                    cr_assert(g[1 * CE_C + c2] == 0 && g[3 * CE_C + c2] == 0, "reduction %d class %d", r, c2);
            }
            ts_tensor_free(in[0]);
        }
        ts_tensor_free(t);
    }
    th_mem_assert_back();
}

Test(tensor_nn_ops, cross_entropy_gradient_is_softmax_minus_onehot)
{
    th_mem_mark();
    int64_t sl[2] = {CE_N, CE_C}, st[1] = {CE_N};
    double tvd[CE_N] = {3, 0, 1, 4};
    ts_tensor *x = th_seq(TS_F64, 2, sl, 1.5, true), *t = th_tensor(TS_I64, 1, st, tvd), *o, *p;
    TH_OK(ts_cross_entropy(x, t, -100, TS_REDUCTION_MEAN, &o));
    TH_OK(ts_backward(o, NULL, false));
    bool prev = ts_grad_mode_set(false);
    TH_OK(ts_softmax(x, 1, &p));
    ts_grad_mode_set(prev);
    double g[CE_N * CE_C], pv[CE_N * CE_C];
    th_vals(ts_tensor_grad(x), g, CE_N * CE_C);
    th_vals(p, pv, CE_N * CE_C);
    for (int i = 0; i < CE_N; i++)
        for (int c = 0; c < CE_C; c++) {
            double want = (pv[i * CE_C + c] - (c == (int)tvd[i])) / CE_N;
            cr_assert(fabs(g[i * CE_C + c] - want) < 1e-15, "[%d][%d] %.17g vs %.17g", i, c, g[i * CE_C + c], want);
        }
    ts_tensor_free(p);
    ts_tensor_free(o);
    ts_tensor_free(x);
    ts_tensor_free(t);
    th_mem_assert_back();
}

Test(tensor_nn_ops, cross_entropy_optimized_matches_reference)
{
    th_mem_mark();
    int64_t sl[2] = {6, 33}, st[1] = {6};
    double tvd[6] = {0, 32, 7, -100, 15, 15};
    ts_tensor *x0 = th_seq(TS_F32, 2, sl, 6.0, false), *t = th_tensor(TS_I64, 1, st, tvd);
    for (int r = 0; r < 3; r++) {
        ce_ctx c = {t, -100, (ts_reduction)r};
        /* log_softmax in float (expf, (x - max) - log s) against double:
         * a few ulp of values up to ~12: 1e-6 relative + 1e-6 absolute,
         * for the loss and the gradient */
        th_assert_kernels_agree(gc_ce, 1, &x0, &c, 1.0, 1e-6, 1e-6, 1e-6, 1e-6);
    }
    ts_tensor_free(x0);
    ts_tensor_free(t);
    th_mem_assert_back();
}

Test(tensor_nn_ops, cross_entropy_large_logits_keep_precision)
{
    th_mem_mark();
    /* logits around 1000 in float32: the loss must be as accurate as for
     * logits around 0 (log_softmax subtracts the maximum first) */
    int64_t sl[2] = {1, 3}, st[1] = {1};
    double big[3] = {1000, 1001, 1002}, small[3] = {0, 1, 2}, tv = 0;
    ts_tensor *xb = th_tensor(TS_F32, 2, sl, big), *xs = th_tensor(TS_F32, 2, sl, small),
              *t = th_tensor(TS_I64, 1, st, &tv);
    ts_tensor *ob, *os;
    TH_OK(ts_cross_entropy(xb, t, -100, TS_REDUCTION_SUM, &ob));
    TH_OK(ts_cross_entropy(xs, t, -100, TS_REDUCTION_SUM, &os));
    double want = log(1 + exp(1.0) + exp(2.0)); /* 2.4076059644443806 */
    /* 2 ulp of 2.4 in float32 (4.8e-7); rounding lse = 1002 + 0.4076 first
     * would be off by up to 3e-5 */
    cr_assert(fabs(item(ob) - want) < 5e-7, "large logits: %.9g vs %.9g", item(ob), want);
    cr_assert(fabs(item(os) - want) < 5e-7, "small logits: %.9g vs %.9g", item(os), want);
    ts_tensor_free(ob);
    ts_tensor_free(os);
    ts_tensor_free(xb);
    ts_tensor_free(xs);
    ts_tensor_free(t);
    th_mem_assert_back();
}

Test(tensor_nn_ops, cross_entropy_bad_arguments)
{
    th_mem_mark();
    int64_t sl[2] = {2, 3}, st[1] = {2}, st3[1] = {3};
    double tv[2] = {0, 3}, tneg[2] = {-2, 0}, ok[3] = {0, 1, 2};
    ts_tensor *x = th_seq(TS_F32, 2, sl, 1, false), *t = th_tensor(TS_I64, 1, st, tv), *o = NULL;
    ts_tensor *tn = th_tensor(TS_I64, 1, st, tneg), *t3 = th_tensor(TS_I64, 1, st3, ok);
    ts_tensor *tf = th_tensor(TS_I32, 1, st, ok);
    cr_assert_eq(ts_cross_entropy(x, t, -100, TS_REDUCTION_MEAN, &o), TS_ERR_INDEX);
    cr_assert(strstr(ts_last_error(), "target 3") && strstr(ts_last_error(), "3 classes"), "%s", ts_last_error());
    cr_assert_eq(ts_cross_entropy(x, tn, -100, TS_REDUCTION_MEAN, &o), TS_ERR_INDEX);
    cr_assert_eq(ts_cross_entropy(x, t3, -100, TS_REDUCTION_MEAN, &o), TS_ERR_SHAPE);
    cr_assert_eq(ts_cross_entropy(x, tf, -100, TS_REDUCTION_MEAN, &o), TS_ERR_DTYPE);
    cr_assert_eq(ts_cross_entropy(x, tn, -2, (ts_reduction)7, &o), TS_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(ts_last_error(), "reduction 7") != NULL, "%s", ts_last_error());
    cr_assert_null(o);
    ts_tensor_free(x);
    ts_tensor_free(t);
    ts_tensor_free(tn);
    ts_tensor_free(t3);
    ts_tensor_free(tf);
    th_mem_assert_back();
}

/* ------------------------------------------------------- mse_loss, l1_loss */

typedef ts_status (*loss_fn)(ts_tensor *input, ts_tensor *target, ts_reduction reduction, ts_tensor **out);

/* fn on a = [[1, 2], [3, 4]] and b = [[1.5, 0], [3, 7]] in f32 and f64:
 * unreduced it gives `want` exactly (in the inputs' dtype), summed `sum`,
 * averaged `mean` (0-dim). */
static void check_loss_values(loss_fn fn, const double want[4], double sum, double mean)
{
    th_mem_mark();
    int64_t s[2] = {2, 2};
    double a[4] = {1, 2, 3, 4}, b[4] = {1.5, 0, 3, 7};
    for (int dt = 0; dt < 2; dt++) {
        ts_dtype d = dt ? TS_F64 : TS_F32;
        ts_tensor *x = th_tensor(d, 2, s, a), *y = th_tensor(d, 2, s, b), *o;
        TH_OK(fn(x, y, TS_REDUCTION_NONE, &o));
        th_assert_shape(o, 2, s);
        cr_assert_eq(ts_tensor_dtype(o), d);
        double got[4];
        th_vals(o, got, 4);
        for (int i = 0; i < 4; i++) cr_assert_eq(got[i], want[i]);
        ts_tensor_free(o);
        TH_OK(fn(x, y, TS_REDUCTION_SUM, &o));
        cr_assert_eq(ts_tensor_ndim(o), 0);
        cr_assert_eq(item(o), sum);
        ts_tensor_free(o);
        TH_OK(fn(x, y, TS_REDUCTION_MEAN, &o));
        cr_assert_eq(ts_tensor_ndim(o), 0);
        cr_assert_eq(item(o), mean);
        ts_tensor_free(o);
        ts_tensor_free(x);
        ts_tensor_free(y);
    }
    th_mem_assert_back();
}

typedef struct loss_case {
    loss_fn fn;
    ts_reduction reduction;
} loss_case;

static ts_status gc_loss(ts_tensor **in, ts_tensor **out, void *ctx)
{
    const loss_case *c = ctx;
    return c->fn(in[0], in[1], c->reduction, out);
}

/* Gradcheck of fn for both inputs, with every reduction. The difference
 * of the inputs is 1.7 * th_seq's values: at least 0.07 from 0 (where
 * |x| is not differentiable), far above the step 1e-6. */
static void check_loss_gradcheck(loss_fn fn)
{
    th_mem_mark();
    int64_t s[2] = {3, 4};
    for (int r = 0; r < 3; r++) {
        ts_tensor *in[2] = {th_seq(TS_F64, 2, s, 1.0, true), th_seq(TS_F64, 2, s, -0.7, true)};
        loss_case c = {fn, (ts_reduction)r};
        th_gradcheck(gc_loss, 2, in, &c, TH_GC_EPS, TH_GC_ATOL, TH_GC_RTOL);
        th_assert_shape(ts_tensor_grad(in[0]), 2, s);
        th_assert_shape(ts_tensor_grad(in[1]), 2, s);
        ts_tensor_free(in[0]);
        ts_tensor_free(in[1]);
    }
    th_mem_assert_back();
}

Test(tensor_nn_ops, mse_loss_values)
{
    /* squared errors 0.25, 4, 0, 9: sum 13.25, mean 3.3125 */
    static const double want[4] = {0.25, 4, 0, 9};
    check_loss_values(ts_mse_loss, want, 13.25, 3.3125);
}

Test(tensor_nn_ops, mse_loss_gradcheck) { check_loss_gradcheck(ts_mse_loss); }

Test(tensor_nn_ops, l1_loss_values)
{
    /* absolute errors 0.5, 2, 0, 3: sum 5.5, mean 1.375 */
    static const double want[4] = {0.5, 2, 0, 3};
    check_loss_values(ts_l1_loss, want, 5.5, 1.375);
}

/* torch 1.13: a = [1, 2, 3] (requires grad), b = [1, 0, 5];
 * F.l1_loss(a, b).backward() gives a.grad = [0, 1/3, -1/3]: the gradient
 * is 0 where the difference is 0. */
Test(tensor_nn_ops, l1_loss_gradient_matches_torch)
{
    th_mem_mark();
    int64_t s[1] = {3};
    double a[3] = {1, 2, 3}, b[3] = {1, 0, 5};
    for (int dt = 0; dt < 2; dt++) {
        ts_dtype d = dt ? TS_F64 : TS_F32;
        ts_tensor *x = th_tensor(d, 1, s, a), *y = th_tensor(d, 1, s, b), *o;
        TH_OK(ts_tensor_set_requires_grad(x, true));
        TH_OK(ts_tensor_set_requires_grad(y, true));
        TH_OK(ts_l1_loss(x, y, TS_REDUCTION_MEAN, &o));
        TH_OK(ts_backward(o, NULL, false));
        double gx[3], gy[3];
        th_vals(ts_tensor_grad(x), gx, 3);
        th_vals(ts_tensor_grad(y), gy, 3);
        double third = dt ? 1.0 / 3.0 : (double)(1.0f / 3.0f);
        cr_assert(gx[0] == 0.0 && gx[1] == third && gx[2] == -third, "grad input [%g, %g, %g]", gx[0], gx[1], gx[2]);
        cr_assert(gy[0] == 0.0 && gy[1] == -third && gy[2] == third, "grad target [%g, %g, %g]", gy[0], gy[1], gy[2]);
        ts_tensor_free(o);
        ts_tensor_free(x);
        ts_tensor_free(y);
    }
    th_mem_assert_back();
}

Test(tensor_nn_ops, l1_loss_gradcheck) { check_loss_gradcheck(ts_l1_loss); }

Test(tensor_nn_ops, l1_loss_bad_arguments)
{
    th_mem_mark();
    int64_t s1[2] = {2, 3}, s2[2] = {3, 2};
    ts_tensor *x = th_seq(TS_F32, 2, s1, 1, false), *y = th_seq(TS_F32, 2, s2, 1, false), *o = NULL;
    cr_assert_eq(ts_l1_loss(x, y, TS_REDUCTION_MEAN, &o), TS_ERR_SHAPE);
    cr_assert(strstr(ts_last_error(), "l1_loss") && strstr(ts_last_error(), "(2, 3)") &&
                  strstr(ts_last_error(), "(3, 2)"),
              "%s", ts_last_error());
    cr_assert_eq(ts_l1_loss(x, x, (ts_reduction)9, &o), TS_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(ts_last_error(), "reduction 9"), "%s", ts_last_error());
    cr_assert_eq(ts_l1_loss(x, NULL, TS_REDUCTION_MEAN, &o), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_l1_loss(x, x, TS_REDUCTION_MEAN, NULL), TS_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(ts_last_error(), "l1_loss") && strstr(ts_last_error(), "NULL"), "%s", ts_last_error());
    cr_assert_null(o);
    ts_tensor_free(x);
    ts_tensor_free(y);
    th_mem_assert_back();
}

Test(tensor_nn_ops, mse_loss_bad_arguments)
{
    th_mem_mark();
    int64_t s1[2] = {2, 3}, s2[2] = {3, 2};
    ts_tensor *x = th_seq(TS_F32, 2, s1, 1, false), *y = th_seq(TS_F32, 2, s2, 1, false), *o = NULL;
    cr_assert_eq(ts_mse_loss(x, y, TS_REDUCTION_MEAN, &o), TS_ERR_SHAPE);
    cr_assert(strstr(ts_last_error(), "(2, 3)") && strstr(ts_last_error(), "(3, 2)"), "%s", ts_last_error());
    cr_assert_eq(ts_mse_loss(x, x, (ts_reduction)9, &o), TS_ERR_INVALID_ARGUMENT);
    cr_assert_null(o);
    ts_tensor_free(x);
    ts_tensor_free(y);
    th_mem_assert_back();
}

/* ------------------------------------------------------------ dropout */

Test(tensor_nn_ops, dropout_identity_cases)
{
    th_mem_mark();
    int64_t s[2] = {4, 5};
    ts_tensor *x = th_seq(TS_F32, 2, s, 1.0, false), *o;
    /* not training: identity, whatever p */
    TH_OK(ts_dropout(x, 0.7, false, NULL, &o));
    th_assert_close(o, x, 0, 0);
    ts_tensor_free(o);
    /* p = 0 in training: identity */
    TH_OK(ts_dropout(x, 0.0, true, NULL, &o));
    th_assert_close(o, x, 0, 0);
    ts_tensor_free(o);
    /* p = 1: zeros */
    TH_OK(ts_dropout(x, 1.0, true, NULL, &o));
    th_assert_shape(o, 2, s);
    double v[20];
    th_vals(o, v, 20);
    for (int i = 0; i < 20; i++) cr_assert_eq(v[i], 0.0, "[%d] = %g", i, v[i]);
    ts_tensor_free(o);
    /* p outside [0, 1] */
    cr_assert_eq(ts_dropout(x, 1.5, true, NULL, &o), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_dropout(x, -0.1, true, NULL, &o), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_dropout(x, NAN, true, NULL, &o), TS_ERR_INVALID_ARGUMENT);
    ts_tensor_free(x);
    th_mem_assert_back();
}

Test(tensor_nn_ops, dropout_seeded_mask_is_deterministic_and_scaled)
{
    th_mem_mark();
    int64_t s[2] = {50, 40};
    const double p = 0.3;
    ts_tensor *x = th_seq(TS_F32, 2, s, 2.0, true), *y1, *y2;
    double xv[2000], a[2000], b[2000];
    th_vals(x, xv, 2000);
    ts_manual_seed(1234);
    TH_OK(ts_dropout(x, p, true, NULL, &y1));
    ts_manual_seed(1234);
    TH_OK(ts_dropout(x, p, true, NULL, &y2));
    th_vals(y1, a, 2000);
    th_vals(y2, b, 2000);
    int kept = 0;
    for (int i = 0; i < 2000; i++) {
        cr_assert_eq(a[i], b[i], "same seed, element %d differs: %g vs %g", i, a[i], b[i]);
        cr_assert(xv[i] != 0);
        if (a[i] != 0) {
            kept++;
            /* x * (mask / (1 - p)) in float: two roundings (2.4e-7) */
            cr_assert(fabs(a[i] - xv[i] / (1 - p)) <= 2.4e-7 * fabs(xv[i] / (1 - p)), "[%d] %.9g vs %.9g", i, a[i],
                      xv[i] / (1 - p));
        }
    }
    /* about 70% kept: 1400 of 2000, binomial sd ~20; allow 6 sd */
    cr_assert(kept > 1280 && kept < 1520, "%d of 2000 kept", kept);
    /* backward: the gradient is the mask times 1 / (1 - p) */
    ts_tensor *l;
    TH_OK(ts_sum(y1, 0, NULL, false, &l));
    TH_OK(ts_backward(l, NULL, false));
    double g[2000];
    th_vals(ts_tensor_grad(x), g, 2000);
    for (int i = 0; i < 2000; i++) {
        double want = a[i] != 0 ? 1 / (1 - p) : 0.0;
        cr_assert(fabs(g[i] - want) <= 1.2e-7 * want, "grad [%d] %.9g vs %.9g", i, g[i], want);
    }
    /* a different seed gives a different mask */
    ts_tensor *y3;
    ts_manual_seed(4321);
    TH_OK(ts_dropout(x, p, true, NULL, &y3));
    double c[2000];
    th_vals(y3, c, 2000);
    int differ = 0;
    for (int i = 0; i < 2000; i++) differ += (a[i] == 0) != (c[i] == 0);
    cr_assert(differ > 100, "masks of two seeds differ in %d places", differ);
    ts_tensor_free(l);
    ts_tensor_free(y1);
    ts_tensor_free(y2);
    ts_tensor_free(y3);
    ts_tensor_free(x);
    th_mem_assert_back();
}

Test(tensor_nn_ops, dropout_explicit_generator_matches_default)
{
    th_mem_mark();
    int64_t s[1] = {64};
    ts_tensor *x = th_seq(TS_F64, 1, s, 1.0, false), *y1, *y2;
    ts_generator *g;
    TH_OK(ts_generator_new(99, &g));
    TH_OK(ts_dropout(x, 0.5, true, g, &y1));
    ts_manual_seed(99);
    TH_OK(ts_dropout(x, 0.5, true, NULL, &y2));
    th_assert_close(y1, y2, 0, 0);
    ts_generator_free(g);
    ts_tensor_free(y1);
    ts_tensor_free(y2);
    ts_tensor_free(x);
    th_mem_assert_back();
}

typedef struct drop_ctx {
    ts_generator *g;
    double p;
} drop_ctx;

static ts_status gc_dropout(ts_tensor **in, ts_tensor **out, void *ctx)
{
    const drop_ctx *c = ctx;
    ts_generator_manual_seed(c->g, 5); /* the same mask on every call */
    return ts_dropout(in[0], c->p, true, c->g, out);
}

Test(tensor_nn_ops, dropout_gradcheck)
{
    th_mem_mark();
    int64_t s[2] = {4, 6};
    ts_generator *g;
    TH_OK(ts_generator_new(0, &g));
    double ps[3] = {0.25, 0.5, 1.0};
    for (int k = 0; k < 3; k++) {
        ts_tensor *in[1] = {th_seq(TS_F64, 2, s, 1.0, true)};
        drop_ctx c = {g, ps[k]};
        th_gradcheck(gc_dropout, 1, in, &c, TH_GC_EPS, TH_GC_ATOL, TH_GC_RTOL);
        cr_assert_not_null(ts_tensor_grad(in[0]), "p = %g", ps[k]);
        ts_tensor_free(in[0]);
    }
    ts_generator_free(g);
    th_mem_assert_back();
}
