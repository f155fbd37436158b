/*
 * Two hosts for real (issue 12 §4): network namespaces joined by a veth
 * pair, each with its own loopback, address (10.213.0.1 and .2), and IPC,
 * pid and mount namespaces (scripts/netns_hosts.sh says why), the same
 * host name on both. Each host runs its own `tsrun --nnodes 2 --node-rank
 * R --master-addr 10.213.0.1`; UCX goes over TCP between the hosts and
 * over shared memory within one. Cases: the collectives on 2 x 2 ranks;
 * fully_shard training on 2 x 2 equal to one process; HSDP on a 2 x 2
 * mesh that replicates across the hosts and shards within them (the
 * reduce-scatters stay on a host, only the all-reduce crosses); a host
 * whose ranks are all SIGKILLed fails the other within 2 s, naming them,
 * also with a busy loop on every core; a rank that gives up on a live one
 * fails that one within 2 s (the store's notice); training on 2 hosts x 1
 * rank 20 times under a busy loop on every core never fails (a slow rank
 * is not a dead one); the store refuses a client of the other host
 * without the token.
 *
 * Needs root, `ip` (iproute2) and unshare: skipped with the reason
 * otherwise. Every case creates its namespaces under a name with this
 * process's pid and removes them, with every process in them, when it
 * ends, also when it fails or times out: a guard process (its own
 * session) holds a pipe to the test and removes them at end of file.
 *
 * This binary is its own rank program (TS_TEST_MH_ROLE, run by a
 * constructor before Criterion starts).
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "comm/comm_internal.h" /* ts__comm_set_timeout */
#include "comm/store.h"
#include "tests/helpers.h"

#define NS_SCRIPT TS_SOURCE_DIR "/scripts/netns_hosts.sh"
#define TSRUN TS_BUILD_DIR "/tools/tsrun"
#define HOST0 "10.213.0.1"
#define HOST1 "10.213.0.2"
#define PORT "29500" /* the namespaces are new: nothing else listens there */
#define TOKEN "mh-test-token-5d1e"

extern char **environ;

/* ------------------------------------------------------------ rank side */

static int g_rank = -1;
#define RFAIL(code, ...) th_rank_exit(g_rank, (code), __VA_ARGS__)
#define ROK(code, expr) TH_RANK_OK(code, expr)

static ts_tensor *vec(int64_t n)
{
    ts_tensor *t = NULL;
    ROK(20, ts_tensor_zeros(TS_F32, 1, &n, &t));
    return t;
}

/* Exact integers in float32 (below 2^24): every result must be equal. */
static void expect(const char *what, int64_t n, const float *got, float (*want)(int64_t, void *), void *ctx)
{
    for (int64_t i = 0; i < n; i++)
        if (got[i] != want(i, ctx))
            RFAIL(21, "%s[%lld] = %g, expected %g", what, (long long)i, (double)got[i], (double)want(i, ctx));
}

typedef struct cctx {
    int W, r;
    int64_t n;
} cctx;
static float ar_want(int64_t i, void *c)
{
    const cctx *x = c;
    return (float)(x->W * (x->W + 1) / 2 + x->W * (i % 7));
}
static float ag_want(int64_t i, void *c)
{
    const cctx *x = c;
    return (float)((i / x->n) * 1000 + i % x->n % 100);
}
static float rs_want(int64_t i, void *c)
{
    const cctx *x = c; /* rank q's input element j is q + j % 5; this rank receives block r */
    int64_t j = x->r * x->n + i;
    return (float)(x->W * (x->W - 1) / 2 + x->W * (j % 5));
}
static float bc_want(int64_t i, void *c)
{
    (void)c;
    return (float)(3 * 10 + i % 11);
}

/* The collectives on the world, small (eager) and large (rendezvous, and
 * the shared-memory bypass between the ranks of one host), and a send
 * from rank 0 to rank 3 (the other host). */
static void role_coll(void)
{
    ts_dist_options o = ts_dist_options_default();
    o.timeout_s = 60;
    ROK(10, ts_dist_init(&o));
    ts_comm *c = ts_dist_world();
    g_rank = ts_comm_rank(c);
    int W = ts_comm_size(c);
    if (W != 4) RFAIL(11, "world of %d, expected 4", W);
    const int64_t ns[2] = {1000, 300000}; /* 4 KB and 1.2 MB per rank */
    for (int k = 0; k < 2; k++) {
        int64_t n = ns[k];
        cctx x = {W, g_rank, n};
        ts_tensor *t = vec(n);
        float *p = ts_tensor_data(t);
        for (int64_t i = 0; i < n; i++) p[i] = (float)(g_rank + 1 + i % 7);
        ROK(12, ts_all_reduce(c, t, TS_REDUCE_SUM, NULL));
        expect("all_reduce", n, p, ar_want, &x);

        ts_tensor *out = vec(W * n);
        for (int64_t i = 0; i < n; i++) p[i] = (float)(g_rank * 1000 + i % 100);
        ROK(13, ts_all_gather_into_tensor(c, out, t, NULL));
        expect("all_gather", W * n, ts_tensor_data(out), ag_want, &x);

        float *q = ts_tensor_data(out);
        for (int64_t j = 0; j < W * n; j++) q[j] = (float)(g_rank + j % 5);
        ROK(14, ts_reduce_scatter_tensor(c, t, out, TS_REDUCE_SUM, 1.0, 1.0, NULL));
        expect("reduce_scatter", n, p, rs_want, &x);

        for (int64_t i = 0; i < n; i++) p[i] = (float)(g_rank * 10 + i % 11);
        ROK(15, ts_broadcast(c, t, 3, NULL));
        expect("broadcast from rank 3", n, p, bc_want, &x);

        if (g_rank == 0 || g_rank == 3) {
            for (int64_t i = 0; i < n; i++) p[i] = g_rank == 0 ? (float)(3 * 10 + i % 11) : -1.0f;
            if (g_rank == 0) ROK(16, ts_send(c, t, 3, 7, NULL));
            else ROK(16, ts_recv(c, t, 0, 7, NULL));
            expect("recv from rank 0", n, p, bc_want, &x);
        }
        ts_tensor_free(t);
        ts_tensor_free(out);
    }
    ROK(17, ts_dist_finalize());
    printf("coll-ok %d\n", g_rank);
    fflush(stdout);
    exit(0); /* not _exit: LeakSanitizer checks the rank at exit */
}

