#define _GNU_SOURCE
/*
 * The loopback transport (transport.h): the ranks of one world are threads
 * of one process joined by a fabric.
 *
 * The fabric holds, per destination rank, a mailbox under one fabric-wide
 * mutex: the messages that arrived before their receive was posted (in
 * arrival order), the posted receives (in posting order), and the
 * completions waiting for that rank's progress() to run their callbacks.
 * A send copies the bytes straight into a posted matching receive when
 * one is waiting and nothing earlier with the same (src, tag) is queued,
 * else into a queued message; the receiver's matching pairs the first
 * posted receive of a (src, tag) with the first queued message of that
 * (src, tag), which keeps posting order. Each transport has an eventfd
 * that is written whenever a completion is queued for it.
 *
 * Fault injection: a delay holds a sender's messages back from matching
 * until their ready time. A killed rank stops delivering and receiving at
 * once; detect_s later every pending and later transfer between it and
 * any rank fails with TS_ERR_PEER_FAILED naming it (the dead rank itself
 * sees the same, so that its thread cannot hang either). Timed events
 * (ready times, detection) are noticed at the next progress(); arm()
 * reports TS_ERR_ALREADY while any are due, and the driving thread polls
 * with a finite timeout.
 *
 * The direct collectives (coll_direct.h) read peers' memory with
 * process_vm_readv; here every rank is this process, so peer_pid gives
 * this process's id for every peer and the tests' ranks take the same
 * copy-free path as processes of one host (TS_LOOPBACK_DIRECT=0, read at
 * each call, turns it off: the packed fallback).
 */
#include "comm/transport.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

typedef struct lb_msg {
    struct lb_msg *next;
    int src;
    uint64_t tag;
    size_t len;
    uint64_t ready_ns;
    unsigned char *data;
} lb_msg;

/* A pending operation: a posted receive, a send held back by a kill, or a
 * completion waiting for progress(). */
typedef struct lb_op {
    struct lb_op *next;
    int peer;
    uint64_t tag;
    void *buf;
    size_t len;
    size_t *len_out;        /* recv_upto: the received length (NULL: len exactly) */
    ts_iov iov[TS_IOV_MAX]; /* recvv_upto: the pieces (niov > 0; len their total) */
    int niov;
    ts_xfer_cb cb;
    void *arg;
    ts_status status;
} lb_op;

/* Whether a message of mlen bytes completes receive r (recv_upto: any
 * length up to r->len, written to *r->len_out); copies it if so. */
static bool deliver(lb_op *r, const void *data, size_t mlen)
{
    if (r->len_out ? mlen > r->len : mlen != r->len) return false;
    if (r->len_out) *r->len_out = mlen;
    if (!r->niov) {
        if (mlen) memcpy(r->buf, data, mlen);
        return true;
    }
    const unsigned char *p = data;
    for (int i = 0; i < r->niov && mlen; i++) {
        size_t k = mlen < r->iov[i].len ? mlen : r->iov[i].len;
        if (k) memcpy(r->iov[i].buf, p, k);
        p += k;
        mlen -= k;
    }
    return true;
}

typedef struct lb_box {
    lb_msg *msgs, *msgs_tail;  /* unexpected messages, arrival order */
    lb_op *recvs, *recvs_tail; /* posted receives, posting order */
    lb_op *sends, *sends_tail; /* sends to/from a killed rank, held until detection */
    lb_op *done, *done_tail;   /* completions for progress() */
    int efd;
    bool attached;
} lb_box;

struct ts_loopback_fabric {
    pthread_mutex_t mu;
    int size;
    lb_box *box;
    uint64_t *delay_ns; /* per sender */
    uint64_t *kill_ns;  /* 0: alive; else the time its death is detected */
    bool *killed;       /* kill() was called */
    uint64_t nsent;     /* messages sent (ts__loopback_sent) */
};

typedef struct lb_transport {
    ts_transport base;
    ts_loopback_fabric *f;
} lb_transport;

#define PUSH(head, tail, node) \
    do { \
        (node)->next = NULL; \
        if (tail) (tail)->next = (node); \
        else (head) = (node); \
        (tail) = (node); \
    } while (0)

