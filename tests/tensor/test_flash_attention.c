/* The fused float32 attention (tensor/flash_attention.h) against
 * ts_attention's unfused reference path, forward and gradients, on every
 * kernel path the CPU runs (the others say 'skipped'); finite-difference
 * gradients; the cases that fall back to the reference path. */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "tensor/flash_attention.h"
#include "tensor/internal.h"
#include "tensor/kernels.h"
#include "tests/helpers.h"

/* mask kinds */
enum { M_NONE, M_CAUSAL, M_RANDOM };

typedef struct acase {
    int64_t B, T, S, E, H;
    int mask;
    double amp;  /* inputs uniform in [-amp, amp) */
    bool packed; /* q, k, v strided views of one (B, T, 3E) projection (needs T == S) */
} acase;

/* Shapes: the benchmark's head (128 x 128 x 64), T not a multiple of the
 * 32-row block, T != S, head dims 8 to 128 (not multiples of the vector
 * widths too), 1 head and several, peaked softmaxes (amp 3: scores up to
 * ~25, so the running maximum moves and rescales the accumulator). */
static const acase cases[] = {
    {2, 128, 128, 256, 4, M_CAUSAL, 1.0, true}, {1, 37, 37, 24, 1, M_CAUSAL, 1.0, true},
    {2, 45, 70, 40, 5, M_NONE, 1.0, false},     {1, 33, 33, 256, 2, M_CAUSAL, 1.0, true},
    {2, 50, 50, 200, 2, M_RANDOM, 3.0, true},   {1, 7, 3, 12, 3, M_NONE, 3.0, false},
    {1, 65, 65, 36, 3, M_NONE, 3.0, true},
};

static ts_tensor *uniform(int ndim, const int64_t *shape, double amp, uint32_t seed)
{
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= shape[i];
    float *d = malloc((size_t)n * sizeof *d);
    uint32_t st = seed;
    for (int64_t i = 0; i < n; i++) d[i] = (float)(amp * (2.0 * th_lcg(&st) / 16777216.0 - 1.0));
    ts_tensor *t;
    TH_OK(ts_tensor_from_data(TS_F32, ndim, shape, d, &t));
    free(d);
    return t;
}

/* (T, S) bool mask; M_RANDOM masks about a third, never a whole row. */
static ts_tensor *make_mask(int kind, int64_t T, int64_t S)
{
    if (kind == M_NONE) return NULL;
    uint8_t *m = malloc((size_t)(T * S));
    uint32_t st = 99;
    for (int64_t t = 0; t < T; t++)
        for (int64_t s = 0; s < S; s++) m[t * S + s] = kind == M_CAUSAL ? s > t : (s != t % S && th_lcg(&st) % 3 == 0);
    int64_t ms[2] = {T, S};
    ts_tensor *mask;
    TH_OK(ts_tensor_from_data(TS_BOOL, 2, ms, m, &mask));
    free(m);
    return mask;
}

typedef struct result {
    ts_tensor *out, *g[3];                       /* output; gradients of q, k, v (or of the packed input in g[0]) */
    uint8_t gen_state[TS_GENERATOR_STATE_BYTES]; /* the generator's state after the forward (dropout runs) */
} result;

static void result_free(result *r)
{
    ts_tensor_free(r->out);
    for (int i = 0; i < 3; i++) ts_tensor_free(r->g[i]);
}

/* Forward and backward of ts_attention with the fused kernel on (fused)
 * or off, with cotangent cot; attention dropout p in training, drawn from
 * a generator seeded with drop_seed. */
