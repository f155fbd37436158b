/*
 * The BLIS matrix products (ts__gemm_f32/f64) against the plain C reference
 * kernels, on many shapes and layouts, and the BLIS kernel-set and thread
 * selection.
 */
#define _GNU_SOURCE
#include "tensor/blis_arch.h"
#include "tensor/internal.h"
#include "tests/helpers.h"

#include <blis.h>
#include <criterion/criterion.h>
#include <float.h>
#include <math.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ------------------------------------------------------------ layouts */

/* How an operand of `rows` x `cols` is laid out in memory. */
typedef enum layout {
    L_ROW,        /* contiguous row-major */
    L_ROW_PAD,    /* row-major, leading dimension cols + 3 */
    L_COL,        /* column-major (a transposed contiguous tensor) */
    L_COL_PAD,    /* column-major, leading dimension rows + 5 */
    L_GENERAL,    /* both strides non-unit: rs = 2 cols + 1, cs = 2 */
    L_INTERLEAVE, /* t[:, ::2] of a (rows, 2 cols - 1) tensor: rows interleave, BLIS refuses it */
    L_NEGATIVE,   /* row-major walked backwards: rs = -cols, cs = -1 */
    L_BROADCAST,  /* every row the same (expand of one row): rs = 0 */
    L_COUNT
} layout;

static const char *const layout_names[L_COUNT] = {"row",     "row_pad",    "col",      "col_pad",
                                                  "general", "interleave", "negative", "broadcast"};

typedef struct mat {
    int64_t rows, cols, rs, cs;
    layout lay;
    bool f64;
    void *buf;    /* allocation */
    int64_t nbuf; /* elements in buf */
    int64_t base; /* index of element (0, 0) in buf */
} mat;

static void strides_for(layout l, int64_t r, int64_t c, int64_t *rs, int64_t *cs)
{
    switch (l) {
    case L_ROW: *rs = c, *cs = 1; break;
    case L_ROW_PAD: *rs = c + 3, *cs = 1; break;
    case L_COL: *rs = 1, *cs = r; break;
    case L_COL_PAD: *rs = 1, *cs = r + 5; break;
    case L_GENERAL: *rs = 2 * c + 1, *cs = 2; break;
    case L_INTERLEAVE: *rs = 2 * c - 1, *cs = 2; break;
    case L_NEGATIVE: *rs = -c, *cs = -1; break;
    case L_BROADCAST: *rs = 0, *cs = 1; break;
    default: cr_assert_fail("bad layout");
    }
}

static uint64_t rng_state = 88172645463325252ull;

/* Values in [-1, 1] with a few exact zeros; deterministic. */
static double next_value(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    uint64_t v = rng_state % 2001;
    return ((double)v - 1000.0) / 1000.0;
}

static double sentinel(bool f64) { return f64 ? -12345.678 : -1234.5f; }

static double load(const mat *m, int64_t idx)
{
    return m->f64 ? ((const double *)m->buf)[idx] : (double)((const float *)m->buf)[idx];
}

static void store(mat *m, int64_t idx, double v)
{
    if (m->f64) ((double *)m->buf)[idx] = v;
    else ((float *)m->buf)[idx] = (float)v;
}

/* Allocates a matrix in layout `l`, three elements of margin on either side
 * filled with a sentinel, the elements random (or NaN if `nan`). */
static mat mat_new(bool f64, layout l, int64_t r, int64_t c, bool nan)
{
    mat m = {.rows = r, .cols = c, .lay = l, .f64 = f64};
    strides_for(l, r, c, &m.rs, &m.cs);
    int64_t lo = 0, hi = 0;
    if (r > 0 && c > 0) {
        int64_t ro = (r - 1) * m.rs, co = (c - 1) * m.cs;
        lo = (ro < 0 ? ro : 0) + (co < 0 ? co : 0);
        hi = (ro > 0 ? ro : 0) + (co > 0 ? co : 0);
    }
    m.nbuf = hi - lo + 1 + 6;
    m.base = -lo + 3;
    m.buf = calloc((size_t)m.nbuf, f64 ? sizeof(double) : sizeof(float));
    cr_assert_not_null(m.buf);
    for (int64_t i = 0; i < m.nbuf; i++) store(&m, i, sentinel(f64));
    for (int64_t i = 0; i < r; i++)
        for (int64_t j = 0; j < c; j++) store(&m, m.base + i * m.rs + j * m.cs, nan ? NAN : next_value());
    return m;
}

