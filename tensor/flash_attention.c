/* Fused float32 attention, forward and backward (see
 * tensor/flash_attention.h for the algorithm, the paths and the limits). */
#define _GNU_SOURCE
#include "tensor/flash_attention.h"
#include "tensor/fastmath.h"
#include "tensor/internal.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define F_X86 1
#define F_AVX2 __attribute__((target("avx2,fma")))
#define F_AVX512 __attribute__((target("avx512f,avx2,fma")))
#else
#define F_X86 0
#endif
#define F_INLINE inline __attribute__((always_inline))

enum { BR = TS__FLASH_BR, BC = TS__FLASH_BC };

/* What a block pair of the mask is. */
enum { BLK_OPEN = 0, BLK_MIXED = 1, BLK_SKIP = 2 };

/* The operations a path provides:
 * mm: C (m x n, row stride rsc) = [C +] A B, A (m x K) read as
 *     A[i * rsa + k * csa] (any strides: broadcast), B (K x n) with row
 *     stride rsb and unit column stride;
 * softmax_rows: the online-softmax step on a br x bc score tile (row
 *     stride BC, masked scores already -inf): s = scale * S, the new row
 *     maximum mn = max(m, max s), P = exp(s - mn) in place, l = l *
 *     exp(m - mn) + sum P, alpha = exp(m - mn) (1 and P = 0 for a row
 *     still wholly masked);
 * probs_rows: the backward's P = exp(scale * S - lse) in place;
 * transpose: xt (hd, S) = x (S, hd) (row stride rs) transposed;
 * mask_tile: the br x bc scores (row stride BC) to -inf where the mask
 *     bytes (row stride S) are nonzero. */
typedef struct kops {
    void (*mm)(int64_t m, int64_t n, int64_t K, const float *A, int64_t rsa, int64_t csa, const float *B, int64_t rsb,
               float *C, int64_t rsc, bool acc);
    void (*softmax_rows)(float *S, int br, int bc, float scale, float *m, float *l, float *alpha);
    void (*probs_rows)(float *S, int br, int bc, float scale, const float *lse);
    void (*transpose)(float *xt, const float *x, int64_t rs, int64_t S, int64_t hd);
    void (*mask_tile)(float *St, int br, int bc, const uint8_t *mk, int64_t S);
} kops;

/* ------------------------------------------------------------- scalar */

static void mm_scalar(int64_t m, int64_t n, int64_t K, const float *A, int64_t rsa, int64_t csa, const float *B,
                      int64_t rsb, float *C, int64_t rsc, bool acc)
{
    for (int64_t i = 0; i < m; i++) {
        float *c = C + i * rsc;
        if (!acc)
            for (int64_t j = 0; j < n; j++) c[j] = 0.0f;
        for (int64_t k = 0; k < K; k++) {
            float a = A[i * rsa + k * csa];
            const float *b = B + k * rsb;
            for (int64_t j = 0; j < n; j++) c[j] += a * b[j];
        }
    }
}

static void softmax_rows_scalar(float *S, int br, int bc, float scale, float *m, float *l, float *alpha)
{
    for (int i = 0; i < br; i++) {
        float *r = S + i * BC, mx = m[i];
        for (int j = 0; j < bc; j++) {
            r[j] *= scale;
            mx = r[j] > mx ? r[j] : mx;
        }
        if (mx == -INFINITY) {
            for (int j = 0; j < bc; j++) r[j] = 0.0f;
            alpha[i] = 1.0f;
            continue;
        }
        float sum = 0.0f;
        for (int j = 0; j < bc; j++) {
            r[j] = ts__exp_f32(r[j] - mx);
            sum += r[j];
        }
        alpha[i] = ts__exp_f32(m[i] - mx);
        l[i] = l[i] * alpha[i] + sum;
        m[i] = mx;
    }
}

static void probs_rows_scalar(float *S, int br, int bc, float scale, const float *lse)
{
    for (int i = 0; i < br; i++)
        for (int j = 0; j < bc; j++) S[i * BC + j] = ts__exp_f32(S[i * BC + j] * scale - lse[i]);
}

static void transpose_scalar(float *xt, const float *x, int64_t rs, int64_t S, int64_t hd)
{
    for (int64_t s0 = 0; s0 < S; s0 += 8) {
        int64_t s1 = s0 + 8 < S ? s0 + 8 : S;
        for (int64_t d = 0; d < hd; d++)
            for (int64_t s = s0; s < s1; s++) xt[d * S + s] = x[s * rs + d];
    }
}

static void mask_tile_scalar(float *St, int br, int bc, const uint8_t *mk, int64_t S)
{
    for (int i = 0; i < br; i++)
        for (int j = 0; j < bc; j++) St[i * BC + j] = mk[i * S + j] ? -INFINITY : St[i * BC + j];
}

