/* Reductions (sum, mean, amax, max over a dim) and softmax / log_softmax. */
#define _GNU_SOURCE
#include "tensor/fastmath.h"
#include "tensor/half_ops.h"
#include "tensor/internal.h"
#include "tensor/kernels.h"

#include <math.h>
#include <string.h>

/* Parses a dim list into a mask; ndims == 0 means all dims. */
static ts_status dim_mask(const char *op, const ts_tensor *a, int ndims, const int *dims, bool *mask)
{
    memset(mask, 0, TS_MAX_DIMS * sizeof *mask);
    if (ndims < 0 || ndims > TS_MAX_DIMS || (ndims && !dims))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: invalid list of %d dims", op, ndims);
    if (ndims == 0) {
        for (int i = 0; i < a->ndim; i++) mask[i] = true;
        return TS_OK;
    }
    for (int i = 0; i < ndims; i++) {
        int d;
        ts_status st = ts__wrap_dim(op, dims[i], a->ndim, &d);
        if (st) return st;
        if (a->ndim == 0) continue;
        if (mask[d]) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: dim %d appears twice in the list", op, d);
        mask[d] = true;
    }
    return TS_OK;
}

/* Output shape with reduced dims kept as 1 (kshape) and dropped (oshape). */
static void reduced_shapes(const ts_tensor *a, const bool *mask, int64_t *kshape, int *ond, int64_t *oshape)
{
    int k = 0;
    for (int i = 0; i < a->ndim; i++) {
        kshape[i] = mask[i] ? 1 : a->shape[i];
        if (!mask[i]) oshape[k++] = a->shape[i];
    }
    *ond = k;
}

enum red { R_SUM, R_MAX };

/* Reduces a over masked dims into a keepdim-shaped output of a's dtype,
 * accumulating in double (sums of f32 stay accurate over long rows). The
 * 16-bit dtypes use the same accumulator and are rounded to float32, then
 * to their dtype: the result is the float32 sum of the upcast values
 * rounded to the dtype, bit for bit (PyTorch accumulates bf16/f16 sums in
 * float32 and rounds once; its float32 cascade and this double sum agree
 * after rounding to 8 or 11 significant bits except on ties of the
 * second rounding, which the tests did not meet against torch 1.13). */
