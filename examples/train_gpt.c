/* Trains a small GPT-style character model with AdamW and a warmup +
 * cosine learning-rate schedule, on a built-in grammar corpus or any text
 * file, with fully_shard: each transformer block is one FSDP group, the
 * root (embeddings, final norm, head) another. Run alone it is one rank;
 * under tsrun (or mpirun, srun) every rank trains on its own batches and
 * the gradients are averaged, so W ranks see W times the data per step.
 * Rank 0 prints step, loss (averaged over ranks), tokens/s (all ranks)
 * and peak memory, and at the end the collectives issued and the bytes
 * they were given per step.
 *
 * Usage: [tsrun --nproc-per-node N] train_gpt [--data FILE] [--steps N]
 *        [--batch B] [--seq T] [--layers L] [--heads H] [--dim D] [--lr LR]
 *        [--seed S] [--save FILE.safetensors] [--load FILE.safetensors]
 *        [--sample N [--temperature T] [--prompt TEXT]]    (--help: all flags)
 *        [--offload cpu [--pin-memory 0|1]] [--checkpoint-activations]
 * --checkpoint-activations checkpoints every block (ts_checkpoint_module
 * before ts_fully_shard): the backward recomputes each block's forward
 * instead of keeping its activations (same losses, lower peak).
 * --offload cpu shards every group with CPUOffloadPolicy (pinned host
 * shards and gradients unless --pin-memory 0) and prints, at the end, its
 * staging copies per step and the host bytes it holds.
 *        [--param-dtype bf16|f16|f32] [--reduce-dtype bf16|f16|f32]
 * --param-dtype and --reduce-dtype give every FSDP group the
 * mixed-precision policy (ts_mp_policy): all-gather, forward and backward
 * in the param dtype, gradients reduced in the reduce dtype (default: the
 * param dtype), float32 master weights and AdamW; the logits are cast to
 * float32 for the loss; f16 adds a ts_grad_scaler (steps with inf/NaN
 * gradients are skipped). The end prints the bytes all-gathered and
 * reduce-scattered per step.
 * --load starts from a full state dict saved by --save (every rank reads
 * the file and keeps its rows); the sizes (--seq, --layers, --heads,
 * --dim) and the vocabulary are the checkpoint's (its metadata records
 * them; sizes given must agree, the text must use its characters).
 * --load F --sample N does not train: it generates N characters after the
 * prompt, greedily or, with --temperature, by sampling (--seed).
 * Exit status: 0 for a run that completed, 2 for bad flags or a size that
 * cannot fit in memory, 1 for a failure (the message says which). */
#include "common.h"


/* The next character's id from the last row of logits (V): the argmax
 * (first of equals) at temperature 0, else a draw from
 * softmax(logits / temperature). */
static int next_token(const float *logits, int V, double temperature, ts_generator *g)
{
    int best = 0;
    for (int v = 1; v < V; v++)
        if (logits[v] > logits[best]) best = v;
    if (temperature <= 0) return best;
    double sum = 0, p[256];
    for (int v = 0; v < V; v++) sum += p[v] = exp(((double)logits[v] - logits[best]) / temperature);
    double u = ((double)ts_generator_random(g) + 0.5) / 4294967296.0 * sum;
    for (int v = 0; v < V; v++) {
        if (u < p[v]) return v;
        u -= p[v];
    }
    return V - 1;
}

/* Generates n characters after the prompt (already mapped to ids) with
 * the sharded model, printing them on rank 0. Every rank runs the same
 * forwards (the model's groups are gathered collectively) and draws the
 * same numbers. */
