/* Reductions (sum, mean, amax, max over a dim) and softmax / log_softmax:
 * values against naive loops, gradients against finite differences, and
 * the optimized f32 kernels against the reference path. */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "tests/helpers.h"

/* Gradchecks use TH_GC_EPS / TH_GC_ATOL / TH_GC_RTOL (helpers.h):
 * truncation ~1e-12 and rounding ~1e-10 on these sums, while a wrong
 * gradient is off by O(1). */

/* ------------------------------------------------------------ naive */

#define D0 2
#define D1 3
#define D2 4
#define NX (D0 * D1 * D2)

enum kind { K_SUM, K_MEAN, K_MAX };

/* Naive reduction of a (2,3,4) row-major array over the dims in mask;
 * writes the keepdim-layout result (row-major over the kept shape) into
 * out and its shapes into kshape / oshape. */
static int naive_reduce(enum kind k, const double *x, const bool mask[3], double *out, int64_t *kshape, int64_t *oshape,
                        int *ond)
{
    int64_t sh[3] = {D0, D1, D2};
    int n = 0;
    for (int d = 0; d < 3; d++) {
        kshape[d] = mask[d] ? 1 : sh[d];
        if (!mask[d]) oshape[n++] = sh[d];
    }
    *ond = n;
    int64_t on = kshape[0] * kshape[1] * kshape[2], count = NX / on;
    for (int64_t i = 0; i < on; i++) out[i] = k == K_MAX ? -INFINITY : 0.0;
    for (int i = 0; i < D0; i++)
        for (int j = 0; j < D1; j++)
            for (int l = 0; l < D2; l++) {
                int64_t oi =
                    (mask[0] ? 0 : i) * kshape[1] * kshape[2] + (mask[1] ? 0 : j) * kshape[2] + (mask[2] ? 0 : l);
                double v = x[(i * D1 + j) * D2 + l];
                if (k == K_MAX) out[oi] = v > out[oi] ? v : out[oi];
                else out[oi] += v;
            }
    if (k == K_MEAN)
        for (int64_t i = 0; i < on; i++) out[i] /= (double)count;
    return (int)on;
}

typedef ts_status (*reduce_fn)(ts_tensor *, int, const int *, bool, ts_tensor **);

static const struct {
    const char *name;
    reduce_fn fn;
    enum kind k;
} reducers[] = {{"sum", ts_sum, K_SUM}, {"mean", ts_mean, K_MEAN}, {"amax", ts_amax, K_MAX}};
#define N_RED 3

/* dim lists, with negative and unordered entries; ndims 0 = all */
static const struct {
    int n;
    int dims[3];
} dimsets[] = {
    {1, {0}},     {1, {1}},    {1, {2}},     {1, {-1}},      {1, {-3}},       {2, {0, 2}},
    {2, {-1, 0}}, {2, {1, 2}}, {2, {2, -2}}, {3, {0, 1, 2}}, {3, {2, 0, -2}}, {0, {0}},
};
#define N_DIMSETS ((int)(sizeof dimsets / sizeof *dimsets))

static void dims_mask(int n, const int *dims, bool mask[3])
{
    for (int d = 0; d < 3; d++) mask[d] = n == 0;
    for (int i = 0; i < n; i++) mask[(dims[i] + 3) % 3] = true;
}

Test(tensor_reduce, sum_mean_amax_match_naive_loops)
{
    th_mem_mark();
    int64_t s[3] = {D0, D1, D2};
    for (int dt = 0; dt < 2; dt++) {
        ts_dtype d = dt ? TS_F64 : TS_F32;
        ts_tensor *x = th_seq(d, 3, s, 2.0, false);
        double xv[NX];
        th_vals(x, xv, NX);
        for (int r = 0; r < N_RED; r++)
            for (int ds = 0; ds < N_DIMSETS; ds++)
                for (int keep = 0; keep < 2; keep++) {
                    bool mask[3];
                    dims_mask(dimsets[ds].n, dimsets[ds].dims, mask);
                    double want[NX], got[NX];
                    int64_t kshape[3], oshape[3];
                    int ond;
                    int on = naive_reduce(reducers[r].k, xv, mask, want, kshape, oshape, &ond);
                    ts_tensor *o;
                    TH_OK(reducers[r].fn(x, dimsets[ds].n, dimsets[ds].dims, keep, &o));
                    if (keep) th_assert_shape(o, 3, kshape);
                    else th_assert_shape(o, ond, oshape);
                    cr_assert_eq(ts_tensor_dtype(o), d);
                    th_vals(o, got, on);
                    /* sums accumulate in double and are rounded once to the
                     * dtype: within an ulp of float32 (6e-8 relative, and
                     * absolute 1e-7 for sums that cancel to near 0); amax is
                     * exact */
                    double rtol = reducers[r].k == K_MAX ? 0 : dt ? 1e-14 : 1.2e-7;
                    double atol = reducers[r].k == K_MAX ? 0 : dt ? 1e-14 : 1e-7;
                    for (int i = 0; i < on; i++)
                        cr_assert(fabs(got[i] - want[i]) <= atol + rtol * fabs(want[i]),
                                  "%s %s dimset %d keepdim %d [%d]: %.9g vs %.9g", ts_dtype_name(d), reducers[r].name,
                                  ds, keep, i, got[i], want[i]);
                    ts_tensor_free(o);
                }
        ts_tensor_free(x);
    }
    th_mem_assert_back();
}

