#define _GNU_SOURCE
/*
 * The rendezvous store's blocking client (store.h has the contract):
 * blocking BSD sockets, poll-bounded reads and writes. The client bounds
 * every wait itself (one second past the server's own TIMEOUT answer), so
 * a hung server cannot hang a rank.
 */
#include "comm/store_internal.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------ */
/* Client                                                            */
/* ------------------------------------------------------------------ */

#define CLIENT_DEFAULT_TIMEOUT_S 300.0
#define CLIENT_MAX_TIMEOUT_S (30.0 * 86400.0)
/* A waiting call waits this much past its deadline for the server's own
 * TIMEOUT answer before giving up on the connection. */
#define CLIENT_GRACE_NS 1000000000ull
/* Budget for the quick checks that name what is missing after a timeout. */
#define CLIENT_REPORT_NS 2000000000ull

struct ts_store {
    int fd;           /* -1 once the connection is lost */
    bool peer_closed; /* the last loss was the server closing (EOF or reset) */
    double timeout_s;
    char addr[300];
};

typedef struct reply {
    uint8_t status;
    unsigned char *val; /* value_alloc'd, never NULL after success */
    size_t vlen;
    uint64_t arg;
} reply;

/* [Note: store values] The reply's value is the one buffer that reaches
 * the caller (ts_store_get, ts_store_compare_set: store.h), who releases
 * it with ts_store_value_free: through the allocator hook, counted under
 * TS_MEM_COMM. */
static unsigned char *value_alloc(size_t n) { return ts__malloc(TS_MEM_COMM, n); }

static void value_free(void *p) { ts__free(TS_MEM_COMM, p); }

void ts_store_value_free(void *value) { value_free(value); }

static void fmt_secs(char *out, size_t n, double s)
{
    if (s >= 0.1) snprintf(out, n, "%.1f", s);
    else snprintf(out, n, "%.3f", s);
}

static uint64_t deadline_after(double s)
{
    double ns = s * 1e9;
    uint64_t now = ts_now_ns();
    if (!(ns < (double)(UINT64_MAX - now - CLIENT_GRACE_NS * 4))) return UINT64_MAX - CLIENT_GRACE_NS * 4;
    return now + (uint64_t)ns;
}

static int remaining_ms(uint64_t deadline)
{
    uint64_t now = ts_now_ns();
    if (now >= deadline) return 0;
    uint64_t ms = (deadline - now + 999999) / 1000000;
    return ms > INT32_MAX ? INT32_MAX : (int)ms;
}

static void lose_connection(ts_store *s)
{
    if (s->fd >= 0) {
        close(s->fd);
        s->fd = -1;
    }
}

/* 1: ready; 0: the deadline passed; -1: error (errno). */
static int wait_fd(int fd, short events, uint64_t deadline)
{
    for (;;) {
        struct pollfd pfd = {.fd = fd, .events = events};
        int ms = remaining_ms(deadline);
        int r = poll(&pfd, 1, ms);
        if (r > 0) return 1;
        if (r == 0) {
            if (ms == 0 || ts_now_ns() >= deadline) return 0;
            continue;
        }
        if (errno != EINTR) return -1;
    }
}

/* After a non-blocking send or receive on fd failed: 1 to try again
 * (interrupted, or fd is ready for `events` again); 0: the deadline
 * passed; -1: a real error (errno). */
static int io_retry(int fd, short events, uint64_t deadline)
{
    if (errno == EINTR) return 1;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return wait_fd(fd, events, deadline);
    return -1;
}

static ts_status io_timeout(ts_store *s, const char *what, uint64_t started, uint64_t deadline)
{
    char secs[32];
    fmt_secs(secs, sizeof secs, (double)(deadline - started) / 1e9);
    lose_connection(s);
    return ts_error(TS_ERR_TIMEOUT, "store %s: no answer from the store at %s within %s s", what, s->addr, secs);
}

