/*
 * One FSDP parameter (PyTorch's _fsdp_param.py): its geometry in its
 * group (rows, chunk rows, offset in the per-rank shard), its sharded and
 * unsharded leaves and its slots, and the copies between them and the
 * group's buffers: the shard made from the original tensor, copy-out from
 * the all-gather, packing its gradient for the reduce-scatter, writing
 * changed rows back into the shard, and loading its rows from a full
 * tensor. internal.h describes the buffers' layout.
 * Floor 2 (internal.h, "Floors"): may call floor 1 (common.c).
 */
#include "fully_shard/internal.h"

#include "tensor/internal.h"
#include "tensor/kernels.h"

#include <string.h>

/* The geometry of parameter t at the end of group g's shard so far
 * (g->shard_numel); the caller adds it to the group's sizes. */
ts_status ts__fsdp_param_init(fsdp_param *p, const fsdp_group *g, const ts_tensor *t, const char *fqn)
{
    p->ndim = ts_tensor_ndim(t);
    memcpy(p->shape, ts_tensor_shape(t), (size_t)p->ndim * sizeof *p->shape);
    p->rows = p->shape[0];
    p->numel = ts_tensor_numel(t);
    p->row_numel = p->rows ? p->numel / p->rows : 0;
    p->c = (p->rows + g->W - 1) / g->W;
    p->chunks = ts__calloc(TS_MEM_NN, (size_t)g->W, sizeof *p->chunks);
    if (!p->chunks) return TS_ERR_NO_MEMORY;
    for (int r = 0; r < g->W; r++) ts_chunk_range(p->rows, g->W, r, &p->chunks[r].row0, &p->chunks[r].rows);
    p->local_rows = p->chunks[g->rank].rows;
    p->off = g->shard_numel;
    p->requires_grad = ts_tensor_requires_grad(t);
    p->fqn = ts__strdup(TS_MEM_NN, fqn);
    return p->fqn ? TS_OK : TS_ERR_NO_MEMORY;
}

/* U: a tensor whose storage is released (restored at each unshard). On a
 * meta model it never had bytes: made as a meta handle, then marked an
 * ordinary released CPU storage, so that sharding a model larger than the
 * rank allocates nothing. */
static ts_status new_released(ts_dtype dtype, int ndim, const int64_t *shape, bool meta, ts_tensor **out)
{
    ts_status st;
    if (!meta) {
        if ((st = ts__tensor_new(dtype, ndim, shape, out))) return st;
        return ts_storage_release(ts_tensor_storage(*out));
    }
    if ((st = ts__tensor_new_meta(dtype, ndim, shape, out))) return st;
    ts_storage *s = ts_tensor_storage(*out); /* released, then a released CPU storage: never a byte */
    if ((st = ts_storage_release(s)) || (st = ts_storage_materialize(s))) {
        ts_tensor_free(*out);
        *out = NULL;
    }
    return st;
}

/* Once the group's shard size is known: places the chunks in the W-block
 * buffers, copies this rank's rows of t into the group's sharded buffer
 * and makes the sharded leaf S (a view of them, with its DTensor) and the
 * unsharded leaf U (storage released). Grad mode is off. */
