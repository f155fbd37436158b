/* Chrome trace recorder (base/base.h: Trace).
 *
 * Spans are appended to a per-thread list of fixed-size chunks; all
 * threads' buffers hang off one global list so that flush can walk them.
 * Flush writes the Chrome trace event format (the JSON object form): one
 * "X" event per span, "M" metadata events naming the process and its
 * threads. A thread whose spans overlap without nesting (the
 * communication thread, whose collectives run concurrently) is split at
 * flush into lanes, each its own tid, so that every track is properly
 * nested, as trace viewers require of "X" events on one tid.
 *
 * SIGTERM and SIGINT (tsrun stopping a job, Ctrl-C) flush too: when
 * tracing starts and the signal's disposition is the default, a handler is
 * installed that only writes the signal number into a pipe; a watcher
 * thread, blocked on the pipe, flushes with the ordinary code (locks and
 * malloc are fine there), then restores the default disposition and
 * raises the signal again, so the process still dies of it. A second
 * signal, or one in a child forked after the watcher started, takes the
 * default action at once. */
#define _GNU_SOURCE
#include "base/base.h"
#include "base/internal.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define SPANS_PER_CHUNK 4096
#define MAX_LANES 16
#define LANE_TID_BASE 1000000 /* tids of the extra lanes: base + 64 * tid + lane */

typedef struct arg_val {
    const char *key; /* static */
    const char *str; /* into the same block, or NULL: num */
    int64_t num;
} arg_val;

typedef struct span_args {
    int n;
    arg_val a[];
} span_args;

typedef struct span {
    const char *name;
    const char *cat;
    uint64_t start_ns, end_ns;
    span_args *args; /* owned; NULL when none */
} span;

typedef struct chunk {
    struct chunk *next;
    int n;
    span spans[SPANS_PER_CHUNK];
} chunk;

typedef struct thread_buf {
    struct thread_buf *next;
    pthread_mutex_t lock; /* owner appends, flush reads */
    chunk *head, *tail;
    int tid;
    bool is_main;
    char name[32];
} thread_buf;

static atomic_int enabled;
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static thread_buf *g_bufs;
static char *g_path;
static bool g_created; /* ts_trace_start created g_path */
static bool g_written; /* a flush wrote g_path since */
static int g_next_tid = 1;
static uint64_t g_origin_ns;
static int g_rank = -1; /* from the launcher's variables, read at load */
static _Thread_local thread_buf *tl_buf;

uint64_t ts_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

bool ts_trace_enabled(void) { return atomic_load_explicit(&enabled, memory_order_relaxed) != 0; }

static thread_buf *my_buf(void)
{
    if (tl_buf) return tl_buf;
    /* libc, not the hook: a thread's buffer lives as long as the process
     * (g_bufs keeps it for a flush after the thread ended), so counted it
     * would stay live for good and forbid ts_set_allocator */
    thread_buf *b = calloc(1, sizeof *b);
    if (!b) return NULL;
    pthread_mutex_init(&b->lock, NULL);
    b->is_main = gettid() == getpid();
    pthread_mutex_lock(&g_lock);
    b->tid = g_next_tid++;
    if (b->is_main) snprintf(b->name, sizeof b->name, "main");
    else snprintf(b->name, sizeof b->name, "thread %d", b->tid);
    b->next = g_bufs;
    g_bufs = b;
    pthread_mutex_unlock(&g_lock);
    tl_buf = b;
    return b;
}

void ts_trace_thread_name(const char *name)
{
    thread_buf *b = my_buf();
    if (!b || !name) return;
    pthread_mutex_lock(&b->lock);
    snprintf(b->name, sizeof b->name, "%s", name);
    pthread_mutex_unlock(&b->lock);
}

/* One block holding the arguments and copies of their strings. */
static span_args *args_new(int n, const ts_trace_arg *args)
{
    if (n > TS_TRACE_MAX_ARGS) n = TS_TRACE_MAX_ARGS;
    size_t bytes = sizeof(span_args) + (size_t)n * sizeof(arg_val);
    for (int i = 0; i < n; i++)
        if (args[i].str) bytes += strlen(args[i].str) + 1;
    span_args *a = ts__malloc(TS_MEM_OTHER, bytes);
    if (!a) return NULL;
    char *strs = (char *)&a->a[n];
    a->n = 0;
    for (int i = 0; i < n; i++) {
        if (!args[i].key) continue;
        arg_val *v = &a->a[a->n++];
        v->key = args[i].key;
        v->num = args[i].num;
        v->str = NULL;
        if (args[i].str) {
            size_t l = strlen(args[i].str) + 1;
            memcpy(strs, args[i].str, l);
            v->str = strs;
            strs += l;
        }
    }
    return a;
}