static ts_status reduce_kernel(enum red kind, ts_tensor *a, const bool *mask, ts_tensor **out)
{
    int64_t kshape[TS_MAX_DIMS], oshape[TS_MAX_DIMS];
    int ond;
    reduced_shapes(a, mask, kshape, &ond, oshape);
    ts_tensor *o;
    ts_status st = ts__tensor_new(a->dtype, a->ndim, kshape, &o);
    if (st) return st;
    if (ts__is_meta(o)) {
        *out = o;
        return TS_OK;
    }
    int64_t on = ts_tensor_numel(o), an = ts_tensor_numel(a);
    double *acc = ts__malloc(TS_MEM_OTHER, (size_t)(on ? on : 1) * sizeof *acc);
    if (!acc) {
        ts_tensor_free(o);
        return TS_ERR_NO_MEMORY;
    }
    for (int64_t i = 0; i < on; i++) acc[i] = kind == R_SUM ? 0.0 : -INFINITY;
    if (an > 0 && a->ndim == 0) {
        acc[0] = ts__load(a->dtype, ts_tensor_data(a), 0);
    } else if (an > 0) {
        int nd = a->ndim;
        int64_t str[2][TS_MAX_DIMS], offs[2] = {0, 0}, idx[TS_MAX_DIMS] = {0};
        memcpy(str[0], a->strides, sizeof a->strides);
        for (int i = 0; i < nd; i++) str[1][i] = mask[i] ? 0 : o->strides[i];
        const void *ap = ts_tensor_data(a);
        int64_t n = a->shape[nd - 1], sa = str[0][nd - 1], so = str[1][nd - 1];
        bool f32 = a->dtype == TS_F32 && !ts__use_reference_kernels;
        bool half = ts__is_half(a->dtype) && !ts__use_reference_kernels && kind == R_SUM;
        do {
            double *ac = acc + offs[1];
            if (half && a->dtype == TS_BF16) {
                const uint16_t *x = (const uint16_t *)ap + offs[0];
                if (so == 0) {
                    double s = 0;
                    for (int64_t i = 0; i < n; i++) s += ts__bf16_to_f32(x[i * sa]);
                    ac[0] += s;
                } else {
                    for (int64_t i = 0; i < n; i++) ac[i * so] += ts__bf16_to_f32(x[i * sa]);
                }
            } else if (half && sa == 1) {
                /* float16 in float blocks from the vectorised conversion
                 * (the scalar one is branchy and not inlined) */
                const uint16_t *x = (const uint16_t *)ap + offs[0];
                float f[256];
                for (int64_t i0 = 0; i0 < n; i0 += 256) {
                    int64_t m = n - i0 < 256 ? n - i0 : 256;
                    ts__buf_convert(TS_F32, f, TS_F16, x + i0, m);
                    if (so == 0) {
                        double t = 0;
                        for (int64_t i = 0; i < m; i++) t += f[i];
                        ac[0] += t;
                    } else {
                        for (int64_t i = 0; i < m; i++) ac[(i0 + i) * so] += f[i];
                    }
                }
            } else if (half) {
                const uint16_t *x = (const uint16_t *)ap + offs[0];
                for (int64_t i = 0; i < n; i++) ac[i * so] += ts_f16_to_f32(x[i * sa]);
            } else if (f32 && kind == R_SUM && so == 0) {
                const float *x = (const float *)ap + offs[0];
                double s = 0;
                for (int64_t i = 0; i < n; i++) s += x[i * sa];
                ac[0] += s;
            } else if (f32 && kind == R_SUM && so == 1 && sa == 1) {
                /* summing rows into a vector (bias gradients): vectorises */
                const float *restrict x = (const float *)ap + offs[0];
                double *restrict acr = ac;
                for (int64_t i = 0; i < n; i++) acr[i] += x[i];
            } else if (f32 && kind == R_SUM) {
                const float *x = (const float *)ap + offs[0];
                for (int64_t i = 0; i < n; i++) ac[i * so] += x[i * sa];
            } else {
                for (int64_t i = 0; i < n; i++) {
                    double v = ts__load(a->dtype, ap, offs[0] + i * sa);
                    double *c = &ac[i * so];
                    if (kind == R_SUM) *c += v;
                    else if (v > *c || v != v) *c = v;
                }
            }
        } while (ts__next_outer(nd, a->shape, idx, 2, str, offs));
    }
    void *od = ts_tensor_data(o);
    for (int64_t i = 0; i < on; i++) ts__store(o->dtype, od, i, acc[i]);
    ts__free(TS_MEM_OTHER, acc);
    *out = o;
    return TS_OK;
}

static ts_status drop_dims(ts_tensor *k, const bool *mask, bool keepdim, ts_tensor **out)
{
    if (keepdim) {
        *out = k;
        return TS_OK;
    }
    int64_t oshape[TS_MAX_DIMS], kshape[TS_MAX_DIMS], str[TS_MAX_DIMS];
    int ond;
    reduced_shapes(k, mask, kshape, &ond, oshape);
    ts__contiguous_strides(ond, oshape, str);
    ts_status st = ts__tensor_alias(k, ond, oshape, str, k->offset, out);
    ts_tensor_free(k);
    return st;
}

ts_status ts__sum_nograd(ts_tensor *a, int ndims, const int *dims, bool keepdim, ts_tensor **out)
{
    bool mask[TS_MAX_DIMS];
    ts_status st = dim_mask("sum", a, ndims, dims, mask);
    if (st) return st;
    ts_tensor *k;
    if ((st = reduce_kernel(R_SUM, a, mask, &k))) return st;
    return drop_dims(k, mask, keepdim, out);
}

/* Node layout for reductions: iargs[0..8) input shape, iargs[15] ndim,
 * iargs[8..16) mask bits (iargs[8] as a bitmask), dargs[0] scale. */
static ts_status expand_grad(ts_node *n, ts_tensor *g, ts_tensor **full)
{
    int nd = (int)n->iargs[15];
    int64_t kshape[TS_MAX_DIMS], str[TS_MAX_DIMS];
    for (int i = 0; i < nd; i++) kshape[i] = (n->iargs[8] >> i) & 1 ? 1 : n->iargs[i];
    ts_tensor *gc, *gk, *e;
    ts_status st = ts_contiguous(g, &gc);
    if (st) return st;
    ts__contiguous_strides(nd, kshape, str);
    st = ts__tensor_alias(gc, nd, kshape, str, gc->offset, &gk);
    ts_tensor_free(gc);
    if (st) return st;
    st = ts_expand(gk, nd, n->iargs, &e);
    ts_tensor_free(gk);
    if (st) return st;
    st = ts_contiguous(e, full);
    ts_tensor_free(e);
    return st;
}