ts_status ts__fsdp_param_make_shard(fsdp_param *p, fsdp_group *g, ts_tensor *t)
{
    for (int r = 0; r < g->W; r++) p->chunks[r].buf_off = (int64_t)r * g->shard_numel + p->off;
    int64_t start = p->chunks[g->rank].row0, len = p->chunks[g->rank].rows;
    ts_status st;
    if (ts__is_meta(t)) { /* deferred init: no bytes to copy; the full parameter keeps its initializers */
        p->meta_src = ts_tensor_retain(t);
    } else {
        ts_tensor *src = NULL;
        if ((st = ts_contiguous(t, &src))) return st;
        unsigned char *dst = (unsigned char *)ts_tensor_data(g->sharded) + (size_t)p->off * g->es;
        if (len > 0)
            memcpy(dst, (const unsigned char *)ts_tensor_data(src) + (size_t)(start * p->row_numel) * g->es,
                   (size_t)(len * p->row_numel) * g->es);
        ts_tensor_free(src);
    }
    int64_t lshape[TS_MAX_DIMS];
    memcpy(lshape, p->shape, sizeof lshape);
    lshape[0] = len;
    int64_t lstrides[TS_MAX_DIMS];
    ts__contiguous_strides(p->ndim, lshape, lstrides);
    if ((st = ts__tensor_alias(g->sharded, p->ndim, lshape, lstrides, g->sharded->offset + p->off, &p->S))) return st;
    if ((st = new_released(g->udtype, p->ndim, p->shape, p->meta_src != NULL, &p->U))) return st;
    if (p->requires_grad) {
        if ((st = ts_tensor_set_requires_grad(p->S, true))) return st;
        if ((st = ts_tensor_set_requires_grad(p->U, true))) return st;
    }
    if ((st = ts_tensor_set_name(p->S, p->fqn)) || (st = ts_tensor_set_name(p->U, p->fqn))) return st;
    ts_placement pl[2] = {ts_replicate(), ts_shard(0)};
    const ts_placement *pls = ts_mesh_ndim(g->mesh) == 1 ? &pl[1] : pl;
    if ((st = ts_dtensor_from_local(p->S, g->mesh, pls, p->ndim, p->shape, &p->dt))) return st;
    ts_tensor_set_shard(p->S, p->dt);
    return TS_OK;
}

void ts__fsdp_param_fini(fsdp_param *p)
{
    ts__free(TS_MEM_NN, p->fqn);
    ts__free(TS_MEM_NN, p->chunks);
    ts__free(TS_MEM_NN, p->slots);
    ts__free(TS_MEM_NN, p->slot_owner);
    ts_dtensor_free(p->dt);
    if (p->S) ts_tensor_clear_shard(p->S);
    ts_tensor_free(p->S);
    ts_tensor_free(p->U);
    ts_tensor_free(p->acc);
    ts_tensor_free(p->meta_src);
}

void ts__fsdp_swap_slot(ts_tensor **slot, ts_tensor *t)
{
    if (*slot == t) return;
    ts_tensor *old = *slot;
    *slot = ts_tensor_retain(t);
    ts_tensor_free(old);
}

/* Puts U (unsharded) or S into every live slot. */
void ts__fsdp_param_set_slots(fsdp_param *p, bool unsharded)
{
    for (int k = 0; k < p->n_slots; k++)
        if (p->slots[k]) ts__fsdp_swap_slot(p->slots[k], unsharded ? p->U : p->S);
}

/* U's storage on a deferred-init model is a released CPU storage (it
 * never had bytes): in a meta step ([Note: meta step] in param_group.c) it
 * is taken as meta while unsharded, so that its block is counted on the
 * ledger and the ops on it compute nothing, and is a released CPU storage
 * again once released. */
ts_status ts__fsdp_param_restore_u(fsdp_param *p, const fsdp_group *g)
{
    ts_storage *s = ts_tensor_storage(p->U);
    if (s->released && !s->meta && ts__fsdp_group_meta(g)) {
        s->meta = true;
        p->u_meta = true;
    }
    ts_status st = ts_storage_restore(s);
    if (st && p->u_meta) {
        s->meta = false;
        p->u_meta = false;
    }
    return st;
}

void ts__fsdp_param_release_u(fsdp_param *p)
{
    ts_storage *s = ts_tensor_storage(p->U);
    (void)ts_storage_release(s);
    if (p->u_meta) {
        s->meta = false;
        ts__meta_ledger_detach(s);
        p->u_meta = false;
    }
}

/* Restores U's storage and copies its real rows out of the all-gather
 * output ag (W blocks of shard_numel, in U's dtype: the group's udtype). */
