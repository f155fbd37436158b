/*
 * fully_shard's internals: the objects the files of fully_shard/ share
 * and the ts__fsdp_* functions they call in one another (docs/design.md D5, D6;
 * docs/fully_shard.md). The files mirror PyTorch's _composable/fsdp/ and
 * stand on floors, each calling only below it ("Floors" below):
 *  - common.c (_fsdp_common.py): events, the registries, helpers;
 *  - param.c (_fsdp_param.py): one parameter's geometry and its copies;
 *  - param_group.c (_fsdp_param_group.py): one group's lifecycle: unshard,
 *    wait, reshard, post-backward, reduce;
 *  - state.c (_fsdp_state.py): the vtable rewrite, lazy init and root, the
 *    forward wrapper, the autograd markers, prefetch, a subtree's groups;
 *  - fully_shard.c (_fully_shard.py): the API, argument checks, collecting
 *    a call's parameters;
 *  - explicit.c: unshard/reshard handles, summon, forward methods, the
 *    prefetch setters; state_dict.c: full state dicts, gradient clipping;
 *    summary.c: ts_fsdp_summary; repr.c: ts_module_print's line.
 *
 * Objects
 *  - fsdp_param: one parameter of a group: its slots (every slot of the
 *    managed modules that held the tensor: tied weights inside a group),
 *    the sharded leaf S (a view of the group's sharded buffer, marked as a
 *    shard, with a DTensor), the unsharded leaf U (its own storage,
 *    released while sharded, so autograd's saved references to it stay
 *    valid), and its geometry: rows, row_numel, chunk rows c = ceil(rows/W),
 *    local rows, its offset in the per-rank (padded) shard, and for each
 *    shard rank the rows it holds and where they sit in the all-gather and
 *    reduce-scatter buffers (fsdp_chunk, computed once at group creation).
 *  - fsdp_group: the parameters sharded by one call (one all-gather, one
 *    reduce-scatter), the shard group (and the replicate group for HSDP),
 *    the sharded buffer (shard_numel elements: each parameter padded to c
 *    rows), the all-gather in flight and the reduce-scatter in flight.
 *  - fsdp_state: one per FSDP module (module->ext); points to its group
 *    (several states share one group for ts_fully_shard_group) and to the
 *    root's fsdp_ctx, made at the root's first forward.
 *  - fsdp_ctx: per root: the states under it (pre-order), the post-forward
 *    order of this iteration and the forward order of the last one (for
 *    prefetch), the reduce-scatter in flight, backward bookkeeping.
 *
 * Buffers: the all-gather output is W blocks of shard_numel; block r holds
 * rank r's padded shard of every parameter in group order, so parameter
 * p's rows [r*c, r*c + c) sit at r*shard_numel + off_p; copy-out moves the
 * real rows into U (docs/design.md D6). The reduce-scatter input is packed the
 * same way from the U gradients (copy-in, zero padding; each block then
 * followed by one flag per parameter, nonzero where this rank has a
 * gradient: param_group.c's [Note: unused parameters]), reduced with AVG
 * over the shard group (or as ts__fsdp_reduce_plan says under a divide
 * factor or force-sum), and each parameter's segment of the output
 * becomes S's gradient as a view of it (or is added into the gradient S
 * has; on the copy-free path, when those gradients are such views, the
 * reduce-scatter adds into them itself). Without gradient sync (accum.c)
 * the U gradients stay (or move to acc in rdtype) until a backward with
 * sync.
 *
 * Lifetimes: states and groups are reference counted: the module holds its
 * state, the autograd markers of a forward hold the state they serve, and
 * states hold their group. A module freed while a graph that went through
 * it is alive makes that graph's FSDP markers fail with TS_ERR_STATE.
 * Slots own a reference to what they hold (S or U); the param holds its
 * own references to both.
 */
#ifndef TS_FULLY_SHARD_INTERNAL_H
#define TS_FULLY_SHARD_INTERNAL_H

#include "base/internal.h"
#include "fully_shard/fully_shard.h"
#include "fully_shard/offload_internal.h"

#include "comm/comm.h"
#include "comm/coll_direct.h"

#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>

#define TS__FSDP_FQN_MAX 512

typedef struct fsdp_state fsdp_state;
typedef struct fsdp_group fsdp_group;
typedef struct fsdp_ctx fsdp_ctx;

