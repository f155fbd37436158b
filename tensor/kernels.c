/* Per-dtype buffer kernels (see tensor/kernels.h, which says what each
 * computes and how the run-time paths are chosen). */
#include "tensor/kernels.h"
#include "tensor/blis_arch.h"
#include "tensor/internal.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define K_X86 1
#define K_AVX2 __attribute__((target("avx2,fma,f16c")))
#define K_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))
#define K_AVX512BF16 __attribute__((target("avx512bf16,avx512bw,avx512f,avx2,fma,f16c")))
#else
#define K_X86 0
#endif

/* ------------------------------------------------------------ paths */

static const char *const k_path_names[TS__KPATH_COUNT] = {"scalar", "avx2", "avx512", "avx512bf16"};
_Static_assert(TS__KPATH_COUNT == 4, "one name per kernel path");

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static ts__kpath g_best; /* the best path the CPU runs */
static ts__kpath g_env;  /* TS_KERNELS's cap (g_best without it) */
static atomic_int g_force = -1;

const char *ts__kpath_name(ts__kpath p) { return (unsigned)p < TS__KPATH_COUNT ? k_path_names[p] : NULL; }

static void paths_init(void)
{
    ts__cpu_info c;
    ts__cpu_info_query(&c);
    g_best = TS__KPATH_SCALAR;
    if (c.avx2 && c.fma3 && c.f16c && c.os_ymm) {
        g_best = TS__KPATH_AVX2;
        if (c.avx512f && c.os_zmm) {
            g_best = TS__KPATH_AVX512;
            if (c.avx512bf16 && c.avx512bw) g_best = TS__KPATH_AVX512BF16;
        }
    }
#if !K_X86
    g_best = TS__KPATH_SCALAR;
#endif
    g_env = ts__kpath_parse(getenv("TS_KERNELS"), g_best);
}

ts__kpath ts__kpath_parse(const char *value, ts__kpath best)
{
    if (!value || !*value) return best;
    for (int p = 0; p < TS__KPATH_COUNT; p++) {
        if (strcasecmp(value, k_path_names[p]) != 0) continue;
        if ((ts__kpath)p <= best) return (ts__kpath)p;
        ts_logf(TS_LOG_WARN, "TS_KERNELS=%s: this CPU does not run it; using '%s'", value, k_path_names[best]);
        return best;
    }
    ts_logf(TS_LOG_WARN, "TS_KERNELS=%s is not one of scalar, avx2, avx512, avx512bf16 (in any case); using '%s'",
            value, k_path_names[best]);
    return best;
}

bool ts__kpath_supported(ts__kpath p)
{
    pthread_once(&g_once, paths_init);
    return (unsigned)p < TS__KPATH_COUNT && p <= g_best;
}

ts__kpath ts__kpath_active(void)
{
    pthread_once(&g_once, paths_init);
    int f = atomic_load_explicit(&g_force, memory_order_relaxed);
    ts__kpath p = g_env;
    if (f >= 0 && f < (int)p) p = (ts__kpath)f;
    return p;
}

void ts__kpath_force(int p) { atomic_store_explicit(&g_force, p, memory_order_relaxed); }

/* ------------------------------------------ f32 <-> bf16 / f16, scalar */

static void bf16_from_f32_scalar(uint16_t *d, const float *s, int64_t n)
{
    for (int64_t i = 0; i < n; i++) d[i] = ts__f32_to_bf16(s[i]);
}

static void bf16_to_f32_scalar(float *d, const uint16_t *s, int64_t n)
{
    for (int64_t i = 0; i < n; i++) d[i] = ts__bf16_to_f32(s[i]);
}

static void f16_from_f32_scalar(uint16_t *d, const float *s, int64_t n)
{
    for (int64_t i = 0; i < n; i++) d[i] = ts_f32_to_f16(s[i]);
}

static void f16_to_f32_scalar(float *d, const uint16_t *s, int64_t n)
{
    for (int64_t i = 0; i < n; i++) d[i] = ts_f16_to_f32(s[i]);
}

/* ------------------------------------------------------- AVX2 + F16C */

#if K_X86
/* bf16 = (u + 0x7FFF + ((u >> 16) & 1)) >> 16 in 32-bit lanes (no lane
 * overflows: a non-NaN u is at most 0xFF800000); NaN lanes, found by
 * |u| > 0x7F800000, are redone by the scalar code. */
