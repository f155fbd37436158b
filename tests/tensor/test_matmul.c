/* matmul (every form of torch.matmul) and linear: against a naive triple
 * loop, the BLIS path against the reference kernels, transposed views
 * without copies, and gradients against finite differences. */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/helpers.h"

/* Gradchecks use TH_GC_EPS / TH_GC_ATOL / TH_GC_RTOL (helpers.h): matmul is
 * bilinear, so the truncation error is 0 and rounding ~1e-10, while a
 * transposed or unreduced gradient is off by O(1). */

/* ------------------------------------------------------------ naive */

/* torch.matmul by the definition: 1-d operands promoted ((k) -> (1, k) on
 * the left, (k, 1) on the right) and their dim removed from the result;
 * batch dims broadcast. Returns a new f64 tensor. */
static ts_tensor *naive_matmul(ts_tensor *ta, ts_tensor *tb)
{
    int na = ts_tensor_ndim(ta), nb = ts_tensor_ndim(tb);
    const int64_t *sa = ts_tensor_shape(ta), *sb = ts_tensor_shape(tb);
    double *A = th_vals_new(ta), *B = th_vals_new(tb);
    int64_t m = na == 1 ? 1 : sa[na - 2], k = sa[na - 1], n = nb == 1 ? 1 : sb[nb - 1];
    int ba = na > 2 ? na - 2 : 0, bb = nb > 2 ? nb - 2 : 0, nbat = ba > bb ? ba : bb;
    int64_t bs[TS_MAX_DIMS], nbatch = 1;
    for (int i = 0; i < nbat; i++) {
        int ia = i - (nbat - ba), ib = i - (nbat - bb);
        int64_t x = ia >= 0 ? sa[ia] : 1, y = ib >= 0 ? sb[ib] : 1;
        bs[i] = x == 1 ? y : x;
        nbatch *= bs[i];
    }
    int64_t os[TS_MAX_DIMS];
    int no = 0;
    for (int i = 0; i < nbat; i++) os[no++] = bs[i];
    if (na > 1) os[no++] = m;
    if (nb > 1) os[no++] = n;
    int64_t total = nbatch * m * n;
    double *O = calloc((size_t)(total > 0 ? total : 1), sizeof *O);
    for (int64_t bi = 0; bi < nbatch; bi++) {
        /* batch offsets of a and b (broadcast dims repeat element 0) */
        int64_t rem = bi, offa = 0, offb = 0, mula = m * k, mulb = k * n;
        for (int i = nbat - 1; i >= 0; i--) {
            int64_t idx = rem % bs[i];
            rem /= bs[i];
            int ia = i - (nbat - ba), ib = i - (nbat - bb);
            if (ia >= 0) {
                offa += (sa[ia] == 1 ? 0 : idx) * mula;
                mula *= sa[ia];
            }
            if (ib >= 0) {
                offb += (sb[ib] == 1 ? 0 : idx) * mulb;
                mulb *= sb[ib];
            }
        }
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < n; j++) {
                double s = 0;
                for (int64_t p = 0; p < k; p++) s += A[offa + i * k + p] * B[offb + p * n + j];
                O[(bi * m + i) * n + j] = s;
            }
    }
    ts_tensor *o;
    TH_OK(ts_tensor_from_data(TS_F64, no, os, O, &o));
    free(A);
    free(B);
    free(O);
    return o;
}

/* x (..., in) @ w (out, in)^T + b, naive */
static ts_tensor *naive_linear(ts_tensor *x, ts_tensor *w, ts_tensor *b)
{
    ts_tensor *wt, *o;
    TH_OK(ts_transpose(w, 0, 1, &wt));
    o = naive_matmul(x, wt);
    ts_tensor_free(wt);
    if (b) {
        ts_tensor *b64, *s;
        bool prev = ts_grad_mode_set(false);
        TH_OK(ts_to_dtype(b, TS_F64, &b64));
        TH_OK(ts_add(o, b64, &s));
        ts_grad_mode_set(prev);
        ts_tensor_free(b64);
        ts_tensor_free(o);
        o = s;
    }
    return o;
}

/* matmul of in[0] and in[1] for th_gradcheck / th_assert_kernels_agree; ctx, when
 * not NULL, an mm_ctx. */
typedef struct mm_ctx {
    bool ta, tb; /* take the transpose of the stored input (its last two dims) */
} mm_ctx;

