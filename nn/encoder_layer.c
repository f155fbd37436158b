/* torch.nn.TransformerEncoderLayer and torch.nn.TransformerEncoder.
 * Forward inputs: src (T, B, d), or (B, T, d) with cfg.batch_first, and
 * optionally a bool mask (T, T) (true = may not attend); with cfg.causal
 * the layer builds the causal mask itself.
 *
 * Every tensor here stays in the caller's layout, as in PyTorch's python
 * path (the one taken in training): self_attn returns a contiguous tensor
 * in that layout, and each dropout draws its bernoulli mask over its input
 * in row-major order of that layout, which is what torch 1.13's CPU
 * dropout does (its mask is a contiguous empty_like of the input). */
#define _GNU_SOURCE
#include "nn/internal.h"
#include "tensor/internal.h"

#include <string.h>

typedef struct encoder_layer {
    ts_module base;
    ts_encoder_layer_config cfg;
    ts_module *self_attn, *linear1, *dropout, *linear2, *norm1, *norm2, *dropout1, *dropout2;
} encoder_layer;

static ts_status call1(ts_module *m, ts_tensor *x, ts_tensor **out) { return ts_module_call1(m, x, out); }

/* dropout1(self_attn(x, x, x, mask)) */
static ts_status sa_block(encoder_layer *l, ts_tensor *x, ts_tensor *mask, ts_tensor **out)
{
    ts_tensor *in[4] = {x, x, x, mask}, *a[TS_MODULE_MAX_IO];
    int n = 0;
    ts_status st = ts_module_call(l->self_attn, mask ? 4 : 3, in, &n, a);
    if (st) return st;
    st = call1(l->dropout1, a[0], out);
    for (int i = 0; i < n; i++) ts_tensor_free(a[i]);
    return st;
}

/* dropout2(linear2(dropout(activation(linear1(x))))) */
static ts_status ff_block(encoder_layer *l, ts_tensor *x, ts_tensor **out)
{
    ts_tensor *h = NULL, *a = NULL, *d = NULL, *o = NULL;
    ts_status st = call1(l->linear1, x, &h);
    if (!st) st = l->cfg.gelu ? ts_gelu(h, TS_GELU_NONE, &a) : ts_relu(h, &a);
    if (!st) st = call1(l->dropout, a, &d);
    if (!st) st = call1(l->linear2, d, &o);
    if (!st) st = call1(l->dropout2, o, out);
    ts_tensor_free(h);
    ts_tensor_free(a);
    ts_tensor_free(d);
    ts_tensor_free(o);
    return st;
}

static ts_status encoder_layer_forward(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    encoder_layer *l = (encoder_layer *)m;
    ts_status st = ts__module_check_inputs(m, n_in, 1, 2);
    if (!st) st = ts__module_check_last_dim(m, "src", in[0], 3, l->cfg.d_model);
    if (st) return st;
    ts_tensor *x = in[0], *mask = n_in > 1 ? in[1] : NULL, *own_mask = NULL;
    if (!mask && l->cfg.causal) {
        if ((st = ts__causal_mask(ts_tensor_size(x, l->cfg.batch_first ? 1 : 0), &own_mask))) return st;
        mask = own_mask;
    }
    ts_tensor *t[6] = {0};
    if (l->cfg.norm_first) {
        /* x = x + sa(norm1(x)); x = x + ff(norm2(x)) */
        if (!(st = call1(l->norm1, x, &t[0])) && !(st = sa_block(l, t[0], mask, &t[1])) &&
            !(st = ts_add(x, t[1], &t[2])) && !(st = call1(l->norm2, t[2], &t[3])) && !(st = ff_block(l, t[3], &t[4])))
            st = ts_add(t[2], t[4], &out[0]);
    } else {
        /* x = norm1(x + sa(x)); x = norm2(x + ff(x)) */
        if (!(st = sa_block(l, x, mask, &t[0])) && !(st = ts_add(x, t[0], &t[1])) &&
            !(st = call1(l->norm1, t[1], &t[2])) && !(st = ff_block(l, t[2], &t[3])) &&
            !(st = ts_add(t[2], t[3], &t[4])))
            st = call1(l->norm2, t[4], &out[0]);
    }
    for (int i = 0; i < 6; i++) ts_tensor_free(t[i]);
    ts_tensor_free(own_mask);
    if (!st) *n_out = 1;
    return st;
}

