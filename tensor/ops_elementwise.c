/* Elementwise ops. One engine for binary ops (with broadcasting) and one
 * for unary ops; each has an optimized path (typed loops specialised per op
 * by inlining) and a reference path (through double, any layout) that
 * tests compare against it. Backward formulas use the same engines with
 * fused "backward" ops so that a gradient costs one pass. */
#define _GNU_SOURCE
#include "tensor/fastmath.h"
#include "tensor/internal.h"
#include "tensor/kernels.h"

#include <math.h>
#include <string.h>

typedef enum bop {
    B_ADD,
    B_SUB,
    B_MUL,
    B_DIV,
    /* fused backward ops: x = incoming gradient, y = saved tensor */
    B_DIV_BW_B,   /* -x * y / p... computed as -g*out/b: y = out, p unused -> see div backward */
    B_RELU_BW,    /* x * (y > 0), y = input */
    B_TANH_BW,    /* x * (1 - y*y), y = output */
    B_SIGMOID_BW, /* x * y * (1 - y), y = output */
    B_SQRT_BW,    /* x / (2y), y = output */
    B_RSQRT_BW,   /* -0.5 * x * y^3, y = output */
    B_GELU_BW,    /* x * gelu'(y), y = input */
    B_GELU_TANH_BW,
    B_POW_BW, /* x * p * y^(p-1), y = input */
    B_ABS_BW, /* x * sign(y), y = input (sign(0) = sign(NaN) = 0, as torch's sgn) */
    B_EQ,     /* bool output */
    B_NE,
    B_LT,
    B_LE,
    B_GT,
    B_GE, /* bool output */
    B_COUNT
} bop;

typedef enum uop {
    U_NEG,
    U_EXP,
    U_LOG,
    U_SQRT,
    U_RSQRT,
    U_TANH,
    U_SIGMOID,
    U_RELU,
    U_GELU,
    U_GELU_TANH,
    U_ADD_S,
    U_MUL_S,
    U_DIV_S,
    U_RSUB_S,
    U_POW_S,
    U_ABS,
    U_COUNT
} uop;

static const char *const bop_names[B_COUNT] = {"add",
                                               "sub",
                                               "mul",
                                               "div",
                                               "div_backward",
                                               "relu_backward",
                                               "tanh_backward",
                                               "sigmoid_backward",
                                               "sqrt_backward",
                                               "rsqrt_backward",
                                               "gelu_backward",
                                               "gelu_backward",
                                               "pow_backward",
                                               "abs_backward",
                                               "eq",
                                               "ne",
                                               "lt",
                                               "le",
                                               "gt",
                                               "ge"};
static const char *const uop_names[U_COUNT] = {
    "neg",  "exp",  "log",        "sqrt",       "rsqrt",      "tanh",        "sigmoid",    "relu",
    "gelu", "gelu", "add_scalar", "mul_scalar", "div_scalar", "rsub_scalar", "pow_scalar", "abs"};
_Static_assert(sizeof bop_names / sizeof *bop_names == B_COUNT, "bop names");
_Static_assert(sizeof uop_names / sizeof *uop_names == U_COUNT, "uop names");

#define K_SQRT_2_PI 0.7978845608028654 /* sqrt(2/pi) */
#define K_INV_SQRT_2 0.7071067811865476
#define K_INV_SQRT_2PI 0.3989422804014327

/* ----------------------------------------------------- scalar formulas */

static inline __attribute__((always_inline)) double bin_d(bop op, double x, double y, double p)
{
    switch (op) {
    case B_ADD: return x + y;
    case B_SUB: return x - y;
    case B_MUL: return x * y;
    case B_DIV: return x / y;
    case B_DIV_BW_B: return -x * y;
    case B_RELU_BW: return y > 0 ? x : 0.0;
    case B_TANH_BW: return x * (1.0 - y * y);
    case B_SIGMOID_BW: return x * y * (1.0 - y);
    case B_SQRT_BW: return x / (2.0 * y);
    case B_RSQRT_BW: return -0.5 * x * y * y * y;
    case B_GELU_BW: {
        double cdf = 0.5 * (1.0 + erf(y * K_INV_SQRT_2));
        double pdf = K_INV_SQRT_2PI * exp(-0.5 * y * y);
        return x * (cdf + y * pdf);
    }
    case B_GELU_TANH_BW: {
        double inner = K_SQRT_2_PI * (y + 0.044715 * y * y * y);
        double t = tanh(inner);
        double dinner = K_SQRT_2_PI * (1.0 + 3.0 * 0.044715 * y * y);
        return x * (0.5 * (1.0 + t) + 0.5 * y * (1.0 - t * t) * dinner);
    }
    case B_POW_BW: return p == 0.0 ? 0.0 : x * p * pow(y, p - 1.0);
    case B_ABS_BW: return x * (double)((y > 0) - (y < 0));
    case B_EQ: return x == y;
    case B_NE: return x != y;
    case B_LT: return x < y;
    case B_LE: return x <= y;
    case B_GT: return x > y;
    case B_GE: return x >= y;
    case B_COUNT: break;
    }
    return 0;
}

