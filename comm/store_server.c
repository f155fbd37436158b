#define _GNU_SOURCE
/*
 * The rendezvous store's server (store.h has the contract): a private
 * libuv loop in its own thread that feeds each connection's bytes to the
 * protocol core (store_proto.c) and writes its replies.
 *
 * Waiter deadlines live on the server: GET and WAIT carry the client's
 * remaining time in milliseconds, the core parks the connection, and one
 * uv_timer armed at the earliest deadline answers TIMEOUT.
 */
#include "comm/store_internal.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

/* ------------------------------------------------------------------ */
/* Server: libuv loop in its own thread                              */
/* ------------------------------------------------------------------ */

typedef struct srv_conn srv_conn;

struct ts_store_server {
    uv_loop_t loop;
    uv_tcp_t listener;
    uv_async_t stop;
    uv_timer_t timer;
    uv_timer_t hello_timer; /* armed at the oldest pending connection's deadline */
    pthread_t thread;
    ts__store_core *core;
    int port;
    char addr[INET6_ADDRSTRLEN + 16];
    uint64_t hello_timeout_ms;
    unsigned max_pending;
    /* Connections that have not said a valid hello yet, oldest first (all
     * get the same timeout, so this is deadline order too). */
    srv_conn *pend_head, *pend_tail;
    _Atomic unsigned npending;
    _Atomic uint64_t over_cap, hello_expired, refused;
    bool own_user_only; /* no token: serve only this user's processes on this host */
};

struct srv_conn {
    uv_tcp_t tcp; /* first: the handle's data points back here */
    ts_store_server *srv;
    ts__store_conn pc;
    bool pending; /* on the server's pending list */
    bool refuse;  /* answer the hello with REFUSED (own_user_only) */
    uint64_t hello_deadline_ms;
    srv_conn *pprev, *pnext;
};

static unsigned g_hello_timeout_ms; /* ts__store_server_set_limits; 0: the default */
static unsigned g_max_pending;
static _Thread_local int tl_listen_error; /* ts__store_server_listen_error */

int ts__store_server_listen_error(void) { return tl_listen_error; }

void ts__store_server_set_limits(unsigned hello_timeout_ms, unsigned max_pending)
{
    g_hello_timeout_ms = hello_timeout_ms;
    g_max_pending = max_pending;
}

void ts__store_server_get_stats(const ts_store_server *s, ts__store_server_stats *out)
{
    memset(out, 0, sizeof *out);
    if (!s) return;
    ts_store_server *m = (ts_store_server *)s; /* atomics only */
    out->pending = atomic_load(&m->npending);
    out->over_cap = atomic_load(&m->over_cap);
    out->hello_expired = atomic_load(&m->hello_expired);
    out->refused = atomic_load(&m->refused);
    ts__store_core_warn_counts(m->core, &out->warn_lines, &out->warn_suppressed);
}

static void pending_remove(srv_conn *sc)
{
    if (!sc->pending) return;
    ts_store_server *srv = sc->srv;
    if (sc->pprev) sc->pprev->pnext = sc->pnext;
    else srv->pend_head = sc->pnext;
    if (sc->pnext) sc->pnext->pprev = sc->pprev;
    else srv->pend_tail = sc->pprev;
    sc->pprev = sc->pnext = NULL;
    sc->pending = false;
    atomic_fetch_sub(&srv->npending, 1);
}

static void on_hello_timer(uv_timer_t *t);

static void rearm_hello_timer(ts_store_server *srv)
{
    if (!srv->pend_head) {
        uv_timer_stop(&srv->hello_timer);
        return;
    }
    uint64_t now = uv_now(&srv->loop), d = srv->pend_head->hello_deadline_ms;
    uv_timer_start(&srv->hello_timer, on_hello_timer, d > now ? d - now : 0, 0);
}

