#define _GNU_SOURCE
/*
 * fully_shard (fully_shard.h; DESIGN.md D5, D6; FSDP2-NOTES.md §2).
 *
 * Objects
 *  - fsdp_param: one parameter of a group: its slots (every slot of the
 *    managed modules that held the tensor: tied weights inside a group),
 *    the sharded leaf S (a view of the group's sharded buffer, marked as a
 *    shard, with a DTensor), the unsharded leaf U (its own storage,
 *    released while sharded, so autograd's saved references to it stay
 *    valid), and its geometry: rows, row_numel, chunk rows c = ceil(rows/W),
 *    local rows, and its offset in the per-rank (padded) shard.
 *  - fsdp_group: the parameters sharded by one call (one all-gather, one
 *    reduce-scatter), the shard group (and the replicate group for HSDP),
 *    the sharded buffer (shard_numel elements: each parameter padded to c
 *    rows), the all-gather in flight and the reduce-scatter in flight.
 *  - fsdp_state: one per FSDP module (module->ext); points to its group
 *    (several states share one group for ts_fully_shard_group) and to the
 *    root's fsdp_ctx, made at the root's first forward.
 *  - fsdp_ctx: per root: the states under it (pre-order), the post-forward
 *    order of this iteration and the forward order of the last one (for
 *    prefetch), the reduce-scatter in flight, backward bookkeeping.
 *
 * Buffers: the all-gather output is W blocks of shard_numel; block r holds
 * rank r's padded shard of every parameter in group order, so parameter
 * p's rows [r*c, r*c + c) sit at r*shard_numel + off_p; copy-out moves the
 * real rows into U (DESIGN.md D6). The reduce-scatter input is packed the
 * same way from the U gradients (copy-in, zero padding), reduced with AVG
 * over the shard group, and each parameter's segment of the output is
 * added into S's gradient.
 *
 * Lifetimes: states and groups are reference counted: the module holds its
 * state, the autograd markers of a forward hold the state they serve, and
 * states hold their group. A module freed while a graph that went through
 * it is alive makes that graph's FSDP markers fail with TS_ERR_STATE.
 * Slots own a reference to what they hold (S or U); the param holds its
 * own references to both.
 */
#include "fully_shard/fully_shard.h"

#include "comm/comm.h"
#include "comm/launch.h"
#include "comm/comm_internal.h"
#include "optim/internal.h"
#include "mesh/internal.h"
#include "nn/internal.h"
#include "tensor/internal.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FQN_MAX 512

typedef struct fsdp_state fsdp_state;
typedef struct fsdp_group fsdp_group;
typedef struct fsdp_ctx fsdp_ctx;

typedef struct fsdp_param {
    char *fqn;          /* name relative to the sharded module (messages) */
    ts_tensor ***slots; /* every slot holding the parameter */
    int *slot_owner;    /* per slot: the index of its module in the call */
    int n_slots;
    ts_tensor *S;       /* sharded leaf (retained) */
    ts_tensor *U;       /* unsharded leaf (retained), storage released while sharded */
    ts_dtensor *dt;     /* S's DTensor (owned) */
    int ndim;
    int64_t shape[TS_MAX_DIMS];
    int64_t rows, row_numel, numel;
    int64_t c;          /* chunk rows: ceil(rows / W) */
    int64_t local_rows; /* this rank's real rows */
    int64_t off;        /* offset in the per-rank shard (elements) */
    bool requires_grad;
    bool in_reduce;     /* its gradient is in the reduce-scatter in flight */
} fsdp_param;

enum { G_SHARDED = 0, G_UNSHARDING, G_UNSHARDED };

struct fsdp_group {
    atomic_int refs;
    fsdp_param *params;
    int n;
    ts_dtype dtype;
    size_t es;
    ts_mesh *mesh;      /* borrowed, or owned_mesh */
    ts_mesh *owned_mesh;
    ts_comm *pg;        /* the shard group */
    ts_comm *rg;        /* HSDP: the replicate group (NULL otherwise) */
    int W, rank;
    int64_t shard_numel, numel, local_numel;
    ts_tensor *sharded;  /* 1-d, shard_numel */
    int state;
    ts_tensor *ag_buf;   /* W * shard_numel while unsharding */
    ts_request *ag_req;
    ts_tensor *rs_in, *rs_out;
    ts_request *rs_req;
    ts_reshard_policy policy; /* resolved at lazy init (AUTO -> TRUE / FALSE) */
    ts_reshard_policy user_policy;
    int every_n, fwd_since_reshard;
    int n_states;          /* modules sharing the group */
    int ran_forward;       /* distinct modules of the group run in this forward */
    bool in_forward;       /* between the group's first pre-forward and its reshard point */
    char fqn[FQN_MAX];
};

struct fsdp_state {
    atomic_int refs;
    ts_module *module;  /* NULL once the module was freed */
    const ts_module_vtable *orig_vt;
    fsdp_group *group;  /* retained; NULL when the call took no parameter */
    fsdp_ctx *ctx;      /* the root's (borrowed; owned by the root: ctx->root == this) */
    char fqn[FQN_MAX];
    bool *method_wrapped; /* per named method of orig_vt: wrapped by ts_fsdp_register_forward_method */
    bool ran;           /* ran forward in this iteration (grouped calls count modules once) */
    int index;          /* its place among the modules of its call */
    fsdp_state **fwd_prefetch, **bwd_prefetch; /* explicit lists (retained) */
    int n_fwd_prefetch, n_bwd_prefetch;
    bool explicit_fwd, explicit_bwd;
};

struct fsdp_ctx {
    fsdp_state *root;
    fsdp_state **states; /* pre-order, retained */
    int n_states, cap_states;
    fsdp_group **post_fwd; /* this iteration's post-forward order (multiplicity) */
    int n_post_fwd, cap_post_fwd;
    fsdp_group **fwd_order, **prev_fwd_order; /* pre-forward order: this and last iteration */
    int n_fwd_order, cap_fwd_order, n_prev_fwd_order, cap_prev_fwd_order;
    int fwd_pos;            /* next position in prev_fwd_order */
    fsdp_state *iter_root;  /* the state whose forward started this iteration */
    fsdp_group *rs_pending; /* the reduce-scatter in flight */
    bool final_queued;
    bool bwd_running;       /* a backward went through a marker and has not ended */
    bool implicit_fwd, implicit_bwd;
    ts_status bwd_error;
};

/* ------------------------------------------------------------------ */
/* Events                                                              */
/* ------------------------------------------------------------------ */

static ts_fsdp_event_fn g_event_fn;
static void *g_event_ctx;

void ts_fsdp_set_event_hook(ts_fsdp_event_fn fn, void *ctx)
{
    g_event_fn = fn;
    g_event_ctx = ctx;
}

static void event(const char *what, const char *fqn)
{
    ts_logf(TS_LOG_DEBUG, "FSDP::%s (%s)", what, fqn);
    if (g_event_fn) g_event_fn(g_event_ctx, what, fqn);
}

/* A hook's span in the trace (TS_TRACE), from t0 (0: not tracing) to now,
 * with the module's FQN and its group's. */
static void trace_hook(uint64_t t0, const char *name, const char *fqn, const fsdp_group *g)
{
    if (!t0) return;
    ts_trace_arg a[2] = {{"fqn", fqn, 0}, {"group", g ? g->fqn : "", 0}};
    ts_trace_span_args(name, "fsdp", t0, ts_now_ns(), 2, a);
}

/* ------------------------------------------------------------------ */
/* Registry of the original tensors of sharded parameters               */
/* ------------------------------------------------------------------ */

/* A parameter tensor that fully_shard replaced but that something else
 * still holds (another module's slot: a tied weight outside the call) is
 * kept here, retained, so that a later call finding it can say that it is
 * shared with an existing group. */
typedef struct reg_entry {
    ts_tensor *t;
    fsdp_group *g;
    char fqn[FQN_MAX];
} reg_entry;

static pthread_mutex_t g_reg_mu = PTHREAD_MUTEX_INITIALIZER;
static reg_entry *g_reg;
static int g_reg_n, g_reg_cap;

static const reg_entry *reg_find(const ts_tensor *t)
{
    for (int i = 0; i < g_reg_n; i++)
        if (g_reg[i].t == t) return &g_reg[i];
    return NULL;
}

static void reg_add(ts_tensor *t, fsdp_group *g, const char *fqn)
{
    pthread_mutex_lock(&g_reg_mu);
    if (g_reg_n == g_reg_cap) {
        int cap = g_reg_cap ? 2 * g_reg_cap : 16;
        reg_entry *n = realloc(g_reg, (size_t)cap * sizeof *n);
        if (!n) {
            pthread_mutex_unlock(&g_reg_mu);
            return; /* only costs the later diagnosis */
        }
        g_reg = n;
        g_reg_cap = cap;
    }
    reg_entry *e = &g_reg[g_reg_n++];
    e->t = ts_tensor_retain(t);
    e->g = g;
    snprintf(e->fqn, sizeof e->fqn, "%s", fqn);
    pthread_mutex_unlock(&g_reg_mu);
}

