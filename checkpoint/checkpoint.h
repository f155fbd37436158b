/*
 * checkpoint: distributed checkpoints in the style of PyTorch's
 * torch.distributed.checkpoint (DCP) with FSDP2 state dicts
 * (docs/checkpoint.md), plus streaming full-state files.
 *
 * A sharded checkpoint is a folder:
 *   - one safetensors file per rank that holds data, with that rank's
 *     local rows of every sharded tensor it writes (a dim-0 shard of a
 *     parameter, or of an optimizer state of the parameter's shape) under
 *     the tensor's key; a tensor replicated over some ranks (a parameter
 *     outside every FSDP group, a buffer, an HSDP shard on the replicas of
 *     mesh dim 0, a 0-d "step") is written once, by the lowest rank that
 *     holds it;
 *   - one index, "index.json" (JSON, jansson), written by rank 0 after
 *     every rank's file is durable, naming the files and, per key, its
 *     dtype, global shape, placements and every saved piece (file, first
 *     global row, rows, byte offset and length in the file, and a 64-bit
 *     checksum of its bytes that a load checks when it reads the piece
 *     whole).
 * Saving gathers nothing: no rank holds more than its own shards. Loading
 * reads the index, and each rank reads (pread) only the byte ranges of the
 * rows it owns now, from whichever files hold them: a checkpoint saved on
 * W ranks loads on any W' and on another mesh (HSDP 2x2 to a 1-d mesh of
 * 2, 4 ranks to 3, 1 to 4, uneven chunks both ways).
 *
 * Keys: parameters and buffers under their FQNs, unchanged by
 * fully_shard ("layers.0.linear1.weight"); optimizer state as torch's
 * get_optimizer_state_dict flattens it: "optim.state.<fqn>.exp_avg",
 * "optim.state.<fqn>.exp_avg_sq", "optim.state.<fqn>.step" (0-d float32),
 * "optim.state.<fqn>.momentum_buffer", "optim.state.<fqn>.max_exp_avg_sq",
 * sharded like the parameter they belong to; extras under
 * "extra.<name>" (replicated) and "rank_extra.<name>" (one per rank).
 *
 * Atomicity: files first, index last. Every file is written under a name
 * unique to this save, fsync'ed; rank 0 then writes the index to a
 * temporary name, fsyncs it, renames it over "index.json" and fsyncs the
 * folder; files no index names any more are removed after that. A crash at
 * any point leaves the previous checkpoint in the folder loadable.
 *
 * Collective: every rank of the model's mesh (the world) calls save and
 * load with the same folder, on a file system every rank sees (the local
 * disk for one host). Threads: one at a time per model.
 */
#ifndef TS_CHECKPOINT_H
#define TS_CHECKPOINT_H

