/*
 * The UCX transport's private types, shared by its two files: the
 * transport (comm/transport_ucx.c: endpoints, transfers, progress,
 * failures, teardown) and its shared-memory bypass for large messages
 * (comm/ucx_shm.c), which the transport calls and which calls back only
 * the raw transfers and mark_dead below. Internal to comm/; never
 * installed.
 */
#ifndef TS_COMM_UCX_INTERNAL_H
#define TS_COMM_UCX_INTERNAL_H

#include "comm/comm_internal.h"
#include "comm/store.h"
#include "comm/transport.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>
#include <ucp/api/ucp.h>

#define TS_UCX_RANK_SHIFT 48
#define TS_UCX_CTRL (1ull << 62) /* shared-memory bypass: control message */
#define TS_UCX_ACK (1ull << 63)  /* shared-memory bypass: acknowledgement */
#define TS_UCX_CMA_MIN (256u << 10)
#define TS_UCX_HOST_LEN 64

typedef struct ucx_op ucx_op;
typedef struct ts_ucx ts_ucx;

struct ucx_op {
    ts_ucx *t;
    ucx_op *prev, *next; /* pending list, or the completed queue (next only) */
    void *req;           /* UCX request, NULL if completed in place */
    ts_xfer_cb cb;
    void *arg;
    int peer;
    bool is_recv;
    bool orphan;      /* user callback already run; free when UCX gives it back */
    bool cancelled;   /* ucp_request_cancel called */
    bool notify;      /* orphaned, user callback not run yet */
    ts_status forced; /* status to report instead of UCX's (cancel), TS_OK if none */
    size_t len;
    uint64_t tag;
    ucs_status_t ucs;
    size_t rlen;     /* received length */
    size_t *len_out; /* recv_upto: where the received length goes (NULL: len exactly) */
    size_t ulen;     /* shared-memory bypass: the bytes of the transfer this message serves (0: none) */
    uint64_t xbits;  /* 0, TS_UCX_CTRL or TS_UCX_ACK */
    /* the bypass's control and acknowledgement payloads live in the op, so
     * that they stay valid for as long as UCX holds the op */
    _Alignas(8) unsigned char inl[48];
};

typedef struct ucx_peer {
    ts_ucx *t;
    int rank;
    ucp_ep_h ep;
    bool dead;
    ucs_status_t dead_status;
    int pidfd;                    /* same-host peer's process (pidfd_open), -1 if none */
    bool exited;                  /* found dead by its pidfd rather than by UCX */
    bool none_mode;               /* endpoint in UCP_ERR_HANDLING_MODE_NONE (TS_UCX_ERROR_MODE=local-none) */
    bool same_host;               /* on this host (host_id: kernel, pid and network namespace), self excluded */
    pid_t pid;                    /* same-host peer's process */
    uint64_t cookie_addr, cookie; /* its published cookie (the bypass's identity check) */
    bool cma_recv;                /* this rank reads the peer's large messages (bypass) */
    bool cma_send;                /* the peer reads this rank's large messages */
} ucx_peer;

struct ts_ucx {
    ts_transport base;
    ucp_context_h ctx;
    ucp_worker_h worker;
    int efd;
    ucx_peer *peers;
    ucx_op pending; /* sentinel of the circular pending list */
    ucx_op *done_head, *done_tail;
    int npending;
    int failed_peer;
    ts_status failed_status;
    /* the caller failed its world (cancel_all: a dead peer, a deadline, a
     * mismatch); TS_OK while it has not */
    ts_status world_failed;
    bool dead_unhandled;
    double next_pid_check;
    unsigned pid_tick; /* progress calls; the pid watch reads the clock every 16th */
    ucx_op *free_ops;  /* finished ops kept for the next transfers (op_release) */
    int n_free;
    uint64_t cma_nonce; /* the last bypass transfer's number */
    /* memory registered once (mem_register: pinned host memory), sorted
     * by address; driving thread only */
    struct ucx_region *regions;
    int n_regions, cap_regions;
    _Atomic uint64_t xfers, xfers_memh; /* xfer_stats */
};

/* The level of this transport's own teardown lines (transfers abandoned,
 * a worker leaked): once the world failed or a peer died these are the
 * expected aftermath (a healthy peer that abandoned its side, a stopped
 * or dead one), which the caller's own error already explains, so debug;
 * in a world that had not failed they are a genuine surprise: warn. */
static inline ts_log_level ts__ucx_teardown_level(const ts_ucx *t)
{
    return t->world_failed != TS_OK || t->failed_peer >= 0 ? TS_LOG_DEBUG : TS_LOG_WARN;
}

