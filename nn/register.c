/* Declared slots: a module type lists its parameters, buffers and children
 * once, in its constructor (ts_module_register_*), and the base derives
 * the visit and the freeing from that list (nn/nn.h, "declared slots").
 *
 * [Note: declared slots] The list lives in m->reg, owned by the base. The
 * derived visit reports the slots' addresses, the same addresses a
 * hand-written visit would report, so every walker (FQNs, state dicts,
 * fully_shard's slot swaps, the checkpoint wrapper, deferred init,
 * printing) sees no difference. Upper layers' vtables copy the original's
 * visit (NULL here) and reach the list through ts_module_visit. Freeing
 * goes through ts__module_release, which the upper layers' free slots
 * call too once they have put the original vtable back. */
#include "nn/internal.h"

#include <string.h>

typedef enum reg_kind { REG_PARAM, REG_BUFFER, REG_CHILD } reg_kind;

typedef struct reg_entry {
    char *name;
    reg_kind kind;
    void *slot; /* ts_tensor ** or ts_module ** */
} reg_entry;

struct ts__module_reg {
    reg_entry *entries;
    int n, cap;
    bool base_allocated; /* the struct came from ts_module_new: the base frees it */
};

#define REG_NAME_MAX 255

static const char *const kind_names[] = {"parameter", "buffer", "child"};

static ts_status reg_get(ts_module *m, struct ts__module_reg **out)
{
    if (!m->reg && !(m->reg = ts__calloc(TS_MEM_NN, 1, sizeof *m->reg)))
        return ts_error(TS_ERR_NO_MEMORY, "%s: out of memory (declaring a slot)", ts_module_type_name(m));
    *out = m->reg;
    return TS_OK;
}

ts_status ts_module_new(size_t size, const ts_module_vtable *vt, ts_module **out)
{
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_module_new: out is NULL");
    if (size < sizeof(ts_module))
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "ts_module_new: size %zu is smaller than a ts_module (%zu): pass sizeof your struct, whose "
                        "first member is the ts_module",
                        size, sizeof(ts_module));
    ts_status st = ts__module_vtable_check("ts_module_new", vt, false);
    if (st) return st;
    ts_module *m = ts__calloc(TS_MEM_NN, 1, size);
    if (!m || reg_get(m, &m->reg)) {
        ts__free(TS_MEM_NN, m);
        return ts_error(TS_ERR_NO_MEMORY, "ts_module_new: out of memory (%s of %zu bytes)", vt->type_name, size);
    }
    m->vtable = vt;
    m->training = true;
    m->reg->base_allocated = true;
    *out = m;
    return TS_OK;
}

static ts_status check_name(const char *fn, ts_module *m, const char *name)
{
    const char *t = ts_module_type_name(m);
    if (!name[0]) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %s: the name is empty", fn, t);
    if (strchr(name, '.'))
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "%s: %s: the name '%s' contains '.' (dots join the names of a fully qualified name)", fn, t,
                        name);
    size_t len = strlen(name);
    if (len > REG_NAME_MAX)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %s: a name of %zu characters (at most %d)", fn, t, len,
                        REG_NAME_MAX);
    return TS_OK;
}

/* TS_ERR_SHARDED when a declared parameter of m or *slot holds a shard:
 * an enclosing module was sharded, and a slot declared now would not be
 * in its group. */
static ts_status check_not_sharded(const char *fn, ts_module *m, const char *name, reg_kind kind, void *slot)
{
    const char *t = ts_module_type_name(m);
    if (kind != REG_CHILD && ts_tensor_is_shard(*(ts_tensor **)slot))
        return ts_error(TS_ERR_SHARDED, "%s: %s: the slot of '%s' holds a shard; declare slots before ts_fully_shard",
                        fn, t, name);
    for (int i = 0; m->reg && i < m->reg->n; i++) {
        const reg_entry *e = &m->reg->entries[i];
        if (e->kind == REG_PARAM && ts_tensor_is_shard(*(ts_tensor **)e->slot))
            return ts_error(TS_ERR_SHARDED,
                            "%s: %s: cannot declare '%s': its parameter '%s' is sharded already (an enclosing module "
                            "was sharded); declare slots in the constructor, before ts_fully_shard",
                            fn, t, name, e->name);
    }
    return TS_OK;
}

static ts_status reg_add(const char *fn, ts_module *m, const char *name, reg_kind kind, void *slot)
{
    if (!m || !name || !slot)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %s is NULL", fn,
                        !m          ? "the module"
                            : !name ? "the name"
                                    : "the slot");
    if (!m->vtable)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "%s: the module has no vtable (ts_module_init failed or was not "
                        "called)",
                        fn);
    const char *t = ts_module_type_name(m);
    ts_status st = check_name(fn, m, name);
    if (st) return st;
    if ((st = check_not_sharded(fn, m, name, kind, slot))) return st;
    if (m->vtable->base)
        return ts_error(TS_ERR_STATE,
                        "%s: %s was rewritten by an upper layer (ts_fully_shard or ts_checkpoint_module); declare "
                        "'%s' in the constructor, before",
                        fn, t, name);
    if (m->vtable->visit)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "%s: %s has its own visit; list '%s' there, or leave the vtable's visit NULL and declare every "
                        "slot",
                        fn, t, name);
    for (int i = 0; m->reg && i < m->reg->n; i++) {
        const reg_entry *e = &m->reg->entries[i];
        if (strcmp(e->name, name) == 0)
            return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %s already has a %s named '%s'", fn, t, kind_names[e->kind],
                            name);
        if (e->slot == slot)
            return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %s: the slot given for '%s' is declared already, as %s '%s'",
                            fn, t, name, kind_names[e->kind], e->name);
    }
    struct ts__module_reg *r = NULL;
    if ((st = reg_get(m, &r))) return st;
    if (r->n == r->cap) {
        int cap = r->cap ? 2 * r->cap : 8;
        reg_entry *grown = ts__malloc(TS_MEM_NN, (size_t)cap * sizeof *grown);
        if (!grown) return ts_error(TS_ERR_NO_MEMORY, "%s: %s: out of memory", fn, t);
        if (r->n) memcpy(grown, r->entries, (size_t)r->n * sizeof *grown);
        ts__free(TS_MEM_NN, r->entries);
        r->entries = grown;
        r->cap = cap;
    }
    char *copy = ts__strdup(TS_MEM_NN, name);
    if (!copy) return ts_error(TS_ERR_NO_MEMORY, "%s: %s: out of memory", fn, t);
    r->entries[r->n++] = (reg_entry){copy, kind, slot};
    return TS_OK;
}

