/* Neural-network ops: layer_norm, embedding, cross_entropy, mse_loss,
 * dropout, and the bfloat16 / float16 softmax rows. In the 16-bit dtypes
 * each op computes in float32 and rounds its result once to the tensor's
 * dtype (torch 1.13's CPU kernels accumulate so); where torch's composite
 * rounds between steps (embedding's backward, dropout's noise, the loss
 * gradient), the same steps round here. */
#define _GNU_SOURCE
#include "tensor/fastmath.h"
#include "tensor/half_ops.h"
#include "tensor/internal.h"

#include <math.h>
#include <string.h>

/* ----------------------------------------------------- softmax rows, 16-bit */

/* The bfloat16 / float16 rows of softmax and log_softmax (ops_reduce.c's
 * softmax_op and ops_attention.c call them): the f32 row kernel's
 * arithmetic (ts__exp_f32, the sum in double) on the values read as
 * float, each result rounded once to dt, so the output is the f32 softmax
 * of the same values rounded (torch 1.13's bf16 softmax gives the same
 * bits; its log_softmax rounds intermediates and differs by an ulp on some
 * elements). x == y is allowed. */
void ts__softmax_rows_half_ref(ts_dtype dt, const void *x, void *y, int64_t rows, int64_t n, bool log_form)
{
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = (const uint16_t *)x + r * n;
        uint16_t *yr = (uint16_t *)y + r * n;
        float mx = -INFINITY;
        for (int64_t i = 0; i < n; i++) {
            float v = ts__half_to_f32(dt, xr[i]);
            mx = v > mx ? v : mx;
        }
        if (mx == -INFINITY) mx = 0;
        double s = 0;
        for (int64_t i = 0; i < n; i++) s += ts__exp_f32(ts__half_to_f32(dt, xr[i]) - mx);
        if (log_form) {
            float ls = (float)log(s);
            for (int64_t i = 0; i < n; i++) yr[i] = ts__f32_to_half(dt, (ts__half_to_f32(dt, xr[i]) - mx) - ls);
        } else {
            float inv = (float)(1.0 / s);
            for (int64_t i = 0; i < n; i++)
                yr[i] = ts__f32_to_half(dt, ts__exp_f32(ts__half_to_f32(dt, xr[i]) - mx) * inv);
        }
    }
}

/* Their backward, as the f32 rows: softmax gx = y * (g - sum(g * y)),
 * log_softmax gx = g - exp(y) * sum(g), sums in double over float terms,
 * each result rounded once to dt. gx == g is allowed. */
void ts__softmax_bw_rows_half(ts_dtype dt, const void *g, const void *y, void *gx, int64_t rows, int64_t n,
                              bool log_form)
{
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gr = (const uint16_t *)g + r * n, *yr = (const uint16_t *)y + r * n;
        uint16_t *o = (uint16_t *)gx + r * n;
        double s = 0;
        if (log_form) {
            for (int64_t i = 0; i < n; i++) s += ts__half_to_f32(dt, gr[i]);
            for (int64_t i = 0; i < n; i++)
                o[i] = ts__f32_to_half(dt,
                                       ts__half_to_f32(dt, gr[i]) - ts__exp_f32(ts__half_to_f32(dt, yr[i])) * (float)s);
        } else {
            for (int64_t i = 0; i < n; i++) s += ts__half_to_f32(dt, gr[i]) * ts__half_to_f32(dt, yr[i]);
            for (int64_t i = 0; i < n; i++)
                o[i] = ts__f32_to_half(dt, ts__half_to_f32(dt, yr[i]) * (ts__half_to_f32(dt, gr[i]) - (float)s));
        }
    }
}

/* ----------------------------------------------------- layer_norm */

/* saved: 0 = x (contiguous), 1 = weight, 2 = mean (rows), 3 = rstd (rows).
 * iargs[0] = D (normalized size), iargs[1] = number of normalized dims,
 * iargs[2..) = normalized shape (the shape of weight and bias, which
 * either may be missing). */
/* One row of the f32 forward. The sums run in eight float lanes (so the
 * loops vectorise) and are combined in double; the variance is taken
 * around the mean (two passes), as PyTorch's CPU kernel does. */
static void layer_norm_row_f32(const float *restrict x, const float *restrict w, const float *restrict b, int64_t D,
                               double eps, float *restrict y, double *mean_out, double *rstd_out)
{
    float lane[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= D; i += 8)
        for (int k = 0; k < 8; k++) lane[k] += x[i + k];
    double s = 0;
    for (int k = 0; k < 8; k++) s += lane[k];
    for (; i < D; i++) s += x[i];
    float mu = (float)(s / (double)D);
    float sq[8] = {0};
    for (i = 0; i + 8 <= D; i += 8)
        for (int k = 0; k < 8; k++) {
            float d = x[i + k] - mu;
            sq[k] += d * d;
        }
    double ss = 0;
    for (int k = 0; k < 8; k++) ss += sq[k];
    for (; i < D; i++) ss += (double)(x[i] - mu) * (x[i] - mu);
    double rsd = 1.0 / sqrt(ss / (double)D + eps);
    float rs = (float)rsd;
    *mean_out = mu;
    *rstd_out = rsd;
    if (w && b)
        for (i = 0; i < D; i++) y[i] = (x[i] - mu) * rs * w[i] + b[i];
    else
        for (i = 0; i < D; i++) {
            float v = (x[i] - mu) * rs;
            if (w) v *= w[i];
            if (b) v += b[i];
            y[i] = v;
        }
}

