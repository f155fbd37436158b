/*
 * fully_shard: per-parameter fully sharded data parallelism, in the style
 * of PyTorch FSDP2 (docs/design.md D5, D6; docs/fully_shard.md).
 *
 * ts_fully_shard(module, options) changes a module in place:
 *   - its vtable becomes "<Type>FSDPModule", which extends the original
 *     (same address, same methods, ts_module_is_fsdp true, the original
 *     reachable through ts_fsdp_original_vtable);
 *   - the parameters of its subtree that no earlier call took (bottom-up:
 *     shard each block first, then the root) form one group; each slot then
 *     holds this rank's dim-0 shard (torch.chunk rows: (8, 8) becomes (4, 8)
 *     on 2 ranks), a leaf marked as a shard (ordinary ops refuse it) that
 *     carries DTensor metadata (ts_fsdp_param_dtensor); names are unchanged;
 *   - calling the module (ts_module_call) all-gathers the group into full
 *     parameters before its forward, reshards after it (per
 *     reshard_after_forward), all-gathers again before its backward, and
 *     reduce-scatters the gradients into the shards' .grad afterwards
 *     (averaged over the shard ranks; accumulating across backwards until
 *     zeroed). A parameter some ranks' backward gave no gradient counts
 *     as zeros there: every rank's shard gets the average when any rank
 *     had a gradient for it, and none when no rank did (DDP's
 *     find_unused_parameters; docs/fully_shard.md, "Unused parameters").
 *     Every rank must still run each FSDP module's forward and backward.
 *
 * A group is gathered with one all-gather and reduced with one
 * reduce-scatter; each parameter's segment of the communication buffers is
 * padded to ceil(rows / W) rows. The first FSDP module to run forward is
 * the root: it decides the end-of-backward work (the post-backward of
 * groups whose inputs needed no grad, waiting for every reduction). The
 * next group's all-gather is issued before the current group computes, in
 * the order recorded on the previous iteration (forward prefetch), and in
 * backward the group that ran before in forward is all-gathered while the
 * current one computes (backward prefetch, as PyTorch).
 *
 * A forward run without grad (evaluation) reshards every group at its end,
 * since no backward will: an optimizer step before the next forward is
 * then always seen. A backward that fails drops its partial reductions at
 * the next forward (they never reach the shards' gradients).
 *
 * Build the optimizer from the module's parameters after fully_shard: it
 * steps on the shards (ts_module_parameters gives the list). Mistakes that
 * would otherwise train silently are reported:
 *   - an optimizer built before fully_shard (its tensors are no longer the
 *     module's, so it would never see a gradient): its step fails with
 *     TS_ERR_STATE naming the first such parameter;
 *   - ts_fully_shard while the launcher's variables (RANK/WORLD_SIZE,
 *     mpirun's, Slurm's) say WORLD_SIZE > 1 but ts_dist_init was not
 *     called: TS_ERR_STATE (every rank would train alone);
 *   - parameters outside every group, given to an optimizer next to
 *     parameters sharded over more than one rank (the root was not
 *     sharded: their gradients are not averaged, the replicas drift
 *     apart): a warning in the log at the optimizer's first step, unless
 *     they were passed as ignored_params;
 *   - an optimizer step in which no parameter has a gradient: a warning
 *     (once per optimizer; optim/optim.h).
 *
 * Module types and named methods are not limited in number: the
 * "<Type>FSDPModule" vtables are made on demand and cached for the life of
 * the process. A vtable without a type name or free function is
 * TS_ERR_INVALID_ARGUMENT; one with its own call_method dispatcher is
 * TS_ERR_UNSUPPORTED; calling an FSDP module whose type has no forward
 * (ModuleList) is TS_ERR_UNSUPPORTED. Buffers are never sharded: every
 * rank keeps its whole copy, and full state dicts hold them as they are.
 *
 * Lifetime rules: the FSDP state belongs to the module and is freed with
 * it (ts_module_free). A mesh given in the options is borrowed and must
 * outlive the module. Every rank of the mesh calls ts_fully_shard, the
 * forward and backward passes, and the other collective calls here, in
 * the same order. One thread at a time per module tree.
 */
#ifndef TS_FULLY_SHARD_H
#define TS_FULLY_SHARD_H

#include "base/base.h"
#include "dtensor/dtensor.h"
#include "mesh/mesh.h"
#include "nn/nn.h"

#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum ts_reshard_policy {
    TS_RESHARD_AUTO = 0, /* true, except false for the root (PyTorch's None) */
    TS_RESHARD_TRUE,     /* reshard after every forward */
    TS_RESHARD_FALSE,    /* keep the parameters unsharded until after backward */
    TS_RESHARD_EVERY_N,  /* reshard after every N-th forward (reshard_every_n) */
} ts_reshard_policy;

/* CPUOffloadPolicy (FSDP2's CPUOffloadPolicy; fully_shard/offload.c). The
 * sharded parameters, their gradients and therefore the optimizer state
 * live in host memory, pinned (base.h, "Pinned host memory") when
 * pin_memory is true; before each all-gather the host shard is copied to
 * the compute device (the all-gather's input), and after each
 * reduce-scatter the reduced gradient is copied back to the host and
 * accumulated into the host shard's gradient, where the optimizer steps.
 * On the CPU device, which is host memory, offload changes only where
 * the shard and gradient bytes live (pinned blocks instead of the caching
 * pool) and adds those two staging copies, which are real copies,
 * counted by ts_fsdp_offload_stats_get; training results are
 * bit-identical to training without offload. As in FSDP2 the policy is
 * per call: groups sharded without one are not offloaded. Every
 * parameter must be on the CPU device (TS_ERR_INVALID_ARGUMENT naming the
 * others; TS_DEVICE_CPU is the only device today). With offload, a
 * shard's gradient is a view of its group's host gradient buffer (made
 * once, reused every step; a gradient still held elsewhere when the next
 * one comes keeps its values: the group starts a new buffer then). */
typedef struct ts_offload_policy {
    /* Pin the host shards and gradients (default true); false keeps them
     * in pageable memory (PyTorch: synchronous copies, no pinned memory). */
    bool pin_memory;
} ts_offload_policy;

/* The defaults: pin_memory true. */
TS_API ts_offload_policy ts_offload_policy_default(void);

