/*
 * tensorshard optim layer: SGD, Adam and AdamW with PyTorch's exact update
 * formulas and defaults, zero_grad, learning-rate schedules and gradient
 * clipping.
 *
 * Exactness: a step computes, element by element, what torch 1.13's
 * single-tensor implementation (foreach=False: torch.optim.sgd.
 * _single_tensor_sgd, adam._single_tensor_adam, adamw._single_tensor_adamw,
 * capturable=False) computes on the CPU, with the same roundings: float32
 * parameters are updated in float32 with the Python-float hyperparameters
 * rounded to float32 where torch rounds them, and the fused multiply-adds
 * of the Debian/GCC AVX2 build (optim.c lists them). Trajectories are
 * bit-identical to torch 1.13 (tests/fixtures/optim). Per-parameter state
 * is kept as torch keeps it: a parameter's state is created at the first
 * step in which it has a gradient, and Adam's step counter is a float32
 * scalar per parameter ("step"), so a parameter skipped in some steps gets
 * its own bias correction, as in torch.
 *
 * Lifetime rules
 * - An optimizer holds references to the parameter tensors it was given
 *   (local shards under fully_shard: it works on their local data through
 *   ts_tensor_local_view, and reads ts_tensor_grad of the shard, a plain
 *   tensor) and owns its per-parameter state. Free it with ts_optim_free.
 * - Steps run without recording autograd history and make one pass over
 *   each parameter, its gradient and its state (no temporaries).
 *   Parameters and gradients may be non-contiguous views.
 *
 * Threads: an optimizer is used by one thread at a time; different
 * optimizers (over different parameters) may step concurrently.
 */
#ifndef TS_OPTIM_H
#define TS_OPTIM_H

#include "tensor/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ts_optim ts_optim;

/* torch.optim.SGD's arguments (torch has no default lr; ours is 1e-3). */
typedef struct ts_sgd_options {
    double lr;           /* > 0; default 1e-3 */
    double momentum;     /* >= 0; default 0 */
    double dampening;    /* default 0 */
    double weight_decay; /* >= 0, L2 added to the gradient; default 0 */
    bool nesterov;       /* false (needs momentum > 0 and dampening 0) */
    bool maximize;       /* false */
    bool fused;          /* false; true: the fused multi-tensor step (below) */
} ts_sgd_options;
TS_API ts_sgd_options ts_sgd_options_default(void);

/* torch.optim.Adam / AdamW's arguments. */
typedef struct ts_adam_options {
    double lr;           /* > 0; 1e-3 (AdamW default too) */
    double beta1, beta2; /* each in [0, 1); 0.9, 0.999 */
    double eps;          /* >= 0; 1e-8 */
    double weight_decay; /* Adam: 0 (L2 added to the gradient); AdamW: 1e-2 (decoupled) */
    bool amsgrad;        /* false */
    bool maximize;       /* false */
    bool fused;          /* false; true: the fused multi-tensor step (below) */
} ts_adam_options;
TS_API ts_adam_options ts_adam_options_default(void);
TS_API ts_adam_options ts_adamw_options_default(void);

/* fused (torch's fused=True, on the CPU): the optimizer keeps each state
 * ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer") of all
 * its parameters of one dtype in one contiguous buffer, laid out in the
 * order the parameters were given (each parameter's state is a contiguous
 * view of it, with the same names, shapes and first-step presence as
 * without fused, so checkpoints are the same), allocated whole at the
 * first step; and a step updates each run of parameters whose data,
 * gradients and state are adjacent in memory (parameters that are views
 * of one buffer, such as an FSDP group's shards without padding, with
 * gradients that are views of one buffer, and the same step count) by one
 * call of the vectorized kernel (AVX-512, AVX2 or scalar as tensor/
 * kernels.h chooses at run time), the others one by one. The values are
 * bit-identical to fused false for every option. */

