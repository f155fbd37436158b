#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "tests/helpers.h"

static double item(ts_tensor *t)
{
    double v;
    TH_OK(ts_tensor_item(t, &v));
    return v;
}

static double at(ts_tensor *t, int64_t i)
{
    double v;
    int64_t idx[1] = {i};
    TH_OK(ts_tensor_get(t, idx, &v));
    return v;
}

Test(tensor_autograd, chain_rule_and_accumulation)
{
    th_mem_mark();
    int64_t s[1] = {3};
    double xv[3] = {1, 2, 3};
    ts_tensor *x = th_tensor(TS_F64, 1, s, xv), *y, *z, *l;
    TH_OK(ts_tensor_set_requires_grad(x, true));
    cr_assert(ts_tensor_is_leaf(x));
    /* l = sum(x * x * 3) -> dl/dx = 6x */
    TH_OK(ts_mul(x, x, &y));
    cr_assert(!ts_tensor_is_leaf(y));
    TH_OK(ts_mul_scalar(y, 3.0, &z));
    TH_OK(ts_sum(z, 0, NULL, false, &l));
    cr_assert_float_eq(item(l), 42.0, 1e-12);
    TH_OK(ts_backward(l, NULL, true));
    for (int i = 0; i < 3; i++) cr_assert_float_eq(at(ts_tensor_grad(x), i), 6 * xv[i], 1e-12);
    /* a second backward (graph retained) accumulates into .grad */
    TH_OK(ts_backward(l, NULL, false));
    for (int i = 0; i < 3; i++) cr_assert_float_eq(at(ts_tensor_grad(x), i), 12 * xv[i], 1e-12);
    /* the graph is now released */
    cr_assert_eq(ts_backward(l, NULL, false), TS_ERR_AUTOGRAD);
    cr_assert(strstr(ts_last_error(), "second time") != NULL, "%s", ts_last_error());
    ts_tensor_zero_grad(x, false);
    cr_assert_float_eq(at(ts_tensor_grad(x), 1), 0.0, 0);
    ts_tensor_zero_grad(x, true);
    cr_assert_null(ts_tensor_grad(x));
    ts_tensor_free(x);
    ts_tensor_free(y);
    ts_tensor_free(z);
    ts_tensor_free(l);
    th_mem_assert_back();
}

Test(tensor_autograd, no_grad_scope_records_nothing)
{
    int64_t s[1] = {2};
    ts_tensor *x = th_seq(TS_F32, 1, s, 1.0, true), *y, *z;
    bool prev = ts_grad_mode_set(false);
    cr_assert(prev);
    cr_assert(!ts_grad_mode_enabled());
    TH_OK(ts_exp(x, &y));
    ts_grad_mode_set(prev);
    cr_assert(!ts_tensor_requires_grad(y));
    cr_assert(ts_tensor_is_leaf(y));
    TH_OK(ts_exp(x, &z));
    cr_assert(ts_tensor_requires_grad(z));
    ts_tensor_free(x);
    ts_tensor_free(y);
    ts_tensor_free(z);
}

Test(tensor_autograd, set_requires_grad_only_on_float_leaves)
{
    int64_t s[1] = {2};
    ts_tensor *x = th_seq(TS_F32, 1, s, 1.0, true), *y, *i;
    TH_OK(ts_neg(x, &y));
    cr_assert_eq(ts_tensor_set_requires_grad(y, false), TS_ERR_AUTOGRAD);
    cr_assert(strstr(ts_last_error(), "not a leaf") != NULL);
    TH_OK(ts_tensor_zeros(TS_I64, 1, s, &i));
    cr_assert_eq(ts_tensor_set_requires_grad(i, true), TS_ERR_DTYPE);
    ts_tensor_free(x);
    ts_tensor_free(y);
    ts_tensor_free(i);
}

Test(tensor_autograd, explicit_gradient_for_non_scalar_root)
{
    int64_t s[2] = {2, 2};
    ts_tensor *x = th_seq(TS_F64, 2, s, 1.0, true), *y, *g, *bad;
    TH_OK(ts_mul_scalar(x, 5.0, &y));
    cr_assert_eq(ts_backward(y, NULL, false), TS_ERR_AUTOGRAD);
    cr_assert(strstr(ts_last_error(), "(2, 2)") != NULL, "%s", ts_last_error());
    int64_t s3[1] = {3};
    TH_OK(ts_tensor_ones(TS_F64, 1, s3, &bad));
    cr_assert_eq(ts_backward(y, bad, false), TS_ERR_SHAPE);
    TH_OK(ts_tensor_full(TS_F64, 2, s, 2.0, &g));
    TH_OK(ts_backward(y, g, false));
    int64_t idx[2] = {1, 1};
    double v;
    TH_OK(ts_tensor_get(ts_tensor_grad(x), idx, &v));
    cr_assert_float_eq(v, 10.0, 1e-12);
    ts_tensor_free(x);
    ts_tensor_free(y);
    ts_tensor_free(g);
    ts_tensor_free(bad);
}

