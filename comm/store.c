#define _GNU_SOURCE
/*
 * The rendezvous store (store.h has the protocol and the contract).
 *
 * Layout of this file:
 *   1. the protocol core: frame parsing, the key-value table, waiters and
 *      their deadlines; no sockets (store_internal.h; the fuzz target
 *      drives it directly);
 *   2. the server: a private libuv loop in its own thread that feeds each
 *      connection's bytes to the core and writes its replies;
 *   3. the client: blocking BSD sockets, poll-bounded reads and writes.
 *
 * Waiter deadlines live on the server: GET and WAIT carry the client's
 * remaining time in milliseconds, the core parks the connection, and one
 * uv_timer armed at the earliest deadline answers TIMEOUT. The client
 * bounds its own wait too (one second more), so a hung server cannot hang
 * a rank.
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
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

_Static_assert(TS__STORE_MAX_BODY <= UINT32_MAX, "a frame body must fit its u32 length");
_Static_assert(TS_STORE_MAX_KEY + 64 <= 65536, "keys are small");

/* ------------------------------------------------------------------ */
/* Little-endian helpers                                               */
/* ------------------------------------------------------------------ */

static void wr32(unsigned char *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

static void wr64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

static uint32_t rd32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t rd64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

static const char *op_name(unsigned op)
{
    static const char *const names[TS__STORE_OP_COUNT_] = {"?",     "HELLO", "SET", "GET",        "CHECK",
                                                           "WAIT", "ADD",   "COMPARE_SET", "DELETE"};
    return op < TS__STORE_OP_COUNT_ ? names[op] : "?";
}

/* ------------------------------------------------------------------ */
/* 1. Protocol core                                                    */
/* ------------------------------------------------------------------ */

#define CONN_BUF_INITIAL 512u
#define CONN_BUF_KEEP (64u * 1024u) /* a larger idle buffer is given back */

typedef struct entry {
    struct entry *next;
    uint64_t hash;
    unsigned char *val; /* NULL when vlen == 0 */
    size_t vlen;
    uint32_t klen;
    unsigned char key[];
} entry;

struct ts__store_core {
    unsigned char *token; /* NULL: any token */
    size_t token_len;
    ts__store_send_fn send;
    void *ctx;
    entry **buckets;
    size_t nbuckets, count;
    ts__store_conn *waiters;
};

static uint64_t hash_key(const unsigned char *k, size_t n)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++) {
        h ^= k[i];
        h *= 1099511628211ull;
    }
    return h;
}

static bool key_eq(const unsigned char *a, size_t an, const unsigned char *b, size_t bn)
{
    return an == bn && (an == 0 || memcmp(a, b, an) == 0);
}

ts_status ts__store_core_new(const char *token, ts__store_send_fn send, void *ctx, ts__store_core **out)
{
    ts__store_core *core = ts__calloc(TS_MEM_COMM, 1, sizeof *core);
    if (!core)
        return TS_ERR_NO_MEMORY;
    core->send = send;
    core->ctx = ctx;
    if (token && *token) {
        core->token_len = strlen(token);
        core->token = ts__malloc(TS_MEM_COMM, core->token_len);
        if (!core->token) {
            ts__free(TS_MEM_COMM, core);
            return TS_ERR_NO_MEMORY;
        }
        memcpy(core->token, token, core->token_len);
    }
    core->nbuckets = 16;
    core->buckets = ts__calloc(TS_MEM_COMM, core->nbuckets, sizeof *core->buckets);
    if (!core->buckets) {
        ts__free(TS_MEM_COMM, core->token);
        ts__free(TS_MEM_COMM, core);
        return TS_ERR_NO_MEMORY;
    }
    *out = core;
    return TS_OK;
}

void ts__store_core_free(ts__store_core *core)
{
    if (!core)
        return;
    TS_ASSERT(core->waiters == NULL);
    for (size_t b = 0; b < core->nbuckets; b++) {
        entry *e = core->buckets[b];
        while (e) {
            entry *next = e->next;
            ts__free(TS_MEM_COMM, e->val);
            ts__free(TS_MEM_COMM, e);
            e = next;
        }
    }
    ts__free(TS_MEM_COMM, core->buckets);
    ts__free(TS_MEM_COMM, core->token);
    ts__free(TS_MEM_COMM, core);
}

size_t ts__store_core_count(const ts__store_core *core) { return core ? core->count : 0; }

static entry *table_find(const ts__store_core *core, const unsigned char *key, size_t klen, uint64_t h)
{
    for (entry *e = core->buckets[h & (core->nbuckets - 1)]; e; e = e->next)
        if (e->hash == h && key_eq(e->key, e->klen, key, klen))
            return e;
    return NULL;
}

static void table_grow(ts__store_core *core)
{
    size_t nb = core->nbuckets * 2;
    entry **nt = ts__calloc(TS_MEM_COMM, nb, sizeof *nt);
    if (!nt)
        return; /* keep working with longer chains */
    for (size_t b = 0; b < core->nbuckets; b++) {
        entry *e = core->buckets[b];
        while (e) {
            entry *next = e->next;
            e->next = nt[e->hash & (nb - 1)];
            nt[e->hash & (nb - 1)] = e;
            e = next;
        }
    }
    ts__free(TS_MEM_COMM, core->buckets);
    core->buckets = nt;
    core->nbuckets = nb;
}

/* Sets key to a copy of value; NULL when out of memory (nothing changed). */
static entry *table_put(ts__store_core *core, const unsigned char *key, size_t klen, const void *val, size_t vlen)
{
    uint64_t h = hash_key(key, klen);
    unsigned char *copy = NULL;
    if (vlen) {
        copy = ts__malloc(TS_MEM_COMM, vlen);
        if (!copy)
            return NULL;
        memcpy(copy, val, vlen);
    }
    entry *e = table_find(core, key, klen, h);
    if (e) {
        ts__free(TS_MEM_COMM, e->val);
        e->val = copy;
        e->vlen = vlen;
        return e;
    }
    e = ts__malloc(TS_MEM_COMM, sizeof *e + klen);
    if (!e) {
        ts__free(TS_MEM_COMM, copy);
        return NULL;
    }
    e->hash = h;
    e->val = copy;
    e->vlen = vlen;
    e->klen = (uint32_t)klen;
    if (klen)
        memcpy(e->key, key, klen);
    size_t b = h & (core->nbuckets - 1);
    e->next = core->buckets[b];
    core->buckets[b] = e;
    core->count++;
    if (core->count > core->nbuckets)
        table_grow(core);
    return e;
}

