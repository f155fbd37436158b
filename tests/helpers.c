#define _GNU_SOURCE
#include "tests/helpers.h"

#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

ts_tensor *th_tensor(ts_dtype dtype, int ndim, const int64_t *shape, const double *vals)
{
    ts_tensor *t;
    TH_OK(ts_tensor_empty(dtype, ndim, shape, &t));
    int64_t n = ts_tensor_numel(t);
    double *buf = NULL;
    size_t es = ts_dtype_size(dtype);
    char *raw = malloc((size_t)(n ? n : 1) * es);
    for (int64_t i = 0; i < n; i++) {
        switch (dtype) {
        case TS_F32: ((float *)raw)[i] = (float)vals[i]; break;
        case TS_F64: ((double *)raw)[i] = vals[i]; break;
        case TS_BF16: ((uint16_t *)raw)[i] = ts_f32_to_bf16((float)vals[i]); break;
        case TS_F16: ((uint16_t *)raw)[i] = ts_f32_to_f16((float)vals[i]); break;
        case TS_I64: ((int64_t *)raw)[i] = (int64_t)vals[i]; break;
        case TS_I32: ((int32_t *)raw)[i] = (int32_t)vals[i]; break;
        case TS_BOOL: ((uint8_t *)raw)[i] = vals[i] != 0; break;
        default: cr_assert_fail("bad dtype");
        }
    }
    ts_tensor_free(t);
    TH_OK(ts_tensor_from_data(dtype, ndim, shape, raw, &t));
    free(raw);
    free(buf);
    return t;
}

ts_tensor *th_seq(ts_dtype dtype, int ndim, const int64_t *shape, double scale, bool rg)
{
    int64_t n = 1;
    for (int i = 0; i < ndim; i++)
        n *= shape[i];
    double *v = malloc((size_t)(n ? n : 1) * sizeof *v);
    for (int64_t i = 0; i < n; i++)
        v[i] = scale * sin(0.7 * (double)i + 0.3) * (1.0 + 0.01 * (double)(i % 7));
    ts_tensor *t = th_tensor(dtype, ndim, shape, v);
    free(v);
    if (rg)
        TH_OK(ts_tensor_set_requires_grad(t, true));
    return t;
}

static double *to_doubles(const ts_tensor *t)
{
    int64_t n = ts_tensor_numel(t);
    double *d = malloc((size_t)(n ? n : 1) * sizeof *d);
    ts_tensor *c;
    TH_OK(ts_to_dtype((ts_tensor *)t, TS_F64, &c));
    TH_OK(ts_tensor_copy_to(c, d, (size_t)n * sizeof *d));
    ts_tensor_free(c);
    return d;
}

void th_assert_close(const ts_tensor *a, const ts_tensor *b, double rtol, double atol)
{
    char s1[96], s2[96];
    cr_assert_eq(ts_tensor_ndim(a), ts_tensor_ndim(b), "ndim %d vs %d (%s vs %s)", ts_tensor_ndim(a), ts_tensor_ndim(b),
                 ts_tensor_shape_str(a, s1, sizeof s1), ts_tensor_shape_str(b, s2, sizeof s2));
    for (int i = 0; i < ts_tensor_ndim(a); i++)
        cr_assert_eq(ts_tensor_shape(a)[i], ts_tensor_shape(b)[i], "shape %s vs %s",
                     ts_tensor_shape_str(a, s1, sizeof s1), ts_tensor_shape_str(b, s2, sizeof s2));
    int64_t n = ts_tensor_numel(a);
    double *x = to_doubles(a), *y = to_doubles(b);
    for (int64_t i = 0; i < n; i++) {
        bool ok = fabs(x[i] - y[i]) <= atol + rtol * fabs(y[i]) || (isnan(x[i]) && isnan(y[i])) ||
                  (isinf(x[i]) && x[i] == y[i]);
        if (!ok) {
            double xi = x[i], yi = y[i];
            free(x);
            free(y);
            cr_assert_fail("element %lld differs: %.9g vs %.9g (rtol %g, atol %g)", (long long)i, xi, yi, rtol, atol);
        }
    }
    free(x);
    free(y);
}