static const kops k_scalar = {mm_scalar, softmax_rows_scalar, probs_rows_scalar, transpose_scalar, mask_tile_scalar};

#if F_X86
/* ---------------------------------------------------------- AVX-512F */

/* ts__exp_f32 in 16 lanes, the same operations in the same order (no
 * fused multiply-adds), so each lane has the scalar function's bits. */
F_AVX512 static F_INLINE __m512 exp512(__m512 x)
{
    const __m512 lo = _mm512_set1_ps(-87.3f), hi = _mm512_set1_ps(88.7f), shift = _mm512_set1_ps(12582912.0f);
    __m512 xc = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
    __m512 t = _mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f));
    __m512 fn = _mm512_sub_ps(_mm512_add_ps(t, shift), shift);
    __m512i n = _mm512_cvttps_epi32(fn);
    __m512 r = _mm512_sub_ps(xc, _mm512_mul_ps(fn, _mm512_set1_ps(0.693359375f)));
    r = _mm512_sub_ps(r, _mm512_mul_ps(fn, _mm512_set1_ps(-2.12194440e-4f)));
    __m512 r2 = _mm512_mul_ps(r, r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
    __m512 y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, r2), r), _mm512_set1_ps(1.0f));
    __m512 sc = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23));
    __m512 out = _mm512_mul_ps(y, sc);
    out = _mm512_mask_mov_ps(out, _mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ), _mm512_set1_ps(INFINITY));
    out = _mm512_mask_mov_ps(out, _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), _mm512_setzero_ps());
    return _mm512_mask_mov_ps(out, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
}

/* One register tile: mr rows (<= 6) by nv vectors of 16 columns (<= 4),
 * the last vector's lanes by `last`. Called with constant mr and nv, so
 * the accumulators stay in registers. */
F_AVX512 static F_INLINE void tile512(const int mr, const int nv, __mmask16 last, int64_t K, const float *A,
                                      int64_t rsa, int64_t csa, const float *B, int64_t rsb, float *C, int64_t rsc,
                                      bool acc)
{
    __m512 c[6][4];
#pragma GCC unroll 6
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
        for (int j = 0; j < nv; j++)
            c[i][j] =
                acc ? _mm512_maskz_loadu_ps(j == nv - 1 ? last : 0xFFFF, C + i * rsc + 16 * j) : _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const float *b = B + k * rsb, *a = A + k * csa;
        __m512 bv[4];
#pragma GCC unroll 4
        for (int j = 0; j < nv; j++) bv[j] = _mm512_maskz_loadu_ps(j == nv - 1 ? last : 0xFFFF, b + 16 * j);
#pragma GCC unroll 6
        for (int i = 0; i < mr; i++) {
            __m512 av = _mm512_set1_ps(a[i * rsa]);
#pragma GCC unroll 4
            for (int j = 0; j < nv; j++) c[i][j] = _mm512_fmadd_ps(av, bv[j], c[i][j]);
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
        for (int j = 0; j < nv; j++) _mm512_mask_storeu_ps(C + i * rsc + 16 * j, j == nv - 1 ? last : 0xFFFF, c[i][j]);
}

F_AVX512 static F_INLINE void tile512_rows(int mr, const int nv, __mmask16 last, int64_t K, const float *A, int64_t rsa,
                                           int64_t csa, const float *B, int64_t rsb, float *C, int64_t rsc, bool acc)
{
    switch (mr) {
    case 1: tile512(1, nv, last, K, A, rsa, csa, B, rsb, C, rsc, acc); break;
    case 2: tile512(2, nv, last, K, A, rsa, csa, B, rsb, C, rsc, acc); break;
    case 3: tile512(3, nv, last, K, A, rsa, csa, B, rsb, C, rsc, acc); break;
    case 4: tile512(4, nv, last, K, A, rsa, csa, B, rsb, C, rsc, acc); break;
    case 5: tile512(5, nv, last, K, A, rsa, csa, B, rsb, C, rsc, acc); break;
    default: tile512(6, nv, last, K, A, rsa, csa, B, rsb, C, rsc, acc); break;
    }
}

F_AVX512 static void mm_avx512(int64_t m, int64_t n, int64_t K, const float *A, int64_t rsa, int64_t csa,
                               const float *B, int64_t rsb, float *C, int64_t rsc, bool acc)
{
    for (int64_t n0 = 0; n0 < n; n0 += 64) {
        int64_t nn = n - n0 < 64 ? n - n0 : 64;
        int nv = (int)((nn + 15) / 16), rem = (int)(nn - 16 * (nv - 1));
        __mmask16 last = (__mmask16)(rem == 16 ? 0xFFFFu : (1u << rem) - 1u);
        for (int64_t m0 = 0; m0 < m; m0 += 6) {
            int mr = m - m0 < 6 ? (int)(m - m0) : 6;
            const float *a = A + m0 * rsa, *b = B + n0;
            float *c = C + m0 * rsc + n0;
            switch (nv) {
            case 1: tile512_rows(mr, 1, last, K, a, rsa, csa, b, rsb, c, rsc, acc); break;
            case 2: tile512_rows(mr, 2, last, K, a, rsa, csa, b, rsb, c, rsc, acc); break;
            case 3: tile512_rows(mr, 3, last, K, a, rsa, csa, b, rsb, c, rsc, acc); break;
            default: tile512_rows(mr, 4, last, K, a, rsa, csa, b, rsb, c, rsc, acc); break;
            }
        }
    }
}

F_AVX512 static void softmax_rows_avx512(float *S, int br, int bc, float scale, float *m, float *l, float *alpha)
{
    const __m512 vs = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    for (int i = 0; i < br; i++) {
        float *r = S + i * BC;
        __m512 vmax = ninf;
        for (int j = 0; j < bc; j += 16) {
            __mmask16 k = (__mmask16)(bc - j >= 16 ? 0xFFFFu : (1u << (bc - j)) - 1u);
            __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, r + j), vs);
            _mm512_mask_storeu_ps(r + j, k, x);
            vmax = _mm512_mask_max_ps(vmax, k, vmax, x);
        }
        float mx = _mm512_reduce_max_ps(vmax);
        mx = m[i] > mx ? m[i] : mx;
        if (mx == -INFINITY) {
            for (int j = 0; j < bc; j++) r[j] = 0.0f;
            alpha[i] = 1.0f;
            continue;
        }
        __m512 vm = _mm512_set1_ps(mx), vsum = _mm512_setzero_ps();
        for (int j = 0; j < bc; j += 16) {
            __mmask16 k = (__mmask16)(bc - j >= 16 ? 0xFFFFu : (1u << (bc - j)) - 1u);
            __m512 p = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, r + j), vm));
            _mm512_mask_storeu_ps(r + j, k, p);
            vsum = _mm512_mask_add_ps(vsum, k, vsum, p);
        }
        alpha[i] = ts__exp_f32(m[i] - mx);
        l[i] = l[i] * alpha[i] + _mm512_reduce_add_ps(vsum);
        m[i] = mx;
    }
}

