#define _GNU_SOURCE
/*
 * Worlds, requests and the ring collectives (comm.h).
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
 *    after DRIVE_IDLE_NS without events (a stopped peer, a long transfer),
 *    wakes the communication thread and sleeps on the condition variable.
 *  - a caller submitting an asynchronous op starts it the same way when
 *    the lock is free (one round: its receives and first sends posted)
 *    and goes on without waking the communication thread;
 *  - the world's communication thread keeps asynchronous requests moving
 *    while the caller computes, without the caller calling into the
 *    library. It takes them over only after TS_COMM_TAKEOVER_US without
 *    a caller's round (see takeover_ns), so that a collective waited for
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
 * world tells the others (see Fingerprints and Failure notices below).
 *
 * Rings (reference/DEPS-GUIDE.md §2): left = rank-1, right = rank+1.
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
#include "comm/comm_internal.h"
#include "comm/store.h"
#include "tensor/kernels.h"
#include "tensor/kernels.h"  /* the per-dtype buffer kernels of the reductions */

#include <errno.h>
#include <math.h>
#include <poll.h>
#include <sched.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#define ERR_LEN 256
/* How long the communication thread keeps polling the transport after its
 * last event before it sleeps in poll(): TS_COMM_SPIN_US (default 50; 0
 * sleeps at once). Sleeping costs a wake-up of several microseconds per
 * hand-off; spinning costs a core, which on a machine with fewer cores
 * than threads delays the other ranks. (A caller waiting in
 * ts_request_wait drives progress itself: see DRIVE_IDLE_NS.) */
#define SPIN_US_DEFAULT 50
#define BUSY_RETRIES 16 /* arm attempts the transport may refuse before a nap */
#define NAP_MIN_US 5     /* naps then double up to NAP_MAX_US while nothing happens */
#define NAP_MAX_US 100
/* dst (n bytes) = src, truncated. */
static void copy_str(char *dst, size_t n, const char *src)
{
    size_t k = strlen(src);
    if (k >= n) k = n - 1;
    memcpy(dst, src, k);
    dst[k] = '\0';
}

/* How long the communication thread leaves progress to the callers after
 * a caller last ran a round of it (an asynchronous submission starts its
 * op itself; a waiting caller drives) before it takes over:
 * TS_COMM_TAKEOVER_US (default 200; 0: the thread takes over at once and
 * is woken by every asynchronous submission). Meanwhile the thread sleeps on
 * submissions only, not on the transport, so that a collective its caller
 * waits for soon (FSDP's prefetches of small groups) costs no hand-off
 * and no thread competing with the ranks' compute threads for the cores;
 * an op nobody drives is taken over after at most that delay. */
#define TAKEOVER_US_DEFAULT 200
static uint64_t g_spin_ns, g_takeover_ns;
static size_t g_fp_inline; /* TS_COMM_FP_INLINE (see Fingerprints) */
static size_t env_fp_inline(void);
static pthread_once_t g_spin_once = PTHREAD_ONCE_INIT;
static uint64_t env_us(const char *name, double dflt)
{
    const char *e = getenv(name);
    char *end = NULL;
    double us = e && *e ? strtod(e, &end) : dflt;
    if (!e || !*e || *end || !(us >= 0) || us > 1e6) us = dflt;
    return (uint64_t)(us * 1e3);
}
static void spin_init(void)
{
    g_spin_ns = env_us("TS_COMM_SPIN_US", SPIN_US_DEFAULT);
    g_takeover_ns = env_us("TS_COMM_TAKEOVER_US", TAKEOVER_US_DEFAULT);
    g_fp_inline = env_fp_inline();
}
static uint64_t spin_ns(void)
{
    pthread_once(&g_spin_once, spin_init);
    return g_spin_ns;
}
static uint64_t takeover_ns(void)
{
    pthread_once(&g_spin_once, spin_init);
    return g_takeover_ns;
}
static size_t fp_inline_max(void)
{
    pthread_once(&g_spin_once, spin_init);
    return g_fp_inline;
}

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
    /* the progress lock (see the top of the file): its holder alone calls
     * the transport and touches everything below */
    pthread_mutex_t prog_mu;
    atomic_int driving; /* callers driving progress in ts_request_wait */
    atomic_int live;    /* ops submitted and not finished */
    atomic_bool traced; /* spans wait in `traces` */
    _Atomic uint64_t caller_ns; /* when a caller last ran a round (0: never); see takeover_ns */
    atomic_bool sleeping;       /* the thread sleeps without a timeout */
    atomic_bool deferring;      /* the thread sleeps until its take-over (takeover_sleep) */
    /* ops finished by driving callers / by the thread (ts__comm_progress_stats) */
    _Atomic uint64_t by_callers, by_thread;
    /* under prog_mu */
    op *active;
    ts_status failed;
    char failed_msg[ERR_LEN];
    /* notices (see "Failure notices" below): a receive from every peer,
     * the one message this rank sends when it fails its world */
    struct notice_slot *nslots;
    struct notice *nout;
    bool notices_posted;
    /* a failure to act on from the loop (a notice received, a fingerprint
     * mismatch), and a dead peer waiting for the grace period */
    ts_status pend_st;
    bool pend_notify;
    char pend_msg[ERR_LEN];
    int suspect;          /* world rank seen dead first (-1: none) */
    uint64_t suspect_ns;  /* when (0: none) */
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
    /* blocks of finished ops (op_free), under mu */
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
 * from (see "Fingerprints" below). */
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
    size_t block;      /* bytes per block */
    size_t block_n;    /* accumulation elements per block */
    ts_dtype acc;      /* accumulation dtype */
    ts_reduce_op rop;
    unsigned char *stage[2];
    unsigned char *scratch;  /* pool block behind buf (when owned) */
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
    unsigned char *send0;    /* step 0's block (src's, or converted) */
    bool rs, ag;       /* phases this op runs */
    bool rs_done, ag_started, ag_done;
    int ag_recvd;
    bool bc_recvd, bc_sent, bc_started;
    int pending;
    ts_status err;
    bool finished;
    /* finalization (all-reduce with an accumulation copy): buf -> out */
    void *out;
    ts_dtype out_dtype;
    size_t out_n;      /* elements to write */
    double post;       /* divide by (1: none) */
    xfer *x;           /* (phase 0/1/fp) x (send/recv) x W (in the op's block) */
    int *map;          /* group rank -> world rank (W entries, in the op's block) */
    unsigned char **outs; /* list all-gather: W output blocks (owned array) */
    unsigned char *a2a_out; /* all-to-all: the output (W blocks) */
    int peer;          /* send / recv: the group rank */
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

/* ------------------------------------------------------------------ */
/* Dtypes and reductions                                               */
/* ------------------------------------------------------------------ */

static bool reducible(ts_dtype d) { return d == TS_F32 || d == TS_F64 || d == TS_BF16 || d == TS_F16 || d == TS_I64; }

/* The buffer kernels' element operation of a reduce op (AVG sums; the
 * division comes with the post factor). */
static ts__buf_op buf_op(ts_reduce_op rop)
{
    switch (rop) {
    case TS_REDUCE_MAX: return TS__BUF_MAX;
    case TS_REDUCE_MIN: return TS__BUF_MIN;
    default: return TS__BUF_SUM;
    }
}

/* dst[i] (acc) = src[i] / div, converted (the division in acc, after the
 * conversion: tensor/kernels.h's ts__buf_div). */
static void load_acc(void *dst, ts_dtype acc, const void *src, ts_dtype d, size_t n, double div)
{
    ts__buf_convert(acc, dst, d, src, (int64_t)n);
    ts__buf_div(acc, dst, (int64_t)n, div);
}

/* dst[i] = src[i] (acc) / div, converted to d (the division in acc,
 * before the conversion; src is divided in place). */
static void store_acc(void *dst, ts_dtype d, void *src, size_t n, double div)
{
    ts_dtype acc = ts__acc_dtype(d);
    ts__buf_div(acc, src, (int64_t)n, div);
    ts__buf_convert(d, dst, acc, src, (int64_t)n);
}

/* dst = dst op src, n accumulation elements (AVG sums). */
static void reduce_into(void *dst, const void *src, ts_dtype acc, ts_reduce_op rop, size_t n)
{
    ts__buf_reduce(acc, buf_op(rop), dst, dst, src, (int64_t)n);
}

#define CHUNK 2048 /* elements converted at a time through a stack buffer */

/* acc[i] = acc[i] op (src[i] / pre), src converted from sd to the
 * accumulation dtype ad; n elements. */
static void accumulate(void *acc, ts_dtype ad, const void *src, ts_dtype sd, double pre, ts_reduce_op rop, size_t n)
{
    if (sd == ad && pre == 1.0) {
        reduce_into(acc, src, ad, rop, n);
        return;
    }
    _Alignas(64) unsigned char tmp[CHUNK * 8];
    size_t ae = ts_dtype_size(ad), se = ts_dtype_size(sd);
    for (size_t i = 0; i < n; i += CHUNK) {
        size_t k = n - i < CHUNK ? n - i : CHUNK;
        load_acc(tmp, ad, (const unsigned char *)src + i * se, sd, k, pre);
        reduce_into((unsigned char *)acc + i * ae, tmp, ad, rop, k);
    }
}

/* out[i] = (part[i] op src[i] / pre) / post, converted to od: the last
 * reduce-scatter step, in one pass (part is read, not written). */
static void reduce_store(void *out, ts_dtype od, const void *part, ts_dtype ad, const void *src, ts_dtype sd,
                         double pre, ts_reduce_op rop, double post, size_t n)
{
    if (od == ad && sd == ad && pre == 1.0 && post == 1.0) {
        ts__buf_reduce(ad, buf_op(rop), out, part, src, (int64_t)n);
        return;
    }
    _Alignas(64) unsigned char tmp[CHUNK * 8];
    size_t oe = ts_dtype_size(od), ae = ts_dtype_size(ad), se = ts_dtype_size(sd);
    for (size_t i = 0; i < n; i += CHUNK) {
        size_t k = n - i < CHUNK ? n - i : CHUNK;
        memcpy(tmp, (const unsigned char *)part + i * ae, k * ae);
        accumulate(tmp, ad, (const unsigned char *)src + i * se, sd, pre, rop, k);
        store_acc((unsigned char *)out + i * oe, od, tmp, k, post);
    }
}

/* out[i] = (src[i] / pre) / post, through the accumulation dtype ad: the
 * one-rank reduce-scatter. */
static void convert_through(void *out, ts_dtype od, const void *src, ts_dtype sd, ts_dtype ad, double pre,
                            double post, size_t n)
{
    _Alignas(64) unsigned char tmp[CHUNK * 8];
    size_t oe = ts_dtype_size(od), se = ts_dtype_size(sd);
    for (size_t i = 0; i < n; i += CHUNK) {
        size_t k = n - i < CHUNK ? n - i : CHUNK;
        load_acc(tmp, ad, (const unsigned char *)src + i * se, sd, k, pre);
        store_acc((unsigned char *)out + i * oe, od, tmp, k, post);
    }
}

/* ------------------------------------------------------------------ */
/* Requests                                                            */
/* ------------------------------------------------------------------ */

static void complete_req(world *w, ts_request *r, ts_status st, const char *msg)
{
    if (w) pthread_mutex_lock(&w->mu);
    r->status = st;
    if (st != TS_OK && msg != r->err) snprintf(r->err, sizeof r->err, "%s", msg && *msg ? msg : ts_status_str(st));
    if (st != TS_OK && !r->err[0]) snprintf(r->err, sizeof r->err, "%s", ts_status_str(st));
    atomic_store(&r->done, 1);
    if (w) {
        pthread_cond_broadcast(&w->cv);
        pthread_mutex_unlock(&w->mu);
    }
}

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

/* ------------------------------------------------------------------ */
/* Ops on the communication thread                                     */
/* ------------------------------------------------------------------ */

/* An op and what it indexes by rank are one block: 6 W transfer slots
 * ((rs, ag, fp) x (send, recv) x W), W received fingerprints, 2 W held
 * forwards, the W-entry rank map. A world keeps up to OP_CACHE blocks of
 * finished ops (sized for the world; its groups are no larger) for the
 * next ops, under mu: a small collective otherwise spent about as long in
 * the allocator as on the wire. */
#define OP_CACHE 64

static size_t op_block_bytes(int W)
{
    return sizeof(op) + (size_t)(6 * W) * sizeof(xfer) + (size_t)W * sizeof(fp) + (size_t)(3 * W) * sizeof(int);
}

