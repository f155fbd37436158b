/* The meta device (docs/meta.md): the scoped default device, meta
 * factories, materialization, the errors outside a scope, and the key
 * guarantee the memory estimate builds on: a training step replayed on
 * meta tensors gives exactly the storage peak and the pool growth the same
 * step gives on the CPU. */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <pthread.h>
#include <string.h>

#include "tests/helpers.h"

/* ------------------------------------------------------------ the scope */

Test(tensor_meta, scope_nests_and_exit_without_enter_is_refused)
{
    cr_assert_eq(ts_default_device(), TS_DEVICE_CPU);
    cr_assert_str_eq(ts_device_name(TS_DEVICE_CPU), "cpu");
    cr_assert_str_eq(ts_device_name(TS_DEVICE_META), "meta");
    cr_assert_str_eq(ts_device_name((ts_device)7), "invalid");
    cr_assert_eq(ts_device_scope_exit(), TS_ERR_STATE);
    cr_assert(strstr(ts_last_error(), "no device scope is open"), "%s", ts_last_error());
    cr_assert_eq(ts_device_scope_enter((ts_device)7), TS_ERR_INVALID_ARGUMENT);
    TH_OK(ts_device_scope_enter(TS_DEVICE_META));
    cr_assert_eq(ts_default_device(), TS_DEVICE_META);
    TH_OK(ts_device_scope_enter(TS_DEVICE_CPU));
    cr_assert_eq(ts_default_device(), TS_DEVICE_CPU);
    ts_tensor *c, *m;
    int64_t s[2] = {2, 3};
    TH_OK(ts_tensor_zeros(TS_F32, 2, s, &c));
    TH_OK(ts_device_scope_exit());
    cr_assert_eq(ts_default_device(), TS_DEVICE_META);
    TH_OK(ts_tensor_zeros(TS_F32, 2, s, &m));
    TH_OK(ts_device_scope_exit());
    cr_assert_eq(ts_default_device(), TS_DEVICE_CPU);
    cr_assert_eq(ts_tensor_device(c), TS_DEVICE_CPU);
    cr_assert_eq(ts_tensor_device(m), TS_DEVICE_META);
    cr_assert_eq(ts_device_scope_exit(), TS_ERR_STATE);
    /* the depth limit */
    for (int i = 0; i < TS_DEVICE_SCOPE_MAX_DEPTH; i++) TH_OK(ts_device_scope_enter(TS_DEVICE_META));
    cr_assert_eq(ts_device_scope_enter(TS_DEVICE_META), TS_ERR_STATE);
    cr_assert(strstr(ts_last_error(), "the limit"), "%s", ts_last_error());
    for (int i = 0; i < TS_DEVICE_SCOPE_MAX_DEPTH; i++) TH_OK(ts_device_scope_exit());
    cr_assert_eq(ts_default_device(), TS_DEVICE_CPU);
    ts_tensor_free(c);
    ts_tensor_free(m);
}

static void *thread_default_device(void *arg)
{
    ts_device *seen = arg;
    *seen = ts_default_device();
    ts_tensor *t = NULL;
    int64_t s[1] = {100};
    if (ts_tensor_empty(TS_F32, 1, s, &t) == TS_OK) {
        seen[1] = ts_tensor_device(t);
        ts_tensor_free(t);
    }
    return NULL;
}

/* The default device is per thread: a meta scope on one thread does not
 * change what another creates, and each thread has its own ledger. */
Test(tensor_meta, scope_and_ledger_are_per_thread)
{
    TH_OK(ts_device_scope_enter(TS_DEVICE_META));
    ts_meta_reset();
    ts_meta_stats before = ts_meta_get_stats();
    ts_device seen[2] = {TS_DEVICE_META, TS_DEVICE_META};
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, thread_default_device, seen), 0);
    pthread_join(th, NULL);
    cr_assert_eq(seen[0], TS_DEVICE_CPU, "the other thread's default device");
    cr_assert_eq(seen[1], TS_DEVICE_CPU, "the other thread's tensor");
    ts_meta_stats after = ts_meta_get_stats();
    cr_assert_eq(after.live, before.live);
    cr_assert_eq(after.peak, before.peak);
    TH_OK(ts_device_scope_exit());
}

typedef struct made_on_thread {
    ts_tensor *t;
    ts_meta_stats stats;
} made_on_thread;

static void *make_meta(void *arg)
{
    made_on_thread *m = arg;
    int64_t s[1] = {1000};
    if (ts_device_scope_enter(TS_DEVICE_META) == TS_OK) {
        if (ts_tensor_empty(TS_F32, 1, s, &m->t) != TS_OK) m->t = NULL;
        m->stats = ts_meta_get_stats();
        ts_device_scope_exit();
    }
    return NULL;
}

static void *free_tensor(void *arg)
{
    ts_tensor_free(arg);
    return NULL;
}

