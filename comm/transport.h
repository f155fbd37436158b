/*
 * Internal: the transport interface under the collectives (docs/design.md D7,
 * docs/comm-design.md). Not installed.
 *
 * A transport moves tagged byte messages between the ranks of one world.
 * It is driven by one thread at a time: every function below except
 * create/destroy (and xfer_stats) is called only by the holder of the
 * world's progress lock (comm.c: a caller waiting on a request, or the
 * communication thread), and the completion callbacks run inside
 * progress() on that thread.
 *
 * Matching: a receive posted for (peer, tag) completes with the message
 * that peer sent with that tag; messages with the same (peer, tag) match
 * in posting order. The tag is 64-bit: the collectives encode (group id,
 * collective sequence number, step, chunk) in it, so back-to-back
 * collectives never cross-match. A message may arrive before its receive
 * is posted (the transport buffers it). The receive length must equal the
 * sent length (TS_ERR_COMM otherwise), except for recv_upto's receives.
 */
#ifndef TS_COMM_TRANSPORT_H
#define TS_COMM_TRANSPORT_H

#include "base/internal.h"
#include "base/base.h"

typedef struct ts_transport ts_transport;

/* One piece of a message of several (sendv, recvv_upto). */
typedef struct ts_iov {
    void *buf;
    size_t len;
} ts_iov;
#define TS_IOV_MAX 3

/* Completion of one posted send or receive: TS_OK, or the error (a dead
 * peer: TS_ERR_PEER_FAILED naming it; cancelled: TS_ERR_COMM). */
typedef void (*ts_xfer_cb)(void *arg, ts_status status);

typedef struct ts_transport_vtable {
    const char *name; /* "ucx", "loopback" */
    /* Posts a send of len bytes (the buffer stays untouched until the
     * callback) / a receive into buf. Immediate errors are returned and
     * the callback is then never called. */
    ts_status (*send)(ts_transport *t, int peer, const void *buf, size_t len, uint64_t tag, ts_xfer_cb cb, void *arg);
    ts_status (*recv)(ts_transport *t, int peer, void *buf, size_t len, uint64_t tag, ts_xfer_cb cb, void *arg);
    /* Makes progress and runs completions; returns how many events it
     * handled (0: nothing to do now). */
    int (*progress)(ts_transport *t);
    /* Before sleeping: TS_OK means nothing is pending and the thread may
     * sleep in poll() on wait_fd(); TS_ERR_ALREADY means events arrived,
     * progress again first (UCX's arm-before-sleep rule). */
    ts_status (*arm)(ts_transport *t);
    /* An fd that becomes readable when there is progress to make, or -1 if
     * the transport has none (then the thread sleeps with a short timeout). */
    int (*wait_fd)(ts_transport *t);
    /* The first peer found dead (-1 if none) and its status; when one is,
     * the error detail (ts_last_error) says why, phrased to follow "rank
     * N failed", e.g. "its process exited". */
    int (*failed_peer)(ts_transport *t, ts_status *status_out);
    /* Completes every pending send and receive with `status` (bounded in
     * time), e.g. after a failure. */
    void (*cancel_all)(ts_transport *t, ts_status status);
    /* Frees the transport; bounded in time even with dead peers. */
    void (*destroy)(ts_transport *t);
    /* Optional (NULL: the transport has no memory map; the loopback's).
     * Registers [addr, addr + len) with the transport's memory map once
     * (UCX: ucp_mem_map), so that every later send or receive whose buffer
     * lies inside it passes that registration (UCX: the memh) instead of
     * the transport registering the buffer per transfer; *handle_out is
     * given back to mem_deregister before the memory is freed. Called on
     * the driving thread (comm.c runs pinned-memory registrations under
     * the progress lock). */
    ts_status (*mem_register)(ts_transport *t, void *addr, size_t len, void **handle_out);
    void (*mem_deregister)(ts_transport *t, void *handle);
    /* Optional: the sends and receives posted so far with a buffer of
     * their own (not the bypass's small control messages) and how many of
     * them passed a registration. Any thread. */
    void (*xfer_stats)(ts_transport *t, uint64_t *posted_out, uint64_t *registered_out);
    /* Optional (NULL: never): the process id of world rank `peer` when
     * this rank may read that process's memory with process_vm_readv
     * (same host, the check at connection passed both ways, TS_UCX_CMA
     * not 0 on either side); 0 otherwise, and for the rank itself. Fixed
     * at creation: any thread (comm/coll_direct.c reads from the caller's
     * thread). */
    int (*peer_pid)(ts_transport *t, int peer);
    /* Optional (NULL: not supported; comm.c then keeps every fingerprint
     * apart from the data): a receive like recv() that also accepts a
     * message shorter than len, for messages under the sizes that take
     * another path (UCX's bypass: len < 256 KiB). The received length is
     * written to *len_out (which must stay valid until the callback)
     * before the callback runs with TS_OK; a message longer than len
     * fails it with TS_ERR_COMM, *len_out then unspecified. comm.c's
     * fingerprint receives use it: a peer's fingerprint message may carry
     * a data block of another size (see comm.c, "Fingerprints"). */
    ts_status (*recv_upto)(ts_transport *t, int peer, void *buf, size_t len, uint64_t tag, ts_xfer_cb cb, void *arg,
                           size_t *len_out);
    /* Optional (NULL: not supported; comm.c then copies the pieces
     * together): send() of one message made of n (1..TS_IOV_MAX) pieces
     * in order, and recv_upto() into n pieces filled in order (a message
     * of at most their total; *len_out its length). The array may go when
     * the call returns; the pieces' memory stays until the callback. Under
     * 256 KiB in all (never UCX's bypass). */
    ts_status (*sendv)(ts_transport *t, int peer, const ts_iov *iov, int n, uint64_t tag, ts_xfer_cb cb, void *arg);
    ts_status (*recvv_upto)(ts_transport *t, int peer, const ts_iov *iov, int n, uint64_t tag, ts_xfer_cb cb, void *arg,
                            size_t *len_out);
} ts_transport_vtable;

