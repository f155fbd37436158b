/*
 * train_gpt --init-from-hf (examples/train_gpt.c; docs/gpt2-weights.md)
 * with the Hugging Face GPT-2 fixture of tests/fixtures/hf_gpt2/
 * (tools/reference/make_hf_gpt2.py): on 2 ranks the deferred, sharded
 * model starts from the file's weights and fine-tunes on a token file;
 * conflicting shape flags are refused before anything is built.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "checkpoint/checkpoint.h"
#include "comm/launch.h"
#include "tests/helpers.h"
#include "text/tokenizer.h"

#ifndef TS_BUILD_DIR
#error "TS_BUILD_DIR (the build root, where examples/ is) must be defined"
#endif

#define MODEL TS_FIXTURES_DIR "/hf_gpt2/model.safetensors"

static char *exe_path(void)
{
    static char path[4096];
    snprintf(path, sizeof path, "%s/examples/train_gpt", TS_BUILD_DIR);
    cr_assert_eq(access(path, X_OK), 0, "%s is not built", path);
    return path;
}

/* train_gpt ARGS (NULL-terminated) on 2 ranks through the launcher;
 * asserts every rank exited 0; returns the relayed stdout, malloc'd. */
static char *run_two_ranks(const char *const *args)
{
    ts_launch_result res;
    char *out, *err;
    th_launch_capture(exe_path(), 2, args, &res, &out, &err);
    cr_assert_eq(res.exit_code, 0, "rank %d failed: exit %d signal %d\nstdout:\n%s\nstderr:\n%s", res.failed_rank,
                 res.exit_code, res.failed_signal, out, err);
    free(err);
    return out;
}

/* train_gpt ARGS alone; asserts it exits 2 with every string of want
 * (NULL-terminated) in its stderr and no training step. */
static void expect_refused(int nargs, const char *const *args, const char *const *want)
{
    th_clear_launch_env();
    int ofd = memfd_create("ts-hf-out", MFD_CLOEXEC), efd = memfd_create("ts-hf-err", MFD_CLOEXEC);
    cr_assert(ofd >= 0 && efd >= 0);
    char *argv[40] = {exe_path()};
    cr_assert_lt(nargs, 39);
    for (int i = 0; i < nargs; i++) argv[i + 1] = (char *)args[i];
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        int devnull = open("/dev/null", O_RDONLY);
        if (devnull < 0 || dup2(devnull, 0) < 0 || dup2(ofd, 1) < 0 || dup2(efd, 2) < 0) _exit(120);
        execv(argv[0], argv);
        _exit(121);
    }
    int status = 0;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    char *out = th_slurp_fd(ofd), *err = th_slurp_fd(efd);
    close(ofd);
    close(efd);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 2, "exit status %d, expected 2\nstdout:\n%s\nstderr:\n%s",
              status, out, err);
    for (int i = 0; want[i]; i++) cr_expect_not_null(strstr(err, want[i]), "the message lacks '%s':\n%s", want[i], err);
    cr_expect_null(strstr(out, "step "), "trained before refusing:\n%s", out);
    free(out);
    free(err);
}

/* a token file of a 37-token cycle in the fixture's vocabulary (300) */
static void write_tokens(const char *path, size_t n)
{
    int32_t *ids = malloc(n * sizeof *ids);
    cr_assert(ids);
    for (size_t i = 0; i < n; i++) ids[i] = (int32_t)((i % 37) * 7 + 11);
    TH_OK(ts_tokenizer_write_bin(ids, n, path));
    free(ids);
}

/* The model train_gpt trains is the file's: one step at a learning rate
 * far below the weights' last bit (1e-30: AdamW's first update is about
 * lr) leaves them unchanged, and the --save-full file (our names, the
 * gathered shards of the deferred 2-rank model) is bitwise the fixture
 * loaded by ts_ckpt_load_hf_gpt2 into a plain model. Then 30 steps
 * fine-tune it: the loss falls. */