static int generate(ts_module *model, const char *chars, int vocab, int seq, const int64_t *prompt, int n_prompt,
                    int n, double temperature, uint64_t seed)
{
    int64_t *ctx = malloc((size_t)(n_prompt + n) * sizeof *ctx);
    float *logits = malloc((size_t)seq * (size_t)vocab * sizeof *logits);
    ts_generator *g;
    if (!ctx || !logits || ts_generator_new(seed, &g)) {
        fprintf(stderr, "train_gpt: out of memory for --sample %d\n", n);
        return 1;
    }
    memcpy(ctx, prompt, (size_t)n_prompt * sizeof *ctx);
    int len = n_prompt;
    ts_module_eval(model);
    bool prev = ts_grad_mode_set(false);
    for (int i = 0; i < n; i++) {
        int T = len < seq ? len : seq;
        int64_t shape[2] = {1, T};
        ts_tensor *x, *y;
        CHECK(ts_tensor_from_data(TS_I64, 2, shape, ctx + len - T, &x));
        CHECK(ts_module_call1(model, x, &y));
        CHECK(ts_tensor_copy_to(y, logits, (size_t)T * (size_t)vocab * sizeof *logits));
        ctx[len++] = next_token(logits + (size_t)(T - 1) * (size_t)vocab, vocab, temperature, g);
        ts_tensor_free(y);
        ts_tensor_free(x);
    }
    ts_grad_mode_set(prev);
    if (temperature > 0)
        printf("sample (temperature %g, seed %llu): %d characters after the prompt\n", temperature,
               (unsigned long long)seed, n);
    else
        printf("sample (greedy): %d characters after the prompt\n", n);
    for (int i = 0; i < len; i++) putchar(chars[ctx[i]]);
    putchar('\n');
    fflush(stdout);
    ts_generator_free(g);
    free(logits);
    free(ctx);
    return 0;
}

/* One line: the collectives of one step on this rank, by kind, the bytes
 * given to them (the counters' input bytes) and the bytes this rank sends
 * for them over the rings (all-gather (W-1) x its input; reduce-scatter
 * (W-1)/W of it; all-reduce, a reduce-scatter then an all-gather, twice
 * that; broadcast and send their tensor). */
static void print_comm_summary(ts_comm *world, int steps, int W)
{
    static const char *names[TS_COLL_KIND_COUNT] = {"all_gather", "reduce_scatter", "all_reduce", "broadcast",
                                                    "barrier",    "all_to_all",     "send",       "recv"};
    double sent_factor[TS_COLL_KIND_COUNT] = {0};
    sent_factor[TS_COLL_ALL_GATHER] = W - 1;
    sent_factor[TS_COLL_REDUCE_SCATTER] = (double)(W - 1) / W;
    sent_factor[TS_COLL_ALL_REDUCE] = 2.0 * (W - 1) / W;
    sent_factor[TS_COLL_BROADCAST] = W > 1 ? 1 : 0;
    sent_factor[TS_COLL_ALL_TO_ALL] = (double)(W - 1) / W;
    sent_factor[TS_COLL_SEND] = 1;
    ts_comm_counters c;
    ts_comm_stats(world, &c);
    double calls = 0, in = 0, sent = 0;
    char kinds[512] = "";
    size_t n = 0;
    for (int k = 0; k < TS_COLL_KIND_COUNT; k++) {
        if (!c.calls[k]) continue;
        calls += (double)c.calls[k];
        in += (double)c.bytes[k];
        sent += sent_factor[k] * (double)c.bytes[k];
        n += (size_t)snprintf(kinds + n, sizeof kinds - n, "%s%s %.1f", n ? ", " : "", names[k],
                              (double)c.calls[k] / steps);
    }
    char b1[32], b2[32];
    printf("collectives per step on rank 0 of %d: %.1f issued%s%s%s, %s given to them, %s sent by this rank\n", W,
           calls / steps, n ? " (" : "", kinds, n ? ")" : "", ex_fmt_bytes(in / steps, b1, sizeof b1),
           ex_fmt_bytes(sent / steps, b2, sizeof b2));
}

/* The dtype named by a --param-dtype / --reduce-dtype value (bf16, f16,
 * f32, or their PyTorch names); TS_DTYPE_COUNT for anything else. */
static ts_dtype parse_dtype(const char *s)
{
    if (!strcmp(s, "bf16") || !strcmp(s, "bfloat16")) return TS_BF16;
    if (!strcmp(s, "f16") || !strcmp(s, "fp16") || !strcmp(s, "float16")) return TS_F16;
    if (!strcmp(s, "f32") || !strcmp(s, "fp32") || !strcmp(s, "float32")) return TS_F32;
    return TS_DTYPE_COUNT;
}

/* The value of `key` in the "__metadata__" of a safetensors file that
 * --save wrote (its values hold no escapes): 1 with the value in buf when
 * found, 0 when absent or not readable as such (the loader then says what
 * is wrong with the file), -1 after printing why the file cannot be read. */
