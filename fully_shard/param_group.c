/*
 * One FSDP parameter group's lifecycle (PyTorch's _fsdp_param_group.py):
 * building it from a call's parameters (the sharded buffer, the mesh's shard
 * and replicate groups), its reference count, unshard (the all-gather),
 * wait (copy-out into the unsharded parameters), reshard, and the gradient
 * reduction: post-backward packs the unsharded gradients and issues the
 * reduce-scatter (and HSDP's all-reduce), whose result is added into the
 * shards' gradients. On one host (and by default) both collectives are
 * copy-free (comm/coll_direct.h): the all-gather reads the peers' rows
 * straight into the unsharded parameters and the reduce-scatter reads
 * this rank's rows of the peers' unsharded gradients, summing them
 * straight into its output, bitwise the packed path's result, which
 * TS_FSDP_COPY_FREE=0 (or ts__fsdp_set_copy_free) keeps selectable.
 * Floor 4 (internal.h, "Floors"): may call floors 1-3 (common.c,
 * param.c, offload.c, persist.c).
 */
#include "fully_shard/internal.h"

#include "comm/comm.h"
#include "comm/comm_internal.h"
#include "tensor/internal.h"
#include "tensor/kernels.h"

#include <float.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ */
/* The copy-free switch                                               */
/* ------------------------------------------------------------------ */

static atomic_int g_copy_free = -1; /* -1: from TS_FSDP_COPY_FREE */

void ts__fsdp_set_copy_free(int on) { atomic_store(&g_copy_free, on < 0 ? -1 : on ? 1 : 0); }

/* A direct collective costs a descriptor exchange, a hand-off to its
 * worker and W - 1 acknowledgements whatever its size: about what a
 * copy of this many bytes costs here (the UCX transport's single-copy
 * bypass starts at the same size). Below it the packed path's one
 * small ring collective is cheaper: a model of 256 Linear(16, 16)
 * groups took 14x its unsharded step copy-free (bench_fsdp_overhead). */
#define COPY_FREE_MIN_BYTES ((int64_t)256 << 10)

bool ts__fsdp_copy_free(int W, int64_t unsharded_bytes)
{
    int v = atomic_load(&g_copy_free);
    if (v >= 0) return v != 0;
    const char *e = getenv("TS_FSDP_COPY_FREE");
    if (e && strcmp(e, "0") == 0) return false;
    if (e && strcmp(e, "1") == 0) return true;
    return W > 1 && unsharded_bytes >= COPY_FREE_MIN_BYTES;
}

static void drop_holds(ts_tensor **h, int n);

bool ts__fsdp_reduce_in_flight(const fsdp_group *g) { return g && (g->rs_req || g->rs_direct || g->rs_meta); }

/* [Note: meta step]
 * Inside ts_device_scope_enter(TS_DEVICE_META), or on a group whose
 * sharded buffer is meta, a training step plays through these hooks as it
 * runs for real, with no collective and no data: every buffer the real
 * step takes from the pool (all-gather output, the param_dtype copy, the
 * unsharded parameters' storages, the reduce-scatter input and output, the
 * cast back, the copy-free path's descriptor tensors and comm's pool
 * scratch) is taken as a meta storage at the same point and freed at the
 * same point, so the thread's ledger (tensor/meta.c) sees the pool's
 * allocations in the real order. A collective is skipped (ag_meta,
 * rs_meta mark it in flight) and completes when waited on; its
 * transport-side pool scratch is modelled with ts__meta_scratch or a meta
 * storage held as long as the request. The unused-parameter flags are
 * taken as "this rank's" (every rank is assumed to take the same path). */
/* ts__fsdp_group_meta (common.c) tells whether a group plays so. */

static void drop_holds(ts_tensor **h, int n)
{
    for (int i = 0; i < n; i++) {
        ts_tensor_free(h[i]);
        h[i] = NULL;
    }
}

/* A meta tensor of n elements of d held in *slot (the pool block a
 * skipped collective would hold). */
static ts_status hold(ts_dtype d, int64_t n, ts_tensor **slot)
{
    bool scoped = ts__meta_mode();
    if (!scoped && ts_device_scope_enter(TS_DEVICE_META)) return TS_ERR_INTERNAL;
    ts_status st = ts_tensor_empty(d, 1, &n, slot);
    if (!scoped) (void)ts_device_scope_exit();
    return st;
}

/* The copy-free collective's descriptors (comm/coll_direct.c, start),
 * and on more than one rank its acknowledgements (move: one int64 out, W
 * in), h[0..4). The acknowledgements are taken by the channel's worker
 * when it has moved the data, some time between the issue and the wait:
 * held from the issue here, the ledger's peak is the latest the real one
 * can be (it is up to their two blocks per collective in flight lower when
 * a worker had not got there yet). */
static ts_status hold_descs(const fsdp_group *g, bool rs, ts_tensor **h)
{
    int64_t nd = ts__direct_desc_numel(rs, g->n);
    ts_status st = hold(TS_I64, nd, &h[0]);
    if (!st) st = hold(TS_I64, nd * g->W, &h[1]);
    if (!st && g->W > 1) st = hold(TS_I64, 1, &h[2]);
    if (!st && g->W > 1) st = hold(TS_I64, g->W, &h[3]);
    return st;
}

/* The segment lists of the copy-free collectives, made once: parameter i's
 * part for rank j is its chunk's rows (counts in elements). */
static ts_status direct_segs(fsdp_group *g)
{
    if (g->dsegs) return TS_OK;
    size_t n = (size_t)(g->n ? g->n : 1);
    g->dsegs = ts__calloc(TS_MEM_NN, n, sizeof *g->dsegs);
    g->dcounts = ts__calloc(TS_MEM_NN, n * (size_t)g->W, sizeof *g->dcounts);
    g->rs_src = ts__calloc(TS_MEM_NN, n, sizeof *g->rs_src);
    if (!g->dsegs || !g->dcounts || !g->rs_src) return TS_ERR_NO_MEMORY;
    for (int i = 0; i < g->n; i++) {
        const fsdp_param *p = &g->params[i];
        for (int j = 0; j < g->W; j++) g->dcounts[(size_t)i * g->W + j] = p->chunks[j].rows * p->row_numel;
        g->dsegs[i] = (ts__dseg){NULL, g->udtype, p->off, g->dcounts + (size_t)i * g->W};
    }
    return TS_OK;
}

static void drop_rs_src(fsdp_group *g)
{
    for (int i = 0; g->rs_src && i < g->n; i++) {
        ts_tensor_free(g->rs_src[i]);
        g->rs_src[i] = NULL;
    }
}

/* ------------------------------------------------------------------ */
/* Reference counts                                                   */
/* ------------------------------------------------------------------ */

