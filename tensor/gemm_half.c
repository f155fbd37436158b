/*
 * bfloat16 and float16 matrix products (see tensor/gemm_half.h for the
 * kernels and docs/bf16-matmul.md for the measurements behind them).
 *
 * Both kernels sum the products in float32 and round each element of C
 * once, after adding beta * C in float32: the result of PyTorch's CPU
 * matmul for bfloat16 (oneDNN with float32 accumulation). They differ from
 * the reference only in the order of the float32 additions.
 *
 * AVX512-BF16 kernel. vdpbf16ps multiplies pairs of bf16 values and adds
 * both products to a float32 lane: lane i of the result gets
 * a[2i] b[2i] + a[2i+1] b[2i+1]. So A and B are packed as pairs along k:
 * a 32-bit word holds (x[., 2p], x[., 2p+1]), with the low half first, and
 * an odd k is padded with a zero pair half on both sides. The blocking is
 * BLIS's: C is cut into NC-column blocks (jc), the whole k extent of B's
 * block is packed once into NR-column micro-panels (shared by the threads,
 * which pack alternate micro-panels), each thread takes its share of the
 * MC-row blocks (ic) and, per KC-pair step (pc), packs its A block into
 * MR-row micro-panels and runs the micro-kernel over every MR x NR tile.
 * A micro-panel of B (KC pairs x NR) stays in L1 while the A micro-panels
 * stream from L2. The micro-kernel accumulates MR x NR float32 in 2 MR zmm
 * registers, kept across the pc steps in a float32 block of C (MC x NC,
 * per thread), which is added to beta * C and rounded once at the end.
 *
 * sgemm kernel. The same idea with BLIS doing the multiplication: per NC
 * columns of B the k x NC block is converted to float32, per MC rows of A
 * the MC x k block is, bli_sgemm multiplies them into a float32 MC x NC
 * block, which is added to beta * C and rounded. A converted block follows
 * the layout of its source (row- or column-major) so the conversion reads
 * contiguous memory through ts__buf_convert. No float32 copy of a whole
 * operand is made; the blocks are bounded (BLK_FLOATS).
 *
 * Scratch comes from the tensor caching pool (no fresh pages per product);
 * without memory the reference runs, which needs none.
 */
#define _GNU_SOURCE
#include "tensor/gemm_half.h"
#include "tensor/internal.h"
#include "tensor/kernels.h"

#include <blis.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define TS__HAVE_AVX512BF16_KERNEL 1
#else
#define TS__HAVE_AVX512BF16_KERNEL 0
#endif

/* ------------------------------------------------------------ choosing */

static const char *const kernel_names[TS__HGEMM_KERNEL_COUNT] = {"sgemm", "avx512bf16"};

const char *ts__hgemm_kernel_name(ts__hgemm_kernel k)
{
    return (int)k >= 0 && k < TS__HGEMM_KERNEL_COUNT ? kernel_names[k] : NULL;
}

bool ts__hgemm_kernel_runnable(ts__hgemm_kernel k, const ts__cpu_info *c)
{
    switch (k) {
    case TS__HGEMM_SGEMM: return true;
    case TS__HGEMM_AVX512BF16:
        return TS__HAVE_AVX512BF16_KERNEL && c->avx && c->os_ymm && c->os_zmm && c->avx512f && c->avx512bw &&
            c->avx512vl && c->avx512bf16;
    default: return false;
    }
}

ts__hgemm_kernel ts__hgemm_choose(const ts__cpu_info *c)
{
    /* AMX-BF16 CPUs (Sapphire Rapids and later) have AVX512_BF16 too:
     * they run the AVX512-BF16 kernel, since no AMX kernel is built. */
    if (ts__hgemm_kernel_runnable(TS__HGEMM_AVX512BF16, c)) return TS__HGEMM_AVX512BF16;
    return TS__HGEMM_SGEMM;
}

/* cpuid once: it traps to the hypervisor in a virtual machine (7% of a
 * 512 x 512 x 512 product when queried per product). */
