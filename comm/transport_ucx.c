#define _GNU_SOURCE
/*
 * The UCX transport (transport.h; docs/design.md, "UCX: transports and registration" and the sections after it).
 *
 * One UCP context (TAG + WAKEUP) and one worker in
 * UCS_THREAD_MODE_SERIALIZED: driven by one thread at a time, whichever
 * holds the world's progress lock (comm.c: a caller waiting on a request,
 * or the communication thread). Unset UCX_TLS, UCX_MM_ERROR_HANDLING
 * and UCX_KEEPALIVE_INTERVAL get the launcher's defaults (setenv before
 * ucp_config_read). Every rank connects to every rank (itself included)
 * with UCP_ERR_HANDLING_MODE_PEER.
 *
 * Address exchange: the store value under "<prefix>/ucx/<rank>" is a
 * ts_ucx_addr (ucx_internal.h: magic, pid, host, the bypass's cookie, then
 * the worker address), written by ts__ucx_addr_encode and read by
 * ts__ucx_addr_decode. The pid and host let same-host peers watch each
 * other's process (see Failures). host is ts__host_id(TS_HOST_ID_NET) (boot
 * id, pid and network namespace; xmem.h), not the host name, which hosts
 * may share; TS_LOG_LEVEL=info shows each rank's verdict (log_hosts).
 *
 * Tag packing. ucp_tag_recv_nbx is not bound to an endpoint, so the source
 * rank travels in the tag: the 64-bit UCX tag is
 *     ucx_tag = ((uint64_t)src_rank << 48) ^ tag
 * with tag < 2^48 (transport tags that use bits 48..63 are rejected with
 * TS_ERR_INVALID_ARGUMENT), so the XOR is a plain OR: bits 48..61 hold the
 * sender's rank (world size at most 16384), bits 62 and 63 the
 * shared-memory bypass's message kinds (below), bits 0..47 the transport
 * tag.
 * Receives match with tag_mask = ~0.
 *
 * Completions: UCX callbacks (send and receive, with user_data = our op).
 * A UCX callback only records the status and moves the op from the pending
 * list to a completed queue; the user's callback runs from progress(),
 * after ucp_worker_progress returned, never from inside send()/recv() and
 * never inside UCX. A send that completes in place (ucp_tag_send_nbx
 * returns NULL) is queued the same way. Receives are posted with
 * UCP_OP_ATTR_FLAG_NO_IMM_CMPL, so recv_cb always runs (inside
 * ucp_tag_recv_nbx when the message was already here) and reports the
 * received length, which must equal the posted one (TS_ERR_COMM naming
 * both; a longer message is UCX's "Message truncated"), or for recv_upto
 * be at most the posted one.
 *
 * Failures. The endpoint error callback only records (peer, status): the
 * first failure is what failed_peer() reports. Same-host peers are also
 * watched through a pidfd (pidfd_open), polled from progress at most every
 * 0.25 s: UCX 1.13's keepalive never reported a dead shared-memory peer
 * while a rendezvous send to it was pending (measured), while the pidfd
 * sees the exit at once (a zombie counts as exited); TS_UCX_PID_WATCH=0
 * turns the watch off. progress() then
 * cancels (ucp_request_cancel) every receive posted from a dead peer and
 * abandons every send to it; both complete with TS_ERR_PEER_FAILED. New
 * sends to or receives from a dead peer fail at once. UCX's keepalive
 * (UCX_KEEPALIVE_INTERVAL, 1 s here) and the pid check both run inside
 * progress: the driving thread must progress at least every ~100 ms (poll
 * with a timeout).
 *
 *
 * Shared-memory bypass for large messages (TS_UCX_CMA_MIN bytes or more
 * between processes of one host, both ways agreed at connection):
 * comm/ucx_shm.c, which says why and how.
 *
 *
 * Bounded waits: cancel_all and destroy progress for at most
 * TS_UCX_DRAIN_S seconds. An op UCX does not give back in time is
 * "orphaned": its user callback runs with the requested status and the op
 * stays on the pending list (UCX may still touch it) until UCX returns it;
 * destroy force-closes every endpoint (which returns what it can), and if
 * requests are still held it skips ucp_worker_destroy and ucp_cleanup
 * (leaking them) rather than hang or free memory UCX may still use.
 */
#include "comm/ucx_internal.h"
#include "comm/xmem.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <poll.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <ucs/debug/log_def.h>
#include <unistd.h>

#define TS_UCX_MAX_SIZE (1 << 14)
#define TS_UCX_DRAIN_S 2.0
/* After a peer's death the drain is shorter: a rendezvous receive from the
 * dead peer that UCX had already matched is never given back, and nothing
 * more can arrive from a dead process; waiting longer only delays the
 * survivors' error (the target: under 2 s; docs/design.md D8). */
#define TS_UCX_DRAIN_DEAD_S 0.5
#define TS_UCX_PID_CHECK_S 0.25

/* The address header is its wire layout, field for field (the top). */
_Static_assert(offsetof(ts_ucx_addr_hdr, pid) == 4 && offsetof(ts_ucx_addr_hdr, host) == 8 &&
                   offsetof(ts_ucx_addr_hdr, cookie_addr) == 8 + TS_UCX_HOST_LEN &&
                   offsetof(ts_ucx_addr_hdr, cookie) == 16 + TS_UCX_HOST_LEN &&
                   sizeof(ts_ucx_addr_hdr) == 24 + TS_UCX_HOST_LEN,
               "ts_ucx_addr_hdr has no padding");

/* ------------------------------------------------------- registrations
 *
 * Pinned host memory (base.h) is mapped once with ucp_mem_map and its
 * memh passed with every send or receive whose buffer lies inside it
 * (UCX 1.13 accepts a memh that covers the buffer, measured; a memh of
 * another buffer fails the transfer with "mismatched memory handle"),
 * so that UCX does not register (or look up its registration cache for)
 * that buffer on each transfer. On shared memory the registration is
 * trivial (posix, sysv, cma); on RDMA networks it is what zero-copy
 * needs. */
typedef struct ucx_region {
    uintptr_t addr;
    size_t len;
    ucp_mem_h memh;
} ucx_region;

/* The region that holds [buf, buf + len), or NULL. */
static ucp_mem_h region_memh(const ts_ucx *t, const void *buf, size_t len)
{
    uintptr_t b = (uintptr_t)buf;
    int lo = 0, hi = t->n_regions - 1, at = -1;
    while (lo <= hi) { /* the last region starting at or below b */
        int mid = (lo + hi) / 2;
        if (t->regions[mid].addr <= b) {
            at = mid;
            lo = mid + 1;
        } else {
            hi = mid - 1;
        }
    }
    if (at < 0 || b - t->regions[at].addr > t->regions[at].len || len > t->regions[at].len - (b - t->regions[at].addr))
        return NULL;
    return t->regions[at].memh;
}

/* ------------------------------------------------------------ UCX's log
 *
 * UCX prints its ERROR and WARN lines straight to stderr, also on paths
 * this library expects and reports itself: a peer that died or exited
 * ("Connection reset by remote peer", endpoint timeouts), requests left
 * behind by a failure ("was not returned to mpool"), messages that arrive
 * for receives cancelled after a failure. Unless the user set
 * UCX_LOG_LEVEL (then UCX prints what it was asked to), a handler pushed
 * before the first ucp_init routes them through our own log instead: at
 * debug level once this process has seen a peer fail or is tearing a
 * worker down, and for the known expected-path messages; otherwise (a
 * genuine, unexpected UCX error) as our own warning. FATAL lines go to
 * UCX's handler as before (UCX aborts after them). */
static atomic_bool g_ucx_trouble; /* a peer of this process failed (sticky) */
static atomic_int g_ucx_teardown; /* cancel_all or destroy running */
static pthread_once_t g_ucx_log_once = PTHREAD_ONCE_INIT;