/* One row of the f32 backward: xh = (x - mu) * rs, gxh = g * w,
 * gx = rs * (gxh - mean(gxh) - xh * mean(gxh * xh)); gw += g * xh, gb += g. */
static void layer_norm_bw_row_f32(const float *x, const float *g, const float *w, float mu, float rs, int64_t D,
                                  float *gx, double *gw, double *gb)
{
    float s1 = 0, s2 = 0;
    for (int64_t i = 0; i < D; i++) {
        float xh = (x[i] - mu) * rs, gxh = w ? g[i] * w[i] : g[i];
        s1 += gxh;
        s2 += gxh * xh;
        if (gw) {
            gw[i] += (double)(g[i] * xh);
            gb[i] += g[i];
        }
    }
    if (!gx) return;
    s1 /= (float)D;
    s2 /= (float)D;
    for (int64_t i = 0; i < D; i++) {
        float xh = (x[i] - mu) * rs, gxh = w ? g[i] * w[i] : g[i];
        gx[i] = rs * (gxh - s1 - xh * s2);
    }
}

static ts_status layer_norm_backward(ts_node *n, ts_tensor **g, ts_tensor **gin)
{
    ts_tensor *x = n->saved[0], *w = n->saved[1], *mean = n->saved[2], *rstd = n->saved[3], *gc;
    int64_t D = n->iargs[0], R = D ? ts_tensor_numel(x) / D : 0;
    int pnd = (int)n->iargs[1];
    const int64_t *pshape = &n->iargs[2];
    ts_status st = ts_contiguous(g[0], &gc);
    if (st) return st;
    ts_dtype dt = x->dtype;
    const void *xp = ts_tensor_data(x), *gp = ts_tensor_data(gc), *wp = w ? ts_tensor_data(w) : NULL;
    const double *mp = ts_tensor_data(mean), *rp = ts_tensor_data(rstd);
    bool need_x = ts__node_needs_input_grad(n, 0), need_w = ts__node_needs_input_grad(n, 1),
         need_b = ts__node_needs_input_grad(n, 2);
    ts_tensor *gx = NULL;
    double *gw = NULL, *gb = NULL;
    if (need_x && (st = ts__tensor_new(dt, x->ndim, x->shape, &gx))) goto out;
    if ((need_w || need_b) && !(gw = ts__calloc(TS_MEM_OTHER, (size_t)(2 * D + 1), sizeof *gw))) {
        st = TS_ERR_NO_MEMORY;
        goto out;
    }
    gb = gw ? gw + D : NULL;
    void *gxp = gx ? ts_tensor_data(gx) : NULL;
    bool meta = ts__meta_mode(); /* the gradients are meta tensors: allocate them, compute nothing */
    if (meta) {
        R = 0;
    } else if (ts__is_half(dt)) {
        /* bfloat16 / float16: the f32 row kernel over float copies of x,
         * g and w (PyTorch's CPU kernel accumulates in float), each result
         * rounded once to dt */
        float *buf = ts__malloc(TS_MEM_OTHER, (size_t)(4 * D + 1) * sizeof *buf);
        if (!buf) {
            st = TS_ERR_NO_MEMORY;
            goto out;
        }
        float *xf = buf, *gf = buf + D, *wf = wp ? buf + 2 * D : NULL, *gxf = buf + 3 * D;
        size_t es = ts_dtype_size(dt);
        if (wf) ts__buf_convert(TS_F32, wf, dt, wp, D);
        for (int64_t r = 0; r < R; r++) {
            ts__buf_convert(TS_F32, xf, dt, (const char *)xp + (size_t)(r * D) * es, D);
            ts__buf_convert(TS_F32, gf, dt, (const char *)gp + (size_t)(r * D) * es, D);
            layer_norm_bw_row_f32(xf, gf, wf, (float)mp[r], (float)rp[r], D, gx ? gxf : NULL, gw, gb);
            if (gx) ts__buf_convert(dt, (char *)gxp + (size_t)(r * D) * es, TS_F32, gxf, D);
        }
        ts__free(TS_MEM_OTHER, buf);
    } else if (dt == TS_F32 && !ts__use_reference_kernels) {
        const float *xf = xp, *gf = gp, *wf = wp;
        float *gxf = gxp;
        for (int64_t r = 0; r < R; r++)
            layer_norm_bw_row_f32(xf + r * D, gf + r * D, wf, (float)mp[r], (float)rp[r], D, gxf ? gxf + r * D : NULL,
                                  gw, gb);
    }
    for (int64_t r = 0; r < R && !ts__is_half(dt) && !(dt == TS_F32 && !ts__use_reference_kernels); r++) {
        double mu = mp[r], rs = rp[r], s1 = 0, s2 = 0;
        for (int64_t i = 0; i < D; i++) {
            double xh = (ts__load(dt, xp, r * D + i) - mu) * rs;
            double gi = ts__load(dt, gp, r * D + i);
            double gxh = gi * (wp ? ts__load(dt, wp, i) : 1.0);
            s1 += gxh;
            s2 += gxh * xh;
            if (gw) {
                gw[i] += gi * xh;
                gb[i] += gi;
            }
        }
        if (gx) {
            s1 /= (double)D;
            s2 /= (double)D;
            for (int64_t i = 0; i < D; i++) {
                double xh = (ts__load(dt, xp, r * D + i) - mu) * rs;
                double gxh = ts__load(dt, gp, r * D + i) * (wp ? ts__load(dt, wp, i) : 1.0);
                ts__store(dt, gxp, r * D + i, rs * (gxh - s1 - xh * s2));
            }
        }
    }
    if (need_w) {
        if ((st = ts__tensor_new(dt, pnd, pshape, &gin[1]))) goto out;
        for (int64_t i = 0; i < D && !meta; i++)
            ts__store(dt, ts_tensor_data(gin[1]), i, ts__is_half(dt) ? (double)(float)gw[i] : gw[i]);
    }
    if (need_b) {
        if ((st = ts__tensor_new(dt, pnd, pshape, &gin[2]))) goto out;
        for (int64_t i = 0; i < D && !meta; i++)
            ts__store(dt, ts_tensor_data(gin[2]), i, ts__is_half(dt) ? (double)(float)gb[i] : gb[i]);
    }
    gin[0] = gx;
    gx = NULL;
out:
    ts_tensor_free(gx);
    ts__free(TS_MEM_OTHER, gw);
    ts_tensor_free(gc);
    return st;
}