static result run_case_p(const acase *c, bool fused, ts_tensor *mask, ts_tensor *cot, double p, uint64_t drop_seed)
{
    result r = {0};
    ts__flash_force(fused);
    ts_tensor *in[3] = {0}, *leaf[3] = {0}, *qkv = NULL;
    int nl = 0;
    if (c->packed) {
        int64_t ps[3] = {c->B, c->T, 3 * c->E};
        qkv = uniform(3, ps, c->amp, 7);
        TH_OK(ts_tensor_set_requires_grad(qkv, true));
        int np;
        TH_OK(ts_chunk(qkv, 3, 2, 3, in, &np));
        leaf[nl++] = qkv;
    } else {
        int64_t qs[3] = {c->B, c->T, c->E}, ks[3] = {c->B, c->S, c->E};
        in[0] = uniform(3, qs, c->amp, 1);
        in[1] = uniform(3, ks, c->amp, 2);
        in[2] = uniform(3, ks, 1.0, 3);
        for (int i = 0; i < 3; i++) {
            TH_OK(ts_tensor_set_requires_grad(in[i], true));
            leaf[nl++] = ts_tensor_retain(in[i]);
        }
    }
    ts_generator *gen;
    TH_OK(ts_generator_new(drop_seed, &gen));
    TH_OK(ts_attention(in[0], in[1], in[2], c->H, mask, p, true, gen, &r.out));
    ts_generator_get_state(gen, r.gen_state);
    ts_generator_free(gen);
    TH_OK(ts_backward(r.out, cot, false));
    for (int i = 0; i < nl; i++) r.g[i] = ts_tensor_retain(ts_tensor_grad(leaf[i]));
    for (int i = 0; i < 3; i++) {
        ts_tensor_free(in[i]);
        ts_tensor_free(leaf[i]);
    }
    ts__flash_force(-1);
    return r;
}

static result run_case(const acase *c, bool fused, ts_tensor *mask, ts_tensor *cot)
{
    return run_case_p(c, fused, mask, cot, 0.0, 0);
}

static double max_abs(const ts_tensor *t)
{
    double *v = th_vals_new(t), m = 0;
    for (int64_t i = 0; i < ts_tensor_numel(t); i++) m = fabs(v[i]) > m ? fabs(v[i]) : m;
    free(v);
    return m;
}

/* Tolerance. Each output element is a sum of rounded float32 products:
 * scores over hd terms, then (forward) the probability-weighted sum over
 * S keys, or (backward) dP over hd, D over hd and sums over T or S. The
 * fused kernel and the reference sum in different orders, the fused one
 * adds the online rescalings (one multiply per key block) and its exp is
 * ts__exp_f32 (0.93 ulp) where the reference's softmax row kernel has its
 * own; each path is within gamma_n = n u (u = 2^-24, n = S + T + hd + 8
 * rounding steps in a chain) of the exact value times the sum of the
 * terms' magnitudes, and those sums are bounded by a few times the largest
 * result (softmax weights are in [0, 1] and sum to 1; inputs are O(1)).
 * So |fused - reference| <= 2 gamma_n * 8 * max|reference|; a wrong
 * kernel is off by O(max|reference|). Measured errors are 10x to 100x
 * below this bound. */
/* With attention dropout p > 0 the weights are P o Z / (1 - p): each in
 * [0, 1/(1-p)], their row sums at most 1/(1-p), so the terms' magnitude
 * sums grow by at most ds = 1/(1-p); both paths add one rounded multiply
 * per weight (the reference P * D, the fused P * ds in the backward) and
 * the fused one a rounded ds / l per row: n + 2 steps, times ds. */
static void assert_close_tol(const ts_tensor *a, const ts_tensor *b, const acase *c, const char *what, double p)
{
    double ds = 1.0 / (1.0 - p);
    double n = (double)(c->S + c->T + c->E / c->H + 8 + (p > 0 ? 2 : 0)), u = 0x1p-24;
    double tol = 2.0 * n * u * 8.0 * ds * max_abs(b);
    double *x = th_vals_new(a), *y = th_vals_new(b), worst = 0;
    int64_t at = -1;
    for (int64_t i = 0; i < ts_tensor_numel(b); i++) {
        double e = fabs(x[i] - y[i]);
        if (!(e <= worst)) {
            worst = e;
            at = i;
        }
    }
    cr_assert(worst <= tol,
              "%s (B %lld T %lld S %lld E %lld H %lld mask %d dropout %g): |fused - reference| %g at "
              "%lld (%g vs %g) > tolerance %g",
              what, (long long)c->B, (long long)c->T, (long long)c->S, (long long)c->E, (long long)c->H, c->mask, p,
              worst, (long long)at, at >= 0 ? x[at] : 0.0, at >= 0 ? y[at] : 0.0, tol);
    if (getenv("TS_TEST_VERBOSE"))
        cr_log_info("%s B %lld T %lld S %lld E %lld dropout %g: worst %g, tolerance %g (%.3f)", what, (long long)c->B,
                    (long long)c->T, (long long)c->S, (long long)c->E, p, worst, tol, worst / tol);
    free(x);
    free(y);
}

