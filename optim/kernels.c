/*
 * The update kernels of SGD, Adam and AdamW (PyTorch 1.13's single-tensor
 * formulas), the row walk that runs them over a tensor, and the choice of
 * their build (scalar reference, AVX2, AVX-512) for a step.
 *
 *
 * Bit-exactness. PyTorch runs each of its update lines as a separate op over
 * the whole tensor; every op rounds to the parameter's dtype, and Python
 * float scalars (double) are rounded to that dtype when they meet an f32
 * tensor. The Debian 12 build (GCC 12, AVX2 kernels, GNU-mode
 * -ffp-contract=fast) fuses these multiply-adds, in its vector loops and in
 * its scalar tails alike, which was measured op by op against torch 1.13
 * (tools/reference/make_optim_vectors.py fixtures; see PROVENANCE.md):
 *
 *   t.add(o, alpha=a)          fma(o, a, t)
 *   t.mul_(s)                  t * s
 *   t.addcmul_(x, y, value=v)  fma(v * x, y, t)
 *   t.addcdiv_(x, y, value=v)  t + (v * x) / y
 *   t / s, t.add_(s)           t / s, t + s
 *   s / t (Tensor.__rdiv__)    (1 / t) * s
 *   torch.maximum(a, b)        NaN if either is NaN, else std::max(a, b)
 *
 * (torch 1.13's Adam updates exp_avg with mul_(beta1).add_(grad, alpha=
 * 1 - beta1); the lerp_ form came with torch 2.0 and rounds differently.
 * Adam's per-parameter step is a float32 tensor, as in torch, so it stops
 * counting at 2^24 steps exactly where torch's does.)
 *
 * The kernels below fuse element-wise: one pass over parameter, gradient
 * and state, each element computed with exactly that sequence of roundings
 * (this file is compiled with -ffp-contract=off, so only the fmaf/fma
 * calls written here fuse). Each kernel exists as a plain scalar reference
 * (fma from libm) and, on x86-64 CPUs with AVX2 and FMA (chosen at run
 * time), as an AVX2 build doing the same operations with vector
 * intrinsics; they give identical bits (tests compare them).
 */
#define _GNU_SOURCE
#include "optim/optim_internal.h"
#include "tensor/kernels.h"

#include <math.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define OPT_HAVE_AVX2_BUILD 1
#define OPT_AVX2_TARGET __attribute__((target("avx2,fma")))
#define OPT_AVX512_TARGET __attribute__((target("avx512f,avx2,fma")))
#else
#define OPT_HAVE_AVX2_BUILD 0
#endif
#define OPT_INLINE static inline __attribute__((always_inline))
/* The row kernels (the functions a step calls through row_fn) start on a
 * 64-byte boundary: their loops then sit at the same place in the CPU's
 * 64-byte fetch and op-cache windows wherever the linker puts this file.
 * With the default 16-byte function alignment a change elsewhere in the
 * library moved the (byte-identical) scalar loop by 16 or 32 bytes within
 * its window and bench_optim's per-param scalar row by ~5-11%. */
#define OPT_ROW_ALIGN __attribute__((aligned(64)))

bool ts__optim_use_reference = false;

/* The build of the update kernels this step uses: tensor/kernels.h's
 * active path (the CPU's best, capped by TS_KERNELS and ts__kpath_force),
 * the scalar reference when the test hook is on. */
static ts__kpath update_path(void)
{
#if OPT_HAVE_AVX2_BUILD
    return ts__optim_use_reference ? TS__KPATH_SCALAR : ts__kpath_active();
#else
    return TS__KPATH_SCALAR;
#endif
}

bool ts__optim_avx2_active(void) { return update_path() >= TS__KPATH_AVX2; }

const char *ts__optim_update_path_name(void)
{
    ts__kpath p = update_path();
    return p >= TS__KPATH_AVX512 ? "avx512" : ts__kpath_name(p);
}

/* ------------------------------------------------------------ row walking */

/* Runs fn over every innermost row of a (and b, same shape) in row-major
 * order; one call for the whole tensor when both are contiguous. */
