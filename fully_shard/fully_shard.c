/*
 * fully_shard: the API (fully_shard.h; docs/design.md D5; PyTorch's _fully_shard.py):
 * argument checks, collecting the parameters of a call, building its group
 * and states and swapping the shards into the modules' slots (and adding
 * them to common.c's registries); ts_fsdp_group_info_get.
 * The objects are described in internal.h.
 * Floor 6 (internal.h, "Floors"): may call floors 1-5.
 */
#include "fully_shard/internal.h"

#include "comm/comm.h"
#include "comm/launch.h"
#include "comm/comm_internal.h"
#include "mesh/mesh.h"
#include "nn/internal.h"
#include "tensor/internal.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* The calling thread's virtual world (memory.c's estimate). */
static _Thread_local ts_comm *tl_virtual_world;

void ts__fsdp_set_virtual_world(ts_comm *world) { tl_virtual_world = world; }

/* ------------------------------------------------------------------ */
/* Mistakes that would otherwise train silently (issue 9 §4)          */
/* ------------------------------------------------------------------ */

/* ts_fully_shard over the one-rank world while the launcher's variables
 * say the job has several ranks: every rank would train alone. */
static ts_status check_world_started(const char *fn, const ts_fsdp_options *o)
{
    if (ts_dist_is_initialized()) return TS_OK;
    if (o->mesh && ts_mesh_size(o->mesh, NULL) > 1) return TS_OK; /* a world made some other way (loopback) */
    if (o->mesh && tl_virtual_world && ts_mesh_world(o->mesh) == tl_virtual_world) return TS_OK; /* an estimate's */
    ts_rank_env env;
    char saved[1024];
    ts_status saved_st = ts_last_status();
    snprintf(saved, sizeof saved, "%s", ts_last_error());
    if (ts_launch_env(&env) == TS_OK) {
        if (env.world_size <= 1) return TS_OK;
        return ts_error(TS_ERR_STATE,
                        "%s: the launcher (%s) started this process as rank %d of %d, but ts_dist_init has not been "
                        "called: sharding over a one-rank world would make every rank train alone; call "
                        "ts_dist_init(NULL) before ts_fully_shard (and before making a mesh)",
                        fn, ts_launch_source_name(env.source), env.rank, env.world_size);
    }
    /* The variables are incomplete (say mpirun's without MASTER_PORT):
     * ts_dist_init would say what is missing, and a launcher that says
     * several ranks still means every rank would train alone. */
    char why[512];
    snprintf(why, sizeof why, "%s", ts_last_error());
    int claimed = ts__launch_env_world_size();
    if (claimed > 1)
        return ts_error(TS_ERR_STATE,
                        "%s: the launcher's variables say this process is one of %d ranks, but ts_dist_init has not "
                        "been called (and would fail: %s): sharding over a one-rank world would make every rank "
                        "train alone; call ts_dist_init(NULL) before ts_fully_shard",
                        fn, claimed, why);
    if (saved_st) ts_error(saved_st, "%s", saved); /* no launcher: nothing to say */
    else ts_clear_error();
    return TS_OK;
}

static bool ignored(const ts_fsdp_options *o, const ts_tensor *t)
{
    for (int i = 0; i < o->n_ignored_params; i++)
        if (o->ignored_params[i] == t) return true;
    return false;
}

static ts_status on_param(void *vc, const char *name, ts_tensor **slot)
{
    ts__fsdp_collect *c = vc;
    if (!*slot || ignored(c->o, *slot)) return TS_OK;
    char fqn[TS__FSDP_FQN_MAX];
    int len = snprintf(fqn, sizeof fqn, "%s%s%s", c->prefix, *c->prefix ? "." : "", name);
    if (len < 0 || len >= (int)sizeof fqn)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "fully_shard: the name '%s.%s' is too long", c->prefix, name);
    char gfqn[TS__FSDP_FQN_MAX], gtype[TS__FSDP_FQN_MAX];
    if (ts__fsdp_slot_owner(slot, gfqn, gtype, sizeof gfqn)) /* [Note: bottom-up] */
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "%s: parameter '%s' of this %s is already sharded by the FSDP group of an enclosing %s (its "
                        "'%s'), which was sharded first; fully_shard goes bottom-up: shard the children (this %s) "
                        "before their parent (the %s)",
                        c->fn, fqn, c->type, gtype, gfqn, c->type, gtype);
    ts__fsdp_pcand *p = NULL;
    for (int i = 0; i < c->n && !p; i++)
        if (c->c[i].t == *slot) p = &c->c[i];
    if (!p) {
        if (!ts__fsdp_grow((void **)&c->c, &c->cap, c->n + 1, sizeof *c->c)) return TS_ERR_NO_MEMORY;
        p = &c->c[c->n++];
        memset(p, 0, sizeof *p);
        p->t = *slot;
        snprintf(p->fqn, sizeof p->fqn, "%s", fqn);
    }
    if (!ts__fsdp_grow((void **)&p->slots, &p->cap_slots, p->n_slots + 1, sizeof *p->slots) ||
        !ts__fsdp_grow((void **)&p->owners, &p->cap_owners, p->n_slots + 1, sizeof *p->owners))
        return TS_ERR_NO_MEMORY;
    p->owners[p->n_slots] = c->top;
    p->slots[p->n_slots++] = slot;
    return TS_OK;
}

