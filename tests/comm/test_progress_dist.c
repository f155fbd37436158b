/*
 * Caller-driven progress between real ranks over UCX (comm/comm.c,
 * "Driving"), started without a launcher the way mpirun would (OMPI_*
 * variables; rank 0 hosts the store): a caller that waits drives the
 * world's progress itself (blocking collectives are finished by their
 * caller), an asynchronous collective that a driving caller left behind
 * completes on the communication thread while the caller does not call
 * into the library (also one that takes the shared-memory bypass), and a
 * caller waiting in ts_request_wait on a SIGSTOPped peer still fails at
 * the deadline, naming the collective and the rank, at a small part of a
 * core. This binary is its own rank program (TS_TEST_PROGRESS_ROLE, run
 * by a constructor before Criterion starts); ranks report on stderr and
 * through their exit code.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "comm/comm_internal.h"
#include "tests/helpers.h"

/* ------------------------------------------------------------ rank side */

static int g_rank = -1;

#define RFAIL(code, ...) th_rank_exit(g_rank, (code), __VA_ARGS__)

static ts_tensor *filled(int64_t n, float base)
{
    ts_tensor *t = NULL;
    if (ts_tensor_empty(TS_F32, 1, &n, &t) != TS_OK) RFAIL(20, "tensor");
    float *p = ts_tensor_data(t);
    for (int64_t i = 0; i < n; i++) p[i] = base + (float)(i % 7);
    return t;
}

static void check_gather(const char *what, const ts_tensor *out, int W, int64_t n)
{
    const float *p = ts_tensor_data(out);
    for (int j = 0; j < W; j++)
        for (int64_t i = 0; i < n; i++)
            if (p[j * n + i] != (float)(j * 100) + (float)(i % 7))
                RFAIL(21, "%s: out[%d][%lld] = %g, want %g", what, j, (long long)i, p[j * n + i],
                      (double)(j * 100) + (double)(i % 7));
}

/* 2 ranks. (1) 200 blocking 4 KiB all-reduces: right, and at least half
 * finished by the caller (a caller hands over to the thread only after
 * 5 ms without events). (2) For 1000 floats (eager messages) and 2^18
 * (1 MiB per rank: the shared-memory bypass): rank 0 submits an
 * asynchronous all-gather on a group, then drives a blocking all-reduce
 * of the world and leaves; rank 1 joins the all-gather 30 ms after the
 * all-reduce; both then sleep 300 ms without calling the library, and
 * ts_request_test (which does no progress) must see it done: on rank 0
 * by the communication thread (rank 1 may finish it in the round that
 * starts it at submission). Prints "handover R ok". */
