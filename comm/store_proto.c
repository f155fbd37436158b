#define _GNU_SOURCE
/*
 * The rendezvous store's protocol core (store_internal.h has the frame
 * layout): frame parsing, the key-value table, waiters and their
 * deadlines; no sockets. The server (store_server.c) feeds it each
 * connection's bytes; the fuzz target (fuzz/fuzz_store.c) drives it
 * directly.
 */
#include "comm/store_internal.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

_Static_assert(TS__STORE_MAX_BODY <= UINT32_MAX, "a frame body must fit its u32 length");
_Static_assert(TS_STORE_MAX_KEY + 64 <= 65536, "keys are small");

static const char *op_name(unsigned op)
{
    static const char *const names[TS__STORE_OP_COUNT_] = {"?",    "HELLO", "SET",         "GET",   "CHECK",
                                                           "WAIT", "ADD",   "COMPARE_SET", "DELETE"};
    return op < TS__STORE_OP_COUNT_ ? names[op] : "?";
}

/* ------------------------------------------------------------------ */
/* Protocol core                                                    */
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
    /* Rejected-client warnings (ts__store_core_warnf). */
    uint64_t warn_last_ms;
    bool warn_any;
    uint64_t warn_pending; /* suppressed since the last line */
    _Atomic uint64_t warn_lines, warn_suppressed;
    /* Test hook (store.h: TS_STORE_TEST_STALL_ENV): the first get or wait
     * of stall_key stalls the server for stall_ms; 0: none. */
    unsigned stall_ms;
    char stall_key[256];
};

/* Reads TS_STORE_TEST_STALL_ENV ("<ms>:<key>", tests only). */
static void read_stall_hook(ts__store_core *core)
{
    const char *v = getenv(TS_STORE_TEST_STALL_ENV);
    if (!v) return;
    char *end = NULL;
    unsigned long ms = strtoul(v, &end, 10);
    if (end == v || *end != ':' || ms == 0 || ms > 60000 || !end[1] || strlen(end + 1) >= sizeof core->stall_key)
        return;
    core->stall_ms = (unsigned)ms;
    snprintf(core->stall_key, sizeof core->stall_key, "%s", end + 1);
}

void ts__store_core_warnf(ts__store_core *core, const char *fmt, ...)
{
    uint64_t now = ts_now_ns() / 1000000u;
    if (core->warn_any && now - core->warn_last_ms < TS__STORE_WARN_INTERVAL_MS) {
        core->warn_pending++;
        atomic_fetch_add(&core->warn_suppressed, 1);
        return;
    }
    char line[320];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (core->warn_pending)
        ts_logf(TS_LOG_WARN, "%s (and %llu more rejected clients in the last %.1f s, not shown)", line,
                (unsigned long long)core->warn_pending, (double)(now - core->warn_last_ms) / 1000.0);
    else ts_logf(TS_LOG_WARN, "%s", line);
    atomic_fetch_add(&core->warn_lines, 1);
    core->warn_any = true;
    core->warn_last_ms = now;
    core->warn_pending = 0;
}

void ts__store_core_warn_counts(ts__store_core *core, uint64_t *lines, uint64_t *suppressed)
{
    *lines = atomic_load(&core->warn_lines);
    *suppressed = atomic_load(&core->warn_suppressed);
}

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
    if (!core) return TS_ERR_NO_MEMORY;
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
    read_stall_hook(core);
    *out = core;
    return TS_OK;
}

void ts__store_core_free(ts__store_core *core)
{
    if (!core) return;
    TS_ASSERT(core->waiters == NULL);
    if (core->warn_pending)
        ts_logf(TS_LOG_WARN, "store: %llu more rejected clients were not shown (at most one warning per %u ms)",
                (unsigned long long)core->warn_pending, TS__STORE_WARN_INTERVAL_MS);
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
        if (e->hash == h && key_eq(e->key, e->klen, key, klen)) return e;
    return NULL;
}

