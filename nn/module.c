/* The module base: calls through the vtable, tree traversal with PyTorch's
 * fully qualified names, train/eval, zero_grad. */
#define _GNU_SOURCE
#include "nn/internal.h"
#include "tensor/internal.h"

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
        struct ts__vt_cache_entry *grown = realloc(c->entries, (size_t)cap * sizeof *grown);
        if (!grown) {
            st = ts_error(TS_ERR_NO_MEMORY, "%s: out of memory (the table of %d module types)", c->op, c->n);
            goto done;
        }
        c->entries = grown;
        c->cap = cap;
    }
    size_t len = strlen(orig->type_name) + strlen(c->suffix) + 1;
    vt = calloc(1, sizeof *vt);
    name = malloc(len);
    if (!vt || !name) {
        st = ts_error(TS_ERR_NO_MEMORY, "%s: out of memory", c->op);
        goto done;
    }
    snprintf(name, len, "%s%s", orig->type_name, c->suffix);
    vt->type_name = name;
    vt->base = orig;
    vt->visit = orig->visit;
    vt->reset_parameters = orig->reset_parameters; /* re-initializes the same parameters */
    vt->methods = orig->methods; /* the original's names and functions */
    vt->n_methods = orig->n_methods;
    c->fill(vt, orig);
    c->entries[c->n++] = (struct ts__vt_cache_entry){orig, vt};
    *out = vt;
    vt = NULL, name = NULL;
done:
    pthread_mutex_unlock(&c->mu);
    free(vt);
    free(name);
    return st;
}

ts_status ts__module_vtable_check(const char *fn, const ts_module_vtable *vt, bool need_free)
{
    if (!vt)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: the vtable is NULL", fn);
    if (!vt->type_name || !vt->type_name[0])
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: the module vtable has no type name (set .type_name, e.g. "
                                                 "\"MyBlock\")", fn);
    const char *t = vt->type_name;
    if (need_free && !vt->free)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: the vtable of %s has no free function", fn, t);
    if (vt->n_methods < 0 || (vt->n_methods > 0 && !vt->methods))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: the vtable of %s lists %d methods but %s", fn, t,
                        vt->n_methods, vt->n_methods < 0 ? "a count cannot be negative" : "methods is NULL");
    if (vt->n_inputs < 0 || vt->n_inputs > TS_MODULE_MAX_IO)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: the vtable of %s takes n_inputs %d (0: any, else 1 to %d)", fn,
                        t, vt->n_inputs, TS_MODULE_MAX_IO);
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
    if (!m)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_module_init: the module is NULL");
    m->vtable = NULL;
    m->training = true;
    m->ext = NULL;
    m->extra_refs = 0;
    m->reg = NULL;
    ts_status st = ts__module_vtable_check("ts_module_init", vt, true);
    if (st)
        return st;
    m->vtable = vt;
    return TS_OK;
}

const char *ts_module_type_name(const ts_module *m)
{
    if (!m)
        return "(null)";
    if (!m->vtable)
        return "(no vtable)";
    return m->vtable->type_name && m->vtable->type_name[0] ? m->vtable->type_name : "(unnamed type)";
}