static mat mat_copy(const mat *src)
{
    mat m = *src;
    size_t es = src->f64 ? sizeof(double) : sizeof(float);
    m.buf = malloc((size_t)m.nbuf * es);
    cr_assert_not_null(m.buf);
    memcpy(m.buf, src->buf, (size_t)m.nbuf * es);
    return m;
}

static double at(const mat *m, int64_t i, int64_t j) { return load(m, m->base + i * m->rs + j * m->cs); }

static void *origin(const mat *m)
{
    return m->f64 ? (void *)((double *)m->buf + m->base) : (void *)((float *)m->buf + m->base);
}

/* ----------------------------------------------------------- checking */

static void run_gemm(bool reference, bool f64, int64_t m, int64_t n, int64_t k, double alpha, const mat *a,
                     const mat *b, double beta, mat *c)
{
    if (f64) {
        (reference ? ts__gemm_ref_f64 : ts__gemm_f64)(m, n, k, alpha, origin(a), a->rs, a->cs, origin(b), b->rs, b->cs,
                                                      beta, origin(c), c->rs, c->cs);
    } else {
        (reference ? ts__gemm_ref_f32 : ts__gemm_f32)(m, n, k, (float)alpha, origin(a), a->rs, a->cs, origin(b), b->rs,
                                                      b->cs, (float)beta, origin(c), c->rs, c->cs);
    }
}

/* One product by BLIS and by the reference, compared element by element.
 *
 * Tolerance: a dot product of length k summed in any order (BLIS blocks
 * and uses FMA) is within gamma_k * sum |a||b| of the exact value, gamma_k
 * ~ k u with u the unit roundoff (Higham, Accuracy and Stability, 3.1);
 * adding beta*C and rounding the result adds a few u more. The f32
 * reference accumulates in double (its own error is negligible); the f64
 * one has the same bound as BLIS, so the two may differ by twice it.
 * (k + 2) * EPSILON = 2 (k + 2) u covers both. The elements outside the
 * matrix (padding, margins) must keep their sentinel. */
static void check_one(bool f64, int64_t m, int64_t n, int64_t k, double alpha, layout la, layout lb, layout lc,
                      double beta)
{
    mat a = mat_new(f64, la, m, k, false);
    mat b = mat_new(f64, lb, k, n, false);
    /* with beta == 0 C is not read: NaN there must not come out */
    mat c0 = mat_new(f64, lc, m, n, beta == 0.0);
    mat c_blis = mat_copy(&c0);
    mat c_ref = mat_copy(&c0);

    size_t live = ts_mem_live_total();
    run_gemm(false, f64, m, n, k, alpha, &a, &b, beta, &c_blis);
    cr_assert_eq(ts_mem_live_total(), live, "scratch memory left behind (layouts %s %s %s)", layout_names[la],
                 layout_names[lb], layout_names[lc]);
    run_gemm(true, f64, m, n, k, alpha, &a, &b, beta, &c_ref);

    double eps = f64 ? DBL_EPSILON : FLT_EPSILON;
    for (int64_t i = 0; i < m; i++) {
        for (int64_t j = 0; j < n; j++) {
            double mag = 0.0;
            for (int64_t p = 0; p < k; p++) mag += fabs(at(&a, i, p) * at(&b, p, j));
            mag = fabs(alpha) * mag + (beta != 0.0 ? fabs(beta * at(&c0, i, j)) : 0.0);
            double tol = (double)(k + 2) * eps * mag + (f64 ? 1e-300 : 1e-30);
            double got = at(&c_blis, i, j), want = at(&c_ref, i, j);
            cr_assert(fabs(got - want) <= tol,
                      "%s m=%ld n=%ld k=%ld alpha=%g beta=%g layouts A=%s B=%s C=%s: C[%ld,%ld] = %.17g, "
                      "reference %.17g (tolerance %.3g)",
                      f64 ? "f64" : "f32", (long)m, (long)n, (long)k, alpha, beta, layout_names[la], layout_names[lb],
                      layout_names[lc], (long)i, (long)j, got, want, tol);
        }
    }
    /* Everything but the matrix elements is untouched: compare the whole
     * buffers after writing the reference values into the BLIS copy. */
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) store(&c_blis, c_blis.base + i * c_blis.rs + j * c_blis.cs, at(&c_ref, i, j));
    size_t es = f64 ? sizeof(double) : sizeof(float);
    cr_assert(memcmp(c_blis.buf, c_ref.buf, (size_t)c0.nbuf * es) == 0,
              "%s m=%ld n=%ld k=%ld layouts A=%s B=%s C=%s: wrote outside C", f64 ? "f64" : "f32", (long)m, (long)n,
              (long)k, layout_names[la], layout_names[lb], layout_names[lc]);
    free(a.buf);
    free(b.buf);
    free(c0.buf);
    free(c_blis.buf);
    free(c_ref.buf);
}