static void format_addr(const struct sockaddr *sa, char *out, size_t n)
{
    char host[INET6_ADDRSTRLEN] = "?";
    int port = 0;
    if (sa->sa_family == AF_INET) {
        const struct sockaddr_in *a = (const struct sockaddr_in *)sa;
        inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
        port = ntohs(a->sin_port);
        snprintf(out, n, "%s:%d", host, port);
    } else if (sa->sa_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)sa;
        inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
        port = ntohs(a->sin6_port);
        snprintf(out, n, "[%s]:%d", host, port);
    } else {
        snprintf(out, n, "?");
    }
}

static void on_conn_closed(uv_handle_t *h)
{
    srv_conn *sc = h->data;
    ts__store_conn_fini(sc->srv->core, &sc->pc);
    ts__free(TS_MEM_COMM, sc);
}

static void conn_close(srv_conn *sc)
{
    pending_remove(sc);
    if (!uv_is_closing((uv_handle_t *)&sc->tcp)) uv_close((uv_handle_t *)&sc->tcp, on_conn_closed);
}

static void on_hello_timer(uv_timer_t *t)
{
    ts_store_server *srv = t->data;
    uint64_t now = uv_now(&srv->loop);
    while (srv->pend_head && srv->pend_head->hello_deadline_ms <= now) {
        srv_conn *sc = srv->pend_head;
        atomic_fetch_add(&srv->hello_expired, 1);
        ts__store_core_warnf(srv->core, "store %s: dropping client %s: no valid hello within %.1f s", srv->addr,
                             sc->pc.peer, (double)srv->hello_timeout_ms / 1000.0);
        conn_close(sc);
    }
    rearm_hello_timer(srv);
}

static void on_write(uv_write_t *req, int status)
{
    ts__store_reply *r = (ts__store_reply *)req;
    if (status < 0 && status != UV_ECANCELED) {
        srv_conn *sc = req->handle->data;
        ts_logf(TS_LOG_INFO, "store: writing to client %s failed: %s", sc->pc.peer, uv_strerror(status));
        conn_close(sc);
    }
    ts__free(TS_MEM_COMM, r);
}

static void server_send(ts__store_conn *pc, ts__store_reply *r, void *ctx)
{
    (void)ctx;
    srv_conn *sc = pc->user;
    if (!r) {
        conn_close(sc);
        return;
    }
    if (uv_is_closing((uv_handle_t *)&sc->tcp)) {
        ts__free(TS_MEM_COMM, r);
        return;
    }
    r->buf = uv_buf_init((char *)r->bytes, (unsigned)r->len);
    int rc = uv_write(&r->req, (uv_stream_t *)&sc->tcp, &r->buf, 1, on_write);
    if (rc < 0) {
        ts_logf(TS_LOG_INFO, "store: writing to client %s failed: %s", pc->peer, uv_strerror(rc));
        ts__free(TS_MEM_COMM, r);
        conn_close(sc);
    }
}

static void on_timer(uv_timer_t *t);

static void rearm_timer(ts_store_server *srv)
{
    uint64_t d = ts__store_core_next_deadline(srv->core);
    if (d == UINT64_MAX) {
        uv_timer_stop(&srv->timer);
        return;
    }
    uint64_t now = uv_now(&srv->loop);
    uv_timer_start(&srv->timer, on_timer, d > now ? d - now : 0, 0);
}

static void on_timer(uv_timer_t *t)
{
    ts_store_server *srv = t->data;
    ts__store_core_expire(srv->core, uv_now(&srv->loop));
    rearm_timer(srv);
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    (void)suggested;
    srv_conn *sc = h->data;
    unsigned char *p;
    size_t n;
    if (!ts__store_conn_space(sc->srv->core, &sc->pc, &p, &n)) {
        buf->base = NULL;
        buf->len = 0; /* read_cb gets UV_ENOBUFS */
        return;
    }
    buf->base = (char *)p;
    buf->len = n;
}

/* The kernel's socket tables print addresses as native-endian 32-bit
 * words of the network-order bytes, ports in hex: "0100007F:1F90". */
