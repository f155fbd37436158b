/* bench/fsdp_step: one GPT training step (forward, backward, AdamW) with
 * fully_shard on W ranks, against the same step without sharding, in the
 * same run, to show what sharding costs and how much of its communication
 * the prefetching hides.
 *
 * Per rank and step (medians over --steps steps after 2 warm-up steps):
 *   local      the unsharded model on the rank's batch, no communication
 *              (the compute this step cannot avoid);
 *   fsdp       fully_shard (each block a group, then the root), implicit
 *              forward and backward prefetch on (the default);
 *   fsdp-nopf  the same with the implicit prefetch off;
 *   fsdp-bf16  fsdp with ts_mp_policy param_dtype bfloat16, reduce_dtype
 *              float32 (float32 master weights and AdamW; logits cast to
 *              float32 for the loss), against fsdp: the step time ratio
 *              and the bytes all-gathered and reduce-scattered per step
 *              (the all-gathers carry exactly half the bytes);
 *   comm       the step's collectives run alone, back to back and blocking
 *              (2 all-gathers per block group, 1 for the root, which stays
 *              unsharded after forward, and 1 reduce-scatter per group):
 *              what would be exposed with no overlap at all.
 * exposed = fsdp - local, also as a multiple of comm (0: all hidden; 1:
 * nothing hidden; above 1: FSDP's own work, the copy-out and packing, on
 * top). On shared memory the transfers are copies made by the ranks' CPUs,
 * so with fewer than 2 cores per rank they cannot overlap the compute.
 *   offload    fsdp with CPUOffloadPolicy on every group (pinned host shards
 *              and gradients: the staging copies before each all-gather and
 *              after each reduce-scatter, fully_shard.h);
 *   offload-nopin  the same with pin_memory false.
 *   fsdp-ac    fsdp with every block checkpointed (ts_checkpoint_module
 *              before ts_fully_shard): its peak storage and step time
 *              against fsdp (the step time interleaved with fsdp's).
 * The offload table compares them with fsdp in the same run: step time
 * (the three run once more with their steps interleaved, so that a
 * changing machine load slows them alike) and its ratio (the target is
 * 1.05 at most), bytes per step (given to the
 * collectives, and copied host-to-device and device-to-host), the
 * storage peak, the part of it that is the offloaded groups' host blocks
 * (the shards and the host gradient buffers, which offload keeps for the
 * whole step: on a GPU that memory would be off the device) and the
 * pinned bytes.
 * Memory: the peak of tensor storage (TS_MEM_STORAGE) during the steps of
 * each mode, and the bytes of parameters this rank holds; per sharded mode
 * also ts_fsdp_memory_estimate's prediction of that peak, the ratio, and
 * its terms (docs/fully_shard.md, "Memory"). Rank 0 also
 * prints where fully_shard's own time goes (its TS_TRACE spans: waiting
 * for all-gathers, copy-out, packing gradients, waiting for
 * reduce-scatters, adding them into the shards' gradients).
 *
 * Then, in one alternating run (run_vs): per step, local and fsdp with the
 * per-parameter AdamW and local-fused and fsdp-fused with the fused one
 * (ts_adam_options.fused), in a rotating order, then one step of torch
 * 1.13 DDP over gloo on the same GPT, batch and ranks for each bucket size
 * (tools/bench/torch_ddp_step.py, started by rank 0; the other ranks wait
 * at the next barrier): the median step and ts_optim_step time of each,
 * 'fsdp / local' (target <= 1.03) and 'fsdp / ddp' (target <= 0.80), or
 * why DDP did not run (no torch in /usr/bin/python3). docs/optim.md.
 *
 * --hsdp R shards every sharded mode over a 2-d (replicate R, shard W/R)
 * mesh instead of all W ranks (HSDP: with --nnodes R, the all-gathers and
 * reduce-scatters stay within a host and only the gradients' all-reduce
 * crosses; scripts/bench_two_hosts.sh --step passes it on).
 *
 * Usage: tsrun --nproc-per-node 2 bench_fsdp_step [--steps N] [--layers L]
 *        [--dim D] [--heads H] [--seq T] [--batch B] [--hsdp R] [--no-ddp]
 *        [--ddp-bucket-mb 1,25] [--only-vs (the alternating run alone)]
 * Defaults: 9 steps, 4 layers, d 256, 4 heads, seq 128, batch 4 per rank. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench/bench_common.h"
#include "optim/internal.h"
#include "tensorshard.h"

typedef struct cfg {
    int steps, layers, dim, heads, seq, batch, vocab;
} cfg;

enum { LOCAL, FSDP, FSDP_NOPF, FSDP_BF16, OFFLOAD, OFFLOAD_NOPIN, FSDP_AC, N_MODES };
static const char *mode_names[N_MODES] = {"local",   "fsdp",          "fsdp-nopf", "fsdp-bf16",
                                          "offload", "offload-nopin", "fsdp-ac"};

/* Per mode, besides the step time: bytes per step given to the
 * collectives (all of them; the all-gathers; the reduce-scatters) and
 * staged by offload, the pinned bytes at the end (rank 0's counters). */
typedef struct mode_bytes {
    double coll, ag, rs, h2d, d2h;
    size_t pinned, host;
} mode_bytes;
static mode_bytes g_bytes[N_MODES];

static ts_mesh *g_mesh; /* --hsdp R: the (replicate R, shard W/R) mesh every sharded mode uses; NULL: 1-d */

/* The world's collective counters, plus the HSDP mesh's groups' (each
 * group counts its own). */
