#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <string.h>

#include "tests/helpers.h"

static double get2(ts_tensor *t, int64_t i, int64_t j)
{
    double v;
    int64_t ix[2] = {i, j};
    TH_OK(ts_tensor_get(t, ix, &v));
    return v;
}

Test(tensor_views, views_share_storage_and_have_torch_strides)
{
    th_mem_mark();
    int64_t s[3] = {2, 3, 4};
    ts_tensor *a = th_seq(TS_F32, 3, s, 1.0, false), *t, *p, *n, *e, *u, *q, *v;
    TH_OK(ts_transpose(a, 0, 2, &t));
    cr_assert_eq(ts_tensor_storage(t), ts_tensor_storage(a));
    const int64_t *ts_ = ts_tensor_strides(t);
    cr_assert(ts_[0] == 1 && ts_[1] == 4 && ts_[2] == 12, "strides (%lld,%lld,%lld)", (long long)ts_[0],
              (long long)ts_[1], (long long)ts_[2]);
    cr_assert(!ts_tensor_is_contiguous(t));
    int perm[3] = {1, 2, 0};
    TH_OK(ts_permute(a, perm, &p));
    cr_assert(ts_tensor_shape(p)[0] == 3 && ts_tensor_shape(p)[1] == 4 && ts_tensor_shape(p)[2] == 2);
    TH_OK(ts_narrow(a, 1, 1, 2, &n));
    cr_assert_eq(ts_tensor_offset(n), 4);
    cr_assert_eq(ts_tensor_shape(n)[1], 2);
    int64_t es[4] = {5, 2, 3, 4};
    TH_OK(ts_expand(a, 4, es, &e));
    cr_assert_eq(ts_tensor_strides(e)[0], 0);
    TH_OK(ts_unsqueeze(a, 1, &u));
    cr_assert_eq(ts_tensor_ndim(u), 4);
    cr_assert_eq(ts_tensor_shape(u)[1], 1);
    TH_OK(ts_squeeze(u, 1, &q));
    cr_assert_eq(ts_tensor_ndim(q), 3);
    int64_t vs[2] = {6, -1};
    TH_OK(ts_view(a, 2, vs, &v));
    cr_assert_eq(ts_tensor_shape(v)[1], 4);
    cr_assert_eq(ts_tensor_storage(v), ts_tensor_storage(a));
    /* a write through one view is seen by the others */
    bool prev = ts_grad_mode_set(false);
    TH_OK(ts_tensor_fill_(n, 9.0));
    ts_grad_mode_set(prev);
    cr_assert_float_eq(get2(v, 1, 0), 9.0, 0); /* a[0][1][*] is row 1 of the (6, 4) view */
    cr_assert_float_eq(get2(v, 5, 3), 9.0, 0); /* a[1][2][3] */
    cr_assert(get2(v, 3, 0) != 9.0);           /* a[1][0][0] was not in the narrow */
    ts_tensor *all[] = {a, t, p, n, e, u, q, v};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) ts_tensor_free(all[i]);
    th_mem_assert_back();
}

Test(tensor_views, slice_with_step_and_clamping)
{
    int64_t s[1] = {10};
    ts_tensor *a, *b, *c;
    TH_OK(ts_tensor_arange(TS_F64, 0, 10, 1, &a));
    (void)s;
    TH_OK(ts_slice(a, 0, 1, 100, 3, &b)); /* 1, 4, 7 */
    cr_assert_eq(ts_tensor_shape(b)[0], 3);
    double v;
    int64_t i2[1] = {2};
    TH_OK(ts_tensor_get(b, i2, &v));
    cr_assert_float_eq(v, 7.0, 0);
    TH_OK(ts_slice(a, 0, -3, -1, 1, &c)); /* 7, 8 */
    cr_assert_eq(ts_tensor_shape(c)[0], 2);
    int64_t i0[1] = {0};
    TH_OK(ts_tensor_get(c, i0, &v));
    cr_assert_float_eq(v, 7.0, 0);
    ts_tensor_free(a);
    ts_tensor_free(b);
    ts_tensor_free(c);
}

