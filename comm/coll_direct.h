/*
 * Internal: copy-free collectives over segment lists (docs/design.md D6,
 * docs/comm-design.md "Direct collectives"). Not installed.
 *
 * fully_shard's all-gather fills each parameter's unsharded tensor from
 * every rank's shard, and its reduce-scatter sums each rank's rows of
 * every unsharded gradient into that rank's shard gradient. The ring
 * collectives of comm.h need the data packed into one W-block buffer
 * first (and copied out after); these take the parameters where they are:
 *
 *  - a segment is one unsharded array (a parameter, or its gradient) made
 *    of W consecutive parts, part j (counts[j] elements) being rank j's
 *    rows; this rank's part also sits in its shard buffer at element
 *    shard_off (the shard layout, like the counts, is the same on every
 *    rank);
 *  - all-gather: every rank's part of every segment lands in `full`
 *    (this rank's part copied from its own shard);
 *  - reduce-scatter: the reduction over ranks of this rank's part of
 *    every segment's `full` (each rank's source may have its own dtype,
 *    or be NULL for zeros) is written into the shard buffer (the output
 *    dtype), with the ring's summation order and dtype rules, so that the
 *    result is bitwise ts_reduce_scatter_tensor's over the packed buffer
 *    (the packed buffer being the sources converted to the output dtype,
 *    zeros where a source is NULL).
 *
 * Between processes of one host that may read each other's memory (the
 * transport's peer_pid: cross-memory attach, TS_UCX_CMA not 0) the
 * ranks exchange their buffers' addresses in one small all-gather and
 * each reads what it needs with process_vm_readv, straight into its
 * tensors (the reduce-scatter in pieces of a few KiB that it adds into
 * its output as they arrive); each then tells every peer, point to point
 * (user tags of the group: the exchange's sequence number), that it
 * finished reading (or failed), and a wait returns once every peer has:
 * the buffers may change then. Where any pair of the group cannot (another host,
 * CMA refused or off, the loopback transport), every rank of the group
 * falls back to the packed ring collective over the same data: bitwise
 * the same result, decided from the exchanged addresses, so all ranks
 * agree.
 *
 * Lifetime: everything the call names (the shard, every `full`, the
 * counts are copied) must stay alive and unchanged (outputs untouched)
 * until ts__direct_wait returns: peers read this rank's buffers until
 * then. Calls on one group follow its collective order (the call and its
 * wait each issue a collective of the group: call and wait them in the
 * same order on every rank). Fingerprints: the exchange carries the kind,
 * dtype, op, divisors, segment count and a hash of the layout; ranks that
 * disagree all fail with TS_ERR_COMM naming both sides, as the ring
 * collectives do. Deadlines and peer failures are the group's.
 *
 * Threads: the call and the wait run on the caller's thread and issue
 * the group's collectives (the exchange, the acknowledgement, the packed
 * fallback) in call order. The reads run on a worker thread per channel
 * and process ("comm-direct", started at the first call), in call order,
 * from the exchange's completion on, while the caller computes; the wait
 * blocks until they are done. Channel 0 serves every all-gather and, by
 * default, the reduce-scatters (a reduce-scatter called before an
 * all-gather is moved first, as on one NCCL communicator); channel 1
 * ("comm-direct-rs") serves reduce-scatters given their own, so that
 * they and the all-gathers move at the same time (FSDP2's separate
 * reduce-scatter group: give them a group of their own as well). Without
 * a worker (pthread_create failed) the wait moves the data.
 */
#ifndef TS_COMM_COLL_DIRECT_H
#define TS_COMM_COLL_DIRECT_H

#include "comm/comm.h"

typedef struct ts__direct ts__direct;

/* One segment (see the top). counts: W entries, this rank's part
 * counts[rank] elements. */
typedef struct ts__dseg {
    void *full;            /* all-gather: the output; reduce-scatter: the source (NULL: zeros) */
    ts_dtype dtype;        /* reduce-scatter: full's dtype (any float dtype, or the output's); all-gather: ignored */
    int64_t shard_off;     /* this rank's part in the shard buffer (elements of the collective's dtype) */
    const int64_t *counts; /* W elements per rank */
} ts__dseg;

/* Starts the all-gather of `shard` (shard_numel elements of dtype d; read
 * by the peers until the wait) into the segments' full arrays (dtype d).
 * Counted (ts_comm_stats) as one all-gather of shard_numel elements.
 * Errors before anything is exchanged: TS_ERR_INVALID_ARGUMENT (NULL,
 * negative counts, nseg < 0, a part outside the shard), TS_ERR_NO_MEMORY.
 * *out is owned by the caller (ts__direct_free). Caller's thread. */
ts_status ts__direct_all_gather(ts_comm *c, ts_dtype d, const void *shard, int64_t shard_numel, int nseg,
                                const ts__dseg *segs, ts__direct **out);