void ts__optim_walk_rows(ts_tensor *a, const ts_tensor *b, row_fn fn, const void *k)
{
    int64_t numel = ts_tensor_numel(a);
    if (numel == 0) return;
    char *pa = ts_tensor_data(a);
    const char *pb = ts_tensor_data(b);
    int nd = ts_tensor_ndim(a);
    if (nd == 0 || (ts_tensor_is_contiguous(a) && ts_tensor_is_contiguous(b))) {
        fn(k, numel, pa, 1, pb, 1, 0);
        return;
    }
    const int64_t *shape = ts_tensor_shape(a), *sa = ts_tensor_strides(a), *sb = ts_tensor_strides(b);
    size_t ea = ts_dtype_size(ts_tensor_dtype(a)), eb = ts_dtype_size(ts_tensor_dtype(b));
    int64_t inner = shape[nd - 1], idx[TS_MAX_DIMS] = {0}, oa = 0, ob = 0, lin = 0;
    for (;;) {
        fn(k, inner, pa + oa * (int64_t)ea, sa[nd - 1], pb + ob * (int64_t)eb, sb[nd - 1], lin);
        lin += inner;
        int d = nd - 2;
        for (; d >= 0; d--) {
            oa += sa[d];
            ob += sb[d];
            if (++idx[d] < shape[d]) break;
            oa -= sa[d] * shape[d];
            ob -= sb[d] * shape[d];
            idx[d] = 0;
        }
        if (d < 0) return;
    }
}

/* -------------------------------------------------------------- SGD kernel */

/* torch.optim.sgd._single_tensor_sgd, one element at a time:
 *   d_p = -grad if maximize else grad
 *   if weight_decay != 0: d_p = d_p.add(param, alpha=wd)       fma(p, wd, d)
 *   if momentum != 0:
 *       buf = d_p.clone() at the first step, else
 *       buf.mul_(momentum).add_(d_p, alpha=1 - dampening)     fma(d, 1-damp, buf*m)
 *       d_p = d_p.add(buf, alpha=momentum) if nesterov else buf
 *   param.add_(d_p, alpha=-lr)                                 fma(d, -lr, p) */
OPT_INLINE void sgd_body_f32(const sgd_k *k, int64_t n, float *p, int64_t sp, const float *g, int64_t sg,
                             float *restrict buf)
{
    const float wd = (float)k->wd, m = (float)k->momentum, damp1 = (float)k->damp1, nlr = (float)-k->lr;
    const bool has_wd = k->wd != 0, has_m = k->momentum != 0;
    for (int64_t i = 0; i < n; i++) {
        float d = k->maximize ? -g[i * sg] : g[i * sg];
        if (has_wd) d = fmaf(p[i * sp], wd, d);
        if (has_m) {
            float b = k->first ? d : fmaf(d, damp1, buf[i] * m);
            buf[i] = b;
            d = k->nesterov ? fmaf(b, m, d) : b;
        }
        p[i * sp] = fmaf(d, nlr, p[i * sp]);
    }
}

OPT_INLINE void sgd_body_f64(const sgd_k *k, int64_t n, double *p, int64_t sp, const double *g, int64_t sg,
                             double *restrict buf)
{
    const double wd = k->wd, m = k->momentum, damp1 = k->damp1, nlr = -k->lr;
    const bool has_wd = k->wd != 0, has_m = k->momentum != 0;
    for (int64_t i = 0; i < n; i++) {
        double d = k->maximize ? -g[i * sg] : g[i * sg];
        if (has_wd) d = fma(p[i * sp], wd, d);
        if (has_m) {
            double b = k->first ? d : fma(d, damp1, buf[i] * m);
            buf[i] = b;
            d = k->nesterov ? fma(b, m, d) : b;
        }
        p[i * sp] = fma(d, nlr, p[i * sp]);
    }
}

OPT_INLINE void sgd_row_f32(const void *kv, int64_t n, void *p, int64_t sp, const void *g, int64_t sg, int64_t lin)
{
    const sgd_k *k = kv;
    float *buf = k->buf ? (float *)k->buf + lin : NULL;
    if (sp == 1 && sg == 1) sgd_body_f32(k, n, p, 1, g, 1, buf);
    else sgd_body_f32(k, n, p, sp, g, sg, buf);
}

OPT_INLINE void sgd_row_f64(const void *kv, int64_t n, void *p, int64_t sp, const void *g, int64_t sg, int64_t lin)
{
    const sgd_k *k = kv;
    double *buf = k->buf ? (double *)k->buf + lin : NULL;
    if (sp == 1 && sg == 1) sgd_body_f64(k, n, p, 1, g, 1, buf);
    else sgd_body_f64(k, n, p, sp, g, sg, buf);
}

/* ------------------------------------------------------------- Adam kernel */

