/* optim: SGD, Adam and AdamW trajectories against torch 1.13, state,
 * zero_grad, schedules, gradient clipping, shards, errors and memory.
 *
 * Golden values: tests/fixtures/optim, made by
 * tools/reference/make_optim_vectors.py (PROVENANCE.md and index.txt there
 * list the exact torch calls). Trajectories and clipping are compared bit
 * for bit (tolerance 0 ulp): the kernels reproduce torch's sequence of
 * roundings and fused multiply-adds exactly (optim/optim.c), so any
 * difference is a bug. On a failure the message gives the first differing
 * element and its distance in ulps. */
#include <math.h>

#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "optim/internal.h"
#include "tensor/internal.h"
#include "tests/helpers.h"
#include "tests/log_capture.h"

#define NP 3
#define STEPS 10
static const int64_t shape0[2] = {3, 4}, shape1[1] = {5}, shape2[1] = {67};
static const int ndims[NP] = {2, 1, 1};
static const int64_t *const shapes[NP] = {shape0, shape1, shape2};
static const int64_t numels[NP] = {12, 5, 67};
#define PER_STEP 84 /* 12 + 5 + 67 */

/* ------------------------------------------------------------- fixtures */

static void *fx_read(const char *file, size_t want_bytes)
{
    char path[512];
    size_t len;
    snprintf(path, sizeof path, "%s/optim/%s", TS_FIXTURES_DIR, file);
    void *buf = th_read_file(path, &len);
    cr_assert_eq(len, want_bytes, "%s: %zu bytes, %zu expected", path, len, want_bytes);
    return buf;
}

static int64_t ulp_key_f32(float f)
{
    int32_t i;
    memcpy(&i, &f, 4);
    return i < 0 ? -(int64_t)(i & 0x7fffffff) : i;
}

static int64_t ulp_key_f64(double f)
{
    int64_t i;
    memcpy(&i, &f, 8);
    return i < 0 ? -(i & 0x7fffffffffffffffLL) : i;
}

/* Asserts n values of dtype dt are bit-identical. */
static void assert_same_bits(ts_dtype dt, const void *got, const void *want, int64_t n, const char *what, int step,
                             int param)
{
    size_t es = ts_dtype_size(dt);
    for (int64_t i = 0; i < n; i++) {
        if (memcmp((const char *)got + i * (int64_t)es, (const char *)want + i * (int64_t)es, es) == 0) continue;
        if (dt == TS_F32) {
            float g = ((const float *)got)[i], w = ((const float *)want)[i];
            cr_assert_fail("%s: step %d, param %d, element %lld: %.9g vs torch %.9g (%lld ulp)", what, step, param,
                           (long long)i, g, w, (long long)llabs(ulp_key_f32(g) - ulp_key_f32(w)));
        } else {
            double g = ((const double *)got)[i], w = ((const double *)want)[i];
            cr_assert_fail("%s: step %d, param %d, element %lld: %.17g vs torch %.17g (%lld ulp)", what, step, param,
                           (long long)i, g, w, (long long)llabs(ulp_key_f64(g) - ulp_key_f64(w)));
        }
    }
}

typedef enum { K_SGD, K_ADAM, K_ADAMW } kind;

typedef struct fx_case {
    const char *name;
    ts_dtype dt;
    kind k;
    ts_sgd_options sgd;
    ts_adam_options adam;
    bool skip;        /* param 1 has no grad at steps 2 and 6 */
    double lr_change; /* > 0: lr set to this before step 5 */
} fx_case;

typedef enum { LAYOUT_PLAIN, LAYOUT_SHARD, LAYOUT_STRIDED } layout;

/* Parameter i holding `vals` (row-major), requiring grad, named "p<i>".
 * STRIDED: p0 (3, 4) is the transpose of a (4, 3) leaf made without
 * grad mode, so its strides are (1, 3). */
static ts_tensor *make_param(ts_dtype dt, int i, const void *vals, layout lay)
{
    ts_tensor *t;
    size_t es = ts_dtype_size(dt);
    if (lay == LAYOUT_STRIDED && i == 0) {
        int64_t ts_[2] = {4, 3};
        ts_tensor *base;
        TH_OK(ts_tensor_empty(dt, 2, ts_, &base));
        char *d = ts_tensor_data(base);
        for (int r = 0; r < 3; r++)
            for (int c = 0; c < 4; c++)
                memcpy(d + (size_t)(c * 3 + r) * es, (const char *)vals + (size_t)(r * 4 + c) * es, es);
        bool prev = ts_grad_mode_set(false);
        TH_OK(ts_transpose(base, 0, 1, &t));
        ts_grad_mode_set(prev);
        ts_tensor_free(base);
        cr_assert(!ts_tensor_is_contiguous(t));
    } else {
        TH_OK(ts_tensor_from_data(dt, ndims[i], shapes[i], vals, &t));
    }
    TH_OK(ts_tensor_set_requires_grad(t, true));
    char name[8];
    snprintf(name, sizeof name, "p%d", i);
    TH_OK(ts_tensor_set_name(t, name));
    if (lay == LAYOUT_SHARD) ts_tensor_set_shard(t, (void *)&shape0); /* any opaque pointer */
    return t;
}

/* A gradient tensor holding `vals`; non-contiguous (a transposed copy) for
 * p0 in the STRIDED layout. */
static ts_tensor *make_grad(ts_dtype dt, int i, const void *vals, layout lay)
{
    ts_tensor *g;
    if (lay == LAYOUT_STRIDED && i == 0) {
        ts_tensor *c;
        TH_OK(ts_tensor_from_data(dt, ndims[i], shapes[i], vals, &c));
        int64_t s2[2] = {4, 3};
        ts_tensor *base, *tr;
        TH_OK(ts_tensor_empty(dt, 2, s2, &base));
        TH_OK(ts_transpose(base, 0, 1, &tr));
        TH_OK(ts_tensor_copy_(tr, c));
        ts_tensor_free(base);
        ts_tensor_free(c);
        g = tr;
    } else {
        TH_OK(ts_tensor_from_data(dt, ndims[i], shapes[i], vals, &g));
    }
    return g;
}

static ts_optim *make_optim(const fx_case *c, ts_tensor **ps)
{
    ts_optim *o = NULL;
    switch (c->k) {
    case K_SGD: TH_OK(ts_sgd_new(NP, ps, &c->sgd, &o)); break;
    case K_ADAM: TH_OK(ts_adam_new(NP, ps, &c->adam, &o)); break;
    case K_ADAMW: TH_OK(ts_adamw_new(NP, ps, &c->adam, &o)); break;
    }
    return o;
}

/* Copies parameter values (through a local view, so shards work too). */
static void read_param(ts_tensor *p, void *buf, size_t nbytes)
{
    ts_tensor *v;
    TH_OK(ts_tensor_local_view(p, &v));
    TH_OK(ts_tensor_copy_to(v, buf, nbytes));
    ts_tensor_free(v);
}

