/*
 * A parameter some ranks' backward gives no gradient (fully_shard/
 * param_group.c, [Note: unused parameters]; docs/fully_shard.md, "Unused
 * parameters"), over W loopback ranks run as threads
 * (tests/loopback_ranks.h). The model is two Branch modules, each its own
 * group: y = tanh(fc(x)) * gain, where a rank may skip gain (y = tanh(fc(x)))
 * or the whole branch (y = tanh(x): no gradient in its group at all), and
 * a parameter `never` that no rank uses. Each rank computes the expected
 * gradients unsharded: every rank's local gradients (NULL: zeros) summed
 * over ranks and microbatches and divided by the world size; the sharded
 * gradient of every rank (its rows) must equal that, a parameter no rank
 * used must have no gradient on any rank, and AdamW (whose decay would
 * move a parameter with any gradient) leaves it untouched. On 2 and 4
 * ranks (uneven rows: 6 over 4 leaves rank 3 empty), HSDP 2x2, the packed
 * and the copy-free reduce-scatter, accumulation without sync and with
 * it, HSDP's partial sums (requires_all_reduce false), bf16 parameters
 * with a float32 reduction, CPU offload and the persistent parameters'
 * bucket; and, flat and HSDP, bf16 and f16 reductions (16-bit flags), a
 * gradient divide factor (the reduce-scatter's pre-division, flags
 * included), force-sum, and a divide factor so large that an f16 flag
 * would underflow in the reduction.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "fully_shard/fully_shard.h"
#include "fully_shard/internal.h"
#include "optim/optim.h"
#include "tensor/kernels.h"
#include "tests/loopback_ranks.h"

#define D 6    /* features: rows of every parameter */
#define ROWS 3 /* batch rows per rank and microbatch */
#define NB 2   /* branches */
#define NP 8   /* parameters: per branch gain, never, fc.weight, fc.bias */
#define MAXMB 3

enum { SKIP_GAIN = 1, SKIP_ALL = 2 };

/* ------------------------------------------------------------ the module */

typedef struct branch {
    ts_module base;
    ts_module *fc;
    ts_tensor *gain, *never;
    unsigned skip; /* SKIP_GAIN, SKIP_ALL: set before each forward */
} branch;

static ts_status branch_forward(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    (void)n_in;
    branch *b = (branch *)m;
    ts_tensor *h = NULL, *a = NULL, *y = NULL;
    ts_status st = TS_OK;
    if (b->skip & SKIP_ALL) {
        st = ts_tanh(in[0], &y); /* no parameter of the group */
    } else {
        st = ts_module_call1(b->fc, in[0], &h);
        if (!st) st = ts_tanh(h, &a);
        if (!st && (b->skip & SKIP_GAIN)) y = ts_tensor_retain(a);
        else if (!st) st = ts_mul(a, b->gain, &y);
    }
    ts_tensor_free(h);
    ts_tensor_free(a);
    if (st) return st;
    out[0] = y;
    *n_out = 1;
    return TS_OK;
}

static ts_status branch_visit(ts_module *m, const ts_module_visitor *v)
{
    branch *b = (branch *)m;
    ts_status st = TS_OK;
    if (v->param && (st = v->param(v->ctx, "gain", &b->gain))) return st;
    if (v->param && (st = v->param(v->ctx, "never", &b->never))) return st;
    if (v->child) st = v->child(v->ctx, "fc", b->fc);
    return st;
}

static void branch_free(ts_module *m)
{
    branch *b = (branch *)m;
    ts_module_free(b->fc);
    ts_tensor_free(b->gain);
    ts_tensor_free(b->never);
    free(b);
}

static const ts_module_vtable branch_vt = {
    .type_name = "Branch", .forward = branch_forward, .visit = branch_visit, .free = branch_free};

/* Deterministic values (no generator): element i of parameter k. */
static void fill(ts_tensor *t, int k)
{
    float *f = ts_tensor_data(t);
    for (int64_t i = 0; i < ts_tensor_numel(t); i++) f[i] = (float)(0.5 + 0.3 * sin(1.3 * (double)(i + 7 * k)));
}

