/*
 * TS_TRACE on a 2-rank fully_shard job started by the real tsrun: each
 * rank writes its own trace, tsrun none; the JSON is Chrome trace event
 * format as Perfetto reads it (every event has ph, name, pid, tid; "X"
 * events ts and dur; "B"/"E" pairs; metadata names for the process and
 * every thread; spans on one track nest); each iteration shows forward,
 * backward and the optimizer step; every FSDP group's four hooks carry its
 * FQN; the collectives sit on the communication thread's track with their
 * kind, bytes, group and sequence number.
 *
 * This binary is also the rank program (TS_TEST_TRACE_RANK=1, run by a
 * constructor before Criterion starts): a Sequential of two blocks and a
 * head, each block its own group, the root the head's, SGD, ITERS steps.
 * tools/trace_plot draws the job's traces (skipped without matplotlib).
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <spawn.h>
#include <sys/mman.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/helpers.h"

#ifndef TS_BUILD_DIR
#error "TS_BUILD_DIR (the build root, where tools/tsrun is) must be defined"
#endif

enum { ITERS = 3, BLOCKS = 2 };

extern char **environ;

/* ------------------------------------------------------------ rank side */

/* wait: after the iterations and a barrier, says "ready" and waits for
 * tsrun to stop the job (the trace must be flushed by the SIGTERM). */
static void rank_main(bool wait)
{
    TH_RANK_OK(10, ts_dist_init(NULL));
    ts_manual_seed(0);
    ts_module *blocks[BLOCKS], *top[BLOCKS + 1], *model;
    for (int b = 0; b < BLOCKS; b++) {
        ts_module *k[3];
        TH_RANK_OK(11, ts_linear_new(8, 8, true, &k[0]));
        TH_RANK_OK(11, ts_relu_new(&k[1]));
        TH_RANK_OK(11, ts_linear_new(8, 8, true, &k[2]));
        TH_RANK_OK(11, ts_sequential_new(3, k, &blocks[b]));
        top[b] = blocks[b];
    }
    TH_RANK_OK(12, ts_linear_new(8, 4, true, &top[BLOCKS]));
    TH_RANK_OK(12, ts_sequential_new(BLOCKS + 1, top, &model));
    TH_RANK_OK(13, ts_fully_shard_each(BLOCKS, blocks, NULL));
    TH_RANK_OK(13, ts_fully_shard(model, NULL));
    ts_named_params np;
    TH_RANK_OK(14, ts_module_named_parameters(model, &np));
    ts_tensor *ps[16];
    if (np.n > 16) _exit(14);
    for (int i = 0; i < np.n; i++) ps[i] = *np.items[i].slot;
    ts_sgd_options so = ts_sgd_options_default();
    so.lr = 0.1;
    ts_optim *opt;
    TH_RANK_OK(15, ts_sgd_new(np.n, ps, &so, &opt));
    int64_t xs[2] = {4, 8};
    for (int it = 0; it < ITERS; it++) {
        ts_tensor *x, *out, *loss;
        TH_RANK_OK(16, ts_randn(TS_F32, 2, xs, NULL, &x));
        TH_RANK_OK(16, ts_module_call1(model, x, &out));
        TH_RANK_OK(16, ts_sum(out, 0, NULL, false, &loss));
        TH_RANK_OK(17, ts_backward(loss, NULL, false));
        TH_RANK_OK(18, ts_optim_step(opt));
        ts_optim_zero_grad(opt, true);
        ts_tensor_free(x);
        ts_tensor_free(out);
        ts_tensor_free(loss);
    }
    if (wait) {
        TH_RANK_OK(20, ts_barrier(ts_dist_world(), NULL));
        printf("ready\n");
        fflush(stdout);
        for (;;) pause();
    }
    ts_optim_free(opt);
    ts_named_params_free(&np);
    ts_module_free(model);
    TH_RANK_OK(19, ts_dist_finalize());
    exit(0); /* the trace is flushed at exit */
}

__attribute__((constructor)) static void trace_rank_role(void)
{
    const char *role = getenv("TS_TEST_TRACE_RANK");
    if (role) rank_main(strcmp(role, "wait") == 0);
}

/* ------------------------------------------------------------ test side */

/* Starts `tsrun --nproc-per-node 2 <this binary>` with TS_TRACE=trace and
 * TS_TEST_TRACE_RANK=role; its stdout into *out_fd (a pipe) when out_fd is
 * not NULL, else with stderr into a memfd (*err_fd). */
