/* System invariants of the foundation: a training loop of many steps
 * learns and runs in flat memory (docs/design.md D2). */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <math.h>

#include "tests/helpers.h"

static void init_linear(int64_t in, int64_t out, ts_tensor **w, ts_tensor **b)
{
    int64_t ws[2] = {out, in}, bs[1] = {out};
    TH_OK(ts_tensor_empty(TS_F32, 2, ws, w));
    TH_OK(ts_tensor_empty(TS_F32, 1, bs, b));
    TH_OK(ts_init_kaiming_uniform_(*w, sqrt(5.0), TS_FAN_IN, TS_NL_LEAKY_RELU, NULL));
    TH_OK(ts_uniform_(*b, -1.0 / sqrt((double)in), 1.0 / sqrt((double)in), NULL));
    TH_OK(ts_tensor_set_requires_grad(*w, true));
    TH_OK(ts_tensor_set_requires_grad(*b, true));
}

static double step(ts_tensor **p, ts_tensor *x, ts_tensor *y, double lr)
{
    ts_tensor *h, *a, *o, *l;
    TH_OK(ts_linear(x, p[0], p[1], &h));
    TH_OK(ts_gelu(h, TS_GELU_TANH, &a));
    TH_OK(ts_linear(a, p[2], p[3], &o));
    TH_OK(ts_mse_loss(o, y, TS_REDUCTION_MEAN, &l));
    TH_OK(ts_backward(l, NULL, false));
    double v;
    TH_OK(ts_tensor_item(l, &v));
    bool prev = ts_grad_mode_set(false);
    for (int k = 0; k < 4; k++) {
        ts_tensor *u, *n;
        TH_OK(ts_mul_scalar(ts_tensor_grad(p[k]), lr, &u));
        TH_OK(ts_sub(p[k], u, &n));
        TH_OK(ts_tensor_copy_(p[k], n));
        ts_tensor_free(u);
        ts_tensor_free(n);
        ts_tensor_zero_grad(p[k], false); /* keep the grad buffers, as zero_grad(set_to_none=False) */
    }
    ts_grad_mode_set(prev);
    ts_tensor_free(h);
    ts_tensor_free(a);
    ts_tensor_free(o);
    ts_tensor_free(l);
    return v;
}

Test(tensor_training, thousands_of_steps_learn_in_flat_memory, .timeout = 120)
{
    th_mem_mark();
    ts_manual_seed(1);
    ts_tensor *p[4];
    init_linear(4, 32, &p[0], &p[1]);
    init_linear(32, 2, &p[2], &p[3]);
    int64_t xs[2] = {64, 4}, ys[2] = {64, 2};
    ts_tensor *x, *y;
    TH_OK(ts_randn(TS_F32, 2, xs, NULL, &x));
    /* a smooth target: y = (sum x, x0 * x1) */
    float yv[128];
    float xv[256];
    TH_OK(ts_tensor_copy_to(x, xv, sizeof xv));
    for (int i = 0; i < 64; i++) {
        yv[2 * i] = 0.5f * (xv[4 * i] + xv[4 * i + 1] + xv[4 * i + 2] + xv[4 * i + 3]);
        yv[2 * i + 1] = 0.5f * xv[4 * i] * xv[4 * i + 1];
    }
    TH_OK(ts_tensor_from_data(TS_F32, 2, ys, yv, &y));
    double first = step(p, x, y, 0.05);
    size_t live_storage = 0, pool = 0, autograd = 0;
    double last = first;
    for (int s = 1; s < 3000; s++) {
        last = step(p, x, y, 0.05);
        if (s == 50) {
            live_storage = ts_mem_live_bytes(TS_MEM_STORAGE);
            pool = ts_mem_live_bytes(TS_MEM_POOL);
            autograd = ts_mem_live_bytes(TS_MEM_AUTOGRAD);
        }
    }
    cr_assert_eq(ts_mem_live_bytes(TS_MEM_STORAGE), live_storage, "tensor memory grew over the loop");
    cr_assert_eq(ts_mem_live_bytes(TS_MEM_POOL), pool, "the pool took new memory after warm-up");
    cr_assert_eq(ts_mem_live_bytes(TS_MEM_AUTOGRAD), autograd, "graph memory was not released");
    cr_assert_lt(last, first / 5, "loss %g -> %g did not fall", first, last);
    for (int k = 0; k < 4; k++) ts_tensor_free(p[k]);
    ts_tensor_free(x);
    ts_tensor_free(y);
    th_mem_assert_back();
}