static bool expected_ucx_message(const char *m)
{
    static const char *const known[] = {
        "Connection reset",  "remote peer", "Endpoint timeout",   "not returned to mpool", "Request canceled",
        "Message truncated", "unexpected",  "Input/output error", "No such process",       "Destination is unreachable",
        "Broken pipe"};
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
        if (strstr(m, known[i])) return true;
    return false;
}

static ucs_log_func_rc_t ucx_log_handler(const char *file, unsigned line, const char *function, ucs_log_level_t level,
                                         const ucs_log_component_config_t *comp, const char *fmt, va_list ap)
{
    (void)function;
    if (level == UCS_LOG_LEVEL_FATAL || level > UCS_LOG_LEVEL_WARN) return UCS_LOG_FUNC_RC_CONTINUE;
    if (comp && level > comp->log_level)
        return UCS_LOG_FUNC_RC_STOP; /* below UCX's own threshold: it would not print it either */
    char msg[512];
    va_list cp;
    va_copy(cp, ap);
    vsnprintf(msg, sizeof msg, fmt, cp);
    va_end(cp);
    const char *base = file ? strrchr(file, '/') : NULL;
    base = base ? base + 1 : file ? file : "?";
    const char *lv = level == UCS_LOG_LEVEL_ERROR ? "error" : "warning";
    if (atomic_load(&g_ucx_trouble) || atomic_load(&g_ucx_teardown) > 0 || expected_ucx_message(msg))
        ts_logf(TS_LOG_DEBUG, "ucx %s (%s:%u; expected, the library reports the failure itself): %s", lv, base, line,
                msg);
    else ts_logf(TS_LOG_WARN, "ucx %s (%s:%u): %s", lv, base, line, msg);
    return UCS_LOG_FUNC_RC_STOP;
}

static void ucx_log_install(void)
{
    if (getenv("UCX_LOG_LEVEL")) return;
    ucs_log_push_handler(ucx_log_handler);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ------------------------------------------------------------ op lists */

static void pending_add(ts_ucx *t, ucx_op *op)
{
    op->next = &t->pending;
    op->prev = t->pending.prev;
    t->pending.prev->next = op;
    t->pending.prev = op;
    t->npending++;
}

static void pending_remove(ts_ucx *t, ucx_op *op)
{
    op->prev->next = op->next;
    op->next->prev = op->prev;
    op->prev = op->next = NULL;
    t->npending--;
}

static void done_push(ts_ucx *t, ucx_op *op)
{
    op->next = NULL;
    if (t->done_tail) t->done_tail->next = op;
    else t->done_head = op;
    t->done_tail = op;
}

/* UCX gave the op back (callback, or completion in place). */
static void op_finished(ucx_op *op, ucs_status_t status, size_t rlen)
{
    ts_ucx *t = op->t;
    op->ucs = status;
    op->rlen = rlen;
    pending_remove(t, op);
    done_push(t, op);
}

static void send_cb(void *request, ucs_status_t status, void *user_data)
{
    (void)request;
    ucx_op *op = user_data;
    op_finished(op, status, op->len);
}

static void recv_cb(void *request, ucs_status_t status, const ucp_tag_recv_info_t *info, void *user_data)
{
    (void)request;
    ucx_op *op = user_data;
    op_finished(op, status, info ? info->length : 0);
}

static void ep_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    (void)ep;
    ucx_peer *p = arg;
    ts__ucx_mark_dead(p->t, p, status);
}

void ts__ucx_mark_dead(ts_ucx *t, ucx_peer *p, ucs_status_t status)
{
    if (p->dead) return;
    p->dead = true;
    p->dead_status = status;
    t->dead_unhandled = true;
    atomic_store(&g_ucx_trouble, true);
    if (t->failed_peer < 0) {
        t->failed_peer = p->rank;
        t->failed_status = TS_ERR_PEER_FAILED;
    }
}

/* Same-host peers: UCX 1.13's keepalive misses a dead shared-memory peer
 * while a rendezvous send to it is pending (measured: never detected), so
 * progress also polls each local peer's pidfd (readable once the process
 * has exited, zombie included), at most every TS_UCX_PID_CHECK_S. */
static void check_peer_pids(ts_ucx *t)
{
    double now = now_s();
    if (now < t->next_pid_check) return;
    t->next_pid_check = now + TS_UCX_PID_CHECK_S;
    for (int r = 0; r < t->base.size; r++) {
        ucx_peer *p = &t->peers[r];
        if (p->pidfd < 0 || p->dead) continue;
        struct pollfd pf = {.fd = p->pidfd, .events = POLLIN};
        if (poll(&pf, 1, 0) == 1 && (pf.revents & (POLLIN | POLLHUP | POLLERR))) {
            p->exited = true;
            ts__ucx_mark_dead(t, p, UCS_ERR_CONNECTION_RESET);
        }
    }
}

static const char *dead_why(const ucx_peer *p)
{
    return p->exited ? "its process exited" : ucs_status_string(p->dead_status);
}

/* The status of a finished op, with the error detail recorded. */
static ts_status op_status(ts_ucx *t, ucx_op *op)
{
    char whatb[128];
    if (op->ulen) /* a bypass piece: describe the user's transfer it serves */
        snprintf(whatb, sizeof whatb, "%s (shared-memory rendezvous, %s)",
                 (op->xbits == TS_UCX_ACK) == op->is_recv ? "send" : "receive",
                 op->xbits == TS_UCX_CTRL ? (op->is_recv ? "waiting for its control message" : "control message")
                                          : (op->is_recv ? "waiting for the acknowledgement" : "acknowledgement"));
    const char *what = op->ulen ? whatb : op->is_recv ? "receive" : "send";
    if (op->ulen) {
        bool user_recv = (op->xbits == TS_UCX_ACK) != op->is_recv;
        const char *d = user_recv ? "from" : "to";
        if (op->forced == TS_ERR_PEER_FAILED || (op->ucs != UCS_OK && t->peers[op->peer].dead))
            return ts_error(
                TS_ERR_PEER_FAILED, "ucx: rank %d: %s of %zu bytes %s rank %d (tag 0x%" PRIx64 "): rank %d failed (%s)",
                t->base.rank, what, op->ulen, d, op->peer, op->tag, op->peer, dead_why(&t->peers[op->peer]));
        if (op->forced != TS_OK)
            return ts_error(op->forced, "ucx: rank %d: %s of %zu bytes %s rank %d (tag 0x%" PRIx64 ") cancelled",
                            t->base.rank, what, op->ulen, d, op->peer, op->tag);
        if (op->ucs != UCS_OK || (op->is_recv && op->rlen != op->len))
            return ts_error(TS_ERR_COMM, "ucx: rank %d: %s of %zu bytes %s rank %d (tag 0x%" PRIx64 ") failed: %s",
                            t->base.rank, what, op->ulen, d, op->peer, op->tag,
                            op->ucs != UCS_OK ? ucs_status_string(op->ucs) : "bad message length");
        return TS_OK;
    }
    const char *dir = op->is_recv ? "from" : "to";
    if (op->forced != TS_OK) {
        if (op->forced == TS_ERR_PEER_FAILED)
            return ts_error(
                TS_ERR_PEER_FAILED, "ucx: rank %d: %s of %zu bytes %s rank %d (tag 0x%" PRIx64 "): rank %d failed (%s)",
                t->base.rank, what, op->len, dir, op->peer, op->tag, op->peer, dead_why(&t->peers[op->peer]));
        return ts_error(op->forced, "ucx: rank %d: %s of %zu bytes %s rank %d (tag 0x%" PRIx64 ") cancelled",
                        t->base.rank, what, op->len, dir, op->peer, op->tag);
    }
    if (op->ucs == UCS_OK) {
        if (op->is_recv && op->len_out && op->rlen <= op->len) {
            *op->len_out = op->rlen;
            return TS_OK;
        }
        if (op->is_recv && op->rlen != op->len)
            return ts_error(TS_ERR_COMM,
                            "ucx: rank %d: receive from rank %d (tag 0x%" PRIx64 "): got %zu bytes, expected %zu",
                            t->base.rank, op->peer, op->tag, op->rlen, op->len);
        return TS_OK;
    }
    if (op->ucs == UCS_ERR_MESSAGE_TRUNCATED)
        return ts_error(TS_ERR_COMM,
                        "ucx: rank %d: receive from rank %d (tag 0x%" PRIx64
                        "): message longer than the %zu-byte buffer (%zu bytes reported): %s",
                        t->base.rank, op->peer, op->tag, op->len, op->rlen, ucs_status_string(op->ucs));
    if (t->peers[op->peer].dead)
        return ts_error(TS_ERR_PEER_FAILED,
                        "ucx: rank %d: %s of %zu bytes %s rank %d (tag 0x%" PRIx64 "): rank %d failed: %s",
                        t->base.rank, what, op->len, dir, op->peer, op->tag, op->peer, ucs_status_string(op->ucs));
    return ts_error(TS_ERR_COMM, "ucx: rank %d: %s of %zu bytes %s rank %d (tag 0x%" PRIx64 ") failed: %s",
                    t->base.rank, what, op->len, dir, op->peer, op->tag, ucs_status_string(op->ucs));
}

