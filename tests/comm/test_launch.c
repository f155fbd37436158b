/*
 * The launcher: ts_launch in the test process and the tsrun binary, with
 * /bin/sh scripts as ranks, and this test binary itself as a rank
 * (TS_TEST_LAUNCH_ROLE, handled by a constructor before Criterion starts);
 * and ts_launch_env / ts_launch_rank_guard on hand-made environments.
 *
 * No test hangs: every rank's sleep is bounded, every wait on a process or
 * a pipe has a deadline, and every case has a Criterion timeout.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <jansson.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "comm/comm_internal.h"
#include "tests/helpers.h"

#ifndef TS_BUILD_DIR
#error "TS_BUILD_DIR must name the build root (tests/meson.build defines it)"
#endif
#define TSRUN TS_BUILD_DIR "/tools/tsrun"

extern char **environ;

/* ------------------------------------------------------ this binary as a rank */

static void role_guard(void)
{
    ts_status s = ts_launch_rank_guard();
    printf("guard %s %d\n", ts_status_name(s), (int)getpid());
    fflush(stdout);
    if (s != TS_OK) _exit(4);
    for (int i = 0; i < 300; i++) /* bounded: 30 s */
        usleep(100 * 1000);
    _exit(0);
}

static void role_store(void)
{
    ts_rank_env e;
    ts_store *st = NULL;
    ts_status s = ts_launch_env(&e);
    if (s == TS_OK && !e.store_hosted) s = ts_error(TS_ERR_STATE, "TS_STORE_HOSTED is not 1");
    if (s == TS_OK) s = ts_store_connect(e.master_addr, e.master_port, e.token, 10.0, &st);
    if (s == TS_OK) {
        ts_store_set_timeout(st, 10.0);
        char key[32], val[32];
        snprintf(key, sizeof key, "rank/%d", e.rank);
        snprintf(val, sizeof val, "%d", e.rank * 10);
        s = ts_store_set(st, key, val, strlen(val) + 1);
        if (s == TS_OK) s = ts_store_barrier(st, "launch-test", e.world_size);
        for (int r = 0; s == TS_OK && r < e.world_size; r++) {
            void *v = NULL;
            size_t n = 0;
            snprintf(key, sizeof key, "rank/%d", r);
            s = ts_store_get(st, key, &v, &n);
            if (s == TS_OK && atoi(v) != r * 10) s = ts_error(TS_ERR_FORMAT, "rank/%d holds %s", r, (char *)v);
            ts_store_value_free(v);
        }
        ts_store_close(st);
    }
    if (s != TS_OK) {
        fprintf(stderr, "store rank failed: %s: %s\n", ts_status_name(s), ts_last_error());
        _exit(5);
    }
    printf("store ok %d %d\n", e.rank, e.master_port);
    fflush(stdout);
    _exit(0);
}

static void lines_usr1(int sig)
{
    (void)sig;
    static const char tail[] = "partial tail"; /* no newline: the launcher adds one */
    if (write(1, tail, sizeof tail - 1) < 0) _exit(5);
    _exit(3);
}

/* A rank that prints with plain printf (no fflush: the library's line
 * buffering is under test), says "blocked" on stderr, then waits: SIGUSR1
 * makes it write a partial line and exit 3; SIGTERM kills it; alarm(30)
 * bounds it. TS_TEST_GUARD=1 calls ts_launch_rank_guard first. */
static void role_lines(void)
{
    if (getenv("TS_TEST_GUARD") && ts_launch_rank_guard() != TS_OK) _exit(4);
    signal(SIGUSR1, lines_usr1); /* before "blocked" tells the test it may signal */
    alarm(30);
    const char *r = getenv("RANK") ? getenv("RANK") : "-";
    for (int i = 0; i < 3; i++) printf("line %d of %s\n", i, r);
    printf("blocked %d\n", (int)getpid());
    fputs("blocked\n", stderr);
    for (;;) pause();
}

__attribute__((constructor)) static void launch_test_role(void)
{
    const char *role = getenv("TS_TEST_LAUNCH_ROLE");
    if (!role) return;
    if (strcmp(role, "guard") == 0) role_guard();
    if (strcmp(role, "store") == 0) role_store();
    if (strcmp(role, "lines") == 0) role_lines();
    fprintf(stderr, "unknown TS_TEST_LAUNCH_ROLE=%s\n", role);
    _exit(6);
}

/* ------------------------------------------------------------------ helpers */

/* An anonymous file for captured output (not inherited by the ranks). */
static int mem_fd(void)
{
    int fd = memfd_create("ts-launch-out", MFD_CLOEXEC);
    cr_assert_geq(fd, 0, "memfd_create: %s", strerror(errno));
    return fd;
}

/* The whole content of an fd (from offset 0), NUL-terminated; malloc'd. */
typedef struct run_out {
    ts_launch_result res;
    char *out, *err;
    double elapsed;
} run_out;

/* Runs `script` under /bin/sh as n ranks through ts_launch. */
static run_out launch_sh(int n, const char *script, double grace)
{
    ts_launch_options o = ts_launch_options_default();
    o.nproc_per_node = n;
    o.grace_s = grace;
    o.forward_signals = false;
    o.out_fd = mem_fd();
    o.err_fd = mem_fd();
    char *argv[] = {"/bin/sh", "-c", (char *)script, "rank", NULL};
    run_out r;
    memset(&r, 0, sizeof r);
    double t0 = th_now_s();
    TH_OK(ts_launch(&o, argv, &r.res));
    r.elapsed = th_now_s() - t0;
    r.out = th_slurp_fd(o.out_fd);
    r.err = th_slurp_fd(o.err_fd);
    close(o.out_fd);
    close(o.err_fd);
    return r;
}

static void run_out_free(run_out *r)
{
    free(r->out);
    free(r->err);
}

/* True once `pid` no longer runs (gone, or a zombie nobody reaped yet). */
static bool pid_dead(int pid)
{
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return true;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return true;
    buf[n] = '\0';
    const char *p = strrchr(buf, ')');
    return p && (p[2] == 'Z' || p[2] == 'X');
}

static void assert_dies_within(int pid, double seconds)
{
    double end = th_now_s() + seconds;
    while (!pid_dead(pid) && th_now_s() < end) usleep(10 * 1000);
    bool dead = pid_dead(pid);
    if (!dead) kill(pid, SIGKILL);
    cr_assert(dead, "process %d still runs %.1f s later", pid, seconds);
}

typedef struct child {
    pid_t pid;
    int out, err; /* read ends of its stdout and stderr */
    char *out_buf, *err_buf;
    size_t out_len, err_len;
} child;

/* Starts tsrun with `args` (after "tsrun"), environ plus `extra_env`
 * (NULL-terminated, may be NULL), stdout and stderr on pipes. */
static child spawn_tsrun(const char *const *args, const char *const *extra_env)
{
    child c;
    memset(&c, 0, sizeof c);
    int po[2], pe[2];
    cr_assert_eq(pipe2(po, O_CLOEXEC), 0);
    cr_assert_eq(pipe2(pe, O_CLOEXEC), 0);
    char *argv[64];
    int n = 0;
    argv[n++] = TSRUN;
    for (int i = 0; args[i]; i++) argv[n++] = (char *)args[i];
    argv[n] = NULL;
    size_t ne = 0;
    while (environ[ne]) ne++;
    char **envp = calloc(ne + 16, sizeof *envp);
    size_t k = 0;
    for (size_t i = 0; i < ne; i++) envp[k++] = environ[i];
    for (int i = 0; extra_env && extra_env[i]; i++) envp[k++] = (char *)extra_env[i];
    envp[k] = NULL;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, po[1], 1);
    posix_spawn_file_actions_adddup2(&fa, pe[1], 2);
    int r = posix_spawn(&c.pid, TSRUN, &fa, NULL, argv, envp);
    posix_spawn_file_actions_destroy(&fa);
    free(envp);
    close(po[1]);
    close(pe[1]);
    cr_assert_eq(r, 0, "posix_spawn %s: %s (is tsrun built?)", TSRUN, strerror(r));
    c.out = po[0];
    c.err = pe[0];
    return c;
}

static void append(char **buf, size_t *len, const char *s, size_t n)
{
    *buf = realloc(*buf, *len + n + 1);
    cr_assert(*buf);
    memcpy(*buf + *len, s, n);
    *len += n;
    (*buf)[*len] = '\0';
}

/* Reads the child's pipes until `done(out)` holds, both reach EOF, or the
 * deadline passes. Returns whether `done` held (or EOF when done is NULL). */
