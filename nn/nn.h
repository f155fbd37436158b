/*
 * tensorshard nn layer: the module base (a struct whose first member points
 * to a static const vtable), PyTorch-compatible layers, state dicts and
 * safetensors files.
 *
 * Lifetime rules
 * - A module is created by its constructor (ts_linear_new, ...) and freed
 *   with ts_module_free(), which frees its parameters and children.
 *   Containers own the children given to them.
 * - Parameters live in slots (ts_tensor **) that the module owns; an upper
 *   layer (fully_shard) may swap what a slot holds. Code that needs a
 *   parameter reads the slot each time.
 * - Forward outputs are new references the caller releases.
 * - Modules are used by one thread at a time.
 *
 * Calling convention: always call a module through ts_module_call (or
 * ts_module_call_method for a named extra method); containers do the same
 * for their children, so that hooks installed on any module run.
 */
#ifndef TS_NN_H
#define TS_NN_H

#include "tensor/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Most inputs or outputs a module call takes. */
#define TS_MODULE_MAX_IO 8

typedef struct ts_module ts_module;

/* Forward (or a named extra method): reads n_in inputs, writes *n_out new
 * references into out (capacity TS_MODULE_MAX_IO). */
typedef ts_status (*ts_module_fn)(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out);

/* A visitor over a module's direct parameter slots and direct children, in
 * registration order (PyTorch's _parameters, then _modules). Either
 * callback may be NULL. A non-OK status stops the visit and is returned. */
typedef struct ts_module_visitor {
    ts_status (*param)(void *ctx, const char *name, ts_tensor **slot);
    ts_status (*child)(void *ctx, const char *name, ts_module *child);
    void *ctx;
} ts_module_visitor;

typedef struct ts_module_method {
    const char *name;
    ts_module_fn fn;
} ts_module_method;

typedef struct ts_module_vtable {
    const char *type_name;  /* "Linear" */
    ts_module_fn forward;
    ts_status (*visit)(ts_module *m, const ts_module_visitor *v);
    /* Frees what the module owns: its parameter tensors, children (via
     * ts_module_free) and the struct itself. */
    void (*free)(ts_module *m);
    const ts_module_method *methods; /* optional named extra methods */
    int n_methods;
    /* For a vtable made by an upper layer that extends another one
     * (fully_shard's "<Type>FSDPModule"): the one it extends. NULL for a
     * layer's own vtable. */
    const struct ts_module_vtable *base;
} ts_module_vtable;

/* The base every module struct starts with. */
struct ts_module {
    const ts_module_vtable *vtable;
    bool training;  /* train mode (default true, as in PyTorch) */
    void *ext;      /* owned by upper layers (fully_shard state); NULL here */
};

/* Initialises the base of a module struct the caller allocated. */
TS_API void ts_module_init(ts_module *m, const ts_module_vtable *vt);

/* Calls the module's forward (through its current vtable, so that hooks
 * run). TS_ERR_INVALID_ARGUMENT for NULL or too many inputs; errors of the
 * module's forward otherwise. */
TS_API ts_status ts_module_call(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out);
/* One input, one output. TS_ERR_INVALID_ARGUMENT if the module returns
 * more than one output. */
TS_API ts_status ts_module_call1(ts_module *m, ts_tensor *in, ts_tensor **out);
/* Calls a named extra method. TS_ERR_NOT_FOUND names the type and method. */
TS_API ts_status ts_module_call_method(ts_module *m, const char *name, int n_in, ts_tensor *const *in, int *n_out,
                                       ts_tensor **out);
/* Type name ("Linear", or "LinearFSDPModule" once rewritten). */
TS_API const char *ts_module_type_name(const ts_module *m);
/* Frees the module (NULL is accepted). */
TS_API void ts_module_free(ts_module *m);

/* Sets training mode on the module and every descendant. */
TS_API void ts_module_train(ts_module *m, bool training);
TS_API void ts_module_eval(ts_module *m);

/* One named parameter: the fully qualified name ("layers.1.weight", owned
 * by the list) and the slot. */
typedef struct ts_named_param {
    char *name;
    ts_tensor **slot;
    ts_module *owner; /* the module whose slot it is */
} ts_named_param;

typedef struct ts_named_params {
    ts_named_param *items;
    int n;
} ts_named_params;

/* Every parameter of the module tree in PyTorch's named_parameters()
 * order, each tensor once (a tied parameter appears under its first name).
 * Empty slots (a NULL tensor, such as an absent bias) are skipped. Free the
 * list with ts_named_params_free. */
TS_API ts_status ts_module_named_parameters(ts_module *m, ts_named_params *out);
TS_API void ts_named_params_free(ts_named_params *p);

