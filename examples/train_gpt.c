/* Trains a small GPT-style character model with AdamW, a warmup and a
 * learning-rate schedule (cosine by default), on a built-in grammar
 * corpus or any text file, with fully_shard: each transformer block is one FSDP group, the
 * root (embeddings, final norm, head) another. Run alone it is one rank;
 * under tsrun (or mpirun, srun) every rank trains on its own batches and
 * the gradients are averaged, so W ranks see W times the data per step.
 * Rank 0 prints step N/STEPS, the loss (averaged over ranks), the lr, the
 * time per step, the ETA, tokens/s (all ranks) and the peak memory (the
 * maximum over the ranks), and at the end the total and mean step time,
 * the collectives issued and the bytes they were given per step
 * (docs/progress.md).
 *
 * Usage: [tsrun --nproc-per-node N] train_gpt [--data FILE] [--steps N]
 *        [--batch B | --global-batch G] [--seq T] [--layers L] [--heads H]
 *        [--dim D] [--lr LR] [--seed S]
 *        [--save DIR [--save-every N]] [--resume DIR]
 *        [--save-full FILE.safetensors] [--load FILE.safetensors]
 *        [--sample N [--temperature T] [--prompt TEXT]]    (--help: all flags)
 *        [--offload cpu [--pin-memory 0|1]] [--checkpoint-activations] [--ignore-memory-cap]
 *        [--init deferred|eager]
 *        [--data-tokens FILE.bin [--vocab N] [--val-every N] [--val-tokens K]]
 *        [--init-from-hf FILE.safetensors]
 *        [--schedule constant|linear|cosine|wsd] [--warmup N] [--decay-fraction F]
 *        [--metrics FILE.jsonl]
 * --schedule: after a linear warmup of --warmup steps (default
 * max(steps/10, min(100, steps/4)), measured in default_warmup), the lr
 * stays at --lr (constant), or decays to --lr/10 at --steps linearly, by a
 * cosine (the default), or warmup-stable-decay (wsd: --lr, then linear over
 * the last --decay-fraction of the steps); optim.h's ts_lr_schedule.
 * --metrics FILE.jsonl: rank 0 writes a JSON object per step (step, loss,
 * lr, grad_norm, tokens_per_s, seconds, elapsed_s, peak_tensor_bytes,
 * rss_bytes and peak_rss_bytes as maxima over the ranks, val_loss after a
 * validation), flushed each line, appended on --resume (docs/progress.md;
 * tools/trace_plot --metrics draws it).
 *        [--data FILE.txt --tokenizer DIR] [--hsdp R]
 * --init deferred (the default) builds the model on the meta device
 * (ts_device_scope_enter), shards it with no parameter bytes, then gives
 * each rank only its rows: ts_fsdp_materialize replays the initializers
 * (or --load fills them, with no initializer run): no rank ever holds the
 * whole model. --init eager builds it whole on every rank and then shards
 * it; both give the same bits (a --save-full file is the same byte for
 * byte).
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
 *        [--accum K [--accum-mode nosync|sync]]
 * --accum K makes each optimizer step K microbatches of --batch sequences
 * (each loss scaled by 1/K; the same sequences as --accum 1 --batch K*B):
 * nosync (default) turns gradient sync off on the first K-1
 * (ts_fsdp_set_requires_gradient_sync), sync reduce-scatters every one;
 * it prints the gradient memory each mode holds and, per step, the loss
 * and gradient norm to 9 digits.
 * --global-batch G: one data-order generator, the same on every rank,
 * draws G sequences per step and rank r trains on its G/W of them (G a
 * multiple of the world size W), so that W ranks and W' ranks train on
 * the same data (without it each rank draws its own --batch sequences).
 * --save DIR writes a sharded checkpoint (checkpoint/checkpoint.h: one
 * safetensors file per rank and an index) at the end and, with
 * --save-every N, after every N steps; --resume DIR continues one
 * exactly: the model, AdamW's state, the step (--steps N counts from the
 * start of training, so a resumed run stops where an uninterrupted one
 * does and prints the same loss lines), the learning-rate schedule's
 * position, every rank's RNG state and the data order, and the f16 grad
 * scaler's scale and growth tracker. The checkpoint records the flags that
 * shape the model and the training (--seq --layers --heads --dim --param-dtype
 * --reduce-dtype --lr --steps --seed --batch --global-batch --accum
 * --accum-mode --schedule --warmup --decay-fraction) and the
 * text's length and hash; --resume takes those not given, and refuses
 * one given with another value (naming the flag and both values): a
 * changed --lr, --steps, --schedule, --warmup or --decay-fraction would
 * move the schedule (a checkpoint from before --schedule resumes with
 * cosine and steps/10 + 1 warmup steps, what it trained with), so it is
 * refused rather than silently resumed inexactly (to train on with a new
 * schedule, --load a --save-full file). On another world size the
 * per-rank RNG states (and, without --global-batch, the per-rank data
 * order) cannot carry over: they start afresh and a line says so.
 * --stop-after K ends the run after step K of the --steps schedule (a job
 * with a time limit: --save it, then --resume it).
 * --save-full FILE writes the full (unsharded) model as one safetensors
 * file, for PyTorch users (tools/reference/models.py).
 * --load starts from a full state dict saved by --save-full (or by
 * PyTorch: every rank reads the rows it keeps, one tensor at a time, with
 * ts_ckpt_load_full); the sizes (--seq, --layers, --heads,
 * --dim) and the vocabulary are the checkpoint's (its metadata records
 * them; sizes given must agree, the text must use its characters).
 * --load F --sample N does not train: it generates N characters after the
 * prompt, greedily or, with --temperature, by sampling (--seed).
 * Memory: before anything is built, the estimate of each rank's peak
 * resident set (ts_fsdp_memory_estimate_gpt's rss_peak_bytes: the process
 * floor, the tensors and the blocks the caching pool keeps; docs/memory.md)
 * is compared with the cap the rank runs under, TS_MEMORY_PER_RANK (bytes;
 * tsrun --memory-per-rank sets it) or else the process's cgroup limit: a
 * job above it is refused with the numbers (--ignore-memory-cap runs it
 * anyway). At the end rank 0 prints, for each rank, its peak RSS (VmHWM)
 * beside the estimate and its tensor peak beside the tensors' estimate.
 * --vocab N trains on random token ids instead of text: each sequence is
 * seq + 1 draws (ts_generator_random(data_rng) % N) from the data-order
 * generator (seeded --seed + 1, plus the rank without --global-batch, as
 * the text's batches are), so a GPT-2 vocabulary (50257) can be measured;
 * the model, the estimate and the memory cap follow N. The loss can only
 * fall to ln N (the uniform guess), slowly; with --data-batches K the
 * stream starts again every K steps, so the same K batches come back and
 * the model can learn them (K = 1: one batch, a quick check that a large
 * model trains). It trains from scratch: --data, --load,
 * --resume, --sample, --save and --save-full are refused with it.
 * --data-tokens FILE.bin trains on llm.c's token file (tools/tokenize;
 * text/tokens.h), memory-mapped, with a vocabulary of 50257 (GPT-2's) or
 * --vocab N; an id outside it is refused, naming the id and the file. The
 * last --val-tokens K tokens (a tenth of the file by default with
 * --val-every) are held out; training windows are drawn from the rest by
 * the data-order generator as for text (--global-batch: one order, each
 * rank its slice). --val-every N prints, every N steps and at the end,
 * the mean validation loss per token and its perplexity over the fixed
 * validation windows, each rank evaluating its share (all-reduced). The
 * checkpoint records the file's token count and hash, the vocabulary and
 * --val-tokens: --resume needs the same --data-tokens.
 * --init-from-hf FILE starts from a Hugging Face GPT-2 safetensors file
 * (checkpoint.h, ts_ckpt_load_hf_gpt2; docs/gpt2-weights.md): the model
 * takes its shape (layers, width, vocabulary, positions, tied head, tanh
 * GELU; --heads, else GPT-2's 64-wide heads), a conflicting --layers,
 * --dim or --vocab is refused, and each rank reads its rows of the
 * weights; train on --data-tokens (or --vocab N random ids).
 * --data FILE.txt --tokenizer DIR tokenizes the text at start on every
 * rank (GPT-2's encoder.json and vocab.bpe in DIR, or the pair tools/tokenize
 * --learn wrote there; docs/tokenizer.md, "Training on a text") into a
 * token file in memory, then trains as --data-tokens does on the same
 * ids (the vocabulary the tokenizer's; the checkpoint's identity that of
 * the token file tools/tokenize would write). --load F --sample N
 * --tokenizer DIR encodes --prompt (default <|endoftext|>) and decodes the
 * sample through it. Without --tokenizer, --data is characters.
 * --hsdp R shards over a 2-d mesh (replicate R, shard W/R: HSDP, the
 * gradients reduce-scattered in a shard group, then all-reduced over the
 * replicas); W must be a multiple of R. The losses are the 1-d mesh's up
 * to the order of float sums; its checkpoints resume on any mesh.
 * --report-json FILE: rank 0 writes, at the end, the run's figures as one
 * JSON object (the config, every step's loss, "hsdp", "tokenizer", the
 * validations of --val-every ("val": step, loss, perplexity; "val_loss",
 * "val_perplexity": the last), and per rank the estimate:
 * tensors, the pool's holding, the floor and the peak RSS; the tensor
 * peak, VmHWM, the median step time over the steps after the first, and
 * tokens/s), for scripts (scripts/bench_scale.sh).
 * Exit status: 0 for a run that completed, 2 for bad flags or a size that
 * cannot fit in memory or under the memory cap (and for a --resume folder that is missing, holds
 * no readable index, or disagrees with a flag), 1 for a failure (the
 * message says which; a checkpoint whose files cannot be loaded is one). */
#include "common.h"
#include "checkpoint/checkpoint.h"
#include "text/tokenizer.h"
#include "text/tokens.h"

#include <jansson.h>
#include <dirent.h>

/* The next character's id from the last row of logits (V): the argmax
 * (first of equals) at temperature 0, else a draw from
 * softmax(logits / temperature). */
static int next_token(const float *logits, int V, double temperature, ts_generator *g)
{
    int best = 0;
    for (int v = 1; v < V; v++)
        if (logits[v] > logits[best]) best = v;
    if (temperature <= 0) return best;
    double sum = 0;
    for (int v = 0; v < V; v++) sum += exp(((double)logits[v] - logits[best]) / temperature);
    double u = ((double)ts_generator_random(g) + 0.5) / 4294967296.0 * sum;
    for (int v = 0; v < V; v++) { /* the same terms again: a vocabulary of any size, no array */
        double p = exp(((double)logits[v] - logits[best]) / temperature);
        if (u < p) return v;
        u -= p;
    }
    return V - 1;
}

/* Generates n tokens after the prompt (already mapped to ids) with the
 * sharded model, printing them on rank 0: characters (chars[id]), or with
 * a tokenizer the bytes its ids decode to (drawn among its own ids only,
 * when the model's vocabulary is larger). Every rank runs the same
 * forwards (the model's groups are gathered collectively) and draws the
 * same numbers. */
static int generate(ts_module *model, const char *chars, const ts_tokenizer *tok, int vocab, int seq,
                    const int64_t *prompt, int n_prompt, int n, double temperature, uint64_t seed)
{
    int draw_vocab = tok && ts_tokenizer_vocab_size(tok) < vocab ? ts_tokenizer_vocab_size(tok) : vocab;
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
        ctx[len++] = next_token(logits + (size_t)(T - 1) * (size_t)vocab, draw_vocab, temperature, g);
        ts_tensor_free(y);
        ts_tensor_free(x);
    }
    ts_grad_mode_set(prev);
    const char *what = tok ? "tokens" : "characters";
    if (temperature > 0)
        printf("sample (temperature %g, seed %llu): %d %s after the prompt\n", temperature, (unsigned long long)seed, n,
               what);
    else printf("sample (greedy): %d %s after the prompt\n", n, what);
    int rc = 0;
    if (tok) { /* the ids back to their bytes (int32 for the tokenizer) */
        int32_t *ids32 = malloc((size_t)len * sizeof *ids32);
        char *bytes = NULL;
        size_t nb = 0;
        for (int i = 0; ids32 && i < len; i++) ids32[i] = (int32_t)ctx[i];
        ts_status st = ids32 ? ts_tokenizer_decode(tok, ids32, (size_t)len, &bytes, &nb) : TS_ERR_NO_MEMORY;
        if (st) {
            fprintf(stderr, "train_gpt: --sample: the ids do not decode: %s\n", ts_last_error());
            rc = 1;
        } else {
            fwrite(bytes, 1, nb, stdout);
        }
        ts_tokenizer_buffer_free(bytes);
        free(ids32);
    } else {
        for (int i = 0; i < len; i++) putchar(chars[ctx[i]]);
    }
    putchar('\n');
    fflush(stdout);
    ts_generator_free(g);
    free(logits);
    free(ctx);
    return rc;
}

/* --tokenizer DIR: the vocabulary and merges are DIR/encoder.json and
 * DIR/vocab.bpe (GPT-2's names), DIR/vocab.json and DIR/merges.txt
 * (Hugging Face's), or the one pair STEM.encoder.json and STEM.vocab.bpe
 * in DIR that tools/tokenize --learn writes beside its output; DIR may
 * also be that STEM itself (out/train for out/train.encoder.json). The
 * loaded tokenizer in *tok_out; 0, or -1 after printing why. */
