/* Scopes for temporaries (tensor/tensor.h, ts_scope): what a scope owns is
 * released when it ends, also on an error half-way; kept tensors outlive
 * it; scopes nest per thread; gradients through scoped temporaries are
 * bitwise those of the same ops without a scope. */
#include "tensor/tensor.h"
#include "tests/helpers.h"

#include <criterion/criterion.h>
#include <pthread.h>
#include <string.h>

/* h = tanh(x * w); y = sum(h * h + x) -- scoped, with an optional bad op
 * (a shape mismatch) after the first two, which must release them. */
static ts_status scoped_f(ts_tensor *x, ts_tensor *w, bool fail, ts_tensor **out)
{
    ts_scope s = ts_scope_begin();
    ts_tensor *h, *y, *bad;
    TS_SCOPED(s, h, ts_mul(x, w, &h));
    TS_SCOPED(s, h, ts_tanh(h, &h));
    if (fail) {
        int64_t sh[1] = {5};
        ts_tensor *other;
        TS_SCOPED(s, other, ts_tensor_zeros(TS_F64, 1, sh, &other));
        TS_SCOPED(s, bad, ts_add(h, other, &bad)); /* (3, 4) + (5,): TS_ERR_SHAPE */
    }
    TS_SCOPED(s, y, ts_mul(h, h, &y));
    TS_SCOPED(s, y, ts_add(y, x, &y));
    TS_SCOPED(s, y, ts_sum(y, 0, NULL, false, &y));
    int n = 0;
    return ts_scope_return(s, 1, &y, &n, out);
}

/* The same ops, each temporary freed by hand. */
static ts_status plain_f(ts_tensor *x, ts_tensor *w, ts_tensor **out)
{
    ts_tensor *a = NULL, *h = NULL, *hh = NULL, *z = NULL;
    ts_status st = ts_mul(x, w, &a);
    if (!st) st = ts_tanh(a, &h);
    if (!st) st = ts_mul(h, h, &hh);
    if (!st) st = ts_add(hh, x, &z);
    if (!st) st = ts_sum(z, 0, NULL, false, out);
    ts_tensor_free(a);
    ts_tensor_free(h);
    ts_tensor_free(hh);
    ts_tensor_free(z);
    return st;
}

static void inputs(ts_tensor **x, ts_tensor **w)
{
    int64_t sh[2] = {3, 4};
    *x = th_seq(TS_F64, 2, sh, 0.3, true);
    *w = th_seq(TS_F64, 2, sh, -0.2, true);
}

Test(tensor_scope, gradients_bitwise_as_without_scope)
{
    ts_tensor *x1, *w1, *x2, *w2, *y1 = NULL, *y2 = NULL;
    inputs(&x1, &w1);
    inputs(&x2, &w2);
    TH_OK(plain_f(x1, w1, &y1));
    TH_OK(scoped_f(x2, w2, false, &y2)); /* the scope has ended: its temporaries are released */
    cr_assert_eq(ts_scope_depth(), 0);
    TH_OK(ts_backward(y1, NULL, false));
    TH_OK(ts_backward(y2, NULL, false));
    double a, b;
    TH_OK(ts_tensor_item(y1, &a));
    TH_OK(ts_tensor_item(y2, &b));
    cr_assert_eq(memcmp(&a, &b, sizeof a), 0, "%.17g vs %.17g", a, b);
    const ts_tensor *g[4] = {ts_tensor_grad(x1), ts_tensor_grad(x2), ts_tensor_grad(w1), ts_tensor_grad(w2)};
    for (int i = 0; i < 4; i += 2) {
        cr_assert_not_null(g[i]);
        cr_assert_not_null(g[i + 1]);
        cr_assert_eq(memcmp(ts_tensor_data(g[i]), ts_tensor_data(g[i + 1]), 12 * sizeof(double)), 0,
                     "gradient %d differs", i / 2);
    }
    ts_tensor *all[6] = {x1, w1, x2, w2, y1, y2};
    for (int i = 0; i < 6; i++) ts_tensor_free(all[i]);
}

Test(tensor_scope, an_error_half_way_releases_everything)
{
    ts_tensor *x, *w, *y = NULL;
    inputs(&x, &w);
    TH_OK(scoped_f(x, w, false, &y)); /* first use: one-time tables */
    ts_tensor_free(y);
    y = NULL;
    th_mem_mark();
    TH_FAILS(scoped_f(x, w, true, &y), TS_ERR_SHAPE, "add");
    cr_assert_null(y);
    cr_assert_eq(ts_scope_depth(), 0);
    th_mem_assert_back();
    /* and on success, only the result stays */
    TH_OK(scoped_f(x, w, false, &y));
    ts_tensor_free(y);
    th_mem_assert_back();
    ts_tensor_free(x);
    ts_tensor_free(w);
}