static ts_status send_all(ts_store *s, const char *what, struct iovec *iov, int cnt, uint64_t started,
                          uint64_t deadline)
{
    while (cnt > 0) {
        struct msghdr m = {0};
        m.msg_iov = iov;
        m.msg_iovlen = (size_t)cnt;
        ssize_t w = sendmsg(s->fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0) {
            int r = io_retry(s->fd, POLLOUT, deadline);
            if (r == 0) return io_timeout(s, what, started, deadline);
            if (r > 0) continue;
            int e = errno;
            lose_connection(s);
            s->peer_closed = e == ECONNRESET || e == EPIPE;
            return ts_error(TS_ERR_COMM, "store %s: sending to the store at %s failed: %s", what, s->addr, strerror(e));
        }
        size_t done = (size_t)w;
        while (cnt > 0 && done >= iov->iov_len) {
            done -= iov->iov_len;
            iov++;
            cnt--;
        }
        if (cnt > 0) {
            iov->iov_base = (char *)iov->iov_base + done;
            iov->iov_len -= done;
        }
    }
    return TS_OK;
}

static ts_status recv_all(ts_store *s, const char *what, void *buf, size_t n, uint64_t started, uint64_t deadline,
                          bool hello)
{
    char *p = buf;
    while (n > 0) {
        ssize_t r = recv(s->fd, p, n, MSG_DONTWAIT);
        if (r > 0) {
            p += r;
            n -= (size_t)r;
            continue;
        }
        if (r == 0) {
            lose_connection(s);
            s->peer_closed = true;
            return ts_error(TS_ERR_COMM, "store %s: the store at %s closed the connection%s", what, s->addr,
                            hello ? " before answering" : "");
        }
        int w = io_retry(s->fd, POLLIN, deadline);
        if (w == 0) return io_timeout(s, what, started, deadline);
        if (w > 0) continue;
        int e = errno;
        lose_connection(s);
        s->peer_closed = e == ECONNRESET;
        return ts_error(TS_ERR_COMM, "store %s: receiving from the store at %s failed: %s%s", what, s->addr,
                        strerror(e), hello && e == ECONNRESET ? " before answering" : "");
    }
    return TS_OK;
}

/* One request and its answer. `a` and `b` make the value (for
 * COMPARE_SET: expected and desired, after their u32 length). The whole
 * exchange must finish by `deadline`. On success r->val is malloc'd. */
static ts_status roundtrip(ts_store *s, const char *what, uint8_t op, const char *key, size_t klen, const void *a,
                           size_t an, const void *b, size_t bn, uint64_t arg, uint64_t deadline, reply *r)
{
    if (s->fd < 0)
        return ts_error(TS_ERR_COMM, "store %s: the connection to the store at %s was lost earlier", what, s->addr);
    uint64_t started = ts_now_ns();
    bool cas = op == TS__STORE_OP_COMPARE_SET;
    size_t vlen = (cas ? 4 : 0) + an + bn;
    unsigned char head[9], mid[8], tail[8];
    ts__store_wr32(head, (uint32_t)(TS__STORE_REQ_FIXED + klen + vlen));
    head[4] = op;
    ts__store_wr32(head + 5, (uint32_t)klen);
    ts__store_wr32(mid, (uint32_t)vlen);
    if (cas) ts__store_wr32(mid + 4, (uint32_t)an);
    ts__store_wr64(tail, arg);
    struct iovec iov[6];
    int cnt = 0;
    iov[cnt++] = (struct iovec){head, sizeof head};
    if (klen) iov[cnt++] = (struct iovec){(void *)key, klen};
    iov[cnt++] = (struct iovec){mid, cas ? 8u : 4u};
    if (an) iov[cnt++] = (struct iovec){(void *)a, an};
    if (bn) iov[cnt++] = (struct iovec){(void *)b, bn};
    iov[cnt++] = (struct iovec){tail, sizeof tail};
    ts_status st = send_all(s, what, iov, cnt, started, deadline);
    if (st != TS_OK) return st;

    bool hello = op == TS__STORE_OP_HELLO;
    unsigned char rh[9];
    st = recv_all(s, what, rh, sizeof rh, started, deadline, hello);
    if (st != TS_OK) return st;
    uint32_t body = ts__store_rd32(rh), rvlen = ts__store_rd32(rh + 5);
    if (rvlen > TS_STORE_MAX_VALUE || body != TS__STORE_RESP_FIXED + rvlen || rh[4] >= TS__STORE_ST_COUNT_) {
        lose_connection(s);
        return ts_error(TS_ERR_COMM, "store %s: malformed answer from the store at %s (body %u, value %u, status %u)",
                        what, s->addr, body, rvlen, rh[4]);
    }
    unsigned char *val = value_alloc(rvlen ? rvlen : 1);
    if (!val) {
        lose_connection(s);
        return ts_error(TS_ERR_NO_MEMORY, "store %s: out of memory for an answer of %u bytes", what, rvlen);
    }
    unsigned char ra[8];
    st = recv_all(s, what, val, rvlen, started, deadline, hello);
    if (st == TS_OK) st = recv_all(s, what, ra, sizeof ra, started, deadline, hello);
    if (st != TS_OK) {
        value_free(val);
        return st;
    }
    r->status = rh[4];
    r->val = val;
    r->vlen = rvlen;
    r->arg = ts__store_rd64(ra);
    return TS_OK;
}

