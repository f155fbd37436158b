#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <poll.h>
#include <string.h>

#include "comm/transport.h"
#include "tests/helpers.h"

/* Loopback transport: one thread drives every rank's transport in turn,
 * which the interface allows since each transport is used by one thread
 * at a time. */

typedef struct done_rec {
    int count;
    ts_status last;
    int order[16];
} done_rec;

typedef struct cb_slot {
    done_rec *rec;
    int id;
} cb_slot;

static void on_done(void *arg, ts_status st)
{
    cb_slot *s = arg;
    s->rec->last = st;
    if (s->rec->count < 16) s->rec->order[s->rec->count] = s->id;
    s->rec->count++;
}

typedef struct lb_world {
    ts_loopback_fabric *f;
    ts_transport *t[4];
    int n;
} lb_world;

static void world_open(lb_world *w, int n)
{
    w->n = n;
    TH_OK(ts__loopback_fabric_new(n, &w->f));
    for (int i = 0; i < n; i++) TH_OK(ts__loopback_transport_new(w->f, i, &w->t[i]));
}

static void world_close(lb_world *w)
{
    for (int i = 0; i < w->n; i++) w->t[i]->vt->destroy(w->t[i]);
    ts__loopback_fabric_free(w->f);
}

static void progress_all(lb_world *w)
{
    for (int i = 0; i < w->n; i++)
        while (w->t[i]->vt->progress(w->t[i]) > 0) {}
}

Test(comm_loopback, matching_in_posting_order, .timeout = 30)
{
    th_mem_mark();
    lb_world w;
    world_open(&w, 2);
    ts_transport *a = w.t[0], *b = w.t[1];
    int in[3] = {10, 20, 30}, out[3] = {0, 0, 0}, other = 0, oin = 99;
    done_rec sr = {0}, rr = {0};
    cb_slot ss[4], rs[4];
    for (int i = 0; i < 4; i++) {
        ss[i] = (cb_slot){&sr, i};
        rs[i] = (cb_slot){&rr, i};
    }
    /* two receives for tag 5 posted before the sends, one for tag 6 */
    TH_OK(b->vt->recv(b, 0, &out[0], sizeof(int), 5, on_done, &rs[0]));
    TH_OK(b->vt->recv(b, 0, &other, sizeof(int), 6, on_done, &rs[1]));
    TH_OK(b->vt->recv(b, 0, &out[1], sizeof(int), 5, on_done, &rs[2]));
    TH_OK(a->vt->send(a, 1, &oin, sizeof(int), 6, on_done, &ss[0]));
    TH_OK(a->vt->send(a, 1, &in[0], sizeof(int), 5, on_done, &ss[1]));
    TH_OK(a->vt->send(a, 1, &in[1], sizeof(int), 5, on_done, &ss[2]));
    progress_all(&w);
    cr_assert_eq(sr.count, 3);
    cr_assert_eq(rr.count, 3);
    cr_assert_eq(rr.last, TS_OK);
    cr_assert_eq(out[0], 10);
    cr_assert_eq(out[1], 20);
    cr_assert_eq(other, 99);
    cr_assert_eq(rr.order[0], 1); /* tag 6 first: its send came first */
    world_close(&w);
    th_mem_assert_back();
}

Test(comm_loopback, early_arrival_is_buffered, .timeout = 30)
{
    th_mem_mark();
    lb_world w;
    world_open(&w, 3);
    ts_transport *a = w.t[2], *b = w.t[0];
    double in[4] = {1, 2, 3, 4}, out[4] = {0};
    done_rec sr = {0}, rr = {0};
    cb_slot s = {&sr, 0}, r = {&rr, 0};
    TH_OK(a->vt->send(a, 0, in, sizeof in, 77, on_done, &s));
    in[0] = -1; /* the send copied the bytes */
    /* the receiver's fd is readable: something arrived */
    struct pollfd pfd = {.fd = b->vt->wait_fd(b), .events = POLLIN};
    cr_assert_eq(poll(&pfd, 1, 0), 1);
    progress_all(&w);
    cr_assert_eq(sr.count, 1);
    cr_assert_eq(b->vt->arm(b), TS_OK); /* nothing to match yet */
    TH_OK(b->vt->recv(b, 2, out, sizeof out, 77, on_done, &r));
    cr_assert_eq(b->vt->arm(b), TS_ERR_ALREADY);
    progress_all(&w);
    cr_assert_eq(rr.count, 1);
    cr_assert_eq(rr.last, TS_OK);
    cr_assert_eq(out[0], 1.0);
    cr_assert_eq(out[3], 4.0);
    world_close(&w);
    th_mem_assert_back();
}

