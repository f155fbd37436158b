/*
 * The launcher (ts_launch) on a private libuv loop (the rank side is in
 * launch_env.c). docs/design.md, "The launcher", tells why each
 * piece is there: detached ranks killed by process group, per-stream carry
 * buffers for whole-line output, a grace timer between SIGTERM and SIGKILL.
 */
#define _GNU_SOURCE
#include "comm/comm_internal.h"
#include "comm/launch.h"
#include "comm/launch_internal.h"
#include "comm/store.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

extern char **environ;

#define MAX_RANKS_PER_NODE 4096
#define MAX_NODES 65536
#define LINE_SPLIT (64 * 1024) /* longer lines are split (a newline inserted) */
#define READ_CHUNK (64 * 1024)
#define MIN_MEMORY_CAP ((int64_t)1 << 20)
#define MAX_MEMORY_CAP ((int64_t)1 << 60)

/* ============================================================= launcher */

typedef struct launcher launcher;
typedef struct rank_proc rank_proc;

typedef struct out_stream {
    uv_pipe_t pipe;
    rank_proc *rp;
    int fd;     /* destination */
    bool *dead; /* set after a write error on fd: drop further output */
    bool open;  /* initialised and not closed yet */
    char *carry;
    size_t carry_len, carry_cap;
} out_stream;

struct rank_proc {
    uv_process_t proc;
    launcher *L;
    int rank;
    int pid;
    bool running; /* spawned and not yet exited */
    int log_fd;   /* log_dir/rank<R>.log, -1 when none (or after a write error) */
    bool cg_live; /* its memory cgroup exists (memory_per_rank) */
    out_stream out, err;
};

struct launcher {
    uv_loop_t loop;
    uv_timer_t grace, drain, notice;
    uv_signal_t sig[3];
    int nsig;
    const ts_launch_options *o;
    rank_proc *ranks;
    int n;
    int running;    /* processes not yet exited */
    int open_pipes; /* pipes not yet closed */
    bool stopping;  /* SIGTERM sent (failure or signal) */
    bool finishing;
    int failed_rank, failed_code, failed_signal, received_signal;
    ts__cgroup_job *cg; /* memory_per_rank's groups; NULL without caps */
    int oom_rank;       /* -1: none */
    int64_t oom_peak;
    char oom_message[256];
    bool out_dead, err_dead;
    int watchdog_fd; /* write end of the watchdog's pipe; -1 when none */
    ts_store *store; /* node 0: a client of its own store, recording exits; NULL when none */
    const char *run_id;
    char *line;
    size_t line_cap;
    char rbuf[READ_CHUNK];
};

static void *grow(void *p, size_t used, size_t cap)
{
    void *q = ts__malloc(TS_MEM_COMM, cap);
    if (q && p) memcpy(q, p, used);
    if (q) ts__free(TS_MEM_COMM, p);
    return q;
}

/* Writes all of buf to fd with SIGPIPE blocked on this thread (a closed
 * reader must not kill the launcher). Returns 0 or an errno value. */
static int write_all(int fd, const char *p, size_t n)
{
    sigset_t pipe_set, old, pending;
    sigemptyset(&pipe_set);
    sigaddset(&pipe_set, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_set, &old);
    sigpending(&pending);
    bool was_pending = sigismember(&pending, SIGPIPE) == 1;
    int err = 0;
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w > 0) {
            p += w;
            n -= (size_t)w;
        } else if (w < 0 && errno == EINTR) {
            continue;
        } else if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            struct pollfd pf = {.fd = fd, .events = POLLOUT};
            poll(&pf, 1, 1000);
        } else {
            err = w < 0 ? errno : EIO;
            break;
        }
    }
    if (err == EPIPE && !was_pending) {
        struct timespec zero = {0, 0};
        sigtimedwait(&pipe_set, NULL, &zero);
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return err;
}

/* ------------------------------------------------------------- watchdog */

/* path = dir + "/rank" + decimal r, async-signal-safe; false when it
 * does not fit. */
static bool rank_dir(char *path, size_t cap, const char *dir, int r)
{
    size_t n = 0;
    for (const char *p = dir; *p; p++)
        if (n + 1 < cap) path[n++] = *p;
        else return false;
    static const char tail[] = "/rank";
    char digits[16];
    int nd = 0;
    do {
        digits[nd++] = (char)('0' + r % 10);
        r /= 10;
    } while (r > 0 && nd < 15);
    if (n + sizeof tail + (size_t)nd >= cap) return false;
    for (size_t k = 0; k + 1 < sizeof tail; k++) path[n++] = tail[k];
    while (nd > 0) path[n++] = digits[--nd];
    path[n] = '\0';
    return true;
}

/* SIGKILLs every process listed in the group's cgroup.procs (those
 * that left the rank's process group); async-signal-safe. */
static void kill_group_procs(const char *dir)
{
    char path[PATH_MAX + 16];
    size_t n = 0;
    for (const char *p = dir; *p && n + 1 < PATH_MAX; p++) path[n++] = *p;
    static const char tail[] = "/cgroup.procs";
    for (size_t k = 0; k < sizeof tail; k++) path[n++] = tail[k];
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    char buf[4096];
    ssize_t got = read(fd, buf, sizeof buf - 1);
    close(fd);
    long pid = 0;
    for (ssize_t i = 0; i < got; i++) {
        if (buf[i] >= '0' && buf[i] <= '9') {
            pid = pid * 10 + (buf[i] - '0');
        } else {
            if (pid > 0) kill((pid_t)pid, SIGKILL);
            pid = 0;
        }
    }
}

/* The watchdog's removal of the memory cgroups of the dead launcher's
 * ranks (async-signal-safe): each once its killed processes have left
 * it, for at most about 5 s in all. */
static void watchdog_remove_groups(const char *job, int first_rank, int n)
{
    struct timespec step = {0, 10 * 1000 * 1000};
    int tries = 500;
    for (int i = 0; i < n; i++) {
        char path[PATH_MAX];
        if (!rank_dir(path, sizeof path, job, first_rank + i)) continue;
        while (rmdir(path) != 0 && errno == EBUSY && tries-- > 0) {
            kill_group_procs(path);
            nanosleep(&step, NULL);
        }
    }
    rmdir(job);
}