static ts_status branch_new(int k, ts_module **out)
{
    branch *b = calloc(1, sizeof *b);
    if (!b) return TS_ERR_NO_MEMORY;
    int64_t d = D;
    ts_status st = ts_module_init(&b->base, &branch_vt);
    /* ts_linear_new draws its initial values (overwritten below) from the
     * default generator, which the rank threads share: one at a time */
    pthread_mutex_lock(&th_build_mu);
    if (!st) st = ts_linear_new(D, D, true, &b->fc);
    pthread_mutex_unlock(&th_build_mu);
    if (!st) st = ts_param_new(TS_F32, 1, &d, &b->gain);
    if (!st) st = ts_param_new(TS_F32, 1, &d, &b->never);
    if (st) {
        branch_free(&b->base);
        return st;
    }
    ts_named_params np;
    if ((st = ts_module_named_parameters(b->fc, &np))) {
        branch_free(&b->base);
        return st;
    }
    for (int i = 0; i < np.n; i++) fill(*np.items[i].slot, 4 * k + i);
    ts_named_params_free(&np);
    fill(b->gain, 4 * k + 2);
    fill(b->never, 4 * k + 3);
    *out = &b->base;
    return TS_OK;
}

typedef struct model {
    ts_module *root, *br[NB];
    ts_tensor *ps[NP];
    char names[NP][64];
} model;

static ts_status model_new(model *m)
{
    memset(m, 0, sizeof *m);
    ts_module *c[NB] = {NULL};
    ts_status st = TS_OK;
    for (int k = 0; k < NB && !st; k++) st = branch_new(k, &c[k]);
    if (!st) st = ts_sequential_new(NB, c, &m->root);
    if (st) {
        for (int k = 0; k < NB; k++) ts_module_free(c[k]);
        return st;
    }
    for (int k = 0; k < NB; k++) m->br[k] = c[k];
    return TS_OK;
}

static ts_status model_slots(model *m)
{
    ts_named_params np;
    ts_status st = ts_module_named_parameters(m->root, &np);
    if (st) return st;
    if (np.n != NP) st = ts_error(TS_ERR_INTERNAL, "%d parameters, expected %d", np.n, NP);
    for (int i = 0; i < np.n && i < NP; i++) {
        m->ps[i] = *np.items[i].slot;
        snprintf(m->names[i], sizeof m->names[i], "%s", np.items[i].name);
    }
    ts_named_params_free(&np);
    return st;
}

/* A contiguous tensor's values as doubles (new; NULL when t's data is
 * not readable). Rank threads do not assert (th_vals does). */
static double *vals_new(const ts_tensor *t)
{
    int64_t n = ts_tensor_numel(t);
    const void *data = ts_tensor_data(t);
    double *v = malloc((size_t)(n ? n : 1) * sizeof *v);
    if (!v || (n && (!data || !ts_tensor_is_contiguous(t)))) {
        free(v);
        return NULL;
    }
    ts__buf_convert(TS_F64, v, ts_tensor_dtype(t), data, n);
    return v;
}

/* ------------------------------------------------------------ the cases */

typedef struct ucase {
    int W;
    bool hsdp, copy_free, bf16, offload, persist;
    int mb;         /* microbatches of one step */
    bool nosync;    /* microbatches before the last without gradient sync (else each synced) */
    bool ar_last;   /* HSDP: microbatches before the last reduce-scatter without all-reduce (partial sums) */
    ts_dtype rd;    /* reduce_dtype with float32 parameters (0: none set) */
    double factor;  /* ts_fsdp_set_gradient_divide_factor (0: none set) */
    bool force_sum; /* ts_fsdp_set_force_sum_reduction_for_comms */
    bool any_grad;  /* only that a used parameter has a gradient (the values underflow) */
    unsigned skip[MAXMB][TH_MAXW][NB]; /* per microbatch, rank, branch */
} ucase;

