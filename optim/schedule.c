/*
 * Learning-rate schedules (optim.h: ts_lr_schedule_check, ts_lr_at):
 * constant, and warmup followed by cosine, constant or linear decay.
 */
#include "optim/optim.h"

#include <math.h>
#include <stdio.h>

static const char *const lr_kind_names[] = {"TS_LR_CONSTANT", "TS_LR_WARMUP_COSINE", "TS_LR_WARMUP_CONSTANT",
                                            "TS_LR_WARMUP_LINEAR", "TS_LR_WARMUP_STABLE_DECAY"};
_Static_assert(sizeof lr_kind_names / sizeof lr_kind_names[0] == TS_LR_KIND_COUNT, "a name per schedule kind");

/* What a kind reads besides base_lr: the warmup; total_steps and min_lr
 * (a decay to min_lr at total_steps); decay_fraction. */
static bool lr_has_warmup(ts_lr_kind k) { return k != TS_LR_CONSTANT; }
static bool lr_has_decay(ts_lr_kind k)
{
    return k == TS_LR_WARMUP_COSINE || k == TS_LR_WARMUP_LINEAR || k == TS_LR_WARMUP_STABLE_DECAY;
}

/* Whether schedule s (not NULL) is one ts_lr_schedule_check accepts;
 * when not, and `why` is given, the reason (naming the field and value)
 * goes there. Sets no error: ts_lr_at calls it on every step. */
static bool lr_valid(const ts_lr_schedule *s, char *why, size_t cap)
{
#define LR_BAD(...) (why ? (void)snprintf(why, cap, __VA_ARGS__) : (void)0, false)
    if ((unsigned)s->kind >= TS_LR_KIND_COUNT)
        return LR_BAD("unknown kind %d (TS_LR_CONSTANT .. TS_LR_WARMUP_STABLE_DECAY)", (int)s->kind);
    const char *k = lr_kind_names[s->kind];
    if (!isfinite(s->base_lr) || s->base_lr < 0)
        return LR_BAD("%s: base_lr %g is not a finite value >= 0", k, s->base_lr);
    if (lr_has_warmup(s->kind) && s->warmup_steps < 0)
        return LR_BAD("%s: warmup_steps %lld is negative (0: no warmup)", k, (long long)s->warmup_steps);
    if (lr_has_decay(s->kind)) {
        if (!isfinite(s->min_lr) || s->min_lr < 0)
            return LR_BAD("%s: min_lr %g is not a finite value >= 0", k, s->min_lr);
        if (s->total_steps < 0) return LR_BAD("%s: total_steps %lld is negative", k, (long long)s->total_steps);
        if (s->warmup_steps > s->total_steps)
            return LR_BAD("%s: warmup_steps %lld is more than total_steps %lld (the decay would end before the "
                          "warmup does)",
                          k, (long long)s->warmup_steps, (long long)s->total_steps);
    }
    if (s->kind == TS_LR_WARMUP_STABLE_DECAY && !(s->decay_fraction >= 0 && s->decay_fraction <= 1))
        return LR_BAD("%s: decay_fraction %g is not in [0, 1]", k, s->decay_fraction);
    return true;
#undef LR_BAD
}

ts_status ts_lr_schedule_check(const ts_lr_schedule *s)
{
    if (!s) return ts_error(TS_ERR_INVALID_ARGUMENT, "lr schedule: NULL schedule");
    char why[256];
    if (!lr_valid(s, why, sizeof why)) return ts_error(TS_ERR_INVALID_ARGUMENT, "lr schedule %s", why);
    return TS_OK;
}

/* base_lr at `from`, a straight line to min_lr at `to` (from < to), min_lr
 * from `to` on. */
static double lr_line(const ts_lr_schedule *s, int64_t step, int64_t from, int64_t to)
{
    if (step >= to) return s->min_lr;
    return s->min_lr + (s->base_lr - s->min_lr) * (double)(to - step) / (double)(to - from);
}

double ts_lr_at(const ts_lr_schedule *s, int64_t step)
{
    if (!s) return NAN;
    if (step < 0) step = 0;
    switch (s->kind) {
    case TS_LR_CONSTANT: return s->base_lr;
    case TS_LR_WARMUP_COSINE: {
        if (step < s->warmup_steps) return s->base_lr * ((double)step + 1.0) / (double)s->warmup_steps;
        if (step >= s->total_steps) return s->min_lr;
        int64_t w = s->warmup_steps > 0 ? s->warmup_steps : 0;
        double progress = (double)(step - w) / (double)(s->total_steps - w);
        const double pi = 3.14159265358979323846;
        return s->min_lr + 0.5 * (s->base_lr - s->min_lr) * (1.0 + cos(pi * progress));
    }
    case TS_LR_WARMUP_CONSTANT:
    case TS_LR_WARMUP_LINEAR:
    case TS_LR_WARMUP_STABLE_DECAY: break;
    case TS_LR_KIND_COUNT: return NAN;
    }
    if (!lr_valid(s, NULL, 0)) return NAN;
    if (step < s->warmup_steps) return s->base_lr * ((double)step + 1.0) / (double)s->warmup_steps;
    if (s->kind == TS_LR_WARMUP_CONSTANT) return s->base_lr;
    if (s->kind == TS_LR_WARMUP_LINEAR) return lr_line(s, step, s->warmup_steps, s->total_steps);
    /* WSD: the decay over the last D steps, never into the warmup */
    int64_t d = llround(s->decay_fraction * (double)s->total_steps);
    int64_t start = s->total_steps - d > s->warmup_steps ? s->total_steps - d : s->warmup_steps;
    if (step < start) return s->base_lr;
    return lr_line(s, step, start, s->total_steps);
}