/* The rows of a parameter that one shard rank holds (ts_chunk_range),
 * computed once when its group is built. */
typedef struct fsdp_chunk {
    int64_t row0, rows; /* the rows [row0, row0 + rows) of the full parameter (rows <= c) */
    int64_t buf_off;    /* where the chunk starts in the all-gather output (W blocks), in elements:
                           r * shard_numel + off (the reduce-scatter input's blocks are longer: the
                           flags follow each, param_group.c) */
} fsdp_chunk;

typedef struct fsdp_param {
    char *fqn;          /* name relative to the sharded module (messages) */
    ts_tensor ***slots; /* every slot holding the parameter */
    int *slot_owner;    /* per slot: the index of its module in the call */
    int n_slots;
    ts_tensor *S;   /* sharded leaf (retained) */
    ts_tensor *U;   /* unsharded leaf (retained), storage released while sharded */
    ts_dtensor *dt; /* S's DTensor (owned) */
    int ndim;
    int64_t shape[TS_MAX_DIMS];
    int64_t rows, row_numel, numel;
    int64_t c;          /* chunk rows: ceil(rows / W) */
    int64_t local_rows; /* this rank's real rows */
    int64_t off;        /* offset in the per-rank shard (elements) */
    fsdp_chunk *chunks; /* per shard rank r (W of them): the rows it holds */
    bool requires_grad;
    bool in_reduce;  /* its gradient is in the reduce-scatter in flight: this rank's, until the
                           reduction is waited on; then whether any rank had one (param_group.c,
                           [Note: unused parameters]) */
    bool u_meta;     /* U's released CPU storage is taken as meta while unsharded in a meta step
                           (param.c, ts__fsdp_param_restore_u) */
    bool in_partial; /* its gradient is in the group's partial (HSDP, requires_all_reduce false) */
    /* no gradient sync under a reduce dtype other than the gradient's: the
     * unsharded gradient accumulated in rdtype (full shape, owned), FSDP2's
     * unsharded_accumulated_grad; NULL otherwise (the gradient then stays
     * on U, where autograd accumulates) */
    ts_tensor *acc;
    /* deferred init (materialize.c): the full meta parameter the shard was
     * made from (retained), until ts_fsdp_materialize or a checkpoint load
     * gives the shard bytes: its storage carries the initializers recorded
     * on it, of which this rank replays the elements of its rows; NULL for
     * a parameter sharded with bytes */
    ts_tensor *meta_src;
} fsdp_param;

/* A parameter with fewer elements than the call's
 * persist_threshold_numel (DeepSpeed's stage3_param_persistence_threshold;
 * persist.c): left whole in its slots on every rank, outside the group's
 * buffers (never all-gathered), its gradient all-reduced at the end of the
 * backward together with every other persistent parameter under the root
 * (one bucket per reduce dtype and reduction plan, usually one). The group
 * keeps the microbatching flags that decide when that happens. */
typedef struct fsdp_persist {
    ts_tensor *t;       /* the parameter (retained); stays in its slots */
    char *fqn;          /* its name relative to the sharded module (owned) */
    ts_tensor ***slots; /* the slots holding it (owned array; for the slot registry) */
    int n_slots;
    ts_dtype rdtype; /* the dtype its gradient is reduced in (reduce_dtype, or its own) */
    /* the gradient the last reduction set (retained): found still on t at
     * the next backward, it is moved to `reduced` so that only the new
     * local gradient is reduced, then added back */
    ts_tensor *mine;
    ts_tensor *reduced;
} fsdp_persist;

/* Where a group's parameters are (PyTorch's ShardedState, plus the
 * all-gather in flight of an asynchronous unshard). */
typedef enum fsdp_sharded_state {
    FSDP_SHARDED = 0, /* only the shards exist; the slots hold S, U's storage is released */
    FSDP_UNSHARDING,  /* the all-gather is in flight (ag_buf, ag_req); the slots still hold S */
    FSDP_UNSHARDED,   /* the full parameters U are copied out and in the slots */
} fsdp_sharded_state;