/* A meta tensor freed on another thread leaves the ledger of the thread
 * that made it, also after that thread ended. */
Test(tensor_meta, a_free_on_another_thread_counts_on_the_creating_ledger)
{
    TH_OK(ts_device_scope_enter(TS_DEVICE_META));
    ts_meta_reset();
    int64_t s[1] = {1000};
    ts_tensor *t;
    TH_OK(ts_tensor_empty(TS_F32, 1, s, &t));
    TH_OK(ts_device_scope_exit());
    ts_meta_stats a = ts_meta_get_stats();
    cr_assert_eq(a.live, 4096, "1000 floats take the 4096-byte class");
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, free_tensor, t), 0);
    pthread_join(th, NULL);
    ts_meta_stats b = ts_meta_get_stats();
    cr_assert_eq(b.live, a.live - 4096, "freed on the other thread, counted here");
    cr_assert_eq(b.cached, a.cached + 4096);
    /* made on a thread that has ended, freed here: its ledger, not this one */
    made_on_thread m = {0};
    cr_assert_eq(pthread_create(&th, NULL, make_meta, &m), 0);
    pthread_join(th, NULL);
    cr_assert_not_null(m.t);
    cr_assert_eq(m.stats.live, 4096);
    ts_tensor_free(m.t);
    ts_meta_stats c = ts_meta_get_stats();
    cr_assert_eq(c.live, b.live);
    cr_assert_eq(c.cached, b.cached);
}

/* ------------------------------------------------------------ factories */

Test(tensor_meta, factories_make_meta_tensors_and_draw_nothing)
{
    ts_manual_seed(5);
    uint8_t g0[TS_GENERATOR_STATE_BYTES], g1[TS_GENERATOR_STATE_BYTES];
    ts_generator_get_state(ts_default_generator(), g0);
    size_t storage0 = ts_mem_live_bytes(TS_MEM_STORAGE);
    TH_OK(ts_device_scope_enter(TS_DEVICE_META));
    ts_meta_reset();
    int64_t s[2] = {3, 5};
    float data[15] = {0};
    ts_tensor *t[11] = {0};
    TH_OK(ts_tensor_empty(TS_F32, 2, s, &t[0]));
    TH_OK(ts_tensor_zeros(TS_F64, 2, s, &t[1]));
    TH_OK(ts_tensor_ones(TS_BF16, 2, s, &t[2]));
    TH_OK(ts_tensor_full(TS_I64, 2, s, 7, &t[3]));
    TH_OK(ts_tensor_scalar(TS_F32, 2.5, &t[4]));
    TH_OK(ts_tensor_arange(TS_I64, 0, 10, 3, &t[5]));
    TH_OK(ts_tensor_from_data(TS_F32, 2, s, data, &t[6]));
    TH_OK(ts_rand(TS_F32, 2, s, NULL, &t[7]));
    TH_OK(ts_randn(TS_F64, 2, s, NULL, &t[8]));
    TH_OK(ts_randint(0, 9, 2, s, NULL, &t[9]));
    TH_OK(ts_randperm(12, NULL, &t[10]));
    /* the same argument checks as on the CPU */
    ts_tensor *bad = NULL;
    cr_assert_eq(ts_tensor_full(TS_I32, 2, s, 1e20, &bad), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_tensor_arange(TS_F32, 0, 1, 0, &bad), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_tensor_from_data(TS_F32, 2, s, NULL, &bad), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_randint(3, 3, 2, s, NULL, &bad), TS_ERR_INVALID_ARGUMENT);
    cr_assert_null(bad);
    ts_meta_stats st = ts_meta_get_stats();
    TH_OK(ts_device_scope_exit());
    ts_generator_get_state(ts_default_generator(), g1);
    cr_assert_eq(memcmp(g0, g1, sizeof g0), 0, "the generator was not advanced");
    cr_assert_eq(ts_mem_live_bytes(TS_MEM_STORAGE), storage0, "no real storage was taken");
    for (int i = 0; i < 11; i++) {
        cr_assert_eq(ts_tensor_device(t[i]), TS_DEVICE_META, "tensor %d", i);
        cr_assert_null(ts_tensor_data(t[i]), "tensor %d", i);
        cr_assert_null(ts_storage_data(ts_tensor_storage(t[i])));
        cr_assert(ts_storage_is_meta(ts_tensor_storage(t[i])));
    }
    cr_assert_eq(ts_tensor_numel(t[5]), 4);
    cr_assert_eq(ts_tensor_dtype(t[2]), TS_BF16);
    cr_assert_eq(ts_tensor_ndim(t[4]), 0);
    cr_assert_eq(ts_tensor_numel(t[10]), 12);
    /* the pool's classes: six of 64 bytes (60 and fewer bytes), five of 128 */
    cr_assert_eq(st.live, 6 * 64 + 5 * 128, "every storage is counted");
    for (int i = 0; i < 11; i++) ts_tensor_free(t[i]);
    cr_assert_eq(ts_meta_get_stats().live, 0);
}