static void op_free(op *o)
{
    if (o->scratch) ts__pool_free(o->scratch, o->scratch_bytes);
    else if (o->owned) ts__free(TS_MEM_COMM, o->buf);
    if (o->sscratch) ts__pool_free(o->sscratch, o->sscratch_bytes);
    ts__free(TS_MEM_COMM, o->outs);
    world *w = o->w;
    if (w) {
        pthread_mutex_lock(&w->mu);
        if (w->n_cached < OP_CACHE) {
            o->next = w->op_cache;
            w->op_cache = o;
            w->n_cached++;
            o = NULL;
        }
        pthread_mutex_unlock(&w->mu);
    }
    if (o) ts__free(TS_MEM_COMM, o->fpbuf);
    ts__free(TS_MEM_COMM, o);
}

static uint64_t tag_of(const op *o, int step) { return o->tagbase | (uint64_t)(unsigned)step; }

static unsigned char *blk(op *o, int b) { return o->buf + (size_t)((b % o->W + o->W) % o->W) * o->block; }

static void on_xfer(void *arg, ts_status st);

/* Posts one transfer of o; len_out non-NULL: a receive of at most len
 * bytes (transport.h, recv_upto), its length written there; iov
 * non-NULL: of the niov pieces instead of buf (sendv, recvv_upto). */
static void post_xv(op *o, int kind, int phase, int step, int peer, void *buf, size_t len, size_t *len_out,
                    const ts_iov *iov, int niov)
{
    if (o->err) return;
    int slot = phase == PH_FP ? 2 : phase == PH_AG ? 1 : 0;
    xfer *x = &o->x[(slot * 2 + kind) * o->W + (phase == PH_FP ? peer : step % o->W)];
    x->o = o;
    x->kind = kind;
    x->phase = phase;
    x->step = step;
    x->peer = peer;
    x->live = true;
    ts_transport *t = o->req->w->t;
    int wire = phase == PH_FP ? (int)FP_STEP : phase == PH_AG && o->rs ? step + o->W - 1 : phase == PH_A2A ? 0 : step;
    uint64_t tag = phase == PH_P2P ? o->tagbase : tag_of(o, wire);
    int wpeer = o->map[peer];
    o->pending++;
    ts_status s;
    if (iov)
        s = kind == K_SEND ? t->vt->sendv(t, wpeer, iov, niov, tag, on_xfer, x)
                           : t->vt->recvv_upto(t, wpeer, iov, niov, tag, on_xfer, x, len_out);
    else
        s = kind == K_SEND ? t->vt->send(t, wpeer, buf, len, tag, on_xfer, x)
            : len_out      ? t->vt->recv_upto(t, wpeer, buf, len, tag, on_xfer, x, len_out)
                           : t->vt->recv(t, wpeer, buf, len, tag, on_xfer, x);
    if (s != TS_OK) {
        x->live = false;
        o->pending--;
        o->err = s;
        snprintf(o->req->err, sizeof o->req->err, "%s", ts_last_error());
    }
}

static void post_x(op *o, int kind, int phase, int step, int peer, void *buf, size_t len, size_t *len_out)
{
    post_xv(o, kind, phase, step, peer, buf, len, len_out, NULL, 0);
}

static void post(op *o, int kind, int phase, int step, int peer, void *buf, size_t len)
{
    post_x(o, kind, phase, step, peer, buf, len, NULL);
}

/* (An inline all-gather's step 0 travels with the fingerprints.) */
static void start_ag(op *o)
{
    o->ag_started = true;
    bool inl = o->inl && !o->rs;
    for (int s = inl; s < o->W - 1; s++) post(o, K_RECV, PH_AG, s, o->left, blk(o, o->rank - s - 1), o->block);
    if (!inl) post(o, K_SEND, PH_AG, 0, o->right, blk(o, o->rank), o->block);
}

/* Reduce-scatter phase (see the top of the file): step s receives the
 * partial sum of block rank-s-2 into stage[s%2], adds the source's block,
 * and forwards it at step s+1; the last step (s = W-2) adds to the own
 * block and writes final_out. Step 0 sends the source's block rank-1
 * (send0). A stage is received into again once its forward completed. */
static void start_rs(op *o)
{
    for (int s = o->inl; s < 2 && s < o->W - 1; s++) post(o, K_RECV, PH_RS, s, o->left, o->stage[s], o->block);
    if (!o->inl) post(o, K_SEND, PH_RS, 0, o->right, o->send0, o->block);
}

static const unsigned char *src_blk(const op *o, int b)
{
    return o->src + (size_t)((b % o->W + o->W) % o->W) * o->block_n * ts_dtype_size(o->src_dtype);
}

/* Sends what this rank received on to the right: all-gather's step
 * `step` (the block received at step-1), reduce-scatter's (the stage
 * reduced at step-1), broadcast's. Held until the left neighbour's
 * fingerprint matched this rank's, so that a rank's result only holds
 * data that came through ranks that each checked their left neighbour:
 * every rank then fails within the collective, not only the two around a
 * mismatch. */
static void do_forward(op *o, int phase, int step)
{
    if (phase == PH_AG) post(o, K_SEND, PH_AG, step, o->right, blk(o, o->rank - step), o->block);
    else if (phase == PH_RS) post(o, K_SEND, PH_RS, step, o->right, o->stage[(step - 1) % 2], o->block);
    else post(o, K_SEND, PH_BC, 0, o->right, o->buf, o->block);
}

static void forward(op *o, int phase, int step)
{
    if (o->fp_ok) do_forward(o, phase, step);
    else o->held[o->nheld++] = phase << 8 | step;
}

static void rs_received(op *o, int s)
{
    unsigned char *st = o->stage[s % 2];
    if (s == o->W - 2) {
        reduce_store(o->final_out, o->final_dtype, st, o->acc, src_blk(o, o->rank), o->src_dtype, o->pre, o->rop,
                     o->post, o->block_n);
        o->rs_done = true;
        return;
    }
    accumulate(st, o->acc, src_blk(o, o->rank - s - 2), o->src_dtype, o->pre, o->rop, o->block_n);
    forward(o, PH_RS, s + 1);
}

/* The forward of step k (from stage[(k-1)%2]) completed: that stage takes
 * the receive of step k+1. */
static void rs_sent(op *o, int k)
{
    if (k >= 1 && k + 1 <= o->W - 2) post(o, K_RECV, PH_RS, k + 1, o->left, o->stage[(k - 1) % 2], o->block);
}

static void start_bc(op *o)
{
    o->bc_started = true;
    int pos = (o->rank - o->root + o->W) % o->W;
    if (pos == 0) {
        o->bc_recvd = true;
        if (o->W > 1) {
            o->bc_sent = true;
            post(o, K_SEND, PH_BC, 0, o->right, o->buf, o->block);
        }
    } else {
        post(o, K_RECV, PH_BC, 0, o->left, o->buf, o->block);
    }
}

/* All-to-all: receive block j of the output from rank j, send block j of
 * the input copy to rank j (the own block was copied at submission). */
static void start_a2a(op *o)
{
    if (o->block == 0) return;
    for (int j = 0; j < o->W; j++)
        if (j != o->rank) post(o, K_RECV, PH_A2A, j, j, o->a2a_out + (size_t)j * o->block, o->block);
    for (int k = 1; k < o->W; k++) {
        int j = (o->rank + k) % o->W;
        post(o, K_SEND, PH_A2A, j, j, o->buf + (size_t)j * o->block, o->block);
    }
}

static bool op_done(const op *o)
{
    if (o->kind == TS_COLL_ALL_TO_ALL || o->kind == TS_COLL_SEND || o->kind == TS_COLL_RECV) return true;
    if (o->kind == TS_COLL_BROADCAST) return o->bc_recvd;
    if (o->rs && !o->rs_done) return false;
    if (o->ag && !o->ag_done) return false;
    return true;
}

static const char *const k_kind_names[TS_COLL_KIND_COUNT] = {
    "all_gather", "reduce_scatter", "all_reduce", "broadcast", "barrier", "all_to_all", "send", "recv"};
_Static_assert(TS_COLL_KIND_COUNT == 8, "one name per collective");

/* TS_DISTRIBUTED_DEBUG (comm.h): OFF, INFO or DETAIL, in any case; read
 * once, when the first world is made. */
enum { DEBUG_OFF, DEBUG_INFO, DEBUG_DETAIL };
static int g_debug;
static pthread_once_t g_debug_once = PTHREAD_ONCE_INIT;
static void debug_init(void)
{
    const char *e = getenv("TS_DISTRIBUTED_DEBUG");
    if (!e || !*e || strcasecmp(e, "OFF") == 0) g_debug = DEBUG_OFF;
    else if (strcasecmp(e, "INFO") == 0) g_debug = DEBUG_INFO;
    else if (strcasecmp(e, "DETAIL") == 0) g_debug = DEBUG_DETAIL;
    else ts_logf(TS_LOG_WARN, "TS_DISTRIBUTED_DEBUG=%s is not one of OFF, INFO, DETAIL (in any case); using OFF", e);
}
static int debug_level(void)
{
    pthread_once(&g_debug_once, debug_init);
    return g_debug;
}
int ts__dist_debug_level(void) { return debug_level(); }

/* TS_DISTRIBUTED_DEBUG=INFO (and DETAIL): a group's counters in one line
 * on stderr when it is freed. */
static void log_summary(ts_comm *c)
{
    /* a memory estimate's virtual world and its groups are not the run's */
    if (debug_level() < DEBUG_INFO || !strcmp(c->w->t->vt->name, "virtual")) return;
    ts_comm_counters k;
    ts_comm_stats(c, &k);
    char line[1024];
    int n = snprintf(line, sizeof line, "[ts comm] group %llu rank %d/%d summary:", (unsigned long long)c->gid,
                     c->rank, c->size);
    bool any = false;
    for (int i = 0; i < TS_COLL_KIND_COUNT && n > 0 && (size_t)n < sizeof line; i++) {
        if (!k.calls[i]) continue;
        n += snprintf(line + n, sizeof line - (size_t)n, "%s %s %llu (%llu bytes)", any ? "," : "", k_kind_names[i],
                      (unsigned long long)k.calls[i], (unsigned long long)k.bytes[i]);
        any = true;
    }
    fprintf(stderr, "%s%s\n", line, any ? "" : " no collectives");
}

/* TS_DISTRIBUTED_DEBUG=DETAIL: one line per collective on stderr. */
static void log_detail(const op *o, ts_status st)
{
    if (debug_level() < DEBUG_DETAIL) return;
    fprintf(stderr, "[ts comm] group %llu rank %d/%d #%u %s %zu bytes: %s in %.3f ms\n", (unsigned long long)o->gid,
            o->rank, o->W, o->seq, k_kind_names[o->kind], o->bytes, ts_status_name(st),
            (double)(ts_now_ns() - o->submit_ns) / 1e6);
}

/* Writes the results out of the op's buffer (after success). A one-rank
 * reduction runs here: its own block is the whole result. */
static void finalize(op *o)
{
    if (o->rs && o->W == 1)
        convert_through(o->final_out, o->final_dtype, o->src, o->src_dtype, o->acc, o->pre, o->post, o->block_n);
    if (o->out) store_acc(o->out, o->out_dtype, o->buf, o->out_n, 1.0);
    if (o->outs && o->block)
        for (int i = 0; i < o->W; i++) memcpy(o->outs[i], o->buf + (size_t)i * o->block, o->block);
}

/* TS_TRACE: the collective's span on the communication thread's track,
 * from submission to completion (base/base.h lists the args). A span
 * finished by a driving caller is kept (under prog_mu) until the
 * communication thread records it on its own track (flush_traces). */
typedef struct trace_rec {
    struct trace_rec *next;
    ts_coll_kind kind;
    size_t bytes;
    uint64_t gid, start_ns, end_ns;
    uint32_t seq;
    int rank;
    ts_status st;
} trace_rec;

/* The world whose communication thread this thread is (NULL: none). */
static _Thread_local world *tl_comm_world;

static void trace_rec_emit(const trace_rec *k)
{
    ts_trace_arg a[6] = {{"kind", k_kind_names[k->kind], 0},     {"bytes", NULL, (int64_t)k->bytes},
                         {"group", NULL, (int64_t)k->gid},       {"seq", NULL, (int64_t)k->seq},
                         {"rank", NULL, k->rank},                {"status", ts_status_name(k->st), 0}};
    ts_trace_span_args(k_kind_names[k->kind], "comm", k->start_ns, k->end_ns, 6, a);
}

