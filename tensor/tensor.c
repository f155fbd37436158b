#define _GNU_SOURCE
#include "tensor/internal.h"
#include "tensor/kernels.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* ------------------------------------------------------------ geometry */

int64_t ts__numel(int ndim, const int64_t *shape)
{
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= shape[i];
    return n;
}

void ts__contiguous_strides(int ndim, const int64_t *shape, int64_t *strides)
{
    int64_t s = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        strides[i] = s;
        s *= shape[i] > 1 ? shape[i] : 1;
    }
}

bool ts__is_contiguous(const ts_tensor *t)
{
    int64_t s = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (t->shape[i] == 0) return true;
        if (t->shape[i] != 1 && t->strides[i] != s) return false;
        s *= t->shape[i];
    }
    return true;
}

char *ts_shape_str(int ndim, const int64_t *shape, char *buf, size_t len)
{
    size_t n = 0;
    if (!buf || len == 0 || ndim < 0 || ndim > TS_MAX_DIMS || (!shape && ndim > 0)) return NULL;
    buf[0] = '\0';
    n += (size_t)snprintf(buf + n, len - n, "(");
    for (int i = 0; i < ndim && n < len; i++)
        n += (size_t)snprintf(buf + n, len - n, i ? ", %lld" : "%lld", (long long)shape[i]);
    if (ndim == 1 && n < len) n += (size_t)snprintf(buf + n, len - n, ",");
    if (n < len) snprintf(buf + n, len - n, ")");
    return buf;
}

ts_status ts__wrap_dim(const char *op, int dim, int ndim, int *out)
{
    int n = ndim > 0 ? ndim : 1;
    if (dim < -n || dim >= n)
        return ts_error(TS_ERR_INDEX,
                        "%s: dimension %d is out of range for a tensor of %d dims (expected "
                        "[%d, %d])",
                        op, dim, ndim, -n, n - 1);
    *out = dim < 0 ? dim + n : dim;
    return TS_OK;
}

/* ------------------------------------------------------------ handles */

static ts_status check_shape(const char *op, ts_dtype dtype, int ndim, const int64_t *shape)
{
    if ((unsigned)dtype >= TS_DTYPE_COUNT)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: invalid dtype %d", op, (int)dtype);
    if (ndim < 0 || ndim > TS_MAX_DIMS)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %d dims requested; tensors have 0 to %d dims", op, ndim,
                        TS_MAX_DIMS);
    if (ndim > 0 && !shape) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: shape is NULL for %d dims", op, ndim);
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0)
            return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: size %lld of dim %d is negative", op, (long long)shape[i], i);
        if (shape[i] && n > INT64_MAX / 16 / shape[i]) {
            char buf[96];
            return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: shape %s has too many elements (dim %d of size %lld)", op,
                            ts_shape_str(ndim, shape, buf, sizeof buf), i, (long long)shape[i]);
        }
        n *= shape[i];
    }
    return TS_OK;
}

static ts_status fill(ts_tensor *t, double value);

static ts_tensor *handle_new(void)
{
    ts_tensor *t = ts__calloc(TS_MEM_TENSOR, 1, sizeof *t);
    if (t) atomic_init(&t->refcount, 1);
    return t;
}

/* A contiguous handle over fresh storage: a pool block, or a meta storage
 * (no bytes). */
static ts_status tensor_new(bool meta, ts_dtype dtype, int ndim, const int64_t *shape, ts_tensor **out)
{
    ts_tensor *t = handle_new();
    if (!t) return TS_ERR_NO_MEMORY;
    t->dtype = dtype;
    t->device = meta ? TS_DEVICE_META : TS_DEVICE_CPU;
    t->ndim = ndim;
    if (ndim) memcpy(t->shape, shape, (size_t)ndim * sizeof *shape);
    ts__contiguous_strides(ndim, shape, t->strides);
    size_t nbytes = (size_t)ts__numel(ndim, shape) * ts_dtype_size(dtype);
    ts_status st = meta ? ts__storage_new_meta(nbytes, &t->storage) : ts__storage_new(nbytes, &t->storage);
    if (st) {
        ts__free(TS_MEM_TENSOR, t);
        return st;
    }
    *out = t;
    return TS_OK;
}

ts_status ts__tensor_new(ts_dtype dtype, int ndim, const int64_t *shape, ts_tensor **out)
{
    return tensor_new(ts__meta_mode(), dtype, ndim, shape, out);
}