static void op_release(ts_ucx *t, ucx_op *op);

/* Runs the completed queue; returns how many user callbacks ran. */
static int run_completions(ts_ucx *t)
{
    int n = 0;
    while (t->done_head) {
        ucx_op *op = t->done_head;
        t->done_head = op->next;
        if (!t->done_head) t->done_tail = NULL;
        if (op->req) ucp_request_free(op->req);
        if (!op->orphan || op->notify) { /* an orphan whose callback has not run yet gets it now */
            op->notify = false;
            ts_status s = op_status(t, op);
            n++;
            if (op->cb) op->cb(op->arg, s);
        }
        op_release(t, op);
    }
    return n;
}

/* Runs the user callbacks of ops orphaned since the last call (marked
 * `notify`); one at a time, rescanning, since a callback may post (or
 * cancel) transfers. */
static int run_notifies(ts_ucx *t)
{
    int n = 0;
    for (;;) {
        ucx_op *op = t->pending.next;
        while (op != &t->pending && !op->notify) op = op->next;
        if (op == &t->pending) break;
        op->notify = false;
        ts_status s = op_status(t, op);
        n++;
        if (op->cb) op->cb(op->arg, s);
    }
    return n;
}

/* Fails the transfers with peers found dead since the last call: cancels
 * the receives (UCX then gives them back), and abandons the sends, whose
 * user callbacks run now with TS_ERR_PEER_FAILED. A send to a dead peer
 * is not always given back by UCX 1.13 (a rendezvous send waiting for the
 * peer's reply stays pending), and its buffer is only ever read by the
 * peer (CMA) or copied at posting time (eager), so the user may reuse it.
 * The op stays on the pending list until UCX returns it (or destroy). */
static int handle_dead_peers(ts_ucx *t)
{
    if (!t->dead_unhandled) return 0;
    t->dead_unhandled = false;
    for (ucx_op *op = t->pending.next, *nx; op != &t->pending; op = nx) {
        nx = op->next; /* ucp_request_cancel may complete op in place, moving it */
        if (op->orphan || !t->peers[op->peer].dead) continue;
        op->forced = TS_ERR_PEER_FAILED;
        if (op->is_recv && !op->cancelled) {
            op->cancelled = true;
            if (op->req) ucp_request_cancel(t->worker, op->req);
        } else if (!op->is_recv) {
            op->orphan = true;
            op->notify = true;
        }
    }
    return run_notifies(t);
}

/* ---------------------------------------------------------- the vtable */

static ts_status check_args(ts_ucx *t, const char *what, int peer, const void *buf, size_t len, uint64_t tag)
{
    if (peer < 0 || peer >= t->base.size)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ucx: %s: peer %d is not a rank of a world of %d", what, peer,
                        t->base.size);
    if (!buf && len) return ts_error(TS_ERR_INVALID_ARGUMENT, "ucx: %s: NULL buffer of %zu bytes", what, len);
    if (tag >> TS_UCX_RANK_SHIFT)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "ucx: %s: tag 0x%" PRIx64 " uses bits 48..63 (reserved for the source rank)", what, tag);
    if (t->peers[peer].dead)
        return ts_error(TS_ERR_PEER_FAILED, "ucx: %s: rank %d has failed (%s)", what, peer, dead_why(&t->peers[peer]));
    return TS_OK;
}

/* Finished ops are kept for the next transfers (at most TS_UCX_OP_CACHE;
 * destroy frees them): a small collective otherwise spent about as long
 * in the allocator (64-byte aligned blocks) as on the wire. */
#define TS_UCX_OP_CACHE 64

static void op_release(ts_ucx *t, ucx_op *op)
{
    if (t->n_free < TS_UCX_OP_CACHE) {
        op->next = t->free_ops;
        t->free_ops = op;
        t->n_free++;
        return;
    }
    ts__free(TS_MEM_COMM, op);
}

static ucx_op *op_new(ts_ucx *t, int peer, size_t len, uint64_t tag, bool is_recv, ts_xfer_cb cb, void *arg)
{
    ucx_op *op = t->free_ops;
    if (op) {
        t->free_ops = op->next;
        t->n_free--;
        memset(op, 0, sizeof *op);
    } else if (!(op = ts__calloc(TS_MEM_COMM, 1, sizeof *op))) {
        return NULL;
    }
    op->t = t;
    op->peer = peer;
    op->len = len;
    op->tag = tag;
    op->is_recv = is_recv;
    op->cb = cb;
    op->arg = arg;
    op->forced = TS_OK;
    return op;
}

/* A transfer with a buffer of its own: passes the memh of the registered
 * region that holds it, if one does, and counts it (xfer_stats). */
static void count_xfer(ts_ucx *t, ucp_request_param_t *prm, const void *buf, size_t len)
{
    atomic_fetch_add_explicit(&t->xfers, 1, memory_order_relaxed);
    ucp_mem_h mh = t->n_regions ? region_memh(t, buf, len) : NULL;
    if (!mh) return;
    prm->op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    prm->memh = mh;
    atomic_fetch_add_explicit(&t->xfers_memh, 1, memory_order_relaxed);
}

/* One UCX send (ucx_internal.h). */
ts_status ts__ucx_send_raw(ts_ucx *t, int peer, const void *buf, size_t len, uint64_t tag, uint64_t xbits, size_t ulen,
                           const void *inl, ts_xfer_cb cb, void *arg)
{
    ucx_op *op = op_new(t, peer, len, tag, false, cb, arg);
    if (!op) return ts_error(TS_ERR_NO_MEMORY, "ucx: send: out of memory");
    op->ulen = ulen;
    op->xbits = xbits;
    if (!buf && inl && len <= sizeof op->inl) {
        memcpy(op->inl, inl, len);
        buf = op->inl;
    }
    ucp_request_param_t prm = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE,
        .cb.send = send_cb,
        .user_data = op,
        .datatype = ucp_dt_make_contig(1),
    };
    if (buf != op->inl && len) count_xfer(t, &prm, buf, len);
    ucp_tag_t utag = (((uint64_t)t->base.rank << TS_UCX_RANK_SHIFT) ^ tag) | xbits;
    pending_add(t, op);
    void *r = ucp_tag_send_nbx(t->peers[peer].ep, buf, len, utag, &prm);
    if (UCS_PTR_IS_ERR(r)) {
        ucs_status_t us = UCS_PTR_STATUS(r);
        pending_remove(t, op);
        op_release(t, op);
        return ts_error(t->peers[peer].dead ? TS_ERR_PEER_FAILED : TS_ERR_COMM,
                        "ucx: rank %d: send of %zu bytes to rank %d (tag 0x%" PRIx64 ") failed: %s", t->base.rank,
                        ulen ? ulen : len, peer, tag, ucs_status_string(us));
    }
    if (r == NULL) op_finished(op, UCS_OK, len); /* in place: the callback runs from the next progress */
    else op->req = r;
    return TS_OK;
}