/* What a group, or a root's context, is doing (PyTorch's TrainingState). */
typedef enum fsdp_training_state {
    FSDP_IDLE = 0,      /* none of the below: between iterations, or between a group's forward and backward */
    FSDP_FORWARD,       /* group: from its modules' first pre-forward in this iteration to its reshard point */
    FSDP_PRE_BACKWARD,  /* group: unsharded for its modules' backward; context: a backward went through a
                           marker and has not ended (its end-of-backward callback has not run) */
    FSDP_POST_BACKWARD, /* group: its gradients are packed and their reduce-scatter issued, until the
                           end of the backward */
} fsdp_training_state;

/* What a group's collectives of one kind did (TS_DISTRIBUTED_DEBUG,
 * ts_fsdp_print_stats; repr.c writes them): the calls issued (a meta step's
 * skipped ones not counted), the bytes of their unsharded side (the
 * padded group: W x shard_numel elements in the collective's dtype), and
 * the time the lifecycle spent waiting for them to complete. */
typedef struct fsdp_coll_stats {
    uint64_t calls, bytes, wait_ns;
} fsdp_coll_stats;

struct fsdp_group {
    atomic_int refs;
    fsdp_param *params;
    int n;
    ts_dtype dtype;
    size_t es;
    ts_mesh *mesh; /* borrowed, or owned_mesh */
    ts_mesh *owned_mesh;
    ts_comm *pg; /* the shard group */
    ts_comm *rg; /* HSDP: the replicate group (NULL otherwise) */
    int W, rank;
    int64_t shard_numel, numel, local_numel;
    ts_tensor *sharded; /* 1-d, shard_numel */
    fsdp_sharded_state sharded_state;
    ts_tensor *ag_buf; /* W * shard_numel while unsharding */
    ts_request *ag_req;
    ts_tensor *rs_in, *rs_out;
    ts_request *rs_req;
    ts_reshard_policy policy; /* resolved at lazy init (AUTO -> TRUE / FALSE) */
    ts_reshard_policy user_policy;
    int every_n, fwd_since_reshard;
    int n_states;                 /* modules sharing the group */
    int ran_forward;              /* distinct modules of the group run in this forward */
    fsdp_training_state training; /* IDLE, FORWARD, PRE_BACKWARD or POST_BACKWARD */
    char fqn[TS__FSDP_FQN_MAX];
    ts__fsdp_offload off; /* CPUOffloadPolicy (offload_internal.h); off.on false without one */
    /* mixed precision (ts_mp_policy), resolved when the group is made:
     * udtype is the all-gather's and the unsharded parameters' dtype
     * (param_dtype, or dtype: no cast), rdtype the reduce-scatter's and
     * HSDP all-reduce's (reduce_dtype, or udtype); ues, res their sizes */
    ts_dtype udtype, rdtype;
    size_t ues, res;
    ts_tensor *ag_in; /* the shard cast to udtype, while its all-gather is in flight */
    /* the microbatching controls (fully_shard/accum.c; FSDP2's
     * FSDPParamGroup.reduce_grads, all_reduce_grads,
     * reshard_after_backward, gradient_divide_factor,
     * force_sum_reduction_for_comms) */
    bool reduce_grads;           /* requires_gradient_sync (default true) */
    bool all_reduce_grads;       /* requires_all_reduce: HSDP's all-reduce (default true) */
    bool reshard_after_backward; /* default true */
    bool force_sum;              /* SUM collectives, divided after the last one */
    double divide_factor;        /* 0: none set (average over the ranks) */
    /* HSDP with requires_all_reduce false: the reduce-scattered gradients
     * summed over microbatches (rdtype, shard_numel), all-reduced with the
     * next reduction that all-reduces */
    ts_tensor *partial;
    /* how the reduction in flight was issued (ts__fsdp_reduce_plan) */
    ts_reduce_op ar_op;
    double post_div; /* after the HSDP all-reduce (1: none) */
    /* the call's parameters below persist_threshold_numel (persist.c);
     * params[0..n) are the sharded ones only, so a group may have n == 0
     * and only persistent parameters: it then issues no all-gather */
    fsdp_persist *persist;
    int n_persist;
    unsigned persist_mark; /* persist.c: the bucket walk that last visited the group */
    /* copy-free collectives (comm/coll_direct.h; param_group.c): the
     * all-gather reads the peers' rows straight into the U tensors, the
     * reduce-scatter this rank's rows of the peers' U gradients straight
     * into rs_out (no ag_buf, no copy-out, no rs_in). In flight: ag_direct
     * (instead of ag_buf/ag_req), rs_direct (instead of rs_in/rs_req) with
     * the gradients it reads kept in rs_src (n, owned) until it completes;
     * dsegs (n) and dcounts (n x W elements per rank) are made once. */
    bool copy_free;    /* from ts__fsdp_copy_free() when the group is made */
    bool flags_apart;  /* the reduce-scatter in flight: its flags were reduced on their own
                                  * (they would underflow in it: [Note: unused parameters]) */
    uint64_t n_direct; /* collectives that took the copy-free path (not the packed fallback) */
    ts__direct *ag_direct, *rs_direct;
    /* ts_fsdp_set_separate_reduce_scatter_group: the reductions' own group
     * (the shard group's ranks, owned; NULL: they share pg); a copy-free
     * reduce-scatter on it moves on the reductions' own channel. */
    ts_comm *rsg;
    ts_tensor **rs_src;
    ts__dseg *dsegs;
    int64_t *dcounts;
    /* the shard gradients (param_group.c, finish_reduce): a parameter
     * without one gets a view of the reduction's output (rs_out, or its
     * cast) at its offset, so that a group's gradients share one storage
     * in the shard layout; a later reduction on the copy-free path adds
     * straight into those views (rs_add: rs_out is then an alias of their
     * storage and the collective is ts__direct_reduce_scatter_add), other
     * cases add each segment into the existing gradient in a separate
     * pass. Counted for tests and benchmarks: reductions the collective
     * added in (n_rs_add), segments added by the separate pass
     * (n_grad_adds), gradients made as views (n_grad_views). */
    bool rs_add;
    uint64_t n_rs_add, n_grad_adds, n_grad_views;
    /* a meta step (param_group.c, [Note: meta step]): the all-gather and
     * the reduction in flight were skipped (no collective, no data); they
     * complete when waited on */
    bool ag_meta, rs_meta;
    /* what the skipped collectives would hold from the pool until waited
     * on (the copy-free descriptors, comm's staging scratch), as meta
     * storages: freed when the all-gather (ag_hold) or reduction (rs_hold)
     * completes */
    ts_tensor *ag_hold[4], *rs_hold[4];
    /* the lifecycle's all-gathers (unshard), reduce-scatters
     * (post-backward) and HSDP all-reduces (finishing a reduction) */
    fsdp_coll_stats ag_stats, rs_stats, ar_stats;
};

