/* tensor_kernels: the shared buffer kernels of tensor/kernels.h. Every
 * run-time conversion path against the scalar ts_f32_to_bf16 & co.
 * (tensor/half.c, itself checked against torch in test_half.c), bit for
 * bit: all 65536 bf16 / f16 patterns, every f32 high half with several low
 * halves (NaN payloads, infinities, subnormals, rounding ties), a sweep of
 * 2^24 f32 patterns, odd lengths and unaligned pointers. A path this CPU
 * does not run is reported as skipped. Then the reductions, divide, scale
 * and norms against plain loops written here. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tensor/kernels.h"
#include "tests/helpers.h"

static void skip_unless(ts__kpath p)
{
    if (!ts__kpath_supported(p)) cr_skip_test("skipped: this CPU (or OS) does not run the %s path", ts__kpath_name(p));
}

/* f32 inputs: every high half with low halves 0, 1, 0x7FFF, 0x8000,
 * 0x8001, 0xFFFF and one pseudo-random (ties and neighbours of bf16's
 * rounding; every exponent, NaN payloads, infinities and subnormals), then
 * 2^24 patterns stepping by 255 over the whole range (f16's rounding
 * bits), then runs of NaN / subnormal / normal mixtures. */
static float *f32_patterns(int64_t *n_out)
{
    static const uint32_t lows[] = {0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF};
    int64_t nl = (int64_t)(sizeof lows / sizeof lows[0]) + 1;
    int64_t n = 65536 * nl + (1 << 24) + 4096;
    float *v = malloc((size_t)n * sizeof *v);
    cr_assert_not_null(v);
    int64_t k = 0;
    uint32_t rng = 12345;
    for (uint32_t h = 0; h < 65536; h++) {
        for (int64_t j = 0; j < nl - 1; j++) v[k++] = th_f32_of(h << 16 | lows[j]);
        rng = rng * 1664525u + 1013904223u;
        v[k++] = th_f32_of(h << 16 | (rng >> 16));
    }
    for (uint32_t i = 0; i < (1u << 24); i++) v[k++] = th_f32_of(i * 255u + (i >> 8));
    for (int i = 0; i < 4096; i++) {
        rng = rng * 1664525u + 1013904223u;
        uint32_t u = rng;
        switch (i % 5) {
        case 0: u = 0x7F800001u | (u & 0x807FFFFFu); break; /* NaN (maybe signalling) */
        case 1: u &= 0x807FFFFFu; break;                    /* subnormal or zero */
        default: break;                                     /* anything */
        }
        v[k++] = th_f32_of(u);
    }
    cr_assert_eq(k, n);
    *n_out = n;
    return v;
}

/* Converts the patterns on path p and compares with ts_f32_to_bf16 /
 * ts_f32_to_f16 one by one. */
static void check_from_f32(ts__kpath p, ts_dtype dd)
{
    int64_t n;
    float *src = f32_patterns(&n);
    uint16_t *got = malloc((size_t)n * 2);
    cr_assert_not_null(got);
    ts__buf_convert_on(p, dd, got, TS_F32, src, n);
    for (int64_t i = 0; i < n; i++) {
        uint16_t want = dd == TS_BF16 ? ts_f32_to_bf16(src[i]) : ts_f32_to_f16(src[i]);
        if (got[i] != want)
            cr_assert_fail("%s path, f32 0x%08x -> %s: 0x%04x, scalar 0x%04x (index %lld)", ts__kpath_name(p),
                           th_f32_bits(src[i]), ts_dtype_name(dd), got[i], want, (long long)i);
    }
    free(got);
    free(src);
}

/* Every 16-bit pattern, twice over (so that the vector bodies see every
 * pattern in every lane position of an odd-length buffer). */
static void check_to_f32(ts__kpath p, ts_dtype sd)
{
    enum { N = 65536 * 2 + 13 };
    uint16_t *src = malloc(N * 2);
    float *got = malloc(N * sizeof *got);
    cr_assert(src && got);
    for (int i = 0; i < N; i++) src[i] = (uint16_t)(i < 65536 ? i : (i - 65536) * 7 + 3);
    ts__buf_convert_on(p, TS_F32, got, sd, src, N);
    for (int i = 0; i < N; i++) {
        float want = sd == TS_BF16 ? ts_bf16_to_f32(src[i]) : ts_f16_to_f32(src[i]);
        if (th_f32_bits(got[i]) != th_f32_bits(want))
            cr_assert_fail("%s path, %s 0x%04x -> f32: 0x%08x, scalar 0x%08x", ts__kpath_name(p), ts_dtype_name(sd),
                           src[i], th_f32_bits(got[i]), th_f32_bits(want));
    }
    free(got);
    free(src);
}

