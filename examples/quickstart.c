/* Quickstart: a small MLP sharded with fully_shard, trained with AdamW on two ranks. */
#include "tensorshard.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(x) do { if ((x) != TS_OK) { fprintf(stderr, "%s: %s\n", #x, ts_last_error()); exit(1); } } while (0)

int main(int argc, char **argv)
{
    if (argc > 1) { printf("usage: tsrun --nproc-per-node 2 %s\n", argv[0]); return strcmp(argv[1], "--help") ? 2 : 0; }
    CHECK(ts_dist_init(NULL));                    /* rank and world from tsrun (alone: one rank) */
    int rank = ts_comm_rank(ts_dist_world());
    ts_manual_seed(0);                            /* the same initial weights on every rank */
    ts_module *layer[3], *model;
    CHECK(ts_linear_new(16, 64, true, &layer[0]));
    CHECK(ts_relu_new(&layer[1]));
    CHECK(ts_linear_new(64, 1, true, &layer[2]));
    CHECK(ts_sequential_new(3, layer, &model));   /* the Sequential owns the layers */
    for (int i = 0; i < 3; i += 2)
        CHECK(ts_fully_shard(layer[i], NULL));    /* bottom-up: each Linear its own group, */
    CHECK(ts_fully_shard(model, NULL));           /* then the root */
    ts_param_list p;                              /* this rank's shards: build the optimizer now */
    CHECK(ts_module_parameters(model, &p));
    ts_adam_options o = ts_adamw_options_default();
    o.lr = 0.01;
    ts_optim *opt;
    CHECK(ts_adamw_new(p.n, p.items, &o, &opt));
    ts_param_list_free(&p);
    ts_tensor *w, *x, *y, *pred, *loss;
    char shape[32];
    CHECK(ts_module_get_parameter(model, "0.weight", &w));   /* borrowed */
    printf("rank %d holds 0.weight as %s of (64, 16)\n", rank, ts_tensor_shape_str(w, shape, sizeof shape));
    ts_manual_seed(1 + (uint64_t)rank);           /* each rank its own batch, y = sum of x */
    CHECK(ts_randn(TS_F32, 2, (int64_t[]){32, 16}, NULL, &x));
    CHECK(ts_sum(x, 1, (int[]){1}, true, &y));
    for (int step = 1; step <= 5; step++) {
        double v;
        CHECK(ts_module_call1(model, x, &pred));  /* all-gathers each group as it runs */
        CHECK(ts_mse_loss(pred, y, TS_REDUCTION_MEAN, &loss));
        CHECK(ts_backward(loss, NULL, false));    /* reduce-scatters the gradients (averaged) */
        CHECK(ts_optim_step(opt));                /* steps on the shards */
        ts_optim_zero_grad(opt, true);
        CHECK(ts_tensor_item(loss, &v));
        printf("rank %d step %d loss %.4f\n", rank, step, v);
        ts_tensor_free(pred);
        ts_tensor_free(loss);
    }
    ts_tensor_free(x);
    ts_tensor_free(y);
    ts_optim_free(opt);
    ts_module_free(model);
    return ts_dist_finalize() == TS_OK ? 0 : 1;
}