/* One microbatch's forward and backward of rank r's rows. */
static ts_status fwd_bwd(model *m, const ucase *u, int mb, int r)
{
    for (int k = 0; k < NB; k++) ((branch *)m->br[k])->skip = u->skip[mb][r][k];
    int64_t row0 = (int64_t)(mb * u->W + r) * ROWS;
    return th_mse_backward_rows(m->root, row0, ROWS, D, D);
}

/* The expected gradients: every rank's local ones summed over ranks and
 * microbatches, divided by W or by the divide factor (want[i] NULL: no
 * rank had one). */
static ts_status expected(const ucase *u, double *want[NP], int64_t numel[NP])
{
    model m;
    ts_status st = model_new(&m);
    if (!st) st = model_slots(&m);
    for (int mb = 0; mb < u->mb && !st; mb++)
        for (int r = 0; r < u->W && !st; r++) st = fwd_bwd(&m, u, mb, r);
    for (int i = 0; i < NP && !st; i++) {
        numel[i] = ts_tensor_numel(m.ps[i]);
        ts_tensor *g = ts_tensor_grad(m.ps[i]);
        want[i] = NULL;
        if (!g) continue;
        if (!(want[i] = vals_new(g))) {
            st = ts_error(TS_ERR_INTERNAL, "the reference gradient of %s is not readable", m.names[i]);
            break;
        }
        for (int64_t e = 0; e < numel[i]; e++) want[i][e] /= u->factor > 0 ? u->factor : u->W;
    }
    ts_module_free(m.root);
    return st;
}

