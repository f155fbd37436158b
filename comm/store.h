/*
 * tensorshard rendezvous store: a TCP key-value server on libuv (hosted by
 * rank 0 or the launcher) and a blocking client (docs/design.md D8).
 *
 * The wire protocol is internal (comm/store_internal.h). A client's first
 * message carries the job's token (compared in constant time); a wrong
 * token (recorded under TS_STORE_REJECTED_KEY and counted under
 * TS_STORE_REJECTED_COUNT_KEY), an unknown request, a
 * malformed or oversized one (key over
 * TS_STORE_MAX_KEY, value over TS_STORE_MAX_VALUE, token over
 * TS_STORE_MAX_TOKEN), or a request sent while a get/wait of the same
 * connection is still pending drops the client; the server logs why (warn
 * for a wrong token, info otherwise) and keeps serving everyone else. Keys
 * and values are binary-safe on the wire (the C API takes keys as
 * strings).
 *
 * Idle and flooding clients: a connection that has not presented a valid
 * token within TS_STORE_HELLO_TIMEOUT_MS is closed, and while
 * TS_STORE_MAX_PENDING connections are waiting to present theirs, new ones
 * are closed at once (the client retries such a close until its connect
 * timeout: a flood delays a real client by at most the hello timeout).
 * Warnings about rejected clients are rate-limited to one line per second,
 * the next line counting those not shown.
 *
 * Waiting: ts_store_get and ts_store_wait pass the client's remaining time
 * to the server, which answers when the key is set (by set, add or
 * compare_set) or that time has passed, so a timed-out call leaves the
 * connection usable. The client also bounds every call itself (poll on the
 * socket, its timeout plus one second of grace for waits): a server that
 * stops answering yields TS_ERR_TIMEOUT, a closed connection TS_ERR_COMM,
 * both naming the store's address; after such an error the client's
 * connection is gone and every later call fails with TS_ERR_COMM.
 *
 * Lifetime rules: the server and each client are objects the library
 * allocates (ts_store_server_start / ts_store_connect) and frees
 * (ts_store_server_stop / ts_store_close); their memory is counted under
 * TS_MEM_COMM. Values returned to the caller (ts_store_get,
 * ts_store_compare_set) are copies the caller owns and releases with
 * ts_store_value_free (never NULL on success, even when empty).
 *
 * Threads: the server runs its own libuv loop in its own thread (which
 * blocks asynchronous signals and SIGPIPE); every server function may be
 * called from any thread. A client is used by one thread at a time.
 */
#ifndef TS_STORE_H
#define TS_STORE_H

#include "base/base.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TS_STORE_MAX_KEY 4096
#define TS_STORE_MAX_VALUE (64u << 20)
#define TS_STORE_MAX_TOKEN 1024
/* A connection must present its token within this time (ms)... */
#define TS_STORE_HELLO_TIMEOUT_MS 5000
/* ...and at most this many connections may be waiting to present it. */
#define TS_STORE_MAX_PENDING 1024
/* Key under which the server records the address ("127.0.0.1:40312") of
 * the last client it rejected for a wrong token, so that the job can say
 * so (ts_dist_init's rendezvous fails at once naming it). Set by the
 * server only; a client may read it like any key. */
#define TS_STORE_REJECTED_KEY "ts.store/rejected-token"
/* Counter (8 little-endian bytes, a ts_store_add counter) of the clients
 * the server has rejected for a wrong token since it started. The key
 * above is never cleared and is not tied to a run, so a rendezvous reads
 * this counter when it begins and fails only on rejections counted after
 * that, while ranks are still missing: a stray client rejected earlier
 * (or under a launcher's store, during an earlier ts_dist_init) does not
 * fail it. Set by the server only. */
#define TS_STORE_REJECTED_COUNT_KEY "ts.store/rejected-count"
/* Test hook, for tests only (tests/comm/test_rendezvous.c): when this
 * variable is "<ms>:<key>" (ms in 1..60000) as a server starts, the first
 * get or wait of exactly <key> that server receives stalls its loop for
 * <ms> ms (a reply that comes late, as on a loaded host) before it is
 * served; the server then sets TS_STORE_TEST_STALLED_KEY (empty value).
 * Anything else is ignored. Not for production use. */
#define TS_STORE_TEST_STALL_ENV "TS_STORE_TEST_STALL"
#define TS_STORE_TEST_STALLED_KEY "ts.store/test-stalled"
/* Environment variable a client reads its token from when given NULL
 * (the launcher sets it for every rank). */
#define TS_STORE_TOKEN_ENV "TS_STORE_TOKEN"

typedef struct ts_store_server ts_store_server;
typedef struct ts_store ts_store;

/* Starts a server bound to `host` (a numeric IPv4 or IPv6 address or a
 * name that resolves to one; "127.0.0.1" when NULL: loopback unless told
 * otherwise) on `port` (0 picks a free port; read it back with
 * ts_store_server_port). Clients must present `token` (at most
 * TS_STORE_MAX_TOKEN bytes). Without a token (NULL or ""), any token is
 * accepted but only from processes of the server's own user on its own
 * host (the peer's socket must be in /proc/net/tcp or tcp6 with the
 * server's effective uid): others are refused, and their
 * ts_store_connect fails saying to set TS_STORE_TOKEN. The first start
 * raises the process's soft RLIMIT_NOFILE to its hard limit (every rank
 * holds several connections). TS_ERR_IO names the address and
 * the system error (address in use, cannot resolve, ...);
 * TS_ERR_INVALID_ARGUMENT for a bad port, token or NULL `out`. */
