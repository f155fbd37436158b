/* bench/attention: the attention core with dropout in training, its
 * unfused reference path (which draws a (B, H, T, S) float noise tensor
 * and keeps the probabilities and the noise for backward; what every
 * call with dropout ran before the fused kernel took dropout) against the
 * fused kernel (keep mask drawn in bits, tensor/flash_attention.h), and
 * the fused kernel without dropout as the floor; plus the two ways of
 * drawing the mask alone. Every variant runs once per rep, in turn, so
 * that load from elsewhere on the machine hits them alike (in a new
 * random order each rep); the table has
 * medians of wall time and of process CPU time (the latter is less
 * disturbed by other processes at 1 thread).
 *
 * Shapes default to bench_train_step's GPT (B 8, T 128, E 256, 4 heads,
 * causal mask, q, k, v strided views of one packed projection).
 *
 * Usage: bench_attention [--threads N] [--reps N] [--batch B] [--seq T] [--dim E] [--heads H]
 *        [--dropout P] [--no-causal] */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench/bench_common.h"
#include "tensor/flash_attention.h"
#include "tensor/internal.h"
#include "tensorshard.h"

static double cpu_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

typedef struct opts {
    int threads, reps;
    int64_t B, T, E, H;
    double p;
    bool causal;
} opts;

enum {
    V_REF_FB,
    V_FUSED_FB,
    V_FUSED_NODROP_FB,
    V_REF_F,
    V_FUSED_F,
    V_FUSED_NODROP_F,
    V_DRAW_FLOAT,
    V_DRAW_BITS,
    V_COUNT
};

static const char *const names[V_COUNT] = {
    "reference, dropout: forward + backward",
    "fused, dropout: forward + backward",
    "fused, no dropout: forward + backward",
    "reference, dropout: forward",
    "fused, dropout: forward",
    "fused, no dropout: forward",
    "mask draw: bernoulli_ float (B,H,T,S)",
    "mask draw: keep bits (B,H,T,S)",
};

/* One run of variant v. */
static void run_variant(int v, const opts *o, ts_tensor *qkv, ts_tensor *mask, ts_tensor *noise, uint32_t *bits)
{
    if (v == V_DRAW_FLOAT) {
        CHECK(ts_bernoulli_(noise, 1.0 - o->p, NULL));
        return;
    }
    if (v == V_DRAW_BITS) {
        ts__rng_bernoulli_bits(NULL, 1.0 - o->p, o->B * o->H * o->T, o->T, TS__FLASH_KEEP_WORDS(o->T), bits);
        return;
    }
    bool fused = v != V_REF_FB && v != V_REF_F, backward = v <= V_FUSED_NODROP_FB;
    double p = v == V_FUSED_NODROP_FB || v == V_FUSED_NODROP_F ? 0.0 : o->p;
    ts__flash_force(fused);
    ts_tensor *parts[3], *out, *g;
    int np;
    CHECK(ts_chunk(qkv, 3, 2, 3, parts, &np));
    bool prev = ts_grad_mode_set(backward);
    CHECK(ts_attention(parts[0], parts[1], parts[2], o->H, mask, p, true, NULL, &out));
    ts_grad_mode_set(prev);
    if (backward) {
        CHECK(ts_tensor_full(TS_F32, 3, ts_tensor_shape(out), 1e-3, &g));
        CHECK(ts_backward(out, g, false));
        ts_tensor_free(g);
        ts_tensor_set_grad(qkv, NULL);
    }
    ts_tensor_free(out);
    for (int i = 0; i < 3; i++) ts_tensor_free(parts[i]);
    ts__flash_force(-1);
}

