/*
 * examples/train_gpt's progress on 2 ranks (issue 21 §4): the step lines
 * (step N/STEPS, s/step, ETA, global tokens/s, memory as the maximum over
 * the ranks), the closing time line, the --metrics file (every field of
 * every line, read with jansson), tools/trace_plot drawing it and the log
 * (skipped without python3-matplotlib), and the --schedule / --warmup
 * flags, on their own and against a --resume.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "comm/launch.h"
#include "optim/optim.h"
#include "tests/helpers.h"
#include "text/tokenizer.h"

#ifndef TS_BUILD_DIR
#error "TS_BUILD_DIR (the build root, where examples/ is) must be defined"
#endif

/* Runs build/examples/train_gpt with args (NULL-terminated) on nproc
 * ranks; returns the job's exit code and the relayed stdout and stderr
 * ("[r] line" lines), malloc'd. */
static int run_gpt(int nproc, const char *const *args, char **out, char **err)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/examples/train_gpt", TS_BUILD_DIR);
    cr_assert_eq(access(path, X_OK), 0, "%s is not built", path);
    return th_launch_capture(path, nproc, args, NULL, out, err);
}

static char *run_gpt_ok(int nproc, const char *const *args)
{
    char *out, *err;
    int code = run_gpt(nproc, args, &out, &err);
    cr_assert_eq(code, 0, "train_gpt exited %d\nstdout:\n%s\nstderr:\n%s", code, out, err);
    free(err);
    return out;
}

/* A token file: a permutation of 0..36 repeated (each token has one
 * successor, so the loss falls in a few steps). */
static void write_tokens(const char *path, size_t n)
{
    static const int32_t perm[37] = {5, 17, 30, 2,  11, 24, 36, 8,  19, 1, 27, 14, 33, 6,  22, 0,  29, 12, 35,
                                     9, 20, 3,  26, 15, 31, 7,  18, 34, 4, 23, 10, 28, 16, 32, 13, 21, 25};
    int32_t *ids = malloc(n * sizeof *ids);
    cr_assert(ids);
    for (size_t i = 0; i < n; i++) ids[i] = perm[i % 37];
    TH_OK(ts_tokenizer_write_bin(ids, n, path));
    free(ids);
}

/* A temporary folder of this test's files. */
static void temp_dir(char *dir, size_t cap)
{
    const char *t = getenv("TMPDIR");
    snprintf(dir, cap, "%s/ts_metrics_XXXXXX", t && *t ? t : "/tmp");
    cr_assert_not_null(mkdtemp(dir));
}

/* Rank 0's value after `key` on the line of `out` that starts with
 * `prefix` ("[0] step   10/"): NAN when there is none. */
static double line_value(const char *out, const char *prefix, const char *key)
{
    const char *l = strstr(out, prefix);
    if (!l) return NAN;
    const char *nl = strchr(l, '\n'), *k = strstr(l, key);
    double v;
    if (!k || (nl && k > nl) || sscanf(k + strlen(key), "%lf", &v) != 1) return NAN;
    return v;
}

enum { STEPS = 12, VAL_EVERY = 5, SEQ = 16, BATCH = 2, W = 2 };

/* The printed lr has 3 digits ("%.2e"): within half a unit of the third,
 * at most 0.5% of it; 0.6% tolerates the decimal's own rounding. */

/* The run: 2 ranks, a WSD schedule with a warmup, validation every 5 steps
 * (and at the end), --metrics. Every line's fields: the step in order;
 * the lr the schedule gives that step (exactly: the JSON holds 17 digits);
 * a finite loss and gradient norm; the step's time and its tokens of both
 * ranks / that time; memory figures that are positive and consistent
 * (peaks never fall, peak RSS >= RSS); val_loss exactly on the validation
 * steps, equal to the printed line; nothing else. The step lines print the
 * same loss, lr and tensor peak, "step N/12", s/step, ETA, tokens/s
 * labelled global and the memory as a maximum over 2 ranks; the end
 * prints the time line. */