static ts_status sum_backward(ts_node *n, ts_tensor **g, ts_tensor **gin)
{
    ts_tensor *full;
    ts_status st = expand_grad(n, g[0], &full);
    if (st || n->dargs[0] == 1.0) {
        gin[0] = st ? NULL : full;
        return st;
    }
    /* mean: torch's mean_backward divides by the count, which for the
     * 16-bit dtypes is a wrapped number rounded to the dtype */
    if (ts__is_half(full->dtype)) st = ts_div_scalar(full, n->dargs[1], &gin[0]);
    else st = ts_mul_scalar(full, n->dargs[0], &gin[0]);
    ts_tensor_free(full);
    return st;
}

static ts_status amax_backward(ts_node *n, ts_tensor **g, ts_tensor **gin)
{
    /* gradient shared evenly among the elements equal to the maximum */
    ts_tensor *full_g, *full_m, *mask, *cnt, *share, *maskf, *gm;
    ts_status st = expand_grad(n, g[0], &full_g);
    if (st) return st;
    int nd = (int)n->iargs[15];
    ts_tensor *x = n->saved[0], *mx = n->saved[1];
    st = ts_expand(mx, nd, n->iargs, &full_m);
    if (!st) {
        st = ts_eq(x, full_m, &mask);
        ts_tensor_free(full_m);
    }
    if (!st) {
        st = ts_to_dtype(mask, x->dtype, &maskf);
        ts_tensor_free(mask);
    }
    if (!st) {
        int dims[TS_MAX_DIMS], k = 0;
        for (int i = 0; i < nd; i++)
            if ((n->iargs[8] >> i) & 1) dims[k++] = i;
        st = ts__sum_nograd(maskf, k, dims, true, &cnt);
        if (!st) {
            st = ts_div(full_g, cnt, &share); /* broadcasting the count */
            ts_tensor_free(cnt);
        }
        if (!st) {
            st = ts_mul(share, maskf, &gm);
            ts_tensor_free(share);
            if (!st) gin[0] = gm;
        }
        ts_tensor_free(maskf);
    }
    ts_tensor_free(full_g);
    return st;
}

static ts_status reduce_op(const char *name, enum red kind, bool mean, ts_tensor *a, int ndims, const int *dims,
                           bool keepdim, ts_tensor **out)
{
    ts_status st;
    if ((st = ts__check_inputs(name, 1, &a)) || (st = ts__check_floating(name, a))) return st;
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: out is NULL", name);
    bool mask[TS_MAX_DIMS];
    if ((st = dim_mask(name, a, ndims, dims, mask))) return st;
    int64_t count = 1;
    for (int i = 0; i < a->ndim; i++)
        if (mask[i]) count *= a->shape[i];
    if (kind == R_MAX && count == 0)
        return ts_error(TS_ERR_SHAPE, "%s: cannot take the maximum over zero elements", name);
    ts_tensor *k;
    if ((st = reduce_kernel(kind, a, mask, &k))) return st;
    if (mean) {
        ts_tensor *m;
        st = ts_div_scalar(k, (double)count, &m); /* k has no grad yet: plain kernel */
        ts_tensor_free(k);
        if (st) return st;
        k = m;
    }
    ts_tensor *o;
    if ((st = drop_dims(k, mask, keepdim, &o))) return st;
    if (ts__needs_grad(1, &a)) {
        ts_node *n = ts__node_new(name, kind == R_SUM ? sum_backward : amax_backward, 1, &a, 1);
        if (!n) {
            ts_tensor_free(o);
            return TS_ERR_NO_MEMORY;
        }
        memcpy(n->iargs, a->shape, (size_t)a->ndim * sizeof *a->shape);
        n->iargs[15] = a->ndim;
        n->iargs[8] = 0;
        for (int i = 0; i < a->ndim; i++) n->iargs[8] |= (int64_t)mask[i] << i;
        n->dargs[0] = mean ? 1.0 / (double)count : 1.0;
        n->dargs[1] = (double)count;
        if (kind == R_MAX) {
            int64_t kshape[TS_MAX_DIMS], oshape[TS_MAX_DIMS], str[TS_MAX_DIMS];
            int ond;
            reduced_shapes(a, mask, kshape, &ond, oshape);
            ts__contiguous_strides(a->ndim, kshape, str);
            ts_tensor *kv;
            st = ts__tensor_alias(o, a->ndim, kshape, str, o->offset, &kv);
            if (!st) {
                st = ts__node_save(n, 0, a);
                if (!st) st = ts__node_save(n, 1, kv);
                ts_tensor_free(kv);
            }
        }
        if (!st) ts__node_set_output(n, 0, o);
        ts__node_free(n);
        if (st) {
            ts_tensor_free(o);
            return st;
        }
    }
    *out = o;
    return TS_OK;
}

