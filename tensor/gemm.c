/*
 * Matrix products: C (m, n) = alpha * A (m, k) B (k, n) + beta * C with
 * general strides in elements, through BLIS, and the plain C reference the
 * tests compare it with.
 *
 * Semantics shared by both paths (BLAS's): beta == 0 overwrites C without
 * reading it (NaN in C does not propagate); alpha == 0 or k == 0 leaves
 * C = beta * C without reading A or B; m == 0 or n == 0 does nothing.
 *
 * Layouts: BLIS documents general strides as positive strides of a row-
 * or column-tilted layout whose rows or columns do not interleave (the
 * rules of bli_check_matrix_strides, which its object API applies). BLIS
 * 0.9's typed API does not check them, and on this build gave correct
 * results for some layouts outside them, but nothing promises that for
 * every kernel set and code path (the haswell/zen "sup" path reads
 * operands unpacked). So an operand outside the rules (a broadcast stride
 * 0, a negative stride, a stepped slice such as t[:, ::2] whose rows
 * interleave) is copied into a contiguous scratch buffer first, and sizes
 * of 1 get canonical strides, since their stride is arbitrary. Scratch
 * comes from ts__malloc (TS_MEM_OTHER); without it the reference runs.
 */
#define _GNU_SOURCE
#include "tensor/internal.h"

#include <blis.h>
#include <string.h>

_Static_assert(sizeof(dim_t) == sizeof(int64_t) && sizeof(inc_t) == sizeof(int64_t),
               "BLIS is expected to use 64-bit dimensions and strides");

bool ts__use_reference_kernels = false;

/* ---------------------------------------------------------- reference */

/* Columns of C accumulated at once: a block of double accumulators on the
 * stack, so the loops run i, then k, then j (rows of B stream in order). */
#define REF_NB 64

void ts__gemm_ref_f32(int64_t m, int64_t n, int64_t k, float alpha, const float *a, int64_t rsa, int64_t csa,
                      const float *b, int64_t rsb, int64_t csb, float beta, float *c, int64_t rsc, int64_t csc)
{
    double acc[REF_NB];
    bool use_ab = k > 0 && alpha != 0.0f;
    for (int64_t i = 0; i < m; i++) {
        for (int64_t j0 = 0; j0 < n; j0 += REF_NB) {
            int64_t nb = n - j0 < REF_NB ? n - j0 : REF_NB;
            for (int64_t jj = 0; jj < nb; jj++) acc[jj] = 0.0;
            if (use_ab) {
                for (int64_t p = 0; p < k; p++) {
                    double av = a[i * rsa + p * csa];
                    const float *brow = b + p * rsb + j0 * csb;
                    for (int64_t jj = 0; jj < nb; jj++) acc[jj] += av * (double)brow[jj * csb];
                }
            }
            for (int64_t jj = 0; jj < nb; jj++) {
                float *cp = c + i * rsc + (j0 + jj) * csc;
                double v = use_ab ? (double)alpha * acc[jj] : 0.0;
                if (beta != 0.0f) v += (double)beta * (double)*cp;
                *cp = (float)v;
            }
        }
    }
}

void ts__gemm_ref_f64(int64_t m, int64_t n, int64_t k, double alpha, const double *a, int64_t rsa, int64_t csa,
                      const double *b, int64_t rsb, int64_t csb, double beta, double *c, int64_t rsc, int64_t csc)
{
    double acc[REF_NB];
    bool use_ab = k > 0 && alpha != 0.0;
    for (int64_t i = 0; i < m; i++) {
        for (int64_t j0 = 0; j0 < n; j0 += REF_NB) {
            int64_t nb = n - j0 < REF_NB ? n - j0 : REF_NB;
            for (int64_t jj = 0; jj < nb; jj++) acc[jj] = 0.0;
            if (use_ab) {
                for (int64_t p = 0; p < k; p++) {
                    double av = a[i * rsa + p * csa];
                    const double *brow = b + p * rsb + j0 * csb;
                    for (int64_t jj = 0; jj < nb; jj++) acc[jj] += av * brow[jj * csb];
                }
            }
            for (int64_t jj = 0; jj < nb; jj++) {
                double *cp = c + i * rsc + (j0 + jj) * csc;
                double v = use_ab ? alpha * acc[jj] : 0.0;
                if (beta != 0.0) v += beta * *cp;
                *cp = v;
            }
        }
    }
}

