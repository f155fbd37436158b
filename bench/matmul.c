/*
 * bench_matmul: GFLOP/s of the library's ts_matmul, beside raw bli_sgemm on
 * the same buffers and beside this CPU's FP32 FMA peak measured here, in
 * the same run, at 1 and 2 threads. Shapes: a Linear layer's forward
 * x (M, K) @ W^T with W (N, K), its two backward products dX = dY @ W and
 * dW = dY^T @ X (M = 8192, K = 768, N = 3072), and square 512, 1024, 2048.
 *
 * bfloat16: the same products with every operand in bfloat16 (ts_matmul
 * on bf16 tensors: float32 accumulation, one rounding), beside the float32
 * figure (ratio bf16/f32) and beside PyTorch 1.13's bfloat16 torch.matmul
 * on the same shapes, measured by tools/bench/torch_matmul.py (Debian's
 * /usr/bin/python3) in the same run, once per thread count before the
 * products. The input values are bfloat16 numbers in both dtypes, so the
 * bf16 result is checked against the float32 one (within the bf16
 * rounding of the result). TS_BF16_GEMM_KERNEL=sgemm measures the
 * fallback that CPUs without AVX512_BF16 run.
 *
 * Each figure is the median of several timed repetitions after a warm-up.
 * The library's and raw BLIS's repetitions alternate (and which of the two
 * goes first alternates too), so that drift in clock speed or in other
 * load on the machine hits both alike; the peak is measured right before
 * and right after each shape (the median of six runs of about 50 ms). The
 * peak kernel is the widest FMA the CPU has (AVX-512, else AVX2+FMA, else
 * SSE multiply and add) with 16 (12 for ymm) independent accumulators, run
 * on every thread at once.
 *
 * Usage: bench_matmul [--quick] [--reps N] [--threads LIST] [--best] [--no-torch]
 *   --quick         fewer repetitions (about 2x shorter)
 *   --reps N        timed repetitions per shape (default 7, 3 with --quick)
 *   --threads LIST  comma-separated thread counts (default 1,2)
 *   --best          report the fastest repetition instead of the median
 *                   (what the hardware can do when other load comes and
 *                   goes; the targets are about medians)
 *   --no-torch      skip PyTorch's bfloat16 figures
 * Exit status 1 if the library's result differs from raw BLIS's.
 */
#define _GNU_SOURCE
#include "tensorshard.h"

#include <blis.h>
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static bool use_best = false;

/* Median of n times, or the smallest with --best. */
static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    if (use_best) return v[0];
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* ----------------------------------------------------------- FMA peak */

/* Each kernel runs `iters` iterations of independent FMAs acc = acc * x + y
 * on distinct accumulators (x < 1, so nothing overflows or goes
 * subnormal) and returns a sum of them so nothing is optimised away. */

#define PEAK_ACC_ZMM 16
#define PEAK_ACC_YMM 12
#define PEAK_ACC_XMM 12

