/*
 * SGD, Adam and AdamW with PyTorch 1.13's single-tensor (foreach=False)
 * update formulas, learning-rate schedules, and clip_grad_norm_.
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
#include "optim/internal.h"
#include "tensor/internal.h"
#include "tensor/kernels.h"

#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define OPT_HAVE_AVX2_BUILD 1
#define OPT_AVX2_TARGET __attribute__((target("avx2,fma")))
#define OPT_AVX512_TARGET __attribute__((target("avx512f,avx2,fma")))
#else
#define OPT_HAVE_AVX2_BUILD 0
#endif
#define OPT_INLINE static inline __attribute__((always_inline))

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

/* ---------------------------------------------------------------- options */

ts_sgd_options ts_sgd_options_default(void)
{
    return (ts_sgd_options){.lr = 1e-3};
}

ts_adam_options ts_adam_options_default(void)
{
    return (ts_adam_options){.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8};
}

ts_adam_options ts_adamw_options_default(void)
{
    ts_adam_options o = ts_adam_options_default();
    o.weight_decay = 1e-2;
    return o;
}

/* ----------------------------------------------------------------- object */

typedef enum opt_kind { OPT_SGD = 0, OPT_ADAM, OPT_ADAMW } opt_kind;

static const char *const kind_names[] = {"SGD", "Adam", "AdamW"};

typedef struct opt_param {
    ts_tensor *param;     /* retained, as given (may be shard-marked) */
    ts_tensor *local;     /* retained local view on param's data */
    bool ready;           /* state exists (torch: self.state[p] not empty) */
    ts_tensor *momentum_buffer;             /* SGD with momentum */
    ts_tensor *exp_avg, *exp_avg_sq;        /* Adam(W) */
    ts_tensor *max_exp_avg_sq;              /* Adam(W) amsgrad */
    ts_tensor *step;                        /* Adam(W): 0-d f32, torch's state['step'] */
} opt_param;

struct ts_optim {
    opt_kind kind;
    int n;
    opt_param *p;
    ts_tensor **params;   /* p[i].param, in order (borrowed), for the upper layer's check */
    bool warned_no_grad;  /* a step without any gradient was reported */
    double lr;
    ts_sgd_options sgd;
    ts_adam_options adam;
    int64_t steps;
    bool fused;           /* the options' fused: state in one buffer per dtype, runs updated at once */
    bool arenas;          /* fused: every parameter's state views exist */
    int last_calls;       /* fused: kernel calls (runs and strided parameters) of the last step */
};

/* "parameter 3 ('fc.weight')" or "parameter 3" */
static const char *param_label(int i, const ts_tensor *t, char *buf, size_t len)
{
    const char *name = t ? ts_tensor_name(t) : "";
    if (name[0])
        snprintf(buf, len, "parameter %d ('%s')", i, name);
    else
        snprintf(buf, len, "parameter %d", i);
    return buf;
}

static ts_status check_params(const char *who, int n, ts_tensor *const *params)
{
    char lab[160];
    if (n <= 0 || !params)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: got an empty parameter list (n = %d%s)", who, n,
                        params ? "" : ", params NULL");
    for (int i = 0; i < n; i++) {
        ts_tensor *t = params[i];
        if (!t)
            return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: parameter %d is NULL", who, i);
        ts_dtype dt = ts_tensor_dtype(t);
        if (dt != TS_F32 && dt != TS_F64)
            return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %s has dtype %s; float32 or float64 expected", who,
                            param_label(i, t, lab, sizeof lab), ts_dtype_name(dt));
        if (!ts_tensor_requires_grad(t))
            return ts_error(TS_ERR_INVALID_ARGUMENT,
                            "%s: %s does not require grad; only tensors that require grad can be optimized", who,
                            param_label(i, t, lab, sizeof lab));
        if (!ts_tensor_is_leaf(t))
            return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %s is not a leaf; can't optimize a non-leaf tensor", who,
                            param_label(i, t, lab, sizeof lab));
        const int64_t *shape = ts_tensor_shape(t), *strides = ts_tensor_strides(t);
        for (int d = 0; d < ts_tensor_ndim(t); d++)
            if (shape[d] > 1 && strides[d] == 0)
                return ts_error(TS_ERR_INVALID_ARGUMENT,
                                "%s: %s has overlapping memory (stride 0 in dim %d, an expanded view); an in-place "
                                "update would write one element several times", who,
                                param_label(i, t, lab, sizeof lab), d);
        for (int j = 0; j < i; j++)
            if (params[j] == t)
                return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %s appears twice in the parameter list (also at %d)",
                                who, param_label(i, t, lab, sizeof lab), j);
    }
    return TS_OK;
}

static ts_status optim_new(opt_kind kind, int n, ts_tensor *const *params, ts_optim **out)
{
    const char *who = kind_names[kind];
    ts_status st = check_params(who, n, params);
    if (st)
        return st;
    ts_optim *o = ts__calloc(TS_MEM_NN, 1, sizeof *o);
    if (!o)
        return TS_ERR_NO_MEMORY;
    o->kind = kind;
    o->p = ts__calloc(TS_MEM_NN, (size_t)n, sizeof *o->p);
    o->params = ts__calloc(TS_MEM_NN, (size_t)n, sizeof *o->params);
    if (!o->p || !o->params) {
        ts__free(TS_MEM_NN, o->p);
        ts__free(TS_MEM_NN, o->params);
        ts__free(TS_MEM_NN, o);
        return TS_ERR_NO_MEMORY;
    }
    for (int i = 0; i < n; i++) {
        if ((st = ts_tensor_local_view(params[i], &o->p[i].local))) {
            ts_optim_free(o);
            return st;
        }
        o->p[i].param = ts_tensor_retain(params[i]);
        o->params[i] = o->p[i].param;
        o->n = i + 1;
    }
    *out = o;
    return TS_OK;
}

ts_status ts_sgd_new(int n, ts_tensor *const *params, const ts_sgd_options *opts, ts_optim **out)
{
    if (!out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "SGD: out is NULL");
    ts_sgd_options o = opts ? *opts : ts_sgd_options_default();
    if (!(o.lr > 0) || !isfinite(o.lr))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "SGD: invalid learning rate %g (must be > 0 and finite)", o.lr);
    if (!(o.momentum >= 0) || !isfinite(o.momentum))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "SGD: invalid momentum %g (must be >= 0)", o.momentum);
    if (!isfinite(o.dampening))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "SGD: invalid dampening %g (must be finite)", o.dampening);
    if (!(o.weight_decay >= 0) || !isfinite(o.weight_decay))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "SGD: invalid weight_decay %g (must be >= 0)", o.weight_decay);
    if (o.nesterov && (o.momentum <= 0 || o.dampening != 0))
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "SGD: nesterov momentum requires a momentum > 0 and zero dampening (momentum %g, "
                        "dampening %g)", o.momentum, o.dampening);
    ts_optim *opt;
    ts_status st = optim_new(OPT_SGD, n, params, &opt);
    if (st)
        return st;
    opt->sgd = o;
    opt->lr = o.lr;
    opt->fused = o.fused;
    *out = opt;
    return TS_OK;
}

