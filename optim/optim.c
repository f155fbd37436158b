/*
 * SGD, Adam and AdamW (optim.h): the options, the optimizer object and its
 * per-parameter state, the checks of a step and its dispatch to the
 * kernels, and the accessors (lr, step count, state) checkpoints use.
 *
 * The other files of the layer: kernels.c (the update kernels, their
 * bit-exactness against torch and the row walk), fused.c (the fused step),
 * schedule.c (learning-rate schedules), clip.c (clip_grad_norm_); what
 * they share is in optim_internal.h (the hooks for other layers are in
 * internal.h).
 */
#define _GNU_SOURCE
#include "optim/optim_internal.h"
#include "tensor/internal.h"
#include "tensor/kernels.h"

#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

/* ---------------------------------------------------------------- options */

ts_sgd_options ts_sgd_options_default(void) { return (ts_sgd_options){.lr = 1e-3}; }

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

static const char *const kind_names[] = {"SGD", "Adam", "AdamW"};

/* "parameter 3 ('fc.weight')" or "parameter 3" */
const char *ts__optim_param_label(int i, const ts_tensor *t, char *buf, size_t len)
{
    const char *name = t ? ts_tensor_name(t) : "";
    if (name[0]) snprintf(buf, len, "parameter %d ('%s')", i, name);
    else snprintf(buf, len, "parameter %d", i);
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
        if (!t) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: parameter %d is NULL", who, i);
        ts_dtype dt = ts_tensor_dtype(t);
        if (dt != TS_F32 && dt != TS_F64)
            return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %s has dtype %s; float32 or float64 expected", who,
                            ts__optim_param_label(i, t, lab, sizeof lab), ts_dtype_name(dt));
        if (!ts_tensor_requires_grad(t))
            return ts_error(TS_ERR_INVALID_ARGUMENT,
                            "%s: %s does not require grad; only tensors that require grad can be optimized", who,
                            ts__optim_param_label(i, t, lab, sizeof lab));
        if (!ts_tensor_is_leaf(t))
            return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %s is not a leaf; can't optimize a non-leaf tensor", who,
                            ts__optim_param_label(i, t, lab, sizeof lab));
        const int64_t *shape = ts_tensor_shape(t), *strides = ts_tensor_strides(t);
        for (int d = 0; d < ts_tensor_ndim(t); d++)
            if (shape[d] > 1 && strides[d] == 0)
                return ts_error(TS_ERR_INVALID_ARGUMENT,
                                "%s: %s has overlapping memory (stride 0 in dim %d, an expanded view); an in-place "
                                "update would write one element several times",
                                who, ts__optim_param_label(i, t, lab, sizeof lab), d);
        for (int j = 0; j < i; j++)
            if (params[j] == t)
                return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %s appears twice in the parameter list (also at %d)", who,
                                ts__optim_param_label(i, t, lab, sizeof lab), j);
    }
    return TS_OK;
}

static ts_status optim_new(opt_kind kind, int n, ts_tensor *const *params, ts_optim **out)
{
    const char *who = kind_names[kind];
    ts_status st = check_params(who, n, params);
    if (st) return st;
    ts_optim *o = ts__calloc(TS_MEM_NN, 1, sizeof *o);
    if (!o) return TS_ERR_NO_MEMORY;
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
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "SGD: out is NULL");
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
                        "dampening %g)",
                        o.momentum, o.dampening);
    ts_optim *opt;
    ts_status st = optim_new(OPT_SGD, n, params, &opt);
    if (st) return st;
    opt->sgd = o;
    opt->lr = o.lr;
    opt->fused = o.fused;
    *out = opt;
    return TS_OK;
}