__attribute__((target("avx512f"))) static float peak_zmm(long iters)
{
    __m512 x = _mm512_set1_ps(0.999999f), y = _mm512_set1_ps(1e-7f);
    __m512 a0 = _mm512_set1_ps(0.0f), a1 = _mm512_set1_ps(1.0f), a2 = _mm512_set1_ps(2.0f), a3 = _mm512_set1_ps(3.0f),
           a4 = _mm512_set1_ps(4.0f), a5 = _mm512_set1_ps(5.0f), a6 = _mm512_set1_ps(6.0f), a7 = _mm512_set1_ps(7.0f),
           a8 = _mm512_set1_ps(8.0f), a9 = _mm512_set1_ps(9.0f), a10 = _mm512_set1_ps(10.0f),
           a11 = _mm512_set1_ps(11.0f), a12 = _mm512_set1_ps(12.0f), a13 = _mm512_set1_ps(13.0f),
           a14 = _mm512_set1_ps(14.0f), a15 = _mm512_set1_ps(15.0f);
    for (long i = 0; i < iters; i++) {
        a0 = _mm512_fmadd_ps(a0, x, y);
        a1 = _mm512_fmadd_ps(a1, x, y);
        a2 = _mm512_fmadd_ps(a2, x, y);
        a3 = _mm512_fmadd_ps(a3, x, y);
        a4 = _mm512_fmadd_ps(a4, x, y);
        a5 = _mm512_fmadd_ps(a5, x, y);
        a6 = _mm512_fmadd_ps(a6, x, y);
        a7 = _mm512_fmadd_ps(a7, x, y);
        a8 = _mm512_fmadd_ps(a8, x, y);
        a9 = _mm512_fmadd_ps(a9, x, y);
        a10 = _mm512_fmadd_ps(a10, x, y);
        a11 = _mm512_fmadd_ps(a11, x, y);
        a12 = _mm512_fmadd_ps(a12, x, y);
        a13 = _mm512_fmadd_ps(a13, x, y);
        a14 = _mm512_fmadd_ps(a14, x, y);
        a15 = _mm512_fmadd_ps(a15, x, y);
    }
    __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                             _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)));
    __m512 t = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11)),
                             _mm512_add_ps(_mm512_add_ps(a12, a13), _mm512_add_ps(a14, a15)));
    return _mm512_reduce_add_ps(_mm512_add_ps(s, t));
}

__attribute__((target("avx2,fma"))) static float peak_ymm(long iters)
{
    __m256 x = _mm256_set1_ps(0.999999f), y = _mm256_set1_ps(1e-7f);
    __m256 a0 = _mm256_set1_ps(0.0f), a1 = _mm256_set1_ps(1.0f), a2 = _mm256_set1_ps(2.0f), a3 = _mm256_set1_ps(3.0f),
           a4 = _mm256_set1_ps(4.0f), a5 = _mm256_set1_ps(5.0f), a6 = _mm256_set1_ps(6.0f), a7 = _mm256_set1_ps(7.0f),
           a8 = _mm256_set1_ps(8.0f), a9 = _mm256_set1_ps(9.0f), a10 = _mm256_set1_ps(10.0f),
           a11 = _mm256_set1_ps(11.0f);
    for (long i = 0; i < iters; i++) {
        a0 = _mm256_fmadd_ps(a0, x, y);
        a1 = _mm256_fmadd_ps(a1, x, y);
        a2 = _mm256_fmadd_ps(a2, x, y);
        a3 = _mm256_fmadd_ps(a3, x, y);
        a4 = _mm256_fmadd_ps(a4, x, y);
        a5 = _mm256_fmadd_ps(a5, x, y);
        a6 = _mm256_fmadd_ps(a6, x, y);
        a7 = _mm256_fmadd_ps(a7, x, y);
        a8 = _mm256_fmadd_ps(a8, x, y);
        a9 = _mm256_fmadd_ps(a9, x, y);
        a10 = _mm256_fmadd_ps(a10, x, y);
        a11 = _mm256_fmadd_ps(a11, x, y);
    }
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                             _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
    s = _mm256_add_ps(s, _mm256_add_ps(_mm256_add_ps(a8, a9), _mm256_add_ps(a10, a11)));
    float out[8];
    _mm256_storeu_ps(out, s);
    return out[0] + out[1] + out[2] + out[3] + out[4] + out[5] + out[6] + out[7];
}

