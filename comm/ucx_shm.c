#define _GNU_SOURCE
/*
 * The UCX transport's shared-memory bypass for large messages
 * (ucx_internal.h; the transport itself is comm/transport_ucx.c).
 *
 * In PEER error mode UCX 1.13's shared-memory rendezvous costs about
 * 22 us more per message and halves the bandwidth of simultaneous transfers in both directions (a 2-rank
 * all-gather): measured against NONE mode, with the same process_vm_readv
 * traffic. So messages of TS_UCX_CMA_MIN bytes or more between processes
 * of one host do their own single-copy rendezvous over the same PEER-mode
 * endpoints: the sender sends a small control message (its buffer's
 * address and length, tag bit CTRL) and waits for an acknowledgement (tag
 * bit ACK); the receiver reads the buffer with process_vm_readv straight
 * into its own and acknowledges. Failure handling is unchanged: every
 * piece is an ordinary UCX transfer with the peer (cancelled or abandoned
 * when it dies), and a read from a dead process fails. Whether rank i can
 * read rank j is tested once, at connection, by reading a cookie that j
 * published with its address (a different pid namespace, or ptrace rules
 * that forbid it, fail the test), and published in the store, so that
 * both sides of a pair take the same path. TS_UCX_CMA=0 turns the bypass
 * off. The two flag bits are the top bits of the rank field, so worlds
 * have at most 16384 ranks. Details that keep it safe:
 *  - the acknowledgement carries the control message's nonce, so one left
 *    over from an abandoned transfer with the same tag is not taken for a
 *    later one's;
 *  - the sender keeps a "live" word holding the nonce until its send ends
 *    (acknowledged, failed or cancelled); the receiver reads it after the
 *    data, so a read that raced with an abandoned send (the buffer reused
 *    since) fails instead of delivering what the buffer held;
 *  - the first read also re-reads the peer's cookie: a dead peer's pid may
 *    name another process;
 *  - the payloads of the small messages live in the ucx_op, which is only
 *    freed when UCX gives it back;
 *  - a size mismatch between sides where one is under TS_UCX_CMA_MIN and
 *    the other not takes two paths that never meet: it ends at the
 *    caller's deadline, not with TS_ERR_COMM (comm.h says so).
 *
 * Calls: the transport's raw transfers (ts__ucx_send_raw / _recv_raw),
 * ts__ucx_mark_dead, the cross-memory reads of comm/xmem.h, the store.
 */
#include "comm/ucx_internal.h"
#include "comm/xmem.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* Published with the worker address; a peer that reads it back with
 * process_vm_readv may use the shared-memory bypass towards this process. */
static uint64_t g_cma_cookie;

uint64_t ts__ucx_shm_cookie(void)
{
    if (!g_cma_cookie) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        g_cma_cookie =
            ((uint64_t)getpid() << 32) ^ (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 20) ^ 0x9e3779b97f4a7c15ull;
    }
    return g_cma_cookie;
}

uint64_t ts__ucx_shm_cookie_addr(void) { return (uint64_t)(uintptr_t)&g_cma_cookie; }

/* ------------------------------------------------------------ transfers */

#define CMA_MAGIC 0x434d4132u /* "CMA2" */

typedef struct cma_msg { /* control message: where the data is */
    uint64_t addr, len, nonce;
    uint64_t live_addr; /* the sender's word that holds nonce while the buffer may be read */
    uint32_t magic, pad;
} cma_msg;

typedef struct cma_ack { /* acknowledgement: which transfer, how it went */
    uint64_t nonce;
    int64_t status; /* 0: read; a ts_status otherwise */
} cma_ack;

_Static_assert(sizeof(cma_msg) <= 48 && sizeof(cma_ack) <= 48, "bypass payloads fit an op's inline buffer");

/* A send: the acknowledgement receive, then the control message. */
typedef struct cma_tx {
    ts_ucx *t;
    ts_xfer_cb cb;
    void *arg;
    int peer;
    size_t len;
    uint64_t tag, nonce;
    int parts;     /* pieces not finished */
    bool suppress; /* the caller got the error synchronously: no callback */
    ts_status st;  /* the first piece's failure */
    char err[256];
    int64_t ack;    /* the receiver's status */
    ucx_op *ack_op; /* the acknowledgement receive in flight */
    /* nonce while the receiver may read the buffer; cleared when the send
     * ends, so that a receiver reading after an abandoned send (the world
     * failed, the buffer was reused) finds out and fails instead of
     * returning whatever the buffer holds by then */
    volatile uint64_t live;
} cma_tx;

static void tx_finish(cma_tx *x)
{
    x->live = 0;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (!x->suppress) {
        ts_status s = x->st;
        if (s) ts_error(s, "%s", x->err);
        else if (x->ack != 0)
            s = ts_error(TS_ERR_COMM, "ucx: rank %d: rank %d could not read the %zu bytes sent to it: %s",
                         x->t->base.rank, x->peer, x->len, ts_status_name((ts_status)x->ack));
        if (x->cb) x->cb(x->arg, s);
    }
    ts__free(TS_MEM_COMM, x);
}

