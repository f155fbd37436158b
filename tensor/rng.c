/*
 * PyTorch-exact CPU random numbers: the mt19937 generator of
 * at::CPUGeneratorImpl and the kernels of torch 1.13's rand, randn,
 * uniform_, normal_, randint, randperm and bernoulli_, as
 * docs/rng.md describes them.
 *
 * Platform: the "AVX2/GCC" column of docs/rng.md §0, the one torch uses on any
 * x86-64 CPU with AVX2+FMA (Linux wheels, Debian, conda-forge): uniform_
 * in the FMA form, the vectorised float32 normal_ path emulated lane by
 * lane in scalar C with avx_mathfun's contractions written as fmaf(), the
 * scalar path with glibc's double log/sin/cos and a final fma(). The file
 * is compiled with -ffp-contract=off, so every fused multiply-add below is
 * one the algorithm requires and no other multiply-add is fused.
 *
 * The generator is not thread-safe: one thread draws from a generator at a
 * time (torch takes a mutex; here the caller serialises). Only the
 * creation of the default generator is thread-safe.
 */
#include "tensor/internal.h"
#include "tensor/kernels.h"

#include <float.h>
#include <math.h>
#include <string.h>
#include <threads.h>

/* torch's default_rng_seed_val (c10/core/GeneratorImpl.h). torch seeds its
 * own default generator non-deterministically at start-up; ours starts
 * from this fixed seed so that a program that never calls ts_manual_seed
 * is still reproducible. */
#define TS__DEFAULT_SEED UINT64_C(67280421310721)

#define MT_N 624
#define MT_M 397
#define MT_MATRIX_A UINT32_C(0x9908B0DF)
#define MT_UMASK UINT32_C(0x80000000)
#define MT_LMASK UINT32_C(0x7FFFFFFF)

struct ts_generator {
    uint32_t mt[MT_N];
    int32_t left;  /* draws until the next twist, plus one ("cokus" MT) */
    uint32_t next; /* index of the next word to temper */
    uint64_t seed; /* as given to manual_seed (torch.initial_seed()) */
    /* next_double_normal_sample_: the second value of a scalar-path
     * Box-Muller pair, before mean/std are applied */
    bool has_normal;
    double normal;
    /* next_float_normal_sample_: no CPU kernel uses it; kept so that a
     * state survives get_state/set_state unchanged */
    bool has_float_normal;
    float float_normal;
};

/* ------------------------------------------------------------ generator */

static void gen_seed(ts_generator *g, uint64_t seed)
{
    g->seed = seed;
    g->mt[0] = (uint32_t)(seed & UINT32_C(0xFFFFFFFF));
    for (uint32_t j = 1; j < MT_N; j++) g->mt[j] = UINT32_C(1812433253) * (g->mt[j - 1] ^ (g->mt[j - 1] >> 30)) + j;
    g->left = 1;
    g->next = 0;
    g->has_normal = false;
    g->normal = 0.0;
    g->has_float_normal = false;
    g->float_normal = 0.0f;
}

static uint32_t mt_twist(uint32_t u, uint32_t v)
{
    return (((u & MT_UMASK) | (v & MT_LMASK)) >> 1) ^ ((v & 1u) ? MT_MATRIX_A : 0u);
}

static void mt_next_state(ts_generator *g)
{
    uint32_t *p = g->mt;
    int k;
    for (k = 0; k < MT_N - MT_M; k++) p[k] = p[k + MT_M] ^ mt_twist(p[k], p[k + 1]);
    for (; k < MT_N - 1; k++) p[k] = p[k + MT_M - MT_N] ^ mt_twist(p[k], p[k + 1]);
    p[MT_N - 1] = p[MT_M - 1] ^ mt_twist(p[MT_N - 1], p[0]);
    g->left = MT_N;
    g->next = 0;
}

/* One mt19937 output (docs/rng.md §1.2). */
static inline uint32_t mt_random(ts_generator *g)
{
    if (--g->left == 0) mt_next_state(g);
    uint32_t y = g->mt[g->next++];
    y ^= y >> 11;
    y ^= (y << 7) & UINT32_C(0x9D2C5680);
    y ^= (y << 15) & UINT32_C(0xEFC60000);
    y ^= y >> 18;
    return y;
}

/* random64: the first draw is the high half (docs/rng.md §1.3). */
static inline uint64_t mt_random64(ts_generator *g)
{
    uint64_t hi = mt_random(g);
    uint64_t lo = mt_random(g);
    return (hi << 32) | lo;
}

/* U24: low 24 bits of one draw, exact f32 in [0, 1 - 2^-24]. */
static inline float u24(ts_generator *g) { return (float)(mt_random(g) & UINT32_C(0xFFFFFF)) * 0x1p-24f; }

/* U53: low 53 bits of random64, exact f64 in [0, 1 - 2^-53]. */
static inline double u53(ts_generator *g) { return (double)(mt_random64(g) & ((UINT64_C(1) << 53) - 1)) * 0x1p-53; }

static ts_generator default_gen;
static once_flag default_once = ONCE_FLAG_INIT;

static void default_gen_init(void) { gen_seed(&default_gen, TS__DEFAULT_SEED); }

/* A thread's own default (ts_generator_set_thread_default), else NULL. */
static _Thread_local ts_generator *tl_default;

ts_generator *ts_default_generator(void)
{
    if (tl_default) return tl_default;
    call_once(&default_once, default_gen_init);
    return &default_gen;
}

ts_generator *ts_generator_set_thread_default(ts_generator *g)
{
    ts_generator *prev = tl_default;
    tl_default = g;
    return prev;
}

static ts_generator *gen_or_default(ts_generator *g) { return g ? g : ts_default_generator(); }

void ts_manual_seed(uint64_t seed) { gen_seed(ts_default_generator(), seed); }

ts_status ts_generator_new(uint64_t seed, ts_generator **out)
{
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "generator_new: out is NULL");
    ts_generator *g = ts__malloc(TS_MEM_OTHER, sizeof *g);
    if (!g) return ts_error(TS_ERR_NO_MEMORY, "generator_new: cannot allocate %zu bytes", sizeof *g);
    gen_seed(g, seed);
    *out = g;
    return TS_OK;
}

/* The default generator is not freed (it is static). */
void ts_generator_free(ts_generator *g)
{
    if (g && g != &default_gen) ts__free(TS_MEM_OTHER, g);
}

void ts_generator_manual_seed(ts_generator *g, uint64_t seed) { gen_seed(gen_or_default(g), seed); }

uint32_t ts_generator_random(ts_generator *g) { return mt_random(gen_or_default(g)); }

/* ------------------------------------------- state (docs/rng.md §1.5, 5056 bytes) */

enum {
    ST_SEED = 0,
    ST_LEFT = 8,
    ST_SEEDED = 12,
    ST_NEXT = 16,
    ST_STATE = 24,
    ST_NORMAL_X = 5016,
    ST_NORMAL_Y = 5024,
    ST_NORMAL_RHO = 5032,
    ST_NORMAL_VALID = 5040,
    ST_FLOAT_NORMAL = 5048,
    ST_FLOAT_NORMAL_VALID = 5052,
};
_Static_assert(ST_STATE + 8 * MT_N == ST_NORMAL_X, "rng state layout");
_Static_assert(ST_FLOAT_NORMAL_VALID + 4 == TS_GENERATOR_STATE_BYTES, "rng state size");

