/* Per-dtype buffer kernels (see tensor/kernels.h). */
#include "tensor/kernels.h"
#include "tensor/internal.h"

static void to_f32(float *d, ts_dtype sd, const void *src, int64_t n)
{
    switch (sd) {
    case TS_F32: memmove(d, src, (size_t)n * sizeof *d); return;
    case TS_BF16: {
        const uint16_t *s = src;
        for (int64_t i = 0; i < n; i++)
            d[i] = ts__bf16_to_f32(s[i]);
        return;
    }
    case TS_F16: {
        const uint16_t *s = src;
        for (int64_t i = 0; i < n; i++)
            d[i] = ts_f16_to_f32(s[i]);
        return;
    }
    default:
        for (int64_t i = 0; i < n; i++)
            d[i] = (float)ts__load(sd, src, i);
        return;
    }
}

static void from_f32(ts_dtype dd, void *dst, const float *s, int64_t n)
{
    switch (dd) {
    case TS_F32: memmove(dst, s, (size_t)n * sizeof *s); return;
    case TS_BF16: {
        uint16_t *d = dst;
        for (int64_t i = 0; i < n; i++)
            d[i] = ts__f32_to_bf16(s[i]);
        return;
    }
    case TS_F16: {
        uint16_t *d = dst;
        for (int64_t i = 0; i < n; i++)
            d[i] = ts_f32_to_f16(s[i]);
        return;
    }
    default:
        for (int64_t i = 0; i < n; i++)
            ts__store(dd, dst, i, (double)s[i]);
        return;
    }
}

void ts__buf_convert(ts_dtype dd, void *dst, ts_dtype sd, const void *src, int64_t n)
{
    if (n <= 0)
        return;
    if (dd == sd) {
        memmove(dst, src, (size_t)n * ts_dtype_size(dd));
        return;
    }
    if (dd == TS_F32 && (sd == TS_BF16 || sd == TS_F16)) {
        to_f32(dst, sd, src, n);
        return;
    }
    if (sd == TS_F32 && (dd == TS_BF16 || dd == TS_F16)) {
        from_f32(dd, dst, src, n);
        return;
    }
    for (int64_t i = 0; i < n; i++)
        ts__store(dd, dst, i, ts__load(sd, src, i));
}