ts_status ts_tensor_new_cpu(bool zero, ts_dtype dtype, int ndim, const int64_t *shape, ts_tensor **out)
{
    ts_status st = ts_device_scope_enter(TS_DEVICE_CPU);
    if (st) return st;
    st = zero ? ts_tensor_zeros(dtype, ndim, shape, out) : ts_tensor_empty(dtype, ndim, shape, out);
    ts_status ex = ts_device_scope_exit();
    return st ? st : ex;
}

bool ts_tensor_is_meta(const ts_tensor *t) { return ts__is_meta(t); }

ts_status ts__tensor_new_meta(ts_dtype dtype, int ndim, const int64_t *shape, ts_tensor **out)
{
    return tensor_new(true, dtype, ndim, shape, out);
}

ts_status ts__tensor_alias(const ts_tensor *t, int ndim, const int64_t *shape, const int64_t *strides, int64_t offset,
                           ts_tensor **out)
{
    ts_tensor *v = handle_new();
    if (!v) return TS_ERR_NO_MEMORY;
    v->dtype = t->dtype;
    v->device = t->device;
    v->ndim = ndim;
    if (ndim) {
        memcpy(v->shape, shape, (size_t)ndim * sizeof *shape);
        memcpy(v->strides, strides, (size_t)ndim * sizeof *strides);
    }
    v->offset = offset;
    v->storage = t->storage;
    ts__storage_retain(v->storage);
    *out = v;
    return TS_OK;
}

ts_status ts_tensor_empty(ts_dtype dtype, int ndim, const int64_t *shape, ts_tensor **out)
{
    ts_status st = check_shape("ts_tensor_empty", dtype, ndim, shape);
    if (st) return st;
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_tensor_empty: out is NULL");
    return ts__tensor_new(dtype, ndim, shape, out);
}

ts_status ts_tensor_full(ts_dtype dtype, int ndim, const int64_t *shape, double value, ts_tensor **out)
{
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_tensor_full: out is NULL");
    ts_tensor *t;
    ts_status st = check_shape("ts_tensor_full", dtype, ndim, shape);
    if (st || (st = ts__check_scalar("ts_tensor_full", dtype, value)) || (st = ts__tensor_new(dtype, ndim, shape, &t)))
        return st;
    fill(t, value);
    *out = t;
    return TS_OK;
}

ts_status ts_tensor_zeros(ts_dtype dtype, int ndim, const int64_t *shape, ts_tensor **out)
{
    return ts_tensor_full(dtype, ndim, shape, 0.0, out);
}

ts_status ts_tensor_ones(ts_dtype dtype, int ndim, const int64_t *shape, ts_tensor **out)
{
    return ts_tensor_full(dtype, ndim, shape, 1.0, out);
}

ts_status ts_tensor_from_data(ts_dtype dtype, int ndim, const int64_t *shape, const void *data, ts_tensor **out)
{
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_tensor_from_data: out is NULL");
    ts_tensor *t;
    ts_status st = ts_tensor_empty(dtype, ndim, shape, &t);
    if (st) return st;
    size_t n = (size_t)ts__numel(ndim, shape) * ts_dtype_size(dtype);
    if (n && !data) {
        ts_tensor_free(t);
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_tensor_from_data: data is NULL for %zu bytes", n);
    }
    if (n && !ts__is_meta(t)) /* a meta tensor takes the shape only */
        memcpy(ts_tensor_data(t), data, n);
    *out = t;
    return TS_OK;
}

ts_status ts_tensor_scalar(ts_dtype dtype, double value, ts_tensor **out)
{
    if ((unsigned)dtype < TS_DTYPE_COUNT) {
        ts_status st = ts__check_scalar("ts_tensor_scalar", dtype, value);
        if (st) return st;
    }
    return ts_tensor_full(dtype, 0, NULL, value, out);
}