/* ------------------------------------------------------ extension points */

typedef struct event_log {
    char ev[32][32];
    int n;
    ts_tensor *watch;       /* leaf whose grad is inspected by callbacks */
    double watch_grad_seen; /* its grad[0] when the callback ran */
} event_log;

static void note(event_log *log, const char *what)
{
    cr_assert_lt(log->n, 32);
    strncpy(log->ev[log->n++], what, 31);
}

typedef struct marker {
    event_log *log;
    const char *name;
    int *freed;
} marker;

static ts_status end_cb(void *ctx)
{
    event_log *log = ctx;
    note(log, "end-of-backward");
    ts_tensor *g = ts_tensor_grad(log->watch);
    log->watch_grad_seen = g ? at(g, 0) : NAN;
    return TS_OK;
}

static ts_status marker_cb(void *ctx, int n, ts_tensor **grads)
{
    marker *m = ctx;
    note(m->log, m->name);
    cr_assert_eq(n, 1);
    cr_assert_not_null(grads[0]);
    if (strcmp(m->name, "pre-backward(outputs)") == 0) return ts_autograd_queue_callback(end_cb, m->log);
    return TS_OK;
}

static void marker_free(void *ctx)
{
    marker *m = ctx;
    (*m->freed)++;
}

/* A "module": y = tanh(x * w). Its inputs pass through a post-backward
 * marker made BEFORE its ops, its outputs through a pre-backward marker
 * made AFTER them, as fully_shard does. */
Test(tensor_autograd, markers_run_in_reverse_creation_order)
{
    th_mem_mark();
    event_log log = {0};
    int freed = 0;
    marker post = {&log, "post-backward(inputs)", &freed}, pre = {&log, "pre-backward(outputs)", &freed};
    int64_t s[1] = {4};
    ts_tensor *x = th_seq(TS_F64, 1, s, 1.0, true), *w = th_seq(TS_F64, 1, s, 0.5, true);
    log.watch = w;
    ts_tensor *xin, *h, *y, *yout, *l;
    TH_OK(ts_autograd_custom(1, &x, marker_cb, &post, marker_free, &xin));
    TH_OK(ts_mul(xin, w, &h));
    TH_OK(ts_tanh(h, &y));
    TH_OK(ts_autograd_custom(1, &y, marker_cb, &pre, marker_free, &yout));
    TH_OK(ts_sum(yout, 0, NULL, false, &l));
    cr_assert_eq(log.n, 0, "nothing runs in forward");
    TH_OK(ts_backward(l, NULL, false));
    cr_assert_eq(log.n, 3);
    cr_assert_str_eq(log.ev[0], "pre-backward(outputs)");
    cr_assert_str_eq(log.ev[1], "post-backward(inputs)");
    cr_assert_str_eq(log.ev[2], "end-of-backward");
    /* by the end-of-backward callback, w's gradient was complete */
    double xv = at(x, 0), wv = at(w, 0), t = tanh(xv * wv);
    cr_assert_float_eq(log.watch_grad_seen, (1 - t * t) * xv, 1e-12);
    /* gradients pass through the identity markers unchanged */
    cr_assert_float_eq(at(ts_tensor_grad(x), 0), (1 - t * t) * wv, 1e-12);
    cr_assert_eq(freed, 0);
    ts_tensor_free(x);
    ts_tensor_free(w);
    ts_tensor_free(xin);
    ts_tensor_free(h);
    ts_tensor_free(y);
    ts_tensor_free(yout);
    ts_tensor_free(l);
    cr_assert_eq(freed, 2, "ctx_free runs when the nodes die");
    th_mem_assert_back();
}

static ts_status scale_grad_cb(void *ctx, int n, ts_tensor **grads)
{
    (void)ctx;
    for (int i = 0; i < n; i++) {
        ts_tensor *s;
        ts_status st = ts_mul_scalar(grads[i], 10.0, &s);
        if (st) return st;
        ts_tensor_free(grads[i]);
        grads[i] = s;
    }
    return TS_OK;
}

Test(tensor_autograd, custom_callback_may_replace_gradients)
{
    int64_t s[1] = {2};
    ts_tensor *x = th_seq(TS_F64, 1, s, 1.0, true), *xo, *l;
    TH_OK(ts_autograd_custom(1, &x, scale_grad_cb, NULL, NULL, &xo));
    TH_OK(ts_sum(xo, 0, NULL, false, &l));
    TH_OK(ts_backward(l, NULL, false));
    cr_assert_float_eq(at(ts_tensor_grad(x), 0), 10.0, 1e-12);
    ts_tensor_free(x);
    ts_tensor_free(xo);
    ts_tensor_free(l);
}