TS_API ts_status ts_store_server_start(const char *host, int port, const char *token, ts_store_server **out);
TS_API int ts_store_server_port(const ts_store_server *s);
/* Stops the loop, drops every client (their pending calls fail) and frees
 * the server. Accepts NULL. */
TS_API void ts_store_server_stop(ts_store_server *s);

/* Connects to `host` (NULL: "127.0.0.1") and `port` (1..65535), retrying
 * until `timeout_s` (the server may not be up yet), and says hello with
 * `token` (NULL: the TS_STORE_TOKEN environment variable, "" if unset).
 * TS_ERR_TIMEOUT names the address and the last system error (a server
 * that keeps closing the connection before answering, as one at its cap
 * of pending connections does, is retried until then); TS_ERR_COMM when
 * the server rejects the token (the detail says so), refuses this client
 * (see ts_store_server_start) or the name does not resolve;
 * TS_ERR_INVALID_ARGUMENT for bad arguments. */
TS_API ts_status ts_store_connect(const char *host, int port, const char *token, double timeout_s, ts_store **out);
/* Frees the client (closing its connection). Accepts NULL. */
TS_API void ts_store_close(ts_store *s);
/* Timeout (seconds) for every later call of this client; default 300. Each
 * call (including the whole of wait, barrier and rendezvous) must finish
 * within it. Values that are not > 0 are ignored; very large ones are
 * capped at 30 days. Accepts NULL (no effect). */
TS_API void ts_store_set_timeout(ts_store *s, double timeout_s);

/* Every call below returns TS_ERR_INVALID_ARGUMENT for a NULL client or
 * key, a key longer than TS_STORE_MAX_KEY, a value longer than
 * TS_STORE_MAX_VALUE or NULL with a non-zero length, and TS_ERR_COMM /
 * TS_ERR_TIMEOUT as described at the top when the store cannot be reached.
 * Error details name the key (truncated to 200 bytes) and the address. */

/* Sets `key` to a copy of `len` bytes at `value`, waking its waiters. */
TS_API ts_status ts_store_set(ts_store *s, const char *key, const void *value, size_t len);
/* Blocks until `key` exists (or the timeout: TS_ERR_TIMEOUT naming the
 * key), then returns its value (the caller's; release it with
 * ts_store_value_free). A counter reads as
 * its 8 little-endian bytes. Both outputs are required. */
TS_API ts_status ts_store_get(ts_store *s, const char *key, void **value_out, size_t *len_out);
/* TS_OK if the key exists now, TS_ERR_NOT_FOUND otherwise (no waiting). */
TS_API ts_status ts_store_check(ts_store *s, const char *key);
/* Waits until every one of the `n` keys exists (n >= 0; no values are
 * transferred). TS_ERR_TIMEOUT lists the keys still missing at the end. */
TS_API ts_status ts_store_wait(ts_store *s, int n, const char *const *keys);
/* Adds `delta` to the integer counter at `key` (created as 0) and returns
 * the new value (wrapping in two's complement; `value_out` may be NULL).
 * A counter is an 8-byte little-endian value, so ts_store_set can
 * initialise one. TS_ERR_FORMAT if the key holds a value of another size.
 * Wakes the key's waiters. */
TS_API ts_status ts_store_add(ts_store *s, const char *key, int64_t delta, int64_t *value_out);
/* Sets `key` to `desired` if its value equals `expected` (an absent key
 * matches expected_len == 0, as does a present empty value). Returns the
 * value after the call (the caller's; release it with
 * ts_store_value_free): `desired` when it swapped, else the
 * current value, or an empty value when the key is absent. `value_out`
 * and `len_out` may both be NULL when the caller does not want it. */
TS_API ts_status ts_store_compare_set(ts_store *s, const char *key, const void *expected, size_t expected_len,
                                      const void *desired, size_t desired_len, void **value_out, size_t *len_out);
/* Releases a value that ts_store_get or ts_store_compare_set returned.
 * Accepts NULL. Any thread. Never free() a value: it may come from the
 * allocator set with ts_set_allocator. */
TS_API void ts_store_value_free(void *value);
/* Deletes `key`; *deleted_out (may be NULL) says whether it existed.
 * Waiters on the key keep waiting. */
TS_API ts_status ts_store_delete(ts_store *s, const char *key, bool *deleted_out);
/* A barrier of `world` (>= 1) participants built on add: each call of a
 * given `name` is a new epoch. Keys: "barrier/<name>/count" (the counter;
 * the epoch is (count - 1) / world) and "barrier/<name>/<epoch>/done".
 * TS_ERR_TIMEOUT says how many arrived; a participant that timed out has
 * still counted itself, so the name must not be used again after a
 * timeout. */
TS_API ts_status ts_store_barrier(ts_store *s, const char *name, int world);
/* Rendezvous of `world` ranks: rank `rank` (0 <= rank < world) sets
 * "<prefix>/arrived/<rank>" (empty value), then waits for every rank's key,
 * all within the client's timeout. On timeout, TS_ERR_TIMEOUT names the
 * ranks that never arrived ("rendezvous 'init': ranks 2, 3 of 4 never
 * arrived within 5.0 s"). The keys stay, so each rendezvous needs its own
 * prefix (a run id, an epoch). */
TS_API ts_status ts_store_rendezvous(ts_store *s, const char *prefix, int rank, int world);

#ifdef __cplusplus
}
#endif
#endif /* TS_STORE_H */