static pid_t start_job(const char *trace, const char *role, int *out_fd, int *err_fd)
{
    char *exe = th_self_exe(), tsrun[4096];
    snprintf(tsrun, sizeof tsrun, "%s/tools/tsrun", TS_BUILD_DIR);
    cr_assert_eq(access(tsrun, X_OK), 0, "%s is not built", tsrun);
    size_t k;
    char **envp = th_job_environ(2, &k);
    char tv[4400];
    snprintf(tv, sizeof tv, "TS_TRACE=%s", trace);
    envp[k++] = tv;
    char rv[64];
    snprintf(rv, sizeof rv, "TS_TEST_TRACE_RANK=%s", role);
    envp[k++] = rv;
    envp[k] = NULL;
    int errfd = memfd_create("ts-trace-err", MFD_CLOEXEC);
    cr_assert_geq(errfd, 0);
    int po[2] = {-1, -1};
    if (out_fd) cr_assert_eq(pipe2(po, O_CLOEXEC), 0);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, errfd, 2);
    posix_spawn_file_actions_adddup2(&fa, out_fd ? po[1] : errfd, 1);
    char *argv[] = {tsrun, "--nproc-per-node", "2", exe, NULL};
    pid_t pid;
    cr_assert_eq(posix_spawn(&pid, tsrun, &fa, NULL, argv, envp), 0);
    posix_spawn_file_actions_destroy(&fa);
    free(envp);
    if (out_fd) {
        close(po[1]);
        *out_fd = po[0];
    }
    *err_fd = errfd;
    return pid;
}

/* Runs the job to its end and asserts that tsrun exited 0. */
static void run_job(const char *trace)
{
    int errfd;
    pid_t pid = start_job(trace, "1", NULL, &errfd);
    int status;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    char *err = th_slurp_fd(errfd);
    close(errfd);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "tsrun: status %d; output:\n%s", status, err);
    free(err);
}

/* The checks every event passes (the fields Perfetto's JSON importer
 * needs); `pid_out` the pid of the file's events. */
static void check_events(const char *file, json_t *ev, json_int_t *pid_out)
{
    json_int_t pid = -1;
    int open_b = 0;
    size_t i;
    json_t *e;
    json_array_foreach(ev, i, e)
    {
        cr_assert(json_is_object(e), "%s: event %zu is not an object", file, i);
        const char *ph = json_string_value(json_object_get(e, "ph"));
        const char *name = json_string_value(json_object_get(e, "name"));
        cr_assert(ph && strlen(ph) == 1, "%s: event %zu has no phase", file, i);
        cr_assert(name && *name, "%s: event %zu has no name", file, i);
        cr_assert(json_is_integer(json_object_get(e, "pid")), "%s: event %zu (%s) has no integer pid", file, i, name);
        cr_assert(json_is_integer(json_object_get(e, "tid")), "%s: event %zu (%s) has no integer tid", file, i, name);
        json_int_t p = json_integer_value(json_object_get(e, "pid"));
        if (pid < 0) pid = p;
        cr_assert_eq(p, pid, "%s: one process, one pid", file);
        switch (ph[0]) {
        case 'X':
            cr_assert(json_is_number(json_object_get(e, "ts")), "%s: %s has no ts", file, name);
            cr_assert(json_is_number(json_object_get(e, "dur")), "%s: %s has no dur", file, name);
            cr_assert_geq(json_number_value(json_object_get(e, "dur")), 0.0);
            cr_assert_geq(json_number_value(json_object_get(e, "ts")), 0.0);
            break;
        case 'B': open_b++; break;
        case 'E':
            open_b--;
            cr_assert_geq(open_b, 0, "%s: E without B", file);
            break;
        case 'M':
            cr_assert(json_is_object(json_object_get(e, "args")), "%s: metadata %s has no args", file, name);
            if (!strcmp(name, "process_name") || !strcmp(name, "thread_name"))
                cr_assert(json_is_string(json_object_get(json_object_get(e, "args"), "name")),
                          "%s: %s without args.name", file, name);
            break;
        default: cr_assert_fail("%s: unexpected phase %s (%s)", file, ph, name);
        }
    }
    cr_assert_eq(open_b, 0, "%s: B without E", file);
    *pid_out = pid;
}

/* The thread_name of tid, or NULL. */
static const char *thread_name(json_t *ev, json_int_t tid)
{
    size_t i;
    json_t *e;
    json_array_foreach(ev, i, e)
    {
        if (!strcmp(json_string_value(json_object_get(e, "name")), "thread_name") &&
            json_integer_value(json_object_get(e, "tid")) == tid)
            return json_string_value(json_object_get(json_object_get(e, "args"), "name"));
    }
    return NULL;
}