static ts_status walk_managed(ts__fsdp_collect *c, ts_module *m);

static ts_status on_child(void *vc, const char *name, ts_module *child)
{
    ts__fsdp_collect *c = vc;
    if (!child || ts_module_is_fsdp(child)) return TS_OK; /* sharded earlier: its own group */
    if (!child->vtable)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "fully_shard: child '%s%s%s' has no vtable (ts_module_init failed or was not called)",
                        c->prefix, *c->prefix ? "." : "", name ? name : "(null)");
    char saved[TS__FSDP_FQN_MAX];
    snprintf(saved, sizeof saved, "%s", c->prefix);
    int len = snprintf(c->prefix, sizeof c->prefix, "%s%s%s", saved, *saved ? "." : "", name);
    if (len < 0 || len >= (int)sizeof c->prefix) {
        snprintf(c->prefix, sizeof c->prefix, "%s", saved);
        return ts_error(TS_ERR_INVALID_ARGUMENT, "fully_shard: the name '%s.%s' is too long", saved, name);
    }
    ts_status st = walk_managed(c, child);
    snprintf(c->prefix, sizeof c->prefix, "%s", saved);
    return st;
}

/* Parameters come in named_parameters order (own first, then children's). */
static ts_status walk_managed(ts__fsdp_collect *c, ts_module *m)
{
    for (int i = 0; i < c->n_seen; i++)
        if (c->seen[i] == m) return TS_OK;
    if (!ts__fsdp_grow((void **)&c->seen, &c->cap_seen, c->n_seen + 1, sizeof *c->seen)) return TS_ERR_NO_MEMORY;
    c->seen[c->n_seen++] = m;
    ts_module_visitor pv = {on_param, NULL, c, NULL};
    ts_status st = ts_module_visit(m, &pv); /* the vtable's visit, or the declared slots */
    if (st) return st;
    ts_module_visitor cv = {NULL, on_child, c, NULL};
    return ts_module_visit(m, &cv);
}

static void collect_free(ts__fsdp_collect *c)
{
    for (int i = 0; i < c->n; i++) {
        ts__free(TS_MEM_NN, c->c[i].slots);
        ts__free(TS_MEM_NN, c->c[i].owners);
    }
    ts__free(TS_MEM_NN, c->c);
    ts__free(TS_MEM_NN, c->seen);
}

/* ------------------------------------------------------------------ */
/* Sharding                                                           */
/* ------------------------------------------------------------------ */

ts_fsdp_options ts_fsdp_options_default(void)
{
    ts_fsdp_options o;
    memset(&o, 0, sizeof o);
    o.reshard_after_forward = TS_RESHARD_AUTO;
    return o;
}

static ts_status check_options(const char *fn, const ts_fsdp_options *o)
{
    if ((unsigned)o->reshard_after_forward > TS_RESHARD_EVERY_N)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: reshard_after_forward %d is not a ts_reshard_policy", fn,
                        (int)o->reshard_after_forward);
    if (o->reshard_after_forward == TS_RESHARD_EVERY_N && o->reshard_every_n <= 0)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "%s: reshard_after_forward every N forwards needs N >= 1 (reshard_every_n = %d)", fn,
                        o->reshard_every_n);
    if (o->persist_threshold_numel < 0)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: persist_threshold_numel must be >= 0 (0: off), got %lld", fn,
                        (long long)o->persist_threshold_numel);
    if (o->n_ignored_params < 0 || (o->n_ignored_params && !o->ignored_params))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %d ignored parameters but no list", fn, o->n_ignored_params);
    if (o->mp_policy) {
        ts_status st = ts_mp_policy_check(o->mp_policy);
        if (st) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s", ts_last_error());
            return ts_error(st, "%s: %s", fn, msg);
        }
    }
    if (o->mesh) {
        int nd = ts_mesh_ndim(o->mesh);
        if (nd != 1 && nd != 2)
            return ts_error(TS_ERR_INVALID_ARGUMENT,
                            "%s: the mesh has %d dims; fully_shard takes a 1-d (shard) or 2-d (replicate, shard) mesh",
                            fn, nd);
        if (strcmp(ts_mesh_device_type(o->mesh), "cpu") != 0)
            return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: mesh device '%s' (only cpu)", fn,
                            ts_mesh_device_type(o->mesh));
        ts_comm *w = ts_mesh_world(o->mesh);
        if (ts_dist_is_initialized() && w != ts_dist_world() && w != tl_virtual_world)
            return ts_error(TS_ERR_INVALID_ARGUMENT,
                            "%s: the mesh (%lld ranks) was not made over the initialized world (%d ranks): make it "
                            "with ts_mesh_new after ts_dist_init",
                            fn, (long long)ts_mesh_size(o->mesh, NULL), ts_comm_size(ts_dist_world()));
    }
    return TS_OK;
}