/* A process of its own session that SIGKILLs the ranks' process groups if
 * the launcher dies without saying goodbye (SIGKILL, a crash), so that
 * ranks never outlive it, even those that never call ts_launch_rank_guard,
 * and their children. The launcher tells it over a pipe: pid > 0 a rank's
 * group started, pid < 0 it ended, 0 goodbye. End of file without a
 * goodbye means the launcher is gone. With memory_per_rank it then also
 * removes the ranks' memory cgroups. */
static void watchdog_main(int fd, int n, const char *cg_job, int first_rank)
{
    int32_t groups[MAX_RANKS_PER_NODE] = {0};
    /* forked from a process that may have threads: only async-signal-safe
     * calls from here on */
    setsid(); /* no terminal signals: a Ctrl-C is the launcher's to handle */
    int null = open("/dev/null", O_RDWR);
    if (null >= 0) {
        dup2(null, 0);
        dup2(null, 1);
        dup2(null, 2);
    }
    if (fd != 3) {
        dup2(fd, 3);
        fd = 3;
    }
    if (close_range(4, ~0u, 0) != 0)
        for (int i = 4; i < 4096; i++) close(i);
    for (;;) {
        int32_t v;
        size_t got = 0;
        while (got < sizeof v) {
            ssize_t r = read(fd, (char *)&v + got, sizeof v - got);
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) { /* the launcher is gone */
                for (int i = 0; i < n; i++)
                    if (groups[i] > 0) kill(-(pid_t)groups[i], SIGKILL);
                if (cg_job[0]) watchdog_remove_groups(cg_job, first_rank, n);
                _exit(0);
            }
            got += (size_t)r;
        }
        if (v == 0) _exit(0);
        for (int i = 0; i < n; i++) {
            if (v > 0 && groups[i] == 0) {
                groups[i] = v;
                break;
            }
            if (v < 0 && groups[i] == -v) {
                groups[i] = 0;
                break;
            }
        }
    }
}

/* Starts the watchdog; returns its pid (-1 when it could not start: the
 * job runs without it) and the pipe's write end. cg_job: the directory of
 * the ranks' memory cgroups ("" when none), removed should the launcher
 * die. */
static pid_t watchdog_start(int n, const char *cg_job, int first_rank, int *fd_out)
{
    *fd_out = -1;
    int p[2];
    if (pipe2(p, O_CLOEXEC) != 0) return -1;
    pid_t w = fork();
    if (w == 0) {
        close(p[1]);
        watchdog_main(p[0], n, cg_job, first_rank);
        _exit(0);
    }
    close(p[0]);
    if (w < 0) {
        close(p[1]);
        return -1;
    }
    *fd_out = p[1];
    return w;
}

static void watchdog_tell(launcher *L, int32_t v)
{
    if (L->watchdog_fd >= 0 && write_all(L->watchdog_fd, (const char *)&v, sizeof v) != 0) {
        close(L->watchdog_fd); /* it died: carry on without it */
        L->watchdog_fd = -1;
    }
}

/* Says goodbye and reaps it. */
static void watchdog_stop(launcher *L, pid_t w)
{
    if (w <= 0) return;
    watchdog_tell(L, 0);
    if (L->watchdog_fd >= 0) close(L->watchdog_fd);
    L->watchdog_fd = -1;
    while (waitpid(w, NULL, 0) < 0 && errno == EINTR)
        ;
}

/* One line (without its newline) to the stream's destination, prefixed,
 * in one write; and, unprefixed, to the rank's log file. */
static void emit_line(out_stream *os, const char *s, size_t len)
{
    launcher *L = os->rp->L;
    if (*os->dead && os->rp->log_fd < 0) return;
    char prefix[32];
    int pn = L->o->prefix_output ? snprintf(prefix, sizeof prefix, "[%d] ", os->rp->rank) : 0;
    size_t total = (size_t)pn + len + 1;
    if (total > L->line_cap) {
        size_t cap = L->line_cap ? L->line_cap : 256;
        while (cap < total) cap *= 2;
        char *nb = grow(NULL, 0, cap);
        if (!nb) {
            *os->dead = true; /* out of memory: drop output rather than mangle it */
            return;
        }
        ts__free(TS_MEM_COMM, L->line);
        L->line = nb;
        L->line_cap = cap;
    }
    memcpy(L->line, prefix, (size_t)pn);
    memcpy(L->line + pn, s, len);
    L->line[total - 1] = '\n';
    /* the log first: a line seen on the terminal is in the log already */
    rank_proc *rp = os->rp;
    int err;
    if (rp->log_fd >= 0 && (err = write_all(rp->log_fd, L->line + pn, len + 1)) != 0) {
        /* a full disk must not stop the job: this log ends, once said */
        close(rp->log_fd);
        rp->log_fd = -1;
        char msg[PATH_MAX + 160];
        int mn = snprintf(msg, sizeof msg, "ts_launch: cannot write %s/rank%d.log: %s; that log stops here\n",
                          L->o->log_dir, rp->rank, strerror(err));
        if (!L->err_dead && mn > 0) write_all(L->o->err_fd, msg, (size_t)mn < sizeof msg ? (size_t)mn : sizeof msg - 1);
    }
    if (!*os->dead && write_all(os->fd, L->line, total) != 0) *os->dead = true;
}

/* Appends to the carry buffer, emitting LINE_SPLIT-byte pieces of an
 * overlong line. */
static void carry_add(out_stream *os, const char *s, size_t n)
{
    while (n > 0) {
        size_t room = LINE_SPLIT - os->carry_len;
        size_t take = n < room ? n : room;
        if (os->carry_len + take > os->carry_cap) {
            size_t cap = os->carry_cap ? os->carry_cap : 1024;
            while (cap < os->carry_len + take) cap *= 2;
            if (cap > LINE_SPLIT) cap = LINE_SPLIT;
            char *nb = grow(os->carry, os->carry_len, cap);
            if (!nb) {
                /* out of memory: pass the piece on as a line of its own */
                emit_line(os, os->carry, os->carry_len);
                os->carry_len = 0;
                emit_line(os, s, n);
                return;
            }
            os->carry = nb;
            os->carry_cap = cap;
        }
        memcpy(os->carry + os->carry_len, s, take);
        os->carry_len += take;
        s += take;
        n -= take;
        if (os->carry_len == LINE_SPLIT) {
            emit_line(os, os->carry, os->carry_len);
            os->carry_len = 0;
        }
    }
}

