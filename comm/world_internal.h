/*
 * Internal: the private types of a world, its groups, ops and requests,
 * shared by the files of the collectives (not installed):
 *
 *   comm/debug.c     environment knobs, names, debug logs, trace records
 *   comm/reduce.c    the dtype glue of the reductions
 *   comm/ops.c       an op's block, its ring state machines, fingerprints
 *                    and inline blocks, failure notices
 *   comm/deadline.c  deadlines and the ranks that never entered
 *   comm/progress.c  requests, the progress lock (drive, park, take-over),
 *                    a round's phases (dead peers among them) and the
 *                    communication thread
 *   comm/world.c     worlds
 *   comm/comm.c      submission, the public collectives and groups
 *
 * Each file calls only those above it in this list (and base/, tensor/,
 * the transport's vtable); the one exception is the counters that
 * debug.c's summary reads through the public ts_comm_stats. The functions
 * they share are the ts__comm_* ones declared at the end. What other
 * folders and files call (coll_direct.c, dist.c, fully_shard/) stays in
 * comm/comm_internal.h.
 */
#ifndef TS_COMM_WORLD_INTERNAL_H
#define TS_COMM_WORLD_INTERNAL_H

#include "comm/comm_internal.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/*
 * How the collectives run: worlds, requests and the ring collectives
 * (comm.h).
 *
 * Threads and the progress lock: the caller (compute) thread validates
 * arguments, converts the input into the op's working buffer, and pushes
 * the op on the world's queue (mutex + eventfd). Whichever thread holds
 * the world's progress lock (prog_mu) drives the transport: it starts
 * queued ops, runs their ring state machines from the transfer callbacks,
 * checks failures and deadlines, and completes requests (mutex +
 * condition variable a sleeping waiter waits on). Two kinds of thread take
 * it:
 *  - a caller in ts_request_wait (every blocking collective waits there)
 *    drives progress itself: it takes the lock, starts its op, and spins
 *    on progress until its request completes, so that a small collective
 *    costs no thread hand-off (each one 5-100 us on a VM). It gives up
 *    after DRIVE_IDLE_NS (progress.c) without events (a stopped peer, a long transfer),
 *    wakes the communication thread and sleeps on the condition variable.
 *  - a caller submitting an asynchronous op starts it the same way when
 *    the lock is free (one round: its receives and first sends posted)
 *    and goes on without waking the communication thread;
 *  - the world's communication thread keeps asynchronous requests moving
 *    while the caller computes, without the caller calling into the
 *    library. It takes them over only after TS_COMM_TAKEOVER_US without
 *    a caller's round (see ts__comm_takeover_ns), so that a collective waited for
 *    soon costs no hand-off. It stays off the lock while a caller
 *    drives (it "parks" on the submission eventfd; a driver that leaves
 *    ops behind wakes it),
 *    spins on progress a little after its last event (TS_COMM_SPIN_US),
 *    then arms the transport and sleeps in poll() on the submission
 *    eventfd and the transport's fd, with a 10 ms timeout while ops are
 *    active so that deadlines and failure detection are noticed. It never
 *    spins while the caller computes (that took a core from compute: a
 *    2-rank FSDP step ran 2.3 times slower).
 * Every collective also carries a fingerprint, and a rank that fails its
 * world tells the others (see Fingerprints and Failure notices in ops.c).
 *
 * Rings (docs/design.md, "Rings"): left = rank-1, right = rank+1.
 *  - all-gather over W blocks of a buffer: every receive is posted at
 *    start into its final slot (step s receives block rank-s-1 from the
 *    left); step 0 sends block `rank`, and the block received at step s
 *    is forwarded at step s+1.
 *  - reduce-scatter over W blocks of the accumulation buffer: step 0 sends
 *    block rank-1; step s receives block rank-s-2 into staging block s%2,
 *    reduces it into the accumulation block and forwards that at step
 *    s+1; after W-1 steps block `rank` holds the full reduction. The
 *    receive of step s+2 reuses staging block s%2 once step s is reduced.
 *  - all-reduce: reduce-scatter then all-gather (steps W-1..2W-3) on one
 *    accumulation buffer padded to W equal blocks.
 *  - broadcast: a chain from the root; barrier: an all-gather of one byte.
 *  - all-to-all: every receive (block j from rank j) and send (block j of
 *    a copy of the input to rank j) posted at start, all with step 0 (the
 *    peer tells them apart); send / recv: one transfer with step 255.
 *
 * Groups (ts_comm_new_group) share their world's thread and transport:
 * an op carries its group's rank map and translates peers to world ranks
 * when it posts; rings and steps are in group ranks.
 */