static void reg_drop_group(fsdp_group *g)
{
    pthread_mutex_lock(&g_reg_mu);
    int k = 0;
    for (int i = 0; i < g_reg_n; i++) {
        if (g_reg[i].g == g) ts_tensor_free(g_reg[i].t);
        else g_reg[k++] = g_reg[i];
    }
    g_reg_n = k;
    if (!g_reg_n) {
        free(g_reg);
        g_reg = NULL;
        g_reg_cap = 0;
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

static void ign_drop_state(const fsdp_state *s)
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
/* Mistakes that would otherwise train silently (issue 9 §4)           */
/* ------------------------------------------------------------------ */

/* ts_fully_shard over the one-rank world while the launcher's variables
 * say the job has several ranks: every rank would train alone. */
static ts_status check_world_started(const char *fn, const ts_fsdp_options *o)
{
    if (ts_dist_is_initialized()) return TS_OK;
    if (o->mesh && ts_mesh_size(o->mesh, NULL) > 1) return TS_OK; /* a world made some other way (loopback) */
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
    for (int i = 0; i < n && g_reg_n; i++) {
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
            if (ign) continue;
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
/* Reference counts                                                    */
/* ------------------------------------------------------------------ */

static void group_free(fsdp_group *g)
{
    reg_drop_group(g);
    if (g->ag_req) {
        (void)ts_request_wait(g->ag_req);
        ts_request_free(g->ag_req);
    }
    if (g->rs_req) {
        (void)ts_request_wait(g->rs_req);
        ts_request_free(g->rs_req);
    }
    ts_tensor_free(g->ag_buf);
    ts_tensor_free(g->rs_in);
    ts_tensor_free(g->rs_out);
    for (int i = 0; i < g->n; i++) {
        fsdp_param *p = &g->params[i];
        ts__free(TS_MEM_NN, p->fqn);
        ts__free(TS_MEM_NN, p->slots);
        ts__free(TS_MEM_NN, p->slot_owner);
        ts_dtensor_free(p->dt);
        if (p->S) ts_tensor_clear_shard(p->S);
        ts_tensor_free(p->S);
        ts_tensor_free(p->U);
    }
    ts__free(TS_MEM_NN, g->params);
    ts_tensor_free(g->sharded);
    ts_mesh_free(g->owned_mesh);
    ts__free(TS_MEM_NN, g);
}

static fsdp_group *group_retain(fsdp_group *g)
{
    if (g) atomic_fetch_add(&g->refs, 1);
    return g;
}

static void group_release(fsdp_group *g)
{
    if (g && atomic_fetch_sub(&g->refs, 1) == 1) group_free(g);
}

static void ctx_free(fsdp_ctx *c);

static fsdp_state *state_retain(fsdp_state *s)
{
    if (s) atomic_fetch_add(&s->refs, 1);
    return s;
}

static void state_release(fsdp_state *s)
{
    if (!s || atomic_fetch_sub(&s->refs, 1) != 1) return;
    for (int i = 0; i < s->n_fwd_prefetch; i++) state_release(s->fwd_prefetch[i]);
    for (int i = 0; i < s->n_bwd_prefetch; i++) state_release(s->bwd_prefetch[i]);
    ts__free(TS_MEM_NN, s->fwd_prefetch);
    ts__free(TS_MEM_NN, s->bwd_prefetch);
    ts__free(TS_MEM_NN, s->method_wrapped);
    ign_drop_state(s);
    if (s->ctx && s->ctx->root == s) ctx_free(s->ctx);
    group_release(s->group);
    ts__free(TS_MEM_NN, s);
}

static void ctx_free(fsdp_ctx *c)
{
    /* the root's own entry is not retained (it would keep itself alive) */
    for (int i = 0; i < c->n_states; i++)
        if (c->states[i] != c->root) state_release(c->states[i]);
    ts__free(TS_MEM_NN, c->states);
    ts__free(TS_MEM_NN, c->post_fwd);
    ts__free(TS_MEM_NN, c->fwd_order);
    ts__free(TS_MEM_NN, c->prev_fwd_order);
    ts__free(TS_MEM_NN, c);
}

/* ------------------------------------------------------------------ */
/* The "<Type>FSDPModule" vtables                                      */
/* ------------------------------------------------------------------ */

static ts_status fsdp_forward(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out);
static void fsdp_free(ts_module *m);
static ts_status fsdp_call(fsdp_state *st, ts_module_fn fn, int n_in, ts_tensor *const *in, int *n_out,
                           ts_tensor **out);

/* The FSDP vtable's method dispatcher (ts_module_call_method): method k of
 * the original, through the FSDP wrapper when registered. */
static ts_status fsdp_call_method(ts_module *m, int k, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    fsdp_state *st = m->ext;
    if (!st || k < 0 || k >= st->orig_vt->n_methods)
        return ts_error(TS_ERR_INTERNAL, "fully_shard: method %d of %s is out of range", k, ts_module_type_name(m));
    ts_module_fn fn = st->orig_vt->methods[k].fn;
    if (!st->method_wrapped || !st->method_wrapped[k]) return fn(m, n_in, in, n_out, out);
    return fsdp_call(st, fn, n_in, in, n_out, out);
}

static int fsdp_extra_repr(const ts_module *m, char *buf, size_t cap);

/* The FSDP vtables made so far, one per original vtable; the array grows
 * (no limit on module types). */
typedef struct vt_entry {
    const ts_module_vtable *orig;
    ts_module_vtable *vt;
} vt_entry;

static pthread_mutex_t g_vt_mu = PTHREAD_MUTEX_INITIALIZER;
static vt_entry *g_vts;
static int g_n_vts, g_cap_vts;

/* Every FSDP vtable, and only those, has fsdp_forward as its forward. */
static bool is_fsdp_vt(const ts_module_vtable *vt) { return vt && vt->base && vt->forward == fsdp_forward; }

/* The cached FSDP vtable extending orig (made once per original vtable and
 * kept for the life of the process). */
static ts_status fsdp_vtable(const ts_module_vtable *orig, const ts_module_vtable **out)
{
    ts_status vst = ts__module_vtable_check("fully_shard", orig);
    if (vst) return vst;
    if (orig->call_method)
        return ts_error(TS_ERR_UNSUPPORTED,
                        "fully_shard: %s has its own method dispatcher (call_method); fully_shard cannot wrap it",
                        orig->type_name);
    pthread_mutex_lock(&g_vt_mu);
    for (int i = 0; i < g_n_vts; i++)
        if (g_vts[i].orig == orig) {
            *out = g_vts[i].vt;
            pthread_mutex_unlock(&g_vt_mu);
            return TS_OK;
        }
    ts_status st = TS_OK;
    ts_module_vtable *vt = NULL;
    char *name = NULL;
    if (g_n_vts == g_cap_vts) {
        int cap = g_cap_vts ? 2 * g_cap_vts : 16;
        vt_entry *grown = realloc(g_vts, (size_t)cap * sizeof *grown);
        if (!grown) {
            st = ts_error(TS_ERR_NO_MEMORY, "fully_shard: out of memory (the table of %d module types)", g_n_vts);
            goto done;
        }
        g_vts = grown;
        g_cap_vts = cap;
    }
    size_t len = strlen(orig->type_name) + sizeof "FSDPModule";
    vt = calloc(1, sizeof *vt);
    name = malloc(len);
    if (!vt || !name) {
        st = ts_error(TS_ERR_NO_MEMORY, "fully_shard: out of memory");
        goto done;
    }
    snprintf(name, len, "%sFSDPModule", orig->type_name);
    vt->type_name = name;
    vt->forward = fsdp_forward;
    vt->visit = orig->visit;
    vt->free = fsdp_free;
    /* the original's names and functions; calls go through call_method */
    vt->methods = orig->methods;
    vt->n_methods = orig->n_methods;
    vt->base = orig;
    vt->extra_repr = fsdp_extra_repr;
    vt->call_method = fsdp_call_method;
    g_vts[g_n_vts++] = (vt_entry){orig, vt};
    *out = vt;
    vt = NULL, name = NULL;
done:
    pthread_mutex_unlock(&g_vt_mu);
    free(vt);
    free(name);
    return st;
}

bool ts_module_is_fsdp(const ts_module *m) { return m && is_fsdp_vt(m->vtable) && m->ext; }

const ts_module_vtable *ts_fsdp_original_vtable(const ts_module *m)
{
    return ts_module_is_fsdp(m) ? ((fsdp_state *)m->ext)->orig_vt : NULL;
}

static fsdp_state *state_of(const ts_module *m) { return ts_module_is_fsdp(m) ? m->ext : NULL; }

const ts_dtensor *ts_fsdp_param_dtensor(const ts_tensor *t)
{
    if (!t || !ts_tensor_is_shard(t)) return NULL;
    return ts_tensor_dist_meta(t);
}

/* ------------------------------------------------------------------ */
/* Collecting what a call manages                                      */
/* ------------------------------------------------------------------ */

typedef struct pcand {
    ts_tensor *t;       /* the parameter tensor */
    ts_tensor ***slots;
    int *owners;        /* per slot: the index of the module in the call */
    int n_slots, cap_slots, cap_owners;
    char fqn[FQN_MAX];  /* first name */
} pcand;

typedef struct collect {
    pcand *c;
    int n, cap;
    ts_module **seen;   /* modules visited (each once) */
    int n_seen, cap_seen;
    const ts_fsdp_options *o;
    char prefix[FQN_MAX];
    int top;            /* the index of the module being walked in the call */
} collect;

static bool grow(void **arr, int *cap, int need, size_t elem)
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
    pcand *p = NULL;
    for (int i = 0; i < c->n && !p; i++)
        if (c->c[i].t == *slot) p = &c->c[i];
    if (!p) {
        if (!grow((void **)&c->c, &c->cap, c->n + 1, sizeof *c->c)) return TS_ERR_NO_MEMORY;
        p = &c->c[c->n++];
        memset(p, 0, sizeof *p);
        p->t = *slot;
        snprintf(p->fqn, sizeof p->fqn, "%s", fqn);
    }
    if (!grow((void **)&p->slots, &p->cap_slots, p->n_slots + 1, sizeof *p->slots) ||
        !grow((void **)&p->owners, &p->cap_owners, p->n_slots + 1, sizeof *p->owners))
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
    if (!grow((void **)&c->seen, &c->cap_seen, c->n_seen + 1, sizeof *c->seen)) return TS_ERR_NO_MEMORY;
    c->seen[c->n_seen++] = m;
    if (!m->vtable->visit) return TS_OK; /* no parameters, no children */
    ts_module_visitor pv = {on_param, NULL, c, NULL};
    ts_status st = m->vtable->visit(m, &pv);
    if (st) return st;
    ts_module_visitor cv = {NULL, on_child, c, NULL};
    return m->vtable->visit(m, &cv);
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
/* Sharding                                                            */
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
    if (o->n_ignored_params < 0 || (o->n_ignored_params && !o->ignored_params))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %d ignored parameters but no list", fn, o->n_ignored_params);
    if (o->mp_policy || o->offload_policy)
        return ts_error(TS_ERR_UNSUPPORTED,
                        "%s: the mixed-precision and CPU-offload policies are not built yet (pass NULL)", fn);
    if (o->mesh) {
        int nd = ts_mesh_ndim(o->mesh);
        if (nd != 1 && nd != 2)
            return ts_error(TS_ERR_INVALID_ARGUMENT,
                            "%s: the mesh has %d dims; fully_shard takes a 1-d (shard) or 2-d (replicate, shard) mesh",
                            fn, nd);
        if (strcmp(ts_mesh_device_type(o->mesh), "cpu") != 0)
            return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: mesh device '%s' (only cpu)", fn,
                            ts_mesh_device_type(o->mesh));
        ts_comm *w = ts__mesh_world(o->mesh);
        if (ts_dist_is_initialized() && w != ts_dist_world())
            return ts_error(TS_ERR_INVALID_ARGUMENT,
                            "%s: the mesh (%lld ranks) was not made over the initialized world (%d ranks): make it "
                            "with ts_mesh_new after ts_dist_init",
                            fn, (long long)ts_mesh_size(o->mesh, NULL), ts_comm_size(ts_dist_world()));
    }
    return TS_OK;
}

static bool is_float(ts_dtype d) { return d == TS_F32 || d == TS_F64 || d == TS_BF16 || d == TS_F16; }

/* Builds the group of the collected parameters (nothing changes on
 * error). */
static ts_status group_new(const char *fn, collect *c, const ts_fsdp_options *o, int n_states, fsdp_group **out)
{
    fsdp_group *g = ts__calloc(TS_MEM_NN, 1, sizeof *g);
    if (!g) return TS_ERR_NO_MEMORY;
    atomic_init(&g->refs, 1);
    g->user_policy = o->reshard_after_forward;
    g->every_n = o->reshard_every_n;
    g->n_states = n_states;
    ts_status st = TS_OK;
    if (o->mesh) {
        g->mesh = o->mesh;
    } else {
        ts_comm *w = ts_dist_world();
        int64_t shape[1] = {ts_comm_size(w)};
        const char *names[1] = {"dp"};
        if ((st = ts_mesh_new(w, "cpu", 1, shape, names, &g->owned_mesh))) goto fail;
        g->mesh = g->owned_mesh;
    }
    if (ts_mesh_ndim(g->mesh) == 1) {
        g->pg = ts_mesh_group(g->mesh, NULL);
    } else {
        g->pg = ts_mesh_group(g->mesh, ts_mesh_dim_name(g->mesh, 1));
        g->rg = ts_mesh_group(g->mesh, ts_mesh_dim_name(g->mesh, 0));
    }
    if (!g->pg || (ts_mesh_ndim(g->mesh) == 2 && !g->rg)) {
        st = ts_error(TS_ERR_INTERNAL, "%s: the mesh has no group for this rank", fn);
        goto fail;
    }
    g->W = ts_comm_size(g->pg);
    g->rank = ts_comm_rank(g->pg);
    g->n = c->n;
    if (c->n) {
        g->params = ts__calloc(TS_MEM_NN, (size_t)c->n, sizeof *g->params);
        if (!g->params) {
            st = TS_ERR_NO_MEMORY;
            goto fail;
        }
    }
    /* geometry and checks */
    for (int i = 0; i < c->n; i++) {
        ts_tensor *t = c->c[i].t;
        fsdp_param *p = &g->params[i];
        const reg_entry *e;
        pthread_mutex_lock(&g_reg_mu);
        e = reg_find(t);
        char other[FQN_MAX] = "";
        if (e) snprintf(other, sizeof other, "%s", e->fqn);
        pthread_mutex_unlock(&g_reg_mu);
        if (e || ts_tensor_is_shard(t)) {
            st = ts_error(TS_ERR_INVALID_ARGUMENT,
                          "%s: parameter '%s' is shared with a parameter already managed by another FSDP group%s%s%s; "
                          "for shared (tied) parameters, shard the modules that use it in one call "
                          "(ts_fully_shard_group) so that they form one group",
                          fn, c->c[i].fqn, *other ? " ('" : "", other, *other ? "')" : "");
            goto fail;
        }
        if (ts_tensor_ndim(t) < 1) {
            st = ts_error(TS_ERR_INVALID_ARGUMENT,
                          "%s: fully_shard does not support 0-d parameters; make '%s' a 1-d tensor of one element", fn,
                          c->c[i].fqn);
            goto fail;
        }
        if (!is_float(ts_tensor_dtype(t))) {
            st = ts_error(TS_ERR_DTYPE, "%s: parameter '%s' is %s; only floating-point parameters can be sharded", fn,
                          c->c[i].fqn, ts_dtype_name(ts_tensor_dtype(t)));
            goto fail;
        }
        if (i > 0 && ts_tensor_dtype(t) != g->dtype) {
            st = ts_error(TS_ERR_DTYPE, "%s: one group needs one dtype: '%s' is %s, '%s' is %s", fn, c->c[0].fqn,
                          ts_dtype_name(g->dtype), c->c[i].fqn, ts_dtype_name(ts_tensor_dtype(t)));
            goto fail;
        }
        if (!ts_tensor_data(t) && ts_tensor_numel(t) > 0) {
            st = ts_error(TS_ERR_RELEASED, "%s: the storage of parameter '%s' is released", fn, c->c[i].fqn);
            goto fail;
        }
        g->dtype = ts_tensor_dtype(t);
        p->ndim = ts_tensor_ndim(t);
        memcpy(p->shape, ts_tensor_shape(t), (size_t)p->ndim * sizeof *p->shape);
        p->rows = p->shape[0];
        p->numel = ts_tensor_numel(t);
        p->row_numel = p->rows ? p->numel / p->rows : 0;
        p->c = (p->rows + g->W - 1) / g->W;
        int64_t start, len;
        ts_chunk_range(p->rows, g->W, g->rank, &start, &len);
        p->local_rows = len;
        p->off = g->shard_numel;
        p->requires_grad = ts_tensor_requires_grad(t);
        g->shard_numel += p->c * p->row_numel;
        g->numel += p->numel;
        g->local_numel += len * p->row_numel;
        p->fqn = ts__strdup(TS_MEM_NN, c->c[i].fqn);
        if (!p->fqn) {
            st = TS_ERR_NO_MEMORY;
            goto fail;
        }
    }
    g->es = c->n ? ts_dtype_size(g->dtype) : 4;
    /* the sharded buffer, zero padded, and the shards as views of it */
    int64_t sn = g->shard_numel;
    if ((st = ts_tensor_zeros(c->n ? g->dtype : TS_F32, 1, &sn, &g->sharded))) goto fail;
    bool prev = ts_grad_mode_set(false);
    for (int i = 0; i < c->n && !st; i++) {
        fsdp_param *p = &g->params[i];
        ts_tensor *t = c->c[i].t;
        int64_t start, len;
        ts_chunk_range(p->rows, g->W, g->rank, &start, &len);
        ts_tensor *src = NULL;
        if ((st = ts_contiguous(t, &src))) break;
        unsigned char *dst = (unsigned char *)ts_tensor_data(g->sharded) + (size_t)p->off * g->es;
        if (len > 0)
            memcpy(dst, (const unsigned char *)ts_tensor_data(src) + (size_t)(start * p->row_numel) * g->es,
                   (size_t)(len * p->row_numel) * g->es);
        ts_tensor_free(src);
        int64_t lshape[TS_MAX_DIMS];
        memcpy(lshape, p->shape, sizeof lshape);
        lshape[0] = len;
        int64_t lstrides[TS_MAX_DIMS];
        ts__contiguous_strides(p->ndim, lshape, lstrides);
        if ((st = ts__tensor_alias(g->sharded, p->ndim, lshape, lstrides, g->sharded->offset + p->off, &p->S))) break;
        if ((st = ts__tensor_new(g->dtype, p->ndim, p->shape, &p->U))) break;
        if ((st = ts_storage_release(ts_tensor_storage(p->U)))) break;
        if (p->requires_grad) {
            if ((st = ts_tensor_set_requires_grad(p->S, true))) break;
            if ((st = ts_tensor_set_requires_grad(p->U, true))) break;
        }
        if ((st = ts_tensor_set_name(p->S, p->fqn)) || (st = ts_tensor_set_name(p->U, p->fqn))) break;
        ts_placement pl[2] = {ts_replicate(), ts_shard(0)};
        const ts_placement *pls = ts_mesh_ndim(g->mesh) == 1 ? &pl[1] : pl;
        if ((st = ts_dtensor_from_local(p->S, g->mesh, pls, p->ndim, p->shape, &p->dt))) break;
        ts_tensor_set_shard(p->S, p->dt);
    }
    ts_grad_mode_set(prev);
    if (st) goto fail;
    *out = g;
    return TS_OK;
fail:
    group_free(g);
    return st;
}

static void swap_slot(ts_tensor **slot, ts_tensor *t)
{
    if (*slot == t) return;
    ts_tensor *old = *slot;
    *slot = ts_tensor_retain(t);
    ts_tensor_free(old);
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
    for (int i = 0; i < n && !st; i++) st = fsdp_vtable(modules[i]->vtable, &vts[i]);
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
        if (n > 1) snprintf(c.prefix, sizeof c.prefix, "[%d]", i);
        st = walk_managed(&c, modules[i]);
    }
    fsdp_group *g = NULL;
    if (!st) st = group_new(fn, &c, &o, n, &g);
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
        if (g) group_free(g);
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
        for (int k = 0; k < p->n_slots; k++) swap_slot(p->slots[k], p->S);
        /* still held elsewhere (a tied weight outside the call, or the
         * user): remember it, so that sharding it again is diagnosed */
        if (atomic_load(&orig->refcount) > 1) reg_add(orig, g, p->fqn);
        ts_tensor_free(orig);
    }
    bool have_params = g->n > 0;
    for (int i = 0; i < n; i++) {
        fsdp_state *s = states[i];
        atomic_init(&s->refs, 1);
        s->module = modules[i];
        s->orig_vt = modules[i]->vtable;
        s->group = have_params ? group_retain(g) : NULL;
        s->index = i;
        snprintf(s->fqn, sizeof s->fqn, "%s", ts_module_type_name(modules[i]));
        modules[i]->ext = s;
        modules[i]->vtable = vts[i];
    }
    /* the ignored parameters, remembered for the optimizer's check */
    for (int i = 0; i < o.n_ignored_params; i++)
        if (o.ignored_params[i]) ign_add(o.ignored_params[i], states[0]);
    snprintf(g->fqn, sizeof g->fqn, "%s", states[0]->fqn);
    group_release(g); /* the states hold it (or nothing did: freed) */
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
    fsdp_state *s = state_of(module);
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
    return TS_OK;
}