static ts_status adam_new(opt_kind kind, int n, ts_tensor *const *params, const ts_adam_options *opts,
                          ts_optim **out)
{
    const char *who = kind_names[kind];
    if (!out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: out is NULL", who);
    ts_adam_options o = opts ? *opts : kind == OPT_ADAMW ? ts_adamw_options_default() : ts_adam_options_default();
    if (!(o.lr > 0) || !isfinite(o.lr))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: invalid learning rate %g (must be > 0 and finite)", who, o.lr);
    if (!(o.eps >= 0) || !isfinite(o.eps))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: invalid epsilon %g (must be >= 0)", who, o.eps);
    if (!(o.beta1 >= 0 && o.beta1 < 1))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: invalid beta1 %g (must be in [0, 1))", who, o.beta1);
    if (!(o.beta2 >= 0 && o.beta2 < 1))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: invalid beta2 %g (must be in [0, 1))", who, o.beta2);
    if (!(o.weight_decay >= 0) || !isfinite(o.weight_decay))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: invalid weight_decay %g (must be >= 0)", who,
                        o.weight_decay);
    ts_optim *opt;
    ts_status st = optim_new(kind, n, params, &opt);
    if (st)
        return st;
    opt->adam = o;
    opt->lr = o.lr;
    opt->fused = o.fused;
    *out = opt;
    return TS_OK;
}

ts_status ts_adam_new(int n, ts_tensor *const *params, const ts_adam_options *o, ts_optim **out)
{
    return adam_new(OPT_ADAM, n, params, o, out);
}

ts_status ts_adamw_new(int n, ts_tensor *const *params, const ts_adam_options *o, ts_optim **out)
{
    return adam_new(OPT_ADAMW, n, params, o, out);
}

static void free_state(opt_param *pp)
{
    ts_tensor_free(pp->momentum_buffer);
    ts_tensor_free(pp->exp_avg);
    ts_tensor_free(pp->exp_avg_sq);
    ts_tensor_free(pp->max_exp_avg_sq);
    ts_tensor_free(pp->step);
    pp->momentum_buffer = pp->exp_avg = pp->exp_avg_sq = pp->max_exp_avg_sq = pp->step = NULL;
    pp->ready = false;
}

void ts_optim_free(ts_optim *o)
{
    if (!o)
        return;
    for (int i = 0; i < o->n; i++) {
        free_state(&o->p[i]);
        ts_tensor_free(o->p[i].local);
        ts_tensor_free(o->p[i].param);
    }
    ts__free(TS_MEM_NN, o->p);
    ts__free(TS_MEM_NN, o->params);
    ts__free(TS_MEM_NN, o);
}

static _Atomic(ts__optim_param_check_fn) g_param_check;

void ts__optim_set_param_check(ts__optim_param_check_fn fn) { atomic_store(&g_param_check, fn); }

/* ------------------------------------------------------------------ state */

static bool has_momentum_state(const ts_optim *o) { return o->kind == OPT_SGD && o->sgd.momentum != 0; }

/* The slots of the element-wise states this optimizer keeps for pp
 * (momentum_buffer; or exp_avg, exp_avg_sq and max_exp_avg_sq with
 * amsgrad), written to slots_out; returns how many. */
static int elementwise_slots(const ts_optim *o, opt_param *pp, ts_tensor **slots_out[3])
{
    int n = 0;
    if (o->kind == OPT_SGD) {
        if (o->sgd.momentum != 0)
            slots_out[n++] = &pp->momentum_buffer;
        return n;
    }
    slots_out[n++] = &pp->exp_avg;
    slots_out[n++] = &pp->exp_avg_sq;
    if (o->adam.amsgrad)
        slots_out[n++] = &pp->max_exp_avg_sq;
    return n;
}

/* fused: one zeroed buffer per element-wise state and dtype holding that
 * state of every parameter of the dtype, in parameter order, and each
 * parameter's state a contiguous view of it in its local shape. Made once,
 * before any state exists (the first alloc_state), so that no state is
 * lost; on failure nothing is left allocated. */
static ts_status alloc_arenas(ts_optim *o)
{
    static const ts_dtype dts[2] = {TS_F32, TS_F64};
    ts_status st = TS_OK;
    for (int d = 0; d < 2 && !st; d++) {
        int64_t total = 0;
        bool any = false;
        for (int i = 0; i < o->n; i++)
            if (ts_tensor_dtype(o->p[i].local) == dts[d]) {
                total += ts_tensor_numel(o->p[i].local);
                any = true;
            }
        if (!any)
            continue;
        ts_tensor **probe[3];
        int ns = elementwise_slots(o, &o->p[0], probe);
        bool meta = false; /* the state is made where the parameters are (meta if any is) */
        for (int i = 0; i < o->n; i++)
            meta |= ts_tensor_dtype(o->p[i].local) == dts[d] && ts__is_meta(o->p[i].local);
        for (int s = 0; s < ns && !st; s++) {
            ts_tensor *arena = NULL;
            if ((st = ts_device_scope_enter(meta ? TS_DEVICE_META : TS_DEVICE_CPU)))
                break;
            st = ts_tensor_zeros(dts[d], 1, &total, &arena);
            ts_device_scope_exit();
            if (st)
                break;
            int64_t off = 0;
            for (int i = 0; i < o->n && !st; i++) {
                opt_param *pp = &o->p[i];
                if (ts_tensor_dtype(pp->local) != dts[d])
                    continue;
                ts_tensor **slots[3];
                elementwise_slots(o, pp, slots);
                int nd = ts_tensor_ndim(pp->local);
                int64_t strides[TS_MAX_DIMS];
                ts__contiguous_strides(nd, ts_tensor_shape(pp->local), strides);
                st = ts__tensor_alias(arena, nd, ts_tensor_shape(pp->local), strides, off, slots[s]);
                off += ts_tensor_numel(pp->local);
            }
            ts_tensor_free(arena); /* the views keep the storage */
        }
    }
    if (st) {
        for (int i = 0; i < o->n; i++) {
            ts_tensor **slots[3];
            int ns = elementwise_slots(o, &o->p[i], slots);
            for (int s = 0; s < ns; s++) {
                ts_tensor_free(*slots[s]);
                *slots[s] = NULL;
            }
        }
        return st;
    }
    o->arenas = true;
    return TS_OK;
}

