/*
 * The UCX transport with real processes: the test process forks a store
 * host (a process running ts_store_server_start on 127.0.0.1, port 0; see
 * start_store_host for why not a thread here), then forks the ranks; it
 * never calls UCX itself (docs/design.md, "UCX: fork"), and
 * each rank connects to the store, creates its transport and runs one
 * scenario. Ranks report by exit code (_exit); the test process waits with
 * a deadline and SIGKILLs leftovers.
 *
 * Every wait in a rank is the comm thread's loop: progress, then arm, then
 * poll on wait_fd with a 100 ms timeout, until done or a deadline.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "comm/transport.h"
#include "tests/helpers.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* --------------------------------------------------------- rank helpers */

typedef struct xfer {
    int done;
    ts_status status;
    char detail[512];
} xfer;

static void xfer_cb(void *arg, ts_status status)
{
    xfer *x = arg;
    x->done = 1;
    x->status = status;
    snprintf(x->detail, sizeof x->detail, "%s", status == TS_OK ? "" : ts_last_error());
}

/* Loop statistics of the last wait. */
static long g_progress_calls, g_polls;

#define FAIL(code, ...) \
    do { \
        fprintf(stderr, "rank %d: ", g_rank); \
        fprintf(stderr, __VA_ARGS__); \
        fprintf(stderr, " (line %d)\n", __LINE__); \
        return code; \
    } while (0)

static int g_rank;

/* Waits until every one of the n transfers is done (or stop() says so),
 * sleeping in poll when there is nothing to do. 0 if done, -1 on timeout. */
static int wait_xfers(ts_transport *t, xfer *xs, int n, double timeout_s, bool (*stop)(ts_transport *))
{
    double deadline = now_s() + timeout_s;
    g_progress_calls = g_polls = 0;
    for (;;) {
        int left = 0;
        for (int i = 0; i < n; i++) left += !xs[i].done;
        if (left == 0 || (stop && stop(t))) return 0;
        if (now_s() > deadline) return -1;
        g_progress_calls++;
        if (t->vt->progress(t) > 0) continue;
        ts_status s = t->vt->arm(t);
        if (s == TS_ERR_ALREADY) continue;
        if (s != TS_OK) return -1;
        struct pollfd p = {.fd = t->vt->wait_fd(t), .events = POLLIN};
        g_polls++;
        poll(&p, 1, 100);
    }
}

static unsigned char pattern(int src, int idx, size_t i)
{
    return (unsigned char)(src * 31 + idx * 7 + (int)(i % 251));
}

static void fill(unsigned char *b, size_t n, int src, int idx)
{
    for (size_t i = 0; i < n; i++) b[i] = pattern(src, idx, i);
}

static bool check(const unsigned char *b, size_t n, int src, int idx)
{
    for (size_t i = 0; i < n; i++)
        if (b[i] != pattern(src, idx, i)) return false;
    return true;
}

/* ------------------------------------------------------------ scenarios */

typedef int (*scenario_fn)(ts_transport *t, ts_store *st, const char *prefix);

static int sc_ring(ts_transport *t, ts_store *st, const char *prefix)
{
    (void)st;
    (void)prefix;
    int r = t->rank, w = t->size, right = (r + 1) % w, left = (r + w - 1) % w;
    const size_t sizes[2] = {100, 16u << 20};
    unsigned char *sb[2], *rb[2];
    xfer xs[4] = {0};
    for (int k = 0; k < 2; k++) {
        sb[k] = malloc(sizes[k]);
        rb[k] = calloc(1, sizes[k]);
        if (!sb[k] || !rb[k]) FAIL(10, "out of memory");
        fill(sb[k], sizes[k], r, k);
    }
    for (int k = 0; k < 2; k++) {
        uint64_t tag = 0x1234500000ull + (uint64_t)k;
        if (t->vt->recv(t, left, rb[k], sizes[k], tag, xfer_cb, &xs[k]) != TS_OK) FAIL(11, "recv: %s", ts_last_error());
        if (t->vt->send(t, right, sb[k], sizes[k], tag, xfer_cb, &xs[2 + k]) != TS_OK)
            FAIL(12, "send: %s", ts_last_error());
    }
    if (wait_xfers(t, xs, 4, 20, NULL) != 0) FAIL(13, "ring timed out");
    for (int i = 0; i < 4; i++)
        if (xs[i].status != TS_OK) FAIL(14, "xfer %d: %s %s", i, ts_status_name(xs[i].status), xs[i].detail);
    for (int k = 0; k < 2; k++)
        if (!check(rb[k], sizes[k], left, k)) FAIL(15, "wrong data in message %d from rank %d", k, left);
    for (int k = 0; k < 2; k++) {
        free(sb[k]);
        free(rb[k]);
    }
    return 0;
}