/* Runs the test on kernel path p (ts__kpath_force), or skips it where the
 * CPU or TS_KERNELS does not allow that path. */
static void force_path_or_skip(ts__kpath p)
{
    if (!ts__kpath_supported(p)) cr_skip_test("skipped: this CPU does not run the %s path", ts__kpath_name(p));
    ts__kpath_force(p);
    if (ts__kpath_active() != p)
        cr_skip_test("skipped: TS_KERNELS caps the kernels below the %s path", ts__kpath_name(p));
}

/* The fused result f against the reference r: the output and each input's
 * gradient within assert_close_tol's bound for dropout p. */
static void assert_results_close(const result *f, const result *r, const acase *c, double p)
{
    static const char *const gn[3] = {"grad q", "grad k", "grad v"};
    const char *packed = p > 0 ? "grad of the packed qkv with dropout" : "grad of the packed qkv";
    assert_close_tol(f->out, r->out, c, p > 0 ? "output with dropout" : "output", p);
    for (int i = 0; i < 3 && r->g[i]; i++) assert_close_tol(f->g[i], r->g[i], c, c->packed ? packed : gn[i], p);
}

static void check_path(ts__kpath p)
{
    force_path_or_skip(p);
    for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++) {
        const acase *c = &cases[ci];
        ts_tensor *mask = make_mask(c->mask, c->T, c->S);
        int64_t os[3] = {c->B, c->T, c->E};
        ts_tensor *cot = uniform(3, os, 1.0, 5);
        result f = run_case(c, true, mask, cot), r = run_case(c, false, mask, cot);
        assert_results_close(&f, &r, c, 0.0);
        result_free(&f);
        result_free(&r);
        ts_tensor_free(mask);
        ts_tensor_free(cot);
    }
    ts__kpath_force(-1);
}

Test(tensor_flash_attention, scalar_path_matches_the_reference) { check_path(TS__KPATH_SCALAR); }
Test(tensor_flash_attention, avx2_path_matches_the_reference) { check_path(TS__KPATH_AVX2); }
Test(tensor_flash_attention, avx512_path_matches_the_reference) { check_path(TS__KPATH_AVX512); }

/* Attention dropout in training: every case above (causal and not, T not
 * a multiple of 32, T != S, 1 to 5 heads, packed views), p 0.1 or 0.5,
 * the fused kernel against the reference path from generators seeded
 * alike: the reference draws the (B, H, T, S) noise tensor with
 * ts_bernoulli_, the fused kernel its bits; the same draws select the
 * same weights, so the outputs and gradients agree within the rounding
 * tolerance (a mask off by one element moves the output by O(1/S) of its
 * size, far above it), and both leave the generator in the same state. */
