/* The autograd tape (docs/design.md D3): every recorded op appends a node with
 * a sequence number; backward runs the nodes reachable from the root in
 * reverse creation order, so a node made after a module's ops (such as a
 * marker on its inputs) runs after all of them. */
#define _GNU_SOURCE
#include "tensor/internal.h"

#include <stdlib.h>
#include <string.h>

static atomic_uint_fast64_t next_seq = 1;
static _Thread_local bool tl_grad_disabled;
static _Thread_local bool tl_in_backward;

typedef struct queued_cb {
    ts_autograd_callback_fn fn;
    void *ctx;
} queued_cb;
static _Thread_local queued_cb *tl_queue;
static _Thread_local int tl_queue_len, tl_queue_cap;

bool ts_grad_mode_set(bool enabled)
{
    bool prev = !tl_grad_disabled;
    tl_grad_disabled = !enabled;
    return prev;
}

bool ts_grad_mode_enabled(void) { return !tl_grad_disabled; }
bool ts_autograd_in_backward(void) { return tl_in_backward; }

bool ts__needs_grad(int n, ts_tensor *const *inputs)
{
    if (tl_grad_disabled) return false;
    for (int i = 0; i < n; i++)
        if (inputs[i] && inputs[i]->requires_grad) return true;
    return false;
}

/* ------------------------------------------------------------ nodes */

ts_node *ts__node_new(const char *name, ts_node_backward_fn backward, int n_inputs, ts_tensor *const *inputs,
                      int n_outputs)
{
    ts_node *n = ts__calloc(TS_MEM_AUTOGRAD, 1, sizeof *n);
    if (!n) return NULL;
    n->inputs = ts__calloc(TS_MEM_AUTOGRAD, (size_t)(n_inputs ? n_inputs : 1), sizeof *n->inputs);
    n->out_dtype = ts__calloc(TS_MEM_AUTOGRAD, (size_t)n_outputs, sizeof *n->out_dtype);
    n->out_ndim = ts__calloc(TS_MEM_AUTOGRAD, (size_t)n_outputs, sizeof *n->out_ndim);
    n->out_shape = ts__calloc(TS_MEM_AUTOGRAD, (size_t)n_outputs, sizeof *n->out_shape);
    if (!n->inputs || !n->out_dtype || !n->out_ndim || !n->out_shape) {
        ts__free(TS_MEM_AUTOGRAD, n->inputs);
        ts__free(TS_MEM_AUTOGRAD, n->out_dtype);
        ts__free(TS_MEM_AUTOGRAD, n->out_ndim);
        ts__free(TS_MEM_AUTOGRAD, n->out_shape);
        ts__free(TS_MEM_AUTOGRAD, n);
        return NULL;
    }
    atomic_init(&n->refcount, 1);
    n->seq = atomic_fetch_add(&next_seq, 1);
    n->name = name;
    n->backward = backward;
    n->n_inputs = n_inputs;
    n->n_outputs = n_outputs;
    for (int i = 0; i < n_inputs; i++) {
        ts_tensor *t = inputs[i];
        if (!t || !t->requires_grad) continue;
        if (t->grad_fn) {
            n->inputs[i].node = t->grad_fn;
            n->inputs[i].index = t->output_index;
            ts__node_retain(t->grad_fn);
        } else {
            n->inputs[i].leaf = ts_tensor_retain(t);
        }
    }
    return n;
}

void ts__node_retain(ts_node *n) { atomic_fetch_add_explicit(&n->refcount, 1, memory_order_relaxed); }

/* Drops what a node saved for its backward: its saved tensors, and its
 * context when the context is itself saved state (a checkpoint's inputs:
 * a second backward through the node is then refused by collect). */
static void release_saved(ts_node *n)
{
    for (int i = 0; i < TS_NODE_MAX_SAVED; i++) {
        ts_tensor_free(n->saved[i]);
        n->saved[i] = NULL;
    }
    if (n->ctx_is_saved && n->ctx_free) {
        n->ctx_free(n->ctx);
        n->ctx = NULL;
        n->ctx_free = NULL;
    }
}