static void put_le(uint8_t *p, uint64_t v, int nbytes)
{
    for (int i = 0; i < nbytes; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get_le(const uint8_t *p, int nbytes)
{
    uint64_t v = 0;
    for (int i = 0; i < nbytes; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

void ts_generator_get_state(const ts_generator *gc, uint8_t state_out[TS_GENERATOR_STATE_BYTES])
{
    if (!state_out) return;
    const ts_generator *g = gc ? gc : ts_default_generator();
    uint64_t bits;
    uint32_t fbits;

    memset(state_out, 0, TS_GENERATOR_STATE_BYTES);
    put_le(state_out + ST_SEED, g->seed, 8);
    put_le(state_out + ST_LEFT, (uint32_t)g->left, 4);
    put_le(state_out + ST_SEEDED, 1, 4);
    put_le(state_out + ST_NEXT, g->next, 8);
    for (int i = 0; i < MT_N; i++) put_le(state_out + ST_STATE + 8 * i, g->mt[i], 8);
    /* normal_x and normal_rho stay 0 (torch writes dummies) */
    if (g->has_normal) {
        memcpy(&bits, &g->normal, 8);
        put_le(state_out + ST_NORMAL_Y, bits, 8);
        put_le(state_out + ST_NORMAL_VALID, 1, 4);
    }
    if (g->has_float_normal) {
        memcpy(&fbits, &g->float_normal, 4);
        put_le(state_out + ST_FLOAT_NORMAL, fbits, 4);
        state_out[ST_FLOAT_NORMAL_VALID] = 1;
    }
}

/* Accepts what torch.set_rng_state accepts for a 5056-byte state (the
 * 64-bit state words are truncated to 32 bits as torch does), except that
 * it also refuses left/next pairs that would read past the state array,
 * which torch does not check: seeded != 0, 1 <= left <= 624,
 * next <= 624 and left + next <= 625. The generator is unchanged on
 * error (TS_ERR_INVALID_ARGUMENT). */
ts_status ts_generator_set_state(ts_generator *g, const uint8_t state[TS_GENERATOR_STATE_BYTES])
{
    if (!state) return ts_error(TS_ERR_INVALID_ARGUMENT, "generator_set_state: state is NULL");
    g = gen_or_default(g);
    int32_t left = (int32_t)(uint32_t)get_le(state + ST_LEFT, 4);
    int32_t seeded = (int32_t)(uint32_t)get_le(state + ST_SEEDED, 4);
    uint64_t next = get_le(state + ST_NEXT, 8);
    if (seeded == 0 || left < 1 || left > MT_N || next > MT_N || (uint64_t)left + next > MT_N + 1)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "generator_set_state: invalid mt19937 state (seeded=%d, left=%d, next=%llu; "
                        "need seeded != 0, 1 <= left <= 624, next <= 624, left + next <= 625)",
                        (int)seeded, (int)left, (unsigned long long)next);
    g->seed = get_le(state + ST_SEED, 8);
    g->left = left;
    g->next = (uint32_t)next;
    for (int i = 0; i < MT_N; i++) g->mt[i] = (uint32_t)get_le(state + ST_STATE + 8 * i, 8);
    g->has_normal = get_le(state + ST_NORMAL_VALID, 4) != 0;
    uint64_t bits = get_le(state + ST_NORMAL_Y, 8);
    memcpy(&g->normal, &bits, 8);
    if (!g->has_normal) g->normal = 0.0;
    g->has_float_normal = state[ST_FLOAT_NORMAL_VALID] != 0;
    uint32_t fbits = (uint32_t)get_le(state + ST_FLOAT_NORMAL, 4);
    memcpy(&g->float_normal, &fbits, 4);
    if (!g->has_float_normal) g->float_normal = 0.0f;
    return TS_OK;
}

/* -------------------------------------------- avx_mathfun, one lane (§5.2) */

static inline float f32_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t bits_f32(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* The constants as f32 bit patterns (the header's decimal literals
 * converted to float). */
#define C_MIN_NORM 0x00800000u
#define C_SQRTHF 0x3F3504F3u
#define C_LOG_P0 0x3D9021BBu
#define C_LOG_P1 0xBDEBD1B8u
#define C_LOG_P2 0x3DEF251Au
#define C_LOG_P3 0xBDFE5D4Fu
#define C_LOG_P4 0x3E11E9BFu
#define C_LOG_P5 0xBE2AAE50u
#define C_LOG_P6 0x3E4CCEACu
#define C_LOG_P7 0xBE7FFFFCu
#define C_LOG_P8 0x3EAAAAAAu
#define C_LOG_Q1 0xB95E8083u
#define C_LOG_Q2 0x3F318000u
#define C_DP1 0xBF490000u
#define C_DP2 0xB97DA000u
#define C_DP3 0xB3222169u
#define C_SIN_P0 0xB94CA1F9u
#define C_SIN_P1 0x3C08839Eu
#define C_SIN_P2 0xBE2AAAA3u
#define C_COS_P0 0x37CCF5CEu
#define C_COS_P1 0xBAB6061Au
#define C_COS_P2 0x3D2AAAA5u
#define C_FOPI 0x3FA2F983u
#define C_TWO_PI_F 0x40C90FDBu

/* log256_ps as GCC compiles it with -mavx2 -mfma: every multiply whose only
 * use is an add is fused (the fmaf calls). Only called with x in
 * [2^-24, 1]; x <= 0 would give NaN in torch and is not handled. */
static float avx_logf(float x)
{
    const float one = 1.0f;
    if (!(x > f32_bits(C_MIN_NORM))) /* maxps(x, MIN_NORM) */
        x = f32_bits(C_MIN_NORM);
    uint32_t bits = bits_f32(x);
    int32_t k = (int32_t)(bits >> 23) - 127;
    float m = f32_bits((bits & 0x807FFFFFu) | 0x3F000000u);
    float e = (float)k + one;
    float t;
    if (m < f32_bits(C_SQRTHF)) {
        t = m;
        e = e - one;
    } else {
        t = 0.0f;
        e = e - 0.0f;
    }
    m = m - one;
    m = m + t;
    float z = m * m;
    float y = f32_bits(C_LOG_P0);
    y = fmaf(y, m, f32_bits(C_LOG_P1));
    y = fmaf(y, m, f32_bits(C_LOG_P2));
    y = fmaf(y, m, f32_bits(C_LOG_P3));
    y = fmaf(y, m, f32_bits(C_LOG_P4));
    y = fmaf(y, m, f32_bits(C_LOG_P5));
    y = fmaf(y, m, f32_bits(C_LOG_P6));
    y = fmaf(y, m, f32_bits(C_LOG_P7));
    y = fmaf(y, m, f32_bits(C_LOG_P8));
    y = y * m;
    float eq1 = e * f32_bits(C_LOG_Q1);
    y = fmaf(y, z, eq1);
    y = fmaf(-z, 0.5f, y);
    m = m + y;
    m = fmaf(e, f32_bits(C_LOG_Q2), m);
    return m;
}

/* sincos256_ps as GCC compiles it (fused), one lane. */
static void avx_sincosf(float x, float *s_out, float *c_out)
{
    uint32_t sign_sin = bits_f32(x) & 0x80000000u;
    x = f32_bits(bits_f32(x) & 0x7FFFFFFFu);
    float xf = x * f32_bits(C_FOPI);
    /* cvttps2dq: truncation, INT32_MIN for NaN or out of range */
    int32_t ji = (xf > -2147483648.0f && xf < 2147483648.0f) ? (int32_t)xf : INT32_MIN;
    uint32_t j = ((uint32_t)ji + 1u) & ~1u;
    float y = (float)(int32_t)j;
    uint32_t swap_sin = (j & 4u) << 29;
    bool poly = (j & 2u) == 0;
    x = fmaf(y, f32_bits(C_DP1), x);
    x = fmaf(y, f32_bits(C_DP2), x);
    x = fmaf(y, f32_bits(C_DP3), x);
    uint32_t sign_cos = (~(j - 2u) & 4u) << 29;
    sign_sin ^= swap_sin;
    float z = x * x;
    float yc = fmaf(f32_bits(C_COS_P0), z, f32_bits(C_COS_P1));
    yc = fmaf(yc, z, f32_bits(C_COS_P2));
    yc = yc * z;
    float hz = z * 0.5f;
    yc = fmaf(yc, z, -hz);
    yc = yc + 1.0f;
    float ys = fmaf(f32_bits(C_SIN_P0), z, f32_bits(C_SIN_P1));
    ys = fmaf(ys, z, f32_bits(C_SIN_P2));
    ys = ys * z;
    ys = fmaf(ys, x, x);
    /* selection exactly as the vector code does it (and/andnot masks) */
    float s2 = poly ? ys : 0.0f;
    float s1 = poly ? 0.0f : yc;
    float sin_raw = s1 + s2;
    float cos_raw = (ys - s2) + (yc - s1);
    *s_out = f32_bits(bits_f32(sin_raw) ^ sign_sin);
    *c_out = f32_bits(bits_f32(cos_raw) ^ sign_cos);
}

/* normal_fill_16_AVX2: Box-Muller over the pairs (j, j + 8). Lane j reads
 * d[j], d[j + 8] and writes only them, so in place is exact. */
static void fill16_f32(float *d, float mean, float std)
{
    for (int j = 0; j < 8; j++) {
        float u1 = 1.0f - d[j];
        float u2 = d[j + 8];
        float radius = sqrtf(-2.0f * avx_logf(u1));
        float theta = f32_bits(C_TWO_PI_F) * u2;
        float s, c;
        avx_sincosf(theta, &s, &c);
        float n1 = radius * c;
        float n2 = radius * s;
        d[j] = fmaf(n1, std, mean);
        d[j + 8] = fmaf(n2, std, mean);
    }
}

/* normal_fill_16<double> (the AVX2 build fuses the last multiply-add). */
static void fill16_f64(double *d, double mean, double std)
{
    for (int j = 0; j < 8; j++) {
        double u1 = 1.0 - d[j];
        double u2 = d[j + 8];
        double radius = sqrt(-2.0 * log(u1));
        double theta = 6.283185307179586 * u2; /* 2.0 * pi<double>, folded */
        double n1 = radius * cos(theta);
        double n2 = radius * sin(theta);
        d[j] = fma(n1, std, mean);
        d[j + 8] = fma(n2, std, mean);
    }
}

/* §5.2 steps 1-3: n >= 16 contiguous float32. */
static void normal_fill_f32(ts_generator *g, float *d, int64_t n, float mean, float std)
{
    for (int64_t i = 0; i < n; i++) d[i] = u24(g);
    for (int64_t b = 0; b + 16 <= n; b += 16) fill16_f32(d + b, mean, std);
    if (n % 16 != 0) {
        /* recompute the last 16 slots from fresh draws */
        float *t = d + n - 16;
        for (int i = 0; i < 16; i++) t[i] = u24(g);
        fill16_f32(t, mean, std);
    }
}

/* §5.5: n >= 16 contiguous float64. */
static void normal_fill_f64(ts_generator *g, double *d, int64_t n, double mean, double std)
{
    for (int64_t i = 0; i < n; i++) d[i] = u53(g);
    for (int64_t b = 0; b + 16 <= n; b += 16) fill16_f64(d + b, mean, std);
    if (n % 16 != 0) {
        double *t = d + n - 16;
        for (int i = 0; i < 16; i++) t[i] = u53(g);
        fill16_f64(t, mean, std);
    }
}

/* §5.4: at::normal_distribution<double> with the generator's cache. */
static double normal_scalar(ts_generator *g, double mean, double std)
{
    double v;
    if (g->has_normal) {
        g->has_normal = false;
        v = g->normal;
    } else {
        double u1 = u53(g); /* the angle */
        double u2 = u53(g); /* the radius */
        double r = sqrt(-2.0 * log(1.0 - u2));
        double theta = 6.283185307179586 * u1;
        g->normal = r * sin(theta);
        g->has_normal = true;
        v = r * cos(theta);
    }
    return fma(v, std, mean);
}

/* ------------------------------------------------------ element order (§2) */

/* Visits a tensor's elements in TensorIterator order: dimensions sorted by
 * ascending stride (memory order for a permuted dense tensor), size-1
 * dimensions dropped. Row-major order for a contiguous tensor. */
typedef struct elem_iter {
    int nd;
    int64_t size[TS_MAX_DIMS];   /* innermost first */
    int64_t stride[TS_MAX_DIMS]; /* in elements */
    int64_t idx[TS_MAX_DIMS];
    int64_t off;
} elem_iter;

static void elem_iter_init_geom(elem_iter *it, int ndim, const int64_t *shape, const int64_t *strides)
{
    it->nd = 0;
    it->off = 0;
    /* innermost (last) dimension first, then a stable insertion sort by
     * stride, like TensorIterator's reorder_dimensions */
    for (int d = ndim - 1; d >= 0; d--) {
        if (shape[d] == 1) continue;
        int k = it->nd++;
        while (k > 0 && it->stride[k - 1] > strides[d]) {
            it->size[k] = it->size[k - 1];
            it->stride[k] = it->stride[k - 1];
            k--;
        }
        it->size[k] = shape[d];
        it->stride[k] = strides[d];
    }
    for (int d = 0; d < it->nd; d++) it->idx[d] = 0;
}

static void elem_iter_init(elem_iter *it, const ts_tensor *t)
{
    elem_iter_init_geom(it, t->ndim, t->shape, t->strides);
}

/* Offset of the current element, then advances. */
static inline int64_t elem_iter_next(elem_iter *it)
{
    int64_t cur = it->off;
    for (int d = 0; d < it->nd; d++) {
        it->off += it->stride[d];
        if (++it->idx[d] < it->size[d]) break;
        it->off -= it->stride[d] * it->size[d];
        it->idx[d] = 0;
    }
    return cur;
}

/* torch's is_contiguous: size-1 dimensions may have any stride, and an
 * empty tensor is contiguous. */
static bool is_dense_contiguous_geom(int ndim, const int64_t *shape, const int64_t *strides)
{
    for (int d = 0; d < ndim; d++)
        if (shape[d] == 0) return true;
    int64_t expected = 1;
    for (int d = ndim - 1; d >= 0; d--) {
        if (shape[d] == 1) continue;
        if (strides[d] != expected) return false;
        expected *= shape[d];
    }
    return true;
}

static bool is_dense_contiguous(const ts_tensor *t) { return is_dense_contiguous_geom(t->ndim, t->shape, t->strides); }

static int64_t tensor_numel(const ts_tensor *t)
{
    int64_t n = 1;
    for (int d = 0; d < t->ndim; d++) n *= t->shape[d];
    return n;
}

/* Common checks of the in-place fills: a usable tensor (not released, not a
 * shard), float32/float64, no two elements at one address. Sets *data_out
 * (NULL for an empty tensor or a meta one: ts__is_meta tells them apart;
 * the fill then records itself, [Note: deferred init]). */
static ts_status fill_prepare(const char *op, ts_tensor *t, void **data_out)
{
    ts_status st = ts__check_inputs(op, 1, &t);
    if (st != TS_OK) return st;
    if (t->dtype != TS_F32 && t->dtype != TS_F64)
        return ts_error(TS_ERR_DTYPE, "%s: dtype %s is not supported (float32 or float64)", op,
                        ts_dtype_name(t->dtype));
    if (tensor_numel(t) == 0) {
        *data_out = NULL;
        return TS_OK;
    }
    for (int d = 0; d < t->ndim; d++)
        if (t->strides[d] == 0 && t->shape[d] > 1)
            return ts_error(TS_ERR_INVALID_ARGUMENT,
                            "%s: dim %d of size %lld has stride 0, so several elements share one memory "
                            "location; fill a contiguous tensor (ts_contiguous) instead",
                            op, d, (long long)t->shape[d]);
    if (ts__is_meta(t)) {
        *data_out = NULL;
        return TS_OK;
    }
    *data_out = ts_tensor_data(t);
    if (!*data_out) return ts_error(TS_ERR_RELEASED, "%s: the tensor's storage is released", op);
    return TS_OK;
}

/* ----------------------------------------------------------- in-place fills */

ts_status ts_uniform_(ts_tensor *t, double from, double to, ts_generator *gen)
{
    void *data;
    ts_status st = fill_prepare("uniform_", t, &data);
    if (st != TS_OK) return st;
    double max = t->dtype == TS_F32 ? (double)FLT_MAX : DBL_MAX;
    if (!(from >= -max && from <= max))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "uniform_: from=%g is out of bounds for %s", from,
                        ts_dtype_name(t->dtype));
    if (!(to >= -max && to <= max))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "uniform_: to=%g is out of bounds for %s", to,
                        ts_dtype_name(t->dtype));
    if (from > to)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "uniform_: expects a [from, to) range, but from=%g > to=%g", from, to);
    if (!(to - from <= max))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "uniform_: to - from must be <= the largest %s, but to=%g and from=%g",
                        ts_dtype_name(t->dtype), to, from);
    if (ts__is_meta(t)) return ts__init_record("uniform_", t, TS__INIT_UNIFORM, from, to, gen);
    if (!data) return TS_OK;
    ts_generator *g = gen_or_default(gen);
    elem_iter it;
    elem_iter_init(&it, t);
    int64_t n = tensor_numel(t);
    if (t->dtype == TS_F32) {
        float *p = data;
        float f = (float)from;
        float range = (float)to - f;
        for (int64_t i = 0; i < n; i++) p[elem_iter_next(&it)] = fmaf(u24(g), range, f);
    } else {
        double *p = data;
        double range = to - from;
        for (int64_t i = 0; i < n; i++) p[elem_iter_next(&it)] = fma(u53(g), range, from);
    }
    return TS_OK;
}