/* The collectives of a group's gradient reduction (FSDP2's
 * _get_gradient_divide_factors, docs/design.md, "Gradient division"). */
typedef struct fsdp_reduce_plan {
    ts_reduce_op rs_op, ar_op;
    double rs_pre, rs_post; /* the reduce-scatter's pre_div and post_div */
    double post;            /* divided after the HSDP all-reduce (1: none) */
} fsdp_reduce_plan;

struct fsdp_state {
    atomic_int refs;
    ts_module *module; /* NULL once the module was freed */
    const ts_module_vtable *orig_vt;
    fsdp_group *group; /* retained; NULL when the call took no parameter */
    fsdp_ctx *ctx;     /* the root's (borrowed; owned by the root: ctx->root == this) */
    char fqn[TS__FSDP_FQN_MAX];
    bool *method_wrapped; /* per named method of orig_vt: wrapped by ts_fsdp_register_forward_method */
    bool ran;             /* ran forward in this iteration (grouped calls count modules once) */
    int index;            /* its place among the modules of its call */
    fsdp_state **fwd_prefetch, **bwd_prefetch; /* explicit lists (retained) */
    int n_fwd_prefetch, n_bwd_prefetch;
    bool explicit_fwd, explicit_bwd;
    ts_mp_policy mp;        /* the call's policy (ts_mp_policy_default() for none): the input and output casts */
    bool not_last_backward; /* ts_fsdp_set_is_last_backward(false) before lazy init: copied into the root's ctx */
};