void ts__fsdp_group_free(fsdp_group *g)
{
    ts__fsdp_reg_drop_group(g);
    if (g->ag_req) {
        (void)ts_request_wait(g->ag_req);
        ts_request_free(g->ag_req);
    }
    if (g->rs_req) {
        (void)ts_request_wait(g->rs_req);
        ts_request_free(g->rs_req);
    }
    ts__direct_free(g->ag_direct);
    ts__direct_free(g->rs_direct);
    drop_holds(g->ag_hold, 4);
    drop_holds(g->rs_hold, 4);
    ts_comm_free(g->rsg);
    drop_rs_src(g);
    ts__free(TS_MEM_NN, g->rs_src);
    ts__free(TS_MEM_NN, g->dsegs);
    ts__free(TS_MEM_NN, g->dcounts);
    ts_tensor_free(g->ag_buf);
    ts_tensor_free(g->ag_in);
    ts_tensor_free(g->rs_in);
    ts_tensor_free(g->rs_out);
    ts_tensor_free(g->partial);
    for (int i = 0; i < g->n; i++) ts__fsdp_param_fini(&g->params[i]);
    ts__free(TS_MEM_NN, g->params);
    ts__fsdp_persist_free(g->persist, g->n_persist);
    ts_tensor_free(g->sharded);
    ts__fsdp_offload_fini(&g->off);
    ts_mesh_free(g->owned_mesh);
    ts__free(TS_MEM_NN, g);
}

fsdp_group *ts__fsdp_group_retain(fsdp_group *g)
{
    if (g) atomic_fetch_add(&g->refs, 1);
    return g;
}

void ts__fsdp_group_release(fsdp_group *g)
{
    if (g && atomic_fetch_sub(&g->refs, 1) == 1) ts__fsdp_group_free(g);
}

/* ------------------------------------------------------------------ */
/* Building a group                                                   */
/* ------------------------------------------------------------------ */

static bool is_float(ts_dtype d) { return d == TS_F32 || d == TS_F64 || d == TS_BF16 || d == TS_F16; }

/* Builds the group of the collected parameters (nothing changes on
 * error). */
ts_status ts__fsdp_group_new(const char *fn, ts__fsdp_collect *c, const ts_fsdp_options *o, int n_states,
                             fsdp_group **out)
{
    fsdp_group *g = ts__calloc(TS_MEM_NN, 1, sizeof *g);
    if (!g) return TS_ERR_NO_MEMORY;
    atomic_init(&g->refs, 1);
    g->user_policy = o->reshard_after_forward;
    g->every_n = o->reshard_every_n;
    g->n_states = n_states;
    g->reduce_grads = g->all_reduce_grads = g->reshard_after_backward = true;
    g->ar_op = TS_REDUCE_AVG;
    g->post_div = 1.0;
    ts_status st = TS_OK;
    if (o->mesh) {
        g->mesh = o->mesh;
    } else {
        ts_comm *w = ts_dist_world();
        int64_t shape[1] = {ts_comm_size(w)};
        const char *names[1] = {"dp"};
        if ((st = ts_mesh_new(w, "cpu", 1, shape, names, &g->owned_mesh))) goto fail;
        g->mesh = g->owned_mesh;
    }
    if (ts_mesh_ndim(g->mesh) == 1) {
        g->pg = ts_mesh_group(g->mesh, NULL);
    } else {
        g->pg = ts_mesh_group(g->mesh, ts_mesh_dim_name(g->mesh, 1));
        g->rg = ts_mesh_group(g->mesh, ts_mesh_dim_name(g->mesh, 0));
    }
    if (!g->pg || (ts_mesh_ndim(g->mesh) == 2 && !g->rg)) {
        st = ts_error(TS_ERR_INTERNAL, "%s: the mesh has no group for this rank", fn);
        goto fail;
    }
    g->W = ts_comm_size(g->pg);
    g->rank = ts_comm_rank(g->pg);
    g->n = c->n;
    if (c->n) {
        g->params = ts__calloc(TS_MEM_NN, (size_t)c->n, sizeof *g->params);
        if (!g->params) {
            st = TS_ERR_NO_MEMORY;
            goto fail;
        }
    }
    /* geometry and checks */
    for (int i = 0; i < c->n; i++) {
        ts_tensor *t = c->c[i].t;
        fsdp_param *p = &g->params[i];
        char other[TS__FSDP_FQN_MAX] = "";
        if (ts__fsdp_reg_owner(t, other, sizeof other) || ts_tensor_is_shard(t)) {
            st = ts_error(TS_ERR_INVALID_ARGUMENT,
                          "%s: parameter '%s' is shared with a parameter already managed by another FSDP group%s%s%s; "
                          "for shared (tied) parameters, shard the modules that use it in one call "
                          "(ts_fully_shard_group) so that they form one group",
                          fn, c->c[i].fqn, *other ? " ('" : "", other, *other ? "')" : "");
            goto fail;
        }
        if (ts_tensor_ndim(t) < 1) {
            st = ts_error(TS_ERR_INVALID_ARGUMENT,
                          "%s: fully_shard does not support 0-d parameters; make '%s' a 1-d tensor of one element", fn,
                          c->c[i].fqn);
            goto fail;
        }
        if (!is_float(ts_tensor_dtype(t))) {
            st = ts_error(TS_ERR_DTYPE, "%s: parameter '%s' is %s; only floating-point parameters can be sharded", fn,
                          c->c[i].fqn, ts_dtype_name(ts_tensor_dtype(t)));
            goto fail;
        }
        if (i > 0 && ts_tensor_dtype(t) != g->dtype) {
            st = ts_error(TS_ERR_DTYPE, "%s: one group needs one dtype: '%s' is %s, '%s' is %s", fn, c->c[0].fqn,
                          ts_dtype_name(g->dtype), c->c[i].fqn, ts_dtype_name(ts_tensor_dtype(t)));
            goto fail;
        }
        if (i > 0 && ts__is_meta(t) != ts__is_meta(c->c[0].t)) {
            int m = ts__is_meta(t) ? i : 0, r = m ? 0 : i;
            st = ts_error(TS_ERR_INVALID_ARGUMENT,
                          "%s: parameter '%s' is on the meta device and '%s' is not: one group's parameters are all "
                          "meta (deferred init: sharded without bytes, then ts_fsdp_materialize) or all real",
                          fn, c->c[m].fqn, c->c[r].fqn);
            goto fail;
        }
        if (ts__is_meta(t) && !ts__is_contiguous(t)) {
            st = ts_error(TS_ERR_UNSUPPORTED,
                          "%s: meta parameter '%s' is not contiguous: deferred init shards rows of contiguous "
                          "parameters only (make it with ts_param_new)",
                          fn, c->c[i].fqn);
            goto fail;
        }
        if (!ts__is_meta(t) && !ts_tensor_data(t) && ts_tensor_numel(t) > 0) {
            st = ts_error(TS_ERR_RELEASED, "%s: the storage of parameter '%s' is released", fn, c->c[i].fqn);
            goto fail;
        }
        g->dtype = ts_tensor_dtype(t);
        if ((st = ts__fsdp_param_init(p, g, t, c->c[i].fqn))) goto fail;
        g->shard_numel += p->c * p->row_numel;
        g->numel += p->numel;
        g->local_numel += p->local_rows * p->row_numel;
    }
    g->es = c->n ? ts_dtype_size(g->dtype) : 4;
    /* the policy's dtypes; equal dtypes mean no cast (FSDP2's
     * init_dtype_attrs). Every parameter of a group is floating. */
    const ts_mp_policy *mp = o->mp_policy;
    g->udtype = mp && c->n && mp->param_dtype != TS_DTYPE_KEEP ? mp->param_dtype : g->dtype;
    g->rdtype = mp && c->n && mp->reduce_dtype != TS_DTYPE_KEEP ? mp->reduce_dtype : g->udtype;
    g->ues = ts_dtype_size(g->udtype);
    g->res = ts_dtype_size(g->rdtype);
    g->copy_free = ts__fsdp_copy_free(g->W, g->shard_numel * g->W * (int64_t)g->ues);
    /* the sharded buffer, zero padded, and the shards as views of it; on
     * the meta device for meta parameters (materialize.c gives it bytes) */
    int64_t sn = g->shard_numel;
    if (c->n && ts__is_meta(c->c[0].t)) st = ts__tensor_new_meta(g->dtype, 1, &sn, &g->sharded);
    else st = ts_tensor_zeros(c->n ? g->dtype : TS_F32, 1, &sn, &g->sharded);
    if (st) goto fail;
    bool prev = ts_grad_mode_set(false);
    for (int i = 0; i < c->n && !st; i++) st = ts__fsdp_param_make_shard(&g->params[i], g, c->c[i].t);
    ts_grad_mode_set(prev);
    if (!st && o->offload_policy) st = ts__fsdp_offload_init(g, o->offload_policy, fn);
    if (st) goto fail;
    *out = g;
    return TS_OK;
fail:
    ts__fsdp_group_free(g);
    return st;
}

