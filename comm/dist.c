/*
 * The world from the launcher's environment (comm/comm.h: ts_dist_init).
 *
 * Threads and the UCX worker: the transport's worker is created in SINGLE
 * thread mode here, on the caller's thread (ts__ucx_transport_new needs the
 * store client, which the caller owns), and ts__world_new then hands it
 * over to the world's communication thread, which alone drives it until
 * ts__world_free has joined that thread (destroy then runs on the caller's
 * thread again). The hand-overs are ordered by pthread_create and
 * pthread_join (full memory barriers) and the worker is never touched by
 * two threads at a time: that is the serialized use UCX's SINGLE mode
 * allows in practice (SINGLE only removes the worker's locks; no thread-id
 * check exists outside UCX debug builds). Creating the transport on the
 * communication thread itself would need a hook in comm.c's thread start.
 *
 * The world accessor is comm.c's (comm_internal.h): this file publishes the
 * world it made with ts__world_publish and only reads it back; comm.c never
 * calls into this file.
 *
 * A world of one rank needs no peers: it runs on a one-rank loopback
 * transport (collectives on the caller's thread), without a store.
 *
 * The rendezvous (join_world), under "<prefix>/rdv/":
 *   claim/<r>    compare-and-set from empty to "<pid> <host id>": the first
 *                process to claim rank r owns it; a second one finds the
 *                first's claim and reports a duplicate RANK;
 *   arrivals     a counter: each claimant adds one, getting its ticket n;
 *   arrival/<n>  "<rank> <world> <pid> <host id> <host name>", so every rank
 *                reads each arrival once, in order (O(W) per rank);
 *   error        the first error any rank found (compare-and-set from
 *                empty): every rank polls it and fails with it;
 *   failed       a counter of the processes that have the error, or died
 *                (out/<rank>/<pid>/<host id>, set once, counts each once):
 *                the store's host waits for it (hold_store_for_error).
 * Every rank checks each arrival against its own WORLD_SIZE and, for the
 * arrivals on its own host (same boot id and pid namespace), watches the
 * process through a pidfd: one that exits before the rendezvous completes
 * fails the others at once, naming it. The loop waits on those pidfds
 * (poll, 50 ms plus 1 ms per 8 ranks) between rounds and says at warn
 * level, every g_progress_s (10 s), which ranks it still waits for.
 * Under a launcher that hosts the store (tsrun), the loop also reads the
 * exits it records (TS_LAUNCH_EXITS_KEY, comm/launch.h): a rank that exits
 * before the rendezvous completes, even with status 0 and before it
 * arrived, fails the others at once, naming it and its status.
 * Without a launcher, a second RANK 0 finds MASTER_PORT taken by the
 * first one's store: it connects there as a client and, finding RANK 0
 * claimed, reports the duplicate through the error key (port_taken).
 * When rank 0 hosts the store (no launcher) and the rendezvous fails, it
 * keeps the store up until every process that joined it has read the
 * error (hold_store_for_error, at most RDV_ERROR_GRACE_S).
 * A client the store rejected for a wrong token (TS_STORE_REJECTED_KEY,
 * set by the store itself) after this rank's rendezvous began (the
 * store's TS_STORE_REJECTED_COUNT_KEY grew since; a store rank 0 has just
 * started counts from 0) fails the rendezvous at once on every rank,
 * naming its address, and is counted out (it will never arrive). A
 * rejection before then (a stray client, an earlier job under tsrun's
 * store, which outlives ts_dist_finalize) does not. After
 * the rendezvous, a watch thread per rank fails the world if an error is
 * recorded late (a duplicate RANK that started after the others met: see
 * "the watch" below).
 * Known limit: when every rank of the smaller WORLD_SIZE arrives and
 * leaves before any rank of a larger one arrives, only the latecomers
 * fail (the others see a consistent world and go on).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "comm/coll_direct.h" /* ts__direct_fallback_bytes: the floor */
#include "comm/comm_internal.h"
#include "comm/launch.h"
#include "comm/store.h"
#include "comm/store_internal.h"
#include "comm/transport.h"
#include "comm/xmem.h"
#include "tensor/blis_arch.h"

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static ts_comm *g_world;          /* NULL when not initialized (under g_mu) */
static ts_store *g_store;         /* NULL for a world of one rank */
static ts_store_server *g_server; /* rank 0 when no launcher hosts the store */
/* Rank 0 under a launcher that hosts the store for ranks on several
 * nodes: node 0's launcher (and its store) ends when its own ranks have
 * exited, so rank 0 waits at ts_dist_finalize until every rank has made
 * its last store call, as the hosting rank 0 does without a launcher. */
static bool g_hold_for_nodes;
static ts_loopback_fabric *g_fabric; /* the one-rank world's */
static char g_prefix[3 * TS_LAUNCH_MAX_STR];
static unsigned g_epoch;           /* inits so far: each gets its own store keys */
static double g_progress_s = 10.0; /* ts__dist_set_progress_interval */

void ts__dist_set_progress_interval(double seconds) { g_progress_s = seconds > 0 ? seconds : 10.0; }

#define TS_DIST_TIMEOUT_ENV "TS_DIST_TIMEOUT"
#define RDV_MAX_ID 160

/* ------------------------------------------------------------ rendezvous */

typedef struct rdv_peer {
    bool seen;
    int pid;
    int pidfd; /* -1: not on this host, or not watchable */
    char host[64];
    bool exited; /* its launcher recorded its exit (TS_LAUNCH_EXIT_KEY) */
    int exit_code, exit_signal, exit_pid;
} rdv_peer;

/* The n bytes at v as a NUL-terminated string (ts__free(TS_MEM_COMM)
 * it), or NULL when out of memory (as strndup, which it replaces; the
 * bytes hold no NUL in the values read here). */
static char *text_of(const void *v, size_t n)
{
    char *t = ts__malloc(TS_MEM_COMM, n + 1);
    if (!t) return NULL;
    memcpy(t, v, n);
    t[n] = '\0';
    return t;
}

/* Identifies this host and pid namespace: pids compare only within it
 * (xmem.h, TS_HOST_ID_PIDS). */
static void host_id(char *out, size_t n) { ts__host_id(TS_HOST_ID_PIDS, out, n); }

static void host_name(char *out, size_t n)
{
    if (gethostname(out, n) != 0) snprintf(out, n, "?");
    out[n - 1] = '\0';
    for (char *p = out; *p; p++)
        if (*p == ' ') *p = '_';
}

/* Records the first error of the rendezvous for every rank and returns
 * `s` with `msg` as this rank's detail. */
static ts_status rdv_fail(ts_store *st, const char *prefix, int world, ts_status s, const char *msg)
{
    char key[3 * TS_LAUNCH_MAX_STR + 32];
    snprintf(key, sizeof key, "%s/rdv/error", prefix);
    char val[600];
    snprintf(val, sizeof val, "%d %s", (int)s, msg);
    void *got = NULL;
    size_t glen = 0;
    if (ts_store_compare_set(st, key, "", 0, val, strlen(val), &got, &glen) == TS_OK && glen == strlen(val) &&
        memcmp(got, val, glen) == 0) {
        /* the first error: wake the ranks past the rendezvous (watch_main) */
        for (int r = 0; r < world; r++) {
            snprintf(key, sizeof key, "%s/rdv/wake/%d", prefix, r);
            if (ts_store_set(st, key, "", 0) != TS_OK) break;
        }
    }
    ts_store_value_free(got);
    return ts_error(s, "%s", msg);
}

/* Counts a process out of a failed rendezvous ("<prefix>/rdv/failed",
 * which the store's host reads: hold_store_for_error), at most once per
 * process: the process itself once it has the error, or, for a rank of
 * this host that died (it will never read the error), the rank that found
 * it dead. `rank`, `pid` and `id` (host id) name the process counted out. */