ts_status ts_layer_norm(ts_tensor *x, int n_norm_dims, ts_tensor *weight, ts_tensor *bias, double eps, ts_tensor **out)
{
    ts_tensor *in[3] = {x, weight, bias};
    ts_status st;
    if ((st = ts__check_inputs("layer_norm", 1, &x)) || (weight && (st = ts__check_inputs("layer_norm", 1, &weight))) ||
        (bias && (st = ts__check_inputs("layer_norm", 1, &bias))) || (st = ts__check_floating("layer_norm", x)))
        return st;
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "layer_norm: out is NULL");
    char s1[96], s2[96];
    if (n_norm_dims < 1 || n_norm_dims > x->ndim)
        return ts_error(TS_ERR_SHAPE, "layer_norm: cannot normalize the last %d dims of a tensor of shape %s",
                        n_norm_dims, ts_shape_str(x->ndim, x->shape, s1, sizeof s1));
    const int64_t *nshape = x->shape + x->ndim - n_norm_dims;
    for (int k = 0; k < 2; k++) {
        ts_tensor *p = k ? bias : weight;
        if (!p) continue;
        if (p->dtype != x->dtype)
            return ts_error(TS_ERR_DTYPE, "layer_norm: %s dtype %s differs from input dtype %s", k ? "bias" : "weight",
                            ts_dtype_name(p->dtype), ts_dtype_name(x->dtype));
        if (p->ndim != n_norm_dims || memcmp(p->shape, nshape, (size_t)n_norm_dims * sizeof *nshape) != 0)
            return ts_error(TS_ERR_SHAPE, "layer_norm: %s of shape %s does not match normalized shape %s",
                            k ? "bias" : "weight", ts_shape_str(p->ndim, p->shape, s1, sizeof s1),
                            ts_shape_str(n_norm_dims, nshape, s2, sizeof s2));
    }
    int64_t D = ts__numel(n_norm_dims, nshape), R = D ? ts_tensor_numel(x) / D : 0;
    ts_tensor *xc = NULL, *wc = NULL, *bc = NULL, *o = NULL, *mean = NULL, *rstd = NULL;
    bool grad = ts_grad_mode_set(false);
    st = ts_contiguous(x, &xc);
    if (!st && weight) st = ts_contiguous(weight, &wc);
    if (!st && bias) st = ts_contiguous(bias, &bc);
    ts_grad_mode_set(grad);
    if (st) goto fail;
    int64_t rs[1] = {R};
    if ((st = ts__tensor_new(x->dtype, x->ndim, x->shape, &o)) || (st = ts__tensor_new(TS_F64, 1, rs, &mean)) ||
        (st = ts__tensor_new(TS_F64, 1, rs, &rstd)))
        goto fail;
    double *mp = ts_tensor_data(mean), *rp = ts_tensor_data(rstd);
    if (ts__is_meta(o)) {
        /* meta: nothing to compute */
    } else if (ts__is_half(x->dtype)) {
        /* bfloat16 / float16 as PyTorch's CPU kernel: mean, rstd and the
         * affine map in float (the f32 row kernel over float copies),
         * the output rounded once to the input's dtype */
        ts_dtype dt = x->dtype;
        size_t es = ts_dtype_size(dt);
        float *buf = ts__malloc(TS_MEM_OTHER, (size_t)(4 * D + 1) * sizeof *buf);
        if (!buf) {
            st = TS_ERR_NO_MEMORY;
            goto fail;
        }
        float *xf = buf, *yf = buf + D, *wf = wc ? buf + 2 * D : NULL, *bf = bc ? buf + 3 * D : NULL;
        if (wf) ts__buf_convert(TS_F32, wf, dt, ts_tensor_data(wc), D);
        if (bf) ts__buf_convert(TS_F32, bf, dt, ts_tensor_data(bc), D);
        const char *xp = ts_tensor_data(xc);
        char *op_ = ts_tensor_data(o);
        for (int64_t r = 0; r < R; r++) {
            ts__buf_convert(TS_F32, xf, dt, xp + (size_t)(r * D) * es, D);
            layer_norm_row_f32(xf, wf, bf, D, eps, yf, &mp[r], &rp[r]);
            ts__buf_convert(dt, op_ + (size_t)(r * D) * es, TS_F32, yf, D);
        }
        ts__free(TS_MEM_OTHER, buf);
    } else if (x->dtype == TS_F32 && !ts__use_reference_kernels) {
        const float *xp = ts_tensor_data(xc), *wp = wc ? ts_tensor_data(wc) : NULL,
                    *bp = bc ? ts_tensor_data(bc) : NULL;
        float *op_ = ts_tensor_data(o);
        for (int64_t r = 0; r < R; r++) layer_norm_row_f32(xp + r * D, wp, bp, D, eps, op_ + r * D, &mp[r], &rp[r]);
    } else {
        ts_dtype dt = x->dtype;
        const void *xp = ts_tensor_data(xc), *wp = wc ? ts_tensor_data(wc) : NULL, *bp = bc ? ts_tensor_data(bc) : NULL;
        void *op_ = ts_tensor_data(o);
        for (int64_t r = 0; r < R; r++) {
            double s = 0, ss = 0;
            for (int64_t i = 0; i < D; i++) s += ts__load(dt, xp, r * D + i);
            double mu = s / (double)D;
            for (int64_t i = 0; i < D; i++) {
                double d = ts__load(dt, xp, r * D + i) - mu;
                ss += d * d;
            }
            double rsd = 1.0 / sqrt(ss / (double)D + eps);
            mp[r] = mu;
            rp[r] = rsd;
            for (int64_t i = 0; i < D; i++) {
                double v = (ts__load(dt, xp, r * D + i) - mu) * rsd;
                if (wp) v *= ts__load(dt, wp, i);
                if (bp) v += ts__load(dt, bp, i);
                ts__store(dt, op_, r * D + i, v);
            }
        }
    }
    if (ts__needs_grad(3, in)) {
        ts_node *n = ts__node_new("layer_norm", layer_norm_backward, 3, in, 1);
        if (!n) {
            st = TS_ERR_NO_MEMORY;
            goto fail;
        }
        n->iargs[0] = D;
        n->iargs[1] = n_norm_dims;
        memcpy(&n->iargs[2], nshape, (size_t)n_norm_dims * sizeof *nshape);
        if (!(st = ts__node_save(n, 0, xc)) && !(st = ts__node_save(n, 1, wc)) && !(st = ts__node_save(n, 2, mean)) &&
            !(st = ts__node_save(n, 3, rstd)))
            ts__node_set_output(n, 0, o);
        ts__node_free(n);
        if (st) goto fail;
    }
    ts_tensor_free(xc);
    ts_tensor_free(wc);
    ts_tensor_free(bc);
    ts_tensor_free(mean);
    ts_tensor_free(rstd);
    *out = o;
    return TS_OK;