/* ------------------------------------------------------------------ */
/* Unshard, reshard                                                   */
/* ------------------------------------------------------------------ */

/* One collective of the group issued, of elements of es bytes: its
 * unsharded side is the padded group (W x shard_numel; the packed
 * reduce-scatter's flags not counted, so both paths count alike). */
static void count_issued(fsdp_coll_stats *s, const fsdp_group *g, size_t es)
{
    s->calls++;
    s->bytes += (uint64_t)g->W * (uint64_t)g->shard_numel * es;
}

static void set_slots(fsdp_group *g, bool unsharded)
{
    for (int i = 0; i < g->n; i++) ts__fsdp_param_set_slots(&g->params[i], unsharded);
}

/* Issues the group's all-gather (no-op unless sharded): of the shard
 * itself, or of its copy cast to param_dtype (ag_in, kept until the
 * all-gather completes). */
/* The copy-free all-gather: U's storage back, the peers' rows read into
 * it when waited (the input is the shard, or its copy in udtype / on the
 * device, ag_in, which the peers read until then). */
static ts_status unshard_direct(fsdp_group *g)
{
    ts_status st = direct_segs(g);
    bool meta = ts__fsdp_group_meta(g);
    const void *in = ts_tensor_data(g->sharded);
    if (!st && g->off.on && g->udtype != g->dtype) {
        ts_tensor *alias = NULL;
        if (!(st = ts__fsdp_offload_copy_in(g, &alias))) in = ts_tensor_data(g->ag_in); /* cast into ag_in */
    } else if (!st && g->off.on) { /* the host shard to the device (counted as offload's H2D copy) */
        if (!(st = ts_tensor_empty(g->udtype, 1, &g->shard_numel, &g->ag_in))) {
            ts__fsdp_offload_h2d(&g->off, ts_tensor_data(g->ag_in), ts_tensor_data(g->sharded),
                                 (size_t)g->shard_numel * g->es);
            in = ts_tensor_data(g->ag_in);
        }
    } else if (!st && g->udtype != g->dtype) {
        if (!(st = ts_tensor_empty(g->udtype, 1, &g->shard_numel, &g->ag_in))) {
            if (!meta)
                ts__buf_convert(g->udtype, ts_tensor_data(g->ag_in), g->dtype, ts_tensor_data(g->sharded),
                                g->shard_numel);
            in = ts_tensor_data(g->ag_in);
        }
    }
    for (int i = 0; i < g->n && !st; i++) {
        if ((st = ts__fsdp_param_restore_u(&g->params[i], g))) break;
        g->dsegs[i].full = ts_tensor_data(g->params[i].U);
    }
    if (!st && meta) {
        st = hold_descs(g, false, g->ag_hold);
        g->ag_meta = !st;
    } else if (!st) {
        st = ts__direct_all_gather(g->pg, g->udtype, in, g->shard_numel, g->n, g->dsegs, &g->ag_direct);
        if (!st) count_issued(&g->ag_stats, g, g->ues);
    }
    if (st) {
        drop_holds(g->ag_hold, 4);
        g->ag_meta = false;
        for (int i = 0; i < g->n; i++) ts__fsdp_param_release_u(&g->params[i]);
        ts_tensor_free(g->ag_in);
        g->ag_in = NULL;
        return st;
    }
    g->sharded_state = FSDP_UNSHARDING;
    return TS_OK;
}

ts_status ts__fsdp_unshard(fsdp_group *g)
{
    if (!g || g->sharded_state != FSDP_SHARDED || g->n == 0) return TS_OK; /* n == 0: only persistent params */
    /* meta shards play only inside a meta scope ([Note: meta step]) */
    ts_status mst = ts__meta_mode() ? TS_OK : ts__fsdp_group_check_materialized("fully_shard: unshard", g);
    if (mst) return mst;
    ts__fsdp_event("unshard", g->fqn);
    if (g->copy_free) return unshard_direct(g);
    bool meta = ts__fsdp_group_meta(g);
    int64_t n = g->shard_numel * g->W;
    ts_status st = ts_tensor_empty(g->udtype, 1, &n, &g->ag_buf);
    if (st) return st;
    ts_tensor *in = g->sharded, *alias = NULL;
    if (g->off.on) { /* the host shard copied to the device: into ag_buf's block, or cast into ag_in */
        if (!(st = ts__fsdp_offload_copy_in(g, &alias))) in = alias;
    } else if (g->udtype != g->dtype) {
        if (!(st = ts_tensor_empty(g->udtype, 1, &g->shard_numel, &g->ag_in))) {
            if (!meta)
                ts__buf_convert(g->udtype, ts_tensor_data(g->ag_in), g->dtype, ts_tensor_data(g->sharded),
                                g->shard_numel);
            in = g->ag_in;
        }
    }
    if (!st && meta) g->ag_meta = true; /* skipped: complete when waited on */
    else if (!st) st = ts_all_gather_into_tensor(g->pg, g->ag_buf, in, &g->ag_req);
    if (!st && !meta) count_issued(&g->ag_stats, g, g->ues);
    if (alias != g->ag_in) ts_tensor_free(alias);
    if (st) {
        ts_tensor_free(g->ag_buf);
        ts_tensor_free(g->ag_in);
        g->ag_buf = g->ag_in = NULL;
        return st;
    }
    g->sharded_state = FSDP_UNSHARDING;
    return TS_OK;
}

/* The end of an unshard: on failure the unsharded storage is released and
 * the group stays sharded; else the unsharded parameters go into the
 * slots. Returns st. */