static void tx_fail(cma_tx *x, ts_status st)
{
    if (st && !x->st) {
        x->st = st;
        snprintf(x->err, sizeof x->err, "%s", ts_last_error());
    }
}

static void tx_sent(void *arg, ts_status st)
{
    cma_tx *x = arg;
    tx_fail(x, st);
    if (--x->parts == 0) tx_finish(x);
}

static void tx_acked(void *arg, ts_status st)
{
    cma_tx *x = arg;
    cma_ack a;
    memcpy(&a, x->ack_op->inl, sizeof a);
    x->ack_op = NULL;
    if (!st && a.nonce != x->nonce) {
        /* an acknowledgement left over from an abandoned transfer with the
         * same peer and tag: not ours; wait for ours */
        ts_status s =
            ts__ucx_recv_raw(x->t, x->peer, NULL, sizeof(cma_ack), x->tag, TS_UCX_ACK, x->len, tx_acked, x, &x->ack_op);
        if (!s) return;
        st = s;
    }
    tx_fail(x, st);
    if (!st) x->ack = a.status;
    if (--x->parts == 0) tx_finish(x);
}

ts_status ts__ucx_shm_send(ts_ucx *t, int peer, const void *buf, size_t len, uint64_t tag, ts_xfer_cb cb, void *arg)
{
    cma_tx *x = ts__calloc(TS_MEM_COMM, 1, sizeof *x);
    if (!x) return ts_error(TS_ERR_NO_MEMORY, "ucx: send: out of memory");
    *x = (cma_tx){.t = t,
                  .cb = cb,
                  .arg = arg,
                  .peer = peer,
                  .len = len,
                  .tag = tag,
                  .nonce = ++t->cma_nonce,
                  .ack = -1,
                  .parts = 1};
    x->live = x->nonce;
    /* the acknowledgement receive first: once the control message is out,
     * the peer may read the buffer, and only its acknowledgement says when
     * it is done */
    ts_status s = ts__ucx_recv_raw(t, peer, NULL, sizeof(cma_ack), tag, TS_UCX_ACK, len, tx_acked, x, &x->ack_op);
    if (s) {
        ts__free(TS_MEM_COMM, x);
        return s;
    }
    cma_msg m = {(uint64_t)(uintptr_t)buf, len, x->nonce, (uint64_t)(uintptr_t)&x->live, CMA_MAGIC, 0};
    x->parts = 2;
    if ((s = ts__ucx_send_raw(t, peer, NULL, sizeof m, tag, TS_UCX_CTRL, len, &m, tx_sent, x))) {
        /* nothing went out: drop the acknowledgement receive; x is freed
         * when UCX gives it back */
        x->suppress = true;
        x->parts = 1;
        ucx_op *op = x->ack_op;
        if (op && !op->cancelled) {
            op->cancelled = true;
            op->forced = s;
            if (op->req) ucp_request_cancel(t->worker, op->req);
        }
        return s;
    }
    return TS_OK;
}

/* A receive: the control message in, the read, the acknowledgement out. */
typedef struct cma_rx {
    ts_ucx *t;
    ts_xfer_cb cb;
    void *arg;
    int peer;
    void *buf;
    size_t len;
    uint64_t tag;
    ucx_op *ctrl_op;
} cma_rx;

/* Reads len bytes at m->addr of the peer's process into buf, checking in
 * the same first call that the process is still the one whose cookie was
 * read at connection (a dead peer's pid may name another process). */
static ts_status cma_read(ts_ucx *t, int peer, void *buf, const cma_msg *m, size_t len)
{
    ucx_peer *p = &t->peers[peer];
    if (m->magic != CMA_MAGIC || m->len != len)
        return ts_error(TS_ERR_COMM, "ucx: rank %d: rank %d sent %llu bytes, %zu expected (or a bad control message)",
                        t->base.rank, peer, (unsigned long long)m->len, len);
    /* the cookie first, then the data, in one read */
    uint64_t cookie = 0;
    struct iovec l[2] = {{&cookie, 8}, {buf, len}};
    struct iovec r[2] = {{(void *)(uintptr_t)p->cookie_addr, 8}, {(void *)(uintptr_t)m->addr, len}};
    size_t got = 0;
    int e = ts__xmem_readv(p->pid, l, 2, r, 2, &got);
    if ((got > 0 && got < 8) || (got >= 8 && cookie != p->cookie))
        return ts_error(TS_ERR_PEER_FAILED,
                        "ucx: rank %d: rank %d's process (pid %d) is gone; its %zu bytes "
                        "cannot be read",
                        t->base.rank, peer, (int)p->pid, len);
    if (e) {
        size_t done = got > 8 ? got - 8 : 0;
        bool dead = e == ESRCH || p->dead;
        if (e == ESRCH && !p->dead) { /* the process is gone: as the pid watch would find */
            p->exited = true;
            ts__ucx_mark_dead(t, p, UCS_ERR_CONNECTION_RESET);
        }
        return ts_error(dead ? TS_ERR_PEER_FAILED : TS_ERR_COMM,
                        "ucx: rank %d: reading %zu bytes from rank %d (pid %d) failed after %zu: %s", t->base.rank, len,
                        peer, (int)p->pid, done, strerror(e));
    }
    /* the sender still waits for this transfer (so nothing it read was
     * reused under it): its live word holds the nonce */
    uint64_t live = 0;
    e = ts__xmem_read(p->pid, &live, m->live_addr, 8);
    if (e || live != m->nonce)
        return ts_error(e == ESRCH ? TS_ERR_PEER_FAILED : TS_ERR_COMM,
                        "ucx: rank %d: rank %d abandoned its %zu-byte send before it was read (its world failed)",
                        t->base.rank, peer, len);
    return TS_OK;
}