static bool pump(child *c, double seconds, bool (*done)(const char *out, const void *arg), const void *arg)
{
    double end = th_now_s() + seconds;
    for (;;) {
        if (done && c->out_buf && done(c->out_buf, arg)) return true;
        if (c->out < 0 && c->err < 0) return done == NULL;
        double left = end - th_now_s();
        if (left <= 0) return false;
        struct pollfd pf[2] = {{.fd = c->out, .events = POLLIN}, {.fd = c->err, .events = POLLIN}};
        int r = poll(pf, 2, (int)(left * 1000) + 1);
        if (r < 0 && errno == EINTR) continue;
        cr_assert_geq(r, 0);
        char tmp[4096];
        for (int i = 0; i < 2; i++) {
            if (pf[i].fd < 0 || !(pf[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
            ssize_t n = read(pf[i].fd, tmp, sizeof tmp);
            if (n > 0) {
                if (i == 0) append(&c->out_buf, &c->out_len, tmp, (size_t)n);
                else append(&c->err_buf, &c->err_len, tmp, (size_t)n);
            } else if (n == 0 || errno != EINTR) {
                close(pf[i].fd);
                if (i == 0) c->out = -1;
                else c->err = -1;
            }
        }
    }
}

/* Waits for the child with a deadline (SIGKILL then): its wait status. */
static int reap(child *c, double seconds)
{
    double end = th_now_s() + seconds;
    int status = 0;
    for (;;) {
        pid_t r = waitpid(c->pid, &status, WNOHANG);
        if (r == c->pid) break;
        if (th_now_s() > end) {
            kill(c->pid, SIGKILL);
            waitpid(c->pid, &status, 0);
            cr_assert_fail("tsrun (pid %d) did not end within %.1f s", (int)c->pid, seconds);
        }
        usleep(5 * 1000);
    }
    pump(c, 5.0, NULL, NULL); /* what is left in the pipes */
    if (!c->out_buf) append(&c->out_buf, &c->out_len, "", 0);
    if (!c->err_buf) append(&c->err_buf, &c->err_len, "", 0);
    return status;
}

static void child_free(child *c)
{
    if (c->out >= 0) close(c->out);
    if (c->err >= 0) close(c->err);
    free(c->out_buf);
    free(c->err_buf);
}

static int count_substr(const char *s, const char *needle)
{
    int n = 0;
    for (const char *p = strstr(s, needle); p; p = strstr(p + 1, needle)) n++;
    return n;
}

struct want {
    const char *needle;
    int n;
};

static bool has_n_of(const char *out, const void *arg)
{
    const struct want *w = arg;
    return count_substr(out, w->needle) >= w->n;
}

/* The pids printed as "<tag> <pid>" in out, in order. */
static int pids_after(const char *out, const char *tag, int *pids, int max)
{
    int n = 0;
    size_t tl = strlen(tag);
    for (const char *p = strstr(out, tag); p && n < max; p = strstr(p + tl, tag)) pids[n++] = atoi(p + tl);
    return n;
}

/* ------------------------------------------------------------ environment */

ParameterizedTestParameters(comm_launch, ranks_see_their_world)
{
    static int sizes[] = {1, 2, 3, 4};
    return cr_make_param_array(int, sizes, sizeof sizes / sizeof sizes[0]);
}

ParameterizedTest(int *world, comm_launch, ranks_see_their_world, .timeout = 60)
{
    /* stale launcher variables in the caller's environment are replaced */
    setenv("RANK", "77", 1);
    setenv("MASTER_PORT", "1", 1);
    unsetenv("UCX_TLS");
    unsetenv("UCX_MM_ERROR_HANDLING");
    unsetenv("UCX_KEEPALIVE_INTERVAL");
    unsetenv("UCX_WARN_UNUSED_ENV_VARS");
    unsetenv("BLIS_NUM_THREADS");
    unsetenv("TS_NUM_THREADS");
    run_out r = launch_sh(*world,
                          "echo \"R=$RANK W=$WORLD_SIZE L=$LOCAL_RANK LW=$LOCAL_WORLD_SIZE A=$MASTER_ADDR "
                          "P=$MASTER_PORT T=$TS_STORE_TOKEN I=$TS_RUN_ID H=$TS_STORE_HOSTED "
                          "LP=$TS_LAUNCHER_PID TLS=$UCX_TLS MM=$UCX_MM_ERROR_HANDLING "
                          "KA=$UCX_KEEPALIVE_INTERVAL WU=$UCX_WARN_UNUSED_ENV_VARS BT=$BLIS_NUM_THREADS "
                          "TT=$TS_NUM_THREADS\"; echo \"err from $RANK\" >&2",
                          3.0);
    cr_assert_eq(r.res.exit_code, 0, "stderr: %s", r.err);
    cr_assert_eq(r.res.failed_rank, -1);
    cr_assert_gt(r.res.master_port, 0);
    long cores = ts_cpu_count();
    int threads = (int)(cores / *world) < 1 ? 1 : (int)(cores / *world);
    char token[256] = "", run_id[256] = "";
    for (int rank = 0; rank < *world; rank++) {
        char head[32];
        snprintf(head, sizeof head, "[%d] R=", rank);
        const char *line = strstr(r.out, head);
        cr_assert(line, "no line of rank %d in:\n%s", rank, r.out);
        int R, W, L, LW, P, H, LP, BT, TT;
        char A[64], T[256], I[256], TLS[64], MM[8], KA[8], WU[8];
        int got = sscanf(line,
                         "[%*d] R=%d W=%d L=%d LW=%d A=%63s P=%d T=%255s I=%255s H=%d LP=%d TLS=%63s MM=%7s "
                         "KA=%7s WU=%7s BT=%d TT=%d",
                         &R, &W, &L, &LW, A, &P, T, I, &H, &LP, TLS, MM, KA, WU, &BT, &TT);
        cr_assert_eq(got, 16, "line: %.300s", line);
        cr_assert_eq(R, rank);
        cr_assert_eq(W, *world);
        cr_assert_eq(L, rank);
        cr_assert_eq(LW, *world);
        cr_assert_str_eq(A, "127.0.0.1");
        cr_assert_eq(P, r.res.master_port);
        cr_assert_geq(strlen(T), 16, "a generated token: %s", T);
        cr_assert_geq(strlen(I), 8, "a generated run id: %s", I);
        if (rank == 0) {
            snprintf(token, sizeof token, "%s", T);
            snprintf(run_id, sizeof run_id, "%s", I);
        }
        cr_assert_str_eq(T, token, "one token for the job");
        cr_assert_str_eq(I, run_id, "one run id for the job");
        cr_assert_eq(H, 1);
        cr_assert_eq(LP, (int)getpid());
        cr_assert_str_eq(TLS, "posix,cma,self");
        cr_assert_str_eq(MM, "y");
        cr_assert_str_eq(KA, "1s");
        cr_assert_str_eq(WU, "n");
        cr_assert_eq(BT, threads);
        cr_assert_eq(TT, threads);
        char err_line[64];
        snprintf(err_line, sizeof err_line, "[%d] err from %d\n", rank, rank);
        cr_assert(strstr(r.err, err_line), "stderr of rank %d goes to err_fd: %s", rank, r.err);
    }
    cr_assert_eq(count_substr(r.out, "R="), *world, "%s", r.out);
    run_out_free(&r);
}

Test(comm_launch, user_settings_win_over_defaults, .timeout = 30)
{
    setenv("UCX_TLS", "tcp,self", 1);
    setenv("UCX_KEEPALIVE_INTERVAL", "5s", 1);
    setenv("BLIS_NUM_THREADS", "7", 1);
    setenv("TS_NUM_THREADS", "5", 1);
    ts_launch_options o = ts_launch_options_default();
    o.nproc_per_node = 2;
    o.forward_signals = false;
    o.token = "sekrit";
    o.run_id = "job-42";
    o.out_fd = mem_fd();
    char *argv[] = {"/bin/sh", "-c",
                    "echo \"$UCX_TLS $UCX_KEEPALIVE_INTERVAL $BLIS_NUM_THREADS $TS_NUM_THREADS "
                    "$TS_STORE_TOKEN $TS_RUN_ID\"",
                    NULL};
    ts_launch_result res;
    TH_OK(ts_launch(&o, argv, &res));
    cr_assert_eq(res.exit_code, 0);
    char *out = th_slurp_fd(o.out_fd);
    cr_assert(strstr(out, "[0] tcp,self 5s 7 5 sekrit job-42\n"), "%s", out);
    cr_assert(strstr(out, "[1] tcp,self 5s 7 5 sekrit job-42\n"), "%s", out);
    free(out);
    close(o.out_fd);
}

Test(comm_launch, master_port_zero_picks_a_free_port_the_ranks_reach, .timeout = 60)
{
    /* the ranks are this binary: they read their world with ts_launch_env,
     * connect to the store the launcher hosts and meet in a barrier */
    setenv("TS_TEST_LAUNCH_ROLE", "store", 1);
    ts_launch_options o = ts_launch_options_default();
    o.nproc_per_node = 3;
    o.master_port = 0;
    o.forward_signals = false;
    o.out_fd = mem_fd();
    o.err_fd = mem_fd();
    char *argv[] = {th_self_exe(), NULL};
    ts_launch_result res;
    TH_OK(ts_launch(&o, argv, &res));
    char *out = th_slurp_fd(o.out_fd), *err = th_slurp_fd(o.err_fd);
    cr_assert_eq(res.exit_code, 0, "rank %d failed: stdout:\n%s\nstderr:\n%s", res.failed_rank, out, err);
    cr_assert_gt(res.master_port, 0);
    for (int r = 0; r < 3; r++) {
        char want[64];
        snprintf(want, sizeof want, "[%d] store ok %d %d\n", r, r, res.master_port);
        cr_assert(strstr(out, want), "missing '%s' in:\n%s\nstderr:\n%s", want, out, err);
    }
    free(out);
    free(err);
    close(o.out_fd);
    close(o.err_fd);
}

/* ----------------------------------------------------------------- output */

#define LINES_PER_RANK 1000

Test(comm_launch, output_lines_are_whole_and_prefixed, .timeout = 120)
{
    /* each line is written in two pieces (two printf builtins, two writes),
     * 1 KB of payload, by 4 ranks at once; stderr lines go to the same fd;
     * the last line has no newline */
    enum { N = 4 };
    char script[1024];
    snprintf(script, sizeof script,
             "p=0123456789; p=$p$p$p$p$p$p$p$p$p$p; p=$p$p$p$p$p$p$p$p$p$p; i=0; "
             "while [ $i -lt %d ]; do printf 'L %%s %%s ' $RANK $i; printf '%%s\\n' \"$p\"; "
             "if [ $((i %% 10)) = 0 ]; then printf 'E %%s ' $RANK >&2; printf '%%s\\n' $i >&2; fi; "
             "i=$((i+1)); done; printf 'tail %%s' $RANK",
             LINES_PER_RANK);
    ts_launch_options o = ts_launch_options_default();
    o.nproc_per_node = N;
    o.forward_signals = false;
    o.out_fd = o.err_fd = mem_fd();
    char *argv[] = {"/bin/sh", "-c", script, NULL};
    ts_launch_result res;
    TH_OK(ts_launch(&o, argv, &res));
    cr_assert_eq(res.exit_code, 0);
    char *out = th_slurp_fd(o.out_fd);
    close(o.out_fd);

    char payload[1001];
    for (int i = 0; i < 1000; i++) payload[i] = (char)('0' + i % 10);
    payload[1000] = '\0';
    int next_l[N] = {0}, next_e[N] = {0}, tails[N] = {0};
    int lines = 0;
    char *save = NULL;
    cr_assert_eq(out[strlen(out) - 1], '\n', "the output ends with a whole line");
    for (char *line = strtok_r(out, "\n", &save); line; line = strtok_r(NULL, "\n", &save), lines++) {
        int pr, r, i, used = 0;
        cr_assert_eq(sscanf(line, "[%d] %n", &pr, &used), 1, "line %d has no prefix: %.80s", lines, line);
        cr_assert(pr >= 0 && pr < N && used > 0, "line %d: %.80s", lines, line);
        const char *body = line + used;
        if (sscanf(body, "L %d %d ", &r, &i) == 2) {
            cr_assert_eq(r, pr, "line %d of rank %d carries rank %d: %.80s", lines, pr, r, line);
            cr_assert_eq(i, next_l[r], "rank %d: line %d after %d", r, i, next_l[r] - 1);
            const char *pl = strrchr(body, ' ') + 1;
            cr_assert_str_eq(pl, payload, "line %d (rank %d, #%d) is not whole", lines, r, i);
            next_l[r]++;
        } else if (sscanf(body, "E %d %d", &r, &i) == 2) {
            cr_assert_eq(r, pr, "%.80s", line);
            cr_assert_eq(i, next_e[r] * 10, "rank %d stderr: %d", r, i);
            next_e[r]++;
        } else if (sscanf(body, "tail %d", &r) == 1) {
            cr_assert_eq(r, pr);
            cr_assert_eq(next_l[r], LINES_PER_RANK, "the unterminated line comes last");
            tails[r]++;
        } else {
            cr_assert_fail("line %d is mangled: %.120s", lines, line);
        }
    }
    for (int r = 0; r < N; r++) {
        cr_assert_eq(next_l[r], LINES_PER_RANK, "rank %d: %d lines", r, next_l[r]);
        cr_assert_eq(next_e[r], LINES_PER_RANK / 10);
        cr_assert_eq(tails[r], 1);
    }
    free(out);
}

Test(comm_launch, overlong_lines_are_split_not_lost, .timeout = 30)
{
    /* 200000 bytes without a newline, then a short line */
    run_out r = launch_sh(1, "head -c 200000 /dev/zero | tr '\\0' x; echo; echo after", 3.0);
    cr_assert_eq(r.res.exit_code, 0);
    size_t xs = 0;
    int pieces = 0;
    char *save = NULL;
    bool after = false;
    for (char *line = strtok_r(r.out, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        cr_assert_eq(strncmp(line, "[0] ", 4), 0);
        if (strcmp(line + 4, "after") == 0) {
            after = true;
            continue;
        }
        size_t n = strlen(line + 4);
        cr_assert_eq(strspn(line + 4, "x"), n);
        cr_assert_leq(n, 64 * 1024);
        xs += n;
        pieces++;
    }
    cr_assert_eq(xs, 200000);
    cr_assert_eq(pieces, 4, "64 KiB pieces");
    cr_assert(after);
    run_out_free(&r);
}

Test(comm_launch, tsrun_no_prefix, .timeout = 30)
{
    const char *args[] = {"--no-prefix", "--nproc-per-node=2", "/bin/sh", "-c", "echo \"hi $RANK\"", NULL};
    child c = spawn_tsrun(args, NULL);
    int st = reap(&c, 20);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status %d: %s", st, c.err_buf);
    cr_assert(strstr(c.out_buf, "hi 0\n") && strstr(c.out_buf, "hi 1\n"), "%s", c.out_buf);
    cr_assert_null(strstr(c.out_buf, "["), "%s", c.out_buf);
    child_free(&c);
}

Test(comm_launch, a_closed_output_does_not_kill_tsrun, .timeout = 30)
{
    const char *args[] = {"--nproc-per-node",
                          "2",
                          "/bin/sh",
                          "-c",
                          "i=0; while [ $i -lt 2000 ]; do echo \"line $i\"; i=$((i+1)); done",
                          NULL};
    child c = spawn_tsrun(args, NULL);
    close(c.out); /* nobody reads tsrun's stdout */
    c.out = -1;
    int st = reap(&c, 20);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status %d: %s", st, c.err_buf);
    child_free(&c);
}

/* ---------------------------------------------------------------- failures */

Test(comm_launch, failing_rank_stops_the_others, .timeout = 60)
{
    run_out r = launch_sh(3, "if [ \"$RANK\" = 1 ]; then sleep 0.2; exit 3; fi; exec sleep 30", 1.0);
    cr_assert_eq(r.res.failed_rank, 1);
    cr_assert_eq(r.res.exit_code, 3);
    cr_assert_eq(r.res.failed_signal, 0);
    cr_assert_eq(r.res.received_signal, 0);
    cr_assert_lt(r.elapsed, 5.0, "the sleeping ranks were not stopped: %.1f s", r.elapsed);
    run_out_free(&r);
}

Test(comm_launch, ranks_ignoring_sigterm_are_killed_after_the_grace, .timeout = 60)
{
    run_out r = launch_sh(2, "trap '' TERM; if [ \"$RANK\" = 0 ]; then sleep 0.2; exit 3; fi; sleep 30", 1.0);
    cr_assert_eq(r.res.failed_rank, 0);
    cr_assert_eq(r.res.exit_code, 3);
    cr_assert_geq(r.elapsed, 1.0, "SIGKILL came before the grace: %.2f s", r.elapsed);
    cr_assert_lt(r.elapsed, 8.0, "not killed after the grace: %.1f s", r.elapsed);
    run_out_free(&r);
}

Test(comm_launch, killed_rank_is_reported_as_a_signal, .timeout = 60)
{
    run_out r = launch_sh(2, "if [ \"$RANK\" = 1 ]; then kill -KILL $$; fi; exec sleep 30", 1.0);
    cr_assert_eq(r.res.failed_rank, 1);
    cr_assert_eq(r.res.failed_signal, SIGKILL);
    cr_assert_eq(r.res.exit_code, 128 + SIGKILL);
    cr_assert_lt(r.elapsed, 5.0);
    run_out_free(&r);
}

Test(comm_launch, grandchildren_holding_the_pipe_do_not_hold_the_launcher, .timeout = 60)
{
    /* a successful rank leaves a grandchild that holds its stdout */
    run_out a = launch_sh(1, "sleep 100 & echo \"gc $!\"; exit 0", 3.0);
    cr_assert_eq(a.res.exit_code, 0);
    cr_assert_lt(a.elapsed, 5.0, "waited for the grandchild: %.1f s", a.elapsed);
    int pids[4];
    cr_assert_eq(pids_after(a.out, "gc ", pids, 4), 1, "%s", a.out);
    assert_dies_within(pids[0], 5.0);
    run_out_free(&a);

    /* a failing rank and a waiting one, both with grandchildren */
    run_out b = launch_sh(2, "sleep 100 & echo \"gc $!\"; if [ \"$RANK\" = 1 ]; then sleep 0.3; exit 3; fi; wait", 3.0);
    cr_assert_eq(b.res.failed_rank, 1);
    cr_assert_eq(b.res.exit_code, 3);
    cr_assert_lt(b.elapsed, 5.0, "waited for the grandchildren: %.1f s", b.elapsed);
    cr_assert_eq(pids_after(b.out, "gc ", pids, 4), 2, "%s", b.out);
    assert_dies_within(pids[0], 5.0);
    assert_dies_within(pids[1], 5.0);
    run_out_free(&b);
}

Test(comm_launch, nonexistent_program_is_an_io_error_naming_it, .timeout = 30)
{
    ts_launch_options o = ts_launch_options_default();
    o.nproc_per_node = 3;
    o.forward_signals = false;
    char *argv[] = {"/nonexistent/ts-no-such-program", "x", NULL};
    ts_launch_result res = {.exit_code = 12345};
    ts_status s = ts_launch(&o, argv, &res);
    cr_assert_eq(s, TS_ERR_IO, "%s", ts_status_name(s));
    cr_assert(strstr(ts_last_error(), "ts-no-such-program"), "%s", ts_last_error());
    cr_assert_eq(res.exit_code, 12345, "result untouched on error");

    char *argv2[] = {"ts-no-such-program-in-path", NULL};
    cr_assert_eq(ts_launch(&o, argv2, &res), TS_ERR_IO);
    cr_assert(strstr(ts_last_error(), "ts-no-such-program-in-path"), "%s", ts_last_error());

    const char *args[] = {"--nproc-per-node", "2", "/nonexistent/ts-no-such-program", NULL};
    child c = spawn_tsrun(args, NULL);
    int st = reap(&c, 20);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 1, "status %d", st);
    cr_assert(strstr(c.err_buf, "ts-no-such-program"), "%s", c.err_buf);
    child_free(&c);
}

Test(comm_launch, bad_options_are_rejected, .timeout = 30)
{
    char *argv[] = {"/bin/true", NULL};
    ts_launch_result res;
    ts_launch_options o = ts_launch_options_default();
    o.nproc_per_node = 0;
    cr_assert_eq(ts_launch(&o, argv, &res), TS_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(ts_last_error(), "nproc_per_node"), "%s", ts_last_error());
    o = ts_launch_options_default();
    o.nnodes = 2;
    o.node_rank = 1;
    o.token = "t";
    cr_assert_eq(ts_launch(&o, argv, &res), TS_ERR_INVALID_ARGUMENT, "several nodes need a fixed port");
    cr_assert(strstr(ts_last_error(), "master_port"), "%s", ts_last_error());
    o.master_port = 29500;
    o.token = NULL;
    cr_assert_eq(ts_launch(&o, argv, &res), TS_ERR_INVALID_ARGUMENT, "several nodes need a token");
    cr_assert(strstr(ts_last_error(), "token"), "%s", ts_last_error());
    o = ts_launch_options_default();
    o.grace_s = -1;
    cr_assert_eq(ts_launch(&o, argv, &res), TS_ERR_INVALID_ARGUMENT);
    o = ts_launch_options_default();
    cr_assert_eq(ts_launch(&o, NULL, &res), TS_ERR_INVALID_ARGUMENT);

    static const char *const cases[][4] = {
        {"--bogus", "/bin/true", NULL},
        {"--nproc-per-node", "0", "/bin/true", NULL},
        {"--nproc-per-node", "two", "/bin/true", NULL},
        {"--nproc-per-node", NULL},
        {"--grace=-1", "/bin/true", NULL},
        {"--nnodes=2", "--master-port=29500", "/bin/true", NULL},
        {"--nnodes=2", "--node-rank=2", "--master-port=29500", "/bin/true"},
        {NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *args[6] = {0};
        for (int k = 0; k < 4 && cases[i][k]; k++) args[k] = cases[i][k];
        child c = spawn_tsrun(args, NULL);
        int st = reap(&c, 20);
        cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 2, "case %zu: status %d", i, st);
        cr_assert(strstr(c.err_buf, "tsrun: "), "case %zu: %s", i, c.err_buf);
        child_free(&c);
    }
    const char *help[] = {"--help", NULL};
    child c = spawn_tsrun(help, NULL);
    int st = reap(&c, 20);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    cr_assert(strstr(c.out_buf, "usage: tsrun") && strstr(c.out_buf, "--nproc-per-node"), "%s", c.out_buf);
    child_free(&c);
}

Test(comm_launch, tsrun_reports_the_failed_rank, .timeout = 60)
{
    const char *args[] = {"--nproc-per-node",
                          "3",
                          "--grace",
                          "1",
                          "/bin/sh",
                          "-c",
                          "echo \"up $RANK\"; if [ \"$RANK\" = 2 ]; then sleep 0.2; exit 3; fi; exec sleep 30",
                          NULL};
    double t0 = th_now_s();
    child c = spawn_tsrun(args, NULL);
    int st = reap(&c, 20);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 3, "status %d, stderr: %s", st, c.err_buf);
    cr_assert_lt(th_now_s() - t0, 6.0);
    cr_assert(strstr(c.err_buf, "tsrun: rank 2 exited with status 3\n"), "%s", c.err_buf);
    cr_assert(strstr(c.out_buf, "[2] up 2\n"), "%s", c.out_buf);
    child_free(&c);

    const char *args2[] = {"--nproc-per-node=2", "/bin/sh", "-c",
                           "if [ \"$RANK\" = 1 ]; then kill -KILL $$; fi; exec sleep 30", NULL};
    c = spawn_tsrun(args2, NULL);
    st = reap(&c, 20);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 137, "status %d, stderr: %s", st, c.err_buf);
    cr_assert(strstr(c.err_buf, "tsrun: rank 1 killed by signal SIGKILL\n"), "%s", c.err_buf);
    child_free(&c);
}

/* ---------------------------------------------------------------- signals */

Test(comm_launch, sigterm_to_tsrun_is_forwarded, .timeout = 60)
{
    const char *args[] = {
        "--nproc-per-node", "2", "--grace", "10", "/bin/sh", "-c", "echo \"ready $$\"; exec sleep 30", NULL};
    child c = spawn_tsrun(args, NULL);
    struct want w = {"ready", 2};
    cr_assert(pump(&c, 15, has_n_of, &w), "ranks never became ready: %s", c.out_buf ? c.out_buf : "");
    int pids[2];
    cr_assert_eq(pids_after(c.out_buf, "ready ", pids, 2), 2);
    double t0 = th_now_s();
    kill(c.pid, SIGTERM);
    int st = reap(&c, 15);
    double dt = th_now_s() - t0;
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 143, "status %d, stderr: %s", st, c.err_buf);
    cr_assert_lt(dt, 3.0, "tsrun took %.1f s", dt);
    cr_assert(strstr(c.err_buf, "received SIGTERM"), "%s", c.err_buf);
    assert_dies_within(pids[0], 1.0);
    assert_dies_within(pids[1], 1.0);
    child_free(&c);
}

