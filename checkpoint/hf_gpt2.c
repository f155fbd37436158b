/* Hugging Face GPT-2 weights (checkpoint/checkpoint.h; docs/gpt2-weights.md).
 *
 * Every tensor of an HF GPT-2 file is one tensor of our GPT (nn/gpt.c),
 * as it is or transposed: HF's Conv1D stores its weight (in, out), a
 * Linear (out, in), and c_attn's fused (d, 3d) weight transposed is
 * MultiheadAttention's packed in_proj_weight (3d, d), whose rows are q, k
 * and v in the order c_attn's columns are. So no tensor is split or
 * fused: the table below is the whole mapping.
 *
 * Load: the header is read and checked against the model's config
 * (names, shapes, dtypes) before anything is changed; then, one tensor at
 * a time, the file's bytes are read (pread), transposed where the table
 * says, and handed to ts_fsdp_load_full_state_dict as a one-entry state
 * dict: the loader every full checkpoint goes through, which copies each
 * rank's rows into a sharded model, fills a plain one, and materializes a
 * deferred (meta) model on the first tensor without running its
 * initializers. Peak extra memory: one full tensor (wte's, 154 MB for
 * GPT-2 small) and its transpose.
 *
 * Save: ts_fsdp_full_state_dict gathers the model on rank 0 (the whole
 * model, once, on that rank), which streams it out tensor by tensor in
 * HF's layout under HF's names, sorted by name as the Rust safetensors
 * writer sorts tensors of one dtype, with {"format": "pt"} as metadata:
 * the bytes save_pretrained would write. */
#define _GNU_SOURCE
#include "checkpoint/internal.h"

#include "comm/comm.h"
#include "fully_shard/fully_shard.h"
#include "mesh/mesh.h"
#include "safetensors/safetensors.h"
#include "tensor/tensor.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ------------------------------------------------------------ the mapping */

/* One tensor: our state-dict name, HF's (without "transformer."), whether
 * HF stores it transposed (Conv1D), and its HF shape in units of the
 * config (filled by hf_plan). */
typedef struct hf_item {
    char ours[96], hf[160];
    bool transpose;
    int ndim;
    int64_t shape[2]; /* HF's */
} hf_item;

/* Per block: ours, HF's, transposed, then the HF shape as multiples of d
 * (rows, cols; cols 0 for a vector). */
static const struct {
    const char *ours, *hf;
    bool transpose;
    int rows, cols;
} block_map[] = {
    {"ln1.weight", "ln_1.weight", false, 1, 0},
    {"ln1.bias", "ln_1.bias", false, 1, 0},
    {"attn.in_proj_weight", "attn.c_attn.weight", true, 1, 3},
    {"attn.in_proj_bias", "attn.c_attn.bias", false, 3, 0},
    {"attn.out_proj.weight", "attn.c_proj.weight", true, 1, 1},
    {"attn.out_proj.bias", "attn.c_proj.bias", false, 1, 0},
    {"ln2.weight", "ln_2.weight", false, 1, 0},
    {"ln2.bias", "ln_2.bias", false, 1, 0},
    {"mlp.0.weight", "mlp.c_fc.weight", true, 1, 4},
    {"mlp.0.bias", "mlp.c_fc.bias", false, 4, 0},
    {"mlp.2.weight", "mlp.c_proj.weight", true, 4, 1},
    {"mlp.2.bias", "mlp.c_proj.bias", false, 1, 0},
};
enum { BLOCK_MAP_N = sizeof block_map / sizeof block_map[0] };

static void item_set(hf_item *it, const char *ours, const char *prefix, const char *hf, bool transpose, int64_t r,
                     int64_t c)
{
    snprintf(it->ours, sizeof it->ours, "%s", ours);
    snprintf(it->hf, sizeof it->hf, "%s%s", prefix, hf);
    it->transpose = transpose;
    it->ndim = c ? 2 : 1;
    it->shape[0] = r;
    it->shape[1] = c;
}

/* The tensors of a GPT of config c, in our state dict's order, HF's names
 * with prefix before each but lm_head's; with_head adds lm_head.weight
 * (an untied model's). *out is the caller's (ts__free TS_MEM_OTHER). */