ts_status ts_normal_(ts_tensor *t, double mean, double std, ts_generator *gen)
{
    void *data;
    ts_status st = fill_prepare("normal_", t, &data);
    if (st != TS_OK) return st;
    if (!(std >= 0.0)) return ts_error(TS_ERR_INVALID_ARGUMENT, "normal_: expects std >= 0.0, but std=%g", std);
    if (ts__is_meta(t)) return ts__init_record("normal_", t, TS__INIT_NORMAL, mean, std, gen);
    if (!data) return TS_OK;
    ts_generator *g = gen_or_default(gen);
    int64_t n = tensor_numel(t);
    if (n >= 16 && is_dense_contiguous(t)) {
        if (t->dtype == TS_F32) normal_fill_f32(g, data, n, (float)mean, (float)std);
        else normal_fill_f64(g, data, n, mean, std);
        return TS_OK;
    }
    elem_iter it;
    elem_iter_init(&it, t);
    if (t->dtype == TS_F32) {
        float *p = data;
        for (int64_t i = 0; i < n; i++) p[elem_iter_next(&it)] = (float)normal_scalar(g, mean, std);
    } else {
        double *p = data;
        for (int64_t i = 0; i < n; i++) p[elem_iter_next(&it)] = normal_scalar(g, mean, std);
    }
    return TS_OK;
}