static int checkpoint_meta(const char *path, const char *key, char *buf, size_t cap)
{
    int fd = ex_open_regular("train_gpt", "--load", path);
    if (fd < 0) return -1;
    unsigned char lenb[8];
    struct stat sb;
    int found = 0;
    char *hdr = NULL;
    if (fstat(fd, &sb) == 0 && read(fd, lenb, 8) == 8) {
        uint64_t n = 0;
        for (int i = 7; i >= 0; i--) n = n << 8 | lenb[i];
        if (n <= (uint64_t)sb.st_size - 8 && n <= (64u << 20) && (hdr = malloc((size_t)n + 1)) &&
            read(fd, hdr, (size_t)n) == (ssize_t)n) {
            hdr[n] = '\0';
            char quoted[128];
            snprintf(quoted, sizeof quoted, "\"%s\"", key);
            const char *m = strstr(hdr, "\"__metadata__\"");
            const char *k = m ? strstr(m, quoted) : NULL;
            if (k) {
                k += strlen(quoted);
                while (*k == ' ' || *k == ':') k++;
                const char *end = *k == '"' ? strchr(k + 1, '"') : NULL;
                if (end && (size_t)(end - k - 1) < cap) {
                    memcpy(buf, k + 1, (size_t)(end - k - 1));
                    buf[end - k - 1] = '\0';
                    found = 1;
                }
            }
        }
    }
    free(hdr);
    close(fd);
    return found;
}