static void rx_ctrl(void *arg, ts_status st)
{
    cma_rx *y = arg;
    ts_ucx *t = y->t;
    ts_xfer_cb cb = y->cb;
    void *cb_arg = y->arg;
    cma_msg m;
    memcpy(&m, y->ctrl_op->inl, sizeof m);
    if (!st) {
        st = cma_read(t, y->peer, y->buf, &m, y->len);
        char err[256];
        snprintf(err, sizeof err, "%s", st ? ts_last_error() : "");
        /* acknowledge: the sender's buffer is free after this */
        cma_ack a = {m.nonce, st};
        if (!t->peers[y->peer].dead &&
            ts__ucx_send_raw(t, y->peer, NULL, sizeof a, y->tag, TS_UCX_ACK, y->len, &a, NULL, NULL) != TS_OK)
            ts_logf(ts__ucx_teardown_level(t),
                    "ucx: rank %d: could not acknowledge %zu bytes to rank %d: %s; it will wait until "
                    "its deadline",
                    t->base.rank, y->len, y->peer, ts_last_error());
        if (st) ts_error(st, "%s", err);
    }
    ts__free(TS_MEM_COMM, y);
    if (cb) cb(cb_arg, st);
}

ts_status ts__ucx_shm_recv(ts_ucx *t, int peer, void *buf, size_t len, uint64_t tag, ts_xfer_cb cb, void *arg)
{
    cma_rx *y = ts__calloc(TS_MEM_COMM, 1, sizeof *y);
    if (!y) return ts_error(TS_ERR_NO_MEMORY, "ucx: recv: out of memory");
    *y = (cma_rx){.t = t, .cb = cb, .arg = arg, .peer = peer, .buf = buf, .len = len, .tag = tag};
    ts_status s = ts__ucx_recv_raw(t, peer, NULL, sizeof(cma_msg), tag, TS_UCX_CTRL, len, rx_ctrl, y, &y->ctrl_op);
    if (s) ts__free(TS_MEM_COMM, y);
    return s;
}

/* ------------------------------------------------------------ connection */

bool ts__ucx_shm_probe(ucx_peer *p, const ts_ucx_addr_hdr *h)
{
    uint64_t got = 0;
    p->cookie_addr = h->cookie_addr;
    p->cookie = h->cookie;
    int e = ts__xmem_read((pid_t)h->pid, &got, h->cookie_addr, 8);
    p->cma_recv = e == 0 && got == h->cookie;
    return (e == 0 && got != h->cookie) || e == ESRCH;
}

ts_status ts__ucx_shm_agree(ts_ucx *t, ts_store *store, const char *prefix, bool cma_on, double timeout_s)
{
    int rank = t->base.rank, size = t->base.size;
    char key[TS_STORE_MAX_KEY];
    ts_status s;
    snprintf(key, sizeof key, "%s/ucx/cmaon/%d", prefix, rank);
    char on_c = cma_on ? '1' : '0';
    if ((s = ts_store_set(store, key, &on_c, 1)) != TS_OK) return s;
    for (int r = 0; r < size; r++) {
        if (!t->peers[r].same_host) continue;
        snprintf(key, sizeof key, "%s/ucx/cma/%d/%d", prefix, rank, r);
        char one = t->peers[r].cma_recv && cma_on ? '1' : '0';
        if ((s = ts_store_set(store, key, &one, 1)) != TS_OK) return s;
    }
    for (int r = 0; r < size; r++) {
        if (!t->peers[r].same_host) continue;
        bool vals[2] = {false, false};
        for (int k = 0; k < 2; k++) {
            if (k == 0) snprintf(key, sizeof key, "%s/ucx/cmaon/%d", prefix, r);
            else snprintf(key, sizeof key, "%s/ucx/cma/%d/%d", prefix, r, rank);
            void *v = NULL;
            size_t vlen = 0;
            if ((s = ts_store_get(store, key, &v, &vlen)) != TS_OK) {
                char why[256];
                snprintf(why, sizeof why, "%s", ts_last_error());
                s = ts_error(s, "ucx: rank %d: no shared-memory answer from rank %d within %.1f s: %s", rank, r,
                             timeout_s, why);
                return s;
            }
            vals[k] = vlen == 1 && *(char *)v == '1';
            ts_store_value_free(v);
        }
        t->peers[r].cma_recv = t->peers[r].cma_recv && cma_on && vals[0];
        t->peers[r].cma_send = vals[1] && cma_on;
    }
    return TS_OK;
}
