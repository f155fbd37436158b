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
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/comm_internal.h"
#include "comm/launch.h"
#include "comm/store.h"
#include "comm/transport.h"

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static ts_comm *g_world;                /* NULL when not initialized (under g_mu) */
static ts_store *g_store;               /* NULL for a world of one rank */
static ts_store_server *g_server;       /* rank 0 when no launcher hosts the store */
static ts_loopback_fabric *g_fabric;    /* the one-rank world's */
static char g_prefix[3 * TS_LAUNCH_MAX_STR];
static unsigned g_epoch;                /* inits so far: each gets its own store keys */

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

static ts_status init_locked(const ts_dist_options *o)
{
    const char *tname = o->transport && *o->transport ? o->transport : "ucx";
    double timeout_s = o->timeout_s > 0 ? o->timeout_s : 300.0;
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
    if (env.world_size == 1) return one_rank_world(timeout_s, &g_world);
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
        if (s != TS_OK) return s;
    }
    s = ts_store_connect(env.master_addr, env.master_port, env.token, timeout_s, &g_store);
    if (s != TS_OK) goto fail;
    ts_store_set_timeout(g_store, timeout_s);
    char rdv[sizeof g_prefix + 16];
    snprintf(rdv, sizeof rdv, "%s/init", g_prefix);
    s = ts_store_rendezvous(g_store, rdv, env.rank, env.world_size);
    if (s != TS_OK) goto fail;
    ts_transport *t = NULL;
    s = ts__ucx_transport_new(g_store, g_prefix, env.rank, env.world_size, timeout_s, &t);
    if (s != TS_OK) goto fail;
    s = ts__world_new(t, timeout_s, &g_world);
    if (s != TS_OK) {
        t->vt->destroy(t);
        goto fail;
    }
    return TS_OK;
fail:
    ts_store_close(g_store);
    g_store = NULL;
    ts_store_server_stop(g_server);
    g_server = NULL;
    return s;
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
    else
        s = init_locked(o);
    if (s == TS_OK) ts__world_publish(g_world);
    pthread_mutex_unlock(&g_mu);
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
     * closes its endpoints (DEPS-GUIDE §1.11). */
    if (s == TS_OK && g_store) {
        char name[sizeof g_prefix + 16];
        snprintf(name, sizeof name, "%s/finalize", g_prefix);
        s = ts_store_barrier(g_store, name, ts_comm_size(w));
    }
    /* When rank 0 hosts the store (mpirun, srun), it stops the server
     * only after every other rank has left its last store call. */
    if (s == TS_OK && g_store) {
        int W = ts_comm_size(w), R = ts_comm_rank(w);
        char key[sizeof g_prefix + 32];
        if (R != 0 && !g_server) {
            snprintf(key, sizeof key, "%s/left/%d", g_prefix, R);
            s = ts_store_set(g_store, key, "", 0);
        } else if (g_server && W > 1) {
            char(*keys)[sizeof key] = calloc((size_t)W - 1, sizeof key);
            const char **kp = calloc((size_t)W - 1, sizeof *kp);
            if (keys && kp) {
                for (int r = 1; r < W; r++) {
                    snprintf(keys[r - 1], sizeof key, "%s/left/%d", g_prefix, r);
                    kp[r - 1] = keys[r - 1];
                }
                s = ts_store_wait(g_store, W - 1, kp);
            }
            free(keys);
            free(kp);
        }
    }
    char err[512] = "";
    if (s != TS_OK) snprintf(err, sizeof err, "%s", ts_last_error());
    g_world = NULL;
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
    pthread_mutex_unlock(&g_mu);
    if (s != TS_OK) return ts_error(s, "ts_dist_finalize: %s", err);
    return TS_OK;
}