static ts_status gc_matmul(ts_tensor **in, ts_tensor **out, void *ctx)
{
    const mm_ctx *c = ctx;
    ts_tensor *a = in[0], *b = in[1], *at = NULL, *bt = NULL;
    ts_status st = TS_OK;
    if (c && c->ta && (st = ts_transpose(a, -1, -2, &at))) return st;
    if (c && c->tb && (st = ts_transpose(b, -1, -2, &bt))) {
        ts_tensor_free(at);
        return st;
    }
    st = ts_matmul(at ? at : a, bt ? bt : b, out);
    ts_tensor_free(at);
    ts_tensor_free(bt);
    return st;
}

/* ------------------------------------------------------------ cases */

typedef struct mm_case {
    const char *name;
    int na, nb;
    int64_t sa[4], sb[4];
    int no;
    int64_t so[4];
} mm_case;

static const mm_case mm_cases[] = {
    {"1d.1d", 1, 1, {3}, {3}, 0, {0}},
    {"1d.2d", 1, 2, {3}, {3, 4}, 1, {4}},
    {"2d.1d", 2, 1, {2, 3}, {3}, 1, {2}},
    {"2d.2d", 2, 2, {2, 3}, {3, 4}, 2, {2, 4}},
    {"3d.3d", 3, 3, {2, 2, 3}, {2, 3, 4}, 3, {2, 2, 4}},
    {"3d.2d fold", 3, 2, {2, 3, 4}, {4, 5}, 3, {2, 3, 5}},
    {"4d.2d fold", 4, 2, {2, 2, 3, 4}, {4, 2}, 4, {2, 2, 3, 2}},
    {"broadcast batch", 3, 3, {1, 3, 4}, {5, 4, 2}, 3, {5, 3, 2}},
    {"broadcast both", 4, 3, {2, 1, 3, 4}, {5, 4, 2}, 4, {2, 5, 3, 2}},
    {"2d.3d", 2, 3, {3, 4}, {2, 4, 5}, 3, {2, 3, 5}},
    {"1d.3d", 1, 3, {3}, {2, 3, 4}, 2, {2, 4}},
    {"3d.1d", 3, 1, {2, 3, 4}, {4}, 2, {2, 3}},
    {"m=1 batch fold", 3, 2, {4, 1, 3}, {3, 2}, 3, {4, 1, 2}},
};
#define N_MM ((int)(sizeof mm_cases / sizeof *mm_cases))

Test(tensor_matmul, every_form_matches_naive_loop)
{
    th_mem_mark();
    for (int c = 0; c < N_MM; c++)
        for (int dt = 0; dt < 2; dt++) {
            const mm_case *mc = &mm_cases[c];
            ts_dtype d = dt ? TS_F64 : TS_F32;
            ts_tensor *a = th_seq(d, mc->na, mc->sa, 1.0, false), *b = th_seq(d, mc->nb, mc->sb, -1.5, false), *o;
            TH_OK(ts_matmul(a, b, &o));
            th_assert_shape(o, mc->no, mc->so);
            cr_assert_eq(ts_tensor_dtype(o), d);
            ts_tensor *want = naive_matmul(a, b);
            /* float32 products of k <= 4 terms of size <= 1.5 accumulated in
             * float by BLIS: a few ulp of values <= ~6 (1e-6 absolute);
             * float64: the same sums in another order (1e-14) */
            th_assert_close(o, want, dt ? 1e-14 : 1e-6, dt ? 1e-14 : 1e-6);
            ts_tensor_free(o);
            ts_tensor_free(want);
            ts_tensor_free(a);
            ts_tensor_free(b);
        }
    th_mem_assert_back();
}