static bool table_delete(ts__store_core *core, const unsigned char *key, size_t klen)
{
    uint64_t h = hash_key(key, klen);
    for (entry **pe = &core->buckets[h & (core->nbuckets - 1)]; *pe; pe = &(*pe)->next) {
        entry *e = *pe;
        if (e->hash == h && key_eq(e->key, e->klen, key, klen)) {
            *pe = e->next;
            ts__free(TS_MEM_COMM, e->val);
            ts__free(TS_MEM_COMM, e);
            core->count--;
            return true;
        }
    }
    return false;
}

static ts__store_reply *reply_new(uint8_t status, const void *val, size_t vlen, uint64_t arg)
{
    size_t total = 4 + TS__STORE_RESP_FIXED + vlen;
    ts__store_reply *r = ts__malloc(TS_MEM_COMM, sizeof *r + total);
    if (!r)
        return NULL;
    r->len = total;
    unsigned char *p = r->bytes;
    wr32(p, (uint32_t)(TS__STORE_RESP_FIXED + vlen));
    p[4] = status;
    wr32(p + 5, (uint32_t)vlen);
    if (vlen)
        memcpy(p + 9, val, vlen);
    wr64(p + 9 + vlen, arg);
    return r;
}

/* Answers the connection being processed; false (drop it) when out of memory. */
static bool answer(ts__store_core *core, ts__store_conn *c, uint8_t status, const void *val, size_t vlen,
                   uint64_t arg)
{
    ts__store_reply *r = reply_new(status, val, vlen, arg);
    if (!r) {
        ts_logf(TS_LOG_ERROR, "store: out of memory answering client %s; dropping it", c->peer);
        return false;
    }
    core->send(c, r, core->ctx);
    return true;
}

/* Answers a parked connection (not the one being processed). */
static void answer_waiter(ts__store_core *core, ts__store_conn *c, uint8_t status, const void *val, size_t vlen)
{
    ts__store_reply *r = reply_new(status, val, vlen, 0);
    if (!r)
        ts_logf(TS_LOG_ERROR, "store: out of memory answering client %s; dropping it", c->peer);
    core->send(c, r, core->ctx);
}

static void unpark(ts__store_core *core, ts__store_conn *c)
{
    if (!c->parked)
        return;
    if (c->wprev)
        c->wprev->wnext = c->wnext;
    else
        core->waiters = c->wnext;
    if (c->wnext)
        c->wnext->wprev = c->wprev;
    c->wprev = c->wnext = NULL;
    ts__free(TS_MEM_COMM, c->wait_key);
    c->wait_key = NULL;
    c->parked = false;
}

static bool park(ts__store_core *core, ts__store_conn *c, uint8_t op, const unsigned char *key, size_t klen,
                 uint64_t deadline)
{
    c->wait_key = ts__malloc(TS_MEM_COMM, klen ? klen : 1);
    if (!c->wait_key)
        return false;
    if (klen)
        memcpy(c->wait_key, key, klen);
    c->wait_klen = (uint32_t)klen;
    c->wait_op = op;
    c->deadline_ms = deadline;
    c->parked = true;
    c->wprev = NULL;
    c->wnext = core->waiters;
    if (core->waiters)
        core->waiters->wprev = c;
    core->waiters = c;
    return true;
}

/* Answers every waiter of e's key. */
static void wake(ts__store_core *core, const entry *e)
{
    ts__store_conn *next;
    for (ts__store_conn *w = core->waiters; w; w = next) {
        next = w->wnext;
        if (!key_eq(w->wait_key, w->wait_klen, e->key, e->klen))
            continue;
        bool get = w->wait_op == TS__STORE_OP_GET;
        unpark(core, w);
        answer_waiter(core, w, TS__STORE_ST_OK, get ? e->val : NULL, get ? e->vlen : 0);
    }
}

void ts__store_core_expire(ts__store_core *core, uint64_t now_ms)
{
    ts__store_conn *next;
    for (ts__store_conn *w = core->waiters; w; w = next) {
        next = w->wnext;
        if (w->deadline_ms > now_ms)
            continue;
        unpark(core, w);
        answer_waiter(core, w, TS__STORE_ST_TIMEOUT, NULL, 0);
    }
}

uint64_t ts__store_core_next_deadline(const ts__store_core *core)
{
    uint64_t d = UINT64_MAX;
    for (const ts__store_conn *w = core->waiters; w; w = w->wnext)
        if (w->deadline_ms < d)
            d = w->deadline_ms;
    return d;
}

void ts__store_conn_init(ts__store_core *core, ts__store_conn *c, const char *peer)
{
    (void)core;
    memset(c, 0, sizeof *c);
    snprintf(c->peer, sizeof c->peer, "%s", peer ? peer : "?");
}

void ts__store_conn_fini(ts__store_core *core, ts__store_conn *c)
{
    unpark(core, c);
    ts__free(TS_MEM_COMM, c->buf);
    c->buf = NULL;
    c->len = c->cap = 0;
}

static bool set_buffer(ts__store_conn *c, size_t cap)
{
    unsigned char *nb = ts__malloc(TS_MEM_COMM, cap);
    if (!nb)
        return false;
    if (c->len)
        memcpy(nb, c->buf, c->len);
    ts__free(TS_MEM_COMM, c->buf);
    c->buf = nb;
    c->cap = cap;
    return true;
}

bool ts__store_conn_space(ts__store_core *core, ts__store_conn *c, unsigned char **p, size_t *n)
{
    (void)core;
    if (!c->buf && !set_buffer(c, CONN_BUF_INITIAL))
        return false;
    if (c->len == c->cap) {
        /* The frame being received does not fit (complete frames are
         * consumed, so its length is known and passed the limits in
         * ts__store_conn_received). Grow geometrically towards it, so that
         * memory follows the bytes that really arrive, not the length a
         * client announces. */
        uint64_t total = 4 + (uint64_t)rd32(c->buf);
        uint64_t want = 2 * (uint64_t)c->cap;
        if (want > total)
            want = total;
        if (want <= c->cap || want > 4 + TS__STORE_MAX_BODY)
            return false; /* not reached */
        if (!set_buffer(c, (size_t)want))
            return false;
    }
    *p = c->buf + c->len;
    *n = c->cap - c->len;
    return true;
}

