/*
 * CPUOffloadPolicy (fully_shard.h, ts_offload_policy), over W loopback
 * ranks run as threads (tests/loopback_ranks.h). Ported from PyTorch's
 * test/distributed/_composable/fsdp/test_fully_shard_training.py
 * (test_train_parity_multi_group_cpu_offload_eager: offload against the
 * same training without it, per reshard_after_forward and pin_memory;
 * test_gradient_accumulation with offload_policy) and
 * test_fully_shard_memory.py (where the sharded parameters, gradients and
 * optimizer state live with offload). PyTorch compares against DDP with
 * a tolerance because its CPU Adam and GPU Adam round differently; here
 * the optimizer runs on the same CPU with and without offload, so the two
 * runs must agree to the bit.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "fully_shard/fully_shard.h"
#include "optim/optim.h"
#include "tests/loopback_ranks.h"

typedef th_rank rank_ctx;
#define fail th_rank_fail
#define RK_OK TH_RK_OK
#define RK_EQ TH_RK_EQ

static void run_world(int W, th_rank_fn fn, void *arg) { th_run_world(W, fn, arg, 60.0); }

#define IN 6
#define HID 10
#define OUT 3
#define ROWS 12 /* the global batch: divides by 1, 2 and 4 */
#define NP 6    /* parameters: three Linear layers, weight and bias */

/* Sequential(Linear(IN, HID), Tanh, Linear(HID, HID), Tanh, Linear(HID, OUT)) */
typedef struct mlp {
    ts_module *root;
    ts_module *lin[3];
    ts_tensor *ps[NP];
    ts_optim *opt;
} mlp;

typedef struct off_arg {
    int steps;
    int accum; /* backwards per step (gradient accumulation) */
    bool pin;
    bool hsdp;       /* a 2-d (replicate, shard) mesh at W = 4 */
    bool keep_grads; /* zero_grad(set_to_none = false): gradients exist at every reduction */
    bool adam;       /* AdamW (two state tensors per parameter) instead of SGD with momentum */
    bool bf16;       /* both models under a mixed-precision policy (bf16 compute, f32 reduce and output) */
    ts_reshard_policy policy;
} off_arg;

/* The model, sharded (each Linear its own group, then the root) with the
 * policy (NULL: no offload), and its optimizer. */
static ts_status mlp_new(ts_mesh *mesh, const off_arg *a, const ts_offload_policy *pol, mlp *m)
{
    memset(m, 0, sizeof *m);
    ts_status st = th_mlp3_new(11, IN, HID, HID, OUT, &m->root, m->lin);
    if (st) return st;
    ts_fsdp_options o = ts_fsdp_options_default();
    o.mesh = mesh;
    o.reshard_after_forward = a->policy;
    o.offload_policy = pol;
    ts_mp_policy mp = ts_mp_policy_default();
    mp.param_dtype = TS_BF16;
    mp.reduce_dtype = TS_F32;
    mp.output_dtype = TS_F32;
    if (a->bf16) o.mp_policy = &mp;
    if ((st = ts_fully_shard_each(3, m->lin, &o)) || (st = ts_fully_shard(m->root, &o))) return st;
    if ((st = th_param_slots(m->root, NP, m->ps))) return st;
    if (a->adam) {
        ts_adam_options ao = ts_adamw_options_default();
        ao.lr = 0.01;
        return ts_adamw_new(NP, m->ps, &ao, &m->opt);
    }
    ts_sgd_options so = ts_sgd_options_default();
    so.lr = 0.05;
    so.momentum = 0.9;
    so.weight_decay = 0.01;
    return ts_sgd_new(NP, m->ps, &so, &m->opt);
}

static void mlp_free(mlp *m)
{
    ts_optim_free(m->opt);
    ts_module_free(m->root);
}

static ts_status fwd_bwd(mlp *m, ts_tensor *x, ts_tensor *y) { return th_mse_backward(m->root, x, y); }

