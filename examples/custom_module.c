/* Writing your own module, and sharding it.
 *
 * A user-defined block type, ResidualBlock: y = x + gain * tanh(fc(x)),
 * with a child module (fc, a Linear), a parameter of its own (gain, one
 * per feature) and a buffer (num_batches_tracked, counted in training
 * mode as BatchNorm does: saved in state dicts, never trained, never
 * sharded). It is built into a model
 *
 *     Sequential(Linear(4, 16), ResidualBlock(16), ResidualBlock(16), Linear(16, 1))
 *
 * which is sharded bottom-up (each ResidualBlock its own group, then the
 * root takes the two Linears), and trained with AdamW on a small
 * regression, each rank on its own rows of a fixed batch. It runs alone:
 *
 *     build/examples/custom_module
 *
 * or on several ranks (the losses are the same, up to rounding: the
 * gradients are averaged over the ranks):
 *
 *     build/tools/tsrun --nproc-per-node 2 build/examples/custom_module
 *
 * With --skip-gain-rank R, rank R's blocks skip their gain (y = x +
 * tanh(fc(x))): its backward gives gain no gradient, while the other
 * ranks' do. Every rank's shard of gain still trains (the other ranks'
 * gradients averaged with zeros for rank R: docs/fully_shard.md, "Unused
 * parameters"); each rank then prints how many of its rows of 1.gain
 * moved from their initial 0.5:
 *
 *     build/tools/tsrun --nproc-per-node 2 build/examples/custom_module --skip-gain-rank 1
 *
 * The ownership rules it follows (nn/nn.h, base/base.h):
 *   - every tensor a function will own starts as NULL, so that one cleanup
 *     label can free all of them on every path (ts_tensor_free(NULL) and
 *     ts_module_free(NULL) do nothing);
 *   - TS_TRY_GOTO jumps to that label on the first error, TS_CHECK
 *     returns an error with a message naming the values;
 *   - a forward writes out[] and *n_out only on success, and hands over
 *     its result by clearing its own pointer (out[0] = y; y = NULL);
 *   - children are called through ts_module_call1 (so that a sharded
 *     child's hooks run), and parameters are read from their slots at
 *     each call (fully_shard swaps what the slots hold).
 */
#include "common.h"

#include <math.h>

/* ------------------------------------------------------------ the block type */

typedef struct residual_block {
    ts_module base;                 /* first member: the vtable pointer lives here */
    ts_module *fc;                  /* child "fc": Linear(dim, dim) */
    ts_tensor *gain;                /* parameter "gain": (dim,) */
    ts_tensor *num_batches_tracked; /* buffer: int64, 0-d */
    int64_t dim;
    bool skip_gain;                 /* y = x + tanh(fc(x)): gain unused (--skip-gain-rank) */
} residual_block;

static ts_status block_forward(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    residual_block *b = (residual_block *)m;
    TS_CHECK(n_in == 1 && in[0], TS_ERR_INVALID_ARGUMENT, "ResidualBlock: forward takes 1 input, got %d", n_in);
    TS_CHECK(ts_tensor_ndim(in[0]) >= 1 && ts_tensor_size(in[0], -1) == b->dim, TS_ERR_SHAPE,
             "ResidualBlock(%lld): the input's last size is %lld", (long long)b->dim,
             (long long)(ts_tensor_ndim(in[0]) ? ts_tensor_size(in[0], -1) : 0));
    ts_status st;
    ts_tensor *h = NULL, *a = NULL, *g = NULL, *y = NULL; /* everything this call owns, NULL until made */
    TS_TRY_GOTO(st, ts_module_call1(b->fc, in[0], &h), done);
    TS_TRY_GOTO(st, ts_tanh(h, &a), done);
    if (b->skip_gain)
        g = ts_tensor_retain(a); /* this rank's backward gives gain no gradient */
    else
        TS_TRY_GOTO(st, ts_mul(a, b->gain, &g), done); /* read the slot now: it holds the gathered gain */
    TS_TRY_GOTO(st, ts_add(in[0], g, &y), done);
    if (m->training)
        ((int64_t *)ts_tensor_data(b->num_batches_tracked))[0] += 1;
    out[0] = y; /* the caller owns it now */
    y = NULL;
    *n_out = 1;
done:
    ts_tensor_free(h);
    ts_tensor_free(a);
    ts_tensor_free(g);
    ts_tensor_free(y);
    return st;
}

