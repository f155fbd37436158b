#define _GNU_SOURCE
/*
 * Deadlines: the message of a collective whose deadline passed (the
 * peers it waits for), and the store's record of who entered which
 * collective, which names the ranks that never entered it. Under the
 * world's progress lock. Calls ops.c (ts__comm_fail_world), debug.c and
 * the store client.
 */
#include "comm/store.h"
#include "comm/world_internal.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ */
/* Deadline messages                                                   */
/* ------------------------------------------------------------------ */

/* Group rank g of `o` as the user knows it: "rank 2", or "rank 1 (world
 * rank 2)" in a group. */
static int peer_str(const op *o, int g, char *buf, size_t n)
{
    if (o->gid) return snprintf(buf, n, "rank %d (world rank %d)", g, o->map[g]);
    return snprintf(buf, n, "rank %d", g);
}

/* The deadline message: the op and the peers it still waits to receive
 * from; for an all-gather phase, broadcast or all-to-all also whose data
 * it still lacks (the ranks that have not completed their part, as far as
 * this rank can know); then the ranks its unfinished sends go to (with no
 * receive pending, those are the ones it waits for), so that every
 * deadline names a rank. */
static void deadline_msg(const op *o, double timeout_s, char *msg, size_t n)
{
    char name[64];
    ts__comm_op_name(o, name, sizeof name);
    int k = snprintf(msg, n, "%s on rank %d of %d passed its deadline of %.3g s", name, o->rank, o->W, timeout_s);
    bool any = false;
    for (int pass = 0; pass < 2; pass++) { /* fingerprints first: those peers have not entered it */
        for (int i = 0; i < 6 * o->W && k > 0 && (size_t)k < n; i++) {
            const xfer *x = &o->x[i];
            if (!x->live || x->kind != K_RECV || (pass == 0) != (x->phase == PH_FP)) continue;
            if (pass == 1) { /* a peer already named as not entered */
                bool named = false;
                for (int j = 0; j < 2 * o->W; j++) {
                    const xfer *y = &o->x[4 * o->W + j];
                    if (y->live && y->kind == K_RECV && y->peer == x->peer) named = true;
                }
                if (named) continue;
            }
            k += snprintf(msg + k, n - (size_t)k, "%s", any ? "; " : ": waiting for ");
            any = true;
            if ((size_t)k >= n) break;
            k += peer_str(o, x->peer, msg + k, n - (size_t)k);
            if ((size_t)k >= n) break;
            int origin = -1;
            if (x->phase == PH_AG) origin = ((o->rank - x->step - 1) % o->W + o->W) % o->W;
            else if (x->phase == PH_BC) origin = o->root;
            if (x->phase == PH_FP) k += snprintf(msg + k, n - (size_t)k, ", which has not entered it");
            else if (origin >= 0 && origin != x->peer) {
                k += snprintf(msg + k, n - (size_t)k, " to forward the data of ");
                if ((size_t)k < n) k += peer_str(o, origin, msg + k, n - (size_t)k);
            } else if (x->phase == PH_RS)
                k += snprintf(msg + k, n - (size_t)k, " (reduce-scatter step %d of %d)", x->step + 1, o->W - 1);
            /* a ring waits on one peer: its first missing step says it */
            if (x->phase != PH_FP && x->phase != PH_A2A) break;
        }
    }
    if (k <= 0 || (size_t)k >= n) return;
    /* the ranks its unfinished sends go to (a stopped rank does not take a
     * rendezvous send), each once and not one named for a receive: a rank
     * that waits for its upstream neighbour, itself stuck, still names the
     * stopped rank downstream */
    int named = 0, first = -1;
    for (int i = 0; i < 6 * o->W && (size_t)k < n; i++) {
        const xfer *x = &o->x[i];
        if (!x->live || x->kind != K_SEND) continue;
        bool seen = false;
        for (int j = 0; j < 6 * o->W; j++) {
            const xfer *y = &o->x[j];
            if (y->live && y->peer == x->peer && ((y->kind == K_SEND && j < i) || (y->kind == K_RECV && any)))
                seen = true;
        }
        if (seen) continue;
        k += snprintf(msg + k, n - (size_t)k, "%s", named ? ", " : any ? "; its sends to " : ": waiting for ");
        if ((size_t)k < n) k += peer_str(o, x->peer, msg + k, n - (size_t)k);
        if (!named++) first = x->peer;
    }
    if ((size_t)k >= n) return;
    if (any) {
        if (named) snprintf(msg + k, n - (size_t)k, " did not complete");
    } else if (named == 1) {
        k += snprintf(msg + k, n - (size_t)k, " (its sends to ");
        if ((size_t)k < n) k += peer_str(o, first, msg + k, n - (size_t)k);
        if ((size_t)k < n) snprintf(msg + k, n - (size_t)k, " did not complete)");
    } else if (named > 1) {
        snprintf(msg + k, n - (size_t)k, " (its sends to them did not complete)");
    } else {
        /* nothing in flight: the ring's upstream rank (a point-to-point
         * op's peer) is the one whose data or completion it lacks */
        int up = o->kind == TS_COLL_SEND || o->kind == TS_COLL_RECV ? o->peer : o->left;
        k += snprintf(msg + k, n - (size_t)k, ": waiting for ");
        if ((size_t)k < n) k += peer_str(o, up, msg + k, n - (size_t)k);
        if ((size_t)k < n) snprintf(msg + k, n - (size_t)k, " (no transfer pending on this rank)");
    }
}
/* ------------------------------------------------------------------ */
/* Who never entered                                                   */
/* ------------------------------------------------------------------ */

