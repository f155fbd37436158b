/*
 * Full state dicts of FSDP models (fully_shard.h): saving gathers every
 * group's parameters whole (on every rank, or rank 0 only), loading copies
 * each rank's rows of a full tensor into its shard; and
 * ts_fsdp_clip_grad_norm over the sharded gradients.
 */
#include "fully_shard/internal.h"

#include "comm/comm.h"
#include "nn/internal.h"
#include "tensor/internal.h"

#include <math.h>
#include <string.h>

/* The group parameter whose S or U is t, or NULL. */
/* ------------------------------------------------------------------ */
/* State dicts                                                        */
/* ------------------------------------------------------------------ */

fsdp_param *ts__fsdp_find_param(groups_walk *w, const ts_tensor *t, fsdp_group **g_out)
{
    for (int i = 0; i < w->n; i++)
        for (int k = 0; k < w->g[i]->n; k++) {
            fsdp_param *p = &w->g[i]->params[k];
            if (p->S == t || p->U == t) {
                if (g_out) *g_out = w->g[i];
                return p;
            }
        }
    return NULL;
}

ts_status ts_fsdp_full_state_dict(ts_module *module, bool rank0_only, ts_state_dict **out)
{
    if (!module || !out) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_fsdp_full_state_dict: NULL argument");
    groups_walk w;
    ts_status st = ts__fsdp_idle_groups("ts_fsdp_full_state_dict", module, &w);
    if (st) return st;
    bool keep = true;
    if (rank0_only)
        keep = w.n ? ts_comm_rank(w.g[0]->pg) == 0 && (!w.g[0]->rg || ts_comm_rank(w.g[0]->rg) == 0)
                   : ts_comm_rank(ts_dist_world()) == 0;
    ts_named_params np = {0};
    ts_state_dict *sd = NULL;
    ts_tensor **full = NULL; /* per group param, flattened over groups */
    int total = 0;
    for (int i = 0; i < w.n; i++) total += w.g[i]->n;
    if ((st = ts_state_dict_new(&sd))) goto done;
    if (total && !(full = ts__calloc(TS_MEM_NN, (size_t)total, sizeof *full))) {
        st = TS_ERR_NO_MEMORY;
        goto done;
    }
    /* gather every group (collective, same order on every rank) */
    for (int i = 0, at = 0; i < w.n && !st; at += w.g[i]->n, i++) {
        fsdp_group *g = w.g[i];
        if (g->udtype != g->dtype) { /* the unsharded parameters are in param_dtype: gather the masters */
            st = ts__fsdp_gather_full(g, keep, &full[at]);
            continue;
        }
        bool was_sharded = g->sharded_state == FSDP_SHARDED;
        if ((st = ts__fsdp_unshard(g)) || (st = ts__fsdp_wait_unshard(g))) break;
        for (int k = 0; k < g->n && !st && keep; k++)
            st = ts_tensor_from_data(g->dtype, g->params[k].ndim, g->params[k].shape, ts_tensor_data(g->params[k].U),
                                     &full[at + k]);
        if (was_sharded) {
            ts_status s2 = ts__fsdp_reshard(g);
            if (!st) st = s2;
        }
    }
    if (st || !keep) goto done;
    if ((st = ts__module_entries(module, true, true, false, &np))) goto done; /* buffers: whole, replicated */
    for (int i = 0; i < np.n && !st; i++) {
        ts_tensor *t = *np.items[i].slot;
        fsdp_group *g = NULL;
        fsdp_param *p = ts__fsdp_find_param(&w, t, &g);
        if (p) {
            int at = 0;
            for (int j = 0; w.g[j] != g; j++) at += w.g[j]->n;
            st = ts_state_dict_set(sd, np.items[i].name, full[at + (int)(p - g->params)]);
        } else {
            ts_tensor *d = NULL;
            if (!(st = ts_detach(t, &d))) {
                st = ts_state_dict_set(sd, np.items[i].name, d);
                ts_tensor_free(d);
            }
        }
    }
done:
    for (int i = 0; i < total; i++) ts_tensor_free(full ? full[i] : NULL);
    ts__free(TS_MEM_NN, full);
    ts_named_params_free(&np);
    ts__free(TS_MEM_NN, w.g);
    if (st) {
        ts_state_dict_free(sd);
        return st;
    }
    *out = sd;
    return TS_OK;
}