/* Output layouts: every one that does not alias elements. */
static const layout c_layouts[] = {L_ROW, L_ROW_PAD, L_COL, L_COL_PAD, L_GENERAL, L_INTERLEAVE, L_NEGATIVE};
#define N_C_LAYOUTS (int)(sizeof c_layouts / sizeof c_layouts[0])

static const int64_t small_shapes[][3] = {
    {1, 1, 1},  {1, 7, 1},   {7, 1, 3},    {1, 1, 100},  {2, 3, 4},  {3, 2, 1},   {1, 9, 17},
    {9, 1, 17}, {17, 33, 9}, {31, 17, 65}, {16, 16, 16}, {33, 5, 2}, {5, 47, 31},
};
#define N_SMALL (int)(sizeof small_shapes / sizeof small_shapes[0])

/* Every layout of A, B and C on small odd shapes, beta 0, 1 and -0.5. */
static void all_layouts(bool f64)
{
    static const double betas[] = {0.0, 1.0, -0.5};
    for (int s = 0; s < N_SMALL; s++)
        for (int la = 0; la < L_COUNT; la++)
            for (int lb = 0; lb < L_COUNT; lb++)
                for (int ic = 0; ic < N_C_LAYOUTS; ic++)
                    for (int bi = 0; bi < 3; bi++)
                        check_one(f64, small_shapes[s][0], small_shapes[s][1], small_shapes[s][2], bi == 2 ? 0.75 : 1.0,
                                  (layout)la, (layout)lb, c_layouts[ic], betas[bi]);
}

Test(tensor_gemm, f32_matches_reference_on_every_layout) { all_layouts(false); }

Test(tensor_gemm, f64_matches_reference_on_every_layout) { all_layouts(true); }

/* Sizes past BLIS's cache blocks (skx: MC 480, KC 384 for f32, and the
 * micro-tile edges MR 32 x NR 12), in the layouts a Linear layer uses. */
static void large_shapes(bool f64)
{
    static const int64_t shapes[][3] = {{500, 131, 401}, {129, 130, 131}, {255, 257, 63},
                                        {64, 64, 64},    {1, 513, 385},   {513, 1, 385}};
    static const layout combos[][3] = {
        {L_ROW, L_COL, L_ROW}, /* x @ W^T (forward) */
        {L_ROW, L_ROW, L_ROW}, /* dY @ W (grad of x) */
        {L_COL, L_ROW, L_ROW}, /* dY^T @ X (grad of W) */
        {L_ROW_PAD, L_COL_PAD, L_COL_PAD},
        {L_INTERLEAVE, L_GENERAL, L_ROW_PAD},
    };
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (size_t c = 0; c < sizeof combos / sizeof combos[0]; c++)
            for (int bi = 0; bi < 2; bi++)
                check_one(f64, shapes[s][0], shapes[s][1], shapes[s][2], 1.0, combos[c][0], combos[c][1], combos[c][2],
                          bi ? 1.0 : 0.0);
}

Test(tensor_gemm, f32_matches_reference_past_cache_blocks, .timeout = 120) { large_shapes(false); }

Test(tensor_gemm, f64_matches_reference_past_cache_blocks, .timeout = 120) { large_shapes(true); }