typedef struct xspan {
    json_int_t tid;
    double ts, end;
} xspan;

static int by_tid_ts(const void *pa, const void *pb)
{
    const xspan *a = pa, *b = pb;
    if (a->tid != b->tid) return a->tid < b->tid ? -1 : 1;
    if (a->ts != b->ts) return a->ts < b->ts ? -1 : 1;
    return a->end > b->end ? -1 : a->end < b->end;
}

/* On each tid, "X" spans nest (a span that starts inside another ends
 * inside it), as trace viewers require. */
static void check_nesting(const char *file, json_t *ev)
{
    size_t n = json_array_size(ev), k = 0;
    xspan *v = calloc(n ? n : 1, sizeof *v);
    cr_assert_not_null(v);
    size_t i;
    json_t *e;
    json_array_foreach(ev, i, e)
    {
        if (strcmp(json_string_value(json_object_get(e, "ph")), "X")) continue;
        double ts = json_number_value(json_object_get(e, "ts"));
        v[k++] = (xspan){json_integer_value(json_object_get(e, "tid")), ts,
                         ts + json_number_value(json_object_get(e, "dur"))};
    }
    qsort(v, k, sizeof *v, by_tid_ts);
    double stack[64];
    int depth = 0;
    for (size_t j = 0; j < k; j++) {
        if (j > 0 && v[j].tid != v[j - 1].tid) depth = 0;
        while (depth > 0 && stack[depth - 1] <= v[j].ts + 1e-3) depth--;
        if (depth > 0)
            cr_assert_leq(v[j].end, stack[depth - 1] + 1e-3,
                          "%s: tid %lld: the span at %.3f us crosses the end of its parent at %.3f us", file,
                          (long long)v[j].tid, v[j].ts, stack[depth - 1]);
        cr_assert_lt(depth, 64);
        stack[depth++] = v[j].end;
    }
    free(v);
}

/* Spans named `name` on the tid `tid` (-1: any). */
static int count_spans(json_t *ev, const char *name, json_int_t tid)
{
    int c = 0;
    size_t i;
    json_t *e;
    json_array_foreach(ev, i, e)
    {
        if (!strcmp(json_string_value(json_object_get(e, "ph")), "X") &&
            !strcmp(json_string_value(json_object_get(e, "name")), name) &&
            (tid < 0 || json_integer_value(json_object_get(e, "tid")) == tid))
            c++;
    }
    return c;
}

/* The number of `hook` spans whose args.fqn is fqn. */
static int hook_spans(json_t *ev, const char *hook, const char *fqn)
{
    int c = 0;
    size_t i;
    json_t *e;
    json_array_foreach(ev, i, e)
    {
        if (strcmp(json_string_value(json_object_get(e, "name")), hook)) continue;
        json_t *args = json_object_get(e, "args");
        const char *f = json_string_value(json_object_get(args, "fqn"));
        cr_assert_not_null(f, "%s without args.fqn", hook);
        cr_assert(json_is_string(json_object_get(args, "group")), "%s without args.group", hook);
        if (!strcmp(f, fqn)) c++;
    }
    return c;
}

