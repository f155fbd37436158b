/* optim: the learning-rate schedules of optim.h (ts_lr_at,
 * ts_lr_schedule_check) against torch 1.13's schedulers, WSD against its
 * formula, and the answers to bad schedules.
 *
 * Golden values: tests/fixtures/optim/lr_schedules.json, written by
 * tools/reference/make_lr_schedules.py (its docstring and each case's
 * "torch" field give the exact scheduler calls). */
#include <math.h>

#include <criterion/criterion.h>
#include <jansson.h>
#include <stdio.h>
#include <string.h>

#include "optim/optim.h"
#include "tests/helpers.h"

static ts_lr_kind kind_named(const char *name)
{
    static const struct {
        const char *name;
        ts_lr_kind kind;
    } kinds[] = {{"constant", TS_LR_CONSTANT},
                 {"warmup_constant", TS_LR_WARMUP_CONSTANT},
                 {"cosine", TS_LR_WARMUP_COSINE},
                 {"linear", TS_LR_WARMUP_LINEAR},
                 {"wsd", TS_LR_WARMUP_STABLE_DECAY}};
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++)
        if (!strcmp(kinds[i].name, name)) return kinds[i].kind;
    cr_assert_fail("unknown kind '%s' in the fixture", name);
    return TS_LR_KIND_COUNT;
}

/* Tolerance: torch's decays after their first step are chained
 * (LinearLR's and CosineAnnealingLR's get_lr multiply the previous lr by
 * a ratio each step), ours are closed forms, so the two round
 * differently: measured at most 6.1e-15 relative (the 50-step cosine
 * without warmup, near its end, where the lr is small), 2.1e-15 for the
 * linear decays, 0 for the warmups. 1e-13 leaves room for another libm's
 * cos and is far below any real difference: a schedule one step off moves
 * the lr by 1e-3 relative or more in every case here. Where torch's lr is
 * 0, the absolute error is what is left: 1e-18. */
#define LR_RTOL 1e-13
#define LR_ATOL 1e-18

Test(optim_lr_schedule, matches_torch_schedulers)
{
    char path[512];
    snprintf(path, sizeof path, "%s/optim/lr_schedules.json", TS_FIXTURES_DIR);
    json_error_t jerr;
    json_t *root = json_load_file(path, 0, &jerr);
    cr_assert_not_null(root, "%s: %s", path, jerr.text);
    json_t *cases = json_object_get(root, "cases");
    cr_assert(json_array_size(cases) >= 10, "%s holds %zu cases", path, json_array_size(cases));
    double worst = 0;
    int kinds_seen[TS_LR_KIND_COUNT] = {0};
    for (size_t c = 0; c < json_array_size(cases); c++) {
        json_t *o = json_array_get(cases, c), *lrs = json_object_get(o, "lr");
        ts_lr_schedule s = {.kind = kind_named(json_string_value(json_object_get(o, "kind"))),
                            .base_lr = json_real_value(json_object_get(o, "base_lr")),
                            .warmup_steps = json_integer_value(json_object_get(o, "warmup_steps")),
                            .total_steps = json_integer_value(json_object_get(o, "total_steps")),
                            .min_lr = json_number_value(json_object_get(o, "min_lr")),
                            .decay_fraction = json_number_value(json_object_get(o, "decay_fraction"))};
        const char *calls = json_string_value(json_object_get(o, "torch"));
        cr_assert(json_array_size(lrs) > 5 && calls, "case %zu", c);
        TH_OK(ts_lr_schedule_check(&s));
        kinds_seen[s.kind]++;
        for (size_t k = 0; k < json_array_size(lrs); k++) {
            double want = json_real_value(json_array_get(lrs, k)), got = ts_lr_at(&s, (int64_t)k);
            double err = fabs(got - want);
            cr_assert(err <= LR_RTOL * fabs(want) || err <= LR_ATOL,
                      "case %zu (%s), step %zu: lr %.17g, torch %.17g (relative %.3g)", c, calls, k, got, want,
                      want ? err / fabs(want) : err);
            if (want) worst = fmax(worst, err / fabs(want));
        }
    }
    for (int k = 0; k < TS_LR_KIND_COUNT; k++) cr_assert_gt(kinds_seen[k], 0, "no case of kind %d", k);
    cr_log_info("lr schedules: worst relative difference from torch %.3g", worst);
    json_decref(root);
}

/* WSD from optim.h's formula, values worked out by hand: base 1, min 0.2,
 * warmup 2, total 10, decay_fraction 0.3: D = 3, the decay starts at 7 and
 * falls by (1 - 0.2) / 3 a step. */