/* ------------------------------------------------------ mixed precision
 * (fully_shard/mp_policy.c) FSDP2's MixedPrecisionPolicy: module-level
 * mixed precision, set per fully_shard call (a child may have its own
 * policy inside a parent's: an f32 child under a bf16 parent):
 *   - the sharded parameter keeps its dtype (f32 master weights: the
 *     optimizer steps on them as without a policy, no extra copy);
 *   - param_dtype: the shard is cast to it before the all-gather (a bf16
 *     all-gather moves half the bytes of an f32 one), and the unsharded
 *     parameters, the forward and backward compute and the unsharded
 *     gradients are in it;
 *   - reduce_dtype: the gradients are converted to it for the
 *     reduce-scatter (and HSDP's all-reduce) and land, converted back, in
 *     the shard's gradient (the parameter's own dtype); keep: reduce in
 *     param_dtype;
 *   - output_dtype: floating outputs of the module's forward are cast to
 *     it after forward;
 *   - cast_forward_inputs: floating inputs of the module's forward are cast
 *     to param_dtype before it (when param_dtype is set).
 * A dtype equal to the one it would replace (param_dtype equal to the
 * parameter's dtype, reduce_dtype equal to param_dtype) adds no cast
 * (decided when fully_shard builds the group: a group's dtypes cannot
 * change afterwards); integer tensors (token ids) are never cast, and a
 * group's parameters are all floating. Buffers are never cast (FSDP2).
 * ts_fsdp_full_state_dict gathers the shards in their own dtype (the
 * float32 masters, not param_dtype); ts_fsdp_summon_full_params gives
 * the unsharded parameters in param_dtype and refuses writeback when they
 * differ from the shards' dtype (it would round the masters). */

/* The value of a ts_mp_policy dtype field that means "keep" (PyTorch's
 * None): no cast. Not a dtype of any tensor. */
#define TS_DTYPE_KEEP ((ts_dtype)0x7f)

typedef struct ts_mp_policy {
    ts_dtype param_dtype;     /* TS_F32, TS_F64, TS_BF16, TS_F16 or TS_DTYPE_KEEP (default) */
    ts_dtype reduce_dtype;    /* as param_dtype; TS_DTYPE_KEEP: param_dtype's (default) */
    ts_dtype output_dtype;    /* as param_dtype; TS_DTYPE_KEEP: outputs as computed (default) */
    bool cast_forward_inputs; /* default true */
} ts_mp_policy;

/* Every dtype TS_DTYPE_KEEP, cast_forward_inputs true: a policy that
 * changes nothing. */
TS_API ts_mp_policy ts_mp_policy_default(void);
/* Checks a policy (ts_fully_shard does the same): TS_ERR_INVALID_ARGUMENT
 * for NULL or a field that is neither a ts_dtype nor TS_DTYPE_KEEP (a
 * policy zeroed by memset is valid: all float32); TS_ERR_DTYPE for an
 * integer or bool dtype. Each message names the field and the value. */
TS_API ts_status ts_mp_policy_check(const ts_mp_policy *policy);

typedef struct ts_fsdp_options {
    /* The mesh to shard over (borrowed): 1-d (shard) or 2-d (replicate,
     * shard: HSDP, gradients all-reduced over dim 0). NULL: the world as a
     * 1-d mesh (the one-rank CPU mesh when no world is initialized). */
    ts_mesh *mesh;
    ts_reshard_policy reshard_after_forward;
    /* For TS_RESHARD_EVERY_N: the group stays unsharded after each forward
     * and reshards after every N-th forward since its last reshard; 1 is
     * the same as TS_RESHARD_TRUE; 0 or less is TS_ERR_INVALID_ARGUMENT.
     * A group resharded this way is gathered again for its backward. */
    int reshard_every_n;
    /* Parameters (the tensors in the module's slots) left unsharded and
     * outside every group. */
    ts_tensor *const *ignored_params;
    int n_ignored_params;
    /* Mixed precision for this call's group (borrowed, copied by
     * ts_fully_shard); NULL: none, as ts_mp_policy_default(). */
    const ts_mp_policy *mp_policy;
    /* CPU offload of the shards, their gradients and the optimizer state
     * (ts_offload_policy above; borrowed, read during the call); NULL: no
     * offload (FSDP2's OffloadPolicy()). */
    const ts_offload_policy *offload_policy;
    /* Persistence threshold (DeepSpeed's stage3_param_persistence_threshold):
     * the call's parameters with fewer elements than this stay whole
     * (replicated) in their slots on every rank instead of being sharded:
     * never all-gathered, their optimizer state replicated with them. At the
     * end of each backward that reduces gradients, the gradients of every
     * persistent parameter under the root are all-reduced together in one
     * bucket (one collective per step for the whole model; one per reduce
     * dtype and reduction plan when calls differ), averaged like a shard's
     * (the mesh's ranks; gradient_divide_factor, force_sum, the
     * mp_policy's reduce_dtype and requires_gradient_sync /
     * requires_all_reduce of the call's module apply). A call whose
     * parameters are all persistent issues no all-gather. 0 (the
     * default): off. Negative: TS_ERR_INVALID_ARGUMENT. Not built
     * (TS_ERR_UNSUPPORTED at ts_fully_shard): a persistent parameter under
     * an mp_policy whose param_dtype differs from its dtype, or under an
     * offload policy. */
    int64_t persist_threshold_numel;
} ts_fsdp_options;

/* Defaults: the world's mesh, TS_RESHARD_AUTO, nothing ignored, no
 * persistence threshold. */
TS_API ts_fsdp_options ts_fsdp_options_default(void);

/* Shards `module` in place as described above; NULL options: defaults.
 * Collective over the mesh (no communication today, but every rank must
 * shard the same modules in the same order). Errors (nothing is changed):
 * TS_ERR_ALREADY when fully_shard has already been applied to the module;
 * TS_ERR_STATE when the launcher's variables say WORLD_SIZE > 1 and
 * ts_dist_init was not called (and no mesh of several ranks was given);
 * TS_ERR_INVALID_ARGUMENT for NULL, a bad reshard_every_n, a mesh of
 * neither 1 nor 2 dims or one that does not match the initialized world, a
 * 0-d parameter, a parameter already managed by another group (a tied
 * weight sharded in a separate call: shard the modules together with
 * ts_fully_shard_group; or a module whose parent was sharded first: the
 * message names both and says to shard bottom-up), parameters of different dtypes in one group,
 * with an offload policy a parameter not on the CPU device;
 * ts_mp_policy_check's errors for a bad mp_policy (TS_ERR_DTYPE for an
 * integer dtype, TS_ERR_INVALID_ARGUMENT for a value that is no dtype);
 * TS_ERR_NO_MEMORY. */
