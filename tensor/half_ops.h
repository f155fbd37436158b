/*
 * Element helpers of the bfloat16 / float16 paths of the nn ops
 * (tensor/ops_nn.c, ops_attention.c and the softmax of ops_reduce.c):
 * one 16-bit value to float and back, and float rounded to a 16-bit
 * dtype, with tensor/kernels.h's conversions (torch 1.13's c10::BFloat16
 * and c10::Half results). Not installed; library-internal.
 */
#ifndef TS_TENSOR_HALF_OPS_H
#define TS_TENSOR_HALF_OPS_H

#include "tensor/kernels.h"

/* h (a bfloat16 or float16 bit pattern, by d) as float. */
static inline float ts__half_to_f32(ts_dtype d, uint16_t h)
{
    return d == TS_BF16 ? ts__bf16_to_f32(h) : ts_f16_to_f32(h);
}

/* f rounded to the 16-bit dtype d (nearest even), as a bit pattern. */
static inline uint16_t ts__f32_to_half(ts_dtype d, float f)
{
    return d == TS_BF16 ? ts__f32_to_bf16(f) : ts_f32_to_f16(f);
}

/* f rounded to the 16-bit dtype d and back: what an op that stores a
 * result in d and the next op that reads it see. */
static inline float ts__round_half(ts_dtype d, float f) { return ts__half_to_f32(d, ts__f32_to_half(d, f)); }

/* x[i] = ts__round_half(d, x[i]) for i < n. */
static inline void ts__round_half_buf(ts_dtype d, float *x, int64_t n)
{
    for (int64_t i = 0; i < n; i++) x[i] = ts__round_half(d, x[i]);
}

/* Softmax (log_form false) or log_softmax over the rows of a contiguous
 * (rows, n) bfloat16 / float16 buffer, and their backward
 * (tensor/ops_nn.c). ts__softmax_rows_half (tensor/ops_reduce.c) runs
 * the float32 row kernel on each row converted to float and rounds the
 * result once; ts__softmax_rows_half_ref is the same arithmetic element by
 * element (the reference kernels, and the fallback when no row buffer can
 * be had): both give the float32 run rounded, bit for bit. */
void ts__softmax_rows_half(ts_dtype dt, const void *x, void *y, int64_t rows, int64_t n, bool log_form);
void ts__softmax_rows_half_ref(ts_dtype dt, const void *x, void *y, int64_t rows, int64_t n, bool log_form);
void ts__softmax_bw_rows_half(ts_dtype dt, const void *g, const void *y, void *gx, int64_t rows, int64_t n,
                              bool log_form);

/* The dropout noise of torch 1.13's CPU _dropout in the 16-bit dtype dt:
 * empty(shape).bernoulli_(1 - p) (drawn as for float32: the same draws in
 * the same order), then div_(1 - p) in dt: kept elements are
 * round(1 / round(1 - p)), dropped ones 0. p == 1 draws nothing and gives
 * zeros. A new contiguous tensor in *out (tensor/ops_nn.c). */
ts_status ts__dropout_noise_half(ts_dtype dt, int ndim, const int64_t *shape, double p, ts_generator *gen,
                                 ts_tensor **out);

#endif