ts_status ts__fsdp_param_copy_out(fsdp_param *p, const fsdp_group *g, const unsigned char *ag)
{
    ts_status st = ts__fsdp_param_restore_u(p, g);
    if (st) return st;
    unsigned char *u = ts_tensor_data(p->U);
    if (!u || !ag) return TS_OK; /* a meta step ([Note: meta step] in param_group.c): no data */
    size_t rb = (size_t)p->row_numel * g->ues;
    for (int r = 0; r < g->W; r++) {
        const fsdp_chunk *ch = &p->chunks[r];
        if (ch->rows > 0) memcpy(u + (size_t)ch->row0 * rb, ag + (size_t)ch->buf_off * g->ues, (size_t)ch->rows * rb);
    }
    return TS_OK;
}

/* Packs gradient gr (U's, or NULL: zeros) into the reduce-scatter input
 * `in` (W blocks of shard_numel, in the group's rdtype: converted from
 * gr's dtype when they differ), zero padded. */
ts_status ts__fsdp_param_pack_grad(fsdp_param *p, const fsdp_group *g, unsigned char *in, int64_t block, ts_tensor *gr)
{
    size_t rb = (size_t)p->row_numel * g->res;
    /* zeros where no gradient row lands: the padding rows, or the whole
     * segment of a parameter without gradient */
    for (int r = 0; in && r < g->W; r++) {
        int64_t len = gr ? p->chunks[r].rows : 0;
        if (len < p->c)
            memset(in + (size_t)(r * block + p->off) * g->res + (size_t)len * rb, 0, (size_t)(p->c - len) * rb);
    }
    if (!gr) return TS_OK;
    ts_tensor *cg = NULL;
    bool prev = ts_grad_mode_set(false);
    ts_status st = ts_contiguous(gr, &cg);
    ts_grad_mode_set(prev);
    if (st) return st;
    const unsigned char *src = ts_tensor_data(cg);
    ts_dtype gd = ts_tensor_dtype(cg);
    size_t gb = (size_t)p->row_numel * ts_dtype_size(gd);
    for (int r = 0; in && src && r < g->W; r++) {
        const fsdp_chunk *ch = &p->chunks[r];
        if (ch->rows > 0)
            ts__buf_convert(g->rdtype, in + (size_t)(r * block + p->off) * g->res, gd, src + (size_t)ch->row0 * gb,
                            ch->rows * p->row_numel);
    }
    ts_tensor_free(cg);
    return TS_OK;
}

/* Copies the rows of U that this rank holds back into its shard
 * (converted from udtype to the shard's dtype when they differ). */
void ts__fsdp_param_write_back(fsdp_param *p, const fsdp_group *g)
{
    unsigned char *sh = ts_tensor_data(g->sharded);
    const fsdp_chunk *ch = &p->chunks[g->rank];
    size_t rb = (size_t)p->row_numel * g->ues;
    if (ch->rows > 0)
        ts__buf_convert(g->dtype, sh + (size_t)p->off * g->es, g->udtype,
                        (const unsigned char *)ts_tensor_data(p->U) + (size_t)ch->row0 * rb, ch->rows * p->row_numel);
}

/* Copies this rank's rows of the full tensor src (checked: p's shape and
 * dtype) into the shard. Grad mode is off. */
ts_status ts__fsdp_param_load_rows(fsdp_param *p, const fsdp_group *g, ts_tensor *src)
{
    const fsdp_chunk *ch = &p->chunks[g->rank];
    if (ch->rows == 0) return TS_OK;
    ts_tensor *rows = NULL, *lv = NULL;
    ts_status st;
    if (!(st = ts_narrow(src, 0, ch->row0, ch->rows, &rows)) && !(st = ts_tensor_local_view(p->S, &lv)))
        st = ts_tensor_copy_(lv, rows);
    ts_tensor_free(rows);
    ts_tensor_free(lv);
    return st;
}