static void rdv_count_out_quiet(ts_store *st, const char *prefix, int rank, int pid, const char *id)
{
    char key[3 * TS_LAUNCH_MAX_STR + RDV_MAX_ID + 64], me[RDV_MAX_ID + 32], me_id[RDV_MAX_ID];
    snprintf(key, sizeof key, "%s/rdv/out/%d/%d/%s", prefix, rank, pid, id);
    host_id(me_id, sizeof me_id);
    snprintf(me, sizeof me, "%d %s", (int)getpid(), me_id);
    void *got = NULL;
    size_t glen = 0;
    if (ts_store_compare_set(st, key, "", 0, me, strlen(me), &got, &glen) != TS_OK) return;
    bool first = glen == strlen(me) && memcmp(got, me, glen) == 0;
    ts_store_value_free(got);
    if (first) {
        snprintf(key, sizeof key, "%s/rdv/failed", prefix);
        (void)ts_store_add(st, key, 1, NULL);
    }
}

/* Quiet (docs/design.md, D1): the error that counts a process out keeps
 * its detail whatever the store says. */
static void rdv_count_out(ts_store *st, const char *prefix, int rank, int pid, const char *id)
{
    ts__error_quiet_begin();
    rdv_count_out_quiet(st, prefix, rank, pid, id);
    ts__error_quiet_end();
}

/* The duplicate-RANK message: `claim` (len bytes) is the first claimant's
 * "<pid> <host id> <host name>"; `how` (may be "") ends it. */
static void duplicate_rank_msg(char *msg, size_t cap, int rank, const void *claim, size_t len, int pid,
                               const char *me_host, int world, const char *how)
{
    int opid = 0;
    char oid[RDV_MAX_ID] = "?", ohost[64] = "?";
    char *txt = text_of(claim, len);
    if (txt) sscanf(txt, "%d %159s %63s", &opid, oid, ohost);
    ts__free(TS_MEM_COMM, txt);
    snprintf(msg, cap,
             "ts_dist_init: duplicate RANK %d: claimed by pid %d on %s and by pid %d on %s (WORLD_SIZE %d); "
             "every process needs its own RANK in 0..%d%s",
             rank, opid, ohost, pid, me_host, world, world - 1, how);
}

static void list_ranks(char *out, size_t cap, const rdv_peer *peers, int world)
{
    size_t used = 0;
    int listed = 0, missing = 0;
    out[0] = '\0';
    for (int r = 0; r < world; r++) {
        if (peers[r].seen) continue;
        missing++;
        if (listed < 16 && used + 16 < cap) {
            used += (size_t)snprintf(out + used, cap - used, "%s%d", listed ? ", " : "", r);
            listed++;
        }
    }
    if (missing > listed && used + 32 < cap) snprintf(out + used, cap - used, " and %d more", missing - listed);
}

/* Reads the exits the launcher recorded since the last call (`exits_read`
 * of them read so far) into peers[]; counts the newly exited ranks other
 * than this one in *nexited. */
static ts_status read_exits(ts_store *st, const char *run_id, int rank, int world, rdv_peer *peers, int64_t *exits_read,
                            int *nexited)
{
    char key[TS_LAUNCH_MAX_STR + 64];
    snprintf(key, sizeof key, TS_LAUNCH_EXITS_KEY, run_id);
    int64_t n = 0;
    ts_status s = ts_store_add(st, key, 0, &n);
    while (s == TS_OK && *exits_read < n) {
        snprintf(key, sizeof key, TS_LAUNCH_EXIT_KEY, run_id, (long long)(*exits_read + 1));
        if (ts_store_check(st, key) != TS_OK) break; /* counted but not set yet: next round */
        void *v = NULL;
        size_t len = 0;
        s = ts_store_get(st, key, &v, &len);
        if (s != TS_OK) break;
        ++*exits_read;
        int r = -1, code = 0, sig = 0, epid = 0;
        char *txt = text_of(v, len);
        ts_store_value_free(v);
        if (txt) sscanf(txt, "%d %d %d %d", &r, &code, &sig, &epid);
        ts__free(TS_MEM_COMM, txt);
        if (r < 0 || r >= world || r == rank || peers[r].exited)
            continue; /* another job's numbering cannot reach here; ignore what is not a peer */
        peers[r].exited = true;
        peers[r].exit_code = code;
        peers[r].exit_signal = sig;
        peers[r].exit_pid = epid;
        ++*nexited;
    }
    return s;
}

/* "status 3" or "signal 9 (SIGKILL)" */
static void exit_how(char *out, size_t cap, const rdv_peer *p)
{
    if (p->exit_signal > 0) {
        const char *name = sigabbrev_np(p->exit_signal);
        snprintf(out, cap, "signal %d%s%s%s", p->exit_signal, name ? " (SIG" : "", name ? name : "", name ? ")" : "");
    } else {
        snprintf(out, cap, "status %d", p->exit_code);
    }
}

/* All W ranks meet: duplicate RANKs, inconsistent WORLD_SIZEs, ranks of
 * this host that exit meanwhile and ranks whose launcher recorded their
 * exit (run_id not NULL: the launcher's TS_LAUNCH_EXIT_KEY records) are
 * errors on every rank that is still waiting (see the top of this file).
 * Bounded by timeout_s. */