Test(comm_launch, second_sigint_kills_at_once, .timeout = 60)
{
    /* the ranks ignore SIGINT; the grace is long; a second Ctrl-C kills */
    const char *args[] = {
        "--nproc-per-node", "2", "--grace", "20", "/bin/sh", "-c", "trap '' INT; echo \"ready $$\"; sleep 30", NULL};
    child c = spawn_tsrun(args, NULL);
    struct want w = {"ready", 2};
    cr_assert(pump(&c, 15, has_n_of, &w), "ranks never became ready");
    double t0 = th_now_s();
    kill(c.pid, SIGINT);
    usleep(300 * 1000);
    cr_assert_eq(waitpid(c.pid, NULL, WNOHANG), 0, "tsrun ended on the first SIGINT");
    kill(c.pid, SIGINT);
    int st = reap(&c, 15);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 130, "status %d, stderr: %s", st, c.err_buf);
    cr_assert_lt(th_now_s() - t0, 5.0);
    child_free(&c);
}

Test(comm_launch, ranks_die_with_a_killed_launcher, .timeout = 60)
{
    /* rank 0 is this binary calling ts_launch_rank_guard; ranks 1 and 2 are
     * shells that know nothing, one with a child of its own: the
     * launcher's watchdog kills their process groups */
    char script[4200];
    snprintf(script, sizeof script,
             "case $RANK in 0) exec env TS_TEST_LAUNCH_ROLE=guard '%s';; 1) echo \"ready $$\"; exec sleep 30;; "
             "*) sleep 30 & echo \"ready $$ $!\"; wait;; esac",
             th_self_exe());
    const char *args[] = {"--nproc-per-node", "3", "/bin/sh", "-c", script, NULL};
    child c = spawn_tsrun(args, NULL);
    struct want w = {"ready", 2}, g = {"guard TS_OK", 1};
    cr_assert(pump(&c, 20, has_n_of, &w) && pump(&c, 20, has_n_of, &g), "ranks never reported: %s / %s",
              c.out_buf ? c.out_buf : "", c.err_buf ? c.err_buf : "");
    int pids[4];
    cr_assert_eq(pids_after(c.out_buf, "guard TS_OK ", pids, 1), 1);
    const char *r1 = strstr(c.out_buf, "[1] ready "), *r2 = strstr(c.out_buf, "[2] ready ");
    cr_assert(r1 && r2, "%s", c.out_buf);
    pids[1] = atoi(r1 + 10);
    cr_assert_eq(sscanf(r2 + 10, "%d %d", &pids[2], &pids[3]), 2, "%s", c.out_buf);
    kill(c.pid, SIGKILL);
    int st = reap(&c, 10);
    cr_assert(WIFSIGNALED(st));
    for (int i = 0; i < 4; i++) assert_dies_within(pids[i], 5.0);
    child_free(&c);
}