/* New optimizers over n >= 1 parameters, which must be distinct leaf tensors
 * that require grad, of dtype f32 or f64 (they may be shard-marked). `o`
 * NULL means the defaults. Returns TS_ERR_INVALID_ARGUMENT, with the index
 * and name of the parameter or the value that does not fit, for: n < 1, a
 * NULL, non-float, non-leaf, repeated or not-requiring-grad parameter, or
 * one with overlapping memory (an expanded view);
 * lr <= 0, momentum < 0, weight_decay < 0, nesterov without momentum > 0
 * and dampening 0 (SGD); beta outside [0, 1), eps < 0 (Adam/AdamW); any
 * non-finite value. TS_ERR_NO_MEMORY. *out is written only on success. */
TS_API ts_status ts_sgd_new(int n, ts_tensor *const *params, const ts_sgd_options *o, ts_optim **out);
TS_API ts_status ts_adam_new(int n, ts_tensor *const *params, const ts_adam_options *o, ts_optim **out);
TS_API ts_status ts_adamw_new(int n, ts_tensor *const *params, const ts_adam_options *o, ts_optim **out);
/* Frees the state and drops the parameter references. Accepts NULL. */
TS_API void ts_optim_free(ts_optim *o);

/* One update of every parameter that has a gradient (ts_tensor_grad not
 * NULL); parameters without one are skipped and their state is untouched,
 * as in PyTorch. Everything is checked before anything changes, so on an
 * error parameters and state are as before: TS_ERR_SHAPE (a gradient's
 * shape differs from its parameter's local shape) and TS_ERR_DTYPE (its
 * dtype differs), naming the parameter; TS_ERR_RELEASED (a parameter or
 * gradient storage is released); TS_ERR_NO_MEMORY (first-step state). */
TS_API ts_status ts_optim_step(ts_optim *o);
/* Meta parameters (docs/meta.md): a parameter's state is made on its
 * device (as torch's zeros_like), so a meta parameter's state is meta, on
 * the meta ledger of the stepping thread. Inside a meta scope
 * (ts_device_scope_enter(TS_DEVICE_META)) a step over meta parameters or
 * meta gradients allocates that state at the first step, as a CPU step
 * does, counts the step, and computes nothing; outside one it returns
 * TS_ERR_STATE naming the parameter ("... is on the meta device (it has no
 * data): materialize the model or load a checkpoint first"). */
/* Drops (set_to_none, PyTorch's default) or zeroes every parameter's grad. */
TS_API void ts_optim_zero_grad(ts_optim *o, bool set_to_none);
/* The learning rate the next step uses (param_groups[0]['lr']). */
TS_API double ts_optim_get_lr(const ts_optim *o);
/* Sets it; any finite lr >= 0 is accepted (a schedule may reach 0); other
 * values are ignored with a warning in the log. */
TS_API void ts_optim_set_lr(ts_optim *o, double lr);
/* Number of completed ts_optim_step calls. */
TS_API int64_t ts_optim_step_count(const ts_optim *o);
/* The number of parameters the optimizer was made with (0 for NULL), and
 * parameter i of them (borrowed; NULL for NULL or i out of range), as
 * torch's optimizer.param_groups[0]["params"]. */
TS_API int ts_optim_num_params(const ts_optim *o);
TS_API ts_tensor *ts_optim_param(const ts_optim *o, int i);
/* Borrowed per-parameter state tensors, as in torch's optimizer.state[p]:
 * SGD with momentum: "momentum_buffer"; Adam/AdamW: "step" (0-d float32,
 * the number of steps this parameter took), "exp_avg", "exp_avg_sq", and
 * "max_exp_avg_sq" with amsgrad. Each has the parameter's local shape and
 * dtype and is contiguous. NULL for an unknown name or index, or before
 * the parameter's first step (torch's state is empty then). The values may
 * be written (checkpoint load). */
TS_API ts_tensor *ts_optim_state(const ts_optim *o, int param_index, const char *name);
/* For loading a checkpoint into a fresh optimizer: creates parameter
 * `param_index`'s state now if it has none (as its first step would:
 * zeros, step 0; SGD's momentum buffer zeros) and writes the borrowed
 * tensor `name` to *state_out, for the caller to fill. Afterwards the state
 * counts as present, as after torch's load_state_dict: SGD's next step
 * updates the buffer instead of starting it from the gradient.
 * TS_ERR_INVALID_ARGUMENT (NULL or index out of range), TS_ERR_NOT_FOUND
 * (no such state in this optimizer, e.g. "max_exp_avg_sq" without amsgrad
 * or "momentum_buffer" with momentum 0), TS_ERR_NO_MEMORY. */