static ts_status join_world_inner(ts_store *st, const char *prefix, const char *run_id, int rank, int world,
                                  double timeout_s, bool hosting)
{
    char me_id[RDV_MAX_ID], me_host[64];
    host_id(me_id, sizeof me_id);
    host_name(me_host, sizeof me_host);
    int pid = (int)getpid();
    char key[3 * TS_LAUNCH_MAX_STR + 64], val[RDV_MAX_ID + 160], msg[512];
    ts_status s;

    /* 0. The store's count of clients rejected for a wrong token so far:
     * only later ones fail this rendezvous (store.h:
     * TS_STORE_REJECTED_COUNT_KEY). A store this process has just started
     * for this rendezvous counts from 0 (a rank rejected before this read
     * is one of ours). Add 0 reads the counter (creating it as 0). */
    int64_t rejected0 = 0;
    if (!hosting) {
        s = ts_store_add(st, TS_STORE_REJECTED_COUNT_KEY, 0, &rejected0);
        if (s != TS_OK) return s;
    }

    /* 1. Claim the rank. */
    snprintf(key, sizeof key, "%s/rdv/claim/%d", prefix, rank);
    snprintf(val, sizeof val, "%d %s %s", pid, me_id, me_host);
    void *got = NULL;
    size_t glen = 0;
    s = ts_store_compare_set(st, key, "", 0, val, strlen(val), &got, &glen);
    if (s != TS_OK) return s;
    bool mine = glen == strlen(val) && memcmp(got, val, glen) == 0;
    if (!mine) {
        duplicate_rank_msg(msg, sizeof msg, rank, got, glen, pid, me_host, world, "");
        ts_store_value_free(got);
        return rdv_fail(st, prefix, world, TS_ERR_INVALID_ARGUMENT, msg);
    }
    ts_store_value_free(got);

    /* 2. Arrive. */
    snprintf(key, sizeof key, "%s/rdv/arrivals", prefix);
    int64_t ticket = 0;
    s = ts_store_add(st, key, 1, &ticket);
    if (s != TS_OK) return s;
    snprintf(key, sizeof key, "%s/rdv/arrival/%lld", prefix, (long long)ticket);
    snprintf(val, sizeof val, "%d %d %d %s %s", rank, world, pid, me_id, me_host);
    s = ts_store_set(st, key, val, strlen(val));
    if (s != TS_OK) return s;

    /* 3. Wait for everyone, reading each arrival once. */
    rdv_peer *peers = ts__calloc(TS_MEM_COMM, (size_t)world, sizeof *peers);
    struct pollfd *pfds = ts__calloc(TS_MEM_COMM, (size_t)world, sizeof *pfds);
    int *pfd_rank = ts__calloc(TS_MEM_COMM, (size_t)world, sizeof *pfd_rank);
    if (!peers || !pfds || !pfd_rank) {
        ts__free(TS_MEM_COMM, peers);
        ts__free(TS_MEM_COMM, pfds);
        ts__free(TS_MEM_COMM, pfd_rank);
        return ts_error(TS_ERR_NO_MEMORY, "ts_dist_init: rendezvous of %d ranks: out of memory", world);
    }
    for (int r = 0; r < world; r++) peers[r].pidfd = -1;
    int nseen = 0, npfd = 0, nexited = 0;
    int64_t read_upto = 0, exits_read = 0;
    double t0 = (double)ts_now_ns() / 1e9, next_note = t0 + g_progress_s;
    s = TS_OK;
    int gone = -1; /* a local rank whose pidfd fired */
    for (;;) {
        /* Somebody failed? (Checked first: a rank that found an error
         * records it before it exits.) */
        snprintf(key, sizeof key, "%s/rdv/error", prefix);
        if (ts_store_check(st, key) == TS_OK) {
            void *ev = NULL;
            size_t elen = 0;
            s = ts_store_get(st, key, &ev, &elen);
            if (s == TS_OK) {
                int code = (int)TS_ERR_INVALID_ARGUMENT, off = 0;
                char *txt = text_of(ev, elen);
                if (txt && sscanf(txt, "%d %n", &code, &off) >= 1)
                    s = ts_error((ts_status)code, "%s (reported to rank %d)", txt + off, rank);
                else s = ts_error(TS_ERR_INVALID_ARGUMENT, "ts_dist_init: the rendezvous failed on another rank");
                ts__free(TS_MEM_COMM, txt);
                ts_store_value_free(ev);
            }
            break;
        }
        /* A client the store rejected for a wrong token is a rank that
         * will never arrive (it failed at once): say so now. */
        int64_t rejected = 0;
        s = ts_store_add(st, TS_STORE_REJECTED_COUNT_KEY, 0, &rejected);
        if (s != TS_OK) break;
        if (rejected != rejected0 && ts_store_check(st, TS_STORE_REJECTED_KEY) == TS_OK) {
            void *rv = NULL;
            size_t rlen = 0;
            s = ts_store_get(st, TS_STORE_REJECTED_KEY, &rv, &rlen);
            if (s != TS_OK) break;
            char missing[200];
            list_ranks(missing, sizeof missing, peers, world);
            snprintf(msg, sizeof msg,
                     "ts_dist_init: the store rejected a client from %.*s for a wrong token: every rank needs the "
                     "same " TS_STORE_TOKEN_ENV " (rank(s) [%s] of %d had not arrived)",
                     (int)(rlen < 64 ? rlen : 64), (const char *)rv, missing, world);
            /* counted out as the process it was, so that the store's host
             * need not wait for it (hold_store_for_error) */
            char who[96];
            snprintf(who, sizeof who, "%.*s", (int)(rlen < 64 ? rlen : 64), (const char *)rv);
            for (char *q = who; *q; q++)
                if (*q == '/' || *q == ' ') *q = '_';
            ts_store_value_free(rv);
            s = rdv_fail(st, prefix, world, TS_ERR_INVALID_ARGUMENT, msg);
            rdv_count_out(st, prefix, -1, 0, who);
            break;
        }
        if (gone >= 0) {
            snprintf(msg, sizeof msg,
                     "ts_dist_init: rank %d (pid %d on %s) exited before the rendezvous of %d ranks completed", gone,
                     peers[gone].pid, peers[gone].host, world);
            s = rdv_fail(st, prefix, world, TS_ERR_PEER_FAILED, msg);
            rdv_count_out(st, prefix, gone, peers[gone].pid, me_id);
            break;
        }
        /* Exits the launcher saw, read before the arrivals: a rank's
         * arrival is in the store before its exit is. */
        if (run_id) {
            s = read_exits(st, run_id, rank, world, peers, &exits_read, &nexited);
            if (s != TS_OK) break;
        }
        /* New arrivals. */
        int64_t count = 0;
        snprintf(key, sizeof key, "%s/rdv/arrivals", prefix);
        s = ts_store_add(st, key, 0, &count);
        if (s != TS_OK) break;
        while (read_upto < count) {
            snprintf(key, sizeof key, "%s/rdv/arrival/%lld", prefix, (long long)(read_upto + 1));
            if (ts_store_check(st, key) != TS_OK) break; /* added but not set yet: next round */
            void *av = NULL;
            size_t alen = 0;
            s = ts_store_get(st, key, &av, &alen);
            if (s != TS_OK) break;
            read_upto++;
            char *txt = text_of(av, alen);
            ts_store_value_free(av);
            int ar = -1, aw = -1, apid = 0;
            char aid[RDV_MAX_ID] = "?", ahost[64] = "?";
            if (txt) sscanf(txt, "%d %d %d %159s %63s", &ar, &aw, &apid, aid, ahost);
            ts__free(TS_MEM_COMM, txt);
            if (aw != world) {
                snprintf(msg, sizeof msg,
                         "ts_dist_init: inconsistent WORLD_SIZE: rank %d (pid %d on %s) has WORLD_SIZE %d, rank %d "
                         "(pid %d on %s) has %d; every process needs the same WORLD_SIZE",
                         ar, apid, ahost, aw, rank, pid, me_host, world);
                s = rdv_fail(st, prefix, world, TS_ERR_INVALID_ARGUMENT, msg);
                break;
            }
            if (ar < 0 || ar >= world || peers[ar].seen) continue; /* cannot happen: claims are unique and in range */
            peers[ar].seen = true;
            peers[ar].pid = apid;
            snprintf(peers[ar].host, sizeof peers[ar].host, "%s", ahost);
            nseen++;
            if (ar != rank && ts__host_same(me_id, aid, sizeof aid) && apid > 0) {
                int fd = ts__host_watch((pid_t)apid);
                if (fd < 0 && errno == ESRCH) {
                    snprintf(msg, sizeof msg,
                             "ts_dist_init: rank %d (pid %d on %s) exited before the rendezvous of %d ranks "
                             "completed",
                             ar, apid, ahost, world);
                    s = rdv_fail(st, prefix, world, TS_ERR_PEER_FAILED, msg);
                    rdv_count_out(st, prefix, ar, apid, me_id);
                    break;
                }
                if (fd >= 0) {
                    peers[ar].pidfd = fd;
                    pfds[npfd] = (struct pollfd){.fd = fd, .events = POLLIN};
                    pfd_rank[npfd++] = ar;
                }
            }
        }
        if (s != TS_OK) break;
        if (count > world) {
            snprintf(msg, sizeof msg,
                     "ts_dist_init: %lld processes joined a world of WORLD_SIZE %d: a RANK or WORLD_SIZE is wrong "
                     "somewhere",
                     (long long)count, world);
            s = rdv_fail(st, prefix, world, TS_ERR_INVALID_ARGUMENT, msg);
            break;
        }
        if (nseen == world) break;
        for (int r = 0; nexited > 0 && r < world; r++) {
            if (!peers[r].exited) continue;
            char how[64];
            exit_how(how, sizeof how, &peers[r]);
            if (peers[r].seen)
                snprintf(msg, sizeof msg,
                         "ts_dist_init: rank %d (pid %d on %s) exited before the rendezvous of %d ranks completed "
                         "(%s, seen by its launcher)",
                         r, peers[r].pid, peers[r].host, world, how);
            else
                snprintf(msg, sizeof msg,
                         "ts_dist_init: rank %d exited (%s) before joining the rendezvous of %d ranks (pid %d, seen "
                         "by its launcher; %d of %d had arrived)",
                         r, how, world, peers[r].exit_pid, nseen, world);
            s = rdv_fail(st, prefix, world, TS_ERR_PEER_FAILED, msg);
            break;
        }
        if (s != TS_OK) break;
        double now = (double)ts_now_ns() / 1e9;
        if (now - t0 >= timeout_s) {
            char missing[200];
            list_ranks(missing, sizeof missing, peers, world);
            s = ts_error(TS_ERR_TIMEOUT,
                         "ts_dist_init: rendezvous '%s': rank %d waited %.1f s (the deadline; " TS_DIST_TIMEOUT_ENV
                         " sets it) for rank(s) [%s], which never arrived (%d of %d arrived)",
                         prefix, rank, now - t0, missing, nseen, world);
            break;
        }
        if (now >= next_note) {
            char missing[200];
            list_ranks(missing, sizeof missing, peers, world);
            ts_logf(TS_LOG_WARN,
                    "rank %d: rendezvous: still waiting for rank(s) [%s] (%d of %d arrived) after %.0f s (deadline "
                    "%.0f s)",
                    rank, missing, nseen, world, now - t0, timeout_s);
            next_note = now + g_progress_s;
        }
        /* Wait on the local ranks' pidfds between rounds. */
        int pr = poll(pfds, (nfds_t)npfd, 50 + world / 8); /* fewer rounds for big worlds */
        for (int i = 0; pr > 0 && i < npfd && gone < 0; i++)
            if (pfds[i].revents & (POLLIN | POLLHUP | POLLERR)) gone = pfd_rank[i];
    }
    for (int r = 0; r < world; r++)
        if (peers[r].pidfd >= 0) close(peers[r].pidfd);
    ts__free(TS_MEM_COMM, peers);
    ts__free(TS_MEM_COMM, pfds);
    ts__free(TS_MEM_COMM, pfd_rank);
    return s;
}