static void check_rank(const char *file, int rank)
{
    json_error_t je;
    json_t *root = json_load_file(file, 0, &je);
    cr_assert_not_null(root, "%s: not valid JSON: %s (line %d)", file, je.text, je.line);
    json_t *ev = json_object_get(root, "traceEvents");
    cr_assert(json_is_array(ev), "%s: no traceEvents array", file);
    json_int_t pid;
    check_events(file, ev, &pid);
    check_nesting(file, ev);

    /* the process is named by its rank */
    char want[32];
    snprintf(want, sizeof want, "rank %d", rank);
    bool named = false;
    size_t i;
    json_t *e;
    json_int_t main_tid = -1;
    json_array_foreach(ev, i, e)
    {
        const char *name = json_string_value(json_object_get(e, "name"));
        const char *an = json_string_value(json_object_get(json_object_get(e, "args"), "name"));
        if (!strcmp(name, "process_name") && an && !strcmp(an, want)) named = true;
        if (!strcmp(name, "forward")) main_tid = json_integer_value(json_object_get(e, "tid"));
    }
    cr_assert(named, "%s: no process_name '%s'", file, want);

    /* one iteration: forward, backward, optimizer step, on the main thread */
    cr_assert_geq(main_tid, 0, "%s: no forward span", file);
    cr_assert_str_eq(thread_name(ev, main_tid), "main");
    cr_assert_eq(count_spans(ev, "forward", main_tid), ITERS, "%s", file);
    cr_assert_eq(count_spans(ev, "backward", main_tid), ITERS, "%s", file);
    cr_assert_eq(count_spans(ev, "optimizer.step", main_tid), ITERS, "%s", file);

    /* each group's hooks with its FQN: blocks "0", "1", the root "" */
    static const char *const hooks[] = {"fsdp.pre_forward", "fsdp.post_forward", "fsdp.pre_backward",
                                        "fsdp.post_backward"};
    static const char *const fqns[] = {"0", "1", ""};
    for (int h = 0; h < 4; h++)
        for (int f = 0; f < 3; f++)
            cr_assert_eq(hook_spans(ev, hooks[h], fqns[f]), ITERS, "%s: %s of '%s': %d, expected %d", file, hooks[h],
                         fqns[f], hook_spans(ev, hooks[h], fqns[f]), ITERS);

    /* collectives on the communication thread's track(s) */
    int ag = 0, rs = 0;
    json_array_foreach(ev, i, e)
    {
        const char *name = json_string_value(json_object_get(e, "name"));
        bool is_ag = !strcmp(name, "all_gather"), is_rs = !strcmp(name, "reduce_scatter");
        if (!is_ag && !is_rs) continue;
        json_int_t tid = json_integer_value(json_object_get(e, "tid"));
        const char *tn = thread_name(ev, tid);
        cr_assert(tn && !strncmp(tn, "comm", 4), "%s: %s on tid %lld named '%s', not the comm thread's", file, name,
                  (long long)tid, tn ? tn : "(none)");
        cr_assert_neq(tid, main_tid);
        json_t *args = json_object_get(e, "args");
        cr_assert_str_eq(json_string_value(json_object_get(args, "kind")), name);
        cr_assert_gt(json_integer_value(json_object_get(args, "bytes")), 0, "%s: %s moves no bytes", file, name);
        cr_assert(json_is_integer(json_object_get(args, "group")), "%s: %s without args.group", file, name);
        cr_assert(json_is_integer(json_object_get(args, "seq")), "%s: %s without args.seq", file, name);
        cr_assert_str_eq(json_string_value(json_object_get(args, "status")), "TS_OK");
        ag += is_ag;
        rs += is_rs;
    }
    /* every group gathers in forward and again in backward (resharded
     * after forward; the root keeps its parameters), reduces once */
    cr_assert_geq(ag, (BLOCKS + 1) * ITERS, "%s: %d all-gathers", file, ag);
    cr_assert_eq(rs, (BLOCKS + 1) * ITERS, "%s: %d reduce-scatters", file, rs);
    json_decref(root);
}

Test(fully_shard_trace, two_ranks_under_tsrun, .timeout = 120)
{
    const char *t = getenv("TMPDIR");
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/ts_fsdp_trace_XXXXXX", t && *t ? t : "/tmp");
    cr_assert_not_null(mkdtemp(dir));
    char trace[4200], r0[4300], r1[4300];
    snprintf(trace, sizeof trace, "%s/trace.json", dir);
    snprintf(r0, sizeof r0, "%s/trace.rank0.json", dir);
    snprintf(r1, sizeof r1, "%s/trace.rank1.json", dir);
    run_job(trace);
    cr_assert_eq(access(trace, F_OK), -1, "tsrun (or a rank) wrote the plain file %s", trace);
    check_rank(r0, 0);
    check_rank(r1, 1);
    unlink(r0);
    unlink(r1);
    rmdir(dir);
}

