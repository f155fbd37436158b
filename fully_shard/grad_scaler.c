/*
 * ts_grad_scaler (grad_scaler.h): PyTorch's ShardedGradScaler on the CPU.
 * The scale is a float32 and every product that changes it is a float32
 * product (torch keeps it in a float32 tensor); unscaling multiplies by
 * inv = (float)(1.0 / (double)scale) as torch's unscale_ does. Per
 * optimizer (by address) it keeps torch's OptState: READY, UNSCALED,
 * STEPPED, and the found-inf flag after the all-reduce.
 * Floor 7 (internal.h, "Floors"): calls no other file of fully_shard/.
 */
#include "fully_shard/grad_scaler.h"

#include "tensor/kernels.h"

#include <math.h>
#include <string.h>

enum { ST_READY = 0, ST_UNSCALED, ST_STEPPED };

typedef struct scaler_opt {
    const ts_optim *o;
    int stage;
    bool found_inf;
} scaler_opt;

struct ts_grad_scaler {
    ts_grad_scaler_options opt;
    float scale;
    int64_t growth_tracker;
    scaler_opt *opts; /* the optimizers seen since the last update */
    int n_opts, cap_opts;
};

ts_grad_scaler_options ts_grad_scaler_options_default(void)
{
    ts_grad_scaler_options o;
    memset(&o, 0, sizeof o);
    o.init_scale = 65536.0;
    o.growth_factor = 2.0;
    o.backoff_factor = 0.5;
    o.growth_interval = 2000;
    o.enabled = true;
    o.group = NULL;
    return o;
}

ts_status ts_grad_scaler_new(const ts_grad_scaler_options *opts, ts_grad_scaler **out)
{
    const char *fn = "ts_grad_scaler_new";
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: out is NULL", fn);
    ts_grad_scaler_options o = opts ? *opts : ts_grad_scaler_options_default();
    if (!(isfinite(o.init_scale) && o.init_scale > 0 && (float)o.init_scale > 0 && isfinite((float)o.init_scale)))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: init_scale %g must be finite and > 0 (as a float32)", fn,
                        o.init_scale);
    if (!(isfinite(o.growth_factor) && o.growth_factor > 1.0))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: the growth factor must be > 1.0 (growth_factor %g)", fn,
                        o.growth_factor);
    if (!(o.backoff_factor > 0.0 && o.backoff_factor < 1.0))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: the backoff factor must be in (0, 1) (backoff_factor %g)", fn,
                        o.backoff_factor);
    if (o.growth_interval < 1)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: growth_interval %lld must be >= 1", fn,
                        (long long)o.growth_interval);
    ts_grad_scaler *s = ts__calloc(TS_MEM_NN, 1, sizeof *s);
    if (!s) return ts_error(TS_ERR_NO_MEMORY, "%s: out of memory", fn);
    s->opt = o;
    s->scale = (float)o.init_scale;
    *out = s;
    return TS_OK;
}

void ts_grad_scaler_free(ts_grad_scaler *s)
{
    if (!s) return;
    ts__free(TS_MEM_NN, s->opts);
    ts__free(TS_MEM_NN, s);
}

double ts_grad_scaler_get_scale(const ts_grad_scaler *s) { return s && s->opt.enabled ? (double)s->scale : 1.0; }

int64_t ts_grad_scaler_growth_tracker(const ts_grad_scaler *s) { return s ? s->growth_tracker : 0; }

bool ts_grad_scaler_is_enabled(const ts_grad_scaler *s) { return s && s->opt.enabled; }

static scaler_opt *find_opt(const ts_grad_scaler *s, const ts_optim *o)
{
    for (int i = 0; i < s->n_opts; i++)
        if (s->opts[i].o == o) return &s->opts[i];
    return NULL;
}

bool ts_grad_scaler_found_inf(const ts_grad_scaler *s, const ts_optim *o)
{
    const scaler_opt *e = s ? find_opt(s, o) : NULL;
    return e && e->stage != ST_READY && e->found_inf;
}

