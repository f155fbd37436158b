/*
 * Activation checkpointing (PyTorch's torch.utils.checkpoint with
 * use_reentrant=False, applied to a module as checkpoint_wrapper or the
 * composable checkpoint(module) do): the module's forward runs without
 * recording a graph and keeps only its inputs and the default generator's
 * state; its outputs carry one autograd node whose backward re-runs the
 * forward with grad enabled and that generator state (dropout draws the
 * same masks), then differentiates the recomputed graph inside the
 * backward (ts__backward_nested) and hands back the inputs' gradients.
 * The node's context (the inputs, the module reference) goes as soon as
 * that backward has run without retain_graph (ts_node.ctx_is_saved), not
 * when the caller frees the graph.
 *
 * A checkpointed module's vtable is "<Type>Checkpointed", extending the
 * type's own (ts_module_vtable.base). It sits under any vtable an upper
 * layer adds: fully_shard after ts_checkpoint_module wraps it
 * ("<Type>CheckpointedFSDPModule"), and ts_checkpoint_module after
 * fully_shard asks fully_shard's vtable to extend it instead of the
 * original (ts_module_vtable.rebase), which gives the same module. So
 * fully_shard's hooks always run outside the checkpoint, as FSDP2's hooks
 * run outside AC's in PyTorch.
 */
#include "nn/internal.h"
#include "tensor/internal.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

static ts_status ckpt_forward(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out);
static void ckpt_free(ts_module *m);

/* ------------------------------------------------------------ vtables */

static bool is_ckpt_vt(const ts_module_vtable *vt) { return vt && vt->base && vt->forward == ckpt_forward; }

/* The Checkpointed vtable in m's chain, or NULL. */
static const ts_module_vtable *find_ckpt_vt(const ts_module *m)
{
    for (const ts_module_vtable *vt = m ? m->vtable : NULL; vt; vt = vt->base)
        if (is_ckpt_vt(vt)) return vt;
    return NULL;
}

/* The Checkpointed slots of vt extending orig: named methods run as they
 * are, not checkpointed. */
static void ckpt_fill(ts_module_vtable *vt, const ts_module_vtable *orig)
{
    vt->forward = ckpt_forward;
    vt->free = ckpt_free;
    vt->extra_repr = orig->extra_repr;
    vt->call_method = orig->call_method;
}

static ts__vt_cache g_vts = TS__VT_CACHE_INIT("ts_checkpoint_module", "Checkpointed", ckpt_fill);

/* The "<Type>Checkpointed" vtable extending orig, made once per original
 * vtable and kept for the life of the process. */
static ts_status ckpt_vtable(const ts_module_vtable *orig, const ts_module_vtable **out)
{
    return ts__vt_cache_get(&g_vts, orig, out);
}

bool ts_module_is_checkpointed(const ts_module *m) { return find_ckpt_vt(m) != NULL; }

ts_status ts_checkpoint_module(ts_module *m)
{
    if (!m) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_checkpoint_module: module is NULL");
    if (!m->vtable)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "ts_checkpoint_module: the module has no vtable (ts_module_init failed or was not called)");
    if (find_ckpt_vt(m))
        return ts_error(TS_ERR_ALREADY, "ts_checkpoint_module: %s is already checkpointed", ts_module_type_name(m));
    const ts_module_vtable *top = m->vtable, *orig = top->base ? top->base : top;
    if (top->base && top->base->base)
        return ts_error(TS_ERR_UNSUPPORTED,
                        "ts_checkpoint_module: %s extends %s, which extends %s: only one upper layer (fully_shard) "
                        "can be under a checkpoint",
                        top->type_name, top->base->type_name, top->base->base->type_name);
    if (top->base && !top->rebase)
        return ts_error(TS_ERR_UNSUPPORTED,
                        "ts_checkpoint_module: %s extends %s and cannot be made to extend %sCheckpointed (its vtable "
                        "has no rebase); checkpoint the module before that layer rewrites it",
                        top->type_name, orig->type_name, orig->type_name);
    ts_status st = ts__module_vtable_check("ts_checkpoint_module", orig, false);
    if (!st) st = ts__module_check_free("ts_checkpoint_module", m);
    if (st) return st;
    if (!orig->forward)
        return ts_error(TS_ERR_UNSUPPORTED,
                        "ts_checkpoint_module: %s has no forward (a container such as ModuleList): checkpoint the "
                        "modules it holds instead",
                        orig->type_name);
    const ts_module_vtable *vt = NULL;
    if ((st = ckpt_vtable(orig, &vt))) return st;
    if (!top->base) {
        m->vtable = vt;
        return TS_OK;
    }
    return top->rebase(m, vt);
}