static void vlog_drop(const ts__store_conn *c, ts_log_level level, const char *fmt, va_list ap)
{
    if (!TS_LOG_ENABLED(level))
        return;
    char why[256];
    vsnprintf(why, sizeof why, fmt, ap);
    ts_logf(level, "store: dropping client %s: %s", c->peer, why);
}

/* Logs why the client is dropped; returns false (for run_frame). */
static bool drop(const ts__store_conn *c, ts_log_level level, const char *fmt, ...) TS_PRINTF(3, 4);
static bool drop(const ts__store_conn *c, ts_log_level level, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vlog_drop(c, level, fmt, ap);
    va_end(ap);
    return false;
}

/* The same, returning -1 (for check_frame). */
static int refuse(const ts__store_conn *c, ts_log_level level, const char *fmt, ...) TS_PRINTF(3, 4);
static int refuse(const ts__store_conn *c, ts_log_level level, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vlog_drop(c, level, fmt, ap);
    va_end(ap);
    return -1;
}

static uint64_t max_value_len(unsigned op)
{
    switch (op) {
    case TS__STORE_OP_HELLO:
        return TS_STORE_MAX_TOKEN;
    case TS__STORE_OP_SET:
        return TS_STORE_MAX_VALUE;
    case TS__STORE_OP_COMPARE_SET:
        return 4u + 2u * (uint64_t)TS_STORE_MAX_VALUE;
    default:
        return 0;
    }
}

/* -1: drop (logged); 0: the frame is incomplete; 1: a complete frame. Every
 * check that the bytes received so far allow is made at once, so an
 * oversized or impossible frame is refused before its body arrives. */
static int check_frame(ts__store_conn *c, const unsigned char *p, size_t avail)
{
    if (avail < 4)
        return 0;
    uint32_t body = rd32(p);
    uint64_t limit = c->authed ? TS__STORE_MAX_BODY : TS__STORE_MAX_HELLO_BODY;
    if (body < TS__STORE_REQ_FIXED)
        return refuse(c, TS_LOG_INFO, "frame body of %u bytes is shorter than the %u-byte minimum", body,
                    TS__STORE_REQ_FIXED);
    if (body > limit)
        return refuse(c, TS_LOG_INFO, "frame body of %u bytes is over the limit of %llu bytes%s", body,
                    (unsigned long long)limit, c->authed ? "" : " before hello");
    if (avail < 5)
        return 0;
    unsigned op = p[4];
    if (op == 0 || op >= TS__STORE_OP_COUNT_)
        return refuse(c, TS_LOG_INFO, "unknown op %u", op);
    if (!c->authed && op != TS__STORE_OP_HELLO)
        return refuse(c, TS_LOG_WARN, "sent %s before hello", op_name(op));
    if (c->authed && op == TS__STORE_OP_HELLO)
        return refuse(c, TS_LOG_INFO, "said hello twice");
    if (avail < 9)
        return 0;
    uint32_t klen = rd32(p + 5);
    uint32_t max_key = op == TS__STORE_OP_HELLO ? 0 : TS_STORE_MAX_KEY;
    if (klen > max_key)
        return refuse(c, TS_LOG_INFO, "%s with a key of %u bytes (limit %u)", op_name(op), klen, max_key);
    if (klen > body - TS__STORE_REQ_FIXED)
        return refuse(c, TS_LOG_INFO, "key of %u bytes does not fit a body of %u bytes", klen, body);
    uint64_t vlen = (uint64_t)body - TS__STORE_REQ_FIXED - klen;
    if (vlen > max_value_len(op))
        return refuse(c, TS_LOG_INFO, "%s with a value of %llu bytes (limit %llu)", op_name(op),
                    (unsigned long long)vlen, (unsigned long long)max_value_len(op));
    if (avail < 13 + (size_t)klen)
        return 0;
    uint32_t declared = rd32(p + 9 + klen);
    if (declared != vlen)
        return refuse(c, TS_LOG_INFO, "value length %u does not match the body length (%llu expected)", declared,
                    (unsigned long long)vlen);
    return avail >= 4 + (size_t)body ? 1 : 0;
}

static bool token_ok(const ts__store_core *core, const unsigned char *t, size_t n)
{
    if (!core->token)
        return true;
    /* Constant time in the expected token: every byte presented is
     * compared, and the lengths fold into the same accumulator. */
    volatile unsigned acc = (unsigned)(n != core->token_len);
    for (size_t i = 0; i < n; i++)
        acc |= (unsigned)(t[i] ^ core->token[i % core->token_len]);
    return acc == 0;
}

static uint64_t sat_add(uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; }

