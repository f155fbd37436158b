/* matmul and linear. Operands go to BLIS with their strides (a transposed
 * view is just other strides), batch dims broadcast, and a batched operand
 * times a 2-d one becomes one large product when the batch folds into the
 * rows. */
#define _GNU_SOURCE
#include "tensor/gemm_half.h"
#include "tensor/internal.h"

#include <string.h>

ts_gemm_observer_fn ts__gemm_observer;

void ts__gemm(ts_dtype dt, int64_t m, int64_t n, int64_t k, const void *a, int64_t rsa, int64_t csa, const void *b,
              int64_t rsb, int64_t csb, double beta, void *c, int64_t rsc, int64_t csc)
{
    if (ts__gemm_observer) ts__gemm_observer(dt, m, n, k, rsa, csa, rsb, csb, beta);
    TS_TRACE_BEGIN(t0);
    if (dt == TS_F32) ts__gemm_f32(m, n, k, 1.0f, a, rsa, csa, b, rsb, csb, (float)beta, c, rsc, csc);
    else if (dt == TS_BF16 || dt == TS_F16)
        ts__gemm_half(dt, m, n, k, a, rsa, csa, b, rsb, csb, (float)beta, c, rsc, csc);
    else ts__gemm_f64(m, n, k, 1.0, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc);
    TS_TRACE_END(t0, "matmul", "compute");
}

void ts__gemm_meta(ts_dtype dt, int64_t m, int64_t n, int64_t k, double beta, int64_t csc)
{
    if (dt == TS_BF16 || dt == TS_F16) ts__gemm_half_meta(dt, m, n, k, (float)beta, csc);
}

/* True if dims [0, nd-1) of t (batch and rows) fold into one row dim:
 * then row r of the fold is at r * *rs_out. Dims of size 1 are skipped
 * (their stride is arbitrary), so the row stride is that of the innermost
 * of those dims with a size above 1. */
static bool rows_fold(const ts_tensor *t, int64_t *rs_out)
{
    int nd = t->ndim;
    int64_t rs = nd >= 2 ? t->strides[nd - 2] : 0, expect = 0;
    bool seen = false;
    for (int i = nd - 2; i >= 0; i--) {
        if (t->shape[i] == 1) continue;
        if (!seen) {
            rs = t->strides[i];
            expect = rs * t->shape[i];
            seen = true;
        } else if (t->strides[i] != expect) {
            return false;
        } else {
            expect *= t->shape[i];
        }
    }
    *rs_out = rs;
    return true;
}

/* out = a @ b for a, b of >= 2 dims (batch dims broadcast); beta = 0 or 1
 * (1 accumulates into *out, which must then have the result's shape). No
 * autograd. */
static ts_status mm_kernel(const char *op, ts_tensor *a, ts_tensor *b, ts_tensor **out)
{
    char s1[96], s2[96];
    int na = a->ndim, nb = b->ndim;
    int64_t m = a->shape[na - 2], k = a->shape[na - 1], k2 = b->shape[nb - 2], n = b->shape[nb - 1];
    if (k != k2)
        return ts_error(TS_ERR_SHAPE, "%s: shapes %s and %s cannot be multiplied (%lld columns vs %lld rows)", op,
                        ts_shape_str(na, a->shape, s1, sizeof s1), ts_shape_str(nb, b->shape, s2, sizeof s2),
                        (long long)k, (long long)k2);
    int nbatch;
    int64_t bshape[TS_MAX_DIMS];
    ts_status st = ts__broadcast_shape(op, na - 2, a->shape, nb - 2, b->shape, &nbatch, bshape);
    if (st) return st;
    int64_t oshape[TS_MAX_DIMS];
    memcpy(oshape, bshape, (size_t)nbatch * sizeof *bshape);
    oshape[nbatch] = m;
    oshape[nbatch + 1] = n;
    ts_tensor *o;
    if ((st = ts__tensor_new(a->dtype, nbatch + 2, oshape, &o))) return st;
    int64_t batches = ts__numel(nbatch, bshape);
    size_t es = ts_dtype_size(a->dtype);
    const char *ap = ts_tensor_data(a), *bp = ts_tensor_data(b);
    char *op_ = ts_tensor_data(o);
    int64_t rsa = a->strides[na - 2], csa = a->strides[na - 1], rsb = b->strides[nb - 2], csb = b->strides[nb - 1];
    int64_t rs_fold;
    if (batches * m * n == 0) {
        /* nothing to compute */
    } else if (ts__is_meta(o)) {
        /* each product of the batch takes and returns the same scratch */
        ts__gemm_meta(a->dtype, nb == 2 && rows_fold(a, &rs_fold) ? batches * m : m, n, k, 0.0, 1);
    } else if (nb == 2 && rows_fold(a, &rs_fold)) {
        /* (batch..., m, k) @ (k, n): one product with batch*m rows */
        ts__gemm(a->dtype, batches * m, n, k, ap, rs_fold, csa, bp, rsb, csb, 0.0, op_, n, 1);
    } else {
        int64_t sa[TS_MAX_DIMS], sb[TS_MAX_DIMS];
        ts_tensor va = *a, vb = *b;
        va.ndim = na - 2;
        vb.ndim = nb - 2;
        ts__broadcast_strides(&va, nbatch, bshape, sa);
        ts__broadcast_strides(&vb, nbatch, bshape, sb);
        int64_t idx[TS_MAX_DIMS] = {0};
        for (int64_t bi = 0; bi < batches; bi++) {
            int64_t oa = 0, ob = 0;
            for (int d = 0; d < nbatch; d++) {
                oa += idx[d] * sa[d];
                ob += idx[d] * sb[d];
            }
            ts__gemm(a->dtype, m, n, k, ap + oa * (int64_t)es, rsa, csa, bp + ob * (int64_t)es, rsb, csb, 0.0,
                     op_ + bi * m * n * (int64_t)es, n, 1);
            for (int d = nbatch - 1; d >= 0; d--) {
                if (++idx[d] < bshape[d]) break;
                idx[d] = 0;
            }
        }
    }
    *out = o;
    return TS_OK;
}