static ts_status adam_new(opt_kind kind, int n, ts_tensor *const *params, const ts_adam_options *opts, ts_optim **out)
{
    const char *who = kind_names[kind];
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: out is NULL", who);
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
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: invalid weight_decay %g (must be >= 0)", who, o.weight_decay);
    ts_optim *opt;
    ts_status st = optim_new(kind, n, params, &opt);
    if (st) return st;
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
    if (!o) return;
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
        if (o->sgd.momentum != 0) slots_out[n++] = &pp->momentum_buffer;
        return n;
    }
    slots_out[n++] = &pp->exp_avg;
    slots_out[n++] = &pp->exp_avg_sq;
    if (o->adam.amsgrad) slots_out[n++] = &pp->max_exp_avg_sq;
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
        if (!any) continue;
        ts_tensor **probe[3];
        int ns = elementwise_slots(o, &o->p[0], probe);
        bool meta = false; /* the state is made where the parameters are (meta if any is) */
        for (int i = 0; i < o->n; i++) meta |= ts_tensor_dtype(o->p[i].local) == dts[d] && ts__is_meta(o->p[i].local);
        for (int s = 0; s < ns && !st; s++) {
            ts_tensor *arena = NULL;
            if ((st = ts_device_scope_enter(meta ? TS_DEVICE_META : TS_DEVICE_CPU))) break;
            st = ts_tensor_zeros(dts[d], 1, &total, &arena);
            ts_device_scope_exit();
            if (st) break;
            int64_t off = 0;
            for (int i = 0; i < o->n && !st; i++) {
                opt_param *pp = &o->p[i];
                if (ts_tensor_dtype(pp->local) != dts[d]) continue;
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
    if (st) return st;
    st = alloc_state_on(o, i);
    ts_device_scope_exit();
    return st;
}

static ts_status alloc_state_on(ts_optim *o, int i)
{
    opt_param *pp = &o->p[i];
    if (o->fused && !o->arenas) {
        ts_status ast = alloc_arenas(o);
        if (ast) return ast;
    }
    ts_tensor *t = pp->local;
    ts_dtype dt = ts_tensor_dtype(t);
    int nd = ts_tensor_ndim(t);
    const int64_t *shape = ts_tensor_shape(t);
    ts_status st = TS_OK;
    if (o->kind == OPT_SGD) {
        if (has_momentum_state(o) && !pp->momentum_buffer) st = ts_tensor_zeros(dt, nd, shape, &pp->momentum_buffer);
        return st;
    }
    if (!pp->step && (st = ts_tensor_zeros(TS_F32, 0, NULL, &pp->step))) return st;
    if (!pp->exp_avg && (st = ts_tensor_zeros(dt, nd, shape, &pp->exp_avg))) return st;
    if (!pp->exp_avg_sq && (st = ts_tensor_zeros(dt, nd, shape, &pp->exp_avg_sq))) return st;
    if (o->adam.amsgrad && !pp->max_exp_avg_sq && (st = ts_tensor_zeros(dt, nd, shape, &pp->max_exp_avg_sq))) return st;
    return TS_OK;
}

/* ------------------------------------------------------------------- step */

static ts_status check_grad(const ts_optim *o, int i, const ts_tensor *g)
{
    const opt_param *pp = &o->p[i];
    const char *who = kind_names[o->kind];
    char lab[160], s1[96], s2[96];
    if (ts_tensor_dtype(g) != ts_tensor_dtype(pp->local))
        return ts_error(TS_ERR_DTYPE, "%s step: %s has a %s gradient for %s data", who,
                        ts__optim_param_label(i, pp->param, lab, sizeof lab), ts_dtype_name(ts_tensor_dtype(g)),
                        ts_dtype_name(ts_tensor_dtype(pp->local)));
    int nd = ts_tensor_ndim(g);
    if (nd != ts_tensor_ndim(pp->local) ||
        memcmp(ts_tensor_shape(g), ts_tensor_shape(pp->local), (size_t)nd * sizeof(int64_t)) != 0)
        return ts_error(TS_ERR_SHAPE, "%s step: %s has gradient shape %s but its data has shape %s", who,
                        ts__optim_param_label(i, pp->param, lab, sizeof lab), ts_tensor_shape_str(g, s1, sizeof s1),
                        ts_tensor_shape_str(pp->local, s2, sizeof s2));
    if (ts__is_meta(pp->local) || ts__is_meta(g)) {
        /* a meta step allocates the state and computes nothing; outside a
         * meta scope it is refused, as ops refuse meta inputs */
        if (!ts__meta_mode())
            return ts_error(TS_ERR_STATE,
                            "%s step: %s%s %s is on the meta device (it has no data): materialize "
                            "the model or load a checkpoint first (inside ts_device_scope_enter("
                            "TS_DEVICE_META) a step only allocates its state)",
                            who, ts__is_meta(pp->local) ? "" : "the gradient of ",
                            ts__optim_param_label(i, pp->param, lab, sizeof lab),
                            ts_tensor_shape_str(ts__is_meta(pp->local) ? pp->local : g, s1, sizeof s1));
        if (ts_storage_is_released(ts_tensor_storage(pp->local)) || ts_storage_is_released(ts_tensor_storage(g)))
            return ts_error(TS_ERR_RELEASED, "%s step: %s or its gradient has released storage", who,
                            ts__optim_param_label(i, pp->param, lab, sizeof lab));
        return TS_OK;
    }
    if (ts_tensor_numel(pp->local) > 0 && !ts_tensor_data(pp->local))
        return ts_error(TS_ERR_RELEASED, "%s step: %s has released storage", who,
                        ts__optim_param_label(i, pp->param, lab, sizeof lab));
    if (ts_tensor_numel(g) > 0 && !ts_tensor_data(g))
        return ts_error(TS_ERR_RELEASED, "%s step: the gradient of %s has released storage", who,
                        ts__optim_param_label(i, pp->param, lab, sizeof lab));
    return TS_OK;
}

/* The SGD kernel's arguments for parameter pp's update this step. */
sgd_k ts__optim_sgd_args(const ts_optim *o, const opt_param *pp)
{
    const ts_sgd_options *s = &o->sgd;
    return (sgd_k){.lr = o->lr,
                   .wd = s->weight_decay,
                   .momentum = s->momentum,
                   .damp1 = 1.0 - s->dampening,
                   .nesterov = s->nesterov,
                   .maximize = s->maximize,
                   .first = !pp->ready,
                   .buf = pp->momentum_buffer ? ts_tensor_data(pp->momentum_buffer) : NULL};
}

/* Counts parameter pp's step (its "step" state += 1, a float32 as torch's)
 * and returns the Adam kernel's arguments for it. */
adam_k ts__optim_adam_args(const ts_optim *o, opt_param *pp)
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
                    .beta1 = a->beta1,
                    .omb1 = 1.0 - a->beta1,
                    .beta2 = a->beta2,
                    .omb2 = 1.0 - a->beta2,
                    .bc2_sqrt = sqrt(bc2),
                    .eps = a->eps,
                    .neg_step_size = -step_size,
                    .adamw = o->kind == OPT_ADAMW,
                    .amsgrad = a->amsgrad,
                    .maximize = a->maximize,
                    .exp_avg = ts_tensor_data(pp->exp_avg),
                    .exp_avg_sq = ts_tensor_data(pp->exp_avg_sq),
                    .max_exp_avg_sq = pp->max_exp_avg_sq ? ts_tensor_data(pp->max_exp_avg_sq) : NULL};
}