/* torch.optim.adam._single_tensor_adam / adamw._single_tensor_adamw
 * (capturable=False, differentiable=False), one element at a time:
 *   grad = -grad if maximize
 *   AdamW: param.mul_(1 - lr * weight_decay)                    p * decay
 *   Adam, weight_decay != 0: grad = grad.add(param, alpha=wd)     fma(p, wd, g)
 *   exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)              fma(g, 1-b1, m*b1)
 *   exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)  fma((1-b2)*g, g, v*b2)
 *   amsgrad: torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
 *   denom = (s.sqrt() / bias_correction2_sqrt).add_(eps)         sqrt(s) / bc + eps
 *   param.addcdiv_(exp_avg, denom, value=-step_size)              p + (-ss * m) / denom
 * with s = max_exp_avg_sq if amsgrad else exp_avg_sq. */
OPT_INLINE void adam_body_f32(const adam_k *k, int64_t n, float *p, int64_t sp, const float *g, int64_t sg,
                              float *restrict m, float *restrict v, float *restrict mx)
{
    const float wd = (float)k->wd, decay = (float)k->decay, b1 = (float)k->beta1, omb1 = (float)k->omb1,
                b2 = (float)k->beta2, omb2 = (float)k->omb2, bc = (float)k->bc2_sqrt, eps = (float)k->eps,
                nss = (float)k->neg_step_size;
    const bool l2 = !k->adamw && k->wd != 0;
    for (int64_t i = 0; i < n; i++) {
        float gi = k->maximize ? -g[i * sg] : g[i * sg];
        float pi = p[i * sp];
        if (k->adamw) pi = pi * decay;
        else if (l2) gi = fmaf(pi, wd, gi);
        float mi = fmaf(gi, omb1, m[i] * b1);
        float vi = fmaf(omb2 * gi, gi, v[i] * b2);
        m[i] = mi;
        v[i] = vi;
        float s = vi;
        if (k->amsgrad) {
            float x = mx[i];
            s = (isnan(x) || isnan(vi)) ? NAN : (x < vi ? vi : x);
            mx[i] = s;
        }
        float denom = sqrtf(s) / bc + eps;
        p[i * sp] = pi + (nss * mi) / denom;
    }
}

OPT_INLINE void adam_body_f64(const adam_k *k, int64_t n, double *p, int64_t sp, const double *g, int64_t sg,
                              double *restrict m, double *restrict v, double *restrict mx)
{
    const double wd = k->wd, decay = k->decay, b1 = k->beta1, omb1 = k->omb1, b2 = k->beta2, omb2 = k->omb2,
                 bc = k->bc2_sqrt, eps = k->eps, nss = k->neg_step_size;
    const bool l2 = !k->adamw && k->wd != 0;
    for (int64_t i = 0; i < n; i++) {
        double gi = k->maximize ? -g[i * sg] : g[i * sg];
        double pi = p[i * sp];
        if (k->adamw) pi = pi * decay;
        else if (l2) gi = fma(pi, wd, gi);
        double mi = fma(gi, omb1, m[i] * b1);
        double vi = fma(omb2 * gi, gi, v[i] * b2);
        m[i] = mi;
        v[i] = vi;
        double s = vi;
        if (k->amsgrad) {
            double x = mx[i];
            s = (isnan(x) || isnan(vi)) ? (double)NAN : (x < vi ? vi : x);
            mx[i] = s;
        }
        double denom = sqrt(s) / bc + eps;
        p[i * sp] = pi + (nss * mi) / denom;
    }
}

OPT_INLINE void adam_row_f32(const void *kv, int64_t n, void *p, int64_t sp, const void *g, int64_t sg, int64_t lin)
{
    const adam_k *k = kv;
    float *m = (float *)k->exp_avg + lin, *v = (float *)k->exp_avg_sq + lin;
    float *mx = k->max_exp_avg_sq ? (float *)k->max_exp_avg_sq + lin : NULL;
    if (sp == 1 && sg == 1) adam_body_f32(k, n, p, 1, g, 1, m, v, mx);
    else adam_body_f32(k, n, p, sp, g, sg, m, v, mx);
}

OPT_INLINE void adam_row_f64(const void *kv, int64_t n, void *p, int64_t sp, const void *g, int64_t sg, int64_t lin)
{
    const adam_k *k = kv;
    double *m = (double *)k->exp_avg + lin, *v = (double *)k->exp_avg_sq + lin;
    double *mx = k->max_exp_avg_sq ? (double *)k->max_exp_avg_sq + lin : NULL;
    if (sp == 1 && sg == 1) adam_body_f64(k, n, p, 1, g, 1, m, v, mx);
    else adam_body_f64(k, n, p, sp, g, sg, m, v, mx);
}

