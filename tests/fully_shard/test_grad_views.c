/*
 * fully_shard's shard gradients as views of the reduction's output
 * (fully_shard/param_group.c, finish_reduce and accumulate_target), over
 * W loopback ranks run as threads (tests/loopback_ranks.h):
 *  - a parameter without a gradient gets a view of the reduce-scatter
 *    output (or of its cast) at its offset: a group's gradients share one
 *    storage in the shard layout (data pointers checked);
 *  - on the copy-free path, gradients that are such views take the next
 *    reduction straight from the collective (ts__direct_reduce_scatter_add:
 *    no output buffer, no separate add; counted by the group's n_rs_add,
 *    and n_grad_adds stays 0), while a cast (bf16 reduce), HSDP's
 *    all-reduce, offload and the packed path keep the separate add;
 *  - every gradient and every parameter after SGD and AdamW steps (fused
 *    and not) is bitwise what the packed path gives (the behaviour before
 *    the views: the same sums, added by a separate pass), on 2 and 3
 *    ranks (uneven rows, an empty trailing rank), and accumulation over 3
 *    synced backwards is bitwise the per-backward gradients summed by
 *    hand;
 *  - the fused optimizer steps a group whose shards are contiguous in one
 *    kernel call (ts__optim_fused_calls against the runs the layout has);
 *  - a gradient tensor the caller keeps after zero_grad(set_to_none) is
 *    not written by later backwards; one the caller sets is accumulated
 *    into (it is the gradient), with the separate add;
 *  - a reduction a backward that is not the last leaves in flight does
 *    not write into the gradients;
 *  - an accumulating reduction dropped after a failed backward drops the
 *    gradients it had been adding into (set to none), not left mixed.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "fully_shard/fully_shard.h"
#include "fully_shard/internal.h"
#include "optim/internal.h"
#include "optim/optim.h"
#include "tensor/internal.h"
#include "tensor/kernels.h"
#include "tests/loopback_ranks.h"

typedef th_rank rank_ctx;
#define fail th_rank_fail
#define RK_OK TH_RK_OK

#define IN 6
#define H1 8 /* over 3 ranks: 3, 3, 2 rows (padding after rank 2's weight) */
#define H2 4
#define OUT 2 /* over 3 ranks: rank 2 empty */
#define ROWS 12
#define NP 6

typedef struct mlp {
    ts_module *root, *lin[3];
    ts_tensor *ps[NP];
    ts_optim *opt;
} mlp;

typedef struct gv_arg {
    int steps, accum; /* steps, each of accum synced backwards */
    bool adam, fused;
    bool bf16;        /* param_dtype bf16, reduce_dtype f32: no cast of the result */
    bool bf16_reduce; /* reduce_dtype bf16: the result is cast back (separate add) */
    bool offload, hsdp;
    bool keep_grads; /* zero_grad(set_to_none = false) between steps */
    bool expect_add; /* the copy-free model's accumulations are added by the collective */
    bool separate;   /* the copy-free model's reductions on a group and channel of their own */
} gv_arg;

static ts_status mlp_new(ts_mesh *mesh, const gv_arg *a, bool copy_free, mlp *m)
{
    memset(m, 0, sizeof *m);
    ts_status st = th_mlp3_new(11, IN, H1, H2, OUT, &m->root, m->lin);
    if (st) return st;
    ts_fsdp_options o = ts_fsdp_options_default();
    o.mesh = mesh;
    ts_offload_policy pol = ts_offload_policy_default();
    if (a->offload) o.offload_policy = &pol;
    ts_mp_policy mp = ts_mp_policy_default();
    mp.param_dtype = TS_BF16;
    mp.reduce_dtype = a->bf16_reduce ? TS_BF16 : TS_F32;
    mp.output_dtype = TS_F32;
    if (a->bf16 || a->bf16_reduce) o.mp_policy = &mp;
    if ((st = ts_fully_shard_each(3, m->lin, &o)) || (st = ts_fully_shard(m->root, &o))) return st;
    for (int l = 0; l < 3; l++) ts__fsdp_state_of(m->lin[l])->group->copy_free = copy_free;
    if ((st = th_param_slots(m->root, NP, m->ps))) return st;
    if (a->adam) {
        ts_adam_options ao = ts_adamw_options_default();
        ao.lr = 0.01;
        ao.fused = a->fused;
        return ts_adamw_new(NP, m->ps, &ao, &m->opt);
    }
    ts_sgd_options so = ts_sgd_options_default();
    so.lr = 0.05;
    so.momentum = 0.9;
    so.fused = a->fused;
    return ts_sgd_new(NP, m->ps, &so, &m->opt);
}

