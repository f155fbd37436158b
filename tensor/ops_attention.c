/* Multi-head attention core in one op: per batch and head, scores =
 * q k^T (straight from the strided projections, no head split copies),
 * scale, mask and softmax in place, dropout, then weights @ v written
 * straight into the (B, T, E) output at the head's columns. The backward
 * writes dq, dk, dv the same way. This replaces a chain of views, copies
 * and elementwise passes whose memory traffic was a third of the
 * non-matmul time of a transformer step. */
#define _GNU_SOURCE
#include "tensor/flash_attention.h"
#include "tensor/half_ops.h"
#include "tensor/internal.h"

#include <math.h>
#include <string.h>

/* ------------------------------------------------ bfloat16 / float16 */

/* In the 16-bit dtypes the op follows torch 1.13's F.multi_head_attention_
 * forward op by op, each op computing in float and rounding its result
 * once to the dtype, as PyTorch's CPU kernels do:
 *     qs = q / sqrt(hd)                 (the scalar rounded to the dtype)
 *     A  = baddbmm(mask, qs, k^T)       (float accumulation, rounded)
 *     P  = softmax(A)                   (ts__softmax_rows_half)
 *     W  = P * noise                    (dropout: noise round(1/round(1-p)))
 *     O  = bmm(W, v)
 * and the backward is the chain of those ops' backward formulas, each
 * rounded. The matrix products run in float32 (ts__gemm) over float copies
 * of the head's slices. */

/* rows x cols floats from a 16-bit matrix with row stride rs (elements)
 * and unit column stride. */
static void load_rows(ts_dtype dt, float *dst, const char *src, int64_t rs, int64_t rows, int64_t cols)
{
    size_t es = ts_dtype_size(dt);
    for (int64_t r = 0; r < rows; r++) ts__buf_convert(TS_F32, dst + r * cols, dt, src + (size_t)(r * rs) * es, cols);
}

/* The inverse: rows x cols floats rounded into a 16-bit matrix. */
static void store_rows(ts_dtype dt, char *dst, int64_t rs, const float *src, int64_t rows, int64_t cols)
{
    size_t es = ts_dtype_size(dt);
    for (int64_t r = 0; r < rows; r++) ts__buf_convert(dt, dst + (size_t)(r * rs) * es, TS_F32, src + r * cols, cols);
}

/* qs (T, hd) = round(q / s) for the head at qbh (row stride rs). */
static void load_q_scaled(ts_dtype dt, float *qs, const char *qbh, int64_t rs, int64_t T, int64_t hd, float s)
{
    load_rows(dt, qs, qbh, rs, T, hd);
    for (int64_t i = 0; i < T * hd; i++) qs[i] = ts__round_half(dt, qs[i] / s);
}