static void signal_box(lb_box *b)
{
    if (b->efd >= 0) {
        uint64_t one = 1;
        ssize_t w = write(b->efd, &one, sizeof one);
        (void)w; /* EAGAIN: the counter is already non-zero */
    }
}

static void complete_locked(ts_loopback_fabric *f, int rank, lb_op *op, ts_status st)
{
    lb_box *b = &f->box[rank];
    op->status = st;
    PUSH(b->done, b->done_tail, op);
    signal_box(b);
}

/* Whether transfers between a and b have failed by `now`; sets *dead_out
 * to the dead rank. */
static bool link_dead(const ts_loopback_fabric *f, int a, int b, uint64_t now, int *dead_out)
{
    if (f->kill_ns[a] && now >= f->kill_ns[a]) {
        *dead_out = a;
        return true;
    }
    if (f->kill_ns[b] && now >= f->kill_ns[b]) {
        *dead_out = b;
        return true;
    }
    return false;
}

static bool link_cut(const ts_loopback_fabric *f, int a, int b) { return f->killed[a] || f->killed[b]; }

static ts_status peer_failed(int dead) { return ts_error(TS_ERR_PEER_FAILED, "loopback: rank %d failed", dead); }

/* Pairs posted receives of `rank` with ready queued messages. */
static int match_locked(ts_loopback_fabric *f, int rank, uint64_t now)
{
    lb_box *b = &f->box[rank];
    int n = 0;
    lb_op *prev_r = NULL;
    for (lb_op *r = b->recvs; r;) {
        lb_msg *prev_m = NULL, *m = b->msgs;
        while (m && !(m->src == r->peer && m->tag == r->tag)) {
            prev_m = m;
            m = m->next;
        }
        if (!m || m->ready_ns > now) {
            prev_r = r;
            r = r->next;
            continue;
        }
        /* unlink both */
        if (prev_m) prev_m->next = m->next;
        else b->msgs = m->next;
        if (b->msgs_tail == m) b->msgs_tail = prev_m;
        lb_op *next = r->next;
        if (prev_r) prev_r->next = next;
        else b->recvs = next;
        if (b->recvs_tail == r) b->recvs_tail = prev_r;
        ts_status st = deliver(r, m->data, m->len) ? TS_OK : TS_ERR_COMM;
        ts__free(TS_MEM_COMM, m->data);
        ts__free(TS_MEM_COMM, m);
        complete_locked(f, rank, r, st);
        n++;
        r = next;
    }
    return n;
}

/* Fails the pending operations of `rank` whose link has died by `now`. */
static void fail_dead_locked(ts_loopback_fabric *f, int rank, uint64_t now)
{
    lb_box *b = &f->box[rank];
    lb_op **lists[2][2] = {{&b->recvs, &b->recvs_tail}, {&b->sends, &b->sends_tail}};
    for (int l = 0; l < 2; l++) {
        lb_op *prev = NULL;
        for (lb_op *o = *lists[l][0]; o;) {
            lb_op *next = o->next;
            int dead;
            if (link_dead(f, rank, o->peer, now, &dead)) {
                if (prev) prev->next = next;
                else *lists[l][0] = next;
                if (*lists[l][1] == o) *lists[l][1] = prev;
                complete_locked(f, rank, o, TS_ERR_PEER_FAILED);
            } else {
                prev = o;
            }
            o = next;
        }
    }
}

static lb_op *new_op(int peer, uint64_t tag, void *buf, size_t len, ts_xfer_cb cb, void *arg)
{
    lb_op *o = ts__calloc(TS_MEM_COMM, 1, sizeof *o);
    if (!o) return NULL;
    o->peer = peer;
    o->tag = tag;
    o->buf = buf;
    o->len = len;
    o->cb = cb;
    o->arg = arg;
    return o;
}

static ts_status check_peer(const ts_transport *t, int peer)
{
    if (peer < 0 || peer >= t->size)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "loopback: peer %d outside [0, %d)", peer, t->size);
    return TS_OK;
}