TS_API ts_status ts_fully_shard(ts_module *module, const ts_fsdp_options *options);
/* Shards each of modules[0..n) with its own group, in order (seed 003's
 * list form): the same as n calls. Stops at the first error (earlier
 * modules stay sharded). */
TS_API ts_status ts_fully_shard_each(int n, ts_module *const *modules, const ts_fsdp_options *options);
/* Shards modules[0..n) into ONE group (PyTorch's fully_shard([a, b])), as
 * tied weights need: the parameters of all their subtrees are gathered
 * and reduced together; each module's vtable is rewritten. The group is
 * gathered when the first of them runs forward and resharded after the
 * last. Errors as ts_fully_shard. */
TS_API ts_status ts_fully_shard_group(int n, ts_module *const *modules, const ts_fsdp_options *options);

/* ------------------------------------------------------ wrap policies
 * (fully_shard/policy.c) Both walk root's tree bottom-up (every module
 * after its descendants, siblings in PyTorch's named_modules order) and
 * call ts_fully_shard(m, options) on the modules they pick. Neither ever
 * shards the root itself: end with ts_fully_shard(root, options), which
 * takes what is left, as FSDP2 users end with fully_shard(model). Modules
 * already sharded are skipped, and the parameters their groups hold count
 * as taken. *count_out (optional) is the number of modules sharded by the
 * call; 0 when nothing matched, which is not an error. Errors:
 * TS_ERR_INVALID_ARGUMENT for a NULL root or bad policy argument;
 * TS_ERR_ALREADY when root is already sharded (its group took every
 * parameter: apply the policy first); ts_fully_shard's errors, naming the
 * module (the modules sharded before it stay sharded). Collective like
 * ts_fully_shard: every rank applies the same policy. */

/* Shards every module below root whose type name (before fully_shard,
 * exactly "Block", not "BlockFSDPModule") is type_name: FSDP1's
 * ModuleWrapPolicy({Block}), FSDP2's loop calling fully_shard on each
 * Block. A match nested inside another match is sharded first. */
TS_API ts_status ts_fsdp_apply_by_type(ts_module *root, const char *type_name, const ts_fsdp_options *options,
                                       int *count_out);
/* FSDP1's size_based_auto_wrap_policy(min_num_params): bottom-up, a module
 * below root is sharded when the elements of its subtree's parameters that
 * no group holds yet (the ones its sharded descendants did not take, each
 * tensor once, ignored_params not counted) reach min_params. As FSDP1 by
 * default, nothing inside a MultiheadAttention is sharded on its own and a
 * ModuleList is never sharded (its parameters are left to its parent).
 * On two Blocks of two Linear(6, 6) with min_params 30, each Linear (36)
 * is sharded and the Blocks are not (nothing is left to them).
 * TS_ERR_INVALID_ARGUMENT for min_params <= 0. */
TS_API ts_status ts_fsdp_apply_by_size(ts_module *root, int64_t min_params, const ts_fsdp_options *options,
                                       int *count_out);

/* ------------------------------------------------------ deferred init
 * (fully_shard/materialize.c; docs/fully_shard.md, "Deferred
 * initialization") A model built on the meta device (its parameters and
 * buffers have a shape and a dtype and no bytes: tensor.h,
 * TS_DEVICE_META) can be sharded as it is: ts_fully_shard and the wrap
 * policies record the groups and make every buffer a group would own
 * (the sharded buffer, the offloaded host shard) meta too, with no
 * collective and no byte of parameter data. The initializers the
 * constructors ran on the meta parameters are recorded on them, and stay
 * with the shards. Then, before anything else:
 *   - ts_fsdp_materialize gives every meta storage bytes and replays the
 *     recorded initializers; or
 *   - ts_ckpt_load, ts_ckpt_load_full or ts_fsdp_load_full_state_dict
 *     fills the model from a checkpoint (materializing it first, without
 *     running the initializers).
 * Until then a forward (TS_ERR_STATE naming the first parameter or buffer
 * still meta: "'0.weight' is on the meta device: call ts_fsdp_materialize
 * (or load a checkpoint) first"), an unshard, a summon, a full state dict
 * or a checkpoint save refuses the model, except that inside
 * ts_device_scope_enter(TS_DEVICE_META) a forward, backward and optimizer
 * step run on it with no collective and no data, counting on the meta
 * ledger what the real step takes from the pool (docs/meta.md, "fully_shard
 * on meta shards"). A group's parameters are all
 * meta or all real (TS_ERR_INVALID_ARGUMENT naming one of each). */

/* Materializes every tensor under root that is on the meta device, in
 * place (the tensors stay the same objects: an optimizer built before
 * keeps working): each FSDP group's shards (this rank's rows only; the
 * padding rows zero; pinned under an offload policy with pin_memory), the
 * parameters outside every group and the buffers (whole); works on a
 * model never sharded too. Then the initializers recorded on the
 * parameters and buffers (every one of the model, in the order the
 * constructors ran them) are replayed, each drawing from its generator
 * exactly what it would have drawn on the full tensor while this rank
 * writes only its rows, in bounded blocks: the result is bitwise what
 * building the model eagerly with the same generator state and then
 * sharding it gives. Not collective (no communication: each rank fills
 * its own rows), but every rank must call it with the same generator
 * state, as eager initialization needs. Memory: the shards' bytes plus
 * one replay block. A model with nothing on the meta device is left
 * unchanged. Errors: TS_ERR_INVALID_ARGUMENT for NULL; TS_ERR_STATE
 * inside a forward or backward; TS_ERR_NO_MEMORY (the tensors made so
 * far stay materialized; calling it again finishes). Thread: the one
 * that runs the model. */
TS_API ts_status ts_fsdp_materialize(ts_module *root);

/* True once fully_shard was applied to m. */
TS_API bool ts_module_is_fsdp(const ts_module *m);
/* The vtable fully_shard extended (NULL when m is not an FSDP module). */
TS_API const ts_module_vtable *ts_fsdp_original_vtable(const ts_module *m);

/* The DTensor (Shard(0) over the group's mesh, the global shape) of a
 * sharded parameter tensor, borrowed; NULL if t is not one. */
TS_API const ts_dtensor *ts_fsdp_param_dtensor(const ts_tensor *t);

