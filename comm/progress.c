#define _GNU_SOURCE
/*
 * Progress: waiting on requests, the progress lock and its rounds, the
 * callers that drive progress in ts_request_wait, and the world's
 * communication thread, whose loop runs as named phases (take-over
 * delay, park, round, sleep). The overview of who holds the lock when is
 * at the top of comm/world_internal.h.
 * Calls deadline.c, ops.c, debug.c and the transport's vtable.
 */
#include "comm/world_internal.h"

#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define BUSY_RETRIES 16 /* arm attempts the transport may refuse before a nap */
#define NAP_MIN_US 5    /* naps then double up to NAP_MAX_US while nothing happens */
#define NAP_MAX_US 100
/* How long the communication thread's nap grows to once nothing has
 * happened for NAP_LONG_AFTER_NS (short against any transfer that takes
 * that long). */
#define NAP_LONG_AFTER_NS 100000000ull
#define NAP_LONG_US 1000
/* How long a caller in ts_request_wait drives progress without events
 * before it sleeps after all (a peer that stopped, a long transfer): it
 * then costs no core, and the communication thread takes over. */
#define DRIVE_IDLE_NS 5000000ull
/* A driver polls without a pause for its first DRIVE_HOT_NS (a 4 KiB
 * collective takes 2-4 us), then yields its core to any other runnable
 * thread between rounds. On a loaded machine the scheduler often puts
 * both ranks' drivers on one core, where each exchange waits for the
 * other to yield: measured with both ranks on one core (taskset), a 4 KiB
 * all-reduce took a median 17-86 us with a 5 us window against 0.8-2 ms
 * with 50 us, and the same on separate cores (3.4-4.4 us at 4 KiB, 9-10
 * us at 64 KiB, 113-148 us at 1 MiB) whatever the window. */
#define DRIVE_HOT_NS 10000ull
#define DRIVE_BATCH 16
/* ------------------------------------------------------------------ */
/* Requests                                                            */
/* ------------------------------------------------------------------ */
static void drive(world *w, ts_request *r);

ts_status ts_request_wait(ts_request *r)
{
    if (!r) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_request_wait: NULL request");
    if (!atomic_load(&r->done)) drive(r->w, r); /* progress on this thread (see "Driving") */
    if (r->status != TS_OK) return ts_error(r->status, "%s", r->err);
    return TS_OK;
}

ts_status ts_request_test(ts_request *r, bool *done_out)
{
    if (!r || !done_out) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_request_test: NULL argument");
    *done_out = atomic_load(&r->done) != 0;
    return TS_OK;
}

ts_status ts_request_status(const ts_request *r)
{
    if (!r) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_request_status: the request is NULL");
    ts_request *m = (ts_request *)(uintptr_t)r;
    if (!atomic_load(&m->done)) return TS_ERR_STATE;
    return r->status;
}

void ts_request_free(ts_request *r)
{
    if (!r) return;
    if (!atomic_load(&r->done)) (void)ts_request_wait(r);
    ts__free(TS_MEM_COMM, r);
}
static void sweep(world *w)
{
    op **pp = &w->active;
    while (*pp) {
        op *o = *pp;
        if (o->finished) {
            *pp = o->next;
            ts__comm_op_free(o);
        } else {
            pp = &o->next;
        }
    }
}
/* ------------------------------------------------------------------ */
/* The progress lock                                                   */
/* ------------------------------------------------------------------ */

/* The world whose progress lock this thread holds (NULL: none). */
static _Thread_local world *tl_holding;

void ts__comm_prog_lock(world *w)
{
    pthread_mutex_lock(&w->prog_mu);
    tl_holding = w;
}

bool ts__comm_prog_trylock(world *w)
{
    if (pthread_mutex_trylock(&w->prog_mu) != 0) return false;
    tl_holding = w;
    return true;
}

void ts__comm_prog_unlock(world *w)
{
    tl_holding = NULL;
    pthread_mutex_unlock(&w->prog_mu);
}