/* Every rank sends NMSG tagged messages to every other rank, posting its
 * sends in increasing tag order and its receives in a scrambled order
 * (some after the data arrived), with sizes across the eager/rendezvous
 * switch. */
#define NMSG 48
static size_t many_size(int i) { return (size_t)(i % 3 == 0 ? 16 : i % 3 == 1 ? 3000 : 40000) + (size_t)i; }

static int sc_many_tags(ts_transport *t, ts_store *st, const char *prefix)
{
    (void)st;
    (void)prefix;
    int r = t->rank, w = t->size, n = (w - 1) * NMSG;
    unsigned char **sb = calloc((size_t)n, sizeof *sb), **rb = calloc((size_t)n, sizeof *rb);
    int *rsrc = calloc((size_t)n, sizeof *rsrc), *ridx = calloc((size_t)n, sizeof *ridx);
    xfer *xs = calloc((size_t)(2 * n), sizeof *xs);
    if (!sb || !rb || !xs || !rsrc || !ridx) FAIL(10, "out of memory");
    int k = 0;
    for (int p = 0; p < w; p++) {
        if (p == r) continue;
        for (int i = 0; i < NMSG; i++, k++) {
            sb[k] = malloc(many_size(i));
            fill(sb[k], many_size(i), r, i);
            if (t->vt->send(t, p, sb[k], many_size(i), 0x77000000ull + (uint64_t)i, xfer_cb, &xs[n + k]) != TS_OK)
                FAIL(11, "send: %s", ts_last_error());
        }
    }
    /* Let some of the messages arrive before their receives. */
    for (int i = 0; i < 20; i++) t->vt->progress(t);
    k = 0;
    for (int p = w - 1; p >= 0; p--) {
        if (p == r) continue;
        for (int j = 0; j < NMSG; j++, k++) {
            int i = (j * 17 + 5) % NMSG; /* 17 is coprime with 48: a permutation */
            rsrc[k] = p;
            ridx[k] = i;
            rb[k] = calloc(1, many_size(i));
            if (t->vt->recv(t, p, rb[k], many_size(i), 0x77000000ull + (uint64_t)i, xfer_cb, &xs[k]) != TS_OK)
                FAIL(12, "recv: %s", ts_last_error());
        }
    }
    if (wait_xfers(t, xs, 2 * n, 30, NULL) != 0) FAIL(13, "many tags timed out");
    for (int i = 0; i < 2 * n; i++)
        if (xs[i].status != TS_OK) FAIL(14, "xfer %d: %s %s", i, ts_status_name(xs[i].status), xs[i].detail);
    for (k = 0; k < n; k++)
        if (!check(rb[k], many_size(ridx[k]), rsrc[k], ridx[k]))
            FAIL(15, "wrong data in message %d from rank %d", ridx[k], rsrc[k]);
    for (k = 0; k < n; k++) {
        free(sb[k]);
        free(rb[k]);
    }
    free(sb);
    free(rb);
    free(rsrc);
    free(ridx);
    free(xs);
    return 0;
}

/* Rank 1 sends (eager sizes complete before rank 0 posts anything, a
 * rendezvous size is in flight), then both meet at a store barrier; only
 * then does rank 0 post its receives. */
static int sc_unexpected(ts_transport *t, ts_store *st, const char *prefix)
{
    char name[128];
    snprintf(name, sizeof name, "%s/unexp", prefix);
    const size_t sizes[3] = {100, 4000, 1u << 20};
    unsigned char *b[3];
    xfer xs[3] = {0};
    for (int k = 0; k < 3; k++) {
        b[k] = calloc(1, sizes[k]);
        if (!b[k]) FAIL(10, "out of memory");
    }
    if (t->rank == 1) {
        for (int k = 0; k < 3; k++) {
            fill(b[k], sizes[k], 1, k);
            if (t->vt->send(t, 0, b[k], sizes[k], (uint64_t)(100 + k), xfer_cb, &xs[k]) != TS_OK)
                FAIL(11, "send: %s", ts_last_error());
        }
        if (wait_xfers(t, xs, 2, 10, NULL) != 0) /* the eager ones complete alone */
            FAIL(12, "eager sends did not complete");
        if (ts_store_barrier(st, name, 2) != TS_OK) FAIL(13, "barrier: %s", ts_last_error());
        if (wait_xfers(t, xs, 3, 10, NULL) != 0) FAIL(14, "rendezvous send did not complete");
    } else {
        if (ts_store_barrier(st, name, 2) != TS_OK) FAIL(13, "barrier: %s", ts_last_error());
        for (int k = 2; k >= 0; k--)
            if (t->vt->recv(t, 1, b[k], sizes[k], (uint64_t)(100 + k), xfer_cb, &xs[k]) != TS_OK)
                FAIL(11, "recv: %s", ts_last_error());
        if (wait_xfers(t, xs, 3, 10, NULL) != 0) FAIL(14, "receives did not complete");
        for (int k = 0; k < 3; k++)
            if (!check(b[k], sizes[k], 1, k)) FAIL(15, "wrong data in message %d", k);
    }
    for (int k = 0; k < 3; k++)
        if (xs[k].status != TS_OK) FAIL(16, "xfer %d: %s %s", k, ts_status_name(xs[k].status), xs[k].detail);
    for (int k = 0; k < 3; k++) free(b[k]);
    return 0;
}