static void proc_net_addr(const struct sockaddr *sa, char *out, size_t n)
{
    if (sa->sa_family == AF_INET) {
        const struct sockaddr_in *a = (const struct sockaddr_in *)sa;
        uint32_t w;
        memcpy(&w, &a->sin_addr, 4);
        snprintf(out, n, "%08X:%04X", w, ntohs(a->sin_port));
    } else {
        const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)sa;
        uint32_t w[4];
        memcpy(w, &a->sin6_addr, 16);
        snprintf(out, n, "%08X%08X%08X%08X:%04X", w[0], w[1], w[2], w[3], ntohs(a->sin6_port));
    }
}

/* Whether the other end of an accepted connection is a socket of this
 * host (network namespace) owned by this process's user: the kernel knows
 * a socket with local and remote addresses swapped (sock_diag; else its
 * entry in /proc/net/tcp or tcp6), with our uid. A peer on another host
 * has none. */
static void unmap_v4(const struct sockaddr *sa, struct sockaddr_storage *out)
{
    memcpy(out, sa, sa->sa_family == AF_INET6 ? sizeof(struct sockaddr_in6) : sizeof(struct sockaddr_in));
    const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)sa;
    if (sa->sa_family == AF_INET6 && IN6_IS_ADDR_V4MAPPED(&a->sin6_addr)) {
        struct sockaddr_in v4;
        memset(&v4, 0, sizeof v4);
        v4.sin_family = AF_INET;
        v4.sin_port = a->sin6_port;
        memcpy(&v4.sin_addr, a->sin6_addr.s6_addr + 12, 4);
        memcpy(out, &v4, sizeof v4);
    }
}

/* Asks the kernel (sock_diag netlink, an exact lookup by the 4-tuple)
 * for the owner of the TCP socket whose local end is `peer` and remote end
 * `local`. 1: found (*uid_out set); 0: no such socket on this host; -1:
 * the query itself failed (netlink unavailable). */
static int diag_socket_uid(const struct sockaddr *peer, const struct sockaddr *local, unsigned long *uid_out)
{
    int fd = socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
    if (fd < 0) return -1;
    struct {
        struct nlmsghdr nlh;
        struct inet_diag_req_v2 r;
    } req;
    memset(&req, 0, sizeof req);
    req.nlh.nlmsg_len = sizeof req;
    req.nlh.nlmsg_type = SOCK_DIAG_BY_FAMILY;
    req.nlh.nlmsg_flags = NLM_F_REQUEST;
    req.r.sdiag_family = (uint8_t)peer->sa_family;
    req.r.sdiag_protocol = IPPROTO_TCP;
    req.r.idiag_states = ~0u;
    req.r.id.idiag_cookie[0] = INET_DIAG_NOCOOKIE;
    req.r.id.idiag_cookie[1] = INET_DIAG_NOCOOKIE;
    if (peer->sa_family == AF_INET) {
        const struct sockaddr_in *p = (const struct sockaddr_in *)peer, *l = (const struct sockaddr_in *)local;
        req.r.id.idiag_sport = p->sin_port;
        req.r.id.idiag_dport = l->sin_port;
        memcpy(req.r.id.idiag_src, &p->sin_addr, 4);
        memcpy(req.r.id.idiag_dst, &l->sin_addr, 4);
    } else {
        const struct sockaddr_in6 *p = (const struct sockaddr_in6 *)peer, *l = (const struct sockaddr_in6 *)local;
        req.r.id.idiag_sport = p->sin6_port;
        req.r.id.idiag_dport = l->sin6_port;
        memcpy(req.r.id.idiag_src, &p->sin6_addr, 16);
        memcpy(req.r.id.idiag_dst, &l->sin6_addr, 16);
    }
    struct sockaddr_nl nl;
    memset(&nl, 0, sizeof nl);
    nl.nl_family = AF_NETLINK;
    int rc = -1;
    if (sendto(fd, &req, sizeof req, 0, (struct sockaddr *)&nl, sizeof nl) == (ssize_t)sizeof req) {
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        long buf[1024]; /* aligned for nlmsghdr */
        ssize_t n = poll(&pfd, 1, 1000) == 1 ? recv(fd, buf, sizeof buf, 0) : -1;
        struct nlmsghdr *h = (struct nlmsghdr *)buf;
        if (n >= (ssize_t)sizeof *h && NLMSG_OK(h, (size_t)n)) {
            if (h->nlmsg_type == SOCK_DIAG_BY_FAMILY && h->nlmsg_len >= NLMSG_LENGTH(sizeof(struct inet_diag_msg))) {
                const struct inet_diag_msg *m = NLMSG_DATA(h);
                *uid_out = m->idiag_uid;
                rc = 1;
            } else if (h->nlmsg_type == NLMSG_ERROR && h->nlmsg_len >= NLMSG_LENGTH(sizeof(struct nlmsgerr))) {
                const struct nlmsgerr *e = NLMSG_DATA(h);
                rc = e->error == -ENOENT ? 0 : -1;
            }
        }
    }
    close(fd);
    return rc;
}

