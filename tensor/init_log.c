/*
 * Deferred init's event logs ([Note: deferred init] in tensor/internal.h):
 * recording an initializer on a meta storage, the per-storage logs, the
 * orphans of freed storages. The replay itself is in tensor/rng.c, beside
 * the kernels whose draws it repeats.
 */
#include "tensor/internal.h"

#include <pthread.h>
#include <string.h>

static atomic_uint_fast64_t next_seq = 1;

uint64_t ts__init_seq_next(void) { return (uint64_t)atomic_load(&next_seq); }

static ts_status log_reserve(ts__init_log *log, int extra)
{
    if (extra <= 0 || log->n + extra <= log->cap)
        return TS_OK;
    if (extra > INT32_MAX / 2 - log->n)
        return ts_error(TS_ERR_NO_MEMORY, "deferred init: too many events (%d + %d)", log->n, extra);
    int cap = log->cap ? 2 * log->cap : 4;
    while (cap < log->n + extra)
        cap *= 2;
    ts__init_event *e = ts__malloc(TS_MEM_TENSOR, (size_t)cap * sizeof *e);
    if (!e)
        return ts_error(TS_ERR_NO_MEMORY, "deferred init: cannot allocate %d events", cap);
    if (log->n)
        memcpy(e, log->events, (size_t)log->n * sizeof *e);
    ts__free(TS_MEM_TENSOR, log->events);
    log->events = e;
    log->cap = cap;
    return TS_OK;
}

ts_status ts__init_log_append(ts__init_log *log, const ts__init_event *events, int n)
{
    if (!log || n <= 0)
        return TS_OK;
    ts_status st = log_reserve(log, n);
    if (st)
        return st;
    /* insertion from the back: the common case (appending later events)
     * moves nothing */
    for (int i = 0; i < n; i++) {
        int k = log->n++;
        while (k > 0 && log->events[k - 1].seq > events[i].seq) {
            log->events[k] = log->events[k - 1];
            k--;
        }
        log->events[k] = events[i];
    }
    return TS_OK;
}

void ts__init_log_fini(ts__init_log *log)
{
    if (!log)
        return;
    ts__free(TS_MEM_TENSOR, log->events);
    log->events = NULL;
    log->n = log->cap = 0;
}

ts_status ts__init_record(const char *op, const ts_tensor *t, ts__init_kind kind, double a, double b,
                          ts_generator *gen)
{
    int64_t n = ts__numel(t->ndim, t->shape);
    if (n == 0)
        return TS_OK;
    ts__init_event ev = {.kind = kind, .a = a, .b = b, .gen = gen, .dtype = t->dtype, .ndim = t->ndim,
                         .offset = t->offset};
    memcpy(ev.shape, t->shape, sizeof ev.shape);
    memcpy(ev.strides, t->strides, sizeof ev.strides);
    ts__init_log *log = &t->storage->init_log;
    if (log_reserve(log, 1))
        return ts_error(TS_ERR_NO_MEMORY, "%s: cannot record the initializer of a meta tensor (out of memory)", op);
    ev.seq = (uint64_t)atomic_fetch_add(&next_seq, 1);
    return ts__init_log_append(log, &ev, 1);
}

const ts__init_event *ts__init_events(const ts_storage *s, int *n_out)
{
    int n = s ? s->init_log.n : 0;
    if (n_out)
        *n_out = n;
    return n ? s->init_log.events : NULL;
}

ts_status ts__init_events_move(ts_storage *dst, ts_storage *src)
{
    if (!dst || !src || dst == src || src->init_log.n == 0)
        return TS_OK;
    if (dst->init_log.n == 0) { /* hand the array over */
        ts__init_log_fini(&dst->init_log);
        dst->init_log = src->init_log;
        src->init_log = (ts__init_log){0};
        return TS_OK;
    }
    ts_status st = ts__init_log_append(&dst->init_log, src->init_log.events, src->init_log.n);
    if (!st)
        ts__init_log_fini(&src->init_log);
    return st;
}

void ts__init_events_clear(ts_storage *s)
{
    if (s)
        ts__init_log_fini(&s->init_log);
}

/* ------------------------------------------------------------- orphans */

static pthread_mutex_t orphan_mu = PTHREAD_MUTEX_INITIALIZER;
static ts__init_log orphans;

void ts__init_storage_drop(ts_storage *s)
{
    if (!s || s->init_log.n == 0)
        return;
    ts__init_log *log = &s->init_log;
    int kept = 0;
    for (int i = 0; i < log->n; i++)
        if (log->events[i].kind != TS__INIT_FILL)
            log->events[kept++] = log->events[i];
    if (kept) {
        pthread_mutex_lock(&orphan_mu);
        /* out of memory: the draws are lost, and a later replay of this
         * recording advances the generator less than the eager run did */
        if (ts__init_log_append(&orphans, log->events, kept))
            ts_clear_error();
        pthread_mutex_unlock(&orphan_mu);
    }
    ts__init_log_fini(log);
}

ts_status ts__init_orphans_take(uint64_t seq_begin, uint64_t seq_end, ts__init_log *out)
{
    if (!out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts__init_orphans_take: out is NULL");
    pthread_mutex_lock(&orphan_mu);
    int n = 0;
    for (int i = 0; i < orphans.n; i++)
        n += orphans.events[i].seq >= seq_begin && orphans.events[i].seq < seq_end;
    ts_status st = log_reserve(out, n);
    if (!st && n) {
        int kept = 0;
        for (int i = 0; i < orphans.n; i++) {
            const ts__init_event *e = &orphans.events[i];
            if (e->seq >= seq_begin && e->seq < seq_end)
                st = ts__init_log_append(out, e, 1); /* reserved: cannot fail */
            else
                orphans.events[kept++] = *e;
        }
        orphans.n = kept;
        if (kept == 0)
            ts__init_log_fini(&orphans);
    }
    pthread_mutex_unlock(&orphan_mu);
    return st;
}

/* ------------------------------------------------------------- replay of a model */

ts_status ts__init_replay_targets(int n, const ts__init_target *targets)
{
    if (n < 0 || (n > 0 && !targets))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts__init_replay_targets: %d targets%s", n,
                        n < 0 ? "" : " and targets is NULL");
    if (n == 0)
        return TS_OK;
    int *next = ts__calloc(TS_MEM_OTHER, (size_t)n, sizeof *next);
    if (!next)
        return ts_error(TS_ERR_NO_MEMORY, "ts__init_replay_targets: cannot allocate %d cursors", n);
    ts_status st = TS_OK;
    /* a merge of n sorted lists by seq: the smallest head each time
     * (n is a model's parameter count; its events are few per parameter) */
    for (;;) {
        int best = -1;
        uint64_t best_seq = 0;
        for (int i = 0; i < n; i++) {
            const ts__init_log *l = targets[i].log;
            if (l && next[i] < l->n && (best < 0 || l->events[next[i]].seq < best_seq)) {
                best = i;
                best_seq = l->events[next[i]].seq;
            }
        }
        if (best < 0)
            break;
        const ts__init_target *t = &targets[best];
        st = ts__init_replay(&t->log->events[next[best]++], t->elem_begin, t->elem_end, t->dst_dtype, t->dst);
        if (st)
            break;
    }
    ts__free(TS_MEM_OTHER, next);
    return st;
}
