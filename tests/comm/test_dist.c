/*
 * ts_dist_init / ts_dist_finalize: the world from the launcher's
 * environment, end to end. This binary is also its own rank program
 * (TS_TEST_DIST_ROLE, handled by a constructor before Criterion starts):
 * the tests start it as ranks through ts_launch. Ranks report through
 * their exit code and stderr and leave with _exit (no cr_assert there).
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "comm/comm.h"
#include "comm/launch.h"
#include "tests/helpers.h"

/* ------------------------------------------------------------ rank side */

static int g_rank = -1;

#define RFAIL(code, ...) th_rank_exit(g_rank, (code), __VA_ARGS__)

static double get(const void *p, ts_dtype d, size_t i)
{
    switch (d) {
    case TS_F32: return ((const float *)p)[i];
    case TS_F64: return ((const double *)p)[i];
    case TS_BF16: return ts_bf16_to_f32(((const uint16_t *)p)[i]);
    case TS_F16: return ts_f16_to_f32(((const uint16_t *)p)[i]);
    case TS_I64: return (double)((const int64_t *)p)[i];
    case TS_I32: return ((const int32_t *)p)[i];
    case TS_BOOL: return ((const bool *)p)[i] ? 1.0 : 0.0;
    default: return NAN;
    }
}

static void put(void *p, ts_dtype d, size_t i, double v)
{
    switch (d) {
    case TS_F32: ((float *)p)[i] = (float)v; break;
    case TS_F64: ((double *)p)[i] = v; break;
    case TS_BF16: ((uint16_t *)p)[i] = ts_f32_to_bf16((float)v); break;
    case TS_F16: ((uint16_t *)p)[i] = ts_f32_to_f16((float)v); break;
    case TS_I64: ((int64_t *)p)[i] = (int64_t)v; break;
    case TS_I32: ((int32_t *)p)[i] = (int32_t)v; break;
    case TS_BOOL: ((bool *)p)[i] = v != 0.0; break;
    default: break;
    }
}

/* Rank r's value at index i: small integers, exact in every dtype (and
 * their sums over <= 4 ranks too). */
static double val(int r, size_t i, ts_dtype d)
{
    if (d == TS_BOOL) return (double)(((size_t)r + i) % 2);
    return (double)((r * 37 + (long)(i % 1000) * 11 + (long)(i / 1000)) % 23) - 11;
}

static double tol(ts_dtype d)
{
    switch (d) {
    case TS_BF16: return 1e-2;
    case TS_F16: return 1e-3;
    case TS_F32: return 1e-6;
    case TS_F64: return 1e-12;
    default: return 0;
    }
}

static ts_tensor *mk(ts_dtype d, int64_t n)
{
    ts_tensor *t = NULL;
    if (ts_tensor_empty(d, 1, &n, &t) != TS_OK) RFAIL(20, "tensor_empty");
    return t;
}

static void check(const char *what, ts_dtype d, int64_t n, const ts_tensor *t, const double *want)
{
    const void *p = ts_tensor_data(t);
    for (int64_t i = 0; i < n; i++) {
        double g = get(p, d, (size_t)i), w = want[i];
        if (!(fabs(g - w) <= tol(d) * (1.0 + fabs(w))))
            RFAIL(21, "%s %s n=%lld: [%lld] = %g, want %g", what, ts_dtype_name(d), (long long)n, (long long)i, g, w);
    }
}

static double ref_reduce(ts_reduce_op op, ts_dtype d, int W, size_t idx, double pre, double post)
{
    double acc = 0;
    for (int j = 0; j < W; j++) {
        double x = val(j, idx, d) / pre;
        if (j == 0 || op == TS_REDUCE_SUM || op == TS_REDUCE_AVG) acc = j == 0 ? x : acc + x;
        else if (op == TS_REDUCE_MAX) acc = fmax(acc, x);
        else acc = fmin(acc, x);
    }
    if (op == TS_REDUCE_AVG) acc /= W;
    acc /= post;
    if (d == TS_I64) acc = trunc(acc);
    return acc;
}

static const char *k_ops[] = {"sum", "avg", "max", "min"};