/* Runs one complete, checked frame; false means drop. */
static bool run_frame(ts__store_core *core, ts__store_conn *c, const unsigned char *p, uint64_t now_ms)
{
    unsigned op = p[4];
    uint32_t klen = rd32(p + 5);
    const unsigned char *key = p + 9;
    uint32_t vlen = rd32(p + 9 + klen);
    const unsigned char *val = p + 13 + klen;
    uint64_t arg = rd64(val + vlen);
    entry *e;

    switch (op) {
    case TS__STORE_OP_HELLO:
        if (arg != TS__STORE_PROTOCOL)
            return drop(c, TS_LOG_WARN, "protocol version %llu (this server speaks %u)", (unsigned long long)arg,
                        TS__STORE_PROTOCOL);
        if (!token_ok(core, val, vlen))
            return drop(c, TS_LOG_WARN, "wrong token");
        c->authed = true;
        return answer(core, c, TS__STORE_ST_OK, NULL, 0, TS__STORE_PROTOCOL);

    case TS__STORE_OP_SET:
        e = table_put(core, key, klen, val, vlen);
        if (!e)
            return answer(core, c, TS__STORE_ST_NO_MEMORY, NULL, 0, 0);
        if (!answer(core, c, TS__STORE_ST_OK, NULL, 0, 0))
            return false;
        wake(core, e);
        return true;

    case TS__STORE_OP_GET:
    case TS__STORE_OP_WAIT:
        e = table_find(core, key, klen, hash_key(key, klen));
        if (e) {
            bool get = op == TS__STORE_OP_GET;
            return answer(core, c, TS__STORE_ST_OK, get ? e->val : NULL, get ? e->vlen : 0, 0);
        }
        if (arg == 0)
            return answer(core, c, TS__STORE_ST_TIMEOUT, NULL, 0, 0);
        if (!park(core, c, (uint8_t)op, key, klen, sat_add(now_ms, arg)))
            return answer(core, c, TS__STORE_ST_NO_MEMORY, NULL, 0, 0);
        return true;

    case TS__STORE_OP_CHECK:
        e = table_find(core, key, klen, hash_key(key, klen));
        return answer(core, c, e ? TS__STORE_ST_OK : TS__STORE_ST_NOT_FOUND, NULL, 0, e ? 1 : 0);

    case TS__STORE_OP_ADD: {
        e = table_find(core, key, klen, hash_key(key, klen));
        if (e && e->vlen != 8)
            return answer(core, c, TS__STORE_ST_NOT_COUNTER, NULL, 0, e->vlen);
        uint64_t v = (e ? rd64(e->val) : 0) + arg; /* wraps: two's complement */
        if (e) {
            wr64(e->val, v);
        } else {
            unsigned char b[8];
            wr64(b, v);
            e = table_put(core, key, klen, b, 8);
            if (!e)
                return answer(core, c, TS__STORE_ST_NO_MEMORY, NULL, 0, 0);
        }
        if (!answer(core, c, TS__STORE_ST_OK, NULL, 0, v))
            return false;
        wake(core, e);
        return true;
    }

    case TS__STORE_OP_COMPARE_SET: {
        if (vlen < 4)
            return drop(c, TS_LOG_INFO, "COMPARE_SET value of %u bytes lacks the expected length", vlen);
        uint32_t elen = rd32(val);
        if (elen > vlen - 4 || elen > TS_STORE_MAX_VALUE || vlen - 4 - elen > TS_STORE_MAX_VALUE)
            return drop(c, TS_LOG_INFO, "COMPARE_SET expected length %u does not fit its value of %u bytes", elen,
                        vlen);
        const unsigned char *expected = val + 4, *desired = val + 4 + elen;
        size_t dlen = vlen - 4 - elen;
        e = table_find(core, key, klen, hash_key(key, klen));
        bool match = e ? key_eq(e->val, e->vlen, expected, elen) : elen == 0;
        if (!match)
            return answer(core, c, TS__STORE_ST_OK, e ? e->val : NULL, e ? e->vlen : 0, 0);
        e = table_put(core, key, klen, desired, dlen);
        if (!e)
            return answer(core, c, TS__STORE_ST_NO_MEMORY, NULL, 0, 0);
        if (!answer(core, c, TS__STORE_ST_OK, e->val, e->vlen, 1))
            return false;
        wake(core, e);
        return true;
    }

    case TS__STORE_OP_DELETE: {
        bool existed = table_delete(core, key, klen);
        return answer(core, c, TS__STORE_ST_OK, NULL, 0, existed ? 1 : 0);
    }

    default: /* check_frame refused it */
        return drop(c, TS_LOG_INFO, "unknown op %u", op);
    }
}

bool ts__store_conn_received(ts__store_core *core, ts__store_conn *c, size_t n, uint64_t now_ms)
{
    TS_ASSERT(n <= c->cap - c->len);
    c->len += n;
    size_t off = 0;
    bool ok = true;
    while (off < c->len) {
        if (c->parked) {
            ok = drop(c, TS_LOG_INFO, "sent a request while its %s was pending", op_name(c->wait_op));
            break;
        }
        const unsigned char *p = c->buf + off;
        int r = check_frame(c, p, c->len - off);
        if (r < 0) {
            ok = false;
            break;
        }
        if (r == 0)
            break;
        if (!run_frame(core, c, p, now_ms)) {
            ok = false;
            break;
        }
        off += 4 + (size_t)rd32(p);
    }
    if (!ok)
        return false;
    if (off) {
        memmove(c->buf, c->buf + off, c->len - off);
        c->len -= off;
    }
    if (c->len == 0 && c->cap > CONN_BUF_KEEP) {
        ts__free(TS_MEM_COMM, c->buf);
        c->buf = NULL;
        c->cap = 0;
    }
    return true;
}

bool ts__store_conn_feed(ts__store_core *core, ts__store_conn *c, const void *data, size_t n, uint64_t now_ms)
{
    const unsigned char *d = data;
    while (n) {
        unsigned char *p;
        size_t room;
        if (!ts__store_conn_space(core, c, &p, &room))
            return false;
        size_t k = n < room ? n : room;
        memcpy(p, d, k);
        if (!ts__store_conn_received(core, c, k, now_ms))
            return false;
        d += k;
        n -= k;
    }
    return true;
}

/* ------------------------------------------------------------------ */
/* 2. Server: libuv loop in its own thread                              */
/* ------------------------------------------------------------------ */

struct ts_store_server {
    uv_loop_t loop;
    uv_tcp_t listener;
    uv_async_t stop;
    uv_timer_t timer;
    pthread_t thread;
    ts__store_core *core;
    int port;
    char addr[INET6_ADDRSTRLEN + 16];
};

typedef struct srv_conn {
    uv_tcp_t tcp; /* first: the handle's data points back here */
    ts_store_server *srv;
    ts__store_conn pc;
} srv_conn;

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
    if (!uv_is_closing((uv_handle_t *)&sc->tcp))
        uv_close((uv_handle_t *)&sc->tcp, on_conn_closed);
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

static void on_read(uv_stream_t *stream, ssize_t nread, const uv_buf_t *buf)
{
    (void)buf;
    srv_conn *sc = stream->data;
    ts_store_server *srv = sc->srv;
    if (nread > 0) {
        if (!ts__store_conn_received(srv->core, &sc->pc, (size_t)nread, uv_now(&srv->loop)))
            conn_close(sc);
        rearm_timer(srv);
    } else if (nread < 0) {
        if (nread != UV_EOF)
            ts_logf(TS_LOG_INFO, "store: client %s: %s", sc->pc.peer, uv_strerror((int)nread));
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
    int sl = (int)sizeof ss;
    if (uv_tcp_getpeername(&sc->tcp, (struct sockaddr *)&ss, &sl) == 0)
        format_addr((struct sockaddr *)&ss, sc->pc.peer, sizeof sc->pc.peer);
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
    if (uv_is_closing(h))
        return;
    if (h->type == UV_TCP && h != (uv_handle_t *)&srv->listener)
        conn_close(h->data);
    else
        uv_close(h, NULL);
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
        if (rc < 0)
            ts_logf(TS_LOG_WARN, "store %s: closing its loop: %s", srv->addr, uv_strerror(rc));
    }
    ts__store_core_free(srv->core);
    ts__free(TS_MEM_COMM, srv);
}