static void bernoulli_dense(int kpath, ts_generator *g, ts_dtype dt, void *data, int64_t n, double p);

/* The non-MKL kernel (docs/rng.md §7): element = U53 < p, two draws each. A
 * contiguous tensor takes the batched draws of bernoulli_dense (the same
 * numbers, in 8 or 16 lanes on the avx2 and avx512 paths); any other
 * visits its elements in TensorIterator order one by one. */
ts_status ts_bernoulli_(ts_tensor *t, double p, ts_generator *gen)
{
    void *data;
    ts_status st = fill_prepare("bernoulli_", t, &data);
    if (st != TS_OK) return st;
    if (!(p >= 0.0 && p <= 1.0))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "bernoulli_: expects p in [0, 1], but p=%g", p);
    if (ts__is_meta(t)) return ts__init_record("bernoulli_", t, TS__INIT_BERNOULLI, p, 0.0, gen);
    if (!data) return TS_OK;
    ts_generator *g = gen_or_default(gen);
    int64_t n = tensor_numel(t);
    if (is_dense_contiguous(t)) {
        bernoulli_dense((int)ts__kpath_active(), g, t->dtype, data, n, p);
        return TS_OK;
    }
    elem_iter it;
    elem_iter_init(&it, t);
    if (t->dtype == TS_F32) {
        float *q = data;
        for (int64_t i = 0; i < n; i++) q[elem_iter_next(&it)] = u53(g) < p ? 1.0f : 0.0f;
    } else {
        double *q = data;
        for (int64_t i = 0; i < n; i++) q[elem_iter_next(&it)] = u53(g) < p ? 1.0 : 0.0;
    }
    return TS_OK;
}

/* ------------------------------------------- bernoulli draws as bits */