static void check_path_dropout(ts__kpath p)
{
    force_path_or_skip(p);
    for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++) {
        const acase *c = &cases[ci];
        double dp = ci % 2 ? 0.5 : 0.1;
        uint64_t seed = 1000 + ci;
        ts_tensor *mask = make_mask(c->mask, c->T, c->S);
        int64_t os[3] = {c->B, c->T, c->E};
        ts_tensor *cot = uniform(3, os, 1.0, 5);
        result f = run_case_p(c, true, mask, cot, dp, seed), r = run_case_p(c, false, mask, cot, dp, seed);
        result nd = run_case(c, true, mask, cot);
        assert_results_close(&f, &r, c, dp);
        cr_assert(memcmp(f.gen_state, r.gen_state, sizeof f.gen_state) == 0,
                  "case %zu: the generator's state after the fused forward differs from the reference path's", ci);
        /* the dropout did something: without it the output is elsewhere */
        double *x = th_vals_new(f.out), *y = th_vals_new(nd.out), diff = 0;
        for (int64_t i = 0; i < ts_tensor_numel(f.out); i++) diff = fmax(diff, fabs(x[i] - y[i]));
        cr_assert(diff > 1e-3 * max_abs(nd.out), "case %zu: dropout %g changed the output by only %g", ci, dp, diff);
        free(x);
        free(y);
        result_free(&f);
        result_free(&r);
        result_free(&nd);
        ts_tensor_free(mask);
        ts_tensor_free(cot);
    }
    ts__kpath_force(-1);
}

Test(tensor_flash_attention, scalar_path_with_dropout_matches_the_reference) { check_path_dropout(TS__KPATH_SCALAR); }
Test(tensor_flash_attention, avx2_path_with_dropout_matches_the_reference) { check_path_dropout(TS__KPATH_AVX2); }
Test(tensor_flash_attention, avx512_path_with_dropout_matches_the_reference) { check_path_dropout(TS__KPATH_AVX512); }

/* sum(out * cot) in double; with dropout p > 0 the generator is seeded
 * with seed first, so that every call draws the same keep mask. */
static double loss_of(ts_tensor *const *in, int64_t H, ts_tensor *mask, const double *cot, double p, ts_generator *gen,
                      uint64_t seed)
{
    ts_tensor *o;
    bool prev = ts_grad_mode_set(false);
    ts_generator_manual_seed(gen, seed);
    TH_OK(ts_attention(in[0], in[1], in[2], H, mask, p, true, gen, &o));
    ts_grad_mode_set(prev);
    double *v = th_vals_new(o), s = 0;
    for (int64_t i = 0; i < ts_tensor_numel(o); i++) s += v[i] * cot[i];
    free(v);
    ts_tensor_free(o);
    return s;
}

/* Central differences in float32: step 1e-2 on inputs of size ~1 has a
 * truncation error ~ h^2 |f'''| / 6 ~ 1e-5 and a rounding error ~
 * u |L| / h ~ 6e-8 * 10 / 1e-2 ~ 6e-5 per derivative, so 1e-3 absolute
 * plus 1e-2 relative is loose for float32 and still far below the O(1)
 * error of a wrong gradient. */
static void finite_differences(ts__kpath p, double dp)
{
    force_path_or_skip(p);
    ts__flash_force(1);
    int64_t B = 1, T = 37, E = 8, H = 2, s3[3] = {B, T, E};
    ts_generator *gen;
    TH_OK(ts_generator_new(0, &gen));
    for (int causal = 0; causal < 2; causal++) {
        uint64_t seed = 77 + (uint64_t)causal;
        ts_tensor *mask = causal ? make_mask(M_CAUSAL, T, T) : NULL, *in[3], *cot = uniform(3, s3, 1.0, 9), *o;
        for (int i = 0; i < 3; i++) {
            in[i] = uniform(3, s3, 1.0, 11 + (uint32_t)i);
            TH_OK(ts_tensor_set_requires_grad(in[i], true));
        }
        ts_generator_manual_seed(gen, seed);
        TH_OK(ts_attention(in[0], in[1], in[2], H, mask, dp, true, gen, &o));
        TH_OK(ts_backward(o, cot, false));
        double *cv = th_vals_new(cot);
        for (int i = 0; i < 3; i++) {
            double *g = th_vals_new(ts_tensor_grad(in[i]));
            float *x = ts_tensor_data(in[i]);
            for (int64_t e = 0; e < B * T * E; e++) {
                float x0 = x[e], h = 1e-2f;
                x[e] = x0 + h;
                double lp = loss_of(in, H, mask, cv, dp, gen, seed);
                x[e] = x0 - h;
                double lm = loss_of(in, H, mask, cv, dp, gen, seed);
                x[e] = x0;
                double fd = (lp - lm) / (2.0 * (double)h);
                cr_assert(fabs(fd - g[e]) <= 1e-3 + 1e-2 * fabs(fd),
                          "%s path, dropout %g, causal %d, input %d element %lld: finite difference %g, gradient %g",
                          ts__kpath_name(p), dp, causal, i, (long long)e, fd, g[e]);
            }
            free(g);
        }
        free(cv);
        for (int i = 0; i < 3; i++) ts_tensor_free(in[i]);
        ts_tensor_free(o);
        ts_tensor_free(cot);
        ts_tensor_free(mask);
    }
    ts_generator_free(gen);
    ts__flash_force(-1);
    ts__kpath_force(-1);
}

