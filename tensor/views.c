/* View ops: new handles on the same storage with other geometry. Each is
 * differentiable; its backward maps the gradient back to the input's
 * shape. */
#define _GNU_SOURCE
#include "tensor/internal.h"

#include <string.h>

enum view_kind { V_VIEW, V_PERMUTE, V_NARROW, V_EXPAND, V_DETACH };

/* Node args: iargs[0..ndim) = input shape, dargs[0] = kind, dargs[1] =
 * input ndim. For permute, iargs[8..8+ndim) = dims (all 8 slots for an 8-d
 * tensor); for narrow/slice iargs[8] = dim, [9] = start, [10] = step. */

static ts_status view_backward(ts_node *n, ts_tensor **g, ts_tensor **gin)
{
    int in_ndim = (int)n->dargs[1];
    int64_t in_shape[TS_MAX_DIMS];
    memcpy(in_shape, n->iargs, sizeof in_shape);
    ts_tensor *go = g[0];
    switch ((enum view_kind)n->dargs[0]) {
    case V_VIEW: {
        ts_tensor *c;
        ts_status st = ts_contiguous(go, &c);
        if (st) return st;
        int64_t str[TS_MAX_DIMS];
        ts__contiguous_strides(in_ndim, in_shape, str);
        st = ts__tensor_alias(c, in_ndim, in_shape, str, c->offset, &gin[0]);
        ts_tensor_free(c);
        return st;
    }
    case V_PERMUTE: {
        int inv[TS_MAX_DIMS];
        for (int i = 0; i < in_ndim; i++) inv[n->iargs[TS_MAX_DIMS + i]] = i;
        ts_tensor *p;
        ts_status st = ts__tensor_alias(go, go->ndim, go->shape, go->strides, go->offset, &p);
        if (st) return st;
        for (int i = 0; i < in_ndim; i++) {
            p->shape[i] = go->shape[inv[i]];
            p->strides[i] = go->strides[inv[i]];
        }
        gin[0] = p;
        return TS_OK;
    }
    case V_NARROW: {
        int dim = (int)n->iargs[TS_MAX_DIMS];
        int64_t start = n->iargs[TS_MAX_DIMS + 1], step = n->iargs[TS_MAX_DIMS + 2];
        ts_tensor *z, *part;
        ts_status st = ts__tensor_new(go->dtype, in_ndim, in_shape, &z);
        if (st) return st;
        ts_tensor_fill_(z, 0.0);
        st = ts__tensor_alias(z, go->ndim, go->shape, z->strides, z->offset + start * z->strides[dim], &part);
        if (!st) {
            part->strides[dim] *= step;
            ts__copy_into("narrow backward", part, go);
            ts_tensor_free(part);
            gin[0] = z;
        } else {
            ts_tensor_free(z);
        }
        return st;
    }
    case V_EXPAND: return ts__reduce_to_shape(go, in_ndim, in_shape, &gin[0]);
    case V_DETACH: break;
    }
    return ts_error(TS_ERR_INTERNAL, "view backward: unknown kind");
}

/* Wraps a computed alias `v` of `t` as a differentiable view. */
static ts_status finish_view(const char *name, ts_tensor *t, ts_tensor *v, enum view_kind kind, const int64_t *extra,
                             int n_extra, ts_tensor **out)
{
    if (!out) {
        ts_tensor_free(v);
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: out is NULL", name);
    }
    v->is_shard = false;
    if (ts__needs_grad(1, &t)) {
        ts_node *n = ts__node_new(name, view_backward, 1, &t, 1);
        if (!n) {
            ts_tensor_free(v);
            return TS_ERR_NO_MEMORY;
        }
        n->dargs[0] = kind;
        memcpy(n->iargs, t->shape, sizeof t->shape);
        n->dargs[1] = t->ndim;
        for (int i = 0; i < n_extra; i++) n->iargs[TS_MAX_DIMS + i] = extra[i];
        ts__node_set_output(n, 0, v);
        ts__node_free(n);
    }
    *out = v;
    return TS_OK;
}