static void run_fixture_build(const fx_case *c, layout lay)
{
    th_mem_mark();
    ts_dtype dt = c->dt;
    size_t es = ts_dtype_size(dt);
    char file[96];
    snprintf(file, sizeof file, "inputs_%s.bin", dt == TS_F32 ? "f32" : "f64");
    char *in = fx_read(file, (size_t)PER_STEP * (1 + STEPS) * es);
    snprintf(file, sizeof file, "%s.bin", c->name);
    char *want = fx_read(file, (size_t)PER_STEP * STEPS * es);

    ts_tensor *ps[NP];
    size_t off = 0;
    for (int i = 0; i < NP; i++) {
        ps[i] = make_param(dt, i, in + off * es, lay);
        off += (size_t)numels[i];
    }
    ts_optim *o = make_optim(c, ps);
    char got[PER_STEP * 8], what[160];
    snprintf(what, sizeof what, "%s (%s kernels)", c->name, ts__optim_avx2_active() ? "AVX2" : "reference");
    for (int k = 0; k < STEPS; k++) {
        if (c->lr_change > 0 && k == 5) ts_optim_set_lr(o, c->lr_change);
        size_t goff = (size_t)PER_STEP * (size_t)(1 + k);
        for (int i = 0; i < NP; i++) {
            if (c->skip && i == 1 && (k == 2 || k == 6)) {
                ts_tensor_zero_grad(ps[i], true);
            } else {
                ts_tensor *g = make_grad(dt, i, in + goff * es, lay);
                TH_OK(ts_tensor_set_grad(ps[i], g));
                ts_tensor_free(g);
            }
            goff += (size_t)numels[i];
        }
        ts_status st = ts_optim_step(o);
        cr_assert_eq(st, TS_OK, "%s", ts_last_error());
        size_t woff = (size_t)PER_STEP * (size_t)k;
        for (int i = 0; i < NP; i++) {
            read_param(ps[i], got, (size_t)numels[i] * es);
            assert_same_bits(dt, got, want + woff * es, numels[i], what, k, i);
            woff += (size_t)numels[i];
        }
    }
    cr_assert_eq(ts_optim_step_count(o), STEPS);
    if (c->k != K_SGD) {
        /* per-parameter step counters, as torch's state['step'] */
        double s0, s1;
        TH_OK(ts_tensor_item(ts_optim_state(o, 0, "step"), &s0));
        TH_OK(ts_tensor_item(ts_optim_state(o, 1, "step"), &s1));
        cr_assert_eq(s0, 10.0);
        cr_assert_eq(s1, c->skip ? 8.0 : 10.0);
    }
    ts_optim_free(o);
    for (int i = 0; i < NP; i++) ts_tensor_free(ps[i]);
    free(in);
    free(want);
    th_mem_assert_back();
}

/* Runs a fixture case with the AVX2 kernels (where the CPU has them) and
 * with the plain reference kernels: both must match torch. */
static void run_fixture(const fx_case *c, layout lay)
{
    run_fixture_build(c, lay);
    ts__optim_use_reference = true;
    run_fixture_build(c, lay);
    ts__optim_use_reference = false;
}

static ts_sgd_options sgd_opts(double lr, double momentum, double dampening, double wd, bool nesterov, bool maximize)
{
    ts_sgd_options o = ts_sgd_options_default();
    o.lr = lr;
    o.momentum = momentum;
    o.dampening = dampening;
    o.weight_decay = wd;
    o.nesterov = nesterov;
    o.maximize = maximize;
    return o;
}

static ts_adam_options adam_opts(bool adamw, double lr, double wd, bool amsgrad, bool maximize)
{
    ts_adam_options o = adamw ? ts_adamw_options_default() : ts_adam_options_default();
    o.lr = lr;
    o.weight_decay = wd;
    o.amsgrad = amsgrad;
    o.maximize = maximize;
    return o;
}

static fx_case sgd_case(const char *name, ts_sgd_options o, bool skip)
{
    return (fx_case){.name = name, .dt = TS_F32, .k = K_SGD, .sgd = o, .skip = skip};
}

static fx_case adam_case(const char *name, kind k, ts_adam_options o, bool skip)
{
    return (fx_case){.name = name, .dt = TS_F32, .k = k, .adam = o, .skip = skip};
}

/* ------------------------------------------------------ SGD trajectories */

Test(optim_sgd, plain)
{
    fx_case c = sgd_case("sgd_plain", sgd_opts(0.1, 0, 0, 0, false, false), false);
    run_fixture(&c, LAYOUT_PLAIN);
}

Test(optim_sgd, momentum)
{
    fx_case c = sgd_case("sgd_momentum", sgd_opts(0.1, 0.9, 0, 0, false, false), false);
    run_fixture(&c, LAYOUT_PLAIN);
}

Test(optim_sgd, dampening)
{
    fx_case c = sgd_case("sgd_dampening", sgd_opts(0.1, 0.9, 0.3, 0, false, false), false);
    run_fixture(&c, LAYOUT_PLAIN);
}

Test(optim_sgd, nesterov)
{
    fx_case c = sgd_case("sgd_nesterov", sgd_opts(0.1, 0.9, 0, 0, true, false), false);
    run_fixture(&c, LAYOUT_PLAIN);
}

Test(optim_sgd, weight_decay)
{
    fx_case c = sgd_case("sgd_weight_decay", sgd_opts(0.1, 0.9, 0, 0.01, false, false), false);
    run_fixture(&c, LAYOUT_PLAIN);
}

Test(optim_sgd, maximize)
{
    fx_case c = sgd_case("sgd_maximize", sgd_opts(0.1, 0.9, 0, 0.01, false, true), false);
    run_fixture(&c, LAYOUT_PLAIN);
}

/* Parameter 1 has no grad at steps 2 and 6: skipped, its momentum buffer
 * kept as it was. */
Test(optim_sgd, skips_params_without_grad)
{
    fx_case c = sgd_case("sgd_momentum_skip", sgd_opts(0.1, 0.9, 0.3, 0, false, false), true);
    run_fixture(&c, LAYOUT_PLAIN);
}

Test(optim_sgd, float64)
{
    fx_case c = sgd_case("sgd_nesterov_f64", sgd_opts(0.1, 0.9, 0, 0.01, true, false), false);
    c.dt = TS_F64;
    run_fixture(&c, LAYOUT_PLAIN);
}

/* ----------------------------------------------------- Adam trajectories */

Test(optim_adam, defaults)
{
    fx_case c = adam_case("adam_default", K_ADAM, ts_adam_options_default(), false);
    run_fixture(&c, LAYOUT_PLAIN);
}

Test(optim_adam, lr_betas_eps)
{
    ts_adam_options o = adam_opts(false, 0.05, 0, false, false);
    o.beta1 = 0.8;
    o.beta2 = 0.99;
    o.eps = 1e-6;
    fx_case c = adam_case("adam_lr", K_ADAM, o, false);
    run_fixture(&c, LAYOUT_PLAIN);
}

Test(optim_adam, weight_decay)
{
    fx_case c = adam_case("adam_weight_decay", K_ADAM, adam_opts(false, 0.01, 0.1, false, false), false);
    run_fixture(&c, LAYOUT_PLAIN);
}

