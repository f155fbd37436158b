/* cat, split / chunk, where / masked_fill (with a causal mask from
 * ts_tril_mask), to_dtype and eq. */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "tests/helpers.h"

/* Gradchecks use TH_GC_EPS / TH_GC_ATOL / TH_GC_RTOL (helpers.h): these ops
 * are piecewise linear in their inputs, so the only error is rounding
 * (~1e-10), while a misrouted gradient is off by O(1). */

/* ------------------------------------------------------------ cat */

Test(tensor_shape_ops, cat_dim0_dim1_and_negative)
{
    th_mem_mark();
    int64_t s23[2] = {2, 3}, s13[2] = {1, 3}, s22[2] = {2, 2};
    double a[6] = {1, 2, 3, 4, 5, 6}, b[3] = {7, 8, 9}, c[4] = {-1, -2, -3, -4};
    ts_tensor *ta = th_tensor(TS_F32, 2, s23, a), *tb = th_tensor(TS_F32, 2, s13, b),
              *tc = th_tensor(TS_F32, 2, s22, c);
    ts_tensor *o, *ins[3];
    /* dim 0: (2,3) + (1,3) + (2,3) -> (5,3) */
    ins[0] = ta, ins[1] = tb, ins[2] = ta;
    TH_OK(ts_cat(3, ins, 0, &o));
    int64_t s53[2] = {5, 3};
    th_assert_shape(o, 2, s53);
    double got[15], w0[15] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6};
    th_vals(o, got, 15);
    for (int i = 0; i < 15; i++) cr_assert_eq(got[i], w0[i], "dim 0 [%d]", i);
    ts_tensor_free(o);
    /* dim 1 and -1: (2,3) + (2,2) -> (2,5) */
    int dims[2] = {1, -1};
    for (int k = 0; k < 2; k++) {
        ins[0] = ta, ins[1] = tc;
        TH_OK(ts_cat(2, ins, dims[k], &o));
        int64_t s25[2] = {2, 5};
        th_assert_shape(o, 2, s25);
        double w1[10] = {1, 2, 3, -1, -2, 4, 5, 6, -3, -4};
        th_vals(o, got, 10);
        for (int i = 0; i < 10; i++) cr_assert_eq(got[i], w1[i], "dim %d [%d]", dims[k], i);
        ts_tensor_free(o);
    }
    /* a single tensor is copied */
    TH_OK(ts_cat(1, &ta, 0, &o));
    th_assert_close(o, ta, 0, 0);
    cr_assert_neq(ts_tensor_data(o), ts_tensor_data(ta));
    ts_tensor_free(o);
    ts_tensor_free(ta);
    ts_tensor_free(tb);
    ts_tensor_free(tc);
    th_mem_assert_back();
}

Test(tensor_shape_ops, cat_three_dims_and_non_contiguous_inputs)
{
    th_mem_mark();
    int64_t s1[3] = {2, 3, 4}, sb[3] = {2, 4, 1};
    ts_tensor *a = th_seq(TS_F64, 3, s1, 1.0, false), *bb = th_seq(TS_F64, 3, sb, 2.0, false), *bt, *bc, *o1, *o2;
    /* bt = bb^T(1,2): (2,1,4), non-contiguous */
    TH_OK(ts_transpose(bb, 1, 2, &bt));
    TH_OK(ts_contiguous(bt, &bc));
    ts_tensor *ins[2] = {a, bt}, *ins2[2] = {a, bc};
    TH_OK(ts_cat(2, ins, 1, &o1));
    TH_OK(ts_cat(2, ins2, 1, &o2));
    int64_t so[3] = {2, 4, 4};
    th_assert_shape(o1, 3, so);
    th_assert_close(o1, o2, 0, 0);
    double av[24], bv[8], got[32];
    th_vals(a, av, 24);
    th_vals(bt, bv, 8);
    th_vals(o1, got, 32);
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++)
            for (int k = 0; k < 4; k++)
                cr_assert_eq(got[(i * 4 + j) * 4 + k], j < 3 ? av[(i * 3 + j) * 4 + k] : bv[i * 4 + k], "[%d][%d][%d]",
                             i, j, k);
    ts_tensor_free(a);
    ts_tensor_free(bb);
    ts_tensor_free(bt);
    ts_tensor_free(bc);
    ts_tensor_free(o1);
    ts_tensor_free(o2);
    th_mem_assert_back();
}

typedef struct cat_ctx {
    int n;
    int dim;
} cat_ctx;

static ts_status gc_cat(ts_tensor **in, ts_tensor **out, void *ctx)
{
    const cat_ctx *c = ctx;
    return ts_cat(c->n, in, c->dim, out);
}