void ts__comm_wake_thread(world *w)
{
    uint64_t one = 1;
    ssize_t wr = write(w->efd, &one, sizeof one);
    (void)wr; /* EAGAIN: the counter is non-zero already */
}

/* How long a rank whose transport found a dead peer waits for a notice
 * naming the rank that failed first (ops.c, "Failure notices"). */
#define PEER_GRACE_NS 300000000ull

/* The transport's dead peer, the grace period, the notices: fails the
 * world once it knows which rank failed first (see Failure notices, ops.c). */
void ts__comm_check_peers(world *w)
{
    ts_transport *t = w->t;
    if (w->failed) return;
    if (w->pend_st) {
        ts__comm_fail_world(w, w->pend_st, w->pend_msg, NULL, w->pend_notify, -1);
        return;
    }
    ts_status st = TS_OK;
    int dead = t->vt->failed_peer(t, &st);
    char why[ERR_LEN - 32] = "";
    if (dead >= 0) {
        snprintf(why, sizeof why, "%s", ts_last_error());
        ts__comm_suspect(w, dead);
    }
    if (w->suspect < 0) return;
    if (t->size > 2 && ts_now_ns() - w->suspect_ns < PEER_GRACE_NS) return;
    char msg[ERR_LEN];
    if (dead == w->suspect && why[0]) snprintf(msg, sizeof msg, "rank %d failed (%s)", dead, why);
    else snprintf(msg, sizeof msg, "rank %d failed (a transfer with it failed)", w->suspect);
    ts__comm_fail_world(w, TS_ERR_PEER_FAILED, msg, NULL, true, w->suspect);
}

/* Phase of a round: the ops submitted since the last round join the
 * active list and start (in a failed world, fail at once). Returns how
 * many. */
static int start_queued(world *w)
{
    int n = 0;
    if (atomic_load_explicit(&w->queued, memory_order_acquire)) {
        pthread_mutex_lock(&w->mu);
        op *q = w->queue;
        w->queue = w->queue_tail = NULL;
        atomic_store_explicit(&w->queued, false, memory_order_relaxed);
        pthread_mutex_unlock(&w->mu);
        while (q) {
            op *o = q;
            q = q->next;
            o->next = w->active;
            w->active = o;
            n++;
            if (w->failed) {
                o->err = w->failed;
                ts__comm_set_op_err(o, w->failed_msg);
                ts__comm_finish(o);
            } else {
                ts__comm_start_op(w, o);
            }
        }
    }
    return n;
}

/* One round of progress, under prog_mu: starts the queued ops, progresses
 * the transport (the ops' state machines run in its callbacks), checks
 * failures and (if `timers`: a clock read, which a driver spares most of
 * its rounds) deadlines, frees finished ops. Returns the events handled,
 * ops started included. */
int ts__comm_round(world *w, bool timers)
{
    if (!w->notices_posted) ts__comm_post_notices(w); /* once: a receive for each peer's notice */
    int n = start_queued(w);
    n += w->t->vt->progress(w->t);           /* the ops' state machines run in its callbacks */
    ts__comm_check_peers(w);                 /* dead peers, notices received */
    if (timers) ts__comm_check_deadlines(w); /* deadline.c */
    sweep(w);
    return n;
}
/* ------------------------------------------------------------------ */
/* Pinned-memory registration                                          */
/* ------------------------------------------------------------------ */

/* The transport belongs to the holder of the progress lock
 * (transport.h), so a registration of pinned memory (base.h's registrar,
 * installed while a world over a transport with a memory map lives) runs
 * under it, on the calling thread. */
static void run_locked(world *w, void (*fn)(ts_transport *t, void *arg), void *arg)
{
    if (tl_holding == w) { /* inside a round already */
        fn(w->t, arg);
        return;
    }
    ts__comm_prog_lock(w);
    fn(w->t, arg);
    ts__comm_prog_unlock(w);
}

typedef struct reg_call {
    void *addr;
    size_t len;
    void *handle;
    ts_status st;
    char err[ERR_LEN];
} reg_call;