static void feed(out_stream *os, const char *s, size_t n)
{
    while (n > 0) {
        const char *nl = memchr(s, '\n', n);
        if (!nl) {
            carry_add(os, s, n);
            return;
        }
        size_t len = (size_t)(nl - s);
        if (os->carry_len == 0 && len <= LINE_SPLIT) {
            emit_line(os, s, len);
        } else {
            carry_add(os, s, len);
            if (os->carry_len > 0) emit_line(os, os->carry, os->carry_len);
            os->carry_len = 0;
        }
        s = nl + 1;
        n -= len + 1;
    }
}

static void maybe_finish(launcher *L);

static void close_stream(out_stream *os)
{
    if (!os->open) return;
    if (os->carry_len > 0) /* an unterminated last line */
        emit_line(os, os->carry, os->carry_len);
    os->carry_len = 0;
    os->open = false;
    os->rp->L->open_pipes--;
    uv_close((uv_handle_t *)&os->pipe, NULL);
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    (void)suggested;
    out_stream *os = h->data;
    /* one buffer for all streams: libuv calls read_cb right after alloc_cb */
    buf->base = os->rp->L->rbuf;
    buf->len = READ_CHUNK;
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    out_stream *os = s->data;
    if (nread > 0) {
        feed(os, buf->base, (size_t)nread);
        return;
    }
    if (nread == 0) /* EAGAIN */
        return;
    close_stream(os); /* UV_EOF or an error */
    maybe_finish(os->rp->L);
}

static void signal_groups(launcher *L, int sig)
{
    for (int i = 0; i < L->n; i++)
        if (L->ranks[i].running) kill(-(pid_t)L->ranks[i].pid, sig);
}

static void on_grace(uv_timer_t *t) { signal_groups(t->data, SIGKILL); }

static void start_stopping(launcher *L, int sig)
{
    L->stopping = true;
    uv_timer_stop(&L->notice);
    signal_groups(L, sig);
    if (sig != SIGKILL && !uv_is_active((uv_handle_t *)&L->grace)) {
        double ms = L->o->grace_s * 1000.0;
        uv_timer_start(&L->grace, on_grace, (uint64_t)ms, 0);
    }
}

/* The window after an OOM notice is over: the ranks that have not
 * failed and exited on it are stopped. */
static void on_notice(uv_timer_t *t) { start_stopping(t->data, SIGTERM); }

static void on_drain(uv_timer_t *t)
{
    launcher *L = t->data;
    /* processes outside the ranks' groups still hold pipes: abandon them */
    for (int i = 0; i < L->n; i++) {
        close_stream(&L->ranks[i].out);
        close_stream(&L->ranks[i].err);
    }
    maybe_finish(L);
}

/* Records a rank's exit in the store (TS_LAUNCH_EXITS_KEY, launch.h), so
 * that a rendezvous waiting for it fails at once. The store runs on its
 * own thread, so these blocking calls are answered at once; should it
 * fail, the client is dropped and the job goes on without the records. */
static void record_exit(launcher *L, const rank_proc *rp, int64_t exit_status, int term_signal)
{
    if (!L->store) return;
    char key[TS_LAUNCH_MAX_STR + 64], val[96];
    snprintf(key, sizeof key, TS_LAUNCH_EXITS_KEY, L->run_id);
    int64_t n = 0;
    ts_status s = ts_store_add(L->store, key, 1, &n);
    if (s == TS_OK) {
        snprintf(key, sizeof key, TS_LAUNCH_EXIT_KEY, L->run_id, (long long)n);
        snprintf(val, sizeof val, "%d %lld %d %d", rp->rank, (long long)exit_status, term_signal, rp->pid);
        s = ts_store_set(L->store, key, val, strlen(val));
    }
    if (s != TS_OK) {
        ts_logf(TS_LOG_WARN, "ts_launch: cannot record the exit of rank %d in the store: %s", rp->rank,
                ts_last_error());
        ts_store_close(L->store);
        L->store = NULL;
    }
}

/* The rank the others found hung (TS_LAUNCH_HUNG_KEY), if one of them
 * recorded it before exiting. */
static void read_hung(launcher *L, ts_launch_result *res)
{
    if (!L->store) return;
    char key[TS_LAUNCH_MAX_STR + 64];
    snprintf(key, sizeof key, TS_LAUNCH_HUNG_KEY, L->run_id);
    if (ts_store_check(L->store, key) != TS_OK) return;
    void *v = NULL;
    size_t len = 0;
    if (ts_store_get(L->store, key, &v, &len) != TS_OK) return;
    char txt[128];
    snprintf(txt, sizeof txt, "%.*s", (int)(len < sizeof txt - 1 ? len : sizeof txt - 1), (const char *)v);
    ts_store_value_free(v);
    int r = -1, off = 0;
    if (sscanf(txt, "%d %n", &r, &off) < 1 || r < 0 || r >= L->o->nnodes * L->o->nproc_per_node) return;
    res->hung_rank = r;
    snprintf(res->hung_collective, sizeof res->hung_collective, "%s", txt + off);
}

/* rank R's memory cgroup (memory_per_rank) */
static void cg_dir(const launcher *L, int rank, char *out, size_t cap)
{
    snprintf(out, cap, "%s/rank%d", L->cg->job, rank);
}

/* Posts the failure notice `msg` of rank `culprit` to the world the ranks
 * formed last (TS_LAUNCH_WORLD_KEY: "<world size> <prefix>") and wakes
 * every other rank's watch (comm/dist.c, "Failure notices"), unless a
 * rank posted a failure of its own first. True when this notice is the
 * world's. */