/* ------------------------------------------------------ the address
 *
 * The store value under "<prefix>/ucx/<rank>", in native byte order (a
 * UCX address only means something to the same build anyway):
 *     u32 magic | i32 pid | char host[TS_UCX_HOST_LEN] (NUL-padded) |
 *     u64 cookie address | u64 cookie | worker address (the rest)
 * ts_ucx_addr_hdr is that header field for field (no padding: asserted
 * in transport_ucx.c). */
#define TS_UCX_MAGIC 0x32555354u /* "TSU2" */

typedef struct ts_ucx_addr_hdr {
    uint32_t magic;             /* TS_UCX_MAGIC */
    int32_t pid;                /* the publishing process */
    char host[TS_UCX_HOST_LEN]; /* its ts__host_id(TS_HOST_ID_NET) */
    uint64_t cookie_addr;       /* where its bypass cookie lives (ucx_shm.c) */
    uint64_t cookie;            /* the cookie's value */
} ts_ucx_addr_hdr;

#define TS_UCX_HDR sizeof(ts_ucx_addr_hdr)

typedef struct ts_ucx_addr {
    ts_ucx_addr_hdr hdr;
    const void *worker; /* the worker address: borrowed (encode: the caller's; decode: inside the value) */
    size_t worker_len;
} ts_ucx_addr;

/* The bytes of a's store value: the header, then the worker address.
 * Returns the value's length (TS_UCX_HDR + a->worker_len); writes out only
 * when cap is at least that (out may be NULL to ask the length). */
size_t ts__ucx_addr_encode(const ts_ucx_addr *a, void *out, size_t cap);

/* Reads the store value `val` (len bytes) that ts__ucx_addr_encode wrote
 * into *out (its worker points into val). TS_ERR_FORMAT, naming `key`,
 * the value's length and the header's, when the value is no longer than
 * the header or does not start with TS_UCX_MAGIC; *out is then untouched.
 * `rank` (this rank) only names the caller in the message. */
ts_status ts__ucx_addr_decode(const void *val, size_t len, int rank, const char *key, ts_ucx_addr *out);

/* ------------------------------------- transport_ucx.c, for ucx_shm.c */

/* One UCX send (xbits: 0, or TS_UCX_CTRL / TS_UCX_ACK for the bypass;
 * ulen: the bytes of the bypass transfer this message serves, 0: none).
 * buf NULL: send len (<= 48) bytes of `inl`, copied into the op. */
ts_status ts__ucx_send_raw(ts_ucx *t, int peer, const void *buf, size_t len, uint64_t tag, uint64_t xbits, size_t ulen,
                           const void *inl, ts_xfer_cb cb, void *arg);
/* One UCX receive (xbits and ulen as send). buf NULL: into the op's `inl`
 * (len <= 48), which the callback reads through *op_out. */
ts_status ts__ucx_recv_raw(ts_ucx *t, int peer, void *buf, size_t len, uint64_t tag, uint64_t xbits, size_t ulen,
                           ts_xfer_cb cb, void *arg, ucx_op **op_out);
/* Records p as failed (first failure: what failed_peer reports); its
 * transfers fail from the next progress. */
void ts__ucx_mark_dead(ts_ucx *t, ucx_peer *p, ucs_status_t status);

/* ------------------------------------------- ucx_shm.c, for transport_ucx.c */

/* The bypass's send and receive of len >= TS_UCX_CMA_MIN bytes with a
 * same-host peer that agreed (cma_send / cma_recv); arguments checked. */
ts_status ts__ucx_shm_send(ts_ucx *t, int peer, const void *buf, size_t len, uint64_t tag, ts_xfer_cb cb, void *arg);
ts_status ts__ucx_shm_recv(ts_ucx *t, int peer, void *buf, size_t len, uint64_t tag, ts_xfer_cb cb, void *arg);
/* This process's cookie (made on the first call) and its address, which
 * the address header publishes. */
uint64_t ts__ucx_shm_cookie(void);
uint64_t ts__ucx_shm_cookie_addr(void);
/* At connection, for a same-host peer: records its cookie and whether
 * this rank can read it (p->cma_recv); returns true when the peer is in
 * another pid namespace (its pid means another process here). */
bool ts__ucx_shm_probe(ucx_peer *p, const ts_ucx_addr_hdr *h);
/* After connection: publishes whether the bypass is on here (cma_on) and
 * which same-host peers this rank can read, then learns the same of each
 * peer and sets every peer's cma_recv and cma_send, so that both sides of
 * a pair take the same path. Bounded by the store's timeout (timeout_s
 * only names it in errors). */
ts_status ts__ucx_shm_agree(ts_ucx *t, ts_store *store, const char *prefix, bool cma_on, double timeout_s);

#endif /* TS_COMM_UCX_INTERNAL_H */
