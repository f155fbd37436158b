#define _GNU_SOURCE
/*
 * Worlds: making and freeing one (its communication thread, its notices,
 * the pinned-memory registrar), failing one from outside, its store, its
 * knobs, the published world, and the accessors of a group's counters
 * (comm/comm_internal.h). Calls progress.c, ops.c, debug.c.
 */
#include "comm/store.h"
#include "comm/world_internal.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

/* ------------------------------------------------------------------ */
/* Worlds                                                              */
/* ------------------------------------------------------------------ */
void ts__comm_set_timeout(ts_comm *c, double timeout_s)
{
    if (c && c->w && timeout_s > 0) atomic_store(&c->w->deadline_s, timeout_s);
}

void ts__comm_set_check(ts_comm *c, bool on)
{
    if (c && c->w) atomic_store(&c->w->check, on);
}

void ts__comm_set_fp_inline(ts_comm *c, size_t bytes)
{
    if (c && c->w) atomic_store(&c->w->fp_inline, bytes < FP_INLINE_CAP ? bytes : FP_INLINE_CAP);
}

static ts_comm g_local = {
    .w = NULL,
    .rank = 0,
    .size = 1,
    .gid = 0,
    .seq = 0,
    .stats_mu = PTHREAD_MUTEX_INITIALIZER,
};

/* The world ts_dist_init published (NULL when none); world.c owns it,
 * dist.c only sets it (comm_internal.h). */
static _Atomic(ts_comm *) g_published;

void ts__world_publish(ts_comm *w) { atomic_store(&g_published, w); }

ts_comm *ts__world_published(void) { return atomic_load(&g_published); }

ts_comm *ts_comm_world(void)
{
    ts_comm *d = ts__world_published(); /* the world of ts_dist_init, if any */
    return d ? d : &g_local;
}

int ts_comm_rank(const ts_comm *c) { return c ? c->rank : -1; }
int ts_comm_size(const ts_comm *c) { return c ? c->size : -1; }

void ts_comm_stats(ts_comm *c, ts_comm_counters *out)
{
    if (!c || !out) return;
    pthread_mutex_lock(&c->stats_mu);
    *out = c->stats;
    pthread_mutex_unlock(&c->stats_mu);
}

void ts_comm_stats_reset(ts_comm *c)
{
    if (!c) return;
    pthread_mutex_lock(&c->stats_mu);
    memset(&c->stats, 0, sizeof c->stats);
    pthread_mutex_unlock(&c->stats_mu);
}

/* ts__world_new's first step: w and c (zeroed, w's eventfd open) as a
 * world of t's ranks, the knobs read, the locks made. */
static void world_init(world *w, ts_comm *c, ts_transport *t, double timeout_s)
{
    w->t = t;
    w->comm = c;
    w->timeout_s = timeout_s > 0 ? timeout_s : 300.0;
    (void)ts__dist_debug_level(); /* a bad TS_DISTRIBUTED_DEBUG is a warning now */
    atomic_init(&w->deadline_s, w->timeout_s);
    atomic_init(&w->check, ts__comm_check_default());
    atomic_init(&w->fp_inline, ts__comm_fp_inline_max());
    w->suspect = -1;
    atomic_init(&w->next_gid, 1);
    atomic_init(&w->queued, false);
    atomic_init(&w->stop, false);
    atomic_init(&w->driving, 0);
    atomic_init(&w->live, 0);
    atomic_init(&w->traced, false);
    atomic_init(&w->caller_ns, 0);
    atomic_init(&w->sleeping, false);
    atomic_init(&w->deferring, false);
    atomic_init(&w->by_callers, 0);
    atomic_init(&w->by_thread, 0);
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    pthread_mutex_init(&w->prog_mu, NULL);
    c->w = w;
    c->rank = t->rank;
    c->size = t->size;
    pthread_mutex_init(&c->stats_mu, NULL);
}

/* ts__world_new's second step for a world of 2 ranks or more: the notice
 * slots and the communication thread; on failure, undoes world_init and
 * frees w and c. */
/* What world_init made, and the two blocks: the end of ts__world_free and
 * of a world whose thread could not start. */
static void world_release(world *w, ts_comm *c)
{
    ts__free(TS_MEM_COMM, w->nslots);
    ts__free(TS_MEM_COMM, w->nout);
    close(w->efd);
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->prog_mu);
    pthread_mutex_destroy(&c->stats_mu);
    ts__free(TS_MEM_COMM, w);
    ts__free(TS_MEM_COMM, c);
}

static ts_status world_start_thread(world *w, ts_comm *c, ts_transport *t)
{
    w->nslots = ts__calloc(TS_MEM_COMM, (size_t)t->size, sizeof *w->nslots);
    w->nout = ts__calloc(TS_MEM_COMM, 1, sizeof *w->nout);
    if (!w->nslots || !w->nout || pthread_create(&w->thread, NULL, ts__comm_thread_main, w) != 0) {
        bool mem = !w->nslots || !w->nout;
        world_release(w, c);
        if (mem) return ts_error(TS_ERR_NO_MEMORY, "ts__world_new: out of memory");
        return ts_error(TS_ERR_INTERNAL, "ts__world_new: cannot start the communication thread");
    }
    w->has_thread = true;
    return TS_OK;
}