/* ------------------------------------------------------------------ */
/* Unshard, reshard                                                    */
/* ------------------------------------------------------------------ */

static void set_slots(fsdp_group *g, bool unsharded)
{
    for (int i = 0; i < g->n; i++) {
        fsdp_param *p = &g->params[i];
        for (int k = 0; k < p->n_slots; k++)
            if (p->slots[k]) swap_slot(p->slots[k], unsharded ? p->U : p->S);
    }
}

/* Issues the group's all-gather (no-op unless sharded). */
static ts_status unshard(fsdp_group *g)
{
    if (!g || g->state != G_SHARDED) return TS_OK;
    event("unshard", g->fqn);
    int64_t n = g->shard_numel * g->W;
    ts_status st = ts_tensor_empty(g->dtype, 1, &n, &g->ag_buf);
    if (st) return st;
    if ((st = ts_all_gather_into_tensor(g->pg, g->ag_buf, g->sharded, &g->ag_req))) {
        ts_tensor_free(g->ag_buf);
        g->ag_buf = NULL;
        return st;
    }
    g->state = G_UNSHARDING;
    return TS_OK;
}

/* Waits for the all-gather and copies each parameter's rows out into its
 * unsharded tensor, which then fills the slots. */
static ts_status wait_unshard(fsdp_group *g)
{
    if (!g || g->state != G_UNSHARDING) return TS_OK;
    TS_TRACE_BEGIN(tw);
    ts_status st = ts_request_wait(g->ag_req);
    TS_TRACE_END(tw, "fsdp.wait_all_gather", "wait");
    ts_request_free(g->ag_req);
    g->ag_req = NULL;
    TS_TRACE_BEGIN(tc);
    if (!st) {
        const unsigned char *ag = ts_tensor_data(g->ag_buf);
        for (int i = 0; i < g->n && !st; i++) {
            fsdp_param *p = &g->params[i];
            if ((st = ts_storage_restore(ts_tensor_storage(p->U)))) break;
            unsigned char *u = ts_tensor_data(p->U);
            size_t rb = (size_t)p->row_numel * g->es;
            for (int r = 0; r < g->W; r++) {
                int64_t start, len;
                ts_chunk_range(p->rows, g->W, r, &start, &len);
                if (len > 0)
                    memcpy(u + (size_t)start * rb, ag + ((size_t)r * (size_t)g->shard_numel + (size_t)p->off) * g->es,
                           (size_t)len * rb);
            }
        }
    }
    ts_tensor_free(g->ag_buf);
    g->ag_buf = NULL;
    TS_TRACE_END(tc, "fsdp.copy_out", "copy");
    if (st) {
        for (int i = 0; i < g->n; i++) (void)ts_storage_release(ts_tensor_storage(g->params[i].U));
        g->state = G_SHARDED;
        return st;
    }
    g->state = G_UNSHARDED;
    set_slots(g, true);
    return TS_OK;
}

/* Frees the unsharded parameters; the shards go back into the slots. */
static ts_status reshard(fsdp_group *g)
{
    if (!g || g->state == G_SHARDED) return TS_OK;
    ts_status st = TS_OK;
    if (g->state == G_UNSHARDING) st = wait_unshard(g);
    if (g->state != G_UNSHARDED) return st;
    event("reshard", g->fqn);
    set_slots(g, false);
    for (int i = 0; i < g->n; i++) (void)ts_storage_release(ts_tensor_storage(g->params[i].U));
    g->state = G_SHARDED;
    g->fwd_since_reshard = 0;
    return st;
}

/* ------------------------------------------------------------------ */
/* Gradient reduction                                                  */
/* ------------------------------------------------------------------ */

