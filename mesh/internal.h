/* Internal helpers of the mesh layer. */
#ifndef TS_MESH_INTERNAL_H
#define TS_MESH_INTERNAL_H

#include "base/internal.h"
#include "mesh/mesh.h"

/* The world the mesh was made over (borrowed). */
ts_comm *ts__mesh_world(const ts_mesh *m);

#endif