/* The store host's failure path: keeps the store up until every process
 * that joined the failed rendezvous has counted itself out under
 * "<prefix>/rdv/failed" (rdv_count_out), that is has read the error or
 * died, or for RDV_ERROR_GRACE_S, whichever comes first. Every process
 * means every rank that arrived and, for a rank that has not connected
 * yet, as many as the largest WORLD_SIZE that any arrival announced (read
 * here from the arrivals themselves: this rank may have read the error
 * before the arrival that disagrees with it, and a late rank of a larger
 * world would otherwise find the store gone and wait for its own deadline
 * on "connection refused"). */
#define RDV_ERROR_GRACE_S 5.0
static void hold_store_for_error_quiet(ts_store *st, const char *prefix, int world)
{
    char fkey[3 * TS_LAUNCH_MAX_STR + 64], akey[3 * TS_LAUNCH_MAX_STR + 64], key[3 * TS_LAUNCH_MAX_STR + 64];
    snprintf(fkey, sizeof fkey, "%s/rdv/failed", prefix);
    snprintf(akey, sizeof akey, "%s/rdv/arrivals", prefix);
    int64_t failed = 0, arrived = 0, read_upto = 0;
    int max_world = world;
    uint64_t until = ts_now_ns() + (uint64_t)(RDV_ERROR_GRACE_S * 1e9);
    while (ts_now_ns() < until) {
        if (ts_store_add(st, akey, 0, &arrived) != TS_OK) return;
        while (read_upto < arrived) {
            snprintf(key, sizeof key, "%s/rdv/arrival/%lld", prefix, (long long)(read_upto + 1));
            if (ts_store_check(st, key) != TS_OK) break; /* added but not set yet: next round */
            void *av = NULL;
            size_t alen = 0;
            if (ts_store_get(st, key, &av, &alen) != TS_OK) return;
            read_upto++;
            int ar = -1, aw = -1;
            char *txt = text_of(av, alen);
            ts_store_value_free(av);
            if (txt && sscanf(txt, "%d %d", &ar, &aw) == 2 && aw > max_world)
                max_world = aw; /* ts_launch_env bounded it on that rank */
            ts__free(TS_MEM_COMM, txt);
        }
        if (ts_store_add(st, fkey, 0, &failed) != TS_OK) return;
        if (read_upto == arrived && failed >= arrived && failed >= max_world) return; /* everybody has read the error */
        struct timespec nap = {0, 20000000}; /* 20 ms: the others are reading the error */
        nanosleep(&nap, NULL);
    }
}

/* Quiet, as rdv_count_out. */
static void hold_store_for_error(ts_store *st, const char *prefix, int world)
{
    ts__error_quiet_begin();
    hold_store_for_error_quiet(st, prefix, world);
    ts__error_quiet_end();
}

static ts_status join_world(ts_store *st, const char *prefix, const char *run_id, int rank, int world, double timeout_s,
                            bool hosting)
{
    ts_status s = join_world_inner(st, prefix, run_id, rank, world, timeout_s, hosting);
    if (s != TS_OK && s != TS_ERR_TIMEOUT && s != TS_ERR_COMM) {
        /* Count this rank out; the rank hosting the store keeps it up
         * until the others have read the error too (hold_store_for_error),
         * so that they report it rather than a lost store. */
        char me_id[RDV_MAX_ID];
        host_id(me_id, sizeof me_id);
        rdv_count_out(st, prefix, rank, (int)getpid(), me_id);
        if (hosting) hold_store_for_error(st, prefix, world);
    }
    return s;
}

/* Rank 0 cannot host the store: MASTER_PORT is taken (the detail of
 * ts_store_server_start is the last error). When a store of this job
 * answers there and RANK 0 is claimed in it, this process is a second
 * RANK 0: it reports that through the job's error key, so that every rank
 * fails at once naming both pids, and counts itself out (join_world).
 * Otherwise another program holds the port. Bounded by 5 s (or timeout_s
 * when shorter) for the connection and 5 s more for the claim. */
static ts_status port_taken(const ts_rank_env *e, const char *prefix, double timeout_s)
{
    char listen_err[400], why[400], msg[512];
    snprintf(listen_err, sizeof listen_err, "%s", ts_last_error());
    double probe_s = timeout_s < 5.0 ? timeout_s : 5.0;
    ts_store *c = NULL;
    ts_status s = ts_store_connect(e->master_addr, e->master_port, e->token, probe_s, &c);
    if (s != TS_OK) {
        snprintf(why, sizeof why, "%s", ts_last_error());
        return ts_error(TS_ERR_IO,
                        "ts_dist_init: rank 0 cannot host the store: %s: another program holds MASTER_PORT %d (no "
                        "tensorshard store of this job answers there: %s); stop it or choose another MASTER_PORT",
                        listen_err, e->master_port, why);
    }
    ts_store_set_timeout(c, probe_s);
    char key[3 * TS_LAUNCH_MAX_STR + 64];
    snprintf(key, sizeof key, "%s/rdv/claim/0", prefix);
    void *got = NULL;
    size_t glen = 0;
    s = ts_store_get(c, key, &got, &glen);
    if (s != TS_OK) {
        snprintf(why, sizeof why, "%s", ts_last_error());
        ts_store_close(c);
        return ts_error(TS_ERR_IO,
                        "ts_dist_init: rank 0 cannot host the store: %s: a tensorshard store answers on MASTER_PORT %d "
                        "but no RANK 0 of this job claimed its rank there (%s): another job's store holds the port; "
                        "choose another MASTER_PORT",
                        listen_err, e->master_port, why);
    }
    char me_host[64], how[96];
    host_name(me_host, sizeof me_host);
    snprintf(how, sizeof how, " (the second found MASTER_PORT %d held by the first one's store)", e->master_port);
    duplicate_rank_msg(msg, sizeof msg, 0, got, glen, (int)getpid(), me_host, e->world_size, how);
    ts_store_value_free(got);
    s = rdv_fail(c, prefix, e->world_size, TS_ERR_INVALID_ARGUMENT, msg);
    /* counted out, so that the hosting rank 0 need not wait for this one */
    char me_id[RDV_MAX_ID];
    host_id(me_id, sizeof me_id);
    rdv_count_out(c, prefix, 0, (int)getpid(), me_id);
    ts_store_close(c);
    return ts_error(s, "%s", msg);
}

/* ------------------------------------------------------------ the watch */