/* ---- training ---- */

enum { D = 16, H = 24, NMLP = 3, NP = 2 + 4 * NMLP, B = 3, STEPS = 3 };

/* Sequential(Linear(D, D), MLP x NMLP), MLP = Sequential(Linear(D, H),
 * Tanh, Linear(H, D)); the MLPs sharded, then the root (mesh NULL: not
 * sharded at all); SGD with momentum. */
static void model_new(ts_mesh *mesh, bool shard, ts_module **root, ts_optim **opt)
{
    ts_manual_seed(11);
    ts_module *c[1 + NMLP] = {0};
    ROK(30, ts_linear_new(D, D, true, &c[0]));
    for (int i = 0; i < NMLP; i++) {
        ts_module *l[3] = {0};
        ROK(30, ts_linear_new(D, H, true, &l[0]));
        ROK(30, ts_tanh_new(&l[1]));
        ROK(30, ts_linear_new(H, D, true, &l[2]));
        ROK(30, ts_sequential_new(3, l, &c[1 + i]));
    }
    ROK(30, ts_sequential_new(1 + NMLP, c, root));
    if (shard) {
        ts_fsdp_options o = ts_fsdp_options_default();
        o.mesh = mesh;
        ROK(31, ts_fully_shard_each(NMLP, &c[1], &o));
        ROK(31, ts_fully_shard(*root, &o));
    }
    ts_tensor *ps[NP];
    ROK(32, th_param_slots(*root, NP, ps));
    ts_sgd_options so = ts_sgd_options_default();
    so.lr = 0.05;
    so.momentum = 0.9;
    ROK(33, ts_sgd_new(NP, ps, &so, opt));
}

static void step(ts_module *root, ts_optim *opt, int64_t row0, int64_t rows)
{
    ts_tensor *x = th_batch(row0, rows, D, th_xval), *y = th_batch(row0, rows, D, th_yval);
    ts_tensor *o = NULL, *loss = NULL;
    if (!x || !y) RFAIL(40, "batch");
    ROK(41, ts_module_call1(root, x, &o));
    ROK(41, ts_mse_loss(o, y, TS_REDUCTION_MEAN, &loss));
    ROK(41, ts_backward(loss, NULL, false));
    ROK(42, ts_optim_step(opt));
    ts_optim_zero_grad(opt, true);
    ts_tensor_free(x);
    ts_tensor_free(y);
    ts_tensor_free(o);
    ts_tensor_free(loss);
}

/* The node (host) of each rank of group g, gathered over g. */
static void nodes_of(ts_comm *g, float *out)
{
    const char *gr = getenv("GROUP_RANK");
    int64_t one = 1, n = ts_comm_size(g);
    ts_tensor *me = NULL, *all = NULL;
    ROK(50, ts_tensor_full(TS_F32, 1, &one, gr ? atof(gr) : -1.0, &me));
    ROK(50, ts_tensor_zeros(TS_F32, 1, &n, &all));
    ROK(50, ts_all_gather_into_tensor(g, all, me, NULL));
    memcpy(out, ts_tensor_data(all), (size_t)n * sizeof *out);
    ts_tensor_free(me);
    ts_tensor_free(all);
}

/* Tolerance of sharded (W ranks) against one process (the whole batch):
 * a gradient element is the mean over W * B = 12 rows; the reference sums
 * the 12 per-row terms in one pass, the ranks sum 3 on each rank and then
 * the 4 partial sums (2 then 2 under HSDP), so each step's gradient may
 * differ by the reordering of a 12-term float32 sum: about 12 * 6e-8 *
 * sum|terms| (terms around 1e-2 that cancel to 1e-3: ~1e-7 relative to
 * sum|terms|, 1e-6 of the gradient). SGD with lr 0.05 and momentum 0.9
 * over 3 steps moves a parameter by at most ~0.3 of its gradients, so the
 * parameters differ by far less than 1e-6 absolute; the check allows
 * 1e-5 relative plus 1e-6 absolute. A lost or doubled rank's rows change
 * the mean gradient by a quarter and the parameters by ~1e-3: it fails. */
#define TRAIN_RTOL 1e-5
#define TRAIN_ATOL 1e-6

