/* bfloat16 and float16 matrix products: every kernel (the AVX512-BF16
 * micro-kernel where the CPU has it, the sgemm fallback everywhere)
 * against the reference, through ts__gemm_half_with and through the ops
 * (matmul, bmm, linear and their backward), the kernel choice from cpuid
 * and from TS_BF16_GEMM_KERNEL.
 *
 * The reference (ts__gemm_ref_half) upcasts the inputs, sums the products
 * in float32 in the order p = 0 .. k-1, adds beta * C in float32 and
 * rounds once. The kernels compute the same sum in another order (blocks
 * of k, pairs of products inside vdpbf16ps, BLIS's own order), so their
 * float32 sums may differ from the reference's by up to about
 * 2 k u S, u = 2^-24 and S = sum_p |a_ip b_pj| + |beta c_ij| (the
 * forward error bound of a float32 sum, for each of the two orders); the
 * single rounding to the 16-bit dtype then adds at most one unit in the
 * last place when the two float32 values fall on either side of a
 * rounding boundary. So an element passes when
 * |got - ref| <= ulp(ref) + 2 k u S, which is tight enough that a missing
 * product, a wrong stride or a second rounding (each off by far more
 * than an ulp for these inputs) fails. vdpbf16ps also flushes subnormal
 * inputs and outputs to zero; the inputs here are normal numbers whose
 * sums stay far from the subnormal range, so that does not show. */
#define _GNU_SOURCE
#include "tensor/blis_arch.h"
#include "tensor/gemm_half.h"
#include "tensor/internal.h"
#include "tensor/kernels.h"
#include "tests/helpers.h"

#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static float to_f32(ts_dtype dt, uint16_t h) { return dt == TS_BF16 ? ts__bf16_to_f32(h) : ts_f16_to_f32(h); }

static uint16_t from_f32(ts_dtype dt, float f) { return dt == TS_BF16 ? ts__f32_to_bf16(f) : ts_f32_to_f16(f); }

/* n values in [-1, 1) rounded to dt. */
static uint16_t *rand_half(ts_dtype dt, int64_t n, uint32_t seed)
{
    uint16_t *p = malloc((size_t)(n > 0 ? n : 1) * sizeof *p);
    uint32_t s = seed * 2654435761u + 7;
    for (int64_t i = 0; i < n; i++) p[i] = from_f32(dt, (float)(th_lcg(&s) >> 8) / 8388608.0f - 1.0f);
    return p;
}

/* Spacing of dt's numbers at |x| (dt's ulp; 2^-24 for bf16 / 2^-24 for
 * f16 subnormals as the floor). */
static double ulp_of(ts_dtype dt, double x)
{
    int mant = dt == TS_BF16 ? 7 : 10;
    int e;
    frexp(fabs(x), &e); /* |x| in [2^(e-1), 2^e) */
    double u = ldexp(1.0, e - 1 - mant);
    double floor_u = dt == TS_BF16 ? ldexp(1.0, -133) : ldexp(1.0, -24);
    return x == 0.0 ? floor_u : fmax(u, floor_u);
}

/* Asserts c (m, n) matches ref (m, n) within the tolerance of the file
 * comment; a, b, c0 (C before the product) give S. */
static void assert_matches(ts_dtype dt, const char *what, int64_t m, int64_t n, int64_t k, const uint16_t *a,
                           int64_t rsa, int64_t csa, const uint16_t *b, int64_t rsb, int64_t csb, float beta,
                           const uint16_t *c0, const uint16_t *got, const uint16_t *ref, int64_t rsc, int64_t csc)
{
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            double s = beta != 0.0f ? fabs((double)beta * to_f32(dt, c0[i * rsc + j * csc])) : 0.0;
            for (int64_t p = 0; p < k; p++)
                s += fabs((double)to_f32(dt, a[i * rsa + p * csa]) * to_f32(dt, b[p * rsb + j * csb]));
            double r = to_f32(dt, ref[i * rsc + j * csc]), g = to_f32(dt, got[i * rsc + j * csc]);
            double tol = ulp_of(dt, r) + 2.0 * (double)(k + 1) * ldexp(1.0, -24) * s;
            cr_assert(fabs(g - r) <= tol,
                      "%s (%s, m %lld n %lld k %lld, beta %g): C[%lld, %lld] = %.9g, reference %.9g "
                      "(tolerance %.3g)",
                      what, dt == TS_BF16 ? "bf16" : "f16", (long long)m, (long long)n, (long long)k, (double)beta,
                      (long long)i, (long long)j, g, r, tol);
        }
}

