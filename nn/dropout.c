/* torch.nn.Dropout(p): inverted dropout in train mode, identity in eval */
#define _GNU_SOURCE
#include "nn/internal.h"

static ts_status dropout_forward(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    ts_status st = ts__module_check_inputs(m, n_in, 1, 1);
    if (!st && !(st = ts_dropout(in[0], ((ts__act *)m)->p, m->training, NULL, &out[0]))) *n_out = 1;
    return st;
}

static const ts_module_vtable dropout_vt = {.type_name = "Dropout", .forward = dropout_forward, .free = ts__act_free};

ts_status ts_dropout_new(double p, ts_module **out)
{
    if (!(p >= 0.0 && p <= 1.0))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "Dropout: probability has to be between 0 and 1, but got %g", p);
    return ts__act_new(&dropout_vt, TS_GELU_NONE, p, out);
}