static void role_train(void)
{
    bool hsdp = getenv("TS_TEST_MH_HSDP") && atoi(getenv("TS_TEST_MH_HSDP"));
    int want_w = getenv("TS_TEST_MH_WORLD") ? atoi(getenv("TS_TEST_MH_WORLD")) : 4;
    ts_dist_options o = ts_dist_options_default();
    o.timeout_s = 60;
    ROK(10, ts_dist_init(&o));
    ts_comm *w = ts_dist_world();
    g_rank = ts_comm_rank(w);
    int W = ts_comm_size(w);
    if (W != want_w || (hsdp && W != 4)) RFAIL(11, "world of %d, expected %d", W, hsdp ? 4 : want_w);
    ts_mesh *mesh = NULL;
    if (hsdp) {
        int64_t shape[2] = {2, 2};
        const char *names[2] = {"replicate", "shard"};
        ROK(12, ts_mesh_new(w, "cpu", 2, shape, names, &mesh));
    } else {
        int64_t shape[1] = {W};
        const char *names[1] = {"dp"};
        ROK(12, ts_mesh_new(w, "cpu", 1, shape, names, &mesh));
    }
    ts_module *ref = NULL, *m = NULL;
    ts_optim *ref_opt = NULL, *opt = NULL;
    model_new(NULL, false, &ref, &ref_opt);
    model_new(mesh, true, &m, &opt);
    ts_comm *pg = ts_mesh_group(mesh, hsdp ? "shard" : "dp"), *rg = hsdp ? ts_mesh_group(mesh, "replicate") : NULL;
    ts_comm_stats_reset(pg);
    if (rg) ts_comm_stats_reset(rg);
    for (int s = 0; s < STEPS; s++) {
        int64_t base = (int64_t)s * W * B;
        step(ref, ref_opt, base, (int64_t)W * B);    /* one process: the whole batch */
        step(m, opt, base + (int64_t)g_rank * B, B); /* this rank's rows */
    }
    if (hsdp) {
        /* the reduce-scatters and all-gathers stay on one host, the
         * all-reduce crosses: the shard group is one host's ranks, the
         * replicate group one rank of each host */
        ts_comm_counters cp, cr;
        ts_comm_stats(pg, &cp);
        ts_comm_stats(rg, &cr);
        float pn[2], rn[2];
        nodes_of(pg, pn);
        nodes_of(rg, rn);
        if (pn[0] != pn[1] || pn[0] < 0)
            RFAIL(13, "the shard group spans nodes %g and %g", (double)pn[0], (double)pn[1]);
        if (rn[0] == rn[1]) RFAIL(13, "the replicate group is on node %g alone", (double)rn[0]);
        if (cp.calls[TS_COLL_REDUCE_SCATTER] != (uint64_t)STEPS * (NMLP + 1) || cp.calls[TS_COLL_ALL_REDUCE] != 0 ||
            cr.calls[TS_COLL_ALL_REDUCE] != (uint64_t)STEPS * (NMLP + 1) || cr.calls[TS_COLL_REDUCE_SCATTER] != 0 ||
            cr.calls[TS_COLL_ALL_GATHER] != 0)
            RFAIL(14,
                  "shard group: %llu reduce-scatters, %llu all-reduces; replicate group: %llu all-reduces, %llu "
                  "reduce-scatters, %llu all-gathers (expected %d, 0; %d, 0, 0)",
                  (unsigned long long)cp.calls[TS_COLL_REDUCE_SCATTER],
                  (unsigned long long)cp.calls[TS_COLL_ALL_REDUCE], (unsigned long long)cr.calls[TS_COLL_ALL_REDUCE],
                  (unsigned long long)cr.calls[TS_COLL_REDUCE_SCATTER],
                  (unsigned long long)cr.calls[TS_COLL_ALL_GATHER], STEPS * (NMLP + 1), STEPS * (NMLP + 1));
        printf("hsdp rank %d: shard group on node %g (%llu reduce-scatters, %llu bytes), replicate group across nodes "
               "%g and %g (%llu all-reduces, %llu bytes)\n",
               g_rank, (double)pn[0], (unsigned long long)cp.calls[TS_COLL_REDUCE_SCATTER],
               (unsigned long long)cp.bytes[TS_COLL_REDUCE_SCATTER], (double)rn[0], (double)rn[1],
               (unsigned long long)cr.calls[TS_COLL_ALL_REDUCE], (unsigned long long)cr.bytes[TS_COLL_ALL_REDUCE]);
    }
    ts_state_dict *sd = NULL, *rsd = NULL;
    ROK(15, ts_fsdp_full_state_dict(m, false, &sd));
    ROK(15, ts_module_state_dict(ref, &rsd));
    if (ts_state_dict_size(sd) != ts_state_dict_size(rsd))
        RFAIL(16, "%d tensors in the state dict, %d in the reference's", ts_state_dict_size(sd),
              ts_state_dict_size(rsd));
    double worst = 0;
    for (int i = 0; i < ts_state_dict_size(rsd); i++) {
        const char *name = ts_state_dict_name(rsd, i);
        ts_tensor *a = ts_state_dict_tensor(rsd, i), *b = ts_state_dict_get(sd, name);
        if (!b || ts_tensor_numel(a) != ts_tensor_numel(b)) RFAIL(17, "'%s' missing or of another size", name);
        const float *pa = ts_tensor_data(a), *pb = ts_tensor_data(b);
        for (int64_t k = 0; k < ts_tensor_numel(a); k++) {
            double d = fabs((double)pa[k] - (double)pb[k]);
            worst = d > worst ? d : worst;
            if (!(d <= TRAIN_ATOL + TRAIN_RTOL * fabs((double)pa[k])))
                RFAIL(18, "'%s'[%lld]: %.9g sharded on %d ranks vs %.9g in one process", name, (long long)k,
                      (double)pb[k], W, (double)pa[k]);
        }
    }
    ts_state_dict_free(sd);
    ts_state_dict_free(rsd);
    ts_optim_free(opt);
    ts_optim_free(ref_opt);
    ts_module_free(m);
    ts_module_free(ref);
    ts_mesh_free(mesh);
    ROK(19, ts_dist_finalize());
    printf("train-ok %d (largest difference %.3g)\n", g_rank, worst);
    fflush(stdout);
    exit(0);
}

/* Trains until a collective fails (the test kills the other host's
 * ranks): prints "steady" once (rank 0, after 3 steps), then on failure
 * "survivor R: STATUS: detail" and exits 3 at once. Ignores SIGTERM. */
