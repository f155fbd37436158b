/*
 * Deferred initialization (fully_shard.h, ts_fsdp_materialize;
 * docs/fully_shard.md, "Deferred initialization"): a model built on the
 * meta device is sharded without bytes (param_group.c makes the groups'
 * sharded buffers meta, param.c keeps each shard's full meta parameter in
 * meta_src), then materialized here: every meta storage under the root
 * gets bytes in place (zeros), so that every tensor over it (the shards,
 * the optimizer's references) stays the same object, and the initializers
 * recorded on the full parameters' storages are replayed into the rows
 * this rank holds. A checkpoint load materializes without the replay.
 * (The check that refuses to run a model that still has meta tensors:
 * common.c.)
 * Floor 6, its first file (internal.h, "Floors"): may call floors 1-5.
 */
#include "fully_shard/internal.h"

#include "nn/internal.h"
#include "tensor/internal.h"

#include <string.h>

/* ------------------------------------------------------------------ */
/* Bytes                                                              */
/* ------------------------------------------------------------------ */

/* Gives meta storage s zeroed bytes in place (pinned when pin); every
 * tensor over it then reads them. */
static ts_status storage_materialize(const char *fn, ts_storage *s, bool pin)
{
    if (!s->meta) return TS_OK;
    ts_status st = pin ? ts_storage_pin(s) : TS_OK; /* a meta storage pinned gets a pinned block */
    if (!st) st = ts_storage_materialize(s);
    if (st) {
        char why[512];
        snprintf(why, sizeof why, "%s", ts_last_error());
        return ts_error(st, "%s: %s", fn, why);
    }
    return TS_OK;
}

/* The bytes of a group: its sharded buffer (the host shard under an
 * offload policy, pinned as ts_fully_shard would have), padding zero. */
static ts_status group_materialize(const char *fn, fsdp_group *g)
{
    if (!ts__is_meta(g->sharded)) return TS_OK;
    ts_status st = storage_materialize(fn, ts_tensor_storage(g->sharded), g->off.on && g->off.pin);
    if (st) return st;
    return TS_OK;
}

/* ------------------------------------------------------------------ */
/* Materializing                                                      */
/* ------------------------------------------------------------------ */

/* Where the recorded initializers of one storage land: its elements
 * [begin, end) are written at dst, in dtype (a shard's rows of its full
 * parameter, or a whole parameter or buffer in place). A rank that holds
 * no row of a parameter still has one (begin == end): the replay draws
 * what the eager initializer draws either way. */
typedef struct mat_dst {
    ts_storage *src;
    int64_t begin, end;
    ts_dtype dtype;
    void *dst;
    ts__init_log log; /* src's recorded initializers, copied before src gets bytes (owned) */
} mat_dst;

typedef struct mat_list {
    mat_dst *d;
    int n, cap;
} mat_list;

/* Adds src's destination (dst is set once the bytes exist) with a copy of
 * its recorded initializers; a storage once (a tied weight, two tensors
 * over one storage). */
static ts_status dst_add(mat_list *l, ts_storage *src, int64_t begin, int64_t end, ts_dtype dtype)
{
    for (int k = 0; k < l->n; k++)
        if (l->d[k].src == src) return TS_OK;
    if (!ts__fsdp_grow((void **)&l->d, &l->cap, l->n + 1, sizeof *l->d)) return TS_ERR_NO_MEMORY;
    mat_dst *d = &l->d[l->n];
    *d = (mat_dst){src, begin, end, dtype, NULL, {0}};
    int n_ev = 0;
    const ts__init_event *ev = ts__init_events(src, &n_ev);
    ts_status st = n_ev ? ts__init_log_append(&d->log, ev, n_ev) : TS_OK;
    if (st) return st;
    l->n++;
    return TS_OK;
}

static void list_free(mat_list *l)
{
    for (int i = 0; i < l->n; i++) ts__init_log_fini(&l->d[i].log);
    ts__free(TS_MEM_NN, l->d);
}

/* [Note: materialize order]
 * Every recorded initializer of the model goes into one replay, sorted by
 * sequence number (ts__init_replay_targets interleaves the storages'
 * logs): the generator then advances as the eager construction advanced
 * it, whichever parameter each draw lands in. The orphaned initializers
 * this thread recorded from the model's first event on (storages freed
 * while the model was built: the first initializer of a weight then tied
 * to another, which may come after the model's last kept event) are drawn
 * and dropped in their place, since the eager build drew them too: build
 * and materialize one deferred model at a time on a generator. A rank that holds no
 * row of a parameter still replays its initializers over an empty range. */