Test(optim_lr_schedule, wsd_formula)
{
    ts_lr_schedule s = {TS_LR_WARMUP_STABLE_DECAY, 1.0, 2, 10, 0.2, 0.3};
    const double want[13] = {0.5, 1, 1, 1, 1, 1, 1, 1.0, 0.2 + 0.8 * 2 / 3, 0.2 + 0.8 / 3, 0.2, 0.2, 0.2};
    for (int k = 0; k < 13; k++)
        cr_assert_float_eq(ts_lr_at(&s, k), want[k], 1e-15, "step %d: %.17g, want %.17g", k, ts_lr_at(&s, k), want[k]);
    /* round(f T) to nearest: 0.29 * 100 = 28.999999999999996 decays 29 steps, not 28 */
    ts_lr_schedule r = {TS_LR_WARMUP_STABLE_DECAY, 1.0, 0, 100, 0.0, 0.29};
    cr_assert_eq(ts_lr_at(&r, 71), 1.0, "the decay starts at 100 - 29 = 71, from base_lr");
    cr_assert_float_eq(ts_lr_at(&r, 72), 28.0 / 29.0, 1e-15, "(28 decayed steps would still be at 1.0)");
    /* fraction 1 is the linear decay; fraction 0 holds base_lr until the end */
    ts_lr_schedule lin = {TS_LR_WARMUP_LINEAR, 3e-3, 7, 50, 3e-4, 0};
    ts_lr_schedule all = {TS_LR_WARMUP_STABLE_DECAY, 3e-3, 7, 50, 3e-4, 1.0};
    ts_lr_schedule none = {TS_LR_WARMUP_STABLE_DECAY, 3e-3, 7, 50, 3e-4, 0.0};
    ts_lr_schedule wc = {TS_LR_WARMUP_CONSTANT, 3e-3, 7, 0, 0, 0};
    for (int k = 0; k < 60; k++) {
        cr_assert_eq(ts_lr_at(&all, k), ts_lr_at(&lin, k), "step %d", k);
        cr_assert_eq(ts_lr_at(&none, k), k < 50 ? ts_lr_at(&wc, k) : 3e-4, "step %d", k);
    }
}

/* An initializer written before decay_fraction existed (positional, five
 * fields) still compiles and means what it meant. (-Wextra warns about
 * the missing field in positional initializers, which is the point here;
 * designated ones, {.kind = ..., .base_lr = ...}, never warn.) */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
Test(optim_lr_schedule, old_initializers_keep_their_meaning)
{
    ts_lr_schedule s = {TS_LR_WARMUP_COSINE, 3e-3, 31, 300, 3e-4};
    cr_assert_eq(s.decay_fraction, 0.0);
    TH_OK(ts_lr_schedule_check(&s));
    cr_assert_eq(ts_lr_at(&s, 0), 3e-3 / 31);
    cr_assert_eq(ts_lr_at(&s, 31), 3e-3);
    cr_assert_eq(ts_lr_at(&s, 300), 3e-4);
    /* TS_LR_CONSTANT still ignores a warmup given to it; the warmup kind honours it */
    ts_lr_schedule c = {TS_LR_CONSTANT, 0.3, 10, 0, 0};
    ts_lr_schedule wc = {TS_LR_WARMUP_CONSTANT, 0.3, 10, 0, 0};
    cr_assert_eq(ts_lr_at(&c, 0), 0.3);
    cr_assert_float_eq(ts_lr_at(&wc, 0), 0.03, 1e-17);
    cr_assert_eq(ts_lr_at(&wc, 10), 0.3);
}
#pragma GCC diagnostic pop

static void expect_refused(ts_lr_schedule s, const char *what, const char *const *words)
{
    cr_assert_eq(ts_lr_schedule_check(&s), TS_ERR_INVALID_ARGUMENT, "%s: accepted", what);
    const char *msg = ts_last_error();
    for (int i = 0; words[i]; i++)
        cr_assert_not_null(strstr(msg, words[i]), "%s: the message lacks '%s': %s", what, words[i], msg);
}

/* Bad schedules: ts_lr_schedule_check names the field and its value;
 * ts_lr_at gives NaN for them (never a rate that looks fine), except the
 * two original kinds, whose documented results are unchanged. */