static inline __attribute__((always_inline)) float bin_f(bop op, float x, float y, float p)
{
    switch (op) {
    case B_ADD: return x + y;
    case B_SUB: return x - y;
    case B_MUL: return x * y;
    case B_DIV: return x / y;
    case B_DIV_BW_B: return -x * y;
    case B_RELU_BW: return y > 0 ? x : 0.0f;
    case B_TANH_BW: return x * (1.0f - y * y);
    case B_SIGMOID_BW: return x * y * (1.0f - y);
    case B_SQRT_BW: return x / (2.0f * y);
    case B_RSQRT_BW: return -0.5f * x * y * y * y;
    case B_GELU_BW: {
        float cdf = 0.5f * (1.0f + ts__erf_f32(y * (float)K_INV_SQRT_2));
        float pdf = (float)K_INV_SQRT_2PI * ts__exp_f32(-0.5f * y * y);
        return x * (cdf + y * pdf);
    }
    case B_GELU_TANH_BW: {
        float inner = (float)K_SQRT_2_PI * (y + 0.044715f * y * y * y);
        float t = tanhf(inner);
        float dinner = (float)K_SQRT_2_PI * (1.0f + 3.0f * 0.044715f * y * y);
        return x * (0.5f * (1.0f + t) + 0.5f * y * (1.0f - t * t) * dinner);
    }
    case B_POW_BW: return p == 0.0f ? 0.0f : x * p * powf(y, p - 1.0f);
    case B_ABS_BW: return x * (float)((y > 0) - (y < 0));
    case B_EQ:
    case B_NE:
    case B_LT:
    case B_LE:
    case B_GT:
    case B_GE:
    case B_COUNT: break;
    }
    return 0;
}

static inline __attribute__((always_inline)) double un_d(uop op, double x, double p)
{
    switch (op) {
    case U_NEG: return -x;
    case U_EXP: return exp(x);
    case U_LOG: return log(x);
    case U_SQRT: return sqrt(x);
    case U_RSQRT: return 1.0 / sqrt(x);
    case U_TANH: return tanh(x);
    case U_SIGMOID: return 1.0 / (1.0 + exp(-x));
    case U_RELU: return x > 0 ? x : (x != x ? x : 0.0);
    case U_GELU: return 0.5 * x * (1.0 + erf(x * K_INV_SQRT_2));
    case U_GELU_TANH: return 0.5 * x * (1.0 + tanh(K_SQRT_2_PI * (x + 0.044715 * x * x * x)));
    case U_ADD_S: return x + p;
    case U_MUL_S: return x * p;
    case U_DIV_S: return x / p;
    case U_RSUB_S: return p - x;
    case U_POW_S: return p == 2.0 ? x * x : pow(x, p);
    case U_ABS: return fabs(x);
    case U_COUNT: break;
    }
    return 0;
}

static inline __attribute__((always_inline)) float un_f(uop op, float x, float p)
{
    switch (op) {
    case U_NEG: return -x;
    case U_EXP: return expf(x);
    case U_LOG: return logf(x);
    case U_SQRT: return sqrtf(x);
    case U_RSQRT: return 1.0f / sqrtf(x);
    case U_TANH: return tanhf(x);
    case U_SIGMOID: return 1.0f / (1.0f + expf(-x));
    case U_RELU: return x > 0 ? x : (x != x ? x : 0.0f);
    case U_GELU: return 0.5f * x * (1.0f + ts__erf_f32(x * (float)K_INV_SQRT_2));
    case U_GELU_TANH: return 0.5f * x * (1.0f + tanhf((float)K_SQRT_2_PI * (x + 0.044715f * x * x * x)));
    case U_ADD_S: return x + p;
    case U_MUL_S: return x * p;
    case U_DIV_S: return x / p;
    case U_RSUB_S: return p - x;
    case U_POW_S: return p == 2.0f ? x * x : powf(x, p);
    case U_ABS: return fabsf(x);
    case U_COUNT: break;
    }
    return 0;
}

/* Geometry of a binary op: output (contiguous) shape and the operands'
 * strides broadcast to it. */
typedef struct bgeom {
    int nd;
    int64_t shape[TS_MAX_DIMS];
    int64_t str[3][TS_MAX_DIMS]; /* out, a, b */
} bgeom;

static inline __attribute__((always_inline)) void bin_loop_f32(bop op, const bgeom *g, float *o, const float *a,
                                                               const float *b, float p)
{
    int nd = g->nd;
    if (nd == 0) {
        o[0] = bin_f(op, a[0], b[0], p);
        return;
    }
    int64_t idx[TS_MAX_DIMS] = {0}, offs[3] = {0, 0, 0}, str[3][TS_MAX_DIMS];
    memcpy(str, g->str, sizeof str);
    int64_t n = g->shape[nd - 1], sa = str[1][nd - 1], sb = str[2][nd - 1];
    do {
        /* outputs are fresh tensors: they never alias the inputs */
        float *restrict oo = o + offs[0];
        const float *restrict aa = a + offs[1], *restrict bb = b + offs[2];
        if (sa == 1 && sb == 1)
            for (int64_t i = 0; i < n; i++) oo[i] = bin_f(op, aa[i], bb[i], p);
        else if (sa == 1 && sb == 0)
            for (int64_t i = 0; i < n; i++) oo[i] = bin_f(op, aa[i], bb[0], p);
        else if (sa == 0 && sb == 1)
            for (int64_t i = 0; i < n; i++) oo[i] = bin_f(op, aa[0], bb[i], p);
        else
            for (int64_t i = 0; i < n; i++) oo[i] = bin_f(op, aa[i * sa], bb[i * sb], p);
    } while (ts__next_outer(nd, g->shape, idx, 3, str, offs));
}

static inline __attribute__((always_inline)) void bin_loop_f64(bop op, const bgeom *g, double *o, const double *a,
                                                               const double *b, double p)
{
    int nd = g->nd;
    if (nd == 0) {
        o[0] = bin_d(op, a[0], b[0], p);
        return;
    }
    int64_t idx[TS_MAX_DIMS] = {0}, offs[3] = {0, 0, 0}, str[3][TS_MAX_DIMS];
    memcpy(str, g->str, sizeof str);
    int64_t n = g->shape[nd - 1], sa = str[1][nd - 1], sb = str[2][nd - 1];
    do {
        double *restrict oo = o + offs[0];
        const double *restrict aa = a + offs[1], *restrict bb = b + offs[2];
        for (int64_t i = 0; i < n; i++) oo[i] = bin_d(op, aa[i * sa], bb[i * sb], p);
    } while (ts__next_outer(nd, g->shape, idx, 3, str, offs));
}