static void add_into(void *dst, const void *src, int64_t n, ts_dtype d)
{
    switch (d) {
    case TS_F32: {
        float *a = dst;
        const float *b = src;
        for (int64_t i = 0; i < n; i++) a[i] += b[i];
        break;
    }
    case TS_F64: {
        double *a = dst;
        const double *b = src;
        for (int64_t i = 0; i < n; i++) a[i] += b[i];
        break;
    }
    case TS_BF16: {
        uint16_t *a = dst;
        const uint16_t *b = src;
        for (int64_t i = 0; i < n; i++) a[i] = ts_f32_to_bf16(ts_bf16_to_f32(a[i]) + ts_bf16_to_f32(b[i]));
        break;
    }
    case TS_F16: {
        uint16_t *a = dst;
        const uint16_t *b = src;
        for (int64_t i = 0; i < n; i++) a[i] = ts_f32_to_f16(ts_f16_to_f32(a[i]) + ts_f16_to_f32(b[i]));
        break;
    }
    default: break;
    }
}

/* Waits for the group's reduce-scatter (and HSDP all-reduce) and adds each
 * parameter's segment into its shard's gradient. */
static ts_status finish_reduce(fsdp_group *g)
{
    if (!g || !g->rs_req) return TS_OK;
    TS_TRACE_BEGIN(tw);
    ts_status st = ts_request_wait(g->rs_req);
    ts_request_free(g->rs_req);
    g->rs_req = NULL;
    if (!st && g->rg && ts_comm_size(g->rg) > 1) st = ts_all_reduce(g->rg, g->rs_out, TS_REDUCE_AVG, NULL);
    TS_TRACE_END(tw, "fsdp.wait_reduce", "wait");
    TS_TRACE_BEGIN(ta);
    const unsigned char *out = st ? NULL : ts_tensor_data(g->rs_out);
    for (int i = 0; i < g->n && !st; i++) {
        fsdp_param *p = &g->params[i];
        if (!p->in_reduce) continue; /* no gradient flowed to it: it keeps none (or its own) */
        p->in_reduce = false;
        const unsigned char *seg = out + (size_t)p->off * g->es;
        int64_t ln = p->local_rows * p->row_numel;
        ts_tensor *gr = ts_tensor_grad(p->S);
        if (gr && ts_tensor_is_contiguous(gr) && ts_tensor_data(gr)) {
            add_into(ts_tensor_data(gr), seg, ln, g->dtype);
        } else {
            ts_tensor *ng = NULL;
            const int64_t *sh = ts_tensor_shape(p->S);
            if ((st = ts_tensor_from_data(g->dtype, p->ndim, sh, seg, &ng))) break;
            if (gr) { /* a non-contiguous gradient the user set: add the old one */
                ts_tensor *sum = NULL;
                bool prev = ts_grad_mode_set(false);
                st = ts_add(ng, gr, &sum);
                ts_grad_mode_set(prev);
                ts_tensor_free(ng);
                if (st) break;
                ng = sum;
            }
            st = ts_tensor_set_grad(p->S, ng);
            ts_tensor_free(ng);
        }
    }
    for (int i = 0; i < g->n; i++) g->params[i].in_reduce = false;
    ts_tensor_free(g->rs_in);
    ts_tensor_free(g->rs_out);
    g->rs_in = g->rs_out = NULL;
    TS_TRACE_END(ta, "fsdp.grad_into_shards", "copy");
    return st;
}

/* Drops a reduction without applying it (after a failed backward). */
static void discard_reduce(fsdp_group *g)
{
    if (g->rs_req) {
        (void)ts_request_wait(g->rs_req);
        ts_request_free(g->rs_req);
        g->rs_req = NULL;
    }
    for (int i = 0; i < g->n; i++) g->params[i].in_reduce = false;
    ts_tensor_free(g->rs_in);
    ts_tensor_free(g->rs_out);
    g->rs_in = g->rs_out = NULL;
}

/* Post-backward of a group: packs the unsharded gradients (copy-in),
 * drops them, reshards, and issues the reduce-scatter, keeping one in
 * flight per root (the previous one is finished first). */
static ts_status post_backward(fsdp_ctx *ctx, fsdp_group *g)
{
    bool any = false;
    for (int i = 0; i < g->n; i++)
        if (g->params[i].requires_grad && ts_tensor_grad(g->params[i].U)) any = true;
    if (!any) return reshard(g);
    TS_TRACE_BEGIN(t_hook);
    ts_status st = TS_OK;
    if (ctx && ctx->rs_pending) {
        st = finish_reduce(ctx->rs_pending);
        ctx->rs_pending = NULL;
        if (st) return st;
    }
    if (g->rs_req && (st = finish_reduce(g))) return st;
    event("post_backward", g->fqn);
    TS_TRACE_BEGIN(tp);
    int64_t n_in = g->shard_numel * g->W, n_out = g->shard_numel;
    if ((st = ts_tensor_empty(g->dtype, 1, &n_in, &g->rs_in)) || (st = ts_tensor_empty(g->dtype, 1, &n_out, &g->rs_out))) {
        discard_reduce(g);
        return st;
    }
    unsigned char *in = ts_tensor_data(g->rs_in);
    for (int i = 0; i < g->n && !st; i++) {
        fsdp_param *p = &g->params[i];
        ts_tensor *gr = p->requires_grad ? ts_tensor_grad(p->U) : NULL;
        p->in_reduce = gr != NULL;
        size_t rb = (size_t)p->row_numel * g->es;
        /* zeros where no gradient row lands: the padding rows, or the whole
         * segment of a parameter without gradient */
        for (int r = 0; r < g->W; r++) {
            int64_t start, len;
            ts_chunk_range(p->rows, g->W, r, &start, &len);
            if (!gr) len = 0;
            if (len < p->c)
                memset(in + ((size_t)r * (size_t)g->shard_numel + (size_t)p->off) * g->es + (size_t)len * rb, 0,
                       (size_t)(p->c - len) * rb);
        }
        if (!gr) continue;
        ts_tensor *cg = NULL;
        bool prev = ts_grad_mode_set(false);
        st = ts_contiguous(gr, &cg);
        ts_grad_mode_set(prev);
        if (st) break;
        const unsigned char *src = ts_tensor_data(cg);
        for (int r = 0; r < g->W; r++) {
            int64_t start, len;
            ts_chunk_range(p->rows, g->W, r, &start, &len);
            if (len > 0)
                memcpy(in + ((size_t)r * (size_t)g->shard_numel + (size_t)p->off) * g->es, src + (size_t)start * rb,
                       (size_t)len * rb);
        }
        ts_tensor_free(cg);
        (void)ts_tensor_set_grad(p->U, NULL);
    }
    TS_TRACE_END(tp, "fsdp.pack_grads", "copy");
    if (!st) st = reshard(g);
    if (!st) st = ts_reduce_scatter_tensor(g->pg, g->rs_out, g->rs_in, TS_REDUCE_AVG, 1.0, 1.0, &g->rs_req);
    if (st) {
        discard_reduce(g);
        return st;
    }
    if (ctx) ctx->rs_pending = g;
    else st = finish_reduce(g);
    trace_hook(t_hook, "fsdp.post_backward", g->fqn, g);
    return st;
}

/* ------------------------------------------------------------------ */
/* Root, lazy init                                                     */
/* ------------------------------------------------------------------ */

typedef struct init_walk {
    fsdp_ctx *ctx;
} init_walk;

static ts_status init_each(void *vc, const char *fqn, ts_module *m)
{
    init_walk *w = vc;
    fsdp_state *s = state_of(m);
    if (!s) return TS_OK;
    if (s->ctx && s->ctx != w->ctx)
        return ts_error(TS_ERR_STATE,
                        "fully_shard: the FSDP state of '%s' (%s) has already been lazily initialized: run forward "
                        "through the root module first",
                        fqn, ts_module_type_name(m));
    for (int i = 0; i < w->ctx->n_states; i++)
        if (w->ctx->states[i] == s) return TS_OK;
    if (!grow((void **)&w->ctx->states, &w->ctx->cap_states, w->ctx->n_states + 1, sizeof *w->ctx->states))
        return TS_ERR_NO_MEMORY;
    w->ctx->states[w->ctx->n_states++] = s == w->ctx->root ? s : state_retain(s);
    s->ctx = w->ctx;
    snprintf(s->fqn, sizeof s->fqn, "%s", fqn);
    return TS_OK;
}

/* Group names: its modules' names joined by ", " (the root's is ""). */
static void name_groups(fsdp_ctx *c)
{
    for (int i = 0; i < c->n_states; i++) {
        fsdp_group *g = c->states[i]->group;
        if (!g) continue;
        bool first = true;
        for (int j = 0; j < i && first; j++) first = c->states[j]->group != g;
        size_t l = first ? 0 : strlen(g->fqn);
        snprintf(g->fqn + l, sizeof g->fqn - l, "%s%s", first ? "" : ", ", c->states[i]->fqn);
    }
}

static void resolve_policy(fsdp_group *g, bool root)
{
    ts_reshard_policy p = g->user_policy;
    if (p == TS_RESHARD_AUTO) p = root ? TS_RESHARD_FALSE : TS_RESHARD_TRUE;
    if (p == TS_RESHARD_EVERY_N && g->every_n == 1) p = TS_RESHARD_TRUE;
    g->policy = p;
}

static ts_status lazy_init(fsdp_state *st)
{
    if (st->ctx) return TS_OK;
    fsdp_ctx *c = ts__calloc(TS_MEM_NN, 1, sizeof *c);
    if (!c) return TS_ERR_NO_MEMORY;
    c->root = st;
    c->implicit_fwd = c->implicit_bwd = true;
    st->ctx = c;
    init_walk w = {c};
    ts_status s = ts_module_named_modules(st->module, init_each, &w);
    if (s) {
        for (int i = 0; i < c->n_states; i++)
            if (c->states[i] != st) c->states[i]->ctx = NULL;
        st->ctx = NULL;
        ctx_free(c);
        return s;
    }
    /* a group shared by a grouped call belongs to several states: it is
     * the root's only when the root's own state holds it */
    for (int i = 0; i < c->n_states; i++)
        if (c->states[i]->group) resolve_policy(c->states[i]->group, false);
    if (st->group) resolve_policy(st->group, true); /* the root's group, even when shared with others */
    name_groups(c);
    return TS_OK;
}

/* ------------------------------------------------------------------ */
/* Backward                                                            */
/* ------------------------------------------------------------------ */

static ts_status final_callback(void *vctx);

static bool order_push(fsdp_group ***arr, int *n, int *cap, fsdp_group *g)
{
    if (!grow((void **)arr, cap, *n + 1, sizeof **arr)) return false;
    (*arr)[(*n)++] = g;
    return true;
}

/* TS_ERR_STATE when the marker's module was freed while its graph lived. */
static ts_status marker_live(const fsdp_state *s)
{
    if (s->module && s->ctx) return TS_OK;
    return ts_error(TS_ERR_STATE, "fully_shard: an FSDP module was freed while an autograd graph through it was alive");
}

/* The pre-backward marker on a module's outputs: unshards its group before
 * its backward runs, prefetches the group that ran before it in forward,
 * and queues the root's end-of-backward work once per backward. */