/* Rank 1 sends 200 and 50 bytes; rank 0 receives both into 100-byte
 * buffers: TS_ERR_COMM naming both lengths. Bad arguments fail at once. */
static int sc_mismatch(ts_transport *t, ts_store *st, const char *prefix)
{
    (void)st;
    (void)prefix;
    unsigned char big[200] = {0}, small[50] = {0}, rb[2][100];
    xfer xs[2] = {0};
    xfer never = {0};
    if (t->vt->send(t, 1 - t->rank, big, 10, 1ull << 48, xfer_cb, &never) != TS_ERR_INVALID_ARGUMENT)
        FAIL(10, "a tag with bit 48 set was accepted");
    if (!strstr(ts_last_error(), "tag")) FAIL(10, "detail does not name the tag: %s", ts_last_error());
    if (t->vt->recv(t, 1 - t->rank, rb[0], 10, ~0ull, xfer_cb, &never) != TS_ERR_INVALID_ARGUMENT)
        FAIL(10, "a tag with high bits set was accepted");
    if (t->vt->send(t, 2, big, 10, 1, xfer_cb, &never) != TS_ERR_INVALID_ARGUMENT) FAIL(10, "peer 2 of 2 accepted");
    if (t->vt->recv(t, -1, rb[0], 10, 1, xfer_cb, &never) != TS_ERR_INVALID_ARGUMENT) FAIL(10, "peer -1 accepted");
    if (t->rank == 1) {
        if (t->vt->send(t, 0, big, sizeof big, 1, xfer_cb, &xs[0]) != TS_OK ||
            t->vt->send(t, 0, small, sizeof small, 2, xfer_cb, &xs[1]) != TS_OK)
            FAIL(11, "send: %s", ts_last_error());
        if (wait_xfers(t, xs, 2, 10, NULL) != 0) FAIL(12, "sends did not complete");
    } else {
        if (t->vt->recv(t, 1, rb[0], 100, 1, xfer_cb, &xs[0]) != TS_OK ||
            t->vt->recv(t, 1, rb[1], 100, 2, xfer_cb, &xs[1]) != TS_OK)
            FAIL(11, "recv: %s", ts_last_error());
        if (wait_xfers(t, xs, 2, 10, NULL) != 0) FAIL(12, "receives did not complete");
        for (int k = 0; k < 2; k++) {
            if (xs[k].status != TS_ERR_COMM)
                FAIL(13, "receive %d: %s, expected TS_ERR_COMM", k, ts_status_name(xs[k].status));
            printf("rank 0: mismatch %d: %s\n", k, xs[k].detail);
        }
        if (!strstr(xs[0].detail, "100")) FAIL(14, "detail lacks the buffer size: %s", xs[0].detail);
        if (!strstr(xs[1].detail, "50") || !strstr(xs[1].detail, "100"))
            FAIL(14, "detail lacks both lengths: %s", xs[1].detail);
    }
    if (never.done) FAIL(15, "callback of a rejected call ran");
    return 0;
}

/* Rank 0 posts a receive and waits; rank 1 sends 300 ms later. Rank 0's
 * loop must sleep in poll meanwhile: few progress calls, several polls. */
