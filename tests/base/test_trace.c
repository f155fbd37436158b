/*
 * The trace recorder: spans, the JSON it writes, per-rank file names from
 * TS_TRACE, the warning for a path that cannot be written, and the flush
 * on SIGTERM. This binary is also its own traced program
 * (TS_TEST_TRACE_ROLE, run by a constructor after the library's, before
 * Criterion starts): the tests start it with TS_TRACE and launcher
 * variables in its environment.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/helpers.h"

extern char **environ;

/* ------------------------------------------------------------ rank side */

static void *role_worker(void *arg)
{
    (void)arg;
    ts_trace_thread_name("worker");
    uint64_t t0 = ts_now_ns();
    ts_trace_span("role.work", "test", t0, t0 + 1000);
    return NULL;
}

/* spans: records spans on two threads and exits (flushed at exit).
 * check: prints whether tracing is on. wait: records a span, says "ready"
 * and blocks on stdin until a signal ends it. */
__attribute__((constructor)) static void trace_test_role(void)
{
    const char *role = getenv("TS_TEST_TRACE_ROLE");
    if (!role) return;
    if (strcmp(role, "check") == 0) {
        printf("enabled=%d\n", ts_trace_enabled());
        fflush(stdout);
        _exit(0);
    }
    uint64_t t0 = ts_now_ns();
    ts_trace_span("role.step", "test", t0, t0 + 2000);
    if (strcmp(role, "spans") == 0) {
        pthread_t th;
        pthread_create(&th, NULL, role_worker, NULL);
        pthread_join(th, NULL);
        exit(0); /* atexit flushes */
    }
    if (strcmp(role, "wait") == 0) {
        printf("ready\n");
        fflush(stdout);
        char c;
        while (read(0, &c, 1) != 0) {}
        _exit(3); /* stdin closed: the signal never came */
    }
    _exit(6);
}

/* ------------------------------------------------------------ test side */

typedef struct child {
    pid_t pid;
    int out, err, in; /* our ends of its stdout, stderr, stdin */
} child;

/* Starts this binary with TS_TEST_TRACE_ROLE=role and the variables
 * env[0..n) ("NAME=value"), without any inherited launcher variable or
 * TS_TRACE. */
static child spawn_role(const char *role, int n, const char *const *env)
{
    static const char *const drop[] = {
        "TS_TRACE=",           "RANK=",        "WORLD_SIZE=", "LOCAL_RANK=", "OMPI_COMM_WORLD_RANK=", "SLURM_PROCID=",
        "TS_TEST_TRACE_ROLE=", "TS_LOG_LEVEL="};
    size_t k;
    char **envp = th_environ_without(drop, sizeof drop / sizeof drop[0], (size_t)n + 2, &k);
    char rolev[64];
    snprintf(rolev, sizeof rolev, "TS_TEST_TRACE_ROLE=%s", role);
    envp[k++] = rolev;
    envp[k++] = "TS_LOG_LEVEL=warn";
    for (int i = 0; i < n; i++) envp[k++] = (char *)env[i];
    envp[k] = NULL;
    int po[2], pe[2], pi[2];
    cr_assert_eq(pipe2(po, O_CLOEXEC), 0);
    cr_assert_eq(pipe2(pe, O_CLOEXEC), 0);
    cr_assert_eq(pipe2(pi, O_CLOEXEC), 0);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, pi[0], 0);
    posix_spawn_file_actions_adddup2(&fa, po[1], 1);
    posix_spawn_file_actions_adddup2(&fa, pe[1], 2);
    char *exe = th_self_exe();
    char *argv[] = {exe, NULL};
    child c = {.out = po[0], .err = pe[0], .in = pi[1]};
    cr_assert_eq(posix_spawn(&c.pid, exe, &fa, NULL, argv, envp), 0);
    posix_spawn_file_actions_destroy(&fa);
    close(po[1]);
    close(pe[1]);
    close(pi[0]);
    free(envp);
    return c;
}

