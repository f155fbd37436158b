/* State dicts: an ordered name -> tensor map, and loading one into a
 * module with PyTorch's strict / non-strict rules. */
#define _GNU_SOURCE
#include "nn/internal.h"

#include <stdio.h>
#include <string.h>

struct ts_state_dict {
    char **names;
    ts_tensor **tensors;
    int n, cap;
};

ts_status ts_state_dict_new(ts_state_dict **out)
{
    if (!out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_state_dict_new: out is NULL");
    ts_state_dict *sd = ts__calloc(TS_MEM_NN, 1, sizeof *sd);
    if (!sd)
        return TS_ERR_NO_MEMORY;
    *out = sd;
    return TS_OK;
}

void ts_state_dict_free(ts_state_dict *sd)
{
    if (!sd)
        return;
    for (int i = 0; i < sd->n; i++) {
        ts__free(TS_MEM_NN, sd->names[i]);
        ts_tensor_free(sd->tensors[i]);
    }
    ts__free(TS_MEM_NN, sd->names);
    ts__free(TS_MEM_NN, sd->tensors);
    ts__free(TS_MEM_NN, sd);
}

static int find(const ts_state_dict *sd, const char *name)
{
    for (int i = 0; i < sd->n; i++)
        if (strcmp(sd->names[i], name) == 0)
            return i;
    return -1;
}

ts_status ts_state_dict_set(ts_state_dict *sd, const char *name, ts_tensor *t)
{
    if (!sd || !name || !t)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_state_dict_set: NULL argument");
    int i = find(sd, name);
    if (i >= 0) {
        ts_tensor_retain(t);
        ts_tensor_free(sd->tensors[i]);
        sd->tensors[i] = t;
        return TS_OK;
    }
    if (sd->n == sd->cap) {
        int cap = sd->cap ? 2 * sd->cap : 16;
        char **names = ts__malloc(TS_MEM_NN, (size_t)cap * sizeof *names);
        ts_tensor **ts = ts__malloc(TS_MEM_NN, (size_t)cap * sizeof *ts);
        if (!names || !ts) {
            ts__free(TS_MEM_NN, names);
            ts__free(TS_MEM_NN, ts);
            return TS_ERR_NO_MEMORY;
        }
        if (sd->n) {
            memcpy(names, sd->names, (size_t)sd->n * sizeof *names);
            memcpy(ts, sd->tensors, (size_t)sd->n * sizeof *ts);
        }
        ts__free(TS_MEM_NN, sd->names);
        ts__free(TS_MEM_NN, sd->tensors);
        sd->names = names;
        sd->tensors = ts;
        sd->cap = cap;
    }
    char *copy = ts__strdup(TS_MEM_NN, name);
    if (!copy)
        return TS_ERR_NO_MEMORY;
    sd->names[sd->n] = copy;
    sd->tensors[sd->n] = ts_tensor_retain(t);
    sd->n++;
    return TS_OK;
}

ts_tensor *ts_state_dict_get(const ts_state_dict *sd, const char *name)
{
    int i = sd && name ? find(sd, name) : -1;
    return i >= 0 ? sd->tensors[i] : NULL;
}

int ts_state_dict_size(const ts_state_dict *sd) { return sd ? sd->n : 0; }
const char *ts_state_dict_name(const ts_state_dict *sd, int i) { return sd && i >= 0 && i < sd->n ? sd->names[i] : NULL; }
ts_tensor *ts_state_dict_tensor(const ts_state_dict *sd, int i)
{
    return sd && i >= 0 && i < sd->n ? sd->tensors[i] : NULL;
}

ts_status ts_module_state_dict(ts_module *m, ts_state_dict **out)
{
    if (!out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_module_state_dict: out is NULL");
    ts_named_params p;
    ts_status st = ts__module_entries(m, true, true, false, &p);
    if (st)
        return st;
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
    if (*len >= cap)
        return;
    int n = snprintf(buf + *len, cap - *len, "%s'%s'", *len ? ", " : "", name);
    *len += n > 0 ? (size_t)n : 0;
}

ts_status ts_module_load_state_dict(ts_module *m, const ts_state_dict *sd, bool strict)
{
    if (!m || !sd)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_module_load_state_dict: NULL argument");
    ts_named_params p;
    ts_status st = ts__module_entries(m, true, true, false, &p);
    if (st)
        return st;
    char missing[1024] = "", unexpected[1024] = "", shapes[1024] = "";
    size_t lm = 0, lu = 0, ls = 0;
    int n_missing = 0, n_unexpected = 0, n_shape = 0;
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
    }
    for (int i = 0; i < ts_state_dict_size(sd); i++) {
        const char *name = ts_state_dict_name(sd, i);
        bool known = false;
        for (int k = 0; k < p.n && !known; k++)
            known = strcmp(p.items[k].name, name) == 0;
        if (!known) {
            n_unexpected++;
            append(unexpected, sizeof unexpected, &lu, name);
        }
    }
    if (n_shape)
        st = ts_error(TS_ERR_SHAPE, "load_state_dict into %s: size mismatch for %d parameter%s: %s",
                      ts_module_type_name(m), n_shape, n_shape == 1 ? "" : "s", shapes);
    else if (strict && (n_missing || n_unexpected))
        st = ts_error(TS_ERR_NOT_FOUND, "load_state_dict into %s: missing keys (%d): [%s]; unexpected keys (%d): [%s]",
                      ts_module_type_name(m), n_missing, missing, n_unexpected, unexpected);
    bool prev = ts_grad_mode_set(false);
    for (int i = 0; i < p.n && !st; i++) {
        ts_tensor *src = ts_state_dict_get(sd, p.items[i].name);
        if (!src)
            continue;
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