void ts_trace_span_args(const char *name, const char *cat, uint64_t start_ns, uint64_t end_ns, int n_args,
                        const ts_trace_arg *args)
{
    if (!ts_trace_enabled() || !name) return;
    thread_buf *b = my_buf();
    if (!b) return;
    if (end_ns < start_ns) end_ns = start_ns;
    span_args *a = n_args > 0 && args ? args_new(n_args, args) : NULL;
    pthread_mutex_lock(&b->lock);
    if (!b->tail || b->tail->n == SPANS_PER_CHUNK) {
        chunk *c = ts__malloc(TS_MEM_OTHER, sizeof *c);
        if (!c) {
            pthread_mutex_unlock(&b->lock);
            ts__free(TS_MEM_OTHER, a);
            return;
        }
        c->next = NULL;
        c->n = 0;
        if (b->tail) b->tail->next = c;
        else b->head = c;
        b->tail = c;
    }
    b->tail->spans[b->tail->n++] = (span){name, cat ? cat : "ts", start_ns, end_ns, a};
    pthread_mutex_unlock(&b->lock);
}

void ts_trace_span(const char *name, const char *cat, uint64_t start_ns, uint64_t end_ns)
{
    ts_trace_span_args(name, cat, start_ns, end_ns, 0, NULL);
}

static void clear_spans_locked(void)
{
    for (thread_buf *b = g_bufs; b; b = b->next) {
        pthread_mutex_lock(&b->lock);
        for (chunk *c = b->head, *n; c; c = n) {
            n = c->next;
            for (int i = 0; i < c->n; i++) ts__free(TS_MEM_OTHER, c->spans[i].args);
            ts__free(TS_MEM_OTHER, c);
        }
        b->head = b->tail = NULL;
        pthread_mutex_unlock(&b->lock);
    }
}

/* ------------------------------------------------------------ file names */

/* Appends l bytes to buf (n used of size, one byte kept for the NUL). */
static bool put(char *buf, size_t size, size_t *n, const char *p, size_t l)
{
    if (*n + l >= size) return false;
    memcpy(buf + *n, p, l);
    *n += l;
    return true;
}

ts_status ts_trace_rank_path(const char *file, int rank, char *buf, size_t size)
{
    if (!file || !*file) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_trace_rank_path: the trace file name is empty");
    if (!buf || size == 0) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_trace_rank_path: no output buffer");
    char r[16];
    snprintf(r, sizeof r, "%d", rank < 0 ? 0 : rank);
    size_t n = 0, fl = strlen(file);
    bool fits = true;
    if (strstr(file, "%r")) { /* every %r becomes the rank */
        for (const char *p = file; *p && fits;) {
            bool ph = p[0] == '%' && p[1] == 'r';
            fits = ph ? put(buf, size, &n, r, strlen(r)) : put(buf, size, &n, p, 1);
            p += ph ? 2 : 1;
        }
    } else if (rank < 0) {
        fits = put(buf, size, &n, file, fl);
    } else { /* ".rank<R>" before the extension of the last component */
        const char *base = strrchr(file, '/');
        base = base ? base + 1 : file;
        const char *dot = strrchr(base, '.');
        size_t at = dot && dot > base ? (size_t)(dot - file) : fl;
        char ins[32];
        snprintf(ins, sizeof ins, ".rank%d", rank);
        fits = put(buf, size, &n, file, at) && put(buf, size, &n, ins, strlen(ins)) &&
            put(buf, size, &n, file + at, fl - at);
    }
    if (!fits)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "ts_trace_rank_path: the trace file name for rank %d of '%s' does not fit in %zu bytes", rank,
                        file, size);
    buf[n] = '\0';
    return TS_OK;
}

/* The rank from the launcher's variables (as ts_launch_env reads them:
 * tsrun and torchrun, mpirun, srun); -1 when the process is not a rank. */
static int env_rank(void)
{
    static const char *const vars[] = {"RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"};
    for (int i = 0; i < 3; i++) {
        const char *v = getenv(vars[i]);
        if (!v || !*v) continue;
        char *end;
        errno = 0;
        long x = strtol(v, &end, 10);
        return *end || errno || x < 0 || x > (1 << 24) ? -1 : (int)x;
    }
    return -1;
}