/* Operand layouts: row-major, column-major, and a stepped view (every
 * other column of a wider row-major buffer, so no unit stride at all). */
typedef enum layout { ROW, COL, STEP, N_LAYOUTS } layout;
static const char *const layout_names[] = {"row-major", "column-major", "stepped"};

static void strides_for(layout l, int64_t rows, int64_t cols, int64_t *rs, int64_t *cs, int64_t *elems)
{
    switch (l) {
    case ROW: *rs = cols, *cs = 1, *elems = rows * cols; break;
    case COL: *rs = 1, *cs = rows, *elems = rows * cols; break;
    default: *rs = 2 * cols + 1, *cs = 2, *elems = rows * (2 * cols + 1); break;
    }
}

/* One product with kernel `kern` against the reference: every pair of
 * operand layouts, C row- or column-major, beta 0, 1 and -0.5. */
static void check_kernel_case(ts__hgemm_kernel kern, ts_dtype dt, int64_t m, int64_t n, int64_t k)
{
    static const float betas[] = {0.0f, 1.0f, -0.5f};
    for (int la = 0; la < N_LAYOUTS; la++)
        for (int lb = 0; lb < N_LAYOUTS; lb++) {
            int64_t rsa, csa, na, rsb, csb, nb;
            strides_for((layout)la, m, k, &rsa, &csa, &na);
            strides_for((layout)lb, k, n, &rsb, &csb, &nb);
            uint16_t *a = rand_half(dt, na, (uint32_t)(m * 31 + la)), *b = rand_half(dt, nb, (uint32_t)(n * 17 + lb));
            for (int bi = 0; bi < 3; bi++) {
                float beta = betas[bi];
                bool ccol = (la + lb + bi) % 2;
                int64_t rsc = ccol ? 1 : n, csc = ccol ? m : 1;
                uint16_t *c0 = rand_half(dt, m * n, (uint32_t)(k + bi)), *got = malloc((size_t)(m * n) * 2),
                         *ref = malloc((size_t)(m * n) * 2);
                if (beta == 0.0f) /* beta 0 must not read C: NaN there must not show */
                    for (int64_t i = 0; i < m * n; i++) c0[i] = dt == TS_BF16 ? 0x7FC0 : 0x7E00;
                memcpy(got, c0, (size_t)(m * n) * 2);
                memcpy(ref, c0, (size_t)(m * n) * 2);
                ts__gemm_ref_half(dt, m, n, k, a, rsa, csa, b, rsb, csb, beta, ref, rsc, csc);
                ts__gemm_half_with(kern, dt, m, n, k, a, rsa, csa, b, rsb, csb, beta, got, rsc, csc);
                char what[160];
                snprintf(what, sizeof what, "kernel %s, A %s, B %s, C %s", ts__hgemm_kernel_name(kern),
                         layout_names[la], layout_names[lb], ccol ? "column-major" : "row-major");
                assert_matches(dt, what, m, n, k, a, rsa, csa, b, rsb, csb, beta, c0, got, ref, rsc, csc);
                free(c0);
                free(got);
                free(ref);
            }
            free(a);
            free(b);
        }
}

/* Sizes around the kernels' blocks: 1s, odd sizes, k odd and above two
 * KC steps (513 pairs = 1026 > 2 x 512), m above one MC block (168 rows)
 * and n above one NC block (1024 columns) and not a multiple of the
 * 14 x 32 tile. */
static const int64_t sizes[][3] = {
    {1, 1, 1}, {1, 7, 3}, {5, 1, 9}, {3, 5, 1}, {13, 29, 17}, {31, 33, 65}, {15, 40, 1027}, {170, 1030, 7},
};
#define N_SIZES (int)(sizeof sizes / sizeof sizes[0])

static void check_kernel(ts__hgemm_kernel kern, ts_dtype dt)
{
    for (int s = 0; s < N_SIZES; s++) check_kernel_case(kern, dt, sizes[s][0], sizes[s][1], sizes[s][2]);
}

static bool cpu_runs(ts__hgemm_kernel k)
{
    ts__cpu_info cpu;
    ts__cpu_info_query(&cpu);
    return ts__hgemm_kernel_runnable(k, &cpu);
}