void ts__node_free(ts_node *n)
{
    /* Iterative over chains of last references, so that freeing a long
     * graph does not recurse once per node. */
    while (n) {
        if (atomic_fetch_sub_explicit(&n->refcount, 1, memory_order_acq_rel) != 1) return;
        ts_node *next = NULL;
        for (int i = 0; i < n->n_inputs; i++) {
            ts_tensor_free(n->inputs[i].leaf);
            ts_node *in = n->inputs[i].node;
            if (!in) continue;
            if (!next) next = in; /* continue with it below, without recursion */
            else ts__node_free(in);
        }
        release_saved(n);
        if (n->ctx_free) n->ctx_free(n->ctx);
        ts__free(TS_MEM_AUTOGRAD, n->inputs);
        ts__free(TS_MEM_AUTOGRAD, n->out_dtype);
        ts__free(TS_MEM_AUTOGRAD, n->out_ndim);
        ts__free(TS_MEM_AUTOGRAD, n->out_shape);
        ts__free(TS_MEM_AUTOGRAD, n);
        n = next;
    }
}

ts_status ts__node_save(ts_node *n, int i, ts_tensor *t)
{
    TS_ASSERT(i >= 0 && i < TS_NODE_MAX_SAVED);
    if (!t) return TS_OK;
    ts_tensor *a;
    ts_status st = ts__tensor_alias(t, t->ndim, t->shape, t->strides, t->offset, &a);
    if (st) return st;
    ts_tensor_free(n->saved[i]);
    n->saved[i] = a;
    return TS_OK;
}

void ts__node_set_output(ts_node *n, int index, ts_tensor *out)
{
    TS_ASSERT(index >= 0 && index < n->n_outputs && !out->grad_fn);
    ts__node_retain(n);
    out->grad_fn = n;
    out->output_index = index;
    out->requires_grad = true;
    n->out_dtype[index] = out->dtype;
    n->out_ndim[index] = out->ndim;
    memcpy(n->out_shape[index], out->shape, sizeof out->shape);
}

ts_status ts__record1(ts_node *n, ts_tensor *o, ts_tensor *s0, ts_tensor *s1)
{
    ts_status st = ts__node_save(n, 0, s0);
    if (!st) st = ts__node_save(n, 1, s1);
    if (!st) ts__node_set_output(n, 0, o);
    ts__node_free(n);
    if (st) ts_tensor_free(o);
    return st;
}

bool ts__node_needs_input_grad(const ts_node *n, int j)
{
    return j < n->n_inputs && (n->inputs[j].node || n->inputs[j].leaf);
}

/* ------------------------------------------------------------ tensor grads */

ts_status ts_tensor_set_requires_grad(ts_tensor *t, bool requires_grad)
{
    if (!t) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_tensor_set_requires_grad: tensor is NULL");
    if (t->grad_fn)
        return ts_error(TS_ERR_AUTOGRAD,
                        "ts_tensor_set_requires_grad: tensor%s%s%s is not a leaf (made by %s); "
                        "only leaves can change requires_grad (detach it first)",
                        t->name ? " '" : "", t->name ? t->name : "", t->name ? "'" : "", t->grad_fn->name);
    if (requires_grad && !ts_dtype_is_float(t->dtype))
        return ts_error(TS_ERR_DTYPE,
                        "ts_tensor_set_requires_grad: only floating tensors can require grad, "
                        "not %s",
                        ts_dtype_name(t->dtype));
    t->requires_grad = requires_grad;
    return TS_OK;
}

bool ts_tensor_requires_grad(const ts_tensor *t) { return t && t->requires_grad; }
bool ts_tensor_is_leaf(const ts_tensor *t) { return t && !t->grad_fn; }
ts_tensor *ts_tensor_grad(const ts_tensor *t) { return t ? t->grad : NULL; }

static ts_status check_grad_fits(const char *op, const ts_tensor *t, const ts_tensor *g)
{
    if (g->dtype != t->dtype)
        return ts_error(TS_ERR_DTYPE, "%s: gradient dtype %s does not match tensor dtype %s", op,
                        ts_dtype_name(g->dtype), ts_dtype_name(t->dtype));
    if (g->ndim != t->ndim || memcmp(g->shape, t->shape, (size_t)t->ndim * sizeof *t->shape) != 0) {
        char s1[96], s2[96];
        return ts_error(TS_ERR_SHAPE, "%s: gradient shape %s does not match tensor%s%s%s shape %s", op,
                        ts_shape_str(g->ndim, g->shape, s1, sizeof s1), t->name ? " '" : "", t->name ? t->name : "",
                        t->name ? "'" : "", ts_shape_str(t->ndim, t->shape, s2, sizeof s2));
    }
    return TS_OK;
}