/* SSE has no FMA: a multiply and an add per element (the same two flops). */
static float peak_xmm(long iters)
{
    __m128 x = _mm_set1_ps(0.999999f), y = _mm_set1_ps(1e-7f);
    __m128 a0 = _mm_set1_ps(0.0f), a1 = _mm_set1_ps(1.0f), a2 = _mm_set1_ps(2.0f), a3 = _mm_set1_ps(3.0f),
           a4 = _mm_set1_ps(4.0f), a5 = _mm_set1_ps(5.0f), a6 = _mm_set1_ps(6.0f), a7 = _mm_set1_ps(7.0f),
           a8 = _mm_set1_ps(8.0f), a9 = _mm_set1_ps(9.0f), a10 = _mm_set1_ps(10.0f), a11 = _mm_set1_ps(11.0f);
    for (long i = 0; i < iters; i++) {
        a0 = _mm_add_ps(_mm_mul_ps(a0, x), y);
        a1 = _mm_add_ps(_mm_mul_ps(a1, x), y);
        a2 = _mm_add_ps(_mm_mul_ps(a2, x), y);
        a3 = _mm_add_ps(_mm_mul_ps(a3, x), y);
        a4 = _mm_add_ps(_mm_mul_ps(a4, x), y);
        a5 = _mm_add_ps(_mm_mul_ps(a5, x), y);
        a6 = _mm_add_ps(_mm_mul_ps(a6, x), y);
        a7 = _mm_add_ps(_mm_mul_ps(a7, x), y);
        a8 = _mm_add_ps(_mm_mul_ps(a8, x), y);
        a9 = _mm_add_ps(_mm_mul_ps(a9, x), y);
        a10 = _mm_add_ps(_mm_mul_ps(a10, x), y);
        a11 = _mm_add_ps(_mm_mul_ps(a11, x), y);
    }
    __m128 s = _mm_add_ps(_mm_add_ps(_mm_add_ps(a0, a1), _mm_add_ps(a2, a3)),
                          _mm_add_ps(_mm_add_ps(a4, a5), _mm_add_ps(a6, a7)));
    s = _mm_add_ps(s, _mm_add_ps(_mm_add_ps(a8, a9), _mm_add_ps(a10, a11)));
    float out[4];
    _mm_storeu_ps(out, s);
    return out[0] + out[1] + out[2] + out[3];
}

typedef struct peak_kind {
    const char *desc;
    float (*fn)(long iters);
    double flops_per_iter;
} peak_kind;

static peak_kind pick_peak_kernel(void)
{
    __builtin_cpu_init();
    /* __builtin_cpu_supports also checks that the OS saves the registers */
    if (__builtin_cpu_supports("avx512f"))
        return (peak_kind){"AVX-512F zmm _mm512_fmadd_ps, 16 accumulators", peak_zmm, 2.0 * 16 * PEAK_ACC_ZMM};
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return (peak_kind){"AVX2+FMA ymm _mm256_fmadd_ps, 12 accumulators", peak_ymm, 2.0 * 8 * PEAK_ACC_YMM};
    return (peak_kind){"SSE xmm _mm_mul_ps + _mm_add_ps (no FMA), 12 accumulators", peak_xmm, 2.0 * 4 * PEAK_ACC_XMM};
}

static volatile float peak_sink;

typedef struct peak_job {
    peak_kind kind;
    long iters;
    pthread_barrier_t *start;
    double seconds;
} peak_job;

static void *peak_thread(void *arg)
{
    peak_job *j = arg;
    pthread_barrier_wait(j->start);
    double t0 = now_s();
    float v = j->kind.fn(j->iters);
    j->seconds = now_s() - t0;
    peak_sink = v;
    return NULL;
}

/* GFLOP/s of `threads` copies of the kernel running at once (total flops
 * over the slowest thread's time). */
static double peak_once(peak_kind k, long iters, int threads)
{
    pthread_t tid[64];
    peak_job jobs[64];
    pthread_barrier_t start;
    if (threads > 64) threads = 64;
    pthread_barrier_init(&start, NULL, (unsigned)threads);
    for (int i = 0; i < threads; i++) {
        jobs[i] = (peak_job){k, iters, &start, 0.0};
        if (i > 0) pthread_create(&tid[i], NULL, peak_thread, &jobs[i]);
    }
    peak_thread(&jobs[0]);
    double worst = jobs[0].seconds;
    for (int i = 1; i < threads; i++) {
        pthread_join(tid[i], NULL);
        if (jobs[i].seconds > worst) worst = jobs[i].seconds;
    }
    pthread_barrier_destroy(&start);
    return k.flops_per_iter * (double)iters * threads / worst * 1e-9;
}