static ts_status attention_half_forward(ts_tensor *q, ts_tensor *k, ts_tensor *v, int64_t H, const uint8_t *mp,
                                        ts_tensor *P, ts_tensor *D, ts_tensor *o)
{
    ts_dtype dt = q->dtype;
    int64_t B = q->shape[0], T = q->shape[1], S = k->shape[1], E = q->shape[2], hd = E / H, TS_ = T * S;
    size_t es = ts_dtype_size(dt);
    float sdiv = ts__round_half(dt, (float)sqrt((double)hd));
    float *buf = ts__malloc(TS_MEM_OTHER, (size_t)(2 * T * hd + 2 * S * hd + TS_ + 1) * sizeof *buf);
    if (!buf) return TS_ERR_NO_MEMORY;
    float *qf = buf, *kf = qf + T * hd, *vf = kf + S * hd, *wf = vf + S * hd, *of = wf + TS_;
    const char *qp = ts_tensor_data(q), *kp = ts_tensor_data(k), *vp = ts_tensor_data(v);
    char *Pp = ts_tensor_data(P), *op_ = ts_tensor_data(o);
    const uint16_t *Dp = D ? ts_tensor_data(D) : NULL;
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++) {
            load_q_scaled(dt, qf, qp + (size_t)(b * q->strides[0] + h * hd) * es, q->strides[1], T, hd, sdiv);
            load_rows(dt, kf, kp + (size_t)(b * k->strides[0] + h * hd) * es, k->strides[1], S, hd);
            load_rows(dt, vf, vp + (size_t)(b * v->strides[0] + h * hd) * es, v->strides[1], S, hd);
            /* A (T, S) = qs @ k^T, rounded, -inf where masked */
            ts__gemm(TS_F32, T, S, hd, qf, hd, 1, kf, 1, hd, 0.0, wf, S, 1);
            for (int64_t i = 0; i < TS_; i++) wf[i] = mp && mp[i] ? -INFINITY : wf[i];
            uint16_t *Pbh = (uint16_t *)(void *)(Pp + (size_t)((b * H + h) * TS_) * es);
            store_rows(dt, (char *)Pbh, S, wf, T, S);
            ts__softmax_rows_half(dt, Pbh, Pbh, T, S, false);
            load_rows(dt, wf, (const char *)Pbh, S, T, S);
            if (Dp) {
                const uint16_t *Dbh = Dp + (b * H + h) * TS_;
                for (int64_t i = 0; i < TS_; i++) wf[i] = ts__round_half(dt, wf[i] * ts__half_to_f32(dt, Dbh[i]));
            }
            /* O (T, hd) = W @ v, rounded into the head's columns */
            ts__gemm(TS_F32, T, hd, S, wf, S, 1, vf, hd, 1, 0.0, of, hd, 1);
            store_rows(dt, op_ + (size_t)(b * T * E + h * hd) * es, E, of, T, hd);
        }
    ts__free(TS_MEM_OTHER, buf);
    return TS_OK;
}

static ts_status attention_half_backward(ts_tensor *q, ts_tensor *k, ts_tensor *v, int64_t H, ts_tensor *P,
                                         ts_tensor *D, ts_tensor *go, ts_tensor *dq, ts_tensor *dk, ts_tensor *dv)
{
    ts_dtype dt = q->dtype;
    int64_t B = q->shape[0], T = q->shape[1], S = k->shape[1], E = q->shape[2], hd = E / H, TS_ = T * S;
    size_t es = ts_dtype_size(dt);
    float sdiv = ts__round_half(dt, (float)sqrt((double)hd));
    size_t nf = (size_t)(3 * T * hd + 4 * S * hd + 2 * TS_ + 1);
    float *buf = ts__malloc(TS_MEM_OTHER, nf * sizeof *buf + (size_t)(TS_ + 1) * sizeof(uint16_t));
    if (!buf) return TS_ERR_NO_MEMORY;
    float *qf = buf, *kf = qf + T * hd, *vf = kf + S * hd, *gf = vf + S * hd, *wf = gf + T * hd, *dwf = wf + TS_;
    float *dqf = dwf + TS_, *dkf = dqf + T * hd, *dvf = dkf + S * hd;
    uint16_t *dsh = (uint16_t *)(void *)(buf + nf);
    const char *qp = ts_tensor_data(q), *kp = ts_tensor_data(k), *vp = ts_tensor_data(v), *gp = ts_tensor_data(go);
    const char *Pp = ts_tensor_data(P);
    const uint16_t *Dp = D ? ts_tensor_data(D) : NULL;
    char *dqp = ts_tensor_data(dq), *dkp = ts_tensor_data(dk), *dvp = ts_tensor_data(dv);
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++) {
            load_q_scaled(dt, qf, qp + (size_t)(b * q->strides[0] + h * hd) * es, q->strides[1], T, hd, sdiv);
            load_rows(dt, kf, kp + (size_t)(b * k->strides[0] + h * hd) * es, k->strides[1], S, hd);
            load_rows(dt, vf, vp + (size_t)(b * v->strides[0] + h * hd) * es, v->strides[1], S, hd);
            load_rows(dt, gf, gp + (size_t)(b * T * E + h * hd) * es, E, T, hd);
            const char *Pbh = Pp + (size_t)((b * H + h) * TS_) * es;
            const uint16_t *Dbh = Dp ? Dp + (b * H + h) * TS_ : NULL;
            load_rows(dt, wf, Pbh, S, T, S);
            if (Dbh)
                for (int64_t i = 0; i < TS_; i++) wf[i] = ts__round_half(dt, wf[i] * ts__half_to_f32(dt, Dbh[i]));
            /* bmm(W, v): dv (S, hd) = W^T @ dO, dW (T, S) = dO @ v^T */
            ts__gemm(TS_F32, S, hd, T, wf, 1, S, gf, hd, 1, 0.0, dvf, hd, 1);
            store_rows(dt, dvp + (size_t)(b * S * E + h * hd) * es, E, dvf, S, hd);
            ts__gemm(TS_F32, T, S, hd, gf, hd, 1, vf, 1, hd, 0.0, dwf, S, 1);
            ts__round_half_buf(dt, dwf, TS_);
            /* dropout: dP = dW * noise */
            if (Dbh)
                for (int64_t i = 0; i < TS_; i++) dwf[i] = ts__round_half(dt, dwf[i] * ts__half_to_f32(dt, Dbh[i]));
            /* softmax: dA = P * (dP - sum(dP * P)) */
            store_rows(dt, (char *)dsh, S, dwf, T, S);
            ts__softmax_bw_rows_half(dt, dsh, Pbh, dsh, T, S, false);
            load_rows(dt, dwf, (const char *)dsh, S, T, S);
            /* baddbmm(mask, qs, k^T): dqs (T, hd) = dA @ k, dk (S, hd) = dA^T @ qs */
            ts__gemm(TS_F32, T, hd, S, dwf, S, 1, kf, hd, 1, 0.0, dqf, hd, 1);
            ts__gemm(TS_F32, S, hd, T, dwf, 1, S, qf, hd, 1, 0.0, dkf, hd, 1);
            store_rows(dt, dkp + (size_t)(b * S * E + h * hd) * es, E, dkf, S, hd);
            /* qs = q / s: dq = round(dqs) / s, rounded */
            for (int64_t i = 0; i < T * hd; i++) dqf[i] = ts__round_half(dt, dqf[i]) / sdiv;
            store_rows(dt, dqp + (size_t)(b * T * E + h * hd) * es, E, dqf, T, hd);
        }
    ts__free(TS_MEM_OTHER, buf);
    return TS_OK;
}