static void mlp_free(mlp *m)
{
    ts_optim_free(m->opt);
    ts_module_free(m->root);
}

static fsdp_group *group_of(const mlp *m, int l) { return ts__fsdp_state_of(m->lin[l])->group; }

static ts_status fwd_bwd(mlp *m, int64_t row0, int64_t rows)
{
    return th_mse_backward_rows(m->root, row0, rows, IN, OUT);
}

static int same_bits(rank_ctx *rc, const char *what, int s, int i, const ts_tensor *a, const ts_tensor *b)
{
    return th_rank_same_bits(rc, a, b, "step %d %s %d", s, what, i);
}

/* Every group's shard gradients are views of one storage, each at its
 * parameter's offset in the shard layout (as the shards in the sharded
 * buffer), contiguous, in the shard's shape. */
static int check_layout(rank_ctx *rc, const mlp *m, const char *which)
{
    for (int l = 0; l < 3; l++) {
        const fsdp_group *g = group_of(m, l);
        const ts_tensor *g0 = ts_tensor_grad(g->params[0].S);
        if (!g0) return fail(rc, "%s group %d: parameter 0 has no gradient", which, l);
        const unsigned char *base = (const unsigned char *)ts_tensor_data(g0) - (size_t)g->params[0].off * g->es;
        for (int i = 0; i < g->n; i++) {
            const fsdp_param *p = &g->params[i];
            const ts_tensor *gr = ts_tensor_grad(p->S);
            if (!gr) return fail(rc, "%s group %d: parameter %d has no gradient", which, l, i);
            if (ts_tensor_storage(gr) != ts_tensor_storage(g0))
                return fail(rc, "%s group %d: parameter %d's gradient has a storage of its own", which, l, i);
            if ((const unsigned char *)ts_tensor_data(gr) != base + (size_t)p->off * g->es)
                return fail(rc, "%s group %d: parameter %d's gradient at %td bytes from the group's, expected %lld",
                            which, l, i, (const unsigned char *)ts_tensor_data(gr) - base,
                            (long long)p->off * (long long)g->es);
            if (!ts_tensor_is_contiguous(gr) || ts_tensor_numel(gr) != ts_tensor_numel(p->S))
                return fail(rc, "%s group %d: parameter %d's gradient is not a contiguous tensor of its shard's shape",
                            which, l, i);
        }
        if (ts_tensor_storage(g0)->nbytes < (size_t)g->shard_numel * g->es)
            return fail(rc, "%s group %d: the gradients' storage has %zu bytes, less than the shard's %lld", which, l,
                        ts_tensor_storage(g0)->nbytes, (long long)g->shard_numel * (long long)g->es);
    }
    return 0;
}

/* The fused step's kernel calls the layout allows: one per run of
 * non-empty parameters adjacent in their group's buffer (the gradients
 * are views in the same layout, the state is packed in parameter order),
 * broken by padding and between groups. */
static int expected_runs(const mlp *m)
{
    int runs = 0;
    for (int l = 0; l < 3; l++) {
        const fsdp_group *g = group_of(m, l);
        int64_t end = -1;
        for (int i = 0; i < g->n; i++) {
            const fsdp_param *p = &g->params[i];
            int64_t n = p->local_rows * p->row_numel;
            if (n == 0) continue;
            if (p->off != end) runs++;
            end = p->off + n;
        }
    }
    return runs;
}

