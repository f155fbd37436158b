/* tensor_half: float32 <-> bfloat16 / float16 conversions against torch
 * 1.13 (c10::BFloat16 and c10::Half), bit for bit. The vectors in
 * tests/fixtures/rng/half_* come from tools/reference/make_rng_vectors.py
 * (PROVENANCE.md): 12,071 float32 patterns (ties, subnormals, overflow,
 * NaN payloads, random) with their 16-bit results, the float32 bits of
 * interesting 16-bit patterns, and CRC-32s of all 65,536 16-bit patterns
 * and of a 2^24-pattern float32 sweep. */
#include <criterion/criterion.h>
#include <fenv.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/helpers.h"

/* A non-empty fixture of tests/fixtures/rng, NUL-terminated. */
static uint8_t *read_fixture(const char *file, size_t *len)
{
    uint8_t *buf = th_fixture_read(file, len);
    cr_assert_gt(*len, 0, "empty fixture %s", file);
    return buf;
}

static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

static uint32_t rd32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* CRC-32 (th_crc32) continued from `crc` over v's little-endian bytes. */
static uint32_t crc_u16(uint32_t crc, uint16_t v)
{
    uint8_t b[2] = {(uint8_t)v, (uint8_t)(v >> 8)};
    return th_crc32(crc, b, 2);
}