static void do_register(ts_transport *t, void *arg)
{
    reg_call *c = arg;
    c->st = t->vt->mem_register(t, c->addr, c->len, &c->handle);
    if (c->st) snprintf(c->err, sizeof c->err, "%s", ts_last_error());
}

static void do_deregister(ts_transport *t, void *arg) { t->vt->mem_deregister(t, ((reg_call *)arg)->handle); }

ts_status ts__comm_pin_register(void *ctx, void *addr, size_t len, void **handle_out)
{
    reg_call c = {.addr = addr, .len = len};
    run_locked(ctx, do_register, &c);
    if (c.st) return ts_error(c.st, "%s", c.err);
    *handle_out = c.handle;
    return TS_OK;
}

void ts__comm_pin_deregister(void *ctx, void *handle)
{
    reg_call c = {.handle = handle};
    run_locked(ctx, do_deregister, &c);
}
/* ------------------------------------------------------------------ */
/* Driving                                                             */
/* ------------------------------------------------------------------ */

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}
void ts__comm_err_save(saved_err *e)
{
    e->st = ts_last_status();
    if (e->st != TS_OK) ts__comm_copy_str(e->msg, sizeof e->msg, ts_last_error());
}

/* only when it changed: formatting it again costs a microsecond */
void ts__comm_err_restore(const saved_err *e)
{
    if (e->st != TS_OK) {
        if (ts_last_status() != e->st || strcmp(ts_last_error(), e->msg) != 0) ts_error(e->st, "%s", e->msg);
    } else if (ts_last_status() != TS_OK) {
        ts_clear_error();
    }
}

/* ts_request_wait on a pending request: the caller runs rounds of
 * progress itself (see the top of comm/world_internal.h) until the request completes,
 * or until DRIVE_IDLE_NS pass without events; then it hands over to the
 * communication thread and sleeps on the condition variable. Whoever
 * holds the lock progresses every op of the world, so several callers
 * waiting at once take turns, and one's round may complete another's
 * request. While any caller drives, the communication thread parks (see
 * park); a driver that leaves ops behind wakes it. */
static void drive(world *w, ts_request *r)
{
    saved_err saved;
    ts__comm_err_save(&saved); /* the caller's own last error is kept */
    atomic_fetch_add(&w->driving, 1);
    uint64_t start = ts_now_ns(), last = start;
    bool held = false, fresh = false, hot = true;
    /* The lock is kept across rounds (released every DRIVE_BATCH rounds
     * for another driver, and around each yield), and the clock read
     * once per DRIVE_BATCH rounds: a clock read costs about as much as
     * an empty round (85 ns on a VM). */
    for (unsigned k = 1; !atomic_load_explicit(&r->done, memory_order_acquire); k++) {
        if (!held) held = ts__comm_prog_trylock(w);
        if (held && ts__comm_round(w, k % DRIVE_BATCH == 0) > 0) fresh = true;
        if (atomic_load_explicit(&r->done, memory_order_acquire)) break;
        if (k % DRIVE_BATCH == 0) {
            uint64_t now = ts_now_ns();
            atomic_store_explicit(&w->caller_ns, now, memory_order_relaxed);
            if (fresh) last = now;
            else if (now - last >= DRIVE_IDLE_NS) break;
            fresh = false;
            hot = now - start < DRIVE_HOT_NS;
            if (held && hot) {
                ts__comm_prog_unlock(w);
                held = false;
            }
        }
        if (hot) {
            cpu_relax();
        } else {
            if (held) ts__comm_prog_unlock(w);
            held = false;
            sched_yield();
        }
    }
    if (held) ts__comm_prog_unlock(w);
    bool done = atomic_load(&r->done) != 0;
    /* done: the thread keeps off a while more (the caller may wait again
     * soon); given up: the thread takes over now, not after its delay */
    atomic_store_explicit(&w->caller_ns, done ? ts_now_ns() : 0, memory_order_relaxed);
    atomic_fetch_sub(&w->driving, 1);
    /* hand over: the request itself, ops left behind (the thread may be
     * parked, or asleep on a worker armed before this caller's rounds,
     * which need not signal again: it would wait for its 10 ms timeout;
     * a thread waiting for its take-over looks at them by itself, soon),
     * spans to record on its track (it may sleep without a timeout) */
    if (!done || atomic_load(&w->traced) || (atomic_load(&w->live) > 0 && !atomic_load(&w->deferring)))
        ts__comm_wake_thread(w);
    if (!done) {
        pthread_mutex_lock(&w->mu);
        while (!atomic_load(&r->done)) pthread_cond_wait(&w->cv, &w->mu);
        pthread_mutex_unlock(&w->mu);
    }
    ts__comm_err_restore(&saved);
}
/* ------------------------------------------------------------------ */
/* The communication thread                                            */
/* ------------------------------------------------------------------ */

