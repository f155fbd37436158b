/* torch.nn.LayerNorm over the last dim */
#define _GNU_SOURCE
#include "nn/internal.h"

#include <stdio.h>

static ts_status layer_norm_forward(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    ts_nn_layer_norm *l = (ts_nn_layer_norm *)m;
    ts_status st = ts__module_check_inputs(m, n_in, 1, 1);
    if (!st) st = ts__module_check_last_dim(m, "input", in[0], 1, l->dim);
    if (!st) st = ts__module_check_dtype(m, "input", in[0], "weight", l->weight);
    if (!st && !(st = ts_layer_norm(in[0], 1, l->weight, l->bias, l->eps, &out[0]))) *n_out = 1;
    return st;
}

static ts_status layer_norm_visit(ts_module *m, const ts_module_visitor *v)
{
    ts_nn_layer_norm *l = (ts_nn_layer_norm *)m;
    ts_status st = TS_OK;
    if (v->param && l->weight && !(st = v->param(v->ctx, "weight", &l->weight)))
        st = v->param(v->ctx, "bias", &l->bias);
    return st;
}

static void layer_norm_free(ts_module *m)
{
    ts_nn_layer_norm *l = (ts_nn_layer_norm *)m;
    ts_tensor_free(l->weight);
    ts_tensor_free(l->bias);
    ts__free(TS_MEM_NN, l);
}

/* PyTorch's LayerNorm.extra_repr */
static int layer_norm_extra_repr(const ts_module *m, char *buf, size_t cap)
{
    const ts_nn_layer_norm *l = (const ts_nn_layer_norm *)m;
    return snprintf(buf, cap, "(%lld,), eps=%g, elementwise_affine=%s", (long long)l->dim, l->eps,
                    l->weight ? "True" : "False");
}

/* PyTorch's LayerNorm.reset_parameters: ones_(weight), zeros_(bias). */
static ts_status layer_norm_reset_parameters(ts_module *m)
{
    ts_nn_layer_norm *l = (ts_nn_layer_norm *)m;
    if (!l->weight) return TS_OK;
    bool prev = ts_grad_mode_set(false);
    ts_status st = ts_tensor_fill_(l->weight, 1.0);
    if (!st) st = ts_tensor_fill_(l->bias, 0.0);
    ts_grad_mode_set(prev);
    return st;
}

static const ts_module_vtable layer_norm_vt = {.type_name = "LayerNorm",
                                               .forward = layer_norm_forward,
                                               .visit = layer_norm_visit,
                                               .free = layer_norm_free,
                                               .extra_repr = layer_norm_extra_repr,
                                               .reset_parameters = layer_norm_reset_parameters};

ts_status ts_layer_norm_new(int64_t dim, double eps, bool elementwise_affine, ts_module **out)
{
    if (dim <= 0 || !(eps > 0) || !out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "LayerNorm: need dim > 0 and eps > 0 (got %lld, %g)", (long long)dim,
                        eps);
    ts_nn_layer_norm *l = ts__calloc(TS_MEM_NN, 1, sizeof *l);
    if (!l) return TS_ERR_NO_MEMORY;
    ts_module_init(&l->base, &layer_norm_vt);
    l->dim = dim;
    l->eps = eps;
    ts_status st = TS_OK;
    if (elementwise_affine) {
        int64_t s[1] = {dim};
        if (!(st = ts__param_new(TS_F32, 1, s, &l->weight)) && !(st = ts__param_new(TS_F32, 1, s, &l->bias)))
            st = layer_norm_reset_parameters(&l->base);
    }
    if (st) {
        layer_norm_free(&l->base);
        return st;
    }
    *out = &l->base;
    return TS_OK;
}
