/* State dicts: an ordered name -> tensor map, and loading one into a
 * module with PyTorch's strict / non-strict rules. */
#define _GNU_SOURCE
#include "nn/internal.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <unistd.h>

#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

/* Entries in insertion order, and an open-addressing index over their
 * names (linear probing; a slot holds entry number + 1, 0 when empty; at
 * least twice as many slots as entries, a power of two), so that a lookup
 * costs O(1) name comparisons. Entries are never removed. */
struct ts_state_dict {
    char **names;
    ts_tensor **tensors;
    int n, cap;
    int *index;
    size_t nslots;
};

static _Atomic uint64_t g_compares;

uint64_t ts__state_dict_compares(void) { return g_compares; }

/* FNV-1a, 64 bits. */
static uint64_t name_hash(const char *s)
{
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

ts_status ts_state_dict_new(ts_state_dict **out)
{
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_state_dict_new: out is NULL");
    ts_state_dict *sd = ts__calloc(TS_MEM_NN, 1, sizeof *sd);
    if (!sd) return TS_ERR_NO_MEMORY;
    *out = sd;
    return TS_OK;
}

void ts_state_dict_free(ts_state_dict *sd)
{
    if (!sd) return;
    for (int i = 0; i < sd->n; i++) {
        ts__free(TS_MEM_NN, sd->names[i]);
        ts_tensor_free(sd->tensors[i]);
    }
    ts__free(TS_MEM_NN, sd->names);
    ts__free(TS_MEM_NN, sd->tensors);
    ts__free(TS_MEM_NN, sd->index);
    ts__free(TS_MEM_NN, sd);
}

/* The index slot that holds `name`, or the empty slot where it would go. */
static size_t find_slot(const ts_state_dict *sd, const char *name)
{
    size_t mask = sd->nslots - 1, k = (size_t)name_hash(name) & mask;
    uint64_t cmp = 0;
    while (sd->index[k]) {
        cmp++;
        if (strcmp(sd->names[sd->index[k] - 1], name) == 0) break;
        k = (k + 1) & mask;
    }
    g_compares += cmp;
    return k;
}

static int find(const ts_state_dict *sd, const char *name)
{
    if (!sd->nslots) return -1;
    return sd->index[find_slot(sd, name)] - 1;
}

/* Rebuilds the index with `nslots` slots (a power of two > sd->n). */
static ts_status reindex(ts_state_dict *sd, size_t nslots)
{
    int *idx = ts__calloc(TS_MEM_NN, nslots, sizeof *idx);
    if (!idx) return TS_ERR_NO_MEMORY;
    ts__free(TS_MEM_NN, sd->index);
    sd->index = idx;
    sd->nslots = nslots;
    for (int i = 0; i < sd->n; i++) idx[find_slot(sd, sd->names[i])] = i + 1;
    return TS_OK;
}

ts_status ts_state_dict_set(ts_state_dict *sd, const char *name, ts_tensor *t)
{
    if (!sd || !name || !t) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_state_dict_set: NULL argument");
    int i = find(sd, name);
    if (i >= 0) {
        ts_tensor_retain(t);
        ts_tensor_free(sd->tensors[i]);
        sd->tensors[i] = t;
        return TS_OK;
    }
    if (sd->n == sd->cap) {
        if (sd->cap > INT32_MAX / 4)
            return ts_error(TS_ERR_NO_MEMORY, "ts_state_dict_set: a state dict holds at most %d entries", sd->cap);
        int cap = sd->cap ? 2 * sd->cap : 16;
        void *names, *ts;
        if (ts__grow_pair(sd->names, sizeof *sd->names, sd->tensors, sizeof *sd->tensors, sd->n, cap, &names, &ts))
            return TS_ERR_NO_MEMORY;
        sd->names = names;
        sd->tensors = ts;
        int old_cap = sd->cap;
        sd->cap = cap;
        ts_status st = reindex(sd, 2 * (size_t)cap);
        if (st) {
            sd->cap = old_cap; /* the old index still covers the entries */
            return st;
        }
    }
    char *copy = ts__strdup(TS_MEM_NN, name);
    if (!copy) return TS_ERR_NO_MEMORY;
    sd->names[sd->n] = copy;
    sd->tensors[sd->n] = ts_tensor_retain(t);
    sd->n++;
    sd->index[find_slot(sd, copy)] = sd->n;
    return TS_OK;
}

ts_tensor *ts_state_dict_get(const ts_state_dict *sd, const char *name)
{
    int i = sd && name ? find(sd, name) : -1;
    return i >= 0 ? sd->tensors[i] : NULL;
}

int ts_state_dict_size(const ts_state_dict *sd) { return sd ? sd->n : 0; }
const char *ts_state_dict_name(const ts_state_dict *sd, int i)
{
    return sd && i >= 0 && i < sd->n ? sd->names[i] : NULL;
}
ts_tensor *ts_state_dict_tensor(const ts_state_dict *sd, int i)
{
    return sd && i >= 0 && i < sd->n ? sd->tensors[i] : NULL;
}

ts_status ts_module_state_dict(ts_module *m, ts_state_dict **out)
{
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_module_state_dict: out is NULL");
    ts_named_params p;
    ts_status st = ts__module_entries(m, true, true, false, &p);
    if (st) return st;
    ts_state_dict *sd;
    if ((st = ts_state_dict_new(&sd))) {
        ts_named_params_free(&p);
        return st;
    }
    for (int i = 0; i < p.n && !st; i++) {
        ts_tensor *d;
        if (!(st = ts_detach(*p.items[i].slot, &d))) {
            st = ts_state_dict_set(sd, p.items[i].name, d);
            ts_tensor_free(d);
        }
    }
    ts_named_params_free(&p);
    if (st) {
        ts_state_dict_free(sd);
        return st;
    }
    *out = sd;
    return TS_OK;
}

/* Appends ", name" to a bounded message buffer. */
static void append(char *buf, size_t cap, size_t *len, const char *name)
{
    if (*len >= cap) return;
    int n = snprintf(buf + *len, cap - *len, "%s'%s'", *len ? ", " : "", name);
    *len += n > 0 ? (size_t)n : 0;
}

ts_status ts_module_load_state_dict(ts_module *m, const ts_state_dict *sd, bool strict)
{
    if (!m || !sd) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_module_load_state_dict: NULL argument");
    ts_named_params p;
    ts_status st = ts__module_entries(m, true, true, false, &p);
    if (st) return st;
    /* the parameters by name, for the unexpected keys in O(1) each */
    ts_state_dict *known = NULL;
    if ((st = ts_state_dict_new(&known))) {
        ts_named_params_free(&p);
        return st;
    }
    for (int i = 0; i < p.n && !st; i++) st = ts_state_dict_set(known, p.items[i].name, *p.items[i].slot);
    if (st) {
        ts_state_dict_free(known);
        ts_named_params_free(&p);
        return st;
    }
    char missing[1024] = "", unexpected[1024] = "", shapes[1024] = "", dtypes[1024] = "";
    size_t lm = 0, lu = 0, ls = 0, ld = 0;
    int n_missing = 0, n_unexpected = 0, n_shape = 0, n_dtype = 0;
    for (int i = 0; i < p.n; i++) {
        ts_tensor *src = ts_state_dict_get(sd, p.items[i].name), *dst = *p.items[i].slot;
        if (!src) {
            n_missing++;
            append(missing, sizeof missing, &lm, p.items[i].name);
            continue;
        }
        int nd = ts_tensor_ndim(dst);
        bool same = ts_tensor_ndim(src) == nd &&
            memcmp(ts_tensor_shape(src), ts_tensor_shape(dst), (size_t)nd * sizeof(int64_t)) == 0;
        if (!same) {
            char s1[96], s2[96], line[300];
            snprintf(line, sizeof line, "%s: checkpoint %s vs model %s", p.items[i].name,
                     ts_tensor_shape_str(src, s1, sizeof s1), ts_tensor_shape_str(dst, s2, sizeof s2));
            n_shape++;
            append(shapes, sizeof shapes, &ls, line);
        }
        if (ts_tensor_dtype(src) != ts_tensor_dtype(dst)) {
            char line[300];
            snprintf(line, sizeof line, "%s: checkpoint %s vs model %s", p.items[i].name,
                     ts_dtype_name(ts_tensor_dtype(src)), ts_dtype_name(ts_tensor_dtype(dst)));
            n_dtype++;
            append(dtypes, sizeof dtypes, &ld, line);
        }
    }
    for (int i = 0; i < ts_state_dict_size(sd); i++) {
        const char *name = ts_state_dict_name(sd, i);
        if (!ts_state_dict_get(known, name)) {
            n_unexpected++;
            append(unexpected, sizeof unexpected, &lu, name);
        }
    }
    ts_state_dict_free(known);
    if (n_shape)
        st = ts_error(TS_ERR_SHAPE, "load_state_dict into %s: size mismatch for %d parameter%s: %s",
                      ts_module_type_name(m), n_shape, n_shape == 1 ? "" : "s", shapes);
    else if (n_dtype)
        st = ts_error(TS_ERR_DTYPE,
                      "load_state_dict into %s: dtype mismatch for %d parameter%s: %s (convert the checkpoint's "
                      "tensors with ts_to_dtype first)",
                      ts_module_type_name(m), n_dtype, n_dtype == 1 ? "" : "s", dtypes);
    else if (strict && (n_missing || n_unexpected))
        st = ts_error(TS_ERR_NOT_FOUND, "load_state_dict into %s: missing keys (%d): [%s]; unexpected keys (%d): [%s]",
                      ts_module_type_name(m), n_missing, missing, n_unexpected, unexpected);
    bool prev = ts_grad_mode_set(false);
    for (int i = 0; i < p.n && !st; i++) {
        ts_tensor *src = ts_state_dict_get(sd, p.items[i].name);
        if (!src) continue;
        ts_tensor *dst = *p.items[i].slot, *local;
        /* a shard slot is written through its local view (the caller
         * gives shard-shaped tensors; fully_shard checks the meaning) */
        if (!(st = ts_tensor_local_view(dst, &local))) {
            st = ts_tensor_copy_(local, src);
            ts_tensor_free(local);
        }
    }
    ts_grad_mode_set(prev);
    ts_named_params_free(&p);
    return st;
}

/* ------------------------------------------------------------ safetensors files
 * A state dict saved and loaded whole, through the format's writer and
 * header reader (safetensors/safetensors.h). */

/* Names and strings from a file are cut to this in messages. */
#define SD_NAME_MAX_SHOWN 200

static void st_warn_nonfinite(const char *op, const char *src, const char *name, const ts_tensor *t)
{
    ts_dtype dt = ts_tensor_dtype(t);
    if (!ts_dtype_is_float(dt) || !TS_LOG_ENABLED(TS_LOG_WARN)) return;
    int64_t n = ts_tensor_numel(t), bad = 0;
    const void *d = ts_tensor_data(t);
    for (int64_t i = 0; i < n; i++) {
        switch (dt) {
        case TS_F32: bad += !isfinite(((const float *)d)[i]); break;
        case TS_F64: bad += !isfinite(((const double *)d)[i]); break;
        case TS_BF16: bad += (((const uint16_t *)d)[i] & 0x7f80u) == 0x7f80u; break;
        case TS_F16: bad += (((const uint16_t *)d)[i] & 0x7c00u) == 0x7c00u; break;
        default: break;
        }
    }
    if (bad)
        ts_logf(TS_LOG_WARN, "%s: '%s': tensor '%.*s' holds %lld non-finite values (NaN or Inf) of %lld", op, src,
                SD_NAME_MAX_SHOWN, name, (long long)bad, (long long)n);
}

ts_status ts_safetensors_parse(const void *data, size_t len, ts_state_dict **out)
{
    static const char op[] = "ts_safetensors_parse", src[] = "<buffer>";
    if ((!data && len) || !out) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL argument", op);
    ts_safetensors_header h;
    ts_status st = ts_safetensors_header_parse(op, src, data, len, &h);
    if (st) return st;
    const unsigned char *buf = (const unsigned char *)data + h.data_start;
    ts_state_dict *sd;
    if ((st = ts_state_dict_new(&sd))) {
        ts_safetensors_header_fini(&h);
        return st;
    }
    for (size_t i = 0; i < h.n && !st; i++) {
        const ts_safetensors_entry *e = &h.entries[i];
        ts_tensor *t;
        if (!(st = ts_tensor_from_data(e->dtype, e->ndim, e->shape, buf + e->begin, &t))) {
            st_warn_nonfinite(op, src, e->name, t);
            st = ts_state_dict_set(sd, e->name, t);
            ts_tensor_free(t);
        }
    }
    ts_safetensors_header_fini(&h);
    if (st) {
        ts_state_dict_free(sd);
        return st;
    }
    *out = sd;
    return TS_OK;
}

static ts_status st_load_fd(const char *op, const char *path, int fd, ts_state_dict **out)
{
    ts_safetensors_header h;
    ts_status st = ts_safetensors_header_read(op, path, fd, &h);
    if (st) return st;
    uint64_t n = h.data_start - 8;
    ts_state_dict *sd;
    if ((st = ts_state_dict_new(&sd))) {
        ts_safetensors_header_fini(&h);
        return st;
    }
    for (size_t i = 0; i < h.n && !st; i++) {
        const ts_safetensors_entry *e = &h.entries[i];
        ts_tensor *t;
        /* CPU bytes to read into, even inside a meta device scope */
        if ((st = ts_tensor_new_cpu(false, e->dtype, e->ndim, e->shape, &t))) break;
        char what[SD_NAME_MAX_SHOWN + 32];
        snprintf(what, sizeof what, "tensor '%s'", e->name);
        if (e->end > e->begin)
            st = ts_safetensors_read_at(op, path, fd, ts_tensor_data(t), (size_t)(e->end - e->begin), 8 + n + e->begin,
                                        what);
        if (!st) {
            st_warn_nonfinite(op, path, e->name, t);
            st = ts_state_dict_set(sd, e->name, t);
        }
        ts_tensor_free(t);
    }
    ts_safetensors_header_fini(&h);
    if (st) {
        ts_state_dict_free(sd);
        return st;
    }
    *out = sd;
    return TS_OK;
}

ts_status ts_safetensors_load(const char *path, ts_state_dict **out)
{
    static const char op[] = "ts_safetensors_load";
    if (!path || !out) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL argument", op);
    /* O_NONBLOCK: a FIFO must not block the open until a writer comes (it
     * is then refused as not a regular file); regular files ignore it. */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return ts_error(TS_ERR_IO, "%s: cannot open '%s': %s", op, path, strerror(errno));
    ts_status st = st_load_fd(op, path, fd, out);
    close(fd);
    return st;
}

ts_status ts_safetensors_save(const char *path, const ts_state_dict *sd, const char *const *metadata, int n_meta)
{
    static const char op[] = "ts_safetensors_save";
    if (!path || !sd) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL argument", op);
    int n = ts_state_dict_size(sd);
    ts_safetensors_desc *descs = n ? ts__calloc(TS_MEM_NN, (size_t)n, sizeof *descs) : NULL;
    if (n && !descs) return TS_ERR_NO_MEMORY;
    for (int i = 0; i < n; i++) {
        ts_tensor *t = ts_state_dict_tensor(sd, i);
        descs[i] = (ts_safetensors_desc){ts_state_dict_name(sd, i), ts_tensor_dtype(t), ts_tensor_ndim(t),
                                         ts_tensor_shape(t), t};
    }
    ts_safetensors_writer *s = NULL;
    ts_status st = ts_safetensors_writer_open(op, path, n, descs, metadata, n_meta, &s);
    ts__free(TS_MEM_NN, descs);
    for (int i = 0; i < n && !st; i++) st = ts_safetensors_writer_put(s, ts_state_dict_tensor(sd, i));
    if (st) {
        ts_safetensors_writer_abort(s);
        return st;
    }
    return ts_safetensors_writer_commit(s);
}
