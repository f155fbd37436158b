/* Distributed tensors (dtensor.h). A DTensor keeps its local tensor, the
 * placements and the global shape; the local shape and offsets follow from
 * them by applying ts_chunk_range for each Shard mesh dim in mesh-dim
 * order (nested chunking).
 *
 * Redistribution plans an intermediate placement M between the source S
 * and the target T, one mesh dim at a time: a dim keeps S when S == T,
 * reduce-scatters a Partial into a Shard, and otherwise goes through
 * Replicate (all-gather of a Shard, all-reduce of a Partial). Phase 1 walks
 * the mesh dims from last to first doing S -> M (collectives); phase 2
 * walks them from first to last doing M -> T (local chunks). A Shard(d)
 * kept or reduce-scattered at mesh dim j is only correct if no earlier mesh
 * dim changes how tensor dim d is chunked (the earlier chunk must be taken
 * first), so such a j is demoted to Replicate until the plan is stable;
 * that also gathers inner nested shards before the outer ones, as
 * PyTorch's planner does. Uneven chunks are padded to ceil(n / k) rows for
 * each collective and trimmed after; the collectives work on the dim moved
 * to the front (a transpose), so blocks are contiguous. */
#include "base/internal.h"
#include "dtensor/dtensor.h"

#include <stdio.h>
#include <string.h>

struct ts_dtensor {
    const ts_mesh *mesh;
    int mesh_ndim;
    ts_placement pl[TS_MESH_MAX_DIMS];
    int ndim;
    int64_t shape[TS_MAX_DIMS];
    int64_t offset[TS_MAX_DIMS];
    ts_tensor *local;
};

/* ------------------------------------------------------------ formatting */

char *ts_placement_str(ts_placement p, char *buf, size_t len)
{
    if (!buf || len == 0) return buf;
    switch (p.kind) {
    case TS_PLACEMENT_SHARD: snprintf(buf, len, "Shard(%d)", p.dim); break;
    case TS_PLACEMENT_REPLICATE: snprintf(buf, len, "Replicate()"); break;
    case TS_PLACEMENT_PARTIAL: {
        static const char *const ops[TS_REDUCE_OP_COUNT] = {"sum", "avg", "max", "min"};
        _Static_assert(TS_REDUCE_OP_COUNT == 4, "reduce op names");
        if ((unsigned)p.op < TS_REDUCE_OP_COUNT) snprintf(buf, len, "Partial(%s)", ops[p.op]);
        else snprintf(buf, len, "Partial(op %d)", (int)p.op);
        break;
    }
    default: snprintf(buf, len, "Placement(kind %d)", (int)p.kind); break;
    }
    return buf;
}

/* "[Shard(0), Replicate()]" */
static const char *pl_list(char *buf, size_t cap, int n, const ts_placement *p)
{
    size_t k = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < n && k < cap; i++) {
        char one[48];
        k += (size_t)snprintf(buf + k, cap - k, "%s%s", i ? ", " : "", ts_placement_str(p[i], one, sizeof one));
    }
    if (k < cap) snprintf(buf + k, cap - k, "]");
    return buf;
}

