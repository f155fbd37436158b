/* Internal hooks of the optim layer (not installed). */
#ifndef TS_OPTIM_INTERNAL_H
#define TS_OPTIM_INTERNAL_H

#include "base/internal.h"
#include "optim/optim.h"

/* Test hook: when true, the update and norm kernels run their plain scalar
 * reference build (libm fma calls) instead of the AVX2 build. Both must
 * give bit-identical results; tests compare them. */
extern bool ts__optim_use_reference;

/* True when a vector build (AVX2 or AVX-512) of the update kernels is
 * used: tensor/kernels.h's active path is avx2 or above (the CPU has it,
 * TS_KERNELS and ts__kpath_force allow it) and the hook above is off. The
 * clipping norms are tensor/kernels.h's and follow the same path. */
bool ts__optim_avx2_active(void);
/* The build of the update kernels a step uses now: "scalar", "avx2" or
 * "avx512" (tensor/kernels.h's active path, capped by TS_KERNELS and
 * ts__kpath_force; "scalar" with the hook above on). */
const char *ts__optim_update_path_name(void);

/* clip_grad_norm's pieces, shared with fully_shard's
 * ts_fsdp_clip_grad_norm so that sharded and unsharded clipping compute
 * the same numbers (ts_clip_grad_norm is these four in a row):
 * - ts__optim_grad_norm: torch.norm(g, 2) of one float32 or float64
 *   gradient (any strides; a float32 result is exact as a double), the
 *   bits of torch 1.13's CPU kernel (tensor/kernels.h's ts__buf_norm2_*).
 *   A bfloat16 / float16 gradient (fully_shard's, which ts_clip_grad_norm
 *   does not take) is converted to float32, exactly, and normed as
 *   float32 (torch accumulates these in float too; its order for them is
 *   not reproduced). TS_ERR_NO_MEMORY without memory to gather a
 *   non-contiguous gradient or convert a 16-bit one.
 * - ts__optim_total_norm: torch.norm(torch.stack(norms), 2) of n
 *   per-gradient norms, the stack float64 if any_f64, else float32 (each
 *   norm rounded to float first); 0 for n == 0. TS_ERR_NO_MEMORY.
 * - ts__optim_clip_coef: max_norm / (total + 1e-6) as torch rounds it
 *   (Tensor.__rdiv__ in the stack's dtype); the caller clips when < 1.
 * - ts__optim_scale_grad: g.mul_(coef) in g's dtype (f32 multiplies by
 *   (float)coef; f64, bf16, f16 as tensor/kernels.h's ts__buf_scale). */
ts_status ts__optim_grad_norm(const ts_tensor *g, double *norm_out);
ts_status ts__optim_total_norm(int n, const double *norms, bool any_f64, double *total_out);
double ts__optim_clip_coef(double total, double max_norm, bool any_f64);
void ts__optim_scale_grad(ts_tensor *g, double coef);

/* Test and bench hook: how many kernel calls the last step of a fused
 * optimizer made (one per run of adjacent parameters, one per strided
 * parameter; 0 before its first step); -1 for NULL or an optimizer made
 * without fused. */
int ts__optim_fused_calls(const ts_optim *o);

/* A check an upper layer (fully_shard) installs: called by every
 * ts_optim_step, before anything changes, with the optimizer's name
 * ("AdamW"), its parameters as given, and whether this is its first step.
 * A non-OK status (with its detail) fails the step. One process-wide
 * check; installing again replaces it; NULL removes it. */
typedef ts_status (*ts__optim_param_check_fn)(const char *who, int n, ts_tensor *const *params, bool first_step);
void ts__optim_set_param_check(ts__optim_param_check_fn fn);

/* For checkpoints (checkpoint/): the optimizer's kind as torch names its
 * class ("SGD", "Adam", "AdamW"); the names of the per-parameter states
 * it keeps, in the order torch's state dict lists them, written to
 * names_out (room for 4; returns how many: SGD 1 with momentum, else 0;
 * Adam(W) 3, 4 with amsgrad); and setting the completed-step count
 * (ts_optim_step_count) when a checkpoint is loaded. */
const char *ts__optim_kind_name(const ts_optim *o);
int ts__optim_state_names(const ts_optim *o, const char *names_out[4]);
void ts__optim_set_step_count(ts_optim *o, int64_t steps);

/* The hyperparameters of o (torch's param_groups[0] entries), for a
 * checkpoint's index: lr is the current one (ts_optim_get_lr); sgd is
 * true for SGD (then momentum, dampening, weight_decay, nesterov,
 * maximize are its), false for Adam / AdamW (beta1, beta2, eps,
 * weight_decay, amsgrad, maximize). */
typedef struct ts__optim_hparams {
    bool sgd;
    double lr, momentum, dampening, weight_decay, beta1, beta2, eps;
    bool nesterov, amsgrad, maximize;
} ts__optim_hparams;
void ts__optim_hparams_get(const ts_optim *o, ts__optim_hparams *out);

#endif