Test(tensor_reduce, hand_computed_values)
{
    th_mem_mark();
    int64_t s[2] = {2, 3};
    double v[6] = {1, 2, 3, 4, 5, 6};
    ts_tensor *x = th_tensor(TS_F32, 2, s, v), *o;
    double got[3];
    int d0 = 0, d1 = -1;
    TH_OK(ts_sum(x, 1, &d0, false, &o));
    th_vals(o, got, 3);
    cr_assert(got[0] == 5 && got[1] == 7 && got[2] == 9, "sum dim 0: %g %g %g", got[0], got[1], got[2]);
    ts_tensor_free(o);
    TH_OK(ts_mean(x, 1, &d1, true, &o));
    int64_t ks[2] = {2, 1};
    th_assert_shape(o, 2, ks);
    th_vals(o, got, 2);
    cr_assert(got[0] == 2 && got[1] == 5, "mean dim -1: %g %g", got[0], got[1]);
    ts_tensor_free(o);
    TH_OK(ts_amax(x, 0, NULL, false, &o));
    cr_assert_eq(ts_tensor_ndim(o), 0);
    th_vals(o, got, 1);
    cr_assert_eq(got[0], 6);
    ts_tensor_free(o);
    TH_OK(ts_mean(x, 0, NULL, false, &o));
    th_vals(o, got, 1);
    cr_assert_eq(got[0], 3.5);
    ts_tensor_free(o);
    ts_tensor_free(x);
    th_mem_assert_back();
}

Test(tensor_reduce, non_contiguous_and_zero_dim_inputs)
{
    th_mem_mark();
    int64_t s[2] = {4, 3};
    ts_tensor *x = th_seq(TS_F32, 2, s, 1.0, false), *xt, *xc;
    TH_OK(ts_transpose(x, 0, 1, &xt));
    TH_OK(ts_contiguous(xt, &xc));
    for (int r = 0; r < N_RED; r++)
        for (int dim = -2; dim < 2; dim++) {
            ts_tensor *o1, *o2;
            TH_OK(reducers[r].fn(xt, 1, &dim, false, &o1));
            TH_OK(reducers[r].fn(xc, 1, &dim, false, &o2));
            /* both accumulate in double in the same element order along the
             * reduced dim: identical after rounding to float */
            th_assert_close(o1, o2, 0, 0);
            ts_tensor_free(o1);
            ts_tensor_free(o2);
        }
    /* a 0-d tensor reduces to itself; dim 0 and -1 name its only "dim" */
    ts_tensor *z, *o;
    TH_OK(ts_tensor_scalar(TS_F64, 2.5, &z));
    int dz = -1;
    for (int r = 0; r < N_RED; r++) {
        TH_OK(reducers[r].fn(z, 1, &dz, false, &o));
        cr_assert_eq(ts_tensor_ndim(o), 0);
        double v;
        TH_OK(ts_tensor_item(o, &v));
        cr_assert_eq(v, 2.5, "%s of a 0-d tensor: %g", reducers[r].name, v);
        ts_tensor_free(o);
    }
    ts_tensor_free(z);
    ts_tensor_free(x);
    ts_tensor_free(xt);
    ts_tensor_free(xc);
    th_mem_assert_back();
}

