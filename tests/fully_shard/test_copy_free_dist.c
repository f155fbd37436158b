/*
 * fully_shard's copy-free collectives between real processes of one host
 * (comm/coll_direct.h: process_vm_readv between the ranks of tsrun):
 * examples/train_gpt trains a few steps with them (the default) and with
 * the packed path (TS_FSDP_COPY_FREE=0), and the full models it saves
 * (--save-full, safetensors) are the same bytes: f32 on 2 and 3 ranks
 * (uneven rows: a width of 36 over 3 ranks is not a multiple of rows per
 * rank everywhere), bf16 mixed precision with a float32 reduction, CPU
 * offload, accumulation without sync and with it (the copy-free
 * reductions then add into the shard gradients themselves). With
 * cross-memory attach refused
 * (TS_UCX_CMA=0) the copy-free groups fall back to the ring: same bytes.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "comm/launch.h"
#include "tests/helpers.h"

#ifndef TS_BUILD_DIR
#error "TS_BUILD_DIR (the build root, where examples/ is) must be defined"
#endif

/* Runs train_gpt on nproc ranks with the extra NULL-terminated args and
 * --save-full path; asserts it succeeded. */
static void train(int nproc, const char *copy_free, const char *const *extra, const char *path)
{
    th_clear_launch_env();
    setenv("TS_FSDP_COPY_FREE", copy_free, 1);
    char exe[4096];
    snprintf(exe, sizeof exe, "%s/examples/train_gpt", TS_BUILD_DIR);
    cr_assert_eq(access(exe, X_OK), 0, "%s is not built", exe);
    ts_launch_options o = ts_launch_options_default();
    o.nproc_per_node = nproc;
    o.forward_signals = false;
    o.out_fd = memfd_create("ts-cf-out", MFD_CLOEXEC);
    o.err_fd = memfd_create("ts-cf-err", MFD_CLOEXEC);
    cr_assert(o.out_fd >= 0 && o.err_fd >= 0);
    const char *base[] = {exe,  "--layers", "2", "--dim",   "36", "--heads",     "4", "--seq",
                          "16", "--batch",  "2", "--steps", "3",  "--save-full", path};
    char *argv[48];
    int n = 0;
    for (size_t i = 0; i < sizeof base / sizeof base[0]; i++) argv[n++] = (char *)base[i];
    for (int i = 0; extra && extra[i]; i++) argv[n++] = (char *)extra[i];
    argv[n] = NULL;
    ts_launch_result res;
    TH_OK(ts_launch(&o, argv, &res));
    char *out = th_slurp_fd(o.out_fd), *err = th_slurp_fd(o.err_fd);
    close(o.out_fd);
    close(o.err_fd);
    unsetenv("TS_FSDP_COPY_FREE");
    cr_assert_eq(res.exit_code, 0, "train_gpt (TS_FSDP_COPY_FREE=%s) on %d ranks exited %d\nstdout:\n%s\nstderr:\n%s",
                 copy_free, nproc, res.exit_code, out, err);
    free(out);
    free(err);
}

static void same_model(int nproc, const char *const *extra)
{
    const char *t = getenv("TMPDIR");
    char dir[4096], a[4200], b[4200];
    snprintf(dir, sizeof dir, "%s/ts_cf_XXXXXX", t && *t ? t : "/tmp");
    cr_assert_not_null(mkdtemp(dir));
    snprintf(a, sizeof a, "%s/copy_free.safetensors", dir);
    snprintf(b, sizeof b, "%s/packed.safetensors", dir);
    train(nproc, "1", extra, a);
    train(nproc, "0", extra, b);
    size_t na = 0, nb = 0;
    unsigned char *pa = th_read_file(a, &na), *pb = th_read_file(b, &nb);
    cr_assert(pa && pb && na > 1000, "saved models missing");
    cr_assert_eq(na, nb, "the saved models differ in size: %zu and %zu bytes", na, nb);
    cr_assert(memcmp(pa, pb, na) == 0, "the models trained copy-free and packed differ");
    free(pa);
    free(pb);
    unlink(a);
    unlink(b);
    rmdir(dir);
}

Test(fully_shard_copy_free_dist, f32_on_2_and_3_ranks, .timeout = 240)
{
    same_model(2, NULL);
    same_model(3, NULL);
}

Test(fully_shard_copy_free_dist, bf16_offload_and_accumulation, .timeout = 240)
{
    const char *mp[] = {"--param-dtype", "bf16", "--reduce-dtype", "f32", NULL};
    same_model(2, mp);
    const char *off[] = {"--offload", "cpu", NULL};
    same_model(2, off);
    const char *acc[] = {"--accum", "2", "--accum-mode", "nosync", "--param-dtype", "bf16", "--reduce-dtype",
                         "f32",     NULL};
    same_model(3, acc);
}

/* Microbatches with sync: each reduction after the first of a step adds
 * into the shard gradients, which are views of the first one's output, in
 * the copy-free reduce-scatter itself (ts__direct_reduce_scatter_add,
 * across processes); the packed path adds in a separate pass: same bytes. */
Test(fully_shard_copy_free_dist, synced_accumulation, .timeout = 240)
{
    const char *acc[] = {"--accum", "3", "--accum-mode", "sync", NULL};
    same_model(2, acc);
    same_model(3, acc);
}

Test(fully_shard_copy_free_dist, cma_refused_falls_back, .timeout = 240)
{
    setenv("TS_UCX_CMA", "0", 1);
    same_model(2, NULL);
    unsetenv("TS_UCX_CMA");
}