ts_status ts__world_new(ts_transport *t, double timeout_s, ts_comm **world_out)
{
    if (!t || !world_out) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts__world_new: NULL argument");
    if (t->size > 128)
        return ts_error(TS_ERR_UNSUPPORTED, "ts__world_new: %d ranks; the tag layout allows 128", t->size);
    ts_comm *c = ts__calloc(TS_MEM_COMM, 1, sizeof *c);
    world *w = ts__calloc(TS_MEM_COMM, 1, sizeof *w);
    if (!c || !w) {
        ts__free(TS_MEM_COMM, c);
        ts__free(TS_MEM_COMM, w);
        return TS_ERR_NO_MEMORY;
    }
    w->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (w->efd < 0) {
        ts__free(TS_MEM_COMM, c);
        ts__free(TS_MEM_COMM, w);
        return ts_error(TS_ERR_IO, "ts__world_new: eventfd: %s", strerror(errno));
    }
    world_init(w, c, t, timeout_s);
    if (t->size > 1) {
        ts_status st = world_start_thread(w, c, t);
        if (st != TS_OK) return st;
    }
    /* the first world over a transport with a memory map registers the
     * pinned memory of the process (base.h) from now on */
    if (t->vt->mem_register && t->vt->mem_deregister) {
        ts__pin_registrar r = {ts__comm_pin_register, ts__comm_pin_deregister, w};
        w->registrar = ts__pin_registrar_set(&r) == TS_OK;
        if (!w->registrar) ts_clear_error();
    }
    *world_out = c;
    return TS_OK;
}

void ts__world_set_fail_hook(ts_comm *c, ts__world_fail_hook hook, void *arg)
{
    if (!c || !c->w) return;
    ts__comm_prog_lock(c->w);
    c->w->fail_hook = hook;
    c->w->fail_hook_arg = arg;
    ts__comm_prog_unlock(c->w);
}

void ts__world_fail(ts_comm *c, ts_status st, const char *msg)
{
    if (!c || c == &g_local || !c->w || st >= 0) return;
    world *w = c->w;
    ts__comm_prog_lock(w);
    ts__comm_fail_later(w, st, msg, false);
    if (!w->has_thread) ts__comm_check_peers(w); /* nobody else runs a round */
    ts__comm_prog_unlock(w);
    if (w->has_thread) ts__comm_wake_thread(w);
}

ts_status ts__world_attach_store(ts_comm *c, ts_store *client, const char *prefix, const char *hung_key)
{
    if (!c || c == &g_local || !c->w || !client || !prefix) {
        ts_store_close(client);
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts__world_attach_store: no world, client or prefix");
    }
    world *w = c->w;
    ts__comm_prog_lock(w);
    ts_store_close(w->store);
    w->store = client;
    ts__comm_copy_str(w->store_prefix, sizeof w->store_prefix, prefix);
    ts__comm_copy_str(w->hung_key, sizeof w->hung_key, hung_key ? hung_key : "");
    ts__comm_prog_unlock(w);
    return TS_OK;
}

void ts__world_free(ts_comm *c)
{
    if (!c || c == &g_local) return;
    ts__error_quiet_begin(); /* a teardown: the error it follows keeps its detail (docs/design.md, D1) */
    ts__comm_log_summary(c);
    world *w = c->w;
    if (w->registrar) ts__pin_registrar_clear(w); /* while the thread still runs the deregistrations */
    if (w->has_thread) {
        atomic_store(&w->stop, true);
        ts__comm_wake_thread(w);
        pthread_join(w->thread, NULL);
    }
    w->t->vt->destroy(w->t); /* runs the notice receives' callbacks (cancelled) */
    ts_store_close(w->store);
    ts__comm_flush_traces(w); /* none left by the thread's last round; a thread-less world's */
    while (w->op_cache) {
        op *o = w->op_cache;
        w->op_cache = o->next;
        ts__free(TS_MEM_COMM, o->fpbuf);
        ts__free(TS_MEM_COMM, o);
    }
    world_release(w, c);
    ts__error_quiet_end();
}
void ts__comm_progress_stats(ts_comm *c, uint64_t *by_callers_out, uint64_t *by_thread_out)
{
    world *w = c ? c->w : NULL;
    if (by_callers_out) *by_callers_out = w ? atomic_load(&w->by_callers) : 0;
    if (by_thread_out) *by_thread_out = w ? atomic_load(&w->by_thread) : 0;
}

void ts__comm_count(ts_comm *c, ts_coll_kind kind, int64_t calls, int64_t bytes)
{
    if (!c || (unsigned)kind >= TS_COLL_KIND_COUNT) return;
    pthread_mutex_lock(&c->stats_mu);
    c->stats.calls[kind] += (uint64_t)calls;
    c->stats.bytes[kind] += (uint64_t)bytes;
    pthread_mutex_unlock(&c->stats_mu);
}

uint64_t ts__comm_gid(const ts_comm *c) { return c ? c->gid : 0; }

uint32_t ts__comm_next_seq(ts_comm *c)
{
    if (!c) return 0;
    pthread_mutex_lock(&c->stats_mu);
    uint32_t s = c->seq;
    pthread_mutex_unlock(&c->stats_mu);
    return s;
}

int ts__comm_world_rank(const ts_comm *c, int r) { return c && c->map ? c->map[r] : r; }

int ts__comm_peer_pid(ts_comm *c, int peer)
{
    if (!c || !c->w || peer < 0 || peer >= c->size || peer == c->rank || !c->w->t->vt->peer_pid) return 0;
    return c->w->t->vt->peer_pid(c->w->t, ts__comm_world_rank(c, peer));
}

void ts__comm_xfer_stats(ts_comm *c, uint64_t *posted_out, uint64_t *registered_out)
{
    uint64_t p = 0, r = 0;
    if (c && c->w && c->w->t->vt->xfer_stats) c->w->t->vt->xfer_stats(c->w->t, &p, &r);
    if (posted_out) *posted_out = p;
    if (registered_out) *registered_out = r;
}