/* ------------------------------------------------------------ materialize */

Test(tensor_meta, materialize_turns_every_view_into_a_cpu_tensor)
{
    TH_OK(ts_device_scope_enter(TS_DEVICE_META));
    ts_meta_reset();
    int64_t s[2] = {4, 6}, vs[2] = {6, 4};
    ts_tensor *t, *v;
    TH_OK(ts_tensor_empty(TS_F32, 2, s, &t));
    TH_OK(ts_tensor_set_name(t, "0.weight"));
    TH_OK(ts_transpose(t, 0, 1, &v));
    TH_OK(ts_device_scope_exit());
    cr_assert_eq(ts_tensor_device(v), TS_DEVICE_META, "a view of a meta tensor is meta");
    cr_assert_eq(ts_meta_get_stats().live, 128);
    /* before: a clear error naming the tensor */
    double x;
    cr_assert_eq(ts_tensor_item(t, &x), TS_ERR_SHAPE, "the shape check comes first, as on the CPU");
    TH_OK(ts_device_scope_enter(TS_DEVICE_META));
    ts_tensor *one;
    TH_OK(ts_tensor_scalar(TS_F32, 1.0, &one));
    TH_OK(ts_device_scope_exit());
    cr_assert_eq(ts_tensor_item(one, &x), TS_ERR_STATE);
    cr_assert(strstr(ts_last_error(), "ts_tensor_item: tensor () is on the meta device"), "%s", ts_last_error());
    ts_tensor_free(one);
    int64_t idx[2] = {0, 0};
    cr_assert_eq(ts_tensor_get(t, idx, &x), TS_ERR_STATE);
    cr_assert(strstr(ts_last_error(),
                     "'0.weight' (4, 6) is on the meta device (it has no data): materialize the "
                     "model or load a checkpoint first"),
              "%s", ts_last_error());
    size_t pool0 = ts_mem_live_bytes(TS_MEM_STORAGE);
    TH_OK(ts_tensor_materialize(t));
    TH_OK(ts_tensor_materialize(t)); /* a no-op on a CPU storage */
    cr_assert_eq(ts_tensor_device(t), TS_DEVICE_CPU);
    cr_assert_eq(ts_tensor_device(v), TS_DEVICE_CPU, "the view over the same storage follows");
    cr_assert_eq(ts_mem_live_bytes(TS_MEM_STORAGE), pool0 + 128, "real bytes from the pool");
    cr_assert_eq(ts_meta_get_stats().live, 0, "the storage left the ledger");
    cr_assert_eq(ts_meta_get_stats().pool, ts_meta_get_stats().cached, "only the freed scalar's block is left");
    th_assert_shape(v, 2, vs);
    double vals[24];
    th_vals(v, vals, 24);
    for (int i = 0; i < 24; i++) cr_assert_eq(vals[i], 0.0, "materialized bytes are zeroed");
    cr_assert_eq(ts_storage_materialize(NULL), TS_ERR_INVALID_ARGUMENT);
    ts_tensor_free(v);
    ts_tensor_free(t);
}

/* Release and restore of a meta storage (fully_shard's reshard and
 * unshard) move its block to and from the ledger, as on the pool. */
Test(tensor_meta, release_and_restore_move_the_block_on_the_ledger)
{
    TH_OK(ts_device_scope_enter(TS_DEVICE_META));
    ts_meta_reset();
    int64_t s[1] = {1000};
    ts_tensor *t, *u, *y;
    TH_OK(ts_tensor_empty(TS_F32, 1, s, &t));
    cr_assert_eq(ts_meta_get_stats().live, 4096);
    TH_OK(ts_storage_release(ts_tensor_storage(t)));
    ts_meta_stats r = ts_meta_get_stats();
    cr_assert_eq(r.live, 0);
    cr_assert_eq(r.cached, 4096, "the block is cached");
    cr_assert_eq(ts_neg(t, &y), TS_ERR_RELEASED, "a released meta input is refused as on the CPU");
    TH_OK(ts_tensor_empty(TS_F32, 1, s, &u)); /* reuses the cached block: the pool does not grow */
    cr_assert_eq(ts_meta_get_stats().pool, 4096);
    TH_OK(ts_storage_restore(ts_tensor_storage(t)));
    cr_assert_eq(ts_meta_get_stats().pool, 8192);
    cr_assert_eq(ts_meta_get_stats().peak, 8192);
    TH_OK(ts_device_scope_exit());
    ts_tensor_free(t);
    ts_tensor_free(u);
    ts_meta_stats end = ts_meta_get_stats();
    cr_assert_eq(end.live, 0);
    cr_assert_eq(end.cached, 8192);
    ts_meta_empty_cache();
    cr_assert_eq(ts_meta_get_stats().pool, 0);
}