Test(tensor_reduce, bad_dim_lists_are_refused)
{
    th_mem_mark();
    int64_t s[2] = {2, 3};
    ts_tensor *x = th_seq(TS_F32, 2, s, 1.0, false), *o = NULL;
    int bad[1] = {2}, neg[1] = {-3}, dup[2] = {1, -1};
    for (int r = 0; r < N_RED; r++) {
        cr_assert_eq(reducers[r].fn(x, 1, bad, false, &o), TS_ERR_INDEX);
        cr_assert(strstr(ts_last_error(), "dimension 2") != NULL, "%s", ts_last_error());
        cr_assert(strstr(ts_last_error(), reducers[r].name) != NULL, "%s", ts_last_error());
        cr_assert_eq(reducers[r].fn(x, 1, neg, false, &o), TS_ERR_INDEX);
        cr_assert_eq(reducers[r].fn(x, 2, dup, false, &o), TS_ERR_INVALID_ARGUMENT);
        cr_assert(strstr(ts_last_error(), "twice") != NULL, "%s", ts_last_error());
        cr_assert_null(o);
    }
    /* amax over zero elements has no value */
    int64_t se[2] = {0, 3};
    ts_tensor *e;
    TH_OK(ts_tensor_zeros(TS_F32, 2, se, &e));
    int d0 = 0;
    cr_assert_eq(ts_amax(e, 1, &d0, false, &o), TS_ERR_SHAPE);
    /* while sum over zero elements is 0 */
    TH_OK(ts_sum(e, 1, &d0, false, &o));
    double v[3];
    th_vals(o, v, 3);
    cr_assert(v[0] == 0 && v[1] == 0 && v[2] == 0);
    ts_tensor_free(o);
    ts_tensor_free(e);
    ts_tensor_free(x);
    th_mem_assert_back();
}

Test(tensor_reduce, random_views_match_contiguous_copies)
{
    th_mem_mark();
    uint32_t st = 4242;
    for (int it = 0; it < 300; it++) {
        int nd = 1 + (int)(th_lcg(&st) % 4);
        int64_t sh[4];
        for (int i = 0; i < nd; i++) sh[i] = 1 + th_lcg(&st) % 5;
        ts_dtype d = it % 2 ? TS_F64 : TS_F32;
        /* a permuted view with a step-2 slice on one dim */
        int64_t bs[4];
        int perm[4] = {0, 1, 2, 3}, inv[4];
        for (int i = nd - 1; i > 0; i--) {
            int j = (int)(th_lcg(&st) % (uint32_t)(i + 1)), t = perm[i];
            perm[i] = perm[j];
            perm[j] = t;
        }
        for (int i = 0; i < nd; i++) inv[perm[i]] = i;
        int sd = (int)(th_lcg(&st) % (uint32_t)nd);
        for (int i = 0; i < nd; i++) bs[i] = sh[perm[i]] * (perm[i] == sd ? 2 : 1);
        ts_tensor *base = th_seq(d, nd, bs, 3.0, false), *p, *x, *xc;
        TH_OK(ts_permute(base, inv, &p));
        TH_OK(ts_slice(p, sd, 0, 2 * sh[sd], 2, &x));
        TH_OK(ts_contiguous(x, &xc));
        int dims[4], n = (int)(th_lcg(&st) % (uint32_t)(nd + 1)), k = 0;
        for (int i = 0; i < nd && k < n; i++)
            if (th_lcg(&st) % 2) dims[k++] = th_lcg(&st) % 2 ? i : i - nd;
        bool keep = th_lcg(&st) % 2;
        int r = it % N_RED;
        ts_tensor *o1, *o2;
        TH_OK(reducers[r].fn(x, k, dims, keep, &o1));
        TH_OK(reducers[r].fn(xc, k, dims, keep, &o2));
        /* the strided and the contiguous input are summed in double in
         * different orders: within an ulp of the dtype after rounding */
        th_assert_close(o1, o2, d == TS_F64 ? 1e-14 : 1.2e-7, d == TS_F64 ? 1e-14 : 1e-6);
        ts_tensor_free(o1);
        ts_tensor_free(o2);
        int sdim = (int)(th_lcg(&st) % (uint32_t)nd);
        TH_OK(it % 2 ? ts_log_softmax(x, sdim, &o1) : ts_softmax(x, sdim, &o1));
        TH_OK(it % 2 ? ts_log_softmax(xc, sdim, &o2) : ts_softmax(xc, sdim, &o2));
        th_assert_close(o1, o2, 0, 0); /* both are copied to the same layout first */
        ts_tensor_free(o1);
        ts_tensor_free(o2);
        ts_tensor_free(base);
        ts_tensor_free(p);
        ts_tensor_free(x);
        ts_tensor_free(xc);
    }
    th_mem_assert_back();
}