ts_status ts_tensor_arange(ts_dtype dtype, double start, double end, double step, ts_tensor **out)
{
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_tensor_arange: out is NULL");
    if (step == 0 || !isfinite(start) || !isfinite(end) || !isfinite(step) || (step > 0 && end < start) ||
        (step < 0 && end > start))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_tensor_arange: cannot step from %g to %g by %g", start, end, step);
    /* torch's size check: the count must fit int64 (NaN fails too) */
    double count = ceil((end - start) / step);
    if (!(count < 9223372036854775808.0))
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "ts_tensor_arange: %g elements from %g to %g by %g cannot be counted in int64", count, start,
                        end, step);
    int64_t n = (int64_t)count;
    ts_tensor *t;
    ts_status st = ts_tensor_empty(dtype, 1, &n, &t);
    if (st) return st;
    /* integer elements must fit the dtype (the first and the last are the
     * extremes) */
    if (n && !ts_dtype_is_float(dtype) && dtype != TS_BOOL &&
        ((st = ts__check_scalar("ts_tensor_arange", dtype, start)) ||
         (st = ts__check_scalar("ts_tensor_arange", dtype, start + (double)(n - 1) * step)))) {
        ts_tensor_free(t);
        return st;
    }
    void *d = ts_tensor_data(t);
    for (int64_t i = 0; i < n && d; i++) /* d NULL: a meta tensor */
        ts__store(dtype, d, i, start + (double)i * step);
    *out = t;
    return TS_OK;
}

ts_tensor *ts_tensor_retain(ts_tensor *t)
{
    if (t) atomic_fetch_add_explicit(&t->refcount, 1, memory_order_relaxed);
    return t;
}

void ts_tensor_free(ts_tensor *t)
{
    if (!t || atomic_fetch_sub_explicit(&t->refcount, 1, memory_order_acq_rel) != 1) return;
    ts_tensor_free(t->grad);
    if (t->grad_fn) ts__node_free(t->grad_fn);
    ts__storage_release_ref(t->storage);
    ts__free(TS_MEM_TENSOR, t->name);
    ts__free(TS_MEM_TENSOR, t);
}

/* The accessors give a neutral value for NULL (tensor.h lists them). */
ts_dtype ts_tensor_dtype(const ts_tensor *t) { return t ? t->dtype : TS_DTYPE_COUNT; }
/* From the storage, so that materializing a storage in place makes every
 * tensor over it a CPU tensor. */
ts_device ts_tensor_device(const ts_tensor *t) { return ts__is_meta(t) ? TS_DEVICE_META : TS_DEVICE_CPU; }
int ts_tensor_ndim(const ts_tensor *t) { return t ? t->ndim : 0; }
const int64_t *ts_tensor_shape(const ts_tensor *t) { return t ? t->shape : NULL; }
const int64_t *ts_tensor_strides(const ts_tensor *t) { return t ? t->strides : NULL; }
int64_t ts_tensor_offset(const ts_tensor *t) { return t ? t->offset : 0; }
int64_t ts_tensor_numel(const ts_tensor *t) { return t ? ts__numel(t->ndim, t->shape) : 0; }
bool ts_tensor_is_contiguous(const ts_tensor *t) { return t && ts__is_contiguous(t); }
ts_storage *ts_tensor_storage(const ts_tensor *t) { return t ? t->storage : NULL; }

int64_t ts_tensor_size(const ts_tensor *t, int dim)
{
    if (!t) return -1;
    if (dim < -t->ndim || dim >= t->ndim) return -1;
    return t->shape[dim < 0 ? dim + t->ndim : dim];
}

void *ts_tensor_data(const ts_tensor *t)
{
    if (!t || t->storage->released || t->storage->meta) return NULL;
    return (char *)t->storage->data + t->offset * (int64_t)ts_dtype_size(t->dtype);
}

char *ts_tensor_shape_str(const ts_tensor *t, char *buf, size_t len)
{
    if (!t || !buf || len == 0) return NULL;
    return ts_shape_str(t->ndim, t->shape, buf, len);
}

ts_status ts_tensor_set_name(ts_tensor *t, const char *name)
{
    if (!t) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_tensor_set_name: tensor is NULL");
    char *n = NULL;
    if (name && !(n = ts__strdup(TS_MEM_TENSOR, name))) return TS_ERR_NO_MEMORY;
    ts__free(TS_MEM_TENSOR, t->name);
    t->name = n;
    return TS_OK;
}

const char *ts_tensor_name(const ts_tensor *t) { return t && t->name ? t->name : ""; }

/* ------------------------------------------------------------ checks */