static void run_collectives(ts_comm *c)
{
    int W = ts_comm_size(c), R = ts_comm_rank(c);
    static const ts_dtype dts[] = {TS_F32, TS_F64, TS_BF16, TS_F16, TS_I64, TS_I32, TS_BOOL};
    /* 150001 elements: blocks of 300 KB and more, over the transport's
     * shared-memory bypass threshold (256 KiB) for every dtype but bool */
    static const int64_t sizes[] = {1, 5, 7, 1000, 4099, 150001};
    char what[128];
    for (size_t di = 0; di < sizeof dts / sizeof dts[0]; di++) {
        ts_dtype d = dts[di];
        bool reducible = d != TS_I32 && d != TS_BOOL;
        for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
            int64_t n = sizes[si];
            double *want = malloc(sizeof(double) * (size_t)n * (size_t)W);
            if (!want) RFAIL(22, "malloc");
            /* all-gather */
            ts_tensor *in = mk(d, n), *out = mk(d, n * W);
            for (int64_t i = 0; i < n; i++) put(ts_tensor_data(in), d, (size_t)i, val(R, (size_t)i, d));
            if (ts_all_gather_into_tensor(c, out, in, NULL) != TS_OK) RFAIL(23, "all_gather %s", ts_dtype_name(d));
            for (int j = 0; j < W; j++)
                for (int64_t i = 0; i < n; i++) want[j * n + i] = val(j, (size_t)i, d);
            check("all_gather", d, n * W, out, want);
            ts_tensor_free(in);
            ts_tensor_free(out);
            /* broadcast from a root that varies */
            int root = (int)((di + si) % (size_t)W);
            ts_tensor *b = mk(d, n);
            for (int64_t i = 0; i < n; i++) put(ts_tensor_data(b), d, (size_t)i, val(R, (size_t)i, d));
            if (ts_broadcast(c, b, root, NULL) != TS_OK) RFAIL(24, "broadcast %s", ts_dtype_name(d));
            for (int64_t i = 0; i < n; i++) want[i] = val(root, (size_t)i, d);
            check("broadcast", d, n, b, want);
            ts_tensor_free(b);
            if (!reducible) {
                free(want);
                continue;
            }
            for (int op = 0; op < TS_REDUCE_OP_COUNT; op++) {
                /* all-reduce (any size) */
                ts_tensor *t = mk(d, n);
                for (int64_t i = 0; i < n; i++) put(ts_tensor_data(t), d, (size_t)i, val(R, (size_t)i, d));
                if (ts_all_reduce(c, t, (ts_reduce_op)op, NULL) != TS_OK)
                    RFAIL(25, "all_reduce %s %s", k_ops[op], ts_dtype_name(d));
                for (int64_t i = 0; i < n; i++) want[i] = ref_reduce((ts_reduce_op)op, d, W, (size_t)i, 1, 1);
                snprintf(what, sizeof what, "all_reduce %s", k_ops[op]);
                check(what, d, n, t, want);
                ts_tensor_free(t);
                /* reduce-scatter, without and (SUM/AVG of floats) with factors */
                int nf = (op == TS_REDUCE_SUM || op == TS_REDUCE_AVG) && d != TS_I64 ? 2 : 1;
                for (int f = 0; f < nf; f++) {
                    double pre = f ? 2.0 : 1.0, post = f ? 4.0 : 1.0;
                    ts_tensor *rin = mk(d, n * W), *rout = mk(d, n);
                    for (int64_t i = 0; i < n * W; i++) put(ts_tensor_data(rin), d, (size_t)i, val(R, (size_t)i, d));
                    if (ts_reduce_scatter_tensor(c, rout, rin, (ts_reduce_op)op, pre, post, NULL) != TS_OK)
                        RFAIL(26, "reduce_scatter %s %s", k_ops[op], ts_dtype_name(d));
                    for (int64_t i = 0; i < n; i++)
                        want[i] = ref_reduce((ts_reduce_op)op, d, W, (size_t)(R * n + i), pre, post);
                    snprintf(what, sizeof what, "reduce_scatter %s pre %g post %g", k_ops[op], pre, post);
                    check(what, d, n, rout, want);
                    ts_tensor_free(rin);
                    ts_tensor_free(rout);
                }
            }
            free(want);
        }
        if (ts_barrier(c, NULL) != TS_OK) RFAIL(27, "barrier");
    }
}