/* The keep masks of attention dropout draw two mt19937 words per element
 * of a (B, H, T, S) tensor, so the generator's own speed matters there:
 * the twist, the tempering and the comparison run in 8 (AVX2) or 16
 * (AVX-512F) lanes on the paths that have them (tensor/kernels.h). All
 * integer operations: every path gives the same bits. */

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define R_X86 1
#define R_AVX2 __attribute__((target("avx2")))
#define R_AVX512 __attribute__((target("avx512f,avx2")))
#else
#define R_X86 0
#endif

/* U53 < p as an integer test: x = random64 & (2^53 - 1) is below 2^53,
 * U53 = x * 2^-53 exactly, and scaling both sides by 2^53 is exact for p
 * in [0, 1] (a power of two, no overflow), so U53 < p <=> x < P, P = p *
 * 2^53 (a double <= 2^53), and for an integer x, x < P <=> x < ceil(P). */
static uint64_t u53_threshold(double p) { return (uint64_t)ceil(p * 0x1p53); }

#define MASK53 ((UINT64_C(1) << 53) - 1)

typedef struct bits_ops {
    void (*twist)(uint32_t *mt);                                   /* mt_next_state's loops */
    void (*temper)(uint32_t *out, const uint32_t *src, int64_t n); /* mt_random's tempering */
    uint32_t (*pack)(const uint32_t *w, uint64_t thr);             /* 32 elements from 64 words */
} bits_ops;

static void twist_scalar(uint32_t *p)
{
    int k;
    for (k = 0; k < MT_N - MT_M; k++) p[k] = p[k + MT_M] ^ mt_twist(p[k], p[k + 1]);
    for (; k < MT_N - 1; k++) p[k] = p[k + MT_M - MT_N] ^ mt_twist(p[k], p[k + 1]);
    p[MT_N - 1] = p[MT_M - 1] ^ mt_twist(p[MT_N - 1], p[0]);
}

static void temper_scalar(uint32_t *out, const uint32_t *src, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        uint32_t y = src[i];
        y ^= y >> 11;
        y ^= (y << 7) & UINT32_C(0x9D2C5680);
        y ^= (y << 15) & UINT32_C(0xEFC60000);
        y ^= y >> 18;
        out[i] = y;
    }
}

static uint32_t pack_scalar(const uint32_t *w, uint64_t thr)
{
    uint32_t out = 0;
    for (int i = 0; i < 32; i++) {
        uint64_t x = (((uint64_t)w[2 * i] << 32) | w[2 * i + 1]) & MASK53;
        out |= (uint32_t)(x < thr) << i;
    }
    return out;
}

static const bits_ops bits_scalar = {twist_scalar, temper_scalar, pack_scalar};

#if R_X86
/* The twist in 8 lanes: for k < 227 every operand is an old word (k + 1
 * and k + 397 not yet rewritten); from 227 on, p[k - 227] is a new one,
 * written at least 227 > 8 words earlier. */
R_AVX2 static void twist_avx2(uint32_t *p)
{
    const __m256i um = _mm256_set1_epi32((int)MT_UMASK), lm = _mm256_set1_epi32((int)MT_LMASK),
                  one = _mm256_set1_epi32(1), ma = _mm256_set1_epi32((int)MT_MATRIX_A), zero = _mm256_setzero_si256();
    int k = 0;
    for (int part = 0; part < 2; part++) {
        int end = part == 0 ? MT_N - MT_M : MT_N - 1, off = part == 0 ? MT_M : MT_M - MT_N;
        for (; k + 8 <= end; k += 8) {
            __m256i u = _mm256_loadu_si256((const __m256i *)(const void *)(p + k));
            __m256i v = _mm256_loadu_si256((const __m256i *)(const void *)(p + k + 1));
            __m256i s = _mm256_loadu_si256((const __m256i *)(const void *)(p + k + off));
            __m256i y = _mm256_srli_epi32(_mm256_or_si256(_mm256_and_si256(u, um), _mm256_and_si256(v, lm)), 1);
            __m256i mag = _mm256_andnot_si256(_mm256_cmpeq_epi32(_mm256_and_si256(v, one), zero), ma);
            _mm256_storeu_si256((__m256i *)(void *)(p + k), _mm256_xor_si256(_mm256_xor_si256(s, y), mag));
        }
        for (; k < end; k++) p[k] = p[k + off] ^ mt_twist(p[k], p[k + 1]);
    }
    p[MT_N - 1] = p[MT_M - 1] ^ mt_twist(p[MT_N - 1], p[0]);
}

R_AVX2 static void temper_avx2(uint32_t *out, const uint32_t *src, int64_t n)
{
    const __m256i b = _mm256_set1_epi32((int)UINT32_C(0x9D2C5680)), c = _mm256_set1_epi32((int)UINT32_C(0xEFC60000));
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i y = _mm256_loadu_si256((const __m256i *)(const void *)(src + i));
        y = _mm256_xor_si256(y, _mm256_srli_epi32(y, 11));
        y = _mm256_xor_si256(y, _mm256_and_si256(_mm256_slli_epi32(y, 7), b));
        y = _mm256_xor_si256(y, _mm256_and_si256(_mm256_slli_epi32(y, 15), c));
        y = _mm256_xor_si256(y, _mm256_srli_epi32(y, 18));
        _mm256_storeu_si256((__m256i *)(void *)(out + i), y);
    }
    temper_scalar(out + i, src + i, n - i);
}

/* x and the threshold are below 2^63, so the signed compare is exact. */
R_AVX2 static uint32_t pack_avx2(const uint32_t *w, uint64_t thr)
{
    const __m256i m53 = _mm256_set1_epi64x((long long)MASK53), t = _mm256_set1_epi64x((long long)thr);
    uint32_t out = 0;
    for (int g = 0; g < 8; g++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(const void *)(w + 8 * g));
        __m256i x = _mm256_and_si256(_mm256_shuffle_epi32(v, 0xB1), m53); /* (w[2i] << 32) | w[2i+1] */
        out |= (uint32_t)_mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpgt_epi64(t, x))) << (4 * g);
    }
    return out;
}

R_AVX512 static void twist_avx512(uint32_t *p)
{
    const __m512i um = _mm512_set1_epi32((int)MT_UMASK), lm = _mm512_set1_epi32((int)MT_LMASK),
                  one = _mm512_set1_epi32(1), ma = _mm512_set1_epi32((int)MT_MATRIX_A);
    int k = 0;
    for (int part = 0; part < 2; part++) {
        int end = part == 0 ? MT_N - MT_M : MT_N - 1, off = part == 0 ? MT_M : MT_M - MT_N;
        for (; k + 16 <= end; k += 16) {
            __m512i u = _mm512_loadu_si512(p + k), v = _mm512_loadu_si512(p + k + 1),
                    s = _mm512_loadu_si512(p + k + off);
            __m512i y = _mm512_srli_epi32(_mm512_or_si512(_mm512_and_si512(u, um), _mm512_and_si512(v, lm)), 1);
            __m512i mag = _mm512_maskz_mov_epi32(_mm512_test_epi32_mask(v, one), ma);
            _mm512_storeu_si512(p + k, _mm512_xor_si512(_mm512_xor_si512(s, y), mag));
        }
        for (; k < end; k++) p[k] = p[k + off] ^ mt_twist(p[k], p[k + 1]);
    }
    p[MT_N - 1] = p[MT_M - 1] ^ mt_twist(p[MT_N - 1], p[0]);
}