#include "base/base.h"
#include "fully_shard/fully_shard.h"
#include "nn/nn.h"
#include "optim/optim.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One metadata pair (a model's configuration, a tokenizer's name): a
 * key and its value, both NUL-terminated UTF-8 strings, borrowed for the
 * call. An array of them with its length is what ts_ckpt_options and
 * ts_ckpt_save_full take:
 *   ts_ckpt_meta meta[] = {{"n_layer", "12"}, {"vocab", "gpt2"}};
 *   o.metadata = meta; o.n_metadata = sizeof meta / sizeof meta[0];
 * or, safer (a count that is wrong cannot be checked, and reading past
 * the array is undefined), ended by a {NULL, NULL} pair with the count
 * TS_CKPT_META_END:
 *   ts_ckpt_meta meta[] = {{"n_layer", "12"}, {"vocab", "gpt2"}, {NULL, NULL}};
 *   o.metadata = meta; o.n_metadata = TS_CKPT_META_END;
 * (at most TS_CKPT_META_MAX pairs before the end). A NULL key or value
 * (before the end), an empty key, a key given twice or a string that
 * is not UTF-8 is TS_ERR_INVALID_ARGUMENT naming the pair's index; for
 * ts_ckpt_save and ts_ckpt_load the key "ts_ckpt" is reserved (the
 * checkpoint's own record in every file). */
#define TS_CKPT_META_END (-1)
#define TS_CKPT_META_MAX 65536
typedef struct ts_ckpt_meta {
    const char *key;
    const char *value;
} ts_ckpt_meta;

typedef struct ts_ckpt_options {
    /* The optimizer over the model's parameters (after fully_shard): its
     * state is saved and loaded with the model, keyed by parameter FQN.
     * NULL: the model only. Loading into an optimizer of another kind than
     * the one saved (SGD into AdamW) is TS_ERR_INVALID_ARGUMENT naming
     * both; its hyperparameters are recorded in the index ("optim":
     * "param_groups": [{"lr", "betas", "eps", "weight_decay", ...}], as
     * torch's state dict names them; lr the current one) and not checked
     * or restored (a resumed run may change them). Its step count is
     * saved and restored. */
    ts_optim *optim;
    /* Tensors every rank holds with equal values (a step counter, the data
     * generator's state): saved once, loaded on every rank. On load, the
     * dict's tensors are filled in place (shape and dtype must match). */
    const ts_state_dict *extra;
    /* Tensors of this rank only (its RNG state): every rank saves its own.
     * On load they are filled when the checkpoint was saved by the same
     * world size, and left as they are otherwise (ts_ckpt_info says which). */
    const ts_state_dict *rank_extra;
    /* n_metadata key/value pairs (ts_ckpt_meta; NULL with 0; or
     * TS_CKPT_META_END for a list ended by {NULL, NULL}), recorded in
     * the index (read back with ts_ckpt_metadata) and in every file's
     * safetensors __metadata__. */
    const ts_ckpt_meta *metadata;
    int n_metadata;
    /* Load only: every key of the model (and of the optimizer, and the
     * extras) must be in the checkpoint, and every model key of the
     * checkpoint in the model (default true). */
    bool strict;
} ts_ckpt_options;

/* No optimizer, no extras, no metadata, strict. */
TS_API ts_ckpt_options ts_ckpt_options_default(void);

/* What a load found. */
typedef struct ts_ckpt_info {
    int saved_world;        /* ranks that saved it */
    int loaded_world;       /* ranks that loaded it */
    bool rank_extra_loaded; /* saved_world == loaded_world: rank extras were filled */
    int64_t optim_steps;    /* the optimizer's step count at save (0 without one) */
    uint64_t bytes_read;    /* tensor bytes this rank read from the files: the rows it owns and the
                               replicated tensors (file headers and the index not counted) */
} ts_ckpt_info;

/* Saves model (a module tree, sharded with fully_shard or not; one-rank
 * trees too) and the options' optimizer and extras (options NULL: the
 * defaults, the model only) into folder dir
 * (created if missing, mode 0777 under the umask). Collective. On any
 * rank's failure every rank returns the error and the previous checkpoint
 * in dir stays loadable. Errors: TS_ERR_INVALID_ARGUMENT for NULL
 * arguments, an optimizer holding a tensor that is not one of the model's
 * parameters, or two extras with one name; TS_ERR_STATE inside a forward
 * or backward, or when another save into dir is under way (rank 0 holds
 * an exclusive flock on the folder for the whole save: overlapping saves
 * into one folder would remove each other's files); TS_ERR_IO naming the
 * path and the system error; TS_ERR_NO_MEMORY; collective errors. */
TS_API ts_status ts_ckpt_save(const char *dir, ts_module *model, const ts_ckpt_options *options);

/* Loads dir into model (and the options' optimizer and extras; options
 * NULL: the defaults), in place:
 * each rank reads the rows its shards own now, whatever the world size and
 * mesh that saved it. Collective. Nothing is changed on error. Errors:
 * TS_ERR_IO (dir or a file missing or unreadable, naming the path);
 * TS_ERR_FORMAT (an index or a file malformed, truncated or not agreeing
 * with each other, or a piece read whole whose bytes do not match the
 * checksum the index records, naming the file and what is wrong); TS_ERR_SHAPE and
 * TS_ERR_DTYPE naming the key with both shapes or dtypes;
 * TS_ERR_NOT_FOUND (strict) with the missing and unexpected keys;
 * TS_ERR_INVALID_ARGUMENT as for save and for an optimizer of another
 * kind; TS_ERR_STATE inside a forward or backward; collective errors.
 * info_out (may be NULL) is written on success. */
TS_API ts_status ts_ckpt_load(const char *dir, ts_module *model, const ts_ckpt_options *options,
                              ts_ckpt_info *info_out);

/* The value of metadata key `key` in dir's index, as a new string (free
 * it with free()); for reading a model's configuration before building
 * it. Not collective. TS_ERR_NOT_FOUND names the key; TS_ERR_IO,
 * TS_ERR_FORMAT as ts_ckpt_load. */
TS_API ts_status ts_ckpt_metadata(const char *dir, const char *key, char **value_out);

/* Writes the full (unsharded) model to one safetensors file (torch's
 * get_model_state_dict(full_state_dict=True) saved with safetensors):
 * one tensor at a time is all-gathered and handed to rank 0, which
 * streams it into the file (peak extra memory: the largest tensor, on
 * rank 0 only). The file is written atomically as ts_safetensors_save
 * writes it (mode 0644 under the umask at most), with the n_metadata
 * pairs of `metadata` (ts_ckpt_meta; NULL with 0; TS_CKPT_META_END for
 * a list ended by {NULL, NULL}) in __metadata__; they
 * are checked on every rank before anything is communicated or written.
 * Collective. Errors as ts_ckpt_save, and TS_ERR_INVALID_ARGUMENT for
 * metadata as ts_ckpt_meta describes. */
TS_API ts_status ts_ckpt_save_full(const char *path, ts_module *model, const ts_ckpt_meta *metadata, int n_metadata);

/* Loads a full safetensors file (ts_ckpt_save_full's, ts_safetensors_save's
 * or PyTorch's) into a sharded model: the header is read once, then for
 * each parameter and buffer this rank reads only the rows it owns (pread),
 * one tensor at a time (peak extra memory: one tensor's local rows, never
 * the model; PyTorch's pytorch#149640). strict, and the errors, as
 * ts_fsdp_load_full_state_dict, plus TS_ERR_IO and TS_ERR_FORMAT as
 * ts_safetensors_load. Collective only in that every rank must call it
 * (no communication). */
TS_API ts_status ts_ckpt_load_full(const char *path, ts_module *model, bool strict);

/* ------------------------------------------------------------ Hugging Face GPT-2
 * (checkpoint/hf_gpt2.c; docs/gpt2-weights.md) A GPT-2 safetensors file
 * of Hugging Face's naming (GPT2Model's "wte.weight", "h.N.attn.c_attn.weight",
 * ..., or GPT2LMHeadModel's with "transformer." before each and maybe
 * "lm_head.weight") into and out of a GPT of ts_gpt_new: Conv1D weights
 * (stored (in, out)) are transposed to Linear's (out, in); c_attn's fused
 * q, k, v columns become MultiheadAttention's packed in_proj rows. */

/* The config of the GPT a file holds, from its tensors' shapes: vocab and
 * d_model from wte, block_size from wpe (n_positions), n_layer from the
 * blocks h.0, h.1, ... present, n_head = d_model / 64 (GPT-2's head size
 * in every published size: the head count is not in the weights; 0 when
 * d_model is not a multiple of 64: set it), tie_weights unless the file
 * has an lm_head.weight, gelu_approx TS_GELU_TANH, dropout 0. Reads only
 * the header. Errors: TS_ERR_IO (the file cannot be opened or read,
 * naming it), TS_ERR_FORMAT (not a valid safetensors file),
 * TS_ERR_NOT_FOUND (no wte.weight: not a GPT-2 file), TS_ERR_SHAPE (wte
 * or wpe not 2-d, or their widths differ), TS_ERR_INVALID_ARGUMENT for
 * NULL. Any thread. */
TS_API ts_status ts_ckpt_gpt2_config(const char *path, ts_gpt_config *cfg_out);

/* Loads an HF GPT-2 file into model, a GPT of ts_gpt_new with
 * gelu_approx TS_GELU_TANH and float32 parameters: plain, sharded with
 * ts_fully_shard (each rank keeps its rows), or deferred (built on the
 * meta device, sharded or not: it gets its bytes here, no initializer
 * runs). Every tensor's name, shape and dtype is checked against the
 * model's config before anything is changed; then each tensor is read and
 * copied in (ts_fsdp_load_full_state_dict), one at a time (peak extra
 * memory: one tensor, twice when transposed). A tied model takes
 * lm_head from wte (an lm_head.weight in the file must then be wte's
 * bits); an untied one takes the file's lm_head.weight, or wte when the
 * file has none (HF ties them). The attention buffers h.N.attn.bias and
 * h.N.attn.masked_bias are ignored. Errors, nothing changed: TS_ERR_IO,
 * TS_ERR_FORMAT as ts_safetensors_load; TS_ERR_SHAPE naming each tensor
 * whose shape is not the model's (the file's shape, the expected one, and
 * the file's sizes); TS_ERR_DTYPE naming each tensor that is not F32;
 * TS_ERR_NOT_FOUND listing the missing tensors and those the model has
 * no place for (another layer count); TS_ERR_INVALID_ARGUMENT for NULL, a
 * model that is not a GPT, an erf GELU, a tied model with a different
 * lm_head.weight in the file; TS_ERR_STATE inside a forward or backward.
 * A read failing after the checks (the file changed or an I/O error)
 * leaves the tensors before it loaded. Every rank calls it (no
 * communication). */
TS_API ts_status ts_ckpt_load_hf_gpt2(const char *path, ts_module *model);

/* Writes model (a GPT as ts_ckpt_load_hf_gpt2 takes; sharded or not, not
 * meta) as an HF GPT-2 file: float32, HF's names and layouts, sorted by
 * name as the Rust safetensors writer sorts them, metadata {"format":
 * "pt"}, written atomically as ts_safetensors_save. A tied model is
 * written with GPT2Model's names and no lm_head (the hub's gpt2 file);
 * an untied one with GPT2LMHeadModel's ("transformer." before each, and
 * lm_head.weight). A file loaded with ts_ckpt_load_hf_gpt2 and written
 * back is the same bytes when it was written so (no attention buffers,
 * that naming). Collective for a sharded model: the full model is
 * gathered on rank 0 (it holds it whole, once), which writes; every rank
 * returns rank 0's status. A plain model is written by rank 0 of the
 * world (the only rank without one). Errors: TS_ERR_IO as
 * ts_safetensors_save; TS_ERR_STATE for a model still on the meta device
 * or inside a forward or backward; TS_ERR_INVALID_ARGUMENT as the load;
 * collective errors. */
TS_API ts_status ts_ckpt_save_hf_gpt2(const char *path, ts_module *model);

#ifdef __cplusplus
}
#endif
#endif /* TS_CHECKPOINT_H */
