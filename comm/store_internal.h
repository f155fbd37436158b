/*
 * Internals of the rendezvous store (comm/store_proto.c, store_server.c,
 * store_client.c), shared with the tests and the fuzz target
 * (fuzz/fuzz_store.c). Not installed.
 *
 * Wire protocol (both directions little-endian):
 *   request  = u32 body_len | u8 op | u32 klen | key | u32 vlen | value | u64 arg
 *   response = u32 body_len | u8 status | u32 vlen | value | u64 arg
 * body_len counts everything after itself and must equal 17 + klen + vlen
 * (13 + vlen for a response) exactly.
 *   op 1 HELLO        key empty, value = token, arg = protocol version (1)
 *   op 2 SET          key, value
 *   op 3 GET          key, arg = timeout (ms); answers the value
 *   op 4 CHECK        key; answers OK or NOT_FOUND
 *   op 5 WAIT         key, arg = timeout (ms); answers OK, no value
 *   op 6 ADD          key, arg = delta (int64); answers the new value in arg
 *   op 7 COMPARE_SET  key, value = u32 expected_len | expected | desired;
 *                     answers the value after the call, arg = 1 if it swapped
 *   op 8 DELETE       key; answers arg = 1 if the key existed
 *   status 0 OK, 1 NOT_FOUND, 2 TIMEOUT, 3 NOT_COUNTER, 4 NO_MEMORY,
 *          5 BAD_TOKEN, 6 REFUSED (answers to HELLO only)
 * A connection's first request must be HELLO carrying the job's token
 * (compared in constant time). The server answers a good HELLO with OK;
 * a wrong token with BAD_TOKEN and a client the server does not serve
 * without a token (not its own user's on its own host) with REFUSED, then drops the
 * connection; anything else before a good HELLO drops it without an
 * answer, as does the server when the client has not said hello within
 * TS_STORE_HELLO_TIMEOUT_MS or TS_STORE_MAX_PENDING connections are
 * waiting for their hello already (the client retries those). GET and WAIT carry the client's
 * remaining time: the server parks the connection until the key is set
 * and answers TIMEOUT when that time has passed.
 *
 * The server is split in two: a protocol core that knows nothing of
 * sockets (frame parsing, the key-value table, waiters, deadlines) and a
 * libuv layer that feeds it the bytes each connection receives and writes
 * the replies it produces. The fuzz target drives the core directly.
 *
 * Everything here runs on one thread (the server's loop thread, or the
 * fuzzer's). Time is whatever millisecond clock the driver passes in.
 * Includes <uv.h>, which needs _GNU_SOURCE (or a POSIX level) under
 * -std=c11.
 */
#ifndef TS_STORE_INTERNAL_H
#define TS_STORE_INTERNAL_H

#include <uv.h>

#include "base/internal.h"
#include "comm/store.h"