static void trace_op(world *w, const op *o, ts_status st)
{
    if (!ts_trace_enabled()) return;
    trace_rec k = {NULL, o->kind, o->bytes, o->gid, o->submit_ns, ts_now_ns(), o->seq, o->rank, st};
    if (tl_comm_world == w) {
        trace_rec_emit(&k);
        return;
    }
    trace_rec *d = malloc(sizeof *d); /* as base/trace.c's own records: outside the counted allocator */
    if (!d) return;                    /* tracing drops what it cannot hold */
    *d = k;
    d->next = w->traces;
    w->traces = d;
    atomic_store(&w->traced, true);
}

/* On the communication thread, under prog_mu: records the spans drivers
 * left. */
static void flush_traces(world *w)
{
    trace_rec *d = w->traces;
    w->traces = NULL;
    atomic_store(&w->traced, false);
    while (d) {
        trace_rec *n = d->next;
        trace_rec_emit(d);
        free(d);
        d = n;
    }
}

static void finish(op *o)
{
    world *w = o->req->w;
    ts_status st = o->err;
    if (st == TS_OK) finalize(o);
    o->finished = true;
    log_detail(o, st);
    trace_op(w, o, st);
    atomic_fetch_add_explicit(tl_comm_world == w ? &w->by_thread : &w->by_callers, 1, memory_order_relaxed);
    atomic_fetch_sub(&w->live, 1);
    complete_req(w, o->req, st, o->req->err);
}

static void advance(op *o)
{
    if (o->finished) return;
    world *w = o->req->w;
    if (o->err) {
        /* a peer failure is held until the world has named the rank that
         * failed first (see fail_world): the transfer's own error may name
         * a rank that only exited after failing itself */
        if (o->pending == 0 && !(o->err == TS_ERR_PEER_FAILED && !w->failed)) finish(o);
        return;
    }
    if (o->rs && o->rs_done && o->ag && !o->ag_started && o->pending == 0) start_ag(o);
    if (o->err) {
        if (o->pending == 0 && !(o->err == TS_ERR_PEER_FAILED && !w->failed)) finish(o);
        return;
    }
    if (op_done(o) && o->pending == 0) finish(o);
}

/* ------------------------------------------------------------------ */
/* Fingerprints                                                        */
/* ------------------------------------------------------------------ */

/* Every collective (not send/recv) sends its fingerprint (kind, sequence,
 * dtype, count, reduce op, root: 16 bytes) to its right neighbour
 * (all-to-all and broadcast: every peer), with step FP_STEP of its own
 * tag, and receives its left neighbour's (all-to-all, broadcast: every
 * peer's); it completes only once those arrived and matched. A rank that
 * finds a fingerprint differ from its own fails its world with a message
 * naming both sides and sends a notice to every peer. In the rings
 * (all-gather, reduce-scatter, all-reduce, barrier) a rank forwards what
 * it received only once its left neighbour's fingerprint matched (see
 * forward()): a rank's result then only holds data that passed ranks that
 * each checked their left neighbour, so a result completes only when all
 * ranks agree, and every rank fails within the collective. A broadcast's
 * data flows one way along its chain, so there every pair checks.
 *
 * Inline blocks. A separate 16-byte message cost about 0.3 us per small
 * collective (8-16% of a 4 KiB all-gather), so a ring whose step-0 block
 * is small (fp_inline: at most TS_COMM_FP_INLINE bytes, 16 KiB by
 * default) sends that block in its fingerprint's message, [fingerprint |
 * block], and no step-0 data message: sent as two pieces (the
 * fingerprint, the block where it lies: sendv). The receiver checks the
 * fingerprint before it uses or forwards the block: an all-gather
 * receives the message as pieces, the block straight into its slot
 * (recvv_upto); a reduce-scatter receives it in front of staging block 0,
 * which is then reduced in place.
 * Larger blocks go from and to the caller's buffers without a copy, and
 * their fingerprint stays alone. A fingerprint message is therefore 16
 * bytes or 16 plus a block of at most FP_INLINE_CAP, and every
 * fingerprint receive from the left accepts any of these lengths (the
 * transport's recv_upto): whatever the two sides' sizes, the receiver
 * reads the sender's fingerprint, so a mismatch across the threshold (one
 * block under it, the other over) is caught by the fingerprint like any
 * other, on the rank that receives it, and the others learn it from its
 * notice. (A receive of the exact length would fail with a length error
 * instead, leaving the rank without the peer's fingerprint; and a message
 * of 256 KiB or more takes UCX's shared-memory bypass, which never meets
 * a receive of another size.) Only the left can send a longer message:
 * the rings send to the right alone, broadcast and all-to-all only 16
 * bytes. When fingerprints match, the lengths do too, unless the ranks'
 * TS_COMM_FP_INLINE differ, which fails the collective saying so.
 *
 * A data receive that fails first (a length mismatch) waits for the
 * fingerprint, whose message then wins; large messages take the
 * transport's shared-memory bypass, whose size mismatches would otherwise
 * only end at the deadline. TS_COMM_CHECK=0 turns fingerprints off (every
 * rank alike), and with them the inline blocks. */

/* TS_COMM_FP_INLINE: bytes (0 keeps every fingerprint apart; at most
 * FP_INLINE_CAP). Must be the same on every rank. */
static size_t env_fp_inline(void)
{
    const char *e = getenv("TS_COMM_FP_INLINE");
    char *end = NULL;
    double b = e && *e ? strtod(e, &end) : -1;
    if (!e || !*e || *end || !(b >= 0) || b > (double)FP_INLINE_CAP) {
        if (e && *e)
            ts_logf(TS_LOG_WARN, "TS_COMM_FP_INLINE=%s is not a byte count in [0, %zu]; using %zu", e,
                    (size_t)FP_INLINE_CAP, (size_t)FP_INLINE_DEFAULT);
        return FP_INLINE_DEFAULT;
    }
    return (size_t)b;
}

/* Whether o (a ring, its block set) sends its step-0 block with its
 * fingerprint: when the block is at most the threshold. Measured
 * (bench_collectives' "fingerprint inline blocks", 2 ranks, UCX shared
 * memory, a loaded machine): inline saves 10-20% up to 2 KiB blocks and
 * 5-12% at 8-16 KiB, for every ring kind, once no block is copied (the
 * message is sent and received as pieces: sendv, recvv_upto). With the
 * block copied into and out of the message, an all-gather lost 3-6% from
 * 8 KiB. */
static bool fp_inline(const op *o)
{
    const ts_transport_vtable *vt = o->check ? o->w->t->vt : NULL;
    if (!o->check || o->W < 2 || !o->fpbuf || !vt->recv_upto || !vt->sendv || !vt->recvv_upto ||
        o->kind == TS_COLL_BROADCAST || o->kind == TS_COLL_ALL_TO_ALL)
        return false;
    size_t limit = atomic_load_explicit(&o->w->fp_inline, memory_order_relaxed);
    return limit > 0 && o->block <= limit; /* 0: never, not even an empty block */
}

static const char *const k_rop_names[TS_REDUCE_OP_COUNT] = {"sum", "avg", "max", "min"};
_Static_assert(TS_REDUCE_OP_COUNT == 4, "one name per reduce op");

/* "all_gather #12 (float32, 8512)" */
static void fp_str(const fp *f, char *buf, size_t n)
{
    const char *kind = f->kind < TS_COLL_KIND_COUNT ? k_kind_names[f->kind] : "an unknown collective";
    int k = snprintf(buf, n, "%s #%u", kind, f->seq);
    if (k < 0 || (size_t)k >= n || f->kind == TS_COLL_BARRIER) return;
    k += snprintf(buf + k, n - (size_t)k, " (%s, %llu",
                  f->dtype != FP_NONE ? ts_dtype_name((ts_dtype)f->dtype) : "-", (unsigned long long)f->count);
    if ((size_t)k < n && f->rop != FP_NONE && f->rop < TS_REDUCE_OP_COUNT)
        k += snprintf(buf + k, n - (size_t)k, ", %s", k_rop_names[f->rop]);
    if ((size_t)k < n && f->root != FP_NONE) k += snprintf(buf + k, n - (size_t)k, ", root %u", f->root);
    if ((size_t)k < n) snprintf(buf + k, n - (size_t)k, ")");
}

static void fail_later(world *w, ts_status st, const char *msg, bool notify)
{
    if (w->failed || w->pend_st) return;
    w->pend_st = st;
    w->pend_notify = notify;
    copy_str(w->pend_msg, sizeof w->pend_msg, msg);
}

/* Fails o (and its world, with notices) with msg, as a mismatch does. */
static void fp_fail(op *o, const char *msg)
{
    o->fp_bad = true;
    o->err = TS_ERR_COMM;
    copy_str(o->req->err, sizeof o->req->err, msg);
    fail_later(o->req->w, TS_ERR_COMM, msg, true);
}

static void check_fp(op *o, int peer)
{
    const fp *a = &o->mine, *b = &o->theirs[peer];
    if (memcmp(a, b, sizeof *a) == 0) {
        if (o->kind == TS_COLL_ALL_TO_ALL || o->kind == TS_COLL_BROADCAST) return; /* all pairs: nothing held */
        o->fp_ok = true;
        for (int i = 0; i < o->nheld && !o->err; i++) do_forward(o, o->held[i] >> 8, o->held[i] & 0xff);
        o->nheld = 0;
        return;
    }
    char sa[96], sb[96], msg[ERR_LEN + 128], grp[32] = "";
    fp_str(a, sa, sizeof sa);
    fp_str(b, sb, sizeof sb);
    if (o->gid) snprintf(grp, sizeof grp, "group %llu: ", (unsigned long long)o->gid);
    bool me_first = o->rank < peer;
    snprintf(msg, sizeof msg, "desynchronised collectives: %srank %d runs %s, rank %d runs %s", grp,
             me_first ? o->rank : peer, me_first ? sa : sb, me_first ? peer : o->rank, me_first ? sb : sa);
    fp_fail(o, msg);
}

/* The left's fingerprint message goes to fpbuf (any length up to an
 * inline block of FP_INLINE_CAP), the other peers' (all-to-all,
 * broadcast) straight to theirs[]. An inline all-gather's block goes
 * straight to its slot (what a longer message holds beyond it, to
 * fpbuf). */
static void post_fp_left(op *o)
{
    o->fp_upto = o->fpbuf && o->req->w->t->vt->recv_upto;
    if (o->inl && !o->rs) {
        ts_iov v[3] = {{o->fpbuf + FPB_RECV - sizeof(fp), sizeof(fp)},
                       {blk(o, o->rank - 1), o->block},
                       {o->fpbuf + FPB_RECV, FP_INLINE_CAP - o->block}};
        post_xv(o, K_RECV, PH_FP, 0, o->left, NULL, 0, &o->fp_rlen, v, 3);
    } else if (o->fp_upto)
        post_x(o, K_RECV, PH_FP, 0, o->left, o->fpbuf + FPB_RECV - sizeof(fp), sizeof(fp) + FP_INLINE_CAP,
               &o->fp_rlen);
    else
        post(o, K_RECV, PH_FP, 0, o->left, &o->theirs[o->left], sizeof(fp));
}

static void start_fp(op *o)
{
    if (!o->check || o->W < 2) return;
    if (o->kind == TS_COLL_ALL_TO_ALL || o->kind == TS_COLL_BROADCAST) {
        post_fp_left(o);
        for (int j = 0; j < o->W; j++)
            if (j != o->rank && j != o->left) post(o, K_RECV, PH_FP, 0, j, &o->theirs[j], sizeof(fp));
        for (int j = 0; j < o->W; j++)
            if (j != o->rank) post(o, K_SEND, PH_FP, 0, j, &o->mine, sizeof(fp));
        return;
    }
    post_fp_left(o);
    if (o->inl) { /* [fingerprint | block], from where the block is */
        ts_iov v[2] = {{&o->mine, sizeof(fp)}, {o->rs ? o->send0 : blk(o, o->rank), o->block}};
        post_xv(o, K_SEND, PH_FP, 0, o->right, NULL, 0, NULL, v, 2);
    } else {
        post(o, K_SEND, PH_FP, 0, o->right, &o->mine, sizeof(fp));
    }
}

/* The left's fingerprint message arrived (in fpbuf): checks it and, for
 * an inline ring, takes its block as step 0's receive. */
