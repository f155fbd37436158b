/*
 * torch.nn.init (torch 1.13): calculate_gain, kaiming_uniform_,
 * kaiming_normal_, xavier_uniform_, xavier_normal_. The bounds are
 * computed in f64 with exactly the operations and order of init.py
 * (docs/rng.md §8), then passed to uniform_/normal_, so
 * that the same seed gives the same bits as torch.
 */
#include "tensor/internal.h"

#include <math.h>

/* calculate_gain. For TS_NL_LEAKY_RELU `param` is the negative slope
 * (torch's default when param is None is 0.01; pass it explicitly); the
 * other nonlinearities ignore it. NaN for an unknown nonlinearity. */
double ts_init_calculate_gain(ts_nonlinearity nl, double param)
{
    switch (nl) {
    case TS_NL_LINEAR:
    case TS_NL_SIGMOID: return 1.0;
    case TS_NL_TANH: return 5.0 / 3;
    case TS_NL_RELU: return sqrt(2.0);
    case TS_NL_LEAKY_RELU:
        /* Python's negative_slope ** 2 is pow(x, 2.0), which is x * x */
        return sqrt(2.0 / (1 + param * param));
    case TS_NL_SELU: return 3.0 / 4;
    }
    return NAN;
}

static bool nl_valid(ts_nonlinearity nl) { return nl >= TS_NL_LINEAR && nl <= TS_NL_SELU; }

static int64_t numel_of(const ts_tensor *t)
{
    int64_t n = 1;
    for (int d = 0; d < t->ndim; d++) n *= t->shape[d];
    return n;
}

/* _calculate_fan_in_and_fan_out: fan_in = size(1) * receptive, fan_out =
 * size(0) * receptive, receptive = product of sizes [2:]. */
static ts_status fans(const char *op, const ts_tensor *t, int64_t *fan_in, int64_t *fan_out)
{
    if (t->ndim < 2) {
        char buf[96];
        return ts_error(TS_ERR_SHAPE,
                        "%s: fan in and fan out can not be computed for a tensor with fewer than 2 dimensions "
                        "(shape %s)",
                        op, ts_shape_str(t->ndim, t->shape, buf, sizeof buf));
    }
    int64_t receptive = 1;
    for (int d = 2; d < t->ndim; d++) receptive *= t->shape[d];
    *fan_in = t->shape[1] * receptive;
    *fan_out = t->shape[0] * receptive;
    return TS_OK;
}

/* Shared prologue of the kaiming initializers: input checks, the zero
 * element no-op (checked before the fans, as init.py does), and
 * std = gain / sqrt(fan). Sets *skip for a zero-element tensor. */
static ts_status kaiming_std(const char *op, ts_tensor *t, double a, ts_fan_mode mode, ts_nonlinearity nl,
                             double *std_out, bool *skip)
{
    ts_status st = ts__check_inputs(op, 1, &t);
    if (st != TS_OK) return st;
    if (mode != TS_FAN_IN && mode != TS_FAN_OUT)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: mode %d is neither TS_FAN_IN nor TS_FAN_OUT", op, (int)mode);
    if (!nl_valid(nl)) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: unknown nonlinearity %d", op, (int)nl);
    if (!isfinite(a)) /* the gain would be NaN (or 0 for an infinite slope): weights of NaN or zeros */
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: the negative slope a = %g is not finite", op, a);
    *skip = numel_of(t) == 0;
    if (*skip) return TS_OK;
    int64_t fan_in = 0, fan_out = 0; /* set by fans() on success */
    st = fans(op, t, &fan_in, &fan_out);
    if (st != TS_OK) return st;
    double fan = (double)(mode == TS_FAN_IN ? fan_in : fan_out);
    double gain = ts_init_calculate_gain(nl, a);
    *std_out = gain / sqrt(fan);
    return TS_OK;
}

ts_status ts_init_kaiming_uniform_(ts_tensor *t, double a, ts_fan_mode mode, ts_nonlinearity nl, ts_generator *gen)
{
    double std = 0.0;
    bool skip = true;
    ts_status st = kaiming_std("kaiming_uniform_", t, a, mode, nl, &std, &skip);
    if (st != TS_OK || skip) return st;
    double bound = sqrt(3.0) * std;
    return ts_uniform_(t, -bound, bound, gen);
}

ts_status ts_init_kaiming_normal_(ts_tensor *t, double a, ts_fan_mode mode, ts_nonlinearity nl, ts_generator *gen)
{
    double std = 0.0;
    bool skip = true;
    ts_status st = kaiming_std("kaiming_normal_", t, a, mode, nl, &std, &skip);
    if (st != TS_OK || skip) return st;
    return ts_normal_(t, 0.0, std, gen);
}

/* std = gain * sqrt(2.0 / (fan_in + fan_out)). init.py has no zero-element
 * shortcut here: fan_in + fan_out == 0 (shape (0, 0)) is a division by
 * zero in torch and TS_ERR_INVALID_ARGUMENT here. */
static ts_status xavier_std(const char *op, ts_tensor *t, double gain, double *std_out)
{
    ts_status st = ts__check_inputs(op, 1, &t);
    if (st != TS_OK) return st;
    if (!isfinite(gain)) /* a std of NaN or infinity: weights of NaN or infinities */
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: gain %g is not finite", op, gain);
    int64_t fan_in = 0, fan_out = 0; /* set by fans() on success */
    st = fans(op, t, &fan_in, &fan_out);
    if (st != TS_OK) return st;
    if (fan_in + fan_out == 0) {
        char buf[96];
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: fan_in + fan_out is 0 for shape %s", op,
                        ts_shape_str(t->ndim, t->shape, buf, sizeof buf));
    }
    *std_out = gain * sqrt(2.0 / (double)(fan_in + fan_out));
    return TS_OK;
}

ts_status ts_init_xavier_uniform_(ts_tensor *t, double gain, ts_generator *gen)
{
    double std = 0.0;
    ts_status st = xavier_std("xavier_uniform_", t, gain, &std);
    if (st != TS_OK) return st;
    double a = sqrt(3.0) * std;
    return ts_uniform_(t, -a, a, gen);
}

ts_status ts_init_xavier_normal_(ts_tensor *t, double gain, ts_generator *gen)
{
    double std = 0.0;
    ts_status st = xavier_std("xavier_normal_", t, gain, &std);
    if (st != TS_OK) return st;
    return ts_normal_(t, 0.0, std, gen);
}