static void role_coll(void)
{
    /* TS_TEST_CMA_OFF_RANK=r: rank r turns the shared-memory bypass off;
     * the pairs must still agree on the path of every large message */
    const char *off = getenv("TS_TEST_CMA_OFF_RANK"), *me = getenv("RANK");
    if (off && me && atoi(off) == atoi(me)) setenv("TS_UCX_CMA", "0", 1);
    ts_dist_options o = ts_dist_options_default();
    o.timeout_s = 60;
    if (ts_dist_init(&o) != TS_OK) RFAIL(10, "ts_dist_init");
    ts_comm *c = ts_dist_world();
    g_rank = ts_comm_rank(c);
    const char *ws = getenv("WORLD_SIZE");
    if (!ts_dist_is_initialized() || (ws && ts_comm_size(c) != atoi(ws))) RFAIL(11, "bad world");
    if (ts_dist_init(&o) != TS_ERR_ALREADY) RFAIL(12, "second init");
    run_collectives(c);
    ts_comm_counters k;
    ts_comm_stats(c, &k);
    uint64_t ncoll = 0;
    for (int i = 0; i < TS_COLL_KIND_COUNT; i++) ncoll += k.calls[i];
    if (ncoll < 300) RFAIL(15, "only %llu collectives counted", (unsigned long long)ncoll);
    if (ts_dist_finalize() != TS_OK) RFAIL(13, "ts_dist_finalize");
    if (ts_dist_is_initialized() || ts_dist_world() != ts_comm_world()) RFAIL(14, "world after finalize");
    /* Collectives after finalize: the one-rank group. */
    run_collectives(ts_dist_world());
    fprintf(stderr, "rank %d ok (%llu collectives)\n", g_rank, (unsigned long long)ncoll);
    fflush(stderr);
    _exit(0);
}

/* Rank 2 SIGKILLs itself while a large all-reduce is in flight; ranks 0
 * and 1 must see TS_ERR_PEER_FAILED within 2 s of its death (its
 * CLOCK_MONOTONIC time of death goes through a file). */
static void role_kill(void)
{
    signal(SIGTERM, SIG_IGN); /* the launcher stops us when rank 2 dies: measure first */
    const char *file = getenv("TS_TEST_DIST_KILLFILE");
    ts_dist_options o = ts_dist_options_default();
    o.timeout_s = 30;
    if (!file || ts_dist_init(&o) != TS_OK) RFAIL(10, "ts_dist_init");
    ts_comm *c = ts_dist_world();
    g_rank = ts_comm_rank(c);
    int64_t n = 4 << 20; /* 16 MiB of f32 */
    ts_tensor *t = mk(TS_F32, n);
    memset(ts_tensor_data(t), 0, (size_t)n * 4);
    for (int it = 0; it < 1000; it++) {
        if (g_rank == 2 && it == 3) {
            ts_request *r = NULL;
            if (ts_all_reduce(c, t, TS_REDUCE_SUM, &r) != TS_OK) RFAIL(30, "submit");
            usleep(2000); /* mid-collective */
            FILE *f = fopen(file, "w");
            if (!f) RFAIL(31, "fopen %s", file);
            fprintf(f, "%.9f\n", th_now_s());
            fclose(f);
            raise(SIGKILL);
        }
        ts_status s = ts_all_reduce(c, t, TS_REDUCE_SUM, NULL);
        if (s == TS_OK) continue;
        double t_err = th_now_s();
        double t_kill = 0;
        FILE *f = fopen(file, "r");
        if (!f || fscanf(f, "%lf", &t_kill) != 1) RFAIL(32, "no time of death in %s", file);
        fclose(f);
        double dt = t_err - t_kill;
        fprintf(stderr, "detect rank %d %s %.3f s after the kill: %s\n", g_rank, ts_status_name(s), dt,
                ts_last_error());
        fflush(stderr);
        double t0 = th_now_s();
        ts_status fs = ts_dist_finalize();
        fprintf(stderr, "rank %d finalize %s in %.3f s\n", g_rank, ts_status_name(fs), th_now_s() - t0);
        fflush(stderr);
        if (s != TS_ERR_PEER_FAILED || !(dt < 2.0) || ts_dist_is_initialized()) _exit(33);
        fprintf(stderr, "rank %d detect-ok\n", g_rank);
        fflush(stderr);
        _exit(0);
    }
    RFAIL(34, "no failure seen");
}

__attribute__((constructor)) static void dist_test_role(void)
{
    const char *role = getenv("TS_TEST_DIST_ROLE");
    if (!role) return;
    if (strcmp(role, "coll") == 0) role_coll();
    if (strcmp(role, "kill") == 0) role_kill();
    fprintf(stderr, "unknown TS_TEST_DIST_ROLE=%s\n", role);
    _exit(6);
}

/* ------------------------------------------------------------ test side */

ParameterizedTestParameters(dist, collectives)
{
    static int sizes[] = {1, 2, 3, 4};
    return cr_make_param_array(int, sizes, sizeof sizes / sizeof sizes[0]);
}

