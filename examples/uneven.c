/* Uneven shards (seed 001): a Linear(3, 3) has 9 parameters, 3 rows, which
 * do not divide over 4 ranks. Each rank holds torch.chunk's rows (1, 1, 1
 * and none), and the communication buffers are padded to ceil(3 / 4) = 1
 * row per rank: 4 x 3 = 12 numbers, 3 of them padding. A forward and
 * backward then run on every rank, the one with the empty shard included.
 * Run with four ranks:
 *
 *     build/tools/tsrun --nproc-per-node 4 build/examples/uneven */
#include "common.h"

int main(int argc, char **argv)
{
    /* no flags: --help prints this, anything else is refused (exit 2) */
    ex_parse_flags(argc, argv,
                   "Seed 001: Linear(3, 3) sharded over 4 ranks: shard shapes, communicated size and padding. Run "
                   "under tsrun --nproc-per-node 4.",
                   NULL, 0);
    CHECK(ts_launch_rank_guard());
    CHECK(ts_dist_init(NULL));
    int rank = ts_comm_rank(ts_dist_world()), world = ts_comm_size(ts_dist_world());

    ts_manual_seed(0);
    ts_module *odd;
    CHECK(ts_linear_new(3, 3, false, &odd));
    CHECK(ts_fully_shard(odd, NULL));
    ts_nn_linear *lin = (ts_nn_linear *)odd;
    ts_fsdp_group_info info;
    CHECK(ts_fsdp_group_info_get(odd, &info));
    char shape[64];
    printf("rank %d | %lld params over world %d: shard %s\n", rank, (long long)info.numel, world,
           ts_tensor_shape_str(lin->weight, shape, sizeof shape));
    printf("rank %d | padded communication size %d x %lld = %lld, %lld of them padding\n", rank, info.shard_world,
           (long long)info.shard_numel, (long long)info.padded_numel, (long long)info.padding);

    int64_t xs[2] = {2, 3};
    ts_tensor *x, *y, *loss;
    CHECK(ts_tensor_ones(TS_F32, 2, xs, &x));
    CHECK(ts_module_call1(odd, x, &y));
    CHECK(ts_sum(y, 0, NULL, false, &loss));
    CHECK(ts_backward(loss, NULL, false));
    ts_tensor *g = ts_tensor_grad(lin->weight);
    if (!g) {
        fprintf(stderr, "error: rank %d: the weight shard has no gradient after backward\n", rank);
        exit(1);
    }
    printf("rank %d | grad shard %s after forward and backward\n", rank, ts_tensor_shape_str(g, shape, sizeof shape));
    fflush(stdout);

    ts_tensor_free(loss);
    ts_tensor_free(y);
    ts_tensor_free(x);
    ts_module_free(odd);
    CHECK(ts_dist_finalize());
    return 0;
}
