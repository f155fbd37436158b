/* Sequential and ModuleList: children named "0", "1", ... Sequential's
 * forward feeds each child's outputs to the next, through ts_module_call. */
#define _GNU_SOURCE
#include "nn/internal.h"

#include <stdio.h>
#include <string.h>

typedef struct container {
    ts_module base;
    int n;
    ts_module **children;
} container;

static ts_status container_visit(ts_module *m, const ts_module_visitor *v)
{
    container *c = (container *)m;
    if (!v->child) return TS_OK;
    for (int i = 0; i < c->n; i++) {
        char name[16];
        snprintf(name, sizeof name, "%d", i);
        ts_status st = v->child(v->ctx, name, c->children[i]);
        if (st) return st;
    }
    return TS_OK;
}

static void container_free(ts_module *m)
{
    container *c = (container *)m;
    for (int i = 0; i < c->n; i++) ts_module_free(c->children[i]);
    ts__free(TS_MEM_NN, c->children);
    ts__free(TS_MEM_NN, c);
}

static ts_status sequential_forward(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    container *c = (container *)m;
    ts_tensor *cur[TS_MODULE_MAX_IO], *next[TS_MODULE_MAX_IO];
    int n_cur = n_in;
    for (int i = 0; i < n_in; i++) cur[i] = ts_tensor_retain(in[i]);
    ts_status st = TS_OK;
    for (int k = 0; k < c->n && !st; k++) {
        int n_next = 0;
        st = ts_module_call(c->children[k], n_cur, cur, &n_next, next);
        for (int i = 0; i < n_cur; i++) ts_tensor_free(cur[i]);
        n_cur = 0;
        if (!st) {
            memcpy(cur, next, (size_t)n_next * sizeof *next);
            n_cur = n_next;
        }
    }
    if (st) {
        for (int i = 0; i < n_cur; i++) ts_tensor_free(cur[i]);
        return st;
    }
    memcpy(out, cur, (size_t)n_cur * sizeof *cur);
    *n_out = n_cur;
    return TS_OK;
}

static const ts_module_vtable sequential_vt = {
    .type_name = "Sequential", .forward = sequential_forward, .visit = container_visit, .free = container_free};
static const ts_module_vtable module_list_vt = {
    .type_name = "ModuleList", .forward = NULL, .visit = container_visit, .free = container_free};

static ts_status container_new(const ts_module_vtable *vt, int n, ts_module *const *children, ts_module **out)
{
    if (n < 0 || (n && !children) || !out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: invalid list of %d children", vt->type_name, n);
    for (int i = 0; i < n; i++)
        if (!children[i]) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: child %d is NULL", vt->type_name, i);
    container *c = ts__calloc(TS_MEM_NN, 1, sizeof *c);
    if (!c) return TS_ERR_NO_MEMORY;
    c->children = ts__calloc(TS_MEM_NN, (size_t)(n ? n : 1), sizeof *c->children);
    if (!c->children) {
        ts__free(TS_MEM_NN, c);
        return TS_ERR_NO_MEMORY;
    }
    ts_module_init(&c->base, vt);
    c->n = n;
    if (n) memcpy(c->children, children, (size_t)n * sizeof *children);
    /* a child in several slots is owned once per slot: container_free
     * frees every slot */
    for (int i = 1; i < n; i++)
        for (int j = 0; j < i; j++)
            if (children[j] == children[i]) {
                ts_module_retain(children[i]);
                break;
            }
    *out = &c->base;
    return TS_OK;
}

ts_status ts_sequential_new(int n, ts_module *const *children, ts_module **out)
{
    return container_new(&sequential_vt, n, children, out);
}

ts_status ts_module_list_new(int n, ts_module *const *children, ts_module **out)
{
    return container_new(&module_list_vt, n, children, out);
}

static container *as_container(ts_module *m)
{
    if (!m) return NULL;
    const ts_module_vtable *vt = m->vtable;
    while (vt && vt->base) vt = vt->base; /* a rewritten (fully_shard) container is still one */
    return vt == &sequential_vt || vt == &module_list_vt ? (container *)m : NULL;
}

ts_module *ts_container_child(ts_module *m, int i)
{
    container *c = as_container(m);
    return c && i >= 0 && i < c->n ? c->children[i] : NULL;
}

int ts_container_size(ts_module *m)
{
    container *c = as_container(m);
    return c ? c->n : 0;
}