Test(tensor_shape_ops, cat_gradcheck)
{
    th_mem_mark();
    int64_t sa[3] = {2, 3, 4}, sb0[3] = {1, 3, 4}, sb1[3] = {2, 2, 4}, sb2[3] = {2, 3, 1};
    const int64_t *sbs[3] = {sb0, sb1, sb2};
    for (int dim = 0; dim < 3; dim++)
        for (int neg = 0; neg < 2; neg++) {
            ts_tensor *in[3] = {th_seq(TS_F64, 3, sa, 1.0, true), th_seq(TS_F64, 3, sbs[dim], -2.0, false),
                                th_seq(TS_F64, 3, sbs[dim], 0.5, true)};
            cat_ctx c = {3, neg ? dim - 3 : dim};
            th_gradcheck(gc_cat, 3, in, &c, TH_GC_EPS, TH_GC_ATOL, TH_GC_RTOL);
            th_assert_shape(ts_tensor_grad(in[0]), 3, sa);
            cr_assert_null(ts_tensor_grad(in[1]), "input that needs no grad got one");
            th_assert_shape(ts_tensor_grad(in[2]), 3, sbs[dim]);
            for (int j = 0; j < 3; j++) ts_tensor_free(in[j]);
        }
    th_mem_assert_back();
}

Test(tensor_shape_ops, cat_of_many_tensors_with_gradients)
{
    th_mem_mark();
    /* e.g. 24 attention heads of (2, 3) concatenated on the last dim */
    enum { H = 24 };
    int64_t s[2] = {2, 3};
    ts_tensor *heads[H], *o;
    for (int h = 0; h < H; h++) heads[h] = th_seq(TS_F64, 2, s, 1.0 + h, h % 3 != 1);
    TH_OK(ts_cat(H, heads, -1, &o));
    int64_t so[2] = {2, 3 * H};
    cr_assert(ts_tensor_ndim(o) == 2 && ts_tensor_shape(o)[0] == so[0] && ts_tensor_shape(o)[1] == so[1]);
    ts_tensor *cot = th_seq(TS_F64, 2, so, 1.0, false);
    TH_OK(ts_backward(o, cot, false));
    double cv[2 * 3 * H];
    th_vals(cot, cv, 2 * 3 * H);
    for (int h = 0; h < H; h++) {
        if (h % 3 == 1) {
            cr_assert_null(ts_tensor_grad(heads[h]));
            continue;
        }
        double g[6];
        th_vals(ts_tensor_grad(heads[h]), g, 6);
        for (int r = 0; r < 2; r++)
            for (int c = 0; c < 3; c++)
                cr_assert_eq(g[r * 3 + c], cv[r * 3 * H + 3 * h + c], "head %d [%d][%d]", h, r, c);
    }
    for (int h = 0; h < H; h++) ts_tensor_free(heads[h]);
    ts_tensor_free(cot);
    ts_tensor_free(o);
    th_mem_assert_back();
}

Test(tensor_shape_ops, cat_gradient_is_the_matching_slice)
{
    th_mem_mark();
    int64_t s2[1] = {2}, s3[1] = {3}, s5[1] = {5};
    ts_tensor *a = th_seq(TS_F32, 1, s2, 1, true), *b = th_seq(TS_F32, 1, s3, 1, true), *o;
    ts_tensor *ins[2] = {a, b};
    TH_OK(ts_cat(2, ins, 0, &o));
    double cv[5] = {10, 20, 30, 40, 50};
    ts_tensor *cot = th_tensor(TS_F32, 1, s5, cv);
    TH_OK(ts_backward(o, cot, false));
    double ga[2], gb[3];
    th_vals(ts_tensor_grad(a), ga, 2);
    th_vals(ts_tensor_grad(b), gb, 3);
    cr_assert(ga[0] == 10 && ga[1] == 20, "%g %g", ga[0], ga[1]);
    cr_assert(gb[0] == 30 && gb[1] == 40 && gb[2] == 50, "%g %g %g", gb[0], gb[1], gb[2]);
    ts_tensor_free(cot);
    ts_tensor_free(o);
    ts_tensor_free(a);
    ts_tensor_free(b);
    th_mem_assert_back();
}