static void fp_left_received(op *o)
{
    char msg[ERR_LEN], grp[32] = "";
    if (o->gid) snprintf(grp, sizeof grp, "group %llu: ", (unsigned long long)o->gid);
    if (o->fp_rlen < sizeof(fp)) {
        snprintf(msg, sizeof msg, "%srank %d sent rank %d a fingerprint of %zu bytes (want at least %zu)", grp,
                 o->left, o->rank, o->fp_rlen, sizeof(fp));
        fp_fail(o, msg);
        return;
    }
    memcpy(&o->theirs[o->left], o->fpbuf + FPB_RECV - sizeof(fp), sizeof(fp));
    check_fp(o, o->left);
    if (o->err) return;
    size_t want = o->inl ? o->block : 0, got = o->fp_rlen - sizeof(fp);
    if (got != want) { /* the same collective: the ranks' TS_COMM_FP_INLINE differ */
        snprintf(msg, sizeof msg,
                 "%srank %d sent %zu bytes of data with its fingerprint, rank %d expected %zu: is TS_COMM_FP_INLINE "
                 "the same on every rank?", grp, o->left, got, o->rank, want);
        fp_fail(o, msg);
        return;
    }
    if (!o->inl) return;
    if (o->rs) { /* the block landed in staging block 0 */
        rs_received(o, 0);
        return;
    }
    if (o->W > 2) forward(o, PH_AG, 1); /* the block is in its slot */
    if (++o->ag_recvd == o->W - 1) o->ag_done = true;
}

static void suspect(world *w, int wrank)
{
    if (w->suspect >= 0) return;
    w->suspect = wrank;
    w->suspect_ns = ts_now_ns();
}

static void on_xfer(void *arg, ts_status st)
{
    xfer *x = arg;
    op *o = x->o;
    o->pending--;
    x->live = false;
    if (st != TS_OK && !o->err) {
        o->err = st;
        snprintf(o->req->err, sizeof o->req->err, "%s", ts_last_error());
        if (st == TS_ERR_PEER_FAILED) suspect(o->req->w, o->map[x->peer]);
    }
    if (x->phase == PH_FP) {
        if (st == TS_OK && x->kind == K_RECV) {
            if (x->peer == o->left && o->fp_upto) fp_left_received(o);
            else check_fp(o, x->peer);
        }
        advance(o);
        return;
    }
    if (!o->err && x->kind == K_SEND && x->phase == PH_RS) rs_sent(o, x->step);
    if (!o->err && x->kind == K_RECV) {
        int s = x->step;
        if (x->phase == PH_AG) {
            if (s < o->W - 2) forward(o, PH_AG, s + 1);
            if (++o->ag_recvd == o->W - 1) o->ag_done = true;
        } else if (x->phase == PH_RS) {
            rs_received(o, s);
        } else if (x->phase == PH_BC) {
            o->bc_recvd = true;
            if ((o->rank - o->root + o->W) % o->W < o->W - 1) forward(o, PH_BC, 0);
        }
    }
    advance(o);
}

static void start_op(world *w, op *o)
{
    o->deadline_ns = ts_now_ns() + (uint64_t)(atomic_load(&w->deadline_s) * 1e9);
    o->fp_ok = !o->check || o->W < 2 || o->kind == TS_COLL_ALL_TO_ALL || o->kind == TS_COLL_BROADCAST;
    /* the fingerprint first: it then arrives before the data, and the
     * forwards and the all-reduce's second phase, which wait for it, do
     * not (measured: sending it after step 0 cost more at 4 KiB) */
    start_fp(o);
    if (o->kind == TS_COLL_BROADCAST) start_bc(o);
    else if (o->kind == TS_COLL_ALL_TO_ALL) start_a2a(o);
    else if (o->kind == TS_COLL_SEND) post(o, K_SEND, PH_P2P, 0, o->peer, o->buf, o->block);
    else if (o->kind == TS_COLL_RECV) post(o, K_RECV, PH_P2P, 0, o->peer, o->buf, o->block);
    else if (o->rs) start_rs(o);
    else start_ag(o);
    advance(o);
}

/* ------------------------------------------------------------------ */
/* Failure notices                                                     */
/* ------------------------------------------------------------------ */

/* A rank that fails its world because a peer died (once it has named the
 * rank that died first) or because fingerprints differ sends one notice
 * to every other rank, which fails its own world with the same message.
 * Every rank keeps a receive posted for a notice from each peer (tag
 * NOTICE_TAG). This makes every survivor name the same, first-failed
 * rank: a survivor that would otherwise first notice a rank that merely
 * exited after failing (the pid watch checks the ranks in order) learns
 * the real one from that rank's notice, which it sent before exiting; and
 * a rank whose transport found a dead peer waits PEER_GRACE_NS for such a
 * notice (or for the transport to report another death) before naming it,
 * in worlds of 3 ranks or more. */
#define NOTICE_MAGIC 0x5453464eu /* "NFST" */
#define PEER_GRACE_NS 300000000ull

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

static void on_notice(void *arg, ts_status st)
{
    notice_slot *sl = arg;
    world *w = sl->w;
    if (st != TS_OK || w->failed) return; /* cancelled at failure or teardown */
    notice n = sl->n;
    n.msg[sizeof n.msg - 1] = '\0';
    if (n.magic != NOTICE_MAGIC || n.status >= 0 || n.from != sl->peer) {
        ts_logf(TS_LOG_WARN, "comm: rank %d: malformed failure notice from rank %d ignored", w->comm->rank, sl->peer);
        return;
    }
    char msg[ERR_LEN];
    int k = snprintf(msg, sizeof msg, "%s%s", n.msg, n.culprit >= 0 ? " (reported by a peer)" : "");
    (void)k; /* truncated if need be */
    fail_later(w, (ts_status)n.status, msg, false);
}

static void nop_cb(void *arg, ts_status st)
{
    (void)arg;
    (void)st;
}

static void post_notices(world *w)
{
    ts_transport *t = w->t;
    w->notices_posted = true;
    if (!w->nslots) return;
    for (int p = 0; p < t->size; p++) {
        if (p == t->rank) continue;
        notice_slot *sl = &w->nslots[p];
        sl->w = w;
        sl->peer = p;
        if (t->vt->recv(t, p, &sl->n, sizeof sl->n, NOTICE_TAG, on_notice, sl) != TS_OK)
            ts_logf(TS_LOG_DEBUG, "comm: rank %d: no notice receive from rank %d: %s", t->rank, p, ts_last_error());
    }
}

static void send_notices(world *w, ts_status st, int culprit, const char *msg)
{
    ts_transport *t = w->t;
    if (!w->nout || !w->notices_posted) return;
    *w->nout = (notice){.magic = NOTICE_MAGIC, .status = st, .from = t->rank, .culprit = culprit};
    copy_str(w->nout->msg, sizeof w->nout->msg, msg);
    for (int p = 0; p < t->size; p++) {
        if (p == t->rank || p == culprit) continue;
        if (t->vt->send(t, p, w->nout, sizeof *w->nout, NOTICE_TAG, nop_cb, NULL) != TS_OK)
            ts_logf(TS_LOG_DEBUG, "comm: rank %d: no notice to rank %d: %s", t->rank, p, ts_last_error());
    }
}

/* "all_gather #12 (group 3)" */
static void op_name(const op *o, char *buf, size_t n)
{
    if (o->kind == TS_COLL_SEND || o->kind == TS_COLL_RECV)
        snprintf(buf, n, "%s (tag %llu)", k_kind_names[o->kind], (unsigned long long)((o->tagbase >> 8) & SEQ_MASK));
    else if (o->gid)
        snprintf(buf, n, "%s #%u (group %llu)", k_kind_names[o->kind], o->seq, (unsigned long long)o->gid);
    else
        snprintf(buf, n, "%s #%u", k_kind_names[o->kind], o->seq);
}

/* req->err = "<op>: <msg>" */
static void set_op_err(op *o, const char *msg)
{
    char name[64];
    op_name(o, name, sizeof name);
    size_t a = strlen(name), b = strlen(msg), n = sizeof o->req->err - 1;
    if (a + 2 > n) a = n - 2;
    if (a + 2 + b > n) b = n - a - 2;
    memcpy(o->req->err, name, a);
    memcpy(o->req->err + a, ": ", 2);
    memmove(o->req->err + a + 2, msg, b); /* msg may be req->err's own copy */
    o->req->err[a + 2 + b] = '\0';
}

/* Fails the world: every active and later op completes with `st`; `src`
 * (if any) already holds its own message. A fingerprint mismatch keeps its
 * message too. notify: send the notice to every peer (culprit: the rank
 * that failed, -1 if none). */
static void fail_world(world *w, ts_status st, const char *msg, op *src, bool notify, int culprit)
{
    if (w->failed) return;
    w->failed = st;
    copy_str(w->failed_msg, sizeof w->failed_msg, msg);
    if (notify) send_notices(w, st, culprit, msg);
    /* the hook (the store's notice, dist.c) runs before any request
     * completes, so a rank that exits on the error has told the others;
     * only for this rank's own findings: a notice (notify) or its own
     * deadline (src, check_deadlines), not a failure it was told of */
    if (w->fail_hook && (notify || (src && st == TS_ERR_TIMEOUT))) w->fail_hook(w->fail_hook_arg, st, culprit, msg);
    for (op *o = w->active; o; o = o->next) {
        if (o->finished || o == src || o->fp_bad) continue;
        o->err = st;
        set_op_err(o, msg);
    }
    w->t->vt->cancel_all(w->t, st);
    for (op *o = w->active; o; o = o->next) {
        if (o->finished) continue;
        o->pending = 0; /* the transport completed or dropped everything */
        advance(o);
    }
}

/* Group rank g of `o` as the user knows it: "rank 2", or "rank 1 (world
 * rank 2)" in a group. */
static int peer_str(const op *o, int g, char *buf, size_t n)
{
    if (o->gid) return snprintf(buf, n, "rank %d (world rank %d)", g, o->map[g]);
    return snprintf(buf, n, "rank %d", g);
}

/* The deadline message: the op and the peers it still waits to receive
 * from; for an all-gather phase, broadcast or all-to-all also whose data
 * it still lacks (the ranks that have not completed their part, as far as
 * this rank can know); then the ranks its unfinished sends go to (with no
 * receive pending, those are the ones it waits for), so that every
 * deadline names a rank. */
static void deadline_msg(const op *o, double timeout_s, char *msg, size_t n)
{
    char name[64];
    op_name(o, name, sizeof name);
    int k = snprintf(msg, n, "%s on rank %d of %d passed its deadline of %.3g s", name, o->rank, o->W, timeout_s);
    bool any = false;
    for (int pass = 0; pass < 2; pass++) { /* fingerprints first: those peers have not entered it */
        for (int i = 0; i < 6 * o->W && k > 0 && (size_t)k < n; i++) {
            const xfer *x = &o->x[i];
            if (!x->live || x->kind != K_RECV || (pass == 0) != (x->phase == PH_FP)) continue;
            if (pass == 1) { /* a peer already named as not entered */
                bool named = false;
                for (int j = 0; j < 2 * o->W; j++) {
                    const xfer *y = &o->x[4 * o->W + j];
                    if (y->live && y->kind == K_RECV && y->peer == x->peer) named = true;
                }
                if (named) continue;
            }
            k += snprintf(msg + k, n - (size_t)k, "%s", any ? "; " : ": waiting for ");
            any = true;
            if ((size_t)k >= n) break;
            k += peer_str(o, x->peer, msg + k, n - (size_t)k);
            if ((size_t)k >= n) break;
            int origin = -1;
            if (x->phase == PH_AG) origin = ((o->rank - x->step - 1) % o->W + o->W) % o->W;
            else if (x->phase == PH_BC) origin = o->root;
            if (x->phase == PH_FP)
                k += snprintf(msg + k, n - (size_t)k, ", which has not entered it");
            else if (origin >= 0 && origin != x->peer) {
                k += snprintf(msg + k, n - (size_t)k, " to forward the data of ");
                if ((size_t)k < n) k += peer_str(o, origin, msg + k, n - (size_t)k);
            } else if (x->phase == PH_RS)
                k += snprintf(msg + k, n - (size_t)k, " (reduce-scatter step %d of %d)", x->step + 1, o->W - 1);
            /* a ring waits on one peer: its first missing step says it */
            if (x->phase != PH_FP && x->phase != PH_A2A) break;
        }
    }
    if (k <= 0 || (size_t)k >= n) return;
    /* the ranks its unfinished sends go to (a stopped rank does not take a
     * rendezvous send), each once and not one named for a receive: a rank
     * that waits for its upstream neighbour, itself stuck, still names the
     * stopped rank downstream */
    int named = 0, first = -1;
    for (int i = 0; i < 6 * o->W && (size_t)k < n; i++) {
        const xfer *x = &o->x[i];
        if (!x->live || x->kind != K_SEND) continue;
        bool seen = false;
        for (int j = 0; j < 6 * o->W; j++) {
            const xfer *y = &o->x[j];
            if (y->live && y->peer == x->peer && ((y->kind == K_SEND && j < i) || (y->kind == K_RECV && any)))
                seen = true;
        }
        if (seen) continue;
        k += snprintf(msg + k, n - (size_t)k, "%s", named ? ", " : any ? "; its sends to " : ": waiting for ");
        if ((size_t)k < n) k += peer_str(o, x->peer, msg + k, n - (size_t)k);
        if (!named++) first = x->peer;
    }
    if ((size_t)k >= n) return;
    if (any) {
        if (named) snprintf(msg + k, n - (size_t)k, " did not complete");
    } else if (named == 1) {
        k += snprintf(msg + k, n - (size_t)k, " (its sends to ");
        if ((size_t)k < n) k += peer_str(o, first, msg + k, n - (size_t)k);
        if ((size_t)k < n) snprintf(msg + k, n - (size_t)k, " did not complete)");
    } else if (named > 1) {
        snprintf(msg + k, n - (size_t)k, " (its sends to them did not complete)");
    } else {
        /* nothing in flight: the ring's upstream rank (a point-to-point
         * op's peer) is the one whose data or completion it lacks */
        int up = o->kind == TS_COLL_SEND || o->kind == TS_COLL_RECV ? o->peer : o->left;
        k += snprintf(msg + k, n - (size_t)k, ": waiting for ");
        if ((size_t)k < n) k += peer_str(o, up, msg + k, n - (size_t)k);
        if ((size_t)k < n) snprintf(msg + k, n - (size_t)k, " (no transfer pending on this rank)");
    }
}