static ts_status alloc_state_on(ts_optim *o, int i);

/* Allocates parameter i's state as torch's first step does (zeros, step 0)
 * unless allocated already, on the parameter's device (torch's zeros_like:
 * meta state for a meta parameter, on its meta ledger; CPU state for a CPU
 * parameter, inside a meta scope too). Does not mark it ready. */
static ts_status alloc_state(ts_optim *o, int i)
{
    ts_status st = ts_device_scope_enter(ts__is_meta(o->p[i].local) ? TS_DEVICE_META : TS_DEVICE_CPU);
    if (st)
        return st;
    st = alloc_state_on(o, i);
    ts_device_scope_exit();
    return st;
}

static ts_status alloc_state_on(ts_optim *o, int i)
{
    opt_param *pp = &o->p[i];
    if (o->fused && !o->arenas) {
        ts_status ast = alloc_arenas(o);
        if (ast)
            return ast;
    }
    ts_tensor *t = pp->local;
    ts_dtype dt = ts_tensor_dtype(t);
    int nd = ts_tensor_ndim(t);
    const int64_t *shape = ts_tensor_shape(t);
    ts_status st = TS_OK;
    if (o->kind == OPT_SGD) {
        if (has_momentum_state(o) && !pp->momentum_buffer)
            st = ts_tensor_zeros(dt, nd, shape, &pp->momentum_buffer);
        return st;
    }
    if (!pp->step && (st = ts_tensor_zeros(TS_F32, 0, NULL, &pp->step)))
        return st;
    if (!pp->exp_avg && (st = ts_tensor_zeros(dt, nd, shape, &pp->exp_avg)))
        return st;
    if (!pp->exp_avg_sq && (st = ts_tensor_zeros(dt, nd, shape, &pp->exp_avg_sq)))
        return st;
    if (o->adam.amsgrad && !pp->max_exp_avg_sq && (st = ts_tensor_zeros(dt, nd, shape, &pp->max_exp_avg_sq)))
        return st;
    return TS_OK;
}

/* ------------------------------------------------------------ row walking */

/* An update kernel over one row of n elements: param row p (stride sp),
 * gradient row g (stride sg), state at linear element index `lin` (state
 * tensors are contiguous, in the parameter's row-major order). */
typedef void (*row_fn)(const void *k, int64_t n, void *p, int64_t sp, const void *g, int64_t sg, int64_t lin);

/* Runs fn over every innermost row of a (and b, same shape) in row-major
 * order; one call for the whole tensor when both are contiguous. */
static void walk_rows(ts_tensor *a, const ts_tensor *b, row_fn fn, const void *k)
{
    int64_t numel = ts_tensor_numel(a);
    if (numel == 0)
        return;
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
            if (++idx[d] < shape[d])
                break;
            oa -= sa[d] * shape[d];
            ob -= sb[d] * shape[d];
            idx[d] = 0;
        }
        if (d < 0)
            return;
    }
}

/* -------------------------------------------------------------- SGD kernel */

typedef struct sgd_k {
    double lr, wd, momentum, damp1; /* damp1 = 1 - dampening */
    bool nesterov, maximize, first; /* first: the buffer is new (buf = d_p.clone()) */
    void *buf;                      /* momentum buffer data or NULL */
} sgd_k;

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
        if (has_wd)
            d = fmaf(p[i * sp], wd, d);
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
        if (has_wd)
            d = fma(p[i * sp], wd, d);
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
    if (sp == 1 && sg == 1)
        sgd_body_f32(k, n, p, 1, g, 1, buf);
    else
        sgd_body_f32(k, n, p, sp, g, sg, buf);
}

OPT_INLINE void sgd_row_f64(const void *kv, int64_t n, void *p, int64_t sp, const void *g, int64_t sg, int64_t lin)
{
    const sgd_k *k = kv;
    double *buf = k->buf ? (double *)k->buf + lin : NULL;
    if (sp == 1 && sg == 1)
        sgd_body_f64(k, n, p, 1, g, 1, buf);
    else
        sgd_body_f64(k, n, p, sp, g, sg, buf);
}

/* ------------------------------------------------------------- Adam kernel */

typedef struct adam_k {
    double wd;          /* Adam's L2 term (0 for AdamW) */
    double decay;       /* AdamW: 1 - lr * weight_decay */
    double beta1, omb1, beta2, omb2; /* omb = 1 - beta */
    double bc2_sqrt, eps, neg_step_size;
    bool adamw, amsgrad, maximize;
    void *exp_avg, *exp_avg_sq, *max_exp_avg_sq;
} adam_k;

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
        if (k->adamw)
            pi = pi * decay;
        else if (l2)
            gi = fmaf(pi, wd, gi);
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
        if (k->adamw)
            pi = pi * decay;
        else if (l2)
            gi = fma(pi, wd, gi);
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
    if (sp == 1 && sg == 1)
        adam_body_f32(k, n, p, 1, g, 1, m, v, mx);
    else
        adam_body_f32(k, n, p, sp, g, sg, m, v, mx);
}

OPT_INLINE void adam_row_f64(const void *kv, int64_t n, void *p, int64_t sp, const void *g, int64_t sg, int64_t lin)
{
    const adam_k *k = kv;
    double *m = (double *)k->exp_avg + lin, *v = (double *)k->exp_avg_sq + lin;
    double *mx = k->max_exp_avg_sq ? (double *)k->max_exp_avg_sq + lin : NULL;
    if (sp == 1 && sg == 1)
        adam_body_f64(k, n, p, 1, g, 1, m, v, mx);
    else
        adam_body_f64(k, n, p, sp, g, sg, m, v, mx);
}

/* The plain reference build of each kernel (fma from libm). */
static void sgd_f32_ref(const void *k, int64_t n, void *p, int64_t sp, const void *g, int64_t sg, int64_t lin)
{
    sgd_row_f32(k, n, p, sp, g, sg, lin);
}
static void sgd_f64_ref(const void *k, int64_t n, void *p, int64_t sp, const void *g, int64_t sg, int64_t lin)
{
    sgd_row_f64(k, n, p, sp, g, sg, lin);
}
static void adam_f32_ref(const void *k, int64_t n, void *p, int64_t sp, const void *g, int64_t sg, int64_t lin)
{
    adam_row_f32(k, n, p, sp, g, sg, lin);
}
static void adam_f64_ref(const void *k, int64_t n, void *p, int64_t sp, const void *g, int64_t sg, int64_t lin)
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
        if (k->maximize)
            d = _mm256_xor_ps(d, sign);
        if (has_wd)
            d = _mm256_fmadd_ps(pv, wd, d);
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
        if (k->maximize)
            d = _mm256_xor_pd(d, sign);
        if (has_wd)
            d = _mm256_fmadd_pd(pv, wd, d);
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
OPT_AVX2_TARGET static int64_t adam_vec_f32(const adam_k *k, int64_t n, float *p, const float *g, float *m,
                                            float *v, float *mx)
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
        if (k->maximize)
            gi = _mm256_xor_ps(gi, sign);
        if (k->adamw)
            pi = _mm256_mul_ps(pi, decay);
        else if (l2)
            gi = _mm256_fmadd_ps(pi, wd, gi);
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
        if (k->maximize)
            gi = _mm256_xor_pd(gi, sign);
        if (k->adamw)
            pi = _mm256_mul_pd(pi, decay);
        else if (l2)
            gi = _mm256_fmadd_pd(pi, wd, gi);
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