/* ------------------------------------------------------------ signals */

static const int k_signals[2] = {SIGTERM, SIGINT};
static bool g_handled[2]; /* our handler is installed for k_signals[i] */
static int g_sig_pipe[2] = {-1, -1};
static pid_t g_watch_pid; /* the process whose watcher reads the pipe */
static atomic_int g_sig_seen;

static void on_signal(int sig)
{
    int saved = errno;
    if (getpid() != g_watch_pid || atomic_exchange(&g_sig_seen, sig) != 0) {
        signal(sig, SIG_DFL);
        raise(sig);
    } else {
        unsigned char b = (unsigned char)sig;
        ssize_t w = write(g_sig_pipe[1], &b, 1);
        (void)w;
    }
    errno = saved;
}

static void *watch_signals(void *arg)
{
    (void)arg;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL); /* the handler runs on other threads */
    unsigned char b = 0;
    ssize_t n;
    while ((n = read(g_sig_pipe[0], &b, 1)) < 0 && errno == EINTR) {}
    if (n != 1) return NULL;
    int sig = b;
    if (ts_trace_enabled() && ts_trace_flush() != TS_OK) ts_logf(TS_LOG_WARN, "TS_TRACE: %s", ts_last_error());
    signal(sig, SIG_DFL);
    sigset_t one;
    sigemptyset(&one);
    sigaddset(&one, sig);
    pthread_sigmask(SIG_UNBLOCK, &one, NULL);
    raise(sig);
    return NULL;
}

/* Under g_lock. Once: the pipe and the watcher. Failures only mean no
 * flush on a signal. */
static void start_watcher_locked(void)
{
    static bool tried;
    if (tried) return;
    tried = true;
    if (pipe2(g_sig_pipe, O_CLOEXEC) != 0) return;
    g_watch_pid = getpid();
    pthread_attr_t at;
    pthread_t th;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&th, &at, watch_signals, NULL);
    pthread_attr_destroy(&at);
    if (rc != 0) {
        close(g_sig_pipe[0]);
        close(g_sig_pipe[1]);
        g_sig_pipe[0] = g_sig_pipe[1] = -1;
    }
}

/* Under g_lock: our handler for each signal whose disposition is the
 * default (a program's own handler, or SIG_IGN, is left alone). */
static void install_handlers_locked(void)
{
    if (g_sig_pipe[1] < 0) return;
    for (int i = 0; i < 2; i++) {
        struct sigaction old, sa;
        if (g_handled[i] || sigaction(k_signals[i], NULL, &old) != 0 || (old.sa_flags & SA_SIGINFO) ||
            old.sa_handler != SIG_DFL)
            continue;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_signal;
        sa.sa_flags = SA_RESTART;
        sigemptyset(&sa.sa_mask);
        g_handled[i] = sigaction(k_signals[i], &sa, NULL) == 0;
    }
}

/* Under g_lock: back to the default where our handler is still there (the
 * watcher stays, blocked on the pipe; a later start installs again). */
static void restore_signals_locked(void)
{
    for (int i = 0; i < 2; i++) {
        if (!g_handled[i]) continue;
        struct sigaction cur;
        if (sigaction(k_signals[i], NULL, &cur) == 0 && !(cur.sa_flags & SA_SIGINFO) && cur.sa_handler == on_signal)
            signal(k_signals[i], SIG_DFL);
        g_handled[i] = false;
    }
}

/* ------------------------------------------------------------ start, stop */

static void at_exit_flush(void)
{
    if (!ts_trace_enabled()) return;
    if (ts_trace_stop(true) != TS_OK) ts_logf(TS_LOG_WARN, "TS_TRACE: %s", ts_last_error());
}

static const char k_empty_trace[] = "{\"traceEvents\": []}\n";

/* Creates `path` (holding an empty trace) or checks that the existing one
 * opens for writing; sets *created. */
static ts_status check_path(const char *path, bool *created)
{
    *created = false;
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd >= 0) {
        *created = true;
        ssize_t w = write(fd, k_empty_trace, sizeof k_empty_trace - 1);
        int e = errno;
        close(fd);
        if (w != (ssize_t)(sizeof k_empty_trace - 1)) {
            unlink(path);
            return ts_error(TS_ERR_IO, "ts_trace_start: cannot write trace file '%s': %s", path,
                            w < 0 ? strerror(e) : "short write");
        }
        return TS_OK;
    }
    if (errno == EEXIST) {
        /* not truncated: the old content stays until the first flush.
         * A symbolic link is not opened (its target could be a device
         * that acts on open): the flush replaces the link itself. */
        fd = open(path, O_WRONLY | O_NONBLOCK | O_CLOEXEC | O_NOFOLLOW);
        if (fd >= 0) {
            close(fd);
            return TS_OK;
        }
        if (errno == ELOOP) return TS_OK;
    }
    return ts_error(TS_ERR_IO, "ts_trace_start: cannot create trace file '%s': %s", path, strerror(errno));
}

