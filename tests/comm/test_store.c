#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "comm/store_internal.h"
#include "tests/helpers.h"

/* Store tests: one server per test on a free loopback port (port 0), and
 * client threads standing in for ranks. Raw sockets play misbehaving
 * clients.
 *
 * Every test has the same .timeout: Criterion 2.4.1's runner leaks 48
 * bytes (which LeakSanitizer reports, failing the run) when tests with
 * different timeouts run at the same time under --jobs=2. */

static double now_s(void) { return (double)ts_now_ns() / 1e9; }

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static ts_store_server *start_server(const char *token)
{
    ts_store_server *srv = NULL;
    TH_OK(ts_store_server_start(NULL, 0, token, &srv));
    cr_assert_gt(ts_store_server_port(srv), 0);
    return srv;
}

static ts_store *connect_to(const ts_store_server *srv, const char *token)
{
    ts_store *c = NULL;
    TH_OK(ts_store_connect("127.0.0.1", ts_store_server_port(srv), token, 5.0, &c));
    return c;
}

/* ---- raw protocol helpers ---- */

static int raw_connect(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    cr_assert_geq(fd, 0);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof a), 0, "connect: %s", strerror(errno));
    return fd;
}

static void raw_send(int fd, const void *buf, size_t n)
{
    const char *p = buf;
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) return; /* the server may already have dropped us */
        p += w;
        n -= (size_t)w;
    }
}

static void put32(unsigned char *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static void put64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}

/* Builds a well-formed request frame into buf; returns its length. */
static size_t raw_frame(unsigned char *buf, uint8_t op, const void *key, uint32_t klen, const void *val, uint32_t vlen,
                        uint64_t arg)
{
    put32(buf, 17 + klen + vlen);
    buf[4] = op;
    put32(buf + 5, klen);
    if (klen) memcpy(buf + 9, key, klen);
    put32(buf + 9 + klen, vlen);
    if (vlen) memcpy(buf + 13 + klen, val, vlen);
    put64(buf + 13 + klen + vlen, arg);
    return 21 + (size_t)klen + vlen;
}

/* Reads up to n bytes until the deadline; returns how many. */
static size_t raw_recv(int fd, void *buf, size_t n, double timeout_s)
{
    size_t got = 0;
    double end = now_s() + timeout_s;
    while (got < n) {
        int ms = (int)((end - now_s()) * 1000);
        if (ms <= 0) break;
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        if (poll(&pfd, 1, ms) <= 0) break;
        ssize_t r = recv(fd, (char *)buf + got, n - got, 0);
        if (r <= 0) break;
        got += (size_t)r;
    }
    return got;
}

static void raw_hello(int fd, const char *token)
{
    unsigned char f[64 + TS_STORE_MAX_TOKEN];
    size_t n = raw_frame(f, TS__STORE_OP_HELLO, NULL, 0, token, (uint32_t)strlen(token), 1);
    raw_send(fd, f, n);
    unsigned char r[17];
    cr_assert_eq(raw_recv(fd, r, sizeof r, 5.0), sizeof r, "hello answer");
    cr_assert_eq(r[4], TS__STORE_ST_OK);
}

/* Asserts that the server closes the connection within a few seconds
 * (answers sent before the drop are skipped). */
static void expect_dropped(int fd, const char *what)
{
    double end = now_s() + 5.0;
    for (;;) {
        int ms = (int)((end - now_s()) * 1000);
        cr_assert_gt(ms, 0, "%s: the server did not drop the client", what);
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        int pr = poll(&pfd, 1, ms);
        cr_assert_geq(pr, 0);
        if (pr == 0) continue;
        char b[256];
        ssize_t r = recv(fd, b, sizeof b, 0);
        if (r == 0 || (r < 0 && errno == ECONNRESET)) break;
    }
    close(fd);
}

/* ---- basic operations ---- */

Test(comm_store, set_get_binary_values, .timeout = 60)
{
    th_mem_mark();
    ts_store_server *srv = start_server("tok");
    ts_store *c = connect_to(srv, "tok");

    const unsigned char bin[] = {0, 1, 0, 255, 0, 'a', 0};
    TH_OK(ts_store_set(c, "bin", bin, sizeof bin));
    void *v = NULL;
    size_t n = 0;
    TH_OK(ts_store_get(c, "bin", &v, &n));
    cr_assert_eq(n, sizeof bin);
    cr_assert_eq(memcmp(v, bin, n), 0);
    ts_store_value_free(v);

    TH_OK(ts_store_set(c, "empty", NULL, 0));
    TH_OK(ts_store_get(c, "empty", &v, &n));
    cr_assert_eq(n, 0);
    cr_assert_not_null(v, "an empty value is still a pointer to free");
    ts_store_value_free(v);

    /* Overwrite, and a value big enough to take many reads (8 MiB). */
    size_t big = 8u << 20;
    unsigned char *b = malloc(big);
    for (size_t i = 0; i < big; i++) b[i] = (unsigned char)(i * 131 + (i >> 11));
    TH_OK(ts_store_set(c, "bin", b, big));
    TH_OK(ts_store_get(c, "bin", &v, &n));
    cr_assert_eq(n, big);
    cr_assert_eq(memcmp(v, b, big), 0);
    ts_store_value_free(v);
    free(b);

    TH_OK(ts_store_check(c, "bin"));
    cr_assert_eq(ts_store_check(c, "nope"), TS_ERR_NOT_FOUND);

    ts_store_close(c);
    ts_store_server_stop(srv);
    th_mem_assert_back();
}

typedef struct {
    int port;
    const char *key;
    const char *val;
    int delay_ms;
    ts_status st;
} setter_arg;

static void *setter(void *p)
{
    setter_arg *a = p;
    sleep_ms(a->delay_ms);
    ts_store *c = NULL;
    a->st = ts_store_connect(NULL, a->port, "tok", 5.0, &c);
    if (a->st == TS_OK) a->st = ts_store_set(c, a->key, a->val, strlen(a->val));
    ts_store_close(c);
    return NULL;
}

Test(comm_store, get_blocks_until_another_thread_sets, .timeout = 60)
{
    th_mem_mark();
    ts_store_server *srv = start_server("tok");
    ts_store *c = connect_to(srv, "tok");
    setter_arg a = {ts_store_server_port(srv), "late", "here", 200, TS_ERR_INTERNAL};
    pthread_t t;
    pthread_create(&t, NULL, setter, &a);
    double t0 = now_s();
    void *v;
    size_t n;
    TH_OK(ts_store_get(c, "late", &v, &n));
    double dt = now_s() - t0;
    pthread_join(t, NULL);
    TH_OK(a.st);
    cr_assert_eq(n, 4);
    cr_assert_eq(memcmp(v, "here", 4), 0);
    cr_assert_geq(dt, 0.15, "get returned after %.3f s, before the key was set", dt);
    ts_store_value_free(v);
    ts_store_close(c);
    ts_store_server_stop(srv);
    th_mem_assert_back();
}