static ts_status transposed(ts_tensor *t, ts_tensor **out)
{
    int64_t sh[TS_MAX_DIMS], str[TS_MAX_DIMS];
    memcpy(sh, t->shape, sizeof sh);
    memcpy(str, t->strides, sizeof str);
    int d = t->ndim;
    sh[d - 2] = t->shape[d - 1];
    sh[d - 1] = t->shape[d - 2];
    str[d - 2] = t->strides[d - 1];
    str[d - 1] = t->strides[d - 2];
    return ts__tensor_alias(t, d, sh, str, t->offset, out);
}

/* (…, r, c) viewed as (R, c) when the leading dims fold (a 1-d (c,) is
 * one row); else a contiguous copy viewed that way. */
static ts_status flat_rows(ts_tensor *t, ts_tensor **out)
{
    int64_t c = t->shape[t->ndim - 1], r = c ? ts_tensor_numel(t) / c : 0;
    int64_t sh[2] = {r, c}, rs;
    if (t->ndim == 2) {
        *out = ts_tensor_retain(t);
        return TS_OK;
    }
    if (rows_fold(t, &rs)) {
        int64_t str[2] = {rs, t->strides[t->ndim - 1]};
        return ts__tensor_alias(t, 2, sh, str, t->offset, out);
    }
    ts_tensor *cc;
    bool grad = ts_grad_mode_set(false);
    ts_status st = ts__copy_op("matmul", t, t->dtype, &cc);
    ts_grad_mode_set(grad);
    if (st) return st;
    int64_t str[2] = {c, 1};
    st = ts__tensor_alias(cc, 2, sh, str, cc->offset, out);
    ts_tensor_free(cc);
    return st;
}

static ts_status matmul_backward(ts_node *n, ts_tensor **g, ts_tensor **gin)
{
    ts_tensor *a = n->saved[0], *b = n->saved[1];
    ts_status st = TS_OK;
    if (ts__node_needs_input_grad(n, 0)) {
        ts_tensor *bt, *ga;
        if (!(st = transposed(b, &bt))) {
            st = mm_kernel("matmul backward", g[0], bt, &ga);
            ts_tensor_free(bt);
            if (!st) {
                st = ts__reduce_to_shape(ga, a->ndim, a->shape, &gin[0]);
                ts_tensor_free(ga);
            }
        }
    }
    if (!st && ts__node_needs_input_grad(n, 1)) {
        ts_tensor *gb;
        if (b->ndim == 2 && a->ndim > 2) {
            /* sum over the batch in one product: a_flat^T (k, M) @ g_flat (M, n) */
            ts_tensor *af, *gf, *aft;
            if ((st = flat_rows(a, &af))) return st;
            if ((st = flat_rows(g[0], &gf))) {
                ts_tensor_free(af);
                return st;
            }
            if (!(st = transposed(af, &aft))) {
                st = mm_kernel("matmul backward", aft, gf, &gin[1]);
                ts_tensor_free(aft);
            }
            ts_tensor_free(af);
            ts_tensor_free(gf);
        } else {
            ts_tensor *at;
            if (!(st = transposed(a, &at))) {
                st = mm_kernel("matmul backward", at, g[0], &gb);
                ts_tensor_free(at);
                if (!st) {
                    st = ts__reduce_to_shape(gb, b->ndim, b->shape, &gin[1]);
                    ts_tensor_free(gb);
                }
            }
        }
    }
    return st;
}

