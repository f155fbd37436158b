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
    if (extra <= 0 || log->n + extra <= log->cap) return TS_OK;
    if (extra > INT32_MAX / 2 - log->n)
        return ts_error(TS_ERR_NO_MEMORY, "deferred init: too many events (%d + %d)", log->n, extra);
    int cap = log->cap ? 2 * log->cap : 4;
    while (cap < log->n + extra) cap *= 2;
    ts__init_event *e = ts__malloc(TS_MEM_TENSOR, (size_t)cap * sizeof *e);
    if (!e) return ts_error(TS_ERR_NO_MEMORY, "deferred init: cannot allocate %d events", cap);
    if (log->n) memcpy(e, log->events, (size_t)log->n * sizeof *e);
    ts__free(TS_MEM_TENSOR, log->events);
    log->events = e;
    log->cap = cap;
    return TS_OK;
}

ts_status ts__init_log_append(ts__init_log *log, const ts__init_event *events, int n)
{
    if (!log || n <= 0) return TS_OK;
    ts_status st = log_reserve(log, n);
    if (st) return st;
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
    if (!log) return;
    ts__free(TS_MEM_TENSOR, log->events);
    log->events = NULL;
    log->n = log->cap = 0;
}

ts_status ts__init_record(const char *op, const ts_tensor *t, ts__init_kind kind, double a, double b, ts_generator *gen)
{
    int64_t n = ts__numel(t->ndim, t->shape);
    if (n == 0) return TS_OK;
    ts__init_event ev = {.kind = kind,
                         .a = a,
                         .b = b,
                         .gen = gen,
                         .owner = gen ? gen : ts_default_generator(),
                         .dtype = t->dtype,
                         .ndim = t->ndim,
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
    if (n_out) *n_out = n;
    return n ? s->init_log.events : NULL;
}

ts_status ts__init_events_move(ts_storage *dst, ts_storage *src)
{
    if (!dst || !src || dst == src || src->init_log.n == 0) return TS_OK;
    if (dst->init_log.n == 0) { /* hand the array over */
        ts__init_log_fini(&dst->init_log);
        dst->init_log = src->init_log;
        src->init_log = (ts__init_log){0};
        return TS_OK;
    }
    ts_status st = ts__init_log_append(&dst->init_log, src->init_log.events, src->init_log.n);
    if (!st) ts__init_log_fini(&src->init_log);
    return st;
}

ts_status ts__init_events_repeat(ts_storage *dst, const ts_storage *src)
{
    if (!dst || !src || dst == src) return TS_OK;
    ts__init_log log = {0};
    ts_status st = log_reserve(&log, src->init_log.n);
    if (st) return st;
    for (int i = 0; i < src->init_log.n; i++) {
        ts__init_event ev = src->init_log.events[i];
        if (ev.kind != TS__INIT_FILL && !ev.repeat_of) ev.repeat_of = ev.seq;
        ev.seq = (uint64_t)atomic_fetch_add(&next_seq, 1);
        log.events[log.n++] = ev;
    }
    ts__init_log_fini(&dst->init_log);
    dst->init_log = log;
    return TS_OK;
}

void ts__init_events_clear(ts_storage *s)
{
    if (s) ts__init_log_fini(&s->init_log);
}

/* ------------------------------------------------------------- orphans */

static pthread_mutex_t orphan_mu = PTHREAD_MUTEX_INITIALIZER;
static ts__init_log orphans;

void ts__init_storage_drop(ts_storage *s)
{
    if (!s || s->init_log.n == 0) return;
    ts__init_log *log = &s->init_log;
    int kept = 0;
    for (int i = 0; i < log->n; i++)
        if (log->events[i].kind != TS__INIT_FILL && !log->events[i].repeat_of) log->events[kept++] = log->events[i];
    if (kept) {
        pthread_mutex_lock(&orphan_mu);
        /* out of memory: the draws are lost, and a later replay of this
         * recording advances the generator less than the eager run did */
        if (ts__init_log_append(&orphans, log->events, kept)) ts_clear_error();
        pthread_mutex_unlock(&orphan_mu);
    }
    ts__init_log_fini(log);
}

ts_status ts__init_orphans_take(uint64_t seq_begin, uint64_t seq_end, ts__init_log *out)
{
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts__init_orphans_take: out is NULL");
    const ts_generator *mine = ts_default_generator();
#define TAKE(e) ((e)->seq >= seq_begin && (e)->seq < seq_end && ((e)->gen || (e)->owner == mine))
    pthread_mutex_lock(&orphan_mu);
    int n = 0;
    for (int i = 0; i < orphans.n; i++) n += TAKE(&orphans.events[i]);
    ts_status st = log_reserve(out, n);
    if (!st && n) {
        int kept = 0;
        for (int i = 0; i < orphans.n; i++) {
            const ts__init_event *e = &orphans.events[i];
            if (TAKE(e)) st = ts__init_log_append(out, e, 1); /* reserved: cannot fail */
            else orphans.events[kept++] = *e;
        }
        orphans.n = kept;
        if (kept == 0) ts__init_log_fini(&orphans);
    }
    pthread_mutex_unlock(&orphan_mu);
#undef TAKE
    return st;
}

/* ------------------------------------------------------------- replay of a model */

/* The generator states saved for repeat events: one per source seq. */
typedef struct state_snapshot {
    uint64_t seq;
    bool taken;
    uint8_t state[TS_GENERATOR_STATE_BYTES];
} state_snapshot;

typedef struct snapshots {
    state_snapshot *items;
    int n;
} snapshots;

static state_snapshot *snapshot_find(snapshots *s, uint64_t seq)
{
    for (int i = 0; i < s->n; i++)
        if (s->items[i].seq == seq) return &s->items[i];
    return NULL;
}

/* One snapshot slot per distinct source of the targets' repeat events. */
static ts_status snapshots_plan(snapshots *s, int n, const ts__init_target *targets)
{
    int cap = 0;
    for (int i = 0; i < n; i++)
        for (int j = 0; targets[i].log && j < targets[i].log->n; j++) cap += targets[i].log->events[j].repeat_of != 0;
    if (cap == 0) return TS_OK;
    s->items = ts__malloc(TS_MEM_OTHER, (size_t)cap * sizeof *s->items);
    if (!s->items)
        return ts_error(TS_ERR_NO_MEMORY, "ts__init_replay_targets: cannot allocate %d generator states", cap);
    for (int i = 0; i < n; i++)
        for (int j = 0; targets[i].log && j < targets[i].log->n; j++) {
            uint64_t src = targets[i].log->events[j].repeat_of;
            if (src && !snapshot_find(s, src)) s->items[s->n++] = (state_snapshot){.seq = src};
        }
    return TS_OK;
}

/* A repeat: the source's draws again from the state the source started
 * from, then the generator as it was. */
static ts_status replay_repeat(snapshots *s, const ts__init_event *ev, const ts__init_target *t)
{
    state_snapshot *ss = snapshot_find(s, ev->repeat_of);
    if (!ss || !ss->taken)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "ts__init_replay_targets: event %llu repeats event %llu, which is "
                        "not among the targets' events before it (replay the copied tensor's storage too)",
                        (unsigned long long)ev->seq, (unsigned long long)ev->repeat_of);
    uint8_t *now = ts__malloc(TS_MEM_OTHER, TS_GENERATOR_STATE_BYTES);
    if (!now) return ts_error(TS_ERR_NO_MEMORY, "ts__init_replay_targets: cannot allocate a generator state");
    ts_generator_get_state(ev->gen, now);
    ts_status st = ts_generator_set_state(ev->gen, ss->state);
    ts__init_event src = *ev;
    src.repeat_of = 0;
    if (!st) st = ts__init_replay(&src, t->elem_begin, t->elem_end, t->dst_dtype, t->dst);
    ts_status rs = ts_generator_set_state(ev->gen, now);
    ts__free(TS_MEM_OTHER, now);
    return st ? st : rs;
}

