/* bench/fsdp_overhead: what fully_shard costs per group when the groups
 * are tiny, so that the host work around each group (hooks, autograd
 * markers, allocations, bookkeeping, issuing collectives) is all there is
 * to see (issue 12 §2; FSDP2 users report half the step in pre_forward
 * with many small modules, pytorch#173680).
 *
 * The model: a Sequential of --groups (256) Linear(16, 16) with bias, each
 * Linear fully_shard'ed, then the root (which is left no parameter); SGD
 * (lr 0.01); batch (4, 16); loss: the mean of the output. The same model
 * unsharded runs in the same process, its steps interleaved with the
 * sharded one's (a step of each in turn, the order alternating), so that a
 * machine whose load changes slows both alike.
 *
 * Per round (--rounds, 5), --steps (20) timed steps of each variant after
 * 2 warm-up steps; a step is forward, backward, SGD step, zero_grad.
 * Variants:
 *   local    the unsharded model (no communication);
 *   fsdp     fully_shard, tracing off (the figure the targets are about);
 *   traced   the same fsdp model once more with TS_TRACE spans on, to
 *            measure the time the compute thread waits for collectives
 *            (fully_shard's wait spans: fsdp.wait_all_gather,
 *            fsdp.wait_reduce) and the hook spans.
 * Per group per step (medians over rounds of the per-round medians):
 *   whole      (fsdp - local) / groups;
 *   wait       the wait spans of a traced step / groups;
 *   host       (traced - wait - local) / groups, each traced step against
 *              the local step of the same iteration: fully_shard's time
 *              outside waiting for collectives (hooks, allocations,
 *              autograd markers, bookkeeping, issuing the collectives; the
 *              tracing itself included, so it errs high);
 *   comm alone the step's collectives (per group: 2 all-gathers, 1
 *              reduce-scatter, of the group's buffers) run alone, blocking,
 *              back to back, / groups: what the collectives take by
 *              themselves.
 * Targets (issue 12): whole <= 40 us, host < 20 us per group at W = 2.
 *
 * Usage: tsrun --nproc-per-node 2 bench_fsdp_overhead [--groups G]
 *        [--steps N] [--rounds R] [--persist NUMEL] [--only local|fsdp]
 *        bench_fsdp_overhead [...]   (W = 1, no launcher: the one-rank world)
 * --only local|fsdp runs only that model's steps, untraced, and prints
 * nothing but the step time (for profilers: callgrind's instruction
 * counts of the two runs give the cost per group exactly).
 * --persist NUMEL sets ts_fsdp_options.persist_threshold_numel for the
 * sharded model (0, the default: off); above 272 every Linear's weight and
 * bias stay replicated: no all-gather, one all-reduce per step. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/bench_common.h"
#include "tensorshard.h"

#define DIM 16
#define BATCH 4
#define MAX_STEPS 256
#define MAX_ROUNDS 32

typedef struct cfg {
    int groups, steps, rounds;
    int64_t persist;
    int only; /* 0 both; 1 local only; 2 fsdp only */
} cfg;

typedef struct model {
    ts_module *m;
    ts_optim *opt;
} model;

static void model_new(const cfg *c, bool fsdp, model *out)
{
    ts_manual_seed(3);
    ts_module **lin = malloc((size_t)c->groups * sizeof *lin);
    for (int i = 0; i < c->groups; i++) CHECK(ts_linear_new(DIM, DIM, true, &lin[i]));
    CHECK(ts_sequential_new(c->groups, lin, &out->m));
    if (fsdp) {
        ts_fsdp_options o = ts_fsdp_options_default();
        o.persist_threshold_numel = c->persist;
        for (int i = 0; i < c->groups; i++) CHECK(ts_fully_shard(lin[i], &o));
        CHECK(ts_fully_shard(out->m, &o));
    }
    free(lin);
    ts_named_params np;
    CHECK(ts_module_named_parameters(out->m, &np));
    ts_tensor **ps = malloc((size_t)np.n * sizeof *ps);
    for (int i = 0; i < np.n; i++) ps[i] = *np.items[i].slot;
    ts_sgd_options so = ts_sgd_options_default();
    so.lr = 0.01;
    CHECK(ts_sgd_new(np.n, ps, &so, &out->opt));
    free(ps);
    ts_named_params_free(&np);
}