static ts_status lb_send(ts_transport *t, int peer, const void *buf, size_t len, uint64_t tag, ts_xfer_cb cb, void *arg)
{
    ts_loopback_fabric *f = ((lb_transport *)t)->f;
    ts_status s = check_peer(t, peer);
    if (s) return s;
    int me = t->rank;
    lb_op *op = new_op(peer, tag, (void *)(uintptr_t)buf, len, cb, arg);
    if (!op) return TS_ERR_NO_MEMORY;
    pthread_mutex_lock(&f->mu);
    f->nsent++;
    uint64_t now = ts_now_ns();
    int dead;
    if (link_dead(f, me, peer, now, &dead)) {
        complete_locked(f, me, op, TS_ERR_PEER_FAILED);
        pthread_mutex_unlock(&f->mu);
        return TS_OK;
    }
    if (link_cut(f, me, peer)) { /* never delivered; fails at detection */
        PUSH(f->box[me].sends, f->box[me].sends_tail, op);
        pthread_mutex_unlock(&f->mu);
        return TS_OK;
    }
    lb_box *d = &f->box[peer];
    uint64_t ready = f->delay_ns[me] ? now + f->delay_ns[me] : 0;
    /* Straight into a posted receive when nothing earlier of (me, tag) waits. */
    if (!ready) {
        bool queued = false;
        for (lb_msg *m = d->msgs; m && !queued; m = m->next) queued = m->src == me && m->tag == tag;
        if (!queued) {
            lb_op *prev = NULL;
            for (lb_op *r = d->recvs; r; prev = r, r = r->next) {
                if (r->peer != me || r->tag != tag) continue;
                if (prev) prev->next = r->next;
                else d->recvs = r->next;
                if (d->recvs_tail == r) d->recvs_tail = prev;
                ts_status st = deliver(r, buf, len) ? TS_OK : TS_ERR_COMM;
                complete_locked(f, peer, r, st);
                complete_locked(f, me, op, TS_OK);
                pthread_mutex_unlock(&f->mu);
                return TS_OK;
            }
        }
    }
    lb_msg *m = ts__calloc(TS_MEM_COMM, 1, sizeof *m);
    unsigned char *data = ts__malloc(TS_MEM_COMM, len ? len : 1);
    if (!m || !data) {
        pthread_mutex_unlock(&f->mu);
        ts__free(TS_MEM_COMM, m);
        ts__free(TS_MEM_COMM, data);
        ts__free(TS_MEM_COMM, op);
        return TS_ERR_NO_MEMORY;
    }
    if (len) memcpy(data, buf, len);
    m->src = me;
    m->tag = tag;
    m->len = len;
    m->ready_ns = ready;
    m->data = data;
    PUSH(d->msgs, d->msgs_tail, m);
    signal_box(d);
    complete_locked(f, me, op, TS_OK);
    pthread_mutex_unlock(&f->mu);
    return TS_OK;
}

/* Posts receive `op` in rank me's box (matched at once if its message is
 * there), or fails it at once if its peer is dead. */
static void post_recv(ts_loopback_fabric *f, int me, lb_op *op)
{
    pthread_mutex_lock(&f->mu);
    uint64_t now = ts_now_ns();
    int dead;
    if (link_dead(f, me, op->peer, now, &dead)) {
        complete_locked(f, me, op, TS_ERR_PEER_FAILED);
    } else {
        PUSH(f->box[me].recvs, f->box[me].recvs_tail, op);
        if (!link_cut(f, me, op->peer)) match_locked(f, me, now);
    }
    pthread_mutex_unlock(&f->mu);
}

static ts_status lb_recv_upto(ts_transport *t, int peer, void *buf, size_t len, uint64_t tag, ts_xfer_cb cb, void *arg,
                              size_t *len_out)
{
    ts_loopback_fabric *f = ((lb_transport *)t)->f;
    ts_status s = check_peer(t, peer);
    if (s) return s;
    int me = t->rank;
    lb_op *op = new_op(peer, tag, buf, len, cb, arg);
    if (!op) return TS_ERR_NO_MEMORY;
    op->len_out = len_out;
    post_recv(f, me, op);
    return TS_OK;
}

static ts_status lb_recv(ts_transport *t, int peer, void *buf, size_t len, uint64_t tag, ts_xfer_cb cb, void *arg)
{
    return lb_recv_upto(t, peer, buf, len, tag, cb, arg, NULL);
}