OPT_AVX2_TARGET static void sgd_f32_avx2(const void *kv, int64_t n, void *p, int64_t sp, const void *g, int64_t sg,
                                         int64_t lin)
{
    const sgd_k *k = kv;
    int64_t i = 0;
    if (sp == 1 && sg == 1)
        i = sgd_vec_f32(k, n, p, g, k->buf ? (float *)k->buf + lin : NULL);
    sgd_row_f32(kv, n - i, (float *)p + i * sp, sp, (const float *)g + i * sg, sg, lin + i);
}

OPT_AVX2_TARGET static void sgd_f64_avx2(const void *kv, int64_t n, void *p, int64_t sp, const void *g, int64_t sg,
                                         int64_t lin)
{
    const sgd_k *k = kv;
    int64_t i = 0;
    if (sp == 1 && sg == 1)
        i = sgd_vec_f64(k, n, p, g, k->buf ? (double *)k->buf + lin : NULL);
    sgd_row_f64(kv, n - i, (double *)p + i * sp, sp, (const double *)g + i * sg, sg, lin + i);
}

OPT_AVX2_TARGET static void adam_f32_avx2(const void *kv, int64_t n, void *p, int64_t sp, const void *g,
                                          int64_t sg, int64_t lin)
{
    const adam_k *k = kv;
    int64_t i = 0;
    if (sp == 1 && sg == 1)
        i = adam_vec_f32(k, n, p, g, (float *)k->exp_avg + lin, (float *)k->exp_avg_sq + lin,
                         k->max_exp_avg_sq ? (float *)k->max_exp_avg_sq + lin : NULL);
    adam_row_f32(kv, n - i, (float *)p + i * sp, sp, (const float *)g + i * sg, sg, lin + i);
}