Test(comm_launch, escaped_grandchildren_are_abandoned_after_the_grace, .timeout = 60)
{
    /* a grandchild in a session of its own holds the pipe: the launcher
     * gives up on the pipe max(grace_s, 1 s) after the rank exited */
    run_out r = launch_sh(1,
                          "setsid sleep 30 & "
                          /* until it has left the rank's session (field 6 of stat) */
                          "while [ \"$(cut -d' ' -f6 /proc/$!/stat 2>/dev/null)\" = $$ ]; do :; done; "
                          "echo \"gc $!\"; exit 0",
                          0.5);
    int pid = 0;
    cr_assert_eq(pids_after(r.out, "gc ", &pid, 1), 1, "%s", r.out);
    kill(pid, SIGKILL);
    cr_assert_eq(r.res.exit_code, 0);
    cr_assert_geq(r.elapsed, 0.9);
    cr_assert_lt(r.elapsed, 5.0, "waited for the escaped grandchild: %.1f s", r.elapsed);
    run_out_free(&r);
}

Test(comm_launch, a_second_node_starts_its_share_without_a_store, .timeout = 30)
{
    unsetenv("UCX_TLS");
    ts_launch_options o = ts_launch_options_default();
    o.nproc_per_node = 2;
    o.nnodes = 3;
    o.node_rank = 1;
    o.master_addr = "node0.example";
    o.master_port = 29511;
    o.token = "tok";
    o.forward_signals = false;
    o.out_fd = mem_fd();
    char *argv[] = {"/bin/sh", "-c",
                    "echo \"$RANK/$WORLD_SIZE $LOCAL_RANK/$LOCAL_WORLD_SIZE $MASTER_ADDR:$MASTER_PORT "
                    "$TS_STORE_TOKEN $TS_RUN_ID $UCX_TLS\"",
                    NULL};
    ts_launch_result res;
    th_mem_mark();
    TH_OK(ts_launch(&o, argv, &res));
    th_mem_assert_back();
    cr_assert_eq(res.exit_code, 0);
    cr_assert_eq(res.master_port, 29511);
    char *out = th_slurp_fd(o.out_fd);
    cr_assert(strstr(out, "[2] 2/6 0/2 node0.example:29511 tok tsrun-node0.example-29511 posix,cma,self,tcp\n"), "%s",
              out);
    cr_assert(strstr(out, "[3] 3/6 1/2 node0.example:29511 tok tsrun-node0.example-29511 posix,cma,self,tcp\n"), "%s",
              out);
    free(out);
    close(o.out_fd);
}

Test(comm_launch, launch_frees_what_it_allocates, .timeout = 30)
{
    char *argv[] = {"/bin/sh", "-c", "echo x; printf y; exit 2", NULL};
    ts_launch_options o = ts_launch_options_default();
    o.nproc_per_node = 2;
    o.forward_signals = false;
    o.out_fd = mem_fd();
    ts_launch_result res;
    th_mem_mark();
    TH_OK(ts_launch(&o, argv, &res));
    th_mem_assert_back();
    cr_assert_eq(res.exit_code, 2);
    char *bad[] = {"/nonexistent/x", NULL};
    th_mem_mark();
    cr_assert_eq(ts_launch(&o, bad, &res), TS_ERR_IO);
    th_mem_assert_back();
    close(o.out_fd);
}

/* ------------------------------------------------------- ts_launch_env */

static void clear_launch_env(void)
{
    static const char *const vars[] = {
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TS_STORE_TOKEN",
        "TS_RUN_ID",
        "TS_STORE_HOSTED",
        "TS_LAUNCHER_PID",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "SLURM_NPROCS",
        "SLURM_LOCALID",
        "SLURM_NODEID",
        "SLURM_STEP_TASKS_PER_NODE",
        "SLURM_TASKS_PER_NODE",
        "SLURM_NTASKS_PER_NODE",
        "SLURM_STEP_NODELIST",
        "SLURM_JOB_NODELIST",
        "SLURM_NODELIST",
        "SLURM_JOB_ID",
        "SLURM_STEP_ID",
    };
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) unsetenv(vars[i]);
}

/* Sets "NAME=VALUE" pairs from a NULL-terminated list. */
static void set_vars(const char *const *kv)
{
    clear_launch_env();
    for (int i = 0; kv[i]; i++) {
        char name[64];
        const char *eq = strchr(kv[i], '=');
        cr_assert(eq);
        snprintf(name, sizeof name, "%.*s", (int)(eq - kv[i]), kv[i]);
        setenv(name, eq + 1, 1);
    }
}

/* Expects `kv` to be rejected with a detail holding every `needles` entry. */
static void expect_rejected(const char *const *kv, ts_status want, const char *const *needles)
{
    set_vars(kv);
    ts_rank_env e;
    memset(&e, 0x5a, sizeof e);
    ts_status s = ts_launch_env(&e);
    cr_assert_eq(s, want, "%s for %s...: %s", ts_status_name(s), kv[0] ? kv[0] : "(none)", ts_last_error());
    for (int i = 0; needles[i]; i++)
        cr_assert(strstr(ts_last_error(), needles[i]), "'%s' not in: %s", needles[i], ts_last_error());
    cr_assert_eq(e.rank, 0x5a5a5a5a, "out untouched on error");
}

/* The probe of the claimed world size runs quiet (docs/design.md, D1):
 * incomplete variables fail inside it, and the caller's last error stays
 * what it was, set or clear. */
Test(comm_launch, world_size_probe_keeps_the_last_error, .timeout = 10)
{
    const char *kv[] = {"OMPI_COMM_WORLD_RANK=0", "OMPI_COMM_WORLD_SIZE=4", NULL}; /* no LOCAL_RANK: fails */
    set_vars(kv);
    ts_error(TS_ERR_SHAPE, "the first error");
    cr_assert_eq(ts__launch_env_world_size(), 4);
    cr_assert_eq(ts_last_status(), TS_ERR_SHAPE, "the probe wrote %s (%s)", ts_status_name(ts_last_status()),
                 ts_last_error());
    cr_assert_str_eq(ts_last_error(), "the first error");
    ts_clear_error();
    cr_assert_eq(ts__launch_env_world_size(), 4);
    cr_assert_eq(ts_last_status(), TS_OK, "the probe wrote %s (%s)", ts_status_name(ts_last_status()), ts_last_error());
    clear_launch_env();
}

Test(comm_launch, env_from_tsrun_variables, .timeout = 10)
{
    const char *kv[] = {"RANK=2", "WORLD_SIZE=4", "LOCAL_RANK=0", "LOCAL_WORLD_SIZE=2", "MASTER_ADDR=10.1.2.3",
                        "MASTER_PORT=29500", "TS_STORE_TOKEN=abc", "TS_RUN_ID=job7", "TS_STORE_HOSTED=1",
                        "TS_LAUNCHER_PID=4242",
                        /* a launcher's variables win over mpirun's and Slurm's */
                        "OMPI_COMM_WORLD_RANK=9", "SLURM_PROCID=8", NULL};
    set_vars(kv);
    ts_rank_env e;
    TH_OK(ts_launch_env(&e));
    cr_assert_eq(e.source, TS_LAUNCH_SOURCE_TSRUN);
    cr_assert_str_eq(ts_launch_source_name(e.source), "tsrun");
    cr_assert_eq(e.rank, 2);
    cr_assert_eq(e.world_size, 4);
    cr_assert_eq(e.local_rank, 0);
    cr_assert_eq(e.local_world_size, 2);
    cr_assert_str_eq(e.master_addr, "10.1.2.3");
    cr_assert_eq(e.master_port, 29500);
    cr_assert_str_eq(e.token, "abc");
    cr_assert_str_eq(e.run_id, "job7");
    cr_assert(e.store_hosted);
    cr_assert_eq(e.launcher_pid, 4242);

    /* neither LOCAL_ variable: one node; no MASTER_ADDR: loopback */
    const char *kv2[] = {"RANK=1", "WORLD_SIZE=3", "MASTER_PORT=5000", NULL};
    set_vars(kv2);
    TH_OK(ts_launch_env(&e));
    cr_assert_eq(e.local_rank, 1);
    cr_assert_eq(e.local_world_size, 3);
    cr_assert_str_eq(e.master_addr, "127.0.0.1");
    cr_assert_str_eq(e.token, "");
    cr_assert(!e.store_hosted);
    cr_assert_eq(e.launcher_pid, 0);

    /* a world of one needs no port */
    const char *kv3[] = {"RANK=0", "WORLD_SIZE=1", NULL};
    set_vars(kv3);
    TH_OK(ts_launch_env(&e));
    cr_assert_eq(e.master_port, 0);
}