static uint64_t sum_counter(const mlp *m, int which)
{
    uint64_t n = 0;
    for (int l = 0; l < 3; l++) {
        const fsdp_group *g = group_of(m, l);
        n += which == 0 ? g->n_rs_add : which == 1 ? g->n_grad_adds : g->n_grad_views;
    }
    return n;
}

/* The copy-free model against the packed one, side by side. */
static int rank_parity(rank_ctx *rc)
{
    const gv_arg *a = rc->arg;
    ts_mesh *mesh = th_rank_mesh(rc, a->hsdp);
    if (!mesh) return fail(rc, "mesh: %s", ts_last_error());
    mlp cf, ref;
    RK_OK(rc, mlp_new(mesh, a, true, &cf));
    RK_OK(rc, mlp_new(mesh, a, false, &ref));
    if (a->separate) RK_OK(rc, ts_fsdp_set_separate_reduce_scatter_group(cf.root, true));
    int64_t rows = ROWS / rc->W;
    uint64_t accumulations = 0; /* reductions per group that met existing gradients */
    for (int s = 0; s < a->steps; s++) {
        for (int k = 0; k < a->accum; k++) {
            if (s > 0 || k > 0) accumulations += k > 0 || a->keep_grads;
            RK_OK(rc, fwd_bwd(&cf, rc->rank * rows + 3 * k + s, rows));
            RK_OK(rc, fwd_bwd(&ref, rc->rank * rows + 3 * k + s, rows));
            for (int i = 0; i < NP; i++)
                if (same_bits(rc, "gradient", s, i, ts_tensor_grad(cf.ps[i]), ts_tensor_grad(ref.ps[i]))) return 1;
            if (check_layout(rc, &cf, "copy-free") || check_layout(rc, &ref, "packed")) return 1;
        }
        RK_OK(rc, ts_optim_step(cf.opt));
        RK_OK(rc, ts_optim_step(ref.opt));
        for (int i = 0; i < NP; i++)
            if (same_bits(rc, "parameter", s, i, cf.ps[i], ref.ps[i])) return 1;
        if (a->fused) {
            int want = expected_runs(&cf);
            TH_RK_EQ(rc, ts__optim_fused_calls(cf.opt), want);
            TH_RK_EQ(rc, ts__optim_fused_calls(ref.opt), want);
            if (rc->W == 2 && want != 3) return fail(rc, "2 ranks: %d runs, expected one per group", want);
        }
        ts_optim_zero_grad(cf.opt, !a->keep_grads);
        ts_optim_zero_grad(ref.opt, !a->keep_grads);
    }
    /* how the accumulations went: in the collective (copy-free, nothing
     * between the reduction and the gradients) or by the separate add */
    uint64_t rs_add = sum_counter(&cf, 0), adds = sum_counter(&cf, 1);
    if (a->expect_add) {
        TH_RK_EQ(rc, rs_add, 3 * accumulations);
        TH_RK_EQ(rc, adds, 0);
    } else {
        TH_RK_EQ(rc, rs_add, 0);
        if (accumulations && !adds) return fail(rc, "no separate add where one was expected");
    }
    TH_RK_EQ(rc, sum_counter(&ref, 0), 0); /* the packed path always adds separately */
    if (accumulations && sum_counter(&ref, 1) == 0) return fail(rc, "the packed model never added separately");
    /* the views were made once per step without kept gradients (each parameter) */
    TH_RK_EQ(rc, sum_counter(&cf, 2), (uint64_t)NP * (a->keep_grads ? 1 : (uint64_t)a->steps));
    mlp_free(&cf);
    mlp_free(&ref);
    ts_mesh_free(mesh);
    return 0;
}

static void run(int W, gv_arg a) { th_run_world(W, rank_parity, &a, 60.0); }

Test(fully_shard_grad_views, sgd_and_adamw_equal_the_packed_path_on_2_and_3_ranks, .timeout = 120)
{
    gv_arg a = {.steps = 3, .accum = 1, .expect_add = true};
    run(2, a);
    run(3, a);
    a.adam = true;
    run(2, a);
    run(3, a);
}