ts_status ts_sum(ts_tensor *a, int ndims, const int *dims, bool keepdim, ts_tensor **out)
{
    return reduce_op("sum", R_SUM, false, a, ndims, dims, keepdim, out);
}

ts_status ts_mean(ts_tensor *a, int ndims, const int *dims, bool keepdim, ts_tensor **out)
{
    return reduce_op("mean", R_SUM, true, a, ndims, dims, keepdim, out);
}

ts_status ts_amax(ts_tensor *a, int ndims, const int *dims, bool keepdim, ts_tensor **out)
{
    return reduce_op("amax", R_MAX, false, a, ndims, dims, keepdim, out);
}

/* ----------------------------------------------------- max over one dim */

static ts_status max_dim_backward(ts_node *n, ts_tensor **g, ts_tensor **gin)
{
    /* scatter g into zeros at the saved indices (keepdim layout) */
    int nd = (int)n->iargs[15], dim = (int)n->iargs[14];
    ts_tensor *idx = n->saved[0], *gc, *z;
    ts_status st = ts__tensor_new(g[0]->dtype, nd, n->iargs, &z);
    if (st) return st;
    ts_tensor_fill_(z, 0.0);
    if ((st = ts_contiguous(g[0], &gc))) {
        ts_tensor_free(z);
        return st;
    }
    if (ts__is_meta(z)) {
        ts_tensor_free(gc);
        gin[0] = z;
        return TS_OK;
    }
    const int64_t *ix = ts_tensor_data(idx);
    const void *gp = ts_tensor_data(gc);
    void *zp = ts_tensor_data(z);
    int64_t outer = 1, inner = 1, size = n->iargs[dim];
    for (int i = 0; i < dim; i++) outer *= n->iargs[i];
    for (int i = dim + 1; i < nd; i++) inner *= n->iargs[i];
    for (int64_t o = 0; o < outer; o++)
        for (int64_t i = 0; i < inner; i++) {
            int64_t r = o * inner + i;
            ts__store(z->dtype, zp, (o * size + ix[r]) * inner + i, ts__load(gc->dtype, gp, r));
        }
    ts_tensor_free(gc);
    gin[0] = z;
    return TS_OK;
}