/* After the rendezvous: a process that claims a rank of this world late
 * (a duplicate RANK that starts after the others have met) records the
 * error under "<prefix>/rdv/error" and sets "<prefix>/rdv/wake/<r>" for
 * every rank r (rdv_fail). Each rank's watch thread waits on its own wake
 * key through a client of its own (the store answers it at once when the
 * key is set; it asks again every WATCH_POLL_S so that a store that
 * stopped answering cannot hold it longer) and, woken by an error, fails
 * the world with it (ts__world_fail): the collectives of every rank fail,
 * naming the duplicate. ts_dist_finalize sets this rank's wake key to
 * end it, then reads the error key once more.
 *
 * Failure notices: a rank that fails its world by its own finding (a dead
 * peer, a fingerprint mismatch, a deadline: comm_internal.h's fail hook)
 * posts "<rank> <status> <culprit> <message>" under "<prefix>/failed"
 * (compare-and-set from empty: the first failure wins) and, when it won,
 * sets every other rank's wake key, all before its request completes with
 * the error (post_failure, through a second client, each call bounded by
 * FAIL_POST_TIMEOUT_S). A watch woken without a rendezvous error fails
 * its world with that notice, naming the rank that posted it. The
 * transport's notices (comm.c) reach every rank but the culprit, and only
 * over endpoints that still work: the store reaches the rank another
 * declared failed (a live one when that was wrong, docs/multihost.md) and
 * ranks whose connection to the failing rank broke. */
#define WATCH_POLL_S 2.0
#define FAIL_POST_TIMEOUT_S 1.0
/* A reply the store sends late (a loaded host) costs the client its
 * connection (store.h): the watch then reconnects, after a pause that
 * doubles from WATCH_BACKOFF_MIN_S up to WATCH_BACKOFF_MAX_S, until it is
 * stopped, each attempt bounded by WATCH_CONNECT_S; post_failure
 * reconnects once (bounded by FAIL_POST_TIMEOUT_S) before it gives up. */
#define WATCH_BACKOFF_MIN_S 0.05
#define WATCH_BACKOFF_MAX_S 2.0
#define WATCH_CONNECT_S 1.0
/* The connect timeout of the optional clients (the watch's, the fail
 * hook's, the world's for "Who never entered"): the main client has just
 * reached the store, so a connect that takes longer means trouble, and
 * three of them must not add minutes to ts_dist_init. */
#define OPTIONAL_CONNECT_S 5.0

typedef struct watch {
    pthread_t thread;
    ts_store *client;
    ts_store *post; /* the fail hook's client (NULL: no notices posted) */
    ts_comm *world;
    int rank, world_size;
    atomic_bool stop;
    char addr[TS_LAUNCH_MAX_STR], token[TS_LAUNCH_MAX_STR]; /* to reconnect */
    int port;
    char prefix[3 * TS_LAUNCH_MAX_STR];
    char wake_key[3 * TS_LAUNCH_MAX_STR + 48], error_key[3 * TS_LAUNCH_MAX_STR + 32];
    char failed_key[3 * TS_LAUNCH_MAX_STR + 32];
} watch;
static watch *g_watch;

/* Replaces *c (closed) by a new connection to the store, its calls
 * bounded by call_s; false (and *c NULL) when the connect fails. */
static bool store_reconnect(const watch *wt, ts_store **c, double connect_s, double call_s)
{
    ts_store_close(*c);
    *c = NULL;
    if (ts_store_connect(wt->addr[0] ? wt->addr : NULL, wt->port, wt->token, connect_s, c) != TS_OK) {
        *c = NULL;
        return false;
    }
    ts_store_set_timeout(*c, call_s);
    return true;
}

/* One attempt at posting: the compare-and-set, then (when this rank won)
 * the wakes, from rank `from_r` on. *won says whether the notice is this
 * rank's; *next_r where the wakes stopped. */
static ts_status post_once(watch *wt, const char *val, size_t len, bool *won, int *next_r)
{
    ts_status s = TS_OK;
    if (!*won) {
        void *got = NULL;
        size_t glen = 0;
        s = ts_store_compare_set(wt->post, wt->failed_key, "", 0, val, len, &got, &glen);
        *won = s == TS_OK && glen == len && memcmp(got, val, len) == 0;
        ts_store_value_free(got);
        if (s != TS_OK || !*won) return s;
    }
    for (; *next_r < wt->world_size; ++*next_r) {
        if (*next_r == wt->rank) continue;
        char key[sizeof wt->wake_key];
        snprintf(key, sizeof key, TS__DIST_WAKE_KEY, wt->prefix, *next_r);
        s = ts_store_set(wt->post, key, "", 0);
        if (s != TS_OK) return s;
    }
    return TS_OK;
}

/* The fail hook (comm_internal.h): posts this rank's failure and wakes
 * the other ranks' watches. Runs under the world's progress lock. A lost
 * connection (a late reply drops it: store.h) is made again once. */
static void post_failure(void *arg, ts_status st, int culprit, const char *msg)
{
    watch *wt = arg;
    char val[640];
    int n = snprintf(val, sizeof val, "%d %d %d %s", wt->rank, (int)st, culprit, msg);
    size_t len = n < 0 ? 0 : (size_t)n >= sizeof val ? sizeof val - 1 : (size_t)n;
    bool won = false;
    int next_r = 0;
    ts_status s = wt->post ? post_once(wt, val, len, &won, &next_r) : TS_ERR_COMM;
    if (s == TS_ERR_COMM || s == TS_ERR_TIMEOUT) {
        /* the compare-and-set may have been applied before the reply was
         * lost: a retry then finds this rank's own value and wins again */
        if (store_reconnect(wt, &wt->post, FAIL_POST_TIMEOUT_S, FAIL_POST_TIMEOUT_S))
            s = post_once(wt, val, len, &won, &next_r);
        else if (!wt->post)
            s = ts_error(TS_ERR_COMM, "ts_dist: rank %d: cannot reconnect to the store to post its failure: %s",
                         wt->rank, ts_last_error());
    }
    if (s != TS_OK)
        ts_logf(TS_LOG_WARN, "ts_dist: rank %d: cannot post its failure to the store: %s", wt->rank, ts_last_error());
}

/* The value of `key` as a NUL-terminated string (text_of), or NULL
 * when it is not set or cannot be read. */
static char *store_text(ts_store *st, const char *key)
{
    if (ts_store_check(st, key) != TS_OK) return NULL;
    void *v = NULL;
    size_t n = 0;
    if (ts_store_get(st, key, &v, &n) != TS_OK) return NULL;
    char *text = text_of(v, n);
    ts_store_value_free(v);
    return text;
}

/* The failure notice of another rank as this rank's message: *st_out and
 * the message in msg; false when there is none (or it is this rank's own,
 * or malformed). */
static bool read_notice(watch *wt, ts_status *st_out, char *msg, size_t cap)
{
    char *text = store_text(wt->client, wt->failed_key);
    if (!text) return false;
    int from = -1, st = 0, culprit = -1, used = 0;
    bool ok = sscanf(text, "%d %d %d %n", &from, &st, &culprit, &used) == 3 && used > 0 && st < 0 && from != wt->rank;
    if (ok) {
        const char *what = text + used;
        if (from < 0) /* the launcher's: a rank its memory cgroup OOM-killed */
            snprintf(msg, cap, "%.500s (reported by the launcher through the store)", what);
        else if (culprit == wt->rank)
            snprintf(msg, cap, "rank %d gave up on this rank: %.500s (reported through the store)", from, what);
        else if (culprit >= 0) snprintf(msg, cap, "%.500s (reported by a peer through the store)", what);
        else snprintf(msg, cap, "rank %d failed: %.500s (reported through the store)", from, what);
        *st_out = (ts_status)st;
    }
    ts__free(TS_MEM_COMM, text);
    return ok;
}

/* The recorded rendezvous error as "<status> <message>": *code_out and
 * the message (malloc'd), or NULL when none is recorded. */
static char *read_rdv_error(ts_store *st, const char *key, ts_status *code_out)
{
    char *txt = store_text(st, key);
    if (!txt) return NULL;
    int code = (int)TS_ERR_INVALID_ARGUMENT, off = 0;
    if (sscanf(txt, "%d %n", &code, &off) < 1 || code >= 0) code = (int)TS_ERR_INVALID_ARGUMENT, off = 0;
    memmove(txt, txt + off, strlen(txt + off) + 1);
    *code_out = (ts_status)code;
    return txt;
}