static void sweep(world *w)
{
    op **pp = &w->active;
    while (*pp) {
        op *o = *pp;
        if (o->finished) {
            *pp = o->next;
            op_free(o);
        } else {
            pp = &o->next;
        }
    }
}

/* The transport's dead peer, the grace period, the notices: fails the
 * world once it knows which rank failed first (see Failure notices). */
static void check_peers(world *w)
{
    ts_transport *t = w->t;
    if (w->failed) return;
    if (w->pend_st) {
        fail_world(w, w->pend_st, w->pend_msg, NULL, w->pend_notify, -1);
        return;
    }
    ts_status st = TS_OK;
    int dead = t->vt->failed_peer(t, &st);
    char why[ERR_LEN - 32] = "";
    if (dead >= 0) {
        snprintf(why, sizeof why, "%s", ts_last_error());
        suspect(w, dead);
    }
    if (w->suspect < 0) return;
    if (t->size > 2 && ts_now_ns() - w->suspect_ns < PEER_GRACE_NS) return;
    char msg[ERR_LEN];
    if (dead == w->suspect && why[0])
        snprintf(msg, sizeof msg, "rank %d failed (%s)", dead, why);
    else
        snprintf(msg, sizeof msg, "rank %d failed (a transfer with it failed)", w->suspect);
    fail_world(w, TS_ERR_PEER_FAILED, msg, NULL, true, w->suspect);
}

/* ------------------------------------------------------------------ */
/* Who never entered                                                   */
/* ------------------------------------------------------------------ */

/* A rank that never enters a collective (stopped, sleeping, stuck in its
 * own code) shows in the deadline messages of its ring neighbours only:
 * the others wait on a survivor that itself waits, and each would name
 * the rank it waits on. With a store (ts__world_attach_store), a rank
 * whose collective is still pending half way to its deadline records
 * that it entered it ("<prefix>/entered/<gid>/<world rank>" = its
 * sequence number: one store call per collective that lasts that long,
 * none for the others). At the deadline the rank reads the group's
 * records: the ranks that have not recorded this collective (or a later
 * one) are the ones that never entered it. It names them, sends the
 * message to every other rank as a failure notice (so all survivors
 * report the same ranks, even those whose deadline comes later or who
 * would first see the reporter exit), and records the first of them for
 * the launcher (TS_LAUNCH_HUNG_KEY), whose last line names it. Store
 * calls are bounded by STORE_CALL_S (a fraction of the deadline); a
 * store that does not answer (its host is the hung rank) or fails is
 * dropped and the deadline message says what this rank alone sees.
 * Known limit: a rank that entered more than half the deadline after the
 * one whose deadline passes has not recorded its entry yet, and is named
 * with the rank that never entered. */
#define STORE_CALL_S 2.0

static void store_drop(world *w)
{
    ts_logf(TS_LOG_WARN,
            "comm: rank %d: no hung-peer records in the store from now on (deadline messages will not name the "
            "ranks that never entered): %s",
            w->comm->rank, ts_last_error());
    ts_store_close(w->store);
    w->store = NULL;
}

static void store_bound(world *w)
{
    double d = atomic_load(&w->deadline_s) / 4;
    ts_store_set_timeout(w->store, d < STORE_CALL_S ? d : STORE_CALL_S);
}

static bool collective(const op *o) { return o->kind != TS_COLL_SEND && o->kind != TS_COLL_RECV; }

static void note_entry(world *w, op *o)
{
    o->noted = true;
    if (!w->store || !collective(o)) return;
    char key[sizeof w->store_prefix + 64], val[16];
    snprintf(key, sizeof key, "%s/entered/%llu/%d", w->store_prefix, (unsigned long long)o->gid, o->map[o->rank]);
    snprintf(val, sizeof val, "%u", o->seq);
    store_bound(w);
    if (ts_store_set(w->store, key, val, strlen(val)) != TS_OK) store_drop(w);
}

/* The group ranks of o that have not recorded o (or a later collective
 * of its group) in the store, into `out` (at most o->W); -1 when the
 * store cannot tell. */
static int not_entered(world *w, const op *o, int *out)
{
    if (!w->store || !collective(o)) return -1;
    store_bound(w);
    int n = 0;
    for (int g = 0; g < o->W; g++) {
        if (g == o->rank) continue;
        char key[sizeof w->store_prefix + 64];
        snprintf(key, sizeof key, "%s/entered/%llu/%d", w->store_prefix, (unsigned long long)o->gid, o->map[g]);
        ts_status st = ts_store_check(w->store, key);
        if (st == TS_ERR_NOT_FOUND) {
            out[n++] = g;
            continue;
        }
        void *v = NULL;
        size_t len = 0;
        if (st == TS_OK) st = ts_store_get(w->store, key, &v, &len);
        if (st != TS_OK) {
            store_drop(w);
            return -1;
        }
        char txt[16];
        snprintf(txt, sizeof txt, "%.*s", (int)(len < sizeof txt - 1 ? len : sizeof txt - 1), (const char *)v);
        free(v);
        unsigned seq = (unsigned)strtoul(txt, NULL, 10);
        if ((int32_t)(seq - o->seq) < 0) out[n++] = g; /* an earlier one: not this one */
    }
    return n;
}

/* The deadline message when the store names the ranks that never
 * entered; false (msg untouched) when it cannot. *culprit_out: the first
 * one's world rank. */
static bool hung_msg(world *w, const op *o, double timeout_s, char *msg, size_t n, int *culprit_out)
{
    int *missing = ts__malloc(TS_MEM_COMM, (size_t)o->W * sizeof *missing);
    if (!missing) return false;
    int k = not_entered(w, o, missing);
    if (k <= 0) {
        ts__free(TS_MEM_COMM, missing);
        return false;
    }
    char name[64];
    op_name(o, name, sizeof name);
    int m = snprintf(msg, n, "%s on rank %d of %d passed its deadline of %.3g s: waiting for ", name, o->rank, o->W,
                     timeout_s);
    for (int i = 0; i < k && m > 0 && (size_t)m < n; i++) {
        if (i) m += snprintf(msg + m, n - (size_t)m, i + 1 == k ? " and " : ", ");
        if ((size_t)m < n) m += peer_str(o, missing[i], msg + m, n - (size_t)m);
    }
    if (m > 0 && (size_t)m < n)
        snprintf(msg + m, n - (size_t)m, ", which %s not entered it (%s)", k == 1 ? "has" : "have",
                 k + 1 < o->W ? "the store shows the other ranks in it" : "as the store shows");
    *culprit_out = o->map[missing[0]];
    ts__free(TS_MEM_COMM, missing);
    return true;
}

/* Records the hung rank for the launcher: the first rank to find one
 * wins (compare-and-set from empty). */
static void note_hung(world *w, const op *o, int culprit)
{
    if (!w->store || !w->hung_key[0]) return;
    char val[96], name[64];
    op_name(o, name, sizeof name);
    snprintf(val, sizeof val, "%d %s", culprit, name);
    if (ts_store_compare_set(w->store, w->hung_key, "", 0, val, strlen(val), NULL, NULL) != TS_OK) store_drop(w);
}

static void check_deadlines(world *w)
{
    if (w->failed || !w->active) return;
    uint64_t now = ts_now_ns();
    double dl = atomic_load(&w->deadline_s);
    uint64_t half = (uint64_t)(dl * 0.5e9);
    for (op *o = w->active; o; o = o->next) {
        if (!o->finished && !o->noted && w->store && now + half > o->deadline_ns) note_entry(w, o);
        if (!o->finished && now > o->deadline_ns) {
            char msg[ERR_LEN];
            int culprit = -1;
            bool named = hung_msg(w, o, dl, msg, sizeof msg, &culprit);
            if (!named) deadline_msg(o, dl, msg, sizeof msg);
            if (!o->err || o->err == TS_ERR_PEER_FAILED) {
                o->err = TS_ERR_TIMEOUT;
                copy_str(o->req->err, sizeof o->req->err, msg);
            }
            if (named) note_hung(w, o, culprit);
            fail_world(w, TS_ERR_TIMEOUT, msg, o, named, culprit);
            break;
        }
    }
}


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
/* The progress lock                                                   */
/* ------------------------------------------------------------------ */

/* The world whose progress lock this thread holds (NULL: none). */
static _Thread_local world *tl_holding;

static void prog_lock(world *w)
{
    pthread_mutex_lock(&w->prog_mu);
    tl_holding = w;
}

static bool prog_trylock(world *w)
{
    if (pthread_mutex_trylock(&w->prog_mu) != 0) return false;
    tl_holding = w;
    return true;
}

static void prog_unlock(world *w)
{
    tl_holding = NULL;
    pthread_mutex_unlock(&w->prog_mu);
}

static void wake_thread(world *w)
{
    uint64_t one = 1;
    ssize_t wr = write(w->efd, &one, sizeof one);
    (void)wr; /* EAGAIN: the counter is non-zero already */
}

/* One round of progress, under prog_mu: starts the queued ops, progresses
 * the transport (the ops' state machines run in its callbacks), checks
 * failures and (if `timers`: a clock read, which a driver spares most of
 * its rounds) deadlines, frees finished ops. Returns the events handled,
 * ops started included. */
static int round_locked(world *w, bool timers)
{
    int n = 0;
    if (!w->notices_posted) post_notices(w);
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
                set_op_err(o, w->failed_msg);
                finish(o);
            } else {
                start_op(w, o);
            }
        }
    }
    n += w->t->vt->progress(w->t);
    check_peers(w);
    if (timers) check_deadlines(w);
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
    prog_lock(w);
    fn(w->t, arg);
    prog_unlock(w);
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

static ts_status pin_register(void *ctx, void *addr, size_t len, void **handle_out)
{
    reg_call c = {.addr = addr, .len = len};
    run_locked(ctx, do_register, &c);
    if (c.st) return ts_error(c.st, "%s", c.err);
    *handle_out = c.handle;
    return TS_OK;
}

