/*
 * tensorshard rendezvous store: a TCP key-value server on libuv (hosted by
 * rank 0 or the launcher) and a blocking client (DESIGN.md D8).
 *
 * Protocol (both directions little-endian):
 *   request  = u32 body_len | u8 op | u32 klen | key | u32 vlen | value | u64 arg
 *   response = u32 body_len | u8 status | u32 vlen | value | u64 arg
 * A connection's first request must be HELLO carrying the job's token; a
 * wrong token, a malformed or oversized frame (limits below) drops the
 * client. Keys and values are binary-safe.
 *
 * Lifetime rules: the server and each client are objects the library
 * allocates (ts_store_server_start / ts_store_connect) and frees
 * (ts_store_server_stop / ts_store_close). Values returned to the caller
 * are malloc'd copies the caller frees with free().
 *
 * Threads: the server runs its own libuv loop in its own thread; every
 * server function may be called from any thread. A client is used by one
 * thread at a time.
 */
#ifndef TS_STORE_H
#define TS_STORE_H

#include "base/base.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TS_STORE_MAX_KEY 4096
#define TS_STORE_MAX_VALUE (64u << 20)

typedef struct ts_store_server ts_store_server;
typedef struct ts_store ts_store;

/* Starts a server bound to `host` ("127.0.0.1" when NULL: loopback unless
 * told otherwise) on `port` (0 picks a free port; read it back with
 * ts_store_server_port). Clients must present `token` (NULL or "" accepts
 * any). TS_ERR_IO names the address and the system error. */
TS_API ts_status ts_store_server_start(const char *host, int port, const char *token, ts_store_server **out);
TS_API int ts_store_server_port(const ts_store_server *s);
/* Stops the loop, drops every client (their pending calls fail) and frees
 * the server. Accepts NULL. */
TS_API void ts_store_server_stop(ts_store_server *s);

/* Connects (retrying until `timeout_s`: the server may not be up yet) and
 * says hello with `token`. TS_ERR_TIMEOUT names the address. */
TS_API ts_status ts_store_connect(const char *host, int port, const char *token, double timeout_s, ts_store **out);
TS_API void ts_store_close(ts_store *s);
/* Timeout (seconds) for every later call of this client; default 300. */
TS_API void ts_store_set_timeout(ts_store *s, double timeout_s);

TS_API ts_status ts_store_set(ts_store *s, const char *key, const void *value, size_t len);
/* Blocks until `key` exists (or the timeout: TS_ERR_TIMEOUT naming the
 * key), then returns its value (malloc'd; free() it). */
TS_API ts_status ts_store_get(ts_store *s, const char *key, void **value_out, size_t *len_out);
/* TS_OK if the key exists now, TS_ERR_NOT_FOUND otherwise (no waiting). */
TS_API ts_status ts_store_check(ts_store *s, const char *key);
/* Waits until every key exists. TS_ERR_TIMEOUT lists the missing keys. */
TS_API ts_status ts_store_wait(ts_store *s, int n, const char *const *keys);
/* Adds `delta` to the integer counter at `key` (created as 0) and returns
 * the new value. TS_ERR_FORMAT if the key holds a non-counter value. */
TS_API ts_status ts_store_add(ts_store *s, const char *key, int64_t delta, int64_t *value_out);
/* Sets `key` to `desired` if its value equals `expected` (an absent key
 * matches expected_len == 0). Returns the value after the call (malloc'd). */
TS_API ts_status ts_store_compare_set(ts_store *s, const char *key, const void *expected, size_t expected_len,
                                      const void *desired, size_t desired_len, void **value_out, size_t *len_out);
/* Deletes `key`; *deleted_out says whether it existed. */
TS_API ts_status ts_store_delete(ts_store *s, const char *key, bool *deleted_out);
/* A barrier of `world` participants built on add: each call of a given
 * `name` is a new epoch. TS_ERR_TIMEOUT says how many arrived. */
TS_API ts_status ts_store_barrier(ts_store *s, const char *name, int world);

#ifdef __cplusplus
}
#endif
#endif /* TS_STORE_H */