ts_status ts_max_dim(ts_tensor *a, int dim, bool keepdim, ts_tensor **values_out, ts_tensor **indices_out)
{
    ts_status st;
    if ((st = ts__check_inputs("max", 1, &a)) || (st = ts__check_floating("max", a))) return st;
    if (!values_out) return ts_error(TS_ERR_INVALID_ARGUMENT, "max: values_out is NULL");
    int d;
    if ((st = ts__wrap_dim("max", dim, a->ndim, &d))) return st;
    if (a->ndim == 0) return ts_error(TS_ERR_INDEX, "max: a 0-d tensor has no dim to reduce");
    if (a->shape[d] == 0) return ts_error(TS_ERR_SHAPE, "max: dim %d has size 0", d);
    ts_tensor *ac;
    if ((st = ts_contiguous(a, &ac))) return st;
    int64_t kshape[TS_MAX_DIMS];
    memcpy(kshape, a->shape, sizeof kshape);
    kshape[d] = 1;
    ts_tensor *v, *ix;
    if ((st = ts__tensor_new(a->dtype, a->ndim, kshape, &v))) {
        ts_tensor_free(ac);
        return st;
    }
    if ((st = ts__tensor_new(TS_I64, a->ndim, kshape, &ix))) {
        ts_tensor_free(ac);
        ts_tensor_free(v);
        return st;
    }
    int64_t outer = 1, inner = 1, size = a->shape[d];
    for (int i = 0; i < d; i++) outer *= a->shape[i];
    for (int i = d + 1; i < a->ndim; i++) inner *= a->shape[i];
    const void *ap = ts_tensor_data(ac);
    void *vp = ts_tensor_data(v);
    int64_t *ip = ts_tensor_data(ix);
    for (int64_t o = 0; o < outer && vp; o++) /* vp NULL: meta outputs */
        for (int64_t i = 0; i < inner; i++) {
            double best = ts__load(a->dtype, ap, o * size * inner + i);
            int64_t bi = 0;
            for (int64_t k = 1; k < size && best == best; k++) {
                double x = ts__load(a->dtype, ap, (o * size + k) * inner + i);
                if (x > best || x != x) {
                    best = x;
                    bi = k;
                }
            }
            ts__store(a->dtype, vp, o * inner + i, best);
            ip[o * inner + i] = bi;
        }
    ts_tensor_free(ac);
    bool mask[TS_MAX_DIMS] = {0};
    mask[d] = true;
    ts_tensor *vo, *io;
    if ((st = drop_dims(v, mask, keepdim, &vo))) {
        ts_tensor_free(ix);
        return st;
    }
    ts_tensor_retain(ix); /* one reference for drop_dims, one kept for the node */
    if ((st = drop_dims(ix, mask, keepdim, &io))) {
        ts_tensor_free(ix);
        ts_tensor_free(vo);
        return st;
    }
    if (ts__needs_grad(1, &a)) {
        ts_node *n = ts__node_new("max", max_dim_backward, 1, &a, 1);
        if (!n) st = TS_ERR_NO_MEMORY;
        else {
            memcpy(n->iargs, a->shape, (size_t)a->ndim * sizeof *a->shape);
            n->iargs[15] = a->ndim;
            n->iargs[14] = d;
            st = ts__node_save(n, 0, ix);
            if (!st) ts__node_set_output(n, 0, vo);
            ts__node_free(n);
        }
    }
    ts_tensor_free(ix);
    if (st) {
        ts_tensor_free(vo);
        ts_tensor_free(io);
        return st;
    }
    *values_out = vo;
    if (indices_out) *indices_out = io;
    else ts_tensor_free(io);
    return TS_OK;
}

/* ----------------------------------------------------- softmax */

/* Row kernel over the last dim of a contiguous (rows, n) buffer. The
 * exponentials go through ts__exp_f32 in a loop of their own (it
 * vectorises); the sums are then taken in double. */
__attribute__((target_clones("avx2", "default"))) static void softmax_rows_f32(const float *x, float *y, int64_t rows,
                                                                               int64_t n, bool log_form)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *yr = y + r * n;
        float mx = -INFINITY;
        for (int64_t i = 0; i < n; i++) mx = xr[i] > mx ? xr[i] : mx;
        if (mx == -INFINITY) mx = 0;
        for (int64_t i = 0; i < n; i++) yr[i] = ts__exp_f32(xr[i] - mx);
        double s = 0;
        for (int64_t i = 0; i < n; i++) s += yr[i];
        if (log_form) {
            /* (x - max) - log(sum), in this order, as PyTorch does: folding
             * max + log(sum) first rounds at the magnitude of the logits and
             * loses the small differences (pytorch/pytorch#11752) */
            float ls = (float)log(s);
            for (int64_t i = 0; i < n; i++) yr[i] = (xr[i] - mx) - ls;
        } else {
            float inv = (float)(1.0 / s);
            for (int64_t i = 0; i < n; i++) yr[i] *= inv;
        }
    }
}

/* The 16-bit rows through the float32 kernel (half_ops.h): each row
 * converted by the vectorised ts__buf_convert, softmax_rows_f32 (whose
 * exponentials vectorise), one rounding back. The element-by-element loop
 * called ts__exp_f32 per element and was 16% of a bf16 GPT step's
 * samples; with this, bench_fsdp_step's bf16/f32 step ratio went from
 * 1.06-1.09 to 0.92 on an AVX512-BF16 machine. */
void ts__softmax_rows_half(ts_dtype dt, const void *x, void *y, int64_t rows, int64_t n, bool log_form)
{
    float stack[2 * 512];
    float *in = n <= 512 ? stack : ts__malloc(TS_MEM_OTHER, (size_t)n * 2 * sizeof *in);
    if (!in || ts__use_reference_kernels) {
        if (in && in != stack) ts__free(TS_MEM_OTHER, in);
        ts__softmax_rows_half_ref(dt, x, y, rows, n, log_form);
        return;
    }
    float *out = in + n;
    for (int64_t r = 0; r < rows; r++) {
        ts__buf_convert(TS_F32, in, dt, (const uint16_t *)x + r * n, n);
        softmax_rows_f32(in, out, 1, n, log_form);
        ts__buf_convert(dt, (uint16_t *)y + r * n, TS_F32, out, n);
    }
    if (in != stack) ts__free(TS_MEM_OTHER, in);
}

