/* Device meshes (mesh.h). Every mesh remembers the layout of the mesh
 * ts_mesh_new made (the root): its shape and this rank's coordinate in it.
 * Each of its own dims is a set of root dims (a bit mask: one bit for the
 * dims of a root mesh and its slices, several after a flatten); the group
 * of a dim is the ranks sharing every root coordinate outside the set,
 * ordered row-major over the set, so this rank's index in the group is its
 * row-major index over the set. Groups are reference counted and shared
 * between a mesh, its slices and single-dim flattens. */
#include "mesh/internal.h"

#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

typedef struct mesh_group {
    ts_comm *c;
    atomic_int refs;
    bool owned; /* made by ts_comm_new_group (false: the world itself) */
} mesh_group;

struct ts_mesh {
    ts_comm *world;
    int ndim;
    int64_t shape[TS_MESH_MAX_DIMS];
    char names[TS_MESH_MAX_DIMS][TS_MESH_NAME_MAX + 1];
    unsigned mask[TS_MESH_MAX_DIMS];
    int coord[TS_MESH_MAX_DIMS];
    mesh_group *grp[TS_MESH_MAX_DIMS];
    int root_ndim;
    int64_t root_shape[TS_MESH_MAX_DIMS];
    int root_coord[TS_MESH_MAX_DIMS];
};

static void group_unref(mesh_group *g)
{
    if (!g) return;
    if (atomic_fetch_sub(&g->refs, 1) == 1) {
        if (g->owned) ts_comm_free(g->c);
        ts__free(TS_MEM_COMM, g);
    }
}

static mesh_group *group_ref(mesh_group *g)
{
    atomic_fetch_add(&g->refs, 1);
    return g;
}

void ts_mesh_free(ts_mesh *m)
{
    if (!m) return;
    for (int d = 0; d < m->ndim; d++) group_unref(m->grp[d]);
    ts__free(TS_MEM_COMM, m);
}

static ts_status check_name(const char *what, int i, const char *name)
{
    if (!name) return ts_error(TS_ERR_INVALID_ARGUMENT, "mesh: %s %d is NULL", what, i);
    if (!name[0]) return ts_error(TS_ERR_INVALID_ARGUMENT, "mesh: %s %d is empty", what, i);
    if (strlen(name) > TS_MESH_NAME_MAX)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "mesh: %s %d ('%.20s...') is longer than %d characters", what, i, name,
                        TS_MESH_NAME_MAX);
    return TS_OK;
}