/* "(5, 3)" */
static const char *shape_str(char *buf, size_t cap, int n, const int64_t *shape)
{
    size_t k = (size_t)snprintf(buf, cap, "(");
    for (int i = 0; i < n && k < cap; i++)
        k += (size_t)snprintf(buf + k, cap - k, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (k < cap) snprintf(buf + k, cap - k, "%s)", n == 1 ? "," : "");
    return buf;
}

/* ------------------------------------------------------------ chunks */

void ts_chunk_range(int64_t n, int k, int i, int64_t *start, int64_t *len)
{
    int64_t s = 0, l = 0;
    if (n > 0 && k > 0 && i >= 0 && i < k) {
        int64_t c = (n + k - 1) / k;
        s = (int64_t)i * c < n ? (int64_t)i * c : n;
        l = (s + c < n ? s + c : n) - s;
    } else if (n > 0) {
        s = n;
    }
    if (start) *start = s;
    if (len) *len = l;
}

static bool is_shard(ts_placement p, int d) { return p.kind == TS_PLACEMENT_SHARD && p.dim == d; }

static bool same_pl(ts_placement a, ts_placement b)
{
    if (a.kind != b.kind) return false;
    if (a.kind == TS_PLACEMENT_SHARD) return a.dim == b.dim;
    if (a.kind == TS_PLACEMENT_PARTIAL) return a.op == b.op;
    return true;
}

typedef struct mesh_info {
    int n;
    int k[TS_MESH_MAX_DIMS];
    int coord[TS_MESH_MAX_DIMS];
} mesh_info;

static void get_mesh_info(const ts_mesh *m, mesh_info *mi)
{
    mi->n = ts_mesh_ndim(m);
    for (int i = 0; i < mi->n; i++) mi->k[i] = (int)ts_mesh_dim_size(m, i);
    ts_mesh_coordinate(m, mi->coord);
}

/* This rank's local shape and offsets for placements pl over the mesh dims
 * [0, upto), applied in mesh-dim order. */
static void local_geometry(const mesh_info *mi, const ts_placement *pl, int upto, int ndim, const int64_t *shape,
                           int64_t *lshape, int64_t *off)
{
    for (int d = 0; d < ndim; d++) {
        lshape[d] = shape[d];
        if (off) off[d] = 0;
    }
    for (int i = 0; i < upto; i++) {
        if (pl[i].kind != TS_PLACEMENT_SHARD) continue;
        int d = pl[i].dim;
        int64_t s, l;
        ts_chunk_range(lshape[d], mi->k[i], mi->coord[i], &s, &l);
        if (off) off[d] += s;
        lshape[d] = l;
    }
}

/* Checks the placements' kinds, Partial ops and (ndim >= 0) Shard dims. */
static ts_status check_placements(const char *op, const mesh_info *mi, const ts_placement *pl, int ndim,
                                  const int64_t *shape, bool allow_partial)
{
    char pb[256], sb[128], one[48];
    for (int i = 0; i < mi->n; i++) {
        ts_placement p = pl[i];
        switch (p.kind) {
        case TS_PLACEMENT_REPLICATE: break;
        case TS_PLACEMENT_SHARD:
            if (ndim >= 0 && (p.dim < 0 || p.dim >= ndim))
                return ts_error(TS_ERR_INDEX,
                                "%s: placement %s on mesh dim %d is outside the dims of a tensor of shape %s "
                                "(placements %s)",
                                op, ts_placement_str(p, one, sizeof one), i, shape_str(sb, sizeof sb, ndim, shape),
                                pl_list(pb, sizeof pb, mi->n, pl));
            break;
        case TS_PLACEMENT_PARTIAL:
            if (!allow_partial)
                return ts_error(TS_ERR_INVALID_ARGUMENT,
                                "%s: placement %s on mesh dim %d is refused; distribute Replicate or Shard "
                                "placements (placements %s)",
                                op, ts_placement_str(p, one, sizeof one), i, pl_list(pb, sizeof pb, mi->n, pl));
            if ((unsigned)p.op >= TS_REDUCE_OP_COUNT)
                return ts_error(TS_ERR_INVALID_ARGUMENT,
                                "%s: placement %s on mesh dim %d has an unknown reduce op "
                                "(placements %s)",
                                op, ts_placement_str(p, one, sizeof one), i, pl_list(pb, sizeof pb, mi->n, pl));
            break;
        default:
            return ts_error(TS_ERR_INVALID_ARGUMENT,
                            "%s: placement %s on mesh dim %d has an unknown kind "
                            "(placements %s)",
                            op, ts_placement_str(p, one, sizeof one), i, pl_list(pb, sizeof pb, mi->n, pl));
        }
    }
    return TS_OK;
}

static ts_comm *dim_group(const ts_mesh *m, int i) { return ts_mesh_group(m, ts_mesh_dim_name(m, i)); }

/* A new contiguous copy of t. */
static ts_status copy_new(ts_tensor *t, ts_tensor **out)
{
    ts_tensor *c = NULL;
    ts_status st = ts_tensor_new_cpu(false, ts_tensor_dtype(t), ts_tensor_ndim(t), ts_tensor_shape(t), &c);
    if (st == TS_OK) st = ts_tensor_copy_(c, t);
    if (st != TS_OK) {
        ts_tensor_free(c);
        return st;
    }
    *out = c;
    return TS_OK;
}

static ts_status new_dtensor(const ts_mesh *mesh, const mesh_info *mi, const ts_placement *pl, int ndim,
                             const int64_t *shape, ts_tensor *local, ts_dtensor **out)
{
    ts_dtensor *d = ts__calloc(TS_MEM_OTHER, 1, sizeof *d);
    if (!d) return ts_error(TS_ERR_NO_MEMORY, "dtensor: out of memory");
    d->mesh = mesh;
    d->mesh_ndim = mi->n;
    memcpy(d->pl, pl, (size_t)mi->n * sizeof *pl);
    d->ndim = ndim;
    if (ndim) memcpy(d->shape, shape, (size_t)ndim * sizeof *shape);
    int64_t lshape[TS_MAX_DIMS];
    local_geometry(mi, pl, mi->n, ndim, shape, lshape, d->offset);
    d->local = local;
    *out = d;
    return TS_OK;
}

/* ------------------------------------------------------------ mesh-wide collectives */

/* Broadcasts t from the rank at src_coord over the whole mesh: along each
 * mesh dim in turn, within the lines that already hold the data. */
static ts_status mesh_broadcast(const ts_mesh *m, const mesh_info *mi, const int *src_coord, ts_tensor *t)
{
    for (int i = 0; i < mi->n; i++) {
        bool holds_line = true;
        for (int j = i + 1; j < mi->n; j++)
            if (mi->coord[j] != src_coord[j]) holds_line = false;
        if (!holds_line) continue;
        ts_status st = ts_broadcast(dim_group(m, i), t, src_coord[i], NULL);
        if (st != TS_OK) return st;
    }
    return TS_OK;
}

/* Reduces t over the whole mesh (one all-reduce per mesh dim). */
static ts_status mesh_all_reduce(const ts_mesh *m, const mesh_info *mi, ts_tensor *t, ts_reduce_op op)
{
    for (int i = 0; i < mi->n; i++) {
        ts_status st = ts_all_reduce(dim_group(m, i), t, op, NULL);
        if (st != TS_OK) return st;
    }
    return TS_OK;
}

/* ------------------------------------------------------------ distribute_tensor */

enum { META_DTYPE, META_NDIM, META_SHAPE, META_LEN = META_SHAPE + TS_MAX_DIMS };
enum { FLAG_SHAPE, FLAG_DTYPE, FLAG_SRC_FAILED, FLAG_LEN };

/* With src_rank >= 0: agrees with src on the dtype and shape (every rank
 * fails together if any differs) and returns in *out a contiguous tensor
 * holding src's `full` on every rank. Collective over the mesh. */
static ts_status fetch_from_src(ts_tensor *full, const ts_mesh *mesh, const mesh_info *mi, int src_rank,
                                ts_tensor **out)
{
    int src_coord[TS_MESH_MAX_DIMS];
    int64_t rest = src_rank;
    for (int i = mi->n - 1; i >= 0; i--) {
        src_coord[i] = (int)(rest % mi->k[i]);
        rest /= mi->k[i];
    }
    bool is_src = true;
    for (int i = 0; i < mi->n; i++)
        if (src_coord[i] != mi->coord[i]) is_src = false;

    int64_t msh[1] = {META_LEN}, fsh[1] = {FLAG_LEN};
    ts_tensor *meta = NULL, *flags = NULL, *buf = NULL;
    ts_status st = ts_tensor_new_cpu(true, TS_I64, 1, msh, &meta);
    if (st == TS_OK) st = ts_tensor_new_cpu(true, TS_I64, 1, fsh, &flags);
    if (st != TS_OK) goto done;
    int64_t *mv = ts_tensor_data(meta), *fv = ts_tensor_data(flags);
    int nd = ts_tensor_ndim(full);
    const int64_t *sh = ts_tensor_shape(full);
    if (is_src) {
        mv[META_DTYPE] = ts_tensor_dtype(full);
        mv[META_NDIM] = nd;
        for (int i = 0; i < nd; i++) mv[META_SHAPE + i] = sh[i];
    }
    if ((st = mesh_broadcast(mesh, mi, src_coord, meta)) != TS_OK) goto done;

    int src_nd = (int)mv[META_NDIM];
    ts_dtype src_dt = (ts_dtype)mv[META_DTYPE];
    int64_t src_sh[TS_MAX_DIMS] = {0};
    for (int i = 0; i < src_nd && i < TS_MAX_DIMS; i++) src_sh[i] = mv[META_SHAPE + i];
    bool bad_shape = src_nd != nd, bad_dtype = src_dt != ts_tensor_dtype(full);
    for (int i = 0; i < nd && !bad_shape; i++) bad_shape = sh[i] != src_sh[i];
    fv[FLAG_SHAPE] = bad_shape;
    fv[FLAG_DTYPE] = bad_dtype;
    ts_status local_st = TS_OK;
    char local_msg[512] = "";
    if (!bad_shape && !bad_dtype) {
        local_st = ts_tensor_new_cpu(false, src_dt, src_nd, src_sh, &buf);
        if (local_st == TS_OK && is_src) local_st = ts_tensor_copy_(buf, full);
        if (local_st != TS_OK) {
            snprintf(local_msg, sizeof local_msg, "%s", ts_last_error());
            fv[FLAG_SRC_FAILED] = 1;
        }
    }
    if ((st = mesh_all_reduce(mesh, mi, flags, TS_REDUCE_MAX)) != TS_OK) goto done;

    char a[128], b[128];
    if (bad_shape || bad_dtype) {
        st = ts_error(bad_shape ? TS_ERR_SHAPE : TS_ERR_DTYPE,
                      "distribute_tensor: this rank's tensor %s %s does not match source rank %d's %s %s",
                      shape_str(a, sizeof a, nd, sh), ts_dtype_name(ts_tensor_dtype(full)), src_rank,
                      shape_str(b, sizeof b, src_nd, src_sh), ts_dtype_name(src_dt));
    } else if (local_st != TS_OK) {
        st = ts_error(local_st, "distribute_tensor: %s", local_msg);
    } else if (fv[FLAG_SHAPE] || fv[FLAG_DTYPE]) {
        st = ts_error(fv[FLAG_SHAPE] ? TS_ERR_SHAPE : TS_ERR_DTYPE,
                      "distribute_tensor: another rank's tensor does not match source rank %d's %s %s (each rank "
                      "must pass a tensor of the source's shape and dtype)",
                      src_rank, shape_str(b, sizeof b, src_nd, src_sh), ts_dtype_name(src_dt));
    } else if (fv[FLAG_SRC_FAILED]) {
        st = ts_error(TS_ERR_COMM,
                      "distribute_tensor: another rank failed to prepare the broadcast of source rank "
                      "%d's tensor %s %s",
                      src_rank, shape_str(b, sizeof b, src_nd, src_sh), ts_dtype_name(src_dt));
    }
    if (st != TS_OK) goto done;
    if (ts_tensor_numel(buf) > 0 && (st = mesh_broadcast(mesh, mi, src_coord, buf)) != TS_OK) goto done;
    *out = buf;
    buf = NULL;
done:
    ts_tensor_free(meta);
    ts_tensor_free(flags);
    ts_tensor_free(buf);
    return st;
}

ts_status ts_distribute_tensor(ts_tensor *full, const ts_mesh *mesh, const ts_placement *placements, int src_rank,
                               ts_dtensor **out)
{
    if (!full || !mesh || !placements || !out)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "distribute_tensor: NULL argument (full %p, mesh %p, placements %p, "
                        "out %p)",
                        (void *)full, (const void *)mesh, (const void *)placements, (void *)out);
    mesh_info mi;
    get_mesh_info(mesh, &mi);
    char pb[256], sb[128];
    ts_status st = check_placements("distribute_tensor", &mi, placements, -1, NULL, false);
    if (st != TS_OK) return st;
    int64_t msize = ts_mesh_size(mesh, NULL);
    if (src_rank >= msize)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "distribute_tensor: src_rank %d is outside the mesh of %lld ranks "
                        "(placements %s, tensor %s)",
                        src_rank, (long long)msize, pl_list(pb, sizeof pb, mi.n, placements),
                        shape_str(sb, sizeof sb, ts_tensor_ndim(full), ts_tensor_shape(full)));

    bool prev = ts_grad_mode_set(false);
    ts_tensor *src = NULL, *local = NULL;
    if (src_rank >= 0) st = fetch_from_src(full, mesh, &mi, src_rank, &src);
    else st = ts_tensor_local_view(full, &src);
    if (st == TS_OK)
        st = check_placements("distribute_tensor", &mi, placements, ts_tensor_ndim(src), ts_tensor_shape(src), false);
    if (st == TS_OK) {
        int nd = ts_tensor_ndim(src);
        int64_t shape[TS_MAX_DIMS] = {0}, lshape[TS_MAX_DIMS], off[TS_MAX_DIMS];
        if (nd) memcpy(shape, ts_tensor_shape(src), (size_t)nd * sizeof *shape);
        local_geometry(&mi, placements, mi.n, nd, shape, lshape, off);
        ts_tensor *t = ts_tensor_retain(src);
        for (int d = 0; d < nd && st == TS_OK; d++) {
            if (lshape[d] == shape[d]) continue;
            ts_tensor *v = NULL;
            st = ts_narrow(t, d, off[d], lshape[d], &v);
            ts_tensor_free(t);
            t = v;
        }
        if (st == TS_OK) st = copy_new(t, &local);
        ts_tensor_free(t);
        if (st == TS_OK) st = new_dtensor(mesh, &mi, placements, nd, shape, local, out);
        if (st != TS_OK) ts_tensor_free(local);
    }
    ts_tensor_free(src);
    ts_grad_mode_set(prev);
    return st;
}