/* One UCX receive (ucx_internal.h). */
ts_status ts__ucx_recv_raw(ts_ucx *t, int peer, void *buf, size_t len, uint64_t tag, uint64_t xbits, size_t ulen,
                           ts_xfer_cb cb, void *arg, ucx_op **op_out)
{
    ucx_op *op = op_new(t, peer, len, tag, true, cb, arg);
    if (!op) return ts_error(TS_ERR_NO_MEMORY, "ucx: recv: out of memory");
    op->ulen = ulen;
    op->xbits = xbits;
    if (!buf && len && len <= sizeof op->inl) buf = op->inl;
    if (op_out) *op_out = op;
    ucp_request_param_t prm = {
        /* NO_IMM_CMPL: a receive that matches a message already here
         * still calls recv_cb (inside ucp_tag_recv_nbx), which is where the
         * received length comes from; recv_cb only queues the op. */
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE |
            UCP_OP_ATTR_FLAG_NO_IMM_CMPL,
        .cb.recv = recv_cb,
        .user_data = op,
        .datatype = ucp_dt_make_contig(1),
    };
    if (buf != op->inl && len) count_xfer(t, &prm, buf, len);
    ucp_tag_t utag = (((uint64_t)peer << TS_UCX_RANK_SHIFT) ^ tag) | xbits;
    pending_add(t, op);
    void *r = ucp_tag_recv_nbx(t->worker, buf, len, utag, ~(ucp_tag_t)0, &prm);
    if (UCS_PTR_IS_ERR(r)) {
        ucs_status_t us = UCS_PTR_STATUS(r);
        pending_remove(t, op);
        op_release(t, op);
        if (op_out) *op_out = NULL;
        return ts_error(TS_ERR_COMM, "ucx: rank %d: receive of %zu bytes from rank %d (tag 0x%" PRIx64 ") failed: %s",
                        t->base.rank, ulen ? ulen : len, peer, tag, ucs_status_string(us));
    }
    if (r == NULL) /* not expected with NO_IMM_CMPL; the length is then unknown */
        op_finished(op, UCS_OK, len);
    else op->req = r;
    return TS_OK;
}

static ts_status ucx_send(ts_transport *base, int peer, const void *buf, size_t len, uint64_t tag, ts_xfer_cb cb,
                          void *arg)
{
    ts_ucx *t = (ts_ucx *)base;
    ts_status s = check_args(t, "send", peer, buf, len, tag);
    if (s != TS_OK) return s;
    if (len >= TS_UCX_CMA_MIN && t->peers[peer].cma_send) return ts__ucx_shm_send(t, peer, buf, len, tag, cb, arg);
    return ts__ucx_send_raw(t, peer, buf, len, tag, 0, 0, NULL, cb, arg);
}

static ts_status ucx_recv(ts_transport *base, int peer, void *buf, size_t len, uint64_t tag, ts_xfer_cb cb, void *arg)
{
    ts_ucx *t = (ts_ucx *)base;
    ts_status s = check_args(t, "recv", peer, buf, len, tag);
    if (s != TS_OK) return s;
    if (len >= TS_UCX_CMA_MIN && t->peers[peer].cma_recv) return ts__ucx_shm_recv(t, peer, buf, len, tag, cb, arg);
    return ts__ucx_recv_raw(t, peer, buf, len, tag, 0, 0, cb, arg, NULL);
}

/* A receive of at most len bytes (transport.h): never the bypass, which
 * needs the exact length on both sides. */
static ts_status ucx_recv_upto(ts_transport *base, int peer, void *buf, size_t len, uint64_t tag, ts_xfer_cb cb,
                               void *arg, size_t *len_out)
{
    ts_ucx *t = (ts_ucx *)base;
    ts_status s = check_args(t, "recv", peer, buf, len, tag);
    if (s != TS_OK) return s;
    if (len >= TS_UCX_CMA_MIN || !len_out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ucx: rank %d: recv_upto of %zu bytes from rank %d: %s", t->base.rank,
                        len, peer, len_out ? "at least the bypass's 256 KiB" : "NULL len_out");
    ucx_op *op = NULL;
    s = ts__ucx_recv_raw(t, peer, buf, len, tag, 0, 0, cb, arg, &op);
    if (s == TS_OK && op) op->len_out = len_out; /* read by op_status, from progress: never before this */
    return s;
}

_Static_assert(sizeof(ucp_dt_iov_t) == sizeof(ts_iov) && TS_IOV_MAX * sizeof(ucp_dt_iov_t) <= 48,
               "the pieces of a message fit an op's inline buffer");

/* sendv / recvv_upto (transport.h): UCX's iov datatype over the pieces,
 * whose list lives in the op's inline buffer for as long as UCX holds
 * the op. Never the bypass. */
static ts_status ucx_xferv(ts_ucx *t, bool is_recv, int peer, const ts_iov *iov, int n, uint64_t tag, ts_xfer_cb cb,
                           void *arg, size_t *len_out)
{
    const char *what = is_recv ? "recvv" : "sendv";
    if (n < 1 || n > TS_IOV_MAX)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ucx: %s of %d pieces (1..%d)", what, n, TS_IOV_MAX);
    size_t total = 0;
    for (int i = 0; i < n; i++) total += iov[i].len;
    ts_status s = check_args(t, what, peer, iov[0].buf ? iov[0].buf : (void *)iov, total, tag);
    if (s != TS_OK) return s;
    if (total >= TS_UCX_CMA_MIN || (is_recv && !len_out))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ucx: rank %d: %s of %zu bytes with rank %d: %s", t->base.rank, what,
                        total, peer, len_out || !is_recv ? "at least the bypass's 256 KiB" : "NULL len_out");
    ucx_op *op = op_new(t, peer, total, tag, is_recv, cb, arg);
    if (!op) return ts_error(TS_ERR_NO_MEMORY, "ucx: %s: out of memory", what);
    ucp_dt_iov_t *v = (ucp_dt_iov_t *)(void *)op->inl;
    for (int i = 0; i < n; i++) v[i] = (ucp_dt_iov_t){.buffer = iov[i].buf, .length = iov[i].len};
    op->len_out = is_recv ? len_out : NULL;
    atomic_fetch_add_explicit(&t->xfers, 1, memory_order_relaxed);
    ucp_request_param_t prm = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE |
            (is_recv ? UCP_OP_ATTR_FLAG_NO_IMM_CMPL : 0),
        .user_data = op,
        .datatype = ucp_dt_make_iov(),
    };
    if (is_recv) prm.cb.recv = recv_cb;
    else prm.cb.send = send_cb;
    ucp_tag_t utag = ((uint64_t)(is_recv ? peer : t->base.rank) << TS_UCX_RANK_SHIFT) ^ tag;
    pending_add(t, op);
    void *r = is_recv ? ucp_tag_recv_nbx(t->worker, v, (size_t)n, utag, ~(ucp_tag_t)0, &prm)
                      : ucp_tag_send_nbx(t->peers[peer].ep, v, (size_t)n, utag, &prm);
    if (UCS_PTR_IS_ERR(r)) {
        ucs_status_t us = UCS_PTR_STATUS(r);
        pending_remove(t, op);
        op_release(t, op);
        return ts_error(!is_recv && t->peers[peer].dead ? TS_ERR_PEER_FAILED : TS_ERR_COMM,
                        "ucx: rank %d: %s of %zu bytes %s rank %d (tag 0x%" PRIx64 ") failed: %s", t->base.rank, what,
                        total, is_recv ? "from" : "to", peer, tag, ucs_status_string(us));
    }
    if (r == NULL) op_finished(op, UCS_OK, total); /* a send done in place (a receive is never, with NO_IMM_CMPL) */
    else op->req = r;
    return TS_OK;
}