/* The plain reference build of each kernel (fma from libm). */
OPT_ROW_ALIGN static void sgd_f32_ref(const void *k, int64_t n, void *p, int64_t sp, const void *g, int64_t sg,
                                      int64_t lin)
{
    sgd_row_f32(k, n, p, sp, g, sg, lin);
}
OPT_ROW_ALIGN static void sgd_f64_ref(const void *k, int64_t n, void *p, int64_t sp, const void *g, int64_t sg,
                                      int64_t lin)
{
    sgd_row_f64(k, n, p, sp, g, sg, lin);
}
OPT_ROW_ALIGN static void adam_f32_ref(const void *k, int64_t n, void *p, int64_t sp, const void *g, int64_t sg,
                                       int64_t lin)
{
    adam_row_f32(k, n, p, sp, g, sg, lin);
}
OPT_ROW_ALIGN static void adam_f64_ref(const void *k, int64_t n, void *p, int64_t sp, const void *g, int64_t sg,
                                       int64_t lin)
{
    adam_row_f64(k, n, p, sp, g, sg, lin);
}
#if OPT_HAVE_AVX2_BUILD
/* The AVX2 build: the same operations, eight floats (four doubles) at a
 * time with the AVX2/FMA intrinsics (each one IEEE-rounded like its scalar
 * counterpart, so the bits are the reference's), over the contiguous part
 * of a row; the remainder and strided rows go through the scalar bodies,
 * compiled here with the FMA instruction. Each returns how many leading
 * elements it did. */
OPT_AVX2_TARGET static int64_t sgd_vec_f32(const sgd_k *k, int64_t n, float *p, const float *g, float *buf)
{
    const __m256 wd = _mm256_set1_ps((float)k->wd), m = _mm256_set1_ps((float)k->momentum),
                 damp1 = _mm256_set1_ps((float)k->damp1), nlr = _mm256_set1_ps((float)-k->lr),
                 sign = _mm256_set1_ps(-0.0f);
    const bool has_wd = k->wd != 0, has_m = k->momentum != 0;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 d = _mm256_loadu_ps(g + i), pv = _mm256_loadu_ps(p + i);
        if (k->maximize) d = _mm256_xor_ps(d, sign);
        if (has_wd) d = _mm256_fmadd_ps(pv, wd, d);
        if (has_m) {
            __m256 b = k->first ? d : _mm256_fmadd_ps(d, damp1, _mm256_mul_ps(_mm256_loadu_ps(buf + i), m));
            _mm256_storeu_ps(buf + i, b);
            d = k->nesterov ? _mm256_fmadd_ps(b, m, d) : b;
        }
        _mm256_storeu_ps(p + i, _mm256_fmadd_ps(d, nlr, pv));
    }
    return i;
}

OPT_AVX2_TARGET static int64_t sgd_vec_f64(const sgd_k *k, int64_t n, double *p, const double *g, double *buf)
{
    const __m256d wd = _mm256_set1_pd(k->wd), m = _mm256_set1_pd(k->momentum), damp1 = _mm256_set1_pd(k->damp1),
                  nlr = _mm256_set1_pd(-k->lr), sign = _mm256_set1_pd(-0.0);
    const bool has_wd = k->wd != 0, has_m = k->momentum != 0;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        __m256d d = _mm256_loadu_pd(g + i), pv = _mm256_loadu_pd(p + i);
        if (k->maximize) d = _mm256_xor_pd(d, sign);
        if (has_wd) d = _mm256_fmadd_pd(pv, wd, d);
        if (has_m) {
            __m256d b = k->first ? d : _mm256_fmadd_pd(d, damp1, _mm256_mul_pd(_mm256_loadu_pd(buf + i), m));
            _mm256_storeu_pd(buf + i, b);
            d = k->nesterov ? _mm256_fmadd_pd(b, m, d) : b;
        }
        _mm256_storeu_pd(p + i, _mm256_fmadd_pd(d, nlr, pv));
    }
    return i;
}

/* torch.maximum(x, v): NaN if either is NaN, else std::max(x, v), i.e.
 * (x < v ? v : x) = _mm256_max_ps(v, x). */
