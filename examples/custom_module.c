/* Writing your own module, and sharding it (docs/custom-modules.md; the
 * same program in PyTorch FSDP2: tools/reference/custom_module_fsdp2.py).
 *
 * A user-defined block type, ResidualBlock: y = x + gain * tanh(fc(x)),
 * with a child (fc, a Linear), a parameter (gain, one per feature) and a
 * buffer (num_batches_tracked, counted in training mode as BatchNorm
 * does: saved in state dicts, never trained, never sharded), built into
 *
 *     Sequential(Linear(4, 16), ResidualBlock(16), ResidualBlock(16), Linear(16, 1))
 *
 * sharded bottom-up (each block a group of its own, then the root takes
 * the two Linears) and trained with AdamW on a small regression, each
 * rank on its own rows of a fixed batch. Alone, or on several ranks (the
 * same losses up to rounding: the gradients are averaged over the ranks):
 *
 *     build/examples/custom_module
 *     build/tools/tsrun --nproc-per-node 2 build/examples/custom_module
 *
 * With --skip-gain-rank R, rank R's blocks skip gain (y = x + tanh(fc(x))):
 * every rank's shard of gain still trains (docs/fully_shard.md, "Unused
 * parameters"), and each rank prints how many of its rows of 1.gain moved.
 *
 * The block declares its parameter, buffer and child once, in its
 * constructor: the base derives their names, printing, sharding and
 * freeing. Its forward keeps its temporaries in a scope: TS_SCOPED per
 * op, the first error releases them all and returns, ts_scope_return
 * hands the result over. */
#include "common.h"

/* ------------------------------------------------------------ the block type */

typedef struct residual_block {
    ts_module base;                 /* first member: the vtable pointer lives here */
    ts_module *fc;                  /* child "fc": Linear(dim, dim) */
    ts_tensor *gain;                /* parameter "gain": (dim,) */
    ts_tensor *num_batches_tracked; /* buffer: int64, 0-d */
    int64_t dim;
    bool skip_gain; /* y = x + tanh(fc(x)): gain unused (--skip-gain-rank) */
} residual_block;

static ts_status block_forward(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    (void)n_in; /* 1: the vtable's n_inputs, checked by ts_module_call */
    residual_block *b = (residual_block *)m;
    ts_scope s = ts_scope_begin();
    ts_tensor *x = in[0], *h, *y;
    TS_SCOPED(s, h, ts_module_call1(b->fc, x, &h)); /* children through ts_module_call: their hooks run */
    TS_SCOPED(s, h, ts_tanh(h, &h));
    if (!b->skip_gain) /* the slot read at each call: it holds the gathered gain */
        TS_SCOPED(s, h, ts_mul(h, b->gain, &h));
    TS_SCOPED(s, y, ts_add(x, h, &y));
    if (m->training) ((int64_t *)ts_tensor_data(b->num_batches_tracked))[0] += 1;
    return ts_scope_return(s, 1, &y, n_out, out);
}

/* PyTorch's reset_parameters: the block's own slots (fc resets itself),
 * through fills that deferred init records and replays. */
static ts_status block_reset(ts_module *m)
{
    residual_block *b = (residual_block *)m;
    TS_TRY(ts_tensor_fill_(b->gain, 0.5));
    return ts_tensor_fill_(b->num_batches_tracked, 0.0);
}

static int block_extra_repr(const ts_module *m, char *buf, size_t cap)
{
    return snprintf(buf, cap, "dim=%lld", (long long)((const residual_block *)m)->dim);
}

static const ts_module_vtable block_vt = {.type_name = "ResidualBlock",
                                          .forward = block_forward,
                                          .n_inputs = 1,
                                          .extra_repr = block_extra_repr,
                                          .reset_parameters = block_reset};

