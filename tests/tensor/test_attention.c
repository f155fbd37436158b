/* ts_attention: against the same computation written with plain ops,
 * finite-difference gradients, masks, dropout and bad input. */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "tests/helpers.h"

/* softmax(q_h k_h^T / sqrt(hd) masked) [* D_h] v_h, heads side by side,
 * written with views, matmul, masked_fill, softmax, mul and cat. */
static ts_tensor *composed(ts_tensor *q, ts_tensor *k, ts_tensor *v, int64_t H, ts_tensor *mask, ts_tensor *D)
{
    int64_t E = ts_tensor_size(q, 2), hd = E / H;
    ts_tensor *heads[16];
    for (int64_t h = 0; h < H; h++) {
        ts_tensor *qh, *kh, *vh, *kt, *s, *ss, *sm, *p, *pd = NULL, *o;
        TH_OK(ts_narrow(q, 2, h * hd, hd, &qh));
        TH_OK(ts_narrow(k, 2, h * hd, hd, &kh));
        TH_OK(ts_narrow(v, 2, h * hd, hd, &vh));
        TH_OK(ts_transpose(kh, 1, 2, &kt));
        TH_OK(ts_matmul(qh, kt, &s));
        TH_OK(ts_div_scalar(s, sqrt((double)hd), &ss));
        if (mask) TH_OK(ts_masked_fill(ss, mask, -INFINITY, &sm));
        else sm = ts_tensor_retain(ss);
        TH_OK(ts_softmax(sm, -1, &p));
        if (D) {
            ts_tensor *dh;
            TH_OK(ts_narrow(D, 1, h, 1, &dh));
            ts_tensor *d3;
            TH_OK(ts_squeeze(dh, 1, &d3));
            TH_OK(ts_mul(p, d3, &pd));
            ts_tensor_free(dh);
            ts_tensor_free(d3);
        } else {
            pd = ts_tensor_retain(p);
        }
        TH_OK(ts_matmul(pd, vh, &o));
        heads[h] = o;
        ts_tensor *all[] = {qh, kh, vh, kt, s, ss, sm, p, pd};
        for (size_t i = 0; i < sizeof all / sizeof *all; i++) ts_tensor_free(all[i]);
    }
    ts_tensor *out;
    TH_OK(ts_cat((int)H, heads, 2, &out));
    for (int64_t h = 0; h < H; h++) ts_tensor_free(heads[h]);
    return out;
}

static ts_tensor *causal(int64_t T)
{
    ts_tensor *keep, *f, *m;
    TH_OK(ts_tril_mask(T, 0, &keep));
    TH_OK(ts_tensor_full(TS_BOOL, 0, NULL, 0.0, &f));
    TH_OK(ts_eq(keep, f, &m));
    ts_tensor_free(keep);
    ts_tensor_free(f);
    return m;
}

Test(tensor_attention, matches_the_composed_ops_from_packed_views)
{
    th_mem_mark();
    int64_t s[3] = {2, 5, 24};
    ts_tensor *qkv = th_seq(TS_F32, 3, s, 1.0, false), *parts[3], *mask = causal(5);
    int n;
    TH_OK(ts_chunk(qkv, 3, 2, 3, parts, &n)); /* strided views (row stride 24) */
    for (int masked = 0; masked < 2; masked++) {
        ts_tensor *a, *b = composed(parts[0], parts[1], parts[2], 2, masked ? mask : NULL, NULL);
        TH_OK(ts_attention(parts[0], parts[1], parts[2], 2, masked ? mask : NULL, 0.0, true, NULL, &a));
        /* f32: two products of 4 and 5 terms and a softmax: 1e-6 */
        th_assert_close(a, b, 1e-5, 1e-6);
        ts_tensor_free(a);
        ts_tensor_free(b);
    }
    for (int i = 0; i < 3; i++) ts_tensor_free(parts[i]);
    ts_tensor_free(qkv);
    ts_tensor_free(mask);
    th_mem_assert_back();
}

typedef struct actx {
    ts_tensor *mask;
} actx;

static ts_status attn_fn(ts_tensor **in, ts_tensor **out, void *ctx)
{
    return ts_attention(in[0], in[1], in[2], 2, ((actx *)ctx)->mask, 0.0, true, NULL, out);
}

Test(tensor_attention, gradients_match_finite_differences)
{
    th_mem_mark();
    int64_t qs[3] = {2, 3, 4}, ks[3] = {2, 3, 4};
    ts_tensor *q = th_seq(TS_F64, 3, qs, 1.0, true), *k = th_seq(TS_F64, 3, ks, 0.7, true),
              *v = th_seq(TS_F64, 3, ks, 1.3, true);
    ts_tensor *in[3] = {q, k, v};
    actx c = {NULL};
    th_gradcheck(attn_fn, 3, in, &c, 1e-6, 1e-8, 1e-6);
    c.mask = causal(3);
    th_gradcheck(attn_fn, 3, in, &c, 1e-6, 1e-8, 1e-6);
    ts_tensor_free(c.mask);
    ts_tensor_free(q);
    ts_tensor_free(k);
    ts_tensor_free(v);
    th_mem_assert_back();
}