static void coll_stats(ts_comm_counters *k)
{
    ts_comm_stats(ts_dist_world(), k);
    static const char *const dims[2] = {"replicate", "shard"};
    for (int d = 0; g_mesh && d < 2; d++) {
        ts_comm_counters g;
        ts_comm_stats(ts_mesh_group(g_mesh, dims[d]), &g);
        for (int i = 0; i < TS_COLL_KIND_COUNT; i++) k->calls[i] += g.calls[i], k->bytes[i] += g.bytes[i];
    }
}
static ts_fsdp_memory_report g_pred[N_MODES]; /* ts_fsdp_memory_estimate per mode (zeros for local) */

static ts_module *build(const cfg *c, int mode)
{
    ts_gpt_config g = ts_gpt_config_default();
    g.vocab_size = c->vocab, g.block_size = c->seq, g.n_layer = c->layers, g.n_head = c->heads;
    g.d_model = c->dim;
    ts_manual_seed(1);
    ts_module *m;
    CHECK(ts_gpt_new(&g, &m));
    if (mode == LOCAL) return m;
    ts_offload_policy op = ts_offload_policy_default();
    op.pin_memory = mode == OFFLOAD;
    ts_mp_policy mp = ts_mp_policy_default();
    mp.param_dtype = TS_BF16;
    mp.reduce_dtype = TS_F32;
    ts_fsdp_options fo = ts_fsdp_options_default();
    fo.mesh = g_mesh;
    if (mode == OFFLOAD || mode == OFFLOAD_NOPIN) fo.offload_policy = &op;
    if (mode == FSDP_BF16) fo.mp_policy = &mp;
    for (int l = 0; l < c->layers; l++) {
        char name[32];
        ts_module *b;
        snprintf(name, sizeof name, "blocks.%d", l);
        CHECK(ts_module_get_submodule(m, name, &b));
        if (mode == FSDP_AC) CHECK(ts_checkpoint_module(b));
        CHECK(ts_fully_shard(b, &fo));
    }
    CHECK(ts_fully_shard(m, &fo));
    bool pf = mode != FSDP_NOPF;
    CHECK(ts_fsdp_set_implicit_prefetch(m, pf, pf));
    return m;
}

/* The token ids and targets of one rank's batch (the same every step). */
static void make_batch(const cfg *c, int rank, ts_tensor **ids, ts_tensor **tg)
{
    int64_t is[2] = {c->batch, c->seq}, tsz[1] = {(int64_t)c->batch * c->seq};
    CHECK(ts_tensor_empty(TS_I64, 2, is, ids));
    CHECK(ts_tensor_empty(TS_I64, 1, tsz, tg));
    int64_t *a = ts_tensor_data(*ids), *b = ts_tensor_data(*tg);
    for (int64_t i = 0; i < tsz[0]; i++) {
        a[i] = (i * 7 + rank * 13) % c->vocab;
        b[i] = (i * 11 + rank * 5) % c->vocab;
    }
}

static double g_last_opt_s; /* the last train_step's ts_optim_step, seconds */

/* AdamW with the defaults over the n parameters, fused or per parameter. */
static void make_adamw(int n, ts_tensor **ps, bool fused, ts_optim **out)
{
    ts_adam_options ao = ts_adamw_options_default();
    ao.fused = fused;
    CHECK(ts_adamw_new(n, ps, &ao, out));
}

/* One training step: forward, the loss in float32 (as torchtitan's
 * pred.float() under a bf16 policy), backward, AdamW, zero_grad. */
static void train_step(const cfg *c, ts_module *m, ts_optim *opt, ts_tensor *ids, ts_tensor *tg)
{
    int64_t fs[2] = {(int64_t)c->batch * c->seq, c->vocab};
    ts_tensor *logits, *flat, *loss;
    CHECK(ts_module_call1(m, ids, &logits));
    if (ts_tensor_dtype(logits) != TS_F32) {
        ts_tensor *l32;
        CHECK(ts_to_dtype(logits, TS_F32, &l32));
        ts_tensor_free(logits);
        logits = l32;
    }
    CHECK(ts_reshape(logits, 2, fs, &flat));
    CHECK(ts_cross_entropy(flat, tg, -100, TS_REDUCTION_MEAN, &loss));
    CHECK(ts_backward(loss, NULL, false));
    double t0 = bench_now_s();
    CHECK(ts_optim_step(opt));
    g_last_opt_s = bench_now_s() - t0;
    ts_optim_zero_grad(opt, true);
    ts_tensor_free(logits), ts_tensor_free(flat), ts_tensor_free(loss);
}

/* Median step seconds; *peak the storage peak during the steps, *pbytes
 * the parameter bytes this rank holds. */