static ts_status lb_recvv_upto(ts_transport *t, int peer, const ts_iov *iov, int n, uint64_t tag, ts_xfer_cb cb,
                               void *arg, size_t *len_out)
{
    if (n < 1 || n > TS_IOV_MAX || !len_out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "loopback: recvv_upto of %d pieces (1..%d) with%s len_out", n,
                        TS_IOV_MAX, len_out ? "" : "out");
    ts_loopback_fabric *f = ((lb_transport *)t)->f;
    ts_status s = check_peer(t, peer);
    if (s) return s;
    int me = t->rank;
    size_t total = 0;
    for (int i = 0; i < n; i++) total += iov[i].len;
    lb_op *op = new_op(peer, tag, iov[0].buf, total, cb, arg);
    if (!op) return TS_ERR_NO_MEMORY;
    op->len_out = len_out;
    memcpy(op->iov, iov, (size_t)n * sizeof *iov);
    op->niov = n;
    post_recv(f, me, op);
    return TS_OK;
}

/* The pieces gathered into one buffer, sent as one message. */
static ts_status lb_sendv(ts_transport *t, int peer, const ts_iov *iov, int n, uint64_t tag, ts_xfer_cb cb, void *arg)
{
    if (n < 1 || n > TS_IOV_MAX)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "loopback: sendv of %d pieces (1..%d)", n, TS_IOV_MAX);
    size_t total = 0;
    for (int i = 0; i < n; i++) total += iov[i].len;
    unsigned char *g = ts__malloc(TS_MEM_COMM, total ? total : 1);
    if (!g) return TS_ERR_NO_MEMORY;
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        if (iov[i].len) memcpy(g + off, iov[i].buf, iov[i].len);
        off += iov[i].len;
    }
    ts_status s = lb_send(t, peer, g, total, tag, cb, arg); /* copies the bytes, or never reads them (a cut link) */
    ts__free(TS_MEM_COMM, g);
    return s;
}

static int lb_progress(ts_transport *t)
{
    ts_loopback_fabric *f = ((lb_transport *)t)->f;
    int me = t->rank;
    lb_box *b = &f->box[me];
    pthread_mutex_lock(&f->mu);
    uint64_t now = ts_now_ns();
    match_locked(f, me, now);
    fail_dead_locked(f, me, now);
    lb_op *done = b->done;
    b->done = b->done_tail = NULL;
    uint64_t cnt;
    ssize_t r = read(b->efd, &cnt, sizeof cnt);
    (void)r;
    pthread_mutex_unlock(&f->mu);
    int n = 0;
    while (done) {
        lb_op *next = done->next;
        ts_status st = done->status;
        if (st == TS_ERR_PEER_FAILED) {
            int dead = 0;
            pthread_mutex_lock(&f->mu);
            link_dead(f, me, done->peer, ts_now_ns(), &dead);
            pthread_mutex_unlock(&f->mu);
            peer_failed(dead);
        } else if (st == TS_ERR_COMM) {
            ts_error(TS_ERR_COMM,
                     "loopback: receive of %s%zu bytes from rank %d (tag %#llx) got a message of %s length",
                     done->len_out ? "up to " : "", done->len, done->peer, (unsigned long long)done->tag,
                     done->len_out ? "a greater" : "another");
        }
        if (done->cb) done->cb(done->arg, st);
        ts__free(TS_MEM_COMM, done);
        done = next;
        n++;
    }
    return n;
}

static ts_status lb_arm(ts_transport *t)
{
    ts_loopback_fabric *f = ((lb_transport *)t)->f;
    int me = t->rank;
    lb_box *b = &f->box[me];
    pthread_mutex_lock(&f->mu);
    uint64_t now = ts_now_ns();
    bool busy = b->done != NULL;
    /* a ready message for a posted receive, or a death now detectable */
    for (lb_msg *m = b->msgs; m && !busy; m = m->next) {
        if (m->ready_ns > now) continue;
        for (lb_op *r = b->recvs; r && !busy; r = r->next) busy = r->peer == m->src && r->tag == m->tag;
    }
    for (int p = 0; p < f->size && !busy; p++) busy = f->kill_ns[p] && now >= f->kill_ns[p] && (b->recvs || b->sends);
    pthread_mutex_unlock(&f->mu);
    return busy ? TS_ERR_ALREADY : TS_OK;
}

