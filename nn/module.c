/* The module base: the vtable checks and the process-wide cache of
 * extended vtables, ts_module_init, calls through the vtable, free and
 * retain; then what the layers share (input checks, new parameters, the
 * parameter-free layers, growing two parallel tables). Walking the tree
 * is nn/traverse.c, printing it nn/print.c, converting its dtype
 * nn/convert.c. */
#define _GNU_SOURCE
#include "nn/internal.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct ts__vt_cache_entry {
    const ts_module_vtable *orig;
    ts_module_vtable *vt;
};

ts_status ts__vt_cache_get(ts__vt_cache *c, const ts_module_vtable *orig, const ts_module_vtable **out)
{
    pthread_mutex_lock(&c->mu);
    for (int i = 0; i < c->n; i++)
        if (c->entries[i].orig == orig) {
            *out = c->entries[i].vt;
            pthread_mutex_unlock(&c->mu);
            return TS_OK;
        }
    ts_status st = TS_OK;
    ts_module_vtable *vt = NULL;
    char *name = NULL;
    if (c->n == c->cap) {
        int cap = c->cap ? 2 * c->cap : 16;
        struct ts__vt_cache_entry *grown =
            realloc(c->entries, (size_t)cap * sizeof *grown); /* libc: lives as long as the process, as the types */
        if (!grown) {
            st = ts_error(TS_ERR_NO_MEMORY, "%s: out of memory (the table of %d module types)", c->op, c->n);
            goto done;
        }
        c->entries = grown;
        c->cap = cap;
    }
    size_t len = strlen(orig->type_name) + strlen(c->suffix) + 1;
    /* libc: an extended vtable lives as long as the process (every module of
     * the type points at it), outside the allocator hook's live counts */
    vt = calloc(1, sizeof *vt);
    name = malloc(len); /* libc: as vt */
    if (!vt || !name) {
        st = ts_error(TS_ERR_NO_MEMORY, "%s: out of memory", c->op);
        goto done;
    }
    snprintf(name, len, "%s%s", orig->type_name, c->suffix);
    vt->type_name = name;
    vt->base = orig;
    vt->visit = orig->visit;
    vt->reset_parameters = orig->reset_parameters; /* re-initializes the same parameters */
    vt->methods = orig->methods;                   /* the original's names and functions */
    vt->n_methods = orig->n_methods;
    c->fill(vt, orig);
    c->entries[c->n++] = (struct ts__vt_cache_entry){orig, vt};
    *out = vt;
    vt = NULL, name = NULL;
done:
    pthread_mutex_unlock(&c->mu);
    free(vt);   /* libc: as above */
    free(name); /* libc: as above */
    return st;
}

ts_status ts__module_vtable_check(const char *fn, const ts_module_vtable *vt, bool need_free)
{
    if (!vt) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: the vtable is NULL", fn);
    if (!vt->type_name || !vt->type_name[0])
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "%s: the module vtable has no type name (set .type_name, e.g. "
                        "\"MyBlock\")",
                        fn);
    const char *t = vt->type_name;
    if (need_free && !vt->free)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: the vtable of %s has no free function", fn, t);
    if (vt->n_methods < 0 || (vt->n_methods > 0 && !vt->methods))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: the vtable of %s lists %d methods but %s", fn, t, vt->n_methods,
                        vt->n_methods < 0 ? "a count cannot be negative" : "methods is NULL");
    if (vt->n_inputs < 0 || vt->n_inputs > TS_MODULE_MAX_IO)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: the vtable of %s takes n_inputs %d (0: any, else 1 to %d)", fn, t,
                        vt->n_inputs, TS_MODULE_MAX_IO);
    for (int i = 0; i < vt->n_methods; i++) {
        const ts_module_method *mt = &vt->methods[i];
        if (!mt->name || !mt->name[0] || !mt->fn)
            return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: method %d of %s has no %s", fn, i, t,
                            !mt->name || !mt->name[0] ? "name" : "function");
        for (int j = 0; j < i; j++)
            if (strcmp(vt->methods[j].name, mt->name) == 0)
                return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %s has two methods named '%s' (%d and %d)", fn, t,
                                mt->name, j, i);
    }
    return TS_OK;
}

ts_status ts_module_init(ts_module *m, const ts_module_vtable *vt)
{
    if (!m) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_module_init: the module is NULL");
    m->vtable = NULL;
    m->training = true;
    m->ext = NULL;
    m->extra_refs = 0;
    m->reg = NULL;
    ts_status st = ts__module_vtable_check("ts_module_init", vt, true);
    if (st) return st;
    m->vtable = vt;
    return TS_OK;
}