/* Where this rank's shard of a group parameter sits, for code outside
 * fully_shard (checkpoints) that reads sharding without its internals.
 * Every pointer is borrowed from the group and lives as long as the
 * model. Shard rank r holds the rows ts_chunk_range(rows, shard_world, r)
 * of dim 0 (rows: ts_dtensor_shape(dtensor)[0]). */
typedef struct ts_fsdp_shard_info {
    ts_tensor *shard;            /* the parameter's shard (the tensor the optimizer updates) */
    const ts_dtensor *dtensor;   /* its DTensor: mesh, placements, global shape */
    ts_comm *shard_group;        /* the ranks it is sharded over */
    ts_comm *replicate_group;    /* HSDP: this shard's replicas; NULL without */
    int shard_rank, shard_world; /* this rank in shard_group, and its size */
} ts_fsdp_shard_info;
/* Finds the group parameter of module's subtree whose shard or unsharded
 * tensor is t and writes its shard_info to *out; when t is none (a plain
 * parameter, a buffer, an ignored or persistent parameter) writes
 * out->shard NULL and the rest zero. TS_ERR_INVALID_ARGUMENT for NULL;
 * TS_ERR_NO_MEMORY. Not collective. Thread: the one that runs the model. */
TS_API ts_status ts_fsdp_param_shard_info(ts_module *module, const ts_tensor *t, ts_fsdp_shard_info *out);
/* Whether module's subtree is idle: no forward or backward of one of its
 * FSDP groups runs, no reduction of one is in flight and no backward
 * runs (a model never sharded: outside a backward). Writes *idle_out.
 * TS_ERR_INVALID_ARGUMENT for NULL; TS_ERR_NO_MEMORY. Not collective. */
TS_API ts_status ts_fsdp_is_idle(ts_module *module, bool *idle_out);
/* The communicator the meshes of module's FSDP groups were made over, or
 * ts_dist_world() when its subtree has none; borrowed (*world_out).
 * TS_ERR_INVALID_ARGUMENT for NULL; TS_ERR_NO_MEMORY. Not collective. */
TS_API ts_status ts_fsdp_world(ts_module *module, ts_comm **world_out);
/* Reshards every FSDP group of module's subtree (each parameter's slots
 * hold its shard again; already sharded groups are left as they are); a
 * model without FSDP groups is left unchanged. TS_ERR_INVALID_ARGUMENT
 * for NULL; TS_ERR_STATE inside a forward or backward. Not collective.
 * Thread: the one that runs the model. */
TS_API ts_status ts_fsdp_reshard_tree(ts_module *module);
/* ts_fsdp_materialize without replaying the initializers: every meta
 * tensor under root gets bytes in place (zeros), and the recorded
 * initializers are dropped (for a caller, as a checkpoint load, that
 * fills every value next). Errors as ts_fsdp_materialize. */
TS_API ts_status ts_fsdp_materialize_empty(ts_module *root);

/* What CPU offload did in module's subtree (each FSDP group once):
 * groups that offload (and how many pin), the staging copies made so far
 * (H2D: host shard to the all-gather's device buffer before each
 * all-gather; D2H: reduced gradient back to the host after each
 * reduce-scatter) and their bytes, and the bytes of the host blocks the
 * offloaded groups hold (sharded buffers, host gradient and staging
 * buffers), with the part in pinned blocks. Zeros for a tree without
 * offload. TS_ERR_INVALID_ARGUMENT for NULL. Not collective. */
typedef struct ts_fsdp_offload_stats {
    int groups, pinned_groups;
    uint64_t h2d_copies, h2d_bytes;
    uint64_t d2h_copies, d2h_bytes;
    size_t host_bytes, pinned_bytes;
} ts_fsdp_offload_stats;
TS_API ts_status ts_fsdp_offload_stats_get(ts_module *module, ts_fsdp_offload_stats *out);

/* Facts about the group fully_shard made for `module` (not its
 * children's). */
typedef struct ts_fsdp_group_info {
    int n_params;             /* parameters in the group (0: none) */
    int shard_world;          /* ranks the group is sharded over */
    int64_t numel;            /* elements of the full parameters */
    int64_t shard_numel;      /* elements per rank in the communication buffers (padded) */
    int64_t padded_numel;     /* shard_numel * shard_world */
    int64_t padding;          /* padded_numel - numel */
    int64_t local_numel;      /* real (unpadded) elements this rank holds */
    int n_persistent;         /* parameters below persist_threshold_numel: whole on every rank, not in the above */
    int64_t persistent_numel; /* their elements */
} ts_fsdp_group_info;
/* TS_ERR_INVALID_ARGUMENT when module is not an FSDP module. */
TS_API ts_status ts_fsdp_group_info_get(const ts_module *module, ts_fsdp_group_info *out);

/* The sharding layout of module's tree as this rank sees it (FSDP1's
 * summarize().print_summary()): the mesh, then per group (pre-order) the
 * FQNs of its modules and their type, its parameters, elements and dtype,
 * mesh dims, reshard_after_forward policy (resolved at the first forward;
 * before it, what AUTO will mean), elements and bytes per rank (sharded,
 * padded) and while unsharded, padding on this rank and over all ranks,
 * and a line per parameter: FQN, full shape, this rank's local shard
 * shape, the padded shard shape, this rank's padding elements; then the
 * parameters outside every group (whole on every rank), the buffers
 * (never sharded), and what this rank holds in all; then what gradient
 * accumulation costs per rank in each mode (ts_fsdp_accumulation_memory)
 * and, between microbatches, a "gradient accumulation now" line: the
 * groups whose gradient sync is off, the unreduced (unsharded) gradients
 * held for the next synced backward, which an optimizer step now would
 * not see, and reductions left in flight. Works on a module
 * that is not (or not all) sharded. Not collective: call it on rank 0 to
 * print it once. ts_fsdp_summary writes to f (TS_ERR_IO when writing
 * fails); ts_fsdp_summary_str into buf (capacity cap, NUL-terminated,
 * truncated to fit; buf may be NULL when cap is 0) with *len_out the
 * length of the whole text. TS_ERR_INVALID_ARGUMENT for NULL arguments,
 * TS_ERR_NO_MEMORY. */
TS_API ts_status ts_fsdp_summary(ts_module *module, FILE *f);
TS_API ts_status ts_fsdp_summary_str(ts_module *module, char *buf, size_t cap, size_t *len_out);