/* The slots in a fixed order: parameters, buffers, children. Their names
 * make the FQNs: "1.gain", "1.num_batches_tracked", "1.fc.weight". */
static ts_status block_visit(ts_module *m, const ts_module_visitor *v)
{
    residual_block *b = (residual_block *)m;
    if (v->param)
        TS_TRY(v->param(v->ctx, "gain", &b->gain));
    if (v->buffer)
        TS_TRY(v->buffer(v->ctx, "num_batches_tracked", &b->num_batches_tracked));
    if (v->child)
        TS_TRY(v->child(v->ctx, "fc", b->fc));
    return TS_OK;
}

/* Frees what the block owns: its tensors, its child, itself. */
static void block_free(ts_module *m)
{
    residual_block *b = (residual_block *)m;
    ts_module_free(b->fc);
    ts_tensor_free(b->gain);
    ts_tensor_free(b->num_batches_tracked);
    free(b);
}

static int block_extra_repr(const ts_module *m, char *buf, size_t cap)
{
    return snprintf(buf, cap, "dim=%lld", (long long)((const residual_block *)m)->dim);
}

/* PyTorch's reset_parameters: the block's OWN parameter and buffer (fc
 * resets itself), through the fills deferred init can record and replay
 * (docs/deferred-init.md). The constructor calls it too. */
static ts_status block_reset(ts_module *m)
{
    residual_block *b = (residual_block *)m;
    TS_TRY(ts_tensor_fill_(b->gain, 0.5));
    return ts_tensor_fill_(b->num_batches_tracked, 0.0);
}

static const ts_module_vtable residual_block_vt = {
    .type_name = "ResidualBlock",
    .forward = block_forward,
    .visit = block_visit,
    .free = block_free,
    .extra_repr = block_extra_repr,
    .reset_parameters = block_reset,
};

static ts_status residual_block_new(int64_t dim, ts_module **out)
{
    TS_CHECK(dim > 0 && out, TS_ERR_INVALID_ARGUMENT, "ResidualBlock: dim must be > 0 (got %lld)", (long long)dim);
    residual_block *b = calloc(1, sizeof *b);
    TS_CHECK(b, TS_ERR_NO_MEMORY, "ResidualBlock: out of memory");
    ts_status st;
    TS_TRY_GOTO(st, ts_module_init(&b->base, &residual_block_vt), fail);
    b->dim = dim;
    TS_TRY_GOTO(st, ts_linear_new(dim, dim, true, &b->fc), fail);
    TS_TRY_GOTO(st, ts_param_new(TS_F32, 1, &dim, &b->gain), fail);
    TS_TRY_GOTO(st, ts_tensor_zeros(TS_I64, 0, NULL, &b->num_batches_tracked), fail);
    TS_TRY_GOTO(st, block_reset(&b->base), fail);
    *out = &b->base;
    return TS_OK;
fail: /* the parts made so far; the struct itself */
    ts_module_free(b->fc);
    ts_tensor_free(b->gain);
    ts_tensor_free(b->num_batches_tracked);
    free(b);
    return st;
}

/* ------------------------------------------------------------ the program */

enum { IN = 4, HID = 16, BATCH = 16, STEPS = 20 };

/* Row r of the fixed batch, and its target. */
static double xval(int64_t r, int j) { return sin(0.37 * (double)(r * IN + j) + 0.1); }
static double target(int64_t r)
{
    double x0 = xval(r, 0), x1 = xval(r, 1), x2 = xval(r, 2), x3 = xval(r, 3);
    return sin(2.0 * x0) + 0.5 * x1 * x2 - 0.3 * x3 * x3;
}