/* The reference path (every dtype; float32 takes the fused kernel
 * below unless a row is wholly masked or TS_ATTENTION=reference).
 * Node layout: saved[0..2] = q, k, v; saved[3] = probabilities P
 * (B, H, T, S) before dropout; saved[4] = the dropout scale mask D (0 or
 * 1/(1-p)) or NULL. iargs[0] = H; dargs[0] = scale. */

static ts_status attention_backward_impl(ts_node *n, ts_tensor **g, ts_tensor **gin)
{
    ts_tensor *q = n->saved[0], *k = n->saved[1], *v = n->saved[2], *P = n->saved[3], *D = n->saved[4];
    int64_t H = n->iargs[0], B = q->shape[0], T = q->shape[1], S = k->shape[1], E = q->shape[2], hd = E / H;
    double scale = n->dargs[0];
    ts_dtype dt = q->dtype;
    int64_t es = (int64_t)ts_dtype_size(dt);
    ts_tensor *go = NULL, *dq = NULL, *dk = NULL, *dv = NULL, *dp = NULL, *pd = NULL;
    ts_status st = ts_contiguous(g[0], &go);
    int64_t qs[3] = {B, T, E}, ks[3] = {B, S, E}, ps[2] = {T, S};
    if (!st) st = ts__tensor_new(dt, 3, qs, &dq);
    if (!st) st = ts__tensor_new(dt, 3, ks, &dk);
    if (!st) st = ts__tensor_new(dt, 3, ks, &dv);
    if (!st) st = ts__tensor_new(dt, 2, ps, &dp);
    if (!st && D) st = ts__tensor_new(dt, 2, ps, &pd);
    if (st) goto done;
    if (ts__meta_mode()) goto grads; /* meta: the gradients allocated, nothing to compute */
    if (ts__is_half(dt)) {
        if ((st = attention_half_backward(q, k, v, H, P, D, go, dq, dk, dv))) goto done;
        goto grads;
    }
    const char *qp = ts_tensor_data(q), *kp = ts_tensor_data(k), *vp = ts_tensor_data(v), *gp = ts_tensor_data(go);
    const char *Pp = ts_tensor_data(P), *Dp = D ? ts_tensor_data(D) : NULL;
    char *dqp = ts_tensor_data(dq), *dkp = ts_tensor_data(dk), *dvp = ts_tensor_data(dv), *dpp = ts_tensor_data(dp);
    char *pdp = pd ? ts_tensor_data(pd) : NULL;
    int64_t TS_ = T * S;
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++) {
            const char *qbh = qp + (b * q->strides[0] + h * hd * q->strides[2]) * es;
            const char *kbh = kp + (b * k->strides[0] + h * hd * k->strides[2]) * es;
            const char *vbh = vp + (b * v->strides[0] + h * hd * v->strides[2]) * es;
            const char *gbh = gp + (b * T * E + h * hd) * es;
            const char *Pbh = Pp + ((b * H + h) * TS_) * es;
            const char *Dbh = Dp ? Dp + ((b * H + h) * TS_) * es : NULL;
            /* the weights that multiplied v: P, or P * D under dropout */
            const char *W = Pbh;
            if (Dbh) {
                if (dt == TS_F32)
                    for (int64_t i = 0; i < TS_; i++)
                        ((float *)pdp)[i] = ((const float *)Pbh)[i] * ((const float *)Dbh)[i];
                else
                    for (int64_t i = 0; i < TS_; i++)
                        ((double *)pdp)[i] = ((const double *)Pbh)[i] * ((const double *)Dbh)[i];
                W = pdp;
            }
            /* dv (S, hd) = W^T (S, T) @ dO (T, hd) */
            ts__gemm(dt, S, hd, T, W, 1, S, gbh, E, 1, 0.0, dvp + (b * S * E + h * hd) * es, E, 1);
            /* dW (T, S) = dO (T, hd) @ v^T (hd, S) */
            ts__gemm(dt, T, S, hd, gbh, E, 1, vbh, v->strides[2], v->strides[1], 0.0, dpp, S, 1);
            if (Dbh) {
                if (dt == TS_F32)
                    for (int64_t i = 0; i < TS_; i++) ((float *)dpp)[i] *= ((const float *)Dbh)[i];
                else
                    for (int64_t i = 0; i < TS_; i++) ((double *)dpp)[i] *= ((const double *)Dbh)[i];
            }
            /* dScores = scale * softmax_backward(P, dP), in place */
            ts__softmax_bw_rows(dt, dpp, Pbh, dpp, T, S);
            if (dt == TS_F32)
                for (int64_t i = 0; i < TS_; i++) ((float *)dpp)[i] *= (float)scale;
            else
                for (int64_t i = 0; i < TS_; i++) ((double *)dpp)[i] *= scale;
            /* dq (T, hd) = dS (T, S) @ k (S, hd); dk (S, hd) = dS^T (S, T) @ q (T, hd) */
            ts__gemm(dt, T, hd, S, dpp, S, 1, kbh, k->strides[1], k->strides[2], 0.0, dqp + (b * T * E + h * hd) * es,
                     E, 1);
            ts__gemm(dt, S, hd, T, dpp, 1, S, qbh, q->strides[1], q->strides[2], 0.0, dkp + (b * S * E + h * hd) * es,
                     E, 1);
        }