/* What each FSDP group in module's subtree (pre-order, each group once)
 * communicated on this rank since it was made, one line per group and a
 * total (docs/debugging.md):
 *   [ts fsdp] rank 1/2 group 'blocks.0' (4 parameters, 4160 elements,
 *   mesh (dp=2)): all_gather 6 (16640 bytes, wait 0.512 ms),
 *   reduce_scatter 3 (16640 bytes, wait 0.101 ms)
 *   [ts fsdp] rank 1/2 total over 2 groups: ...
 * ("(root)" for the root's group; rank and size are the world's). Counted
 * are the collectives the FSDP lifecycle issues: the all-gathers of
 * unshard (forward, backward, ts_fsdp_unshard, summon), the
 * reduce-scatters of the gradients, and under HSDP the all-reduces over
 * the replicate dim; not the gathers of full state dicts, checkpoints or
 * clip_grad_norm's all-reduce, nor a meta step's skipped collectives.
 * Bytes are those of the padded group (W x the per-rank shard, in the
 * collective's dtype: param_dtype for all-gathers, reduce_dtype for
 * reductions) per collective, except the HSDP all-reduce's: this rank's
 * shard. Wait is the time the calling thread spent waiting for them to
 * complete (the whole of the blocking HSDP all-reduce). With
 * TS_DISTRIBUTED_DEBUG=INFO or DETAIL (comm.h) the same lines go to stderr
 * when the root module (the one the forwards start at) is freed, if its
 * groups issued any collective. Not collective. Errors:
 * TS_ERR_INVALID_ARGUMENT for NULL arguments; TS_ERR_IO when writing to
 * f fails; TS_ERR_NO_MEMORY. Any thread that may run the model, outside
 * its forward and backward. */
TS_API ts_status ts_fsdp_print_stats(ts_module *module, FILE *f);

/* ----------------------------------------------------- explicit control */

typedef struct ts_fsdp_unshard_handle ts_fsdp_unshard_handle;
/* All-gathers the module's group. Synchronous (async false): returns when
 * the full parameters are in the slots, with *handle NULL. Async: issues
 * the all-gather and returns a handle (owned by the caller) whose
 * ts_fsdp_unshard_wait puts them there and frees the handle. The group
 * stays unsharded until ts_fsdp_reshard (or the next reshard the policy
 * makes). A module without a group: nothing to do (handle NULL).
 * TS_ERR_INVALID_ARGUMENT for a non-FSDP module; collective errors. */
TS_API ts_status ts_fsdp_unshard(ts_module *module, bool async, ts_fsdp_unshard_handle **handle);
/* Waits for an async unshard and frees the handle (NULL accepted). */
TS_API ts_status ts_fsdp_unshard_wait(ts_fsdp_unshard_handle *handle);
/* Frees the unsharded parameters of the module's group and puts the
 * shards back in the slots (waits for an all-gather in flight). */
TS_API ts_status ts_fsdp_reshard(ts_module *module);

/* Summons the full parameters of every group in module's subtree (every
 * FSDP module in it): the slots hold full tensors until
 * ts_fsdp_summon_end. With writeback, the end copies each full parameter's
 * rows back into this rank's shard (so edits made while summoned are
 * kept; every rank should make the same edits). Not inside a forward or
 * backward (TS_ERR_STATE). Writeback on a group whose mixed-precision
 * policy gathers in another dtype than its shards' is TS_ERR_UNSUPPORTED.
 * The handle is owned by the caller; _end frees it. */
typedef struct ts_fsdp_summon ts_fsdp_summon;
TS_API ts_status ts_fsdp_summon_full_params(ts_module *module, bool writeback, ts_fsdp_summon **out);
TS_API ts_status ts_fsdp_summon_end(ts_fsdp_summon *s);

/* Wraps the module's named extra method (ts_module_call_method) with the
 * same pre- and post-forward work as its forward. TS_ERR_NOT_FOUND names
 * the method; TS_ERR_INVALID_ARGUMENT for a non-FSDP module. */
TS_API ts_status ts_fsdp_register_forward_method(ts_module *module, const char *name);

/* Explicit prefetch: when `module` runs forward (backward), issue the
 * all-gathers of modules[0..n) (FSDP modules with groups) right after
 * its own. Replaces the implicit order for that module; n = 0 clears it. */
TS_API ts_status ts_fsdp_set_modules_to_forward_prefetch(ts_module *module, int n, ts_module *const *modules);
TS_API ts_status ts_fsdp_set_modules_to_backward_prefetch(ts_module *module, int n, ts_module *const *modules);
/* Turns the implicit forward and backward prefetch on or off for every
 * FSDP module under the root `module` (both on by default). */
TS_API ts_status ts_fsdp_set_implicit_prefetch(ts_module *module, bool forward, bool backward);

/* ------------------------------------ gradient accumulation, microbatches
 * (fully_shard/accum.c; FSDP2's FSDPModule methods, docs/fully_shard.md, "Gradient accumulation and microbatches",
 * docs/design.md, "Gradient division"). By default every backward reduce-scatters each
 * group's gradients and adds them into the shards' .grad, so K backwards
 * without zeroing accumulate ("sync every microbatch": the least memory,
 * K reductions). The two ways to accumulate over K microbatches:
 *
 *   // no sync: unsharded gradients kept, one reduction at the end
 *   for (k = 0; k < K; k++) {
 *       ts_fsdp_set_requires_gradient_sync(model, k == K - 1, true);
 *       loss_k = mean loss of microbatch k, times 1/K; ts_backward(loss_k);
 *   }
 *   ts_optim_step(opt); ts_optim_zero_grad(opt);
 *
 * Without sync, each group keeps its full (unsharded) gradients from the
 * first microbatch's backward until the reduction of the last: on a model
 * sharded over W ranks that is about W times the sharded gradients
 * (ts_fsdp_accumulation_memory; the summary prints it). Under a
 * mixed-precision policy whose reduce_dtype differs from param_dtype the
 * kept gradients are summed in reduce_dtype, as FSDP2's
 * unsharded_accumulated_grad. Any thread that runs the model; not
 * collective (every rank must set the same flags, since they decide which
 * collectives run). Each returns TS_ERR_INVALID_ARGUMENT, naming the
 * module's type, when module is NULL or not an FSDP module. */

/* Whether the next backwards reduce this module's group (and with
 * recurse, the group of every FSDP module below it) across ranks. false:
 * no reduce-scatter and no all-reduce; the unsharded gradients accumulate
 * locally until a backward with sync reduces them all at once. */
