/* bench/collectives: an nccl-tests-like table (size, time, algbw, busbw)
 * for all_gather_into_tensor, reduce_scatter_tensor and all_reduce over
 * the UCX world, with, in the same run,
 *   - a single-process memcpy of the same bytes (the physical reference),
 *   - OpenMPI's MPI_Allgather (out of place and MPI_IN_PLACE),
 *     MPI_Reduce_scatter_block and MPI_Allreduce, measured by
 *     bench_collectives_mpi (built next to this program when meson finds
 *     MPI) under mpirun in two configurations, ob1 (OpenMPI's default,
 *     shared memory through vader) and ucx (--mca pml ucx ...,
 *     docs/design.md, "Thread counts, and PyTorch at its fastest"), the best of the two per size being the reference,
 *   - UCX's own point-to-point bandwidth (ucx_perftest -t tag_bw, from
 *     Debian's ucx-utils, when on PATH) at the sizes >= 1 MiB, as the
 *     transport's ceiling.
 * Targets at 2 ranks: from 1 MiB up, busbw >= OpenMPI's best
 * configuration; from 16 MiB up, busbw >= 0.8 x ucp_tag_bw.
 *
 * Size convention (nccl-tests): `size` is the bytes of the largest buffer
 * of the collective, f32 elements:
 *   all_gather:     the output (W*n; each rank contributes size/W),
 *   reduce_scatter: the input  (W*n; each rank receives size/W),
 *   all_reduce:     the tensor (n).
 * algbw = size / time; busbw = algbw * (W-1)/W for all_gather and
 * reduce_scatter, algbw * 2(W-1)/W for all_reduce (docs/design.md, "Thread counts, and PyTorch at its fastest"). Time is
 * rank 0's median over K iterations, each preceded by a barrier (K from 20
 * at small sizes down to 5 at 16 MiB and more), after 2 warm-up calls.
 * memcpy is the median of K copies of `size` bytes in rank 0's process.
 *
 * Usage (the program is the rank program):
 *   tsrun --nproc-per-node 2 bench_collectives [--iters N] [--max-mib M]
 * --iters N fixes K at every size; --max-mib M stops at M MiB (default 64).
 *
 * Two hosts (scripts/bench_two_hosts.sh; docs/multihost.md): the same
 * program under `tsrun --nnodes 2` on each of two hosts made of network
 * namespaces (scripts/netns_hosts.sh), UCX over TCP between them. When
 * the ranks span hosts the table says so, ucx_perftest runs between the
 * hosts (server on rank 0's host, client on host 1's, UCX_TLS=tcp) and
 * OpenMPI runs over the same namespaces: mpirun --host with the hosts'
 * namespaces and netns_hosts.sh as its rsh agent (TS_BENCH_NETNS names
 * the hosts, TS_BENCH_NETNS_SCRIPT the script; both set by
 * bench_two_hosts.sh), TCP on 10.213.0.0/24 only, in two configurations:
 * ob1 with btl tcp,self (vader, its shared memory, crashed mpirun across
 * the namespaces with OpenMPI 4.1.4 when both hosts' daemons had the same
 * host name) and pml ucx; mpi_yield_when_idle so that the oversubscribed
 * ranks do not spin one another out.
 *
 * The collectives' fingerprints (comm/comm.c): the 4 KiB latency of each
 * collective with the check on and off (ts__comm_set_check, switched on
 * every rank at the same point), in alternating rounds of 50 calls, the
 * median over rounds; target: on/off <= 1.05. Then the inline blocks'
 * threshold (comm.c, "Fingerprints"): per-rank blocks of 1 to 16 KiB with
 * the step-0 block inside the fingerprint's message and apart
 * (ts__comm_set_fp_inline 16 KiB, its cap, and 0), alternating rounds of
 * 30 calls, the median over rounds: inline/apart < 1 where inlining
 * pays. */
#define _GNU_SOURCE
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "bench/bench_common.h"
#include "comm/comm_internal.h" /* ts__comm_set_check: the fingerprints' cost; ts__comm_set_timeout */
#include "tensorshard.h"

#define N_SIZES 8
static const int64_t sizes[N_SIZES] = {4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20};
enum { COLL_AG, COLL_AG_IP, COLL_RS, COLL_AR, N_COLL };
static const char *coll_names[N_COLL] = {"all_gather_into_tensor (out of place: in is its own tensor)",
                                         "all_gather_into_tensor (in place: in is out's own block, as FSDP calls it)",
                                         "reduce_scatter_tensor", "all_reduce"};