Test(comm_launch, env_from_open_mpi_variables, .timeout = 10)
{
    const char *kv[] = {"OMPI_COMM_WORLD_RANK=3",
                        "OMPI_COMM_WORLD_SIZE=4",
                        "OMPI_COMM_WORLD_LOCAL_RANK=1",
                        "OMPI_COMM_WORLD_LOCAL_SIZE=2",
                        "MASTER_ADDR=head",
                        "MASTER_PORT=1234",
                        NULL};
    set_vars(kv);
    ts_rank_env e;
    TH_OK(ts_launch_env(&e));
    cr_assert_eq(e.source, TS_LAUNCH_SOURCE_OMPI);
    cr_assert_str_eq(ts_launch_source_name(e.source), "ompi");
    cr_assert_eq(e.rank, 3);
    cr_assert_eq(e.world_size, 4);
    cr_assert_eq(e.local_rank, 1);
    cr_assert_eq(e.local_world_size, 2);
    cr_assert_str_eq(e.master_addr, "head");
    cr_assert_eq(e.master_port, 1234);
    cr_assert(!e.store_hosted, "rank 0 hosts the store under mpirun");

    /* one node: MASTER_ADDR defaults to loopback */
    const char *kv2[] = {"OMPI_COMM_WORLD_RANK=0",       "OMPI_COMM_WORLD_SIZE=2", "OMPI_COMM_WORLD_LOCAL_RANK=0",
                         "OMPI_COMM_WORLD_LOCAL_SIZE=2", "MASTER_PORT=1234",       NULL};
    set_vars(kv2);
    TH_OK(ts_launch_env(&e));
    cr_assert_str_eq(e.master_addr, "127.0.0.1");

    /* several nodes without MASTER_ADDR */
    const char *kv3[] = {"OMPI_COMM_WORLD_RANK=0",       "OMPI_COMM_WORLD_SIZE=4", "OMPI_COMM_WORLD_LOCAL_RANK=0",
                         "OMPI_COMM_WORLD_LOCAL_SIZE=2", "MASTER_PORT=1234",       NULL};
    expect_rejected(kv3, TS_ERR_INVALID_ARGUMENT,
                    (const char *[]){"MASTER_ADDR", "OMPI_COMM_WORLD_LOCAL_SIZE=2", "OMPI_COMM_WORLD_SIZE=4", NULL});
    /* no port */
    const char *kv4[] = {"OMPI_COMM_WORLD_RANK=0", "OMPI_COMM_WORLD_SIZE=2", "OMPI_COMM_WORLD_LOCAL_RANK=0",
                         "OMPI_COMM_WORLD_LOCAL_SIZE=2", NULL};
    expect_rejected(kv4, TS_ERR_INVALID_ARGUMENT, (const char *[]){"MASTER_PORT", NULL});
    /* a missing local size */
    const char *kv5[] = {"OMPI_COMM_WORLD_RANK=0", "OMPI_COMM_WORLD_SIZE=2", "OMPI_COMM_WORLD_LOCAL_RANK=0",
                         "MASTER_PORT=1", NULL};
    expect_rejected(kv5, TS_ERR_INVALID_ARGUMENT, (const char *[]){"OMPI_COMM_WORLD_LOCAL_SIZE", NULL});
}

Test(comm_launch, env_from_slurm_variables, .timeout = 10)
{
    const char *kv[] = {"SLURM_PROCID=5",
                        "SLURM_NTASKS=6",
                        "SLURM_LOCALID=1",
                        "SLURM_NODEID=2",
                        "SLURM_STEP_TASKS_PER_NODE=2(x3)",
                        "SLURM_STEP_NODELIST=node[03-05]",
                        "SLURM_JOB_ID=77",
                        "SLURM_STEP_ID=0",
                        "MASTER_PORT=29500",
                        NULL};
    set_vars(kv);
    ts_rank_env e;
    TH_OK(ts_launch_env(&e));
    cr_assert_eq(e.source, TS_LAUNCH_SOURCE_SLURM);
    cr_assert_str_eq(ts_launch_source_name(e.source), "slurm");
    cr_assert_eq(e.rank, 5);
    cr_assert_eq(e.world_size, 6);
    cr_assert_eq(e.local_rank, 1);
    cr_assert_eq(e.local_world_size, 2);
    cr_assert_str_eq(e.master_addr, "node03", "the first host of the node list");
    cr_assert_eq(e.master_port, 29500);
    cr_assert_str_eq(e.run_id, "slurm-77.0");
    cr_assert(!e.store_hosted);

    /* uneven nodes, a plain host list, SLURM_NPROCS */
    const char *kv2[] = {"SLURM_PROCID=3",
                         "SLURM_NPROCS=4",
                         "SLURM_LOCALID=0",
                         "SLURM_NODEID=1",
                         "SLURM_TASKS_PER_NODE=3,1",
                         "SLURM_JOB_NODELIST=alpha,beta",
                         "MASTER_PORT=9",
                         NULL};
    set_vars(kv2);
    TH_OK(ts_launch_env(&e));
    cr_assert_eq(e.world_size, 4);
    cr_assert_eq(e.local_world_size, 1);
    cr_assert_str_eq(e.master_addr, "alpha");

    /* a bracket group with a suffix; MASTER_ADDR set wins over the list */
    const char *kv3[] = {"SLURM_PROCID=0",
                         "SLURM_NTASKS=4",
                         "SLURM_LOCALID=0",
                         "SLURM_NTASKS_PER_NODE=2",
                         "SLURM_NODELIST=n[7,9]-ib",
                         "MASTER_PORT=9",
                         NULL};
    set_vars(kv3);
    TH_OK(ts_launch_env(&e));
    cr_assert_str_eq(e.master_addr, "n7-ib");
    setenv("MASTER_ADDR", "10.0.0.9", 1);
    TH_OK(ts_launch_env(&e));
    cr_assert_str_eq(e.master_addr, "10.0.0.9");

    /* one node: loopback, whatever the list */
    const char *kv4[] = {"SLURM_PROCID=1",
                         "SLURM_NTASKS=2",
                         "SLURM_LOCALID=1",
                         "SLURM_TASKS_PER_NODE=2",
                         "SLURM_NODELIST=r[1-2]-n[3-4]",
                         "MASTER_PORT=9",
                         NULL};
    set_vars(kv4);
    TH_OK(ts_launch_env(&e));
    cr_assert_str_eq(e.master_addr, "127.0.0.1");

    /* a list that is not simple, several nodes */
    const char *kv5[] = {"SLURM_PROCID=1",
                         "SLURM_NTASKS=4",
                         "SLURM_LOCALID=1",
                         "SLURM_NODEID=0",
                         "SLURM_TASKS_PER_NODE=2(x2)",
                         "SLURM_STEP_NODELIST=r[1-2]-n[3-4]",
                         "MASTER_PORT=9",
                         NULL};
    expect_rejected(kv5, TS_ERR_INVALID_ARGUMENT, (const char *[]){"MASTER_ADDR", "SLURM_STEP_NODELIST", NULL});
    /* no tasks-per-node variable */
    const char *kv6[] = {"SLURM_PROCID=0", "SLURM_NTASKS=2", "SLURM_LOCALID=0", "MASTER_PORT=9", NULL};
    expect_rejected(kv6, TS_ERR_INVALID_ARGUMENT,
                    (const char *[]){"SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", NULL});
    /* a list without SLURM_NODEID */
    const char *kv7[] = {"SLURM_PROCID=0",           "SLURM_NTASKS=3", "SLURM_LOCALID=0",
                         "SLURM_TASKS_PER_NODE=2,1", "MASTER_PORT=9",  NULL};
    expect_rejected(kv7, TS_ERR_INVALID_ARGUMENT, (const char *[]){"SLURM_NODEID", NULL});
    /* a malformed list */
    const char *kv8[] = {"SLURM_PROCID=0",
                         "SLURM_NTASKS=3",
                         "SLURM_LOCALID=0",
                         "SLURM_NODEID=0",
                         "SLURM_TASKS_PER_NODE=2(y2)",
                         "MASTER_PORT=9",
                         NULL};
    expect_rejected(kv8, TS_ERR_INVALID_ARGUMENT, (const char *[]){"SLURM_TASKS_PER_NODE='2(y2)'", NULL});
    /* the local id beyond this node's tasks */
    const char *kv9[] = {"SLURM_PROCID=2",
                         "SLURM_NTASKS=3",
                         "SLURM_LOCALID=2",
                         "SLURM_NODEID=0",
                         "SLURM_TASKS_PER_NODE=2,1",
                         "MASTER_PORT=9",
                         NULL};
    expect_rejected(kv9, TS_ERR_INVALID_ARGUMENT, (const char *[]){"SLURM_LOCALID=2", "SLURM_TASKS_PER_NODE=2", NULL});
}

Test(comm_launch, env_rejects_inconsistent_values, .timeout = 10)
{
    expect_rejected((const char *[]){NULL}, TS_ERR_NOT_FOUND, (const char *[]){"RANK", "SLURM_PROCID", NULL});
    expect_rejected((const char *[]){"RANK=4", "WORLD_SIZE=4", "MASTER_PORT=1", NULL}, TS_ERR_INVALID_ARGUMENT,
                    (const char *[]){"RANK=4", "WORLD_SIZE=4", NULL});
    expect_rejected((const char *[]){"RANK=1", NULL}, TS_ERR_INVALID_ARGUMENT, (const char *[]){"WORLD_SIZE", NULL});
    expect_rejected((const char *[]){"WORLD_SIZE=2", NULL}, TS_ERR_INVALID_ARGUMENT, (const char *[]){"RANK", NULL});
    expect_rejected((const char *[]){"RANK=x", "WORLD_SIZE=2", NULL}, TS_ERR_INVALID_ARGUMENT,
                    (const char *[]){"RANK='x'", NULL});
    expect_rejected((const char *[]){"RANK=-1", "WORLD_SIZE=2", NULL}, TS_ERR_INVALID_ARGUMENT,
                    (const char *[]){"RANK='-1'", NULL});
    expect_rejected((const char *[]){"RANK=0", "WORLD_SIZE=0", NULL}, TS_ERR_INVALID_ARGUMENT,
                    (const char *[]){"WORLD_SIZE='0'", NULL});
    expect_rejected((const char *[]){"RANK=0", "WORLD_SIZE=2", "LOCAL_RANK=0", "MASTER_PORT=1", NULL},
                    TS_ERR_INVALID_ARGUMENT, (const char *[]){"LOCAL_RANK", "LOCAL_WORLD_SIZE", NULL});
    expect_rejected(
        (const char *[]){"RANK=0", "WORLD_SIZE=2", "LOCAL_RANK=2", "LOCAL_WORLD_SIZE=2", "MASTER_PORT=1", NULL},
        TS_ERR_INVALID_ARGUMENT, (const char *[]){"LOCAL_RANK=2", "LOCAL_WORLD_SIZE=2", NULL});
    expect_rejected(
        (const char *[]){"RANK=0", "WORLD_SIZE=2", "LOCAL_RANK=0", "LOCAL_WORLD_SIZE=3", "MASTER_PORT=1", NULL},
        TS_ERR_INVALID_ARGUMENT, (const char *[]){"LOCAL_WORLD_SIZE=3", "WORLD_SIZE=2", NULL});
    expect_rejected((const char *[]){"RANK=0", "WORLD_SIZE=2", NULL}, TS_ERR_INVALID_ARGUMENT,
                    (const char *[]){"MASTER_PORT", "WORLD_SIZE=2", NULL});
    expect_rejected((const char *[]){"RANK=0", "WORLD_SIZE=2", "MASTER_PORT=70000", NULL}, TS_ERR_INVALID_ARGUMENT,
                    (const char *[]){"MASTER_PORT='70000'", NULL});
    expect_rejected((const char *[]){"RANK=0", "WORLD_SIZE=1", "TS_LAUNCHER_PID=abc", NULL}, TS_ERR_INVALID_ARGUMENT,
                    (const char *[]){"TS_LAUNCHER_PID", NULL});
}

