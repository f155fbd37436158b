/* ts_module_to_dtype: every distinct floating parameter and buffer of
 * the tree converted (deferred ones through their recorded initializers),
 * then swapped into its slots, so that an error changes nothing. */
#include "nn/internal.h"
#include "tensor/internal.h"

#include <stdio.h>

/* ------------------------------------------------------------ dtype */

/* One distinct tensor of the tree and its converted copy. */
typedef struct to_dtype_pair {
    ts_tensor *old, *new_;
} to_dtype_pair;

static void to_dtype_pairs_free(to_dtype_pair *pairs, int n)
{
    for (int i = 0; i < n; i++) ts_tensor_free(pairs[i].new_);
    ts__free(TS_MEM_NN, pairs);
}

/* A deferred tensor converted: a new meta tensor of dtype whose storage
 * takes t's recorded initializers ([Note: deferred init] in
 * tensor/internal.h), still in the dtype they run in; replaying them into
 * the new dtype converts as ts_to_dtype would have converted the values.
 * t must own its storage whole (a parameter as the layers make them). */
static ts_status to_dtype_meta(const char *fqn, ts_tensor *t, ts_dtype dtype, ts_tensor **out)
{
    int64_t n = ts_tensor_numel(t);
    if (!ts_tensor_is_contiguous(t) || t->offset != 0 || t->storage->nbytes != (size_t)n * ts_dtype_size(t->dtype))
        return ts_error(TS_ERR_UNSUPPORTED,
                        "ts_module_to_dtype: '%s' is a deferred (meta) view of a larger storage; "
                        "convert it after materializing",
                        fqn);
    ts_tensor *nt = NULL;
    ts_status st = ts__tensor_new_meta(dtype, t->ndim, t->shape, &nt);
    if (!st && (st = ts__init_events_move(nt->storage, t->storage))) {
        ts_tensor_free(nt);
        nt = NULL;
    }
    if (!st) *out = nt;
    return st;
}

/* The converted copy of t: a leaf with t's name and requires_grad, and
 * t's .grad converted too (PyTorch's Module._apply converts param.grad). */
static ts_status to_dtype_copy(const char *fqn, ts_tensor *t, ts_dtype dtype, ts_tensor **out)
{
    ts_tensor *nt = NULL, *g = NULL;
    bool prev = ts_grad_mode_set(false);
    ts_status st = ts__is_meta(t) ? to_dtype_meta(fqn, t, dtype, &nt) : ts_to_dtype(t, dtype, &nt);
    if (!st && ts_tensor_requires_grad(t)) st = ts_tensor_set_requires_grad(nt, true);
    if (!st && ts_tensor_name(t)) st = ts_tensor_set_name(nt, ts_tensor_name(t));
    if (!st && ts_tensor_grad(t) && !(st = ts_to_dtype(ts_tensor_grad(t), dtype, &g))) st = ts_tensor_set_grad(nt, g);
    ts_grad_mode_set(prev);
    ts_tensor_free(g);
    if (st) {
        ts__error_quiet_begin();  /* the cleanup of a failure: its detail stays (docs/design.md, D1) */
        if (nt && ts__is_meta(t)) /* t keeps its recorded initializers: t's log is empty, a hand-over */
            ts__init_events_move(t->storage, nt->storage);
        ts_tensor_free(nt);
        ts__error_quiet_end();
        return ts_error(st, "ts_module_to_dtype: converting '%s' to %s failed: %s", fqn, ts_dtype_name(dtype),
                        ts_last_error());
    }
    *out = nt;
    return TS_OK;
}

ts_status ts_module_to_dtype(ts_module *m, ts_dtype dtype)
{
    if (!m) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_module_to_dtype: module is NULL");
    if ((unsigned)dtype >= TS_DTYPE_COUNT)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_module_to_dtype: invalid dtype %d", (int)dtype);
    if (!ts_dtype_is_float(dtype))
        return ts_error(TS_ERR_DTYPE,
                        "ts_module_to_dtype: dtype %s is not floating; a module converts to float32, "
                        "float64, bfloat16 or float16 only (PyTorch's Module.to)",
                        ts_dtype_name(dtype));
    ts_named_params e;
    ts_status st = ts__module_entries(m, true, true, false, &e);
    if (st) return st;
    to_dtype_pair *pairs = ts__calloc(TS_MEM_NN, (size_t)(e.n ? e.n : 1), sizeof *pairs);
    int np = 0;
    if (!pairs) {
        ts_named_params_free(&e);
        return TS_ERR_NO_MEMORY;
    }
    /* every distinct floating tensor converted first, so that nothing
     * changes on an error; a tensor in several slots (tied weights) once */
    for (int i = 0; i < e.n && !st; i++) {
        ts_tensor *t = *e.items[i].slot;
        if (!t || !ts_dtype_is_float(ts_tensor_dtype(t)) || ts_tensor_dtype(t) == dtype) continue;
        if (ts_tensor_is_shard(t)) {
            st = ts_error(TS_ERR_SHARDED,
                          "ts_module_to_dtype: '%s' is a sharded parameter; convert the module "
                          "before ts_fully_shard (or use a mixed-precision policy)",
                          e.items[i].name);
            break;
        }
        bool seen = false;
        for (int j = 0; j < np && !seen; j++) seen = pairs[j].old == t;
        if (seen) continue;
        pairs[np].old = t;
        if ((st = to_dtype_copy(e.items[i].name, t, dtype, &pairs[np].new_))) break;
        np++;
    }
    if (!st)
        for (int i = 0; i < e.n; i++) {
            ts_tensor *t = *e.items[i].slot;
            for (int j = 0; j < np; j++)
                if (pairs[j].old == t) {
                    *e.items[i].slot = ts_tensor_retain(pairs[j].new_);
                    ts_tensor_free(t);
                    break;
                }
        }
    else /* deferred tensors take back their recorded initializers (hand-overs: cannot fail) */
        for (int j = 0; j < np; j++)
            if (ts__is_meta(pairs[j].old)) ts__init_events_move(pairs[j].old->storage, pairs[j].new_->storage);
    to_dtype_pairs_free(pairs, np);
    ts_named_params_free(&e);
    return st;
}
