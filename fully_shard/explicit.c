/*
 * Explicit control of FSDP modules (fully_shard.h): unshard with a handle
 * and reshard (PyTorch's FSDPModule.unshard/reshard), summoning the full
 * parameters of a subtree (optionally writing changes back into the shards),
 * forward methods other than forward that run through the FSDP wrapper,
 * and the explicit and implicit prefetch setters.
 * Floor 7 (internal.h, "Floors"): may call floors 1-6.
 */
#include "fully_shard/internal.h"

#include "tensor/tensor.h"

#include <string.h>

/* ------------------------------------------------------------------ */
/* Unshard and reshard                                                */
/* ------------------------------------------------------------------ */

struct ts_fsdp_unshard_handle {
    fsdp_group *g;
};

ts_status ts_fsdp_unshard(ts_module *module, bool async, ts_fsdp_unshard_handle **handle)
{
    fsdp_state *s = NULL;
    ts_status st = ts__fsdp_need_state("ts_fsdp_unshard", module, &s);
    if (st) return st;
    if (handle) *handle = NULL;
    if (async && !handle) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_fsdp_unshard: async needs a handle pointer");
    fsdp_group *g = s->group;
    if (!g) return TS_OK;
    if ((st = ts__fsdp_unshard(g))) return st;
    if (!async) return ts__fsdp_wait_unshard(g);
    ts_fsdp_unshard_handle *h = ts__calloc(TS_MEM_NN, 1, sizeof *h);
    if (!h) {
        (void)ts__fsdp_wait_unshard(g);
        return TS_ERR_NO_MEMORY;
    }
    h->g = ts__fsdp_group_retain(g);
    *handle = h;
    return TS_OK;
}

ts_status ts_fsdp_unshard_wait(ts_fsdp_unshard_handle *h)
{
    if (!h) return TS_OK;
    ts_status st = ts__fsdp_wait_unshard(h->g);
    ts__fsdp_group_release(h->g);
    ts__free(TS_MEM_NN, h);
    return st;
}

ts_status ts_fsdp_reshard(ts_module *module)
{
    fsdp_state *s = NULL;
    ts_status st = ts__fsdp_need_state("ts_fsdp_reshard", module, &s);
    return st ? st : ts__fsdp_reshard(s->group);
}

/* ------------------------------------------------------------------ */
/* Summoning the full parameters                                      */
/* ------------------------------------------------------------------ */

struct ts_fsdp_summon {
    fsdp_group **g;
    bool *was_sharded;
    int n;
    bool writeback;
};

ts_status ts_fsdp_summon_full_params(ts_module *module, bool writeback, ts_fsdp_summon **out)
{
    if (!module || !out) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_fsdp_summon_full_params: NULL argument");
    ts__fsdp_groups_walk w;
    ts_status st = ts__fsdp_idle_groups("ts_fsdp_summon_full_params", module, &w);
    if (st) return st;
    for (int i = 0; i < w.n && writeback; i++)
        if (w.g[i]->udtype != w.g[i]->dtype) {
            st = ts_error(TS_ERR_UNSUPPORTED,
                          "ts_fsdp_summon_full_params: writeback under a mixed-precision policy would round the %s "
                          "shards of '%s' to their %s unsharded copies; summon without writeback, or change the "
                          "shards (ts_fsdp_load_full_state_dict)",
                          ts_dtype_name(w.g[i]->dtype), w.g[i]->fqn, ts_dtype_name(w.g[i]->udtype));
            ts__free(TS_MEM_NN, w.g);
            return st;
        }
    ts_fsdp_summon *s = ts__calloc(TS_MEM_NN, 1, sizeof *s);
    bool *was = ts__calloc(TS_MEM_NN, (size_t)(w.n ? w.n : 1), sizeof *was);
    if (!s || !was) {
        ts__free(TS_MEM_NN, s);
        ts__free(TS_MEM_NN, was);
        ts__free(TS_MEM_NN, w.g);
        return TS_ERR_NO_MEMORY;
    }
    for (int i = 0; i < w.n && !st; i++) {
        was[i] = w.g[i]->sharded_state == FSDP_SHARDED;
        if (!(st = ts__fsdp_unshard(w.g[i]))) st = ts__fsdp_wait_unshard(w.g[i]);
    }
    for (int i = 0; i < w.n; i++) ts__fsdp_group_retain(w.g[i]);
    s->g = w.g;
    s->was_sharded = was;
    s->n = w.n;
    s->writeback = writeback;
    if (st) {
        s->writeback = false;
        ts__error_quiet_begin(); /* the cleanup of a failure: the failure's detail stays (docs/design.md, D1) */
        (void)ts_fsdp_summon_end(s);
        ts__error_quiet_end();
        return st;
    }
    *out = s;
    return TS_OK;
}