/* ------------------------------------------------------------ rank guard */

Test(comm_launch, rank_guard_checks_the_launcher, .timeout = 30)
{
    unsetenv("TS_LAUNCHER_PID");
    TH_OK(ts_launch_rank_guard()); /* not launched: nothing to guard */

    char buf[32];
    snprintf(buf, sizeof buf, "%d", (int)getppid());
    setenv("TS_LAUNCHER_PID", buf, 1);
    TH_OK(ts_launch_rank_guard()); /* the parent */

    /* an ancestor further up: a wrapper sits between launcher and rank */
    char path[64], stat[512] = "";
    snprintf(path, sizeof path, "/proc/%d/stat", (int)getppid());
    FILE *f = fopen(path, "r");
    cr_assert(f);
    cr_assert(fgets(stat, sizeof stat, f));
    fclose(f);
    int grand = atoi(strrchr(stat, ')') + 4);
    if (grand > 1) {
        snprintf(buf, sizeof buf, "%d", grand);
        setenv("TS_LAUNCHER_PID", buf, 1);
        TH_OK(ts_launch_rank_guard());
    }

    /* a process that is neither parent nor ancestor: a child of ours */
    pid_t kid = fork();
    cr_assert_geq(kid, 0);
    if (kid == 0) {
        usleep(10 * 1000 * 1000);
        _exit(0);
    }
    snprintf(buf, sizeof buf, "%d", (int)kid);
    setenv("TS_LAUNCHER_PID", buf, 1);
    ts_status s = ts_launch_rank_guard();
    kill(kid, SIGKILL);
    waitpid(kid, NULL, 0);
    cr_assert_eq(s, TS_ERR_PEER_FAILED, "%s", ts_status_name(s));
    cr_assert(strstr(ts_last_error(), buf), "%s", ts_last_error());

    setenv("TS_LAUNCHER_PID", "abc", 1);
    cr_assert_eq(ts_launch_rank_guard(), TS_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(ts_last_error(), "TS_LAUNCHER_PID"), "%s", ts_last_error());
    unsetenv("TS_LAUNCHER_PID");
}

/* ------------------------------------------------------------ live output */

/* Reads on until stderr holds n times `needle` (or 20 s passed). */
static void pump_err(child *c, const char *needle, int n)
{
    for (double end = th_now_s() + 20; count_substr(c->err_buf ? c->err_buf : "", needle) < n && th_now_s() < end;)
        pump(c, 0.05, NULL, NULL);
    cr_assert_geq(count_substr(c->err_buf ? c->err_buf : "", needle), n, "stderr: %s", c->err_buf);
}

/* Rank r's three lines (and its "blocked" line) are in out, once each. */
static void assert_rank_lines(const char *out, const char *prefix_fmt, int r)
{
    for (int i = 0; i < 3; i++) {
        char want[64];
        snprintf(want, sizeof want, prefix_fmt, r);
        size_t n = strlen(want);
        snprintf(want + n, sizeof want - n, "line %d of %d\n", i, r);
        cr_assert_eq(count_substr(out, want), 1, "'%s' is not there once in:\n%s", want, out);
    }
}

ParameterizedTestParameters(comm_launch, lines_are_relayed_live_and_survive_sigterm)
{
    static int guard[] = {0, 1};
    return cr_make_param_array(int, guard, 2);
}

ParameterizedTest(int *guard, comm_launch, lines_are_relayed_live_and_survive_sigterm, .timeout = 60)
{
    /* the ranks print with printf and block: their lines can only come
     * out if stdout is line-buffered (from the library's constructor, or
     * ts_launch_rank_guard with guard) and tsrun relays them at once */
    setenv("TS_TEST_LAUNCH_ROLE", "lines", 1);
    if (*guard) setenv("TS_TEST_GUARD", "1", 1);
    const char *args[] = {"--nproc-per-node", "2", "--grace", "10", th_self_exe(), NULL};
    child c = spawn_tsrun(args, NULL);
    struct want w = {"blocked ", 2};
    cr_assert(pump(&c, 20, has_n_of, &w), "the ranks' lines did not come while they ran:\n%s\nstderr:\n%s",
              c.out_buf ? c.out_buf : "", c.err_buf ? c.err_buf : "");
    for (int r = 0; r < 2; r++) assert_rank_lines(c.out_buf, "[%d] ", r);
    pump_err(&c, "] blocked\n", 2); /* stderr: the other pipe */
    kill(c.pid, SIGTERM);
    int st = reap(&c, 15);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 143, "status %d, stderr: %s", st, c.err_buf);
    for (int r = 0; r < 2; r++) assert_rank_lines(c.out_buf, "[%d] ", r); /* not repeated at the end */
    cr_assert_eq(count_substr(c.err_buf, "] blocked\n"), 2, "%s", c.err_buf);
    child_free(&c);
}

Test(comm_launch, lines_of_the_survivors_are_relayed_when_a_rank_fails, .timeout = 60)
{
    /* rank 1 fails (SIGUSR1: a partial line, then exit 3) while ranks 0
     * and 2 block; tsrun SIGTERMs them: nothing they printed is lost, and
     * rank 1's unterminated line arrives whole */
    setenv("TS_TEST_LAUNCH_ROLE", "lines", 1);
    const char *args[] = {"--nproc-per-node", "3", "--grace", "10", th_self_exe(), NULL};
    child c = spawn_tsrun(args, NULL);
    struct want w = {"blocked ", 3};
    cr_assert(pump(&c, 20, has_n_of, &w), "the ranks' lines did not come while they ran:\n%s",
              c.out_buf ? c.out_buf : "");
    const char *b1 = strstr(c.out_buf, "[1] blocked ");
    cr_assert(b1, "%s", c.out_buf);
    int pid1 = atoi(b1 + strlen("[1] blocked "));
    cr_assert_gt(pid1, 1);
    double t0 = th_now_s();
    kill(pid1, SIGUSR1);
    int st = reap(&c, 15);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 3, "status %d, stderr: %s", st, c.err_buf);
    cr_assert_lt(th_now_s() - t0, 5.0, "the survivors were not stopped at once");
    cr_assert(strstr(c.err_buf, "tsrun: rank 1 exited with status 3\n"), "%s", c.err_buf);
    for (int r = 0; r < 3; r++) assert_rank_lines(c.out_buf, "[%d] ", r);
    cr_assert_eq(count_substr(c.out_buf, "[1] partial tail\n"), 1, "%s", c.out_buf);
    child_free(&c);
}

/* Starts this binary in role `lines` with exactly `env` (plus the role),
 * stdout and stderr on pipes. */
static child spawn_lines(const char *const *env)
{
    child c;
    memset(&c, 0, sizeof c);
    int po[2], pe[2];
    cr_assert_eq(pipe2(po, O_CLOEXEC), 0);
    cr_assert_eq(pipe2(pe, O_CLOEXEC), 0);
    char *envp[16];
    int n = 0;
    envp[n++] = "TS_TEST_LAUNCH_ROLE=lines";
    for (int i = 0; env[i] && n < 15; i++) envp[n++] = (char *)env[i];
    envp[n] = NULL;
    char *argv[] = {th_self_exe(), NULL};
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, po[1], 1);
    posix_spawn_file_actions_adddup2(&fa, pe[1], 2);
    int r = posix_spawn(&c.pid, argv[0], &fa, NULL, argv, envp);
    posix_spawn_file_actions_destroy(&fa);
    close(po[1]);
    close(pe[1]);
    cr_assert_eq(r, 0, "posix_spawn: %s", strerror(r));
    c.out = po[0];
    c.err = pe[0];
    return c;
}

/* Whether the role's stdout lines are out by the time it says "blocked"
 * on stderr (unbuffered, written after them): true when line-buffered. */
static bool stdout_is_live(const char *const *env)
{
    child c = spawn_lines(env);
    char err[256] = "";
    size_t got = 0;
    double end = th_now_s() + 20;
    while (!strstr(err, "blocked\n") && th_now_s() < end) {
        struct pollfd pf = {.fd = c.err, .events = POLLIN};
        if (poll(&pf, 1, 100) > 0) {
            ssize_t r = read(c.err, err + got, sizeof err - 1 - got);
            if (r <= 0) break;
            got += (size_t)r;
            err[got] = '\0';
        }
    }
    cr_assert(strstr(err, "blocked\n"), "the role did not start: %s", err);
    struct pollfd pf = {.fd = c.out, .events = POLLIN};
    bool live = poll(&pf, 1, 0) == 1;
    if (live) {
        /* the lines were written before "blocked": all there now */
        char out[256];
        ssize_t r = read(c.out, out, sizeof out - 1);
        cr_assert_gt(r, 0);
        out[r] = '\0';
        cr_assert(strstr(out, "line 0 of -\nline 1 of -\nline 2 of -\nblocked "), "%s", out);
    }
    kill(c.pid, SIGKILL);
    waitpid(c.pid, NULL, 0);
    child_free(&c);
    return live;
}

Test(comm_launch, ranks_of_mpirun_and_srun_are_line_buffered, .timeout = 60)
{
    /* no tsrun here: the variables alone make a rank */
    const char *ompi[] = {"OMPI_COMM_WORLD_RANK=0", "OMPI_COMM_WORLD_SIZE=1", NULL};
    const char *slurm[] = {"SLURM_PROCID=0", "SLURM_NTASKS=1", NULL};
    const char *torchrun[] = {"WORLD_SIZE=1", NULL};
    const char *forced[] = {"TS_LINE_BUFFERED=1", NULL};
    cr_assert(stdout_is_live(ompi), "mpirun rank");
    cr_assert(stdout_is_live(slurm), "srun rank");
    cr_assert(stdout_is_live(torchrun), "torchrun rank");
    cr_assert(stdout_is_live(forced), "TS_LINE_BUFFERED=1");
    /* and the C default otherwise: block-buffered into a pipe */
    const char *none[] = {NULL};
    const char *opt_out[] = {"OMPI_COMM_WORLD_RANK=0", "OMPI_COMM_WORLD_SIZE=1", "TS_LINE_BUFFERED=0", NULL};
    cr_assert_not(stdout_is_live(none), "not a rank: C's buffering stays");
    cr_assert_not(stdout_is_live(opt_out), "TS_LINE_BUFFERED=0");
}