ts_status ts_tensor_set_grad(ts_tensor *t, ts_tensor *g)
{
    if (!t) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_tensor_set_grad: tensor is NULL");
    if (g) {
        ts_status st = check_grad_fits("ts_tensor_set_grad", t, g);
        if (st) return st;
    }
    ts_tensor_retain(g);
    ts_tensor_free(t->grad);
    t->grad = g;
    return TS_OK;
}

void ts_tensor_zero_grad(ts_tensor *t, bool set_to_none)
{
    if (!t || !t->grad) return;
    if (set_to_none) {
        ts_tensor_free(t->grad);
        t->grad = NULL;
    } else {
        ts_tensor_fill_(t->grad, 0.0);
    }
}

/* Adds g into leaf's .grad: the first gradient is stored (as a private
 * contiguous copy unless nobody else holds it), later ones are added in
 * place, as PyTorch's AccumulateGrad does. */
static ts_status accumulate_leaf(ts_tensor *leaf, ts_tensor *g)
{
    ts_status st = check_grad_fits("backward (accumulate into .grad)", leaf, g);
    if (st) return st;
    if (!leaf->grad) {
        /* keep the incoming tensor only if nothing else can see its data:
         * a view's backward hands back another handle on the caller's
         * storage, which a later in-place accumulation would change */
        if (atomic_load(&g->refcount) == 1 && atomic_load(&g->storage->refcount) == 1 && ts__is_contiguous(g) &&
            !g->grad_fn && g->offset == 0 &&
            ts_tensor_numel(g) * (int64_t)ts_dtype_size(g->dtype) == (int64_t)g->storage->nbytes) {
            leaf->grad = ts_tensor_retain(g);
            return TS_OK;
        }
        ts_tensor *c;
        if ((st = ts__tensor_new(g->dtype, g->ndim, g->shape, &c))) return st;
        ts__copy_into("backward", c, g);
        leaf->grad = c;
        return TS_OK;
    }
    if (leaf->grad->storage->released)
        return ts_error(TS_ERR_RELEASED, "backward: the .grad of%s%s%s has released storage", leaf->name ? " '" : "",
                        leaf->name ? leaf->name : "", leaf->name ? "'" : " a leaf");
    return ts__add_inplace(leaf->grad, g);
}

ts_status ts__accumulate(ts_tensor **acc, ts_tensor *src)
{
    if (!*acc) {
        *acc = ts_tensor_retain(src);
        return TS_OK;
    }
    ts_tensor *sum;
    ts_status st = ts__add_nograd(*acc, src, &sum);
    if (st) return st;
    ts_tensor_free(*acc);
    *acc = sum;
    return TS_OK;
}

/* ------------------------------------------------------------ backward */

typedef struct node_vec {
    ts_node **v;
    int n, cap;
} node_vec;

static ts_status vec_push(node_vec *nv, ts_node *n)
{
    if (nv->n == nv->cap) {
        int cap = nv->cap ? nv->cap * 2 : 64;
        ts_node **v = ts__malloc(TS_MEM_AUTOGRAD, (size_t)cap * sizeof *v);
        if (!v) return TS_ERR_NO_MEMORY;
        if (nv->n) memcpy(v, nv->v, (size_t)nv->n * sizeof *v);
        ts__free(TS_MEM_AUTOGRAD, nv->v);
        nv->v = v;
        nv->cap = cap;
    }
    nv->v[nv->n++] = n;
    return TS_OK;
}

static int by_seq_desc(const void *a, const void *b)
{
    uint64_t x = (*(ts_node *const *)a)->seq, y = (*(ts_node *const *)b)->seq;
    return x < y ? 1 : x > y ? -1 : 0;
}

/* Every node reachable from root, each once (marked by a non-NULL
 * grad_buf, which the run below needs anyway). */