/* Sleeps `s` seconds, in steps of at most 50 ms, returning early when
 * the watch is stopped. */
static void watch_pause(watch *wt, double s)
{
    while (s > 0 && !atomic_load(&wt->stop)) {
        double d = s < 0.05 ? s : 0.05;
        struct timespec ts = {0, (long)(d * 1e9)};
        nanosleep(&ts, NULL);
        s -= d;
    }
}

static void *watch_main(void *arg)
{
    watch *wt = arg;
    ts_trace_thread_name("dist-watch");
    double backoff = WATCH_BACKOFF_MIN_S;
    unsigned lost = 0; /* failed calls and connects since the last good reply */
    while (!atomic_load(&wt->stop)) {
        if (!wt->client) {
            if (!store_reconnect(wt, &wt->client, WATCH_CONNECT_S, WATCH_POLL_S)) {
                lost++;
                watch_pause(wt, backoff);
                backoff = backoff * 2 < WATCH_BACKOFF_MAX_S ? backoff * 2 : WATCH_BACKOFF_MAX_S;
                continue;
            }
            ts_logf(TS_LOG_INFO, "ts_dist: rank %d: the watch reconnected to the store (after %u failed attempts)",
                    wt->rank, lost);
        }
        void *v = NULL;
        size_t len = 0;
        ts_status s = ts_store_get(wt->client, wt->wake_key, &v, &len);
        ts_store_value_free(v);
        char why[300] = "";
        if (s != TS_OK) snprintf(why, sizeof why, "%s", ts_last_error());
        if (s == TS_ERR_TIMEOUT && ts_store_check(wt->client, wt->wake_key) != TS_ERR_COMM) {
            lost = 0, backoff = WATCH_BACKOFF_MIN_S; /* the store answered: no wake yet */
            continue;
        }
        if (s != TS_OK) {
            /* The connection is gone (a late reply, a reset): make it
             * again, unless the watch is being stopped. */
            if (lost++ == 0 && !atomic_load(&wt->stop))
                ts_logf(TS_LOG_WARN, "ts_dist: rank %d: the watch lost its connection to the store (%s); reconnecting",
                        wt->rank, why);
            ts_store_close(wt->client);
            wt->client = NULL;
            watch_pause(wt, backoff);
            backoff = backoff * 2 < WATCH_BACKOFF_MAX_S ? backoff * 2 : WATCH_BACKOFF_MAX_S;
            continue;
        }
        ts_status code = TS_OK;
        char *err = read_rdv_error(wt->client, wt->error_key, &code);
        char msg[700];
        if (err) {
            snprintf(msg, sizeof msg, "%s (found after the rendezvous; reported to rank %d)", err, wt->rank);
            ts__world_fail(wt->world, code, msg);
            ts__free(TS_MEM_COMM, err);
        } else if (!atomic_load(&wt->stop) && read_notice(wt, &code, msg, sizeof msg)) {
            ts__world_fail(wt->world, code, msg);
        } else if (!atomic_load(&wt->stop)) {
            ts_logf(TS_LOG_WARN,
                    "ts_dist: rank %d: the watch of the store ends before ts_dist_finalize: woken, it found no "
                    "rendezvous error and no failure notice it could read (%s); later notices reach this rank only "
                    "over the transport",
                    wt->rank, ts_last_error());
        }
        break;
    }
    return NULL;
}

/* Starts the watch of `world` (rank `rank`); without one (no memory, no
 * second connection) the job runs unwatched, with a warning. */
static void watch_start(const ts_rank_env *e, const char *prefix, ts_comm *world)
{
    watch *wt = ts__calloc(TS_MEM_COMM, 1, sizeof *wt);
    if (!wt) return;
    wt->world = world;
    wt->rank = e->rank;
    wt->world_size = e->world_size;
    atomic_init(&wt->stop, false);
    snprintf(wt->prefix, sizeof wt->prefix, "%s", prefix);
    snprintf(wt->wake_key, sizeof wt->wake_key, TS__DIST_WAKE_KEY, prefix, e->rank);
    snprintf(wt->error_key, sizeof wt->error_key, "%s/rdv/error", prefix);
    snprintf(wt->failed_key, sizeof wt->failed_key, TS__DIST_FAILED_KEY, prefix);
    snprintf(wt->addr, sizeof wt->addr, "%s", e->master_addr);
    snprintf(wt->token, sizeof wt->token, "%s", e->token);
    wt->port = e->master_port;
    if (ts_store_connect(e->master_addr, e->master_port, e->token, OPTIONAL_CONNECT_S, &wt->client) != TS_OK) {
        ts_logf(TS_LOG_WARN, "ts_dist_init: rank %d: no watch of the store (a late duplicate RANK goes unseen): %s",
                e->rank, ts_last_error());
        ts__free(TS_MEM_COMM, wt);
        return;
    }
    ts_store_set_timeout(wt->client, WATCH_POLL_S);
    if (pthread_create(&wt->thread, NULL, watch_main, wt) != 0) {
        ts_logf(TS_LOG_WARN, "ts_dist_init: rank %d: no watch of the store: cannot start its thread", e->rank);
        ts_store_close(wt->client);
        ts__free(TS_MEM_COMM, wt);
        return;
    }
    g_watch = wt;
    if (ts_store_connect(e->master_addr, e->master_port, e->token, OPTIONAL_CONNECT_S, &wt->post) != TS_OK) {
        ts_logf(TS_LOG_WARN, "ts_dist_init: rank %d: its failures will reach the others only over the transport: %s",
                e->rank, ts_last_error());
        wt->post = NULL;
        return;
    }
    ts_store_set_timeout(wt->post, FAIL_POST_TIMEOUT_S);
    ts__world_set_fail_hook(world, post_failure, wt);
}

/* Ends the watch: wakes it through `st` (the caller's client; NULL or a
 * store that does not answer: the watch ends by itself within
 * WATCH_POLL_S and a second, plus WATCH_CONNECT_S when it was
 * reconnecting) and joins it. */
static void watch_stop(ts_store *st)
{
    watch *wt = g_watch;
    if (!wt) return;
    g_watch = NULL;
    ts__world_set_fail_hook(wt->world, NULL, NULL);
    atomic_store(&wt->stop, true);
    if (st) (void)ts_store_set(st, wt->wake_key, "", 0);
    pthread_join(wt->thread, NULL);
    ts_store_close(wt->client);
    ts_store_close(wt->post);
    ts__free(TS_MEM_COMM, wt);
}

/* Gives the world a store client of its own, through which a rank whose
 * collective passes its deadline names the ranks that never entered it
 * (comm.c, "Who never entered"), and, under tsrun, records the first for
 * the launcher's last line. Without one (the connection failed) the
 * deadline messages say what each rank sees, with a warning. */
static void attach_store(const ts_rank_env *e, const char *prefix, ts_comm *world)
{
    ts_store *c = NULL;
    if (ts_store_connect(e->master_addr, e->master_port, e->token, OPTIONAL_CONNECT_S, &c) != TS_OK) {
        ts_logf(TS_LOG_WARN, "ts_dist_init: rank %d: deadlines will not name hung ranks from the store: %s", e->rank,
                ts_last_error());
        return;
    }
    char hung[TS_LAUNCH_MAX_STR + 32] = "";
    if (e->store_hosted && e->run_id[0]) snprintf(hung, sizeof hung, TS_LAUNCH_HUNG_KEY, e->run_id);
    if (ts__world_attach_store(world, c, prefix, hung) != TS_OK)
        ts_logf(TS_LOG_WARN, "ts_dist_init: rank %d: %s", e->rank, ts_last_error());
}

/* Under a launcher that hosts the store: records this world's store
 * prefix (TS_LAUNCH_WORLD_KEY), through which the launcher posts a failure
 * notice of its own (a rank its memory cgroup OOM-killed). Every rank
 * sets the same value once it has met the others, so the key is there
 * before any rank can fail in a collective. */