Test(fully_shard_examples_hf, init_from_hf_on_two_ranks, .timeout = 120)
{
    char *dir = th_tmp_dir("ts-test-hf-gpt");
    char bin[512], full[512];
    snprintf(bin, sizeof bin, "%s/train.bin", dir);
    snprintf(full, sizeof full, "%s/full.safetensors", dir);
    write_tokens(bin, 3000);
    const char *a[] = {
        "--init-from-hf", MODEL, "--heads", "4",     "--data-tokens", bin,  "--seq", "16", "--global-batch", "4",
        "--steps",        "1",   "--lr",    "1e-30", "--save-full",   full, NULL};
    char *out = run_two_ranks(a);
    cr_assert(strstr(out, "GPT-2 weights: " MODEL " (2 layers, width 64, 4 heads, vocabulary 300, 32 positions)"), "%s",
              out);
    ts_gpt_config c;
    TH_OK(ts_ckpt_gpt2_config(MODEL, &c));
    c.n_head = 4;
    ts_module *m = NULL;
    TH_OK(ts_gpt_new(&c, &m));
    TH_OK(ts_ckpt_load_hf_gpt2(MODEL, m));
    ts_state_dict *want = NULL, *got = NULL;
    TH_OK(ts_module_state_dict(m, &want));
    TH_OK(ts_safetensors_load(full, &got));
    cr_assert_eq(ts_state_dict_size(got), ts_state_dict_size(want));
    for (int i = 0; i < ts_state_dict_size(want); i++) {
        const char *name = ts_state_dict_name(want, i);
        ts_tensor *w = ts_state_dict_tensor(want, i), *g = ts_state_dict_get(got, name);
        cr_assert(g && ts_tensor_numel(g) == ts_tensor_numel(w), "%s", name);
        cr_assert_eq(memcmp(ts_tensor_data(g), ts_tensor_data(w), (size_t)ts_tensor_numel(w) * 4), 0,
                     "'%s' is not the file's", name);
    }
    ts_state_dict_free(want);
    ts_state_dict_free(got);
    ts_module_free(m);
    free(out);

    const char *b[] = {"--init-from-hf", MODEL, "--heads", "4",  "--data-tokens", bin,    "--seq", "16",
                       "--global-batch", "4",   "--steps", "30", "--lr",          "3e-3", NULL};
    out = run_two_ranks(b);
    double first = 0, last = 0;
    const char *l = strstr(out, "[0] loss ");
    cr_assert(l && sscanf(l, "[0] loss %lf -> %lf", &first, &last) == 2, "no loss line:\n%s", out);
    cr_assert_lt(last, first * 0.5, "the loss did not fall: %g -> %g\n%s", first, last, out);
    free(out);
    th_rm_rf(dir);
    free(dir);
}

Test(fully_shard_examples_hf, conflicting_flags_are_refused, .timeout = 60)
{
    char *dir = th_tmp_dir("ts-test-hf-gpt"), bin[512];
    snprintf(bin, sizeof bin, "%s/train.bin", dir);
    write_tokens(bin, 1000);
    const char *layers[] = {"--init-from-hf", MODEL, "--data-tokens", bin, "--heads", "4", "--layers", "3"};
    expect_refused(8, layers, (const char *[]){"--layers 3, but --init-from-hf", "has --layers 2", NULL});
    const char *dim[] = {"--init-from-hf", MODEL, "--data-tokens", bin, "--dim", "128"};
    expect_refused(6, dim, (const char *[]){"--dim 128", "has --dim 64", NULL});
    const char *vocab[] = {"--init-from-hf", MODEL, "--data-tokens", bin, "--vocab", "64"};
    expect_refused(6, vocab, (const char *[]){"--vocab 64", "has --vocab 300", NULL});
    const char *seq[] = {"--init-from-hf", MODEL, "--data-tokens", bin, "--heads", "4", "--seq", "64"};
    expect_refused(8, seq, (const char *[]){"--seq 64", "has 32 positions", NULL});
    const char *chars[] = {"--init-from-hf", MODEL, "--heads", "4"};
    expect_refused(4, chars, (const char *[]){"needs token ids of its vocabulary (300)", NULL});
    const char *load[] = {"--init-from-hf", MODEL, "--load", MODEL};
    expect_refused(4, load, (const char *[]){"does not go with --load", NULL});
    const char *missing[] = {"--init-from-hf", "/nonexistent/gpt2.safetensors", "--data-tokens", bin};
    expect_refused(4, missing, (const char *[]){"--init-from-hf", "/nonexistent/gpt2.safetensors", NULL});
    th_rm_rf(dir);
    free(dir);
}