/* An answer status the caller did not expect. Frees the reply. */
static ts_status unexpected(ts_store *s, const char *what, reply *r)
{
    value_free(r->val);
    r->val = NULL;
    if (r->status == TS__STORE_ST_NO_MEMORY)
        return ts_error(TS_ERR_NO_MEMORY, "store %s: the store at %s is out of memory", what, s->addr);
    lose_connection(s);
    return ts_error(TS_ERR_COMM, "store %s: unexpected answer %u from the store at %s", what, r->status, s->addr);
}

static ts_status check_client(const char *fn, const ts_store *s)
{
    if (!s) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: the store client is NULL", fn);
    return TS_OK;
}

static ts_status check_key(const char *fn, const char *key, size_t *klen_out)
{
    if (!key) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: key is NULL", fn);
    size_t n = strnlen(key, TS_STORE_MAX_KEY + 1);
    if (n > TS_STORE_MAX_KEY)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: key '%.200s...' is longer than %d bytes", fn, key,
                        TS_STORE_MAX_KEY);
    *klen_out = n;
    return TS_OK;
}

/* check_client, then check_key. */
static ts_status check_client_key(const char *fn, const ts_store *s, const char *key, size_t *klen_out)
{
    ts_status st = check_client(fn, s);
    return st == TS_OK ? check_key(fn, key, klen_out) : st;
}

static ts_status check_value(const char *fn, const char *name, const void *v, size_t n)
{
    if (!v && n) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %s is NULL with a length of %zu", fn, name, n);
    if (n > TS_STORE_MAX_VALUE)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %s of %zu bytes is over the limit of %u bytes", fn, name, n,
                        TS_STORE_MAX_VALUE);
    return TS_OK;
}

static int try_connect(const struct addrinfo *ai, uint64_t deadline, int *err)
{
    int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
        *err = errno;
        return -1;
    }
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) return fd;
    if (errno != EINPROGRESS) {
        *err = errno;
        close(fd);
        return -1;
    }
    int w = wait_fd(fd, POLLOUT, deadline);
    if (w <= 0) {
        *err = w == 0 ? ETIMEDOUT : errno;
        close(fd);
        return -1;
    }
    int soerr = 0;
    socklen_t sl = sizeof soerr;
    if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) < 0) soerr = errno;
    if (soerr) {
        *err = soerr;
        close(fd);
        return -1;
    }
    return fd;
}

static void sleep_ns(uint64_t ns)
{
    struct timespec ts = {(time_t)(ns / 1000000000ull), (long)(ns % 1000000000ull)};
    while (nanosleep(&ts, &ts) < 0 && errno == EINTR) {}
}

/* Says hello on the fresh connection s->fd. On failure the connection is
 * gone (s->peer_closed says whether the server closed it unanswered). */
static ts_status say_hello(ts_store *s, const char *token, size_t tlen, uint64_t deadline)
{
    int fl = fcntl(s->fd, F_GETFL);
    if (fl >= 0) fcntl(s->fd, F_SETFL, fl & ~O_NONBLOCK); /* blocking; reads and writes use MSG_DONTWAIT and poll */
    int one = 1;
    setsockopt(s->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);

    /* At least a second for the hello even when connecting took all the time. */
    uint64_t hello_deadline = deadline;
    if (hello_deadline < ts_now_ns() + CLIENT_GRACE_NS) hello_deadline = ts_now_ns() + CLIENT_GRACE_NS;
    reply r;
    s->peer_closed = false;
    ts_status st =
        roundtrip(s, "hello", TS__STORE_OP_HELLO, "", 0, token, tlen, NULL, 0, TS__STORE_PROTOCOL, hello_deadline, &r);
    if (st != TS_OK) {
        lose_connection(s);
        return st;
    }
    if (r.status == TS__STORE_ST_OK && r.arg == TS__STORE_PROTOCOL) {
        value_free(r.val);
        return TS_OK;
    }
    if (r.status == TS__STORE_ST_BAD_TOKEN) {
        value_free(r.val);
        lose_connection(s);
        return ts_error(TS_ERR_COMM,
                        "store hello: the store at %s rejected the token (%s): every rank must use the job's "
                        "token (" TS_STORE_TOKEN_ENV ", as the launcher sets it)",
                        s->addr, tlen ? "a wrong one" : "none was given");
    }
    if (r.status == TS__STORE_ST_REFUSED) {
        value_free(r.val);
        lose_connection(s);
        return ts_error(TS_ERR_COMM,
                        "store hello: the store at %s has no token and serves only processes of its own user on "
                        "its own host; give every rank the same secret in " TS_STORE_TOKEN_ENV
                        " (e.g. `export " TS_STORE_TOKEN_ENV "=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \\n')`"
                        " and `mpirun -x " TS_STORE_TOKEN_ENV " ...`; srun passes the environment on)",
                        s->addr);
    }
    st = unexpected(s, "hello", &r);
    lose_connection(s);
    return st;
}

