/* ts_fsdp_memory_estimate: one training step played on a model of the
 * caching pool (fully_shard.h, "memory"; docs/fully_shard.md, "Memory").
 *
 * The model is a tape like autograd's: buffers with reference counts
 * (each a pool block: its bytes rounded by ts__pool_block_bytes), nodes
 * that hold their saved buffers and, in backward, make the gradients of
 * their inputs, which are accumulated into the producer's gradient slot
 * (the first one taken, later ones summed into a new buffer) or into a
 * parameter's gradient (the first one kept, later ones added in place),
 * as tensor/autograd.c does. fully_shard's hooks are nodes too: a
 * pre-backward marker on a group's outputs unshards it (and prefetches
 * the group before it in post-forward order), a post-backward marker on
 * its inputs packs its gradients into the reduce-scatter input and
 * reshards, as fully_shard/param_group.c does. Each op below mirrors its
 * forward in tensor/ and nn/: the buffers it makes, the ones the module
 * frees when it returns, and what its node saves. */
#define _GNU_SOURCE
#include "fully_shard/internal.h"

#include "nn/internal.h"
#include "tensor/flash_attention.h"
#include "tensor/gemm_half.h"
#include "tensor/internal.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ------------------------------------------------------------ pool model */

typedef struct mbuf {
    int64_t bytes;
    int refs;
    int comp; /* -1: one pool block of `bytes`; else the group whose full parameters (u_blk) it stands for */
} mbuf;

/* [Note: pool classes] The caching pool keeps every block it ever handed
 * out, on the free list of its size class (tensor/pool.c), and hands a
 * cached block only to a request of the same class. So what it holds,
 * TS_MEM_POOL, is for each class the most blocks of that class live at
 * once so far, times the class's bytes: more than the storage peak when
 * blocks freed in one class are followed by requests in another (the full
 * parameters each rank builds and frees at start-up are the large case).
 * The model counts live blocks per class beside the total, and the pool's
 * peak is the sum over classes of each one's high-water mark. */
typedef struct mclass {
    int64_t bytes, live, peak;
} mclass;

enum { HOOK_NONE = 0, HOOK_PRE_BWD, HOOK_POST_BWD, HOOK_CKPT };

typedef struct mgin {
    int64_t bytes; /* a new buffer of these bytes; 0 with alias: the node's own output gradient passed on */
    bool alias;
    int dest, slot; /* the producer node and its output slot (-1: none) */
    int leaf;       /* a parameter (-1: none) */
    int64_t scratch; /* pool blocks the op takes and frees right after making this gradient (a 16-bit product's) */
} mgin;

typedef struct mnode {
    int saved[6], ns;
    int grad[3];    /* accumulated output gradients (buffer ids, -1 none) */
    mgin g[4];
    int ng;
    int64_t scratch; /* buffers made and freed inside its backward */
    int hook, group;
    int ckpt_block;  /* HOOK_CKPT: the block to recompute */
} mnode;

typedef struct mparam {
    int group;
    int grad; /* buffer of the unsharded gradient, -1 */
    int held; /* copy-free: the gradient the reduce-scatter in flight reads, -1 */
} mparam;

typedef struct mgroup {
    int64_t u, ag, ag_in, staging, rs_in, rs_out, conv;
    /* per parameter, the pool blocks ([Note: pool classes]): the unsharded one (u is their sum), the
     * full one built before sharding (in the parameters' dtype), the local shard's (optimizer state) */
    int64_t *u_blk, *full_blk, *local_blk;
    int n_blk;
    int64_t host; /* the sharded buffer's block (0: not a pool block, pinned) */
    int64_t sgrad; /* the persistent parameters' gradients (one block each, summed); the sharded ones' are
                      views of the reduction's output (rs_out, or conv), which stays */
    bool sharded;  /* the group has sharded parameters (it reduces; their gradients view its output) */
    int64_t rs_scratch; /* the reduce-scatter's own stages (comm/comm.c setup_rs), held until it is waited on */
    bool reshard, offload;
    bool cf; /* copy-free collectives (param_group.c): no all-gather buffer, no packed input, the
                gradients kept until the reduce-scatter is waited on, U filled in place */
    int state; /* 0 sharded, 1 all-gather in flight, 2 unsharded */
    int u_buf, ag_buf, ag_in_buf, staging_buf, rs_in_buf, rs_out_buf, rs_scratch_buf;
    bool has_sgrad;
} mgroup;

/* Shapes of the step (a GPT's (B, T) or a Sequential's rows). */
typedef struct msim {
    mbuf *b;
    int nb, cap_b;
    mnode *n;
    int nn, cap_n;
    mparam *p;
    int np, cap_p;
    mgroup *g;
    int ng;
    int64_t live, peak;
    mclass *cls; /* live blocks per pool class ([Note: pool classes]) */
    int ncls, cap_cls;
    ts_status err;
    /* the step */
    int64_t B, T, R;   /* batch, sequence (1 for 2-d inputs), rows B*T */
    size_t ces;        /* compute dtype size (param_dtype) */
    ts_dtype half;     /* the 16-bit compute dtype (TS_BF16, TS_F16) when ces is 2 */
    size_t es;         /* parameters' own dtype size */
    int W;
    bool prefetch_fwd, prefetch_bwd, ckpt;
    bool no_grad;      /* a checkpointed forward: ops record nothing */
    int pending;       /* group whose reduce-scatter is in flight (-1) */
    const struct mblock *blocks; /* the GPT's blocks (a checkpoint node recomputes blocks[ckpt_block]) */
    int *order;        /* post-forward order of the groups (each once) */
    int n_order;
} msim;

static bool grow(void **a, int *cap, int need, size_t elem)
{
    if (need <= *cap) return true;
    int c = *cap ? *cap * 2 : 64;
    while (c < need) c *= 2;
    void *n = realloc(*a, (size_t)c * elem);
    if (!n) return false;
    *a = n;
    *cap = c;
    return true;
}

static int64_t pool_bytes(int64_t raw) { return (int64_t)ts__pool_block_bytes((size_t)(raw > 0 ? raw : 0)); }

/* n more (or fewer) live blocks of pool class pb. */
static void cls_count(msim *s, int64_t pb, int64_t n)
{
    if (pb <= 0 || s->err) return;
    int i = 0;
    while (i < s->ncls && s->cls[i].bytes != pb) i++;
    if (i == s->ncls) {
        if (!grow((void **)&s->cls, &s->cap_cls, s->ncls + 1, sizeof *s->cls)) {
            s->err = TS_ERR_NO_MEMORY;
            return;
        }
        s->cls[s->ncls++] = (mclass){pb, 0, 0};
    }
    s->cls[i].live += n;
    if (s->cls[i].live > s->cls[i].peak) s->cls[i].peak = s->cls[i].live;
}

/* What the pool holds at the end: each class's high-water mark. */
static int64_t cls_pool(const msim *s)
{
    int64_t t = 0;
    for (int i = 0; i < s->ncls; i++) t += s->cls[i].bytes * s->cls[i].peak;
    return t;
}

static void comp_count(msim *s, int comp, int64_t n)
{
    const struct mgroup *g = &s->g[comp];
    for (int k = 0; k < g->n_blk; k++) cls_count(s, g->u_blk[k], n);
}

/* A new buffer of raw bytes (one reference); -1 after an error. */
static int balloc(msim *s, int64_t raw)
{
    if (s->err) return -1;
    if (!grow((void **)&s->b, &s->cap_b, s->nb + 1, sizeof *s->b)) {
        s->err = TS_ERR_NO_MEMORY;
        return -1;
    }
    int64_t pb = pool_bytes(raw);
    s->b[s->nb] = (mbuf){pb, 1, -1};
    cls_count(s, pb, 1);
    s->live += pb;
    if (s->live > s->peak) s->peak = s->live;
    return s->nb++;
}