/* [Note: meta initializers] The initializers write values without reading
 * any (the random fills, fill_, the init.c schemes built on them): on a
 * meta tensor they check their arguments and change nothing (the
 * deferred-init work records them for replay at materialization), inside a
 * meta scope or not. Every other op given a meta tensor outside a meta
 * scope fails (ts__meta_error). */
static bool is_initializer(const char *op)
{
    static const char *const names[] = {"uniform_",         "normal_",         "bernoulli_",      "ts_tensor_fill_",
                                        "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_"};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++)
        if (strcmp(op, names[i]) == 0) return true;
    return false;
}

ts_status ts__check_inputs(const char *op, int n, ts_tensor *const *inputs)
{
    for (int i = 0; i < n; i++) {
        const ts_tensor *t = inputs[i];
        if (!t) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: input %d is NULL", op, i);
        if (t->storage->meta && !ts__meta_mode() && !is_initializer(op)) return ts__meta_error(op, i, t);
        if (t->storage->released) {
            char s[96];
            return ts_error(TS_ERR_RELEASED,
                            "%s: input %d%s%s%s %s has released storage (%zu bytes); restore it "
                            "(unshard) before reading it",
                            op, i, t->name ? " '" : "", t->name ? t->name : "", t->name ? "'" : "",
                            ts_shape_str(t->ndim, t->shape, s, sizeof s), t->storage->nbytes);
        }
        if (t->is_shard) {
            char s[96];
            return ts_error(TS_ERR_SHARDED,
                            "%s: input %d%s%s%s %s is a sharded parameter (a local shard); call "
                            "the module through ts_module_call, or unshard it first, or take "
                            "ts_tensor_local_view() to work on the local data",
                            op, i, t->name ? " '" : "", t->name ? t->name : "", t->name ? "'" : "",
                            ts_shape_str(t->ndim, t->shape, s, sizeof s));
        }
    }
    return TS_OK;
}

ts_status ts__check_float(const char *op, const ts_tensor *t)
{
    if (t->dtype != TS_F32 && t->dtype != TS_F64)
        return ts_error(TS_ERR_DTYPE,
                        "%s: dtype %s is not supported (float32 or float64 expected; cast with "
                        "ts_to_dtype)",
                        op, ts_dtype_name(t->dtype));
    return TS_OK;
}

ts_status ts__check_floating(const char *op, const ts_tensor *t)
{
    if (!ts_dtype_is_float(t->dtype))
        return ts_error(TS_ERR_DTYPE,
                        "%s: dtype %s is not supported (a floating dtype expected: float32, "
                        "float64, bfloat16 or float16)",
                        op, ts_dtype_name(t->dtype));
    return TS_OK;
}

ts_status ts__check_same_dtype(const char *op, const ts_tensor *a, const ts_tensor *b)
{
    if (a->dtype != b->dtype)
        return ts_error(TS_ERR_DTYPE, "%s: dtypes %s and %s differ", op, ts_dtype_name(a->dtype),
                        ts_dtype_name(b->dtype));
    return TS_OK;
}

/* 0 bool, 1 integer, 2 floating: PyTorch's categories. */
static int dtype_category(ts_dtype d) { return d == TS_BOOL ? 0 : ts_dtype_is_float(d) ? 2 : 1; }

ts_dtype ts__promote_types(ts_dtype a, ts_dtype b)
{
    if (a == b) return a;
    int ca = dtype_category(a), cb = dtype_category(b);
    if (ca != cb) return ca > cb ? a : b;
    if (ca == 2) {
        if (a == TS_F64 || b == TS_F64) return TS_F64;
        return TS_F32; /* f32 with a 16-bit dtype, or bf16 with f16 */
    }
    return TS_I64; /* int32 with int64 */
}

/* c10's combine_categories: a higher-priority result wins unless the
 * lower one is of a higher category. */
static ts_dtype combine_categories(ts_dtype higher, ts_dtype lower)
{
    if (ts_dtype_is_float(higher)) return higher;
    if (higher == TS_BOOL || ts_dtype_is_float(lower)) return ts__promote_types(higher, lower);
    return higher;
}

ts_dtype ts__result_type(const ts_tensor *a, const ts_tensor *b)
{
    bool za = a->ndim == 0, zb = b->ndim == 0;
    if (za == zb) return ts__promote_types(a->dtype, b->dtype);
    const ts_tensor *dim = za ? b : a, *zero = za ? a : b;
    return combine_categories(dim->dtype, zero->dtype);
}