TS_API ts_status ts_optim_state_create(ts_optim *o, int param_index, const char *name, ts_tensor **state_out);
/* The optimizer's class as torch names it: "SGD", "Adam" or "AdamW" (a
 * static string; NULL for NULL). */
TS_API const char *ts_optim_kind_name(const ts_optim *o);
/* The number of per-parameter states o keeps (0 for NULL), and the name
 * of state i of them in torch's order (a static string; NULL for NULL or
 * i out of range): SGD with momentum "momentum_buffer" (none without);
 * Adam/AdamW "step", "exp_avg", "exp_avg_sq", then "max_exp_avg_sq" with
 * amsgrad. Each parameter has these once created (ts_optim_state). */
TS_API int ts_optim_num_states(const ts_optim *o);
TS_API const char *ts_optim_state_name(const ts_optim *o, int i);
/* Sets the number of completed steps (ts_optim_step_count), as loading a
 * checkpoint does; the parameters' own "step" states are not changed.
 * TS_ERR_INVALID_ARGUMENT for NULL or steps < 0. */
TS_API ts_status ts_optim_set_step_count(ts_optim *o, int64_t steps);
/* The hyperparameters of o, as torch's param_groups[0] holds them: lr is
 * the current one (ts_optim_get_lr); sgd is true for SGD (then momentum,
 * dampening, weight_decay, nesterov and maximize are its, the rest 0),
 * false for Adam / AdamW (beta1, beta2, eps, weight_decay, amsgrad,
 * maximize). Writes *out. TS_ERR_INVALID_ARGUMENT for NULL. */
typedef struct ts_optim_hparams {
    bool sgd;
    double lr, momentum, dampening, weight_decay, beta1, beta2, eps;
    bool nesterov, amsgrad, maximize;
} ts_optim_hparams;
TS_API ts_status ts_optim_hparams_get(const ts_optim *o, ts_optim_hparams *out);

/* Learning-rate schedules: the lr to use for step `step` (0-based, the
 * number of steps already taken), in double precision. Every kind but
 * TS_LR_CONSTANT starts with the same linear warmup over warmup_steps W:
 *
 *     step < W:  base_lr * (step + 1) / W
 *     (base_lr / W at step 0, base_lr at step W - 1; W = 0: no warmup)
 *
 * and then, with T = total_steps:
 *
 *   TS_LR_CONSTANT       base_lr at every step (no warmup: warmup_steps,
 *                        total_steps and min_lr are not read)
 *   TS_LR_WARMUP_COSINE  step >= T: min_lr; otherwise, with p = (step - W)
 *                        / (T - W), in [0, 1):
 *                            min_lr + 0.5 * (base_lr - min_lr) * (1 + cos(pi * p))
 *                        (base_lr at step W, falling to min_lr at T and
 *                        staying there)
 *   TS_LR_WARMUP_CONSTANT  base_lr from step W on (total_steps and min_lr
 *                        are not read)
 *   TS_LR_WARMUP_LINEAR  step >= T: min_lr; otherwise
 *                            min_lr + (base_lr - min_lr) * (T - step) / (T - W)
 *                        (base_lr at step W, a straight line to min_lr at T)
 *   TS_LR_WARMUP_STABLE_DECAY  (WSD) warmup, then base_lr, then a linear
 *                        decay over the last D = round(decay_fraction * T)
 *                        steps (to nearest; decay_fraction in [0, 1]),
 *                        starting at S = max(W, T - D) (a decay longer than
 *                        what the warmup leaves starts right after it):
 *                            W <= step < S:  base_lr
 *                            S <= step < T:  min_lr + (base_lr - min_lr) * (T - step) / (T - S)
 *                            step >= T:      min_lr
 *                        decay_fraction 1 is TS_LR_WARMUP_LINEAR; 0 holds
 *                        base_lr until T, then min_lr.
 *
 * torch 1.13's schedulers give the same values (tests/optim/
 * test_lr_schedule.c): the warmup is LinearLR(start_factor=1/W,
 * end_factor=1, total_iters=W-1); the cosine CosineAnnealingLR(T_max=T-W,
 * eta_min=min_lr), the linear decay LinearLR(1, min_lr/base_lr, T-W),
 * chained after the warmup by SequentialLR(milestones=[W]).
 *
 * Bad input: a negative `step` counts as 0 for every kind. A schedule
 * that ts_lr_schedule_check refuses gives NaN (never a guess), except for
 * the two original kinds, which keep the results they always had:
 * TS_LR_CONSTANT is base_lr whatever it is, and TS_LR_WARMUP_COSINE
 * treats warmup_steps <= 0 as no warmup and follows the formulas above for
 * any values (warmup_steps > total_steps: the warmup, then min_lr). NaN
 * for a NULL schedule or an unknown kind. Pure function, any thread.
 * Typical use, after ts_lr_schedule_check once, before each step:
 * ts_optim_set_lr(o, ts_lr_at(&s, ts_optim_step_count(o))). */