static ts_status hf_plan(const ts_gpt_config *c, bool with_head, const char *prefix, hf_item **out, int *n_out)
{
    int64_t d = c->d_model;
    int n = 4 + BLOCK_MAP_N * (int)c->n_layer + (with_head ? 1 : 0);
    hf_item *it = ts__calloc(TS_MEM_OTHER, (size_t)n, sizeof *it);
    if (!it) return TS_ERR_NO_MEMORY;
    int k = 0;
    item_set(&it[k++], "tok_emb.weight", prefix, "wte.weight", false, c->vocab_size, d);
    item_set(&it[k++], "pos_emb.weight", prefix, "wpe.weight", false, c->block_size, d);
    for (int64_t l = 0; l < c->n_layer; l++)
        for (int j = 0; j < BLOCK_MAP_N; j++) {
            char ours[96], hf[96];
            snprintf(ours, sizeof ours, "blocks.%lld.%s", (long long)l, block_map[j].ours);
            snprintf(hf, sizeof hf, "h.%lld.%s", (long long)l, block_map[j].hf);
            item_set(&it[k++], ours, prefix, hf, block_map[j].transpose, block_map[j].rows * d, block_map[j].cols * d);
        }
    item_set(&it[k++], "ln_f.weight", prefix, "ln_f.weight", false, d, 0);
    item_set(&it[k++], "ln_f.bias", prefix, "ln_f.bias", false, d, 0);
    if (with_head) item_set(&it[k++], "lm_head.weight", "", "lm_head.weight", false, c->vocab_size, d);
    *out = it;
    *n_out = k;
    return TS_OK;
}

/* ------------------------------------------------------------ the file */

#define HF_PREFIX "transformer."

static const ts_safetensors_entry *find_entry(const ts_safetensors_header *h, const char *prefix, const char *name)
{
    size_t pl = strlen(prefix);
    for (size_t i = 0; i < h->n; i++)
        if (!strncmp(h->entries[i].name, prefix, pl) && !strcmp(h->entries[i].name + pl, name)) return &h->entries[i];
    return NULL;
}

/* The file's naming: "" (GPT2Model's, the hub's gpt2 file) or
 * "transformer." (GPT2LMHeadModel's), from where wte.weight is. */
static ts_status file_prefix(const char *op, const char *path, const ts_safetensors_header *h, const char **prefix_out)
{
    if (find_entry(h, "", "wte.weight")) *prefix_out = "";
    else if (find_entry(h, "", HF_PREFIX "wte.weight")) *prefix_out = HF_PREFIX;
    else
        return ts_error(TS_ERR_NOT_FOUND,
                        "%s: '%s' is not a Hugging Face GPT-2 file: it has neither 'wte.weight' nor "
                        "'" HF_PREFIX "wte.weight' (%zu tensors%s%s%s)",
                        op, path, h->n, h->n ? ", the first '" : "", h->n ? h->entries[0].name : "", h->n ? "'" : "");
    return TS_OK;
}