ts_status ts__broadcast_shape(const char *op, int na, const int64_t *sa, int nb, const int64_t *sb, int *nout,
                              int64_t *sout)
{
    int n = na > nb ? na : nb;
    int64_t r[TS_MAX_DIMS];
    for (int i = 0; i < n; i++) {
        int ia = na - n + i, ib = nb - n + i;
        int64_t a = ia >= 0 ? sa[ia] : 1, b = ib >= 0 ? sb[ib] : 1;
        if (a != b && a != 1 && b != 1) {
            char s1[96], s2[96];
            return ts_error(TS_ERR_SHAPE, "%s: shapes %s and %s cannot be broadcast (dim %d: %lld vs %lld)", op,
                            ts_shape_str(na, sa, s1, sizeof s1), ts_shape_str(nb, sb, s2, sizeof s2), i, (long long)a,
                            (long long)b);
        }
        r[i] = a == 1 ? b : a;
    }
    *nout = n;
    memcpy(sout, r, (size_t)n * sizeof *r);
    return TS_OK;
}

void ts__broadcast_strides(const ts_tensor *t, int ndim_out, const int64_t *shape_out, int64_t *strides_out)
{
    for (int i = 0; i < ndim_out; i++) {
        int it = t->ndim - ndim_out + i;
        strides_out[i] = (it >= 0 && t->shape[it] == shape_out[i] && shape_out[i] != 1) ? t->strides[it] : 0;
    }
}

/* ------------------------------------------------------------ element access */

ts_status ts_tensor_get(const ts_tensor *t, const int64_t *index, double *value_out)
{
    if (!t || !index || !value_out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_tensor_get: %s is NULL",
                        !t           ? "the tensor"
                            : !index ? "index"
                                     : "value_out");
    /* a meta tensor: the checks the CPU runs, then the error (it has no data) */
    ts_status st =
        ts__is_meta(t) && !ts__meta_mode() ? TS_OK : ts__check_inputs("ts_tensor_get", 1, (ts_tensor *const *)&t);
    if (st) return st;
    int64_t off = 0;
    for (int i = 0; i < t->ndim; i++) {
        if (index[i] < 0 || index[i] >= t->shape[i])
            return ts_error(TS_ERR_INDEX, "ts_tensor_get: index %lld is out of range for dim %d of size %lld",
                            (long long)index[i], i, (long long)t->shape[i]);
        off += index[i] * t->strides[i];
    }
    if (ts__is_meta(t)) return ts__meta_error("ts_tensor_get", -1, t);
    *value_out = ts__load(t->dtype, ts_tensor_data(t), off);
    return TS_OK;
}