static int iters_for(int64_t size, int fixed)
{
    if (fixed > 0) return fixed;
    if (size <= (256 << 10)) return 20;
    if (size <= (4 << 20)) return 10;
    return 5;
}

static bool on_path(const char *prog)
{
    const char *path = getenv("PATH");
    if (!path) return false;
    char *copy = strdup(path), *save = NULL;
    bool found = false;
    for (char *d = strtok_r(copy, ":", &save); d && !found; d = strtok_r(NULL, ":", &save)) {
        char buf[4096];
        snprintf(buf, sizeof buf, "%s/%s", *d ? d : ".", prog);
        found = access(buf, X_OK) == 0;
    }
    free(copy);
    return found;
}

/* Ranks on several hosts: the hosts' count and ranks per host (from the
 * launcher's environment); g_nodes 1 on one host. */
static int g_nodes = 1, g_per_node = 1;
/* The simulated hosts (bench_two_hosts.sh), or NULL. */
static const char *netns_name(void) { return g_nodes > 1 ? getenv("TS_BENCH_NETNS") : NULL; }
static const char *netns_script(void) { return getenv("TS_BENCH_NETNS_SCRIPT"); }

/* Median seconds of one collective of `size` bytes (convention above). */
static double time_coll(ts_comm *w, int kind, int64_t size, int iters)
{
    int ws = ts_comm_size(w);
    int64_t total = size / 4, part = total / ws;
    ts_tensor *big, *small;
    CHECK(ts_tensor_full(TS_F32, 1, &total, kind == COLL_AR ? 0.0 : 1.0, &big));
    if (kind == COLL_AG_IP) CHECK(ts_narrow(big, 0, ts_comm_rank(w) * part, part, &small));
    else CHECK(ts_tensor_full(TS_F32, 1, &part, 1.0, &small));
    double t[64];
    iters = iters > 64 ? 64 : iters;
    for (int i = -2; i < iters; i++) {
        CHECK(ts_barrier(w, NULL));
        double t0 = bench_now_s();
        if (kind == COLL_AG || kind == COLL_AG_IP) CHECK(ts_all_gather_into_tensor(w, big, small, NULL));
        else if (kind == COLL_RS) CHECK(ts_reduce_scatter_tensor(w, small, big, TS_REDUCE_SUM, 1.0, 1.0, NULL));
        else CHECK(ts_all_reduce(w, big, TS_REDUCE_SUM, NULL));
        if (i >= 0) t[i] = bench_now_s() - t0;
    }
    ts_tensor_free(big);
    ts_tensor_free(small);
    return bench_median(t, iters);
}

/* A barrier that waits without a blocked caller: a blocked caller drives
 * progress itself, polling for up to 5 ms without events (comm/comm.c,
 * "Driving"), which would take a core from rank 0's memcpy, ucx_perftest
 * and mpirun measurements. Polling the request with a sleep lets the
 * communication thread complete it and nap instead. */
static void quiet_barrier(ts_comm *w)
{
    ts_request *r = NULL;
    CHECK(ts_barrier(w, &r));
    for (bool done = false;;) {
        CHECK(ts_request_test(r, &done));
        if (done) break;
        usleep(2000);
    }
    CHECK(ts_request_wait(r));
    ts_request_free(r);
}

static double time_memcpy(int64_t size, int iters)
{
    char *a = aligned_alloc(64, (size_t)size), *b = aligned_alloc(64, (size_t)size);
    memset(a, 1, (size_t)size);
    memset(b, 0, (size_t)size);
    double t[64];
    iters = iters > 64 ? 64 : iters;
    for (int i = -2; i < iters; i++) {
        double t0 = bench_now_s();
        memcpy(b, a, (size_t)size);
        __asm__ volatile("" : : "r"(b) : "memory");
        if (i >= 0) t[i] = bench_now_s() - t0;
    }
    free(a);
    free(b);
    return bench_median(t, iters);
}

/* ucx_perftest tag_bw between a server and a client on 127.0.0.1 (the
 * environment's UCX_TLS, posix,cma,self when unset). Returns GB/s (1e9),
 * or a negative value when it could not be measured. */
