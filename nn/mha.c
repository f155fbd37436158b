/* torch.nn.MultiheadAttention(E, H, dropout, bias, batch_first),
 * computed as PyTorch 1.13's F.multi_head_attention_forward does: one
 * packed input projection (three when query, key and value differ),
 * then per head softmax(q k^T / sqrt(head_dim)) with -inf where the bool
 * mask is set, dropout on the weights in training, weights v
 * (ts_attention, which reads the heads straight from the projections),
 * then out_proj.
 *
 * Layouts: with batch_first the projections are (B, T, E) already. Without
 * it (PyTorch's default) they are (T, B, E); ts_attention reads them
 * through transposed (B, T, E) views, and its (B, T, E) output is made a
 * contiguous (T, B, E) before out_proj, as PyTorch's
 * attn_output.transpose(0, 1).contiguous(). The dropout mask over the
 * (B*H, T, S) weights is the same in both layouts (PyTorch folds
 * (T, B, E) into (T, B*H, hd) and transposes, so batch b, head h is
 * b*H + h either way); the output is contiguous in the caller's layout,
 * so that a dropout applied to it next draws in PyTorch's order. */
#define _GNU_SOURCE
#include "nn/internal.h"

#include <math.h>

#define FREE_ALL(arr) \
    do { \
        for (size_t i_ = 0; i_ < sizeof(arr) / sizeof(arr)[0]; i_++) ts_tensor_free((arr)[i_]); \
    } while (0)

/* rows [k*E, (k+1)*E) of the packed projection weight and bias */
static ts_status proj(ts_nn_mha *a, int k, ts_tensor *x, ts_tensor **out)
{
    int64_t E = a->embed_dim;
    ts_tensor *w = NULL, *b = NULL;
    ts_status st = ts_narrow(a->in_proj_weight, 0, k * E, E, &w);
    if (!st && a->in_proj_bias) st = ts_narrow(a->in_proj_bias, 0, k * E, E, &b);
    if (!st) st = ts_linear(x, w, b, out);
    ts_tensor_free(w);
    ts_tensor_free(b);
    return st;
}

static ts_status mha_forward(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    ts_nn_mha *a = (ts_nn_mha *)m;
    int64_t E = a->embed_dim, H = a->num_heads;
    ts_status st = ts__module_check_inputs(m, n_in, 3, 4);
    if (st) return st;
    ts_tensor *q_in = in[0], *k_in = in[1], *v_in = in[2], *mask = n_in > 3 ? in[3] : NULL;
    static const char *const what[3] = {"query", "key", "value"};
    for (int i = 0; i < 3; i++)
        if ((st = ts__module_check_last_dim(m, what[i], in[i], 3, E)) ||
            (st = ts__module_check_dtype(m, what[i], in[i], "in_proj_weight", a->in_proj_weight)))
            return st;
    /* the batch and the sequence dims of the inputs */
    int bd = a->batch_first ? 0 : 1, sd = 1 - bd;
    if (ts_tensor_ndim(q_in) != 3 || ts_tensor_ndim(k_in) != 3 || ts_tensor_ndim(v_in) != 3 ||
        ts_tensor_size(k_in, bd) != ts_tensor_size(q_in, bd) || ts_tensor_size(v_in, bd) != ts_tensor_size(q_in, bd) ||
        ts_tensor_size(k_in, sd) != ts_tensor_size(v_in, sd)) {
        char s1[96], s2[96], s3[96];
        return ts_error(TS_ERR_SHAPE,
                        "MultiheadAttention: query %s, key %s and value %s must be %s with E = %lld "
                        "(batch_first=%s)",
                        ts_tensor_shape_str(q_in, s1, sizeof s1), ts_tensor_shape_str(k_in, s2, sizeof s2),
                        ts_tensor_shape_str(v_in, s3, sizeof s3),
                        a->batch_first ? "(B, T, E), (B, S, E), (B, S, E)" : "(T, B, E), (S, B, E), (S, B, E)",
                        (long long)E, a->batch_first ? "true" : "false");
    }
    int64_t T = ts_tensor_size(q_in, sd), S = ts_tensor_size(k_in, sd);
    if (mask &&
        (ts_tensor_dtype(mask) != TS_BOOL || ts_tensor_ndim(mask) != 2 || ts_tensor_size(mask, 0) != T ||
         ts_tensor_size(mask, 1) != S)) {
        char s1[96];
        return ts_error(TS_ERR_SHAPE, "MultiheadAttention: attn_mask must be bool (%lld, %lld), got %s %s",
                        (long long)T, (long long)S, ts_dtype_name(ts_tensor_dtype(mask)),
                        ts_tensor_shape_str(mask, s1, sizeof s1));
    }
    ts_tensor *t[16] = {0}; /* every intermediate, freed at the end */
    ts_tensor *q, *k, *v;
    if (q_in == k_in && k_in == v_in) {
        /* self-attention: one packed projection, then a chunk in three */
        ts_tensor *parts[3];
        int np;
        if ((st = ts_linear(q_in, a->in_proj_weight, a->in_proj_bias, &t[0])) ||
            (st = ts_chunk(t[0], 3, -1, 3, parts, &np)))
            goto done;
        t[1] = parts[0];
        t[2] = parts[1];
        t[3] = parts[2];
    } else if ((st = proj(a, 0, q_in, &t[1])) || (st = proj(a, 1, k_in, &t[2])) || (st = proj(a, 2, v_in, &t[3]))) {
        goto done;
    }
    q = t[1];
    k = t[2];
    v = t[3];
    /* (T, B, E) projections: the attention core reads them as (B, T, E)
     * views (unit last stride; no copies) */
    if (!a->batch_first) {
        if ((st = ts_transpose(t[1], 0, 1, &t[5])) || (st = ts_transpose(t[2], 0, 1, &t[6])) ||
            (st = ts_transpose(t[3], 0, 1, &t[7])))
            goto done;
        q = t[5];
        k = t[6];
        v = t[7];
    }
    /* the attention core reads q, k, v straight from the projections */
    if ((st = ts_attention(q, k, v, H, mask, a->dropout, m->training, NULL, &t[4]))) goto done;
    v = t[4];
    /* (B, T, E) -> contiguous (T, B, E), PyTorch's
     * attn_output.transpose(0, 1).contiguous() */
    if (!a->batch_first) {
        if ((st = ts_transpose(t[4], 0, 1, &t[8])) || (st = ts_contiguous(t[8], &t[9]))) goto done;
        v = t[9];
    }
    st = ts_module_call1(a->out_proj, v, &out[0]);
    if (!st) *n_out = 1;
done:
    FREE_ALL(t);
    return st;
}