Test(tensor_matmul_half, avx512bf16_kernel_matches_reference, .timeout = 120)
{
    if (!cpu_runs(TS__HGEMM_AVX512BF16)) cr_skip_test("skipped: this CPU has no AVX512_BF16 (with OS zmm state)");
    check_kernel(TS__HGEMM_AVX512BF16, TS_BF16);
}

Test(tensor_matmul_half, avx512bf16_kernel_two_threads_match_reference, .timeout = 120)
{
    if (!cpu_runs(TS__HGEMM_AVX512BF16)) cr_skip_test("skipped: this CPU has no AVX512_BF16 (with OS zmm state)");
    /* large enough for the second thread (m n k >= 4e6, m >= 28), with
     * the shared B block packed by both threads */
    ts_set_num_threads(2);
    check_kernel_case(TS__HGEMM_AVX512BF16, TS_BF16, 203, 1100, 41);
    ts_set_num_threads(1);
}

Test(tensor_matmul_half, sgemm_fallback_matches_reference_bf16, .timeout = 120)
{
    check_kernel(TS__HGEMM_SGEMM, TS_BF16);
}

Test(tensor_matmul_half, sgemm_fallback_matches_reference_f16, .timeout = 120)
{
    check_kernel(TS__HGEMM_SGEMM, TS_F16);
}

Test(tensor_matmul_half, f16_never_uses_the_bf16_kernel)
{
    /* asked for the AVX512-BF16 kernel, float16 runs the sgemm path: an
     * f16 product read as bf16 pairs would be garbage, far off the
     * reference */
    check_kernel_case(TS__HGEMM_AVX512BF16, TS_F16, 13, 29, 17);
}

Test(tensor_matmul_half, k_zero_scales_c)
{
    for (int kern = 0; kern < TS__HGEMM_KERNEL_COUNT; kern++) {
        uint16_t c[4] = {from_f32(TS_BF16, 1.0f), from_f32(TS_BF16, -2.0f), 0x7FC0, from_f32(TS_BF16, 3.0f)};
        ts__gemm_half_with((ts__hgemm_kernel)kern, TS_BF16, 2, 2, 0, NULL, 0, 1, NULL, 2, 1, 0.5f, c, 2, 1);
        cr_assert_eq(to_f32(TS_BF16, c[0]), 0.5f);
        cr_assert_eq(to_f32(TS_BF16, c[1]), -1.0f);
        cr_assert(isnan(to_f32(TS_BF16, c[2])));
        ts__gemm_half_with((ts__hgemm_kernel)kern, TS_BF16, 2, 2, 0, NULL, 0, 1, NULL, 2, 1, 0.0f, c, 2, 1);
        for (int i = 0; i < 4; i++) cr_assert_eq(c[i], 0, "beta 0 and k 0 give zeros, even over a NaN");
    }
}

/* ------------------------------------------------------------ choosing */

static ts__cpu_info cpu_avx2_only(void)
{
    ts__cpu_info c = {.vendor = TS__CPU_AMD,
                      .family = 0x19,
                      .sse3 = true,
                      .ssse3 = true,
                      .avx = true,
                      .fma3 = true,
                      .avx2 = true,
                      .os_ymm = true};
    return c;
}

static ts__cpu_info cpu_avx512_bf16(void)
{
    ts__cpu_info c = cpu_avx2_only();
    c.avx512f = c.avx512dq = c.avx512cd = c.avx512bw = c.avx512vl = true;
    c.os_zmm = true;
    c.avx512bf16 = true;
    return c;
}

Test(tensor_matmul_half, kernel_choice_from_cpuid)
{
    ts__cpu_info c = cpu_avx2_only();
    cr_assert_eq(ts__hgemm_choose(&c), TS__HGEMM_SGEMM, "AVX2-only CPUs convert to f32 for sgemm");
    c = cpu_avx512_bf16();
    cr_assert_eq(ts__hgemm_choose(&c), TS__HGEMM_AVX512BF16);
    c.os_zmm = false;
    cr_assert_eq(ts__hgemm_choose(&c), TS__HGEMM_SGEMM, "no OS zmm state: the bf16 kernel would fault");
    c = cpu_avx512_bf16();
    c.avx512bf16 = false;
    cr_assert_eq(ts__hgemm_choose(&c), TS__HGEMM_SGEMM, "AVX-512 without BF16 (Skylake-SP, Zen 3)");
    /* Sapphire Rapids: AMX-BF16 with the OS tile state; no AMX kernel is
     * built, so it runs the AVX512-BF16 one */
    c = cpu_avx512_bf16();
    c.amx_bf16 = c.amx_tile = c.os_amx = true;
    cr_assert_eq(ts__hgemm_choose(&c), TS__HGEMM_AVX512BF16);
    cr_assert_str_eq(ts__hgemm_kernel_name(TS__HGEMM_SGEMM), "sgemm");
    cr_assert_str_eq(ts__hgemm_kernel_name(TS__HGEMM_AVX512BF16), "avx512bf16");
}

