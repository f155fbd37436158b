/* bench/train_step: one GPT training step (forward, backward, AdamW) at 1
 * and 2 threads, with
 *   - the step's median time,
 *   - the time inside the library's matrix products (trace spans) and the
 *     rest,
 *   - the time raw bli_sgemm takes for exactly this step's list of matrix
 *     products (recorded from the step, replayed on fresh buffers with the
 *     same shapes and transposes), and its share of the step,
 *   - the time inside the attention op, forward and backward (trace spans
 *     "attention" and "attention_backward"), and its share of the step,
 *   - PyTorch's time for the same model, batch and AdamW step, run in this
 *     same session (when /usr/bin/python3 has torch), and the ratio,
 *   - the attention op alone at the model's shapes (forward and backward,
 *     causal mask, q, k, v strided views of one packed projection as in
 *     MultiheadAttention), its unfused reference path against the fused
 *     kernel (tensor/flash_attention.h), the two interleaved rep by rep
 *     (--no-alone skips it).
 * --dropout P sets the GPT's dropout (embeddings, attention weights, MLP;
 * default 0) in the step, in PyTorch's twin and in the attention alone,
 * which then draws the attention dropout mask every rep (the reference
 * path its (B, H, T, T) noise tensor, the fused kernel its keep bits).
 * TS_ATTENTION=reference runs the whole step on the unfused path.
 * Targets at 1 thread: raw sgemm >= 70% of the step; step <= 0.8 x PyTorch.
 *
 * Usage: bench_train_step [--threads 1,2] [--steps N] [--warmup N] [--no-torch] [--no-alone]
 *        [--layers L --dim D --heads H --seq T --batch B --vocab V] [--dropout P] */
#define _GNU_SOURCE
#include <blis.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "tensor/flash_attention.h"
#include "tensor/internal.h"
#include "bench/bench_common.h"
#include "tensorshard.h"

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec * 1e-6;
}

/* ------------------------------------------------------- recorded products */

typedef struct product {
    int64_t m, n, k;
    bool a_t, b_t; /* operand stored transposed (column-major) */
    double beta;
} product;

static product prods[4096];
static int n_prods;
static bool recording;

static void observe(ts_dtype dt, int64_t m, int64_t n, int64_t k, int64_t rsa, int64_t csa, int64_t rsb, int64_t csb,
                    double beta)
{
    (void)rsb;
    (void)rsa;
    if (!recording || dt != TS_F32 || n_prods == 4096) return;
    prods[n_prods++] = (product){m, n, k, csa != 1, csb != 1, beta};
}

/* Times raw bli_sgemm over the recorded list, on buffers laid out like the
 * step's operands (row-major, or column-major where the step passed a
 * transposed view). Returns the median over `reps` passes, ms. */
static double replay_sgemm(int reps)
{
    size_t need_a = 0, need_b = 0, need_c = 0;
    for (int i = 0; i < n_prods; i++) {
        product *p = &prods[i];
        need_a = need_a > (size_t)(p->m * p->k) ? need_a : (size_t)(p->m * p->k);
        need_b = need_b > (size_t)(p->k * p->n) ? need_b : (size_t)(p->k * p->n);
        need_c = need_c > (size_t)(p->m * p->n) ? need_c : (size_t)(p->m * p->n);
    }
    float *a = aligned_alloc(64, (need_a * 4 + 63) / 64 * 64), *b = aligned_alloc(64, (need_b * 4 + 63) / 64 * 64),
          *c = aligned_alloc(64, (need_c * 4 + 63) / 64 * 64);
    for (size_t i = 0; i < need_a; i++) a[i] = (float)((i * 7) % 13) * 0.01f;
    for (size_t i = 0; i < need_b; i++) b[i] = (float)((i * 5) % 11) * 0.01f;
    memset(c, 0, need_c * 4);
    double times[64];
    reps = reps > 64 ? 64 : reps;
    for (int r = 0; r < reps + 1; r++) {
        double t0 = now_ms();
        for (int i = 0; i < n_prods; i++) {
            product *p = &prods[i];
            float one = 1.0f, beta = (float)p->beta;
            inc_t rsa = p->a_t ? 1 : p->k, csa = p->a_t ? p->m : 1;
            inc_t rsb = p->b_t ? 1 : p->n, csb = p->b_t ? p->k : 1;
            bli_sgemm(BLIS_NO_TRANSPOSE, BLIS_NO_TRANSPOSE, p->m, p->n, p->k, &one, a, rsa, csa, b, rsb, csb, &beta, c,
                      p->n, 1);
        }
        if (r > 0) times[r - 1] = now_ms() - t0;
    }
    free(a);
    free(b);
    free(c);
    return bench_median(times, reps);
}