const char *ts_module_type_name(const ts_module *m)
{
    if (!m) return "(null)";
    if (!m->vtable) return "(no vtable)";
    return m->vtable->type_name && m->vtable->type_name[0] ? m->vtable->type_name : "(unnamed type)";
}

static ts_status check_call(const char *what, ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    if (!m) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: module is NULL", what);
    if (!m->vtable)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "%s: the module has no vtable (ts_module_init failed or was not "
                        "called)",
                        what);
    if (!m->vtable->type_name || !m->vtable->type_name[0])
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: the module's vtable has no type name", what);
    if (n_in < 0 || n_in > TS_MODULE_MAX_IO || (n_in && !in))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %s takes 0 to %d inputs, got %d", what, m->vtable->type_name,
                        TS_MODULE_MAX_IO, n_in);
    if (!n_out || !out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %s: n_out and out must not be NULL", what, m->vtable->type_name);
    return TS_OK;
}

/* Nesting of ts_module_call on this thread: the outermost call is the
 * iteration's forward in the trace. */
static _Thread_local int tl_call_depth;

ts_status ts_module_call(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    ts_status st = check_call("ts_module_call", m, n_in, in, n_out, out);
    if (st) return st;
    const ts_module_vtable *own = m->vtable; /* the type's own vtable, under fully_shard's and the checkpoint's */
    while (own->base) own = own->base;
    if (own->n_inputs > 0 && n_in != own->n_inputs)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_module_call: %s's forward takes %d input%s, got %d",
                        own->type_name, own->n_inputs, own->n_inputs == 1 ? "" : "s", n_in);
    if (!m->vtable->forward)
        return ts_error(TS_ERR_UNSUPPORTED, "ts_module_call: %s has no forward", m->vtable->type_name);
    *n_out = 0;
    uint64_t t0 = tl_call_depth == 0 && ts_trace_enabled() ? ts_now_ns() : 0;
    tl_call_depth++;
    st = m->vtable->forward(m, n_in, in, n_out, out);
    tl_call_depth--;
    if (t0) {
        ts_trace_arg a[1] = {{"module", m->vtable->type_name, 0}};
        ts_trace_span_args("forward", "compute", t0, ts_now_ns(), 1, a);
    }
    return st;
}

ts_status ts_module_call1(ts_module *m, ts_tensor *in, ts_tensor **out)
{
    if (!m || !in || !out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_module_call1: %s is NULL", !m ? "the module" : !in ? "in" : "out");
    ts_tensor *outs[TS_MODULE_MAX_IO];
    int n = 0;
    ts_status st = ts_module_call(m, 1, &in, &n, outs);
    if (st) return st;
    if (n != 1) {
        for (int i = 0; i < n; i++) ts_tensor_free(outs[i]);
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_module_call1: %s returned %d outputs, not 1",
                        ts_module_type_name(m), n);
    }
    *out = outs[0];
    return TS_OK;
}

ts_status ts_module_call_method(ts_module *m, const char *name, int n_in, ts_tensor *const *in, int *n_out,
                                ts_tensor **out)
{
    ts_status st = check_call("ts_module_call_method", m, n_in, in, n_out, out);
    if (st) return st;
    if (!name) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_module_call_method: method name is NULL");
    for (int i = 0; i < m->vtable->n_methods && m->vtable->methods; i++)
        if (m->vtable->methods[i].name && strcmp(m->vtable->methods[i].name, name) == 0) {
            *n_out = 0;
            if (m->vtable->call_method) return m->vtable->call_method(m, i, n_in, in, n_out, out);
            if (!m->vtable->methods[i].fn)
                return ts_error(TS_ERR_UNSUPPORTED, "ts_module_call_method: %s's method '%s' has no function",
                                m->vtable->type_name, name);
            return m->vtable->methods[i].fn(m, n_in, in, n_out, out);
        }
    return ts_error(TS_ERR_NOT_FOUND, "ts_module_call_method: %s has no method '%s'", m->vtable->type_name, name);
}

void ts_module_free(ts_module *m)
{
    if (m && m->extra_refs > 0) {
        m->extra_refs--;
        return;
    }
    if (!m || !m->vtable) return;
    ts__module_release(m); /* through the upper layers' free slots, if any */
}

ts_module *ts_module_retain(ts_module *m)
{
    if (m) m->extra_refs++;
    return m;
}

/* ------------------------------------------------------------ growing tables */