/* The 16-bit dtypes (PyTorch's CPU semantics for bfloat16 and float16):
 * each element is loaded as float, computed by the float32 formula of
 * bin_f / un_f and rounded once to the dtype, so a result equals the
 * float32 op on the upcast inputs, rounded. */
static inline __attribute__((always_inline)) float ld_h(ts_dtype d, const uint16_t *p, int64_t i)
{
    return d == TS_BF16 ? ts__bf16_to_f32(p[i]) : ts_f16_to_f32(p[i]);
}

static inline __attribute__((always_inline)) void st_h(ts_dtype d, uint16_t *p, int64_t i, float v)
{
    p[i] = d == TS_BF16 ? ts__f32_to_bf16(v) : ts_f32_to_f16(v);
}

/* float16 goes through float blocks converted by the vectorised
 * ts__buf_convert (the scalar f16 conversions are branchy and not inlined:
 * 20-40x slower than float32 per element); the bits are the same. */
enum { H_BLOCK = 256 };

static inline void ld_block_f16(float *d, const uint16_t *p, int64_t stride, int64_t m)
{
    if (stride == 1) {
        ts__buf_convert(TS_F32, d, TS_F16, p, m);
    } else if (stride == 0) {
        float v = ts_f16_to_f32(p[0]);
        for (int64_t i = 0; i < m; i++) d[i] = v;
    } else {
        for (int64_t i = 0; i < m; i++) d[i] = ts_f16_to_f32(p[i * stride]);
    }
}

static inline __attribute__((always_inline)) void bin_loop_h(bop op, ts_dtype dt, const bgeom *g, uint16_t *o,
                                                             const uint16_t *a, const uint16_t *b, float p)
{
    int nd = g->nd;
    if (nd == 0) {
        st_h(dt, o, 0, bin_f(op, ld_h(dt, a, 0), ld_h(dt, b, 0), p));
        return;
    }
    int64_t idx[TS_MAX_DIMS] = {0}, offs[3] = {0, 0, 0}, str[3][TS_MAX_DIMS];
    memcpy(str, g->str, sizeof str);
    int64_t n = g->shape[nd - 1], sa = str[1][nd - 1], sb = str[2][nd - 1];
    do {
        uint16_t *restrict oo = o + offs[0];
        const uint16_t *restrict aa = a + offs[1], *restrict bb = b + offs[2];
        if (dt == TS_BF16 && sa == 1 && sb == 1)
            for (int64_t i = 0; i < n; i++)
                oo[i] = ts__f32_to_bf16(bin_f(op, ts__bf16_to_f32(aa[i]), ts__bf16_to_f32(bb[i]), p));
        else if (dt == TS_BF16)
            for (int64_t i = 0; i < n; i++)
                oo[i] = ts__f32_to_bf16(bin_f(op, ts__bf16_to_f32(aa[i * sa]), ts__bf16_to_f32(bb[i * sb]), p));
        else
            for (int64_t i0 = 0; i0 < n; i0 += H_BLOCK) {
                int64_t m = n - i0 < H_BLOCK ? n - i0 : H_BLOCK;
                float fa[H_BLOCK], fb[H_BLOCK];
                ld_block_f16(fa, aa + i0 * sa, sa, m);
                ld_block_f16(fb, bb + i0 * sb, sb, m);
                for (int64_t i = 0; i < m; i++) fa[i] = bin_f(op, fa[i], fb[i], p);
                ts__buf_convert(TS_F16, oo + i0, TS_F32, fa, m);
            }
    } while (ts__next_outer(nd, g->shape, idx, 3, str, offs));
}

/* Reference: any dtypes, through double. */
static void bin_loop_ref(bop op, const bgeom *g, ts_dtype od, void *o, ts_dtype ad, const void *a, ts_dtype bd,
                         const void *b, double p)
{
    int nd = g->nd;
    if (nd == 0) {
        ts__store(od, o, 0, bin_d(op, ts__load(ad, a, 0), ts__load(bd, b, 0), p));
        return;
    }
    int64_t idx[TS_MAX_DIMS] = {0}, offs[3] = {0, 0, 0}, str[3][TS_MAX_DIMS];
    memcpy(str, g->str, sizeof str);
    int64_t n = g->shape[nd - 1];
    do {
        for (int64_t i = 0; i < n; i++)
            ts__store(od, o, offs[0] + i * str[0][nd - 1],
                      bin_d(op, ts__load(ad, a, offs[1] + i * str[1][nd - 1]),
                            ts__load(bd, b, offs[2] + i * str[2][nd - 1]), p));
    } while (ts__next_outer(nd, g->shape, idx, 3, str, offs));
}

__attribute__((target_clones("avx2", "default"))) static void bin_dispatch_f32(bop op, const bgeom *g, float *o,
                                                                               const float *a, const float *b, float p)
{
    switch (op) {
    case B_ADD: bin_loop_f32(B_ADD, g, o, a, b, p); break;
    case B_SUB: bin_loop_f32(B_SUB, g, o, a, b, p); break;
    case B_MUL: bin_loop_f32(B_MUL, g, o, a, b, p); break;
    case B_DIV: bin_loop_f32(B_DIV, g, o, a, b, p); break;
    case B_DIV_BW_B: bin_loop_f32(B_DIV_BW_B, g, o, a, b, p); break;
    case B_RELU_BW: bin_loop_f32(B_RELU_BW, g, o, a, b, p); break;
    case B_TANH_BW: bin_loop_f32(B_TANH_BW, g, o, a, b, p); break;
    case B_SIGMOID_BW: bin_loop_f32(B_SIGMOID_BW, g, o, a, b, p); break;
    case B_SQRT_BW: bin_loop_f32(B_SQRT_BW, g, o, a, b, p); break;
    case B_RSQRT_BW: bin_loop_f32(B_RSQRT_BW, g, o, a, b, p); break;
    case B_GELU_BW: bin_loop_f32(B_GELU_BW, g, o, a, b, p); break;
    case B_GELU_TANH_BW: bin_loop_f32(B_GELU_TANH_BW, g, o, a, b, p); break;
    case B_POW_BW: bin_loop_f32(B_POW_BW, g, o, a, b, p); break;
    case B_ABS_BW: bin_loop_f32(B_ABS_BW, g, o, a, b, p); break;
    case B_EQ:
    case B_NE:
    case B_LT:
    case B_LE:
    case B_GT:
    case B_GE:
    case B_COUNT: TS_ASSERT(!"no f32 loop for this op");
    }
}

