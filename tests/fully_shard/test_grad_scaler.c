#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "fully_shard/grad_scaler.h"
#include "tests/loopback_ranks.h"

/* ts_grad_scaler on one rank (the one-rank world group) and on two
 * loopback ranks; the semantics are torch.amp.GradScaler's, with
 * ShardedGradScaler's all-reduce of the found-inf flag. */

/* A float32 parameter (n) requiring grad, with gradient g. */
static ts_tensor *param_with_grad(ts_dtype dt, int64_t n, const double *p, const double *g)
{
    ts_tensor *t = th_tensor(dt, 1, &n, p);
    TH_OK(ts_tensor_set_requires_grad(t, true));
    if (g) {
        ts_tensor *gr = th_tensor(dt, 1, &n, g);
        TH_OK(ts_tensor_set_grad(t, gr));
        ts_tensor_free(gr);
    }
    return t;
}

static ts_optim *sgd(int n, ts_tensor **ps, double lr)
{
    ts_sgd_options so = ts_sgd_options_default();
    so.lr = lr;
    ts_optim *o = NULL;
    TH_OK(ts_sgd_new(n, ps, &so, &o));
    return o;
}

Test(fully_shard_grad_scaler, defaults_are_torchs)
{
    ts_grad_scaler_options o = ts_grad_scaler_options_default();
    cr_assert_eq(o.init_scale, 65536.0);
    cr_assert_eq(o.growth_factor, 2.0);
    cr_assert_eq(o.backoff_factor, 0.5);
    cr_assert_eq(o.growth_interval, 2000);
    cr_assert(o.enabled);
    cr_assert_null(o.group);
    ts_grad_scaler *s = NULL;
    TH_OK(ts_grad_scaler_new(NULL, &s));
    cr_assert_eq(ts_grad_scaler_get_scale(s), 65536.0);
    cr_assert_eq(ts_grad_scaler_growth_tracker(s), 0);
    cr_assert(ts_grad_scaler_is_enabled(s));
    ts_grad_scaler_free(s);
    ts_grad_scaler_free(NULL);
}