/* While callers drive, the thread stays off the lock: it sleeps on the
 * submission eventfd, which a driver writes when it leaves ops behind
 * (after it decremented `driving`: the eventfd then stays readable for a
 * thread that parks late), and at most 10 ms (the check is repeated). */
static void park(world *w)
{
    if (atomic_load(&w->driving) > 0 && !atomic_load(&w->stop)) {
        struct pollfd p = {.fd = w->efd, .events = POLLIN};
        struct timespec ten = {0, 10 * 1000000L};
        if (ppoll(&p, 1, &ten, NULL) > 0 && (p.revents & POLLIN)) {
            uint64_t cnt;
            ssize_t rd = read(w->efd, &cnt, sizeof cnt);
            (void)rd;
        }
    }
}

/* Before the take-over (ts__comm_takeover_ns): the thread sleeps `ns` on
 * submissions only (a stop, or a driver handing its request over, ends
 * it), then looks again. */
static void takeover_sleep(world *w, uint64_t ns)
{
    struct pollfd p = {.fd = w->efd, .events = POLLIN};
    struct timespec ts = {(time_t)(ns / 1000000000u), (long)(ns % 1000000000u)};
    atomic_store(&w->deferring, true);
    int rc = ppoll(&p, 1, &ts, NULL);
    atomic_store(&w->deferring, false);
    if (rc > 0 && (p.revents & POLLIN)) {
        uint64_t cnt;
        ssize_t rd = read(w->efd, &cnt, sizeof cnt);
        (void)rd;
    }
}

/* The communication thread's loop state (ts__comm_thread_main). */
typedef struct thread_loop {
    uint64_t spin, takeover; /* TS_COMM_SPIN_US, TS_COMM_TAKEOVER_US */
    uint64_t last_event;     /* when the thread last saw an event */
    int busy;                /* arm attempts the transport refused in a row */
    long nap_us;             /* the next nap while the transport cannot be armed */
} thread_loop;

/* Phase 1, the take-over delay: true (after a sleep on submissions) while
 * a caller ran a round less than l->takeover ago, progress being left to
 * the callers. */
static bool defer_to_callers(world *w, const thread_loop *l)
{
    uint64_t now = ts_now_ns(), lc = atomic_load_explicit(&w->caller_ns, memory_order_relaxed);
    if (lc && now - lc < l->takeover) {
        takeover_sleep(w, l->takeover - (now - lc));
        return true;
    }
    return false;
}

/* Phase 2: off the lock while callers drive (park); then spin a little
 * first, the drivers having been busy. */
static void park_while_driven(world *w, thread_loop *l)
{
    park(w);
    l->last_event = ts_now_ns();
    l->nap_us = NAP_MIN_US;
    l->busy = 0;
}

/* The last round of a world being freed, under the lock, which it
 * releases: fails what is still pending and records the spans left. */
static void stop_locked(world *w)
{
    if (w->active && !w->failed)
        ts__comm_fail_world(w, TS_ERR_COMM, "the world was freed with collectives pending", NULL, false, -1);
    sweep(w);
    ts__comm_flush_traces(w);
    ts__comm_prog_unlock(w);
}

/* Phase 4, idle past the spin: arms the transport and sleeps, releasing
 * the lock (held on entry). */
