#define _GNU_SOURCE
#include "base/base.h"

#include <errno.h>
#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* Spans are appended to a per-thread list of fixed-size chunks; all
 * threads' buffers hang off one global list so that flush can walk them. */
#define SPANS_PER_CHUNK 4096

typedef struct span {
    const char *name;
    const char *cat;
    uint64_t start_ns, end_ns;
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
    char name[32];
} thread_buf;

static atomic_int enabled;
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static thread_buf *g_bufs;
static char *g_path;
static int g_next_tid = 1;
static uint64_t g_origin_ns;
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
    if (tl_buf)
        return tl_buf;
    thread_buf *b = calloc(1, sizeof *b);
    if (!b)
        return NULL;
    pthread_mutex_init(&b->lock, NULL);
    pthread_mutex_lock(&g_lock);
    b->tid = g_next_tid++;
    snprintf(b->name, sizeof b->name, "thread %d", b->tid);
    b->next = g_bufs;
    g_bufs = b;
    pthread_mutex_unlock(&g_lock);
    tl_buf = b;
    return b;
}

void ts_trace_thread_name(const char *name)
{
    thread_buf *b = my_buf();
    if (!b || !name)
        return;
    pthread_mutex_lock(&b->lock);
    snprintf(b->name, sizeof b->name, "%s", name);
    pthread_mutex_unlock(&b->lock);
}

void ts_trace_span(const char *name, const char *cat, uint64_t start_ns, uint64_t end_ns)
{
    if (!ts_trace_enabled())
        return;
    thread_buf *b = my_buf();
    if (!b)
        return;
    pthread_mutex_lock(&b->lock);
    if (!b->tail || b->tail->n == SPANS_PER_CHUNK) {
        chunk *c = malloc(sizeof *c);
        if (!c) {
            pthread_mutex_unlock(&b->lock);
            return;
        }
        c->next = NULL;
        c->n = 0;
        if (b->tail)
            b->tail->next = c;
        else
            b->head = c;
        b->tail = c;
    }
    b->tail->spans[b->tail->n++] = (span){name, cat ? cat : "ts", start_ns, end_ns};
    pthread_mutex_unlock(&b->lock);
}

static void clear_spans_locked(void)
{
    for (thread_buf *b = g_bufs; b; b = b->next) {
        pthread_mutex_lock(&b->lock);
        for (chunk *c = b->head, *n; c; c = n) {
            n = c->next;
            free(c);
        }
        b->head = b->tail = NULL;
        pthread_mutex_unlock(&b->lock);
    }
}

static void at_exit_flush(void)
{
    if (ts_trace_enabled())
        ts_trace_stop(true);
}

ts_status ts_trace_start(const char *path)
{
    if (!path || !*path)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_trace_start: the trace file path is empty");
    char *p = strdup(path);
    if (!p)
        return ts_error(TS_ERR_NO_MEMORY, "ts_trace_start: out of memory");
    static bool registered;
    pthread_mutex_lock(&g_lock);
    free(g_path);
    g_path = p;
    if (!g_origin_ns)
        g_origin_ns = ts_now_ns();
    if (!registered) {
        registered = true;
        atexit(at_exit_flush);
    }
    pthread_mutex_unlock(&g_lock);
    atomic_store(&enabled, 1);
    return TS_OK;
}

__attribute__((constructor)) static void trace_from_env(void)
{
    const char *p = getenv("TS_TRACE");
    if (p && *p)
        ts_trace_start(p);
}

ts_status ts_trace_flush(void)
{
    pthread_mutex_lock(&g_lock);
    if (!g_path) {
        pthread_mutex_unlock(&g_lock);
        return ts_error(TS_ERR_STATE, "ts_trace_flush: tracing was never started (set TS_TRACE=FILE "
                                      "or call ts_trace_start)");
    }
    json_t *events = json_array();
    int pid = (int)getpid();
    for (thread_buf *b = g_bufs; b; b = b->next) {
        pthread_mutex_lock(&b->lock);
        json_array_append_new(events, json_pack("{s:s, s:s, s:i, s:i, s:{s:s}}", "name", "thread_name", "ph",
                                                "M", "pid", pid, "tid", b->tid, "args", "name", b->name));
        for (chunk *c = b->head; c; c = c->next)
            for (int i = 0; i < c->n; i++) {
                const span *s = &c->spans[i];
                double ts = (double)(int64_t)(s->start_ns - g_origin_ns) / 1000.0;
                double dur = (double)(s->end_ns - s->start_ns) / 1000.0;
                json_array_append_new(events,
                                      json_pack("{s:s, s:s, s:s, s:f, s:f, s:i, s:i}", "name", s->name, "cat",
                                                s->cat, "ph", "X", "ts", ts, "dur", dur, "pid", pid, "tid",
                                                b->tid));
            }
        pthread_mutex_unlock(&b->lock);
    }
    json_t *root = json_pack("{s:o, s:s}", "traceEvents", events, "displayTimeUnit", "ms");
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", g_path);
    ts_status st = TS_OK;
    if (!root || json_dump_file(root, tmp, JSON_COMPACT) != 0) {
        st = ts_error(TS_ERR_IO, "ts_trace_flush: cannot write trace file '%s': %s", tmp, strerror(errno));
    } else if (rename(tmp, g_path) != 0) {
        st = ts_error(TS_ERR_IO, "ts_trace_flush: cannot rename '%s' to '%s': %s", tmp, g_path, strerror(errno));
        unlink(tmp);
    }
    json_decref(root);
    pthread_mutex_unlock(&g_lock);
    return st;
}

ts_status ts_trace_stop(bool flush)
{
    ts_status st = TS_OK;
    if (flush)
        st = ts_trace_flush();
    atomic_store(&enabled, 0);
    pthread_mutex_lock(&g_lock);
    clear_spans_locked();
    pthread_mutex_unlock(&g_lock);
    return st;
}

uint64_t ts_trace_total_ns(const char *name)
{
    uint64_t total = 0;
    pthread_mutex_lock(&g_lock);
    for (thread_buf *b = g_bufs; b; b = b->next) {
        pthread_mutex_lock(&b->lock);
        for (chunk *c = b->head; c; c = c->next)
            for (int i = 0; i < c->n; i++)
                if (strcmp(c->spans[i].name, name) == 0)
                    total += c->spans[i].end_ns - c->spans[i].start_ns;
        pthread_mutex_unlock(&b->lock);
    }
    pthread_mutex_unlock(&g_lock);
    return total;
}