Test(tensor_matmul, hand_computed_products)
{
    th_mem_mark();
    int64_t s23[2] = {2, 3}, s32[2] = {3, 2}, s3[1] = {3};
    double av[6] = {1, 2, 3, 4, 5, 6}, bv[6] = {7, 8, 9, 10, 11, 12}, v[3] = {1, 0, -1};
    ts_tensor *a = th_tensor(TS_F32, 2, s23, av), *b = th_tensor(TS_F32, 2, s32, bv), *x = th_tensor(TS_F32, 1, s3, v),
              *o;
    TH_OK(ts_matmul(a, b, &o));
    double *g = th_vals_new(o);
    cr_assert(g[0] == 58 && g[1] == 64 && g[2] == 139 && g[3] == 154, "%g %g %g %g", g[0], g[1], g[2], g[3]);
    free(g);
    ts_tensor_free(o);
    TH_OK(ts_matmul(a, x, &o));
    g = th_vals_new(o);
    cr_assert(g[0] == -2 && g[1] == -2, "%g %g", g[0], g[1]);
    free(g);
    ts_tensor_free(o);
    TH_OK(ts_matmul(x, x, &o));
    cr_assert_eq(ts_tensor_ndim(o), 0);
    double dot;
    TH_OK(ts_tensor_item(o, &dot));
    cr_assert_eq(dot, 2.0);
    ts_tensor_free(o);
    ts_tensor_free(a);
    ts_tensor_free(b);
    ts_tensor_free(x);
    th_mem_assert_back();
}

Test(tensor_matmul, blis_matches_reference_kernels)
{
    th_mem_mark();
    /* sizes past BLIS's micro-tiles so that its packed kernels run */
    struct {
        int na, nb;
        int64_t sa[3], sb[3];
    } cases[] = {
        {2, 2, {37, 29}, {29, 41}},       {3, 2, {3, 17, 33}, {33, 9}}, /* fold */
        {3, 3, {4, 19, 23}, {4, 23, 13}},                               /* batched */
        {3, 3, {1, 19, 23}, {3, 23, 13}},                               /* broadcast batch */
        {1, 2, {64}, {64, 31}},           {2, 1, {31, 64}, {64}},
    };
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++)
        for (int dt = 0; dt < 2; dt++) {
            ts_dtype d = dt ? TS_F64 : TS_F32;
            ts_tensor *a0 = th_seq(d, cases[c].na, cases[c].sa, 1.0, false),
                      *b0 = th_seq(d, cases[c].nb, cases[c].sb, 1.0, false);
            ts_tensor *in[2] = {a0, b0};
            /* the reference accumulates in double and rounds once; BLIS
             * accumulates in float: error up to k * eps * sum |a||b| with
             * k <= 64 and terms <= 1: 64 * 6e-8 * 64 ~ 2.5e-4 in the worst
             * case, ~1e-5 in practice; float64: ~1e-13 (output and both
             * gradients) */
            double tol = dt ? 1e-12 : 3e-5;
            th_assert_kernels_agree(gc_matmul, 2, in, NULL, 1.0, tol, tol, tol, tol);
            ts_tensor_free(a0);
            ts_tensor_free(b0);
        }
    th_mem_assert_back();
}

/* Peak storage and scratch bytes of one matmul above the live bytes
 * before it. */
static void mm_peak(ts_tensor *a, ts_tensor *b, size_t *storage, size_t *other)
{
    size_t s0 = ts_mem_live_bytes(TS_MEM_STORAGE), o0 = ts_mem_live_bytes(TS_MEM_OTHER);
    ts_mem_reset_peak();
    ts_tensor *o;
    TH_OK(ts_matmul(a, b, &o));
    *storage = ts_mem_peak_bytes(TS_MEM_STORAGE) - s0;
    *other = ts_mem_peak_bytes(TS_MEM_OTHER) - o0;
    ts_tensor_free(o);
}