Test(optim_lr_schedule, bad_schedules)
{
    const ts_lr_kind newer[3] = {TS_LR_WARMUP_CONSTANT, TS_LR_WARMUP_LINEAR, TS_LR_WARMUP_STABLE_DECAY};
    for (int i = 0; i < 3; i++) {
        ts_lr_kind k = newer[i];
        ts_lr_schedule good = {k, 1e-3, 10, 100, 1e-4, 0.2};
        TH_OK(ts_lr_schedule_check(&good));
        cr_assert(isfinite(ts_lr_at(&good, 5)));
        cr_assert_eq(ts_lr_at(&good, -7), ts_lr_at(&good, 0), "a negative step counts as 0");
        ts_lr_schedule s = good;
        s.warmup_steps = -1;
        expect_refused(s, "negative warmup", (const char *[]){"warmup_steps -1", "negative", NULL});
        cr_assert(isnan(ts_lr_at(&s, 3)));
        s = good, s.base_lr = NAN;
        expect_refused(s, "NaN lr", (const char *[]){"base_lr nan", NULL});
        cr_assert(isnan(ts_lr_at(&s, 50)));
        s = good, s.base_lr = -1e-3;
        expect_refused(s, "negative lr", (const char *[]){"base_lr -0.001", NULL});
        cr_assert(isnan(ts_lr_at(&s, 50)));
        s = good, s.base_lr = INFINITY;
        expect_refused(s, "infinite lr", (const char *[]){"base_lr inf", NULL});
        if (k == TS_LR_WARMUP_CONSTANT) { /* reads neither total_steps, min_lr nor decay_fraction */
            s = good, s.total_steps = -5, s.min_lr = NAN, s.decay_fraction = 7;
            TH_OK(ts_lr_schedule_check(&s));
            cr_assert_eq(ts_lr_at(&s, 50), 1e-3);
            continue;
        }
        s = good, s.min_lr = NAN;
        expect_refused(s, "NaN min_lr", (const char *[]){"min_lr nan", NULL});
        cr_assert(isnan(ts_lr_at(&s, 99)));
        s = good, s.total_steps = -5, s.warmup_steps = 0;
        expect_refused(s, "negative total", (const char *[]){"total_steps -5", NULL});
        cr_assert(isnan(ts_lr_at(&s, 0)));
        s = good, s.warmup_steps = 101;
        expect_refused(s, "warmup > total", (const char *[]){"warmup_steps 101", "total_steps 100", NULL});
        cr_assert(isnan(ts_lr_at(&s, 0)));
        s = good, s.warmup_steps = 100; /* equal: the warmup, then min_lr */
        TH_OK(ts_lr_schedule_check(&s));
        cr_assert_eq(ts_lr_at(&s, 99), 1e-3);
        cr_assert_eq(ts_lr_at(&s, 100), 1e-4);
    }
    ts_lr_schedule w = {TS_LR_WARMUP_STABLE_DECAY, 1e-3, 10, 100, 1e-4, 1.5};
    expect_refused(w, "fraction 1.5", (const char *[]){"decay_fraction 1.5", "[0, 1]", NULL});
    cr_assert(isnan(ts_lr_at(&w, 95)));
    w.decay_fraction = -0.1;
    expect_refused(w, "fraction -0.1", (const char *[]){"decay_fraction -0.1", NULL});
    w.decay_fraction = NAN;
    expect_refused(w, "fraction NaN", (const char *[]){"decay_fraction nan", NULL});
    cr_assert(isnan(ts_lr_at(&w, 0)));

    /* the original kinds: refused by the check, their results as before */
    ts_lr_schedule cos_bad = {TS_LR_WARMUP_COSINE, 1.0, -3, 4, 0.0, 0};
    expect_refused(cos_bad, "cosine, negative warmup",
                   (const char *[]){"TS_LR_WARMUP_COSINE", "warmup_steps -3", NULL});
    cr_assert_eq(ts_lr_at(&cos_bad, 0), 1.0, "warmup_steps <= 0: no warmup, as before");
    ts_lr_schedule cos_long = {TS_LR_WARMUP_COSINE, 1.0, 8, 4, 0.5, 0};
    expect_refused(cos_long, "cosine, warmup > total", (const char *[]){"warmup_steps 8", "total_steps 4", NULL});
    cr_assert_eq(ts_lr_at(&cos_long, 3), 0.5, "the warmup as before");
    cr_assert_eq(ts_lr_at(&cos_long, 8), 0.5, "then min_lr, as before");
    ts_lr_schedule c = {TS_LR_CONSTANT, NAN, 0, 0, 0, 0};
    expect_refused(c, "constant NaN", (const char *[]){"TS_LR_CONSTANT", "base_lr nan", NULL});
    cr_assert(isnan(ts_lr_at(&c, 0)));
    ts_lr_schedule unknown = {(ts_lr_kind)77, 1.0, 0, 0, 0, 0};
    expect_refused(unknown, "unknown kind", (const char *[]){"unknown kind 77", NULL});
    cr_assert(isnan(ts_lr_at(&unknown, 0)));
    cr_assert_eq(ts_lr_schedule_check(NULL), TS_ERR_INVALID_ARGUMENT);
    cr_assert(isnan(ts_lr_at(NULL, 0)));
}