static bool post_notice(launcher *L, int culprit, const char *msg)
{
    if (!L->store) return false;
    char key[3 * TS_LAUNCH_MAX_STR + 64];
    snprintf(key, sizeof key, TS_LAUNCH_WORLD_KEY, L->run_id);
    if (ts_store_check(L->store, key) != TS_OK)
        return false; /* no world has met yet (the rendezvous names the exit itself) */
    void *v = NULL;
    size_t len = 0;
    if (ts_store_get(L->store, key, &v, &len) != TS_OK) return false;
    char world_txt[3 * TS_LAUNCH_MAX_STR + 32];
    snprintf(world_txt, sizeof world_txt, "%.*s", (int)(len < sizeof world_txt - 1 ? len : sizeof world_txt - 1),
             (const char *)v);
    ts_store_value_free(v);
    int world = 0, off = 0;
    if (sscanf(world_txt, "%d %n", &world, &off) < 1 || world < 1 || off <= 0 || !world_txt[off]) return false;
    const char *prefix = world_txt + off;
    char val[640];
    int n = snprintf(val, sizeof val, "-1 %d %d %s", (int)TS_ERR_PEER_FAILED, culprit, msg);
    size_t vlen = n < 0 ? 0 : (size_t)n >= sizeof val ? sizeof val - 1 : (size_t)n;
    snprintf(key, sizeof key, TS__DIST_FAILED_KEY, prefix);
    void *got = NULL;
    size_t glen = 0;
    ts_status s = ts_store_compare_set(L->store, key, "", 0, val, vlen, &got, &glen);
    bool won = s == TS_OK && glen == vlen && memcmp(got, val, vlen) == 0;
    ts_store_value_free(got);
    for (int r = 0; won && r < world; r++) {
        if (r == culprit) continue;
        snprintf(key, sizeof key, TS__DIST_WAKE_KEY, prefix, r);
        if (ts_store_set(L->store, key, "", 0) != TS_OK) won = false;
    }
    if (s != TS_OK)
        ts_logf(TS_LOG_WARN, "ts_launch: cannot post the failure of rank %d to the store: %s", culprit,
                ts_last_error());
    return won;
}

/* Reads the rank's memory cgroup counters and removes the group. True
 * when its failure was the kernel's OOM killer (then the message is in
 * L->oom_message when it is the job's first failure). */
static bool check_oom(launcher *L, rank_proc *rp, int64_t exit_status, int term_signal, int64_t *peak_out)
{
    *peak_out = -1;
    if (!L->cg || !rp->cg_live) return false;
    char dir[PATH_MAX + 32];
    cg_dir(L, rp->rank, dir, sizeof dir);
    int64_t kills = -1, failcnt = -1;
    ts__cgroup_counters(L->cg, dir, &kills, &failcnt, peak_out);
    if (ts__cgroup_remove(dir) == 0) rp->cg_live = false;
    bool failed = exit_status != 0 || term_signal != 0;
    /* without the kill counter (v1 before Linux 4.13): a SIGKILL after
     * the usage hit the limit */
    return failed && (kills > 0 || (kills < 0 && term_signal == SIGKILL && failcnt > 0));
}

static void on_proc_exit(uv_process_t *p, int64_t exit_status, int term_signal)
{
    rank_proc *rp = p->data;
    launcher *L = rp->L;
    rp->running = false;
    L->running--;
    /* leftover children of the rank would keep its pipes open */
    kill(-(pid_t)rp->pid, SIGKILL);
    watchdog_tell(L, -(int32_t)rp->pid);
    uv_close((uv_handle_t *)p, NULL);
    int64_t peak = -1;
    bool oom = check_oom(L, rp, exit_status, term_signal, &peak);
    record_exit(L, rp, exit_status, term_signal);
    bool failed = exit_status != 0 || term_signal != 0;
    if (failed && !L->stopping) {
        L->failed_rank = rp->rank;
        L->failed_signal = term_signal;
        L->failed_code = term_signal ? 128 + term_signal : (int)exit_status;
        if (oom) {
            char cap[32], peak_s[32] = "", how[128];
            ts_launch_format_size(L->o->memory_per_rank, cap, sizeof cap);
            if (peak >= 0) ts_launch_format_size(peak, peak_s, sizeof peak_s);
            if (term_signal == SIGKILL) snprintf(how, sizeof how, "killed by the kernel's OOM killer");
            else
                snprintf(how, sizeof how, "the kernel's OOM killer killed a process of it; it %s %d",
                         term_signal ? "died of signal" : "exited with status",
                         term_signal ? term_signal : (int)exit_status);
            L->oom_rank = rp->rank;
            L->oom_peak = peak;
            snprintf(L->oom_message, sizeof L->oom_message, "rank %d exceeded --memory-per-rank %s (%s%s%s)", rp->rank,
                     cap, how, peak >= 0 ? "; peak " : "", peak_s);
        }
        if (oom && L->o->grace_s > 0 && post_notice(L, rp->rank, L->oom_message)) {
            /* the others fail naming it (dist.c's watch) and exit by
             * themselves; those that do not are stopped after grace_s */
            L->stopping = true;
            uv_timer_start(&L->notice, on_notice, (uint64_t)(L->o->grace_s * 1000.0), 0);
        } else {
            start_stopping(L, SIGTERM);
        }
    }
    if (L->running == 0 && L->open_pipes > 0 && !uv_is_active((uv_handle_t *)&L->drain)) {
        /* at least a second: what the ranks wrote last is still being read */
        double ms = (L->o->grace_s > 1.0 ? L->o->grace_s : 1.0) * 1000.0;
        uv_timer_start(&L->drain, on_drain, (uint64_t)ms, 0);
    }
    maybe_finish(L);
}

static void on_signal(uv_signal_t *h, int signum)
{
    launcher *L = h->data;
    if (L->received_signal && signum != SIGHUP) {
        start_stopping(L, SIGKILL); /* asked twice: no more grace */
        return;
    }
    if (!L->received_signal) L->received_signal = signum;
    start_stopping(L, signum);
}

static void maybe_finish(launcher *L)
{
    if (L->finishing || L->running > 0 || L->open_pipes > 0) return;
    L->finishing = true;
    uv_close((uv_handle_t *)&L->grace, NULL);
    uv_close((uv_handle_t *)&L->drain, NULL);
    uv_close((uv_handle_t *)&L->notice, NULL);
    for (int i = 0; i < L->nsig; i++) uv_close((uv_handle_t *)&L->sig[i], NULL);
}

ts_launch_options ts_launch_options_default(void)
{
    return (ts_launch_options){
        .nproc_per_node = 1,
        .nnodes = 1,
        .node_rank = 0,
        .master_addr = "127.0.0.1",
        .master_port = 0,
        .run_id = NULL,
        .token = NULL,
        .grace_s = 3.0,
        .prefix_output = true,
        .forward_signals = true,
        .out_fd = 1,
        .err_fd = 2,
        .log_dir = NULL,
        .memory_per_rank = 0,
    };
}