/* --------------------------------------------------- errors outside scope */

Test(tensor_meta, meta_inputs_outside_a_scope_are_a_clear_error)
{
    TH_OK(ts_device_scope_enter(TS_DEVICE_META));
    int64_t s[2] = {4, 3};
    ts_tensor *w, *x, *y = NULL;
    TH_OK(ts_randn(TS_F32, 2, s, NULL, &w));
    TH_OK(ts_tensor_set_requires_grad(w, true));
    TH_OK(ts_tensor_set_name(w, "0.weight"));
    TH_OK(ts_device_scope_exit());
    TH_OK(ts_randn(TS_F32, 2, s, NULL, &x));
    cr_assert_eq(ts_mul(x, w, &y), TS_ERR_STATE);
    cr_assert(strstr(ts_last_error(),
                     "mul: input 1 '0.weight' (4, 3) is on the meta device (it has no data): "
                     "materialize the model or load a checkpoint first"),
              "%s", ts_last_error());
    cr_assert_null(y);
    cr_assert_eq(ts_linear(x, w, NULL, &y), TS_ERR_STATE);
    cr_assert_eq(ts_tensor_copy_(x, w), TS_ERR_STATE, "copying from a meta tensor");
    bool g = ts_grad_mode_set(false);
    cr_assert_eq(ts_tensor_copy_(w, x), TS_ERR_STATE, "copying into a meta tensor");
    ts_grad_mode_set(g);
    float buf[12];
    cr_assert_eq(ts_tensor_copy_to(w, buf, sizeof buf), TS_ERR_STATE);
    cr_assert(strstr(ts_last_error(), "ts_tensor_copy_to: tensor '0.weight'"), "%s", ts_last_error());
    cr_assert_null(ts_tensor_data(w));
    /* initializers write without reading: they check their arguments and
     * change nothing on a meta tensor, in a scope or not */
    TH_OK(ts_uniform_(w, -1, 1, NULL));
    cr_assert_eq(ts_uniform_(w, 1, -1, NULL), TS_ERR_INVALID_ARGUMENT);
    ts_tensor_free(x);
    ts_tensor_free(w);
}

/* ------------------------------------------ the ledger equals the pool */

typedef struct mem_use {
    size_t peak;   /* storage peak above the start */
    size_t growth; /* pool growth (bytes taken from the system) */
    size_t left;   /* storage live at the end above the start */
} mem_use;

typedef ts_status (*step_fn)(void *ctx);

static mem_use measure_cpu(step_fn fn, void *ctx)
{
    ts_pool_empty_cache();
    size_t s0 = ts_mem_live_bytes(TS_MEM_STORAGE), p0 = ts_mem_live_bytes(TS_MEM_POOL);
    ts_mem_reset_peak();
    TH_OK(fn(ctx));
    return (mem_use){ts_mem_peak_bytes(TS_MEM_STORAGE) - s0, ts_mem_peak_bytes(TS_MEM_POOL) - p0,
                     ts_mem_live_bytes(TS_MEM_STORAGE) - s0};
}

static mem_use measure_meta(step_fn fn, void *ctx)
{
    size_t s0 = ts_mem_live_bytes(TS_MEM_STORAGE);
    ts_mem_reset_peak();
    TH_OK(ts_device_scope_enter(TS_DEVICE_META));
    ts_meta_reset();
    ts_meta_stats a = ts_meta_get_stats();
    TH_OK(fn(ctx));
    ts_meta_stats b = ts_meta_get_stats();
    TH_OK(ts_device_scope_exit());
    cr_assert_eq(ts_mem_peak_bytes(TS_MEM_STORAGE), s0, "the meta run took no real storage");
    return (mem_use){b.peak - a.live, b.pool_peak - a.pool, b.live - a.live};
}

static void assert_same_memory(const char *what, step_fn fn, void *ctx)
{
    mem_use cpu = measure_cpu(fn, ctx);
    mem_use meta = measure_meta(fn, ctx);
    cr_log_info("%s: storage peak cpu %zu meta %zu, pool growth cpu %zu meta %zu, left cpu %zu meta %zu", what,
                cpu.peak, meta.peak, cpu.growth, meta.growth, cpu.left, meta.left);
    cr_assert_gt(cpu.peak, 0, "%s: the step allocates", what);
    cr_assert_eq(meta.peak, cpu.peak, "%s: storage peak meta %zu, cpu %zu", what, meta.peak, cpu.peak);
    cr_assert_eq(meta.growth, cpu.growth, "%s: pool growth meta %zu, cpu %zu", what, meta.growth, cpu.growth);
    cr_assert_eq(meta.left, cpu.left, "%s: storage left meta %zu, cpu %zu", what, meta.left, cpu.left);
}