OPT_AVX2_TARGET static int64_t adam_vec_f32(const adam_k *k, int64_t n, float *p, const float *g, float *m, float *v,
                                            float *mx)
{
    const __m256 wd = _mm256_set1_ps((float)k->wd), decay = _mm256_set1_ps((float)k->decay),
                 b1 = _mm256_set1_ps((float)k->beta1), omb1 = _mm256_set1_ps((float)k->omb1),
                 b2 = _mm256_set1_ps((float)k->beta2), omb2 = _mm256_set1_ps((float)k->omb2),
                 bc = _mm256_set1_ps((float)k->bc2_sqrt), eps = _mm256_set1_ps((float)k->eps),
                 nss = _mm256_set1_ps((float)k->neg_step_size), sign = _mm256_set1_ps(-0.0f),
                 qnan = _mm256_set1_ps(NAN);
    const bool l2 = !k->adamw && k->wd != 0;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 gi = _mm256_loadu_ps(g + i), pi = _mm256_loadu_ps(p + i);
        if (k->maximize) gi = _mm256_xor_ps(gi, sign);
        if (k->adamw) pi = _mm256_mul_ps(pi, decay);
        else if (l2) gi = _mm256_fmadd_ps(pi, wd, gi);
        __m256 mi = _mm256_fmadd_ps(gi, omb1, _mm256_mul_ps(_mm256_loadu_ps(m + i), b1));
        __m256 vi = _mm256_fmadd_ps(_mm256_mul_ps(omb2, gi), gi, _mm256_mul_ps(_mm256_loadu_ps(v + i), b2));
        _mm256_storeu_ps(m + i, mi);
        _mm256_storeu_ps(v + i, vi);
        __m256 s = vi;
        if (k->amsgrad) {
            __m256 x = _mm256_loadu_ps(mx + i);
            s = _mm256_blendv_ps(_mm256_max_ps(vi, x), qnan, _mm256_cmp_ps(x, vi, _CMP_UNORD_Q));
            _mm256_storeu_ps(mx + i, s);
        }
        __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(s), bc), eps);
        _mm256_storeu_ps(p + i, _mm256_add_ps(pi, _mm256_div_ps(_mm256_mul_ps(nss, mi), denom)));
    }
    return i;
}

OPT_AVX2_TARGET static int64_t adam_vec_f64(const adam_k *k, int64_t n, double *p, const double *g, double *m,
                                            double *v, double *mx)
{
    const __m256d wd = _mm256_set1_pd(k->wd), decay = _mm256_set1_pd(k->decay), b1 = _mm256_set1_pd(k->beta1),
                  omb1 = _mm256_set1_pd(k->omb1), b2 = _mm256_set1_pd(k->beta2), omb2 = _mm256_set1_pd(k->omb2),
                  bc = _mm256_set1_pd(k->bc2_sqrt), eps = _mm256_set1_pd(k->eps),
                  nss = _mm256_set1_pd(k->neg_step_size), sign = _mm256_set1_pd(-0.0),
                  qnan = _mm256_set1_pd((double)NAN);
    const bool l2 = !k->adamw && k->wd != 0;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        __m256d gi = _mm256_loadu_pd(g + i), pi = _mm256_loadu_pd(p + i);
        if (k->maximize) gi = _mm256_xor_pd(gi, sign);
        if (k->adamw) pi = _mm256_mul_pd(pi, decay);
        else if (l2) gi = _mm256_fmadd_pd(pi, wd, gi);
        __m256d mi = _mm256_fmadd_pd(gi, omb1, _mm256_mul_pd(_mm256_loadu_pd(m + i), b1));
        __m256d vi = _mm256_fmadd_pd(_mm256_mul_pd(omb2, gi), gi, _mm256_mul_pd(_mm256_loadu_pd(v + i), b2));
        _mm256_storeu_pd(m + i, mi);
        _mm256_storeu_pd(v + i, vi);
        __m256d s = vi;
        if (k->amsgrad) {
            __m256d x = _mm256_loadu_pd(mx + i);
            s = _mm256_blendv_pd(_mm256_max_pd(vi, x), qnan, _mm256_cmp_pd(x, vi, _CMP_UNORD_Q));
            _mm256_storeu_pd(mx + i, s);
        }
        __m256d denom = _mm256_add_pd(_mm256_div_pd(_mm256_sqrt_pd(s), bc), eps);
        _mm256_storeu_pd(p + i, _mm256_add_pd(pi, _mm256_div_pd(_mm256_mul_pd(nss, mi), denom)));
    }
    return i;
}

OPT_AVX2_TARGET OPT_ROW_ALIGN static void sgd_f32_avx2(const void *kv, int64_t n, void *p, int64_t sp, const void *g,
                                                       int64_t sg, int64_t lin)
{
    const sgd_k *k = kv;
    int64_t i = 0;
    if (sp == 1 && sg == 1) i = sgd_vec_f32(k, n, p, g, k->buf ? (float *)k->buf + lin : NULL);
    sgd_row_f32(kv, n - i, (float *)p + i * sp, sp, (const float *)g + i * sg, sg, lin + i);
}

