#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <errno.h>
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "comm/comm_internal.h"
#include "comm/store.h"
#include "tests/helpers.h"

/* ts_dist_init's rendezvous with ranks started by hand (no launcher):
 * duplicate RANKs (rank 0 too), inconsistent WORLD_SIZEs, a rank that
 * dies before the rendezvous completes, a MASTER_PORT held by another
 * program, a rank that connects only after the error was recorded, the
 * progress line, TS_DIST_TIMEOUT, and the token rule of a
 * multi-host job; and under tsrun, a rank that exits with status 0 before
 * it joins. The ranks are this binary again, in a role chosen by
 * TS_TEST_RDV_ROLE; their stderr goes to a file per rank. */

#ifndef TS_BUILD_DIR
#error "TS_BUILD_DIR must name the build root (tests/meson.build defines it)"
#endif
#define TSRUN TS_BUILD_DIR "/tools/tsrun"

/* ------------------------------------------------------------ rank side */

__attribute__((constructor)) static void rdv_test_role(void)
{
    const char *role = getenv("TS_TEST_RDV_ROLE");
    if (!role) return;
    ts_log_set_level(TS_LOG_WARN); /* the progress line is a warning */
    const char *iv = getenv("TS_TEST_RDV_PROGRESS");
    if (iv) ts__dist_set_progress_interval(atof(iv));
    const char *rk = getenv("RANK");
    if (strcmp(role, "exit1") == 0 && rk && strcmp(rk, "1") == 0)
        _exit(0); /* rank 1 leaves at once, with status 0, before the rendezvous */
    double t0 = th_now_s();
    ts_status s = ts_dist_init(NULL);
    if (strcmp(role, "stall") == 0 && s == TS_OK) {
        /* Rank 1 joins and then never takes part; rank 0's all-reduce
         * must time out after TS_DIST_TIMEOUT. */
        ts_comm *w = ts_dist_world();
        if (ts_comm_rank(w) == 1) {
            for (;;) pause(); /* until the test kills it */
        }
        ts_tensor *x = NULL;
        int64_t shape[1] = {1024};
        if (ts_tensor_zeros(TS_F32, 1, shape, &x) != TS_OK) _exit(7);
        double t1 = th_now_s();
        ts_status cs = ts_all_reduce(w, x, TS_REDUCE_SUM, NULL);
        fprintf(stderr, "all_reduce %s after %.2f s: %s\n", ts_status_name(cs), th_now_s() - t1, ts_last_error());
        fflush(stderr);
        _exit(cs == TS_ERR_TIMEOUT ? 5 : 6);
    }
    fprintf(stderr, "init %s after %.2f s: %s\n", ts_status_name(s), th_now_s() - t0,
            s == TS_OK ? "" : ts_last_error());
    fflush(stderr);
    if (s != TS_OK) _exit(3);
    if (strcmp(role, "train") == 0) {
        /* Barriers until one fails (a duplicate RANK that starts after
         * the rendezvous); 3000 of them (a minute or more) bound the
         * run. */
        ts_comm *w = ts_dist_world();
        for (int i = 0; i < 3000; i++) {
            ts_status bs = ts_barrier(w, NULL);
            if (bs == TS_OK) {
                usleep(20000);
                continue;
            }
            fprintf(stderr, "train %s at barrier %d: %s\n", ts_status_name(bs), i, ts_last_error());
            fflush(stderr);
            (void)ts_dist_finalize();
            _exit(8);
        }
        s = ts_dist_finalize();
        fprintf(stderr, "finalize %s: %s\n", ts_status_name(s), s == TS_OK ? "" : ts_last_error());
        fflush(stderr);
        _exit(s == TS_OK ? 0 : 4);
    }
    s = ts_dist_finalize();
    if (s == TS_OK && strcmp(role, "twice") == 0) {
        /* a second world under the same (launcher's) store */
        t0 = th_now_s();
        s = ts_dist_init(NULL);
        fprintf(stderr, "init2 %s after %.2f s: %s\n", ts_status_name(s), th_now_s() - t0,
                s == TS_OK ? "" : ts_last_error());
        fflush(stderr);
        if (s != TS_OK) _exit(3);
        s = ts_dist_finalize();
    }
    _exit(s == TS_OK ? 0 : 4);
}

/* ------------------------------------------------------------ test side */

extern char **environ;

