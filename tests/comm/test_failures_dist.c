/*
 * Failure modes between real ranks (UCX), started without a launcher the
 * way mpirun would (OMPI_* variables; rank 0 hosts the store): a rank that
 * is SIGKILLed or exits mid-run (every survivor names it, and only it; no
 * raw UCX log line reaches stderr), and a rank that is SIGSTOPped (the
 * survivor's deadline names the collective and the rank, and it waits at
 * ~0% CPU). This binary is its own rank program (TS_TEST_FAIL_ROLE, run
 * by a constructor before Criterion starts); ranks report on stderr and
 * through their exit code.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "comm/comm_internal.h"
#include "tests/helpers.h"

#include <ucs/config/global_opts.h>
#include <ucs/debug/log_def.h>

/* ------------------------------------------------------------ rank side */

static int g_rank = -1;

#define RFAIL(code, ...) th_rank_exit(g_rank, (code), __VA_ARGS__)

static ts_tensor *mk(int64_t n)
{
    ts_tensor *t = NULL;
    if (ts_tensor_zeros(TS_F32, 1, &n, &t) != TS_OK) RFAIL(20, "tensor");
    return t;
}

/* TS_TEST_FAIL_VICTIM=v, TS_TEST_FAIL_HOW=kill|exit: rank v dies at its
 * third collective, mid-way (kill: SIGKILL; exit: _exit(0) without
 * finalizing); the survivors print "survivor R: <error>" and exit 0. The
 * collectives alternate a large all-reduce (the shared-memory bypass) and
 * small ones. */
static void role_die(void)
{
    int victim = atoi(getenv("TS_TEST_FAIL_VICTIM"));
    const char *how = getenv("TS_TEST_FAIL_HOW");
    ts_dist_options o = ts_dist_options_default();
    o.timeout_s = 30;
    if (ts_dist_init(&o) != TS_OK) RFAIL(10, "ts_dist_init");
    ts_comm *c = ts_dist_world();
    g_rank = ts_comm_rank(c);
    ts_tensor *big = mk(1 << 18), *small = mk(64);
    for (int it = 0; it < 1000; it++) {
        ts_tensor *t = it % 2 ? small : big;
        if (g_rank == victim && it == 3) {
            ts_request *r = NULL;
            if (ts_all_reduce(c, t, TS_REDUCE_SUM, &r) != TS_OK) RFAIL(30, "submit");
            usleep(1000);
            if (strcmp(how, "kill") == 0) raise(SIGKILL);
            _exit(0);
        }
        ts_status s = ts_all_reduce(c, t, TS_REDUCE_SUM, NULL);
        if (s == TS_OK) continue;
        fprintf(stderr, "survivor %d: %s: %s\n", g_rank, ts_status_name(s), ts_last_error());
        fflush(stderr);
        (void)ts_dist_finalize();
        _exit(s == TS_ERR_PEER_FAILED ? 0 : 33);
    }
    RFAIL(34, "no failure seen");
}

/* 2 ranks: rank 1 stops itself (SIGSTOP) after a first barrier; rank 0's
 * next all-reduce (deadline shortened to TS_TEST_FAIL_DEADLINE s) fails
 * with TS_ERR_TIMEOUT; it prints its message and its CPU use while
 * waiting. */
static void role_stop(void)
{
    ts_dist_options o = ts_dist_options_default();
    o.timeout_s = 30;
    if (ts_dist_init(&o) != TS_OK) RFAIL(10, "ts_dist_init");
    ts_comm *c = ts_dist_world();
    g_rank = ts_comm_rank(c);
    ts__comm_set_timeout(c, atof(getenv("TS_TEST_FAIL_DEADLINE")));
    ts_tensor *t = mk(1024);
    if (ts_all_reduce(c, t, TS_REDUCE_SUM, NULL) != TS_OK) RFAIL(11, "first all_reduce");
    if (ts_barrier(c, NULL) != TS_OK) RFAIL(12, "barrier");
    if (g_rank == 1) {
        raise(SIGSTOP);
        _exit(0); /* continued: the test is over */
    }
    usleep(100000); /* let rank 1 stop */
    double w0 = th_now_s(), c0 = th_cpu_s();
    ts_status s = ts_all_reduce(c, t, TS_REDUCE_SUM, NULL);
    double wall = th_now_s() - w0, cpu = th_cpu_s() - c0;
    fprintf(stderr, "stopped-peer %s after %.2f s, cpu %.3f s (%.1f%%): %s\n", ts_status_name(s), wall, cpu,
            100.0 * cpu / wall, ts_last_error());
    fflush(stderr);
    _exit(s == TS_ERR_TIMEOUT ? 0 : 35);
}