Test(tensor_shape_ops, cat_of_scalars_viewed_as_vectors)
{
    th_mem_mark();
    /* torch.stack of 0-d losses: view each as (1,) and concatenate */
    double v[3] = {0.5, -1.5, 4.0};
    ts_tensor *sc[3], *vec[3], *o;
    int64_t one[1] = {1}, three[1] = {3};
    for (int i = 0; i < 3; i++) {
        TH_OK(ts_tensor_scalar(TS_F64, v[i], &sc[i]));
        TH_OK(ts_tensor_set_requires_grad(sc[i], true));
        TH_OK(ts_view(sc[i], 1, one, &vec[i]));
        th_assert_shape(vec[i], 1, one);
    }
    TH_OK(ts_cat(3, vec, 0, &o));
    th_assert_shape(o, 1, three);
    double got[3];
    th_vals(o, got, 3);
    for (int i = 0; i < 3; i++) cr_assert_eq(got[i], v[i]);
    /* a 0-d tensor also reshapes to (1, 1) and back */
    ts_tensor *r, *back;
    int64_t s11[2] = {1, 1};
    TH_OK(ts_reshape(sc[0], 2, s11, &r));
    th_assert_shape(r, 2, s11);
    TH_OK(ts_view(r, 0, NULL, &back));
    cr_assert_eq(ts_tensor_ndim(back), 0);
    double cv[3] = {10, 20, 30};
    ts_tensor *cot = th_tensor(TS_F64, 1, three, cv);
    TH_OK(ts_backward(o, cot, false));
    for (int i = 0; i < 3; i++) {
        double g;
        TH_OK(ts_tensor_item(ts_tensor_grad(sc[i]), &g));
        cr_assert_eq(g, cv[i], "scalar %d: grad %g", i, g);
        ts_tensor_free(sc[i]);
        ts_tensor_free(vec[i]);
    }
    ts_tensor_free(cot);
    ts_tensor_free(r);
    ts_tensor_free(back);
    ts_tensor_free(o);
    th_mem_assert_back();
}

Test(tensor_shape_ops, cat_bad_arguments)
{
    th_mem_mark();
    int64_t s23[2] = {2, 3}, s24[2] = {2, 4};
    ts_tensor *a = th_seq(TS_F32, 2, s23, 1, false), *b = th_seq(TS_F32, 2, s24, 1, false),
              *c = th_seq(TS_F64, 2, s23, 1, false), *z, *o = NULL;
    TH_OK(ts_tensor_scalar(TS_F32, 1, &z));
    ts_tensor *ab[2] = {a, b}, *ac[2] = {a, c}, *zz[2] = {z, z};
    cr_assert_eq(ts_cat(2, ab, 0, &o), TS_ERR_SHAPE);
    cr_assert(strstr(ts_last_error(), "(2, 4)") && strstr(ts_last_error(), "(2, 3)"), "%s", ts_last_error());
    cr_assert_eq(ts_cat(2, ac, 0, &o), TS_ERR_DTYPE);
    cr_assert(strstr(ts_last_error(), "float64") && strstr(ts_last_error(), "float32"), "%s", ts_last_error());
    cr_assert_eq(ts_cat(2, ab, 2, &o), TS_ERR_INDEX);
    cr_assert_eq(ts_cat(2, zz, 0, &o), TS_ERR_SHAPE);
    cr_assert_eq(ts_cat(0, ab, 0, &o), TS_ERR_INVALID_ARGUMENT);
    cr_assert_null(o);
    ts_tensor_free(a);
    ts_tensor_free(b);
    ts_tensor_free(c);
    ts_tensor_free(z);
    th_mem_assert_back();
}

/* ------------------------------------------------------------ split / chunk */

static void check_pieces(ts_tensor *base, ts_tensor **outs, int n, const int64_t *want_sizes, int want_n, int dim)
{
    cr_assert_eq(n, want_n, "%d pieces, expected %d", n, want_n);
    int64_t start = 0;
    for (int i = 0; i < n; i++) {
        cr_assert_eq(ts_tensor_size(outs[i], dim), want_sizes[i], "piece %d has %lld, expected %lld", i,
                     (long long)ts_tensor_size(outs[i], dim), (long long)want_sizes[i]);
        /* a view: same storage, starting at the piece's first element */
        cr_assert_eq(ts_tensor_storage(outs[i]), ts_tensor_storage(base));
        cr_assert_eq(ts_tensor_offset(outs[i]), ts_tensor_offset(base) + start * ts_tensor_strides(base)[dim]);
        start += want_sizes[i];
    }
}