static void ckpt_free(ts_module *m)
{
    const ts_module_vtable *vt = find_ckpt_vt(m);
    m->vtable = vt->base; /* the original's free sees its own vtable */
    ts__module_release(m);
}

/* ------------------------------------------------------------ forward */

typedef struct ckpt_ctx {
    ts_module *m;                          /* retained: the node may outlive its parent's free */
    ts_module_fn fn;                       /* the type's own forward */
    int n_in, n_out;                       /* the module's inputs and outputs */
    ts_tensor *in[TS_MODULE_MAX_IO];       /* detached aliases of the inputs (NULL where absent) */
    bool in_rg[TS_MODULE_MAX_IO];          /* the inputs' requires_grad */
    int out_map[TS_MODULE_MAX_IO];         /* node output k is module output out_map[k] */
    uint8_t rng[TS_GENERATOR_STATE_BYTES]; /* the default generator before the forward */
} ckpt_ctx;

static void ctx_free(void *vc)
{
    ckpt_ctx *c = vc;
    if (!c) return;
    for (int i = 0; i < c->n_in; i++) ts_tensor_free(c->in[i]);
    ts_module_free(c->m);
    ts__free(TS_MEM_AUTOGRAD, c);
}

/* A new handle on t's data without autograd history (NULL for NULL). */
static ts_status alias_of(const ts_tensor *t, ts_tensor **out)
{
    *out = NULL;
    if (!t) return TS_OK;
    ts_status st = ts__tensor_alias(t, t->ndim, t->shape, t->strides, t->offset, out);
    if (st) return ts_error(st, "activation checkpoint: out of memory");
    (*out)->is_shard = t->is_shard;
    (*out)->dist = t->dist;
    return TS_OK;
}

/* Stops the visit at the first parameter that requires grad. */
typedef struct rg_walk {
    bool found;
} rg_walk;

static ts_status rg_param(void *vc, const char *name, ts_tensor **slot)
{
    (void)name;
    rg_walk *w = vc;
    if (*slot && ts_tensor_requires_grad(*slot)) {
        w->found = true;
        return TS_ERR_ALREADY; /* a stop signal, never reported */
    }
    return TS_OK;
}

static ts_status rg_child(void *vc, const char *name, ts_module *child)
{
    (void)name;
    rg_walk *w = vc;
    if (!child || !child->vtable) return TS_OK;
    ts_module_visitor v = {.param = rg_param, .child = rg_child, .ctx = w};
    ts_status st = ts_module_visit(child, &v);
    return w->found ? TS_ERR_ALREADY : st;
}

static bool params_require_grad(ts_module *m)
{
    rg_walk w = {false};
    (void)rg_child(&w, "", m);
    return w.found;
}

static ts_status ckpt_backward(ts_node *n, ts_tensor **grad_outs, ts_tensor **grad_ins);

static ts_status ckpt_forward(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    const ts_module_vtable *vt = find_ckpt_vt(m);
    ts_module_fn fn = vt->base->forward;
    bool any_in = false;
    for (int i = 0; i < n_in; i++) any_in |= in[i] && ts_tensor_requires_grad(in[i]);
    /* nothing to differentiate: the plain forward (PyTorch's checkpoint
     * also just runs it then) */
    if (!ts_grad_mode_enabled() || (!any_in && !params_require_grad(m))) return fn(m, n_in, in, n_out, out);
    if (n_in > TS_MODULE_MAX_IO)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %d inputs (at most %d)", vt->type_name, n_in, TS_MODULE_MAX_IO);
    ckpt_ctx *c = ts__calloc(TS_MEM_AUTOGRAD, 1, sizeof *c);
    if (!c) return ts_error(TS_ERR_NO_MEMORY, "%s: out of memory (checkpoint context)", vt->type_name);
    c->fn = fn;
    c->n_in = n_in;
    ts_status st = TS_OK;
    for (int i = 0; i < n_in && !st; i++) {
        st = alias_of(in[i], &c->in[i]);
        c->in_rg[i] = in[i] && ts_tensor_requires_grad(in[i]);
    }
    if (st) {
        ctx_free(c);
        return st;
    }
    ts_generator_get_state(ts_default_generator(), c->rng);
    c->m = ts_module_retain(m);
    bool prev = ts_grad_mode_set(false);
    int n_o = 0;
    ts_tensor *o[TS_MODULE_MAX_IO] = {0};
    st = fn(m, n_in, in, &n_o, o);
    ts_grad_mode_set(prev);
    if (st) {
        ctx_free(c);
        return st;
    }
    c->n_out = n_o;
    /* the floating outputs become the node's outputs, as fresh aliases
     * (an output may be an input passed through, with its own history) */
    ts_tensor *fl[TS_MODULE_MAX_IO];
    int k = 0;
    for (int j = 0; j < n_o; j++)
        if (o[j] && ts_dtype_is_float(ts_tensor_dtype(o[j]))) {
            c->out_map[k] = j;
            fl[k++] = o[j];
        }
    if (k == 0) {
        ctx_free(c);
        memcpy(out, o, (size_t)n_o * sizeof *o);
        *n_out = n_o;
        return TS_OK;
    }
    ts_tensor *al[TS_MODULE_MAX_IO] = {0};
    for (int q = 0; q < k && !st; q++) st = alias_of(fl[q], &al[q]);
    ts_node *node = NULL;
    if (!st && !(node = ts__node_new("checkpoint", ckpt_backward, n_in, in, k)))
        st = ts_error(TS_ERR_NO_MEMORY, "%s: out of memory (checkpoint node)", vt->type_name);
    if (st) {
        for (int q = 0; q < k; q++) ts_tensor_free(al[q]);
        for (int j = 0; j < n_o; j++) ts_tensor_free(o[j]);
        ctx_free(c);
        return st;
    }
    node->ctx = c;
    node->ctx_free = ctx_free;
    node->ctx_is_saved = true; /* the inputs go when the node's backward has run (unless retain_graph) */
    for (int q = 0; q < k; q++) {
        ts__node_set_output(node, q, al[q]);
        ts_tensor_free(o[c->out_map[q]]);
        o[c->out_map[q]] = al[q];
    }
    ts__node_free(node);
    memcpy(out, o, (size_t)n_o * sizeof *o);
    *n_out = n_o;
    return TS_OK;
}