F_AVX512 static void probs_rows_avx512(float *S, int br, int bc, float scale, const float *lse)
{
    const __m512 vs = _mm512_set1_ps(scale);
    for (int i = 0; i < br; i++) {
        float *r = S + i * BC;
        __m512 vl = _mm512_set1_ps(lse[i]);
        for (int j = 0; j < bc; j += 16) {
            __mmask16 k = (__mmask16)(bc - j >= 16 ? 0xFFFFu : (1u << (bc - j)) - 1u);
            __m512 x = _mm512_sub_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, r + j), vs), vl);
            _mm512_mask_storeu_ps(r + j, k, exp512(x));
        }
    }
}

/* --------------------------------------------------------- AVX2 + FMA */

F_AVX2 static F_INLINE __m256 exp256(__m256 x)
{
    const __m256 lo = _mm256_set1_ps(-87.3f), hi = _mm256_set1_ps(88.7f), shift = _mm256_set1_ps(12582912.0f);
    __m256 xc = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 t = _mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f));
    __m256 fn = _mm256_sub_ps(_mm256_add_ps(t, shift), shift);
    __m256i n = _mm256_cvttps_epi32(fn);
    __m256 r = _mm256_sub_ps(xc, _mm256_mul_ps(fn, _mm256_set1_ps(0.693359375f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(fn, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 r2 = _mm256_mul_ps(r, r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
    __m256 y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, r2), r), _mm256_set1_ps(1.0f));
    __m256 sc = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
    __m256 out = _mm256_mul_ps(y, sc);
    out = _mm256_blendv_ps(out, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x, hi, _CMP_GT_OQ));
    out = _mm256_blendv_ps(out, _mm256_setzero_ps(), _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
    return _mm256_blendv_ps(out, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

/* Lanes j < n set (n in [0, 8]). */
F_AVX2 static F_INLINE __m256i lanes256(int n)
{
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* mr rows (<= 6) by nv vectors of 8 columns (<= 2); the last vector
 * partial (lanes `last`) unless `full`. */
F_AVX2 static F_INLINE void tile256(const int mr, const int nv, bool full, __m256i last, int64_t K, const float *A,
                                    int64_t rsa, int64_t csa, const float *B, int64_t rsb, float *C, int64_t rsc,
                                    bool acc)
{
    __m256 c[6][2];
#pragma GCC unroll 6
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 2
        for (int j = 0; j < nv; j++)
            c[i][j] = !acc             ? _mm256_setzero_ps()
                : (full || j < nv - 1) ? _mm256_loadu_ps(C + i * rsc + 8 * j)
                                       : _mm256_maskload_ps(C + i * rsc + 8 * j, last);
    for (int64_t k = 0; k < K; k++) {
        const float *b = B + k * rsb, *a = A + k * csa;
        __m256 bv[2];
#pragma GCC unroll 2
        for (int j = 0; j < nv; j++)
            bv[j] = (full || j < nv - 1) ? _mm256_loadu_ps(b + 8 * j) : _mm256_maskload_ps(b + 8 * j, last);
#pragma GCC unroll 6
        for (int i = 0; i < mr; i++) {
            __m256 av = _mm256_broadcast_ss(a + i * rsa);
#pragma GCC unroll 2
            for (int j = 0; j < nv; j++) c[i][j] = _mm256_fmadd_ps(av, bv[j], c[i][j]);
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 2
        for (int j = 0; j < nv; j++) {
            if (full || j < nv - 1) _mm256_storeu_ps(C + i * rsc + 8 * j, c[i][j]);
            else _mm256_maskstore_ps(C + i * rsc + 8 * j, last, c[i][j]);
        }
}

F_AVX2 static F_INLINE void tile256_rows(int mr, const int nv, bool full, __m256i last, int64_t K, const float *A,
                                         int64_t rsa, int64_t csa, const float *B, int64_t rsb, float *C, int64_t rsc,
                                         bool acc)
{
    switch (mr) {
    case 1: tile256(1, nv, full, last, K, A, rsa, csa, B, rsb, C, rsc, acc); break;
    case 2: tile256(2, nv, full, last, K, A, rsa, csa, B, rsb, C, rsc, acc); break;
    case 3: tile256(3, nv, full, last, K, A, rsa, csa, B, rsb, C, rsc, acc); break;
    case 4: tile256(4, nv, full, last, K, A, rsa, csa, B, rsb, C, rsc, acc); break;
    case 5: tile256(5, nv, full, last, K, A, rsa, csa, B, rsb, C, rsc, acc); break;
    default: tile256(6, nv, full, last, K, A, rsa, csa, B, rsb, C, rsc, acc); break;
    }
}

F_AVX2 static void mm_avx2(int64_t m, int64_t n, int64_t K, const float *A, int64_t rsa, int64_t csa, const float *B,
                           int64_t rsb, float *C, int64_t rsc, bool acc)
{
    for (int64_t n0 = 0; n0 < n; n0 += 16) {
        int64_t nn = n - n0 < 16 ? n - n0 : 16;
        int nv = (int)((nn + 7) / 8), rem = (int)(nn - 8 * (nv - 1));
        bool full = rem == 8;
        __m256i last = lanes256(rem);
        for (int64_t m0 = 0; m0 < m; m0 += 6) {
            int mr = m - m0 < 6 ? (int)(m - m0) : 6;
            const float *a = A + m0 * rsa, *b = B + n0;
            float *c = C + m0 * rsc + n0;
            if (nv == 2) tile256_rows(mr, 2, full, last, K, a, rsa, csa, b, rsb, c, rsc, acc);
            else tile256_rows(mr, 1, full, last, K, a, rsa, csa, b, rsb, c, rsc, acc);
        }
    }
}

F_AVX2 static F_INLINE float hmax256(__m256 v)
{
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_shuffle_ps(x, x, 1));
    return _mm_cvtss_f32(x);
}

F_AVX2 static F_INLINE float hsum256(__m256 v)
{
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
    return _mm_cvtss_f32(x);
}

F_AVX2 static void softmax_rows_avx2(float *S, int br, int bc, float scale, float *m, float *l, float *alpha)
{
    const __m256 vs = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);
    for (int i = 0; i < br; i++) {
        float *r = S + i * BC, mx;
        __m256 vmax = ninf;
        int j = 0;
        for (; j + 8 <= bc; j += 8) {
            __m256 x = _mm256_mul_ps(_mm256_loadu_ps(r + j), vs);
            _mm256_storeu_ps(r + j, x);
            vmax = _mm256_max_ps(vmax, x);
        }
        mx = hmax256(vmax);
        for (; j < bc; j++) {
            r[j] *= scale;
            mx = r[j] > mx ? r[j] : mx;
        }
        mx = m[i] > mx ? m[i] : mx;
        if (mx == -INFINITY) {
            for (j = 0; j < bc; j++) r[j] = 0.0f;
            alpha[i] = 1.0f;
            continue;
        }
        __m256 vm = _mm256_set1_ps(mx), vsum = _mm256_setzero_ps();
        for (j = 0; j + 8 <= bc; j += 8) {
            __m256 p = exp256(_mm256_sub_ps(_mm256_loadu_ps(r + j), vm));
            _mm256_storeu_ps(r + j, p);
            vsum = _mm256_add_ps(vsum, p);
        }
        float sum = hsum256(vsum);
        for (; j < bc; j++) {
            r[j] = ts__exp_f32(r[j] - mx);
            sum += r[j];
        }
        alpha[i] = ts__exp_f32(m[i] - mx);
        l[i] = l[i] * alpha[i] + sum;
        m[i] = mx;
    }
}

F_AVX2 static void probs_rows_avx2(float *S, int br, int bc, float scale, const float *lse)
{
    const __m256 vs = _mm256_set1_ps(scale);
    for (int i = 0; i < br; i++) {
        float *r = S + i * BC;
        __m256 vl = _mm256_set1_ps(lse[i]);
        int j = 0;
        for (; j + 8 <= bc; j += 8)
            _mm256_storeu_ps(r + j, exp256(_mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(r + j), vs), vl)));
        for (; j < bc; j++) r[j] = ts__exp_f32(r[j] * scale - lse[i]);
    }
}

/* dst[d * ds + s] = src[s * rs + d] for an 8 x 8 block. */
F_AVX2 static F_INLINE void tr8x8(float *dst, int64_t ds, const float *src, int64_t rs)
{
    __m256 r[8], t[8], u[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * rs);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(dst + i * ds, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
        _mm256_storeu_ps(dst + (i + 4) * ds, _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
    }
}

F_AVX2 static void transpose_avx2(float *xt, const float *x, int64_t rs, int64_t S, int64_t hd)
{
    int64_t s8 = S / 8 * 8, d8 = hd / 8 * 8;
    for (int64_t s0 = 0; s0 < s8; s0 += 8)
        for (int64_t d0 = 0; d0 < d8; d0 += 8) tr8x8(xt + d0 * S + s0, S, x + s0 * rs + d0, rs);
    for (int64_t d = d8; d < hd; d++) /* the columns right of the 8 x 8 blocks */
        for (int64_t s = 0; s < s8; s++) xt[d * S + s] = x[s * rs + d];
    for (int64_t s = s8; s < S; s++) /* the rows below them */
        for (int64_t d = 0; d < hd; d++) xt[d * S + s] = x[s * rs + d];
}

F_AVX2 static void mask_tile_avx2(float *St, int br, int bc, const uint8_t *mk, int64_t S)
{
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    const __m256i zero = _mm256_setzero_si256();
    for (int i = 0; i < br; i++) {
        float *r = St + i * BC;
        const uint8_t *m = mk + i * S;
        int j = 0;
        for (; j + 8 <= bc; j += 8) {
            __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(m + j)));
            __m256 sel = _mm256_castsi256_ps(_mm256_xor_si256(_mm256_cmpeq_epi32(b, zero), _mm256_set1_epi32(-1)));
            _mm256_storeu_ps(r + j, _mm256_blendv_ps(_mm256_loadu_ps(r + j), ninf, sel));
        }
        for (; j < bc; j++) r[j] = m[j] ? -INFINITY : r[j];
    }
}

F_AVX512 static void mask_tile_avx512(float *St, int br, int bc, const uint8_t *mk, int64_t S)
{
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int i = 0; i < br; i++) {
        float *r = St + i * BC;
        const uint8_t *m = mk + i * S;
        int j = 0;
        for (; j + 16 <= bc; j += 16) {
            __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(m + j)));
            __mmask16 k = _mm512_test_epi32_mask(b, b);
            _mm512_mask_storeu_ps(r + j, k, ninf);
        }
        for (; j < bc; j++) r[j] = m[j] ? -INFINITY : r[j];
    }
}