/* Shards modules[0..n) into one group (n == 1 for ts_fully_shard). */
static ts_status shard_modules(const char *fn, int n, ts_module *const *modules, const ts_fsdp_options *opts)
{
    ts_fsdp_options o = opts ? *opts : ts_fsdp_options_default();
    ts_status st;
    if (n <= 0 || !modules) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: no modules (n = %d)", fn, n);
    for (int i = 0; i < n; i++) {
        if (!modules[i] || !modules[i]->vtable)
            return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: module %d %s", fn, i,
                            modules[i] ? "has no vtable (ts_module_init failed or was not called)" : "is NULL");
        if (ts_module_is_fsdp(modules[i]))
            return ts_error(TS_ERR_ALREADY, "%s: fully_shard has already been applied to this %s (module %d)", fn,
                            ts_module_type_name(modules[i]), i);
        for (int j = 0; j < i; j++)
            if (modules[j] == modules[i])
                return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: module %d is module %d again", fn, i, j);
        if (modules[i]->ext)
            return ts_error(TS_ERR_STATE, "%s: %s already carries another upper layer's state", fn,
                            ts_module_type_name(modules[i]));
    }
    if ((st = check_options(fn, &o))) return st;
    if ((st = check_world_started(fn, &o))) return st;
    ts__fsdp_install_optim_check();
    const ts_module_vtable **vts = ts__calloc(TS_MEM_NN, (size_t)n, sizeof *vts);
    fsdp_state **states = ts__calloc(TS_MEM_NN, (size_t)n, sizeof *states);
    if (!vts || !states) {
        ts__free(TS_MEM_NN, vts);
        ts__free(TS_MEM_NN, states);
        return TS_ERR_NO_MEMORY;
    }
    for (int i = 0; i < n && !st; i++) {
        st = ts__module_check_free("fully_shard", modules[i]);
        if (!st) st = ts__fsdp_vtable(modules[i]->vtable, &vts[i]);
    }
    if (st) {
        ts__free(TS_MEM_NN, vts);
        ts__free(TS_MEM_NN, states);
        return st;
    }

    ts__fsdp_collect c;
    memset(&c, 0, sizeof c);
    c.o = &o;
    for (int i = 0; i < n && !st; i++) {
        c.prefix[0] = '\0';
        c.top = i;
        c.fn = fn;
        c.type = ts_module_type_name(modules[i]);
        if (n > 1) snprintf(c.prefix, sizeof c.prefix, "[%d]", i);
        st = walk_managed(&c, modules[i]);
    }
    fsdp_group *g = NULL;
    fsdp_persist *persist = NULL;
    int n_persist = 0;
    if (!st) st = ts__fsdp_persist_take(fn, &c, &o, &persist, &n_persist);
    if (!st) st = ts__fsdp_group_new(fn, &c, &o, n, &g);
    if (!st) {
        g->persist = persist; /* moved: freed with the group */
        g->n_persist = n_persist;
        persist = NULL;
    }
    for (int i = 0; i < n && !st; i++) {
        states[i] = ts__calloc(TS_MEM_NN, 1, sizeof *states[i]);
        int nm = modules[i]->vtable->n_methods;
        if (!states[i] || (nm && !(states[i]->method_wrapped = ts__calloc(TS_MEM_NN, (size_t)nm, sizeof(bool)))))
            st = TS_ERR_NO_MEMORY;
    }
    if (!st && !ts__fsdp_ign_reserve(o.n_ignored_params)) st = ts_error(TS_ERR_NO_MEMORY, "%s: out of memory", fn);
    if (st) {
        for (int i = 0; i < n; i++) {
            if (states[i]) ts__free(TS_MEM_NN, states[i]->method_wrapped);
            ts__free(TS_MEM_NN, states[i]);
        }
        ts__free(TS_MEM_NN, vts);
        ts__free(TS_MEM_NN, states);
        if (g) ts__fsdp_group_free(g);
        ts__fsdp_persist_free(persist, n_persist);
        collect_free(&c);
        return st;
    }
    /* From here nothing fails. */
    for (int i = 0; i < c.n; i++) {
        fsdp_param *p = &g->params[i];
        ts_tensor *orig = ts_tensor_retain(c.c[i].t);
        p->slots = c.c[i].slots; /* moved */
        p->slot_owner = c.c[i].owners;
        p->n_slots = c.c[i].n_slots;
        c.c[i].slots = NULL;
        c.c[i].owners = NULL;
        for (int k = 0; k < p->n_slots; k++) ts__fsdp_swap_slot(p->slots[k], p->S);
        /* still held elsewhere (a tied weight outside the call, or the
         * user): remember it, so that sharding it again is diagnosed */
        if (atomic_load(&orig->refcount) > 1) ts__fsdp_reg_add(orig, g, p->fqn, false);
        ts_tensor_free(orig);
        for (int k = 0; k < p->n_slots; k++) ts__fsdp_slot_add(p->slots[k], g, p->fqn);
    }
    /* the persistent parameters stay in their slots; remembered so that
     * another call finding them says so, and the optimizer counts them */
    for (int i = 0; i < g->n_persist; i++) {
        ts__fsdp_reg_add(g->persist[i].t, g, g->persist[i].fqn, true);
        for (int k = 0; k < g->persist[i].n_slots; k++) ts__fsdp_slot_add(g->persist[i].slots[k], g, g->persist[i].fqn);
    }
    bool have_params = g->n > 0 || g->n_persist > 0;
    for (int i = 0; i < n; i++) {
        fsdp_state *s = states[i];
        atomic_init(&s->refs, 1);
        s->module = modules[i];
        s->orig_vt = modules[i]->vtable;
        s->group = have_params ? ts__fsdp_group_retain(g) : NULL;
        s->index = i;
        s->mp = o.mp_policy ? *o.mp_policy : ts_mp_policy_default();
        snprintf(s->fqn, sizeof s->fqn, "%s", ts_module_type_name(modules[i]));
        modules[i]->ext = s;
        modules[i]->vtable = vts[i];
    }
    /* the ignored parameters, remembered for the optimizer's check */
    for (int i = 0; i < o.n_ignored_params; i++)
        if (o.ignored_params[i]) ts__fsdp_ign_add(o.ignored_params[i], states[0]);
    snprintf(g->fqn, sizeof g->fqn, "%s", states[0]->fqn);
    ts__fsdp_group_release(g); /* the states hold it (or nothing did: freed) */
    collect_free(&c);
    ts__free(TS_MEM_NN, vts);
    ts__free(TS_MEM_NN, states);
    return TS_OK;
}