OPT_AVX2_TARGET static void adam_f64_avx2(const void *kv, int64_t n, void *p, int64_t sp, const void *g,
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
        if (k->maximize)
            d = neg512_ps(d);
        if (has_wd)
            d = _mm512_fmadd_ps(pv, wd, d);
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
        if (k->maximize)
            d = neg512_pd(d);
        if (has_wd)
            d = _mm512_fmadd_pd(pv, wd, d);
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
OPT_AVX512_TARGET static void adam_vec512_f32(const adam_k *k, int64_t n, float *p, const float *g, float *m,
                                              float *v, float *mx)
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
        if (k->maximize)
            gi = neg512_ps(gi);
        if (k->adamw)
            pi = _mm512_mul_ps(pi, decay);
        else if (l2)
            gi = _mm512_fmadd_ps(pi, wd, gi);
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
        if (k->maximize)
            gi = neg512_pd(gi);
        if (k->adamw)
            pi = _mm512_mul_pd(pi, decay);
        else if (l2)
            gi = _mm512_fmadd_pd(pi, wd, gi);
        __m512d mi = _mm512_fmadd_pd(gi, omb1, _mm512_mul_pd(_mm512_maskz_loadu_pd(mk, m + i), b1));
        __m512d vi =
            _mm512_fmadd_pd(_mm512_mul_pd(omb2, gi), gi, _mm512_mul_pd(_mm512_maskz_loadu_pd(mk, v + i), b2));
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

OPT_AVX512_TARGET static void sgd_f32_avx512(const void *kv, int64_t n, void *p, int64_t sp, const void *g,
                                             int64_t sg, int64_t lin)
{
    const sgd_k *k = kv;
    if (sp == 1 && sg == 1)
        sgd_vec512_f32(k, n, p, g, k->buf ? (float *)k->buf + lin : NULL);
    else
        sgd_row_f32(kv, n, p, sp, g, sg, lin);
}

OPT_AVX512_TARGET static void sgd_f64_avx512(const void *kv, int64_t n, void *p, int64_t sp, const void *g,
                                             int64_t sg, int64_t lin)
{
    const sgd_k *k = kv;
    if (sp == 1 && sg == 1)
        sgd_vec512_f64(k, n, p, g, k->buf ? (double *)k->buf + lin : NULL);
    else
        sgd_row_f64(kv, n, p, sp, g, sg, lin);
}

OPT_AVX512_TARGET static void adam_f32_avx512(const void *kv, int64_t n, void *p, int64_t sp, const void *g,
                                              int64_t sg, int64_t lin)
{
    const adam_k *k = kv;
    if (sp == 1 && sg == 1)
        adam_vec512_f32(k, n, p, g, (float *)k->exp_avg + lin, (float *)k->exp_avg_sq + lin,
                        k->max_exp_avg_sq ? (float *)k->max_exp_avg_sq + lin : NULL);
    else
        adam_row_f32(kv, n, p, sp, g, sg, lin);
}

OPT_AVX512_TARGET static void adam_f64_avx512(const void *kv, int64_t n, void *p, int64_t sp, const void *g,
                                              int64_t sg, int64_t lin)
{
    const adam_k *k = kv;
    if (sp == 1 && sg == 1)
        adam_vec512_f64(k, n, p, g, (double *)k->exp_avg + lin, (double *)k->exp_avg_sq + lin,
                        k->max_exp_avg_sq ? (double *)k->max_exp_avg_sq + lin : NULL);
    else
        adam_row_f64(kv, n, p, sp, g, sg, lin);
}
#endif

static row_fn sgd_kernel(bool f32)
{
#if OPT_HAVE_AVX2_BUILD
    ts__kpath path = update_path();
    if (path >= TS__KPATH_AVX512)
        return f32 ? sgd_f32_avx512 : sgd_f64_avx512;
    if (path == TS__KPATH_AVX2)
        return f32 ? sgd_f32_avx2 : sgd_f64_avx2;
#endif
    return f32 ? sgd_f32_ref : sgd_f64_ref;
}

static row_fn adam_kernel(bool f32)
{
#if OPT_HAVE_AVX2_BUILD
    ts__kpath path = update_path();
    if (path >= TS__KPATH_AVX512)
        return f32 ? adam_f32_avx512 : adam_f64_avx512;
    if (path == TS__KPATH_AVX2)
        return f32 ? adam_f32_avx2 : adam_f64_avx2;
#endif
    return f32 ? adam_f32_ref : adam_f64_ref;
}

/* ------------------------------------------------------------------- step */

static ts_status check_grad(const ts_optim *o, int i, const ts_tensor *g)
{
    const opt_param *pp = &o->p[i];
    const char *who = kind_names[o->kind];
    char lab[160], s1[96], s2[96];
    if (ts_tensor_dtype(g) != ts_tensor_dtype(pp->local))
        return ts_error(TS_ERR_DTYPE, "%s step: %s has a %s gradient for %s data", who,
                        param_label(i, pp->param, lab, sizeof lab), ts_dtype_name(ts_tensor_dtype(g)),
                        ts_dtype_name(ts_tensor_dtype(pp->local)));
    int nd = ts_tensor_ndim(g);
    if (nd != ts_tensor_ndim(pp->local) ||
        memcmp(ts_tensor_shape(g), ts_tensor_shape(pp->local), (size_t)nd * sizeof(int64_t)) != 0)
        return ts_error(TS_ERR_SHAPE, "%s step: %s has gradient shape %s but its data has shape %s", who,
                        param_label(i, pp->param, lab, sizeof lab), ts_tensor_shape_str(g, s1, sizeof s1),
                        ts_tensor_shape_str(pp->local, s2, sizeof s2));
    if (ts__is_meta(pp->local) || ts__is_meta(g)) {
        /* a meta step allocates the state and computes nothing; outside a
         * meta scope it is refused, as ops refuse meta inputs */
        if (!ts__meta_mode())
            return ts_error(TS_ERR_STATE, "%s step: %s%s %s is on the meta device (it has no data): materialize "
                                          "the model or load a checkpoint first (inside ts_device_scope_enter("
                                          "TS_DEVICE_META) a step only allocates its state)", who,
                            ts__is_meta(pp->local) ? "" : "the gradient of ",
                            param_label(i, pp->param, lab, sizeof lab),
                            ts_tensor_shape_str(ts__is_meta(pp->local) ? pp->local : g, s1, sizeof s1));
        if (ts_storage_is_released(ts_tensor_storage(pp->local)) || ts_storage_is_released(ts_tensor_storage(g)))
            return ts_error(TS_ERR_RELEASED, "%s step: %s or its gradient has released storage", who,
                            param_label(i, pp->param, lab, sizeof lab));
        return TS_OK;
    }
    if (ts_tensor_numel(pp->local) > 0 && !ts_tensor_data(pp->local))
        return ts_error(TS_ERR_RELEASED, "%s step: %s has released storage", who,
                        param_label(i, pp->param, lab, sizeof lab));
    if (ts_tensor_numel(g) > 0 && !ts_tensor_data(g))
        return ts_error(TS_ERR_RELEASED, "%s step: the gradient of %s has released storage", who,
                        param_label(i, pp->param, lab, sizeof lab));
    return TS_OK;
}

/* The SGD kernel's arguments for parameter pp's update this step. */
static sgd_k sgd_args(const ts_optim *o, const opt_param *pp)
{
    const ts_sgd_options *s = &o->sgd;
    return (sgd_k){.lr = o->lr, .wd = s->weight_decay, .momentum = s->momentum, .damp1 = 1.0 - s->dampening,
                   .nesterov = s->nesterov, .maximize = s->maximize, .first = !pp->ready,
                   .buf = pp->momentum_buffer ? ts_tensor_data(pp->momentum_buffer) : NULL};
}

/* Counts parameter pp's step (its "step" state += 1, a float32 as torch's)
 * and returns the Adam kernel's arguments for it. */
static adam_k adam_args(const ts_optim *o, opt_param *pp)
{
    const ts_adam_options *a = &o->adam;
    /* step_t += 1 (a float32 tensor); step = step_t.item() */
    float *step_t = ts_tensor_data(pp->step);
    *step_t = *step_t + 1.0f;
    double step = (double)*step_t;
    /* Python floats: bias_correction1 = 1 - beta1 ** step, ...;
     * step_size = lr / bias_correction1; math.sqrt(bias_correction2) */
    double bc1 = 1.0 - pow(a->beta1, step), bc2 = 1.0 - pow(a->beta2, step);
    double step_size = o->lr / bc1;
    return (adam_k){.wd = o->kind == OPT_ADAM ? a->weight_decay : 0.0,
                    .decay = 1.0 - o->lr * a->weight_decay,
                    .beta1 = a->beta1, .omb1 = 1.0 - a->beta1, .beta2 = a->beta2, .omb2 = 1.0 - a->beta2,
                    .bc2_sqrt = sqrt(bc2), .eps = a->eps, .neg_step_size = -step_size,
                    .adamw = o->kind == OPT_ADAMW, .amsgrad = a->amsgrad, .maximize = a->maximize,
                    .exp_avg = ts_tensor_data(pp->exp_avg), .exp_avg_sq = ts_tensor_data(pp->exp_avg_sq),
                    .max_exp_avg_sq = pp->max_exp_avg_sq ? ts_tensor_data(pp->max_exp_avg_sq) : NULL};
}

static void sgd_update(ts_optim *o, opt_param *pp, ts_tensor *g)
{
    sgd_k k = sgd_args(o, pp);
    walk_rows(pp->local, g, sgd_kernel(ts_tensor_dtype(pp->local) == TS_F32), &k);
    pp->ready = true;
}

static void adam_update(ts_optim *o, opt_param *pp, ts_tensor *g)
{
    adam_k k = adam_args(o, pp);
    walk_rows(pp->local, g, adam_kernel(ts_tensor_dtype(pp->local) == TS_F32), &k);
    pp->ready = true;
}

/* ------------------------------------------------------------ fused step */

/* A run of parameters updated by one kernel call: the first one's kernel
 * arguments (its state pointers and, for Adam, its step's bias
 * corrections, which every parameter of the run shares), its data and
 * gradient, and the run's element count. */
typedef struct fused_run {
    bool open, f32;
    int64_t n;
    size_t es;
    unsigned char *p;
    const unsigned char *g;
    sgd_k sk;
    adam_k ak;
} fused_run;

static void run_flush(ts_optim *o, fused_run *r)
{
    if (!r->open)
        return;
    o->last_calls++;
    if (o->kind == OPT_SGD)
        sgd_kernel(r->f32)(&r->sk, r->n, r->p, 1, r->g, 1, 0);
    else
        adam_kernel(r->f32)(&r->ak, r->n, r->p, 1, r->g, 1, 0);
    r->open = false;
}

/* a + n elements of size es == b, for possibly NULL pointers */
static bool adjacent(const void *a, int64_t n, size_t es, const void *b)
{
    return a && b && (const unsigned char *)a + (size_t)n * es == (const unsigned char *)b;
}

/* True if parameter pp (kernel arguments sk / ak, data p, gradient g) is
 * where run r ends in every buffer (data, gradient, each state) and takes
 * the same kernel arguments but for those pointers. */
static bool run_extends(const ts_optim *o, const fused_run *r, bool f32, const unsigned char *p,
                        const unsigned char *g, const sgd_k *sk, const adam_k *ak)
{
    if (!r->open || r->f32 != f32 || !adjacent(r->p, r->n, r->es, p) || !adjacent(r->g, r->n, r->es, g))
        return false;
    if (o->kind == OPT_SGD)
        return r->sk.first == sk->first && (!sk->buf || adjacent(r->sk.buf, r->n, r->es, sk->buf));
    return r->ak.bc2_sqrt == ak->bc2_sqrt && r->ak.neg_step_size == ak->neg_step_size &&
           adjacent(r->ak.exp_avg, r->n, r->es, ak->exp_avg) &&
           adjacent(r->ak.exp_avg_sq, r->n, r->es, ak->exp_avg_sq) &&
           (!ak->max_exp_avg_sq || adjacent(r->ak.max_exp_avg_sq, r->n, r->es, ak->max_exp_avg_sq));
}

/* The fused step: every parameter with a gradient, in order; contiguous
 * ones join the open run of their dtype when they continue it in memory,
 * else start a new one (updates of different parameters are independent,
 * so their order does not matter); non-contiguous ones are walked by rows
 * as without fused. Each
 * element is computed by the same kernel with the same arguments as in
 * the per-parameter step, so the bits are the same. */
static void fused_step(ts_optim *o)
{
    fused_run runs[2] = {{0}}; /* the open run of float32 and of float64 parameters */
    o->last_calls = 0;
    for (int i = 0; i < o->n; i++) {
        opt_param *pp = &o->p[i];
        ts_tensor *g = ts_tensor_grad(pp->param);
        if (!g)
            continue;
        if (ts__is_meta(pp->local) || ts__is_meta(g)) { /* meta: state allocated, nothing to compute */
            pp->ready = true;
            continue;
        }
        sgd_k sk = {0};
        adam_k ak = {0};
        if (o->kind == OPT_SGD)
            sk = sgd_args(o, pp);
        else
            ak = adam_args(o, pp);
        pp->ready = true;
        int64_t n = ts_tensor_numel(pp->local);
        if (n == 0)
            continue;
        bool f32 = ts_tensor_dtype(pp->local) == TS_F32;
        if (!ts_tensor_is_contiguous(pp->local) || !ts_tensor_is_contiguous(g)) {
            walk_rows(pp->local, g, o->kind == OPT_SGD ? sgd_kernel(f32) : adam_kernel(f32),
                      o->kind == OPT_SGD ? (const void *)&sk : (const void *)&ak);
            o->last_calls++;
            continue;
        }
        unsigned char *p = ts_tensor_data(pp->local);
        const unsigned char *gd = ts_tensor_data(g);
        fused_run *r = &runs[f32 ? 0 : 1];
        if (run_extends(o, r, f32, p, gd, &sk, &ak)) {
            r->n += n;
            continue;
        }
        run_flush(o, r);
        *r = (fused_run){.open = true, .f32 = f32, .n = n, .es = f32 ? 4 : 8, .p = p, .g = gd, .sk = sk, .ak = ak};
    }
    run_flush(o, &runs[0]);
    run_flush(o, &runs[1]);
}

ts_status ts_optim_step(ts_optim *o)
{
    if (!o)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_optim_step: optimizer is NULL");
    ts_status st;
    /* Everything is checked and allocated before any value changes, so a
     * failed step leaves parameters and state as they were. */
    ts__optim_param_check_fn check = atomic_load(&g_param_check);
    if (check && (st = check(kind_names[o->kind], o->n, o->params, o->steps == 0)))
        return st;
    int n_grads = 0;
    for (int i = 0; i < o->n; i++) {
        ts_tensor *g = ts_tensor_grad(o->p[i].param);
        if (g && (st = check_grad(o, i, g)))
            return st;
        n_grads += g != NULL;
    }
    if (!n_grads && !o->warned_no_grad) {
        /* torch steps silently; a whole step without gradients is almost
         * always a mistake, so it is said once per optimizer */
        o->warned_no_grad = true;
        ts_logf(TS_LOG_WARN,
                "%s step %lld: none of its %d parameters has a gradient, so the step changes nothing (run backward "
                "first; build the optimizer from the model's parameters after ts_fully_shard; do not zero the "
                "gradients with set_to_none between backward and step). Said once per optimizer.",
                kind_names[o->kind], (long long)o->steps, o->n);
    }
    for (int i = 0; i < o->n; i++)
        if (ts_tensor_grad(o->p[i].param) && (st = alloc_state(o, i)))
            return st;
    TS_TRACE_BEGIN(t0);
    if (o->fused)
        fused_step(o);
    for (int i = 0; i < o->n && !o->fused; i++) {
        opt_param *pp = &o->p[i];
        ts_tensor *g = ts_tensor_grad(pp->param);
        if (!g)
            continue; /* torch skips parameters whose .grad is None */
        if (ts__is_meta(pp->local) || ts__is_meta(g))
            pp->ready = true; /* meta: state allocated, nothing to compute */
        else if (o->kind == OPT_SGD)
            sgd_update(o, pp, g);
        else
            adam_update(o, pp, g);
    }
    o->steps++;
    if (t0) {
        ts_trace_arg a[1] = {{"step", NULL, o->steps}};
        ts_trace_span_args("optimizer.step", "optimizer", t0, ts_now_ns(), 1, a);
    }
    return TS_OK;
}

void ts_optim_zero_grad(ts_optim *o, bool set_to_none)
{
    if (!o)
        return;
    for (int i = 0; i < o->n; i++)
        ts_tensor_zero_grad(o->p[i].param, set_to_none);
}

double ts_optim_get_lr(const ts_optim *o) { return o ? o->lr : NAN; }

void ts_optim_set_lr(ts_optim *o, double lr)
{
    if (!o)
        return;
    if (!(lr >= 0) || !isfinite(lr)) {
        ts_logf(TS_LOG_WARN, "%s: ignoring invalid learning rate %g (must be >= 0 and finite)", kind_names[o->kind],
                lr);
        return;
    }
    o->lr = lr;
}

int64_t ts_optim_step_count(const ts_optim *o) { return o ? o->steps : 0; }

const char *ts__optim_kind_name(const ts_optim *o) { return kind_names[o->kind]; }

void ts__optim_hparams_get(const ts_optim *o, ts__optim_hparams *out)
{
    memset(out, 0, sizeof *out);
    out->lr = o->lr;
    if (o->kind == OPT_SGD) {
        out->sgd = true;
        out->momentum = o->sgd.momentum;
        out->dampening = o->sgd.dampening;
        out->weight_decay = o->sgd.weight_decay;
        out->nesterov = o->sgd.nesterov;
        out->maximize = o->sgd.maximize;
        return;
    }
    out->beta1 = o->adam.beta1;
    out->beta2 = o->adam.beta2;
    out->eps = o->adam.eps;
    out->weight_decay = o->adam.weight_decay;
    out->amsgrad = o->adam.amsgrad;
    out->maximize = o->adam.maximize;
}

int ts__optim_state_names(const ts_optim *o, const char *names_out[4])
{
    int n = 0;
    if (o->kind == OPT_SGD) {
        if (has_momentum_state(o))
            names_out[n++] = "momentum_buffer";
        return n;
    }
    names_out[n++] = "step";
    names_out[n++] = "exp_avg";
    names_out[n++] = "exp_avg_sq";
    if (o->adam.amsgrad)
        names_out[n++] = "max_exp_avg_sq";
    return n;
}

void ts__optim_set_step_count(ts_optim *o, int64_t steps) { o->steps = steps; }

int ts__optim_fused_calls(const ts_optim *o) { return o && o->fused ? o->last_calls : -1; }

int ts_optim_num_params(const ts_optim *o) { return o ? o->n : 0; }

ts_tensor *ts_optim_param(const ts_optim *o, int i) { return o && i >= 0 && i < o->n ? o->params[i] : NULL; }

/* The slot of state `name` for this optimizer, NULL if it has none. */
static ts_tensor **state_slot(ts_optim *o, int i, const char *name)
{
    opt_param *pp = &o->p[i];
    if (o->kind == OPT_SGD)
        return has_momentum_state(o) && !strcmp(name, "momentum_buffer") ? &pp->momentum_buffer : NULL;
    if (!strcmp(name, "step"))
        return &pp->step;
    if (!strcmp(name, "exp_avg"))
        return &pp->exp_avg;
    if (!strcmp(name, "exp_avg_sq"))
        return &pp->exp_avg_sq;
    if (!strcmp(name, "max_exp_avg_sq") && o->adam.amsgrad)
        return &pp->max_exp_avg_sq;
    return NULL;
}

ts_tensor *ts_optim_state(const ts_optim *o, int param_index, const char *name)
{
    if (!o || !name || param_index < 0 || param_index >= o->n || !o->p[param_index].ready)
        return NULL;
    ts_tensor **slot = state_slot((ts_optim *)o, param_index, name);
    return slot ? *slot : NULL;
}

ts_status ts_optim_state_create(ts_optim *o, int param_index, const char *name, ts_tensor **state_out)
{
    if (!o || !name || !state_out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_optim_state_create: NULL argument");
    if (param_index < 0 || param_index >= o->n)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: parameter index %d out of range [0, %d)",
                        kind_names[o->kind], param_index, o->n);
    ts_tensor **slot = state_slot(o, param_index, name);
    if (!slot)
        return ts_error(TS_ERR_NOT_FOUND, "%s: no state named '%s' in this optimizer", kind_names[o->kind], name);
    ts_status st = alloc_state(o, param_index);
    if (st)
        return st;
    o->p[param_index].ready = true;
    *state_out = *slot;
    return TS_OK;
}

/* ------------------------------------------------------------- schedules */

static const char *const lr_kind_names[] = {"TS_LR_CONSTANT", "TS_LR_WARMUP_COSINE", "TS_LR_WARMUP_CONSTANT",
                                             "TS_LR_WARMUP_LINEAR", "TS_LR_WARMUP_STABLE_DECAY"};
_Static_assert(sizeof lr_kind_names / sizeof lr_kind_names[0] == TS_LR_KIND_COUNT, "a name per schedule kind");

/* What a kind reads besides base_lr: the warmup; total_steps and min_lr
 * (a decay to min_lr at total_steps); decay_fraction. */
static bool lr_has_warmup(ts_lr_kind k) { return k != TS_LR_CONSTANT; }
static bool lr_has_decay(ts_lr_kind k)
{
    return k == TS_LR_WARMUP_COSINE || k == TS_LR_WARMUP_LINEAR || k == TS_LR_WARMUP_STABLE_DECAY;
}

/* Whether schedule s (not NULL) is one ts_lr_schedule_check accepts;
 * when not, and `why` is given, the reason (naming the field and value)
 * goes there. Sets no error: ts_lr_at calls it on every step. */
static bool lr_valid(const ts_lr_schedule *s, char *why, size_t cap)
{
#define LR_BAD(...) (why ? (void)snprintf(why, cap, __VA_ARGS__) : (void)0, false)
    if ((unsigned)s->kind >= TS_LR_KIND_COUNT)
        return LR_BAD("unknown kind %d (TS_LR_CONSTANT .. TS_LR_WARMUP_STABLE_DECAY)", (int)s->kind);
    const char *k = lr_kind_names[s->kind];
    if (!isfinite(s->base_lr) || s->base_lr < 0)
        return LR_BAD("%s: base_lr %g is not a finite value >= 0", k, s->base_lr);
    if (lr_has_warmup(s->kind) && s->warmup_steps < 0)
        return LR_BAD("%s: warmup_steps %lld is negative (0: no warmup)", k, (long long)s->warmup_steps);
    if (lr_has_decay(s->kind)) {
        if (!isfinite(s->min_lr) || s->min_lr < 0)
            return LR_BAD("%s: min_lr %g is not a finite value >= 0", k, s->min_lr);
        if (s->total_steps < 0)
            return LR_BAD("%s: total_steps %lld is negative", k, (long long)s->total_steps);
        if (s->warmup_steps > s->total_steps)
            return LR_BAD("%s: warmup_steps %lld is more than total_steps %lld (the decay would end before the "
                          "warmup does)",
                          k, (long long)s->warmup_steps, (long long)s->total_steps);
    }
    if (s->kind == TS_LR_WARMUP_STABLE_DECAY && !(s->decay_fraction >= 0 && s->decay_fraction <= 1))
        return LR_BAD("%s: decay_fraction %g is not in [0, 1]", k, s->decay_fraction);
    return true;
#undef LR_BAD
}

ts_status ts_lr_schedule_check(const ts_lr_schedule *s)
{
    if (!s)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "lr schedule: NULL schedule");
    char why[256];
    if (!lr_valid(s, why, sizeof why))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "lr schedule %s", why);
    return TS_OK;
}