/* -------------------------------------------------------- BLIS layout */

/* Gives dims of size 1 strides BLIS accepts (their value is arbitrary in a
 * tensor), then says whether BLIS takes the layout as it is: both strides
 * positive, and the rules of bli_check_matrix_strides (BLIS reserves
 * rs == cs == 1 for 1x1, and a general-stride matrix must not interleave).
 * rows, cols >= 1. */
static bool blis_layout_ok(int64_t rows, int64_t cols, int64_t *rs, int64_t *cs)
{
    if (rows == 1 && cols == 1) {
        *rs = 1;
        *cs = 1;
        return true;
    }
    if (rows == 1) {
        if (*cs <= 0) return false;
        *rs = cols * *cs;
        return true;
    }
    if (cols == 1) {
        if (*rs <= 0) return false;
        *cs = rows * *rs;
        return true;
    }
    int64_t r = *rs, c = *cs;
    if (r <= 0 || c <= 0 || r == c) return false;
    if (c == 1) return r >= cols;
    if (r == 1) return c >= rows;
    if (r < c) return rows <= c / r;
    return cols <= r / c;
}

/* Contiguous row-major copies of one operand, for layouts BLIS refuses. */
static void pack_f32(int64_t rows, int64_t cols, const float *src, int64_t rs, int64_t cs, float *dst)
{
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++) dst[i * cols + j] = src[i * rs + j * cs];
}

static void unpack_f32(int64_t rows, int64_t cols, const float *src, float *dst, int64_t rs, int64_t cs)
{
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++) dst[i * rs + j * cs] = src[i * cols + j];
}

static void pack_f64(int64_t rows, int64_t cols, const double *src, int64_t rs, int64_t cs, double *dst)
{
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++) dst[i * cols + j] = src[i * rs + j * cs];
}

static void unpack_f64(int64_t rows, int64_t cols, const double *src, double *dst, int64_t rs, int64_t cs)
{
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++) dst[i * rs + j * cs] = src[i * cols + j];
}

/* C = beta * C for the cases where A B does not contribute. */
static void scale_c_f32(int64_t m, int64_t n, float beta, float *c, int64_t rsc, int64_t csc)
{
    if (beta == 1.0f) return;
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            float *p = c + i * rsc + j * csc;
            *p = beta == 0.0f ? 0.0f : beta * *p;
        }
}

static void scale_c_f64(int64_t m, int64_t n, double beta, double *c, int64_t rsc, int64_t csc)
{
    if (beta == 1.0) return;
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            double *p = c + i * rsc + j * csc;
            *p = beta == 0.0 ? 0.0 : beta * *p;
        }
}

/* ------------------------------------------------------------- BLIS */