static ts_status residual_block_new(int64_t dim, bool skip_gain, ts_module **out)
{
    ts_module *m;
    TS_TRY(ts_module_new(sizeof(residual_block), &block_vt, &m));
    residual_block *b = (residual_block *)m;
    b->dim = dim, b->skip_gain = skip_gain;
    /* each slot declared once, then made; an error frees what was declared */
    TS_MODULE_TRY(m, ts_module_register_child(m, "fc", &b->fc));
    TS_MODULE_TRY(m, ts_linear_new(dim, dim, true, &b->fc));
    TS_MODULE_TRY(m, ts_module_param_new(m, "gain", TS_F32, 1, &dim, &b->gain));
    TS_MODULE_TRY(m, ts_module_buffer_new(m, "num_batches_tracked", TS_I64, 0, NULL, &b->num_batches_tracked));
    TS_MODULE_TRY(m, block_reset(m));
    *out = m;
    return TS_OK;
}

/* ------------------------------------------------------------ the program */

enum { IN = 4, HID = 16, BATCH = 16, STEPS = 20 };

static double xval(int64_t r, int j) { return sin(0.37 * (double)(r * IN + j) + 0.1); }

/* One step; rank 0 prints the mean loss over the whole batch. */
static ts_status train_step(ts_module *model, ts_optim *opt, ts_tensor *x, ts_tensor *y, int rank, int step)
{
    ts_scope s = ts_scope_begin();
    ts_tensor *pred, *loss, *avg;
    double v = 0;
    TS_SCOPED(s, pred, ts_module_call1(model, x, &pred));
    TS_SCOPED(s, loss, ts_mse_loss(pred, y, TS_REDUCTION_MEAN, &loss));
    TS_SCOPE_TRY(s, ts_backward(loss, NULL, false));
    TS_SCOPE_TRY(s, ts_optim_step(opt));
    ts_optim_zero_grad(opt, true);
    TS_SCOPED(s, avg, ts_detach(loss, &avg)); /* the ranks' means, averaged */
    TS_SCOPE_TRY(s, ts_all_reduce(ts_dist_world(), avg, TS_REDUCE_AVG, NULL));
    TS_SCOPE_TRY(s, ts_tensor_item(avg, &v));
    if (rank == 0) printf("step %2d loss %.8f\n", step, v);
    return ts_scope_end(s);
}

/* Trains on this rank's rows of a fixed batch, then prints what it holds. */
static ts_status train(ts_module *model, ts_optim *opt, int rank, int world, int skip_gain_rank)
{
    int64_t rows = BATCH / world, row0 = rank * rows;
    float xs[BATCH * IN], ys[BATCH];
    for (int64_t r = 0; r < rows; r++) {
        for (int j = 0; j < IN; j++) xs[r * IN + j] = (float)xval(row0 + r, j);
        double x0 = xval(row0 + r, 0), x1 = xval(row0 + r, 1), x2 = xval(row0 + r, 2), x3 = xval(row0 + r, 3);
        ys[r] = (float)(sin(2.0 * x0) + 0.5 * x1 * x2 - 0.3 * x3 * x3);
    }
    ts_scope s = ts_scope_begin();
    ts_tensor *x, *y, *nbt, *gain; /* nbt and gain borrowed from their slots */
    TS_SCOPED(s, x, ts_tensor_from_data(TS_F32, 2, (int64_t[]){rows, IN}, xs, &x));
    TS_SCOPED(s, y, ts_tensor_from_data(TS_F32, 2, (int64_t[]){rows, 1}, ys, &y));
    for (int step = 0; step < STEPS; step++) TS_SCOPE_TRY(s, train_step(model, opt, x, y, rank, step));
    /* the buffer counted every training forward, on every rank (not
     * sharded: each rank has its own whole copy) */
    double count = 0;
    TS_SCOPE_TRY(s, ts_module_get_buffer(model, "2.num_batches_tracked", &nbt));
    TS_SCOPE_TRY(s, ts_tensor_item(nbt, &count));
    printf("rank %d: 2.num_batches_tracked = %.0f\n", rank, count);
    if (skip_gain_rank >= 0) { /* this rank's rows of 1.gain (its shard: plain floats) */
        TS_SCOPE_TRY(s, ts_module_get_parameter(model, "1.gain", &gain));
        const float *gv = ts_tensor_data(gain);
        int64_t n = ts_tensor_numel(gain), moved = 0;
        for (int64_t i = 0; i < n; i++) moved += gv[i] != 0.5f;
        printf("rank %d: 1.gain rows trained %lld of %lld%s\n", rank, (long long)moved, (long long)n,
               rank == skip_gain_rank ? " (this rank skips gain)" : "");
    }
    return ts_scope_end(s);
}