static ts_status collect(ts_node *root, node_vec *order)
{
    node_vec stack = {0};
    ts_status st = TS_OK;
    if ((st = vec_push(&stack, root))) goto out;
    while (stack.n) {
        ts_node *n = stack.v[--stack.n];
        if (n->grad_buf) continue;
        if (n->released) {
            st = ts_error(TS_ERR_AUTOGRAD,
                          "backward: trying to backward through the graph a second time (node "
                          "'%s'): its saved tensors were released by the first backward; pass "
                          "retain_graph=true to that backward if you need a second one",
                          n->name);
            goto out;
        }
        n->grad_buf = ts__calloc(TS_MEM_AUTOGRAD, (size_t)n->n_outputs, sizeof *n->grad_buf);
        if (!n->grad_buf) st = TS_ERR_NO_MEMORY;
        else if ((st = vec_push(order, n))) {
            ts__free(TS_MEM_AUTOGRAD, n->grad_buf); /* not in `order`: nobody else would free it */
            n->grad_buf = NULL;
        }
        if (st) goto out;
        for (int i = 0; i < n->n_inputs; i++)
            if (n->inputs[i].node && !n->inputs[i].node->grad_buf)
                if ((st = vec_push(&stack, n->inputs[i].node))) goto out;
    }
out:
    ts__free(TS_MEM_AUTOGRAD, stack.v);
    return st;
}

static void drop_grad_bufs(node_vec *order)
{
    for (int k = 0; k < order->n; k++) {
        ts_node *n = order->v[k];
        if (!n->grad_buf) continue;
        for (int i = 0; i < n->n_outputs; i++) ts_tensor_free(n->grad_buf[i]);
        ts__free(TS_MEM_AUTOGRAD, n->grad_buf);
        n->grad_buf = NULL;
    }
}

static ts_status run_node(ts_node *n, bool retain_graph)
{
    bool any = false;
    for (int i = 0; i < n->n_outputs; i++) any |= n->grad_buf[i] != NULL;
    if (!any) return TS_OK; /* no gradient reached this node */
    ts_status st = TS_OK;
    for (int i = 0; i < TS_NODE_MAX_SAVED; i++)
        if (n->saved[i] && n->saved[i]->storage->released) {
            char s[96];
            return ts_error(TS_ERR_RELEASED,
                            "backward: node '%s' saved a tensor %s whose storage is released; "
                            "restore (unshard) it before running backward through this node",
                            n->name, ts_shape_str(n->saved[i]->ndim, n->saved[i]->shape, s, sizeof s));
        }
    /* multi-output nodes see zeros where no gradient flowed */
    for (int i = 0; i < n->n_outputs && n->n_outputs > 1; i++)
        if (!n->grad_buf[i] &&
            (st = ts_tensor_zeros(n->out_dtype[i], n->out_ndim[i], n->out_shape[i], &n->grad_buf[i])))
            return st;
    ts_tensor *stack_ins[8] = {0};
    ts_tensor **grad_ins = stack_ins;
    if (n->n_inputs > 8 && !(grad_ins = ts__calloc(TS_MEM_AUTOGRAD, (size_t)n->n_inputs, sizeof *grad_ins)))
        return TS_ERR_NO_MEMORY;
    st = n->backward(n, n->grad_buf, grad_ins);
    for (int j = 0; j < n->n_inputs; j++) {
        ts_tensor *g = grad_ins[j];
        if (!g) continue;
        if (!st) {
            ts_edge *e = &n->inputs[j];
            if (e->node) st = ts__accumulate(&e->node->grad_buf[e->index], g);
            else if (e->leaf) st = accumulate_leaf(e->leaf, g);
        }
        ts_tensor_free(g);
    }
    if (grad_ins != stack_ins) ts__free(TS_MEM_AUTOGRAD, grad_ins);
    for (int i = 0; i < n->n_outputs; i++) {
        ts_tensor_free(n->grad_buf[i]);
        n->grad_buf[i] = NULL;
    }
    if (!retain_graph && n->backward) {
        release_saved(n);
        n->released = true;
    }
    return st;
}

