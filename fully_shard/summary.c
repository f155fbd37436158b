/*
 * fully_shard's floor 7 (internal.h, "Floors"): describing the sharding:
 * ts_fsdp_summary, per group and per parameter: full, local and padded
 * shapes, bytes per rank; ts_fsdp_print_stats; ts_fsdp_offload_stats_get.
 * (The FSDP vtable's extra_repr and the collective figures: repr.c.)
 * May call: floors 1-6.
 */
#define _GNU_SOURCE
#include "fully_shard/internal.h"

#include "comm/comm.h"
#include "mesh/mesh.h"
#include "nn/nn.h"
#include "tensor/internal.h" /* the storage of an offloaded shard (ts_fsdp_offload_stats_get) */

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void bytes_str(double b, char *buf, size_t cap)
{
    if (b < 1024) snprintf(buf, cap, "%.0f B", b);
    else if (b < 1024.0 * 1024) snprintf(buf, cap, "%.1f KiB", b / 1024);
    else if (b < 1024.0 * 1024 * 1024) snprintf(buf, cap, "%.1f MiB", b / (1024.0 * 1024));
    else snprintf(buf, cap, "%.2f GiB", b / (1024.0 * 1024 * 1024));
}

/* The FSDP modules of a subtree and their names, in pre-order. */
typedef struct summary_walk {
    fsdp_state **s;
    char **fqn;
    int n, cap_s, cap_fqn;
} summary_walk;

static ts_status summary_each(void *vc, const char *fqn, ts_module *m)
{
    summary_walk *w = vc;
    fsdp_state *s = ts__fsdp_state_of(m);
    if (!s) return TS_OK;
    if (!ts__fsdp_grow((void **)&w->s, &w->cap_s, w->n + 1, sizeof *w->s) ||
        !ts__fsdp_grow((void **)&w->fqn, &w->cap_fqn, w->n + 1, sizeof *w->fqn))
        return TS_ERR_NO_MEMORY;
    if (!(w->fqn[w->n] = ts__strdup(TS_MEM_NN, fqn))) return TS_ERR_NO_MEMORY;
    w->s[w->n++] = s;
    return TS_OK;
}

static void summary_walk_free(summary_walk *w)
{
    for (int i = 0; i < w->n; i++) ts__free(TS_MEM_NN, w->fqn[i]);
    ts__free(TS_MEM_NN, w->fqn);
    ts__free(TS_MEM_NN, w->s);
}

static const char *param_name(const ts_named_params *np, const fsdp_param *p)
{
    for (int i = 0; i < np->n; i++)
        if (*np->items[i].slot == p->S || *np->items[i].slot == p->U) return np->items[i].name;
    return p->fqn;
}