static ts_status pre_backward_fn(void *vs, int n, ts_tensor **grads)
{
    (void)n, (void)grads;
    fsdp_state *s = vs;
    ts_status live = marker_live(s);
    if (live) return live;
    fsdp_ctx *c = s->ctx;
    ts_status st = TS_OK;
    c->bwd_running = true;
    if (!c->final_queued) {
        if ((st = ts_autograd_queue_callback(final_callback, c))) return st;
        c->final_queued = true;
    }
    fsdp_group *g = s->group;
    event("pre_backward", s->fqn);
    TS_TRACE_BEGIN(t_hook);
    if (g) {
        if ((st = unshard(g)) || (st = wait_unshard(g))) return st;
        }
    /* backward prefetch */
    if (s->explicit_bwd) {
        for (int i = 0; i < s->n_bwd_prefetch && !st; i++)
            if (s->bwd_prefetch[i]->module) st = unshard(s->bwd_prefetch[i]->group);
    } else if (g && c->implicit_bwd) {
        /* pop this group's last post-forward index; the one before it is
         * the group to prefetch */
        int at = -1;
        for (int i = c->n_post_fwd - 1; i >= 0 && at < 0; i--)
            if (c->post_fwd[i] == g) at = i;
        if (at >= 0) {
            memmove(&c->post_fwd[at], &c->post_fwd[at + 1], (size_t)(c->n_post_fwd - at - 1) * sizeof *c->post_fwd);
            c->n_post_fwd--;
            if (at > 0) {
                st = unshard(c->post_fwd[at - 1]); /* a no-op unless sharded */
            }
        }
    }
    trace_hook(t_hook, "fsdp.pre_backward", s->fqn, g);
    return st;
}

/* The post-backward marker on a module's inputs: runs after the module's
 * backward (its gradients are all accumulated). */
static ts_status post_backward_fn(void *vs, int n, ts_tensor **grads)
{
    (void)n, (void)grads;
    fsdp_state *s = vs;
    ts_status live = marker_live(s);
    if (live) return live;
    return s->group ? post_backward(s->ctx, s->group) : TS_OK;
}

static void marker_release(void *vs) { state_release(vs); }

/* End of the backward (queued by the first pre-backward): the
 * post-backward of every group that still holds unsharded gradients (its
 * inputs needed no grad), in reverse order; then every reduction is
 * finished and every group resharded. */
static ts_status final_callback(void *vctx)
{
    fsdp_ctx *c = vctx;
    ts_status st = TS_OK;
    for (int i = c->n_states - 1; i >= 0; i--) {
        fsdp_group *g = c->states[i]->group;
        if (!g || !c->states[i]->module) continue;
        ts_status s2 = post_backward(c, g);
        if (!st) st = s2;
    }
    if (c->rs_pending) {
        ts_status s2 = finish_reduce(c->rs_pending);
        c->rs_pending = NULL;
        if (!st) st = s2;
    }
    for (int i = 0; i < c->n_states; i++) {
        fsdp_group *g = c->states[i]->group;
        if (!g) continue;
        ts_status s2 = finish_reduce(g);
        if (!st) st = s2;
        s2 = reshard(g); /* reshard after backward, as PyTorch; drops unused prefetches */
        if (!st) st = s2;
    }
    c->n_post_fwd = 0;
    c->final_queued = false;
    c->bwd_running = false;
    return st;
}

/* ------------------------------------------------------------------ */
/* Forward                                                             */
/* ------------------------------------------------------------------ */

/* Passes the non-NULL tensors of t[0..n) through a custom autograd node
 * with backward `fn` (holding a reference to s); out[i] is the new alias
 * of t[i], NULL where t[i] is (optional inputs and outputs). */
static ts_status wrap_marker(int n, ts_tensor *const *t, ts_autograd_backward_fn fn, fsdp_state *s, ts_tensor **out)
{
    ts_tensor *dense[TS_MODULE_MAX_IO], *wrapped[TS_MODULE_MAX_IO];
    int at[TS_MODULE_MAX_IO], k = 0;
    for (int i = 0; i < n; i++) {
        out[i] = NULL;
        if (t[i]) {
            at[k] = i;
            dense[k++] = t[i];
        }
    }
    if (k == 0) return TS_OK;
    ts_status st = ts_autograd_custom(k, dense, fn, state_retain(s), marker_release, wrapped);
    if (st) {
        state_release(s);
        return st;
    }
    for (int j = 0; j < k; j++) out[at[j]] = wrapped[j];
    return TS_OK;
}

static bool any_requires_grad(int n, ts_tensor *const *t)
{
    for (int i = 0; i < n; i++)
        if (t[i] && ts_tensor_requires_grad(t[i])) return true;
    return false;
}

/* Implicit forward prefetch: the group expected after position `pos` of
 * the last iteration's order (pos = -1: the next one expected now). */
static ts_status forward_prefetch(fsdp_ctx *c, fsdp_state *s)
{
    if (s->explicit_fwd) {
        ts_status st = TS_OK;
        for (int i = 0; i < s->n_fwd_prefetch && !st; i++) {
            if (s->fwd_prefetch[i]->module) st = unshard(s->fwd_prefetch[i]->group); /* a no-op unless sharded */
        }
        return st;
    }
    if (!c->implicit_fwd || c->fwd_pos >= c->n_prev_fwd_order) return TS_OK;
    fsdp_group *next = c->prev_fwd_order[c->fwd_pos];
    return next->in_forward ? TS_OK : unshard(next);
}

static void prefetch_advance(fsdp_ctx *c, fsdp_group *g)
{
    /* the current group's place in last iteration's order */
    for (int i = c->fwd_pos; i < c->n_prev_fwd_order; i++)
        if (c->prev_fwd_order[i] == g) {
            c->fwd_pos = i + 1;
            return;
        }
}

static ts_status apply_policy(fsdp_group *g);

/* The end of the iteration root's forward: no all-gather stays in flight;
 * a grouped call some of whose modules did not run gets its post-forward
 * now; after a forward without grad (no backward will follow to reshard)
 * every group is resharded, so that an optimizer step before the next
 * forward cannot leave stale full parameters in use. */
static void root_post_forward(fsdp_ctx *c)
{
    bool no_grad = !ts_grad_mode_enabled();
    for (int i = 0; i < c->n_states; i++) {
        fsdp_group *g = c->states[i]->group;
        if (!g) continue;
        if (g->state == G_UNSHARDING) (void)wait_unshard(g);
        if (g->in_forward) {
            ts_logf(TS_LOG_WARN, "fully_shard: %d of the %d modules of the group '%s' ran forward in this iteration",
                    g->ran_forward, g->n_states, g->fqn);
            g->ran_forward = 0;
            g->in_forward = false;
            (void)apply_policy(g);
        }
        if (no_grad) (void)reshard(g);
    }
    c->iter_root = NULL;
}

/* A backward that failed never ran the end-of-backward callback: drop its
 * reductions in flight and its unsharded gradients (they must not reach
 * the next step's gradients), and reshard. */
static void recover_failed_backward(fsdp_ctx *c)
{
    ts_logf(TS_LOG_WARN, "fully_shard: the last backward did not finish; its partial gradient reductions are dropped");
    for (int i = 0; i < c->n_states; i++) {
        fsdp_group *g = c->states[i]->group;
        if (!g) continue;
        discard_reduce(g);
        for (int k = 0; k < g->n; k++) (void)ts_tensor_set_grad(g->params[k].U, NULL);
        g->ran_forward = 0;
        g->in_forward = false;
        (void)reshard(g);
    }
    c->rs_pending = NULL;
    c->n_post_fwd = 0;
    c->bwd_running = false;
}

/* Post-forward of a group: a grouped call's group reshards after the last
 * of its modules (each counted once per iteration). */
static ts_status post_forward_reshard(fsdp_state *s, fsdp_group *g)
{
    if (g->n_states > 1) {
        if (!s->ran) {
            s->ran = true;
            g->ran_forward++;
        }
        if (g->ran_forward < g->n_states) return TS_OK;
    }
    g->ran_forward = 0;
    g->in_forward = false;
    return apply_policy(g);
}

static ts_status apply_policy(fsdp_group *g)
{
    switch (g->policy) {
    case TS_RESHARD_FALSE: return TS_OK;
    case TS_RESHARD_EVERY_N:
        if (++g->fwd_since_reshard < g->every_n) return TS_OK;
        return reshard(g);
    default: return reshard(g);
    }
}

static ts_status fsdp_call(fsdp_state *s, ts_module_fn fn, int n_in, ts_tensor *const *in, int *n_out,
                           ts_tensor **out)
{
    ts_module *m = s->module;
    ts_status st = lazy_init(s);
    if (st) return st;
    fsdp_ctx *c = s->ctx;
    fsdp_group *g = s->group;
    if (ts_autograd_in_backward()) { /* activation checkpointing's recompute */
        if (g && ((st = unshard(g)) || (st = wait_unshard(g)))) return st;
        return fn(m, n_in, in, n_out, out);
    }
    bool iter_root = false;
    if (!c->iter_root) {
        c->iter_root = s;
        iter_root = true;
        if (c->n_fwd_order) { /* this iteration's order becomes the last one's */
            fsdp_group **t = c->prev_fwd_order;
            c->prev_fwd_order = c->fwd_order;
            c->n_prev_fwd_order = c->n_fwd_order;
            c->fwd_order = t;
            c->n_fwd_order = 0;
            /* capacities travel with the arrays */
            int cap = c->cap_fwd_order;
            c->cap_fwd_order = c->cap_prev_fwd_order;
            c->cap_prev_fwd_order = cap;
        }
        c->fwd_pos = 0;
        if (c->bwd_running || c->rs_pending) recover_failed_backward(c);
        c->final_queued = false;
        for (int i = 0; i < c->n_states; i++) c->states[i]->ran = false;
    }
    event("pre_forward", s->fqn);
    TS_TRACE_BEGIN(t_hook);
    ts_tensor *in2[TS_MODULE_MAX_IO];
    bool wrapped = false;
    if (g) {
        bool first = !g->in_forward; /* the group's first module in this iteration */
        g->in_forward = true;
        if ((st = unshard(g)) || (st = wait_unshard(g))) goto fail;
            if (first) {
            if (!order_push(&c->fwd_order, &c->n_fwd_order, &c->cap_fwd_order, g)) {
                st = TS_ERR_NO_MEMORY;
                goto fail;
            }
            prefetch_advance(c, g);
            if (n_in > 0 && ts_grad_mode_enabled() && any_requires_grad(n_in, in)) {
                if ((st = wrap_marker(n_in, in, post_backward_fn, s, in2))) goto fail;
                wrapped = true;
            }
        }
    }
    if ((st = forward_prefetch(c, s))) goto fail;
    trace_hook(t_hook, "fsdp.pre_forward", s->fqn, g);
    st = fn(m, n_in, wrapped ? in2 : in, n_out, out);
    if (wrapped)
        for (int i = 0; i < n_in; i++) ts_tensor_free(in2[i]);
    wrapped = false;
    if (st) goto fail;
    event("post_forward", s->fqn);
    t_hook = ts_trace_enabled() ? ts_now_ns() : 0;
    if (g) {
        /* the post-forward order serves the backward prefetch: none without grad */
        if (ts_grad_mode_enabled() && !order_push(&c->post_fwd, &c->n_post_fwd, &c->cap_post_fwd, g)) {
            st = TS_ERR_NO_MEMORY;
            goto fail_out;
        }
        if ((st = post_forward_reshard(s, g))) goto fail_out;
    }
    if (*n_out > 0 && ts_grad_mode_enabled() && any_requires_grad(*n_out, out)) {
        ts_tensor *out2[TS_MODULE_MAX_IO];
        if ((st = wrap_marker(*n_out, out, pre_backward_fn, s, out2))) goto fail_out;
        for (int i = 0; i < *n_out; i++) {
            ts_tensor_free(out[i]);
            out[i] = out2[i];
        }
    }
    if (iter_root) root_post_forward(c);
    trace_hook(t_hook, "fsdp.post_forward", s->fqn, g);
    return TS_OK;
fail_out:
    for (int i = 0; i < *n_out; i++) ts_tensor_free(out[i]);
    *n_out = 0;
fail:
    if (wrapped)
        for (int i = 0; i < n_in; i++) ts_tensor_free(in2[i]);
    {
        /* leave the group as the policy would after a forward */
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", ts_last_error());
        if (g && g->in_forward) {
            g->ran_forward = 0;
            g->in_forward = false;
            if (g->policy != TS_RESHARD_FALSE) (void)reshard(g);
        }
        if (iter_root) root_post_forward(c);
        ts_error(st, "%s", msg);
    }
    return st;
}