static pthread_once_t cpu_once = PTHREAD_ONCE_INIT;
static ts__cpu_info cpu_here;

static void query_cpu(void) { ts__cpu_info_query(&cpu_here); }

static const ts__cpu_info *this_cpu(void)
{
    pthread_once(&cpu_once, query_cpu);
    return &cpu_here;
}

static pthread_once_t active_once = PTHREAD_ONCE_INIT;
static ts__hgemm_kernel active_kernel = TS__HGEMM_SGEMM;

static void choose_active(void)
{
    ts__cpu_info cpu = *this_cpu();
    ts__hgemm_kernel chosen = ts__hgemm_choose(&cpu);
    const char *env = getenv("TS_BF16_GEMM_KERNEL");
    const char *why = "chosen from cpuid";
    if (env && *env && strcasecmp(env, "auto") != 0) {
        int want = -1;
        for (int i = 0; i < TS__HGEMM_KERNEL_COUNT; i++)
            if (strcasecmp(env, kernel_names[i]) == 0) want = i;
        if (want < 0)
            ts_logf(TS_LOG_WARN,
                    "TS_BF16_GEMM_KERNEL=%s is not auto, sgemm or avx512bf16; using '%s', chosen "
                    "from cpuid",
                    env, kernel_names[chosen]);
        else if (!ts__hgemm_kernel_runnable((ts__hgemm_kernel)want, &cpu))
            ts_logf(TS_LOG_WARN,
                    "TS_BF16_GEMM_KERNEL=%s: this CPU cannot run it (no AVX512_BF16 with OS zmm "
                    "state); using '%s'",
                    env, kernel_names[chosen]);
        else {
            chosen = (ts__hgemm_kernel)want;
            why = "from TS_BF16_GEMM_KERNEL";
        }
    }
    active_kernel = chosen;
    ts_logf(TS_LOG_INFO, "bfloat16 matmul: '%s' kernel, %s (AVX512_BF16 %s, AMX-BF16 %s; AMX is not built)",
            kernel_names[chosen], why, cpu.avx512bf16 ? "yes" : "no",
            cpu.amx_bf16 && cpu.amx_tile && cpu.os_amx ? "yes" : "no");
}

ts__hgemm_kernel ts__hgemm_active(void)
{
    pthread_once(&active_once, choose_active);
    return active_kernel;
}

const char *ts_bf16_gemm_kernel_name(void) { return kernel_names[ts__hgemm_active()]; }

/* ------------------------------------------------------ element access */

static inline float half_to_f32(ts_dtype dt, uint16_t h)
{
    return dt == TS_BF16 ? ts__bf16_to_f32(h) : ts_f16_to_f32(h);
}

static inline uint16_t f32_to_half(ts_dtype dt, float f)
{
    return dt == TS_BF16 ? ts__f32_to_bf16(f) : ts_f32_to_f16(f);
}

/* C = round(acc + beta * C) for an (m, n) float32 block with row stride
 * ldacc; beta == 0 does not read C. */
static void store_c(ts_dtype dt, int64_t m, int64_t n, const float *acc, int64_t ldacc, float beta, uint16_t *c,
                    int64_t rsc, int64_t csc, float *rowbuf)
{
    for (int64_t i = 0; i < m; i++) {
        const float *ar = acc + i * ldacc;
        uint16_t *cr = c + i * rsc;
        if (beta == 0.0f && csc == 1) {
            ts__buf_convert(dt, cr, TS_F32, ar, n);
            continue;
        }
        if (csc == 1 && rowbuf) {
            ts__buf_convert(TS_F32, rowbuf, dt, cr, n);
            for (int64_t j = 0; j < n; j++) rowbuf[j] = ar[j] + beta * rowbuf[j];
            ts__buf_convert(dt, cr, TS_F32, rowbuf, n);
            continue;
        }
        for (int64_t j = 0; j < n; j++) {
            float v = ar[j];
            if (beta != 0.0f) v += beta * half_to_f32(dt, cr[j * csc]);
            cr[j * csc] = f32_to_half(dt, v);
        }
    }
}