ts_status ts_store_server_start(const char *host, int port, const char *token, ts_store_server **out)
{
    if (!out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_store_server_start: out is NULL");
    if (port < 0 || port > 65535)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_store_server_start: port %d is not in 0..65535", port);
    if (token && strnlen(token, TS_STORE_MAX_TOKEN + 1) > TS_STORE_MAX_TOKEN)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_store_server_start: the token is longer than %d bytes",
                        TS_STORE_MAX_TOKEN);
    if (!host)
        host = "127.0.0.1";
    if (strnlen(host, 256) > 255)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_store_server_start: host name longer than 255 bytes");

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
        if (ai)
            freeaddrinfo(ai);
        return st;
    }
    struct sockaddr_storage bind_addr;
    memset(&bind_addr, 0, sizeof bind_addr);
    memcpy(&bind_addr, ai->ai_addr, ai->ai_addrlen < sizeof bind_addr ? ai->ai_addrlen : sizeof bind_addr);
    freeaddrinfo(ai);

    ts_store_server *srv = ts__calloc(TS_MEM_COMM, 1, sizeof *srv);
    if (!srv)
        return TS_ERR_NO_MEMORY;
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
    for (size_t i = 0; i < sizeof sync_signals / sizeof sync_signals[0]; i++)
        sigdelset(&all, sync_signals[i]);
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
    if (!s)
        return;
    uv_async_send(&s->stop);
    pthread_join(s->thread, NULL);
    /* The loop has returned: every handle is closed and every
     * connection finished, so nothing waits any more. */
    server_free(s, true);
}

/* ------------------------------------------------------------------ */
/* 3. Client                                                            */
/* ------------------------------------------------------------------ */

#define CLIENT_DEFAULT_TIMEOUT_S 300.0
#define CLIENT_MAX_TIMEOUT_S (30.0 * 86400.0)
/* A waiting call waits this much past its deadline for the server's own
 * TIMEOUT answer before giving up on the connection. */
#define CLIENT_GRACE_NS 1000000000ull
/* Budget for the quick checks that name what is missing after a timeout. */
#define CLIENT_REPORT_NS 2000000000ull

struct ts_store {
    int fd; /* -1 once the connection is lost */
    double timeout_s;
    char addr[300];
};

typedef struct reply {
    uint8_t status;
    unsigned char *val; /* malloc'd, never NULL after success */
    size_t vlen;
    uint64_t arg;
} reply;

static void fmt_secs(char *out, size_t n, double s)
{
    if (s >= 0.1)
        snprintf(out, n, "%.1f", s);
    else
        snprintf(out, n, "%.3f", s);
}

static uint64_t deadline_after(double s)
{
    double ns = s * 1e9;
    uint64_t now = ts_now_ns();
    if (!(ns < (double)(UINT64_MAX - now - CLIENT_GRACE_NS * 4)))
        return UINT64_MAX - CLIENT_GRACE_NS * 4;
    return now + (uint64_t)ns;
}

static int remaining_ms(uint64_t deadline)
{
    uint64_t now = ts_now_ns();
    if (now >= deadline)
        return 0;
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
        if (r > 0)
            return 1;
        if (r == 0) {
            if (ms == 0 || ts_now_ns() >= deadline)
                return 0;
            continue;
        }
        if (errno != EINTR)
            return -1;
    }
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
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                int r = wait_fd(s->fd, POLLOUT, deadline);
                if (r == 0)
                    return io_timeout(s, what, started, deadline);
                if (r > 0)
                    continue;
            }
            int e = errno;
            lose_connection(s);
            return ts_error(TS_ERR_COMM, "store %s: sending to the store at %s failed: %s", what, s->addr,
                            strerror(e));
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
            return ts_error(TS_ERR_COMM, "store %s: the store at %s closed the connection%s", what, s->addr,
                            hello ? " (wrong token?)" : "");
        }
        if (errno == EINTR)
            continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            int w = wait_fd(s->fd, POLLIN, deadline);
            if (w == 0)
                return io_timeout(s, what, started, deadline);
            if (w > 0)
                continue;
        }
        int e = errno;
        lose_connection(s);
        return ts_error(TS_ERR_COMM, "store %s: receiving from the store at %s failed: %s%s", what, s->addr,
                        strerror(e), hello && e == ECONNRESET ? " (wrong token?)" : "");
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
    wr32(head, (uint32_t)(TS__STORE_REQ_FIXED + klen + vlen));
    head[4] = op;
    wr32(head + 5, (uint32_t)klen);
    wr32(mid, (uint32_t)vlen);
    if (cas)
        wr32(mid + 4, (uint32_t)an);
    wr64(tail, arg);
    struct iovec iov[6];
    int cnt = 0;
    iov[cnt++] = (struct iovec){head, sizeof head};
    if (klen)
        iov[cnt++] = (struct iovec){(void *)key, klen};
    iov[cnt++] = (struct iovec){mid, cas ? 8u : 4u};
    if (an)
        iov[cnt++] = (struct iovec){(void *)a, an};
    if (bn)
        iov[cnt++] = (struct iovec){(void *)b, bn};
    iov[cnt++] = (struct iovec){tail, sizeof tail};
    ts_status st = send_all(s, what, iov, cnt, started, deadline);
    if (st != TS_OK)
        return st;

    bool hello = op == TS__STORE_OP_HELLO;
    unsigned char rh[9];
    st = recv_all(s, what, rh, sizeof rh, started, deadline, hello);
    if (st != TS_OK)
        return st;
    uint32_t body = rd32(rh), rvlen = rd32(rh + 5);
    if (rvlen > TS_STORE_MAX_VALUE || body != TS__STORE_RESP_FIXED + rvlen || rh[4] >= TS__STORE_ST_COUNT_) {
        lose_connection(s);
        return ts_error(TS_ERR_COMM, "store %s: malformed answer from the store at %s (body %u, value %u, status %u)",
                        what, s->addr, body, rvlen, rh[4]);
    }
    unsigned char *val = malloc(rvlen ? rvlen : 1);
    if (!val) {
        lose_connection(s);
        return ts_error(TS_ERR_NO_MEMORY, "store %s: out of memory for an answer of %u bytes", what, rvlen);
    }
    unsigned char ra[8];
    st = recv_all(s, what, val, rvlen, started, deadline, hello);
    if (st == TS_OK)
        st = recv_all(s, what, ra, sizeof ra, started, deadline, hello);
    if (st != TS_OK) {
        free(val);
        return st;
    }
    r->status = rh[4];
    r->val = val;
    r->vlen = rvlen;
    r->arg = rd64(ra);
    return TS_OK;
}