static bool peer_is_own_user(const struct sockaddr *peer_in, const struct sockaddr *local_in)
{
    if ((peer_in->sa_family != AF_INET && peer_in->sa_family != AF_INET6) ||
        (local_in->sa_family != AF_INET && local_in->sa_family != AF_INET6))
        return false;
    struct sockaddr_storage ps, lsa; /* a v4-mapped peer of a dual-stack socket is in the IPv4 table */
    unmap_v4(peer_in, &ps);
    unmap_v4(local_in, &lsa);
    const struct sockaddr *peer = (const struct sockaddr *)&ps, *local = (const struct sockaddr *)&lsa;
    if (peer->sa_family != local->sa_family || (peer->sa_family != AF_INET && peer->sa_family != AF_INET6))
        return false;
    unsigned long duid = 0;
    int d = diag_socket_uid(peer, local, &duid);
    if (d >= 0) return d == 1 && duid == (unsigned long)geteuid();
    /* No netlink: scan the kernel's table (O(sockets) per client). */
    char want_local[64], want_rem[64];
    proc_net_addr(peer, want_local, sizeof want_local);
    proc_net_addr(local, want_rem, sizeof want_rem);
    FILE *f = fopen(peer->sa_family == AF_INET ? "/proc/net/tcp" : "/proc/net/tcp6", "re");
    if (!f) return false;
    char line[512];
    bool found = false, own = false;
    unsigned long me = (unsigned long)geteuid();
    while (!found && fgets(line, sizeof line, f)) {
        char la[64], ra[64];
        unsigned long uid;
        if (sscanf(line, " %*s %63s %63s %*s %*s %*s %*s %lu", la, ra, &uid) != 3) continue;
        if (strcmp(la, want_local) == 0 && strcmp(ra, want_rem) == 0) {
            found = true;
            own = uid == me;
        }
    }
    fclose(f);
    return own;
}

static void on_read(uv_stream_t *stream, ssize_t nread, const uv_buf_t *buf)
{
    (void)buf;
    srv_conn *sc = stream->data;
    ts_store_server *srv = sc->srv;
    if (nread > 0 && sc->refuse) {
        /* Whatever it sent (its hello), the answer is REFUSED. */
        sc->pc.len = 0;
        ts__store_reply *r = ts__malloc(TS_MEM_COMM, sizeof *r + TS__STORE_RESP_FIXED + 4);
        if (r) {
            r->len = TS__STORE_RESP_FIXED + 4;
            memset(r->bytes, 0, r->len);
            ts__store_wr32(r->bytes, TS__STORE_RESP_FIXED);
            r->bytes[4] = TS__STORE_ST_REFUSED;
            server_send(&sc->pc, r, NULL);
        }
        conn_close(sc);
        return;
    }
    if (nread > 0) {
        if (!ts__store_conn_received(srv->core, &sc->pc, (size_t)nread, uv_now(&srv->loop))) conn_close(sc);
        else if (sc->pending && sc->pc.authed) pending_remove(sc);
        rearm_timer(srv);
    } else if (nread < 0) {
        if (nread != UV_EOF) ts_logf(TS_LOG_INFO, "store: client %s: %s", sc->pc.peer, uv_strerror((int)nread));
        else if (sc->pc.len > 0)
            ts_logf(TS_LOG_INFO, "store: client %s closed the connection in the middle of a frame", sc->pc.peer);
        conn_close(sc);
    }
}