Test(fully_shard_train_metrics, metrics_file_has_every_field_of_every_step, .timeout = 120)
{
    char dir[4096], tokens[4200], metrics[4200];
    temp_dir(dir, sizeof dir);
    snprintf(tokens, sizeof tokens, "%s/tok.bin", dir);
    snprintf(metrics, sizeof metrics, "%s/m.jsonl", dir);
    write_tokens(tokens, 4000);
    const char *a[] = {
        "--data-tokens",    tokens, "--vocab",   "37",    "--steps", "12", "--val-every", "5",   "--seq",    "16",
        "--batch",          "2",    "--layers",  "1",     "--dim",   "32", "--schedule",  "wsd", "--warmup", "3",
        "--decay-fraction", "0.25", "--metrics", metrics, NULL};
    char *out = run_gpt_ok(W, a);
    ts_lr_schedule sched = {.kind = TS_LR_WARMUP_STABLE_DECAY,
                            .base_lr = 3e-3,
                            .warmup_steps = 3,
                            .total_steps = STEPS,
                            .min_lr = 3e-4,
                            .decay_fraction = 0.25};

    FILE *f = fopen(metrics, "r");
    cr_assert_not_null(f, "no %s:\n%s", metrics, out);
    char line[4096];
    int n = 0, vals = 0;
    double prev_peak = 0, prev_hwm = 0, prev_elapsed = 0;
    static const char *const keys[] = {"step",         "loss",           "lr",        "grad_norm",
                                       "tokens_per_s", "seconds",        "elapsed_s", "peak_tensor_bytes",
                                       "rss_bytes",    "peak_rss_bytes", "val_loss"};
    while (fgets(line, sizeof line, f)) {
        cr_assert(strchr(line, '\n'), "line %d is not one line: %s", n + 1, line);
        json_error_t je;
        json_t *o = json_loads(line, 0, &je);
        cr_assert_not_null(o, "line %d is not JSON (%s): %s", n + 1, je.text, line);
        cr_assert(json_is_object(o), "line %d: %s", n + 1, line);
        n++;
        const char *key;
        json_t *v;
        json_object_foreach(o, key, v)
        {
            bool known = false;
            for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) known |= !strcmp(key, keys[i]);
            cr_assert(known, "line %d: unknown field '%s'", n, key);
        }
        cr_assert(json_is_integer(json_object_get(o, "step")), "line %d: %s", n, line);
        cr_assert_eq(json_integer_value(json_object_get(o, "step")), n, "line %d is step %lld", n,
                     (long long)json_integer_value(json_object_get(o, "step")));
        for (size_t i = 1; i < 7; i++)
            cr_assert(json_is_real(json_object_get(o, keys[i])), "line %d: %s is not a number: %s", n, keys[i], line);
        double loss = json_real_value(json_object_get(o, "loss")), lr = json_real_value(json_object_get(o, "lr"));
        double gn = json_real_value(json_object_get(o, "grad_norm"));
        double tps = json_real_value(json_object_get(o, "tokens_per_s"));
        double sec = json_real_value(json_object_get(o, "seconds"));
        double elapsed = json_real_value(json_object_get(o, "elapsed_s"));
        cr_assert(isfinite(loss) && loss > 0 && loss < 10, "line %d: loss %g", n, loss);
        cr_assert_eq(lr, ts_lr_at(&sched, n - 1), "step %d: lr %.17g, the schedule's %.17g", n, lr,
                     ts_lr_at(&sched, n - 1));
        cr_assert(isfinite(gn) && gn > 0, "line %d: grad_norm %g", n, gn);
        cr_assert(sec > 0 && sec < 60, "line %d: seconds %g", n, sec);
        /* the step's tokens on both ranks over its time (relative 1e-12: %.17g round trips) */
        double want_tps = (double)W * BATCH * SEQ / sec;
        cr_assert_leq(fabs(tps - want_tps), 1e-12 * want_tps, "line %d: tokens_per_s %.17g, want %.17g", n, tps,
                      want_tps);
        cr_assert(elapsed >= prev_elapsed && elapsed >= sec * 0.999, "line %d: elapsed_s %g after %g (step %g)", n,
                  elapsed, prev_elapsed, sec);
        for (size_t i = 7; i < 10; i++)
            cr_assert(json_is_integer(json_object_get(o, keys[i])) && th_json_int(o, keys[i]) > 0,
                      "line %d: %s is not a positive integer: %s", n, keys[i], line);
        double peak = (double)th_json_int(o, "peak_tensor_bytes"), rss = (double)th_json_int(o, "rss_bytes");
        double hwm = (double)th_json_int(o, "peak_rss_bytes");
        cr_assert(peak >= prev_peak && hwm >= prev_hwm, "line %d: a peak fell: %s", n, line);
        cr_assert_geq(hwm, rss, "line %d: peak RSS below RSS: %s", n, line);
        json_t *val = json_object_get(o, "val_loss");
        bool val_step = n % VAL_EVERY == 0 || n == STEPS;
        cr_assert_eq(val != NULL, val_step, "line %d: val_loss %s", n, val ? "where no validation ran" : "missing");
        char pre[64];
        if (val) {
            vals++;
            cr_assert(json_is_real(val) && json_real_value(val) > 0, "line %d: %s", n, line);
            snprintf(pre, sizeof pre, "[0] step %4d  val loss ", n);
            double printed = line_value(out, pre, "val loss ");
            cr_assert_leq(fabs(printed - json_real_value(val)), 0.5e-4 + 1e-12, "step %d: val loss %.9g, printed %.4f",
                          n, json_real_value(val), printed);
        }
        /* the step line, when there is one: the same loss, lr and tensor peak, to its digits */
        snprintf(pre, sizeof pre, "[0] step %4d/%d  loss ", n, STEPS);
        const char *sl = strstr(out, pre);
        if (sl) {
            cr_assert_leq(fabs(line_value(out, pre, "loss ") - loss), 0.5e-4 + 1e-12, "step %d: %.80s", n, sl);
            cr_assert_leq(fabs(line_value(out, pre, "  lr ") - lr), 0.006 * lr, "step %d: %.120s", n, sl);
            cr_assert_leq(fabs(line_value(out, pre, "peak tensors ") - peak / 1048576.0), 0.05 + 1e-9, "step %d", n);
            const char *nl = strchr(sl, '\n');
            const char *parts[] = {"/step  ETA ", " tokens/s global  ", " MiB (max over 2 ranks)"};
            for (int i = 0; i < 3; i++) {
                const char *p = strstr(sl, parts[i]);
                cr_assert(p && p < nl, "step %d's line lacks '%s': %.*s", n, parts[i], (int)(nl - sl), sl);
            }
        }
        prev_peak = peak, prev_hwm = hwm, prev_elapsed = elapsed;
        json_decref(o);
    }
    fclose(f);
    cr_assert_eq(n, STEPS, "%d lines for %d steps", n, STEPS);
    cr_assert_eq(vals, 3, "validation at steps 5, 10 and 12");
    cr_assert_not_null(strstr(out, "[0] step    1/12  loss "), "the first step's line:\n%s", out);
    cr_assert_not_null(strstr(out, "[0] time: 12 steps in "), "no time line:\n%s", out);
    cr_assert_not_null(strstr(out, ", mean step "), "%s", out);
    free(out);
    unlink(metrics);
    unlink(tokens);
    rmdir(dir);
}