/* The config a file describes (see ts_ckpt_gpt2_config). */
static ts_status file_config(const char *op, const char *path, const ts_safetensors_header *h, const char *prefix,
                             ts_gpt_config *out)
{
    char name[128], s[64];
    snprintf(name, sizeof name, "%swte.weight", prefix);
    const ts_safetensors_entry *wte = find_entry(h, "", name);
    snprintf(name, sizeof name, "%swpe.weight", prefix);
    const ts_safetensors_entry *wpe = find_entry(h, "", name);
    if (!wte || wte->ndim != 2 || wte->shape[0] < 1 || wte->shape[1] < 1)
        return ts_error(TS_ERR_SHAPE, "%s: '%s': '%swte.weight' must be (vocab, d_model), got %s", op, path, prefix,
                        wte ? ts_shape_str(wte->ndim, wte->shape, s, sizeof s) : "nothing");
    if (!wpe || wpe->ndim != 2 || wpe->shape[0] < 1 || wpe->shape[1] != wte->shape[1])
        return ts_error(wpe ? TS_ERR_SHAPE : TS_ERR_NOT_FOUND,
                        "%s: '%s': '%swpe.weight' must be (n_positions, %lld), got %s", op, path, prefix,
                        (long long)wte->shape[1], wpe ? ts_shape_str(wpe->ndim, wpe->shape, s, sizeof s) : "nothing");
    ts_gpt_config c = ts_gpt_config_default();
    c.vocab_size = wte->shape[0];
    c.d_model = wte->shape[1];
    c.block_size = wpe->shape[0];
    c.n_layer = 0;
    for (;; c.n_layer++) {
        snprintf(name, sizeof name, "%sh.%lld.ln_1.weight", prefix, (long long)c.n_layer);
        if (!find_entry(h, "", name)) break;
    }
    /* every published GPT-2 (small, medium, large, xl, distilgpt2) has
     * heads of 64: the head count is in config.json, not in the weights */
    c.n_head = c.d_model % 64 == 0 ? c.d_model / 64 : 0;
    c.dropout = 0.0;
    snprintf(name, sizeof name, "%slm_head.weight", prefix);
    c.tie_weights = find_entry(h, "", name) == NULL && find_entry(h, "", "lm_head.weight") == NULL;
    c.gelu_approx = TS_GELU_TANH;
    *out = c;
    return TS_OK;
}

static ts_status open_header(const char *op, const char *path, int *fd_out, ts_safetensors_header *h)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return ts_error(TS_ERR_IO, "%s: cannot open '%s': %s", op, path, strerror(errno));
    ts_status st = ts_safetensors_header_read(op, path, fd, h);
    if (st) {
        close(fd);
        return st;
    }
    *fd_out = fd;
    return TS_OK;
}

ts_status ts_ckpt_gpt2_config(const char *path, ts_gpt_config *cfg_out)
{
    static const char op[] = "ts_ckpt_gpt2_config";
    if (!path || !cfg_out) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL argument", op);
    int fd = -1;
    ts_safetensors_header h = {0};
    ts_status st = open_header(op, path, &fd, &h);
    if (st) return st;
    const char *prefix = "";
    ts_gpt_config c;
    if (!(st = file_prefix(op, path, &h, &prefix))) st = file_config(op, path, &h, prefix, &c);
    ts_safetensors_header_fini(&h);
    close(fd);
    if (!st) *cfg_out = c;
    return st;
}

/* ------------------------------------------------------------ load */

/* appends printf-style text to buf (cap bytes), "..." once it is full */
static void TS_PRINTF(3, 4) append(char *buf, size_t cap, const char *fmt, ...)
{
    size_t n = strlen(buf);
    if (n + 4 >= cap) return;
    va_list ap;
    va_start(ap, fmt);
    int w = vsnprintf(buf + n, cap - n, fmt, ap);
    va_end(ap);
    if (w < 0 || (size_t)w >= cap - n) snprintf(buf + cap - 4, 4, "...");
}

/* The file's tensor e as a new float32 CPU tensor of our layout. */
static ts_status read_tensor(const char *op, const char *path, int fd, const ts_safetensors_header *h,
                             const ts_safetensors_entry *e, bool transpose, ts_tensor **out)
{
    ts_tensor *t = NULL, *tt = NULL;
    ts_status st = ts_tensor_new_cpu(false, e->dtype, e->ndim, e->shape, &t);
    if (!st && e->end > e->begin)
        st = ts_safetensors_read_at(op, path, fd, ts_tensor_data(t), (size_t)(e->end - e->begin),
                                    h->data_start + e->begin, e->name);
    if (!st && transpose) {
        ts_tensor *view = NULL;
        if (!(st = ts_transpose(t, 0, 1, &view))) st = ts_contiguous(view, &tt);
        ts_tensor_free(view);
        ts_tensor_free(t);
        t = tt;
    }
    if (st) {
        ts_tensor_free(t);
        return st;
    }
    *out = t;
    return TS_OK;
}

/* ts_fsdp_load_full_state_dict of one tensor under our name */
static ts_status load_one(ts_module *model, const char *name, ts_tensor *t)
{
    ts_state_dict *sd = NULL;
    ts_status st = ts_state_dict_new(&sd);
    if (!st) st = ts_state_dict_set(sd, name, t);
    if (!st) st = ts_fsdp_load_full_state_dict(model, sd, false);
    ts_state_dict_free(sd);
    return st;
}

