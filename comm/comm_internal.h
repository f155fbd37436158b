/* Internal: worlds over a given transport (comm.h). Not installed. */
#ifndef TS_COMM_INTERNAL_H
#define TS_COMM_INTERNAL_H

#include "base/internal.h"
#include "comm/comm.h"
#include "comm/transport.h"

/*
 * Tags: a message's tag is (group id << 32) | (sequence << 8) | step (48
 * bits: the transports take 48-bit tags), the sequence being the
 * collective's number in its group (24 bits, wrapping) and the step its
 * ring step (all-reduce uses steps 0..2W-3, all-to-all step 0), so
 * back-to-back collectives never cross-match. Hence W <= 128 and at most
 * 65534 groups per world (ids are not reused). Step 255 is reserved for
 * point-to-point messages, whose 24-bit middle field is the user tag
 * instead of a sequence; step 254 carries a collective's fingerprint;
 * group id 0xffff, which no group gets, the failure notices (comm.c).
 * transport_ucx.c adds its own bits above these 48 (its tag layout
 * comment).
 */

/* Creates a world (group id 0) over `t`, taking ownership of it, and
 * starts its communication thread; from now on `t` is driven only under
 * the world's progress lock (by that thread, or by a caller waiting on a
 * request: comm.c).
 * timeout_s is the per-collective deadline (<= 0: 300 s). A world of size
 * 1 runs its collectives on the caller's thread. */
ts_status ts__world_new(ts_transport *t, double timeout_s, ts_comm **world_out);
/* Fails what is still pending (TS_ERR_COMM), joins the thread, destroys
 * the transport. Bounded in time. Accepts NULL. */
void ts__world_free(ts_comm *world);
/* A world of `size` ranks (at most 128) of which this process is rank 0
 * and no other exists (comm/transport_virtual.c; PyTorch's
 * FakeProcessGroup): a 1-d mesh over it and fully_shard's meta step work,
 * every message a collective would send fails at once with
 * TS_ERR_UNSUPPORTED. For ts_fsdp_memory_estimate's hypothetical
 * sharding. Free with ts__world_free. */
ts_status ts__virtual_world_new(int size, ts_comm **world_out);

/* Fails `world` from outside its collectives (ts_dist_init's watch of
 * the store: a duplicate RANK found after the rendezvous): every pending
 * and later collective of the world and its groups completes with `st`
 * (< 0) and `msg`, as after a peer's failure notice. Any thread; no
 * effect on NULL, the one-rank group or a world that has failed already. */
void ts__world_fail(ts_comm *world, ts_status st, const char *msg);

/* Gives `world` a store client of its own (ownership passes, even on
 * error; closed by ts__world_free) for naming the ranks that never
 * entered a collective whose deadline passed (comm.c, "Who never
 * entered"): keys go under `prefix`; `hung_key` (NULL or "": none) is
 * where the first rank that finds such a rank records "<world rank>
 * <collective>" for the launcher (TS_LAUNCH_HUNG_KEY). Any thread.
 * TS_ERR_INVALID_ARGUMENT for a NULL or one-rank world, client or prefix. */
ts_status ts__world_attach_store(ts_comm *world, struct ts_store *client, const char *prefix, const char *hung_key);

/* Called, under the world's progress lock and before any request
 * completes with the error, when this rank fails its world by its own
 * finding: a dead peer (culprit: its world rank), a fingerprint mismatch
 * (culprit -1) or a collective's deadline (TS_ERR_TIMEOUT, culprit -1);
 * not when it learns of another rank's failure. `msg` is the failure's
 * message. It must not take the progress lock; it may block briefly (the
 * failing request waits for it). */
typedef void (*ts__world_fail_hook)(void *arg, ts_status st, int culprit, const char *msg);
/* Installs (or with NULL removes) the hook of `world`. Any thread; ignores
 * NULL and the one-rank group. */
void ts__world_set_fail_hook(ts_comm *world, ts__world_fail_hook hook, void *arg);

/* The keys of the failure notices (dist.c, "Failure notices"), printf
 * formats of the world's store prefix (and a rank): the notice, set by
 * compare-and-set from empty to "<posting rank> <status> <culprit>
 * <message>" (posting rank -1: the launcher, for a rank its memory cgroup
 * OOM-killed), and each rank's wake key. */
#define TS__DIST_FAILED_KEY "%s/failed"
#define TS__DIST_WAKE_KEY "%s/rdv/wake/%d"

/* The world ts_comm_world() returns, owned by comm.c: ts_dist_init
 * (comm/dist.c) publishes the world it made and NULL when it is finalized;
 * ts_comm_world() returns the published world, the one-rank group while
 * none is. ts__world_published returns it (NULL when none). Lock-free, any
 * thread. */
void ts__world_publish(ts_comm *w);
ts_comm *ts__world_published(void);