static void bin_dispatch_f64(bop op, const bgeom *g, double *o, const double *a, const double *b, double p)
{
    switch (op) {
    case B_ADD: bin_loop_f64(B_ADD, g, o, a, b, p); break;
    case B_SUB: bin_loop_f64(B_SUB, g, o, a, b, p); break;
    case B_MUL: bin_loop_f64(B_MUL, g, o, a, b, p); break;
    case B_DIV: bin_loop_f64(B_DIV, g, o, a, b, p); break;
    default: bin_loop_f64(op, g, o, a, b, p); break;
    }
}

__attribute__((target_clones("avx2", "default"))) static void bin_dispatch_h(bop op, ts_dtype dt, const bgeom *g,
                                                                             uint16_t *o, const uint16_t *a,
                                                                             const uint16_t *b, float p)
{
    switch (op) {
    case B_ADD: bin_loop_h(B_ADD, dt, g, o, a, b, p); break;
    case B_SUB: bin_loop_h(B_SUB, dt, g, o, a, b, p); break;
    case B_MUL: bin_loop_h(B_MUL, dt, g, o, a, b, p); break;
    case B_DIV: bin_loop_h(B_DIV, dt, g, o, a, b, p); break;
    case B_DIV_BW_B: bin_loop_h(B_DIV_BW_B, dt, g, o, a, b, p); break;
    case B_RELU_BW: bin_loop_h(B_RELU_BW, dt, g, o, a, b, p); break;
    case B_TANH_BW: bin_loop_h(B_TANH_BW, dt, g, o, a, b, p); break;
    case B_SIGMOID_BW: bin_loop_h(B_SIGMOID_BW, dt, g, o, a, b, p); break;
    case B_SQRT_BW: bin_loop_h(B_SQRT_BW, dt, g, o, a, b, p); break;
    case B_RSQRT_BW: bin_loop_h(B_RSQRT_BW, dt, g, o, a, b, p); break;
    case B_GELU_BW: bin_loop_h(B_GELU_BW, dt, g, o, a, b, p); break;
    case B_GELU_TANH_BW: bin_loop_h(B_GELU_TANH_BW, dt, g, o, a, b, p); break;
    case B_POW_BW: bin_loop_h(B_POW_BW, dt, g, o, a, b, p); break;
    case B_ABS_BW: bin_loop_h(B_ABS_BW, dt, g, o, a, b, p); break;
    case B_EQ:
    case B_NE:
    case B_LT:
    case B_LE:
    case B_GT:
    case B_GE:
    case B_COUNT: TS_ASSERT(!"no 16-bit loop for this op");
    }
}

/* A scalar operand of an op on a tensor of dtype d, as PyTorch 1.13 treats
 * a Python number: a "wrapped number" converted to the tensor's dtype
 * first (for bf16/f16 the scalar is rounded to the dtype; measured with
 * torch 1.13: bf16 `x * 0.1` is round(x * bf16(0.1)) bit for bit). */
static double scalar_in(ts_dtype d, double p)
{
    if (d == TS_BF16) return ts__bf16_to_f32(ts__f32_to_bf16((float)p));
    if (d == TS_F16) return ts_f16_to_f32(ts_f32_to_f16((float)p));
    return p;
}

/* out = op(a, b) broadcast; no autograd. */
static ts_status binary_kernel(bop op, ts_tensor *a, ts_tensor *b, double p, ts_tensor **out)
{
    const char *name = bop_names[op];
    ts_status st;
    bgeom g;
    p = scalar_in(a->dtype, p);
    if ((st = ts__broadcast_shape(name, a->ndim, a->shape, b->ndim, b->shape, &g.nd, g.shape))) return st;
    bool cmp = op >= B_EQ;
    ts_dtype od = cmp ? TS_BOOL : a->dtype;
    ts_tensor *o;
    if ((st = ts__tensor_new(od, g.nd, g.shape, &o))) return st;
    memcpy(g.str[0], o->strides, sizeof o->strides);
    ts__broadcast_strides(a, g.nd, g.shape, g.str[1]);
    ts__broadcast_strides(b, g.nd, g.shape, g.str[2]);
    if (ts__numel(g.nd, g.shape) > 0 && !ts__is_meta(o)) {
        void *od_p = ts_tensor_data(o);
        const void *ap = ts_tensor_data(a), *bp = ts_tensor_data(b);
        if (ts__use_reference_kernels || cmp || a->dtype != b->dtype ||
            (a->dtype != TS_F32 && a->dtype != TS_F64 && !ts__is_half(a->dtype)))
            bin_loop_ref(op, &g, od, od_p, a->dtype, ap, b->dtype, bp, p);
        else if (ts__is_half(a->dtype)) bin_dispatch_h(op, a->dtype, &g, od_p, ap, bp, (float)p);
        else if (a->dtype == TS_F32) bin_dispatch_f32(op, &g, od_p, ap, bp, (float)p);
        else bin_dispatch_f64(op, &g, od_p, ap, bp, p);
    }
    *out = o;
    return TS_OK;
}

static inline __attribute__((always_inline)) void un_loop_f32(uop op, int64_t n, float *restrict o,
                                                              const float *restrict a, float p)
{
    for (int64_t i = 0; i < n; i++) o[i] = un_f(op, a[i], p);
}