Test(comm_store, get_timeout_names_key_and_connection_stays_usable, .timeout = 60)
{
    th_mem_mark();
    ts_store_server *srv = start_server("tok");
    ts_store *c = connect_to(srv, "tok");
    ts_store_set_timeout(c, 0.2);
    double t0 = now_s();
    void *v = NULL;
    size_t n = 0;
    cr_assert_eq(ts_store_get(c, "never/set", &v, &n), TS_ERR_TIMEOUT);
    double dt = now_s() - t0;
    cr_assert_null(v, "outputs are written only on success");
    cr_assert(dt >= 0.18 && dt < 1.0, "timed out after %.3f s", dt);
    cr_assert(strstr(ts_last_error(), "'never/set'"), "%s", ts_last_error());
    cr_assert(strstr(ts_last_error(), "0.2 s"), "%s", ts_last_error());
    /* The server answered TIMEOUT, so the connection is still good. */
    TH_OK(ts_store_set(c, "after", "x", 1));
    TH_OK(ts_store_check(c, "after"));
    ts_store_close(c);
    ts_store_server_stop(srv);
    th_mem_assert_back();
}

Test(comm_store, wait_for_several_keys_names_the_missing_ones, .timeout = 60)
{
    th_mem_mark();
    ts_store_server *srv = start_server("tok");
    ts_store *c = connect_to(srv, "tok");
    TH_OK(ts_store_set(c, "k/a", "1", 1));
    TH_OK(ts_store_set(c, "k/c", "3", 1));
    const char *keys[] = {"k/a", "k/b", "k/c", "k/d"};
    ts_store_set_timeout(c, 0.2);
    double t0 = now_s();
    cr_assert_eq(ts_store_wait(c, 4, keys), TS_ERR_TIMEOUT);
    double dt = now_s() - t0;
    cr_assert_lt(dt, 1.0, "wait took %.3f s", dt);
    const char *e = ts_last_error();
    cr_assert(strstr(e, "'k/b'") && strstr(e, "'k/d'"), "%s", e);
    cr_assert(!strstr(e, "'k/a'") && !strstr(e, "'k/c'"), "%s", e);
    cr_assert(strstr(e, "2 of 4"), "%s", e);

    /* Keys set by another client while waiting. */
    ts_store_set_timeout(c, 10);
    setter_arg a = {ts_store_server_port(srv), "k/b", "2", 100, TS_ERR_INTERNAL};
    setter_arg d = {ts_store_server_port(srv), "k/d", "4", 200, TS_ERR_INTERNAL};
    pthread_t ta, td;
    pthread_create(&ta, NULL, setter, &a);
    pthread_create(&td, NULL, setter, &d);
    TH_OK(ts_store_wait(c, 4, keys));
    pthread_join(ta, NULL);
    pthread_join(td, NULL);
    TH_OK(a.st);
    TH_OK(d.st);
    TH_OK(ts_store_wait(c, 0, NULL));
    ts_store_close(c);
    ts_store_server_stop(srv);
    th_mem_assert_back();
}

typedef struct {
    int port;
    int iters;
    ts_status st;
} adder_arg;

static void *adder(void *p)
{
    adder_arg *a = p;
    ts_store *c = NULL;
    a->st = ts_store_connect(NULL, a->port, "tok", 5.0, &c);
    for (int i = 0; i < a->iters && a->st == TS_OK; i++) a->st = ts_store_add(c, "counter", 1, NULL);
    ts_store_close(c);
    return NULL;
}

Test(comm_store, add_from_eight_threads, .timeout = 60)
{
    th_mem_mark();
    ts_store_server *srv = start_server("tok");
    adder_arg args[8];
    pthread_t t[8];
    for (int i = 0; i < 8; i++) {
        args[i] = (adder_arg){ts_store_server_port(srv), 100, TS_ERR_INTERNAL};
        pthread_create(&t[i], NULL, adder, &args[i]);
    }
    for (int i = 0; i < 8; i++) {
        pthread_join(t[i], NULL);
        TH_OK(args[i].st);
    }
    ts_store *c = connect_to(srv, "tok");
    int64_t v = -1;
    TH_OK(ts_store_add(c, "counter", 0, &v));
    cr_assert_eq(v, 800);
    TH_OK(ts_store_add(c, "counter", -1000, &v));
    cr_assert_eq(v, -200);
    /* A counter reads as 8 little-endian bytes. */
    void *b;
    size_t n;
    TH_OK(ts_store_get(c, "counter", &b, &n));
    cr_assert_eq(n, 8);
    int64_t le = 0;
    for (int i = 7; i >= 0; i--) le = (int64_t)((uint64_t)le << 8 | ((unsigned char *)b)[i]);
    cr_assert_eq(le, -200);
    ts_store_value_free(b);
    TH_OK(ts_store_set(c, "text", "abc", 3));
    cr_assert_eq(ts_store_add(c, "text", 1, &v), TS_ERR_FORMAT);
    cr_assert(strstr(ts_last_error(), "3-byte"), "%s", ts_last_error());
    cr_assert_eq(v, -200, "outputs are written only on success");
    ts_store_close(c);
    ts_store_server_stop(srv);
    th_mem_assert_back();
}

Test(comm_store, compare_set_semantics, .timeout = 60)
{
    th_mem_mark();
    ts_store_server *srv = start_server("tok");
    ts_store *c = connect_to(srv, "tok");
    void *v;
    size_t n;
    /* Absent key, non-empty expected: nothing set, empty answer. */
    TH_OK(ts_store_compare_set(c, "cas", "x", 1, "first", 5, &v, &n));
    cr_assert_eq(n, 0);
    ts_store_value_free(v);
    cr_assert_eq(ts_store_check(c, "cas"), TS_ERR_NOT_FOUND);
    /* Absent key, empty expected: set. */
    TH_OK(ts_store_compare_set(c, "cas", NULL, 0, "first", 5, &v, &n));
    cr_assert(n == 5 && memcmp(v, "first", 5) == 0);
    ts_store_value_free(v);
    /* Mismatch: unchanged, current value returned. */
    TH_OK(ts_store_compare_set(c, "cas", "nope", 4, "second", 6, &v, &n));
    cr_assert(n == 5 && memcmp(v, "first", 5) == 0);
    ts_store_value_free(v);
    /* Empty expected no longer matches a non-empty value. */
    TH_OK(ts_store_compare_set(c, "cas", NULL, 0, "second", 6, &v, &n));
    cr_assert(n == 5 && memcmp(v, "first", 5) == 0);
    ts_store_value_free(v);
    /* Match: swapped. Binary values with NULs. */
    TH_OK(ts_store_compare_set(c, "cas", "first", 5, "s\0c", 3, &v, &n));
    cr_assert(n == 3 && memcmp(v, "s\0c", 3) == 0);
    ts_store_value_free(v);
    TH_OK(ts_store_get(c, "cas", &v, &n));
    cr_assert(n == 3 && memcmp(v, "s\0c", 3) == 0);
    ts_store_value_free(v);
    /* A prefix is not equal. */
    TH_OK(ts_store_compare_set(c, "cas", "s", 1, "z", 1, NULL, NULL));
    TH_OK(ts_store_get(c, "cas", &v, &n));
    cr_assert(n == 3 && memcmp(v, "s\0c", 3) == 0);
    ts_store_value_free(v);
    cr_assert_eq(ts_store_compare_set(c, "cas", "s", 1, "z", 1, &v, NULL), TS_ERR_INVALID_ARGUMENT);
    ts_store_close(c);
    ts_store_server_stop(srv);
    th_mem_assert_back();
}