Test(tensor_gemm, two_threads_match_reference, .timeout = 120)
{
    ts_set_num_threads(2);
    cr_assert_eq(ts_get_num_threads(), 2);
    check_one(false, 700, 300, 200, 1.0, L_ROW, L_COL, L_ROW, 0.0);
    check_one(true, 300, 700, 200, 1.0, L_COL, L_ROW, L_ROW, 1.0);
}

/* ------------------------------------------------------- edge cases */

/* k == 0: C = beta * C, and beta == 0 writes zeros even over NaN. Both
 * paths; A and B are never read (NULL here). */
static void k_zero(bool reference)
{
    float c[6] = {1, 2, NAN, 4, INFINITY, -6};
    float want2[6] = {2, 4, NAN, 8, INFINITY, -12};
    float c1[6], c0[6], c2[6];
    memcpy(c1, c, sizeof c);
    memcpy(c0, c, sizeof c);
    memcpy(c2, c, sizeof c);
    void (*g)(int64_t, int64_t, int64_t, float, const float *, int64_t, int64_t, const float *, int64_t, int64_t, float,
              float *, int64_t, int64_t) = reference ? ts__gemm_ref_f32 : ts__gemm_f32;
    g(2, 3, 0, 1.0f, NULL, 0, 1, NULL, 3, 1, 1.0f, c1, 3, 1);
    g(2, 3, 0, 1.0f, NULL, 0, 1, NULL, 3, 1, 0.0f, c0, 3, 1);
    g(2, 3, 0, 1.0f, NULL, 0, 1, NULL, 3, 1, 2.0f, c2, 3, 1);
    for (int i = 0; i < 6; i++) {
        cr_assert(memcmp(&c1[i], &c[i], sizeof(float)) == 0, "beta 1 changed C[%d]", i);
        cr_assert(c0[i] == 0.0f && !signbit(c0[i]), "beta 0: C[%d] = %g, want +0", i, (double)c0[i]);
        cr_assert((isnan(want2[i]) && isnan(c2[i])) || c2[i] == want2[i], "beta 2: C[%d] = %g", i, (double)c2[i]);
    }
    double d[4] = {NAN, 1, 2, 3};
    (reference ? ts__gemm_ref_f64 : ts__gemm_f64)(2, 2, 0, 1.0, NULL, 0, 1, NULL, 2, 1, 0.0, d, 2, 1);
    for (int i = 0; i < 4; i++) cr_assert(d[i] == 0.0, "f64 beta 0: C[%d] = %g", i, d[i]);
}

Test(tensor_gemm, k_zero_scales_c_by_beta) { k_zero(false); }

Test(tensor_gemm, reference_k_zero_scales_c_by_beta) { k_zero(true); }

Test(tensor_gemm, m_or_n_zero_touches_nothing)
{
    /* NULL everywhere: nothing may be dereferenced */
    ts__gemm_f32(0, 5, 3, 1.0f, NULL, 3, 1, NULL, 5, 1, 0.0f, NULL, 5, 1);
    ts__gemm_f32(5, 0, 3, 1.0f, NULL, 3, 1, NULL, 1, 1, 0.0f, NULL, 1, 1);
    ts__gemm_f64(0, 0, 0, 1.0, NULL, 1, 1, NULL, 1, 1, 0.0, NULL, 1, 1);
    ts__gemm_ref_f32(0, 5, 3, 1.0f, NULL, 3, 1, NULL, 5, 1, 0.0f, NULL, 5, 1);
    ts__gemm_ref_f64(5, 0, 3, 1.0, NULL, 3, 1, NULL, 1, 1, 0.0, NULL, 1, 1);
    for (int f = 0; f < 2; f++) {
        check_one(f, 0, 4, 3, 1.0, L_ROW, L_ROW, L_ROW, 0.0);
        check_one(f, 4, 0, 3, 1.0, L_ROW, L_ROW, L_ROW, 1.0);
        check_one(f, 3, 4, 0, 1.0, L_ROW, L_ROW, L_ROW_PAD, 0.0);
        check_one(f, 3, 4, 0, 1.0, L_ROW, L_ROW, L_COL_PAD, -0.5);
    }
}