__attribute__((target_clones("avx2", "default"))) static void un_dispatch_f32(uop op, int64_t n, float *o,
                                                                              const float *a, float p)
{
    switch (op) {
    case U_NEG: un_loop_f32(U_NEG, n, o, a, p); break;
    case U_EXP: un_loop_f32(U_EXP, n, o, a, p); break;
    case U_LOG: un_loop_f32(U_LOG, n, o, a, p); break;
    case U_SQRT: un_loop_f32(U_SQRT, n, o, a, p); break;
    case U_RSQRT: un_loop_f32(U_RSQRT, n, o, a, p); break;
    case U_TANH: un_loop_f32(U_TANH, n, o, a, p); break;
    case U_SIGMOID: un_loop_f32(U_SIGMOID, n, o, a, p); break;
    case U_RELU: un_loop_f32(U_RELU, n, o, a, p); break;
    case U_GELU: un_loop_f32(U_GELU, n, o, a, p); break;
    case U_GELU_TANH: un_loop_f32(U_GELU_TANH, n, o, a, p); break;
    case U_ADD_S: un_loop_f32(U_ADD_S, n, o, a, p); break;
    case U_MUL_S: un_loop_f32(U_MUL_S, n, o, a, p); break;
    case U_DIV_S: un_loop_f32(U_DIV_S, n, o, a, p); break;
    case U_RSUB_S: un_loop_f32(U_RSUB_S, n, o, a, p); break;
    case U_POW_S: un_loop_f32(U_POW_S, n, o, a, p); break;
    case U_ABS: un_loop_f32(U_ABS, n, o, a, p); break;
    case U_COUNT: break;
    }
}

static inline __attribute__((always_inline)) void un_loop_h(uop op, ts_dtype dt, int64_t n, uint16_t *restrict o,
                                                            const uint16_t *restrict a, float p)
{
    if (dt == TS_BF16)
        for (int64_t i = 0; i < n; i++) o[i] = ts__f32_to_bf16(un_f(op, ts__bf16_to_f32(a[i]), p));
    else
        for (int64_t i0 = 0; i0 < n; i0 += H_BLOCK) {
            int64_t m = n - i0 < H_BLOCK ? n - i0 : H_BLOCK;
            float f[H_BLOCK];
            ts__buf_convert(TS_F32, f, TS_F16, a + i0, m);
            for (int64_t i = 0; i < m; i++) f[i] = un_f(op, f[i], p);
            ts__buf_convert(TS_F16, o + i0, TS_F32, f, m);
        }
}

__attribute__((target_clones("avx2", "default"))) static void un_dispatch_h(uop op, ts_dtype dt, int64_t n, uint16_t *o,
                                                                            const uint16_t *a, float p)
{
    switch (op) {
    case U_NEG: un_loop_h(U_NEG, dt, n, o, a, p); break;
    case U_EXP: un_loop_h(U_EXP, dt, n, o, a, p); break;
    case U_LOG: un_loop_h(U_LOG, dt, n, o, a, p); break;
    case U_SQRT: un_loop_h(U_SQRT, dt, n, o, a, p); break;
    case U_RSQRT: un_loop_h(U_RSQRT, dt, n, o, a, p); break;
    case U_TANH: un_loop_h(U_TANH, dt, n, o, a, p); break;
    case U_SIGMOID: un_loop_h(U_SIGMOID, dt, n, o, a, p); break;
    case U_RELU: un_loop_h(U_RELU, dt, n, o, a, p); break;
    case U_GELU: un_loop_h(U_GELU, dt, n, o, a, p); break;
    case U_GELU_TANH: un_loop_h(U_GELU_TANH, dt, n, o, a, p); break;
    case U_ADD_S: un_loop_h(U_ADD_S, dt, n, o, a, p); break;
    case U_MUL_S: un_loop_h(U_MUL_S, dt, n, o, a, p); break;
    case U_DIV_S: un_loop_h(U_DIV_S, dt, n, o, a, p); break;
    case U_RSUB_S: un_loop_h(U_RSUB_S, dt, n, o, a, p); break;
    case U_POW_S: un_loop_h(U_POW_S, dt, n, o, a, p); break;
    case U_ABS: un_loop_h(U_ABS, dt, n, o, a, p); break;
    case U_COUNT: break;
    }
}

/* out = op(a); no autograd. */
static ts_status unary_kernel(uop op, ts_tensor *a, double p, ts_tensor **out)
{
    p = scalar_in(a->dtype, p);
    if (ts__is_half(a->dtype) && !ts__use_reference_kernels && !ts__is_contiguous(a)) {
        /* the 16-bit loops read contiguous inputs: copy first, so that a
         * strided input gives the same bits as a contiguous one */
        ts_tensor *c = NULL;
        bool grad = ts_grad_mode_set(false);
        ts_status st = ts_contiguous(a, &c);
        ts_grad_mode_set(grad);
        if (!st) st = unary_kernel(op, c, p, out);
        ts_tensor_free(c);
        return st;
    }
    ts_tensor *o;
    ts_status st = ts__tensor_new(a->dtype, a->ndim, a->shape, &o);
    if (st) return st;
    int64_t n = ts_tensor_numel(a);
    if (n > 0 && !ts__is_meta(o)) {
        if (!ts__use_reference_kernels && a->dtype == TS_F32 && ts__is_contiguous(a)) {
            un_dispatch_f32(op, n, ts_tensor_data(o), ts_tensor_data(a), (float)p);
        } else if (!ts__use_reference_kernels && ts__is_half(a->dtype)) {
            un_dispatch_h(op, a->dtype, n, ts_tensor_data(o), ts_tensor_data(a), (float)p);
        } else {
            /* reference: any layout, through double */
            bgeom g;
            g.nd = a->ndim;
            memcpy(g.shape, a->shape, sizeof g.shape);
            memcpy(g.str[0], o->strides, sizeof o->strides);
            memcpy(g.str[1], a->strides, sizeof a->strides);
            void *op_ = ts_tensor_data(o);
            const void *ap = ts_tensor_data(a);
            if (g.nd == 0) {
                ts__store(o->dtype, op_, 0, un_d(op, ts__load(a->dtype, ap, 0), p));
            } else {
                int64_t idx[TS_MAX_DIMS] = {0}, offs[3] = {0, 0, 0};
                int64_t inner = g.shape[g.nd - 1];
                do {
                    for (int64_t i = 0; i < inner; i++)
                        ts__store(o->dtype, op_, offs[0] + i * g.str[0][g.nd - 1],
                                  un_d(op, ts__load(a->dtype, ap, offs[1] + i * g.str[1][g.nd - 1]), p));
                } while (ts__next_outer(g.nd, g.shape, idx, 2, g.str, offs));
            }
        }
    }
    *out = o;
    return TS_OK;
}