/* The world size the launcher's variables claim (ts_launch_env's reading),
 * even when they are incomplete (mpirun's without MASTER_PORT): 0 when
 * none says one, or when it could not be read. Leaves ts_last_error() as it
 * was. (comm/launch_env.c) */
int ts__launch_env_world_size(void);

/* This kernel's boot id and the links of this process's pid and network
 * namespaces ("pid:[4026531836]"), each "?" where it cannot be read: what
 * tells hosts apart (comm/launch_env.c). */
void ts__host_parts(char *boot, size_t nb, char *pidns, size_t np, char *netns, size_t nn);

/* Test hook: how often (seconds; <= 0 restores 10) a waiting rendezvous
 * of ts_dist_init says which ranks it still waits for. */
void ts__dist_set_progress_interval(double seconds);

/* Sets the per-collective deadline of c's world for collectives started
 * from now on (> 0; tests shorten it). Any thread. Ignores NULL and the
 * one-rank group. */
void ts__comm_set_timeout(ts_comm *c, double timeout_s);
/* Turns the collectives' fingerprints (comm.c, "Fingerprints") on or off
 * for collectives submitted from now on; default on, TS_COMM_CHECK=0 off.
 * Every rank must switch at the same point of its sequence of
 * collectives (the benchmark measures both). Any thread. */
void ts__comm_set_check(ts_comm *c, bool on);
/* Sets the largest step-0 block (bytes, capped at 16 KiB) that a ring of
 * c's world sends inside its fingerprint's message rather than in a
 * message of its own (comm.c, "Fingerprints": inline blocks), for
 * collectives submitted from now on; default TS_COMM_FP_INLINE, else
 * 16 KiB; 0 never.
 * Ranks that differ fail the collectives of a size between their values
 * with TS_ERR_COMM saying so, as ranks whose TS_COMM_FP_INLINE differ do.
 * Any thread. Ignores NULL and the one-rank group. */
void ts__comm_set_fp_inline(ts_comm *c, size_t bytes);

/* The sends and receives c's world's transport posted with a buffer of
 * their own, and how many passed a registration of pinned memory
 * (transport.h, xfer_stats); zeros when the transport counts none (the
 * loopback) or for the one-rank group. Any thread. */
void ts__comm_xfer_stats(ts_comm *c, uint64_t *posted_out, uint64_t *registered_out);

/* How many collectives of c's world (its groups' included) a caller
 * driving progress in ts_request_wait finished, and how many its
 * communication thread finished (comm.c, "Driving"): blocking collectives
 * should be the callers', asynchronous ones left behind the thread's.
 * Zeros for the one-rank group. Any thread. */
void ts__comm_progress_stats(ts_comm *c, uint64_t *by_callers_out, uint64_t *by_thread_out);
/* The process id of group rank `peer` of c when this process may read
 * its memory with process_vm_readv (the transport's peer_pid: same host,
 * cross-memory attach permitted both ways and not turned off), 0
 * otherwise (another host, the loopback transport, the one-rank group,
 * the caller itself). Any thread. (comm/coll_direct.c) */
int ts__comm_peer_pid(ts_comm *c, int peer);
/* Adds calls and bytes (either may be negative) to c's counters of
 * `kind` (comm.h, ts_comm_stats): the direct collectives count as one
 * collective of their kind, not as the small ones they are made of. Any
 * thread. */
void ts__comm_count(ts_comm *c, ts_coll_kind kind, int64_t calls, int64_t bytes);
/* c's group id, and the sequence number its next collective will take
 * (for the direct collectives' trace spans, which carry them as the ring
 * collectives' do). Any thread. */
uint64_t ts__comm_gid(const ts_comm *c);
uint32_t ts__comm_next_seq(ts_comm *c);
/* The world rank of group rank `r` of c (r itself for a world). */
int ts__comm_world_rank(const ts_comm *c, int r);

/* TS_DISTRIBUTED_DEBUG (comm.h) as read once for the process: 0 OFF, 1
 * INFO, 2 DETAIL (an unknown value warned about, then 0). fully_shard's
 * per-group summary (ts_fsdp_print_stats) reads it too. Any thread. */
int ts__dist_debug_level(void);

/* The pool scratch (bytes) a reduce-scatter of n output elements of d on c
 * with divide factor pre_div holds while in flight (0: none, as on one
 * rank), and the blocks an all-reduce of n elements of d takes (written
 * to bytes, their count returned): fully_shard's meta step records them on
 * the meta ledger (param_group.c, [Note: meta step]) without issuing the
 * collective. Caller's thread; c not NULL. */
size_t ts__comm_reduce_scatter_scratch(ts_comm *c, ts_dtype d, int64_t n, double pre_div);
int ts__comm_all_reduce_scratch(ts_comm *c, ts_dtype d, int64_t n, size_t bytes[2]);

#endif
