/* optim_fused: the fused multi-tensor step (ts_sgd_options.fused,
 * ts_adam_options.fused) against the per-parameter step, bit for bit.
 *
 * The per-parameter step on the plain scalar reference kernels (libm fma;
 * test_optim.c checks it against torch 1.13's golden trajectories) is the
 * reference; the fused step runs on every kernel path this CPU has
 * (scalar, AVX2, AVX-512, forced with ts__kpath_force; a path the CPU
 * lacks is reported as skipped), and so does the per-parameter step. For
 * every option combination, both dtypes, and parameters laid out as views
 * of one buffer (adjacent: one run; with padding between them: one run
 * each), as separate tensors, and with a strided one, of uneven sizes
 * (every tail length of the 16- and 8-lane loops, empty ones), with some
 * parameters skipping steps (their step counts then differ, which splits
 * runs), every parameter and every state must be the same bits after every
 * step. Tolerance 0: the fused step computes each element with the same
 * kernel and arguments, so any difference is a bug. NaN compares equal to
 * NaN of any payload (which operand's payload an instruction keeps is not
 * the point here; the NaN itself must match). */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <unistd.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint/checkpoint.h"
#include "fully_shard/fully_shard.h"
#include "optim/internal.h"
#include "optim/optim_internal.h"
#include "tensor/internal.h"
#include "tensor/kernels.h"
#include "tests/helpers.h"
#include "tests/loopback_ranks.h"

/* ------------------------------------------------------------ layouts */

enum { NPAR = 7 };
/* uneven sizes: 0 (an empty shard), 1, every tail of 8 and 16 lanes */
static const int64_t k_sizes[NPAR] = {37, 0, 16, 1, 23, 8, 130};

typedef enum lay {
    LAY_ADJACENT, /* params views of one buffer back to back, grads too: one run */
    LAY_PADDED,   /* views of one buffer with 3 elements of padding after each */
    LAY_SEPARATE, /* every param and grad its own tensor */
    LAY_STRIDED,  /* adjacent, but param 4 is a (transposed) strided view and its grad too */
    LAY_COUNT
} lay;
static const char *const lay_names[LAY_COUNT] = {"adjacent", "padded", "separate", "strided"};

/* One optimizer's parameters and gradient buffers. */
typedef struct world {
    ts_dtype dt;
    lay l;
    ts_tensor *pbuf, *gbuf; /* the flat buffers (NULL for SEPARATE) */
    ts_tensor *p[NPAR], *g[NPAR];
} world;

static int64_t pad_of(lay l) { return l == LAY_PADDED ? 3 : 0; }

/* The initial value of parameter i, element k, and of its gradient at step s. */
static double pval(int i, int64_t k) { return sin(0.37 * (double)k + 1.3 * i) * 0.8; }
static double gval(int i, int64_t k, int s)
{
    return cos(0.91 * (double)k + 0.7 * i + 1.1 * s) * (s % 3 == 2 ? 30.0 : 0.05) + (k % 5 == 0 ? 0.0 : 1e-3 * s);
}

static void put(ts_dtype dt, void *base, int64_t k, double v)
{
    if (dt == TS_F32) ((float *)base)[k] = (float)v;
    else ((double *)base)[k] = v;
}

/* A view of buf at element offset off with param i's shape: 1-d, or
 * (rows, 4) for the multiple-of-4 sizes so that rows are exercised; for
 * LAY_STRIDED's param 4 a transpose of a (1, 23) view, i.e. (23, 1) with
 * strides (1, 23) (not contiguous as a whole only when both dims > 1, so
 * its (23)-element sibling is made 2-d with a gap instead: shape (23, 1),
 * strides (2, 1) over 46 elements). */
static ts_tensor *view_at(ts_tensor *buf, int i, int64_t off, lay l)
{
    ts_tensor *v = NULL;
    int64_t n = k_sizes[i];
    if (l == LAY_STRIDED && i == 4) {
        int64_t sh[2] = {n, 1}, st[2] = {2, 1};
        TH_OK(ts__tensor_alias(buf, 2, sh, st, off, &v));
        cr_assert(!ts_tensor_is_contiguous(v));
        return v;
    }
    if (n > 0 && n % 4 == 0) {
        int64_t sh[2] = {n / 4, 4}, st[2] = {4, 1};
        TH_OK(ts__tensor_alias(buf, 2, sh, st, off, &v));
    } else {
        int64_t sh[1] = {n}, st[1] = {1};
        TH_OK(ts__tensor_alias(buf, 1, sh, st, off, &v));
    }
    return v;
}

/* Elements param i occupies in the flat buffer (its span, and padding). */
static int64_t span_of(int i, lay l) { return (l == LAY_STRIDED && i == 4 ? 2 * k_sizes[i] : k_sizes[i]) + pad_of(l); }