/* Visits every module of the tree (the root with name "") in PyTorch's
 * named_modules() order (pre-order), each once. */
typedef ts_status (*ts_module_each_fn)(void *ctx, const char *fqn, ts_module *m);
TS_API ts_status ts_module_named_modules(ts_module *m, ts_module_each_fn fn, void *ctx);

/* The module at fully qualified name `fqn` ("blocks.1", "" for m itself),
 * borrowed, as PyTorch's get_submodule. TS_ERR_NOT_FOUND names it;
 * TS_ERR_INVALID_ARGUMENT for NULL arguments. */
TS_API ts_status ts_module_get_submodule(ts_module *m, const char *fqn, ts_module **out);

/* Zeroes (set_to_none=false) or drops (true) every parameter's .grad. */
TS_API void ts_module_zero_grad(ts_module *m, bool set_to_none);
/* Number of parameter elements (each tensor once). */
TS_API int64_t ts_module_num_parameters(ts_module *m);

/* ------------------------------------------------------------ state dicts */

/* An ordered name -> tensor map. Tensors are references owned by the dict. */
typedef struct ts_state_dict ts_state_dict;

TS_API ts_status ts_state_dict_new(ts_state_dict **out);
TS_API void ts_state_dict_free(ts_state_dict *sd);
/* Adds or replaces `name` (copied); the dict takes a new reference. */
TS_API ts_status ts_state_dict_set(ts_state_dict *sd, const char *name, ts_tensor *t);
/* Borrowed tensor for `name`, or NULL. */
TS_API ts_tensor *ts_state_dict_get(const ts_state_dict *sd, const char *name);
TS_API int ts_state_dict_size(const ts_state_dict *sd);
/* Entry i in insertion order (borrowed name and tensor). */
TS_API const char *ts_state_dict_name(const ts_state_dict *sd, int i);
TS_API ts_tensor *ts_state_dict_tensor(const ts_state_dict *sd, int i);

/* Every parameter under every name (tied ones under each name, as
 * PyTorch's state_dict) as detached aliases of the slots' tensors (no
 * copies). */
TS_API ts_status ts_module_state_dict(ts_module *m, ts_state_dict **out);

/* Copies the dict's tensors into the module's parameters. strict: every
 * key must match a parameter and every parameter must have a key. Keys are
 * looked up in O(1) (hashed). Errors, in this order: TS_ERR_SHAPE naming
 * each key whose shape differs (both shapes); TS_ERR_DTYPE naming each key
 * whose dtype differs from the parameter's (both dtypes: nothing is
 * converted or reinterpreted; convert with ts_to_dtype first);
 * TS_ERR_NOT_FOUND with the lists of missing and unexpected keys. Nothing
 * is copied when an error is returned. */
TS_API ts_status ts_module_load_state_dict(ts_module *m, const ts_state_dict *sd, bool strict);

/* Writes a state dict as a safetensors file (little-endian u64 header
 * length, JSON header with dtype/shape/data_offsets, raw data), atomically:
 * a temporary file ".<name>.tmp.<pid>.<16 random hex digits>" in the same
 * folder, created with O_CREAT | O_EXCL | O_NOFOLLOW and mode 0600 while it
 * is written, then given the mode of a new file (0666 under the umask),
 * fsync'ed, renamed over `path`, and the folder fsync'ed. The temporary
 * file is removed on every failure. Temporary files of `path` left in that
 * folder by savers whose pid no longer runs are removed first (only names
 * of that exact pattern; pids are read in this process's pid namespace,
 * so a saver in another container that shares the folder may lose its
 * temporary file and fail with TS_ERR_IO, never a checkpoint). `metadata` (may be NULL) is a list of n_meta
 * key/value string pairs for "__metadata__". TS_ERR_IO names the path and
 * the system error. */
TS_API ts_status ts_safetensors_save(const char *path, const ts_state_dict *sd, const char *const *metadata,
                                     int n_meta);
/* Reads a safetensors file into a new state dict. A missing file is
 * TS_ERR_IO; a truncated, oversized or malformed file is TS_ERR_FORMAT
 * naming what is wrong. Never crashes on bad input. Floating-point tensors
 * holding NaN or Inf load as they are (as torch.load and
 * safetensors.torch.load_file do), with one warning per such tensor that
 * names the key and the count ("... tensor 'w' holds 3 non-finite values
 * (NaN or Inf) of 12"). */
TS_API ts_status ts_safetensors_load(const char *path, ts_state_dict **out);
/* The same, from a buffer (what the fuzz target drives). */
TS_API ts_status ts_safetensors_parse(const void *data, size_t len, ts_state_dict **out);