#define ERR_LEN 256
typedef struct world world;
typedef struct op op;

struct ts_request {
    world *w;
    atomic_int done;
    ts_status status;
    char err[ERR_LEN];
};

struct ts_comm {
    world *w; /* NULL: the one-rank group without a world */
    int rank, size;
    uint64_t gid;
    uint32_t seq;
    pthread_mutex_t stats_mu;
    ts_comm_counters stats;
    bool is_group; /* from ts_comm_new_group (freed by ts_comm_free) */
    int *map;      /* group rank -> world rank; NULL: identity (a world) */
};

struct world {
    ts_transport *t;
    ts_comm *comm;
    pthread_t thread;
    bool has_thread;
    pthread_mutex_t mu; /* queue, request completion */
    pthread_cond_t cv;
    int efd;
    op *queue, *queue_tail;
    atomic_bool queued; /* queue not empty (a hint read without mu) */
    atomic_bool stop;
    double timeout_s;
    _Atomic uint64_t next_gid; /* the next group id this rank may propose */
    _Atomic double deadline_s; /* per-collective deadline (ts__comm_set_timeout) */
    atomic_bool check;         /* fingerprints on (TS_COMM_CHECK, ts__comm_set_check) */
    _Atomic size_t fp_inline;  /* inline blocks up to (TS_COMM_FP_INLINE, ts__comm_set_fp_inline) */
    /* the progress lock (see the top of this file): its holder alone calls
     * the transport and touches everything below */
    pthread_mutex_t prog_mu;
    atomic_int driving;         /* callers driving progress in ts_request_wait */
    atomic_int live;            /* ops submitted and not finished */
    atomic_bool traced;         /* spans wait in `traces` */
    _Atomic uint64_t caller_ns; /* when a caller last ran a round (0: never); see ts__comm_takeover_ns */
    atomic_bool sleeping;       /* the thread sleeps without a timeout */
    atomic_bool deferring;      /* the thread sleeps until its take-over (takeover_sleep) */
    /* ops finished by driving callers / by the thread (ts__comm_progress_stats) */
    _Atomic uint64_t by_callers, by_thread;
    /* under prog_mu */
    op *active;
    ts_status failed;
    char failed_msg[ERR_LEN];
    /* notices (see "Failure notices" in ops.c): a receive from every peer,
     * the one message this rank sends when it fails its world */
    struct notice_slot *nslots;
    struct notice *nout;
    bool notices_posted;
    /* a failure to act on from the loop (a notice received, a fingerprint
     * mismatch), and a dead peer waiting for the grace period */
    ts_status pend_st;
    bool pend_notify;
    char pend_msg[ERR_LEN];
    int suspect;         /* world rank seen dead first (-1: none) */
    uint64_t suspect_ns; /* when (0: none) */
    /* told when this rank fails its world by its own finding (ts__world_set_fail_hook) */
    ts__world_fail_hook fail_hook;
    void *fail_hook_arg;
    char suspect_why[ERR_LEN];
    /* hung-peer diagnosis through the store (see "Who never entered"):
     * the world's own client (NULL: none, or it failed), its key prefix,
     * and the launcher's key for the rank found hung ("": none) */
    ts_store *store;
    char store_prefix[800];
    char hung_key[320];
    /* TS_TRACE: spans of collectives finished by a driving caller, which
     * the communication thread records on its own track */
    struct trace_rec *traces;
    bool registrar; /* this world registers pinned memory (base.h) */
    /* blocks of finished ops (ts__comm_op_free), under mu */
    op *op_cache;
    int n_cached;
};

enum { K_SEND = 0, K_RECV = 1 };
enum { PH_RS = 0, PH_AG = 1, PH_BC = 2, PH_A2A = 3, PH_P2P = 4, PH_FP = 5 };

#define P2P_STEP 0xffu
#define FP_STEP 0xfeu /* a collective's fingerprint (steps 0..2W-3 <= 253 carry data) */
/* Failure notices travel in group id 0xffff, which no group gets. */
#define NOTICE_TAG ((uint64_t)0xffff << 32)
/* Tag layout (comm.h): group id in bits 32..47 (transports take 48-bit
 * tags: UCX keeps the source rank above), sequence or user tag in bits
 * 8..31, step in bits 0..7. Step 254 carries a collective's fingerprint;
 * group id 0xffff (never given to a group) the failure notices. */