static void clear_launch_env(void)
{
    static const char *vars[] = {"RANK",
                                 "WORLD_SIZE",
                                 "LOCAL_RANK",
                                 "LOCAL_WORLD_SIZE",
                                 "MASTER_ADDR",
                                 "MASTER_PORT",
                                 "OMPI_COMM_WORLD_RANK",
                                 "OMPI_COMM_WORLD_SIZE",
                                 "OMPI_COMM_WORLD_LOCAL_RANK",
                                 "OMPI_COMM_WORLD_LOCAL_SIZE",
                                 "SLURM_PROCID",
                                 "TS_LAUNCHER_PID",
                                 "TS_STORE_HOSTED",
                                 "TS_STORE_TOKEN",
                                 "TS_RUN_ID",
                                 "TS_DIST_TIMEOUT"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) unsetenv(vars[i]);
    setenv("UCX_TLS", "posix,cma,self", 0);
    setenv("UCX_MM_ERROR_HANDLING", "y", 0);
    setenv("UCX_WARN_UNUSED_ENV_VARS", "n", 0);
}

/* A fresh launch environment for ranks this test spawns: clear_launch_env,
 * then MASTER_PORT a free port (returned), TS_RUN_ID run_id (unless NULL)
 * and TS_DIST_TIMEOUT timeout (seconds, as text). */
static void port_env(int port, const char *run_id, const char *timeout)
{
    char ports[16];
    snprintf(ports, sizeof ports, "%d", port);
    setenv("MASTER_PORT", ports, 1);
    if (run_id) setenv("TS_RUN_ID", run_id, 1);
    setenv("TS_DIST_TIMEOUT", timeout, 1);
}

static int rdv_env(const char *run_id, const char *timeout)
{
    clear_launch_env();
    int port = th_free_port();
    port_env(port, run_id, timeout);
    return port;
}

/* The variables of ranks whose store a launcher hosts (the test's own
 * server at `port`, token "tok"), as tsrun sets them. */
static void hosted_env(int port, const char *run_id, const char *timeout)
{
    port_env(port, run_id, timeout);
    setenv("TS_STORE_HOSTED", "1", 1);
    setenv("TS_STORE_TOKEN", "tok", 1);
}

typedef struct rank_proc {
    pid_t pid;
    char log[256];
    int status;
    double exited_s; /* seconds after start */
} rank_proc;

/* Starts this binary as rank `rank` of `world` (RANK/WORLD_SIZE, one
 * host), with the environment as it is now plus the role. */
static void spawn_rank(rank_proc *p, int rank, int world, const char *tag)
{
    char rs[16], ws[16];
    snprintf(rs, sizeof rs, "%d", rank);
    snprintf(ws, sizeof ws, "%d", world);
    const char *role = getenv("TS_TEST_RDV_WANT_ROLE");
    setenv("TS_TEST_RDV_ROLE", role ? role : "join", 1);
    setenv("RANK", rs, 1);
    setenv("WORLD_SIZE", ws, 1);
    static int seq;
    const char *tmp = getenv("TMPDIR");
    snprintf(p->log, sizeof p->log, "%s/rdv-%s-%d-%d-%d.log", tmp && *tmp ? tmp : "/tmp", tag, (int)getpid(), rank,
             seq++);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 2, p->log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    char *argv[] = {th_self_exe(), NULL};
    cr_assert_eq(posix_spawn(&p->pid, argv[0], &fa, NULL, argv, environ), 0);
    posix_spawn_file_actions_destroy(&fa);
    unsetenv("TS_TEST_RDV_ROLE");
}

/* Waits for every rank (bounded; the rest are killed), recording when
 * each exited. */
static void wait_ranks(rank_proc *p, int n, double t0, double limit_s)
{
    int left = n;
    for (int i = 0; i < n; i++) p[i].exited_s = -1;
    while (left > 0 && th_now_s() - t0 < limit_s) {
        for (int i = 0; i < n; i++) {
            if (p[i].exited_s >= 0) continue;
            if (waitpid(p[i].pid, &p[i].status, WNOHANG) == p[i].pid) {
                p[i].exited_s = th_now_s() - t0;
                left--;
            }
        }
        if (left) usleep(10000); /* polling the children; bounded by limit_s */
    }
    for (int i = 0; i < n; i++) {
        if (p[i].exited_s >= 0) continue;
        kill(p[i].pid, SIGKILL);
        waitpid(p[i].pid, &p[i].status, 0);
        cr_assert_fail("rank process %d still running after %.0f s", i, limit_s);
    }
}

static char *slurp(const char *path)
{
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s", path);
    static char buf[16384];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = '\0';
    fclose(f);
    unlink(path);
    return buf;
}

static void expect_failed_with(rank_proc *p, int i, const char *a, const char *b)
{
    char *log = slurp(p[i].log);
    cr_assert(WIFEXITED(p[i].status) && WEXITSTATUS(p[i].status) == 3, "process %d: status 0x%x; log:\n%s", i,
              p[i].status, log);
    cr_assert(strstr(log, a) && (!b || strstr(log, b)), "process %d: want '%s' and '%s' in:\n%s", i, a, b ? b : "",
              log);
    cr_log_info("process %d exited after %.2f s: %s", i, p[i].exited_s, strstr(log, "init "));
}