static double ucx_tag_bw(int64_t size, int port)
{
    int n = size >= (16 << 20) ? 200 : 1000;
    char cmd[2048];
    if (netns_name() && netns_script()) /* server here (host 0), client on host 1, over TCP */
        snprintf(cmd, sizeof cmd,
                 "export UCX_TLS=tcp; "
                 "timeout 60 ucx_perftest -t tag_bw -s %lld -n %d -w 20 -f -p %d >/dev/null 2>&1 & "
                 "sleep 0.5; timeout 60 '%s' run '%s' 1 ucx_perftest 10.213.0.1 -t tag_bw -s %lld -n %d -w 20 -f "
                 "-p %d 2>/dev/null; wait",
                 (long long)size, n, port, netns_script(), netns_name(), (long long)size, n, port);
    else
        snprintf(
            cmd, sizeof cmd,
            "export UCX_TLS=\"${UCX_TLS:-posix,cma,self}\"; "
            "timeout 60 ucx_perftest -t tag_bw -s %lld -n %d -w 20 -f -p %d >/dev/null 2>&1 & "
            "sleep 0.5; timeout 60 ucx_perftest 127.0.0.1 -t tag_bw -s %lld -n %d -w 20 -f -p %d 2>/dev/null; wait",
            (long long)size, n, port, (long long)size, n, port);
    FILE *f = popen(cmd, "r");
    if (!f) return -1;
    char line[512];
    double bw = -1;
    while (fgets(line, sizeof line, f)) {
        /* final line: iters p50 avg overall bw_avg bw_overall rate_avg rate_overall */
        double v[8];
        if (sscanf(line, "%lf %lf %lf %lf %lf %lf %lf %lf", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6], &v[7]) ==
            8)
            bw = v[5] * 1048576.0 / 1e9; /* ucx_perftest's MB/s are MiB/s */
    }
    pclose(f);
    return bw;
}

/* OpenMPI's figures: median seconds per (kind, size) from one mpirun of
 * bench_collectives_mpi in configuration `mca` (extra mpirun flags).
 * Returns false when mpirun or the program failed. */
enum { MPI_AG, MPI_AG_IP, MPI_RS, MPI_AR, N_MPI };
static const char *mpi_kinds[N_MPI] = {"ag", "ag_ip", "rs", "ar"};
static const int mpi_of_coll[N_COLL] = {MPI_AG, MPI_AG_IP, MPI_RS, MPI_AR};

static bool run_mpi(const char *self_dir, const char *mca, int ws, int fixed_iters, int64_t max_mib,
                    double t[N_MPI][N_SIZES])
{
    char iters[32] = "", cmd[8192], hosts[1024] = "";
    if (fixed_iters > 0) snprintf(iters, sizeof iters, " --iters %d", fixed_iters);
    if (netns_name() && netns_script()) {
        /* every host through the agent (mpirun's own namespace is host 0's) */
        size_t used = (size_t)snprintf(hosts, sizeof hosts, "--host ");
        for (int h = 0; h < g_nodes && used < sizeof hosts; h++)
            used += (size_t)snprintf(hosts + used, sizeof hosts - used, "%s%s-h%d:%d", h ? "," : "", netns_name(), h,
                                     g_per_node);
        if (used < sizeof hosts)
            snprintf(hosts + used, sizeof hosts - used,
                     " --mca plm_rsh_agent '%s agent' --mca btl_tcp_if_include 10.213.0.0/24 --mca oob_tcp_if_include "
                     "10.213.0.0/24 --mca mpi_yield_when_idle 1",
                     netns_script());
    }
    /* across hosts, 120 s per configuration: the other ranks wait in a
     * barrier whose deadline is ts_dist_init's (300 s) */
    snprintf(cmd, sizeof cmd,
             "timeout %d mpirun %s %s -np %d %s '%s/bench_collectives_mpi' --max-mib %lld%s 2>/dev/null",
             hosts[0] ? 120 : 300, geteuid() == 0 ? "--allow-run-as-root" : "", hosts, ws, mca, self_dir,
             (long long)max_mib, iters);
    FILE *f = popen(cmd, "r");
    if (!f) return false;
    char line[256], kind[16];
    int got = 0;
    long long size;
    double sec;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "mpi %15s %lld %lf", kind, &size, &sec) == 3)
            for (int k = 0; k < N_MPI; k++)
                for (int s = 0; s < N_SIZES; s++)
                    if (!strcmp(kind, mpi_kinds[k]) && sizes[s] == size) {
                        t[k][s] = sec;
                        got++;
                    }
    return pclose(f) == 0 && got > 0;
}

static void size_str(int64_t s, char *buf, size_t n)
{
    if (s >= (1 << 20)) snprintf(buf, n, "%lld MiB", (long long)(s >> 20));
    else snprintf(buf, n, "%lld KiB", (long long)(s >> 10));
}