ts_status ts_store_connect(const char *host, int port, const char *token, double timeout_s, ts_store **out)
{
    static const char fn[] = "ts_store_connect";
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: out is NULL", fn);
    if (port <= 0 || port > 65535) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: port %d is not in 1..65535", fn, port);
    if (!(timeout_s >= 0) || isinf(timeout_s))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: timeout %g s is not a finite number >= 0", fn, timeout_s);
    if (!host) host = "127.0.0.1";
    if (!*host || strnlen(host, 256) > 255)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: host name is empty or longer than 255 bytes", fn);
    if (!token) {
        token = getenv(TS_STORE_TOKEN_ENV);
        if (!token) token = "";
    }
    size_t tlen = strnlen(token, TS_STORE_MAX_TOKEN + 1);
    if (tlen > TS_STORE_MAX_TOKEN)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: the token is longer than %d bytes", fn, TS_STORE_MAX_TOKEN);

    ts_store *s = ts__calloc(TS_MEM_COMM, 1, sizeof *s);
    if (!s) return TS_ERR_NO_MEMORY;
    s->fd = -1;
    s->timeout_s = CLIENT_DEFAULT_TIMEOUT_S;
    snprintf(s->addr, sizeof s->addr, strchr(host, ':') ? "[%s]:%d" : "%s:%d", host, port);

    char portstr[16], secs[32];
    snprintf(portstr, sizeof portstr, "%d", port);
    fmt_secs(secs, sizeof secs, timeout_s);
    uint64_t deadline = deadline_after(timeout_s);
    uint64_t backoff = 10000000ull; /* 10 ms, doubling to 200 ms */
    int last_err = 0, closed_early = 0;
    for (;;) {
        struct addrinfo hints = {0}, *res = NULL;
        hints.ai_family = AF_UNSPEC;
        hints.ai_socktype = SOCK_STREAM;
        hints.ai_flags = AI_NUMERICSERV;
        int gai = getaddrinfo(host, portstr, &hints, &res);
        if (gai != 0 && gai != EAI_AGAIN) {
            ts_status st = ts_error(TS_ERR_COMM, "store: cannot resolve the store's address %s: %s", s->addr,
                                    gai == EAI_SYSTEM ? strerror(errno) : gai_strerror(gai));
            ts__free(TS_MEM_COMM, s);
            return st;
        }
        if (gai == 0) {
            for (struct addrinfo *ai = res; ai && s->fd < 0; ai = ai->ai_next)
                s->fd = try_connect(ai, deadline, &last_err);
            freeaddrinfo(res);
        } else {
            last_err = EAGAIN;
        }
        if (s->fd >= 0) {
            ts_status st = say_hello(s, token, tlen, deadline);
            if (st == TS_OK) break;
            if (!s->peer_closed) {
                ts__free(TS_MEM_COMM, s);
                return st;
            }
            /* Closed before any answer: a server at its cap of pending
             * connections does that. Try again until the deadline. */
            closed_early++;
            s->peer_closed = false;
        }
        uint64_t now = ts_now_ns();
        if (now >= deadline) {
            ts_status st;
            if (closed_early)
                st = ts_error(TS_ERR_TIMEOUT,
                              "store: cannot connect to the store at %s within %s s: it closed the connection "
                              "before answering the hello %d times (too many clients waiting to say hello?)",
                              s->addr, secs, closed_early);
            else
                st = ts_error(TS_ERR_TIMEOUT, "store: cannot connect to the store at %s within %s s: %s", s->addr, secs,
                              gai == EAI_AGAIN ? "name resolution failed" : strerror(last_err));
            ts__free(TS_MEM_COMM, s);
            return st;
        }
        sleep_ns(deadline - now < backoff ? deadline - now : backoff);
        backoff = backoff * 2 > 200000000ull ? 200000000ull : backoff * 2;
    }
    *out = s;
    return TS_OK;
}