/* C = round(beta * C), for products where A B does not contribute. */
static void scale_c(ts_dtype dt, int64_t m, int64_t n, float beta, uint16_t *c, int64_t rsc, int64_t csc)
{
    if (beta == 1.0f) return;
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            uint16_t *p = c + i * rsc + j * csc;
            *p = beta == 0.0f ? f32_to_half(dt, 0.0f) : f32_to_half(dt, beta * half_to_f32(dt, *p));
        }
}

/* ------------------------------------------------------------ reference */

void ts__gemm_ref_half(ts_dtype dt, int64_t m, int64_t n, int64_t k, const uint16_t *a, int64_t rsa, int64_t csa,
                       const uint16_t *b, int64_t rsb, int64_t csb, float beta, uint16_t *c, int64_t rsc, int64_t csc)
{
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            float acc = 0.0f;
            for (int64_t p = 0; p < k; p++)
                acc += half_to_f32(dt, a[i * rsa + p * csa]) * half_to_f32(dt, b[p * rsb + j * csb]);
            uint16_t *cp = c + i * rsc + j * csc;
            if (beta != 0.0f) acc += beta * half_to_f32(dt, *cp);
            *cp = f32_to_half(dt, acc);
        }
}

/* ------------------------------------------------------------- scratch */

/* Scratch blocks from the caching pool (sizes in bytes, 64-byte aligned). */
typedef struct scratch {
    void *p;
    size_t bytes;
} scratch;

static bool scratch_get(scratch *s, size_t bytes)
{
    s->p = ts__pool_alloc(bytes ? bytes : 64, &s->bytes);
    return s->p != NULL;
}

static void scratch_put(scratch *s)
{
    if (s->p) ts__pool_free(s->p, s->bytes);
    s->p = NULL;
}

/* ---------------------------------------------------------- sgemm path */

/* Floats per converted block of A (16 MiB; B's may be twice that). */
#define BLK_FLOATS ((int64_t)4 << 20)

/* dst = src (rows, cols) in float32, in the source's layout: row-major
 * (ld cols) when cs == 1 or neither stride is 1, column-major (ld rows)
 * when rs == 1. Returns true for column-major. */
static bool convert_block(ts_dtype dt, int64_t rows, int64_t cols, const uint16_t *src, int64_t rs, int64_t cs,
                          float *dst)
{
    if (rs == 1 && cs != 1) {
        for (int64_t j = 0; j < cols; j++) ts__buf_convert(TS_F32, dst + j * rows, dt, src + j * cs, rows);
        return true;
    }
    for (int64_t i = 0; i < rows; i++) {
        if (cs == 1) {
            ts__buf_convert(TS_F32, dst + i * cols, dt, src + i * rs, cols);
        } else {
            for (int64_t j = 0; j < cols; j++) dst[i * cols + j] = half_to_f32(dt, src[i * rs + j * cs]);
        }
    }
    return false;
}

/* Strides BLIS accepts for a contiguous (rows, cols) block whose sizes of
 * 1 have arbitrary strides (BLIS reserves rs == cs == 1 for 1 x 1). */
static void canon_strides(int64_t rows, int64_t cols, int64_t *rs, int64_t *cs)
{
    if (rows == 1 && cols == 1) *rs = *cs = 1;
    else if (rows == 1) *rs = cols * *cs;
    else if (cols == 1) *cs = rows * *rs;
}

/* gemm_sgemm's block sizes: B's block as wide as the budget allows (all
 * of n for the Linear shapes: A is then converted once), A's as tall. The
 * scratch estimate and the meta ledger read them from here too. */
static void sgemm_blocks(int64_t m, int64_t n, int64_t k, int64_t *mc_out, int64_t *nc_out)
{
    int64_t nc = 2 * BLK_FLOATS / k, mc = 2 * BLK_FLOATS / k;
    nc = nc < 64 ? 64 : nc;
    mc = mc < 64 ? 64 : mc > 1024 ? 1024 : mc;
    *nc_out = nc > n ? n : nc;
    *mc_out = mc > m ? m : mc;
}