Test(tensor_matmul, transposed_views_are_used_without_copies)
{
    th_mem_mark();
    /* 2-d: a = A(40,30)^T, b = B(50,40)^T; and batched b = B(3,50,40)^T(1,2) */
    int64_t sA[2] = {40, 30}, sB[2] = {50, 40}, sB3[3] = {3, 50, 40};
    for (int dt = 0; dt < 2; dt++) {
        ts_dtype d = dt ? TS_F64 : TS_F32;
        ts_tensor *A = th_seq(d, 2, sA, 1, false), *B = th_seq(d, 2, sB, 1, false), *B3 = th_seq(d, 3, sB3, 1, false);
        ts_tensor *at, *bt, *b3t, *ac, *bc, *b3c;
        TH_OK(ts_transpose(A, 0, 1, &at));
        TH_OK(ts_transpose(B, 0, 1, &bt));
        TH_OK(ts_transpose(B3, 1, 2, &b3t));
        cr_assert(!ts_tensor_is_contiguous(at) && !ts_tensor_is_contiguous(bt) && !ts_tensor_is_contiguous(b3t));
        TH_OK(ts_contiguous(at, &ac));
        TH_OK(ts_contiguous(bt, &bc));
        TH_OK(ts_contiguous(b3t, &b3c));
        /* same numbers */
        ts_tensor *o1, *o2, *want;
        TH_OK(ts_matmul(at, bt, &o1));
        want = naive_matmul(at, bt);
        /* k = 40 terms of size <= 1 in float: 40 * 6e-8 * 40 ~ 1e-4 worst
         * case; 2e-5 leaves margin over what BLIS shows */
        th_assert_close(o1, want, dt ? 1e-13 : 2e-5, dt ? 1e-13 : 2e-5);
        ts_tensor_free(o1);
        ts_tensor_free(want);
        TH_OK(ts_matmul(at, b3t, &o2));
        want = naive_matmul(at, b3t);
        th_assert_close(o2, want, dt ? 1e-13 : 2e-5, dt ? 1e-13 : 2e-5);
        ts_tensor_free(o2);
        ts_tensor_free(want);
        /* no copy: the transposed operands cost no more storage or scratch
         * than contiguous ones (only the output is allocated) */
        size_t st_t, ot_t, st_c, ot_c;
        mm_peak(at, bt, &st_t, &ot_t);
        mm_peak(ac, bc, &st_c, &ot_c);
        cr_assert_eq(st_t, st_c, "%s 2-d: %zu storage bytes with transposed views, %zu contiguous", ts_dtype_name(d),
                     st_t, st_c);
        cr_assert_eq(ot_t, ot_c, "%s 2-d: %zu scratch bytes with transposed views, %zu contiguous", ts_dtype_name(d),
                     ot_t, ot_c);
        mm_peak(at, b3t, &st_t, &ot_t);
        mm_peak(ac, b3c, &st_c, &ot_c);
        cr_assert_eq(st_t, st_c, "%s batched: %zu vs %zu storage bytes", ts_dtype_name(d), st_t, st_c);
        cr_assert_eq(ot_t, ot_c, "%s batched: %zu vs %zu scratch bytes", ts_dtype_name(d), ot_t, ot_c);
        ts_tensor_free(A);
        ts_tensor_free(B);
        ts_tensor_free(B3);
        ts_tensor_free(at);
        ts_tensor_free(bt);
        ts_tensor_free(b3t);
        ts_tensor_free(ac);
        ts_tensor_free(bc);
        ts_tensor_free(b3c);
    }
    th_mem_assert_back();
}

Test(tensor_matmul, strided_batch_views_match_naive)
{
    th_mem_mark();
    /* a = base(2,6,2,4)[:, ::6] is (2,1,2,4) with strides (48,48,4,1): the
     * size-1 dim's stride equals the batch stride but the batch does not
     * fold into the rows (48 != 2 * 4). Likewise m = 1 rows taken with a
     * step, and a batch of row slices with a gap between batches. */
    int64_t sbase[4] = {2, 6, 2, 4}, sw[2] = {4, 3};
    for (int dt = 0; dt < 2; dt++) {
        ts_dtype d = dt ? TS_F64 : TS_F32;
        ts_tensor *base = th_seq(d, 4, sbase, 1, false), *w = th_seq(d, 2, sw, 1, false), *a1, *a2, *a3, *tmp;
        TH_OK(ts_slice(base, 1, 0, 6, 6, &a1));  /* (2,1,2,4) */
        TH_OK(ts_slice(base, 2, 1, 2, 1, &tmp)); /* (2,6,1,4) */
        TH_OK(ts_slice(tmp, 1, 0, 6, 2, &a2));   /* (2,3,1,4): m = 1 */
        ts_tensor_free(tmp);
        TH_OK(ts_slice(base, 1, 1, 4, 1, &a3)); /* (2,3,2,4), batch gap */
        ts_tensor *as[3] = {a1, a2, a3};
        for (int k = 0; k < 3; k++) {
            ts_tensor *o, *want;
            TH_OK(ts_matmul(as[k], w, &o));
            want = naive_matmul(as[k], w);
            /* k = 4 terms in float: a few ulp (1e-6) */
            th_assert_close(o, want, dt ? 1e-14 : 1e-6, dt ? 1e-14 : 1e-6);
            ts_tensor_free(o);
            ts_tensor_free(want);
            /* and linear through the same flattening */
            ts_tensor *wt;
            TH_OK(ts_transpose(w, 0, 1, &wt));
            TH_OK(ts_linear(as[k], wt, NULL, &o));
            want = naive_matmul(as[k], w);
            th_assert_close(o, want, dt ? 1e-14 : 1e-6, dt ? 1e-14 : 1e-6);
            ts_tensor_free(o);
            ts_tensor_free(want);
            ts_tensor_free(wt);
        }
        ts_tensor_free(a1);
        ts_tensor_free(a2);
        ts_tensor_free(a3);
        ts_tensor_free(base);
        ts_tensor_free(w);
    }
    th_mem_assert_back();
}