/* ------------------------------------------------------------ max_dim */

Test(tensor_reduce, max_dim_values_and_first_indices)
{
    th_mem_mark();
    /* ties: row 0 has its maximum 5 at columns 1 and 3 -> index 1;
     * column maxima: col 0 has 2 at rows 1 and 2 -> index 1 */
    int64_t s[2] = {3, 4};
    double v[12] = {0, 5, -1, 5, 2, 1, 7, 3, 2, 4, 7, -9};
    ts_tensor *x = th_tensor(TS_F32, 2, s, v), *val, *idx;
    TH_OK(ts_max_dim(x, 1, false, &val, &idx));
    int64_t s3[1] = {3}, s4[1] = {4};
    th_assert_shape(val, 1, s3);
    th_assert_shape(idx, 1, s3);
    cr_assert_eq(ts_tensor_dtype(idx), TS_I64);
    double gv[4], gi[4];
    th_vals(val, gv, 3);
    th_vals(idx, gi, 3);
    double wv[3] = {5, 7, 7}, wi[3] = {1, 2, 2};
    for (int i = 0; i < 3; i++)
        cr_assert(gv[i] == wv[i] && gi[i] == wi[i], "row %d: value %g index %g", i, gv[i], gi[i]);
    ts_tensor_free(val);
    ts_tensor_free(idx);
    TH_OK(ts_max_dim(x, -2, true, &val, &idx));
    int64_t k[2] = {1, 4};
    th_assert_shape(val, 2, k);
    th_assert_shape(idx, 2, k);
    th_vals(val, gv, 4);
    th_vals(idx, gi, 4);
    double cv[4] = {2, 5, 7, 5}, ci[4] = {1, 0, 1, 0};
    for (int i = 0; i < 4; i++)
        cr_assert(gv[i] == cv[i] && gi[i] == ci[i], "col %d: value %g index %g", i, gv[i], gi[i]);
    ts_tensor_free(val);
    ts_tensor_free(idx);
    /* indices may be omitted */
    TH_OK(ts_max_dim(x, 0, false, &val, NULL));
    th_assert_shape(val, 1, s4);
    ts_tensor_free(val);
    /* out-of-range dims and 0-d inputs are refused */
    cr_assert_eq(ts_max_dim(x, 2, false, &val, &idx), TS_ERR_INDEX);
    ts_tensor *z;
    TH_OK(ts_tensor_scalar(TS_F32, 1, &z));
    cr_assert_eq(ts_max_dim(z, 0, false, &val, &idx), TS_ERR_INDEX);
    ts_tensor_free(z);
    ts_tensor_free(x);
    th_mem_assert_back();
}

Test(tensor_reduce, max_dim_on_three_dims_matches_naive)
{
    th_mem_mark();
    /* x is a permuted (non-contiguous) view of a (4,3,2) tensor */
    int64_t s[3] = {D2, D1, D0};
    ts_tensor *x = th_seq(TS_F64, 3, s, 1.0, false), *tx;
    int perm[3] = {2, 1, 0};
    TH_OK(ts_permute(x, perm, &tx));
    cr_assert(!ts_tensor_is_contiguous(tx));
    double xv[NX];
    th_vals(tx, xv, NX);
    for (int dim = 0; dim < 3; dim++) {
        ts_tensor *val, *idx;
        TH_OK(ts_max_dim(tx, dim, false, &val, &idx));
        int64_t sh[3] = {D0, D1, D2};
        int n = NX / (int)sh[dim];
        double gv[NX], gi[NX];
        th_vals(val, gv, n);
        th_vals(idx, gi, n);
        int o = 0;
        for (int i = 0; i < (dim == 0 ? 1 : D0); i++)
            for (int j = 0; j < (dim == 1 ? 1 : D1); j++)
                for (int l = 0; l < (dim == 2 ? 1 : D2); l++, o++) {
                    double best = -INFINITY;
                    int bi = -1;
                    for (int r = 0; r < sh[dim]; r++) {
                        int ii = dim == 0 ? r : i, jj = dim == 1 ? r : j, ll = dim == 2 ? r : l;
                        double v = xv[(ii * D1 + jj) * D2 + ll];
                        if (v > best) {
                            best = v;
                            bi = r;
                        }
                    }
                    cr_assert(gv[o] == best && gi[o] == bi, "dim %d out %d: %g@%g vs %g@%d", dim, o, gv[o], gi[o], best,
                              bi);
                }
        ts_tensor_free(val);
        ts_tensor_free(idx);
    }
    ts_tensor_free(tx);
    ts_tensor_free(x);
    th_mem_assert_back();
}