/* Like setter, through compare-and-set on an absent key; keeps the value
 * the call returned (what the key holds after it). */
typedef struct {
    setter_arg set;
    void *after;
    size_t after_len;
} cas_setter_arg;

static void *cas_setter(void *p)
{
    cas_setter_arg *a = p;
    sleep_ms(a->set.delay_ms);
    ts_store *c = NULL;
    a->set.st = ts_store_connect(NULL, a->set.port, "tok", 5.0, &c);
    if (a->set.st == TS_OK)
        a->set.st =
            ts_store_compare_set(c, a->set.key, NULL, 0, a->set.val, strlen(a->set.val), &a->after, &a->after_len);
    ts_store_close(c);
    return NULL;
}

Test(comm_store, compare_set_wakes_waiters, .timeout = 60)
{
    ts_store_server *srv = start_server("tok");
    ts_store *c = connect_to(srv, "tok");
    cas_setter_arg a = {{ts_store_server_port(srv), "woken", "v", 100, TS_ERR_INTERNAL}, NULL, 0};
    pthread_t t;
    pthread_create(&t, NULL, cas_setter, &a);
    void *v;
    size_t n;
    TH_OK(ts_store_get(c, "woken", &v, &n));
    /* the waiter sees what compare-and-set set, and the call swapped */
    cr_assert_eq(n, 1);
    cr_assert_eq(memcmp(v, "v", 1), 0);
    ts_store_value_free(v);
    pthread_join(t, NULL);
    TH_OK(a.set.st);
    cr_assert_eq(a.after_len, 1);
    cr_assert_eq(memcmp(a.after, "v", 1), 0);
    ts_store_value_free(a.after);
    ts_store_close(c);
    ts_store_server_stop(srv);
}

Test(comm_store, delete_keys, .timeout = 60)
{
    th_mem_mark();
    ts_store_server *srv = start_server("tok");
    ts_store *c = connect_to(srv, "tok");
    bool deleted = false;
    TH_OK(ts_store_set(c, "gone", "v", 1));
    TH_OK(ts_store_delete(c, "gone", &deleted));
    cr_assert(deleted);
    cr_assert_eq(ts_store_check(c, "gone"), TS_ERR_NOT_FOUND);
    TH_OK(ts_store_delete(c, "gone", &deleted));
    cr_assert(!deleted);
    TH_OK(ts_store_delete(c, "gone", NULL));
    /* A deleted counter starts again at 0. */
    int64_t x;
    TH_OK(ts_store_add(c, "cnt", 5, &x));
    TH_OK(ts_store_delete(c, "cnt", NULL));
    TH_OK(ts_store_add(c, "cnt", 1, &x));
    cr_assert_eq(x, 1);
    ts_store_close(c);
    ts_store_server_stop(srv);
    th_mem_assert_back();
}

/* ---- barrier and rendezvous ---- */

#define BAR_THREADS 8
#define BAR_EPOCHS 6

typedef struct {
    int port;
    int id;
    atomic_int *arrived; /* per epoch */
    ts_status st;
    int order_errors;
} bar_arg;

static void *barrier_worker(void *p)
{
    bar_arg *a = p;
    ts_store *c = NULL;
    a->st = ts_store_connect(NULL, a->port, "tok", 5.0, &c);
    if (a->st != TS_OK) return NULL;
    ts_store_set_timeout(c, 30);
    for (int e = 0; e < BAR_EPOCHS; e++) {
        atomic_fetch_add(&a->arrived[e], 1);
        if ((a->id + e) % 3 == 0) sleep_ms(5 * (a->id + 1)); /* arrive in a different order each epoch */
        a->st = ts_store_barrier(c, "train", BAR_THREADS);
        if (a->st != TS_OK) break;
        /* Nobody leaves epoch e before everyone has arrived at it. */
        if (atomic_load(&a->arrived[e]) != BAR_THREADS) a->order_errors++;
    }
    ts_store_close(c);
    return NULL;
}

Test(comm_store, barrier_eight_threads_several_epochs, .timeout = 60)
{
    th_mem_mark();
    ts_store_server *srv = start_server("tok");
    atomic_int arrived[BAR_EPOCHS];
    for (int e = 0; e < BAR_EPOCHS; e++) atomic_init(&arrived[e], 0);
    bar_arg args[BAR_THREADS];
    pthread_t t[BAR_THREADS];
    for (int i = 0; i < BAR_THREADS; i++) {
        args[i] = (bar_arg){ts_store_server_port(srv), i, arrived, TS_ERR_INTERNAL, 0};
        pthread_create(&t[i], NULL, barrier_worker, &args[i]);
    }
    for (int i = 0; i < BAR_THREADS; i++) {
        pthread_join(t[i], NULL);
        cr_assert_eq(args[i].st, TS_OK, "thread %d: %s", i, ts_status_name(args[i].st));
        cr_assert_eq(args[i].order_errors, 0, "thread %d left a barrier early", i);
    }
    ts_store *c = connect_to(srv, "tok");
    int64_t n;
    TH_OK(ts_store_add(c, "barrier/train/count", 0, &n));
    cr_assert_eq(n, BAR_THREADS * BAR_EPOCHS);
    TH_OK(ts_store_barrier(c, "solo", 1)); /* a barrier of one never waits */
    TH_OK(ts_store_barrier(c, "solo", 1));
    ts_store_close(c);
    ts_store_server_stop(srv);
    th_mem_assert_back();
}

Test(comm_store, barrier_timeout_says_how_many_arrived, .timeout = 60)
{
    th_mem_mark();
    ts_store_server *srv = start_server("tok");
    ts_store *a = connect_to(srv, "tok"), *b = connect_to(srv, "tok");
    ts_store_set_timeout(a, 0.2);
    TH_OK(ts_store_add(b, "barrier/late/count", 1, NULL)); /* b arrived (and went away) */
    double t0 = now_s();
    cr_assert_eq(ts_store_barrier(a, "late", 3), TS_ERR_TIMEOUT);
    cr_assert_lt(now_s() - t0, 1.5);
    cr_assert(strstr(ts_last_error(), "2 of 3"), "%s", ts_last_error());
    cr_assert(strstr(ts_last_error(), "'late'"), "%s", ts_last_error());
    ts_store_close(a);
    ts_store_close(b);
    ts_store_server_stop(srv);
    th_mem_assert_back();
}