/* 3 ranks loop over all-gathers of 16922 floats per rank (67688-byte
 * blocks: UCX's rendezvous, which a stopped receiver never takes); rank 0
 * stops itself (SIGSTOP) at the 20th, before calling it
 * (TS_TEST_FAIL_STOP_US=-1) or that many microseconds after submitting
 * it (TS_TEST_FAIL_HOW=kill: SIGKILL instead). The survivors' deadline
 * is TS_TEST_FAIL_DEADLINE s; each prints "stopped3 R: <status>: <error>",
 * finalizes and prints "finalized R". */
static void role_stop3(void)
{
    int stop_us = atoi(getenv("TS_TEST_FAIL_STOP_US"));
    bool kill = getenv("TS_TEST_FAIL_HOW") && strcmp(getenv("TS_TEST_FAIL_HOW"), "kill") == 0;
    ts_dist_options o = ts_dist_options_default();
    o.timeout_s = 30;
    if (ts_dist_init(&o) != TS_OK) RFAIL(10, "ts_dist_init");
    ts_comm *c = ts_dist_world();
    g_rank = ts_comm_rank(c);
    ts__comm_set_timeout(c, atof(getenv("TS_TEST_FAIL_DEADLINE")));
    int W = ts_comm_size(c);
    ts_tensor *in = mk(16922), *out = mk(16922 * (int64_t)W);
    for (int it = 0; it < 1000; it++) {
        if (g_rank == 0 && it == 20) {
            if (stop_us >= 0) {
                ts_request *r = NULL;
                if (ts_all_gather_into_tensor(c, out, in, &r) != TS_OK) RFAIL(30, "submit");
                usleep((useconds_t)stop_us);
            }
            raise(kill ? SIGKILL : SIGSTOP);
            _exit(0); /* continued: the test is over */
        }
        ts_status s = ts_all_gather_into_tensor(c, out, in, NULL);
        if (s == TS_OK) continue;
        fprintf(stderr, "stopped3 %d: %s: %s\n", g_rank, ts_status_name(s), ts_last_error());
        fflush(stderr);
        (void)ts_dist_finalize();
        fprintf(stderr, "finalized %d\n", g_rank);
        fflush(stderr);
        _exit(s == (kill ? TS_ERR_PEER_FAILED : TS_ERR_TIMEOUT) ? 0 : 37);
    }
    RFAIL(38, "no failure seen");
}

/* 2 ranks call different collectives: #1 an all-gather of 8512 floats
 * against a barrier, or (TS_TEST_FAIL_BIG=1) of 2^17 floats per rank
 * (512 KiB: the shared-memory bypass) against 100 floats. Both must fail
 * at once, naming both sides; each prints "desync R: <error>". */
static void role_desync(void)
{
    /* TS_TEST_FAIL_BIG: 0 (the kinds differ), 1 (bypass against inline),
     * 2, 3, 4 (counts against each other: both blocks inline, rank 1's
     * message the longer; rank 0's apart, rank 1's inline just under
     * comm.c's default threshold, 16 KiB; both apart, rank 0's message
     * the longer) */
    const char *bs = getenv("TS_TEST_FAIL_BIG");
    int mode = bs ? atoi(bs) : 0;
    bool big = mode != 0;
    static const int64_t counts[5][2] = {{8512, 8512}, {1 << 17, 100}, {100, 700}, {5000, 4000}, {8000, 6000}};
    ts_dist_options o = ts_dist_options_default();
    o.timeout_s = 30;
    if (ts_dist_init(&o) != TS_OK) RFAIL(10, "ts_dist_init");
    ts_comm *c = ts_dist_world();
    g_rank = ts_comm_rank(c);
    if (ts_barrier(c, NULL) != TS_OK) RFAIL(11, "barrier");
    int64_t n = counts[mode < 0 || mode > 4 ? 0 : mode][g_rank != 0];
    ts_tensor *in = mk(n), *out = mk(2 * n);
    double t0 = th_now_s();
    ts_status s = !big && g_rank == 1 ? ts_barrier(c, NULL) : ts_all_gather_into_tensor(c, out, in, NULL);
    fprintf(stderr, "desync %d: %s after %.2f s: %s\n", g_rank, ts_status_name(s), th_now_s() - t0, ts_last_error());
    fflush(stderr);
    (void)ts_dist_finalize();
    _exit(s == TS_ERR_COMM ? 0 : 36);
}