static void role_handover(void)
{
    ts_dist_options o = ts_dist_options_default();
    o.timeout_s = 30;
    if (ts_dist_init(&o) != TS_OK) RFAIL(10, "ts_dist_init");
    ts_comm *c = ts_dist_world();
    g_rank = ts_comm_rank(c);
    int W = ts_comm_size(c);
    int ranks[2] = {0, 1};
    ts_comm *g = NULL;
    if (ts_comm_new_group(c, 2, ranks, &g) != TS_OK) RFAIL(11, "new_group");

    uint64_t c0, t0, c1, t1;
    ts__comm_progress_stats(c, &c0, &t0);
    ts_tensor *acc = filled(1024, 0);
    for (int k = 0; k < 200; k++) {
        float *a = ts_tensor_data(acc);
        for (int i = 0; i < 1024; i++) a[i] = (float)(g_rank + k);
        if (ts_all_reduce(c, acc, TS_REDUCE_SUM, NULL) != TS_OK) RFAIL(12, "all_reduce %d", k);
        for (int i = 0; i < 1024; i++)
            if (a[i] != (float)(2 * k + 1)) RFAIL(13, "all_reduce %d: [%d] = %g", k, i, a[i]);
    }
    ts__comm_progress_stats(c, &c1, &t1);
    fprintf(stderr, "handover %d: blocking: %llu finished by the caller, %llu by the thread\n", g_rank,
            (unsigned long long)(c1 - c0), (unsigned long long)(t1 - t0));
    if (c1 - c0 + t1 - t0 != 200)
        RFAIL(14, "%llu + %llu collectives finished, 200 submitted", (unsigned long long)(c1 - c0),
              (unsigned long long)(t1 - t0));
    if (c1 - c0 < 100)
        RFAIL(15, "the caller finished only %llu of 200 blocking all-reduces", (unsigned long long)(c1 - c0));

    static const int64_t sizes[2] = {1000, 1 << 18};
    for (int s = 0; s < 2; s++) {
        int64_t n = sizes[s], total = n * W;
        ts_tensor *in = filled(n, (float)(g_rank * 100)), *out = NULL;
        if (ts_tensor_zeros(TS_F32, 1, &total, &out) != TS_OK) RFAIL(16, "tensor");
        ts__comm_progress_stats(c, &c0, &t0);
        ts_request *r = NULL;
        if (g_rank == 0 && ts_all_gather_into_tensor(g, out, in, &r) != TS_OK) RFAIL(17, "submit");
        if (ts_all_reduce(c, acc, TS_REDUCE_SUM, NULL) != TS_OK) RFAIL(18, "all_reduce");
        if (g_rank != 0) {
            usleep(30000);
            if (ts_all_gather_into_tensor(g, out, in, &r) != TS_OK) RFAIL(17, "submit");
        }
        usleep(300000); /* no call into the library */
        bool done = false;
        if (ts_request_test(r, &done) != TS_OK) RFAIL(19, "test");
        if (!done)
            RFAIL(22, "the all-gather of %lld floats left behind did not complete without the caller", (long long)n);
        if (ts_request_status(r) != TS_OK) RFAIL(23, "all-gather of %lld floats: %s", (long long)n, ts_last_error());
        check_gather("all_gather left to the thread", out, W, n);
        ts__comm_progress_stats(c, &c1, &t1);
        /* rank 0 left its all-gather behind: its thread finished it; a
         * late rank may finish its own in the round that starts it at
         * submission (every peer's data is there by then) */
        if (g_rank == 0 && t1 - t0 < 1)
            RFAIL(24, "the thread finished none of the collectives (the caller %llu)", (unsigned long long)(c1 - c0));
        if (ts_request_wait(r) != TS_OK) RFAIL(25, "wait");
        ts_request_free(r);
        ts_tensor_free(in);
        ts_tensor_free(out);
    }
    ts_tensor_free(acc);
    ts_comm_free(g);
    if (ts_dist_finalize() != TS_OK) RFAIL(26, "finalize");
    fprintf(stderr, "handover %d ok\n", g_rank);
    fflush(stderr);
    _exit(0);
}

/* 2 ranks: rank 1 stops itself (SIGSTOP) after a barrier; rank 0 submits
 * an asynchronous 4 KiB all-gather (deadline TS_TEST_PROGRESS_DEADLINE s)
 * and waits for it in ts_request_wait: TS_ERR_TIMEOUT; it prints its
 * message and its CPU use while waiting. */
static void role_stopwait(void)
{
    ts_dist_options o = ts_dist_options_default();
    o.timeout_s = 30;
    if (ts_dist_init(&o) != TS_OK) RFAIL(10, "ts_dist_init");
    ts_comm *c = ts_dist_world();
    g_rank = ts_comm_rank(c);
    ts__comm_set_timeout(c, atof(getenv("TS_TEST_PROGRESS_DEADLINE")));
    ts_tensor *in = filled(512, 0), *out = filled(1024, 0);
    if (ts_all_gather_into_tensor(c, out, in, NULL) != TS_OK) RFAIL(11, "first all_gather");
    if (ts_barrier(c, NULL) != TS_OK) RFAIL(12, "barrier");
    if (g_rank == 1) {
        raise(SIGSTOP);
        _exit(0); /* continued: the test is over */
    }
    usleep(100000); /* let rank 1 stop */
    double w0 = th_now_s(), c0 = th_cpu_s();
    ts_request *r = NULL;
    if (ts_all_gather_into_tensor(c, out, in, &r) != TS_OK) RFAIL(13, "submit");
    ts_status s = ts_request_wait(r);
    double wall = th_now_s() - w0, cpu = th_cpu_s() - c0;
    fprintf(stderr, "stopwait %s after %.2f s, cpu %.3f s (%.1f%%): %s\n", ts_status_name(s), wall, cpu,
            100.0 * cpu / wall, ts_last_error());
    fflush(stderr);
    ts_request_free(r);
    _exit(s == TS_ERR_TIMEOUT ? 0 : 35);
}