static bool gemm_sgemm(ts_dtype dt, int64_t m, int64_t n, int64_t k, const uint16_t *a, int64_t rsa, int64_t csa,
                       const uint16_t *b, int64_t rsb, int64_t csb, float beta, uint16_t *c, int64_t rsc, int64_t csc)
{
    int64_t mc, nc;
    sgemm_blocks(m, n, k, &mc, &nc);
    scratch sa, sb, sc, sr;
    sr.p = NULL;
    if (!scratch_get(&sa, (size_t)(mc * k) * sizeof(float))) return false;
    if (!scratch_get(&sb, (size_t)(nc * k) * sizeof(float))) {
        scratch_put(&sa);
        return false;
    }
    if (!scratch_get(&sc, (size_t)(mc * nc) * sizeof(float))) {
        scratch_put(&sa);
        scratch_put(&sb);
        return false;
    }
    if (beta != 0.0f && csc == 1)
        scratch_get(&sr, (size_t)nc * sizeof(float)); /* optional: without it store_c goes element-wise */
    ts__blis_ensure_init();
    float one = 1.0f, zero = 0.0f;
    float *af = sa.p, *bf = sb.p, *cf = sc.p;
    for (int64_t jc = 0; jc < n; jc += nc) {
        int64_t nb = n - jc < nc ? n - jc : nc;
        bool bcol = convert_block(dt, k, nb, b + jc * csb, rsb, csb, bf);
        int64_t brs = bcol ? 1 : nb, bcs = bcol ? k : 1;
        for (int64_t ic = 0; ic < m; ic += mc) {
            int64_t mb = m - ic < mc ? m - ic : mc;
            bool acol = convert_block(dt, mb, k, a + ic * rsa, rsa, csa, af);
            int64_t ars = acol ? 1 : k, acs = acol ? mb : 1;
            int64_t brs1 = brs, bcs1 = bcs, crs = nb, ccs = 1;
            canon_strides(mb, k, &ars, &acs);
            canon_strides(k, nb, &brs1, &bcs1);
            canon_strides(mb, nb, &crs, &ccs);
            bli_sgemm(BLIS_NO_TRANSPOSE, BLIS_NO_TRANSPOSE, mb, nb, k, &one, af, ars, acs, bf, brs1, bcs1, &zero, cf,
                      crs, ccs);
            store_c(dt, mb, nb, cf, nb, beta, c + ic * rsc + jc * csc, rsc, csc, sr.p);
        }
    }
    scratch_put(&sa);
    scratch_put(&sb);
    scratch_put(&sc);
    scratch_put(&sr);
    return true;
}

/* ---------------------------------------------------- AVX512-BF16 path */

#if TS__HAVE_AVX512BF16_KERNEL

#define MR 14
#define NR 32
#define KC2 256 /* k pairs per pc step (512 values of k) */
#define MC (MR * 12)
#define NC 1024
#define MAX_THREADS 64

/* The bf16 pair (x[row, 2p], x[row, 2p+1]) of a (rows, k) operand as one
 * word (low half first), zero outside. */
static inline uint32_t pair_at(const uint16_t *x, int64_t rows, int64_t k, int64_t rs, int64_t cs, int64_t row,
                               int64_t p)
{
    if (row >= rows) return 0;
    int64_t k0 = 2 * p;
    uint32_t lo = k0 < k ? x[row * rs + k0 * cs] : 0;
    uint32_t hi = k0 + 1 < k ? x[row * rs + (k0 + 1) * cs] : 0;
    return lo | hi << 16;
}

/* Packs rows [r0, r0 + MR) and pairs [p0, p0 + np) of a (rows, k) operand
 * into dst[p * MR + i]. */