OPT_AVX2_TARGET OPT_ROW_ALIGN static void sgd_f64_avx2(const void *kv, int64_t n, void *p, int64_t sp, const void *g,
                                                       int64_t sg, int64_t lin)
{
    const sgd_k *k = kv;
    int64_t i = 0;
    if (sp == 1 && sg == 1) i = sgd_vec_f64(k, n, p, g, k->buf ? (double *)k->buf + lin : NULL);
    sgd_row_f64(kv, n - i, (double *)p + i * sp, sp, (const double *)g + i * sg, sg, lin + i);
}

OPT_AVX2_TARGET OPT_ROW_ALIGN static void adam_f32_avx2(const void *kv, int64_t n, void *p, int64_t sp, const void *g,
                                                        int64_t sg, int64_t lin)
{
    const adam_k *k = kv;
    int64_t i = 0;
    if (sp == 1 && sg == 1)
        i = adam_vec_f32(k, n, p, g, (float *)k->exp_avg + lin, (float *)k->exp_avg_sq + lin,
                         k->max_exp_avg_sq ? (float *)k->max_exp_avg_sq + lin : NULL);
    adam_row_f32(kv, n - i, (float *)p + i * sp, sp, (const float *)g + i * sg, sg, lin + i);
}

OPT_AVX2_TARGET OPT_ROW_ALIGN static void adam_f64_avx2(const void *kv, int64_t n, void *p, int64_t sp, const void *g,
                                                        int64_t sg, int64_t lin)
{
    const adam_k *k = kv;
    int64_t i = 0;
    if (sp == 1 && sg == 1)
        i = adam_vec_f64(k, n, p, g, (double *)k->exp_avg + lin, (double *)k->exp_avg_sq + lin,
                         k->max_exp_avg_sq ? (double *)k->max_exp_avg_sq + lin : NULL);
    adam_row_f64(kv, n - i, (double *)p + i * sp, sp, (const double *)g + i * sg, sg, lin + i);
}
#endif

#if OPT_HAVE_AVX2_BUILD
/* The AVX-512 build: the AVX2 build's operations on sixteen floats (eight
 * doubles), the row's last partial vector under a mask (lanes past the
 * end are neither loaded nor stored), so a contiguous row is done with
 * vector instructions only; strided rows go through the scalar bodies.
 * Each instruction rounds as its scalar counterpart, so the bits are the
 * reference's. The sign flip of maximize is an integer xor (AVX-512F has
 * no float xor). */
OPT_AVX512_TARGET static inline __m512 neg512_ps(__m512 x)
{
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u)));
}

OPT_AVX512_TARGET static inline __m512d neg512_pd(__m512d x)
{
    return _mm512_castsi512_pd(
        _mm512_xor_si512(_mm512_castpd_si512(x), _mm512_set1_epi64((long long)0x8000000000000000ull)));
}

OPT_AVX512_TARGET static void sgd_vec512_f32(const sgd_k *k, int64_t n, float *p, const float *g, float *buf)
{
    const __m512 wd = _mm512_set1_ps((float)k->wd), m = _mm512_set1_ps((float)k->momentum),
                 damp1 = _mm512_set1_ps((float)k->damp1), nlr = _mm512_set1_ps((float)-k->lr);
    const bool has_wd = k->wd != 0, has_m = k->momentum != 0;
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 mk = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1u);
        __m512 d = _mm512_maskz_loadu_ps(mk, g + i), pv = _mm512_maskz_loadu_ps(mk, p + i);
        if (k->maximize) d = neg512_ps(d);
        if (has_wd) d = _mm512_fmadd_ps(pv, wd, d);
        if (has_m) {
            __m512 b = k->first ? d : _mm512_fmadd_ps(d, damp1, _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, buf + i), m));
            _mm512_mask_storeu_ps(buf + i, mk, b);
            d = k->nesterov ? _mm512_fmadd_ps(b, m, d) : b;
        }
        _mm512_mask_storeu_ps(p + i, mk, _mm512_fmadd_ps(d, nlr, pv));
    }
}