/* Everything up to EOF from a pipe, NUL-terminated, malloc'd. */
static char *read_all(int fd)
{
    size_t n = 0, cap = 4096;
    char *buf = malloc(cap);
    cr_assert_not_null(buf);
    for (;;) {
        if (n + 1 == cap) {
            buf = realloc(buf, cap *= 2);
            cr_assert_not_null(buf);
        }
        ssize_t r = read(fd, buf + n, cap - n - 1);
        if (r < 0 && errno == EINTR) continue;
        cr_assert_geq(r, 0, "read: %s", strerror(errno));
        if (r == 0) break;
        n += (size_t)r;
    }
    buf[n] = '\0';
    return buf;
}

/* Waits for the child; returns its wait status and, malloc'd, what it
 * wrote on stdout and stderr (small: read one after the other). */
static int finish_child(child *c, char **out, char **err)
{
    *out = read_all(c->out);
    *err = read_all(c->err);
    close(c->out);
    close(c->err);
    int status;
    cr_assert_eq(waitpid(c->pid, &status, 0), c->pid);
    close(c->in); /* only now: "wait" ends when its stdin closes */
    return status;
}

/* A fresh directory under TMPDIR (or /tmp), malloc'd. */
static char *temp_dir(void)
{
    const char *t = getenv("TMPDIR");
    char *d = NULL;
    cr_assert_gt(asprintf(&d, "%s/ts_trace_XXXXXX", t && *t ? t : "/tmp"), 0);
    cr_assert_not_null(mkdtemp(d), "mkdtemp: %s", strerror(errno));
    return d;
}

static json_t *load_trace(const char *path)
{
    json_error_t e;
    json_t *root = json_load_file(path, 0, &e);
    cr_assert_not_null(root, "%s is not valid JSON: %s (line %d)", path, e.text, e.line);
    cr_assert(json_is_array(json_object_get(root, "traceEvents")), "%s has no traceEvents array", path);
    return root;
}

/* The number of events named `name` (and of phase ph, when not NULL). */
static int count_events(json_t *root, const char *name, const char *ph)
{
    int n = 0;
    size_t i;
    json_t *e;
    json_array_foreach(json_object_get(root, "traceEvents"), i, e)
    {
        const char *nm = json_string_value(json_object_get(e, "name"));
        const char *p = json_string_value(json_object_get(e, "ph"));
        if (nm && strcmp(nm, name) == 0 && (!ph || (p && strcmp(p, ph) == 0))) n++;
    }
    return n;
}

/* The "args"."name" of the metadata event `what` (process_name,
 * thread_name) with the given tid (-1: any), or NULL. */
static const char *meta_name(json_t *root, const char *what, int tid)
{
    size_t i;
    json_t *e;
    json_array_foreach(json_object_get(root, "traceEvents"), i, e)
    {
        const char *nm = json_string_value(json_object_get(e, "name"));
        if (nm && strcmp(nm, what) == 0 && (tid < 0 || json_integer_value(json_object_get(e, "tid")) == tid))
            return json_string_value(json_object_get(json_object_get(e, "args"), "name"));
    }
    return NULL;
}

static void *worker(void *arg)
{
    (void)arg;
    ts_trace_thread_name("worker");
    uint64_t t0 = ts_now_ns();
    ts_trace_span("work", "test", t0, t0 + 2000);
    return NULL;
}