K_AVX2 static void bf16_from_f32_avx2(uint16_t *d, const float *s, int64_t n)
{
    const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF), inf = _mm256_set1_epi32(0x7F800000);
    const __m256i bias = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i u0 = _mm256_loadu_si256((const __m256i *)(s + i));
        __m256i u1 = _mm256_loadu_si256((const __m256i *)(s + i + 8));
        __m256i r0 = _mm256_add_epi32(u0, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(u0, 16), one)));
        __m256i r1 = _mm256_add_epi32(u1, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(u1, 16), one)));
        r0 = _mm256_srli_epi32(r0, 16);
        r1 = _mm256_srli_epi32(r1, 16);
        /* packus works per 128-bit lane: reorder the 64-bit quarters */
        __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(r0, r1), 0xD8);
        _mm256_storeu_si256((__m256i *)(d + i), p);
        __m256i nan0 = _mm256_cmpgt_epi32(_mm256_and_si256(u0, abs_mask), inf);
        __m256i nan1 = _mm256_cmpgt_epi32(_mm256_and_si256(u1, abs_mask), inf);
        if (!_mm256_testz_si256(_mm256_or_si256(nan0, nan1), _mm256_or_si256(nan0, nan1)))
            bf16_from_f32_scalar(d + i, s + i, 16);
    }
    bf16_from_f32_scalar(d + i, s + i, n - i);
}

K_AVX2 static void bf16_to_f32_avx2(float *d, const uint16_t *s, int64_t n)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + i)));
        _mm256_storeu_si256((__m256i *)(d + i), _mm256_slli_epi32(v, 16));
    }
    bf16_to_f32_scalar(d + i, s + i, n - i);
}

/* vcvtps2ph rounding to nearest even; its NaN (payload truncated) is
 * replaced by ours (sign | 0x7E00) through the scalar code. */
K_AVX2 static void f16_from_f32_avx2(uint16_t *d, const float *s, int64_t n)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(s + i);
        _mm_storeu_si128((__m128i *)(d + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))) f16_from_f32_scalar(d + i, s + i, 8);
    }
    f16_from_f32_scalar(d + i, s + i, n - i);
}

/* vcvtph2ps is exact, and like ours makes a NaN quiet keeping its sign
 * and payload (every pattern is tested). */
K_AVX2 static void f16_to_f32_avx2(float *d, const uint16_t *s, int64_t n)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
    f16_to_f32_scalar(d + i, s + i, n - i);
}

/* ---------------------------------------------------------- AVX-512F */

K_AVX512 static void bf16_from_f32_avx512(uint16_t *d, const float *s, int64_t n)
{
    const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF), inf = _mm512_set1_epi32(0x7F800000);
    const __m512i bias = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i u = _mm512_loadu_si512((const void *)(s + i));
        __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
        _mm256_storeu_si256((__m256i *)(d + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
        if (_mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs_mask), inf)) bf16_from_f32_scalar(d + i, s + i, 16);
    }
    bf16_from_f32_scalar(d + i, s + i, n - i);
}

K_AVX512 static void bf16_to_f32_avx512(float *d, const uint16_t *s, int64_t n)
{
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(s + i)));
        _mm512_storeu_si512((void *)(d + i), _mm512_slli_epi32(v, 16));
    }
    bf16_to_f32_scalar(d + i, s + i, n - i);
}

K_AVX512 static void f16_from_f32_avx512(uint16_t *d, const float *s, int64_t n)
{
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(s + i);
        _mm256_storeu_si256((__m256i *)(d + i), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        if (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) f16_from_f32_scalar(d + i, s + i, 16);
    }
    f16_from_f32_scalar(d + i, s + i, n - i);
}

K_AVX512 static void f16_to_f32_avx512(float *d, const uint16_t *s, int64_t n)
{
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(d + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + i))));
    f16_to_f32_scalar(d + i, s + i, n - i);
}

/* -------------------------------------------------------- AVX512-BF16 */

/* vcvtne2ps2bf16 rounds to nearest even like ours, but makes a NaN quiet
 * keeping its payload (ours: 0x7FC0) and treats f32 subnormal inputs as
 * zero (ours rounds them, to a bf16 subnormal or zero): blocks with such
 * lanes (|u| > 0x7F800000, or 0 < |u| < 0x00800000) are redone by the
 * scalar code. */