OPT_AVX512_TARGET static void sgd_vec512_f64(const sgd_k *k, int64_t n, double *p, const double *g, double *buf)
{
    const __m512d wd = _mm512_set1_pd(k->wd), m = _mm512_set1_pd(k->momentum), damp1 = _mm512_set1_pd(k->damp1),
                  nlr = _mm512_set1_pd(-k->lr);
    const bool has_wd = k->wd != 0, has_m = k->momentum != 0;
    for (int64_t i = 0; i < n; i += 8) {
        __mmask8 mk = n - i >= 8 ? (__mmask8)0xFF : (__mmask8)((1u << (n - i)) - 1u);
        __m512d d = _mm512_maskz_loadu_pd(mk, g + i), pv = _mm512_maskz_loadu_pd(mk, p + i);
        if (k->maximize) d = neg512_pd(d);
        if (has_wd) d = _mm512_fmadd_pd(pv, wd, d);
        if (has_m) {
            __m512d b = k->first ? d : _mm512_fmadd_pd(d, damp1, _mm512_mul_pd(_mm512_maskz_loadu_pd(mk, buf + i), m));
            _mm512_mask_storeu_pd(buf + i, mk, b);
            d = k->nesterov ? _mm512_fmadd_pd(b, m, d) : b;
        }
        _mm512_mask_storeu_pd(p + i, mk, _mm512_fmadd_pd(d, nlr, pv));
    }
}

/* torch.maximum as in the AVX2 build: _mm512_max_ps(v, x) is (v > x ? v :
 * x), and lanes where either is NaN take NaN. */
OPT_AVX512_TARGET static void adam_vec512_f32(const adam_k *k, int64_t n, float *p, const float *g, float *m, float *v,
                                              float *mx)
{
    const __m512 wd = _mm512_set1_ps((float)k->wd), decay = _mm512_set1_ps((float)k->decay),
                 b1 = _mm512_set1_ps((float)k->beta1), omb1 = _mm512_set1_ps((float)k->omb1),
                 b2 = _mm512_set1_ps((float)k->beta2), omb2 = _mm512_set1_ps((float)k->omb2),
                 bc = _mm512_set1_ps((float)k->bc2_sqrt), eps = _mm512_set1_ps((float)k->eps),
                 nss = _mm512_set1_ps((float)k->neg_step_size), qnan = _mm512_set1_ps(NAN);
    const bool l2 = !k->adamw && k->wd != 0;
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 mk = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1u);
        __m512 gi = _mm512_maskz_loadu_ps(mk, g + i), pi = _mm512_maskz_loadu_ps(mk, p + i);
        if (k->maximize) gi = neg512_ps(gi);
        if (k->adamw) pi = _mm512_mul_ps(pi, decay);
        else if (l2) gi = _mm512_fmadd_ps(pi, wd, gi);
        __m512 mi = _mm512_fmadd_ps(gi, omb1, _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, m + i), b1));
        __m512 vi = _mm512_fmadd_ps(_mm512_mul_ps(omb2, gi), gi, _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, v + i), b2));
        _mm512_mask_storeu_ps(m + i, mk, mi);
        _mm512_mask_storeu_ps(v + i, mk, vi);
        __m512 s = vi;
        if (k->amsgrad) {
            __m512 x = _mm512_maskz_loadu_ps(mk, mx + i);
            s = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, vi, _CMP_UNORD_Q), _mm512_max_ps(vi, x), qnan);
            _mm512_mask_storeu_ps(mx + i, mk, s);
        }
        __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(s), bc), eps);
        _mm512_mask_storeu_ps(p + i, mk, _mm512_add_ps(pi, _mm512_div_ps(_mm512_mul_ps(nss, mi), denom)));
    }
}