#define TRY(expr) \
    do { \
        if ((st = (expr)) != TS_OK) goto out; \
    } while (0)

/* One training step per call of `steps`: forward, loss, backward,
 * optimizer step (zero_grad set_to_none before each but the first). */
static ts_status train(ts_module *model, ts_optim *opt, int steps, ts_tensor *x, ts_tensor *targets, int64_t C,
                       bool clip)
{
    ts_status st = TS_OK;
    for (int s = 0; s < steps && !st; s++) {
        ts_tensor *y = NULL, *flat = NULL, *loss = NULL;
        ts_optim_zero_grad(opt, true);
        int64_t fs[2] = {-1, C};
        TRY(ts_module_call1(model, x, &y));
        TRY(ts_reshape(y, 2, fs, &flat));
        TRY(ts_cross_entropy(flat, targets, -100, TS_REDUCTION_MEAN, &loss));
        ts_tensor_free(y);
        ts_tensor_free(flat);
        y = flat = NULL;
        TRY(ts_backward(loss, NULL, false));
        if (clip) {
            ts_param_list p;
            double norm;
            TRY(ts_module_parameters(model, &p));
            st = ts_clip_grad_norm(p.n, p.items, 1.0, &norm);
            ts_param_list_free(&p);
            if (st) goto out;
        }
        TRY(ts_optim_step(opt));
    out:
        ts_tensor_free(y);
        ts_tensor_free(flat);
        ts_tensor_free(loss);
    }
    return st;
}

typedef struct mlp_case {
    ts_dtype dtype;
    bool fused, adam_amsgrad; /* AdamW, or Adam with amsgrad (a third state) */
} mlp_case;

/* Linear, GELU, Linear, cross_entropy, backward, AdamW: the model, the
 * optimizer and the batch are made inside the measured region, so the
 * parameters, the state and every activation and gradient are counted. */
static ts_status mlp_steps(void *ctx)
{
    const mlp_case *c = ctx;
    ts_status st;
    ts_module *l1 = NULL, *act = NULL, *l2 = NULL, *model = NULL;
    ts_optim *opt = NULL;
    ts_tensor *x = NULL, *tg = NULL;
    ts_param_list p = {0};
    int64_t xs[2] = {24, 40}, ts_[1] = {24};
    TRY(ts_linear_new(40, 96, true, &l1));
    TRY(ts_gelu_new(TS_GELU_TANH, &act));
    TRY(ts_linear_new(96, 10, true, &l2));
    ts_module *ch[3] = {l1, act, l2};
    TRY(ts_sequential_new(3, ch, &model));
    l1 = act = l2 = NULL; /* the Sequential owns them */
    if (c->dtype != TS_F32) TRY(ts_module_to_dtype(model, c->dtype));
    TRY(ts_module_parameters(model, &p));
    ts_adam_options o = c->adam_amsgrad ? ts_adam_options_default() : ts_adamw_options_default();
    o.fused = c->fused;
    o.amsgrad = c->adam_amsgrad;
    TRY(c->adam_amsgrad ? ts_adam_new(p.n, p.items, &o, &opt) : ts_adamw_new(p.n, p.items, &o, &opt));
    TRY(ts_randn(c->dtype, 2, xs, NULL, &x));
    TRY(ts_randint(0, 10, 1, ts_, NULL, &tg));
    TRY(train(model, opt, 3, x, tg, 10, true));
out:
    ts_param_list_free(&p);
    ts_optim_free(opt);
    ts_module_free(model);
    ts_module_free(l1);
    ts_module_free(act);
    ts_module_free(l2);
    ts_tensor_free(x);
    ts_tensor_free(tg);
    return st;
}

Test(tensor_meta, mlp_adamw_steps_same_memory_as_cpu)
{
    mlp_case c = {TS_F32, false, false};
    assert_same_memory("mlp f32", mlp_steps, &c);
    c.fused = true;
    assert_same_memory("mlp f32 fused", mlp_steps, &c);
    c.dtype = TS_F64;
    assert_same_memory("mlp f64 fused", mlp_steps, &c);
    c = (mlp_case){TS_F32, true, true};
    assert_same_memory("mlp f32, fused Adam with amsgrad", mlp_steps, &c);
}

/* A GPT (embeddings, layer_norm, causal self-attention with dropout,
 * residual adds, MLP, lm_head) trained for two steps with AdamW: every op
 * of a transformer step, through the real modules. */
typedef struct gpt_case {
    double dropout;
    bool fused, checkpoint;
} gpt_case;