TS_API ts_status ts_fsdp_set_requires_gradient_sync(ts_module *module, bool sync, bool recurse);
/* HSDP (a 2-d mesh): false reduce-scatters every backward but skips the
 * all-reduce over the replicate dimension; the reduce-scattered shards are
 * summed across microbatches (reduce_dtype, one shard per group) and
 * all-reduced with the next reduction that all-reduces. On a 1-d mesh (or
 * a replicate dimension of 1) it is accepted and changes nothing, as in
 * FSDP2. */
TS_API ts_status ts_fsdp_set_requires_all_reduce(ts_module *module, bool all_reduce, bool recurse);
/* Whether a group reshards at the end of its backward (default true).
 * false keeps the full parameters until the next reshard: with
 * reshard_after_forward TS_RESHARD_FALSE the next microbatch's forward and
 * backward all-gather nothing. Set it back to true on the last microbatch,
 * since the optimizer step changes the shards, not the full copies. */
TS_API ts_status ts_fsdp_set_reshard_after_backward(ts_module *module, bool reshard, bool recurse);
/* Whether the next backward through the root is the last of the step
 * (default true). false: its end leaves the reduction still in flight
 * (the last group's reduce-scatter: its gradients reach the shards during
 * the next backward, or at the end of the next backward that is the last)
 * and keeps the backward-prefetch order (pipelining, several backwards
 * per forward). Call it on the root (before or after its first forward);
 * a non-root module before the first forward sets only its own state.
 * Do not step the optimizer before a last backward. */
TS_API ts_status ts_fsdp_set_is_last_backward(ts_module *module, bool is_last);
/* Gradients of this module's group (not recursive, as FSDP2) become the
 * sum over every rank (shard and replicate) divided by factor instead of
 * the average: factor 1 sums; a global token count normalizes by tokens.
 * The reduce-scatter divides each input by factor and sums (FSDP2's
 * PREMUL_SUM; AVG when factor is the shard group's size), the HSDP
 * all-reduce sums. TS_ERR_INVALID_ARGUMENT for factor <= 0, NaN or
 * infinite (nothing changes). */
TS_API ts_status ts_fsdp_set_gradient_divide_factor(ts_module *module, double factor);
/* This module's group (not recursive) reduces with SUM collectives only
 * and divides once at the end (by the divide factor, or by the number of
 * ranks to average), for transports whose fast paths only sum. Same values
 * as the default within rounding. */
TS_API ts_status ts_fsdp_set_force_sum_reduction_for_comms(ts_module *module, bool enable);

/* FSDP2's set_separate_reduce_scatter_group: gives the gradient
 * reductions of every FSDP group in module's subtree a process group of
 * their own (the shard group's ranks; enable false goes back to sharing
 * the shard group), so that a reduce-scatter and the next all-gathers
 * progress at the same time instead of one after the other: a copy-free
 * reduce-scatter (the default on one host, docs/design.md D6) then reads and
 * sums on a thread of its own from the post-backward that issues it to
 * the wait that needs it, while the backward computes; the packed ring
 * runs on the communication thread either way. Same results to the bit.
 * Collective over the shard groups: every rank calls it, in the same
 * order relative to its other collectives, outside a forward or
 * backward and with no reduction in flight. Each group made costs one
 * group id (comm.h: at most 65534). Errors: TS_ERR_INVALID_ARGUMENT
 * (NULL, not an FSDP module), TS_ERR_STATE (inside a forward or
 * backward, or a reduction in flight), ts_comm_new_group's. */
TS_API ts_status ts_fsdp_set_separate_reduce_scatter_group(ts_module *module, bool enable);

/* The gradient memory of each accumulation mode, per rank, for the FSDP
 * groups of module's subtree (each group once). */
typedef struct ts_fsdp_accum_memory {
    /* sync every microbatch: the shards' gradients (in the parameters'
     * dtype; views of one buffer per group in the shard layout, so this
     * rank's padded shard elements), which one batch needs too */
    size_t sync_bytes;
    /* no sync: added on top of sync_bytes: every group's unsharded
     * gradients, full size, in param_dtype (reduce_dtype when a
     * mixed-precision policy reduces in another dtype), held from the
     * first microbatch's backward to the last one's reduction */
    size_t no_sync_bytes;
    /* HSDP with requires_all_reduce false: the partial sums of the
     * reduce-scattered shards (reduce dtype) */
    size_t partial_bytes;
} ts_fsdp_accum_memory;
/* Fills *out. TS_ERR_INVALID_ARGUMENT for NULL arguments. Not collective. */
TS_API ts_status ts_fsdp_accumulation_memory(ts_module *module, ts_fsdp_accum_memory *out);

/* Observer of the FSDP lifecycle (tests, logging): called on the calling
 * thread with event "unshard" (an all-gather is issued), "reshard",
 * "pre_forward", "post_forward", "pre_backward" or "post_backward" (a
 * reduce-scatter is issued) and the group's module name ("" for the root,
 * "layers.1"; several names joined by ", " for a grouped call). NULL
 * clears. Process-wide. TS_LOG_LEVEL=debug also logs them. */
typedef void (*ts_fsdp_event_fn)(void *ctx, const char *event, const char *fqn);
TS_API void ts_fsdp_set_event_hook(ts_fsdp_event_fn fn, void *ctx);

/* clip_grad_norm over a sharded model (torch.nn.utils.clip_grad_norm_ on
 * FSDP2's DTensor gradients): the total 2-norm of every gradient of the
 * module tree, as ts_clip_grad_norm computes it (torch's norm of each
 * gradient, then of the stacked norms), each sharded gradient's norm
 * being sqrt of the sum over its shard ranks of the squared local norms
 * (one float64 all-reduce per group; parameters outside groups are counted
 * as they are); then every gradient is multiplied by
 * max_norm / (total + 1e-6) when that is below 1. On one rank the result
 * and the clipped gradients are ts_clip_grad_norm's bits. Collective.
 * Writes the total norm. A non-finite total returns
 * TS_ERR_INVALID_ARGUMENT and changes nothing; TS_ERR_INVALID_ARGUMENT
 * for max_norm < 0 or NaN and NULL arguments; TS_ERR_DTYPE for a gradient
 * that is not float32, float64, bfloat16 or float16; TS_ERR_RELEASED for
 * a released gradient; collective errors. */
TS_API ts_status ts_fsdp_clip_grad_norm(ts_module *module, double max_norm, double *total_norm_out);