static void world_init(world *w, ts_dtype dt, lay l)
{
    memset(w, 0, sizeof *w);
    w->dt = dt;
    w->l = l;
    int64_t total = 0;
    for (int i = 0; i < NPAR; i++) total += span_of(i, l);
    if (l != LAY_SEPARATE) {
        TH_OK(ts_tensor_full(dt, 1, &total, -7.0, &w->pbuf)); /* padding: -7, must stay */
        TH_OK(ts_tensor_full(dt, 1, &total, 99.0, &w->gbuf));
    }
    int64_t off = 0;
    for (int i = 0; i < NPAR; i++) {
        if (l == LAY_SEPARATE) {
            int64_t n = k_sizes[i];
            TH_OK(ts_tensor_zeros(dt, 1, &n, &w->p[i]));
            TH_OK(ts_tensor_zeros(dt, 1, &n, &w->g[i]));
        } else {
            w->p[i] = view_at(w->pbuf, i, off, l);
            w->g[i] = view_at(w->gbuf, i, off, l);
        }
        off += span_of(i, l);
        /* values through the (possibly strided) geometry, row-major */
        int64_t n = k_sizes[i];
        const int64_t *st = ts_tensor_strides(w->p[i]);
        int nd = ts_tensor_ndim(w->p[i]);
        int64_t inner = nd == 2 ? ts_tensor_size(w->p[i], 1) : n;
        for (int64_t k = 0; k < n; k++) {
            int64_t e = nd == 2 ? (k / inner) * st[0] + (k % inner) * st[1] : k * st[0];
            put(dt, ts_tensor_data(w->p[i]), e, pval(i, k));
        }
        TH_OK(ts_tensor_set_requires_grad(w->p[i], true));
        char name[16];
        snprintf(name, sizeof name, "p%d", i);
        TH_OK(ts_tensor_set_name(w->p[i], name));
    }
}

static void world_fini(world *w)
{
    for (int i = 0; i < NPAR; i++) {
        ts_tensor_free(w->p[i]);
        ts_tensor_free(w->g[i]);
    }
    ts_tensor_free(w->pbuf);
    ts_tensor_free(w->gbuf);
}

/* Parameter i's gradient for step s: its values into w->g[i], attached
 * (the same tensor every step, as a view of the flat buffer); params 1 and
 * 5 have none at steps 1 and 3, param 2 none at step 0. */
static void world_grads(world *w, int s)
{
    for (int i = 0; i < NPAR; i++) {
        bool skip = ((i == 1 || i == 5) && (s == 1 || s == 3)) || (i == 2 && s == 0);
        if (skip) {
            ts_tensor_zero_grad(w->p[i], true);
            continue;
        }
        ts_tensor *g = w->g[i];
        const int64_t *st = ts_tensor_strides(g);
        int nd = ts_tensor_ndim(g);
        int64_t inner = nd == 2 ? ts_tensor_size(g, 1) : k_sizes[i];
        for (int64_t k = 0; k < k_sizes[i]; k++) {
            int64_t e = nd == 2 ? (k / inner) * st[0] + (k % inner) * st[1] : k * st[0];
            put(w->dt, ts_tensor_data(g), e, gval(i, k, s));
        }
        TH_OK(ts_tensor_set_grad(w->p[i], g));
    }
}

/* ------------------------------------------------------------ options */

typedef enum kind { K_SGD, K_ADAM, K_ADAMW } kind;
static const char *const kind_names[3] = {"SGD", "Adam", "AdamW"};

typedef struct ocase {
    kind k;
    ts_sgd_options sgd;
    ts_adam_options adam;
} ocase;

static ts_optim *make(const ocase *c, const world *w, bool fused)
{
    ts_optim *o = NULL;
    ts_sgd_options so = c->sgd;
    ts_adam_options ao = c->adam;
    so.fused = ao.fused = fused;
    ts_tensor *ps[NPAR];
    memcpy(ps, w->p, sizeof ps);
    switch (c->k) {
    case K_SGD: TH_OK(ts_sgd_new(NPAR, ps, &so, &o)); break;
    case K_ADAM: TH_OK(ts_adam_new(NPAR, ps, &ao, &o)); break;
    case K_ADAMW: TH_OK(ts_adamw_new(NPAR, ps, &ao, &o)); break;
    }
    return o;
}

static bool same_bits(ts_dtype dt, const void *a, const void *b, int64_t k)
{
    if (dt == TS_F32) {
        float x = ((const float *)a)[k], y = ((const float *)b)[k];
        return (isnan(x) && isnan(y)) || memcmp(&x, &y, 4) == 0;
    }
    double x = ((const double *)a)[k], y = ((const double *)b)[k];
    return (isnan(x) && isnan(y)) || memcmp(&x, &y, 8) == 0;
}

static double at(ts_dtype dt, const void *a, int64_t k)
{
    return dt == TS_F32 ? (double)((const float *)a)[k] : ((const double *)a)[k];
}