static ts_status check_call(const char *what, ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    if (!m)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: module is NULL", what);
    if (!m->vtable)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: the module has no vtable (ts_module_init failed or was not "
                                                 "called)", what);
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
    if (st)
        return st;
    const ts_module_vtable *own = m->vtable; /* the type's own vtable, under fully_shard's and the checkpoint's */
    while (own->base)
        own = own->base;
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
    for (int i = 0; i < m->vtable->n_methods && m->vtable->methods; i++)
        if (m->vtable->methods[i].name && strcmp(m->vtable->methods[i].name, name) == 0) {
            *n_out = 0;
            if (m->vtable->call_method)
                return m->vtable->call_method(m, i, n_in, in, n_out, out);
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
    if (!m || !m->vtable)
        return;
    ts__module_release(m); /* through the upper layers' free slots, if any */
}

ts_module *ts_module_retain(ts_module *m)
{
    if (m)
        m->extra_refs++;
    return m;
}

/* ------------------------------------------------------------ traversal */

typedef struct walk {
    char prefix[512];
    ts_status (*on_param)(struct walk *w, const char *fqn, ts_tensor **slot, ts_module *owner);
    ts_status (*on_buffer)(struct walk *w, const char *fqn, ts_tensor **slot, ts_module *owner);
    ts_status (*on_module)(struct walk *w, const char *fqn, ts_module *m);
    ts_status (*on_module_post)(struct walk *w, const char *fqn, ts_module *m); /* after its children */
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

static ts_status visit_buffer(void *ctx, const char *name, ts_tensor **slot)
{
    walk *w = ctx;
    if (!w->on_buffer)
        return TS_OK;
    char fqn[512];
    ts_status st = join(fqn, sizeof fqn, w->prefix, name);
    return st ? st : w->on_buffer(w, fqn, slot, w->current);
}

static ts_status visit_child(void *ctx, const char *name, ts_module *child)
{
    walk *w = ctx;
    if (!child)
        return TS_OK;
    if (!child->vtable)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "module tree: child '%s%s%s' of %s has no vtable (ts_module_init failed or was not called)",
                        w->prefix, *w->prefix ? "." : "", name ? name : "(null)", ts_module_type_name(w->current));
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
    w->current = m;
    /* parameters first, then buffers, then children: PyTorch's
     * named_parameters order is the module's own _parameters, then each
     * child's, recursively; its state_dict has each module's parameters,
     * then its buffers, then the children's */
    ts_module_visitor pv = {visit_param, NULL, w, NULL};
    if (w->on_param && (st = ts_module_visit(m, &pv)))
        return st;
    ts_module_visitor bv = {NULL, NULL, w, visit_buffer};
    if (w->on_buffer && (st = ts_module_visit(m, &bv)))
        return st;
    ts_module_visitor cv = {NULL, visit_child, w, NULL};
    if ((st = ts_module_visit(m, &cv)) || !w->on_module_post)
        return st;
    return w->on_module_post(w, w->prefix, m);
}

static ts_status run_walk(walk *w, ts_module *m)
{
    if (!m)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "module is NULL");
    if (!m->vtable)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "module has no vtable (ts_module_init failed or was not called)");
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

static ts_status collect_entry(walk *w, const char *fqn, ts_tensor **slot, ts_module *owner, bool is_buffer)
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
    c->list->items[c->list->n++] = (ts_named_param){name, slot, owner, is_buffer};
    return TS_OK;
}

static ts_status collect_param(walk *w, const char *fqn, ts_tensor **slot, ts_module *owner)
{
    return collect_entry(w, fqn, slot, owner, false);
}

static ts_status collect_buffer(walk *w, const char *fqn, ts_tensor **slot, ts_module *owner)
{
    return collect_entry(w, fqn, slot, owner, true);
}

