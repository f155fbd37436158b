/*
 * fully_shard: the API (fully_shard.h; DESIGN.md D5; PyTorch's _fully_shard.py):
 * argument checks, collecting the parameters of a call, building its group
 * and states and swapping the shards into the modules' slots; the event
 * hook; the registries of replaced and ignored parameters and the
 * optimizer's check over them; ts_fsdp_group_info_get.
 * The objects are described in internal.h.
 */
#include "fully_shard/internal.h"

#include "comm/comm.h"
#include "comm/launch.h"
#include "comm/comm_internal.h"
#include "mesh/mesh.h"
#include "nn/internal.h"
#include "optim/internal.h"
#include "tensor/internal.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ */
/* Events                                                             */
/* ------------------------------------------------------------------ */

static ts_fsdp_event_fn g_event_fn;
static void *g_event_ctx;

void ts_fsdp_set_event_hook(ts_fsdp_event_fn fn, void *ctx)
{
    g_event_fn = fn;
    g_event_ctx = ctx;
}

/* The calling thread's observer (memory.c's estimate) and virtual world. */
static _Thread_local ts_fsdp_event_fn tl_observer;
static _Thread_local void *tl_observer_ctx;
static _Thread_local ts_comm *tl_virtual_world;

void ts__fsdp_set_observer(ts_fsdp_event_fn fn, void *ctx)
{
    tl_observer = fn;
    tl_observer_ctx = ctx;
}

void ts__fsdp_set_virtual_world(ts_comm *world) { tl_virtual_world = world; }

void ts__fsdp_event(const char *what, const char *fqn)
{
    ts_logf(TS_LOG_DEBUG, "FSDP::%s (%s)", what, fqn);
    if (g_event_fn) g_event_fn(g_event_ctx, what, fqn);
    if (tl_observer) tl_observer(tl_observer_ctx, what, fqn);
}

/* A hook's span in the trace (TS_TRACE), from t0 (0: not tracing) to now,
 * with the module's FQN and its group's. */
void ts__fsdp_trace_hook(uint64_t t0, const char *name, const char *fqn, const fsdp_group *g)
{
    if (!t0) return;
    ts_trace_arg a[2] = {{"fqn", fqn, 0}, {"group", g ? g->fqn : "", 0}};
    ts_trace_span_args(name, "fsdp", t0, ts_now_ns(), 2, a);
}

/* ------------------------------------------------------------------ */
/* Registry of the original tensors of sharded parameters             */
/* ------------------------------------------------------------------ */

/* A parameter tensor that fully_shard replaced but that something else
 * still holds (another module's slot: a tied weight outside the call) is
 * kept here, retained, so that a later call finding it can say that it is
 * shared with an existing group. Persistent parameters (below the
 * persistence threshold, still the modules' own tensors) are kept in a
 * list of their own, for the same diagnosis and so that the optimizer's
 * check counts them as managed; apart, because the optimizer looks every
 * parameter up in the first list at every step (that list is usually
 * empty; the persistent one can hold every parameter of the model). */
typedef struct reg_entry {
    ts_tensor *t;
    fsdp_group *g;
    char fqn[FQN_MAX];
} reg_entry;

typedef struct reg_list {
    reg_entry *e;
    int n, cap;
} reg_list;

static pthread_mutex_t g_reg_mu = PTHREAD_MUTEX_INITIALIZER;
static reg_list g_reg, g_pers; /* replaced tensors; persistent parameters */

static const reg_entry *reg_find_in(const reg_list *l, const ts_tensor *t)
{
    for (int i = 0; i < l->n; i++)
        if (l->e[i].t == t) return &l->e[i];
    return NULL;
}

static const reg_entry *reg_find(const ts_tensor *t) { return reg_find_in(&g_reg, t); }

static void reg_add(ts_tensor *t, fsdp_group *g, const char *fqn, bool persist)
{
    pthread_mutex_lock(&g_reg_mu);
    reg_list *l = persist ? &g_pers : &g_reg;
    if (l->n == l->cap) {
        int cap = l->cap ? 2 * l->cap : 16;
        reg_entry *n = realloc(l->e, (size_t)cap * sizeof *n);
        if (!n) {
            pthread_mutex_unlock(&g_reg_mu);
            return; /* only costs the later diagnosis */
        }
        l->e = n;
        l->cap = cap;
    }
    reg_entry *e = &l->e[l->n++];
    e->t = ts_tensor_retain(t);
    e->g = g;
    snprintf(e->fqn, sizeof e->fqn, "%s", fqn);
    pthread_mutex_unlock(&g_reg_mu);
}