static size_t marks[TS_MEM_TAG_COUNT];

void th_mem_mark(void)
{
    for (int i = 0; i < TS_MEM_TAG_COUNT; i++)
        marks[i] = ts_mem_live_bytes((ts_mem_tag)i);
}

void th_mem_assert_back(void)
{
    for (int i = 0; i < TS_MEM_TAG_COUNT; i++) {
        if (i == TS_MEM_POOL)
            continue; /* the pool keeps freed blocks cached by design */
        size_t now = ts_mem_live_bytes((ts_mem_tag)i);
        cr_assert_eq(now, marks[i], "memory tag '%s': %zu live bytes, %zu at the mark (leak of %lld bytes)",
                     ts_mem_tag_name((ts_mem_tag)i), now, marks[i], (long long)now - (long long)marks[i]);
    }
}

static double weighted_sum(th_fn fn, int n, ts_tensor **inputs, void *ctx, const double *w, int64_t wn)
{
    ts_tensor *out;
    TH_OK(fn(inputs, &out, ctx));
    cr_assert_eq(ts_tensor_numel(out), wn, "gradcheck: output size changed");
    double *o = to_doubles(out);
    double s = 0;
    for (int64_t i = 0; i < wn; i++)
        s += o[i] * w[i];
    free(o);
    ts_tensor_free(out);
    (void)n;
    return s;
}

void th_gradcheck(th_fn fn, int n, ts_tensor **inputs, void *ctx, double eps, double atol, double rtol)
{
    ts_tensor *out;
    TH_OK(fn(inputs, &out, ctx));
    int64_t wn = ts_tensor_numel(out);
    double *w = malloc((size_t)(wn ? wn : 1) * sizeof *w);
    for (int64_t i = 0; i < wn; i++)
        w[i] = 0.5 + 0.25 * cos(1.3 * (double)i);
    ts_tensor *wt = th_tensor(ts_tensor_dtype(out), ts_tensor_ndim(out), ts_tensor_shape(out), w);
    for (int i = 0; i < n; i++)
        if (inputs[i] && ts_tensor_requires_grad(inputs[i]))
            ts_tensor_zero_grad(inputs[i], true);
    if (ts_tensor_requires_grad(out))
        TH_OK(ts_backward(out, wt, false));
    ts_tensor_free(wt);
    ts_tensor_free(out);
    bool prev = ts_grad_mode_set(false);
    for (int i = 0; i < n; i++) {
        ts_tensor *x = inputs[i];
        if (!x || !ts_tensor_requires_grad(x))
            continue;
        cr_assert_eq(ts_tensor_dtype(x), TS_F64, "gradcheck inputs must be float64");
        cr_assert(ts_tensor_is_contiguous(x), "gradcheck inputs must be contiguous");
        int64_t m = ts_tensor_numel(x);
        double *xd = ts_tensor_data(x);
        ts_tensor *g = ts_tensor_grad(x);
        double *gd = g ? to_doubles(g) : NULL;
        for (int64_t j = 0; j < m; j++) {
            double keep = xd[j];
            xd[j] = keep + eps;
            double fp = weighted_sum(fn, n, inputs, ctx, w, wn);
            xd[j] = keep - eps;
            double fm = weighted_sum(fn, n, inputs, ctx, w, wn);
            xd[j] = keep;
            double num = (fp - fm) / (2 * eps), ana = gd ? gd[j] : 0.0;
            if (!(fabs(num - ana) <= atol + rtol * fabs(num))) {
                free(gd);
                free(w);
                ts_grad_mode_set(prev);
                cr_assert_fail("gradcheck: input %d element %lld: analytic %.10g vs numeric %.10g", i, (long long)j,
                               ana, num);
            }
        }
        free(gd);
    }
    ts_grad_mode_set(prev);
    free(w);
}

void *th_read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    cr_assert(f != NULL, "cannot open fixture %s", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    void *buf = malloc((size_t)(n > 0 ? n : 1));
    size_t got = fread(buf, 1, (size_t)n, f);
    fclose(f);
    cr_assert_eq(got, (size_t)n, "short read of %s", path);
    *len = (size_t)n;
    return buf;
}