static ts_status write_summary(ts_module *module, FILE *f)
{
    summary_walk w = {0};
    ts_named_params np = {0}, nb = {0};
    ts__fsdp_groups_walk gw = {0};
    ts_status st = ts_module_named_modules(module, summary_each, &w);
    if (!st) st = ts__fsdp_subtree_groups(module, &gw);
    if (!st) st = ts_module_named_parameters(module, &np);
    if (!st) st = ts_module_named_buffers(module, &nb);
    if (st) goto done;
    int rank = gw.n ? ts_comm_rank(gw.g[0]->pg) : 0;
    int64_t total = 0;
    for (int i = 0; i < np.n; i++) { /* full sizes: a shard counts as its whole parameter */
        const fsdp_param *p = ts__fsdp_find_param(&gw, *np.items[i].slot, NULL);
        total += p ? p->numel : ts_tensor_numel(*np.items[i].slot);
    }
    char mesh[128] = "(none)";
    if (gw.n) ts__fsdp_mesh_str(gw.g[0]->mesh, mesh, sizeof mesh);
    fprintf(f,
            "FSDP summary of %s (rank %d of mesh %s): %d FSDP module%s, %d group%s, %d parameter%s (%lld elements)\n",
            ts_module_type_name(module), rank, mesh, w.n, w.n == 1 ? "" : "s", gw.n, gw.n == 1 ? "" : "s", np.n,
            np.n == 1 ? "" : "s", (long long)total);
    double rank_bytes = 0;
    int in_groups = 0;
    for (int i = 0; i < gw.n; i++) {
        const fsdp_group *g = gw.g[i];
        char names[TS__FSDP_FQN_MAX] = "";
        const char *type = "";
        bool root = false, resolved = false;
        for (int k = 0; k < w.n; k++) {
            if (w.s[k]->group != g) continue;
            size_t l = strlen(names);
            snprintf(names + l, sizeof names - l, "%s'%s'", l ? ", " : "", w.fqn[k]);
            if (!*type) type = ts_module_type_name(w.s[k]->module);
            if (w.s[k]->ctx) resolved = true;
            if (w.s[k]->module == module || (w.s[k]->ctx && w.s[k]->ctx->root == w.s[k])) root = true;
        }
        char pol[96], gm[128], b1[32], b2[32];
        ts__fsdp_policy_str(g, resolved, root, pol, sizeof pol);
        ts__fsdp_mesh_str(g->mesh, gm, sizeof gm);
        int64_t pad_all = g->shard_numel * g->W - g->numel;
        bytes_str((double)g->shard_numel * (double)g->es, b1, sizeof b1);
        bytes_str((double)g->shard_numel * (double)g->W * (double)g->ues, b2, sizeof b2); /* in param_dtype */
        rank_bytes += (double)g->shard_numel * (double)g->es;
        in_groups += g->n;
        fprintf(f, "group %s (%s): %d param%s, %lld elements, %s, mesh %s, reshard after forward: %s\n", names, type,
                g->n, g->n == 1 ? "" : "s", (long long)g->numel, ts_dtype_name(g->dtype), gm, pol);
        if (g->udtype != g->dtype || g->rdtype != g->dtype)
            fprintf(f, "  mixed precision: all-gather and compute in %s, gradients reduced in %s\n",
                    ts_dtype_name(g->udtype), ts_dtype_name(g->rdtype));
        fprintf(f,
                "  per rank: %lld elements (%lld of them padding on this rank, %lld over all ranks), %s sharded; "
                "%s while unsharded\n",
                (long long)g->shard_numel, (long long)(g->shard_numel - g->local_numel), (long long)pad_all, b1, b2);
        if (g->off.on)
            fprintf(f,
                    "  offload: cpu, %s (host shards and gradients; copied to the device before each all-gather, "
                    "gradients back after each reduce-scatter)\n",
                    g->off.pin ? "pinned" : "pageable");
        if (g->n_persist) {
            int64_t pn = 0;
            double pbytes = 0;
            for (int k = 0; k < g->n_persist; k++) {
                pn += ts_tensor_numel(g->persist[k].t);
                pbytes +=
                    (double)ts_tensor_numel(g->persist[k].t) * (double)ts_dtype_size(ts_tensor_dtype(g->persist[k].t));
            }
            char pb[32];
            bytes_str(pbytes, pb, sizeof pb);
            rank_bytes += pbytes;
            in_groups += g->n_persist;
            fprintf(f,
                    "  persistent (below the threshold: whole on every rank, gradients all-reduced in one bucket per "
                    "step): %d param%s, %lld elements, %s:",
                    g->n_persist, g->n_persist == 1 ? "" : "s", (long long)pn, pb);
            for (int k = 0; k < g->n_persist; k++) {
                char full[96];
                ts_shape_str(ts_tensor_ndim(g->persist[k].t), ts_tensor_shape(g->persist[k].t), full, sizeof full);
                fprintf(f, " %s %s", g->persist[k].fqn, full);
            }
            fprintf(f, "\n");
        }
        if (!g->n) continue;
        fprintf(f, "  %-40s %-16s %-16s %-16s %s\n", "parameter", "full", "local shard", "padded shard", "padding");
        for (int k = 0; k < g->n; k++) {
            const fsdp_param *p = &g->params[k];
            char full[96], local[96], padded[96];
            int64_t sh[TS_MAX_DIMS];
            memcpy(sh, p->shape, sizeof sh);
            ts_shape_str(p->ndim, p->shape, full, sizeof full);
            sh[0] = p->local_rows;
            ts_shape_str(p->ndim, sh, local, sizeof local);
            sh[0] = p->c;
            ts_shape_str(p->ndim, sh, padded, sizeof padded);
            fprintf(f, "  %-40s %-16s %-16s %-16s %lld\n", param_name(&np, p), full, local, padded,
                    (long long)((p->c - p->local_rows) * p->row_numel));
        }
    }
    /* parameters outside every group: replicated, whole, on every rank */
    int n_out = 0;
    int64_t out_numel = 0;
    double out_bytes = 0;
    for (int i = 0; i < np.n; i++) {
        ts_tensor *t = *np.items[i].slot;
        if (ts__fsdp_find_param(&gw, t, NULL) || ts__fsdp_find_persist(&gw, t)) continue;
        n_out++;
        out_numel += ts_tensor_numel(t);
        out_bytes += (double)ts_tensor_numel(t) * (double)ts_dtype_size(ts_tensor_dtype(t));
    }
    char b[32];
    bytes_str(out_bytes, b, sizeof b);
    fprintf(f, "outside every group (not sharded, whole on every rank): %d parameter%s, %lld elements, %s%s", n_out,
            n_out == 1 ? "" : "s", (long long)out_numel, b, n_out ? ":" : "");
    for (int i = 0, k = 0; i < np.n && k < 8; i++)
        if (!ts__fsdp_find_param(&gw, *np.items[i].slot, NULL) && !ts__fsdp_find_persist(&gw, *np.items[i].slot))
            fprintf(f, " %s", np.items[i].name), k++;
    fprintf(f, "%s\n", n_out > 8 ? " ..." : "");
    double buf_bytes = 0;
    for (int i = 0; i < nb.n; i++)
        buf_bytes +=
            (double)ts_tensor_numel(*nb.items[i].slot) * (double)ts_dtype_size(ts_tensor_dtype(*nb.items[i].slot));
    bytes_str(buf_bytes, b, sizeof b);
    fprintf(f, "buffers (never sharded, whole on every rank): %d, %s\n", nb.n, b);
    char rb[32];
    bytes_str(rank_bytes + out_bytes + buf_bytes, rb, sizeof rb);
    fprintf(f, "this rank holds %s of parameters and buffers (%d parameters in groups, %d outside)\n", rb, in_groups,
            n_out);
    if (gw.n) {
        ts_fsdp_accum_memory am;
        if ((st = ts_fsdp_accumulation_memory(module, &am))) goto done;
        char sb[32], nb2[32], pb[32];
        bytes_str((double)am.sync_bytes, sb, sizeof sb);
        bytes_str((double)am.no_sync_bytes, nb2, sizeof nb2);
        bytes_str((double)am.partial_bytes, pb, sizeof pb);
        fprintf(f,
                "gradient accumulation per rank: sync every microbatch +%s (the sharded gradients), no sync +%s more "
                "(unsharded gradients of every group held across microbatches, %.1fx the sharded)",
                sb, nb2, am.sync_bytes ? (double)am.no_sync_bytes / (double)am.sync_bytes : 0.0);
        if (am.partial_bytes) fprintf(f, ", HSDP without all-reduce +%s (partial sums)", pb);
        fprintf(f, "\n");
        /* the state between microbatches: what a step now would not see */
        int off = 0, in_flight = 0;
        double held = 0;
        for (int i = 0; i < gw.n; i++) {
            const fsdp_group *g = gw.g[i];
            off += !g->reduce_grads;
            in_flight += ts__fsdp_reduce_in_flight(g);
            for (int k = 0; k < g->n; k++) {
                const fsdp_param *p = &g->params[k];
                const ts_tensor *gr = p->acc ? p->acc : p->requires_grad ? ts_tensor_grad(p->U) : NULL;
                if (gr) held += (double)ts_tensor_numel(gr) * (double)ts_dtype_size(ts_tensor_dtype(gr));
            }
        }
        if (off || held > 0 || in_flight) {
            char hb[32];
            bytes_str(held, hb, sizeof hb);
            fprintf(f,
                    "gradient accumulation now: gradient sync off on %d of %d groups; %s of unreduced gradients held "
                    "(the next backward with sync on reduces them; an optimizer step before it does not see them)",
                    off, gw.n, hb);
            if (in_flight)
                fprintf(f, "; %d reduction%s in flight (is_last_backward false: it lands in the next backward)",
                        in_flight, in_flight == 1 ? "" : "s");
            fprintf(f, "\n");
        }
    }
    if (ferror(f)) st = ts_error(TS_ERR_IO, "ts_fsdp_summary: writing the summary failed");
done:
    summary_walk_free(&w);
    ts__free(TS_MEM_NN, gw.g);
    ts_named_params_free(&np);
    ts_named_params_free(&nb);
    return st;
}