/* A tied model with a file that has its own lm_head.weight: it must be
 * wte's bits, or the model cannot hold both. */
static ts_status check_tied_head(const char *op, const char *path, int fd, const ts_safetensors_header *h,
                                 const ts_safetensors_entry *wte, const ts_safetensors_entry *head)
{
    ts_tensor *a = NULL, *b = NULL;
    ts_status st = read_tensor(op, path, fd, h, wte, false, &a);
    if (!st) st = read_tensor(op, path, fd, h, head, false, &b);
    if (!st &&
        (head->dtype != wte->dtype || head->ndim != wte->ndim ||
         memcmp(head->shape, wte->shape, sizeof head->shape) != 0 ||
         memcmp(ts_tensor_data(a), ts_tensor_data(b), (size_t)(wte->end - wte->begin)) != 0))
        st = ts_error(TS_ERR_INVALID_ARGUMENT,
                      "%s: '%s': '%s' differs from '%s' but the model ties lm_head to the token embedding: build it "
                      "with tie_weights false to load both",
                      op, path, head->name, wte->name);
    ts_tensor_free(a);
    ts_tensor_free(b);
    return st;
}

/* The model's config, refused when it cannot compute HF's GPT-2. */
static ts_status model_config(const char *op, ts_module *model, ts_gpt_config *out)
{
    if (!ts_gpt_get_config(model, out))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: the model is a %s, not a GPT of ts_gpt_new", op,
                        ts_module_type_name(model));
    if (out->gelu_approx != TS_GELU_TANH)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "%s: the model's GELU is erf's (gelu_approx TS_GELU_NONE) and GPT-2's is the tanh "
                        "approximation: build it with gelu_approx = TS_GELU_TANH (ts_ckpt_gpt2_config gives the "
                        "file's config)",
                        op);
    return TS_OK;
}