static void pack_panel(const uint16_t *x, int64_t rows, int64_t k, int64_t rs, int64_t cs, int64_t r0, int64_t p0,
                       int64_t np, int64_t width, uint32_t *dst)
{
    bool full_rows = r0 + width <= rows;
    /* pairs [p0, p0 + nf) have both halves inside k; the rest (an odd k's
     * last pair) goes through pair_at */
    int64_t nf = k / 2 - p0;
    nf = nf < 0 ? 0 : nf > np ? np : nf;
    if (!full_rows) nf = 0;
    if (nf > 0 && cs == 1) {
        /* pairs adjacent in memory: a transpose of 32-bit words */
        for (int64_t i = 0; i < width; i++) {
            const uint16_t *src = x + (r0 + i) * rs + 2 * p0;
            for (int64_t p = 0; p < nf; p++) {
                uint32_t w;
                memcpy(&w, src + 2 * p, sizeof w);
                dst[p * width + i] = w;
            }
        }
    } else if (nf > 0 && rs == 1) {
        /* the rows of a pair are contiguous in two columns: interleave */
        for (int64_t p = 0; p < nf; p++) {
            const uint16_t *lo = x + r0 + 2 * (p0 + p) * cs, *hi = lo + cs;
            uint32_t *d = dst + p * width;
            for (int64_t i = 0; i < width; i++) d[i] = (uint32_t)lo[i] | (uint32_t)hi[i] << 16;
        }
    } else {
        nf = 0;
    }
    for (int64_t p = nf; p < np; p++)
        for (int64_t i = 0; i < width; i++) dst[p * width + i] = pair_at(x, rows, k, rs, cs, r0 + i, p0 + p);
}

#define TS__AVX512BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

/* ts__f32_to_bf16 on 16 lanes (the same formula: round to nearest even on
 * the bits, NaN to 0x7FC0), so that the tile stored straight from the
 * registers equals what store_c would write. */
TS__AVX512BF16_TARGET static inline __m256i f32x16_to_bf16(__m512 x)
{
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, lsb), _mm512_set1_epi32(0x7FFF)), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
}

/* acc + beta * out (beta != 0), rounded into 16 bf16 at out. */
TS__AVX512BF16_TARGET static inline void store_bf16x16(uint16_t *out, __m512 acc, float beta)
{
    if (beta != 0.0f) {
        __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)out));
        __m512 cv = _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
        acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_set1_ps(beta), cv));
    }
    _mm256_storeu_si256((__m256i *)out, f32x16_to_bf16(acc));
}

/* c (MR x NR, row stride ldc) = (first ? 0 : c) + A-panel B-panel over
 * kc2 pairs; with `out` (the last pc step of a full tile of a C with unit
 * column stride), the tile goes instead to out (row stride ldo) as
 * round(sum + beta * out), skipping the float32 block. */
TS__AVX512BF16_TARGET static void ukr_bf16(int64_t kc2, const uint32_t *restrict ap, const uint32_t *restrict bp,
                                           float *restrict c, int64_t ldc, bool first, uint16_t *out, int64_t ldo,
                                           float beta)
{
    __m512 acc[MR][2];
    for (int i = 0; i < MR; i++) {
        acc[i][0] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + i * ldc);
        acc[i][1] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + i * ldc + 16);
    }
    for (int64_t p = 0; p < kc2; p++) {
        __m512bh b0 = (__m512bh)_mm512_loadu_si512(bp + p * NR);
        __m512bh b1 = (__m512bh)_mm512_loadu_si512(bp + p * NR + 16);
        const uint32_t *ar = ap + p * MR;
        for (int i = 0; i < MR; i++) {
            __m512bh av = (__m512bh)_mm512_set1_epi32((int)ar[i]);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], av, b0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], av, b1);
        }
    }
    if (out) {
        for (int i = 0; i < MR; i++) {
            store_bf16x16(out + i * ldo, acc[i][0], beta);
            store_bf16x16(out + i * ldo + 16, acc[i][1], beta);
        }
        return;
    }
    for (int i = 0; i < MR; i++) {
        _mm512_storeu_ps(c + i * ldc, acc[i][0]);
        _mm512_storeu_ps(c + i * ldc + 16, acc[i][1]);
    }
}