/* A duration as print_step_line writes it ("4.52ms", "212ms", "1.25s",
 * "12.5s", "1m02s"), in seconds; its last printed digit's half in *tol. */
static double parse_duration(const char *p, double *tol)
{
    char *e;
    double v = strtod(p, &e);
    if (!strncmp(e, "ms", 2)) {
        *tol = v < 10 ? 0.5e-5 : 0.5e-3;
        return v * 1e-3;
    }
    if (*e == 'm') {
        *tol = 0.5;
        return v * 60 + strtod(e + 1, NULL);
    }
    *tol = v < 10 ? 0.5e-2 : 0.5e-1;
    return v;
}

/* With more steps than lines (40 steps: a line every 2), a line's s/step
 * is the mean of the metrics' step seconds since the line before (it
 * printed half of it: the window's mean divided by the window again). */
Test(fully_shard_train_metrics, step_line_time_is_the_windows_mean, .timeout = 120)
{
    char dir[4096], tokens[4200], metrics[4200];
    temp_dir(dir, sizeof dir);
    snprintf(tokens, sizeof tokens, "%s/tok.bin", dir);
    snprintf(metrics, sizeof metrics, "%s/m.jsonl", dir);
    write_tokens(tokens, 4000);
    const char *a[] = {"--data-tokens", tokens, "--vocab", "37", "--steps",   "40",    "--seq", "16", "--batch", "2",
                       "--layers",      "1",    "--dim",   "32", "--metrics", metrics, NULL};
    char *out = run_gpt_ok(W, a);
    double sec[41] = {0};
    FILE *f = fopen(metrics, "r");
    cr_assert_not_null(f, "no %s:\n%s", metrics, out);
    char line[4096];
    for (int n = 1; n <= 40 && fgets(line, sizeof line, f); n++) {
        json_t *o = json_loads(line, 0, NULL);
        cr_assert_not_null(o, "line %d: %s", n, line);
        sec[n] = json_real_value(json_object_get(o, "seconds"));
        json_decref(o);
    }
    fclose(f);
    int checked = 0, prev = 0;
    for (int n = 1; n <= 40; n++) {
        char pre[64];
        snprintf(pre, sizeof pre, "[0] step %4d/40  loss ", n);
        const char *sl = strstr(out, pre);
        if (!sl) continue;
        const char *lr = strstr(sl, "  lr ");
        cr_assert_not_null(lr, "%.120s", sl);
        const char *per = strchr(lr + 5, ' ');
        double tol, printed = parse_duration(per + 2, &tol), mean = 0;
        for (int k = prev + 1; k <= n; k++) mean += sec[k];
        mean /= n - prev;
        cr_assert_leq(fabs(printed - mean), tol + 1e-9, "step %d: %.3g s/step printed, the mean of steps %d-%d is %.6g",
                      n, printed, prev + 1, n, mean);
        checked += n - prev > 1;
        prev = n;
    }
    cr_assert_geq(checked, 10, "lines over windows of several steps: %d\n%s", checked, out);
    free(out);
    unlink(metrics);
    unlink(tokens);
    rmdir(dir);
}