static void on_connection(uv_stream_t *listener, int status)
{
    ts_store_server *srv = listener->data;
    if (status < 0) {
        ts_logf(TS_LOG_WARN, "store %s: accept failed: %s", srv->addr, uv_strerror(status));
        return;
    }
    srv_conn *sc = ts__malloc(TS_MEM_COMM, sizeof *sc);
    if (!sc) {
        ts_logf(TS_LOG_ERROR, "store %s: out of memory accepting a client", srv->addr);
        return;
    }
    memset(sc, 0, sizeof *sc);
    sc->srv = srv;
    ts__store_conn_init(srv->core, &sc->pc, NULL);
    sc->pc.user = sc;
    uv_tcp_init(&srv->loop, &sc->tcp);
    sc->tcp.data = sc;
    int rc = uv_accept(listener, (uv_stream_t *)&sc->tcp);
    if (rc < 0) {
        ts_logf(TS_LOG_WARN, "store %s: accept failed: %s", srv->addr, uv_strerror(rc));
        conn_close(sc);
        return;
    }
    uv_tcp_nodelay(&sc->tcp, 1);
    struct sockaddr_storage ss;
    memset(&ss, 0, sizeof ss);
    int sl = (int)sizeof ss;
    if (uv_tcp_getpeername(&sc->tcp, (struct sockaddr *)&ss, &sl) == 0)
        format_addr((struct sockaddr *)&ss, sc->pc.peer, sizeof sc->pc.peer);
    if (srv->own_user_only) {
        struct sockaddr_storage ls;
        int ll = (int)sizeof ls;
        if (uv_tcp_getsockname(&sc->tcp, (struct sockaddr *)&ls, &ll) != 0 ||
            !peer_is_own_user((struct sockaddr *)&ss, (struct sockaddr *)&ls)) {
            atomic_fetch_add(&srv->refused, 1);
            ts__store_core_warnf(srv->core,
                                 "store %s: refusing client %s: the store has no token, so it serves only "
                                 "processes of its own user on this host; set " TS_STORE_TOKEN_ENV
                                 " to the same secret on every rank",
                                 srv->addr, sc->pc.peer);
            sc->refuse = true; /* answered REFUSED when its hello comes (or dropped at the timeout) */
        }
    }
    if (atomic_load(&srv->npending) >= srv->max_pending) {
        atomic_fetch_add(&srv->over_cap, 1);
        ts__store_core_warnf(srv->core,
                             "store %s: closing client %s at once: the cap of %u connections waiting for their "
                             "hello is reached",
                             srv->addr, sc->pc.peer, srv->max_pending);
        conn_close(sc);
        return;
    }
    sc->pending = true;
    sc->hello_deadline_ms = uv_now(&srv->loop) + srv->hello_timeout_ms;
    sc->pprev = srv->pend_tail;
    if (srv->pend_tail) srv->pend_tail->pnext = sc;
    else srv->pend_head = sc;
    srv->pend_tail = sc;
    atomic_fetch_add(&srv->npending, 1);
    if (srv->pend_head == sc) rearm_hello_timer(srv);
    rc = uv_read_start((uv_stream_t *)&sc->tcp, on_alloc, on_read);
    if (rc < 0) {
        ts_logf(TS_LOG_WARN, "store %s: cannot read from client %s: %s", srv->addr, sc->pc.peer, uv_strerror(rc));
        conn_close(sc);
        return;
    }
    ts_logf(TS_LOG_DEBUG, "store %s: client %s connected", srv->addr, sc->pc.peer);
}