/* base_lr at `from`, a straight line to min_lr at `to` (from < to), min_lr
 * from `to` on. */
static double lr_line(const ts_lr_schedule *s, int64_t step, int64_t from, int64_t to)
{
    if (step >= to)
        return s->min_lr;
    return s->min_lr + (s->base_lr - s->min_lr) * (double)(to - step) / (double)(to - from);
}

double ts_lr_at(const ts_lr_schedule *s, int64_t step)
{
    if (!s)
        return NAN;
    if (step < 0)
        step = 0;
    switch (s->kind) {
    case TS_LR_CONSTANT:
        return s->base_lr;
    case TS_LR_WARMUP_COSINE: {
        if (step < s->warmup_steps)
            return s->base_lr * ((double)step + 1.0) / (double)s->warmup_steps;
        if (step >= s->total_steps)
            return s->min_lr;
        int64_t w = s->warmup_steps > 0 ? s->warmup_steps : 0;
        double progress = (double)(step - w) / (double)(s->total_steps - w);
        const double pi = 3.14159265358979323846;
        return s->min_lr + 0.5 * (s->base_lr - s->min_lr) * (1.0 + cos(pi * progress));
    }
    case TS_LR_WARMUP_CONSTANT:
    case TS_LR_WARMUP_LINEAR:
    case TS_LR_WARMUP_STABLE_DECAY:
        break;
    case TS_LR_KIND_COUNT:
        return NAN;
    }
    if (!lr_valid(s, NULL, 0))
        return NAN;
    if (step < s->warmup_steps)
        return s->base_lr * ((double)step + 1.0) / (double)s->warmup_steps;
    if (s->kind == TS_LR_WARMUP_CONSTANT)
        return s->base_lr;
    if (s->kind == TS_LR_WARMUP_LINEAR)
        return lr_line(s, step, s->warmup_steps, s->total_steps);
    /* WSD: the decay over the last D steps, never into the warmup */
    int64_t d = llround(s->decay_fraction * (double)s->total_steps);
    int64_t start = s->total_steps - d > s->warmup_steps ? s->total_steps - d : s->warmup_steps;
    if (step < start)
        return s->base_lr;
    return lr_line(s, step, start, s->total_steps);
}