static double run_mode(const cfg *c, int mode, int rank, size_t *peak, int64_t *pbytes)
{
    ts_module *m = build(c, mode);
    ts_named_params np;
    CHECK(ts_module_named_parameters(m, &np));
    ts_tensor **ps = malloc((size_t)np.n * sizeof *ps);
    *pbytes = 0;
    for (int i = 0; i < np.n; i++) {
        ps[i] = *np.items[i].slot;
        *pbytes += ts_tensor_numel(ps[i]) * 4;
    }
    ts_optim *opt;
    make_adamw(np.n, ps, false, &opt);
    ts_tensor *ids, *tg;
    make_batch(c, rank, &ids, &tg);
    double t[64];
    int n = c->steps > 64 ? 64 : c->steps;
    ts_comm *w = ts_dist_world();
    ts_comm_counters k0, k1;
    ts_fsdp_offload_stats o0 = {0}, o1 = {0};
    for (int s = -2; s < n; s++) {
        if (s == 0) {
            ts_mem_reset_peak();
            coll_stats(&k0);
            CHECK(ts_fsdp_offload_stats_get(m, &o0));
        }
        CHECK(ts_barrier(w, NULL));
        double t0 = bench_now_s();
        train_step(c, m, opt, ids, tg);
        if (s >= 0) t[s] = bench_now_s() - t0;
    }
    *peak = ts_mem_peak_bytes(TS_MEM_STORAGE);
    if (mode != LOCAL) {
        ts_fsdp_memory_options mo = ts_fsdp_memory_options_default();
        mo.input_ndim = 2, mo.input_shape[0] = c->batch, mo.input_shape[1] = c->seq;
        CHECK(ts_fsdp_memory_estimate(m, &mo, &g_pred[mode]));
    }
    coll_stats(&k1);
    CHECK(ts_fsdp_offload_stats_get(m, &o1));
    mode_bytes *mb = &g_bytes[mode];
    mb->coll = 0;
    for (int k = 0; k < TS_COLL_KIND_COUNT; k++)
        if (k != TS_COLL_BARRIER) mb->coll += (double)(k1.bytes[k] - k0.bytes[k]) / n;
    mb->ag = (double)(k1.bytes[TS_COLL_ALL_GATHER] - k0.bytes[TS_COLL_ALL_GATHER]) / n;
    mb->rs = (double)(k1.bytes[TS_COLL_REDUCE_SCATTER] - k0.bytes[TS_COLL_REDUCE_SCATTER]) / n;
    mb->h2d = (double)(o1.h2d_bytes - o0.h2d_bytes) / n;
    mb->d2h = (double)(o1.d2h_bytes - o0.d2h_bytes) / n;
    mb->pinned = ts_mem_live_bytes(TS_MEM_PINNED);
    mb->host = o1.host_bytes;
    if (mode == FSDP && rank == 0) { /* where fully_shard's own time goes, per step (rank 0) */
        static const char *spans[] = {"fsdp.wait_all_gather", "fsdp.copy_out", "fsdp.pack_grads", "fsdp.wait_reduce",
                                      "fsdp.grad_into_shards"};
        printf("fsdp time per step, rank 0 (TS_TRACE spans, mean over %d steps):", n + 2);
        for (int i = 0; i < 5; i++)
            printf(" %s %.2f ms%s", spans[i] + 5, (double)ts_trace_total_ns(spans[i]) / 1e6 / (n + 2),
                   i < 4 ? "," : "\n");
    }
    ts_tensor_free(ids), ts_tensor_free(tg);
    ts_optim_free(opt);
    free(ps);
    ts_named_params_free(&np);
    ts_module_free(m);
    return bench_median(t, n);
}

/* fsdp, offload and offload-nopin again, their steps interleaved (the
 * order rotating every step), so that a machine whose load changes during
 * the run slows them alike: the ratio of their medians is what the
 * offload table reports. */
typedef struct runner {
    ts_module *m;
    ts_optim *opt;
    ts_tensor **ps;
} runner;

static void runner_new_opt(const cfg *c, int mode, bool fused, runner *r)
{
    r->m = build(c, mode);
    ts_named_params np;
    CHECK(ts_module_named_parameters(r->m, &np));
    r->ps = malloc((size_t)np.n * sizeof *r->ps);
    for (int i = 0; i < np.n; i++) r->ps[i] = *np.items[i].slot;
    make_adamw(np.n, r->ps, fused, &r->opt);
    ts_named_params_free(&np);
}

static void runner_new(const cfg *c, int mode, runner *r) { runner_new_opt(c, mode, false, r); }

static void runner_free(runner *r)
{
    ts_optim_free(r->opt);
    free(r->ps);
    ts_module_free(r->m);
}

static void run_interleaved(const cfg *c, int rank, int nm, const int *modes, double *t_out)
{
    runner r[5];
    if (nm > 5) nm = 5;
    for (int k = 0; k < nm; k++) runner_new(c, modes[k], &r[k]);
    ts_tensor *ids, *tg;
    make_batch(c, rank, &ids, &tg);
    double t[5][64];
    int n = c->steps > 64 ? 64 : c->steps;
    ts_comm *w = ts_dist_world();
    for (int s = -2; s < n; s++) {
        for (int j = 0; j < nm; j++) {
            int k = (j + (s + 2)) % nm;
            CHECK(ts_barrier(w, NULL));
            double t0 = bench_now_s();
            train_step(c, r[k].m, r[k].opt, ids, tg);
            if (s >= 0) t[k][s] = bench_now_s() - t0;
        }
    }
    for (int k = 0; k < nm; k++) {
        t_out[k] = bench_median(t[k], n);
        runner_free(&r[k]);
    }
    ts_tensor_free(ids), ts_tensor_free(tg);
}

/* ------------------------------------------------------------ torch DDP */

/* torch 1.13 DDP over gloo on the same GPT, batch and ranks
 * (tools/bench/torch_ddp_step.py --serve: it starts its W local ranks, one
 * thread each, and runs a step of each bucket size whenever told), started
 * by rank 0 with a pipe each way. Set up as tools/bench/torch_train_step.py
 * runs torch at its fastest (docs/design.md, "Thread counts, and PyTorch at its fastest"): BLIS's AVX-512
 * kernels where ours use them, glibc's malloc thresholds raised; the
 * launcher's RANK / WORLD_SIZE / MASTER_* are removed from its environment
 * so that it starts its own ranks. */
typedef struct ddp_proc {
    pid_t pid;
    FILE *in, *out;
} ddp_proc;

static const char *g_ddp_buckets = "1,25"; /* --ddp-bucket-mb: torch_ddp_step.py's --bucket-mb */
enum { DDP_POLL_S = 20 };                  /* rank 0 tells the others how DDP is doing this often, s */