ts_status ts_ckpt_load_hf_gpt2(const char *path, ts_module *model)
{
    static const char op[] = "ts_ckpt_load_hf_gpt2";
    if (!path || !model) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL argument", op);
    ts_gpt_config mc;
    ts_status st = model_config(op, model, &mc);
    if (st) return st;
    int fd = -1;
    ts_safetensors_header h = {0};
    if ((st = open_header(op, path, &fd, &h))) return st;
    const char *prefix = "";
    ts_gpt_config fc = {0};
    hf_item *items = NULL;
    const ts_safetensors_entry **found = NULL;
    int n = 0;
    if (!(st = file_prefix(op, path, &h, &prefix))) st = file_config(op, path, &h, prefix, &fc);
    if (!st) st = hf_plan(&mc, !mc.tie_weights, prefix, &items, &n);
    if (!st && !(found = ts__calloc(TS_MEM_OTHER, (size_t)n, sizeof *found))) st = TS_ERR_NO_MEMORY;
    char shapes[1024] = "", dtypes[1024] = "", missing[1024] = "", unexpected[1024] = "", fdesc[160] = "";
    if (!st)
        snprintf(fdesc, sizeof fdesc, "the file has vocab %lld, n_positions %lld, d_model %lld, %lld layers",
                 (long long)fc.vocab_size, (long long)fc.block_size, (long long)fc.d_model, (long long)fc.n_layer);
    const ts_safetensors_entry *wte = NULL, *head = NULL;
    for (int i = 0; i < n && !st; i++) {
        hf_item *it = &items[i];
        const ts_safetensors_entry *e = find_entry(&h, "", it->hf);
        /* an untied model without lm_head in the file: HF ties it to wte */
        if (!e && !strcmp(it->ours, "lm_head.weight")) e = find_entry(&h, prefix, "wte.weight");
        if (!e) {
            append(missing, sizeof missing, " '%s'", it->hf);
            continue;
        }
        char a[64], b[64];
        if (e->ndim != it->ndim || memcmp(e->shape, it->shape, (size_t)it->ndim * sizeof(int64_t)) != 0)
            append(shapes, sizeof shapes, " '%s' is %s in the file, the model expects %s;", e->name,
                   ts_shape_str(e->ndim, e->shape, a, sizeof a), ts_shape_str(it->ndim, it->shape, b, sizeof b));
        else if (e->dtype != TS_F32)
            append(dtypes, sizeof dtypes, " '%s' is %s;", e->name, ts_safetensors_dtype_name(e->dtype));
        else found[i] = e;
        if (i == 0) wte = e;
    }
    /* the file's tensors the model has no place for: all but the attention
     * buffers (h.N.attn.bias, h.N.attn.masked_bias) and a tied head */
    for (size_t k = 0; k < h.n && !st; k++) {
        const char *nm = h.entries[k].name;
        bool used = false;
        for (int i = 0; i < n && !used; i++) used = found[i] == &h.entries[k];
        if (used) continue;
        const char *rest = !strncmp(nm, prefix, strlen(prefix)) ? nm + strlen(prefix) : nm;
        long long l = -1;
        int pos = 0;
        bool buffer = sscanf(rest, "h.%lld.attn.%n", &l, &pos) == 1 && pos > 0 && l >= 0 && l < mc.n_layer &&
            (!strcmp(rest + pos, "bias") || !strcmp(rest + pos, "masked_bias"));
        if (buffer) continue;
        if (!strcmp(nm, "lm_head.weight") || !strcmp(rest, "lm_head.weight")) {
            if (mc.tie_weights) head = &h.entries[k];
            continue;
        }
        bool mapped = false; /* a mapped tensor refused above for its shape or dtype */
        for (int i = 0; i < n && !mapped; i++) mapped = !strcmp(items[i].hf, nm);
        if (!mapped) append(unexpected, sizeof unexpected, " '%s'", nm);
    }
    if (!st && *shapes) st = ts_error(TS_ERR_SHAPE, "%s: '%s' (%s) does not fit the model:%s", op, path, fdesc, shapes);
    if (!st && *dtypes)
        st = ts_error(TS_ERR_DTYPE, "%s: '%s': the model loads float32 (F32) tensors:%s convert the file first", op,
                      path, dtypes);
    if (!st && (*missing || *unexpected))
        st = ts_error(TS_ERR_NOT_FOUND,
                      "%s: '%s' (%s; the model has %lld layers): missing tensors:%s; unexpected "
                      "tensors:%s",
                      op, path, fdesc, (long long)mc.n_layer, *missing ? missing : " none",
                      *unexpected ? unexpected : " none");
    if (!st && head && wte) st = check_tied_head(op, path, fd, &h, wte, head);
    /* everything checked: one tensor at a time into the model */
    for (int i = 0; i < n && !st; i++) {
        ts_tensor *t = NULL;
        if (!(st = read_tensor(op, path, fd, &h, found[i], items[i].transpose, &t))) {
            st = load_one(model, items[i].ours, t);
            if (st)
                st = ts_error(st, "%s: '%s': loading '%s' into '%s': %s", op, path, found[i]->name, items[i].ours,
                              ts_last_error());
        }
        ts_tensor_free(t);
    }
    ts__free(TS_MEM_OTHER, found);
    ts__free(TS_MEM_OTHER, items);
    ts_safetensors_header_fini(&h);
    close(fd);
    return st;
}

/* ------------------------------------------------------------ save */

static int cmp_hf_name(const void *a, const void *b)
{
    return strcmp(((const hf_item *)a)->hf, ((const hf_item *)b)->hf);
}

/* Every rank gets the worst status (the lowest ts_status) over the world. */
static ts_status agree(const char *op, ts_comm *world, ts_status mine)
{
    if (!world || ts_comm_size(world) <= 1) return mine;
    int64_t one = 1;
    ts_tensor *t = NULL;
    ts_status st = ts_tensor_new_cpu(true, TS_I64, 1, &one, &t);
    if (st) return st;
    ((int64_t *)ts_tensor_data(t))[0] = -(int64_t)mine;
    st = ts_all_reduce(world, t, TS_REDUCE_MAX, NULL);
    ts_status agreed = st ? st : (ts_status)(-((int64_t *)ts_tensor_data(t))[0]);
    ts_tensor_free(t);
    if (st || agreed == mine) return agreed;
    return ts_error(agreed, "%s: rank 0 failed with %s (its message is in its log and ts_last_error)", op,
                    ts_status_name(agreed));
}