ts_status ts_trace_start(const char *path)
{
    if (!path || !*path) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_trace_start: the trace file path is empty");
    bool created;
    ts_status st = check_path(path, &created);
    if (st) return st;
    char *p = ts__strdup(TS_MEM_OTHER, path);
    if (!p) {
        if (created) unlink(path);
        return ts_error(TS_ERR_NO_MEMORY, "ts_trace_start: out of memory");
    }
    static bool registered;
    pthread_mutex_lock(&g_lock);
    bool same = g_path && strcmp(g_path, path) == 0;
    if (g_path && g_created && !g_written && !same) unlink(g_path); /* replaced before anything was written to it */
    ts__free(TS_MEM_OTHER, g_path);
    g_path = p;
    g_created = created || (same && g_created && !g_written);
    g_written = false;
    if (!g_origin_ns) g_origin_ns = ts_now_ns();
    if (!registered) {
        registered = true;
        atexit(at_exit_flush);
    }
    start_watcher_locked();
    install_handlers_locked();
    pthread_mutex_unlock(&g_lock);
    atomic_store(&enabled, 1);
    return TS_OK;
}

/* A program that links the static library and defines this symbol as
 * non-zero (tsrun: TS_TRACE is its ranks', not its own) is never traced
 * from the environment, so it neither creates nor warns about a file. */
extern const int ts__trace_env_ignored __attribute__((weak));

/* Early (priority 101), so that a program's own constructors run traced. */
__attribute__((constructor(101))) static void trace_from_env(void)
{
    g_rank = env_rank();
    if (&ts__trace_env_ignored && ts__trace_env_ignored) return;
    const char *p = getenv("TS_TRACE");
    if (!p || !*p) return;
    char path[4096];
    ts_status st = ts_trace_rank_path(p, g_rank, path, sizeof path);
    if (!st) st = ts_trace_start(path);
    if (st) ts_logf(TS_LOG_WARN, "TS_TRACE=%s: %s; no trace is recorded", p, ts_last_error());
    ts_clear_error();
}

/* ------------------------------------------------------------ flush */

static json_t *args_json(const span_args *a)
{
    json_t *o = json_object();
    for (int i = 0; o && i < a->n; i++)
        json_object_set_new(o, a->a[i].key,
                            a->a[i].str ? json_string(a->a[i].str) : json_integer((json_int_t)a->a[i].num));
    return o;
}

static int by_start(const void *pa, const void *pb)
{
    const span *a = *(const span *const *)pa, *b = *(const span *const *)pb;
    if (a->start_ns != b->start_ns) return a->start_ns < b->start_ns ? -1 : 1;
    if (a->end_ns != b->end_ns) return a->end_ns > b->end_ns ? -1 : 1; /* the enclosing one first */
    return 0;
}

typedef struct lane {
    uint64_t *ends; /* the open spans' ends, innermost last */
    int n, cap;
} lane;

static json_t *meta(const char *what, int pid, int tid, const char *key, json_t *val)
{
    json_t *e =
        json_pack("{s:s, s:s, s:i, s:i, s:{s:o}}", "name", what, "ph", "M", "pid", pid, "tid", tid, "args", key, val);
    return e;
}

/* Appends b's events to `events`; lanes as described at the top. Under
 * b->lock. Returns false when out of memory. */