/* ------------------------------------------------------------ from_local */

ts_status ts_dtensor_from_local(ts_tensor *local, const ts_mesh *mesh, const ts_placement *placements, int global_ndim,
                                const int64_t *global_shape, ts_dtensor **out)
{
    if (!local || !mesh || !placements || !out)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "dtensor_from_local: NULL argument (local %p, mesh %p, placements "
                        "%p, out %p)",
                        (void *)local, (const void *)mesh, (const void *)placements, (void *)out);
    mesh_info mi;
    get_mesh_info(mesh, &mi);
    int nd = ts_tensor_ndim(local);
    const int64_t *lsh = ts_tensor_shape(local);
    char pb[256], a[128], b[128], c[128];
    ts_status st = check_placements("dtensor_from_local", &mi, placements, nd, lsh, true);
    if (st != TS_OK) return st;
    int64_t gshape[TS_MAX_DIMS] = {0};
    if (global_shape) {
        if (global_ndim != nd)
            return ts_error(TS_ERR_SHAPE,
                            "dtensor_from_local: global shape %s has %d dims but the local tensor %s "
                            "has %d (placements %s)",
                            shape_str(a, sizeof a,
                                      global_ndim < 0                 ? 0
                                          : global_ndim > TS_MAX_DIMS ? TS_MAX_DIMS
                                                                      : global_ndim,
                                      global_shape),
                            global_ndim, shape_str(b, sizeof b, nd, lsh), nd, pl_list(pb, sizeof pb, mi.n, placements));
        for (int d = 0; d < nd; d++) {
            if (global_shape[d] < 0)
                return ts_error(TS_ERR_SHAPE,
                                "dtensor_from_local: global shape %s has a negative size "
                                "(placements %s)",
                                shape_str(a, sizeof a, nd, global_shape), pl_list(pb, sizeof pb, mi.n, placements));
            gshape[d] = global_shape[d];
        }
    } else {
        for (int d = 0; d < nd; d++) gshape[d] = lsh[d];
        for (int i = 0; i < mi.n; i++)
            if (placements[i].kind == TS_PLACEMENT_SHARD) gshape[placements[i].dim] *= mi.k[i];
    }
    int64_t want[TS_MAX_DIMS];
    local_geometry(&mi, placements, mi.n, nd, gshape, want, NULL);
    for (int d = 0; d < nd; d++)
        if (want[d] != lsh[d])
            return ts_error(TS_ERR_SHAPE,
                            "dtensor_from_local: local tensor %s is not this rank's chunk %s of the "
                            "global shape %s under placements %s",
                            shape_str(a, sizeof a, nd, lsh), shape_str(b, sizeof b, nd, want),
                            shape_str(c, sizeof c, nd, gshape), pl_list(pb, sizeof pb, mi.n, placements));
    return new_dtensor(mesh, &mi, placements, nd, gshape, ts_tensor_retain(local), out);
}

