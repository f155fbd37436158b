#define _GNU_SOURCE
/*
 * The collectives' environment knobs (TS_COMM_SPIN_US,
 * TS_COMM_TAKEOVER_US, TS_COMM_FP_INLINE, TS_COMM_CHECK,
 * TS_DISTRIBUTED_DEBUG), the names of collectives and ops in messages,
 * the debug logs and the trace records (comm/world_internal.h).
 * Calls only base/ (and the public ts_comm_stats, for a group's summary).
 */
#include "comm/world_internal.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* How long the communication thread keeps polling the transport after its
 * last event before it sleeps in poll(): TS_COMM_SPIN_US (default 50; 0
 * sleeps at once). Sleeping costs a wake-up of several microseconds per
 * hand-off; spinning costs a core, which on a machine with fewer cores
 * than threads delays the other ranks. (A caller waiting in
 * ts_request_wait drives progress itself: see DRIVE_IDLE_NS.) */
#define SPIN_US_DEFAULT 50
/* dst (n bytes) = src, truncated. */
void ts__comm_copy_str(char *dst, size_t n, const char *src)
{
    size_t k = strlen(src);
    if (k >= n) k = n - 1;
    memcpy(dst, src, k);
    dst[k] = '\0';
}
/* How long the communication thread leaves progress to the callers after
 * a caller last ran a round of it (an asynchronous submission starts its
 * op itself; a waiting caller drives) before it takes over:
 * TS_COMM_TAKEOVER_US (default 200; 0: the thread takes over at once and
 * is woken by every asynchronous submission). Meanwhile the thread sleeps on
 * submissions only, not on the transport, so that a collective its caller
 * waits for soon (FSDP's prefetches of small groups) costs no hand-off
 * and no thread competing with the ranks' compute threads for the cores;
 * an op nobody drives is taken over after at most that delay. */
#define TAKEOVER_US_DEFAULT 200
static uint64_t g_spin_ns, g_takeover_ns;
static size_t g_fp_inline; /* TS_COMM_FP_INLINE (see Fingerprints) */
static size_t env_fp_inline(void);
static pthread_once_t g_spin_once = PTHREAD_ONCE_INIT;
static uint64_t env_us(const char *name, double dflt)
{
    const char *e = getenv(name);
    char *end = NULL;
    double us = e && *e ? strtod(e, &end) : dflt;
    if (!e || !*e || *end || !(us >= 0) || us > 1e6) us = dflt;
    return (uint64_t)(us * 1e3);
}
static void spin_init(void)
{
    g_spin_ns = env_us("TS_COMM_SPIN_US", SPIN_US_DEFAULT);
    g_takeover_ns = env_us("TS_COMM_TAKEOVER_US", TAKEOVER_US_DEFAULT);
    g_fp_inline = env_fp_inline();
}
uint64_t ts__comm_spin_ns(void)
{
    pthread_once(&g_spin_once, spin_init);
    return g_spin_ns;
}
uint64_t ts__comm_takeover_ns(void)
{
    pthread_once(&g_spin_once, spin_init);
    return g_takeover_ns;
}
size_t ts__comm_fp_inline_max(void)
{
    pthread_once(&g_spin_once, spin_init);
    return g_fp_inline;
}

/* TS_COMM_FP_INLINE: bytes (0 keeps every fingerprint apart; at most
 * FP_INLINE_CAP). Must be the same on every rank. */
static size_t env_fp_inline(void)
{
    const char *e = getenv("TS_COMM_FP_INLINE");
    char *end = NULL;
    double b = e && *e ? strtod(e, &end) : -1;
    if (!e || !*e || *end || !(b >= 0) || b > (double)FP_INLINE_CAP) {
        if (e && *e)
            ts_logf(TS_LOG_WARN, "TS_COMM_FP_INLINE=%s is not a byte count in [0, %zu]; using %zu", e,
                    (size_t)FP_INLINE_CAP, (size_t)FP_INLINE_DEFAULT);
        return FP_INLINE_DEFAULT;
    }
    return (size_t)b;
}
/* TS_COMM_CHECK=0: no fingerprints (see Fingerprints). */
bool ts__comm_check_default(void)
{
    const char *e = getenv("TS_COMM_CHECK");
    return !(e && strcmp(e, "0") == 0);
}
const char *const ts__comm_kind_names[TS_COLL_KIND_COUNT] = {"all_gather", "reduce_scatter", "all_reduce", "broadcast",
                                                             "barrier",    "all_to_all",     "send",       "recv"};
_Static_assert(TS_COLL_KIND_COUNT == 8, "one name per collective");

/* TS_DISTRIBUTED_DEBUG (comm.h): OFF, INFO or DETAIL, in any case; read
 * once, when the first world is made. */