/* Strides for viewing t as `shape` without a copy, PyTorch's
 * computeStride: false when impossible. */
static bool view_strides(const ts_tensor *t, int ndim, const int64_t *shape, int64_t *strides)
{
    int64_t numel = ts__numel(t->ndim, t->shape);
    if (t->ndim == 0) {
        /* one element: any shape of numel 1 views it (PyTorch's rule) */
        for (int i = 0; i < ndim; i++) strides[i] = 1;
        return true;
    }
    if (numel == 0) {
        ts__contiguous_strides(ndim, shape, strides);
        return true;
    }
    int view_d = ndim - 1;
    int64_t chunk_base_stride = t->strides[t->ndim - 1];
    int64_t tensor_numel = 1, view_numel = 1;
    for (int td = t->ndim - 1; td >= 0; td--) {
        tensor_numel *= t->shape[td];
        if (td == 0 || (t->shape[td - 1] != 1 && t->strides[td - 1] != tensor_numel * chunk_base_stride)) {
            while (view_d >= 0 && (view_numel < tensor_numel || shape[view_d] == 1)) {
                strides[view_d] = view_numel * chunk_base_stride;
                view_numel *= shape[view_d];
                view_d--;
            }
            if (view_numel != tensor_numel) return false;
            if (td > 0) {
                chunk_base_stride = t->strides[td - 1];
                tensor_numel = 1;
                view_numel = 1;
            }
        }
    }
    return view_d == -1;
}

static ts_status infer_shape(const char *op, const ts_tensor *t, int ndim, const int64_t *shape, int64_t *out)
{
    if (ndim < 0 || ndim > TS_MAX_DIMS || (ndim && !shape))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %d dims requested (0 to %d allowed)", op, ndim, TS_MAX_DIMS);
    int infer = -1;
    int64_t known = 1, numel = ts__numel(t->ndim, t->shape);
    for (int i = 0; i < ndim; i++) {
        if (shape[i] == -1) {
            if (infer >= 0) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: only one dimension can be -1", op);
            infer = i;
        } else if (shape[i] < 0) {
            return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: invalid size %lld for dim %d", op, (long long)shape[i], i);
        } else if (__builtin_mul_overflow(known, shape[i], &known)) {
            char s1[96];
            return ts_error(TS_ERR_INVALID_ARGUMENT,
                            "%s: shape %s has more elements than int64 holds (dim %d of "
                            "size %lld overflows)",
                            op, ts_shape_str(ndim, shape, s1, sizeof s1), i, (long long)shape[i]);
        }
        out[i] = shape[i];
    }
    char s1[96], s2[96];
    if (infer >= 0) {
        if (known == 0 || numel % known)
            return ts_error(TS_ERR_SHAPE, "%s: shape %s is invalid for input of %lld elements %s", op,
                            ts_shape_str(ndim, shape, s1, sizeof s1), (long long)numel,
                            ts_shape_str(t->ndim, t->shape, s2, sizeof s2));
        out[infer] = numel / known;
    } else if (known != numel) {
        return ts_error(TS_ERR_SHAPE, "%s: shape %s is invalid for input of %lld elements %s", op,
                        ts_shape_str(ndim, shape, s1, sizeof s1), (long long)numel,
                        ts_shape_str(t->ndim, t->shape, s2, sizeof s2));
    }
    return TS_OK;
}

ts_status ts_view(ts_tensor *t, int ndim, const int64_t *shape, ts_tensor **out)
{
    if (!out || (ndim > 0 && !shape))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "view: %s is NULL", !out ? "out" : "shape");
    ts_status st = ts__check_inputs("view", 1, &t);
    if (st) return st;
    int64_t sh[TS_MAX_DIMS], str[TS_MAX_DIMS];
    if ((st = infer_shape("view", t, ndim, shape, sh))) return st;
    if (!view_strides(t, ndim, sh, str)) {
        char s1[96], s2[96], s3[96];
        return ts_error(TS_ERR_NOT_VIEWABLE,
                        "view: cannot view a tensor of shape %s and strides %s as %s without "
                        "a copy (its memory is not laid out compatibly); use ts_reshape",
                        ts_shape_str(t->ndim, t->shape, s1, sizeof s1),
                        ts_shape_str(t->ndim, t->strides, s2, sizeof s2), ts_shape_str(ndim, sh, s3, sizeof s3));
    }
    ts_tensor *v;
    if ((st = ts__tensor_alias(t, ndim, sh, str, t->offset, &v))) return st;
    return finish_view("view", t, v, V_VIEW, NULL, 0, out);
}