static ts_status random_hex(char *out, size_t nbytes)
{
    unsigned char b[32];
    if (nbytes > sizeof b) nbytes = sizeof b;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ts_error(TS_ERR_IO, "ts_launch: cannot open /dev/urandom: %s", strerror(errno));
    size_t got = 0;
    while (got < nbytes) {
        ssize_t r = read(fd, b + got, nbytes - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            int e = r < 0 ? errno : EIO;
            close(fd);
            return ts_error(TS_ERR_IO, "ts_launch: cannot read /dev/urandom: %s", strerror(e));
        }
        got += (size_t)r;
    }
    close(fd);
    static const char hex[] = "0123456789abcdef";
    for (size_t i = 0; i < nbytes; i++) {
        out[2 * i] = hex[b[i] >> 4];
        out[2 * i + 1] = hex[b[i] & 15];
    }
    out[2 * nbytes] = '\0';
    return TS_OK;
}

static bool valid_str(const char *s) { return s && *s && strlen(s) < TS_LAUNCH_MAX_STR && !strpbrk(s, "\n\r"); }

static ts_status check_options(const ts_launch_options *o, char *const *argv)
{
    if (!o) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_launch: options are NULL");
    if (!argv || !argv[0] || !*argv[0]) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_launch: no program to run");
    if (o->nproc_per_node < 1 || o->nproc_per_node > MAX_RANKS_PER_NODE)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_launch: nproc_per_node must be 1..%d (got %d)", MAX_RANKS_PER_NODE,
                        o->nproc_per_node);
    if (o->nnodes < 1 || o->nnodes > MAX_NODES)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_launch: nnodes must be 1..%d (got %d)", MAX_NODES, o->nnodes);
    if ((long long)o->nnodes * o->nproc_per_node > INT_MAX / 2)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_launch: nnodes x nproc_per_node is too large");
    if (o->node_rank < 0 || o->node_rank >= o->nnodes)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_launch: node_rank must be 0..%d (nnodes %d; got %d)",
                        o->nnodes - 1, o->nnodes, o->node_rank);
    if (!valid_str(o->master_addr))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_launch: master_addr must be a host name or address");
    if (o->master_port < 0 || o->master_port > 65535)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_launch: master_port must be 0..65535 (got %d)", o->master_port);
    if (o->nnodes > 1 && o->master_port == 0)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "ts_launch: nnodes %d needs a fixed master_port (every node must know it)", o->nnodes);
    if (o->nnodes > 1 && !(o->token && *o->token))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_launch: nnodes %d needs a token, the same on every node",
                        o->nnodes);
    if (o->token && *o->token && !valid_str(o->token))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_launch: token must be under %d bytes, one line",
                        TS_LAUNCH_MAX_STR);
    if (o->run_id && *o->run_id && !valid_str(o->run_id))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_launch: run_id must be under %d bytes, one line",
                        TS_LAUNCH_MAX_STR);
    if (!(o->grace_s >= 0.0 && o->grace_s <= 86400.0))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_launch: grace_s must be 0..86400 seconds (got %g)", o->grace_s);
    if (o->out_fd < 0 || o->err_fd < 0)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_launch: out_fd and err_fd must be open descriptors");
    if (o->memory_per_rank != 0 && (o->memory_per_rank < MIN_MEMORY_CAP || o->memory_per_rank > MAX_MEMORY_CAP))
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "ts_launch: memory_per_rank must be 0 (no cap) or %lld (1 MiB) .. %lld (1 EiB) bytes (got "
                        "%lld)",
                        (long long)MIN_MEMORY_CAP, (long long)MAX_MEMORY_CAP, (long long)o->memory_per_rank);
    if (o->log_dir && (!*o->log_dir || strlen(o->log_dir) > PATH_MAX - 32))
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "ts_launch: log_dir must be a directory path of 1..%d bytes "
                        "(got %zu)",
                        PATH_MAX - 32, strlen(o->log_dir));
    return TS_OK;
}

/* mkdir -p: creates dir and its missing parents (mode 0777 less the
 * umask). Returns 0 or an errno value; ENOTDIR when a component is not a
 * directory. */
static int make_dirs(const char *dir)
{
    char path[PATH_MAX];
    size_t n = strlen(dir);
    if (n >= sizeof path) return ENAMETOOLONG;
    memcpy(path, dir, n + 1);
    for (size_t i = 1; i <= n; i++) {
        if (path[i] != '/' && path[i] != '\0') continue;
        char c = path[i];
        path[i] = '\0';
        if (mkdir(path, 0777) != 0 && errno != EEXIST) return errno;
        path[i] = c;
    }
    struct stat st;
    if (stat(dir, &st) != 0) return errno;
    return S_ISDIR(st.st_mode) ? 0 : ENOTDIR;
}

/* Creates log_dir and truncates one regular file per rank of this node in
 * it, before any rank starts. On failure closes what it opened. */
static ts_status open_logs(launcher *L)
{
    const char *dir = L->o->log_dir;
    int e = make_dirs(dir);
    if (e) return ts_error(TS_ERR_IO, "ts_launch: cannot create the log directory '%s': %s", dir, strerror(e));
    for (int i = 0; i < L->n; i++) {
        char path[PATH_MAX];
        int rank = L->o->node_rank * L->o->nproc_per_node + i;
        snprintf(path, sizeof path, "%s/rank%d.log", dir, rank);
        /* O_NONBLOCK: a FIFO planted there must not block the launcher */
        int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW | O_NOCTTY | O_NONBLOCK, 0666);
        struct stat st;
        e = fd < 0 ? errno : fstat(fd, &st) != 0 ? errno : !S_ISREG(st.st_mode) ? EINVAL : 0;
        int fl = e == 0 ? fcntl(fd, F_GETFL) : 0;
        if (e == 0 && (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0)) e = errno;
        if (e) {
            if (fd >= 0) close(fd);
            for (int k = 0; k < i; k++) {
                close(L->ranks[k].log_fd);
                L->ranks[k].log_fd = -1;
            }
            return ts_error(TS_ERR_IO, "ts_launch: cannot open the log file '%s' for rank %d: %s", path, rank,
                            e == ELOOP        ? "it is a symbolic link (refused)"
                                : e == EINVAL ? "not a regular file"
                                              : strerror(e));
        }
        L->ranks[i].log_fd = fd;
    }
    return TS_OK;
}