Test(tensor_shape_ops, split_sizes)
{
    th_mem_mark();
    int64_t s[2] = {10, 2};
    ts_tensor *x = th_seq(TS_F32, 2, s, 1, false), *outs[8];
    int n = -1;
    TH_OK(ts_split(x, 3, 0, 8, outs, &n));
    int64_t w[4] = {3, 3, 3, 1};
    check_pieces(x, outs, n, w, 4, 0);
    /* values of the last piece: row 9 */
    double xv[20], last[2];
    th_vals(x, xv, 20);
    th_vals(outs[3], last, 2);
    cr_assert(last[0] == xv[18] && last[1] == xv[19]);
    for (int i = 0; i < n; i++) ts_tensor_free(outs[i]);
    /* exact division, and split along dim -1 */
    TH_OK(ts_split(x, 5, 0, 8, outs, &n));
    int64_t w5[2] = {5, 5};
    check_pieces(x, outs, n, w5, 2, 0);
    for (int i = 0; i < n; i++) ts_tensor_free(outs[i]);
    TH_OK(ts_split(x, 1, -1, 8, outs, &n));
    int64_t w1[2] = {1, 1};
    check_pieces(x, outs, n, w1, 2, 1);
    for (int i = 0; i < n; i++) ts_tensor_free(outs[i]);
    /* too little room in outs, or a bad size: refused, nothing written */
    n = -7;
    outs[0] = NULL;
    cr_assert_eq(ts_split(x, 3, 0, 3, outs, &n), TS_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(ts_last_error(), "4 tensors") != NULL, "%s", ts_last_error());
    cr_assert_eq(n, -7);
    cr_assert_null(outs[0]);
    cr_assert_eq(ts_split(x, 0, 0, 8, outs, &n), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_split(x, 2, 2, 8, outs, &n), TS_ERR_INDEX);
    ts_tensor_free(x);
    th_mem_assert_back();
}

Test(tensor_shape_ops, chunk_sizes_follow_torch)
{
    th_mem_mark();
    struct {
        int64_t size;
        int chunks;
        int want_n;
        int64_t want[8];
    } cases[] = {
        {10, 4, 4, {3, 3, 3, 1}}, /* ceil(10/4) = 3 */
        {9, 4, 3, {3, 3, 3}},     /* ceil(9/4) = 3: only 3 pieces */
        {6, 4, 3, {2, 2, 2}},     /* ceil(6/4) = 2: 3 pieces */
        {5, 5, 5, {1, 1, 1, 1, 1}},
        {3, 5, 3, {1, 1, 1}}, /* more chunks than elements */
        {8, 1, 1, {8}},
        {0, 3, 3, {0, 0, 0}}, /* an empty dim: `chunks` empty pieces */
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        int64_t s[2] = {3, cases[k].size};
        ts_tensor *x = th_seq(TS_F64, 2, s, 1, false), *outs[8];
        int n = 0;
        TH_OK(ts_chunk(x, cases[k].chunks, 1, 8, outs, &n));
        check_pieces(x, outs, n, cases[k].want, cases[k].want_n, 1);
        for (int i = 0; i < n; i++) ts_tensor_free(outs[i]);
        ts_tensor_free(x);
    }
    int64_t s[1] = {4};
    ts_tensor *x = th_seq(TS_F64, 1, s, 1, false), *outs[2];
    int n;
    cr_assert_eq(ts_chunk(x, 0, 0, 2, outs, &n), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_chunk(x, 4, 0, 2, outs, &n), TS_ERR_INVALID_ARGUMENT); /* 4 pieces, room for 2 */
    int64_t s0[1] = {0};
    ts_tensor *e;
    TH_OK(ts_tensor_empty(TS_F64, 1, s0, &e));
    cr_assert_eq(ts_chunk(e, 3, 0, 2, outs, &n), TS_ERR_INVALID_ARGUMENT); /* 3 empty pieces, room for 2 */
    ts_tensor_free(e);
    ts_tensor_free(x);
    th_mem_assert_back();
}

static ts_status gc_split_reorder(ts_tensor **in, ts_tensor **out, void *ctx)
{
    /* chunk into pieces along dim 1 and concatenate them in reverse order,
     * skipping the second piece */
    (void)ctx;
    ts_tensor *p[8];
    int n;
    ts_status st = ts_chunk(in[0], 4, 1, 8, p, &n);
    if (st) return st;
    ts_tensor *sel[8];
    int m = 0;
    for (int i = n - 1; i >= 0; i--)
        if (i != 1) sel[m++] = p[i];
    st = ts_cat(m, sel, 1, out);
    for (int i = 0; i < n; i++) ts_tensor_free(p[i]);
    return st;
}

Test(tensor_shape_ops, split_and_chunk_gradcheck)
{
    th_mem_mark();
    int64_t s[2] = {2, 10};
    ts_tensor *in[1] = {th_seq(TS_F64, 2, s, 1.0, true)};
    th_gradcheck(gc_split_reorder, 1, in, NULL, TH_GC_EPS, TH_GC_ATOL, TH_GC_RTOL);
    /* the skipped piece (columns 3..5) gets zero gradient */
    double g[20];
    th_vals(ts_tensor_grad(in[0]), g, 20);
    for (int r = 0; r < 2; r++)
        for (int c = 0; c < 10; c++)
            cr_assert((g[r * 10 + c] == 0) == (c >= 3 && c < 6), "[%d][%d] = %g", r, c, g[r * 10 + c]);
    ts_tensor_free(in[0]);
    th_mem_assert_back();
}