static ts_status unshard_done(fsdp_group *g, ts_status st)
{
    if (st) {
        for (int i = 0; i < g->n; i++) ts__fsdp_param_release_u(&g->params[i]);
        g->sharded_state = FSDP_SHARDED;
        return st;
    }
    g->sharded_state = FSDP_UNSHARDED;
    set_slots(g, true);
    return TS_OK;
}

/* Waits for the all-gather and copies each parameter's rows out into its
 * unsharded tensor, which then fills the slots. */
ts_status ts__fsdp_wait_unshard(fsdp_group *g)
{
    if (!g || g->sharded_state != FSDP_UNSHARDING) return TS_OK;
    TS_TRACE_BEGIN(tw);
    if (g->ag_meta && g->copy_free) { /* a meta step's copy-free all-gather: U is restored, nothing to move */
        g->ag_meta = false;
        drop_holds(g->ag_hold, 4);
        ts_tensor_free(g->ag_in);
        g->ag_in = NULL;
        TS_TRACE_END(tw, "fsdp.wait_all_gather", "wait");
        return unshard_done(g, TS_OK);
    }
    if (g->ag_direct) { /* copy-free: the reads land in U */
        uint64_t t0 = ts_now_ns();
        ts_status st = ts__direct_wait(g->ag_direct);
        g->ag_stats.wait_ns += ts_now_ns() - t0;
        g->n_direct += ts__direct_was_direct(g->ag_direct);
        ts__direct_free(g->ag_direct);
        g->ag_direct = NULL;
        ts_tensor_free(g->ag_in);
        g->ag_in = NULL;
        TS_TRACE_END(tw, "fsdp.wait_all_gather", "wait");
        return unshard_done(g, st);
    }
    uint64_t t0 = ts_now_ns();
    ts_status st = g->ag_meta ? TS_OK : ts_request_wait(g->ag_req);
    if (!g->ag_meta) g->ag_stats.wait_ns += ts_now_ns() - t0;
    TS_TRACE_END(tw, "fsdp.wait_all_gather", "wait");
    if (g->ag_req) ts_request_free(g->ag_req);
    g->ag_req = NULL;
    g->ag_meta = false;
    ts_tensor_free(g->ag_in);
    g->ag_in = NULL;
    TS_TRACE_BEGIN(tc);
    if (!st) {
        const unsigned char *ag = ts_tensor_data(g->ag_buf);
        for (int i = 0; i < g->n && !st; i++) st = ts__fsdp_param_copy_out(&g->params[i], g, ag);
    }
    ts_tensor_free(g->ag_buf);
    g->ag_buf = NULL;
    TS_TRACE_END(tc, "fsdp.copy_out", "copy");
    return unshard_done(g, st);
}

/* Frees the unsharded parameters; the shards go back into the slots. */
ts_status ts__fsdp_reshard(fsdp_group *g)
{
    if (!g || g->sharded_state == FSDP_SHARDED) return TS_OK;
    ts_status st = TS_OK;
    if (g->sharded_state == FSDP_UNSHARDING) st = ts__fsdp_wait_unshard(g);
    if (g->sharded_state != FSDP_UNSHARDED) return st;
    ts__fsdp_event("reshard", g->fqn);
    set_slots(g, false);
    for (int i = 0; i < g->n; i++) ts__fsdp_param_release_u(&g->params[i]);
    g->sharded_state = FSDP_SHARDED;
    g->fwd_since_reshard = 0;
    return st;
}

/* ------------------------------------------------------------------ */
/* Gradient reduction                                                 */
/* ------------------------------------------------------------------ */

static bool is_hsdp(const fsdp_group *g) { return g->rg && ts_comm_size(g->rg) > 1; }

/* [Note: unused parameters]
 * A rank whose backward gave a parameter no gradient (a branch it did not
 * take, an expert its tokens skipped) still takes part in its group's
 * reduction with zeros there, and every rank then agrees on whether any
 * rank of the group (under HSDP: of the shard and replicate groups) had
 * a gradient for it: if one did, every rank's shard gets the reduced
 * gradient, the average over all ranks with that rank's contribution
 * zero (DDP's find_unused_parameters, FSDP2's zero-fill); if none did,
 * no rank gets one (the optimizer skips it). The agreement costs no
 * collective of its own: the copy-free reduce-scatter reads it from the
 * descriptors its ranks exchange anyway (a NULL source:
 * ts__direct_sourced); the packed one, the HSDP all-reduce and the
 * persistent parameters' bucket carry one flag element per parameter
 * after the data (rs_numel), reduced with it: nonzero where a rank had
 * a gradient. A flag is divided like the data (by W and by a divide
 * factor, before or after the sum: flag_value starts it at the divisor,
 * capped to stay finite in the reduce dtype); when a divide factor is so
 * large that the capped flag would underflow to zero (float16: above
 * 32768 * 2^14, flags_fit), the packed reduce-scatter's flags are reduced
 * on their own instead (reduce_flags_apart: one small float32 all-reduce,
 * on every rank alike since the plan is the same), so that the
 * parameter's (underflowed) gradient is not dropped. The HSDP all-reduce
 * and the bucket never divide their flags before the sum. A group whose pre-backward ran reduces even when this rank
 * has no gradient in it at all (ts__fsdp_post_backward), so that the
 * ranks' collectives stay matched. */

/* The reduction's output: the shard layout, then a flag per parameter. */
static int64_t rs_numel(const fsdp_group *g) { return g->shard_numel + g->n; }

/* What the reduce-scatter divides an element by (ts__fsdp_reduce_plan;
 * AVG also by W). */
static double flag_divisor(const fsdp_group *g, const fsdp_reduce_plan *plan)
{
    return plan->rs_pre * plan->rs_post * (plan->rs_op == TS_REDUCE_AVG ? g->W : 1);
}

static double flag_cap(ts_dtype d) { return d == TS_F16 ? 32768.0 : d == TS_F64 ? DBL_MAX / 4 : FLT_MAX / 4; }

/* A flag's value: the divisor, so that a flag comes out as the number of
 * ranks that had a gradient, kept finite in d (a larger value only makes
 * the result larger, never zero). */
static double flag_value(const fsdp_group *g, const fsdp_reduce_plan *plan)
{
    double v = flag_divisor(g, plan), cap = flag_cap(g->rdtype);
    return v < 1.0 ? 1.0 : v > cap ? cap : v;
}

/* Whether a flag survives the reduction: capped, it comes out as cap /
 * divisor, which must stay at least d's smallest normal (a float16
 * reduction with a divide factor above 32768 * 2^14, a float32 one with
 * one above about 1e75, would give 0 there). */
static bool flags_fit(const fsdp_group *g, const fsdp_reduce_plan *plan)
{
    double v = flag_divisor(g, plan), cap = flag_cap(g->rdtype);
    double tiny = g->rdtype == TS_F16 ? 0x1p-14 : g->rdtype == TS_F64 ? DBL_MIN : FLT_MIN;
    return v <= cap || cap / v >= tiny;
}

/* The flags reduced on their own, when they would not survive the
 * reduce-scatter (flags_fit): a float32 SUM over c of 1 where this rank
 * has a gradient, before the reduce-scatter, at the same point on every
 * rank; in_reduce becomes whether any rank had one. */