/* Why DDP cannot run here, or NULL if it can. */
static const char *ddp_unavailable(void)
{
    if (access("/usr/bin/python3", X_OK) != 0) return "no /usr/bin/python3";
    if (system("/usr/bin/python3 -c 'import torch.distributed' 2>/dev/null") != 0)
        return "/usr/bin/python3 has no torch (Debian's python3-torch)";
    return NULL;
}

static bool ddp_start(const cfg *c, int W, ddp_proc *d)
{
    /* everything the child needs is made here: between fork and exec a
     * threaded process may only make async-signal-safe calls */
    char script[1024], a[7][32], blis[32] = "BLIS_ARCH_TYPE=0";
    snprintf(script, sizeof script, "%s/tools/bench/torch_ddp_step.py", TS_SOURCE_DIR);
    snprintf(a[0], 32, "%d", W), snprintf(a[1], 32, "%d", c->layers), snprintf(a[2], 32, "%d", c->dim);
    snprintf(a[3], 32, "%d", c->heads), snprintf(a[4], 32, "%d", c->seq), snprintf(a[5], 32, "%d", c->batch);
    snprintf(a[6], 32, "%d", c->vocab);
    char *argv[] = {"/usr/bin/python3",
                    script,
                    "--serve",
                    "--warmup",
                    "2",
                    "--nproc",
                    a[0],
                    "--layers",
                    a[1],
                    "--dim",
                    a[2],
                    "--heads",
                    a[3],
                    "--seq",
                    a[4],
                    "--batch",
                    a[5],
                    "--vocab",
                    a[6],
                    "--bucket-mb",
                    (char *)g_ddp_buckets,
                    NULL};
    static const char *drop[] = {
        "RANK=",          "LOCAL_RANK=", "WORLD_SIZE=", "LOCAL_WORLD_SIZE=",       "MASTER_ADDR=",
        "MASTER_PORT=",   "GROUP_RANK=", "ROLE_RANK=",  "MALLOC_MMAP_THRESHOLD_=", "MALLOC_TRIM_THRESHOLD_=",
        "BLIS_ARCH_TYPE="};
    size_t ne = 0;
    while (environ[ne]) ne++;
    char **envp = malloc((ne + 4) * sizeof *envp);
    if (!envp) return false;
    size_t k = 0;
    bool skx = strcmp(ts_blis_arch_name(), "skx") == 0;
    for (size_t i = 0; i < ne; i++) {
        bool keep = true;
        for (size_t j = 0; j < sizeof drop / sizeof *drop && keep; j++)
            keep = strncmp(environ[i], drop[j], strlen(drop[j])) != 0 ||
                (!skx && !strcmp(drop[j], "BLIS_ARCH_TYPE=")); /* ours, unless BLIS runs skx here */
        if (keep) envp[k++] = environ[i];
    }
    envp[k++] = "MALLOC_MMAP_THRESHOLD_=33554432";
    envp[k++] = "MALLOC_TRIM_THRESHOLD_=4294967296";
    if (skx) envp[k++] = blis;
    envp[k] = NULL;
    int to[2], from[2];
    if (pipe(to) != 0) {
        free(envp);
        return false;
    }
    if (pipe(from) != 0) {
        close(to[0]), close(to[1]);
        free(envp);
        return false;
    }
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        setpgid(0, 0); /* its own process group, with the ranks it starts: ddp_stop can end them all */
        dup2(to[0], 0);
        dup2(from[1], 1);
        close(to[0]), close(to[1]), close(from[0]), close(from[1]);
        execve(argv[0], argv, envp);
        _exit(127);
    }
    free(envp);
    close(to[0]), close(from[1]);
    if (pid < 0) {
        close(to[1]), close(from[0]);
        return false;
    }
    setpgid(pid, pid);
    d->pid = pid;
    d->in = fdopen(to[1], "w");
    d->out = fdopen(from[0], "r");
    /* unbuffered: ddp_step polls the descriptor before each line, and a
     * line read ahead into a stdio buffer would leave it waiting */
    if (d->out) setvbuf(d->out, NULL, _IONBF, 0);
    return d->in && d->out;
}

/* One DDP step of each bucket size, collective: rank 0 asks for it and
 * reads the times (ms, in the order of --ddp-bucket-mb) into ms_out (with
 * ready, it waits for the line saying DDP has started and warmed up);
 * between waits of at most DDP_POLL_S it broadcasts how far it is (0
 * waiting, 1 done, -1 failed: no answer within limit_s, or DDP ended), so
 * that the other ranks, waiting in that broadcast, learn the outcome and
 * no collective outlasts its deadline however long torch takes to start.
 * Returns the number of times read on every rank, 0 if DDP failed. */