static ts_status fsdp_forward(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    fsdp_state *s = m->ext;
    if (!s->orig_vt->forward) /* a container such as ModuleList: call its children */
        return ts_error(TS_ERR_UNSUPPORTED, "ts_module_call: %s has no forward (call its children instead)",
                        ts_module_type_name(m));
    return fsdp_call(s, s->orig_vt->forward, n_in, in, n_out, out);
}

static void fsdp_free(ts_module *m)
{
    fsdp_state *s = m->ext;
    m->vtable = s->orig_vt;
    m->ext = NULL;
    s->module = NULL;
    if (s->group) { /* its slots die with it: nothing may write through them later */
        fsdp_group *g = s->group;
        for (int i = 0; i < g->n; i++)
            for (int k = 0; k < g->params[i].n_slots; k++)
                if (g->params[i].slot_owner[k] == s->index) g->params[i].slots[k] = NULL;
    }
    /* the prefetch lists may form cycles between states: drop them now */
    for (int i = 0; i < s->n_fwd_prefetch; i++) state_release(s->fwd_prefetch[i]);
    for (int i = 0; i < s->n_bwd_prefetch; i++) state_release(s->bwd_prefetch[i]);
    s->n_fwd_prefetch = s->n_bwd_prefetch = 0;
    m->vtable->free(m);
    state_release(s);
}

/* ------------------------------------------------------------------ */
/* Explicit control                                                    */
/* ------------------------------------------------------------------ */

struct ts_fsdp_unshard_handle {
    fsdp_group *g;
};

static ts_status need_state(const char *fn, ts_module *m, fsdp_state **out)
{
    fsdp_state *s = state_of(m);
    if (!s)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %s is not an FSDP module (call ts_fully_shard first)", fn,
                        m ? ts_module_type_name(m) : "NULL");
    *out = s;
    return TS_OK;
}

ts_status ts_fsdp_unshard(ts_module *module, bool async, ts_fsdp_unshard_handle **handle)
{
    fsdp_state *s = NULL;
    ts_status st = need_state("ts_fsdp_unshard", module, &s);
    if (st) return st;
    if (handle) *handle = NULL;
    if (async && !handle) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_fsdp_unshard: async needs a handle pointer");
    fsdp_group *g = s->group;
    if (!g) return TS_OK;
    if ((st = unshard(g))) return st;
    if (!async) return wait_unshard(g);
    ts_fsdp_unshard_handle *h = ts__calloc(TS_MEM_NN, 1, sizeof *h);
    if (!h) {
        (void)wait_unshard(g);
        return TS_ERR_NO_MEMORY;
    }
    h->g = group_retain(g);
    *handle = h;
    return TS_OK;
}

ts_status ts_fsdp_unshard_wait(ts_fsdp_unshard_handle *h)
{
    if (!h) return TS_OK;
    ts_status st = wait_unshard(h->g);
    group_release(h->g);
    ts__free(TS_MEM_NN, h);
    return st;
}

ts_status ts_fsdp_reshard(ts_module *module)
{
    fsdp_state *s = NULL;
    ts_status st = need_state("ts_fsdp_reshard", module, &s);
    return st ? st : reshard(s->group);
}

/* The distinct groups of the FSDP modules in a subtree, in pre-order. */
typedef struct groups_walk {
    fsdp_group **g;
    int n, cap;
} groups_walk;

static ts_status groups_each(void *vc, const char *fqn, ts_module *m)
{
    (void)fqn;
    groups_walk *w = vc;
    fsdp_state *s = state_of(m);
    if (!s || !s->group) return TS_OK;
    for (int i = 0; i < w->n; i++)
        if (w->g[i] == s->group) return TS_OK;
    if (!grow((void **)&w->g, &w->cap, w->n + 1, sizeof *w->g)) return TS_ERR_NO_MEMORY;
    w->g[w->n++] = s->group;
    return TS_OK;
}

static ts_status subtree_groups(ts_module *m, groups_walk *w)
{
    memset(w, 0, sizeof *w);
    ts_status st = ts_module_named_modules(m, groups_each, w);
    if (st) ts__free(TS_MEM_NN, w->g);
    return st;
}

struct ts_fsdp_summon {
    fsdp_group **g;
    bool *was_sharded;
    int n;
    bool writeback;
};

static bool busy(fsdp_group **g, int n)
{
    for (int i = 0; i < n; i++)
        if (g[i]->in_forward || g[i]->rs_req) return true;
    return ts_autograd_in_backward();
}

ts_status ts_fsdp_summon_full_params(ts_module *module, bool writeback, ts_fsdp_summon **out)
{
    if (!module || !out) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_fsdp_summon_full_params: NULL argument");
    groups_walk w;
    ts_status st = subtree_groups(module, &w);
    if (st) return st;
    if (busy(w.g, w.n)) {
        ts__free(TS_MEM_NN, w.g);
        return ts_error(TS_ERR_STATE, "ts_fsdp_summon_full_params: not inside a forward or backward");
    }
    ts_fsdp_summon *s = ts__calloc(TS_MEM_NN, 1, sizeof *s);
    bool *was = ts__calloc(TS_MEM_NN, (size_t)(w.n ? w.n : 1), sizeof *was);
    if (!s || !was) {
        ts__free(TS_MEM_NN, s);
        ts__free(TS_MEM_NN, was);
        ts__free(TS_MEM_NN, w.g);
        return TS_ERR_NO_MEMORY;
    }
    for (int i = 0; i < w.n && !st; i++) {
        was[i] = w.g[i]->state == G_SHARDED;
        if (!(st = unshard(w.g[i]))) st = wait_unshard(w.g[i]);
    }
    for (int i = 0; i < w.n; i++) group_retain(w.g[i]);
    s->g = w.g;
    s->was_sharded = was;
    s->n = w.n;
    s->writeback = writeback;
    if (st) {
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", ts_last_error());
        s->writeback = false;
        (void)ts_fsdp_summon_end(s);
        return ts_error(st, "%s", msg);
    }
    *out = s;
    return TS_OK;
}

/* Copies the rows of each unsharded parameter that this rank holds back
 * into its shard. */
static void write_back(fsdp_group *g)
{
    unsigned char *sh = ts_tensor_data(g->sharded);
    for (int i = 0; i < g->n; i++) {
        fsdp_param *p = &g->params[i];
        int64_t start, len;
        ts_chunk_range(p->rows, g->W, g->rank, &start, &len);
        size_t rb = (size_t)p->row_numel * g->es;
        if (len > 0)
            memcpy(sh + (size_t)p->off * g->es, (const unsigned char *)ts_tensor_data(p->U) + (size_t)start * rb,
                   (size_t)len * rb);
    }
}

ts_status ts_fsdp_summon_end(ts_fsdp_summon *s)
{
    if (!s) return TS_OK;
    ts_status st = TS_OK;
    for (int i = 0; i < s->n; i++) {
        fsdp_group *g = s->g[i];
        if (s->writeback && g->state == G_UNSHARDED) write_back(g);
        if (s->was_sharded[i]) {
            ts_status s2 = reshard(g);
            if (!st) st = s2;
        }
        group_release(g);
    }
    ts__free(TS_MEM_NN, s->g);
    ts__free(TS_MEM_NN, s->was_sharded);
    ts__free(TS_MEM_NN, s);
    return st;
}

ts_status ts_fsdp_register_forward_method(ts_module *module, const char *name)
{
    fsdp_state *s = NULL;
    ts_status st = need_state("ts_fsdp_register_forward_method", module, &s);
    if (st) return st;
    if (!name) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_fsdp_register_forward_method: NULL name");
    for (int i = 0; i < s->orig_vt->n_methods; i++)
        if (strcmp(s->orig_vt->methods[i].name, name) == 0) {
            s->method_wrapped[i] = true;
            return TS_OK;
        }
    return ts_error(TS_ERR_NOT_FOUND, "ts_fsdp_register_forward_method: %s has no method '%s'",
                    ts_module_type_name(module), name);
}

static ts_status set_prefetch(const char *fn, ts_module *module, int n, ts_module *const *modules, bool fwd)
{
    fsdp_state *s = NULL;
    ts_status st = need_state(fn, module, &s);
    if (st) return st;
    if (n < 0 || (n && !modules)) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %d modules but no list", fn, n);
    fsdp_state **list = n ? ts__calloc(TS_MEM_NN, (size_t)n, sizeof *list) : NULL;
    if (n && !list) return TS_ERR_NO_MEMORY;
    for (int i = 0; i < n; i++) {
        fsdp_state *t = state_of(modules[i]);
        if (!t) {
            ts__free(TS_MEM_NN, list);
            return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: module %d (%s) is not an FSDP module", fn, i,
                            modules[i] ? ts_module_type_name(modules[i]) : "NULL");
        }
        list[i] = t;
    }
    for (int i = 0; i < n; i++) state_retain(list[i]);
    fsdp_state ***dst = fwd ? &s->fwd_prefetch : &s->bwd_prefetch;
    int *dn = fwd ? &s->n_fwd_prefetch : &s->n_bwd_prefetch;
    for (int i = 0; i < *dn; i++) state_release((*dst)[i]);
    ts__free(TS_MEM_NN, *dst);
    *dst = list;
    *dn = n;
    if (fwd) s->explicit_fwd = n > 0;
    else s->explicit_bwd = n > 0;
    return TS_OK;
}

ts_status ts_fsdp_set_modules_to_forward_prefetch(ts_module *module, int n, ts_module *const *modules)
{
    return set_prefetch("ts_fsdp_set_modules_to_forward_prefetch", module, n, modules, true);
}

ts_status ts_fsdp_set_modules_to_backward_prefetch(ts_module *module, int n, ts_module *const *modules)
{
    return set_prefetch("ts_fsdp_set_modules_to_backward_prefetch", module, n, modules, false);
}

ts_status ts_fsdp_set_implicit_prefetch(ts_module *module, bool forward, bool backward)
{
    fsdp_state *s = NULL;
    ts_status st = need_state("ts_fsdp_set_implicit_prefetch", module, &s);
    if (st || (st = lazy_init(s))) return st;
    s->ctx->implicit_fwd = forward;
    s->ctx->implicit_bwd = backward;
    return TS_OK;
}

/* ------------------------------------------------------------------ */
/* State dicts                                                         */
/* ------------------------------------------------------------------ */

/* The group parameter whose S or U is t, or NULL. */
static fsdp_param *find_param(groups_walk *w, const ts_tensor *t, fsdp_group **g_out)
{
    for (int i = 0; i < w->n; i++)
        for (int k = 0; k < w->g[i]->n; k++) {
            fsdp_param *p = &w->g[i]->params[k];
            if (p->S == t || p->U == t) {
                if (g_out) *g_out = w->g[i];
                return p;
            }
        }
    return NULL;
}