static void role_kill(void)
{
    /* tsrun stops the other ranks (SIGTERM) when one fails: each survivor
     * reports its own failure instead */
    signal(SIGTERM, SIG_IGN);
    ts_dist_options o = ts_dist_options_default();
    o.timeout_s = 60;
    ROK(10, ts_dist_init(&o));
    ts_comm *w = ts_dist_world();
    g_rank = ts_comm_rank(w);
    ts_module *m = NULL;
    ts_optim *opt = NULL;
    model_new(NULL, true, &m, &opt);
    for (int s = 0; s < 100000; s++) {
        ts_tensor *x = th_batch((int64_t)s * B, B, D, th_xval), *y = th_batch((int64_t)s * B, B, D, th_yval);
        ts_tensor *out = NULL, *loss = NULL;
        ts_status st = ts_module_call1(m, x, &out);
        if (!st) st = ts_mse_loss(out, y, TS_REDUCTION_MEAN, &loss);
        if (!st) st = ts_backward(loss, NULL, false);
        if (!st) st = ts_optim_step(opt);
        if (st) {
            fprintf(stderr, "survivor %d: %s: %s\n", g_rank, ts_status_name(st), ts_last_error());
            fflush(stderr);
            _exit(3);
        }
        ts_optim_zero_grad(opt, true);
        ts_tensor_free(x);
        ts_tensor_free(y);
        ts_tensor_free(out);
        ts_tensor_free(loss);
        if (s == 3 && g_rank == 0) {
            printf("steady\n");
            fflush(stdout);
        }
    }
    RFAIL(34, "no failure seen");
}

/* Rank 1 gives up on rank 0 while rank 0 is alive but late: its barrier
 * has a 1 s deadline, rank 0 enters collectives only 2.5 s after the
 * world formed (lateness is the scenario, not a wait for an event). Rank
 * 1 prints "gave-up 1: STATUS: detail" and stays alive (a rank that
 * writes a checkpoint, or is slow to exit: its endpoints stay up, so no
 * connection reset tells rank 0). Rank 0 runs barriers (deadline 60 s)
 * until one fails and prints "late 0: STATUS: detail (T s)", T the
 * seconds from its first barrier to the failure, then exits 3. */
static void role_giveup(void)
{
    ts_dist_options o = ts_dist_options_default();
    o.timeout_s = 60;
    ROK(10, ts_dist_init(&o));
    ts_comm *w = ts_dist_world();
    g_rank = ts_comm_rank(w);
    if (ts_comm_size(w) != 2) RFAIL(11, "world of %d, expected 2", ts_comm_size(w));
    if (g_rank == 1) {
        ts__comm_set_timeout(w, 1.0);
        ts_status st = ts_barrier(w, NULL);
        printf("gave-up 1: %s: %s\n", ts_status_name(st), st ? ts_last_error() : "the barrier completed");
        fflush(stdout);
        double until = th_now_s() + 30; /* alive; the test ends it */
        while (th_now_s() < until) pause();
        _exit(0);
    }
    struct timespec late = {2, 500000000};
    while (nanosleep(&late, &late) != 0 && errno == EINTR)
        ;
    double t0 = th_now_s();
    ts_status st = TS_OK;
    for (int i = 0; i < 1000 && st == TS_OK; i++) st = ts_barrier(w, NULL);
    printf("late 0: %s: %s (%.3f s)\n", ts_status_name(st), st ? ts_last_error() : "1000 barriers completed",
           th_now_s() - t0);
    fflush(stdout);
    _exit(3);
}

/* Host 0: a store on HOST0:PORT with TS_TEST_MH_STORE_TOKEN ("" for
 * none), holding "k" = "v"; prints "ready"; stops at end of stdin. */
static void role_store_server(void)
{
    const char *tok = getenv("TS_TEST_MH_STORE_TOKEN");
    ts_store_server *srv = NULL;
    ROK(60, ts_store_server_start(HOST0, atoi(PORT), tok, &srv));
    ts_store *c = NULL;
    ROK(61, ts_store_connect(HOST0, atoi(PORT), tok, 10.0, &c)); /* its own host: served */
    ROK(62, ts_store_set(c, "k", "v", 1));
    ts_store_close(c);
    printf("ready\n");
    fflush(stdout);
    char buf[64];
    while (read(0, buf, sizeof buf) > 0)
        ;
    ts_store_server_stop(srv);
    exit(0);
}

/* Host 1: connects with TS_TEST_MH_CLIENT_TOKEN (unset: NULL, the
 * environment's none) and prints "client: STATUS: detail", then the
 * value of "k" when served. */
static void role_store_client(void)
{
    const char *tok = getenv("TS_TEST_MH_CLIENT_TOKEN");
    ts_store *c = NULL;
    ts_status s = ts_store_connect(HOST0, atoi(PORT), tok ? tok : "", 10.0, &c);
    printf("client: %s: %s\n", ts_status_name(s), s ? ts_last_error() : "connected");
    if (s == TS_OK) {
        void *v = NULL;
        size_t n = 0;
        ts_store_set_timeout(c, 10.0);
        s = ts_store_get(c, "k", &v, &n);
        printf("get k: %s: %.*s\n", ts_status_name(s), s ? 0 : (int)n, s ? "" : (char *)v);
        ts_store_value_free(v);
        ts_store_close(c);
    }
    fflush(stdout);
    exit(0);
}

__attribute__((constructor)) static void rank_main(void)
{
    const char *role = getenv("TS_TEST_MH_ROLE");
    if (!role) return;
    unsetenv("TS_TEST_MH_ROLE"); /* not inherited by anything this process starts */
    if (!strcmp(role, "coll")) role_coll();
    if (!strcmp(role, "train")) role_train();
    if (!strcmp(role, "kill")) role_kill();
    if (!strcmp(role, "giveup")) role_giveup();
    if (!strcmp(role, "store_server")) role_store_server();
    if (!strcmp(role, "store_client")) role_store_client();
    fprintf(stderr, "unknown TS_TEST_MH_ROLE '%s'\n", role);
    _exit(99);
}

/* ------------------------------------------------------------ test side */

