/*
 * Full state dicts of FSDP models (fully_shard.h): saving gathers every
 * group's parameters whole (on every rank, or rank 0 only), loading copies
 * each rank's rows of a full tensor into its shard; and
 * ts_fsdp_clip_grad_norm over the sharded gradients.
 * Floor 6 (internal.h, "Floors"): may call floors 1-5 and materialize.c.
 */
#include "fully_shard/internal.h"

#include "comm/comm.h"
#include "nn/internal.h"
#include "optim/internal.h" /* clip_grad_norm's torch-exact pieces */
#include "tensor/tensor.h"

#include <math.h>
#include <string.h>

/* The group parameter whose S or U is t, or NULL. */
/* ------------------------------------------------------------------ */
/* State dicts                                                        */
/* ------------------------------------------------------------------ */

fsdp_param *ts__fsdp_find_param(ts__fsdp_groups_walk *w, const ts_tensor *t, fsdp_group **g_out)
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

/* ------------------------------------------------------------------ */
/* Sharding as code outside fully_shard reads it (checkpoint/)        */
/* ------------------------------------------------------------------ */

ts_status ts_fsdp_param_shard_info(ts_module *module, const ts_tensor *t, ts_fsdp_shard_info *out)
{
    if (!module || !t || !out) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_fsdp_param_shard_info: NULL argument");
    ts__fsdp_groups_walk w;
    ts_status st = ts__fsdp_subtree_groups(module, &w);
    if (st) return st;
    fsdp_group *g = NULL;
    fsdp_param *p = ts__fsdp_find_param(&w, t, &g);
    ts_fsdp_shard_info info = {0};
    if (p) {
        info.shard = p->S;
        info.dtensor = p->dt;
        info.shard_group = g->pg;
        info.replicate_group = g->rg;
        info.shard_rank = g->rank;
        info.shard_world = g->W;
    }
    ts__free(TS_MEM_NN, w.g);
    *out = info;
    return TS_OK;
}

ts_status ts_fsdp_is_idle(ts_module *module, bool *idle_out)
{
    if (!module || !idle_out) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_fsdp_is_idle: NULL argument");
    ts__fsdp_groups_walk w;
    ts_status st = ts__fsdp_subtree_groups(module, &w);
    if (st) return st;
    *idle_out = !ts__fsdp_groups_busy(w.g, w.n);
    ts__free(TS_MEM_NN, w.g);
    return TS_OK;
}

ts_status ts_fsdp_world(ts_module *module, ts_comm **world_out)
{
    if (!module || !world_out) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_fsdp_world: NULL argument");
    ts__fsdp_groups_walk w;
    ts_status st = ts__fsdp_subtree_groups(module, &w);
    if (st) return st;
    *world_out = w.n ? ts_mesh_world(w.g[0]->mesh) : ts_dist_world();
    ts__free(TS_MEM_NN, w.g);
    return TS_OK;
}

ts_status ts_fsdp_reshard_tree(ts_module *module)
{
    if (!module) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_fsdp_reshard_tree: NULL argument");
    ts__fsdp_groups_walk w;
    ts_status st = ts__fsdp_idle_groups("ts_fsdp_reshard_tree", module, &w);
    if (st) return st;
    for (int i = 0; i < w.n && !st; i++) st = ts__fsdp_reshard(w.g[i]);
    ts__free(TS_MEM_NN, w.g);
    return st;
}

ts_status ts_fsdp_full_state_dict(ts_module *module, bool rank0_only, ts_state_dict **out)
{
    if (!module || !out) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_fsdp_full_state_dict: NULL argument");
    ts__fsdp_groups_walk w;
    ts_status st = ts__fsdp_check_materialized("ts_fsdp_full_state_dict", module);
    if (st) return st;
    if ((st = ts__fsdp_idle_groups("ts_fsdp_full_state_dict", module, &w))) return st;
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
    ts__fsdp_groups_walk w;
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
            snprintf(shapes + strlen(shapes), sizeof shapes - strlen(shapes),
                     " '%s' is %s in the dict, %s in the model;", np.items[i].name,
                     ts_tensor_shape_str(src, a, sizeof a), ts_shape_str(nd, sh, b, sizeof b));
        }
        ts_dtype want = ts_tensor_dtype(p ? p->S : t);
        if (ts_tensor_dtype(src) != want)
            snprintf(dtypes + strlen(dtypes), sizeof dtypes - strlen(dtypes),
                     " '%s' is %s in the dict, %s in the model;", np.items[i].name, ts_dtype_name(ts_tensor_dtype(src)),
                     ts_dtype_name(want));
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
    /* a model on the meta device (deferred init) gets its bytes here,
     * without running its initializers: the dict gives the values */
    if (!st) st = ts__fsdp_materialize(fn, module, false);
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