static ts_status ucx_sendv(ts_transport *base, int peer, const ts_iov *iov, int n, uint64_t tag, ts_xfer_cb cb,
                           void *arg)
{
    return ucx_xferv((ts_ucx *)base, false, peer, iov, n, tag, cb, arg, NULL);
}

static ts_status ucx_recvv_upto(ts_transport *base, int peer, const ts_iov *iov, int n, uint64_t tag, ts_xfer_cb cb,
                                void *arg, size_t *len_out)
{
    return ucx_xferv((ts_ucx *)base, true, peer, iov, n, tag, cb, arg, len_out);
}

static int ucx_progress(ts_transport *base)
{
    ts_ucx *t = (ts_ucx *)base;
    int n = (int)ucp_worker_progress(t->worker);
    /* a caller spinning on progress calls this every few hundred ns: the
     * clock read of the pid watch (85 ns on a VM) only every 16th call
     * (arm, before every sleep, always checks) */
    if (++t->pid_tick % 16 == 0) check_peer_pids(t);
    n += handle_dead_peers(t);
    return n + run_completions(t);
}

static ts_status ucx_arm(ts_transport *base)
{
    ts_ucx *t = (ts_ucx *)base;
    check_peer_pids(t);
    if (t->done_head || t->dead_unhandled) return TS_ERR_ALREADY;
    ucs_status_t us = ucp_worker_arm(t->worker);
    if (us == UCS_OK) return TS_OK;
    if (us == UCS_ERR_BUSY) return TS_ERR_ALREADY;
    return ts_error(TS_ERR_COMM, "ucx: rank %d: ucp_worker_arm failed: %s", t->base.rank, ucs_status_string(us));
}

static int ucx_wait_fd(ts_transport *base) { return ((ts_ucx *)base)->efd; }

static int ucx_failed_peer(ts_transport *base, ts_status *status_out)
{
    ts_ucx *t = (ts_ucx *)base;
    if (t->failed_peer < 0) return -1;
    if (status_out) *status_out = t->failed_status;
    /* the others found dead by now too (a lost host takes all its ranks):
     * "...; ranks 2, 3 failed too" */
    char also[160] = "";
    size_t used = 0;
    int more = 0;
    for (int r = 0; r < t->base.size && used + 16 < sizeof also; r++)
        if (r != t->failed_peer && t->peers[r].dead)
            used += (size_t)snprintf(also + used, sizeof also - used, "%s%d", more++ ? ", " : "", r);
    if (more)
        ts_error(t->failed_status, "%s; rank%s %s failed too", dead_why(&t->peers[t->failed_peer]), more > 1 ? "s" : "",
                 also);
    else ts_error(t->failed_status, "%s", dead_why(&t->peers[t->failed_peer]));
    return t->failed_peer;
}

/* Progresses until no op is pending or `deadline` passes; true if drained. */
static bool drain(ts_ucx *t, double deadline)
{
    while (t->npending > 0 && now_s() < deadline) {
        ucp_worker_progress(t->worker);
        check_peer_pids(t);
        handle_dead_peers(t);
        run_completions(t);
    }
    run_completions(t);
    return t->npending == 0;
}

static int count_live_pending(ts_ucx *t)
{
    int n = 0;
    for (ucx_op *op = t->pending.next; op != &t->pending; op = op->next) n += !op->orphan;
    return n;
}

static void ucx_cancel_all_locked(ts_ucx *t, ts_status status);

static void ucx_cancel_all(ts_transport *base, ts_status status)
{
    ts_ucx *t = (ts_ucx *)base;
    if (t->world_failed == TS_OK) t->world_failed = status != TS_OK ? status : TS_ERR_COMM;
    atomic_fetch_add(&g_ucx_teardown, 1);
    ucx_cancel_all_locked(t, status);
    atomic_fetch_sub(&g_ucx_teardown, 1);
}

static void ucx_cancel_all_locked(ts_ucx *t, ts_status status)
{
    ts_transport *base = &t->base;
    (void)base;
    for (ucx_op *op = t->pending.next, *nx; op != &t->pending; op = nx) {
        nx = op->next;
        if (op->orphan) continue;
        if (op->forced == TS_OK) op->forced = status;
        /* a bypass send's acknowledgement receive is cancelled too: the
         * send then ends, its live word is cleared, and a peer that reads
         * the buffer later fails instead of taking what it holds then */
        if (op->is_recv && !op->cancelled) {
            op->cancelled = true;
            if (op->req) ucp_request_cancel(t->worker, op->req);
        }
    }
    /* Sends cannot be cancelled in UCX 1.13: they finish (peer alive) or
     * fail (peer dead, PEER mode); wait for them, bounded. */
    double bound = status == TS_ERR_PEER_FAILED ? TS_UCX_DRAIN_DEAD_S : TS_UCX_DRAIN_S;
    double deadline = now_s() + bound;
    while (count_live_pending(t) > 0 && now_s() < deadline) {
        ucp_worker_progress(t->worker);
        check_peer_pids(t);
        handle_dead_peers(t);
        run_completions(t);
    }
    /* A receive that ucp_request_cancel completed at once sits on the done
     * list even when nothing is left pending (the loop above then never
     * ran): its callback must run now, before the caller takes every
     * transfer as finished and frees what the callback points to. */
    run_completions(t);
    for (ucx_op *op = t->pending.next, *nx; op != &t->pending; op = nx) {
        nx = op->next;
        if (op->orphan) continue;
        op->orphan = true;
        op->notify = true;
        ts_logf(ts__ucx_teardown_level(t),
                "ucx: rank %d: %s of %zu bytes %s rank %d still held by UCX after %.1f s; abandoned", t->base.rank,
                op->is_recv ? "receive" : "send", op->ulen ? op->ulen : op->len, op->is_recv ? "from" : "to", op->peer,
                bound);
        /* a bypass acknowledgement receive kept past the cancellation (its
         * peer was alive) is cancelled now, so that UCX gives it back */
        if (op->is_recv && !op->cancelled) {
            op->cancelled = true;
            if (op->req) ucp_request_cancel(t->worker, op->req);
        }
    }
    run_notifies(t);
    /* a cancellation that completed in place moved its op to the done
     * list, where its pending callback runs now */
    run_completions(t);
}