/* ------------------------------------------------------------ accessors */

ts_tensor *ts_dtensor_local(const ts_dtensor *d) { return d ? d->local : NULL; }
ts_tensor *ts_dtensor_to_local(const ts_dtensor *d) { return d ? ts_tensor_retain(d->local) : NULL; }
const ts_mesh *ts_dtensor_mesh(const ts_dtensor *d) { return d ? d->mesh : NULL; }
const ts_placement *ts_dtensor_placements(const ts_dtensor *d) { return d ? d->pl : NULL; }
int ts_dtensor_ndim(const ts_dtensor *d) { return d ? d->ndim : -1; }
const int64_t *ts_dtensor_shape(const ts_dtensor *d) { return d ? d->shape : NULL; }

int64_t ts_dtensor_local_offset(const ts_dtensor *d, int dim)
{
    if (!d) {
        ts_error(TS_ERR_INVALID_ARGUMENT, "dtensor_local_offset: NULL dtensor");
        return -1;
    }
    if (dim < 0 || dim >= d->ndim) {
        char sb[128];
        ts_error(TS_ERR_INDEX, "dtensor_local_offset: dim %d is outside the dims of the global shape %s", dim,
                 shape_str(sb, sizeof sb, d->ndim, d->shape));
        return -1;
    }
    return d->offset[dim];
}