Test(tensor_gemm, alpha_zero_does_not_read_a_or_b)
{
    /* BLAS: alpha == 0 leaves beta * C and ignores A and B, NaN included */
    float a[4] = {NAN, NAN, NAN, NAN}, b[4] = {INFINITY, 1, 2, 3};
    float c[4] = {1, 2, 3, 4}, r[4] = {1, 2, 3, 4};
    ts__gemm_f32(2, 2, 2, 0.0f, a, 2, 1, b, 2, 1, 0.5f, c, 2, 1);
    ts__gemm_ref_f32(2, 2, 2, 0.0f, a, 2, 1, b, 2, 1, 0.5f, r, 2, 1);
    for (int i = 0; i < 4; i++) {
        cr_assert_eq(c[i], 0.5f * (float)(i + 1));
        cr_assert_eq(r[i], 0.5f * (float)(i + 1));
    }
}

Test(tensor_gemm, nan_in_a_propagates)
{
    float a[4] = {NAN, 1, 1, 1}, b[4] = {1, 1, 1, 1}, c[4] = {0, 0, 0, 0};
    ts__gemm_f32(2, 2, 2, 1.0f, a, 2, 1, b, 2, 1, 0.0f, c, 2, 1);
    cr_assert(isnan(c[0]) && isnan(c[1]) && c[2] == 2.0f && c[3] == 2.0f);
}

Test(tensor_gemm, exact_small_product)
{
    /* integers: exact in both paths */
    float a[6] = {1, 2, 3, 4, 5, 6};    /* (2, 3) */
    float b[6] = {7, 8, 9, 10, 11, 12}; /* (3, 2) */
    float c[4] = {1, 1, 1, 1};
    ts__gemm_f32(2, 2, 3, 1.0f, a, 3, 1, b, 2, 1, 1.0f, c, 2, 1);
    float want[4] = {59, 65, 140, 155};
    for (int i = 0; i < 4; i++) cr_assert_eq(c[i], want[i], "C[%d] = %g, want %g", i, (double)c[i], (double)want[i]);
    /* the same with A^T stored (3, 2) column-wise, C column-major */
    float at_[6] = {1, 4, 2, 5, 3, 6};
    float cc[4] = {0, 0, 0, 0};
    ts__gemm_f32(2, 2, 3, 1.0f, at_, 1, 2, b, 2, 1, 0.0f, cc, 1, 2);
    float wantc[4] = {58, 139, 64, 154};
    for (int i = 0; i < 4; i++)
        cr_assert_eq(cc[i], wantc[i], "C[%d] = %g, want %g", i, (double)cc[i], (double)wantc[i]);
}

Test(tensor_gemm, reference_flag_routes_to_reference)
{
    mat a = mat_new(false, L_ROW, 37, 29, false);
    mat b = mat_new(false, L_COL, 29, 41, false);
    mat c1 = mat_new(false, L_ROW, 37, 41, false);
    mat c2 = mat_copy(&c1);
    ts__use_reference_kernels = true;
    run_gemm(false, false, 37, 41, 29, 1.0, &a, &b, 1.0, &c1);
    ts__use_reference_kernels = false;
    run_gemm(true, false, 37, 41, 29, 1.0, &a, &b, 1.0, &c2);
    cr_assert(memcmp(c1.buf, c2.buf, (size_t)c1.nbuf * sizeof(float)) == 0,
              "with ts__use_reference_kernels the result must be the reference's, bit for bit");
    free(a.buf);
    free(b.buf);
    free(c1.buf);
    free(c2.buf);
}

/* --------------------------------------------------- kernel selection */

/* Whether this CPU (and OS) runs kernel set `name`, asked of the
 * compiler's runtime, which checks XCR0 too: an oracle independent of
 * the library's cpuid code. */
static bool cpu_runs(const char *name)
{
    __builtin_cpu_init();
    if (strcmp(name, "skx") == 0)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
            __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (strcmp(name, "knl") == 0)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512pf") &&
            __builtin_cpu_supports("avx512er");
    if (strcmp(name, "haswell") == 0 || strcmp(name, "zen") == 0 || strcmp(name, "zen2") == 0 ||
        strcmp(name, "zen3") == 0 || strcmp(name, "excavator") == 0)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (strcmp(name, "sandybridge") == 0) return __builtin_cpu_supports("avx");
    if (strcmp(name, "penryn") == 0) return __builtin_cpu_supports("ssse3");
    if (strcmp(name, "generic") == 0) return true;
    return false;
}