void ts_store_close(ts_store *s)
{
    if (!s) return;
    lose_connection(s);
    ts__free(TS_MEM_COMM, s);
}

void ts_store_set_timeout(ts_store *s, double timeout_s)
{
    if (!s || !(timeout_s > 0)) return;
    s->timeout_s = timeout_s > CLIENT_MAX_TIMEOUT_S ? CLIENT_MAX_TIMEOUT_S : timeout_s;
}

/* The server's share of a waiting call: the milliseconds left. */
static uint64_t wait_arg(uint64_t deadline) { return (uint64_t)remaining_ms(deadline); }

static void describe(char *what, size_t n, const char *verb, const char *key)
{
    snprintf(what, n, "%s '%.200s%s'", verb, key, strlen(key) > 200 ? "..." : "");
}

static ts_status do_set(ts_store *s, const char *what, const char *key, size_t klen, const void *v, size_t n,
                        uint64_t deadline)
{
    reply r;
    ts_status st = roundtrip(s, what, TS__STORE_OP_SET, key, klen, v, n, NULL, 0, 0, deadline, &r);
    if (st != TS_OK) return st;
    if (r.status != TS__STORE_ST_OK) return unexpected(s, what, &r);
    value_free(r.val);
    return TS_OK;
}

ts_status ts_store_set(ts_store *s, const char *key, const void *value, size_t len)
{
    static const char fn[] = "ts_store_set";
    size_t klen = 0;
    ts_status st = check_client_key(fn, s, key, &klen);
    if (st == TS_OK) st = check_value(fn, "value", value, len);
    if (st != TS_OK) return st;
    char what[256];
    describe(what, sizeof what, "set", key);
    return do_set(s, what, key, klen, value, len, deadline_after(s->timeout_s));
}

/* GET (value wanted) or WAIT for one key until `deadline`. TS_ERR_TIMEOUT
 * when the server says the key was not set in time (message written only
 * when `report`). */
static ts_status do_wait(ts_store *s, const char *what, uint8_t op, const char *key, size_t klen, uint64_t deadline,
                         double timeout_s, bool report, reply *r)
{
    ts_status st =
        roundtrip(s, what, op, key, klen, NULL, 0, NULL, 0, wait_arg(deadline), deadline + CLIENT_GRACE_NS, r);
    if (st != TS_OK) return st;
    if (r->status == TS__STORE_ST_OK) return TS_OK;
    if (r->status == TS__STORE_ST_TIMEOUT) {
        value_free(r->val);
        r->val = NULL;
        if (!report) return TS_ERR_TIMEOUT;
        char secs[32];
        fmt_secs(secs, sizeof secs, timeout_s);
        return ts_error(TS_ERR_TIMEOUT, "store %s: key not set within %s s (store at %s)", what, secs, s->addr);
    }
    return unexpected(s, what, r);
}

ts_status ts_store_get(ts_store *s, const char *key, void **value_out, size_t *len_out)
{
    static const char fn[] = "ts_store_get";
    size_t klen = 0;
    ts_status st = check_client_key(fn, s, key, &klen);
    if (st == TS_OK && (!value_out || !len_out))
        st = ts_error(TS_ERR_INVALID_ARGUMENT, "%s: value_out and len_out are required", fn);
    if (st != TS_OK) return st;
    char what[256];
    describe(what, sizeof what, "get", key);
    reply r;
    st = do_wait(s, what, TS__STORE_OP_GET, key, klen, deadline_after(s->timeout_s), s->timeout_s, true, &r);
    if (st != TS_OK) return st;
    *value_out = r.val;
    *len_out = r.vlen;
    return TS_OK;
}