typedef struct hosts {
    char name[48];
    pid_t guard;
    int guard_w; /* the guard removes the hosts at end of file */
} hosts;

/* Runs argv, output to a memfd; returns its exit status (-1 when not
 * exited) and the output in *out (malloc'd). */
static int run_capture(char *const argv[], char **out)
{
    int fd = memfd_create("mh-run", MFD_CLOEXEC);
    cr_assert_geq(fd, 0);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, fd, 1);
    posix_spawn_file_actions_adddup2(&fa, fd, 2);
    pid_t pid;
    int e = posix_spawn(&pid, argv[0], &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    cr_assert_eq(e, 0, "cannot start %s: %s", argv[0], strerror(e));
    int st = 0;
    while (waitpid(pid, &st, 0) < 0 && errno == EINTR)
        ;
    *out = th_slurp_fd(fd);
    close(fd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* Two hosts, or the test is skipped saying why. */
static void hosts_up(hosts *h)
{
    static int seq;
    memset(h, 0, sizeof *h);
    h->guard = -1;
    h->guard_w = -1;
    if (geteuid() != 0)
        cr_skip_test("multi-host tests need root (network namespaces); running as uid %d", (int)geteuid());
    char *out = NULL;
    char *check[] = {NS_SCRIPT, "check", NULL};
    int rc = run_capture(check, &out);
    if (rc == 77) {
        out[strcspn(out, "\n")] = '\0';
        cr_skip_test("multi-host tests need network namespaces: %s", out);
    }
    cr_assert_eq(rc, 0, "netns_hosts.sh check: status %d: %s", rc, out);
    free(out);
    char *reap[] = {NS_SCRIPT, "reap", NULL}; /* namespaces of runs that were killed */
    rc = run_capture(reap, &out);
    free(out);
    snprintf(h->name, sizeof h->name, "tsmh-p%d-%d", (int)getpid(), seq++);
    int p[2];
    cr_assert_eq(pipe2(p, O_CLOEXEC), 0);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, p[0], 0);
    posix_spawnattr_t at;
    posix_spawnattr_init(&at);
    posix_spawnattr_setflags(&at, POSIX_SPAWN_SETSID); /* outlives a killed test */
    char *guard[] = {"/bin/sh", "-c", "cat >/dev/null; exec \"$0\" down \"$1\"", NS_SCRIPT, h->name, NULL};
    int e = posix_spawn(&h->guard, "/bin/sh", &fa, &at, guard, environ);
    posix_spawn_file_actions_destroy(&fa);
    posix_spawnattr_destroy(&at);
    close(p[0]);
    cr_assert_eq(e, 0, "cannot start the guard: %s", strerror(e));
    h->guard_w = p[1];
    char *up[] = {NS_SCRIPT, "up", h->name, "2", NULL};
    rc = run_capture(up, &out);
    cr_assert_eq(rc, 0, "netns_hosts.sh up %s 2: status %d: %s", h->name, rc, out);
    free(out);
}

/* Removes the hosts and every process in them (the guard does it). */
static void hosts_down(hosts *h)
{
    if (h->guard_w >= 0) close(h->guard_w);
    h->guard_w = -1;
    if (h->guard > 0)
        while (waitpid(h->guard, NULL, 0) < 0 && errno == EINTR)
            ;
    h->guard = -1;
}

/* Starts argv on host `host` with the job's environment plus env[]
 * (NULL-terminated), stdout and stderr into out_fd, stdin from in_fd
 * (-1: /dev/null). */
static pid_t host_run(const hosts *h, int host, char *const env[], int out_fd, int in_fd, char *const argv[])
{
    size_t ne = 0, nx = 0, na = 0;
    while (env[nx]) nx++;
    while (argv[na]) na++;
    char **envp = th_job_environ(nx, &ne);
    for (size_t i = 0; i < nx; i++) envp[ne + i] = env[i];
    envp[ne + nx] = NULL;
    char hs[8];
    snprintf(hs, sizeof hs, "%d", host);
    char **full = calloc(na + 5, sizeof *full);
    cr_assert_not_null(full);
    full[0] = NS_SCRIPT, full[1] = "run", full[2] = (char *)h->name, full[3] = hs;
    for (size_t i = 0; i < na; i++) full[4 + i] = argv[i];
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, out_fd, 1);
    posix_spawn_file_actions_adddup2(&fa, out_fd, 2);
    if (in_fd >= 0) posix_spawn_file_actions_adddup2(&fa, in_fd, 0);
    else posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    pid_t pid;
    int e = posix_spawn(&pid, NS_SCRIPT, &fa, NULL, full, envp);
    posix_spawn_file_actions_destroy(&fa);
    free(full);
    free(envp);
    cr_assert_eq(e, 0, "cannot start host %d's command: %s", host, strerror(e));
    return pid;
}

/* Starts `tsrun --nnodes 2 --node-rank R --nproc-per-node NPROC
 * --master-addr HOST0` running this binary on each host, with env[],
 * output into fds[R]. */
static void start_job(const hosts *h, char *const env[], const char *nproc, int fds[2], pid_t pids[2])
{
    for (int r = 0; r < 2; r++) {
        fds[r] = memfd_create("mh-host", MFD_CLOEXEC);
        cr_assert_geq(fds[r], 0);
        char *argv[] = {TSRUN,         "--nnodes",      "2",   "--node-rank",   r ? "1" : "0", "--nproc-per-node",
                        (char *)nproc, "--master-addr", HOST0, "--master-port", PORT,          th_self_exe(),
                        NULL};
        pids[r] = host_run(h, r, env, fds[r], -1, argv);
    }
}

/* start_job with 2 ranks per host; waits for both (limit_s) and returns
 * their exit codes and outputs. */