typedef enum ts_lr_kind {
    TS_LR_CONSTANT = 0,
    TS_LR_WARMUP_COSINE,
    TS_LR_WARMUP_CONSTANT,
    TS_LR_WARMUP_LINEAR,
    TS_LR_WARMUP_STABLE_DECAY,
    TS_LR_KIND_COUNT
} ts_lr_kind;
/* Fields are only ever appended (decay_fraction came last): initialize
 * with designated initializers, {.kind = ..., .base_lr = ...}, and the
 * fields not named are 0. */
typedef struct ts_lr_schedule {
    ts_lr_kind kind;
    double base_lr;        /* the peak: finite, >= 0 */
    int64_t warmup_steps;  /* linear from base_lr/warmup (step 0) to base_lr; >= 0 */
    int64_t total_steps;   /* the decay ends at min_lr here; >= warmup_steps */
    double min_lr;         /* finite, >= 0 */
    double decay_fraction; /* WSD: the last round(decay_fraction * total_steps) steps decay; in [0, 1] */
} ts_lr_schedule;
TS_API double ts_lr_at(const ts_lr_schedule *s, int64_t step);
/* Checks a schedule before use: TS_OK, or TS_ERR_INVALID_ARGUMENT with
 * ts_last_error() naming the field and its value, for a NULL schedule, an
 * unknown kind, and, among the fields the kind reads (see ts_lr_at), a
 * base_lr or min_lr that is NaN, infinite or negative, warmup_steps or
 * total_steps < 0, warmup_steps > total_steps, or a decay_fraction outside
 * [0, 1] (or NaN). Any thread. */
TS_API ts_status ts_lr_schedule_check(const ts_lr_schedule *s);

/* torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=2,
 * error_if_nonfinite=True) over the n tensors' gradients (those without a
 * gradient are left out; shard-marked tensors contribute their local
 * gradient only: a sharded caller must combine the ranks' norms itself).
 * The total is torch's: each gradient's 2-norm in its dtype, then the
 * 2-norm of those (float64 if any gradient is float64, else float32),
 * with torch's summation order for contiguous gradients. Then clip_coef =
 * max_norm / (total + 1e-6) clamped to at most 1, and every gradient is
 * multiplied by it in place (torch also multiplies by 1.0, which changes
 * nothing). Writes the total norm (0 when no tensor has a gradient).
 * A non-finite total returns TS_ERR_INVALID_ARGUMENT and leaves the
 * gradients unchanged. Also TS_ERR_INVALID_ARGUMENT for max_norm < 0 or
 * NaN or a NULL parameter, TS_ERR_DTYPE for a non-float gradient,
 * TS_ERR_RELEASED, TS_ERR_NO_MEMORY.
 * Meta gradients (docs/meta.md): inside a meta scope the total norm is
 * unknown; it writes 0, scales nothing and returns TS_OK (the CPU clip
 * takes no pool memory, so the memory a step replays is the same);
 * outside a meta scope a meta gradient is TS_ERR_STATE naming it. */
TS_API ts_status ts_clip_grad_norm(int n, ts_tensor *const *params, double max_norm, double *total_norm_out);

#ifdef __cplusplus
}
#endif
#endif /* TS_OPTIM_H */