static void record_world(const ts_rank_env *e, const char *prefix)
{
    if (!e->store_hosted || !e->run_id[0]) return;
    char key[TS_LAUNCH_MAX_STR + 32], val[sizeof g_prefix + 16];
    snprintf(key, sizeof key, TS_LAUNCH_WORLD_KEY, e->run_id);
    int n = snprintf(val, sizeof val, "%d %s", e->world_size, prefix);
    if (ts_store_set(g_store, key, val, (size_t)n) != TS_OK)
        ts_logf(TS_LOG_WARN,
                "ts_dist_init: rank %d: the launcher will not reach this world's ranks through the store: %s", e->rank,
                ts_last_error());
}

/* TS_DIST_TIMEOUT, when set, overrides the option (seconds, > 0). */
static ts_status timeout_from_env(double *timeout_s)
{
    const char *v = getenv(TS_DIST_TIMEOUT_ENV);
    if (!v) return TS_OK;
    char *end = NULL;
    errno = 0;
    double d = strtod(v, &end);
    if (!*v || end == v || *end || errno == ERANGE || !isfinite(d) || !(d > 0) || d > 30.0 * 86400.0)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "ts_dist_init: " TS_DIST_TIMEOUT_ENV "='%.64s' is not a number of seconds in (0, 2592000] "
                        "(the store, rendezvous and per-collective deadline; default 300)",
                        v);
    *timeout_s = d;
    return TS_OK;
}

ts_dist_options ts_dist_options_default(void)
{
    ts_dist_options o = {.transport = "ucx", .timeout_s = 300.0};
    return o;
}

bool ts_dist_is_initialized(void) { return ts__world_published() != NULL; }

ts_comm *ts_dist_world(void) { return ts_comm_world(); }

static ts_status one_rank_world(double timeout_s, ts_comm **out)
{
    ts_loopback_fabric *f = NULL;
    ts_transport *t = NULL;
    ts_status s = ts__loopback_fabric_new(1, &f);
    if (s != TS_OK) return s;
    s = ts__loopback_transport_new(f, 0, &t);
    if (s != TS_OK) {
        ts__loopback_fabric_free(f);
        return s;
    }
    s = ts__world_new(t, timeout_s, out);
    if (s != TS_OK) {
        t->vt->destroy(t);
        ts__loopback_fabric_free(f);
        return s;
    }
    g_fabric = f;
    return TS_OK;
}

/* The info-level line of every rank's ts_dist_init (TS_LOG_LEVEL=info). */
static void log_init(const ts_rank_env *e, const char *transport)
{
    static const char *const launchers[] = {"none", "tsrun/torchrun", "mpirun", "srun"};
    const char *via = (int)e->source >= 0 && (int)e->source < 4 ? launchers[e->source] : "?";
    const char *host = e->world_size == 1 ? "not used by one rank"
        : e->store_hosted                 ? "hosted by the launcher"
                                          : "hosted by rank 0";
    if (e->world_size == 1 && !e->master_port)
        ts_logf(TS_LOG_INFO, "ts_dist_init: rank %d of %d, local rank %d of %d, transport %s, no store (launcher %s)",
                e->rank, e->world_size, e->local_rank, e->local_world_size ? e->local_world_size : 1, transport, via);
    else
        ts_logf(TS_LOG_INFO,
                "ts_dist_init: rank %d of %d, local rank %d of %d, transport %s, store %s:%d (%s; launcher %s)",
                e->rank, e->world_size, e->local_rank, e->local_world_size, transport, e->master_addr, e->master_port,
                host, via);
}

static ts_status init_locked(const ts_dist_options *o)
{
    const char *tname = o->transport && *o->transport ? o->transport : "ucx";
    double timeout_s = o->timeout_s > 0 ? o->timeout_s : 300.0;
    ts_status ts = timeout_from_env(&timeout_s);
    if (ts != TS_OK) return ts;
    bool ucx = strcmp(tname, "ucx") == 0;
    if (!ucx && strcmp(tname, "loopback") != 0)
        return ts_error(TS_ERR_UNSUPPORTED, "ts_dist_init: unknown transport '%s' (\"ucx\" or \"loopback\")", tname);

    ts_rank_env env;
    ts_status s = ts_launch_env(&env);
    if (s == TS_ERR_NOT_FOUND) {
        memset(&env, 0, sizeof env);
        env.world_size = 1; /* a process started alone */
    } else if (s != TS_OK) {
        return s; /* ts_launch_env's detail names the variables */
    } else {
        s = ts_launch_rank_guard();
        if (s != TS_OK) return s;
    }
    if (env.world_size == 1) {
        s = one_rank_world(timeout_s, &g_world);
        if (s == TS_OK) log_init(&env, "loopback (one rank)");
        return s;
    }
    if (!ucx)
        return ts_error(TS_ERR_UNSUPPORTED, "ts_dist_init: the loopback transport cannot join %d processes",
                        env.world_size);

    /* Without a token, rank 0's store serves only processes of its own
     * user on its own host (store.h): ranks on other hosts could never
     * join, so say so now, on every rank. */
    if (!env.store_hosted && !env.token[0] && env.local_world_size < env.world_size)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "ts_dist_init: rank %d: the %d ranks span several hosts (%d on this one) and no launcher "
                        "hosts the store (%s), so rank 0's store needs a token: set " TS_STORE_TOKEN_ENV
                        " to the same secret on every rank (e.g. `export " TS_STORE_TOKEN_ENV
                        "=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \\n')` and `mpirun -x " TS_STORE_TOKEN_ENV
                        " ...`; srun passes the environment on); without one it serves only processes of its own "
                        "user on its own host",
                        env.rank, env.world_size, env.local_world_size, ts_launch_source_name(env.source));
    unsigned epoch = g_epoch++;
    snprintf(g_prefix, sizeof g_prefix, "dist/%s/%u", env.run_id, epoch);
    if (!env.store_hosted && env.rank == 0) {
        s = ts_store_server_start(env.master_addr, env.master_port, env.token, &g_server);
        if (s != TS_OK && ts__store_server_listen_error() == UV_EADDRINUSE) s = port_taken(&env, g_prefix, timeout_s);
        if (s != TS_OK) return s;
    }
    s = ts_store_connect(env.master_addr, env.master_port, env.token, timeout_s, &g_store);
    if (s == TS_ERR_TIMEOUT && !g_server) {
        /* Nothing answered there for the whole deadline (connection
         * refused, retried until then): name the host that should. */
        char why[400];
        snprintf(why, sizeof why, "%s", ts_last_error());
        if (env.store_hosted)
            s = ts_error(s,
                         "ts_dist_init: rank %d: the store of tsrun on node 0 at %s:%d is not reachable (%s): node 0's "
                         "tsrun may not have started (retried for %.3g s, the rendezvous deadline; " TS_DIST_TIMEOUT_ENV
                         " sets it)",
                         env.rank, env.master_addr, env.master_port, why, timeout_s);
        else
            s = ts_error(s,
                         "ts_dist_init: rank %d: the store on rank 0 at %s:%d is not reachable (%s): rank 0 may not "
                         "have started (retried for %.3g s, the rendezvous deadline; " TS_DIST_TIMEOUT_ENV
                         " sets it; MASTER_ADDR and MASTER_PORT name it)",
                         env.rank, env.master_addr, env.master_port, why, timeout_s);
    }
    if (s != TS_OK) goto fail;
    ts_store_set_timeout(g_store, timeout_s);
    /* a launcher that hosts the store records the ranks' exits in it */
    s = join_world(g_store, g_prefix, env.store_hosted ? env.run_id : NULL, env.rank, env.world_size, timeout_s,
                   g_server != NULL);
    if (s != TS_OK) goto fail;
    record_world(&env, g_prefix);
    ts_transport *t = NULL;
    s = ts__ucx_transport_new(g_store, g_prefix, env.rank, env.world_size, timeout_s, &t);
    if (s != TS_OK) goto fail;
    s = ts__world_new(t, timeout_s, &g_world);
    if (s != TS_OK) {
        t->vt->destroy(t);
        goto fail;
    }
    g_hold_for_nodes = env.store_hosted && env.rank == 0 && env.local_world_size < env.world_size;
    attach_store(&env, g_prefix, g_world);
    watch_start(&env, g_prefix, g_world);
    log_init(&env, "ucx");
    return TS_OK;