static ts_status reduce_flags_apart(ts_comm *c, fsdp_group *g)
{
    int64_t n = g->n;
    ts_tensor *t = NULL;
    ts_status st = ts_tensor_empty(TS_F32, 1, &n, &t);
    if (st) return st;
    if (ts__fsdp_group_meta(g)) { /* a meta step: this rank's flags stand */
        ts_tensor_free(t);
        return TS_OK;
    }
    float *f = ts_tensor_data(t);
    for (int i = 0; i < g->n; i++) f[i] = g->params[i].in_reduce ? 1.0f : 0.0f;
    st = ts_all_reduce(c, t, TS_REDUCE_SUM, NULL);
    for (int i = 0; !st && i < g->n; i++) g->params[i].in_reduce = f[i] != 0;
    ts_tensor_free(t);
    return st;
}

static void put_flag(ts_dtype d, unsigned char *at, double v) { ts__buf_convert(d, at, TS_F64, &v, 1); }

static bool flag_set(ts_dtype d, const unsigned char *at)
{
    double v = 0;
    ts__buf_convert(TS_F64, &v, d, at, 1);
    return v != 0;
}

/* Writes each parameter's flag (v where in_reduce, else 0) after the
 * shard layout at `base`. */
static void put_flags(const fsdp_group *g, unsigned char *base, double v)
{
    for (int i = 0; i < g->n; i++)
        put_flag(g->rdtype, base + (size_t)(g->shard_numel + i) * g->res, g->params[i].in_reduce ? v : 0.0);
}

/* in_reduce from the flags after the shard layout of `base`: whether any
 * rank had a gradient. */
static void read_flags(fsdp_group *g, const unsigned char *base)
{
    for (int i = 0; i < g->n; i++)
        g->params[i].in_reduce = flag_set(g->rdtype, base + (size_t)(g->shard_numel + i) * g->res);
}

/* A view of the reduced output `out` (1-d, the shard layout) at
 * parameter p's segment, in the shard's shape: the new gradient of a
 * shard that has none (FSDP2's new_sharded_grad as a view of
 * reduce_output). The padding rows after it are simply not viewed. */
static ts_status grad_view(const fsdp_param *p, ts_tensor *out, ts_tensor **view_out)
{
    int64_t strides[TS_MAX_DIMS];
    ts__contiguous_strides(p->ndim, ts_tensor_shape(p->S), strides);
    return ts__tensor_alias(out, p->ndim, ts_tensor_shape(p->S), strides, out->offset + p->off, view_out);
}

/* The pool scratch comm.c's reduce-scatter of the packed path holds
 * while it is in flight (ts__comm_reduce_scatter_scratch), held as a meta
 * storage until the reduction completes. */
static ts_status rs_meta_scratch(fsdp_group *g, const fsdp_reduce_plan *plan)
{
    size_t b = ts__comm_reduce_scatter_scratch(g->rsg ? g->rsg : g->pg, g->rdtype, rs_numel(g), plan->rs_pre);
    return b ? hold(TS_BOOL, (int64_t)b, &g->rs_hold[0]) : TS_OK;
}

/* The scratch of HSDP's all-reduce (synchronous: taken and given back). */
static ts_status hsdp_meta_scratch(const fsdp_group *g)
{
    size_t b[2];
    int n = ts__comm_all_reduce_scratch(g->rg, g->rdtype, rs_numel(g), b);
    ts__meta_scratch(n, b);
    return TS_OK;
}

/* The parameters leave the reduction (in_reduce cleared). With drop, the
 * shard gradients it was adding into are dropped (set to none), and a
 * warning names the group and `why`. Returns how many were dropped. */
static int end_reduce(fsdp_group *g, bool drop, const char *why)
{
    int dropped = 0;
    for (int i = 0; i < g->n; i++) {
        fsdp_param *p = &g->params[i];
        if (drop && p->in_reduce && ts_tensor_grad(p->S)) {
            (void)ts_tensor_set_grad(p->S, NULL);
            dropped++;
        }
        p->in_reduce = false;
    }
    if (dropped)
        ts_logf(TS_LOG_WARN, "fully_shard: group '%s': %s; %d shard gradient%s dropped (set to none)", g->fqn, why,
                dropped, dropped == 1 ? " is" : "s are");
    return dropped;
}

/* Waits for the group's reduce-scatter and, under HSDP, either keeps its
 * output in the partial sum (requires_all_reduce false) or all-reduces it
 * (with the partial sum added first); then each parameter's segment
 * becomes its shard's gradient, a view of the output (no gradient yet), or
 * is added into the gradient it has (the separate add: after a cast, an
 * HSDP all-reduce, an offload copy, on the packed path, or into
 * gradients that are not this group's views; accumulate_target). A
 * reduction that added straight into the gradients (g->rs_add) has
 * nothing left to do. */