/* This rank's rows [row0, row0 + rows) as x (rows, IN) and y (rows, 1). */
static ts_status make_batch(int64_t row0, int64_t rows, ts_tensor **x_out, ts_tensor **y_out)
{
    float xs[BATCH * IN], ys[BATCH];
    for (int64_t r = 0; r < rows; r++) {
        for (int j = 0; j < IN; j++)
            xs[r * IN + j] = (float)xval(row0 + r, j);
        ys[r] = (float)target(row0 + r);
    }
    int64_t xsh[2] = {rows, IN}, ysh[2] = {rows, 1};
    ts_status st;
    ts_tensor *x = NULL;
    TS_TRY(ts_tensor_from_data(TS_F32, 2, xsh, xs, &x));
    if ((st = ts_tensor_from_data(TS_F32, 2, ysh, ys, y_out))) {
        ts_tensor_free(x);
        return st;
    }
    *x_out = x;
    return TS_OK;
}

typedef struct collect_blocks {
    ts_module *m[8];
    int n;
} collect_blocks;

static ts_status find_blocks(void *ctx, const char *fqn, ts_module *m)
{
    (void)fqn;
    collect_blocks *c = ctx;
    if (strcmp(ts_module_type_name(m), "ResidualBlock") == 0) {
        TS_CHECK(c->n < 8, TS_ERR_INVALID_ARGUMENT, "more than 8 ResidualBlocks");
        c->m[c->n++] = m;
    }
    return TS_OK;
}