static int load_tokenizer(const char *dir, ts_tokenizer **tok_out)
{
    static const char *const pairs[][2] = {{"encoder.json", "vocab.bpe"}, {"vocab.json", "merges.txt"}};
    char vocab[4200] = "", merges[4200] = "";
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0] && !*vocab; i++) {
        snprintf(vocab, sizeof vocab, "%s/%s", dir, pairs[i][0]);
        snprintf(merges, sizeof merges, "%s/%s", dir, pairs[i][1]);
        if (access(vocab, R_OK) || access(merges, R_OK)) *vocab = '\0';
    }
    if (!*vocab) { /* a stem given whole */
        snprintf(vocab, sizeof vocab, "%s.encoder.json", dir);
        snprintf(merges, sizeof merges, "%s.vocab.bpe", dir);
        if (access(vocab, R_OK) || access(merges, R_OK)) *vocab = '\0';
    }
    DIR *d = *vocab ? NULL : opendir(dir);
    int found = 0;
    for (struct dirent *e; d && (e = readdir(d));) { /* a learned pair STEM.encoder.json, STEM.vocab.bpe */
        size_t n = strlen(e->d_name), k = strlen(".encoder.json");
        if (n <= k || strcmp(e->d_name + n - k, ".encoder.json")) continue;
        char v[4200], m[4200];
        snprintf(v, sizeof v, "%s/%s", dir, e->d_name);
        snprintf(m, sizeof m, "%s/%.*s.vocab.bpe", dir, (int)(n - k), e->d_name);
        if (access(m, R_OK)) continue;
        if (found++) {
            fprintf(stderr,
                    "train_gpt: --tokenizer '%s' holds several learned vocabularies (%s and %s): give the "
                    "one to use as DIR/STEM\n",
                    dir, vocab, v);
            closedir(d);
            return -1;
        }
        snprintf(vocab, sizeof vocab, "%s", v);
        snprintf(merges, sizeof merges, "%s", m);
    }
    if (d) closedir(d);
    if (!*vocab) {
        fprintf(stderr,
                "train_gpt: --tokenizer '%s' holds no encoder.json and vocab.bpe (GPT-2's), no vocab.json "
                "and merges.txt, and no STEM.encoder.json and STEM.vocab.bpe (tools/tokenize --learn)\n",
                dir);
        return -1;
    }
    ts_status st = ts_tokenizer_load(vocab, merges, tok_out);
    if (st) {
        fprintf(stderr, "train_gpt: --tokenizer '%s': %s\n", dir, ts_last_error());
        return -1;
    }
    return 0;
}

/* --data FILE --tokenizer DIR: reads the text and encodes it whole into a
 * token file in memory (ts_token_file_from_ids: uint16, 2 bytes a token),
 * which then trains exactly as a --data-tokens file of the same ids.
 * Every rank does it on its own (docs/tokenizer.md, "Training on a
 * text"): the vocabulary and the size are needed before the world
 * starts, and the ids are the same everywhere. *bytes_out and *s_out: the
 * text's size and the seconds taken. 0, or -1 after printing why. */
static int tokenize_text(const char *path, ts_tokenizer *tok, ts_token_file **tf_out, size_t *bytes_out, double *s_out)
{
    double t0 = ex_now();
    size_t len = 0;
    char *text = ex_read_file("train_gpt", "--data", path, &len);
    if (!text) return -1;
    int32_t *ids = NULL;
    size_t n = 0;
    ts_status st = ts_tokenizer_encode(tok, text, len, &ids, &n);
    free(text);
    if (!st) st = ts_token_file_from_ids(ids, n, path, tf_out);
    ts_tokenizer_buffer_free(ids);
    if (st) {
        fprintf(stderr, "train_gpt: --data '%s' --tokenizer: %s\n", path, ts_last_error());
        return -1;
    }
    *bytes_out = len;
    *s_out = ex_now() - t0;
    return 0;
}

/* --sample's prompt through the tokenizer (default: "<|endoftext|>", where
 * GPT-2's samples start, or a newline when the vocabulary has none), as
 * *n_out int64 ids in *ids_out (malloc'd). 0, or -1 after printing why. */
static int encode_prompt(ts_tokenizer *tok, const char *prompt, int64_t **ids_out, int *n_out)
{
    int32_t eot, *ids = NULL;
    size_t n = 0;
    ts_status st = TS_OK;
    if (!prompt && !ts_tokenizer_token_id(tok, "<|endoftext|>", &eot)) ids = &eot, n = 1;
    else st = ts_tokenizer_encode(tok, prompt ? prompt : "\n", strlen(prompt ? prompt : "\n"), &ids, &n);
    if (!st && (n == 0 || n > INT_MAX)) st = ts_error(TS_ERR_INVALID_ARGUMENT, "the prompt encodes to %zu tokens", n);
    int64_t *out = st ? NULL : malloc(n * sizeof *out);
    for (size_t i = 0; out && i < n; i++) out[i] = ids[i];
    if (ids != &eot) ts_tokenizer_buffer_free(ids);
    if (st || !out) {
        fprintf(stderr, "train_gpt: --prompt: %s\n", st ? ts_last_error() : "out of memory");
        return -1;
    }
    *ids_out = out;
    *n_out = (int)n;
    return 0;
}

/* --hsdp R: the 2-d mesh (replicate R, shard W/R) every group is sharded
 * over (HSDP: each parameter sharded over the W/R ranks of a shard group,
 * replicated over the R shard groups, gradients reduce-scattered then
 * all-reduced); R 0: NULL, the world as a 1-d mesh. Collective. */
static ts_status make_mesh(ts_comm *world, int replicate, ts_mesh **mesh_out)
{
    *mesh_out = NULL;
    if (!replicate) return TS_OK;
    int W = ts_comm_size(world);
    if (W % replicate)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "--hsdp %d does not divide the world of %d ranks", replicate, W);
    int64_t shape[2] = {replicate, W / replicate};
    const char *names[2] = {"replicate", "shard"};
    return ts_mesh_new(world, "cpu", 2, shape, names, mesh_out);
}

/* The process groups the run's collectives go to: the world, and under
 * --hsdp the mesh's shard and replicate groups (n of them in out). */
static int run_groups(ts_comm *world, const ts_mesh *mesh, ts_comm *out[3])
{
    ts_comm *all[3] = {world, mesh ? ts_mesh_group(mesh, "shard") : NULL,
                       mesh ? ts_mesh_group(mesh, "replicate") : NULL};
    int n = 0;
    for (int i = 0; i < 3; i++) { /* a mesh over one rank is the world itself: each group once */
        bool seen = !all[i];
        for (int k = 0; k < n && !seen; k++) seen = out[k] == all[i];
        if (!seen) out[n++] = all[i];
    }
    return n;
}

/* The counters of the run's groups (run_groups), added up. */
static void run_counters(ts_comm *world, const ts_mesh *mesh, ts_comm_counters *out)
{
    ts_comm *g[3];
    int n = run_groups(world, mesh, g);
    memset(out, 0, sizeof *out);
    for (int i = 0; i < n; i++) {
        ts_comm_counters c;
        ts_comm_stats(g[i], &c);
        for (int k = 0; k < TS_COLL_KIND_COUNT; k++) out->calls[k] += c.calls[k], out->bytes[k] += c.bytes[k];
    }
}

/* The mean loss per token over the validation windows of `tf`: rank r of
 * W evaluates windows r, r + W, ... in batches of B (inputs and targets
 * are buffers of B x seq), without gradients and in eval mode; every rank
 * runs the same number of forwards (the groups are gathered
 * collectively), a rank out of windows padding its batch with targets
 * the loss ignores; the sums of the losses and of the tokens are
 * all-reduced, so every rank gets the mean over the whole set. Collective. */
static ts_status validate(ts_module *model, const ts_token_file *tf, ts_comm *world, int B, int seq, int vocab,
                          bool half, int64_t *inputs, int64_t *targets, double *loss_out)
{
    int W = ts_comm_size(world), rank = ts_comm_rank(world);
    size_t n = ts_token_file_val_windows(tf),
           mine = n > (size_t)rank ? (n - (size_t)rank + (size_t)W - 1) / (size_t)W : 0;
    size_t most = (n + (size_t)W - 1) / (size_t)W, rounds = (most + (size_t)B - 1) / (size_t)B;
    double sums[2] = {0, 0}; /* the loss summed over this rank's tokens, and their count */
    ts_status st = TS_OK;
    bool prev = ts_grad_mode_set(false);
    ts_module_eval(model);
    for (size_t r = 0; r < rounds && !st; r++) {
        for (int b = 0; b < B && !st; b++) {
            size_t j = r * (size_t)B + (size_t)b;
            int64_t *x = inputs + (size_t)b * (size_t)seq, *y = targets + (size_t)b * (size_t)seq;
            if (j < mine) {
                st = ts_token_file_val_window(tf, (size_t)rank + j * (size_t)W, x, y);
                sums[1] += seq;
            } else { /* padding: any ids, no target */
                for (int t = 0; t < seq; t++) x[t] = 0, y[t] = -100;
            }
        }
        int64_t is[2] = {B, seq}, ts_[1] = {(int64_t)B * seq}, fs[2] = {(int64_t)B * seq, vocab};
        ts_tensor *x = NULL, *y = NULL, *logits = NULL, *l32 = NULL, *flat = NULL, *loss = NULL;
        double l = 0;
        if (!st) st = ts_tensor_from_data(TS_I64, 2, is, inputs, &x);
        if (!st) st = ts_tensor_from_data(TS_I64, 1, ts_, targets, &y);
        if (!st) st = ts_module_call1(model, x, &logits);
        if (!st && half) st = ts_to_dtype(logits, TS_F32, &l32);
        if (!st) st = ts_reshape(l32 ? l32 : logits, 2, fs, &flat);
        if (!st) st = ts_cross_entropy(flat, y, -100, TS_REDUCTION_SUM, &loss);
        if (!st) st = ts_tensor_item(loss, &l);
        sums[0] += l;
        ts_tensor_free(loss);
        ts_tensor_free(flat);
        ts_tensor_free(l32);
        ts_tensor_free(logits);
        ts_tensor_free(y);
        ts_tensor_free(x);
    }
    ts_module_train(model, true);
    ts_grad_mode_set(prev);
    int64_t two = 2;
    ts_tensor *t = NULL;
    if (!st) st = ts_tensor_from_data(TS_F64, 1, &two, sums, &t);
    if (!st) st = ts_all_reduce(world, t, TS_REDUCE_SUM, NULL);
    if (!st) {
        const double *v = ts_tensor_data(t);
        *loss_out = v[0] / v[1];
    }
    ts_tensor_free(t);
    return st;
}

/* One line: the collectives of one step on this rank, by kind, the bytes
 * given to them (the counters' input bytes) and the bytes this rank sends
 * for them over the rings (all-gather (W-1) x its input; reduce-scatter
 * (W-1)/W of it; all-reduce, a reduce-scatter then an all-gather, twice
 * that; broadcast and send their tensor). */
static void print_comm_summary(ts_comm *world, const ts_mesh *mesh, int steps)
{
    static const char *names[TS_COLL_KIND_COUNT] = {"all_gather", "reduce_scatter", "all_reduce", "broadcast",
                                                    "barrier",    "all_to_all",     "send",       "recv"};
    ts_comm *groups[3];
    int ng = run_groups(world, mesh, groups);
    double calls_k[TS_COLL_KIND_COUNT] = {0}, calls = 0, in = 0, sent = 0;
    for (int i = 0; i < ng; i++) { /* each group's bytes sent by its own size (HSDP: shard and replicate groups) */
        double W = ts_comm_size(groups[i]);
        double sent_factor[TS_COLL_KIND_COUNT] = {0};
        sent_factor[TS_COLL_ALL_GATHER] = W - 1;
        sent_factor[TS_COLL_REDUCE_SCATTER] = (W - 1) / W;
        sent_factor[TS_COLL_ALL_REDUCE] = 2.0 * (W - 1) / W;
        sent_factor[TS_COLL_BROADCAST] = W > 1 ? 1 : 0;
        sent_factor[TS_COLL_ALL_TO_ALL] = (W - 1) / W;
        sent_factor[TS_COLL_SEND] = 1;
        ts_comm_counters c;
        ts_comm_stats(groups[i], &c);
        for (int k = 0; k < TS_COLL_KIND_COUNT; k++) {
            calls_k[k] += (double)c.calls[k];
            calls += (double)c.calls[k];
            in += (double)c.bytes[k];
            sent += sent_factor[k] * (double)c.bytes[k];
        }
    }
    char kinds[512] = "";
    size_t n = 0;
    for (int k = 0; k < TS_COLL_KIND_COUNT; k++)
        if (calls_k[k])
            n +=
                (size_t)snprintf(kinds + n, sizeof kinds - n, "%s%s %.1f", n ? ", " : "", names[k], calls_k[k] / steps);
    char b1[32], b2[32];
    printf("collectives per step on rank 0 of %d: %.1f issued%s%s%s, %s given to them, %s sent by this rank\n",
           ts_comm_size(world), calls / steps, n ? " (" : "", kinds, n ? ")" : "",
           ex_fmt_bytes(in / steps, b1, sizeof b1), ex_fmt_bytes(sent / steps, b2, sizeof b2));
}