/* ----------------------------------------------------- internal helpers */

ts_status ts__add_nograd(ts_tensor *a, ts_tensor *b, ts_tensor **out) { return binary_kernel(B_ADD, a, b, 0, out); }

ts_status ts__add_inplace(ts_tensor *dst, const ts_tensor *src)
{
    int64_t n = ts_tensor_numel(dst);
    if (dst->dtype == TS_F32 && src->dtype == TS_F32 && ts__is_contiguous(dst) && ts__is_contiguous(src) &&
        ts_tensor_numel(src) == n) {
        float *d = ts_tensor_data(dst);
        const float *s = ts_tensor_data(src);
        for (int64_t i = 0; i < n && d && s; i++) /* NULL: a meta operand, nothing to add */
            d[i] += s[i];
        return TS_OK;
    }
    ts_tensor *sum;
    ts_status st = binary_kernel(B_ADD, dst, (ts_tensor *)src, 0, &sum);
    if (st) return st;
    st = ts__copy_into("add_", dst, sum);
    ts_tensor_free(sum);
    return st;
}

ts_status ts__reduce_to_shape(ts_tensor *g, int ndim, const int64_t *shape, ts_tensor **out)
{
    if (g->ndim == ndim && memcmp(g->shape, shape, (size_t)ndim * sizeof *shape) == 0) {
        *out = ts_tensor_retain(g);
        return TS_OK;
    }
    int dims[TS_MAX_DIMS], nd = 0, lead = g->ndim - ndim;
    for (int i = 0; i < g->ndim; i++)
        if (i < lead || (shape[i - lead] == 1 && g->shape[i] != 1)) dims[nd++] = i;
    ts_tensor *s;
    ts_status st = ts__sum_nograd(g, nd, dims, true, &s);
    if (st) return st;
    int64_t str[TS_MAX_DIMS];
    ts__contiguous_strides(ndim, shape, str);
    st = ts__tensor_alias(s, ndim, shape, str, s->offset, out);
    ts_tensor_free(s);
    return st;
}

/* ----------------------------------------------------- binary ops */

/* Node layout of binary ops: iargs[0..8) shape of a, iargs[8..16) shape of
 * b, dargs[1] and dargs[2] their ndims (an 8-d shape fills its half of
 * iargs), dargs[0] the sign of b for add/sub. */
static int operand_ndim(const ts_node *n, int j) { return (int)n->dargs[1 + j]; }
static const int64_t *operand_shape(const ts_node *n, int j) { return &n->iargs[TS_MAX_DIMS * j]; }

static ts_status add_sub_backward(ts_node *n, ts_tensor **g, ts_tensor **gin)
{
    ts_status st = TS_OK;
    if (ts__node_needs_input_grad(n, 0))
        st = ts__reduce_to_shape(g[0], operand_ndim(n, 0), operand_shape(n, 0), &gin[0]);
    if (!st && ts__node_needs_input_grad(n, 1)) {
        ts_tensor *r;
        st = ts__reduce_to_shape(g[0], operand_ndim(n, 1), operand_shape(n, 1), &r);
        if (!st && n->dargs[0] < 0) {
            st = unary_kernel(U_NEG, r, 0, &gin[1]);
            ts_tensor_free(r);
        } else if (!st) {
            gin[1] = r;
        }
    }
    return st;
}

static ts_status mul_backward(ts_node *n, ts_tensor **g, ts_tensor **gin)
{
    ts_status st = TS_OK;
    for (int j = 0; j < 2 && !st; j++) {
        if (!ts__node_needs_input_grad(n, j)) continue;
        ts_tensor *full;
        if ((st = binary_kernel(B_MUL, g[0], n->saved[1 - j], 0, &full))) break;
        st = ts__reduce_to_shape(full, operand_ndim(n, j), operand_shape(n, j), &gin[j]);
        ts_tensor_free(full);
    }
    return st;
}

static ts_status div_backward(ts_node *n, ts_tensor **g, ts_tensor **gin)
{
    /* saved: 0 = b, 1 = out; da = g / b; db = -g * out / b */
    ts_status st = TS_OK;
    ts_tensor *ga = NULL;
    if ((st = binary_kernel(B_DIV, g[0], n->saved[0], 0, &ga))) return st;
    if (ts__node_needs_input_grad(n, 0)) st = ts__reduce_to_shape(ga, operand_ndim(n, 0), operand_shape(n, 0), &gin[0]);
    if (!st && ts__node_needs_input_grad(n, 1)) {
        ts_tensor *full;
        if (!(st = binary_kernel(B_DIV_BW_B, ga, n->saved[1], 0, &full))) {
            st = ts__reduce_to_shape(full, operand_ndim(n, 1), operand_shape(n, 1), &gin[1]);
            ts_tensor_free(full);
        }
    }
    ts_tensor_free(ga);
    return st;
}

