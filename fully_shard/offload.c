/*
 * CPUOffloadPolicy (fully_shard.h; docs/fully_shard.md, "CPU offload"), mapped to a CPU
 * device. In FSDP2 the sharded parameters and gradients of an offloaded
 * group live in (pinned) CPU memory: the copy-in of each all-gather first
 * copies the shard to the GPU (H2D), the reduced gradient is copied back
 * (D2H) and accumulated on the CPU, and the optimizer steps there. Here
 * the compute device is the CPU, so "host" and "device" are the same
 * memory; what offload changes is where the host-side bytes live and
 * which copies run:
 *  - the sharded buffer (every parameter's shard is a view of it) is
 *    pinned when pin_memory (base.h, "Pinned host memory");
 *  - before the all-gather, the host shard is copied into this rank's
 *    block of the all-gather output (the device buffer), which then is
 *    the collective's input (without offload the collective copies the
 *    shard there itself);
 *  - the reduced gradient (device) is copied into the host gradient
 *    buffer (one per group, pinned when pin_memory, made once and reused;
 *    each shard's .grad is a view of its segment) or, when the shard has
 *    a gradient already (accumulation), into a host staging buffer that
 *    is then added into it;
 *  - the optimizer steps on the host shards and host gradients; its state
 *    is made from them, in host memory.
 * The copies are plain memcpy's of the same bytes, so training with and
 * without offload is bit-identical. They are counted per group
 * (ts_fsdp_offload_stats_get, summary.c) and traced ("fsdp.h2d", "fsdp.d2h").
 * Floor 3 (internal.h, "Floors"): may call floor 1; calls none of
 * fully_shard/ today.
 */
#define _GNU_SOURCE
#include "fully_shard/internal.h"

#include "tensor/internal.h"
#include "tensor/kernels.h"

#include <string.h>

ts_offload_policy ts_offload_policy_default(void) { return (ts_offload_policy){.pin_memory = true}; }

/* ------------------------------------------------------------------ */
/* Staging copies and host buffers                                    */
/* ------------------------------------------------------------------ */

static void staged(const char *name, uint64_t *copies, uint64_t *total, void *dst, const void *src, size_t bytes)
{
    TS_TRACE_BEGIN(t0);
    if (bytes && dst && src) memcpy(dst, src, bytes); /* meta step: no data */
    TS_TRACE_END(t0, name, "copy");
    (*copies)++;
    *total += bytes;
}

void ts__fsdp_offload_h2d(ts__fsdp_offload *o, void *dev_dst, const void *host_src, size_t bytes)
{
    staged("fsdp.h2d", &o->h2d_copies, &o->h2d_bytes, dev_dst, host_src, bytes);
}

void ts__fsdp_offload_h2d_cast(ts__fsdp_offload *o, void *dev_dst, ts_dtype dev_dtype, const void *host_src,
                               ts_dtype host_dtype, int64_t n)
{
    TS_TRACE_BEGIN(t0);
    if (dev_dst && host_src) ts__buf_convert(dev_dtype, dev_dst, host_dtype, host_src, n); /* meta step: no data */
    TS_TRACE_END(t0, "fsdp.h2d", "copy");
    o->h2d_copies++;
    o->h2d_bytes += (uint64_t)n * ts_dtype_size(dev_dtype);
}

void ts__fsdp_offload_d2h(ts__fsdp_offload *o, void *host_dst, const void *dev_src, size_t bytes)
{
    staged("fsdp.d2h", &o->d2h_copies, &o->d2h_bytes, host_dst, dev_src, bytes);
}

ts_status ts__fsdp_offload_place(const ts__fsdp_offload *o, ts_tensor *host)
{
    if (!o->pin || !host) return TS_OK;
    return ts_storage_pin(ts_tensor_storage(host));
}

ts_status ts__fsdp_offload_host_buffer(const ts__fsdp_offload *o, ts_dtype dtype, int64_t n, ts_tensor **out)
{
    ts_tensor *t = NULL;
    ts_status st = ts_tensor_empty(dtype, 1, &n, &t);
    if (st) return st;
    if (o->pin) {
        /* released first: the pinned block is the only one allocated */
        ts_storage *s = ts_tensor_storage(t);
        if (!(st = ts_storage_release(s)) && !(st = ts_storage_pin(s))) st = ts_storage_restore(s);
        if (st) {
            ts_tensor_free(t);
            return st;
        }
    }
    *out = t;
    return TS_OK;
}

void ts__fsdp_offload_fini(ts__fsdp_offload *o)
{
    ts_tensor_free(o->grad_host);
    ts_tensor_free(o->stage);
    o->grad_host = o->stage = NULL;
}

/* ------------------------------------------------------------------ */
/* The group's steps                                                  */
/* ------------------------------------------------------------------ */

static const char *device_name(ts_device d) { return d == TS_DEVICE_CPU ? "cpu" : "unknown"; }