ts_status ts_fsdp_summary(ts_module *module, FILE *f)
{
    if (!module || !f) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_fsdp_summary: NULL %s", module ? "FILE" : "module");
    ts_status st = write_summary(module, f);
    /* flushed, so that a full disk or a closed pipe is this call's error */
    if (!st && (fflush(f) != 0 || ferror(f)))
        st = ts_error(TS_ERR_IO, "ts_fsdp_summary: writing failed: %s", strerror(errno));
    return st;
}

ts_status ts_fsdp_summary_str(ts_module *module, char *buf, size_t cap, size_t *len_out)
{
    if (!module || !len_out || (cap && !buf))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_fsdp_summary_str: NULL argument");
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f) return ts_error(TS_ERR_NO_MEMORY, "ts_fsdp_summary_str: open_memstream failed");
    ts_status st = write_summary(module, f);
    if (fclose(f) && !st) st = ts_error(TS_ERR_NO_MEMORY, "ts_fsdp_summary_str: out of memory");
    if (!st) {
        if (cap) {
            size_t n = len < cap - 1 ? len : cap - 1;
            memcpy(buf, text, n);
            buf[n] = '\0';
        }
        *len_out = len;
    }
    free(text); /* open_memstream's buffer: libc's */
    return st;
}

/* ------------------------------------------------------------------ */
/* Collective figures per group and offload copies (TS_DISTRIBUTED_DEBUG) */
/* ------------------------------------------------------------------ */