struct fsdp_ctx {
    fsdp_state *root;
    fsdp_state **states; /* pre-order, retained */
    int n_states, cap_states;
    fsdp_group **post_fwd; /* this iteration's post-forward order (multiplicity) */
    int n_post_fwd, cap_post_fwd;
    fsdp_group **fwd_order, **prev_fwd_order; /* pre-forward order: this and last iteration */
    int n_fwd_order, cap_fwd_order, n_prev_fwd_order, cap_prev_fwd_order;
    int fwd_pos;            /* next position in prev_fwd_order */
    fsdp_state *iter_root;  /* the state whose forward started this iteration */
    fsdp_group *rs_pending; /* the reduce-scatter in flight */
    bool final_queued;
    fsdp_training_state training; /* IDLE, or PRE_BACKWARD from a backward's first marker to its end */
    bool implicit_fwd, implicit_bwd;
    bool not_last_backward;   /* ts_fsdp_set_is_last_backward(false): the end of backward leaves the
                               reduction in flight and the post-forward order for the next backward */
    bool hold_pending;        /* rs_pending was kept on purpose by such a backward */
    struct fsdp_pbuckets *pb; /* persist.c: the persistent gradients' all-reduces in flight (NULL: none) */
    unsigned persist_walk;    /* persist.c: the id of the last walk over the groups */
    bool materialized;        /* a forward found nothing under the root on the meta device (materialize.c) */
};

/* ------------------------------------------------------------------ */
/* Collecting a call's parameters (fully_shard.c); a subtree's groups  */
/* ------------------------------------------------------------------ */

typedef struct ts__fsdp_pcand {
    ts_tensor *t; /* the parameter tensor */
    ts_tensor ***slots;
    int *owners; /* per slot: the index of the module in the call */
    int n_slots, cap_slots, cap_owners;
    char fqn[TS__FSDP_FQN_MAX]; /* first name */
} ts__fsdp_pcand;

typedef struct ts__fsdp_collect {
    ts__fsdp_pcand *c;
    int n, cap;
    ts_module **seen; /* modules visited (each once) */
    int n_seen, cap_seen;
    const ts_fsdp_options *o;
    char prefix[TS__FSDP_FQN_MAX];
    int top;          /* the index of the module being walked in the call */
    const char *fn;   /* the API function (messages) */
    const char *type; /* the type of the module being walked in the call (messages) */
} ts__fsdp_collect;

/* The distinct groups of a subtree's FSDP modules (state.c, ts__fsdp_subtree_groups). */
typedef struct ts__fsdp_groups_walk {
    fsdp_group **g;
    int n, cap;
} ts__fsdp_groups_walk;

/* ------------------------------------------------------------------ */
/* Floors                                                             */
/* ------------------------------------------------------------------ */

/* The files of fully_shard/ stand on seven floors, in PyTorch's order
 * (_fsdp_common, _fsdp_param, _fsdp_param_group, _fsdp_state,
 * fully_shard): a file calls only files on floors below its own (on
 * floors 6 and 7 also the floor-mates named in its head comment), never
 * one above, so no two files call each other (the unit test layering,
 * tools/check_layering.py, holds it from the objects' symbols: its
 * FSDP_FLOORS is this table). The sections
 * below declare what each floor offers to the floors above it.
 *  1. helpers: common.c (events and trace spans, the registries of
 *     replaced, persistent and ignored parameters and the optimizer's
 *     check, growing arrays, the meta checks, a group's reduction plan),
 *     repr.c (a group described: extra_repr, the collective figures),
 *     mp_policy.c;
 *  2. param.c: one parameter's geometry and copies;
 *  3. offload.c (offload_internal.h) and persist.c;
 *  4. param_group.c: one group's lifecycle;
 *  5. state.c: the FSDP vtables and states, lazy init, the forward and
 *     backward hooks, the groups of a subtree;
 *  6. the API: materialize.c, then accum.c, state_dict.c, fully_shard.c;
 *  7. explicit.c, policy.c, summary.c, memory.c, grad_scaler.c.
 */

/* ------------------------------------------------------------------ */
/* Floor 1: common.c, repr.c, mp_policy.c (calls nothing above)       */
/* ------------------------------------------------------------------ */

/* common.c: events and trace spans */
void ts__fsdp_event(const char *what, const char *fqn);
/* The calling thread's own observer of the events above (after the
 * process-wide hook; NULL clears): ts_fsdp_memory_estimate's measure of
 * each block's forward (memory.c). */
void ts__fsdp_set_observer(ts_fsdp_event_fn fn, void *ctx);
void ts__fsdp_trace_hook(uint64_t t0, const char *name, const char *fqn, const fsdp_group *g);

/* common.c: the registries (replaced, persistent, ignored parameters and
 * the slots groups manage: [Note: bottom-up] in common.c). fully_shard.c
 * adds to them once a call can no longer fail; a group's and a state's
 * entries go with them. */
