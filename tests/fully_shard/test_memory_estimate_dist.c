/* ts_fsdp_memory_estimate on 2 real ranks (tsrun): each rank trains a
 * small GPT sharded over both (vocabulary 33: the root's chunks are
 * uneven), measures the peak of TS_MEM_STORAGE during a step after a
 * warm-up one, and compares it with its own prediction; float32 with
 * prefetch, without prefetch, and every block checkpointed. A rank whose
 * prediction is off by more than 10% (the bound) exits 3 naming
 * both; the test asserts that the job exits 0 and that every rank
 * printed its three lines. */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <fcntl.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tensorshard.h"
#include "tests/helpers.h"

#ifndef TS_BUILD_DIR
#error "TS_BUILD_DIR (the build root, where tools/tsrun is) must be defined"
#endif

extern char **environ;

enum { B = 4, T = 64, V = 33 };

/* ------------------------------------------------------------ rank side */

static void one_case(int rank, const char *name, bool prefetch, bool ckpt)
{
    ts_gpt_config g = ts_gpt_config_default();
    g.vocab_size = V, g.block_size = T, g.n_layer = 3, g.n_head = 4, g.d_model = 64;
    ts_manual_seed(1);
    ts_module *m;
    TH_RANK_OK(11, ts_gpt_new(&g, &m));
    for (int l = 0; l < g.n_layer; l++) {
        char bn[32];
        ts_module *b;
        snprintf(bn, sizeof bn, "blocks.%d", l);
        TH_RANK_OK(12, ts_module_get_submodule(m, bn, &b));
        if (ckpt) TH_RANK_OK(12, ts_checkpoint_module(b));
        TH_RANK_OK(12, ts_fully_shard(b, NULL));
    }
    TH_RANK_OK(13, ts_fully_shard(m, NULL));
    TH_RANK_OK(13, ts_fsdp_set_implicit_prefetch(m, prefetch, prefetch));
    ts_named_params np;
    TH_RANK_OK(14, ts_module_named_parameters(m, &np));
    ts_tensor *ps[64];
    if (np.n > 64) _exit(14);
    for (int i = 0; i < np.n; i++) ps[i] = *np.items[i].slot;
    ts_adam_options ao = ts_adamw_options_default();
    ts_optim *opt;
    TH_RANK_OK(15, ts_adamw_new(np.n, ps, &ao, &opt));
    int64_t is[2] = {B, T}, tsz[1] = {B * T}, fs[2] = {B * T, V};
    ts_tensor *ids, *tg;
    TH_RANK_OK(16, ts_tensor_empty(TS_I64, 2, is, &ids));
    TH_RANK_OK(16, ts_tensor_empty(TS_I64, 1, tsz, &tg));
    int64_t *a = ts_tensor_data(ids), *t = ts_tensor_data(tg);
    for (int i = 0; i < B * T; i++) a[i] = (i * 7 + rank * 3) % V, t[i] = (i * 11 + rank) % V;
    for (int s = 0; s < 2; s++) {
        if (s == 1) {
            TH_RANK_OK(17, ts_barrier(ts_dist_world(), NULL));
            ts_mem_reset_peak();
        }
        ts_tensor *logits, *flat, *loss;
        TH_RANK_OK(18, ts_module_call1(m, ids, &logits));
        TH_RANK_OK(18, ts_reshape(logits, 2, fs, &flat));
        TH_RANK_OK(18, ts_cross_entropy(flat, tg, -100, TS_REDUCTION_MEAN, &loss));
        TH_RANK_OK(18, ts_backward(loss, NULL, false));
        TH_RANK_OK(18, ts_optim_step(opt));
        ts_optim_zero_grad(opt, true);
        ts_tensor_free(logits), ts_tensor_free(flat), ts_tensor_free(loss);
    }
    /* the peak less what lives outside the step: the ids and targets, B*T int64 each (2048 bytes: a pool
     * class exactly); the shards and the optimizer state live before it and the prediction includes them */
    size_t measured = ts_mem_peak_bytes(TS_MEM_STORAGE) - 2 * (size_t)(B * T * 8);
    ts_fsdp_memory_options mo = ts_fsdp_memory_options_default();
    mo.input_ndim = 2, mo.input_shape[0] = B, mo.input_shape[1] = T;
    ts_fsdp_memory_report r;
    TH_RANK_OK(19, ts_fsdp_memory_estimate(m, &mo, &r));
    double ratio = (double)r.peak_bytes / (double)measured;
    printf("rank %d %s: predicted %zu measured %zu ratio %.4f\n", rank, name, r.peak_bytes, measured, ratio);
    fflush(stdout);
    if (!(ratio > 0.9 && ratio < 1.1)) {
        fprintf(stderr, "rank %d %s: predicted %zu bytes, measured %zu: ratio %.4f outside [0.9, 1.1]\n", rank, name,
                r.peak_bytes, measured, ratio);
        _exit(3);
    }
    /* checkpointed: a node's inputs go once its backward has run, and the
     * estimate plays that. Measured is either the predicted peak (ratio
     * 1.0000) or 104 KiB under it (1.0293), by whether a collective's
     * buffer is still held at the peak (timing); keeping the inputs to the
     * end of the step the estimate said 1.0175 or 1.0473 */
    if (ckpt && !(ratio > 0.995 && ratio < 1.035)) {
        fprintf(stderr, "rank %d %s: predicted %zu bytes, measured %zu: ratio %.4f outside [0.995, 1.035]\n", rank,
                name, r.peak_bytes, measured, ratio);
        _exit(3);
    }
    ts_tensor_free(ids), ts_tensor_free(tg);
    ts_optim_free(opt);
    ts_named_params_free(&np);
    ts_module_free(m);
}

static void rank_main(void)
{
    TH_RANK_OK(10, ts_dist_init(NULL));
    int rank = ts_comm_rank(ts_dist_world());
    one_case(rank, "fsdp", true, false);
    one_case(rank, "fsdp-nopf", false, false);
    one_case(rank, "fsdp-ac", true, true);
    TH_RANK_OK(20, ts_dist_finalize());
    exit(0);
}

__attribute__((constructor)) static void mem_rank_role(void)
{
    if (getenv("TS_TEST_MEM_RANK")) rank_main();
}

/* ------------------------------------------------------------ test side */

Test(fully_shard_memory_estimate_dist, predicted_peak_within_10_percent_on_2_ranks, .timeout = 240)
{
    char *out = th_tsrun_self(TS_BUILD_DIR, 2, "TS_TEST_MEM_RANK=1");
    static const char *const lines[] = {"rank 0 fsdp:", "rank 1 fsdp:", "rank 0 fsdp-nopf:", "rank 1 fsdp-nopf:",
                                        "rank 0 fsdp-ac:", "rank 1 fsdp-ac:"};
    for (int i = 0; i < 6; i++) cr_expect(strstr(out, lines[i]) != NULL, "no line '%s' in:\n%s", lines[i], out);
    free(out);
}