/* 1 present, 0 absent, <0 an error status. */
static int do_check(ts_store *s, const char *what, const char *key, size_t klen, uint64_t deadline, ts_status *err)
{
    reply r;
    ts_status st = roundtrip(s, what, TS__STORE_OP_CHECK, key, klen, NULL, 0, NULL, 0, 0, deadline, &r);
    if (st == TS_OK && r.status != TS__STORE_ST_OK && r.status != TS__STORE_ST_NOT_FOUND) st = unexpected(s, what, &r);
    if (st != TS_OK) {
        *err = st;
        return -1;
    }
    value_free(r.val);
    return r.status == TS__STORE_ST_OK;
}

ts_status ts_store_check(ts_store *s, const char *key)
{
    static const char fn[] = "ts_store_check";
    size_t klen = 0;
    ts_status st = check_client_key(fn, s, key, &klen);
    if (st != TS_OK) return st;
    char what[256];
    describe(what, sizeof what, "check", key);
    int present = do_check(s, what, key, klen, deadline_after(s->timeout_s), &st);
    if (present < 0) return st;
    if (!present) return ts_error(TS_ERR_NOT_FOUND, "store %s: key not set (store at %s)", what, s->addr);
    return TS_OK;
}

/* Appends to a bounded list ("'a', 'b'"), ending in "..." once full. */
static void list_add(char *buf, size_t cap, size_t *used, bool *full, const char *item)
{
    if (*full) return;
    size_t need = strlen(item) + 2;
    if (*used + need + 8 >= cap) {
        snprintf(buf + *used, cap - *used, "%s...", *used ? ", " : "");
        *full = true;
        return;
    }
    *used += (size_t)snprintf(buf + *used, cap - *used, "%s%s", *used ? ", " : "", item);
}

/* The keys a waiting call waits for in turn: the caller's own
 * (ts_store_wait) or "<prefix>/arrived/<rank>" for ranks 0..n
 * (ts_store_rendezvous). */
typedef struct key_seq {
    const char *const *keys; /* NULL: the arrival keys of `prefix` */
    const char *prefix;
    const char *what; /* the what of the checks after a timeout; of every wait too for arrival keys */
    char key[TS_STORE_MAX_KEY + 1];
} key_seq;

/* Key i of q (arrival keys are written into q->key) and its length. */
static const char *key_seq_at(key_seq *q, int i, size_t *klen_out)
{
    if (q->keys) {
        *klen_out = strlen(q->keys[i]);
        return q->keys[i];
    }
    *klen_out = (size_t)snprintf(q->key, sizeof q->key, "%s/arrived/%d", q->prefix, i);
    return q->key;
}

/* Waits for the n keys of q in turn until `deadline`. When one is not set
 * in time, checks the later ones quickly and returns TS_ERR_TIMEOUT with
 * no message, the missing keys named in `list` (the caller's keys quoted,
 * arrival keys by rank) and counted in *missing_out (then > 0). Any other
 * failure returns its status with *missing_out untouched. */
static ts_status wait_keys(ts_store *s, key_seq *q, int n, uint64_t deadline, char *list, size_t cap, int *missing_out)
{
    for (int i = 0; i < n; i++) {
        size_t klen = 0;
        const char *key = key_seq_at(q, i, &klen);
        char what[256];
        if (q->keys) describe(what, sizeof what, "wait", key);
        reply r;
        ts_status st =
            do_wait(s, q->keys ? what : q->what, TS__STORE_OP_WAIT, key, klen, deadline, s->timeout_s, false, &r);
        if (st == TS_OK) {
            value_free(r.val);
            continue;
        }
        if (st != TS_ERR_TIMEOUT || s->fd < 0) return st;
        /* Name every key still missing: this one and any later one. */
        size_t used = 0;
        bool full = false;
        int missing = 0;
        uint64_t report_deadline = ts_now_ns() + CLIENT_REPORT_NS;
        for (int j = i; j < n; j++) {
            int present = 0;
            if (j != i) {
                key = key_seq_at(q, j, &klen);
                present = do_check(s, q->what, key, klen, report_deadline, &st);
                if (present < 0) return st;
            }
            if (present) continue;
            char item[220];
            if (q->keys) snprintf(item, sizeof item, "'%.200s%s'", q->keys[j], strlen(q->keys[j]) > 200 ? "..." : "");
            else snprintf(item, sizeof item, "%d", j);
            list_add(list, cap, &used, &full, item);
            missing++;
        }
        *missing_out = missing;
        return TS_ERR_TIMEOUT;
    }
    return TS_OK;
}