/* A random operand of logical shape `shape` (nd dims) built as a view:
 * stored with its last two dims swapped and transposed back, or taken
 * with step 2 from a larger tensor along a random dim, or a size-1 dim
 * expanded. Returns the view (new reference). */
static ts_tensor *random_view(ts_dtype d, int nd, const int64_t *shape, uint32_t *st)
{
    int kind = (int)(th_lcg(st) % 4);
    ts_tensor *base, *v;
    int64_t sh[TS_MAX_DIMS];
    memcpy(sh, shape, (size_t)nd * sizeof *sh);
    if (kind == 1 && nd >= 2) {
        int64_t t = sh[nd - 1];
        sh[nd - 1] = sh[nd - 2];
        sh[nd - 2] = t;
        base = th_seq(d, nd, sh, 1, false);
        TH_OK(ts_transpose(base, -1, -2, &v));
    } else if (kind == 2) {
        int dim = (int)(th_lcg(st) % (uint32_t)nd);
        sh[dim] = 2 * shape[dim] + 1;
        base = th_seq(d, nd, sh, 1, false);
        TH_OK(ts_slice(base, dim, 1, sh[dim], 2, &v));
    } else if (kind == 3 && nd >= 3 && shape[0] > 1) {
        sh[0] = 1;
        base = th_seq(d, nd, sh, 1, false);
        TH_OK(ts_expand(base, nd, shape, &v));
    } else {
        base = th_seq(d, nd, sh, 1, false);
        v = ts_tensor_retain(base);
    }
    ts_tensor_free(base);
    return v;
}

Test(tensor_matmul, random_views_match_naive)
{
    th_mem_mark();
    uint32_t st = 12345;
    for (int it = 0; it < 300; it++) {
        int na = 1 + (int)(th_lcg(&st) % 4), nb = 1 + (int)(th_lcg(&st) % 4);
        int64_t m = 1 + th_lcg(&st) % 4, k = 1 + th_lcg(&st) % 4, n = 1 + th_lcg(&st) % 4;
        int64_t sa[4], sb[4], batch[2] = {1 + th_lcg(&st) % 3, 1 + th_lcg(&st) % 3};
        /* batch dims: shared sizes, some set to 1 to broadcast */
        for (int i = 0; i < na - 2; i++) sa[i] = th_lcg(&st) % 3 ? batch[i + 4 - na] : 1;
        for (int i = 0; i < nb - 2; i++) sb[i] = th_lcg(&st) % 3 ? batch[i + 4 - nb] : 1;
        if (na == 1) sa[0] = k;
        else sa[na - 2] = m, sa[na - 1] = k;
        if (nb == 1) sb[0] = k;
        else sb[nb - 2] = k, sb[nb - 1] = n;
        ts_dtype d = it % 2 ? TS_F64 : TS_F32;
        ts_tensor *a = random_view(d, na, sa, &st), *b = random_view(d, nb, sb, &st), *o;
        TH_OK(ts_matmul(a, b, &o));
        ts_tensor *want = naive_matmul(a, b);
        char s1[64], s2[64];
        ts_tensor_shape_str(a, s1, sizeof s1);
        ts_tensor_shape_str(b, s2, sizeof s2);
        cr_log_info("case %d: %s @ %s", it, s1, s2);
        /* k <= 4 terms of size <= 1: a few float ulp */
        th_assert_close(o, want, d == TS_F64 ? 1e-14 : 1e-6, d == TS_F64 ? 1e-14 : 1e-6);
        ts_tensor_free(o);
        ts_tensor_free(want);
        ts_tensor_free(a);
        ts_tensor_free(b);
    }
    th_mem_assert_back();
}