/* Runs OpenMPI in both configurations and prints its table against ours
 * (t: our median seconds per collective and size). */
static void print_mpi(int ws, int nsizes, int fixed_iters, int64_t max_mib, double t[N_COLL][N_SIZES])
{
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    self[n > 0 ? n : 0] = 0;
    char *slash = strrchr(self, '/');
    if (slash) *slash = 0;
    char prog[4160];
    snprintf(prog, sizeof prog, "%s/bench_collectives_mpi", self);
    if (!on_path("mpirun") || access(prog, X_OK) != 0) {
        printf("\nMPI comparison skipped: %s\n",
               !on_path("mpirun") ? "mpirun not found (install openmpi-bin libopenmpi-dev, then reconfigure)"
                                  : "bench_collectives_mpi was not built (meson found no MPI)");
        return;
    }
    if (g_nodes > 1 && !(netns_name() && netns_script())) {
        printf("\nMPI comparison skipped: the ranks span %d hosts and mpirun needs to reach them; "
               "scripts/bench_two_hosts.sh runs it over its namespaces (TS_BENCH_NETNS, TS_BENCH_NETNS_SCRIPT)\n",
               g_nodes);
        return;
    }
    static const char *cfg_local[2] = {"", "--mca pml ucx --mca pml_ucx_tls any --mca pml_ucx_devices any"};
    static const char *cfg_hosts[2] = {"--mca pml ob1 --mca btl tcp,self",
                                       "--mca pml ucx --mca pml_ucx_tls any --mca pml_ucx_devices any "
                                       "-x UCX_TLS=posix,cma,self,tcp"};
    const char *const *cfg_mca = g_nodes > 1 ? cfg_hosts : cfg_local;
    double mt[2][N_MPI][N_SIZES];
    bool ok[2];
    for (int c = 0; c < 2; c++) {
        for (int k = 0; k < N_MPI; k++)
            for (int s = 0; s < N_SIZES; s++) mt[c][k][s] = -1;
        ok[c] = run_mpi(self, cfg_mca[c], ws, fixed_iters, max_mib, mt[c]);
    }
    printf("\nOpenMPI (mpirun -np %d%s, bench_collectives_mpi; ob1 = %s, ucx = %s): %s%s\n", ws,
           g_nodes > 1 ? " over the same hosts" : "", g_nodes > 1 ? cfg_mca[0] : "default pml", cfg_mca[1],
           ok[0] ? "" : "ob1 FAILED ", ok[1] ? "" : "ucx FAILED");
    printf("target from 1 MiB: our busbw >= OpenMPI's best busbw (ratio >= 1)\n");
    for (int c = 0; c < N_COLL; c++) {
        int k = mpi_of_coll[c];
        double f = c == COLL_AR ? 2.0 * (ws - 1) / ws : (double)(ws - 1) / ws;
        printf("\n%s vs MPI_%s\n", coll_names[c],
               k == MPI_AG          ? "Allgather"
                   : k == MPI_AG_IP ? "Allgather (MPI_IN_PLACE)"
                   : k == MPI_RS    ? "Reduce_scatter_block"
                                    : "Allreduce");
        printf("%10s %11s %11s %11s %11s %11s %9s\n", "size", "ob1 us", "ucx us", "best busbw", "ours busbw",
               "ours/best", "target");
        for (int s = 0; s < nsizes; s++) {
            char sz[32];
            size_str(sizes[s], sz, sizeof sz);
            double a = mt[0][k][s], b = mt[1][k][s];
            double best = a > 0 && (b <= 0 || a <= b) ? a : b;
            double ours = (double)sizes[s] / t[c][s] / 1e9 * f;
            if (best <= 0) {
                printf("%10s %11s %11s %11s %11.2f %11s %9s\n", sz, "-", "-", "-", ours, "-", "-");
                continue;
            }
            double mb = (double)sizes[s] / best / 1e9 * f, r = ours / mb;
            printf("%10s %11.1f %11.1f %11.2f %11.2f %11.2f %9s\n", sz, a * 1e6, b * 1e6, mb, ours, r,
                   sizes[s] >= (1 << 20) ? (r >= 1.0 ? "ok" : "<1") : "");
        }
    }
}