bool ts__fsdp_is_persistent(const ts_tensor *t)
{
    pthread_mutex_lock(&g_reg_mu);
    bool p = reg_find_in(&g_pers, t) != NULL;
    pthread_mutex_unlock(&g_reg_mu);
    return p;
}

bool ts__fsdp_reg_owner(const ts_tensor *t, char *other, size_t cap)
{
    pthread_mutex_lock(&g_reg_mu);
    const reg_entry *e = reg_find(t);
    if (!e) e = reg_find_in(&g_pers, t);
    if (e) snprintf(other, cap, "%s", e->fqn);
    pthread_mutex_unlock(&g_reg_mu);
    return e != NULL;
}

static void reg_drop_in(reg_list *l, const fsdp_group *g)
{
    int k = 0;
    for (int i = 0; i < l->n; i++) {
        if (l->e[i].g == g) ts_tensor_free(l->e[i].t);
        else l->e[k++] = l->e[i];
    }
    l->n = k;
    if (!l->n) {
        free(l->e);
        *l = (reg_list){0};
    }
}

/* [Note: bottom-up]
 * A call takes the parameters of its module's subtree that no earlier call
 * took, so children are sharded before their parents (each block, then the
 * root). A parent sharded first has put its shards (or, for persistent
 * parameters, kept the tensors) in its children's slots; a later call on a
 * child then meets, in its own subtree, slots that the parent's group
 * manages. Every slot a group manages is listed here (not retained; dropped
 * with the group), so that this mistake is told apart from a tied weight
 * (the same tensor in a slot that no group manages: the registry above) and
 * the message says to shard bottom-up, naming the enclosing module. */
typedef struct slot_entry {
    ts_tensor *const *slot;
    const fsdp_group *g;
    const char *fqn; /* the parameter's name in the group (the group's own string) */
} slot_entry;

static slot_entry *g_slots;
static int g_slots_n, g_slots_cap;

static void slot_add(ts_tensor *const *slot, const fsdp_group *g, const char *fqn)
{
    pthread_mutex_lock(&g_reg_mu);
    if (g_slots_n == g_slots_cap) {
        int cap = g_slots_cap ? 2 * g_slots_cap : 64;
        slot_entry *n = realloc(g_slots, (size_t)cap * sizeof *n);
        if (!n) {
            pthread_mutex_unlock(&g_reg_mu);
            return; /* only costs the later diagnosis */
        }
        g_slots = n;
        g_slots_cap = cap;
    }
    g_slots[g_slots_n++] = (slot_entry){slot, g, fqn};
    pthread_mutex_unlock(&g_reg_mu);
}

bool ts__fsdp_slot_owner(ts_tensor *const *slot, char *fqn, char *type, size_t cap)
{
    pthread_mutex_lock(&g_reg_mu);
    const slot_entry *e = NULL;
    for (int i = 0; i < g_slots_n && !e; i++)
        if (g_slots[i].slot == slot) e = &g_slots[i];
    if (e) {
        snprintf(fqn, cap, "%s", e->fqn);
        snprintf(type, cap, "%s", e->g->fqn);
    }
    pthread_mutex_unlock(&g_reg_mu);
    return e != NULL;
}

void ts__fsdp_reg_drop_group(fsdp_group *g)
{
    pthread_mutex_lock(&g_reg_mu);
    reg_drop_in(&g_reg, g);
    reg_drop_in(&g_pers, g);
    int k = 0;
    for (int i = 0; i < g_slots_n; i++)
        if (g_slots[i].g != g) g_slots[k++] = g_slots[i];
    g_slots_n = k;
    if (!g_slots_n) {
        free(g_slots);
        g_slots = NULL;
        g_slots_cap = 0;
    }
    pthread_mutex_unlock(&g_reg_mu);
}

/* The parameters given as ignored_params (retained), each with the state
 * of the call that named it (dropped with that state): the optimizer's
 * check does not count them as left outside every group by mistake. */