Test(tensor_matmul_half, cpuid_reads_bf16_flag)
{
    ts__cpu_info c;
    ts__cpu_info_query(&c);
    __builtin_cpu_init();
    cr_assert_eq(c.avx512bf16, (bool)__builtin_cpu_supports("avx512bf16"));
}

Test(tensor_matmul_half, env_forces_the_fallback)
{
    /* each Criterion test runs in its own process, and the variable is
     * read at the first bfloat16 product: this is the first here */
    setenv("TS_BF16_GEMM_KERNEL", "sgemm", 1);
    cr_assert_str_eq(ts_bf16_gemm_kernel_name(), "sgemm");
    cr_assert_eq(ts__hgemm_active(), TS__HGEMM_SGEMM);
}

Test(tensor_matmul_half, env_auto_and_unknown_follow_cpuid)
{
    setenv("TS_BF16_GEMM_KERNEL", "no-such-kernel", 1);
    ts__cpu_info c;
    ts__cpu_info_query(&c);
    cr_assert_eq(ts__hgemm_active(), ts__hgemm_choose(&c), "an unknown value is ignored with a warning");
}

Test(tensor_matmul_half, env_avx512bf16_where_missing_falls_back)
{
    setenv("TS_BF16_GEMM_KERNEL", "avx512bf16", 1);
    cr_assert_eq(ts__hgemm_active(), cpu_runs(TS__HGEMM_AVX512BF16) ? TS__HGEMM_AVX512BF16 : TS__HGEMM_SGEMM);
}

/* ----------------------------------------------------------------- ops */

static ts_tensor *half_tensor(ts_dtype dt, int nd, const int64_t *shape, uint32_t seed, bool rg)
{
    int64_t n = 1;
    for (int i = 0; i < nd; i++) n *= shape[i];
    uint16_t *v = rand_half(dt, n, seed);
    ts_tensor *t;
    TH_OK(ts_tensor_from_data(dt, nd, shape, v, &t));
    free(v);
    if (rg) TH_OK(ts_tensor_set_requires_grad(t, true));
    return t;
}

/* A contiguous copy's data (caller frees). */
static uint16_t *data_of(ts_tensor *t)
{
    ts_tensor *c;
    TH_OK(ts_contiguous(t, &c));
    int64_t n = ts_tensor_numel(c);
    uint16_t *p = malloc((size_t)(n > 0 ? n : 1) * 2);
    memcpy(p, ts_tensor_data(c), (size_t)n * 2);
    ts_tensor_free(c);
    return p;
}

/* matmul of (bat, m, k) by (bat or 1, k, n) in dt, per batch against the
 * reference; bt transposes b's last two dims as a view first. */
static void check_bmm(ts_dtype dt, int64_t bat, int64_t m, int64_t n, int64_t k, bool bcast, bool bt)
{
    int64_t sa[3] = {bat, m, k}, sb[3] = {bcast ? 1 : bat, bt ? n : k, bt ? k : n};
    ts_tensor *a = half_tensor(dt, 3, sa, 3, false), *b0 = half_tensor(dt, 3, sb, 4, false), *b, *o;
    if (bt) TH_OK(ts_transpose(b0, 1, 2, &b));
    else b = ts_tensor_retain(b0);
    TH_OK(ts_matmul(a, b, &o));
    cr_assert_eq(ts_tensor_dtype(o), dt);
    int64_t so[3] = {bat, m, n};
    th_assert_shape(o, 3, so);
    uint16_t *A = data_of(a), *B = data_of(b0), *O = data_of(o), *R = malloc((size_t)(m * n) * 2);
    for (int64_t i = 0; i < bat; i++) {
        const uint16_t *bi = B + (bcast ? 0 : i) * k * n;
        int64_t rsb = bt ? 1 : n, csb = bt ? k : 1;
        ts__gemm_ref_half(dt, m, n, k, A + i * m * k, k, 1, bi, rsb, csb, 0.0f, R, n, 1);
        assert_matches(dt, "matmul", m, n, k, A + i * m * k, k, 1, bi, rsb, csb, 0.0f, R, O + i * m * n, R, n, 1);
    }
    free(A);
    free(B);
    free(O);
    free(R);
    ts_tensor_free(a);
    ts_tensor_free(b0);
    ts_tensor_free(b);
    ts_tensor_free(o);
}