int main(int argc, char **argv)
{
    int fixed_iters = 0;
    int64_t max_mib = 64;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--iters") && i + 1 < argc) fixed_iters = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--max-mib") && i + 1 < argc) max_mib = atoll(argv[++i]);
        else {
            fprintf(stderr, "usage: tsrun --nproc-per-node 2 %s [--iters N] [--max-mib M]\n", argv[0]);
            return 2;
        }
    }
    CHECK(ts_dist_init(NULL));
    ts_rank_env env;
    if (ts_launch_env(&env) == TS_OK && env.local_world_size < env.world_size) {
        g_per_node = env.local_world_size;
        g_nodes = env.world_size / env.local_world_size;
    }
    ts_comm *w = ts_dist_world();
    int rank = ts_comm_rank(w), ws = ts_comm_size(w);
    int nsizes = 0;
    while (nsizes < N_SIZES && sizes[nsizes] <= max_mib * (1 << 20)) nsizes++;

    /* Warm-up (as nccl-tests' warmup iterations): UCX finishes wiring its
     * lanes and the pools fill during the first collectives, which made
     * the first table's small sizes several times slower. */
    for (int c = 0; c < N_COLL; c++) (void)time_coll(w, c, sizes[nsizes > 4 ? 4 : nsizes - 1], 5);
    for (int k = 0; k < 10; k++) (void)time_coll(w, COLL_AG, sizes[0], 10);

    /* the fingerprints' cost at 4 KiB: rounds alternate off and on */
    enum { FP_ROUNDS = 15 };
    double fp_t[N_COLL][2][FP_ROUNDS];
    for (int k = 0; k < FP_ROUNDS; k++)
        for (int on = 0; on < 2; on++) {
            ts__comm_set_check(w, on != 0);
            for (int c = 0; c < N_COLL; c++) fp_t[c][on][k] = time_coll(w, c, sizes[0], 50);
        }
    ts__comm_set_check(w, true);

    double t[N_COLL][N_SIZES], mc[N_SIZES];
    for (int c = 0; c < N_COLL; c++)
        for (int s = 0; s < nsizes; s++) t[c][s] = time_coll(w, c, sizes[s], iters_for(sizes[s], fixed_iters));
    if (rank == 0)
        for (int s = 0; s < nsizes; s++) mc[s] = time_memcpy(sizes[s], iters_for(sizes[s], fixed_iters));

    /* the inline threshold: rounds alternate apart and inline (last, so
     * that the tables above ran with TS_COMM_FP_INLINE's threshold) */
    enum { IN_ROUNDS = 15, N_BLK = 7 };
    static const int blk_kib[N_BLK] = {1, 2, 4, 6, 8, 12, 16};
    static const int in_colls[3] = {COLL_AG_IP, COLL_RS, COLL_AR};
    double in_t[3][N_BLK][2][IN_ROUNDS];
    for (int k = 0; k < IN_ROUNDS; k++)
        for (int b = 0; b < N_BLK; b++)
            for (int on = 0; on < 2; on++) {
                ts__comm_set_fp_inline(w, on ? (size_t)16 << 10 : 0);
                for (int c = 0; c < 3; c++)
                    in_t[c][b][on][k] = time_coll(w, in_colls[c], (int64_t)blk_kib[b] * 1024 * ws, 30);
            }

    /* The UCX ceiling and OpenMPI (below), while the other ranks wait in
     * quiet_barrier at the end: for up to an hour (two mpirun runs across
     * hosts under load took more than ts_dist_init's 300 s). */
    ts__comm_set_timeout(w, 3600.0);
    double ucx[N_SIZES];
    bool have_ucx = rank == 0 && on_path("ucx_perftest") && (g_nodes == 1 || (netns_name() && netns_script()));
    for (int s = 0; s < nsizes; s++) ucx[s] = -1;
    if (have_ucx)
        for (int s = 0; s < nsizes; s++)
            if (sizes[s] >= (1 << 20)) ucx[s] = ucx_tag_bw(sizes[s], 20000 + (int)(getpid() % 20000));

    if (rank == 0) {
        const char *tls = getenv("UCX_TLS"), *em = getenv("TS_UCX_ERROR_MODE");
        char where[96] = "";
        if (g_nodes > 1)
            snprintf(where, sizeof where, " on %d hosts x %d (TCP between hosts%s)", g_nodes, g_per_node,
                     g_per_node > 1 ? ", shared memory within" : "");
        printf("bench_collectives: %d ranks%s, UCX_TLS=%s, TS_UCX_ERROR_MODE=%s, f32, size = largest buffer "
               "(nccl-tests convention)\n",
               ws, where, tls ? tls : "(unset)", em && *em ? em : "peer");
        printf("busbw = algbw * (W-1)/W (all_gather, reduce_scatter), * 2(W-1)/W (all_reduce); GB/s = 1e9 B/s\n");
        for (int c = 0; c < N_COLL; c++) {
            double f = c == COLL_AR ? 2.0 * (ws - 1) / ws : (double)(ws - 1) / ws;
            printf("\n%s\n", coll_names[c]);
            printf("%10s %6s %11s %11s %11s %13s %11s %10s\n", "size", "iters", "time(us)", "algbw GB/s", "busbw GB/s",
                   "memcpy GB/s", "busbw/mcpy", "busbw/ucx");
            for (int s = 0; s < nsizes; s++) {
                char sz[32], ur[32];
                size_str(sizes[s], sz, sizeof sz);
                double alg = (double)sizes[s] / t[c][s] / 1e9, bus = alg * f, m = (double)sizes[s] / mc[s] / 1e9;
                if (ucx[s] > 0)
                    snprintf(ur, sizeof ur, "%.2f%s", bus / ucx[s],
                             sizes[s] >= (16 << 20) ? (bus / ucx[s] >= 0.8 ? " ok" : " <0.8") : "");
                else snprintf(ur, sizeof ur, "-");
                printf("%10s %6d %11.1f %11.2f %11.2f %13.2f %11.2f %10s\n", sz, iters_for(sizes[s], fixed_iters),
                       t[c][s] * 1e6, alg, bus, m, bus / m, ur);
            }
        }
        printf("\ncollective fingerprints (kind, seq, dtype, count, op, root) at 4 KiB: median of %d rounds of "
               "50 calls each, check on vs off; target on/off <= 1.05\n",
               (int)FP_ROUNDS);
        printf("%-28s %11s %11s %9s\n", "collective", "on (us)", "off (us)", "on/off");
        static const char *short_names[N_COLL] = {"all_gather (out of place)", "all_gather (in place)",
                                                  "reduce_scatter", "all_reduce"};
        for (int c = 0; c < N_COLL; c++) {
            double on = bench_median(fp_t[c][1], FP_ROUNDS), off = bench_median(fp_t[c][0], FP_ROUNDS);
            printf("%-28s %11.2f %11.2f %9.3f %s\n", short_names[c], on * 1e6, off * 1e6, on / off,
                   on / off <= 1.05 ? "ok" : ">1.05");
        }
        printf("\nfingerprint inline blocks: per-rank block (size = block x %d), median of %d rounds of 30 calls, "
               "step-0 block inside the fingerprint's message vs apart (default threshold: the largest block "
               "where inline/apart < 1)\n",
               ws, (int)IN_ROUNDS);
        printf("%8s", "block");
        static const char *in_names[3] = {"all_gather (in place)", "reduce_scatter", "all_reduce"};
        for (int c = 0; c < 3; c++) printf(" %33s", in_names[c]);
        printf("\n%8s", "");
        for (int c = 0; c < 3; c++) printf(" %10s %10s %11s", "inline us", "apart us", "inline/apart");
        printf("\n");
        for (int b = 0; b < N_BLK; b++) {
            printf("%5d KiB", blk_kib[b]);
            for (int c = 0; c < 3; c++) {
                double a = bench_median(in_t[c][b][1], IN_ROUNDS), p = bench_median(in_t[c][b][0], IN_ROUNDS);
                printf(" %10.2f %10.2f %11.3f ", a * 1e6, p * 1e6, a / p);
            }
            printf("\n");
        }
        printf("\nucx_perftest -t tag_bw (%s, transport ceiling; target busbw >= 0.8x from 16 MiB)\n",
               netns_name() && netns_script() ? "host 0 to host 1, UCX_TLS=tcp" : "127.0.0.1");
        if (!have_ucx)
            printf("  skipped: %s\n",
                   g_nodes > 1 ? "the ranks span hosts and no TS_BENCH_NETNS says how to reach them"
                               : "ucx_perftest not found on PATH (Debian package ucx-utils)");
        else
            for (int s = 0; s < nsizes; s++)
                if (sizes[s] >= (1 << 20)) {
                    char sz[32];
                    size_str(sizes[s], sz, sizeof sz);
                    if (ucx[s] > 0) printf("%10s %11.2f GB/s\n", sz, ucx[s]);
                    else printf("%10s %11s (ucx_perftest failed)\n", sz, "-");
                }
        print_mpi(ws, nsizes, fixed_iters, max_mib, t);
        fflush(stdout);
    }
    quiet_barrier(w);
    CHECK(ts_dist_finalize());
    return 0;
}