typedef struct bf16_job {
    int64_t m, n, k;
    const uint16_t *a, *b;
    int64_t rsa, csa, rsb, csb, rsc, csc;
    float beta;
    uint16_t *c;
    int nt;
    uint32_t *bp; /* shared packed B block: (NC / NR) micro-panels of kp x NR words */
    pthread_barrier_t *bar;
    /* the start gate: helpers wait until the thread count is final */
    pthread_mutex_t gate_mu;
    pthread_cond_t gate_cv;
    bool go;
    struct bf16_thread {
        struct bf16_job *job;
        int index;
        uint32_t *ap; /* MC x KC2 pairs */
        float *cbuf;  /* MC x NC float32 */
        float *rowbuf;
        scratch sa, sc, sr;
    } th[MAX_THREADS];
} bf16_job;

static void bf16_run(bf16_job *j, int t)
{
    int64_t m = j->m, n = j->n, k = j->k, kp = (k + 1) / 2;
    /* this thread's rows: whole MR tiles, split evenly */
    int64_t tiles = (m + MR - 1) / MR, per = (tiles + j->nt - 1) / j->nt;
    int64_t r_begin = t * per * MR, r_end = (t + 1) * per * MR;
    if (r_end > m) r_end = m;
    uint32_t *ap = j->th[t].ap;
    float *cb = j->th[t].cbuf;
    for (int64_t jc = 0; jc < n; jc += NC) {
        int64_t nb = n - jc < NC ? n - jc : NC, npan = (nb + NR - 1) / NR;
        if (j->nt > 1) pthread_barrier_wait(j->bar); /* the other thread is done with the previous block */
        /* B's block, as (kc x NR) micro-panels of (b[2p][c], b[2p+1][c]):
         * B (k, n) is the transpose of a (n, k) operand with strides
         * (csb, rsb), which pack_panel packs by rows */
        for (int64_t q = t; q < npan; q += j->nt)
            pack_panel(j->b + jc * j->csb, nb, k, j->csb, j->rsb, q * NR, 0, kp, NR, j->bp + q * kp * NR);
        if (j->nt > 1) pthread_barrier_wait(j->bar);
        for (int64_t ic = r_begin; ic < r_end; ic += MC) {
            int64_t mb = r_end - ic < MC ? r_end - ic : MC, mpan = (mb + MR - 1) / MR;
            /* full tiles of a C with unit column stride are rounded and
             * stored by the micro-kernel at the last pc step; the rest
             * (edge tiles, other C layouts) goes through cb and store_c */
            bool fuse = j->csc == 1;
            int64_t mfull = fuse ? mb / MR : 0, nfull = fuse ? nb / NR : 0;
            uint16_t *cblk = j->c + ic * j->rsc + jc * j->csc;
            for (int64_t pc = 0; pc < kp; pc += KC2) {
                int64_t np = kp - pc < KC2 ? kp - pc : KC2;
                bool last = pc + KC2 >= kp;
                for (int64_t r = 0; r < mpan; r++)
                    pack_panel(j->a + ic * j->rsa, mb, k, j->rsa, j->csa, r * MR, pc, np, MR, ap + r * KC2 * MR);
                for (int64_t q = 0; q < npan; q++) {
                    const uint32_t *bq = j->bp + q * kp * NR + pc * NR;
                    for (int64_t r = 0; r < mpan; r++) {
                        bool direct = last && r < mfull && q < nfull;
                        ukr_bf16(np, ap + r * KC2 * MR, bq, cb + r * MR * NC + q * NR, NC, pc == 0,
                                 direct ? cblk + r * MR * j->rsc + q * NR : NULL, j->rsc, j->beta);
                    }
                }
            }
            if (!fuse || mfull * nfull == 0) {
                store_c(TS_BF16, mb, nb, cb, NC, j->beta, cblk, j->rsc, j->csc, j->th[t].rowbuf);
            } else {
                int64_t mf = mfull * MR, nf = nfull * NR;
                if (nf < nb) /* right edge of the full rows */
                    store_c(TS_BF16, mf, nb - nf, cb + nf, NC, j->beta, cblk + nf, j->rsc, 1, j->th[t].rowbuf);
                if (mf < mb) /* bottom edge, all columns */
                    store_c(TS_BF16, mb - mf, nb, cb + mf * NC, NC, j->beta, cblk + mf * j->rsc, j->rsc, 1,
                            j->th[t].rowbuf);
            }
        }
    }
}