grads:
    gin[0] = dq;
    gin[1] = dk;
    gin[2] = dv;
    dq = dk = dv = NULL;
done:
    ts_tensor_free(go);
    ts_tensor_free(dq);
    ts_tensor_free(dk);
    ts_tensor_free(dv);
    ts_tensor_free(dp);
    ts_tensor_free(pd);
    return st;
}

/* Both backward rules run in an "attention_backward" trace span (the
 * benchmarks' attention share). */
static ts_status attention_backward(ts_node *n, ts_tensor **g, ts_tensor **gin)
{
    TS_TRACE_BEGIN(t0);
    ts_status st = attention_backward_impl(n, g, gin);
    TS_TRACE_END(t0, "attention_backward", "compute");
    return st;
}

/* ------------------------------------------------------ fused float32 */

/* The fused kernel's problem over q, k, v (float32, unit last stride);
 * keep: the dropout keep bits (an int32 tensor (B, H, T,
 * TS__FLASH_KEEP_WORDS(S))) or NULL, drop_scale 1/(1-p). */
static ts__flash_problem flash_problem(ts_tensor *q, ts_tensor *k, ts_tensor *v, int64_t H, const uint8_t *mask,
                                       double scale, ts_tensor *keep, float drop_scale)
{
    return (ts__flash_problem){.B = q->shape[0],
                               .H = H,
                               .T = q->shape[1],
                               .S = k->shape[1],
                               .hd = q->shape[2] / H,
                               .q = ts_tensor_data(q),
                               .k = ts_tensor_data(k),
                               .v = ts_tensor_data(v),
                               .q_sb = q->strides[0],
                               .q_st = q->strides[1],
                               .k_sb = k->strides[0],
                               .k_st = k->strides[1],
                               .v_sb = v->strides[0],
                               .v_st = v->strides[1],
                               .mask = mask,
                               .scale = (float)scale,
                               .keep = keep ? ts_tensor_data(keep) : NULL,
                               .drop_scale = drop_scale};
}