ts_status ts__grow_pair(void *a, size_t size_a, void *b, size_t size_b, int n, int cap, void **a_out, void **b_out)
{
    void *na = ts__malloc(TS_MEM_NN, (size_t)cap * size_a);
    void *nb = ts__malloc(TS_MEM_NN, (size_t)cap * size_b);
    if (!na || !nb) {
        ts__free(TS_MEM_NN, na);
        ts__free(TS_MEM_NN, nb);
        return TS_ERR_NO_MEMORY;
    }
    if (n) {
        memcpy(na, a, (size_t)n * size_a);
        memcpy(nb, b, (size_t)n * size_b);
    }
    ts__free(TS_MEM_NN, a);
    ts__free(TS_MEM_NN, b);
    *a_out = na;
    *b_out = nb;
    return TS_OK;
}

/* ------------------------------------------------------------ helpers for layers */

ts_status ts__module_check_inputs(ts_module *m, int n_in, int min_in, int max_in)
{
    if (n_in < min_in || n_in > max_in) {
        if (min_in == max_in)
            return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: forward takes %d input%s, got %d", m->vtable->type_name,
                            min_in, min_in == 1 ? "" : "s", n_in);
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: forward takes %d to %d inputs, got %d", m->vtable->type_name,
                        min_in, max_in, n_in);
    }
    return TS_OK;
}

ts_status ts__module_check_last_dim(ts_module *m, const char *what, ts_tensor *x, int min_ndim, int64_t want)
{
    char s[96];
    if (!x) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %s is NULL", m->vtable->type_name, what);
    if (ts_tensor_ndim(x) < min_ndim || ts_tensor_size(x, -1) != want)
        return ts_error(TS_ERR_SHAPE,
                        "%s: %s of shape %s does not fit: expected at least %d dims with last size "
                        "%lld",
                        m->vtable->type_name, what, ts_tensor_shape_str(x, s, sizeof s), min_ndim, (long long)want);
    return TS_OK;
}

ts_status ts__module_check_dtype(ts_module *m, const char *what, ts_tensor *x, const char *pname, ts_tensor *p)
{
    if (!x || !p || ts_tensor_dtype(x) == ts_tensor_dtype(p)) return TS_OK;
    return ts_error(TS_ERR_DTYPE,
                    "%s: %s dtype %s differs from the %s dtype %s (convert the input with ts_to_dtype, "
                    "or the module with ts_module_to_dtype)",
                    m->vtable->type_name, what, ts_dtype_name(ts_tensor_dtype(x)), pname,
                    ts_dtype_name(ts_tensor_dtype(p)));
}

/* Makes *tp (just made, with status st) a leaf that requires grad in
 * *out; frees it on error. (A pointer: the argument order of the call that
 * makes it is unspecified.) */
static ts_status as_param(ts_status st, ts_tensor **tp, ts_tensor **out)
{
    if (st) return st;
    ts_tensor *t = *tp;
    if ((st = ts_tensor_set_requires_grad(t, true))) {
        ts_tensor_free(t);
        return st;
    }
    *out = t;
    return TS_OK;
}

ts_status ts__param_new(ts_dtype dtype, int ndim, const int64_t *shape, ts_tensor **out)
{
    ts_tensor *t = NULL; /* meta inside ts_device_scope_enter(TS_DEVICE_META) */
    return as_param(ts_tensor_empty(dtype, ndim, shape, &t), &t, out);
}

/* ------------------------------------------------------------ parameter-free layers */

void ts__act_free(ts_module *m) { ts__free(TS_MEM_NN, m); }

ts_status ts__act_new(const ts_module_vtable *vt, ts_gelu_approx approx, double p, ts_module **out)
{
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: out is NULL", vt->type_name);
    ts__act *a = ts__calloc(TS_MEM_NN, 1, sizeof *a);
    if (!a) return TS_ERR_NO_MEMORY;
    ts_module_init(&a->base, vt);
    a->approx = approx;
    a->p = p;
    *out = &a->base;
    return TS_OK;
}

/* ------------------------------------------------------------ for your own modules */

ts_status ts_param_new(ts_dtype dtype, int ndim, const int64_t *shape, ts_tensor **out)
{
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_param_new: out is NULL");
    if (!ts_dtype_is_float(dtype))
        return ts_error(TS_ERR_DTYPE, "ts_param_new: a parameter must be floating-point to require grad, not %s",
                        ts_dtype_name(dtype));
    ts_tensor *t = NULL;
    ts_status st = ts_tensor_zeros(dtype, ndim, shape, &t); /* meta inside a meta device scope */
    /* deferred: the zeros are recorded, so that a parameter its module never
     * fills materializes as zeros too ([Note: deferred init]) */
    if (!st && ts_tensor_is_meta(t) && (st = ts_tensor_fill_(t, 0.0))) ts_tensor_free(t);
    return as_param(st, &t, out);
}