static int ddp_step(ts_comm *w, int rank, ddp_proc *d, bool ready, double limit_s, double *ms_out, int max,
                    char labels[][64])
{
    int want = 1;
    for (const char *q = g_ddp_buckets; *q && !ready; q++) want += *q == ',';
    if (want > max) want = max;
    int n = 0;
    bool failed = rank == 0 && !ready && (fprintf(d->in, "run 1\n") < 0 || fflush(d->in) != 0);
    double t0 = bench_now_s();
    int64_t one = 1;
    ts_tensor *state;
    CHECK(ts_tensor_zeros(TS_I64, 1, &one, &state));
    int64_t *sv = ts_tensor_data(state);
    for (;;) {
        if (rank == 0 && !failed) {
            struct pollfd pfd = {.fd = fileno(d->out), .events = POLLIN};
            int rc;
            do rc = poll(&pfd, 1, DDP_POLL_S * 1000);
            while (rc < 0 && errno == EINTR);
            char line[256];
            if (rc > 0) {
                if (!fgets(line, sizeof line, d->out)) {
                    failed = true;
                } else {
                    double med, best;
                    char lab[64] = "";
                    if (ready) {
                        n += strncmp(line, "ddp_ready", 9) == 0;
                    } else if (sscanf(line, "ddp_step_ms %lf %lf %63[^\n]", &med, &best, lab) >= 2) {
                        ms_out[n] = med;
                        snprintf(labels[n], 64, "%s", lab);
                        n++;
                    }
                }
            } else if (rc < 0 || bench_now_s() - t0 > limit_s) {
                fprintf(stderr, "bench_fsdp_step: torch DDP gave no step time within %.0f s\n", limit_s);
                failed = true;
            }
            *sv = failed ? -1 : n >= want ? 1 : 0;
        }
        CHECK(ts_broadcast(w, state, 0, NULL));
        if (*sv != 0) break;
    }
    int got = *sv == 1 ? want : 0;
    ts_tensor_free(state);
    return got;
}

/* Ends DDP: "quit" when it is well (it then exits), else its process
 * group is killed. */
static void ddp_stop(ddp_proc *d, bool well)
{
    if (!well && d->pid > 0) kill(-d->pid, SIGKILL);
    if (d->in) {
        signal(SIGPIPE, SIG_IGN);
        fprintf(d->in, "quit\n");
        fclose(d->in);
    }
    if (d->out) fclose(d->out);
    int status;
    if (d->pid > 0) waitpid(d->pid, &status, 0);
    d->in = d->out = NULL;
    d->pid = 0;
}

/* The optimizer's share and the step against DDP, in one alternating run:
 * per step, each of local, fsdp (per-parameter AdamW), local-fused and
 * fsdp-fused (the fused AdamW) in a rotating order, then (rank 0) one DDP
 * step of each bucket size while the other ranks wait at the next
 * barrier. Medians of the steps and of ts_optim_step's time in them. */
enum { VS_LOCAL, VS_FSDP, VS_LOCAL_FUSED, VS_FSDP_FUSED, VS_N, VS_DDP_MAX = 8 };
static const char *vs_names[VS_N] = {"local", "fsdp", "local-fused", "fsdp-fused"};

typedef struct vs_result {
    double step[VS_N], opt[VS_N]; /* medians, seconds */
    int n_ddp;                    /* bucket sizes timed (0: DDP did not run) */
    double ddp[VS_DDP_MAX];       /* medians, seconds */
    char ddp_label[VS_DDP_MAX][64];
    const char *ddp_why; /* why not, when n_ddp is 0 */
} vs_result;

static void run_vs(const cfg *c, int rank, int W, bool with_ddp, vs_result *res)
{
    runner r[VS_N];
    runner_new_opt(c, LOCAL, false, &r[VS_LOCAL]);
    runner_new_opt(c, FSDP, false, &r[VS_FSDP]);
    runner_new_opt(c, LOCAL, true, &r[VS_LOCAL_FUSED]);
    runner_new_opt(c, FSDP, true, &r[VS_FSDP_FUSED]);
    ts_tensor *ids, *tg;
    make_batch(c, rank, &ids, &tg);
    int n = c->steps > 64 ? 64 : c->steps;
    double t[VS_N][64], o[VS_N][64], dd[VS_DDP_MAX][64];
    ts_comm *w = ts_dist_world();
    memset(res, 0, sizeof *res);
    /* rank 0 decides whether DDP runs and tells the others */
    int64_t one = 1;
    ts_tensor *flag;
    CHECK(ts_tensor_zeros(TS_I64, 1, &one, &flag));
    ddp_proc d = {0};
    if (rank == 0 && with_ddp) {
        res->ddp_why = ddp_unavailable();
        if (!res->ddp_why && !ddp_start(c, W, &d)) res->ddp_why = "could not start tools/bench/torch_ddp_step.py";
        if (!res->ddp_why) *(int64_t *)ts_tensor_data(flag) = 1;
    } else if (!with_ddp) {
        res->ddp_why = "--no-ddp";
    }
    CHECK(ts_broadcast(w, flag, 0, NULL));
    bool ddp = *(int64_t *)ts_tensor_data(flag) != 0;
    ts_tensor_free(flag);
    double ms[VS_DDP_MAX] = {0};
    /* torch's start-up and warm-up before any step is timed, so that it
     * takes no core from them */
    if (ddp && !ddp_step(w, rank, &d, true, 900.0, ms, VS_DDP_MAX, res->ddp_label)) {
        if (rank == 0) fprintf(stderr, "bench_fsdp_step: torch DDP did not start; leaving it out\n");
        res->ddp_why = "torch_ddp_step.py did not start (its messages are above)";
        ddp = false;
    }
    int n_ddp = 0;
    for (int s = -2; s < n; s++) {
        for (int j = 0; j < VS_N; j++) {
            int k = (j + (s + 2)) % VS_N;
            CHECK(ts_barrier(w, NULL));
            double t0 = bench_now_s();
            train_step(c, r[k].m, r[k].opt, ids, tg);
            if (s >= 0) t[k][s] = bench_now_s() - t0, o[k][s] = g_last_opt_s;
        }
        if (s >= 0 && ddp) { /* the DDP warm-up steps ran when it started */
            int got = ddp_step(w, rank, &d, false, 300.0, ms, VS_DDP_MAX, res->ddp_label);
            if (!got) {
                if (rank == 0) fprintf(stderr, "bench_fsdp_step: torch DDP stopped answering; leaving it out\n");
                res->ddp_why = "torch_ddp_step.py failed (its messages are above)";
                ddp = false;
                n_ddp = 0;
            } else {
                n_ddp = got;
                for (int b = 0; b < got; b++) dd[b][s] = ms[b] * 1e-3;
            }
        }
    }
    if (rank == 0 && d.pid) ddp_stop(&d, ddp);
    for (int k = 0; k < VS_N; k++) {
        res->step[k] = bench_median(t[k], n);
        res->opt[k] = bench_median(o[k], n);
        runner_free(&r[k]);
    }
    res->n_ddp = ddp ? n_ddp : 0;
    for (int b = 0; b < res->n_ddp; b++) res->ddp[b] = bench_median(dd[b], n);
    ts_tensor_free(ids), ts_tensor_free(tg);
}