static int lb_wait_fd(ts_transport *t)
{
    ts_loopback_fabric *f = ((lb_transport *)t)->f;
    return f->box[t->rank].efd;
}

static int lb_failed_peer(ts_transport *t, ts_status *status_out)
{
    ts_loopback_fabric *f = ((lb_transport *)t)->f;
    int me = t->rank, found = -1;
    pthread_mutex_lock(&f->mu);
    uint64_t now = ts_now_ns();
    for (int p = 0; p < f->size && found < 0; p++)
        if (p != me && f->kill_ns[p] && now >= f->kill_ns[p]) found = p;
    if (found < 0 && f->kill_ns[me] && now >= f->kill_ns[me]) found = me;
    pthread_mutex_unlock(&f->mu);
    if (found >= 0) {
        ts_status st = ts_error(TS_ERR_PEER_FAILED, "loopback: rank %d was killed by fault injection", found);
        if (status_out) *status_out = st;
    }
    return found;
}

static void lb_cancel_all(ts_transport *t, ts_status status)
{
    ts_loopback_fabric *f = ((lb_transport *)t)->f;
    lb_box *b = &f->box[t->rank];
    pthread_mutex_lock(&f->mu);
    lb_op *lists[2] = {b->recvs, b->sends};
    b->recvs = b->recvs_tail = b->sends = b->sends_tail = NULL;
    for (int l = 0; l < 2; l++) {
        for (lb_op *o = lists[l]; o;) {
            lb_op *next = o->next;
            complete_locked(f, t->rank, o, status);
            o = next;
        }
    }
    pthread_mutex_unlock(&f->mu);
    while (lb_progress(t) > 0) {}
}

static void free_ops(lb_op *o)
{
    while (o) {
        lb_op *next = o->next;
        ts__free(TS_MEM_COMM, o);
        o = next;
    }
}

static void lb_destroy(ts_transport *t)
{
    if (!t) return;
    ts_loopback_fabric *f = ((lb_transport *)t)->f;
    lb_box *b = &f->box[t->rank];
    pthread_mutex_lock(&f->mu);
    free_ops(b->recvs);
    free_ops(b->sends);
    free_ops(b->done);
    b->recvs = b->recvs_tail = b->sends = b->sends_tail = b->done = b->done_tail = NULL;
    if (b->efd >= 0) close(b->efd);
    b->efd = -1;
    b->attached = false;
    pthread_mutex_unlock(&f->mu);
    ts__free(TS_MEM_COMM, t);
}

static int lb_peer_pid(ts_transport *t, int peer)
{
    const char *e = getenv("TS_LOOPBACK_DIRECT");
    if (peer < 0 || peer >= t->size || peer == t->rank || (e && strcmp(e, "0") == 0)) return 0;
    return (int)getpid();
}

static const ts_transport_vtable lb_vtable = {
    .name = "loopback",
    .send = lb_send,
    .recv = lb_recv,
    .progress = lb_progress,
    .arm = lb_arm,
    .wait_fd = lb_wait_fd,
    .failed_peer = lb_failed_peer,
    .cancel_all = lb_cancel_all,
    .destroy = lb_destroy,
    .peer_pid = lb_peer_pid,
    .recv_upto = lb_recv_upto,
    .sendv = lb_sendv,
    .recvv_upto = lb_recvv_upto,
};

ts_status ts__loopback_fabric_new(int size, ts_loopback_fabric **out)
{
    if (size < 1 || !out) return ts_error(TS_ERR_INVALID_ARGUMENT, "loopback: fabric size %d < 1", size);
    ts_loopback_fabric *f = ts__calloc(TS_MEM_COMM, 1, sizeof *f);
    if (!f) return TS_ERR_NO_MEMORY;
    f->size = size;
    f->box = ts__calloc(TS_MEM_COMM, (size_t)size, sizeof *f->box);
    f->delay_ns = ts__calloc(TS_MEM_COMM, (size_t)size, sizeof *f->delay_ns);
    f->kill_ns = ts__calloc(TS_MEM_COMM, (size_t)size, sizeof *f->kill_ns);
    f->killed = ts__calloc(TS_MEM_COMM, (size_t)size, sizeof *f->killed);
    if (!f->box || !f->delay_ns || !f->kill_ns || !f->killed) {
        ts__loopback_fabric_free(f);
        return TS_ERR_NO_MEMORY;
    }
    for (int i = 0; i < size; i++) f->box[i].efd = -1;
    pthread_mutex_init(&f->mu, NULL);
    *out = f;
    return TS_OK;
}