static void run_job(const hosts *h, char *const env[], double limit_s, int code[2], char *out[2])
{
    int fds[2];
    pid_t pids[2];
    start_job(h, env, "2", fds, pids);
    int st[2];
    th_wait_pids(pids, 2, -1, limit_s, st);
    for (int r = 0; r < 2; r++) {
        code[r] = WIFEXITED(st[r]) ? WEXITSTATUS(st[r]) : 128 + WTERMSIG(st[r]);
        out[r] = th_slurp_fd(fds[r]);
        close(fds[r]);
        fprintf(stderr, "---- host %d (status %d)\n%s", r, code[r], out[r]);
    }
}

/* Both hosts' jobs exited 0 and each of their two ranks printed
 * "<tag> <rank>". */
static void expect_each_rank(const int code[2], char *const out[2], const char *tag)
{
    for (int r = 0; r < 2; r++) {
        cr_assert_eq(code[r], 0, "host %d: status %d", r, code[r]);
        for (int k = 0; k < 2; k++) {
            char want[48];
            snprintf(want, sizeof want, "%s %d", tag, 2 * r + k);
            cr_assert_not_null(strstr(out[r], want), "host %d lacks '%s'", r, want);
        }
    }
}

Test(comm_multihost, collectives_on_two_hosts_of_two_ranks, .timeout = 90)
{
    hosts h;
    hosts_up(&h);
    char *env[] = {"TS_TEST_MH_ROLE=coll", "TS_STORE_TOKEN=" TOKEN, "TS_LOG_LEVEL=info", NULL};
    int code[2];
    char *out[2];
    run_job(&h, env, 60, code, out);
    hosts_down(&h);
    expect_each_rank(code, out, "coll-ok");
    /* each rank takes its host's other rank for a same-host peer (shared
     * memory and the bypass) and the other host's ranks for remote ones,
     * although both hosts have the same host name */
    static const char *const verdicts[4] = {"ucx: rank 0: same host: [1(bypass)]; other hosts: [2 3]",
                                            "ucx: rank 1: same host: [0(bypass)]; other hosts: [2 3]",
                                            "ucx: rank 2: same host: [3(bypass)]; other hosts: [0 1]",
                                            "ucx: rank 3: same host: [2(bypass)]; other hosts: [0 1]"};
    for (int r = 0; r < 4; r++)
        cr_assert_not_null(strstr(out[r / 2], verdicts[r]), "host %d lacks '%s'", r / 2, verdicts[r]);
    free(out[0]);
    free(out[1]);
}

static void train_case(bool hsdp)
{
    hosts h;
    hosts_up(&h);
    char *env[] = {"TS_TEST_MH_ROLE=train", hsdp ? "TS_TEST_MH_HSDP=1" : "TS_TEST_MH_HSDP=0", "TS_STORE_TOKEN=" TOKEN,
                   NULL};
    int code[2];
    char *out[2];
    run_job(&h, env, 60, code, out);
    hosts_down(&h);
    expect_each_rank(code, out, "train-ok");
    if (hsdp) expect_each_rank(code, out, "hsdp rank");
    free(out[0]);
    free(out[1]);
}

/* fully_shard over the 4 ranks of 2 hosts: the parameters after 3 SGD
 * steps equal those of one process that trains the unsharded model on
 * the whole batch (each rank checks, TRAIN_RTOL). */
Test(comm_multihost, fully_shard_on_two_hosts_equals_one_process, .timeout = 90) { train_case(false); }

/* HSDP on a (replicate 2, shard 2) mesh: shards within a host, replicas
 * across; equal to one process, and every reduce-scatter (and
 * all-gather) is in the host's shard group, every all-reduce in the
 * cross-host replicate group. */
Test(comm_multihost, hsdp_shards_within_hosts_and_replicates_across, .timeout = 90) { train_case(true); }

/* The pids (this machine's numbering) of the ranks on host `host`: the
 * processes of its network namespace that run this binary. */
static int host_rank_pids(const hosts *h, int host, pid_t *pids, int cap)
{
    char ns[64], path[80], exe[4096];
    snprintf(ns, sizeof ns, "/run/netns/%s-h%d", h->name, host);
    struct stat want;
    cr_assert_eq(stat(ns, &want), 0, "%s: %s", ns, strerror(errno));
    const char *self = th_self_exe();
    int n = 0;
    DIR *d = opendir("/proc");
    cr_assert_not_null(d);
    for (struct dirent *e; (e = readdir(d)) && n < cap;) {
        int pid = atoi(e->d_name);
        if (pid <= 0 || pid == (int)getpid()) continue;
        struct stat st;
        snprintf(path, sizeof path, "/proc/%d/ns/net", pid);
        if (stat(path, &st) != 0 || st.st_ino != want.st_ino || st.st_dev != want.st_dev) continue;
        snprintf(path, sizeof path, "/proc/%d/exe", pid);
        ssize_t k = readlink(path, exe, sizeof exe - 1);
        if (k <= 0) continue;
        exe[k] = '\0';
        if (strcmp(exe, self) == 0) pids[n++] = pid;
    }
    closedir(d);
    return n;
}

/* Every rank of host 1 is SIGKILLed mid-training (a host lost): host 0's
 * ranks fail with TS_ERR_PEER_FAILED naming a rank of host 1, and host
 * 0's tsrun exits non-zero, within 2 s of the kill. */
static int start_load(pid_t *pids, int cap);
static void stop_load(const pid_t *pids, int n);