/* Lengths 0 to 100 at element offsets 0 to 3 from a 64-byte boundary,
 * with sentinels either side: the right values, nothing written outside. */
static void check_lengths(ts__kpath p)
{
    enum { MAXN = 100, PAD = 8 };
    _Alignas(64) float f[MAXN + 2 * PAD + 4];
    _Alignas(64) uint16_t h[MAXN + 2 * PAD + 4];
    _Alignas(64) float back[MAXN + 2 * PAD + 4];
    static const ts_dtype halves[2] = {TS_BF16, TS_F16};
    for (int hd = 0; hd < 2; hd++) {
        ts_dtype d = halves[hd];
        for (int off = 0; off < 4; off++) {
            for (int64_t n = 0; n <= MAXN; n++) {
                for (int i = 0; i < MAXN + 2 * PAD + 4; i++) {
                    /* some NaNs and subnormals among normals */
                    uint32_t u = (uint32_t)i * 2654435761u;
                    f[i] = i % 11 == 3 ? NAN
                        : i % 13 == 5  ? th_f32_of(u & 0x807FFFFFu)
                                       : th_f32_of(u % 0x7F000000u) - 1;
                    h[i] = 0xABCD;
                    back[i] = -7.0f;
                }
                float *fs = f + PAD + off;
                uint16_t *hs = h + PAD + off;
                float *bs = back + PAD + off;
                ts__buf_convert_on(p, d, hs, TS_F32, fs, n);
                ts__buf_convert_on(p, TS_F32, bs, d, hs, n);
                for (int i = 0; i < MAXN + 2 * PAD + 4; i++) {
                    int64_t j = i - PAD - off;
                    if (j >= 0 && j < n) {
                        uint16_t want = d == TS_BF16 ? ts_f32_to_bf16(fs[j]) : ts_f32_to_f16(fs[j]);
                        float wb = d == TS_BF16 ? ts_bf16_to_f32(want) : ts_f16_to_f32(want);
                        cr_assert_eq(hs[j], want, "%s %s n %lld offset %d element %lld", ts__kpath_name(p),
                                     ts_dtype_name(d), (long long)n, off, (long long)j);
                        cr_assert_eq(th_f32_bits(bs[j]), th_f32_bits(wb));
                    } else {
                        cr_assert_eq(h[i], 0xABCD, "%s wrote outside: n %lld offset %d index %d", ts__kpath_name(p),
                                     (long long)n, off, i);
                        cr_assert_eq(back[i], -7.0f);
                    }
                }
            }
        }
    }
}

static void check_path(ts__kpath p)
{
    skip_unless(p);
    check_from_f32(p, TS_BF16);
    check_from_f32(p, TS_F16);
    check_to_f32(p, TS_BF16);
    check_to_f32(p, TS_F16);
    check_lengths(p);
}

Test(tensor_kernels, convert_scalar_path) { check_path(TS__KPATH_SCALAR); }
Test(tensor_kernels, convert_avx2_path) { check_path(TS__KPATH_AVX2); }
Test(tensor_kernels, convert_avx512_path) { check_path(TS__KPATH_AVX512); }
Test(tensor_kernels, convert_avx512bf16_path) { check_path(TS__KPATH_AVX512BF16); }

/* The dispatching entry point follows the active path, and the test hook
 * caps it; conversions through other dtypes keep ts__store's results. */