/* 2 ranks; rank 0 has UCX log an expected-path warning and an unknown
 * error through UCX's own logger, then exits after finalizing. */
static void role_ucxlog(void)
{
    if (ts_dist_init(NULL) != TS_OK) RFAIL(10, "ts_dist_init");
    g_rank = ts_comm_rank(ts_dist_world());
    if (g_rank == 0) {
        ucs_log_dispatch("uct/sm/mm/base/mm_ep.c", 42, "test", UCS_LOG_LEVEL_WARN, &ucs_global_opts.log_component, "%s",
                         "Connection reset by remote peer");
        ucs_log_dispatch("ucp/core/ucp_worker.c", 43, "test", UCS_LOG_LEVEL_ERROR, &ucs_global_opts.log_component, "%s",
                         "a genuine surprise 0x1234");
    }
    if (ts_dist_finalize() != TS_OK) RFAIL(11, "finalize");
    _exit(0);
}

__attribute__((constructor)) static void fail_test_role(void)
{
    const char *role = getenv("TS_TEST_FAIL_ROLE");
    if (!role) return;
    if (strcmp(role, "die") == 0) role_die();
    if (strcmp(role, "stop") == 0) role_stop();
    if (strcmp(role, "stop3") == 0) role_stop3();
    if (strcmp(role, "desync") == 0) role_desync();
    if (strcmp(role, "ucxlog") == 0) role_ucxlog();
    fprintf(stderr, "unknown TS_TEST_FAIL_ROLE=%s\n", role);
    _exit(6);
}

/* ------------------------------------------------------------ test side */

#define MAXW 4

typedef struct job {
    int W;
    pid_t pid[MAXW];
    int err_fd[MAXW];
    int status[MAXW];
} job;

/* Starts W ranks mpirun-style (no launcher: rank 0 hosts the store), each
 * with its stderr in a memfd. UCX_LOG_LEVEL stays unset: the library
 * decides what UCX prints. */
static void job_start(job *j, int W, const char *role)
{
    j->W = W;
    th_spawn_mpi_ranks(W, "TS_TEST_FAIL_ROLE", role, j->pid, j->err_fd);
}

/* Waits (bounded) for every rank but `skip`; kills what is left. */
static void job_wait(job *j, int skip, double limit_s) { th_wait_pids(j->pid, j->W, skip, limit_s, j->status); }

/* A line that UCX's own logger printed: "[1700000000.123456] [host:pid:tid]
 * file.c:123 UCX  ERROR ..." */
static bool has_ucx_line(const char *text)
{
    for (const char *l = text; l && *l;) {
        const char *e = strchr(l, '\n');
        size_t n = e ? (size_t)(e - l) : strlen(l);
        char line[1024];
        snprintf(line, sizeof line, "%.*s", (int)(n < sizeof line - 1 ? n : sizeof line - 1), l);
        if (strstr(line, "UCX  ERROR") || strstr(line, "UCX  WARN") || strstr(line, "UCX  FATAL") ||
            (line[0] == '[' && line[1] >= '0' && line[1] <= '9' && (strstr(line, "ucx") || strstr(line, "UCX"))))
            return true;
        l = e ? e + 1 : NULL;
    }
    return false;
}

/* Whether the library's own UCX transport warned ("[ts WARN] ucx:"): on
 * the expected path after a failure its lines are debug level. */
static bool has_ts_ucx_warn(const char *text) { return strstr(text, "[ts WARN] ucx:") != NULL; }

/* Whether `text` names "rank N" with N exactly `r` (not "rank 10"). */
static bool names_rank(const char *text, int r)
{
    char want[16];
    snprintf(want, sizeof want, "rank %d", r);
    for (const char *p = strstr(text, want); p; p = strstr(p + 1, want))
        if (!(p[strlen(want)] >= '0' && p[strlen(want)] <= '9')) return true;
    return false;
}

/* Whether `text` names "rank N" for some N not in {a, b}. */
static int names_other_rank(const char *text, int a, int b, int W)
{
    for (int r = 0; r < W; r++) {
        if (r == a || r == b) continue;
        char want[16];
        snprintf(want, sizeof want, "rank %d", r);
        for (const char *p = strstr(text, want); p; p = strstr(p + 1, want))
            if (!(p[strlen(want)] >= '0' && p[strlen(want)] <= '9')) return r;
    }
    return -1;
}