Test(tensor_scope, nesting_and_keep)
{
    th_mem_mark();
    int64_t sh[1] = {3};
    ts_scope outer = ts_scope_begin();
    ts_tensor *a, *b, *kept, *inner_kept;
    TH_OK(ts_tensor_ones(TS_F32, 1, sh, &a));
    TH_OK(ts_scope_add(outer, a));
    ts_scope inner = ts_scope_begin();
    cr_assert_eq(ts_scope_depth(), 2);
    /* more tensors than a frame holds inline, and a rebound variable */
    ts_tensor *acc = a;
    for (int i = 0; i < 20; i++) {
        ts_tensor *next;
        TH_OK(ts_add(acc, a, &next));
        TH_OK(ts_scope_add(inner, next));
        acc = next;
    }
    inner_kept = acc;
    TH_OK(ts_scope_keep(inner, inner_kept)); /* the caller's now */
    TH_OK(ts_scope_add(outer, inner_kept));  /* handed to the outer scope */
    TH_OK(ts_scope_end(inner));
    cr_assert_eq(ts_scope_depth(), 1);
    double v = 0;
    int64_t i0[1] = {0};
    TH_OK(ts_tensor_get(inner_kept, i0, &v));
    cr_assert_eq(v, 21.0);
    TH_OK(ts_mul_scalar(a, 2.0, &b));
    TH_OK(ts_scope_add(outer, b));
    TH_OK(ts_scope_keep(outer, b));
    kept = b;
    TH_OK(ts_scope_keep(outer, a)); /* kept twice: a scope's reference, then a new one */
    TH_OK(ts_scope_keep(outer, a));
    TH_OK(ts_scope_end(outer));
    cr_assert_eq(ts_scope_depth(), 0);
    TH_OK(ts_tensor_get(kept, i0, &v));
    cr_assert_eq(v, 2.0);
    TH_OK(ts_tensor_get(a, i0, &v));
    cr_assert_eq(v, 1.0);
    ts_tensor_free(kept);
    ts_tensor_free(a);
    ts_tensor_free(a);
    th_mem_assert_back();
}

/* Deeper than the stack's inline frames, and an outer end with inner
 * scopes left open: everything released, an error that says so. */
Test(tensor_scope, deep_nesting_and_misuse)
{
    th_mem_mark();
    int64_t sh[1] = {2};
    ts_scope s[40];
    for (int d = 0; d < 40; d++) {
        s[d] = ts_scope_begin();
        ts_tensor *t;
        TH_OK(ts_tensor_zeros(TS_F32, 1, sh, &t));
        TH_OK(ts_scope_add(s[d], t));
    }
    cr_assert_eq(ts_scope_depth(), 40);
    TH_OK(ts_scope_end(s[39]));
    TH_FAILS(ts_scope_end(s[5]), TS_ERR_STATE, "33 scopes begun inside this one were still open");
    cr_assert_eq(ts_scope_depth(), 5);
    TH_FAILS(ts_scope_end(s[5]), TS_ERR_STATE, "the scope has ended");
    TH_FAILS(ts_scope_end(s[39]), TS_ERR_STATE, "the scope has ended");
    ts_tensor *t;
    TH_OK(ts_tensor_zeros(TS_F32, 1, sh, &t));
    TH_FAILS(ts_scope_add(s[7], t), TS_ERR_STATE, "ts_scope_add", "ended"); /* t released */
    TH_OK(ts_tensor_zeros(TS_F32, 1, sh, &t));
    TH_FAILS(ts_scope_keep(s[7], t), TS_ERR_STATE, "ts_scope_keep");
    ts_tensor_free(t);
    TH_FAILS(ts_scope_add(s[0], NULL), TS_ERR_INVALID_ARGUMENT, "NULL");
    TH_FAILS(ts_scope_keep(s[0], NULL), TS_ERR_INVALID_ARGUMENT, "NULL");
    ts_scope never = {-1, 0};
    TH_FAILS(ts_scope_end(never), TS_ERR_NO_MEMORY, "not opened");
    /* ts_scope_fail keeps the error it is given */
    ts_error(TS_ERR_SHAPE, "the original detail");
    cr_assert_eq(ts_scope_fail(s[9], TS_ERR_SHAPE), TS_ERR_SHAPE);
    cr_assert_str_eq(ts_last_error(), "the original detail");
    ts_tensor *outs[1];
    int n = 0;
    TH_FAILS(ts_scope_return(s[4], 1, (ts_tensor *const[]){NULL}, &n, outs), TS_ERR_INVALID_ARGUMENT, "tensor 0 of 1");
    cr_assert_eq(ts_scope_depth(), 4, "ts_scope_return ended the scope on its error");
    TH_FAILS(ts_scope_end(s[0]), TS_ERR_STATE, "3 scopes begun inside this one");
    cr_assert_eq(ts_scope_depth(), 0);
    th_mem_assert_back();
}

static void *other_thread(void *arg)
{
    ts_scope *s = arg;
    static ts_status st;
    st = ts_scope_end(*s); /* not this thread's */
    ts_scope mine = ts_scope_begin();
    if (st == TS_ERR_STATE && ts_scope_depth() == 1) st = ts_scope_end(mine);
    else st = TS_ERR_INTERNAL;
    return &st;
}

Test(tensor_scope, per_thread)
{
    ts_scope s = ts_scope_begin();
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, other_thread, &s), 0);
    void *r = NULL;
    pthread_join(th, &r);
    cr_assert_eq(*(ts_status *)r, TS_OK, "another thread's scope was not refused, or its own failed");
    cr_assert_eq(ts_scope_depth(), 1);
    TH_OK(ts_scope_end(s));
}