static int bref(msim *s, int id)
{
    if (id >= 0) s->b[id].refs++;
    return id;
}

static void bunref(msim *s, int id)
{
    if (id < 0) return;
    if (--s->b[id].refs == 0) {
        s->live -= s->b[id].bytes;
        if (s->b[id].comp >= 0) comp_count(s, s->b[id].comp, -1);
        else cls_count(s, s->b[id].bytes, -1);
    }
}

/* Buffer id (just made by balloc(s, 0)) stands for `bytes` instead: the
 * full parameters of group comp (>= 0), or one block (-1; bytes 0: none). */
static void bset(msim *s, int id, int64_t bytes, int comp)
{
    if (id < 0) return;
    cls_count(s, s->b[id].bytes, -1);
    s->live += bytes - s->b[id].bytes;
    s->b[id].bytes = bytes;
    s->b[id].comp = comp;
    if (comp >= 0) comp_count(s, comp, 1);
    else cls_count(s, bytes, 1);
    if (s->live > s->peak) s->peak = s->live;
}

/* Transient buffers made and freed at once (scratch in storage). */
static void btransient(msim *s, int64_t raw)
{
    if (raw <= 0) return;
    int id = balloc(s, raw);
    bunref(s, id);
}

/* ------------------------------------------------------------ the tape */

typedef struct mval {
    int buf;  /* its buffer (one reference held by whoever holds the value) */
    int node; /* the node that made it (-1: no grad) */
    int slot;
    int64_t cols; /* last dim; rows are s->R */
    int leaf1;    /* a leaf whose .grad collects its gradient: its parameter id + 1 (0: none) */
} mval;

static int node_new(msim *s)
{
    if (s->err) return -1;
    if (!grow((void **)&s->n, &s->cap_n, s->nn + 1, sizeof *s->n)) {
        s->err = TS_ERR_NO_MEMORY;
        return -1;
    }
    mnode *n = &s->n[s->nn];
    memset(n, 0, sizeof *n);
    n->grad[0] = n->grad[1] = n->grad[2] = -1;
    n->group = n->ckpt_block = -1;
    return s->nn++;
}

static void node_save(msim *s, int n, int buf)
{
    if (n < 0 || buf < 0) return;
    s->n[n].saved[s->n[n].ns++] = bref(s, buf);
}

/* Input gradient of node n: bytes new (alias: the node's own gradient),
 * to the value v's producer, or to parameter leaf. */
static void node_gin(msim *s, int n, int64_t bytes, bool alias, const mval *v, int leaf)
{
    if (n < 0) return;
    if (v && v->node < 0 && v->leaf1) leaf = v->leaf1 - 1; /* a leaf input (a checkpoint's recompute) */
    if (v && v->node < 0 && leaf < 0) return;             /* no gradient flows there */
    mnode *nd = &s->n[n];
    nd->g[nd->ng++] = (mgin){bytes, alias, v && v->node >= 0 ? v->node : -1, v ? v->slot : 0, leaf, 0};
}

static int param_new(msim *s, int group)
{
    if (!grow((void **)&s->p, &s->cap_p, s->np + 1, sizeof *s->p)) {
        s->err = TS_ERR_NO_MEMORY;
        return -1;
    }
    s->p[s->np] = (mparam){group, -1, -1};
    return s->np++;
}

/* ------------------------------------------------------------ groups */

/* The full parameters: one block each, summed. */
static void u_alloc(msim *s, mgroup *g)
{
    g->u_buf = balloc(s, 0);
    bset(s, g->u_buf, g->u, g->n_blk ? (int)(g - s->g) : -1);
}

static void g_unshard(msim *s, int gi)
{
    if (gi < 0) return;
    mgroup *g = &s->g[gi];
    if (g->state) return;
    g->staging_buf = g->offload ? balloc(s, g->staging) : -1;
    g->ag_in_buf = g->ag_in ? balloc(s, g->ag_in) : -1;
    g->ag_buf = g->cf ? -1 : balloc(s, g->ag);
    if (g->cf) u_alloc(s, g); /* read into in place */
    g->state = 1;
}

static void g_wait(msim *s, int gi)
{
    if (gi < 0) return;
    mgroup *g = &s->g[gi];
    if (!g->state) g_unshard(s, gi);
    if (g->state == 1) {
        if (!g->cf) u_alloc(s, g);
        bunref(s, g->ag_buf);
        bunref(s, g->ag_in_buf);
        bunref(s, g->staging_buf);
        g->state = 2;
    }
}

static void g_reshard(msim *s, int gi)
{
    mgroup *g = &s->g[gi];
    if (g->state == 2) bunref(s, g->u_buf);
    g->state = 0;
}

static void g_finish_reduce(msim *s)
{
    if (s->pending < 0) return;
    mgroup *g = &s->g[s->pending];
    for (int i = 0; i < s->np; i++) /* copy-free: the gradients the peers read */
        if (s->p[i].group == s->pending && s->p[i].held >= 0) {
            bunref(s, s->p[i].held);
            s->p[i].held = -1;
        }
    s->pending = -1;
    if (g->conv) { /* reduced in reduce_dtype: converted back to the parameters' dtype */
        int c = balloc(s, g->conv);
        bunref(s, g->rs_out_buf);
        g->rs_out_buf = c;
    }
    bool views = g->sharded && !g->has_sgrad && !g->offload; /* the shards' new gradients: views of the output, kept */
    if (!g->has_sgrad && !g->offload && g->sgrad) {
        int sg = balloc(s, 0); /* the persistent parameters' gradients: one block each (sgrad: their sum) */
        bset(s, sg, g->sgrad, -1);
    }
    if (!g->offload) g->has_sgrad = true;
    bunref(s, g->rs_scratch_buf);
    bunref(s, g->rs_in_buf);
    if (!views) bunref(s, g->rs_out_buf); /* with offload copied to the host; else added into the gradients */
    g->rs_out_buf = g->rs_scratch_buf = g->rs_in_buf = -1;
}

static void g_post_backward(msim *s, int gi)
{
    mgroup *g = &s->g[gi];
    bool any = false;
    for (int i = 0; i < s->np; i++) any |= s->p[i].group == gi && s->p[i].grad >= 0;
    if (!any) {
        g_reshard(s, gi);
        return;
    }
    g_finish_reduce(s);
    g->rs_in_buf = g->cf ? -1 : balloc(s, g->rs_in);
    g->rs_out_buf = balloc(s, g->rs_out);
    for (int i = 0; i < s->np; i++) {
        mparam *p = &s->p[i];
        if (p->group != gi) continue;
        if (g->cf) p->held = p->grad; /* read by the peers until the wait */
        else bunref(s, p->grad);
        p->grad = -1;
    }
    g_reshard(s, gi);
    g->rs_scratch_buf = g->rs_scratch ? balloc(s, g->rs_scratch) : -1;
    s->pending = gi;
}

/* ------------------------------------------------------------ ops */

static mval v_new(msim *s, int64_t cols, size_t es)
{
    return (mval){balloc(s, s->R * cols * (int64_t)es), -1, 0, cols, 0};
}

static void v_free(msim *s, mval *v)
{
    bunref(s, v->buf);
    v->buf = -1;
}

static bool needs_grad(const msim *s, const mval *x, bool has_params)
{
    return !s->no_grad && (has_params || x->node >= 0 || x->leaf1);
}

/* The scratch of a matrix product (m, n, k) in the compute dtype: the
 * 16-bit kernels take theirs from the pool, float32 BLIS none. */