static void close_walk(uv_handle_t *h, void *arg)
{
    ts_store_server *srv = arg;
    if (uv_is_closing(h)) return;
    if (h->type == UV_TCP && h != (uv_handle_t *)&srv->listener) conn_close(h->data);
    else uv_close(h, NULL);
}

static void on_stop(uv_async_t *a)
{
    ts_store_server *srv = a->data;
    uv_walk(&srv->loop, close_walk, srv);
}

static void *server_thread(void *arg)
{
    ts_store_server *srv = arg;
    ts_trace_thread_name("store");
    uv_run(&srv->loop, UV_RUN_DEFAULT);
    return NULL;
}

/* Closes every handle of a loop that is not running (or has stopped) and
 * frees the server. */
static void server_free(ts_store_server *srv, bool loop_ready)
{
    if (loop_ready) {
        uv_walk(&srv->loop, close_walk, srv);
        uv_run(&srv->loop, UV_RUN_DEFAULT);
        int rc = uv_loop_close(&srv->loop);
        if (rc < 0) ts_logf(TS_LOG_WARN, "store %s: closing its loop: %s", srv->addr, uv_strerror(rc));
    }
    ts__store_core_free(srv->core);
    ts__free(TS_MEM_COMM, srv);
}

/* Every rank holds a few connections to the store (comm/dist.c): a
 * large job needs more descriptors than the usual soft limit of 1024, so
 * the server raises this process's soft RLIMIT_NOFILE to its hard limit
 * (once; a failure is only logged: the server then serves fewer). */
static void raise_nofile(void)
{
    static atomic_bool done;
    if (atomic_exchange(&done, true)) return;
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur >= rl.rlim_max) return;
    rlim_t was = rl.rlim_cur;
    rl.rlim_cur = rl.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &rl) != 0)
        ts_logf(TS_LOG_INFO, "store: cannot raise the open-file limit from %llu to %llu: %s", (unsigned long long)was,
                (unsigned long long)rl.rlim_max, strerror(errno));
    else
        ts_logf(TS_LOG_DEBUG, "store: open-file limit raised from %llu to %llu", (unsigned long long)was,
                (unsigned long long)rl.rlim_max);
}