/* Node layout of the fused path: saved[0..2] = q, k, v; saved[3] = the
 * output O (B, T, E); saved[4] = the log-sum-exp (B, H, T); saved[5] =
 * the contiguous mask or NULL; saved[6] = the dropout keep bits or NULL.
 * iargs[0] = H; dargs[0] = scale, dargs[1] = the dropout scale. */
static ts_status flash_backward_impl(ts_node *n, ts_tensor **g, ts_tensor **gin)
{
    ts_tensor *q = n->saved[0], *k = n->saved[1], *v = n->saved[2], *o = n->saved[3], *lse = n->saved[4],
              *mc = n->saved[5], *keep = n->saved[6];
    int64_t H = n->iargs[0], B = q->shape[0], T = q->shape[1], S = k->shape[1], E = q->shape[2];
    ts_tensor *go = NULL, *dq = NULL, *dk = NULL, *dv = NULL;
    int64_t qs[3] = {B, T, E}, ks[3] = {B, S, E};
    ts_status st = ts_contiguous(g[0], &go);
    if (!st) st = ts__tensor_new(TS_F32, 3, qs, &dq);
    if (!st) st = ts__tensor_new(TS_F32, 3, ks, &dk);
    if (!st) st = ts__tensor_new(TS_F32, 3, ks, &dv);
    if (!st && !ts__is_meta(dq)) { /* meta: nothing to compute */
        ts__flash_problem pr =
            flash_problem(q, k, v, H, mc ? ts_tensor_data(mc) : NULL, n->dargs[0], keep, (float)n->dargs[1]);
        st = ts__flash_backward(ts__kpath_active(), &pr, ts_tensor_data(o), ts_tensor_data(lse), ts_tensor_data(go),
                                ts_tensor_data(dq), ts_tensor_data(dk), ts_tensor_data(dv));
    }
    if (!st) {
        gin[0] = dq;
        gin[1] = dk;
        gin[2] = dv;
        dq = dk = dv = NULL;
    }
    ts_tensor_free(go);
    ts_tensor_free(dq);
    ts_tensor_free(dk);
    ts_tensor_free(dv);
    return st;
}

static ts_status flash_backward(ts_node *n, ts_tensor **g, ts_tensor **gin)
{
    TS_TRACE_BEGIN(t0);
    ts_status st = flash_backward_impl(n, g, gin);
    TS_TRACE_END(t0, "attention_backward", "compute");
    return st;
}

/* ts_attention on the fused kernel (float32); mc is the contiguous mask
 * or NULL. With dropout (drop_p > 0) the keep mask is drawn first, as
 * the reference path draws its noise: bernoulli(1 - p) over (B, H, T, S)
 * in row-major order from gen, each kept weight scaled by
 * 1 / (float)(1 - p) (ts_div_scalar's float32 division). */
