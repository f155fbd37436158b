/* The module base: calls through the vtable, tree traversal with PyTorch's
 * fully qualified names, train/eval, zero_grad. */
#define _GNU_SOURCE
#include "nn/internal.h"

#include <stdio.h>
#include <string.h>

void ts_module_init(ts_module *m, const ts_module_vtable *vt)
{
    if (!m)
        return;
    m->vtable = vt;
    m->training = true;
    m->ext = NULL;
}

const char *ts_module_type_name(const ts_module *m) { return m && m->vtable ? m->vtable->type_name : "(null)"; }

static ts_status check_call(const char *what, ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    if (!m || !m->vtable)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: module is NULL", what);
    if (n_in < 0 || n_in > TS_MODULE_MAX_IO || (n_in && !in))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %s takes 0 to %d inputs, got %d", what, m->vtable->type_name,
                        TS_MODULE_MAX_IO, n_in);
    if (!n_out || !out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %s: n_out and out must not be NULL", what, m->vtable->type_name);
    return TS_OK;
}

ts_status ts_module_call(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    ts_status st = check_call("ts_module_call", m, n_in, in, n_out, out);
    if (st)
        return st;
    if (!m->vtable->forward)
        return ts_error(TS_ERR_UNSUPPORTED, "ts_module_call: %s has no forward", m->vtable->type_name);
    *n_out = 0;
    return m->vtable->forward(m, n_in, in, n_out, out);
}

ts_status ts_module_call1(ts_module *m, ts_tensor *in, ts_tensor **out)
{
    if (!m || !in || !out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_module_call1: %s is NULL", !m ? "the module" : !in ? "in" : "out");
    ts_tensor *outs[TS_MODULE_MAX_IO];
    int n = 0;
    ts_status st = ts_module_call(m, 1, &in, &n, outs);
    if (st)
        return st;
    if (n != 1) {
        for (int i = 0; i < n; i++)
            ts_tensor_free(outs[i]);
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
    if (st)
        return st;
    if (!name)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_module_call_method: method name is NULL");
    for (int i = 0; i < m->vtable->n_methods; i++)
        if (strcmp(m->vtable->methods[i].name, name) == 0) {
            *n_out = 0;
            return m->vtable->methods[i].fn(m, n_in, in, n_out, out);
        }
    return ts_error(TS_ERR_NOT_FOUND, "ts_module_call_method: %s has no method '%s'", m->vtable->type_name, name);
}

void ts_module_free(ts_module *m)
{
    if (m && m->vtable && m->vtable->free)
        m->vtable->free(m);
}

/* ------------------------------------------------------------ traversal */

typedef struct walk {
    char prefix[512];
    ts_status (*on_param)(struct walk *w, const char *fqn, ts_tensor **slot, ts_module *owner);
    ts_status (*on_module)(struct walk *w, const char *fqn, ts_module *m);
    void *ctx;
    /* modules already visited (each once) */
    ts_module **seen;
    int n_seen, cap_seen;
    ts_module *current;
} walk;

static ts_status walk_module(walk *w, ts_module *m);

static ts_status join(char *dst, size_t cap, const char *prefix, const char *name)
{
    int n = snprintf(dst, cap, "%s%s%s", prefix, *prefix ? "." : "", name);
    if (n < 0 || (size_t)n >= cap)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "module tree: qualified name '%s.%s' is too long", prefix, name);
    return TS_OK;
}

static ts_status visit_param(void *ctx, const char *name, ts_tensor **slot)
{
    walk *w = ctx;
    if (!w->on_param)
        return TS_OK;
    char fqn[512];
    ts_status st = join(fqn, sizeof fqn, w->prefix, name);
    return st ? st : w->on_param(w, fqn, slot, w->current);
}

static ts_status visit_child(void *ctx, const char *name, ts_module *child)
{
    walk *w = ctx;
    if (!child)
        return TS_OK;
    for (int i = 0; i < w->n_seen; i++)
        if (w->seen[i] == child)
            return TS_OK; /* shared submodule: visited once, as PyTorch */
    char saved[512];
    memcpy(saved, w->prefix, sizeof saved);
    ts_status st = join(w->prefix, sizeof w->prefix, saved, name);
    ts_module *cur = w->current;
    if (!st)
        st = walk_module(w, child);
    w->current = cur;
    memcpy(w->prefix, saved, sizeof saved);
    return st;
}

static ts_status walk_module(walk *w, ts_module *m)
{
    if (w->n_seen == w->cap_seen) {
        int cap = w->cap_seen ? 2 * w->cap_seen : 32;
        ts_module **s = ts__malloc(TS_MEM_NN, (size_t)cap * sizeof *s);
        if (!s)
            return TS_ERR_NO_MEMORY;
        if (w->n_seen)
            memcpy(s, w->seen, (size_t)w->n_seen * sizeof *s);
        ts__free(TS_MEM_NN, w->seen);
        w->seen = s;
        w->cap_seen = cap;
    }
    w->seen[w->n_seen++] = m;
    ts_status st = TS_OK;
    if (w->on_module && (st = w->on_module(w, w->prefix, m)))
        return st;
    if (!m->vtable->visit)
        return TS_OK;
    w->current = m;
    /* parameters first, then children: PyTorch's named_parameters order is
     * the module's own _parameters, then each child's, recursively */
    ts_module_visitor pv = {visit_param, NULL, w};
    if ((st = m->vtable->visit(m, &pv)))
        return st;
    ts_module_visitor cv = {NULL, visit_child, w};
    return m->vtable->visit(m, &cv);
}

static ts_status run_walk(walk *w, ts_module *m)
{
    if (!m || !m->vtable)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "module is NULL");
    w->prefix[0] = '\0';
    ts_status st = walk_module(w, m);
    ts__free(TS_MEM_NN, w->seen);
    return st;
}