static void ucx_destroy_quiet(ts_transport *base)
{
    ts_ucx *t = (ts_ucx *)base;
    if (!t) return;
    bool stuck = false;
    if (t->worker) {
        atomic_fetch_add(&g_ucx_teardown, 1);
        run_completions(t);
        if (count_live_pending(t) > 0) ucx_cancel_all_locked(t, TS_ERR_COMM); /* the teardown count is held */
        /* Force-close every endpoint (local and immediate; PEER mode makes
         * that safe with data in flight), then wait for the closes. A
         * NONE-mode endpoint to a live peer is flush-closed instead. */
        int nclose = t->base.size;
        void **close_reqs = ts__calloc(TS_MEM_COMM, (size_t)nclose, sizeof *close_reqs);
        for (int r = 0; r < t->base.size; r++) {
            if (!t->peers[r].ep) continue;
            bool force = !t->peers[r].none_mode || t->peers[r].dead;
            ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                                       .flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0};
            void *req = ucp_ep_close_nbx(t->peers[r].ep, &prm);
            t->peers[r].ep = NULL;
            if (req && !UCS_PTR_IS_ERR(req)) {
                if (close_reqs) close_reqs[r] = req;
                else stuck = true; /* cannot track it: do not destroy the worker under it */
            }
        }
        double deadline = now_s() + TS_UCX_DRAIN_S;
        for (;;) {
            bool busy = false;
            for (int r = 0; close_reqs && r < nclose; r++) {
                if (!close_reqs[r]) continue;
                if (ucp_request_check_status(close_reqs[r]) == UCS_INPROGRESS) {
                    busy = true;
                } else {
                    ucp_request_free(close_reqs[r]);
                    close_reqs[r] = NULL;
                }
            }
            if (!busy || now_s() >= deadline) {
                stuck = stuck || busy;
                break;
            }
            ucp_worker_progress(t->worker);
        }
        ts__free(TS_MEM_COMM, close_reqs);
        if (!drain(t, now_s() + 0.5)) stuck = true;
        if (stuck) {
            ts_logf(ts__ucx_teardown_level(t),
                    "ucx: rank %d: requests still held by UCX at destroy; leaking the worker", t->base.rank);
        } else {
            ucp_worker_destroy(t->worker);
        }
    }
    if (t->ctx && !stuck) {
        for (int i = 0; i < t->n_regions; i++) /* comm.c deregisters first; whatever is left */
            ucp_mem_unmap(t->ctx, t->regions[i].memh);
        t->n_regions = 0;
        ucp_cleanup(t->ctx);
    }
    if (!stuck) ts__free(TS_MEM_COMM, t->regions);
    if (t->worker) atomic_fetch_sub(&g_ucx_teardown, 1);
    while (t->free_ops) { /* UCX holds none of these */
        ucx_op *op = t->free_ops;
        t->free_ops = op->next;
        ts__free(TS_MEM_COMM, op);
    }
    t->n_free = 0;
    for (int r = 0; t->peers && r < t->base.size; r++)
        if (t->peers[r].pidfd >= 0) {
            close(t->peers[r].pidfd);
            t->peers[r].pidfd = -1;
        }
    if (!stuck) {
        ts__free(TS_MEM_COMM, t->peers);
        ts__free(TS_MEM_COMM, t);
    }
}

/* A teardown: it never writes the last error (the cancelled requests'
 * callbacks may record theirs), so that the error it follows keeps its
 * detail (docs/design.md, D1). */
static void ucx_destroy(ts_transport *base)
{
    ts__error_quiet_begin();
    ucx_destroy_quiet(base);
    ts__error_quiet_end();
}