/* An answer status the caller did not expect. Frees the reply. */
static ts_status unexpected(ts_store *s, const char *what, reply *r)
{
    free(r->val);
    r->val = NULL;
    if (r->status == TS__STORE_ST_NO_MEMORY)
        return ts_error(TS_ERR_NO_MEMORY, "store %s: the store at %s is out of memory", what, s->addr);
    lose_connection(s);
    return ts_error(TS_ERR_COMM, "store %s: unexpected answer %u from the store at %s", what, r->status, s->addr);
}

static ts_status check_client(const char *fn, const ts_store *s)
{
    if (!s)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: the store client is NULL", fn);
    return TS_OK;
}

static ts_status check_key(const char *fn, const char *key, size_t *klen_out)
{
    if (!key)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: key is NULL", fn);
    size_t n = strnlen(key, TS_STORE_MAX_KEY + 1);
    if (n > TS_STORE_MAX_KEY)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: key '%.200s...' is longer than %d bytes", fn, key,
                        TS_STORE_MAX_KEY);
    *klen_out = n;
    return TS_OK;
}

static ts_status check_value(const char *fn, const char *name, const void *v, size_t n)
{
    if (!v && n)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %s is NULL with a length of %zu", fn, name, n);
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
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0)
        return fd;
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
    if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) < 0)
        soerr = errno;
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
    while (nanosleep(&ts, &ts) < 0 && errno == EINTR) {
    }
}

ts_status ts_store_connect(const char *host, int port, const char *token, double timeout_s, ts_store **out)
{
    static const char fn[] = "ts_store_connect";
    if (!out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: out is NULL", fn);
    if (port <= 0 || port > 65535)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: port %d is not in 1..65535", fn, port);
    if (!(timeout_s >= 0) || isinf(timeout_s))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: timeout %g s is not a finite number >= 0", fn, timeout_s);
    if (!host)
        host = "127.0.0.1";
    if (!*host || strnlen(host, 256) > 255)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: host name is empty or longer than 255 bytes", fn);
    if (!token) {
        token = getenv(TS_STORE_TOKEN_ENV);
        if (!token)
            token = "";
    }
    size_t tlen = strnlen(token, TS_STORE_MAX_TOKEN + 1);
    if (tlen > TS_STORE_MAX_TOKEN)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: the token is longer than %d bytes", fn, TS_STORE_MAX_TOKEN);

    ts_store *s = ts__calloc(TS_MEM_COMM, 1, sizeof *s);
    if (!s)
        return TS_ERR_NO_MEMORY;
    s->fd = -1;
    s->timeout_s = CLIENT_DEFAULT_TIMEOUT_S;
    snprintf(s->addr, sizeof s->addr, strchr(host, ':') ? "[%s]:%d" : "%s:%d", host, port);

    char portstr[16], secs[32];
    snprintf(portstr, sizeof portstr, "%d", port);
    fmt_secs(secs, sizeof secs, timeout_s);
    uint64_t deadline = deadline_after(timeout_s);
    uint64_t backoff = 10000000ull; /* 10 ms, doubling to 200 ms */
    int last_err = 0;
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
        if (s->fd >= 0)
            break;
        uint64_t now = ts_now_ns();
        if (now >= deadline) {
            ts_status st = ts_error(TS_ERR_TIMEOUT, "store: cannot connect to the store at %s within %s s: %s",
                                    s->addr, secs, gai == EAI_AGAIN ? "name resolution failed" : strerror(last_err));
            ts__free(TS_MEM_COMM, s);
            return st;
        }
        sleep_ns(deadline - now < backoff ? deadline - now : backoff);
        backoff = backoff * 2 > 200000000ull ? 200000000ull : backoff * 2;
    }
    int fl = fcntl(s->fd, F_GETFL);
    if (fl >= 0)
        fcntl(s->fd, F_SETFL, fl & ~O_NONBLOCK); /* blocking; reads and writes use MSG_DONTWAIT and poll */
    int one = 1;
    setsockopt(s->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);

    /* At least a second for the hello even when connecting took all the time. */
    uint64_t hello_deadline = deadline;
    if (hello_deadline < ts_now_ns() + CLIENT_GRACE_NS)
        hello_deadline = ts_now_ns() + CLIENT_GRACE_NS;
    reply r;
    ts_status st = roundtrip(s, "hello", TS__STORE_OP_HELLO, "", 0, token, tlen, NULL, 0, TS__STORE_PROTOCOL,
                             hello_deadline, &r);
    if (st == TS_OK && (r.status != TS__STORE_ST_OK || r.arg != TS__STORE_PROTOCOL))
        st = unexpected(s, "hello", &r);
    else if (st == TS_OK)
        free(r.val);
    if (st != TS_OK) {
        lose_connection(s);
        ts__free(TS_MEM_COMM, s);
        return st;
    }
    *out = s;
    return TS_OK;
}

void ts_store_close(ts_store *s)
{
    if (!s)
        return;
    lose_connection(s);
    ts__free(TS_MEM_COMM, s);
}

void ts_store_set_timeout(ts_store *s, double timeout_s)
{
    if (!s || !(timeout_s > 0))
        return;
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
    if (st != TS_OK)
        return st;
    if (r.status != TS__STORE_ST_OK)
        return unexpected(s, what, &r);
    free(r.val);
    return TS_OK;
}