fail:
    ts_tensor_free(xc);
    ts_tensor_free(wc);
    ts_tensor_free(bc);
    ts_tensor_free(o);
    ts_tensor_free(mean);
    ts_tensor_free(rstd);
    return st;
}

/* ----------------------------------------------------- embedding */

static ts_status embedding_backward(ts_node *n, ts_tensor **g, ts_tensor **gin)
{
    ts_tensor *idx = n->saved[0], *gc, *gw;
    int64_t num = n->iargs[0], dim = n->iargs[1], cnt = ts_tensor_numel(idx);
    int64_t sh[2] = {num, dim};
    ts_status st = ts_contiguous(g[0], &gc);
    if (st) return st;
    if ((st = ts__tensor_new(g[0]->dtype, 2, sh, &gw))) {
        ts_tensor_free(gc);
        return st;
    }
    ts_tensor_fill_(gw, 0.0);
    const int64_t *ip = ts_tensor_data(idx);
    if (ts__meta_mode()) {
        /* meta: nothing to compute */
    } else if (gw->dtype == TS_F32) {
        float *w = ts_tensor_data(gw);
        const float *gp = ts_tensor_data(gc);
        for (int64_t r = 0; r < cnt; r++)
            for (int64_t i = 0; i < dim; i++) w[ip[r] * dim + i] += gp[r * dim + i];
    } else if (ts__is_half(gw->dtype)) {
        /* PyTorch's embedding_dense_backward_cpu: grad_weight[k].add_(
         * grad[r]) for each index in order, so every partial sum of a row
         * hit several times is rounded to the 16-bit dtype (ts__buf_add: each
         * element through f32, rounded once) */
        size_t row = (size_t)dim * ts_dtype_size(gw->dtype);
        char *w = ts_tensor_data(gw);
        const char *gp = ts_tensor_data(gc);
        for (int64_t r = 0; r < cnt; r++) ts__buf_add(gw->dtype, w + (size_t)ip[r] * row, gp + (size_t)r * row, dim);
    } else {
        double *w = ts_tensor_data(gw);
        const double *gp = ts_tensor_data(gc);
        for (int64_t r = 0; r < cnt; r++)
            for (int64_t i = 0; i < dim; i++) w[ip[r] * dim + i] += gp[r * dim + i];
    }
    ts_tensor_free(gc);
    gin[0] = gw;
    return TS_OK;
}