Test(tensor_matmul_half, matmul_and_bmm_in_bf16_and_f16)
{
    ts_dtype dts[2] = {TS_BF16, TS_F16};
    for (int d = 0; d < 2; d++) {
        check_bmm(dts[d], 1, 37, 45, 29, false, false);
        check_bmm(dts[d], 3, 21, 17, 65, false, false); /* bmm */
        check_bmm(dts[d], 4, 9, 33, 12, true, false);   /* broadcast batch folds into rows */
        check_bmm(dts[d], 2, 15, 31, 18, false, true);  /* transposed view of b */
    }
}

Test(tensor_matmul_half, mixed_dtypes_are_an_error)
{
    int64_t s[2] = {3, 3};
    ts_tensor *a = half_tensor(TS_BF16, 2, s, 1, false), *b = th_seq(TS_F32, 2, s, 1.0, false), *o = NULL;
    cr_assert_neq(ts_matmul(a, b, &o), TS_OK, "torch.matmul(bf16, f32) is an error too");
    cr_assert_null(o);
    ts_tensor_free(a);
    ts_tensor_free(b);
}

Test(tensor_matmul_half, linear_with_bias_rounds_once)
{
    /* out = round(x W^T + bias): the bias is added to the float32 sum
     * before the one rounding (beta 1 onto C holding the bias) */
    ts_dtype dts[2] = {TS_BF16, TS_F16};
    for (int d = 0; d < 2; d++) {
        ts_dtype dt = dts[d];
        int64_t M = 2 * 23, K = 70, N = 41;
        int64_t sx[3] = {2, 23, K}, sw[2] = {N, K}, sbias[1] = {N};
        ts_tensor *x = half_tensor(dt, 3, sx, 5, false), *w = half_tensor(dt, 2, sw, 6, false),
                  *bias = half_tensor(dt, 1, sbias, 7, false), *o;
        TH_OK(ts_linear(x, w, bias, &o));
        uint16_t *X = data_of(x), *W = data_of(w), *Bv = data_of(bias), *O = data_of(o);
        uint16_t *C0 = malloc((size_t)(M * N) * 2), *R = malloc((size_t)(M * N) * 2);
        for (int64_t i = 0; i < M; i++) memcpy(C0 + i * N, Bv, (size_t)N * 2);
        memcpy(R, C0, (size_t)(M * N) * 2);
        ts__gemm_ref_half(dt, M, N, K, X, K, 1, W, 1, K, 1.0f, R, N, 1);
        assert_matches(dt, "linear", M, N, K, X, K, 1, W, 1, K, 1.0f, C0, O, R, N, 1);
        free(X), free(W), free(Bv), free(O), free(C0), free(R);
        ts_tensor_free(x), ts_tensor_free(w), ts_tensor_free(bias), ts_tensor_free(o);
    }
}

/* ------------------------------------------------------------ backward */

/* The same tensor in float32 (exact upcast), requiring grad. */
static ts_tensor *upcast(ts_tensor *t)
{
    uint16_t *v = data_of(t);
    int64_t n = ts_tensor_numel(t);
    float *f = malloc((size_t)(n > 0 ? n : 1) * sizeof *f);
    for (int64_t i = 0; i < n; i++) f[i] = to_f32(ts_tensor_dtype(t), v[i]);
    ts_tensor *u;
    TH_OK(ts_tensor_from_data(TS_F32, ts_tensor_ndim(t), ts_tensor_shape(t), f, &u));
    TH_OK(ts_tensor_set_requires_grad(u, ts_tensor_requires_grad(t)));
    free(v);
    free(f);
    return u;
}

/* Asserts a half-precision gradient equals the float32 gradient rounded to
 * dt, within one ulp plus the reordering term (both are one product
 * accumulated in float32; k_sum terms, |terms| <= bound each). */