/* Bitwise equality of two tensors' local data. */
static int same_bits(rank_ctx *rc, const char *what, int i, const ts_tensor *a, const ts_tensor *b)
{
    if (!a || !b) {
        if (a != b) return fail(rc, "%s %d: only one of the two exists", what, i);
        return 0;
    }
    int64_t n = ts_tensor_numel(a);
    if (n != ts_tensor_numel(b))
        return fail(rc, "%s %d: %lld vs %lld elements", what, i, (long long)n, (long long)ts_tensor_numel(b));
    const float *pa = ts_tensor_data(a), *pb = ts_tensor_data(b);
    for (int64_t k = 0; k < n; k++)
        if (memcmp(&pa[k], &pb[k], sizeof(float)) != 0)
            return fail(rc, "%s %d[%lld]: %.9g without offload, %.9g with", what, i, (long long)k, pa[k], pb[k]);
    return 0;
}

/* The same training with and without the policy, side by side on each
 * rank: after every backward the shard gradients, and after every step
 * the shards, are equal to the bit; then the full state dicts are. */
static int rank_parity(rank_ctx *rc)
{
    const off_arg *a = rc->arg;
    ts_mesh *mesh = th_rank_mesh(rc, a->hsdp);
    if (!mesh) return fail(rc, "mesh: %s", ts_last_error());
    ts_offload_policy pol = ts_offload_policy_default();
    pol.pin_memory = a->pin;
    mlp ref, off;
    RK_OK(rc, mlp_new(mesh, a, NULL, &ref));
    RK_OK(rc, mlp_new(mesh, a, &pol, &off));
    pol.pin_memory = !a->pin; /* read during the call only */
    int64_t rows = ROWS / rc->W;
    ts_tensor *x = th_batch(rc->rank * rows, rows, IN, th_xval), *y = th_batch(rc->rank * rows, rows, OUT, th_yval);
    for (int s = 0; s < a->steps; s++) {
        for (int k = 0; k < a->accum; k++) {
            RK_OK(rc, fwd_bwd(&ref, x, y));
            RK_OK(rc, fwd_bwd(&off, x, y));
            for (int i = 0; i < NP; i++)
                if (same_bits(rc, "gradient", i, ts_tensor_grad(ref.ps[i]), ts_tensor_grad(off.ps[i]))) return 1;
        }
        RK_OK(rc, ts_optim_step(ref.opt));
        RK_OK(rc, ts_optim_step(off.opt));
        for (int i = 0; i < NP; i++)
            if (same_bits(rc, "parameter", i, ref.ps[i], off.ps[i])) return 1;
        /* where they live: host shards and gradients, pinned when asked */
        for (int i = 0; i < NP; i++) {
            if (ts_tensor_is_pinned(off.ps[i]) != a->pin || ts_tensor_is_pinned(ref.ps[i]))
                return fail(rc, "parameter %d: pinned %d with offload (pin_memory %d), %d without", i,
                            ts_tensor_is_pinned(off.ps[i]), a->pin, ts_tensor_is_pinned(ref.ps[i]));
            if (ts_tensor_grad(off.ps[i]) && ts_tensor_is_pinned(ts_tensor_grad(off.ps[i])) != a->pin)
                return fail(rc, "gradient %d: pinned %d, pin_memory %d", i,
                            ts_tensor_is_pinned(ts_tensor_grad(off.ps[i])), a->pin);
        }
        ts_optim_zero_grad(ref.opt, !a->keep_grads);
        ts_optim_zero_grad(off.opt, !a->keep_grads);
    }
    /* the all-gathers of the full state dict read the host shards */
    ts_state_dict *sr = NULL, *so = NULL;
    RK_OK(rc, ts_fsdp_full_state_dict(ref.root, false, &sr));
    RK_OK(rc, ts_fsdp_full_state_dict(off.root, false, &so));
    ts_named_params np;
    RK_OK(rc, ts_module_named_parameters(ref.root, &np));
    for (int i = 0; i < np.n; i++)
        if (same_bits(rc, np.items[i].name, i, ts_state_dict_get(sr, np.items[i].name),
                      ts_state_dict_get(so, np.items[i].name)))
            return 1;
    ts_named_params_free(&np);
    /* the staging copies: per forward and backward pair, one H2D per
     * all-gather (the Linear groups reshard after forward unless FALSE:
     * 2 all-gathers each) and one D2H per parameter; and one H2D per group
     * for the full state dict */
    ts_fsdp_offload_stats os, rs;
    RK_OK(rc, ts_fsdp_offload_stats_get(off.root, &os));
    RK_OK(rc, ts_fsdp_offload_stats_get(ref.root, &rs));
    RK_EQ(rc, rs.groups, 0);
    RK_EQ(rc, rs.h2d_copies + rs.d2h_copies + rs.host_bytes, 0);
    RK_EQ(rc, os.groups, 3);
    RK_EQ(rc, os.pinned_groups, a->pin ? 3 : 0);
    int pairs = a->steps * a->accum, gathers = a->policy == TS_RESHARD_FALSE ? 1 : 2;
    uint64_t shard_bytes = 0, local_bytes = 0;
    for (int l = 0; l < 3; l++) {
        ts_fsdp_group_info gi;
        RK_OK(rc, ts_fsdp_group_info_get(off.lin[l], &gi));
        shard_bytes += (uint64_t)gi.shard_numel * 4;
        local_bytes += (uint64_t)gi.local_numel * 4;
    }
    /* under the bf16 policy the copies before the training all-gathers
     * cast to bf16 on their way (half the bytes), and the full state dict
     * gathers the float32 masters straight from the host shards (not
     * through the unshard path: no staging copy) */
    int sd = a->bf16 ? 0 : 1;
    RK_EQ(rc, os.h2d_copies, (uint64_t)pairs * 3 * gathers + 3 * sd);
    RK_EQ(rc, os.h2d_bytes, (uint64_t)pairs * gathers * shard_bytes / (a->bf16 ? 2 : 1) + sd * shard_bytes);
    RK_EQ(rc, os.d2h_copies, (uint64_t)pairs * NP);
    RK_EQ(rc, os.d2h_bytes, (uint64_t)pairs * local_bytes);
    /* host blocks: the sharded buffers and the host gradient buffers (and
     * the staging buffers when gradients were accumulated into) */
    if (os.host_bytes < 2 * shard_bytes)
        return fail(rc, "host bytes %zu < 2 x %llu", os.host_bytes, (unsigned long long)shard_bytes);
    RK_EQ(rc, os.pinned_bytes, a->pin ? os.host_bytes : 0);
    ts_state_dict_free(sr);
    ts_state_dict_free(so);
    ts_tensor_free(x);
    ts_tensor_free(y);
    mlp_free(&ref);
    mlp_free(&off);
    ts_mesh_free(mesh);
    return 0;
}