/* ------------------------------------------------------------ where / masked_fill */

Test(tensor_shape_ops, where_broadcasts_all_three)
{
    th_mem_mark();
    int64_t sc[2] = {3, 1}, sa[2] = {1, 4};
    double cv[3] = {1, 0, 1}, av[4] = {1, 2, 3, 4};
    ts_tensor *c = th_tensor(TS_BOOL, 2, sc, cv), *a = th_tensor(TS_F32, 2, sa, av), *b, *o;
    TH_OK(ts_tensor_scalar(TS_F32, -7, &b));
    TH_OK(ts_where(c, a, b, &o));
    int64_t so[2] = {3, 4};
    th_assert_shape(o, 2, so);
    double got[12];
    th_vals(o, got, 12);
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < 4; j++) cr_assert_eq(got[i * 4 + j], cv[i] ? av[j] : -7, "[%d][%d]", i, j);
    ts_tensor_free(o);
    /* a non-bool condition and mismatched value dtypes are refused */
    ts_tensor *bd;
    TH_OK(ts_tensor_scalar(TS_F64, 1, &bd));
    cr_assert_eq(ts_where(a, a, b, &o), TS_ERR_DTYPE);
    cr_assert(strstr(ts_last_error(), "bool") != NULL, "%s", ts_last_error());
    cr_assert_eq(ts_where(c, a, bd, &o), TS_ERR_DTYPE);
    int64_t s24[2] = {2, 4};
    ts_tensor *a5 = th_seq(TS_F32, 2, s24, 1, false);
    cr_assert_eq(ts_where(c, a5, b, &o), TS_ERR_SHAPE); /* (3, 1) vs (2, 4) */
    cr_assert(strstr(ts_last_error(), "(3, 1)") && strstr(ts_last_error(), "(2, 4)"), "%s", ts_last_error());
    ts_tensor_free(a5);
    ts_tensor_free(bd);
    ts_tensor_free(c);
    ts_tensor_free(a);
    ts_tensor_free(b);
    th_mem_assert_back();
}

static ts_status gc_where(ts_tensor **in, ts_tensor **out, void *ctx) { return ts_where(ctx, in[0], in[1], out); }

Test(tensor_shape_ops, where_gradcheck)
{
    th_mem_mark();
    int64_t sc[3] = {2, 3, 1}, sa[2] = {1, 4}, sb[3] = {2, 1, 4};
    double cv[6] = {1, 0, 1, 0, 0, 1};
    ts_tensor *c = th_tensor(TS_BOOL, 3, sc, cv);
    ts_tensor *in[2] = {th_seq(TS_F64, 2, sa, 1.0, true), th_seq(TS_F64, 3, sb, -1.0, true)};
    th_gradcheck(gc_where, 2, in, c, TH_GC_EPS, TH_GC_ATOL, TH_GC_RTOL);
    th_assert_shape(ts_tensor_grad(in[0]), 2, sa);
    th_assert_shape(ts_tensor_grad(in[1]), 3, sb);
    ts_tensor_free(in[0]);
    ts_tensor_free(in[1]);
    ts_tensor_free(c);
    th_mem_assert_back();
}

Test(tensor_shape_ops, tril_mask_values)
{
    th_mem_mark();
    int64_t diags[3] = {0, -1, 1};
    for (int k = 0; k < 3; k++) {
        ts_tensor *m;
        TH_OK(ts_tril_mask(4, diags[k], &m));
        int64_t s[2] = {4, 4};
        th_assert_shape(m, 2, s);
        cr_assert_eq(ts_tensor_dtype(m), TS_BOOL);
        double v[16];
        th_vals(m, v, 16);
        for (int r = 0; r < 4; r++)
            for (int c = 0; c < 4; c++)
                cr_assert_eq(v[r * 4 + c], c <= r + diags[k] ? 1.0 : 0.0, "diag %lld [%d][%d]", (long long)diags[k], r,
                             c);
        ts_tensor_free(m);
    }
    ts_tensor *m;
    cr_assert_eq(ts_tril_mask(-1, 0, &m), TS_ERR_INVALID_ARGUMENT);
    th_mem_assert_back();
}