/* Runs argv (NULL-terminated) with stdout and stderr into a memfd;
 * returns the wait status and the output (malloc'd). */
static int run_capture(char *const *argv, char **out)
{
    int fd = memfd_create("ts-trace-plot", MFD_CLOEXEC);
    cr_assert_geq(fd, 0);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, fd, 1);
    posix_spawn_file_actions_adddup2(&fa, fd, 2);
    pid_t pid;
    cr_assert_eq(posix_spawn(&pid, argv[0], &fa, NULL, argv, environ), 0, "cannot start %s", argv[0]);
    posix_spawn_file_actions_destroy(&fa);
    int status;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    *out = th_slurp_fd(fd);
    close(fd);
    return status;
}

static void expect_png(const char *png)
{
    unsigned char magic[8] = {0};
    FILE *f = fopen(png, "rb");
    cr_assert_not_null(f, "no %s", png);
    cr_assert_eq(fread(magic, 1, 8, f), 8);
    fclose(f);
    cr_assert_eq(memcmp(magic, "\x89PNG\r\n\x1a\n", 8), 0, "%s is not a PNG", png);
    unlink(png);
}

/* tools/trace_plot draws a metrics file of train_gpt on 2 ranks (losses,
 * validation losses, lr) and the run's log through --loss (12 steps: a
 * line each, and 3 validation lines), printing how many points it read;
 * a metrics line without a step is named. Skipped without matplotlib. */