void ts__loopback_fabric_free(ts_loopback_fabric *f)
{
    if (!f) return;
    if (f->box) {
        for (int i = 0; i < f->size; i++) {
            lb_box *b = &f->box[i];
            for (lb_msg *m = b->msgs; m;) {
                lb_msg *next = m->next;
                ts__free(TS_MEM_COMM, m->data);
                ts__free(TS_MEM_COMM, m);
                m = next;
            }
            free_ops(b->recvs);
            free_ops(b->sends);
            free_ops(b->done);
            if (b->efd >= 0) close(b->efd);
        }
        pthread_mutex_destroy(&f->mu);
    }
    ts__free(TS_MEM_COMM, f->box);
    ts__free(TS_MEM_COMM, f->delay_ns);
    ts__free(TS_MEM_COMM, f->kill_ns);
    ts__free(TS_MEM_COMM, f->killed);
    ts__free(TS_MEM_COMM, f);
}

ts_status ts__loopback_transport_new(ts_loopback_fabric *f, int rank, ts_transport **out)
{
    if (!f || !out || rank < 0 || rank >= f->size)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "loopback: rank %d outside the fabric", rank);
    lb_transport *t = ts__calloc(TS_MEM_COMM, 1, sizeof *t);
    if (!t) return TS_ERR_NO_MEMORY;
    int efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (efd < 0) {
        ts__free(TS_MEM_COMM, t);
        return ts_error(TS_ERR_IO, "loopback: eventfd: %s", strerror(errno));
    }
    pthread_mutex_lock(&f->mu);
    if (f->box[rank].attached) {
        pthread_mutex_unlock(&f->mu);
        close(efd);
        ts__free(TS_MEM_COMM, t);
        return ts_error(TS_ERR_STATE, "loopback: rank %d already has a transport", rank);
    }
    f->box[rank].attached = true;
    f->box[rank].efd = efd;
    if (f->box[rank].done) signal_box(&f->box[rank]);
    pthread_mutex_unlock(&f->mu);
    t->base.vt = &lb_vtable;
    t->base.rank = rank;
    t->base.size = f->size;
    t->f = f;
    *out = &t->base;
    return TS_OK;
}

void ts__loopback_set_delay(ts_loopback_fabric *f, int rank, double delay_s)
{
    if (!f || rank < 0 || rank >= f->size) return;
    pthread_mutex_lock(&f->mu);
    f->delay_ns[rank] = delay_s > 0 ? (uint64_t)(delay_s * 1e9) : 0;
    pthread_mutex_unlock(&f->mu);
}

void ts__loopback_kill(ts_loopback_fabric *f, int rank, double detect_s)
{
    if (!f || rank < 0 || rank >= f->size) return;
    pthread_mutex_lock(&f->mu);
    f->killed[rank] = true;
    uint64_t at = ts_now_ns() + (detect_s > 0 ? (uint64_t)(detect_s * 1e9) : 0);
    if (!at) at = 1;
    f->kill_ns[rank] = at;
    /* messages from the dead rank not yet received are lost */
    for (int d = 0; d < f->size; d++) {
        lb_box *b = &f->box[d];
        lb_msg *prev = NULL;
        for (lb_msg *m = b->msgs; m;) {
            lb_msg *next = m->next;
            if (m->src == rank || d == rank) {
                if (prev) prev->next = next;
                else b->msgs = next;
                if (b->msgs_tail == m) b->msgs_tail = prev;
                ts__free(TS_MEM_COMM, m->data);
                ts__free(TS_MEM_COMM, m);
            } else {
                prev = m;
            }
            m = next;
        }
        signal_box(b);
    }
    pthread_mutex_unlock(&f->mu);
}

uint64_t ts__loopback_sent(ts_loopback_fabric *f)
{
    pthread_mutex_lock(&f->mu);
    uint64_t n = f->nsent;
    pthread_mutex_unlock(&f->mu);
    return n;
}