Test(optim_adam, amsgrad)
{
    fx_case c = adam_case("adam_amsgrad", K_ADAM, adam_opts(false, 0.05, 0, true, false), false);
    run_fixture(&c, LAYOUT_PLAIN);
}

Test(optim_adam, maximize)
{
    fx_case c = adam_case("adam_maximize", K_ADAM, adam_opts(false, 0.01, 0.1, false, true), false);
    run_fixture(&c, LAYOUT_PLAIN);
}

/* Skipped steps leave parameter 1's step counter behind (8 after 10
 * steps), which changes its bias correction exactly as in torch. */
Test(optim_adam, skips_params_without_grad)
{
    fx_case c = adam_case("adam_skip", K_ADAM, adam_opts(false, 0.05, 0, true, false), true);
    run_fixture(&c, LAYOUT_PLAIN);
}

Test(optim_adam, float64)
{
    fx_case c = adam_case("adam_amsgrad_f64", K_ADAM, adam_opts(false, 0.05, 0.1, true, false), false);
    c.dt = TS_F64;
    run_fixture(&c, LAYOUT_PLAIN);
}

/* ---------------------------------------------------- AdamW trajectories */

Test(optim_adamw, defaults)
{
    fx_case c = adam_case("adamw_default", K_ADAMW, ts_adamw_options_default(), false);
    run_fixture(&c, LAYOUT_PLAIN);
}

Test(optim_adamw, amsgrad)
{
    fx_case c = adam_case("adamw_amsgrad", K_ADAMW, adam_opts(true, 0.05, 0.1, true, false), false);
    run_fixture(&c, LAYOUT_PLAIN);
}

/* ts_optim_set_lr between steps = param_groups[0]['lr'] = ... in torch */
Test(optim_adamw, set_lr_between_steps)
{
    fx_case c = adam_case("adamw_lr_change", K_ADAMW, adam_opts(true, 0.01, 0.05, false, false), false);
    c.lr_change = 0.003;
    run_fixture(&c, LAYOUT_PLAIN);
}

Test(optim_adamw, maximize_and_skip)
{
    fx_case c = adam_case("adamw_maximize_skip", K_ADAMW, adam_opts(true, 0.01, 1e-2, false, true), true);
    run_fixture(&c, LAYOUT_PLAIN);
}

Test(optim_adamw, float64)
{
    fx_case c = adam_case("adamw_default_f64", K_ADAMW, ts_adamw_options_default(), false);
    c.dt = TS_F64;
    run_fixture(&c, LAYOUT_PLAIN);
}

/* ------------------------------------------------- shards and layouts */

/* Shard-marked parameters (as fully_shard leaves them) step through their
 * local data and give the same bits. */
Test(optim_shard, sgd_and_adam_on_shards)
{
    fx_case c = sgd_case("sgd_nesterov", sgd_opts(0.1, 0.9, 0, 0, true, false), false);
    run_fixture(&c, LAYOUT_SHARD);
    fx_case a = adam_case("adam_skip", K_ADAM, adam_opts(false, 0.05, 0, true, false), true);
    run_fixture(&a, LAYOUT_SHARD);
    fx_case w = adam_case("adamw_amsgrad", K_ADAMW, adam_opts(true, 0.05, 0.1, true, false), false);
    run_fixture(&w, LAYOUT_SHARD);
}

/* A transposed (non-contiguous) parameter with a non-contiguous gradient:
 * the strided path gives the same bits as torch. */
Test(optim_layout, non_contiguous_params_and_grads)
{
    fx_case c = sgd_case("sgd_weight_decay", sgd_opts(0.1, 0.9, 0, 0.01, false, false), false);
    run_fixture(&c, LAYOUT_STRIDED);
    fx_case a = adam_case("adam_amsgrad", K_ADAM, adam_opts(false, 0.05, 0, true, false), false);
    run_fixture(&a, LAYOUT_STRIDED);
}

/* The AVX2 build of the kernels and the plain reference build give
 * identical bits on a large tensor (vector body and scalar tail). */
static void kernel_builds_agree(ts_dtype dt, kind k)
{
    ts_generator *gen;
    TH_OK(ts_generator_new(7, &gen));
    int64_t n[1] = {10007};
    ts_tensor *init, *grads[3], *p[2];
    TH_OK(ts_randn(dt, 1, n, gen, &init));
    for (int s = 0; s < 3; s++) TH_OK(ts_randn(dt, 1, n, gen, &grads[s]));
    ts_optim *o[2];
    for (int r = 0; r < 2; r++) {
        TH_OK(ts_clone(init, &p[r]));
        TH_OK(ts_tensor_set_requires_grad(p[r], true));
        if (k == K_SGD) {
            ts_sgd_options so = sgd_opts(0.1, 0.9, 0, 0.01, true, false);
            TH_OK(ts_sgd_new(1, &p[r], &so, &o[r]));
        } else {
            ts_adam_options ao = adam_opts(k == K_ADAMW, 0.05, 0.1, true, false);
            TH_OK((k == K_ADAM ? ts_adam_new : ts_adamw_new)(1, &p[r], &ao, &o[r]));
        }
    }
    for (int s = 0; s < 3; s++) {
        for (int r = 0; r < 2; r++) {
            TH_OK(ts_tensor_set_grad(p[r], grads[s]));
            ts__optim_use_reference = r == 1;
            ts_status st = ts_optim_step(o[r]);
            ts__optim_use_reference = false;
            TH_OK(st);
        }
        assert_same_bits(dt, ts_tensor_data(p[0]), ts_tensor_data(p[1]), n[0], "avx2 vs reference build", s, 0);
    }
    for (int r = 0; r < 2; r++) {
        ts_optim_free(o[r]);
        ts_tensor_free(p[r]);
    }
    for (int s = 0; s < 3; s++) ts_tensor_free(grads[s]);
    ts_tensor_free(init);
    ts_generator_free(gen);
}

Test(optim_layout, avx2_build_matches_reference_build)
{
    if (!ts__optim_avx2_active())
        cr_skip_test("skipped: no AVX2 build of the optimizer kernels on this CPU (the fixture tests check the "
                     "reference build)");
    kernel_builds_agree(TS_F32, K_SGD);
    kernel_builds_agree(TS_F64, K_SGD);
    kernel_builds_agree(TS_F32, K_ADAM);
    kernel_builds_agree(TS_F64, K_ADAMW);
}

/* ------------------------------------------------------------- state */

static ts_tensor *vec_param(ts_dtype dt, int64_t n, double scale)
{
    int64_t s[1] = {n};
    return th_seq(dt, 1, s, scale, true);
}

static void set_seq_grad(ts_tensor *p, double scale)
{
    ts_tensor *g = th_seq(ts_tensor_dtype(p), ts_tensor_ndim(p), ts_tensor_shape(p), scale, false);
    TH_OK(ts_tensor_set_grad(p, g));
    ts_tensor_free(g);
}

