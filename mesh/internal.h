/* Internal helpers of the mesh layer. */
#ifndef TS_MESH_INTERNAL_H
#define TS_MESH_INTERNAL_H

#include "base/internal.h"
#include "mesh/mesh.h"

/* Name before the doors of issue 22 §3 (public in mesh/mesh.h); removed
 * once tools/house_renames.sed has renamed the call sites. */
#define ts_mesh_world ts_mesh_world

#endif