static int sc_poll_loop(ts_transport *t, ts_store *st, const char *prefix)
{
    char name[128];
    snprintf(name, sizeof name, "%s/poll", prefix);
    unsigned char b[64];
    xfer x = {0};
    if (ts_store_barrier(st, name, 2) != TS_OK) FAIL(10, "barrier: %s", ts_last_error());
    if (t->rank == 1) {
        poll(NULL, 0, 300); /* the delay under test, not a wait */
        fill(b, sizeof b, 1, 0);
        if (t->vt->send(t, 0, b, sizeof b, 5, xfer_cb, &x) != TS_OK) FAIL(11, "send: %s", ts_last_error());
        if (wait_xfers(t, &x, 1, 10, NULL) != 0) FAIL(12, "send did not complete");
    } else {
        if (t->vt->recv(t, 1, b, sizeof b, 5, xfer_cb, &x) != TS_OK) FAIL(11, "recv: %s", ts_last_error());
        double t0 = now_s();
        if (wait_xfers(t, &x, 1, 10, NULL) != 0) FAIL(12, "receive did not complete");
        double dt = now_s() - t0;
        printf("rank 0: waited %.3f s with %ld progress calls and %ld polls\n", dt, g_progress_calls, g_polls);
        if (!check(b, sizeof b, 1, 0)) FAIL(13, "wrong data");
        /* A busy loop makes millions of calls in 300 ms; a sleeping one a
         * few per wakeup (UCX may wake us for its own events). */
        if (g_polls < 1 || g_progress_calls > 5000)
            FAIL(14, "not a sleeping wait: %.3f s, %ld progress calls, %ld polls", dt, g_progress_calls, g_polls);
    }
    if (x.status != TS_OK) FAIL(15, "%s %s", ts_status_name(x.status), x.detail);
    return 0;
}

static bool peer_failed(ts_transport *t) { return t->vt->failed_peer(t, NULL) >= 0; }

/* 3 ranks; rank 2 SIGKILLs itself while ranks 0 and 1 have receives (and
 * rank 1 a rendezvous send) pending with it. Survivors must see
 * TS_ERR_PEER_FAILED from failed_peer() and from the callbacks within
 * 3 s, and destroy must be bounded (checked by the caller). */
static int sc_peer_dies(ts_transport *t, ts_store *st, const char *prefix)
{
    char name[128];
    snprintf(name, sizeof name, "%s/die", prefix);
    static unsigned char rb[2][1 << 20], sb[4 << 20];
    xfer xs[3] = {0};
    int n = 0;
    /* One exchange first, so that the endpoints to rank 2 are wired up. */
    if (t->rank != 2) {
        if (t->vt->recv(t, 2, rb[0], 8, 1, xfer_cb, &xs[n++]) != TS_OK) FAIL(10, "recv: %s", ts_last_error());
    } else {
        for (int p = 0; p < 2; p++)
            if (t->vt->send(t, p, sb, 8, 1, xfer_cb, &xs[n++]) != TS_OK) FAIL(10, "send: %s", ts_last_error());
    }
    if (wait_xfers(t, xs, n, 10, NULL) != 0) FAIL(11, "warm-up timed out");
    for (int i = 0; i < n; i++)
        if (xs[i].status != TS_OK) FAIL(11, "warm-up: %s", xs[i].detail);
    memset(xs, 0, sizeof xs);
    n = 0;
    if (t->rank != 2) {
        for (int k = 0; k < 2; k++)
            if (t->vt->recv(t, 2, rb[k], sizeof rb[k], (uint64_t)(10 + k), xfer_cb, &xs[n++]) != TS_OK)
                FAIL(12, "recv: %s", ts_last_error());
        if (t->rank == 1 && t->vt->send(t, 2, sb, sizeof sb, 20, xfer_cb, &xs[n++]) != TS_OK)
            FAIL(12, "send: %s", ts_last_error());
    }
    if (ts_store_barrier(st, name, 3) != TS_OK) FAIL(13, "barrier: %s", ts_last_error());
    if (t->rank == 2) {
        raise(SIGKILL);
        FAIL(14, "still alive");
    }
    /* The kill happens right after rank 2 leaves the barrier. */
    double t0 = now_s();
    if (wait_xfers(t, xs, 1, 10, peer_failed) != 0) FAIL(15, "no failure seen within 10 s");
    double t_fail = now_s() - t0;
    ts_status fs = TS_OK;
    int fp = t->vt->failed_peer(t, &fs);
    if (wait_xfers(t, xs, n, 5, NULL) != 0) {
        for (int i = 0; i < n; i++)
            fprintf(stderr, "rank %d: xfer %d done %d %s\n", t->rank, i, xs[i].done, ts_status_name(xs[i].status));
        FAIL(16, "pending transfers with the dead rank did not complete within 5 s of its detection (failed peer %d)",
             t->vt->failed_peer(t, NULL));
    }
    double t_cb = now_s() - t0;
    /* Survivors leave together: one that destroys early would look dead
     * to the other. */
    char sname[160];
    snprintf(sname, sizeof sname, "%s/survivors", prefix);
    if (ts_store_barrier(st, sname, 2) != TS_OK) FAIL(21, "survivors' barrier: %s", ts_last_error());
    printf("rank %d: failed_peer %d (%s) after %.3f s; all %d callbacks after %.3f s\n", t->rank, fp,
           ts_status_name(fs), t_fail, n, t_cb);
    for (int i = 0; i < n; i++)
        printf("rank %d:   xfer %d: %s: %s\n", t->rank, i, ts_status_name(xs[i].status), xs[i].detail);
    fflush(stdout);
    if (fp != 2 || fs != TS_ERR_PEER_FAILED) FAIL(17, "failed_peer %d %s", fp, ts_status_name(fs));
    if (t_cb > 3.0) FAIL(18, "detection took %.3f s (> 3 s)", t_cb);
    for (int i = 0; i < n; i++)
        if (xs[i].status != TS_ERR_PEER_FAILED)
            FAIL(19, "xfer %d: %s, expected TS_ERR_PEER_FAILED", i, ts_status_name(xs[i].status));
    if (t->vt->send(t, 2, sb, 8, 30, xfer_cb, &xs[0]) != TS_ERR_PEER_FAILED)
        FAIL(20, "a send to the dead rank was accepted");
    return 0;
}