static void *bf16_thread_main(void *arg)
{
    struct bf16_thread *th = arg;
    bf16_job *j = th->job;
    pthread_mutex_lock(&j->gate_mu);
    while (!j->go) pthread_cond_wait(&j->gate_cv, &j->gate_mu);
    pthread_mutex_unlock(&j->gate_mu);
    bf16_run(j, th->index);
    return NULL;
}

/* The threads of an (m, n, k) bf16 product, as the sgemm path has them
 * (ts_get_num_threads): one per 2 MR rows at most, and one for products
 * too small to pay for a thread. gemm_avx512bf16 runs with them and
 * ts__gemm_half_meta counts their scratch. */
static int bf16_threads(int64_t m, int64_t n, int64_t k)
{
    int nt = ts_get_num_threads();
    nt = nt > MAX_THREADS ? MAX_THREADS : nt;
    if ((double)m * (double)n * (double)k < 4e6) nt = 1;
    while (nt > 1 && m < (int64_t)nt * 2 * MR) nt--;
    return nt;
}

static bool gemm_avx512bf16(int64_t m, int64_t n, int64_t k, const uint16_t *a, int64_t rsa, int64_t csa,
                            const uint16_t *b, int64_t rsb, int64_t csb, float beta, uint16_t *c, int64_t rsc,
                            int64_t csc)
{
    bf16_job *j = ts__calloc(TS_MEM_OTHER, 1, sizeof *j);
    if (!j) return false;
    *j = (bf16_job){.m = m,
                    .n = n,
                    .k = k,
                    .a = a,
                    .b = b,
                    .rsa = rsa,
                    .csa = csa,
                    .rsb = rsb,
                    .csb = csb,
                    .rsc = rsc,
                    .csc = csc,
                    .beta = beta,
                    .c = c};
    int nt = bf16_threads(m, n, k);
    int64_t kp = (k + 1) / 2, nb = n < NC ? n : NC, npan = (nb + NR - 1) / NR;
    scratch sb;
    bool ok = scratch_get(&sb, (size_t)(npan * kp * NR) * sizeof(uint32_t));
    int got = 0;
    for (; ok && got < nt; got++) {
        struct bf16_thread *th = &j->th[got];
        th->job = j;
        th->index = got;
        ok = scratch_get(&th->sa, (size_t)(MC * KC2) * sizeof(uint32_t));
        if (ok && !(ok = scratch_get(&th->sc, (size_t)(MC * NC) * sizeof(float)))) scratch_put(&th->sa);
        if (!ok) break;
        if (beta != 0.0f && csc == 1 && !scratch_get(&th->sr, (size_t)NC * sizeof(float)))
            th->sr.p = NULL; /* optional: store_c goes element-wise without it */
        th->ap = th->sa.p;
        th->cbuf = th->sc.p;
        th->rowbuf = th->sr.p;
    }
    pthread_barrier_t bar;
    pthread_t tid[MAX_THREADS];
    if (ok) {
        j->bp = sb.p;
        pthread_mutex_init(&j->gate_mu, NULL);
        pthread_cond_init(&j->gate_cv, NULL);
        /* helpers start at the gate; if one cannot be created, fewer
         * threads share the rows (the count is fixed before any work) */
        int started = 1;
        while (started < nt && pthread_create(&tid[started], NULL, bf16_thread_main, &j->th[started]) == 0) started++;
        j->nt = started;
        if (started > 1) {
            pthread_barrier_init(&bar, NULL, (unsigned)started);
            j->bar = &bar;
        }
        pthread_mutex_lock(&j->gate_mu);
        j->go = true;
        pthread_cond_broadcast(&j->gate_cv);
        pthread_mutex_unlock(&j->gate_mu);
        bf16_run(j, 0);
        for (int i = 1; i < started; i++) pthread_join(tid[i], NULL);
        if (started > 1) pthread_barrier_destroy(&bar);
        pthread_cond_destroy(&j->gate_cv);
        pthread_mutex_destroy(&j->gate_mu);
    }
    scratch_put(&sb);
    for (int t = 0; t < got; t++) {
        scratch_put(&j->th[t].sa);
        scratch_put(&j->th[t].sc);
        scratch_put(&j->th[t].sr);
    }
    ts__free(TS_MEM_OTHER, j);
    return ok;
}
#endif