/* TS_LOG_LEVEL for the ranks (meson sets error, which would hide the
 * warnings the tests look for); returns the old value to restore. */
static char *log_level_push(const char *level)
{
    const char *was = getenv("TS_LOG_LEVEL");
    char *saved = was ? strdup(was) : NULL;
    setenv("TS_LOG_LEVEL", level, 1);
    return saved;
}

static void log_level_pop(char *saved)
{
    if (saved) setenv("TS_LOG_LEVEL", saved, 1);
    else unsetenv("TS_LOG_LEVEL");
    free(saved);
}

static void die_scenario(int W, int victim, const char *how, int run)
{
    char vs[16];
    snprintf(vs, sizeof vs, "%d", victim);
    setenv("TS_TEST_FAIL_VICTIM", vs, 1);
    setenv("TS_TEST_FAIL_HOW", how, 1);
    job j;
    char *saved = log_level_push("warn");
    job_start(&j, W, "die");
    log_level_pop(saved);
    job_wait(&j, -1, 60);
    for (int r = 0; r < W; r++) {
        char *err = th_slurp_fd(j.err_fd[r]);
        close(j.err_fd[r]);
        if (r == victim) {
            free(err);
            continue;
        }
        cr_log_info("W=%d run %d %s rank %d: %s", W, run, how, r, err);
        cr_assert(WIFEXITED(j.status[r]) && WEXITSTATUS(j.status[r]) == 0, "W=%d run %d: survivor %d status 0x%x:\n%s",
                  W, run, r, j.status[r], err);
        char line[64], want[32];
        snprintf(line, sizeof line, "survivor %d: TS_ERR_PEER_FAILED", r);
        snprintf(want, sizeof want, "rank %d failed", victim);
        cr_assert(strstr(err, line) && strstr(err, want), "W=%d run %d (%s rank %d): survivor %d does not name it:\n%s",
                  W, run, how, victim, r, err);
        const char *at = strstr(err, line), *eol = strchr(at, '\n');
        char msg[1024];
        snprintf(msg, sizeof msg, "%.*s", (int)(eol ? (size_t)(eol - at) : strlen(at)), at);
        int other = names_other_rank(msg, victim, r, W);
        cr_assert_eq(other, -1, "W=%d run %d (%s rank %d): survivor %d also names rank %d:\n%s", W, run, how, victim, r,
                     other, err);
        cr_assert(!has_ucx_line(err), "W=%d run %d: survivor %d's stderr has raw UCX log lines:\n%s", W, run, r, err);
        cr_assert(!has_ts_ucx_warn(err), "W=%d run %d (%s rank %d): survivor %d warns about UCX transfers:\n%s", W, run,
                  how, victim, r, err);
        free(err);
    }
}

/* 3 and 4 ranks, one SIGKILLed mid-collective, several times each (the
 * victim varies, rank 0 excepted: it hosts the store): every survivor's
 * error names it and no other rank, and no UCX log line, nor a warning of
 * our own about UCX transfers, is printed (at TS_LOG_LEVEL=warn). */
Test(comm_failures_dist, killed_rank_named_by_every_survivor, .timeout = 240)
{
    for (int run = 0; run < 3; run++) {
        die_scenario(3, 1 + run % 2, "kill", run);
        die_scenario(4, 1 + run % 3, "kill", run);
    }
}

/* The same with a rank that exits (status 0, without finalizing). */
Test(comm_failures_dist, exited_rank_named_by_every_survivor, .timeout = 120)
{
    die_scenario(3, 2, "exit", 0);
    die_scenario(4, 1, "exit", 0);
}

/* A SIGSTOPped peer: the survivor's deadline (2 s) names the collective,
 * its number and the rank; while it waits its process uses a small part
 * of a core (it spun at 100% before). */
