/* cat, split/chunk, where, masked_fill, tril mask. */
#define _GNU_SOURCE
#include "tensor/internal.h"

#include <string.h>

/* ----------------------------------------------------- cat */

/* Node: iargs[0] = dim; ctx = the inputs' sizes along dim (n_inputs
 * entries, any number of inputs). */
static void cat_lengths_free(void *ctx) { ts__free(TS_MEM_AUTOGRAD, ctx); }

static ts_status cat_backward(ts_node *n, ts_tensor **g, ts_tensor **gin)
{
    int dim = (int)n->iargs[0];
    const int64_t *lengths = n->ctx;
    int64_t start = 0;
    for (int j = 0; j < n->n_inputs; j++) {
        int64_t len = lengths[j];
        if (ts__node_needs_input_grad(n, j)) {
            ts_tensor *v;
            ts_status st = ts_narrow(g[0], dim, start, len, &v);
            if (st) return st;
            st = ts_contiguous(v, &gin[j]);
            ts_tensor_free(v);
            if (st) return st;
        }
        start += len;
    }
    return TS_OK;
}

ts_status ts_cat(int n, ts_tensor *const *tensors, int dim, ts_tensor **out)
{
    if (n <= 0 || !tensors || !out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "cat: need at least one tensor (got %d) and an out pointer", n);
    ts_status st = ts__check_inputs("cat", n, tensors);
    if (st) return st;
    const ts_tensor *t0 = tensors[0];
    int d;
    if (t0->ndim == 0) return ts_error(TS_ERR_SHAPE, "cat: zero-dimensional tensor 0 cannot be concatenated");
    if ((st = ts__wrap_dim("cat", dim, t0->ndim, &d))) return st;
    int64_t shape[TS_MAX_DIMS];
    memcpy(shape, t0->shape, sizeof shape);
    shape[d] = 0;
    for (int i = 0; i < n; i++) {
        const ts_tensor *t = tensors[i];
        if (t->dtype != t0->dtype)
            return ts_error(TS_ERR_DTYPE, "cat: tensor %d has dtype %s, tensor 0 has %s", i, ts_dtype_name(t->dtype),
                            ts_dtype_name(t0->dtype));
        bool ok = t->ndim == t0->ndim;
        for (int k = 0; ok && k < t->ndim; k++) ok = k == d || t->shape[k] == t0->shape[k];
        if (!ok) {
            char s1[96], s2[96];
            return ts_error(TS_ERR_SHAPE,
                            "cat: tensor %d of shape %s does not match tensor 0 of shape %s outside dim "
                            "%d",
                            i, ts_shape_str(t->ndim, t->shape, s1, sizeof s1),
                            ts_shape_str(t0->ndim, t0->shape, s2, sizeof s2), d);
        }
        shape[d] += t->shape[d];
    }
    ts_tensor *o;
    if ((st = ts__tensor_new(t0->dtype, t0->ndim, shape, &o))) return st;
    int64_t start = 0;
    for (int i = 0; i < n && !st; i++) {
        ts_tensor *part;
        int64_t sh[TS_MAX_DIMS];
        memcpy(sh, shape, sizeof sh);
        sh[d] = tensors[i]->shape[d];
        if (!(st = ts__tensor_alias(o, o->ndim, sh, o->strides, o->offset + start * o->strides[d], &part))) {
            ts__copy_into("cat", part, tensors[i]);
            ts_tensor_free(part);
        }
        start += tensors[i]->shape[d];
    }
    if (!st && ts__needs_grad(n, tensors)) {
        ts_node *nd = ts__node_new("cat", cat_backward, n, tensors, 1);
        int64_t *lengths = nd ? ts__malloc(TS_MEM_AUTOGRAD, (size_t)n * sizeof *lengths) : NULL;
        if (!lengths) {
            if (nd) ts__node_free(nd);
            st = TS_ERR_NO_MEMORY;
        } else {
            nd->iargs[0] = d;
            for (int i = 0; i < n; i++) lengths[i] = tensors[i]->shape[d];
            nd->ctx = lengths;
            nd->ctx_free = cat_lengths_free;
            ts__node_set_output(nd, 0, o);
            ts__node_free(nd);
        }
    }
    if (st) {
        ts_tensor_free(o);
        return st;
    }
    *out = o;
    return TS_OK;
}

