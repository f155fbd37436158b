/*
 * Process groups, requests and collectives (docs/design.md D7,
 * docs/comm-design.md).
 *
 * A world is the set of ranks that run one job. Collectives are submitted
 * through a queue and run as ring state machines by whichever thread
 * holds the world's progress lock: a caller waiting on a request
 * (ts_request_wait, which every blocking collective calls) drives them
 * itself, so that a small collective costs no thread hand-off; the
 * world's communication thread runs them otherwise, so that progress
 * continues while the caller computes, without the caller calling into
 * the library. Several worlds may live in one process (tests run N
 * loopback ranks as threads).
 *
 * Without an initialized world, ts_comm_world() is a one-rank group: every
 * collective is a local copy. ts_dist_init makes the world from the
 * launcher's environment (UCX transport); ts_dist_world() returns it while
 * it is initialized, the one-rank group otherwise.
 *
 * Lifetime rules: tensors passed to a collective must be contiguous. The
 * input is read before the call returns, except reduce_scatter_tensor's,
 * which is read while the collective runs (no copy is made) and must stay
 * alive and unchanged until the request completes; the output (the tensor itself
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
 * hangs. In a world of ts_dist_init, a deadline names the ranks that never
 * entered the collective (read from the store), on every rank alike. Ranks that call different collectives (or the same with another
 * dtype, count, reduce op or root) all fail within it with TS_ERR_COMM
 * naming both sides (docs/comm-design.md).
 *
 * Limits: at most 128 ranks per world and 65534 groups per world (group
 * ids are not reused; the message tags' layout, comm/comm_internal.h).
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

typedef enum ts_reduce_op {
    TS_REDUCE_SUM,
    TS_REDUCE_AVG,
    TS_REDUCE_MAX,
    TS_REDUCE_MIN,
    TS_REDUCE_OP_COUNT
} ts_reduce_op;

/* The collectives counted per group. */
typedef enum ts_coll_kind {
    TS_COLL_ALL_GATHER,
    TS_COLL_REDUCE_SCATTER,
    TS_COLL_ALL_REDUCE,
    TS_COLL_BROADCAST,
    TS_COLL_BARRIER,
    TS_COLL_ALL_TO_ALL,
    TS_COLL_SEND,
    TS_COLL_RECV,
    TS_COLL_KIND_COUNT
} ts_coll_kind;

/* Per-group counters: calls and bytes of each collective, indexed by
 * ts_coll_kind. Bytes are the bytes of the caller's input tensor (the
 * broadcast tensor for broadcast, the tensor sent or received for send
 * and recv; 0 for barrier). The list form of all-gather counts as
 * TS_COLL_ALL_GATHER. ts_comm_new_group counts one i64 all-reduce on the
 * parent (it agrees on the group id with one).
 *
 * TS_DISTRIBUTED_DEBUG, in any case, read when the first world is made:
 * OFF (the default) prints nothing; INFO prints, when a group is freed
 * (a world at ts_dist_finalize, a subgroup at ts_comm_free), one stderr
 * line per rank with its counters, "[ts comm] group 0 rank 1/2 summary:
 * all_gather 9 (4608 bytes), reduce_scatter 9 (9216 bytes), barrier 1 (0
 * bytes)" (calls and bytes since the group was made or its last
 * ts_comm_stats_reset); DETAIL prints that and, when each collective
 * completes, one line: group, rank, sequence, kind, bytes, status and
 * duration. Any other value is a warning naming it, and means OFF.
 * fully_shard reads the same variable: with INFO or DETAIL, each rank
 * also prints its FSDP groups' collectives when the root module is freed
 * (ts_fsdp_print_stats in fully_shard/fully_shard.h; docs/debugging.md). */
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

/* A subgroup of `parent`: collective over parent (every member calls it,
 * in the same order relative to parent's other collectives, with the same
 * list). ranks[0..n) are ranks of parent, distinct, in [0, size); the new
 * group's rank i is ranks[i]. Members of the list get the group in *out;
 * the others get *out = NULL and TS_OK (as torch's new_group). Errors:
 * n < 1, NULL, duplicate or out-of-range ranks (TS_ERR_INVALID_ARGUMENT
 * naming them, on every member, before any exchange), and the failure of
 * the agreement all-reduce on parent. The group has its own id (agreed
 * with an all-reduce MAX of every member's next free id, so no two groups
 * sharing a pair of ranks ever share an id; at most 65534 groups per
 * world, TS_ERR_UNSUPPORTED beyond), its own sequence numbers and counters, and runs over the
 * parent's world (same transport and communication thread). Groups of one
 * process must not be created concurrently from several threads. */
TS_API ts_status ts_comm_new_group(ts_comm *parent, int n, const int *ranks, ts_comm **out);
/* Frees a group from ts_comm_new_group, after every request on it has
 * completed. Accepts NULL; worlds and ts_comm_world() are ignored (a
 * world is freed with the world). */