/* The collectives of one FSDP step, run alone, blocking, back to back. */
static double run_comm(const cfg *c)
{
    ts_module *m = build(c, FSDP);
    ts_comm *w = ts_dist_world();
    int W = ts_comm_size(w);
    int ng = c->layers + 1;
    int64_t *shard = calloc((size_t)ng, sizeof *shard);
    for (int l = 0; l <= c->layers; l++) {
        ts_module *g = m;
        char name[32];
        snprintf(name, sizeof name, "blocks.%d", l);
        if (l < c->layers) CHECK(ts_module_get_submodule(m, name, &g));
        ts_fsdp_group_info gi;
        CHECK(ts_fsdp_group_info_get(g, &gi));
        shard[l] = gi.shard_numel;
    }
    double t[64];
    int n = c->steps > 64 ? 64 : c->steps;
    for (int s = -2; s < n; s++) {
        CHECK(ts_barrier(w, NULL));
        double t0 = bench_now_s();
        for (int l = 0; l <= c->layers; l++) {
            int64_t full = shard[l] * W;
            ts_tensor *in, *out;
            CHECK(ts_tensor_zeros(TS_F32, 1, &shard[l], &in));
            CHECK(ts_tensor_empty(TS_F32, 1, &full, &out));
            int gathers = l < c->layers ? 2 : 1;
            for (int k = 0; k < gathers; k++) CHECK(ts_all_gather_into_tensor(w, out, in, NULL));
            CHECK(ts_reduce_scatter_tensor(w, in, out, TS_REDUCE_AVG, 1.0, 1.0, NULL));
            ts_tensor_free(in), ts_tensor_free(out);
        }
        if (s >= 0) t[s] = bench_now_s() - t0;
    }
    free(shard);
    ts_module_free(m);
    return bench_median(t, n);
}