/* ----------------------------------------------------- split / chunk */

static ts_status split_backward(ts_node *n, ts_tensor **g, ts_tensor **gin)
{
    if (n->n_outputs == 1) return ts_contiguous(g[0], &gin[0]);
    return ts_cat(n->n_outputs, g, (int)n->iargs[0], &gin[0]);
}

ts_status ts_split(ts_tensor *a, int64_t split_size, int dim, int max_out, ts_tensor **outs, int *n_out)
{
    ts_status st = ts__check_inputs("split", 1, &a);
    if (st) return st;
    if (!outs || !n_out) return ts_error(TS_ERR_INVALID_ARGUMENT, "split: outs and n_out must not be NULL");
    int d;
    if (a->ndim == 0) return ts_error(TS_ERR_SHAPE, "split: a 0-d tensor cannot be split");
    if ((st = ts__wrap_dim("split", dim, a->ndim, &d))) return st;
    int64_t size = a->shape[d];
    if (split_size <= 0 && !(split_size == 0 && size == 0))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "split: split_size must be positive, got %lld", (long long)split_size);
    /* ceil(size / split_size) without size + split_size - 1, which
     * overflows for a huge split_size */
    int64_t pieces = size == 0 ? 1 : size / split_size + (size % split_size != 0);
    if (pieces > max_out)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "split: dim %d of size %lld in pieces of %lld makes %lld tensors, but "
                        "outs has room for %d",
                        d, (long long)size, (long long)split_size, (long long)pieces, max_out);
    /* views of the pieces, recorded as ONE node whose backward concatenates
     * the pieces' gradients (zeros where none flowed), as PyTorch's
     * SplitBackward: per-piece narrow nodes would each scatter into a full
     * zero tensor */
    for (int64_t i = 0; i < pieces; i++) {
        int64_t start = i * split_size, len = size - start < split_size ? size - start : split_size;
        int64_t sh[TS_MAX_DIMS];
        memcpy(sh, a->shape, sizeof sh);
        sh[d] = len;
        if ((st = ts__tensor_alias(a, a->ndim, sh, a->strides, a->offset + (len ? start * a->strides[d] : 0),
                                   &outs[i]))) {
            for (int64_t j = 0; j < i; j++) ts_tensor_free(outs[j]);
            return st;
        }
    }
    if (ts__needs_grad(1, &a)) {
        ts_node *n = ts__node_new("split", split_backward, 1, &a, (int)pieces);
        if (!n) {
            for (int64_t j = 0; j < pieces; j++) ts_tensor_free(outs[j]);
            return TS_ERR_NO_MEMORY;
        }
        n->iargs[0] = d;
        for (int64_t i = 0; i < pieces; i++) ts__node_set_output(n, (int)i, outs[i]);
        ts__node_free(n);
    }
    *n_out = (int)pieces;
    return TS_OK;
}

ts_status ts_chunk(ts_tensor *a, int chunks, int dim, int max_out, ts_tensor **outs, int *n_out)
{
    ts_status st = ts__check_inputs("chunk", 1, &a);
    if (st) return st;
    if (chunks <= 0)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "chunk: number of chunks must be positive, got %d", chunks);
    int d;
    if (a->ndim == 0) return ts_error(TS_ERR_SHAPE, "chunk: a 0-d tensor cannot be chunked");
    if ((st = ts__wrap_dim("chunk", dim, a->ndim, &d))) return st;
    int64_t size = a->shape[d], each = (size + chunks - 1) / chunks;
    if (size > 0) return ts_split(a, each, d, max_out, outs, n_out);
    /* an empty dim gives `chunks` empty pieces, as torch.chunk does (split
     * would give one) */
    if (!outs || !n_out) return ts_error(TS_ERR_INVALID_ARGUMENT, "chunk: outs and n_out must not be NULL");
    if (chunks > max_out)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "chunk: dim %d of size 0 in %d chunks makes %d tensors, but outs "
                        "has room for %d",
                        d, chunks, chunks, max_out);
    for (int i = 0; i < chunks; i++) {
        if ((st = ts_narrow(a, d, 0, 0, &outs[i]))) {
            for (int j = 0; j < i; j++) ts_tensor_free(outs[j]);
            return st;
        }
    }
    *n_out = chunks;
    return TS_OK;
}

