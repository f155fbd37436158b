#define _GNU_SOURCE
#include "tensor/internal.h"

#include <math.h>

#define TS__DT_ONE(e, name, size, isf) +1
_Static_assert((0 TS_DTYPE_TABLE(TS__DT_ONE)) == TS_DTYPE_COUNT, "dtype table and enum disagree");
#undef TS__DT_ONE

size_t ts_dtype_size(ts_dtype d)
{
    switch (d) {
#define TS__DT_SIZE(e, name, size, isf) \
    case e: return size;
        TS_DTYPE_TABLE(TS__DT_SIZE)
#undef TS__DT_SIZE
    case TS_DTYPE_COUNT: break;
    }
    return 0;
}

const char *ts_dtype_name(ts_dtype d)
{
    switch (d) {
#define TS__DT_NAME(e, name, size, isf) \
    case e: return name;
        TS_DTYPE_TABLE(TS__DT_NAME)
#undef TS__DT_NAME
    case TS_DTYPE_COUNT: break;
    }
    return "invalid";
}

bool ts_dtype_is_float(ts_dtype d)
{
    switch (d) {
#define TS__DT_ISF(e, name, size, isf) \
    case e: return isf;
        TS_DTYPE_TABLE(TS__DT_ISF)
#undef TS__DT_ISF
    case TS_DTYPE_COUNT: break;
    }
    return false;
}

double ts__load(ts_dtype d, const void *p, int64_t i)
{
    switch (d) {
    case TS_F32: return ((const float *)p)[i];
    case TS_F64: return ((const double *)p)[i];
    case TS_BF16: return ts_bf16_to_f32(((const uint16_t *)p)[i]);
    case TS_F16: return ts_f16_to_f32(((const uint16_t *)p)[i]);
    case TS_I64: return (double)((const int64_t *)p)[i];
    case TS_I32: return ((const int32_t *)p)[i];
    case TS_BOOL: return ((const uint8_t *)p)[i] ? 1.0 : 0.0;
    case TS_DTYPE_COUNT: break;
    }
    TS_ASSERT(!"invalid dtype");
    return 0;
}

ts_status ts__check_scalar(const char *op, ts_dtype d, double v)
{
    double lo = 0, hi = 0; /* the range: lo <= v <= hi (integers: lo <= v < hi) */
    switch (d) {
    case TS_BOOL:
    case TS_F64:
    case TS_DTYPE_COUNT: return TS_OK;
    case TS_F32: lo = -3.4028234663852886e38, hi = 3.4028234663852886e38; break;
    case TS_BF16: lo = -3.3895313892515355e38, hi = 3.3895313892515355e38; break;
    case TS_F16: lo = -65504.0, hi = 65504.0; break;
    case TS_I64:
        lo = -9223372036854775808.0, hi = 9223372036854775808.0; /* 2^63 itself does not fit */
        break;
    case TS_I32: lo = -2147483648.0, hi = 2147483648.0; break;
    }
    bool isf = ts_dtype_is_float(d);
    if (isf ? (isnan(v) || isinf(v) || (v >= lo && v <= hi)) : (v >= lo && v < hi)) return TS_OK;
    if (isf)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "%s: value %.17g cannot be converted to %s without overflow (its largest finite value is "
                        "%.9g; pass an infinity for an infinite fill)",
                        op, v, ts_dtype_name(d), hi);
    long long min = d == TS_I64 ? INT64_MIN : INT32_MIN, max = d == TS_I64 ? INT64_MAX : INT32_MAX;
    return ts_error(TS_ERR_INVALID_ARGUMENT,
                    "%s: value %.17g cannot be converted to %s without overflow (%s holds %lld to %lld)", op, v,
                    ts_dtype_name(d), ts_dtype_name(d), min, max);
}

/* Conversions follow PyTorch's static_cast semantics: to the reduced
 * float types through float (c10::Half/BFloat16 take a float), integers
 * by truncation, bool as != 0. */
void ts__store(ts_dtype d, void *p, int64_t i, double v)
{
    switch (d) {
    case TS_F32: ((float *)p)[i] = (float)v; return;
    case TS_F64: ((double *)p)[i] = v; return;
    case TS_BF16: ((uint16_t *)p)[i] = ts_f32_to_bf16((float)v); return;
    case TS_F16: ((uint16_t *)p)[i] = ts_f32_to_f16((float)v); return;
    case TS_I64:
        ((int64_t *)p)[i] = v != v        ? 0
            : v >= 9.2233720368547758e18  ? INT64_MAX
            : v <= -9.2233720368547758e18 ? INT64_MIN
                                          : (int64_t)v;
        return;
    case TS_I32:
        ((int32_t *)p)[i] = v != v ? 0 : v >= 2147483647.0 ? INT32_MAX : v <= -2147483648.0 ? INT32_MIN : (int32_t)v;
        return;
    case TS_BOOL: ((uint8_t *)p)[i] = v != 0; return;
    case TS_DTYPE_COUNT: break;
    }
    TS_ASSERT(!"invalid dtype");
}