ts_status ts__fsdp_finish_reduce(fsdp_group *g)
{
    if (!ts__fsdp_reduce_in_flight(g)) return TS_OK;
    TS_TRACE_BEGIN(tw);
    ts_status st;
    bool meta = ts__fsdp_group_meta(g);
    if (g->rs_meta) { /* a meta step: the skipped collective completes; this rank's flags stand */
        st = TS_OK;
        g->rs_meta = false;
        drop_holds(g->rs_hold, 4);
        drop_rs_src(g);
    } else if (g->rs_direct) { /* copy-free: this rank's rows read and summed into rs_out */
        uint64_t t0 = ts_now_ns();
        st = ts__direct_wait(g->rs_direct);
        g->rs_stats.wait_ns += ts_now_ns() - t0;
        g->n_direct += ts__direct_was_direct(g->rs_direct);
        /* whether any rank had a gradient: from the exchanged sources */
        for (int i = 0; !st && i < g->n; i++) g->params[i].in_reduce = ts__direct_sourced(g->rs_direct, i);
        ts__direct_free(g->rs_direct);
        g->rs_direct = NULL;
        drop_rs_src(g);
    } else {
        uint64_t t0 = ts_now_ns();
        st = ts_request_wait(g->rs_req);
        g->rs_stats.wait_ns += ts_now_ns() - t0;
        ts_request_free(g->rs_req);
        g->rs_req = NULL;
        /* summed over the ranks with the data, unless reduced apart */
        if (!st && !g->flags_apart) read_flags(g, ts_tensor_data(g->rs_out));
    }
    if (g->rs_add) { /* added into the shard gradients by the collective, piece by piece: done */
        g->rs_add = false;
        if (!st) g->n_rs_add++;
        /* failed part way: some pieces may be in; the gradients are
         * dropped (set to none) rather than left holding part of it */
        (void)end_reduce(g, st != TS_OK, "a gradient reduction adding into the shard gradients failed part way");
        ts_tensor_free(g->rs_out);
        g->rs_out = NULL;
        TS_TRACE_END(tw, "fsdp.wait_reduce", "wait");
        return st;
    }
    if (!st && is_hsdp(g) && !g->all_reduce_grads) { /* partial: no all-reduce, nothing into the shards yet */
        if (g->partial) {
            if (!meta) ts__buf_add(g->rdtype, ts_tensor_data(g->partial), ts_tensor_data(g->rs_out), g->shard_numel);
        } else {
            g->partial = g->rs_out;
            g->rs_out = NULL;
        }
        for (int i = 0; i < g->n; i++) {
            g->params[i].in_partial |= g->params[i].in_reduce;
            g->params[i].in_reduce = false;
        }
        ts_tensor_free(g->rs_in);
        ts_tensor_free(g->rs_out);
        g->rs_in = g->rs_out = NULL;
        TS_TRACE_END(tw, "fsdp.wait_reduce", "wait");
        return TS_OK;
    }
    if (!st && is_hsdp(g)) {
        if (g->partial) { /* the microbatches reduce-scattered without all-reduce */
            if (!meta) ts__buf_add(g->rdtype, ts_tensor_data(g->rs_out), ts_tensor_data(g->partial), g->shard_numel);
            ts_tensor_free(g->partial);
            g->partial = NULL;
            for (int i = 0; i < g->n; i++) {
                g->params[i].in_reduce |= g->params[i].in_partial;
                g->params[i].in_partial = false;
            }
        }
        /* the flags across the replicas, with the data (AVG keeps them nonzero) */
        if (meta) {
            st = hsdp_meta_scratch(g);
        } else {
            put_flags(g, ts_tensor_data(g->rs_out), 1.0);
            uint64_t t0 = ts_now_ns();
            st = ts_all_reduce(g->rg, g->rs_out, g->ar_op, NULL); /* blocking: its whole time is waited */
            g->ar_stats.wait_ns += ts_now_ns() - t0;
            g->ar_stats.calls++;
            g->ar_stats.bytes += (uint64_t)g->shard_numel * g->res; /* this rank's shard, the flags not counted */
            if (!st) read_flags(g, ts_tensor_data(g->rs_out));
            if (!st && g->post_div != 1.0)
                ts__buf_div(g->rdtype, ts_tensor_data(g->rs_out), g->shard_numel, g->post_div);
        }
    }
    TS_TRACE_END(tw, "fsdp.wait_reduce", "wait");
    /* reduced in rdtype; the shards' gradients are in their own dtype
     * (FSDP2: cast back, then, with offload, copied to the host) */
    if (!st && g->rdtype != g->dtype) {
        ts_tensor *conv = NULL;
        if (!(st = ts_tensor_empty(g->dtype, 1, &g->shard_numel, &conv))) {
            if (!meta)
                ts__buf_convert(g->dtype, ts_tensor_data(conv), g->rdtype, ts_tensor_data(g->rs_out), g->shard_numel);
            ts_tensor_free(g->rs_out);
            g->rs_out = conv;
        }
    }
    if (!st && g->off.on) st = ts__fsdp_offload_grads_out(g); /* to the host shard gradients */
    TS_TRACE_BEGIN(ta);
    bool copied = false; /* a pass over the data: the span is recorded only then */
    const unsigned char *out = st ? NULL : ts_tensor_data(g->rs_out);
    for (int i = 0; i < g->n && !st; i++) {
        fsdp_param *p = &g->params[i];
        if (!p->in_reduce) continue; /* no rank had a gradient for it: it keeps none (or its own) */
        p->in_reduce = false;
        const unsigned char *seg = out ? out + (size_t)p->off * g->es : NULL;
        int64_t ln = p->local_rows * p->row_numel;
        ts_tensor *gr = ts_tensor_grad(p->S);
        if (!gr) { /* its gradient is a view of the output, which lives as long as a view does */
            ts_tensor *view = NULL;
            if ((st = grad_view(p, g->rs_out, &view))) break;
            st = ts_tensor_set_grad(p->S, view);
            ts_tensor_free(view);
            g->n_grad_views++;
        } else if (ts_tensor_is_contiguous(gr) && (ts_tensor_data(gr) || (meta && ts__is_meta(gr)))) {
            if (seg && ts_tensor_data(gr))
                ts__buf_add(g->dtype, ts_tensor_data(gr), seg, ln); /* gr += seg: the separate add */
            g->n_grad_adds++;
            copied = true;
        } else { /* a non-contiguous gradient the user set: a new one, the old added */
            g->n_grad_adds++;
            copied = true;
            ts_tensor *ng = NULL, *sum = NULL;
            if ((st = ts_tensor_from_data(g->dtype, p->ndim, ts_tensor_shape(p->S), seg, &ng))) break;
            bool prev = ts_grad_mode_set(false);
            st = ts_add(ng, gr, &sum);
            ts_grad_mode_set(prev);
            ts_tensor_free(ng);
            if (!st) st = ts_tensor_set_grad(p->S, sum);
            ts_tensor_free(sum);
        }
    }
    (void)end_reduce(g, false, NULL);
    ts_tensor_free(g->rs_in);
    ts_tensor_free(g->rs_out); /* the views made above keep its storage */
    g->rs_in = g->rs_out = NULL;
    if (copied) TS_TRACE_END(ta, "fsdp.grad_into_shards", "copy");
    return st;
}

/* Drops a reduction without applying it (after a failed backward); an
 * accumulating one that already added into the shard gradients drops
 * those gradients too, with a warning. */
void ts__fsdp_discard_reduce(fsdp_group *g)
{
    if (g->rs_req) {
        (void)ts_request_wait(g->rs_req);
        ts_request_free(g->rs_req);
        g->rs_req = NULL;
    }
    /* an accumulating one (rs_add) has added into the gradients by the
     * end of its wait, all of it or, if it failed, some pieces: those
     * gradients now hold part of a reduction that is dropped, and are
     * dropped with it, said so (not left silently mixed) */
    g->rs_meta = false;
    drop_holds(g->rs_hold, 4);
    bool added = g->rs_add && g->rs_direct;
    ts__direct_free(g->rs_direct);
    g->rs_direct = NULL;
    g->rs_add = false;
    drop_rs_src(g);
    (void)end_reduce(g, added, "a dropped gradient reduction had been adding into the shard gradients");
    ts_tensor_free(g->rs_in);
    ts_tensor_free(g->rs_out);
    g->rs_in = g->rs_out = NULL;
}

/* dst (rdtype, contiguous) += src converted to dst's dtype. */
static ts_status add_converted(ts_tensor *dst, ts_tensor *src)
{
    ts_tensor *cg = NULL, *tmp = NULL;
    bool prev = ts_grad_mode_set(false);
    ts_status st = ts_contiguous(src, &cg);
    ts_grad_mode_set(prev);
    if (st) return st;
    ts_dtype d = ts_tensor_dtype(dst);
    int64_t n = ts_tensor_numel(dst);
    const void *from = ts_tensor_data(cg);
    if (ts_tensor_dtype(cg) != d) {
        if ((st = ts_tensor_empty(d, 1, &n, &tmp))) goto done;
        if (from) ts__buf_convert(d, ts_tensor_data(tmp), ts_tensor_dtype(cg), from, n);
        from = ts_tensor_data(tmp);
    }
    if (from && ts_tensor_data(dst)) ts__buf_add(d, ts_tensor_data(dst), from, n); /* meta: nothing to add */
done:
    ts_tensor_free(cg);
    ts_tensor_free(tmp);
    return st;
}