static void softmax_rows_ref(ts_dtype dt, const void *x, void *y, int64_t rows, int64_t n, bool log_form)
{
    for (int64_t r = 0; r < rows; r++) {
        double mx = -INFINITY, s = 0;
        for (int64_t i = 0; i < n; i++) {
            double v = ts__load(dt, x, r * n + i);
            mx = v > mx ? v : mx;
        }
        if (mx == -INFINITY) mx = 0;
        for (int64_t i = 0; i < n; i++) s += exp(ts__load(dt, x, r * n + i) - mx);
        for (int64_t i = 0; i < n; i++) {
            double v = ts__load(dt, x, r * n + i) - mx;
            ts__store(dt, y, r * n + i, log_form ? v - log(s) : exp(v) / s);
        }
    }
}

/* Gradient rows: softmax gx = y * (g - sum(g*y)); log: gx = g - exp(y) * sum(g). */
static void softmax_bw_rows(ts_dtype dt, const void *g, const void *y, void *gx, int64_t rows, int64_t n, bool log_form)
{
    if (ts__is_half(dt)) {
        ts__softmax_bw_rows_half(dt, g, y, gx, rows, n, log_form);
        return;
    }
    if (dt == TS_F32 && !ts__use_reference_kernels) {
        const float *gf = g, *yf = y;
        float *o = gx;
        for (int64_t r = 0; r < rows; r++) {
            const float *gr = gf + r * n, *yr = yf + r * n;
            float *orow = o + r * n;
            double s = 0;
            if (log_form) {
                for (int64_t i = 0; i < n; i++) s += gr[i];
                for (int64_t i = 0; i < n; i++) orow[i] = gr[i] - ts__exp_f32(yr[i]) * (float)s;
            } else {
                for (int64_t i = 0; i < n; i++) s += gr[i] * yr[i];
                for (int64_t i = 0; i < n; i++) orow[i] = yr[i] * (gr[i] - (float)s);
            }
        }
        return;
    }
    for (int64_t r = 0; r < rows; r++) {
        double s = 0;
        for (int64_t i = 0; i < n; i++)
            s += log_form ? ts__load(dt, g, r * n + i) : ts__load(dt, g, r * n + i) * ts__load(dt, y, r * n + i);
        for (int64_t i = 0; i < n; i++) {
            double gi = ts__load(dt, g, r * n + i), yi = ts__load(dt, y, r * n + i);
            ts__store(dt, gx, r * n + i, log_form ? gi - exp(yi) * s : yi * (gi - s));
        }
    }
}

/* Moves `dim` last and makes the data contiguous; returns a new ref. */
static ts_status dim_last(ts_tensor *a, int d, ts_tensor **out)
{
    ts_tensor *t, *c;
    bool grad = ts_grad_mode_set(false);
    ts_status st = ts_transpose(a, d, a->ndim - 1, &t);
    if (!st) {
        st = ts_contiguous(t, &c);
        ts_tensor_free(t);
    }
    ts_grad_mode_set(grad);
    if (!st) *out = c;
    return st;
}

/* Inverse of dim_last for a contiguous result: swaps back (a copy). */
static ts_status dim_back(ts_tensor *c, int d, ts_tensor **out)
{
    if (d == c->ndim - 1) {
        *out = ts_tensor_retain(c);
        return TS_OK;
    }
    ts_tensor *t;
    bool grad = ts_grad_mode_set(false);
    ts_status st = ts_transpose(c, d, c->ndim - 1, &t);
    if (!st) {
        st = ts__copy_op("softmax", t, t->dtype, out);
        ts_tensor_free(t);
    }
    ts_grad_mode_set(grad);
    return st;
}