Test(fully_shard_train_metrics, trace_plot_draws_the_metrics_and_the_log, .timeout = 120)
{
    char *out = NULL;
    char *probe[] = {"/usr/bin/python3", "-c", "import matplotlib", NULL};
    if (access(probe[0], X_OK) != 0 || run_capture(probe, &out) != 0) {
        free(out);
        cr_skip_test("python3-matplotlib is not installed: trace_plot cannot draw");
    }
    free(out);
    char script[4096];
    snprintf(script, sizeof script, "%s/../../tools/trace_plot", TS_FIXTURES_DIR);
    cr_assert_eq(access(script, R_OK), 0, "%s is missing", script);
    char dir[4096], tokens[4200], metrics[4200], log[4200], png[4200];
    temp_dir(dir, sizeof dir);
    snprintf(tokens, sizeof tokens, "%s/tok.bin", dir);
    snprintf(metrics, sizeof metrics, "%s/m.jsonl", dir);
    snprintf(log, sizeof log, "%s/train.log", dir);
    snprintf(png, sizeof png, "%s/curves.png", dir);
    write_tokens(tokens, 4000);
    const char *a[] = {"--data-tokens", tokens,  "--vocab", "37", "--steps",  "12", "--val-every", "5",
                       "--seq",         "16",    "--batch", "2",  "--layers", "1",  "--dim",       "32",
                       "--metrics",     metrics, NULL};
    char *gpt = run_gpt_ok(W, a);
    FILE *f = fopen(log, "w");
    cr_assert_not_null(f);
    fputs(gpt, f);
    fclose(f);

    char *m[] = {"/usr/bin/python3", script, "--metrics", metrics, "-o", png, NULL};
    int status = run_capture(m, &out);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "trace_plot --metrics failed (%d):\n%s", status, out);
    cr_assert_not_null(strstr(out, "m.jsonl: 12 training losses (steps 1 to 12), 3 validation losses"), "%s", out);
    free(out);
    expect_png(png);
    /* the log: one line at step 1 and each step after (12 steps < 20), the validation lines */
    char *l[] = {"/usr/bin/python3", script, "--loss", log, "-o", png, NULL};
    status = run_capture(l, &out);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "trace_plot --loss failed (%d):\n%s", status, out);
    cr_assert_not_null(strstr(out, "train.log: 12 training losses (steps 1 to 12), 3 validation losses"), "%s\n%s", out,
                       gpt);
    free(out);
    expect_png(png);
    /* a metrics file with a line that is not one names the line */
    f = fopen(metrics, "a");
    fputs("{\"loss\": 1.0}\n", f);
    fclose(f);
    status = run_capture(m, &out);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) != 0, "%s", out);
    cr_assert_not_null(strstr(out, "line 13 is not a metrics object"), "%s", out);
    free(out);
    free(gpt);
    unlink(metrics);
    unlink(log);
    unlink(tokens);
    rmdir(dir);
}

/* The schedule flags: bad values are refused before training, naming the
 * value; with the default warmup, max(steps/10, min(100, steps/4)), each
 * --schedule prints at every step the lr of its ts_lr_at. */
Test(fully_shard_train_metrics, schedule_flags, .timeout = 120)
{
    struct {
        const char *args[8];
        const char *want[3];
    } bad[] = {
        {{"--schedule", "step", NULL}, {"--schedule 'step'", "constant, linear, cosine or wsd", NULL}},
        {{"--warmup", "20", "--steps", "10", NULL}, {"--warmup 20 is more than --steps 10", NULL}},
        {{"--decay-fraction", "0.3", NULL}, {"--decay-fraction goes with --schedule wsd", NULL}},
        {{"--schedule", "wsd", "--decay-fraction", "1.5", NULL}, {"--decay-fraction", "1.5", NULL}},
        {{"--warmup", "-1", NULL}, {"--warmup", "-1", NULL}},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char *out, *err;
        int code = run_gpt(1, bad[i].args, &out, &err);
        cr_expect_eq(code, 2, "%s: exit %d\n%s", bad[i].args[0], code, err);
        for (int k = 0; bad[i].want[k]; k++)
            cr_expect_not_null(strstr(err, bad[i].want[k]), "%s: lacks '%s':\n%s", bad[i].args[0], bad[i].want[k], err);
        cr_expect_null(strstr(out, "] step "), "trained before refusing:\n%s", out);
        free(out);
        free(err);
    }
    /* 20 steps: a line each; the default warmup max(2, min(100, 5)) = 5. (2 ranks: one rank under the
     * launcher steps far slower on a busy machine, its collectives' waits) */
    static const struct {
        const char *name;
        ts_lr_kind kind;
    } kinds[] = {{"constant", TS_LR_WARMUP_CONSTANT},
                 {"linear", TS_LR_WARMUP_LINEAR},
                 {"cosine", TS_LR_WARMUP_COSINE},
                 {"wsd", TS_LR_WARMUP_STABLE_DECAY}};
    for (int i = 0; i < 4; i++) {
        const char *a[] = {"--steps", "20",      "--layers", "1",          "--dim",       "16", "--seq",
                           "8",       "--batch", "1",        "--schedule", kinds[i].name, NULL};
        char *out = run_gpt_ok(2, a);
        ts_lr_schedule s = {.kind = kinds[i].kind,
                            .base_lr = 3e-3,
                            .warmup_steps = 5,
                            .total_steps = 20,
                            .min_lr = 3e-4,
                            .decay_fraction = 0.2};
        for (int step = 1; step <= 20; step++) {
            char pre[64];
            snprintf(pre, sizeof pre, "[0] step %4d/20  loss ", step);
            double lr = line_value(out, pre, "  lr "), want = ts_lr_at(&s, step - 1);
            cr_expect_leq(fabs(lr - want), 0.006 * want, "%s, step %d: lr %g printed, %g expected:\n%s", kinds[i].name,
                          step, lr, want, out);
        }
        free(out);
    }
}

