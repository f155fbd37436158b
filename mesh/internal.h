/* Internal helpers of the mesh layer. */
#ifndef TS_MESH_INTERNAL_H
#define TS_MESH_INTERNAL_H

#include "base/internal.h"
#include "mesh/mesh.h"

#endif