Test(tensor_shape_ops, causal_mask_on_attention_scores)
{
    th_mem_mark();
    /* scores (B=2, H=2, T=4, T=4) as q @ k^T would give; the causal mask
     * (T, T) broadcasts over batch and heads */
    int64_t ss[4] = {2, 2, 4, 4};
    ts_tensor *scores = th_seq(TS_F32, 4, ss, 3.0, false), *tril, *f, *notm, *masked, *masked2, *ninf, *p;
    TH_OK(ts_tril_mask(4, 0, &tril));
    /* ~tril as tril == false */
    TH_OK(ts_tensor_scalar(TS_BOOL, 0, &f));
    TH_OK(ts_eq(tril, f, &notm));
    cr_assert_eq(ts_tensor_dtype(notm), TS_BOOL);
    TH_OK(ts_masked_fill(scores, notm, -INFINITY, &masked));
    th_assert_shape(masked, 4, ss);
    /* the same through where(tril, scores, -inf) */
    TH_OK(ts_tensor_scalar(TS_F32, -INFINITY, &ninf));
    TH_OK(ts_where(tril, scores, ninf, &masked2));
    th_assert_close(masked, masked2, 0, 0);
    double sv[64], mv[64], pv[64];
    th_vals(scores, sv, 64);
    th_vals(masked, mv, 64);
    for (int i = 0; i < 64; i++) {
        int r = (i / 4) % 4, c = i % 4;
        cr_assert_eq(mv[i], c <= r ? sv[i] : -INFINITY, "[%d] (row %d col %d)", i, r, c);
    }
    /* softmax over keys: no weight on the future, rows sum to 1, and the
     * first query attends only to itself */
    TH_OK(ts_softmax(masked, -1, &p));
    th_vals(p, pv, 64);
    for (int row = 0; row < 16; row++) {
        int r = row % 4;
        double sum = 0;
        for (int c = 0; c < 4; c++) {
            double v = pv[row * 4 + c];
            if (c > r) cr_assert_eq(v, 0.0, "row %d col %d: %g", row, c, v);
            sum += v;
        }
        cr_assert(fabs(sum - 1) < 1e-6, "row %d sums to %.9g", row, sum); /* float softmax: an ulp per term */
        if (r == 0) cr_assert_eq(pv[row * 4], 1.0);
    }
    ts_tensor_free(scores);
    ts_tensor_free(tril);
    ts_tensor_free(f);
    ts_tensor_free(notm);
    ts_tensor_free(masked);
    ts_tensor_free(masked2);
    ts_tensor_free(ninf);
    ts_tensor_free(p);
    th_mem_assert_back();
}

static ts_status gc_masked_fill(ts_tensor **in, ts_tensor **out, void *ctx)
{
    return ts_masked_fill(in[0], ctx, -5.0, out);
}

Test(tensor_shape_ops, masked_fill_gradcheck)
{
    th_mem_mark();
    int64_t ss[3] = {2, 3, 3};
    ts_tensor *tril, *f, *notm;
    TH_OK(ts_tril_mask(3, 0, &tril));
    TH_OK(ts_tensor_scalar(TS_BOOL, 0, &f));
    TH_OK(ts_eq(tril, f, &notm));
    ts_tensor *in[1] = {th_seq(TS_F64, 3, ss, 1.0, true)};
    th_gradcheck(gc_masked_fill, 1, in, notm, TH_GC_EPS, TH_GC_ATOL, TH_GC_RTOL);
    /* filled positions get no gradient, the others the cotangent */
    double g[18];
    th_vals(ts_tensor_grad(in[0]), g, 18);
    for (int i = 0; i < 18; i++) {
        int r = (i / 3) % 3, c = i % 3;
        cr_assert((g[i] == 0) == (c > r), "[%d] = %g", i, g[i]);
    }
    ts_tensor_free(in[0]);
    ts_tensor_free(tril);
    ts_tensor_free(f);
    ts_tensor_free(notm);
    th_mem_assert_back();
}

Test(tensor_shape_ops, masked_fill_bad_arguments)
{
    th_mem_mark();
    int64_t s44[2] = {4, 4}, s244[3] = {2, 4, 4};
    ts_tensor *a = th_seq(TS_F32, 2, s44, 1, false), *m, *big, *o = NULL;
    TH_OK(ts_tril_mask(4, 0, &m));
    TH_OK(ts_tensor_zeros(TS_BOOL, 3, s244, &big));
    /* the mask must broadcast to a's shape, not widen it */
    cr_assert_eq(ts_masked_fill(a, big, 0, &o), TS_ERR_SHAPE);
    cr_assert(strstr(ts_last_error(), "(2, 4, 4)") && strstr(ts_last_error(), "(4, 4)"), "%s", ts_last_error());
    cr_assert_eq(ts_masked_fill(a, a, 0, &o), TS_ERR_DTYPE);
    cr_assert_null(o);
    ts_tensor_free(a);
    ts_tensor_free(m);
    ts_tensor_free(big);
    th_mem_assert_back();
}