/* The numeric IPv4 address to bind for master_addr. */
static ts_status bind_address(const char *addr, char *out, size_t cap)
{
    struct in_addr a;
    if (inet_pton(AF_INET, addr, &a) == 1) {
        snprintf(out, cap, "%s", addr);
        return TS_OK;
    }
    struct addrinfo hints = {.ai_family = AF_INET, .ai_socktype = SOCK_STREAM};
    struct addrinfo *res = NULL;
    int r = getaddrinfo(addr, NULL, &hints, &res);
    if (r != 0 || !res)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "ts_launch: master_addr '%s' does not resolve to an IPv4 "
                        "address: %s",
                        addr, r ? gai_strerror(r) : "no address");
    const struct sockaddr_in *sin = (const struct sockaddr_in *)(const void *)res->ai_addr;
    inet_ntop(AF_INET, &sin->sin_addr, out, (socklen_t)cap);
    freeaddrinfo(res);
    return TS_OK;
}

/* Variables a launcher sets: removed from the inherited environment. */
static const char *const launcher_vars[] = {
    "RANK",        "WORLD_SIZE",       "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
    "MASTER_PORT", "TS_STORE_TOKEN",   "TS_RUN_ID",  "TS_STORE_HOSTED",  "TS_LAUNCHER_PID",
    "GROUP_RANK",  "GROUP_WORLD_SIZE", "ROLE_RANK",  "ROLE_WORLD_SIZE",  TS_MEMORY_PER_RANK_ENV,
};

static bool is_launcher_var(const char *entry)
{
    for (size_t i = 0; i < sizeof launcher_vars / sizeof launcher_vars[0]; i++) {
        size_t n = strlen(launcher_vars[i]);
        if (strncmp(entry, launcher_vars[i], n) == 0 && entry[n] == '=') return true;
    }
    return false;
}

/* The environment shared by this node's ranks: 2 slots left free at
 * [0] and [1] for RANK and LOCAL_RANK. Strings we made are listed in
 * owned[] (borrowed ones point into environ). */
typedef struct env_builder {
    char **v;
    size_t n, cap;
    char *owned[24];
    int nowned;
} env_builder;

static ts_status env_add(env_builder *b, const char *entry, bool copy)
{
    if (b->n + 2 > b->cap) { /* keep room for the NULL */
        size_t cap = b->cap ? b->cap * 2 : 64;
        char **nv = grow(b->v, b->n * sizeof *nv, cap * sizeof *nv);
        if (!nv) return TS_ERR_NO_MEMORY;
        b->v = nv;
        b->cap = cap;
    }
    char *s = (char *)entry;
    if (copy) {
        TS_ASSERT(b->nowned < (int)(sizeof b->owned / sizeof b->owned[0]));
        s = ts__strdup(TS_MEM_COMM, entry);
        if (!s) return TS_ERR_NO_MEMORY;
        b->owned[b->nowned++] = s;
    }
    b->v[b->n++] = s;
    b->v[b->n] = NULL;
    return TS_OK;
}

static ts_status env_addf(env_builder *b, const char *name, const char *fmt, ...) TS_PRINTF(3, 4);
static ts_status env_addf(env_builder *b, const char *name, const char *fmt, ...)
{
    char buf[2 * TS_LAUNCH_MAX_STR + 64];
    int n = snprintf(buf, sizeof buf, "%s=", name);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf + n, sizeof buf - (size_t)n, fmt, ap);
    va_end(ap);
    return env_add(b, buf, true);
}

static void env_free(env_builder *b)
{
    for (int i = 0; i < b->nowned; i++) ts__free(TS_MEM_COMM, b->owned[i]);
    ts__free(TS_MEM_COMM, b->v);
}

static ts_status build_env(env_builder *b, const ts_launch_options *o, int port, const char *token, const char *run_id)
{
    ts_status s = TS_OK;
    /* slots 0 and 1: RANK and LOCAL_RANK, filled per rank */
    if ((s = env_add(b, "RANK=", false)) || (s = env_add(b, "LOCAL_RANK=", false))) return s;
    for (char **e = environ; e && *e; e++)
        if (!is_launcher_var(*e) && (s = env_add(b, *e, false))) return s;
    int world = o->nnodes * o->nproc_per_node;
    if ((s = env_addf(b, "WORLD_SIZE", "%d", world)) ||
        (s = env_addf(b, "LOCAL_WORLD_SIZE", "%d", o->nproc_per_node)) ||
        (s = env_addf(b, "GROUP_RANK", "%d", o->node_rank)) || (s = env_addf(b, "GROUP_WORLD_SIZE", "%d", o->nnodes)) ||
        (s = env_addf(b, "MASTER_ADDR", "%s", o->master_addr)) || (s = env_addf(b, "MASTER_PORT", "%d", port)) ||
        (s = env_addf(b, "TS_STORE_TOKEN", "%s", token)) || (s = env_addf(b, "TS_RUN_ID", "%s", run_id)) ||
        (s = env_addf(b, "TS_STORE_HOSTED", "1")) || (s = env_addf(b, "TS_LAUNCHER_PID", "%ld", (long)getpid())))
        return s;
    if (o->memory_per_rank > 0 && (s = env_addf(b, TS_MEMORY_PER_RANK_ENV, "%lld", (long long)o->memory_per_rank)))
        return s;
    /* docs/design.md, "UCX: transports and registration": shared memory with peer-failure
     * detection, a fast keepalive, no warnings for unused UCX variables,
     * one BLIS thread per core share */
    if (!getenv("UCX_TLS") &&
        (s = env_addf(b, "UCX_TLS", "%s", o->nnodes > 1 ? "posix,cma,self,tcp" : "posix,cma,self")))
        return s;
    if (!getenv("UCX_MM_ERROR_HANDLING") && (s = env_addf(b, "UCX_MM_ERROR_HANDLING", "y"))) return s;
    if (!getenv("UCX_KEEPALIVE_INTERVAL") && (s = env_addf(b, "UCX_KEEPALIVE_INTERVAL", "1s"))) return s;
    if (!getenv("UCX_WARN_UNUSED_ENV_VARS") && (s = env_addf(b, "UCX_WARN_UNUSED_ENV_VARS", "n"))) return s;
    int threads = ts_cpu_count() / o->nproc_per_node;
    if (threads < 1) threads = 1;
    if (!getenv("BLIS_NUM_THREADS") && (s = env_addf(b, "BLIS_NUM_THREADS", "%d", threads))) return s;
    if (!getenv("TS_NUM_THREADS") && (s = env_addf(b, "TS_NUM_THREADS", "%d", threads))) return s;
    return TS_OK;
}