ts_status ts_tensor_item(const ts_tensor *t, double *value_out)
{
    if (!t || !value_out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_tensor_item: %s is NULL", !t ? "the tensor" : "value_out");
    if (ts_tensor_numel(t) != 1) {
        char s[96];
        return ts_error(TS_ERR_SHAPE, "ts_tensor_item: tensor of shape %s has %lld elements, not 1",
                        ts_shape_str(t->ndim, t->shape, s, sizeof s), (long long)ts_tensor_numel(t));
    }
    int64_t zero[TS_MAX_DIMS] = {0};
    ts_status st = ts_tensor_get(t, zero, value_out);
    if (st == TS_ERR_STATE && ts__is_meta(t)) return ts__meta_error("ts_tensor_item", -1, t); /* named by this call */
    return st;
}

/* dst (any layout) = src broadcast to dst's shape, converted. */
static void copy_strided(ts_tensor *dst, const ts_tensor *src)
{
    int64_t n = ts_tensor_numel(dst);
    if (n == 0 || ts__is_meta(dst) || ts__is_meta(src)) /* meta: nothing to copy */
        return;
    char *dp = ts_tensor_data(dst);
    const char *sp = ts_tensor_data(src);
    if (dst->dtype == src->dtype && ts__is_contiguous(dst) && ts__is_contiguous(src) && ts_tensor_numel(src) == n) {
        memmove(dp, sp, (size_t)n * ts_dtype_size(dst->dtype));
        return;
    }
    if (ts__is_contiguous(dst) && ts__is_contiguous(src) && ts_tensor_numel(src) == n) {
        ts__buf_convert(dst->dtype, dp, src->dtype, sp, n);
        return;
    }
    int nd = dst->ndim;
    if (nd == 0) {
        ts__store(dst->dtype, dp, 0, ts__load(src->dtype, sp, 0));
        return;
    }
    int64_t strides[2][TS_MAX_DIMS], offs[2] = {0, 0}, idx[TS_MAX_DIMS] = {0};
    memcpy(strides[0], dst->strides, sizeof dst->strides);
    ts__broadcast_strides(src, nd, dst->shape, strides[1]);
    int64_t inner = dst->shape[nd - 1], ds = strides[0][nd - 1], ss = strides[1][nd - 1];
    size_t es = dst->dtype == src->dtype ? ts_dtype_size(dst->dtype) : 0;
    do {
        /* the same dtype: the bits, by element size (a bf16 transpose went
         * through double per element before: 10% of a bf16 GPT step) */
        if (es == 4) {
            uint32_t *d = (uint32_t *)dp + offs[0];
            const uint32_t *s = (const uint32_t *)sp + offs[1];
            for (int64_t i = 0; i < inner; i++) d[i * ds] = s[i * ss];
        } else if (es == 2) {
            uint16_t *d = (uint16_t *)dp + offs[0];
            const uint16_t *s = (const uint16_t *)sp + offs[1];
            for (int64_t i = 0; i < inner; i++) d[i * ds] = s[i * ss];
        } else if (es == 8) {
            uint64_t *d = (uint64_t *)dp + offs[0];
            const uint64_t *s = (const uint64_t *)sp + offs[1];
            for (int64_t i = 0; i < inner; i++) d[i * ds] = s[i * ss];
        } else {
            for (int64_t i = 0; i < inner; i++)
                ts__store(dst->dtype, dp, offs[0] + i * ds, ts__load(src->dtype, sp, offs[1] + i * ss));
        }
    } while (ts__next_outer(nd, dst->shape, idx, 2, strides, offs));
}

ts_status ts_tensor_copy_to(const ts_tensor *t, void *buf, size_t nbytes)
{
    if (!t || !buf)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_tensor_copy_to: %s is NULL", !t ? "the tensor" : "buf");
    ts_status st =
        ts__is_meta(t) && !ts__meta_mode() ? TS_OK : ts__check_inputs("ts_tensor_copy_to", 1, (ts_tensor *const *)&t);
    if (st) return st;
    size_t want = (size_t)ts_tensor_numel(t) * ts_dtype_size(t->dtype);
    if (nbytes != want)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_tensor_copy_to: buffer has %zu bytes, tensor needs %zu", nbytes,
                        want);
    if (ts__is_meta(t)) /* the checks the CPU runs, then the error (it has no data) */
        return ts__meta_error("ts_tensor_copy_to", -1, t);
    ts_tensor tmp = {0};
    tmp.dtype = t->dtype;
    tmp.ndim = t->ndim;
    memcpy(tmp.shape, t->shape, sizeof t->shape);
    ts__contiguous_strides(t->ndim, t->shape, tmp.strides);
    ts_storage s = {0};
    s.data = buf;
    s.nbytes = nbytes;
    tmp.storage = &s;
    copy_strided(&tmp, t);
    return TS_OK;
}