Test(tensor_matmul, gradcheck_every_form)
{
    th_mem_mark();
    for (int c = 0; c < N_MM; c++) {
        const mm_case *mc = &mm_cases[c];
        ts_tensor *in[2] = {th_seq(TS_F64, mc->na, mc->sa, 1.0, true), th_seq(TS_F64, mc->nb, mc->sb, -1.5, true)};
        th_gradcheck(gc_matmul, 2, in, NULL, TH_GC_EPS, TH_GC_ATOL, TH_GC_RTOL);
        for (int j = 0; j < 2; j++) {
            cr_assert_not_null(ts_tensor_grad(in[j]), "%s: no grad for input %d", mc->name, j);
            th_assert_shape(ts_tensor_grad(in[j]), ts_tensor_ndim(in[j]), ts_tensor_shape(in[j]));
        }
        ts_tensor_free(in[0]);
        ts_tensor_free(in[1]);
    }
    th_mem_assert_back();
}

Test(tensor_matmul, gradcheck_transposed_operands)
{
    th_mem_mark();
    /* stored shapes are the transposes of what matmul sees */
    struct {
        int na, nb;
        int64_t sa[3], sb[3];
        bool ta, tb;
    } cases[] = {
        {2, 2, {3, 2}, {3, 4}, true, false},
        {2, 2, {2, 3}, {4, 3}, false, true},
        {2, 2, {3, 2}, {4, 3}, true, true},
        {3, 2, {2, 4, 3}, {5, 4}, true, true}, /* fold path with a transposed a: copies */
        {3, 3, {2, 4, 3}, {2, 5, 4}, true, true},
        {2, 3, {3, 4}, {2, 5, 4}, false, true},
    };
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        ts_tensor *in[2] = {th_seq(TS_F64, cases[c].na, cases[c].sa, 1.0, true),
                            th_seq(TS_F64, cases[c].nb, cases[c].sb, -1.5, true)};
        mm_ctx ctx = {cases[c].ta, cases[c].tb};
        th_gradcheck(gc_matmul, 2, in, &ctx, TH_GC_EPS, TH_GC_ATOL, TH_GC_RTOL);
        ts_tensor_free(in[0]);
        ts_tensor_free(in[1]);
    }
    th_mem_assert_back();
}

Test(tensor_matmul, gradcheck_one_side_only)
{
    th_mem_mark();
    for (int c = 0; c < N_MM; c++)
        for (int which = 0; which < 2; which++) {
            const mm_case *mc = &mm_cases[c];
            ts_tensor *in[2] = {th_seq(TS_F64, mc->na, mc->sa, 1.0, which == 0),
                                th_seq(TS_F64, mc->nb, mc->sb, -1.5, which == 1)};
            th_gradcheck(gc_matmul, 2, in, NULL, TH_GC_EPS, TH_GC_ATOL, TH_GC_RTOL);
            cr_assert_null(ts_tensor_grad(in[1 - which]));
            ts_tensor_free(in[0]);
            ts_tensor_free(in[1]);
        }
    th_mem_assert_back();
}

/* ------------------------------------------------------------ linear */

Test(tensor_matmul, linear_matches_naive)
{
    th_mem_mark();
    int64_t sw[2] = {3, 4}, sbias[1] = {3};
    struct {
        int nx;
        int64_t sx[3];
    } xs[] = {{1, {4}}, {2, {5, 4}}, {3, {2, 5, 4}}};
    for (int dt = 0; dt < 2; dt++) {
        ts_dtype d = dt ? TS_F64 : TS_F32;
        ts_tensor *w = th_seq(d, 2, sw, 1.0, false), *b = th_seq(d, 1, sbias, -2.0, false);
        for (size_t k = 0; k < sizeof xs / sizeof *xs; k++)
            for (int ub = 0; ub < 2; ub++) {
                ts_tensor *x = th_seq(d, xs[k].nx, xs[k].sx, 1.5, false), *o;
                TH_OK(ts_linear(x, w, ub ? b : NULL, &o));
                int64_t so[3];
                memcpy(so, xs[k].sx, sizeof so);
                so[xs[k].nx - 1] = 3;
                th_assert_shape(o, xs[k].nx, so);
                ts_tensor *want = naive_linear(x, w, ub ? b : NULL);
                /* 4 products plus a bias in float: a few ulp (1e-6) */
                th_assert_close(o, want, dt ? 1e-14 : 1e-6, dt ? 1e-14 : 1e-6);
                ts_tensor_free(o);
                ts_tensor_free(want);
                ts_tensor_free(x);
            }
        ts_tensor_free(w);
        ts_tensor_free(b);
    }
    th_mem_assert_back();
}