/* Spawns rank i. On failure writes the message into err. */
static int spawn_rank(launcher *L, int i, char *const *argv, char **env, char *err, size_t errcap)
{
    rank_proc *rp = &L->ranks[i];
    rp->L = L;
    rp->rank = L->o->node_rank * L->o->nproc_per_node + i;
    out_stream *streams[2] = {&rp->out, &rp->err};
    for (int k = 0; k < 2; k++) {
        out_stream *os = streams[k];
        os->rp = rp;
        os->fd = k == 0 ? L->o->out_fd : L->o->err_fd;
        os->dead = k == 0 ? &L->out_dead : (L->o->err_fd == L->o->out_fd ? &L->out_dead : &L->err_dead);
        uv_pipe_init(&L->loop, &os->pipe, 0);
        os->pipe.data = os;
        os->open = true;
        L->open_pipes++;
    }
    uv_stdio_container_t stdio[3];
    memset(stdio, 0, sizeof stdio);
    stdio[0].flags = UV_IGNORE;
    stdio[1].flags = (uv_stdio_flags)(UV_CREATE_PIPE | UV_WRITABLE_PIPE);
    stdio[1].data.stream = (uv_stream_t *)&rp->out.pipe;
    stdio[2].flags = (uv_stdio_flags)(UV_CREATE_PIPE | UV_WRITABLE_PIPE);
    stdio[2].data.stream = (uv_stream_t *)&rp->err.pipe;
    uv_process_options_t po;
    memset(&po, 0, sizeof po);
    po.exit_cb = on_proc_exit;
    po.file = argv[0];
    po.args = (char **)argv;
    po.env = env;
    po.flags = UV_PROCESS_DETACHED; /* setsid: a process group per rank */
    po.stdio_count = 3;
    po.stdio = stdio;
    rp->proc.data = rp;
    /* born in its memory cgroup: the forking thread (v2: the launcher)
     * stands in it for the fork */
    char dir[PATH_MAX + 32];
    if (L->cg) {
        cg_dir(L, rp->rank, dir, sizeof dir);
        if (ts__cgroup_enter(L->cg, dir) != TS_OK) {
            snprintf(err, errcap, "%s", ts_last_error());
            rp->out.open = rp->err.open = false;
            L->open_pipes -= 2;
            uv_close((uv_handle_t *)&rp->out.pipe, NULL);
            uv_close((uv_handle_t *)&rp->err.pipe, NULL);
            return -1;
        }
    }
    int r = uv_spawn(&L->loop, &rp->proc, &po);
    /* the launcher must not go on under the rank's cap: when it cannot
     * leave the group, the job stops here */
    bool left = !L->cg || ts__cgroup_leave(L->cg) == TS_OK;
    if (!left) snprintf(err, errcap, "%s", ts_last_error());
    if (r != 0) {
        if (left) snprintf(err, errcap, "ts_launch: cannot start rank %d: '%s': %s", rp->rank, argv[0], uv_strerror(r));
        uv_close((uv_handle_t *)&rp->proc, NULL);
        rp->out.open = rp->err.open = false;
        L->open_pipes -= 2;
        uv_close((uv_handle_t *)&rp->out.pipe, NULL);
        uv_close((uv_handle_t *)&rp->err.pipe, NULL);
        return r;
    }
    rp->pid = rp->proc.pid;
    rp->running = true;
    watchdog_tell(L, (int32_t)rp->pid);
    L->running++;
    uv_read_start((uv_stream_t *)&rp->out.pipe, on_alloc, on_read);
    uv_read_start((uv_stream_t *)&rp->err.pipe, on_alloc, on_read);
    return left ? 0 : -1;
}

/* Removes the memory cgroups still there (a rank's children still
 * exiting, a failed start) and the job's directory, waiting up to 2 s for
 * killed processes to leave them; a group that stays is named in a
 * warning. Keeps the last error. */
static void remove_groups(launcher *L)
{
    struct timespec step = {0, 10 * 1000 * 1000};
    int tries = 200;
    for (int i = 0; L->ranks && i < L->n; i++) {
        if (!L->ranks[i].cg_live) continue;
        char dir[PATH_MAX + 32];
        cg_dir(L, L->o->node_rank * L->o->nproc_per_node + i, dir, sizeof dir);
        int e;
        while ((e = ts__cgroup_remove(dir)) == EBUSY && tries-- > 0) nanosleep(&step, NULL);
        if (e) ts_logf(TS_LOG_WARN, "ts_launch: cannot remove the memory cgroup '%s': %s", dir, strerror(e));
        L->ranks[i].cg_live = false;
    }
    int e = ts__cgroup_job_remove(L->cg);
    if (e) ts_logf(TS_LOG_WARN, "ts_launch: cannot remove the memory cgroup '%s': %s", L->cg->job, strerror(e));
    ts__free(TS_MEM_COMM, L->cg);
    L->cg = NULL;
}

