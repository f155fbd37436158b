/* torch.nn.ReLU */
#define _GNU_SOURCE
#include "nn/internal.h"

static ts_status relu_forward(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    ts_status st = ts__module_check_inputs(m, n_in, 1, 1);
    if (!st && !(st = ts_relu(in[0], &out[0]))) *n_out = 1;
    return st;
}

static const ts_module_vtable relu_vt = {.type_name = "ReLU", .forward = relu_forward, .free = ts__act_free};

ts_status ts_relu_new(ts_module **out) { return ts__act_new(&relu_vt, TS_GELU_NONE, 0, out); }