/* --------------------------------------------------------------- clipping */

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
    for (int64_t i = 0; i < n; i++)
        memcpy(dst + (size_t)i * es, src + (size_t)(i * sp) * es, es);
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
    for (int64_t i = 0; i < n; i++)
        ts__buf_scale(s->dt, (unsigned char *)p + (size_t)(i * sp) * es, 1, s->coef);
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
        walk_rows(g, g, gather_row, &k);
        x = tmp;
    }
    if (half) {
        float *f = (float *)((unsigned char *)tmp + (gather ? (size_t)n * es : 0));
        ts__buf_convert(TS_F32, f, dt, x, n);
        x = f;
    }
    *norm_out = dt == TS_F64 ? ts__buf_norm2_f64_on(norm_path(), x, n) : (double)ts__buf_norm2_f32_on(norm_path(), x, n);
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
    if (!n32)
        return TS_ERR_NO_MEMORY;
    for (int i = 0; i < n; i++)
        n32[i] = (float)norms[i];
    *total_out = (double)ts__buf_norm2_f32_on(norm_path(), n32, n);
    ts__free(TS_MEM_NN, n32);
    return TS_OK;
}

double ts__optim_clip_coef(double total, double max_norm, bool any_f64)
{
    /* clip_coef = max_norm / (total_norm + 1e-6), i.e. Tensor.__rdiv__:
     * (total + 1e-6).reciprocal() * max_norm, in the stack's dtype */
    if (any_f64)
        return (1.0 / (total + 1e-6)) * max_norm;
    float t = (float)total + (float)1e-6;
    return (double)((1.0f / t) * (float)max_norm);
}