Test(base_trace, off_by_default_and_records_spans_when_started)
{
    cr_assert(!ts_trace_enabled(), "tracing must be off unless TS_TRACE is set");
    ts_trace_span("ignored", "test", 0, 10);
    char path[] = "/tmp/ts_trace_XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    close(fd);
    TH_OK(ts_trace_start(path));
    cr_assert(ts_trace_enabled());
    uint64_t t0 = ts_now_ns();
    ts_trace_span("step", "test", t0, t0 + 5000);
    TS_TRACE_BEGIN(tb);
    TS_TRACE_END(tb, "scoped", "test");
    pthread_t th;
    pthread_create(&th, NULL, worker, NULL);
    pthread_join(th, NULL);
    cr_assert_eq(ts_trace_total_ns("step"), 5000);
    cr_assert_eq(ts_trace_total_ns("ignored"), 0);
    TH_OK(ts_trace_flush());

    json_error_t err;
    json_t *root = json_load_file(path, 0, &err);
    cr_assert_not_null(root, "trace is not valid JSON: %s", err.text);
    json_t *ev = json_object_get(root, "traceEvents");
    cr_assert(json_is_array(ev));
    int steps = 0, works = 0, names = 0;
    size_t i;
    json_t *e;
    json_array_foreach(ev, i, e)
    {
        const char *name = json_string_value(json_object_get(e, "name"));
        const char *ph = json_string_value(json_object_get(e, "ph"));
        if (strcmp(name, "step") == 0) {
            steps++;
            cr_assert_str_eq(ph, "X");
            cr_assert_float_eq(json_number_value(json_object_get(e, "dur")), 5.0, 1e-9);
        }
        if (strcmp(name, "work") == 0) works++;
        if (strcmp(name, "thread_name") == 0 &&
            strcmp(json_string_value(json_object_get(json_object_get(e, "args"), "name")), "worker") == 0)
            names++;
    }
    cr_assert_eq(steps, 1);
    cr_assert_eq(works, 1, "spans of other threads are written too");
    cr_assert_eq(names, 1);
    json_decref(root);
    TH_OK(ts_trace_stop(false));
    cr_assert(!ts_trace_enabled());
    unlink(path);
}

Test(base_trace, unwritable_path_is_an_io_error_at_start)
{
    cr_assert_eq(ts_trace_start("/nonexistent-dir/trace.json"), TS_ERR_IO);
    cr_assert(strstr(ts_last_error(), "/nonexistent-dir/trace.json") != NULL, "%s", ts_last_error());
    cr_assert(strstr(ts_last_error(), "No such file or directory") != NULL, "%s", ts_last_error());
    cr_assert(!ts_trace_enabled(), "nothing is recorded for a path that cannot be written");
    cr_assert_eq(ts_trace_start("/tmp"), TS_ERR_IO, "a directory is not a trace file");
    cr_assert_eq(ts_trace_flush(), TS_ERR_STATE);
    cr_assert_eq(ts_trace_start(""), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_trace_start(NULL), TS_ERR_INVALID_ARGUMENT);
}