/* ------------------------------------------------------- the step */

typedef struct cfg {
    int64_t vocab, layers, dim, heads, seq, batch;
    double dropout;
} cfg;

typedef struct result {
    double step_ms, best_ms, matmul_ms, sgemm_ms, attn_ms;
    int n_products;
    double gflop;
} result;

static result run(const cfg *c, int threads, int steps, int warmup)
{
    ts_set_num_threads(threads);
    ts_manual_seed(0);
    ts_gpt_config g = ts_gpt_config_default();
    g.vocab_size = c->vocab;
    g.block_size = c->seq;
    g.n_layer = c->layers;
    g.n_head = c->heads;
    g.d_model = c->dim;
    g.dropout = c->dropout;
    ts_module *model;
    CHECK(ts_gpt_new(&g, &model));
    ts_named_params p;
    CHECK(ts_module_named_parameters(model, &p));
    ts_tensor **plist = malloc((size_t)p.n * sizeof *plist);
    for (int i = 0; i < p.n; i++) plist[i] = *p.items[i].slot;
    ts_adam_options ao = ts_adamw_options_default();
    ts_optim *opt;
    CHECK(ts_adamw_new(p.n, plist, &ao, &opt));
    int64_t is[2] = {c->batch, c->seq}, fs[2] = {c->batch * c->seq, c->vocab}, ys[1] = {c->batch * c->seq};
    ts_tensor *x, *y;
    CHECK(ts_randint(0, c->vocab, 2, is, NULL, &x));
    CHECK(ts_randint(0, c->vocab, 1, ys, NULL, &y));
    char trace_path[64];
    snprintf(trace_path, sizeof trace_path, "/tmp/ts_bench_trace_%d.json", (int)getpid());
    double times[256], mm[256], at[256];
    steps = steps > 256 ? 256 : steps;
    n_prods = 0;
    for (int s = 0; s < warmup + steps; s++) {
        recording = s == warmup; /* one step's list of products */
        CHECK(ts_trace_start(trace_path));
        double t0 = now_ms();
        ts_tensor *logits, *flat, *loss;
        CHECK(ts_module_call1(model, x, &logits));
        CHECK(ts_reshape(logits, 2, fs, &flat));
        CHECK(ts_cross_entropy(flat, y, -100, TS_REDUCTION_MEAN, &loss));
        CHECK(ts_backward(loss, NULL, false));
        CHECK(ts_optim_step(opt));
        ts_optim_zero_grad(opt, true);
        ts_tensor_free(logits);
        ts_tensor_free(flat);
        ts_tensor_free(loss);
        double t1 = now_ms();
        if (getenv("TS_BENCH_POOL"))
            fprintf(stderr, "step %d pool %zu MiB cached %zu MiB\n", s, ts_mem_live_bytes(TS_MEM_POOL) >> 20,
                    ts_pool_cached_bytes() >> 20);
        double matmul = (double)ts_trace_total_ns("matmul") * 1e-6;
        double attn = (double)(ts_trace_total_ns("attention") + ts_trace_total_ns("attention_backward")) * 1e-6;
        ts_trace_stop(false);
        recording = false;
        if (s >= warmup) {
            times[s - warmup] = t1 - t0;
            mm[s - warmup] = matmul;
            at[s - warmup] = attn;
        }
    }
    result r = {0};
    double sorted[256];
    memcpy(sorted, times, (size_t)steps * sizeof *times);
    r.step_ms = bench_median(times, steps);
    r.best_ms = sorted[0];
    for (int i = 1; i < steps; i++) r.best_ms = sorted[i] < r.best_ms ? sorted[i] : r.best_ms;
    r.matmul_ms = bench_median(mm, steps);
    r.attn_ms = bench_median(at, steps);
    r.n_products = n_prods;
    for (int i = 0; i < n_prods; i++) r.gflop += 2e-9 * (double)prods[i].m * (double)prods[i].n * (double)prods[i].k;
    bli_thread_set_num_threads(threads);
    r.sgemm_ms = replay_sgemm(steps);
    ts_tensor_free(x);
    ts_tensor_free(y);
    ts_optim_free(opt);
    free(plist);
    ts_named_params_free(&p);
    ts_module_free(model);
    ts_pool_empty_cache();
    return r;
}