ts_status ts_embedding(ts_tensor *weight, ts_tensor *indices, ts_tensor **out)
{
    ts_tensor *in[2] = {weight, indices};
    ts_status st;
    if ((st = ts__check_inputs("embedding", 2, in)) || (st = ts__check_floating("embedding", weight))) return st;
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "embedding: out is NULL");
    char s1[96];
    if (weight->ndim != 2)
        return ts_error(TS_ERR_SHAPE, "embedding: weight must be 2-d (num, dim), got %s",
                        ts_shape_str(weight->ndim, weight->shape, s1, sizeof s1));
    if (indices->dtype != TS_I64 && indices->dtype != TS_I32)
        return ts_error(TS_ERR_DTYPE, "embedding: indices must be int64 or int32, got %s",
                        ts_dtype_name(indices->dtype));
    if (indices->ndim >= TS_MAX_DIMS)
        return ts_error(TS_ERR_SHAPE, "embedding: indices have %d dims; at most %d", indices->ndim, TS_MAX_DIMS - 1);
    ts_tensor *ic, *wc, *o;
    if ((st = ts_to_dtype(indices, TS_I64, &ic))) return st;
    ts_tensor *icc;
    st = ts_contiguous(ic, &icc);
    ts_tensor_free(ic);
    if (st) return st;
    int64_t num = weight->shape[0], dim = weight->shape[1], cnt = ts_tensor_numel(icc);
    const int64_t *ip = ts_tensor_data(icc); /* NULL for meta indices: their values are unknown */
    for (int64_t r = 0; r < cnt && ip; r++)
        if (ip[r] < 0 || ip[r] >= num) {
            ts_tensor_free(icc);
            return ts_error(TS_ERR_INDEX, "embedding: index %lld at position %lld is out of range for %lld rows",
                            (long long)ip[r], (long long)r, (long long)num);
        }
    bool grad = ts_grad_mode_set(false);
    st = ts_contiguous(weight, &wc);
    ts_grad_mode_set(grad);
    if (st) {
        ts_tensor_free(icc);
        return st;
    }
    int64_t oshape[TS_MAX_DIMS];
    memcpy(oshape, indices->shape, (size_t)indices->ndim * sizeof *oshape);
    oshape[indices->ndim] = dim;
    if ((st = ts__tensor_new(weight->dtype, indices->ndim + 1, oshape, &o))) goto done;
    size_t row = (size_t)dim * ts_dtype_size(weight->dtype);
    for (int64_t r = 0; r < cnt && !ts__is_meta(o); r++)
        memcpy((char *)ts_tensor_data(o) + (size_t)r * row, (char *)ts_tensor_data(wc) + (size_t)ip[r] * row, row);
    if (ts__needs_grad(1, &weight)) {
        ts_node *n = ts__node_new("embedding", embedding_backward, 1, &weight, 1);
        if (!n) st = TS_ERR_NO_MEMORY;
        else {
            n->iargs[0] = num;
            n->iargs[1] = dim;
            if (!(st = ts__node_save(n, 0, icc))) ts__node_set_output(n, 0, o);
            ts__node_free(n);
        }
        if (st) {
            ts_tensor_free(o);
            goto done;
        }
    }
    *out = o;
done:
    ts_tensor_free(icc);
    ts_tensor_free(wc);
    return st;
}

/* ----------------------------------------------------- cross_entropy */

/* saved: 0 = log-probabilities (N, C), 1 = targets. iargs: 0 = ignore,
 * 1 = reduction; dargs[0] = 1 / count for mean. */