Test(base_trace, rank_file_names)
{
    static const struct {
        const char *file;
        int rank;
        const char *want;
    } cases[] = {
        {"trace.json", 0, "trace.rank0.json"}, {"out/trace.json", 12, "out/trace.rank12.json"},
        {"trace", 3, "trace.rank3"},           {"run.d/trace", 1, "run.d/trace.rank1"},
        {".hidden", 2, ".hidden.rank2"},       {"a.b.json", 1, "a.b.rank1.json"},
        {"t/%r.json", 5, "t/5.json"},          {"%r-%r.json", 1, "1-1.json"},
        {"trace.json", -1, "trace.json"},      {"t/%r.json", -1, "t/0.json"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char buf[64];
        TH_OK(ts_trace_rank_path(cases[i].file, cases[i].rank, buf, sizeof buf));
        cr_assert_str_eq(buf, cases[i].want, "%s for rank %d", cases[i].file, cases[i].rank);
    }
    char small[12];
    cr_assert_eq(ts_trace_rank_path("trace.json", 0, small, sizeof small), TS_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(ts_last_error(), "trace.json") != NULL, "%s", ts_last_error());
    cr_assert_eq(ts_trace_rank_path("", 0, small, sizeof small), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_trace_rank_path(NULL, 0, small, sizeof small), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_trace_rank_path("t", 0, NULL, 8), TS_ERR_INVALID_ARGUMENT);
}

/* A rank writes FILE with .rank<R>; a process that is not a rank writes
 * FILE itself. */
Test(base_trace, each_rank_writes_its_own_file, .timeout = 60)
{
    char *dir = temp_dir();
    char *tv = NULL, *rank_file = NULL, *plain = NULL;
    cr_assert_gt(asprintf(&tv, "TS_TRACE=%s/trace.json", dir), 0);
    cr_assert_gt(asprintf(&rank_file, "%s/trace.rank1.json", dir), 0);
    cr_assert_gt(asprintf(&plain, "%s/trace.json", dir), 0);
    const char *env[] = {tv, "RANK=1", "WORLD_SIZE=2"};
    child c = spawn_role("spans", 3, env);
    char *out, *err;
    int status = finish_child(&c, &out, &err);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "status %d, stderr: %s", status, err);
    cr_assert_eq(access(plain, F_OK), -1, "a rank must not write the plain file %s", plain);
    json_t *root = load_trace(rank_file);
    cr_assert_eq(count_events(root, "role.step", "X"), 1);
    cr_assert_eq(count_events(root, "role.work", "X"), 1, "spans of every thread are written");
    cr_assert_str_eq(meta_name(root, "process_name", -1), "rank 1");
    cr_assert_eq(json_integer_value(json_object_get(json_object_get(root, "otherData"), "rank")), 1);
    json_decref(root);
    free(out);
    free(err);
    unlink(rank_file);

    const char *env2[] = {tv};
    c = spawn_role("spans", 1, env2);
    status = finish_child(&c, &out, &err);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "status %d, stderr: %s", status, err);
    root = load_trace(plain);
    cr_assert_eq(count_events(root, "role.step", "X"), 1);
    cr_assert_str_neq(meta_name(root, "process_name", -1), "rank 0");
    json_decref(root);
    unlink(plain);
    free(out);
    free(err);
    rmdir(dir);
    free(dir);
    free(tv);
    free(rank_file);
    free(plain);
}

Test(base_trace, unwritable_trace_variable_warns_at_start, .timeout = 60)
{
    const char *env[] = {"TS_TRACE=/nonexistent-dir/trace.json", "RANK=0", "WORLD_SIZE=1"};
    child c = spawn_role("check", 3, env);
    char *out, *err;
    int status = finish_child(&c, &out, &err);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "status %d, stderr: %s", status, err);
    cr_assert(strstr(out, "enabled=0") != NULL, "tracing must stay off: %s", out);
    cr_assert(strstr(err, "[ts WARN] TS_TRACE=/nonexistent-dir/trace.json") != NULL, "no warning: '%s'", err);
    cr_assert(strstr(err, "/nonexistent-dir/trace.rank0.json") != NULL, "the warning names the file: '%s'", err);
    cr_assert(strstr(err, "No such file or directory") != NULL, "the warning says why: '%s'", err);
    free(out);
    free(err);
}

/* tsrun stops a job with SIGTERM: the trace is flushed, and the process
 * still dies of the signal. */
Test(base_trace, sigterm_flushes_the_trace, .timeout = 60)
{
    char *dir = temp_dir();
    char *tv = NULL, *file = NULL;
    cr_assert_gt(asprintf(&tv, "TS_TRACE=%s/t_%%r.json", dir), 0);
    cr_assert_gt(asprintf(&file, "%s/t_3.json", dir), 0);
    const char *env[] = {tv, "RANK=3", "WORLD_SIZE=4"};
    child c = spawn_role("wait", 3, env);
    char line[16] = "";
    size_t got = 0;
    while (got < 6) { /* "ready\n" */
        ssize_t r = read(c.out, line + got, 6 - got);
        cr_assert_gt(r, 0, "the child ended before it was ready");
        got += (size_t)r;
    }
    cr_assert_str_eq(line, "ready\n");
    /* the file exists from the start, with an empty trace */
    json_t *root = load_trace(file);
    cr_assert_eq(count_events(root, "role.step", NULL), 0);
    json_decref(root);
    cr_assert_eq(kill(c.pid, SIGTERM), 0);
    char *out, *err;
    int status = finish_child(&c, &out, &err);
    cr_assert(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM, "status %d, stderr: %s", status, err);
    root = load_trace(file);
    cr_assert_eq(count_events(root, "role.step", "X"), 1, "the span recorded before SIGTERM is in the file");
    json_decref(root);
    unlink(file);
    rmdir(dir);
    free(out);
    free(err);
    free(dir);
    free(tv);
    free(file);
}