Test(optim_state, names_and_presence)
{
    th_mem_mark();
    ts_tensor *p[2] = {vec_param(TS_F32, 6, 1.0), vec_param(TS_F32, 4, 1.0)};
    ts_adam_options ao = ts_adam_options_default();
    ao.amsgrad = true;
    ts_optim *o;
    TH_OK(ts_adam_new(2, p, &ao, &o));
    cr_assert_null(ts_optim_state(o, 0, "exp_avg"), "no state before the first step (torch: empty)");
    set_seq_grad(p[0], 0.5);
    TH_OK(ts_optim_step(o));
    const char *names[4] = {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
    for (int i = 0; i < 4; i++) cr_assert_not_null(ts_optim_state(o, 0, names[i]), "%s", names[i]);
    cr_assert_null(ts_optim_state(o, 1, "exp_avg"), "parameter 1 had no grad: no state");
    cr_assert_null(ts_optim_state(o, 0, "momentum_buffer"));
    cr_assert_null(ts_optim_state(o, 0, "nope"));
    cr_assert_null(ts_optim_state(o, 2, "exp_avg"));
    cr_assert_null(ts_optim_state(o, -1, "exp_avg"));
    ts_tensor *ea = ts_optim_state(o, 0, "exp_avg");
    cr_assert_eq(ts_tensor_dtype(ea), TS_F32);
    cr_assert_eq(ts_tensor_numel(ea), 6);
    cr_assert_eq(ts_tensor_ndim(ts_optim_state(o, 0, "step")), 0);
    ts_optim_free(o);

    /* without amsgrad there is no max_exp_avg_sq; SGD without momentum has no buffer */
    TH_OK(ts_adamw_new(1, p, NULL, &o));
    TH_OK(ts_optim_step(o));
    cr_assert_not_null(ts_optim_state(o, 0, "exp_avg_sq"));
    cr_assert_null(ts_optim_state(o, 0, "max_exp_avg_sq"));
    ts_optim_free(o);
    TH_OK(ts_sgd_new(1, p, NULL, &o));
    TH_OK(ts_optim_step(o));
    cr_assert_null(ts_optim_state(o, 0, "momentum_buffer"));
    ts_tensor *out;
    cr_assert_eq(ts_optim_state_create(o, 0, "momentum_buffer", &out), TS_ERR_NOT_FOUND);
    ts_optim_free(o);
    ts_tensor_free(p[0]);
    ts_tensor_free(p[1]);
    th_mem_assert_back();
}

/* Copying the state into a fresh optimizer (as a checkpoint load would)
 * and continuing gives the same bits as never stopping. */
static void resume_case(kind k)
{
    th_mem_mark();
    ts_tensor *a = vec_param(TS_F32, 37, 1.0), *b = vec_param(TS_F32, 37, 1.0);
    ts_sgd_options so = sgd_opts(0.1, 0.9, 0.3, 0.01, false, false);
    ts_adam_options ao = adam_opts(k == K_ADAMW, 0.05, 0.1, true, false);
    ts_optim *oa, *ob;
    if (k == K_SGD) TH_OK(ts_sgd_new(1, &a, &so, &oa));
    else TH_OK((k == K_ADAM ? ts_adam_new : ts_adamw_new)(1, &a, &ao, &oa));
    for (int s = 0; s < 4; s++) {
        set_seq_grad(a, 0.3 + s);
        TH_OK(ts_optim_step(oa));
    }
    /* "checkpoint": parameter values and state into a fresh optimizer */
    bool prev = ts_grad_mode_set(false);
    TH_OK(ts_tensor_copy_(b, a));
    ts_grad_mode_set(prev);
    if (k == K_SGD) TH_OK(ts_sgd_new(1, &b, &so, &ob));
    else TH_OK((k == K_ADAM ? ts_adam_new : ts_adamw_new)(1, &b, &ao, &ob));
    static const char *const sgd_names[] = {"momentum_buffer"};
    static const char *const adam_names[] = {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
    const char *const *names = k == K_SGD ? sgd_names : adam_names;
    int nn = k == K_SGD ? 1 : 4;
    for (int i = 0; i < nn; i++) {
        ts_tensor *dst;
        TH_OK(ts_optim_state_create(ob, 0, names[i], &dst));
        cr_assert_eq(ts_optim_state(ob, 0, names[i]), dst);
        TH_OK(ts_tensor_copy_(dst, ts_optim_state(oa, 0, names[i])));
    }
    for (int s = 4; s < 8; s++) {
        set_seq_grad(a, 0.3 + s);
        set_seq_grad(b, 0.3 + s);
        TH_OK(ts_optim_step(oa));
        TH_OK(ts_optim_step(ob));
    }
    assert_same_bits(TS_F32, ts_tensor_data(b), ts_tensor_data(a), 37, "resumed", 8, 0);
    ts_optim_free(oa);
    ts_optim_free(ob);
    ts_tensor_free(a);
    ts_tensor_free(b);
    th_mem_assert_back();
}

Test(optim_state, resume_from_copied_state)
{
    resume_case(K_SGD);
    resume_case(K_ADAM);
    resume_case(K_ADAMW);
}

/* ---------------------------------------------------------- zero_grad */

Test(optim_zero_grad, set_to_none_and_zero)
{
    th_mem_mark();
    ts_tensor *p[2] = {vec_param(TS_F32, 5, 1.0), vec_param(TS_F64, 3, 1.0)};
    ts_optim *o;
    TH_OK(ts_sgd_new(2, p, NULL, &o));
    set_seq_grad(p[0], 1.0);
    set_seq_grad(p[1], 1.0);
    ts_optim_zero_grad(o, false);
    for (int i = 0; i < 2; i++) {
        ts_tensor *g = ts_tensor_grad(p[i]);
        cr_assert_not_null(g);
        for (int64_t j = 0; j < ts_tensor_numel(g); j++) {
            double v;
            TH_OK(ts_tensor_get(g, &j, &v));
            cr_assert_eq(v, 0.0);
        }
    }
    ts_optim_zero_grad(o, true);
    cr_assert_null(ts_tensor_grad(p[0]));
    cr_assert_null(ts_tensor_grad(p[1]));
    ts_optim_zero_grad(o, true); /* no grads: nothing to do */
    /* a step with no grads changes nothing but counts */
    double before[5], after[5];
    ts_tensor *c64;
    TH_OK(ts_to_dtype(p[0], TS_F64, &c64));
    TH_OK(ts_tensor_copy_to(c64, before, sizeof before));
    ts_tensor_free(c64);
    TH_OK(ts_optim_step(o));
    TH_OK(ts_to_dtype(p[0], TS_F64, &c64));
    TH_OK(ts_tensor_copy_to(c64, after, sizeof after));
    ts_tensor_free(c64);
    cr_assert_arr_eq(before, after, sizeof before);
    cr_assert_eq(ts_optim_step_count(o), 1);
    ts_optim_zero_grad(NULL, true);
    ts_optim_free(o);
    ts_optim_free(NULL);
    ts_tensor_free(p[0]);
    ts_tensor_free(p[1]);
    th_mem_assert_back();
}

/* ---------------------------------------------------------------- lr */

Test(optim_lr, get_set)
{
    ts_tensor *p = vec_param(TS_F32, 3, 1.0);
    ts_optim *o;
    ts_adam_options ao = ts_adam_options_default();
    TH_OK(ts_adam_new(1, &p, &ao, &o));
    cr_assert_eq(ts_optim_get_lr(o), 1e-3);
    ts_optim_set_lr(o, 0.25);
    cr_assert_eq(ts_optim_get_lr(o), 0.25);
    ts_optim_set_lr(o, 0.0); /* a schedule may end at 0 */
    cr_assert_eq(ts_optim_get_lr(o), 0.0);
    ts_log_level lv = ts_log_get_level();
    ts_log_set_level(TS_LOG_ERROR);
    ts_optim_set_lr(o, -1.0); /* ignored */
    ts_optim_set_lr(o, NAN);
    ts_log_set_level(lv);
    cr_assert_eq(ts_optim_get_lr(o), 0.0);
    /* lr 0: parameters unchanged by Adam */
    set_seq_grad(p, 1.0);
    float before[3], after[3];
    TH_OK(ts_tensor_copy_to(p, before, sizeof before));
    TH_OK(ts_optim_step(o));
    TH_OK(ts_tensor_copy_to(p, after, sizeof after));
    cr_assert_arr_eq(before, after, sizeof before);
    ts_optim_free(o);
    ts_tensor_free(p);
}

/* Values worked out by hand from the formulas in optim.h. Tolerance: the
 * warmup values are exact binary fractions; the cosine ones may differ
 * from the closed forms by an ulp of cos() and of the final sum (4e-16
 * relative). */
Test(optim_lr, schedules)
{
    ts_lr_schedule c = {.kind = TS_LR_CONSTANT, .base_lr = 0.3};
    cr_assert_eq(ts_lr_at(&c, 0), 0.3);
    cr_assert_eq(ts_lr_at(&c, 123456), 0.3);

    ts_lr_schedule s = {
        .kind = TS_LR_WARMUP_COSINE, .base_lr = 1.0, .warmup_steps = 4, .total_steps = 12, .min_lr = 0.1};
    cr_assert_eq(ts_lr_at(&s, 0), 0.25);
    cr_assert_eq(ts_lr_at(&s, 1), 0.5);
    cr_assert_eq(ts_lr_at(&s, 2), 0.75);
    cr_assert_eq(ts_lr_at(&s, 3), 1.0);
    cr_assert_eq(ts_lr_at(&s, -3), 0.25, "negative steps count as 0");
    cr_assert_eq(ts_lr_at(&s, 4), 1.0, "cosine starts at base_lr");
    /* step 6: p = 2/8, cos(pi/4) = sqrt(2)/2 */
    double want6 = 0.1 + 0.45 * (1 + sqrt(2.0) / 2);
    cr_assert_float_eq(ts_lr_at(&s, 6), want6, 4e-16);
    /* step 8: p = 1/2, cos = 0: halfway between base and min */
    cr_assert_float_eq(ts_lr_at(&s, 8), 0.55, 4e-16);
    /* step 10: p = 3/4 */
    cr_assert_float_eq(ts_lr_at(&s, 10), 0.1 + 0.45 * (1 - sqrt(2.0) / 2), 4e-16);
    /* step 11: p = 7/8, cos(7pi/8) = -sqrt(2 + sqrt(2)) / 2 */
    cr_assert_float_eq(ts_lr_at(&s, 11), 0.1 + 0.45 * (1 - sqrt(2 + sqrt(2.0)) / 2), 4e-16);
    cr_assert_eq(ts_lr_at(&s, 12), 0.1, "min_lr at total_steps");
    cr_assert_eq(ts_lr_at(&s, 1000), 0.1);

    ts_lr_schedule nw = {
        .kind = TS_LR_WARMUP_COSINE, .base_lr = 2.0, .warmup_steps = 0, .total_steps = 4, .min_lr = 0.0};
    cr_assert_eq(ts_lr_at(&nw, 0), 2.0, "no warmup: cosine from step 0");
    cr_assert_float_eq(ts_lr_at(&nw, 2), 1.0, 4e-16);
    cr_assert_eq(ts_lr_at(&nw, 4), 0.0);

    cr_assert(isnan(ts_lr_at(NULL, 0)));
    ts_lr_schedule bad = {.kind = (ts_lr_kind)99};
    cr_assert(isnan(ts_lr_at(&bad, 0)));
}

/* ----------------------------------------------------------- clipping */

typedef struct clip_case {
    const char *name;
    ts_dtype dt;
    int n;
    int nd[10];
    int64_t shape[10][3];
} clip_case;

static int64_t cc_numel(const clip_case *c, int i)
{
    int64_t n = 1;
    for (int d = 0; d < c->nd[i]; d++) n *= c->shape[i][d];
    return n;
}

static void run_clip(const clip_case *c)
{
    th_mem_mark();
    size_t es = ts_dtype_size(c->dt);
    int64_t total = 0;
    for (int i = 0; i < c->n; i++) total += cc_numel(c, i);
    char file[96];
    snprintf(file, sizeof file, "%s.bin", c->name);
    char *fx = fx_read(file, (size_t)(2 + 2 * total) * es);
    double max_norm, want_total;
    if (c->dt == TS_F32) {
        max_norm = ((float *)fx)[0];
        want_total = ((float *)fx)[1];
    } else {
        max_norm = ((double *)fx)[0];
        want_total = ((double *)fx)[1];
    }
    ts_tensor *ps[10];
    size_t off = 2;
    for (int i = 0; i < c->n; i++) {
        TH_OK(ts_tensor_zeros(c->dt, c->nd[i], c->shape[i], &ps[i]));
        TH_OK(ts_tensor_set_requires_grad(ps[i], true));
        ts_tensor *g;
        TH_OK(ts_tensor_from_data(c->dt, c->nd[i], c->shape[i], fx + off * es, &g));
        TH_OK(ts_tensor_set_grad(ps[i], g));
        ts_tensor_free(g);
        off += (size_t)cc_numel(c, i);
    }
    double got_total = -1;
    TH_OK(ts_clip_grad_norm(c->n, ps, max_norm, &got_total));
    /* the total is torch's float32 (or float64) value, bit for bit */
    cr_assert_eq(got_total, want_total, "%s: total norm %.17g vs torch %.17g", c->name, got_total, want_total);
    char buf[8000];
    for (int i = 0; i < c->n; i++) {
        int64_t n = cc_numel(c, i);
        cr_assert_leq((size_t)n * es, sizeof buf);
        TH_OK(ts_tensor_copy_to(ts_tensor_grad(ps[i]), buf, (size_t)n * es));
        assert_same_bits(c->dt, buf, fx + off * es, n, c->name, 0, i);
        off += (size_t)n;
    }
    for (int i = 0; i < c->n; i++) ts_tensor_free(ps[i]);
    free(fx);
    th_mem_assert_back();
}

Test(optim_clip, scaled)
{
    clip_case c = {"clip_scaled", TS_F32, 3, {2, 1, 1}, {{3, 4}, {5}, {1000}}};
    run_clip(&c);
}

Test(optim_clip, below_max_norm_unchanged)
{
    clip_case c = {"clip_unscaled", TS_F32, 2, {2, 1}, {{3, 4}, {5}}};
    run_clip(&c);
}

Test(optim_clip, single_and_many)
{
    clip_case a = {"clip_single", TS_F32, 1, {2}, {{7, 9}}};
    run_clip(&a);
    clip_case b = {"clip_many",
                   TS_F32,
                   10,
                   {1, 2, 1, 1, 3, 1, 1, 2, 1, 1},
                   {{3}, {4, 4}, {9}, {1}, {2, 3, 5}, {17}, {8}, {11, 2}, {6}, {13}}};
    run_clip(&b);
}

Test(optim_clip, float64)
{
    clip_case c = {"clip_scaled_f64", TS_F64, 3, {2, 1, 1}, {{3, 4}, {5}, {300}}};
    run_clip(&c);
}

/* Per-gradient norms: one gradient of each size 1..80, 127, 1001, 4099 through
 * clip_grad_norm_ with max_norm inf (the total of one gradient is its
 * norm, as in torch). Bit for bit: covers the 8-lane body and every tail
 * length of torch's float32 kernel, and float64's sequential sum. */
static void run_norms(ts_dtype dt)
{
    size_t es = ts_dtype_size(dt);
    enum { COUNT = 83, VALUES = 80 * 81 / 2 + 127 + 1001 + 4099 };
    char *fx = fx_read(dt == TS_F32 ? "norms_f32.bin" : "norms_f64.bin", (size_t)(VALUES + COUNT) * es);
    size_t off = 0;
    const char *want = fx + (size_t)VALUES * es;
    for (int k = 0; k < COUNT; k++) {
        int64_t n = k < 80 ? k + 1 : k == 80 ? 127 : k == 81 ? 1001 : 4099;
        ts_tensor *p, *g;
        TH_OK(ts_tensor_zeros(dt, 1, &n, &p));
        TH_OK(ts_tensor_set_requires_grad(p, true));
        TH_OK(ts_tensor_from_data(dt, 1, &n, fx + off * es, &g));
        TH_OK(ts_tensor_set_grad(p, g));
        double total;
        TH_OK(ts_clip_grad_norm(1, &p, INFINITY, &total));
        double w = dt == TS_F32 ? (double)((const float *)want)[k] : ((const double *)want)[k];
        cr_assert_eq(total, w, "%s norm of %lld elements: %.17g vs torch %.17g", ts_dtype_name(dt), (long long)n, total,
                     w);
        cr_assert_eq(ts_tensor_grad(p), g, "max_norm inf: nothing to scale");
        ts_tensor_free(g);
        ts_tensor_free(p);
        off += (size_t)n;
    }
    free(fx);
}

Test(optim_clip, norms_of_every_size)
{
    run_norms(TS_F32);
    run_norms(TS_F64);
}

Test(optim_clip, non_finite_total_leaves_grads)
{
    th_mem_mark();
    ts_tensor *p[2] = {vec_param(TS_F32, 4, 1.0), vec_param(TS_F32, 3, 1.0)};
    double inf_vals[3] = {1.0, INFINITY, 2.0}, nan_vals[3] = {1.0, NAN, 2.0};
    const double *bad[2] = {inf_vals, nan_vals};
    for (int b = 0; b < 2; b++) {
        set_seq_grad(p[0], 3.0);
        int64_t s[1] = {3};
        ts_tensor *g = th_tensor(TS_F32, 1, s, bad[b]);
        TH_OK(ts_tensor_set_grad(p[1], g));
        ts_tensor_free(g);
        float before[4], after[4];
        TH_OK(ts_tensor_copy_to(ts_tensor_grad(p[0]), before, sizeof before));
        double total = 12345;
        cr_assert_eq(ts_clip_grad_norm(2, p, 1.0, &total), TS_ERR_INVALID_ARGUMENT);
        cr_assert(strstr(ts_last_error(), "non-finite"), "%s", ts_last_error());
        cr_assert_eq(total, 12345, "output written only on success");
        TH_OK(ts_tensor_copy_to(ts_tensor_grad(p[0]), after, sizeof after));
        cr_assert_arr_eq(before, after, sizeof before);
    }
    ts_tensor_free(p[0]);
    ts_tensor_free(p[1]);
    th_mem_assert_back();
}

Test(optim_clip, no_grads_and_bad_arguments)
{
    ts_tensor *p = vec_param(TS_F32, 4, 1.0);
    double total = -1;
    TH_OK(ts_clip_grad_norm(1, &p, 1.0, &total));
    cr_assert_eq(total, 0.0);
    TH_OK(ts_clip_grad_norm(0, NULL, 1.0, &total));
    set_seq_grad(p, 1.0);
    cr_assert_eq(ts_clip_grad_norm(1, &p, -1.0, &total), TS_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(ts_last_error(), "max_norm -1"), "%s", ts_last_error());
    cr_assert_eq(ts_clip_grad_norm(1, &p, NAN, &total), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_clip_grad_norm(1, &p, 1.0, NULL), TS_ERR_INVALID_ARGUMENT);
    ts_tensor *null_p = NULL;
    cr_assert_eq(ts_clip_grad_norm(1, &null_p, 1.0, &total), TS_ERR_INVALID_ARGUMENT);
    /* max_norm 0 zeroes the gradients, as in torch */
    TH_OK(ts_clip_grad_norm(1, &p, 0.0, &total));
    cr_assert_gt(total, 0.0);
    float g[4];
    TH_OK(ts_tensor_copy_to(ts_tensor_grad(p), g, sizeof g));
    for (int i = 0; i < 4; i++) cr_assert_eq(g[i], 0.0f);
    ts_tensor_free(p);
}

/* A non-contiguous gradient and a shard-marked parameter give the same
 * norm and scaling as their contiguous, plain counterparts. */
Test(optim_clip, strided_grad_and_shard)
{
    th_mem_mark();
    int64_t s[2] = {6, 5}, st[2] = {5, 6};
    ts_tensor *a = th_seq(TS_F32, 2, s, 1.0, true), *b = th_seq(TS_F32, 2, s, 1.0, true);
    ts_tensor *ga = th_seq(TS_F32, 2, s, 2.0, false);
    ts_tensor *base, *gb;
    TH_OK(ts_tensor_empty(TS_F32, 2, st, &base));
    TH_OK(ts_transpose(base, 0, 1, &gb));
    TH_OK(ts_tensor_copy_(gb, ga));
    TH_OK(ts_tensor_set_grad(a, ga));
    TH_OK(ts_tensor_set_grad(b, gb));
    ts_tensor_set_shard(b, (void *)s);
    double ta, tb;
    TH_OK(ts_clip_grad_norm(1, &a, 1.0, &ta));
    TH_OK(ts_clip_grad_norm(1, &b, 1.0, &tb));
    cr_assert_eq(ta, tb);
    cr_assert_gt(ta, 1.0);
    float x[30], y[30];
    TH_OK(ts_tensor_copy_to(ts_tensor_grad(a), x, sizeof x));
    TH_OK(ts_tensor_copy_to(ts_tensor_grad(b), y, sizeof y));
    cr_assert_arr_eq(x, y, sizeof x);
    ts_tensor_clear_shard(b);
    ts_tensor_free(ga);
    ts_tensor_free(gb);
    ts_tensor_free(base);
    ts_tensor_free(a);
    ts_tensor_free(b);
    th_mem_assert_back();
}

/* ------------------------------------------------------------- errors */

static void expect_error(ts_status st, ts_status want, const char *must_contain1, const char *must_contain2)
{
    cr_assert_eq(st, want, "status %s, %s expected (%s)", ts_status_name(st), ts_status_name(want), ts_last_error());
    cr_assert(strstr(ts_last_error(), must_contain1), "'%s' not in: %s", must_contain1, ts_last_error());
    if (must_contain2)
        cr_assert(strstr(ts_last_error(), must_contain2), "'%s' not in: %s", must_contain2, ts_last_error());
}

Test(optim_errors, parameters)
{
    th_mem_mark();
    ts_tensor *ok = vec_param(TS_F32, 3, 1.0);
    int64_t s[1] = {3};
    ts_tensor *frozen = th_seq(TS_F32, 1, s, 1.0, false);
    TH_OK(ts_tensor_set_name(frozen, "frozen.weight"));
    ts_tensor *ps[2] = {ok, frozen};
    ts_optim *o = (ts_optim *)&ps; /* must stay untouched */
    ts_optim *const sentinel = o;
    expect_error(ts_sgd_new(2, ps, NULL, &o), TS_ERR_INVALID_ARGUMENT, "parameter 1", "frozen.weight");
    cr_assert(strstr(ts_last_error(), "does not require grad"), "%s", ts_last_error());
    expect_error(ts_adam_new(2, ps, NULL, &o), TS_ERR_INVALID_ARGUMENT, "parameter 1", "frozen.weight");
    expect_error(ts_adamw_new(2, ps, NULL, &o), TS_ERR_INVALID_ARGUMENT, "parameter 1", "frozen.weight");
    cr_assert_eq(o, sentinel, "out written only on success");

    ts_tensor *ints;
    TH_OK(ts_tensor_zeros(TS_I64, 1, s, &ints));
    ps[1] = ints;
    expect_error(ts_sgd_new(2, ps, NULL, &o), TS_ERR_INVALID_ARGUMENT, "parameter 1", "int64");
    ps[1] = ok;
    expect_error(ts_sgd_new(2, ps, NULL, &o), TS_ERR_INVALID_ARGUMENT, "parameter 1", "twice");
    ps[1] = NULL;
    expect_error(ts_sgd_new(2, ps, NULL, &o), TS_ERR_INVALID_ARGUMENT, "parameter 1", "NULL");
    expect_error(ts_sgd_new(0, ps, NULL, &o), TS_ERR_INVALID_ARGUMENT, "empty", NULL);
    cr_assert_eq(ts_sgd_new(1, ps, NULL, NULL), TS_ERR_INVALID_ARGUMENT);

    /* an expanded view (stride 0) would be updated several times per element */
    ts_tensor *one = th_seq(TS_F32, 1, (int64_t[]){1}, 1.0, false), *wide;
    bool prev = ts_grad_mode_set(false);
    TH_OK(ts_expand(one, 1, (int64_t[]){4}, &wide));
    ts_grad_mode_set(prev);
    TH_OK(ts_tensor_set_requires_grad(wide, true));
    ps[0] = wide;
    expect_error(ts_sgd_new(1, ps, NULL, &o), TS_ERR_INVALID_ARGUMENT, "parameter 0", "overlapping");
    ts_tensor_free(wide);
    ts_tensor_free(one);

    /* a non-leaf (the result of an op) */
    ts_tensor *y;
    TH_OK(ts_mul_scalar(ok, 2.0, &y));
    ps[0] = y;
    expect_error(ts_adam_new(1, ps, NULL, &o), TS_ERR_INVALID_ARGUMENT, "parameter 0", "leaf");
    ts_tensor_free(y);
    ts_tensor_free(ints);
    ts_tensor_free(frozen);
    ts_tensor_free(ok);
    th_mem_assert_back();
}

Test(optim_errors, hyperparameters)
{
    ts_tensor *p = vec_param(TS_F32, 3, 1.0);
    ts_optim *o;
    ts_sgd_options so = ts_sgd_options_default();
    so.lr = 0;
    expect_error(ts_sgd_new(1, &p, &so, &o), TS_ERR_INVALID_ARGUMENT, "learning rate 0", NULL);
    so.lr = -0.5;
    expect_error(ts_sgd_new(1, &p, &so, &o), TS_ERR_INVALID_ARGUMENT, "learning rate -0.5", NULL);
    so.lr = NAN;
    expect_error(ts_sgd_new(1, &p, &so, &o), TS_ERR_INVALID_ARGUMENT, "learning rate nan", NULL);
    so = ts_sgd_options_default();
    so.weight_decay = -0.1;
    expect_error(ts_sgd_new(1, &p, &so, &o), TS_ERR_INVALID_ARGUMENT, "weight_decay -0.1", NULL);
    so = ts_sgd_options_default();
    so.momentum = -0.9;
    expect_error(ts_sgd_new(1, &p, &so, &o), TS_ERR_INVALID_ARGUMENT, "momentum -0.9", NULL);
    so = ts_sgd_options_default();
    so.nesterov = true;
    expect_error(ts_sgd_new(1, &p, &so, &o), TS_ERR_INVALID_ARGUMENT, "nesterov", "momentum 0");
    so.momentum = 0.9;
    so.dampening = 0.1;
    expect_error(ts_sgd_new(1, &p, &so, &o), TS_ERR_INVALID_ARGUMENT, "nesterov", "dampening 0.1");

    ts_adam_options ao = ts_adam_options_default();
    ao.lr = 0;
    expect_error(ts_adam_new(1, &p, &ao, &o), TS_ERR_INVALID_ARGUMENT, "Adam", "learning rate 0");
    ao = ts_adamw_options_default();
    ao.beta1 = 1.0;
    expect_error(ts_adamw_new(1, &p, &ao, &o), TS_ERR_INVALID_ARGUMENT, "AdamW", "beta1 1");
    ao = ts_adam_options_default();
    ao.beta2 = -0.1;
    expect_error(ts_adam_new(1, &p, &ao, &o), TS_ERR_INVALID_ARGUMENT, "beta2 -0.1", NULL);
    ao = ts_adam_options_default();
    ao.eps = -1e-8;
    expect_error(ts_adam_new(1, &p, &ao, &o), TS_ERR_INVALID_ARGUMENT, "epsilon -1e-08", NULL);
    ao = ts_adamw_options_default();
    ao.weight_decay = -0.01;
    expect_error(ts_adamw_new(1, &p, &ao, &o), TS_ERR_INVALID_ARGUMENT, "weight_decay -0.01", NULL);
    /* boundary values torch accepts */
    ao = ts_adam_options_default();
    ao.beta1 = 0;
    ao.eps = 0;
    TH_OK(ts_adam_new(1, &p, &ao, &o));
    ts_optim_free(o);
    ts_tensor_free(p);
}

/* A gradient whose shape or dtype does not fit (possible only by going
 * around ts_tensor_set_grad's checks, as a buggy layer above could): the
 * step fails naming the parameter and changes nothing, not even the
 * parameters checked before it. */
Test(optim_errors, gradient_mismatch_changes_nothing)
{
    th_mem_mark();
    ts_tensor *p[2] = {vec_param(TS_F32, 4, 1.0), vec_param(TS_F32, 6, 1.0)};
    TH_OK(ts_tensor_set_name(p[1], "head.bias"));
    ts_optim *o;
    ts_sgd_options so = sgd_opts(0.1, 0.9, 0, 0, false, false);
    TH_OK(ts_sgd_new(2, p, &so, &o));
    set_seq_grad(p[0], 1.0);
    int64_t s5[1] = {5};
    ts_tensor *wrong = th_seq(TS_F32, 1, s5, 1.0, false);
    p[1]->grad = wrong; /* around the API */
    float before[4], after[4];
    TH_OK(ts_tensor_copy_to(p[0], before, sizeof before));
    expect_error(ts_optim_step(o), TS_ERR_SHAPE, "parameter 1 ('head.bias')", "(5,)");
    TH_OK(ts_tensor_copy_to(p[0], after, sizeof after));
    cr_assert_arr_eq(before, after, sizeof before);
    cr_assert_null(ts_optim_state(o, 0, "momentum_buffer"));
    cr_assert_eq(ts_optim_step_count(o), 0);

    ts_tensor *wrong64 = th_seq(TS_F64, 1, (int64_t[]){6}, 1.0, false);
    p[1]->grad = wrong64;
    ts_tensor_free(wrong);
    expect_error(ts_optim_step(o), TS_ERR_DTYPE, "parameter 1", "float64");

    ts_tensor *good = th_seq(TS_F32, 1, (int64_t[]){6}, 1.0, false);
    p[1]->grad = good;
    ts_tensor_free(wrong64);
    TH_OK(ts_optim_step(o));
    cr_assert_not_null(ts_optim_state(o, 1, "momentum_buffer"));

    cr_assert_eq(ts_optim_step(NULL), TS_ERR_INVALID_ARGUMENT);
    ts_tensor *out;
    cr_assert_eq(ts_optim_state_create(o, 2, "momentum_buffer", &out), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_optim_state_create(o, 0, "exp_avg", &out), TS_ERR_NOT_FOUND);
    ts_optim_free(o);
    ts_tensor_free(p[0]);
    ts_tensor_free(p[1]);
    th_mem_assert_back();
}

/* A released parameter storage (a resharded FSDP parameter) is refused. */
Test(optim_errors, released_storage)
{
    th_mem_mark();
    ts_tensor *p = vec_param(TS_F32, 4, 1.0);
    ts_optim *o;
    TH_OK(ts_adam_new(1, &p, NULL, &o));
    set_seq_grad(p, 1.0);
    TH_OK(ts_storage_release(ts_tensor_storage(p)));
    expect_error(ts_optim_step(o), TS_ERR_RELEASED, "parameter 0", NULL);
    TH_OK(ts_storage_restore(ts_tensor_storage(p)));
    TH_OK(ts_optim_step(o));
    ts_optim_free(o);
    ts_tensor_free(p);
    th_mem_assert_back();
}

/* ------------------------------------------------------------- memory */

/* Many steps with state, zero_grad and clipping: live memory returns to
 * the mark after free, and does not grow between steps. */
Test(optim_memory, flat_and_no_leaks)
{
    th_mem_mark();
    ts_tensor *p[3] = {vec_param(TS_F32, 100, 1.0), vec_param(TS_F64, 7, 1.0), vec_param(TS_F32, 1, 1.0)};
    ts_optim *o[3];
    ts_sgd_options so = sgd_opts(0.01, 0.9, 0, 0.01, true, false);
    ts_adam_options ao = adam_opts(false, 1e-3, 0.01, true, false);
    TH_OK(ts_sgd_new(3, p, &so, &o[0]));
    TH_OK(ts_adam_new(3, p, &ao, &o[1]));
    TH_OK(ts_adamw_new(3, p, NULL, &o[2]));
    size_t live = 0;
    for (int s = 0; s < 50; s++) {
        for (int i = 0; i < 3; i++) set_seq_grad(p[i], 1.0);
        double total;
        TH_OK(ts_clip_grad_norm(3, p, 0.5, &total));
        for (int k = 0; k < 3; k++) TH_OK(ts_optim_step(o[k]));
        ts_optim_zero_grad(o[s % 3], s % 2 == 0);
        for (int i = 0; i < 3; i++) ts_tensor_zero_grad(p[i], true);
        if (s == 1) live = ts_mem_live_total() - ts_mem_live_bytes(TS_MEM_POOL);
        if (s > 1) cr_assert_eq(ts_mem_live_total() - ts_mem_live_bytes(TS_MEM_POOL), live, "step %d grew memory", s);
    }
    for (int k = 0; k < 3; k++) ts_optim_free(o[k]);
    for (int i = 0; i < 3; i++) ts_tensor_free(p[i]);
    th_mem_assert_back();
}

/* A step in which no parameter has a gradient changes nothing and says so
 * in the log, once per optimizer. */
Test(optim_step, without_any_gradient_warns_once)
{
    int64_t s[1] = {3};
    ts_tensor *p = th_seq(TS_F32, 1, s, 1.0, true);
    double before[3], after[3];
    th_vals(p, before, 3);
    ts_optim *o = NULL;
    TH_OK(ts_adamw_new(1, &p, NULL, &o));
    th_log_capture c;
    th_log_capture_begin(&c, TS_LOG_WARN);
    TH_OK(ts_optim_step(o));
    TH_OK(ts_optim_step(o));
    char *log = th_log_capture_end(&c);
    cr_assert_not_null(strstr(log, "AdamW step 0: none of its 1 parameters has a gradient"), "%s", log);
    cr_assert_null(strstr(strstr(log, "none of its") + 1, "none of its"), "said once:\n%s", log);
    free(log);
    th_vals(p, after, 3);
    for (int i = 0; i < 3; i++) cr_assert_float_eq(after[i], before[i], 0);
    /* a step with a gradient says nothing */
    ts_optim *o2 = NULL;
    TH_OK(ts_sgd_new(1, &p, NULL, &o2));
    ts_tensor *g = th_seq(TS_F32, 1, s, 1.0, false);
    TH_OK(ts_tensor_set_grad(p, g));
    th_log_capture_begin(&c, TS_LOG_WARN);
    TH_OK(ts_optim_step(o2));
    log = th_log_capture_end(&c);
    cr_assert_null(strstr(log, "gradient"), "%s", log);
    free(log);
    ts_tensor_free(g);
    ts_optim_free(o2);
    ts_optim_free(o);
    ts_tensor_free(p);
}
