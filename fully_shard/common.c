/*
 * fully_shard's floor 1 (internal.h, "Floors"): the helpers every other
 * file of the folder calls and that call none of them: the event hook and
 * the trace spans of the hooks; the registries of replaced, persistent
 * and ignored parameters and the optimizer's check over them;
 * ts_fsdp_param_dtensor; growing arrays; a module's own type; the meta
 * checks; a group's reduction plan. May call: no other file of
 * fully_shard/ (repr.c and mp_policy.c are its floor-mates).
 */
#include "fully_shard/internal.h"

#include "comm/comm.h"
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

/* The calling thread's observer (memory.c's estimate). */
static _Thread_local ts_fsdp_event_fn tl_observer;
static _Thread_local void *tl_observer_ctx;

void ts__fsdp_set_observer(ts_fsdp_event_fn fn, void *ctx)
{
    tl_observer = fn;
    tl_observer_ctx = ctx;
}

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
    char fqn[TS__FSDP_FQN_MAX];
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

void ts__fsdp_reg_add(ts_tensor *t, fsdp_group *g, const char *fqn, bool persist)
{
    pthread_mutex_lock(&g_reg_mu);
    reg_list *l = persist ? &g_pers : &g_reg;
    if (!ts__fsdp_grow((void **)&l->e, &l->cap, l->n + 1, sizeof *l->e)) {
        pthread_mutex_unlock(&g_reg_mu);
        return; /* only costs the later diagnosis */
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
        ts__free(TS_MEM_NN, l->e);
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

void ts__fsdp_slot_add(ts_tensor *const *slot, const fsdp_group *g, const char *fqn)
{
    pthread_mutex_lock(&g_reg_mu);
    if (!ts__fsdp_grow((void **)&g_slots, &g_slots_cap, g_slots_n + 1, sizeof *g_slots)) {
        pthread_mutex_unlock(&g_reg_mu);
        return; /* only costs the later diagnosis */
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
        ts__free(TS_MEM_NN, g_slots);
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
bool ts__fsdp_ign_reserve(int n)
{
    pthread_mutex_lock(&g_reg_mu);
    bool ok = ts__fsdp_grow((void **)&g_ign, &g_ign_cap, g_ign_n + n, sizeof *g_ign);
    pthread_mutex_unlock(&g_reg_mu);
    return ok;
}

void ts__fsdp_ign_add(ts_tensor *t, const fsdp_state *s)
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
        ts__free(TS_MEM_NN, g_ign);
        g_ign = NULL;
        g_ign_cap = 0;
    }
    pthread_mutex_unlock(&g_reg_mu);
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
    char stale_fqn[TS__FSDP_FQN_MAX] = "";
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
                who, n_outside, n, first_outside, name[0] ? " '" : "", name, name[0] ? "'" : "", (long long)mesh_ranks);
    }
    return TS_OK;
}

void ts__fsdp_install_optim_check(void) { ts__optim_set_param_check(optim_check); }

/* ------------------------------------------------------------------ */
/* Parameters                                                         */
/* ------------------------------------------------------------------ */

const ts_dtensor *ts_fsdp_param_dtensor(const ts_tensor *t)
{
    if (!t || !ts_tensor_is_shard(t)) return NULL;
    return ts_tensor_dist_meta(t);
}

/* ------------------------------------------------------------------ */
/* Growing arrays, module types                                       */
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

/* The type a module had before fully_shard (or ts_checkpoint_module)
 * rewrote it ("" if unnamed). */
const char *ts__fsdp_own_type(const ts_module *m)
{
    const ts_module_vtable *vt = m->vtable;
    while (vt && vt->base) vt = vt->base;
    return vt && vt->type_name ? vt->type_name : "";
}

/* ------------------------------------------------------------------ */
/* Meta checks                                                        */
/* ------------------------------------------------------------------ */

/* Whether g's runtime plays on the meta device: param_group.c's
 * [Note: meta step]. */
bool ts__fsdp_group_meta(const fsdp_group *g)
{
    return ts__meta_mode() || (g && g->sharded && ts__is_meta(g->sharded));
}

static ts_status meta_error(const char *fn, const char *name)
{
    return ts_error(TS_ERR_STATE,
                    "%s: '%s' is on the meta device: call ts_fsdp_materialize (or load a checkpoint) first", fn, name);
}

ts_status ts__fsdp_check_materialized(const char *fn, ts_module *root)
{
    ts_named_params np = {0};
    ts_status st = ts__module_entries(root, true, true, true, &np);
    for (int i = 0; i < np.n && !st; i++)
        if (ts__is_meta(*np.items[i].slot)) st = meta_error(fn, np.items[i].name);
    ts_named_params_free(&np);
    return st;
}

ts_status ts__fsdp_group_check_materialized(const char *fn, const fsdp_group *g)
{
    if (!g->sharded || !ts__is_meta(g->sharded) || g->n == 0) return TS_OK;
    char name[2 * TS__FSDP_FQN_MAX + 2];
    snprintf(name, sizeof name, "%s%s%s", g->fqn, *g->fqn ? "." : "", g->params[0].fqn);
    return meta_error(fn, name);
}

/* ------------------------------------------------------------------ */
/* A group's reduction plan                                           */
/* ------------------------------------------------------------------ */

static bool is_hsdp(const fsdp_group *g) { return g->rg && ts_comm_size(g->rg) > 1; }

/* param_group.c's [Note: unused parameters] and FSDP2's
 * _get_gradient_divide_factors: the collectives and divisions of g's next
 * reduction (the reduce-scatter's, and persist.c's bucket's). */
fsdp_reduce_plan ts__fsdp_reduce_plan(const fsdp_group *g)
{
    int n_rs = g->W, n_ar = is_hsdp(g) ? ts_comm_size(g->rg) : 1;
    double n = (double)n_rs * n_ar, f = g->divide_factor;
    fsdp_reduce_plan p = {TS_REDUCE_AVG, TS_REDUCE_AVG, 1.0, 1.0, 1.0};
    if (g->force_sum) { /* SUM only, one division at the end: by f, or by N to average */
        p.rs_op = p.ar_op = TS_REDUCE_SUM;
        double d = f > 0 ? f : n;
        if (n_ar > 1) p.post = d;
        else p.rs_post = d;
    } else if (f > 0) { /* sum over every rank / f */
        p.ar_op = TS_REDUCE_SUM;
        if (f != (double)n_rs) {
            p.rs_op = TS_REDUCE_SUM; /* FSDP2's PREMUL_SUM(1/f): each input divided by f, then summed */
            p.rs_pre = f;
        }
    }
    return p;
}