Test(comm_rendezvous, duplicate_rank_fails_every_rank, .timeout = 120)
{
    rdv_env(NULL, "60");
    rank_proc p[3];
    double t0 = th_now_s();
    spawn_rank(&p[0], 0, 3, "dup");
    spawn_rank(&p[1], 1, 3, "dup");
    spawn_rank(&p[2], 1, 3, "dup"); /* RANK 1 again; rank 2 is missing */
    wait_ranks(p, 3, t0, 90);
    for (int i = 0; i < 3; i++) {
        expect_failed_with(p, i, "duplicate RANK 1", "claimed by pid");
        cr_assert_lt(p[i].exited_s, 20.0, "process %d took %.1f s (the deadline is 60 s)", i, p[i].exited_s);
    }
}

/* Waits (bounded) until the log of `p` shows a line with `what`. */
static void wait_for_line(const rank_proc *p, const char *what, double limit_s)
{
    double t0 = th_now_s();
    for (;;) {
        size_t n = 0;
        char *text = th_read_file(p->log, &n);
        bool seen = text && strstr(text, what);
        free(text);
        if (seen) return;
        cr_assert_lt(th_now_s() - t0, limit_s, "no '%s' in %s after %.0f s", what, p->log, limit_s);
        usleep(20000);
    }
}

Test(comm_rendezvous, duplicate_rank_after_the_rendezvous_fails_every_rank, .timeout = 150)
{
    /* Ranks 0 and 1 meet and run barriers; a second RANK 1 starts only
     * then. It fails at its claim, and so must the two others (at their
     * next barrier), naming the duplicate: none of them exits 0. */
    rdv_env(NULL, "60");
    setenv("TS_TEST_RDV_WANT_ROLE", "train", 1);
    rank_proc p[3];
    double t0 = th_now_s();
    spawn_rank(&p[0], 0, 2, "latedup");
    spawn_rank(&p[1], 1, 2, "latedup");
    unsetenv("TS_TEST_RDV_WANT_ROLE");
    wait_for_line(&p[0], "init TS_OK", 60);
    wait_for_line(&p[1], "init TS_OK", 60);
    spawn_rank(&p[2], 1, 2, "latedup"); /* RANK 1 again */
    wait_ranks(p, 3, t0, 120);
    for (int i = 0; i < 3; i++) {
        char *log = slurp(p[i].log);
        cr_log_info("process %d: status 0x%x after %.2f s:\n%s", i, p[i].status, p[i].exited_s, log);
        cr_assert(WIFEXITED(p[i].status) && WEXITSTATUS(p[i].status) != 0, "process %d exited 0x%x:\n%s", i,
                  p[i].status, log);
        cr_assert(strstr(log, "duplicate RANK 1: claimed by pid"), "process %d does not name the duplicate:\n%s", i,
                  log);
    }
}

Test(comm_rendezvous, watch_survives_a_late_store_reply_and_still_sees_a_late_duplicate, .timeout = 150)
{
    /* As above, under a store the test hosts, which stalls 4.5 s on rank
     * 0's first watch call (the test hook TS_STORE_TEST_STALL: a loaded
     * host). The late reply costs the watches their connections (a client
     * gives up after its 2 s poll plus 1 s); they must reconnect, so that
     * the duplicate RANK 1 that starts after the stall fails both ranks
     * at a barrier, naming it (a dead watch leaves it to finalize). */
    clear_launch_env();
    setenv(TS_STORE_TEST_STALL_ENV, "4500:dist/rdvstall/0/rdv/wake/0", 1);
    ts_store_server *srv = NULL;
    TH_OK(ts_store_server_start(NULL, 0, "tok", &srv));
    unsetenv(TS_STORE_TEST_STALL_ENV);
    int port = ts_store_server_port(srv);
    hosted_env(port, "rdvstall", "60");
    setenv("TS_TEST_RDV_WANT_ROLE", "train", 1);
    rank_proc p[3];
    double t0 = th_now_s();
    spawn_rank(&p[0], 0, 2, "stall");
    spawn_rank(&p[1], 1, 2, "stall");
    unsetenv("TS_TEST_RDV_WANT_ROLE");
    ts_store *c = NULL;
    TH_OK(ts_store_connect(NULL, port, "tok", 30.0, &c));
    ts_store_set_timeout(c, 60.0);
    void *v = NULL;
    size_t n = 0;
    TH_OK(ts_store_get(c, TS_STORE_TEST_STALLED_KEY, &v, &n)); /* the stall is over */
    ts_store_value_free(v);
    spawn_rank(&p[2], 1, 2, "stall"); /* RANK 1 again */
    wait_ranks(p, 3, t0, 120);
    for (int i = 0; i < 3; i++) {
        char *log = slurp(p[i].log);
        cr_log_info("process %d: status 0x%x after %.2f s:\n%s", i, p[i].status, p[i].exited_s, log);
        cr_assert(WIFEXITED(p[i].status) && WEXITSTATUS(p[i].status) != 0, "process %d exited 0x%x:\n%s", i,
                  p[i].status, log);
        cr_assert(strstr(log, "duplicate RANK 1: claimed by pid"), "process %d does not name the duplicate:\n%s", i,
                  log);
        /* found by the watch while training, not only at finalize */
        if (i < 2) cr_assert(strstr(log, "at barrier"), "process %d did not fail at a barrier:\n%s", i, log);
    }
    ts_store_close(c);
    ts_store_server_stop(srv);
}