/* ------------------------------------------------------------ tsrun flags */

/* A fresh directory under $TMPDIR (or /tmp). */
static void make_tmp_dir(char *buf, size_t cap)
{
    const char *t = getenv("TMPDIR");
    snprintf(buf, cap, "%s/ts-launch-XXXXXX", t && *t ? t : "/tmp");
    cr_assert(mkdtemp(buf), "mkdtemp %s: %s", buf, strerror(errno));
}

static int rm_one(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st, (void)flag, (void)ftw;
    if (flag == FTW_DP) chmod(path, 0700);
    return remove(path);
}

static void rm_tree(const char *dir)
{
    chmod(dir, 0700);
    nftw(dir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

static char *read_text(const char *path)
{
    size_t n;
    return th_read_file(path, &n);
}

static void write_text(const char *path, const char *text, mode_t mode)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
    cr_assert_geq(fd, 0, "%s: %s", path, strerror(errno));
    cr_assert_eq(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    cr_assert_eq(fchmod(fd, mode), 0);
    close(fd);
}

/* Runs tsrun with args to the end: its wait status; the child's buffers
 * are left in *c (child_free it). */
static int run_tsrun(child *c, const char *const *args, const char *const *extra_env)
{
    *c = spawn_tsrun(args, extra_env);
    return reap(c, 30);
}

static bool exited_with(int st, int code) { return WIFEXITED(st) && WEXITSTATUS(st) == code; }

Test(comm_launch, tsrun_version_prints_the_library_version, .timeout = 30)
{
    json_error_t jerr;
    json_t *info = json_load_file(TS_BUILD_DIR "/meson-info/intro-projectinfo.json", 0, &jerr);
    cr_assert(info, "meson's project info: %s", jerr.text);
    const char *version = json_string_value(json_object_get(info, "version"));
    cr_assert(version && *version);
    char want[128];
    snprintf(want, sizeof want, "tsrun (tensorshard) %s\n", version);
    json_decref(info);

    child c;
    const char *args[] = {"--version", NULL};
    int st = run_tsrun(&c, args, NULL);
    cr_assert(exited_with(st, 0), "status %d: %s", st, c.err_buf);
    cr_assert_str_eq(c.out_buf, want);
    cr_assert_str_eq(c.err_buf, "");
    child_free(&c);
    /* it runs nothing */
    const char *args2[] = {"--nproc-per-node=2", "--version", "/bin/sh", "-c", "echo ran", NULL};
    st = run_tsrun(&c, args2, NULL);
    cr_assert(exited_with(st, 0));
    cr_assert_str_eq(c.out_buf, want);
    child_free(&c);
    const char *args3[] = {"--version=1", NULL};
    st = run_tsrun(&c, args3, NULL);
    cr_assert(exited_with(st, 2), "status %d", st);
    child_free(&c);
}

Test(comm_launch, tsrun_standalone_is_one_node_on_a_free_port, .timeout = 60)
{
    child c;
    const char *args[] = {"--standalone",
                          "--nproc-per-node",
                          "2",
                          "/bin/sh",
                          "-c",
                          "echo \"W=$WORLD_SIZE N=$GROUP_WORLD_SIZE G=$GROUP_RANK A=$MASTER_ADDR P=$MASTER_PORT\"",
                          NULL};
    int st = run_tsrun(&c, args, NULL);
    cr_assert(exited_with(st, 0), "status %d: %s", st, c.err_buf);
    int ports[2];
    for (int r = 0; r < 2; r++) {
        char head[16];
        snprintf(head, sizeof head, "[%d] W=", r);
        const char *l = strstr(c.out_buf, head);
        cr_assert(l, "%s", c.out_buf);
        char addr[64];
        int w, n, g;
        cr_assert_eq(sscanf(l, "[%*d] W=%d N=%d G=%d A=%63s P=%d", &w, &n, &g, addr, &ports[r]), 5, "%s", l);
        cr_assert_eq(w, 2);
        cr_assert_eq(n, 1);
        cr_assert_eq(g, 0);
        cr_assert_str_eq(addr, "127.0.0.1");
        cr_assert_gt(ports[r], 0);
    }
    cr_assert_eq(ports[0], ports[1]);
    child_free(&c);

    /* as torchrun: an address and a port given anyway are ignored, said
     * so; the ranks reach the store on the free port */
    const char *env[] = {"TS_TEST_LAUNCH_ROLE=store", NULL};
    const char *args2[] = {"--standalone",     "--master-addr",
                           "10.255.255.1",     "--master-port=29517",
                           "--nproc-per-node", "2",
                           th_self_exe(),      NULL};
    st = run_tsrun(&c, args2, env);
    cr_assert(exited_with(st, 0), "status %d: %s", st, c.err_buf);
    cr_assert(strstr(c.err_buf, "--standalone: ignoring --master-addr and --master-port"), "%s", c.err_buf);
    int r0, p0;
    const char *l = strstr(c.out_buf, "[0] store ok ");
    cr_assert(l && sscanf(l, "[0] store ok %d %d", &r0, &p0) == 2, "%s", c.out_buf);
    cr_assert_neq(p0, 29517);
    cr_assert(strstr(c.out_buf, "[1] store ok 1 "), "%s", c.out_buf);
    child_free(&c);

    /* several nodes cannot be standalone */
    const char *args3[] = {"--standalone", "--nnodes", "2", "--master-port", "29500", "/bin/true", NULL};
    st = run_tsrun(&c, args3, NULL);
    cr_assert(exited_with(st, 2), "status %d", st);
    cr_assert(strstr(c.err_buf, "--standalone runs one node"), "%s", c.err_buf);
    child_free(&c);
    const char *args4[] = {"--standalone=yes", "/bin/true", NULL};
    st = run_tsrun(&c, args4, NULL);
    cr_assert(exited_with(st, 2), "status %d", st);
    child_free(&c);
}

Test(comm_launch, tsrun_nproc_per_node_auto_is_one_rank_per_usable_core, .timeout = 60)
{
    cpu_set_t all;
    cr_assert_eq(sched_getaffinity(0, sizeof all, &all), 0);
    int cores = CPU_COUNT(&all);
    child c;
    const char *args[] = {"--nproc-per-node", "auto", "/bin/sh", "-c", "echo \"W=$WORLD_SIZE\"", NULL};
    int st = run_tsrun(&c, args, NULL);
    cr_assert(exited_with(st, 0), "status %d: %s", st, c.err_buf);
    char want[32];
    snprintf(want, sizeof want, "W=%d\n", cores);
    cr_assert_eq(count_substr(c.out_buf, want), cores, "%d cores:\n%s", cores, c.out_buf);
    child_free(&c);

    /* the affinity mask counts, not the machine: one core allowed, one rank */
    int first = 0;
    while (!CPU_ISSET(first, &all)) first++;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(first, &one);
    cr_assert_eq(sched_setaffinity(0, sizeof one, &one), 0); /* inherited by tsrun */
    const char *args2[] = {"--nproc-per-node=cpu", "/bin/sh", "-c", "echo \"W=$WORLD_SIZE\"", NULL};
    st = run_tsrun(&c, args2, NULL);
    sched_setaffinity(0, sizeof all, &all);
    cr_assert(exited_with(st, 0), "status %d: %s", st, c.err_buf);
    cr_assert_str_eq(c.out_buf, "[0] W=1\n");
    child_free(&c);

    const char *args3[] = {"--nproc-per-node", "automatic", "/bin/true", NULL};
    st = run_tsrun(&c, args3, NULL);
    cr_assert(exited_with(st, 2), "status %d", st);
    cr_assert(strstr(c.err_buf, "automatic"), "%s", c.err_buf);
    child_free(&c);
}

Test(comm_launch, tsrun_log_dir_tees_each_rank_to_a_file, .timeout = 60)
{
    char tmp[4096], dir[4200], path[4300];
    make_tmp_dir(tmp, sizeof tmp);
    snprintf(dir, sizeof dir, "%s/a/b", tmp); /* parents created too */
    child c;
    const char *args[] = {"--nproc-per-node",
                          "2",
                          "--log-dir",
                          dir,
                          "/bin/sh",
                          "-c",
                          "echo \"out $RANK\"; echo \"err $RANK\" >&2; printf \"tail $RANK\"",
                          NULL};
    int st = run_tsrun(&c, args, NULL);
    cr_assert(exited_with(st, 0), "status %d: %s", st, c.err_buf);
    for (int r = 0; r < 2; r++) {
        char o[32], e[32], t[32];
        snprintf(o, sizeof o, "[%d] out %d\n", r, r);
        snprintf(e, sizeof e, "[%d] err %d\n", r, r);
        snprintf(t, sizeof t, "[%d] tail %d\n", r, r);
        cr_assert(strstr(c.out_buf, o) && strstr(c.out_buf, t), "the terminal still gets it: %s", c.out_buf);
        cr_assert(strstr(c.err_buf, e), "%s", c.err_buf);
        snprintf(path, sizeof path, "%s/rank%d.log", dir, r);
        char *log = read_text(path);
        /* stdout and stderr are two pipes: their relative order is the relay's */
        cr_assert(strstr(log, o + 4) && strstr(log, e + 4) && strstr(log, t + 4), "%s: %s", path, log);
        cr_assert_eq(strlen(log), strlen(o + 4) + strlen(e + 4) + strlen(t + 4), "%s: %s", path, log);
        cr_assert_null(strchr(log, '['), "no prefix in the file: %s", log);
        free(log);
    }
    child_free(&c);

    /* live, like the terminal: written while the ranks still run; and a
     * rerun truncates */
    const char *env[] = {"TS_TEST_LAUNCH_ROLE=lines", NULL};
    const char *args2[] = {"--nproc-per-node", "2", "--log-dir", dir, th_self_exe(), NULL};
    c = spawn_tsrun(args2, env);
    struct want w = {"blocked ", 2};
    cr_assert(pump(&c, 20, has_n_of, &w), "%s", c.out_buf ? c.out_buf : "");
    pump_err(&c, "] blocked\n", 2); /* stderr: the other pipe */
    snprintf(path, sizeof path, "%s/rank1.log", dir);
    char *log = read_text(path);
    cr_assert(strstr(log, "line 0 of 1\nline 1 of 1\nline 2 of 1\nblocked "), "%s", log);
    cr_assert(strstr(log, "blocked\n"), "stderr too: %s", log);
    cr_assert_null(strstr(log, "out 1"), "truncated: %s", log);
    free(log);
    kill(c.pid, SIGTERM);
    st = reap(&c, 15);
    cr_assert(exited_with(st, 143), "status %d", st);
    child_free(&c);
    rm_tree(tmp);
}

Test(comm_launch, tsrun_log_dir_that_cannot_be_written_fails_before_any_rank, .timeout = 60)
{
    char tmp[4096], file[4200], sub[4300], ran[4200], script[4400];
    make_tmp_dir(tmp, sizeof tmp);
    snprintf(file, sizeof file, "%s/plain", tmp);
    write_text(file, "x", 0644);
    snprintf(ran, sizeof ran, "%s/ran", tmp);
    snprintf(script, sizeof script, "touch '%s'", ran);
    child c;

    /* under a regular file, or a regular file itself */
    snprintf(sub, sizeof sub, "%s/logs", file);
    const char *dirs[] = {sub, file};
    for (int i = 0; i < 2; i++) {
        const char *args[] = {"--nproc-per-node", "2", "--log-dir", dirs[i], "/bin/sh", "-c", script, NULL};
        int st = run_tsrun(&c, args, NULL);
        cr_assert(exited_with(st, 1), "status %d: %s", st, c.err_buf);
        cr_assert(strstr(c.err_buf, "tsrun: ts_launch: cannot create the log directory") &&
                      strstr(c.err_buf, dirs[i]) && strstr(c.err_buf, "Not a directory"),
                  "%s", c.err_buf);
        cr_assert_neq(access(ran, F_OK), 0, "a rank ran");
        child_free(&c);
    }

    /* a symbolic link planted as a log file is not followed */
    char ldir[4200], victim[4200], link[4300];
    snprintf(ldir, sizeof ldir, "%s/links", tmp);
    snprintf(victim, sizeof victim, "%s/victim", tmp);
    snprintf(link, sizeof link, "%s/rank1.log", ldir);
    cr_assert_eq(mkdir(ldir, 0755), 0);
    write_text(victim, "keep", 0644);
    cr_assert_eq(symlink(victim, link), 0);
    const char *args[] = {"--nproc-per-node", "2", "--log-dir", ldir, "/bin/sh", "-c", script, NULL};
    int st = run_tsrun(&c, args, NULL);
    cr_assert(exited_with(st, 1), "status %d: %s", st, c.err_buf);
    cr_assert(strstr(c.err_buf, "rank1.log") && strstr(c.err_buf, "symbolic link"), "%s", c.err_buf);
    char *v = read_text(victim);
    cr_assert_str_eq(v, "keep");
    free(v);
    cr_assert_neq(access(ran, F_OK), 0, "a rank ran");
    child_free(&c);

    /* a FIFO neither blocks tsrun nor is taken for a file */
    char fdir[4200], fifo[4300];
    snprintf(fdir, sizeof fdir, "%s/fifo", tmp);
    snprintf(fifo, sizeof fifo, "%s/rank0.log", fdir);
    cr_assert_eq(mkdir(fdir, 0755), 0);
    cr_assert_eq(mkfifo(fifo, 0644), 0);
    const char *args2[] = {"--log-dir", fdir, "/bin/sh", "-c", script, NULL};
    st = run_tsrun(&c, args2, NULL);
    cr_assert(exited_with(st, 1), "status %d: %s", st, c.err_buf);
    cr_assert(strstr(c.err_buf, "rank0.log"), "%s", c.err_buf);
    cr_assert_neq(access(ran, F_OK), 0, "a rank ran");
    child_free(&c);

    /* no write permission (root is not refused by modes: only checked as
     * another user) */
    if (geteuid() != 0) {
        char ro[4200];
        snprintf(ro, sizeof ro, "%s/ro", tmp);
        cr_assert_eq(mkdir(ro, 0500), 0);
        const char *args3[] = {"--log-dir", ro, "/bin/sh", "-c", script, NULL};
        st = run_tsrun(&c, args3, NULL);
        cr_assert(exited_with(st, 1), "status %d: %s", st, c.err_buf);
        cr_assert(strstr(c.err_buf, "Permission denied"), "%s", c.err_buf);
        child_free(&c);
    }

    /* through the library: the same error, nothing leaked, nothing run */
    ts_launch_options o = ts_launch_options_default();
    o.forward_signals = false;
    o.log_dir = sub;
    char *argv[] = {"/bin/sh", "-c", script, NULL};
    ts_launch_result res = {.exit_code = 12345};
    th_mem_mark();
    cr_assert_eq(ts_launch(&o, argv, &res), TS_ERR_IO);
    th_mem_assert_back();
    cr_assert(strstr(ts_last_error(), sub), "%s", ts_last_error());
    cr_assert_eq(res.exit_code, 12345);
    o.log_dir = "";
    cr_assert_eq(ts_launch(&o, argv, &res), TS_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(ts_last_error(), "log_dir"), "%s", ts_last_error());
    cr_assert_neq(access(ran, F_OK), 0, "a rank ran");
    rm_tree(tmp);
}

/* Whether /proc/<pid>/<what> (NUL-separated) holds `needle`. */
static bool proc_holds(int pid, const char *what, const char *needle)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/%s", pid, what);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    cr_assert_geq(fd, 0, "%s: %s", path, strerror(errno));
    static char buf[1 << 20];
    size_t got = 0;
    ssize_t r;
    while (got < sizeof buf && (r = read(fd, buf + got, sizeof buf - got)) > 0) got += (size_t)r;
    close(fd);
    cr_assert_gt(got, 0, "%s is empty", path);
    return memmem(buf, got, needle, strlen(needle)) != NULL;
}

/* tsrun with `args` and `env`: the ranks report their token; neither
 * tsrun's nor a rank's command line holds it, their environment does. */
static void expect_token_hidden(const char *const *args, const char *const *env, const char *token)
{
    child c = spawn_tsrun(args, env);
    struct want w = {"ready ", 2};
    cr_assert(pump(&c, 20, has_n_of, &w), "%s\n%s", c.out_buf ? c.out_buf : "", c.err_buf ? c.err_buf : "");
    cr_assert_not(proc_holds(c.pid, "cmdline", token), "tsrun's command line shows the token");
    char env_entry[512];
    snprintf(env_entry, sizeof env_entry, "TS_STORE_TOKEN=%s", token);
    for (int r = 0; r < 2; r++) {
        char head[32];
        snprintf(head, sizeof head, "[%d] ready ", r);
        const char *l = strstr(c.out_buf, head);
        cr_assert(l, "%s", c.out_buf);
        int pid = 0;
        char got[300] = "";
        cr_assert_eq(sscanf(l + strlen(head), "%d %299s", &pid, got), 2, "%s", l);
        cr_assert_str_eq(got, token, "rank %d got another token", r);
        cr_assert_not(proc_holds(pid, "cmdline", token), "rank %d's command line shows the token", r);
        cr_assert(proc_holds(pid, "environ", env_entry), "rank %d's environment lacks it", r);
    }
    kill(c.pid, SIGTERM);
    int st = reap(&c, 15);
    cr_assert(exited_with(st, 143), "status %d: %s", st, c.err_buf);
    cr_assert_null(strstr(c.err_buf, "warning"), "%s", c.err_buf);
    child_free(&c);
}

Test(comm_launch, tsrun_token_comes_from_the_environment_or_a_file_never_argv, .timeout = 90)
{
    char token[128], env_tok[160], tmp[4096], file[4200];
    snprintf(token, sizeof token, "ts-secret-%d-%ld", (int)getpid(), (long)time(NULL));
    snprintf(env_tok, sizeof env_tok, "TS_STORE_TOKEN=%s", token);
    /* no exec: a command line read during an exec can come back empty */
    const char *rank[] = {"/bin/sh", "-c", "echo \"ready $$ $TS_STORE_TOKEN\"; sleep 30"};
    const char *args[] = {"--nproc-per-node", "2", "--grace", "5", rank[0], rank[1], rank[2], NULL};
    const char *env[] = {env_tok, NULL};
    expect_token_hidden(args, env, token);

    /* a file (a trailing newline dropped) wins over the environment */
    make_tmp_dir(tmp, sizeof tmp);
    snprintf(file, sizeof file, "%s/token", tmp);
    char file_tok[160], text[200];
    snprintf(file_tok, sizeof file_tok, "%s-file", token);
    snprintf(text, sizeof text, "%s\n", file_tok);
    write_text(file, text, 0600);
    const char *args2[] = {
        "--nproc-per-node", "2", "--grace", "5", "--token-file", file, rank[0], rank[1], rank[2], NULL};
    expect_token_hidden(args2, env, file_tok);

    /* --token on the command line is refused, without echoing it */
    child c;
    const char *bad1[] = {"--token", token, "/bin/true", NULL};
    const char *bad2[] = {"--token=sekrit-value", "/bin/true", NULL};
    const char *const *bads[] = {bad1, bad2};
    for (int i = 0; i < 2; i++) {
        int st = run_tsrun(&c, bads[i], NULL);
        cr_assert(exited_with(st, 2), "status %d", st);
        cr_assert(strstr(c.err_buf, "TS_STORE_TOKEN") && strstr(c.err_buf, "--token-file"), "%s", c.err_buf);
        cr_assert_null(strstr(c.err_buf, token), "%s", c.err_buf);
        cr_assert_null(strstr(c.err_buf, "sekrit-value"), "%s", c.err_buf);
        child_free(&c);
    }

    /* bad token files: missing, empty, two lines, a directory, a FIFO
     * without a writer (refused at once, not a blocked open) */
    char missing[4300], empty[4300], two[4300], fifo[4300];
    snprintf(missing, sizeof missing, "%s/missing", tmp);
    snprintf(empty, sizeof empty, "%s/empty", tmp);
    snprintf(two, sizeof two, "%s/two", tmp);
    snprintf(fifo, sizeof fifo, "%s/fifo", tmp);
    write_text(empty, "\n", 0600);
    write_text(two, "a\nb\n", 0600);
    cr_assert_eq(mkfifo(fifo, 0600), 0, "mkfifo %s: %s", fifo, strerror(errno));
    const char *files[] = {missing, empty, two, tmp, fifo};
    const char *why[] = {"No such file", "one line", "one line", "not a regular file", "not a regular file"};
    for (int i = 0; i < 5; i++) {
        const char *a[] = {"--token-file", files[i], "/bin/true", NULL};
        int st = run_tsrun(&c, a, NULL);
        cr_assert(exited_with(st, 2), "%s: status %d", files[i], st);
        cr_assert(strstr(c.err_buf, files[i]) && strstr(c.err_buf, why[i]), "%s", c.err_buf);
        child_free(&c);
    }
    /* a file others may read works, with a warning */
    write_text(file, text, 0644);
    const char *a[] = {"--token-file", file, "/bin/sh", "-c", "echo \"$TS_STORE_TOKEN\"", NULL};
    int st = run_tsrun(&c, a, NULL);
    cr_assert(exited_with(st, 0), "status %d: %s", st, c.err_buf);
    cr_assert(strstr(c.err_buf, "warning") && strstr(c.err_buf, "readable by other users"), "%s", c.err_buf);
    cr_assert(strstr(c.out_buf, file_tok), "%s", c.out_buf);
    child_free(&c);
    /* several nodes without a token say where to put one */
    const char *a2[] = {"--nnodes", "2", "--master-port", "29500", "/bin/true", NULL};
    st = run_tsrun(&c, a2, NULL);
    cr_assert(exited_with(st, 2), "status %d", st);
    cr_assert(strstr(c.err_buf, "TS_STORE_TOKEN") && strstr(c.err_buf, "--token-file"), "%s", c.err_buf);
    child_free(&c);
    rm_tree(tmp);
}