__attribute__((constructor)) static void progress_test_role(void)
{
    const char *role = getenv("TS_TEST_PROGRESS_ROLE");
    if (!role) return;
    if (strcmp(role, "handover") == 0) role_handover();
    if (strcmp(role, "stopwait") == 0) role_stopwait();
    fprintf(stderr, "unknown TS_TEST_PROGRESS_ROLE=%s\n", role);
    _exit(6);
}

/* ------------------------------------------------------------ test side */

typedef struct job {
    pid_t pid[2];
    int err_fd[2];
    int status[2];
} job;

/* Starts 2 ranks mpirun-style (no launcher: rank 0 hosts the store), each
 * with its stderr in a memfd. */
static void job_start(job *j, const char *role)
{
    th_spawn_mpi_ranks(2, "TS_TEST_PROGRESS_ROLE", role, j->pid, j->err_fd);
}

Test(comm_progress_dist, async_collective_left_by_a_driving_caller_completes_on_the_thread, .timeout = 90)
{
    job j;
    job_start(&j, "handover");
    th_wait_pids(j.pid, 2, -1, 60, j.status);
    for (int r = 0; r < 2; r++) {
        char *err = th_slurp_fd(j.err_fd[r]);
        close(j.err_fd[r]);
        cr_log_info("rank %d: %s", r, err);
        cr_assert(WIFEXITED(j.status[r]) && WEXITSTATUS(j.status[r]) == 0, "rank %d status 0x%x:\n%s", r, j.status[r],
                  err);
        char want[32];
        snprintf(want, sizeof want, "handover %d ok", r);
        cr_assert(strstr(err, want), "rank %d:\n%s", r, err);
        free(err);
    }
}

/* A caller in ts_request_wait on a stopped peer: the deadline (2 s) still
 * fails it, naming the collective, its number and the rank, and while it
 * waits its process uses a small part of a core (the caller drives
 * progress for 5 ms without events at most, then sleeps). */
Test(comm_progress_dist, wait_on_a_stopped_peer_fails_at_the_deadline_without_a_core, .timeout = 60)
{
    setenv("TS_TEST_PROGRESS_DEADLINE", "2", 1);
    job j;
    job_start(&j, "stopwait");
    th_wait_pids(j.pid, 2, 1, 40, j.status);
    kill(j.pid[1], SIGKILL);
    waitpid(j.pid[1], NULL, 0);
    char *err = th_slurp_fd(j.err_fd[0]);
    close(j.err_fd[0]);
    close(j.err_fd[1]);
    cr_log_info("%s", err);
    cr_assert(WIFEXITED(j.status[0]) && WEXITSTATUS(j.status[0]) == 0, "rank 0 status 0x%x:\n%s", j.status[0], err);
    cr_assert(strstr(err, "stopwait TS_ERR_TIMEOUT"), "%s", err);
    cr_assert(strstr(err, "all_gather #2"), "the error does not name the collective and its number:\n%s", err);
    cr_assert(strstr(err, "rank 1"), "the error does not name the stopped rank:\n%s", err);
    double wall = 0, cpu = 0;
    const char *p = strstr(err, "stopwait TS_ERR_TIMEOUT after ");
    cr_assert(p && sscanf(p, "stopwait TS_ERR_TIMEOUT after %lf s, cpu %lf", &wall, &cpu) == 2, "%s", err);
    cr_assert_geq(wall, 1.9);
    cr_assert_lt(wall, 6.0, "the deadline of 2 s took %.2f s", wall);
    /* a spinning caller would use 100% of a core; a sleeping one well
     * under 5%: 20% leaves room for a loaded machine */
    cr_assert_lt(cpu, 0.2 * wall, "%.3f s of CPU in %.2f s of waiting", cpu, wall);
    free(err);
}