/* Rank 0 posts a receive nobody sends and a rendezvous send rank 1 never
 * receives, then cancels everything: both callbacks run with the given
 * status within the transport's bound (2 s), and destroy stays bounded. */
static int sc_cancel_all(ts_transport *t, ts_store *st, const char *prefix)
{
    char name[128];
    snprintf(name, sizeof name, "%s/cancel", prefix);
    static unsigned char rb[64], sb[4 << 20];
    static xfer xs[2];
    if (t->rank == 0) {
        if (t->vt->recv(t, 1, rb, sizeof rb, 99, xfer_cb, &xs[0]) != TS_OK ||
            t->vt->send(t, 1, sb, sizeof sb, 98, xfer_cb, &xs[1]) != TS_OK)
            FAIL(10, "post: %s", ts_last_error());
        for (int i = 0; i < 50; i++) t->vt->progress(t);
        if (xs[0].done || xs[1].done) FAIL(11, "a transfer completed by itself");
        double t0 = now_s();
        t->vt->cancel_all(t, TS_ERR_TIMEOUT);
        double dt = now_s() - t0;
        printf("rank 0: cancel_all took %.3f s: recv %s (%s), send %s (%s)\n", dt, ts_status_name(xs[0].status),
               xs[0].detail, ts_status_name(xs[1].status), xs[1].detail);
        if (!xs[0].done || !xs[1].done || xs[0].status != TS_ERR_TIMEOUT || xs[1].status != TS_ERR_TIMEOUT)
            FAIL(12, "cancel_all left: recv %d %s, send %d %s", xs[0].done, ts_status_name(xs[0].status), xs[1].done,
                 ts_status_name(xs[1].status));
        if (dt > 3.0) FAIL(13, "cancel_all took %.3f s", dt);
        if (t->vt->progress(t) < 0) FAIL(14, "progress after cancel_all");
    }
    if (ts_store_barrier(st, name, 2) != TS_OK) FAIL(15, "barrier: %s", ts_last_error());
    return 0;
}

/* The shared-memory bypass (messages of 256 KiB or more on one host): a
 * send abandoned by cancel_all ends at once, and a receiver that reads it
 * afterwards (its buffer reused by then) fails instead of returning what
 * the buffer holds; then a new send with the same tag still goes through
 * (the abandoned transfer's control message is consumed by the failed
 * receive, and acknowledgements are matched by nonce). */