static const kops k_avx2 = {mm_avx2, softmax_rows_avx2, probs_rows_avx2, transpose_avx2, mask_tile_avx2};
static const kops k_avx512 = {mm_avx512, softmax_rows_avx512, probs_rows_avx512, transpose_avx2, mask_tile_avx512};
#endif

/* ------------------------------------------------------------- common */

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static bool g_env_on = true;
static atomic_int g_force = -1;

static void mode_init(void)
{
    const char *e = getenv("TS_ATTENTION");
    if (!e || !*e || !strcasecmp(e, "fused")) return;
    if (!strcasecmp(e, "reference")) g_env_on = false;
    else ts_logf(TS_LOG_WARN, "TS_ATTENTION=%s is not 'fused' or 'reference' (in any case); using 'fused'", e);
}

bool ts__flash_enabled(void)
{
    pthread_once(&g_once, mode_init);
    int f = atomic_load_explicit(&g_force, memory_order_relaxed);
    return f >= 0 ? f != 0 : g_env_on;
}

void ts__flash_force(int on) { atomic_store_explicit(&g_force, on < 0 ? -1 : on != 0, memory_order_relaxed); }

bool ts__flash_mask_ok(const uint8_t *mask, int64_t T, int64_t S)
{
    if (!mask) return true;
    for (int64_t t = 0; t < T; t++) {
        const uint8_t *r = mask + t * S;
        int64_t s = 0;
        while (s < S && r[s]) s++;
        if (s == S) return false;
    }
    return true;
}