static bool cpu_has_avx512_skx(void) { return cpu_runs("skx"); }

/* Each Test runs in its own process, so BLIS is not initialised yet and
 * the environment can be set for it. */
static const char *arch_with_env(const char *value)
{
    if (value) setenv("BLIS_ARCH_TYPE", value, 1);
    else unsetenv("BLIS_ARCH_TYPE");
    return ts_blis_arch_name();
}

Test(tensor_gemm, chosen_kernels_are_known_runnable_and_fast)
{
    const char *name = arch_with_env(NULL);
    bool known = false;
    for (int id = 0; id < TS__BLIS_ARCH_COUNT; id++)
        if (ts__blis_arch_configured(id) && strcmp(name, ts__blis_arch_id_name(id)) == 0) known = true;
    cr_assert(known, "BLIS runs '%s', which is not a sub-configuration of this BLIS build", name);
    cr_assert(cpu_runs(name), "BLIS runs '%s', which this CPU cannot execute", name);
    /* the real choice is what BLIS reports */
    cr_assert_str_eq(name, bli_arch_string(bli_arch_query_id()));
    ts__cpu_info cpu;
    ts__cpu_info_query(&cpu);
    cr_assert_str_eq(name, ts__blis_arch_id_name(ts__blis_arch_choose(&cpu)));
    if (cpu_has_avx512_skx()) cr_assert_str_eq(name, "skx", "an AVX-512 CPU must get the skx kernels, got '%s'", name);
    else if (cpu_runs("haswell"))
        cr_assert(strcmp(name, "haswell") == 0 || strncmp(name, "zen", 3) == 0,
                  "an AVX2+FMA CPU must get AVX2 kernels, got '%s'", name);
}

Test(tensor_gemm, cpuid_agrees_with_the_compiler)
{
    ts__cpu_info c;
    ts__cpu_info_query(&c);
    __builtin_cpu_init();
    cr_assert_eq(c.avx2 && c.os_ymm && c.avx, (bool)__builtin_cpu_supports("avx2"));
    cr_assert_eq(c.fma3 && c.avx && c.os_ymm, (bool)__builtin_cpu_supports("fma"));
    cr_assert_eq(c.avx512f && c.os_zmm, (bool)__builtin_cpu_supports("avx512f"));
    cr_assert_eq(c.avx512bw && c.os_zmm, (bool)__builtin_cpu_supports("avx512bw"));
    cr_assert_eq(c.ssse3, (bool)__builtin_cpu_supports("ssse3"));
}

static ts__cpu_info cpu_avx2(ts__cpu_vendor v, uint32_t family)
{
    ts__cpu_info c = {.vendor = v,
                      .family = family,
                      .sse3 = true,
                      .ssse3 = true,
                      .avx = true,
                      .fma3 = true,
                      .avx2 = true,
                      .os_ymm = true};
    return c;
}

static ts__cpu_info cpu_avx512(ts__cpu_vendor v, uint32_t family)
{
    ts__cpu_info c = cpu_avx2(v, family);
    c.avx512f = c.avx512dq = c.avx512cd = c.avx512bw = c.avx512vl = true;
    c.os_zmm = true;
    return c;
}

static const char *choice(ts__cpu_info c) { return ts__blis_arch_id_name(ts__blis_arch_choose(&c)); }