Test(fully_shard_grad_views, fused_optimizers_step_a_contiguous_group_in_one_call, .timeout = 120)
{
    gv_arg a = {.steps = 3, .accum = 1, .fused = true, .expect_add = true};
    run(2, a); /* even rows: one call per group */
    run(3, a); /* rank 2's padding splits its first group; its last group is empty */
    a.adam = true;
    a.accum = 2;
    run(2, a);
    run(3, a);
}

Test(fully_shard_grad_views, synced_accumulation_adds_in_the_collective, .timeout = 120)
{
    gv_arg a = {.steps = 2, .accum = 3, .adam = true, .expect_add = true};
    run(2, a);
    run(3, a);
    a.separate = true; /* the adding reductions on their own channel, while the all-gathers move */
    run(3, a);
    a.separate = false;
    a.keep_grads = true; /* zero_grad(set_to_none = false): zeroed in place, then added into */
    a.accum = 1;
    a.steps = 3;
    a.adam = false;
    run(3, a);
}

Test(fully_shard_grad_views, bf16_params_with_f32_reduce_add_in_the_collective, .timeout = 120)
{
    gv_arg a = {.steps = 2, .accum = 2, .bf16 = true, .fused = true, .adam = true, .expect_add = true};
    run(2, a);
    run(3, a);
}

Test(fully_shard_grad_views, a_cast_hsdp_or_offload_keeps_the_separate_add, .timeout = 120)
{
    gv_arg a = {.steps = 2, .accum = 2, .bf16_reduce = true};
    run(3, a); /* reduced in bf16: the result is cast back to f32 first */
    a.bf16_reduce = false;
    a.offload = true; /* the host gradient buffer's views; accumulation staged and added */
    a.fused = true;
    run(2, a);
    a.offload = false;
    a.fused = false;
    a.hsdp = true; /* 2 x 2: the all-reduce comes between */
    a.adam = true;
    run(4, a);
}

/* Accumulation over 3 synced backwards, by hand: each backward's
 * gradients alone (zero_grad(set_to_none) between), then the three in a
 * row without zeroing, which must be ((g1 + g2) + g3) as ts__buf_add sums
 * them, and added by the collective on the copy-free path. */
static int rank_by_hand(rank_ctx *rc)
{
    bool copy_free = *(const bool *)rc->arg;
    ts_mesh *mesh = th_rank_mesh(rc, false);
    if (!mesh) return fail(rc, "mesh: %s", ts_last_error());
    gv_arg a = {.adam = true};
    mlp m;
    RK_OK(rc, mlp_new(mesh, &a, copy_free, &m));
    int64_t rows = ROWS / rc->W;
    ts_tensor *want[NP] = {0};
    for (int k = 0; k < 3; k++) {
        RK_OK(rc, fwd_bwd(&m, rc->rank * rows + 5 * k, rows));
        for (int i = 0; i < NP; i++) {
            ts_tensor *gr = ts_tensor_grad(m.ps[i]);
            if (!gr) return fail(rc, "backward %d: parameter %d has no gradient", k, i);
            if (!want[i]) {
                RK_OK(rc, ts_clone(gr, &want[i]));
            } else if (ts_tensor_numel(gr)) {
                ts__buf_add(TS_F32, ts_tensor_data(want[i]), ts_tensor_data(gr), ts_tensor_numel(gr));
            }
        }
        ts_optim_zero_grad(m.opt, true);
    }
    uint64_t rs0 = sum_counter(&m, 0), add0 = sum_counter(&m, 1);
    for (int k = 0; k < 3; k++) RK_OK(rc, fwd_bwd(&m, rc->rank * rows + 5 * k, rows));
    for (int i = 0; i < NP; i++)
        if (same_bits(rc, "accumulated gradient", 0, i, ts_tensor_grad(m.ps[i]), want[i])) return 1;
    if (check_layout(rc, &m, copy_free ? "copy-free" : "packed")) return 1;
    TH_RK_EQ(rc, sum_counter(&m, 0) - rs0, copy_free ? 6 : 0); /* 3 groups, the 2nd and 3rd backward */
    TH_RK_EQ(rc, sum_counter(&m, 1) - add0, copy_free ? 0 : 2 * NP);
    for (int i = 0; i < NP; i++) ts_tensor_free(want[i]);
    mlp_free(&m);
    ts_mesh_free(mesh);
    return 0;
}