Test(tensor_flash_attention, scalar_gradients_match_finite_differences) { finite_differences(TS__KPATH_SCALAR, 0.0); }
Test(tensor_flash_attention, avx2_gradients_match_finite_differences) { finite_differences(TS__KPATH_AVX2, 0.0); }
Test(tensor_flash_attention, avx512_gradients_match_finite_differences) { finite_differences(TS__KPATH_AVX512, 0.0); }

/* With dropout 0.3 and the keep mask fixed (the generator reseeded before
 * every forward): the gradient of a fixed mask's function. */
Test(tensor_flash_attention, scalar_dropout_gradients_match_finite_differences)
{
    finite_differences(TS__KPATH_SCALAR, 0.3);
}
Test(tensor_flash_attention, avx2_dropout_gradients_match_finite_differences)
{
    finite_differences(TS__KPATH_AVX2, 0.3);
}
Test(tensor_flash_attention, avx512_dropout_gradients_match_finite_differences)
{
    finite_differences(TS__KPATH_AVX512, 0.3);
}

/* A wholly masked row is NaN (PyTorch's softmax of all -inf), which the
 * fused kernel leaves to the reference path: the same bits either way,
 * NaN in that row only, with dropout in training too (the reference path
 * then draws the noise, the same draws). float64 takes the reference path
 * too (the same bits with the fused kernel on or off). */
Test(tensor_flash_attention, unsupported_cases_fall_back_to_the_reference)
{
    th_mem_mark();
    int64_t s[3] = {2, 6, 8}, ms[2] = {6, 6};
    uint8_t m[36] = {0};
    for (int j = 0; j < 6; j++) m[2 * 6 + j] = 1; /* row 2 sees nothing */
    cr_assert(!ts__flash_mask_ok(m, 6, 6));
    cr_assert(ts__flash_mask_ok(NULL, 6, 6));
    ts_tensor *mask, *q = uniform(3, s, 1.0, 1), *k = uniform(3, s, 1.0, 2), *v = uniform(3, s, 1.0, 3);
    TH_OK(ts_tensor_from_data(TS_BOOL, 2, ms, m, &mask));
    ts_tensor *a[2], *d[2], *e[2];
    for (int fused = 0; fused < 2; fused++) {
        ts__flash_force(fused);
        TH_OK(ts_attention(q, k, v, 2, mask, 0.0, true, NULL, &a[fused]));
        ts_manual_seed(5);
        TH_OK(ts_attention(q, k, v, 2, mask, 0.3, true, NULL, &d[fused]));
        ts_tensor *q64, *k64, *v64;
        TH_OK(ts_to_dtype(q, TS_F64, &q64));
        TH_OK(ts_to_dtype(k, TS_F64, &k64));
        TH_OK(ts_to_dtype(v, TS_F64, &v64));
        TH_OK(ts_attention(q64, k64, v64, 2, NULL, 0.0, true, NULL, &e[fused]));
        ts_tensor_free(q64);
        ts_tensor_free(k64);
        ts_tensor_free(v64);
    }
    ts__flash_force(-1);
    double *x = th_vals_new(a[0]), *y = th_vals_new(a[1]);
    for (int64_t i = 0; i < 2 * 6 * 8; i++) {
        bool row2 = (i / 8) % 6 == 2;
        cr_assert(row2 ? isnan(x[i]) : isfinite(x[i]), "element %lld: %g", (long long)i, x[i]);
        cr_assert(memcmp(&x[i], &y[i], sizeof x[i]) == 0, "element %lld: %g vs %g", (long long)i, x[i], y[i]);
    }
    free(x);
    free(y);
    x = th_vals_new(d[0]);
    y = th_vals_new(d[1]);
    for (int64_t i = 0; i < 2 * 6 * 8; i++)
        cr_assert(memcmp(&x[i], &y[i], sizeof x[i]) == 0, "dropout, element %lld: %g vs %g", (long long)i, x[i], y[i]);
    free(x);
    free(y);
    th_assert_close(e[1], e[0], 0, 0);
    ts_tensor *all[] = {mask, q, k, v, a[0], a[1], d[0], d[1], e[0], e[1]};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) ts_tensor_free(all[i]);
    th_mem_assert_back();
}