Test(comm_rendezvous, wrong_token_fails_the_rendezvous_at_once_naming_it, .timeout = 120)
{
    /* Rank 1's token differs from rank 0's: the store rejects it (it
     * fails at once), and rank 0 fails at once too saying why, not at the
     * 30 s deadline with "never arrived". */
    rdv_env(NULL, "30");
    rank_proc p[2];
    double t0 = th_now_s();
    setenv("TS_STORE_TOKEN", "right-token", 1);
    spawn_rank(&p[0], 0, 2, "token");
    setenv("TS_STORE_TOKEN", "wrong-token", 1);
    spawn_rank(&p[1], 1, 2, "token");
    unsetenv("TS_STORE_TOKEN");
    wait_ranks(p, 2, t0, 90);
    expect_failed_with(p, 1, "rejected", "token");
    expect_failed_with(p, 0, "the store rejected a client from 127.0.0.1:", "for a wrong token");
    cr_assert_lt(p[0].exited_s, 15.0, "rank 0 took %.1f s (the deadline is 30 s)", p[0].exited_s);
}

Test(comm_rendezvous, stray_wrong_token_client_before_the_rendezvous_fails_nothing, .timeout = 120)
{
    /* The test hosts the store, as tsrun does (it outlives
     * ts_dist_finalize). A client with a wrong token is rejected before
     * the ranks start (a stray process, a port scanner that speaks the
     * protocol): the store records it, but the 2-rank world, and a second
     * one under the same store, still meet and finalize. */
    clear_launch_env();
    ts_store_server *srv = NULL;
    TH_OK(ts_store_server_start(NULL, 0, "tok", &srv));
    int port = ts_store_server_port(srv);
    ts_store *bad = NULL;
    cr_assert_eq(ts_store_connect(NULL, port, "not-the-token", 10.0, &bad), TS_ERR_COMM, "%s", ts_last_error());
    ts_store *c = NULL;
    TH_OK(ts_store_connect(NULL, port, "tok", 10.0, &c));
    cr_assert_eq(ts_store_check(c, TS_STORE_REJECTED_KEY), TS_OK, "the store recorded the rejection");
    int64_t rejected = 0;
    TH_OK(ts_store_add(c, TS_STORE_REJECTED_COUNT_KEY, 0, &rejected));
    cr_assert_eq(rejected, 1);
    hosted_env(port, "rdvstray", "30");
    setenv("TS_TEST_RDV_WANT_ROLE", "twice", 1);
    rank_proc p[2];
    double t0 = th_now_s();
    spawn_rank(&p[0], 0, 2, "stray");
    spawn_rank(&p[1], 1, 2, "stray");
    unsetenv("TS_TEST_RDV_WANT_ROLE");
    wait_ranks(p, 2, t0, 100);
    for (int i = 0; i < 2; i++) {
        char *log = slurp(p[i].log);
        cr_assert(WIFEXITED(p[i].status) && WEXITSTATUS(p[i].status) == 0, "rank %d: status 0x%x; log:\n%s", i,
                  p[i].status, log);
        cr_assert(strstr(log, "init2 TS_OK"), "rank %d: want a second init in:\n%s", i, log);
    }
    ts_store_close(c);
    ts_store_server_stop(srv);
}

Test(comm_rendezvous, missing_store_names_rank_0, .timeout = 60)
{
    /* Rank 0 never starts: rank 1 retries until its deadline, then says
     * where the store should be and that rank 0 may not have started. */
    int port = rdv_env(NULL, "1.5");
    rank_proc p[1];
    double t0 = th_now_s();
    spawn_rank(&p[0], 1, 2, "nostore");
    wait_ranks(p, 1, t0, 40);
    char want[96];
    snprintf(want, sizeof want, "the store on rank 0 at 127.0.0.1:%d is not reachable (", port);
    expect_failed_with(p, 0, want, "rank 0 may not have started");
}