K_AVX512BF16 static __mmask16 bf16_special(__m512i u)
{
    const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
    __m512i a = _mm512_and_si512(u, abs_mask);
    __mmask16 nan = _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7F800000));
    __mmask16 sub = _mm512_cmplt_epu32_mask(_mm512_sub_epi32(a, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7FFFFF));
    return nan | sub;
}

K_AVX512BF16 static void bf16_from_f32_avx512bf16(uint16_t *d, const float *s, int64_t n)
{
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m512 lo = _mm512_loadu_ps(s + i), hi = _mm512_loadu_ps(s + i + 16);
        __m512bh r = _mm512_cvtne2ps_pbh(hi, lo); /* the first operand gives the upper half */
        _mm512_storeu_si512((void *)(d + i), (__m512i)r);
        if (bf16_special(_mm512_castps_si512(lo)) | bf16_special(_mm512_castps_si512(hi)))
            bf16_from_f32_scalar(d + i, s + i, 32);
    }
    bf16_from_f32_avx512(d + i, s + i, n - i);
}
#endif

/* ------------------------------------------------ conversion dispatch */

static void bf16_from_f32(ts__kpath p, uint16_t *d, const float *s, int64_t n)
{
    switch (p) {
#if K_X86
    case TS__KPATH_AVX512BF16: bf16_from_f32_avx512bf16(d, s, n); return;
    case TS__KPATH_AVX512: bf16_from_f32_avx512(d, s, n); return;
    case TS__KPATH_AVX2: bf16_from_f32_avx2(d, s, n); return;
#endif
    default: bf16_from_f32_scalar(d, s, n); return;
    }
}

static void bf16_to_f32(ts__kpath p, float *d, const uint16_t *s, int64_t n)
{
    switch (p) {
#if K_X86
    case TS__KPATH_AVX512BF16:
    case TS__KPATH_AVX512: bf16_to_f32_avx512(d, s, n); return;
    case TS__KPATH_AVX2: bf16_to_f32_avx2(d, s, n); return;
#endif
    default: bf16_to_f32_scalar(d, s, n); return;
    }
}

static void f16_from_f32(ts__kpath p, uint16_t *d, const float *s, int64_t n)
{
    switch (p) {
#if K_X86
    case TS__KPATH_AVX512BF16:
    case TS__KPATH_AVX512: f16_from_f32_avx512(d, s, n); return;
    case TS__KPATH_AVX2: f16_from_f32_avx2(d, s, n); return;
#endif
    default: f16_from_f32_scalar(d, s, n); return;
    }
}

static void f16_to_f32(ts__kpath p, float *d, const uint16_t *s, int64_t n)
{
    switch (p) {
#if K_X86
    case TS__KPATH_AVX512BF16:
    case TS__KPATH_AVX512: f16_to_f32_avx512(d, s, n); return;
    case TS__KPATH_AVX2: f16_to_f32_avx2(d, s, n); return;
#endif
    default: f16_to_f32_scalar(d, s, n); return;
    }
}

void ts__buf_convert_on(ts__kpath p, ts_dtype dd, void *dst, ts_dtype sd, const void *src, int64_t n)
{
    if (n <= 0) return;
    TS_ASSERT(ts__kpath_supported(p));
    if (dd == sd) {
        memmove(dst, src, (size_t)n * ts_dtype_size(dd));
        return;
    }
    if (dd == TS_F32 && sd == TS_BF16) bf16_to_f32(p, dst, src, n);
    else if (dd == TS_F32 && sd == TS_F16) f16_to_f32(p, dst, src, n);
    else if (sd == TS_F32 && dd == TS_BF16) bf16_from_f32(p, dst, src, n);
    else if (sd == TS_F32 && dd == TS_F16) f16_from_f32(p, dst, src, n);
    else
        for (int64_t i = 0; i < n; i++) ts__store(dd, dst, i, ts__load(sd, src, i));
}

void ts__buf_convert(ts_dtype dd, void *dst, ts_dtype sd, const void *src, int64_t n)
{
    ts__buf_convert_on(ts__kpath_active(), dd, dst, sd, src, n);
}

/* -------------------------------------------------------- reductions */