static ts_status encoder_layer_visit(ts_module *m, const ts_module_visitor *v)
{
    encoder_layer *l = (encoder_layer *)m;
    if (!v->child) return TS_OK;
    const char *names[8] = {"self_attn", "linear1", "dropout", "linear2", "norm1", "norm2", "dropout1", "dropout2"};
    ts_module *kids[8] = {l->self_attn, l->linear1, l->dropout,  l->linear2,
                          l->norm1,     l->norm2,   l->dropout1, l->dropout2};
    for (int i = 0; i < 8; i++) {
        ts_status st = v->child(v->ctx, names[i], kids[i]);
        if (st) return st;
    }
    return TS_OK;
}

static void encoder_layer_free(ts_module *m)
{
    encoder_layer *l = (encoder_layer *)m;
    ts_module *kids[8] = {l->self_attn, l->linear1, l->dropout,  l->linear2,
                          l->norm1,     l->norm2,   l->dropout1, l->dropout2};
    for (int i = 0; i < 8; i++) ts_module_free(kids[i]);
    ts__free(TS_MEM_NN, l);
}

static const ts_module_vtable encoder_layer_vt = {.type_name = "TransformerEncoderLayer",
                                                  .forward = encoder_layer_forward,
                                                  .visit = encoder_layer_visit,
                                                  .free = encoder_layer_free};

ts_encoder_layer_config ts_encoder_layer_config_default(int64_t d_model, int64_t nhead)
{
    return (ts_encoder_layer_config){.d_model = d_model,
                                     .nhead = nhead,
                                     .dim_feedforward = 2048,
                                     .dropout = 0.1,
                                     .gelu = false,
                                     .layer_norm_eps = 1e-5,
                                     .norm_first = false,
                                     .causal = false,
                                     .batch_first = false};
}

ts_status ts_encoder_layer_new(const ts_encoder_layer_config *cfg, ts_module **out)
{
    if (!cfg || !out || cfg->dim_feedforward <= 0)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "TransformerEncoderLayer: need a config with dim_feedforward > 0");
    encoder_layer *l = ts__calloc(TS_MEM_NN, 1, sizeof *l);
    if (!l) return TS_ERR_NO_MEMORY;
    ts_module_init(&l->base, &encoder_layer_vt);
    l->cfg = *cfg;
    /* construction order = PyTorch's (it fixes the RNG draws) */
    ts_mha_options mo = ts_mha_options_default();
    mo.dropout = cfg->dropout;
    mo.batch_first = cfg->batch_first;
    ts_status st = ts_mha_new_opts(cfg->d_model, cfg->nhead, &mo, &l->self_attn);
    if (!st) st = ts_linear_new(cfg->d_model, cfg->dim_feedforward, true, &l->linear1);
    if (!st) st = ts_dropout_new(cfg->dropout, &l->dropout);
    if (!st) st = ts_linear_new(cfg->dim_feedforward, cfg->d_model, true, &l->linear2);
    if (!st) st = ts_layer_norm_new(cfg->d_model, cfg->layer_norm_eps, true, &l->norm1);
    if (!st) st = ts_layer_norm_new(cfg->d_model, cfg->layer_norm_eps, true, &l->norm2);
    if (!st) st = ts_dropout_new(cfg->dropout, &l->dropout1);
    if (!st) st = ts_dropout_new(cfg->dropout, &l->dropout2);
    if (st) {
        encoder_layer_free(&l->base);
        return st;
    }
    *out = &l->base;
    return TS_OK;
}

/* ------------------------------------------------------------ encoder */

typedef struct encoder {
    ts_module base;
    ts_module *layers; /* ModuleList */
} encoder;

static ts_status encoder_forward(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    encoder *e = (encoder *)m;
    ts_status st = ts__module_check_inputs(m, n_in, 1, 2);
    if (st) return st;
    ts_tensor *x = ts_tensor_retain(in[0]);
    for (int i = 0; i < ts_container_size(e->layers) && !st; i++) {
        ts_tensor *args[2] = {x, n_in > 1 ? in[1] : NULL}, *y[TS_MODULE_MAX_IO];
        int n = 0;
        st = ts_module_call(ts_container_child(e->layers, i), n_in, args, &n, y);
        ts_tensor_free(x);
        x = st ? NULL : y[0];
        for (int k = 1; !st && k < n; k++) ts_tensor_free(y[k]);
    }
    if (st) return st;
    out[0] = x;
    *n_out = 1;
    return TS_OK;
}

static ts_status encoder_visit(ts_module *m, const ts_module_visitor *v)
{
    return v->child ? v->child(v->ctx, "layers", ((encoder *)m)->layers) : TS_OK;
}

static void encoder_free(ts_module *m)
{
    ts_module_free(((encoder *)m)->layers);
    ts__free(TS_MEM_NN, m);
}