/* ----------------------------------------------------- state dicts */

/* Every parameter of the module tree under every name (as
 * ts_module_state_dict), as full tensors gathered from the shards
 * (collective: every rank calls it). rank0_only: only rank 0 of the
 * world gets the tensors (other ranks get an empty dict). The dict is
 * owned by the caller and can be saved with ts_safetensors_save and loaded
 * into an unsharded model. */
TS_API ts_status ts_fsdp_full_state_dict(ts_module *module, bool rank0_only, ts_state_dict **out);
/* Loads full tensors (e.g. from ts_safetensors_load) into a sharded model:
 * each rank copies its rows into its shards; non-FSDP parameters are
 * copied whole. strict and the errors as ts_module_load_state_dict:
 * TS_ERR_SHAPE, then TS_ERR_DTYPE (a tensor whose dtype is not the
 * parameter's is never converted nor reinterpreted), then (strict)
 * TS_ERR_NOT_FOUND; keys are looked up in O(1); nothing is copied on
 * error. TS_ERR_STATE inside a forward or backward. */
TS_API ts_status ts_fsdp_load_full_state_dict(ts_module *module, const ts_state_dict *sd, bool strict);

/* ------------------------------------------------------------ memory
 * (fully_shard/memory.c; docs/memory.md) What one training step holds per
 * rank in tensor storage (TS_MEM_STORAGE: the caching pool's blocks, each
 * rounded up to its size class), predicted before running it by running
 * it: the model's own forward (every module type, user-defined ones
 * included), a cross-entropy loss, the backward, an optimizer step and
 * zero_grad(set_to_none) are played inside
 * ts_device_scope_enter(TS_DEVICE_META) (docs/meta.md), where every op and
 * every fully_shard hook (unshard, prefetch implicit and explicit,
 * reshard after forward or every N, reduce-scatter, HSDP all-reduce,
 * microbatch accumulation settings, persistent parameters, offload,
 * mixed-precision casts, activation checkpointing) takes the pool blocks
 * the real step would take, on the calling thread's meta ledger, and
 * computes nothing ([Note: estimate by meta step] in memory.c). Two steps
 * are played and the second is measured (the optimizer state and the
 * prefetch order then exist, as after a warm-up step). The step is:
 * logits = model(input); cast to float32 when 16-bit; reshaped to
 * (rows, logits' elements / rows), rows being the input's elements for
 * token ids and its elements over its last dim otherwise; cross-entropy
 * against int64 targets (rows); backward; the optimizer's step over the
 * parameters (ts_module_parameters); zero_grad(set_to_none); the logits
 * and loss freed after that. The caller's input and targets are not
 * counted. What is not counted: tensor, autograd and module handles, the
 * caller's own tensors, and (for a model estimated as it is) anything
 * outside the model the caller keeps alive. */
typedef enum ts_fsdp_optim_kind {
    TS_FSDP_OPTIM_NONE = 0,     /* no optimizer state */
    TS_FSDP_OPTIM_SGD,          /* plain SGD: no state */
    TS_FSDP_OPTIM_SGD_MOMENTUM, /* one momentum buffer per parameter */
    TS_FSDP_OPTIM_ADAM,         /* Adam/AdamW: exp_avg, exp_avg_sq and a 0-d step per parameter */
} ts_fsdp_optim_kind;

typedef struct ts_fsdp_memory_options {
    /* The input's shape: (B, T) token ids for a GPT, (B, in) or (B, T, in)
     * for a Sequential. */
    int input_ndim;
    int64_t input_shape[TS_MAX_DIMS];
    /* The input's dtype. TS_DTYPE_KEEP (the default): int64 token ids when
     * the root or one of its direct children is an Embedding (a GPT-like
     * model), else the dtype of the model's first parameter. */
    ts_dtype input_dtype;
    ts_fsdp_optim_kind optim; /* default TS_FSDP_OPTIM_ADAM */
    /* Forward/backward passes per step (gradient accumulation, default 1):
     * with n > 1 the first n - 1 run without gradient sync (every group's
     * ts_fsdp_set_requires_gradient_sync flag false, put back after), so
     * the unsharded gradients are held until the last one reduces. Each
     * pass's logits and loss are freed before the next pass's forward,
     * the last pass's after the optimizer step. */
    int microbatches;
    /* Predict the peak with every block activation-checkpointed (a block:
     * a module below the root whose ts_fully_shard call made a group of
     * its own, not inside another block); false: the blocks as they are.
     * The estimate checkpoints them for its own run and puts their vtables
     * back (the model is left as it was). */
    bool checkpoint_blocks;
    /* Hypothetical sharding, for ts_fsdp_memory_estimate_gpt and
     * ts_fsdp_memory_estimate_build (and a GPT of ts_gpt_new not sharded
     * yet, estimated as ts_fsdp_memory_estimate_gpt of its config): the
     * ranks (default 1, at most 128), implicit prefetch on or off
     * (default on) and the GPT's mixed-precision param_dtype
     * (TS_DTYPE_KEEP: none, the default). Another model not sharded yet
     * is estimated as it is, unsharded: world_size > 1 or a param_dtype
     * is then TS_ERR_UNSUPPORTED. A sharded model's own groups, meshes,
     * policies and prefetch settings are what counts; these are ignored. */
    int world_size;
    bool prefetch;
    ts_dtype param_dtype;
    /* Each rank built the whole model before sharding it (default true):
     * the full parameters' pool blocks stay cached after sharding, each in
     * its size class (pool_peak_bytes). false for a model built deferred
     * (on the meta device, then ts_fsdp_materialize). Ignored for a model
     * that is not sharded. */
    bool eager_init;
} ts_fsdp_memory_options;

/* Defaults as above; input_ndim 0 (the caller must give the shape). */
TS_API ts_fsdp_memory_options ts_fsdp_memory_options_default(void);