Test(fully_shard_offload, training_equals_training_without_offload_on_1_2_4_ranks, .timeout = 240)
{
    for (int pin = 0; pin <= 1; pin++) {
        off_arg a = {.steps = 3, .accum = 1, .pin = pin, .policy = TS_RESHARD_AUTO};
        for (int W = 1; W <= 4; W *= 2) run_world(W, rank_parity, &a);
    }
}

Test(fully_shard_offload, training_equals_per_reshard_policy_and_with_adamw, .timeout = 240)
{
    off_arg a = {.steps = 3, .accum = 1, .pin = true, .policy = TS_RESHARD_FALSE};
    run_world(2, rank_parity, &a);
    a.policy = TS_RESHARD_TRUE;
    a.adam = true;
    run_world(4, rank_parity, &a);
    a.pin = false;
    run_world(2, rank_parity, &a);
}

Test(fully_shard_offload, gradient_accumulation_equals_without_offload, .timeout = 240)
{
    off_arg a = {.steps = 2, .accum = 3, .pin = true, .policy = TS_RESHARD_AUTO};
    run_world(2, rank_parity, &a);
    a.pin = false;
    a.keep_grads = true; /* every reduction adds into an existing gradient */
    run_world(4, rank_parity, &a);
    a.pin = true;
    run_world(1, rank_parity, &a);
}

/* With a mixed-precision policy as well (bf16 all-gathers and compute,
 * f32 reduction): offload still changes no bit. */