ts_status ts_fsdp_load_full_state_dict(ts_module *module, const ts_state_dict *sd, bool strict)
{
    static const char fn[] = "ts_fsdp_load_full_state_dict";
    if (!module || !sd) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL argument", fn);
    groups_walk w;
    ts_status st = ts__fsdp_idle_groups(fn, module, &w);
    if (st) return st;
    for (int i = 0; i < w.n && !st; i++) st = ts__fsdp_reshard(w.g[i]);
    ts_named_params np = {0};
    if (!st) st = ts__module_entries(module, true, true, false, &np); /* buffers are copied whole */
    /* the model's names, for the unexpected keys in O(1) each */
    ts_state_dict *known = NULL;
    if (!st) st = ts_state_dict_new(&known);
    for (int i = 0; i < np.n && !st; i++) st = ts_state_dict_set(known, np.items[i].name, *np.items[i].slot);
    /* check everything first: nothing is copied on error. Shapes, then
     * dtypes, then (strict) key mismatches, as ts_module_load_state_dict. */
    char missing[1024] = "", unexpected[1024] = "", shapes[1024] = "", dtypes[1024] = "";
    for (int i = 0; i < np.n && !st; i++) {
        ts_tensor *t = *np.items[i].slot, *src = ts_state_dict_get(sd, np.items[i].name);
        if (!src) {
            snprintf(missing + strlen(missing), sizeof missing - strlen(missing), " '%s'", np.items[i].name);
            continue;
        }
        fsdp_param *p = ts__fsdp_find_param(&w, t, NULL);
        int nd = p ? p->ndim : ts_tensor_ndim(t);
        const int64_t *sh = p ? p->shape : ts_tensor_shape(t);
        if (ts_tensor_ndim(src) != nd || memcmp(ts_tensor_shape(src), sh, (size_t)nd * sizeof *sh) != 0) {
            char a[128], b[128];
            snprintf(shapes + strlen(shapes), sizeof shapes - strlen(shapes), " '%s' is %s in the dict, %s in the model;",
                     np.items[i].name, ts_tensor_shape_str(src, a, sizeof a), ts__shape_str(nd, sh, b, sizeof b));
        }
        ts_dtype want = ts_tensor_dtype(p ? p->S : t);
        if (ts_tensor_dtype(src) != want)
            snprintf(dtypes + strlen(dtypes), sizeof dtypes - strlen(dtypes), " '%s' is %s in the dict, %s in the model;",
                     np.items[i].name, ts_dtype_name(ts_tensor_dtype(src)), ts_dtype_name(want));
    }
    for (int i = 0; i < ts_state_dict_size(sd) && !st; i++)
        if (!ts_state_dict_get(known, ts_state_dict_name(sd, i)))
            snprintf(unexpected + strlen(unexpected), sizeof unexpected - strlen(unexpected), " '%s'",
                     ts_state_dict_name(sd, i));
    ts_state_dict_free(known);
    if (!st && *shapes) st = ts_error(TS_ERR_SHAPE, "%s:%s", fn, shapes);
    if (!st && *dtypes)
        st = ts_error(TS_ERR_DTYPE, "%s: dtype mismatch:%s convert the dict's tensors with ts_to_dtype first", fn,
                      dtypes);
    if (!st && strict && (*missing || *unexpected))
        st = ts_error(TS_ERR_NOT_FOUND, "%s: missing keys:%s; unexpected keys:%s", fn, *missing ? missing : " none",
                      *unexpected ? unexpected : " none");
    bool prev = ts_grad_mode_set(false);
    for (int i = 0; i < np.n && !st; i++) {
        ts_tensor *t = *np.items[i].slot, *src = ts_state_dict_get(sd, np.items[i].name);
        if (!src) continue;
        fsdp_group *g = NULL;
        fsdp_param *p = ts__fsdp_find_param(&w, t, &g);
        if (!p) {
            ts_tensor *lv = NULL;
            if (!(st = ts_tensor_local_view(t, &lv))) {
                st = ts_tensor_copy_(lv, src);
                ts_tensor_free(lv);
            }
            continue;
        }
        st = ts__fsdp_param_load_rows(p, g, src);
    }
    ts_grad_mode_set(prev);
    ts_named_params_free(&np);
    ts__free(TS_MEM_NN, w.g);
    return st;
}