static ts_status flash_attention(ts_tensor *q, ts_tensor *k, ts_tensor *v, int64_t H, ts_tensor *mc, double scale,
                                 double drop_p, ts_generator *gen, ts_tensor **out)
{
    int64_t B = q->shape[0], T = q->shape[1], S = k->shape[1], E = q->shape[2], os[3] = {B, T, E}, ls[3] = {B, H, T},
            ks[4] = {B, H, T, TS__FLASH_KEEP_WORDS(S)};
    ts_tensor *o = NULL, *lse = NULL, *keep = NULL, *in[3] = {q, k, v};
    float ds = 1.0f;
    ts_status st;
    if ((st = ts__tensor_new(TS_F32, 3, os, &o)) || (st = ts__tensor_new(TS_F32, 3, ls, &lse))) goto fail;
    if (drop_p > 0) {
        if ((st = ts__tensor_new(TS_I32, 4, ks, &keep))) goto fail;
        if (!ts__is_meta(keep)) /* meta: no draw, the generator stays */
            ts__rng_bernoulli_bits(gen, 1.0 - drop_p, B * H * T, S, ks[3], ts_tensor_data(keep));
        ds = 1.0f / (float)(1.0 - drop_p);
    }
    ts__flash_problem pr = flash_problem(q, k, v, H, mc ? ts_tensor_data(mc) : NULL, scale, keep, ds);
    if (!ts__is_meta(o) && (st = ts__flash_forward(ts__kpath_active(), &pr, ts_tensor_data(o), ts_tensor_data(lse))))
        goto fail;
    if (ts__needs_grad(3, in)) {
        ts_node *n = ts__node_new("attention", flash_backward, 3, in, 1);
        if (!n) {
            st = TS_ERR_NO_MEMORY;
            goto fail;
        }
        n->iargs[0] = H;
        n->dargs[0] = scale;
        n->dargs[1] = ds;
        if (!(st = ts__node_save(n, 0, q)) && !(st = ts__node_save(n, 1, k)) && !(st = ts__node_save(n, 2, v)) &&
            !(st = ts__node_save(n, 3, o)) && !(st = ts__node_save(n, 4, lse)) && !(st = ts__node_save(n, 5, mc)) &&
            !(st = ts__node_save(n, 6, keep)))
            ts__node_set_output(n, 0, o);
        ts__node_free(n);
        if (st) goto fail;
    }
    ts_tensor_free(lse);
    ts_tensor_free(keep);
    *out = o;
    return TS_OK;
fail:
    ts_tensor_free(o);
    ts_tensor_free(lse);
    ts_tensor_free(keep);
    return st;
}

