/* ts_fsdp_memory_estimate on 2 real ranks (tsrun): each rank trains a
 * small GPT sharded over both (vocabulary 33: the root's chunks are
 * uneven), measures the peak of TS_MEM_STORAGE during a step after a
 * warm-up one, and compares it with its own prediction; float32 with
 * prefetch, without prefetch, and every block checkpointed. Then the same
 * for a user-defined module type (GatedMLP blocks, estimate_common.h):
 * plain, HSDP over a (2, 1) mesh, reshard after every 2nd forward, 2
 * microbatches without gradient sync, explicit prefetch. A rank whose
 * prediction is not the measured peak (within the real run's timing,
 * one_case) exits 3 naming both; the test asserts that the job exits 0
 * and that every rank printed its lines. */
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

#define EC_OK(expr) TH_RANK_OK(2, expr) /* a rank process: the call, its status and message, exit 2 */
#include "tests/fully_shard/estimate_common.h"

#ifndef TS_BUILD_DIR
#error "TS_BUILD_DIR (the build root, where tools/tsrun is) must be defined"
#endif

extern char **environ;

enum { B = 4, T = 64, V = 33 };

/* ------------------------------------------------------------ rank side */

/* The estimate plays the step each rank runs: the measured peak equals
 * the prediction (1.0000 in a quiet run), but for the real run's timing on
 * the communication thread. Under: a collective completed before the peak
 * and its buffers were gone (104 KiB with checkpointed blocks, 1.0315).
 * Over: comm's thread gave a collective's scratch back after the caller's
 * next allocation; 23 KiB on a 686 KiB peak (0.9675) when the suite ran
 * beside two others on 2 cores. The one-rank suite
 * (fully_shard_test_memory_estimate) holds the same models to the byte.
 * The hand-kept model this replaced was held to [0.9, 1.1]. */
static void check_peak(int rank, const char *name, size_t predicted, size_t measured)
{
    double ratio = (double)predicted / (double)measured;
    printf("rank %d %s: predicted %zu measured %zu ratio %.4f\n", rank, name, predicted, measured, ratio);
    fflush(stdout);
    if (!(ratio > 0.95 && ratio < 1.05)) {
        fprintf(stderr, "rank %d %s: predicted %zu bytes, measured %zu: ratio %.4f outside [0.95, 1.05]\n", rank, name,
                predicted, measured, ratio);
        _exit(3);
    }
}

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
    ts_optim *opt = ec_adamw(m);
    ts_tensor *ids, *tg;
    ec_inputs(true, B, T, V, rank, &ids, &tg);
    TH_RANK_OK(17, ts_barrier(ts_dist_world(), NULL));
    /* the peak less the ids and targets; the shards and the optimizer state live before it and the
     * prediction includes them */
    size_t measured = ec_measured_peak(m, opt, ids, tg, 1);
    ts_fsdp_memory_options mo = ts_fsdp_memory_options_default();
    mo.input_ndim = 2, mo.input_shape[0] = B, mo.input_shape[1] = T;
    ts_fsdp_memory_report r;
    TH_RANK_OK(19, ts_fsdp_memory_estimate(m, &mo, &r));
    check_peak(rank, name, r.peak_bytes, measured);
    ts_tensor_free(ids), ts_tensor_free(tg);
    ts_optim_free(opt);
    ts_module_free(m);
}

typedef struct user_case {
    const char *name;
    ec_shard_opts so;
    bool hsdp;
    int microbatches;
} user_case;

static const user_case k_user[] = {
    {"user", {.prefetch = true}, false, 1},
    {"user-hsdp-2x1", {.prefetch = true}, true, 1},
    {"user-reshard-every-2", {.prefetch = true, .policy = TS_RESHARD_EVERY_N, .every_n = 2}, false, 1},
    {"user-nosync-x2", {.prefetch = true}, false, 2},
    {"user-explicit-prefetch", {.prefetch = false, .explicit_pf = true}, false, 1},
};

/* The user module on both ranks: the estimate against the step measured. */
static void user_one(int rank, const user_case *uc)
{
    ec_shard_opts so = uc->so;
    ts_mesh *mesh = NULL;
    if (uc->hsdp) {
        int64_t shape[2] = {2, 1};
        const char *names[2] = {"replicate", "shard"};
        TH_RANK_OK(21, ts_mesh_new(ts_dist_world(), "cpu", 2, shape, names, &mesh));
        so.mesh = mesh;
    }
    ts_module *m = ec_user_model(true, &so);
    ts_fsdp_memory_options mo = ec_user_options();
    mo.microbatches = uc->microbatches;
    ts_fsdp_memory_report r;
    TH_RANK_OK(22, ts_fsdp_memory_estimate(m, &mo, &r));
    ts_optim *opt = ec_adamw(m);
    ts_tensor *x, *tg;
    ec_inputs(false, EC_ROWS, EC_IN, EC_CLASSES, rank, &x, &tg);
    TH_RANK_OK(23, ts_barrier(ts_dist_world(), NULL));
    size_t measured = ec_measured_peak(m, opt, x, tg, uc->microbatches);
    check_peak(rank, uc->name, r.peak_bytes, measured);
    ts_tensor_free(x), ts_tensor_free(tg);
    ts_optim_free(opt);
    ts_module_free(m);
    ts_mesh_free(mesh);
}

static void rank_main(void)
{
    TH_RANK_OK(10, ts_dist_init(NULL));
    int rank = ts_comm_rank(ts_dist_world());
    one_case(rank, "fsdp", true, false);
    one_case(rank, "fsdp-nopf", false, false);
    one_case(rank, "fsdp-ac", true, true);
    for (size_t i = 0; i < sizeof k_user / sizeof k_user[0]; i++) user_one(rank, &k_user[i]);
    TH_RANK_OK(20, ts_dist_finalize());
    exit(0);
}

__attribute__((constructor)) static void mem_rank_role(void)
{
    if (getenv("TS_TEST_MEM_RANK")) rank_main();
}

/* ------------------------------------------------------------ test side */

Test(fully_shard_memory_estimate_dist, predicted_peak_within_5_percent_on_2_ranks, .timeout = 240)
{
    char *out = th_tsrun_self(TS_BUILD_DIR, 2, "TS_TEST_MEM_RANK=1");
    static const char *const lines[] = {
        "rank 0 fsdp:", "rank 1 fsdp:", "rank 0 fsdp-nopf:", "rank 1 fsdp-nopf:", "rank 0 fsdp-ac:", "rank 1 fsdp-ac:"};
    for (int i = 0; i < 6; i++) cr_expect(strstr(out, lines[i]) != NULL, "no line '%s' in:\n%s", lines[i], out);
    for (size_t i = 0; i < sizeof k_user / sizeof k_user[0]; i++)
        for (int r = 0; r < 2; r++) {
            char line[96];
            snprintf(line, sizeof line, "rank %d %s:", r, k_user[i].name);
            cr_expect(strstr(out, line) != NULL, "no line '%s' in:\n%s", line, out);
        }
    free(out);
}