Test(tensor_kernels, active_path_and_force)
{
    ts__kpath best = ts__kpath_active();
    cr_assert(ts__kpath_supported(best));
    ts__kpath_force(TS__KPATH_SCALAR);
    cr_assert_eq(ts__kpath_active(), TS__KPATH_SCALAR);
    float f[37];
    uint16_t a[37], b[37];
    for (int i = 0; i < 37; i++) f[i] = i % 5 == 0 ? NAN : (float)i * 0.3337f - 4;
    ts__buf_convert(TS_BF16, a, TS_F32, f, 37);
    ts__kpath_force(-1);
    cr_assert_eq(ts__kpath_active(), best);
    ts__buf_convert(TS_BF16, b, TS_F32, f, 37);
    cr_assert_eq(memcmp(a, b, sizeof a), 0);
    /* f64 -> bf16 goes through float (static_cast), i64 -> f16 too */
    double d[3] = {1.0 + 0x1p-9 + 0x1p-30, -3.5, 1e300};
    ts__buf_convert(TS_BF16, a, TS_F64, d, 3);
    for (int i = 0; i < 3; i++) cr_assert_eq(a[i], ts_f32_to_bf16((float)d[i]), "f64 %g", d[i]);
}

Test(tensor_kernels, env_names)
{
    cr_assert_eq(ts__kpath_parse(NULL, TS__KPATH_AVX512), TS__KPATH_AVX512);
    cr_assert_eq(ts__kpath_parse("", TS__KPATH_AVX2), TS__KPATH_AVX2);
    cr_assert_eq(ts__kpath_parse("scalar", TS__KPATH_AVX512BF16), TS__KPATH_SCALAR);
    cr_assert_eq(ts__kpath_parse("AVX2", TS__KPATH_AVX512BF16), TS__KPATH_AVX2);
    cr_assert_eq(ts__kpath_parse("avx512", TS__KPATH_AVX512BF16), TS__KPATH_AVX512);
    /* above what the CPU runs, or unknown: the best it runs */
    cr_assert_eq(ts__kpath_parse("avx512bf16", TS__KPATH_AVX2), TS__KPATH_AVX2);
    cr_assert_eq(ts__kpath_parse("sse9", TS__KPATH_AVX2), TS__KPATH_AVX2);
    cr_assert_str_eq(ts__kpath_name(TS__KPATH_AVX512BF16), "avx512bf16");
    cr_assert_null(ts__kpath_name(TS__KPATH_COUNT));
}

/* ------------------------------------------------------- reductions */

static float ref_op_f32(ts__buf_op op, float a, float b)
{
    switch (op) {
    case TS__BUF_SUM: return a + b;
    case TS__BUF_MAX: return isnan(b) ? b : isnan(a) ? a : b > a ? b : a;
    default: return isnan(b) ? b : isnan(a) ? a : b < a ? b : a;
    }
}

static double ref_op_f64(ts__buf_op op, double a, double b)
{
    switch (op) {
    case TS__BUF_SUM: return a + b;
    case TS__BUF_MAX: return isnan(b) ? b : isnan(a) ? a : b > a ? b : a;
    default: return isnan(b) ? b : isnan(a) ? a : b < a ? b : a;
    }
}

static float val(int i, int salt)
{
    uint32_t u = (uint32_t)(i * 7 + salt) * 2654435761u;
    if (i % 17 == salt % 17) return NAN;
    if (i % 23 == 4) return salt % 2 ? INFINITY : -INFINITY;
    return (float)((int32_t)u >> 8) * 0x1p-20f;
}

/* Every op and dtype, in place and out of place, on an odd length that
 * crosses the 16-bit chunking; 16-bit dtypes on every path. */
