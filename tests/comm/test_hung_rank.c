/*
 * A rank that never enters a collective (SIGSTOPped before it), under
 * tsrun with 4 ranks: every survivor's deadline error names that rank,
 * not the ring neighbour it happens to wait on, and tsrun's last line
 * names it too, not the survivor that exited first (comm.c, "Who never
 * entered"). This binary is its own rank program (TS_TEST_HUNG_RANK, run
 * by a constructor before Criterion starts).
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "comm/comm_internal.h"
#include "tests/helpers.h"

#ifndef TS_BUILD_DIR
#error "TS_BUILD_DIR must name the build root (tests/meson.build defines it)"
#endif
#define TSRUN TS_BUILD_DIR "/tools/tsrun"

/* ------------------------------------------------------------ rank side */

/* Small all-reduces (eager messages: no send waits for the stopped rank)
 * with a 2 s deadline; rank TS_TEST_HUNG_RANK stops itself before the
 * 6th. A survivor prints "hung-test R: <status>: <error>" and exits 5.
 * SIGTERM is ignored so that tsrun, which stops the job when the first
 * survivor exits, cannot end a survivor before it has printed (SIGKILL
 * after tsrun's grace ends it). */
__attribute__((constructor)) static void hung_test_role(void)
{
    const char *hv = getenv("TS_TEST_HUNG_RANK");
    if (!hv) return;
    int hung = atoi(hv);
    ts_dist_options o = ts_dist_options_default();
    o.timeout_s = 60;
    ts_status s = ts_dist_init(&o);
    if (s != TS_OK) {
        fprintf(stderr, "init %s: %s\n", ts_status_name(s), ts_last_error());
        _exit(10);
    }
    signal(SIGTERM, SIG_IGN);
    ts_comm *c = ts_dist_world();
    int rank = ts_comm_rank(c);
    ts__comm_set_timeout(c, 2.0);
    int64_t n = 64;
    ts_tensor *t = NULL;
    if (ts_tensor_zeros(TS_F32, 1, &n, &t) != TS_OK) _exit(11);
    for (int it = 0; it < 1000; it++) {
        if (rank == hung && it == 5) {
            raise(SIGSTOP);
            _exit(0); /* continued: the test is over */
        }
        s = ts_all_reduce(c, t, TS_REDUCE_SUM, NULL);
        if (s == TS_OK) continue;
        fprintf(stderr, "hung-test %d: %s: %s\n", rank, ts_status_name(s), ts_last_error());
        fflush(stderr);
        (void)ts_dist_finalize();
        _exit(5);
    }
    _exit(12); /* no failure seen */
}

/* ------------------------------------------------------------ test side */

extern char **environ;

/* Runs tsrun with 4 ranks, rank `hung` stopping itself; returns tsrun's
 * output (stdout and stderr, malloc'd) and its wait status. */
static char *run_job(int hung, int *status)
{
    th_clear_launch_env();
    unsetenv("TS_DIST_TIMEOUT");
    char hv[16];
    snprintf(hv, sizeof hv, "%d", hung);
    setenv("TS_TEST_HUNG_RANK", hv, 1);
    char log[256];
    const char *tmp = getenv("TMPDIR");
    snprintf(log, sizeof log, "%s/hung-%d-%d.log", tmp && *tmp ? tmp : "/tmp", (int)getpid(), hung);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    char *argv[] = {TSRUN, "--nproc-per-node", "4", "--grace", "5", th_self_exe(), NULL};
    pid_t pid;
    cr_assert_eq(posix_spawn(&pid, argv[0], &fa, NULL, argv, environ), 0);
    posix_spawn_file_actions_destroy(&fa);
    unsetenv("TS_TEST_HUNG_RANK");
    th_wait_pids(&pid, 1, -1, 90, status);
    size_t len = 0;
    char *out = th_read_file(log, &len);
    unlink(log);
    return out;
}

/* The line of `out` that starts with `prefix` (a copy without its
 * newline, in buf), or NULL. */
static const char *line_of(const char *out, const char *prefix, char *buf, size_t n)
{
    for (const char *l = out; l && *l;) {
        const char *e = strchr(l, '\n');
        size_t len = e ? (size_t)(e - l) : strlen(l);
        if (strncmp(l, prefix, strlen(prefix)) == 0) {
            snprintf(buf, n, "%.*s", (int)(len < n - 1 ? len : n - 1), l);
            return buf;
        }
        l = e ? e + 1 : NULL;
    }
    return NULL;
}

/* The last line of `out` (a copy, in buf). */
static const char *last_line(const char *out, char *buf, size_t n)
{
    size_t len = strlen(out);
    while (len > 0 && out[len - 1] == '\n') len--;
    size_t start = len;
    while (start > 0 && out[start - 1] != '\n') start--;
    snprintf(buf, n, "%.*s", (int)(len - start < n - 1 ? len - start : n - 1), out + start);
    return buf;
}

/* Ranks 1, 2 and 0 in turn never enter their 6th all-reduce: with rank 1
 * stopped, rank 2 waits on it directly but rank 3 and rank 0 wait on
 * survivors (rank 2, rank 3), whom they named before. */
Test(comm_hung_rank, every_survivor_and_tsrun_name_the_rank_that_never_entered, .timeout = 300)
{
    static const int hung_ranks[] = {1, 2, 0};
    for (size_t k = 0; k < sizeof hung_ranks / sizeof hung_ranks[0]; k++) {
        int hung = hung_ranks[k], status = 0;
        char *out = run_job(hung, &status);
        cr_log_info("rank %d hung:\n%s", hung, out);
        cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 5, "rank %d hung: tsrun status 0x%x:\n%s", hung, status,
                  out);
        char want[64];
        snprintf(want, sizeof want, "rank %d, which has not entered it", hung);
        for (int r = 0; r < 4; r++) {
            if (r == hung) continue;
            char prefix[48], buf[1024];
            snprintf(prefix, sizeof prefix, "[%d] hung-test %d: TS_ERR_TIMEOUT: ", r, r);
            const char *line = line_of(out, prefix, buf, sizeof buf);
            cr_assert_not_null(line, "rank %d hung: survivor %d printed no deadline error:\n%s", hung, r, out);
            cr_assert(strstr(line, want), "rank %d hung: survivor %d names another rank: %s", hung, r, line);
        }
        char buf[512], tsrun_want[96];
        const char *last = last_line(out, buf, sizeof buf);
        snprintf(tsrun_want, sizeof tsrun_want, "tsrun: rank %d hung: it never entered all_reduce #", hung);
        cr_assert(strncmp(last, tsrun_want, strlen(tsrun_want)) == 0, "rank %d hung: tsrun's last line: %s", hung,
                  last);
        free(out);
    }
}