ts_status ts_store_server_start(const char *host, int port, const char *token, ts_store_server **out)
{
    tl_listen_error = 0;
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_store_server_start: out is NULL");
    if (port < 0 || port > 65535)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_store_server_start: port %d is not in 0..65535", port);
    if (token && strnlen(token, TS_STORE_MAX_TOKEN + 1) > TS_STORE_MAX_TOKEN)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_store_server_start: the token is longer than %d bytes",
                        TS_STORE_MAX_TOKEN);
    if (!host) host = "127.0.0.1";
    if (strnlen(host, 256) > 255)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_store_server_start: host name longer than 255 bytes");
    raise_nofile();

    char portstr[16];
    snprintf(portstr, sizeof portstr, "%d", port);
    struct addrinfo hints = {0}, *ai = NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    int gai = getaddrinfo(host, portstr, &hints, &ai);
    if (gai != 0 || !ai) {
        ts_status st = ts_error(TS_ERR_IO, "store: cannot listen on %s:%d: cannot resolve '%s': %s", host, port, host,
                                gai_strerror(gai));
        if (ai) freeaddrinfo(ai);
        return st;
    }
    struct sockaddr_storage bind_addr;
    memset(&bind_addr, 0, sizeof bind_addr);
    memcpy(&bind_addr, ai->ai_addr, ai->ai_addrlen < sizeof bind_addr ? ai->ai_addrlen : sizeof bind_addr);
    freeaddrinfo(ai);

    ts_store_server *srv = ts__calloc(TS_MEM_COMM, 1, sizeof *srv);
    if (!srv) return TS_ERR_NO_MEMORY;
    format_addr((struct sockaddr *)&bind_addr, srv->addr, sizeof srv->addr);
    ts_status st = ts__store_core_new(token, server_send, srv, &srv->core);
    if (st != TS_OK) {
        ts__free(TS_MEM_COMM, srv);
        return st;
    }
    int rc = uv_loop_init(&srv->loop);
    if (rc < 0) {
        server_free(srv, false);
        return ts_error(TS_ERR_IO, "store: cannot listen on %s: loop: %s", host, uv_strerror(rc));
    }
    uv_tcp_init(&srv->loop, &srv->listener);
    srv->listener.data = srv;
    uv_timer_init(&srv->loop, &srv->timer);
    srv->timer.data = srv;
    uv_timer_init(&srv->loop, &srv->hello_timer);
    srv->hello_timer.data = srv;
    srv->hello_timeout_ms = g_hello_timeout_ms ? g_hello_timeout_ms : TS_STORE_HELLO_TIMEOUT_MS;
    srv->max_pending = g_max_pending ? g_max_pending : TS_STORE_MAX_PENDING;
    srv->own_user_only = !token || !*token;
    rc = uv_async_init(&srv->loop, &srv->stop, on_stop);
    srv->stop.data = srv;
    const char *step = "async";
    if (rc == 0) {
        step = "bind";
        rc = uv_tcp_bind(&srv->listener, (const struct sockaddr *)&bind_addr, 0);
    }
    if (rc == 0) {
        step = "listen";
        rc = uv_listen((uv_stream_t *)&srv->listener, 511, on_connection);
    }
    if (rc == 0) {
        struct sockaddr_storage ss;
        int sl = (int)sizeof ss;
        step = "getsockname";
        rc = uv_tcp_getsockname(&srv->listener, (struct sockaddr *)&ss, &sl);
        if (rc == 0) {
            format_addr((struct sockaddr *)&ss, srv->addr, sizeof srv->addr);
            srv->port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                                       : ((struct sockaddr_in *)&ss)->sin_port);
        }
    }
    if (rc < 0) {
        if (strcmp(step, "bind") == 0 || strcmp(step, "listen") == 0) tl_listen_error = rc;
        st = ts_error(TS_ERR_IO, "store: cannot listen on %s (%s): %s (%s)", srv->addr, step, uv_strerror(rc),
                      uv_err_name(rc));
        server_free(srv, true);
        return st;
    }

    /* The loop thread blocks asynchronous signals (they belong to the
     * application's threads) and SIGPIPE (a write to a client that went
     * away then fails with EPIPE instead of killing the process). */
    sigset_t all, old;
    sigfillset(&all);
    static const int sync_signals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGSYS, SIGABRT};
    for (size_t i = 0; i < sizeof sync_signals / sizeof sync_signals[0]; i++) sigdelset(&all, sync_signals[i]);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int prc = pthread_create(&srv->thread, NULL, server_thread, srv);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (prc != 0) {
        st = ts_error(TS_ERR_IO, "store: cannot start the thread serving %s: %s", srv->addr, strerror(prc));
        server_free(srv, true);
        return st;
    }
    ts_logf(TS_LOG_INFO, "store: serving on %s%s", srv->addr, token && *token ? "" : " (no token required)");
    *out = srv;
    return TS_OK;
}

int ts_store_server_port(const ts_store_server *s) { return s ? s->port : -1; }

void ts_store_server_stop(ts_store_server *s)
{
    if (!s) return;
    uv_async_send(&s->stop);
    pthread_join(s->thread, NULL);
    /* The loop has returned: every handle is closed and every
     * connection finished, so nothing waits any more. */
    server_free(s, true);
}