TS_API void ts_comm_free(ts_comm *c);

/* Waits until the collective completes; returns its status. The calling
 * thread drives the world's progress meanwhile (every pending collective
 * of the world, not only r's), polling for up to 5 ms without events,
 * then sleeping while the communication thread takes over; the wait ends
 * at the latest at the collective's deadline (TS_ERR_TIMEOUT). Leaves
 * ts_last_error() as it was when the collective succeeds. Any thread;
 * several may wait at once. */
TS_API ts_status ts_request_wait(ts_request *r);
/* Sets *done_out without blocking and without making progress (the
 * communication thread does); returns TS_OK (the collective's own
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
 * only SUM and AVG accept factors other than 1). in is read in place
 * until completion (see the lifetime rules); out may be in's block `rank`
 * and must not overlap the rest of in (TS_ERR_INVALID_ARGUMENT). */
TS_API ts_status ts_reduce_scatter_tensor(ts_comm *c, ts_tensor *out, ts_tensor *in, ts_reduce_op op, double pre_div,
                                          double post_div, ts_request **r);
/* t (any shape) = op over ranks of t, in place. Any size (padded
 * internally to a multiple of W). */
TS_API ts_status ts_all_reduce(ts_comm *c, ts_tensor *t, ts_reduce_op op, ts_request **r);
/* t (any shape) = root's t on every rank. */
TS_API ts_status ts_broadcast(ts_comm *c, ts_tensor *t, int root, ts_request **r);
/* Completes when every rank has entered it. */
TS_API ts_status ts_barrier(ts_comm *c, ts_request **r);
/* List form of all-gather: outs[i] (n elements each) = rank i's in (n).
 * nout must be the group size; every outs[i] contiguous, of in's dtype
 * and numel, distinct from each other and from in. Any dtype. */
TS_API ts_status ts_all_gather(ts_comm *c, int nout, ts_tensor **outs, ts_tensor *in, ts_request **r);
/* out (W*n) block j = block `rank` of rank j's in (W*n): block j of in
 * goes to rank j. Equal blocks (n is the same on every rank); any dtype;
 * in is copied before the call returns (out may be in). */
TS_API ts_status ts_all_to_all(ts_comm *c, ts_tensor *out, ts_tensor *in, ts_request **r);
/* Point-to-point within the group: t's bytes to / from group rank dst /
 * src (not the caller), with a user tag in [0, TS_P2P_TAG_MAX]. A send
 * matches the receive from the same peer with the same tag; several
 * with the same (peer, tag) match in posting order; different tags may be
 * posted in any order. Both sides must give the same number of bytes
 * (TS_ERR_COMM otherwise; between two processes of one host, a mismatch
 * where one side is under 256 KiB and the other not is only caught by the
 * deadline, TS_ERR_TIMEOUT, since the two sizes take different paths:
 * see the UCX transport's shared-memory bypass). Not collective: they take no sequence number
 * of the group, so they may interleave freely with its collectives. The
 * send's data is copied before the call returns; the receive's tensor is
 * the output. Like collectives, a receive still unmatched after the
 * world's deadline fails the world (TS_ERR_TIMEOUT). */
#define TS_P2P_TAG_MAX 0xffffff
TS_API ts_status ts_send(ts_comm *c, ts_tensor *t, int dst, int tag, ts_request **r);
TS_API ts_status ts_recv(ts_comm *c, ts_tensor *t, int src, int tag, ts_request **r);

/* ------------------------------------------------------------ the world */

typedef struct ts_dist_options {
    const char *transport; /* "ucx" (default); "loopback" only for a world of one rank */
    double timeout_s;      /* store connection, rendezvous and per-collective deadline (default 300);
                            * the environment variable TS_DIST_TIMEOUT (seconds), when set,
                            * overrides it */
} ts_dist_options;

TS_API ts_dist_options ts_dist_options_default(void);