typedef struct {
    int port;
    int rank, world;
    double timeout;
    const char *prefix;
    ts_status st;
    char err[1024];
} rdv_arg;

static void *rdv_worker(void *p)
{
    rdv_arg *a = p;
    ts_store *c = NULL;
    a->st = ts_store_connect(NULL, a->port, "tok", 5.0, &c);
    if (a->st == TS_OK) {
        ts_store_set_timeout(c, a->timeout);
        a->st = ts_store_rendezvous(c, a->prefix, a->rank, a->world);
    }
    snprintf(a->err, sizeof a->err, "%s", ts_last_error());
    ts_store_close(c);
    return NULL;
}

Test(comm_store, rendezvous_completes_and_names_missing_ranks, .timeout = 60)
{
    th_mem_mark();
    ts_store_server *srv = start_server("tok");
    int port = ts_store_server_port(srv);
    rdv_arg args[4];
    pthread_t t[4];
    /* All four arrive. */
    for (int r = 0; r < 4; r++) {
        args[r] = (rdv_arg){port, r, 4, 10.0, "full", TS_ERR_INTERNAL, ""};
        pthread_create(&t[r], NULL, rdv_worker, &args[r]);
    }
    for (int r = 0; r < 4; r++) {
        pthread_join(t[r], NULL);
        cr_assert_eq(args[r].st, TS_OK, "rank %d: %s", r, args[r].err);
    }
    /* Ranks 2 and 3 never come. */
    for (int r = 0; r < 2; r++) {
        args[r] = (rdv_arg){port, r, 4, 1.0, "init", TS_ERR_INTERNAL, ""};
        pthread_create(&t[r], NULL, rdv_worker, &args[r]);
    }
    double t0 = now_s();
    for (int r = 0; r < 2; r++) {
        pthread_join(t[r], NULL);
        cr_assert_eq(args[r].st, TS_ERR_TIMEOUT, "rank %d: %s", r, args[r].err);
        cr_assert(strstr(args[r].err, "rendezvous 'init': ranks 2, 3 of 4 never arrived within 1.0 s"), "rank %d: %s",
                  r, args[r].err);
    }
    cr_assert_lt(now_s() - t0, 3.0);
    /* Only rank 1 missing: singular. */
    for (int r = 0; r < 4; r++) {
        if (r == 1) continue;
        args[r] = (rdv_arg){port, r, 4, 1.0, "one", TS_ERR_INTERNAL, ""};
        pthread_create(&t[r], NULL, rdv_worker, &args[r]);
    }
    for (int r = 0; r < 4; r++) {
        if (r == 1) continue;
        pthread_join(t[r], NULL);
        cr_assert_eq(args[r].st, TS_ERR_TIMEOUT);
        cr_assert(strstr(args[r].err, ": rank 1 of 4 never arrived"), "rank %d: %s", r, args[r].err);
    }
    ts_store_server_stop(srv);
    th_mem_assert_back();
}

/* ---- tokens ---- */

Test(comm_store, wrong_token_is_dropped_right_one_works, .timeout = 60)
{
    th_mem_mark();
    ts_store_server *srv = start_server("s3cret");
    int port = ts_store_server_port(srv);
    ts_store *c = NULL;
    ts_status st = ts_store_connect(NULL, port, "wrong", 2.0, &c);
    cr_assert_eq(st, TS_ERR_COMM, "%s: %s", ts_status_name(st), ts_last_error());
    cr_assert_null(c);
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
    cr_assert(strstr(ts_last_error(), addr) && strstr(ts_last_error(), "token"), "%s", ts_last_error());
    cr_assert_eq(ts_store_connect(NULL, port, "", 2.0, &c), TS_ERR_COMM);
    cr_assert_eq(ts_store_connect(NULL, port, "s3cret!", 2.0, &c), TS_ERR_COMM);
    cr_assert_eq(ts_store_connect(NULL, port, "s3cre", 2.0, &c), TS_ERR_COMM);

    c = connect_to(srv, "s3cret");
    TH_OK(ts_store_set(c, "k", "v", 1));
    ts_store_close(c);

    /* NULL takes the token from the environment. */
    setenv(TS_STORE_TOKEN_ENV, "s3cret", 1);
    TH_OK(ts_store_connect(NULL, port, NULL, 2.0, &c));
    TH_OK(ts_store_check(c, "k"));
    ts_store_close(c);
    setenv(TS_STORE_TOKEN_ENV, "nope", 1);
    cr_assert_eq(ts_store_connect(NULL, port, NULL, 2.0, &c), TS_ERR_COMM);
    unsetenv(TS_STORE_TOKEN_ENV);

    /* A raw client that skips hello is dropped too. */
    int fd = raw_connect(port);
    unsigned char f[64];
    raw_send(fd, f, raw_frame(f, TS__STORE_OP_SET, "k", 1, "x", 1, 0));
    expect_dropped(fd, "set before hello");
    ts_store_server_stop(srv);
    th_mem_assert_back();
}

Test(comm_store, server_without_token_accepts_any, .timeout = 60)
{
    ts_store_server *srv = start_server(NULL);
    ts_store *c = connect_to(srv, "whatever");
    TH_OK(ts_store_set(c, "k", "v", 1));
    ts_store_close(c);
    c = connect_to(srv, "");
    TH_OK(ts_store_check(c, "k"));
    ts_store_close(c);
    ts_store_server_stop(srv);
}

/* ---- hostile clients ---- */

static void assert_still_serving(ts_store *good, int round)
{
    char key[32];
    snprintf(key, sizeof key, "alive/%d", round);
    TH_OK(ts_store_set(good, key, "ok", 2));
    void *v;
    size_t n;
    TH_OK(ts_store_get(good, key, &v, &n));
    cr_assert(n == 2 && memcmp(v, "ok", 2) == 0);
    ts_store_value_free(v);
}