enum { DEBUG_OFF, DEBUG_INFO, DEBUG_DETAIL };
static int g_debug;
static pthread_once_t g_debug_once = PTHREAD_ONCE_INIT;
static void debug_init(void)
{
    const char *e = getenv("TS_DISTRIBUTED_DEBUG");
    if (!e || !*e || strcasecmp(e, "OFF") == 0) g_debug = DEBUG_OFF;
    else if (strcasecmp(e, "INFO") == 0) g_debug = DEBUG_INFO;
    else if (strcasecmp(e, "DETAIL") == 0) g_debug = DEBUG_DETAIL;
    else ts_logf(TS_LOG_WARN, "TS_DISTRIBUTED_DEBUG=%s is not one of OFF, INFO, DETAIL (in any case); using OFF", e);
}
static int debug_level(void)
{
    pthread_once(&g_debug_once, debug_init);
    return g_debug;
}
int ts__dist_debug_level(void) { return debug_level(); }

/* TS_DISTRIBUTED_DEBUG=INFO (and DETAIL): a group's counters in one line
 * on stderr when it is freed. */
void ts__comm_log_summary(ts_comm *c)
{
    /* a memory estimate's virtual world and its groups are not the run's */
    if (debug_level() < DEBUG_INFO || !strcmp(c->w->t->vt->name, "virtual")) return;
    ts_comm_counters k;
    ts_comm_stats(c, &k);
    char line[1024];
    int n = snprintf(line, sizeof line, "[ts comm] group %llu rank %d/%d summary:", (unsigned long long)c->gid, c->rank,
                     c->size);
    bool any = false;
    for (int i = 0; i < TS_COLL_KIND_COUNT && n > 0 && (size_t)n < sizeof line; i++) {
        if (!k.calls[i]) continue;
        n += snprintf(line + n, sizeof line - (size_t)n, "%s %s %llu (%llu bytes)", any ? "," : "",
                      ts__comm_kind_names[i], (unsigned long long)k.calls[i], (unsigned long long)k.bytes[i]);
        any = true;
    }
    fprintf(stderr, "%s%s\n", line, any ? "" : " no collectives");
}

/* TS_DISTRIBUTED_DEBUG=DETAIL: one line per collective on stderr. */
void ts__comm_log_detail(const op *o, ts_status st)
{
    if (debug_level() < DEBUG_DETAIL) return;
    fprintf(stderr, "[ts comm] group %llu rank %d/%d #%u %s %zu bytes: %s in %.3f ms\n", (unsigned long long)o->gid,
            o->rank, o->W, o->seq, ts__comm_kind_names[o->kind], o->bytes, ts_status_name(st),
            (double)(ts_now_ns() - o->submit_ns) / 1e6);
}
/* TS_TRACE: the collective's span on the communication thread's track,
 * from submission to completion (base/base.h lists the args). A span
 * finished by a driving caller is kept (under prog_mu) until the
 * communication thread records it on its own track (ts__comm_flush_traces). */
typedef struct trace_rec {
    struct trace_rec *next;
    ts_coll_kind kind;
    size_t bytes;
    uint64_t gid, start_ns, end_ns;
    uint32_t seq;
    int rank;
    ts_status st;
} trace_rec;

/* The world whose communication thread this thread is (NULL: none). */
_Thread_local world *ts__comm_thread_world;

static void trace_rec_emit(const trace_rec *k)
{
    ts_trace_arg a[6] = {{"kind", ts__comm_kind_names[k->kind], 0},
                         {"bytes", NULL, (int64_t)k->bytes},
                         {"group", NULL, (int64_t)k->gid},
                         {"seq", NULL, (int64_t)k->seq},
                         {"rank", NULL, k->rank},
                         {"status", ts_status_name(k->st), 0}};
    ts_trace_span_args(ts__comm_kind_names[k->kind], "comm", k->start_ns, k->end_ns, 6, a);
}

void ts__comm_trace_op(world *w, const op *o, ts_status st)
{
    if (!ts_trace_enabled()) return;
    trace_rec k = {NULL, o->kind, o->bytes, o->gid, o->submit_ns, ts_now_ns(), o->seq, o->rank, st};
    if (ts__comm_thread_world == w) {
        trace_rec_emit(&k);
        return;
    }
    trace_rec *d = ts__malloc(TS_MEM_COMM, sizeof *d);
    if (!d) return; /* tracing drops what it cannot hold */
    *d = k;
    d->next = w->traces;
    w->traces = d;
    atomic_store(&w->traced, true);
}

/* On the communication thread, under prog_mu: records the spans drivers
 * left. */
void ts__comm_flush_traces(world *w)
{
    trace_rec *d = w->traces;
    w->traces = NULL;
    atomic_store(&w->traced, false);
    while (d) {
        trace_rec *n = d->next;
        trace_rec_emit(d);
        ts__free(TS_MEM_COMM, d);
        d = n;
    }
}
/* "all_gather #12 (group 3)" */
void ts__comm_op_name(const op *o, char *buf, size_t n)
{
    if (o->kind == TS_COLL_SEND || o->kind == TS_COLL_RECV)
        snprintf(buf, n, "%s (tag %llu)", ts__comm_kind_names[o->kind],
                 (unsigned long long)((o->tagbase >> 8) & SEQ_MASK));
    else if (o->gid)
        snprintf(buf, n, "%s #%u (group %llu)", ts__comm_kind_names[o->kind], o->seq, (unsigned long long)o->gid);
    else snprintf(buf, n, "%s #%u", ts__comm_kind_names[o->kind], o->seq);
}