/* Iterations of the peak kernel that take about `seconds` on one thread. */
static long peak_calibrate(peak_kind k, double seconds)
{
    long iters = 1 << 20;
    double g = peak_once(k, iters, 1);
    g = fmax(g, peak_once(k, iters, 1));
    iters = (long)(seconds * g * 1e9 / k.flops_per_iter);
    return iters < 1000 ? 1000 : iters;
}

/* ------------------------------------------------------------- shapes */

typedef enum op_kind { OP_FWD, OP_DX, OP_DW, OP_SQUARE } op_kind;

typedef struct shape {
    const char *name;
    op_kind op;
    int64_t M, K, N; /* Linear sizes; for squares M = K = N */
    bool large;
} shape;

static const shape shapes[] = {
    {"linear fwd  x @ W^T", OP_FWD, 8192, 768, 3072, true},
    {"linear bwd dX = dY @ W", OP_DX, 8192, 768, 3072, true},
    {"linear bwd dW = dY^T @ X", OP_DW, 8192, 768, 3072, true},
    {"square 512", OP_SQUARE, 512, 512, 512, false},
    {"square 1024", OP_SQUARE, 1024, 1024, 1024, false},
    {"square 2048", OP_SQUARE, 2048, 2048, 2048, true},
};
#define N_SHAPES (int)(sizeof shapes / sizeof shapes[0])

static void check(ts_status s, const char *what)
{
    if (s != TS_OK) {
        fprintf(stderr, "bench_matmul: %s failed: %s: %s\n", what, ts_status_name(s), ts_last_error());
        exit(2);
    }
}

static ts_tensor *filled(int64_t rows, int64_t cols, uint32_t seed)
{
    int64_t dims[2] = {rows, cols};
    ts_tensor *t;
    check(ts_tensor_empty(TS_F32, 2, dims, &t), "ts_tensor_empty");
    float *p = ts_tensor_data(t);
    uint32_t s = seed * 2654435761u + 1;
    for (int64_t i = 0; i < rows * cols; i++) {
        s = s * 1664525u + 1013904223u;
        /* bfloat16 numbers, so the f32 and bf16 products take equal inputs */
        p[i] = ts_bf16_to_f32(ts_f32_to_bf16((float)((s >> 8) & 0xFFFF) / 65536.0f - 0.5f));
    }
    return t;
}

/* The same values in bfloat16 (exact). */
static ts_tensor *to_bf16(ts_tensor *f)
{
    int64_t n = ts_tensor_numel(f);
    uint16_t *h = malloc((size_t)n * sizeof *h);
    const float *p = ts_tensor_data(f);
    for (int64_t i = 0; i < n; i++) h[i] = ts_f32_to_bf16(p[i]);
    ts_tensor *t;
    check(ts_tensor_from_data(TS_BF16, ts_tensor_ndim(f), ts_tensor_shape(f), h, &t), "ts_tensor_from_data");
    free(h);
    return t;
}

/* One product, set up for both the library and raw BLIS on the same
 * buffers: C (m, n) = A (m, k) B (k, n) with A and B given as tensors
 * (views included) and as raw pointers with strides. */
typedef struct problem {
    ts_tensor *a, *b;   /* operands as ts_matmul gets them (may be views) */
    ts_tensor *ha, *hb; /* the same in bfloat16 */
    ts_tensor *c_blis;  /* raw BLIS output, (m, n) contiguous */
    int64_t m, n, k;
    float *pa, *pb;
    int64_t rsa, csa, rsb, csb;
} problem;