Test(tensor_matmul, linear_hand_values)
{
    th_mem_mark();
    int64_t sx[2] = {1, 2}, sw[2] = {2, 2}, sb[1] = {2};
    double xv[2] = {1, 2}, wv[4] = {1, 0, 3, -1}, bv[2] = {0.5, 10};
    ts_tensor *x = th_tensor(TS_F32, 2, sx, xv), *w = th_tensor(TS_F32, 2, sw, wv), *b = th_tensor(TS_F32, 1, sb, bv),
              *o;
    TH_OK(ts_linear(x, w, b, &o));
    double *g = th_vals_new(o);
    /* (1*1 + 2*0 + 0.5, 1*3 - 2 + 10) */
    cr_assert(g[0] == 1.5 && g[1] == 11, "%g %g", g[0], g[1]);
    free(g);
    ts_tensor_free(o);
    ts_tensor_free(x);
    ts_tensor_free(w);
    ts_tensor_free(b);
    th_mem_assert_back();
}

Test(tensor_matmul, linear_non_contiguous_operands)
{
    th_mem_mark();
    /* x = X(4,2,5)^T(0,1) is (2,4,5), not foldable: copied; w = W(5,3)^T */
    int64_t sX[3] = {4, 2, 5}, sW[2] = {5, 3}, sb[1] = {3};
    for (int dt = 0; dt < 2; dt++) {
        ts_dtype d = dt ? TS_F64 : TS_F32;
        ts_tensor *X = th_seq(d, 3, sX, 1, false), *W = th_seq(d, 2, sW, 1, false), *b = th_seq(d, 1, sb, 1, false);
        ts_tensor *x, *w, *o, *want;
        TH_OK(ts_transpose(X, 0, 1, &x));
        TH_OK(ts_transpose(W, 0, 1, &w));
        TH_OK(ts_linear(x, w, b, &o));
        want = naive_linear(x, w, b);
        th_assert_close(o, want, dt ? 1e-14 : 1e-6, dt ? 1e-14 : 1e-6); /* 5 terms in float */
        ts_tensor_free(o);
        ts_tensor_free(want);
        ts_tensor_free(x);
        ts_tensor_free(w);
        ts_tensor_free(X);
        ts_tensor_free(W);
        ts_tensor_free(b);
    }
    th_mem_assert_back();
}

typedef struct lin_ctx {
    bool tx; /* transpose dims 0 and 1 of x */
} lin_ctx;

static ts_status gc_linear(ts_tensor **in, ts_tensor **out, void *ctx)
{
    const lin_ctx *c = ctx;
    ts_tensor *xt = NULL;
    ts_status st;
    if (c && c->tx && (st = ts_transpose(in[0], 0, 1, &xt))) return st;
    st = ts_linear(xt ? xt : in[0], in[1], in[2], out);
    ts_tensor_free(xt);
    return st;
}

Test(tensor_matmul, linear_gradcheck_all_inputs)
{
    th_mem_mark();
    int64_t sw[2] = {3, 4}, sbias[1] = {3};
    struct {
        int nx;
        int64_t sx[3];
        bool tx;
    } xs[] = {{1, {4}, false}, {2, {5, 4}, false}, {3, {2, 5, 4}, false}, {3, {5, 2, 4}, true}};
    for (size_t k = 0; k < sizeof xs / sizeof *xs; k++)
        for (int ub = 0; ub < 2; ub++) {
            ts_tensor *in[3] = {th_seq(TS_F64, xs[k].nx, xs[k].sx, 1.5, true), th_seq(TS_F64, 2, sw, 1.0, true),
                                ub ? th_seq(TS_F64, 1, sbias, -2.0, true) : NULL};
            lin_ctx c = {xs[k].tx};
            th_gradcheck(gc_linear, 3, in, &c, TH_GC_EPS, TH_GC_ATOL, TH_GC_RTOL);
            for (int j = 0; j < 3; j++)
                if (in[j]) {
                    cr_assert_not_null(ts_tensor_grad(in[j]), "x case %zu bias %d: no grad for input %d", k, ub, j);
                    th_assert_shape(ts_tensor_grad(in[j]), ts_tensor_ndim(in[j]), ts_tensor_shape(in[j]));
                }
            for (int j = 0; j < 3; j++) ts_tensor_free(in[j]);
        }
    th_mem_assert_back();
}