Test(comm_rendezvous, duplicate_rank_0_fails_every_rank, .timeout = 120)
{
    /* The second RANK 0 cannot listen on MASTER_PORT: it finds the first
     * one's store there, RANK 0 claimed in it, and reports the duplicate
     * to every rank. */
    rdv_env(NULL, "60");
    rank_proc p[3];
    double t0 = th_now_s();
    spawn_rank(&p[0], 0, 3, "dup0");
    spawn_rank(&p[1], 0, 3, "dup0"); /* RANK 0 again; rank 2 is missing */
    spawn_rank(&p[2], 1, 3, "dup0");
    wait_ranks(p, 3, t0, 90);
    char pid0[32], pid1[32];
    snprintf(pid0, sizeof pid0, "pid %d ", (int)p[0].pid);
    snprintf(pid1, sizeof pid1, "pid %d ", (int)p[1].pid);
    for (int i = 0; i < 3; i++) {
        char log[sizeof p[i].log];
        snprintf(log, sizeof log, "%s", p[i].log);
        FILE *f = fopen(log, "r");
        cr_assert_not_null(f, "%s", log);
        char text[4096];
        size_t n = fread(text, 1, sizeof text - 1, f);
        text[n] = '\0';
        fclose(f);
        cr_assert(strstr(text, pid0) && strstr(text, pid1), "process %d: want '%s' and '%s' in:\n%s", i, pid0, pid1,
                  text);
        expect_failed_with(p, i, "duplicate RANK 0: claimed by pid", "RANK in 0..2");
        cr_assert_lt(p[i].exited_s, 20.0, "process %d took %.1f s (the deadline is 60 s)", i, p[i].exited_s);
    }
    /* The second RANK 0 counts itself out in the store, so rank 0, which
     * hosts it, leaves as soon as rank 1 has read the error too, not after
     * its 5 s grace for ranks that never come. */
    double others = p[1].exited_s > p[2].exited_s ? p[1].exited_s : p[2].exited_s;
    cr_assert_lt(p[0].exited_s - others, 2.5, "rank 0 left %.2f s after the others (the grace is 5 s)",
                 p[0].exited_s - others);
}

