/* Trains a small GPT-style character model with AdamW and a warmup +
 * cosine learning-rate schedule, on a built-in grammar corpus or any text
 * file, with fully_shard: each transformer block is one FSDP group, the
 * root (embeddings, final norm, head) another. Run alone it is one rank;
 * under tsrun (or mpirun, srun) every rank trains on its own batches and
 * the gradients are averaged, so W ranks see W times the data per step.
 * Rank 0 prints step, loss (averaged over ranks), tokens/s (all ranks)
 * and peak memory.
 *
 * Usage: [tsrun --nproc-per-node N] train_gpt [--data FILE] [--steps N]
 *        [--batch B] [--seq T] [--layers L] [--heads H] [--dim D] [--lr LR]
 *        [--seed S] [--save FILE.safetensors] [--load FILE.safetensors]
 * --load starts from a full state dict saved by --save (every rank reads
 * the file and keeps its rows); the vocabulary must be the same. */
#include "examples/common.h"

#include <math.h>

int main(int argc, char **argv)
{
    ts_launch_rank_guard();
    const char *data = NULL, *save = NULL, *load = NULL;
    int steps = 300, batch = 8, seq = 64, layers = 2, heads = 4, dim = 64;
    double lr = 3e-3;
    unsigned long seed = 1337;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            fprintf(stderr, "%s needs a value\n", a);
            return 2;
        }
        if (!strcmp(a, "--data")) data = v;
        else if (!strcmp(a, "--steps")) steps = atoi(v);
        else if (!strcmp(a, "--batch")) batch = atoi(v);
        else if (!strcmp(a, "--seq")) seq = atoi(v);
        else if (!strcmp(a, "--layers")) layers = atoi(v);
        else if (!strcmp(a, "--heads")) heads = atoi(v);
        else if (!strcmp(a, "--dim")) dim = atoi(v);
        else if (!strcmp(a, "--lr")) lr = atof(v);
        else if (!strcmp(a, "--seed")) seed = strtoul(v, NULL, 10);
        else if (!strcmp(a, "--save")) save = v;
        else if (!strcmp(a, "--load")) load = v;
        else {
            fprintf(stderr, "usage: %s [--data FILE] [--steps N] [--batch B] [--seq T] [--layers L] [--heads H] "
                            "[--dim D] [--lr LR] [--seed S] [--save FILE] [--load FILE]\n", argv[0]);
            return 2;
        }
        i++;
    }
    if (steps < 1 || batch < 1 || seq < 2 || layers < 1 || heads < 1 || dim < heads || dim % heads) {
        fprintf(stderr, "invalid sizes: steps, batch, layers, heads >= 1, seq >= 2, dim a multiple of heads\n");
        return 2;
    }
    CHECK(ts_dist_init(NULL));
    ts_comm *world = ts_dist_world();
    int rank = ts_comm_rank(world), W = ts_comm_size(world);
    if (rank != 0) /* one voice */
        if (!freopen("/dev/null", "w", stdout))
            return 1;
    size_t len;
    char *text = data ? ex_read_file(data, &len) : ex_grammar_corpus(200000, 7);
    if (!text)
        return 1;
    if (!data)
        len = strlen(text);
    if (len < (size_t)seq + 2) {
        fprintf(stderr, "the text has %zu characters; need more than --seq + 1 = %d\n", len, seq + 1);
        return 1;
    }
    /* character vocabulary */
    int map[256], vocab = 0;
    for (int i = 0; i < 256; i++)
        map[i] = -1;
    for (size_t i = 0; i < len; i++)
        if (map[(unsigned char)text[i]] < 0)
            map[(unsigned char)text[i]] = vocab++;
    printf("corpus: %s, %zu characters, vocabulary %d\n", data ? data : "built-in grammar", len, vocab);

    ts_manual_seed(seed);
    ts_gpt_config cfg = ts_gpt_config_default();
    cfg.vocab_size = vocab;
    cfg.block_size = seq;
    cfg.n_layer = layers;
    cfg.n_head = heads;
    cfg.d_model = dim;
    ts_module *model;
    CHECK(ts_gpt_new(&cfg, &model));
    /* bottom-up: each block its own group, then the root takes the rest */
    for (int l = 0; l < layers; l++) {
        char name[32];
        ts_module *block;
        snprintf(name, sizeof name, "blocks.%d", l);
        CHECK(ts_module_get_submodule(model, name, &block));
        CHECK(ts_fully_shard(block, NULL));
    }
    CHECK(ts_fully_shard(model, NULL));
    if (rank == 0) CHECK(ts_fsdp_summary(model, stdout)); /* the sharding layout, once */
    if (load) {
        ts_state_dict *sd;
        CHECK(ts_safetensors_load(load, &sd));
        CHECK(ts_fsdp_load_full_state_dict(model, sd, true));
        printf("loaded %d tensors from %s\n", ts_state_dict_size(sd), load);
        ts_state_dict_free(sd);
    }
    ts_named_params params;
    CHECK(ts_module_named_parameters(model, &params));
    ts_tensor **plist = malloc((size_t)params.n * sizeof *plist);
    for (int i = 0; i < params.n; i++)
        plist[i] = *params.items[i].slot;
    ts_adam_options ao = ts_adamw_options_default();
    ao.lr = lr;
    ao.weight_decay = 0.01;
    ts_optim *opt;
    CHECK(ts_adamw_new(params.n, plist, &ao, &opt));
    ts_lr_schedule sched = {TS_LR_WARMUP_COSINE, lr, steps / 10 + 1, steps, lr / 10};
    ts_fsdp_group_info gi;
    CHECK(ts_fsdp_group_info_get(model, &gi));
    int64_t local = 0;
    for (int i = 0; i < params.n; i++)
        local += ts_tensor_numel(plist[i]);
    printf("model: GPT %d layers, %d heads, d_model %d; fully_shard over %d rank%s (%s): %lld parameter elements "
           "on rank 0\n",
           layers, heads, dim, W, W > 1 ? "s" : "", W > 1 ? "tsrun world" : "one-rank mesh", (long long)local);

    int64_t *ids = malloc((size_t)batch * (size_t)seq * sizeof *ids), *tg = malloc((size_t)batch * (size_t)seq * sizeof *tg);
    ts_generator *data_rng;
    CHECK(ts_generator_new(seed + 1 + (unsigned long)rank, &data_rng)); /* each rank its own batches */
    double t0 = ex_now(), first = 0, last = 0, window = 0;
    int64_t tokens = 0;
    for (int step = 0; step < steps; step++) {
        for (int b = 0; b < batch; b++) {
            size_t start = ts_generator_random(data_rng) % (len - (size_t)seq - 1);
            for (int t = 0; t < seq; t++) {
                ids[b * seq + t] = map[(unsigned char)text[start + (size_t)t]];
                tg[b * seq + t] = map[(unsigned char)text[start + (size_t)t + 1]];
            }
        }
        int64_t is[2] = {batch, seq}, ts_[1] = {(int64_t)batch * seq};
        ts_tensor *x, *y, *logits, *flat, *loss;
        CHECK(ts_tensor_from_data(TS_I64, 2, is, ids, &x));
        CHECK(ts_tensor_from_data(TS_I64, 1, ts_, tg, &y));
        CHECK(ts_module_call1(model, x, &logits));
        int64_t fs[2] = {(int64_t)batch * seq, vocab};
        CHECK(ts_reshape(logits, 2, fs, &flat));
        CHECK(ts_cross_entropy(flat, y, -100, TS_REDUCTION_MEAN, &loss));
        CHECK(ts_backward(loss, NULL, false));
        double gn;
        ts_status cs = ts_fsdp_clip_grad_norm(model, 1.0, &gn);
        if (cs) {
            fprintf(stderr, "step %d: %s\n", step, ts_last_error());
            return 1;
        }
        ts_optim_set_lr(opt, ts_lr_at(&sched, step));
        CHECK(ts_optim_step(opt));
        ts_optim_zero_grad(opt, true);
        double l;
        {
            /* the loss averaged over the ranks, for the log */
            int64_t one = 1;
            ts_tensor *lt;
            CHECK(ts_tensor_item(loss, &l));
            CHECK(ts_tensor_full(TS_F64, 1, &one, l, &lt));
            CHECK(ts_all_reduce(world, lt, TS_REDUCE_AVG, NULL));
            CHECK(ts_tensor_item(lt, &l));
            ts_tensor_free(lt);
        }
        if (step == 0)
            first = l;
        last = l;
        window += l;
        tokens += (int64_t)batch * seq * W;
        int every = steps >= 20 ? steps / 20 : 1;
        if ((step + 1) % every == 0 || step == 0) {
            double el = ex_now() - t0;
            printf("step %4d  loss %.4f  (mean of last %d: %.4f)  lr %.2e  %.0f tokens/s  peak tensors %.1f MiB  "
                   "rss %.1f MiB\n", step + 1, l, step ? every : 1, window / (step ? every : 1), ts_lr_at(&sched, step),
                   (double)tokens / el, (double)ts_mem_peak_bytes(TS_MEM_STORAGE) / 1048576.0, ex_peak_rss_mib());
            window = 0;
        }
        ts_tensor_free(x);
        ts_tensor_free(y);
        ts_tensor_free(logits);
        ts_tensor_free(flat);
        ts_tensor_free(loss);
    }
    printf("loss %.4f -> %.4f (uniform guess: %.4f)\n", first, last, log((double)vocab));
    if (save) { /* gathered on rank 0 only, then written there */
        ts_state_dict *sd;
        CHECK(ts_fsdp_full_state_dict(model, true, &sd));
        if (rank == 0) {
            CHECK(ts_safetensors_save(save, sd, NULL, 0));
            printf("saved %d full tensors to %s\n", ts_state_dict_size(sd), save);
        }
        ts_state_dict_free(sd);
    }
    ts_generator_free(data_rng);
    ts_optim_free(opt);
    free(plist);
    ts_named_params_free(&params);
    ts_module_free(model);
    free(ids);
    free(tg);
    free(text);
    CHECK(ts_dist_finalize());
    /* success: the loss fell (from scratch), or did not grow (resumed) */
    return isfinite(last) && (load ? last < first * 1.1 : last < first * 0.6) ? 0 : 1;
}
