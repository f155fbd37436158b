/* Internal: CPUOffloadPolicy's per-group state and staging copies
 * (fully_shard/offload.c; fully_shard.h, ts_offload_policy). Not installed. */
#ifndef TS_FULLY_SHARD_OFFLOAD_INTERNAL_H
#define TS_FULLY_SHARD_OFFLOAD_INTERNAL_H

#include "fully_shard/fully_shard.h"

typedef struct ts__fsdp_offload {
    bool on;  /* the group was sharded with an offload policy */
    bool pin; /* its pin_memory */
    /* the host shard gradients: one 1-d buffer of shard_numel elements
     * (pinned when pin), made at the first reduction; each parameter's
     * gradient is a view of its segment */
    ts_tensor *grad_host;
    /* the host landing buffer of the reduced gradients (shard_numel,
     * pinned when pin) when they are added to existing gradients */
    ts_tensor *stage;
    /* the staging copies made (ts_fsdp_offload_stats) */
    uint64_t h2d_copies, h2d_bytes, d2h_copies, d2h_bytes;
} ts__fsdp_offload;

/* The copy of a host shard to the compute device before the all-gather
 * (H2D; CUDA's cudaMemcpyAsync host-to-device, FSDP2's
 * sharded_param.to(device, non_blocking=True)) and of a reduced gradient
 * back to the host (D2H). On TS_DEVICE_CPU both sides are host memory:
 * it is a memcpy between the two buffers, counted and traced
 * ("fsdp.h2d", "fsdp.d2h", cat "copy"). */
void ts__fsdp_offload_h2d(ts__fsdp_offload *o, void *dev_dst, const void *host_src, size_t bytes);
void ts__fsdp_offload_d2h(ts__fsdp_offload *o, void *host_dst, const void *dev_src, size_t bytes);
/* The H2D copy under a mixed-precision policy: n elements converted from
 * the host shard's dtype to the all-gather's on their way (one pass, as
 * FSDP2's copy then cast); counts the bytes written to the device. */
void ts__fsdp_offload_h2d_cast(ts__fsdp_offload *o, void *dev_dst, ts_dtype dev_dtype, const void *host_src,
                               ts_dtype host_dtype, int64_t n);
/* A new 1-d host buffer of n elements for the group (pinned when o->pin). */
ts_status ts__fsdp_offload_host_buffer(const ts__fsdp_offload *o, ts_dtype dtype, int64_t n, ts_tensor **out);
/* Makes an existing host buffer pinned when o->pin (the sharded parameters). */
ts_status ts__fsdp_offload_place(const ts__fsdp_offload *o, ts_tensor *host);
/* Frees the group's offload buffers. */
void ts__fsdp_offload_fini(ts__fsdp_offload *o);

/* The group-level steps (fully_shard/offload.c), called from
 * param_group.c when g->off.on:
 *  - ts__fsdp_offload_init: at group creation, after the shards are made:
 *    checks that every parameter is on the CPU device (FSDP2's lazy-init
 *    check; TS_ERR_INVALID_ARGUMENT naming them) and pins the sharded
 *    buffer when asked;
 *  - ts__fsdp_offload_copy_in: before the all-gather: copies the host
 *    shard into this rank's block of the all-gather output (H2D) and
 *    returns that block as the all-gather's input (*in_out, a new
 *    reference the caller frees); under a mixed-precision policy it casts
 *    the shard into g->ag_in instead (H2D with the cast) and returns
 *    g->ag_in itself (owned by the group until the all-gather ends);
 *  - ts__fsdp_offload_grads_out: after the reduce-scatter (and HSDP's
 *    all-reduce): copies each reduced gradient segment to the host (D2H):
 *    straight into the host gradient buffer, whose segment becomes the
 *    shard's .grad, when the shard has no gradient; else into the host
 *    staging buffer, which then replaces g->rs_out, so that the caller
 *    adds it into the existing host gradient. */
typedef struct fsdp_group fsdp_group;
ts_status ts__fsdp_offload_init(fsdp_group *g, const ts_offload_policy *policy, const char *fn);
ts_status ts__fsdp_offload_copy_in(fsdp_group *g, ts_tensor **in_out);
ts_status ts__fsdp_offload_grads_out(fsdp_group *g);

#endif