static ts_status cross_entropy_backward(ts_node *n, ts_tensor **g, ts_tensor **gin)
{
    ts_tensor *lp = n->saved[0], *tg = n->saved[1], *gx, *gc;
    int64_t N = lp->shape[0], C = lp->shape[1], ignore = n->iargs[0];
    ts_reduction red = (ts_reduction)n->iargs[1];
    ts_status st = ts_contiguous(g[0], &gc);
    if (st) return st;
    if ((st = ts__tensor_new(lp->dtype, 2, lp->shape, &gx))) {
        ts_tensor_free(gc);
        return st;
    }
    const int64_t *t = ts_tensor_data(tg);
    ts_dtype dt = lp->dtype;
    const void *lpp = ts_tensor_data(lp), *gp = ts_tensor_data(gc);
    void *gxp = ts_tensor_data(gx);
    if (ts__is_meta(gx)) N = 0; /* meta: nothing to compute */
    for (int64_t i = 0; i < N && ts__is_half(dt); i++) {
        /* PyTorch: nll_loss_backward writes -g (times 1/count for mean,
         * rounded to dt) at the target, then log_softmax_backward
         * g_c - exp(lp_c) * sum(g), in float, rounded once to dt */
        float gi = red == TS_REDUCTION_NONE ? (float)ts__load(dt, gp, i)
                                            : ts__round_half(dt, (float)(ts__load(dt, gp, 0) * n->dargs[0]));
        bool ign = t[i] == ignore;
        const uint16_t *lr = (const uint16_t *)lpp + i * C;
        uint16_t *gr = (uint16_t *)gxp + i * C;
        for (int64_t c = 0; c < C; c++)
            gr[c] =
                ts__f32_to_half(dt, ign ? 0.0f : gi * (expf(ts__half_to_f32(dt, lr[c])) - (c == t[i] ? 1.0f : 0.0f)));
    }
    for (int64_t i = 0; i < N && !ts__is_half(dt); i++) {
        double gi = red == TS_REDUCTION_NONE ? ts__load(dt, gp, i) : ts__load(dt, gp, 0) * n->dargs[0];
        bool ign = t[i] == ignore;
        for (int64_t c = 0; c < C; c++) {
            double v = ign ? 0.0 : gi * (exp(ts__load(dt, lpp, i * C + c)) - (c == t[i] ? 1.0 : 0.0));
            ts__store(dt, gxp, i * C + c, v);
        }
    }
    ts_tensor_free(gc);
    gin[0] = gx;
    return TS_OK;
}

ts_status ts_cross_entropy(ts_tensor *logits, ts_tensor *targets, int64_t ignore_index, ts_reduction reduction,
                           ts_tensor **out)
{
    ts_tensor *in[2] = {logits, targets};
    ts_status st;
    if ((st = ts__check_inputs("cross_entropy", 2, in)) || (st = ts__check_floating("cross_entropy", logits)))
        return st;
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "cross_entropy: out is NULL");
    char s1[96], s2[96];
    if (logits->ndim != 2 || targets->ndim != 1 || targets->shape[0] != logits->shape[0])
        return ts_error(TS_ERR_SHAPE, "cross_entropy: logits %s and targets %s do not fit (expected (N, C) and (N,))",
                        ts_shape_str(logits->ndim, logits->shape, s1, sizeof s1),
                        ts_shape_str(targets->ndim, targets->shape, s2, sizeof s2));
    if (targets->dtype != TS_I64)
        return ts_error(TS_ERR_DTYPE, "cross_entropy: targets must be int64, got %s", ts_dtype_name(targets->dtype));
    if (reduction != TS_REDUCTION_MEAN && reduction != TS_REDUCTION_SUM && reduction != TS_REDUCTION_NONE)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "cross_entropy: invalid reduction %d", (int)reduction);
    int64_t N = logits->shape[0], C = logits->shape[1];
    ts_tensor *tc;
    if ((st = ts_contiguous(targets, &tc))) return st;
    const int64_t *t = ts_tensor_data(tc); /* NULL for meta targets: their values are unknown */
    for (int64_t i = 0; i < N && t; i++)
        if (t[i] != ignore_index && (t[i] < 0 || t[i] >= C)) {
            ts_tensor_free(tc);
            return ts_error(TS_ERR_INDEX,
                            "cross_entropy: target %lld at position %lld is out of range for %lld "
                            "classes (ignore_index is %lld)",
                            (long long)t[i], (long long)i, (long long)C, (long long)ignore_index);
        }
    ts_tensor *lp;
    bool grad = ts_grad_mode_set(false);
    st = ts_log_softmax(logits, 1, &lp);
    ts_grad_mode_set(grad);
    if (st) {
        ts_tensor_free(tc);
        return st;
    }
    ts_dtype dt = logits->dtype;
    const void *lpp = ts_tensor_data(lp);
    double total = 0;
    int64_t count = 0;
    ts_tensor *o;
    int64_t nshape[1] = {N};
    if ((st = reduction == TS_REDUCTION_NONE ? ts__tensor_new(dt, 1, nshape, &o) : ts__tensor_new(dt, 0, NULL, &o)))
        goto done;
    bool meta = ts__is_meta(o);
    if (meta) count = N; /* the targets are unknown: the node's mean scale as if none were ignored (unused on meta) */
    for (int64_t i = 0; i < N && !meta; i++) {
        double li = t[i] == ignore_index ? 0.0 : -ts__load(dt, lpp, i * C + t[i]);
        if (t[i] != ignore_index) count++;
        if (reduction == TS_REDUCTION_NONE) ts__store(dt, ts_tensor_data(o), i, li);
        total += li;
    }
    double scale = reduction == TS_REDUCTION_MEAN ? 1.0 / (double)count : 1.0; /* 0 targets: NaN, as PyTorch */
    if (reduction != TS_REDUCTION_NONE && !meta)
        ts__store(dt, ts_tensor_data(o), 0, reduction == TS_REDUCTION_MEAN ? total / (double)count : total);
    if (ts__needs_grad(1, &logits)) {
        ts_node *n = ts__node_new("cross_entropy", cross_entropy_backward, 1, &logits, 1);
        if (!n) st = TS_ERR_NO_MEMORY;
        else {
            n->iargs[0] = ignore_index;
            n->iargs[1] = reduction;
            n->dargs[0] = scale;
            if (!(st = ts__node_save(n, 0, lp)) && !(st = ts__node_save(n, 1, tc))) ts__node_set_output(n, 0, o);
            ts__node_free(n);
        }
        if (st) {
            ts_tensor_free(o);
            goto done;
        }
    }
    *out = o;