void ts__gemm_f32(int64_t m, int64_t n, int64_t k, float alpha, const float *a, int64_t rsa, int64_t csa,
                  const float *b, int64_t rsb, int64_t csb, float beta, float *c, int64_t rsc, int64_t csc)
{
    if (m <= 0 || n <= 0) return;
    if (k <= 0 || alpha == 0.0f) {
        scale_c_f32(m, n, beta, c, rsc, csc);
        return;
    }
    if (ts__use_reference_kernels) {
        ts__gemm_ref_f32(m, n, k, alpha, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc);
        return;
    }
    ts__blis_ensure_init();

    float *ta = NULL, *tb = NULL, *tc = NULL;
    bool ok_a = blis_layout_ok(m, k, &rsa, &csa);
    bool ok_b = blis_layout_ok(k, n, &rsb, &csb);
    bool ok_c = blis_layout_ok(m, n, &rsc, &csc);
    if ((!ok_a && !(ta = ts__malloc(TS_MEM_OTHER, (size_t)(m * k) * sizeof(float)))) ||
        (!ok_b && !(tb = ts__malloc(TS_MEM_OTHER, (size_t)(k * n) * sizeof(float)))) ||
        (!ok_c && !(tc = ts__malloc(TS_MEM_OTHER, (size_t)(m * n) * sizeof(float))))) {
        /* no scratch memory: the reference takes any layout (ts__malloc
         * recorded TS_ERR_NO_MEMORY, but the product still succeeds) */
        ts__free(TS_MEM_OTHER, ta);
        ts__free(TS_MEM_OTHER, tb);
        ts__gemm_ref_f32(m, n, k, alpha, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc);
        return;
    }
    if (ta) {
        pack_f32(m, k, a, rsa, csa, ta);
        a = ta, rsa = k, csa = 1;
        blis_layout_ok(m, k, &rsa, &csa);
    }
    if (tb) {
        pack_f32(k, n, b, rsb, csb, tb);
        b = tb, rsb = n, csb = 1;
        blis_layout_ok(k, n, &rsb, &csb);
    }
    float *cc = c;
    int64_t rscc = rsc, cscc = csc;
    if (tc) {
        if (beta != 0.0f) pack_f32(m, n, c, rsc, csc, tc);
        cc = tc, rscc = n, cscc = 1;
        blis_layout_ok(m, n, &rscc, &cscc);
    }
    /* BLIS's typed API takes non-const pointers but does not write A, B,
     * alpha or beta. */
    bli_sgemm(BLIS_NO_TRANSPOSE, BLIS_NO_TRANSPOSE, m, n, k, &alpha, (float *)a, rsa, csa, (float *)b, rsb, csb, &beta,
              cc, rscc, cscc);
    if (tc) unpack_f32(m, n, tc, c, rsc, csc);
    ts__free(TS_MEM_OTHER, ta);
    ts__free(TS_MEM_OTHER, tb);
    ts__free(TS_MEM_OTHER, tc);
}

void ts__gemm_f64(int64_t m, int64_t n, int64_t k, double alpha, const double *a, int64_t rsa, int64_t csa,
                  const double *b, int64_t rsb, int64_t csb, double beta, double *c, int64_t rsc, int64_t csc)
{
    if (m <= 0 || n <= 0) return;
    if (k <= 0 || alpha == 0.0) {
        scale_c_f64(m, n, beta, c, rsc, csc);
        return;
    }
    if (ts__use_reference_kernels) {
        ts__gemm_ref_f64(m, n, k, alpha, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc);
        return;
    }
    ts__blis_ensure_init();

    double *ta = NULL, *tb = NULL, *tc = NULL;
    bool ok_a = blis_layout_ok(m, k, &rsa, &csa);
    bool ok_b = blis_layout_ok(k, n, &rsb, &csb);
    bool ok_c = blis_layout_ok(m, n, &rsc, &csc);
    if ((!ok_a && !(ta = ts__malloc(TS_MEM_OTHER, (size_t)(m * k) * sizeof(double)))) ||
        (!ok_b && !(tb = ts__malloc(TS_MEM_OTHER, (size_t)(k * n) * sizeof(double)))) ||
        (!ok_c && !(tc = ts__malloc(TS_MEM_OTHER, (size_t)(m * n) * sizeof(double))))) {
        ts__free(TS_MEM_OTHER, ta);
        ts__free(TS_MEM_OTHER, tb);
        ts__gemm_ref_f64(m, n, k, alpha, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc);
        return;
    }
    if (ta) {
        pack_f64(m, k, a, rsa, csa, ta);
        a = ta, rsa = k, csa = 1;
        blis_layout_ok(m, k, &rsa, &csa);
    }
    if (tb) {
        pack_f64(k, n, b, rsb, csb, tb);
        b = tb, rsb = n, csb = 1;
        blis_layout_ok(k, n, &rsb, &csb);
    }
    double *cc = c;
    int64_t rscc = rsc, cscc = csc;
    if (tc) {
        if (beta != 0.0) pack_f64(m, n, c, rsc, csc, tc);
        cc = tc, rscc = n, cscc = 1;
        blis_layout_ok(m, n, &rscc, &cscc);
    }
    bli_dgemm(BLIS_NO_TRANSPOSE, BLIS_NO_TRANSPOSE, m, n, k, &alpha, (double *)a, rsa, csa, (double *)b, rsb, csb,
              &beta, cc, rscc, cscc);
    if (tc) unpack_f64(m, n, tc, c, rsc, csc);
    ts__free(TS_MEM_OTHER, ta);
    ts__free(TS_MEM_OTHER, tb);
    ts__free(TS_MEM_OTHER, tc);
}