Test(comm_store, malformed_frames_drop_only_the_sender, .timeout = 60)
{
    th_mem_mark();
    ts_store_server *srv = start_server("tok");
    int port = ts_store_server_port(srv);
    ts_store *good = connect_to(srv, "tok");
    int round = 0;
    unsigned char f[256];
    int fd;

    /* Garbage before hello. */
    fd = raw_connect(port);
    unsigned char junk[512];
    for (size_t i = 0; i < sizeof junk; i++) junk[i] = (unsigned char)(i * 7 + 13);
    raw_send(fd, junk, sizeof junk);
    expect_dropped(fd, "garbage");
    assert_still_serving(good, round++);

    /* An oversized length before hello: refused on its first 4 bytes. */
    fd = raw_connect(port);
    put32(f, 1u << 20);
    raw_send(fd, f, 4);
    expect_dropped(fd, "oversized hello");
    assert_still_serving(good, round++);

    /* A truncated frame, then end of stream. */
    fd = raw_connect(port);
    raw_hello(fd, "tok");
    size_t n = raw_frame(f, TS__STORE_OP_SET, "key", 3, "value", 5, 0);
    raw_send(fd, f, n - 6);
    shutdown(fd, SHUT_WR);
    expect_dropped(fd, "truncated");
    assert_still_serving(good, round++);

    /* An oversized length after hello (over the compare-set maximum). */
    fd = raw_connect(port);
    raw_hello(fd, "tok");
    put32(f, 0xFFFFFFF0u);
    raw_send(fd, f, 4);
    expect_dropped(fd, "oversized");
    assert_still_serving(good, round++);

    /* A SET whose value is over TS_STORE_MAX_VALUE (but under the frame maximum). */
    fd = raw_connect(port);
    raw_hello(fd, "tok");
    put32(f, 17 + 1 + TS_STORE_MAX_VALUE + 1);
    f[4] = TS__STORE_OP_SET;
    put32(f + 5, 1);
    raw_send(fd, f, 9);
    expect_dropped(fd, "value over the limit");
    assert_still_serving(good, round++);

    /* A huge key length. */
    fd = raw_connect(port);
    raw_hello(fd, "tok");
    put32(f, 100);
    f[4] = TS__STORE_OP_GET;
    put32(f + 5, 0xFFFFFFFFu);
    raw_send(fd, f, 9);
    expect_dropped(fd, "huge key");
    assert_still_serving(good, round++);

    /* A key just over the limit, in a frame that would otherwise fit. */
    fd = raw_connect(port);
    raw_hello(fd, "tok");
    put32(f, 17 + TS_STORE_MAX_KEY + 1);
    f[4] = TS__STORE_OP_CHECK;
    put32(f + 5, TS_STORE_MAX_KEY + 1);
    raw_send(fd, f, 9);
    expect_dropped(fd, "key over the limit");
    assert_still_serving(good, round++);

    /* The declared value length disagrees with the body length. */
    fd = raw_connect(port);
    raw_hello(fd, "tok");
    n = raw_frame(f, TS__STORE_OP_SET, "key", 3, "value", 5, 0);
    put32(f + 12, 4);
    raw_send(fd, f, n);
    expect_dropped(fd, "value length mismatch");
    assert_still_serving(good, round++);

    /* A value on an op that takes none; an unknown op; a body too short. */
    fd = raw_connect(port);
    raw_hello(fd, "tok");
    raw_send(fd, f, raw_frame(f, TS__STORE_OP_GET, "key", 3, "v", 1, 10));
    expect_dropped(fd, "value on GET");
    fd = raw_connect(port);
    raw_hello(fd, "tok");
    raw_send(fd, f, raw_frame(f, 200, "key", 3, NULL, 0, 0));
    expect_dropped(fd, "unknown op");
    fd = raw_connect(port);
    raw_hello(fd, "tok");
    put32(f, 3);
    raw_send(fd, f, 7);
    expect_dropped(fd, "short body");
    assert_still_serving(good, round++);

    /* A compare-set whose expected length runs past its value. */
    fd = raw_connect(port);
    raw_hello(fd, "tok");
    unsigned char cas[8];
    put32(cas, 50);
    memcpy(cas + 4, "abcd", 4);
    raw_send(fd, f, raw_frame(f, TS__STORE_OP_COMPARE_SET, "key", 3, cas, 8, 0));
    expect_dropped(fd, "compare-set lengths");
    assert_still_serving(good, round++);

    /* Hello twice; a second request while a GET is pending. */
    fd = raw_connect(port);
    raw_hello(fd, "tok");
    raw_send(fd, f, raw_frame(f, TS__STORE_OP_HELLO, NULL, 0, "tok", 3, 1));
    expect_dropped(fd, "hello twice");
    fd = raw_connect(port);
    raw_hello(fd, "tok");
    n = raw_frame(f, TS__STORE_OP_GET, "pending", 7, NULL, 0, 60000);
    n += raw_frame(f + n, TS__STORE_OP_SET, "other", 5, "x", 1, 0);
    raw_send(fd, f, n);
    expect_dropped(fd, "pipelined while waiting");
    assert_still_serving(good, round++);
    cr_assert_eq(ts_store_check(good, "other"), TS_ERR_NOT_FOUND, "the dropped client's request did not run");

    /* A wrong protocol version. */
    fd = raw_connect(port);
    raw_send(fd, f, raw_frame(f, TS__STORE_OP_HELLO, NULL, 0, "tok", 3, 99));
    expect_dropped(fd, "protocol version");

    /* Well-formed requests pipelined by a raw client are all answered, in order. */
    fd = raw_connect(port);
    raw_hello(fd, "tok");
    n = raw_frame(f, TS__STORE_OP_SET, "pipe", 4, "abc", 3, 0);
    n += raw_frame(f + n, TS__STORE_OP_GET, "pipe", 4, NULL, 0, 1000);
    n += raw_frame(f + n, TS__STORE_OP_DELETE, "pipe", 4, NULL, 0, 0);
    raw_send(fd, f, n);
    unsigned char r[17 + 20 + 17];
    cr_assert_eq(raw_recv(fd, r, sizeof r, 5.0), sizeof r);
    cr_assert_eq(r[17 + 4], TS__STORE_ST_OK);
    cr_assert_eq(memcmp(r + 17 + 9, "abc", 3), 0);
    cr_assert_eq(r[17 + 20 + 9], 1, "delete says the key existed");
    close(fd);

    assert_still_serving(good, round++);
    ts_store_close(good);
    ts_store_server_stop(srv);
    th_mem_assert_back();
}

Test(comm_store, client_that_vanishes_while_waiting_is_forgotten, .timeout = 60)
{
    th_mem_mark();
    ts_store_server *srv = start_server("tok");
    int port = ts_store_server_port(srv);
    for (int i = 0; i < 5; i++) {
        int fd = raw_connect(port);
        raw_hello(fd, "tok");
        unsigned char f[64];
        raw_send(fd, f, raw_frame(f, TS__STORE_OP_GET, "never", 5, NULL, 0, 600000));
        close(fd);
    }
    ts_store *c = connect_to(srv, "tok");
    sleep_ms(100);
    TH_OK(ts_store_set(c, "never", "now", 3)); /* the waiters are gone or harmlessly answered */
    ts_store_close(c);
    ts_store_server_stop(srv);
    th_mem_assert_back();
}

/* ---- server lifetime ---- */

typedef struct {
    ts_store *c;
    ts_status st;
    double took;
    char err[1024];
} getter_arg;

static void *getter(void *p)
{
    getter_arg *a = p;
    double t0 = now_s();
    void *v = NULL;
    size_t n;
    a->st = ts_store_get(a->c, "never", &v, &n);
    a->took = now_s() - t0;
    snprintf(a->err, sizeof a->err, "%s", ts_last_error());
    ts_store_value_free(v);
    return NULL;
}