/* ------------------------------------------------------------ dispatch */

void ts__gemm_half_meta(ts_dtype dt, int64_t m, int64_t n, int64_t k, float beta, int64_t csc)
{
    /* the blocks ts__gemm_half(dt, m, n, k, ...) takes from the pool, in
     * its order (gemm_avx512bf16 or gemm_sgemm), held together then freed */
    if (ts__use_reference_kernels || m <= 0 || n <= 0 || k <= 0) return;
    bool row = beta != 0.0f && csc == 1;
#if TS__HAVE_AVX512BF16_KERNEL
    if (dt == TS_BF16 && ts__hgemm_active() == TS__HGEMM_AVX512BF16 &&
        ts__hgemm_kernel_runnable(TS__HGEMM_AVX512BF16, this_cpu())) {
        size_t b[1 + 3 * MAX_THREADS];
        int nb = 0, nt = bf16_threads(m, n, k);
        int64_t kp = (k + 1) / 2, nbk = n < NC ? n : NC, npan = (nbk + NR - 1) / NR;
        b[nb++] = (size_t)(npan * kp * NR) * sizeof(uint32_t);
        for (int t = 0; t < nt; t++) {
            b[nb++] = (size_t)(MC * KC2) * sizeof(uint32_t);
            b[nb++] = (size_t)(MC * NC) * sizeof(float);
            if (row) b[nb++] = (size_t)NC * sizeof(float);
        }
        ts__meta_scratch(nb, b);
        return;
    }
#endif
    int64_t mc, nc;
    sgemm_blocks(m, n, k, &mc, &nc);
    size_t b[4] = {(size_t)(mc * k) * sizeof(float), (size_t)(nc * k) * sizeof(float),
                   (size_t)(mc * nc) * sizeof(float), (size_t)nc * sizeof(float)};
    ts__meta_scratch(row ? 4 : 3, b);
}

void ts__gemm_half_with(ts__hgemm_kernel kern, ts_dtype dt, int64_t m, int64_t n, int64_t k, const uint16_t *a,
                        int64_t rsa, int64_t csa, const uint16_t *b, int64_t rsb, int64_t csb, float beta, uint16_t *c,
                        int64_t rsc, int64_t csc)
{
    if (m <= 0 || n <= 0) return;
    if (k <= 0) {
        scale_c(dt, m, n, beta, c, rsc, csc);
        return;
    }
    bool done = false;
#if TS__HAVE_AVX512BF16_KERNEL
    if (kern == TS__HGEMM_AVX512BF16 && dt == TS_BF16) {
        if (ts__hgemm_kernel_runnable(kern, this_cpu()))
            done = gemm_avx512bf16(m, n, k, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc);
        else done = gemm_sgemm(dt, m, n, k, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc);
    }
#endif
    if (!done) done = gemm_sgemm(dt, m, n, k, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc);
    if (!done) /* no scratch memory: the reference needs none */
        ts__gemm_ref_half(dt, m, n, k, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc);
}

void ts__gemm_half(ts_dtype dt, int64_t m, int64_t n, int64_t k, const void *a, int64_t rsa, int64_t csa, const void *b,
                   int64_t rsb, int64_t csb, float beta, void *c, int64_t rsc, int64_t csc)
{
    if (ts__use_reference_kernels) {
        if (m > 0 && n > 0) ts__gemm_ref_half(dt, m, n, k, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc);
        return;
    }
    ts__gemm_half_with(dt == TS_BF16 ? ts__hgemm_active() : TS__HGEMM_SGEMM, dt, m, n, k, a, rsa, csa, b, rsb, csb,
                       beta, c, rsc, csc);
}