/* The attention op alone at the model's shapes, forward and backward:
 * medians over `reps` of the reference path and of the fused kernel,
 * timed alternately (so that other load on the machine hits both). */
static void attention_alone(const cfg *c, int threads, int reps, double *ref_ms, double *fused_ms)
{
    ts_set_num_threads(threads);
    int64_t ps[3] = {c->batch, c->seq, 3 * c->dim};
    ts_tensor *qkv, *parts[3], *keep, *f, *mask;
    int np;
    ts_manual_seed(3);
    CHECK(ts_randn(TS_F32, 3, ps, NULL, &qkv));
    CHECK(ts_tensor_set_requires_grad(qkv, true));
    CHECK(ts_tril_mask(c->seq, 0, &keep));
    CHECK(ts_tensor_full(TS_BOOL, 0, NULL, 0.0, &f));
    CHECK(ts_eq(keep, f, &mask));
    double t[2][64];
    reps = reps > 64 ? 64 : reps;
    for (int r = 0; r < reps + 1; r++)
        for (int mode = 0; mode < 2; mode++) {
            ts__flash_force(mode);
            CHECK(ts_chunk(qkv, 3, 2, 3, parts, &np));
            double t0 = now_ms();
            ts_tensor *o, *g;
            CHECK(ts_attention(parts[0], parts[1], parts[2], c->heads, mask, c->dropout, true, NULL, &o));
            CHECK(ts_tensor_full(TS_F32, 3, ts_tensor_shape(o), 1e-3, &g));
            CHECK(ts_backward(o, g, false));
            double t1 = now_ms();
            ts_tensor_free(o);
            ts_tensor_free(g);
            ts_tensor_set_grad(qkv, NULL);
            for (int i = 0; i < 3; i++) ts_tensor_free(parts[i]);
            if (r > 0) t[mode][r - 1] = t1 - t0;
        }
    ts__flash_force(-1);
    *ref_ms = bench_median(t[0], reps);
    *fused_ms = bench_median(t[1], reps);
    ts_tensor_free(qkv);
    ts_tensor_free(keep);
    ts_tensor_free(f);
    ts_tensor_free(mask);
}

/* Runs the PyTorch twin; returns its median step in ms, or -1. */
static double torch_step(const cfg *c, int threads, int steps, int warmup, const char *script)
{
    if (access("/usr/bin/python3", X_OK) != 0 || system("/usr/bin/python3 -c 'import torch' 2>/dev/null") != 0)
        return -1;
    char cmd[2048];
    snprintf(
        cmd, sizeof cmd,
        "env BLIS_ARCH_TYPE=%s MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 "
        "OMP_NUM_THREADS=%d BLIS_NUM_THREADS=%d /usr/bin/python3 %s %d %d %d %lld %lld %lld %lld %lld %lld %lld %.17g",
        strcmp(ts_blis_arch_name(), "skx") == 0 ? "0" : "\"$BLIS_ARCH_TYPE\"", threads, threads, script, threads, steps,
        warmup, (long long)c->vocab, (long long)c->seq, (long long)c->layers, (long long)c->heads, (long long)c->dim,
        (long long)c->batch, (long long)c->seq, c->dropout);
    FILE *f = popen(cmd, "r");
    if (!f) return -1;
    char line[256];
    double med = -1, best;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "torch_step_ms %lf %lf", &med, &best) == 2) break;
    pclose(f);
    return med;
}