/* torch.nn.utils.clip_grad_norm_ over FSDP2's DTensor gradients, built
 * from optim's pieces (optim/internal.h) so that on one rank it computes
 * what ts_clip_grad_norm computes on the same gradients, to the bit:
 * - each parameter of the module tree that has a gradient gives one norm,
 *   in named_parameters() order: torch.norm of its gradient
 *   (ts__optim_grad_norm: torch's float32 order). For a sharded parameter
 *   whose shard group has W > 1 ranks it is sqrt(sum over the W ranks of
 *   local_norm^2): each rank's norm of its rows, squared in float64 (exact
 *   for a float32 norm), the W squares summed by one float64 all-reduce
 *   per group (comm's ring, reduce-scatter then all-gather, so every rank
 *   gets the same bits; the W terms are added in ring order, W - 1
 *   float64 roundings), then sqrt in float64. PyTorch's DTensor does the
 *   same in the gradient's dtype (_NormPartial: local norm ** 2
 *   all-reduced, then ** 0.5); the float64 sum is nearer the exact value.
 *   A parameter counts when any rank of its group has a gradient for it
 *   (the same all-reduce counts them), so every rank stacks the same
 *   norms. On a one-rank group the local norm is the norm (no all-reduce);
 * - the total is torch.norm(torch.stack(norms)) (ts__optim_total_norm;
 *   float64 if any gradient is), the coefficient ts__optim_clip_coef, and
 *   every gradient (the shards', and those of parameters outside groups,
 *   counted as they are) is scaled in place by ts__optim_scale_grad when
 *   the coefficient is below 1.
 * On W > 1 ranks the norms differ from the unsharded ones by the rounding
 * of the float32 sums of squares (tests/fully_shard/test_clip.c derives
 * the bound it tests). */

/* The gradient of t if it has one this function can norm; errors name the
 * parameter. */
static ts_status clip_grad_of(const char *fn, const char *name, ts_tensor *t, ts_tensor **gr_out)
{
    ts_tensor *gr = ts_tensor_grad(t);
    *gr_out = gr;
    if (!gr) return TS_OK;
    ts_dtype d = ts_tensor_dtype(gr);
    if (d != TS_F32 && d != TS_F64 && d != TS_BF16 && d != TS_F16)
        return ts_error(TS_ERR_DTYPE,
                        "%s: the gradient of %s has dtype %s; float32, float64, bfloat16 or float16 expected", fn, name,
                        ts_dtype_name(d));
    if (ts_tensor_numel(gr) > 0 && !ts_tensor_data(gr))
        return ts_error(TS_ERR_RELEASED, "%s: the gradient of %s has released storage", fn, name);
    return TS_OK;
}