ts_status ts_fsdp_full_state_dict(ts_module *module, bool rank0_only, ts_state_dict **out)
{
    if (!module || !out) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_fsdp_full_state_dict: NULL argument");
    groups_walk w;
    ts_status st = subtree_groups(module, &w);
    if (st) return st;
    if (busy(w.g, w.n)) {
        ts__free(TS_MEM_NN, w.g);
        return ts_error(TS_ERR_STATE, "ts_fsdp_full_state_dict: not inside a forward or backward");
    }
    bool keep = true;
    if (rank0_only)
        keep = w.n ? ts_comm_rank(w.g[0]->pg) == 0 && (!w.g[0]->rg || ts_comm_rank(w.g[0]->rg) == 0)
                   : ts_comm_rank(ts_dist_world()) == 0;
    ts_named_params np = {0};
    ts_state_dict *sd = NULL;
    ts_tensor **full = NULL; /* per group param, flattened over groups */
    int total = 0;
    for (int i = 0; i < w.n; i++) total += w.g[i]->n;
    if ((st = ts_state_dict_new(&sd))) goto done;
    if (total && !(full = ts__calloc(TS_MEM_NN, (size_t)total, sizeof *full))) {
        st = TS_ERR_NO_MEMORY;
        goto done;
    }
    /* gather every group (collective, same order on every rank) */
    for (int i = 0, at = 0; i < w.n && !st; at += w.g[i]->n, i++) {
        fsdp_group *g = w.g[i];
        bool was_sharded = g->state == G_SHARDED;
        if ((st = unshard(g)) || (st = wait_unshard(g))) break;
        for (int k = 0; k < g->n && !st && keep; k++)
            st = ts_tensor_from_data(g->dtype, g->params[k].ndim, g->params[k].shape, ts_tensor_data(g->params[k].U),
                                     &full[at + k]);
        if (was_sharded) {
            ts_status s2 = reshard(g);
            if (!st) st = s2;
        }
    }
    if (st || !keep) goto done;
    if ((st = ts__module_entries(module, true, true, false, &np))) goto done; /* buffers: whole, replicated */
    for (int i = 0; i < np.n && !st; i++) {
        ts_tensor *t = *np.items[i].slot;
        fsdp_group *g = NULL;
        fsdp_param *p = find_param(&w, t, &g);
        if (p) {
            int at = 0;
            for (int j = 0; w.g[j] != g; j++) at += w.g[j]->n;
            st = ts_state_dict_set(sd, np.items[i].name, full[at + (int)(p - g->params)]);
        } else {
            ts_tensor *d = NULL;
            if (!(st = ts_detach(t, &d))) {
                st = ts_state_dict_set(sd, np.items[i].name, d);
                ts_tensor_free(d);
            }
        }
    }
done:
    for (int i = 0; i < total; i++) ts_tensor_free(full ? full[i] : NULL);
    ts__free(TS_MEM_NN, full);
    ts_named_params_free(&np);
    ts__free(TS_MEM_NN, w.g);
    if (st) {
        ts_state_dict_free(sd);
        return st;
    }
    *out = sd;
    return TS_OK;
}

ts_status ts_fsdp_load_full_state_dict(ts_module *module, const ts_state_dict *sd, bool strict)
{
    static const char fn[] = "ts_fsdp_load_full_state_dict";
    if (!module || !sd) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL argument", fn);
    groups_walk w;
    ts_status st = subtree_groups(module, &w);
    if (st) return st;
    if (busy(w.g, w.n)) {
        ts__free(TS_MEM_NN, w.g);
        return ts_error(TS_ERR_STATE, "%s: not inside a forward or backward", fn);
    }
    for (int i = 0; i < w.n && !st; i++) st = reshard(w.g[i]);
    ts_named_params np = {0};
    if (!st) st = ts__module_entries(module, true, true, false, &np); /* buffers are copied whole */
    /* the model's names, for the unexpected keys in O(1) each */
    ts_state_dict *known = NULL;
    if (!st) st = ts_state_dict_new(&known);
    for (int i = 0; i < np.n && !st; i++) st = ts_state_dict_set(known, np.items[i].name, *np.items[i].slot);
    /* check everything first: nothing is copied on error. Shapes, then
     * dtypes, then (strict) key mismatches, as ts_module_load_state_dict. */
    char missing[1024] = "", unexpected[1024] = "", shapes[1024] = "", dtypes[1024] = "";
    for (int i = 0; i < np.n && !st; i++) {
        ts_tensor *t = *np.items[i].slot, *src = ts_state_dict_get(sd, np.items[i].name);
        if (!src) {
            snprintf(missing + strlen(missing), sizeof missing - strlen(missing), " '%s'", np.items[i].name);
            continue;
        }
        fsdp_param *p = find_param(&w, t, NULL);
        int nd = p ? p->ndim : ts_tensor_ndim(t);
        const int64_t *sh = p ? p->shape : ts_tensor_shape(t);
        if (ts_tensor_ndim(src) != nd || memcmp(ts_tensor_shape(src), sh, (size_t)nd * sizeof *sh) != 0) {
            char a[128], b[128];
            snprintf(shapes + strlen(shapes), sizeof shapes - strlen(shapes), " '%s' is %s in the dict, %s in the model;",
                     np.items[i].name, ts_tensor_shape_str(src, a, sizeof a), ts__shape_str(nd, sh, b, sizeof b));
        }
        ts_dtype want = ts_tensor_dtype(p ? p->S : t);
        if (ts_tensor_dtype(src) != want)
            snprintf(dtypes + strlen(dtypes), sizeof dtypes - strlen(dtypes), " '%s' is %s in the dict, %s in the model;",
                     np.items[i].name, ts_dtype_name(ts_tensor_dtype(src)), ts_dtype_name(want));
    }
    for (int i = 0; i < ts_state_dict_size(sd) && !st; i++)
        if (!ts_state_dict_get(known, ts_state_dict_name(sd, i)))
            snprintf(unexpected + strlen(unexpected), sizeof unexpected - strlen(unexpected), " '%s'",
                     ts_state_dict_name(sd, i));
    ts_state_dict_free(known);
    if (!st && *shapes) st = ts_error(TS_ERR_SHAPE, "%s:%s", fn, shapes);
    if (!st && *dtypes)
        st = ts_error(TS_ERR_DTYPE, "%s: dtype mismatch:%s convert the dict's tensors with ts_to_dtype first", fn,
                      dtypes);
    if (!st && strict && (*missing || *unexpected))
        st = ts_error(TS_ERR_NOT_FOUND, "%s: missing keys:%s; unexpected keys:%s", fn, *missing ? missing : " none",
                      *unexpected ? unexpected : " none");
    bool prev = ts_grad_mode_set(false);
    for (int i = 0; i < np.n && !st; i++) {
        ts_tensor *t = *np.items[i].slot, *src = ts_state_dict_get(sd, np.items[i].name);
        if (!src) continue;
        fsdp_group *g = NULL;
        fsdp_param *p = find_param(&w, t, &g);
        if (!p) {
            ts_tensor *lv = NULL;
            if (!(st = ts_tensor_local_view(t, &lv))) {
                st = ts_tensor_copy_(lv, src);
                ts_tensor_free(lv);
            }
            continue;
        }
        int64_t start, len;
        ts_chunk_range(p->rows, g->W, g->rank, &start, &len);
        if (len == 0) continue;
        ts_tensor *rows = NULL, *lv = NULL;
        if (!(st = ts_narrow(src, 0, start, len, &rows)) && !(st = ts_tensor_local_view(p->S, &lv)))
            st = ts_tensor_copy_(lv, rows);
        ts_tensor_free(rows);
        ts_tensor_free(lv);
    }
    ts_grad_mode_set(prev);
    ts_named_params_free(&np);
    ts__free(TS_MEM_NN, w.g);
    return st;
}

/* ------------------------------------------------------------------ */
/* Gradient clipping                                                   */
/* ------------------------------------------------------------------ */

static double sum_squares(const ts_tensor *g)
{
    ts_tensor *c = NULL;
    if (ts_contiguous((ts_tensor *)g, &c)) return NAN;
    double s = 0;
    int64_t n = ts_tensor_numel(c);
    const void *p = ts_tensor_data(c);
    for (int64_t i = 0; i < n; i++) {
        double v;
        switch (ts_tensor_dtype(c)) {
        case TS_F32: v = ((const float *)p)[i]; break;
        case TS_F64: v = ((const double *)p)[i]; break;
        case TS_BF16: v = ts_bf16_to_f32(((const uint16_t *)p)[i]); break;
        case TS_F16: v = ts_f16_to_f32(((const uint16_t *)p)[i]); break;
        default: v = NAN;
        }
        s += v * v;
    }
    ts_tensor_free(c);
    return s;
}

ts_status ts_fsdp_clip_grad_norm(ts_module *module, double max_norm, double *total_norm_out)
{
    static const char fn[] = "ts_fsdp_clip_grad_norm";
    if (!module || !total_norm_out) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL argument", fn);
    if (!(max_norm >= 0)) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: invalid max_norm %g (must be >= 0)", fn, max_norm);
    groups_walk w;
    ts_status st = subtree_groups(module, &w);
    if (st) return st;
    ts_named_params np = {0};
    double total = 0;
    /* each group's shards: local sum, then summed over its shard ranks */
    for (int i = 0; i < w.n && !st; i++) {
        fsdp_group *g = w.g[i];
        double local = 0;
        for (int k = 0; k < g->n; k++) {
            ts_tensor *gr = ts_tensor_grad(g->params[k].S);
            if (gr) local += sum_squares(gr);
        }
        int64_t one = 1;
        ts_tensor *t = NULL;
        if ((st = ts_tensor_full(TS_F64, 1, &one, local, &t))) break;
        if (!(st = ts_all_reduce(g->pg, t, TS_REDUCE_SUM, NULL))) total += *(double *)ts_tensor_data(t);
        ts_tensor_free(t);
    }
    /* parameters outside every group (ignored ones): counted as they are */
    if (!st) st = ts_module_named_parameters(module, &np);
    for (int i = 0; i < np.n && !st; i++) {
        ts_tensor *t = *np.items[i].slot;
        if (find_param(&w, t, NULL)) continue;
        ts_tensor *gr = ts_tensor_grad(t);
        if (gr) total += sum_squares(gr);
    }
    if (!st) {
        total = sqrt(total);
        *total_norm_out = total;
        if (!isfinite(total))
            st = ts_error(TS_ERR_INVALID_ARGUMENT, "%s: the total gradient norm is %g; gradients left unchanged", fn,
                          total);
    }
    double coef = max_norm / (total + 1e-6);
    if (!st && coef < 1.0) {
        bool prev = ts_grad_mode_set(false);
        for (int i = 0; i < np.n && !st; i++) {
            ts_tensor *t = *np.items[i].slot;
            fsdp_param *p = find_param(&w, t, NULL);
            ts_tensor *gr = ts_tensor_grad(p ? p->S : t);
            if (!gr) continue;
            ts_tensor *sc = NULL;
            if (!(st = ts_mul_scalar(gr, coef, &sc))) {
                st = ts_tensor_copy_(gr, sc);
                ts_tensor_free(sc);
            }
        }
        ts_grad_mode_set(prev);
    }
    ts_named_params_free(&np);
    ts__free(TS_MEM_NN, w.g);
    return st;
}

/* ------------------------------------------------------------------ */
/* Describing the sharding: ts_module_print's line, ts_fsdp_summary    */
/* ------------------------------------------------------------------ */