static int64_t gemm_scratch(const msim *s, int64_t m, int64_t n, int64_t k, bool beta)
{
    if (s->ces != 2) return 0;
    return (int64_t)ts__gemm_half_scratch_bytes(s->half, m, n, k, beta);
}

/* Linear(in -> out): saves its input (and the weight, which is the
 * group's unsharded parameter); backward: gx (rows, in) = g W, then
 * gw = g^T x, gb. */
static mval op_linear(msim *s, const mval *x, int64_t in, int64_t out, bool bias, int pw, int pb)
{
    mval o = v_new(s, out, s->ces);
    btransient(s, gemm_scratch(s, s->R, out, in, bias));
    if (!needs_grad(s, x, pw >= 0)) return o;
    int n = node_new(s);
    if (n < 0) return o;
    node_save(s, n, x->buf);
    node_gin(s, n, s->R * in * (int64_t)s->ces, false, x, -1);
    if (x->node >= 0) s->n[n].g[s->n[n].ng - 1].scratch = gemm_scratch(s, s->R, in, out, false);
    if (pw >= 0) {
        node_gin(s, n, out * in * (int64_t)s->ces, false, NULL, pw);
        s->n[n].g[s->n[n].ng - 1].scratch = gemm_scratch(s, out, in, s->R, false);
    }
    if (bias && pb >= 0) node_gin(s, n, out * (int64_t)s->ces, false, NULL, pb);
    o.node = n;
    return o;
}

/* LayerNorm: saves its input and float64 mean and rstd (rows each). */
static mval op_layer_norm(msim *s, const mval *x, int64_t d, int pw, int pb)
{
    mval o = v_new(s, d, s->ces);
    int mean = balloc(s, s->R * 8), rstd = balloc(s, s->R * 8);
    if (needs_grad(s, x, pw >= 0)) {
        int n = node_new(s);
        node_save(s, n, x->buf);
        node_save(s, n, mean);
        node_save(s, n, rstd);
        node_gin(s, n, s->R * d * (int64_t)s->ces, false, x, -1);
        if (pw >= 0) node_gin(s, n, d * (int64_t)s->ces, false, NULL, pw);
        if (pb >= 0) node_gin(s, n, d * (int64_t)s->ces, false, NULL, pb);
        o.node = n;
    }
    bunref(s, mean);
    bunref(s, rstd);
    return o;
}

/* GELU, ReLU, Tanh: a new output; GELU and ReLU save the input, Tanh its
 * output; backward: one gradient of the input's size. */
static mval op_act(msim *s, const mval *x, bool save_out)
{
    mval o = v_new(s, x->cols, s->ces);
    if (!needs_grad(s, x, false)) return o;
    int n = node_new(s);
    node_save(s, n, save_out ? o.buf : x->buf);
    node_gin(s, n, s->R * x->cols * (int64_t)s->ces, false, x, -1);
    o.node = n;
    return o;
}

/* The dropout mask of n elements (ts_dropout, attention): float32 draws
 * then the 16-bit noise for 16-bit dtypes (the noise kept), or the draws
 * then the scaled mask (the scaled one kept). */
static int dropout_mask(msim *s, int64_t n)
{
    int draws = balloc(s, n * (s->ces == 2 ? 4 : (int64_t)s->ces));
    int mask = balloc(s, n * (int64_t)s->ces);
    bunref(s, draws);
    return mask;
}

/* Dropout: identity (a new reference) in eval or with p 0; else the
 * mask, a new output (x * mask) and a node that saves x and the mask in
 * float32 (mul's operands), the mask alone in 16 bits. */
static mval op_dropout(msim *s, const mval *x, double p, bool training)
{
    if (!training || p == 0.0) {
        mval o = *x;
        bref(s, o.buf);
        return o;
    }
    int mask = dropout_mask(s, s->R * x->cols);
    mval o = v_new(s, x->cols, s->ces);
    if (needs_grad(s, x, false)) {
        int n = node_new(s);
        if (s->ces != 2) node_save(s, n, x->buf);
        node_save(s, n, mask);
        node_gin(s, n, s->R * x->cols * (int64_t)s->ces, false, x, -1);
        o.node = n;
    }
    bunref(s, mask);
    return o;
}

/* a + b of one shape: a new output, nothing saved; backward passes the
 * gradient on to both (the same buffer). */
static mval op_add(msim *s, const mval *a, const mval *b)
{
    mval o = v_new(s, a->cols, s->ces);
    if (!needs_grad(s, a, false) && !needs_grad(s, b, false)) return o;
    int n = node_new(s);
    node_gin(s, n, 0, true, a, -1);
    node_gin(s, n, 0, true, b, -1);
    o.node = n;
    return o;
}

/* An FSDP marker (identity custom function) with a hook. */
static mval op_marker(msim *s, const mval *x, int hook, int group)
{
    mval o = *x;
    bref(s, o.buf);
    if (x->node < 0 && hook == HOOK_PRE_BWD) return o;
    int n = node_new(s);
    if (n < 0) return o;
    s->n[n].hook = hook;
    s->n[n].group = group;
    node_gin(s, n, 0, true, x, -1);
    o.node = n;
    return o;
}

/* ------------------------------------------------------------ backward */

static void accumulate(msim *s, int *slot, int buf)
{
    if (*slot < 0) {
        *slot = buf; /* takes the reference */
        return;
    }
    int sum = balloc(s, s->b[buf].bytes);
    bunref(s, *slot);
    bunref(s, buf);
    *slot = sum;
}

static void run_node(msim *s, int i);
static int param_new(msim *s, int group);

/* One GPT block as the estimate sees it. */
typedef struct mblock mblock;
static mval block_forward(msim *s, const mblock *bk, const mval *x);

struct mblock {
    int64_t d, H;
    double attn_p, mlp_p;
    bool training;
    int params[12]; /* ln1 w b, in_proj w b, out_proj w b, ln2 w b, fc1 w b, fc2 w b */
    int group;
    bool ckpt;      /* checkpointed (ts_checkpoint_module, or the options say every block) */
};

/* The checkpoint node's backward (nn/checkpoint.c): the block's forward
 * again with grad on an alias of the saved input (a leaf whose .grad
 * collects the input's gradient), the backward of that graph at once
 * (its nodes released as they run), then the input's gradient passed
 * on. The block's group is unsharded by its pre-backward marker. */
static void run_ckpt(msim *s, int i)
{
    mnode *nd = &s->n[i];
    const mblock *bk = &s->blocks[nd->ckpt_block];
    int first = s->nn, leaf = param_new(s, -1);
    if (leaf < 0) return;
    mval x = {bref(s, nd->saved[0]), -1, 0, bk->d, leaf + 1};
    mval y = block_forward(s, bk, &x);
    v_free(s, &x);
    nd = &s->n[i];
    if (y.node >= 0) { /* the output's gradient: the checkpoint node's */
        s->n[y.node].grad[y.slot] = bref(s, nd->grad[0]);
    }
    for (int k = s->nn - 1; k >= first && !s->err; k--) run_node(s, k);
    v_free(s, &y); /* the recomputed output is held until its backward ends */
    s->nn = first;
    /* the input's gradient replaces the node's own, for its alias gin */
    nd = &s->n[i];
    bunref(s, nd->grad[0]);
    nd->grad[0] = s->p[leaf].grad;
    s->np--;
}