Test(tensor_reduce, max_dim_gradient_goes_to_first_maximum)
{
    th_mem_mark();
    int64_t s[2] = {2, 3};
    double v[6] = {1, 4, 4, 9, 2, 9};
    ts_tensor *x = th_tensor(TS_F64, 2, s, v), *val, *l;
    TH_OK(ts_tensor_set_requires_grad(x, true));
    TH_OK(ts_max_dim(x, 1, false, &val, NULL));
    TH_OK(ts_sum(val, 0, NULL, false, &l));
    TH_OK(ts_backward(l, NULL, false));
    double g[6], want[6] = {0, 1, 0, 1, 0, 0};
    th_vals(ts_tensor_grad(x), g, 6);
    for (int i = 0; i < 6; i++) cr_assert_eq(g[i], want[i], "grad [%d] = %g", i, g[i]);
    ts_tensor_free(val);
    ts_tensor_free(l);
    ts_tensor_free(x);
    th_mem_assert_back();
}

Test(tensor_reduce, amax_gradient_is_shared_between_ties)
{
    th_mem_mark();
    int64_t s[2] = {2, 4};
    double v[8] = {1, 3, 3, 2, 5, 5, 5, 0};
    ts_tensor *x = th_tensor(TS_F64, 2, s, v), *m, *l;
    TH_OK(ts_tensor_set_requires_grad(x, true));
    int d = 1;
    TH_OK(ts_amax(x, 1, &d, false, &m));
    TH_OK(ts_sum(m, 0, NULL, false, &l));
    TH_OK(ts_backward(l, NULL, false));
    double g[8], want[8] = {0, 0.5, 0.5, 0, 1.0 / 3, 1.0 / 3, 1.0 / 3, 0};
    th_vals(ts_tensor_grad(x), g, 8);
    for (int i = 0; i < 8; i++)
        cr_assert(fabs(g[i] - want[i]) < 1e-15, "grad [%d] = %.17g, expected %.17g", i, g[i], want[i]);
    ts_tensor_free(m);
    ts_tensor_free(l);
    ts_tensor_free(x);
    th_mem_assert_back();
}

/* ------------------------------------------------------------ softmax */

static void naive_softmax(const double *x, double *y, int dim, bool log_form)
{
    int64_t sh[3] = {D0, D1, D2}, st[3] = {D1 * D2, D2, 1};
    for (int i = 0; i < NX; i++) {
        int64_t c = (i / st[dim]) % sh[dim], base = i - c * st[dim];
        double mx = -INFINITY, s = 0;
        for (int r = 0; r < sh[dim]; r++) mx = fmax(mx, x[base + r * st[dim]]);
        for (int r = 0; r < sh[dim]; r++) s += exp(x[base + r * st[dim]] - mx);
        y[i] = log_form ? x[i] - mx - log(s) : exp(x[i] - mx) / s;
    }
}

Test(tensor_reduce, softmax_and_log_softmax_on_every_dim)
{
    th_mem_mark();
    int64_t s[3] = {D0, D1, D2};
    for (int dt = 0; dt < 2; dt++) {
        ts_dtype d = dt ? TS_F64 : TS_F32;
        ts_tensor *x = th_seq(d, 3, s, 3.0, false);
        double xv[NX];
        th_vals(x, xv, NX);
        for (int dim = -3; dim < 3; dim++)
            for (int lf = 0; lf < 2; lf++) {
                ts_tensor *o;
                TH_OK(lf ? ts_log_softmax(x, dim, &o) : ts_softmax(x, dim, &o));
                th_assert_shape(o, 3, s);
                cr_assert_eq(ts_tensor_dtype(o), d);
                double got[NX], want[NX];
                th_vals(o, got, NX);
                naive_softmax(xv, want, (dim + 3) % 3, lf);
                /* float32: expf and a float subtraction per element,
                 * sum in double: a few ulp of the result (values <= ~6 in
                 * magnitude for log_softmax): 1e-6 relative + 1e-6 abs */
                double rtol = dt ? 1e-13 : 1e-6, atol = dt ? 1e-14 : 1e-6;
                for (int i = 0; i < NX; i++)
                    cr_assert(fabs(got[i] - want[i]) <= atol + rtol * fabs(want[i]), "%s %s dim %d [%d]: %.9g vs %.9g",
                              ts_dtype_name(d), lf ? "log_softmax" : "softmax", dim, i, got[i], want[i]);
                ts_tensor_free(o);
            }
        ts_tensor_free(x);
    }
    th_mem_assert_back();
}