Test(base_trace, stop_without_flush_leaves_no_file_it_created)
{
    char *dir = temp_dir();
    char *path = NULL;
    cr_assert_gt(asprintf(&path, "%s/t.json", dir), 0);
    TH_OK(ts_trace_start(path));
    struct stat sb;
    cr_assert_eq(stat(path, &sb), 0, "the file is created at start");
    TH_OK(ts_trace_stop(false));
    cr_assert_eq(access(path, F_OK), -1, "a file that nothing was written to is removed");
    /* an existing file is kept */
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs("old", f);
    fclose(f);
    TH_OK(ts_trace_start(path));
    TH_OK(ts_trace_stop(false));
    cr_assert_eq(stat(path, &sb), 0);
    cr_assert_eq(sb.st_size, 3);
    unlink(path);
    rmdir(dir);
    free(path);
    free(dir);
}

/* Spans that overlap without nesting go to another track of the thread;
 * nested spans stay on theirs; args are written. */
Test(base_trace, overlapping_spans_get_their_own_track_and_args)
{
    char *dir = temp_dir();
    char *path = NULL;
    cr_assert_gt(asprintf(&path, "%s/t.json", dir), 0);
    TH_OK(ts_trace_start(path));
    ts_trace_thread_name("comm");
    uint64_t t = ts_now_ns();
    ts_trace_arg a[3] = {{"kind", "all_gather", 0}, {"bytes", NULL, 4096}, {NULL, "skipped", 0}};
    ts_trace_span_args("outer", "test", t, t + 10000, 3, a);
    ts_trace_span("inner", "test", t + 1000, t + 3000);
    ts_trace_span("crossing", "test", t + 5000, t + 15000);
    ts_trace_span("after", "test", t + 16000, t + 17000);
    TH_OK(ts_trace_stop(true));
    json_t *root = load_trace(path);
    int tid[4] = {-1, -1, -1, -1};
    static const char *const names[4] = {"outer", "inner", "crossing", "after"};
    size_t i;
    json_t *e;
    json_array_foreach(json_object_get(root, "traceEvents"), i, e)
    {
        const char *nm = json_string_value(json_object_get(e, "name"));
        for (int k = 0; k < 4; k++)
            if (strcmp(nm, names[k]) == 0) {
                tid[k] = (int)json_integer_value(json_object_get(e, "tid"));
                cr_assert(json_is_number(json_object_get(e, "ts")) && json_is_number(json_object_get(e, "dur")));
                cr_assert(json_is_integer(json_object_get(e, "pid")));
                if (k == 0) {
                    json_t *args = json_object_get(e, "args");
                    cr_assert_str_eq(json_string_value(json_object_get(args, "kind")), "all_gather");
                    cr_assert_eq(json_integer_value(json_object_get(args, "bytes")), 4096);
                    cr_assert_eq(json_object_size(args), 2, "a NULL key is skipped");
                }
            }
    }
    cr_assert_eq(tid[0], tid[1], "a nested span stays on its thread's track");
    cr_assert_eq(tid[0], tid[3]);
    cr_assert_neq(tid[0], tid[2], "a crossing span goes to another track");
    cr_assert_str_eq(meta_name(root, "thread_name", tid[0]), "comm");
    cr_assert_str_eq(meta_name(root, "thread_name", tid[2]), "comm (2)");
    json_decref(root);
    unlink(path);
    rmdir(dir);
    free(path);
    free(dir);
}