ts_status ts_reshape(ts_tensor *t, int ndim, const int64_t *shape, ts_tensor **out)
{
    if (!out || (ndim > 0 && !shape))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "reshape: %s is NULL", !out ? "out" : "shape");
    ts_status st = ts__check_inputs("reshape", 1, &t);
    if (st) return st;
    int64_t sh[TS_MAX_DIMS], str[TS_MAX_DIMS];
    if ((st = infer_shape("reshape", t, ndim, shape, sh))) return st;
    if (view_strides(t, ndim, sh, str)) return ts_view(t, ndim, sh, out);
    ts_tensor *c;
    if ((st = ts_contiguous(t, &c))) return st;
    st = ts_view(c, ndim, sh, out);
    ts_tensor_free(c);
    return st;
}

ts_status ts_permute(ts_tensor *t, const int *dims, ts_tensor **out)
{
    ts_status st = ts__check_inputs("permute", 1, &t);
    if (st) return st;
    if (t->ndim && !dims) return ts_error(TS_ERR_INVALID_ARGUMENT, "permute: dims is NULL");
    int64_t sh[TS_MAX_DIMS], str[TS_MAX_DIMS], extra[TS_MAX_DIMS];
    bool seen[TS_MAX_DIMS] = {0};
    for (int i = 0; i < t->ndim; i++) {
        int d;
        if ((st = ts__wrap_dim("permute", dims[i], t->ndim, &d))) return st;
        if (seen[d]) return ts_error(TS_ERR_INVALID_ARGUMENT, "permute: dim %d appears twice in the permutation", d);
        seen[d] = true;
        sh[i] = t->shape[d];
        str[i] = t->strides[d];
        extra[i] = d;
    }
    ts_tensor *v;
    if ((st = ts__tensor_alias(t, t->ndim, sh, str, t->offset, &v))) return st;
    return finish_view("permute", t, v, V_PERMUTE, extra, t->ndim, out);
}

ts_status ts_transpose(ts_tensor *t, int dim0, int dim1, ts_tensor **out)
{
    ts_status st = ts__check_inputs("transpose", 1, &t);
    if (st) return st;
    int a, b;
    if ((st = ts__wrap_dim("transpose", dim0, t->ndim, &a)) || (st = ts__wrap_dim("transpose", dim1, t->ndim, &b)))
        return st;
    int dims[TS_MAX_DIMS];
    for (int i = 0; i < TS_MAX_DIMS; i++) dims[i] = i;
    if (t->ndim == 0) return ts_permute(t, dims, out);
    dims[a] = b;
    dims[b] = a;
    return ts_permute(t, dims, out);
}

ts_status ts_slice(ts_tensor *t, int dim, int64_t start, int64_t end, int64_t step, ts_tensor **out)
{
    ts_status st = ts__check_inputs("slice", 1, &t);
    if (st) return st;
    int d;
    if (t->ndim == 0) return ts_error(TS_ERR_INDEX, "slice: cannot slice a 0-d tensor");
    if ((st = ts__wrap_dim("slice", dim, t->ndim, &d))) return st;
    if (step < 1) return ts_error(TS_ERR_INVALID_ARGUMENT, "slice: step must be positive, got %lld", (long long)step);
    int64_t size = t->shape[d];
    if (start < 0) start += size;
    if (end < 0) end += size;
    start = start < 0 ? 0 : start > size ? size : start;
    end = end < start ? start : end > size ? size : end;
    /* ceil((end - start) / step) without forming end - start + step - 1,
     * which overflows for a step near INT64_MAX */
    int64_t len = (end - start) / step + ((end - start) % step != 0);
    /* the new stride, stride * step, cannot overflow when two elements are
     * taken (both lie in the storage); for one or none it is never used to
     * step, and a step near INT64_MAX would overflow it: keep the stride */
    int64_t stride;
    if (__builtin_mul_overflow(t->strides[d], step, &stride)) stride = t->strides[d];
    int64_t sh[TS_MAX_DIMS], str[TS_MAX_DIMS];
    memcpy(sh, t->shape, sizeof sh);
    memcpy(str, t->strides, sizeof str);
    sh[d] = len;
    str[d] = stride;
    ts_tensor *v;
    if ((st = ts__tensor_alias(t, t->ndim, sh, str, t->offset + (len ? start * t->strides[d] : 0), &v))) return st;
    int64_t extra[3] = {d, start, step};
    return finish_view("slice", t, v, V_NARROW, extra, 3, out);
}