Test(tensor_gemm, selection_policy_for_other_cpus)
{
    /* The ids Debian's BLIS 0.9 has; skip if linked against another build */
    if (!ts__blis_arch_configured(0) || !ts__blis_arch_configured(3) || !ts__blis_arch_configured(6) ||
        !ts__blis_arch_configured(7) || !ts__blis_arch_configured(25))
        cr_skip_test("BLIS build without skx/haswell/zen3/zen2/generic");
    /* AMD Zen 5 (family 0x1A) and Zen 4 (0x19): BLIS 0.9 falls back to
     * generic there; AVX-512 gets skx */
    cr_assert_str_eq(choice(cpu_avx512(TS__CPU_AMD, 0x1A)), "skx");
    cr_assert_str_eq(choice(cpu_avx512(TS__CPU_AMD, 0x19)), "skx");
    cr_assert_str_eq(choice(cpu_avx512(TS__CPU_INTEL, 6)), "skx");
    /* the OS does not save zmm state (XCR0): AVX-512 is unusable */
    ts__cpu_info no_zmm = cpu_avx512(TS__CPU_AMD, 0x1A);
    no_zmm.os_zmm = false;
    cr_assert_str_eq(choice(no_zmm), "zen3");
    cr_assert(!ts__blis_arch_runnable(0, &no_zmm));
    /* AVX-512 without BW/VL (Knights Landing lacks them): not skx */
    ts__cpu_info partial = cpu_avx512(TS__CPU_INTEL, 6);
    partial.avx512bw = partial.avx512vl = false;
    cr_assert_str_neq(choice(partial), "skx");
    cr_assert(!ts__blis_arch_runnable(0, &partial));
    cr_assert_str_eq(choice(partial), "haswell");
    /* AVX2 machines */
    cr_assert_str_eq(choice(cpu_avx2(TS__CPU_AMD, 0x19)), "zen3");
    cr_assert_str_eq(choice(cpu_avx2(TS__CPU_AMD, 0x1A)), "zen3");
    cr_assert_str_eq(choice(cpu_avx2(TS__CPU_AMD, 0x17)), "zen2");
    cr_assert_str_eq(choice(cpu_avx2(TS__CPU_INTEL, 6)), "haswell");
    cr_assert_str_eq(choice(cpu_avx2(TS__CPU_OTHER, 6)), "haswell");
    /* AVX without AVX2, and without OS ymm support */
    ts__cpu_info snb = cpu_avx2(TS__CPU_INTEL, 6);
    snb.avx2 = snb.fma3 = false;
    cr_assert_str_eq(choice(snb), ts__blis_arch_configured(4) ? "sandybridge" : "penryn");
    ts__cpu_info no_ymm = cpu_avx2(TS__CPU_INTEL, 6);
    no_ymm.os_ymm = false;
    cr_assert(!ts__blis_arch_runnable(3, &no_ymm));
    cr_assert_str_eq(choice(no_ymm), ts__blis_arch_configured(5) ? "penryn" : "generic");
    ts__cpu_info bare = {.vendor = TS__CPU_OTHER};
    cr_assert_str_eq(choice(bare), "generic");
    /* whatever it picks, it can run */
    ts__cpu_info cpus[] = {cpu_avx512(TS__CPU_AMD, 0x1A), no_zmm, partial, snb, no_ymm, bare};
    for (size_t i = 0; i < sizeof cpus / sizeof cpus[0]; i++) {
        int id = ts__blis_arch_choose(&cpus[i]);
        cr_assert(ts__blis_arch_configured(id) && ts__blis_arch_runnable(id, &cpus[i]));
    }
}

Test(tensor_gemm, user_arch_number_is_respected)
{
    if (!cpu_runs("haswell")) cr_skip_test("CPU without AVX2+FMA");
    cr_assert_str_eq(arch_with_env("3"), "haswell");
    check_one(false, 40, 30, 20, 1.0, L_ROW, L_COL, L_ROW, 0.0);
}

/* The other kernel sets this CPU runs, on every layout: haswell has
 * BLIS's "sup" path, which reads small operands unpacked. */
Test(tensor_gemm, haswell_kernels_match_reference_on_every_layout, .timeout = 120)
{
    if (!cpu_runs("haswell")) cr_skip_test("CPU without AVX2+FMA");
    cr_assert_str_eq(arch_with_env("haswell"), "haswell");
    all_layouts(false);
    all_layouts(true);
    large_shapes(false);
}

Test(tensor_gemm, generic_kernels_match_reference, .timeout = 120)
{
    cr_assert_str_eq(arch_with_env("25"), "generic");
    for (int f = 0; f < 2; f++) {
        check_one(f, 65, 47, 129, 1.0, L_ROW, L_COL, L_ROW, 0.0);
        check_one(f, 31, 17, 65, 0.75, L_INTERLEAVE, L_NEGATIVE, L_COL_PAD, -0.5);
    }
}