ts_status ts__fsdp_offload_init(fsdp_group *g, const ts_offload_policy *policy, const char *fn)
{
    /* FSDP2's _validate_cpu_offload_params: every parameter on the CPU.
     * TS_DEVICE_CPU is the only device today, so this holds for every
     * tensor the library makes; the check is here for the next device. */
    char bad[1024] = "";
    size_t used = 0;
    for (int i = 0; i < g->n; i++) {
        ts_device d = ts_tensor_device(g->params[i].S);
        if (d == TS_DEVICE_CPU || ts__is_meta(g->params[i].S)) continue; /* meta: materialized on the host */
        int k =
            snprintf(bad + used, sizeof bad - used, "%s('%s', %s)", used ? ", " : "", g->params[i].fqn, device_name(d));
        if (k > 0) used = used + (size_t)k < sizeof bad ? used + (size_t)k : sizeof bad - 1;
    }
    if (used)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "%s: FSDP parameters should be materialized on CPU when enabling CPU offloading; found "
                        "parameters on a non-CPU device: [%s]",
                        fn, bad);
    if (!g->n) return TS_OK; /* a call that took no parameter makes no group */
    g->off.on = true;
    g->off.pin = policy->pin_memory;
    if (ts__is_meta(g->sharded)) return TS_OK; /* pinned when materialized (materialize.c) */
    return ts__fsdp_offload_place(&g->off, g->sharded);
}

ts_status ts__fsdp_offload_copy_in(fsdp_group *g, ts_tensor **in_out)
{
    int64_t n = g->shard_numel;
    if (g->udtype != g->dtype) { /* mixed precision: the copy casts on its way to the device */
        ts_status st = ts_tensor_empty(g->udtype, 1, &n, &g->ag_in);
        if (st) return st;
        ts__fsdp_offload_h2d_cast(&g->off, ts_tensor_data(g->ag_in), g->udtype, ts_tensor_data(g->sharded), g->dtype,
                                  n);
        *in_out = g->ag_in;
        return TS_OK;
    }
    ts_tensor *own = NULL;
    ts_status st =
        ts__tensor_alias(g->ag_buf, 1, &n, (const int64_t[]){1}, g->ag_buf->offset + (int64_t)g->rank * n, &own);
    if (st) return st;
    ts__fsdp_offload_h2d(&g->off, ts_tensor_data(own), ts_tensor_data(g->sharded),
                         (size_t)n * g->es); /* meta: no data */
    *in_out = own;
    return TS_OK;
}

/* The host gradient buffer, made once per group. A view of it that
 * something outside the shards' .grad still holds (a gradient kept after
 * zero_grad(set_to_none)) keeps the values it had: the group then starts
 * a new buffer rather than write over them. */
static ts_status grad_host(fsdp_group *g)
{
    ts__fsdp_offload *o = &g->off;
    if (o->grad_host) {
        ts_storage *s = ts_tensor_storage(o->grad_host);
        int held = 0;
        for (int i = 0; i < g->n; i++) {
            ts_tensor *gr = ts_tensor_grad(g->params[i].S);
            if (gr && ts_tensor_storage(gr) == s) held++;
        }
        if (atomic_load(&s->refcount) <= 1 + held) return TS_OK;
        ts_tensor_free(o->grad_host);
        o->grad_host = NULL;
    }
    return ts__fsdp_offload_host_buffer(o, g->dtype, g->shard_numel, &o->grad_host);
}

ts_status ts__fsdp_offload_grads_out(fsdp_group *g)
{
    const unsigned char *dev = ts_tensor_data(g->rs_out); /* NULL in a meta step: the copies move nothing */
    bool staging = false;
    ts_status st = TS_OK;
    for (int i = 0; i < g->n && !st; i++) {
        fsdp_param *p = &g->params[i];
        if (!p->in_reduce) continue;
        size_t off = (size_t)p->off * g->es, bytes = (size_t)(p->local_rows * p->row_numel) * g->es;
        ts_tensor *gr = ts_tensor_grad(p->S);
        if (gr) { /* accumulate: to the host, then added by the caller */
            if (!g->off.stage && (st = ts__fsdp_offload_host_buffer(&g->off, g->dtype, g->shard_numel, &g->off.stage)))
                break;
            unsigned char *h = ts_tensor_data(g->off.stage);
            ts__fsdp_offload_d2h(&g->off, h ? h + off : NULL, dev ? dev + off : NULL, bytes);
            staging = true;
            continue;
        }
        if ((st = grad_host(g))) break;
        unsigned char *h = ts_tensor_data(g->off.grad_host);
        ts__fsdp_offload_d2h(&g->off, h ? h + off : NULL, dev ? dev + off : NULL, bytes);
        int64_t strides[TS_MAX_DIMS];
        ts__contiguous_strides(p->ndim, ts_tensor_shape(p->S), strides);
        ts_tensor *view = NULL;
        if ((st = ts__tensor_alias(g->off.grad_host, p->ndim, ts_tensor_shape(p->S), strides,
                                   g->off.grad_host->offset + p->off, &view)))
            break;
        st = ts_tensor_set_grad(p->S, view);
        ts_tensor_free(view);
        g->n_grad_views++;
        p->in_reduce = false;
    }
    if (!st && staging) { /* the caller adds the rest from the host copy */
        ts_tensor_free(g->rs_out);
        g->rs_out = ts_tensor_retain(g->off.stage);
    }
    return st;
}
