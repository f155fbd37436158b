/*
 * The dtype glue of the reductions: loading a source into the
 * accumulation dtype, reducing into it, storing it back
 * (comm/world_internal.h). Calls only tensor/kernels.h's buffer kernels.
 */
#include "comm/world_internal.h"
#include "tensor/kernels.h" /* the per-dtype buffer kernels of the reductions */

#include <string.h>

/* ------------------------------------------------------------------ */
/* Dtypes and reductions                                               */
/* ------------------------------------------------------------------ */

bool ts__comm_reducible(ts_dtype d) { return d == TS_F32 || d == TS_F64 || d == TS_BF16 || d == TS_F16 || d == TS_I64; }

/* The buffer kernels' element operation of a reduce op (AVG sums; the
 * division comes with the post factor). */
static ts__buf_op buf_op(ts_reduce_op rop)
{
    switch (rop) {
    case TS_REDUCE_MAX: return TS__BUF_MAX;
    case TS_REDUCE_MIN: return TS__BUF_MIN;
    default: return TS__BUF_SUM;
    }
}

/* dst[i] (acc) = src[i] / div, converted (the division in acc, after the
 * conversion: tensor/kernels.h's ts__buf_div). */
void ts__comm_load_acc(void *dst, ts_dtype acc, const void *src, ts_dtype d, size_t n, double div)
{
    ts__buf_convert(acc, dst, d, src, (int64_t)n);
    ts__buf_div(acc, dst, (int64_t)n, div);
}

/* dst[i] = src[i] (acc) / div, converted to d (the division in acc,
 * before the conversion; src is divided in place). */
void ts__comm_store_acc(void *dst, ts_dtype d, void *src, size_t n, double div)
{
    ts_dtype acc = ts__acc_dtype(d);
    ts__buf_div(acc, src, (int64_t)n, div);
    ts__buf_convert(d, dst, acc, src, (int64_t)n);
}

/* dst = dst op src, n accumulation elements (AVG sums). */
static void reduce_into(void *dst, const void *src, ts_dtype acc, ts_reduce_op rop, size_t n)
{
    ts__buf_reduce(acc, buf_op(rop), dst, dst, src, (int64_t)n);
}

#define CHUNK 2048 /* elements converted at a time through a stack buffer */

/* acc[i] = acc[i] op (src[i] / pre), src converted from sd to the
 * accumulation dtype ad; n elements. */
void ts__comm_accumulate(void *acc, ts_dtype ad, const void *src, ts_dtype sd, double pre, ts_reduce_op rop, size_t n)
{
    if (sd == ad && pre == 1.0) {
        reduce_into(acc, src, ad, rop, n);
        return;
    }
    _Alignas(64) unsigned char tmp[CHUNK * 8];
    size_t ae = ts_dtype_size(ad), se = ts_dtype_size(sd);
    for (size_t i = 0; i < n; i += CHUNK) {
        size_t k = n - i < CHUNK ? n - i : CHUNK;
        ts__comm_load_acc(tmp, ad, (const unsigned char *)src + i * se, sd, k, pre);
        reduce_into((unsigned char *)acc + i * ae, tmp, ad, rop, k);
    }
}

/* out[i] = (part[i] op src[i] / pre) / post, converted to od: the last
 * reduce-scatter step, in one pass (part is read, not written). */
void ts__comm_reduce_store(void *out, ts_dtype od, const void *part, ts_dtype ad, const void *src, ts_dtype sd,
                           double pre, ts_reduce_op rop, double post, size_t n)
{
    if (od == ad && sd == ad && pre == 1.0 && post == 1.0) {
        ts__buf_reduce(ad, buf_op(rop), out, part, src, (int64_t)n);
        return;
    }
    _Alignas(64) unsigned char tmp[CHUNK * 8];
    size_t oe = ts_dtype_size(od), ae = ts_dtype_size(ad), se = ts_dtype_size(sd);
    for (size_t i = 0; i < n; i += CHUNK) {
        size_t k = n - i < CHUNK ? n - i : CHUNK;
        memcpy(tmp, (const unsigned char *)part + i * ae, k * ae);
        ts__comm_accumulate(tmp, ad, (const unsigned char *)src + i * se, sd, pre, rop, k);
        ts__comm_store_acc((unsigned char *)out + i * oe, od, tmp, k, post);
    }
}

/* out[i] = (src[i] / pre) / post, through the accumulation dtype ad: the
 * one-rank reduce-scatter. */
void ts__comm_convert_through(void *out, ts_dtype od, const void *src, ts_dtype sd, ts_dtype ad, double pre,
                              double post, size_t n)
{
    _Alignas(64) unsigned char tmp[CHUNK * 8];
    size_t oe = ts_dtype_size(od), se = ts_dtype_size(sd);
    for (size_t i = 0; i < n; i += CHUNK) {
        size_t k = n - i < CHUNK ? n - i : CHUNK;
        ts__comm_load_acc(tmp, ad, (const unsigned char *)src + i * se, sd, k, pre);
        ts__comm_store_acc((unsigned char *)out + i * oe, od, tmp, k, post);
    }
}