/* --resume refuses a changed --schedule or --warmup (the schedule would
 * move), names both values, and takes the saved ones when not given; a
 * checkpoint that records none (saved before the flags existed) resumes
 * with the schedule it trained with. */
Test(fully_shard_train_metrics, resume_keeps_the_schedule, .timeout = 120)
{
    char dir[4096], ckpt[4200];
    temp_dir(dir, sizeof dir);
    snprintf(ckpt, sizeof ckpt, "%s/ckpt", dir);
    const char *a[] = {"--steps", "8", "--stop-after", "4",      "--layers", "1", "--dim",  "16", "--seq", "8",
                       "--batch", "1", "--schedule",   "linear", "--warmup", "2", "--save", ckpt, NULL};
    free(run_gpt_ok(2, a));
    const char *b[] = {"--resume", ckpt, "--schedule", "cosine", NULL};
    char *out, *err;
    cr_assert_eq(run_gpt(1, b, &out, &err), 2, "%s", err);
    cr_expect_not_null(strstr(err, "--schedule cosine, but --resume"), "%s", err);
    cr_expect_not_null(strstr(err, "saved with --schedule linear"), "%s", err);
    cr_expect_not_null(strstr(err, "the learning-rate schedule would change"), "%s", err);
    free(out);
    free(err);
    const char *c[] = {"--resume", ckpt, "--warmup", "3", NULL};
    cr_assert_eq(run_gpt(1, c, &out, &err), 2, "%s", err);
    cr_expect_not_null(strstr(err, "--warmup 3, but --resume"), "%s", err);
    cr_expect_not_null(strstr(err, "saved with --warmup 2"), "%s", err);
    free(out);
    free(err);
    /* adopted: step 5's lr is linear's with warmup 2 over 8 steps */
    const char *d[] = {"--resume", ckpt, NULL};
    out = run_gpt_ok(2, d);
    ts_lr_schedule s = {
        .kind = TS_LR_WARMUP_LINEAR, .base_lr = 3e-3, .warmup_steps = 2, .total_steps = 8, .min_lr = 3e-4};
    double lr = line_value(out, "[0] step    5/8  loss ", "  lr ");
    cr_expect_leq(fabs(lr - ts_lr_at(&s, 4)), 0.006 * ts_lr_at(&s, 4), "lr %g, want %g:\n%s", lr, ts_lr_at(&s, 4), out);
    free(out);
    /* a checkpoint from before --schedule (its flags without the three):
     * cosine with steps/10 + 1 = 1 warmup step, what it trained with, not
     * today's default of 2 */
    const char *e[] = {"--steps", "8", "--stop-after", "4", "--layers", "1",  "--dim", "16",
                       "--seq",   "8", "--batch",      "1", "--save",   ckpt, NULL};
    free(run_gpt_ok(2, e));
    char index[4300];
    snprintf(index, sizeof index, "%s/index.json", ckpt);
    size_t len;
    char *text = th_read_file(index, &len);
    char *from = strstr(text, " --schedule="), *to = from ? strchr(from, '"') : NULL;
    cr_assert(from && to, "no --schedule in the recorded flags:\n%s", text);
    memmove(from, to, strlen(to) + 1);
    FILE *f = fopen(index, "w");
    cr_assert(f && fputs(text, f) >= 0 && fclose(f) == 0);
    free(text);
    out = run_gpt_ok(2, d);
    ts_lr_schedule old = {
        .kind = TS_LR_WARMUP_COSINE, .base_lr = 3e-3, .warmup_steps = 1, .total_steps = 8, .min_lr = 3e-4};
    for (int step = 5; step <= 8; step++) {
        char pre[64];
        snprintf(pre, sizeof pre, "[0] step %4d/8  loss ", step);
        lr = line_value(out, pre, "  lr ");
        cr_expect_leq(fabs(lr - ts_lr_at(&old, step - 1)), 0.006 * ts_lr_at(&old, step - 1),
                      "step %d: lr %g, the old schedule's %g:\n%s", step, lr, ts_lr_at(&old, step - 1), out);
    }
    free(out);
    char cmd[4400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
}