ts_status ts__init_replay_targets(int n, const ts__init_target *targets)
{
    if (n < 0 || (n > 0 && !targets))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts__init_replay_targets: %d targets%s", n,
                        n < 0 ? "" : " and targets is NULL");
    if (n == 0) return TS_OK;
    int *next = ts__calloc(TS_MEM_OTHER, (size_t)n, sizeof *next);
    if (!next) return ts_error(TS_ERR_NO_MEMORY, "ts__init_replay_targets: cannot allocate %d cursors", n);
    snapshots snap = {0};
    ts_status st = snapshots_plan(&snap, n, targets);
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
        if (best < 0 || st) break;
        const ts__init_target *t = &targets[best];
        const ts__init_event *ev = &t->log->events[next[best]++];
        if (ev->repeat_of) {
            st = replay_repeat(&snap, ev, t);
        } else {
            state_snapshot *ss = snapshot_find(&snap, ev->seq);
            if (ss) {
                ts_generator_get_state(ev->gen, ss->state);
                ss->taken = true;
            }
            st = ts__init_replay(ev, t->elem_begin, t->elem_end, t->dst_dtype, t->dst);
        }
        if (st) break;
    }
    ts__free(TS_MEM_OTHER, snap.items);
    ts__free(TS_MEM_OTHER, next);
    return st;
}