ts_status ts_fsdp_clip_grad_norm(ts_module *module, double max_norm, double *total_norm_out)
{
    static const char fn[] = "ts_fsdp_clip_grad_norm";
    if (!module || !total_norm_out) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL argument", fn);
    if (!(max_norm >= 0))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: invalid max_norm %g (must be >= 0)", fn, max_norm);
    ts__fsdp_groups_walk w;
    ts_status st = ts__fsdp_subtree_groups(module, &w);
    if (st) return st;
    /* a reduction a backward left in flight (ts_fsdp_set_is_last_backward
     * false) lands in the shards' gradients first: FSDP2 has assigned it
     * to .grad when its backward ends, so its clip_grad_norm_ counts it;
     * measured without it the norm and the clipped gradients were wrong,
     * and the gradient landing later was not clipped */
    for (int i = 0; i < w.n && !st; i++) st = ts__fsdp_finish_reduce(w.g[i]);
    fsdp_state *ms = ts__fsdp_state_of(module);
    if (ms && ms->ctx && ms->ctx->rs_pending && !ts__fsdp_reduce_in_flight(ms->ctx->rs_pending)) {
        ms->ctx->rs_pending = NULL;
        ms->ctx->hold_pending = false;
    }
    if (st) {
        ts__free(TS_MEM_NN, w.g);
        return st;
    }
    ts_named_params np = {0};
    st = ts_module_named_parameters(module, &np);
    /* per group i, from base[i]: each parameter's local norm (loc) and,
     * summed over the shard group, its squared local norm and the number
     * of ranks with a gradient for it (red[i], 2 n float64) */
    int total_n = 0;
    for (int i = 0; i < w.n; i++) total_n += w.g[i]->n;
    int *base = ts__malloc(TS_MEM_NN, (size_t)(w.n + 1) * sizeof *base);
    double *loc = ts__malloc(TS_MEM_NN, (size_t)(total_n + 1) * sizeof *loc);
    double *norms = ts__malloc(TS_MEM_NN, (size_t)(np.n + 1) * sizeof *norms);
    ts_tensor **red = ts__calloc(TS_MEM_NN, (size_t)(w.n + 1), sizeof *red);
    if (!st && (!base || !loc || !norms || !red)) st = TS_ERR_NO_MEMORY;
    bool any_f64 = false;
    for (int i = 0, b = 0; i < w.n && !st; b += w.g[i]->n, i++) {
        fsdp_group *g = w.g[i];
        base[i] = b;
        int64_t two_n = 2 * (int64_t)g->n;
        if ((st = ts_tensor_zeros(TS_F64, 1, &two_n, &red[i]))) break;
        double *r = ts_tensor_data(red[i]);
        for (int k = 0; k < g->n && !st; k++) {
            ts_tensor *gr = NULL;
            loc[b + k] = 0;
            if ((st = clip_grad_of(fn, g->params[k].fqn, g->params[k].S, &gr)) || !gr) continue;
            if ((st = ts__optim_grad_norm(gr, &loc[b + k]))) break;
            r[k] = loc[b + k] * loc[b + k];
            r[g->n + k] = 1;
        }
        if (!st && ts_comm_size(g->pg) > 1) st = ts_all_reduce(g->pg, red[i], TS_REDUCE_SUM, NULL);
    }
    /* the norms in named_parameters() order; a group's gradients have its
     * dtype, so whether the stack is float64 is the same on every rank */
    int nn = 0;
    for (int i = 0; i < np.n && !st; i++) {
        ts_tensor *t = *np.items[i].slot;
        fsdp_group *g = NULL;
        fsdp_param *p = ts__fsdp_find_param(&w, t, &g);
        if (!p) { /* outside every group: counted as it is */
            ts_tensor *gr = NULL;
            if ((st = clip_grad_of(fn, np.items[i].name, t, &gr)) || !gr) continue;
            any_f64 |= ts_tensor_dtype(gr) == TS_F64;
            st = ts__optim_grad_norm(gr, &norms[nn++]);
            continue;
        }
        int gi = 0;
        while (w.g[gi] != g) gi++;
        int k = (int)(p - g->params);
        const double *r = ts_tensor_data(red[gi]);
        if (r[g->n + k] == 0) continue; /* no rank has a gradient for it */
        any_f64 |= g->dtype == TS_F64;
        norms[nn++] = ts_comm_size(g->pg) > 1 ? sqrt(r[k]) : loc[base[gi] + k];
    }
    double total = 0;
    if (!st) st = ts__optim_total_norm(nn, norms, any_f64, &total);
    if (!st) {
        *total_norm_out = total;
        if (!isfinite(total))
            st = ts_error(TS_ERR_INVALID_ARGUMENT, "%s: the total gradient norm is %g; gradients left unchanged", fn,
                          total);
    }
    double coef = st ? 1.0 : ts__optim_clip_coef(total, max_norm, any_f64);
    for (int i = 0; i < np.n && !st && coef < 1.0; i++) {
        ts_tensor *t = *np.items[i].slot;
        fsdp_param *p = ts__fsdp_find_param(&w, t, NULL);
        ts_tensor *gr = ts_tensor_grad(p ? p->S : t);
        if (gr) ts__optim_scale_grad(gr, coef);
    }
    for (int i = 0; red && i < w.n; i++) ts_tensor_free(red[i]);
    ts__free(TS_MEM_NN, red);
    ts__free(TS_MEM_NN, norms);
    ts__free(TS_MEM_NN, loc);
    ts__free(TS_MEM_NN, base);
    ts_named_params_free(&np);
    ts__free(TS_MEM_NN, w.g);
    return st;
}