/* ------------------------------------------------------------ backward */

static ts_status ckpt_backward(ts_node *n, ts_tensor **grad_outs, ts_tensor **grad_ins)
{
    ckpt_ctx *c = n->ctx;
    const char *type = ts_module_type_name(c->m);
    ts_tensor *x[TS_MODULE_MAX_IO] = {0}, *o[TS_MODULE_MAX_IO] = {0};
    int n_o = 0;
    ts_status st = TS_OK;
    for (int i = 0; i < c->n_in && !st; i++) {
        st = alias_of(c->in[i], &x[i]);
        if (!st && c->in_rg[i]) x[i]->requires_grad = true; /* a leaf: its .grad is the input's gradient */
    }
    if (st) goto out;
    /* (a) the generator as at the forward, (b) the forward again with grad */
    uint8_t *now = ts__malloc(TS_MEM_AUTOGRAD, TS_GENERATOR_STATE_BYTES);
    if (!now) {
        st = ts_error(TS_ERR_NO_MEMORY, "%s: out of memory (checkpoint recompute)", type);
        goto out;
    }
    ts_generator *gen = ts_default_generator();
    ts_generator_get_state(gen, now);
    if ((st = ts_generator_set_state(gen, c->rng))) {
        ts__free(TS_MEM_AUTOGRAD, now);
        goto out;
    }
    bool prev = ts_grad_mode_set(true);
    st = c->fn(c->m, c->n_in, x, &n_o, o);
    ts_grad_mode_set(prev);
    ts_status rs = ts_generator_set_state(gen, now); /* the current state back */
    ts__free(TS_MEM_AUTOGRAD, now);
    if (st) {
        n_o = 0;
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", ts_last_error());
        ts_error(st, "%s: the recompute of the checkpointed forward failed: %s", type, msg);
        goto out;
    }
    if ((st = rs)) goto out;
    if (n_o != c->n_out) {
        st = ts_error(TS_ERR_STATE, "%s: the checkpointed forward returned %d outputs, its recompute %d", type,
                      c->n_out, n_o);
        goto out;
    }
    /* (c) backward through the recomputed graph */
    ts_tensor *roots[TS_MODULE_MAX_IO];
    for (int q = 0; q < n->n_outputs; q++) roots[q] = o[c->out_map[q]];
    if ((st = ts__backward_nested(n->n_outputs, roots, grad_outs))) {
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", ts_last_error());
        ts_error(st, "%s: the backward of the checkpointed recompute failed: %s", type, msg);
        goto out;
    }
    for (int i = 0; i < c->n_in; i++)
        if (x[i] && c->in_rg[i] && ts__node_needs_input_grad(n, i)) grad_ins[i] = ts_tensor_retain(x[i]->grad);
out:
    for (int i = 0; i < c->n_in; i++) ts_tensor_free(x[i]);
    for (int j = 0; j < n_o; j++) ts_tensor_free(o[j]);
    return st;
}