ParameterizedTest(int *world, dist, collectives, .timeout = 120)
{
    th_clear_launch_env();
    setenv("TS_TEST_DIST_ROLE", "coll", 1);
    ts_launch_options o = ts_launch_options_default();
    o.nproc_per_node = *world;
    o.forward_signals = false;
    char *argv[] = {th_self_exe(), NULL};
    ts_launch_result res;
    double t0 = th_now_s();
    TH_OK(ts_launch(&o, argv, &res));
    fprintf(stderr, "dist/collectives W=%d: %.2f s\n", *world, th_now_s() - t0);
    cr_assert_eq(res.exit_code, 0, "rank %d failed: exit %d signal %d", res.failed_rank, res.exit_code,
                 res.failed_signal);
}

/* One rank with the shared-memory bypass off, the others on: every pair
 * agrees on the path (large messages to or from rank 1 go through UCX,
 * the others through the bypass), and the results are right. */
Test(dist, collectives_with_the_bypass_off_on_one_rank, .timeout = 120)
{
    th_clear_launch_env();
    setenv("TS_TEST_DIST_ROLE", "coll", 1);
    setenv("TS_TEST_CMA_OFF_RANK", "1", 1);
    ts_launch_options o = ts_launch_options_default();
    o.nproc_per_node = 3;
    o.forward_signals = false;
    char *argv[] = {th_self_exe(), NULL};
    ts_launch_result res;
    TH_OK(ts_launch(&o, argv, &res));
    unsetenv("TS_TEST_CMA_OFF_RANK");
    cr_assert_eq(res.exit_code, 0, "rank %d failed: exit %d signal %d", res.failed_rank, res.exit_code,
                 res.failed_signal);
}

/* One run of the failure scenario; returns the ranks' captured stderr. */
static char *run_peer_killed(ts_launch_result *res, double *elapsed)
{
    char file[] = "/tmp/ts-test-dist-kill-XXXXXX";
    int kfd = mkstemp(file);
    cr_assert_geq(kfd, 0);
    close(kfd);
    setenv("TS_TEST_DIST_ROLE", "kill", 1);
    setenv("TS_TEST_DIST_KILLFILE", file, 1);
    ts_launch_options o = ts_launch_options_default();
    o.nproc_per_node = 3;
    o.forward_signals = false;
    o.grace_s = 15; /* the survivors ignore SIGTERM and leave by themselves */
    o.err_fd = memfd_create("ts-dist-err", MFD_CLOEXEC);
    cr_assert_geq(o.err_fd, 0);
    char *argv[] = {th_self_exe(), NULL};
    double t0 = th_now_s();
    TH_OK(ts_launch(&o, argv, res));
    *elapsed = th_now_s() - t0;
    char *err = th_slurp_fd(o.err_fd);
    close(o.err_fd);
    unlink(file);
    fprintf(stderr, "%s(whole launch %.2f s)\n", err, *elapsed);
    return err;
}

/* Rank 2 is SIGKILLed amid large all-reduces: ranks 0 and 1 must fail with
 * TS_ERR_PEER_FAILED within 2 s (each rank measures and exits non-zero
 * otherwise), and the launcher must name rank 2 and SIGKILL. */
Test(dist, peer_killed, .timeout = 120)
{
    th_clear_launch_env();
    ts_launch_result res;
    double el = 0;
    char *err = run_peer_killed(&res, &el);
    cr_assert_neq(res.exit_code, 0);
    cr_assert_eq(res.failed_rank, 2, "failed rank %d", res.failed_rank);
    cr_assert_eq(res.failed_signal, SIGKILL, "signal %d", res.failed_signal);
    cr_assert_lt(el, 30.0);
    bool ok = strstr(err, "[0] rank 0 detect-ok") && strstr(err, "[1] rank 1 detect-ok");
    cr_assert(ok, "a survivor did not report TS_ERR_PEER_FAILED within 2 s:\n%s", err);
    free(err);
}

/* The same with same-host endpoints in UCX's NONE error mode
 * (TS_UCX_ERROR_MODE=local-none): the pid watch alone detects the death,
 * in time, and teardown stays bounded. The collectives pass in that mode. */