static const ts_module_vtable encoder_vt = {
    .type_name = "TransformerEncoder", .forward = encoder_forward, .visit = encoder_visit, .free = encoder_free};

ts_status ts__causal_mask(int64_t T, ts_tensor **out)
{
    ts_tensor *keep, *f;
    ts_status st = ts_tril_mask(T, 0, &keep);
    if (st) return st;
    /* tril marks what may be seen; the attention mask marks what may not */
    if (!(st = ts_tensor_full(TS_BOOL, 0, NULL, 0.0, &f))) {
        st = ts_eq(keep, f, out);
        ts_tensor_free(f);
    }
    ts_tensor_free(keep);
    return st;
}

/* Deferred ([Note: deferred init] in tensor/internal.h): the copy is
 * recorded, each dst parameter's storage repeating its src twin's
 * initializers. Parameters, then buffers, in the same order in both. */
static ts_status copy_params_deferred(ts_module *dst, ts_module *src)
{
    ts_named_params a = {0}, b = {0};
    ts_status st = ts__module_entries(src, true, true, true, &a);
    if (!st) st = ts__module_entries(dst, true, true, true, &b);
    if (!st && a.n != b.n)
        st = ts_error(TS_ERR_INVALID_ARGUMENT, "copying %d parameters and buffers into %d", a.n, b.n);
    for (int i = 0; !st && i < a.n; i++) {
        ts_tensor *from = *a.items[i].slot, *to = *b.items[i].slot;
        if (!ts__is_meta(to) || !ts__is_meta(from) || ts_tensor_numel(to) != ts_tensor_numel(from))
            st = ts_error(TS_ERR_INVALID_ARGUMENT,
                          "copying '%s' of a deferred module: both must be meta tensors of "
                          "one size",
                          a.items[i].name);
        else st = ts__init_events_repeat(to->storage, from->storage);
    }
    ts_named_params_free(&a);
    ts_named_params_free(&b);
    return st;
}

/* Copies every parameter of src into dst (same architecture). */
ts_status ts__module_copy_params(ts_module *dst, ts_module *src)
{
    ts_named_params p;
    ts_status pst = ts_module_named_parameters(src, &p);
    if (pst) return pst;
    bool deferred = p.n > 0 && ts__is_meta(*p.items[0].slot);
    ts_named_params_free(&p);
    if (deferred) return copy_params_deferred(dst, src);
    ts_state_dict *sd;
    ts_status st = ts_module_state_dict(src, &sd);
    if (st) return st;
    st = ts_module_load_state_dict(dst, sd, true);
    ts_state_dict_free(sd);
    return st;
}

ts_status ts_transformer_encoder_new(const ts_encoder_layer_config *cfg, int num_layers, ts_module **out)
{
    if (num_layers < 1 || num_layers > 4096 || !out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "TransformerEncoder: num_layers must be in [1, 4096], got %d",
                        num_layers);
    ts_module **layers = ts__calloc(TS_MEM_NN, (size_t)num_layers, sizeof *layers);
    if (!layers) return TS_ERR_NO_MEMORY;
    /* PyTorch deep-copies one constructed layer: the copies draw nothing.
     * Build the first normally, the others with the generator state saved
     * and restored, then copy the first one's values into them. */
    ts_status st = ts_encoder_layer_new(cfg, &layers[0]);
    uint8_t *state = st ? NULL : ts__malloc(TS_MEM_NN, TS_GENERATOR_STATE_BYTES);
    if (!st && !state) st = TS_ERR_NO_MEMORY;
    if (!st) ts_generator_get_state(ts_default_generator(), state);
    for (int i = 1; i < num_layers && !st; i++)
        if (!(st = ts_encoder_layer_new(cfg, &layers[i]))) st = ts__module_copy_params(layers[i], layers[0]);
    if (state) {
        ts_status rs = ts_generator_set_state(ts_default_generator(), state);
        st = st ? st : rs;
        ts__free(TS_MEM_NN, state);
    }
    encoder *e = NULL;
    if (!st && !(e = ts__calloc(TS_MEM_NN, 1, sizeof *e))) st = TS_ERR_NO_MEMORY;
    if (!st && (st = ts_module_list_new(num_layers, layers, &e->layers))) ts__free(TS_MEM_NN, e);
    if (st) {
        for (int i = 0; i < num_layers; i++) ts_module_free(layers[i]);
        ts__free(TS_MEM_NN, layers);
        return st;
    }
    ts__free(TS_MEM_NN, layers);
    ts_module_init(&e->base, &encoder_vt);
    *out = &e->base;
    return TS_OK;
}