Test(comm_failures_dist, stopped_peer_deadline_names_it_and_costs_no_core, .timeout = 60)
{
    setenv("TS_TEST_FAIL_DEADLINE", "2", 1);
    job j;
    char *saved = log_level_push("warn");
    job_start(&j, 2, "stop");
    log_level_pop(saved);
    job_wait(&j, 1, 40);
    kill(j.pid[1], SIGKILL);
    waitpid(j.pid[1], NULL, 0);
    char *err = th_slurp_fd(j.err_fd[0]);
    cr_log_info("%s", err);
    cr_assert(WIFEXITED(j.status[0]) && WEXITSTATUS(j.status[0]) == 0, "rank 0 status 0x%x:\n%s", j.status[0], err);
    cr_assert(strstr(err, "stopped-peer TS_ERR_TIMEOUT"), "%s", err);
    cr_assert(strstr(err, "all_reduce #2"), "the error does not name the collective and its number:\n%s", err);
    cr_assert(strstr(err, "rank 1"), "the error does not name the stopped rank:\n%s", err);
    double wall = 0, cpu = 0;
    const char *p = strstr(err, "stopped-peer TS_ERR_TIMEOUT after ");
    cr_assert(p && sscanf(p, "stopped-peer TS_ERR_TIMEOUT after %lf s, cpu %lf", &wall, &cpu) == 2, "%s", err);
    cr_assert_geq(wall, 1.9);
    /* 100% of a core before; a sleeping thread uses well under 5%: 20%
     * leaves room for a loaded machine */
    cr_assert_lt(cpu, 0.2 * wall, "%.3f s of CPU in %.2f s of waiting", cpu, wall);
    cr_assert(!has_ucx_line(err), "raw UCX log lines:\n%s", err);
    cr_assert(!has_ts_ucx_warn(err), "a warning about UCX transfers after the deadline:\n%s", err);
    free(err);
    close(j.err_fd[0]);
    close(j.err_fd[1]);
}

/* 3 ranks, rank 0 (the store's host) SIGSTOPped in a loop of all-gathers,
 * before its 20th or at several points within it: every survivor's
 * deadline (2 s) names rank 0 (the one it waits for, directly or through
 * its upstream neighbour), finalize returns, and no survivor's stderr has
 * a raw UCX line or a warning of ours about UCX transfers (the abandoned
 * ones are the expected aftermath, at debug level). */
static void stop3_scenario(const char *how)
{
    static const char *stops[] = {"-1", "0", "300", "3000"};
    bool kill_it = strcmp(how, "kill") == 0;
    setenv("TS_TEST_FAIL_DEADLINE", "2", 1);
    setenv("TS_TEST_FAIL_HOW", how, 1);
    for (size_t k = 0; k < sizeof stops / sizeof stops[0]; k++) {
        setenv("TS_TEST_FAIL_STOP_US", stops[k], 1);
        job j;
        char *saved = log_level_push("warn");
        job_start(&j, 3, "stop3");
        log_level_pop(saved);
        job_wait(&j, 0, 60);
        kill(j.pid[0], SIGKILL);
        waitpid(j.pid[0], NULL, 0);
        for (int r = 0; r < 3; r++) {
            char *err = th_slurp_fd(j.err_fd[r]);
            close(j.err_fd[r]);
            if (r == 0) {
                free(err);
                continue;
            }
            cr_log_info("%s %s us, rank %d: %s", how, stops[k], r, err);
            cr_assert(WIFEXITED(j.status[r]) && WEXITSTATUS(j.status[r]) == 0, "%s %s: survivor %d status 0x%x:\n%s",
                      how, stops[k], r, j.status[r], err);
            char line[64], fin[32];
            snprintf(line, sizeof line, "stopped3 %d: %s: ", r, kill_it ? "TS_ERR_PEER_FAILED" : "TS_ERR_TIMEOUT");
            snprintf(fin, sizeof fin, "finalized %d", r);
            const char *at = strstr(err, line);
            cr_assert(at && strstr(err, fin), "%s %s: survivor %d:\n%s", how, stops[k], r, err);
            const char *eol = strchr(at, '\n');
            char msg[1024];
            snprintf(msg, sizeof msg, "%.*s", (int)(eol ? (size_t)(eol - at) : strlen(at)), at + strlen(line));
            cr_assert(strstr(msg, "all_gather #") && strstr(msg, kill_it ? "rank 0 failed" : "passed its deadline"),
                      "%s %s: %s", how, stops[k], msg);
            cr_assert(names_rank(msg, 0), "%s %s: survivor %d does not name rank 0: %s", how, stops[k], r, msg);
            cr_assert(!has_ucx_line(err), "%s %s: survivor %d has raw UCX log lines:\n%s", how, stops[k], r, err);
            cr_assert(!has_ts_ucx_warn(err), "%s %s: survivor %d warns about UCX transfers:\n%s", how, stops[k], r,
                      err);
            free(err);
        }
    }
}

Test(comm_failures_dist, stopped_rank_of_three_named_by_every_survivor, .timeout = 180) { stop3_scenario("stop"); }

/* The same with rank 0 SIGKILLed: every survivor names it as failed, with
 * no warning of ours about the transfers abandoned after it. */