static int sc_bypass_abandoned(ts_transport *t, ts_store *st, const char *prefix)
{
    char name[128];
    enum { N = 1 << 20 };
    static unsigned char b[N];
    xfer x[2] = {{0}, {0}};
    if (t->rank == 0) {
        memset(b, 1, N);
        if (t->vt->send(t, 1, b, N, 5, xfer_cb, &x[0]) != TS_OK) FAIL(10, "send: %s", ts_last_error());
        for (int i = 0; i < 50; i++) t->vt->progress(t);
        double t0 = now_s();
        t->vt->cancel_all(t, TS_ERR_TIMEOUT);
        if (!x[0].done || x[0].status != TS_ERR_TIMEOUT)
            FAIL(11, "cancel_all left the send %d %s", x[0].done, ts_status_name(x[0].status));
        if (now_s() - t0 > 1.0) FAIL(12, "cancel_all took %.3f s", now_s() - t0);
        memset(b, 2, N); /* reused, as the callback allows */
    }
    snprintf(name, sizeof name, "%s/bypass1", prefix);
    if (ts_store_barrier(st, name, 2) != TS_OK) FAIL(13, "barrier: %s", ts_last_error());
    if (t->rank == 1) {
        if (t->vt->recv(t, 0, b, N, 5, xfer_cb, &x[0]) != TS_OK) FAIL(14, "recv: %s", ts_last_error());
        if (wait_xfers(t, &x[0], 1, 5.0, NULL)) FAIL(15, "the late receive hangs");
        if (x[0].status == TS_OK) FAIL(16, "the late receive returned TS_OK with the sender's reused buffer");
        printf("rank 1: late receive: %s (%s)\n", ts_status_name(x[0].status), x[0].detail);
        if (!strstr(x[0].detail, "abandoned")) FAIL(17, "message: %s", x[0].detail);
    }
    snprintf(name, sizeof name, "%s/bypass2", prefix);
    if (ts_store_barrier(st, name, 2) != TS_OK) FAIL(18, "barrier: %s", ts_last_error());
    /* the same tag again, both sides live: right data */
    if (t->rank == 0) {
        memset(b, 3, N);
        if (t->vt->send(t, 1, b, N, 5, xfer_cb, &x[1]) != TS_OK) FAIL(19, "send 2: %s", ts_last_error());
    } else {
        memset(b, 0, N);
        if (t->vt->recv(t, 0, b, N, 5, xfer_cb, &x[1]) != TS_OK) FAIL(20, "recv 2: %s", ts_last_error());
    }
    if (wait_xfers(t, &x[1], 1, 5.0, NULL) || x[1].status != TS_OK)
        FAIL(21, "second transfer: %d %s %s", x[1].done, ts_status_name(x[1].status), x[1].detail);
    if (t->rank == 1)
        for (int i = 0; i < N; i++)
            if (b[i] != 3) FAIL(22, "second transfer: byte %d is %d", i, b[i]);
    snprintf(name, sizeof name, "%s/bypass3", prefix);
    if (ts_store_barrier(st, name, 2) != TS_OK) FAIL(23, "barrier: %s", ts_last_error());
    return 0;
}

/* With tcp in UCX_TLS, the transport (timeout 20 s, run_rank) sets UCX's
 * TCP keepalive so that the kernel's probes span the deadline: 10 s idle,
 * then (20 - 10) / 2 = 5 probes 2 s apart (docs/multihost.md). */
static int sc_tcp_keepalive(ts_transport *t, ts_store *st, const char *prefix)
{
    (void)t, (void)st, (void)prefix;
    static const char *const want[3][2] = {
        {"UCX_TCP_KEEPIDLE", "10s"}, {"UCX_TCP_KEEPINTVL", "2s"}, {"UCX_TCP_KEEPCNT", "5"}};
    for (int i = 0; i < 3; i++) {
        const char *v = getenv(want[i][0]);
        if (!v || strcmp(v, want[i][1]) != 0)
            FAIL(30, "%s is '%s', expected '%s'", want[i][0], v ? v : "(unset)", want[i][1]);
    }
    return 0;
}

/* ---------------------------------------------------------- the harness */

/* A scenario that destroyed the transport itself sets this (run_rank
 * then only checks the memory). */
static bool g_destroyed;

/* The teardown keeps the last error (docs/design.md, D1): rank 0
 * fails (an error of its own), then destroys its transport with a
 * receive pending, which the destroy cancels; the cancelled receive's
 * detail ("... cancelled") goes to its callback, not to the last error. */
static int sc_destroy_keeps_error(ts_transport *t, ts_store *st, const char *prefix)
{
    (void)st;
    (void)prefix;
    if (t->rank != 0) return 0;
    static unsigned char rb[64];
    static xfer x;
    if (t->vt->recv(t, 1, rb, sizeof rb, 77, xfer_cb, &x) != TS_OK) FAIL(20, "post: %s", ts_last_error());
    for (int i = 0; i < 20; i++) t->vt->progress(t);
    ts_error(TS_ERR_SHAPE, "the first error");
    t->vt->destroy(t);
    g_destroyed = true;
    printf("rank 0: after the destroy: %s (%s); the receive: %s\n", ts_status_name(ts_last_status()), ts_last_error(),
           ts_status_name(x.status));
    if (!x.done || x.status == TS_OK) FAIL(21, "the pending receive was not cancelled by the destroy");
    if (ts_last_status() != TS_ERR_SHAPE || strcmp(ts_last_error(), "the first error") != 0)
        FAIL(22, "the destroy wrote the last error: %s (%s)", ts_status_name(ts_last_status()), ts_last_error());
    return 0;
}