static ts_status ucx_mem_register(ts_transport *base, void *addr, size_t len, void **handle_out)
{
    ts_ucx *t = (ts_ucx *)base;
    if (!addr || !len || !handle_out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ucx: mem_register: NULL or empty region (%p, %zu bytes)", addr, len);
    if (t->n_regions == t->cap_regions) {
        int cap = t->cap_regions ? 2 * t->cap_regions : 16;
        ucx_region *nr = ts__calloc(TS_MEM_COMM, (size_t)cap, sizeof *nr);
        if (!nr) return ts_error(TS_ERR_NO_MEMORY, "ucx: mem_register: out of memory");
        if (t->n_regions) memcpy(nr, t->regions, (size_t)t->n_regions * sizeof *nr);
        ts__free(TS_MEM_COMM, t->regions);
        t->regions = nr;
        t->cap_regions = cap;
    }
    ucp_mem_map_params_t mp = {
        .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH, .address = addr, .length = len};
    ucp_mem_h mh = NULL;
    ucs_status_t us = ucp_mem_map(t->ctx, &mp, &mh);
    if (us != UCS_OK)
        return ts_error(TS_ERR_COMM, "ucx: rank %d: ucp_mem_map of %zu bytes at %p failed: %s", t->base.rank, len, addr,
                        ucs_status_string(us));
    int at = t->n_regions;
    while (at > 0 && t->regions[at - 1].addr > (uintptr_t)addr) {
        t->regions[at] = t->regions[at - 1];
        at--;
    }
    t->regions[at] = (ucx_region){(uintptr_t)addr, len, mh};
    t->n_regions++;
    *handle_out = mh;
    return TS_OK;
}

static void ucx_mem_deregister(ts_transport *base, void *handle)
{
    ts_ucx *t = (ts_ucx *)base;
    for (int i = 0; i < t->n_regions; i++) {
        if (t->regions[i].memh != handle) continue;
        ucp_mem_unmap(t->ctx, t->regions[i].memh);
        memmove(&t->regions[i], &t->regions[i + 1], (size_t)(t->n_regions - i - 1) * sizeof *t->regions);
        t->n_regions--;
        return;
    }
}

static void ucx_xfer_stats(ts_transport *base, uint64_t *posted_out, uint64_t *registered_out)
{
    ts_ucx *t = (ts_ucx *)base;
    if (posted_out) *posted_out = atomic_load_explicit(&t->xfers, memory_order_relaxed);
    if (registered_out) *registered_out = atomic_load_explicit(&t->xfers_memh, memory_order_relaxed);
}

/* The direct collectives' test (transport.h, peer_pid): the same
 * agreement as the bypass's, in both directions. */
static int ucx_peer_pid(ts_transport *base, int peer)
{
    ts_ucx *t = (ts_ucx *)base;
    if (peer < 0 || peer >= t->base.size || peer == t->base.rank) return 0;
    const ucx_peer *p = &t->peers[peer];
    return p->same_host && p->cma_recv && p->cma_send ? (int)p->pid : 0;
}

static const ts_transport_vtable ucx_vtable = {
    .name = "ucx",
    .send = ucx_send,
    .recv = ucx_recv,
    .progress = ucx_progress,
    .arm = ucx_arm,
    .wait_fd = ucx_wait_fd,
    .failed_peer = ucx_failed_peer,
    .cancel_all = ucx_cancel_all,
    .destroy = ucx_destroy,
    .mem_register = ucx_mem_register,
    .mem_deregister = ucx_mem_deregister,
    .xfer_stats = ucx_xfer_stats,
    .peer_pid = ucx_peer_pid,
    .recv_upto = ucx_recv_upto,
    .sendv = ucx_sendv,
    .recvv_upto = ucx_recvv_upto,
};

/* ------------------------------------------------------------- create */
/* ------------------------------------------------------- the address */

size_t ts__ucx_addr_encode(const ts_ucx_addr *a, void *out, size_t cap)
{
    size_t len = TS_UCX_HDR + a->worker_len;
    if (out && cap >= len) {
        memcpy(out, &a->hdr, TS_UCX_HDR);
        memcpy((unsigned char *)out + TS_UCX_HDR, a->worker, a->worker_len);
    }
    return len;
}

ts_status ts__ucx_addr_decode(const void *val, size_t len, int rank, const char *key, ts_ucx_addr *out)
{
    ts_ucx_addr_hdr h;
    if (len <= TS_UCX_HDR)
        return ts_error(TS_ERR_FORMAT,
                        "ucx: rank %d: the store's '%s' (%zu bytes) is not a tensorshard UCX address: "
                        "not longer than its %zu-byte header",
                        rank, key, len, (size_t)TS_UCX_HDR);
    memcpy(&h, val, TS_UCX_HDR);
    if (h.magic != TS_UCX_MAGIC)
        return ts_error(TS_ERR_FORMAT,
                        "ucx: rank %d: the store's '%s' (%zu bytes) is not a tensorshard UCX address: "
                        "magic 0x%08x, expected 0x%08x",
                        rank, key, len, (unsigned)h.magic, (unsigned)TS_UCX_MAGIC);
    *out = (ts_ucx_addr){.hdr = h, .worker = (const unsigned char *)val + TS_UCX_HDR, .worker_len = len - TS_UCX_HDR};
    return TS_OK;
}

/* ------------------------------------------------------------- create */

static void env_default(const char *name, const char *value)
{
    if (!getenv(name)) setenv(name, value, 0);
}

/* The kernel's TCP keepalive on UCX's tcp sockets (UCX_TCP_KEEPIDLE,
 * _KEEPINTVL, _KEEPCNT) reports a peer whose host stopped answering
 * probes, which UCX 1.13 passes on as UCS_ERR_ENDPOINT_TIMEOUT (the status
 * of every failed tcp endpoint). UCX's defaults give up after 10 s idle
 * plus the system's probe count at 2 s (9: 28 s), and older releases
 * after 1 s probes (UCX PR #7093 lengthened them for false failures under
 * congestion). A silent host is what the collectives' deadline
 * (TS_DIST_TIMEOUT) is for, so unless the user set them the probes span
 * at least that deadline: 10 s idle, then probes every
 * max(2 s, (T - 10) / 127) s, as many as reach T (3 to 127, the kernel's
 * limit). Set only when UCX_TLS has tcp (otherwise UCX would warn that they
 * are unused). A dead process's connections are reset by its kernel at
 * once, which this does not delay. */
static void tcp_keepalive_defaults(double timeout_s)
{
    const char *tls = getenv("UCX_TLS");
    if (!tls || !(strstr(tls, "tcp") || strstr(tls, "all") || tls[0] == '^')) return;
    const double idle = 10.0;
    double span = timeout_s > idle ? timeout_s - idle : 0.0;
    double intvl = ceil(span / 127.0);
    if (intvl < 2.0) intvl = 2.0;
    if (intvl > 3600.0) intvl = 3600.0;
    double cnt = ceil(span / intvl);
    if (cnt < 3.0) cnt = 3.0;
    if (cnt > 127.0) cnt = 127.0;
    char buf[32];
    snprintf(buf, sizeof buf, "%.0fs", idle);
    env_default("UCX_TCP_KEEPIDLE", buf);
    snprintf(buf, sizeof buf, "%.0fs", intvl);
    env_default("UCX_TCP_KEEPINTVL", buf);
    snprintf(buf, sizeof buf, "%.0f", cnt);
    env_default("UCX_TCP_KEEPCNT", buf);
}

/* One info-level line per rank: which peers share its host (shared
 * memory, the pid watch; "bypass" when large messages take it both ways)
 * and which are on other hosts (the network). */
static void log_hosts(const ts_ucx *t)
{
    if (!TS_LOG_ENABLED(TS_LOG_INFO)) return;
    char same[512] = "", other[512] = "";
    size_t ns = 0, no = 0;
    for (int r = 0; r < t->base.size; r++) {
        if (r == t->base.rank) continue;
        const ucx_peer *p = &t->peers[r];
        char *buf = p->same_host ? same : other;
        size_t *used = p->same_host ? &ns : &no;
        if (*used + 24 >= sizeof same) {
            if (*used + 4 < sizeof same) *used += (size_t)snprintf(buf + *used, sizeof same - *used, " ...");
            continue;
        }
        *used += (size_t)snprintf(buf + *used, sizeof same - *used, "%s%d%s", *used ? " " : "", r,
                                  p->same_host && p->cma_recv && p->cma_send ? "(bypass)" : "");
    }
    ts_logf(TS_LOG_INFO, "ucx: rank %d: same host: [%s]; other hosts: [%s]", t->base.rank, same, other);
}

/* The knobs of one transport, read from the environment at creation. */
typedef struct ucx_knobs {
    /* TS_UCX_ERROR_MODE: "peer" (default) puts every endpoint in PEER
     * error mode; "local-none" puts same-host peers that the pid watch
     * covers in NONE mode, which doubles shared-memory bandwidth in UCX
     * 1.13 (its rendezvous costs about 22 us more per message in PEER
     * mode, measured with ucx_perftest -e): their death is still seen by
     * the pid watch, and their endpoints are flush-closed (force-closed
     * only once the peer is dead), since UCX requires PEER mode on both
     * sides for a force close. */
    bool local_none;
    /* TS_UCX_PID_WATCH=0 turns the pidfd watch off (UCX's own detection only). */
    bool pid_watch;
    /* TS_UCX_CMA=0 turns the shared-memory bypass off (ucx_shm.c). */
    bool cma_on;
} ucx_knobs;

/* Step 1: the arguments and the knobs. */
static ts_status check_new(ts_store *store, const char *prefix, int rank, int size, double timeout_s,
                           ts_transport **out, ucx_knobs *k)
{
    if (!store || !prefix || !out) return ts_error(TS_ERR_INVALID_ARGUMENT, "ucx: NULL store, prefix or out");
    if (size < 1 || size > TS_UCX_MAX_SIZE || rank < 0 || rank >= size)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ucx: rank %d of a world of %d (1..%d ranks)", rank, size,
                        TS_UCX_MAX_SIZE);
    if (!(timeout_s > 0)) return ts_error(TS_ERR_INVALID_ARGUMENT, "ucx: timeout %g s is not positive", timeout_s);
    const char *em = getenv("TS_UCX_ERROR_MODE");
    k->local_none = false;
    if (em && *em) {
        if (strcmp(em, "local-none") == 0) k->local_none = true;
        else if (strcmp(em, "peer") != 0)
            return ts_error(TS_ERR_INVALID_ARGUMENT, "ucx: TS_UCX_ERROR_MODE='%s' (expected 'peer' or 'local-none')",
                            em);
    }
    const char *pw = getenv("TS_UCX_PID_WATCH");
    k->pid_watch = !(pw && strcmp(pw, "0") == 0);
    const char *cm = getenv("TS_UCX_CMA");
    k->cma_on = !(cm && strcmp(cm, "0") == 0);
    return TS_OK;
}

/* Step 2: UCX's environment, unless the user set it. */
static void env_defaults(double timeout_s)
{
    env_default("UCX_TLS", "posix,cma,self");
    env_default("UCX_MM_ERROR_HANDLING", "y");
    env_default("UCX_KEEPALIVE_INTERVAL", "1s");
    tcp_keepalive_defaults(timeout_s);
    /* UCX_WARN_UNUSED_ENV_VARS is a libucs global option, read when the
     * library loads: setting it here is too late (and is itself then
     * reported as unused), so the launcher and the tests set it. */
}

/* Step 3: the transport and its peers, nothing opened yet; NULL when out
 * of memory. */
static ts_ucx *ucx_alloc(int rank, int size)
{
    ts_ucx *t = ts__calloc(TS_MEM_COMM, 1, sizeof *t);
    if (!t) return NULL;
    t->base.vt = &ucx_vtable;
    t->base.rank = rank;
    t->base.size = size;
    t->efd = -1;
    t->failed_peer = -1;
    t->pending.next = t->pending.prev = &t->pending;
    t->peers = ts__calloc(TS_MEM_COMM, (size_t)size, sizeof *t->peers);
    if (!t->peers) {
        ts__free(TS_MEM_COMM, t);
        return NULL;
    }
    for (int r = 0; r < size; r++) {
        t->peers[r].t = t;
        t->peers[r].rank = r;
        t->peers[r].pidfd = -1;
    }
    return t;
}

/* Step 4: the UCP context (TAG + WAKEUP), with UCX's log routed first. */
static ts_status open_context(ts_ucx *t)
{
    ucp_config_t *cfg = NULL;
    pthread_once(&g_ucx_log_once, ucx_log_install);
    ucs_status_t us = ucp_config_read(NULL, NULL, &cfg);
    if (us != UCS_OK)
        return ts_error(TS_ERR_COMM, "ucx: rank %d: ucp_config_read failed: %s", t->base.rank, ucs_status_string(us));
    ucp_params_t params = {
        .field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME | UCP_PARAM_FIELD_ESTIMATED_NUM_EPS,
        .features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP,
        .name = "tensorshard",
        .estimated_num_eps = (size_t)t->base.size,
    };
    us = ucp_init(&params, cfg, &t->ctx);
    ucp_config_release(cfg);
    if (us != UCS_OK) {
        t->ctx = NULL;
        return ts_error(TS_ERR_COMM, "ucx: rank %d: ucp_init failed: %s", t->base.rank, ucs_status_string(us));
    }
    return TS_OK;
}