Test(tensor_reduce, softmax_is_stable_and_handles_minus_infinity)
{
    th_mem_mark();
    int64_t s[2] = {2, 3};
    double v[6] = {1000, 1001, 1002, -INFINITY, 0, -INFINITY};
    for (int dt = 0; dt < 2; dt++) {
        ts_tensor *x = th_tensor(dt ? TS_F64 : TS_F32, 2, s, v), *p, *lp;
        TH_OK(ts_softmax(x, 1, &p));
        TH_OK(ts_log_softmax(x, 1, &lp));
        double g[6], gl[6];
        th_vals(p, g, 6);
        th_vals(lp, gl, 6);
        /* softmax(0, 1, 2) by hand: e^k / (1 + e + e^2) */
        double den = 1 + exp(1.0) + exp(2.0);
        double tol = dt ? 1e-15 : 1e-7; /* float32: an ulp or two of ~0.66 */
        for (int i = 0; i < 3; i++) {
            cr_assert(fabs(g[i] - exp((double)i) / den) <= tol, "row 0 [%d]: %.17g", i, g[i]);
            cr_assert(fabs(gl[i] - ((double)i - log(den))) <= 4 * tol, "log row 0 [%d]: %.17g", i, gl[i]);
        }
        cr_assert(g[3] == 0 && g[4] == 1 && g[5] == 0, "row 1: %g %g %g", g[3], g[4], g[5]);
        cr_assert(gl[3] == -INFINITY && gl[4] == 0 && gl[5] == -INFINITY, "log row 1: %g %g %g", gl[3], gl[4], gl[5]);
        ts_tensor_free(p);
        ts_tensor_free(lp);
        ts_tensor_free(x);
    }
    /* 0-d: softmax is 1, log_softmax 0 */
    ts_tensor *z, *o;
    TH_OK(ts_tensor_scalar(TS_F32, 3.0, &z));
    TH_OK(ts_softmax(z, 0, &o));
    double v1;
    TH_OK(ts_tensor_item(o, &v1));
    cr_assert_eq(v1, 1.0);
    ts_tensor_free(o);
    TH_OK(ts_log_softmax(z, -1, &o));
    TH_OK(ts_tensor_item(o, &v1));
    cr_assert_eq(v1, 0.0);
    ts_tensor_free(o);
    cr_assert_eq(ts_softmax(z, 1, &o), TS_ERR_INDEX);
    ts_tensor_free(z);
    th_mem_assert_back();
}

/* ------------------------------------------------------------ gradients */

typedef struct red_ctx {
    int which; /* index into reducers, or 3 = max_dim, 4 = softmax, 5 = log_softmax */
    int n;
    const int *dims;
    bool keepdim;
    bool transpose; /* reduce the transposed (dims 0 and 2 swapped) view */
} red_ctx;

static ts_status gc_reduce(ts_tensor **in, ts_tensor **out, void *ctx)
{
    const red_ctx *c = ctx;
    ts_tensor *x = in[0], *xt = NULL;
    ts_status st;
    if (c->transpose) {
        if ((st = ts_transpose(x, 0, -1, &xt))) return st;
        x = xt;
    }
    switch (c->which) {
    case 0:
    case 1:
    case 2: st = reducers[c->which].fn(x, c->n, c->dims, c->keepdim, out); break;
    case 3: st = ts_max_dim(x, c->dims[0], c->keepdim, out, NULL); break;
    case 4: st = ts_softmax(x, c->dims[0], out); break;
    default: st = ts_log_softmax(x, c->dims[0], out); break;
    }
    ts_tensor_free(xt);
    return st;
}