void ts_dtensor_free(ts_dtensor *d)
{
    if (!d) return;
    ts_tensor_free(d->local);
    ts__free(TS_MEM_OTHER, d);
}

/* ------------------------------------------------------------ redistribute */

/* Replaces *t by a view of itself with dims 0 and d swapped (d to the
 * front, or back again: the swap is its own inverse). */
static ts_status swap_front(ts_tensor **t, int d)
{
    if (d == 0) return TS_OK;
    ts_tensor *v = NULL;
    ts_status st = ts_transpose(*t, 0, d, &v);
    if (st != TS_OK) return st;
    ts_tensor_free(*t);
    *t = v;
    return TS_OK;
}

/* Replaces *t by its narrow along dim d. */
static ts_status narrow_in_place(ts_tensor **t, int d, int64_t start, int64_t len)
{
    ts_tensor *v = NULL;
    ts_status st = ts_narrow(*t, d, start, len, &v);
    if (st != TS_OK) return st;
    ts_tensor_free(*t);
    *t = v;
    return TS_OK;
}

/* A zero tensor shaped like t with dim 0 of size rows; t's rows copied into
 * its first rows. */
static ts_status padded_copy(ts_tensor *t, int64_t rows, ts_tensor **out)
{
    int nd = ts_tensor_ndim(t);
    int64_t sh[TS_MAX_DIMS];
    memcpy(sh, ts_tensor_shape(t), (size_t)nd * sizeof *sh);
    sh[0] = rows;
    ts_tensor *p = NULL, *head = NULL;
    ts_status st = ts_tensor_new_cpu(true, ts_tensor_dtype(t), nd, sh, &p);
    if (st == TS_OK) st = ts_narrow(p, 0, 0, ts_tensor_shape(t)[0], &head);
    if (st == TS_OK) st = ts_tensor_copy_(head, t);
    ts_tensor_free(head);
    if (st != TS_OK) {
        ts_tensor_free(p);
        return st;
    }
    *out = p;
    return TS_OK;
}