Test(comm_rendezvous, master_port_held_by_another_program_is_named, .timeout = 60)
{
    /* A plain socket listens on MASTER_PORT and never answers: rank 0
     * keeps the EADDRINUSE detail and says another program holds it. */
    clear_launch_env();
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    cr_assert_geq(fd, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    cr_assert_eq(listen(fd, 8), 0);
    socklen_t len = sizeof a;
    cr_assert_eq(getsockname(fd, (struct sockaddr *)&a, &len), 0);
    char port[16], want[64];
    snprintf(port, sizeof port, "%d", ntohs(a.sin_port));
    snprintf(want, sizeof want, "another program holds MASTER_PORT %s", port);
    setenv("MASTER_PORT", port, 1);
    setenv("TS_DIST_TIMEOUT", "30", 1);
    rank_proc p[1];
    double t0 = th_now_s();
    spawn_rank(&p[0], 0, 2, "held");
    wait_ranks(p, 1, t0, 50);
    close(fd);
    expect_failed_with(p, 0, "(EADDRINUSE)", want);
    cr_assert_lt(p[0].exited_s, 15.0, "rank 0 took %.1f s (the probe is bounded by 5 s)", p[0].exited_s);
}

Test(comm_rendezvous, inconsistent_world_size_fails_every_rank, .timeout = 120)
{
    rdv_env(NULL, "60");
    rank_proc p[3];
    double t0 = th_now_s();
    spawn_rank(&p[0], 0, 2, "ws"); /* WORLD_SIZE 2 ... */
    spawn_rank(&p[1], 1, 3, "ws"); /* ... and 3 */
    spawn_rank(&p[2], 2, 3, "ws");
    wait_ranks(p, 3, t0, 90);
    for (int i = 0; i < 3; i++) {
        expect_failed_with(p, i, "inconsistent WORLD_SIZE", "has WORLD_SIZE");
        cr_assert_lt(p[i].exited_s, 20.0, "process %d took %.1f s (the deadline is 60 s)", i, p[i].exited_s);
    }
}

Test(comm_rendezvous, rank_connecting_after_the_error_is_recorded_still_reads_it, .timeout = 120)
{
    /* Rank 0 (WORLD_SIZE 2) hosts the store; rank 2 (WORLD_SIZE 3)
     * arrives after it, finds the inconsistency and records it, and rank
     * 0 then usually reads the recorded error before rank 2's arrival.
     * Rank 1 (WORLD_SIZE 3) starts only once rank 2 has failed and exited:
     * rank 0 must keep the store up until rank 1 too has read the error
     * (every rank of the largest WORLD_SIZE announced), so that rank 1
     * fails at once naming the problem instead of meeting a closed port
     * until its deadline. */
    int port = rdv_env("rdvlate", "30");
    rank_proc p0[1], p1[1], p2[1];
    double t0 = th_now_s();
    spawn_rank(&p0[0], 0, 2, "late");
    ts_store *c = NULL;
    TH_OK(ts_store_connect(NULL, port, NULL, 30.0, &c)); /* rank 0's store (retries until it listens) */
    ts_store_set_timeout(c, 30.0);
    void *v = NULL;
    size_t n = 0;
    TH_OK(ts_store_get(c, "dist/rdvlate/0/rdv/arrival/1", &v, &n)); /* rank 0 has arrived */
    cr_assert(n >= 4 && memcmp(v, "0 2 ", 4) == 0, "arrival 1 is '%.*s', not rank 0's", (int)n, (char *)v);
    ts_store_value_free(v);
    ts_store_close(c);
    spawn_rank(&p2[0], 2, 3, "late");
    wait_ranks(p2, 1, t0, 60); /* rank 2 has failed and left */
    expect_failed_with(p2, 0, "inconsistent WORLD_SIZE", "has WORLD_SIZE");
    double t1 = th_now_s();
    spawn_rank(&p1[0], 1, 3, "late");
    wait_ranks(p1, 1, t1, 60);
    wait_ranks(p0, 1, t0, 60);
    expect_failed_with(p1, 0, "inconsistent WORLD_SIZE", "has WORLD_SIZE");
    expect_failed_with(p0, 0, "inconsistent WORLD_SIZE", "has WORLD_SIZE");
    cr_assert_lt(p1[0].exited_s, 15.0, "rank 1 failed %.1f s after it started (the deadline is 30 s)", p1[0].exited_s);
    cr_assert_lt(p0[0].exited_s, 45.0, "rank 0 took %.1f s", p0[0].exited_s);
}

Test(comm_rendezvous, rank_0_hosting_the_store_counts_a_dead_rank_out, .timeout = 120)
{
    /* Rank 0 hosts the store; rank 2 arrives and is killed; rank 1 starts
     * after that. Rank 0 finds rank 2 dead and counts it out of the failed
     * rendezvous (it will never read the error), so rank 0 leaves as soon
     * as rank 1 has read the error, not after its 5 s grace. */
    int port = rdv_env("rdvdead", "30");
    rank_proc p0[1], p1[1], victim;
    double t0 = th_now_s();
    spawn_rank(&p0[0], 0, 3, "dead");
    spawn_rank(&victim, 2, 3, "dead");
    ts_store *c = NULL;
    TH_OK(ts_store_connect(NULL, port, NULL, 30.0, &c)); /* rank 0's store (retries until it listens) */
    ts_store_set_timeout(c, 30.0);
    void *v = NULL;
    size_t n = 0;
    TH_OK(ts_store_get(c, "dist/rdvdead/0/rdv/arrival/2", &v, &n)); /* ranks 0 and 2 have arrived */
    ts_store_value_free(v);
    ts_store_close(c);
    kill(victim.pid, SIGKILL);
    int st;
    cr_assert_eq(waitpid(victim.pid, &st, 0), victim.pid);
    unlink(victim.log);
    double t1 = th_now_s();
    spawn_rank(&p1[0], 1, 3, "dead");
    wait_ranks(p1, 1, t1, 60);
    wait_ranks(p0, 1, t0, 60);
    expect_failed_with(p1, 0, "rank 2 (pid", "exited before the rendezvous");
    expect_failed_with(p0, 0, "rank 2 (pid", "exited before the rendezvous");
    double gap = (t0 + p0[0].exited_s) - (t1 + p1[0].exited_s);
    cr_assert_lt(gap, 2.5, "rank 0 left %.2f s after rank 1 (the grace is 5 s)", gap);
    cr_log_info("rank 0 left %.2f s after rank 1", gap);
}

Test(comm_rendezvous, rank_killed_before_the_rendezvous_fails_the_others_at_once, .timeout = 120)
{
    clear_launch_env();
    /* The test hosts the store, as a launcher would, so it can see rank 2
     * arrive; no launcher watches the ranks. */
    ts_store_server *srv = NULL;
    TH_OK(ts_store_server_start(NULL, 0, "tok", &srv));
    char port[16];
    snprintf(port, sizeof port, "%d", ts_store_server_port(srv));
    setenv("MASTER_PORT", port, 1);
    setenv("TS_STORE_HOSTED", "1", 1);
    setenv("TS_STORE_TOKEN", "tok", 1);
    setenv("TS_RUN_ID", "rdvkill", 1);
    setenv("TS_DIST_TIMEOUT", "120", 1);
    rank_proc victim, p[2];
    spawn_rank(&victim, 2, 3, "kill");
    ts_store *c = NULL;
    TH_OK(ts_store_connect(NULL, ts_store_server_port(srv), "tok", 30.0, &c));
    ts_store_set_timeout(c, 30.0);
    void *v = NULL;
    size_t n = 0;
    TH_OK(ts_store_get(c, "dist/rdvkill/0/rdv/arrival/1", &v, &n)); /* rank 2 has published its pid */
    ts_store_value_free(v);
    kill(victim.pid, SIGKILL);
    int st;
    cr_assert_eq(waitpid(victim.pid, &st, 0), victim.pid);
    unlink(victim.log);
    double t0 = th_now_s();
    spawn_rank(&p[0], 0, 3, "kill");
    spawn_rank(&p[1], 1, 3, "kill");
    wait_ranks(p, 2, t0, 100);
    for (int i = 0; i < 2; i++) {
        expect_failed_with(p, i, "rank 2 (pid", "exited before the rendezvous");
        cr_assert_lt(p[i].exited_s, 5.0, "rank %d failed after %.1f s (the deadline is 120 s)", i, p[i].exited_s);
    }
    ts_store_close(c);
    ts_store_server_stop(srv);
}

Test(comm_rendezvous, waiting_rendezvous_names_the_missing_ranks_until_the_deadline, .timeout = 120)
{
    rdv_env(NULL, "2.5"); /* the rendezvous deadline, from the environment */
    setenv("TS_TEST_RDV_PROGRESS", "0.5", 1);
    rank_proc p[1];
    double t0 = th_now_s();
    spawn_rank(&p[0], 0, 3, "wait"); /* ranks 1 and 2 never come */
    wait_ranks(p, 1, t0, 60);
    unsetenv("TS_TEST_RDV_PROGRESS");
    char *log = slurp(p[0].log);
    cr_assert(WIFEXITED(p[0].status) && WEXITSTATUS(p[0].status) == 3, "status 0x%x:\n%s", p[0].status, log);
    int lines = 0;
    for (const char *q = log; (q = strstr(q, "still waiting for rank(s) [1, 2] (1 of 3 arrived)")); q++) lines++;
    cr_assert_geq(lines, 2, "%d progress lines in:\n%s", lines, log);
    cr_assert(strstr(log, "TS_ERR_TIMEOUT") && strstr(log, "rank(s) [1, 2], which never arrived (1 of 3 arrived)") &&
                  strstr(log, "TS_DIST_TIMEOUT"),
              "%s", log);
    cr_assert(p[0].exited_s > 2.0 && p[0].exited_s < 15.0, "failed after %.1f s, the deadline is 2.5 s", p[0].exited_s);
    cr_log_info("%d progress lines; failed after %.2f s", lines, p[0].exited_s);
}

Test(comm_rendezvous, bad_dist_timeout_is_a_clear_error, .timeout = 30)
{
    clear_launch_env();
    static const char *bad[] = {"", "abc", "0", "-1", "5s", "1e999", "nan", "inf", "3000000"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        setenv("TS_DIST_TIMEOUT", bad[i], 1);
        ts_status s = ts_dist_init(NULL);
        cr_assert_eq(s, TS_ERR_INVALID_ARGUMENT, "'%s': %s", bad[i], ts_status_name(s));
        char want[64];
        snprintf(want, sizeof want, "TS_DIST_TIMEOUT='%s'", bad[i]);
        cr_assert(strstr(ts_last_error(), want), "'%s': %s", bad[i], ts_last_error());
        cr_assert(!ts_dist_is_initialized());
    }
    setenv("TS_DIST_TIMEOUT", "2.5", 1);
    TH_OK(ts_dist_init(NULL)); /* alone: a one-rank world */
    TH_OK(ts_dist_finalize());
    unsetenv("TS_DIST_TIMEOUT");
}

Test(comm_rendezvous, ranks_on_several_hosts_need_a_token, .timeout = 30)
{
    clear_launch_env();
    /* mpirun-style, 2 ranks on 2 hosts, no token: refused on both ranks
     * before anything listens or connects. */
    setenv("OMPI_COMM_WORLD_SIZE", "2", 1);
    setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "1", 1);
    setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0", 1);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", "29999", 1);
    for (int r = 0; r < 2; r++) {
        char rs[8];
        snprintf(rs, sizeof rs, "%d", r);
        setenv("OMPI_COMM_WORLD_RANK", rs, 1);
        double t0 = th_now_s();
        ts_status s = ts_dist_init(NULL);
        cr_assert_eq(s, TS_ERR_INVALID_ARGUMENT, "rank %d: %s: %s", r, ts_status_name(s), ts_last_error());
        cr_assert(strstr(ts_last_error(), "TS_STORE_TOKEN") && strstr(ts_last_error(), "several hosts") &&
                      strstr(ts_last_error(), "mpirun -x"),
                  "%s", ts_last_error());
        cr_assert_lt(th_now_s() - t0, 1.0);
    }
    clear_launch_env();
}