OPT_AVX512_TARGET static void adam_vec512_f64(const adam_k *k, int64_t n, double *p, const double *g, double *m,
                                              double *v, double *mx)
{
    const __m512d wd = _mm512_set1_pd(k->wd), decay = _mm512_set1_pd(k->decay), b1 = _mm512_set1_pd(k->beta1),
                  omb1 = _mm512_set1_pd(k->omb1), b2 = _mm512_set1_pd(k->beta2), omb2 = _mm512_set1_pd(k->omb2),
                  bc = _mm512_set1_pd(k->bc2_sqrt), eps = _mm512_set1_pd(k->eps),
                  nss = _mm512_set1_pd(k->neg_step_size), qnan = _mm512_set1_pd((double)NAN);
    const bool l2 = !k->adamw && k->wd != 0;
    for (int64_t i = 0; i < n; i += 8) {
        __mmask8 mk = n - i >= 8 ? (__mmask8)0xFF : (__mmask8)((1u << (n - i)) - 1u);
        __m512d gi = _mm512_maskz_loadu_pd(mk, g + i), pi = _mm512_maskz_loadu_pd(mk, p + i);
        if (k->maximize) gi = neg512_pd(gi);
        if (k->adamw) pi = _mm512_mul_pd(pi, decay);
        else if (l2) gi = _mm512_fmadd_pd(pi, wd, gi);
        __m512d mi = _mm512_fmadd_pd(gi, omb1, _mm512_mul_pd(_mm512_maskz_loadu_pd(mk, m + i), b1));
        __m512d vi = _mm512_fmadd_pd(_mm512_mul_pd(omb2, gi), gi, _mm512_mul_pd(_mm512_maskz_loadu_pd(mk, v + i), b2));
        _mm512_mask_storeu_pd(m + i, mk, mi);
        _mm512_mask_storeu_pd(v + i, mk, vi);
        __m512d s = vi;
        if (k->amsgrad) {
            __m512d x = _mm512_maskz_loadu_pd(mk, mx + i);
            s = _mm512_mask_blend_pd(_mm512_cmp_pd_mask(x, vi, _CMP_UNORD_Q), _mm512_max_pd(vi, x), qnan);
            _mm512_mask_storeu_pd(mx + i, mk, s);
        }
        __m512d denom = _mm512_add_pd(_mm512_div_pd(_mm512_sqrt_pd(s), bc), eps);
        _mm512_mask_storeu_pd(p + i, mk, _mm512_add_pd(pi, _mm512_div_pd(_mm512_mul_pd(nss, mi), denom)));
    }
}

OPT_AVX512_TARGET OPT_ROW_ALIGN static void sgd_f32_avx512(const void *kv, int64_t n, void *p, int64_t sp,
                                                           const void *g, int64_t sg, int64_t lin)
{
    const sgd_k *k = kv;
    if (sp == 1 && sg == 1) sgd_vec512_f32(k, n, p, g, k->buf ? (float *)k->buf + lin : NULL);
    else sgd_row_f32(kv, n, p, sp, g, sg, lin);
}

OPT_AVX512_TARGET OPT_ROW_ALIGN static void sgd_f64_avx512(const void *kv, int64_t n, void *p, int64_t sp,
                                                           const void *g, int64_t sg, int64_t lin)
{
    const sgd_k *k = kv;
    if (sp == 1 && sg == 1) sgd_vec512_f64(k, n, p, g, k->buf ? (double *)k->buf + lin : NULL);
    else sgd_row_f64(kv, n, p, sp, g, sg, lin);
}

OPT_AVX512_TARGET OPT_ROW_ALIGN static void adam_f32_avx512(const void *kv, int64_t n, void *p, int64_t sp,
                                                            const void *g, int64_t sg, int64_t lin)
{
    const adam_k *k = kv;
    if (sp == 1 && sg == 1)
        adam_vec512_f32(k, n, p, g, (float *)k->exp_avg + lin, (float *)k->exp_avg_sq + lin,
                        k->max_exp_avg_sq ? (float *)k->max_exp_avg_sq + lin : NULL);
    else adam_row_f32(kv, n, p, sp, g, sg, lin);
}

OPT_AVX512_TARGET OPT_ROW_ALIGN static void adam_f64_avx512(const void *kv, int64_t n, void *p, int64_t sp,
                                                            const void *g, int64_t sg, int64_t lin)
{
    const adam_k *k = kv;
    if (sp == 1 && sg == 1)
        adam_vec512_f64(k, n, p, g, (double *)k->exp_avg + lin, (double *)k->exp_avg_sq + lin,
                        k->max_exp_avg_sq ? (double *)k->max_exp_avg_sq + lin : NULL);
    else adam_row_f64(kv, n, p, sp, g, sg, lin);
}
#endif

row_fn ts__optim_sgd_kernel(bool f32)
{
#if OPT_HAVE_AVX2_BUILD
    ts__kpath path = update_path();
    if (path >= TS__KPATH_AVX512) return f32 ? sgd_f32_avx512 : sgd_f64_avx512;
    if (path == TS__KPATH_AVX2) return f32 ? sgd_f32_avx2 : sgd_f64_avx2;
#endif
    return f32 ? sgd_f32_ref : sgd_f64_ref;
}

row_fn ts__optim_adam_kernel(bool f32)
{
#if OPT_HAVE_AVX2_BUILD
    ts__kpath path = update_path();
    if (path >= TS__KPATH_AVX512) return f32 ? adam_f32_avx512 : adam_f64_avx512;
    if (path == TS__KPATH_AVX2) return f32 ? adam_f32_avx2 : adam_f64_avx2;
#endif
    return f32 ? adam_f32_ref : adam_f64_ref;
}