/* The entry of o, added in state READY if new (NULL: out of memory). */
static scaler_opt *opt_entry(ts_grad_scaler *s, const ts_optim *o)
{
    scaler_opt *e = find_opt(s, o);
    if (e) return e;
    if (s->n_opts == s->cap_opts) {
        int cap = s->cap_opts ? 2 * s->cap_opts : 4;
        scaler_opt *n = ts__calloc(TS_MEM_NN, (size_t)cap, sizeof *n);
        if (!n) return NULL;
        if (s->n_opts) memcpy(n, s->opts, (size_t)s->n_opts * sizeof *n);
        ts__free(TS_MEM_NN, s->opts);
        s->opts = n;
        s->cap_opts = cap;
    }
    e = &s->opts[s->n_opts++];
    e->o = o;
    e->stage = ST_READY;
    e->found_inf = false;
    return e;
}

ts_status ts_grad_scaler_scale(ts_grad_scaler *s, ts_tensor *loss, ts_tensor **out)
{
    if (!s || !loss || !out) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_grad_scaler_scale: NULL argument");
    if (!s->opt.enabled) {
        *out = ts_tensor_retain(loss);
        return TS_OK;
    }
    return ts_mul_scalar(loss, (double)s->scale, out);
}

/* Checks and unscales one gradient in place (any strides); true when some
 * element was inf or NaN before. */
static bool unscale_grad(ts_tensor *g, float inv)
{
    ts_dtype d = ts_tensor_dtype(g);
    int nd = ts_tensor_ndim(g);
    if (ts_tensor_numel(g) == 0) return false;
    int64_t shape[TS_MAX_DIMS], strides[1][TS_MAX_DIMS], idx[TS_MAX_DIMS] = {0}, off[1] = {0};
    if (nd == 0) {
        shape[0] = 1;
        strides[0][0] = 1;
        nd = 1;
    } else {
        memcpy(shape, ts_tensor_shape(g), (size_t)nd * sizeof *shape);
        memcpy(strides[0], ts_tensor_strides(g), (size_t)nd * sizeof(int64_t));
    }
    int64_t inner = shape[nd - 1], is = strides[0][nd - 1];
    bool bad = false;
    void *base = ts_tensor_data(g);
    do {
        for (int64_t j = 0; j < inner; j++) {
            int64_t k = off[0] + j * is;
            switch (d) {
            case TS_F32: {
                float *p = (float *)base + k;
                bad |= !isfinite(*p);
                *p = *p * inv;
                break;
            }
            case TS_F64: {
                double *p = (double *)base + k;
                bad |= !isfinite(*p);
                *p = *p * (double)inv;
                break;
            }
            default: break;
            }
        }
    } while (ts__next_outer(nd, shape, idx, 1, strides, off));
    return bad;
}

static ts_status unscale(const char *fn, ts_grad_scaler *s, ts_optim *o, scaler_opt *e)
{
    if (e->stage == ST_UNSCALED)
        return ts_error(TS_ERR_STATE,
                        "%s: unscale_() has already been called on this optimizer since the last update()", fn);
    if (e->stage == ST_STEPPED) return ts_error(TS_ERR_STATE, "%s: unscale_() is being called after step()", fn);
    int n = ts_optim_num_params(o);
    /* everything checked before anything changes */
    for (int i = 0; i < n; i++) {
        ts_tensor *p = ts_optim_param(o, i);
        ts_tensor *g = ts_tensor_grad(p);
        if (!g) continue;
        if (ts_tensor_dtype(g) != TS_F32 && ts_tensor_dtype(g) != TS_F64)
            return ts_error(TS_ERR_DTYPE,
                            "%s: the gradient of parameter %d ('%s') is %s; the optimizers' dtypes "
                            "(float32, float64) can be unscaled",
                            fn, i, ts_tensor_name(p), ts_dtype_name(ts_tensor_dtype(g)));
        if (ts_tensor_numel(g) > 0 && !ts_tensor_data(g))
            return ts_error(TS_ERR_RELEASED, "%s: the gradient storage of parameter %d ('%s') is released", fn, i,
                            ts_tensor_name(p));
    }
    ts_tensor *flag = NULL;
    ts_status st = ts_tensor_zeros(TS_F32, 1, (const int64_t[]){1}, &flag);
    if (st) return st;
    float inv = (float)(1.0 / (double)s->scale);
    bool bad = false;
    for (int i = 0; i < n; i++) {
        ts_tensor *g = ts_tensor_grad(ts_optim_param(o, i));
        if (g) bad |= unscale_grad(g, inv);
    }
    *(float *)ts_tensor_data(flag) = bad ? 1.0f : 0.0f;
    ts_comm *grp = s->opt.group ? s->opt.group : ts_dist_is_initialized() ? ts_dist_world() : ts_comm_world();
    if ((st = ts_all_reduce(grp, flag, TS_REDUCE_SUM, NULL))) {
        ts_tensor_free(flag);
        return st;
    }
    e->found_inf = *(const float *)ts_tensor_data(flag) > 0.0f;
    e->stage = ST_UNSCALED;
    ts_tensor_free(flag);
    return TS_OK;
}