/* Runs argv (a NULL-terminated list) with stdout and stderr into a memfd;
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

Test(fully_shard_trace, trace_plot_draws_the_ranks_and_a_loss_curve, .timeout = 180)
{
    char *out = NULL;
    char *probe[] = {"/usr/bin/python3", "-c", "import matplotlib", NULL};
    if (access(probe[0], X_OK) != 0 || run_capture(probe, &out) != 0) {
        free(out);
        cr_skip_test("python3-matplotlib is not installed");
    }
    free(out);
    /* the source tree's tools/, from TS_FIXTURES_DIR = <src>/tests/fixtures */
    char script[4096];
    snprintf(script, sizeof script, "%s/../../tools/trace_plot", TS_FIXTURES_DIR);
    cr_assert_eq(access(script, R_OK), 0, "%s is missing", script);

    const char *t = getenv("TMPDIR");
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/ts_fsdp_plot_XXXXXX", t && *t ? t : "/tmp");
    cr_assert_not_null(mkdtemp(dir));
    char trace[4200], r0[4300], r1[4300], log[4300], png[4300];
    snprintf(trace, sizeof trace, "%s/trace.json", dir);
    snprintf(r0, sizeof r0, "%s/trace.rank0.json", dir);
    snprintf(r1, sizeof r1, "%s/trace.rank1.json", dir);
    snprintf(log, sizeof log, "%s/train.log", dir);
    snprintf(png, sizeof png, "%s/run.png", dir);
    run_job(trace);
    /* train_gpt's lines, as tsrun relays them */
    FILE *f = fopen(log, "w");
    cr_assert_not_null(f);
    fputs("[0] corpus: built-in grammar, 200000 characters, vocabulary 26\n", f);
    for (int s = 1; s <= 5; s++)
        fprintf(f, "[0] step %4d  loss %.4f  (mean of last 1: %.4f)  lr 3.00e-03  9000 tokens/s\n", s, 3.0 / s,
                3.0 / s);
    fclose(f);
    char *argv[] = {"/usr/bin/python3", script, r0, r1, "--loss", log, "-o", png, NULL};
    int status = run_capture(argv, &out);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "trace_plot failed (%d):\n%s", status, out);
    cr_assert(strstr(out, "rank 0: all-gathers and reduce-scatters active") != NULL, "%s", out);
    cr_assert(strstr(out, "rank 1: all-gathers and reduce-scatters active") != NULL, "%s", out);
    free(out);
    unsigned char magic[8] = {0};
    f = fopen(png, "rb");
    cr_assert_not_null(f, "no %s", png);
    cr_assert_eq(fread(magic, 1, 8, f), 8);
    fclose(f);
    cr_assert_eq(memcmp(magic, "\x89PNG\r\n\x1a\n", 8), 0, "%s is not a PNG", png);
    /* a log without loss lines is an error that says so */
    char *bad[] = {"/usr/bin/python3", script, "--loss", r0, "-o", png, NULL};
    status = run_capture(bad, &out);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) != 0);
    cr_assert(strstr(out, "has no 'step N  loss L' lines") != NULL, "%s", out);
    free(out);
    unlink(r0);
    unlink(r1);
    unlink(log);
    unlink(png);
    rmdir(dir);
}

/* tsrun stopping a job (SIGTERM to tsrun, forwarded to the ranks) still
 * leaves each rank's trace, with what it recorded. */
Test(fully_shard_trace, stopping_the_job_flushes_every_rank, .timeout = 120)
{
    const char *t = getenv("TMPDIR");
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/ts_fsdp_stop_XXXXXX", t && *t ? t : "/tmp");
    cr_assert_not_null(mkdtemp(dir));
    char trace[4200], r[2][4300];
    snprintf(trace, sizeof trace, "%s/trace.json", dir);
    for (int i = 0; i < 2; i++) snprintf(r[i], sizeof r[i], "%s/trace.rank%d.json", dir, i);
    int out, errfd;
    pid_t pid = start_job(trace, "wait", &out, &errfd);
    /* both ranks say "[R] ready" */
    char buf[4096] = "";
    size_t n = 0;
    while (!(strstr(buf, "[0] ready\n") && strstr(buf, "[1] ready\n"))) {
        cr_assert_lt(n, sizeof buf - 1);
        ssize_t k = read(out, buf + n, sizeof buf - 1 - n);
        cr_assert_gt(k, 0, "the job ended before both ranks were ready: '%.*s'", (int)n, buf);
        n += (size_t)k;
        buf[n] = '\0';
    }
    cr_assert_eq(kill(pid, SIGTERM), 0);
    int status;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    char *err = th_slurp_fd(errfd);
    close(errfd);
    close(out);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 128 + SIGTERM, "tsrun: status %d; stderr:\n%s", status, err);
    free(err);
    for (int i = 0; i < 2; i++) {
        json_error_t je;
        json_t *root = json_load_file(r[i], 0, &je);
        cr_assert_not_null(root, "%s: not valid JSON: %s", r[i], je.text);
        json_t *ev = json_object_get(root, "traceEvents");
        cr_assert_eq(count_spans(ev, "forward", -1), ITERS, "%s: the spans before SIGTERM are flushed", r[i]);
        cr_assert_geq(count_spans(ev, "all_gather", -1), 1, "%s", r[i]);
        json_decref(root);
        unlink(r[i]);
    }
    cr_assert_eq(access(trace, F_OK), -1);
    rmdir(dir);
}