Test(comm_loopback, length_mismatch_fails_the_receive, .timeout = 30)
{
    th_mem_mark();
    lb_world w;
    world_open(&w, 2);
    ts_transport *a = w.t[0], *b = w.t[1];
    char in[8] = "abcdefg", out[4] = {0};
    done_rec sr = {0}, rr = {0};
    cb_slot s = {&sr, 0}, r = {&rr, 0};
    TH_OK(b->vt->recv(b, 0, out, sizeof out, 1, on_done, &r));
    TH_OK(a->vt->send(a, 1, in, sizeof in, 1, on_done, &s));
    progress_all(&w);
    cr_assert_eq(rr.count, 1);
    cr_assert_eq(rr.last, TS_ERR_COMM);
    cr_assert_eq(ts_last_status(), TS_ERR_COMM);
    /* bad peer: immediate error */
    cr_assert_eq(a->vt->send(a, 5, in, 1, 1, on_done, &s), TS_ERR_INVALID_ARGUMENT);
    world_close(&w);
    th_mem_assert_back();
}

Test(comm_loopback, delay_holds_messages_back, .timeout = 30)
{
    lb_world w;
    world_open(&w, 2);
    ts_transport *a = w.t[0], *b = w.t[1];
    int in = 3, out = 0;
    done_rec sr = {0}, rr = {0};
    cb_slot s = {&sr, 0}, r = {&rr, 0};
    ts__loopback_set_delay(w.f, 0, 0.2);
    uint64_t t0 = ts_now_ns();
    TH_OK(b->vt->recv(b, 0, &out, sizeof out, 1, on_done, &r));
    TH_OK(a->vt->send(a, 1, &in, sizeof in, 1, on_done, &s));
    while (rr.count == 0 && ts_now_ns() - t0 < 5000000000ull) {
        progress_all(&w);
        poll(NULL, 0, 5);
    }
    double dt = (double)(ts_now_ns() - t0) / 1e9;
    cr_assert_eq(rr.count, 1);
    cr_assert_eq(out, 3);
    cr_assert_geq(dt, 0.19);
    world_close(&w);
}

Test(comm_loopback, kill_is_detected_after_detect_time, .timeout = 30)
{
    th_mem_mark();
    lb_world w;
    world_open(&w, 3);
    ts_transport *b = w.t[0];
    int out = 0, out2 = 0, in = 1;
    done_rec rr = {0}, sr = {0}, lr = {0};
    cb_slot r = {&rr, 0}, s = {&sr, 0}, l = {&lr, 0};
    TH_OK(b->vt->recv(b, 1, &out, sizeof out, 9, on_done, &r));
    uint64_t t0 = ts_now_ns();
    ts__loopback_kill(w.f, 1, 0.3);
    TH_OK(b->vt->send(b, 1, &in, sizeof in, 9, on_done, &s)); /* to the dead rank: held */
    cr_assert_eq(b->vt->failed_peer(b, NULL), -1);
    while (rr.count == 0 && ts_now_ns() - t0 < 5000000000ull) {
        progress_all(&w);
        poll(NULL, 0, 5);
    }
    double dt = (double)(ts_now_ns() - t0) / 1e9;
    cr_assert_eq(rr.count, 1);
    cr_assert_eq(rr.last, TS_ERR_PEER_FAILED);
    cr_assert_eq(sr.count, 1);
    cr_assert_eq(sr.last, TS_ERR_PEER_FAILED);
    cr_assert_geq(dt, 0.29, "detected after %.3f s", dt);
    cr_assert_lt(dt, 1.5, "detected after %.3f s", dt);
    ts_status st = TS_OK;
    cr_assert_eq(b->vt->failed_peer(b, &st), 1);
    cr_assert_eq(st, TS_ERR_PEER_FAILED);
    cr_assert(strstr(ts_last_error(), "rank 1") != NULL, "%s", ts_last_error());
    /* a later transfer fails too; the live link 0 <-> 2 still works */
    TH_OK(b->vt->recv(b, 1, &out2, sizeof out2, 10, on_done, &l));
    progress_all(&w);
    cr_assert_eq(lr.count, 1);
    cr_assert_eq(lr.last, TS_ERR_PEER_FAILED);
    done_rec r2 = {0}, s2 = {0};
    cb_slot rs2 = {&r2, 0}, ss2 = {&s2, 0};
    TH_OK(w.t[2]->vt->recv(w.t[2], 0, &out2, sizeof out2, 11, on_done, &rs2));
    TH_OK(b->vt->send(b, 2, &in, sizeof in, 11, on_done, &ss2));
    progress_all(&w);
    cr_assert_eq(r2.last, TS_OK);
    cr_assert_eq(out2, 1);
    world_close(&w);
    th_mem_assert_back();
}