/* Makes this process's world from the launcher's environment
 * (ts_launch_env: tsrun/torchrun, mpirun, srun): guards the rank against
 * its launcher's death (ts_launch_rank_guard), connects to the store at
 * MASTER_ADDR:MASTER_PORT with TS_STORE_TOKEN (when no launcher hosts it,
 * TS_STORE_HOSTED != "1", rank 0 starts it first), waits for every rank
 * (TS_ERR_TIMEOUT naming the missing ranks; while it waits, a warning
 * every 10 s names the ranks it still waits for), connects the UCX
 * transport and starts the world's communication thread. At the
 * rendezvous, a RANK claimed by two processes or a WORLD_SIZE that differs
 * between processes is TS_ERR_INVALID_ARGUMENT on every rank still
 * waiting, naming the ranks, pids, hosts and values; a rank of this host
 * that exits before the rendezvous completes (watched through its pidfd)
 * is TS_ERR_PEER_FAILED on the others at once, naming it; a client the
 * store rejected for a wrong token is TS_ERR_INVALID_ARGUMENT on every
 * rank still waiting, naming its address. A duplicate RANK that starts
 * after the rendezvous fails the world's collectives (and
 * ts_dist_finalize) on every rank with that error. A store that cannot be
 * reached within the deadline is TS_ERR_TIMEOUT saying where it should be
 * (rank 0, or node 0's tsrun, may not have started). Rank 0, when it
 * hosts the store, returns such an error only once the other ranks have
 * read it too (at most 5 s later), so that a late rank reports it rather
 * than a refused connection. A process
 * started alone (no launcher variables) or a world of size 1 gets a
 * one-rank world. Errors: TS_ERR_INVALID_ARGUMENT for a TS_DIST_TIMEOUT
 * that is not a number of seconds in (0, 30 days], for ranks on several
 * hosts without TS_STORE_TOKEN and no launcher hosting the store
 * (comm/launch.h), and ts_launch_env's (inconsistent variables),
 * TS_ERR_ALREADY when initialized already, TS_ERR_UNSUPPORTED for an
 * unknown transport, and the store's and transport's. NULL: defaults. Call
 * from one thread; the world is then used as described above. */
TS_API ts_status ts_dist_init(const ts_dist_options *o);
/* (On success every rank logs one info-level line, TS_LOG_LEVEL=info:
 * "ts_dist_init: rank 1 of 2, local rank 1 of 2, transport ucx, store
 * 127.0.0.1:29500 (hosted by the launcher; launcher tsrun/torchrun)", and
 * the UCX transport one more naming the peers on this host and on others:
 * "ucx: rank 0: same host: [1(bypass)]; other hosts: [2 3]". A host is a
 * kernel (boot id), pid namespace and network namespace, not a host name:
 * peers on other hosts go through the network, never through shared
 * memory or the bypass; docs/multihost.md.) */
TS_API bool ts_dist_is_initialized(void);
/* The initialized world; the one-rank group (ts_comm_world()) otherwise. */
TS_API ts_comm *ts_dist_world(void);
/* Barrier (collective and through the store), frees the world (bounded in
 * time, also after a peer failure) and closes the store. The process
 * that keeps the store up waits for every rank's last store call first:
 * rank 0 when it hosts the store (mpirun, srun), and rank 0 under a
 * launcher whose ranks span several nodes (node 0's tsrun hosts the store
 * and ends with its own ranks). Returns the barrier's status (the world
 * is freed either way); TS_ERR_STATE when not initialized. Afterwards
 * ts_dist_world() is the one-rank group. */
TS_API ts_status ts_dist_finalize(void);

/* The process floor: the resident memory the runtime holds beyond the
 * library's tensors (docs/memory.md): the library's and its
 * dependencies' code and data, UCX with its endpoints and shared memory,
 * the communication thread, the store connection, the C allocator's
 * slack, and BLIS's float32 packing buffers (which BLIS allocates at the
 * first product: counted from its block sizes, ts__blis_pack_bytes, not
 * from the resident set; a product run before the measurement is in
 * both, at most those bytes twice), and, in a world whose ranks cannot
 * all read each other's memory (ranks on other hosts), the buffers of
 * the copy-free collectives' packed fallback (their bound: 16 MiB plus
 * staging, kept by the tensor pool once used). Measured by ts_dist_init once its
 * world is up (each call replaces it), or, in a process that has not
 * called it, at the first ts_process_floor_get (and kept). The memory
 * estimate adds it to the tensors (fully_shard.h, rss_peak_bytes). */
typedef struct ts_process_floor {
    size_t bytes;           /* the floor: resident_bytes - tracked_bytes + blis_pack_bytes + fallback_bytes */
    size_t resident_bytes;  /* VmRSS at the measurement */
    size_t tracked_bytes;   /* the library's tensor pool, pinned blocks and tensor, autograd and module handles then */
    size_t blis_pack_bytes; /* BLIS's packing buffers (ts__blis_pack_bytes) */
    size_t fallback_bytes;  /* the copy-free collectives' packed fallback, when some rank of the world cannot read
                               another's memory (another host): its chunk buffers, kept in the tensor pool; else 0 */
    bool at_dist_init;      /* measured by ts_dist_init (false: at the first call) */
} ts_process_floor;
/* Writes the floor into *out (measuring it now if nothing has).
 * TS_ERR_IO / TS_ERR_FORMAT when /proc/self/status cannot be read
 * (ts_process_memory_read's), TS_ERR_INVALID_ARGUMENT for NULL. Any
 * thread. */
TS_API ts_status ts_process_floor_get(ts_process_floor *out);
/* ts_process_floor_get's bytes; 0 when it fails. */
TS_API size_t ts_process_floor_bytes(void);

#ifdef __cplusplus
}
#endif
#endif /* TS_COMM_H */