/* The fused path saves O and the log-sum-exp, not the (B, H, T, S)
 * probabilities: after the forward, the graph holds less memory. */
Test(tensor_flash_attention, saves_no_score_matrix)
{
    int64_t ps[3] = {2, 128, 3 * 64};
    ts_tensor *mask = make_mask(M_CAUSAL, 128, 128);
    size_t held[2], held_drop[2];
    for (int fused = 0; fused < 2; fused++) {
        ts__flash_force(fused);
        ts_tensor *qkv = uniform(3, ps, 1.0, 4), *in[3], *o, *od;
        TH_OK(ts_tensor_set_requires_grad(qkv, true));
        int np;
        TH_OK(ts_chunk(qkv, 3, 2, 3, in, &np));
        size_t before = ts_mem_live_bytes(TS_MEM_STORAGE);
        TH_OK(ts_attention(in[0], in[1], in[2], 2, mask, 0.1, true, NULL, &od));
        held_drop[fused] = ts_mem_live_bytes(TS_MEM_STORAGE) - before;
        ts_tensor_free(od);
        before = ts_mem_live_bytes(TS_MEM_STORAGE);
        TH_OK(ts_attention(in[0], in[1], in[2], 2, mask, 0.0, true, NULL, &o));
        held[fused] = ts_mem_live_bytes(TS_MEM_STORAGE) - before;
        ts_tensor_free(o);
        for (int i = 0; i < 3; i++) ts_tensor_free(in[i]);
        ts_tensor_free(qkv);
    }
    ts__flash_force(-1);
    /* reference: O (2*128*64 floats) + P (2*2*128*128 floats) = 320 KiB;
     * fused: O + lse (2*2*128 floats) = 66 KiB */
    size_t o_bytes = 2 * 128 * 64 * 4, p_bytes = 2 * 2 * 128 * 128 * 4, lse_bytes = 2 * 2 * 128 * 4;
    cr_assert_geq(held[0], o_bytes + p_bytes, "reference held %zu bytes", held[0]);
    cr_assert_leq(held[1], o_bytes + lse_bytes + 16384, "fused held %zu bytes", held[1]);
    /* with dropout the reference path also keeps the noise D (as many
     * floats as P); the fused one the keep bits, 2*2*128 rows of 4 words
     * = 8 KiB */
    size_t keep_bytes = 2 * 2 * 128 * 4 * 4;
    cr_assert_geq(held_drop[0], o_bytes + 2 * p_bytes, "reference with dropout held %zu bytes", held_drop[0]);
    cr_assert_leq(held_drop[1], o_bytes + lse_bytes + keep_bytes + 16384, "fused with dropout held %zu bytes",
                  held_drop[1]);
    ts_tensor_free(mask);
}