static void pin_deregister(void *ctx, void *handle)
{
    reg_call c = {.handle = handle};
    run_locked(ctx, do_deregister, &c);
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

/* ------------------------------------------------------------------ */
/* Driving                                                             */
/* ------------------------------------------------------------------ */

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* A caller's last error, kept across rounds of progress on its thread:
 * the rounds run other ops' callbacks, which record their errors there. */
typedef struct saved_err {
    ts_status st;
    char msg[ERR_LEN];
} saved_err;

static void err_save(saved_err *e)
{
    e->st = ts_last_status();
    if (e->st != TS_OK) copy_str(e->msg, sizeof e->msg, ts_last_error());
}

/* only when it changed: formatting it again costs a microsecond */
static void err_restore(const saved_err *e)
{
    if (e->st != TS_OK) {
        if (ts_last_status() != e->st || strcmp(ts_last_error(), e->msg) != 0) ts_error(e->st, "%s", e->msg);
    } else if (ts_last_status() != TS_OK) {
        ts_clear_error();
    }
}

/* ts_request_wait on a pending request: the caller runs rounds of
 * progress itself (see the top of the file) until the request completes,
 * or until DRIVE_IDLE_NS pass without events; then it hands over to the
 * communication thread and sleeps on the condition variable. Whoever
 * holds the lock progresses every op of the world, so several callers
 * waiting at once take turns, and one's round may complete another's
 * request. While any caller drives, the communication thread parks (see
 * park); a driver that leaves ops behind wakes it. */
static void drive(world *w, ts_request *r)
{
    saved_err saved;
    err_save(&saved); /* the caller's own last error is kept */
    atomic_fetch_add(&w->driving, 1);
    uint64_t start = ts_now_ns(), last = start;
    bool held = false, fresh = false, hot = true;
    /* The lock is kept across rounds (released every DRIVE_BATCH rounds
     * for another driver, and around each yield), and the clock read
     * once per DRIVE_BATCH rounds: a clock read costs about as much as
     * an empty round (85 ns on a VM). */
    for (unsigned k = 1; !atomic_load_explicit(&r->done, memory_order_acquire); k++) {
        if (!held) held = prog_trylock(w);
        if (held && round_locked(w, k % DRIVE_BATCH == 0) > 0) fresh = true;
        if (atomic_load_explicit(&r->done, memory_order_acquire)) break;
        if (k % DRIVE_BATCH == 0) {
            uint64_t now = ts_now_ns();
            atomic_store_explicit(&w->caller_ns, now, memory_order_relaxed);
            if (fresh) last = now;
            else if (now - last >= DRIVE_IDLE_NS) break;
            fresh = false;
            hot = now - start < DRIVE_HOT_NS;
            if (held && hot) {
                prog_unlock(w);
                held = false;
            }
        }
        if (hot) {
            cpu_relax();
        } else {
            if (held) prog_unlock(w);
            held = false;
            sched_yield();
        }
    }
    if (held) prog_unlock(w);
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
    if (!done || atomic_load(&w->traced) || (atomic_load(&w->live) > 0 && !atomic_load(&w->deferring))) wake_thread(w);
    if (!done) {
        pthread_mutex_lock(&w->mu);
        while (!atomic_load(&r->done)) pthread_cond_wait(&w->cv, &w->mu);
        pthread_mutex_unlock(&w->mu);
    }
    err_restore(&saved);
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

/* Before the take-over (takeover_ns): the thread sleeps `ns` on
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

static void *comm_thread(void *arg)
{
    world *w = arg;
    tl_comm_world = w;
    ts_trace_thread_name("comm");
    ts_transport *t = w->t;
    uint64_t spin = spin_ns(), last_event = ts_now_ns();
    int busy = 0;
    long nap_us = NAP_MIN_US;
    uint64_t takeover = takeover_ns();
    for (;;) {
        bool stop = atomic_load(&w->stop);
        if (!stop && takeover > 0) { /* a caller ran a round lately: leave progress to the callers */
            uint64_t now = ts_now_ns(), lc = atomic_load_explicit(&w->caller_ns, memory_order_relaxed);
            if (lc && now - lc < takeover) {
                takeover_sleep(w, takeover - (now - lc));
                continue;
            }
        }
        if (!stop && atomic_load(&w->driving) > 0) {
            park(w);
            last_event = ts_now_ns(); /* the drivers were busy: spin a little first */
            nap_us = NAP_MIN_US;
            busy = 0;
            continue;
        }
        prog_lock(w);
        int n = round_locked(w, true);
        flush_traces(w);
        if (stop) {
            if (w->active && !w->failed) fail_world(w, TS_ERR_COMM, "the world was freed with collectives pending", NULL, false, -1);
            sweep(w);
            flush_traces(w);
            prog_unlock(w);
            break;
        }
        if (n > 0) {
            prog_unlock(w);
            last_event = ts_now_ns();
            nap_us = NAP_MIN_US;
            continue;
        }
        uint64_t idle = ts_now_ns() - last_event;
        if (idle < spin) {
            prog_unlock(w);
            continue;
        }
        bool armed = t->vt->arm(t) != TS_ERR_ALREADY;
        bool watch = w->active || (w->suspect >= 0 && !w->failed);
        int tfd = t->vt->wait_fd(t);
        /* about to sleep without a timeout: set under the lock, so that a
         * caller who starts an op after this round (submit) sees it */
        if (armed && !watch && tfd >= 0) atomic_store(&w->sleeping, true);
        prog_unlock(w);
        /* not armed: nap, below, after a few retries */
        if (!armed && ++busy < BUSY_RETRIES) continue;
        busy = 0;
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
        struct timespec nap = {0, nap_us * 1000L}, ten = {0, 10 * 1000000L};
        long cap = idle >= NAP_LONG_AFTER_NS ? NAP_LONG_US : NAP_MAX_US;
        if (!armed) nap_us = nap_us * 2 > cap ? cap : nap_us * 2;
        const struct timespec *timeout = !armed ? &nap : watch || pfd[1].fd < 0 ? &ten : NULL;
        int rc = ppoll(pfd, (nfds_t)nfd, timeout, NULL);
        atomic_store(&w->sleeping, false);
        if (armed && rc > 0) { /* woken by an event (not the timeout) */
            last_event = ts_now_ns();
            nap_us = NAP_MIN_US;
        }
        uint64_t cnt;
        if (pfd[0].revents & POLLIN) {
            ssize_t rd = read(w->efd, &cnt, sizeof cnt);
            (void)rd;
        }
    }
    return NULL;
}

/* ------------------------------------------------------------------ */
/* Worlds                                                              */
/* ------------------------------------------------------------------ */

/* TS_COMM_CHECK=0: no fingerprints (see Fingerprints). */
static bool check_default(void)
{
    const char *e = getenv("TS_COMM_CHECK");
    return !(e && strcmp(e, "0") == 0);
}

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
    .w = NULL, .rank = 0, .size = 1, .gid = 0, .seq = 0, .stats_mu = PTHREAD_MUTEX_INITIALIZER,
};

/* The world ts_dist_init published (NULL when none); comm.c owns it,
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

ts_status ts__world_new(ts_transport *t, double timeout_s, ts_comm **world_out)
{
    if (!t || !world_out) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts__world_new: NULL argument");
    if (t->size > 128) return ts_error(TS_ERR_UNSUPPORTED, "ts__world_new: %d ranks; the tag layout allows 128", t->size);
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
    w->t = t;
    w->comm = c;
    w->timeout_s = timeout_s > 0 ? timeout_s : 300.0;
    (void)debug_level(); /* a bad TS_DISTRIBUTED_DEBUG is a warning now */
    atomic_init(&w->deadline_s, w->timeout_s);
    atomic_init(&w->check, check_default());
    atomic_init(&w->fp_inline, fp_inline_max());
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
    if (t->size > 1) {
        w->nslots = ts__calloc(TS_MEM_COMM, (size_t)t->size, sizeof *w->nslots);
        w->nout = ts__calloc(TS_MEM_COMM, 1, sizeof *w->nout);
        if (!w->nslots || !w->nout || pthread_create(&w->thread, NULL, comm_thread, w) != 0) {
            bool mem = !w->nslots || !w->nout;
            ts__free(TS_MEM_COMM, w->nslots);
            ts__free(TS_MEM_COMM, w->nout);
            close(w->efd);
            pthread_mutex_destroy(&w->mu);
            pthread_cond_destroy(&w->cv);
            pthread_mutex_destroy(&w->prog_mu);
            pthread_mutex_destroy(&c->stats_mu);
            ts__free(TS_MEM_COMM, c);
            ts__free(TS_MEM_COMM, w);
            if (mem) return ts_error(TS_ERR_NO_MEMORY, "ts__world_new: out of memory");
            return ts_error(TS_ERR_INTERNAL, "ts__world_new: cannot start the communication thread");
        }
        w->has_thread = true;
    }
    /* the first world over a transport with a memory map registers the
     * pinned memory of the process (base.h) from now on */
    if (t->vt->mem_register && t->vt->mem_deregister) {
        ts__pin_registrar r = {pin_register, pin_deregister, w};
        w->registrar = ts__pin_registrar_set(&r) == TS_OK;
        if (!w->registrar) ts_clear_error();
    }
    *world_out = c;
    return TS_OK;
}

void ts__world_set_fail_hook(ts_comm *c, ts__world_fail_hook hook, void *arg)
{
    if (!c || !c->w) return;
    prog_lock(c->w);
    c->w->fail_hook = hook;
    c->w->fail_hook_arg = arg;
    prog_unlock(c->w);
}

void ts__world_fail(ts_comm *c, ts_status st, const char *msg)
{
    if (!c || c == &g_local || !c->w || st >= 0) return;
    world *w = c->w;
    prog_lock(w);
    fail_later(w, st, msg, false);
    if (!w->has_thread) check_peers(w); /* nobody else runs a round */
    prog_unlock(w);
    if (w->has_thread) wake_thread(w);
}

ts_status ts__world_attach_store(ts_comm *c, ts_store *client, const char *prefix, const char *hung_key)
{
    if (!c || c == &g_local || !c->w || !client || !prefix) {
        ts_store_close(client);
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts__world_attach_store: no world, client or prefix");
    }
    world *w = c->w;
    prog_lock(w);
    ts_store_close(w->store);
    w->store = client;
    copy_str(w->store_prefix, sizeof w->store_prefix, prefix);
    copy_str(w->hung_key, sizeof w->hung_key, hung_key ? hung_key : "");
    prog_unlock(w);
    return TS_OK;
}