Test(comm_rendezvous, dist_timeout_sets_the_collective_deadline, .timeout = 120)
{
    rdv_env(NULL, "2");
    setenv("TS_TEST_RDV_WANT_ROLE", "stall", 1);
    rank_proc p[2];
    double t0 = th_now_s();
    spawn_rank(&p[0], 0, 2, "stall");
    spawn_rank(&p[1], 1, 2, "stall");
    unsetenv("TS_TEST_RDV_WANT_ROLE");
    wait_ranks(p, 1, t0, 60); /* rank 0 alone: rank 1 waits to be killed */
    kill(p[1].pid, SIGKILL);
    waitpid(p[1].pid, &p[1].status, 0);
    unlink(p[1].log);
    char *log = slurp(p[0].log);
    cr_assert(WIFEXITED(p[0].status) && WEXITSTATUS(p[0].status) == 5, "status 0x%x:\n%s", p[0].status, log);
    double dt = -1;
    const char *line = strstr(log, "all_reduce TS_ERR_TIMEOUT after ");
    cr_assert_not_null(line, "%s", log);
    sscanf(line, "all_reduce TS_ERR_TIMEOUT after %lf", &dt);
    cr_assert(dt > 1.5 && dt < 10.0, "the all-reduce timed out after %.2f s; TS_DIST_TIMEOUT is 2 s:\n%s", dt, log);
    cr_log_info("%s", line);
}

