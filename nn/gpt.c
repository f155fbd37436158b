/* A GPT-style decoder; its PyTorch twin is tools/reference/models.py:
 * tok_emb, pos_emb, drop, blocks (ln1, attn, ln2, mlp = Linear, GELU,
 * Linear, Dropout), ln_f, lm_head (bias-free, optionally tied to tok_emb).
 * The GELU is erf's or, with cfg.gelu_approx, the tanh approximation
 * (Hugging Face GPT-2's; docs/gpt2-weights.md). */
#define _GNU_SOURCE
#include "nn/internal.h"

#include <string.h>

/* ------------------------------------------------------------ block */

typedef struct block {
    ts_module base;
    ts_module *ln1, *attn, *ln2, *mlp;
} block;

static ts_status block_forward(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    block *b = (block *)m;
    ts_status st = ts__module_check_inputs(m, n_in, 1, 2);
    if (st) return st;
    ts_tensor *x = in[0], *mask = n_in > 1 ? in[1] : NULL;
    ts_tensor *t[6] = {0}, *a[TS_MODULE_MAX_IO];
    int n = 0;
    if (!(st = ts_module_call1(b->ln1, x, &t[0]))) {
        ts_tensor *args[4] = {t[0], t[0], t[0], mask};
        if (!(st = ts_module_call(b->attn, mask ? 4 : 3, args, &n, a))) t[1] = a[0];
    }
    if (!st && !(st = ts_add(x, t[1], &t[2])) && !(st = ts_module_call1(b->ln2, t[2], &t[3])) &&
        !(st = ts_module_call1(b->mlp, t[3], &t[4])))
        st = ts_add(t[2], t[4], &out[0]);
    for (int i = 0; i < 6; i++) ts_tensor_free(t[i]);
    if (!st) *n_out = 1;
    return st;
}

static ts_status block_visit(ts_module *m, const ts_module_visitor *v)
{
    block *b = (block *)m;
    ts_status st = TS_OK;
    if (v->child && !(st = v->child(v->ctx, "ln1", b->ln1)) && !(st = v->child(v->ctx, "attn", b->attn)) &&
        !(st = v->child(v->ctx, "ln2", b->ln2)))
        st = v->child(v->ctx, "mlp", b->mlp);
    return st;
}

static void block_free(ts_module *m)
{
    block *b = (block *)m;
    ts_module_free(b->ln1);
    ts_module_free(b->attn);
    ts_module_free(b->ln2);
    ts_module_free(b->mlp);
    ts__free(TS_MEM_NN, b);
}

static const ts_module_vtable block_vt = {
    .type_name = "Block", .forward = block_forward, .visit = block_visit, .free = block_free};

static ts_status block_new(const ts_gpt_config *c, ts_module **out)
{
    block *b = ts__calloc(TS_MEM_NN, 1, sizeof *b);
    if (!b) return TS_ERR_NO_MEMORY;
    ts_module_init(&b->base, &block_vt);
    ts_module *mlp[4] = {0};
    ts_status st = ts_layer_norm_new(c->d_model, 1e-5, true, &b->ln1);
    ts_mha_options mo = ts_mha_options_default();
    mo.dropout = c->dropout;
    mo.batch_first = true; /* (B, T, d) activations */
    if (!st) st = ts_mha_new_opts(c->d_model, c->n_head, &mo, &b->attn);
    if (!st) st = ts_layer_norm_new(c->d_model, 1e-5, true, &b->ln2);
    if (!st) st = ts_linear_new(c->d_model, 4 * c->d_model, true, &mlp[0]);
    if (!st) st = ts_gelu_new(c->gelu_approx, &mlp[1]);
    if (!st) st = ts_linear_new(4 * c->d_model, c->d_model, true, &mlp[2]);
    if (!st) st = ts_dropout_new(c->dropout, &mlp[3]);
    if (!st) st = ts_sequential_new(4, mlp, &b->mlp);
    if (st) {
        if (!b->mlp)
            for (int i = 0; i < 4; i++) ts_module_free(mlp[i]);
        block_free(&b->base);
        return st;
    }
    *out = &b->base;
    return TS_OK;
}

/* ------------------------------------------------------------ gpt */

typedef struct gpt {
    ts_module base;
    ts_gpt_config cfg;
    ts_module *tok_emb, *pos_emb, *drop, *blocks, *ln_f, *lm_head;
} gpt;

static ts_status gpt_forward(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    gpt *g = (gpt *)m;
    ts_status st = ts__module_check_inputs(m, n_in, 1, 1);
    if (st) return st;
    ts_tensor *idx = in[0];
    char s[96];
    if (!idx || ts_tensor_ndim(idx) != 2 || ts_tensor_dtype(idx) != TS_I64 ||
        ts_tensor_size(idx, 1) > g->cfg.block_size || ts_tensor_size(idx, 1) < 1)
        return ts_error(TS_ERR_SHAPE,
                        "GPT: input must be int64 token ids (B, T) with 1 <= T <= block_size %lld, got "
                        "%s %s",
                        (long long)g->cfg.block_size, idx ? ts_dtype_name(ts_tensor_dtype(idx)) : "NULL",
                        idx ? ts_tensor_shape_str(idx, s, sizeof s) : "");
    int64_t T = ts_tensor_size(idx, 1);
    ts_tensor *t[8] = {0};
    if (!(st = ts_module_call1(g->tok_emb, idx, &t[0])) && !(st = ts_tensor_arange(TS_I64, 0, (double)T, 1, &t[1])) &&
        !(st = ts_module_call1(g->pos_emb, t[1], &t[2])) && !(st = ts_add(t[0], t[2], &t[3])) &&
        !(st = ts_module_call1(g->drop, t[3], &t[4])) && !(st = ts__causal_mask(T, &t[5]))) {
        ts_tensor *x = ts_tensor_retain(t[4]);
        for (int i = 0; i < ts_container_size(g->blocks) && !st; i++) {
            ts_tensor *args[2] = {x, t[5]}, *y[TS_MODULE_MAX_IO];
            int n = 0;
            st = ts_module_call(ts_container_child(g->blocks, i), 2, args, &n, y);
            ts_tensor_free(x);
            x = st ? NULL : y[0];
        }
        if (!st && !(st = ts_module_call1(g->ln_f, x, &t[6]))) st = ts_module_call1(g->lm_head, t[6], &out[0]);
        ts_tensor_free(x);
    }
    for (int i = 0; i < 8; i++) ts_tensor_free(t[i]);
    if (!st) *n_out = 1;
    return st;
}