void ts__world_free(ts_comm *c)
{
    if (!c || c == &g_local) return;
    log_summary(c);
    world *w = c->w;
    if (w->registrar) ts__pin_registrar_clear(w); /* while the thread still runs the deregistrations */
    if (w->has_thread) {
        atomic_store(&w->stop, true);
        wake_thread(w);
        pthread_join(w->thread, NULL);
    }
    w->t->vt->destroy(w->t); /* runs the notice receives' callbacks (cancelled) */
    ts_store_close(w->store);
    flush_traces(w);         /* none left by the thread's last round; a thread-less world's */
    while (w->op_cache) {
        op *o = w->op_cache;
        w->op_cache = o->next;
        ts__free(TS_MEM_COMM, o->fpbuf);
        ts__free(TS_MEM_COMM, o);
    }
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

/* ------------------------------------------------------------------ */
/* Submission                                                          */
/* ------------------------------------------------------------------ */

static op *op_new(ts_comm *c, ts_coll_kind kind)
{
    world *w = c->w;
    op *o = NULL;
    if (w) { /* a cached block (op_free), sized for the world */
        pthread_mutex_lock(&w->mu);
        if ((o = w->op_cache)) {
            w->op_cache = o->next;
            w->n_cached--;
        }
        pthread_mutex_unlock(&w->mu);
    }
    unsigned char *fpbuf = NULL; /* a cached op keeps its fingerprint buffer */
    if (o) {
        fpbuf = o->fpbuf;
        memset(o, 0, op_block_bytes(c->size));
    } else {
        o = ts__calloc(TS_MEM_COMM, 1, op_block_bytes(w ? w->t->size : c->size));
    }
    bool check = w && atomic_load(&w->check) && kind != TS_COLL_SEND && kind != TS_COLL_RECV;
    if (o && check && c->size >= 2 && !fpbuf) fpbuf = ts__malloc(TS_MEM_COMM, FPB_BYTES);
    ts_request *r = ts__calloc(TS_MEM_COMM, 1, sizeof *r);
    if (!o || !r || (check && c->size >= 2 && !fpbuf)) {
        ts__free(TS_MEM_COMM, fpbuf);
        ts__free(TS_MEM_COMM, o);
        ts__free(TS_MEM_COMM, r);
        return NULL;
    }
    o->fpbuf = fpbuf;
    size_t nx = (size_t)(6 * c->size);
    xfer *x = (xfer *)(void *)(o + 1);
    o->w = w;
    o->x = x;
    o->theirs = (fp *)(void *)(x + nx);
    o->held = (int *)(void *)(o->theirs + c->size);
    o->map = o->held + 2 * c->size;
    for (int i = 0; i < c->size; i++) o->map[i] = c->map ? c->map[i] : i;
    r->w = w;
    o->req = r;
    o->kind = kind;
    o->W = c->size;
    o->rank = c->rank;
    o->left = (c->rank - 1 + c->size) % c->size;
    o->right = (c->rank + 1) % c->size;
    o->post = 1.0;
    o->check = check;
    o->mine = (fp){.kind = (uint8_t)kind, .dtype = FP_NONE, .rop = FP_NONE, .root = FP_NONE};
    return o;
}

static void set_fp(op *o, ts_dtype d, int64_t count, unsigned rop, unsigned root)
{
    o->mine.dtype = (uint8_t)d;
    o->mine.count = (uint64_t)count;
    o->mine.rop = (uint8_t)rop;
    o->mine.root = (uint8_t)root;
}

static void op_discard(op *o)
{
    ts__free(TS_MEM_COMM, o->req);
    op_free(o);
}

/* Counts, numbers and submits `o`; waits if r_out is NULL. */
static ts_status submit(ts_comm *c, op *o, size_t bytes, ts_request **r_out)
{
    bool p2p = o->kind == TS_COLL_SEND || o->kind == TS_COLL_RECV;
    pthread_mutex_lock(&c->stats_mu);
    c->stats.calls[o->kind]++;
    c->stats.bytes[o->kind] += bytes;
    uint32_t seq = p2p ? 0 : c->seq++;
    pthread_mutex_unlock(&c->stats_mu);
    /* p2p: tagbase already holds the user tag in the middle field */
    o->tagbase = p2p ? (c->gid << GID_SHIFT) | o->tagbase | P2P_STEP
                     : (c->gid << GID_SHIFT) | ((uint64_t)(seq & SEQ_MASK) << 8);
    o->gid = c->gid;
    o->seq = seq;
    o->mine.seq = seq;
    o->bytes = bytes;
    o->submit_ns = ts_now_ns();
    ts_request *r = o->req;
    world *w = c->w;
    if (o->W == 1 || !w || !w->has_thread) {
        /* nothing to exchange: finalize here */
        ts_status st = TS_OK;
        finalize(o);
        log_detail(o, st);
        complete_req(NULL, r, st, NULL);
        op_free(o);
    } else {
        atomic_fetch_add(&w->live, 1);
        pthread_mutex_lock(&w->mu);
        o->next = NULL;
        if (w->queue_tail) w->queue_tail->next = o;
        else w->queue = o;
        w->queue_tail = o;
        atomic_store_explicit(&w->queued, true, memory_order_release);
        pthread_mutex_unlock(&w->mu);
        /* A blocking op is started by its caller, who drives progress in
         * ts_request_wait below. An asynchronous one is started here too
         * (its receives and first sends posted, with one round of
         * progress) when the progress lock is free: the communication
         * thread, which takes over ops no caller drives after a delay
         * (takeover_ns), then need not be woken, unless it sleeps without
         * a timeout (no op was pending) and would not look at this one.
         * When the lock is busy the thread is woken to start it. */
        if (r_out) {
            bool started = false;
            if (takeover_ns() > 0 && prog_trylock(w)) {
                saved_err saved;
                err_save(&saved);
                (void)round_locked(w, false);
                prog_unlock(w);
                err_restore(&saved);
                atomic_store_explicit(&w->caller_ns, ts_now_ns(), memory_order_relaxed);
                started = true;
            }
            if (!started || atomic_load(&w->sleeping)) wake_thread(w);
        }
    }
    if (r_out) {
        *r_out = r;
        return TS_OK;
    }
    ts_status st = ts_request_wait(r);
    ts_request_free(r);
    return st;
}

static ts_status check_tensor(const char *fn, const char *what, const ts_tensor *t)
{
    if (!t) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL %s", fn, what);
    if (!ts_tensor_is_contiguous(t)) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %s is not contiguous", fn, what);
    if (ts_tensor_numel(t) > 0 && !ts_tensor_data(t))
        return ts_error(TS_ERR_RELEASED, "%s: the storage of %s is released", fn, what);
    return TS_OK;
}

static ts_status check_comm(const char *fn, const ts_comm *c)
{
    if (!c) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL group", fn);
    return TS_OK;
}

/* An all-gather (its own block in place) sends that block with its
 * fingerprint when it is small enough (see Fingerprints). */
static void set_inline_ag(op *o) { o->inl = fp_inline(o); }

ts_status ts_all_gather_into_tensor(ts_comm *c, ts_tensor *out, ts_tensor *in, ts_request **r)
{
    static const char fn[] = "ts_all_gather_into_tensor";
    ts_status s;
    if ((s = check_comm(fn, c)) || (s = check_tensor(fn, "out", out)) || (s = check_tensor(fn, "in", in))) return s;
    if (ts_tensor_dtype(out) != ts_tensor_dtype(in))
        return ts_error(TS_ERR_DTYPE, "%s: out is %s, in is %s", fn, ts_dtype_name(ts_tensor_dtype(out)),
                        ts_dtype_name(ts_tensor_dtype(in)));
    int64_t n = ts_tensor_numel(in);
    if (ts_tensor_numel(out) != n * c->size)
        return ts_error(TS_ERR_SHAPE, "%s: out has %lld elements, expected %d x %lld", fn,
                        (long long)ts_tensor_numel(out), c->size, (long long)n);
    op *o = op_new(c, TS_COLL_ALL_GATHER);
    if (!o) return TS_ERR_NO_MEMORY;
    set_fp(o, ts_tensor_dtype(in), n, FP_NONE, FP_NONE);
    o->block = (size_t)n * ts_dtype_size(ts_tensor_dtype(in));
    o->buf = ts_tensor_data(out);
    o->ag = true;
    if (o->block && blk(o, c->rank) != (unsigned char *)ts_tensor_data(in))
        memmove(blk(o, c->rank), ts_tensor_data(in), o->block);
    set_inline_ag(o);
    return submit(c, o, o->block, r);
}

static ts_status check_reduce(const char *fn, ts_dtype d, ts_reduce_op op_, double pre, double post)
{
    if (!reducible(d)) return ts_error(TS_ERR_DTYPE, "%s: cannot reduce %s", fn, ts_dtype_name(d));
    if ((unsigned)op_ >= TS_REDUCE_OP_COUNT) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: bad reduce op %d", fn, (int)op_);
    if (!(pre > 0) || !(post > 0) || !isfinite(pre) || !isfinite(post))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: divide factors must be finite and > 0 (%g, %g)", fn, pre, post);
    if ((op_ == TS_REDUCE_MAX || op_ == TS_REDUCE_MIN) && (pre != 1.0 || post != 1.0))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: MAX and MIN take no divide factors", fn);
    return TS_OK;
}

/* A scratch block from the caching pool (reused across collectives, so
 * no fresh pages are touched in a step: DEPS-GUIDE §7). */
static unsigned char *scratch(size_t bytes, size_t *got)
{
    return ts__pool_alloc(bytes ? bytes : 1, got);
}

/* The op's buffer from the pool; false without memory. */
static bool own_scratch(op *o, size_t bytes)
{
    o->scratch = scratch(bytes, &o->scratch_bytes);
    o->buf = o->scratch;
    o->owned = o->scratch != NULL;
    return o->scratch != NULL;
}

/* Sets up the reduce-scatter phase over a source of W blocks of block_n
 * elements: the stages (up to two accumulation blocks) and step 0's send
 * block, converted when the source is not already in the accumulation
 * dtype or is divided. */
static ts_status setup_rs(op *o, const void *src, ts_dtype sd, double pre, size_t block_n)
{
    size_t es = ts_dtype_size(o->acc);
    o->rs = true;
    o->src = src;
    o->src_dtype = sd;
    o->pre = pre;
    o->block_n = block_n;
    o->block = block_n * es;
    if (o->W == 1) return TS_OK;
    bool convert = sd != o->acc || pre != 1.0;
    if ((o->inl = fp_inline(o))) {
        /* step 0 travels with the fingerprints (see Fingerprints): its
         * block is received in front of staging block 0, in fpbuf */
        int extra = (o->W > 2) + convert;
        if (extra) {
            o->sscratch = scratch((size_t)extra * o->block, &o->sscratch_bytes);
            if (!o->sscratch) return TS_ERR_NO_MEMORY;
        }
        o->stage[0] = o->stage[1] = o->fpbuf + FPB_RECV;
        if (o->W > 2) o->stage[1] = o->sscratch;
        if (convert) {
            o->send0 = o->sscratch + (o->W > 2 ? o->block : 0);
            convert_through(o->send0, o->acc, src_blk(o, o->rank - 1), sd, o->acc, pre, 1.0, block_n);
        } else {
            o->send0 = (unsigned char *)(uintptr_t)src_blk(o, o->rank - 1);
        }
        return TS_OK;
    }
    int nstage = o->W - 1 < 2 ? o->W - 1 : 2;
    o->sscratch = scratch((size_t)(nstage + convert) * o->block, &o->sscratch_bytes);
    if (!o->sscratch) return TS_ERR_NO_MEMORY;
    o->stage[0] = o->sscratch;
    o->stage[1] = o->sscratch + (nstage > 1 ? o->block : 0);
    if (convert) {
        o->send0 = o->sscratch + (size_t)nstage * o->block;
        convert_through(o->send0, o->acc, src_blk(o, o->rank - 1), sd, o->acc, pre, 1.0, block_n);
    } else {
        o->send0 = (unsigned char *)(uintptr_t)src_blk(o, o->rank - 1);
    }
    return TS_OK;
}

/* The staging scratch setup_rs takes for a reduce-scatter over a source
 * of W blocks of block_n elements of sd (accumulated in acc): what
 * fully_shard's meta step records (ts__comm_reduce_scatter_scratch). */
static size_t rs_scratch_bytes(ts_comm *c, ts_dtype sd, ts_dtype acc, double pre, size_t block_n)
{
    if (!c || c->size < 2) return 0;
    op *o = op_new(c, TS_COLL_REDUCE_SCATTER);
    if (!o) return 0;
    o->acc = acc;
    o->block = block_n * ts_dtype_size(acc);
    bool convert = sd != acc || pre != 1.0;
    size_t b;
    if (fp_inline(o)) {
        b = (size_t)((o->W > 2) + convert) * o->block;
    } else {
        int nstage = o->W - 1 < 2 ? o->W - 1 : 2;
        b = (size_t)(nstage + convert) * o->block;
    }
    op_discard(o);
    return b;
}

size_t ts__comm_reduce_scatter_scratch(ts_comm *c, ts_dtype d, int64_t n, double pre_div)
{
    return rs_scratch_bytes(c, d, ts__acc_dtype(d), pre_div, (size_t)n);
}

int ts__comm_all_reduce_scratch(ts_comm *c, ts_dtype d, int64_t n, size_t bytes[2])
{
    if (!c || n < 0) return 0;
    int k = 0;
    ts_dtype acc = ts__acc_dtype(d);
    size_t W = (size_t)c->size, bn = ((size_t)n + W - 1) / W, es = ts_dtype_size(acc);
    if (!(acc == d && (size_t)n % W == 0)) {
        size_t b = W * bn * es;
        bytes[k++] = b ? b : 1;
    }
    size_t s = rs_scratch_bytes(c, acc, acc, 1.0, bn);
    if (s) bytes[k++] = s;
    return k;
}

ts_status ts_reduce_scatter_tensor(ts_comm *c, ts_tensor *out, ts_tensor *in, ts_reduce_op rop, double pre_div,
                                   double post_div, ts_request **r)
{
    static const char fn[] = "ts_reduce_scatter_tensor";
    ts_status s;
    if ((s = check_comm(fn, c)) || (s = check_tensor(fn, "out", out)) || (s = check_tensor(fn, "in", in))) return s;
    ts_dtype d = ts_tensor_dtype(in);
    if (ts_tensor_dtype(out) != d)
        return ts_error(TS_ERR_DTYPE, "%s: out is %s, in is %s", fn, ts_dtype_name(ts_tensor_dtype(out)), ts_dtype_name(d));
    if ((s = check_reduce(fn, d, rop, pre_div, post_div))) return s;
    int64_t n = ts_tensor_numel(out);
    if (ts_tensor_numel(in) != n * c->size)
        return ts_error(TS_ERR_SHAPE, "%s: in has %lld elements, expected %d x %lld", fn,
                        (long long)ts_tensor_numel(in), c->size, (long long)n);
    size_t es = ts_dtype_size(d), nb = (size_t)n * es;
    const unsigned char *ip = ts_tensor_data(in), *op_ = ts_tensor_data(out);
    if (n > 0 && op_ < ip + (size_t)c->size * nb && ip < op_ + nb && op_ != ip + (size_t)c->rank * nb)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "%s: out overlaps in other than as in's block %d (the rank's own; in place)", fn, c->rank);
    op *o = op_new(c, TS_COLL_REDUCE_SCATTER);
    if (!o) return TS_ERR_NO_MEMORY;
    set_fp(o, d, n, (unsigned)rop, FP_NONE);
    o->acc = ts__acc_dtype(d);
    o->rop = rop;
    if (setup_rs(o, ip, d, pre_div, (size_t)n) != TS_OK) {
        op_discard(o);
        return TS_ERR_NO_MEMORY;
    }
    o->final_out = ts_tensor_data(out);
    o->final_dtype = d;
    o->post = post_div * (rop == TS_REDUCE_AVG ? c->size : 1);
    return submit(c, o, (size_t)ts_tensor_numel(in) * es, r);
}