ts_status ts_tensor_pin_memory(const ts_tensor *t, ts_tensor **out)
{
    if (!t || !out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_tensor_pin_memory: %s is NULL", !t ? "the tensor" : "out");
    if (ts__is_meta(t) && !ts__meta_mode()) return ts__meta_error("ts_tensor_pin_memory", 0, t);
    if (t->storage && t->storage->pinned && !t->storage->released) {
        *out = ts_tensor_retain((ts_tensor *)(uintptr_t)t);
        return TS_OK;
    }
    ts_tensor *p = NULL;
    ts_status st = ts__tensor_new(t->dtype, t->ndim, t->shape, &p);
    /* release, mark pinned, restore: the new tensor's bytes go straight
     * into a pinned block without a copy of the pool block */
    if (!st) st = ts_storage_release(p->storage);
    if (!st) st = ts_storage_pin(p->storage);
    if (!st) st = ts_storage_restore(p->storage);
    if (!st && !ts__is_meta(p)) /* a meta copy has no bytes to fill */
        st = ts_tensor_copy_to(t, p->storage->data, (size_t)ts_tensor_numel(p) * ts_dtype_size(p->dtype));
    if (st) {
        ts_tensor_free(p);
        return st;
    }
    p->device = t->device;
    *out = p;
    return TS_OK;
}

bool ts_tensor_is_pinned(const ts_tensor *t) { return t && t->storage && t->storage->pinned; }

ts_status ts__copy_into(const char *op, ts_tensor *dst, const ts_tensor *src)
{
    int nout;
    int64_t shape[TS_MAX_DIMS];
    ts_status st = ts__broadcast_shape(op, dst->ndim, dst->shape, src->ndim, src->shape, &nout, shape);
    if (st) return st;
    if (nout != dst->ndim || memcmp(shape, dst->shape, (size_t)nout * sizeof *shape) != 0) {
        char s1[96], s2[96];
        return ts_error(TS_ERR_SHAPE, "%s: source of shape %s does not broadcast to destination shape %s", op,
                        ts_shape_str(src->ndim, src->shape, s1, sizeof s1),
                        ts_shape_str(dst->ndim, dst->shape, s2, sizeof s2));
    }
    copy_strided(dst, src);
    return TS_OK;
}

ts_status ts_tensor_copy_(ts_tensor *dst, const ts_tensor *src)
{
    ts_tensor *in[2] = {dst, (ts_tensor *)src};
    ts_status st = ts__check_inputs("ts_tensor_copy_", 2, in);
    if (st) return st;
    if (dst->requires_grad && ts_grad_mode_enabled())
        return ts_error(TS_ERR_AUTOGRAD,
                        "ts_tensor_copy_: destination%s%s%s requires grad; an in-place copy into "
                        "it would not be recorded (disable grad mode first)",
                        dst->name ? " '" : "", dst->name ? dst->name : "", dst->name ? "'" : "");
    return ts__copy_into("ts_tensor_copy_", dst, src);
}

ts_status ts_tensor_fill_(ts_tensor *t, double value)
{
    ts_status st = ts__check_inputs("ts_tensor_fill_", 1, &t);
    if (st || (st = ts__check_scalar("ts_tensor_fill_", t->dtype, value))) return st;
    if (ts__is_meta(t)) /* recorded, [Note: deferred init] */
        return ts__init_record("ts_tensor_fill_", t, TS__INIT_FILL, value, 0.0, NULL);
    return fill(t, value);
}

/* Sets every element of t to value (checked by the caller). */
static ts_status fill(ts_tensor *t, double value)
{
    ts_status st;
    int64_t n = ts_tensor_numel(t);
    if (n == 0 || ts__is_meta(t)) return TS_OK;
    if (ts__is_contiguous(t)) {
        char *d = ts_tensor_data(t);
        if (t->dtype == TS_F32) {
            float v = (float)value, *f = (float *)d;
            for (int64_t i = 0; i < n; i++) f[i] = v;
        } else if (value == 0.0 && !signbit(value)) {
            memset(d, 0, (size_t)n * ts_dtype_size(t->dtype));
        } else {
            for (int64_t i = 0; i < n; i++) ts__store(t->dtype, d, i, value);
        }
        return TS_OK;
    }
    ts_tensor *s;
    st = ts_tensor_full(t->dtype, 0, NULL, value, &s);
    if (st) return st;
    copy_strided(t, s);
    ts_tensor_free(s);
    return TS_OK;
}

/* ------------------------------------------------------------ shard marker */

void ts_tensor_set_shard(ts_tensor *t, void *meta)
{
    if (!t) return;
    t->is_shard = true;
    t->dist = meta;
}

void ts_tensor_clear_shard(ts_tensor *t)
{
    if (!t) return;
    t->is_shard = false;
    t->dist = NULL;
}

bool ts_tensor_is_shard(const ts_tensor *t) { return t && t->is_shard; }
void *ts_tensor_dist_meta(const ts_tensor *t) { return t ? t->dist : NULL; }

ts_status ts_tensor_local_view(ts_tensor *t, ts_tensor **out)
{
    if (!t || !out) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_tensor_local_view: NULL argument");
    return ts__tensor_alias(t, t->ndim, t->shape, t->strides, t->offset, out);
}

ts_status ts_tensor_materialize(ts_tensor *t)
{
    if (!t) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_tensor_materialize: tensor is NULL");
    return ts_storage_materialize(t->storage);
}