ts_status ts_store_set(ts_store *s, const char *key, const void *value, size_t len)
{
    static const char fn[] = "ts_store_set";
    size_t klen = 0;
    ts_status st = check_client(fn, s);
    if (st == TS_OK)
        st = check_key(fn, key, &klen);
    if (st == TS_OK)
        st = check_value(fn, "value", value, len);
    if (st != TS_OK)
        return st;
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
    ts_status st = roundtrip(s, what, op, key, klen, NULL, 0, NULL, 0, wait_arg(deadline), deadline + CLIENT_GRACE_NS,
                             r);
    if (st != TS_OK)
        return st;
    if (r->status == TS__STORE_ST_OK)
        return TS_OK;
    if (r->status == TS__STORE_ST_TIMEOUT) {
        free(r->val);
        r->val = NULL;
        if (!report)
            return TS_ERR_TIMEOUT;
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
    ts_status st = check_client(fn, s);
    if (st == TS_OK)
        st = check_key(fn, key, &klen);
    if (st == TS_OK && (!value_out || !len_out))
        st = ts_error(TS_ERR_INVALID_ARGUMENT, "%s: value_out and len_out are required", fn);
    if (st != TS_OK)
        return st;
    char what[256];
    describe(what, sizeof what, "get", key);
    reply r;
    st = do_wait(s, what, TS__STORE_OP_GET, key, klen, deadline_after(s->timeout_s), s->timeout_s, true, &r);
    if (st != TS_OK)
        return st;
    *value_out = r.val;
    *len_out = r.vlen;
    return TS_OK;
}

/* 1 present, 0 absent, <0 an error status. */
static int do_check(ts_store *s, const char *what, const char *key, size_t klen, uint64_t deadline, ts_status *err)
{
    reply r;
    ts_status st = roundtrip(s, what, TS__STORE_OP_CHECK, key, klen, NULL, 0, NULL, 0, 0, deadline, &r);
    if (st == TS_OK && r.status != TS__STORE_ST_OK && r.status != TS__STORE_ST_NOT_FOUND)
        st = unexpected(s, what, &r);
    if (st != TS_OK) {
        *err = st;
        return -1;
    }
    free(r.val);
    return r.status == TS__STORE_ST_OK;
}

ts_status ts_store_check(ts_store *s, const char *key)
{
    static const char fn[] = "ts_store_check";
    size_t klen = 0;
    ts_status st = check_client(fn, s);
    if (st == TS_OK)
        st = check_key(fn, key, &klen);
    if (st != TS_OK)
        return st;
    char what[256];
    describe(what, sizeof what, "check", key);
    int present = do_check(s, what, key, klen, deadline_after(s->timeout_s), &st);
    if (present < 0)
        return st;
    if (!present)
        return ts_error(TS_ERR_NOT_FOUND, "store %s: key not set (store at %s)", what, s->addr);
    return TS_OK;
}

/* Appends to a bounded list ("'a', 'b'"), ending in "..." once full. */
static void list_add(char *buf, size_t cap, size_t *used, bool *full, const char *item)
{
    if (*full)
        return;
    size_t need = strlen(item) + 2;
    if (*used + need + 8 >= cap) {
        snprintf(buf + *used, cap - *used, "%s...", *used ? ", " : "");
        *full = true;
        return;
    }
    *used += (size_t)snprintf(buf + *used, cap - *used, "%s%s", *used ? ", " : "", item);
}

ts_status ts_store_wait(ts_store *s, int n, const char *const *keys)
{
    static const char fn[] = "ts_store_wait";
    ts_status st = check_client(fn, s);
    if (st != TS_OK)
        return st;
    if (n < 0 || (n > 0 && !keys))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %d keys at %p", fn, n, (const void *)keys);
    for (int i = 0; i < n; i++) {
        size_t klen = 0;
        st = check_key(fn, keys[i], &klen);
        if (st != TS_OK)
            return st;
    }
    uint64_t deadline = deadline_after(s->timeout_s);
    for (int i = 0; i < n; i++) {
        char what[256];
        describe(what, sizeof what, "wait", keys[i]);
        reply r;
        st = do_wait(s, what, TS__STORE_OP_WAIT, keys[i], strlen(keys[i]), deadline, s->timeout_s, false, &r);
        if (st == TS_OK) {
            free(r.val);
            continue;
        }
        if (st != TS_ERR_TIMEOUT || s->fd < 0)
            return st;
        /* Name every key still missing: this one and any later one. */
        char list[640] = "";
        size_t used = 0;
        bool full = false;
        int missing = 0;
        uint64_t report_deadline = ts_now_ns() + CLIENT_REPORT_NS;
        for (int j = i; j < n; j++) {
            int present = j == i ? 0 : do_check(s, "wait", keys[j], strlen(keys[j]), report_deadline, &st);
            if (present < 0)
                return st;
            if (present)
                continue;
            char item[220];
            snprintf(item, sizeof item, "'%.200s%s'", keys[j], strlen(keys[j]) > 200 ? "..." : "");
            list_add(list, sizeof list, &used, &full, item);
            missing++;
        }
        char secs[32];
        fmt_secs(secs, sizeof secs, s->timeout_s);
        return ts_error(TS_ERR_TIMEOUT, "store wait: %d of %d keys not set within %s s: %s (store at %s)", missing, n,
                        secs, list, s->addr);
    }
    return TS_OK;
}

static ts_status do_add(ts_store *s, const char *what, const char *key, size_t klen, int64_t delta,
                        uint64_t deadline, int64_t *value_out)
{
    reply r;
    ts_status st = roundtrip(s, what, TS__STORE_OP_ADD, key, klen, NULL, 0, NULL, 0, (uint64_t)delta, deadline, &r);
    if (st != TS_OK)
        return st;
    if (r.status == TS__STORE_ST_NOT_COUNTER) {
        free(r.val);
        return ts_error(TS_ERR_FORMAT, "store %s: the key holds a %llu-byte value, not an 8-byte counter", what,
                        (unsigned long long)r.arg);
    }
    if (r.status != TS__STORE_ST_OK)
        return unexpected(s, what, &r);
    free(r.val);
    if (value_out)
        *value_out = (int64_t)r.arg;
    return TS_OK;
}

ts_status ts_store_add(ts_store *s, const char *key, int64_t delta, int64_t *value_out)
{
    static const char fn[] = "ts_store_add";
    size_t klen = 0;
    ts_status st = check_client(fn, s);
    if (st == TS_OK)
        st = check_key(fn, key, &klen);
    if (st != TS_OK)
        return st;
    char what[256];
    describe(what, sizeof what, "add", key);
    return do_add(s, what, key, klen, delta, deadline_after(s->timeout_s), value_out);
}

ts_status ts_store_compare_set(ts_store *s, const char *key, const void *expected, size_t expected_len,
                               const void *desired, size_t desired_len, void **value_out, size_t *len_out)
{
    static const char fn[] = "ts_store_compare_set";
    size_t klen = 0;
    ts_status st = check_client(fn, s);
    if (st == TS_OK)
        st = check_key(fn, key, &klen);
    if (st == TS_OK)
        st = check_value(fn, "expected", expected, expected_len);
    if (st == TS_OK)
        st = check_value(fn, "desired", desired, desired_len);
    if (st == TS_OK && !value_out != !len_out)
        st = ts_error(TS_ERR_INVALID_ARGUMENT, "%s: value_out and len_out must both be given or both be NULL", fn);
    if (st != TS_OK)
        return st;
    char what[256];
    describe(what, sizeof what, "compare_set", key);
    reply r;
    st = roundtrip(s, what, TS__STORE_OP_COMPARE_SET, key, klen, expected, expected_len, desired, desired_len, 0,
                   deadline_after(s->timeout_s), &r);
    if (st != TS_OK)
        return st;
    if (r.status != TS__STORE_ST_OK)
        return unexpected(s, what, &r);
    if (value_out) {
        *value_out = r.val;
        *len_out = r.vlen;
    } else {
        free(r.val);
    }
    return TS_OK;
}

ts_status ts_store_delete(ts_store *s, const char *key, bool *deleted_out)
{
    static const char fn[] = "ts_store_delete";
    size_t klen = 0;
    ts_status st = check_client(fn, s);
    if (st == TS_OK)
        st = check_key(fn, key, &klen);
    if (st != TS_OK)
        return st;
    char what[256];
    describe(what, sizeof what, "delete", key);
    reply r;
    st = roundtrip(s, what, TS__STORE_OP_DELETE, key, klen, NULL, 0, NULL, 0, 0, deadline_after(s->timeout_s), &r);
    if (st != TS_OK)
        return st;
    if (r.status != TS__STORE_ST_OK)
        return unexpected(s, what, &r);
    free(r.val);
    if (deleted_out)
        *deleted_out = r.arg != 0;
    return TS_OK;
}

ts_status ts_store_barrier(ts_store *s, const char *name, int world)
{
    static const char fn[] = "ts_store_barrier";
    ts_status st = check_client(fn, s);
    if (st != TS_OK)
        return st;
    if (!name)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: name is NULL", fn);
    if (world < 1)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: world %d is not >= 1", fn, world);
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
    if (st != TS_OK)
        return st;
    if (n < 1)
        return ts_error(TS_ERR_STATE, "store %s: its counter reads %lld after an increment (was it changed by hand?)",
                        what, (long long)n);
    int64_t epoch = (n - 1) / world;
    int64_t arrived_before = (n - 1) % world; /* participants of this epoch before us */
    char count_key[TS_STORE_MAX_KEY + 1];
    memcpy(count_key, key, (size_t)klen + 1);
    size_t count_klen = (size_t)klen;
    klen = snprintf(key, sizeof key, "barrier/%s/%lld/done", name, (long long)epoch);
    if (arrived_before + 1 == world)
        return do_set(s, what, key, (size_t)klen, NULL, 0, deadline);
    reply r;
    st = do_wait(s, what, TS__STORE_OP_WAIT, key, (size_t)klen, deadline, s->timeout_s, false, &r);
    if (st == TS_OK) {
        free(r.val);
        return TS_OK;
    }
    if (st != TS_ERR_TIMEOUT || s->fd < 0)
        return st;
    int64_t now_count;
    st = do_add(s, what, count_key, count_klen, 0, ts_now_ns() + CLIENT_REPORT_NS, &now_count);
    if (st != TS_OK)
        return st;
    int64_t arrived = now_count - epoch * world;
    if (arrived > world)
        arrived = world;
    char secs[32];
    fmt_secs(secs, sizeof secs, s->timeout_s);
    return ts_error(TS_ERR_TIMEOUT, "store %s (epoch %lld): %lld of %d participants arrived within %s s (store at %s)",
                    what, (long long)epoch, (long long)arrived, world, secs, s->addr);
}

ts_status ts_store_rendezvous(ts_store *s, const char *prefix, int rank, int world)
{
    static const char fn[] = "ts_store_rendezvous";
    ts_status st = check_client(fn, s);
    if (st != TS_OK)
        return st;
    if (!prefix)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: prefix is NULL", fn);
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
    if (st != TS_OK)
        return st;
    for (int r = 0; r < world; r++) {
        klen = snprintf(key, sizeof key, "%s/arrived/%d", prefix, r);
        reply rep;
        st = do_wait(s, what, TS__STORE_OP_WAIT, key, (size_t)klen, deadline, s->timeout_s, false, &rep);
        if (st == TS_OK) {
            free(rep.val);
            continue;
        }
        if (st != TS_ERR_TIMEOUT || s->fd < 0)
            return st;
        char list[640] = "";
        size_t used = 0;
        bool full = false;
        int missing = 0;
        uint64_t report_deadline = ts_now_ns() + CLIENT_REPORT_NS;
        for (int j = r; j < world; j++) {
            int present = 0;
            if (j != r) {
                klen = snprintf(key, sizeof key, "%s/arrived/%d", prefix, j);
                present = do_check(s, what, key, (size_t)klen, report_deadline, &st);
                if (present < 0)
                    return st;
            }
            if (present)
                continue;
            char item[16];
            snprintf(item, sizeof item, "%d", j);
            list_add(list, sizeof list, &used, &full, item);
            missing++;
        }
        char secs[32];
        fmt_secs(secs, sizeof secs, s->timeout_s);
        return ts_error(TS_ERR_TIMEOUT, "%s: %s %s of %d never arrived within %s s (store at %s)", what,
                        missing == 1 ? "rank" : "ranks", list, world, secs, s->addr);
    }
    return TS_OK;
}