Test(comm_store, server_stop_fails_a_blocked_get_promptly, .timeout = 60)
{
    th_mem_mark();
    ts_store_server *srv = start_server("tok");
    int port = ts_store_server_port(srv);
    ts_store *c = connect_to(srv, "tok");
    ts_store_set_timeout(c, 60);
    getter_arg a = {c, TS_ERR_INTERNAL, 0, ""};
    pthread_t t;
    pthread_create(&t, NULL, getter, &a);
    sleep_ms(200);
    double t0 = now_s();
    ts_store_server_stop(srv);
    pthread_join(t, NULL);
    cr_assert_lt(now_s() - t0, 2.0, "the get took %.2f s after the stop", now_s() - t0);
    cr_assert_eq(a.st, TS_ERR_COMM, "%s: %s", ts_status_name(a.st), a.err);
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
    cr_assert(strstr(a.err, addr) && strstr(a.err, "'never'"), "%s", a.err);
    /* Later calls fail at once. */
    cr_assert_eq(ts_store_set(c, "k", "v", 1), TS_ERR_COMM);
    cr_assert(strstr(ts_last_error(), "lost"), "%s", ts_last_error());
    ts_store_close(c);
    th_mem_assert_back();
}

Test(comm_store, dead_server_yields_errors_not_hangs, .timeout = 60)
{
    th_mem_mark();
    ts_store_server *srv = start_server("tok");
    int port = ts_store_server_port(srv);
    ts_store_server_stop(srv);
    ts_store *c = NULL;
    double t0 = now_s();
    ts_status st = ts_store_connect(NULL, port, "tok", 0.3, &c);
    double dt = now_s() - t0;
    cr_assert_eq(st, TS_ERR_TIMEOUT, "%s", ts_status_name(st));
    cr_assert(dt >= 0.25 && dt < 1.5, "connect gave up after %.2f s", dt);
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
    cr_assert(strstr(ts_last_error(), addr), "%s", ts_last_error());
    cr_assert(strstr(ts_last_error(), "refused"), "%s", ts_last_error());
    th_mem_assert_back();
}

typedef struct {
    int port;
    int delay_ms;
    ts_store_server *srv;
    ts_status st;
} late_server_arg;

static void *late_server(void *p)
{
    late_server_arg *a = p;
    sleep_ms(a->delay_ms);
    a->st = ts_store_server_start("127.0.0.1", a->port, "tok", &a->srv);
    return NULL;
}

Test(comm_store, connect_retries_until_the_server_is_up, .timeout = 60)
{
    ts_store_server *srv = start_server("tok");
    int port = ts_store_server_port(srv);
    ts_store_server_stop(srv);
    late_server_arg a = {port, 300, NULL, TS_ERR_INTERNAL};
    pthread_t t;
    pthread_create(&t, NULL, late_server, &a);
    ts_store *c = NULL;
    ts_status st = ts_store_connect("localhost", port, "tok", 10.0, &c);
    pthread_join(t, NULL);
    if (a.st != TS_OK) cr_skip_test("port %d was taken meanwhile", port);
    TH_OK(st);
    TH_OK(ts_store_set(c, "k", "v", 1));
    ts_store_close(c);
    ts_store_server_stop(a.srv);
}

Test(comm_store, port_zero_picks_a_port_and_address_in_use_is_named, .timeout = 60)
{
    th_mem_mark();
    ts_store_server *a = start_server("tok");
    ts_store_server *b = start_server("tok");
    int pa = ts_store_server_port(a), pb = ts_store_server_port(b);
    cr_assert_neq(pa, pb);
    ts_store_server *c = NULL;
    ts_status st = ts_store_server_start("127.0.0.1", pa, "tok", &c);
    cr_assert_eq(st, TS_ERR_IO, "%s", ts_status_name(st));
    cr_assert_null(c);
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", pa);
    cr_assert(strstr(ts_last_error(), addr), "%s", ts_last_error());
    cr_assert(strstr(ts_last_error(), "in use"), "%s", ts_last_error());
    ts_store_server_stop(a);
    ts_store_server_stop(b);
    ts_store_server_stop(NULL);
    th_mem_assert_back();
}

Test(comm_store, invalid_arguments, .timeout = 60)
{
    th_mem_mark();
    ts_store_server *srv = start_server("tok");
    ts_store *c = connect_to(srv, "tok");
    void *v = NULL;
    size_t n;
    char *long_key = malloc(TS_STORE_MAX_KEY + 2);
    memset(long_key, 'k', TS_STORE_MAX_KEY + 1);
    long_key[TS_STORE_MAX_KEY + 1] = '\0';
    ts_store_server *s2 = NULL;
    ts_store *c2 = NULL;

    cr_assert_eq(ts_store_server_start(NULL, 0, "tok", NULL), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_store_server_start(NULL, 70000, "tok", &s2), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_store_server_start(NULL, -1, "tok", &s2), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_store_server_start(NULL, 0, long_key, &s2), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_store_connect(NULL, 0, "tok", 1, &c2), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_store_connect(NULL, 1, "tok", -1, &c2), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_store_connect(NULL, 1, "tok", 1, NULL), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_store_connect(NULL, 1, long_key, 1, &c2), TS_ERR_INVALID_ARGUMENT);

    cr_assert_eq(ts_store_set(NULL, "k", "v", 1), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_store_set(c, NULL, "v", 1), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_store_set(c, "k", NULL, 1), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_store_set(c, long_key, "v", 1), TS_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(ts_last_error(), "4096"), "%s", ts_last_error());
    cr_assert_eq(ts_store_set(c, "k", "v", (size_t)TS_STORE_MAX_VALUE + 1), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_store_get(c, "k", NULL, &n), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_store_get(c, long_key, &v, &n), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_store_check(NULL, "k"), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_store_check(c, NULL), TS_ERR_INVALID_ARGUMENT);
    const char *keys[] = {"a", NULL};
    cr_assert_eq(ts_store_wait(c, 2, keys), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_store_wait(c, -1, keys), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_store_wait(c, 1, NULL), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_store_add(c, NULL, 1, NULL), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_store_compare_set(c, "k", NULL, 3, "d", 1, NULL, NULL), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_store_compare_set(c, "k", "e", 1, NULL, 3, NULL, NULL), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_store_delete(c, long_key, NULL), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_store_barrier(c, NULL, 2), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_store_barrier(c, "b", 0), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_store_barrier(c, long_key, 2), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_store_rendezvous(c, "r", 2, 2), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_store_rendezvous(c, "r", -1, 2), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_store_rendezvous(c, NULL, 0, 2), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_store_rendezvous(NULL, "r", 0, 2), TS_ERR_INVALID_ARGUMENT);
    ts_store_set_timeout(NULL, 1);
    ts_store_set_timeout(c, -1); /* ignored */
    ts_store_close(NULL);
    cr_assert_eq(ts_store_server_port(NULL), -1);

    /* A key of exactly the limit works. */
    long_key[TS_STORE_MAX_KEY] = '\0';
    TH_OK(ts_store_set(c, long_key, "v", 1));
    TH_OK(ts_store_check(c, long_key));
    free(long_key);
    ts_store_close(c);
    ts_store_server_stop(srv);
    th_mem_assert_back();
}