/* The class of every block pair (nqb x nkb), NULL mask: all open. */
static uint8_t *classify(const uint8_t *mask, int64_t T, int64_t S, int64_t nqb, int64_t nkb)
{
    uint8_t *cls = ts__malloc(TS_MEM_OTHER, (size_t)(nqb * nkb));
    if (!cls) return NULL;
    for (int64_t qi = 0; qi < nqb; qi++)
        for (int64_t kj = 0; kj < nkb; kj++) {
            int64_t t0 = qi * BR, s0 = kj * BC, t1 = t0 + BR < T ? t0 + BR : T, s1 = s0 + BC < S ? s0 + BC : S;
            int64_t nm = 0;
            if (mask)
                for (int64_t t = t0; t < t1; t++)
                    for (int64_t s = s0; s < s1; s++) nm += mask[t * S + s] != 0;
            cls[qi * nkb + kj] = nm == 0 ? BLK_OPEN : nm == (t1 - t0) * (s1 - s0) ? BLK_SKIP : BLK_MIXED;
        }
    return cls;
}

/* sum a[i] * b[i] over n, in 16 partial sums (so that it vectorises
 * without reassociation), then the tail. */
static F_INLINE float dot16(const float *a, const float *b, int64_t n)
{
    float acc[16] = {0}, s = 0.0f;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) acc[l] += a[i + l] * b[i + l];
    for (int l = 0; l < 16; l++) s += acc[l];
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* Dropout on a br x bc tile of probabilities (row stride BC): entries
 * whose keep bit is 0 (bit jj of row i's word kz[i * kw]) become 0. The
 * kept ones are scaled once per row later (by the output's 1/l). */
static F_INLINE void drop_tile(float *St, int br, int bc, const uint32_t *kz, int64_t kw)
{
    for (int i = 0; i < br; i++) {
        uint32_t wd = kz[i * kw];
        float *r = St + i * BC;
        for (int jj = 0; jj < bc; jj++) r[jj] = (wd >> jj) & 1u ? r[jj] : 0.0f;
    }
}

typedef struct job job;
/* One (b, h) pair, forward or backward, on one path. */
typedef void (*head_fn)(const job *j, float *w, int64_t b, int64_t h);

struct job {
    head_fn head;
    const ts__flash_problem *pr;
    const uint8_t *cls;
    int64_t nqb, nkb;
    bool backward;
    float *o, *lse; /* forward: written; backward: read */
    const float *go;
    float *dq, *dk, *dv;
    int nt;
    atomic_int failed;
};

static F_INLINE void forward_head(const kops *k, const job *j, float *w, int64_t b, int64_t h)
{
    const ts__flash_problem *pr = j->pr;
    int64_t T = pr->T, S = pr->S, hd = pr->hd, E = pr->H * hd;
    const float *q = pr->q + b * pr->q_sb + h * hd, *kk = pr->k + b * pr->k_sb + h * hd,
                *v = pr->v + b * pr->v_sb + h * hd;
    float *o = j->o + b * T * E + h * hd, *lse = j->lse + (b * pr->H + h) * T;
    float *Kt = w, *St = Kt + hd * S, *Oa = St + BR * BC, *m = Oa + BR * hd, *l = m + BR, *alpha = l + BR;
    int64_t kw = TS__FLASH_KEEP_WORDS(S);
    const uint32_t *kz = pr->keep ? pr->keep + (b * pr->H + h) * T * kw : NULL;
    k->transpose(Kt, kk, pr->k_st, S, hd);
    for (int64_t qi = 0; qi < j->nqb; qi++) {
        int64_t t0 = qi * BR;
        int br = (int)(T - t0 < BR ? T - t0 : BR);
        for (int i = 0; i < br; i++) {
            m[i] = -INFINITY;
            l[i] = 0.0f;
        }
        memset(Oa, 0, (size_t)(br * hd) * sizeof *Oa);
        for (int64_t kj = 0; kj < j->nkb; kj++) {
            int c = j->cls[qi * j->nkb + kj];
            if (c == BLK_SKIP) continue;
            int64_t s0 = kj * BC;
            int bc = (int)(S - s0 < BC ? S - s0 : BC);
            k->mm(br, bc, hd, q + t0 * pr->q_st, pr->q_st, 1, Kt + s0, S, St, BC, false);
            if (c == BLK_MIXED) k->mask_tile(St, br, bc, pr->mask + t0 * S + s0, S);
            k->softmax_rows(St, br, bc, pr->scale, m, l, alpha);
            if (kz) /* after the sum: l normalises over every key */
                drop_tile(St, br, bc, kz + t0 * kw + kj, kw);
            for (int i = 0; i < br; i++)
                if (alpha[i] != 1.0f)
                    for (int64_t d = 0; d < hd; d++) Oa[i * hd + d] *= alpha[i];
            k->mm(br, hd, bc, St, BC, 1, v + s0 * pr->v_st, pr->v_st, Oa, hd, true);
        }
        for (int i = 0; i < br; i++) {
            float inv = kz ? pr->drop_scale / l[i] : 1.0f / l[i];
            float *orow = o + (t0 + i) * E;
            for (int64_t d = 0; d < hd; d++) orow[d] = Oa[i * hd + d] * inv;
            lse[t0 + i] = m[i] + logf(l[i]);
        }
    }
}

static F_INLINE void backward_head(const kops *k, const job *j, float *w, int64_t b, int64_t h)
{
    const ts__flash_problem *pr = j->pr;
    int64_t T = pr->T, S = pr->S, hd = pr->hd, E = pr->H * hd;
    const float *q = pr->q + b * pr->q_sb + h * hd, *kk = pr->k + b * pr->k_sb + h * hd,
                *v = pr->v + b * pr->v_sb + h * hd;
    const float *o = j->o + b * T * E + h * hd, *go = j->go + b * T * E + h * hd;
    const float *lse = j->lse + (b * pr->H + h) * T;
    float *dq = j->dq + b * T * E + h * hd, *dk = j->dk + b * S * E + h * hd, *dv = j->dv + b * S * E + h * hd;
    float *Kt = w, *Vt = Kt + hd * S, *Pt = Vt + hd * S, *dPt = Pt + BR * BC, *D = dPt + BR * BC;
    float scale = pr->scale, ds = pr->drop_scale;
    int64_t kw = TS__FLASH_KEEP_WORDS(S);
    const uint32_t *kz = pr->keep ? pr->keep + (b * pr->H + h) * T * kw : NULL;
    k->transpose(Kt, kk, pr->k_st, S, hd);
    k->transpose(Vt, v, pr->v_st, S, hd);
    for (int64_t t = 0; t < T; t++) D[t] = dot16(go + t * E, o + t * E, hd);
    for (int64_t kj = 0; kj < j->nkb; kj++) {
        int64_t s0 = kj * BC;
        int bc = (int)(S - s0 < BC ? S - s0 : BC);
        for (int64_t qi = 0; qi < j->nqb; qi++) {
            int c = j->cls[qi * j->nkb + kj];
            if (c == BLK_SKIP) continue;
            int64_t t0 = qi * BR;
            int br = (int)(T - t0 < BR ? T - t0 : BR);
            /* P = exp(scale q k^T - lse), 0 under the mask */
            k->mm(br, bc, hd, q + t0 * pr->q_st, pr->q_st, 1, Kt + s0, S, Pt, BC, false);
            if (c == BLK_MIXED) k->mask_tile(Pt, br, bc, pr->mask + t0 * S + s0, S);
            k->probs_rows(Pt, br, bc, scale, lse + t0);
            if (!kz) {
                /* dV += P^T dO */
                k->mm(bc, hd, br, Pt, 1, BC, go + t0 * E, E, dv + s0 * E, E, true);
                /* dP = dO V^T; dS = scale * P * (dP - D) */
                k->mm(br, bc, hd, go + t0 * E, E, 1, Vt + s0, S, dPt, BC, false);
                for (int i = 0; i < br; i++) {
                    float Di = D[t0 + i];
                    for (int jj = 0; jj < bc; jj++)
                        dPt[i * BC + jj] = Pt[i * BC + jj] * (dPt[i * BC + jj] - Di) * scale;
                }
            } else {
                /* dropout, Z the keep bits scaled by ds: dP = (dO V^T) o Z,
                 * dS = scale * P * (dP - D), then P becomes W = P o Z for
                 * dV += W^T dO */
                k->mm(br, bc, hd, go + t0 * E, E, 1, Vt + s0, S, dPt, BC, false);
                for (int i = 0; i < br; i++) {
                    float Di = D[t0 + i];
                    uint32_t wd = kz[(t0 + i) * kw + kj];
                    float *pr_ = Pt + i * BC, *dr = dPt + i * BC;
                    for (int jj = 0; jj < bc; jj++) {
                        bool keep = (wd >> jj) & 1u;
                        float p = pr_[jj];
                        dr[jj] = p * ((keep ? dr[jj] * ds : 0.0f) - Di) * scale;
                        pr_[jj] = keep ? p * ds : 0.0f;
                    }
                }
                k->mm(bc, hd, br, Pt, 1, BC, go + t0 * E, E, dv + s0 * E, E, true);
            }
            /* dQ += dS K; dK += dS^T Q */
            k->mm(br, hd, bc, dPt, BC, 1, kk + s0 * pr->k_st, pr->k_st, dq + t0 * E, E, true);
            k->mm(bc, hd, br, dPt, 1, BC, q + t0 * pr->q_st, pr->q_st, dk + s0 * E, E, true);
        }
    }
}

/* Each path's head functions: the blocks' loops and elementwise passes
 * are inlined into a function compiled for the path's instruction set
 * (so that they vectorise with it), calling its kernels directly. */
static void head_scalar(const job *j, float *w, int64_t b, int64_t h)
{
    if (j->backward) backward_head(&k_scalar, j, w, b, h);
    else forward_head(&k_scalar, j, w, b, h);
}

#if F_X86
F_AVX2 static void head_avx2(const job *j, float *w, int64_t b, int64_t h)
{
    if (j->backward) backward_head(&k_avx2, j, w, b, h);
    else forward_head(&k_avx2, j, w, b, h);
}

F_AVX512 static void head_avx512(const job *j, float *w, int64_t b, int64_t h)
{
    if (j->backward) backward_head(&k_avx512, j, w, b, h);
    else forward_head(&k_avx512, j, w, b, h);
}
#endif

static head_fn head_for(ts__kpath p)
{
#if F_X86
    if (p >= TS__KPATH_AVX512) return head_avx512;
    if (p == TS__KPATH_AVX2) return head_avx2;
#endif
    (void)p;
    return head_scalar;
}

/* Floats of one worker's scratch. */
static size_t scratch_floats(const ts__flash_problem *pr)
{
    int64_t fwd = pr->hd * pr->S + BR * BC + BR * pr->hd + 3 * BR;
    int64_t bwd = 2 * pr->hd * pr->S + 2 * BR * BC + pr->T;
    return (size_t)(fwd > bwd ? fwd : bwd);
}

typedef struct worker {
    job *j;
    int index;
} worker;

static void *worker_main(void *arg)
{
    worker *wk = arg;
    job *j = wk->j;
    const ts__flash_problem *pr = j->pr;
    float *w = ts__malloc(TS_MEM_OTHER, scratch_floats(pr) * sizeof(float));
    if (!w) {
        atomic_store(&j->failed, 1);
        return NULL;
    }
    for (int64_t p = wk->index; p < pr->B * pr->H; p += j->nt) j->head(j, w, p / pr->H, p % pr->H);
    ts__free(TS_MEM_OTHER, w);
    return NULL;
}

enum { MAX_THREADS = 64 };

/* Runs the job's (b, h) pairs on up to ts_get_num_threads() threads (the
 * calling one included); if a helper cannot be started, the pairs are
 * dealt among those that could before any work begins. */
static ts_status run(job *j)
{
    const ts__flash_problem *pr = j->pr;
    j->nqb = (pr->T + BR - 1) / BR;
    j->nkb = (pr->S + BC - 1) / BC;
    uint8_t *cls = classify(pr->mask, pr->T, pr->S, j->nqb, j->nkb);
    if (!cls) return TS_ERR_NO_MEMORY;
    j->cls = cls;
    int64_t pairs = pr->B * pr->H;
    int nt = ts_get_num_threads();
    nt = nt > MAX_THREADS ? MAX_THREADS : nt < 1 ? 1 : nt;
    nt = (int64_t)nt > pairs ? (int)pairs : nt;
    worker wk[MAX_THREADS];
    pthread_t tid[MAX_THREADS];
    atomic_init(&j->failed, 0);
    /* the count is fixed before any helper starts: a helper that cannot
     * be created has its share run here */
    int started = 1;
    j->nt = nt;
    for (int i = 0; i < nt; i++) wk[i] = (worker){j, i};
    while (started < nt && pthread_create(&tid[started], NULL, worker_main, &wk[started]) == 0) started++;
    if (started < nt) {
        /* the helpers that did not start: their pairs are run here */
        for (int i = started; i < nt; i++) worker_main(&wk[i]);
    }
    worker_main(&wk[0]);
    for (int i = 1; i < started; i++) pthread_join(tid[i], NULL);
    ts__free(TS_MEM_OTHER, cls);
    if (atomic_load(&j->failed))
        return ts_error(TS_ERR_NO_MEMORY, "attention: no memory for the fused kernel's scratch (%zu bytes per thread)",
                        scratch_floats(pr) * sizeof(float));
    return TS_OK;
}

ts_status ts__flash_forward(ts__kpath p, const ts__flash_problem *pr, float *o, float *lse)
{
    job j = {.head = head_for(p), .pr = pr, .o = o, .lse = lse};
    return run(&j);
}

ts_status ts__flash_backward(ts__kpath p, const ts__flash_problem *pr, const float *o, const float *lse,
                             const float *go, float *dq, float *dk, float *dv)
{
    int64_t E = pr->H * pr->hd;
    memset(dq, 0, (size_t)(pr->B * pr->T * E) * sizeof *dq);
    memset(dk, 0, (size_t)(pr->B * pr->S * E) * sizeof *dk);
    memset(dv, 0, (size_t)(pr->B * pr->S * E) * sizeof *dv);
    job j = {.head = head_for(p),
             .pr = pr,
             .o = (float *)o,
             .lse = (float *)lse,
             .go = go,
             .dq = dq,
             .dk = dk,
             .dv = dv,
             .backward = true};
    return run(&j);
}
