/* torch.nn.GELU(approximate='none' | 'tanh') */
#define _GNU_SOURCE
#include "nn/internal.h"

static ts_status gelu_forward(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    ts_status st = ts__module_check_inputs(m, n_in, 1, 1);
    if (!st && !(st = ts_gelu(in[0], ((ts__act *)m)->approx, &out[0]))) *n_out = 1;
    return st;
}

static const ts_module_vtable gelu_vt = {.type_name = "GELU", .forward = gelu_forward, .free = ts__act_free};

ts_status ts_gelu_new(ts_gelu_approx approx, ts_module **out)
{
    if (approx != TS_GELU_NONE && approx != TS_GELU_TANH)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "GELU: approximate must be TS_GELU_NONE or TS_GELU_TANH, got %d",
                        (int)approx);
    return ts__act_new(&gelu_vt, approx, 0, out);
}