Test(comm_store, many_clients_and_keys_no_leaks, .timeout = 60)
{
    th_mem_mark();
    ts_store_server *srv = start_server("tok");
    ts_store *c[16];
    for (int i = 0; i < 16; i++) c[i] = connect_to(srv, "tok");
    /* Enough keys to grow the table several times. */
    for (int i = 0; i < 2000; i++) {
        char key[32], val[32];
        snprintf(key, sizeof key, "key/%d", i);
        snprintf(val, sizeof val, "value %d", i * 3);
        TH_OK(ts_store_set(c[i % 16], key, val, strlen(val)));
    }
    for (int i = 0; i < 2000; i += 7) {
        char key[32], val[32];
        snprintf(key, sizeof key, "key/%d", i);
        snprintf(val, sizeof val, "value %d", i * 3);
        void *v;
        size_t n;
        TH_OK(ts_store_get(c[(i + 5) % 16], key, &v, &n));
        cr_assert(n == strlen(val) && memcmp(v, val, n) == 0, "key %d", i);
        ts_store_value_free(v);
        if (i % 2) TH_OK(ts_store_delete(c[0], key, NULL));
    }
    for (int i = 0; i < 16; i++) ts_store_close(c[i]);
    ts_store_server_stop(srv);
    th_mem_assert_back();
}

/* ---- the protocol core without sockets ---- */

typedef struct {
    int replies;
    uint8_t last_status;
    size_t last_len;
    int drops;
} sink_state;

static void sink(ts__store_conn *c, ts__store_reply *r, void *ctx)
{
    (void)c;
    sink_state *s = ctx;
    if (!r) {
        s->drops++;
        return;
    }
    s->replies++;
    s->last_status = r->bytes[4];
    s->last_len = r->len;
    ts__free(TS_MEM_COMM, r);
}

Test(comm_store, core_waiters_and_deadlines, .timeout = 60)
{
    th_mem_mark();
    sink_state ss = {0};
    ts__store_core *core;
    TH_OK(ts__store_core_new("tok", sink, &ss, &core));
    ts__store_conn a, b;
    ts__store_conn_init(core, &a, "a");
    ts__store_conn_init(core, &b, "b");
    unsigned char f[128];
    cr_assert(ts__store_conn_feed(core, &a, f, raw_frame(f, TS__STORE_OP_HELLO, NULL, 0, "tok", 3, 1), 0));
    cr_assert(ts__store_conn_feed(core, &b, f, raw_frame(f, TS__STORE_OP_HELLO, NULL, 0, "tok", 3, 1), 0));
    cr_assert_eq(ss.replies, 2);
    /* a waits 100 ms for "x" and b waits 50 ms for "y"; a frame fed a byte at a time. */
    size_t n = raw_frame(f, TS__STORE_OP_GET, "x", 1, NULL, 0, 100);
    for (size_t i = 0; i < n; i++) cr_assert(ts__store_conn_feed(core, &a, f + i, 1, 1000));
    cr_assert(ts__store_conn_feed(core, &b, f, raw_frame(f, TS__STORE_OP_WAIT, "y", 1, NULL, 0, 50), 1000));
    cr_assert_eq(ss.replies, 2);
    cr_assert_eq(ts__store_core_next_deadline(core), 1050);
    ts__store_core_expire(core, 1049);
    cr_assert_eq(ss.replies, 2);
    ts__store_core_expire(core, 1050);
    cr_assert_eq(ss.replies, 3);
    cr_assert_eq(ss.last_status, TS__STORE_ST_TIMEOUT);
    cr_assert_eq(ts__store_core_next_deadline(core), 1100);
    /* b sets "x": a gets the value; b gets its OK. */
    cr_assert(ts__store_conn_feed(core, &b, f, raw_frame(f, TS__STORE_OP_SET, "x", 1, "val", 3, 0), 1060));
    cr_assert_eq(ss.replies, 5);
    cr_assert_eq(ts__store_core_next_deadline(core), UINT64_MAX);
    cr_assert_eq(ts__store_core_count(core), 1);
    /* A waiter that is finished (its client went away) is forgotten. */
    cr_assert(ts__store_conn_feed(core, &a, f, raw_frame(f, TS__STORE_OP_GET, "z", 1, NULL, 0, 10), 2000));
    ts__store_conn_fini(core, &a);
    cr_assert_eq(ts__store_core_next_deadline(core), UINT64_MAX);
    ts__store_conn_fini(core, &b);
    ts__store_core_free(core);
    cr_assert_eq(ss.drops, 0);
    th_mem_assert_back();
}

/* ---- idle and flooding clients (issue 9 §9) ---- */

#include <sys/resource.h>

Test(comm_store, idle_connection_is_dropped_after_the_hello_timeout, .timeout = 60)
{
    th_mem_mark();
    ts__store_server_set_limits(200, 0);
    ts_store_server *srv = start_server("tok");
    int port = ts_store_server_port(srv);
    double t0 = now_s();
    int idle = raw_connect(port);
    int half = raw_connect(port); /* half a hello, then silence */
    unsigned char f[64];
    size_t n = raw_frame(f, TS__STORE_OP_HELLO, NULL, 0, "tok", 3, 1);
    raw_send(half, f, n / 2);
    expect_dropped(idle, "idle connection");
    expect_dropped(half, "half a hello");
    cr_assert_lt(now_s() - t0, 3.0, "dropped after %.2f s, the timeout is 0.2 s", now_s() - t0);
    /* A client that says hello in time stays, past the timeout. */
    ts_store *c = connect_to(srv, "tok");
    sleep_ms(400);
    TH_OK(ts_store_set(c, "k", "v", 1));
    TH_OK(ts_store_check(c, "k"));
    ts__store_server_stats st;
    ts__store_server_get_stats(srv, &st);
    cr_assert_eq(st.hello_expired, 2);
    cr_assert_eq(st.pending, 0);
    ts_store_close(c);
    ts_store_server_stop(srv);
    ts__store_server_set_limits(0, 0);
    th_mem_assert_back();
}

