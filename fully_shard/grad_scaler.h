/*
 * Gradient scaling for float16 training under fully_shard: PyTorch's
 * ShardedGradScaler (torch/distributed/fsdp/sharded_grad_scaler.py, on
 * torch.amp.GradScaler), whose scale, unscale, inf/nan check and scale
 * update it follows:
 *
 *   ts_grad_scaler *sc;  ts_grad_scaler_new(NULL, &sc);
 *   per step:
 *     ts_grad_scaler_scale(sc, loss, &scaled);  ts_backward(scaled, NULL, false);
 *     ts_grad_scaler_step(sc, opt, &stepped);   // unscale, agree on inf, step or skip
 *     ts_grad_scaler_update(sc);                // back off or grow
 *
 * The loss is multiplied by the scale (init_scale, 2^16 by default) so
 * that small float16 gradients do not flush to zero. Unscaling multiplies
 * every gradient of the optimizer's parameters (the local shards' .grad
 * under fully_shard: each rank unscales what it holds) by 1/scale in
 * place, and notes whether any is inf or NaN; one all-reduce (SUM of a
 * float32 flag) over the scaler's group makes every rank agree, so that
 * all of them skip the same steps. A step with inf or NaN is skipped and
 * update() multiplies the scale by backoff_factor; after growth_interval
 * consecutive good steps it multiplies it by growth_factor.
 *
 * Lifetime: the scaler is owned by the caller (ts_grad_scaler_free); it
 * remembers the optimizers it saw since the last update by address only.
 * The group in the options is borrowed. unscale, step and update are
 * collective over the group when the scaler is enabled (every rank calls
 * them in the same order). One thread at a time.
 */
#ifndef TS_GRAD_SCALER_H
#define TS_GRAD_SCALER_H

#include "base/base.h"
#include "comm/comm.h"
#include "optim/optim.h"
#include "tensor/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ts_grad_scaler ts_grad_scaler;

typedef struct ts_grad_scaler_options {
    double init_scale;       /* > 0, finite; 65536 (2^16) */
    double growth_factor;    /* > 1, finite; 2 */
    double backoff_factor;   /* in (0, 1); 0.5 */
    int64_t growth_interval; /* >= 1; 2000 */
    bool enabled;            /* true; false: scale returns the loss, step only steps, the rest do nothing */
    /* The group the inf/nan flag is all-reduced over (borrowed): every
     * rank that holds a part of the model. NULL: the initialized world
     * (ts_dist_world(), the one-rank group without one), as PyTorch's
     * dist.group.WORLD. */
    ts_comm *group;
} ts_grad_scaler_options;

/* PyTorch's defaults (above). */
TS_API ts_grad_scaler_options ts_grad_scaler_options_default(void);

/* A new scaler (owned by the caller); NULL options: the defaults. The
 * scale is a float32 (as torch's _scale tensor): init_scale is rounded to
 * float32. TS_ERR_INVALID_ARGUMENT naming the value for an option out of
 * its range (torch: "The growth factor must be > 1.0."), TS_ERR_NO_MEMORY. */
TS_API ts_status ts_grad_scaler_new(const ts_grad_scaler_options *opts, ts_grad_scaler **out);
/* Frees the scaler. Accepts NULL. */
TS_API void ts_grad_scaler_free(ts_grad_scaler *s);

/* *out = loss * scale, in loss's dtype (differentiable, a new reference);
 * disabled: a new reference to loss itself. The ops' errors
 * (TS_ERR_DTYPE for a non-floating loss). */
TS_API ts_status ts_grad_scaler_scale(ts_grad_scaler *s, ts_tensor *loss, ts_tensor **out);

/* Unscales the gradients of o's parameters in place (grad = grad * inv
 * with inv = 1/scale computed in float64 and rounded to float32, as torch;
 * multiplied in float32 for float32 gradients and in float64 for float64
 * ones, as torch's kernel; every element, like torch's kernel), records whether any value
 * was inf or NaN before unscaling, and all-reduces that flag over the
 * group. Parameters without a gradient are skipped. Call it before
 * clipping the gradients; step() then does not unscale again. Errors,
 * before anything changes: TS_ERR_INVALID_ARGUMENT (NULL), TS_ERR_STATE
 * (already unscaled since the last update: "unscale_() has already been
 * called on this optimizer since the last update()", or after step),
 * TS_ERR_DTYPE (a gradient neither float32 nor float64, naming the
 * parameter),
 * TS_ERR_RELEASED; then the all-reduce's errors. Disabled: nothing. */
TS_API ts_status ts_grad_scaler_unscale(ts_grad_scaler *s, ts_optim *o);

/* Unscales (unless ts_grad_scaler_unscale already did since the last
 * update), then runs ts_optim_step(o) when no rank found inf or NaN and
 * skips it otherwise. *stepped_out (optional) says which. Disabled: just
 * ts_optim_step. TS_ERR_STATE when step was already called for o since
 * the last update; unscale's and ts_optim_step's errors. */
TS_API ts_status ts_grad_scaler_step(ts_grad_scaler *s, ts_optim *o, bool *stepped_out);

/* Updates the scale from every optimizer unscaled since the last update:
 * if any found inf or NaN, scale *= backoff_factor and the growth tracker
 * restarts at 0; otherwise the tracker counts the good step, and when it
 * reaches growth_interval, scale *= growth_factor and it restarts at 0
 * (float32 products, as torch). Then forgets the optimizers. TS_ERR_STATE
 * when nothing was unscaled since the last update ("No inf checks were
 * recorded prior to update."). Disabled: nothing. */
TS_API ts_status ts_grad_scaler_update(ts_grad_scaler *s);
/* torch's update(new_scale): sets the scale (rounded to float32) instead
 * of computing it; the growth tracker is kept; forgets the optimizers.
 * TS_ERR_INVALID_ARGUMENT unless new_scale is finite and > 0. Disabled:
 * nothing. */
TS_API ts_status ts_grad_scaler_update_to(ts_grad_scaler *s, double new_scale);

/* torch's GradScaler.load_state_dict({"scale", "_growth_tracker"}), for
 * a resumed training: sets the scale (rounded to float32) and the count of
 * good steps towards the next growth, as ts_grad_scaler_get_scale and
 * ts_grad_scaler_growth_tracker returned them when the state was saved;
 * forgets the optimizers. TS_ERR_INVALID_ARGUMENT (naming the value)
 * unless scale is finite and > 0 and 0 <= growth_tracker <
 * growth_interval. Disabled: nothing. */
TS_API ts_status ts_grad_scaler_load_state(ts_grad_scaler *s, double scale, int64_t growth_tracker);

/* The current scale (1 when disabled or s is NULL, as torch's
 * get_scale()). */
TS_API double ts_grad_scaler_get_scale(const ts_grad_scaler *s);
/* Consecutive good steps counted towards the next growth (0 when s is
 * NULL). */
TS_API int64_t ts_grad_scaler_growth_tracker(const ts_grad_scaler *s);
/* After unscale or step for o and before update: whether some rank found
 * inf or NaN in o's gradients (false otherwise). */
TS_API bool ts_grad_scaler_found_inf(const ts_grad_scaler *s, const ts_optim *o);
/* True unless made with enabled false. */
TS_API bool ts_grad_scaler_is_enabled(const ts_grad_scaler *s);

#ifdef __cplusplus
}
#endif
#endif /* TS_GRAD_SCALER_H */
