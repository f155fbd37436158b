/* Tree traversal with PyTorch's fully qualified names: the walk (each
 * module once: its parameters, its buffers, then its children), the name
 * tables built on it (named parameters, buffers and modules), train/eval,
 * zero_grad, reset_parameters, and finding a submodule, a parameter or a
 * buffer by its name. */
#include "nn/internal.h"

#include <stdio.h>
#include <string.h>

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

ts_status ts__module_fqn_join(char *dst, size_t cap, const char *prefix, const char *name)
{
    int n = snprintf(dst, cap, "%s%s%s", prefix, *prefix ? "." : "", name);
    if (n < 0 || (size_t)n >= cap)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "module tree: qualified name '%s.%s' is too long", prefix, name);
    return TS_OK;
}

static ts_status visit_param(void *ctx, const char *name, ts_tensor **slot)
{
    walk *w = ctx;
    if (!w->on_param) return TS_OK;
    char fqn[512];
    ts_status st = ts__module_fqn_join(fqn, sizeof fqn, w->prefix, name);
    return st ? st : w->on_param(w, fqn, slot, w->current);
}

static ts_status visit_buffer(void *ctx, const char *name, ts_tensor **slot)
{
    walk *w = ctx;
    if (!w->on_buffer) return TS_OK;
    char fqn[512];
    ts_status st = ts__module_fqn_join(fqn, sizeof fqn, w->prefix, name);
    return st ? st : w->on_buffer(w, fqn, slot, w->current);
}

static ts_status visit_child(void *ctx, const char *name, ts_module *child)
{
    walk *w = ctx;
    if (!child) return TS_OK;
    if (!child->vtable)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "module tree: child '%s%s%s' of %s has no vtable (ts_module_init failed or was not called)",
                        w->prefix, *w->prefix ? "." : "", name ? name : "(null)", ts_module_type_name(w->current));
    for (int i = 0; i < w->n_seen; i++)
        if (w->seen[i] == child) return TS_OK; /* shared submodule: visited once, as PyTorch */
    char saved[512];
    memcpy(saved, w->prefix, sizeof saved);
    ts_status st = ts__module_fqn_join(w->prefix, sizeof w->prefix, saved, name);
    ts_module *cur = w->current;
    if (!st) st = walk_module(w, child);
    w->current = cur;
    memcpy(w->prefix, saved, sizeof saved);
    return st;
}

static ts_status walk_module(walk *w, ts_module *m)
{
    if (w->n_seen == w->cap_seen) {
        int cap = w->cap_seen ? 2 * w->cap_seen : 32;
        ts_module **s = ts__malloc(TS_MEM_NN, (size_t)cap * sizeof *s);
        if (!s) return TS_ERR_NO_MEMORY;
        if (w->n_seen) memcpy(s, w->seen, (size_t)w->n_seen * sizeof *s);
        ts__free(TS_MEM_NN, w->seen);
        w->seen = s;
        w->cap_seen = cap;
    }
    w->seen[w->n_seen++] = m;
    ts_status st = TS_OK;
    if (w->on_module && (st = w->on_module(w, w->prefix, m))) return st;
    w->current = m;
    /* parameters first, then buffers, then children: PyTorch's
     * named_parameters order is the module's own _parameters, then each
     * child's, recursively; its state_dict has each module's parameters,
     * then its buffers, then the children's */
    ts_module_visitor pv = {visit_param, NULL, w, NULL};
    if (w->on_param && (st = ts_module_visit(m, &pv))) return st;
    ts_module_visitor bv = {NULL, NULL, w, visit_buffer};
    if (w->on_buffer && (st = ts_module_visit(m, &bv))) return st;
    ts_module_visitor cv = {NULL, visit_child, w, NULL};
    if ((st = ts_module_visit(m, &cv)) || !w->on_module_post) return st;
    return w->on_module_post(w, w->prefix, m);
}