/* Reduce-scatter then all-gather. When the tensor is in its accumulation
 * dtype and divides into W blocks, both run on the tensor itself (no
 * copy); otherwise on an accumulation copy padded to W blocks. */
ts_status ts_all_reduce(ts_comm *c, ts_tensor *t, ts_reduce_op rop, ts_request **r)
{
    static const char fn[] = "ts_all_reduce";
    ts_status s;
    if ((s = check_comm(fn, c)) || (s = check_tensor(fn, "t", t))) return s;
    ts_dtype d = ts_tensor_dtype(t);
    if ((s = check_reduce(fn, d, rop, 1.0, 1.0))) return s;
    size_t n = (size_t)ts_tensor_numel(t);
    op *o = op_new(c, TS_COLL_ALL_REDUCE);
    if (!o) return TS_ERR_NO_MEMORY;
    set_fp(o, d, (int64_t)n, (unsigned)rop, FP_NONE);
    o->acc = ts__acc_dtype(d);
    o->rop = rop;
    o->ag = true;
    size_t W = (size_t)c->size, bn = (n + W - 1) / W, es = ts_dtype_size(o->acc);
    if (o->acc == d && n % W == 0) {
        o->buf = ts_tensor_data(t);
    } else {
        if (!own_scratch(o, W * bn * es)) {
            op_discard(o);
            return TS_ERR_NO_MEMORY;
        }
        load_acc(o->buf, o->acc, ts_tensor_data(t), d, n, 1.0);
        memset(o->buf + n * es, 0, (W * bn - n) * es);
        o->out = ts_tensor_data(t);
        o->out_dtype = d;
        o->out_n = n;
    }
    if (setup_rs(o, o->buf, o->acc, 1.0, bn) != TS_OK) {
        op_discard(o);
        return TS_ERR_NO_MEMORY;
    }
    o->final_out = blk(o, c->rank);
    o->final_dtype = o->acc;
    o->post = rop == TS_REDUCE_AVG ? (double)c->size : 1.0;
    return submit(c, o, n * ts_dtype_size(d), r);
}

ts_status ts_broadcast(ts_comm *c, ts_tensor *t, int root, ts_request **r)
{
    static const char fn[] = "ts_broadcast";
    ts_status s;
    if ((s = check_comm(fn, c)) || (s = check_tensor(fn, "t", t))) return s;
    if (root < 0 || root >= c->size) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: root %d outside [0, %d)", fn, root, c->size);
    op *o = op_new(c, TS_COLL_BROADCAST);
    if (!o) return TS_ERR_NO_MEMORY;
    set_fp(o, ts_tensor_dtype(t), ts_tensor_numel(t), FP_NONE, (unsigned)root);
    o->root = root;
    o->buf = ts_tensor_data(t);
    o->block = (size_t)ts_tensor_numel(t) * ts_dtype_size(ts_tensor_dtype(t));
    return submit(c, o, o->block, r);
}

ts_status ts_barrier(ts_comm *c, ts_request **r)
{
    static const char fn[] = "ts_barrier";
    ts_status s;
    if ((s = check_comm(fn, c))) return s;
    op *o = op_new(c, TS_COLL_BARRIER);
    if (!o) return TS_ERR_NO_MEMORY;
    o->block = 1;
    o->buf = ts__calloc(TS_MEM_COMM, (size_t)c->size, 1);
    o->owned = true;
    o->ag = true;
    if (!o->buf) {
        op_discard(o);
        return TS_ERR_NO_MEMORY;
    }
    set_inline_ag(o);
    return submit(c, o, 0, r);
}

/* ------------------------------------------------------------------ */
/* Subgroups                                                           */
/* ------------------------------------------------------------------ */

ts_status ts_comm_new_group(ts_comm *parent, int n, const int *ranks, ts_comm **out)
{
    static const char fn[] = "ts_comm_new_group";
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL out", fn);
    *out = NULL;
    ts_status s;
    if ((s = check_comm(fn, parent))) return s;
    if (n < 1 || !ranks) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: empty rank list (n = %d)", fn, n);
    int P = parent->size;
    for (int i = 0; i < n; i++)
        if (ranks[i] < 0 || ranks[i] >= P)
            return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: rank %d (entry %d) outside [0, %d)", fn, ranks[i], i, P);
    for (int i = 0; i < n; i++)
        for (int j = 0; j < i; j++)
            if (ranks[i] == ranks[j])
                return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: rank %d appears twice (entries %d and %d)", fn,
                                ranks[i], j, i);
    /* agree on the id: the largest next free id among parent's members */
    world *w = parent->w;
    ts_tensor *t = NULL;
    int64_t one = 1;
    if ((s = ts_tensor_new_cpu(false, TS_I64, 1, &one, &t))) return s;
    *(int64_t *)ts_tensor_data(t) = (int64_t)(w ? atomic_load(&w->next_gid) : 1);
    s = ts_all_reduce(parent, t, TS_REDUCE_MAX, NULL);
    uint64_t gid = (uint64_t)*(int64_t *)ts_tensor_data(t);
    ts_tensor_free(t);
    if (s) return s;
    if (gid >= GID_LIMIT - 1) /* 0xffff carries the failure notices */
        return ts_error(TS_ERR_UNSUPPORTED, "%s: group id %llu; the tag layout allows %llu groups", fn,
                        (unsigned long long)gid, (unsigned long long)(GID_LIMIT - 2));
    if (w) {
        uint64_t cur = atomic_load(&w->next_gid);
        while (cur <= gid && !atomic_compare_exchange_weak(&w->next_gid, &cur, gid + 1)) {
        }
    }
    int me = -1;
    for (int i = 0; i < n; i++)
        if (ranks[i] == parent->rank) me = i;
    if (me < 0) return TS_OK;
    ts_comm *c = ts__calloc(TS_MEM_COMM, 1, sizeof *c);
    int *map = ts__malloc(TS_MEM_COMM, (size_t)n * sizeof *map);
    if (!c || !map) {
        ts__free(TS_MEM_COMM, c);
        ts__free(TS_MEM_COMM, map);
        return TS_ERR_NO_MEMORY;
    }
    for (int i = 0; i < n; i++) map[i] = parent->map ? parent->map[ranks[i]] : ranks[i];
    c->w = w;
    c->rank = me;
    c->size = n;
    c->gid = gid;
    c->is_group = true;
    c->map = map;
    pthread_mutex_init(&c->stats_mu, NULL);
    *out = c;
    return TS_OK;
}

void ts_comm_free(ts_comm *c)
{
    if (!c || !c->is_group) return;
    log_summary(c);
    pthread_mutex_destroy(&c->stats_mu);
    ts__free(TS_MEM_COMM, c->map);
    ts__free(TS_MEM_COMM, c);
}

/* ------------------------------------------------------------------ */
/* List all-gather, all-to-all, point-to-point                         */
/* ------------------------------------------------------------------ */

ts_status ts_all_gather(ts_comm *c, int nout, ts_tensor **outs, ts_tensor *in, ts_request **r)
{
    static const char fn[] = "ts_all_gather";
    ts_status s;
    if ((s = check_comm(fn, c)) || (s = check_tensor(fn, "in", in))) return s;
    if (!outs) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL outs", fn);
    if (nout != c->size) return ts_error(TS_ERR_SHAPE, "%s: %d outputs for a group of %d", fn, nout, c->size);
    ts_dtype d = ts_tensor_dtype(in);
    int64_t n = ts_tensor_numel(in);
    for (int i = 0; i < nout; i++) {
        char what[32];
        snprintf(what, sizeof what, "outs[%d]", i);
        if ((s = check_tensor(fn, what, outs[i]))) return s;
        if (ts_tensor_dtype(outs[i]) != d)
            return ts_error(TS_ERR_DTYPE, "%s: outs[%d] is %s, in is %s", fn, i, ts_dtype_name(ts_tensor_dtype(outs[i])),
                            ts_dtype_name(d));
        if (ts_tensor_numel(outs[i]) != n)
            return ts_error(TS_ERR_SHAPE, "%s: outs[%d] has %lld elements, in %lld", fn, i,
                            (long long)ts_tensor_numel(outs[i]), (long long)n);
    }
    op *o = op_new(c, TS_COLL_ALL_GATHER);
    if (!o) return TS_ERR_NO_MEMORY;
    set_fp(o, d, n, FP_NONE, FP_NONE);
    o->block = (size_t)n * ts_dtype_size(d);
    bool got = own_scratch(o, (size_t)c->size * o->block);
    o->outs = ts__malloc(TS_MEM_COMM, (size_t)c->size * sizeof *o->outs);
    if (!got || !o->outs) {
        op_discard(o);
        return TS_ERR_NO_MEMORY;
    }
    for (int i = 0; i < nout; i++) o->outs[i] = ts_tensor_data(outs[i]);
    o->ag = true;
    if (o->block) memcpy(blk(o, c->rank), ts_tensor_data(in), o->block);
    set_inline_ag(o);
    return submit(c, o, o->block, r);
}

ts_status ts_all_to_all(ts_comm *c, ts_tensor *out, ts_tensor *in, ts_request **r)
{
    static const char fn[] = "ts_all_to_all";
    ts_status s;
    if ((s = check_comm(fn, c)) || (s = check_tensor(fn, "out", out)) || (s = check_tensor(fn, "in", in))) return s;
    ts_dtype d = ts_tensor_dtype(in);
    if (ts_tensor_dtype(out) != d)
        return ts_error(TS_ERR_DTYPE, "%s: out is %s, in is %s", fn, ts_dtype_name(ts_tensor_dtype(out)), ts_dtype_name(d));
    int64_t total = ts_tensor_numel(in);
    if (total % c->size != 0)
        return ts_error(TS_ERR_SHAPE, "%s: in has %lld elements, not a multiple of the group size %d", fn,
                        (long long)total, c->size);
    if (ts_tensor_numel(out) != total)
        return ts_error(TS_ERR_SHAPE, "%s: out has %lld elements, in %lld", fn, (long long)ts_tensor_numel(out),
                        (long long)total);
    op *o = op_new(c, TS_COLL_ALL_TO_ALL);
    if (!o) return TS_ERR_NO_MEMORY;
    set_fp(o, d, total, FP_NONE, FP_NONE);
    size_t bytes = (size_t)total * ts_dtype_size(d);
    o->block = bytes / (size_t)c->size;
    if (!own_scratch(o, bytes)) {
        op_discard(o);
        return TS_ERR_NO_MEMORY;
    }
    o->a2a_out = ts_tensor_data(out);
    if (bytes) {
        memcpy(o->buf, ts_tensor_data(in), bytes);
        size_t at = (size_t)c->rank * o->block;
        memcpy(o->a2a_out + at, o->buf + at, o->block);
    }
    return submit(c, o, bytes, r);
}

static unsigned char g_empty[1];

static ts_status p2p(const char *fn, ts_coll_kind kind, ts_comm *c, ts_tensor *t, int peer, int tag, ts_request **r)
{
    ts_status s;
    if ((s = check_comm(fn, c)) || (s = check_tensor(fn, "t", t))) return s;
    const char *who = kind == TS_COLL_SEND ? "dst" : "src";
    if (peer < 0 || peer >= c->size)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %s %d outside [0, %d)", fn, who, peer, c->size);
    if (peer == c->rank) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %s %d is the caller", fn, who, peer);
    if (tag < 0 || tag > TS_P2P_TAG_MAX)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: tag %d outside [0, %d]", fn, tag, TS_P2P_TAG_MAX);
    size_t bytes = (size_t)ts_tensor_numel(t) * ts_dtype_size(ts_tensor_dtype(t));
    op *o = op_new(c, kind);
    if (!o) return TS_ERR_NO_MEMORY;
    o->peer = peer;
    o->block = bytes;
    o->tagbase = (uint64_t)(unsigned)tag << 8;
    if (bytes == 0) {
        o->buf = g_empty;
    } else if (kind == TS_COLL_SEND) {
        if (!own_scratch(o, bytes)) {
            op_discard(o);
            return TS_ERR_NO_MEMORY;
        }
        memcpy(o->buf, ts_tensor_data(t), bytes);
    } else {
        o->buf = ts_tensor_data(t);
    }
    return submit(c, o, bytes, r);
}

ts_status ts_send(ts_comm *c, ts_tensor *t, int dst, int tag, ts_request **r)
{
    return p2p("ts_send", TS_COLL_SEND, c, t, dst, tag, r);
}

ts_status ts_recv(ts_comm *c, ts_tensor *t, int src, int tag, ts_request **r)
{
    return p2p("ts_recv", TS_COLL_RECV, c, t, src, tag, r);
}