/* bernoulli(p) by docs/rng.md §7, written out:
 * per element two words of the generator, the first the high half,
 * U53 = (x & (2^53 - 1)) * 2^-53, 1 when U53 < p. */
static int spec_bernoulli(ts_generator *g, double p)
{
    uint64_t hi = ts_generator_random(g), lo = ts_generator_random(g);
    uint64_t x = ((hi << 32) | lo) & ((UINT64_C(1) << 53) - 1);
    return (double)x * 0x1p-53 < p;
}

/* The keep bits, and ts_bernoulli_ over a contiguous tensor (both
 * batched, in 8 or 16 lanes on the vector paths), are docs/rng.md §7's draws on
 * each kernel path: bit (r, c) and element (r, c) are the draw of element
 * r * cols + c, and all three generators end in the same state. Columns
 * below, at and across the 32-bit words and the 1024-element batches,
 * more words than one mt19937 block (624) so that twists fall inside
 * batches, generators part-way through a block, and p at both ends and in
 * between (p * 2^53 an integer or not). (tests/tensor/test_rng.c checks
 * ts_bernoulli_ against torch's own draws on the active path.) */
static void keep_bits_check(ts__kpath path)
{
    if (!ts__kpath_supported(path)) cr_skip_test("skipped: this CPU does not run the %s path", ts__kpath_name(path));
    ts__kpath_force(path);
    static const int64_t shapes[][2] = {{1, 1}, {3, 5}, {7, 32}, {5, 33}, {9, 70}, {4, 700}, {40, 37}, {3, 2100}};
    static const double ps[] = {0.0, 1.0, 0.5, 0.9, 0.1, 0.75, 1.0 - 0x1p-40, 0x1p-50, 0.3};
    uint8_t s1[TS_GENERATOR_STATE_BYTES], s2[TS_GENERATOR_STATE_BYTES], s3[TS_GENERATOR_STATE_BYTES];
    ts_generator *ga, *gb, *gc;
    TH_OK(ts_generator_new(0, &ga));
    TH_OK(ts_generator_new(0, &gb));
    TH_OK(ts_generator_new(0, &gc));
    for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++)
        for (size_t pi = 0; pi < sizeof ps / sizeof *ps; pi++) {
            int64_t R = shapes[si][0], C = shapes[si][1], W = (C + 31) / 32 + (int64_t)(pi % 2);
            uint64_t seed = 31 * si + pi;
            ts_generator *gs[3] = {ga, gb, gc};
            for (int i = 0; i < 3; i++) {
                ts_generator_manual_seed(gs[i], seed);
                for (size_t w = 0; w < 3 * si + pi; w++) /* part-way through a block */
                    (void)ts_generator_random(gs[i]);
            }
            uint32_t *bits = malloc((size_t)(R * W) * sizeof *bits);
            memset(bits, 0xA5, (size_t)(R * W) * sizeof *bits);
            ts__rng_bernoulli_bits_on((int)path, gb, ps[pi], R, C, W, bits);
            ts_tensor *t;
            int64_t sh[2] = {R, C};
            TH_OK(ts_tensor_empty(pi % 3 == 2 ? TS_F64 : TS_F32, 2, sh, &t));
            TH_OK(ts_bernoulli_(t, ps[pi], gc));
            double *v = th_vals_new(t);
            int64_t ones = 0;
            for (int64_t r = 0; r < R; r++) {
                for (int64_t c = 0; c < C; c++) {
                    int want = spec_bernoulli(ga, ps[pi]), bit = (bits[r * W + c / 32] >> (c % 32)) & 1;
                    ones += want;
                    cr_assert_eq(bit, want, "%s path, shape (%lld, %lld) p %g: bit (%lld, %lld) is %d, the draw %d",
                                 ts__kpath_name(path), (long long)R, (long long)C, ps[pi], (long long)r, (long long)c,
                                 bit, want);
                    cr_assert_eq(v[r * C + c], (double)want,
                                 "%s path, shape (%lld, %lld) p %g: bernoulli_ element "
                                 "(%lld, %lld) is %g, the draw %d",
                                 ts__kpath_name(path), (long long)R, (long long)C, ps[pi], (long long)r, (long long)c,
                                 v[r * C + c], want);
                }
                for (int64_t c = C; c < 32 * W; c++)
                    cr_assert_eq((bits[r * W + c / 32] >> (c % 32)) & 1, 0u, "padding bit %lld of row %lld is set",
                                 (long long)c, (long long)r);
            }
            if (ps[pi] == 0.0 || ps[pi] == 1.0) cr_assert_eq(ones, ps[pi] == 1.0 ? R * C : 0);
            ts_generator_get_state(ga, s1);
            ts_generator_get_state(gb, s2);
            ts_generator_get_state(gc, s3);
            cr_assert(memcmp(s1, s2, sizeof s1) == 0 && memcmp(s1, s3, sizeof s1) == 0,
                      "%s path, shape (%lld, %lld) p %g: the generators' states differ", ts__kpath_name(path),
                      (long long)R, (long long)C, ps[pi]);
            uint32_t next = ts_generator_random(ga);
            cr_assert(ts_generator_random(gb) == next && ts_generator_random(gc) == next);
            free(v);
            free(bits);
            ts_tensor_free(t);
        }
    ts_generator_free(ga);
    ts_generator_free(gb);
    ts_generator_free(gc);
    ts__kpath_force(-1);
}