/* Shards the model bottom-up (each ResidualBlock a group of its own, then
 * the root takes the two Linears), prints it, makes AdamW, trains. */
static ts_status shard_and_train(ts_module *model, int rank, int world, int skip_gain_rank)
{
    TS_TRY(ts_fsdp_apply_by_type(model, "ResidualBlock", NULL, NULL));
    TS_TRY(ts_fully_shard(model, NULL));
    if (rank == 0) {
        TS_TRY(ts_module_print(model, stdout));
        TS_TRY(ts_fsdp_summary(model, stdout));
    }
    ts_tensor *gain; /* borrowed from its slot */
    char shape[64];
    TS_TRY(ts_module_get_parameter(model, "1.gain", &gain));
    printf("rank %d: 1.gain holds %s of (%d,)\n", rank, ts_tensor_shape_str(gain, shape, sizeof shape), HID);
    /* the optimizer, after sharding (the list holds references; the
     * optimizer takes its own) */
    ts_param_list params;
    ts_optim *opt = NULL;
    ts_adam_options ao = ts_adamw_options_default();
    ao.lr = 1e-2;
    TS_TRY(ts_module_parameters(model, &params));
    ts_status st = ts_adamw_new(params.n, params.items, &ao, &opt);
    ts_param_list_free(&params);
    if (!st) st = train(model, opt, rank, world, skip_gain_rank);
    ts_optim_free(opt);
    return st;
}

static ts_status run(int rank, int world, int skip_gain_rank)
{
    TS_CHECK(BATCH % world == 0, TS_ERR_INVALID_ARGUMENT, "the batch of %d rows does not split over %d ranks", BATCH,
             world);
    ts_manual_seed(0); /* every rank builds the same model */
    ts_module *k[4] = {NULL, NULL, NULL, NULL}, *model = NULL;
    ts_status st = ts_linear_new(IN, HID, true, &k[0]);
    if (!st) st = residual_block_new(HID, rank == skip_gain_rank, &k[1]);
    if (!st) st = residual_block_new(HID, rank == skip_gain_rank, &k[2]);
    if (!st) st = ts_linear_new(HID, 1, true, &k[3]);
    if (!st) st = ts_sequential_new(4, k, &model); /* owns them from here */
    if (!st) st = shard_and_train(model, rank, world, skip_gain_rank);
    else
        for (int i = 0; i < 4; i++) ts_module_free(k[i]);
    ts_module_free(model);
    fflush(stdout);
    return st;
}

int main(int argc, char **argv)
{
    /* --help prints the flags, anything else is refused (exit 2) */
    int skip_gain_rank = -1;
    ex_flag flags[] = {
        {"--skip-gain-rank", "R", EX_FLAG_INT, &skip_gain_rank, -1, 1 << 20, false,
         "this rank's blocks do not use gain (its backward gives it no gradient; -1: none)", false},
    };
    ex_parse_flags(argc, argv,
                   "A user-defined module type (a residual block with a child, a parameter and a buffer), printed, "
                   "summarised, sharded bottom-up and trained with AdamW. Alone, or under tsrun.",
                   flags, 1);
    CHECK(ts_launch_rank_guard());
    CHECK(ts_dist_init(NULL)); /* the world from tsrun (or mpirun, srun); one rank alone */
    int rank = ts_comm_rank(ts_dist_world()), world = ts_comm_size(ts_dist_world());
    ts_status st = run(rank, world, skip_gain_rank);
    if (st) fprintf(stderr, "rank %d: error: %s: %s\n", rank, ts_status_name(st), ts_last_error());
    fflush(stdout);
    ts_status fst = ts_dist_finalize();
    return st || fst ? 1 : 0;
}