static ts_status replay(const char *fn, mat_list *l, bool draw)
{
    uint64_t lo = UINT64_MAX, hi = 0;
    for (int i = 0; i < l->n; i++) {
        const ts__init_log *g = &l->d[i].log;
        if (!g->n) continue;
        if (g->events[0].seq < lo) lo = g->events[0].seq;
        if (g->events[g->n - 1].seq > hi) hi = g->events[g->n - 1].seq;
    }
    ts__init_log orphans = {0};
    ts_status st = lo <= hi ? ts__init_orphans_take(lo, ts__init_seq_next(), &orphans) : TS_OK;
    ts__init_target *t = NULL;
    if (!st && draw && !(t = ts__calloc(TS_MEM_NN, (size_t)l->n + 1, sizeof *t)))
        st = ts_error(TS_ERR_NO_MEMORY, "%s: out of memory", fn);
    if (!st && draw) {
        for (int i = 0; i < l->n; i++)
            t[i] = (ts__init_target){&l->d[i].log, l->d[i].begin, l->d[i].end, l->d[i].dtype, l->d[i].dst};
        t[l->n] = (ts__init_target){&orphans, 0, 0, TS_F32, NULL}; /* drawn and dropped */
        st = ts__init_replay_targets(l->n + 1, t);
    }
    ts__free(TS_MEM_NN, t);
    ts__init_log_fini(&orphans);
    /* replayed (or superseded by a load): never again, not even as orphans
     * when their storages are freed */
    if (!st)
        for (int i = 0; i < l->n; i++) ts__init_events_clear(l->d[i].src);
    return st;
}

ts_status ts__fsdp_materialize(const char *fn, ts_module *root, bool do_replay)
{
    ts__fsdp_groups_walk w = {0};
    ts_named_params np = {0};
    mat_list l = {0};
    ts_status st = ts__fsdp_idle_groups(fn, root, &w);
    if (st) return st;
    /* the groups' shards: rows [row0, row0 + rows) of the full parameter */
    for (int i = 0; i < w.n && !st; i++) {
        fsdp_group *g = w.g[i];
        if ((st = group_materialize(fn, g))) break;
        for (int k = 0; k < g->n && !st; k++) {
            fsdp_param *p = &g->params[k];
            if (!p->meta_src) continue;
            const fsdp_chunk *ch = &p->chunks[g->rank];
            int64_t b = p->meta_src->offset + ch->row0 * p->row_numel;
            if (!(st = dst_add(&l, p->meta_src->storage, b, b + ch->rows * p->row_numel, g->dtype)))
                l.d[l.n - 1].dst = ts_tensor_data(p->S);
        }
    }
    /* everything else in place, whole: parameters outside every group
     * (persistent ones too), buffers */
    if (!st) st = ts__module_entries(root, true, true, true, &np);
    for (int i = 0; i < np.n && !st; i++) {
        ts_tensor *t = *np.items[i].slot;
        ts_storage *s = ts_tensor_storage(t);
        if (!ts__is_meta(t)) continue;
        size_t es = ts_dtype_size(ts_tensor_dtype(t));
        if ((st = dst_add(&l, s, 0, (int64_t)(s->nbytes / es), ts_tensor_dtype(t)))) break;
        if ((st = storage_materialize(fn, s, false))) break;
        for (int k = 0; k < l.n; k++)
            if (l.d[k].src == s && !l.d[k].dst) l.d[k].dst = s->data; /* whole, in place */
    }
    if (!st) st = replay(fn, &l, do_replay);
    if (!st) /* initialized (or loaded next): the full meta parameters are done with */
        for (int i = 0; i < w.n; i++)
            for (int k = 0; k < w.g[i]->n; k++) {
                ts_tensor_free(w.g[i]->params[k].meta_src);
                w.g[i]->params[k].meta_src = NULL;
            }
    list_free(&l);
    ts_named_params_free(&np);
    ts__free(TS_MEM_NN, w.g);
    return st;
}

ts_status ts_fsdp_materialize(ts_module *root)
{
    if (!root) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_fsdp_materialize: root is NULL");
    return ts__fsdp_materialize("ts_fsdp_materialize", root, true);
}

ts_status ts_fsdp_materialize_empty(ts_module *root)
{
    if (!root) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_fsdp_materialize_empty: root is NULL");
    return ts__fsdp_materialize("ts_fsdp_materialize_empty", root, false);
}