ts_status ts_store_wait(ts_store *s, int n, const char *const *keys)
{
    static const char fn[] = "ts_store_wait";
    ts_status st = check_client(fn, s);
    if (st != TS_OK) return st;
    if (n < 0 || (n > 0 && !keys))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %d keys at %p", fn, n, (const void *)keys);
    for (int i = 0; i < n; i++) {
        size_t klen = 0;
        st = check_key(fn, keys[i], &klen);
        if (st != TS_OK) return st;
    }
    char list[640] = "";
    int missing = 0;
    key_seq q = {.keys = keys, .what = "wait"};
    st = wait_keys(s, &q, n, deadline_after(s->timeout_s), list, sizeof list, &missing);
    if (st != TS_ERR_TIMEOUT || !missing) return st;
    char secs[32];
    fmt_secs(secs, sizeof secs, s->timeout_s);
    return ts_error(TS_ERR_TIMEOUT, "store wait: %d of %d keys not set within %s s: %s (store at %s)", missing, n, secs,
                    list, s->addr);
}

static ts_status do_add(ts_store *s, const char *what, const char *key, size_t klen, int64_t delta, uint64_t deadline,
                        int64_t *value_out)
{
    reply r;
    ts_status st = roundtrip(s, what, TS__STORE_OP_ADD, key, klen, NULL, 0, NULL, 0, (uint64_t)delta, deadline, &r);
    if (st != TS_OK) return st;
    if (r.status == TS__STORE_ST_NOT_COUNTER) {
        value_free(r.val);
        return ts_error(TS_ERR_FORMAT, "store %s: the key holds a %llu-byte value, not an 8-byte counter", what,
                        (unsigned long long)r.arg);
    }
    if (r.status != TS__STORE_ST_OK) return unexpected(s, what, &r);
    value_free(r.val);
    if (value_out) *value_out = (int64_t)r.arg;
    return TS_OK;
}

ts_status ts_store_add(ts_store *s, const char *key, int64_t delta, int64_t *value_out)
{
    static const char fn[] = "ts_store_add";
    size_t klen = 0;
    ts_status st = check_client_key(fn, s, key, &klen);
    if (st != TS_OK) return st;
    char what[256];
    describe(what, sizeof what, "add", key);
    return do_add(s, what, key, klen, delta, deadline_after(s->timeout_s), value_out);
}

ts_status ts_store_compare_set(ts_store *s, const char *key, const void *expected, size_t expected_len,
                               const void *desired, size_t desired_len, void **value_out, size_t *len_out)
{
    static const char fn[] = "ts_store_compare_set";
    size_t klen = 0;
    ts_status st = check_client_key(fn, s, key, &klen);
    if (st == TS_OK) st = check_value(fn, "expected", expected, expected_len);
    if (st == TS_OK) st = check_value(fn, "desired", desired, desired_len);
    if (st == TS_OK && !value_out != !len_out)
        st = ts_error(TS_ERR_INVALID_ARGUMENT, "%s: value_out and len_out must both be given or both be NULL", fn);
    if (st != TS_OK) return st;
    char what[256];
    describe(what, sizeof what, "compare_set", key);
    reply r;
    st = roundtrip(s, what, TS__STORE_OP_COMPARE_SET, key, klen, expected, expected_len, desired, desired_len, 0,
                   deadline_after(s->timeout_s), &r);
    if (st != TS_OK) return st;
    if (r.status != TS__STORE_ST_OK) return unexpected(s, what, &r);
    if (value_out) {
        *value_out = r.val;
        *len_out = r.vlen;
    } else {
        value_free(r.val);
    }
    return TS_OK;
}

ts_status ts_store_delete(ts_store *s, const char *key, bool *deleted_out)
{
    static const char fn[] = "ts_store_delete";
    size_t klen = 0;
    ts_status st = check_client_key(fn, s, key, &klen);
    if (st != TS_OK) return st;
    char what[256];
    describe(what, sizeof what, "delete", key);
    reply r;
    st = roundtrip(s, what, TS__STORE_OP_DELETE, key, klen, NULL, 0, NULL, 0, 0, deadline_after(s->timeout_s), &r);
    if (st != TS_OK) return st;
    if (r.status != TS__STORE_ST_OK) return unexpected(s, what, &r);
    value_free(r.val);
    if (deleted_out) *deleted_out = r.arg != 0;
    return TS_OK;
}