static ts_status run_callbacks(void)
{
    ts_status first = TS_OK;
    /* a callback may queue another one; run until the queue is empty */
    for (int i = 0; i < tl_queue_len; i++) {
        ts_status st = tl_queue[i].fn(tl_queue[i].ctx);
        if (st && !first) first = st;
    }
    /* the queue is thread-local: give it back, so that a thread that
     * ends after a backward leaks nothing */
    ts__free(TS_MEM_AUTOGRAD, tl_queue);
    tl_queue = NULL;
    tl_queue_len = tl_queue_cap = 0;
    return first;
}

ts_status ts_backward(ts_tensor *root, ts_tensor *grad, bool retain_graph)
{
    if (!root) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_backward: root tensor is NULL");
    if (tl_in_backward) return ts_error(TS_ERR_STATE, "ts_backward: a backward is already running on this thread");
    if (!ts__meta_mode() && (ts__is_meta(root) || ts__is_meta(grad)))
        return ts__meta_error("ts_backward", ts__is_meta(root) ? 0 : 1, ts__is_meta(root) ? root : grad);
    if (!root->requires_grad) {
        char s[96];
        return ts_error(TS_ERR_AUTOGRAD, "ts_backward: tensor %s does not require grad and has no grad_fn",
                        ts_shape_str(root->ndim, root->shape, s, sizeof s));
    }
    ts_status st;
    if (grad) {
        if ((st = check_grad_fits("ts_backward", root, grad))) return st;
        ts_tensor_retain(grad);
    } else {
        if (ts_tensor_numel(root) != 1) {
            char s[96];
            return ts_error(TS_ERR_AUTOGRAD,
                            "ts_backward: grad can be implicitly created only for outputs with "
                            "one element; root has shape %s (pass a gradient of that shape)",
                            ts_shape_str(root->ndim, root->shape, s, sizeof s));
        }
        if ((st = ts_tensor_ones(root->dtype, root->ndim, root->shape, &grad))) return st;
    }
    TS_TRACE_BEGIN(t_bwd);
    tl_in_backward = true;
    tl_queue_len = 0;
    bool prev_mode = ts_grad_mode_set(false); /* backward formulas are not recorded */
    if (!root->grad_fn) {
        st = accumulate_leaf(root, grad);
        ts_tensor_free(grad);
        ts_status cb = run_callbacks();
        tl_in_backward = false;
        ts_grad_mode_set(prev_mode);
        TS_TRACE_END(t_bwd, "backward", "compute");
        return st ? st : cb;
    }
    node_vec order = {0};
    st = collect(root->grad_fn, &order);
    if (!st) {
        qsort(order.v, (size_t)order.n, sizeof *order.v, by_seq_desc);
        root->grad_fn->grad_buf[root->output_index] = ts_tensor_retain(grad);
        for (int k = 0; k < order.n && !st; k++) st = run_node(order.v[k], retain_graph);
    }
    ts_tensor_free(grad);
    drop_grad_bufs(&order);
    ts__free(TS_MEM_AUTOGRAD, order.v);
    ts_status cb = TS_OK;
    if (!st) {
        cb = run_callbacks();
    } else { /* a failed backward does not run them; drop them */
        ts__free(TS_MEM_AUTOGRAD, tl_queue);
        tl_queue = NULL;
        tl_queue_len = tl_queue_cap = 0;
    }
    tl_queue_len = 0;
    tl_in_backward = false;
    ts_grad_mode_set(prev_mode);
    TS_TRACE_END(t_bwd, "backward", "compute");
    return st ? st : cb;
}

/* A backward started inside a node's backward (activation checkpointing's
 * recompute): runs the graph reachable from the roots with their
 * gradients, accumulating into leaves' .grad. It shares the outer
 * backward's state: the callbacks it queues run when the outer backward
 * ends, and nodes of the outer graph it reaches (they have a grad_buf
 * already) are not run here: their gradients wait in their grad_buf for the
 * outer run, as any other input gradient. */