Test(tensor_kernels, reduce_matches_element_loops)
{
    enum { N = 2500 };
    static float fa[N], fb[N], fo[N];
    static double da[N], db[N], dout[N];
    static int64_t ia[N], ib[N], io[N];
    static uint16_t ha[N], hb[N], ho[N];
    for (int i = 0; i < N; i++) {
        fa[i] = val(i, 1);
        fb[i] = val(i, 2);
        da[i] = (double)fa[i] * 1.000000001;
        db[i] = (double)fb[i];
        ia[i] = i % 3 ? (int64_t)(fa[i] * 1e6f) : INT64_MAX - i;
        ib[i] = i % 2 ? (int64_t)(fb[i] * 1e6f) : INT64_MAX - 2 * i;
        if (isnan(fa[i]) || isinf(fa[i])) ia[i] = -i;
        if (isnan(fb[i]) || isinf(fb[i])) ib[i] = i * 3;
    }
    for (int op = 0; op < TS__BUF_OP_COUNT; op++) {
        ts__buf_reduce(TS_F32, (ts__buf_op)op, fo, fa, fb, N);
        ts__buf_reduce(TS_F64, (ts__buf_op)op, dout, da, db, N);
        ts__buf_reduce(TS_I64, (ts__buf_op)op, io, ia, ib, N);
        for (int i = 0; i < N; i++) {
            float wf = ref_op_f32((ts__buf_op)op, fa[i], fb[i]);
            double wd = ref_op_f64((ts__buf_op)op, da[i], db[i]);
            cr_assert(isnan(wf) ? isnan(fo[i]) : th_f32_bits(fo[i]) == th_f32_bits(wf), "f32 op %d at %d", op, i);
            cr_assert(isnan(wd) ? isnan(dout[i]) : memcmp(&dout[i], &wd, 8) == 0, "f64 op %d at %d", op, i);
            int64_t wi = op == TS__BUF_SUM ? (int64_t)((uint64_t)ia[i] + (uint64_t)ib[i])
                : op == TS__BUF_MAX        ? (ia[i] > ib[i] ? ia[i] : ib[i])
                                           : (ia[i] < ib[i] ? ia[i] : ib[i]);
            cr_assert_eq(io[i], wi, "i64 op %d at %d", op, i);
        }
        /* in place: out == a */
        memcpy(fo, fa, sizeof fa);
        ts__buf_reduce(TS_F32, (ts__buf_op)op, fo, fo, fb, N);
        for (int i = 0; i < N; i++) {
            float wf = ref_op_f32((ts__buf_op)op, fa[i], fb[i]);
            cr_assert(isnan(wf) ? isnan(fo[i]) : th_f32_bits(fo[i]) == th_f32_bits(wf));
        }
        static const ts_dtype halves[2] = {TS_BF16, TS_F16};
        for (int hd = 0; hd < 2; hd++) {
            ts_dtype d = halves[hd];
            for (int p = 0; p < TS__KPATH_COUNT; p++) {
                if (!ts__kpath_supported((ts__kpath)p)) continue;
                ts__kpath_force(p);
                ts__buf_convert_on(TS__KPATH_SCALAR, d, ha, TS_F32, fa, N);
                ts__buf_convert_on(TS__KPATH_SCALAR, d, hb, TS_F32, fb, N);
                memcpy(ho, ha, sizeof ha);
                if (op == TS__BUF_SUM) ts__buf_add(d, ho, hb, N);
                else ts__buf_reduce(d, (ts__buf_op)op, ho, ho, hb, N);
                for (int i = 0; i < N; i++) {
                    float x = d == TS_BF16 ? ts_bf16_to_f32(ha[i]) : ts_f16_to_f32(ha[i]);
                    float y = d == TS_BF16 ? ts_bf16_to_f32(hb[i]) : ts_f16_to_f32(hb[i]);
                    float r = ref_op_f32((ts__buf_op)op, x, y);
                    uint16_t w = d == TS_BF16 ? ts_f32_to_bf16(r) : ts_f32_to_f16(r);
                    cr_assert_eq(ho[i], w, "%s op %d path %s at %d", ts_dtype_name(d), op, ts__kpath_name((ts__kpath)p),
                                 i);
                }
                ts__kpath_force(-1);
            }
        }
    }
}

/* comm's divide factors and clipping's scale: the dtype's own division
 * or multiplication, with the factor rounded to the dtype first. */