ts_status ts_grad_scaler_unscale(ts_grad_scaler *s, ts_optim *o)
{
    const char *fn = "ts_grad_scaler_unscale";
    if (!s || !o) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL argument", fn);
    if (!s->opt.enabled) return TS_OK;
    scaler_opt *e = opt_entry(s, o);
    if (!e) return ts_error(TS_ERR_NO_MEMORY, "%s: out of memory", fn);
    return unscale(fn, s, o, e);
}

ts_status ts_grad_scaler_step(ts_grad_scaler *s, ts_optim *o, bool *stepped_out)
{
    const char *fn = "ts_grad_scaler_step";
    if (!s || !o) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL argument", fn);
    ts_status st;
    if (!s->opt.enabled) {
        if ((st = ts_optim_step(o))) return st;
        if (stepped_out) *stepped_out = true;
        return TS_OK;
    }
    scaler_opt *e = opt_entry(s, o);
    if (!e) return ts_error(TS_ERR_NO_MEMORY, "%s: out of memory", fn);
    if (e->stage == ST_STEPPED)
        return ts_error(TS_ERR_STATE, "%s: step() has already been called since the last update()", fn);
    if (e->stage == ST_READY && (st = unscale(fn, s, o, e))) return st;
    bool step = !e->found_inf;
    if (step && (st = ts_optim_step(o))) return st;
    e->stage = ST_STEPPED;
    if (stepped_out) *stepped_out = step;
    return TS_OK;
}

static void forget(ts_grad_scaler *s) { s->n_opts = 0; }

ts_status ts_grad_scaler_update(ts_grad_scaler *s)
{
    const char *fn = "ts_grad_scaler_update";
    if (!s) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: scaler is NULL", fn);
    if (!s->opt.enabled) return TS_OK;
    bool any = false, found = false;
    for (int i = 0; i < s->n_opts; i++) {
        if (s->opts[i].stage == ST_READY) continue;
        any = true;
        found |= s->opts[i].found_inf;
    }
    if (!any)
        return ts_error(TS_ERR_STATE,
                        "%s: No inf checks were recorded prior to update (call ts_grad_scaler_step or "
                        "ts_grad_scaler_unscale first)",
                        fn);
    if (found) {
        s->scale = s->scale * (float)s->opt.backoff_factor;
        s->growth_tracker = 0;
    } else if (s->growth_tracker + 1 == s->opt.growth_interval) {
        float grown = s->scale * (float)s->opt.growth_factor;
        if (isfinite(grown)) s->scale = grown; /* torch's kernel keeps a finite scale */
        s->growth_tracker = 0;
    } else {
        s->growth_tracker++;
    }
    forget(s);
    return TS_OK;
}

ts_status ts_grad_scaler_update_to(ts_grad_scaler *s, double new_scale)
{
    const char *fn = "ts_grad_scaler_update_to";
    if (!s) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: scaler is NULL", fn);
    if (!s->opt.enabled) return TS_OK;
    if (!(isfinite(new_scale) && new_scale > 0 && (float)new_scale > 0 && isfinite((float)new_scale)))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: new_scale %g must be finite and > 0 (as a float32)", fn,
                        new_scale);
    s->scale = (float)new_scale;
    forget(s);
    return TS_OK;
}

ts_status ts_grad_scaler_load_state(ts_grad_scaler *s, double scale, int64_t growth_tracker)
{
    const char *fn = "ts_grad_scaler_load_state";
    if (!s) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: scaler is NULL", fn);
    if (!s->opt.enabled) return TS_OK;
    if (!(isfinite(scale) && scale > 0 && (float)scale > 0 && isfinite((float)scale)))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: scale %g must be finite and > 0 (as a float32)", fn, scale);
    if (growth_tracker < 0 || growth_tracker >= s->opt.growth_interval)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: growth_tracker %lld is not in [0, growth_interval %lld)", fn,
                        (long long)growth_tracker, (long long)s->opt.growth_interval);
    s->scale = (float)scale;
    s->growth_tracker = growth_tracker;
    forget(s);
    return TS_OK;
}
