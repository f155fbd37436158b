/* torch.nn.Embedding */
#define _GNU_SOURCE
#include "nn/internal.h"

#include <stdio.h>

static ts_status embedding_forward(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    ts_nn_embedding *e = (ts_nn_embedding *)m;
    ts_status st = ts__module_check_inputs(m, n_in, 1, 1);
    if (!st && !(st = ts_embedding(e->weight, in[0], &out[0]))) *n_out = 1;
    return st;
}

static ts_status embedding_visit(ts_module *m, const ts_module_visitor *v)
{
    return v->param ? v->param(v->ctx, "weight", &((ts_nn_embedding *)m)->weight) : TS_OK;
}

static void embedding_free(ts_module *m)
{
    ts_tensor_free(((ts_nn_embedding *)m)->weight);
    ts__free(TS_MEM_NN, m);
}

/* PyTorch's Embedding.extra_repr */
static int embedding_extra_repr(const ts_module *m, char *buf, size_t cap)
{
    const ts_nn_embedding *e = (const ts_nn_embedding *)m;
    return snprintf(buf, cap, "%lld, %lld", (long long)e->num_embeddings, (long long)e->embedding_dim);
}

/* PyTorch's Embedding.reset_parameters: init.normal_(weight). */
static ts_status embedding_reset_parameters(ts_module *m)
{
    bool prev = ts_grad_mode_set(false);
    ts_status st = ts_normal_(((ts_nn_embedding *)m)->weight, 0.0, 1.0, NULL);
    ts_grad_mode_set(prev);
    return st;
}

static const ts_module_vtable embedding_vt = {.type_name = "Embedding",
                                              .forward = embedding_forward,
                                              .visit = embedding_visit,
                                              .free = embedding_free,
                                              .extra_repr = embedding_extra_repr,
                                              .reset_parameters = embedding_reset_parameters};

ts_status ts_embedding_new(int64_t num_embeddings, int64_t embedding_dim, ts_module **out)
{
    if (num_embeddings < 0 || embedding_dim < 0 || !out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "Embedding: sizes must be >= 0 (got %lld, %lld)",
                        (long long)num_embeddings, (long long)embedding_dim);
    ts_nn_embedding *e = ts__calloc(TS_MEM_NN, 1, sizeof *e);
    if (!e) return TS_ERR_NO_MEMORY;
    ts_module_init(&e->base, &embedding_vt);
    e->num_embeddings = num_embeddings;
    e->embedding_dim = embedding_dim;
    int64_t s[2] = {num_embeddings, embedding_dim};
    ts_status st = ts__param_new(TS_F32, 2, s, &e->weight);
    if (!st) st = embedding_reset_parameters(&e->base);
    if (st) {
        embedding_free(&e->base);
        return st;
    }
    *out = &e->base;
    return TS_OK;
}