/* Writes "(a, b, c)" into buf. */
static void fmt_shape(char *buf, size_t cap, int n, const int64_t *shape)
{
    size_t k = 0;
    k += (size_t)snprintf(buf, cap, "(");
    for (int i = 0; i < n && k < cap; i++)
        k += (size_t)snprintf(buf + k, cap - k, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (k < cap) snprintf(buf + k, cap - k, ")");
}

/* Makes (collectively over m->world) the group of the root dims in `mask`
 * and returns the one containing this rank in *out. */
static ts_status make_group(const ts_mesh *m, unsigned mask, mesh_group **out)
{
    int W = ts_comm_size(m->world);
    int64_t stride[TS_MESH_MAX_DIMS];
    int64_t n = 1, s = 1;
    for (int d = m->root_ndim - 1; d >= 0; d--) {
        stride[d] = s;
        s *= m->root_shape[d];
        if (mask & (1u << d)) n *= m->root_shape[d];
    }
    mesh_group *g = ts__calloc(TS_MEM_COMM, 1, sizeof *g);
    if (!g) return ts_error(TS_ERR_NO_MEMORY, "mesh: out of memory");
    atomic_init(&g->refs, 1);
    if (n == W) { /* the whole world: reuse it */
        g->c = m->world;
        *out = g;
        return TS_OK;
    }
    int *ranks = ts__calloc(TS_MEM_COMM, (size_t)n, sizeof *ranks);
    if (!ranks) {
        ts__free(TS_MEM_COMM, g);
        return ts_error(TS_ERR_NO_MEMORY, "mesh: out of memory");
    }
    ts_status st = TS_OK;
    for (int base = 0; base < W && st == TS_OK; base++) {
        bool first = true; /* zero on every dim of the set */
        for (int d = 0; d < m->root_ndim; d++)
            if ((mask & (1u << d)) && (base / stride[d]) % m->root_shape[d] != 0) first = false;
        if (!first) continue;
        for (int64_t k = 0; k < n; k++) {
            int64_t rest = k, r = base;
            for (int d = m->root_ndim - 1; d >= 0; d--) {
                if (!(mask & (1u << d))) continue;
                r += (rest % m->root_shape[d]) * stride[d];
                rest /= m->root_shape[d];
            }
            ranks[k] = (int)r;
        }
        ts_comm *c = NULL;
        st = ts_comm_new_group(m->world, (int)n, ranks, &c);
        if (st == TS_OK && c) {
            if (g->c) {
                ts_comm_free(c);
                st = ts_error(TS_ERR_INTERNAL, "mesh: rank in two groups of one dim");
            } else {
                g->c = c;
                g->owned = true;
            }
        }
    }
    ts__free(TS_MEM_COMM, ranks);
    if (st == TS_OK && !g->c) st = ts_error(TS_ERR_INTERNAL, "mesh: rank in no group of a dim");
    if (st != TS_OK) {
        if (g->owned) ts_comm_free(g->c);
        ts__free(TS_MEM_COMM, g);
        return st;
    }
    *out = g;
    return TS_OK;
}

/* This rank's row-major index over the root dims in mask. */
static int index_in(const ts_mesh *m, unsigned mask)
{
    int64_t idx = 0;
    for (int d = 0; d < m->root_ndim; d++)
        if (mask & (1u << d)) idx = idx * m->root_shape[d] + m->root_coord[d];
    return (int)idx;
}

ts_status ts_mesh_new(ts_comm *world, const char *device, int ndim, const int64_t *shape, const char *const *names,
                      ts_mesh **out)
{
    if (!out || !shape || !names || !device) return ts_error(TS_ERR_INVALID_ARGUMENT, "mesh_new: NULL argument");
    if (strcmp(device, "cpu") != 0)
        return ts_error(TS_ERR_UNSUPPORTED, "mesh_new: unknown device type '%s' (only \"cpu\")", device);
    if (ndim < 1 || ndim > TS_MESH_MAX_DIMS)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "mesh_new: ndim %d outside [1, %d]", ndim, TS_MESH_MAX_DIMS);
    if (!world) world = ts_dist_world();
    int W = ts_comm_size(world);
    char sbuf[256];
    int64_t prod = 1;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] < 1 || shape[d] > W) {
            fmt_shape(sbuf, sizeof sbuf, ndim, shape);
            return ts_error(TS_ERR_INVALID_ARGUMENT, "mesh_new: size %lld of dim %d of shape %s is not in [1, %d]",
                            (long long)shape[d], d, sbuf, W);
        }
        prod *= shape[d];
        if (prod > W) break;
    }
    if (prod != W) {
        fmt_shape(sbuf, sizeof sbuf, ndim, shape);
        return ts_error(TS_ERR_INVALID_ARGUMENT, "mesh_new: shape %s has %s%lld ranks but the world has %d", sbuf,
                        prod > W ? "more than " : "", (long long)prod, W);
    }
    for (int d = 0; d < ndim; d++) {
        ts_status st = check_name("dim name", d, names[d]);
        if (st != TS_OK) return st;
        for (int e = 0; e < d; e++)
            if (strcmp(names[d], names[e]) == 0)
                return ts_error(TS_ERR_INVALID_ARGUMENT, "mesh_new: dims %d and %d have the same name '%s'", e, d,
                                names[d]);
    }
    ts_mesh *m = ts__calloc(TS_MEM_COMM, 1, sizeof *m);
    if (!m) return ts_error(TS_ERR_NO_MEMORY, "mesh_new: out of memory");
    m->world = world;
    m->ndim = m->root_ndim = ndim;
    int r = ts_comm_rank(world);
    for (int d = ndim - 1; d >= 0; d--) {
        m->shape[d] = m->root_shape[d] = shape[d];
        m->root_coord[d] = m->coord[d] = (int)(r % shape[d]);
        r = (int)(r / shape[d]);
        m->mask[d] = 1u << d;
        snprintf(m->names[d], sizeof m->names[d], "%s", names[d]);
    }
    for (int d = 0; d < ndim; d++) {
        ts_status st = make_group(m, m->mask[d], &m->grp[d]);
        if (st != TS_OK) {
            ts_mesh_free(m); /* grp[d..] are NULL */
            return st;
        }
    }
    *out = m;
    return TS_OK;
}

int ts_mesh_ndim(const ts_mesh *m) { return m ? m->ndim : 0; }

const char *ts_mesh_device_type(const ts_mesh *m) { return m ? "cpu" : NULL; }

const char *ts_mesh_dim_name(const ts_mesh *m, int dim)
{
    if (!m) return NULL;
    if (dim < 0 || dim >= m->ndim) {
        ts_error(TS_ERR_INDEX, "mesh: dim %d out of range for a %d-d mesh", dim, m->ndim);
        return NULL;
    }
    return m->names[dim];
}

int ts_mesh_dim_index(const ts_mesh *m, const char *name)
{
    if (!m) {
        ts_error(TS_ERR_INVALID_ARGUMENT, "mesh: NULL mesh");
        return -1;
    }
    if (name)
        for (int d = 0; d < m->ndim; d++)
            if (strcmp(m->names[d], name) == 0) return d;
    char buf[TS_MESH_MAX_DIMS * (TS_MESH_NAME_MAX + 4) + 4];
    size_t k = 0;
    for (int d = 0; d < m->ndim; d++)
        k += (size_t)snprintf(buf + k, sizeof buf - k, "%s'%s'", d ? ", " : "", m->names[d]);
    ts_error(TS_ERR_NOT_FOUND, "mesh: no dim named '%s' (dims: %s)", name ? name : "(null)", buf);
    return -1;
}