static void thread_sleep(world *w, thread_loop *l, uint64_t idle)
{
    ts_transport *t = w->t;
    bool armed = t->vt->arm(t) != TS_ERR_ALREADY;
    bool watch = w->active || (w->suspect >= 0 && !w->failed);
    int tfd = t->vt->wait_fd(t);
    /* about to sleep without a timeout: set under the lock, so that a
     * caller who starts an op after this round (submit) sees it */
    if (armed && !watch && tfd >= 0) atomic_store(&w->sleeping, true);
    ts__comm_prog_unlock(w);
    /* not armed: nap, below, after a few retries */
    if (!armed && ++l->busy < BUSY_RETRIES) return;
    l->busy = 0;
    /* Armed: sleep until the transport or a submission wakes us (10 ms
     * at most while collectives are pending, for deadlines and failure
     * checks). Not armed after BUSY_RETRIES tries: the transport keeps
     * reporting events that its progress does not consume (UCX 1.13
     * does so while rendezvous transfers wait on the peer), and spinning
     * on it took a core from the compute threads: nap on submissions
     * only, then progress again; the nap doubles from NAP_MIN_US to
     * NAP_MAX_US while nothing happens (NAP_LONG_US after NAP_LONG_AFTER_NS
     * without events), so that a long wait costs little CPU and a short
     * one little latency. A peer's death waiting out its grace period
     * keeps the timeout short too. A driver that arrives meanwhile
     * takes the lock at once; one that gives up writes the eventfd. */
    struct pollfd pfd[2] = {{.fd = w->efd, .events = POLLIN}, {.fd = tfd, .events = POLLIN}};
    int nfd = armed && pfd[1].fd >= 0 ? 2 : 1;
    struct timespec nap = {0, l->nap_us * 1000L}, ten = {0, 10 * 1000000L};
    long cap = idle >= NAP_LONG_AFTER_NS ? NAP_LONG_US : NAP_MAX_US;
    if (!armed) l->nap_us = l->nap_us * 2 > cap ? cap : l->nap_us * 2;
    const struct timespec *timeout = !armed ? &nap : watch || pfd[1].fd < 0 ? &ten : NULL;
    int rc = ppoll(pfd, (nfds_t)nfd, timeout, NULL);
    atomic_store(&w->sleeping, false);
    if (armed && rc > 0) { /* woken by an event (not the timeout) */
        l->last_event = ts_now_ns();
        l->nap_us = NAP_MIN_US;
    }
    uint64_t cnt;
    if (pfd[0].revents & POLLIN) {
        ssize_t rd = read(w->efd, &cnt, sizeof cnt);
        (void)rd;
    }
}

/* The loop, as phases: the take-over delay (a caller ran a round lately),
 * parking while callers drive, a round of progress under the lock, the
 * spin after the last event, and the sleep. */
void *ts__comm_thread_main(void *arg)
{
    world *w = arg;
    ts__comm_thread_world = w;
    ts_trace_thread_name("comm");
    thread_loop l = {.spin = ts__comm_spin_ns(),
                     .takeover = ts__comm_takeover_ns(),
                     .last_event = ts_now_ns(),
                     .busy = 0,
                     .nap_us = NAP_MIN_US};
    for (;;) {
        bool stop = atomic_load(&w->stop);
        if (!stop && l.takeover > 0 && defer_to_callers(w, &l)) continue;
        if (!stop && atomic_load(&w->driving) > 0) {
            park_while_driven(w, &l);
            continue;
        }
        ts__comm_prog_lock(w);
        int n = ts__comm_round(w, true);
        ts__comm_flush_traces(w);
        if (stop) {
            stop_locked(w);
            break;
        }
        if (n > 0) {
            ts__comm_prog_unlock(w);
            l.last_event = ts_now_ns();
            l.nap_us = NAP_MIN_US;
            continue;
        }
        uint64_t idle = ts_now_ns() - l.last_event;
        if (idle < l.spin) { /* phase 3: spin */
            ts__comm_prog_unlock(w);
            continue;
        }
        thread_sleep(w, &l, idle);
    }
    return NULL;
}