static int run_rank(int rank, int world, int port, const char *prefix, scenario_fn fn, double *destroy_s)
{
    g_rank = rank;
    ts_store *st = NULL;
    ts_transport *t = NULL;
    if (ts_store_connect("127.0.0.1", port, "", 10.0, &st) != TS_OK) FAIL(2, "connect: %s", ts_last_error());
    if (ts__ucx_transport_new(st, prefix, rank, world, 20.0, &t) != TS_OK) FAIL(3, "transport: %s", ts_last_error());
    if (strcmp(t->vt->name, "ucx") != 0 || t->rank != rank || t->size != world || t->vt->wait_fd(t) < 0)
        FAIL(4, "bad transport fields");
    int rc = fn(t, st, prefix);
    if (rc == 0 && (g_destroyed || !peer_failed(t))) { /* t is gone when the scenario destroyed it */
        /* Clean shutdown order: everything completed, barrier, close. */
        char name[128];
        snprintf(name, sizeof name, "%s/end", prefix);
        if (ts_store_barrier(st, name, world) != TS_OK) FAIL(5, "end barrier: %s", ts_last_error());
    }
    if (rc != 0) return rc; /* transfers may still point into the scenario's frame: just exit */
    double t0 = now_s();
    if (!g_destroyed) t->vt->destroy(t);
    *destroy_s = now_s() - t0;
    ts_store_close(st);
    /* The ranks leave with _exit (no leak sanitizer): count instead. */
    if (ts_mem_live_bytes(TS_MEM_COMM) != 0)
        FAIL(7, "%zu bytes of comm memory still live after destroy", ts_mem_live_bytes(TS_MEM_COMM));
    return rc;
}

/* The store server runs in a forked process of its own, so that the test
 * process stays single-threaded: forking the ranks from a process where
 * the server's thread may hold a lock (UCX's libucm hooks mmap and takes
 * a lock inside it) leaves that lock held forever in the child. The host
 * writes the port to `port_fd` and stops when `stop_fd` reaches EOF. */
static pid_t start_store_host(int *port_out, int *stop_out)
{
    int pp[2], sp[2];
    cr_assert_eq(pipe(pp), 0);
    cr_assert_eq(pipe(sp), 0);
    fflush(NULL);
    pid_t pid = fork();
    cr_assert_neq(pid, -1, "fork: %s", strerror(errno));
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        close(pp[0]);
        close(sp[1]);
        ts_store_server *srv = NULL;
        int port = -1;
        if (ts_store_server_start("127.0.0.1", 0, NULL, &srv) == TS_OK) port = ts_store_server_port(srv);
        if (write(pp[1], &port, sizeof port) != (ssize_t)sizeof port) _exit(2);
        char c;
        while (read(sp[0], &c, 1) > 0) /* blocks until the test closes its end */
            ;
        ts_store_server_stop(srv);
        _exit(0);
    }
    close(pp[1]);
    close(sp[0]);
    int port = -1;
    struct pollfd p = {.fd = pp[0], .events = POLLIN};
    if (poll(&p, 1, 10000) == 1 && read(pp[0], &port, sizeof port) != (ssize_t)sizeof port) port = -1;
    close(pp[0]);
    cr_assert_gt(port, 0, "the store host did not start");
    *port_out = port;
    *stop_out = sp[1];
    return pid;
}

/* Forks `world` ranks running fn; kill_rank (or -1) is expected to die of
 * SIGKILL, every other rank to exit 0. */