static void run_node(msim *s, int i)
{
    if (s->err) return;
    mnode *nd = &s->n[i];
    if (nd->hook == HOOK_CKPT) run_ckpt(s, i), nd = &s->n[i];
    if (nd->hook == HOOK_PRE_BWD) {
        g_wait(s, nd->group);
        /* implicit backward prefetch: the group before it in post-forward order */
        for (int k = 1; s->prefetch_bwd && k < s->n_order; k++)
            if (s->order[k] == nd->group) g_unshard(s, s->order[k - 1]);
    } else if (nd->hook == HOOK_POST_BWD) {
        g_post_backward(s, nd->group);
    }
    int made[4];
    for (int k = 0; k < nd->ng; k++) {
        mgin *g = &nd->g[k];
        made[k] = g->alias ? bref(s, nd->grad[0]) : balloc(s, g->bytes);
        btransient(s, g->scratch);
    }
    btransient(s, nd->scratch);
    for (int k = 0; k < nd->ng; k++) {
        mgin *g = &nd->g[k];
        if (made[k] < 0) continue;
        if (g->leaf >= 0) {
            mparam *p = &s->p[g->leaf];
            if (p->grad >= 0) {
                bunref(s, made[k]); /* added in place */
            } else if (s->b[made[k]].refs > 1) { /* another handle sees it (an alias): .grad is a copy */
                p->grad = balloc(s, s->b[made[k]].bytes);
                bunref(s, made[k]);
            } else {
                p->grad = made[k];
            }
        } else if (g->dest >= 0) {
            accumulate(s, &s->n[g->dest].grad[g->slot], made[k]);
        } else {
            bunref(s, made[k]);
        }
    }
    for (int k = 0; k < 3; k++) {
        bunref(s, nd->grad[k]);
        nd->grad[k] = -1;
    }
    /* saved tensors go once the node has run; a checkpoint node's context
     * (the block's inputs) with them, as a backward without retain_graph
     * releases it (nn/checkpoint.c, ts_node.ctx_is_saved) */
    for (int k = 0; k < nd->ns; k++) bunref(s, nd->saved[k]);
    nd->ns = 0;
}

/* ------------------------------------------------------------ modules */

/* MultiheadAttention on one input x (self-attention): the packed
 * projection (rows, 3d), three chunks (a split node), the attention core
 * (saves q/k/v, the probabilities (B, H, T, T) and, with dropout, its
 * mask; on the fused float32 kernel, tensor/flash_attention.h, its output,
 * the log-sum-exp (B, H, T) and, with dropout, the keep mask in bits
 * (B, H, T, TS__FLASH_KEEP_WORDS(T)) int32 instead), the output
 * projection. */
static mval mha_forward(msim *s, const mblock *bk, const mval *x)
{
    int64_t d = bk->d, H = bk->H, pbytes = s->B * H * s->T * s->T * (int64_t)s->ces;
    bool fused = s->ces == 4 && ts__flash_enabled();
    if (fused)
        pbytes = s->B * H * s->T * 4;
    mval qkv = op_linear(s, x, d, 3 * d, true, bk->params[2], bk->params[3]);
    int split = -1;
    if (qkv.node >= 0 && !s->no_grad) {
        split = node_new(s);
        node_gin(s, split, s->R * 3 * d * (int64_t)s->ces, false, &qkv, -1);
    }
    mval o = v_new(s, d, s->ces);
    int P = balloc(s, pbytes), D = -1;
    if (bk->training && bk->attn_p > 0 && fused) {
        D = balloc(s, s->B * H * s->T * TS__FLASH_KEEP_WORDS(s->T) * 4);
    } else if (bk->training && bk->attn_p > 0) {
        D = dropout_mask(s, pbytes / (int64_t)s->ces);
        if (s->ces != 2) btransient(s, s->T * s->T * (int64_t)s->ces); /* the weights P * D of one head */
    }
    if (split >= 0) {
        int n = node_new(s);
        node_save(s, n, qkv.buf);
        node_save(s, n, P);
        node_save(s, n, D);
        if (fused)
            node_save(s, n, o.buf);
        for (int k = 0; k < 3; k++) {
            mval part = {qkv.buf, split, k, d, 0};
            node_gin(s, n, s->R * d * (int64_t)s->ces, false, &part, -1);
        }
        o.node = n;
    }
    bunref(s, P);
    bunref(s, D);
    mval y = op_linear(s, &o, d, d, true, bk->params[4], bk->params[5]);
    v_free(s, &qkv);
    v_free(s, &o);
    return y;
}

static mval block_forward(msim *s, const mblock *bk, const mval *x)
{
    int64_t d = bk->d;
    mval t0 = op_layer_norm(s, x, d, bk->params[0], bk->params[1]);
    mval t1 = mha_forward(s, bk, &t0);
    mval t2 = op_add(s, x, &t1);
    mval t3 = op_layer_norm(s, &t2, d, bk->params[6], bk->params[7]);
    mval m0 = op_linear(s, &t3, d, 4 * d, true, bk->params[8], bk->params[9]);
    mval m1 = op_act(s, &m0, false);
    v_free(s, &m0);
    mval m2 = op_linear(s, &m1, 4 * d, d, true, bk->params[10], bk->params[11]);
    v_free(s, &m1);
    mval t4 = op_dropout(s, &m2, bk->mlp_p, bk->training);
    v_free(s, &m2);
    mval out = op_add(s, &t2, &t4);
    v_free(s, &t0), v_free(s, &t1), v_free(s, &t2), v_free(s, &t3), v_free(s, &t4);
    return out;
}

/* ------------------------------------------------------------ the model */


static ts_status child(ts_module *m, const char *name, const char *type, const char *where, ts_module **out)
{
    ts_status st = ts_module_get_submodule(m, name, out);
    if (st) return st;
    if (type && strcmp(ts__fsdp_own_type(*out), type))
        return ts_error(TS_ERR_UNSUPPORTED, "ts_fsdp_memory_estimate: module '%s%s' is a %s, expected %s (the only layout "
                                            "it knows in a %s)", where, name, ts__fsdp_own_type(*out), type, ts__fsdp_own_type(m));
    return TS_OK;
}

/* One group's sizes from its parameters' full shapes, on shard rank
 * `rank` of W (torch.chunk rows, each parameter padded to its chunk). */
typedef struct gshape {
    int64_t rows, row_numel;
} gshape;