static ts_status gpt_steps(void *ctx)
{
    const gpt_case *c = ctx;
    ts_status st;
    ts_module *model = NULL;
    ts_optim *opt = NULL;
    ts_tensor *idx = NULL, *tg = NULL;
    ts_param_list p = {0};
    ts_gpt_config cfg = ts_gpt_config_default();
    cfg.vocab_size = 96;
    cfg.block_size = 24;
    cfg.n_layer = 2;
    cfg.n_head = 4;
    cfg.d_model = 32;
    cfg.dropout = c->dropout;
    TRY(ts_gpt_new(&cfg, &model));
    if (c->checkpoint) {
        ts_module *blocks = NULL;
        TRY(ts_module_get_submodule(model, "blocks", &blocks));
        for (int i = 0; i < ts_container_size(blocks); i++) TRY(ts_checkpoint_module(ts_container_child(blocks, i)));
    }
    ts_module_train(model, true);
    TRY(ts_module_parameters(model, &p));
    ts_adam_options o = ts_adamw_options_default();
    o.fused = c->fused;
    TRY(ts_adamw_new(p.n, p.items, &o, &opt));
    int64_t is[2] = {3, 24}, ts_[1] = {72};
    TRY(ts_randint(0, 96, 2, is, NULL, &idx));
    TRY(ts_randint(0, 96, 1, ts_, NULL, &tg));
    TRY(train(model, opt, 2, idx, tg, 96, false));
out:
    ts_param_list_free(&p);
    ts_optim_free(opt);
    ts_module_free(model);
    ts_tensor_free(idx);
    ts_tensor_free(tg);
    return st;
}

Test(tensor_meta, gpt_adamw_steps_same_memory_as_cpu)
{
    gpt_case c = {0.1, false, false};
    assert_same_memory("gpt dropout 0.1", gpt_steps, &c);
    c = (gpt_case){0.0, true, false};
    assert_same_memory("gpt no dropout, fused AdamW", gpt_steps, &c);
    c = (gpt_case){0.1, false, true};
    assert_same_memory("gpt with activation checkpointing", gpt_steps, &c);
}

/* A transformer-ish block by hand: layer_norm, MultiheadAttention with a
 * causal mask and dropout on (T, B, E) inputs, a residual add, then SGD
 * with momentum. */
static ts_status block_steps(void *ctx)
{
    (void)ctx;
    ts_status st;
    ts_module *ln = NULL, *mha = NULL;
    ts_optim *opt = NULL;
    ts_tensor *x = NULL, *keep = NULL, *f = NULL, *mask = NULL;
    ts_param_list p1 = {0}, p2 = {0};
    ts_tensor *params[16];
    int64_t xs[3] = {20, 2, 32};
    TRY(ts_layer_norm_new(32, 1e-5, true, &ln));
    TRY(ts_mha_new(32, 4, 0.2, true, &mha));
    TRY(ts_module_parameters(ln, &p1));
    TRY(ts_module_parameters(mha, &p2));
    int n = 0;
    for (int i = 0; i < p1.n; i++) params[n++] = p1.items[i];
    for (int i = 0; i < p2.n; i++) params[n++] = p2.items[i];
    ts_sgd_options so = ts_sgd_options_default();
    so.momentum = 0.9;
    TRY(ts_sgd_new(n, params, &so, &opt));
    TRY(ts_randn(TS_F32, 3, xs, NULL, &x));
    TRY(ts_tril_mask(20, 0, &keep));
    TRY(ts_tensor_full(TS_BOOL, 0, NULL, 0.0, &f));
    TRY(ts_eq(keep, f, &mask));
    for (int s = 0; s < 2 && !st; s++) {
        ts_tensor *h = NULL, *a = NULL, *r = NULL, *loss = NULL;
        ts_optim_zero_grad(opt, true);
        ts_tensor *in[4];
        int nout;
        if (!(st = ts_module_call1(ln, x, &h))) {
            in[0] = in[1] = in[2] = h;
            in[3] = mask;
            st = ts_module_call(mha, 4, in, &nout, &a);
        }
        if (!st) st = ts_add(x, a, &r);
        if (!st) st = ts_mean(r, 0, NULL, false, &loss);
        if (!st) st = ts_backward(loss, NULL, false);
        if (!st) st = ts_optim_step(opt);
        ts_tensor_free(h);
        ts_tensor_free(a);
        ts_tensor_free(r);
        ts_tensor_free(loss);
    }
out:
    ts_param_list_free(&p1);
    ts_param_list_free(&p2);
    ts_optim_free(opt);
    ts_module_free(ln);
    ts_module_free(mha);
    ts_tensor_free(x);
    ts_tensor_free(keep);
    ts_tensor_free(f);
    ts_tensor_free(mask);
    return st;
}

Test(tensor_meta, attention_block_same_memory_as_cpu)
{
    assert_same_memory("layer_norm + mha + residual", block_steps, NULL);
}

/* 16-bit products take pool scratch (tensor/gemm_half.c): the ledger
 * counts it as the pool does. */
typedef struct half_case {
    ts_dtype dtype;
} half_case;