/* The f32 and f64 loops are plain C that GCC vectorises at -O3 (this
 * file is compiled with -ffp-contract=off and -fno-trapping-math). */
static void reduce_f32(ts__buf_op op, float *o, const float *a, const float *b, int64_t n)
{
    switch (op) {
    case TS__BUF_SUM:
        for (int64_t i = 0; i < n; i++) o[i] = a[i] + b[i];
        return;
    case TS__BUF_MAX:
        for (int64_t i = 0; i < n; i++) o[i] = b[i] > a[i] || isnan(b[i]) ? b[i] : a[i];
        return;
    case TS__BUF_MIN:
        for (int64_t i = 0; i < n; i++) o[i] = b[i] < a[i] || isnan(b[i]) ? b[i] : a[i];
        return;
    default: TS_ASSERT(0);
    }
}

static void reduce_f64(ts__buf_op op, double *o, const double *a, const double *b, int64_t n)
{
    switch (op) {
    case TS__BUF_SUM:
        for (int64_t i = 0; i < n; i++) o[i] = a[i] + b[i];
        return;
    case TS__BUF_MAX:
        for (int64_t i = 0; i < n; i++) o[i] = b[i] > a[i] || isnan(b[i]) ? b[i] : a[i];
        return;
    case TS__BUF_MIN:
        for (int64_t i = 0; i < n; i++) o[i] = b[i] < a[i] || isnan(b[i]) ? b[i] : a[i];
        return;
    default: TS_ASSERT(0);
    }
}

static void reduce_i64(ts__buf_op op, int64_t *o, const int64_t *a, const int64_t *b, int64_t n)
{
    switch (op) {
    case TS__BUF_SUM:
        for (int64_t i = 0; i < n; i++) o[i] = (int64_t)((uint64_t)a[i] + (uint64_t)b[i]);
        return;
    case TS__BUF_MAX:
        for (int64_t i = 0; i < n; i++) o[i] = b[i] > a[i] ? b[i] : a[i];
        return;
    case TS__BUF_MIN:
        for (int64_t i = 0; i < n; i++) o[i] = b[i] < a[i] ? b[i] : a[i];
        return;
    default: TS_ASSERT(0);
    }
}

#define K_CHUNK 1024 /* 16-bit elements taken through f32 at a time (stack) */

void ts__buf_reduce(ts_dtype d, ts__buf_op op, void *out, const void *a, const void *b, int64_t n)
{
    if (n <= 0) return;
    switch (d) {
    case TS_F32: reduce_f32(op, out, a, b, n); return;
    case TS_F64: reduce_f64(op, out, a, b, n); return;
    case TS_I64: reduce_i64(op, out, a, b, n); return;
    case TS_BF16:
    case TS_F16: {
        ts__kpath p = ts__kpath_active();
        _Alignas(64) float fa[K_CHUNK], fb[K_CHUNK];
        const uint16_t *ha = a, *hb = b;
        uint16_t *ho = out;
        for (int64_t i = 0; i < n; i += K_CHUNK) {
            int64_t k = n - i < K_CHUNK ? n - i : K_CHUNK;
            ts__buf_convert_on(p, TS_F32, fa, d, ha + i, k);
            ts__buf_convert_on(p, TS_F32, fb, d, hb + i, k);
            reduce_f32(op, fa, fa, fb, k);
            ts__buf_convert_on(p, d, ho + i, TS_F32, fa, k);
        }
        return;
    }
    default: TS_ASSERT(0);
    }
}

void ts__buf_add(ts_dtype d, void *dst, const void *src, int64_t n)
{
    ts__buf_reduce(d, TS__BUF_SUM, dst, dst, src, n);
}

/* x[i] = x[i] / div (mul false) or x[i] * c (mul true) for the 16-bit
 * dtypes, through f32 with one rounding. */
static void half_div_or_mul(ts_dtype d, uint16_t *x, int64_t n, float c, bool mul)
{
    ts__kpath p = ts__kpath_active();
    _Alignas(64) float f[K_CHUNK];
    for (int64_t i = 0; i < n; i += K_CHUNK) {
        int64_t k = n - i < K_CHUNK ? n - i : K_CHUNK;
        ts__buf_convert_on(p, TS_F32, f, d, x + i, k);
        if (mul)
            for (int64_t j = 0; j < k; j++) f[j] = f[j] * c;
        else
            for (int64_t j = 0; j < k; j++) f[j] = f[j] / c;
        ts__buf_convert_on(p, d, x + i, TS_F32, f, k);
    }
}