static ts_status gpt_visit(ts_module *m, const ts_module_visitor *v)
{
    gpt *g = (gpt *)m;
    if (!v->child) return TS_OK;
    const char *names[6] = {"tok_emb", "pos_emb", "drop", "blocks", "ln_f", "lm_head"};
    ts_module *kids[6] = {g->tok_emb, g->pos_emb, g->drop, g->blocks, g->ln_f, g->lm_head};
    for (int i = 0; i < 6; i++) {
        ts_status st = v->child(v->ctx, names[i], kids[i]);
        if (st) return st;
    }
    return TS_OK;
}

static void gpt_free(ts_module *m)
{
    gpt *g = (gpt *)m;
    ts_module *kids[6] = {g->tok_emb, g->pos_emb, g->drop, g->blocks, g->ln_f, g->lm_head};
    for (int i = 0; i < 6; i++) ts_module_free(kids[i]);
    ts__free(TS_MEM_NN, g);
}

static const ts_module_vtable gpt_vt = {
    .type_name = "GPT", .forward = gpt_forward, .visit = gpt_visit, .free = gpt_free};

bool ts_gpt_get_config(const ts_module *m, ts_gpt_config *out)
{
    const ts_module_vtable *vt = m ? m->vtable : NULL;
    while (vt && vt != &gpt_vt) vt = vt->base; /* under fully_shard's and the checkpoint's vtables */
    if (!vt || !out) return false;
    *out = ((const gpt *)m)->cfg;
    return true;
}

ts_gpt_config ts_gpt_config_default(void)
{
    return (ts_gpt_config){.vocab_size = 64,
                           .block_size = 128,
                           .n_layer = 4,
                           .n_head = 4,
                           .d_model = 256,
                           .dropout = 0.0,
                           .tie_weights = false,
                           .gelu_approx = TS_GELU_NONE};
}

ts_status ts_gpt_new(const ts_gpt_config *c, ts_module **out)
{
    if (!c || !out || c->vocab_size <= 0 || c->block_size <= 0 || c->n_layer < 0 || c->n_layer > 4096 ||
        c->n_head <= 0 || c->d_model <= 0 || c->d_model % c->n_head)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "GPT: invalid config (vocab %lld, block %lld, layers %lld, heads %lld, "
                        "d_model %lld: all positive, d_model a multiple of heads)",
                        c ? (long long)c->vocab_size : 0, c ? (long long)c->block_size : 0,
                        c ? (long long)c->n_layer : 0, c ? (long long)c->n_head : 0, c ? (long long)c->d_model : 0);
    if (c->gelu_approx != TS_GELU_NONE && c->gelu_approx != TS_GELU_TANH)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "GPT: gelu_approx must be TS_GELU_NONE or TS_GELU_TANH, got %d",
                        (int)c->gelu_approx);
    gpt *g = ts__calloc(TS_MEM_NN, 1, sizeof *g);
    ts_module **blocks = ts__calloc(TS_MEM_NN, (size_t)(c->n_layer ? c->n_layer : 1), sizeof *blocks);
    if (!g || !blocks) {
        ts__free(TS_MEM_NN, g);
        ts__free(TS_MEM_NN, blocks);
        return TS_ERR_NO_MEMORY;
    }
    ts_module_init(&g->base, &gpt_vt);
    g->cfg = *c;
    int made = 0;
    ts_status st = ts_embedding_new(c->vocab_size, c->d_model, &g->tok_emb);
    if (!st) st = ts_embedding_new(c->block_size, c->d_model, &g->pos_emb);
    if (!st) st = ts_dropout_new(c->dropout, &g->drop);
    for (; !st && made < c->n_layer; made++) st = block_new(c, &blocks[made]);
    if (st && made > 0) made--;
    if (!st && !(st = ts_module_list_new((int)c->n_layer, blocks, &g->blocks))) made = 0; /* the list owns them now */
    if (!st) st = ts_layer_norm_new(c->d_model, 1e-5, true, &g->ln_f);
    if (!st) st = ts_linear_new(c->d_model, c->vocab_size, false, &g->lm_head);
    if (!st && c->tie_weights) {
        /* lm_head.weight = tok_emb.weight: one tensor in two slots */
        ts_nn_linear *h = (ts_nn_linear *)g->lm_head;
        ts_tensor_free(h->weight);
        h->weight = ts_tensor_retain(((ts_nn_embedding *)g->tok_emb)->weight);
    }
    for (int i = 0; i < made; i++) ts_module_free(blocks[i]);
    ts__free(TS_MEM_NN, blocks);
    if (st) {
        gpt_free(&g->base);
        return st;
    }
    *out = &g->base;
    return TS_OK;
}