static ts_status half_matmuls(void *ctx)
{
    const half_case *c = ctx;
    ts_status st;
    ts_tensor *a = NULL, *b = NULL, *w = NULL, *bias = NULL, *y = NULL, *z = NULL, *u = NULL, *l = NULL, *bb = NULL;
    int64_t as[3] = {3, 40, 72}, bs[2] = {72, 56}, ws[2] = {48, 72}, bis[1] = {48}, bbs[3] = {3, 56, 24};
    TRY(ts_randn(TS_F32, 3, as, NULL, &u));
    TRY(ts_to_dtype(u, c->dtype, &a));
    ts_tensor_free(u);
    u = NULL;
    TRY(ts_tensor_set_requires_grad(a, true));
    TRY(ts_tensor_zeros(c->dtype, 2, bs, &b));
    TRY(ts_tensor_set_requires_grad(b, true));
    TRY(ts_tensor_ones(c->dtype, 2, ws, &w));
    TRY(ts_tensor_set_requires_grad(w, true));
    TRY(ts_tensor_ones(c->dtype, 1, bis, &bias));
    TRY(ts_tensor_set_requires_grad(bias, true));
    TRY(ts_tensor_zeros(c->dtype, 3, bbs, &bb));
    TRY(ts_tensor_set_requires_grad(bb, true));
    TRY(ts_matmul(a, b, &y));       /* folded batch (3*40, 72) @ (72, 56) */
    TRY(ts_matmul(y, bb, &z));      /* batched (3, 40, 56) @ (3, 56, 24) */
    TRY(ts_linear(a, w, bias, &u)); /* with bias: beta 1 */
    ts_tensor *s1 = NULL, *s2 = NULL;
    TRY(ts_sum(z, 0, NULL, false, &s1));
    if (!(st = ts_sum(u, 0, NULL, false, &s2))) {
        st = ts_add(s1, s2, &l);
        ts_tensor_free(s2);
    }
    ts_tensor_free(s1);
    if (!st) st = ts_backward(l, NULL, false);
out:
    ts_tensor_free(a);
    ts_tensor_free(b);
    ts_tensor_free(w);
    ts_tensor_free(bias);
    ts_tensor_free(bb);
    ts_tensor_free(y);
    ts_tensor_free(z);
    ts_tensor_free(u);
    ts_tensor_free(l);
    return st;
}

Test(tensor_meta, half_matmuls_same_memory_as_cpu)
{
    half_case c = {TS_BF16};
    assert_same_memory("bf16 matmul, batched matmul, linear and backward", half_matmuls, &c);
    c.dtype = TS_F16;
    assert_same_memory("f16 matmul, batched matmul, linear and backward", half_matmuls, &c);
}

/* The same on the sgemm kernel, which every CPU runs (the choice is read
 * at the first bfloat16 product of the process: each test runs in its
 * own). */
Test(tensor_meta, half_matmuls_same_memory_on_the_sgemm_kernel)
{
    setenv("TS_BF16_GEMM_KERNEL", "sgemm", 1);
    cr_assert_str_eq(ts_bf16_gemm_kernel_name(), "sgemm");
    half_case c = {TS_BF16};
    assert_same_memory("bf16 on sgemm", half_matmuls, &c);
}

/* Embedding, a Linear to the vocabulary, cross_entropy with ignored
 * targets, backward, plain SGD. */
static ts_status embedding_steps(void *ctx)
{
    (void)ctx;
    ts_status st;
    ts_module *emb = NULL, *head = NULL, *model = NULL;
    ts_optim *opt = NULL;
    ts_tensor *idx = NULL, *tg = NULL;
    ts_param_list p = {0};
    TRY(ts_embedding_new(100, 24, &emb));
    TRY(ts_linear_new(24, 100, false, &head));
    ts_module *ch[2] = {emb, head};
    TRY(ts_sequential_new(2, ch, &model));
    emb = head = NULL; /* the Sequential owns them */
    TRY(ts_module_parameters(model, &p));
    TRY(ts_sgd_new(p.n, p.items, NULL, &opt));
    int64_t is[2] = {4, 9}, ts_[1] = {36};
    TRY(ts_randint(0, 100, 2, is, NULL, &idx));
    TRY(ts_randint(-1, 100, 1, ts_, NULL, &tg));
    /* -1 as ignore_index: the targets drawn as -1 are ignored */
    for (int s = 0; s < 2 && !st; s++) {
        ts_tensor *y = NULL, *flat = NULL, *loss = NULL;
        int64_t fs[2] = {36, 100};
        ts_optim_zero_grad(opt, true);
        if (!(st = ts_module_call1(model, idx, &y)) && !(st = ts_view(y, 2, fs, &flat)) &&
            !(st = ts_cross_entropy(flat, tg, -1, TS_REDUCTION_MEAN, &loss)) && !(st = ts_backward(loss, NULL, false)))
            st = ts_optim_step(opt);
        ts_tensor_free(y);
        ts_tensor_free(flat);
        ts_tensor_free(loss);
    }
out:
    ts_param_list_free(&p);
    ts_optim_free(opt);
    ts_module_free(model);
    ts_module_free(emb);
    ts_module_free(head);
    ts_tensor_free(idx);
    ts_tensor_free(tg);
    return st;
}