static void group_sizes(mgroup *g, int n, const gshape *ps, int W, int rank, size_t es, size_t ues, size_t res,
                        bool offload, bool pin, ts_fsdp_optim_kind ok, int64_t *param, int64_t *optim, int64_t *sgrad_out)
{
    int64_t shard = 0, u = 0, opt = 0;
    for (int i = 0; i < n; i++) {
        int64_t c = (ps[i].rows + W - 1) / W, r0 = c * rank;
        int64_t lr = ps[i].rows - r0 < 0 ? 0 : ps[i].rows - r0 < c ? ps[i].rows - r0 : c;
        shard += c * ps[i].row_numel;
        u += pool_bytes(ps[i].rows * ps[i].row_numel * (int64_t)ues);
        int64_t local = pool_bytes(lr * ps[i].row_numel * (int64_t)es);
        if (ok == TS_FSDP_OPTIM_SGD_MOMENTUM) opt += local;
        if (ok == TS_FSDP_OPTIM_ADAM) opt += 2 * local + pool_bytes(4);
    }
    /* the shards' gradients: views of the reduction's output in the
     * parameters' dtype (rs_out, or conv after a cast), padding included */
    int64_t sg = n ? pool_bytes((res != es ? shard : shard + n) * (int64_t)es) : 0; /* rs_out: its flags too */
    memset(g, 0, sizeof *g);
    g->u = u;
    g->u_blk = calloc((size_t)(n ? n : 1), sizeof *g->u_blk);
    g->full_blk = calloc((size_t)(n ? n : 1), sizeof *g->full_blk);
    g->local_blk = calloc((size_t)(n ? n : 1), sizeof *g->local_blk);
    if (g->u_blk && g->full_blk && g->local_blk) {
        g->n_blk = n;
        for (int i = 0; i < n; i++) {
            int64_t c = (ps[i].rows + W - 1) / W, r0 = c * rank;
            int64_t lr = ps[i].rows - r0 < 0 ? 0 : ps[i].rows - r0 < c ? ps[i].rows - r0 : c;
            g->u_blk[i] = pool_bytes(ps[i].rows * ps[i].row_numel * (int64_t)ues);
            g->full_blk[i] = pool_bytes(ps[i].rows * ps[i].row_numel * (int64_t)es);
            g->local_blk[i] = pool_bytes(lr * ps[i].row_numel * (int64_t)es);
        }
    }
    g->ag = pool_bytes(W * shard * (int64_t)ues);
    g->cf = ts__fsdp_copy_free(W, W * shard * (int64_t)ues);
    /* copy-free with offload: the shard copied to the device (ag_in) is what the peers read */
    g->ag_in = ues != es || (g->cf && offload) ? pool_bytes(shard * (int64_t)ues) : 0;
    /* the reduction's blocks: the shard layout, then a flag per parameter
     * (param_group.c, [Note: unused parameters]) */
    int64_t rs_block = n ? shard + n : 0;
    g->rs_in = pool_bytes(W * rs_block * (int64_t)res);
    g->rs_out = pool_bytes(rs_block * (int64_t)res);
    g->conv = res != es ? pool_bytes(shard * (int64_t)es) : 0;
    /* ring stages: min(W - 1, 2) blocks in the accumulation dtype (float32 for 16-bit), one more to convert */
    int64_t acc = res == 8 ? 8 : 4, nstage = W - 1 < 2 ? W - 1 : 2;
    g->rs_scratch = W > 1 && !g->cf ? pool_bytes((nstage + (res == 2 ? 1 : 0)) * rs_block * acc) : 0;
    g->offload = offload;
    g->sgrad = 0;
    g->sharded = n > 0;
    g->u_buf = g->ag_buf = g->ag_in_buf = g->staging_buf = g->rs_in_buf = g->rs_out_buf = g->rs_scratch_buf = -1;
    /* offloaded with pin_memory: the sharded buffer and the host gradient
     * buffer are pinned blocks, rounded to pages (base/pinned.c), not pool blocks */
    int64_t host = shard * (int64_t)es;
    if (offload && pin) {
        int64_t pg = (int64_t)sysconf(_SC_PAGESIZE);
        pg = pg > 0 ? pg : 4096;
        host = host ? (host + pg - 1) / pg * pg : pg;
    } else {
        host = pool_bytes(host);
    }
    *param = host;
    g->host = offload && pin ? 0 : host;
    *optim = opt;
    /* with offload the shards' gradients are views of one host buffer, kept */
    *sgrad_out = offload ? host : sg;
}

typedef struct wblock {
    int64_t H;
    double attn_p, mlp_p;
    bool ckpt;       /* made checkpointed by ts_checkpoint_module */
    bool fsdp;       /* an FSDP module */
    fsdp_group *fg;  /* its own group (NULL: none) */
} wblock;

typedef struct gpt_walk {
    ts_module *tok, *pos, *drop, *ln_f, *head;
    ts_module **blocks; /* the Block modules (NULL for a walk made from a config) */
    wblock *wb;         /* per block: what the estimate needs */
    int L;
    int64_t V, d, Tmax;
    double emb_p;
    bool tied, training;
} gpt_walk;

static fsdp_group *own_group(ts_module *m);

static ts_status gpt_shapes(ts_module *model, gpt_walk *w)
{
    ts_status st;
    ts_module *list;
    if ((st = child(model, "tok_emb", "Embedding", "", &w->tok)) || (st = child(model, "pos_emb", "Embedding", "", &w->pos)) ||
        (st = child(model, "drop", "Dropout", "", &w->drop)) || (st = child(model, "blocks", "ModuleList", "", &list)) ||
        (st = child(model, "ln_f", "LayerNorm", "", &w->ln_f)) || (st = child(model, "lm_head", "Linear", "", &w->head)))
        return st;
    ts_nn_embedding *te = (ts_nn_embedding *)w->tok, *pe = (ts_nn_embedding *)w->pos;
    w->V = te->num_embeddings, w->d = te->embedding_dim, w->Tmax = pe->num_embeddings;
    w->emb_p = ((ts__act *)w->drop)->p;
    w->training = model->training;
    w->tied = ((ts_nn_linear *)w->head)->weight == te->weight;
    w->L = ts_container_size(list);
    w->blocks = calloc((size_t)(w->L ? w->L : 1), sizeof *w->blocks);
    w->wb = calloc((size_t)(w->L ? w->L : 1), sizeof *w->wb);
    if (!w->blocks || !w->wb) return TS_ERR_NO_MEMORY;
    for (int l = 0; l < w->L; l++) {
        ts_module *b = ts_container_child(list, l), *x;
        char where[48];
        snprintf(where, sizeof where, "blocks.%d.", l);
        if (strcmp(ts__fsdp_own_type(b), "Block"))
            return ts_error(TS_ERR_UNSUPPORTED, "ts_fsdp_memory_estimate: module 'blocks.%d' is a %s, expected Block", l,
                            ts__fsdp_own_type(b));
        ts_module *attn, *mlp;
        if ((st = child(b, "ln1", "LayerNorm", where, &x)) || (st = child(b, "attn", "MultiheadAttention", where, &attn)) ||
            (st = child(b, "ln2", "LayerNorm", where, &x)) || (st = child(b, "mlp", "Sequential", where, &mlp)))
            return st;
        w->blocks[l] = b;
        ts_module *dr = ts_container_size(mlp) == 4 ? ts_container_child(mlp, 3) : NULL;
        wblock *wb = &w->wb[l];
        wb->H = ((ts_nn_mha *)attn)->num_heads;
        wb->attn_p = ((ts_nn_mha *)attn)->dropout;
        wb->mlp_p = dr && !strcmp(ts__fsdp_own_type(dr), "Dropout") ? ((ts__act *)dr)->p : 0.0;
        wb->ckpt = ts_module_is_checkpointed(b);
        wb->fsdp = ts_module_is_fsdp(b);
        wb->fg = own_group(b);
    }
    return TS_OK;
}

/* The group of module m (its own, else -1). */
static fsdp_group *own_group(ts_module *m)
{
    fsdp_state *s = ts__fsdp_state_of(m);
    return s ? s->group : NULL;
}

static void group_from_fsdp(mgroup *g, const fsdp_group *fg, bool offload, ts_fsdp_optim_kind ok, int64_t *param,
                            int64_t *optim, int64_t *sgrad)
{
    gshape ps[64];
    int n = fg->n < 64 ? fg->n : 64;
    /* group_sizes from the group's own geometry: rows and row sizes of each parameter */
    gshape *heap = fg->n > 64 ? malloc((size_t)fg->n * sizeof *heap) : NULL;
    gshape *use = heap ? heap : ps;
    if (heap) n = fg->n;
    for (int i = 0; i < n; i++) use[i] = (gshape){fg->params[i].rows, fg->params[i].row_numel};
    group_sizes(g, n, use, fg->W, fg->rank, fg->es, fg->ues, fg->res, offload, fg->off.pin, ok, param, optim, sgrad);
    free(heap);
    /* persistent parameters (persist.c): whole on every rank, and so are
     * their gradients and optimizer state (their one all-reduce bucket at
     * the end of the backward is not counted) */
    for (int i = 0; i < fg->n_persist; i++) {
        const ts_tensor *t = fg->persist[i].t;
        int64_t b = pool_bytes(ts_tensor_numel(t) * (int64_t)ts_dtype_size(ts_tensor_dtype(t)));
        *param += b;
        *sgrad += b;
        if (!offload) g->sgrad += b;
        if (ok == TS_FSDP_OPTIM_SGD_MOMENTUM) *optim += b;
        if (ok == TS_FSDP_OPTIM_ADAM) *optim += 2 * b + pool_bytes(4);
    }
}