ts_status ts__module_entries(ts_module *m, bool params, bool buffers, bool dedup, ts_named_params *out)
{
    if (!out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_module_named_parameters: out is NULL");
    ts_named_params list = {0};
    np_ctx c = {&list, 0, dedup};
    walk w = {.on_param = params ? collect_param : NULL, .on_buffer = buffers ? collect_buffer : NULL, .ctx = &c};
    ts_status st = run_walk(&w, m);
    if (st) {
        ts_named_params_free(&list);
        return st;
    }
    *out = list;
    return TS_OK;
}

ts_status ts__module_params(ts_module *m, bool dedup, ts_named_params *out)
{
    return ts__module_entries(m, true, false, dedup, out);
}

ts_status ts_module_named_parameters(ts_module *m, ts_named_params *out) { return ts__module_params(m, true, out); }

ts_status ts_module_named_buffers(ts_module *m, ts_named_params *out)
{
    return ts__module_entries(m, false, true, true, out);
}

ts_status ts_module_parameters(ts_module *m, ts_param_list *out)
{
    if (!m || !out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_module_parameters: NULL %s", m ? "out" : "module");
    ts_named_params p;
    ts_status st = ts__module_params(m, true, &p);
    if (st)
        return st;
    ts_param_list l = {NULL, 0};
    if (p.n && !(l.items = ts__calloc(TS_MEM_NN, (size_t)p.n, sizeof *l.items))) {
        ts_named_params_free(&p);
        return TS_ERR_NO_MEMORY;
    }
    for (int i = 0; i < p.n; i++)
        if (ts_tensor_requires_grad(*p.items[i].slot))
            l.items[l.n++] = ts_tensor_retain(*p.items[i].slot);
    ts_named_params_free(&p);
    if (!l.n) {
        ts__free(TS_MEM_NN, l.items);
        l.items = NULL;
    }
    *out = l;
    return TS_OK;
}

void ts_param_list_free(ts_param_list *l)
{
    if (!l)
        return;
    for (int i = 0; i < l->n; i++)
        ts_tensor_free(l->items[i]);
    ts__free(TS_MEM_NN, l->items);
    l->items = NULL;
    l->n = 0;
}

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

static ts_status reset_one(ts_module *m)
{
    return m->vtable->reset_parameters ? m->vtable->reset_parameters(m) : TS_OK;
}

static ts_status reset_post(walk *w, const char *fqn, ts_module *m)
{
    (void)w;
    (void)fqn;
    return reset_one(m);
}

ts_status ts_module_reset_parameters(ts_module *m, bool recurse)
{
    if (!m)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_module_reset_parameters: the module is NULL");
    if (!m->vtable)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_module_reset_parameters: the module has no vtable "
                                                 "(ts_module_init failed or was not called)");
    if (!recurse)
        return reset_one(m);
    walk w = {.on_module_post = reset_post};
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
    if (!x)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %s is NULL", m->vtable->type_name, what);
    if (ts_tensor_ndim(x) < min_ndim || ts_tensor_size(x, -1) != want)
        return ts_error(TS_ERR_SHAPE, "%s: %s of shape %s does not fit: expected at least %d dims with last size "
                                      "%lld", m->vtable->type_name, what, ts_tensor_shape_str(x, s, sizeof s),
                        min_ndim, (long long)want);
    return TS_OK;
}

ts_status ts__module_check_dtype(ts_module *m, const char *what, ts_tensor *x, const char *pname, ts_tensor *p)
{
    if (!x || !p || ts_tensor_dtype(x) == ts_tensor_dtype(p))
        return TS_OK;
    return ts_error(TS_ERR_DTYPE, "%s: %s dtype %s differs from the %s dtype %s (convert the input with ts_to_dtype, "
                                  "or the module with ts_module_to_dtype)", m->vtable->type_name, what,
                    ts_dtype_name(ts_tensor_dtype(x)), pname, ts_dtype_name(ts_tensor_dtype(p)));
}

/* Makes *tp (just made, with status st) a leaf that requires grad in
 * *out; frees it on error. (A pointer: the argument order of the call that
 * makes it is unspecified.) */
static ts_status as_param(ts_status st, ts_tensor **tp, ts_tensor **out)
{
    if (st)
        return st;
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

/* ------------------------------------------------------------ for your own modules */

ts_status ts_param_new(ts_dtype dtype, int ndim, const int64_t *shape, ts_tensor **out)
{
    if (!out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_param_new: out is NULL");
    if (!ts_dtype_is_float(dtype))
        return ts_error(TS_ERR_DTYPE, "ts_param_new: a parameter must be floating-point to require grad, not %s",
                        ts_dtype_name(dtype));
    ts_tensor *t = NULL;
    ts_status st = ts_tensor_zeros(dtype, ndim, shape, &t); /* meta inside a meta device scope */
    /* deferred: the zeros are recorded, so that a parameter its module never
     * fills materializes as zeros too ([Note: deferred init]) */
    if (!st && ts__is_meta(t) && (st = ts_tensor_fill_(t, 0.0)))
        ts_tensor_free(t);
    return as_param(st, &t, out);
}

typedef struct slot_find {
    const char *name;
    bool buffer;
    ts_tensor **slot;
    bool other_kind; /* found under the name, but as the other kind */
} slot_find;

static ts_status find_param_slot(void *ctx, const char *name, ts_tensor **slot)
{
    slot_find *f = ctx;
    if (strcmp(name, f->name) == 0) {
        if (f->buffer)
            f->other_kind = true;
        else if (!f->slot)
            f->slot = slot;
    }
    return TS_OK;
}

static ts_status find_buffer_slot(void *ctx, const char *name, ts_tensor **slot)
{
    slot_find *f = ctx;
    if (strcmp(name, f->name) == 0) {
        if (!f->buffer)
            f->other_kind = true;
        else if (!f->slot)
            f->slot = slot;
    }
    return TS_OK;
}

static ts_status get_slot(const char *fn, ts_module *m, const char *fqn, bool buffer, ts_tensor **out)
{
    if (!m || !fqn || !out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL argument", fn);
    const char *dot = strrchr(fqn, '.');
    ts_module *owner = m;
    if (dot) {
        size_t n = (size_t)(dot - fqn);
        char prefix[512];
        if (n >= sizeof prefix)
            return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: the name '%s' is longer than %zu characters", fn, fqn,
                            sizeof prefix - 1);
        memcpy(prefix, fqn, n);
        prefix[n] = '\0';
        ts_status st = ts_module_get_submodule(m, prefix, &owner);
        if (st)
            return ts_error(st, "%s: %s has no submodule '%s' (looking for '%s')", fn, ts_module_type_name(m), prefix,
                            fqn);
    }
    if (!owner->vtable)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: the module has no vtable", fn);
    slot_find f = {dot ? dot + 1 : fqn, buffer, NULL, false};
    ts_module_visitor v = {find_param_slot, NULL, &f, find_buffer_slot};
    ts_status st = ts_module_visit(owner, &v);
    if (st)
        return st;
    if (!f.slot || !*f.slot)
        return ts_error(TS_ERR_NOT_FOUND, "%s: %s has no %s '%s'%s", fn, ts_module_type_name(m),
                        buffer ? "buffer" : "parameter", fqn,
                        f.other_kind ? (buffer ? " (it is a parameter)" : " (it is a buffer)")
                        : f.slot ? " (the slot is empty)" : "");
    *out = *f.slot;
    return TS_OK;
}

ts_status ts_module_get_parameter(ts_module *m, const char *fqn, ts_tensor **out)
{
    return get_slot("ts_module_get_parameter", m, fqn, false, out);
}

ts_status ts_module_get_buffer(ts_module *m, const char *fqn, ts_tensor **out)
{
    return get_slot("ts_module_get_buffer", m, fqn, true, out);
}

/* ------------------------------------------------------------ printing */

/* A growing text buffer; the first failure sticks in st. */
typedef struct sbuf {
    char *p;
    size_t n, cap;
    ts_status st;
} sbuf;

static void sb_put(sbuf *b, const char *s, size_t len)
{
    if (b->st)
        return;
    if (b->n + len + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + len + 1)
            cap *= 2;
        char *p = ts__malloc(TS_MEM_NN, cap);
        if (!p) {
            b->st = TS_ERR_NO_MEMORY;
            return;
        }
        if (b->n)
            memcpy(p, b->p, b->n);
        ts__free(TS_MEM_NN, b->p);
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, len);
    b->n += len;
    b->p[b->n] = '\0';
}

static void sb_str(sbuf *b, const char *s) { sb_put(b, s, strlen(s)); }

static void sb_indent(sbuf *b, int depth)
{
    for (int i = 0; i < depth; i++)
        sb_str(b, "  ");
}

typedef struct print_ctx {
    sbuf *b;
    int count;       /* slots printed on this line */
    bool buffers;    /* this pass prints buffers */
    /* children of the module being printed */
    const char **child_names;
    ts_module **children;
    int n_children, cap_children;
    ts_status st;
} print_ctx;

static void print_slot(print_ctx *c, const char *name, ts_tensor **slot)
{
    if (!slot || !*slot)
        return;
    char shape[96];
    sb_str(c->b, c->count++ ? ", " : "  ");
    if (c->buffers)
        sb_str(c->b, "buffer ");
    sb_str(c->b, name);
    sb_str(c->b, " ");
    ts_dtype dt = ts_tensor_dtype(*slot);
    if (dt != TS_F32) {
        sb_str(c->b, ts_dtype_name(dt));
        sb_str(c->b, " ");
    }
    sb_str(c->b, ts_tensor_shape_str(*slot, shape, sizeof shape));
    if (ts_tensor_is_shard(*slot))
        sb_str(c->b, " [shard]");
}

static ts_status print_param(void *ctx, const char *name, ts_tensor **slot)
{
    print_slot(ctx, name, slot);
    return TS_OK;
}

static ts_status print_buffer(void *ctx, const char *name, ts_tensor **slot)
{
    print_slot(ctx, name, slot);
    return TS_OK;
}

static ts_status print_child(void *ctx, const char *name, ts_module *child)
{
    print_ctx *c = ctx;
    if (!child)
        return TS_OK;
    if (c->n_children == c->cap_children) {
        int cap = c->cap_children ? 2 * c->cap_children : 8;
        void *nn, *nc;
        if (ts__grow_pair(c->child_names, sizeof *c->child_names, c->children, sizeof *c->children, c->n_children,
                          cap, &nn, &nc))
            return TS_ERR_NO_MEMORY;
        c->child_names = nn;
        c->children = nc;
        c->cap_children = cap;
    }
    char *copy = ts__strdup(TS_MEM_NN, name ? name : "");
    if (!copy)
        return TS_ERR_NO_MEMORY;
    c->child_names[c->n_children] = copy;
    c->children[c->n_children++] = child;
    return TS_OK;
}

typedef struct print_seen {
    ts_module **m;
    char **fqn;
    int n, cap;
} print_seen;

static ts_status seen_add(print_seen *s, ts_module *m, const char *fqn)
{
    if (s->n == s->cap) {
        int cap = s->cap ? 2 * s->cap : 16;
        void *nm, *nf;
        if (ts__grow_pair(s->m, sizeof *s->m, s->fqn, sizeof *s->fqn, s->n, cap, &nm, &nf))
            return TS_ERR_NO_MEMORY;
        s->m = nm;
        s->fqn = nf;
        s->cap = cap;
    }
    char *copy = ts__strdup(TS_MEM_NN, fqn);
    if (!copy)
        return TS_ERR_NO_MEMORY;
    s->m[s->n] = m;
    s->fqn[s->n++] = copy;
    return TS_OK;
}

static ts_status print_module(sbuf *b, print_seen *seen, ts_module *m, const char *name, const char *fqn,
                              int depth)
{
    sb_indent(b, depth);
    if (depth > 0) {
        sb_str(b, "(");
        sb_str(b, name);
        sb_str(b, "): ");
    }
    sb_str(b, ts_module_type_name(m));
    for (int i = 0; i < seen->n; i++)
        if (seen->m[i] == m) {
            sb_str(b, " (shared with '");
            sb_str(b, seen->fqn[i]);
            sb_str(b, "')\n");
            return b->st;
        }
    ts_status st = seen_add(seen, m, fqn);
    if (st)
        return st;
    if (!m->vtable) {
        sb_str(b, "\n");
        return b->st;
    }
    char er[512] = "";
    if (m->vtable->extra_repr && m->vtable->extra_repr(m, er, sizeof er) < 0)
        er[0] = '\0';
    sbuf slots = {0};
    print_ctx c = {.b = &slots};
    {
        ts_module_visitor cv = {NULL, print_child, &c, NULL};
        ts_module_visitor pv = {print_param, NULL, &c, NULL};
        ts_module_visitor bv = {NULL, NULL, &c, print_buffer};
        st = ts_module_visit(m, &cv);
        if (!st)
            st = ts_module_visit(m, &pv); /* own parameters, then buffers */
        c.buffers = true;
        if (!st)
            st = ts_module_visit(m, &bv);
    }
    if (!st)
        st = slots.st;
    if (!st && !c.n_children) { /* a leaf: one line */
        sb_str(b, "(");
        sb_str(b, er);
        sb_str(b, ")");
        if (slots.n)
            sb_str(b, slots.p);
        sb_str(b, "\n");
    } else if (!st) { /* settings, own slots and children inside, as PyTorch */
        sb_str(b, "(\n");
        if (er[0]) {
            sb_indent(b, depth + 1);
            sb_str(b, er);
            sb_str(b, "\n");
        }
        if (slots.n) {
            sb_indent(b, depth + 1);
            sb_str(b, slots.p + 2); /* without the leading "  " */
            sb_str(b, "\n");
        }
        for (int i = 0; i < c.n_children && !st && !b->st; i++) {
            char cfqn[512];
            if ((st = join(cfqn, sizeof cfqn, fqn, c.child_names[i])))
                break;
            st = print_module(b, seen, c.children[i], c.child_names[i], cfqn, depth + 1);
        }
        sb_indent(b, depth);
        sb_str(b, ")\n");
    }
    ts__free(TS_MEM_NN, slots.p);
    for (int i = 0; i < c.n_children; i++)
        ts__free(TS_MEM_NN, (void *)c.child_names[i]);
    ts__free(TS_MEM_NN, c.child_names);
    ts__free(TS_MEM_NN, c.children);
    return st ? st : b->st;
}

static ts_status render(const char *fn, ts_module *m, sbuf *b)
{
    if (!m)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: module is NULL", fn);
    print_seen seen = {0};
    memset(b, 0, sizeof *b);
    ts_status st = print_module(b, &seen, m, "", "", 0);
    for (int i = 0; i < seen.n; i++)
        ts__free(TS_MEM_NN, seen.fqn[i]);
    ts__free(TS_MEM_NN, seen.m);
    ts__free(TS_MEM_NN, seen.fqn);
    if (st) {
        ts__free(TS_MEM_NN, b->p);
        b->p = NULL;
        return st == TS_ERR_NO_MEMORY ? ts_error(st, "%s: out of memory", fn) : st;
    }
    return TS_OK;
}

ts_status ts_module_repr(ts_module *m, char *buf, size_t cap, size_t *len_out)
{
    if (!len_out || (cap && !buf))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_module_repr: NULL %s", len_out ? "buf" : "len_out");
    sbuf b;
    ts_status st = render("ts_module_repr", m, &b);
    if (st)
        return st;
    if (cap) {
        size_t n = b.n < cap - 1 ? b.n : cap - 1;
        if (n)
            memcpy(buf, b.p, n);
        buf[n] = '\0';
    }
    *len_out = b.n;
    ts__free(TS_MEM_NN, b.p);
    return TS_OK;
}

ts_status ts_module_print(ts_module *m, FILE *f)
{
    if (!f)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_module_print: the FILE is NULL");
    sbuf b;
    ts_status st = render("ts_module_print", m, &b);
    if (st)
        return st;
    /* flushed, so that a full disk or a closed pipe is this call's error */
    if ((b.n && fwrite(b.p, 1, b.n, f) != b.n) || fflush(f) != 0 || ferror(f))
        st = ts_error(TS_ERR_IO, "ts_module_print: writing %zu bytes failed: %s", b.n, strerror(errno));
    ts__free(TS_MEM_NN, b.p);
    return st;
}

/* ------------------------------------------------------------ dtype */

/* One distinct tensor of the tree and its converted copy. */
typedef struct to_dtype_pair {
    ts_tensor *old, *new_;
} to_dtype_pair;

static void to_dtype_pairs_free(to_dtype_pair *pairs, int n)
{
    for (int i = 0; i < n; i++)
        ts_tensor_free(pairs[i].new_);
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
        return ts_error(TS_ERR_UNSUPPORTED, "ts_module_to_dtype: '%s' is a deferred (meta) view of a larger storage; "
                        "convert it after materializing", fqn);
    ts_tensor *nt = NULL;
    ts_status st = ts__tensor_new_meta(dtype, t->ndim, t->shape, &nt);
    if (!st && (st = ts__init_events_move(nt->storage, t->storage))) {
        ts_tensor_free(nt);
        nt = NULL;
    }
    if (!st)
        *out = nt;
    return st;
}

/* The converted copy of t: a leaf with t's name and requires_grad, and
 * t's .grad converted too (PyTorch's Module._apply converts param.grad). */
static ts_status to_dtype_copy(const char *fqn, ts_tensor *t, ts_dtype dtype, ts_tensor **out)
{
    ts_tensor *nt = NULL, *g = NULL;
    bool prev = ts_grad_mode_set(false);
    ts_status st = ts__is_meta(t) ? to_dtype_meta(fqn, t, dtype, &nt) : ts_to_dtype(t, dtype, &nt);
    if (!st && ts_tensor_requires_grad(t))
        st = ts_tensor_set_requires_grad(nt, true);
    if (!st && ts_tensor_name(t))
        st = ts_tensor_set_name(nt, ts_tensor_name(t));
    if (!st && ts_tensor_grad(t) && !(st = ts_to_dtype(ts_tensor_grad(t), dtype, &g)))
        st = ts_tensor_set_grad(nt, g);
    ts_grad_mode_set(prev);
    ts_tensor_free(g);
    if (st) {
        char why[512];
        snprintf(why, sizeof why, "%s", ts_last_error());
        if (nt && ts__is_meta(t)) /* t keeps its recorded initializers: t's log is empty, a hand-over */
            ts__init_events_move(t->storage, nt->storage);
        ts_tensor_free(nt);
        return ts_error(st, "ts_module_to_dtype: converting '%s' to %s failed: %s", fqn, ts_dtype_name(dtype), why);
    }
    *out = nt;
    return TS_OK;
}

ts_status ts_module_to_dtype(ts_module *m, ts_dtype dtype)
{
    if (!m)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_module_to_dtype: module is NULL");
    if ((unsigned)dtype >= TS_DTYPE_COUNT)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_module_to_dtype: invalid dtype %d", (int)dtype);
    if (!ts_dtype_is_float(dtype))
        return ts_error(TS_ERR_DTYPE, "ts_module_to_dtype: dtype %s is not floating; a module converts to float32, "
                                      "float64, bfloat16 or float16 only (PyTorch's Module.to)", ts_dtype_name(dtype));
    ts_named_params e;
    ts_status st = ts__module_entries(m, true, true, false, &e);
    if (st)
        return st;
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
        if (!t || !ts_dtype_is_float(ts_tensor_dtype(t)) || ts_tensor_dtype(t) == dtype)
            continue;
        if (ts_tensor_is_shard(t)) {
            st = ts_error(TS_ERR_SHARDED, "ts_module_to_dtype: '%s' is a sharded parameter; convert the module "
                                          "before ts_fully_shard (or use a mixed-precision policy)", e.items[i].name);
            break;
        }
        bool seen = false;
        for (int j = 0; j < np && !seen; j++)
            seen = pairs[j].old == t;
        if (seen)
            continue;
        pairs[np].old = t;
        if ((st = to_dtype_copy(e.items[i].name, t, dtype, &pairs[np].new_)))
            break;
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
            if (ts__is_meta(pairs[j].old))
                ts__init_events_move(pairs[j].old->storage, pairs[j].new_->storage);
    to_dtype_pairs_free(pairs, np);
    ts_named_params_free(&e);
    return st;
}
