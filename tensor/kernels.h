/*
 * Per-dtype buffer kernels of the library: loops over contiguous buffers
 * that the tensor ops, comm, fully_shard and optim share (conversion
 * between dtypes and the element conversions inlined into the ops' loops).
 * Not installed; library-internal (`ts__` prefix).
 */
#ifndef TS_TENSOR_KERNELS_H
#define TS_TENSOR_KERNELS_H

#include "tensor/tensor.h"

#include <string.h>

/* The element conversions of ts_f32_to_bf16 & co. (tensor/half.c, which
 * documents their results), inlined so that loops over them vectorise. */
static inline float ts__bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t ts__f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & UINT32_C(0x7FFFFFFF)) > UINT32_C(0x7F800000))
        return UINT16_C(0x7FC0);
    return (uint16_t)((u + ((u >> 16) & 1u) + UINT32_C(0x7FFF)) >> 16);
}

/* The dtype an op accumulates in for inputs of dtype d: float32 for
 * float32, bfloat16 and float16 (PyTorch's CPU kernels), float64 for
 * float64; d itself for integer dtypes. */
static inline ts_dtype ts__acc_dtype(ts_dtype d)
{
    return d == TS_BF16 || d == TS_F16 ? TS_F32 : d;
}

/* True for the 16-bit floating dtypes. */
static inline bool ts__is_half(ts_dtype d)
{
    return d == TS_BF16 || d == TS_F16;
}

/* dst[i] = src[i] converted from `sd` to `dd` for i < n (contiguous,
 * non-overlapping unless dd == sd). Conversions are ts__store's
 * (PyTorch's static_cast: to bf16/f16 through float, rounded to nearest
 * even; to integers truncated, saturated, NaN to 0; bool as != 0). */
void ts__buf_convert(ts_dtype dd, void *dst, ts_dtype sd, const void *src, int64_t n);

#endif