ts_fsdp_memory_options ts_fsdp_memory_options_default(void)
{
    ts_fsdp_memory_options o;
    memset(&o, 0, sizeof o);
    o.optim = TS_FSDP_OPTIM_ADAM;
    o.world_size = 1;
    o.prefetch = true;
    o.param_dtype = TS_DTYPE_KEEP;
    o.eager_init = true;
    return o;
}

void ts_fsdp_memory_set_floor(ts_fsdp_memory_report *r, size_t floor_bytes)
{
    if (!r) return;
    r->floor_bytes = floor_bytes;
    size_t pool = r->pool_peak_bytes > r->peak_bytes ? r->pool_peak_bytes : r->peak_bytes;
    r->rss_peak_bytes = floor_bytes + pool;
}

/* Runs one step on the model of the pool: the forward of the GPT (groups
 * unsharded and prefetched as the hooks do), the loss, the backward, the
 * end of backward, the optimizer step. */
typedef struct gpt_run {
    gpt_walk *w;
    mblock *bk;
    int root_g;
    int tok_p, pos_p, lnf_w, lnf_b, head_p;
    int64_t fwd_peak, bwd_peak, act_live;
} gpt_run;

static void gpt_step(msim *s, gpt_run *r)
{
    gpt_walk *w = r->w;
    int64_t d = w->d, V = w->V;
    /* forward: the root's pre-forward gathers its group and prefetches the first block's */
    g_wait(s, r->root_g);
    if (s->prefetch_fwd && w->L) g_unshard(s, r->bk[0].group);
    int ids = balloc(s, 0); /* the caller's ids: counted outside the step */
    bset(s, ids, 0, -1);
    mval tok = v_new(s, d, s->ces);
    {
        int n = node_new(s);
        node_save(s, n, ids);
        node_gin(s, n, V * d * (int64_t)s->ces, false, NULL, r->tok_p);
        tok.node = n;
    }
    int ar = balloc(s, s->T * 8);
    mval pos = {balloc(s, s->T * d * (int64_t)s->ces), -1, 0, d, 0};
    {
        int n = node_new(s);
        node_save(s, n, ar);
        node_gin(s, n, w->Tmax * d * (int64_t)s->ces, false, NULL, r->pos_p);
        pos.node = n;
    }
    mval x0 = v_new(s, d, s->ces);
    {
        int n = node_new(s);
        node_gin(s, n, 0, true, &tok, -1);
        node_gin(s, n, s->T * d * (int64_t)s->ces, false, &pos, -1); /* summed over the batch */
        x0.node = n;
    }
    mval x = op_dropout(s, &x0, w->emb_p, w->training);
    int mask = balloc(s, s->T * s->T);
    for (int l = 0; l < w->L; l++) {
        mblock *bk = &r->bk[l];
        int g = bk->group;
        bool own = g != r->root_g;
        if (own) {
            g_wait(s, g);
            if (s->prefetch_fwd && l + 1 < w->L) g_unshard(s, r->bk[l + 1].group);
        }
        mval xin = own ? op_marker(s, &x, HOOK_POST_BWD, g) : x;
        if (!own) bref(s, xin.buf);
        v_free(s, &x);
        mval y;
        if (s->ckpt || bk->ckpt) { /* keeps only the block's inputs (x and the mask): the forward records nothing */
            s->no_grad = true;
            y = block_forward(s, bk, &xin);
            s->no_grad = false;
            int n = node_new(s);
            node_save(s, n, xin.buf);
            node_save(s, n, mask);
            s->n[n].hook = HOOK_CKPT;
            s->n[n].ckpt_block = l;
            node_gin(s, n, 0, true, &xin, -1);
            y.node = n, y.slot = 0;
        } else {
            y = block_forward(s, bk, &xin);
        }
        v_free(s, &xin);
        if (own) {
            if (s->g[g].reshard) g_reshard(s, g);
            x = op_marker(s, &y, HOOK_PRE_BWD, g);
            v_free(s, &y);
        } else {
            x = y;
        }
    }
    mval h = op_layer_norm(s, &x, d, r->lnf_w, r->lnf_b);
    mval logits = op_linear(s, &h, d, V, false, r->head_p, -1);
    v_free(s, &x), v_free(s, &h);
    v_free(s, &tok), v_free(s, &pos), bunref(s, ar), v_free(s, &x0), bunref(s, mask);
    mval out = op_marker(s, &logits, HOOK_PRE_BWD, r->root_g);
    v_free(s, &logits);
    if (s->ces != 4) { /* the loss in float32: the logits cast (the caller keeps only the cast) */
        mval l32 = v_new(s, V, 4);
        int n = node_new(s);
        node_gin(s, n, s->R * V * (int64_t)s->ces, false, &out, -1);
        l32.node = n;
        v_free(s, &out);
        out = l32;
    }
    /* cross-entropy: the log-softmax saved, a 0-d loss */
    int lp = balloc(s, s->R * V * 4), loss = balloc(s, 4);
    int ce = node_new(s);
    node_save(s, ce, lp);
    node_gin(s, ce, s->R * V * 4, false, &out, -1);
    bunref(s, lp);
    r->act_live = s->live;
    r->fwd_peak = s->peak;
    /* backward from the loss (its gradient: a 0-d one) */
    s->peak = s->live;
    if (ce >= 0) s->n[ce].grad[0] = balloc(s, 4);
    for (int i = s->nn - 1; i >= 0 && !s->err; i--) run_node(s, i);
    /* end of backward: the root's post-backward, then the last reduce-scatter */
    g_post_backward(s, r->root_g);
    for (int i = 0; i < s->ng; i++)
        if (i != r->root_g) g_post_backward(s, i);
    g_finish_reduce(s);
    for (int i = 0; i < s->ng; i++) g_reshard(s, i);
    bunref(s, loss);
    v_free(s, &out); /* the caller's logits and loss, freed after the optimizer step, and the graph with them */
    r->bwd_peak = s->peak;
}

static void block_shapes(int64_t d, gshape *ps)
{
    gshape b[12] = {{d, 1}, {d, 1}, {3 * d, d}, {3 * d, 1}, {d, d}, {d, 1},
                    {d, 1}, {d, 1}, {4 * d, d}, {4 * d, 1}, {d, 4 * d}, {d, 1}};
    memcpy(ps, b, sizeof b);
}

/* The pool's classes before the step ([Note: pool classes]): with
 * o->eager_init, the start-up first: every parameter built whole (one
 * block each), then each group sharded in turn, blocks first and the root
 * last, as ts_fully_shard is called bottom-up: its sharded buffer made,
 * each parameter's unsharded tensor made and released (one block at a
 * time, fully_shard/param.c), its full parameters freed. Then the blocks
 * live when the step starts: the sharded buffers, the optimizer state
 * (one block per parameter shard and state, and Adam's 0-d step), and
 * with offload the host gradient buffers. */