/* Copies the rows of each unsharded parameter that this rank holds back
 * into its shard. */
static void write_back(fsdp_group *g)
{
    for (int i = 0; i < g->n; i++) ts__fsdp_param_write_back(&g->params[i], g);
}

ts_status ts_fsdp_summon_end(ts_fsdp_summon *s)
{
    if (!s) return TS_OK;
    ts_status st = TS_OK;
    for (int i = 0; i < s->n; i++) {
        fsdp_group *g = s->g[i];
        if (s->writeback && g->sharded_state == FSDP_UNSHARDED) write_back(g);
        if (s->was_sharded[i]) {
            ts_status s2 = ts__fsdp_reshard(g);
            if (!st) st = s2;
        }
        ts__fsdp_group_release(g);
    }
    ts__free(TS_MEM_NN, s->g);
    ts__free(TS_MEM_NN, s->was_sharded);
    ts__free(TS_MEM_NN, s);
    return st;
}

/* ------------------------------------------------------------------ */
/* Forward methods and prefetch                                       */
/* ------------------------------------------------------------------ */

ts_status ts_fsdp_register_forward_method(ts_module *module, const char *name)
{
    fsdp_state *s = NULL;
    ts_status st = ts__fsdp_need_state("ts_fsdp_register_forward_method", module, &s);
    if (st) return st;
    if (!name) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_fsdp_register_forward_method: NULL name");
    for (int i = 0; i < s->orig_vt->n_methods; i++)
        if (strcmp(s->orig_vt->methods[i].name, name) == 0) {
            s->method_wrapped[i] = true;
            return TS_OK;
        }
    return ts_error(TS_ERR_NOT_FOUND, "ts_fsdp_register_forward_method: %s has no method '%s'",
                    ts_module_type_name(module), name);
}

static ts_status set_prefetch(const char *fn, ts_module *module, int n, ts_module *const *modules, bool fwd)
{
    fsdp_state *s = NULL;
    ts_status st = ts__fsdp_need_state(fn, module, &s);
    if (st) return st;
    if (n < 0 || (n && !modules)) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %d modules but no list", fn, n);
    fsdp_state **list = n ? ts__calloc(TS_MEM_NN, (size_t)n, sizeof *list) : NULL;
    if (n && !list) return TS_ERR_NO_MEMORY;
    for (int i = 0; i < n; i++) {
        fsdp_state *t = ts__fsdp_state_of(modules[i]);
        if (!t) {
            ts__free(TS_MEM_NN, list);
            return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: module %d (%s) is not an FSDP module", fn, i,
                            modules[i] ? ts_module_type_name(modules[i]) : "NULL");
        }
        list[i] = t;
    }
    for (int i = 0; i < n; i++) ts__fsdp_state_retain(list[i]);
    fsdp_state ***dst = fwd ? &s->fwd_prefetch : &s->bwd_prefetch;
    int *dn = fwd ? &s->n_fwd_prefetch : &s->n_bwd_prefetch;
    for (int i = 0; i < *dn; i++) ts__fsdp_state_release((*dst)[i]);
    ts__free(TS_MEM_NN, *dst);
    *dst = list;
    *dn = n;
    if (fwd) s->explicit_fwd = n > 0;
    else s->explicit_bwd = n > 0;
    return TS_OK;
}

ts_status ts_fsdp_set_modules_to_forward_prefetch(ts_module *module, int n, ts_module *const *modules)
{
    return set_prefetch("ts_fsdp_set_modules_to_forward_prefetch", module, n, modules, true);
}

ts_status ts_fsdp_set_modules_to_backward_prefetch(ts_module *module, int n, ts_module *const *modules)
{
    return set_prefetch("ts_fsdp_set_modules_to_backward_prefetch", module, n, modules, false);
}

ts_status ts_fsdp_set_implicit_prefetch(ts_module *module, bool forward, bool backward)
{
    fsdp_state *s = NULL;
    ts_status st = ts__fsdp_need_state("ts_fsdp_set_implicit_prefetch", module, &s);
    if (st || (st = ts__fsdp_lazy_init(s))) return st;
    s->ctx->implicit_fwd = forward;
    s->ctx->implicit_bwd = backward;
    return TS_OK;
}