typedef struct ign_entry {
    ts_tensor *t;
    const fsdp_state *s;
} ign_entry;

static ign_entry *g_ign;
static int g_ign_n, g_ign_cap;

/* Room for n more entries (so that adding them cannot fail). */
static bool ign_reserve(int n)
{
    pthread_mutex_lock(&g_reg_mu);
    bool ok = true;
    if (g_ign_n + n > g_ign_cap) {
        int cap = g_ign_cap ? g_ign_cap : 16;
        while (cap < g_ign_n + n) cap *= 2;
        ign_entry *e = realloc(g_ign, (size_t)cap * sizeof *e);
        if (e) {
            g_ign = e;
            g_ign_cap = cap;
        } else {
            ok = false;
        }
    }
    pthread_mutex_unlock(&g_reg_mu);
    return ok;
}

static void ign_add(ts_tensor *t, const fsdp_state *s)
{
    pthread_mutex_lock(&g_reg_mu);
    if (g_ign_n < g_ign_cap) g_ign[g_ign_n++] = (ign_entry){ts_tensor_retain(t), s};
    pthread_mutex_unlock(&g_reg_mu);
}

void ts__fsdp_ign_drop_state(const fsdp_state *s)
{
    pthread_mutex_lock(&g_reg_mu);
    int k = 0;
    for (int i = 0; i < g_ign_n; i++) {
        if (g_ign[i].s == s) ts_tensor_free(g_ign[i].t);
        else g_ign[k++] = g_ign[i];
    }
    g_ign_n = k;
    if (!g_ign_n) {
        free(g_ign);
        g_ign = NULL;
        g_ign_cap = 0;
    }
    pthread_mutex_unlock(&g_reg_mu);
}

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

/* Called by every optimizer step before it changes anything (optim's
 * hook): an optimizer over tensors fully_shard replaced fails (they are no
 * longer the module's: their gradients never come); at the first step,
 * parameters outside every FSDP group next to parameters sharded over
 * more than one rank get a warning (their gradients are not averaged: the
 * ranks' copies drift apart). */
static ts_status optim_check(const char *who, int n, ts_tensor *const *params, bool first_step)
{
    pthread_mutex_lock(&g_reg_mu);
    int stale = -1;
    char stale_fqn[FQN_MAX] = "";
    int n_stale = 0;
    for (int i = 0; i < n && g_reg.n; i++) {
        const reg_entry *e = reg_find(params[i]);
        if (!e) continue;
        if (stale < 0) {
            stale = i;
            snprintf(stale_fqn, sizeof stale_fqn, "%s", e->fqn);
        }
        n_stale++;
    }
    int n_outside = 0, first_outside = -1;
    int64_t mesh_ranks = 1;
    if (stale < 0 && first_step) {
        for (int i = 0; i < n; i++) {
            const ts_dtensor *dt = ts_fsdp_param_dtensor(params[i]);
            if (dt) {
                int64_t r = ts_mesh_size(ts_dtensor_mesh(dt), NULL);
                if (r > mesh_ranks) mesh_ranks = r;
                continue;
            }
            bool ign = false;
            for (int k = 0; k < g_ign_n && !ign; k++) ign = g_ign[k].t == params[i];
            if (ign || reg_find_in(&g_pers, params[i])) continue; /* ignored, or persistent (reduced by fully_shard) */
            if (first_outside < 0) first_outside = i;
            n_outside++;
        }
    }
    pthread_mutex_unlock(&g_reg_mu);
    if (stale >= 0)
        return ts_error(TS_ERR_STATE,
                        "%s step: %d of its %d parameters (the first: parameter %d, '%s') are no longer the model's: "
                        "ts_fully_shard replaced them with their shards after this optimizer was built, so they "
                        "would never get a gradient; build the optimizer after ts_fully_shard, from "
                        "ts_module_parameters(model)",
                        who, n_stale, n, stale, stale_fqn);
    if (n_outside && mesh_ranks > 1) {
        const char *name = ts_tensor_name(params[first_outside]);
        ts_logf(TS_LOG_WARN,
                "%s: %d of its %d parameters (the first: parameter %d%s%s%s) are outside every FSDP group while the "
                "others are sharded over %lld ranks: their gradients are not averaged across ranks, so each rank's "
                "copy drifts apart; shard the root too (ts_fully_shard(model) after its blocks), or pass them as "
                "ignored_params and keep them in sync yourself",
                who, n_outside, n, first_outside, name[0] ? " '" : "", name, name[0] ? "'" : "",
                (long long)mesh_ranks);
    }
    return TS_OK;
}