ts_status ts_fully_shard(ts_module *module, const ts_fsdp_options *options)
{
    return shard_modules("ts_fully_shard", 1, &module, options);
}

ts_status ts_fully_shard_each(int n, ts_module *const *modules, const ts_fsdp_options *options)
{
    if (n <= 0 || !modules) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_fully_shard_each: no modules (n = %d)", n);
    for (int i = 0; i < n; i++) {
        ts_status st = shard_modules("ts_fully_shard_each", 1, &modules[i], options);
        if (st) return st;
    }
    return TS_OK;
}

ts_status ts_fully_shard_group(int n, ts_module *const *modules, const ts_fsdp_options *options)
{
    return shard_modules("ts_fully_shard_group", n, modules, options);
}

ts_status ts_fsdp_group_info_get(const ts_module *module, ts_fsdp_group_info *out)
{
    fsdp_state *s = ts__fsdp_state_of(module);
    if (!s || !out) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_fsdp_group_info_get: not an FSDP module or NULL out");
    memset(out, 0, sizeof *out);
    fsdp_group *g = s->group;
    if (!g) {
        out->shard_world = 1;
        return TS_OK;
    }
    out->n_params = g->n;
    out->shard_world = g->W;
    out->numel = g->numel;
    out->shard_numel = g->shard_numel;
    out->padded_numel = g->shard_numel * g->W;
    out->padding = out->padded_numel - g->numel;
    out->local_numel = g->local_numel;
    out->n_persistent = g->n_persist;
    for (int i = 0; i < g->n_persist; i++) out->persistent_numel += ts_tensor_numel(g->persist[i].t);
    return TS_OK;
}