static ts_status matmul_nd(ts_tensor *a, ts_tensor *b, ts_tensor **out)
{
    ts_tensor *in[2] = {a, b}, *o;
    ts_status st = mm_kernel("matmul", a, b, &o);
    if (st) return st;
    if (ts__needs_grad(2, in)) {
        ts_node *n = ts__node_new("matmul", matmul_backward, 2, in, 1);
        if (!n) {
            ts_tensor_free(o);
            return TS_ERR_NO_MEMORY;
        }
        if ((st = ts__record1(n, o, a, b))) return st;
    }
    *out = o;
    return TS_OK;
}

ts_status ts_matmul(ts_tensor *a, ts_tensor *b, ts_tensor **out)
{
    ts_tensor *in[2] = {a, b};
    ts_status st;
    if ((st = ts__check_inputs("matmul", 2, in)) || (st = ts__check_same_dtype("matmul", a, b)) ||
        (st = ts__check_floating("matmul", a)))
        return st;
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "matmul: out is NULL");
    if (a->ndim == 0 || b->ndim == 0)
        return ts_error(TS_ERR_SHAPE, "matmul: both arguments need at least 1 dimension (got %d and %d dims)", a->ndim,
                        b->ndim);
    int64_t ka = a->shape[a->ndim - 1], kb = b->shape[b->ndim >= 2 ? b->ndim - 2 : 0];
    if (ka != kb) {
        char s1[96], s2[96];
        return ts_error(TS_ERR_SHAPE, "matmul: shapes %s and %s cannot be multiplied (%lld columns vs %lld rows)",
                        ts_shape_str(a->ndim, a->shape, s1, sizeof s1), ts_shape_str(b->ndim, b->shape, s2, sizeof s2),
                        (long long)ka, (long long)kb);
    }
    if (a->ndim >= 2 && b->ndim >= 2) return matmul_nd(a, b, out);
    /* 1-d operands: unsqueeze (recorded), multiply, squeeze (recorded) */
    ts_tensor *a2 = NULL, *b2 = NULL, *o2 = NULL;
    if ((st = a->ndim == 1 ? ts_unsqueeze(a, 0, &a2) : (a2 = ts_tensor_retain(a), TS_OK))) return st;
    if ((st = b->ndim == 1 ? ts_unsqueeze(b, 1, &b2) : (b2 = ts_tensor_retain(b), TS_OK))) {
        ts_tensor_free(a2);
        return st;
    }
    st = matmul_nd(a2, b2, &o2);
    ts_tensor_free(a2);
    ts_tensor_free(b2);
    if (st) return st;
    ts_tensor *o3 = NULL;
    if (b->ndim == 1 && !(st = ts_squeeze(o2, -1, &o3))) {
        ts_tensor_free(o2);
        o2 = o3;
    }
    if (!st && a->ndim == 1 && !(st = ts_squeeze(o2, o2->ndim - (b->ndim == 1 ? 1 : 2), &o3))) {
        ts_tensor_free(o2);
        o2 = o3;
    }
    if (st) {
        ts_tensor_free(o2);
        return st;
    }
    *out = o2;
    return TS_OK;
}

/* ----------------------------------------------------- linear */