static void model_free(model *m)
{
    ts_optim_free(m->opt);
    ts_module_free(m->m);
}

static void train_step(model *m, ts_tensor *x)
{
    ts_tensor *y, *loss;
    CHECK(ts_module_call1(m->m, x, &y));
    CHECK(ts_mean(y, 0, NULL, false, &loss));
    CHECK(ts_backward(loss, NULL, false));
    CHECK(ts_optim_step(m->opt));
    ts_optim_zero_grad(m->opt, true);
    ts_tensor_free(y);
    ts_tensor_free(loss);
}

/* The step's collectives alone: per group 2 all-gathers and 1
 * reduce-scatter of its sizes, blocking, back to back (median seconds per
 * step over n steps). */
static double comm_alone(const cfg *c, int64_t shard_numel, int n)
{
    ts_comm *w = ts_dist_world();
    int64_t full = shard_numel * ts_comm_size(w);
    ts_tensor *in, *out;
    CHECK(ts_tensor_zeros(TS_F32, 1, &shard_numel, &in));
    CHECK(ts_tensor_zeros(TS_F32, 1, &full, &out));
    double t[MAX_STEPS];
    for (int s = -2; s < n; s++) {
        CHECK(ts_barrier(w, NULL));
        double t0 = bench_now_s();
        for (int g = 0; g < c->groups; g++) {
            for (int k = 0; k < 2; k++) CHECK(ts_all_gather_into_tensor(w, out, in, NULL));
            CHECK(ts_reduce_scatter_tensor(w, in, out, TS_REDUCE_AVG, 1.0, 1.0, NULL));
        }
        if (s >= 0) t[s] = bench_now_s() - t0;
    }
    ts_tensor_free(in);
    ts_tensor_free(out);
    return bench_median(t, n);
}

static const char *k_waits[] = {"fsdp.wait_all_gather", "fsdp.wait_reduce"};
static const char *k_hooks[] = {"fsdp.pre_forward", "fsdp.post_forward", "fsdp.pre_backward", "fsdp.post_backward"};

static double span_ns(const char *const *names, int n)
{
    double s = 0;
    for (int i = 0; i < n; i++) s += (double)ts_trace_total_ns(names[i]);
    return s;
}

static void usage(const char *argv0)
{
    fprintf(stderr,
            "usage: [tsrun --nproc-per-node 2] %s [--groups G (1..4096)] [--steps N (1..%d)] [--rounds R (1..%d)]"
            " [--persist NUMEL (>= 0)] [--only local|fsdp]\n",
            argv0, MAX_STEPS, MAX_ROUNDS);
}