static void table_grow(ts__store_core *core)
{
    size_t nb = core->nbuckets * 2;
    entry **nt = ts__calloc(TS_MEM_COMM, nb, sizeof *nt);
    if (!nt) return; /* keep working with longer chains */
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
        if (!copy) return NULL;
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
    if (klen) memcpy(e->key, key, klen);
    size_t b = h & (core->nbuckets - 1);
    e->next = core->buckets[b];
    core->buckets[b] = e;
    core->count++;
    if (core->count > core->nbuckets) table_grow(core);
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
    if (!r) return NULL;
    r->len = total;
    unsigned char *p = r->bytes;
    ts__store_wr32(p, (uint32_t)(TS__STORE_RESP_FIXED + vlen));
    p[4] = status;
    ts__store_wr32(p + 5, (uint32_t)vlen);
    if (vlen) memcpy(p + 9, val, vlen);
    ts__store_wr64(p + 9 + vlen, arg);
    return r;
}

/* Answers the connection being processed; false (drop it) when out of memory. */
static bool answer(ts__store_core *core, ts__store_conn *c, uint8_t status, const void *val, size_t vlen, uint64_t arg)
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
    if (!r) ts_logf(TS_LOG_ERROR, "store: out of memory answering client %s; dropping it", c->peer);
    core->send(c, r, core->ctx);
}

static void unpark(ts__store_core *core, ts__store_conn *c)
{
    if (!c->parked) return;
    if (c->wprev) c->wprev->wnext = c->wnext;
    else core->waiters = c->wnext;
    if (c->wnext) c->wnext->wprev = c->wprev;
    c->wprev = c->wnext = NULL;
    ts__free(TS_MEM_COMM, c->wait_key);
    c->wait_key = NULL;
    c->parked = false;
}

static bool park(ts__store_core *core, ts__store_conn *c, uint8_t op, const unsigned char *key, size_t klen,
                 uint64_t deadline)
{
    c->wait_key = ts__malloc(TS_MEM_COMM, klen ? klen : 1);
    if (!c->wait_key) return false;
    if (klen) memcpy(c->wait_key, key, klen);
    c->wait_klen = (uint32_t)klen;
    c->wait_op = op;
    c->deadline_ms = deadline;
    c->parked = true;
    c->wprev = NULL;
    c->wnext = core->waiters;
    if (core->waiters) core->waiters->wprev = c;
    core->waiters = c;
    return true;
}

/* Answers every waiter of e's key. */
static void wake(ts__store_core *core, const entry *e)
{
    ts__store_conn *next;
    for (ts__store_conn *w = core->waiters; w; w = next) {
        next = w->wnext;
        if (!key_eq(w->wait_key, w->wait_klen, e->key, e->klen)) continue;
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
        if (w->deadline_ms > now_ms) continue;
        unpark(core, w);
        answer_waiter(core, w, TS__STORE_ST_TIMEOUT, NULL, 0);
    }
}

uint64_t ts__store_core_next_deadline(const ts__store_core *core)
{
    uint64_t d = UINT64_MAX;
    for (const ts__store_conn *w = core->waiters; w; w = w->wnext)
        if (w->deadline_ms < d) d = w->deadline_ms;
    return d;
}

void ts__store_conn_init(ts__store_core *core, ts__store_conn *c, const char *peer)
{
    memset(c, 0, sizeof *c);
    c->core = core;
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
    if (!nb) return false;
    if (c->len) memcpy(nb, c->buf, c->len);
    ts__free(TS_MEM_COMM, c->buf);
    c->buf = nb;
    c->cap = cap;
    return true;
}