static void install_optim_check(void) { ts__optim_set_param_check(optim_check); }

/* ------------------------------------------------------------------ */
/* Parameters                                                         */
/* ------------------------------------------------------------------ */

const ts_dtensor *ts_fsdp_param_dtensor(const ts_tensor *t)
{
    if (!t || !ts_tensor_is_shard(t)) return NULL;
    return ts_tensor_dist_meta(t);
}

/* ------------------------------------------------------------------ */
/* Collecting what a call manages                                     */
/* ------------------------------------------------------------------ */

bool ts__fsdp_grow(void **arr, int *cap, int need, size_t elem)
{
    if (need <= *cap) return true;
    int cap2 = *cap ? *cap : 8;
    while (cap2 < need) cap2 *= 2;
    void *n = ts__malloc(TS_MEM_NN, (size_t)cap2 * elem);
    if (!n) return false;
    if (*cap) memcpy(n, *arr, (size_t)*cap * elem);
    ts__free(TS_MEM_NN, *arr);
    *arr = n;
    *cap = cap2;
    return true;
}

static bool ignored(const ts_fsdp_options *o, const ts_tensor *t)
{
    for (int i = 0; i < o->n_ignored_params; i++)
        if (o->ignored_params[i] == t) return true;
    return false;
}

static ts_status on_param(void *vc, const char *name, ts_tensor **slot)
{
    collect *c = vc;
    if (!*slot || ignored(c->o, *slot)) return TS_OK;
    char fqn[FQN_MAX];
    int len = snprintf(fqn, sizeof fqn, "%s%s%s", c->prefix, *c->prefix ? "." : "", name);
    if (len < 0 || len >= (int)sizeof fqn)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "fully_shard: the name '%s.%s' is too long", c->prefix, name);
    char gfqn[FQN_MAX], gtype[FQN_MAX];
    if (ts__fsdp_slot_owner(slot, gfqn, gtype, sizeof gfqn)) /* [Note: bottom-up] */
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "%s: parameter '%s' of this %s is already sharded by the FSDP group of an enclosing %s (its "
                        "'%s'), which was sharded first; fully_shard goes bottom-up: shard the children (this %s) "
                        "before their parent (the %s)",
                        c->fn, fqn, c->type, gtype, gfqn, c->type, gtype);
    pcand *p = NULL;
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

static ts_status walk_managed(collect *c, ts_module *m);

static ts_status on_child(void *vc, const char *name, ts_module *child)
{
    collect *c = vc;
    if (!child || ts_module_is_fsdp(child)) return TS_OK; /* sharded earlier: its own group */
    if (!child->vtable)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "fully_shard: child '%s%s%s' has no vtable (ts_module_init failed or was not called)", c->prefix,
                        *c->prefix ? "." : "", name ? name : "(null)");
    char saved[FQN_MAX];
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
static ts_status walk_managed(collect *c, ts_module *m)
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

static void collect_free(collect *c)
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
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "%s: persist_threshold_numel must be >= 0 (0: off), got %lld", fn,
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
    install_optim_check();
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

    collect c;
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
    if (!st && !ign_reserve(o.n_ignored_params)) st = ts_error(TS_ERR_NO_MEMORY, "%s: out of memory", fn);
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
        if (atomic_load(&orig->refcount) > 1) reg_add(orig, g, p->fqn, false);
        ts_tensor_free(orig);
        for (int k = 0; k < p->n_slots; k++) slot_add(p->slots[k], g, p->fqn);
    }
    /* the persistent parameters stay in their slots; remembered so that
     * another call finding them says so, and the optimizer counts them */
    for (int i = 0; i < g->n_persist; i++) {
        reg_add(g->persist[i].t, g, g->persist[i].fqn, true);
        for (int k = 0; k < g->persist[i].n_slots; k++) slot_add(g->persist[i].slots[k], g, g->persist[i].fqn);
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
        if (o.ignored_params[i]) ign_add(o.ignored_params[i], states[0]);
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
