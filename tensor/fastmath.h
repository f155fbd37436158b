/* Float exp and erf without libm calls, so that the loops that use them
 * (GELU, softmax) vectorise. Accuracy measured against double libm (see
 * the comments); the reference kernels keep libm. */
#ifndef TS_FASTMATH_H
#define TS_FASTMATH_H

#include <stdint.h>
#include <string.h>

/* exp(x) for float: Cephes expf's range reduction (x = n ln2 + r with ln2
 * split in two) and degree-5 polynomial, the 2^n scale built from the
 * exponent bits. Inputs below -87.3 give 0, above 88.7 give +inf; NaN gives
 * NaN. Measured: within 0.93 ulp of exp over [-87, 88] (one float in 4096
 * sampled). Branch-free so that loops over it vectorise. */
static inline __attribute__((always_inline)) float ts__exp_f32(float x)
{
    float xc = x < -87.3f ? -87.3f : x > 88.7f ? 88.7f : x;
    float t = xc * 1.44269504088896341f;
    /* round to nearest by adding and subtracting 1.5 * 2^23 (|t| < 128) */
    float fn = (t + 12582912.0f) - 12582912.0f;
    int32_t n = (int32_t)fn;
    float r = xc - fn * 0.693359375f;
    r = r - fn * -2.12194440e-4f;
    float r2 = r * r;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * r2 + r + 1.0f;
    uint32_t bits = (uint32_t)(n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    float out = y * scale;
    out = x > 88.7f ? __builtin_inff() : out;
    out = x < -87.3f ? 0.0f : out;
    return x != x ? x : out;
}

/* erf for float: the rational approximation Eigen and XLA use (x clamped
 * to [-4, 4], odd degree-13 numerator over an even degree-8 denominator in
 * x^2). Measured against double erf over [-10, 10] in steps of 1e-4:
 * 3.8e-7 absolute; the f32 GELU made with it is within 1.5e-6 absolute
 * (3e-7 relative) of the one made with glibc's erff. */
static inline __attribute__((always_inline)) float ts__erf_f32(float x)
{
    x = x < -4.0f ? -4.0f : x > 4.0f ? 4.0f : x;
    float x2 = x * x;
    float p = x2 * -2.72614225801306e-10f + 2.77068142495902e-08f;
    p = p * x2 + -2.10102402082508e-06f;
    p = p * x2 + -5.69250639462346e-05f;
    p = p * x2 + -7.34990630326855e-04f;
    p = p * x2 + -2.95459980854025e-03f;
    p = p * x2 + -1.60960333262415e-02f;
    float q = x2 * -1.45660718464996e-05f + -2.13374055278905e-04f;
    q = q * x2 + -1.68282697438203e-03f;
    q = q * x2 + -7.37332916720468e-03f;
    q = q * x2 + -1.42647390514189e-02f;
    return x * p / q;
}

#endif