Test(fully_shard_grad_views, three_synced_backwards_sum_like_by_hand, .timeout = 120)
{
    bool cf = true;
    th_run_world(2, rank_by_hand, &cf, 60.0);
    th_run_world(3, rank_by_hand, &cf, 60.0);
    cf = false;
    th_run_world(3, rank_by_hand, &cf, 60.0);
}

/* The caller's own references: a gradient kept after
 * zero_grad(set_to_none) keeps its values through later backwards (they
 * get a new output); one kept without zeroing is the gradient and is
 * accumulated into; a gradient the caller set in place of the view takes
 * the separate add, and the others of its group too (no longer one
 * layout), with the packed path's bits. */
static int rank_user_refs(rank_ctx *rc)
{
    ts_mesh *mesh = th_rank_mesh(rc, false);
    if (!mesh) return fail(rc, "mesh: %s", ts_last_error());
    gv_arg a = {0};
    mlp cf, ref;
    RK_OK(rc, mlp_new(mesh, &a, true, &cf));
    RK_OK(rc, mlp_new(mesh, &a, false, &ref));
    int64_t rows = ROWS / rc->W;
    RK_OK(rc, fwd_bwd(&cf, rc->rank * rows, rows));
    RK_OK(rc, fwd_bwd(&ref, rc->rank * rows, rows));
    ts_tensor *old = ts_tensor_retain(ts_tensor_grad(cf.ps[0])), *snap = NULL;
    RK_OK(rc, ts_clone(old, &snap));
    RK_OK(rc, ts_optim_step(cf.opt));
    RK_OK(rc, ts_optim_step(ref.opt));
    ts_optim_zero_grad(cf.opt, true);
    ts_optim_zero_grad(ref.opt, true);
    for (int k = 1; k < 3; k++) { /* a new output each time, then added into */
        RK_OK(rc, fwd_bwd(&cf, rc->rank * rows + k, rows));
        RK_OK(rc, fwd_bwd(&ref, rc->rank * rows + k, rows));
        if (same_bits(rc, "kept gradient", k, 0, old, snap)) return 1;
        if (ts_tensor_storage(ts_tensor_grad(cf.ps[0])) == ts_tensor_storage(old))
            return fail(rc, "backward %d wrote into the storage of a gradient the caller kept", k);
    }
    /* kept without zeroing: it is the gradient, accumulated into */
    ts_tensor *cur = ts_tensor_retain(ts_tensor_grad(cf.ps[0]));
    RK_OK(rc, fwd_bwd(&cf, rc->rank * rows + 7, rows));
    RK_OK(rc, fwd_bwd(&ref, rc->rank * rows + 7, rows));
    if (ts_tensor_grad(cf.ps[0]) != cur) return fail(rc, "the accumulated gradient was replaced");
    /* a gradient the caller sets (a copy of the view) on both models */
    uint64_t rs0 = sum_counter(&cf, 0), add0 = sum_counter(&cf, 1);
    ts_tensor *own = NULL, *own_ref = NULL;
    RK_OK(rc, ts_clone(ts_tensor_grad(cf.ps[2]), &own));
    RK_OK(rc, ts_clone(ts_tensor_grad(ref.ps[2]), &own_ref));
    RK_OK(rc, ts_tensor_set_grad(cf.ps[2], own));
    RK_OK(rc, ts_tensor_set_grad(ref.ps[2], own_ref));
    RK_OK(rc, fwd_bwd(&cf, rc->rank * rows + 8, rows));
    RK_OK(rc, fwd_bwd(&ref, rc->rank * rows + 8, rows));
    if (ts_tensor_grad(cf.ps[2]) != own) return fail(rc, "the caller's gradient was replaced");
    /* group 1 (ps[2], ps[3]) took the separate add, groups 0 and 2 the collective's */
    TH_RK_EQ(rc, sum_counter(&cf, 0) - rs0, 2);
    TH_RK_EQ(rc, sum_counter(&cf, 1) - add0, 2);
    for (int i = 0; i < NP; i++)
        if (same_bits(rc, "gradient", 9, i, ts_tensor_grad(cf.ps[i]), ts_tensor_grad(ref.ps[i]))) return 1;
    RK_OK(rc, ts_optim_step(cf.opt));
    RK_OK(rc, ts_optim_step(ref.opt));
    for (int i = 0; i < NP; i++)
        if (same_bits(rc, "parameter", 9, i, cf.ps[i], ref.ps[i])) return 1;
    if (same_bits(rc, "kept gradient", 9, 0, old, snap)) return 1;
    ts_tensor_free(own);
    ts_tensor_free(own_ref);
    ts_tensor_free(cur);
    ts_tensor_free(old);
    ts_tensor_free(snap);
    mlp_free(&cf);
    mlp_free(&ref);
    ts_mesh_free(mesh);
    return 0;
}