static ts_status attention_impl(ts_tensor *q, ts_tensor *k, ts_tensor *v, int64_t num_heads, ts_tensor *mask,
                                double dropout_p, bool training, ts_generator *gen, ts_tensor **out)
{
    const char *op = "attention";
    ts_tensor *in[3] = {q, k, v};
    ts_status st;
    if ((st = ts__check_inputs(op, 3, in)) || (mask && (st = ts__check_inputs(op, 1, &mask))) ||
        (st = ts__check_floating(op, q)) || (st = ts__check_same_dtype(op, q, k)) ||
        (st = ts__check_same_dtype(op, q, v)))
        return st;
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: out is NULL", op);
    char s1[96], s2[96], s3[96];
    if (q->ndim != 3 || k->ndim != 3 || v->ndim != 3 || k->shape[0] != q->shape[0] || v->shape[0] != q->shape[0] ||
        k->shape[2] != q->shape[2] || v->shape[2] != q->shape[2] || v->shape[1] != k->shape[1])
        return ts_error(TS_ERR_SHAPE, "%s: q %s, k %s and v %s must be (B, T, E), (B, S, E), (B, S, E)", op,
                        ts_shape_str(q->ndim, q->shape, s1, sizeof s1), ts_shape_str(k->ndim, k->shape, s2, sizeof s2),
                        ts_shape_str(v->ndim, v->shape, s3, sizeof s3));
    int64_t B = q->shape[0], T = q->shape[1], S = k->shape[1], E = q->shape[2];
    if (num_heads <= 0 || E % num_heads)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: embed dim %lld is not a multiple of %lld heads", op, (long long)E,
                        (long long)num_heads);
    if (mask && (mask->dtype != TS_BOOL || mask->ndim != 2 || mask->shape[0] != T || mask->shape[1] != S))
        return ts_error(TS_ERR_SHAPE, "%s: mask must be bool (%lld, %lld), got %s %s", op, (long long)T, (long long)S,
                        ts_dtype_name(mask->dtype), ts_shape_str(mask->ndim, mask->shape, s1, sizeof s1));
    if (!(dropout_p >= 0 && dropout_p < 1))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: dropout probability %g must be in [0, 1)", op, dropout_p);
    for (int i = 0; i < 3; i++)
        if (in[i]->strides[2] != 1)
            return ts_error(TS_ERR_NOT_VIEWABLE,
                            "%s: %s must have unit stride in its last dim (got %lld); make it "
                            "contiguous",
                            op,
                            i == 0       ? "q"
                                : i == 1 ? "k"
                                         : "v",
                            (long long)in[i]->strides[2]);
    int64_t H = num_heads, hd = E / H, TS_ = T * S;
    double scale = 1.0 / sqrt((double)hd);
    ts_dtype dt = q->dtype;
    int64_t es = (int64_t)ts_dtype_size(dt);
    int64_t os[3] = {B, T, E}, pshape[4] = {B, H, T, S};
    ts_tensor *o = NULL, *P = NULL, *D = NULL, *W = NULL, *mc = NULL;
    bool drop = training && dropout_p > 0;
    /* float32, with or without dropout: the fused kernel, unless a row is
     * wholly masked (NaN rows: the reference path gives PyTorch's NaNs) */
    if (dt == TS_F32 && T > 0 && S > 0 && ts__flash_enabled()) {
        if (mask && (st = ts_contiguous(mask, &mc))) return st;
        /* a meta mask's rows are unknown: taken as not wholly masked (a
         * causal mask is not) */
        if (ts__flash_mask_ok(mc ? ts_tensor_data(mc) : NULL, T, S)) {
            st = flash_attention(q, k, v, H, mc, scale, drop ? dropout_p : 0.0, gen, out);
            ts_tensor_free(mc);
            return st;
        }
        ts_tensor_free(mc);
        mc = NULL;
    }
    if ((st = ts__tensor_new(dt, 3, os, &o)) || (st = ts__tensor_new(dt, 4, pshape, &P))) goto fail;
    if (ts__is_half(dt)) {
        if (mask && (st = ts_contiguous(mask, &mc))) goto fail;
        if ((drop && (st = ts__dropout_noise_half(dt, 4, pshape, dropout_p, gen, &D))) ||
            (!ts__is_meta(o) && (st = attention_half_forward(q, k, v, H, mc ? ts_tensor_data(mc) : NULL, P, D, o))))
            goto fail;
        goto record;
    }
    if (drop) {
        /* PyTorch: F.dropout over the (B*H, T, S) weights: bernoulli(1-p)
         * in row-major order, scaled by 1/(1-p) */
        if ((st = ts__tensor_new(dt, 4, pshape, &D)) ||
            (!ts__is_meta(D) && (st = ts_bernoulli_(D, 1.0 - dropout_p, gen)))) /* meta: no draw */
            goto fail;
        ts_tensor *scaled;
        bool prev = ts_grad_mode_set(false);
        st = ts_div_scalar(D, 1.0 - dropout_p, &scaled);
        ts_grad_mode_set(prev);
        if (st) goto fail;
        ts_tensor_free(D);
        D = scaled;
        int64_t ps[2] = {T, S};
        if ((st = ts__tensor_new(dt, 2, ps, &W))) goto fail;
    }
    if (mask && (st = ts_contiguous(mask, &mc))) goto fail;
    const char *qp = ts_tensor_data(q), *kp = ts_tensor_data(k), *vp = ts_tensor_data(v);
    const uint8_t *mp = mc ? ts_tensor_data(mc) : NULL;
    char *Pp = ts_tensor_data(P), *op_ = ts_tensor_data(o), *Dp = D ? ts_tensor_data(D) : NULL,
         *Wp = W ? ts_tensor_data(W) : NULL;
    if (ts__is_meta(o)) B = 0; /* meta: nothing to compute */
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++) {
            const char *qbh = qp + (b * q->strides[0] + h * hd) * es;
            const char *kbh = kp + (b * k->strides[0] + h * hd) * es;
            const char *vbh = vp + (b * v->strides[0] + h * hd) * es;
            char *Pbh = Pp + ((b * H + h) * TS_) * es;
            /* scores (T, S) = q (T, hd) @ k^T (hd, S) */
            ts__gemm(dt, T, S, hd, qbh, q->strides[1], 1, kbh, 1, k->strides[1], 0.0, Pbh, S, 1);
            if (dt == TS_F32) {
                float *p = (float *)Pbh, fs = (float)scale;
                for (int64_t t = 0; t < T; t++)
                    for (int64_t s = 0; s < S; s++) p[t * S + s] = mp && mp[t * S + s] ? -INFINITY : fs * p[t * S + s];
            } else {
                double *p = (double *)Pbh;
                for (int64_t t = 0; t < T; t++)
                    for (int64_t s = 0; s < S; s++)
                        p[t * S + s] = mp && mp[t * S + s] ? -INFINITY : scale * p[t * S + s];
            }
            ts__softmax_rows(dt, Pbh, Pbh, T, S);
            const char *weights = Pbh;
            if (Dp) {
                const char *Dbh = Dp + ((b * H + h) * TS_) * es;
                if (dt == TS_F32)
                    for (int64_t i = 0; i < TS_; i++)
                        ((float *)Wp)[i] = ((const float *)Pbh)[i] * ((const float *)Dbh)[i];
                else
                    for (int64_t i = 0; i < TS_; i++)
                        ((double *)Wp)[i] = ((const double *)Pbh)[i] * ((const double *)Dbh)[i];
                weights = Wp;
            }
            /* out[b, :, h*hd:(h+1)*hd] (T, hd) = weights (T, S) @ v (S, hd) */
            ts__gemm(dt, T, hd, S, weights, S, 1, vbh, v->strides[1], 1, 0.0, op_ + (b * T * E + h * hd) * es, E, 1);
        }