fail:
    ts_store_close(g_store);
    g_store = NULL;
    ts_store_server_stop(g_server);
    g_server = NULL;
    return s;
}

/* ------------------------------------------------------------ the floor
 * What the process holds beyond the library's tensors: measured once the
 * runtime is up (ts_dist_init's world: UCX, its endpoints and shared
 * memory, the communication thread, the store connection), as VmRSS less
 * the tensor pool, pinned blocks and handles then live, plus BLIS's
 * packing buffers, which BLIS allocates only at the first product, plus,
 * in a world where some ranks cannot read each other's memory (other
 * hosts), the packed fallback's chunk buffers, which its first
 * copy-free collective leaves in the pool (docs/memory.md, "The floor"). */
static pthread_mutex_t g_floor_mu = PTHREAD_MUTEX_INITIALIZER;
static ts_process_floor g_floor;
static bool g_floor_set;

static ts_status floor_measure(bool at_init)
{
    ts_process_memory pm;
    ts_status s = ts_process_memory_read(&pm);
    if (s != TS_OK) return s;
    ts_process_floor f;
    memset(&f, 0, sizeof f);
    f.resident_bytes = pm.rss_bytes;
    f.tracked_bytes = ts_mem_live_bytes(TS_MEM_POOL) + ts_mem_live_bytes(TS_MEM_PINNED) +
        ts_mem_live_bytes(TS_MEM_TENSOR) + ts_mem_live_bytes(TS_MEM_AUTOGRAD) + ts_mem_live_bytes(TS_MEM_NN);
    f.blis_pack_bytes = ts__blis_pack_bytes();
    pthread_mutex_lock(&g_mu);
    f.fallback_bytes = g_world ? ts__direct_fallback_bytes(g_world) : 0;
    pthread_mutex_unlock(&g_mu);
    f.bytes = (f.resident_bytes > f.tracked_bytes ? f.resident_bytes - f.tracked_bytes : 0) + f.blis_pack_bytes +
        f.fallback_bytes;
    f.at_dist_init = at_init;
    pthread_mutex_lock(&g_floor_mu);
    g_floor = f;
    g_floor_set = true;
    pthread_mutex_unlock(&g_floor_mu);
    return TS_OK;
}

ts_status ts_process_floor_get(ts_process_floor *out)
{
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_process_floor_get: out must not be NULL");
    pthread_mutex_lock(&g_floor_mu);
    bool set = g_floor_set;
    pthread_mutex_unlock(&g_floor_mu);
    if (!set) {
        ts_status s = floor_measure(false);
        if (s != TS_OK) return s;
    }
    pthread_mutex_lock(&g_floor_mu);
    *out = g_floor;
    pthread_mutex_unlock(&g_floor_mu);
    return TS_OK;
}

size_t ts_process_floor_bytes(void)
{
    ts_process_floor f;
    return ts_process_floor_get(&f) == TS_OK ? f.bytes : 0;
}

ts_status ts_dist_init(const ts_dist_options *o)
{
    ts_dist_options d = ts_dist_options_default();
    if (!o) o = &d;
    pthread_mutex_lock(&g_mu);
    ts_status s;
    if (g_world)
        s = ts_error(TS_ERR_ALREADY, "ts_dist_init: the world is initialized already (rank %d of %d)",
                     ts_comm_rank(g_world), ts_comm_size(g_world));
    else s = init_locked(o);
    if (s == TS_OK) ts__world_publish(g_world);
    pthread_mutex_unlock(&g_mu);
    if (s == TS_OK && floor_measure(true) != TS_OK) /* no /proc: the estimate's floor is 0 then, not an error here */
        ts_logf(TS_LOG_DEBUG, "ts_dist_init: the process floor is not measured: %s", ts_last_error());
    return s;
}

ts_status ts_dist_finalize(void)
{
    pthread_mutex_lock(&g_mu);
    ts_comm *w = g_world;
    if (!w) {
        pthread_mutex_unlock(&g_mu);
        return ts_error(TS_ERR_STATE, "ts_dist_finalize: no world is initialized");
    }
    /* Every rank's collectives complete (a failed world answers at once)... */
    ts_status s = ts_barrier(w, NULL);
    /* ...and every rank has seen its last message arrive before any rank
     * closes its endpoints (docs/design.md, "UCX: dead peers and shutdown"). */
    if (s == TS_OK && g_store) {
        char name[sizeof g_prefix + 16];
        snprintf(name, sizeof name, "%s/finalize", g_prefix);
        s = ts_store_barrier(g_store, name, ts_comm_size(w));
    }
    /* The watch ends (a failed world may have stopped the store's host:
     * then the wake is not answered and the watch ends by itself); a
     * duplicate RANK recorded meanwhile fails finalize on every rank. */
    if (s != TS_OK && g_store) ts_store_set_timeout(g_store, WATCH_POLL_S); /* only the wake and the close follow */
    watch_stop(g_store);
    /* When rank 0 hosts the store (mpirun, srun), it stops the server
     * only after every other rank has left its last store call; under a
     * launcher whose ranks span several nodes, rank 0 waits the same way,
     * which keeps node 0's launcher, and with it the store, up for the
     * ranks of the other nodes (g_hold_for_nodes). The other ranks read
     * the error key before they leave, rank 0 after they all have: an
     * error found there (a late duplicate RANK) fails finalize, and a
     * rank that finds one still leaves, so that rank 0 is not held. */
    if (s == TS_OK && g_store) {
        int W = ts_comm_size(w), R = ts_comm_rank(w);
        char key[sizeof g_prefix + 32];
        ts_status late = TS_OK;
        char *lerr = NULL;
        if (R != 0 && !g_server) {
            snprintf(key, sizeof key, "%s/rdv/error", g_prefix);
            lerr = read_rdv_error(g_store, key, &late);
            snprintf(key, sizeof key, "%s/left/%d", g_prefix, R);
            s = ts_store_set(g_store, key, "", 0);
        } else if ((g_server || g_hold_for_nodes) && W > 1) {
            char(*keys)[sizeof key] = ts__calloc(TS_MEM_COMM, (size_t)W - 1, sizeof key);
            const char **kp = ts__calloc(TS_MEM_COMM, (size_t)W - 1, sizeof *kp);
            if (keys && kp) {
                for (int r = 1; r < W; r++) {
                    snprintf(keys[r - 1], sizeof key, "%s/left/%d", g_prefix, r);
                    kp[r - 1] = keys[r - 1];
                }
                s = ts_store_wait(g_store, W - 1, kp);
            }
            ts__free(TS_MEM_COMM, keys);
            ts__free(TS_MEM_COMM, kp);
        }
        if (!lerr && s == TS_OK) {
            snprintf(key, sizeof key, "%s/rdv/error", g_prefix);
            lerr = read_rdv_error(g_store, key, &late);
        }
        if (lerr) {
            s = ts_error(late, "%s (found after the rendezvous; reported to rank %d)", lerr, R);
            ts__free(TS_MEM_COMM, lerr);
        }
    }
    g_world = NULL; /* the teardown below never writes the last error (docs/design.md, D1) */
    ts__world_publish(NULL);
    ts__world_free(w);
    if (g_fabric) {
        ts__loopback_fabric_free(g_fabric);
        g_fabric = NULL;
    }
    ts_store_close(g_store);
    g_store = NULL;
    ts_store_server_stop(g_server);
    g_server = NULL;
    g_hold_for_nodes = false;
    pthread_mutex_unlock(&g_mu);
    if (s != TS_OK) return ts_error(s, "ts_dist_finalize: %s", ts_last_error());
    return TS_OK;
}