static ts_status failing_cb(void *ctx, int n, ts_tensor **grads)
{
    (void)ctx;
    (void)n;
    (void)grads;
    return ts_error(TS_ERR_COMM, "simulated reduce-scatter failure");
}

Test(tensor_autograd, callback_error_stops_backward)
{
    th_mem_mark();
    int64_t s[1] = {2};
    ts_tensor *x = th_seq(TS_F64, 1, s, 1.0, true), *xo, *l;
    TH_OK(ts_autograd_custom(1, &x, failing_cb, NULL, NULL, &xo));
    TH_OK(ts_sum(xo, 0, NULL, false, &l));
    cr_assert_eq(ts_backward(l, NULL, false), TS_ERR_COMM);
    cr_assert(strstr(ts_last_error(), "simulated") != NULL);
    cr_assert(!ts_autograd_in_backward());
    ts_tensor_free(x);
    ts_tensor_free(xo);
    ts_tensor_free(l);
    th_mem_assert_back();
}

Test(tensor_autograd, custom_without_grad_is_a_plain_alias)
{
    int freed = 0;
    event_log log = {0};
    marker m = {&log, "never", &freed};
    int64_t s[1] = {2};
    ts_tensor *ids, *out;
    TH_OK(ts_tensor_zeros(TS_I64, 1, s, &ids));
    TH_OK(ts_autograd_custom(1, &ids, marker_cb, &m, marker_free, &out));
    cr_assert_eq(freed, 1, "ctx is released at once when the node can never run");
    cr_assert(!ts_tensor_requires_grad(out));
    cr_assert_eq(ts_tensor_data(out), ts_tensor_data(ids), "outputs alias the inputs");
    ts_tensor_free(ids);
    ts_tensor_free(out);
}

Test(tensor_autograd, queue_callback_outside_backward_is_refused)
{
    event_log log = {0};
    cr_assert_eq(ts_autograd_queue_callback(end_cb, &log), TS_ERR_STATE);
    cr_assert(strstr(ts_last_error(), "no backward") != NULL);
}

Test(tensor_autograd, unused_split_outputs_get_zero_gradients)
{
    int64_t s[1] = {6};
    ts_tensor *x = th_seq(TS_F64, 1, s, 1.0, true), *parts[3], *l;
    int n;
    TH_OK(ts_split(x, 2, 0, 3, parts, &n));
    cr_assert_eq(n, 3);
    TH_OK(ts_sum(parts[1], 0, NULL, false, &l));
    TH_OK(ts_backward(l, NULL, false));
    double want[6] = {0, 0, 1, 1, 0, 0};
    for (int i = 0; i < 6; i++) cr_assert_float_eq(at(ts_tensor_grad(x), i), want[i], 0);
    for (int i = 0; i < 3; i++) ts_tensor_free(parts[i]);
    ts_tensor_free(x);
    ts_tensor_free(l);
}

Test(tensor_autograd, long_chain_frees_without_deep_recursion)
{
    th_mem_mark();
    int64_t s[1] = {1};
    ts_tensor *x = th_seq(TS_F32, 1, s, 1.0, true), *y = ts_tensor_retain(x);
    for (int i = 0; i < 200000; i++) {
        ts_tensor *z;
        TH_OK(ts_add_scalar(y, 1e-6, &z));
        ts_tensor_free(y);
        y = z;
    }
    ts_tensor_free(y); /* frees 200k nodes iteratively */
    ts_tensor_free(x);
    th_mem_assert_back();
}

Test(tensor_autograd, leaf_grad_never_aliases_the_callers_gradient)
{
    int64_t s2[2] = {2, 2}, s4[1] = {4};
    ts_tensor *x = th_seq(TS_F64, 2, s2, 1.0, true), *y, *g;
    TH_OK(ts_view(x, 1, s4, &y));
    TH_OK(ts_tensor_ones(TS_F64, 1, s4, &g));
    TH_OK(ts_backward(y, g, false));
    cr_assert_neq(ts_tensor_data(ts_tensor_grad(x)), ts_tensor_data(g), ".grad must not share the caller's data");
    TH_OK(ts_tensor_fill_(g, 5.0));
    double v;
    int64_t i0[2] = {0, 0};
    TH_OK(ts_tensor_get(ts_tensor_grad(x), i0, &v));
    cr_assert_float_eq(v, 1.0, 0);
    ts_tensor_free(x);
    ts_tensor_free(y);
    ts_tensor_free(g);
}