Test(tensor_gemm, user_arch_name_is_accepted)
{
    cr_assert_str_eq(arch_with_env("generic"), "generic");
    cr_assert_str_eq(getenv("BLIS_ARCH_TYPE"), "25");
    check_one(true, 20, 30, 40, 1.0, L_COL, L_ROW, L_ROW, 1.0);
}

/* Values BLIS would abort on (ids it does not have) or read as skx: the
 * library warns and uses its own choice instead. */
static void user_arch_replaced(const char *value)
{
    ts__cpu_info cpu;
    ts__cpu_info_query(&cpu);
    const char *want = ts__blis_arch_id_name(ts__blis_arch_choose(&cpu));
    cr_assert_str_eq(arch_with_env(value), want, "BLIS_ARCH_TYPE=%s", value);
    check_one(false, 20, 20, 20, 1.0, L_ROW, L_ROW, L_ROW, 0.0);
}

Test(tensor_gemm, user_arch_unconfigured_id_is_replaced) { user_arch_replaced("2"); }

Test(tensor_gemm, user_arch_arm_id_is_replaced) { user_arch_replaced("13"); }

Test(tensor_gemm, user_arch_out_of_range_is_replaced) { user_arch_replaced("99"); }

Test(tensor_gemm, user_arch_junk_is_replaced) { user_arch_replaced("fastest"); }

Test(tensor_gemm, user_arch_detect_gets_library_choice) { user_arch_replaced("-1"); }

Test(tensor_gemm, user_arch_cpu_cannot_run_is_replaced)
{
    if (cpu_has_avx512_skx()) cr_skip_test("this CPU runs every x86 kernel set BLIS 0.9 has but knl/bulldozer");
    user_arch_replaced("0");
}

Test(tensor_gemm, user_arch_bulldozer_on_non_fma4_is_replaced)
{
    __builtin_cpu_init();
    if (__builtin_cpu_supports("fma4")) cr_skip_test("CPU with FMA4");
    user_arch_replaced("12");
}

/* ------------------------------------------------------------ threads */

Test(tensor_gemm, threads_default_to_one)
{
    unsetenv("TS_NUM_THREADS");
    unsetenv("LOCAL_WORLD_SIZE");
    cr_assert_eq(ts_get_num_threads(), 1);
    cr_assert_eq(bli_thread_get_num_threads(), 1);
}

Test(tensor_gemm, threads_from_ts_num_threads)
{
    setenv("TS_NUM_THREADS", "3", 1);
    setenv("LOCAL_WORLD_SIZE", "2", 1);
    cr_assert_eq(ts_get_num_threads(), 3);
    cr_assert_eq(bli_thread_get_num_threads(), 3);
    check_one(false, 200, 100, 50, 1.0, L_ROW, L_COL, L_ROW, 0.0);
}

Test(tensor_gemm, threads_bad_ts_num_threads_ignored)
{
    setenv("TS_NUM_THREADS", "lots", 1);
    unsetenv("LOCAL_WORLD_SIZE");
    cr_assert_eq(ts_get_num_threads(), 1);
}

Test(tensor_gemm, threads_from_local_world_size)
{
    unsetenv("TS_NUM_THREADS");
    long cores = ts_cpu_count();
    setenv("LOCAL_WORLD_SIZE", "1", 1);
    cr_assert_eq(ts_get_num_threads(), (int)cores);
}

Test(tensor_gemm, threads_local_world_size_above_cores_gives_one)
{
    unsetenv("TS_NUM_THREADS");
    setenv("LOCAL_WORLD_SIZE", "4096", 1);
    cr_assert_eq(ts_get_num_threads(), 1);
}

Test(tensor_gemm, set_num_threads)
{
    ts_set_num_threads(2);
    cr_assert_eq(ts_get_num_threads(), 2);
    cr_assert_eq(bli_thread_get_num_threads(), 2);
    ts_set_num_threads(0);
    cr_assert_eq(ts_get_num_threads(), 1);
    cr_assert_eq(bli_thread_get_num_threads(), 1);
}