/* Remembers t, replaced by (or, when persist, kept as a persistent
 * parameter of) group g under the name fqn (retained). */
void ts__fsdp_reg_add(ts_tensor *t, fsdp_group *g, const char *fqn, bool persist);
/* Remembers that g manages slot, under the parameter's name fqn (g's own
 * string: not copied). */
void ts__fsdp_slot_add(ts_tensor *const *slot, const fsdp_group *g, const char *fqn);
/* Room for n more ignored parameters, so that ts__fsdp_ign_add cannot
 * fail; false when out of memory. */
bool ts__fsdp_ign_reserve(int n);
/* Remembers t (retained) as ignored by state s's call. */
void ts__fsdp_ign_add(ts_tensor *t, const fsdp_state *s);
/* Writes into other (cap bytes) the name of the group parameter t was
 * replaced by and returns true when an FSDP group already manages t. */
bool ts__fsdp_reg_owner(const ts_tensor *t, char *other, size_t cap);
/* True when t is a persistent parameter of some group (persist.c). */
bool ts__fsdp_is_persistent(const ts_tensor *t);
/* Returns true when slot is a parameter slot that some FSDP group
 * already manages (its module's subtree contains the slot), with the name
 * of the parameter in that group written into fqn and the group's fqn (its
 * module's) into type, cap bytes each: [Note: bottom-up] in common.c. */
bool ts__fsdp_slot_owner(ts_tensor *const *slot, char *fqn, char *type, size_t cap);
void ts__fsdp_reg_drop_group(fsdp_group *g);
void ts__fsdp_ign_drop_state(const fsdp_state *s);
/* Installs the optimizer's check over the registries (optim's hook). */
void ts__fsdp_install_optim_check(void);

/* common.c: helpers */
/* Grows *arr (ts__malloc, TS_MEM_NN) to room for need elements of elem
 * bytes (doubling *cap); false when out of memory (*arr unchanged). */
bool ts__fsdp_grow(void **arr, int *cap, int need, size_t elem);
/* The type a module had before fully_shard (or ts_checkpoint_module)
 * rewrote it ("" if unnamed). */
const char *ts__fsdp_own_type(const ts_module *m);
/* Whether g's runtime plays on the meta device ([Note: meta step] in
 * param_group.c): the thread is in a meta scope or the group's sharded
 * buffer is meta. Its collectives are then skipped (they complete at
 * once), its copies move no data, and its buffers are meta storages on the
 * thread's ledger. */
bool ts__fsdp_group_meta(const fsdp_group *g);
/* TS_ERR_STATE (prefixed with fn) naming the first parameter or buffer of
 * root's tree (its full name) that is still on the meta device; TS_OK when
 * none is. */
ts_status ts__fsdp_check_materialized(const char *fn, ts_module *root);
/* The same for one group (its first parameter, by its name in the group). */
ts_status ts__fsdp_group_check_materialized(const char *fn, const fsdp_group *g);
/* The collectives and divisions for the group's next reduction. */
fsdp_reduce_plan ts__fsdp_reduce_plan(const fsdp_group *g);

/* repr.c: a group as text */
int ts__fsdp_extra_repr(const ts_module *m, char *buf, size_t cap);
/* g's reshard policy (resolved, or as the user gave it; is_root < 0: not
 * known yet, before the first forward) and a mesh as text, into buf (cap
 * bytes). */
void ts__fsdp_policy_str(const fsdp_group *g, bool resolved, int is_root, char *buf, size_t cap);
void ts__fsdp_mesh_str(const ts_mesh *mesh, char *buf, size_t cap);
/* The lines of ts_fsdp_print_stats for the groups w (fully_shard.h),
 * written to f; false when writing failed. */
bool ts__fsdp_print_coll_stats(const ts__fsdp_groups_walk *w, FILE *f);

/* ------------------------------------------------------------------ */
/* Floor 2: param.c (calls floor 1)                                   */
/* ------------------------------------------------------------------ */

ts_status ts__fsdp_param_init(fsdp_param *p, const fsdp_group *g, const ts_tensor *t, const char *fqn);
ts_status ts__fsdp_param_make_shard(fsdp_param *p, fsdp_group *g, ts_tensor *t);
void ts__fsdp_param_fini(fsdp_param *p);
void ts__fsdp_swap_slot(ts_tensor **slot, ts_tensor *t);
void ts__fsdp_param_set_slots(fsdp_param *p, bool unsharded);
ts_status ts__fsdp_param_copy_out(fsdp_param *p, const fsdp_group *g, const unsigned char *ag);
/* Packs gr (NULL: zeros) into the reduce-scatter input `in`: W blocks of
 * `block` elements (rdtype), rank r's rows at r * block + off. */