ts_status ts_fsdp_print_stats(ts_module *module, FILE *f)
{
    if (!module || !f)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_fsdp_print_stats: %s is NULL", !module ? "module" : "f");
    ts__fsdp_groups_walk w;
    ts_status st = ts__fsdp_subtree_groups(module, &w);
    if (st) return st;
    bool ok = ts__fsdp_print_coll_stats(&w, f);
    ts__free(TS_MEM_NN, w.g);
    return ok ? TS_OK : ts_error(TS_ERR_IO, "ts_fsdp_print_stats: writing failed: %s", strerror(errno));
}

/* The offload policy's copies (ts_fsdp_offload_stats_get; offload.c counts them). */
static size_t block_bytes(const ts_tensor *t) { return t ? ts_tensor_storage(t)->block_bytes : 0; }

ts_status ts_fsdp_offload_stats_get(ts_module *module, ts_fsdp_offload_stats *out)
{
    if (!module || !out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_fsdp_offload_stats_get: %s is NULL", !module ? "module" : "out");
    ts__fsdp_groups_walk w = {0};
    ts_status st = ts__fsdp_subtree_groups(module, &w);
    if (st) return st;
    ts_fsdp_offload_stats s = {0};
    for (int i = 0; i < w.n; i++) {
        const fsdp_group *g = w.g[i];
        if (!g->off.on) continue;
        s.groups++;
        s.pinned_groups += g->off.pin;
        s.h2d_copies += g->off.h2d_copies;
        s.h2d_bytes += g->off.h2d_bytes;
        s.d2h_copies += g->off.d2h_copies;
        s.d2h_bytes += g->off.d2h_bytes;
        size_t host = block_bytes(g->sharded) + block_bytes(g->off.grad_host) + block_bytes(g->off.stage);
        s.host_bytes += host;
        if (g->off.pin) s.pinned_bytes += host;
    }
    ts__free(TS_MEM_NN, w.g);
    *out = s;
    return TS_OK;
}