ts_status ts_narrow(ts_tensor *t, int dim, int64_t start, int64_t length, ts_tensor **out)
{
    ts_status st = ts__check_inputs("narrow", 1, &t);
    if (st) return st;
    int d;
    if (t->ndim == 0) return ts_error(TS_ERR_INDEX, "narrow: cannot narrow a 0-d tensor");
    if ((st = ts__wrap_dim("narrow", dim, t->ndim, &d))) return st;
    if (start < 0) start += t->shape[d];
    if (start < 0 || length < 0 || start > t->shape[d] || length > t->shape[d] - start)
        return ts_error(TS_ERR_INDEX, "narrow: start %lld and length %lld do not fit dim %d of size %lld",
                        (long long)start, (long long)length, d, (long long)t->shape[d]);
    return ts_slice(t, d, start, start + length, 1, out);
}

ts_status ts_expand(ts_tensor *t, int ndim, const int64_t *shape, ts_tensor **out)
{
    if (!out || (ndim > 0 && !shape))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "expand: %s is NULL", !out ? "out" : "shape");
    ts_status st = ts__check_inputs("expand", 1, &t);
    if (st) return st;
    char s1[96], s2[96];
    if (ndim < t->ndim || ndim > TS_MAX_DIMS)
        return ts_error(TS_ERR_SHAPE, "expand: cannot expand %s to %d dims",
                        ts_shape_str(t->ndim, t->shape, s1, sizeof s1), ndim);
    int64_t sh[TS_MAX_DIMS], str[TS_MAX_DIMS];
    for (int i = 0; i < ndim; i++) {
        int it = t->ndim - ndim + i;
        int64_t want = shape[i];
        if (it < 0) {
            if (want < 0) return ts_error(TS_ERR_SHAPE, "expand: size -1 is not allowed for new leading dim %d", i);
            sh[i] = want;
            str[i] = 0;
        } else if (want == -1 || want == t->shape[it]) {
            sh[i] = t->shape[it];
            str[i] = t->strides[it];
        } else if (t->shape[it] == 1 && want >= 0) {
            sh[i] = want;
            str[i] = 0;
        } else {
            return ts_error(TS_ERR_SHAPE,
                            "expand: the size of %s at dim %d (%lld) must match %lld in %s (only size-1 "
                            "dims expand)",
                            ts_shape_str(t->ndim, t->shape, s1, sizeof s1), it, (long long)t->shape[it],
                            (long long)want, ts_shape_str(ndim, shape, s2, sizeof s2));
        }
    }
    ts_tensor *v;
    if ((st = ts__tensor_alias(t, ndim, sh, str, t->offset, &v))) return st;
    return finish_view("expand", t, v, V_EXPAND, NULL, 0, out);
}

ts_status ts_squeeze(ts_tensor *t, int dim, ts_tensor **out)
{
    ts_status st = ts__check_inputs("squeeze", 1, &t);
    if (st) return st;
    int d;
    if ((st = ts__wrap_dim("squeeze", dim, t->ndim, &d))) return st;
    if (t->ndim == 0 || t->shape[d] != 1) return ts_view(t, t->ndim, t->shape, out);
    int64_t sh[TS_MAX_DIMS];
    int k = 0;
    for (int i = 0; i < t->ndim; i++)
        if (i != d) sh[k++] = t->shape[i];
    return ts_view(t, k, sh, out);
}

