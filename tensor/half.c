/*
 * bfloat16 and float16 conversions with the results of torch 1.13's
 * c10::BFloat16 and c10::Half for every input (tests/fixtures/rng/half_*,
 * made from torch, check the NaN and rounding cases, all 65536 16-bit
 * patterns and a 2^24-pattern sweep of float32).
 *
 * - float -> bfloat16: round to nearest even on the high 16 bits; every NaN
 *   becomes 0x7FC0 (c10::detail::round_to_nearest_even). Note: torch 1.13's
 *   AVX2 vectorised float32 -> bfloat16 copy (a contiguous .to()) writes
 *   0xFFFF for NaN instead; every other input gives the same bits.
 * - bfloat16 -> float: the 16 bits shifted up (NaN payloads and signalling
 *   NaNs kept).
 * - float -> float16: fp16_ieee_from_fp32_value: round to nearest even,
 *   subnormals included, overflow to infinity; every NaN becomes
 *   sign | 0x7E00 (payload dropped, sign kept).
 * - float16 -> float: fp16_ieee_to_fp32_value: exact; a NaN keeps its sign
 *   and payload and becomes quiet (bit 22 set).
 *
 * Written with integer operations only, so the results do not depend on
 * the floating-point environment (flush-to-zero, rounding mode).
 */
#include "tensor/internal.h"

#include <string.h>

static uint32_t f32_to_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float bits_to_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

uint16_t ts_f32_to_bf16(float f)
{
    uint32_t u = f32_to_bits(f);
    if ((u & UINT32_C(0x7FFFFFFF)) > UINT32_C(0x7F800000)) return UINT16_C(0x7FC0);
    uint32_t rounding_bias = ((u >> 16) & 1u) + UINT32_C(0x7FFF);
    return (uint16_t)((u + rounding_bias) >> 16);
}

float ts_bf16_to_f32(uint16_t h) { return bits_to_f32((uint32_t)h << 16); }

uint16_t ts_f32_to_f16(float f)
{
    uint32_t w = f32_to_bits(f);
    uint16_t sign = (uint16_t)((w >> 16) & 0x8000u);
    uint32_t a = w & UINT32_C(0x7FFFFFFF);

    if (a > UINT32_C(0x7F800000)) /* NaN */
        return sign | 0x7E00u;
    if (a >= UINT32_C(0x477FF000)) /* >= 65520 rounds to infinity; infinity */
        return sign | 0x7C00u;
    if (a >= UINT32_C(0x38800000)) {
        /* normal half: rebias the exponent (127 -> 15), round the mantissa
         * from 23 to 10 bits to nearest even; a carry moves into the
         * exponent, which stays finite below 65520 */
        uint32_t m = a - (UINT32_C(112) << 23);
        m += UINT32_C(0xFFF) + ((m >> 13) & 1u);
        return sign | (uint16_t)(m >> 13);
    }
    uint32_t e = a >> 23;
    if (e < 102) /* below 2^-25: rounds to zero */
        return sign;
    /* subnormal half (or the smallest normal after rounding): the value
     * is mant * 2^(e - 150); in units of 2^-24 that is mant >> (126 - e) */
    uint32_t mant = (a & UINT32_C(0x7FFFFF)) | UINT32_C(0x800000);
    uint32_t shift = 126 - e; /* 14 .. 24 */
    uint32_t q = mant >> shift;
    uint32_t rem = mant & ((UINT32_C(1) << shift) - 1);
    uint32_t half = UINT32_C(1) << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return sign | (uint16_t)q;
}

float ts_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu;
    uint32_t mant = h & 0x3FFu;

    if (exp == 0x1F) /* infinity, or a NaN made quiet */
        return bits_to_f32(sign | UINT32_C(0x7F800000) | (mant << 13) | (mant ? UINT32_C(0x400000) : 0));
    if (exp != 0) return bits_to_f32(sign | ((exp + 112) << 23) | (mant << 13));
    if (mant == 0) return bits_to_f32(sign);
    /* subnormal: mant * 2^-24, normalised */
    uint32_t e = 113;
    while (!(mant & 0x400u)) {
        mant <<= 1;
        e--;
    }
    return bits_to_f32(sign | (e << 23) | ((mant & 0x3FFu) << 13));
}