done:
    ts_tensor_free(lp);
    ts_tensor_free(tc);
    return st;
}

/* ----------------------------------------------------- mse_loss */

ts_status ts_mse_loss(ts_tensor *input, ts_tensor *target, ts_reduction reduction, ts_tensor **out)
{
    ts_tensor *in[2] = {input, target};
    ts_status st;
    if ((st = ts__check_inputs("mse_loss", 2, in))) return st;
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "mse_loss: out is NULL");
    if (input->ndim != target->ndim || memcmp(input->shape, target->shape, (size_t)input->ndim * sizeof(int64_t))) {
        char s1[96], s2[96];
        return ts_error(TS_ERR_SHAPE, "mse_loss: input %s and target %s must have the same shape",
                        ts_shape_str(input->ndim, input->shape, s1, sizeof s1),
                        ts_shape_str(target->ndim, target->shape, s2, sizeof s2));
    }
    if (reduction != TS_REDUCTION_MEAN && reduction != TS_REDUCTION_SUM && reduction != TS_REDUCTION_NONE)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "mse_loss: invalid reduction %d", (int)reduction);
    ts_tensor *d, *sq;
    if ((st = ts_sub(input, target, &d))) return st;
    st = ts_mul(d, d, &sq);
    ts_tensor_free(d);
    if (st || reduction == TS_REDUCTION_NONE) {
        if (!st) *out = sq;
        return st;
    }
    st = reduction == TS_REDUCTION_MEAN ? ts_mean(sq, 0, NULL, false, out) : ts_sum(sq, 0, NULL, false, out);
    ts_tensor_free(sq);
    return st;
}

/* ----------------------------------------------------- l1_loss */

/* torch 1.13's l1_loss is composite: apply_loss_reduction((input -
 * target).abs(), reduction), so the gradient is abs's (sign, 0 at 0). */
ts_status ts_l1_loss(ts_tensor *input, ts_tensor *target, ts_reduction reduction, ts_tensor **out)
{
    ts_tensor *in[2] = {input, target};
    ts_status st;
    if ((st = ts__check_inputs("l1_loss", 2, in))) return st;
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "l1_loss: out is NULL");
    if (input->ndim != target->ndim || memcmp(input->shape, target->shape, (size_t)input->ndim * sizeof(int64_t))) {
        char s1[96], s2[96];
        return ts_error(TS_ERR_SHAPE, "l1_loss: input %s and target %s must have the same shape",
                        ts_shape_str(input->ndim, input->shape, s1, sizeof s1),
                        ts_shape_str(target->ndim, target->shape, s2, sizeof s2));
    }
    if (reduction != TS_REDUCTION_MEAN && reduction != TS_REDUCTION_SUM && reduction != TS_REDUCTION_NONE)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "l1_loss: invalid reduction %d", (int)reduction);
    ts_tensor *d, *ad;
    if ((st = ts_sub(input, target, &d))) return st;
    st = ts_abs(d, &ad);
    ts_tensor_free(d);
    if (st || reduction == TS_REDUCTION_NONE) {
        if (!st) *out = ad;
        return st;
    }
    st = reduction == TS_REDUCTION_MEAN ? ts_mean(ad, 0, NULL, false, out) : ts_sum(ad, 0, NULL, false, out);
    ts_tensor_free(ad);
    return st;
}

/* ----------------------------------------------------- dropout */

/* bfloat16 / float16 dropout, as torch 1.13's CPU _dropout in that dtype:
 * noise = empty_like(x).bernoulli_(1 - p) (the same draws, in the same
 * order, as for float32: the mask is drawn into a float32 tensor and
 * converted), noise.div_(1 - p) (a scalar division in the tensor's dtype:
 * the scalar is rounded to it, the quotient computed in float and rounded),
 * out = x * noise rounded once; the backward is mul's, g * noise rounded.
 * saved[0] = noise (a's dtype, contiguous). */