/* What --report-json records of the run besides the figures. */
typedef struct report_cfg {
    int layers, dim, heads, seq, vocab, batch, accum, world;
    int64_t n_params;
    const char *param_dtype;
    bool checkpoint_activations, random_tokens;
    int hsdp;               /* --hsdp R (0: a 1-d mesh) */
    const char *tokenizer;  /* --tokenizer DIR, or NULL */
    int n_val;              /* the validations of --val-every this run made: */
    const int *val_step;    /* after which step */
    const double *val_loss; /* the mean validation loss per token */
} report_cfg;

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The median of v[0..n) (sorted in place); 0 for n = 0. */
static double median(double *v, int n)
{
    if (n <= 0) return 0;
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

enum { RANK_FIGS = 8 }; /* per rank: VmHWM, RSS estimate, tensor peak, tensors' estimate, pool, floor, step, tokens/s */

/* --report-json's mesh, tokenizer and validation figures: "hsdp" (R, or
 * 0), "tokenizer" (its folder, or null), and "val" (one object per
 * validation: the step it followed, the mean loss per token and its
 * perplexity), with "val_loss" and "val_perplexity" the last (null
 * without validation). */
static void write_report_data(FILE *f, const report_cfg *c)
{
    fprintf(f, "  \"hsdp\": %d, \"tokenizer\": ", c->hsdp);
    if (c->tokenizer) { /* a JSON string: a path may hold quotes, backslashes, control characters */
        fputc('"', f);
        for (const unsigned char *p = (const unsigned char *)c->tokenizer; *p; p++)
            if (*p == '"' || *p == '\\') fprintf(f, "\\%c", *p);
            else if (*p < 0x20) fprintf(f, "\\u%04x", *p);
            else fputc(*p, f);
        fputc('"', f);
    } else {
        fprintf(f, "null");
    }
    fprintf(f, ",\n  \"val\": [");
    for (int i = 0; i < c->n_val; i++)
        fprintf(f, "%s{\"step\": %d, \"loss\": %.9g, \"perplexity\": %.9g}", i ? ", " : "", c->val_step[i],
                c->val_loss[i], exp(c->val_loss[i]));
    if (c->n_val)
        fprintf(f, "],\n  \"val_loss\": %.9g, \"val_perplexity\": %.9g,\n", c->val_loss[c->n_val - 1],
                exp(c->val_loss[c->n_val - 1]));
    else fprintf(f, "],\n  \"val_loss\": null, \"val_perplexity\": null,\n");
}

/* rank 0's --report-json: the config, the losses, and each rank's row of
 * v (RANK_FIGS figures). 0, or -1 after printing why. */
static int write_report(const char *path, const report_cfg *c, const double *v, int W, const double *losses, int n)
{
    FILE *f = fopen(path, "w");
    if (!f) {
        fprintf(stderr, "train_gpt: --report-json '%s': %s\n", path, strerror(errno));
        return -1;
    }
    double worst = 0; /* the slowest rank's median step sets the pace */
    for (int r = 0; r < W; r++) worst = v[r * RANK_FIGS + 6] > worst ? v[r * RANK_FIGS + 6] : worst;
    fprintf(f,
            "{\n  \"program\": \"train_gpt\",\n  \"layers\": %d, \"dim\": %d, \"heads\": %d, \"seq\": %d, "
            "\"vocab\": %d, \"batch\": %d, \"accum\": %d, \"world_size\": %d,\n  \"n_params\": %lld, "
            "\"param_dtype\": \"%s\", \"checkpoint_activations\": %s, \"random_tokens\": %s,\n"
            "  \"steps\": %d, \"step_s_median_max\": %.6f, \"tokens_per_s\": %.3f,\n  \"losses\": [",
            c->layers, c->dim, c->heads, c->seq, c->vocab, c->batch, c->accum, c->world, (long long)c->n_params,
            c->param_dtype, c->checkpoint_activations ? "true" : "false", c->random_tokens ? "true" : "false", n, worst,
            worst > 0 ? (double)c->accum * c->batch * c->seq * W / worst : 0.0);
    for (int i = 0; i < n; i++) fprintf(f, "%s%.9g", i ? ", " : "", losses[i]);
    fprintf(f, "],\n");
    write_report_data(f, c);
    fprintf(f, "  \"ranks\": [\n");
    for (int r = 0; r < W; r++) {
        const double *x = v + r * RANK_FIGS;
        fprintf(f,
                "    {\"rank\": %d, \"estimate_tensors_bytes\": %.0f, \"estimate_pool_bytes\": %.0f, "
                "\"estimate_floor_bytes\": %.0f, \"estimate_rss_bytes\": %.0f, \"tensor_peak_bytes\": %.0f, "
                "\"vmhwm_bytes\": %.0f, \"step_s_median\": %.6f, \"tokens_per_s\": %.3f}%s\n",
                r, x[3], x[4], x[5], x[1], x[2], x[0], x[6], x[7], r + 1 < W ? "," : "");
    }
    fprintf(f, "  ]\n}\n");
    if (fclose(f)) {
        fprintf(stderr, "train_gpt: --report-json '%s': %s\n", path, strerror(errno));
        return -1;
    }
    return 0;
}

/* One line per rank on rank 0: its peak resident set (VmHWM, from the
 * process's start) beside the estimate (floor + the pool's holding), and
 * its tensor peak (TS_MEM_STORAGE) beside the tensors' estimate. The
 * ranks' figures travel in one all-reduce of a (W, RANK_FIGS) float64
 * tensor, each rank filling its row; with `json`, rank 0 also writes them
 * (write_report), with the median of this rank's step times step_s[0..n)
 * (the first left out when there are more) and its tokens/s at that pace
 * (`tokens` per step). Collective. */
static ts_status print_rank_memory(ts_comm *world, const ts_fsdp_memory_report *me, double *step_s,
                                   const double *losses, int n, double tokens, const char *json, const report_cfg *c)
{
    int W = ts_comm_size(world), rank = ts_comm_rank(world);
    int64_t shape[2] = {W, RANK_FIGS};
    ts_tensor *t;
    TS_TRY(ts_tensor_zeros(TS_F64, 2, shape, &t));
    double *v = ts_tensor_data(t);
    ts_process_memory pm = {0, 0};
    if (ts_process_memory_read(&pm)) pm.peak_rss_bytes = 0; /* no /proc: printed as 0 */
    double med = n > 1 ? median(step_s + 1, n - 1) : median(step_s, n);
    double *row = v + rank * RANK_FIGS;
    row[0] = (double)pm.peak_rss_bytes;
    row[1] = (double)me->rss_peak_bytes;
    row[2] = (double)ts_mem_peak_bytes(TS_MEM_STORAGE);
    row[3] = (double)me->peak_bytes;
    row[4] = (double)me->pool_peak_bytes;
    row[5] = (double)me->floor_bytes;
    row[6] = med;
    row[7] = med > 0 ? tokens / med : 0;
    ts_status st = ts_all_reduce(world, t, TS_REDUCE_SUM, NULL);
    v = ts_tensor_data(t);
    for (int r = 0; r < W && !st; r++) /* MiB with a decimal: the estimate's error shows at any size */
        printf("rank %d: peak RSS %.1f MiB, estimate %.1f MiB (tensors %.1f MiB, estimate %.1f MiB)\n", r,
               v[r * RANK_FIGS] / 1048576.0, v[r * RANK_FIGS + 1] / 1048576.0, v[r * RANK_FIGS + 2] / 1048576.0,
               v[r * RANK_FIGS + 3] / 1048576.0);
    if (!st && json && rank == 0 && write_report(json, c, v, W, losses, n)) st = TS_ERR_IO;
    ts_tensor_free(t);
    return st;
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

/* The short name of a policy dtype for the checkpoint's metadata. */
static const char *mp_name(ts_dtype d)
{
    return d == TS_BF16 ? "bf16" : d == TS_F16 ? "f16" : d == TS_F32 ? "f32" : "none";
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

/* The parameters and buffers of the model: the tensors of a full file. */
static int model_tensors(ts_module *m)
{
    ts_named_params p, b;
    int n = 0;
    if (!ts_module_named_parameters(m, &p)) {
        n += p.n;
        ts_named_params_free(&p);
    }
    if (!ts_module_named_buffers(m, &b)) {
        n += b.n;
        ts_named_params_free(&b);
    }
    return n;
}

/* Fills map/chars from a hex vocabulary ("61622e": 'a', 'b', '.');
 * returns the vocabulary size, or 0 (map all -1) when it is not one. */
static int vocab_from_hex(const char *hex, int map[256], char chars[256])
{
    int vocab = 0;
    size_t hl = strlen(hex);
    for (int k = 0; k < 256; k++) map[k] = -1;
    if (hl % 2) return 0;
    for (size_t i = 0; i + 1 < hl; i += 2) {
        unsigned c;
        if (sscanf(hex + i, "%2x", &c) != 1 || map[c] >= 0) {
            for (int k = 0; k < 256; k++) map[k] = -1;
            return 0;
        }
        chars[vocab] = (char)c;
        map[c] = vocab++;
    }
    return vocab;
}

/* FNV-1a of the training text: a resume checks that it trains on the
 * same text as the run it continues. */
static uint64_t text_hash(const char *text, size_t len)
{
    uint64_t h = 14695981039346656037ull;
    for (size_t i = 0; i < len; i++) h = (h ^ (unsigned char)text[i]) * 1099511628211ull;
    return h;
}

/* Checks, before any work, that a checkpoint folder can be written at
 * `path` (given to `flag`): either it is a folder that accepts a new file,
 * or it does not exist and its parent folder does (probed by creating and
 * removing a file). 0, or -1 after printing why. */
static int check_writable_dir(const char *flag, const char *path)
{
    struct stat sb;
    char probe[4200];
    if (stat(path, &sb) == 0) {
        if (!S_ISDIR(sb.st_mode)) {
            fprintf(stderr,
                    "train_gpt: %s '%s' is not a folder (a sharded checkpoint is a folder; --save-full "
                    "FILE writes one file)\n",
                    flag, path);
            return -1;
        }
        snprintf(probe, sizeof probe, "%s/.train_gpt-write-check-XXXXXX", path);
        int fd = mkstemp(probe);
        if (fd < 0) {
            fprintf(stderr, "train_gpt: %s '%s': the folder is not writable: %s\n", flag, path, strerror(errno));
            return -1;
        }
        close(fd);
        unlink(probe);
        return 0;
    }
    if (errno != ENOENT) {
        fprintf(stderr, "train_gpt: %s '%s': %s\n", flag, path, strerror(errno));
        return -1;
    }
    char file[4200]; /* the folder to create, checked as a new file in its parent */
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/') n--; /* "a/b/" is "a/b" */
    snprintf(file, sizeof file, "%.*s", (int)n, path);
    return ex_check_writable("train_gpt", flag, file);
}

/* The state of the training loop that a checkpoint carries besides the
 * model and AdamW ("extra.<name>", the same on every rank, and
 * "rank_extra.<name>", each rank's own); every value is kept in a tensor
 * of its own, written before a save and read after a load. RNG states are
 * their 5056 bytes (torch.get_rng_state()'s layout) in 632 int64s. */
enum { RNG_WORDS = TS_GENERATOR_STATE_BYTES / 8 };
typedef struct run_state {
    ts_state_dict *extra, *rank_extra;
    ts_tensor *step;     /* int64 (1): optimizer steps taken (the schedule's position) */
    ts_tensor *first;    /* float64 (1): the first step's loss, for the final line */
    ts_tensor *window;   /* float64 (3): the sum and count of losses since the last printed line, the last loss */
    ts_tensor *scaler;   /* float64 (3): f16 grad scaler: scale, growth tracker, steps skipped */
    ts_tensor *data_rng; /* int64 (632): the data-order generator (extra with --global-batch, else rank_extra) */
    ts_tensor *rng;      /* int64 (632): this rank's default generator (dropout) */
} run_state;

static ts_status run_state_new(bool global_data, bool with_scaler, run_state *rs)
{
    memset(rs, 0, sizeof *rs);
    int64_t one = 1, three = 3, words = RNG_WORDS;
    ts_status st;
    if ((st = ts_state_dict_new(&rs->extra)) || (st = ts_state_dict_new(&rs->rank_extra)) ||
        (st = ts_tensor_zeros(TS_I64, 1, &one, &rs->step)) || (st = ts_tensor_zeros(TS_F64, 1, &one, &rs->first)) ||
        (st = ts_tensor_zeros(TS_F64, 1, &three, &rs->window)) ||
        (st = ts_tensor_zeros(TS_F64, 1, &three, &rs->scaler)) ||
        (st = ts_tensor_zeros(TS_I64, 1, &words, &rs->data_rng)) || (st = ts_tensor_zeros(TS_I64, 1, &words, &rs->rng)))
        return st;
    if ((st = ts_state_dict_set(rs->extra, "step", rs->step)) ||
        (st = ts_state_dict_set(rs->extra, "first_loss", rs->first)) ||
        (st = ts_state_dict_set(rs->extra, "loss_window", rs->window)) ||
        (with_scaler && (st = ts_state_dict_set(rs->extra, "grad_scaler", rs->scaler))) ||
        (st = ts_state_dict_set(global_data ? rs->extra : rs->rank_extra, "data_rng", rs->data_rng)) ||
        (st = ts_state_dict_set(rs->rank_extra, "rng", rs->rng)))
        return st;
    return TS_OK;
}

static void run_state_free(run_state *rs)
{
    ts_state_dict_free(rs->extra);
    ts_state_dict_free(rs->rank_extra);
    ts_tensor_free(rs->step);
    ts_tensor_free(rs->first);
    ts_tensor_free(rs->window);
    ts_tensor_free(rs->scaler);
    ts_tensor_free(rs->data_rng);
    ts_tensor_free(rs->rng);
}

/* One recorded flag: its name in the checkpoint's "train_gpt.flags"
 * metadata ("--heads=4 --dim=64 ..."), and the value as this run has it. */
typedef struct rec_flag {
    const char *name;
    char value[64];
} rec_flag;

static bool is_dtype_flag(const ex_flag *fl)
{
    return !strcmp(fl->name, "--param-dtype") || !strcmp(fl->name, "--reduce-dtype");
}

/* A recorded flag's value as "train_gpt.flags" holds it: numbers exactly
 * (%.17g for doubles), dtypes by their short name or "none", other
 * strings as given. */
static void rec_value(const ex_flag *fl, char *buf, size_t cap)
{
    const char *str = fl->kind == EX_FLAG_STRING ? *(const char *const *)fl->value : NULL;
    if (fl->kind == EX_FLAG_INT) snprintf(buf, cap, "%d", *(const int *)fl->value);
    else if (fl->kind == EX_FLAG_U64) snprintf(buf, cap, "%llu", (unsigned long long)*(const uint64_t *)fl->value);
    else if (fl->kind == EX_FLAG_DOUBLE) snprintf(buf, cap, "%.17g", *(const double *)fl->value);
    else if (is_dtype_flag(fl)) snprintf(buf, cap, "%s", str ? mp_name(parse_dtype(str)) : "none");
    else snprintf(buf, cap, "%s", str ? str : "none");
}

/* The value of flag `name` in a "train_gpt.flags" string, into buf; false
 * when absent. */
static bool saved_flag(const char *flags, const char *name, char *buf, size_t cap)
{
    size_t n = strlen(name);
    for (const char *p = flags; (p = strstr(p, name)); p += n) {
        if ((p != flags && p[-1] != ' ') || p[n] != '=') continue;
        const char *v = p + n + 1, *end = strchr(v, ' ');
        size_t len = end ? (size_t)(end - v) : strlen(v);
        if (len >= cap) return false;
        memcpy(buf, v, len);
        buf[len] = '\0';
        return true;
    }
    return false;
}

/* Writes the sharded checkpoint of step `step` into dir: the model,
 * AdamW, and the run state (the loop's counters, the scaler, every rank's
 * RNG states), with the metadata --resume checks. Collective. */
static ts_status save_sharded(const char *dir, ts_module *model, ts_optim *opt, const ts_grad_scaler *scaler,
                              int skipped, const ts_generator *data_rng, run_state *rs, int step, double first,
                              double window, int window_n, double last, const ts_ckpt_meta *meta, int n_meta)
{
    *(int64_t *)ts_tensor_data(rs->step) = step;
    *(double *)ts_tensor_data(rs->first) = first;
    double *w = ts_tensor_data(rs->window), *g = ts_tensor_data(rs->scaler);
    w[0] = window;
    w[1] = window_n;
    w[2] = last;
    g[0] = ts_grad_scaler_get_scale(scaler);
    g[1] = (double)ts_grad_scaler_growth_tracker(scaler);
    g[2] = skipped;
    ts_generator_get_state(data_rng, ts_tensor_data(rs->data_rng));
    ts_generator_get_state(ts_default_generator(), ts_tensor_data(rs->rng));
    ts_ckpt_options co = ts_ckpt_options_default();
    co.optim = opt;
    co.extra = rs->extra;
    co.rank_extra = rs->rank_extra;
    co.metadata = meta;
    co.n_metadata = n_meta;
    ts_status st = ts_ckpt_save(dir, model, &co);
    if (!st) printf("saved a sharded checkpoint of step %d to %s\n", step, dir);
    return st;
}

/* --init-from-hf FILE (docs/gpt2-weights.md): the model takes the shape
 * of a Hugging Face GPT-2 file (ts_ckpt_gpt2_config: layers, width,
 * vocabulary and positions from its tensors, the tied head and the tanh
 * GELU), its heads being --heads or GPT-2's 64 wide. A shape flag given
 * with another value is refused, naming both; --seq must fit the file's
 * positions. The data must be token ids of the file's vocabulary
 * (--data-tokens, or --vocab N random ids): characters are not. Writes
 * *hf_out and the sizes; returns 0, or 2 after a message. */
static int init_from_hf_flags(const char *file, const ex_flag *flags, int nflags, bool token_data, int *seq,
                              int *layers, int *heads, int *dim, int *vocab, ts_gpt_config *hf_out)
{
    ts_gpt_config c;
    ts_status st = ts_ckpt_gpt2_config(file, &c);
    if (st) {
        fprintf(stderr, "train_gpt: --init-from-hf '%s': %s: %s\n", file, ts_status_name(st), ts_last_error());
        return 2;
    }
    if (!token_data) {
        fprintf(stderr,
                "train_gpt: --init-from-hf '%s' needs token ids of its vocabulary (%lld): give --data-tokens "
                "FILE.bin, --data FILE.txt --tokenizer DIR or --vocab %lld (random ids), not characters\n",
                file, (long long)c.vocab_size, (long long)c.vocab_size);
        return 2;
    }
    static const char *const names[4] = {"--layers", "--dim", "--vocab", "--heads"};
    int *vals[4] = {layers, dim, vocab, heads};
    long long file_vals[4] = {c.n_layer, c.d_model, c.vocab_size, c.n_head};
    for (int i = 0; i < 4; i++) {
        bool given = ex_flag_given(flags, nflags, names[i]);
        if (i == 3 && given) break; /* the head count is not in the weights: --heads is the user's to give */
        if (given && *vals[i] != file_vals[i]) {
            fprintf(stderr, "train_gpt: %s %d, but --init-from-hf '%s' has %s %lld (drop %s: the file sets it)\n",
                    names[i], *vals[i], file, names[i], file_vals[i], names[i]);
            return 2;
        }
        if (i == 3 && file_vals[i] == 0) {
            fprintf(stderr,
                    "train_gpt: --init-from-hf '%s': its width %lld is not a multiple of GPT-2's 64-wide "
                    "heads: give --heads H\n",
                    file, (long long)c.d_model);
            return 2;
        }
        if (file_vals[i] > INT_MAX) {
            fprintf(stderr, "train_gpt: --init-from-hf '%s': %s %lld is too large\n", file, names[i], file_vals[i]);
            return 2;
        }
        *vals[i] = (int)file_vals[i];
    }
    if (!ex_flag_given(flags, nflags, "--seq") && *seq > c.block_size) *seq = (int)c.block_size;
    if (*seq > c.block_size) {
        fprintf(stderr, "train_gpt: --seq %d, but --init-from-hf '%s' has %lld positions\n", *seq, file,
                (long long)c.block_size);
        return 2;
    }
    *hf_out = c;
    return 0;
}

/* The model's config: the flags' sizes, or a GPT-2 file's (hf) shape. */
static ts_gpt_config model_config(const ts_gpt_config *hf, int vocab, int seq, int layers, int heads, int dim)
{
    ts_gpt_config c = hf ? *hf : ts_gpt_config_default();
    c.vocab_size = vocab;
    c.block_size = hf ? hf->block_size : seq;
    c.n_layer = layers;
    c.n_head = heads;
    c.d_model = dim;
    return c;
}

/* ------------------------------------------------ schedule and progress */

/* --warmup's help, which says why the default is what it is. */
#define WARMUP_HELP \
    "steps of linear warmup, LR/N to LR (default max(steps/10, min(100, steps/4)): at GPT-2-small's shape, " \
    "--layers 12 --dim 768, and LR 3e-3 the loss rose above its first value with 0 or 10 warmup steps, not with " \
    "25 or 50)"

/* The default --warmup for a run of `steps` steps: a quarter of the run
 * up to 100 steps, or a tenth of a longer one. Measured on a text of
 * 278 KB (README and docs/), LR 3e-3, batch 8 x 64, losses of steps 1-4:
 * --layers 12 --dim 768 --heads 12: warmup 0: 4.85 5.50 5.39 5.16;
 * 10 (of 40): 4.85 4.39 4.96 5.11; 25 (of 100): 4.85 3.94 4.20 4.22;
 * 50 (of 100): 4.85 4.10 3.59 3.80 (step 4's batch is a harder one in
 * every run). --layers 4 --dim 512: warmup 0 stayed at 4.71 for steps
 * 2-4 and ended 40 steps at 3.13, against 2.75-2.77 with 5, 10 or 20.
 * --layers 4 --dim 256 did not rise with any (0 to 20). */
static int default_warmup(int steps)
{
    int tenth = steps / 10, quarter = steps / 4 < 100 ? steps / 4 : 100;
    return tenth > quarter ? tenth : quarter;
}

/* The learning-rate schedule of --schedule `name` (optim.h's kinds; every
 * one after a linear warmup of `warmup` steps): constant at `lr`, or a
 * linear, cosine or warmup-stable-decay (the last `fraction` of the steps)
 * decay to lr / 10 at `steps`. 0, or 2 after printing why. */
static int make_schedule(const char *name, int warmup, double fraction, bool fraction_given, double lr, int steps,
                         ts_lr_schedule *out)
{
    static const struct {
        const char *name;
        ts_lr_kind kind;
    } kinds[] = {{"constant", TS_LR_WARMUP_CONSTANT},
                 {"linear", TS_LR_WARMUP_LINEAR},
                 {"cosine", TS_LR_WARMUP_COSINE},
                 {"wsd", TS_LR_WARMUP_STABLE_DECAY}};
    int k = -1;
    for (int i = 0; i < (int)(sizeof kinds / sizeof kinds[0]); i++)
        if (!strcmp(name, kinds[i].name)) k = i;
    if (k < 0) {
        fprintf(stderr, "train_gpt: --schedule '%s' (must be constant, linear, cosine or wsd)\n", name);
        return 2;
    }
    if (fraction_given && kinds[k].kind != TS_LR_WARMUP_STABLE_DECAY) {
        fprintf(stderr, "train_gpt: --decay-fraction goes with --schedule wsd (not %s)\n", name);
        return 2;
    }
    if (warmup > steps) {
        fprintf(stderr, "train_gpt: --warmup %d is more than --steps %d\n", warmup, steps);
        return 2;
    }
    ts_lr_schedule s = {.kind = kinds[k].kind,
                        .base_lr = lr,
                        .warmup_steps = warmup,
                        .total_steps = steps,
                        .min_lr = lr / 10,
                        .decay_fraction = fraction};
    if (ts_lr_schedule_check(&s)) {
        fprintf(stderr, "train_gpt: --schedule %s: %s\n", name, ts_last_error());
        return 2;
    }
    *out = s;
    return 0;
}

/* Whether a recorded flag shapes the learning-rate schedule (a --resume
 * refuses a change of one: the schedule would move). */
static bool moves_schedule(const char *flag)
{
    return !strcmp(flag, "--lr") || !strcmp(flag, "--steps") || !strcmp(flag, "--schedule") ||
        !strcmp(flag, "--warmup") || !strcmp(flag, "--decay-fraction");
}

/* A checkpoint written before --schedule and --warmup existed trained
 * with warmup + cosine and steps / 10 + 1 warmup steps: the value it
 * implies for `flag` (into buf), or false for a flag it implies nothing
 * about (--decay-fraction: cosine does not read it). */
static bool legacy_schedule_flag(const char *flag, int steps, char *buf, size_t cap)
{
    if (!strcmp(flag, "--schedule")) return snprintf(buf, cap, "cosine") > 0;
    if (!strcmp(flag, "--warmup")) return snprintf(buf, cap, "%d", steps / 10 + 1) > 0;
    return false;
}

/* What a step line and a --metrics line report of one step. */
typedef struct step_report {
    int step, steps;  /* the steps done (1-based), of --steps */
    double loss, lr;  /* the loss averaged over the ranks; the lr the step used */
    double grad_norm; /* before clipping; NaN when not computed (an f16 step skipped for inf/NaN) */
    double seconds;   /* the step's time on rank 0 (validation and saving not included) */
    double tokens;    /* the step's tokens on all ranks */
    double elapsed;   /* seconds since the training loop started (this process) */
    double mem[3];    /* max over the ranks: peak tensor bytes, resident set now, peak resident set */
    double val_loss;  /* NaN: no validation this step */
} step_report;

/* The maximum over the ranks of this rank's tensor peak (TS_MEM_STORAGE),
 * resident set now and peak resident set (VmRSS, VmHWM; 0 without /proc),
 * into mem[3]: one all-reduce of 3 doubles. Collective. */
static ts_status memory_max_over_ranks(ts_comm *world, double mem[3])
{
    ts_process_memory pm = {0, 0};
    if (ts_process_memory_read(&pm)) pm.rss_bytes = pm.peak_rss_bytes = 0;
    double v[3] = {(double)ts_mem_peak_bytes(TS_MEM_STORAGE), (double)pm.rss_bytes, (double)pm.peak_rss_bytes};
    int64_t three = 3;
    ts_tensor *t = NULL;
    ts_status st = ts_tensor_from_data(TS_F64, 1, &three, v, &t);
    if (!st) st = ts_all_reduce(world, t, TS_REDUCE_MAX, NULL);
    if (!st) memcpy(mem, ts_tensor_data(t), sizeof v);
    ts_tensor_free(t);
    return st;
}

/* A duration for people: "3.21ms", "420ms", "4.20s", "37.0s", "4m05s", "2h03m". */
static const char *fmt_duration(double s, char *buf, size_t cap)
{
    if (!(s >= 0) || s > 1e9) snprintf(buf, cap, "?");
    else if (s == 0) snprintf(buf, cap, "0s");
    else if (s < 0.01) snprintf(buf, cap, "%.2fms", s * 1e3);
    else if (s < 1) snprintf(buf, cap, "%.0fms", s * 1e3);
    else if (s < 10) snprintf(buf, cap, "%.2fs", s);
    else if (s < 60) snprintf(buf, cap, "%.1fs", s);
    else if (s < 3600) snprintf(buf, cap, "%dm%02ds", (int)(s / 60), (int)fmod(s, 60));
    else snprintf(buf, cap, "%dh%02dm", (int)(s / 3600), (int)fmod(s / 60, 60));
    return buf;
}

/* A step line: "step N/STEPS  loss L  (mean of last K: M)" (the part
 * tools/trace_plot --loss reads, and the tests compare across resumes),
 * then the lr, the mean step time since the last line, the ETA (this
 * run's wall time per step so far, validation included, times the steps
 * left until `end`), the tokens/s of all ranks since the loop started,
 * and the memory maxima over the ranks. */
static void print_step_line(const step_report *r, int window_n, double window_mean, double step_s_mean, int start,
                            int end, double run_tokens, int W)
{
    char eta[32], per[32];
    int done = r->step - start;
    printf("step %4d/%d  loss %.4f  (mean of last %d: %.4f)  lr %.2e  %s/step  ETA %s  %.0f tokens/s global  "
           "peak tensors %.1f MiB  peak rss %.1f MiB (max over %d rank%s)\n",
           r->step, r->steps, r->loss, window_n, window_mean, r->lr, fmt_duration(step_s_mean, per, sizeof per),
           fmt_duration(done > 0 ? r->elapsed / done * (end - r->step) : NAN, eta, sizeof eta),
           r->elapsed > 0 ? run_tokens / r->elapsed : 0.0, r->mem[0] / 1048576.0, r->mem[2] / 1048576.0, W,
           W > 1 ? "s" : "");
}

/* The end's timing line: the training loop's wall time (validation and
 * checkpoints included), the mean of this rank's step times step_s[0..n)
 * and the tokens/s of all ranks over the loop. */
static void print_run_time(double total, const double *step_s, int n, double tokens)
{
    double sum = 0;
    for (int i = 0; i < n; i++) sum += step_s[i];
    char b[32];
    printf("time: %d step%s in %s (%.3f s), mean step %.4f s on rank 0, %.0f tokens/s global\n", n, n == 1 ? "" : "s",
           fmt_duration(total, b, sizeof b), total, n > 0 ? sum / n : 0.0, total > 0 ? tokens / total : 0.0);
}

/* Rank 0 opens --metrics `path`, appending on a resume (the resumed steps'
 * lines follow the earlier run's; a step the earlier run took after its
 * checkpoint appears twice, the later line being the resumed run's), and
 * every rank learns whether it could: one all-reduce, so that all stop
 * together. *out: the file on rank 0, NULL elsewhere. TS_ERR_IO after
 * rank 0 printed why. Collective. */
static ts_status metrics_open(ts_comm *world, const char *path, bool append, FILE **out)
{
    FILE *f = NULL;
    double failed = 0;
    if (ts_comm_rank(world) == 0 && !(f = fopen(path, append ? "a" : "w"))) {
        fprintf(stderr, "train_gpt: --metrics '%s': %s\n", path, strerror(errno));
        failed = 1;
    }
    int64_t one = 1;
    ts_tensor *t = NULL;
    ts_status st = ts_tensor_from_data(TS_F64, 1, &one, &failed, &t);
    if (!st) st = ts_all_reduce(world, t, TS_REDUCE_MAX, NULL);
    if (!st && *(const double *)ts_tensor_data(t) > 0) st = TS_ERR_IO;
    ts_tensor_free(t);
    if (st && f) fclose(f);
    *out = st ? NULL : f;
    return st;
}

/* A JSON number, or null for NaN and infinities (JSON has none). */
static json_t *json_number_or_null(double v) { return isfinite(v) ? json_real(v) : json_null(); }

/* One --metrics line (rank 0): the step's object, flushed. Fields:
 * step, loss, lr, grad_norm, tokens_per_s (the step's, all ranks),
 * seconds, elapsed_s, peak_tensor_bytes, rss_bytes, peak_rss_bytes (max
 * over the ranks), and val_loss when validation ran after this step. 0,
 * or -1 after printing why. */
static int metrics_write(FILE *f, const char *path, const step_report *r)
{
    json_t *o = json_object();
    int bad = !o;
    bad |= json_object_set_new(o, "step", json_integer(r->step));
    bad |= json_object_set_new(o, "loss", json_number_or_null(r->loss));
    bad |= json_object_set_new(o, "lr", json_number_or_null(r->lr));
    bad |= json_object_set_new(o, "grad_norm", json_number_or_null(r->grad_norm));
    bad |= json_object_set_new(o, "tokens_per_s", json_number_or_null(r->seconds > 0 ? r->tokens / r->seconds : NAN));
    bad |= json_object_set_new(o, "seconds", json_number_or_null(r->seconds));
    bad |= json_object_set_new(o, "elapsed_s", json_number_or_null(r->elapsed));
    bad |= json_object_set_new(o, "peak_tensor_bytes", json_integer((json_int_t)r->mem[0]));
    bad |= json_object_set_new(o, "rss_bytes", json_integer((json_int_t)r->mem[1]));
    bad |= json_object_set_new(o, "peak_rss_bytes", json_integer((json_int_t)r->mem[2]));
    if (!isnan(r->val_loss)) bad |= json_object_set_new(o, "val_loss", json_number_or_null(r->val_loss));
    bad = bad || json_dumpf(o, f, JSON_COMPACT | JSON_PRESERVE_ORDER) || fputc('\n', f) == EOF || fflush(f);
    json_decref(o);
    if (bad) fprintf(stderr, "train_gpt: --metrics '%s': cannot write step %d: %s\n", path, r->step, strerror(errno));
    return bad ? -1 : 0;
}

int main(int argc, char **argv)
{
    ts_launch_rank_guard();
    const char *data = NULL, *save = NULL, *save_full = NULL, *resume = NULL, *load = NULL, *prompt = NULL;
    const char *param_dtype_s = NULL, *reduce_dtype_s = NULL;
    int steps = 300, batch = 8, global_batch = 0, seq = 64, layers = 2, heads = 4, dim = 64, sample = 0;
    int save_every = 0, stop_after = 0;
    double lr = 3e-3, temperature = 0;
    uint64_t seed = 1337;
    const char *offload = "none";
    int pin_memory = 1;
    int accum = 1; /* gradient accumulation: microbatches per step */
    const char *accum_mode = "nosync";
    const char *init = "deferred";
    int rand_vocab = 0;             /* --vocab N: random token ids in [0, N) */
    int data_batches = 0;           /* --data-batches K: with --vocab, K batches cycled (0: a fresh one every step) */
    const char *report_json = NULL; /* --report-json FILE */
    const char *data_tokens = NULL; /* --data-tokens FILE.bin: llm.c's token file */
    int val_every = 0;              /* --val-every N: validation loss every N steps */
    int val_tokens = -1;        /* --val-tokens K: the file's last K tokens held out (-1: a tenth with --val-every) */
    const char *init_hf = NULL; /* --init-from-hf FILE: a Hugging Face GPT-2 file's shape and weights */
    ts_gpt_config hf_cfg = {0}; /* its config */
    const char *schedule = "cosine";  /* --schedule: the lr after the warmup */
    int warmup = -1;                  /* --warmup N (-1: default_warmup(steps)) */
    double decay_fraction = 0.2;      /* --decay-fraction F: wsd's share of the steps that decays */
    const char *metrics = NULL;       /* --metrics FILE.jsonl */
    const char *tokenizer_dir = NULL; /* --tokenizer DIR: --data tokenized at start, --sample decoded */
    int hsdp = 0;                     /* --hsdp R: a (replicate R, shard W/R) mesh (0: 1-d) */
    ex_flag flags[] = {
        {"--data", "FILE", EX_FLAG_STRING, &data, 0, 0, false,
         "train on this text file, its characters or with --tokenizer its tokens (default: a built-in grammar corpus)",
         false},
        {"--steps", "N", EX_FLAG_INT, &steps, 1, INT_MAX, false, "optimizer steps", false},
        {"--batch", "B", EX_FLAG_INT, &batch, 1, 1 << 20, false, "sequences per rank and step", false},
        {"--global-batch", "G", EX_FLAG_INT, &global_batch, 1, 1 << 20, false,
         "sequences per step from one data order shared by the ranks, G/W each (instead of --batch)", false},
        {"--seq", "T", EX_FLAG_INT, &seq, 2, 1 << 20, false, "characters per sequence (the context length)", false},
        {"--layers", "L", EX_FLAG_INT, &layers, 1, 1 << 16, false, "transformer blocks", false},
        {"--heads", "H", EX_FLAG_INT, &heads, 1, 1 << 16, false, "attention heads (dividing --dim)", false},
        {"--dim", "D", EX_FLAG_INT, &dim, 1, 1 << 24, false, "model width", false},
        {"--lr", "LR", EX_FLAG_DOUBLE, &lr, 0, 10, true,
         "peak learning rate (reached after --warmup; --schedule says what follows)", false},
        {"--schedule", "constant|linear|cosine|wsd", EX_FLAG_STRING, &schedule, 0, 0, false,
         "after the warmup: LR constant, a linear or cosine decay to LR/10 at --steps, or wsd (LR, then linear to "
         "LR/10 over the last --decay-fraction of the steps)",
         false},
        {"--warmup", "N", EX_FLAG_INT, &warmup, 0, INT_MAX, false, WARMUP_HELP, false},
        {"--decay-fraction", "F", EX_FLAG_DOUBLE, &decay_fraction, 0, 1, false,
         "--schedule wsd: the last F of the steps decay", false},
        {"--seed", "S", EX_FLAG_U64, &seed, 0, 18446744073709551615.0, false, "initialization, batches and sampling",
         false},
        {"--save", "DIR", EX_FLAG_STRING, &save, 0, 0, false, "write a sharded checkpoint (a folder) at the end",
         false},
        {"--save-every", "N", EX_FLAG_INT, &save_every, 1, INT_MAX, false, "with --save: also after every N steps",
         false},
        {"--stop-after", "K", EX_FLAG_INT, &stop_after, 1, INT_MAX, false,
         "end this run after step K of --steps (the schedule still spans --steps; --save, then --resume)", false},
        {"--resume", "DIR", EX_FLAG_STRING, &resume, 0, 0, false,
         "continue exactly from a sharded checkpoint written by --save", false},
        {"--save-full", "FILE", EX_FLAG_STRING, &save_full, 0, 0, false,
         "write the full model (one safetensors file, for PyTorch) at the end", false},
        {"--load", "FILE", EX_FLAG_STRING, &load, 0, 0, false, "start from a full checkpoint written by --save-full",
         false},
        {"--sample", "N", EX_FLAG_INT, &sample, 1, 1 << 20, false,
         "with --load: generate N characters instead of training", false},
        {"--temperature", "T", EX_FLAG_DOUBLE, &temperature, 0, 100, false,
         "--sample: 0 picks the likeliest character, above 0 samples", false},
        {"--prompt", "TEXT", EX_FLAG_STRING, &prompt, 0, 0, false,
         "--sample: the text to continue (default: the corpus's first character)", false},
        {"--offload", "none|cpu", EX_FLAG_STRING, &offload, 0, 0, false,
         "cpu: CPUOffloadPolicy on every group (host shards, gradients, optimizer state)", false},
        {"--pin-memory", "0|1", EX_FLAG_INT, &pin_memory, 0, 1, false,
         "--offload cpu: pin the host shards and gradients", false},
        {"--param-dtype", "bf16|f16|f32", EX_FLAG_STRING, &param_dtype_s, 0, 0, false,
         "mixed precision: all-gather and compute in this dtype (float32 master weights)", false},
        {"--reduce-dtype", "bf16|f16|f32", EX_FLAG_STRING, &reduce_dtype_s, 0, 0, false,
         "mixed precision: reduce the gradients in this dtype (default: the param dtype)", false},
        {"--init", "deferred|eager", EX_FLAG_STRING, &init, 0, 0, false,
         "deferred: build on the meta device, shard, then materialize this rank's rows (default); eager: build whole, "
         "then shard",
         false},
        {"--accum", "K", EX_FLAG_INT, &accum, 1, 1 << 16, false,
         "gradient accumulation: K microbatches of --batch sequences per optimizer step", false},
        {"--accum-mode", "nosync|sync", EX_FLAG_STRING, &accum_mode, 0, 0, false,
         "--accum: nosync reduces once, on the last microbatch (more memory); sync reduce-scatters every microbatch",
         false},
        {"--vocab", "N", EX_FLAG_INT, &rand_vocab, 2, 1 << 24, false,
         "train on random token ids in [0, N) (a seeded stream) instead of text, e.g. 50257 for GPT-2's; with "
         "--data-tokens: the file's vocabulary size",
         false},
        {"--data-batches", "K", EX_FLAG_INT, &data_batches, 1, INT_MAX, false,
         "with --vocab: cycle through the same K random batches (1: one batch every step, which the model can learn)",
         false},
        {"--report-json", "FILE", EX_FLAG_STRING, &report_json, 0, 0, false,
         "rank 0 writes the run's figures (estimate, peaks, step time, tokens/s per rank) as JSON at the end", false},
        {"--data-tokens", "FILE.bin", EX_FLAG_STRING, &data_tokens, 0, 0, false,
         "train on llm.c's token file (tools/tokenize; vocabulary 50257, or --vocab N), memory-mapped", false},
        {"--val-every", "N", EX_FLAG_INT, &val_every, 1, INT_MAX, false,
         "with --data-tokens or --tokenizer: print the validation loss and perplexity every N steps", false},
        {"--val-tokens", "K", EX_FLAG_INT, &val_tokens, 0, INT_MAX, false,
         "with --data-tokens or --tokenizer: hold out the last K tokens for validation (default with --val-every: a "
         "tenth)",
         false},
        {"--tokenizer", "DIR", EX_FLAG_STRING, &tokenizer_dir, 0, 0, false,
         "GPT-2 BPE files (encoder.json, vocab.bpe; or tokenize --learn's): --data is tokenized at start, --sample "
         "decoded",
         false},
        {"--hsdp", "R", EX_FLAG_INT, &hsdp, 1, 1 << 16, false,
         "HSDP: a 2-d mesh, parameters sharded over W/R ranks and replicated R times (R divides W)", false},
        {"--init-from-hf", "FILE", EX_FLAG_STRING, &init_hf, 0, 0, false,
         "start from a Hugging Face GPT-2 safetensors file (its shape; fine-tune on --data-tokens)", false},
        {"--metrics", "FILE.jsonl", EX_FLAG_STRING, &metrics, 0, 0, false,
         "rank 0 writes a JSON object per step (loss, lr, grad norm, tokens/s, time, memory, validation loss; "
         "tools/trace_plot --metrics plots it), appended on --resume",
         false},
    };
    enum { NFLAGS = sizeof flags / sizeof flags[0] };
    bool ckpt_act = false, ignore_cap = false; /* switches without value: taken out before the flags are parsed */
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--checkpoint-activations") || !strcmp(argv[i], "--ignore-memory-cap")) {
            *(!strcmp(argv[i], "--checkpoint-activations") ? &ckpt_act : &ignore_cap) = true;
            memmove(&argv[i], &argv[i + 1], (size_t)(argc - i) * sizeof *argv);
            argc--, i--;
        }
    ex_parse_flags(argc, argv,
                   "Trains a character-level GPT with fully_shard (one FSDP group per block, then the root), alone\n"
                   "or on the ranks of tsrun --nproc-per-node N; or, with --load FILE --sample N, generates text.\n"
                   "--checkpoint-activations (no value): checkpoint every block (recompute in backward).\n"
                   "--ignore-memory-cap (no value): run even when the estimated peak per rank exceeds the memory\n"
                   "cap (TS_MEMORY_PER_RANK from tsrun --memory-per-rank, else the process's cgroup limit).",
                   flags, NFLAGS);
    bool sample_flags = ex_flag_given(flags, NFLAGS, "--temperature") || ex_flag_given(flags, NFLAGS, "--prompt");
    if (strcmp(offload, "none") != 0 && strcmp(offload, "cpu") != 0) {
        fprintf(stderr, "train_gpt: --offload '%s' (must be none or cpu)\n", offload);
        return 2;
    }
    bool offload_cpu = strcmp(offload, "cpu") == 0;
    if (strcmp(init, "deferred") != 0 && strcmp(init, "eager") != 0) {
        fprintf(stderr, "train_gpt: --init '%s' (must be deferred or eager)\n", init);
        return 2;
    }
    bool deferred = strcmp(init, "deferred") == 0;
    if (strcmp(accum_mode, "nosync") != 0 && strcmp(accum_mode, "sync") != 0) {
        fprintf(stderr, "train_gpt: --accum-mode '%s' (must be nosync or sync)\n", accum_mode);
        return 2;
    }
    if (!offload_cpu && ex_flag_given(flags, NFLAGS, "--pin-memory")) {
        fprintf(stderr, "train_gpt: --pin-memory goes with --offload cpu\n");
        return 2;
    }
    if (sample && !load) {
        fprintf(stderr, "train_gpt: --sample needs --load FILE (a checkpoint written by --save-full)\n");
        return 2;
    }
    if (sample_flags && !sample) {
        fprintf(stderr, "train_gpt: --temperature and --prompt go with --sample N\n");
        return 2;
    }
    if (sample && (save || save_full || resume)) {
        fprintf(stderr, "train_gpt: --sample does not train, so there is nothing to %s\n",
                resume     ? "--resume"
                    : save ? "--save"
                           : "--save-full");
        return 2;
    }
    if (save_every && !save) {
        fprintf(stderr, "train_gpt: --save-every %d needs --save DIR (the folder to write)\n", save_every);
        return 2;
    }
    if (resume && load) {
        fprintf(stderr, "train_gpt: --resume continues a run and --load starts one from a full file: give one\n");
        return 2;
    }
    bool tokens_mode = data_tokens || (data && tokenizer_dir); /* token ids: a file's, or the text's tokenized */
    bool rand_mode = rand_vocab && !tokens_mode; /* --vocab N alone: random ids; with tokens, their vocabulary */
    if (tokenizer_dir && (data_tokens || (!data && !sample))) {
        fprintf(stderr,
                "train_gpt: --tokenizer '%s' goes with --data FILE.txt (tokenized at start) or --load FILE "
                "--sample N (decoded)%s\n",
                tokenizer_dir, data_tokens ? ", not with --data-tokens (already tokenized)" : "");
        return 2;
    }
    if (data_tokens && (data || sample)) {
        fprintf(stderr, "train_gpt: --data-tokens '%s' does not go with %s\n", data_tokens,
                data ? "--data (give one: a text, or a token file)" : "--sample (sampling decodes characters only)");
        return 2;
    }
    if (!tokens_mode && (val_every || ex_flag_given(flags, NFLAGS, "--val-tokens"))) {
        fprintf(stderr,
                "train_gpt: --val-every and --val-tokens go with --data-tokens FILE.bin or --data FILE.txt "
                "--tokenizer DIR (a validation split of the tokens)\n");
        return 2;
    }
    if (rand_mode && (data || load || resume || sample || save || save_full)) {
        fprintf(stderr, "train_gpt: --vocab %d trains a new model on random token ids: it does not go with %s\n",
                rand_vocab,
                data         ? "--data (a text has its own vocabulary)"
                    : load   ? "--load"
                    : resume ? "--resume"
                    : sample ? "--sample"
                    : save   ? "--save"
                             : "--save-full");
        return 2;
    }
    if (data_batches && !rand_mode) {
        fprintf(stderr, "train_gpt: --data-batches %d goes with --vocab N (random token ids)\n", data_batches);
        return 2;
    }
    if (global_batch && ex_flag_given(flags, NFLAGS, "--batch")) {
        fprintf(stderr,
                "train_gpt: --batch %d and --global-batch %d: give one (--global-batch G gives each of W "
                "ranks G/W sequences)\n",
                batch, global_batch);
        return 2;
    }
    if (init_hf && (load || sample)) {
        fprintf(stderr, "train_gpt: --init-from-hf '%s' does not go with %s\n", init_hf,
                load ? "--load (give one file to start from)" : "--sample");
        return 2;
    }
    if (init_hf &&
        (ex_check_regular("train_gpt", "--init-from-hf", init_hf) ||
         init_from_hf_flags(init_hf, flags, NFLAGS, tokens_mode || rand_vocab, &seq, &layers, &heads, &dim, &rand_vocab,
                            &hf_cfg)))
        return 2;
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
    if (load && ex_check_regular("train_gpt", "--load", load)) return 2;
    if (save_full && ex_check_writable("train_gpt", "--save-full", save_full)) return 2;
    if (save && check_writable_dir("--save", save)) return 2;
    if (report_json && ex_check_writable("train_gpt", "--report-json", report_json)) return 2;
    if (metrics && ex_check_writable("train_gpt", "--metrics", metrics)) return 2;

    /* The flags that shape the model, the schedule and the data order, as
     * a --save records them ("--heads=4 --lr=0.003 ..."): --resume takes
     * those not given and refuses those given otherwise. */
    static const char *const recorded[] = {
        "--seq",        "--layers",     "--heads",    "--dim",    "--param-dtype",   "--reduce-dtype",
        "--lr",         "--steps",      "--seed",     "--batch",  "--global-batch",  "--accum",
        "--accum-mode", "--val-tokens", "--schedule", "--warmup", "--decay-fraction"};
    enum { NREC = sizeof recorded / sizeof recorded[0] };
    char *saved_flags = NULL, *saved_text = NULL, *saved_vocab = NULL;
    if (resume) {
        struct stat sb;
        if (stat(resume, &sb) != 0 || !S_ISDIR(sb.st_mode)) {
            fprintf(stderr, "train_gpt: --resume '%s': %s\n", resume,
                    stat(resume, &sb) != 0 ? strerror(errno) : "is not a folder (a checkpoint written by --save DIR)");
            return 2;
        }
        ts_status st = ts_ckpt_metadata(resume, "train_gpt.flags", &saved_flags);
        if (!st) st = ts_ckpt_metadata(resume, "train_gpt.text", &saved_text);
        if (!st) st = ts_ckpt_metadata(resume, "train_gpt.vocab", &saved_vocab);
        if (st) {
            fprintf(stderr, "train_gpt: --resume '%s' is not a checkpoint of train_gpt --save: %s: %s\n", resume,
                    ts_status_name(st), ts_last_error());
            free(saved_flags);
            free(saved_text);
            return 2;
        }
        for (int i = 0; i < NREC; i++) {
            ex_flag *fl = NULL;
            for (int k = 0; k < NFLAGS; k++)
                if (!strcmp(flags[k].name, recorded[i])) fl = &flags[k];
            static char adopted[NREC][64]; /* adopted strings outlive main's use of them */
            char *was = adopted[i], now[64];
            bool found = saved_flag(saved_flags, fl->name, was, sizeof adopted[i]);
            if (!found && !strcmp(fl->name, "--val-tokens")) continue;     /* recorded since token files: none before */
            if (!found && !strcmp(fl->name, "--decay-fraction")) continue; /* since --schedule: cosine before */
            if (!found) found = legacy_schedule_flag(fl->name, steps, was, sizeof adopted[i]);
            if (!found) {
                fprintf(stderr, "train_gpt: --resume '%s': its metadata does not record %s ('%s')\n", resume, fl->name,
                        saved_flags);
                free(saved_flags);
                free(saved_text);
                free(saved_vocab);
                return 2;
            }
            rec_value(fl, now, sizeof now);
            if (!strcmp(now, was)) continue;
            if (fl->given) {
                fprintf(stderr, "train_gpt: %s %s, but --resume '%s' was saved with %s %s%s\n", fl->name, now, resume,
                        fl->name, was,
                        moves_schedule(fl->name)
                            ? " (the learning-rate schedule would change; --load a --save-full file to start a new one)"
                            : "");
                free(saved_flags);
                free(saved_text);
                free(saved_vocab);
                return 2;
            }
            bool off = (is_dtype_flag(fl) && !strcmp(was, "none")) ||
                (!strcmp(fl->name, "--global-batch") && !strcmp(was, "0")) ||
                (!strcmp(fl->name, "--val-tokens") && !strcmp(was, "-1"));
            if (off) {
                if (is_dtype_flag(fl)) *(const char **)fl->value = NULL;
                else *(int *)fl->value = !strcmp(fl->name, "--val-tokens") ? -1 : 0;
            } else if (ex_parse_value("train_gpt", fl, was)) {
                fprintf(stderr, "train_gpt: --resume '%s': the value it records for %s is not valid\n", resume,
                        fl->name);
                free(saved_flags);
                free(saved_text);
                free(saved_vocab);
                return 2;
            }
        }
        free(saved_flags);
        saved_flags = NULL;
        /* adopted dtypes */
        mp = ts_mp_policy_default();
        if (param_dtype_s && (mp.param_dtype = parse_dtype(param_dtype_s)) == TS_DTYPE_COUNT) return 2;
        if (reduce_dtype_s && (mp.reduce_dtype = parse_dtype(reduce_dtype_s)) == TS_DTYPE_COUNT) return 2;
    }
    /* the schedule, with the flags a --resume adopted */
    if (warmup < 0) warmup = default_warmup(steps);
    ts_lr_schedule sched;
    if (make_schedule(schedule, warmup, decay_fraction, ex_flag_given(flags, NFLAGS, "--decay-fraction"), lr, steps,
                      &sched))
        return 2;
    if (strcmp(accum_mode, "nosync") != 0 && strcmp(accum_mode, "sync") != 0) { /* a --resume's, checked again */
        fprintf(stderr, "train_gpt: --resume '%s' records --accum-mode '%s' (must be nosync or sync)\n", resume,
                accum_mode);
        return 2;
    }
    /* a resumed run of --accum K prints the accum lines too */
    bool accum_log = ex_flag_given(flags, NFLAGS, "--accum") || accum > 1, accum_nosync = !strcmp(accum_mode, "nosync");
    ts_fsdp_options fso = ts_fsdp_options_default();
    if (param_dtype_s || reduce_dtype_s) fso.mp_policy = &mp;
    bool half = mp.param_dtype == TS_BF16 || mp.param_dtype == TS_F16;

    /* A checkpoint written by --save carries its sizes and vocabulary:
     * sizes not given on the command line are taken from it, sizes given
     * must agree. */
    int map[256], vocab = 0, load_tok_vocab = 0; /* a --load of token ids: its vocabulary */
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
                    fprintf(stderr, "train_gpt: %s %d, but --load '%s' was trained with %s %d\n", names[i], *vals[i],
                            load, names[i], got[i]);
                    return 2;
                }
                *vals[i] = got[i];
            }
        }
        if ((r = checkpoint_meta(load, "train_gpt.vocab", meta, sizeof meta)) < 0) return 2;
        if (r > 0 && !strncmp(meta, "tokens:", 7)) { /* trained on token ids: a tokenizer reads them */
            load_tok_vocab = atoi(meta + 7);
            r = 0;
        }
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
    if (load && sample && load_tok_vocab && !tokenizer_dir) {
        fprintf(stderr,
                "train_gpt: --load '%s' was trained on token ids (a vocabulary of %d): give the --tokenizer "
                "DIR that made them to --sample\n",
                load, load_tok_vocab);
        return 2;
    }
    if (load && tokenizer_dir && vocab) {
        fprintf(stderr, "train_gpt: --load '%s' was trained on characters: --tokenizer does not go with it\n", load);
        return 2;
    }
    int tok_vocab = 0; /* a resumed token-file run's vocabulary ("tokens:N") */
    if (resume && !strncmp(saved_vocab, "tokens:", 7)) {
        char *end;
        long v = strtol(saved_vocab + 7, &end, 10);
        const char *why = *end || v < 2 || v > (1 << 24) ? "is not one --save writes"
            : !tokens_mode ? "is a token file's: give the --data-tokens (or --data --tokenizer) it trained on"
            : rand_vocab && rand_vocab != v ? "differs from --vocab"
                                            : NULL;
        if (why) {
            fprintf(stderr, "train_gpt: --resume '%s': its vocabulary ('%s') %s\n", resume, saved_vocab, why);
            free(saved_text);
            free(saved_vocab);
            return 2;
        }
        tok_vocab = (int)v;
    } else if (resume && tokens_mode) {
        fprintf(stderr,
                "train_gpt: --resume '%s' trained on characters (--data or the built-in corpus): "
                "%s '%s' cannot continue it\n",
                resume, data_tokens ? "--data-tokens" : "--data --tokenizer", data_tokens ? data_tokens : data);
        free(saved_text);
        free(saved_vocab);
        return 2;
    } else if (resume && (vocab = vocab_from_hex(saved_vocab, map, chars)) == 0) {
        fprintf(stderr, "train_gpt: --resume '%s': its vocabulary ('%s') is not one --save writes\n", resume,
                saved_vocab);
        free(saved_flags);
        free(saved_text);
        free(saved_vocab);
        return 2;
    }
    free(saved_vocab);
    if (dim % heads) {
        fprintf(stderr, "train_gpt: --dim %d is not a multiple of --heads %d\n", dim, heads);
        return 2;
    }
    bool ckpt_vocab = vocab > 0;
    size_t len = 0;
    char *text = NULL;
    ts_token_file *tf = NULL; /* --data-tokens */
    char text_id[64] = "";    /* the data's length and hash, recorded by --save */
    ts_tokenizer *tok = NULL; /* --tokenizer */
    size_t text_bytes = 0;    /* --data --tokenizer: the text's size and the seconds its encoding took */
    double tokenize_s = 0;
    if (tokenizer_dir && load_tokenizer(tokenizer_dir, &tok)) {
        free(saved_text);
        return 2;
    }
    int tok_size = tok ? ts_tokenizer_vocab_size(tok) : 50257; /* GPT-2's by default */
    if (tok && rand_vocab && rand_vocab < tok_size) {
        fprintf(stderr, "train_gpt: --vocab %d is smaller than the %d tokens of --tokenizer '%s'\n", rand_vocab,
                tok_size, tokenizer_dir);
        ts_tokenizer_free(tok);
        free(saved_text);
        return 2;
    }
    if (tokens_mode) {
        vocab = tok_vocab ? tok_vocab : rand_vocab ? rand_vocab : load_tok_vocab ? load_tok_vocab : tok_size;
        ts_status st = TS_OK;
        if (data_tokens) {
            st = ts_token_file_open(data_tokens, &tf);
        } else if (tokenize_text(data, tok, &tf, &text_bytes, &tokenize_s)) {
            ts_tokenizer_free(tok);
            free(saved_text);
            return 2;
        } else { /* training needs only the ids: the tokenizer's tables go */
            ts_tokenizer_free(tok);
            tok = NULL;
        }
        if (!st) st = ts_token_file_check_vocab(tf, vocab);
        if (!st && val_tokens < 0) val_tokens = val_every ? (int)(ts_token_file_count(tf) / 10) : 0;
        if (!st) st = ts_token_file_split(tf, (size_t)val_tokens, seq);
        if (st) {
            fprintf(stderr, "train_gpt: %s: %s%s\n", data_tokens ? "--data-tokens" : "--data --tokenizer",
                    ts_last_error(),
                    st == TS_ERR_INDEX && data_tokens ? " (give the tokenizer's size with --vocab N)" : "");
            ts_token_file_close(tf);
            ts_tokenizer_free(tok);
            free(saved_text);
            return 2;
        }
        if (val_every && !ts_token_file_val_windows(tf)) {
            fprintf(stderr, "train_gpt: --val-every %d: no validation tokens (--val-tokens 0)\n", val_every);
            ts_token_file_close(tf);
            ts_tokenizer_free(tok);
            free(saved_text);
            return 2;
        }
        snprintf(text_id, sizeof text_id, "tokens:%zu:%016llx", ts_token_file_count(tf),
                 (unsigned long long)ts_token_file_hash(tf));
    } else if (rand_vocab) { /* no text: token ids drawn in the loop */
        vocab = rand_vocab;
    } else if (sample && tok) { /* --load F --sample N --tokenizer DIR: the checkpoint's token ids */
        vocab = load_tok_vocab ? load_tok_vocab : tok_size;
    } else if (!(sample && ckpt_vocab)) { /* sampling from a checkpoint of ours needs no text */
        text = data ? ex_read_file("train_gpt", "--data", data, &len) : ex_grammar_corpus(200000, 7);
        if (!text) return data ? 2 : 1;
        if (!data) len = strlen(text);
        if (!sample && len < (size_t)seq + 2) {
            fprintf(stderr, "train_gpt: the text has %zu characters; --seq %d needs more than %d\n", len, seq, seq + 1);
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
                        "%s '%s'\n",
                        data ? data : "the built-in corpus", c, i, resume ? "--resume" : "--load",
                        resume ? resume : load);
                free(text);
                free(saved_text);
                return 2;
            }
            chars[vocab] = (char)c;
            map[c] = vocab++;
        }
    }
    if (tokenizer_dir && vocab < tok_size) { /* ids the model has no row for */
        fprintf(stderr, "train_gpt: --tokenizer '%s' has %d tokens, more than the vocabulary of %d of %s '%s'\n",
                tokenizer_dir, tok_size, vocab, resume ? "--resume" : "--load", resume ? resume : load);
        ts_token_file_close(tf);
        ts_tokenizer_free(tok);
        free(saved_text);
        return 2;
    }
    if (text) snprintf(text_id, sizeof text_id, "%zu:%016llx", len, (unsigned long long)text_hash(text, len));
    if (resume && strcmp(text_id, saved_text) != 0) {
        fprintf(stderr,
                "train_gpt: --resume '%s' trained on other data (length:hash %s; %s is %s): give the %s it was "
                "trained on\n",
                resume, saved_text,
                tf         ? ts_token_file_path(tf)
                    : data ? data
                           : "the built-in corpus",
                text_id,
                data_tokens ? "--data-tokens"
                    : tf    ? "--data (and --tokenizer)"
                            : "--data");
        ts_token_file_close(tf);
        ts_tokenizer_free(tok);
        free(text);
        free(saved_text);
        return 2;
    }
    free(saved_text);

    /* the prompt, in ids, before anything is built */
    int64_t *prompt_ids = NULL;
    int n_prompt = 0;
    if (sample && tok) {
        if (encode_prompt(tok, prompt, &prompt_ids, &n_prompt)) {
            ts_tokenizer_free(tok);
            return 2;
        }
    } else if (sample) {
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
                ts_token_file_close(tf);
                ts_tokenizer_free(tok);
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
    int B = batch; /* this rank's sequences per step */
    if (global_batch) {
        if (global_batch % W) {
            fprintf(stderr, "train_gpt: --global-batch %d is not a multiple of the %d ranks (each takes G/W)\n",
                    global_batch, W);
            free(prompt_ids);
            free(text);
            ts_token_file_close(tf);
            ts_tokenizer_free(tok);
            return 2;
        }
        B = global_batch / W;
    }
    if (hsdp && W % hsdp) {
        fprintf(stderr,
                "train_gpt: --hsdp %d: the world of %d rank%s is not a multiple of %d (the mesh is R x W/R: "
                "%d replicas of a shard group of W/R ranks)\n",
                hsdp, W, W > 1 ? "s" : "", hsdp, hsdp);
        free(prompt_ids);
        free(text);
        ts_token_file_close(tf);
        ts_tokenizer_free(tok);
        return 2;
    }
    /* per rank, from ts_fsdp_memory_estimate_gpt (fully_shard.h): the peak of one step */
    ts_gpt_config ecfg = model_config(init_hf ? &hf_cfg : NULL, vocab, seq, layers, heads, dim);
    ts_fsdp_memory_options emo = ts_fsdp_memory_options_default();
    emo.input_ndim = 2, emo.input_shape[0] = sample ? 1 : B, emo.input_shape[1] = seq;
    emo.world_size = hsdp ? W / hsdp : W, emo.checkpoint_blocks = ckpt_act; /* HSDP: sharded over W/R */
    emo.eager_init = !deferred; /* a deferred start-up never holds the full model */
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
        ts_token_file_close(tf);
        ts_tokenizer_free(tok);
        return 2;
    }

    /* The cap this rank runs under (tsrun --memory-per-rank, or the
     * cgroup's limit): a job whose estimated peak resident set exceeds it
     * is refused here, before anything is built (docs/memory.md). */
    ts_memory_cap cap;
    ts_status cst = ts_memory_cap_read(&cap);
    if (cst) {
        fprintf(stderr, "train_gpt: %s\n", ts_last_error());
        free(prompt_ids);
        free(text);
        ts_token_file_close(tf);
        ts_tokenizer_free(tok);
        return 2;
    }
    if (cap.bytes && me.rss_peak_bytes > cap.bytes && !ignore_cap) {
        char b[5][32];
        bool env_cap = !strcmp(cap.source, TS_MEMORY_PER_RANK_ENV);
        fprintf(stderr,
                "train_gpt: the estimated peak per rank, %s (tensors %s + the pool's cached blocks %s + runtime %s), "
                "exceeds the memory cap of %s (%s%s); use more ranks, --checkpoint-activations, --param-dtype bf16, a "
                "smaller --batch or --seq (or --ignore-memory-cap)\n",
                ex_fmt_bytes((double)me.rss_peak_bytes, b[0], 32), ex_fmt_bytes((double)me.peak_bytes, b[1], 32),
                ex_fmt_bytes((double)(me.pool_peak_bytes - me.peak_bytes), b[2], 32),
                ex_fmt_bytes((double)me.floor_bytes, b[3], 32), ex_fmt_bytes((double)cap.bytes, b[4], 32),
                env_cap ? "--memory-per-rank / " : "the cgroup limit in ", cap.source);
        free(prompt_ids);
        free(text);
        ts_token_file_close(tf);
        ts_tokenizer_free(tok);
        return 2;
    }

    CHECK(ts_dist_init(NULL));
    ts_comm *world = ts_dist_world();
    int rank = ts_comm_rank(world);
    W = ts_comm_size(world);
    if (rank != 0) /* one voice */
        if (!freopen("/dev/null", "w", stdout)) return 1;
    ts_mesh *mesh = NULL; /* --hsdp: replicate x shard; NULL: the world, 1-d */
    if (make_mesh(world, hsdp, &mesh)) {
        fprintf(stderr, "train_gpt: %s\n", ts_last_error());
        free(prompt_ids);
        free(text);
        ts_token_file_close(tf);
        ts_tokenizer_free(tok);
        ts_dist_finalize();
        return 2;
    }
    fso.mesh = mesh;
    if (tf && !data_tokens)
        printf("data: %s, %zu bytes tokenized by --tokenizer %s (vocabulary %d) in %.2f s on every rank: %zu tokens, "
               "%zu for training, %zu held out for validation (%zu windows of %d)\n",
               data, text_bytes, tokenizer_dir, vocab, tokenize_s, ts_token_file_count(tf),
               ts_token_file_train_tokens(tf), ts_token_file_count(tf) - ts_token_file_train_tokens(tf),
               ts_token_file_val_windows(tf), seq);
    else if (tf)
        printf("data: %s, %zu tokens (vocabulary %d), memory-mapped: %zu for training, %zu held out for validation "
               "(%zu windows of %d)\n",
               data_tokens, ts_token_file_count(tf), vocab, ts_token_file_train_tokens(tf),
               ts_token_file_count(tf) - ts_token_file_train_tokens(tf), ts_token_file_val_windows(tf), seq);
    else if (rand_mode)
        printf("data: random token ids in [0, %d), seeded %llu%s\n", vocab, (unsigned long long)(seed + 1),
               global_batch ? " (one stream for all ranks)" : " + the rank");
    else if (text)
        printf("corpus: %s, %zu characters, vocabulary %d%s\n", data ? data : "built-in grammar", len, vocab,
               ckpt_vocab ? " (the checkpoint's)" : "");
    else if (tok) printf("vocabulary: %d tokens (--tokenizer %s), from %s\n", vocab, tokenizer_dir, load);
    else printf("vocabulary: %d characters, from %s\n", vocab, load);

    ts_manual_seed(seed);
    ts_gpt_config cfg = model_config(init_hf ? &hf_cfg : NULL, vocab, seq, layers, heads, dim);
    ts_module *model;
    if (deferred) CHECK(ts_device_scope_enter(TS_DEVICE_META)); /* shapes and recorded initializers, no bytes */
    ts_status built = ts_gpt_new(&cfg, &model);
    if (deferred) CHECK(ts_device_scope_exit());
    CHECK(built);
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
        /* streaming: each rank reads its rows, one tensor at a time */
        ts_status st = ts_ckpt_load_full(load, model, true);
        if (st) {
            fprintf(stderr,
                    "train_gpt: --load '%s' cannot be loaded into this model: %s: %s\n(give the --data, --seq, "
                    "--layers, --heads and --dim it was trained with)\n",
                    load, ts_status_name(st), ts_last_error());
            ts_module_free(model);
            ts_mesh_free(mesh);
            free(prompt_ids);
            free(text);
            ts_token_file_close(tf);
            ts_tokenizer_free(tok);
            ts_dist_finalize();
            return 1;
        }
        printf("loaded %d tensors from %s\n", model_tensors(model), load);
    } else if (init_hf && !resume) { /* each rank its rows, one tensor at a time */
        ts_status st = ts_ckpt_load_hf_gpt2(init_hf, model);
        if (st) {
            fprintf(stderr, "train_gpt: --init-from-hf '%s' cannot be loaded: %s: %s\n", init_hf, ts_status_name(st),
                    ts_last_error());
            ts_module_free(model);
            free(prompt_ids);
            free(text);
            ts_token_file_close(tf);
            ts_dist_finalize();
            return 1;
        }
        printf("GPT-2 weights: %s (%d layers, width %d, %d heads, vocabulary %d, %lld positions)\n", init_hf, layers,
               dim, heads, vocab, (long long)cfg.block_size);
    } else if (deferred) { /* this rank's rows, initialized as the eager build would (the same seed) */
        CHECK(ts_fsdp_materialize(model));
    }
    /* the estimate again from the sharded model itself (its groups, policies and checkpointed blocks) */
    char mb[32];
    CHECK(ts_fsdp_memory_estimate(model, &emo, &me));
    printf("memory estimate: %lld parameters, about %s per rank (%d rank%s)\n", (long long)me.n_params,
           ex_fmt_bytes((double)me.peak_bytes, mb, sizeof mb), W, W > 1 ? "s" : "");

    if (sample) {
        int rc = generate(model, chars, tok, vocab, seq, prompt_ids, n_prompt, sample, temperature, seed);
        free(prompt_ids);
        ts_module_free(model);
        ts_mesh_free(mesh);
        free(text);
        ts_token_file_close(tf);
        ts_tokenizer_free(tok);
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
    if (accum > 1) { /* what each accumulation mode costs (ts_fsdp_accumulation_memory) */
        ts_fsdp_accum_memory am;
        CHECK(ts_fsdp_accumulation_memory(model, &am));
        char b1[32], b2[32];
        printf("gradient accumulation: %d microbatches of %d per step, %s; per rank: sharded gradients %s, no sync "
               "holds %s more (unsharded gradients)\n",
               accum, B, accum_nosync ? "no sync until the last" : "reduce-scatter every microbatch",
               ex_fmt_bytes((double)am.sync_bytes, b1, sizeof b1),
               ex_fmt_bytes((double)am.no_sync_bytes, b2, sizeof b2));
    }
    ts_grad_scaler *scaler = NULL; /* float16 needs loss scaling */
    if (mp.param_dtype == TS_F16) CHECK(ts_grad_scaler_new(NULL, &scaler));
    int skipped = 0;

    /* what a checkpoint carries besides the model and AdamW */
    run_state rs;
    CHECK(run_state_new(global_batch > 0, scaler != NULL, &rs));
    char flag_rec[1024], config_rec[128], vocab_rec[2 * 256 + 1];
    {
        size_t n = 0;
        for (int i = 0; i < NREC; i++) {
            const ex_flag *fl = NULL;
            for (int k = 0; k < NFLAGS; k++)
                if (!strcmp(flags[k].name, recorded[i])) fl = &flags[k];
            char v[64];
            rec_value(fl, v, sizeof v);
            n += (size_t)snprintf(flag_rec + n, sizeof flag_rec - n, "%s%s=%s", i ? " " : "", fl->name, v);
        }
        snprintf(config_rec, sizeof config_rec, "seq=%d layers=%d heads=%d dim=%d", seq, layers, heads, dim);
        int nv = rand_vocab || tf ? 0 : vocab; /* --vocab has no characters (and saves nothing) */
        for (int i = 0; i < nv; i++) snprintf(vocab_rec + 2 * i, 3, "%02x", (unsigned char)chars[i]);
        vocab_rec[2 * nv] = '\0';
        if (tf) snprintf(vocab_rec, sizeof vocab_rec, "tokens:%d", vocab); /* a token file's ids, not characters */
    }
    const ts_ckpt_meta ckpt_meta[] = {{"train_gpt.config", config_rec},
                                      {"train_gpt.vocab", vocab_rec},
                                      {"train_gpt.flags", flag_rec},
                                      {"train_gpt.text", text_id}};
    const int n_ckpt_meta = (int)(sizeof ckpt_meta / sizeof ckpt_meta[0]);
    ts_generator *data_rng; /* one data order for all ranks (--global-batch), or each rank its own */
    CHECK(ts_generator_new(global_batch ? seed + 1 : seed + 1 + (uint64_t)rank, &data_rng));
    int start = 0, rc = 0; /* the step this run starts at */
    int64_t *ids = NULL, *tg = NULL;
    int *val_step = NULL; /* --val-every: the step of each validation and its loss */
    double *val_loss = NULL;
    double *step_s = NULL, *losses = NULL; /* each step's time on this rank and its loss (averaged over the ranks) */
    FILE *metrics_f = NULL;                /* --metrics, on rank 0 */
    bool metrics_failed = false;
    int step = 0;
    double first = 0, last = 0, window = 0;
    int window_n = 0;
    if (resume) {
        ts_ckpt_options co = ts_ckpt_options_default();
        co.optim = opt;
        co.extra = rs.extra;
        co.rank_extra = rs.rank_extra;
        ts_ckpt_info info;
        ts_status st = ts_ckpt_load(resume, model, &co, &info);
        if (st) {
            fprintf(stderr, "train_gpt: --resume '%s' cannot be loaded: %s: %s\n", resume, ts_status_name(st),
                    ts_last_error());
            rc = 1;
            goto done;
        }
        const int64_t *sv = ts_tensor_data(rs.step);
        const double *fv = ts_tensor_data(rs.first), *wv = ts_tensor_data(rs.window), *gv = ts_tensor_data(rs.scaler);
        start = (int)sv[0];
        first = fv[0];
        window = wv[0];
        window_n = (int)wv[1];
        last = wv[2];
        if (start < 0 || start > steps || window_n < 0 || window_n > start) {
            fprintf(stderr,
                    "train_gpt: --resume '%s': its step %d (%d losses since the last line) does not fit "
                    "--steps %d\n",
                    resume, start, window_n, steps);
            rc = 1;
            goto done;
        }
        if (scaler) { /* the scale and the good steps towards its next growth */
            skipped = (int)gv[2];
            st = ts_grad_scaler_load_state(scaler, gv[0], (int64_t)gv[1]);
            if (st) {
                fprintf(stderr, "train_gpt: --resume '%s': its grad scaler state does not fit: %s\n", resume,
                        ts_last_error());
                rc = 1;
                goto done;
            }
        }
        bool same_world = info.rank_extra_loaded;
        if (same_world) CHECK(ts_generator_set_state(ts_default_generator(), (const uint8_t *)ts_tensor_data(rs.rng)));
        if (global_batch || same_world)
            CHECK(ts_generator_set_state(data_rng, (const uint8_t *)ts_tensor_data(rs.data_rng)));
        else /* each rank's own order cannot carry over to another world size: a fresh one, not a repeat of step 0's */
            ts_generator_manual_seed(data_rng, seed + 1 + (uint64_t)rank + 0x9E3779B97F4A7C15ull * (uint64_t)start);
        printf("resumed from %s at step %d of %d (saved on %d rank%s, loaded on %d)\n", resume, start, steps,
               info.saved_world, info.saved_world > 1 ? "s" : "", info.loaded_world);
        if (!same_world)
            printf("note: another world size: each rank's RNG state%s starts afresh%s\n",
                   global_batch ? "" : " and its data order",
                   global_batch ? " (the data order is --global-batch's, restored)"
                                : " (--global-batch keeps the data order)");
        if (!same_world && !global_batch) /* --batch is per rank: the global batch follows the world size */
            printf(
                "note: --batch %d is per rank: each step now averages %lld sequences (%d ranks x %d%s), not the %lld "
                "of the %d ranks that saved it; the learning rate is unchanged (save with --global-batch G to keep "
                "the batch)\n",
                B, (long long)W * B * accum, W, B, accum > 1 ? " x --accum" : "",
                (long long)info.saved_world * B * accum, info.saved_world);
    }
    int64_t local = 0;
    for (int i = 0; i < params.n; i++) local += ts_tensor_numel(plist[i]);
    char mesh_desc[96];
    if (mesh) snprintf(mesh_desc, sizeof mesh_desc, "HSDP mesh %d x %d: replicate x shard", hsdp, W / hsdp);
    else snprintf(mesh_desc, sizeof mesh_desc, "%s", W > 1 ? "distributed world" : "one-rank mesh");
    printf("model: GPT %d layers, %d heads, d_model %d; fully_shard over %d rank%s (%s): %lld parameter elements "
           "on rank 0\n",
           layers, heads, dim, W, W > 1 ? "s" : "", mesh_desc, (long long)local);

    size_t n_ids = (size_t)accum * (size_t)B * (size_t)seq;
    ids = malloc(n_ids * sizeof *ids);
    tg = malloc(n_ids * sizeof *tg);
    step_s = malloc((size_t)steps * sizeof *step_s);
    losses = malloc((size_t)steps * sizeof *losses);
    if (!ids || !tg || !step_s || !losses) return 1;
    if (metrics && metrics_open(world, metrics, resume != NULL, &metrics_f)) {
        rc = 1;
        goto done;
    }
    double t0 = ex_now(), window_s = 0; /* window_s: this run's step times since the last line */
    int window_s_n = 0;
    int64_t tokens = 0;
    ts_comm *run_g[3]; /* count the training loop's collectives only (HSDP: the mesh's groups too) */
    for (int i = 0, ng = run_groups(world, mesh, run_g); i < ng; i++) ts_comm_stats_reset(run_g[i]);
    int end = stop_after && stop_after < steps ? stop_after : steps;
    report_cfg rcfg = {layers,
                       dim,
                       heads,
                       seq,
                       vocab,
                       B,
                       accum,
                       W,
                       (int64_t)me.n_params,
                       param_dtype_s ? mp_name(mp.param_dtype) : "f32",
                       ckpt_act,
                       rand_mode,
                       hsdp,
                       tokenizer_dir,
                       0,
                       NULL,
                       NULL};
    if (val_every) { /* the validations of this run, for --report-json */
        val_step = malloc(((size_t)(end - start) / (size_t)val_every + 2) * sizeof *val_step);
        val_loss = malloc(((size_t)(end - start) / (size_t)val_every + 2) * sizeof *val_loss);
        if (!val_step || !val_loss) return 1;
    }
    rcfg.val_step = val_step, rcfg.val_loss = val_loss;
    for (step = start; step < end; step++) {
        /* each microbatch: --global-batch, every rank draws all G starts
         * and keeps its G/W; else its own B (the same sequences as
         * --accum 1 --batch K*B) */
        double ts0 = ex_now();
        if (data_batches && step % data_batches == 0) /* --data-batches K: the stream starts again */
            ts_generator_manual_seed(data_rng, global_batch ? seed + 1 : seed + 1 + (uint64_t)rank);
        int per = global_batch ? global_batch : B, mine = global_batch ? rank * B : 0;
        for (int g = 0; g < accum * per && rand_mode; g++) { /* --vocab: seq + 1 draws per sequence, all drawn */
            int b = g % per - mine;
            bool keep = b >= 0 && b < B;
            b += g / per * B;
            for (int t = 0; t <= seq; t++) {
                int64_t id = (int64_t)(ts_generator_random(data_rng) % (uint32_t)rand_vocab);
                if (keep && t < seq) ids[b * seq + t] = id;
                if (keep && t > 0) tg[b * seq + t - 1] = id;
            }
        }
        for (int k = 0; k < accum && tf; k++) /* the same draws as the text's, from the file's training part */
            CHECK(ts_token_file_train_batch(tf, data_rng, per, mine, B, ids + (size_t)k * B * seq,
                                            tg + (size_t)k * B * seq));
        for (int g = 0; g < accum * per && !rand_mode && !tf; g++) {
            size_t at = ts_generator_random(data_rng) % (len - (size_t)seq - 1);
            int b = g % per - mine;
            if (b < 0 || b >= B) continue;
            b += g / per * B;
            for (int t = 0; t < seq; t++) {
                ids[b * seq + t] = map[(unsigned char)text[at + (size_t)t]];
                tg[b * seq + t] = map[(unsigned char)text[at + (size_t)t + 1]];
            }
        }
        int64_t is[2] = {B, seq}, ts_[1] = {(int64_t)B * seq};
        ts_tensor *x, *y, *logits, *flat, *loss;
        double lsum = 0;
        for (int k = 0; k < accum; k++) { /* microbatch k: sequences [k B, (k + 1) B), its mean loss / K */
            if (accum > 1 && accum_nosync) CHECK(ts_fsdp_set_requires_gradient_sync(model, k == accum - 1, true));
            size_t at = (size_t)k * (size_t)B * (size_t)seq;
            CHECK(ts_tensor_from_data(TS_I64, 2, is, ids + at, &x));
            CHECK(ts_tensor_from_data(TS_I64, 1, ts_, tg + at, &y));
            CHECK(ts_module_call1(model, x, &logits));
            if (half) { /* the loss in float32, as torchtitan's pred.float() */
                ts_tensor *l32;
                CHECK(ts_to_dtype(logits, TS_F32, &l32));
                ts_tensor_free(logits);
                logits = l32;
            }
            int64_t fs[2] = {(int64_t)B * seq, vocab};
            CHECK(ts_reshape(logits, 2, fs, &flat));
            CHECK(ts_cross_entropy(flat, y, -100, TS_REDUCTION_MEAN, &loss));
            double lk;
            CHECK(ts_tensor_item(loss, &lk));
            lsum += lk;
            if (accum > 1) {
                ts_tensor *lk_scaled;
                CHECK(ts_mul_scalar(loss, 1.0 / accum, &lk_scaled));
                ts_tensor_free(loss);
                loss = lk_scaled;
            }
            if (scaler) {
                ts_tensor *scaled;
                CHECK(ts_grad_scaler_scale(scaler, loss, &scaled));
                CHECK(ts_backward(scaled, NULL, false));
                ts_tensor_free(scaled);
            } else {
                CHECK(ts_backward(loss, NULL, false));
            }
            if (k < accum - 1) {
                ts_tensor_free(x);
                ts_tensor_free(y);
                ts_tensor_free(logits);
                ts_tensor_free(flat);
                ts_tensor_free(loss);
            }
        }
        if (scaler) CHECK(ts_grad_scaler_unscale(scaler, opt)); /* before clipping, as PyTorch's recipe */
        double gn = 0;
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
            l = lsum / accum; /* the mean over the step's microbatches */
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
        step_s[step] = ex_now() - ts0;
        losses[step] = l;
        if (step == 0) first = l;
        last = l;
        window += l;
        window_n++;
        tokens += (int64_t)accum * B * seq * W;
        if (accum_log) printf("accum step %d: loss %.9g grad norm %.9g\n", step + 1, l, overflow ? NAN : gn);
        window_s += step_s[step];
        window_s_n++;
        int every = steps >= 20 ? steps / 20 : 1;
        bool line = (step + 1) % every == 0 || step == 0;
        step_report rep = {step + 1,
                           steps,
                           l,
                           ts_lr_at(&sched, step),
                           overflow ? NAN : gn,
                           step_s[step],
                           (double)accum * B * seq * W,
                           ex_now() - t0,
                           {0, 0, 0},
                           NAN};
        if (line || metrics) /* the same steps on every rank (rank 0 alone has the file) */
            CHECK(memory_max_over_ranks(world, rep.mem));
        if (line) {
            print_step_line(&rep, window_n, window / window_n, window_s / window_s_n, start, end, (double)tokens, W);
            window = 0;
            window_n = 0;
            window_s = 0;
            window_s_n = 0;
        }
        if (val_every && ((step + 1) % val_every == 0 || step + 1 == end)) {
            double vl;
            CHECK(validate(model, tf, world, B, seq, vocab, half, ids, tg, &vl));
            val_step[rcfg.n_val] = step + 1, val_loss[rcfg.n_val++] = vl; /* for --report-json */
            printf("step %4d  val loss %.4f  perplexity %.2f  (%zu windows of %d tokens over %d rank%s)\n", step + 1,
                   vl, exp(vl), ts_token_file_val_windows(tf), seq, W, W > 1 ? "s" : "");
            rep.val_loss = vl;
        }
        if (metrics_f && metrics_write(metrics_f, metrics, &rep)) { /* rank 0 only: train on, exit 1 at the end */
            fclose(metrics_f);
            metrics_f = NULL;
            metrics_failed = true;
        }
        if (save && save_every && (step + 1) % save_every == 0 && step + 1 < end)
            CHECK(save_sharded(save, model, opt, scaler, skipped, data_rng, &rs, step + 1, first, window, window_n,
                               last, ckpt_meta, n_ckpt_meta));
    }
    int ran = step - start; /* steps this process took */
    print_run_time(ex_now() - t0, step_s + start, ran, (double)tokens);
    print_comm_summary(world, mesh, ran > 0 ? ran : 1);
    if (accum_log) /* exact, to compare the accumulation modes */
        printf("accum: peak tensor storage %zu bytes on this rank\n", ts_mem_peak_bytes(TS_MEM_STORAGE));
    if (offload_cpu && ran > 0) {
        ts_fsdp_offload_stats os;
        CHECK(ts_fsdp_offload_stats_get(model, &os));
        char b1[32], b2[32], b3[32], b4[32], b5[32];
        printf("offload (cpu, %s): %d groups; per step %.1f host-to-device copies (%s) before all-gathers, %.1f "
               "device-to-host copies (%s) of reduced gradients; host blocks %s, pinned %s (%s locked)\n",
               op.pin_memory ? "pinned" : "pageable", os.groups, (double)os.h2d_copies / ran,
               ex_fmt_bytes((double)os.h2d_bytes / ran, b1, sizeof b1), (double)os.d2h_copies / ran,
               ex_fmt_bytes((double)os.d2h_bytes / ran, b2, sizeof b2),
               ex_fmt_bytes((double)os.host_bytes, b3, sizeof b3), ex_fmt_bytes((double)os.pinned_bytes, b4, sizeof b4),
               ex_fmt_bytes((double)ts_mem_locked_bytes(), b5, sizeof b5));
    }
    {
        /* what the policy changes on the wire: the all-gathers carry the
         * param dtype, the reduce-scatters the reduce dtype */
        ts_comm_counters cc;
        run_counters(world, mesh, &cc);
        char b1[32], b2[32];
        int n = ran > 0 ? ran : 1;
        printf("bytes per step on rank 0: all-gathered %s (%.0f bytes), reduce-scattered %s (%.0f bytes); param dtype "
               "%s, reduce dtype %s\n",
               ex_fmt_bytes((double)cc.bytes[TS_COLL_ALL_GATHER] / n, b1, sizeof b1),
               (double)cc.bytes[TS_COLL_ALL_GATHER] / n,
               ex_fmt_bytes((double)cc.bytes[TS_COLL_REDUCE_SCATTER] / n, b2, sizeof b2),
               (double)cc.bytes[TS_COLL_REDUCE_SCATTER] / n,
               mp.param_dtype == TS_DTYPE_KEEP ? "float32" : ts_dtype_name(mp.param_dtype),
               ts_dtype_name(mp.reduce_dtype != TS_DTYPE_KEEP      ? mp.reduce_dtype
                                 : mp.param_dtype != TS_DTYPE_KEEP ? mp.param_dtype
                                                                   : TS_F32));
        if (scaler)
            printf("grad scaler: %d of %d steps skipped (inf/NaN gradients), final scale %g, growth tracker %lld\n",
                   skipped, step, ts_grad_scaler_get_scale(scaler), (long long)ts_grad_scaler_growth_tracker(scaler));
    }
    if (!rc) {
        if (step < steps) printf("stopped after step %d of %d (--stop-after)\n", step, steps);
        printf("loss %.4f -> %.4f (uniform guess: %.4f)\n", first, last, log((double)vocab));
        if (save)
            CHECK(save_sharded(save, model, opt, scaler, skipped, data_rng, &rs, step, first, window, window_n, last,
                               ckpt_meta, n_ckpt_meta));
        if (save_full) { /* streamed to rank 0 one tensor at a time, with the sizes and the vocabulary
                          * (ckpt_meta's first 2 pairs) for --load and --sample */
            CHECK(ts_ckpt_save_full(save_full, model, ckpt_meta, 2));
            printf("saved %d full tensors to %s\n", model_tensors(model), save_full);
        }
        CHECK(print_rank_memory(world, &me, step_s + start, losses + start, ran, (double)accum * B * seq, report_json,
                                &rcfg));
    }
    if (metrics_failed) rc = rc ? rc : 1; /* after the saves: the checkpoint is still worth having */
done:
    if (metrics_f && fclose(metrics_f)) {
        fprintf(stderr, "train_gpt: --metrics '%s': %s\n", metrics, strerror(errno));
        rc = rc ? rc : 1;
    }
    fflush(stdout);
    ts_generator_free(data_rng);
    run_state_free(&rs);
    ts_grad_scaler_free(scaler);
    ts_optim_free(opt);
    free(plist);
    ts_named_params_free(&params);
    ts_module_free(model);
    ts_mesh_free(mesh);
    free(val_step);
    free(val_loss);
    free(ids);
    free(tg);
    free(step_s);
    free(losses);
    free(text);
    ts_token_file_close(tf);
    ts_tokenizer_free(tok);
    CHECK(ts_dist_finalize());
    return rc;
}