Test(tensor_kernels, div_and_scale)
{
    enum { N = 1501 };
    static float f[N], f2[N];
    static double d[N], d2[N];
    static int64_t iv[N], iv2[N];
    static uint16_t h[N], h2[N];
    const double div = 3.0000001, c = 0.1;
    for (int i = 0; i < N; i++) {
        f[i] = f2[i] = val(i, 5);
        d[i] = d2[i] = (double)val(i, 6) / 3;
        iv[i] = iv2[i] = (int64_t)i * 1000003 - 700000000;
    }
    ts__buf_div(TS_F32, f2, N, div);
    ts__buf_div(TS_F64, d2, N, div);
    ts__buf_div(TS_I64, iv2, N, div);
    for (int i = 0; i < N; i++) {
        float wf = f[i] / (float)div;
        double wd = d[i] / div;
        cr_assert(isnan(wf) ? isnan(f2[i]) : th_f32_bits(f2[i]) == th_f32_bits(wf));
        cr_assert(isnan(wd) ? isnan(d2[i]) : d2[i] == wd);
        cr_assert_eq(iv2[i], (int64_t)((double)iv[i] / div));
    }
    memcpy(f2, f, sizeof f);
    ts__buf_div(TS_F32, f2, N, 1.0);
    cr_assert_eq(memcmp(f, f2, sizeof f), 0, "divide by 1 changes nothing");
    memcpy(f2, f, sizeof f);
    memcpy(d2, d, sizeof d);
    ts__buf_scale(TS_F32, f2, N, c);
    ts__buf_scale(TS_F64, d2, N, c);
    for (int i = 0; i < N; i++) {
        float wf = f[i] * (float)c;
        cr_assert(isnan(wf) ? isnan(f2[i]) : th_f32_bits(f2[i]) == th_f32_bits(wf));
        cr_assert(isnan(d[i]) ? isnan(d2[i]) : d2[i] == d[i] * c);
    }
    static const ts_dtype halves[2] = {TS_BF16, TS_F16};
    for (int hd = 0; hd < 2; hd++) {
        ts_dtype t = halves[hd];
        for (int mul = 0; mul < 2; mul++) {
            ts__buf_convert(t, h, TS_F32, f, N);
            memcpy(h2, h, sizeof h);
            if (mul) ts__buf_scale(t, h2, N, c);
            else ts__buf_div(t, h2, N, div);
            for (int i = 0; i < N; i++) {
                float x = t == TS_BF16 ? ts_bf16_to_f32(h[i]) : ts_f16_to_f32(h[i]);
                float r = mul ? x * (float)c : x / (float)div;
                uint16_t w = t == TS_BF16 ? ts_f32_to_bf16(r) : ts_f32_to_f16(r);
                cr_assert_eq(h2[i], w, "%s %s at %d", ts_dtype_name(t), mul ? "scale" : "div", i);
            }
        }
    }
}

/* ------------------------------------------------------------- norms */

/* Every path gives the scalar reference's bits, for every length up to
 * 200 (all tails) and a long odd one; the values of optim's torch
 * fixtures are checked in tests/optim (Test(optim_clip, norms_of_every_size)). */
Test(tensor_kernels, norms_agree_across_paths)
{
    enum { N = 10007 };
    static float x[N];
    static double y[N];
    for (int i = 0; i < N; i++) {
        x[i] = (float)((int)((uint32_t)i * 2654435761u >> 12) - (1 << 19)) * 0x1p-17f;
        y[i] = (double)x[i] * 1.0000001;
    }
    int npaths = 0;
    for (int p = 0; p < TS__KPATH_COUNT; p++) {
        if (!ts__kpath_supported((ts__kpath)p)) continue;
        npaths++;
        for (int64_t n = 0; n <= 200 || n == N; n = n == 200 ? N : n + 1) {
            float a = ts__buf_norm2_f32_on((ts__kpath)p, x, n);
            float r = ts__buf_norm2_f32_on(TS__KPATH_SCALAR, x, n);
            cr_assert_eq(th_f32_bits(a), th_f32_bits(r), "%s norm of %lld f32", ts__kpath_name((ts__kpath)p),
                         (long long)n);
            double b = ts__buf_norm2_f64_on((ts__kpath)p, y, n);
            double s = ts__buf_norm2_f64_on(TS__KPATH_SCALAR, y, n);
            cr_assert_eq(b, s, "%s norm of %lld f64", ts__kpath_name((ts__kpath)p), (long long)n);
            if (n == N) break;
        }
    }
    /* the reference is torch's order, not a plain sum: a sequential f32
     * sum of the squares of these values gives different bits */
    float seq = 0;
    for (int i = 0; i < N; i++) seq = fmaf(x[i], x[i], seq);
    cr_assert_neq(th_f32_bits(sqrtf(seq)), th_f32_bits(ts__buf_norm2_f32(x, N)));
    cr_assert_geq(npaths, 1);
    cr_assert_eq(ts__buf_norm2_f32(x, 0), 0.0f);
}