/* ------------------------------------------------------------ named params */

typedef struct np_ctx {
    ts_named_params *list;
    int cap;
    bool dedup;
} np_ctx;

static ts_status collect_param(walk *w, const char *fqn, ts_tensor **slot, ts_module *owner)
{
    np_ctx *c = w->ctx;
    if (!*slot)
        return TS_OK;
    if (c->dedup)
        for (int i = 0; i < c->list->n; i++)
            if (*c->list->items[i].slot == *slot)
                return TS_OK;
    if (c->list->n == c->cap) {
        int cap = c->cap ? 2 * c->cap : 16;
        ts_named_param *items = ts__malloc(TS_MEM_NN, (size_t)cap * sizeof *items);
        if (!items)
            return TS_ERR_NO_MEMORY;
        if (c->list->n)
            memcpy(items, c->list->items, (size_t)c->list->n * sizeof *items);
        ts__free(TS_MEM_NN, c->list->items);
        c->list->items = items;
        c->cap = cap;
    }
    char *name = ts__strdup(TS_MEM_NN, fqn);
    if (!name)
        return TS_ERR_NO_MEMORY;
    c->list->items[c->list->n++] = (ts_named_param){name, slot, owner};
    return TS_OK;
}

ts_status ts__module_params(ts_module *m, bool dedup, ts_named_params *out)
{
    if (!out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_module_named_parameters: out is NULL");
    ts_named_params list = {0};
    np_ctx c = {&list, 0, dedup};
    walk w = {.on_param = collect_param, .ctx = &c};
    ts_status st = run_walk(&w, m);
    if (st) {
        ts_named_params_free(&list);
        return st;
    }
    *out = list;
    return TS_OK;
}

ts_status ts_module_named_parameters(ts_module *m, ts_named_params *out) { return ts__module_params(m, true, out); }

void ts_named_params_free(ts_named_params *p)
{
    if (!p)
        return;
    for (int i = 0; i < p->n; i++)
        ts__free(TS_MEM_NN, p->items[i].name);
    ts__free(TS_MEM_NN, p->items);
    p->items = NULL;
    p->n = 0;
}

typedef struct nm_ctx {
    ts_module_each_fn fn;
    void *ctx;
} nm_ctx;

static ts_status each_module(walk *w, const char *fqn, ts_module *m)
{
    nm_ctx *c = w->ctx;
    return c->fn(c->ctx, fqn, m);
}

ts_status ts_module_named_modules(ts_module *m, ts_module_each_fn fn, void *ctx)
{
    if (!fn)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_module_named_modules: callback is NULL");
    nm_ctx c = {fn, ctx};
    walk w = {.on_module = each_module, .ctx = &c};
    return run_walk(&w, m);
}

typedef struct find_ctx {
    const char *fqn;
    ts_module *found;
} find_ctx;

static ts_status find_module(void *ctx, const char *fqn, ts_module *m)
{
    find_ctx *c = ctx;
    if (!c->found && strcmp(fqn, c->fqn) == 0)
        c->found = m;
    return TS_OK;
}

ts_status ts_module_get_submodule(ts_module *m, const char *fqn, ts_module **out)
{
    if (!m || !fqn || !out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_module_get_submodule: NULL argument");
    find_ctx c = {fqn, NULL};
    ts_status st = ts_module_named_modules(m, find_module, &c);
    if (st)
        return st;
    if (!c.found)
        return ts_error(TS_ERR_NOT_FOUND, "ts_module_get_submodule: %s has no submodule '%s'", ts_module_type_name(m),
                        fqn);
    *out = c.found;
    return TS_OK;
}

static ts_status set_training(void *ctx, const char *fqn, ts_module *m)
{
    (void)fqn;
    m->training = *(bool *)ctx;
    return TS_OK;
}

void ts_module_train(ts_module *m, bool training)
{
    if (m)
        ts_module_named_modules(m, set_training, &training);
}

void ts_module_eval(ts_module *m) { ts_module_train(m, false); }

void ts_module_zero_grad(ts_module *m, bool set_to_none)
{
    ts_named_params p;
    if (!m || ts_module_named_parameters(m, &p))
        return;
    for (int i = 0; i < p.n; i++)
        ts_tensor_zero_grad(*p.items[i].slot, set_to_none);
    ts_named_params_free(&p);
}

int64_t ts_module_num_parameters(ts_module *m)
{
    ts_named_params p;
    if (!m || ts_module_named_parameters(m, &p))
        return 0;
    int64_t n = 0;
    for (int i = 0; i < p.n; i++)
        n += ts_tensor_numel(*p.items[i].slot);
    ts_named_params_free(&p);
    return n;
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
    if (!x)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %s is NULL", m->vtable->type_name, what);
    if (ts_tensor_ndim(x) < min_ndim || ts_tensor_size(x, -1) != want)
        return ts_error(TS_ERR_SHAPE, "%s: %s of shape %s does not fit: expected at least %d dims with last size "
                                      "%lld", m->vtable->type_name, what, ts_tensor_shape_str(x, s, sizeof s),
                        min_ndim, (long long)want);
    return TS_OK;
}

ts_status ts__param_new(ts_dtype dtype, int ndim, const int64_t *shape, ts_tensor **out)
{
    ts_tensor *t;
    ts_status st = ts_tensor_empty(dtype, ndim, shape, &t);
    if (st)
        return st;
    if ((st = ts_tensor_set_requires_grad(t, true))) {
        ts_tensor_free(t);
        return st;
    }
    *out = t;
    return TS_OK;
}

/* ------------------------------------------------------------ parameter-free layers */

void ts__act_free(ts_module *m) { ts__free(TS_MEM_NN, m); }

ts_status ts__act_new(const ts_module_vtable *vt, ts_gelu_approx approx, double p, ts_module **out)
{
    if (!out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: out is NULL", vt->type_name);
    ts__act *a = ts__calloc(TS_MEM_NN, 1, sizeof *a);
    if (!a)
        return TS_ERR_NO_MEMORY;
    ts_module_init(&a->base, vt);
    a->approx = approx;
    a->p = p;
    *out = &a->base;
    return TS_OK;
}