/* is_root < 0: not known yet (before the first forward, for print) */
static void policy_str(const fsdp_group *g, bool resolved, int is_root, char *buf, size_t cap)
{
    ts_reshard_policy p = resolved ? g->policy : g->user_policy;
    const char *note = "";
    if (!resolved && p == TS_RESHARD_AUTO && is_root < 0) {
        snprintf(buf, cap, "auto (false for the root, true for the others)");
        return;
    }
    if (!resolved && p == TS_RESHARD_AUTO) {
        p = is_root ? TS_RESHARD_FALSE : TS_RESHARD_TRUE;
        note = is_root ? " (auto: the root keeps its parameters)" : " (auto)";
    }
    if (p == TS_RESHARD_EVERY_N && g->every_n == 1) p = TS_RESHARD_TRUE;
    switch (p) {
    case TS_RESHARD_FALSE: snprintf(buf, cap, "false%s", note); break;
    case TS_RESHARD_EVERY_N: snprintf(buf, cap, "every %d forwards%s", g->every_n, note); break;
    case TS_RESHARD_AUTO: snprintf(buf, cap, "auto"); break;
    default: snprintf(buf, cap, "true%s", note); break;
    }
}

static void mesh_str(const ts_mesh *mesh, char *buf, size_t cap)
{
    size_t n = 0;
    buf[0] = '\0';
    for (int d = 0; d < ts_mesh_ndim(mesh) && n < cap; d++) {
        int k = snprintf(buf + n, cap - n, "%s%s=%lld", d ? ", " : "(", ts_mesh_dim_name(mesh, d),
                         (long long)ts_mesh_dim_size(mesh, d));
        n += k > 0 ? (size_t)k : 0;
    }
    if (n < cap) snprintf(buf + n, cap - n, ")");
}

static void bytes_str(double b, char *buf, size_t cap)
{
    if (b < 1024) snprintf(buf, cap, "%.0f B", b);
    else if (b < 1024.0 * 1024) snprintf(buf, cap, "%.1f KiB", b / 1024);
    else if (b < 1024.0 * 1024 * 1024) snprintf(buf, cap, "%.1f MiB", b / (1024.0 * 1024));
    else snprintf(buf, cap, "%.2f GiB", b / (1024.0 * 1024 * 1024));
}

/* The FSDP vtable's extra_repr: the original's, then this module's group. */
static int fsdp_extra_repr(const ts_module *m, char *buf, size_t cap)
{
    const fsdp_state *s = m->ext;
    char own[512] = "";
    if (s->orig_vt->extra_repr && s->orig_vt->extra_repr(m, own, sizeof own) < 0) own[0] = '\0';
    const char *sep = own[0] ? "; " : "";
    const fsdp_group *g = s->group;
    if (!g) return snprintf(buf, cap, "%s%sFSDP: no parameters of its own", own, sep);
    char pol[96], mesh[128];
    policy_str(g, s->ctx != NULL, s->ctx ? s->ctx->root == s : -1, pol, sizeof pol);
    mesh_str(g->mesh, mesh, sizeof mesh);
    char shared[64] = "";
    if (g->n_states > 1) snprintf(shared, sizeof shared, ", shared by %d modules", g->n_states);
    return snprintf(buf, cap,
                    "%s%sFSDP: %d param%s, %lld elements, %lld per rank + %lld padding in all, mesh %s, reshard "
                    "after forward: %s%s",
                    own, sep, g->n, g->n == 1 ? "" : "s", (long long)g->numel, (long long)g->shard_numel,
                    (long long)(g->shard_numel * g->W - g->numel), mesh, pol, shared);
}

/* The FSDP modules of a subtree and their names, in pre-order. */
typedef struct summary_walk {
    fsdp_state **s;
    char **fqn;
    int n, cap_s, cap_fqn;
} summary_walk;

static ts_status summary_each(void *vc, const char *fqn, ts_module *m)
{
    summary_walk *w = vc;
    fsdp_state *s = state_of(m);
    if (!s) return TS_OK;
    if (!grow((void **)&w->s, &w->cap_s, w->n + 1, sizeof *w->s) ||
        !grow((void **)&w->fqn, &w->cap_fqn, w->n + 1, sizeof *w->fqn))
        return TS_ERR_NO_MEMORY;
    if (!(w->fqn[w->n] = ts__strdup(TS_MEM_NN, fqn))) return TS_ERR_NO_MEMORY;
    w->s[w->n++] = s;
    return TS_OK;
}

static void summary_walk_free(summary_walk *w)
{
    for (int i = 0; i < w->n; i++) ts__free(TS_MEM_NN, w->fqn[i]);
    ts__free(TS_MEM_NN, w->fqn);
    ts__free(TS_MEM_NN, w->s);
}

static const char *param_name(const ts_named_params *np, const fsdp_param *p)
{
    for (int i = 0; i < np->n; i++)
        if (*np->items[i].slot == p->S || *np->items[i].slot == p->U) return np->items[i].name;
    return p->fqn;
}

static ts_status write_summary(ts_module *module, FILE *f)
{
    summary_walk w = {0};
    ts_named_params np = {0}, nb = {0};
    groups_walk gw = {0};
    ts_status st = ts_module_named_modules(module, summary_each, &w);
    if (!st) st = subtree_groups(module, &gw);
    if (!st) st = ts_module_named_parameters(module, &np);
    if (!st) st = ts_module_named_buffers(module, &nb);
    if (st) goto done;
    int rank = gw.n ? ts_comm_rank(gw.g[0]->pg) : 0;
    int64_t total = 0;
    for (int i = 0; i < np.n; i++) { /* full sizes: a shard counts as its whole parameter */
        const fsdp_param *p = find_param(&gw, *np.items[i].slot, NULL);
        total += p ? p->numel : ts_tensor_numel(*np.items[i].slot);
    }
    char mesh[128] = "(none)";
    if (gw.n) mesh_str(gw.g[0]->mesh, mesh, sizeof mesh);
    fprintf(f, "FSDP summary of %s (rank %d of mesh %s): %d FSDP module%s, %d group%s, %d parameter%s (%lld elements)\n",
            ts_module_type_name(module), rank, mesh, w.n, w.n == 1 ? "" : "s", gw.n, gw.n == 1 ? "" : "s", np.n,
            np.n == 1 ? "" : "s", (long long)total);
    double rank_bytes = 0;
    int in_groups = 0;
    for (int i = 0; i < gw.n; i++) {
        const fsdp_group *g = gw.g[i];
        char names[FQN_MAX] = "";
        const char *type = "";
        bool root = false, resolved = false;
        for (int k = 0; k < w.n; k++) {
            if (w.s[k]->group != g) continue;
            size_t l = strlen(names);
            snprintf(names + l, sizeof names - l, "%s'%s'", l ? ", " : "", w.fqn[k]);
            if (!*type) type = ts_module_type_name(w.s[k]->module);
            if (w.s[k]->ctx) resolved = true;
            if (w.s[k]->module == module || (w.s[k]->ctx && w.s[k]->ctx->root == w.s[k])) root = true;
        }
        char pol[96], gm[128], b1[32], b2[32];
        policy_str(g, resolved, root, pol, sizeof pol);
        mesh_str(g->mesh, gm, sizeof gm);
        int64_t pad_all = g->shard_numel * g->W - g->numel;
        bytes_str((double)g->shard_numel * (double)g->es, b1, sizeof b1);
        bytes_str((double)g->shard_numel * (double)g->W * (double)g->es, b2, sizeof b2);
        rank_bytes += (double)g->shard_numel * (double)g->es;
        in_groups += g->n;
        fprintf(f, "group %s (%s): %d param%s, %lld elements, %s, mesh %s, reshard after forward: %s\n", names, type,
                g->n, g->n == 1 ? "" : "s", (long long)g->numel, ts_dtype_name(g->dtype), gm, pol);
        fprintf(f, "  per rank: %lld elements (%lld of them padding on this rank, %lld over all ranks), %s sharded; "
                   "%s while unsharded\n",
                (long long)g->shard_numel, (long long)(g->shard_numel - g->local_numel), (long long)pad_all, b1, b2);
        fprintf(f, "  %-40s %-16s %-16s %-16s %s\n", "parameter", "full", "local shard", "padded shard", "padding");
        for (int k = 0; k < g->n; k++) {
            const fsdp_param *p = &g->params[k];
            char full[96], local[96], padded[96];
            int64_t sh[TS_MAX_DIMS];
            memcpy(sh, p->shape, sizeof sh);
            ts__shape_str(p->ndim, p->shape, full, sizeof full);
            sh[0] = p->local_rows;
            ts__shape_str(p->ndim, sh, local, sizeof local);
            sh[0] = p->c;
            ts__shape_str(p->ndim, sh, padded, sizeof padded);
            fprintf(f, "  %-40s %-16s %-16s %-16s %lld\n", param_name(&np, p), full, local, padded,
                    (long long)((p->c - p->local_rows) * p->row_numel));
        }
    }
    /* parameters outside every group: replicated, whole, on every rank */
    int n_out = 0;
    int64_t out_numel = 0;
    double out_bytes = 0;
    for (int i = 0; i < np.n; i++) {
        ts_tensor *t = *np.items[i].slot;
        if (find_param(&gw, t, NULL)) continue;
        n_out++;
        out_numel += ts_tensor_numel(t);
        out_bytes += (double)ts_tensor_numel(t) * (double)ts_dtype_size(ts_tensor_dtype(t));
    }
    char b[32];
    bytes_str(out_bytes, b, sizeof b);
    fprintf(f, "outside every group (not sharded, whole on every rank): %d parameter%s, %lld elements, %s%s", n_out,
            n_out == 1 ? "" : "s", (long long)out_numel, b, n_out ? ":" : "");
    for (int i = 0, k = 0; i < np.n && k < 8; i++)
        if (!find_param(&gw, *np.items[i].slot, NULL)) fprintf(f, " %s", np.items[i].name), k++;
    fprintf(f, "%s\n", n_out > 8 ? " ..." : "");
    double buf_bytes = 0;
    for (int i = 0; i < nb.n; i++)
        buf_bytes += (double)ts_tensor_numel(*nb.items[i].slot) * (double)ts_dtype_size(ts_tensor_dtype(*nb.items[i].slot));
    bytes_str(buf_bytes, b, sizeof b);
    fprintf(f, "buffers (never sharded, whole on every rank): %d, %s\n", nb.n, b);
    char rb[32];
    bytes_str(rank_bytes + out_bytes + buf_bytes, rb, sizeof rb);
    fprintf(f, "this rank holds %s of parameters and buffers (%d parameters in groups, %d outside)\n", rb, in_groups,
            n_out);
    if (ferror(f)) st = ts_error(TS_ERR_IO, "ts_fsdp_summary: writing the summary failed");
done:
    summary_walk_free(&w);
    ts__free(TS_MEM_NN, gw.g);
    ts_named_params_free(&np);
    ts_named_params_free(&nb);
    return st;
}

ts_status ts_fsdp_summary(ts_module *module, FILE *f)
{
    if (!module || !f)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_fsdp_summary: NULL %s", module ? "FILE" : "module");
    ts_status st = write_summary(module, f);
    /* flushed, so that a full disk or a closed pipe is this call's error */
    if (!st && (fflush(f) != 0 || ferror(f)))
        st = ts_error(TS_ERR_IO, "ts_fsdp_summary: writing failed: %s", strerror(errno));
    return st;
}

ts_status ts_fsdp_summary_str(ts_module *module, char *buf, size_t cap, size_t *len_out)
{
    if (!module || !len_out || (cap && !buf))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_fsdp_summary_str: NULL argument");
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f) return ts_error(TS_ERR_NO_MEMORY, "ts_fsdp_summary_str: open_memstream failed");
    ts_status st = write_summary(module, f);
    if (fclose(f) && !st) st = ts_error(TS_ERR_NO_MEMORY, "ts_fsdp_summary_str: out of memory");
    if (!st) {
        if (cap) {
            size_t n = len < cap - 1 ? len : cap - 1;
            memcpy(buf, text, n);
            buf[n] = '\0';
        }
        *len_out = len;
    }
    free(text);
    return st;
}