static void pool_start(msim *s, const ts_fsdp_memory_options *o, bool offload)
{
    if (o->eager_init)
        for (int gi = 0; gi < s->ng; gi++)
            for (int k = 0; k < s->g[gi].n_blk; k++) cls_count(s, s->g[gi].full_blk[k], 1);
    for (int j = 1; j <= s->ng; j++) {
        mgroup *g = &s->g[j % s->ng]; /* groups 1.. are the blocks, 0 the root */
        cls_count(s, g->host, 1);
        if (offload) cls_count(s, g->host, 1); /* the host gradient buffer */
        for (int k = 0; k < g->n_blk; k++) {
            cls_count(s, g->u_blk[k], 1);
            cls_count(s, g->u_blk[k], -1);
        }
        if (o->eager_init)
            for (int k = 0; k < g->n_blk; k++) cls_count(s, g->full_blk[k], -1);
    }
    for (int gi = 0; gi < s->ng; gi++)
        for (int k = 0; k < s->g[gi].n_blk; k++) {
            int64_t b = s->g[gi].local_blk[k];
            if (o->optim == TS_FSDP_OPTIM_SGD_MOMENTUM) cls_count(s, b, 1);
            if (o->optim == TS_FSDP_OPTIM_ADAM) cls_count(s, b, 2), cls_count(s, pool_bytes(4), 1);
        }
}

/* One run of the step (ckpt or not); fills the report's peaks. */
/* ckpt: 0 no block checkpointed, 1 every block, 2 the blocks ts_checkpoint_module made so. */
static ts_status run(gpt_walk *w, const ts_fsdp_memory_options *o, int ckpt, bool sharded, ts_module *model,
                     int64_t B, int64_t T, ts_fsdp_memory_report *rep, int64_t *act_out, int64_t *block_act_out)
{
    msim S;
    memset(&S, 0, sizeof S);
    msim *s = &S;
    s->B = B, s->T = T, s->R = B * T, s->pending = -1, s->ckpt = ckpt == 1;
    mblock *bk = calloc((size_t)(w->L ? w->L : 1), sizeof *bk);
    s->g = calloc((size_t)w->L + 1, sizeof *s->g);
    s->order = calloc((size_t)w->L + 1, sizeof *s->order);
    if (!bk || !s->g || !s->order) {
        free(bk), free(s->g), free(s->order);
        return TS_ERR_NO_MEMORY;
    }
    ts_status st = TS_OK;
    int64_t param = 0, optim = 0, sgrad = 0;
    /* groups: 0 the root's, then each block with its own */
    s->ng = 1;
    fsdp_group *rg = sharded ? own_group(model) : NULL;
    s->W = sharded && rg ? rg->W : o->world_size;
    bool off = false;
    if (sharded && rg) {
        s->es = rg->es, s->ces = rg->ues, s->half = rg->udtype;
        off = rg->off.on;
    } else {
        s->es = 4;
        s->ces = o->param_dtype == TS_DTYPE_KEEP ? 4 : ts_dtype_size(o->param_dtype);
        s->half = o->param_dtype;
    }
    size_t res = sharded && rg ? rg->res : s->ces;
    int64_t p1, o1, g1;
    if (sharded && rg) {
        group_from_fsdp(&s->g[0], rg, rg->off.on, o->optim, &p1, &o1, &g1);
        fsdp_state *rs = ts__fsdp_state_of(model);
        s->g[0].reshard = ts__fsdp_resolved_policy(rg, true) != TS_RESHARD_FALSE;
        s->prefetch_fwd = rs && rs->ctx ? rs->ctx->implicit_fwd : true;
        s->prefetch_bwd = rs && rs->ctx ? rs->ctx->implicit_bwd : true;
    } else {
        gshape ps[5] = {{w->V, w->d}, {w->Tmax, w->d}, {w->d, 1}, {w->d, 1}, {w->V, w->d}};
        group_sizes(&s->g[0], w->tied ? 4 : 5, ps, s->W, 0, s->es, s->ces, s->ces, false, false, o->optim, &p1, &o1, &g1);
        s->g[0].reshard = false;
        s->prefetch_fwd = s->prefetch_bwd = o->prefetch;
    }
    param += p1, optim += o1, sgrad += g1;
    for (int l = 0; l < w->L && !st; l++) {
        fsdp_group *fg = sharded ? w->wb[l].fg : NULL;
        bk[l].d = w->d, bk[l].H = w->wb[l].H, bk[l].attn_p = w->wb[l].attn_p, bk[l].training = w->training;
        bk[l].mlp_p = w->wb[l].mlp_p;
        bk[l].ckpt = ckpt == 1 || (ckpt == 2 && w->wb[l].ckpt);
        if (sharded && fg == rg) fg = NULL;
        if (sharded && !fg) {
            bk[l].group = 0;
        } else {
            int gi = s->ng++;
            bk[l].group = gi;
            if (fg) {
                group_from_fsdp(&s->g[gi], fg, fg->off.on, o->optim, &p1, &o1, &g1);
                s->g[gi].reshard = ts__fsdp_resolved_policy(fg, false) != TS_RESHARD_FALSE;
            } else {
                gshape ps[12];
                block_shapes(w->d, ps);
                group_sizes(&s->g[gi], 12, ps, s->W, 0, s->es, s->ces, res, false, false, o->optim, &p1, &o1, &g1);
                s->g[gi].reshard = true;
            }
            param += p1, optim += o1, sgrad += g1;
            s->order[s->n_order++] = gi;
        }
        for (int k = 0; k < 12; k++) bk[l].params[k] = param_new(s, bk[l].group);
    }
    s->order[s->n_order++] = 0;
    gpt_run r = {.w = w, .bk = bk, .root_g = 0};
    r.tok_p = param_new(s, 0), r.pos_p = param_new(s, 0), r.lnf_w = param_new(s, 0), r.lnf_b = param_new(s, 0);
    r.head_p = w->tied ? r.tok_p : param_new(s, 0);
    pool_start(s, o, off);
    if (off) /* with offload the host gradient buffers stay */
        s->live = param + optim + sgrad;
    else
        s->live = param + optim;
    s->peak = s->live;
    int64_t base = s->live;
    s->blocks = bk;
    if (!st && !s->err) gpt_step(s, &r);
    if (!st) st = s->err;
    if (!st) {
        *act_out = r.act_live - base - s->g[0].u * (s->g[0].reshard ? 0 : 1);
        rep->param_bytes = (size_t)param;
        rep->grad_bytes = (size_t)sgrad;
        rep->optim_bytes = (size_t)optim;
        rep->pool_peak_bytes = (size_t)cls_pool(s);
        rep->forward_peak_bytes = (size_t)r.fwd_peak;
        rep->backward_peak_bytes = (size_t)r.bwd_peak;
        rep->peak_bytes = (size_t)(r.fwd_peak > r.bwd_peak ? r.fwd_peak : r.bwd_peak);
        rep->group_bytes = rep->all_gather_bytes = 0;
        for (int i = 0; i < s->ng; i++) {
            if ((size_t)s->g[i].u > rep->group_bytes) rep->group_bytes = (size_t)s->g[i].u;
            if ((size_t)s->g[i].ag > rep->all_gather_bytes) rep->all_gather_bytes = (size_t)s->g[i].ag;
        }
        rep->groups_in_flight = s->prefetch_bwd && s->n_order > 2 ? 2 : 1;
        rep->n_blocks = w->L;
        /* one block alone: what its forward keeps (its output included, its input not) */
        if (w->L) {
            msim b1;
            memset(&b1, 0, sizeof b1);
            b1.B = B, b1.T = T, b1.R = B * T, b1.ces = s->ces, b1.es = s->es, b1.pending = -1, b1.half = s->half;
            mblock one = bk[0];
            for (int k = 0; k < 12; k++) one.params[k] = -1;
            int dn = node_new(&b1);
            mval xin = {balloc(&b1, b1.R * w->d * (int64_t)b1.ces), dn, 0, w->d, 0};
            int64_t l0 = b1.live;
            mval y = block_forward(&b1, &one, &xin);
            *block_act_out = b1.err ? 0 : b1.live - l0;
            (void)y;
            free(b1.b), free(b1.n), free(b1.p), free(b1.cls);
            rep->block_act_ckpt_bytes = (size_t)pool_bytes(B * T * w->d * (int64_t)s->ces);
        }
    }
    for (int i = 0; i < s->ng; i++) free(s->g[i].u_blk), free(s->g[i].full_blk), free(s->g[i].local_blk);
    free(bk), free(s->g), free(s->order), free(s->b), free(s->n), free(s->p), free(s->cls);
    return st;
}

