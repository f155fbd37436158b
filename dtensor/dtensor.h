/*
 * Distributed tensors (docs/design.md, "DeviceMesh and DTensor"; PyTorch's DTensor).
 *
 * A DTensor is this rank's local tensor plus the metadata that says what
 * it is a part of: a device mesh, one placement per mesh dim, and the
 * global shape. Placements:
 *   Shard(d)      the global tensor is split along tensor dim d over the
 *                 mesh dim, torch.chunk style: each of the k ranks of the
 *                 mesh dim gets ceil(n / k) rows, trailing ranks fewer or
 *                 none (n=5, k=4: 2, 2, 1, 0);
 *   Replicate     every rank of the mesh dim holds the same values;
 *   Partial(op)   every rank holds a partial value; the global value is
 *                 the sum (or average) over the mesh dim.
 * Several mesh dims may shard the same tensor dim (nested chunking, mesh
 * dim 0 first, as PyTorch does).
 *
 * Lifetime rules: a DTensor is owned by the caller and freed with
 * ts_dtensor_free. It holds a reference to its local tensor. The mesh is
 * borrowed and must outlive the DTensor. Operations that communicate are
 * collective over the mesh (every rank calls them in the same order with
 * the same placements) and follow comm.h's rules. DTensor operations are
 * not recorded by autograd (they run with grad mode off; local tensors
 * they make do not require grad). A DTensor is used from one thread at a
 * time, the thread that uses its mesh.
 *
 * Errors: every fallible function returns a ts_status and leaves a detail
 * in ts_last_error() that names the placements (as ts_placement_str
 * writes them) and the shapes that do not fit. Output parameters are
 * written only on success.
 */
#ifndef TS_DTENSOR_H
#define TS_DTENSOR_H

#include "base/base.h"
#include "comm/comm.h"
#include "mesh/mesh.h"
#include "tensor/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum ts_placement_kind {
    TS_PLACEMENT_REPLICATE = 0,
    TS_PLACEMENT_SHARD = 1,
    TS_PLACEMENT_PARTIAL = 2,
} ts_placement_kind;

typedef struct ts_placement {
    ts_placement_kind kind;
    int dim;         /* Shard: the tensor dim (>= 0) */
    ts_reduce_op op; /* Partial: TS_REDUCE_SUM or TS_REDUCE_AVG (MAX, MIN also work) */
} ts_placement;

static inline ts_placement ts_shard(int dim) { return (ts_placement){TS_PLACEMENT_SHARD, dim, TS_REDUCE_SUM}; }
static inline ts_placement ts_replicate(void) { return (ts_placement){TS_PLACEMENT_REPLICATE, 0, TS_REDUCE_SUM}; }
static inline ts_placement ts_partial(ts_reduce_op op) { return (ts_placement){TS_PLACEMENT_PARTIAL, 0, op}; }

/* Writes "Shard(0)", "Replicate()", "Partial(sum)" or "Partial(avg)" into
 * buf (always NUL-terminated, truncated to len; nothing written when len is
 * 0); returns buf. Invalid kinds or ops are written with their number. */
TS_API char *ts_placement_str(ts_placement p, char *buf, size_t len);

/* torch.chunk of n rows into k parts: part i starts at *start and has
 * *len rows (ceil(n / k) per part, trailing parts short or empty; an empty
 * part starts at n). n = 17, k = 8: 3, 3, 3, 3, 3, 2, 0, 0. Either output
 * may be NULL. */
TS_API void ts_chunk_range(int64_t n, int k, int i, int64_t *start, int64_t *len);

typedef struct ts_dtensor ts_dtensor;

/* Splits `full` (the whole tensor, the same on every rank) by
 * placements[0..ts_mesh_ndim(mesh)) into a new DTensor holding a
 * contiguous copy of this rank's part. No communication when src_rank < 0
 * (every rank passes its full tensor). With src_rank >= 0 (a rank of the
 * mesh, numbered row-major as in ts_mesh_new), only that rank's `full` is
 * read and broadcast first (collective); every other rank passes a tensor
 * of the same shape and dtype, whose contents are ignored and left
 * unchanged; the dtype and shape are agreed first, and if any rank's
 * differ from the source's, every rank fails (TS_ERR_SHAPE or
 * TS_ERR_DTYPE, naming both). The DTensor goes to *out (owned by the
 * caller). Errors: NULL arguments, Partial placements, an unknown
 * placement kind, a src_rank outside the mesh
 * (TS_ERR_INVALID_ARGUMENT); a Shard dim outside the tensor's dims
 * (TS_ERR_INDEX); TS_ERR_NO_MEMORY; the collectives' errors. */