int main(int argc, char **argv)
{
    cfg c = {.groups = 256, .steps = 20, .rounds = 5};
    if ((argc - 1) % 2) {
        usage(argv[0]);
        return 2;
    }
    for (int i = 1; i + 1 < argc; i += 2) {
        long long v = atoll(argv[i + 1]);
        if (!strcmp(argv[i], "--groups")) c.groups = (int)v;
        else if (!strcmp(argv[i], "--steps")) c.steps = (int)v;
        else if (!strcmp(argv[i], "--rounds")) c.rounds = (int)v;
        else if (!strcmp(argv[i], "--persist")) c.persist = v;
        else if (!strcmp(argv[i], "--only") && !strcmp(argv[i + 1], "local")) c.only = 1;
        else if (!strcmp(argv[i], "--only") && !strcmp(argv[i + 1], "fsdp")) c.only = 2;
        else {
            usage(argv[0]);
            return 2;
        }
    }
    if (c.groups < 1 || c.groups > 4096 || c.steps < 1 || c.steps > MAX_STEPS || c.rounds < 1 ||
        c.rounds > MAX_ROUNDS || c.persist < 0) {
        usage(argv[0]);
        return 2;
    }
    ts_launch_rank_guard();
    bool launched = getenv("WORLD_SIZE") != NULL;
    if (launched) CHECK(ts_dist_init(NULL));
    ts_comm *w = ts_dist_world();
    int rank = ts_comm_rank(w), W = ts_comm_size(w);
    bool traced_outside = ts_trace_enabled(); /* TS_TRACE set: keep the user's trace, skip our toggling */

    model local, fsdp;
    model_new(&c, false, &local);
    model_new(&c, true, &fsdp);
    int64_t xs[2] = {BATCH, DIM};
    ts_tensor *x;
    ts_manual_seed(100 + (uint64_t)rank);
    CHECK(ts_randn(TS_F32, 2, xs, NULL, &x));

    double r_local[MAX_ROUNDS], r_fsdp[MAX_ROUNDS], r_traced[MAX_ROUNDS], r_wait[MAX_ROUNDS], r_hooks[MAX_ROUNDS];
    double r_host[MAX_ROUNDS];
    if (c.only) { /* one model's steps alone, for a profiler */
        model *m = c.only == 1 ? &local : &fsdp;
        double t[MAX_STEPS];
        for (int s = -2; s < c.steps; s++) {
            CHECK(ts_barrier(w, NULL));
            double t0 = bench_now_s();
            train_step(m, x);
            if (s >= 0) t[s] = bench_now_s() - t0;
        }
        if (rank == 0)
            printf("bench_fsdp_overhead --only %s: %d ranks, %d groups, %d steps: median step %.3f ms\n",
                   c.only == 1 ? "local" : "fsdp", W, c.groups, c.steps, bench_median(t, c.steps) * 1e3);
        c.rounds = 0;
    }
    double calls_per_step[TS_COLL_KIND_COUNT] = {0};
    for (int r = 0; r < c.rounds; r++) {
        double tl[MAX_STEPS], tf[MAX_STEPS], tt[MAX_STEPS], wt[MAX_STEPS], ht[MAX_STEPS], hs[MAX_STEPS];
        for (int s = -2; s < c.steps; s++) {
            /* local and fsdp in alternating order, then the traced step */
            for (int k = 0; k < 2; k++) {
                bool do_fsdp = (k + s) % 2 == 0;
                CHECK(ts_barrier(w, NULL));
                double t0 = bench_now_s();
                train_step(do_fsdp ? &fsdp : &local, x);
                double dt = bench_now_s() - t0;
                if (s >= 0) (do_fsdp ? tf : tl)[s] = dt;
            }
            if (traced_outside) continue;
            ts_comm_counters k0, k1;
            ts_comm_stats(w, &k0);
            CHECK(ts_trace_start("/dev/null"));
            CHECK(ts_barrier(w, NULL));
            double t0 = bench_now_s();
            train_step(&fsdp, x);
            double dt = bench_now_s() - t0;
            double wns = span_ns(k_waits, 2), hns = span_ns(k_hooks, 4);
            CHECK(ts_trace_stop(false));
            ts_comm_stats(w, &k1);
            if (s >= 0) {
                tt[s] = dt;
                wt[s] = wns * 1e-9;
                hs[s] = dt - wt[s] - tl[s];
                ht[s] = hns * 1e-9;
            }
            if (r == 0 && s == 0)
                for (int k = 0; k < TS_COLL_KIND_COUNT; k++)
                    calls_per_step[k] = (double)(k1.calls[k] - k0.calls[k]) - (k == TS_COLL_BARRIER ? 1 : 0);
        }
        r_local[r] = bench_median(tl, c.steps);
        r_fsdp[r] = bench_median(tf, c.steps);
        r_traced[r] = traced_outside ? 0 : bench_median(tt, c.steps);
        r_wait[r] = traced_outside ? 0 : bench_median(wt, c.steps);
        r_hooks[r] = traced_outside ? 0 : bench_median(ht, c.steps);
        r_host[r] = traced_outside ? 0 : bench_median(hs, c.steps);
        if (rank == 0)
            printf("round %d: local %.3f ms, fsdp %.3f ms, traced %.3f ms (waits %.3f ms, hook spans %.3f ms); whole "
                   "%.1f us/group, host %.1f us/group\n",
                   r, r_local[r] * 1e3, r_fsdp[r] * 1e3, r_traced[r] * 1e3, r_wait[r] * 1e3, r_hooks[r] * 1e3,
                   (r_fsdp[r] - r_local[r]) / c.groups * 1e6, r_host[r] / c.groups * 1e6);
    }
    if (!c.rounds) {
        ts_tensor_free(x);
        model_free(&fsdp);
        model_free(&local);
        if (launched) CHECK(ts_dist_finalize());
        return 0;
    }
    ts_fsdp_group_info gi;
    ts_module *first;
    CHECK(ts_module_get_submodule(fsdp.m, "0", &first));
    CHECK(ts_fsdp_group_info_get(first, &gi));
    int64_t shard = gi.shard_numel ? gi.shard_numel : (DIM * DIM + DIM + W - 1) / W;
    double comm = comm_alone(&c, shard, c.steps);

    double whole_r[MAX_ROUNDS];
    for (int r = 0; r < c.rounds; r++) whole_r[r] = (r_fsdp[r] - r_local[r]) / c.groups;
    double local_ms = bench_median(r_local, c.rounds) * 1e3, fsdp_ms = bench_median(r_fsdp, c.rounds) * 1e3;
    double traced_ms = bench_median(r_traced, c.rounds) * 1e3;
    double wait_us = bench_median(r_wait, c.rounds) / c.groups * 1e6;
    double hooks_us = bench_median(r_hooks, c.rounds) / c.groups * 1e6;
    double whole_us = bench_median(whole_r, c.rounds) * 1e6, host_us = bench_median(r_host, c.rounds) / c.groups * 1e6;
    if (rank == 0) {
        printf("bench_fsdp_overhead: %d ranks, %d groups of Linear(%d, %d), SGD, batch (%d, %d), persist threshold "
               "%lld; %d rounds of %d steps (medians of the rounds' medians; local and fsdp interleaved)\n",
               W, c.groups, DIM, DIM, BATCH, DIM, (long long)c.persist, c.rounds, c.steps);
        printf("step: local %.3f ms, fsdp %.3f ms (%.2fx), traced fsdp %.3f ms\n", local_ms, fsdp_ms,
               fsdp_ms / local_ms, traced_ms);
        if (!traced_outside)
            printf("collectives per fsdp step: %.0f all-gather, %.0f reduce-scatter, %.0f all-reduce\n",
                   calls_per_step[TS_COLL_ALL_GATHER], calls_per_step[TS_COLL_REDUCE_SCATTER],
                   calls_per_step[TS_COLL_ALL_REDUCE]);
        printf("per group per step: whole %.1f us (target <= 40), wait in collectives %.1f us, host %.1f us "
               "(target < 20), hook spans %.1f us (traced), comm alone %.1f us (2 all-gathers + 1 reduce-scatter of "
               "%lld elements, blocking)\n",
               whole_us, wait_us, host_us, hooks_us, comm / c.groups * 1e6, (long long)shard);
        if (traced_outside) printf("(TS_TRACE was set: no traced variant, wait and host not measured)\n");
    }
    ts_tensor_free(x);
    model_free(&fsdp);
    model_free(&local);
    if (launched) CHECK(ts_dist_finalize());
    return 0;
}