static problem setup(const shape *sh, ts_tensor *X, ts_tensor *W, ts_tensor *dY, ts_tensor *S1, ts_tensor *S2,
                     ts_tensor *hX, ts_tensor *hW, ts_tensor *hdY, ts_tensor *hS1, ts_tensor *hS2)
{
    problem p;
    memset(&p, 0, sizeof p);
    int64_t M = sh->M, K = sh->K, N = sh->N;
    switch (sh->op) {
    case OP_FWD: /* x (M, K) @ W^T, W (N, K): W^T is W's strides swapped */
        p.a = ts_tensor_retain(X);
        check(ts_transpose(W, 0, 1, &p.b), "ts_transpose");
        p.ha = ts_tensor_retain(hX);
        check(ts_transpose(hW, 0, 1, &p.hb), "ts_transpose");
        p.m = M, p.n = N, p.k = K;
        break;
    case OP_DX: /* dY (M, N) @ W (N, K) */
        p.a = ts_tensor_retain(dY);
        p.b = ts_tensor_retain(W);
        p.ha = ts_tensor_retain(hdY);
        p.hb = ts_tensor_retain(hW);
        p.m = M, p.n = K, p.k = N;
        break;
    case OP_DW: /* dY^T (N, M) @ X (M, K) */
        check(ts_transpose(dY, 0, 1, &p.a), "ts_transpose");
        p.b = ts_tensor_retain(X);
        check(ts_transpose(hdY, 0, 1, &p.ha), "ts_transpose");
        p.hb = ts_tensor_retain(hX);
        p.m = N, p.n = K, p.k = M;
        break;
    case OP_SQUARE:
        p.a = ts_tensor_retain(S1);
        p.b = ts_tensor_retain(S2);
        p.ha = ts_tensor_retain(hS1);
        p.hb = ts_tensor_retain(hS2);
        p.m = p.n = p.k = M;
        break;
    }
    p.pa = ts_tensor_data(p.a);
    p.pb = ts_tensor_data(p.b);
    p.rsa = ts_tensor_strides(p.a)[0], p.csa = ts_tensor_strides(p.a)[1];
    p.rsb = ts_tensor_strides(p.b)[0], p.csb = ts_tensor_strides(p.b)[1];
    int64_t cshape[2] = {p.m, p.n};
    check(ts_tensor_zeros(TS_F32, 2, cshape, &p.c_blis), "ts_tensor_zeros");
    return p;
}

static double run_lib(const problem *p, bool half, ts_tensor **keep)
{
    ts_tensor *out;
    double t0 = now_s();
    check(ts_matmul(half ? p->ha : p->a, half ? p->hb : p->b, &out), "ts_matmul");
    double t = now_s() - t0;
    if (keep) {
        ts_tensor_free(*keep);
        *keep = out;
    } else {
        ts_tensor_free(out);
    }
    return t;
}

static double run_blis(const problem *p)
{
    float one = 1.0f, zero = 0.0f;
    double t0 = now_s();
    bli_sgemm(BLIS_NO_TRANSPOSE, BLIS_NO_TRANSPOSE, p->m, p->n, p->k, &one, p->pa, p->rsa, p->csa, p->pb, p->rsb,
              p->csb, &zero, ts_tensor_data(p->c_blis), p->n, 1);
    return now_s() - t0;
}

/* Largest |lib - blis| relative to the largest |blis|. */
static double rel_diff(ts_tensor *lib, ts_tensor *blis, int64_t m, int64_t n)
{
    const int64_t *sh = ts_tensor_shape(lib);
    if (ts_tensor_ndim(lib) != 2 || sh[0] != m || sh[1] != n) return INFINITY;
    ts_tensor *cl;
    check(ts_contiguous(lib, &cl), "ts_contiguous");
    const float *x = ts_tensor_data(cl), *y = ts_tensor_data(blis);
    const uint16_t *xh = ts_tensor_data(cl);
    bool half = ts_tensor_dtype(cl) == TS_BF16;
    double md = 0.0, mx = 0.0;
    for (int64_t i = 0; i < m * n; i++) {
        double d = fabs((half ? (double)ts_bf16_to_f32(xh[i]) : (double)x[i]) - (double)y[i]);
        if (!(d <= md)) md = d;
        if (fabs((double)y[i]) > mx) mx = fabs((double)y[i]);
    }
    ts_tensor_free(cl);
    return mx > 0 ? md / mx : md;
}

