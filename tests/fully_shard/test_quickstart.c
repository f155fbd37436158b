/*
 * examples/quickstart.c, the README's first program, run as the README
 * says: under the launcher on 2 ranks (each rank holds half of the first
 * Linear's rows and its loss falls at every one of the 5 steps; rank 0's
 * first loss equals the one of the program run alone, where nothing is
 * sharded: same weights, same batch), alone, and with flags (--help exits
 * 0, anything else 2). tools/check_readme.py checks that the README's
 * copy of the program is this file.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "comm/launch.h"
#include "tests/helpers.h"

#ifndef TS_BUILD_DIR
#error "TS_BUILD_DIR (the build root, where examples/ is) must be defined"
#endif

enum { STEPS = 5 };

static void quickstart_path(char *path, size_t cap)
{
    snprintf(path, cap, "%s/examples/quickstart", TS_BUILD_DIR);
    cr_assert_eq(access(path, X_OK), 0, "%s is not built", path);
}

/* Runs the quickstart on `nproc` ranks through ts_launch (what tsrun
 * does); returns the launcher's exit code and the relayed stdout
 * ("[r] line" lines) and stderr, malloc'd. */
static int run_ranks(int nproc, char **out, char **err)
{
    char path[4096];
    quickstart_path(path, sizeof path);
    return th_launch_capture(path, nproc, NULL, NULL, out, err);
}

/* Runs the quickstart as a plain process with one argument (or none);
 * returns its exit status (-1 when it did not exit) and its stdout. */
static int run_alone(const char *arg, char **out)
{
    th_clear_launch_env();
    char path[4096];
    quickstart_path(path, sizeof path);
    int ofd = memfd_create("ts-quickstart-alone", MFD_CLOEXEC);
    cr_assert_geq(ofd, 0);
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        int devnull = open("/dev/null", O_RDWR);
        if (devnull < 0 || dup2(devnull, 0) < 0 || dup2(ofd, 1) < 0 || dup2(devnull, 2) < 0) _exit(120);
        execl(path, path, arg, (char *)NULL);
        _exit(121);
    }
    int status = 0;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    *out = th_slurp_fd(ofd);
    close(ofd);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* The losses rank r printed ("rank R step S loss L", prefixed with
 * `prefix` when relayed); asserts all STEPS of them are there, in order. */
static void losses(const char *out, int r, bool relayed, double loss[STEPS])
{
    int seen = 0;
    for (const char *line = out; line && *line; line = strchr(line, '\n'), line = line ? line + 1 : NULL) {
        const char *p = line;
        if (relayed) {
            int pr, n = 0;
            if (sscanf(p, "[%d] %n", &pr, &n) != 1 || n == 0 || pr != r) continue;
            p += n;
        }
        int rr, step;
        double v;
        if (sscanf(p, "rank %d step %d loss %lf", &rr, &step, &v) != 3 || rr != r) continue;
        cr_assert_eq(step, seen + 1, "rank %d: step %d after %d steps:\n%s", r, step, seen, out);
        loss[seen++] = v;
    }
    cr_assert_eq(seen, STEPS, "rank %d printed %d step lines, not %d:\n%s", r, seen, STEPS, out);
}

Test(fully_shard_quickstart, trains_on_two_ranks_as_the_readme_says, .timeout = 90)
{
    char *out, *err;
    int code = run_ranks(2, &out, &err);
    cr_assert_eq(code, 0, "the quickstart on 2 ranks exited %d\nstdout:\n%s\nstderr:\n%s", code, out, err);
    char *alone;
    cr_assert_eq(run_alone(NULL, &alone), 0, "the quickstart alone failed:\n%s", alone);
    double one[STEPS];
    losses(alone, 0, false, one);
    cr_expect_not_null(strstr(alone, "rank 0 holds 0.weight as (64, 16) of (64, 16)\n"), "alone:\n%s", alone);
    for (int r = 0; r < 2; r++) {
        char want[96];
        snprintf(want, sizeof want, "[%d] rank %d holds 0.weight as (32, 16) of (64, 16)\n", r, r);
        cr_expect_not_null(strstr(out, want), "no line '%s' in\n%s", want, out);
        double l[STEPS];
        losses(out, r, true, l);
        for (int s = 1; s < STEPS; s++)
            cr_expect_lt(l[s], l[s - 1], "rank %d: the loss rose at step %d (%.4f -> %.4f):\n%s", r, s + 1, l[s - 1],
                         l[s], out);
        /* Printed to 4 decimals: the first forward, sharded or not, is
         * the same computation on the same weights and batch. */
        if (r == 0) cr_expect_eq(l[0], one[0], "rank 0's first loss %.4f on 2 ranks, %.4f alone", l[0], one[0]);
    }
    free(alone);
    free(out);
    free(err);
}

Test(fully_shard_quickstart, help_exits_zero_and_other_flags_two, .timeout = 30)
{
    char *out;
    cr_expect_eq(run_alone("--help", &out), 0);
    cr_expect_not_null(strstr(out, "usage: tsrun --nproc-per-node 2 "), "--help printed:\n%s", out);
    cr_expect_null(strstr(out, "step"), "--help trained:\n%s", out);
    free(out);
    cr_expect_eq(run_alone("--steps", &out), 2);
    cr_expect_null(strstr(out, "step"), "a flag it does not take trained:\n%s", out);
    free(out);
}