record:
    ts_tensor_free(W);
    W = NULL;
    ts_tensor_free(mc);
    mc = NULL;
    if (ts__needs_grad(3, in)) {
        ts_node *n = ts__node_new(op, attention_backward, 3, in, 1);
        if (!n) {
            st = TS_ERR_NO_MEMORY;
            goto fail;
        }
        n->iargs[0] = H;
        n->dargs[0] = scale;
        if (!(st = ts__node_save(n, 0, q)) && !(st = ts__node_save(n, 1, k)) && !(st = ts__node_save(n, 2, v)) &&
            !(st = ts__node_save(n, 3, P)) && !(st = ts__node_save(n, 4, D)))
            ts__node_set_output(n, 0, o);
        ts__node_free(n);
        if (st) goto fail;
    }
    ts_tensor_free(P);
    ts_tensor_free(D);
    *out = o;
    return TS_OK;
fail:
    ts_tensor_free(o);
    ts_tensor_free(P);
    ts_tensor_free(D);
    ts_tensor_free(W);
    ts_tensor_free(mc);
    return st;
}

/* The op in an "attention" trace span (the benchmarks' attention share). */
ts_status ts_attention(ts_tensor *q, ts_tensor *k, ts_tensor *v, int64_t num_heads, ts_tensor *mask, double dropout_p,
                       bool training, ts_generator *gen, ts_tensor **out)
{
    TS_TRACE_BEGIN(t0);
    ts_status st = attention_impl(q, k, v, num_heads, mask, dropout_p, training, gen, out);
    TS_TRACE_END(t0, "attention", "compute");
    return st;
}
