/* An outside program built against an installed tensorshard with nothing but
 * pkg-config (scripts/check_install.sh): it includes the umbrella header,
 * fits a Linear with SGD for a few steps and checks that the loss fell. */
#include <stdio.h>

#include "tensorshard.h"

static int fail(const char *what)
{
    fprintf(stderr, "outside: %s failed: %s\n", what, ts_last_error());
    return 1;
}

int main(void)
{
    ts_manual_seed(0);
    ts_module *lin = NULL;
    if (ts_linear_new(4, 1, true, &lin) != TS_OK) return fail("ts_linear_new");
    const int64_t xs[2] = {16, 4}, ys[2] = {16, 1};
    ts_tensor *x = NULL, *y = NULL;
    if (ts_randn(TS_F32, 2, xs, NULL, &x) != TS_OK || ts_randn(TS_F32, 2, ys, NULL, &y) != TS_OK)
        return fail("ts_randn");
    ts_named_params np;
    if (ts_module_named_parameters(lin, &np) != TS_OK) return fail("ts_module_named_parameters");
    ts_tensor *params[2];
    for (int i = 0; i < np.n && i < 2; i++) params[i] = *np.items[i].slot;
    ts_optim *opt = NULL;
    ts_sgd_options so = ts_sgd_options_default();
    so.lr = 0.1;
    if (ts_sgd_new(np.n, params, &so, &opt) != TS_OK) return fail("ts_sgd_new");
    ts_named_params_free(&np);
    double first = 0, last = 0;
    for (int step = 0; step < 20; step++) {
        ts_tensor *out = NULL, *loss = NULL;
        if (ts_module_call1(lin, x, &out) != TS_OK) return fail("ts_module_call1");
        if (ts_mse_loss(out, y, TS_REDUCTION_MEAN, &loss) != TS_OK) return fail("ts_mse_loss");
        double v = 0;
        if (ts_tensor_item(loss, &v) != TS_OK) return fail("ts_tensor_item");
        if (step == 0) first = v;
        last = v;
        ts_optim_zero_grad(opt, true);
        if (ts_backward(loss, NULL, false) != TS_OK) return fail("ts_backward");
        if (ts_optim_step(opt) != TS_OK) return fail("ts_optim_step");
        ts_tensor_free(out);
        ts_tensor_free(loss);
    }
    printf("outside: loss %.4f -> %.4f\n", first, last);
    ts_optim_free(opt);
    ts_tensor_free(x);
    ts_tensor_free(y);
    ts_module_free(lin);
    return last < first ? 0 : 1;
}