Test(dist, peer_killed_local_none, .timeout = 120)
{
    th_clear_launch_env();
    setenv("TS_UCX_ERROR_MODE", "local-none", 1);
    ts_launch_result res;
    double el = 0;
    char *err = run_peer_killed(&res, &el);
    cr_assert_eq(res.failed_rank, 2, "failed rank %d", res.failed_rank);
    cr_assert_lt(el, 30.0);
    bool ok = strstr(err, "[0] rank 0 detect-ok") && strstr(err, "[1] rank 1 detect-ok");
    cr_assert(ok, "a survivor did not report TS_ERR_PEER_FAILED within 2 s:\n%s", err);
    free(err);
    setenv("TS_TEST_DIST_ROLE", "coll", 1);
    ts_launch_options o = ts_launch_options_default();
    o.nproc_per_node = 3;
    o.forward_signals = false;
    char *argv[] = {th_self_exe(), NULL};
    TH_OK(ts_launch(&o, argv, &res));
    cr_assert_eq(res.exit_code, 0, "rank %d failed: exit %d", res.failed_rank, res.exit_code);
    setenv("TS_UCX_ERROR_MODE", "sometimes", 1);
    TH_OK(ts_launch(&o, argv, &res));
    cr_assert_neq(res.exit_code, 0, "a bad TS_UCX_ERROR_MODE was accepted");
    unsetenv("TS_UCX_ERROR_MODE");
}

/* A process started alone: a one-rank world, no store, no UCX. */
Test(dist, alone, .timeout = 30)
{
    th_clear_launch_env();
    cr_assert(!ts_dist_is_initialized());
    cr_assert_eq(ts_dist_finalize(), TS_ERR_STATE);
    TH_OK(ts_dist_init(NULL));
    cr_assert(ts_dist_is_initialized());
    cr_assert_eq(ts_dist_init(NULL), TS_ERR_ALREADY);
    ts_comm *c = ts_dist_world();
    cr_assert(ts_comm_world() == c || ts_comm_size(ts_comm_world()) == 1);
    cr_assert_eq(ts_comm_size(c), 1);
    cr_assert_eq(ts_comm_rank(c), 0);
    g_rank = 0;
    run_collectives(c);
    TH_OK(ts_dist_finalize());
    cr_assert(!ts_dist_is_initialized());
    cr_assert_eq(ts_dist_world(), ts_comm_world());
    ts_dist_options o = ts_dist_options_default();
    cr_assert_str_eq(o.transport, "ucx");
    cr_assert_eq(o.timeout_s, 300.0);
    o.transport = "carrier-pigeon";
    cr_assert_eq(ts_dist_init(&o), TS_ERR_UNSUPPORTED);
    o.transport = "loopback";
    TH_OK(ts_dist_init(&o));
    TH_OK(ts_dist_finalize());
}

Test(dist, bad_env, .timeout = 30)
{
    th_clear_launch_env();
    setenv("RANK", "5", 1);
    setenv("WORLD_SIZE", "2", 1);
    setenv("MASTER_PORT", "29500", 1);
    cr_assert_eq(ts_dist_init(NULL), TS_ERR_INVALID_ARGUMENT);
    cr_assert(!ts_dist_is_initialized());
    setenv("RANK", "1", 1);
    unsetenv("MASTER_PORT");
    cr_assert_eq(ts_dist_init(NULL), TS_ERR_INVALID_ARGUMENT);
    cr_assert(!ts_dist_is_initialized());
}

extern char **environ;

/* mpirun-style: no launcher hosts the store, so rank 0 does. */
Test(dist, rank0_hosts_store, .timeout = 60)
{
    th_clear_launch_env();
    enum { W = 3 };
    char port[16];
    snprintf(port, sizeof port, "%d", th_free_port());
    setenv("TS_TEST_DIST_ROLE", "coll", 1);
    setenv("MASTER_PORT", port, 1);
    setenv("OMPI_COMM_WORLD_SIZE", "3", 1);
    setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "3", 1);
    setenv("UCX_TLS", "posix,cma,self", 0);
    setenv("UCX_MM_ERROR_HANDLING", "y", 0);
    setenv("UCX_KEEPALIVE_INTERVAL", "1s", 0);
    setenv("UCX_WARN_UNUSED_ENV_VARS", "n", 0);
    pid_t pids[W];
    char *argv[] = {th_self_exe(), NULL};
    for (int r = 0; r < W; r++) {
        char rs[8];
        snprintf(rs, sizeof rs, "%d", r);
        setenv("OMPI_COMM_WORLD_RANK", rs, 1);
        setenv("OMPI_COMM_WORLD_LOCAL_RANK", rs, 1);
        cr_assert_eq(posix_spawn(&pids[r], argv[0], NULL, NULL, argv, environ), 0);
    }
    int status[W];
    th_wait_pids(pids, W, -1, 45, status);
    int failed = 0;
    for (int r = 0; r < W; r++) {
        if (!WIFEXITED(status[r]) || WEXITSTATUS(status[r]) != 0) {
            fprintf(stderr, "rank %d: status 0x%x\n", r, status[r]);
            failed++;
        }
    }
    cr_assert_eq(failed, 0);
}