/* Rank 0's part: the gathered dict sd written in HF's layout. */
static ts_status write_file(const char *op, const char *path, const ts_gpt_config *c, const ts_state_dict *sd)
{
    hf_item *items = NULL;
    int n = 0;
    /* untied: GPT2LMHeadModel's names; tied: GPT2Model's (the hub's gpt2) */
    ts_status st = hf_plan(c, !c->tie_weights, c->tie_weights ? "" : HF_PREFIX, &items, &n);
    if (st) return st;
    qsort(items, (size_t)n, sizeof *items, cmp_hf_name);
    ts_safetensors_desc *descs = ts__calloc(TS_MEM_OTHER, (size_t)n, sizeof *descs);
    if (!descs) st = TS_ERR_NO_MEMORY;
    for (int i = 0; i < n && !st; i++) {
        descs[i] = (ts_safetensors_desc){items[i].hf, TS_F32, items[i].ndim, items[i].shape, NULL};
        if (!ts_state_dict_get(sd, items[i].ours))
            st = ts_error(TS_ERR_NOT_FOUND, "%s: the model has no '%s' (for '%s')", op, items[i].ours, items[i].hf);
    }
    static const char *const meta[2] = {"format", "pt"};
    ts_safetensors_writer *s = NULL;
    if (!st) st = ts_safetensors_writer_open(op, path, n, descs, meta, 1, &s);
    for (int i = 0; i < n && !st; i++) {
        ts_tensor *src = ts_state_dict_get(sd, items[i].ours), *f = NULL, *view = NULL, *out = NULL;
        if (ts_tensor_dtype(src) != TS_F32) st = ts_to_dtype(src, TS_F32, &f);
        else f = ts_tensor_retain(src);
        if (!st && items[i].transpose) {
            if (!(st = ts_transpose(f, 0, 1, &view))) st = ts_contiguous(view, &out);
        } else if (!st) {
            st = ts_contiguous(f, &out);
        }
        if (!st) st = ts_safetensors_writer_put(s, out);
        ts_tensor_free(f);
        ts_tensor_free(view);
        ts_tensor_free(out);
    }
    if (s) {
        if (st) ts_safetensors_writer_abort(s);
        else st = ts_safetensors_writer_commit(s);
    }
    ts__free(TS_MEM_OTHER, descs);
    ts__free(TS_MEM_OTHER, items);
    return st;
}

/* ts_module_named_modules: *ctx (bool) true once an FSDP module is seen. */
static ts_status any_fsdp(void *ctx, const char *fqn, ts_module *m)
{
    (void)fqn;
    if (ts_module_is_fsdp(m)) *(bool *)ctx = true;
    return TS_OK;
}

ts_status ts_ckpt_save_hf_gpt2(const char *path, ts_module *model)
{
    static const char op[] = "ts_ckpt_save_hf_gpt2";
    if (!path || !model) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL argument", op);
    ts_gpt_config c;
    ts_status st = model_config(op, model, &c);
    if (st) return st;
    bool idle = false, sharded = false;
    if ((st = ts_fsdp_is_idle(model, &idle))) return st;
    if (!idle) return ts_error(TS_ERR_STATE, "%s: not inside a forward or backward", op);
    ts_comm *world = NULL;
    if ((st = ts_fsdp_world(model, &world))) return st;
    if ((st = ts_module_named_modules(model, any_fsdp, &sharded))) return st;
    int rank = world ? ts_comm_rank(world) : 0;
    /* sharded: rank 0 gets the gathered model; plain: every rank has it */
    ts_state_dict *sd = NULL;
    if ((st = ts_fsdp_full_state_dict(model, sharded, &sd))) return st;
    ts_status wst = TS_OK;
    bool prev = ts_grad_mode_set(false);
    if (rank == 0) wst = write_file(op, path, &c, sd);
    ts_grad_mode_set(prev);
    ts_state_dict_free(sd);
    return sharded ? agree(op, world, wst) : wst;
}