/* ------------------------------------------------------------ to_dtype */

Test(tensor_shape_ops, to_dtype_round_trips)
{
    th_mem_mark();
    int64_t s[1] = {6};
    double v[6] = {-2.7, -0.5, 0.0, 1.0 / 3.0, 2.5, 1e5 + 0.1};
    ts_tensor *x64 = th_tensor(TS_F64, 1, s, v), *x32, *back, *same;
    /* same dtype: a new reference to the same tensor */
    TH_OK(ts_to_dtype(x64, TS_F64, &same));
    cr_assert_eq(same, x64);
    ts_tensor_free(same);
    /* f64 -> f32 rounds like a C cast; f32 -> f64 -> f32 is exact */
    TH_OK(ts_to_dtype(x64, TS_F32, &x32));
    cr_assert_eq(ts_tensor_dtype(x32), TS_F32);
    double g[6];
    th_vals(x32, g, 6);
    for (int i = 0; i < 6; i++) cr_assert_eq(g[i], (double)(float)v[i], "f32 [%d]", i);
    ts_tensor *x64b;
    TH_OK(ts_to_dtype(x32, TS_F64, &x64b));
    TH_OK(ts_to_dtype(x64b, TS_F32, &back));
    th_assert_close(back, x32, 0, 0);
    ts_tensor_free(back);
    ts_tensor_free(x64b);
    /* half types follow the library's conversions */
    ts_dtype halves[2] = {TS_BF16, TS_F16};
    for (int k = 0; k < 2; k++) {
        ts_tensor *h;
        TH_OK(ts_to_dtype(x32, halves[k], &h));
        TH_OK(ts_to_dtype(h, TS_F32, &back));
        th_vals(back, g, 6);
        for (int i = 0; i < 6; i++) {
            float f = (float)v[i];
            float want = halves[k] == TS_BF16 ? ts_bf16_to_f32(ts_f32_to_bf16(f)) : ts_f16_to_f32(ts_f32_to_f16(f));
            cr_assert_eq(g[i], (double)want, "%s [%d]: %g vs %g", ts_dtype_name(halves[k]), i, g[i], (double)want);
        }
        ts_tensor_free(h);
        ts_tensor_free(back);
    }
    /* integers truncate toward zero; bool is != 0 */
    ts_tensor *i64, *b, *i2f;
    TH_OK(ts_to_dtype(x32, TS_I64, &i64));
    th_vals(i64, g, 6);
    double wi[6] = {-2, 0, 0, 0, 2, 100000};
    for (int i = 0; i < 6; i++) cr_assert_eq(g[i], wi[i], "int64 [%d] = %g", i, g[i]);
    TH_OK(ts_to_dtype(i64, TS_F32, &i2f));
    th_vals(i2f, g, 6);
    for (int i = 0; i < 6; i++) cr_assert_eq(g[i], wi[i]);
    TH_OK(ts_to_dtype(x64, TS_BOOL, &b));
    th_vals(b, g, 6);
    for (int i = 0; i < 6; i++) cr_assert_eq(g[i], v[i] != 0 ? 1.0 : 0.0, "bool [%d]", i);
    cr_assert_eq(ts_to_dtype(x64, TS_DTYPE_COUNT, &b), TS_ERR_INVALID_ARGUMENT);
    ts_tensor_free(i64);
    ts_tensor_free(i2f);
    ts_tensor_free(b);
    ts_tensor_free(x32);
    ts_tensor_free(x64);
    th_mem_assert_back();
}

Test(tensor_shape_ops, gradient_through_a_cast)
{
    th_mem_mark();
    int64_t s[1] = {4};
    double v[4] = {0.5, -1.25, 2.0, 3.0};
    /* f32 leaf -> f64 -> y*y summed: the gradient 2x comes back as f32 */
    ts_tensor *x = th_tensor(TS_F32, 1, s, v), *y, *sq, *l;
    TH_OK(ts_tensor_set_requires_grad(x, true));
    TH_OK(ts_to_dtype(x, TS_F64, &y));
    cr_assert(ts_tensor_requires_grad(y));
    TH_OK(ts_mul(y, y, &sq));
    TH_OK(ts_sum(sq, 0, NULL, false, &l));
    TH_OK(ts_backward(l, NULL, false));
    ts_tensor *g = ts_tensor_grad(x);
    cr_assert_eq(ts_tensor_dtype(g), TS_F32);
    double gv[4];
    th_vals(g, gv, 4);
    for (int i = 0; i < 4; i++) cr_assert_eq(gv[i], 2 * v[i], "[%d] %g", i, gv[i]);
    /* casting to an integer dtype is not differentiable */
    ts_tensor *xi;
    TH_OK(ts_to_dtype(x, TS_I64, &xi));
    cr_assert(!ts_tensor_requires_grad(xi));
    ts_tensor_free(xi);
    ts_tensor_free(y);
    ts_tensor_free(sq);
    ts_tensor_free(l);
    ts_tensor_free(x);
    th_mem_assert_back();
}