/* Starts the reduce-scatter of the segments' sources into `shard` on
 * channel 0 or 1 (see the top)
 * (shard_numel elements of dtype d: f32, f64, bf16, f16; accumulated in
 * ts__acc_dtype(d); elements no part covers are left alone), with every
 * input divided by pre before and the result by post after (AVG also by
 * W), as ts_reduce_scatter_tensor. Counted as one reduce-scatter of W x
 * shard_numel elements of d. Errors as above, plus TS_ERR_DTYPE, the
 * reduce op / divisor checks of comm.h and a channel other than 0 or 1. */
ts_status ts__direct_reduce_scatter(ts_comm *c, ts_dtype d, void *shard, int64_t shard_numel, int nseg,
                                    const ts__dseg *segs, ts_reduce_op rop, double pre, double post, int channel,
                                    ts__direct **out);
/* The same collective, accumulating: each piece of this rank's part,
 * once its reduction over every rank is complete (divided by post and
 * rounded to d), is added into the shard's elements there, shard[i] =
 * shard[i] + result[i] with tensor/kernels.h's ts__buf_add in d: the
 * bits of ts__direct_reduce_scatter into a separate buffer followed by a
 * ts__buf_add of it, without that buffer or that second pass (the packed
 * fallback adds its result the same way). The parts of the shard must
 * hold values of d. Purely local: ranks may mix the two forms in one
 * collective. Same arguments and errors as ts__direct_reduce_scatter;
 * a failure after the reads started (a peer's read failing, a dead
 * peer) may leave some pieces added. */
ts_status ts__direct_reduce_scatter_add(ts_comm *c, ts_dtype d, void *shard, int64_t shard_numel, int nseg,
                                        const ts__dseg *segs, ts_reduce_op rop, double pre, double post, int channel,
                                        ts__direct **out);
/* Runs the collective to its end (the reads, or the packed fallback) and
 * returns its status (the same on later calls): TS_ERR_COMM for
 * disagreeing ranks or a failed read (on every rank, naming the rank),
 * the group's TS_ERR_PEER_FAILED / TS_ERR_TIMEOUT, TS_ERR_NO_MEMORY. */
ts_status ts__direct_wait(ts__direct *r);
/* Whether the collective's data has moved (the reads finished, or the
 * exchange found the packed fallback or an error), without blocking; its
 * wait still acknowledges (and runs the fallback). */
bool ts__direct_done(const ts__direct *r);
/* Whether the collective took the copy-free path (false before the wait
 * and for the packed fallback). */
bool ts__direct_was_direct(const ts__direct *r);
/* After a successful ts__direct_wait of a reduce-scatter: whether some
 * rank of the group gave segment k a source (a non-NULL `full`), read
 * from the exchanged descriptors, so that every rank gets the same
 * answer without another message; false for k out of range, an
 * all-gather, or before a successful wait. fully_shard tells a
 * parameter that no rank has a gradient for (it keeps none) from one
 * that only some ranks have (every rank gets the reduction). */
bool ts__direct_sourced(const ts__direct *r, int k);
/* Waits if needed, then frees. Accepts NULL. */
void ts__direct_free(ts__direct *r);
/* The elements (int64) of the descriptor a copy-free collective exchanges
 * (its desc_in; desc_out holds W of them): both are taken from the pool
 * when it is issued and given back when it is freed. fully_shard's meta
 * step (param_group.c, [Note: meta step]) takes them as meta storages. */
int64_t ts__direct_desc_numel(bool reduce_scatter, int nseg);

/* Test hook: when false, this process announces that it cannot read its
 * peers, so that every group it is in takes the packed fallback
 * (default true; the environment variable TS_COMM_DIRECT=0 sets false at
 * the first call). Every rank of a group must be switched at the same
 * point of its sequence of collectives only if results are compared;
 * the ranks agree either way. Any thread. */
void ts__direct_set_enabled(bool on);

/* The packed fallback moves the data in chunks: each chunk is one ring
 * collective over a buffer of W chunks of `bytes / (W x the element
 * size)` elements (at least one), two chunks in flight, each slot's
 * buffers the same for every chunk of a call, taken from the pool and
 * given back at its end. Default (0):
 * 16 MiB, or 256 KiB per rank where that is more. A test hook for chunk
 * boundaries inside segments; every rank of a group must use the same
 * value. Any thread. */
void ts__direct_set_fallback_bytes(size_t bytes);
/* What the packed fallback adds to the pool's holding on group c at
 * most (per slot in flight, its two buffers and the ring
 * reduce-scatter's staging, as pool blocks, for the largest case: 16-bit data reduced in float32 with a
 * divisor), when some pair of c cannot read each other (another host,
 * cross-memory attach refused or off, ts__direct_set_enabled(false));
 * 0 when every collective of c takes the copy-free path or c has one
 * rank. The process floor counts it for the world (docs/memory.md). */
size_t ts__direct_fallback_bytes(ts_comm *c);

#endif