/* A backward that is not the last (ts_fsdp_set_is_last_backward(false))
 * leaves its last reduction in flight while the caller goes on: none of
 * its reductions adds into the gradients in the collective (they are
 * added when finished), and the held one lands in the next backward;
 * the packed path's bits throughout. */
static int rank_not_last(rank_ctx *rc)
{
    ts_mesh *mesh = th_rank_mesh(rc, false);
    if (!mesh) return fail(rc, "mesh: %s", ts_last_error());
    gv_arg a = {.adam = true};
    mlp cf, ref;
    RK_OK(rc, mlp_new(mesh, &a, true, &cf));
    RK_OK(rc, mlp_new(mesh, &a, false, &ref));
    int64_t rows = ROWS / rc->W;
    mlp *ms[2] = {&cf, &ref};
    for (int k = 0; k < 3; k++) {
        for (int j = 0; j < 2; j++) {
            RK_OK(rc, ts_fsdp_set_is_last_backward(ms[j]->root, k != 1));
            RK_OK(rc, fwd_bwd(ms[j], rc->rank * rows + k, rows));
        }
        if (k == 1) {
            const fsdp_ctx *c = ts__fsdp_state_of(cf.root)->ctx;
            if (!c || !c->rs_pending || !ts__fsdp_reduce_in_flight(c->rs_pending))
                return fail(rc, "no reduction left in flight by a backward that is not the last");
            if (c->rs_pending->rs_add) return fail(rc, "the reduction left in flight adds into the gradients");
            TH_RK_EQ(rc, sum_counter(&cf, 0), 0);
        } else {
            for (int i = 0; i < NP; i++)
                if (same_bits(rc, "gradient", k, i, ts_tensor_grad(cf.ps[i]), ts_tensor_grad(ref.ps[i]))) return 1;
        }
    }
    TH_RK_EQ(rc, sum_counter(&cf, 0), 3); /* the third backward's, into the views */
    RK_OK(rc, ts_optim_step(cf.opt));
    RK_OK(rc, ts_optim_step(ref.opt));
    for (int i = 0; i < NP; i++)
        if (same_bits(rc, "parameter", 3, i, cf.ps[i], ref.ps[i])) return 1;
    mlp_free(&cf);
    mlp_free(&ref);
    ts_mesh_free(mesh);
    return 0;
}

Test(fully_shard_grad_views, a_backward_that_is_not_the_last_adds_separately, .timeout = 120)
{
    th_run_world(2, rank_not_last, NULL, 60.0);
}

Test(fully_shard_grad_views, gradients_the_caller_holds_or_sets, .timeout = 120)
{
    th_run_world(2, rank_user_refs, NULL, 60.0);
    th_run_world(3, rank_user_refs, NULL, 60.0);
}