int main(int argc, char **argv)
{
    ts_launch_rank_guard();
    const char *data = NULL, *save = NULL, *load = NULL, *prompt = NULL;
    const char *param_dtype_s = NULL, *reduce_dtype_s = NULL;
    int steps = 300, batch = 8, seq = 64, layers = 2, heads = 4, dim = 64, sample = 0;
    double lr = 3e-3, temperature = 0;
    uint64_t seed = 1337;
    const char *offload = "none";
    int pin_memory = 1;
    ex_flag flags[] = {
        {"--data", "FILE", EX_FLAG_STRING, &data, 0, 0, false, "train on this text file (default: a built-in grammar corpus)", false},
        {"--steps", "N", EX_FLAG_INT, &steps, 1, INT_MAX, false, "optimizer steps", false},
        {"--batch", "B", EX_FLAG_INT, &batch, 1, 1 << 20, false, "sequences per rank and step", false},
        {"--seq", "T", EX_FLAG_INT, &seq, 2, 1 << 20, false, "characters per sequence (the context length)", false},
        {"--layers", "L", EX_FLAG_INT, &layers, 1, 1 << 16, false, "transformer blocks", false},
        {"--heads", "H", EX_FLAG_INT, &heads, 1, 1 << 16, false, "attention heads (dividing --dim)", false},
        {"--dim", "D", EX_FLAG_INT, &dim, 1, 1 << 24, false, "model width", false},
        {"--lr", "LR", EX_FLAG_DOUBLE, &lr, 0, 10, true, "peak learning rate (warmup, then cosine to LR/10)", false},
        {"--seed", "S", EX_FLAG_U64, &seed, 0, 18446744073709551615.0, false, "initialization, batches and sampling", false},
        {"--save", "FILE", EX_FLAG_STRING, &save, 0, 0, false, "write a full checkpoint (safetensors) from rank 0 at the end", false},
        {"--load", "FILE", EX_FLAG_STRING, &load, 0, 0, false, "start from a checkpoint written by --save", false},
        {"--sample", "N", EX_FLAG_INT, &sample, 1, 1 << 20, false, "with --load: generate N characters instead of training", false},
        {"--temperature", "T", EX_FLAG_DOUBLE, &temperature, 0, 100, false, "--sample: 0 picks the likeliest character, above 0 samples", false},
        {"--prompt", "TEXT", EX_FLAG_STRING, &prompt, 0, 0, false, "--sample: the text to continue (default: the corpus's first character)", false},
        {"--offload", "none|cpu", EX_FLAG_STRING, &offload, 0, 0, false, "cpu: CPUOffloadPolicy on every group (host shards, gradients, optimizer state)", false},
        {"--pin-memory", "0|1", EX_FLAG_INT, &pin_memory, 0, 1, false, "--offload cpu: pin the host shards and gradients", false},
        {"--param-dtype", "bf16|f16|f32", EX_FLAG_STRING, &param_dtype_s, 0, 0, false, "mixed precision: all-gather and compute in this dtype (float32 master weights)", false},
        {"--reduce-dtype", "bf16|f16|f32", EX_FLAG_STRING, &reduce_dtype_s, 0, 0, false, "mixed precision: reduce the gradients in this dtype (default: the param dtype)", false},
    };
    enum { NFLAGS = sizeof flags / sizeof flags[0] };
    bool ckpt_act = false; /* a switch without value: taken out before the flags are parsed */
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--checkpoint-activations")) {
            ckpt_act = true;
            memmove(&argv[i], &argv[i + 1], (size_t)(argc - i) * sizeof *argv);
            argc--, i--;
        }
    ex_parse_flags(argc, argv,
                   "Trains a character-level GPT with fully_shard (one FSDP group per block, then the root), alone\n"
                   "or on the ranks of tsrun --nproc-per-node N; or, with --load FILE --sample N, generates text.\n"
                   "--checkpoint-activations (no value): checkpoint every block (recompute in backward).",
                   flags, NFLAGS);
    bool sample_flags = ex_flag_given(flags, NFLAGS, "--temperature") || ex_flag_given(flags, NFLAGS, "--prompt");
    if (strcmp(offload, "none") != 0 && strcmp(offload, "cpu") != 0) {
        fprintf(stderr, "train_gpt: --offload '%s' (must be none or cpu)\n", offload);
        return 2;
    }
    bool offload_cpu = strcmp(offload, "cpu") == 0;
    if (!offload_cpu && ex_flag_given(flags, NFLAGS, "--pin-memory")) {
        fprintf(stderr, "train_gpt: --pin-memory goes with --offload cpu\n");
        return 2;
    }
    if (sample && !load) {
        fprintf(stderr, "train_gpt: --sample needs --load FILE (a checkpoint written by --save)\n");
        return 2;
    }
    if (sample_flags && !sample) {
        fprintf(stderr, "train_gpt: --temperature and --prompt go with --sample N\n");
        return 2;
    }
    if (sample && save) {
        fprintf(stderr, "train_gpt: --sample does not train, so there is nothing to --save\n");
        return 2;
    }
    /* Files before anything else: a FIFO or a directory is refused rather
     * than read, a checkpoint folder that cannot be written before the
     * training it would lose. */
    ts_mp_policy mp = ts_mp_policy_default();
    if (param_dtype_s && (mp.param_dtype = parse_dtype(param_dtype_s)) == TS_DTYPE_COUNT) {
        fprintf(stderr, "train_gpt: --param-dtype '%s' is not one of bf16, f16, f32\n", param_dtype_s);
        return 2;
    }
    if (reduce_dtype_s && (mp.reduce_dtype = parse_dtype(reduce_dtype_s)) == TS_DTYPE_COUNT) {
        fprintf(stderr, "train_gpt: --reduce-dtype '%s' is not one of bf16, f16, f32\n", reduce_dtype_s);
        return 2;
    }
    ts_fsdp_options fso = ts_fsdp_options_default();
    if (param_dtype_s || reduce_dtype_s) fso.mp_policy = &mp;
    bool half = mp.param_dtype == TS_BF16 || mp.param_dtype == TS_F16;
    if (load && ex_check_regular("train_gpt", "--load", load)) return 2;
    if (save && ex_check_writable("train_gpt", "--save", save)) return 2;

    /* A checkpoint written by --save carries its sizes and vocabulary:
     * sizes not given on the command line are taken from it, sizes given
     * must agree. */
    int map[256], vocab = 0;
    char chars[256];
    for (int i = 0; i < 256; i++) map[i] = -1;
    if (load) {
        char meta[600];
        int r = checkpoint_meta(load, "train_gpt.config", meta, sizeof meta);
        if (r < 0) return 2;
        int got[4];
        if (r > 0 && sscanf(meta, "seq=%d layers=%d heads=%d dim=%d", &got[0], &got[1], &got[2], &got[3]) == 4) {
            static const char *names[4] = {"--seq", "--layers", "--heads", "--dim"};
            int *vals[4] = {&seq, &layers, &heads, &dim};
            for (int i = 0; i < 4; i++) {
                if (ex_flag_given(flags, NFLAGS, names[i]) && *vals[i] != got[i]) {
                    fprintf(stderr, "train_gpt: %s %d, but --load '%s' was trained with %s %d\n", names[i],
                            *vals[i], load, names[i], got[i]);
                    return 2;
                }
                *vals[i] = got[i];
            }
        }
        if ((r = checkpoint_meta(load, "train_gpt.vocab", meta, sizeof meta)) < 0) return 2;
        size_t hl = r > 0 ? strlen(meta) : 0;
        for (size_t i = 0; i + 1 < hl && hl % 2 == 0; i += 2) {
            unsigned c;
            if (sscanf(meta + i, "%2x", &c) != 1 || map[c] >= 0) {
                vocab = 0; /* not ours after all: the vocabulary comes from the text */
                for (int k = 0; k < 256; k++) map[k] = -1;
                break;
            }
            chars[vocab] = (char)c;
            map[c] = vocab++;
        }
    }
    if (dim % heads) {
        fprintf(stderr, "train_gpt: --dim %d is not a multiple of --heads %d\n", dim, heads);
        return 2;
    }
    bool ckpt_vocab = vocab > 0;
    size_t len = 0;
    char *text = NULL;
    if (!(sample && ckpt_vocab)) { /* sampling from a checkpoint of ours needs no text */
        text = data ? ex_read_file("train_gpt", "--data", data, &len) : ex_grammar_corpus(200000, 7);
        if (!text) return data ? 2 : 1;
        if (!data) len = strlen(text);
        if (!sample && len < (size_t)seq + 2) {
            fprintf(stderr, "train_gpt: the text has %zu characters; --seq %d needs more than %d\n", len, seq,
                    seq + 1);
            free(text);
            return 2;
        }
        /* the character vocabulary, or the checkpoint's */
        for (size_t i = 0; i < len; i++) {
            unsigned char c = (unsigned char)text[i];
            if (map[c] >= 0) continue;
            if (ckpt_vocab) {
                fprintf(stderr,
                        "train_gpt: %s has the character 0x%02x at offset %zu, which is not in the vocabulary of "
                        "--load '%s'\n",
                        data ? data : "the built-in corpus", c, i, load);
                free(text);
                return 2;
            }
            chars[vocab] = (char)c;
            map[c] = vocab++;
        }
    }

    /* the prompt, in ids, before anything is built */
    int64_t *prompt_ids = NULL;
    int n_prompt = 0;
    if (sample) {
        const char *p = prompt ? prompt : (const char[]){chars[0], '\0'}; /* the corpus's first character */
        n_prompt = (int)strlen(p);
        prompt_ids = malloc((size_t)n_prompt * sizeof *prompt_ids);
        if (!prompt_ids) return 1;
        for (int i = 0; i < n_prompt; i++) {
            prompt_ids[i] = map[(unsigned char)p[i]];
            if (prompt_ids[i] < 0) {
                fprintf(stderr, "train_gpt: --prompt: the character '%c' (0x%02x) is not in the vocabulary\n", p[i],
                        (unsigned char)p[i]);
                free(prompt_ids);
                free(text);
                return 2;
            }
        }
    }

    /* Refuse sizes this machine cannot hold before allocating them. */
    ts_rank_env env;
    int W = 1, local_W = 1;
    if (ts_launch_env(&env) == TS_OK) {
        W = env.world_size;
        local_W = env.local_world_size;
    }
    /* per rank, from ts_fsdp_memory_estimate_gpt (fully_shard.h): the peak of one step */
    ts_gpt_config ecfg = ts_gpt_config_default();
    ecfg.vocab_size = vocab, ecfg.block_size = seq, ecfg.n_layer = layers, ecfg.n_head = heads, ecfg.d_model = dim;
    ts_fsdp_memory_options emo = ts_fsdp_memory_options_default();
    emo.input_ndim = 2, emo.input_shape[0] = sample ? 1 : batch, emo.input_shape[1] = seq;
    emo.world_size = W, emo.checkpoint_blocks = ckpt_act;
    if (param_dtype_s) emo.param_dtype = mp.param_dtype;
    ts_fsdp_memory_report me;
    CHECK(ts_fsdp_memory_estimate_gpt(&ecfg, &emo, &me));
    double phys = ex_physical_memory();
    if (phys > 0 && (double)me.peak_bytes * local_W > phys) {
        char b[6][32];
        fprintf(stderr,
                "train_gpt: this model cannot fit in memory: %.3g parameters need about %s per rank (shards of the "
                "parameters, gradients and AdamW state %s, gathered groups %s, activations %s) x %d rank%s on this "
                "node = %s, more than the %s of physical memory\n",
                (double)me.n_params, ex_fmt_bytes((double)me.peak_bytes, b[0], 32),
                ex_fmt_bytes((double)(me.param_bytes + me.grad_bytes + me.optim_bytes), b[1], 32),
                ex_fmt_bytes((double)me.group_bytes * me.groups_in_flight, b[2], 32),
                ex_fmt_bytes((double)(me.checkpointed ? me.act_ckpt_bytes : me.act_bytes), b[3], 32), local_W,
                local_W > 1 ? "s" : "", ex_fmt_bytes((double)me.peak_bytes * local_W, b[4], 32),
                ex_fmt_bytes(phys, b[5], 32));
        free(prompt_ids);
        free(text);
        return 2;
    }

    CHECK(ts_dist_init(NULL));
    ts_comm *world = ts_dist_world();
    int rank = ts_comm_rank(world);
    W = ts_comm_size(world);
    if (rank != 0) /* one voice */
        if (!freopen("/dev/null", "w", stdout)) return 1;
    if (text)
        printf("corpus: %s, %zu characters, vocabulary %d%s\n", data ? data : "built-in grammar", len, vocab,
               ckpt_vocab ? " (the checkpoint's)" : "");
    else
        printf("vocabulary: %d characters, from %s\n", vocab, load);

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
    ts_offload_policy op = ts_offload_policy_default();
    op.pin_memory = pin_memory != 0;
    if (offload_cpu) fso.offload_policy = &op;
    for (int l = 0; l < layers; l++) {
        char name[32];
        ts_module *block;
        snprintf(name, sizeof name, "blocks.%d", l);
        CHECK(ts_module_get_submodule(model, name, &block));
        if (ckpt_act) CHECK(ts_checkpoint_module(block));
        CHECK(ts_fully_shard(block, &fso));
    }
    CHECK(ts_fully_shard(model, &fso));
    if (rank == 0) CHECK(ts_fsdp_summary(model, stdout)); /* the sharding layout, once */
    if (load) {
        ts_state_dict *sd;
        CHECK(ts_safetensors_load(load, &sd));
        ts_status st = ts_fsdp_load_full_state_dict(model, sd, true);
        if (st) {
            fprintf(stderr,
                    "train_gpt: --load '%s' does not fit this model: %s\n(give the --data, --seq, --layers, --heads "
                    "and --dim it was trained with)\n",
                    load, ts_last_error());
            ts_state_dict_free(sd);
            ts_module_free(model);
            free(prompt_ids);
            free(text);
            ts_dist_finalize();
            return 1;
        }
        printf("loaded %d tensors from %s\n", ts_state_dict_size(sd), load);
        ts_state_dict_free(sd);
    }
    /* the estimate again from the sharded model itself (its groups, policies and checkpointed blocks) */
    char mb[32];
    CHECK(ts_fsdp_memory_estimate(model, &emo, &me));
    printf("memory estimate: %lld parameters, about %s per rank (%d rank%s)\n", (long long)me.n_params,
           ex_fmt_bytes((double)me.peak_bytes, mb, sizeof mb), W, W > 1 ? "s" : "");

    if (sample) {
        int rc = generate(model, chars, vocab, seq, prompt_ids, n_prompt, sample, temperature, seed);
        free(prompt_ids);
        ts_module_free(model);
        free(text);
        CHECK(ts_dist_finalize());
        return rc;
    }

    ts_named_params params;
    CHECK(ts_module_named_parameters(model, &params));
    ts_tensor **plist = malloc((size_t)params.n * sizeof *plist);
    if (!plist) return 1;
    for (int i = 0; i < params.n; i++) plist[i] = *params.items[i].slot;
    ts_adam_options ao = ts_adamw_options_default();
    ao.lr = lr;
    ao.weight_decay = 0.01;
    ts_optim *opt;
    CHECK(ts_adamw_new(params.n, plist, &ao, &opt));
    ts_lr_schedule sched = {TS_LR_WARMUP_COSINE, lr, steps / 10 + 1, steps, lr / 10};
    ts_grad_scaler *scaler = NULL; /* float16 needs loss scaling */
    if (mp.param_dtype == TS_F16) CHECK(ts_grad_scaler_new(NULL, &scaler));
    int skipped = 0;
    int64_t local = 0;
    for (int i = 0; i < params.n; i++) local += ts_tensor_numel(plist[i]);
    printf("model: GPT %d layers, %d heads, d_model %d; fully_shard over %d rank%s (%s): %lld parameter elements "
           "on rank 0\n",
           layers, heads, dim, W, W > 1 ? "s" : "", W > 1 ? "distributed world" : "one-rank mesh", (long long)local);

    int64_t *ids = malloc((size_t)batch * (size_t)seq * sizeof *ids), *tg = malloc((size_t)batch * (size_t)seq * sizeof *tg);
    if (!ids || !tg) return 1;
    ts_generator *data_rng;
    CHECK(ts_generator_new(seed + 1 + (uint64_t)rank, &data_rng)); /* each rank its own batches */
    double t0 = ex_now(), first = 0, last = 0, window = 0;
    int window_n = 0, rc = 0;
    int64_t tokens = 0;
    ts_comm_stats_reset(world); /* count the training loop's collectives only */
    int step;
    for (step = 0; step < steps; step++) {
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
        if (half) { /* the loss in float32, as torchtitan's pred.float() */
            ts_tensor *l32;
            CHECK(ts_to_dtype(logits, TS_F32, &l32));
            ts_tensor_free(logits);
            logits = l32;
        }
        int64_t fs[2] = {(int64_t)batch * seq, vocab};
        CHECK(ts_reshape(logits, 2, fs, &flat));
        CHECK(ts_cross_entropy(flat, y, -100, TS_REDUCTION_MEAN, &loss));
        if (scaler) {
            ts_tensor *scaled;
            CHECK(ts_grad_scaler_scale(scaler, loss, &scaled));
            CHECK(ts_backward(scaled, NULL, false));
            ts_tensor_free(scaled);
            CHECK(ts_grad_scaler_unscale(scaler, opt)); /* before clipping, as PyTorch's recipe */
        } else {
            CHECK(ts_backward(loss, NULL, false));
        }
        double gn;
        bool overflow = scaler && ts_grad_scaler_found_inf(scaler, opt); /* the same on every rank */
        ts_status cs = overflow ? TS_OK : ts_fsdp_clip_grad_norm(model, 1.0, &gn);
        if (cs) { /* a non-finite gradient norm: the same on every rank */
            fprintf(stderr, "train_gpt: step %d: %s\n", step + 1, ts_last_error());
            ts_tensor_free(x);
            ts_tensor_free(y);
            ts_tensor_free(logits);
            ts_tensor_free(flat);
            ts_tensor_free(loss);
            rc = 1;
            step++;
            break;
        }
        ts_optim_set_lr(opt, ts_lr_at(&sched, step));
        if (scaler) {
            bool stepped;
            CHECK(ts_grad_scaler_step(scaler, opt, &stepped));
            CHECK(ts_grad_scaler_update(scaler));
            skipped += !stepped;
        } else {
            CHECK(ts_optim_step(opt));
        }
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
        ts_tensor_free(x);
        ts_tensor_free(y);
        ts_tensor_free(logits);
        ts_tensor_free(flat);
        ts_tensor_free(loss);
        if (!isfinite(l)) { /* every rank sees the same average */
            fprintf(stderr, "train_gpt: step %d: the loss is %g (diverged; try a smaller --lr than %g)\n", step + 1, l,
                    lr);
            rc = 1;
            step++;
            break;
        }
        if (step == 0) first = l;
        last = l;
        window += l;
        window_n++;
        tokens += (int64_t)batch * seq * W;
        int every = steps >= 20 ? steps / 20 : 1;
        if ((step + 1) % every == 0 || step == 0) {
            double el = ex_now() - t0;
            printf("step %4d  loss %.4f  (mean of last %d: %.4f)  lr %.2e  %.0f tokens/s  peak tensors %.1f MiB  "
                   "rss %.1f MiB\n",
                   step + 1, l, window_n, window / window_n, ts_lr_at(&sched, step), (double)tokens / el,
                   (double)ts_mem_peak_bytes(TS_MEM_STORAGE) / 1048576.0, ex_peak_rss_mib());
            window = 0;
            window_n = 0;
        }
    }
    print_comm_summary(world, step, W);
    if (offload_cpu && step > 0) {
        ts_fsdp_offload_stats os;
        CHECK(ts_fsdp_offload_stats_get(model, &os));
        char b1[32], b2[32], b3[32], b4[32], b5[32];
        printf("offload (cpu, %s): %d groups; per step %.1f host-to-device copies (%s) before all-gathers, %.1f "
               "device-to-host copies (%s) of reduced gradients; host blocks %s, pinned %s (%s locked)\n",
               op.pin_memory ? "pinned" : "pageable", os.groups, (double)os.h2d_copies / step,
               ex_fmt_bytes((double)os.h2d_bytes / step, b1, sizeof b1), (double)os.d2h_copies / step,
               ex_fmt_bytes((double)os.d2h_bytes / step, b2, sizeof b2), ex_fmt_bytes((double)os.host_bytes, b3, sizeof b3),
               ex_fmt_bytes((double)os.pinned_bytes, b4, sizeof b4),
               ex_fmt_bytes((double)ts_mem_locked_bytes(), b5, sizeof b5));
    }
    {
        /* what the policy changes on the wire: the all-gathers carry the
         * param dtype, the reduce-scatters the reduce dtype */
        ts_comm_counters cc;
        ts_comm_stats(world, &cc);
        char b1[32], b2[32];
        int n = step > 0 ? step : 1;
        printf("bytes per step on rank 0: all-gathered %s (%.0f bytes), reduce-scattered %s (%.0f bytes); param dtype "
               "%s, reduce dtype %s\n",
               ex_fmt_bytes((double)cc.bytes[TS_COLL_ALL_GATHER] / n, b1, sizeof b1),
               (double)cc.bytes[TS_COLL_ALL_GATHER] / n,
               ex_fmt_bytes((double)cc.bytes[TS_COLL_REDUCE_SCATTER] / n, b2, sizeof b2),
               (double)cc.bytes[TS_COLL_REDUCE_SCATTER] / n,
               mp.param_dtype == TS_DTYPE_KEEP ? "float32" : ts_dtype_name(mp.param_dtype),
               ts_dtype_name(mp.reduce_dtype != TS_DTYPE_KEEP ? mp.reduce_dtype
                             : mp.param_dtype != TS_DTYPE_KEEP ? mp.param_dtype : TS_F32));
        if (scaler)
            printf("grad scaler: %d of %d steps skipped (inf/NaN gradients), final scale %g\n", skipped, step,
                   ts_grad_scaler_get_scale(scaler));
    }
    if (!rc) {
        printf("loss %.4f -> %.4f (uniform guess: %.4f)\n", first, last, log((double)vocab));
        if (save) { /* gathered on rank 0 only, then written there */
            ts_state_dict *sd;
            CHECK(ts_fsdp_full_state_dict(model, true, &sd));
            if (rank == 0) {
                /* the sizes and the vocabulary, for --load and --sample */
                char cfgs[128], hex[2 * 256 + 1];
                snprintf(cfgs, sizeof cfgs, "seq=%d layers=%d heads=%d dim=%d", seq, layers, heads, dim);
                for (int i = 0; i < vocab; i++) snprintf(hex + 2 * i, 3, "%02x", (unsigned char)chars[i]);
                hex[2 * vocab] = '\0';
                const char *meta[4] = {"train_gpt.config", cfgs, "train_gpt.vocab", hex};
                CHECK(ts_safetensors_save(save, sd, meta, 2));
                printf("saved %d full tensors to %s\n", ts_state_dict_size(sd), save);
            }
            ts_state_dict_free(sd);
        }
    }
    fflush(stdout);
    ts_generator_free(data_rng);
    ts_grad_scaler_free(scaler);
    ts_optim_free(opt);
    free(plist);
    ts_named_params_free(&params);
    ts_module_free(model);
    free(ids);
    free(tg);
    free(text);
    CHECK(ts_dist_finalize());
    return rc;
}