/* The prediction, bytes per rank (pool blocks, rounded as the pool rounds). */
typedef struct ts_fsdp_memory_report {
    size_t param_bytes;          /* sharded parameters (the groups' sharded buffers; whole parameters outside groups) */
    size_t grad_bytes;           /* the shards' gradients after backward */
    size_t optim_bytes;          /* optimizer state */
    size_t group_bytes;          /* the largest group while unsharded (its full parameters, in param_dtype) */
    size_t all_gather_bytes;     /* the largest all-gather output buffer (the padded group) */
    int groups_in_flight;        /* the most groups below the root unsharded or being all-gathered at once during
                                  the measured step (the one computing and the one prefetched: 2 with prefetch) */
    int n_blocks;                /* blocks: groups below the root, not nested (checkpoint_blocks); 0 unsharded */
    size_t block_act_bytes;      /* what one block's forward adds and keeps for backward, its output included:
                                  the mean over the blocks, measured with no block checkpointed */
    size_t block_act_ckpt_bytes; /* the same with every block checkpointed (about its output only) */
    size_t act_bytes;            /* what the whole forward (model, cast, loss) keeps for backward, no block
                                  checkpointed (the unsharded groups' buffers not counted) */
    size_t act_ckpt_bytes;       /* the same with every block checkpointed */
    size_t forward_peak_bytes;   /* the storage peak during forward (model's storages included) */
    size_t backward_peak_bytes;  /* the storage peak during backward */
    size_t peak_bytes;           /* the step's peak: the larger of the two and of the optimizer step */
    bool checkpointed;           /* the peaks above are with checkpointed blocks (all, or those the model has) */
    int64_t n_params;            /* elements of the full parameters (a tied weight once) */
    /* The whole process (docs/memory.md), from the tensors above: */
    size_t pool_peak_bytes; /* what the caching pool holds after start-up and the step (TS_MEM_POOL): per size
                                  class, the most blocks of it live at once, cached free blocks included, so at
                                  least peak_bytes; with eager_init the full parameters' blocks built at start-up
                                  count, cached in their classes (the ledger's model of the pool: docs/meta.md) */
    size_t floor_bytes;     /* the process floor (comm.h: ts_process_floor_bytes) when estimated */
    size_t rss_peak_bytes;  /* the predicted peak resident set (VmHWM) of the rank: floor_bytes +
                                  pool_peak_bytes. Not counted: tensor, autograd and module handles (0.3 MiB on
                                  GPT-2-small), the caller's own buffers (token ids), the pool's blocks' untouched
                                  tails (counted whole: an upper bound) */
} ts_fsdp_memory_report;

/* Sets r's floor_bytes and rss_peak_bytes = floor_bytes + pool_peak_bytes
 * (or peak_bytes if larger): the process from the tensors' prediction,
 * for another floor than the one measured (ts_process_floor_bytes; a
 * floor measured on another host, or 0 to compare tensors only). NULL: no
 * effect. */
TS_API void ts_fsdp_memory_set_floor(ts_fsdp_memory_report *r, size_t floor_bytes);

/* Predicts the per-rank storage of one training step of `model` on an
 * input of o->input_shape (see above for the step). Any module tree:
 * sharded with ts_fully_shard (its groups, meshes, policies, prefetch
 * settings and microbatch flags count, HSDP included: each rank predicts
 * its own), or not sharded (estimated as it is; a GPT of ts_gpt_new as
 * ts_fsdp_memory_estimate_gpt of its config); on the CPU or on the meta
 * device (deferred, before ts_fsdp_materialize: the same report). Not
 * collective: it runs no collective and needs no peer. Changes nothing in
 * the model: the parameters' gradients, fully_shard's state and the
 * blocks' vtables are as before, no generator advances (meta draws
 * nothing), and training afterwards gives the same bits as without it.
 * It resets the calling thread's meta ledger (ts_meta_reset) and the
 * process-wide FSDP event hook sees its events. Writes *out only on
 * success. Errors: TS_ERR_INVALID_ARGUMENT for NULL or bad options
 * (naming them); TS_ERR_STATE inside a forward or backward, or when a
 * group is unsharded, reducing or holds unsharded gradients (microbatches
 * without gradient sync under way: estimate between steps); the model's
 * own errors for an input it refuses (TS_ERR_SHAPE, TS_ERR_DTYPE, ...,
 * with its message); TS_ERR_UNSUPPORTED for world_size > 1 or a
 * param_dtype on a model that is not sharded and not a GPT;
 * TS_ERR_NO_MEMORY. One thread at a time per model, as training. */
TS_API ts_status ts_fsdp_memory_estimate(ts_module *model, const ts_fsdp_memory_options *o, ts_fsdp_memory_report *out);
/* Builds and shards the model to estimate, for one rank of a job of
 * o->world_size ranks: called inside a meta scope with a 1-d mesh over a
 * virtual world of that many ranks (this process is its rank 0; no peer
 * exists and any collective on it fails with TS_ERR_UNSUPPORTED). Give
 * the mesh to ts_fully_shard (ts_fsdp_options.mesh; a 2-d HSDP mesh
 * cannot be made over it). Writes the model (owned by the estimate, which
 * frees it) to *model_out. */
typedef ts_status (*ts_fsdp_build_fn)(void *ctx, ts_mesh *mesh, ts_module **model_out);
/* Predicts one rank of a job of o->world_size ranks (at most 128) from one
 * process: calls build(ctx, mesh, &model) as above (nothing real is
 * allocated: the model is on the meta device), estimates it as
 * ts_fsdp_memory_estimate (o's world_size and param_dtype are the
 * build's business) and frees it. Errors: TS_ERR_INVALID_ARGUMENT for
 * NULL or bad options, TS_ERR_UNSUPPORTED for more than 128 ranks, the
 * build's status, ts_fsdp_memory_estimate's. */
TS_API ts_status ts_fsdp_memory_estimate_build(ts_fsdp_build_fn build, void *ctx, const ts_fsdp_memory_options *o,
                                               ts_fsdp_memory_report *out);
/* The same for a GPT not built yet: the model ts_gpt_new(cfg) makes, in
 * train mode, each block its own group and the root the rest (as
 * ts_fsdp_apply_by_type(model, "Block") then ts_fully_shard(model)),
 * over o->world_size ranks, with o->param_dtype as the mixed-precision
 * param_dtype and o->prefetch as implicit prefetch, built on the meta
 * device through ts_fsdp_memory_estimate_build. Errors as above;
 * TS_ERR_INVALID_ARGUMENT for a config ts_gpt_new would refuse (naming
 * its sizes) or an input that is not (B, T); TS_ERR_SHAPE for T over
 * block_size. */
TS_API ts_status ts_fsdp_memory_estimate_gpt(const ts_gpt_config *cfg, const ts_fsdp_memory_options *o,
                                             ts_fsdp_memory_report *out);

#ifdef __cplusplus
}
#endif
#endif /* TS_FULLY_SHARD_H */