ts_status ts__fsdp_param_pack_grad(fsdp_param *p, const fsdp_group *g, unsigned char *in, int64_t block, ts_tensor *gr);
void ts__fsdp_param_write_back(fsdp_param *p, const fsdp_group *g);
/* Restores / releases U's storage (param.c): in a meta step a released
 * CPU storage is counted on the meta ledger while unsharded. */
ts_status ts__fsdp_param_restore_u(fsdp_param *p, const fsdp_group *g);
void ts__fsdp_param_release_u(fsdp_param *p);
ts_status ts__fsdp_param_load_rows(fsdp_param *p, const fsdp_group *g, ts_tensor *src);

/* ------------------------------------------------------------------ */
/* Floor 3: offload.c (offload_internal.h), persist.c (floors 1-2)    */
/* ------------------------------------------------------------------ */

/* persist.c: parameters below the persistence threshold */
/* Moves the candidates of c with fewer than o->persist_threshold_numel
 * elements (and requiring nothing else) out of c into *out (n_out of them,
 * owned; NULL and 0 when none or the threshold is off). Checks them as
 * group_new checks sharded ones (dtype, released storage, another group's
 * parameter) and that no mixed-precision param_dtype or offload policy
 * applies to them (TS_ERR_UNSUPPORTED). Nothing changes on error. */
ts_status ts__fsdp_persist_take(const char *fn, ts__fsdp_collect *c, const ts_fsdp_options *o, fsdp_persist **out,
                                int *n_out);
void ts__fsdp_persist_free(fsdp_persist *p, int n);
/* The first pre-backward marker of a backward: a persistent parameter
 * whose gradient is still the one the last reduction set moves it aside. */
void ts__fsdp_persist_begin_backward(fsdp_ctx *c);
/* The end of a backward: packs the persistent parameters' gradients of
 * every group that reduces now (gradient sync on; under HSDP also the
 * all-reduce) into one bucket and issues its all-reduce (shard group). */
ts_status ts__fsdp_persist_issue(fsdp_ctx *c);
/* Waits for the bucket (then, under HSDP, all-reduces it over the
 * replicate group) and sets the reduced gradients (plus what was moved
 * aside). */
ts_status ts__fsdp_persist_finish(fsdp_ctx *c);
/* A failed backward: drops the bucket and the new local gradients of the
 * persistent parameters, restores what was moved aside. */
void ts__fsdp_persist_discard(fsdp_ctx *c);
/* The persistent parameter t of a group of w (NULL if none). */
fsdp_persist *ts__fsdp_find_persist(ts__fsdp_groups_walk *w, const ts_tensor *t);

/* ------------------------------------------------------------------ */
/* Floor 4: param_group.c (floors 1-3)                                */
/* ------------------------------------------------------------------ */

ts_status ts__fsdp_group_new(const char *fn, ts__fsdp_collect *c, const ts_fsdp_options *o, int n_states,
                             fsdp_group **out);
void ts__fsdp_group_free(fsdp_group *g);
fsdp_group *ts__fsdp_group_retain(fsdp_group *g);
void ts__fsdp_group_release(fsdp_group *g);
ts_status ts__fsdp_unshard(fsdp_group *g);
ts_status ts__fsdp_wait_unshard(fsdp_group *g);
ts_status ts__fsdp_reshard(fsdp_group *g);
ts_status ts__fsdp_finish_reduce(fsdp_group *g);
void ts__fsdp_discard_reduce(fsdp_group *g);
ts_status ts__fsdp_post_backward(fsdp_ctx *ctx, fsdp_group *g);
/* Whether a group of W ranks whose all-gather output is unsharded_bytes,
 * made from now on, uses the copy-free collectives (comm/coll_direct.h;
 * g->copy_free): TS_FSDP_COPY_FREE=0 selects the packed path (all-gather
 * buffer and copy-out, packed reduce-scatter input), the reference the
 * tests compare against, =1 the copy-free path for every group; by
 * default groups of 256 KiB and more on more than one rank go copy-free
 * (below that the direct collective's fixed cost exceeds the copies it
 * saves). The internal switch (1 on, 0 off, -1 back to the environment)
 * must agree on every rank when a group is made. Any thread. */