Test(fully_shard_offload, with_a_bf16_policy_equals_the_policy_without_offload, .timeout = 240)
{
    off_arg a = {.steps = 3, .accum = 1, .pin = true, .bf16 = true, .policy = TS_RESHARD_AUTO};
    for (int W = 1; W <= 4; W *= 2) run_world(W, rank_parity, &a);
    a.pin = false;
    a.accum = 2;
    a.keep_grads = true;
    run_world(2, rank_parity, &a);
    a.hsdp = true;
    a.accum = 1;
    run_world(4, rank_parity, &a);
}

Test(fully_shard_offload, hsdp_on_a_2x2_mesh_equals_without_offload, .timeout = 120)
{
    off_arg a = {.steps = 3, .accum = 1, .pin = true, .hsdp = true, .policy = TS_RESHARD_TRUE};
    run_world(4, rank_parity, &a);
}

/* Memory accounting (one rank, so no other thread pins meanwhile): the
 * pinned bytes of the process grow by what the offloaded groups hold in
 * pinned blocks, the host shards and gradients exactly, and go back when
 * the model and its optimizer are freed; without pinning nothing is
 * pinned. A gradient held outside the shard when the next one comes
 * keeps its values (the group starts a new host gradient buffer). */
static int rank_memory(rank_ctx *rc)
{
    const off_arg *a = rc->arg;
    ts_mesh *mesh = th_rank_mesh(rc, false);
    if (!mesh) return fail(rc, "mesh: %s", ts_last_error());
    size_t pinned0 = ts_mem_live_bytes(TS_MEM_PINNED);
    ts_offload_policy pol = ts_offload_policy_default();
    pol.pin_memory = a->pin;
    mlp off;
    RK_OK(rc, mlp_new(mesh, a, &pol, &off));
    ts_fsdp_offload_stats os;
    RK_OK(rc, ts_fsdp_offload_stats_get(off.root, &os));
    RK_EQ(rc, ts_mem_live_bytes(TS_MEM_PINNED) - pinned0, os.pinned_bytes);
    size_t shards = os.host_bytes; /* the sharded buffers alone, before any gradient */
    RK_EQ(rc, os.pinned_bytes, a->pin ? shards : 0);
    ts_tensor *x = th_batch(0, ROWS, IN, th_xval), *y = th_batch(0, ROWS, OUT, th_yval);
    RK_OK(rc, fwd_bwd(&off, x, y));
    RK_OK(rc, ts_fsdp_offload_stats_get(off.root, &os));
    RK_EQ(rc, ts_mem_live_bytes(TS_MEM_PINNED) - pinned0, os.pinned_bytes);
    RK_EQ(rc, os.host_bytes, 2 * shards); /* + the host gradient buffers, as large as the shards */
    RK_OK(rc, ts_optim_step(off.opt));
    /* keep one gradient past zero_grad */
    ts_tensor *kept = ts_tensor_retain(ts_tensor_grad(off.ps[0]));
    float before[HID * IN];
    memcpy(before, ts_tensor_data(kept), sizeof before);
    ts_optim_zero_grad(off.opt, true);
    RK_OK(rc, fwd_bwd(&off, x, y));
    if (ts_tensor_grad(off.ps[0]) == kept) return fail(rc, "the kept gradient was reused");
    if (memcmp(before, ts_tensor_data(kept), sizeof before) != 0) return fail(rc, "the kept gradient changed");
    ts_tensor_free(kept);
    RK_OK(rc, ts_optim_step(off.opt));
    ts_tensor_free(x);
    ts_tensor_free(y);
    mlp_free(&off);
    RK_EQ(rc, ts_mem_live_bytes(TS_MEM_PINNED), pinned0);
    ts_mesh_free(mesh);
    return 0;
}

Test(fully_shard_offload, memory_accounting_shows_the_pinned_bytes, .timeout = 60)
{
    off_arg a = {.steps = 1, .accum = 1, .pin = true, .policy = TS_RESHARD_AUTO};
    run_world(1, rank_memory, &a);
    a.pin = false;
    run_world(1, rank_memory, &a);
}