/* ----------------------------------------------------- where / masked_fill */

/* saved[0] = cond; saved[1], saved[2] = aliases of a and b, kept for
 * their shapes only (their data is not read). */
static ts_status where_backward(ts_node *n, ts_tensor **g, ts_tensor **gin)
{
    ts_tensor *cond = n->saved[0];
    ts_status st = TS_OK;
    for (int j = 0; j < 2 && !st; j++) {
        int slot = j + 1; /* inputs 1 (a) and 2 (b) of where */
        if (!ts__node_needs_input_grad(n, slot)) continue;
        ts_tensor *z, *full;
        if ((st = ts_tensor_zeros(g[0]->dtype, 0, NULL, &z))) return st;
        st = j == 0 ? ts_where(cond, g[0], z, &full) : ts_where(cond, z, g[0], &full);
        ts_tensor_free(z);
        if (st) return st;
        ts_tensor *shape_of = n->saved[slot];
        st = ts__reduce_to_shape(full, shape_of->ndim, shape_of->shape, &gin[slot]);
        ts_tensor_free(full);
    }
    return st;
}

ts_status ts_where(ts_tensor *cond, ts_tensor *a, ts_tensor *b, ts_tensor **out)
{
    ts_tensor *in[3] = {cond, a, b};
    ts_status st;
    if ((st = ts__check_inputs("where", 3, in)) || (st = ts__check_same_dtype("where", a, b))) return st;
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "where: out is NULL");
    if (cond->dtype != TS_BOOL)
        return ts_error(TS_ERR_DTYPE, "where: condition must be bool, got %s", ts_dtype_name(cond->dtype));
    int nd1, nd;
    int64_t s1[TS_MAX_DIMS], shape[TS_MAX_DIMS];
    if ((st = ts__broadcast_shape("where", cond->ndim, cond->shape, a->ndim, a->shape, &nd1, s1)) ||
        (st = ts__broadcast_shape("where", nd1, s1, b->ndim, b->shape, &nd, shape)))
        return st;
    ts_tensor *o;
    if ((st = ts__tensor_new(a->dtype, nd, shape, &o))) return st;
    int64_t n = ts_tensor_numel(o);
    if (n > 0 && !ts__is_meta(o)) {
        int64_t sc[TS_MAX_DIMS], sa[TS_MAX_DIMS], sb[TS_MAX_DIMS], idx[TS_MAX_DIMS] = {0};
        ts__broadcast_strides(cond, nd, shape, sc);
        ts__broadcast_strides(a, nd, shape, sa);
        ts__broadcast_strides(b, nd, shape, sb);
        const uint8_t *cp = ts_tensor_data(cond);
        const char *ap = ts_tensor_data(a), *bp = ts_tensor_data(b);
        char *op_ = ts_tensor_data(o);
        int64_t es = (int64_t)ts_dtype_size(a->dtype);
        /* outer dims by odometer, the last dim as a strided inner loop */
        int64_t inner = nd ? shape[nd - 1] : 1, ic = nd ? sc[nd - 1] : 0, ia = nd ? sa[nd - 1] : 0,
                ib = nd ? sb[nd - 1] : 0;
        int64_t oc = 0, oa = 0, ob = 0;
        for (int64_t base = 0; base < n; base += inner) {
            if (es == 4) {
                const float *af = (const float *)ap + oa, *bf = (const float *)bp + ob;
                float *of = (float *)op_ + base;
                const uint8_t *c = cp + oc;
                for (int64_t i = 0; i < inner; i++) of[i] = c[i * ic] ? af[i * ia] : bf[i * ib];
            } else if (es == 2) {
                const uint16_t *ah = (const uint16_t *)ap + oa, *bh = (const uint16_t *)bp + ob;
                uint16_t *oh = (uint16_t *)op_ + base;
                const uint8_t *c = cp + oc;
                for (int64_t i = 0; i < inner; i++) oh[i] = c[i * ic] ? ah[i * ia] : bh[i * ib];
            } else {
                for (int64_t i = 0; i < inner; i++)
                    memcpy(op_ + (base + i) * es, cp[oc + i * ic] ? ap + (oa + i * ia) * es : bp + (ob + i * ib) * es,
                           (size_t)es);
            }
            for (int k = nd - 2; k >= 0; k--) {
                if (++idx[k] < shape[k]) {
                    oc += sc[k];
                    oa += sa[k];
                    ob += sb[k];
                    break;
                }
                oc -= sc[k] * (shape[k] - 1);
                oa -= sa[k] * (shape[k] - 1);
                ob -= sb[k] * (shape[k] - 1);
                idx[k] = 0;
            }
        }
    }
    if (ts__needs_grad(3, in)) {
        ts_node *nd_ = ts__node_new("where", where_backward, 3, in, 1);
        if (!nd_) st = TS_ERR_NO_MEMORY;
        else {
            st = ts__node_save(nd_, 0, cond);
            if (!st) st = ts__node_save(nd_, 1, a);
            if (!st) st = ts__node_save(nd_, 2, b);
            if (!st) ts__node_set_output(nd_, 0, o);
            ts__node_free(nd_);
        }
    }
    if (st) {
        ts_tensor_free(o);
        return st;
    }
    *out = o;
    return TS_OK;
}