static void sgd_update(ts_optim *o, opt_param *pp, ts_tensor *g)
{
    sgd_k k = ts__optim_sgd_args(o, pp);
    ts__optim_walk_rows(pp->local, g, ts__optim_sgd_kernel(ts_tensor_dtype(pp->local) == TS_F32), &k);
    pp->ready = true;
}

static void adam_update(ts_optim *o, opt_param *pp, ts_tensor *g)
{
    adam_k k = ts__optim_adam_args(o, pp);
    ts__optim_walk_rows(pp->local, g, ts__optim_adam_kernel(ts_tensor_dtype(pp->local) == TS_F32), &k);
    pp->ready = true;
}

ts_status ts_optim_step(ts_optim *o)
{
    if (!o) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_optim_step: optimizer is NULL");
    ts_status st;
    /* Everything is checked and allocated before any value changes, so a
     * failed step leaves parameters and state as they were. */
    ts__optim_param_check_fn check = atomic_load(&g_param_check);
    if (check && (st = check(kind_names[o->kind], o->n, o->params, o->steps == 0))) return st;
    int n_grads = 0;
    for (int i = 0; i < o->n; i++) {
        ts_tensor *g = ts_tensor_grad(o->p[i].param);
        if (g && (st = check_grad(o, i, g))) return st;
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
        if (ts_tensor_grad(o->p[i].param) && (st = alloc_state(o, i))) return st;
    TS_TRACE_BEGIN(t0);
    if (o->fused) ts__optim_fused_step(o);
    for (int i = 0; i < o->n && !o->fused; i++) {
        opt_param *pp = &o->p[i];
        ts_tensor *g = ts_tensor_grad(pp->param);
        if (!g) continue;                                               /* torch skips parameters whose .grad is None */
        if (ts__is_meta(pp->local) || ts__is_meta(g)) pp->ready = true; /* meta: state allocated, nothing to compute */
        else if (o->kind == OPT_SGD) sgd_update(o, pp, g);
        else adam_update(o, pp, g);
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
    if (!o) return;
    for (int i = 0; i < o->n; i++) ts_tensor_zero_grad(o->p[i].param, set_to_none);
}

double ts_optim_get_lr(const ts_optim *o) { return o ? o->lr : NAN; }

void ts_optim_set_lr(ts_optim *o, double lr)
{
    if (!o) return;
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
        if (has_momentum_state(o)) names_out[n++] = "momentum_buffer";
        return n;
    }
    names_out[n++] = "step";
    names_out[n++] = "exp_avg";
    names_out[n++] = "exp_avg_sq";
    if (o->adam.amsgrad) names_out[n++] = "max_exp_avg_sq";
    return n;
}

void ts__optim_set_step_count(ts_optim *o, int64_t steps) { o->steps = steps; }

const char *ts_optim_kind_name(const ts_optim *o) { return o ? ts__optim_kind_name(o) : NULL; }

int ts_optim_num_states(const ts_optim *o)
{
    const char *names[4];
    return o ? ts__optim_state_names(o, names) : 0;
}

const char *ts_optim_state_name(const ts_optim *o, int i)
{
    const char *names[4];
    int n = o ? ts__optim_state_names(o, names) : 0;
    return i >= 0 && i < n ? names[i] : NULL;
}

ts_status ts_optim_set_step_count(ts_optim *o, int64_t steps)
{
    if (!o) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_optim_set_step_count: the optimizer is NULL");
    if (steps < 0)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_optim_set_step_count: steps %lld < 0", (long long)steps);
    ts__optim_set_step_count(o, steps);
    return TS_OK;
}

ts_status ts_optim_hparams_get(const ts_optim *o, ts_optim_hparams *out)
{
    if (!o || !out) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_optim_hparams_get: NULL argument");
    ts__optim_hparams hp;
    ts__optim_hparams_get(o, &hp);
    *out = (ts_optim_hparams){.sgd = hp.sgd,
                              .lr = hp.lr,
                              .momentum = hp.momentum,
                              .dampening = hp.dampening,
                              .weight_decay = hp.weight_decay,
                              .beta1 = hp.beta1,
                              .beta2 = hp.beta2,
                              .eps = hp.eps,
                              .nesterov = hp.nesterov,
                              .amsgrad = hp.amsgrad,
                              .maximize = hp.maximize};
    return TS_OK;
}

int ts__optim_fused_calls(const ts_optim *o) { return o && o->fused ? o->last_calls : -1; }

int ts_optim_num_params(const ts_optim *o) { return o ? o->n : 0; }

ts_tensor *ts_optim_param(const ts_optim *o, int i) { return o && i >= 0 && i < o->n ? o->params[i] : NULL; }

/* The slot of state `name` for this optimizer, NULL if it has none. */
static ts_tensor **state_slot(ts_optim *o, int i, const char *name)
{
    opt_param *pp = &o->p[i];
    if (o->kind == OPT_SGD)
        return has_momentum_state(o) && !strcmp(name, "momentum_buffer") ? &pp->momentum_buffer : NULL;
    if (!strcmp(name, "step")) return &pp->step;
    if (!strcmp(name, "exp_avg")) return &pp->exp_avg;
    if (!strcmp(name, "exp_avg_sq")) return &pp->exp_avg_sq;
    if (!strcmp(name, "max_exp_avg_sq") && o->adam.amsgrad) return &pp->max_exp_avg_sq;
    return NULL;
}

ts_tensor *ts_optim_state(const ts_optim *o, int param_index, const char *name)
{
    if (!o || !name || param_index < 0 || param_index >= o->n || !o->p[param_index].ready) return NULL;
    ts_tensor **slot = state_slot((ts_optim *)o, param_index, name);
    return slot ? *slot : NULL;
}

ts_status ts_optim_state_create(ts_optim *o, int param_index, const char *name, ts_tensor **state_out)
{
    if (!o || !name || !state_out) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_optim_state_create: NULL argument");
    if (param_index < 0 || param_index >= o->n)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: parameter index %d out of range [0, %d)", kind_names[o->kind],
                        param_index, o->n);
    ts_tensor **slot = state_slot(o, param_index, name);
    if (!slot)
        return ts_error(TS_ERR_NOT_FOUND, "%s: no state named '%s' in this optimizer", kind_names[o->kind], name);
    ts_status st = alloc_state(o, param_index);
    if (st) return st;
    o->p[param_index].ready = true;
    *state_out = *slot;
    return TS_OK;
}