/* Little-endian field access. */
static inline void ts__store_wr32(unsigned char *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static inline void ts__store_wr64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static inline uint32_t ts__store_rd32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline uint64_t ts__store_rd64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

/* Wire operations (request u8 op). */
enum {
    TS__STORE_OP_HELLO = 1,       /* key empty, value = token, arg = protocol version */
    TS__STORE_OP_SET = 2,         /* key, value */
    TS__STORE_OP_GET = 3,         /* key, arg = timeout in ms; answer: value */
    TS__STORE_OP_CHECK = 4,       /* key; answer: OK or NOT_FOUND */
    TS__STORE_OP_WAIT = 5,        /* key, arg = timeout in ms; answer: OK (no value) */
    TS__STORE_OP_ADD = 6,         /* key, arg = delta (int64); answer arg: new value */
    TS__STORE_OP_COMPARE_SET = 7, /* key, value = u32 elen | expected | desired; answer: value after */
    TS__STORE_OP_DELETE = 8,      /* key; answer arg: 1 if it existed */
    TS__STORE_OP_COUNT_ = 9
};

/* Wire statuses (response u8 status). */
enum {
    TS__STORE_ST_OK = 0,
    TS__STORE_ST_NOT_FOUND = 1,
    TS__STORE_ST_TIMEOUT = 2,
    TS__STORE_ST_NOT_COUNTER = 3,
    TS__STORE_ST_NO_MEMORY = 4,
    TS__STORE_ST_BAD_TOKEN = 5,
    TS__STORE_ST_REFUSED = 6,
    TS__STORE_ST_COUNT_ = 7
};

#define TS__STORE_PROTOCOL 1u
/* Fixed part of a request body: op, klen, vlen, arg. */
#define TS__STORE_REQ_FIXED 17u
/* Fixed part of a response body: status, vlen, arg. */
#define TS__STORE_RESP_FIXED 13u
/* Largest request body of an authenticated client (a compare-and-set with
 * both values at the limit) and of one that has not said hello yet. */
#define TS__STORE_MAX_BODY ((uint64_t)TS__STORE_REQ_FIXED + TS_STORE_MAX_KEY + 4u + 2u * (uint64_t)TS_STORE_MAX_VALUE)
#define TS__STORE_MAX_HELLO_BODY (TS__STORE_REQ_FIXED + TS_STORE_MAX_TOKEN)

/* One reply frame, owned by whoever receives it from the send callback.
 * The libuv layer writes `bytes` with `req` and frees the block (ts__free,
 * TS_MEM_COMM) in the write callback. */
typedef struct ts__store_reply {
    uv_write_t req;
    uv_buf_t buf;
    size_t len;
    unsigned char bytes[];
} ts__store_reply;

typedef struct ts__store_core ts__store_core;

/* Per-connection protocol state; the driver embeds it and keeps it at a
 * stable address between ts__store_conn_init and ts__store_conn_fini. */
typedef struct ts__store_conn {
    unsigned char *buf; /* received bytes not consumed yet */
    size_t len, cap;
    bool authed;
    bool parked; /* a GET or WAIT is waiting for its key */
    uint8_t wait_op;
    unsigned char *wait_key;
    uint32_t wait_klen;
    uint64_t deadline_ms;
    struct ts__store_conn *wprev, *wnext; /* the core's waiter list */
    char peer[64];                        /* for log lines */
    ts__store_core *core;                 /* set by ts__store_conn_init */
    void *user;                           /* the driver's */
} ts__store_conn;

/* Called with each reply for `c` (ownership passes), or with NULL when
 * the core wants `c` dropped but cannot say so through a return value
 * (a woken waiter whose reply could not be allocated). It must not call
 * back into the core. */
typedef void (*ts__store_send_fn)(ts__store_conn *c, ts__store_reply *reply, void *ctx);

/* `token` NULL or "" accepts any token. TS_ERR_NO_MEMORY only. */
ts_status ts__store_core_new(const char *token, ts__store_send_fn send, void *ctx, ts__store_core **out);
/* Every connection must have been finished first. Accepts NULL. */
void ts__store_core_free(ts__store_core *core);
/* Number of keys held. */
size_t ts__store_core_count(const ts__store_core *core);

void ts__store_conn_init(ts__store_core *core, ts__store_conn *c, const char *peer);
/* Forgets the connection's waiter and frees its buffer. */
void ts__store_conn_fini(ts__store_core *core, ts__store_conn *c);
/* Where the next received bytes go (the free tail of the connection's
 * buffer, grown to hold the frame being received). False when out of
 * memory (drop the client). */
bool ts__store_conn_space(ts__store_core *core, ts__store_conn *c, unsigned char **p, size_t *n);
/* `n` bytes were written at the space just handed out: parses and runs
 * every complete request. False means drop the client (malformed or
 * oversized frame, wrong token, a request sent while one is pending); the
 * reason has been logged. */
bool ts__store_conn_received(ts__store_core *core, ts__store_conn *c, size_t n, uint64_t now_ms);
/* space + copy + received, for drivers without a read buffer (the fuzzer). */
bool ts__store_conn_feed(ts__store_core *core, ts__store_conn *c, const void *data, size_t n, uint64_t now_ms);
/* Answers TIMEOUT to every waiter whose deadline is <= now_ms. */
void ts__store_core_expire(ts__store_core *core, uint64_t now_ms);
/* The earliest waiter deadline, UINT64_MAX when nobody waits. */
uint64_t ts__store_core_next_deadline(const ts__store_core *core);

/* Rejected-client warnings (wrong token, no hello in time, over the cap
 * of pending connections, refused peers): at most one line per
 * TS__STORE_WARN_INTERVAL_MS per core, the next line saying how many were
 * suppressed meanwhile; ts__store_core_free logs what is left. Loop
 * thread only. */
#define TS__STORE_WARN_INTERVAL_MS 1000u
void ts__store_core_warnf(ts__store_core *core, const char *fmt, ...) TS_PRINTF(2, 3);
/* Lines printed and suppressed so far (any thread). */
void ts__store_core_warn_counts(ts__store_core *core, uint64_t *lines, uint64_t *suppressed);

/* Counters of a server, for tests (a snapshot; any thread). */
typedef struct ts__store_server_stats {
    unsigned pending;       /* connections waiting for their hello now */
    uint64_t over_cap;      /* closed at once: TS_STORE_MAX_PENDING were pending */
    uint64_t hello_expired; /* closed: no valid hello within the hello timeout */
    uint64_t refused;       /* peers refused: not this user's on this host, and no token */
    uint64_t warn_lines;    /* rejected-client warnings printed */
    uint64_t warn_suppressed;
} ts__store_server_stats;
void ts__store_server_get_stats(const ts_store_server *s, ts__store_server_stats *out);

/* Test hook: the hello timeout (ms) and pending cap of servers started
 * from now on in this process; 0 restores TS_STORE_HELLO_TIMEOUT_MS /
 * TS_STORE_MAX_PENDING. Not thread-safe against concurrent starts. */
void ts__store_server_set_limits(unsigned hello_timeout_ms, unsigned max_pending);

/* The libuv error (UV_EADDRINUSE, UV_EACCES, ...) with which the calling
 * thread's last ts_store_server_start failed to bind or listen; 0 when it
 * succeeded or failed for another reason. Lets ts_dist_init tell "the
 * port is taken" from other failures without parsing the message. */
int ts__store_server_listen_error(void);

#endif /* TS_STORE_INTERNAL_H */