typedef struct redist_ctx {
    const ts_dtensor *d;
    const ts_placement *tgt;
    const mesh_info *mi;
    ts_placement cur[TS_MESH_MAX_DIMS];
} redist_ctx;

static ts_status step_error(redist_ctx *x, ts_status st, const char *what, int i)
{
    char a[256], b[256], sb[128], one[48], two[48], cause[512];
    snprintf(cause, sizeof cause, "%s", ts_last_error()); /* ts_error writes the buffer it would read */
    return ts_error(st,
                    "redistribute: %s on mesh dim %d (%s -> %s) failed for global shape %s, placements %s -> "
                    "%s: %s",
                    what, i, ts_placement_str(x->d->pl[i], one, sizeof one),
                    ts_placement_str(x->tgt[i], two, sizeof two), shape_str(sb, sizeof sb, x->d->ndim, x->d->shape),
                    pl_list(a, sizeof a, x->mi->n, x->d->pl), pl_list(b, sizeof b, x->mi->n, x->tgt), cause);
}

/* Shard(d) -> Replicate on mesh dim i: all-gather of the padded chunks
 * along d, trimmed to the size before mesh dim i's chunk. */
static ts_status do_gather(redist_ctx *x, ts_tensor **t, int i, int d)
{
    const mesh_info *mi = x->mi;
    int64_t before[TS_MAX_DIMS];
    local_geometry(mi, x->cur, i, x->d->ndim, x->d->shape, before, NULL);
    int64_t n = before[d], k = mi->k[i], c = (n + k - 1) / k, s, len;
    ts_chunk_range(n, (int)k, mi->coord[i], &s, &len);
    if (ts_tensor_shape(*t)[d] != len) {
        char sb[128];
        return ts_error(TS_ERR_INTERNAL, "redistribute: local tensor %s has %lld rows along dim %d, expected %lld",
                        shape_str(sb, sizeof sb, ts_tensor_ndim(*t), ts_tensor_shape(*t)),
                        (long long)ts_tensor_shape(*t)[d], d, (long long)len);
    }
    ts_status st = swap_front(t, d);
    if (st != TS_OK) return st;
    ts_tensor *in = NULL, *all = NULL;
    int nd = ts_tensor_ndim(*t);
    int64_t sh[TS_MAX_DIMS];
    memcpy(sh, ts_tensor_shape(*t), (size_t)nd * sizeof *sh);
    sh[0] = k * c;
    st = ts_tensor_new_cpu(false, ts_tensor_dtype(*t), nd, sh, &all);
    if (st == TS_OK && ts_tensor_numel(all) > 0) {
        st = padded_copy(*t, c, &in);
        if (st == TS_OK) st = ts_all_gather_into_tensor(dim_group(x->d->mesh, i), all, in, NULL);
        if (st != TS_OK) st = step_error(x, st, "all-gather", i);
    }
    ts_tensor_free(in);
    if (st == TS_OK) {
        ts_tensor_free(*t);
        *t = all;
        all = NULL;
        st = narrow_in_place(t, 0, 0, n);
    }
    ts_tensor_free(all);
    if (st == TS_OK) st = swap_front(t, d);
    return st;
}

/* Partial -> Shard(d) on mesh dim i: reduce-scatter of the tensor padded
 * to k * ceil(n / k) rows along d, trimmed to this rank's chunk. */