/* Converts the operands of a binary op to their common dtype (PyTorch's
 * type promotion, ts__result_type) with recorded casts, so that gradients
 * flow back in each operand's own dtype. *ca and *cb are new references. */
static ts_status promote_operands(const char *name, ts_tensor *a, ts_tensor *b, bool floating, ts_tensor **ca,
                                  ts_tensor **cb)
{
    ts_dtype rt = ts__result_type(a, b);
    if (floating && !ts_dtype_is_float(rt)) {
        if (a->dtype == b->dtype)
            return ts_error(TS_ERR_DTYPE,
                            "%s: dtype %s is not supported (a floating dtype is needed: float32, "
                            "float64, bfloat16 or float16; cast with ts_to_dtype)",
                            name, ts_dtype_name(a->dtype));
        return ts_error(TS_ERR_DTYPE,
                        "%s: dtypes %s and %s promote to %s, which is not supported (a floating "
                        "dtype is needed: float32, float64, bfloat16 or float16)",
                        name, ts_dtype_name(a->dtype), ts_dtype_name(b->dtype), ts_dtype_name(rt));
    }
    ts_status st = ts_to_dtype(a, rt, ca);
    if (st) return st;
    if ((st = ts_to_dtype(b, rt, cb))) {
        ts_tensor_free(*ca);
        return st;
    }
    return TS_OK;
}

static ts_status binary_op_same(bop op, ts_tensor *a, ts_tensor *b, ts_tensor **out);

static ts_status binary_op(bop op, ts_tensor *a, ts_tensor *b, ts_tensor **out)
{
    const char *name = bop_names[op];
    ts_tensor *in[2] = {a, b};
    ts_status st;
    if ((st = ts__check_inputs(name, 2, in))) return st;
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: out is NULL", name);
    if (a->dtype == b->dtype) return binary_op_same(op, a, b, out);
    ts_tensor *ca, *cb;
    if ((st = promote_operands(name, a, b, true, &ca, &cb))) return st;
    st = binary_op_same(op, ca, cb, out);
    ts_tensor_free(ca);
    ts_tensor_free(cb);
    return st;
}

static ts_status binary_op_same(bop op, ts_tensor *a, ts_tensor *b, ts_tensor **out)
{
    const char *name = bop_names[op];
    ts_tensor *in[2] = {a, b};
    ts_status st;
    if ((st = ts__check_floating(name, a))) return st;
    ts_tensor *o;
    if ((st = binary_kernel(op, a, b, 0, &o))) return st;
    if (ts__needs_grad(2, in)) {
        ts_node_backward_fn bw = op == B_MUL ? mul_backward : op == B_DIV ? div_backward : add_sub_backward;
        ts_node *n = ts__node_new(name, bw, 2, in, 1);
        if (!n) {
            ts_tensor_free(o);
            return TS_ERR_NO_MEMORY;
        }
        n->dargs[1] = a->ndim;
        memcpy(&n->iargs[0], a->shape, (size_t)a->ndim * sizeof *a->shape);
        n->dargs[2] = b->ndim;
        memcpy(&n->iargs[TS_MAX_DIMS], b->shape, (size_t)b->ndim * sizeof *b->shape);
        n->dargs[0] = op == B_SUB ? -1 : 1;
        /* mul saves both operands; div saves b and the output */
        if ((st = ts__record1(n, o,
                              op == B_MUL       ? a
                                  : op == B_DIV ? b
                                                : NULL,
                              op == B_MUL       ? b
                                  : op == B_DIV ? o
                                                : NULL)))
            return st;
    }
    *out = o;
    return TS_OK;
}

ts_status ts_add(ts_tensor *a, ts_tensor *b, ts_tensor **out) { return binary_op(B_ADD, a, b, out); }
ts_status ts_sub(ts_tensor *a, ts_tensor *b, ts_tensor **out) { return binary_op(B_SUB, a, b, out); }
ts_status ts_mul(ts_tensor *a, ts_tensor *b, ts_tensor **out) { return binary_op(B_MUL, a, b, out); }
ts_status ts_div(ts_tensor *a, ts_tensor *b, ts_tensor **out) { return binary_op(B_DIV, a, b, out); }

static ts_status compare_op(bop op, ts_tensor *a, ts_tensor *b, ts_tensor **out)
{
    ts_tensor *in[2] = {a, b};
    ts_status st = ts__check_inputs(bop_names[op], 2, in);
    if (st) return st;
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: out is NULL", bop_names[op]);
    if (a->dtype == b->dtype) return binary_kernel(op, a, b, 0, out);
    /* compared in the common dtype, as torch.eq does (int64 2^24 + 1 and
     * float32 2^24 are equal once both are float32) */
    ts_tensor *ca, *cb;
    bool grad = ts_grad_mode_set(false);
    st = promote_operands(bop_names[op], a, b, false, &ca, &cb);
    ts_grad_mode_set(grad);
    if (st) return st;
    st = binary_kernel(op, ca, cb, 0, out);
    ts_tensor_free(ca);
    ts_tensor_free(cb);
    return st;
}

ts_status ts_eq(ts_tensor *a, ts_tensor *b, ts_tensor **out) { return compare_op(B_EQ, a, b, out); }
ts_status ts_ne(ts_tensor *a, ts_tensor *b, ts_tensor **out) { return compare_op(B_NE, a, b, out); }
ts_status ts_lt(ts_tensor *a, ts_tensor *b, ts_tensor **out) { return compare_op(B_LT, a, b, out); }
ts_status ts_le(ts_tensor *a, ts_tensor *b, ts_tensor **out) { return compare_op(B_LE, a, b, out); }
ts_status ts_gt(ts_tensor *a, ts_tensor *b, ts_tensor **out) { return compare_op(B_GT, a, b, out); }
ts_status ts_ge(ts_tensor *a, ts_tensor *b, ts_tensor **out) { return compare_op(B_GE, a, b, out); }