static bool thread_events(json_t *events, thread_buf *b, int pid)
{
    size_t n = 0;
    for (chunk *c = b->head; c; c = c->next) n += (size_t)c->n;
    const span **v = ts__malloc(TS_MEM_OTHER, (n ? n : 1) * sizeof *v);
    unsigned char *lane_of = ts__malloc(TS_MEM_OTHER, n ? n : 1);
    lane lanes[MAX_LANES];
    memset(lanes, 0, sizeof lanes);
    int nl = 1;
    bool ok = v && lane_of;
    if (ok) {
        size_t k = 0;
        for (chunk *c = b->head; c; c = c->next)
            for (int i = 0; i < c->n; i++) v[k++] = &c->spans[i];
        qsort(v, n, sizeof *v, by_start);
        for (size_t i = 0; i < n && ok; i++) {
            const span *s = v[i];
            int at = -1;
            for (int l = 0; l < nl && at < 0; l++) {
                lane *L = &lanes[l];
                while (L->n > 0 && L->ends[L->n - 1] <= s->start_ns) L->n--;
                if (L->n == 0 || L->ends[L->n - 1] >= s->end_ns) at = l;
            }
            if (at < 0) at = nl < MAX_LANES ? nl++ : MAX_LANES - 1;
            lane *L = &lanes[at];
            if (L->n == L->cap) {
                int cap = L->cap ? 2 * L->cap : 16;
                uint64_t *e = ts__malloc(TS_MEM_OTHER, (size_t)cap * sizeof *e);
                if (!e) {
                    ok = false;
                    break;
                }
                if (L->n) memcpy(e, L->ends, (size_t)L->n * sizeof *e);
                ts__free(TS_MEM_OTHER, L->ends);
                L->ends = e;
                L->cap = cap;
            }
            L->ends[L->n++] = s->end_ns;
            lane_of[i] = (unsigned char)at;
        }
    }
    for (int l = 0; ok && l < nl; l++) {
        int tid = l == 0 ? b->tid : LANE_TID_BASE + 64 * b->tid + l;
        char name[48];
        if (l == 0) snprintf(name, sizeof name, "%s", b->name);
        else snprintf(name, sizeof name, "%s (%d)", b->name, l + 1);
        json_array_append_new(events, meta("thread_name", pid, tid, "name", json_string(name)));
        json_array_append_new(
            events, meta("thread_sort_index", pid, tid, "sort_index", json_integer(b->is_main ? l : 64 * b->tid + l)));
    }
    for (size_t i = 0; ok && i < n; i++) {
        const span *s = v[i];
        int tid = lane_of[i] == 0 ? b->tid : LANE_TID_BASE + 64 * b->tid + lane_of[i];
        double ts = (double)(int64_t)(s->start_ns - g_origin_ns) / 1000.0;
        double dur = (double)(s->end_ns - s->start_ns) / 1000.0;
        json_t *e = json_pack("{s:s, s:s, s:s, s:f, s:f, s:i, s:i}", "name", s->name, "cat", s->cat, "ph", "X", "ts",
                              ts, "dur", dur, "pid", pid, "tid", tid);
        if (e && s->args) json_object_set_new(e, "args", args_json(s->args));
        if (!e || json_array_append_new(events, e) != 0) ok = false;
    }
    for (int l = 0; l < MAX_LANES; l++) ts__free(TS_MEM_OTHER, lanes[l].ends);
    ts__free(TS_MEM_OTHER, v);
    ts__free(TS_MEM_OTHER, lane_of);
    return ok;
}

/* Writes root to path. A character device or FIFO (/dev/null) that path
 * itself names is written straight into; anything else (a regular file, a
 * new name, a symbolic link) is replaced: root is written into a temporary
 * file of a random name in path's folder, created exclusively without
 * following links, mode 0600 (ts__tmp_create; a file or link another user
 * planted is never opened), given mode 0644 under the umask and renamed
 * over path. The temporary is removed on every failure. */