static ts_status do_reduce_scatter(redist_ctx *x, ts_tensor **t, int i, int d, ts_reduce_op op)
{
    const mesh_info *mi = x->mi;
    int64_t n = ts_tensor_shape(*t)[d], k = mi->k[i], c = (n + k - 1) / k, s, len;
    ts_chunk_range(n, (int)k, mi->coord[i], &s, &len);
    ts_status st = swap_front(t, d);
    if (st != TS_OK) return st;
    ts_tensor *in = NULL, *mine = NULL;
    int nd = ts_tensor_ndim(*t);
    int64_t sh[TS_MAX_DIMS];
    memcpy(sh, ts_tensor_shape(*t), (size_t)nd * sizeof *sh);
    sh[0] = c;
    st = ts_tensor_new_cpu(false, ts_tensor_dtype(*t), nd, sh, &mine);
    if (st == TS_OK && ts_tensor_numel(mine) > 0) {
        st = padded_copy(*t, k * c, &in);
        if (st == TS_OK) st = ts_reduce_scatter_tensor(dim_group(x->d->mesh, i), mine, in, op, 1.0, 1.0, NULL);
        if (st != TS_OK) st = step_error(x, st, "reduce-scatter", i);
    }
    ts_tensor_free(in);
    if (st == TS_OK) {
        ts_tensor_free(*t);
        *t = mine;
        mine = NULL;
        st = narrow_in_place(t, 0, 0, len);
    }
    ts_tensor_free(mine);
    if (st == TS_OK) st = swap_front(t, d);
    return st;
}

/* Partial -> Replicate on mesh dim i: all-reduce of a private contiguous
 * copy (the source DTensor's local tensor is never written). */
static ts_status do_all_reduce(redist_ctx *x, ts_tensor **t, int i, ts_reduce_op op)
{
    if (ts_tensor_numel(*t) == 0) return TS_OK;
    ts_status st;
    if (!ts_tensor_is_contiguous(*t) || ts_tensor_storage(*t) == ts_tensor_storage(x->d->local)) {
        ts_tensor *c = NULL;
        if ((st = copy_new(*t, &c)) != TS_OK) return st;
        ts_tensor_free(*t);
        *t = c;
    }
    st = ts_all_reduce(dim_group(x->d->mesh, i), *t, op, NULL);
    return st == TS_OK ? TS_OK : step_error(x, st, "all-reduce", i);
}

/* The intermediate placements (see the top of the file). */
static void plan(const ts_placement *src, const ts_placement *tgt, int n, ts_placement *mid)
{
    for (int i = 0; i < n; i++) {
        if (same_pl(src[i], tgt[i])) mid[i] = src[i];
        else if (src[i].kind == TS_PLACEMENT_PARTIAL && tgt[i].kind == TS_PLACEMENT_SHARD) mid[i] = tgt[i];
        else mid[i] = ts_replicate();
    }
    bool changed = true;
    while (changed) {
        changed = false;
        for (int j = 0; j < n; j++) {
            if (mid[j].kind != TS_PLACEMENT_SHARD) continue;
            int d = mid[j].dim;
            for (int i = 0; i < j; i++) {
                bool stable = same_pl(src[i], mid[i]) && same_pl(mid[i], tgt[i]);
                if (!stable && (is_shard(src[i], d) || is_shard(tgt[i], d))) {
                    mid[j] = ts_replicate();
                    changed = true;
                    break;
                }
            }
        }
    }
}

/* Runs the plan; *out gets a contiguous local tensor for tgt, owned by the
 * caller (d's own local tensor, retained, when nothing changes). */