/* A rank that never enters a collective (stopped, sleeping, stuck in its
 * own code) shows in the deadline messages of its ring neighbours only:
 * the others wait on a survivor that itself waits, and each would name
 * the rank it waits on. With a store (ts__world_attach_store), a rank
 * whose collective is still pending half way to its deadline records
 * that it entered it ("<prefix>/entered/<gid>/<world rank>" = its
 * sequence number: one store call per collective that lasts that long,
 * none for the others). At the deadline the rank reads the group's
 * records: the ranks that have not recorded this collective (or a later
 * one) are the ones that never entered it. It names them, sends the
 * message to every other rank as a failure notice (so all survivors
 * report the same ranks, even those whose deadline comes later or who
 * would first see the reporter exit), and records the first of them for
 * the launcher (TS_LAUNCH_HUNG_KEY), whose last line names it. Store
 * calls are bounded by STORE_CALL_S (a fraction of the deadline); a
 * store that does not answer (its host is the hung rank) or fails is
 * dropped and the deadline message says what this rank alone sees.
 * Known limit: a rank that entered more than half the deadline after the
 * one whose deadline passes has not recorded its entry yet, and is named
 * with the rank that never entered. */
#define STORE_CALL_S 2.0

static void store_drop(world *w)
{
    ts_logf(TS_LOG_WARN,
            "comm: rank %d: no hung-peer records in the store from now on (deadline messages will not name the "
            "ranks that never entered): %s",
            w->comm->rank, ts_last_error());
    ts_store_close(w->store);
    w->store = NULL;
}

static void store_bound(world *w)
{
    double d = atomic_load(&w->deadline_s) / 4;
    ts_store_set_timeout(w->store, d < STORE_CALL_S ? d : STORE_CALL_S);
}

static bool collective(const op *o) { return o->kind != TS_COLL_SEND && o->kind != TS_COLL_RECV; }

static void note_entry(world *w, op *o)
{
    o->noted = true;
    if (!w->store || !collective(o)) return;
    char key[sizeof w->store_prefix + 64], val[16];
    snprintf(key, sizeof key, "%s/entered/%llu/%d", w->store_prefix, (unsigned long long)o->gid, o->map[o->rank]);
    snprintf(val, sizeof val, "%u", o->seq);
    store_bound(w);
    if (ts_store_set(w->store, key, val, strlen(val)) != TS_OK) store_drop(w);
}

/* The group ranks of o that have not recorded o (or a later collective
 * of its group) in the store, into `out` (at most o->W); -1 when the
 * store cannot tell. */
