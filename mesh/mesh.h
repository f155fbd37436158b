/*
 * Device meshes (docs/design.md "DeviceMesh and DTensor"; PyTorch's init_device_mesh).
 *
 * A mesh arranges the ranks of a world in an n-dimensional array, row-major
 * (rank r has coordinates r unravelled over the shape, as
 * torch.arange(W).view(shape)), with a name per dim. For each dim, the ranks
 * that share every other coordinate form a process group; a mesh keeps the
 * groups this rank belongs to, one per dim, created once by ts_mesh_new and
 * reused by every query and slice.
 *
 * Lifetime rules: a mesh is owned by the caller and freed with
 * ts_mesh_free. Groups returned by ts_mesh_group are borrowed: they live
 * as long as the last mesh sharing them (a slice shares its parent's
 * group, and keeps it alive after the parent is freed). The world given
 * to ts_mesh_new must outlive every mesh made from it. A mesh and the
 * meshes sliced from it may be used from one thread at a time; the
 * collective calls (ts_mesh_new, ts_mesh_flatten) follow comm.h's rules:
 * every rank of the world calls them, in the same order relative to the
 * world's other collectives, with the same arguments.
 *
 * Devices: only "cpu".
 */
#ifndef TS_MESH_H
#define TS_MESH_H

#include "base/base.h"
#include "comm/comm.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TS_MESH_MAX_DIMS 8  /* dims of a mesh */
#define TS_MESH_NAME_MAX 63 /* characters of a dim name (without the NUL) */

typedef struct ts_mesh ts_mesh;

/* Makes a mesh of `ndim` dims of sizes shape[0..ndim) named
 * names[0..ndim) over `world` (NULL: ts_dist_world(), which is the
 * one-rank group when no world is initialized; a one-rank mesh then needs
 * a shape of all ones). Collective over the world: for each dim in order,
 * it creates every group of that dim (ts_comm_new_group, in row-major
 * order of their first rank) and keeps the one containing this rank; a 1-d
 * mesh, and any mesh over a one-rank world, uses the world itself. The mesh
 * goes to *out (owned by the caller) only on success.
 * Errors (TS_ERR_INVALID_ARGUMENT, with a message naming the values, on
 * every rank before any exchange): NULL arguments, ndim outside
 * [1, TS_MESH_MAX_DIMS], a size < 1, a product of sizes different from the
 * world's size, a device other than "cpu" (TS_ERR_UNSUPPORTED), NULL,
 * empty, too long or duplicate names; then ts_comm_new_group's errors
 * (nothing is kept). TS_ERR_NO_MEMORY. Any thread, one at a time per
 * world. */
TS_API ts_status ts_mesh_new(ts_comm *world, const char *device, int ndim, const int64_t *shape,
                             const char *const *names, ts_mesh **out);
/* Frees a mesh and the groups no other mesh shares. Accepts NULL. Every
 * request on its groups must have completed. */
TS_API void ts_mesh_free(ts_mesh *m);

/* Number of dims (>= 1). */
/* For a NULL mesh the accessors below return a neutral value: ndim 0;
 * device_type, dim_name and group NULL; dim_index, size, dim_size and
 * get_local_rank -1; coordinate writes nothing. */
TS_API int ts_mesh_ndim(const ts_mesh *m);
/* The world communicator the mesh was made over (borrowed: the mesh does
 * not own it; the one ts_mesh_new was given, or the process world or
 * one-rank group it took for NULL). NULL for NULL. */
TS_API ts_comm *ts_mesh_world(const ts_mesh *m);
/* "cpu". Borrowed, lives as long as the mesh. */
TS_API const char *ts_mesh_device_type(const ts_mesh *m);
/* The name of dim `dim`, borrowed; NULL (with TS_ERR_INDEX as last error)
 * when dim is out of range. */
TS_API const char *ts_mesh_dim_name(const ts_mesh *m, int dim);
/* The index of the dim named `name`; -1 (TS_ERR_NOT_FOUND as last error,
 * naming it and the mesh's dims) when there is none. */
TS_API int ts_mesh_dim_index(const ts_mesh *m, const char *name);
/* The size of dim `name`, or the number of ranks of the mesh when name is
 * NULL; -1 (TS_ERR_NOT_FOUND) for an unknown name. */
TS_API int64_t ts_mesh_size(const ts_mesh *m, const char *name);
/* The size of dim `dim`; -1 (TS_ERR_INDEX) out of range. */
TS_API int64_t ts_mesh_dim_size(const ts_mesh *m, int dim);
/* This rank's index within dim `name` (its rank in that dim's group); -1
 * (TS_ERR_NOT_FOUND) for an unknown name. NULL is accepted for a 1-d mesh
 * only (TS_ERR_INVALID_ARGUMENT otherwise). */
TS_API int ts_mesh_get_local_rank(const ts_mesh *m, const char *name);
/* Writes this rank's coordinate along each dim into
 * coords_out[0..ts_mesh_ndim(m)). */
TS_API void ts_mesh_coordinate(const ts_mesh *m, int *coords_out);
/* The process group of dim `name` that contains this rank (NULL name: the
 * only dim of a 1-d mesh). Borrowed (see the lifetime rules). NULL with
 * TS_ERR_NOT_FOUND / TS_ERR_INVALID_ARGUMENT as last error. */
TS_API ts_comm *ts_mesh_group(const ts_mesh *m, const char *name);

/* A 1-d mesh of dim `name` of m, sharing its group (no collective, no new
 * group). Owned by the caller; independent of m's lifetime. Errors:
 * TS_ERR_NOT_FOUND for an unknown name, TS_ERR_INVALID_ARGUMENT for NULL,
 * TS_ERR_NO_MEMORY. */
TS_API ts_status ts_mesh_slice(const ts_mesh *m, const char *name, ts_mesh **out);
/* A 1-d mesh named new_name whose dim is the dims names[0..ndims) of m
 * merged, in row-major order (they must be distinct and given in m's dim
 * order). Collective over the world m was made on (every rank calls it;
 * ranks holding different slices of one mesh may call it on their
 * slices): creates every group of the merged dim, keeping this rank's;
 * merging a single dim shares its group instead (no collective). Errors:
 * TS_ERR_INVALID_ARGUMENT (NULL, ndims outside [1, ts_mesh_ndim(m)], names
 * out of order or repeated, empty or too long new_name), TS_ERR_NOT_FOUND
 * for an unknown name, ts_comm_new_group's errors, TS_ERR_NO_MEMORY. */
TS_API ts_status ts_mesh_flatten(const ts_mesh *m, int ndims, const char *const *names, const char *new_name,
                                 ts_mesh **out);

#ifdef __cplusplus
}
#endif
#endif /* TS_MESH_H */