bool ts__store_conn_space(ts__store_core *core, ts__store_conn *c, unsigned char **p, size_t *n)
{
    (void)core;
    if (!c->buf && !set_buffer(c, CONN_BUF_INITIAL)) return false;
    if (c->len == c->cap) {
        /* The frame being received does not fit (complete frames are
         * consumed, so its length is known and passed the limits in
         * ts__store_conn_received). Grow geometrically towards it, so that
         * memory follows the bytes that really arrive, not the length a
         * client announces. */
        uint64_t total = 4 + (uint64_t)ts__store_rd32(c->buf);
        uint64_t want = 2 * (uint64_t)c->cap;
        if (want > total) want = total;
        if (want <= c->cap || want > 4 + TS__STORE_MAX_BODY) return false; /* not reached */
        if (!set_buffer(c, (size_t)want)) return false;
    }
    *p = c->buf + c->len;
    *n = c->cap - c->len;
    return true;
}

/* Warnings (rejected clients) go through the core's rate limit. */
static void vlog_drop(const ts__store_conn *c, ts_log_level level, const char *fmt, va_list ap)
{
    if (!TS_LOG_ENABLED(level)) return;
    char why[256];
    vsnprintf(why, sizeof why, fmt, ap);
    if (level == TS_LOG_WARN && c->core) ts__store_core_warnf(c->core, "store: dropping client %s: %s", c->peer, why);
    else ts_logf(level, "store: dropping client %s: %s", c->peer, why);
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
    case TS__STORE_OP_HELLO: return TS_STORE_MAX_TOKEN;
    case TS__STORE_OP_SET: return TS_STORE_MAX_VALUE;
    case TS__STORE_OP_COMPARE_SET: return 4u + 2u * (uint64_t)TS_STORE_MAX_VALUE;
    default: return 0;
    }
}

/* -1: drop (logged); 0: the frame is incomplete; 1: a complete frame. Every
 * check that the bytes received so far allow is made at once, so an
 * oversized or impossible frame is refused before its body arrives. */
static int check_frame(ts__store_conn *c, const unsigned char *p, size_t avail)
{
    if (avail < 4) return 0;
    uint32_t body = ts__store_rd32(p);
    uint64_t limit = c->authed ? TS__STORE_MAX_BODY : TS__STORE_MAX_HELLO_BODY;
    if (body < TS__STORE_REQ_FIXED)
        return refuse(c, TS_LOG_INFO, "frame body of %u bytes is shorter than the %u-byte minimum", body,
                      TS__STORE_REQ_FIXED);
    if (body > limit)
        return refuse(c, TS_LOG_INFO, "frame body of %u bytes is over the limit of %llu bytes%s", body,
                      (unsigned long long)limit, c->authed ? "" : " before hello");
    if (avail < 5) return 0;
    unsigned op = p[4];
    if (op == 0 || op >= TS__STORE_OP_COUNT_) return refuse(c, TS_LOG_INFO, "unknown op %u", op);
    if (!c->authed && op != TS__STORE_OP_HELLO) return refuse(c, TS_LOG_WARN, "sent %s before hello", op_name(op));
    if (c->authed && op == TS__STORE_OP_HELLO) return refuse(c, TS_LOG_INFO, "said hello twice");
    if (avail < 9) return 0;
    uint32_t klen = ts__store_rd32(p + 5);
    uint32_t max_key = op == TS__STORE_OP_HELLO ? 0 : TS_STORE_MAX_KEY;
    if (klen > max_key)
        return refuse(c, TS_LOG_INFO, "%s with a key of %u bytes (limit %u)", op_name(op), klen, max_key);
    if (klen > body - TS__STORE_REQ_FIXED)
        return refuse(c, TS_LOG_INFO, "key of %u bytes does not fit a body of %u bytes", klen, body);
    uint64_t vlen = (uint64_t)body - TS__STORE_REQ_FIXED - klen;
    if (vlen > max_value_len(op))
        return refuse(c, TS_LOG_INFO, "%s with a value of %llu bytes (limit %llu)", op_name(op),
                      (unsigned long long)vlen, (unsigned long long)max_value_len(op));
    if (avail < 13 + (size_t)klen) return 0;
    uint32_t declared = ts__store_rd32(p + 9 + klen);
    if (declared != vlen)
        return refuse(c, TS_LOG_INFO, "value length %u does not match the body length (%llu expected)", declared,
                      (unsigned long long)vlen);
    return avail >= 4 + (size_t)body ? 1 : 0;
}