/* ----------------------------------------------------- unary ops */

/* Saved slot 0: the input or the output, per op. */
static ts_status unary_backward(ts_node *n, ts_tensor **g, ts_tensor **gin)
{
    uop op = (uop)n->iargs[0];
    double p = n->dargs[0];
    switch (op) {
    case U_NEG: return unary_kernel(U_NEG, g[0], 0, &gin[0]);
    case U_EXP: return binary_kernel(B_MUL, g[0], n->saved[0], 0, &gin[0]);
    case U_LOG: return binary_kernel(B_DIV, g[0], n->saved[0], 0, &gin[0]);
    case U_SQRT: return binary_kernel(B_SQRT_BW, g[0], n->saved[0], 0, &gin[0]);
    case U_RSQRT: return binary_kernel(B_RSQRT_BW, g[0], n->saved[0], 0, &gin[0]);
    case U_TANH: return binary_kernel(B_TANH_BW, g[0], n->saved[0], 0, &gin[0]);
    case U_SIGMOID: return binary_kernel(B_SIGMOID_BW, g[0], n->saved[0], 0, &gin[0]);
    case U_RELU: return binary_kernel(B_RELU_BW, g[0], n->saved[0], 0, &gin[0]);
    case U_GELU: return binary_kernel(B_GELU_BW, g[0], n->saved[0], 0, &gin[0]);
    case U_GELU_TANH: return binary_kernel(B_GELU_TANH_BW, g[0], n->saved[0], 0, &gin[0]);
    case U_ADD_S: *gin = ts_tensor_retain(g[0]); return TS_OK;
    case U_MUL_S: return unary_kernel(U_MUL_S, g[0], p, &gin[0]);
    case U_DIV_S: return unary_kernel(U_DIV_S, g[0], p, &gin[0]);
    case U_RSUB_S: return unary_kernel(U_NEG, g[0], 0, &gin[0]);
    case U_POW_S: return binary_kernel(B_POW_BW, g[0], n->saved[0], p, &gin[0]);
    case U_ABS: return binary_kernel(B_ABS_BW, g[0], n->saved[0], 0, &gin[0]);
    case U_COUNT: break;
    }
    return ts_error(TS_ERR_INTERNAL, "unary backward: bad op");
}

static ts_status unary_op(uop op, ts_tensor *a, double p, ts_tensor **out)
{
    const char *name = uop_names[op];
    ts_status st;
    if ((st = ts__check_inputs(name, 1, &a)) || (st = ts__check_floating(name, a))) return st;
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: out is NULL", name);
    ts_tensor *o;
    if ((st = unary_kernel(op, a, p, &o))) return st;
    if (ts__needs_grad(1, &a)) {
        ts_node *n = ts__node_new(name, unary_backward, 1, &a, 1);
        if (!n) {
            ts_tensor_free(o);
            return TS_ERR_NO_MEMORY;
        }
        n->iargs[0] = op;
        n->dargs[0] = p;
        bool save_out = op == U_EXP || op == U_SQRT || op == U_RSQRT || op == U_TANH || op == U_SIGMOID;
        bool save_in = op == U_LOG || op == U_RELU || op == U_GELU || op == U_GELU_TANH || op == U_POW_S || op == U_ABS;
        if ((st = ts__record1(n, o, save_out ? o : save_in ? a : NULL, NULL))) return st;
    }
    *out = o;
    return TS_OK;
}

ts_status ts_neg(ts_tensor *a, ts_tensor **out) { return unary_op(U_NEG, a, 0, out); }
ts_status ts_exp(ts_tensor *a, ts_tensor **out) { return unary_op(U_EXP, a, 0, out); }
ts_status ts_log(ts_tensor *a, ts_tensor **out) { return unary_op(U_LOG, a, 0, out); }
ts_status ts_sqrt(ts_tensor *a, ts_tensor **out) { return unary_op(U_SQRT, a, 0, out); }
ts_status ts_rsqrt(ts_tensor *a, ts_tensor **out) { return unary_op(U_RSQRT, a, 0, out); }
ts_status ts_tanh(ts_tensor *a, ts_tensor **out) { return unary_op(U_TANH, a, 0, out); }
ts_status ts_sigmoid(ts_tensor *a, ts_tensor **out) { return unary_op(U_SIGMOID, a, 0, out); }
ts_status ts_relu(ts_tensor *a, ts_tensor **out) { return unary_op(U_RELU, a, 0, out); }
ts_status ts_abs(ts_tensor *a, ts_tensor **out) { return unary_op(U_ABS, a, 0, out); }
ts_status ts_add_scalar(ts_tensor *a, double s, ts_tensor **out) { return unary_op(U_ADD_S, a, s, out); }
ts_status ts_sub_scalar(ts_tensor *a, double s, ts_tensor **out) { return unary_op(U_ADD_S, a, -s, out); }
ts_status ts_rsub_scalar(ts_tensor *a, double s, ts_tensor **out) { return unary_op(U_RSUB_S, a, s, out); }
ts_status ts_mul_scalar(ts_tensor *a, double s, ts_tensor **out) { return unary_op(U_MUL_S, a, s, out); }
ts_status ts_div_scalar(ts_tensor *a, double s, ts_tensor **out) { return unary_op(U_DIV_S, a, s, out); }
ts_status ts_pow_scalar(ts_tensor *a, double e, ts_tensor **out) { return unary_op(U_POW_S, a, e, out); }

ts_status ts_gelu(ts_tensor *a, ts_gelu_approx approx, ts_tensor **out)
{
    if (approx != TS_GELU_NONE && approx != TS_GELU_TANH)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "gelu: approximate must be TS_GELU_NONE or TS_GELU_TANH, got %d",
                        (int)approx);
    return unary_op(approx == TS_GELU_TANH ? U_GELU_TANH : U_GELU, a, 0, out);
}