Test(comm_loopback, cancel_all_completes_pending, .timeout = 30)
{
    th_mem_mark();
    lb_world w;
    world_open(&w, 2);
    ts_transport *b = w.t[1];
    int out = 0;
    done_rec rr = {0};
    cb_slot r = {&rr, 0};
    TH_OK(b->vt->recv(b, 0, &out, sizeof out, 3, on_done, &r));
    b->vt->cancel_all(b, TS_ERR_COMM);
    cr_assert_eq(rr.count, 1);
    cr_assert_eq(rr.last, TS_ERR_COMM);
    world_close(&w);
    th_mem_assert_back();
}

/* recv_upto: a shorter message completes it with its length, a longer
 * one fails it; both whether the message or the receive came first. */
Test(comm_loopback, recv_upto_takes_any_length_up_to_its_buffer, .timeout = 30)
{
    th_mem_mark();
    lb_world w;
    world_open(&w, 2);
    ts_transport *a = w.t[0], *b = w.t[1];
    char in[8] = "abcdefg";
    for (int early = 0; early < 2; early++) {
        char out[6] = {0};
        size_t got = 99;
        done_rec sr = {0}, rr = {0};
        cb_slot s = {&sr, 0}, r = {&rr, 0};
        if (early) TH_OK(a->vt->send(a, 1, in, 3, 7, on_done, &s));
        TH_OK(b->vt->recv_upto(b, 0, out, sizeof out, 7, on_done, &r, &got));
        if (!early) TH_OK(a->vt->send(a, 1, in, 3, 7, on_done, &s));
        progress_all(&w);
        cr_assert_eq(rr.count, 1);
        cr_assert_eq(rr.last, TS_OK);
        cr_assert_eq(got, 3);
        cr_assert_str_eq(out, "abc");
        /* longer than the buffer */
        rr = (done_rec){0};
        if (early) TH_OK(a->vt->send(a, 1, in, sizeof in, 8, on_done, &s));
        TH_OK(b->vt->recv_upto(b, 0, out, sizeof out, 8, on_done, &r, &got));
        if (!early) TH_OK(a->vt->send(a, 1, in, sizeof in, 8, on_done, &s));
        progress_all(&w);
        cr_assert_eq(rr.count, 1);
        cr_assert_eq(rr.last, TS_ERR_COMM);
        cr_assert(strstr(ts_last_error(), "up to 6 bytes"), "%s", ts_last_error());
    }
    world_close(&w);
    th_mem_assert_back();
}

/* sendv gathers its pieces into one message; recvv_upto scatters one
 * over its pieces in order, as far as the message goes. */
Test(comm_loopback, pieces_gather_and_scatter, .timeout = 30)
{
    th_mem_mark();
    lb_world w;
    world_open(&w, 2);
    ts_transport *a = w.t[0], *b = w.t[1];
    char p0[3] = "ab", p1[5] = "cdef";
    char q0[2] = {0}, q1[3] = {0}, q2[8] = {0};
    size_t got = 0;
    done_rec sr = {0}, rr = {0};
    cb_slot s = {&sr, 0}, r = {&rr, 0};
    ts_iov out[2] = {{p0, 2}, {p1, 4}};
    ts_iov in[3] = {{q0, 2}, {q1, 3}, {q2, 8}};
    TH_OK(b->vt->recvv_upto(b, 0, in, 3, 9, on_done, &r, &got));
    TH_OK(a->vt->sendv(a, 1, out, 2, 9, on_done, &s));
    progress_all(&w);
    cr_assert_eq(rr.count, 1);
    cr_assert_eq(rr.last, TS_OK);
    cr_assert_eq(sr.last, TS_OK);
    cr_assert_eq(got, 6);
    cr_assert(!memcmp(q0, "ab", 2) && !memcmp(q1, "cde", 3) && q2[0] == 'f' && q2[1] == 0);
    /* a plain receive of the gathered length takes a sendv's message */
    char whole[6] = {0};
    rr = (done_rec){0};
    TH_OK(b->vt->recv(b, 0, whole, sizeof whole, 10, on_done, &r));
    TH_OK(a->vt->sendv(a, 1, out, 2, 10, on_done, &s));
    progress_all(&w);
    cr_assert_eq(rr.last, TS_OK);
    cr_assert(!memcmp(whole, "abcdef", 6));
    /* more pieces than TS_IOV_MAX: refused at once */
    ts_iov many[TS_IOV_MAX + 1] = {{p0, 1}, {p0, 1}, {p0, 1}, {p0, 1}};
    cr_assert_eq(a->vt->sendv(a, 1, many, TS_IOV_MAX + 1, 11, on_done, &s), TS_ERR_INVALID_ARGUMENT);
    world_close(&w);
    th_mem_assert_back();
}