static ts_status linear_backward(ts_node *n, ts_tensor **g, ts_tensor **gin)
{
    ts_tensor *x = n->saved[0], *w = n->saved[1], *gf, *xf;
    ts_status st = flat_rows(g[0], &gf);
    if (st) return st;
    int64_t M = gf->shape[0], N = gf->shape[1], K = w->shape[1];
    if (ts__node_needs_input_grad(n, 0)) {
        /* gx (M, K) = g (M, N) @ w (N, K), viewed as x's shape */
        ts_tensor *gx;
        int64_t sh[2] = {M, K};
        if (!(st = ts__tensor_new(x->dtype, 2, sh, &gx))) {
            if (ts__is_meta(gx)) ts__gemm_meta(x->dtype, M, K, N, 0.0, 1);
            else
                ts__gemm(x->dtype, M, K, N, ts_tensor_data(gf), gf->strides[0], gf->strides[1], ts_tensor_data(w),
                         w->strides[0], w->strides[1], 0.0, ts_tensor_data(gx), K, 1);
            int64_t str[TS_MAX_DIMS];
            ts__contiguous_strides(x->ndim, x->shape, str);
            st = ts__tensor_alias(gx, x->ndim, x->shape, str, 0, &gin[0]);
            ts_tensor_free(gx);
        }
    }
    if (!st && ts__node_needs_input_grad(n, 1) && !(st = flat_rows(x, &xf))) {
        /* gw (N, K) = g^T (N, M) @ x (M, K) */
        ts_tensor *gw;
        int64_t sh[2] = {N, K};
        if (!(st = ts__tensor_new(x->dtype, 2, sh, &gw))) {
            if (ts__is_meta(gw)) ts__gemm_meta(x->dtype, N, K, M, 0.0, 1);
            else
                ts__gemm(x->dtype, N, K, M, ts_tensor_data(gf), gf->strides[1], gf->strides[0], ts_tensor_data(xf),
                         xf->strides[0], xf->strides[1], 0.0, ts_tensor_data(gw), K, 1);
            gin[1] = gw;
        }
        ts_tensor_free(xf);
    }
    if (!st && n->n_inputs > 2 && ts__node_needs_input_grad(n, 2)) {
        int dim0 = 0;
        st = ts__sum_nograd(gf, 1, &dim0, false, &gin[2]);
    }
    ts_tensor_free(gf);
    return st;
}

ts_status ts_linear(ts_tensor *x, ts_tensor *w, ts_tensor *b, ts_tensor **out)
{
    ts_tensor *in[3] = {x, w, b};
    int nin = b ? 3 : 2;
    ts_status st;
    if ((st = ts__check_inputs("linear", nin, in)) || (st = ts__check_same_dtype("linear", x, w)) ||
        (b && (st = ts__check_same_dtype("linear", x, b))) || (st = ts__check_floating("linear", x)))
        return st;
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "linear: out is NULL");
    char s1[96], s2[96], s3[96];
    if (x->ndim < 1 || w->ndim != 2 || x->shape[x->ndim - 1] != w->shape[1] ||
        (b && (b->ndim != 1 || b->shape[0] != w->shape[0])))
        return ts_error(TS_ERR_SHAPE,
                        "linear: input %s, weight %s and bias %s do not fit (expected (..., in), "
                        "(out, in) and (out,))",
                        ts_shape_str(x->ndim, x->shape, s1, sizeof s1), ts_shape_str(w->ndim, w->shape, s2, sizeof s2),
                        b ? ts_shape_str(b->ndim, b->shape, s3, sizeof s3) : "none");
    ts_tensor *xf;
    if ((st = flat_rows(x, &xf))) return st;
    int64_t M = xf->shape[0], K = w->shape[1], N = w->shape[0];
    int64_t oshape[TS_MAX_DIMS];
    memcpy(oshape, x->shape, sizeof oshape);
    oshape[x->ndim - 1] = N;
    ts_tensor *o;
    if ((st = ts__tensor_new(x->dtype, x->ndim, oshape, &o))) {
        ts_tensor_free(xf);
        return st;
    }
    char *op_ = ts_tensor_data(o);
    double beta = 0.0;
    if (b && M * N > 0) {
        size_t row = (size_t)N * ts_dtype_size(x->dtype);
        ts_tensor *bc;
        if ((st = ts_contiguous(b, &bc))) {
            ts_tensor_free(xf);
            ts_tensor_free(o);
            return st;
        }
        for (int64_t r = 0; r < M && op_; r++) /* op_ NULL: a meta output */
            memcpy(op_ + (size_t)r * row, ts_tensor_data(bc), row);
        ts_tensor_free(bc);
        beta = 1.0;
    }
    if (M * N > 0 && ts__is_meta(o)) ts__gemm_meta(x->dtype, M, N, K, beta, 1);
    else if (M * N > 0)
        ts__gemm(x->dtype, M, N, K, ts_tensor_data(xf), xf->strides[0], xf->strides[1], ts_tensor_data(w),
                 w->strides[1], w->strides[0], beta, op_, N, 1);
    ts_tensor_free(xf);
    if (ts__needs_grad(nin, in)) {
        ts_node *n = ts__node_new("linear", linear_backward, nin, in, 1);
        if (!n) {
            ts_tensor_free(o);
            return TS_ERR_NO_MEMORY;
        }
        if ((st = ts__record1(n, o, x, w))) return st;
    }
    *out = o;
    return TS_OK;
}
