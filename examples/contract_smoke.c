/* The user contract of fully_shard in one process (seed 003): without
 * ts_dist_init, fully_shard falls back to a one-rank CPU mesh, so sharding
 * is a no-op (each shard is the whole parameter) and the API can be tried
 * without a launcher:
 *
 *     model = fully_shard(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)))
 *     print(type(model).__name__)      # SequentialFSDPModule
 *     opt = SGD(model.parameters(), lr=0.1)    # the shards, right after fully_shard
 *     out = model(randn(2, 4)); print(tuple(out.shape))   # (2, 4)
 *     out.sum().backward(); opt.step()
 *     fully_shard(model)               # fully_shard has already been applied
 *
 * The program checks what it does not print: the step moved every
 * parameter by -0.1 times its gradient, and the second fully_shard failed
 * with TS_ERR_ALREADY. Run it directly: build/examples/contract_smoke */
#include "common.h"

#include <math.h>

enum { MAXP = 8, MAXN = 64 };

/* The n values of a parameter (or a gradient), through a local view. */
static void values(ts_tensor *t, float *buf, int64_t n)
{
    ts_tensor *v;
    CHECK(ts_tensor_local_view(t, &v));
    if (ts_tensor_numel(v) != n) {
        fprintf(stderr, "error: expected %lld values, the tensor has %lld\n", (long long)n,
                (long long)ts_tensor_numel(v));
        exit(1);
    }
    CHECK(ts_tensor_copy_to(v, buf, (size_t)n * sizeof *buf));
    ts_tensor_free(v);
}

int main(int argc, char **argv)
{
    /* no flags: --help prints this, anything else is refused (exit 2) */
    ex_parse_flags(argc, argv,
                   "Seed 003's one-rank contract, in one process without a launcher: SequentialFSDPModule, output "
                   "shape, an SGD step, the already-applied error.",
                   NULL, 0);
    ts_manual_seed(0);
    ts_module *k[3], *model;
    CHECK(ts_linear_new(4, 8, true, &k[0]));
    CHECK(ts_relu_new(&k[1]));
    CHECK(ts_linear_new(8, 4, true, &k[2]));
    CHECK(ts_sequential_new(3, k, &model));
    CHECK(ts_fully_shard(model, NULL)); /* model is the same object, now a SequentialFSDPModule */
    printf("%s\n", ts_module_type_name(model));

    /* opt = SGD(model.parameters(), lr=0.1), built from the sharded
     * parameters right after fully_shard: after the forward, the root's
     * slots hold its gathered parameters until its backward (the root is
     * not resharded after forward), and an optimizer built then would step
     * on those. */
    ts_named_params np;
    CHECK(ts_module_named_parameters(model, &np));
    if (np.n != 4) {
        fprintf(stderr, "error: expected 4 parameters, got %d\n", np.n);
        return 1;
    }
    ts_tensor *params[MAXP];
    for (int i = 0; i < np.n; i++) params[i] = *np.items[i].slot;
    ts_sgd_options so = ts_sgd_options_default();
    so.lr = 0.1;
    ts_optim *opt;
    CHECK(ts_sgd_new(np.n, params, &so, &opt));

    int64_t xs[2] = {2, 4};
    ts_tensor *x, *out, *loss;
    CHECK(ts_randn(TS_F32, 2, xs, NULL, &x));
    CHECK(ts_module_call1(model, x, &out)); /* hooks all-gather for the forward */
    char shape[64];
    printf("%s\n", ts_tensor_shape_str(out, shape, sizeof shape));

    CHECK(ts_sum(out, 0, NULL, false, &loss));
    CHECK(ts_backward(loss, NULL, false));

    static float before[MAXP][MAXN], grad[MAXP][MAXN], after[MAXP][MAXN];
    for (int i = 0; i < np.n; i++) {
        int64_t n = ts_tensor_numel(params[i]);
        ts_tensor *g = ts_tensor_grad(params[i]);
        if (n > MAXN || !g) {
            fprintf(stderr, "error: parameter %s: %lld elements, %s gradient\n", np.items[i].name, (long long)n,
                    g ? "a" : "no");
            return 1;
        }
        values(params[i], before[i], n);
        values(g, grad[i], n);
    }
    CHECK(ts_optim_step(opt));
    for (int i = 0; i < np.n; i++) {
        int64_t n = ts_tensor_numel(params[i]);
        values(params[i], after[i], n);
        for (int64_t j = 0; j < n; j++) {
            float want = before[i][j] - 0.1f * grad[i][j];
            /* float rounding of one multiply-add */
            if (fabsf(after[i][j] - want) > 1e-6f * (1.0f + fabsf(want))) {
                fprintf(stderr, "error: %s[%lld] is %.9g after the step, expected %.9g\n", np.items[i].name,
                        (long long)j, after[i][j], want);
                return 1;
            }
        }
    }

    ts_status st = ts_fully_shard(model, NULL);
    if (st != TS_ERR_ALREADY) {
        fprintf(stderr, "error: a second fully_shard returned %s, not TS_ERR_ALREADY\n", ts_status_name(st));
        return 1;
    }
    printf("%s\n", ts_last_error());

    ts_optim_free(opt);
    ts_named_params_free(&np);
    ts_tensor_free(loss);
    ts_tensor_free(out);
    ts_tensor_free(x);
    ts_module_free(model);
    return 0;
}