int main(int argc, char **argv)
{
    cfg c = {.vocab = 64, .layers = 4, .dim = 256, .heads = 4, .seq = 128, .batch = 8, .dropout = 0.0};
    int steps = 7, warmup = 2, threads[4] = {1, 2}, n_threads = 2;
    bool use_torch = true, alone = true;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : "";
        if (!strcmp(a, "--no-torch")) {
            use_torch = false;
            continue;
        }
        if (!strcmp(a, "--no-alone")) {
            alone = false;
            continue;
        }
        if (!strcmp(a, "--threads")) {
            n_threads = 0;
            for (char *s = strtok((char *)v, ","); s && n_threads < 4; s = strtok(NULL, ","))
                threads[n_threads++] = atoi(s);
        } else if (!strcmp(a, "--steps")) steps = atoi(v);
        else if (!strcmp(a, "--warmup")) warmup = atoi(v);
        else if (!strcmp(a, "--layers")) c.layers = atoll(v);
        else if (!strcmp(a, "--dim")) c.dim = atoll(v);
        else if (!strcmp(a, "--heads")) c.heads = atoll(v);
        else if (!strcmp(a, "--seq")) c.seq = atoll(v);
        else if (!strcmp(a, "--batch")) c.batch = atoll(v);
        else if (!strcmp(a, "--vocab")) c.vocab = atoll(v);
        else if (!strcmp(a, "--dropout")) {
            char *end;
            c.dropout = strtod(v, &end);
            if (!*v || *end || !(c.dropout >= 0 && c.dropout < 1)) {
                fprintf(stderr, "--dropout '%s' is not a probability in [0, 1)\n", v);
                return 2;
            }
        } else {
            fprintf(
                stderr,
                "usage: %s [--threads 1,2] [--steps N] [--warmup N] [--no-torch] [--no-alone] [--layers L] [--dim D] "
                "[--heads H] [--seq T] [--batch B] [--vocab V] [--dropout P]\n",
                argv[0]);
            return 2;
        }
        i++;
    }
    if (steps < 1 || warmup < 0) {
        fprintf(stderr, "--steps must be >= 1 and --warmup >= 0\n");
        return 2;
    }
    char script[1024];
    snprintf(script, sizeof script, "%s/tools/bench/torch_train_step.py", TS_SOURCE_DIR);
    ts__gemm_observer = observe;
    printf("GPT %lld layers, d_model %lld, %lld heads, seq %lld, batch %lld, vocab %lld, dropout %g; AdamW; BLIS "
           "kernels: %s\n",
           (long long)c.layers, (long long)c.dim, (long long)c.heads, (long long)c.seq, (long long)c.batch,
           (long long)c.vocab, c.dropout, ts_blis_arch_name());
    printf("median of %d steps after %d warm-up steps; times in ms\n\n", steps, warmup);
    printf("attention: %s path\n",
           ts__flash_enabled() ? "fused (TS_ATTENTION=reference for the unfused one)"
                               : "reference (TS_ATTENTION=reference)");
    printf("%7s %9s %9s %9s %7s %9s %9s %10s %9s %7s %9s %9s\n", "threads", "step", "best", "matmul", "share", "rest",
           "sgemm", "sgemm/step", "attn", "share", "torch", "step/torch");
    for (int t = 0; t < n_threads; t++) {
        result r = run(&c, threads[t], steps, warmup);
        double tt = use_torch ? torch_step(&c, threads[t], steps, warmup, script) : -1;
        char tbuf[32] = "n/a", rbuf[32] = "n/a";
        if (tt > 0) {
            snprintf(tbuf, sizeof tbuf, "%.1f", tt);
            snprintf(rbuf, sizeof rbuf, "%.3f", r.step_ms / tt);
        }
        printf("%7d %9.1f %9.1f %9.1f %6.1f%% %9.1f %9.1f %10.3f %9.1f %6.1f%% %9s %9s\n", threads[t], r.step_ms,
               r.best_ms, r.matmul_ms, 100 * r.matmul_ms / r.step_ms, r.step_ms - r.matmul_ms, r.sgemm_ms,
               r.sgemm_ms / r.step_ms, r.attn_ms, 100 * r.attn_ms / r.step_ms, tbuf, rbuf);
        printf("        (%d matrix products, %.2f GFLOP per step: %.1f GFLOP/s in raw sgemm)\n", r.n_products, r.gflop,
               r.gflop / (r.sgemm_ms * 1e-3));
        double ref_ms, fused_ms;
        if (!alone) continue;
        attention_alone(&c, threads[t], steps * 4 * (int)c.layers, &ref_ms, &fused_ms);
        printf("        attention alone (B %lld, T %lld, E %lld, %lld heads, causal, dropout %g; forward + backward, "
               "median "
               "of %d interleaved): reference %.3f ms, fused %.3f ms (%.2fx)\n",
               (long long)c.batch, (long long)c.seq, (long long)c.dim, (long long)c.heads, c.dropout,
               steps * 4 * (int)c.layers, ref_ms, fused_ms, ref_ms / fused_ms);
    }
    printf("\ntargets at 1 thread: sgemm/step >= 0.70, step/torch <= 0.80\n");
    {
        /* the process (docs/memory.md): the unsharded step has no estimate
         * (ts_fsdp_memory_estimate plays fully_shard's step) */
        ts_process_memory pm;
        if (ts_process_memory_read(&pm) == TS_OK)
            printf("rank 0: peak RSS %.1f MiB (VmHWM over the whole run; tensors %.1f MiB at their peak)\n",
                   (double)pm.peak_rss_bytes / 1048576.0, (double)ts_mem_peak_bytes(TS_MEM_STORAGE) / 1048576.0);
    }
    return 0;
}