/* The 1-minute load average, or -1 if unknown: other work on the cores
 * lowers every figure, most of all with 2 threads on a 2-core machine. */
static double load_average(void)
{
    double l = -1.0;
    FILE *f = fopen("/proc/loadavg", "r");
    if (f) {
        if (fscanf(f, "%lf", &l) != 1) l = -1.0;
        fclose(f);
    }
    return l;
}

static void usage(void)
{
    fprintf(stderr, "usage: bench_matmul [--quick] [--reps N] [--threads LIST] [--best] [--no-torch]\n");
    exit(2);
}

/* PyTorch's bfloat16 GFLOP/s per shape (index into shapes[]), or -1 each
 * when python3 with torch is absent; returns false then. */
static bool torch_bf16(int threads, int reps, double *gflops)
{
    for (int s = 0; s < N_SHAPES; s++) gflops[s] = -1;
    if (access("/usr/bin/python3", X_OK) != 0 || system("/usr/bin/python3 -c 'import torch' 2>/dev/null") != 0)
        return false;
    static const char *const tags[N_SHAPES] = {"fwd", "dx", "dw", "sq512", "sq1024", "sq2048"};
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "env BLIS_ARCH_TYPE=%s MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 "
             "OMP_NUM_THREADS=%d BLIS_NUM_THREADS=%d /usr/bin/python3 %s/tools/bench/torch_matmul.py %d %d bf16",
             strcmp(ts_blis_arch_name(), "skx") == 0 ? "0" : "\"$BLIS_ARCH_TYPE\"", threads, threads, TS_SOURCE_DIR,
             threads, reps);
    FILE *f = popen(cmd, "r");
    if (!f) return false;
    char line[256], tag[32], dt[16];
    double g;
    bool any = false;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "torch %31s %15s %lf", tag, dt, &g) == 3 && strcmp(dt, "bf16") == 0)
            for (int s = 0; s < N_SHAPES; s++)
                if (strcmp(tag, tags[s]) == 0) {
                    gflops[s] = g;
                    any = true;
                }
    pclose(f);
    return any;
}