Test(fully_shard_grad_scaler, bad_options_name_the_value)
{
    struct {
        const char *field;
        double v;
        const char *msg;
    } cases[] = {
        {"init_scale", 0.0, "init_scale 0"},
        {"init_scale", -1.0, "init_scale -1"},
        {"init_scale", INFINITY, "init_scale inf"},
        {"init_scale", 1e300, "init_scale 1e+300"},
        {"growth_factor", 1.0, "growth factor must be > 1.0 (growth_factor 1)"},
        {"growth_factor", NAN, "growth_factor nan"},
        {"backoff_factor", 1.0, "backoff_factor 1"},
        {"backoff_factor", 0.0, "backoff_factor 0"},
        {"growth_interval", 0, "growth_interval 0 must be >= 1"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        ts_grad_scaler_options o = ts_grad_scaler_options_default();
        if (!strcmp(cases[i].field, "init_scale")) o.init_scale = cases[i].v;
        if (!strcmp(cases[i].field, "growth_factor")) o.growth_factor = cases[i].v;
        if (!strcmp(cases[i].field, "backoff_factor")) o.backoff_factor = cases[i].v;
        if (!strcmp(cases[i].field, "growth_interval")) o.growth_interval = (int64_t)cases[i].v;
        ts_grad_scaler *s = (ts_grad_scaler *)0x1;
        cr_assert_eq(ts_grad_scaler_new(&o, &s), TS_ERR_INVALID_ARGUMENT, "%s", cases[i].field);
        cr_assert_eq(s, (ts_grad_scaler *)0x1, "out written on error");
        cr_assert(strstr(ts_last_error(), cases[i].msg), "%s: %s", cases[i].field, ts_last_error());
    }
}

/* scale() multiplies the loss in its own dtype, differentiably: the
 * gradients are scale times the unscaled ones. */
Test(fully_shard_grad_scaler, scale_multiplies_the_loss_and_its_gradients)
{
    ts_grad_scaler_options o = ts_grad_scaler_options_default();
    o.init_scale = 1024.0;
    ts_grad_scaler *s = NULL;
    TH_OK(ts_grad_scaler_new(&o, &s));
    double pv[3] = {0.5, -1.25, 3.0};
    ts_tensor *p = param_with_grad(TS_F32, 3, pv, NULL);
    ts_tensor *sq = NULL, *loss = NULL, *scaled = NULL;
    TH_OK(ts_mul(p, p, &sq));
    TH_OK(ts_sum(sq, 0, NULL, false, &loss));
    TH_OK(ts_grad_scaler_scale(s, loss, &scaled));
    cr_assert_eq(ts_tensor_dtype(scaled), TS_F32);
    double l, ls;
    th_vals(loss, &l, 1);
    th_vals(scaled, &ls, 1);
    cr_assert_eq(ls, l * 1024.0);
    TH_OK(ts_backward(scaled, NULL, false));
    double g[3];
    th_vals(ts_tensor_grad(p), g, 3);
    for (int i = 0; i < 3; i++) cr_assert_eq(g[i], 2.0 * pv[i] * 1024.0, "g[%d] = %g", i, g[i]);
    ts_tensor_free(sq);
    ts_tensor_free(loss);
    ts_tensor_free(scaled);
    ts_tensor_free(p);
    ts_grad_scaler_free(s);
}

/* A good step: the gradients are divided by the scale exactly (a power of
 * two), the optimizer steps on them, and update() counts the good step. */
Test(fully_shard_grad_scaler, good_step_unscales_and_steps)
{
    ts_grad_scaler *s = NULL;
    TH_OK(ts_grad_scaler_new(NULL, &s));
    double pv[4] = {1, 2, 3, 4}, gv[4] = {65536.0, -32768.0, 3.0, 0.0};
    ts_tensor *p = param_with_grad(TS_F32, 4, pv, gv);
    ts_optim *opt = sgd(1, &p, 0.5);
    bool stepped = false;
    TH_OK(ts_grad_scaler_step(s, opt, &stepped));
    cr_assert(stepped);
    cr_assert(!ts_grad_scaler_found_inf(s, opt));
    double g[4], v[4];
    th_vals(ts_tensor_grad(p), g, 4);
    cr_assert_eq(g[0], 1.0);
    cr_assert_eq(g[1], -0.5);
    cr_assert_eq(g[2], (double)(3.0f * (1.0f / 65536.0f)));
    cr_assert_eq(g[3], 0.0);
    th_vals(p, v, 4);
    for (int i = 0; i < 4; i++)
        cr_assert_eq(v[i], (double)((float)pv[i] - 0.5f * (float)g[i]), "p[%d] = %.9g", i, v[i]);
    cr_assert_eq(ts_optim_step_count(opt), 1);
    TH_OK(ts_grad_scaler_update(s));
    cr_assert_eq(ts_grad_scaler_get_scale(s), 65536.0);
    cr_assert_eq(ts_grad_scaler_growth_tracker(s), 1);
    ts_optim_free(opt);
    ts_tensor_free(p);
    ts_grad_scaler_free(s);
}

/* test_gradient_scaler's injected inf: the step is skipped (parameters and
 * optimizer untouched) and the scale is backed off; NaN the same. */
Test(fully_shard_grad_scaler, inf_or_nan_skips_the_step_and_backs_off)
{
    ts_grad_scaler *s = NULL;
    TH_OK(ts_grad_scaler_new(NULL, &s));
    double pv[3] = {1, 2, 3};
    double bad[2][3] = {{1.0, INFINITY, 2.0}, {NAN, 1.0, 2.0}};
    for (int k = 0; k < 2; k++) {
        double good[3] = {4, 5, 6};
        ts_tensor *p0 = param_with_grad(TS_F32, 3, pv, good);
        ts_tensor *p1 = param_with_grad(TS_F32, 3, pv, bad[k]);
        ts_tensor *ps[2] = {p0, p1};
        ts_optim *opt = sgd(2, ps, 0.1);
        double before = ts_grad_scaler_get_scale(s);
        bool stepped = true;
        TH_OK(ts_grad_scaler_step(s, opt, &stepped));
        cr_assert(!stepped);
        cr_assert(ts_grad_scaler_found_inf(s, opt));
        cr_assert_eq(ts_optim_step_count(opt), 0);
        double v[3];
        th_vals(p0, v, 3);
        for (int i = 0; i < 3; i++) cr_assert_eq(v[i], pv[i]);
        TH_OK(ts_grad_scaler_update(s));
        cr_assert_eq(ts_grad_scaler_get_scale(s), before * 0.5);
        cr_assert_eq(ts_grad_scaler_growth_tracker(s), 0);
        ts_optim_free(opt);
        ts_tensor_free(p0);
        ts_tensor_free(p1);
    }
    cr_assert_eq(ts_grad_scaler_get_scale(s), 16384.0);
    ts_grad_scaler_free(s);
}

/* growth_interval good steps grow the scale; a bad one in between resets
 * the count (torch's _amp_update_scale_). */
Test(fully_shard_grad_scaler, grows_after_growth_interval_good_steps)
{
    ts_grad_scaler_options o = ts_grad_scaler_options_default();
    o.init_scale = 8.0;
    o.growth_interval = 3;
    o.growth_factor = 4.0;
    o.backoff_factor = 0.25;
    ts_grad_scaler *s = NULL;
    TH_OK(ts_grad_scaler_new(&o, &s));
    /* pattern of steps: good good bad good good good */
    const bool inf_at[6] = {false, false, true, false, false, false};
    const double want_scale[6] = {8, 8, 2, 2, 2, 8};
    const int64_t want_tracker[6] = {1, 2, 0, 1, 2, 0};
    double pv[2] = {1, 2};
    for (int it = 0; it < 6; it++) {
        double gv[2] = {1.0, inf_at[it] ? -INFINITY : 2.0};
        ts_tensor *p = param_with_grad(TS_F32, 2, pv, gv);
        ts_optim *opt = sgd(1, &p, 0.1);
        bool stepped;
        TH_OK(ts_grad_scaler_step(s, opt, &stepped));
        cr_assert_eq(stepped, !inf_at[it], "iteration %d", it);
        TH_OK(ts_grad_scaler_update(s));
        cr_assert_eq(ts_grad_scaler_get_scale(s), want_scale[it], "iteration %d: scale %g", it,
                     ts_grad_scaler_get_scale(s));
        cr_assert_eq(ts_grad_scaler_growth_tracker(s), want_tracker[it], "iteration %d", it);
        ts_optim_free(opt);
        ts_tensor_free(p);
    }
    ts_grad_scaler_free(s);
}

/* Growth never makes the scale infinite (torch's kernel keeps it). */
Test(fully_shard_grad_scaler, growth_keeps_a_finite_scale)
{
    ts_grad_scaler_options o = ts_grad_scaler_options_default();
    o.init_scale = 0x1p127;
    o.growth_interval = 1;
    ts_grad_scaler *s = NULL;
    TH_OK(ts_grad_scaler_new(&o, &s));
    double pv[1] = {1}, gv[1] = {0};
    ts_tensor *p = param_with_grad(TS_F32, 1, pv, gv);
    ts_optim *opt = sgd(1, &p, 0.1);
    TH_OK(ts_grad_scaler_step(s, opt, NULL));
    TH_OK(ts_grad_scaler_update(s));
    cr_assert_eq(ts_grad_scaler_get_scale(s), 0x1p127);
    ts_optim_free(opt);
    ts_tensor_free(p);
    ts_grad_scaler_free(s);
}

/* unscale() before step (to clip), then step does not unscale again;
 * torch's stage errors; update without any inf check. */
Test(fully_shard_grad_scaler, stage_errors_are_torchs)
{
    ts_grad_scaler *s = NULL;
    TH_OK(ts_grad_scaler_new(NULL, &s));
    cr_assert_eq(ts_grad_scaler_update(s), TS_ERR_STATE);
    cr_assert(strstr(ts_last_error(), "No inf checks were recorded prior to update"), "%s", ts_last_error());
    double pv[2] = {1, 2}, gv[2] = {131072.0, 65536.0};
    ts_tensor *p = param_with_grad(TS_F32, 2, pv, gv);
    ts_optim *opt = sgd(1, &p, 1.0);
    TH_OK(ts_grad_scaler_unscale(s, opt));
    double g[2];
    th_vals(ts_tensor_grad(p), g, 2);
    cr_assert_eq(g[0], 2.0);
    cr_assert_eq(g[1], 1.0);
    cr_assert_eq(ts_grad_scaler_unscale(s, opt), TS_ERR_STATE);
    cr_assert(strstr(ts_last_error(), "unscale_() has already been called on this optimizer since the last update()"),
              "%s", ts_last_error());
    bool stepped = false;
    TH_OK(ts_grad_scaler_step(s, opt, &stepped));
    cr_assert(stepped);
    double v[2];
    th_vals(p, v, 2);
    cr_assert_eq(v[0], -1.0, "unscaled once: %g", v[0]);
    cr_assert_eq(v[1], 1.0);
    cr_assert_eq(ts_grad_scaler_step(s, opt, NULL), TS_ERR_STATE);
    cr_assert(strstr(ts_last_error(), "step() has already been called since the last update()"), "%s", ts_last_error());
    cr_assert_eq(ts_grad_scaler_unscale(s, opt), TS_ERR_STATE);
    cr_assert(strstr(ts_last_error(), "unscale_() is being called after step()"), "%s", ts_last_error());
    TH_OK(ts_grad_scaler_update(s));
    /* after update the optimizer is READY again */
    TH_OK(ts_grad_scaler_unscale(s, opt));
    TH_OK(ts_grad_scaler_update(s));
    ts_optim_free(opt);
    ts_tensor_free(p);
    ts_grad_scaler_free(s);
}

/* float64 gradients are multiplied in float64 by the float32 inverse;
 * parameters without a gradient are skipped. */
Test(fully_shard_grad_scaler, float64_gradients_and_missing_ones)
{
    ts_grad_scaler_options o = ts_grad_scaler_options_default();
    o.init_scale = 3.0; /* 1/3 is not exact: inv = (float)(1/3.0) */
    ts_grad_scaler *s = NULL;
    TH_OK(ts_grad_scaler_new(&o, &s));
    double pv[2] = {1, 2}, gv[2] = {1.0, 0.1};
    ts_tensor *p = param_with_grad(TS_F64, 2, pv, gv);
    ts_tensor *q = param_with_grad(TS_F32, 2, pv, NULL);
    ts_tensor *ps[2] = {p, q};
    ts_optim *opt = sgd(2, ps, 1.0);
    TH_OK(ts_grad_scaler_unscale(s, opt));
    double g[2];
    th_vals(ts_tensor_grad(p), g, 2);
    double inv = (double)(float)(1.0 / 3.0);
    cr_assert_eq(g[0], 1.0 * inv);
    cr_assert_eq(g[1], 0.1 * inv);
    cr_assert_null(ts_tensor_grad(q));
    ts_optim_free(opt);
    ts_tensor_free(p);
    ts_tensor_free(q);
    ts_grad_scaler_free(s);
}

/* A non-contiguous gradient (a transposed view) is unscaled element by
 * element through its strides. */
Test(fully_shard_grad_scaler, strided_gradient)
{
    ts_grad_scaler_options o = ts_grad_scaler_options_default();
    o.init_scale = 4.0;
    ts_grad_scaler *s = NULL;
    TH_OK(ts_grad_scaler_new(&o, &s));
    int64_t sh[2] = {2, 3};
    double pv[6] = {0}, gv[6] = {4, 8, 12, 16, 20, 24};
    ts_tensor *p = th_tensor(TS_F32, 2, sh, pv);
    TH_OK(ts_tensor_set_requires_grad(p, true));
    int64_t sht[2] = {3, 2};
    double gtv[6] = {4, 16, 8, 20, 12, 24};
    ts_tensor *gt = th_tensor(TS_F32, 2, sht, gtv), *g = NULL;
    TH_OK(ts_transpose(gt, 0, 1, &g));
    cr_assert(!ts_tensor_is_contiguous(g));
    TH_OK(ts_tensor_set_grad(p, g));
    ts_optim *opt = sgd(1, &p, 1.0);
    TH_OK(ts_grad_scaler_unscale(s, opt));
    double got[6];
    th_vals(ts_tensor_grad(p), got, 6);
    for (int i = 0; i < 6; i++) cr_assert_eq(got[i], gv[i] / 4.0, "g[%d] = %g", i, got[i]);
    ts_optim_free(opt);
    ts_tensor_free(g);
    ts_tensor_free(gt);
    ts_tensor_free(p);
    ts_grad_scaler_free(s);
}

/* enabled = false: scale gives the loss itself, step just steps, the rest
 * do nothing and get_scale is 1. */
Test(fully_shard_grad_scaler, disabled_is_a_pass_through)
{
    ts_grad_scaler_options o = ts_grad_scaler_options_default();
    o.enabled = false;
    ts_grad_scaler *s = NULL;
    TH_OK(ts_grad_scaler_new(&o, &s));
    cr_assert_eq(ts_grad_scaler_get_scale(s), 1.0);
    cr_assert(!ts_grad_scaler_is_enabled(s));
    double pv[2] = {1, 2}, gv[2] = {INFINITY, 1};
    ts_tensor *p = param_with_grad(TS_F32, 2, pv, gv), *out = NULL;
    TH_OK(ts_grad_scaler_scale(s, p, &out));
    cr_assert_eq(out, p);
    ts_tensor_free(out);
    ts_optim *opt = sgd(1, &p, 1.0);
    bool stepped = false;
    TH_OK(ts_grad_scaler_step(s, opt, &stepped));
    cr_assert(stepped);
    cr_assert_eq(ts_optim_step_count(opt), 1);
    TH_OK(ts_grad_scaler_update(s));
    TH_OK(ts_grad_scaler_unscale(s, opt));
    ts_optim_free(opt);
    ts_tensor_free(p);
    ts_grad_scaler_free(s);
}

Test(fully_shard_grad_scaler, update_to_sets_the_scale)
{
    ts_grad_scaler *s = NULL;
    TH_OK(ts_grad_scaler_new(NULL, &s));
    TH_OK(ts_grad_scaler_update_to(s, 0.1));
    cr_assert_eq(ts_grad_scaler_get_scale(s), (double)0.1f);
    cr_assert_eq(ts_grad_scaler_update_to(s, 0.0), TS_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(ts_last_error(), "new_scale 0"), "%s", ts_last_error());
    cr_assert_eq(ts_grad_scaler_update_to(s, NAN), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_grad_scaler_get_scale(s), (double)0.1f);
    ts_grad_scaler_free(s);
}

/* load_state restores what get_scale and growth_tracker returned: a
 * scaler saved one good step before a growth grows on the next good
 * step, as the uninterrupted one does; values no scaler can hold are
 * refused, naming them, and leave it unchanged. */
Test(fully_shard_grad_scaler, load_state_restores_scale_and_tracker)
{
    ts_grad_scaler_options o = ts_grad_scaler_options_default();
    o.init_scale = 8.0;
    o.growth_interval = 3;
    o.growth_factor = 4.0;
    ts_grad_scaler *s = NULL;
    TH_OK(ts_grad_scaler_new(&o, &s));
    TH_OK(ts_grad_scaler_load_state(s, 2.0, 2));
    cr_assert_eq(ts_grad_scaler_get_scale(s), 2.0);
    cr_assert_eq(ts_grad_scaler_growth_tracker(s), 2);
    double pv[2] = {1, 2}, gv[2] = {1, 2};
    ts_tensor *p = param_with_grad(TS_F32, 2, pv, gv);
    ts_optim *opt = sgd(1, &p, 0.1);
    TH_OK(ts_grad_scaler_step(s, opt, NULL));
    TH_OK(ts_grad_scaler_update(s));
    cr_assert_eq(ts_grad_scaler_get_scale(s), 8.0, "the third good step grows the scale: %g",
                 ts_grad_scaler_get_scale(s));
    cr_assert_eq(ts_grad_scaler_growth_tracker(s), 0);
    cr_assert_eq(ts_grad_scaler_load_state(s, 1.0, 3), TS_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(ts_last_error(), "growth_tracker 3 is not in [0, growth_interval 3)"), "%s", ts_last_error());
    cr_assert_eq(ts_grad_scaler_load_state(s, 1.0, -1), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_grad_scaler_load_state(s, INFINITY, 0), TS_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(ts_last_error(), "scale inf"), "%s", ts_last_error());
    cr_assert_eq(ts_grad_scaler_get_scale(s), 8.0);
    cr_assert_eq(ts_grad_scaler_growth_tracker(s), 0);
    ts_optim_free(opt);
    ts_tensor_free(p);
    ts_grad_scaler_free(s);
}

/* ------------------------------------------------------ two ranks */

/* ShardedGradScaler's all-reduce: only rank 1's shard holds an inf, and
 * both ranks skip the step and back off, with one all-reduce per step on
 * the scaler's group. */
static int rank_inf_on_one_rank(th_rank *rc)
{
    ts_grad_scaler_options o = ts_grad_scaler_options_default();
    o.group = rc->c;
    ts_grad_scaler *s = NULL;
    TH_RK_OK(rc, ts_grad_scaler_new(&o, &s));
    for (int it = 0; it < 2; it++) {
        double pv[2] = {1, 2}, gv[2] = {65536.0, rc->rank == 1 && it == 0 ? INFINITY : 65536.0};
        int64_t n = 2;
        ts_tensor *p = NULL, *g = NULL;
        TH_RK_OK(rc, ts_tensor_from_data(TS_F32, 1, &n, (float[]){(float)pv[0], (float)pv[1]}, &p));
        TH_RK_OK(rc, ts_tensor_from_data(TS_F32, 1, &n, (float[]){(float)gv[0], (float)gv[1]}, &g));
        TH_RK_OK(rc, ts_tensor_set_requires_grad(p, true));
        TH_RK_OK(rc, ts_tensor_set_grad(p, g));
        ts_sgd_options so = ts_sgd_options_default();
        so.lr = 1.0;
        ts_optim *opt = NULL;
        TH_RK_OK(rc, ts_sgd_new(1, &p, &so, &opt));
        ts_comm_counters c0, c1;
        ts_comm_stats(rc->c, &c0);
        bool stepped = true;
        TH_RK_OK(rc, ts_grad_scaler_step(s, opt, &stepped));
        ts_comm_stats(rc->c, &c1);
        TH_RK_EQ(rc, c1.calls[TS_COLL_ALL_REDUCE] - c0.calls[TS_COLL_ALL_REDUCE], 1);
        TH_RK_EQ(rc, stepped, it == 1);
        TH_RK_EQ(rc, ts_optim_step_count(opt), it == 1);
        TH_RK_OK(rc, ts_grad_scaler_update(s));
        ts_optim_free(opt);
        ts_tensor_free(p);
        ts_tensor_free(g);
    }
    TH_RK_EQ(rc, ts_grad_scaler_get_scale(s), 32768.0);
    TH_RK_EQ(rc, ts_grad_scaler_growth_tracker(s), 1);
    ts_grad_scaler_free(s);
    return 0;
}

Test(fully_shard_grad_scaler, one_ranks_inf_skips_every_rank, .timeout = 60)
{
    th_run_world(2, rank_inf_on_one_rank, NULL, 30.0);
}