static ts_status mha_visit(ts_module *m, const ts_module_visitor *v)
{
    ts_nn_mha *a = (ts_nn_mha *)m;
    ts_status st = TS_OK;
    if (v->param && !(st = v->param(v->ctx, "in_proj_weight", &a->in_proj_weight)) && a->in_proj_bias)
        st = v->param(v->ctx, "in_proj_bias", &a->in_proj_bias);
    if (!st && v->child) st = v->child(v->ctx, "out_proj", a->out_proj);
    return st;
}

static void mha_free(ts_module *m)
{
    ts_nn_mha *a = (ts_nn_mha *)m;
    ts_tensor_free(a->in_proj_weight);
    ts_tensor_free(a->in_proj_bias);
    ts_module_free(a->out_proj);
    ts__free(TS_MEM_NN, a);
}

/* PyTorch's MultiheadAttention._reset_parameters: xavier_uniform_
 * (in_proj_weight), then constant_(in_proj_bias, 0) and
 * constant_(out_proj.bias, 0). It zeroes a child's bias (out_proj's),
 * as torch's does; out_proj's weight is out_proj's own reset (drawn
 * before this one when building and in ts_module_reset_parameters'
 * children-first order). */
static ts_status mha_reset_parameters(ts_module *m)
{
    ts_nn_mha *a = (ts_nn_mha *)m;
    bool prev = ts_grad_mode_set(false);
    ts_status st = ts_init_xavier_uniform_(a->in_proj_weight, 1.0, NULL);
    ts_tensor *out_bias = a->out_proj ? ((ts_nn_linear *)a->out_proj)->bias : NULL;
    if (!st && a->in_proj_bias) st = ts_tensor_fill_(a->in_proj_bias, 0.0);
    if (!st && out_bias) st = ts_tensor_fill_(out_bias, 0.0);
    ts_grad_mode_set(prev);
    return st;
}

static const ts_module_vtable mha_vt = {.type_name = "MultiheadAttention",
                                        .forward = mha_forward,
                                        .visit = mha_visit,
                                        .free = mha_free,
                                        .reset_parameters = mha_reset_parameters};

ts_mha_options ts_mha_options_default(void)
{
    return (ts_mha_options){.dropout = 0.0, .bias = true, .batch_first = false};
}

ts_status ts_mha_new(int64_t embed_dim, int64_t num_heads, double dropout, bool bias, ts_module **out)
{
    ts_mha_options o = ts_mha_options_default();
    o.dropout = dropout;
    o.bias = bias;
    return ts_mha_new_opts(embed_dim, num_heads, &o, out);
}

ts_status ts_mha_new_opts(int64_t embed_dim, int64_t num_heads, const ts_mha_options *opts, ts_module **out)
{
    ts_mha_options o = opts ? *opts : ts_mha_options_default();
    double dropout = o.dropout;
    bool bias = o.bias;
    if (embed_dim <= 0 || num_heads <= 0 || embed_dim % num_heads != 0 || !(dropout >= 0 && dropout <= 1) || !out)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "MultiheadAttention: embed_dim %lld must be a positive multiple of "
                        "num_heads %lld, dropout %g in [0, 1]",
                        (long long)embed_dim, (long long)num_heads, dropout);
    if (embed_dim > INT64_MAX / 3)
        return ts_error(
            TS_ERR_INVALID_ARGUMENT,
            "MultiheadAttention: embed_dim %lld is too large (the (3 * embed_dim, embed_dim) in_proj_weight "
            "has more rows than int64 holds)",
            (long long)embed_dim);
    ts_nn_mha *a = ts__calloc(TS_MEM_NN, 1, sizeof *a);
    if (!a) return TS_ERR_NO_MEMORY;
    ts_module_init(&a->base, &mha_vt);
    a->embed_dim = embed_dim;
    a->num_heads = num_heads;
    a->dropout = dropout;
    a->batch_first = o.batch_first;
    /* PyTorch's order (docs/rng.md §9): out_proj is constructed first (its draws
     * are consumed), then xavier_uniform_(in_proj_weight), then both
     * biases are zeroed */
    int64_t ws[2] = {3 * embed_dim, embed_dim}, bs[1] = {3 * embed_dim};
    ts_status st = ts_linear_new(embed_dim, embed_dim, bias, &a->out_proj);
    if (!st) st = ts__param_new(TS_F32, 2, ws, &a->in_proj_weight);
    if (!st && bias) st = ts__param_new(TS_F32, 1, bs, &a->in_proj_bias);
    if (!st) st = mha_reset_parameters(&a->base);
    if (st) {
        mha_free(&a->base);
        return st;
    }
    *out = &a->base;
    return TS_OK;
}