static ts_status redistribute_local(const ts_dtensor *d, const mesh_info *mi, const ts_placement *tgt, ts_tensor **out)
{
    int n = mi->n;
    bool all_same = true;
    for (int i = 0; i < n; i++)
        if (!same_pl(d->pl[i], tgt[i])) all_same = false;
    if (all_same) {
        *out = ts_tensor_retain(d->local);
        return TS_OK;
    }
    redist_ctx x = {.d = d, .tgt = tgt, .mi = mi};
    memcpy(x.cur, d->pl, (size_t)n * sizeof *d->pl);
    ts_placement mid[TS_MESH_MAX_DIMS];
    plan(d->pl, tgt, n, mid);

    ts_tensor *t = NULL;
    ts_status st = ts_tensor_local_view(d->local, &t);
    /* phase 1: collectives, last mesh dim to first */
    for (int i = n - 1; i >= 0 && st == TS_OK; i--) {
        ts_placement s = d->pl[i], m = mid[i];
        if (same_pl(s, m)) continue;
        if (s.kind == TS_PLACEMENT_SHARD) st = do_gather(&x, &t, i, s.dim);
        else if (m.kind == TS_PLACEMENT_SHARD) st = do_reduce_scatter(&x, &t, i, m.dim, s.op);
        else st = do_all_reduce(&x, &t, i, s.op);
        x.cur[i] = m;
    }
    /* phase 2: local chunks, first mesh dim to last */
    for (int i = 0; i < n && st == TS_OK; i++) {
        if (same_pl(mid[i], tgt[i])) continue;
        int dd = tgt[i].dim;
        int64_t s, len;
        ts_chunk_range(ts_tensor_shape(t)[dd], mi->k[i], mi->coord[i], &s, &len);
        st = narrow_in_place(&t, dd, s, len);
        x.cur[i] = tgt[i];
    }
    if (st == TS_OK) {
        int64_t want[TS_MAX_DIMS];
        local_geometry(mi, tgt, n, d->ndim, d->shape, want, NULL);
        for (int k = 0; k < d->ndim && st == TS_OK; k++) {
            if (ts_tensor_shape(t)[k] == want[k]) continue;
            char a[256], b[256], sa[128], sb[128], sg[128];
            st = ts_error(TS_ERR_INTERNAL,
                          "redistribute: local result %s is not the chunk %s of global shape %s "
                          "under placements %s (from %s)",
                          shape_str(sa, sizeof sa, d->ndim, ts_tensor_shape(t)),
                          shape_str(sb, sizeof sb, d->ndim, want), shape_str(sg, sizeof sg, d->ndim, d->shape),
                          pl_list(b, sizeof b, n, tgt), pl_list(a, sizeof a, n, d->pl));
        }
    }
    if (st == TS_OK && (!ts_tensor_is_contiguous(t) || ts_tensor_storage(t) == ts_tensor_storage(d->local))) {
        ts_tensor *c = NULL;
        st = copy_new(t, &c);
        if (st == TS_OK) {
            ts_tensor_free(t);
            t = c;
        }
    }
    if (st != TS_OK) {
        ts_tensor_free(t);
        return st;
    }
    *out = t;
    return TS_OK;
}

ts_status ts_dtensor_redistribute(const ts_dtensor *d, const ts_placement *placements, ts_dtensor **out)
{
    if (!d || !placements || !out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "redistribute: NULL argument (dtensor %p, placements %p, out %p)",
                        (const void *)d, (const void *)placements, (void *)out);
    mesh_info mi;
    get_mesh_info(d->mesh, &mi);
    ts_status st = check_placements("redistribute", &mi, placements, d->ndim, d->shape, true);
    if (st != TS_OK) return st;
    char a[256], b[256], one[48], two[48], sb[128];
    for (int i = 0; i < mi.n; i++) {
        ts_placement s = d->pl[i], t = placements[i];
        if (t.kind == TS_PLACEMENT_PARTIAL && !same_pl(s, t))
            return ts_error(TS_ERR_UNSUPPORTED,
                            "redistribute: %s -> %s on mesh dim %d is not supported "
                            "(redistributing to Partial is for internal use only; global shape %s, placements "
                            "%s -> %s)",
                            ts_placement_str(s, one, sizeof one), ts_placement_str(t, two, sizeof two), i,
                            shape_str(sb, sizeof sb, d->ndim, d->shape), pl_list(a, sizeof a, mi.n, d->pl),
                            pl_list(b, sizeof b, mi.n, placements));
    }
    bool prev = ts_grad_mode_set(false);
    ts_tensor *local = NULL;
    st = redistribute_local(d, &mi, placements, &local);
    if (st == TS_OK) {
        st = new_dtensor(d->mesh, &mi, placements, d->ndim, d->shape, local, out);
        if (st != TS_OK) ts_tensor_free(local);
    }
    ts_grad_mode_set(prev);
    return st;
}

ts_status ts_dtensor_full_tensor(const ts_dtensor *d, ts_tensor **out)
{
    if (!d || !out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "dtensor_full_tensor: NULL argument (dtensor %p, out %p)",
                        (const void *)d, (void *)out);
    ts_placement rep[TS_MESH_MAX_DIMS];
    for (int i = 0; i < d->mesh_ndim; i++) rep[i] = ts_replicate();
    mesh_info mi;
    get_mesh_info(d->mesh, &mi);
    bool prev = ts_grad_mode_set(false);
    ts_tensor *local = NULL;
    ts_status st = redistribute_local(d, &mi, rep, &local);
    ts_grad_mode_set(prev);
    if (st != TS_OK) return st;
    *out = local;
    return TS_OK;
}