Test(tensor_views, view_of_transposed_is_refused_reshape_copies)
{
    int64_t s[2] = {3, 4}, flat[1] = {12};
    ts_tensor *a = th_seq(TS_F32, 2, s, 1.0, false), *t, *v, *r;
    TH_OK(ts_transpose(a, 0, 1, &t));
    cr_assert_eq(ts_view(t, 1, flat, &v), TS_ERR_NOT_VIEWABLE);
    cr_assert(strstr(ts_last_error(), "(4, 3)") != NULL, "%s", ts_last_error());
    cr_assert(strstr(ts_last_error(), "ts_reshape") != NULL, "%s", ts_last_error());
    TH_OK(ts_reshape(t, 1, flat, &r));
    cr_assert_neq(ts_tensor_storage(r), ts_tensor_storage(a), "reshape had to copy");
    /* element order is the transposed one */
    double v1;
    int64_t i1[1] = {1};
    TH_OK(ts_tensor_get(r, i1, &v1));
    cr_assert_float_eq(v1, get2(a, 1, 0), 0);
    ts_tensor_free(a);
    ts_tensor_free(t);
    ts_tensor_free(r);
}

Test(tensor_views, contiguous_returns_self_when_possible)
{
    int64_t s[2] = {3, 4};
    ts_tensor *a = th_seq(TS_F32, 2, s, 1.0, false), *c, *t, *tc;
    TH_OK(ts_contiguous(a, &c));
    cr_assert_eq(c, a);
    TH_OK(ts_transpose(a, 0, 1, &t));
    TH_OK(ts_contiguous(t, &tc));
    cr_assert(ts_tensor_is_contiguous(tc));
    cr_assert_float_eq(get2(tc, 2, 1), get2(a, 1, 2), 0);
    ts_tensor_free(a);
    ts_tensor_free(c);
    ts_tensor_free(t);
    ts_tensor_free(tc);
}

/* Gradient checks: each view followed by an elementwise op that weights
 * elements differently, so that a wrong index mapping changes the result. */
typedef ts_status (*view_fn)(ts_tensor *in, ts_tensor **out);

static ts_status through(ts_tensor **in, ts_tensor **out, void *ctx)
{
    view_fn f = (view_fn)(uintptr_t)ctx;
    ts_tensor *v, *sq;
    ts_status st = f(in[0], &v);
    if (st) return st;
    st = ts_mul(v, v, &sq);
    ts_tensor_free(v);
    if (!st) {
        st = ts_mul_scalar(sq, 1.5, out);
        ts_tensor_free(sq);
    }
    return st;
}

static ts_status f_transpose(ts_tensor *in, ts_tensor **out) { return ts_transpose(in, 0, 2, out); }
static ts_status f_permute(ts_tensor *in, ts_tensor **out)
{
    int p[3] = {2, 0, 1};
    return ts_permute(in, p, out);
}
static ts_status f_narrow(ts_tensor *in, ts_tensor **out) { return ts_narrow(in, 2, 1, 2, out); }
static ts_status f_slice(ts_tensor *in, ts_tensor **out) { return ts_slice(in, 2, 0, 4, 2, out); }
static ts_status f_view(ts_tensor *in, ts_tensor **out)
{
    int64_t s[2] = {4, 6};
    return ts_view(in, 2, s, out);
}
static ts_status f_reshape_t(ts_tensor *in, ts_tensor **out)
{
    ts_tensor *t;
    ts_status st = ts_transpose(in, 1, 2, &t);
    int64_t s[1] = {24};
    if (!st) st = ts_reshape(t, 1, s, out);
    ts_tensor_free(t);
    return st;
}
static ts_status f_expand(ts_tensor *in, ts_tensor **out)
{
    ts_tensor *n;
    ts_status st = ts_narrow(in, 0, 0, 1, &n);
    int64_t s[3] = {3, 3, 4};
    if (!st) st = ts_expand(n, 3, s, out);
    ts_tensor_free(n);
    return st;
}
static ts_status f_unsq(ts_tensor *in, ts_tensor **out)
{
    ts_tensor *u;
    ts_status st = ts_unsqueeze(in, 1, &u);
    if (!st) st = ts_squeeze(u, 1, out);
    ts_tensor_free(u);
    return st;
}
static ts_status f_contig(ts_tensor *in, ts_tensor **out)
{
    ts_tensor *t;
    ts_status st = ts_transpose(in, 0, 1, &t);
    if (!st) st = ts_contiguous(t, out);
    ts_tensor_free(t);
    return st;
}

Test(tensor_views, every_view_has_a_correct_gradient)
{
    th_mem_mark();
    view_fn fns[] = {f_transpose, f_permute, f_narrow, f_slice, f_view, f_reshape_t, f_expand, f_unsq, f_contig};
    int64_t s[3] = {2, 3, 4};
    for (size_t i = 0; i < sizeof fns / sizeof *fns; i++) {
        ts_tensor *x = th_seq(TS_F64, 3, s, 1.0, true);
        th_gradcheck(through, 1, &x, (void *)(uintptr_t)fns[i], 1e-6, 1e-8, 1e-6);
        ts_tensor_free(x);
    }
    th_mem_assert_back();
}