Test(comm_failures_dist, killed_rank_0_in_all_gathers_no_transfer_warnings, .timeout = 120) { stop3_scenario("kill"); }

/* Desynchronised collectives between processes: both ranks fail within
 * the collective (the deadline is 30 s), naming both sides, with no UCX
 * log line; also when the sizes take different paths (the bypass for
 * 512 KiB against an eager message), which used to end at the deadline,
 * and across the fingerprints' inline threshold (comm.c: blocks up to
 * 16 KiB) and UCX's receive of any length up to it. */
Test(comm_failures_dist, desync_fails_both_ranks_naming_both_sides, .timeout = 120)
{
    static const char *want[5][2] = {
        {"rank 0 runs all_gather #1 (float32, 8512)", "rank 1 runs barrier #1"},
        {"rank 0 runs all_gather #1 (float32, 131072)", "rank 1 runs all_gather #1 (float32, 100)"},
        {"rank 0 runs all_gather #1 (float32, 100)", "rank 1 runs all_gather #1 (float32, 700)"},
        {"rank 0 runs all_gather #1 (float32, 5000)", "rank 1 runs all_gather #1 (float32, 4000)"},
        {"rank 0 runs all_gather #1 (float32, 8000)", "rank 1 runs all_gather #1 (float32, 6000)"}};
    for (int big = 0; big < 5; big++) {
        char bs[8];
        snprintf(bs, sizeof bs, "%d", big);
        setenv("TS_TEST_FAIL_BIG", bs, 1);
        job j;
        job_start(&j, 2, "desync");
        job_wait(&j, -1, 60);
        char *errs[2];
        for (int r = 0; r < 2; r++) {
            errs[r] = th_slurp_fd(j.err_fd[r]);
            close(j.err_fd[r]);
            cr_log_info("big %d rank %d: %s", big, r, errs[r]);
        }
        for (int r = 0; r < 2; r++) {
            char *err = errs[r];
            cr_assert(WIFEXITED(j.status[r]) && WEXITSTATUS(j.status[r]) == 0, "big %d rank %d status 0x%x:\n%s", big,
                      r, j.status[r], err);
            double dt = 99;
            const char *p = strstr(err, "desync ");
            cr_assert(p && sscanf(p, "desync %*d: TS_ERR_COMM after %lf", &dt) == 1, "%s", err);
            cr_assert_lt(dt, 10.0, "rank %d took %.2f s", r, dt);
            for (int k = 0; k < 2; k++) cr_assert(strstr(err, want[big][k]), "'%s' not in:\n%s", want[big][k], err);
            cr_assert(!has_ucx_line(err), "raw UCX log lines:\n%s", err);
            free(err);
        }
    }
}

/* UCX's own ERROR/WARN lines go through our log: an expected-path one at
 * debug level only, an unknown one as our warning; none in UCX's format. */
Test(comm_failures_dist, ucx_log_lines_go_through_our_log, .timeout = 60)
{
    const char *was = getenv("TS_LOG_LEVEL");
    char *saved = was ? strdup(was) : NULL;
    for (int dbg = 0; dbg < 2; dbg++) {
        setenv("TS_LOG_LEVEL", dbg ? "debug" : "warn", 1); /* meson sets error */
        job j;
        job_start(&j, 2, "ucxlog");
        job_wait(&j, -1, 40);
        char *err = th_slurp_fd(j.err_fd[0]);
        cr_log_info("TS_LOG_LEVEL=%s: %s", dbg ? "debug" : "warn", err);
        cr_assert(WIFEXITED(j.status[0]) && WEXITSTATUS(j.status[0]) == 0, "status 0x%x:\n%s", j.status[0], err);
        cr_assert(!has_ucx_line(err), "raw UCX log lines:\n%s", err);
        cr_assert(strstr(err, "[ts WARN] ucx error (ucp_worker.c:43): a genuine surprise 0x1234"), "%s", err);
        bool expected_shown = strstr(err, "Connection reset by remote peer") != NULL;
        cr_assert_eq(expected_shown, dbg == 1, "expected-path line %s at TS_LOG_LEVEL=%s:\n%s",
                     expected_shown ? "shown" : "hidden", dbg ? "debug" : "warn", err);
        free(err);
        close(j.err_fd[0]);
        close(j.err_fd[1]);
    }
    if (saved) setenv("TS_LOG_LEVEL", saved, 1);
    else unsetenv("TS_LOG_LEVEL");
    free(saved);
}