static ts_status softmax_backward(ts_node *n, ts_tensor **g, ts_tensor **gin)
{
    int d = (int)n->iargs[0];
    bool log_form = n->iargs[1] != 0;
    ts_tensor *y = n->saved[0], *gl, *yl, *gx;
    if (y->ndim == 0) return ts_tensor_zeros(y->dtype, 0, NULL, &gin[0]);
    ts_status st = dim_last(g[0], d, &gl);
    if (st) return st;
    if ((st = dim_last(y, d, &yl))) {
        ts_tensor_free(gl);
        return st;
    }
    int64_t n_ = gl->shape[gl->ndim - 1], rows = n_ ? ts_tensor_numel(gl) / n_ : 0;
    if (!(st = ts__tensor_new(gl->dtype, gl->ndim, gl->shape, &gx))) {
        if (!ts__is_meta(gx))
            softmax_bw_rows(gl->dtype, ts_tensor_data(gl), ts_tensor_data(yl), ts_tensor_data(gx), rows, n_, log_form);
        st = dim_back(gx, d, &gin[0]);
        ts_tensor_free(gx);
    }
    ts_tensor_free(gl);
    ts_tensor_free(yl);
    return st;
}

static ts_status softmax_op(const char *name, bool log_form, ts_tensor *a, int dim, ts_tensor **out)
{
    ts_status st;
    if ((st = ts__check_inputs(name, 1, &a)) || (st = ts__check_floating(name, a))) return st;
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: out is NULL", name);
    int d;
    if ((st = ts__wrap_dim(name, dim, a->ndim, &d))) return st;
    ts_tensor *o;
    if (a->ndim == 0) {
        if ((st = ts_tensor_full(a->dtype, 0, NULL, log_form ? 0.0 : 1.0, &o))) return st;
    } else {
        ts_tensor *al, *yl;
        if ((st = dim_last(a, d, &al))) return st;
        int64_t n = al->shape[al->ndim - 1], rows = n ? ts_tensor_numel(al) / n : 0;
        if ((st = ts__tensor_new(al->dtype, al->ndim, al->shape, &yl))) {
            ts_tensor_free(al);
            return st;
        }
        if (ts__is_meta(yl)) {
            /* meta: nothing to compute */
        } else if (ts__is_half(al->dtype))
            ts__softmax_rows_half(al->dtype, ts_tensor_data(al), ts_tensor_data(yl), rows, n, log_form);
        else if (al->dtype == TS_F32 && !ts__use_reference_kernels)
            softmax_rows_f32(ts_tensor_data(al), ts_tensor_data(yl), rows, n, log_form);
        else softmax_rows_ref(al->dtype, ts_tensor_data(al), ts_tensor_data(yl), rows, n, log_form);
        ts_tensor_free(al);
        bool grad = ts_grad_mode_set(false);
        st = dim_back(yl, d, &o);
        ts_grad_mode_set(grad);
        ts_tensor_free(yl);
        if (st) return st;
    }
    if (ts__needs_grad(1, &a)) {
        ts_node *n = ts__node_new(name, softmax_backward, 1, &a, 1);
        if (!n) {
            ts_tensor_free(o);
            return TS_ERR_NO_MEMORY;
        }
        n->iargs[0] = d;
        n->iargs[1] = log_form;
        if ((st = ts__record1(n, o, o, NULL))) return st;
    }
    *out = o;
    return TS_OK;
}

ts_status ts_softmax(ts_tensor *a, int dim, ts_tensor **out) { return softmax_op("softmax", false, a, dim, out); }
ts_status ts_log_softmax(ts_tensor *a, int dim, ts_tensor **out)
{
    return softmax_op("log_softmax", true, a, dim, out);
}

/* ----------------------------------------------------- attention softmax */

/* saved[0] = y; dargs[0] = scale */
static ts_status masked_softmax_backward(ts_node *n, ts_tensor **g, ts_tensor **gin)
{
    ts_tensor *y = n->saved[0], *gc, *gx;
    ts_status st = ts_contiguous(g[0], &gc);
    if (st) return st;
    int64_t s = y->shape[y->ndim - 1], rows = s ? ts_tensor_numel(y) / s : 0;
    if (!(st = ts__tensor_new(y->dtype, y->ndim, y->shape, &gx))) {
        bool meta = ts__is_meta(gx);
        if (!meta) softmax_bw_rows(y->dtype, ts_tensor_data(gc), ts_tensor_data(y), ts_tensor_data(gx), rows, s, false);
        double scale = n->dargs[0];
        if (scale != 1.0 && !meta) {
            void *p = ts_tensor_data(gx);
            if (y->dtype == TS_F32)
                for (int64_t i = 0; i < rows * s; i++) ((float *)p)[i] *= (float)scale;
            else
                for (int64_t i = 0; i < rows * s; i++) ((double *)p)[i] *= scale;
        }
        gin[0] = gx;
    }
    ts_tensor_free(gc);
    return st;
}

