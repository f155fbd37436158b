/*
 * clip_grad_norm_ (optim.h: ts_clip_grad_norm) and its pieces, which
 * fully_shard's sharded clipping shares (internal.h).
 */
#define _GNU_SOURCE
#include "optim/optim_internal.h"
#include "tensor/internal.h"
#include "tensor/kernels.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* torch.norm(g, 2) of contiguous buffers: tensor/kernels.h's
 * ts__buf_norm2_f32 / _f64 (torch 1.13's CPU kernels to the bit), on the
 * scalar build when the reference hook is on. */
static ts__kpath norm_path(void) { return ts__optim_use_reference ? TS__KPATH_SCALAR : ts__kpath_active(); }

/* Row callbacks for clipping (walk_rows over the gradient with itself):
 * gather a strided gradient into the contiguous buffer at k, and scale in
 * place by the coefficient at k. */
typedef struct gather_k {
    size_t es;
    unsigned char *dst;
} gather_k;

static void gather_row(const void *k, int64_t n, void *p, int64_t sp, const void *g, int64_t sg, int64_t lin)
{
    (void)g, (void)sg;
    const gather_k *gk = k;
    size_t es = gk->es;
    unsigned char *dst = gk->dst + (size_t)lin * es;
    const unsigned char *src = p;
    for (int64_t i = 0; i < n; i++) memcpy(dst + (size_t)i * es, src + (size_t)(i * sp) * es, es);
}

typedef struct scale_k {
    ts_dtype dt;
    double coef;
} scale_k;

static void scale_row(const void *k, int64_t n, void *p, int64_t sp, const void *g, int64_t sg, int64_t lin)
{
    (void)g, (void)sg, (void)lin;
    const scale_k *s = k;
    if (sp == 1) {
        ts__buf_scale(s->dt, p, n, s->coef);
        return;
    }
    size_t es = ts_dtype_size(s->dt);
    for (int64_t i = 0; i < n; i++) ts__buf_scale(s->dt, (unsigned char *)p + (size_t)(i * sp) * es, 1, s->coef);
}

ts_status ts__optim_grad_norm(const ts_tensor *gc, double *norm_out)
{
    ts_tensor *g = (ts_tensor *)(uintptr_t)gc;
    int64_t n = ts_tensor_numel(g);
    ts_dtype dt = ts_tensor_dtype(g);
    TS_ASSERT(dt == TS_F32 || dt == TS_F64 || dt == TS_BF16 || dt == TS_F16);
    if (n == 0) {
        *norm_out = 0;
        return TS_OK;
    }
    bool half = dt == TS_BF16 || dt == TS_F16, gather = !ts_tensor_is_contiguous(g);
    size_t es = ts_dtype_size(dt);
    /* one block: the gathered gradient, then (16-bit) its float32 values */
    void *tmp = NULL;
    if ((gather || half) &&
        !(tmp = ts__malloc(TS_MEM_NN, (size_t)n * ((gather ? es : 0) + (half ? sizeof(float) : 0)))))
        return TS_ERR_NO_MEMORY;
    const void *x = ts_tensor_data(g);
    if (gather) {
        gather_k k = {es, tmp};
        ts__optim_walk_rows(g, g, gather_row, &k);
        x = tmp;
    }
    if (half) {
        float *f = (float *)((unsigned char *)tmp + (gather ? (size_t)n * es : 0));
        ts__buf_convert(TS_F32, f, dt, x, n);
        x = f;
    }
    *norm_out =
        dt == TS_F64 ? ts__buf_norm2_f64_on(norm_path(), x, n) : (double)ts__buf_norm2_f32_on(norm_path(), x, n);
    ts__free(TS_MEM_NN, tmp);
    return TS_OK;
}

ts_status ts__optim_total_norm(int n, const double *norms, bool any_f64, double *total_out)
{
    if (n <= 0) {
        *total_out = 0;
        return TS_OK;
    }
    if (any_f64) {
        *total_out = ts__buf_norm2_f64_on(norm_path(), norms, n);
        return TS_OK;
    }
    float *n32 = ts__malloc(TS_MEM_NN, (size_t)n * sizeof *n32);
    if (!n32) return TS_ERR_NO_MEMORY;
    for (int i = 0; i < n; i++) n32[i] = (float)norms[i];
    *total_out = (double)ts__buf_norm2_f32_on(norm_path(), n32, n);
    ts__free(TS_MEM_NN, n32);
    return TS_OK;
}

double ts__optim_clip_coef(double total, double max_norm, bool any_f64)
{
    /* clip_coef = max_norm / (total_norm + 1e-6), i.e. Tensor.__rdiv__:
     * (total + 1e-6).reciprocal() * max_norm, in the stack's dtype */
    if (any_f64) return (1.0 / (total + 1e-6)) * max_norm;
    float t = (float)total + (float)1e-6;
    return (double)((1.0f / t) * (float)max_norm);
}

void ts__optim_scale_grad(ts_tensor *g, double coef)
{
    scale_k k = {ts_tensor_dtype(g), coef};
    ts__optim_walk_rows(g, g, scale_row, &k);
}

ts_status ts_clip_grad_norm(int n, ts_tensor *const *params, double max_norm, double *total_norm_out)
{
    const char *who = "clip_grad_norm";
    char lab[160];
    if (n < 0 || (n > 0 && !params) || !total_norm_out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: bad arguments (n = %d, params %s, total_norm_out %s)", who, n,
                        params ? "set" : "NULL", total_norm_out ? "set" : "NULL");
    if (!(max_norm >= 0))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: invalid max_norm %g (must be >= 0)", who, max_norm);
    int ng = 0;
    bool any_f64 = false, any_meta = false;
    for (int i = 0; i < n; i++) {
        if (!params[i]) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: parameter %d is NULL", who, i);
        ts_tensor *g = ts_tensor_grad(params[i]);
        if (!g) continue;
        ts_dtype dt = ts_tensor_dtype(g);
        if (dt != TS_F32 && dt != TS_F64)
            return ts_error(TS_ERR_DTYPE, "%s: the gradient of %s has dtype %s; float32 or float64 expected", who,
                            ts__optim_param_label(i, params[i], lab, sizeof lab), ts_dtype_name(dt));
        if (ts__is_meta(g) && !ts__meta_mode()) {
            char s1[96];
            return ts_error(TS_ERR_STATE,
                            "%s: the gradient of %s %s is on the meta device (it has no data): "
                            "materialize the model or load a checkpoint first",
                            who, ts__optim_param_label(i, params[i], lab, sizeof lab),
                            ts_tensor_shape_str(g, s1, sizeof s1));
        }
        any_meta |= ts__is_meta(g);
        if (ts_tensor_numel(g) > 0 && !ts_tensor_data(g) && !ts__is_meta(g))
            return ts_error(TS_ERR_RELEASED, "%s: the gradient of %s has released storage", who,
                            ts__optim_param_label(i, params[i], lab, sizeof lab));
        any_f64 |= dt == TS_F64;
        ng++;
    }
    if (ng == 0 || any_meta) {
        /* torch returns tensor(0.) and changes nothing; meta gradients (in
         * a meta scope) have no values: 0, and nothing is scaled */
        *total_norm_out = 0;
        return TS_OK;
    }
    /* torch.norm(torch.stack([torch.norm(g, 2) for g in grads]), 2): the
     * stack is float64 if any gradient is, else float32 */
    double *norms = ts__malloc(TS_MEM_NN, (size_t)ng * sizeof(double));
    if (!norms) return TS_ERR_NO_MEMORY;
    ts_status st = TS_OK;
    for (int i = 0, j = 0; i < n && !st; i++) {
        ts_tensor *g = ts_tensor_grad(params[i]);
        if (g && !(st = ts__optim_grad_norm(g, &norms[j]))) j++;
    }
    double total = 0;
    if (!st) st = ts__optim_total_norm(ng, norms, any_f64, &total);
    ts__free(TS_MEM_NN, norms);
    if (st) return st;
    if (!isfinite(total))
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "%s: the total norm of order 2 of the gradients is non-finite (%g), so it cannot be "
                        "clipped; the gradients were left unchanged",
                        who, total);
    /* grads are multiplied by min(clip_coef, 1); multiplying by exactly
     * 1.0 changes nothing, so that case is skipped. */
    double coef = ts__optim_clip_coef(total, max_norm, any_f64);
    if (coef < 1.0) {
        for (int i = 0; i < n; i++) {
            ts_tensor *g = ts_tensor_grad(params[i]);
            if (g) ts__optim_scale_grad(g, coef);
        }
    }
    *total_norm_out = total;
    return TS_OK;
}