void ts__buf_div(ts_dtype d, void *x, int64_t n, double div)
{
    if (n <= 0 || div == 1.0) return;
    switch (d) {
    case TS_F32: {
        float *v = x;
        const float f = (float)div;
        for (int64_t i = 0; i < n; i++) v[i] = v[i] / f;
        return;
    }
    case TS_F64: {
        double *v = x;
        for (int64_t i = 0; i < n; i++) v[i] = v[i] / div;
        return;
    }
    case TS_I64: {
        int64_t *v = x;
        for (int64_t i = 0; i < n; i++) v[i] = (int64_t)((double)v[i] / div);
        return;
    }
    case TS_BF16:
    case TS_F16: half_div_or_mul(d, x, n, (float)div, false); return;
    default: TS_ASSERT(0);
    }
}

void ts__buf_scale(ts_dtype d, void *x, int64_t n, double c)
{
    if (n <= 0) return;
    switch (d) {
    case TS_F32: {
        float *v = x;
        const float f = (float)c;
        for (int64_t i = 0; i < n; i++) v[i] = v[i] * f;
        return;
    }
    case TS_F64: {
        double *v = x;
        for (int64_t i = 0; i < n; i++) v[i] = v[i] * c;
        return;
    }
    case TS_BF16:
    case TS_F16: half_div_or_mul(d, x, n, (float)c, true); return;
    default: TS_ASSERT(0);
    }
}

/* ------------------------------------------------------------- norms */

/* The scalar reference (fmaf / fma from libm). */
static inline __attribute__((always_inline)) float norm2_body_f32(const float *x, int64_t n)
{
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t d = 0, m = n - n % 8, v4 = m + (n - m) / 4 * 4;
    for (; d < m; d += 8)
        for (int l = 0; l < 8; l++) acc[l] = fmaf(x[d + l], x[d + l], acc[l]);
    float b = acc[0];
    for (int l = 1; l < 8; l++) b = b + acc[l];
    for (; d < v4; d++) b = b + x[d] * x[d];
    for (; d < n; d++) b = fmaf(x[d], x[d], b);
    return sqrtf(b);
}

static inline __attribute__((always_inline)) double norm2_body_f64(const double *x, int64_t n)
{
    double b = 0;
    for (int64_t d = 0; d < n; d++) b = fma(x[d], x[d], b);
    return sqrt(b);
}

static float norm2_f32_scalar(const float *x, int64_t n) { return norm2_body_f32(x, n); }
static double norm2_f64_scalar(const double *x, int64_t n) { return norm2_body_f64(x, n); }

#if K_X86
/* The same 8 lanes in one AVX register; the lane sum and tail as above. */
K_AVX2 static float norm2_f32_avx2(const float *x, int64_t n)
{
    int64_t m = n - n % 8;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < m; d += 8) {
        __m256 v = _mm256_loadu_ps(x + d);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    float b = lanes[0];
    for (int l = 1; l < 8; l++) b = b + lanes[l];
    int64_t d = m, v4 = m + (n - m) / 4 * 4;
    for (; d < v4; d++) b = b + x[d] * x[d];
    for (; d < n; d++) b = fmaf(x[d], x[d], b);
    return sqrtf(b);
}

/* The body with fma inlined as the instruction. */
K_AVX2 static double norm2_f64_avx2(const double *x, int64_t n) { return norm2_body_f64(x, n); }
#endif

float ts__buf_norm2_f32_on(ts__kpath p, const float *x, int64_t n)
{
    TS_ASSERT(ts__kpath_supported(p));
#if K_X86
    if (p >= TS__KPATH_AVX2) return norm2_f32_avx2(x, n);
#endif
    return norm2_f32_scalar(x, n);
}

double ts__buf_norm2_f64_on(ts__kpath p, const double *x, int64_t n)
{
    TS_ASSERT(ts__kpath_supported(p));
#if K_X86
    if (p >= TS__KPATH_AVX2) return norm2_f64_avx2(x, n);
#endif
    return norm2_f64_scalar(x, n);
}

float ts__buf_norm2_f32(const float *x, int64_t n) { return ts__buf_norm2_f32_on(ts__kpath_active(), x, n); }