static ts_status dropout_half_backward(ts_node *n, ts_tensor **g, ts_tensor **gin)
{
    ts_tensor *noise = n->saved[0], *gc, *gx;
    ts_status st = ts_contiguous(g[0], &gc);
    if (st) return st;
    if ((st = ts__tensor_new(noise->dtype, noise->ndim, noise->shape, &gx))) {
        ts_tensor_free(gc);
        return st;
    }
    ts_dtype dt = noise->dtype;
    const uint16_t *gp = ts_tensor_data(gc), *np_ = ts_tensor_data(noise);
    uint16_t *o = ts_tensor_data(gx);
    for (int64_t i = 0, cnt = ts_tensor_numel(gx); i < cnt && o; i++) /* o NULL: meta */
        o[i] = ts__f32_to_half(dt, ts__half_to_f32(dt, gp[i]) * ts__half_to_f32(dt, np_[i]));
    ts_tensor_free(gc);
    gin[0] = gx;
    return TS_OK;
}

ts_status ts__dropout_noise_half(ts_dtype dt, int ndim, const int64_t *shape, double p, ts_generator *gen,
                                 ts_tensor **out)
{
    ts_tensor *mask = NULL, *noise = NULL;
    /* p == 1: zeros without drawing (PyTorch: input * zeros({})) */
    ts_status st = p == 1.0 ? ts_tensor_zeros(TS_F32, ndim, shape, &mask) : ts__tensor_new(TS_F32, ndim, shape, &mask);
    if (!st && p != 1.0 && !ts__is_meta(mask)) /* meta: no draw, the generator stays */
        st = ts_bernoulli_(mask, 1.0 - p, gen);
    if (!st) st = ts__tensor_new(dt, ndim, shape, &noise);
    if (!st) {
        uint16_t keep = ts__f32_to_half(dt, 1.0f / ts__round_half(dt, (float)(1.0 - p)));
        const float *mp = ts_tensor_data(mask);
        uint16_t *np_ = ts_tensor_data(noise);
        for (int64_t i = 0, cnt = ts_tensor_numel(noise); i < cnt && np_; i++) /* np_ NULL: meta */
            np_[i] = mp[i] != 0.0f ? keep : 0;
        *out = noise;
    }
    ts_tensor_free(mask);
    return st;
}

static ts_status dropout_half(ts_tensor *a, double p, ts_generator *gen, ts_tensor **out)
{
    ts_dtype dt = a->dtype;
    ts_tensor *noise = NULL, *ac = NULL, *o = NULL;
    ts_status st;
    bool grad = ts_grad_mode_set(false);
    st = ts_contiguous(a, &ac);
    ts_grad_mode_set(grad);
    if (st || (st = ts__dropout_noise_half(dt, a->ndim, a->shape, p, gen, &noise)) ||
        (st = ts__tensor_new(dt, a->ndim, a->shape, &o)))
        goto done;
    const uint16_t *xp = ts_tensor_data(ac), *np_ = ts_tensor_data(noise);
    uint16_t *op_ = ts_tensor_data(o);
    for (int64_t i = 0, cnt = ts_tensor_numel(o); i < cnt && op_; i++) /* op_ NULL: meta */
        op_[i] = ts__f32_to_half(dt, ts__half_to_f32(dt, xp[i]) * ts__half_to_f32(dt, np_[i]));
    if (ts__needs_grad(1, &a)) {
        ts_node *n = ts__node_new("dropout", dropout_half_backward, 1, &a, 1);
        if (!n) {
            st = TS_ERR_NO_MEMORY;
            goto done;
        }
        ts_tensor *keep_o = o;
        o = NULL; /* ts__record1 frees it on failure */
        if ((st = ts__record1(n, keep_o, noise, NULL))) goto done;
        o = keep_o;
    }
    *out = o;
    o = NULL;
done:
    ts_tensor_free(noise);
    ts_tensor_free(ac);
    ts_tensor_free(o);
    return st;
}

ts_status ts_dropout(ts_tensor *a, double p, bool training, ts_generator *gen, ts_tensor **out)
{
    ts_status st;
    if ((st = ts__check_inputs("dropout", 1, &a)) || (st = ts__check_floating("dropout", a))) return st;
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "dropout: out is NULL");
    if (!(p >= 0.0 && p <= 1.0))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "dropout: probability has to be between 0 and 1, but got %g", p);
    if (!training || p == 0.0) {
        *out = ts_tensor_retain(a);
        return TS_OK;
    }
    if (ts__is_half(a->dtype)) return dropout_half(a, p, gen, out);
    if (p == 1.0) {
        ts_tensor *z;
        if ((st = ts_tensor_zeros(a->dtype, a->ndim, a->shape, &z))) return st;
        st = ts_mul(a, z, out);
        ts_tensor_free(z);
        return st;
    }
    /* PyTorch: mask = empty_like(x).bernoulli_(1 - p); mask /= (1 - p); x * mask */
    ts_tensor *mask, *scaled;
    if ((st = ts__tensor_new(a->dtype, a->ndim, a->shape, &mask))) return st;
    if (!ts__is_meta(mask) && (st = ts_bernoulli_(mask, 1.0 - p, gen))) { /* meta: no draw */
        ts_tensor_free(mask);
        return st;
    }
    st = ts_div_scalar(mask, 1.0 - p, &scaled);
    ts_tensor_free(mask);
    if (st) return st;
    st = ts_mul(a, scaled, out);
    ts_tensor_free(scaled);
    return st;
}