Test(tensor_reduce, gradcheck_sum_mean_amax)
{
    th_mem_mark();
    int64_t s[3] = {D0, D1, D2};
    for (int r = 0; r < N_RED; r++)
        for (int ds = 0; ds < N_DIMSETS; ds++)
            for (int keep = 0; keep < 2; keep++)
                for (int tr = 0; tr < 2; tr++) {
                    /* th_seq values are distinct, so amax has no ties and is
                     * differentiable at these points */
                    ts_tensor *in[1] = {th_seq(TS_F64, 3, s, 1.0, true)};
                    red_ctx c = {r, dimsets[ds].n, dimsets[ds].dims, keep, tr};
                    th_gradcheck(gc_reduce, 1, in, &c, TH_GC_EPS, TH_GC_ATOL, TH_GC_RTOL);
                    cr_assert_not_null(ts_tensor_grad(in[0]));
                    th_assert_shape(ts_tensor_grad(in[0]), 3, s);
                    ts_tensor_free(in[0]);
                }
    th_mem_assert_back();
}

Test(tensor_reduce, gradcheck_max_dim_softmax_log_softmax)
{
    th_mem_mark();
    int64_t s[3] = {D0, D1, D2};
    for (int which = 3; which < 6; which++)
        for (int dim = -3; dim < 3; dim++)
            for (int keep = 0; keep < 2; keep++)
                for (int tr = 0; tr < 2; tr++) {
                    ts_tensor *in[1] = {th_seq(TS_F64, 3, s, 2.0, true)};
                    red_ctx c = {which, 1, &dim, keep, tr};
                    th_gradcheck(gc_reduce, 1, in, &c, TH_GC_EPS, TH_GC_ATOL, TH_GC_RTOL);
                    cr_assert_not_null(ts_tensor_grad(in[0]), "which %d dim %d", which, dim);
                    ts_tensor_free(in[0]);
                }
    th_mem_assert_back();
}

Test(tensor_reduce, gradient_hand_values)
{
    th_mem_mark();
    /* mean over 4 elements gives 1/4 each; sum gives 1 */
    int64_t s[1] = {4};
    ts_tensor *x = th_seq(TS_F32, 1, s, 1.0, true), *o;
    TH_OK(ts_mean(x, 0, NULL, false, &o));
    TH_OK(ts_backward(o, NULL, false));
    double g[4];
    th_vals(ts_tensor_grad(x), g, 4);
    for (int i = 0; i < 4; i++) cr_assert_eq(g[i], 0.25);
    ts_tensor_free(o);
    ts_tensor_zero_grad(x, true);
    /* softmax gradient of sum is zero (the outputs always sum to 1) */
    ts_tensor *p;
    TH_OK(ts_softmax(x, 0, &p));
    TH_OK(ts_sum(p, 0, NULL, false, &o));
    TH_OK(ts_backward(o, NULL, false));
    th_vals(ts_tensor_grad(x), g, 4);
    for (int i = 0; i < 4; i++) cr_assert(fabs(g[i]) < 1e-7, "[%d] %g", i, g[i]); /* float rounding of y*(1 - sum y) */
    ts_tensor_free(o);
    ts_tensor_free(p);
    ts_tensor_free(x);
    th_mem_assert_back();
}

/* ------------------------------------------------- optimized vs reference */

Test(tensor_reduce, optimized_matches_reference)
{
    th_mem_mark();
    int64_t s[3] = {3, 5, 17};
    ts_tensor *x0 = th_seq(TS_F32, 3, s, 4.0, false);
    for (int which = 0; which < 6; which++)
        for (int ds = 0; ds < N_DIMSETS; ds++)
            for (int tr = 0; tr < 2; tr++) {
                if (which >= 3 && (dimsets[ds].n != 1)) continue; /* one dim for max_dim / softmax */
                red_ctx c = {which, dimsets[ds].n, dimsets[ds].dims, false, tr};
                /* sums: both paths accumulate in double, in a different
                 * association, and round once: at most 1 ulp (1.2e-7
                 * relative; 1e-6 absolute for sums that cancel, about an ulp
                 * of the largest partial sum ~30). softmax: float expf and
                 * float arithmetic against double: a few ulp, 1e-6. The
                 * same for values and gradients. */
                th_assert_kernels_agree(gc_reduce, 1, &x0, &c, 0.9, 1e-6, 1e-6, 1e-6, 1e-6);
            }
    ts_tensor_free(x0);
    th_mem_assert_back();
}