ts_status ts_scaled_masked_softmax(ts_tensor *scores, ts_tensor *mask, double scale, ts_tensor **out)
{
    const char *op = "scaled_masked_softmax";
    ts_status st;
    if ((st = ts__check_inputs(op, 1, &scores)) || (mask && (st = ts__check_inputs(op, 1, &mask))) ||
        (st = ts__check_float(op, scores)))
        return st;
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: out is NULL", op);
    char s1[96], s2[96];
    if (scores->ndim < 2)
        return ts_error(TS_ERR_SHAPE, "%s: scores must have at least 2 dims (..., T, S), got %s", op,
                        ts_shape_str(scores->ndim, scores->shape, s1, sizeof s1));
    int64_t T = scores->shape[scores->ndim - 2], S = scores->shape[scores->ndim - 1];
    if (mask && (mask->dtype != TS_BOOL || mask->ndim != 2 || mask->shape[0] != T || mask->shape[1] != S))
        return ts_error(TS_ERR_SHAPE, "%s: mask must be bool (%lld, %lld) to fit scores %s, got %s %s", op,
                        (long long)T, (long long)S, ts_shape_str(scores->ndim, scores->shape, s1, sizeof s1),
                        ts_dtype_name(mask->dtype), ts_shape_str(mask->ndim, mask->shape, s2, sizeof s2));
    ts_tensor *sc = NULL, *mc = NULL, *o = NULL;
    bool grad = ts_grad_mode_set(false);
    st = ts_contiguous(scores, &sc);
    if (!st && mask) st = ts_contiguous(mask, &mc);
    ts_grad_mode_set(grad);
    if (st || (st = ts__tensor_new(scores->dtype, scores->ndim, scores->shape, &o))) goto done;
    int64_t rows = S ? ts_tensor_numel(sc) / S : 0;
    const uint8_t *mp = mc ? ts_tensor_data(mc) : NULL;
    /* masked, scaled scores into the output, then softmax in place */
    if (ts__is_meta(o)) {
        /* meta: nothing to compute */
    } else if (sc->dtype == TS_F32 && !ts__use_reference_kernels) {
        const float *x = ts_tensor_data(sc);
        float *y = ts_tensor_data(o), fs = (float)scale;
        for (int64_t r = 0; r < rows; r++) {
            const uint8_t *mr = mp ? mp + (r % T) * S : NULL;
            for (int64_t i = 0; i < S; i++) y[r * S + i] = mr && mr[i] ? -INFINITY : fs * x[r * S + i];
        }
        softmax_rows_f32(y, y, rows, S, false);
    } else {
        const void *x = ts_tensor_data(sc);
        void *y = ts_tensor_data(o);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < S; i++)
                ts__store(o->dtype, y, r * S + i,
                          mp && mp[(r % T) * S + i] ? -INFINITY : scale * ts__load(sc->dtype, x, r * S + i));
        softmax_rows_ref(o->dtype, y, y, rows, S, false);
    }
    if (ts__needs_grad(1, &scores)) {
        ts_node *n = ts__node_new(op, masked_softmax_backward, 1, &scores, 1);
        if (!n) {
            st = TS_ERR_NO_MEMORY;
            goto done;
        }
        n->dargs[0] = scale;
        if (!(st = ts__node_save(n, 0, o))) ts__node_set_output(n, 0, o);
        ts__node_free(n);
        if (st) goto done;
    }
    *out = o;
    o = NULL;
done:
    ts_tensor_free(sc);
    ts_tensor_free(mc);
    ts_tensor_free(o);
    return st;
}

void ts__softmax_rows(ts_dtype dt, const void *x, void *y, int64_t rows, int64_t n)
{
    if (ts__is_half(dt)) ts__softmax_rows_half(dt, x, y, rows, n, false);
    else if (dt == TS_F32 && !ts__use_reference_kernels) softmax_rows_f32(x, y, rows, n, false);
    else softmax_rows_ref(dt, x, y, rows, n, false);
}

void ts__softmax_bw_rows(ts_dtype dt, const void *g, const void *y, void *gx, int64_t rows, int64_t n)
{
    softmax_bw_rows(dt, g, y, gx, rows, n, false);
}
