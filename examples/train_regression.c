/* Fits y = sin(3x) + 0.5x with a two-layer MLP (Linear(1, 64), tanh,
 * Linear(64, 1)) by full-batch SGD with momentum, using the library's
 * tensors, autograd and PyTorch-exact initialization. Prints the loss as it
 * falls. This is the single-process example of the foundation layer; the
 * fully_shard training examples build on the same pieces.
 *
 * Usage: train_regression [--steps N] [--lr LR] [--seed S] */
#include "common.h"

/* A Linear layer's parameters initialised as torch.nn.Linear does. */
static void linear_init(int64_t in, int64_t out, ts_tensor **w, ts_tensor **b)
{
    int64_t ws[2] = {out, in}, bs[1] = {out};
    CHECK(ts_tensor_empty(TS_F32, 2, ws, w));
    CHECK(ts_tensor_empty(TS_F32, 1, bs, b));
    CHECK(ts_init_kaiming_uniform_(*w, sqrt(5.0), TS_FAN_IN, TS_NL_LEAKY_RELU, NULL));
    double bound = 1.0 / sqrt((double)in);
    CHECK(ts_uniform_(*b, -bound, bound, NULL));
    CHECK(ts_tensor_set_requires_grad(*w, true));
    CHECK(ts_tensor_set_requires_grad(*b, true));
}

int main(int argc, char **argv)
{
    int steps = 2000;
    double lr = 0.05, momentum = 0.9;
    uint64_t seed = 0;
    ex_flag flags[] = {
        {"--steps", "N", EX_FLAG_INT, &steps, 1, INT_MAX, false, "full-batch SGD steps", false},
        {"--lr", "LR", EX_FLAG_DOUBLE, &lr, 0, 10, true, "learning rate (momentum 0.9)", false},
        {"--seed", "S", EX_FLAG_U64, &seed, 0, 18446744073709551615.0, false, "initialization", false},
    };
    ex_parse_flags(argc, argv, "Fits y = sin(3x) + 0.5x with a two-layer MLP and hand-written SGD.", flags,
                   (int)(sizeof flags / sizeof flags[0]));
    ts_manual_seed(seed);
    ts_tensor *w1, *b1, *w2, *b2;
    linear_init(1, 64, &w1, &b1);
    linear_init(64, 1, &w2, &b2);
    ts_tensor *params[4] = {w1, b1, w2, b2}, *velocity[4] = {0};

    /* data: 256 points in [-2, 2] */
    enum { N = 256 };
    float xs[N], ys[N];
    for (int i = 0; i < N; i++) {
        xs[i] = -2.0f + 4.0f * (float)i / (N - 1);
        ys[i] = sinf(3 * xs[i]) + 0.5f * xs[i];
    }
    int64_t ds[2] = {N, 1};
    ts_tensor *x, *y;
    CHECK(ts_tensor_from_data(TS_F32, 2, ds, xs, &x));
    CHECK(ts_tensor_from_data(TS_F32, 2, ds, ys, &y));

    double first = 0, last = 0;
    for (int step = 0; step < steps; step++) {
        ts_tensor *h, *a, *p, *loss;
        CHECK(ts_linear(x, w1, b1, &h));
        CHECK(ts_tanh(h, &a));
        CHECK(ts_linear(a, w2, b2, &p));
        CHECK(ts_mse_loss(p, y, TS_REDUCTION_MEAN, &loss));
        CHECK(ts_backward(loss, NULL, false));
        double l;
        CHECK(ts_tensor_item(loss, &l));
        if (step == 0) first = l;
        last = l;
        if (step % (steps / 10 > 0 ? steps / 10 : 1) == 0 || step == steps - 1)
            printf("step %5d  loss %.6f\n", step, l);
        /* SGD with momentum on each parameter, outside the graph */
        bool prev = ts_grad_mode_set(false);
        for (int k = 0; k < 4; k++) {
            ts_tensor *g = ts_tensor_grad(params[k]), *v, *upd, *np;
            if (!velocity[k]) {
                velocity[k] = ts_tensor_retain(g);
            } else {
                ts_tensor *vm;
                CHECK(ts_mul_scalar(velocity[k], momentum, &vm));
                CHECK(ts_add(vm, g, &v));
                ts_tensor_free(vm);
                ts_tensor_free(velocity[k]);
                velocity[k] = v;
            }
            CHECK(ts_mul_scalar(velocity[k], lr, &upd));
            CHECK(ts_sub(params[k], upd, &np));
            CHECK(ts_tensor_copy_(params[k], np));
            ts_tensor_free(upd);
            ts_tensor_free(np);
            ts_tensor_zero_grad(params[k], true);
        }
        ts_grad_mode_set(prev);
        ts_tensor_free(h);
        ts_tensor_free(a);
        ts_tensor_free(p);
        ts_tensor_free(loss);
    }
    printf("loss %.6f -> %.6f (%.1fx lower); peak tensor memory %.1f KiB\n", first, last, first / last,
           (double)ts_mem_peak_bytes(TS_MEM_STORAGE) / 1024.0);
    for (int k = 0; k < 4; k++) {
        ts_tensor_free(params[k]);
        ts_tensor_free(velocity[k]);
    }
    ts_tensor_free(x);
    ts_tensor_free(y);
    if (!isfinite(last)) {
        fprintf(stderr, "train_regression: the loss is %g (diverged; try a smaller --lr than %g)\n", last, lr);
        return 1;
    }
    return 0;
}
