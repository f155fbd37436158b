/* bench/optim: one AdamW step over one rank's shards of bench_fsdp_step's
 * GPT (4 layers, d 256, vocab 64, seq 128: each parameter's first half of
 * rows, as rank 0 of 2 holds them), per parameter against fused, on each
 * kernel path the CPU runs, in the same run, the variants' steps
 * interleaved (the order rotating every round) so that a drifting machine
 * load slows them alike. Medians over --steps rounds, after 3 warm-up
 * rounds.
 *
 * The parameters are views of one flat buffer, as an FSDP group's shards
 * without padding; their gradients either separate tensors (fully_shard
 * before its gradients became views of the reduction's output: one kernel
 * call per parameter) or views of one flat buffer in the same layout
 * (fully_shard's gradients now, with or without offload, or any flat
 * gradient buffer: one call for all). The row "per-param avx2" is the
 * optimizer as it was before issue 12 (AVX2 per parameter).
 *
 * Usage: bench_optim [--steps N] [--layers L] [--dim D] */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/bench_common.h"
#include "optim/internal.h"
#include "tensor/internal.h"
#include "tensor/kernels.h"
#include "tensorshard.h"

enum { MAXP = 256, MAXV = 8, MAXS = 128 };

typedef struct variant {
    const char *name;
    ts__kpath path;
    bool fused, flat_grads;
    ts_tensor *pbuf, *gbuf, *p[MAXP], *g[MAXP];
    ts_optim *o;
    double t[MAXS];
} variant;

static int g_n;
static int64_t g_numel[MAXP];

static void variant_init(variant *v)
{
    int64_t total = 0;
    for (int i = 0; i < g_n; i++) total += g_numel[i];
    CHECK(ts_tensor_full(TS_F32, 1, &total, 0.01, &v->pbuf));
    if (v->flat_grads) CHECK(ts_tensor_full(TS_F32, 1, &total, 1e-3, &v->gbuf));
    int64_t off = 0;
    for (int i = 0; i < g_n; i++) {
        int64_t st = 1;
        CHECK(ts__tensor_alias(v->pbuf, 1, &g_numel[i], &st, off, &v->p[i]));
        if (v->flat_grads) CHECK(ts__tensor_alias(v->gbuf, 1, &g_numel[i], &st, off, &v->g[i]));
        else CHECK(ts_tensor_full(TS_F32, 1, &g_numel[i], 1e-3, &v->g[i]));
        CHECK(ts_tensor_set_requires_grad(v->p[i], true));
        CHECK(ts_tensor_set_grad(v->p[i], v->g[i]));
        off += g_numel[i];
    }
    ts_adam_options ao = ts_adamw_options_default();
    ao.fused = v->fused;
    CHECK(ts_adamw_new(g_n, v->p, &ao, &v->o));
}

static void variant_fini(variant *v)
{
    ts_optim_free(v->o);
    for (int i = 0; i < g_n; i++) ts_tensor_free(v->p[i]), ts_tensor_free(v->g[i]);
    ts_tensor_free(v->pbuf);
    ts_tensor_free(v->gbuf);
}

int main(int argc, char **argv)
{
    int steps = 21, layers = 4, dim = 256;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--steps")) steps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--layers")) layers = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--dim")) dim = atoi(argv[i + 1]);
        else {
            fprintf(stderr, "usage: %s [--steps N] [--layers L] [--dim D]\n", argv[0]);
            return 2;
        }
    }
    if (steps < 1 || steps > 128 || layers < 1 || dim < 4 || dim % 4 || (argc - 1) % 2) {
        fprintf(stderr, "usage: %s [--steps N (1..128)] [--layers L] [--dim D (a multiple of 4)]\n", argv[0]);
        return 2;
    }
    ts_gpt_config gc = ts_gpt_config_default();
    gc.vocab_size = 64, gc.block_size = 128, gc.n_layer = layers, gc.n_head = 4, gc.d_model = dim;
    ts_module *m;
    CHECK(ts_gpt_new(&gc, &m));
    ts_named_params np;
    CHECK(ts_module_named_parameters(m, &np));
    int64_t total = 0;
    for (int i = 0; i < np.n && g_n < MAXP; i++) { /* rank 0's rows of 2: the first ceil(rows / 2) */
        ts_tensor *t = *np.items[i].slot;
        int64_t rows = ts_tensor_size(t, 0), row = ts_tensor_numel(t) / (rows ? rows : 1);
        g_numel[g_n++] = (rows + 1) / 2 * row;
        total += g_numel[g_n - 1];
    }
    ts_named_params_free(&np);
    ts_module_free(m);

    variant vs[MAXV] = {
        {.name = "per-param scalar", .path = TS__KPATH_SCALAR},
        {.name = "per-param avx2 (before)", .path = TS__KPATH_AVX2},
        {.name = "per-param avx512", .path = TS__KPATH_AVX512},
        {.name = "fused avx512", .path = TS__KPATH_AVX512, .fused = true},
        {.name = "fused avx512 flat grads", .path = TS__KPATH_AVX512, .fused = true, .flat_grads = true},
        {.name = "fused avx2 flat grads", .path = TS__KPATH_AVX2, .fused = true, .flat_grads = true},
    };
    int nv = 6;
    for (int k = 0; k < nv; k++) variant_init(&vs[k]);
    for (int s = -3; s < steps; s++)
        for (int j = 0; j < nv; j++) {
            variant *v = &vs[(j + s + 3) % nv];
            if (!ts__kpath_supported(v->path)) continue;
            ts__kpath_force((int)v->path);
            double t0 = bench_now_s();
            CHECK(ts_optim_step(v->o));
            double dt = bench_now_s() - t0;
            ts__kpath_force(-1);
            if (s >= 0) v->t[s] = dt;
        }
    printf("bench_optim: AdamW over one rank's shards (1 of 2) of a GPT %d layers, d %d: %d parameters, %lld "
           "elements (%.1f MiB of parameters; the step reads and writes parameters, exp_avg, exp_avg_sq and reads "
           "the gradients: %.1f MiB moved)\n",
           layers, dim, g_n, (long long)total, (double)total * 4 / 1048576.0, (double)total * 4 * 7 / 1048576.0);
    printf("medians (and best) of %d steps, variants interleaved; GB/s and 'vs before' of the medians\n%-26s %10s %10s "
           "%10s %8s %12s\n",
           steps, "variant", "step ms", "best ms", "GB/s", "calls", "vs before");
    double before = 0;
    for (int k = 0; k < nv; k++)
        if (vs[k].path == TS__KPATH_AVX2 && !vs[k].fused && ts__kpath_supported(TS__KPATH_AVX2))
            before = bench_median(vs[k].t, steps);
    for (int k = 0; k < nv; k++) {
        if (!ts__kpath_supported(vs[k].path)) {
            printf("%-26s %10s (skipped: this CPU has no %s)\n", vs[k].name, "-", ts__kpath_name(vs[k].path));
            continue;
        }
        double med = bench_median(vs[k].t, steps), best = vs[k].t[0]; /* sorted by the median */
        int calls = vs[k].fused ? ts__optim_fused_calls(vs[k].o) : g_n;
        printf("%-26s %10.3f %10.3f %10.2f %8d %12.3f\n", vs[k].name, med * 1e3, best * 1e3,
               (double)total * 4 * 7 / med / 1e9, calls, before > 0 ? med / before : 0.0);
    }
    for (int k = 0; k < nv; k++) variant_fini(&vs[k]);
    return 0;
}