static ts_status gc_cast(ts_tensor **in, ts_tensor **out, void *ctx)
{
    /* out = cast(3 * cast(x, hop), float64): the gradient crosses two casts */
    ts_dtype hop = *(const ts_dtype *)ctx;
    ts_tensor *h, *h2;
    ts_status st = ts_to_dtype(in[0], hop, &h);
    if (st) return st;
    st = ts_mul_scalar(h, 3.0, &h2);
    ts_tensor_free(h);
    if (st) return st;
    st = ts_to_dtype(h2, TS_F64, out);
    ts_tensor_free(h2);
    return st;
}

Test(tensor_shape_ops, cast_gradcheck)
{
    th_mem_mark();
    /* through an f64 "hop" the finite differences are exact; through an f32
     * hop the perturbation is rounded, so the step is 2^-10 and the inputs
     * are exact in float32: the map x -> 3x is linear, so the differences
     * stay exact (every value involved is a small dyadic rational) */
    int64_t s[2] = {2, 3};
    double v[6] = {0.5, -1.25, 2.0, 3.0, -0.75, 1.5};
    ts_dtype hops[2] = {TS_F64, TS_F32};
    for (int k = 0; k < 2; k++) {
        ts_tensor *in[1] = {th_tensor(TS_F64, 2, s, v)};
        TH_OK(ts_tensor_set_requires_grad(in[0], true));
        th_gradcheck(gc_cast, 1, in, &hops[k], k ? 0x1p-10 : TH_GC_EPS, TH_GC_ATOL, TH_GC_RTOL);
        cr_assert_eq(ts_tensor_dtype(ts_tensor_grad(in[0])), TS_F64);
        ts_tensor_free(in[0]);
    }
    th_mem_assert_back();
}

/* ------------------------------------------------------------ eq */

Test(tensor_shape_ops, eq_broadcasts_and_returns_bool)
{
    th_mem_mark();
    int64_t sa[2] = {2, 3}, sb[1] = {3};
    double av[6] = {1, 2, 3, 3, 2, 1}, bv[3] = {1, 2, 1};
    ts_tensor *a = th_tensor(TS_F32, 2, sa, av), *b = th_tensor(TS_F32, 1, sb, bv), *o;
    TH_OK(ts_tensor_set_requires_grad(a, true));
    TH_OK(ts_eq(a, b, &o));
    th_assert_shape(o, 2, sa);
    cr_assert_eq(ts_tensor_dtype(o), TS_BOOL);
    cr_assert(!ts_tensor_requires_grad(o), "eq is not differentiable");
    double g[6], w[6] = {1, 1, 0, 0, 1, 1};
    th_vals(o, g, 6);
    for (int i = 0; i < 6; i++) cr_assert_eq(g[i], w[i], "[%d]", i);
    ts_tensor_free(o);
    /* NaN equals nothing, not even itself */
    ts_tensor *n;
    TH_OK(ts_tensor_scalar(TS_F64, NAN, &n));
    TH_OK(ts_eq(n, n, &o));
    double r;
    TH_OK(ts_tensor_item(o, &r));
    cr_assert_eq(r, 0.0);
    ts_tensor_free(o);
    /* integer tensors compare too */
    double iv[3] = {4, 5, 6}, jv[3] = {4, 0, 6};
    ts_tensor *i1 = th_tensor(TS_I64, 1, sb, iv), *i2 = th_tensor(TS_I64, 1, sb, jv);
    TH_OK(ts_eq(i1, i2, &o));
    th_vals(o, g, 3);
    cr_assert(g[0] == 1 && g[1] == 0 && g[2] == 1);
    ts_tensor_free(o);
    int64_t s4[1] = {4};
    ts_tensor *c = th_seq(TS_F32, 1, s4, 1, false);
    cr_assert_eq(ts_eq(a, c, &o), TS_ERR_SHAPE);
    ts_tensor_free(c);
    ts_tensor_free(i1);
    ts_tensor_free(i2);
    ts_tensor_free(n);
    ts_tensor_free(a);
    ts_tensor_free(b);
    th_mem_assert_back();
}