static ts_status write_json(json_t *root, const char *path)
{
    static const char op[] = "ts_trace_flush";
    struct stat sb;
    size_t flags = JSON_COMPACT | JSON_REAL_PRECISION(15);
    if (lstat(path, &sb) == 0 && (S_ISCHR(sb.st_mode) || S_ISFIFO(sb.st_mode))) {
        /* without blocking (a FIFO nobody reads would hold the flush at
         * exit: ENXIO instead), and checked on the descriptor itself, so
         * that a file swapped in after lstat is not written: still a
         * device or FIFO, this user's or root's */
        int fd = open(path, O_WRONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
        if (fd < 0) return ts_error(TS_ERR_IO, "%s: cannot open trace file '%s': %s", op, path, strerror(errno));
        if (fstat(fd, &sb) != 0 || !(S_ISCHR(sb.st_mode) || S_ISFIFO(sb.st_mode)) ||
            (sb.st_uid != 0 && sb.st_uid != geteuid())) {
            close(fd);
            return ts_error(TS_ERR_IO,
                            "%s: trace file '%s' changed while it was opened, or is a device or FIFO of another "
                            "user (uid %u): not written",
                            op, path, (unsigned)sb.st_uid);
        }
        (void)fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
        int rc = json_dumpfd(root, fd, flags);
        int e = errno;
        close(fd);
        if (rc != 0) return ts_error(TS_ERR_IO, "%s: cannot write trace file '%s': %s", op, path, strerror(e));
        return TS_OK;
    }
    char *tmp = NULL;
    int fd = -1;
    ts_status st = ts__tmp_create_beside(TS_MEM_OTHER, op, path, &tmp, &fd);
    if (st) return st;
    if (json_dumpfd(root, fd, flags) != 0)
        st = ts_error(TS_ERR_IO, "%s: cannot write trace file '%s' (temporary '%s'): %s", op, path, tmp,
                      strerror(errno));
    if (!st && fchmod(fd, (mode_t)ts__file_mode(0644)) != 0)
        st = ts_error(TS_ERR_IO, "%s: setting the mode of '%s' failed: %s", op, tmp, strerror(errno));
    if (close(fd) != 0 && !st)
        st = ts_error(TS_ERR_IO, "%s: cannot write trace file '%s' (temporary '%s'): %s", op, path, tmp,
                      strerror(errno));
    if (!st && rename(tmp, path) != 0)
        st = ts_error(TS_ERR_IO, "%s: cannot rename '%s' to '%s': %s", op, tmp, path, strerror(errno));
    if (st) unlink(tmp);
    ts__free(TS_MEM_OTHER, tmp);
    return st;
}

ts_status ts_trace_flush(void)
{
    pthread_mutex_lock(&g_lock);
    if (!g_path) {
        pthread_mutex_unlock(&g_lock);
        return ts_error(TS_ERR_STATE,
                        "ts_trace_flush: tracing was never started (set TS_TRACE=FILE "
                        "or call ts_trace_start)");
    }
    json_t *events = json_array();
    int pid = (int)getpid();
    char pname[64];
    if (g_rank >= 0) snprintf(pname, sizeof pname, "rank %d", g_rank);
    else snprintf(pname, sizeof pname, "%s", program_invocation_short_name);
    bool ok = events != NULL;
    if (ok) {
        json_array_append_new(events, meta("process_name", pid, 0, "name", json_string(pname)));
        json_array_append_new(events,
                              meta("process_sort_index", pid, 0, "sort_index", json_integer(g_rank < 0 ? 0 : g_rank)));
    }
    for (thread_buf *b = g_bufs; b && ok; b = b->next) {
        pthread_mutex_lock(&b->lock);
        ok = thread_events(events, b, pid);
        pthread_mutex_unlock(&b->lock);
    }
    json_t *root = ok ? json_pack("{s:o, s:s, s:{s:s, s:I, s:i, s:s}}", "traceEvents", events, "displayTimeUnit", "ms",
                                  "otherData", "clock", "CLOCK_MONOTONIC", "origin_ns", (json_int_t)g_origin_ns, "rank",
                                  g_rank, "program", program_invocation_short_name)
                      : NULL;
    if (!ok) json_decref(events);
    ts_status st = root
        ? write_json(root, g_path)
        : ts_error(TS_ERR_NO_MEMORY, "ts_trace_flush: out of memory building the trace of '%s'", g_path);
    if (st == TS_OK) g_written = true;
    json_decref(root);
    pthread_mutex_unlock(&g_lock);
    return st;
}

ts_status ts_trace_stop(bool flush)
{
    ts_status st = TS_OK;
    if (flush) st = ts_trace_flush();
    atomic_store(&enabled, 0);
    pthread_mutex_lock(&g_lock);
    clear_spans_locked();
    if (g_path && g_created && !g_written) {
        unlink(g_path); /* nothing was ever written: leave no file behind */
        g_created = false;
    }
    restore_signals_locked();
    pthread_mutex_unlock(&g_lock);
    return st;
}

uint64_t ts_trace_total_ns(const char *name)
{
    uint64_t total = 0;
    if (!name) return 0;
    pthread_mutex_lock(&g_lock);
    for (thread_buf *b = g_bufs; b; b = b->next) {
        pthread_mutex_lock(&b->lock);
        for (chunk *c = b->head; c; c = c->next)
            for (int i = 0; i < c->n; i++)
                if (strcmp(c->spans[i].name, name) == 0) total += c->spans[i].end_ns - c->spans[i].start_ns;
        pthread_mutex_unlock(&b->lock);
    }
    pthread_mutex_unlock(&g_lock);
    return total;
}