static ts_status run_walk(walk *w, ts_module *m)
{
    if (!m) return ts_error(TS_ERR_INVALID_ARGUMENT, "module is NULL");
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
    if (!*slot) return TS_OK;
    if (c->dedup)
        for (int i = 0; i < c->list->n; i++)
            if (*c->list->items[i].slot == *slot) return TS_OK;
    if (c->list->n == c->cap) {
        int cap = c->cap ? 2 * c->cap : 16;
        ts_named_param *items = ts__malloc(TS_MEM_NN, (size_t)cap * sizeof *items);
        if (!items) return TS_ERR_NO_MEMORY;
        if (c->list->n) memcpy(items, c->list->items, (size_t)c->list->n * sizeof *items);
        ts__free(TS_MEM_NN, c->list->items);
        c->list->items = items;
        c->cap = cap;
    }
    char *name = ts__strdup(TS_MEM_NN, fqn);
    if (!name) return TS_ERR_NO_MEMORY;
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
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_module_named_parameters: out is NULL");
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

ts_status ts_module_named_tensors(ts_module *m, ts_named_params *out)
{
    if (!m || !out) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_module_named_tensors: NULL argument");
    return ts__module_entries(m, true, true, false, out);
}

ts_status ts_module_parameters(ts_module *m, ts_param_list *out)
{
    if (!m || !out) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_module_parameters: NULL %s", m ? "out" : "module");
    ts_named_params p;
    ts_status st = ts__module_params(m, true, &p);
    if (st) return st;
    ts_param_list l = {NULL, 0};
    if (p.n && !(l.items = ts__calloc(TS_MEM_NN, (size_t)p.n, sizeof *l.items))) {
        ts_named_params_free(&p);
        return TS_ERR_NO_MEMORY;
    }
    for (int i = 0; i < p.n; i++)
        if (ts_tensor_requires_grad(*p.items[i].slot)) l.items[l.n++] = ts_tensor_retain(*p.items[i].slot);
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
    if (!l) return;
    for (int i = 0; i < l->n; i++) ts_tensor_free(l->items[i]);
    ts__free(TS_MEM_NN, l->items);
    l->items = NULL;
    l->n = 0;
}

void ts_named_params_free(ts_named_params *p)
{
    if (!p) return;
    for (int i = 0; i < p->n; i++) ts__free(TS_MEM_NN, p->items[i].name);
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
    if (!fn) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_module_named_modules: callback is NULL");
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
    if (!m) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_module_reset_parameters: the module is NULL");
    if (!m->vtable)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "ts_module_reset_parameters: the module has no vtable "
                        "(ts_module_init failed or was not called)");
    if (!recurse) return reset_one(m);
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
    if (!c->found && strcmp(fqn, c->fqn) == 0) c->found = m;
    return TS_OK;
}

ts_status ts_module_get_submodule(ts_module *m, const char *fqn, ts_module **out)
{
    if (!m || !fqn || !out) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_module_get_submodule: NULL argument");
    find_ctx c = {fqn, NULL};
    ts_status st = ts_module_named_modules(m, find_module, &c);
    if (st) return st;
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
    if (m) ts_module_named_modules(m, set_training, &training);
}

void ts_module_eval(ts_module *m) { ts_module_train(m, false); }

void ts_module_zero_grad(ts_module *m, bool set_to_none)
{
    ts_named_params p;
    if (!m || ts_module_named_parameters(m, &p)) return;
    for (int i = 0; i < p.n; i++) ts_tensor_zero_grad(*p.items[i].slot, set_to_none);
    ts_named_params_free(&p);
}

int64_t ts_module_num_parameters(ts_module *m)
{
    ts_named_params p;
    if (!m || ts_module_named_parameters(m, &p)) return 0;
    int64_t n = 0;
    for (int i = 0; i < p.n; i++) n += ts_tensor_numel(*p.items[i].slot);
    ts_named_params_free(&p);
    return n;
}

/* ------------------------------------------------------------ slots by name */

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
        if (f->buffer) f->other_kind = true;
        else if (!f->slot) f->slot = slot;
    }
    return TS_OK;
}

static ts_status find_buffer_slot(void *ctx, const char *name, ts_tensor **slot)
{
    slot_find *f = ctx;
    if (strcmp(name, f->name) == 0) {
        if (!f->buffer) f->other_kind = true;
        else if (!f->slot) f->slot = slot;
    }
    return TS_OK;
}

static ts_status get_slot(const char *fn, ts_module *m, const char *fqn, bool buffer, ts_tensor **out)
{
    if (!m || !fqn || !out) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL argument", fn);
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
    if (!owner->vtable) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: the module has no vtable", fn);
    slot_find f = {dot ? dot + 1 : fqn, buffer, NULL, false};
    ts_module_visitor v = {find_param_slot, NULL, &f, find_buffer_slot};
    ts_status st = ts_module_visit(owner, &v);
    if (st) return st;
    if (!f.slot || !*f.slot)
        return ts_error(TS_ERR_NOT_FOUND, "%s: %s has no %s '%s'%s", fn, ts_module_type_name(m),
                        buffer ? "buffer" : "parameter", fqn,
                        f.other_kind ? (buffer ? " (it is a parameter)" : " (it is a buffer)")
                            : f.slot ? " (the slot is empty)"
                                     : "");
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