/* A backward that fails after the last group's accumulating reduction
 * was issued (the input's own backward fails, after every group's
 * post-backward): the next forward drops that reduction, and with it the
 * gradients it had added into (they would hold part of the failed
 * backward), while the groups whose reductions finished keep theirs; the
 * step after that trains again. */
static ts_status fail_backward(void *ctx, int n, ts_tensor **g)
{
    (void)ctx, (void)n, (void)g;
    return ts_error(TS_ERR_INTERNAL, "injected backward failure");
}

static int rank_failed_add(rank_ctx *rc)
{
    ts_mesh *mesh = th_rank_mesh(rc, false);
    if (!mesh) return fail(rc, "mesh: %s", ts_last_error());
    gv_arg a = {0};
    mlp cf;
    RK_OK(rc, mlp_new(mesh, &a, true, &cf));
    int64_t rows = ROWS / rc->W;
    RK_OK(rc, fwd_bwd(&cf, rc->rank * rows, rows)); /* the gradients are views now */
    /* no zero_grad: the next backward adds into them, in the collective */
    ts_tensor *x = th_batch(rc->rank * rows + 1, rows, IN, th_xval), *xf = NULL, *o = NULL, *loss = NULL;
    RK_OK(rc, ts_tensor_set_requires_grad(x, true));
    RK_OK(rc, ts_autograd_custom(1, &x, fail_backward, NULL, NULL, &xf));
    RK_OK(rc, ts_module_call1(cf.root, xf, &o));
    ts_tensor *y = th_batch(rc->rank * rows + 1, rows, OUT, th_yval);
    RK_OK(rc, ts_mse_loss(o, y, TS_REDUCTION_MEAN, &loss));
    if (ts_backward(loss, NULL, false) != TS_ERR_INTERNAL)
        return fail(rc, "the injected failure did not fail backward");
    const fsdp_ctx *c = ts__fsdp_state_of(cf.root)->ctx;
    if (!c || !c->rs_pending || !c->rs_pending->rs_add)
        return fail(rc, "no accumulating reduction left in flight by the failed backward");
    const fsdp_group *pending = c->rs_pending;
    ts_tensor_free(o);
    ts_tensor_free(loss);
    o = loss = NULL;
    /* the next forward cleans up: the pending group's gradients go */
    ts_tensor *x2 = th_batch(rc->rank * rows + 2, rows, IN, th_xval);
    RK_OK(rc, ts_module_call1(cf.root, x2, &o));
    int dropped = 0, kept = 0;
    for (int l = 0; l < 3; l++) {
        const fsdp_group *g = group_of(&cf, l);
        for (int i = 0; i < NP; i++) {
            int li = i / 2; /* ps: weight and bias of lin[0], lin[1], lin[2] */
            if (li != l) continue;
            bool has = ts_tensor_grad(cf.ps[i]) != NULL;
            if (g == pending && has)
                return fail(rc, "parameter %d kept a gradient the dropped reduction added into", i);
            if (g != pending && !has) return fail(rc, "parameter %d of a finished group lost its gradient", i);
            dropped += g == pending, kept += g != pending;
        }
    }
    if (!dropped || !kept) return fail(rc, "dropped %d, kept %d gradients", dropped, kept);
    ts_tensor_free(o);
    o = NULL;
    ts_optim_zero_grad(cf.opt, true); /* and training goes on */
    RK_OK(rc, fwd_bwd(&cf, rc->rank * rows + 3, rows));
    for (int i = 0; i < NP; i++)
        if (!ts_tensor_grad(cf.ps[i])) return fail(rc, "parameter %d has no gradient after the next backward", i);
    RK_OK(rc, ts_optim_step(cf.opt));
    ts_tensor_free(x);
    ts_tensor_free(xf);
    ts_tensor_free(x2);
    ts_tensor_free(y);
    mlp_free(&cf);
    ts_mesh_free(mesh);
    return 0;
}

Test(fully_shard_grad_views, a_dropped_accumulating_reduction_drops_its_gradients, .timeout = 120)
{
    th_run_world(2, rank_failed_add, NULL, 60.0);
}
