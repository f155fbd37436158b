/* torch.nn.Linear */
#define _GNU_SOURCE
#include "nn/internal.h"

#include <math.h>
#include <stdio.h>

static ts_status linear_forward(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    ts_nn_linear *l = (ts_nn_linear *)m;
    ts_status st = ts__module_check_inputs(m, n_in, 1, 1);
    if (!st) st = ts__module_check_last_dim(m, "input", in[0], 1, l->in_features);
    if (!st) st = ts__module_check_dtype(m, "input", in[0], "weight", l->weight);
    if (!st) st = ts_linear(in[0], l->weight, l->bias, &out[0]);
    if (!st) *n_out = 1;
    return st;
}

static ts_status linear_visit(ts_module *m, const ts_module_visitor *v)
{
    ts_nn_linear *l = (ts_nn_linear *)m;
    ts_status st = TS_OK;
    if (v->param && !(st = v->param(v->ctx, "weight", &l->weight)) && l->bias) st = v->param(v->ctx, "bias", &l->bias);
    return st;
}

static void linear_free(ts_module *m)
{
    ts_nn_linear *l = (ts_nn_linear *)m;
    ts_tensor_free(l->weight);
    ts_tensor_free(l->bias);
    ts__free(TS_MEM_NN, l);
}

/* PyTorch's Linear.extra_repr */
static int linear_extra_repr(const ts_module *m, char *buf, size_t cap)
{
    const ts_nn_linear *l = (const ts_nn_linear *)m;
    return snprintf(buf, cap, "in_features=%lld, out_features=%lld, bias=%s", (long long)l->in_features,
                    (long long)l->out_features, l->bias ? "True" : "False");
}

/* PyTorch's Linear.reset_parameters: kaiming_uniform_(weight, a=sqrt(5)),
 * then bias uniform in +-1/sqrt(fan_in) (docs/rng.md §9: this order of draws;
 * fan_in from the weight, 0 gives a bound of 0). */
static ts_status linear_reset_parameters(ts_module *m)
{
    ts_nn_linear *l = (ts_nn_linear *)m;
    bool prev = ts_grad_mode_set(false);
    ts_status st = ts_init_kaiming_uniform_(l->weight, sqrt(5.0), TS_FAN_IN, TS_NL_LEAKY_RELU, NULL);
    if (!st && l->bias) {
        int64_t fan_in = ts_tensor_size(l->weight, 1);
        double bound = fan_in > 0 ? 1.0 / sqrt((double)fan_in) : 0.0;
        st = ts_uniform_(l->bias, -bound, bound, NULL);
    }
    ts_grad_mode_set(prev);
    return st;
}

static const ts_module_vtable linear_vtable = {
    .type_name = "Linear",
    .forward = linear_forward,
    .visit = linear_visit,
    .free = linear_free,
    .extra_repr = linear_extra_repr,
    .reset_parameters = linear_reset_parameters,
};

ts_status ts_linear_new(int64_t in_features, int64_t out_features, bool bias, ts_module **out)
{
    if (in_features < 0 || out_features < 0 || !out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "Linear: features must be >= 0 (got in %lld, out %lld)",
                        (long long)in_features, (long long)out_features);
    ts_nn_linear *l = ts__calloc(TS_MEM_NN, 1, sizeof *l);
    if (!l) return TS_ERR_NO_MEMORY;
    ts_module_init(&l->base, &linear_vtable);
    l->in_features = in_features;
    l->out_features = out_features;
    int64_t ws[2] = {out_features, in_features}, bs[1] = {out_features};
    ts_status st = ts__param_new(TS_F32, 2, ws, &l->weight);
    if (!st && bias) st = ts__param_new(TS_F32, 1, bs, &l->bias);
    if (!st) st = linear_reset_parameters(&l->base);
    if (st) {
        linear_free(&l->base);
        return st;
    }
    *out = &l->base;
    return TS_OK;
}
