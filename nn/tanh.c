/* torch.nn.Tanh */
#define _GNU_SOURCE
#include "nn/internal.h"

static ts_status tanh_forward(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    ts_status st = ts__module_check_inputs(m, n_in, 1, 1);
    if (!st && !(st = ts_tanh(in[0], &out[0]))) *n_out = 1;
    return st;
}

static const ts_module_vtable tanh_vt = {.type_name = "Tanh", .forward = tanh_forward, .free = ts__act_free};

ts_status ts_tanh_new(ts_module **out) { return ts__act_new(&tanh_vt, TS_GELU_NONE, 0, out); }