/* FSDP2's accumulate_unsharded_grad_if_needed: a gradient accumulated in
 * rdtype by earlier microbatches takes U's new one. */
static ts_status accumulate_unsharded(fsdp_param *p)
{
    ts_tensor *gr = p->requires_grad ? ts_tensor_grad(p->U) : NULL;
    if (!gr || !p->acc) return TS_OK;
    ts_status st = add_converted(p->acc, gr);
    if (!st) (void)ts_tensor_set_grad(p->U, NULL);
    return st;
}

/* FSDP2's to_accumulated_grad_if_needed (no sync): U's gradient moves to
 * acc in rdtype when its own dtype is another (bf16 compute, f32 reduce),
 * so that the microbatches are summed in rdtype. */
static ts_status to_accumulated(fsdp_param *p, const fsdp_group *g)
{
    ts_tensor *gr = p->requires_grad ? ts_tensor_grad(p->U) : NULL;
    if (!gr || p->acc || ts_tensor_dtype(gr) == g->rdtype) return TS_OK;
    bool prev = ts_grad_mode_set(false);
    ts_tensor *cg = NULL;
    ts_status st = ts_contiguous(gr, &cg);
    if (!st) st = ts_tensor_empty(g->rdtype, p->ndim, p->shape, &p->acc);
    ts_grad_mode_set(prev);
    if (!st) {
        if (ts_tensor_data(p->acc) && ts_tensor_data(cg))
            ts__buf_convert(g->rdtype, ts_tensor_data(p->acc), ts_tensor_dtype(cg), ts_tensor_data(cg), p->numel);
        (void)ts_tensor_set_grad(p->U, NULL);
    }
    ts_tensor_free(cg);
    return st;
}

void ts__fsdp_drop_unreduced(fsdp_group *g)
{
    for (int k = 0; k < g->n; k++) {
        (void)ts_tensor_set_grad(g->params[k].U, NULL);
        ts_tensor_free(g->params[k].acc);
        g->params[k].acc = NULL;
        g->params[k].in_partial = false;
    }
    ts_tensor_free(g->partial);
    g->partial = NULL;
}

static ts_status reshard_after_backward(fsdp_group *g)
{
    if (g->reshard_after_backward) return ts__fsdp_reshard(g);
    return ts__fsdp_wait_unshard(g); /* stays unsharded (an all-gather in flight is completed) */
}

/* Whether the reduction about to be issued can add straight into the
 * shard gradients (ts__direct_reduce_scatter_add, no output buffer and no
 * separate add): returns a 1-d alias of shard_numel elements over their
 * storage, in the shard layout (a new reference: g->rs_out), or NULL for
 * the separate add. Only when nothing stands between the reduce-scatter
 * and the gradients: the reduce dtype is the parameters' (no cast), no
 * HSDP all-reduce, no offload copy; on the last backward (a reduction a
 * backward leaves in flight, ts_fsdp_set_is_last_backward(false), must
 * not write into gradients the caller may read or zero before it lands);
 * and every parameter takes part (the separate add skips one without an
 * unsharded gradient now, whose segment still holds the peers' sums) and
 * has as shard gradient a contiguous tensor of one storage (the same for
 * all, not one the sources live in) at its own offset of the shard
 * layout, the layout covered by the storage: the views finish_reduce
 * made. The collective then writes each parameter's own elements only,
 * which is what the separate add would write, with the same bits. */
static ts_tensor *accumulate_target(fsdp_group *g, const fsdp_ctx *ctx)
{
    if (g->n == 0 || g->rdtype != g->dtype || is_hsdp(g) || g->partial || g->off.on || (ctx && ctx->not_last_backward))
        return NULL;
    const ts_tensor *g0 = ts_tensor_grad(g->params[0].S);
    if (!g0) return NULL;
    const ts_storage *s = g0->storage;
    int64_t base = g0->offset - g->params[0].off;
    if (base < 0 || (!s->data && !s->meta) || (size_t)(base + g->shard_numel) * g->es > s->nbytes) return NULL;
    for (int i = 0; i < g->n; i++) {
        const fsdp_param *p = &g->params[i];
        const ts_tensor *gr = ts_tensor_grad(p->S);
        if (!p->in_reduce || !gr || gr->storage != s || gr->offset != base + p->off || !ts_tensor_is_contiguous(gr))
            return NULL;
        if (g->rs_src[i] && g->rs_src[i]->storage == s) return NULL;
    }
    int64_t n = g->shard_numel;
    ts_tensor *alias = NULL;
    if (ts__tensor_alias(g0, 1, &n, (const int64_t[]){1}, base, &alias))
        return NULL; /* out of memory: the separate add */
    return alias;
}

/* The copy-free reduce-scatter of post-backward: each parameter's
 * gradient (acc in rdtype, or U's, made contiguous; NULL: zeros) is kept
 * in rs_src for the peers to read until the reduction completes. Its
 * output is a new rs_out whose padding rows are zeroed (the packed path
 * reduces zeros there), or, when accumulate_target allows, the shard
 * gradients themselves, into which the collective adds. Then the
 * gradients leave U and the group reshards, as in the packed path. */
static ts_status reduce_direct(fsdp_ctx *ctx, fsdp_group *g)
{
    ts_status st = direct_segs(g);
    if (st) {
        ts__fsdp_discard_reduce(g);
        return st;
    }
    for (int i = 0; i < g->n && !st; i++) {
        fsdp_param *p = &g->params[i];
        ts_tensor *gr = p->acc ? p->acc : p->requires_grad ? ts_tensor_grad(p->U) : NULL;
        p->in_reduce = gr != NULL;
        g->dsegs[i].full = NULL;
        g->dsegs[i].dtype = g->rdtype;
        if (gr) {
            bool prev = ts_grad_mode_set(false);
            st = ts_contiguous(gr, &g->rs_src[i]);
            ts_grad_mode_set(prev);
            if (st) break;
            g->dsegs[i].full = ts_tensor_data(g->rs_src[i]);
            g->dsegs[i].dtype = ts_tensor_dtype(g->rs_src[i]);
        }
        if (p->acc) {
            ts_tensor_free(p->acc);
            p->acc = NULL;
        } else if (gr) {
            (void)ts_tensor_set_grad(p->U, NULL);
        }
    }
    if (!st) {
        g->rs_out = accumulate_target(g, ctx);
        g->rs_add = g->rs_out != NULL;
        int64_t n_out = rs_numel(g); /* the flags' place after the shard layout (HSDP's all-reduce carries them) */
        if (!g->rs_add && !(st = ts_tensor_empty(g->rdtype, 1, &n_out, &g->rs_out))) {
            unsigned char *o = ts_tensor_data(g->rs_out);
            for (int i = 0; o && i < g->n; i++) {
                const fsdp_param *p = &g->params[i];
                if (p->local_rows < p->c)
                    memset(o + (size_t)(p->off + p->local_rows * p->row_numel) * g->res, 0,
                           (size_t)((p->c - p->local_rows) * p->row_numel) * g->res);
            }
        }
    }
    if (!st) st = reshard_after_backward(g);
    fsdp_reduce_plan plan = ts__fsdp_reduce_plan(g);
    if (!st && ts__fsdp_group_meta(g)) {
        st = hold_descs(g, true, g->rs_hold);
        g->rs_meta = !st;
    } else if (!st) {
        st = (g->rs_add ? ts__direct_reduce_scatter_add : ts__direct_reduce_scatter)(
            g->rsg ? g->rsg : g->pg, g->rdtype, ts_tensor_data(g->rs_out), g->shard_numel, g->n, g->dsegs, plan.rs_op,
            plan.rs_pre, plan.rs_post, g->rsg ? 1 : 0, &g->rs_direct);
        if (!st) count_issued(&g->rs_stats, g, g->res);
    }
    if (st) {
        ts__fsdp_discard_reduce(g);
        return st;
    }
    g->ar_op = plan.ar_op;
    g->post_div = plan.post;
    return TS_OK;
}