#define GID_SHIFT 32
#define GID_LIMIT ((uint64_t)1 << 16)
#define SEQ_MASK 0xffffffu

typedef struct xfer {
    op *o;
    int kind, phase, step;
    int peer;  /* group rank */
    bool live; /* posted, not completed (the deadline message lists them) */
} xfer;

/* A collective's fingerprint (16 bytes), sent to the ranks it receives
 * from (see "Fingerprints" in ops.c). */
typedef struct fp {
    uint32_t seq;
    uint8_t kind, dtype, rop, root; /* 0xff: not part of this kind */
    uint64_t count;                 /* elements (kind's meaning; 0 for barrier) */
} fp;
_Static_assert(sizeof(fp) == 16, "a fingerprint is 16 bytes");
#define FP_NONE 0xffu
/* A ring's step-0 block travels in its fingerprint's message when it is
 * at most TS_COMM_FP_INLINE bytes (default FP_INLINE_DEFAULT, at most
 * FP_INLINE_CAP; see fp_inline). The op's fpbuf holds the received
 * message (fingerprint at FPB_RECV - 16, block at FPB_RECV, 64-byte
 * aligned: up to FP_INLINE_CAP bytes whatever this rank's block, since a
 * peer's may differ; an all-gather receives its block in its slot and
 * only what lies beyond it here). */
#define FP_INLINE_CAP ((size_t)16 << 10)
#define FP_INLINE_DEFAULT ((size_t)16 << 10)
#define FPB_RECV ((size_t)64)
#define FPB_BYTES (FPB_RECV + FP_INLINE_CAP)

struct op {
    op *next;
    world *w; /* NULL: the one-rank group without a world */
    ts_request *req;
    ts_coll_kind kind;
    int W, rank, left, right, root;
    uint64_t tagbase;
    uint64_t deadline_ns;
    /* ring buffer: the output (all-gather, broadcast) or the accumulation
     * buffer (reductions); `owned` if allocated here */
    unsigned char *buf;
    bool owned;
    size_t block;   /* bytes per block */
    size_t block_n; /* accumulation elements per block */
    ts_dtype acc;   /* accumulation dtype */
    ts_reduce_op rop;
    unsigned char *stage[2];
    unsigned char *scratch; /* pool block behind buf (when owned) */
    size_t scratch_bytes;
    unsigned char *sscratch; /* pool block behind the stages and send0 */
    size_t sscratch_bytes;
    /* reduce-scatter phase: block b of the source is src + b * block_n
     * elements of src_dtype, divided by pre as it is read; the rank's own
     * reduced block is written to final_out (final_dtype, divided by post) */
    const unsigned char *src;
    ts_dtype src_dtype;
    double pre;
    unsigned char *final_out;
    ts_dtype final_dtype;
    unsigned char *send0; /* step 0's block (src's, or converted) */
    bool rs, ag;          /* phases this op runs */
    bool rs_done, ag_started, ag_done;
    int ag_recvd;
    bool bc_recvd, bc_sent, bc_started;
    int pending;
    ts_status err;
    bool finished;
    /* finalization (all-reduce with an accumulation copy): buf -> out */
    void *out;
    ts_dtype out_dtype;
    size_t out_n;           /* elements to write */
    double post;            /* divide by (1: none) */
    xfer *x;                /* (phase 0/1/fp) x (send/recv) x W (in the op's block) */
    int *map;               /* group rank -> world rank (W entries, in the op's block) */
    unsigned char **outs;   /* list all-gather: W output blocks (owned array) */
    unsigned char *a2a_out; /* all-to-all: the output (W blocks) */
    int peer;               /* send / recv: the group rank */
    /* TS_DISTRIBUTED_DEBUG=DETAIL */
    uint64_t gid, submit_ns;
    uint32_t seq;
    size_t bytes;
    /* fingerprint: this rank's, and those received (W entries, in the
     * block behind x) */
    bool check;
    fp mine;
    fp *theirs;
    bool fp_bad;
    /* forwards wait until the left neighbour's fingerprint matched (see
     * Fingerprints): (phase << 8 | step) of those held, in order */
    bool fp_ok;
    int *held, nheld;
    /* the fingerprint messages' buffer (FPB_*; kept with the op's block
     * in the world's cache), the left's message's length, whether it was
     * received there (recv_upto), and whether this op's step-0 block
     * travels with its fingerprint (inline) */
    unsigned char *fpbuf;
    size_t fp_rlen;
    bool fp_upto, inl;
    bool noted; /* its entry is recorded in the store (Who never entered) */
};
/* A failure notice (ops.c, "Failure notices"), and the receive slot of
 * one peer's. */