/* Step 5: the worker and its wakeup fd. */
static ts_status open_worker(ts_ucx *t)
{
    ucp_worker_params_t wp = {
        .field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
        .thread_mode = UCS_THREAD_MODE_SERIALIZED, /* several threads, one at a time (comm.c's progress lock) */
    };
    ucs_status_t us = ucp_worker_create(t->ctx, &wp, &t->worker);
    if (us != UCS_OK) {
        t->worker = NULL;
        return ts_error(TS_ERR_COMM, "ucx: rank %d: ucp_worker_create failed: %s", t->base.rank, ucs_status_string(us));
    }
    us = ucp_worker_get_efd(t->worker, &t->efd);
    if (us != UCS_OK)
        return ts_error(TS_ERR_COMM, "ucx: rank %d: ucp_worker_get_efd failed: %s", t->base.rank,
                        ucs_status_string(us));
    return TS_OK;
}

/* Step 6: this rank's address under "<prefix>/ucx/<rank>" (the top),
 * with host (this process's host id) in it. */
static ts_status publish_address(ts_ucx *t, ts_store *store, const char *prefix, const char *host)
{
    char key[TS_STORE_MAX_KEY];
    if ((size_t)snprintf(key, sizeof key, "%s/ucx/%d", prefix, t->base.rank) >= sizeof key)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ucx: prefix too long (%zu bytes)", strlen(prefix));
    ucp_address_t *addr = NULL;
    size_t alen = 0;
    ucs_status_t us = ucp_worker_get_address(t->worker, &addr, &alen);
    if (us != UCS_OK)
        return ts_error(TS_ERR_COMM, "ucx: rank %d: ucp_worker_get_address failed: %s", t->base.rank,
                        ucs_status_string(us));
    ts_ucx_addr a = {.hdr = {.magic = TS_UCX_MAGIC,
                             .pid = (int32_t)getpid(),
                             .cookie_addr = ts__ucx_shm_cookie_addr(),
                             .cookie = ts__ucx_shm_cookie()},
                     .worker = addr,
                     .worker_len = alen};
    memcpy(a.hdr.host, host, TS_UCX_HOST_LEN);
    size_t vlen = ts__ucx_addr_encode(&a, NULL, 0);
    unsigned char *val = ts__calloc(TS_MEM_COMM, 1, vlen);
    if (!val) {
        ucp_worker_release_address(t->worker, addr);
        return ts_error(TS_ERR_NO_MEMORY, "ucx: out of memory");
    }
    ts__ucx_addr_encode(&a, val, vlen);
    ts_status s = ts_store_set(store, key, val, vlen);
    ts__free(TS_MEM_COMM, val);
    ucp_worker_release_address(t->worker, addr);
    return s;
}

/* Step 7, for peer r: its address from the store, the same-host probe
 * (host id, then whether this rank can read it and a pidfd on it), and
 * the endpoint. */
static ts_status connect_peer(ts_ucx *t, ts_store *store, const char *prefix, int r, const char *host,
                              const ucx_knobs *k, double timeout_s)
{
    int rank = t->base.rank;
    ucx_peer *p = &t->peers[r];
    char key[TS_STORE_MAX_KEY];
    snprintf(key, sizeof key, "%s/ucx/%d", prefix, r);
    void *v = NULL;
    size_t vlen = 0;
    ts_status s = ts_store_get(store, key, &v, &vlen);
    if (s != TS_OK) {
        char why[256];
        snprintf(why, sizeof why, "%s", ts_last_error());
        return ts_error(s, "ucx: rank %d: no address from rank %d within %.1f s: %s", rank, r, timeout_s, why);
    }
    ts_ucx_addr a;
    if ((s = ts__ucx_addr_decode(v, vlen, rank, key, &a)) != TS_OK) {
        ts_store_value_free(v);
        return s;
    }
    bool same_host = r != rank && ts__host_same(host, a.hdr.host, TS_UCX_HOST_LEN);
    p->same_host = same_host;
    p->pid = same_host ? (pid_t)a.hdr.pid : 0;
    bool other_ns = false; /* the same host name, but another pid namespace (containers) */
    if (same_host)         /* can this rank read that process? (its published cookie) */
        other_ns = ts__ucx_shm_probe(p, &a.hdr);
    if (same_host && k->pid_watch && !other_ns) {
        int fd = ts__host_watch((pid_t)a.hdr.pid);
        if (fd >= 0) p->pidfd = fd;
        else if (errno == ESRCH) { /* gone already */ p->exited = true;
            ts__ucx_mark_dead(t, p, UCS_ERR_CONNECTION_RESET);
        }
    }
    p->none_mode = k->local_none && p->pidfd >= 0;
    ucp_ep_params_t ep = {
        .field_mask =
            UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER,
        .address = (const ucp_address_t *)a.worker,
        .err_mode = p->none_mode ? UCP_ERR_HANDLING_MODE_NONE : UCP_ERR_HANDLING_MODE_PEER,
        .err_handler = {.cb = ep_err_cb, .arg = p},
    };
    ucs_status_t us = ucp_ep_create(t->worker, &ep, &p->ep);
    ts_store_value_free(v);
    if (us != UCS_OK) {
        p->ep = NULL;
        return ts_error(TS_ERR_COMM,
                        "ucx: rank %d: cannot connect to rank %d: %s (UCX_TLS=%s; shared memory needs "
                        "UCX_MM_ERROR_HANDLING=y for PEER error handling)",
                        rank, r, ucs_status_string(us), getenv("UCX_TLS") ? getenv("UCX_TLS") : "");
    }
    return TS_OK;
}

/* Step 7: every rank (this one included), from this rank on. The store
 * client's timeout bounds the waits (it stays set). */
static ts_status connect_peers(ts_ucx *t, ts_store *store, const char *prefix, const char *host, const ucx_knobs *k,
                               double timeout_s)
{
    ts_store_set_timeout(store, timeout_s);
    for (int i = 0; i < t->base.size; i++) {
        ts_status s = connect_peer(t, store, prefix, (t->base.rank + i) % t->base.size, host, k, timeout_s);
        if (s != TS_OK) return s;
    }
    return TS_OK;
}

ts_status ts__ucx_transport_new(ts_store *store, const char *prefix, int rank, int size, double timeout_s,
                                ts_transport **out)
{
    ucx_knobs k = {0};
    ts_status s = check_new(store, prefix, rank, size, timeout_s, out, &k);
    if (s != TS_OK) return s;
    env_defaults(timeout_s);
    ts_ucx *t = ucx_alloc(rank, size);
    if (!t) return ts_error(TS_ERR_NO_MEMORY, "ucx: out of memory");
    char host[TS_UCX_HOST_LEN];
    ts__host_id(TS_HOST_ID_NET, host, sizeof host);
    if ((s = open_context(t)) != TS_OK || (s = open_worker(t)) != TS_OK ||
        (s = publish_address(t, store, prefix, host)) != TS_OK ||
        (s = connect_peers(t, store, prefix, host, &k, timeout_s)) != TS_OK ||
        (s = ts__ucx_shm_agree(t, store, prefix, k.cma_on, timeout_s)) != TS_OK) {
        ucx_destroy(&t->base); /* quiet: the first error's detail stays */
        return s;
    }
    log_hosts(t);
    *out = &t->base;
    return TS_OK;
}