Test(tensor_matmul, linear_optimized_matches_reference)
{
    th_mem_mark();
    int64_t sx[3] = {3, 7, 33}, sw[2] = {19, 33}, sb[1] = {19};
    ts_tensor *x0 = th_seq(TS_F32, 3, sx, 1, false), *w0 = th_seq(TS_F32, 2, sw, 1, false),
              *b0 = th_seq(TS_F32, 1, sb, 1, false);
    ts_tensor *in[3] = {x0, w0, b0};
    /* float BLIS accumulation over k <= 33 terms of size <= 1 against a
     * double accumulation: ~k * eps * k = 7e-5 worst case, far less in
     * practice; 3e-5 for the output and every gradient */
    th_assert_kernels_agree(gc_linear, 3, in, NULL, 1, 3e-5, 3e-5, 3e-5, 3e-5);
    ts_tensor_free(x0);
    ts_tensor_free(w0);
    ts_tensor_free(b0);
    th_mem_assert_back();
}

Test(tensor_matmul, bad_shapes_are_refused)
{
    th_mem_mark();
    int64_t s3[1] = {3}, s4[1] = {4}, s23[2] = {2, 3}, s45[2] = {4, 5}, s234[3] = {2, 3, 4}, s345[3] = {3, 4, 5};
    ts_tensor *v3 = th_seq(TS_F32, 1, s3, 1, false), *v4 = th_seq(TS_F32, 1, s4, 1, false),
              *m23 = th_seq(TS_F32, 2, s23, 1, false), *m45 = th_seq(TS_F32, 2, s45, 1, false),
              *b234 = th_seq(TS_F32, 3, s234, 1, false), *b345 = th_seq(TS_F32, 3, s345, 1, false), *z, *o = NULL;
    TH_OK(ts_tensor_scalar(TS_F32, 1, &z));
    cr_assert_eq(ts_matmul(m23, m45, &o), TS_ERR_SHAPE);
    cr_assert(strstr(ts_last_error(), "(2, 3)") && strstr(ts_last_error(), "(4, 5)"), "%s", ts_last_error());
    /* 1-d forms name the shapes the caller passed */
    cr_assert_eq(ts_matmul(v3, v4, &o), TS_ERR_SHAPE);
    cr_assert(strstr(ts_last_error(), "(3,)") && strstr(ts_last_error(), "(4,)"), "%s", ts_last_error());
    cr_assert_eq(ts_matmul(v3, m45, &o), TS_ERR_SHAPE);
    cr_assert(strstr(ts_last_error(), "(3,)") && strstr(ts_last_error(), "(4, 5)"), "%s", ts_last_error());
    cr_assert_eq(ts_matmul(m45, v4, &o), TS_ERR_SHAPE);
    /* batch dims that do not broadcast */
    cr_assert_eq(ts_matmul(b234, b345, &o), TS_ERR_SHAPE);
    cr_assert_eq(ts_matmul(z, m23, &o), TS_ERR_SHAPE);
    /* linear: in-features mismatch, bias of the wrong size */
    cr_assert_eq(ts_linear(m23, m45, NULL, &o), TS_ERR_SHAPE);
    cr_assert(strstr(ts_last_error(), "(2, 3)") && strstr(ts_last_error(), "(4, 5)"), "%s", ts_last_error());
    ts_tensor *w43 = th_seq(TS_F32, 2, (int64_t[]){4, 3}, 1, false);
    cr_assert_eq(ts_linear(m23, w43, v3, &o), TS_ERR_SHAPE);
    cr_assert(strstr(ts_last_error(), "(3,)") != NULL, "%s", ts_last_error());
    cr_assert_null(o);
    ts_tensor_free(w43);
    ts_tensor_free(v3);
    ts_tensor_free(v4);
    ts_tensor_free(m23);
    ts_tensor_free(m45);
    ts_tensor_free(b234);
    ts_tensor_free(b345);
    ts_tensor_free(z);
    th_mem_assert_back();
}