struct ts_transport {
    const ts_transport_vtable *vt;
    int rank, size;
};

/* ----------------------------------------------------------- loopback */

/* A fabric joins `size` loopback transports inside one process (ranks as
 * threads), for tests and fault injection. */
typedef struct ts_loopback_fabric ts_loopback_fabric;
ts_status ts__loopback_fabric_new(int size, ts_loopback_fabric **out);
void ts__loopback_fabric_free(ts_loopback_fabric *f); /* after every transport is destroyed */
ts_status ts__loopback_transport_new(ts_loopback_fabric *f, int rank, ts_transport **out);
/* Fault injection: messages from `rank` are delayed by delay_s; `rank`
 * dies (its peers see TS_ERR_PEER_FAILED on pending and later transfers
 * with it after detect_s). */
void ts__loopback_set_delay(ts_loopback_fabric *f, int rank, double delay_s);
void ts__loopback_kill(ts_loopback_fabric *f, int rank, double detect_s);
/* Test hook: how many messages the fabric's transports have sent so far
 * (all ranks; every send counts, whatever became of it). Any thread. */
uint64_t ts__loopback_sent(ts_loopback_fabric *f);

/* ----------------------------------------------------------- UCX */

typedef struct ts_store ts_store;
/* Creates this rank's UCX worker (SERIALIZED thread mode: any thread, one
 * at a time; TAG + WAKEUP), puts its address in the store under
 * "<prefix>/ucx/<rank>", connects to every peer with PEER error handling,
 * and waits (timeout_s) until all have published. */
ts_status ts__ucx_transport_new(ts_store *store, const char *prefix, int rank, int size, double timeout_s,
                                ts_transport **out);

#endif
