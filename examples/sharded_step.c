/* A sharded step, verified (seed 003): two ranks shard an nn.Linear(8, 8)
 * and check their shards, their gradient slices and one SGD step against
 * an unsharded reference computed in the same program with identical
 * weights and data:
 *
 *     tp.manual_seed(42); model = nn.Linear(8, 8); x = tp.randn(4, 8)
 *     model = fully_shard(model)       # {'weight': (4, 8), 'bias': (4,)}
 *     model(x).sum().backward()        # gradients: the shard shapes again
 *     SGD(model.parameters(), lr=0.1).step(); model.unshard()   # (8, 8)
 *
 * Each rank prints its shard and gradient shapes and the gathered weight's
 * shape; rank 0 prints the full weight and bias after the step to ten
 * decimals; each rank then says whether its gradient shards are the
 * reference gradient's rows and the gathered parameters the reference
 * step's, exactly (the program exits 1 when not). Run with two ranks:
 *
 *     build/tools/tsrun --nproc-per-node 2 build/examples/sharded_step */
#include "common.h"

#include <math.h>

enum { F = 8, B = 4 };

/* The n values of t (a shard, a gradient or a full tensor). */
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

/* manual_seed(42); Linear(8, 8); randn(4, 8) */
static ts_nn_linear *build(ts_tensor **x_out)
{
    ts_manual_seed(42);
    ts_module *m;
    CHECK(ts_linear_new(F, F, true, &m));
    int64_t xs[2] = {B, F};
    CHECK(ts_randn(TS_F32, 2, xs, NULL, x_out));
    return (ts_nn_linear *)m;
}

/* model(x).sum().backward() */
static void step(ts_module *m, ts_tensor *x)
{
    ts_tensor *y, *s;
    CHECK(ts_module_call1(m, x, &y));
    CHECK(ts_sum(y, 0, NULL, false, &s));
    CHECK(ts_backward(s, NULL, false));
    ts_tensor_free(s);
    ts_tensor_free(y);
}

/* SGD(params, lr=0.1).step() */
static void sgd_step(ts_tensor *const params[2])
{
    ts_sgd_options so = ts_sgd_options_default();
    so.lr = 0.1;
    ts_optim *opt;
    CHECK(ts_sgd_new(2, params, &so, &opt));
    CHECK(ts_optim_step(opt));
    ts_optim_free(opt);
}

static void print_shapes(int rank, ts_tensor *w, ts_tensor *b)
{
    char s1[32], s2[32];
    printf("%d {'weight': %s, 'bias': %s}\n", rank, ts_tensor_shape_str(w, s1, sizeof s1),
           ts_tensor_shape_str(b, s2, sizeof s2));
}

/* `name [[v, ...], ...]` with ten decimals, rows of `cols`. */
static void print_values(const char *name, const float *v, int n, int cols)
{
    printf("%s [", name);
    for (int i = 0; i < n; i++) {
        if (cols && i % cols == 0) printf("%s[", i ? ",\n    " : "");
        printf("%.10f%s", v[i], (i + 1) % (cols ? cols : n) == 0 ? (cols ? "]" : "") : ", ");
    }
    printf("]\n");
}

int main(int argc, char **argv)
{
    /* no flags: --help prints this, anything else is refused (exit 2) */
    ex_parse_flags(argc, argv,
                   "Seed 003's verified step: Linear(8, 8) sharded on 2 ranks, one SGD step, checked against the "
                   "unsharded reference. Run under tsrun --nproc-per-node 2.",
                   NULL, 0);
    CHECK(ts_launch_rank_guard());
    CHECK(ts_dist_init(NULL));
    int rank = ts_comm_rank(ts_dist_world()), world = ts_comm_size(ts_dist_world());
    if (world != 2) {
        fprintf(stderr, "sharded_step runs on 2 ranks (tsrun --nproc-per-node 2), not %d\n", world);
        ts_dist_finalize();
        return 2;
    }

    /* the unsharded reference: same weights, same data, one step */
    ts_tensor *rx;
    ts_nn_linear *ref = build(&rx);
    ts_tensor *rp[2] = {ref->weight, ref->bias};
    step(&ref->base, rx);
    float rgw[F * F], rgb[F], rw[F * F], rb[F];
    values(ts_tensor_grad(ref->weight), rgw, F * F);
    values(ts_tensor_grad(ref->bias), rgb, F);
    sgd_step(rp);
    values(ref->weight, rw, F * F);
    values(ref->bias, rb, F);

    /* the sharded model */
    ts_tensor *x;
    ts_nn_linear *lin = build(&x);
    ts_module *model = &lin->base;
    CHECK(ts_fully_shard(model, NULL));
    print_shapes(rank, lin->weight, lin->bias);
    ts_tensor *sp[2] = {lin->weight, lin->bias}; /* the shards, what the optimizer takes */
    step(model, x);
    ts_tensor *gw = ts_tensor_grad(lin->weight), *gb = ts_tensor_grad(lin->bias);
    if (!gw || !gb) {
        fprintf(stderr, "error: rank %d: a shard has no gradient after backward\n", rank);
        return 1;
    }
    print_shapes(rank, gw, gb);
    /* this rank's rows of the full-batch gradient */
    const int rows = F / 2, r0 = rank * rows;
    float sgw[F * F / 2], sgb[F / 2];
    values(gw, sgw, rows * F);
    values(gb, sgb, rows);
    bool grads_ok = memcmp(sgw, rgw + r0 * F, sizeof sgw) == 0 && memcmp(sgb, rgb + r0, sizeof sgb) == 0;
    sgd_step(sp);

    /* model.unshard(): the slots hold the full parameters until reshard */
    ts_fsdp_unshard_handle *h;
    CHECK(ts_fsdp_unshard(model, false, &h));
    char shape[32];
    printf("%d %s\n", rank, ts_tensor_shape_str(lin->weight, shape, sizeof shape));
    float w[F * F], b[F];
    values(lin->weight, w, F * F);
    values(lin->bias, b, F);
    CHECK(ts_fsdp_reshard(model));
    fflush(stdout);
    CHECK(ts_barrier(ts_dist_world(), NULL)); /* rank 0's values after every rank's shapes */
    if (rank == 0) {
        print_values("weight after the step", w, F * F, F);
        print_values("bias after the step", b, F, 0);
    }
    fflush(stdout);
    CHECK(ts_barrier(ts_dist_world(), NULL));
    double maxdiff = 0;
    for (int i = 0; i < F * F; i++) maxdiff = fmax(maxdiff, fabs((double)w[i] - rw[i]));
    for (int i = 0; i < F; i++) maxdiff = fmax(maxdiff, fabs((double)b[i] - rb[i]));
    bool params_ok = memcmp(w, rw, sizeof w) == 0 && memcmp(b, rb, sizeof b) == 0;
    printf("rank %d: gradient shards %s the reference gradient's rows %d-%d; weight and bias after the step %s the "
           "unsharded reference (max |diff| %g)\n",
           rank, grads_ok ? "equal" : "DIFFER FROM", r0, r0 + rows - 1, params_ok ? "equal" : "DIFFER FROM", maxdiff);
    fflush(stdout);

    ts_tensor_free(x);
    ts_tensor_free(rx);
    ts_module_free(model);
    ts_module_free(&ref->base);
    CHECK(ts_dist_finalize());
    return grads_ok && params_ok ? 0 : 1;
}