void ts__optim_scale_grad(ts_tensor *g, double coef)
{
    scale_k k = {ts_tensor_dtype(g), coef};
    walk_rows(g, g, scale_row, &k);
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
        if (!params[i])
            return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: parameter %d is NULL", who, i);
        ts_tensor *g = ts_tensor_grad(params[i]);
        if (!g)
            continue;
        ts_dtype dt = ts_tensor_dtype(g);
        if (dt != TS_F32 && dt != TS_F64)
            return ts_error(TS_ERR_DTYPE, "%s: the gradient of %s has dtype %s; float32 or float64 expected", who,
                            param_label(i, params[i], lab, sizeof lab), ts_dtype_name(dt));
        if (ts__is_meta(g) && !ts__meta_mode()) {
            char s1[96];
            return ts_error(TS_ERR_STATE, "%s: the gradient of %s %s is on the meta device (it has no data): "
                                          "materialize the model or load a checkpoint first", who,
                            param_label(i, params[i], lab, sizeof lab), ts_tensor_shape_str(g, s1, sizeof s1));
        }
        any_meta |= ts__is_meta(g);
        if (ts_tensor_numel(g) > 0 && !ts_tensor_data(g) && !ts__is_meta(g))
            return ts_error(TS_ERR_RELEASED, "%s: the gradient of %s has released storage", who,
                            param_label(i, params[i], lab, sizeof lab));
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
    if (!norms)
        return TS_ERR_NO_MEMORY;
    ts_status st = TS_OK;
    for (int i = 0, j = 0; i < n && !st; i++) {
        ts_tensor *g = ts_tensor_grad(params[i]);
        if (g && !(st = ts__optim_grad_norm(g, &norms[j])))
            j++;
    }
    double total = 0;
    if (!st)
        st = ts__optim_total_norm(ng, norms, any_f64, &total);
    ts__free(TS_MEM_NN, norms);
    if (st)
        return st;
    if (!isfinite(total))
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "%s: the total norm of order 2 of the gradients is non-finite (%g), so it cannot be "
                        "clipped; the gradients were left unchanged", who, total);
    /* grads are multiplied by min(clip_coef, 1); multiplying by exactly
     * 1.0 changes nothing, so that case is skipped. */
    double coef = ts__optim_clip_coef(total, max_norm, any_f64);
    if (coef < 1.0) {
        for (int i = 0; i < n; i++) {
            ts_tensor *g = ts_tensor_grad(params[i]);
            if (g)
                ts__optim_scale_grad(g, coef);
        }
    }
    *total_norm_out = total;
    return TS_OK;
}
