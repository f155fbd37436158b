/* Counting the collectives of one step (seed 001): three blocks
 * Sequential(Linear(6, 6), ReLU, Linear(6, 6)) under a root Sequential,
 * each block sharded as its own group, then the root. The world's
 * collective counters are read after the forward and after the backward:
 * with reshard_after_forward=True the forward gathers each block once and
 * the backward gathers it again and reduce-scatters its gradients; with
 * False the backward needs no all-gather. Run with two ranks:
 *
 *     build/tools/tsrun --nproc-per-node 2 build/examples/collective_counts */
#include "common.h"

enum { BLOCKS = 3 };

/* PyTorch's names for the collectives counted here, by ts_coll_kind. */
static const char *coll_name(ts_coll_kind k)
{
    switch (k) {
    case TS_COLL_ALL_GATHER: return "all_gather_into_tensor";
    case TS_COLL_REDUCE_SCATTER: return "reduce_scatter_tensor";
    case TS_COLL_ALL_REDUCE: return "all_reduce";
    default: return NULL;
    }
}

/* `label{"name": n, ...}` with the non-zero counts of the world. */
static void print_counts(const char *label)
{
    ts_comm_counters c;
    ts_comm_stats(ts_dist_world(), &c);
    printf("%s{", label);
    bool first = true;
    for (int k = 0; k < TS_COLL_KIND_COUNT; k++) {
        if (c.calls[k] == 0) continue;
        const char *name = coll_name((ts_coll_kind)k);
        printf("%s\"%s\": %llu", first ? "" : ", ", name ? name : "other", (unsigned long long)c.calls[k]);
        first = false;
    }
    printf("}\n");
}

static ts_status count_fsdp(void *ctx, const char *fqn, ts_module *m)
{
    (void)fqn;
    if (ts_module_is_fsdp(m)) (*(int *)ctx)++;
    return TS_OK;
}

static void run(ts_reshard_policy policy, const char *label)
{
    printf("reshard_after_forward=%s\n", label);
    ts_manual_seed(0);
    ts_module *blocks[BLOCKS], *model;
    for (int b = 0; b < BLOCKS; b++) {
        ts_module *k[3];
        CHECK(ts_linear_new(6, 6, false, &k[0]));
        CHECK(ts_relu_new(&k[1]));
        CHECK(ts_linear_new(6, 6, false, &k[2]));
        CHECK(ts_sequential_new(3, k, &blocks[b]));
    }
    CHECK(ts_sequential_new(BLOCKS, blocks, &model));
    ts_fsdp_options o = ts_fsdp_options_default();
    o.reshard_after_forward = policy;
    CHECK(ts_fully_shard_each(BLOCKS, blocks, &o));
    CHECK(ts_fully_shard(model, &o));

    int64_t xs[2] = {2, 6};
    ts_tensor *x, *out, *loss;
    CHECK(ts_tensor_ones(TS_F32, 2, xs, &x));
    ts_comm_stats_reset(ts_dist_world());
    CHECK(ts_module_call1(model, x, &out));
    print_counts("after forward : ");
    CHECK(ts_sum(out, 0, NULL, false, &loss));
    CHECK(ts_backward(loss, NULL, false));
    print_counts("after backward: ");
    int units = 0;
    CHECK(ts_module_named_modules(model, count_fsdp, &units));
    printf("fsdp units    : %d\n", units);
    fflush(stdout);

    ts_tensor_free(loss);
    ts_tensor_free(out);
    ts_tensor_free(x);
    ts_module_free(model);
}

int main(int argc, char **argv)
{
    /* no flags: --help prints this, anything else is refused (exit 2) */
    ex_parse_flags(argc, argv,
                   "Seed 001: the all-gathers and reduce-scatters of one step of three sharded blocks, with "
                   "reshard_after_forward true and false. Run under tsrun --nproc-per-node 2.",
                   NULL, 0);
    CHECK(ts_launch_rank_guard());
    CHECK(ts_dist_init(NULL));
    run(TS_RESHARD_TRUE, "True");
    run(TS_RESHARD_FALSE, "False");
    CHECK(ts_dist_finalize());
    return 0;
}
