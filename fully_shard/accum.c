/*
 * Gradient accumulation and the microbatching controls (FSDP2's
 * FSDPModule.set_requires_gradient_sync, set_requires_all_reduce,
 * set_reshard_after_backward, set_is_last_backward,
 * set_gradient_divide_factor, set_force_sum_reduction_for_comms;
 * docs/fully_shard.md, "Gradient accumulation and microbatches"; docs/design.md, "Gradient division"). The setters only change flags
 * of the groups (or of the root's context); param_group.c's post-backward
 * and reduction read them, state.c's end-of-backward reads
 * is_last_backward and reshard_after_backward.
 * Also ts_fsdp_set_separate_reduce_scatter_group.
 * Floor 6 (internal.h, "Floors"): may call floors 1-5.
 */
#include "fully_shard/internal.h"

#include <math.h>

typedef enum group_flag { FLAG_SYNC, FLAG_ALL_REDUCE, FLAG_RESHARD_AFTER_BACKWARD } group_flag;

static void set_flag(fsdp_group *g, group_flag which, bool v)
{
    if (!g) return;
    switch (which) {
    case FLAG_SYNC: g->reduce_grads = v; break;
    case FLAG_ALL_REDUCE: g->all_reduce_grads = v; break;
    case FLAG_RESHARD_AFTER_BACKWARD: g->reshard_after_backward = v; break;
    }
}

/* The flag on module's group, and with recurse on the group of every FSDP
 * module below it (FSDP2's loop over self.modules()). */
static ts_status set_group_flag(const char *fn, ts_module *module, group_flag which, bool v, bool recurse)
{
    fsdp_state *s = NULL;
    ts_status st = ts__fsdp_need_state(fn, module, &s);
    if (st) return st;
    if (!recurse) {
        set_flag(s->group, which, v);
        return TS_OK;
    }
    ts__fsdp_groups_walk w = {0};
    if ((st = ts__fsdp_subtree_groups(module, &w))) return st;
    for (int i = 0; i < w.n; i++) set_flag(w.g[i], which, v);
    ts__free(TS_MEM_NN, w.g);
    return TS_OK;
}

ts_status ts_fsdp_set_requires_gradient_sync(ts_module *module, bool sync, bool recurse)
{
    return set_group_flag("ts_fsdp_set_requires_gradient_sync", module, FLAG_SYNC, sync, recurse);
}

ts_status ts_fsdp_set_requires_all_reduce(ts_module *module, bool all_reduce, bool recurse)
{
    return set_group_flag("ts_fsdp_set_requires_all_reduce", module, FLAG_ALL_REDUCE, all_reduce, recurse);
}

ts_status ts_fsdp_set_reshard_after_backward(ts_module *module, bool reshard, bool recurse)
{
    return set_group_flag("ts_fsdp_set_reshard_after_backward", module, FLAG_RESHARD_AFTER_BACKWARD, reshard, recurse);
}

ts_status ts_fsdp_set_is_last_backward(ts_module *module, bool is_last)
{
    fsdp_state *s = NULL;
    ts_status st = ts__fsdp_need_state("ts_fsdp_set_is_last_backward", module, &s);
    if (st) return st;
    s->not_last_backward = !is_last;
    if (s->ctx) s->ctx->not_last_backward = !is_last;
    return TS_OK;
}

ts_status ts_fsdp_set_gradient_divide_factor(ts_module *module, double factor)
{
    fsdp_state *s = NULL;
    ts_status st = ts__fsdp_need_state("ts_fsdp_set_gradient_divide_factor", module, &s);
    if (st) return st;
    if (!isfinite(factor) || factor <= 0)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "ts_fsdp_set_gradient_divide_factor: the factor must be finite and > 0, got %g", factor);
    if (s->group) s->group->divide_factor = factor;
    return TS_OK;
}

ts_status ts_fsdp_set_force_sum_reduction_for_comms(ts_module *module, bool enable)
{
    fsdp_state *s = NULL;
    ts_status st = ts__fsdp_need_state("ts_fsdp_set_force_sum_reduction_for_comms", module, &s);
    if (st) return st;
    if (s->group) s->group->force_sum = enable;
    return TS_OK;
}

ts_status ts_fsdp_accumulation_memory(ts_module *module, ts_fsdp_accum_memory *out)
{
    if (!module || !out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_fsdp_accumulation_memory: %s is NULL", module ? "out" : "module");
    ts__fsdp_groups_walk w = {0};
    ts_status st = ts__fsdp_subtree_groups(module, &w);
    if (st) return st;
    ts_fsdp_accum_memory m = {0};
    for (int i = 0; i < w.n; i++) {
        const fsdp_group *g = w.g[i];
        /* the gradient the unsharded parameters get (udtype), or the
         * reduce dtype it is accumulated in when that is another */
        size_t acc_es = g->rdtype != g->udtype ? g->res : g->ues;
        m.sync_bytes += (size_t)g->shard_numel * g->es; /* views of one output in the shard layout */
        m.no_sync_bytes += (size_t)g->numel * acc_es;
        if (g->rg && ts_comm_size(g->rg) > 1) m.partial_bytes += (size_t)g->shard_numel * g->res;
    }
    ts__free(TS_MEM_NN, w.g);
    *out = m;
    return TS_OK;
}

/* ------------------------------------------------------------------ */
/* A separate reduce-scatter group                                    */
/* ------------------------------------------------------------------ */

ts_status ts_fsdp_set_separate_reduce_scatter_group(ts_module *module, bool enable)
{
    static const char fn[] = "ts_fsdp_set_separate_reduce_scatter_group";
    if (!module) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL module", fn);
    fsdp_state *s = NULL;
    ts_status st = ts__fsdp_need_state(fn, module, &s);
    if (st) return st;
    ts__fsdp_groups_walk w = {0};
    if ((st = ts__fsdp_idle_groups(fn, module, &w))) return st;
    for (int i = 0; i < w.n && !st; i++) {
        fsdp_group *g = w.g[i];
        if (enable && !g->rsg && g->W > 1) {
            int *ranks = ts__malloc(TS_MEM_NN, (size_t)g->W * sizeof *ranks);
            if (!ranks) {
                st = TS_ERR_NO_MEMORY;
                break;
            }
            for (int j = 0; j < g->W; j++) ranks[j] = j;
            st = ts_comm_new_group(g->pg, g->W, ranks, &g->rsg);
            ts__free(TS_MEM_NN, ranks);
        } else if (!enable && g->rsg) {
            ts_comm_free(g->rsg);
            g->rsg = NULL;
        }
    }
    ts__free(TS_MEM_NN, w.g);
    return st;
}