int main(int argc, char **argv)
{
    opts o = {.threads = 1, .reps = 40, .B = 8, .T = 128, .E = 256, .H = 4, .p = 0.1, .causal = true};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : "";
        if (!strcmp(a, "--no-causal")) {
            o.causal = false;
            continue;
        }
        char *end = NULL;
        if (!strcmp(a, "--threads")) o.threads = (int)strtol(v, &end, 10);
        else if (!strcmp(a, "--reps")) o.reps = (int)strtol(v, &end, 10);
        else if (!strcmp(a, "--batch")) o.B = strtoll(v, &end, 10);
        else if (!strcmp(a, "--seq")) o.T = strtoll(v, &end, 10);
        else if (!strcmp(a, "--dim")) o.E = strtoll(v, &end, 10);
        else if (!strcmp(a, "--heads")) o.H = strtoll(v, &end, 10);
        else if (!strcmp(a, "--dropout")) o.p = strtod(v, &end);
        else {
            fprintf(stderr,
                    "usage: %s [--threads N] [--reps N] [--batch B] [--seq T] [--dim E] [--heads H] "
                    "[--dropout P] [--no-causal]\n",
                    argv[0]);
            return 2;
        }
        if (!*v || *end) {
            fprintf(stderr, "%s: '%s' is not a number\n", a, v);
            return 2;
        }
        i++;
    }
    if (o.threads < 1 || o.reps < 1 || o.B < 1 || o.T < 1 || o.E < 1 || o.H < 1 || o.E % o.H || !(o.p > 0 && o.p < 1)) {
        fprintf(stderr,
                "need --threads, --reps, --batch, --seq, --dim, --heads >= 1, --dim a multiple of --heads "
                "and --dropout in (0, 1)\n");
        return 2;
    }
    ts_set_num_threads(o.threads);
    int64_t ps[3] = {o.B, o.T, 3 * o.E}, ns[4] = {o.B, o.H, o.T, o.T};
    ts_tensor *qkv, *mask = NULL, *noise;
    ts_manual_seed(3);
    CHECK(ts_randn(TS_F32, 3, ps, NULL, &qkv));
    CHECK(ts_tensor_set_requires_grad(qkv, true));
    if (o.causal) {
        ts_tensor *keep, *f;
        CHECK(ts_tril_mask(o.T, 0, &keep));
        CHECK(ts_tensor_full(TS_BOOL, 0, NULL, 0.0, &f));
        CHECK(ts_eq(keep, f, &mask));
        ts_tensor_free(keep);
        ts_tensor_free(f);
    }
    CHECK(ts_tensor_empty(TS_F32, 4, ns, &noise));
    uint32_t *bits = malloc((size_t)(o.B * o.H * o.T * TS__FLASH_KEEP_WORDS(o.T)) * sizeof *bits);
    double *wall[V_COUNT], *cpu[V_COUNT];
    for (int v = 0; v < V_COUNT; v++) {
        wall[v] = malloc((size_t)o.reps * sizeof(double));
        cpu[v] = malloc((size_t)o.reps * sizeof(double));
    }
    /* two warm-up rounds; each round runs the variants in a new random
     * order, so that none always runs right after the same one (at 2
     * threads the reference path's BLIS threads keep spinning in OpenMP
     * for a while after it returns and slow whatever runs next) */
    uint32_t lcg = 12345;
    int order[V_COUNT];
    for (int r = -2; r < o.reps; r++) {
        for (int i = 0; i < V_COUNT; i++) order[i] = i;
        for (int i = V_COUNT - 1; i > 0; i--) {
            lcg = lcg * 1664525u + 1013904223u;
            int j = (int)((lcg >> 8) % (uint32_t)(i + 1)), t = order[i];
            order[i] = order[j];
            order[j] = t;
        }
        for (int i = 0; i < V_COUNT; i++) {
            int v = order[i];
            double w0 = bench_now_s(), c0 = cpu_s();
            run_variant(v, &o, qkv, mask, noise, bits);
            double w1 = bench_now_s(), c1 = cpu_s();
            if (r >= 0) {
                wall[v][r] = (w1 - w0) * 1e3;
                cpu[v][r] = (c1 - c0) * 1e3;
            }
        }
    }
    printf("attention with dropout %g: B %lld, T %lld, E %lld, %lld heads, %s, %d thread(s), kernels %s; median of %d "
           "interleaved reps, ms\n\n",
           o.p, (long long)o.B, (long long)o.T, (long long)o.E, (long long)o.H, o.causal ? "causal" : "no mask",
           o.threads, ts__kpath_name(ts__kpath_active()), o.reps);
    printf("%-40s %10s %10s\n", "variant", "wall", "cpu");
    double mw[V_COUNT], mc[V_COUNT];
    for (int v = 0; v < V_COUNT; v++) {
        mw[v] = bench_median(wall[v], o.reps);
        mc[v] = bench_median(cpu[v], o.reps);
        printf("%-40s %10.3f %10.3f\n", names[v], mw[v], mc[v]);
    }
    printf("\nreference / fused with dropout, forward + backward: %.2fx wall, %.2fx cpu\n",
           mw[V_REF_FB] / mw[V_FUSED_FB], mc[V_REF_FB] / mc[V_FUSED_FB]);
    printf("fused with / without dropout, forward + backward:   %.2fx wall, %.2fx cpu\n",
           mw[V_FUSED_FB] / mw[V_FUSED_NODROP_FB], mc[V_FUSED_FB] / mc[V_FUSED_NODROP_FB]);
    printf("mask draw, float noise / keep bits:                 %.2fx wall, %.2fx cpu\n",
           mw[V_DRAW_FLOAT] / mw[V_DRAW_BITS], mc[V_DRAW_FLOAT] / mc[V_DRAW_BITS]);
    for (int v = 0; v < V_COUNT; v++) {
        free(wall[v]);
        free(cpu[v]);
    }
    free(bits);
    ts_tensor_free(qkv);
    ts_tensor_free(mask);
    ts_tensor_free(noise);
    return 0;
}