ts_status ts__backward_nested(int n, ts_tensor *const *roots, ts_tensor *const *grads)
{
    if (!tl_in_backward) return ts_error(TS_ERR_STATE, "backward (nested): no backward is running on this thread");
    node_vec order = {0};
    ts_status st = TS_OK;
    for (int i = 0; i < n && !st; i++) {
        ts_tensor *r = roots[i];
        if (!r || !grads[i] || !r->requires_grad) continue;
        if ((st = check_grad_fits("backward (nested)", r, grads[i]))) break;
        if (r->grad_fn && !r->grad_fn->grad_buf) st = collect(r->grad_fn, &order);
    }
    if (!st) {
        qsort(order.v, (size_t)order.n, sizeof *order.v, by_seq_desc);
        for (int i = 0; i < n && !st; i++) {
            ts_tensor *r = roots[i];
            if (!r || !grads[i] || !r->requires_grad) continue;
            if (r->grad_fn) st = ts__accumulate(&r->grad_fn->grad_buf[r->output_index], grads[i]);
            else st = accumulate_leaf(r, grads[i]);
        }
        for (int k = 0; k < order.n && !st; k++) st = run_node(order.v[k], false);
    }
    drop_grad_bufs(&order);
    ts__free(TS_MEM_AUTOGRAD, order.v);
    return st;
}

ts_status ts_autograd_queue_callback(ts_autograd_callback_fn fn, void *ctx)
{
    if (!fn) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_autograd_queue_callback: callback is NULL");
    if (!tl_in_backward)
        return ts_error(TS_ERR_STATE, "ts_autograd_queue_callback: no backward is running on this thread");
    if (tl_queue_len == tl_queue_cap) {
        int cap = tl_queue_cap ? tl_queue_cap * 2 : 16;
        queued_cb *q = ts__malloc(TS_MEM_AUTOGRAD, (size_t)cap * sizeof *q);
        if (!q) return ts_error(TS_ERR_NO_MEMORY, "ts_autograd_queue_callback: out of memory");
        if (tl_queue_len) memcpy(q, tl_queue, (size_t)tl_queue_len * sizeof *q);
        ts__free(TS_MEM_AUTOGRAD, tl_queue);
        tl_queue = q;
        tl_queue_cap = cap;
    }
    tl_queue[tl_queue_len++] = (queued_cb){fn, ctx};
    return TS_OK;
}

/* ------------------------------------------------------------ custom nodes */

static ts_status custom_backward(ts_node *n, ts_tensor **grad_outs, ts_tensor **grad_ins)
{
    ts_autograd_backward_fn fn = (ts_autograd_backward_fn)(uintptr_t)n->iargs[0];
    for (int i = 0; i < n->n_outputs; i++) grad_ins[i] = ts_tensor_retain(grad_outs[i]);
    return fn(n->ctx, n->n_outputs, grad_ins);
}

ts_status ts_autograd_custom(int n, ts_tensor *const *inputs, ts_autograd_backward_fn fn, void *ctx,
                             void (*ctx_free)(void *ctx), ts_tensor **outs)
{
    if (n <= 0 || !inputs || !fn || !outs)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "ts_autograd_custom: need n > 0 inputs, a callback and outs "
                        "(n = %d)",
                        n);
    for (int i = 0; i < n; i++)
        if (!inputs[i]) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_autograd_custom: input %d is NULL", i);
    ts_tensor *tmp[64];
    if (n > 64) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_autograd_custom: at most 64 tensors, got %d", n);
    ts_status st = TS_OK;
    int made = 0;
    for (; made < n; made++) {
        const ts_tensor *t = inputs[made];
        if ((st = ts__tensor_alias(t, t->ndim, t->shape, t->strides, t->offset, &tmp[made]))) break;
        tmp[made]->is_shard = t->is_shard;
        tmp[made]->dist = t->dist;
    }
    ts_node *node = NULL;
    if (!st && ts__needs_grad(n, inputs)) {
        node = ts__node_new("autograd_custom", custom_backward, n, inputs, n);
        if (!node) st = TS_ERR_NO_MEMORY;
    }
    if (st) {
        for (int i = 0; i < made; i++) ts_tensor_free(tmp[i]);
        return st;
    }
    if (node) {
        node->iargs[0] = (int64_t)(uintptr_t)fn;
        node->ctx = ctx;
        node->ctx_free = ctx_free;
        for (int i = 0; i < n; i++)
            if (inputs[i]->requires_grad) ts__node_set_output(node, i, tmp[i]);
        ts__node_free(node);
    } else if (ctx_free) {
        ctx_free(ctx);
    }
    memcpy(outs, tmp, (size_t)n * sizeof *outs);
    return TS_OK;
}