/* ------------------------------------------------------------------ */
/* Gradient clipping                                                  */
/* ------------------------------------------------------------------ */

static double sum_squares(const ts_tensor *g)
{
    ts_tensor *c = NULL;
    if (ts_contiguous((ts_tensor *)g, &c)) return NAN;
    double s = 0;
    int64_t n = ts_tensor_numel(c);
    const void *p = ts_tensor_data(c);
    for (int64_t i = 0; i < n; i++) {
        double v;
        switch (ts_tensor_dtype(c)) {
        case TS_F32: v = ((const float *)p)[i]; break;
        case TS_F64: v = ((const double *)p)[i]; break;
        case TS_BF16: v = ts_bf16_to_f32(((const uint16_t *)p)[i]); break;
        case TS_F16: v = ts_f16_to_f32(((const uint16_t *)p)[i]); break;
        default: v = NAN;
        }
        s += v * v;
    }
    ts_tensor_free(c);
    return s;
}

ts_status ts_fsdp_clip_grad_norm(ts_module *module, double max_norm, double *total_norm_out)
{
    static const char fn[] = "ts_fsdp_clip_grad_norm";
    if (!module || !total_norm_out) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL argument", fn);
    if (!(max_norm >= 0)) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: invalid max_norm %g (must be >= 0)", fn, max_norm);
    groups_walk w;
    ts_status st = ts__fsdp_subtree_groups(module, &w);
    if (st) return st;
    ts_named_params np = {0};
    double total = 0;
    /* each group's shards: local sum, then summed over its shard ranks */
    for (int i = 0; i < w.n && !st; i++) {
        fsdp_group *g = w.g[i];
        double local = 0;
        for (int k = 0; k < g->n; k++) {
            ts_tensor *gr = ts_tensor_grad(g->params[k].S);
            if (gr) local += sum_squares(gr);
        }
        int64_t one = 1;
        ts_tensor *t = NULL;
        if ((st = ts_tensor_full(TS_F64, 1, &one, local, &t))) break;
        if (!(st = ts_all_reduce(g->pg, t, TS_REDUCE_SUM, NULL))) total += *(double *)ts_tensor_data(t);
        ts_tensor_free(t);
    }
    /* parameters outside every group (ignored ones): counted as they are */
    if (!st) st = ts_module_named_parameters(module, &np);
    for (int i = 0; i < np.n && !st; i++) {
        ts_tensor *t = *np.items[i].slot;
        if (ts__fsdp_find_param(&w, t, NULL)) continue;
        ts_tensor *gr = ts_tensor_grad(t);
        if (gr) total += sum_squares(gr);
    }
    if (!st) {
        total = sqrt(total);
        *total_norm_out = total;
        if (!isfinite(total))
            st = ts_error(TS_ERR_INVALID_ARGUMENT, "%s: the total gradient norm is %g; gradients left unchanged", fn,
                          total);
    }
    double coef = max_norm / (total + 1e-6);
    if (!st && coef < 1.0) {
        bool prev = ts_grad_mode_set(false);
        for (int i = 0; i < np.n && !st; i++) {
            ts_tensor *t = *np.items[i].slot;
            fsdp_param *p = ts__fsdp_find_param(&w, t, NULL);
            ts_tensor *gr = ts_tensor_grad(p ? p->S : t);
            if (!gr) continue;
            ts_tensor *sc = NULL;
            if (!(st = ts_mul_scalar(gr, coef, &sc))) {
                st = ts_tensor_copy_(gr, sc);
                ts_tensor_free(sc);
            }
        }
        ts_grad_mode_set(prev);
    }
    ts_named_params_free(&np);
    ts__free(TS_MEM_NN, w.g);
    return st;
}
