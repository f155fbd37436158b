/* Parameter-free layers: ReLU, Tanh, GELU, Dropout. (One small file for
 * the four; each is a vtable and a forward.) */
#define _GNU_SOURCE
#include "nn/internal.h"

typedef struct act {
    ts_module base;
    ts_gelu_approx approx;
    double p;
} act;

static void act_free(ts_module *m) { ts__free(TS_MEM_NN, m); }

static ts_status relu_forward(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    ts_status st = ts__module_check_inputs(m, n_in, 1, 1);
    if (!st && !(st = ts_relu(in[0], &out[0])))
        *n_out = 1;
    return st;
}

static ts_status tanh_forward(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    ts_status st = ts__module_check_inputs(m, n_in, 1, 1);
    if (!st && !(st = ts_tanh(in[0], &out[0])))
        *n_out = 1;
    return st;
}

static ts_status gelu_forward(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    ts_status st = ts__module_check_inputs(m, n_in, 1, 1);
    if (!st && !(st = ts_gelu(in[0], ((act *)m)->approx, &out[0])))
        *n_out = 1;
    return st;
}

static ts_status dropout_forward(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    ts_status st = ts__module_check_inputs(m, n_in, 1, 1);
    if (!st && !(st = ts_dropout(in[0], ((act *)m)->p, m->training, NULL, &out[0])))
        *n_out = 1;
    return st;
}

static const ts_module_vtable relu_vt = {.type_name = "ReLU", .forward = relu_forward, .free = act_free};
static const ts_module_vtable tanh_vt = {.type_name = "Tanh", .forward = tanh_forward, .free = act_free};
static const ts_module_vtable gelu_vt = {.type_name = "GELU", .forward = gelu_forward, .free = act_free};
static const ts_module_vtable dropout_vt = {.type_name = "Dropout", .forward = dropout_forward, .free = act_free};

static ts_status act_new(const ts_module_vtable *vt, ts_gelu_approx approx, double p, ts_module **out)
{
    if (!out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: out is NULL", vt->type_name);
    act *a = ts__calloc(TS_MEM_NN, 1, sizeof *a);
    if (!a)
        return TS_ERR_NO_MEMORY;
    ts_module_init(&a->base, vt);
    a->approx = approx;
    a->p = p;
    *out = &a->base;
    return TS_OK;
}

ts_status ts_relu_new(ts_module **out) { return act_new(&relu_vt, TS_GELU_NONE, 0, out); }
ts_status ts_tanh_new(ts_module **out) { return act_new(&tanh_vt, TS_GELU_NONE, 0, out); }

ts_status ts_gelu_new(ts_gelu_approx approx, ts_module **out)
{
    if (approx != TS_GELU_NONE && approx != TS_GELU_TANH)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "GELU: approximate must be TS_GELU_NONE or TS_GELU_TANH, got %d",
                        (int)approx);
    return act_new(&gelu_vt, approx, 0, out);
}

ts_status ts_dropout_new(double p, ts_module **out)
{
    if (!(p >= 0.0 && p <= 1.0))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "Dropout: probability has to be between 0 and 1, but got %g", p);
    return act_new(&dropout_vt, TS_GELU_NONE, p, out);
}