Test(tensor_attention, dropout_uses_the_torch_stream_over_weights)
{
    int64_t s[3] = {2, 4, 8}, ds[4] = {2, 2, 4, 4};
    ts_tensor *q = th_seq(TS_F32, 3, s, 1.0, false), *k = th_seq(TS_F32, 3, s, 0.5, false),
              *v = th_seq(TS_F32, 3, s, 2.0, false), *a, *b, *D, *Ds;
    ts_manual_seed(11);
    TH_OK(ts_attention(q, k, v, 2, NULL, 0.25, true, NULL, &a));
    /* the same draws, made by hand: bernoulli(0.75) over (B, H, T, S) / 0.75 */
    ts_manual_seed(11);
    TH_OK(ts_tensor_empty(TS_F32, 4, ds, &D));
    TH_OK(ts_bernoulli_(D, 0.75, NULL));
    TH_OK(ts_div_scalar(D, 0.75, &Ds));
    b = composed(q, k, v, 2, NULL, Ds);
    th_assert_close(a, b, 1e-5, 1e-6);
    ts_tensor *e;
    TH_OK(ts_attention(q, k, v, 2, NULL, 0.25, false, NULL, &e)); /* eval: no dropout */
    ts_tensor *c = composed(q, k, v, 2, NULL, NULL);
    th_assert_close(e, c, 1e-5, 1e-6);
    ts_tensor *all[] = {q, k, v, a, b, D, Ds, e, c};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) ts_tensor_free(all[i]);
}

Test(tensor_attention, bad_input_is_an_error)
{
    int64_t s[3] = {2, 4, 6}, s2[3] = {2, 4, 5}, ms[2] = {3, 4};
    ts_tensor *q = th_seq(TS_F32, 3, s, 1.0, false), *k = th_seq(TS_F32, 3, s2, 1.0, false), *m, *o = NULL;
    cr_assert_eq(ts_attention(q, k, k, 2, NULL, 0.0, true, NULL, &o), TS_ERR_SHAPE);
    cr_assert(strstr(ts_last_error(), "(2, 4, 6)") && strstr(ts_last_error(), "(2, 4, 5)"), "%s", ts_last_error());
    cr_assert_eq(ts_attention(q, q, q, 4, NULL, 0.0, true, NULL, &o), TS_ERR_INVALID_ARGUMENT);
    TH_OK(ts_tensor_zeros(TS_BOOL, 2, ms, &m));
    cr_assert_eq(ts_attention(q, q, q, 2, m, 0.0, true, NULL, &o), TS_ERR_SHAPE);
    cr_assert_eq(ts_attention(q, q, q, 2, NULL, 1.0, true, NULL, &o), TS_ERR_INVALID_ARGUMENT);
    cr_assert_null(o);
    ts_tensor_free(q);
    ts_tensor_free(k);
    ts_tensor_free(m);
}

typedef struct smctx {
    ts_tensor *mask;
} smctx;

static ts_status smsoft(ts_tensor **in, ts_tensor **out, void *ctx)
{
    return ts_scaled_masked_softmax(in[0], ((smctx *)ctx)->mask, 0.5, out);
}

Test(tensor_attention, scaled_masked_softmax_matches_composition)
{
    th_mem_mark();
    int64_t s[3] = {2, 4, 4};
    ts_tensor *x = th_seq(TS_F32, 3, s, 3.0, false), *mask = causal(4), *a, *xs, *xm, *b;
    TH_OK(ts_scaled_masked_softmax(x, mask, 0.5, &a));
    TH_OK(ts_mul_scalar(x, 0.5, &xs));
    TH_OK(ts_masked_fill(xs, mask, -INFINITY, &xm));
    TH_OK(ts_softmax(xm, -1, &b));
    th_assert_close(a, b, 1e-6, 1e-7); /* same float operations up to exp rounding */
    ts_tensor *x64 = th_seq(TS_F64, 3, s, 1.0, true);
    smctx c = {mask};
    th_gradcheck(smsoft, 1, &x64, &c, 1e-6, 1e-8, 1e-6);
    int64_t bad[2] = {3, 4};
    ts_tensor *bm, *o = NULL;
    TH_OK(ts_tensor_zeros(TS_BOOL, 2, bad, &bm));
    cr_assert_eq(ts_scaled_masked_softmax(x, bm, 1.0, &o), TS_ERR_SHAPE);
    cr_assert(strstr(ts_last_error(), "(3, 4)") != NULL, "%s", ts_last_error());
    ts_tensor *all[] = {x, mask, a, xs, xm, b, x64, bm};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) ts_tensor_free(all[i]);
    th_mem_assert_back();
}
