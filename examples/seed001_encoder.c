/* Seed 001's own script: four TransformerEncoderLayer(128, 4) with
 * PyTorch's defaults (dim_feedforward 2048, dropout 0.1, relu, post-norm,
 * batch_first false) in a Sequential, sharded as one FSDP group (the
 * seed's FSDP(model)), AdamW lr 1e-4, x = randn(8, 16, 128) (seq 8, batch
 * 16, d 128), five steps of zero_grad, model(x).abs().mean(), backward,
 * step. Prints the five losses, one line each:
 *
 *     step 0 loss 0.799008071
 *
 * The seed's script draws no seed; this one calls ts_manual_seed(--seed,
 * default 0) first, and with torch.manual_seed(0) torch 1.13 prints the
 * same losses (tools/reference/make_seed001.py; the test that compares
 * them is in tests/fully_shard/test_examples.c): the parameters, x and
 * every dropout mask are drawn bit for bit as torch draws them.
 *
 * Usage: seed001_encoder [--dropout P] [--batch-first] [--seed S] [--help]
 *   --dropout P    every layer's dropout (default 0.1, PyTorch's)
 *   --batch-first  batch_first=True layers, x = randn(16, 8, 128)
 *   --seed S       the generator's seed (default 0)
 *
 * Runs alone (a one-rank world) or under tsrun, which shards the model
 * over the ranks; every rank draws the same x, so the losses do not
 * change with the number of ranks. Rank 0 prints. */
#include "common.h"

#include <errno.h>

enum { LAYERS = 4, D_MODEL = 128, NHEAD = 4, STEPS = 5 };

static void usage(FILE *f, const char *prog)
{
    fprintf(f,
            "usage: %s [--dropout P] [--batch-first] [--seed S] [--help]\n"
            "  --dropout P    dropout of every layer, in [0, 1) (default 0.1)\n"
            "  --batch-first  batch_first=True layers and x = randn(16, 8, 128)\n"
            "  --seed S       ts_manual_seed(S) before building (default 0)\n",
            prog);
}

/* Strict parses: the whole string, in range; a message names the flag. */
static bool parse_double(const char *flag, const char *s, double lo, double hi, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !(v >= lo && v < hi)) {
        fprintf(stderr, "error: %s '%s': expected a number in [%g, %g)\n", flag, s, lo, hi);
        return false;
    }
    *out = v;
    return true;
}

static bool parse_u64(const char *flag, const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end || *s == '-' || *s == '+') {
        fprintf(stderr, "error: %s '%s': expected an unsigned integer below 2^64\n", flag, s);
        return false;
    }
    *out = (uint64_t)v;
    return true;
}

int main(int argc, char **argv)
{
    double dropout = 0.1;
    bool batch_first = false;
    uint64_t seed = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout, argv[0]);
            return 0;
        }
        if (!strcmp(a, "--batch-first")) {
            batch_first = true;
            continue;
        }
        bool takes = !strcmp(a, "--dropout") || !strcmp(a, "--seed");
        if (!takes) {
            fprintf(stderr, "error: unknown argument '%s'\n", a);
            usage(stderr, argv[0]);
            return 2;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "error: %s needs a value\n", a);
            return 2;
        }
        const char *v = argv[++i];
        if (!strcmp(a, "--dropout") ? !parse_double(a, v, 0.0, 1.0, &dropout) : !parse_u64(a, v, &seed)) return 2;
    }

    ts_launch_rank_guard();
    CHECK(ts_dist_init(NULL));
    int rank = ts_comm_rank(ts_dist_world());

    /* torch.manual_seed(seed); nn.Sequential(*[nn.TransformerEncoderLayer(
     * 128, 4) for _ in range(4)]): four layers built one after the other,
     * each drawing its own initial values. */
    ts_manual_seed(seed);
    ts_encoder_layer_config cfg = ts_encoder_layer_config_default(D_MODEL, NHEAD);
    cfg.dropout = dropout;
    cfg.batch_first = batch_first;
    ts_module *layers[LAYERS], *model;
    for (int l = 0; l < LAYERS; l++) CHECK(ts_encoder_layer_new(&cfg, &layers[l]));
    CHECK(ts_sequential_new(LAYERS, layers, &model));
    /* FSDP(model): the root as one group */
    CHECK(ts_fully_shard(model, NULL));

    /* torch.optim.AdamW(model.parameters(), lr=1e-4): betas (0.9, 0.999),
     * eps 1e-8, weight_decay 1e-2 */
    ts_named_params params;
    CHECK(ts_module_named_parameters(model, &params));
    ts_tensor **plist = malloc((size_t)params.n * sizeof *plist);
    if (!plist) {
        fprintf(stderr, "error: out of memory\n");
        return 1;
    }
    for (int i = 0; i < params.n; i++) plist[i] = *params.items[i].slot;
    ts_adam_options ao = ts_adamw_options_default();
    ao.lr = 1e-4;
    ts_optim *opt;
    CHECK(ts_adamw_new(params.n, plist, &ao, &opt));

    /* x = torch.randn(8, 16, 128): (seq, batch, d); batch-first (16, 8, 128) */
    int64_t xs[3] = {batch_first ? 16 : 8, batch_first ? 8 : 16, D_MODEL};
    ts_tensor *x;
    CHECK(ts_randn(TS_F32, 3, xs, NULL, &x));

    for (int step = 0; step < STEPS; step++) {
        ts_optim_zero_grad(opt, true);
        ts_tensor *y = NULL, *ay = NULL, *loss = NULL;
        CHECK(ts_module_call1(model, x, &y));
        CHECK(ts_abs(y, &ay));
        CHECK(ts_mean(ay, 0, NULL, false, &loss));
        CHECK(ts_backward(loss, NULL, false));
        CHECK(ts_optim_step(opt));
        double l;
        CHECK(ts_tensor_item(loss, &l));
        /* nine significant digits: a float32 value, exactly */
        if (rank == 0) printf("step %d loss %.9g\n", step, l);
        fflush(stdout);
        ts_tensor_free(loss);
        ts_tensor_free(ay);
        ts_tensor_free(y);
    }

    ts_tensor_free(x);
    ts_optim_free(opt);
    free(plist);
    ts_named_params_free(&params);
    ts_module_free(model);
    CHECK(ts_dist_finalize());
    return 0;
}