/* A path that is not a regular file is written straight into, never
 * replaced by a rename (as root, /dev/null would become a file). */
Test(base_trace, dev_null_stays_a_device)
{
    TH_OK(ts_trace_start("/dev/null"));
    uint64_t t = ts_now_ns();
    ts_trace_span("x", "test", t, t + 10);
    TH_OK(ts_trace_flush());
    TH_OK(ts_trace_stop(false));
    struct stat sb;
    cr_assert_eq(stat("/dev/null", &sb), 0);
    cr_assert(S_ISCHR(sb.st_mode), "/dev/null is no longer a character device");
}

/* The flush wrote "<path>.tmp.<pid>" with json_dump_file, which truncates
 * and follows a symbolic link: a link planted under that name (a shared
 * folder without the sticky bit, or fs.protected_symlinks=0) made a root
 * process overwrite a root-only file outside the folder. The temporary
 * now has a random name, created exclusively without following links:
 * the link's target is untouched, the trace replaces `path`, no temporary
 * is left, and the file is 0644 at most under the umask. */
Test(base_trace, planted_temporary_link_is_not_followed)
{
    char shared[] = "/tmp/ts_trace_shared.XXXXXX", outside[] = "/tmp/ts_trace_outside.XXXXXX";
    cr_assert(mkdtemp(shared) && mkdtemp(outside));
    cr_assert_eq(chmod(shared, 0777), 0); /* world-writable, not sticky */
    char path[200], target[200], planted[240];
    snprintf(path, sizeof path, "%s/trace.json", shared);
    snprintf(target, sizeof target, "%s/root-only", outside);
    FILE *f = fopen(target, "w");
    cr_assert(f);
    fputs("root only\n", f);
    fclose(f);
    cr_assert_eq(chmod(target, 0600), 0);
    snprintf(planted, sizeof planted, "%s.tmp.%d", path, (int)getpid());
    cr_assert_eq(symlink(target, planted), 0);
    mode_t old = umask(0);
    TH_OK(ts_trace_start(path));
    uint64_t t = ts_now_ns();
    ts_trace_span("x", "test", t, t + 10);
    ts_status st = ts_trace_flush();
    umask(old);
    TH_OK(st);
    TH_OK(ts_trace_stop(false));
    char buf[64] = "";
    f = fopen(target, "r");
    cr_assert(f);
    cr_assert(fgets(buf, sizeof buf, f));
    fclose(f);
    cr_assert_str_eq(buf, "root only\n", "the planted link's target was overwritten: '%.40s'", buf);
    struct stat sb;
    cr_assert_eq(lstat(path, &sb), 0);
    cr_assert(S_ISREG(sb.st_mode));
    cr_assert_eq(sb.st_mode & 07777, 0644, "trace file mode %o under umask 0", (unsigned)(sb.st_mode & 07777));
    json_t *root = json_load_file(path, 0, NULL);
    cr_assert(root && json_is_array(json_object_get(root, "traceEvents")), "the trace file is not a trace");
    json_decref(root);
    cr_assert_eq(lstat(planted, &sb), 0);
    cr_assert(S_ISLNK(sb.st_mode), "the planted link was replaced");
    int others = 0; /* the trace's own temporaries: none left */
    DIR *d = opendir(shared);
    cr_assert(d);
    for (struct dirent *de; (de = readdir(d));)
        others += strcmp(de->d_name, ".") && strcmp(de->d_name, "..") && strcmp(de->d_name, "trace.json") &&
            strcmp(de->d_name, strrchr(planted, '/') + 1);
    closedir(d);
    cr_assert_eq(others, 0, "%d files left in the folder", others);
    unlink(planted);
    unlink(path);
    unlink(target);
    rmdir(shared);
    rmdir(outside);
}

/* ts_trace_start opened an existing trace path for writing to check it,
 * following a symbolic link planted there: a root rank opened the link's
 * target (a device acts on open alone). It now leaves a link unopened
 * (the flush replaces the link): inotify sees no open of the target. */
