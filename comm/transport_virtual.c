/* A virtual world: `size` ranks of which only this process's rank exists
 * (PyTorch's FakeProcessGroup). ts_fsdp_memory_estimate shards a model
 * built on the meta device over it to predict one rank of a job of `size`
 * ranks from one process: fully_shard's meta step skips its collectives
 * ([Note: meta step] in fully_shard/param_group.c), and a 1-d mesh over
 * the whole world makes no group. Any message a collective would send is
 * refused at once with TS_ERR_UNSUPPORTED saying so, so a collective on
 * it fails instead of waiting for peers that do not exist. */
#include "comm/comm_internal.h"
#include "comm/transport.h"

static ts_status refuse(ts_transport *t, int peer)
{
    return ts_error(TS_ERR_UNSUPPORTED,
                    "virtual communicator (rank %d of %d, no peers: a memory estimate's world) moves no data: a "
                    "collective with rank %d was attempted; only fully_shard's meta step (which skips its "
                    "collectives) and 1-d meshes over the whole world work on it",
                    t->rank, t->size, peer);
}

static ts_status v_send(ts_transport *t, int peer, const void *buf, size_t len, uint64_t tag, ts_xfer_cb cb, void *arg)
{
    (void)buf, (void)len, (void)tag, (void)cb, (void)arg;
    return refuse(t, peer);
}

static ts_status v_recv(ts_transport *t, int peer, void *buf, size_t len, uint64_t tag, ts_xfer_cb cb, void *arg)
{
    (void)buf, (void)len, (void)tag, (void)cb, (void)arg;
    return refuse(t, peer);
}

/* The optional receives and sends of several pieces, refused the same way:
 * present so that the collectives lay out their messages (and take their
 * pool scratch) as over UCX and the loopback, which have them. */
static ts_status v_recv_upto(ts_transport *t, int peer, void *buf, size_t len, uint64_t tag, ts_xfer_cb cb, void *arg,
                             size_t *len_out)
{
    (void)buf, (void)len, (void)tag, (void)cb, (void)arg, (void)len_out;
    return refuse(t, peer);
}

static ts_status v_sendv(ts_transport *t, int peer, const ts_iov *iov, int n, uint64_t tag, ts_xfer_cb cb, void *arg)
{
    (void)iov, (void)n, (void)tag, (void)cb, (void)arg;
    return refuse(t, peer);
}

static ts_status v_recvv_upto(ts_transport *t, int peer, const ts_iov *iov, int n, uint64_t tag, ts_xfer_cb cb,
                              void *arg, size_t *len_out)
{
    (void)iov, (void)n, (void)tag, (void)cb, (void)arg, (void)len_out;
    return refuse(t, peer);
}

static int v_progress(ts_transport *t)
{
    (void)t;
    return 0;
}
static ts_status v_arm(ts_transport *t)
{
    (void)t;
    return TS_OK;
}
static int v_wait_fd(ts_transport *t)
{
    (void)t;
    return -1;
}
static int v_failed_peer(ts_transport *t, ts_status *status_out)
{
    (void)t, (void)status_out;
    return -1;
}
static void v_cancel_all(ts_transport *t, ts_status status) { (void)t, (void)status; }
static void v_destroy(ts_transport *t) { ts__free(TS_MEM_COMM, t); }

static const ts_transport_vtable g_virtual_vt = {
    .name = "virtual",
    .send = v_send,
    .recv = v_recv,
    .progress = v_progress,
    .arm = v_arm,
    .wait_fd = v_wait_fd,
    .failed_peer = v_failed_peer,
    .cancel_all = v_cancel_all,
    .destroy = v_destroy,
    .recv_upto = v_recv_upto,
    .sendv = v_sendv,
    .recvv_upto = v_recvv_upto,
};

ts_status ts__virtual_world_new(int size, ts_comm **world_out)
{
    if (size < 1 || !world_out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "virtual world: %d ranks (at least 1), out %p", size,
                        (void *)world_out);
    ts_transport *t = ts__calloc(TS_MEM_COMM, 1, sizeof *t);
    if (!t) return ts_error(TS_ERR_NO_MEMORY, "virtual world: out of memory");
    *t = (ts_transport){.vt = &g_virtual_vt, .rank = 0, .size = size};
    ts_status st = ts__world_new(t, 0, world_out);
    if (st) ts__free(TS_MEM_COMM, t);
    return st;
}
