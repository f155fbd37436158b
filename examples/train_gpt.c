/* Trains a small GPT-style character model with AdamW and a warmup +
 * cosine learning-rate schedule, on a built-in grammar corpus or any text
 * file. Prints step, loss, tokens/s and peak memory.
 *
 * Usage: train_gpt [--data FILE] [--steps N] [--batch B] [--seq T]
 *                  [--layers L] [--heads H] [--dim D] [--lr LR] [--seed S] */
#include "examples/common.h"

#include <math.h>

int main(int argc, char **argv)
{
    const char *data = NULL;
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
        else {
            fprintf(stderr, "usage: %s [--data FILE] [--steps N] [--batch B] [--seq T] [--layers L] [--heads H] "
                            "[--dim D] [--lr LR] [--seed S]\n", argv[0]);
            return 2;
        }
        i++;
    }
    if (steps < 1 || batch < 1 || seq < 2 || layers < 1 || heads < 1 || dim < heads || dim % heads) {
        fprintf(stderr, "invalid sizes: steps, batch, layers, heads >= 1, seq >= 2, dim a multiple of heads\n");
        return 2;
    }
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
    printf("model: GPT %d layers, %d heads, d_model %d, %lld parameters\n", layers, heads, dim,
           (long long)ts_module_num_parameters(model));

    int64_t *ids = malloc((size_t)batch * (size_t)seq * sizeof *ids), *tg = malloc((size_t)batch * (size_t)seq * sizeof *tg);
    ts_generator *data_rng;
    CHECK(ts_generator_new(seed + 1, &data_rng));
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
        ts_status cs = ts_clip_grad_norm(params.n, plist, 1.0, &gn);
        if (cs) {
            fprintf(stderr, "step %d: %s\n", step, ts_last_error());
            return 1;
        }
        ts_optim_set_lr(opt, ts_lr_at(&sched, step));
        CHECK(ts_optim_step(opt));
        ts_optim_zero_grad(opt, true);
        double l;
        CHECK(ts_tensor_item(loss, &l));
        if (step == 0)
            first = l;
        last = l;
        window += l;
        tokens += (int64_t)batch * seq;
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
    ts_generator_free(data_rng);
    ts_optim_free(opt);
    free(plist);
    ts_named_params_free(&params);
    ts_module_free(model);
    free(ids);
    free(tg);
    free(text);
    return last < first * 0.6 ? 0 : 1;
}
