/*
 * fully_shard's floor 1 (internal.h, "Floors"): describing a group from
 * its fields alone: the FSDP vtable's extra_repr (the line ts_module_print
 * shows for an FSDP module), the reshard policy and mesh as text (also
 * summary.c's), and the collective figures of a list of groups
 * (ts_fsdp_print_stats, and TS_DISTRIBUTED_DEBUG when a root is freed:
 * state.c). May call: no other file of fully_shard/.
 */
#include "fully_shard/internal.h"

#include "comm/comm.h"

#include <stdio.h>
#include <string.h>

/* is_root < 0: not known yet (before the first forward, for print) */
void ts__fsdp_policy_str(const fsdp_group *g, bool resolved, int is_root, char *buf, size_t cap)
{
    ts_reshard_policy p = resolved ? g->policy : g->user_policy;
    const char *note = "";
    if (!resolved && p == TS_RESHARD_AUTO && is_root < 0) {
        snprintf(buf, cap, "auto (false for the root, true for the others)");
        return;
    }
    if (!resolved && p == TS_RESHARD_AUTO) {
        p = is_root ? TS_RESHARD_FALSE : TS_RESHARD_TRUE;
        note = is_root ? " (auto: the root keeps its parameters)" : " (auto)";
    }
    if (p == TS_RESHARD_EVERY_N && g->every_n == 1) p = TS_RESHARD_TRUE;
    switch (p) {
    case TS_RESHARD_FALSE: snprintf(buf, cap, "false%s", note); break;
    case TS_RESHARD_EVERY_N: snprintf(buf, cap, "every %d forwards%s", g->every_n, note); break;
    case TS_RESHARD_AUTO: snprintf(buf, cap, "auto"); break;
    default: snprintf(buf, cap, "true%s", note); break;
    }
}

void ts__fsdp_mesh_str(const ts_mesh *mesh, char *buf, size_t cap)
{
    size_t n = 0;
    buf[0] = '\0';
    for (int d = 0; d < ts_mesh_ndim(mesh) && n < cap; d++) {
        int k = snprintf(buf + n, cap - n, "%s%s=%lld", d ? ", " : "(", ts_mesh_dim_name(mesh, d),
                         (long long)ts_mesh_dim_size(mesh, d));
        n += k > 0 ? (size_t)k : 0;
    }
    if (n < cap) snprintf(buf + n, cap - n, ")");
}

/* The FSDP vtable's extra_repr: the original's, then this module's group. */
int ts__fsdp_extra_repr(const ts_module *m, char *buf, size_t cap)
{
    const fsdp_state *s = m->ext;
    char own[512] = "";
    if (s->orig_vt->extra_repr && s->orig_vt->extra_repr(m, own, sizeof own) < 0) own[0] = '\0';
    const char *sep = own[0] ? "; " : "";
    const fsdp_group *g = s->group;
    if (!g) return snprintf(buf, cap, "%s%sFSDP: no parameters of its own", own, sep);
    char pol[96], mesh[128];
    ts__fsdp_policy_str(g, s->ctx != NULL, s->ctx ? s->ctx->root == s : -1, pol, sizeof pol);
    ts__fsdp_mesh_str(g->mesh, mesh, sizeof mesh);
    char shared[64] = "";
    if (g->n_states > 1) snprintf(shared, sizeof shared, ", shared by %d modules", g->n_states);
    return snprintf(buf, cap,
                    "%s%sFSDP: %d param%s, %lld elements, %lld per rank + %lld padding in all, mesh %s, reshard "
                    "after forward: %s%s",
                    own, sep, g->n, g->n == 1 ? "" : "s", (long long)g->numel, (long long)g->shard_numel,
                    (long long)(g->shard_numel * g->W - g->numel), mesh, pol, shared);
}

/* ------------------------------------------------------------------ */
/* Collective figures per group (TS_DISTRIBUTED_DEBUG)                 */
/* ------------------------------------------------------------------ */

/* ", all_gather 6 (33280 bytes, wait 0.512 ms)" into buf at *n; nothing
 * when the kind issued none. */
static void coll_str(char *buf, size_t cap, size_t *n, const char *kind, const fsdp_coll_stats *s)
{
    if (!s->calls || *n >= cap) return;
    int k = snprintf(buf + *n, cap - *n, "%s%s %llu (%llu bytes, wait %.3f ms)", *n ? ", " : "", kind,
                     (unsigned long long)s->calls, (unsigned long long)s->bytes, (double)s->wait_ns / 1e6);
    *n += k > 0 ? (size_t)k : 0;
}

static void coll_add(fsdp_coll_stats *sum, const fsdp_coll_stats *s)
{
    sum->calls += s->calls;
    sum->bytes += s->bytes;
    sum->wait_ns += s->wait_ns;
}

/* The lines of ts_fsdp_print_stats for the groups w (see the header),
 * written to f; false when writing failed. */
bool ts__fsdp_print_coll_stats(const ts__fsdp_groups_walk *w, FILE *f)
{
    ts_comm *world = w->n ? ts_mesh_world(w->g[0]->mesh) : ts_dist_world();
    int rank = ts_comm_rank(world), size = ts_comm_size(world);
    fsdp_coll_stats sum[3] = {{0}};
    bool ok = true;
    for (int i = 0; i < w->n; i++) {
        const fsdp_group *g = w->g[i];
        char line[1024];
        size_t n = 0;
        coll_str(line, sizeof line, &n, "all_gather", &g->ag_stats);
        coll_str(line, sizeof line, &n, "reduce_scatter", &g->rs_stats);
        coll_str(line, sizeof line, &n, "all_reduce", &g->ar_stats);
        coll_add(&sum[0], &g->ag_stats);
        coll_add(&sum[1], &g->rs_stats);
        coll_add(&sum[2], &g->ar_stats);
        char mesh[128];
        ts__fsdp_mesh_str(g->mesh, mesh, sizeof mesh);
        ok &= fprintf(f, "[ts fsdp] rank %d/%d group '%s' (%d parameters, %lld elements, mesh %s): %s\n", rank, size,
                      g->fqn[0] ? g->fqn : "(root)", g->n, (long long)g->numel, mesh, n ? line : "no collectives") > 0;
    }
    char line[1024];
    size_t n = 0;
    coll_str(line, sizeof line, &n, "all_gather", &sum[0]);
    coll_str(line, sizeof line, &n, "reduce_scatter", &sum[1]);
    coll_str(line, sizeof line, &n, "all_reduce", &sum[2]);
    ok &= fprintf(f, "[ts fsdp] rank %d/%d total over %d group%s: %s\n", rank, size, w->n, w->n == 1 ? "" : "s",
                  n ? line : "no collectives") > 0;
    return fflush(f) == 0 && ok;
}