static void run_world(int world, scenario_fn fn, int kill_rank, double deadline_s)
{
    int port = 0, stop_fd = -1;
    pid_t host = start_store_host(&port, &stop_fd);
    char prefix[64];
    snprintf(prefix, sizeof prefix, "t%d", (int)getpid());
    pid_t pids[8];
    fflush(NULL);
    for (int r = 0; r < world; r++) {
        pids[r] = fork();
        cr_assert_neq(pids[r], -1, "fork: %s", strerror(errno));
        if (pids[r] == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            close(stop_fd);
            double destroy_s = 0;
            int rc = run_rank(r, world, port, prefix, fn, &destroy_s);
            if (rc == 0 && destroy_s > 5.0) {
                fprintf(stderr, "rank %d: destroy took %.3f s\n", r, destroy_s);
                rc = 6;
            }
            printf("rank %d: destroy took %.3f s\n", r, destroy_s);
            fflush(NULL);
            _exit(rc);
        }
    }
    double deadline = now_s() + deadline_s;
    int status[8], left = world, failed = 0;
    bool reaped[8] = {false};
    while (left > 0) {
        for (int r = 0; r < world; r++) {
            if (reaped[r]) continue;
            pid_t p = waitpid(pids[r], &status[r], WNOHANG);
            if (p == pids[r]) {
                reaped[r] = true;
                left--;
            }
        }
        if (left == 0) break;
        if (now_s() > deadline) {
            for (int r = 0; r < world; r++)
                if (!reaped[r]) {
                    kill(pids[r], SIGKILL);
                    waitpid(pids[r], &status[r], 0);
                    reaped[r] = true;
                    cr_log_error("rank %d killed at the deadline", r);
                    failed++;
                    status[r] = -1;
                }
            break;
        }
        poll(NULL, 0, 10); /* reaping children: there is no fd to wait on */
    }
    close(stop_fd);
    int hs = 0;
    double hdl = now_s() + 5;
    while (waitpid(host, &hs, WNOHANG) == 0) {
        if (now_s() > hdl) {
            kill(host, SIGKILL);
            waitpid(host, &hs, 0);
            break;
        }
        poll(NULL, 0, 10);
    }
    for (int r = 0; r < world; r++) {
        if (status[r] == -1) continue;
        if (r == kill_rank) {
            if (!(WIFSIGNALED(status[r]) && WTERMSIG(status[r]) == SIGKILL)) {
                cr_log_error("rank %d: expected death by SIGKILL, status 0x%x", r, status[r]);
                failed++;
            }
        } else if (!WIFEXITED(status[r]) || WEXITSTATUS(status[r]) != 0) {
            cr_log_error("rank %d: %s %d", r, WIFEXITED(status[r]) ? "exit" : "signal",
                         WIFEXITED(status[r]) ? WEXITSTATUS(status[r]) : WTERMSIG(status[r]));
            failed++;
        }
    }
    cr_assert_eq(failed, 0, "%d of %d ranks failed", failed, world);
}

ParameterizedTestParameters(comm_transport_ucx, ring)
{
    static int worlds[] = {2, 3, 4};
    return cr_make_param_array(int, worlds, sizeof worlds / sizeof worlds[0]);
}

ParameterizedTest(int *world, comm_transport_ucx, ring, .timeout = 60) { run_world(*world, sc_ring, -1, 50); }

ParameterizedTestParameters(comm_transport_ucx, many_tags_out_of_order)
{
    static int worlds[] = {2, 3, 4};
    return cr_make_param_array(int, worlds, sizeof worlds / sizeof worlds[0]);
}

ParameterizedTest(int *world, comm_transport_ucx, many_tags_out_of_order, .timeout = 60)
{
    run_world(*world, sc_many_tags, -1, 50);
}

Test(comm_transport_ucx, message_before_receive, .timeout = 60) { run_world(2, sc_unexpected, -1, 50); }

Test(comm_transport_ucx, length_mismatch_and_bad_arguments, .timeout = 60) { run_world(2, sc_mismatch, -1, 50); }

Test(comm_transport_ucx, waits_sleep_in_poll, .timeout = 60) { run_world(2, sc_poll_loop, -1, 50); }

Test(comm_transport_ucx, dead_peer_detected_within_3s, .timeout = 60) { run_world(3, sc_peer_dies, 2, 50); }

Test(comm_transport_ucx, cancel_all_is_bounded, .timeout = 60) { run_world(2, sc_cancel_all, -1, 50); }

Test(comm_transport_ucx, destroy_keeps_the_last_error, .timeout = 60) { run_world(2, sc_destroy_keeps_error, -1, 50); }

Test(comm_transport_ucx, bypass_send_abandoned_then_read, .timeout = 60) { run_world(2, sc_bypass_abandoned, -1, 50); }

Test(comm_transport_ucx, tcp_keepalive_spans_the_deadline, .timeout = 60)
{
    /* the ranks inherit these (no UCX call in the test process) */
    char *tls = getenv("UCX_TLS") ? strdup(getenv("UCX_TLS")) : NULL;
    setenv("UCX_TLS", "tcp,self", 1);
    unsetenv("UCX_TCP_KEEPIDLE");
    unsetenv("UCX_TCP_KEEPINTVL");
    unsetenv("UCX_TCP_KEEPCNT");
    run_world(2, sc_tcp_keepalive, -1, 50);
    if (tls) setenv("UCX_TLS", tls, 1);
    else unsetenv("UCX_TLS");
    free(tls);
}

Test(comm_transport_ucx, bad_create_arguments, .timeout = 10)
{
    ts_transport *t = NULL;
    cr_assert_eq(ts__ucx_transport_new(NULL, "p", 0, 1, 1.0, &t), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(t, NULL);
    /* No UCX call may happen in the test process (later tests fork), so
     * only arguments rejected before UCX starts are tried here. */
}