/* Every element of the two flat buffers (or separate tensors) and every
 * state tensor is the same. */
static void assert_worlds_same(const world *a, const world *b, ts_optim *oa, ts_optim *ob, const char *what, int s)
{
    ts_dtype dt = a->dt;
    if (a->pbuf) {
        int64_t n = ts_tensor_numel(a->pbuf);
        for (int64_t k = 0; k < n; k++)
            if (!same_bits(dt, ts_tensor_data(a->pbuf), ts_tensor_data(b->pbuf), k))
                cr_assert_fail("%s, step %d: buffer element %lld: %.17g vs %.17g", what, s, (long long)k,
                               at(dt, ts_tensor_data(a->pbuf), k), at(dt, ts_tensor_data(b->pbuf), k));
    } else {
        for (int i = 0; i < NPAR; i++)
            for (int64_t k = 0; k < k_sizes[i]; k++)
                if (!same_bits(dt, ts_tensor_data(a->p[i]), ts_tensor_data(b->p[i]), k))
                    cr_assert_fail("%s, step %d: param %d element %lld: %.17g vs %.17g", what, s, i, (long long)k,
                                   at(dt, ts_tensor_data(a->p[i]), k), at(dt, ts_tensor_data(b->p[i]), k));
    }
    static const char *const names[5] = {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"};
    for (int i = 0; i < NPAR; i++)
        for (int q = 0; q < 5; q++) {
            ts_tensor *x = ts_optim_state(oa, i, names[q]), *y = ts_optim_state(ob, i, names[q]);
            cr_assert_eq(x == NULL, y == NULL, "%s, step %d: param %d state %s present in one only", what, s, i,
                         names[q]);
            if (!x) continue;
            cr_assert(ts_tensor_is_contiguous(y), "%s: state %s of param %d not contiguous", what, names[q], i);
            cr_assert_eq(ts_tensor_numel(x), ts_tensor_numel(y));
            cr_assert_eq(ts_tensor_ndim(x), ts_tensor_ndim(y));
            ts_dtype sd = ts_tensor_dtype(x);
            for (int64_t k = 0; k < ts_tensor_numel(x); k++)
                if (!same_bits(sd, ts_tensor_data(x), ts_tensor_data(y), k))
                    cr_assert_fail("%s, step %d: param %d state %s element %lld: %.17g vs %.17g", what, s, i, names[q],
                                   (long long)k, at(sd, ts_tensor_data(x), k), at(sd, ts_tensor_data(y), k));
        }
}

enum { STEPS = 5 };

/* The reference (per-parameter, scalar reference kernels) against the
 * fused step and the per-parameter step on kernel path `path`. Returns the
 * fused optimizer's kernel calls at its last step. */
static int compare_case(const ocase *c, ts_dtype dt, lay l, ts__kpath path)
{
    world wr, wf, wp;
    world_init(&wr, dt, l);
    world_init(&wf, dt, l);
    world_init(&wp, dt, l);
    ts_optim *or_ = make(c, &wr, false), *of = make(c, &wf, true), *op = make(c, &wp, false);
    char what[200];
    snprintf(what, sizeof what, "%s %s %s layout, %s path", kind_names[c->k], ts_dtype_name(dt), lay_names[l],
             ts__kpath_name(path));
    for (int s = 0; s < STEPS; s++) {
        if (s == 3) { /* a schedule's change between steps */
            ts_optim_set_lr(or_, ts_optim_get_lr(or_) * 0.5);
            ts_optim_set_lr(of, ts_optim_get_lr(of) * 0.5);
            ts_optim_set_lr(op, ts_optim_get_lr(op) * 0.5);
        }
        world_grads(&wr, s);
        world_grads(&wf, s);
        world_grads(&wp, s);
        ts__optim_use_reference = true;
        TH_OK(ts_optim_step(or_));
        ts__optim_use_reference = false;
        ts__kpath_force((int)path);
        ts_status st1 = ts_optim_step(of), st2 = ts_optim_step(op);
        ts__kpath_force(-1);
        TH_OK(st1);
        TH_OK(st2);
        assert_worlds_same(&wr, &wf, or_, of, what, s);
        char w2[220];
        snprintf(w2, sizeof w2, "%s (per-parameter)", what);
        assert_worlds_same(&wr, &wp, or_, op, w2, s);
    }
    int calls = ts__optim_fused_calls(of);
    cr_assert_eq(ts__optim_fused_calls(op), -1);
    ts_optim_free(or_);
    ts_optim_free(of);
    ts_optim_free(op);
    world_fini(&wr);
    world_fini(&wf);
    world_fini(&wp);
    return calls;
}

/* Every option combination of a kind. */
static int cases_for(kind k, ocase *out)
{
    int n = 0;
    if (k == K_SGD) {
        static const double moms[3] = {0, 0.9, 0.5}, damps[2] = {0, 0.25}, wds[2] = {0, 0.01};
        for (int a = 0; a < 3; a++)
            for (int b = 0; b < 2; b++)
                for (int c = 0; c < 2; c++)
                    for (int nest = 0; nest < 2; nest++)
                        for (int mx = 0; mx < 2; mx++) {
                            if (nest && (moms[a] == 0 || damps[b] != 0)) continue;
                            ts_sgd_options o = ts_sgd_options_default();
                            o.lr = 0.05, o.momentum = moms[a], o.dampening = damps[b], o.weight_decay = wds[c];
                            o.nesterov = nest, o.maximize = mx;
                            out[n++] = (ocase){.k = k, .sgd = o};
                        }
        return n;
    }
    static const double wds[2] = {0, 0.05};
    for (int c = 0; c < 2; c++)
        for (int ams = 0; ams < 2; ams++)
            for (int mx = 0; mx < 2; mx++) {
                ts_adam_options o = k == K_ADAMW ? ts_adamw_options_default() : ts_adam_options_default();
                o.lr = 0.01, o.weight_decay = wds[c], o.amsgrad = ams, o.maximize = mx;
                if (c == 1) o.beta1 = 0.5, o.beta2 = 0.75, o.eps = 1e-3; /* other hyperparameters too */
                out[n++] = (ocase){.k = k, .adam = o};
            }
    return n;
}

static void run_kind(kind k)
{
    th_mem_mark();
    ocase cs[64];
    int nc = cases_for(k, cs);
    cr_assert(nc > 0);
    int ran = 0;
    for (int p = 0; p < TS__KPATH_AVX512BF16; p++) {
        if (!ts__kpath_supported((ts__kpath)p)) {
            cr_log_info("optim_fused %s: kernel path %s skipped (this CPU does not run it)", kind_names[k],
                        ts__kpath_name((ts__kpath)p));
            continue;
        }
        ran++;
        for (int d = 0; d < 2; d++)
            for (int l = 0; l < LAY_COUNT; l++)
                for (int c = 0; c < nc; c++) compare_case(&cs[c], d ? TS_F64 : TS_F32, (lay)l, (ts__kpath)p);
    }
    cr_assert(ran >= 1);
    th_mem_assert_back();
}

Test(optim_fused, sgd_every_option_layout_dtype_and_path, .timeout = 120) { run_kind(K_SGD); }
Test(optim_fused, adam_every_option_layout_dtype_and_path, .timeout = 120) { run_kind(K_ADAM); }
Test(optim_fused, adamw_every_option_layout_dtype_and_path, .timeout = 120) { run_kind(K_ADAMW); }

/* The runs: adjacent parameters are one kernel call; padding between them,
 * separate tensors and a strided parameter split them; parameters whose
 * step counts differ (param 1 and 5 skipped steps 1 and 3, param 2 step 0)
 * split them too, at the last step (4) all have a gradient: params 1 and 5
 * are at 3 steps, 2 at 4, the others at 5. */
Test(optim_fused, adjacent_parameters_are_one_kernel_call)
{
    ocase c = {.k = K_ADAMW, .adam = ts_adamw_options_default()};
    ts__kpath best = ts__kpath_active();
    /* step counts at step 4: p0 5, p1 (empty) 3, p2 4, p3 5, p4 5, p5 3, p6 5:
     * runs p0 | p2 | p3 p4 | p5 | p6 (the empty p1 joins nothing, breaks nothing) */
    cr_assert_eq(compare_case(&c, TS_F32, LAY_ADJACENT, best), 5);
    cr_assert_eq(compare_case(&c, TS_F32, LAY_PADDED, best), 6); /* one per non-empty parameter */
    cr_assert_eq(compare_case(&c, TS_F32, LAY_SEPARATE, best), 6);
    cr_assert_eq(compare_case(&c, TS_F32, LAY_STRIDED, best), 6); /* p4 strided, walked on its own */
    /* SGD without momentum has no step count: one run over the buffer */
    ocase s = {.k = K_SGD, .sgd = ts_sgd_options_default()};
    cr_assert_eq(compare_case(&s, TS_F64, LAY_ADJACENT, best), 1);
    /* with momentum, a buffer made at a parameter's first step splits:
     * at step 4 none is first, so one run */
    s.sgd.momentum = 0.9;
    cr_assert_eq(compare_case(&s, TS_F64, LAY_ADJACENT, best), 1);
}

/* The state of a fused optimizer: the same names and presence as per
 * parameter (none before a parameter's first step), each state a
 * contiguous view in one buffer per state in parameter order; and state
 * written before the first step (a checkpoint being loaded) is used by
 * both alike. */
Test(optim_fused, state_names_presence_and_loading)
{
    th_mem_mark();
    world a, b;
    world_init(&a, TS_F32, LAY_ADJACENT);
    world_init(&b, TS_F32, LAY_ADJACENT);
    ts_adam_options ao = ts_adamw_options_default();
    ao.amsgrad = true;
    ocase c = {.k = K_ADAMW, .adam = ao};
    ts_optim *of = make(&c, &a, true), *op = make(&c, &b, false);
    const char *names[4];
    cr_assert_eq(ts__optim_state_names(of, names), 4);
    cr_assert_eq(ts__optim_fused_calls(of), 0);
    for (int i = 0; i < NPAR; i++) cr_assert_null(ts_optim_state(of, i, "exp_avg"));
    /* load a state for param 6 into both (as checkpoint/ does) */
    for (int q = 0; q < 4; q++) {
        ts_tensor *x = NULL, *y = NULL;
        TH_OK(ts_optim_state_create(of, 6, names[q], &x));
        TH_OK(ts_optim_state_create(op, 6, names[q], &y));
        cr_assert_eq(ts_tensor_numel(x), ts_tensor_numel(y));
        for (int64_t k = 0; k < ts_tensor_numel(x); k++) {
            float v = q == 0 ? 7.0f : (float)(0.01 * (double)(k % 13) + 0.001 * q);
            ((float *)ts_tensor_data(x))[k] = v;
            ((float *)ts_tensor_data(y))[k] = v;
        }
    }
    cr_assert_not_null(ts_optim_state(of, 6, "exp_avg"));
    cr_assert_null(ts_optim_state(of, 0, "exp_avg"), "no state before the first step but the loaded one");
    for (int s = 0; s < 3; s++) {
        world_grads(&a, s);
        world_grads(&b, s);
        TH_OK(ts_optim_step(of));
        TH_OK(ts_optim_step(op));
        assert_worlds_same(&b, &a, op, of, "loaded state", s);
    }
    /* one buffer per state, in parameter order; param 1 is empty */
    for (int q = 1; q < 4; q++) {
        const char *base = ts_tensor_data(ts_optim_state(of, 0, names[q]));
        int64_t off = 0;
        for (int i = 0; i < NPAR; i++) {
            ts_tensor *t = ts_optim_state(of, i, names[q]);
            if (!t) continue; /* param 2 took its first step at step 1, so it has state; 1 and 5 too */
            if (k_sizes[i])
                cr_assert_eq((const char *)ts_tensor_data(t), base + off * 4, "param %d state %s not at %lld", i,
                             names[q], (long long)off);
            off += k_sizes[i];
        }
    }
    double st6, st0;
    TH_OK(ts_tensor_item(ts_optim_state(of, 6, "step"), &st6));
    TH_OK(ts_tensor_item(ts_optim_state(of, 0, "step"), &st0));
    cr_assert_eq(st6, 10.0, "the loaded step 7 plus 3");
    cr_assert_eq(st0, 3.0);
    ts_optim_free(of);
    ts_optim_free(op);
    world_fini(&a);
    world_fini(&b);
    th_mem_assert_back();
}

/* Bad gradients fail a fused step before anything changes, as per
 * parameter. */
Test(optim_fused, bad_gradient_changes_nothing)
{
    th_mem_mark();
    world a;
    world_init(&a, TS_F32, LAY_ADJACENT);
    ocase c = {.k = K_ADAM, .adam = ts_adam_options_default()};
    ts_optim *o = make(&c, &a, true);
    world_grads(&a, 0);
    TH_OK(ts_optim_step(o));
    double before[300];
    int64_t total = ts_tensor_numel(a.pbuf);
    cr_assert(total <= 300);
    th_vals(a.pbuf, before, total);
    world_grads(&a, 1);
    int64_t n = 5;
    ts_tensor *bad = NULL;
    TH_OK(ts_tensor_zeros(TS_F32, 1, &n, &bad));
    ts_tensor *good = a.p[6]->grad;
    a.p[6]->grad = bad; /* 5 elements for 130, around the API (ts_tensor_set_grad refuses it) */
    ts_status st = ts_optim_step(o);
    cr_assert_eq(st, TS_ERR_SHAPE, "%s", ts_status_name(st));
    cr_assert_not_null(strstr(ts_last_error(), "p6"), "%s", ts_last_error());
    double after[300];
    th_vals(a.pbuf, after, total);
    cr_assert_eq(memcmp(before, after, (size_t)total * sizeof(double)), 0, "a failed step changed parameters");
    double s0;
    TH_OK(ts_tensor_item(ts_optim_state(o, 0, "step"), &s0));
    cr_assert_eq(s0, 1.0, "a failed step counted");
    a.p[6]->grad = good;
    ts_tensor_free(bad);
    ts_optim_free(o);
    world_fini(&a);
    th_mem_assert_back();
}

/* ------------------------------------------------------------ fully_shard */

/* Sequential(Linear(8, 16), Tanh, Linear(16, 6)) sharded as one group over
 * W ranks, AdamW fused and per-parameter on copies (same init, same
 * batches): the shards are the same bits after every step. With the
 * offload policy the shards' gradients are views of one host buffer, so
 * the fused step makes fewer kernel calls than there are parameters; with
 * param_dtype bfloat16 the optimizer updates the float32 master shards.
 * Checkpoints: a fused optimizer's state saved with ts_ckpt_save loads
 * into a per-parameter one and the other way round, and both go on to the
 * same bits. */
typedef struct fs_arg {
    int mode; /* 0 plain, 1 offload, 2 bf16 params, 3 checkpoint cross-load */
    char dir[2][128];
} fs_arg;

typedef struct fs_model {
    ts_module *m;
    ts_optim *o;
    ts_named_params np;
} fs_model;

static pthread_mutex_t g_build_mu = PTHREAD_MUTEX_INITIALIZER;

static ts_status fs_new(ts_mesh *mesh, int mode, bool fused, fs_model *f)
{
    ts_module *c[3] = {0};
    memset(f, 0, sizeof *f);
    pthread_mutex_lock(&g_build_mu);
    ts_manual_seed(11);
    ts_status st = ts_linear_new(8, 16, true, &c[0]);
    if (!st) st = ts_tanh_new(&c[1]);
    if (!st) st = ts_linear_new(16, 6, true, &c[2]);
    if (!st) st = ts_sequential_new(3, c, &f->m);
    pthread_mutex_unlock(&g_build_mu);
    if (st) return st;
    ts_offload_policy op = ts_offload_policy_default();
    ts_mp_policy mp = ts_mp_policy_default();
    mp.param_dtype = TS_BF16;
    mp.reduce_dtype = TS_F32;
    ts_fsdp_options fo = ts_fsdp_options_default();
    fo.mesh = mesh;
    if (mode == 1) fo.offload_policy = &op;
    if (mode == 2) fo.mp_policy = &mp;
    if ((st = ts_fully_shard(f->m, &fo)) || (st = ts_module_named_parameters(f->m, &f->np))) return st;
    ts_tensor *ps[8];
    for (int i = 0; i < f->np.n; i++) ps[i] = *f->np.items[i].slot;
    ts_adam_options ao = ts_adamw_options_default();
    ao.lr = 0.05;
    ao.fused = fused;
    return ts_adamw_new(f->np.n, ps, &ao, &f->o);
}

static void fs_free(fs_model *f)
{
    ts_optim_free(f->o);
    ts_named_params_free(&f->np);
    ts_module_free(f->m);
}

static ts_status fs_step(fs_model *f, int rank, int s)
{
    int64_t xs[2] = {5, 8};
    ts_tensor *x = NULL, *y = NULL, *sq = NULL, *loss = NULL;
    ts_status st = ts_tensor_empty(TS_F32, 2, xs, &x);
    if (!st) {
        float *xp = ts_tensor_data(x);
        for (int k = 0; k < 40; k++) xp[k] = (float)sin(0.3 * k + rank + 0.5 * s);
        st = ts_module_call1(f->m, x, &y);
    }
    if (!st) st = ts_mul(y, y, &sq);
    if (!st) st = ts_sum(sq, 0, NULL, false, &loss);
    if (!st) st = ts_backward(loss, NULL, false);
    if (!st) st = ts_optim_step(f->o);
    ts_optim_zero_grad(f->o, true);
    ts_tensor_free(x), ts_tensor_free(y), ts_tensor_free(sq), ts_tensor_free(loss);
    return st;
}

/* 0 if every shard of a and b is the same bits, else th_rank_fail. */
static int fs_same(th_rank *rc, const fs_model *a, const fs_model *b, const char *what, int s)
{
    for (int i = 0; i < a->np.n; i++) {
        ts_tensor *la = NULL, *lb = NULL;
        TH_RK_OK(rc, ts_tensor_local_view(*a->np.items[i].slot, &la));
        TH_RK_OK(rc, ts_tensor_local_view(*b->np.items[i].slot, &lb));
        if (ts_tensor_dtype(la) != TS_F32) return th_rank_fail(rc, "shard %d is not float32", i);
        int64_t n = ts_tensor_numel(la);
        bool same = !n || memcmp(ts_tensor_data(la), ts_tensor_data(lb), (size_t)n * 4) == 0;
        ts_tensor_free(la), ts_tensor_free(lb);
        if (!same) return th_rank_fail(rc, "%s, step %d: shard of %s differs", what, s, a->np.items[i].name);
    }
    return 0;
}

static int fs_rank(th_rank *rc)
{
    const fs_arg *a = rc->arg;
    fs_model f[4];
    ts_mesh *mesh = th_rank_mesh(rc, false);
    if (!mesh) return th_rank_fail(rc, "mesh: %s", ts_last_error());
    TH_RK_OK(rc, fs_new(mesh, a->mode, false, &f[0]));
    TH_RK_OK(rc, fs_new(mesh, a->mode, true, &f[1]));
    int steps = a->mode == 3 ? 2 : 3;
    for (int s = 0; s < steps; s++) {
        TH_RK_OK(rc, fs_step(&f[0], rc->rank, s));
        TH_RK_OK(rc, fs_step(&f[1], rc->rank, s));
        if (fs_same(rc, &f[0], &f[1], "fused against per-parameter", s)) return 1;
    }
    int calls = ts__optim_fused_calls(f[1].o);
    if (calls < 1 || calls > f[1].np.n) return th_rank_fail(rc, "fused calls %d for %d parameters", calls, f[1].np.n);
    if (a->mode == 1 && calls >= f[1].np.n)
        return th_rank_fail(rc, "offload: gradients in one buffer, yet %d calls for %d parameters", calls, f[1].np.n);
    if (a->mode == 3) {
        /* f[1] (fused) saved, loaded by f[2] (per-parameter); f[0] saved,
         * loaded by f[3] (fused); all four go on alike */
        for (int k = 0; k < 2; k++) {
            ts_ckpt_options co = ts_ckpt_options_default();
            co.optim = f[1 - k].o;
            TH_RK_OK(rc, ts_ckpt_save(a->dir[k], f[1 - k].m, &co));
            TH_RK_OK(rc, fs_new(mesh, 0, k == 1, &f[2 + k]));
            co.optim = f[2 + k].o;
            TH_RK_OK(rc, ts_ckpt_load(a->dir[k], f[2 + k].m, &co, NULL));
            TH_RK_EQ(rc, ts_optim_step_count(f[2 + k].o), steps);
        }
        for (int s = steps; s < steps + 2; s++) {
            for (int k = 0; k < 4; k++) TH_RK_OK(rc, fs_step(&f[k], rc->rank, s));
            if (fs_same(rc, &f[0], &f[1], "fused against per-parameter", s) ||
                fs_same(rc, &f[0], &f[2], "per-parameter loaded from fused", s) ||
                fs_same(rc, &f[0], &f[3], "fused loaded from per-parameter", s))
                return 1;
        }
        fs_free(&f[2]);
        fs_free(&f[3]);
    }
    fs_free(&f[0]);
    fs_free(&f[1]);
    ts_mesh_free(mesh);
    return 0;
}

Test(optim_fused, fully_shard_two_ranks_same_shards, .timeout = 60)
{
    fs_arg a = {.mode = 0};
    th_run_world(2, fs_rank, &a, 30.0);
}

Test(optim_fused, fully_shard_offload_one_run_per_gradient_buffer, .timeout = 60)
{
    fs_arg a = {.mode = 1};
    th_run_world(2, fs_rank, &a, 30.0);
}

Test(optim_fused, fully_shard_bf16_params_float32_master, .timeout = 60)
{
    fs_arg a = {.mode = 2};
    th_run_world(2, fs_rank, &a, 30.0);
}

Test(optim_fused, checkpoint_state_loads_across_fused_and_per_parameter, .timeout = 60)
{
    char base[] = "/tmp/ts_fused_test.XXXXXX";
    cr_assert(mkdtemp(base), "mkdtemp: %s", strerror(errno));
    fs_arg a = {.mode = 3};
    snprintf(a.dir[0], sizeof a.dir[0], "%s/fused", base);
    snprintf(a.dir[1], sizeof a.dir[1], "%s/plain", base);
    th_run_world(2, fs_rank, &a, 30.0);
    th_rm_rf(a.dir[0]);
    th_rm_rf(a.dir[1]);
    rmdir(base);
}

/* Parameters of both dtypes in one optimizer (one state buffer per dtype,
 * a run never crossing dtypes), and one with only empty parameters. */
Test(optim_fused, mixed_dtypes_and_only_empty_parameters)
{
    th_mem_mark();
    static const ts_dtype dts[4] = {TS_F32, TS_F64, TS_F32, TS_F64};
    static const int64_t ns[4] = {19, 9, 33, 0};
    ts_tensor *p[2][4], *g[2][4], *flat[2][2], *gflat[2][2];
    ts_optim *o[2];
    for (int v = 0; v < 2; v++) {
        /* the f32 ones adjacent in one buffer, the f64 ones in another */
        int64_t n32 = ns[0] + ns[2], n64 = ns[1] + ns[3], one = 1;
        TH_OK(ts_tensor_full(TS_F32, 1, &n32, 0.5, &flat[v][0]));
        TH_OK(ts_tensor_full(TS_F64, 1, &n64, -0.25, &flat[v][1]));
        TH_OK(ts_tensor_zeros(TS_F32, 1, &n32, &gflat[v][0]));
        TH_OK(ts_tensor_zeros(TS_F64, 1, &n64, &gflat[v][1]));
        int64_t off[2] = {0, 0};
        for (int i = 0; i < 4; i++) {
            int d = dts[i] == TS_F64;
            TH_OK(ts__tensor_alias(flat[v][d], 1, &ns[i], &one, off[d], &p[v][i]));
            TH_OK(ts__tensor_alias(gflat[v][d], 1, &ns[i], &one, off[d], &g[v][i]));
            off[d] += ns[i];
            TH_OK(ts_tensor_set_requires_grad(p[v][i], true));
        }
        ts_adam_options ao = ts_adam_options_default();
        ao.weight_decay = 0.1, ao.amsgrad = true, ao.fused = v == 1;
        TH_OK(ts_adam_new(4, p[v], &ao, &o[v]));
    }
    for (int s = 0; s < 4; s++) {
        for (int v = 0; v < 2; v++) {
            for (int i = 0; i < 4; i++) {
                for (int64_t k = 0; k < ns[i]; k++) put(dts[i], ts_tensor_data(g[v][i]), k, gval(i, k, s));
                TH_OK(ts_tensor_set_grad(p[v][i], g[v][i]));
            }
            TH_OK(ts_optim_step(o[v]));
        }
        for (int d = 0; d < 2; d++) {
            ts_dtype dt = d ? TS_F64 : TS_F32;
            for (int64_t k = 0; k < ts_tensor_numel(flat[0][d]); k++)
                cr_assert(same_bits(dt, ts_tensor_data(flat[0][d]), ts_tensor_data(flat[1][d]), k),
                          "step %d, %s element %lld", s, ts_dtype_name(dt), (long long)k);
        }
        /* f32 params 0 and 2 (data and gradients adjacent) are one run
         * though param 1 comes between them, f64 param 1 another, the
         * empty one none */
        cr_assert_eq(ts__optim_fused_calls(o[1]), 2, "calls %d", ts__optim_fused_calls(o[1]));
    }
    for (int v = 0; v < 2; v++) {
        ts_optim_free(o[v]);
        for (int i = 0; i < 4; i++) ts_tensor_free(p[v][i]), ts_tensor_free(g[v][i]);
        ts_tensor_free(flat[v][0]), ts_tensor_free(flat[v][1]);
        ts_tensor_free(gflat[v][0]), ts_tensor_free(gflat[v][1]);
    }
    /* only empty parameters: the state buffers are empty, steps count */
    int64_t zero = 0;
    ts_tensor *e[2];
    for (int i = 0; i < 2; i++) {
        TH_OK(ts_tensor_zeros(TS_F32, 1, &zero, &e[i]));
        TH_OK(ts_tensor_set_requires_grad(e[i], true));
        ts_tensor *eg = NULL;
        TH_OK(ts_tensor_zeros(TS_F32, 1, &zero, &eg));
        TH_OK(ts_tensor_set_grad(e[i], eg));
        ts_tensor_free(eg);
    }
    ts_adam_options ao = ts_adamw_options_default();
    ao.fused = true;
    ts_optim *oe = NULL;
    TH_OK(ts_adamw_new(2, e, &ao, &oe));
    TH_OK(ts_optim_step(oe));
    TH_OK(ts_optim_step(oe));
    cr_assert_eq(ts__optim_fused_calls(oe), 0);
    double st;
    TH_OK(ts_tensor_item(ts_optim_state(oe, 1, "step"), &st));
    cr_assert_eq(st, 2.0);
    cr_assert_eq(ts_tensor_numel(ts_optim_state(oe, 0, "exp_avg")), 0);
    ts_optim_free(oe);
    ts_tensor_free(e[0]), ts_tensor_free(e[1]);
    th_mem_assert_back();
}

/* Every row kernel of every path starts on a 64-byte boundary
 * (OPT_ROW_ALIGN in optim/kernels.c): bench_optim's figures then do not
 * move with where the linker puts the file. */
Test(optim_fused, row_kernels_start_on_64_byte_boundaries)
{
    for (int path = -1; path < TS__KPATH_COUNT; path++) { /* -1: the scalar reference */
        ts__optim_use_reference = path < 0;
        if (path >= 0) ts__kpath_force(path);
        row_fn fns[4] = {ts__optim_sgd_kernel(true), ts__optim_sgd_kernel(false), ts__optim_adam_kernel(true),
                         ts__optim_adam_kernel(false)};
        ts__optim_use_reference = false;
        ts__kpath_force(-1);
        for (int i = 0; i < 4; i++)
            cr_expect_eq((uintptr_t)fns[i] % 64, 0, "path %s: %s %s kernel at %p",
                         path < 0 ? "reference" : ts__kpath_name((ts__kpath)path), i < 2 ? "SGD" : "Adam",
                         i % 2 ? "f64" : "f32", (void *)(uintptr_t)fns[i]);
    }
}
