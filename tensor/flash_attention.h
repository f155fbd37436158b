/*
 * Fused float32 attention in the style of FlashAttention-2 (library-internal,
 * `ts__` prefix; ts_attention in tensor/ops_attention.c calls it).
 *
 * Per batch b and head h, the queries are taken in blocks of
 * TS__FLASH_BR rows against blocks of TS__FLASH_BC keys: the scores of one
 * block pair live in a BR x BC tile (8 KiB, in L1), the softmax is online
 * (a running maximum m and sum l per query row, the output accumulator
 * rescaled by exp(m_old - m_new) when the maximum grows), and nothing of
 * size T x S is ever written. The forward saves the output O and the
 * log-sum-exp L = m + log(l) per row; the backward recomputes the
 * probabilities P = exp(scale * q k^T - L) block by block and forms
 * dV += P^T dO, dS = P * (dO V^T - rowsum(dO * O)), dQ += scale dS K,
 * dK += scale dS^T Q (Dao, "FlashAttention-2", 2023, Algorithm 2).
 *
 * Dropout (training, p > 0) multiplies the probabilities by a keep mask Z
 * scaled by 1/(1-p), drawn beforehand in bits (PyTorch's bernoulli draws,
 * ts__rng_bernoulli_bits): the forward zeroes the dropped probabilities of
 * each tile after the online softmax's sum (the normalisation is over all
 * keys) and scales the output by 1/(1-p); the backward uses W = P o Z
 * scaled for dV += W^T dO and dP = (dO V^T) o Z scaled, with D =
 * rowsum(dO o O) of the dropped output and dS = P o (dP - D) as before.
 *
 * A bool mask (T, S) (true = may not attend, PyTorch's attn_mask) is
 * classified once per call into block pairs that are all visible, all
 * masked (skipped: a causal mask skips the blocks above the diagonal) or
 * mixed (masked per element). Rows that the mask hides entirely give NaN
 * in PyTorch and in ts_attention's reference path; the caller sends them
 * there (ts__flash_mask_ok).
 *
 * Run-time paths (tensor/kernels.h): scalar (the reference), avx2
 * (AVX2 + FMA, 8 lanes) and avx512 (AVX-512F, 16 lanes; the avx512bf16
 * path runs it too). The paths differ only in the order of the products'
 * sums; the exponential is ts__exp_f32's (tensor/fastmath.h) operation for
 * operation on every path. Work is split over the (b, h) pairs on
 * ts_get_num_threads() threads.
 */
#ifndef TS_TENSOR_FLASH_ATTENTION_H
#define TS_TENSOR_FLASH_ATTENTION_H

#include "tensor/kernels.h"

#include <stdbool.h>
#include <stdint.h>

#define TS__FLASH_BR 32 /* query rows per block */
#define TS__FLASH_BC 32 /* keys per block */

/* 32-bit words per query row of a dropout keep mask over S keys: one
 * word per key block. */
#define TS__FLASH_KEEP_WORDS(S) (((S) + TS__FLASH_BC - 1) / TS__FLASH_BC)

/* One attention problem: q (B, T, E), k and v (B, S, E) with element
 * strides (batch, row; unit column stride), head h at columns
 * [h*hd, (h+1)*hd); mask (T, S) contiguous bytes (nonzero = masked) or
 * NULL; scale multiplies the scores (1/sqrt(hd)).
 * Dropout on the probabilities: keep NULL (none), or the keep mask
 * (B, H, T, S) in bits, B*H*T rows of TS__FLASH_KEEP_WORDS(S) words,
 * key s of a row at bit s % 32 of word s / 32 (1 = kept; what
 * ts__rng_bernoulli_bits writes); a kept probability is multiplied by
 * drop_scale (1/(1-p)), a dropped one is 0. The log-sum-exp stays the
 * one of the probabilities before dropout. */
typedef struct ts__flash_problem {
    int64_t B, H, T, S, hd;
    const float *q, *k, *v;
    int64_t q_sb, q_st, k_sb, k_st, v_sb, v_st;
    const uint8_t *mask;
    float scale;
    const uint32_t *keep;
    float drop_scale;
} ts__flash_problem;

/* True when every row of the (T, S) mask has at least one visible key
 * (NULL: true): the rows the fused kernel supports. */
bool ts__flash_mask_ok(const uint8_t *mask, int64_t T, int64_t S);

/* Forward on path p (supported): o (B, T, E) contiguous, lse (B, H, T)
 * contiguous (natural log). TS_ERR_NO_MEMORY when scratch cannot be
 * allocated (o and lse are then undefined). */
ts_status ts__flash_forward(ts__kpath p, const ts__flash_problem *pr, float *o, float *lse);

/* Backward on path p: from the forward's o and lse and the output's
 * gradient go (B, T, E) contiguous, writes dq (B, T, E), dk and dv
 * (B, S, E), contiguous, overwriting them. TS_ERR_NO_MEMORY as above. */
ts_status ts__flash_backward(ts__kpath p, const ts__flash_problem *pr, const float *o, const float *lse,
                             const float *go, float *dq, float *dk, float *dv);

/* Whether ts_attention takes the fused kernel where it applies (float32,
 * no wholly masked row): TS_ATTENTION=reference
 * (read once) or ts__flash_force(0) sends every call to the unfused
 * reference path, TS_ATTENTION=fused (the default) or ts__flash_force(1)
 * to the fused one; ts__flash_force(-1) removes the test override.
 * Thread-safe. */
bool ts__flash_enabled(void);
void ts__flash_force(int on);

#endif