Test(tensor_flash_attention, scalar_keep_bits_and_bernoulli_are_the_spec_draws) { keep_bits_check(TS__KPATH_SCALAR); }
Test(tensor_flash_attention, avx2_keep_bits_and_bernoulli_are_the_spec_draws) { keep_bits_check(TS__KPATH_AVX2); }
Test(tensor_flash_attention, avx512_keep_bits_and_bernoulli_are_the_spec_draws) { keep_bits_check(TS__KPATH_AVX512); }

/* Training with p = 0 is no dropout, and eval mode ignores p: the fused
 * kernel gives the same bits as without dropout and draws nothing. */
Test(tensor_flash_attention, no_dropout_at_p0_or_in_eval)
{
    int64_t s[3] = {2, 45, 24}, ks[3] = {2, 40, 24};
    ts_tensor *mask = make_mask(M_RANDOM, 45, 40);
    ts_tensor *q = uniform(3, s, 1.0, 1), *k = uniform(3, ks, 1.0, 2), *v = uniform(3, ks, 1.0, 3), *o[3];
    ts_generator *g;
    TH_OK(ts_generator_new(3, &g));
    uint8_t before[TS_GENERATOR_STATE_BYTES], after[TS_GENERATOR_STATE_BYTES];
    ts_generator_get_state(g, before);
    ts__flash_force(1);
    TH_OK(ts_attention(q, k, v, 3, mask, 0.0, false, g, &o[0])); /* eval, no dropout */
    TH_OK(ts_attention(q, k, v, 3, mask, 0.0, true, g, &o[1]));  /* training, p = 0 */
    TH_OK(ts_attention(q, k, v, 3, mask, 0.4, false, g, &o[2])); /* eval, p = 0.4 */
    ts__flash_force(-1);
    ts_generator_get_state(g, after);
    cr_assert(memcmp(before, after, sizeof before) == 0, "no draws without dropout");
    double *x = th_vals_new(o[0]);
    for (int i = 1; i < 3; i++) {
        double *y = th_vals_new(o[i]);
        for (int64_t e = 0; e < ts_tensor_numel(o[0]); e++)
            cr_assert(memcmp(&x[e], &y[e], sizeof x[e]) == 0, "call %d element %lld: %g vs %g", i, (long long)e, y[e],
                      x[e]);
        free(y);
    }
    free(x);
    ts_tensor *all[] = {mask, q, k, v, o[0], o[1], o[2]};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) ts_tensor_free(all[i]);
    ts_generator_free(g);
}
