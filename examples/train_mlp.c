/* Trains an MLP classifier (Linear, ReLU, Linear, ReLU, Linear) on a
 * built-in three-arm spiral data set with SGD + momentum or AdamW. Prints
 * step, loss, accuracy, samples/s and peak memory.
 *
 * Usage: train_mlp [--steps N] [--hidden H] [--optim sgd|adamw] [--lr LR] [--seed S] */
#include "common.h"

#include <math.h>

enum { PER_CLASS = 200, CLASSES = 3, N = PER_CLASS * CLASSES };

int main(int argc, char **argv)
{
    int steps = 500, hidden = 64;
    double lr = 0;
    const char *optim = "adamw";
    uint64_t seed = 0;
    ex_flag flags[] = {
        {"--steps", "N", EX_FLAG_INT, &steps, 1, INT_MAX, false, "full-batch optimizer steps", false},
        {"--hidden", "H", EX_FLAG_INT, &hidden, 1, 1 << 16, false, "width of the two hidden layers", false},
        {"--optim", "sgd|adamw", EX_FLAG_STRING, &optim, 0, 0, false, "SGD with momentum 0.9, or AdamW", false},
        {"--lr", "LR", EX_FLAG_DOUBLE, &lr, 0, 10, true, "learning rate (default 0.1 for sgd, 0.01 for adamw)", false},
        {"--seed", "S", EX_FLAG_U64, &seed, 0, 18446744073709551615.0, false, "the data set's noise", false},
    };
    ex_parse_flags(argc, argv,
                   "Classifies a built-in three-arm spiral with an MLP (Linear, ReLU, Linear, ReLU, Linear).", flags,
                   (int)(sizeof flags / sizeof flags[0]));
    bool sgd = !strcmp(optim, "sgd");
    if (!sgd && strcmp(optim, "adamw")) {
        fprintf(stderr, "train_mlp: --optim: '%s' is neither sgd nor adamw\n", optim);
        return 2;
    }
    if (lr <= 0) lr = sgd ? 0.1 : 1e-2;
    ts_manual_seed(seed);
    /* spiral: class c, point i at radius r, angle 4r + 2pi c/3 + noise */
    float xs[N * 2];
    int64_t ys[N];
    ts_tensor *noise;
    int64_t ns[1] = {N};
    CHECK(ts_randn(TS_F32, 1, ns, NULL, &noise));
    float nz[N];
    CHECK(ts_tensor_copy_to(noise, nz, sizeof nz));
    ts_tensor_free(noise);
    for (int c = 0; c < CLASSES; c++)
        for (int i = 0; i < PER_CLASS; i++) {
            int k = c * PER_CLASS + i;
            double r = (double)i / PER_CLASS, t = 4.0 * r + 2.0944 * c + 0.2 * nz[k];
            xs[2 * k] = (float)(r * sin(t));
            xs[2 * k + 1] = (float)(r * cos(t));
            ys[k] = c;
        }
    int64_t xsh[2] = {N, 2};
    ts_tensor *x, *y;
    CHECK(ts_tensor_from_data(TS_F32, 2, xsh, xs, &x));
    CHECK(ts_tensor_from_data(TS_I64, 1, ns, ys, &y));

    ts_module *k[5], *model;
    CHECK(ts_linear_new(2, hidden, true, &k[0]));
    CHECK(ts_relu_new(&k[1]));
    CHECK(ts_linear_new(hidden, hidden, true, &k[2]));
    CHECK(ts_relu_new(&k[3]));
    CHECK(ts_linear_new(hidden, CLASSES, true, &k[4]));
    CHECK(ts_sequential_new(5, k, &model));
    ts_named_params p;
    CHECK(ts_module_named_parameters(model, &p));
    ts_tensor *plist[16];
    for (int i = 0; i < p.n; i++) plist[i] = *p.items[i].slot;
    ts_optim *opt;
    if (sgd) {
        ts_sgd_options o = ts_sgd_options_default();
        o.lr = lr;
        o.momentum = 0.9;
        CHECK(ts_sgd_new(p.n, plist, &o, &opt));
    } else {
        ts_adam_options o = ts_adamw_options_default();
        o.lr = lr;
        CHECK(ts_adamw_new(p.n, plist, &o, &opt));
    }
    printf("spiral: %d points, %d classes; MLP 2-%d-%d-%d, %lld parameters, %s lr %g\n", N, CLASSES, hidden, hidden,
           CLASSES, (long long)ts_module_num_parameters(model), optim, lr);
    double t0 = ex_now(), first = 0, last = 0, acc = 0;
    for (int step = 0; step < steps; step++) {
        ts_tensor *logits, *loss, *pred;
        CHECK(ts_module_call1(model, x, &logits));
        CHECK(ts_cross_entropy(logits, y, -100, TS_REDUCTION_MEAN, &loss));
        CHECK(ts_backward(loss, NULL, false));
        CHECK(ts_optim_step(opt));
        ts_optim_zero_grad(opt, true);
        double l;
        CHECK(ts_tensor_item(loss, &l));
        if (step == 0) first = l;
        last = l;
        int every = steps >= 10 ? steps / 10 : 1;
        if ((step + 1) % every == 0 || step == 0) {
            ts_tensor *vals;
            CHECK(ts_max_dim(logits, 1, false, &vals, &pred));
            int64_t pv[N];
            CHECK(ts_tensor_copy_to(pred, pv, sizeof pv));
            int right = 0;
            for (int i = 0; i < N; i++) right += pv[i] == ys[i];
            acc = (double)right / N;
            printf("step %4d  loss %.4f  accuracy %.3f  %.0f samples/s  peak tensors %.2f MiB  rss %.1f MiB\n",
                   step + 1, l, acc, (double)N * (step + 1) / (ex_now() - t0),
                   (double)ts_mem_peak_bytes(TS_MEM_STORAGE) / 1048576.0, ex_peak_rss_mib());
            ts_tensor_free(vals);
            ts_tensor_free(pred);
        }
        ts_tensor_free(logits);
        ts_tensor_free(loss);
    }
    printf("loss %.4f -> %.4f, accuracy %.3f\n", first, last, acc);
    int rc = 0;
    if (!isfinite(last)) {
        fprintf(stderr, "train_mlp: the loss is %g (diverged; try a smaller --lr than %g)\n", last, lr);
        rc = 1;
    }
    ts_optim_free(opt);
    ts_named_params_free(&p);
    ts_module_free(model);
    ts_tensor_free(x);
    ts_tensor_free(y);
    return rc;
}