/* with_load: a busy loop on every core throughout */
static void kill_case(bool with_load)
{
    hosts h;
    hosts_up(&h);
    pid_t load[64];
    int nload = with_load ? start_load(load, 64) : 0;
    char *env[] = {"TS_TEST_MH_ROLE=kill", "TS_STORE_TOKEN=" TOKEN, NULL};
    int fds[2];
    pid_t pids[2];
    for (int r = 0; r < 2; r++) {
        fds[r] = memfd_create("mh-host", MFD_CLOEXEC);
        cr_assert_geq(fds[r], 0);
        char *argv[] = {TSRUN, "--nnodes",      "2",   "--node-rank",   r ? "1" : "0", "--nproc-per-node",
                        "2",   "--master-addr", HOST0, "--master-port", PORT,          th_self_exe(),
                        NULL};
        pids[r] = host_run(&h, r, env, fds[r], -1, argv);
    }
    /* training is under way once rank 0 says "steady" */
    double until = th_now_s() + 60;
    bool steady = false;
    while (!steady && th_now_s() < until) {
        char buf[4096];
        ssize_t k = pread(fds[0], buf, sizeof buf - 1, 0);
        buf[k > 0 ? k : 0] = '\0';
        steady = strstr(buf, "[0] steady") != NULL;
        if (!steady) usleep(20000);
    }
    cr_assert(steady, "rank 0 did not train 3 steps within 60 s");
    pid_t victims[8];
    int nv = host_rank_pids(&h, 1, victims, 8);
    cr_assert_eq(nv, 2, "%d ranks found on host 1, expected 2", nv);
    double t0 = th_now_s();
    for (int i = 0; i < nv; i++) kill(victims[i], SIGKILL);
    int st[2];
    th_wait_pids(pids, 1, -1, 30, st); /* host 0 */
    double took = th_now_s() - t0;
    stop_load(load, nload);
    th_wait_pids(pids + 1, 1, -1, 30, st + 1);
    char *out[2];
    for (int r = 0; r < 2; r++) {
        out[r] = th_slurp_fd(fds[r]);
        close(fds[r]);
        fprintf(stderr, "---- host %d (status 0x%x)\n%s", r, st[r], out[r]);
    }
    hosts_down(&h);
    fprintf(stderr, "host 0 ended %.3f s after the kill\n", took);
    cr_assert(WIFEXITED(st[0]) && WEXITSTATUS(st[0]) != 0, "host 0's tsrun: status 0x%x", st[0]);
    cr_assert(WIFEXITED(st[1]) && WEXITSTATUS(st[1]) == 128 + SIGKILL, "host 1's tsrun: status 0x%x", st[1]);
    for (int r = 0; r < 2; r++) {
        char want[64];
        snprintf(want, sizeof want, "[%d] survivor %d: TS_ERR_PEER_FAILED", r, r);
        const char *line = strstr(out[0], want);
        cr_assert_not_null(line, "host 0 lacks '%s'", want);
        size_t len = strcspn(line, "\n");
        char *l = strndup(line, len);
        cr_assert(strstr(l, "rank 2") || strstr(l, "rank 3"), "rank %d's error names neither rank 2 nor 3: %s", r, l);
        free(l);
    }
    cr_assert_not_null(strstr(out[0], "tsrun: rank"), "host 0's tsrun names no rank");
    cr_assert_lt(took, 2.0, "host 0 ended %.2f s after host 1's ranks were killed (limit 2 s)", took);
    free(out[0]);
    free(out[1]);
}

Test(comm_multihost, a_host_whose_ranks_are_killed_fails_the_other_within_2s, .timeout = 90) { kill_case(false); }

/* The same with a busy loop on every core: a real death is still seen at
 * once under the load that must not make a live rank look dead. */
Test(comm_multihost, a_killed_host_fails_the_other_within_2s_under_full_cpu_load, .timeout = 90) { kill_case(true); }

/* Host 0 runs a store; a client on host 1 is refused without the token
 * and with a wrong one, and served with it; a store without a token
 * refuses host 1 outright (it serves only its own host: the client's
 * socket is not in host 0's /proc/net/tcp, although it is the same user). */
static void store_case(const char *server_token, const char *const *client_tokens, const char *const *want, int n)
{
    hosts h;
    hosts_up(&h);
    char tok_env[96];
    snprintf(tok_env, sizeof tok_env, "TS_TEST_MH_STORE_TOKEN=%s", server_token);
    char *senv[] = {"TS_TEST_MH_ROLE=store_server", tok_env, NULL};
    int sfd = memfd_create("mh-server", MFD_CLOEXEC), p[2];
    cr_assert_geq(sfd, 0);
    cr_assert_eq(pipe2(p, O_CLOEXEC), 0);
    char *sargv[] = {th_self_exe(), NULL};
    pid_t server = host_run(&h, 0, senv, sfd, p[0], sargv);
    close(p[0]);
    for (int i = 0; i < n; i++) {
        char cenv_tok[96];
        snprintf(cenv_tok, sizeof cenv_tok, "TS_TEST_MH_CLIENT_TOKEN=%s", client_tokens[i]);
        char *cenv[] = {"TS_TEST_MH_ROLE=store_client", cenv_tok, NULL};
        int cfd = memfd_create("mh-client", MFD_CLOEXEC);
        cr_assert_geq(cfd, 0);
        pid_t client = host_run(&h, 1, cenv, cfd, -1, sargv);
        int st = 0;
        th_wait_pids(&client, 1, -1, 30, &st);
        char *out = th_slurp_fd(cfd);
        close(cfd);
        fprintf(stderr, "client with token '%s': %s", client_tokens[i], out);
        cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "client: status 0x%x: %s", st, out);
        cr_assert_not_null(strstr(out, want[i]), "client with token '%s': expected '%s', got: %s", client_tokens[i],
                           want[i], out);
        free(out);
    }
    close(p[1]); /* the server stops */
    int st = 0;
    th_wait_pids(&server, 1, -1, 30, &st);
    char *sout = th_slurp_fd(sfd);
    close(sfd);
    hosts_down(&h);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "server: status 0x%x: %s", st, sout);
    free(sout);
}