/* The estimate from a walk (of a model, or of a config). */
static ts_status estimate_walk(gpt_walk *w, const ts_fsdp_memory_options *o, bool sharded, ts_module *model,
                               ts_fsdp_memory_report *out)
{
    ts_status st = TS_OK;
    if (o->input_shape[1] > w->Tmax)
        return ts_error(TS_ERR_SHAPE, "ts_fsdp_memory_estimate: sequence length %lld is longer than the GPT's block_size "
                                      "%lld", (long long)o->input_shape[1], (long long)w->Tmax);
    ts_fsdp_memory_report rep, rc, ra;
    memset(&rep, 0, sizeof rep);
    memset(&rc, 0, sizeof rc);
    memset(&ra, 0, sizeof ra);
    int64_t act = 0, act_c = 0, act_a = 0, blk = 0, blk_c = 0, blk_a = 0;
    bool any = false; /* blocks checkpointed by ts_checkpoint_module */
    for (int l = 0; l < w->L; l++) any |= w->wb[l].ckpt;
    int64_t B = o->input_shape[0], T = o->input_shape[1];
    if (!st) st = run(w, o, 0, sharded, model, B, T, &rep, &act, &blk);
    if (!st) st = run(w, o, 1, sharded, model, B, T, &rc, &act_c, &blk_c);
    if (!st && any && !o->checkpoint_blocks) st = run(w, o, 2, sharded, model, B, T, &ra, &act_a, &blk_a);
    if (st) return st;
    const ts_fsdp_memory_report *pk = o->checkpoint_blocks ? &rc : any ? &ra : &rep;
    rep.forward_peak_bytes = pk->forward_peak_bytes;
    rep.backward_peak_bytes = pk->backward_peak_bytes;
    rep.peak_bytes = pk->peak_bytes;
    rep.pool_peak_bytes = pk->pool_peak_bytes > pk->peak_bytes ? pk->pool_peak_bytes : pk->peak_bytes;
    ts_fsdp_memory_set_floor(&rep, ts_process_floor_bytes());
    rep.checkpointed = o->checkpoint_blocks || any;
    rep.block_act_bytes = (size_t)blk;
    rep.act_bytes = (size_t)act;
    rep.act_ckpt_bytes = (size_t)act_c;
    int64_t block = 12 * w->d * w->d + 13 * w->d;
    rep.n_params = (int64_t)w->L * block + (w->tied ? 1 : 2) * w->V * w->d + w->Tmax * w->d + 2 * w->d;
    *out = rep;
    return TS_OK;
}

static ts_status check_options(const ts_fsdp_memory_options *o)
{
    if ((unsigned)o->optim > TS_FSDP_OPTIM_ADAM)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_fsdp_memory_estimate: optim %d is not a ts_fsdp_optim_kind", (int)o->optim);
    if (o->input_ndim != 2 || o->input_shape[0] < 1 || o->input_shape[1] < 1)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_fsdp_memory_estimate: a GPT's input is (B, T) token ids with B, T >= 1; "
                                                "got %d dims (%lld, %lld)", o->input_ndim,
                        (long long)(o->input_ndim > 0 ? o->input_shape[0] : 0),
                        (long long)(o->input_ndim > 1 ? o->input_shape[1] : 0));
    return TS_OK;
}

static ts_status check_unsharded(const ts_fsdp_memory_options *o)
{
    if (o->world_size < 1 || (o->param_dtype != TS_DTYPE_KEEP && o->param_dtype != TS_F32 &&
                              o->param_dtype != TS_BF16 && o->param_dtype != TS_F16))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_fsdp_memory_estimate: world_size %d must be >= 1 and param_dtype "
                                                "f32, bf16, f16 or TS_DTYPE_KEEP (got %d)", o->world_size, (int)o->param_dtype);
    return TS_OK;
}

ts_status ts_fsdp_memory_estimate_gpt(const ts_gpt_config *cfg, const ts_fsdp_memory_options *o,
                                      ts_fsdp_memory_report *out)
{
    if (!cfg || !o || !out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_fsdp_memory_estimate_gpt: config %p, options %p and out %p must not be "
                                                "NULL", (const void *)cfg, (const void *)o, (void *)out);
    if (cfg->vocab_size <= 0 || cfg->block_size <= 0 || cfg->n_layer < 0 || cfg->n_layer > 4096 || cfg->n_head <= 0 ||
        cfg->d_model <= 0 || cfg->d_model % cfg->n_head || !(cfg->dropout >= 0 && cfg->dropout < 1))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_fsdp_memory_estimate_gpt: invalid config (vocab %lld, block %lld, "
                                                "layers %lld, heads %lld, d_model %lld, dropout %g)",
                        (long long)cfg->vocab_size, (long long)cfg->block_size, (long long)cfg->n_layer,
                        (long long)cfg->n_head, (long long)cfg->d_model, cfg->dropout);
    ts_status st;
    if ((st = check_options(o)) || (st = check_unsharded(o))) return st;
    gpt_walk w;
    memset(&w, 0, sizeof w);
    w.L = (int)cfg->n_layer, w.V = cfg->vocab_size, w.d = cfg->d_model, w.Tmax = cfg->block_size;
    w.emb_p = cfg->dropout, w.tied = cfg->tie_weights, w.training = true;
    w.wb = calloc((size_t)(w.L ? w.L : 1), sizeof *w.wb);
    if (!w.wb) return TS_ERR_NO_MEMORY;
    for (int l = 0; l < w.L; l++) w.wb[l] = (wblock){cfg->n_head, cfg->dropout, cfg->dropout, false, false, NULL};
    st = estimate_walk(&w, o, false, NULL, out);
    free(w.wb);
    return st;
}

ts_status ts_fsdp_memory_estimate(ts_module *model, const ts_fsdp_memory_options *o, ts_fsdp_memory_report *out)
{
    if (!model || !o || !out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_fsdp_memory_estimate: model %p, options %p and out %p must not be NULL",
                        (void *)model, (const void *)o, (void *)out);
    ts_status cs = check_options(o);
    if (cs) return cs;
    const char *type = ts__fsdp_own_type(model);
    if (strcmp(type, "GPT"))
        return ts_error(TS_ERR_UNSUPPORTED, "ts_fsdp_memory_estimate: the model's type %s is not one it knows (GPT: "
                                            "nn/gpt.c); per-module rules for other types are not built", type);
    bool sharded = ts_module_is_fsdp(model);
    if (!sharded && (cs = check_unsharded(o))) return cs;
    gpt_walk w;
    memset(&w, 0, sizeof w);
    ts_status st = gpt_shapes(model, &w);
    if (!st && sharded && !ts__fsdp_state_of(model))
        st = ts_error(TS_ERR_UNSUPPORTED, "ts_fsdp_memory_estimate: the GPT is sharded without its root");
    for (int l = 0; l < w.L && !st && !sharded; l++)
        if (w.wb[l].fsdp)
            st = ts_error(TS_ERR_UNSUPPORTED, "ts_fsdp_memory_estimate: blocks.%d is sharded but the root is not: call "
                                              "ts_fully_shard(model) last (as FSDP2 users do) before estimating", l);
    if (!st) st = estimate_walk(&w, o, sharded, model, out);
    free(w.blocks);
    free(w.wb);
    return st;
}
