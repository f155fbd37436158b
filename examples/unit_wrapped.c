/* The unit you wrapped (seed 000), on per-parameter sharding: a
 * Sequential(Linear(4, 4), ReLU, Linear(4, 4)) with each Linear sharded
 * as its own group, then the root. Prints this rank's shard of layer 0
 * (rows 2r and 2r+1 of the weight, next to the original rows on rank 0),
 * the shape the weight has again while summoned, and the gradient shard
 * after one forward and backward. Run with two ranks:
 *
 *     build/tools/tsrun --nproc-per-node 2 build/examples/unit_wrapped
 *
 * The numbers equal the seed's PyTorch printout (the RNG is bit-exact
 * with torch.manual_seed(0) and nn.Linear's initialization). */
#include "common.h"

#include <math.h>

/* One value as the seed prints a Python float: "0.0" for zero, else ten
 * decimals. */
static void put_value(double v)
{
    if (v == 0.0) printf("%s", signbit(v) ? "-0.0" : "0.0");
    else printf("%.10f", v);
}

/* Values a[from..to) separated by ", ". */
static void put_values(const float *a, int from, int to)
{
    for (int i = from; i < to; i++) {
        if (i > from) printf(", ");
        put_value(a[i]);
    }
}

/* Copies the local data of a (possibly shard-marked) tensor: n floats. */
static void local_values(ts_tensor *t, float *buf, int64_t n)
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
                   "Seed 000: Sequential(Linear(4, 4), ReLU, Linear(4, 4)), each Linear sharded; prints each rank's "
                   "shard of layer 0, the summoned shape and the gradient shards. Run under tsrun --nproc-per-node 2.",
                   NULL, 0);
    CHECK(ts_launch_rank_guard());
    CHECK(ts_dist_init(NULL));
    int rank = ts_comm_rank(ts_dist_world()), world = ts_comm_size(ts_dist_world());
    if (world != 2) {
        fprintf(stderr, "unit_wrapped runs on 2 ranks (tsrun --nproc-per-node 2), not %d\n", world);
        ts_dist_finalize();
        return 2;
    }

    /* torch.manual_seed(0); nn.Sequential(nn.Linear(4, 4, bias=False),
     * nn.ReLU(), nn.Linear(4, 4, bias=False)): built in that order. */
    ts_manual_seed(0);
    ts_module *k[3], *model;
    CHECK(ts_linear_new(4, 4, false, &k[0]));
    CHECK(ts_relu_new(&k[1]));
    CHECK(ts_linear_new(4, 4, false, &k[2]));
    CHECK(ts_sequential_new(3, k, &model));
    ts_nn_linear *layer0 = (ts_nn_linear *)k[0];
    float ref[16];
    CHECK(ts_tensor_copy_to(layer0->weight, ref, sizeof ref));

    /* One group per Linear, then the root (which owns no parameters). */
    ts_module *linears[2] = {k[0], k[2]};
    CHECK(ts_fully_shard_each(2, linears, NULL));
    CHECK(ts_fully_shard(model, NULL));

    /* The slot now holds this rank's (2, 4) rows. */
    float shard[8];
    local_values(layer0->weight, shard, 8);
    char head[64];
    int w = snprintf(head, sizeof head, "rank %d: shard of layer0 ", rank);
    printf("%s[", head);
    put_values(shard, 0, 4);
    printf(",\n%*s", w, "");
    put_values(shard, 4, 8);
    printf("]\n");
    if (rank == 0) {
        const char *lead = "layer0 full, row 0 and 1: ";
        printf("%s[", lead);
        put_values(ref, 0, 4);
        printf("]\n%*s[", (int)strlen(lead), "");
        put_values(ref, 4, 8);
        printf("]\n");
    }
    fflush(stdout);

    /* summon_full_params: the slot holds the full (4, 4) weight again. */
    ts_fsdp_summon *s;
    CHECK(ts_fsdp_summon_full_params(model, false, &s));
    char shape[64];
    printf("rank %d: summoned layer0 shape %s\n", rank, ts_tensor_shape_str(layer0->weight, shape, sizeof shape));
    fflush(stdout);
    CHECK(ts_fsdp_summon_end(s));

    /* f(torch.full((2, 4), 1.0)).sum().backward() */
    int64_t xs[2] = {2, 4};
    ts_tensor *x, *y, *loss;
    CHECK(ts_tensor_full(TS_F32, 2, xs, 1.0, &x));
    CHECK(ts_module_call1(model, x, &y));
    CHECK(ts_sum(y, 0, NULL, false, &loss));
    CHECK(ts_backward(loss, NULL, false));
    ts_tensor *g = ts_tensor_grad(layer0->weight);
    if (!g) {
        fprintf(stderr, "error: layer0's weight shard has no gradient after backward\n");
        exit(1);
    }
    float grad[8];
    local_values(g, grad, 8);
    printf("rank %d: grad shard of layer0 [", rank);
    put_values(grad, 0, 8);
    printf("]\n");
    fflush(stdout);

    ts_tensor_free(loss);
    ts_tensor_free(y);
    ts_tensor_free(x);
    ts_module_free(model);
    CHECK(ts_dist_finalize());
    return 0;
}