Test(comm_multihost, the_store_refuses_the_other_host_without_the_token, .timeout = 90)
{
    const char *toks[3] = {"", "not-" TOKEN, TOKEN};
    const char *want[3] = {"client: TS_ERR_COMM", "client: TS_ERR_COMM", "get k: TS_OK: v"};
    store_case(TOKEN, toks, want, 3);
}

Test(comm_multihost, a_store_without_a_token_refuses_the_other_host, .timeout = 90)
{
    const char *toks[1] = {""};
    const char *want[1] = {"client: TS_ERR_COMM"};
    store_case("", toks, want, 1);
}

/* Rank 1 (host 1) gives up on rank 0 (its barrier's deadline) while rank
 * 0 is alive and rank 1 stays alive: rank 0 fails too, at its next
 * collective and not at its own 60 s deadline, naming rank 1, with rank
 * 1's status (the store carries rank 1's notice: docs/multihost.md). */
Test(comm_multihost, a_rank_that_gives_up_fails_the_other_host_within_2s, .timeout = 90)
{
    hosts h;
    hosts_up(&h);
    char *env[] = {"TS_TEST_MH_ROLE=giveup", "TS_STORE_TOKEN=" TOKEN, NULL};
    int fds[2];
    pid_t pids[2];
    start_job(&h, env, "1", fds, pids);
    int st = 0;
    th_wait_pids(pids, 1, -1, 75, &st); /* host 0; host 1's rank stays alive */
    hosts_down(&h);
    int st1 = 0;
    th_wait_pids(pids + 1, 1, -1, 10, &st1);
    char *out[2];
    for (int r = 0; r < 2; r++) {
        out[r] = th_slurp_fd(fds[r]);
        close(fds[r]);
        fprintf(stderr, "---- host %d\n%s", r, out[r]);
    }
    cr_assert_not_null(strstr(out[1], "gave-up 1: TS_ERR_TIMEOUT"), "rank 1 did not give up on its deadline");
    const char *line = strstr(out[0], "late 0: ");
    cr_assert_not_null(line, "rank 0 printed no result");
    char *l = strndup(line, strcspn(line, "\n"));
    cr_assert_not_null(strstr(l, "late 0: TS_ERR_TIMEOUT"), "rank 0: %s", l);
    cr_assert_not_null(strstr(l, "rank 1"), "rank 0's error does not name rank 1: %s", l);
    const char *paren = strrchr(l, '(');
    double took = paren ? atof(paren + 1) : 1e9;
    cr_assert_lt(took, 2.0, "rank 0 failed %.2f s after entering its collectives (limit 2 s): %s", took, l);
    free(l);
    free(out[0]);
    free(out[1]);
}

/* Busy loops on every core (the load of CPU training), killed with this
 * test process (PR_SET_PDEATHSIG) and after 600 s at most (alarm). */
static int start_load(pid_t *pids, int cap)
{
    long n = ts_cpu_count();
    if (n > cap) n = cap;
    for (long i = 0; i < n; i++) {
        pid_t p = fork();
        cr_assert_geq(p, 0, "fork: %s", strerror(errno));
        if (p == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            alarm(600);
            for (volatile unsigned long k = 0;; k++)
                ;
        }
        pids[i] = p;
    }
    return (int)n;
}

static void stop_load(const pid_t *pids, int n)
{
    for (int i = 0; i < n; i++) {
        kill(pids[i], SIGKILL);
        while (waitpid(pids[i], NULL, 0) < 0 && errno == EINTR)
            ;
    }
}

/* fully_shard training on 2 hosts x 1 rank, 20 times, with a busy loop
 * on every core beside it: every run trains and checks its result (exit
 * 0, "train-ok" from both ranks). A rank slow to get a core is not dead:
 * no run may fail. */
#if defined(__SANITIZE_ADDRESS__)
/* Under ASan (CI's second pass over the multirank suites) the runs are 2-3x
 * slower and this case checks memory, not liveness: 2 runs keep CI within
 * its budget; the plain build runs all 20. */
#define LOAD_RUNS 2
#else
#define LOAD_RUNS 20
#endif
Test(comm_multihost, training_under_full_cpu_load_never_declares_a_live_peer_dead, .timeout = 450)
{
    hosts h;
    hosts_up(&h);
    pid_t load[64];
    int nload = start_load(load, 64);
    char *env[] = {"TS_TEST_MH_ROLE=train", "TS_TEST_MH_HSDP=0", "TS_TEST_MH_WORLD=2", "TS_STORE_TOKEN=" TOKEN, NULL};
    int failed = 0;
    double t0 = th_now_s();
    for (int k = 0; k < LOAD_RUNS; k++) {
        int fds[2], st[2];
        pid_t pids[2];
        start_job(&h, env, "1", fds, pids);
        th_wait_pids(pids, 2, -1, 60, st);
        bool ok = true;
        char *out[2];
        for (int r = 0; r < 2; r++) {
            out[r] = th_slurp_fd(fds[r]);
            close(fds[r]);
            char want[32];
            snprintf(want, sizeof want, "train-ok %d", r);
            ok = ok && WIFEXITED(st[r]) && WEXITSTATUS(st[r]) == 0 && strstr(out[r], want);
        }
        if (!ok) {
            failed++;
            fprintf(stderr, "---- run %d of %d failed:\n---- host 0 (status 0x%x)\n%s---- host 1 (status 0x%x)\n%s",
                    k + 1, LOAD_RUNS, st[0], out[0], st[1], out[1]);
        }
        free(out[0]);
        free(out[1]);
    }
    double took = th_now_s() - t0;
    stop_load(load, nload);
    hosts_down(&h);
    fprintf(stderr, "%d of %d runs under %d busy loops failed (%.1f s)\n", failed, LOAD_RUNS, nload, took);
    cr_assert_eq(failed, 0, "%d of %d runs of 2-host training under a full CPU load failed", failed, LOAD_RUNS);
}