typedef struct notice {
    uint32_t magic;
    int32_t status;
    int32_t from;
    int32_t culprit; /* the rank that failed (-1: none, e.g. a mismatch) */
    char msg[ERR_LEN - 48];
} notice;

typedef struct notice_slot {
    world *w;
    int peer;
    notice n;
} notice_slot;
/* A caller's last error, kept across rounds of progress on its thread:
 * the rounds run other ops' callbacks, which record their errors there. */
typedef struct saved_err {
    ts_status st;
    char msg[ERR_LEN];
} saved_err;
/* The block of ring position b (mod W) of o's buffer, and of its
 * reduce-scatter source. */
static inline unsigned char *ts__comm_blk(op *o, int b)
{
    return o->buf + (size_t)((b % o->W + o->W) % o->W) * o->block;
}

static inline const unsigned char *ts__comm_src_blk(const op *o, int b)
{
    return o->src + (size_t)((b % o->W + o->W) % o->W) * o->block_n * ts_dtype_size(o->src_dtype);
}

/* debug.c: knobs, names, logs, traces */
void ts__comm_copy_str(char *dst, size_t n, const char *src);
uint64_t ts__comm_spin_ns(void);
uint64_t ts__comm_takeover_ns(void);
size_t ts__comm_fp_inline_max(void);
bool ts__comm_check_default(void);
extern const char *const ts__comm_kind_names[TS_COLL_KIND_COUNT];
void ts__comm_op_name(const op *o, char *buf, size_t n);
void ts__comm_log_summary(ts_comm *c);
void ts__comm_log_detail(const op *o, ts_status st);
/* The world whose communication thread this thread is (NULL: none). */
extern _Thread_local world *ts__comm_thread_world;
void ts__comm_trace_op(world *w, const op *o, ts_status st);
void ts__comm_flush_traces(world *w);

/* reduce.c: the dtype glue of the reductions */
bool ts__comm_reducible(ts_dtype d);
void ts__comm_load_acc(void *dst, ts_dtype acc, const void *src, ts_dtype d, size_t n, double div);
void ts__comm_store_acc(void *dst, ts_dtype d, void *src, size_t n, double div);
void ts__comm_accumulate(void *acc, ts_dtype ad, const void *src, ts_dtype sd, double pre, ts_reduce_op rop, size_t n);
void ts__comm_reduce_store(void *out, ts_dtype od, const void *part, ts_dtype ad, const void *src, ts_dtype sd,
                           double pre, ts_reduce_op rop, double post, size_t n);
void ts__comm_convert_through(void *out, ts_dtype od, const void *src, ts_dtype sd, ts_dtype ad, double pre,
                              double post, size_t n);

/* ops.c: ops, their state machines, fingerprints, failure notices */
void ts__comm_complete_req(world *w, ts_request *r, ts_status st, const char *msg);
op *ts__comm_op_new(ts_comm *c, ts_coll_kind kind);
void ts__comm_op_free(op *o);
void ts__comm_finalize(op *o);
void ts__comm_finish(op *o);
bool ts__comm_fp_inline(const op *o);
void ts__comm_fail_later(world *w, ts_status st, const char *msg, bool notify);
void ts__comm_start_op(world *w, op *o);
void ts__comm_post_notices(world *w);
void ts__comm_set_op_err(op *o, const char *msg);
void ts__comm_fail_world(world *w, ts_status st, const char *msg, op *src, bool notify, int culprit);
/* Notes wrank as seen dead first (the grace period, see Failure notices). */
void ts__comm_suspect(world *w, int wrank);

/* deadline.c */
void ts__comm_check_deadlines(world *w);

/* progress.c: the progress lock, rounds, the communication thread */
void ts__comm_prog_lock(world *w);
bool ts__comm_prog_trylock(world *w);
void ts__comm_prog_unlock(world *w);
void ts__comm_wake_thread(world *w);
void ts__comm_check_peers(world *w);
int ts__comm_round(world *w, bool timers);
void ts__comm_err_save(saved_err *e);
void ts__comm_err_restore(const saved_err *e);
ts_status ts__comm_pin_register(void *ctx, void *addr, size_t len, void **handle_out);
void ts__comm_pin_deregister(void *ctx, void *handle);
void *ts__comm_thread_main(void *arg);

#endif
