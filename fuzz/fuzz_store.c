#define _GNU_SOURCE
/* libFuzzer target for the rendezvous store's protocol core (fuzz/README.md
 * says how to build and run it): the frame parser, the key-value table,
 * waiters and deadlines, driven without sockets exactly as the libuv layer
 * drives them.
 *
 * Input: a sequence of records, each starting with a control byte c:
 *   c % 4 in 0..2  the next (c / 4) + 1 bytes (fewer at the end of the
 *                  input) arrive on connection c % 4;
 *   c % 4 == 3     the clock advances by (c / 4) * 7 ms and waiters whose
 *                  deadline passed are answered.
 * Three connections share one core whose token is "tok". A connection the
 * core drops is finished and replaced by a fresh one (a new client).
 *
 * Findings: a crash, an ASan or UBSan report, a reply frame that breaks
 * the protocol (lengths that disagree, an unknown status), a reply to a
 * connection with no request outstanding, or library memory (TS_MEM_COMM)
 * still live once every connection and the core are freed. Drops log at
 * info and warn, so the target sets the log level to error. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/store_internal.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define NCONN 3

typedef struct {
    ts__store_conn conn;
    size_t replies;
    bool dropped; /* the core refused its bytes or asked for a drop through on_send */
} fuzz_conn;

static uint32_t rd32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void fail(const char *what)
{
    fprintf(stderr, "fuzz_store: %s\n", what);
    abort();
}

static void on_send(ts__store_conn *c, ts__store_reply *r, void *ctx)
{
    (void)ctx;
    fuzz_conn *fc = c->user;
    if (!r) {
        fc->dropped = true;
        return;
    }
    if (r->len < 4 + TS__STORE_RESP_FIXED || rd32(r->bytes) != r->len - 4)
        fail("reply length disagrees with its frame");
    uint32_t vlen = rd32(r->bytes + 5);
    if ((size_t)vlen + 4 + TS__STORE_RESP_FIXED != r->len || vlen > TS_STORE_MAX_VALUE)
        fail("reply value length disagrees with its frame");
    if (r->bytes[4] >= TS__STORE_ST_COUNT_) fail("reply with an unknown status");
    if (c->parked) fail("reply to a connection that is still parked");
    /* volatile reads so that ASan checks every byte handed to the writer */
    volatile unsigned char sink = 0;
    for (size_t i = 0; i < r->len; i++) sink ^= r->bytes[i];
    (void)sink;
    fc->replies++;
    ts__free(TS_MEM_COMM, r);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    ts_log_set_level(TS_LOG_ERROR); /* drops log at info and warn */
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    size_t before = ts_mem_live_bytes(TS_MEM_COMM);
    ts__store_core *core = NULL;
    if (ts__store_core_new("tok", on_send, NULL, &core) != TS_OK) fail("core_new");
    static fuzz_conn fc[NCONN];
    char peer[16];
    for (int i = 0; i < NCONN; i++) {
        memset(&fc[i], 0, sizeof fc[i]);
        snprintf(peer, sizeof peer, "fuzz%d", i);
        ts__store_conn_init(core, &fc[i].conn, peer);
        fc[i].conn.user = &fc[i];
    }
    uint64_t now = 1000;
    size_t pos = 0;
    while (pos < size) {
        unsigned c = data[pos++];
        unsigned k = c & 3;
        if (k == 3) {
            now += (uint64_t)(c >> 2) * 7;
            ts__store_core_expire(core, now);
            uint64_t next = ts__store_core_next_deadline(core);
            if (next <= now) fail("a waiter outlived its deadline");
        } else {
            size_t n = (c >> 2) + 1;
            if (n > size - pos) n = size - pos;
            fuzz_conn *f = &fc[k];
            bool ok = ts__store_conn_feed(core, &f->conn, data + pos, n, now);
            pos += n;
            if (!ok) f->dropped = true;
        }
        /* Replace every dropped connection by a new client. */
        for (int i = 0; i < NCONN; i++) {
            if (!fc[i].dropped) continue;
            ts__store_conn_fini(core, &fc[i].conn);
            memset(&fc[i], 0, sizeof fc[i]);
            snprintf(peer, sizeof peer, "fuzz%d", i);
            ts__store_conn_init(core, &fc[i].conn, peer);
            fc[i].conn.user = &fc[i];
        }
    }
    /* Let every waiter time out, then tear down. */
    ts__store_core_expire(core, UINT64_MAX);
    if (ts__store_core_next_deadline(core) != UINT64_MAX) fail("waiters left after expiring everything");
    for (int i = 0; i < NCONN; i++) ts__store_conn_fini(core, &fc[i].conn);
    ts__store_core_free(core);
    if (ts_mem_live_bytes(TS_MEM_COMM) != before) {
        fprintf(stderr, "fuzz_store: %zu live bytes before, %zu after\n", before, ts_mem_live_bytes(TS_MEM_COMM));
        abort();
    }
    return 0;
}