static void assert_grad(const char *what, ts_tensor *gh, ts_tensor *gf, int64_t k_sum, double bound)
{
    cr_assert_not_null(gh, "%s: no gradient", what);
    cr_assert_not_null(gf);
    ts_dtype dt = ts_tensor_dtype(gh);
    cr_assert_eq(ts_tensor_numel(gh), ts_tensor_numel(gf));
    uint16_t *h = data_of(gh);
    ts_tensor *fc;
    TH_OK(ts_contiguous(gf, &fc));
    const float *f = ts_tensor_data(fc);
    for (int64_t i = 0; i < ts_tensor_numel(gh); i++) {
        double want = to_f32(dt, from_f32(dt, f[i])), got = to_f32(dt, h[i]);
        double tol = ulp_of(dt, want) + 2.0 * (double)(k_sum + 1) * ldexp(1.0, -24) * (double)k_sum * bound;
        cr_assert(fabs(got - want) <= tol, "%s: element %lld = %.9g, f32 gradient rounded %.9g (tolerance %.3g)", what,
                  (long long)i, got, want, tol);
    }
    free(h);
    ts_tensor_free(fc);
}

Test(tensor_matmul_half, matmul_backward_matches_f32_backward_rounded)
{
    ts_dtype dts[2] = {TS_BF16, TS_F16};
    for (int d = 0; d < 2; d++) {
        ts_dtype dt = dts[d];
        int64_t sa[2] = {19, 27}, sb[2] = {27, 33}, sg[2] = {19, 33};
        ts_tensor *a = half_tensor(dt, 2, sa, 8, true), *b = half_tensor(dt, 2, sb, 9, true),
                  *g = half_tensor(dt, 2, sg, 10, false);
        ts_tensor *af = upcast(a), *bf = upcast(b), *gf = upcast(g), *o, *of;
        TH_OK(ts_matmul(a, b, &o));
        TH_OK(ts_backward(o, g, false));
        TH_OK(ts_matmul(af, bf, &of));
        TH_OK(ts_backward(of, gf, false));
        /* dA = G B^T sums over n = 33, dB = A^T G over m = 19; |terms| <= 1 */
        assert_grad("matmul dA", ts_tensor_grad(a), ts_tensor_grad(af), 33, 1.0);
        assert_grad("matmul dB", ts_tensor_grad(b), ts_tensor_grad(bf), 19, 1.0);
        cr_assert_eq(ts_tensor_dtype(ts_tensor_grad(a)), dt);
        ts_tensor *all[] = {a, b, g, af, bf, gf, o, of};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) ts_tensor_free(all[i]);
    }
}

Test(tensor_matmul_half, linear_backward_matches_f32_backward_rounded)
{
    ts_dtype dts[2] = {TS_BF16, TS_F16};
    for (int d = 0; d < 2; d++) {
        ts_dtype dt = dts[d];
        int64_t sx[3] = {3, 11, 24}, sw[2] = {17, 24}, sb[1] = {17}, sg[3] = {3, 11, 17};
        ts_tensor *x = half_tensor(dt, 3, sx, 11, true), *w = half_tensor(dt, 2, sw, 12, true),
                  *bias = half_tensor(dt, 1, sb, 14, true), *g = half_tensor(dt, 3, sg, 13, false);
        ts_tensor *xf = upcast(x), *wf = upcast(w), *bf = upcast(bias), *gf = upcast(g), *o, *of;
        TH_OK(ts_linear(x, w, bias, &o));
        TH_OK(ts_backward(o, g, false));
        TH_OK(ts_linear(xf, wf, bf, &of));
        TH_OK(ts_backward(of, gf, false));
        /* dX = G W sums over out = 17; dW = G^T X and d(bias) = sum of G's
         * rows over the 33 rows */
        assert_grad("linear dX", ts_tensor_grad(x), ts_tensor_grad(xf), 17, 1.0);
        assert_grad("linear dW", ts_tensor_grad(w), ts_tensor_grad(wf), 33, 1.0);
        assert_grad("linear dbias", ts_tensor_grad(bias), ts_tensor_grad(bf), 33, 1.0);
        ts_tensor_free(bias);
        ts_tensor_free(bf);
        ts_tensor *all[] = {x, w, g, xf, wf, gf, o, of};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) ts_tensor_free(all[i]);
    }
}