ts_status ts_unsqueeze(ts_tensor *t, int dim, ts_tensor **out)
{
    ts_status st = ts__check_inputs("unsqueeze", 1, &t);
    if (st) return st;
    if (t->ndim >= TS_MAX_DIMS)
        return ts_error(TS_ERR_SHAPE, "unsqueeze: tensor already has %d dims (the maximum)", TS_MAX_DIMS);
    int d;
    if ((st = ts__wrap_dim("unsqueeze", dim, t->ndim + 1, &d))) return st;
    int64_t sh[TS_MAX_DIMS], str[TS_MAX_DIMS];
    for (int i = 0, k = 0; i <= t->ndim; i++) {
        if (i == d) {
            sh[i] = 1;
            str[i] = (k < t->ndim) ? t->strides[k] * t->shape[k] : 1;
        } else {
            sh[i] = t->shape[k];
            str[i] = t->strides[k];
            k++;
        }
    }
    ts_tensor *v;
    if ((st = ts__tensor_alias(t, t->ndim + 1, sh, str, t->offset, &v))) return st;
    return finish_view("unsqueeze", t, v, V_VIEW, NULL, 0, out);
}

ts_status ts_detach(ts_tensor *t, ts_tensor **out)
{
    if (!t || !out) return ts_error(TS_ERR_INVALID_ARGUMENT, "detach: NULL argument");
    ts_status st = ts__tensor_alias(t, t->ndim, t->shape, t->strides, t->offset, out);
    /* a detached shard stays marked (ops still refuse it), but does not
     * carry the owner's metadata pointer, which may die before it */
    if (!st) (*out)->is_shard = t->is_shard;
    return st;
}

static ts_status copy_backward(ts_node *n, ts_tensor **g, ts_tensor **gin)
{
    return ts_to_dtype(g[0], (ts_dtype)n->iargs[0], &gin[0]);
}

ts_status ts__copy_op(const char *name, ts_tensor *t, ts_dtype dtype, ts_tensor **out)
{
    ts_tensor *c;
    ts_status st = ts__tensor_new(dtype, t->ndim, t->shape, &c);
    if (st) return st;
    ts__copy_into(name, c, t);
    if (ts__needs_grad(1, &t) && ts_dtype_is_float(dtype)) {
        ts_node *n = ts__node_new(name, copy_backward, 1, &t, 1);
        if (!n) {
            ts_tensor_free(c);
            return TS_ERR_NO_MEMORY;
        }
        n->iargs[0] = t->dtype;
        ts__node_set_output(n, 0, c);
        ts__node_free(n);
    }
    *out = c;
    return TS_OK;
}

ts_status ts_contiguous(ts_tensor *t, ts_tensor **out)
{
    ts_status st = ts__check_inputs("contiguous", 1, &t);
    if (st) return st;
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "contiguous: out is NULL");
    if (ts__is_contiguous(t)) {
        *out = ts_tensor_retain(t);
        return TS_OK;
    }
    return ts__copy_op("contiguous", t, t->dtype, out);
}

ts_status ts_clone(ts_tensor *t, ts_tensor **out)
{
    ts_status st = ts__check_inputs("clone", 1, &t);
    if (st) return st;
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "clone: out is NULL");
    return ts__copy_op("clone", t, t->dtype, out);
}

ts_status ts_to_dtype(ts_tensor *a, ts_dtype dtype, ts_tensor **out)
{
    ts_status st = ts__check_inputs("to_dtype", 1, &a);
    if (st) return st;
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "to_dtype: out is NULL");
    if ((unsigned)dtype >= TS_DTYPE_COUNT)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "to_dtype: invalid dtype %d", (int)dtype);
    if (a->dtype == dtype) {
        *out = ts_tensor_retain(a);
        return TS_OK;
    }
    return ts__copy_op("to_dtype", a, dtype, out);
}