static ts_status run(int rank, int world, int skip_gain_rank)
{
    ts_status st;
    ts_module *model = NULL, *k[4] = {NULL, NULL, NULL, NULL};
    ts_optim *opt = NULL;
    ts_param_list params = {NULL, 0};
    ts_tensor *x = NULL, *y = NULL, *pred = NULL, *loss = NULL, *avg = NULL;

    TS_CHECK(BATCH % world == 0, TS_ERR_INVALID_ARGUMENT, "the batch of %d rows does not split over %d ranks",
             BATCH, world);
    ts_manual_seed(0); /* every rank builds the same model */
    TS_TRY_GOTO(st, ts_linear_new(IN, HID, true, &k[0]), done);
    TS_TRY_GOTO(st, residual_block_new(HID, &k[1]), done);
    TS_TRY_GOTO(st, residual_block_new(HID, &k[2]), done);
    TS_TRY_GOTO(st, ts_linear_new(HID, 1, true, &k[3]), done);
    TS_TRY_GOTO(st, ts_sequential_new(4, k, &model), done);
    for (int i = 0; i < 4; i++)
        k[i] = NULL; /* the Sequential owns them now */

    /* bottom-up: each ResidualBlock (its gain and its fc) a group of its
     * own, then the root takes what is left (the two Linears) */
    collect_blocks blocks = {.n = 0};
    TS_TRY_GOTO(st, ts_module_named_modules(model, find_blocks, &blocks), done);
    for (int i = 0; i < blocks.n; i++)
        ((residual_block *)blocks.m[i])->skip_gain = rank == skip_gain_rank;
    TS_TRY_GOTO(st, ts_fully_shard_each(blocks.n, blocks.m, NULL), done);
    TS_TRY_GOTO(st, ts_fully_shard(model, NULL), done);
    if (rank == 0) {
        TS_TRY_GOTO(st, ts_module_print(model, stdout), done);
        TS_TRY_GOTO(st, ts_fsdp_summary(model, stdout), done);
    }
    ts_tensor *gain = NULL; /* borrowed from its slot */
    TS_TRY_GOTO(st, ts_module_get_parameter(model, "1.gain", &gain), done);
    char shape[64];
    printf("rank %d: 1.gain holds %s of (%d,)\n", rank, ts_tensor_shape_str(gain, shape, sizeof shape), HID);

    /* the optimizer, after sharding, from the model's parameters (the
     * list holds references; the optimizer takes its own) */
    TS_TRY_GOTO(st, ts_module_parameters(model, &params), done);
    ts_adam_options ao = ts_adamw_options_default();
    ao.lr = 1e-2;
    TS_TRY_GOTO(st, ts_adamw_new(params.n, params.items, &ao, &opt), done);
    ts_param_list_free(&params);

    int64_t rows = BATCH / world;
    TS_TRY_GOTO(st, make_batch(rank * rows, rows, &x, &y), done);
    for (int step = 0; step < STEPS; step++) {
        TS_TRY_GOTO(st, ts_module_call1(model, x, &pred), done);
        TS_TRY_GOTO(st, ts_mse_loss(pred, y, TS_REDUCTION_MEAN, &loss), done);
        TS_TRY_GOTO(st, ts_backward(loss, NULL, false), done);
        TS_TRY_GOTO(st, ts_optim_step(opt), done);
        ts_optim_zero_grad(opt, true);
        /* the mean loss over the whole batch: the ranks' means, averaged */
        TS_TRY_GOTO(st, ts_detach(loss, &avg), done);
        TS_TRY_GOTO(st, ts_all_reduce(ts_dist_world(), avg, TS_REDUCE_AVG, NULL), done);
        double v = 0;
        TS_TRY_GOTO(st, ts_tensor_item(avg, &v), done);
        if (rank == 0)
            printf("step %2d loss %.8f\n", step, v);
        ts_tensor_free(pred);
        ts_tensor_free(loss);
        ts_tensor_free(avg);
        pred = loss = avg = NULL; /* freed: clear, so that the cleanup does not free them again */
    }

    /* the buffer counted every training forward, on every rank (it is not
     * sharded: each rank has its own whole copy) */
    ts_tensor *nbt = NULL;
    TS_TRY_GOTO(st, ts_module_get_buffer(model, "2.num_batches_tracked", &nbt), done);
    double count = 0;
    TS_TRY_GOTO(st, ts_tensor_item(nbt, &count), done);
    printf("rank %d: 2.num_batches_tracked = %.0f\n", rank, count);
    if (skip_gain_rank >= 0) { /* this rank's rows of 1.gain (its shard: plain floats) */
        TS_TRY_GOTO(st, ts_module_get_parameter(model, "1.gain", &gain), done);
        const float *gv = ts_tensor_data(gain);
        int64_t n = ts_tensor_numel(gain), moved = 0;
        for (int64_t i = 0; i < n; i++)
            moved += gv[i] != 0.5f;
        printf("rank %d: 1.gain rows trained %lld of %lld%s\n", rank, (long long)moved, (long long)n,
               rank == skip_gain_rank ? " (this rank skips gain)" : "");
    }
    fflush(stdout);
done:
    ts_tensor_free(pred);
    ts_tensor_free(loss);
    ts_tensor_free(avg);
    ts_tensor_free(x);
    ts_tensor_free(y);
    ts_param_list_free(&params);
    ts_optim_free(opt);
    for (int i = 0; i < 4; i++)
        ts_module_free(k[i]);
    ts_module_free(model);
    return st;
}

int main(int argc, char **argv)
{
    /* no flags: --help prints this, anything else is refused (exit 2) */
    int skip_gain_rank = -1;
    ex_flag flags[] = {
        {"--skip-gain-rank", "R", EX_FLAG_INT, &skip_gain_rank, -1, 1 << 20, false,
         "this rank's blocks do not use gain (its backward gives it no gradient; -1: none)", false},
    };
    ex_parse_flags(argc, argv, "A user-defined module type (a residual block with a child, a parameter and a buffer), printed, summarised, sharded bottom-up and trained with AdamW. Alone, or under tsrun.", flags, 1);
    CHECK(ts_launch_rank_guard());
    CHECK(ts_dist_init(NULL)); /* the world from tsrun (or mpirun, srun); one rank alone */
    int rank = ts_comm_rank(ts_dist_world()), world = ts_comm_size(ts_dist_world());
    ts_status st = run(rank, world, skip_gain_rank);
    if (st)
        fprintf(stderr, "rank %d: error: %s: %s\n", rank, ts_status_name(st), ts_last_error());
    fflush(stdout);
    ts_status fst = ts_dist_finalize();
    return st || fst ? 1 : 0;
}