ts_status ts_launch(const ts_launch_options *o, char *const *argv, ts_launch_result *result_out)
{
    ts_status s = check_options(o, argv);
    if (s) return s;
    char token[TS_LAUNCH_MAX_STR], run_id[TS_LAUNCH_MAX_STR];
    if (o->token && *o->token) snprintf(token, sizeof token, "%s", o->token);
    else if ((s = random_hex(token, 16))) return s;
    if (o->run_id && *o->run_id) snprintf(run_id, sizeof run_id, "%s", o->run_id);
    else if (o->nnodes > 1) snprintf(run_id, sizeof run_id, "tsrun-%s-%d", o->master_addr, o->master_port);
    else if ((s = random_hex(run_id, 8))) return s;
    char ip[INET_ADDRSTRLEN + 1] = "";
    if (o->node_rank == 0 && (s = bind_address(o->master_addr, ip, sizeof ip))) return s;

    /* the memory cgroups' directory, before the watchdog (which removes it
     * should the launcher die); nothing it opens stays open */
    ts__cgroup_job *cg = NULL;
    if (o->memory_per_rank > 0) {
        if (!(cg = ts__calloc(TS_MEM_COMM, 1, sizeof *cg))) return TS_ERR_NO_MEMORY;
        if ((s = ts__cgroup_job_init(cg, o->memory_per_rank))) {
            ts__free(TS_MEM_COMM, cg);
            return s;
        }
    }
    /* forked first: before anything else starts threads, opens descriptors
     * or allocates memory the child would keep */
    int watchdog_fd;
    pid_t watchdog =
        watchdog_start(o->nproc_per_node, cg ? cg->job : "", o->node_rank * o->nproc_per_node, &watchdog_fd);
    launcher *L = ts__calloc(TS_MEM_COMM, 1, sizeof *L);
    if (!L) {
        if (watchdog > 0) {
            close(watchdog_fd);
            waitpid(watchdog, NULL, 0);
        }
        if (cg) ts__cgroup_job_remove(cg);
        ts__free(TS_MEM_COMM, cg);
        return TS_ERR_NO_MEMORY;
    }
    L->o = o;
    L->n = o->nproc_per_node;
    L->failed_rank = -1;
    L->oom_rank = -1;
    L->cg = cg;
    L->watchdog_fd = watchdog_fd;
    ts_store_server *server = NULL;
    env_builder env = {0};
    char **rank_env = NULL;
    char spawn_err[1024] = "";
    bool failed_spawn = false;
    int port = o->master_port;
    L->ranks = ts__calloc(TS_MEM_COMM, (size_t)L->n, sizeof *L->ranks);
    if (!L->ranks) {
        s = TS_ERR_NO_MEMORY;
        goto out;
    }
    for (int i = 0; i < L->n; i++) L->ranks[i].log_fd = -1;
    if (o->log_dir && (s = open_logs(L))) goto out;
    for (int i = 0; cg && i < L->n; i++) {
        char dir[PATH_MAX + 32];
        if ((s = ts__cgroup_rank_create(cg, o->node_rank * o->nproc_per_node + i, dir, sizeof dir))) goto out;
        L->ranks[i].cg_live = true;
    }
    /* node 0 hosts the store for the whole job */
    if (o->node_rank == 0) {
        if ((s = ts_store_server_start(ip, o->master_port, token, &server))) goto out;
        port = ts_store_server_port(server);
        /* the launcher's own client, recording the ranks' exits */
        L->run_id = run_id;
        if (ts_store_connect(ip, port, token, 5.0, &L->store) == TS_OK) ts_store_set_timeout(L->store, 5.0);
        else
            ts_logf(TS_LOG_WARN,
                    "ts_launch: cannot connect to its own store (%s); a rank that exits before the "
                    "rendezvous will not be reported to the others",
                    ts_last_error());
    }
    if ((s = build_env(&env, o, port, token, run_id))) goto out;
    rank_env = ts__malloc(TS_MEM_COMM, (env.n + 1) * sizeof *rank_env);
    if (!rank_env) {
        s = TS_ERR_NO_MEMORY;
        goto out;
    }
    int r = uv_loop_init(&L->loop);
    if (r) {
        s = ts_error(TS_ERR_IO, "ts_launch: uv_loop_init: %s", uv_strerror(r));
        goto out;
    }
    uv_timer_init(&L->loop, &L->grace);
    uv_timer_init(&L->loop, &L->drain);
    uv_timer_init(&L->loop, &L->notice);
    L->grace.data = L->drain.data = L->notice.data = L;
    if (o->forward_signals) {
        static const int sigs[] = {SIGINT, SIGTERM, SIGHUP};
        for (int i = 0; i < 3; i++) {
            uv_signal_init(&L->loop, &L->sig[i]);
            L->sig[i].data = L;
            L->nsig++;
            uv_signal_start(&L->sig[i], on_signal, sigs[i]);
        }
    }
    for (int i = 0; i < L->n; i++) {
        char rank_s[32], local_s[32];
        snprintf(rank_s, sizeof rank_s, "RANK=%d", o->node_rank * o->nproc_per_node + i);
        snprintf(local_s, sizeof local_s, "LOCAL_RANK=%d", i);
        memcpy(rank_env, env.v, (env.n + 1) * sizeof *rank_env);
        rank_env[0] = rank_s;
        rank_env[1] = local_s;
        if (spawn_rank(L, i, argv, rank_env, spawn_err, sizeof spawn_err) != 0) {
            /* the ranks started already go, and are reaped below */
            failed_spawn = true;
            start_stopping(L, SIGKILL);
            break;
        }
    }
    maybe_finish(L);
    uv_run(&L->loop, UV_RUN_DEFAULT);
    r = uv_loop_close(&L->loop);
    TS_ASSERT(r == 0);

    if (failed_spawn) {
        s = TS_ERR_IO;
    } else {
        ts_launch_result res = {
            .exit_code = 0,
            .failed_rank = L->failed_rank,
            .failed_signal = L->failed_signal,
            .received_signal = L->received_signal,
            .master_port = port,
        };
        res.hung_rank = -1;
        res.oom_rank = L->oom_rank;
        res.oom_peak_bytes = L->oom_rank >= 0 ? L->oom_peak : -1;
        snprintf(res.oom_message, sizeof res.oom_message, "%s", L->oom_rank >= 0 ? L->oom_message : "");
        if (L->failed_rank >= 0) read_hung(L, &res);
        if (L->failed_rank >= 0) res.exit_code = L->failed_code;
        else if (L->received_signal) res.exit_code = 128 + L->received_signal;
        if (result_out) *result_out = res;
    }
out:
    ts_store_close(L->store);
    ts_store_server_stop(server);
    if (cg) remove_groups(L);
    watchdog_stop(L, watchdog);
    for (int i = 0; L->ranks && i < L->n; i++) {
        ts__free(TS_MEM_COMM, L->ranks[i].out.carry);
        ts__free(TS_MEM_COMM, L->ranks[i].err.carry);
        if (L->ranks[i].log_fd >= 0) close(L->ranks[i].log_fd);
    }
    ts__free(TS_MEM_COMM, rank_env);
    env_free(&env);
    ts__free(TS_MEM_COMM, L->line);
    ts__free(TS_MEM_COMM, L->ranks);
    ts__free(TS_MEM_COMM, L);
    if (failed_spawn) /* recorded last: cleanup must not overwrite the detail */
        ts_error(TS_ERR_IO, "%s", spawn_err);
    return s;
}