/* Post-backward of a group: without gradient sync, keeps the unsharded
 * gradients (in rdtype) for a later microbatch; otherwise packs them
 * (copy-in), drops them, reshards (per reshard_after_backward), and issues
 * the reduce-scatter, keeping one in flight per root (the previous one is
 * finished first). */
ts_status ts__fsdp_post_backward(fsdp_ctx *ctx, fsdp_group *g)
{
    bool any = false, trainable = false;
    ts_status st = TS_OK;
    for (int i = 0; i < g->n && !st; i++) {
        fsdp_param *p = &g->params[i];
        st = accumulate_unsharded(p);
        if (p->acc || (p->requires_grad && ts_tensor_grad(p->U))) any = true;
        trainable |= p->requires_grad;
    }
    if (st) return st;
    /* without a gradient here, the group still reduces (zeros) when its
     * backward ran, as it did on its peers, which may have gradients
     * ([Note: unused parameters]); otherwise (no backward through it, or
     * its post-backward already ran) there is nothing to reduce */
    if (!any && !(trainable && g->training == FSDP_PRE_BACKWARD)) return reshard_after_backward(g);
    if (!g->reduce_grads) { /* no sync: no communication, the gradients stay for the next microbatch */
        for (int i = 0; i < g->n && !st; i++) st = to_accumulated(&g->params[i], g);
        if (!st) st = reshard_after_backward(g);
        g->training = FSDP_POST_BACKWARD;
        return st;
    }
    TS_TRACE_BEGIN(t_hook);
    if (ctx && ctx->rs_pending) {
        st = ts__fsdp_finish_reduce(ctx->rs_pending);
        ctx->rs_pending = NULL;
        if (st) return st;
    }
    if (ts__fsdp_reduce_in_flight(g) && (st = ts__fsdp_finish_reduce(g))) return st;
    ts__fsdp_event("post_backward", g->fqn);
    if (g->copy_free) {
        st = reduce_direct(ctx, g);
        if (!st) g->training = FSDP_POST_BACKWARD;
        if (!st) {
            if (ctx) ctx->rs_pending = g;
            else st = ts__fsdp_finish_reduce(g);
        }
        ts__fsdp_trace_hook(t_hook, "fsdp.post_backward", g->fqn, g);
        return st;
    }
    TS_TRACE_BEGIN(tp);
    /* W blocks of the shard layout, each followed by the flags */
    int64_t n_out = rs_numel(g), n_in = n_out * g->W;
    if ((st = ts_tensor_empty(g->rdtype, 1, &n_in, &g->rs_in)) ||
        (st = ts_tensor_empty(g->rdtype, 1, &n_out, &g->rs_out))) {
        ts__fsdp_discard_reduce(g);
        return st;
    }
    unsigned char *in = ts_tensor_data(g->rs_in);
    for (int i = 0; i < g->n && !st; i++) {
        fsdp_param *p = &g->params[i];
        ts_tensor *gr = p->acc ? p->acc : p->requires_grad ? ts_tensor_grad(p->U) : NULL;
        p->in_reduce = gr != NULL;
        if ((st = ts__fsdp_param_pack_grad(p, g, in, n_out, gr))) break;
        if (p->acc) {
            ts_tensor_free(p->acc);
            p->acc = NULL;
        } else if (gr) {
            (void)ts_tensor_set_grad(p->U, NULL);
        }
    }
    fsdp_reduce_plan plan = ts__fsdp_reduce_plan(g);
    g->flags_apart = !flags_fit(g, &plan);
    if (!st && g->flags_apart) st = reduce_flags_apart(g->rsg ? g->rsg : g->pg, g);
    bool meta = ts__fsdp_group_meta(g);
    if (!st && !meta) {
        double v = flag_value(g, &plan);
        for (int r = 0; r < g->W; r++) put_flags(g, in + (size_t)(r * n_out) * g->res, v);
    }
    TS_TRACE_END(tp, "fsdp.pack_grads", "copy");
    if (!st) st = reshard_after_backward(g);
    if (!st && meta) {
        st = rs_meta_scratch(g, &plan);
        g->rs_meta = !st;
    } else if (!st) {
        st = ts_reduce_scatter_tensor(g->rsg ? g->rsg : g->pg, g->rs_out, g->rs_in, plan.rs_op, plan.rs_pre,
                                      plan.rs_post, &g->rs_req);
        if (!st) count_issued(&g->rs_stats, g, g->res);
    }
    if (st) {
        ts__fsdp_discard_reduce(g);
        return st;
    }
    g->ar_op = plan.ar_op;
    g->post_div = plan.post;
    g->training = FSDP_POST_BACKWARD;
    if (ctx) ctx->rs_pending = g;
    else st = ts__fsdp_finish_reduce(g);
    ts__fsdp_trace_hook(t_hook, "fsdp.post_backward", g->fqn, g);
    return st;
}

/* ------------------------------------------------------------------ */
/* Gathering in the parameters' own dtype                              */
/* ------------------------------------------------------------------ */

ts_status ts__fsdp_gather_full(fsdp_group *g, bool keep, ts_tensor **full)
{
    if (g->n == 0) return TS_OK; /* only persistent parameters: whole already */
    ts_status mst = ts__fsdp_group_check_materialized("fully_shard: gather", g);
    if (mst) return mst;
    int64_t n = g->shard_numel * g->W;
    ts_tensor *ag = NULL;
    ts_status st = ts_tensor_empty(g->dtype, 1, &n, &ag);
    if (st) return st;
    if ((st = ts_all_gather_into_tensor(g->pg, ag, g->sharded, NULL))) {
        ts_tensor_free(ag);
        return st;
    }
    const unsigned char *src = ts_tensor_data(ag);
    for (int k = 0; k < g->n && keep && !st; k++) {
        fsdp_param *p = &g->params[k];
        if ((st = ts_tensor_empty(g->dtype, p->ndim, p->shape, &full[k]))) break;
        unsigned char *dst = ts_tensor_data(full[k]);
        size_t rb = (size_t)p->row_numel * g->es;
        for (int r = 0; r < g->W; r++) {
            const fsdp_chunk *ch = &p->chunks[r];
            if (ch->rows > 0)
                memcpy(dst + (size_t)ch->row0 * rb, src + (size_t)ch->buf_off * g->es, (size_t)ch->rows * rb);
        }
    }
    ts_tensor_free(ag);
    return st;
}