int main(int argc, char **argv)
{
    ts_launch_rank_guard();
    cfg c = {.steps = 9, .layers = 4, .dim = 256, .heads = 4, .seq = 128, .batch = 4, .vocab = 64};
    bool with_ddp = true, only_vs = false;
    int hsdp = 1;
    for (int i = 1; i < argc; i++) { /* the flags without a value, taken out of argv */
        bool drop = true;
        if (!strcmp(argv[i], "--no-ddp")) with_ddp = false;
        else if (!strcmp(argv[i], "--only-vs")) only_vs = true;
        else if (!strcmp(argv[i], "--ddp-bucket-mb") && i + 1 < argc) {
            g_ddp_buckets = argv[i + 1];
            memmove(&argv[i], &argv[i + 1], (size_t)(argc - i - 1) * sizeof *argv);
            argc--;
        } else drop = false;
        if (drop) {
            memmove(&argv[i], &argv[i + 1], (size_t)(argc - i - 1) * sizeof *argv);
            argc--, i--;
        }
    }
    for (int i = 1; i + 1 < argc; i += 2) {
        int v = atoi(argv[i + 1]);
        if (!strcmp(argv[i], "--steps")) c.steps = v;
        else if (!strcmp(argv[i], "--layers")) c.layers = v;
        else if (!strcmp(argv[i], "--dim")) c.dim = v;
        else if (!strcmp(argv[i], "--heads")) c.heads = v;
        else if (!strcmp(argv[i], "--seq")) c.seq = v;
        else if (!strcmp(argv[i], "--batch")) c.batch = v;
        else if (!strcmp(argv[i], "--hsdp")) hsdp = v;
        else {
            fprintf(stderr, "unknown flag %s\n", argv[i]);
            return 2;
        }
    }
    if ((argc - 1) % 2 || c.steps < 1 || c.layers < 1 || c.dim < c.heads || c.dim % c.heads || c.seq < 2 ||
        c.batch < 1 || hsdp < 1) {
        fprintf(stderr,
                "usage: tsrun --nproc-per-node 2 %s [--steps N] [--layers L] [--dim D] [--heads H] "
                "[--seq T] [--batch B] [--hsdp R] [--no-ddp] [--ddp-bucket-mb 1,25] [--only-vs]\n",
                argv[0]);
        return 2;
    }
    CHECK(ts_dist_init(NULL));
    if (!ts_trace_enabled()) CHECK(ts_trace_start("/dev/null")); /* for the breakdown; never flushed */
    int rank = ts_comm_rank(ts_dist_world()), W = ts_comm_size(ts_dist_world());
    if (hsdp > 1) { /* HSDP: replicate over R (the hosts, with --nnodes R), shard within */
        if (W % hsdp) {
            fprintf(stderr, "--hsdp %d: the %d ranks do not split into %d replicas\n", hsdp, W, hsdp);
            return 2;
        }
        int64_t shape[2] = {hsdp, W / hsdp};
        static const char *const names[2] = {"replicate", "shard"};
        CHECK(ts_mesh_new(ts_dist_world(), "cpu", 2, shape, names, &g_mesh));
    }
    double t[N_MODES] = {0};
    size_t peak[N_MODES] = {0};
    int64_t pbytes[N_MODES] = {0};
    double comm = 0, ti[5] = {0};
    static const int off_modes[5] = {FSDP, OFFLOAD, OFFLOAD_NOPIN, FSDP_BF16, FSDP_AC};
    if (!only_vs) {
        for (int m = 0; m < N_MODES; m++) t[m] = run_mode(&c, m, rank, &peak[m], &pbytes[m]);
        comm = run_comm(&c);
        /* the policies' rows against fsdp again, their steps interleaved (the
         * load on a shared machine drifts between the runs above) */
        run_interleaved(&c, rank, 5, off_modes, ti);
    }
    vs_result vs;
    run_vs(&c, rank, W, with_ddp, &vs);
    /* each rank's peak resident set (VmHWM: the whole run, every mode) beside
     * the largest estimate of the modes (ts_fsdp_memory_estimate's
     * rss_peak_bytes: floor + the pool; docs/memory.md), gathered in one
     * all-reduce of a (W, 4) tensor, each rank its row */
    ts_tensor *rss_t;
    {
        int64_t rs_shape[2] = {W, 4};
        CHECK(ts_tensor_zeros(TS_F64, 2, rs_shape, &rss_t));
        double *v = ts_tensor_data(rss_t);
        ts_process_memory pm = {0, 0};
        if (ts_process_memory_read(&pm)) pm.peak_rss_bytes = 0;
        v[rank * 4] = (double)pm.peak_rss_bytes;
        for (int m = FSDP; m < N_MODES; m++) {
            if ((double)g_pred[m].rss_peak_bytes > v[rank * 4 + 1]) v[rank * 4 + 1] = (double)g_pred[m].rss_peak_bytes;
            if ((double)peak[m] > v[rank * 4 + 2]) v[rank * 4 + 2] = (double)peak[m];
            if ((double)g_pred[m].peak_bytes > v[rank * 4 + 3]) v[rank * 4 + 3] = (double)g_pred[m].peak_bytes;
        }
        CHECK(ts_all_reduce(ts_dist_world(), rss_t, TS_REDUCE_SUM, NULL));
    }
    if (rank == 0) {
        printf("bench_fsdp_step: %d ranks%s, GPT %d layers, d %d, %d heads, seq %d, batch %d per rank, AdamW; "
               "TS_UCX_ERROR_MODE=%s\n",
               W, g_mesh ? " (HSDP: replicate x shard mesh of --hsdp; comm alone stays 1-d)" : "", c.layers, c.dim,
               c.heads, c.seq, c.batch, getenv("TS_UCX_ERROR_MODE") ? getenv("TS_UCX_ERROR_MODE") : "peer");
    }
    if (rank == 0 && !only_vs) {
        printf("%-14s %11s %10s %16s %16s\n", "mode", "step ms", "vs local", "peak storage MiB", "param MiB/rank");
        for (int m = 0; m < N_MODES; m++)
            printf("%-14s %11.2f %10.3f %16.2f %16.2f\n", mode_names[m], t[m] * 1e3, t[m] / t[LOCAL],
                   (double)peak[m] / 1048576.0, (double)pbytes[m] / 1048576.0);
        printf("memory per rank, predicted (ts_fsdp_memory_estimate) against measured (peak storage), MiB:\n%-14s %9s "
               "%9s %6s %7s %7s %7s %7s %7s %9s\n",
               "mode", "predicted", "measured", "ratio", "params", "grads", "optim", "group", "acts", "acts ckpt");
        for (int m = FSDP; m < N_MODES; m++) {
            const ts_fsdp_memory_report *p = &g_pred[m];
            printf("%-14s %9.2f %9.2f %6.3f %7.2f %7.2f %7.2f %4.2fx%d %7.2f %9.2f\n", mode_names[m],
                   p->peak_bytes / 1048576.0, peak[m] / 1048576.0, (double)p->peak_bytes / (double)peak[m],
                   p->param_bytes / 1048576.0, p->grad_bytes / 1048576.0, p->optim_bytes / 1048576.0,
                   p->group_bytes / 1048576.0, p->groups_in_flight, p->act_bytes / 1048576.0,
                   p->act_ckpt_bytes / 1048576.0);
        }
        {
            const double *v = ts_tensor_data(rss_t);
            printf("process memory per rank (peak RSS: VmHWM over the whole run; estimate: the largest mode's "
                   "rss_peak_bytes, floor + pool; tensors: the largest peak storage and its estimate):\n");
            for (int r = 0; r < W; r++)
                printf("rank %d: peak RSS %.1f MiB, estimate %.1f MiB (tensors %.1f MiB, estimate %.1f MiB)\n", r,
                       v[r * 4] / 1048576.0, v[r * 4 + 1] / 1048576.0, v[r * 4 + 2] / 1048576.0,
                       v[r * 4 + 3] / 1048576.0);
        }
        printf("offload against fsdp, same run (rank 0; step ms: medians of the three run again with their "
               "steps interleaved; bytes per step: given to the collectives, copied host-to-device before "
               "all-gathers, device-to-host after reduce-scatters):\n");
        printf("%-14s %9s %9s %9s %9s %9s %17s %14s %11s\n", "mode", "step ms", "vs fsdp", "coll MiB", "h2d MiB",
               "d2h MiB", "peak storage MiB", "of it host MiB", "pinned MiB");
        for (int i = 0; i < 3; i++) {
            int m = off_modes[i];
            printf("%-14s %9.2f %9.3f %9.3f %9.3f %9.3f %17.2f %14.2f %11.3f\n", mode_names[m], ti[i] * 1e3,
                   ti[i] / ti[0], g_bytes[m].coll / 1048576.0, g_bytes[m].h2d / 1048576.0, g_bytes[m].d2h / 1048576.0,
                   (double)peak[m] / 1048576.0, (double)g_bytes[m].host / 1048576.0,
                   (double)g_bytes[m].pinned / 1048576.0);
        }
        printf("offload / fsdp step time (interleaved): %.3f (pinned), %.3f (pageable); target <= 1.05\n",
               ti[1] / ti[0], ti[2] / ti[0]);
        double exposed = t[FSDP] - t[LOCAL], exposed_nopf = t[FSDP_NOPF] - t[LOCAL];
        printf("comm alone (the step's collectives, blocking, back to back): %.2f ms\n", comm * 1e3);
        printf("exposed (fsdp - local): prefetch on %.2f ms (%.2f x comm alone), off %.2f ms (%.2f x comm alone)\n",
               exposed * 1e3, exposed / comm, exposed_nopf * 1e3, exposed_nopf / comm);
        printf("%-10s %16s %16s\n", "mode", "all-gather B/step", "red-scatter B/step");
        for (int m = FSDP; m < N_MODES; m++)
            printf("%-10s %16.0f %16.0f\n", mode_names[m], g_bytes[m].ag, g_bytes[m].rs);
        printf("bf16 (f32 reduce) vs f32: step %.3f x (interleaved; target <= 0.65 with AVX512-BF16, <= 1.05 AVX2 "
               "only), all-gather bytes %.4f x (target 0.5), reduce-scatter bytes %.4f x, peak storage %.3f x; CPU: "
               "%s\n",
               ti[3] / ti[0], g_bytes[FSDP_BF16].ag / g_bytes[FSDP].ag, g_bytes[FSDP_BF16].rs / g_bytes[FSDP].rs,
               (double)peak[FSDP_BF16] / (double)peak[FSDP],
               __builtin_cpu_supports("avx512bf16") ? "avx512bf16"
                   : __builtin_cpu_supports("avx2") ? "avx2, no avx512bf16"
                                                    : "no avx2");
        printf(
            "fsdp-ac (every block checkpointed) vs fsdp: peak storage %.2f MiB vs %.2f MiB (%.3f x), step %.2f ms vs "
            "%.2f ms (%.3f x, interleaved)\n",
            (double)peak[FSDP_AC] / 1048576.0, (double)peak[FSDP] / 1048576.0,
            (double)peak[FSDP_AC] / (double)peak[FSDP], ti[4] * 1e3, ti[0] * 1e3, ti[4] / ti[0]);
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        printf("cores per rank: %.1f%s\n", (double)cores / W,
               (double)cores / W < 2 ? " (shared-memory transfers are copies made by the ranks' own CPUs, so with "
                                       "fewer than 2 cores per rank they take compute time and cannot be hidden: "
                                       "prefetch hides waiting, not copying)"
                                     : "");
    }
    if (rank == 0) {
        printf("optimizer and DDP, same run (rank 0; medians of %d steps; per step, the four modes in a rotating "
               "order, then one torch DDP step of each bucket size, the other ranks waiting):\n",
               c.steps);
        printf("%-24s %9s %9s %9s %9s\n", "mode", "step ms", "vs local", "optim ms", "optim %");
        for (int k = 0; k < VS_N; k++)
            printf("%-24s %9.2f %9.3f %9.2f %8.1f%%\n", vs_names[k], vs.step[k] * 1e3, vs.step[k] / vs.step[VS_LOCAL],
                   vs.opt[k] * 1e3, 100 * vs.opt[k] / vs.step[k]);
        int best = 0;
        for (int b = 0; b < vs.n_ddp; b++) {
            printf("%-24s %9.2f %9.3f %19s (%s)\n", "ddp", vs.ddp[b] * 1e3, vs.ddp[b] / vs.step[VS_LOCAL], "",
                   vs.ddp_label[b]);
            if (vs.ddp[b] < vs.ddp[best]) best = b;
        }
        printf("AdamW step (ts_optim_step), kernels %s: per-parameter %.2f ms (%.1f%% of the fsdp step), fused %.2f ms "
               "(%.1f%% of fsdp-fused); fused / per-parameter %.3f\n",
               ts__optim_update_path_name(), vs.opt[VS_FSDP] * 1e3, 100 * vs.opt[VS_FSDP] / vs.step[VS_FSDP],
               vs.opt[VS_FSDP_FUSED] * 1e3, 100 * vs.opt[VS_FSDP_FUSED] / vs.step[VS_FSDP_FUSED],
               vs.opt[VS_FSDP_FUSED] / vs.opt[VS_FSDP]);
        int f = vs.step[VS_FSDP_FUSED] < vs.step[VS_FSDP] ? VS_FSDP_FUSED : VS_FSDP;
        printf("fsdp / local: %.3f (%s / %s; target <= 1.03)\n",
               vs.step[f] / vs.step[f == VS_FSDP ? VS_LOCAL : VS_LOCAL_FUSED], vs_names[f],
               vs_names[f == VS_FSDP ? VS_LOCAL : VS_LOCAL_FUSED]);
        if (vs.n_ddp)
            printf("fsdp / ddp: %.3f (%s against torch 1.13 DDP over gloo, %s, %d ranks, one thread each; target <= "
                   "0.80)\n",
                   vs.step[f] / vs.ddp[best], vs_names[f], vs.ddp_label[best], W);
        else printf("fsdp / ddp: not measured: %s\n", vs.ddp_why ? vs.ddp_why : "DDP did not run");
    }
    ts_mesh_free(g_mesh);
    CHECK(ts_dist_finalize());
    ts_tensor_free(rss_t);
    return 0;
}