Test(comm_rendezvous, rank_exiting_0_under_tsrun_before_joining_fails_the_others_at_once, .timeout = 120)
{
    /* tsrun records every rank's exit in its store; rank 1 exits with
     * status 0 before it publishes anything, and ranks 0 and 2 fail at
     * once naming it (not at the 60 s deadline, blaming nobody). */
    clear_launch_env();
    setenv("TS_DIST_TIMEOUT", "60", 1);
    setenv("TS_TEST_RDV_ROLE", "exit1", 1);
    setenv("TS_TEST_RDV_PROGRESS", "0.5", 1); /* a progress line would show a wait */
    const char *tmp = getenv("TMPDIR");
    char log[256];
    snprintf(log, sizeof log, "%s/rdv-tsrun-%d.log", tmp && *tmp ? tmp : "/tmp", (int)getpid());
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    char *argv[] = {TSRUN, "--nproc-per-node", "3", "--grace", "1", th_self_exe(), NULL};
    rank_proc p[1];
    snprintf(p[0].log, sizeof p[0].log, "%s", log);
    double t0 = th_now_s();
    cr_assert_eq(posix_spawn(&p[0].pid, argv[0], &fa, NULL, argv, environ), 0);
    posix_spawn_file_actions_destroy(&fa);
    unsetenv("TS_TEST_RDV_ROLE");
    unsetenv("TS_TEST_RDV_PROGRESS");
    wait_ranks(p, 1, t0, 90);
    char *out = slurp(log);
    cr_assert(WIFEXITED(p[0].status) && WEXITSTATUS(p[0].status) == 3, "tsrun: status 0x%x:\n%s", p[0].status, out);
    /* The rank tsrun names failed first and says why; tsrun then stops
     * the other one, which may or may not have printed its line yet: any
     * line it did print names rank 1 too. */
    int failed = -1;
    const char *last = strstr(out, "tsrun: rank ");
    cr_assert(last && sscanf(last, "tsrun: rank %d exited with status 3", &failed) == 1 && (failed == 0 || failed == 2),
              "%s", out);
    for (int r = 0; r <= 2; r += 2) {
        char want[64];
        snprintf(want, sizeof want, "[%d] init ", r);
        const char *line = strstr(out, want);
        cr_assert(line || r != failed, "rank %d, which tsrun names, printed no init line:\n%s", r, out);
        if (!line) continue;
        const char *eol = strchr(line, '\n');
        const char *named = strstr(line, "rank 1 exited (status 0) before joining the rendezvous of 3 ranks");
        cr_assert(strncmp(line + strlen(want), "TS_ERR_PEER_FAILED after ", 25) == 0 && named && (!eol || named < eol),
                  "rank %d: want TS_ERR_PEER_FAILED naming rank 1 in:\n%s", r, out);
    }
    cr_assert_null(strstr(out, "[1] "), "rank 1 printed something:\n%s", out);
    cr_assert_null(strstr(out, "still waiting"), "%s", out);
    cr_assert_lt(p[0].exited_s, 20.0, "tsrun took %.1f s (the deadline is 60 s):\n%s", p[0].exited_s, out);
    cr_log_info("tsrun exited after %.2f s:\n%s", p[0].exited_s, out);
}