ts_status ts_module_register_param(ts_module *m, const char *name, ts_tensor **slot)
{
    return reg_add("ts_module_register_param", m, name, REG_PARAM, slot);
}

ts_status ts_module_register_buffer(ts_module *m, const char *name, ts_tensor **slot)
{
    return reg_add("ts_module_register_buffer", m, name, REG_BUFFER, slot);
}

ts_status ts_module_register_child(ts_module *m, const char *name, ts_module **slot)
{
    return reg_add("ts_module_register_child", m, name, REG_CHILD, slot);
}

/* Declares the NULL slot first (the checks), then fills it; a failed fill
 * takes the declaration back, so that nothing changes on an error. */
static ts_status add_new(const char *fn, ts_module *m, const char *name, reg_kind kind, ts_dtype dtype, int ndim,
                         const int64_t *shape, ts_tensor **slot)
{
    if (slot && *slot)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: the slot for '%s' already holds a tensor", fn,
                        name ? name : "(null)");
    ts_status st = reg_add(fn, m, name, kind, slot);
    if (st) return st;
    ts_tensor *t = NULL;
    if (kind == REG_PARAM) {
        st = ts_param_new(dtype, ndim, shape, &t);
    } else if (!(st = ts_tensor_zeros(dtype, ndim, shape, &t)) && ts_tensor_is_meta(t) &&
               (st = ts_tensor_fill_(t, 0.0))) {
        ts_tensor_free(t); /* deferred: the zeros recorded, as ts_param_new records them */
        t = NULL;
    }
    if (st) {
        ts__free(TS_MEM_NN, m->reg->entries[--m->reg->n].name);
        return st;
    }
    *slot = t;
    return TS_OK;
}

ts_status ts_module_param_new(ts_module *m, const char *name, ts_dtype dtype, int ndim, const int64_t *shape,
                              ts_tensor **slot)
{
    return add_new("ts_module_param_new", m, name, REG_PARAM, dtype, ndim, shape, slot);
}

ts_status ts_module_buffer_new(ts_module *m, const char *name, ts_dtype dtype, int ndim, const int64_t *shape,
                               ts_tensor **slot)
{
    return add_new("ts_module_buffer_new", m, name, REG_BUFFER, dtype, ndim, shape, slot);
}

ts_status ts_module_visit(ts_module *m, const ts_module_visitor *v)
{
    if (!m || !v)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_module_visit: %s is NULL", m ? "the visitor" : "the module");
    if (!m->vtable)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "ts_module_visit: the module has no vtable (ts_module_init failed "
                        "or was not called)");
    if (m->vtable->visit) return m->vtable->visit(m, v);
    const struct ts__module_reg *r = m->reg;
    ts_status st = TS_OK;
    /* each kind in declaration order: parameters, buffers, children */
    for (int k = REG_PARAM; k <= REG_CHILD && !st; k++)
        for (int i = 0; r && i < r->n && !st; i++) {
            const reg_entry *e = &r->entries[i];
            if ((int)e->kind != k) continue;
            if (k == REG_PARAM && v->param) st = v->param(v->ctx, e->name, (ts_tensor **)e->slot);
            else if (k == REG_BUFFER && v->buffer) st = v->buffer(v->ctx, e->name, (ts_tensor **)e->slot);
            else if (k == REG_CHILD && v->child) st = v->child(v->ctx, e->name, *(ts_module **)e->slot);
        }
    return st;
}

ts_status ts__module_check_free(const char *fn, const ts_module *m)
{
    if (m && m->vtable && !m->vtable->free && !(m->reg && m->reg->base_allocated))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: the vtable of %s has no free function", fn,
                        ts_module_type_name(m));
    return TS_OK;
}

void ts__module_release(ts_module *m)
{
    if (m->vtable && m->vtable->base && m->vtable->free) {
        m->vtable->free(m); /* still an upper layer's (a checkpoint under fully_shard): it comes back here */
        return;
    }
    struct ts__module_reg *r = m->reg;
    bool base_allocated = r && r->base_allocated;
    if (r) {
        for (int i = r->n - 1; i >= 0; i--) { /* the reverse of the declarations */
            reg_entry *e = &r->entries[i];
            if (e->kind == REG_CHILD) {
                ts_module *c = *(ts_module **)e->slot;
                *(ts_module **)e->slot = NULL;
                ts_module_free(c);
            } else {
                ts_tensor *t = *(ts_tensor **)e->slot;
                *(ts_tensor **)e->slot = NULL;
                ts_tensor_free(t);
            }
            ts__free(TS_MEM_NN, e->name);
        }
        ts__free(TS_MEM_NN, r->entries);
        ts__free(TS_MEM_NN, r);
        m->reg = NULL;
    }
    if (m->vtable && m->vtable->free) m->vtable->free(m);
    else if (base_allocated) ts__free(TS_MEM_NN, m);
}