bool ts__fsdp_copy_free(int W, int64_t unsharded_bytes);
void ts__fsdp_set_copy_free(int on);
/* A reduction of g is in flight (packed or copy-free). */
bool ts__fsdp_reduce_in_flight(const fsdp_group *g);
/* Drops what microbatches without sync left unreduced: every parameter's
 * acc and U gradient, and the group's partial. */
void ts__fsdp_drop_unreduced(fsdp_group *g);
/* All-gathers the group's shards in their own dtype (not the policy's
 * param_dtype) and, when keep, makes each parameter's full tensor
 * full[0..n) (new references). Collective over the shard group. */
ts_status ts__fsdp_gather_full(fsdp_group *g, bool keep, ts_tensor **full);

/* ------------------------------------------------------------------ */
/* Floor 5: state.c (floors 1-4)                                      */
/* ------------------------------------------------------------------ */

ts_status ts__fsdp_vtable(const ts_module_vtable *orig, const ts_module_vtable **out);
fsdp_state *ts__fsdp_state_of(const ts_module *m);
/* Writes m's state (borrowed) to *out; TS_ERR_INVALID_ARGUMENT (prefixed
 * with fn, naming m's type) when m is not an FSDP module. */
ts_status ts__fsdp_need_state(const char *fn, ts_module *m, fsdp_state **out);
fsdp_state *ts__fsdp_state_retain(fsdp_state *s);
void ts__fsdp_state_release(fsdp_state *s);
ts_status ts__fsdp_lazy_init(fsdp_state *st);
/* The reshard policy the group has once lazy init resolves it (AUTO: false
 * for the root's group, true for the others; every 1 forward: true), also
 * before that, without changing the group (state.c). */
ts_reshard_policy ts__fsdp_resolved_policy(const fsdp_group *g, bool root);
/* The distinct groups of a subtree's FSDP modules, pre-order (w->g owned
 * by the caller). */
ts_status ts__fsdp_subtree_groups(ts_module *m, ts__fsdp_groups_walk *w);
/* Inside a forward or backward of one of g[0..n), or a reduction of one
 * in flight, or any backward running. */
bool ts__fsdp_groups_busy(fsdp_group *const *g, int n);
/* The groups of m's subtree (w->g owned by the caller), or TS_ERR_STATE
 * (naming fn) when called inside a forward or backward of one of them. */
ts_status ts__fsdp_idle_groups(const char *fn, ts_module *m, ts__fsdp_groups_walk *w);
/* TS_DISTRIBUTED_DEBUG=INFO (or DETAIL): the root's groups'
 * collective figures on stderr when it is freed (nothing when they issued
 * none, as the memory estimate's meta models). */
void ts__fsdp_stats_at_free(ts_module *root);

/* ------------------------------------------------------------------ */
/* Floor 6: materialize.c; accum.c, state_dict.c, fully_shard.c       */
/* ------------------------------------------------------------------ */

/* materialize.c: deferred initialization (docs/fully_shard.md, "Deferred
 * initialization") */
/* Gives every meta storage under root bytes in place (zeros), the groups'
 * sharded buffers (pinned under an offload policy with pin_memory), the
 * parameters outside groups and the buffers; with replay, then replays
 * their recorded initializers (ts_fsdp_materialize). Without replay the
 * recorded initializers are dropped (a checkpoint load fills the values).
 * A model with nothing on the meta device is left as it is. */
ts_status ts__fsdp_materialize(const char *fn, ts_module *root, bool replay);
/* state_dict.c */
fsdp_param *ts__fsdp_find_param(ts__fsdp_groups_walk *w, const ts_tensor *t, fsdp_group **g_out);
/* fully_shard.c */
/* Meshes over `world` (a virtual world: comm_internal.h,
 * ts__virtual_world_new) are accepted by ts_fully_shard on the calling
 * thread although ts_dist_init made another world (NULL clears). */
void ts__fsdp_set_virtual_world(ts_comm *world);

/* Floor 7 (explicit.c, policy.c, summary.c, memory.c, grad_scaler.c,
 * floors 1-6) offers nothing to the others. */

#endif