static bool token_ok(const ts__store_core *core, const unsigned char *t, size_t n)
{
    if (!core->token) return true;
    /* Constant time in the expected token: every byte presented is
     * compared, and the lengths fold into the same accumulator. */
    volatile unsigned acc = (unsigned)(n != core->token_len);
    for (size_t i = 0; i < n; i++) acc |= (unsigned)(t[i] ^ core->token[i % core->token_len]);
    return acc == 0;
}

static uint64_t sat_add(uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; }

/* Runs one complete, checked frame; false means drop. */
static bool run_frame(ts__store_core *core, ts__store_conn *c, const unsigned char *p, uint64_t now_ms)
{
    unsigned op = p[4];
    uint32_t klen = ts__store_rd32(p + 5);
    const unsigned char *key = p + 9;
    uint32_t vlen = ts__store_rd32(p + 9 + klen);
    const unsigned char *val = p + 13 + klen;
    uint64_t arg = ts__store_rd64(val + vlen);
    entry *e;

    switch (op) {
    case TS__STORE_OP_HELLO:
        if (arg != TS__STORE_PROTOCOL)
            return drop(c, TS_LOG_WARN, "protocol version %llu (this server speaks %u)", (unsigned long long)arg,
                        TS__STORE_PROTOCOL);
        if (!token_ok(core, val, vlen)) {
            answer(core, c, TS__STORE_ST_BAD_TOKEN, NULL, 0, TS__STORE_PROTOCOL); /* then dropped */
            /* Recorded for the job (store.h: TS_STORE_REJECTED_KEY and
             * TS_STORE_REJECTED_COUNT_KEY): a rendezvous that began before
             * this rejection and still waits for a rank fails at once.
             * Out of memory, it is only logged. */
            static const char rk[] = TS_STORE_REJECTED_KEY, ck[] = TS_STORE_REJECTED_COUNT_KEY;
            entry *re = table_put(core, (const unsigned char *)rk, sizeof rk - 1, c->peer, strlen(c->peer));
            if (re) wake(core, re);
            entry *ce = table_find(core, (const unsigned char *)ck, sizeof ck - 1,
                                   hash_key((const unsigned char *)ck, sizeof ck - 1));
            if (ce && ce->vlen == 8) {
                ts__store_wr64(ce->val, ts__store_rd64(ce->val) + 1);
            } else {
                unsigned char one[8];
                ts__store_wr64(one, 1);
                ce = table_put(core, (const unsigned char *)ck, sizeof ck - 1, one, 8);
            }
            if (ce) wake(core, ce);
            return drop(c, TS_LOG_WARN, "wrong token");
        }
        c->authed = true;
        return answer(core, c, TS__STORE_ST_OK, NULL, 0, TS__STORE_PROTOCOL);

    case TS__STORE_OP_SET:
        e = table_put(core, key, klen, val, vlen);
        if (!e) return answer(core, c, TS__STORE_ST_NO_MEMORY, NULL, 0, 0);
        if (!answer(core, c, TS__STORE_ST_OK, NULL, 0, 0)) return false;
        wake(core, e);
        return true;

    case TS__STORE_OP_GET:
    case TS__STORE_OP_WAIT:
        if (core->stall_ms && klen == strlen(core->stall_key) && memcmp(key, core->stall_key, klen) == 0) {
            /* the test hook: a loaded host, once */
            ts_logf(TS_LOG_WARN, "store: test hook " TS_STORE_TEST_STALL_ENV ": stalling %u ms on '%s'", core->stall_ms,
                    core->stall_key);
            struct timespec ts = {core->stall_ms / 1000, (long)(core->stall_ms % 1000) * 1000000L};
            nanosleep(&ts, NULL);
            core->stall_ms = 0;
            static const char sk[] = TS_STORE_TEST_STALLED_KEY;
            entry *se = table_put(core, (const unsigned char *)sk, sizeof sk - 1, "", 0);
            if (se) wake(core, se);
        }
        e = table_find(core, key, klen, hash_key(key, klen));
        if (e) {
            bool get = op == TS__STORE_OP_GET;
            return answer(core, c, TS__STORE_ST_OK, get ? e->val : NULL, get ? e->vlen : 0, 0);
        }
        if (arg == 0) return answer(core, c, TS__STORE_ST_TIMEOUT, NULL, 0, 0);
        if (!park(core, c, (uint8_t)op, key, klen, sat_add(now_ms, arg)))
            return answer(core, c, TS__STORE_ST_NO_MEMORY, NULL, 0, 0);
        return true;

    case TS__STORE_OP_CHECK:
        e = table_find(core, key, klen, hash_key(key, klen));
        return answer(core, c, e ? TS__STORE_ST_OK : TS__STORE_ST_NOT_FOUND, NULL, 0, e ? 1 : 0);

    case TS__STORE_OP_ADD: {
        e = table_find(core, key, klen, hash_key(key, klen));
        if (e && e->vlen != 8) return answer(core, c, TS__STORE_ST_NOT_COUNTER, NULL, 0, e->vlen);
        uint64_t v = (e ? ts__store_rd64(e->val) : 0) + arg; /* wraps: two's complement */
        if (e) {
            ts__store_wr64(e->val, v);
        } else {
            unsigned char b[8];
            ts__store_wr64(b, v);
            e = table_put(core, key, klen, b, 8);
            if (!e) return answer(core, c, TS__STORE_ST_NO_MEMORY, NULL, 0, 0);
        }
        if (!answer(core, c, TS__STORE_ST_OK, NULL, 0, v)) return false;
        wake(core, e);
        return true;
    }

    case TS__STORE_OP_COMPARE_SET: {
        if (vlen < 4) return drop(c, TS_LOG_INFO, "COMPARE_SET value of %u bytes lacks the expected length", vlen);
        uint32_t elen = ts__store_rd32(val);
        if (elen > vlen - 4 || elen > TS_STORE_MAX_VALUE || vlen - 4 - elen > TS_STORE_MAX_VALUE)
            return drop(c, TS_LOG_INFO, "COMPARE_SET expected length %u does not fit its value of %u bytes", elen,
                        vlen);
        const unsigned char *expected = val + 4, *desired = val + 4 + elen;
        size_t dlen = vlen - 4 - elen;
        e = table_find(core, key, klen, hash_key(key, klen));
        bool match = e ? key_eq(e->val, e->vlen, expected, elen) : elen == 0;
        if (!match) return answer(core, c, TS__STORE_ST_OK, e ? e->val : NULL, e ? e->vlen : 0, 0);
        e = table_put(core, key, klen, desired, dlen);
        if (!e) return answer(core, c, TS__STORE_ST_NO_MEMORY, NULL, 0, 0);
        if (!answer(core, c, TS__STORE_ST_OK, e->val, e->vlen, 1)) return false;
        wake(core, e);
        return true;
    }

    case TS__STORE_OP_DELETE: {
        bool existed = table_delete(core, key, klen);
        return answer(core, c, TS__STORE_ST_OK, NULL, 0, existed ? 1 : 0);
    }

    default: /* check_frame refused it */ return drop(c, TS_LOG_INFO, "unknown op %u", op);
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
        if (r == 0) break;
        if (!run_frame(core, c, p, now_ms)) {
            ok = false;
            break;
        }
        off += 4 + (size_t)ts__store_rd32(p);
    }
    if (!ok) return false;
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
        if (!ts__store_conn_space(core, c, &p, &room)) return false;
        size_t k = n < room ? n : room;
        memcpy(p, d, k);
        if (!ts__store_conn_received(core, c, k, now_ms)) return false;
        d += k;
        n -= k;
    }
    return true;
}