int main(int argc, char **argv)
{
    bool quick = false, use_torch = true;
    int reps = 0;
    int threads[16] = {1, 2};
    int n_threads = 2;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--quick") == 0) {
            quick = true;
        } else if (strcmp(argv[i], "--no-torch") == 0) {
            use_torch = false;
        } else if (strcmp(argv[i], "--best") == 0) {
            use_best = true;
        } else if (strcmp(argv[i], "--reps") == 0 && i + 1 < argc) {
            reps = atoi(argv[++i]);
            if (reps < 1 || reps > 101) usage();
        } else if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc) {
            n_threads = 0;
            for (char *tok = strtok(argv[++i], ","); tok && n_threads < 16; tok = strtok(NULL, ",")) {
                threads[n_threads] = atoi(tok);
                if (threads[n_threads] < 1 || threads[n_threads] > 64) usage();
                n_threads++;
            }
            if (n_threads == 0) usage();
        } else {
            usage();
        }
    }

    const char *user_arch = getenv("BLIS_ARCH_TYPE");
    char user_arch_copy[64];
    snprintf(user_arch_copy, sizeof user_arch_copy, "%s", user_arch ? user_arch : "");
    const char *arch = ts_blis_arch_name(); /* the library's BLIS set-up, before any BLIS use */
    ts_grad_mode_set(false);

    peak_kind pk = pick_peak_kernel();
    printf("tensorshard bench_matmul: float32, BLIS %s (%s), kernels '%s' (%s%s)\n", bli_info_get_version_str(),
           bli_info_get_enable_openmp()         ? "OpenMP"
               : bli_info_get_enable_pthreads() ? "pthreads"
                                                : "serial",
           arch, user_arch ? "BLIS_ARCH_TYPE was set to " : "chosen by the library from cpuid",
           user_arch ? user_arch_copy : "");
    printf("FMA peak kernel: %s\n", pk.desc);
    printf("bfloat16 kernel: '%s' (TS_BF16_GEMM_KERNEL=%s)\n", ts_bf16_gemm_kernel_name(),
           getenv("TS_BF16_GEMM_KERNEL") ? getenv("TS_BF16_GEMM_KERNEL") : "unset, auto");

    int64_t M = shapes[0].M, K = shapes[0].K, N = shapes[0].N;
    ts_tensor *X = filled(M, K, 1), *W = filled(N, K, 2), *dY = filled(M, N, 3);
    ts_tensor *hX = to_bf16(X), *hW = to_bf16(W), *hdY = to_bf16(dY);
    ts_tensor *sq[2][3], *hsq[2][3];
    for (int s = 0; s < 3; s++) {
        int64_t n = 512 << s;
        sq[0][s] = filled(n, n, (uint32_t)(10 + s));
        sq[1][s] = filled(n, n, (uint32_t)(20 + s));
        hsq[0][s] = to_bf16(sq[0][s]);
        hsq[1][s] = to_bf16(sq[1][s]);
    }

    int status = 0;
    double t_start = now_s();
    double load0 = load_average();
    printf("load average at start %.2f%s\n", load0,
           load0 > 0.5 ? " (other processes are running: figures, above all at 2 threads, will be low)" : "");
    printf("\n%-3s %-26s %6s %6s %6s %9s %9s %9s %8s %8s %9s %8s %9s %8s %s\n", "thr", "product", "m", "n", "k",
           "lib f32", "blis", "peak", "lib/", "lib/", "lib bf16", "bf16/", "torch", "bf16/", "check");
    printf("%-3s %-26s %6s %6s %6s %9s %9s %9s %8s %8s %9s %8s %9s %8s\n", "", "", "", "", "", "GFLOP/s", "GFLOP/s",
           "GFLOP/s", "blis", "peak", "GFLOP/s", "f32", "bf16", "torch");
    for (int ti = 0; ti < n_threads; ti++) {
        int nt = threads[ti];
        double torch_g[N_SHAPES];
        bool have_torch = use_torch && torch_bf16(nt, reps ? reps : quick ? 3 : 7, torch_g);
        if (!use_torch)
            for (int s = 0; s < N_SHAPES; s++) torch_g[s] = -1;
        else if (!have_torch)
            printf("(%d thread%s: no /usr/bin/python3 with torch here, or it failed: no torch figures)\n", nt,
                   nt == 1 ? "" : "s");
        ts_set_num_threads(nt);
        long peak_iters = peak_calibrate(pk, 0.05);
        for (int s = 0; s < N_SHAPES; s++) {
            const shape *sh = &shapes[s];
            int si = sh->op == OP_SQUARE ? (sh->M == 512 ? 0 : sh->M == 1024 ? 1 : 2) : 0;
            problem p = setup(sh, X, W, dY, sq[0][si], sq[1][si], hX, hW, hdY, hsq[0][si], hsq[1][si]);
            int r = reps ? reps : quick ? 3 : 7;
            int warm = sh->large ? 2 : 5;
            /* the peak just before and just after the products (as
             * times, so that median() fits); not between them: the first
             * product after 50 ms of the peak kernel runs measurably slower */
            double tp[6];
            for (int i = 0; i < 3; i++) tp[i] = 1.0 / peak_once(pk, peak_iters, nt);
            /* warm-up: BLIS's packing buffers, and the library's output
             * block, which goes back to the caching pool after each run
             * and is reused by the next (no fresh pages in timed runs) */
            for (int w = 0; w < warm; w++) {
                run_lib(&p, false, NULL);
                run_blis(&p);
                run_lib(&p, true, NULL);
            }
            ts_tensor *lib_out = NULL, *half_out = NULL;
            double tl[101], tb[101], th[101];
            for (int i = 0; i < r; i++) {
                /* which goes first alternates: the first of a pair ran
                 * a few per cent slower on the small squares here */
                if (i % 2) tb[i] = run_blis(&p);
                tl[i] = run_lib(&p, false, i == r - 1 ? &lib_out : NULL);
                th[i] = run_lib(&p, true, i == r - 1 ? &half_out : NULL);
                if (i % 2 == 0) tb[i] = run_blis(&p);
            }
            for (int i = 3; i < 6; i++) tp[i] = 1.0 / peak_once(pk, peak_iters, nt);
            double flops = 2.0 * (double)p.m * (double)p.n * (double)p.k;
            double gl = flops / median(tl, r) * 1e-9, gb = flops / median(tb, r) * 1e-9,
                   gh = flops / median(th, r) * 1e-9;
            double peak = 1.0 / median(tp, 6);
            double d = rel_diff(lib_out, p.c_blis, p.m, p.n);
            /* the same BLIS call on the same data: equal up to how BLIS
             * splits the work (f32 rounding of a length-k sum) */
            bool ok = d <= 1e-4;
            /* bf16: the same inputs; the result rounded to bf16 (2^-9
             * relative) plus the f32 reordering, relative to max |C| */
            double dh = rel_diff(half_out, p.c_blis, p.m, p.n);
            bool ok_h = dh <= 1.0 / 256;
            if (!ok || !ok_h) status = 1;
            char tcol[16], tratio[16];
            snprintf(tcol, sizeof tcol, torch_g[s] > 0 ? "%.1f" : "-", torch_g[s]);
            snprintf(tratio, sizeof tratio, torch_g[s] > 0 ? "%.3f" : "-", gh / torch_g[s]);
            printf("%-3d %-26s %6ld %6ld %6ld %9.1f %9.1f %9.1f %8.3f %8.3f %9.1f %8.3f %9s %8s %s\n", nt, sh->name,
                   (long)p.m, (long)p.n, (long)p.k, gl, gb, peak, gl / gb, gl / peak, gh, gh / gl, tcol, tratio,
                   ok && ok_h ? "ok"
                       : !ok  ? "DIFFERS"
                              : "BF16 DIFFERS");
            fflush(stdout);
            ts_tensor_free(lib_out);
            ts_tensor_free(half_out);
            ts_tensor_free(p.ha);
            ts_tensor_free(p.hb);
            ts_tensor_free(p.a);
            ts_tensor_free(p.b);
            ts_tensor_free(p.c_blis);
        }
    }
    printf("\ntargets at 1 thread: lib/blis >= 0.95 on every product, lib/peak >= 0.70 on the Linear shapes "
           "and square 2048;\nbf16/f32 >= 1.8 on AVX512-BF16 CPUs, >= 0.85 on AVX2-only ones (the sgemm kernel)\n"
           "(%s; %.0f s; load average at end %.2f)\n",
           use_best ? "fastest repetitions" : "medians", now_s() - t_start, load_average());
    for (int s = 0; s < 3; s++) {
        ts_tensor_free(sq[0][s]);
        ts_tensor_free(sq[1][s]);
        ts_tensor_free(hsq[0][s]);
        ts_tensor_free(hsq[1][s]);
    }
    ts_tensor_free(hX);
    ts_tensor_free(hW);
    ts_tensor_free(hdY);
    ts_tensor_free(X);
    ts_tensor_free(W);
    ts_tensor_free(dY);
    return status;
}