R_AVX512 static void temper_avx512(uint32_t *out, const uint32_t *src, int64_t n)
{
    const __m512i b = _mm512_set1_epi32((int)UINT32_C(0x9D2C5680)), c = _mm512_set1_epi32((int)UINT32_C(0xEFC60000));
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i y = _mm512_loadu_si512(src + i);
        y = _mm512_xor_si512(y, _mm512_srli_epi32(y, 11));
        y = _mm512_xor_si512(y, _mm512_and_si512(_mm512_slli_epi32(y, 7), b));
        y = _mm512_xor_si512(y, _mm512_and_si512(_mm512_slli_epi32(y, 15), c));
        y = _mm512_xor_si512(y, _mm512_srli_epi32(y, 18));
        _mm512_storeu_si512(out + i, y);
    }
    temper_scalar(out + i, src + i, n - i);
}

R_AVX512 static uint32_t pack_avx512(const uint32_t *w, uint64_t thr)
{
    const __m512i m53 = _mm512_set1_epi64((long long)MASK53), t = _mm512_set1_epi64((long long)thr);
    uint32_t out = 0;
    for (int g = 0; g < 4; g++) {
        __m512i x = _mm512_and_si512(_mm512_rol_epi64(_mm512_loadu_si512(w + 16 * g), 32), m53);
        out |= (uint32_t)_mm512_cmplt_epu64_mask(x, t) << (8 * g);
    }
    return out;
}

static const bits_ops bits_avx2 = {twist_avx2, temper_avx2, pack_avx2};
static const bits_ops bits_avx512 = {twist_avx512, temper_avx512, pack_avx512};
#endif

/* n tempered mt19937 outputs into out, in the order mt_random returns
 * them, leaving the generator as n calls of mt_random would: the words
 * still untwisted in the state (left - 1 of them) are tempered in one
 * pass, then the state is twisted as mt_random twists it (there, after a
 * twist, left = MT_N and next = 1 once the first word is out; here left =
 * MT_N + 1 and next = 0 before it). */
static void mt_fill(const bits_ops *ops, ts_generator *g, uint32_t *out, int64_t n)
{
    while (n > 0) {
        if (g->left <= 1) {
            ops->twist(g->mt);
            g->left = MT_N + 1;
            g->next = 0;
        }
        int64_t k = g->left - 1 < n ? g->left - 1 : n;
        ops->temper(out, g->mt + g->next, k);
        g->next += (uint32_t)k;
        g->left -= (int32_t)k;
        out += k;
        n -= k;
    }
}

/* Row by row, in chunks of CHUNK elements (a multiple of 32, so that a
 * chunk starts at a word of the row): 2 words per element, 32 elements
 * packed per word. The words past a row's end in the last group are
 * stale or zero; their bits are cleared. */
static const bits_ops *bits_ops_for(int kpath)
{
#if R_X86
    if (kpath >= TS__KPATH_AVX512) return &bits_avx512;
    if (kpath == TS__KPATH_AVX2) return &bits_avx2;
#endif
    (void)kpath;
    return &bits_scalar;
}

enum { CHUNK = 1024 };                               /* elements per batch of words */
static _Thread_local uint32_t bits_words[2 * CHUNK]; /* zero at first, then stale words */

void ts__rng_bernoulli_bits_on(int kpath, ts_generator *gen, double p, int64_t rows, int64_t cols, int64_t row_words,
                               uint32_t *bits)
{
    const bits_ops *ops = bits_ops_for(kpath);
    ts_generator *g = gen_or_default(gen);
    uint64_t thr = u53_threshold(p);
    uint32_t *w = bits_words;
    memset(bits, 0, (size_t)(rows * row_words) * sizeof *bits);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c0 = 0; c0 < cols; c0 += CHUNK) {
            int64_t m = cols - c0 < CHUNK ? cols - c0 : CHUNK;
            mt_fill(ops, g, w, 2 * m);
            uint32_t *row = bits + r * row_words + c0 / 32;
            for (int64_t j = 0; j < m; j += 32) {
                uint32_t wd = ops->pack(w + 2 * j, thr);
                row[j / 32] = m - j >= 32 ? wd : wd & ((UINT32_C(1) << (m - j)) - 1u);
            }
        }
}

void ts__rng_bernoulli_bits(ts_generator *gen, double p, int64_t rows, int64_t cols, int64_t row_words, uint32_t *bits)
{
    ts__rng_bernoulli_bits_on((int)ts__kpath_active(), gen, p, rows, cols, row_words, bits);
}

/* ts_bernoulli_ over n contiguous elements (float32 or float64) on kernel
 * path kpath: the bits above, expanded to 1 and 0, batch by batch. */
static void bernoulli_dense(int kpath, ts_generator *g, ts_dtype dt, void *data, int64_t n, double p)
{
    const bits_ops *ops = bits_ops_for(kpath);
    uint64_t thr = u53_threshold(p);
    uint32_t *w = bits_words;
    for (int64_t i0 = 0; i0 < n; i0 += CHUNK) {
        int64_t m = n - i0 < CHUNK ? n - i0 : CHUNK;
        mt_fill(ops, g, w, 2 * m);
        for (int64_t j = 0; j < m; j += 32) {
            uint32_t wd = ops->pack(w + 2 * j, thr);
            int k = m - j < 32 ? (int)(m - j) : 32;
            if (dt == TS_F32) {
                float *o = (float *)data + i0 + j;
                for (int i = 0; i < k; i++) o[i] = (float)((wd >> i) & 1u);
            } else {
                double *o = (double *)data + i0 + j;
                for (int i = 0; i < k; i++) o[i] = (double)((wd >> i) & 1u);
            }
        }
    }
}

/* ------------------------------------------------- deferred init: replay */

/* ts__init_replay ([Note: deferred init] in tensor/internal.h) repeats
 * the in-place fills above for a recorded event, block by block: the
 * same words drawn in the same order, the same arithmetic per element, so
 * that each element it keeps is the eager fill's element and the
 * generator ends where the eager fill left it. The eager fill's two
 * element orders are the replay's too: memory order (offset + i) for a
 * dense contiguous geometry, TensorIterator order (elem_iter) otherwise. */

_Static_assert(TS__INIT_REPLAY_BLOCK % 16 == 0, "a replay block holds whole normal_ chunks");

/* Where a replay writes: storage offsets [begin, end) to dst. */
typedef struct replay_sink {
    int64_t begin, end;
    ts_dtype src_dt, dst_dt;
    size_t src_es, dst_es;
    char *dst;
} replay_sink;

static bool sink_hits(const replay_sink *k, int64_t off0, int64_t m)
{
    return m > 0 && off0 < k->end && off0 + m > k->begin;
}

/* m values (src_dt, contiguous in vals) at storage offsets off0, off0 +
 * 1, ...: the part in range, converted. */