Test(base_trace, start_does_not_open_a_planted_link_target, .timeout = 20)
{
    char *dir = th_tmp_dir("ts_trace_link");
    char path[200], target[200];
    snprintf(path, sizeof path, "%s/trace.json", dir);
    snprintf(target, sizeof target, "%s/target", dir);
    FILE *f = fopen(target, "w");
    cr_assert(f);
    fclose(f);
    cr_assert_eq(symlink(target, path), 0);
    int in = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    cr_assert_geq(in, 0, "inotify_init1: %s", strerror(errno));
    cr_assert_geq(inotify_add_watch(in, target, IN_OPEN), 0, "inotify_add_watch: %s", strerror(errno));
    TH_OK(ts_trace_start(path));
    char ev[4096];
    ssize_t n = read(in, ev, sizeof ev);
    int e = errno;
    TH_OK(ts_trace_stop(false));
    close(in);
    cr_assert(n < 0 && e == EAGAIN, "ts_trace_start opened the planted link's target (%zd bytes of events)", n);
    th_rm_rf(dir);
    free(dir);
}

/* A FIFO at the trace path whose reader went away held the flush (at
 * exit too) forever in open(O_WRONLY): it now fails at once naming the
 * file. */
Test(base_trace, flush_into_a_fifo_nobody_reads_fails_at_once, .timeout = 20)
{
    char *dir = th_tmp_dir("ts_trace_fifo");
    char path[200];
    snprintf(path, sizeof path, "%s/trace.json", dir);
    cr_assert_eq(mkfifo(path, 0600), 0, "mkfifo: %s", strerror(errno));
    int rd = open(path, O_RDONLY | O_NONBLOCK); /* a reader while the trace starts, gone before the flush */
    cr_assert_geq(rd, 0, "open the FIFO: %s", strerror(errno));
    TH_OK(ts_trace_start(path));
    close(rd);
    uint64_t t0 = ts_now_ns();
    ts_status st = ts_trace_flush();
    double took = (double)(ts_now_ns() - t0) * 1e-9;
    cr_assert_eq(st, TS_ERR_IO, "flush into an unread FIFO: %s", ts_status_name(st));
    cr_assert(strstr(ts_last_error(), path), "the error does not name the file: %s", ts_last_error());
    cr_assert_lt(took, 5.0);
    (void)ts_trace_stop(false);
    th_rm_rf(dir);
    free(dir);
}

/* The trace's spans, their arguments and its file name go through the
 * allocator hook (docs/design.md, "Ownership"): counted while tracing,
 * given back by stop and by the next start's name. */
Test(base_trace, spans_are_counted_by_the_allocator_hook)
{
    char *dir = temp_dir();
    char *path = NULL;
    cr_assert_gt(asprintf(&path, "%s/t.json", dir), 0);
    ts_trace_thread_name("main"); /* the thread's own buffer (libc) exists before the mark */
    size_t before = ts_mem_live_bytes(TS_MEM_OTHER);
    TH_OK(ts_trace_start(path));
    size_t started = ts_mem_live_bytes(TS_MEM_OTHER);
    cr_assert_gt(started, before, "the trace file's name is counted");
    ts_trace_arg args[] = {{.key = "bytes", .num = 4096}, {.key = "peer", .str = "rank 1"}};
    for (int i = 0; i < 600; i++) ts_trace_span_args("op", "test", 10 + (uint64_t)i, 20 + (uint64_t)i, 2, args);
    cr_assert_gt(ts_mem_live_bytes(TS_MEM_OTHER), started, "spans and their args are counted");
    TH_OK(ts_trace_stop(true));
    cr_assert_eq(ts_mem_live_bytes(TS_MEM_OTHER), started, "stop gives the spans and the flush's scratch back");
    unlink(path);
    rmdir(dir);
    free(path);
    free(dir);
}