ts_status ts_masked_fill(ts_tensor *a, ts_tensor *mask, double value, ts_tensor **out)
{
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "masked_fill: out is NULL");
    ts_tensor *in[2] = {a, mask};
    ts_status st = ts__check_inputs("masked_fill", 2, in);
    if (st) return st;
    if (mask->dtype != TS_BOOL)
        return ts_error(TS_ERR_DTYPE, "masked_fill: mask must be bool, got %s", ts_dtype_name(mask->dtype));
    int nd;
    int64_t shape[TS_MAX_DIMS];
    if ((st = ts__broadcast_shape("masked_fill", a->ndim, a->shape, mask->ndim, mask->shape, &nd, shape))) return st;
    if (nd != a->ndim || memcmp(shape, a->shape, (size_t)nd * sizeof *shape) != 0) {
        char s1[96], s2[96];
        return ts_error(TS_ERR_SHAPE, "masked_fill: mask of shape %s does not broadcast to the input shape %s",
                        ts_shape_str(mask->ndim, mask->shape, s1, sizeof s1),
                        ts_shape_str(a->ndim, a->shape, s2, sizeof s2));
    }
    ts_tensor *v;
    if ((st = ts__check_scalar("masked_fill", a->dtype, value)) || (st = ts_tensor_full(a->dtype, 0, NULL, value, &v)))
        return st;
    st = ts_where(mask, v, a, out);
    ts_tensor_free(v);
    return st;
}

ts_status ts_tril_mask(int64_t n, int64_t diagonal, ts_tensor **out)
{
    if (n < 0 || !out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "tril_mask: size must be >= 0 (got %lld) and out non-NULL",
                        (long long)n);
    int64_t sh[2] = {n, n}, nn;
    if (__builtin_mul_overflow(n, n, &nn))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "tril_mask: a (%lld, %lld) mask has more elements than int64 holds",
                        (long long)n, (long long)n);
    ts_tensor *m;
    ts_status st = ts_tensor_empty(TS_BOOL, 2, sh, &m);
    if (st) return st;
    uint8_t *p = ts_tensor_data(m);
    for (int64_t r = 0; r < n && p; r++) /* p NULL: a meta mask */
        for (int64_t c = 0; c < n; c++)
            p[r * n + c] = c - r <= diagonal; /* c <= r + diagonal, which overflows for a huge diagonal */
    *out = m;
    return TS_OK;
}