TS_API ts_status ts_distribute_tensor(ts_tensor *full, const ts_mesh *mesh, const ts_placement *placements,
                                      int src_rank, ts_dtensor **out);

/* Wraps this rank's `local` (retained, not copied) with placements over
 * mesh (Partial allowed) and the global shape (global_ndim dims; NULL:
 * inferred as PyTorch does for even shards, each Shard(d) multiplying dim
 * d by the mesh dim's size). The local shape must be this rank's chunk of
 * the global shape (TS_ERR_SHAPE naming both, also for a global_ndim other
 * than local's). Other errors: NULL arguments or an unknown placement
 * (TS_ERR_INVALID_ARGUMENT), a Shard dim outside local's dims
 * (TS_ERR_INDEX), TS_ERR_NO_MEMORY. No communication. */
TS_API ts_status ts_dtensor_from_local(ts_tensor *local, const ts_mesh *mesh, const ts_placement *placements,
                                       int global_ndim, const int64_t *global_shape, ts_dtensor **out);

/* This rank's local tensor (borrowed, lives as long as the DTensor); NULL
 * for NULL. */
TS_API ts_tensor *ts_dtensor_local(const ts_dtensor *d);
/* A new reference to the local tensor (torch's to_local()), released by
 * the caller with ts_tensor_free; NULL for NULL. */
TS_API ts_tensor *ts_dtensor_to_local(const ts_dtensor *d);
/* The whole tensor on every rank in *out (a new reference
 * owned by the caller): gathers Shard dims, reduces Partial ones, as
 * redistributing to all-Replicate does (when d is all-Replicate already,
 * it is d's local tensor itself). Collective. Errors: NULL arguments
 * (TS_ERR_INVALID_ARGUMENT), TS_ERR_NO_MEMORY, the collectives'. */
TS_API ts_status ts_dtensor_full_tensor(const ts_dtensor *d, ts_tensor **out);
/* A new DTensor with the same global value under new placements, in
 * *out (owned by the caller; its local tensor is a new contiguous tensor,
 * or d's own when nothing changes; d is not modified). Collective. Per
 * mesh dim: Shard -> Replicate all-gathers; Partial -> Replicate
 * all-reduces; Partial -> Shard reduce-scatters; Replicate -> Shard
 * chunks locally (no communication); Shard(i) -> Shard(j) gathers then
 * chunks. Gathers and reductions run from the last mesh dim to the first,
 * chunks from the first to the last; a nested Shard whose outer chunking
 * changes is gathered first and chunked again. Errors: Replicate or Shard
 * -> Partial, and Partial -> Partial of another op (TS_ERR_UNSUPPORTED);
 * NULL arguments or an unknown placement (TS_ERR_INVALID_ARGUMENT); a
 * Shard dim outside the tensor's dims (TS_ERR_INDEX); TS_ERR_NO_MEMORY;
 * the collectives' errors. */
TS_API ts_status ts_dtensor_redistribute(const ts_dtensor *d, const ts_placement *placements, ts_dtensor **out);

/* The mesh (borrowed, as given at creation); NULL for NULL. */
TS_API const ts_mesh *ts_dtensor_mesh(const ts_dtensor *d);
/* ts_mesh_ndim(mesh) placements, borrowed; NULL for NULL. */
TS_API const ts_placement *ts_dtensor_placements(const ts_dtensor *d);
/* Number of dims of the global tensor; -1 for NULL. */
TS_API int ts_dtensor_ndim(const ts_dtensor *d);
/* The global shape (ndim sizes, borrowed); NULL for NULL. */
TS_API const int64_t *ts_dtensor_shape(const ts_dtensor *d);
/* Offset of this rank's local tensor in the global tensor along `dim`
 * (0 for unsharded dims). -1 with TS_ERR_INDEX (dim outside the global
 * dims) or TS_ERR_INVALID_ARGUMENT (NULL) as last error. */
TS_API int64_t ts_dtensor_local_offset(const ts_dtensor *d, int dim);
/* Frees the DTensor and its reference to the local tensor. NULL is
 * accepted. */
TS_API void ts_dtensor_free(ts_dtensor *d);

#ifdef __cplusplus
}
#endif
#endif /* TS_DTENSOR_H */