Test(tensor_meta, embedding_cross_entropy_same_memory_as_cpu)
{
    assert_same_memory("embedding + cross_entropy + SGD", embedding_steps, NULL);
}

/* --------------------------------------------------------- optimizers */

Test(tensor_meta, optimizer_step_on_meta_parameters)
{
    TH_OK(ts_device_scope_enter(TS_DEVICE_META));
    ts_meta_reset();
    int64_t s[2] = {64, 32};
    ts_tensor *w, *g;
    TH_OK(ts_param_new(TS_F32, 2, s, &w));
    TH_OK(ts_tensor_set_name(w, "fc.weight"));
    TH_OK(ts_tensor_empty(TS_F32, 2, s, &g));
    TH_OK(ts_tensor_set_grad(w, g));
    ts_tensor_free(g);
    ts_optim *opt;
    TH_OK(ts_adamw_new(1, &w, NULL, &opt));
    size_t before = ts_meta_get_stats().live;
    TH_OK(ts_optim_step(opt));
    cr_assert_eq(ts_meta_get_stats().live, before + 2 * 8192 + 64, "exp_avg, exp_avg_sq and step, on the ledger");
    ts_tensor *ea = ts_optim_state(opt, 0, "exp_avg");
    cr_assert_eq(ts_tensor_device(ea), TS_DEVICE_META);
    cr_assert_eq(ts_optim_step_count(opt), 1);
    double norm = -1;
    TH_OK(ts_clip_grad_norm(1, &w, 1.0, &norm));
    cr_assert_eq(norm, 0.0, "meta gradients have no norm: 0 in a meta scope");
    TH_OK(ts_device_scope_exit());
    /* outside the scope: the clear error naming the parameter */
    cr_assert_eq(ts_optim_step(opt), TS_ERR_STATE);
    cr_assert(strstr(ts_last_error(), "parameter 0 ('fc.weight') (64, 32) is on the meta device (it has no data)"),
              "%s", ts_last_error());
    cr_assert_eq(ts_clip_grad_norm(1, &w, 1.0, &norm), TS_ERR_STATE);
    cr_assert(strstr(ts_last_error(), "'fc.weight'"), "%s", ts_last_error());
    /* a CPU parameter's state stays on the CPU inside a meta scope */
    ts_tensor *cw, *cg;
    TH_OK(ts_param_new(TS_F32, 2, s, &cw));
    TH_OK(ts_tensor_ones(TS_F32, 2, s, &cg));
    TH_OK(ts_tensor_set_grad(cw, cg));
    ts_tensor_free(cg);
    ts_optim *copt;
    TH_OK(ts_sgd_new(1, &cw, NULL, &copt));
    TH_OK(ts_device_scope_enter(TS_DEVICE_META));
    TH_OK(ts_optim_step(copt));
    TH_OK(ts_device_scope_exit());
    int64_t zero[2] = {0, 0};
    double v;
    TH_OK(ts_tensor_get(cw, zero, &v));
    cr_assert_float_eq(v, -1e-3, 1e-9, "a CPU parameter is updated in a meta scope too");
    ts_optim_free(copt);
    ts_tensor_free(cw);
    ts_optim_free(opt);
    ts_tensor_free(w);
}

/* Backward outside the scope of a graph built in it is refused. */
Test(tensor_meta, backward_of_a_meta_graph_outside_the_scope_is_refused)
{
    TH_OK(ts_device_scope_enter(TS_DEVICE_META));
    int64_t s[1] = {5};
    ts_tensor *x, *y;
    TH_OK(ts_tensor_ones(TS_F32, 1, s, &x));
    TH_OK(ts_tensor_set_requires_grad(x, true));
    TH_OK(ts_sum(x, 0, NULL, false, &y));
    TH_OK(ts_device_scope_exit());
    cr_assert_eq(ts_backward(y, NULL, false), TS_ERR_STATE);
    cr_assert(strstr(ts_last_error(), "ts_backward: input 0 () is on the meta device"), "%s", ts_last_error());
    TH_OK(ts_device_scope_enter(TS_DEVICE_META));
    TH_OK(ts_backward(y, NULL, false));
    TH_OK(ts_device_scope_exit());
    cr_assert_eq(ts_tensor_device(ts_tensor_grad(x)), TS_DEVICE_META);
    th_assert_shape(ts_tensor_grad(x), 1, s);
    ts_tensor_free(y);
    ts_tensor_free(x);
}