Test(fully_shard_offload, defaults_and_errors, .timeout = 30)
{
    ts_offload_policy p = ts_offload_policy_default();
    cr_assert(p.pin_memory, "pin_memory defaults to true (FSDP2's CPUOffloadPolicy)");
    ts_fsdp_options o = ts_fsdp_options_default();
    cr_assert_null(o.offload_policy, "no offload by default (FSDP2's OffloadPolicy())");
    ts_fsdp_offload_stats s;
    TH_FAILS(ts_fsdp_offload_stats_get(NULL, &s), TS_ERR_INVALID_ARGUMENT, "NULL");
    ts_module *lin = NULL;
    TH_OK(ts_linear_new(4, 4, true, &lin));
    TH_FAILS(ts_fsdp_offload_stats_get(lin, NULL), TS_ERR_INVALID_ARGUMENT, "NULL");
    memset(&s, 0xff, sizeof s);
    TH_OK(ts_fsdp_offload_stats_get(lin, &s)); /* not sharded: nothing offloaded */
    cr_assert_eq(s.groups, 0);
    cr_assert_eq(s.host_bytes, 0);
    /* one rank without a world: offload works there too */
    o.offload_policy = &p;
    TH_OK(ts_fully_shard(lin, &o));
    TH_OK(ts_fsdp_offload_stats_get(lin, &s));
    cr_assert_eq(s.groups, 1);
    cr_assert_eq(s.pinned_groups, 1);
    cr_assert_geq(s.pinned_bytes, 20 * sizeof(float));
    char text[4096];
    size_t len = 0;
    TH_OK(ts_fsdp_summary_str(lin, text, sizeof text, &len));
    cr_assert_not_null(strstr(text, "\n  offload: cpu, pinned (host shards and gradients;"), "%s", text);
    ts_module_free(lin);
}

/* Loading a full state dict writes into the host shards (which stay
 * pinned), and an explicit unshard reads them: the full parameters are
 * the loaded ones. */
static int rank_load(rank_ctx *rc)
{
    off_arg a = {.steps = 1, .accum = 1, .pin = true, .policy = TS_RESHARD_AUTO};
    ts_mesh *mesh = th_rank_mesh(rc, false);
    if (!mesh) return fail(rc, "mesh: %s", ts_last_error());
    ts_offload_policy pol = ts_offload_policy_default();
    mlp ref, off;
    RK_OK(rc, mlp_new(mesh, &a, NULL, &ref));
    RK_OK(rc, mlp_new(mesh, &a, &pol, &off));
    int64_t rows = ROWS / rc->W;
    ts_tensor *x = th_batch(rc->rank * rows, rows, IN, th_xval), *y = th_batch(rc->rank * rows, rows, OUT, th_yval);
    RK_OK(rc, fwd_bwd(&ref, x, y)); /* the reference moves away from the initial weights */
    RK_OK(rc, ts_optim_step(ref.opt));
    ts_state_dict *sd = NULL;
    RK_OK(rc, ts_fsdp_full_state_dict(ref.root, false, &sd));
    RK_OK(rc, ts_fsdp_load_full_state_dict(off.root, sd, true));
    for (int i = 0; i < NP; i++) {
        if (!ts_tensor_is_pinned(off.ps[i])) return fail(rc, "parameter %d is not pinned after loading", i);
        if (same_bits(rc, "loaded shard", i, ref.ps[i], off.ps[i])) return 1;
    }
    RK_OK(rc, ts_fsdp_unshard(off.lin[1], false, NULL));
    ts_tensor *w = NULL;
    RK_OK(rc, ts_module_get_parameter(off.lin[1], "weight", &w));
    if (ts_tensor_numel(w) != HID * HID)
        return fail(rc, "the unsharded weight has %lld elements", (long long)ts_tensor_numel(w));
    if (same_bits(rc, "unsharded weight", 0, ts_state_dict_get(sd, "2.weight"), w)) return 1;
    RK_OK(rc, ts_fsdp_reshard(off.lin[1]));
    ts_state_dict_free(sd);
    ts_tensor_free(x);
    ts_tensor_free(y);
    mlp_free(&ref);
    mlp_free(&off);
    ts_mesh_free(mesh);
    return 0;
}

Test(fully_shard_offload, load_full_state_dict_and_explicit_unshard, .timeout = 60)
{
    run_world(2, rank_load, NULL);
    run_world(4, rank_load, NULL);
}