static int not_entered(world *w, const op *o, int *out)
{
    if (!w->store || !collective(o)) return -1;
    store_bound(w);
    int n = 0;
    for (int g = 0; g < o->W; g++) {
        if (g == o->rank) continue;
        char key[sizeof w->store_prefix + 64];
        snprintf(key, sizeof key, "%s/entered/%llu/%d", w->store_prefix, (unsigned long long)o->gid, o->map[g]);
        ts_status st = ts_store_check(w->store, key);
        if (st == TS_ERR_NOT_FOUND) {
            out[n++] = g;
            continue;
        }
        void *v = NULL;
        size_t len = 0;
        if (st == TS_OK) st = ts_store_get(w->store, key, &v, &len);
        if (st != TS_OK) {
            store_drop(w);
            return -1;
        }
        char txt[16];
        snprintf(txt, sizeof txt, "%.*s", (int)(len < sizeof txt - 1 ? len : sizeof txt - 1), (const char *)v);
        ts_store_value_free(v);
        unsigned seq = (unsigned)strtoul(txt, NULL, 10);
        if ((int32_t)(seq - o->seq) < 0) out[n++] = g; /* an earlier one: not this one */
    }
    return n;
}

/* The deadline message when the store names the ranks that never
 * entered; false (msg untouched) when it cannot. *culprit_out: the first
 * one's world rank. */
static bool hung_msg(world *w, const op *o, double timeout_s, char *msg, size_t n, int *culprit_out)
{
    int *missing = ts__malloc(TS_MEM_COMM, (size_t)o->W * sizeof *missing);
    if (!missing) return false;
    int k = not_entered(w, o, missing);
    if (k <= 0) {
        ts__free(TS_MEM_COMM, missing);
        return false;
    }
    char name[64];
    ts__comm_op_name(o, name, sizeof name);
    int m = snprintf(msg, n, "%s on rank %d of %d passed its deadline of %.3g s: waiting for ", name, o->rank, o->W,
                     timeout_s);
    for (int i = 0; i < k && m > 0 && (size_t)m < n; i++) {
        if (i) m += snprintf(msg + m, n - (size_t)m, i + 1 == k ? " and " : ", ");
        if ((size_t)m < n) m += peer_str(o, missing[i], msg + m, n - (size_t)m);
    }
    if (m > 0 && (size_t)m < n)
        snprintf(msg + m, n - (size_t)m, ", which %s not entered it (%s)", k == 1 ? "has" : "have",
                 k + 1 < o->W ? "the store shows the other ranks in it" : "as the store shows");
    *culprit_out = o->map[missing[0]];
    ts__free(TS_MEM_COMM, missing);
    return true;
}

/* Records the hung rank for the launcher: the first rank to find one
 * wins (compare-and-set from empty). */
static void note_hung(world *w, const op *o, int culprit)
{
    if (!w->store || !w->hung_key[0]) return;
    char val[96], name[64];
    ts__comm_op_name(o, name, sizeof name);
    snprintf(val, sizeof val, "%d %s", culprit, name);
    if (ts_store_compare_set(w->store, w->hung_key, "", 0, val, strlen(val), NULL, NULL) != TS_OK) store_drop(w);
}

void ts__comm_check_deadlines(world *w)
{
    if (w->failed || !w->active) return;
    uint64_t now = ts_now_ns();
    double dl = atomic_load(&w->deadline_s);
    uint64_t half = (uint64_t)(dl * 0.5e9);
    for (op *o = w->active; o; o = o->next) {
        if (!o->finished && !o->noted && w->store && now + half > o->deadline_ns) note_entry(w, o);
        if (!o->finished && now > o->deadline_ns) {
            char msg[ERR_LEN];
            int culprit = -1;
            bool named = hung_msg(w, o, dl, msg, sizeof msg, &culprit);
            if (!named) deadline_msg(o, dl, msg, sizeof msg);
            if (!o->err || o->err == TS_ERR_PEER_FAILED) {
                o->err = TS_ERR_TIMEOUT;
                ts__comm_copy_str(o->req->err, sizeof o->req->err, msg);
            }
            if (named) note_hung(w, o, culprit);
            ts__comm_fail_world(w, TS_ERR_TIMEOUT, msg, o, named, culprit);
            break;
        }
    }
}