ts_status ts_store_barrier(ts_store *s, const char *name, int world)
{
    static const char fn[] = "ts_store_barrier";
    ts_status st = check_client(fn, s);
    if (st != TS_OK) return st;
    if (!name) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: name is NULL", fn);
    if (world < 1) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: world %d is not >= 1", fn, world);
    size_t nlen = strnlen(name, TS_STORE_MAX_KEY + 1);
    if (nlen + 40 > TS_STORE_MAX_KEY)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: name of %zu bytes is too long (limit %d)", fn, nlen,
                        TS_STORE_MAX_KEY - 40);
    char key[TS_STORE_MAX_KEY + 1];
    char what[256];
    snprintf(what, sizeof what, "barrier '%.200s%s'", name, nlen > 200 ? "..." : "");
    uint64_t deadline = deadline_after(s->timeout_s);

    int klen = snprintf(key, sizeof key, "barrier/%s/count", name);
    int64_t n;
    st = do_add(s, what, key, (size_t)klen, 1, deadline, &n);
    if (st != TS_OK) return st;
    if (n < 1)
        return ts_error(TS_ERR_STATE, "store %s: its counter reads %lld after an increment (was it changed by hand?)",
                        what, (long long)n);
    int64_t epoch = (n - 1) / world;
    int64_t arrived_before = (n - 1) % world; /* participants of this epoch before us */
    char count_key[TS_STORE_MAX_KEY + 1];
    memcpy(count_key, key, (size_t)klen + 1);
    size_t count_klen = (size_t)klen;
    klen = snprintf(key, sizeof key, "barrier/%s/%lld/done", name, (long long)epoch);
    if (arrived_before + 1 == world) return do_set(s, what, key, (size_t)klen, NULL, 0, deadline);
    reply r;
    st = do_wait(s, what, TS__STORE_OP_WAIT, key, (size_t)klen, deadline, s->timeout_s, false, &r);
    if (st == TS_OK) {
        value_free(r.val);
        return TS_OK;
    }
    if (st != TS_ERR_TIMEOUT || s->fd < 0) return st;
    int64_t now_count;
    st = do_add(s, what, count_key, count_klen, 0, ts_now_ns() + CLIENT_REPORT_NS, &now_count);
    if (st != TS_OK) return st;
    int64_t arrived = now_count - epoch * world;
    if (arrived > world) arrived = world;
    char secs[32];
    fmt_secs(secs, sizeof secs, s->timeout_s);
    return ts_error(TS_ERR_TIMEOUT, "store %s (epoch %lld): %lld of %d participants arrived within %s s (store at %s)",
                    what, (long long)epoch, (long long)arrived, world, secs, s->addr);
}

ts_status ts_store_rendezvous(ts_store *s, const char *prefix, int rank, int world)
{
    static const char fn[] = "ts_store_rendezvous";
    ts_status st = check_client(fn, s);
    if (st != TS_OK) return st;
    if (!prefix) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: prefix is NULL", fn);
    if (world < 1 || rank < 0 || rank >= world)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: rank %d of world %d", fn, rank, world);
    size_t plen = strnlen(prefix, TS_STORE_MAX_KEY + 1);
    if (plen + 24 > TS_STORE_MAX_KEY)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: prefix of %zu bytes is too long (limit %d)", fn, plen,
                        TS_STORE_MAX_KEY - 24);
    char what[256], key[TS_STORE_MAX_KEY + 1];
    snprintf(what, sizeof what, "rendezvous '%.200s%s'", prefix, plen > 200 ? "..." : "");
    uint64_t deadline = deadline_after(s->timeout_s);
    int klen = snprintf(key, sizeof key, "%s/arrived/%d", prefix, rank);
    st = do_set(s, what, key, (size_t)klen, NULL, 0, deadline);
    if (st != TS_OK) return st;
    char list[640] = "";
    int missing = 0;
    key_seq q = {.prefix = prefix, .what = what};
    st = wait_keys(s, &q, world, deadline, list, sizeof list, &missing);
    if (st != TS_ERR_TIMEOUT || !missing) return st;
    char secs[32];
    fmt_secs(secs, sizeof secs, s->timeout_s);
    return ts_error(TS_ERR_TIMEOUT, "%s: %s %s of %d never arrived within %s s (store at %s)", what,
                    missing == 1 ? "rank" : "ranks", list, world, secs, s->addr);
}