static int rank_case(th_rank *rc)
{
    const ucase *u = rc->arg;
    double *want[NP] = {NULL};
    int64_t numel[NP];
    model m;
    memset(&m, 0, sizeof m);
    ts_mesh *mesh = NULL;
    ts_optim *opt = NULL;
    double *before[NP] = {NULL};
    int rv = 1;
    TH_RK_OK(rc, expected(u, want, numel));
    TH_RK_OK(rc, model_new(&m));
    mesh = th_rank_mesh(rc, u->hsdp);
    if (!mesh) {
        rv = th_rank_fail(rc, "mesh: %s", ts_last_error());
        goto done;
    }
    ts_fsdp_options o = ts_fsdp_options_default();
    o.mesh = mesh;
    ts_mp_policy mp = ts_mp_policy_default();
    mp.param_dtype = TS_BF16;
    mp.reduce_dtype = TS_F32;
    if (u->bf16) o.mp_policy = &mp;
    ts_mp_policy narrow = ts_mp_policy_default();
    narrow.reduce_dtype = u->rd;
    if (u->rd) o.mp_policy = &narrow;
    ts_offload_policy off = ts_offload_policy_default();
    if (u->offload) o.offload_policy = &off;
    if (u->persist) o.persist_threshold_numel = D + 1; /* gain, never and fc.bias: whole, all-reduced in the bucket */
#define GO(expr) \
    do { \
        ts_status s_ = (expr); \
        if (s_) { \
            rv = th_rank_fail(rc, "%s -> %s: %s", #expr, ts_status_name(s_), ts_last_error()); \
            goto done; \
        } \
    } while (0)
    GO(ts_fully_shard_each(NB, m.br, &o));
    GO(ts_fully_shard(m.root, &o));
    for (int k = 0; k < NB; k++) ts__fsdp_state_of(m.br[k])->group->copy_free = u->copy_free;
    ts_module *mods[1 + NB] = {m.root, m.br[0], m.br[1]};
    for (int k = 0; k < 1 + NB; k++) { /* not recursive: each module's own group */
        if (u->factor > 0) GO(ts_fsdp_set_gradient_divide_factor(mods[k], u->factor));
        GO(ts_fsdp_set_force_sum_reduction_for_comms(mods[k], u->force_sum));
    }
    GO(model_slots(&m));
    ts_adam_options ao = ts_adamw_options_default(); /* weight decay: a parameter stepped without a gradient moves */
    ao.lr = 0.05;
    GO(ts_adamw_new(NP, m.ps, &ao, &opt));
    for (int mb = 0; mb < u->mb; mb++) {
        bool sync = !u->nosync || mb == u->mb - 1;
        GO(ts_fsdp_set_requires_gradient_sync(m.root, sync, true));
        GO(ts_fsdp_set_requires_all_reduce(m.root, !u->ar_last || mb == u->mb - 1, true));
        GO(fwd_bwd(&m, u, mb, rc->rank));
    }
    int Ws = u->hsdp ? rc->W / 2 : rc->W, srank = rc->rank % Ws;
    /* fp32: the same sums in another order; bf16 parameters: the forward
     * and backward in bf16 (8 bits of mantissa) against float32 */
    double tol = u->bf16 || u->rd == TS_BF16 ? 3e-2 : 2e-6;
    /* a float16 reduction: 11 bits of mantissa for the bf16 case's 8, the
     * same number of roundings */
    if (u->rd == TS_F16) tol = 3e-2 / 8;
    for (int i = 0; i < NP; i++) {
        ts_tensor *p = m.ps[i], *g = ts_tensor_grad(p);
        if (!want[i]) {
            if (g) {
                rv = th_rank_fail(rc, "%s: no rank used it, yet it has a gradient", m.names[i]);
                goto done;
            }
            if (!(before[i] = vals_new(p))) {
                rv = th_rank_fail(rc, "%s: not readable", m.names[i]);
                goto done;
            }
            continue;
        }
        if (!g) {
            rv = th_rank_fail(rc, "%s: some rank used it, yet this rank's shard has no gradient", m.names[i]);
            goto done;
        }
        if (u->any_grad) continue;
        int64_t rows = D, row_numel = numel[i] / D, local_rows = ts_tensor_numel(p) / row_numel;
        int64_t row0 = local_rows == rows && !ts_fsdp_param_dtensor(p) ? 0 : srank * ((rows + Ws - 1) / Ws);
        double *got = vals_new(g);
        if (!got) {
            rv = th_rank_fail(rc, "%s: its gradient is not readable", m.names[i]);
            goto done;
        }
        double scale = 0;
        for (int64_t e = 0; e < numel[i]; e++) scale = fmax(scale, fabs(want[i][e]));
        for (int64_t e = 0; e < local_rows * row_numel; e++) {
            double w = want[i][row0 * row_numel + e];
            if (!(fabs(got[e] - w) <= tol * (fabs(w) + scale) + 1e-7)) {
                rv = th_rank_fail(rc, "%s: local element %lld (row %lld) is %.8g, expected %.8g", m.names[i],
                                  (long long)e, (long long)(row0 + e / row_numel), got[e], w);
                free(got);
                goto done;
            }
        }
        free(got);
    }
    GO(ts_optim_step(opt));
    for (int i = 0; i < NP; i++) {
        if (!before[i]) continue;
        double *now = vals_new(m.ps[i]);
        int64_t n = ts_tensor_numel(m.ps[i]);
        bool same = now && memcmp(now, before[i], (size_t)n * sizeof *now) == 0;
        free(now);
        if (!same) {
            rv = th_rank_fail(rc, "%s: no gradient anywhere, yet the optimizer moved it", m.names[i]);
            goto done;
        }
    }
    rv = 0;
done:
    for (int i = 0; i < NP; i++) {
        free(want[i]);
        free(before[i]);
    }
    ts_optim_free(opt);
    ts_module_free(m.root);
    ts_mesh_free(mesh);
    return rv;
#undef GO
}

static void run(const ucase *u) { th_run_world(u->W, rank_case, (void *)u, 60.0); }

/* Both reduce-scatter paths of a case. */
static void run_both(ucase u)
{
    u.copy_free = false;
    run(&u);
    u.copy_free = true;
    run(&u);
}

/* ------------------------------------------------------------ tests */

/* The case: rank 1 skips branch 0's gain; rank 0 and rank 1 both
 * get half of rank 0's gradient on their rows. */
Test(fully_shard_unused_params, one_rank_skips_a_parameter_on_2_ranks, .timeout = 120)
{
    ucase u = {.W = 2, .mb = 1};
    u.skip[0][1][0] = SKIP_GAIN;
    run_both(u);
}

/* 4 ranks, uneven rows (rank 3 holds none): rank 2 skips branch 0's gain,
 * rank 0 skips the whole of branch 1 (its group has no gradient on rank
 * 0, which still takes part in the reduction: its pre-backward ran, the
 * branch's output depending on its input). */
Test(fully_shard_unused_params, four_ranks_and_a_whole_group_skipped, .timeout = 120)
{
    ucase u = {.W = 4, .mb = 1};
    u.skip[0][2][0] = SKIP_GAIN;
    u.skip[0][0][1] = SKIP_ALL;
    run_both(u);
}

/* No rank uses branch 1's gain: no gradient anywhere, AdamW leaves it
 * alone (and every `never`). */
Test(fully_shard_unused_params, unused_everywhere_keeps_no_gradient, .timeout = 120)
{
    ucase u = {.W = 2, .mb = 1};
    u.skip[0][0][1] = u.skip[0][1][1] = SKIP_GAIN;
    run_both(u);
}

/* HSDP 2x2: the skipping rank's replica and shard peers both had it. */
Test(fully_shard_unused_params, hsdp_2x2, .timeout = 120)
{
    ucase u = {.W = 4, .hsdp = true, .mb = 1};
    u.skip[0][3][0] = SKIP_GAIN;
    u.skip[0][1][1] = SKIP_ALL;
    run_both(u);
    ucase v = {.W = 4, .hsdp = true, .mb = 1}; /* only one replica's shard group had it */
    v.skip[0][0][0] = v.skip[0][1][0] = SKIP_GAIN;
    run_both(v);
}

/* Accumulation without sync: rank 1 uses gain in the first microbatch
 * only (its gradient from there is kept and reduced at the last), rank 0
 * in the last only; branch 1's gain only rank 0's first microbatch. */
Test(fully_shard_unused_params, accumulation_without_sync, .timeout = 120)
{
    ucase u = {.W = 2, .mb = 3, .nosync = true};
    u.skip[0][0][0] = u.skip[1][0][0] = SKIP_GAIN;
    u.skip[1][1][0] = u.skip[2][1][0] = SKIP_GAIN;
    u.skip[0][1][1] = u.skip[1][0][1] = u.skip[1][1][1] = u.skip[2][0][1] = u.skip[2][1][1] = SKIP_GAIN;
    run_both(u);
    u.hsdp = true; /* and HSDP's partial sums */
    u.W = 4;
    run_both(u);
}

/* HSDP with requires_all_reduce false before the last microbatch: the
 * reduce-scattered partial sums remember that a parameter had a gradient
 * in an earlier microbatch (branch 1's gain: only rank 0's first), and
 * the final all-reduce carries that across the replicas. */
Test(fully_shard_unused_params, hsdp_partial_sums, .timeout = 120)
{
    ucase u = {.W = 4, .hsdp = true, .mb = 3, .ar_last = true};
    for (int mb = 0; mb < 3; mb++) {
        u.skip[mb][3][0] = SKIP_GAIN;
        for (int r = 0; r < 4; r++) u.skip[mb][r][1] = mb == 0 && r == 0 ? 0 : SKIP_GAIN;
    }
    u.skip[1][2][1] = SKIP_ALL;
    run_both(u);
}

/* Accumulation with sync: every microbatch reduces and adds into the
 * shard gradients; a parameter nobody used in one microbatch but used in
 * another keeps the sum of the others. */
Test(fully_shard_unused_params, accumulation_with_sync, .timeout = 120)
{
    ucase u = {.W = 2, .mb = 3};
    u.skip[0][1][0] = SKIP_GAIN;
    u.skip[1][0][0] = u.skip[1][1][0] = SKIP_GAIN;
    u.skip[2][0][1] = SKIP_ALL;
    run_both(u);
}

Test(fully_shard_unused_params, bf16_params_f32_reduce, .timeout = 120)
{
    ucase u = {.W = 2, .mb = 2, .bf16 = true, .nosync = true};
    u.skip[0][1][0] = u.skip[1][1][0] = SKIP_GAIN;
    u.skip[1][0][1] = SKIP_GAIN;
    run_both(u);
}

Test(fully_shard_unused_params, offload, .timeout = 120)
{
    ucase u = {.W = 2, .mb = 1, .offload = true};
    u.skip[0][1][0] = SKIP_GAIN;
    u.skip[0][0][1] = SKIP_ALL;
    run_both(u);
}

/* gain, never and fc.bias below persist_threshold_numel: whole on every
 * rank, all-reduced in one bucket with the same semantics. */
Test(fully_shard_unused_params, persistent_parameters, .timeout = 120)
{
    ucase u = {.W = 2, .mb = 1, .persist = true};
    u.skip[0][1][0] = SKIP_GAIN;
    u.skip[0][0][1] = SKIP_ALL;
    run(&u);
    ucase h = {.W = 4, .mb = 2, .persist = true, .hsdp = true, .nosync = true};
    h.skip[0][2][0] = h.skip[1][2][0] = SKIP_GAIN;
    h.skip[1][3][1] = SKIP_GAIN;
    run(&h);
}

/* ------------------------------------------------------------ the reduction's settings */

/* One rank skips branch 0's gain, another the whole of branch 1 (on 4
 * ranks), and no rank uses branch 1's gain on 2: flat and HSDP, both
 * reduce-scatter paths, and the persistent bucket. */
static void run_settings(ucase u)
{
    ucase a = u;
    a.W = 2;
    a.mb = 1;
    a.skip[0][1][0] = SKIP_GAIN;
    a.skip[0][0][1] = a.skip[0][1][1] = SKIP_GAIN;
    run_both(a);
    ucase h = u;
    h.W = 4;
    h.mb = 1;
    h.hsdp = true;
    h.skip[0][3][0] = SKIP_GAIN;
    h.skip[0][1][1] = SKIP_ALL;
    run_both(h);
    h.skip[0][0][1] = h.skip[0][2][1] = h.skip[0][3][1] = SKIP_GAIN; /* branch 1's gain: nobody's */
    run_both(h);
    ucase p = a;
    p.persist = true;
    run(&p);
    p = h;
    p.persist = true;
    run(&p);
}

/* The flags themselves 16-bit. */
Test(fully_shard_unused_params, bf16_reduce_dtype, .timeout = 300) { run_settings((ucase){.rd = TS_BF16}); }

Test(fully_shard_unused_params, f16_reduce_dtype, .timeout = 300) { run_settings((ucase){.rd = TS_F16}); }

/* A divide factor other than W: each input divided by it before the sum
 * (the reduce-scatter's pre-division), flags included. */
Test(fully_shard_unused_params, gradient_divide_factor, .timeout = 300)
{
    run_settings((ucase){.factor = 3.0});
    run_settings((ucase){.factor = 0.5});
    run_settings((ucase){.factor = 3.0, .rd = TS_F16});
    run_settings((ucase){.factor = 3.0, .rd = TS_BF16});
}

/* SUM collectives, one division at the end (by W or by the factor). */
Test(fully_shard_unused_params, force_sum_reduction, .timeout = 300)
{
    run_settings((ucase){.force_sum = true});
    run_settings((ucase){.force_sum = true, .factor = 3.0});
    run_settings((ucase){.force_sum = true, .rd = TS_F16});
    run_settings((ucase){.force_sum = true, .rd = TS_BF16, .factor = 5.0});
}

/* A factor so large that a float16 flag (at most 32768 before the
 * division) divided by it underflows to zero: the parameter one rank used
 * still gets its (underflowed, zero) gradient on every rank rather than
 * none, and a parameter nobody used still none. */
Test(fully_shard_unused_params, f16_flags_survive_a_huge_divide_factor, .timeout = 300)
{
    run_settings((ucase){.rd = TS_F16, .factor = 1e13, .any_grad = true});
    run_settings((ucase){.rd = TS_F16, .factor = 1e13, .force_sum = true, .any_grad = true});
    run_settings((ucase){.rd = TS_F32, .factor = 1e200, .any_grad = true});
}