static uint32_t crc_u32(uint32_t crc, uint32_t v)
{
    uint8_t b[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    return th_crc32(crc, b, 4);
}

/* The value of `name` in half_crc32.txt. */
static uint32_t torch_crc(const char *name) { return th_fixture_crc("half_crc32.txt", name); }

Test(tensor_half, f32_to_bf16_and_f16_match_torch)
{
    size_t len;
    uint8_t *buf = read_fixture("half_from_f32.bin", &len);
    cr_assert_eq(len % 8, 0);
    size_t n = len / 8;
    cr_assert_gt(n, 12000);
    const uint8_t *in = buf, *bf = buf + 4 * n, *hf = buf + 6 * n;
    for (size_t i = 0; i < n; i++) {
        uint32_t x = rd32(in + 4 * i);
        uint16_t b = ts_f32_to_bf16(th_f32_of(x)), h = ts_f32_to_f16(th_f32_of(x));
        cr_assert_eq(b, rd16(bf + 2 * i), "bf16(0x%08" PRIx32 ") = 0x%04x, torch 0x%04x", x, b, rd16(bf + 2 * i));
        cr_assert_eq(h, rd16(hf + 2 * i), "f16(0x%08" PRIx32 ") = 0x%04x, torch 0x%04x", x, h, rd16(hf + 2 * i));
    }
    free(buf);
}

Test(tensor_half, sixteen_bit_patterns_to_f32_match_torch)
{
    size_t len;
    uint8_t *buf = read_fixture("half_to_f32.bin", &len);
    cr_assert_eq(len % 10, 0);
    size_t n = len / 10;
    const uint8_t *in = buf, *fh = buf + 2 * n, *fb = buf + 6 * n;
    for (size_t i = 0; i < n; i++) {
        uint16_t x = rd16(in + 2 * i);
        uint32_t h = th_f32_bits(ts_f16_to_f32(x)), b = th_f32_bits(ts_bf16_to_f32(x));
        cr_assert_eq(h, rd32(fh + 4 * i), "f16 0x%04x -> 0x%08" PRIx32 ", torch 0x%08" PRIx32, x, h, rd32(fh + 4 * i));
        cr_assert_eq(b, rd32(fb + 4 * i), "bf16 0x%04x -> 0x%08" PRIx32 ", torch 0x%08" PRIx32, x, b, rd32(fb + 4 * i));
    }
    free(buf);
}

Test(tensor_half, every_sixteen_bit_pattern_matches_torch_crc)
{
    uint32_t ch = 0, cb = 0;
    for (uint32_t x = 0; x < 65536; x++) {
        ch = crc_u32(ch, th_f32_bits(ts_f16_to_f32((uint16_t)x)));
        cb = crc_u32(cb, th_f32_bits(ts_bf16_to_f32((uint16_t)x)));
    }
    cr_assert_eq(ch, torch_crc("f16_to_f32_all"), "f16 -> f32 over all patterns: crc 0x%08" PRIx32, ch);
    cr_assert_eq(cb, torch_crc("bf16_to_f32_all"), "bf16 -> f32 over all patterns: crc 0x%08" PRIx32, cb);
}

Test(tensor_half, f32_sweep_matches_torch_crc)
{
    /* float32 patterns (k * 0x9E3779B1) mod 2^32 for k < 2^24 */
    uint32_t cb = 0, ch = 0;
    for (uint32_t k = 0; k < (1u << 24); k++) {
        float f = th_f32_of(k * 0x9E3779B1u);
        cb = crc_u16(cb, ts_f32_to_bf16(f));
        ch = crc_u16(ch, ts_f32_to_f16(f));
    }
    cr_assert_eq(cb, torch_crc("f32_to_bf16_sweep"), "bf16 sweep crc 0x%08" PRIx32, cb);
    cr_assert_eq(ch, torch_crc("f32_to_f16_sweep"), "f16 sweep crc 0x%08" PRIx32, ch);
}

Test(tensor_half, round_trips_and_nan)
{
    for (uint32_t x = 0; x < 65536; x++) {
        uint16_t h = (uint16_t)x;
        bool h_nan = (h & 0x7C00) == 0x7C00 && (h & 0x3FF);
        bool b_nan = (h & 0x7F80) == 0x7F80 && (h & 0x7F);
        if (!h_nan) cr_assert_eq(ts_f32_to_f16(ts_f16_to_f32(h)), h, "f16 0x%04x", h);
        else cr_assert_eq(ts_f32_to_f16(ts_f16_to_f32(h)), (h & 0x8000) | 0x7E00, "f16 NaN 0x%04x", h);
        if (!b_nan) cr_assert_eq(ts_f32_to_bf16(ts_bf16_to_f32(h)), h, "bf16 0x%04x", h);
        else cr_assert_eq(ts_f32_to_bf16(ts_bf16_to_f32(h)), 0x7FC0, "bf16 NaN 0x%04x", h);
    }
    /* c10: every NaN is 0x7FC0 in bf16 (sign and payload dropped); f16 keeps the sign */
    cr_assert_eq(ts_f32_to_bf16(th_f32_of(0xFFC00000u)), 0x7FC0);
    cr_assert_eq(ts_f32_to_bf16(th_f32_of(0x7FFF8000u)), 0x7FC0);
    cr_assert_eq(ts_f32_to_f16(th_f32_of(0xFFC00001u)), 0xFE00);
    cr_assert_eq(ts_f32_to_bf16(-0.0f), 0x8000);
    cr_assert_eq(ts_f32_to_f16(-0.0f), 0x8000);
    cr_assert_eq(ts_f32_to_bf16(1.0f), 0x3F80);
    cr_assert_eq(ts_f32_to_f16(65504.0f), 0x7BFF);
    cr_assert_eq(ts_f32_to_f16(65520.0f), 0x7C00);
}

Test(tensor_half, results_do_not_depend_on_the_rounding_mode)
{
    static const uint32_t xs[] = {0x3F808000u, 0x3F818000u, 0x33000001u, 0x33C00000u, 0x387FF000u,
                                  0x477FEFFFu, 0x00018000u, 0xBF801000u, 0x7F7F8000u, 0x00000001u};
    uint16_t b[10], h[10];
    uint32_t fb[10], fh[10];
    for (int i = 0; i < 10; i++) {
        b[i] = ts_f32_to_bf16(th_f32_of(xs[i]));
        h[i] = ts_f32_to_f16(th_f32_of(xs[i]));
        fb[i] = th_f32_bits(ts_bf16_to_f32((uint16_t)xs[i]));
        fh[i] = th_f32_bits(ts_f16_to_f32((uint16_t)xs[i]));
    }
    static const int modes[] = {FE_UPWARD, FE_DOWNWARD, FE_TOWARDZERO};
    for (int m = 0; m < 3; m++) {
        cr_assert_eq(fesetround(modes[m]), 0);
        for (int i = 0; i < 10; i++) {
            cr_assert_eq(ts_f32_to_bf16(th_f32_of(xs[i])), b[i]);
            cr_assert_eq(ts_f32_to_f16(th_f32_of(xs[i])), h[i]);
            cr_assert_eq(th_f32_bits(ts_bf16_to_f32((uint16_t)xs[i])), fb[i]);
            cr_assert_eq(th_f32_bits(ts_f16_to_f32((uint16_t)xs[i])), fh[i]);
        }
    }
    fesetround(FE_TONEAREST);
}