/* ------------------------------------------------------------ layers */

/* torch.nn.Linear(in, out, bias): weight (out, in), bias (out,). */
typedef struct ts_nn_linear {
    ts_module base;
    ts_tensor *weight, *bias; /* bias NULL without bias */
    int64_t in_features, out_features;
} ts_nn_linear;
TS_API ts_status ts_linear_new(int64_t in_features, int64_t out_features, bool bias, ts_module **out);

/* Activations and dropout (no parameters). */
TS_API ts_status ts_relu_new(ts_module **out);
TS_API ts_status ts_tanh_new(ts_module **out);
TS_API ts_status ts_gelu_new(ts_gelu_approx approx, ts_module **out);
TS_API ts_status ts_dropout_new(double p, ts_module **out);

/* Sequential and ModuleList: children named "0", "1", ... */
TS_API ts_status ts_sequential_new(int n, ts_module *const *children, ts_module **out);
TS_API ts_status ts_module_list_new(int n, ts_module *const *children, ts_module **out);
/* Child i of a Sequential or ModuleList (borrowed), NULL if out of range. */
TS_API ts_module *ts_container_child(ts_module *m, int i);
TS_API int ts_container_size(ts_module *m);

/* torch.nn.Embedding(num, dim): weight (num, dim) ~ N(0, 1). */
typedef struct ts_nn_embedding {
    ts_module base;
    ts_tensor *weight;
    int64_t num_embeddings, embedding_dim;
} ts_nn_embedding;
TS_API ts_status ts_embedding_new(int64_t num_embeddings, int64_t embedding_dim, ts_module **out);

/* torch.nn.LayerNorm(normalized_shape): weight = 1, bias = 0. */
typedef struct ts_nn_layer_norm {
    ts_module base;
    ts_tensor *weight, *bias;
    int64_t dim;
    double eps;
} ts_nn_layer_norm;
TS_API ts_status ts_layer_norm_new(int64_t dim, double eps, bool elementwise_affine, ts_module **out);

/* torch.nn.MultiheadAttention(E, H, bias=True, batch_first=True):
 * in_proj_weight (3E, E), in_proj_bias (3E,), out_proj (Linear E -> E).
 * Forward inputs: query, key, value (B, T, E), and optionally a bool mask
 * (T, S) where true means "may not attend" (PyTorch's attn_mask rule).
 * Output: (B, T, E). */
typedef struct ts_nn_mha {
    ts_module base;
    ts_tensor *in_proj_weight, *in_proj_bias;
    ts_module *out_proj;
    int64_t embed_dim, num_heads;
    double dropout;
} ts_nn_mha;
TS_API ts_status ts_mha_new(int64_t embed_dim, int64_t num_heads, double dropout, bool bias, ts_module **out);

typedef struct ts_encoder_layer_config {
    int64_t d_model, nhead, dim_feedforward;
    double dropout;          /* default 0.1 */
    bool gelu;               /* activation: false relu (default), true gelu */
    double layer_norm_eps;   /* default 1e-5 */
    bool norm_first;         /* default false */
    bool causal;             /* apply a causal mask in self-attention */
} ts_encoder_layer_config;
TS_API ts_encoder_layer_config ts_encoder_layer_config_default(int64_t d_model, int64_t nhead);

/* torch.nn.TransformerEncoderLayer(batch_first=True): self_attn, linear1,
 * dropout, linear2, norm1, norm2, dropout1, dropout2. Input (B, T, d). */
TS_API ts_status ts_encoder_layer_new(const ts_encoder_layer_config *cfg, ts_module **out);
/* torch.nn.TransformerEncoder(layer, num_layers): "layers" holds
 * num_layers copies of one freshly made layer (deep copies, as PyTorch). */
TS_API ts_status ts_transformer_encoder_new(const ts_encoder_layer_config *cfg, int num_layers, ts_module **out);

typedef struct ts_gpt_config {
    int64_t vocab_size, block_size, n_layer, n_head, d_model;
    double dropout;   /* default 0.0 */
    bool tie_weights; /* lm_head.weight is tok_emb.weight (default false) */
} ts_gpt_config;
TS_API ts_gpt_config ts_gpt_config_default(void);

/* A GPT-style decoder (see tools/reference/models.py for the PyTorch
 * twin): tok_emb, pos_emb, blocks.N (ln1, attn, ln2, mlp.0, mlp.2), ln_f,
 * lm_head. Forward input: int64 token ids (B, T) with T <= block_size;
 * output logits (B, T, vocab). */
TS_API ts_status ts_gpt_new(const ts_gpt_config *cfg, ts_module **out);

#ifdef __cplusplus
}
#endif
#endif /* TS_NN_H */