static void sink_run(const replay_sink *k, const char *vals, int64_t off0, int64_t m)
{
    int64_t lo = off0 > k->begin ? off0 : k->begin;
    int64_t hi = off0 + m < k->end ? off0 + m : k->end;
    if (lo < hi)
        ts__buf_convert(k->dst_dt, k->dst + (size_t)(lo - k->begin) * k->dst_es, k->src_dt,
                        vals + (size_t)(lo - off0) * k->src_es, hi - lo);
}

/* m values in the order of `it` (advanced past them), base added to its
 * offsets: each run of consecutive offsets at once. */
static void sink_iter(const replay_sink *k, const char *vals, elem_iter *it, int64_t base, int64_t m)
{
    if (m <= 0) return;
    int64_t start = 0, off0 = base + elem_iter_next(it);
    for (int64_t j = 1; j < m; j++) {
        int64_t o = base + elem_iter_next(it);
        if (o == off0 + (j - start)) continue;
        sink_run(k, vals + (size_t)start * k->src_es, off0, j - start);
        start = j;
        off0 = o;
    }
    sink_run(k, vals + (size_t)start * k->src_es, off0, m - start);
}

/* Advances g by k mt19937 words, as k calls of mt_random would (without
 * tempering them). */
static void skip_words(ts_generator *g, int64_t k)
{
    for (int64_t i = 0; i < k; i++) {
        if (--g->left == 0) mt_next_state(g);
        g->next++;
    }
}

/* uniform_ (ts_uniform_'s loops), bernoulli_ (its scalar path: the same
 * U53 < p per element as the batched bits, which draw the same words) and
 * the constant fill, all one value per element in the fill's order. */
static void replay_elementwise(ts_generator *g, const ts__init_event *ev, const replay_sink *k, char *buf, int64_t n,
                               bool dense)
{
    elem_iter it;
    elem_iter_init_geom(&it, ev->ndim, ev->shape, ev->strides);
    bool f32 = ev->dtype == TS_F32;
    if (ev->kind == TS__INIT_FILL) { /* the value in the tensor's dtype, as ts_tensor_fill_ stores it */
        int64_t m = n < TS__INIT_REPLAY_BLOCK ? n : TS__INIT_REPLAY_BLOCK;
        for (int64_t i = 0; i < m; i++) ts__store(ev->dtype, buf, i, ev->a);
    }
    for (int64_t i0 = 0; i0 < n; i0 += TS__INIT_REPLAY_BLOCK) {
        int64_t m = n - i0 < TS__INIT_REPLAY_BLOCK ? n - i0 : TS__INIT_REPLAY_BLOCK;
        bool need = !dense || sink_hits(k, ev->offset + i0, m);
        switch (ev->kind) {
        case TS__INIT_UNIFORM:
            if (!need) {
                skip_words(g, f32 ? m : 2 * m);
            } else if (f32) {
                float *p = (float *)(void *)buf, f = (float)ev->a, range = (float)ev->b - f;
                for (int64_t i = 0; i < m; i++) p[i] = fmaf(u24(g), range, f);
            } else {
                double *p = (double *)(void *)buf, range = ev->b - ev->a;
                for (int64_t i = 0; i < m; i++) p[i] = fma(u53(g), range, ev->a);
            }
            break;
        case TS__INIT_BERNOULLI:
            if (!need) {
                skip_words(g, 2 * m);
            } else if (f32) {
                float *p = (float *)(void *)buf;
                for (int64_t i = 0; i < m; i++) p[i] = u53(g) < ev->a ? 1.0f : 0.0f;
            } else {
                double *p = (double *)(void *)buf;
                for (int64_t i = 0; i < m; i++) p[i] = u53(g) < ev->a ? 1.0 : 0.0;
            }
            break;
        default: /* TS__INIT_FILL: buf already holds the value */ break;
        }
        if (dense) sink_run(k, buf, ev->offset + i0, m);
        else sink_iter(k, buf, &it, ev->offset, m);
    }
}

/* normal_ on n >= 16 dense elements (normal_fill_f32/f64): all n
 * uniforms in order, each whole 16-chunk transformed, then, when n % 16
 * != 0, 16 fresh uniforms for the last 16 slots. A block is whole chunks;
 * the slots from n - 16 on are written by the tail only. */
static void replay_normal_dense(ts_generator *g, const ts__init_event *ev, const replay_sink *k, char *buf, int64_t n)
{
    bool f32 = ev->dtype == TS_F32;
    int64_t tail = n % 16 ? n - 16 : n;
    float mf = (float)ev->a, sf = (float)ev->b;
    for (int64_t i0 = 0; i0 < n; i0 += TS__INIT_REPLAY_BLOCK) {
        int64_t m = n - i0 < TS__INIT_REPLAY_BLOCK ? n - i0 : TS__INIT_REPLAY_BLOCK;
        int64_t wm = (i0 + m < tail ? i0 + m : tail) - i0; /* slots this block writes */
        if (!sink_hits(k, ev->offset + i0, wm)) {
            skip_words(g, f32 ? m : 2 * m);
            continue;
        }
        if (f32) {
            float *d = (float *)(void *)buf;
            for (int64_t i = 0; i < m; i++) d[i] = u24(g);
            for (int64_t b = 0; b + 16 <= m; b += 16)
                if (sink_hits(k, ev->offset + i0 + b, 16)) fill16_f32(d + b, mf, sf);
        } else {
            double *d = (double *)(void *)buf;
            for (int64_t i = 0; i < m; i++) d[i] = u53(g);
            for (int64_t b = 0; b + 16 <= m; b += 16)
                if (sink_hits(k, ev->offset + i0 + b, 16)) fill16_f64(d + b, ev->a, ev->b);
        }
        sink_run(k, buf, ev->offset + i0, wm);
    }
    if (n % 16 == 0) return;
    if (f32) {
        float *t = (float *)(void *)buf;
        for (int i = 0; i < 16; i++) t[i] = u24(g);
        fill16_f32(t, mf, sf);
    } else {
        double *t = (double *)(void *)buf;
        for (int i = 0; i < 16; i++) t[i] = u53(g);
        fill16_f64(t, ev->a, ev->b);
    }
    sink_run(k, buf, ev->offset + n - 16, 16);
}

/* normal_ on fewer than 16 elements or a non-dense view: normal_scalar
 * per element in TensorIterator order (its cached second value makes
 * every element depend on the one before: nothing is skipped). */
static void replay_normal_scalar(ts_generator *g, const ts__init_event *ev, const replay_sink *k, char *buf, int64_t n)
{
    elem_iter it;
    elem_iter_init_geom(&it, ev->ndim, ev->shape, ev->strides);
    for (int64_t i0 = 0; i0 < n; i0 += TS__INIT_REPLAY_BLOCK) {
        int64_t m = n - i0 < TS__INIT_REPLAY_BLOCK ? n - i0 : TS__INIT_REPLAY_BLOCK;
        if (ev->dtype == TS_F32) {
            float *p = (float *)(void *)buf;
            for (int64_t i = 0; i < m; i++) p[i] = (float)normal_scalar(g, ev->a, ev->b);
        } else {
            double *p = (double *)(void *)buf;
            for (int64_t i = 0; i < m; i++) p[i] = normal_scalar(g, ev->a, ev->b);
        }
        sink_iter(k, buf, &it, ev->offset, m);
    }
}