Test(comm_store, flood_of_idle_connections_does_not_lock_out_a_real_client, .timeout = 60)
{
    enum { WANT = 1100 };
    struct rlimit rl;
    cr_assert_eq(getrlimit(RLIMIT_NOFILE, &rl), 0);
    rlim_t need = 2 * WANT + 64; /* both ends live in this process */
    if (rl.rlim_cur < need) {
        rl.rlim_cur = rl.rlim_max < need ? rl.rlim_max : need;
        setrlimit(RLIMIT_NOFILE, &rl);
        getrlimit(RLIMIT_NOFILE, &rl);
    }
    int nidle = WANT;
    if (rl.rlim_cur < need) nidle = (int)((rl.rlim_cur - 64) / 2);
    cr_assert_gt(nidle, 100, "fd limit %llu", (unsigned long long)rl.rlim_cur);
    const unsigned timeout_ms = 1500, cap = 1024;
    ts__store_server_set_limits(timeout_ms, 0); /* the default cap */
    ts_store_server *srv = start_server("tok");
    int port = ts_store_server_port(srv);

    int *fds = calloc((size_t)nidle, sizeof *fds);
    cr_assert_not_null(fds);
    double t0 = now_s();
    for (int i = 0; i < nidle; i++) fds[i] = raw_connect(port);
    double opened = now_s() - t0;

    /* A real client gets in (at the latest once the idle ones expire)
     * and works. */
    ts_store *c = NULL;
    TH_OK(ts_store_connect("127.0.0.1", port, "tok", 20.0, &c));
    double joined = now_s() - t0;
    assert_still_serving(c, 1);

    /* Every idle connection is closed, well before any 300 s deadline. */
    int open_left = nidle;
    double end = now_s() + 20.0;
    while (open_left > 0 && now_s() < end) {
        for (int i = 0; i < nidle; i++) {
            if (fds[i] < 0) continue;
            struct pollfd pfd = {.fd = fds[i], .events = POLLIN};
            if (poll(&pfd, 1, 0) == 1) {
                char b[64];
                ssize_t r = recv(fds[i], b, sizeof b, MSG_DONTWAIT);
                if (r == 0 || (r < 0 && errno == ECONNRESET)) {
                    close(fds[i]);
                    fds[i] = -1;
                    open_left--;
                }
            }
        }
        if (open_left > 0) sleep_ms(20); /* polling many fds; bounded by `end` */
    }
    double all_closed = now_s() - t0;
    cr_assert_eq(open_left, 0, "%d of %d idle connections still open after %.1f s", open_left, nidle, all_closed);
    cr_assert_lt(all_closed, timeout_ms / 1000.0 + 10.0, "closed after %.1f s", all_closed);
    assert_still_serving(c, 2);

    ts__store_server_stats st;
    ts__store_server_get_stats(srv, &st);
    cr_assert_geq(st.over_cap + st.hello_expired, (uint64_t)nidle, "over cap %llu, expired %llu",
                  (unsigned long long)st.over_cap, (unsigned long long)st.hello_expired);
    if (nidle > (int)cap && opened < timeout_ms / 1000.0)
        cr_assert_geq(st.over_cap, (uint64_t)(nidle - (int)cap), "opened in %.2f s, over cap %llu", opened,
                      (unsigned long long)st.over_cap);
    cr_assert_eq(st.pending, 0);
    /* Rate-limited: about one line per second, the rest counted. */
    cr_assert_leq(st.warn_lines, (uint64_t)all_closed + 3, "%llu warning lines in %.1f s",
                  (unsigned long long)st.warn_lines, all_closed);
    cr_assert_geq(st.warn_suppressed, (uint64_t)nidle - st.warn_lines);
    cr_log_info("%d idle connections: opened in %.2f s, real client in after %.2f s, all closed after %.2f s; "
                "%llu over the cap, %llu expired, %llu warning lines, %llu suppressed",
                nidle, opened, joined, all_closed, (unsigned long long)st.over_cap,
                (unsigned long long)st.hello_expired, (unsigned long long)st.warn_lines,
                (unsigned long long)st.warn_suppressed);
    free(fds);
    ts_store_close(c);
    ts_store_server_stop(srv);
    ts__store_server_set_limits(0, 0);
}

Test(comm_store, only_a_rejected_token_is_called_wrong, .timeout = 60)
{
    ts__store_server_set_limits(0, 1); /* a cap of one pending connection */
    ts_store_server *srv = start_server("tok");
    int port = ts_store_server_port(srv);
    int idle = raw_connect(port); /* holds the one pending slot */
    sleep_ms(50);
    ts_store *c = NULL;
    ts_status s = ts_store_connect(NULL, port, "tok", 0.5, &c);
    cr_assert_eq(s, TS_ERR_TIMEOUT, "%s: %s", ts_status_name(s), ts_last_error());
    cr_assert(strstr(ts_last_error(), "before answering") && !strstr(ts_last_error(), "token"), "%s", ts_last_error());
    close(idle);
    s = ts_store_connect(NULL, port, "bad", 5.0, &c);
    cr_assert_eq(s, TS_ERR_COMM, "%s: %s", ts_status_name(s), ts_last_error());
    cr_assert(strstr(ts_last_error(), "rejected the token"), "%s", ts_last_error());
    ts_store_server_stop(srv);
    ts__store_server_set_limits(0, 0);
}

/* ---- a store without a token serves only its own user (issue 9 §9) ---- */

#include <sys/wait.h>

/* In a child running as `nobody`: the outsider. Exit code 0 when every
 * attempt was refused as it should be. */
static int outsider(int port)
{
    if (setgid(65534) != 0 || setuid(65534) != 0) return 10;
    ts_store *c = NULL;
    ts_status s = ts_store_connect(NULL, port, NULL, 3.0, &c);
    if (s != TS_ERR_COMM || !strstr(ts_last_error(), TS_STORE_TOKEN_ENV) || !strstr(ts_last_error(), "own user")) {
        fprintf(stderr, "outsider connect: %s: %s\n", ts_status_name(s), ts_last_error());
        return 11;
    }
    /* Raw: hello and an ADD to the rendezvous counter in one write. */
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a) != 0) return 12;
    unsigned char f[256];
    size_t n = raw_frame(f, TS__STORE_OP_HELLO, NULL, 0, "", 0, 1);
    n += raw_frame(f + n, TS__STORE_OP_ADD, "rdv/count", 9, NULL, 0, 1);
    raw_send(fd, f, n);
    unsigned char r[64];
    size_t got = raw_recv(fd, r, sizeof r, 5.0);
    if (got != 17 || r[4] != TS__STORE_ST_REFUSED) {
        fprintf(stderr, "outsider raw: %zu bytes, status %u\n", got, got > 4 ? r[4] : 255);
        return 13;
    }
    close(fd);
    return 0;
}

Test(comm_store, tokenless_store_refuses_other_users, .timeout = 60)
{
    if (geteuid() != 0) cr_skip_test("needs root to run a client as another user");
    ts_store_server *srv = start_server(NULL);
    int port = ts_store_server_port(srv);
    ts_store *own = connect_to(srv, NULL); /* this user: served */
    TH_OK(ts_store_set(own, "ucx/addr/0", "secret-address", 14));
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) _exit(outsider(port));
    int st = 0;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "outsider status 0x%x", st);
    /* The outsider's ADD never ran. */
    cr_assert_eq(ts_store_check(own, "rdv/count"), TS_ERR_NOT_FOUND);
    ts__store_server_stats ss;
    ts__store_server_get_stats(srv, &ss);
    cr_assert_geq(ss.refused, 2);
    ts_store_close(own);
    ts_store_server_stop(srv);
}
