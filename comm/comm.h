/*
 * Process groups, requests and collectives (DESIGN.md D7,
 * docs/comm-design.md).
 *
 * A world is the set of ranks that run one job. Each world has one
 * communication thread that owns its transport: collectives are submitted
 * to it through a queue, run there as ring state machines, and complete
 * requests that the caller waits on. Progress continues while the caller
 * computes, without the caller calling into the library. Several worlds
 * may live in one process (tests run N loopback ranks as threads).
 *
 * Without an initialized world, ts_comm_world() is a one-rank group: every
 * collective is a local copy. (The world from the launcher's environment,
 * ts_dist_init, comes with the UCX transport.)
 *
 * Lifetime rules: tensors passed to a collective must be contiguous. The
 * input is read before the call returns; the output (the tensor itself
 * for all-reduce and broadcast) must stay alive and untouched, and must
 * not be used by another collective in flight, until the request
 * completes. A request returned through `r` is
 * owned by the caller, who frees it with ts_request_free. Collectives on
 * one group must be called in the same order on every member, from one
 * thread at a time.
 *
 * Failure: a dead peer (reported by the transport) or a collective that
 * outlives its deadline (given when the world is made, default 300 s) fails
 * that collective and every pending and later one of the world with the
 * error (TS_ERR_PEER_FAILED naming the rank, or TS_ERR_TIMEOUT); nothing
 * hangs.
 *
 * Tags: a message's 64-bit tag is (group id << 40) | (sequence << 8) |
 * step, the sequence being the collective's number in its group (32 bits,
 * wrapping) and the step its ring step (all-reduce uses steps 0..2W-3), so
 * back-to-back collectives never cross-match. Hence W <= 128.
 *
 * Dtypes: f32, f64, bf16, f16 and i64 (all-gather and broadcast also move
 * i32 and bool). bf16/f16 reductions accumulate in f32; i64 reductions in
 * i64 (AVG and the divide factors then divide with truncation).
 */
#ifndef TS_COMM_H
#define TS_COMM_H

#include "base/base.h"
#include "tensor/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ts_comm ts_comm;       /* a process group */
typedef struct ts_request ts_request; /* one submitted collective */

typedef enum ts_reduce_op { TS_REDUCE_SUM, TS_REDUCE_AVG, TS_REDUCE_MAX, TS_REDUCE_MIN, TS_REDUCE_OP_COUNT } ts_reduce_op;

/* The collectives counted per group. */
typedef enum ts_coll_kind {
    TS_COLL_ALL_GATHER,
    TS_COLL_REDUCE_SCATTER,
    TS_COLL_ALL_REDUCE,
    TS_COLL_BROADCAST,
    TS_COLL_BARRIER,
    TS_COLL_KIND_COUNT
} ts_coll_kind;

/* Per-group counters: calls and bytes of each collective, indexed by
 * ts_coll_kind. Bytes are the bytes of the caller's input tensor (the
 * broadcast tensor for broadcast; 0 for barrier). With
 * TS_DISTRIBUTED_DEBUG=DETAIL in the environment, each collective also
 * writes one line to stderr when it completes: group, rank, sequence,
 * kind, bytes, status and duration. */
typedef struct ts_comm_counters {
    uint64_t calls[TS_COLL_KIND_COUNT];
    uint64_t bytes[TS_COLL_KIND_COUNT];
} ts_comm_counters;

/* The one-rank group used when no world is initialized (never NULL;
 * static, not freed). Any thread. */
TS_API ts_comm *ts_comm_world(void);
TS_API int ts_comm_rank(const ts_comm *c);
TS_API int ts_comm_size(const ts_comm *c);
/* Copies the group's counters into *out / resets them to zero. Any
 * thread. */
TS_API void ts_comm_stats(ts_comm *c, ts_comm_counters *out);
TS_API void ts_comm_stats_reset(ts_comm *c);

/* Waits until the collective completes; returns its status. */
TS_API ts_status ts_request_wait(ts_request *r);
/* Sets *done_out without blocking; returns TS_OK (the collective's own
 * status comes from ts_request_status or ts_request_wait). */
TS_API ts_status ts_request_test(ts_request *r, bool *done_out);
/* The collective's status; TS_ERR_STATE while it is pending. */
TS_API ts_status ts_request_status(const ts_request *r);
/* Frees a request, waiting for it first if pending (bounded by the
 * world's deadline). Accepts NULL. */
TS_API void ts_request_free(ts_request *r);

/* All of them: r == NULL blocks and returns the collective's status;
 * otherwise *r receives a request and the return value only reports
 * argument errors (TS_ERR_INVALID_ARGUMENT, TS_ERR_SHAPE, TS_ERR_DTYPE,
 * TS_ERR_NO_MEMORY) found before submission. */

/* out (W*n) = the concatenation of every rank's in (n), in rank order.
 * Same dtype, contiguous. */
TS_API ts_status ts_all_gather_into_tensor(ts_comm *c, ts_tensor *out, ts_tensor *in, ts_request **r);
/* out (n) = op over ranks of block `rank` of in (W*n), with every input
 * divided by pre_div before and the result by post_div after (1: none;
 * only SUM and AVG accept factors other than 1). */
TS_API ts_status ts_reduce_scatter_tensor(ts_comm *c, ts_tensor *out, ts_tensor *in, ts_reduce_op op,
                                          double pre_div, double post_div, ts_request **r);
/* t (any shape) = op over ranks of t, in place. Any size (padded
 * internally to a multiple of W). */
TS_API ts_status ts_all_reduce(ts_comm *c, ts_tensor *t, ts_reduce_op op, ts_request **r);
/* t (any shape) = root's t on every rank. */
TS_API ts_status ts_broadcast(ts_comm *c, ts_tensor *t, int root, ts_request **r);
/* Completes when every rank has entered it. */
TS_API ts_status ts_barrier(ts_comm *c, ts_request **r);

#ifdef __cplusplus
}
#endif
#endif /* TS_COMM_H */