ts_status ts__init_replay(const ts__init_event *ev, int64_t elem_begin, int64_t elem_end, ts_dtype dst_dtype, void *dst)
{
    if (!ev) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts__init_replay: the event is NULL");
    if (elem_begin < 0 || elem_end < elem_begin)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts__init_replay: range [%lld, %lld) is %s", (long long)elem_begin,
                        (long long)elem_end, elem_begin < 0 ? "negative" : "reversed");
    if (!dst && elem_end > elem_begin)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts__init_replay: dst is NULL for the %lld elements [%lld, %lld)",
                        (long long)(elem_end - elem_begin), (long long)elem_begin, (long long)elem_end);
    if ((unsigned)dst_dtype >= TS_DTYPE_COUNT || (unsigned)ev->dtype >= TS_DTYPE_COUNT)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts__init_replay: dtype %d or %d is not a dtype", (int)ev->dtype,
                        (int)dst_dtype);
    if ((unsigned)ev->kind >= TS__INIT_KIND_COUNT ||
        (ev->kind != TS__INIT_FILL && ev->dtype != TS_F32 && ev->dtype != TS_F64) || ev->ndim < 0 ||
        ev->ndim > TS_MAX_DIMS)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "ts__init_replay: event %llu (kind %d, %s, %d dims) is not a "
                        "recorded initializer",
                        (unsigned long long)ev->seq, (int)ev->kind, ts_dtype_name(ev->dtype), ev->ndim);
    if (ev->repeat_of)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "ts__init_replay: event %llu repeats event %llu (a copy): replay it "
                        "through ts__init_replay_targets, with its source",
                        (unsigned long long)ev->seq, (unsigned long long)ev->repeat_of);
    int64_t n = ts__numel(ev->ndim, ev->shape);
    if (n <= 0) return TS_OK;
    size_t es = ts_dtype_size(ev->dtype);
    int64_t bn = n < TS__INIT_REPLAY_BLOCK ? (n < 16 ? 16 : n) : TS__INIT_REPLAY_BLOCK;
    char *buf = ts__malloc(TS_MEM_OTHER, (size_t)bn * es);
    if (!buf)
        return ts_error(TS_ERR_NO_MEMORY, "ts__init_replay: cannot allocate a block of %lld elements", (long long)bn);
    replay_sink k = {elem_begin, elem_end, ev->dtype, dst_dtype, es, ts_dtype_size(dst_dtype), dst};
    ts_generator *g = gen_or_default(ev->gen);
    bool dense = is_dense_contiguous_geom(ev->ndim, ev->shape, ev->strides);
    if (ev->kind != TS__INIT_NORMAL) replay_elementwise(g, ev, &k, buf, n, dense);
    else if (n >= 16 && dense) replay_normal_dense(g, ev, &k, buf, n);
    else replay_normal_scalar(g, ev, &k, buf, n);
    ts__free(TS_MEM_OTHER, buf);
    return TS_OK;
}

/* ------------------------------------------------------------ new tensors */

static ts_status new_float(const char *op, ts_dtype dtype, int ndim, const int64_t *shape, ts_tensor **out)
{
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: out is NULL", op);
    if (dtype != TS_F32 && dtype != TS_F64)
        return ts_error(TS_ERR_DTYPE, "%s: dtype %s is not supported (float32 or float64)", op, ts_dtype_name(dtype));
    return ts_tensor_empty(dtype, ndim, shape, out);
}

ts_status ts_rand(ts_dtype dtype, int ndim, const int64_t *shape, ts_generator *gen, ts_tensor **out)
{
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "rand: out is NULL");
    ts_tensor *t;
    ts_status st = new_float("rand", dtype, ndim, shape, &t);
    if (st != TS_OK) return st;
    if (ts__is_meta(t)) { /* a meta tensor draws nothing: the generator stays */
        *out = t;
        return TS_OK;
    }
    st = ts_uniform_(t, 0.0, 1.0, gen);
    if (st != TS_OK) {
        ts_tensor_free(t);
        return st;
    }
    *out = t;
    return TS_OK;
}

ts_status ts_randn(ts_dtype dtype, int ndim, const int64_t *shape, ts_generator *gen, ts_tensor **out)
{
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "randn: out is NULL");
    ts_tensor *t;
    ts_status st = new_float("randn", dtype, ndim, shape, &t);
    if (st != TS_OK) return st;
    if (ts__is_meta(t)) { /* a meta tensor draws nothing: the generator stays */
        *out = t;
        return TS_OK;
    }
    st = ts_normal_(t, 0.0, 1.0, gen);
    if (st != TS_OK) {
        ts_tensor_free(t);
        return st;
    }
    *out = t;
    return TS_OK;
}

/* §6.1: range >= 2^32 draws random64, else one random() per element; the
 * modulo bias is torch's. */
ts_status ts_randint(int64_t low, int64_t high, int ndim, const int64_t *shape, ts_generator *gen, ts_tensor **out)
{
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "randint: out is NULL");
    if (low >= high)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "randint: expects low < high, but low=%lld >= high=%lld",
                        (long long)low, (long long)high);
    ts_tensor *t;
    ts_status st = ts_tensor_empty(TS_I64, ndim, shape, &t);
    if (st != TS_OK) return st;
    int64_t n = ts__is_meta(t) ? 0 : tensor_numel(t); /* meta: no draw */
    int64_t *p = n ? ts_tensor_data(t) : NULL;
    ts_generator *g = gen_or_default(gen);
    uint64_t range = (uint64_t)high - (uint64_t)low;
    bool wide = range >= (UINT64_C(1) << 32);
    for (int64_t i = 0; i < n; i++) {
        uint64_t v = wide ? mt_random64(g) : (uint64_t)mt_random(g);
        p[i] = (int64_t)(v % range + (uint64_t)low);
    }
    *out = t;
    return TS_OK;
}

/* §6.2: Fisher-Yates from the front, n - 1 draws. torch 1.13 uses this
 * algorithm for every n (later versions switch above 214,748,364). */
ts_status ts_randperm(int64_t n, ts_generator *gen, ts_tensor **out)
{
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "randperm: out is NULL");
    if (n < 0) return ts_error(TS_ERR_INVALID_ARGUMENT, "randperm: n=%lld must be >= 0", (long long)n);
    ts_tensor *t;
    ts_status st = ts_tensor_empty(TS_I64, 1, &n, &t);
    if (st != TS_OK) return st;
    if (ts__is_meta(t)) { /* a meta tensor draws nothing: the generator stays */
        *out = t;
        return TS_OK;
    }
    int64_t *p = n ? ts_tensor_data(t) : NULL;
    ts_generator *g = gen_or_default(gen);
    for (int64_t i = 0; i < n; i++) p[i] = i;
    for (int64_t i = 0; i < n - 1; i++) {
        int64_t z = (int64_t)((uint64_t)mt_random(g) % (uint64_t)(n - i));
        int64_t sav = p[i];
        p[i] = p[i + z];
        p[i + z] = sav;
    }
    *out = t;
    return TS_OK;
}