/* The dim `name` names, or the only dim for NULL on a 1-d mesh; -1 with
 * the error set otherwise. */
static int dim_of(const ts_mesh *m, const char *name)
{
    if (name) return ts_mesh_dim_index(m, name);
    if (m->ndim == 1) return 0;
    ts_error(TS_ERR_INVALID_ARGUMENT, "mesh: a dim name is required for a %d-d mesh", m->ndim);
    return -1;
}

int64_t ts_mesh_size(const ts_mesh *m, const char *name)
{
    if (!m) return -1;
    if (!name) {
        int64_t n = 1;
        for (int d = 0; d < m->ndim; d++) n *= m->shape[d];
        return n;
    }
    int d = ts_mesh_dim_index(m, name);
    return d < 0 ? -1 : m->shape[d];
}

int64_t ts_mesh_dim_size(const ts_mesh *m, int dim)
{
    if (!m) return -1;
    if (dim < 0 || dim >= m->ndim) {
        ts_error(TS_ERR_INDEX, "mesh: dim %d out of range for a %d-d mesh", dim, m->ndim);
        return -1;
    }
    return m->shape[dim];
}

int ts_mesh_get_local_rank(const ts_mesh *m, const char *name)
{
    if (!m) return -1;
    int d = dim_of(m, name);
    return d < 0 ? -1 : m->coord[d];
}

void ts_mesh_coordinate(const ts_mesh *m, int *coords_out)
{
    if (!m || !coords_out) return;
    for (int d = 0; d < m->ndim; d++) coords_out[d] = m->coord[d];
}

ts_comm *ts_mesh_group(const ts_mesh *m, const char *name)
{
    if (!m) return NULL;
    int d = dim_of(m, name);
    return d < 0 ? NULL : m->grp[d]->c;
}

/* A 1-d copy of m's root layout with one dim; the caller fills the rest. */
static ts_mesh *one_dim(const ts_mesh *m)
{
    ts_mesh *s = ts__calloc(TS_MEM_COMM, 1, sizeof *s);
    if (!s) return NULL;
    s->world = m->world;
    s->ndim = 1;
    s->root_ndim = m->root_ndim;
    memcpy(s->root_shape, m->root_shape, sizeof s->root_shape);
    memcpy(s->root_coord, m->root_coord, sizeof s->root_coord);
    return s;
}

ts_status ts_mesh_slice(const ts_mesh *m, const char *name, ts_mesh **out)
{
    if (!m || !name || !out) return ts_error(TS_ERR_INVALID_ARGUMENT, "mesh_slice: NULL argument");
    int d = ts_mesh_dim_index(m, name);
    if (d < 0) return TS_ERR_NOT_FOUND;
    ts_mesh *s = one_dim(m);
    if (!s) return ts_error(TS_ERR_NO_MEMORY, "mesh_slice: out of memory");
    s->shape[0] = m->shape[d];
    s->mask[0] = m->mask[d];
    s->coord[0] = m->coord[d];
    memcpy(s->names[0], m->names[d], sizeof s->names[0]);
    s->grp[0] = group_ref(m->grp[d]);
    *out = s;
    return TS_OK;
}

ts_status ts_mesh_flatten(const ts_mesh *m, int ndims, const char *const *names, const char *new_name, ts_mesh **out)
{
    if (!m || !names || !out) return ts_error(TS_ERR_INVALID_ARGUMENT, "mesh_flatten: NULL argument");
    if (ndims < 1 || ndims > m->ndim)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "mesh_flatten: %d dims to merge, outside [1, %d]", ndims, m->ndim);
    ts_status st = check_name("new name", 0, new_name);
    if (st != TS_OK) return st;
    unsigned mask = 0;
    int64_t n = 1;
    int prev = -1;
    for (int i = 0; i < ndims; i++) {
        st = check_name("name", i, names[i]);
        if (st != TS_OK) return st;
        int d = ts_mesh_dim_index(m, names[i]);
        if (d < 0) return TS_ERR_NOT_FOUND;
        if (d <= prev)
            return ts_error(TS_ERR_INVALID_ARGUMENT,
                            "mesh_flatten: dim '%s' is %s (names must follow the mesh's order)", names[i],
                            d == prev ? "repeated" : "out of order");
        prev = d;
        mask |= m->mask[d];
        n *= m->shape[d];
    }
    ts_mesh *s = one_dim(m);
    if (!s) return ts_error(TS_ERR_NO_MEMORY, "mesh_flatten: out of memory");
    s->shape[0] = n;
    s->mask[0] = mask;
    s->coord[0] = index_in(m, mask);
    snprintf(s->names[0], sizeof s->names[0], "%s", new_name);
    if (ndims == 1) {
        s->grp[0] = group_ref(m->grp[prev]);
    } else {
        st = make_group(s, mask, &s->grp[0]);
        if (st != TS_OK) {
            ts__free(TS_MEM_COMM, s);
            return st;
        }
    }
    *out = s;
    return TS_OK;
}

ts_comm *ts_mesh_world(const ts_mesh *m) { return m ? m->world : NULL; }
