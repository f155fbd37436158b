/* tensor_rng: the generator and the random fills against torch 1.13's
 * bits (tests/fixtures/rng, made by tools/reference/make_rng_vectors.py;
 * PROVENANCE.md there lists the exact torch calls). Every comparison is
 * bit for bit: the algorithms are specified to be exact
 * (docs/rng.md), so no tolerance applies. */
#include <math.h>

#include <criterion/criterion.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/helpers.h"

/* ------------------------------------------------------------- helpers */

static int64_t sh1[1];

/* A new 1-d tensor from rand/randn with the default generator. */
static ts_tensor *rand1(ts_dtype dt, int64_t n)
{
    ts_tensor *t;
    sh1[0] = n;
    TH_OK(ts_rand(dt, 1, sh1, NULL, &t));
    return t;
}

static ts_tensor *randn1(ts_dtype dt, int64_t n)
{
    ts_tensor *t;
    sh1[0] = n;
    TH_OK(ts_randn(dt, 1, sh1, NULL, &t));
    return t;
}

static const int64_t sizes[] = {1, 15, 16, 17, 31, 33, 100, 1000};
#define N_SIZES ((int)(sizeof sizes / sizeof sizes[0]))

/* ----------------------------------------------------------- generator */

Test(tensor_rng, mt19937_known_outputs)
{
    /* docs/rng.md §1.2/§1.3: std::mt19937's sequence */
    static const uint32_t s0[] = {2357136044u, 2546248239u, 3071714933u, 3626093760u, 2588848963u};
    static const uint32_t s42[] = {1608637542u, 3421126067u, 4083286876u, 787846414u, 3143890026u};
    ts_manual_seed(0);
    for (int i = 0; i < 5; i++) cr_assert_eq(ts_generator_random(NULL), s0[i], "seed 0 draw %d", i);
    ts_manual_seed(42);
    for (int i = 0; i < 5; i++) cr_assert_eq(ts_generator_random(ts_default_generator()), s42[i], "seed 42 draw %d", i);
    ts_manual_seed(5489);
    cr_assert_eq(ts_generator_random(NULL), 3499211612u);
    cr_assert_eq(ts_generator_random(NULL), 581869302u);
    /* random64: high half first */
    ts_manual_seed(0);
    uint64_t hi = ts_generator_random(NULL), lo = ts_generator_random(NULL);
    cr_assert_eq((hi << 32) | lo, UINT64_C(10123822223749065263));
}

Test(tensor_rng, only_low_32_seed_bits_reach_the_engine)
{
    ts_generator *a, *b;
    TH_OK(ts_generator_new(7, &a));
    TH_OK(ts_generator_new((UINT64_C(1) << 32) + 7, &b));
    for (int i = 0; i < 2000; i++) cr_assert_eq(ts_generator_random(a), ts_generator_random(b), "draw %d", i);
    ts_generator_free(a);
    ts_generator_free(b);
}

Test(tensor_rng, generators_are_independent_of_the_default)
{
    ts_generator *g;
    TH_OK(ts_generator_new(0, &g));
    ts_manual_seed(0);
    int64_t n = 37;
    ts_tensor *a, *b;
    TH_OK(ts_randn(TS_F32, 1, &n, g, &a));
    (void)ts_generator_random(NULL); /* disturbs the default only */
    ts_generator_manual_seed(g, 0);
    TH_OK(ts_randn(TS_F32, 1, &n, g, &b));
    cr_assert_eq(memcmp(ts_tensor_data(a), ts_tensor_data(b), 37 * sizeof(float)), 0);
    /* and the default generator with the same seed gives the same */
    ts_manual_seed(0);
    ts_tensor *c;
    TH_OK(ts_randn(TS_F32, 1, &n, NULL, &c));
    cr_assert_eq(memcmp(ts_tensor_data(a), ts_tensor_data(c), 37 * sizeof(float)), 0);
    ts_tensor_free(a);
    ts_tensor_free(b);
    ts_tensor_free(c);
    ts_generator_free(g);
    ts_generator_free(NULL);
    ts_generator_free(ts_default_generator()); /* ignored: static */
    (void)ts_generator_random(NULL);
}

/* -------------------------------------------------- the shared vectors */

Test(tensor_rng, shared_rand_randn_randint_randperm)
{
    th_vec v = th_vec_open("rand_8_seed0");
    ts_manual_seed(0);
    th_vec_expect_free(&v, rand1(TS_F32, 8), "rand(8)");
    th_vec_close(&v);

    v = th_vec_open("randn_17_seed0");
    ts_manual_seed(0);
    th_vec_expect_free(&v, randn1(TS_F32, 17), "randn(17)");
    th_vec_close(&v);

    ts_tensor *t;
    v = th_vec_open("randn_2x3_seed42");
    ts_manual_seed(42);
    TH_OK(ts_randn(TS_F32, 2, (int64_t[]){2, 3}, NULL, &t));
    th_vec_expect_free(&v, t, "randn(2, 3)");
    th_vec_close(&v);

    v = th_vec_open("randn_4x8_seed42");
    ts_manual_seed(42);
    TH_OK(ts_randn(TS_F32, 2, (int64_t[]){4, 8}, NULL, &t));
    th_vec_expect_free(&v, t, "randn(4, 8)");
    th_vec_close(&v);

    v = th_vec_open("randint_0_10_12_seed0");
    ts_manual_seed(0);
    TH_OK(ts_randint(0, 10, 1, (int64_t[]){12}, NULL, &t));
    th_vec_expect_free(&v, t, "randint(0, 10, (12,))");
    th_vec_close(&v);

    v = th_vec_open("randperm_10_seed0");
    ts_manual_seed(0);
    TH_OK(ts_randperm(10, NULL, &t));
    th_vec_expect_free(&v, t, "randperm(10)");
    th_vec_close(&v);

    /* nn.Embedding(10, 3): normal_(0, 1) over 30 elements */
    v = th_vec_open("embedding10x3_seed0_weight");
    ts_manual_seed(0);
    t = th_empty(TS_F32, 2, (int64_t[]){10, 3});
    TH_OK(ts_normal_(t, 0.0, 1.0, NULL));
    th_vec_expect_free(&v, t, "Embedding(10, 3).weight");
    th_vec_close(&v);
}

/* ------------------------------------------------------ rand and randn */

Test(tensor_rng, rand_and_randn_at_every_size)
{
    static const char *names[] = {"rand_f32_sizes", "rand_f64_sizes", "randn_f32_sizes", "randn_f64_sizes"};
    for (int k = 0; k < 4; k++) {
        th_vec v = th_vec_open(names[k]);
        ts_dtype dt = (k & 1) ? TS_F64 : TS_F32;
        for (int i = 0; i < N_SIZES; i++) {
            char what[64];
            snprintf(what, sizeof what, "%s(%lld)", k < 2 ? "rand" : "randn", (long long)sizes[i]);
            ts_manual_seed(1000 + (uint64_t)sizes[i]);
            th_vec_expect_free(&v, k < 2 ? rand1(dt, sizes[i]) : randn1(dt, sizes[i]), what);
        }
        th_vec_close(&v);
    }
}

Test(tensor_rng, seeds_wrap_like_torch)
{
    /* torch.manual_seed(-1) is 2^64 - 1; -123456789 is its two's complement */
    static const uint64_t seeds[] = {0,
                                     1,
                                     42,
                                     2147483647u,
                                     4294967295u,
                                     (UINT64_C(1) << 32) + 7,
                                     (UINT64_C(1) << 63) - 1,
                                     UINT64_MAX,
                                     (uint64_t)INT64_C(-123456789),
                                     UINT64_MAX};
    th_vec v = th_vec_open("rand_seeds");
    for (int i = 0; i < 10; i++) {
        ts_manual_seed(seeds[i]);
        th_vec_expect_free(&v, rand1(TS_F32, 4), "rand(4)");
    }
    th_vec_close(&v);
}

/* ---------------------------------------------------- normal_, uniform_ */

Test(tensor_rng, normal_with_mean_and_std)
{
    static const double ms32[3][2] = {{0.25, 2.5}, {-3.0, 0.1}, {1000.0, 0.001}};
    static const int64_t n32[] = {5, 16, 37, 1000};
    th_vec v = th_vec_open("normal_f32_mean_std");
    for (int k = 0; k < 3; k++) {
        ts_manual_seed(100 + (uint64_t)k);
        for (int i = 0; i < 4; i++) {
            ts_tensor *t = th_empty(TS_F32, 1, &n32[i]);
            TH_OK(ts_normal_(t, ms32[k][0], ms32[k][1], NULL));
            th_vec_expect_free(&v, t, "normal_ f32");
        }
    }
    th_vec_close(&v);

    static const int64_t n64[] = {5, 16, 37, 200};
    v = th_vec_open("normal_f64_mean_std");
    for (int k = 0; k < 2; k++) {
        ts_manual_seed(200 + (uint64_t)k);
        for (int i = 0; i < 4; i++) {
            ts_tensor *t = th_empty(TS_F64, 1, &n64[i]);
            TH_OK(ts_normal_(t, ms32[k][0], ms32[k][1], NULL));
            th_vec_expect_free(&v, t, "normal_ f64");
        }
    }
    th_vec_close(&v);
}

Test(tensor_rng, uniform_with_bounds)
{
    static const double ab[5][2] = {{-2.5, 7.25}, {-0.125, 0.125}, {3.0, 3.0}, {-1e30, 1e30}, {0.1, 0.2}};
    static const char *names[] = {"uniform_f32_bounds", "uniform_f64_bounds"};
    for (int k = 0; k < 2; k++) {
        th_vec v = th_vec_open(names[k]);
        ts_manual_seed(3 + (uint64_t)k);
        for (int i = 0; i < 5; i++) {
            ts_tensor *t = th_empty(k ? TS_F64 : TS_F32, 1, (int64_t[]){37});
            TH_OK(ts_uniform_(t, ab[i][0], ab[i][1], NULL));
            th_vec_expect_free(&v, t, "uniform_");
        }
        th_vec_close(&v);
    }
}

Test(tensor_rng, scalar_normal_cache_carries_across_calls)
{
    /* randn(3) leaves a cached value that randn(5) picks up after the
     * vectorised randn(20); see docs/rng.md §5.4 */
    th_vec v = th_vec_open("normal_cache_seq");
    ts_manual_seed(0);
    th_vec_expect_free(&v, randn1(TS_F32, 3), "randn(3)");
    th_vec_expect_free(&v, randn1(TS_F32, 20), "randn(20)");
    th_vec_expect_free(&v, randn1(TS_F32, 5), "randn(5)");
    th_vec_expect_free(&v, rand1(TS_F32, 7), "rand(7)");
    th_vec_expect_free(&v, randn1(TS_F32, 1), "randn(1)");
    th_vec_expect_free(&v, randn1(TS_F64, 3), "randn(3, float64)");
    th_vec_expect_free(&v, randn1(TS_F32, 16), "randn(16)");
    th_vec_expect_free(&v, randn1(TS_F32, 2), "randn(2)");
    ts_tensor *t = th_empty(TS_F32, 1, (int64_t[]){3});
    TH_OK(ts_normal_(t, 2.0, 0.5, NULL));
    th_vec_expect_free(&v, t, "normal_(2.0, 0.5) on 3");
    th_vec_close(&v);
}

Test(tensor_rng, non_contiguous_fills_follow_memory_order)
{
    th_vec v = th_vec_open("noncontig_fills");
    ts_tensor *b, *t, *u;
    ts_manual_seed(0);

    b = th_empty(TS_F32, 2, (int64_t[]){8, 4}); /* (8, 4).t(): scalar normal path */
    TH_OK(ts_transpose(b, 0, 1, &t));
    TH_OK(ts_normal_(t, 0.0, 1.0, NULL));
    th_vec_expect_free(&v, t, "(8, 4).t().normal_()");
    ts_tensor_free(b);

    b = th_empty(TS_F32, 2, (int64_t[]){8, 4});
    TH_OK(ts_transpose(b, 0, 1, &t));
    TH_OK(ts_uniform_(t, -1.0, 1.0, NULL));
    th_vec_expect_free(&v, t, "(8, 4).t().uniform_(-1, 1)");
    ts_tensor_free(b);

    b = th_empty(TS_F32, 2, (int64_t[]){6, 10}); /* [:, ::2] */
    TH_OK(ts_slice(b, 1, 0, 10, 2, &t));
    TH_OK(ts_uniform_(t, -1.0, 1.0, NULL));
    th_vec_expect_free(&v, t, "(6, 10)[:, ::2].uniform_(-1, 1)");
    ts_tensor_free(b);

    b = th_empty(TS_F32, 3, (int64_t[]){2, 3, 4});
    TH_OK(ts_permute(b, (int[]){2, 0, 1}, &t));
    TH_OK(ts_normal_(t, 0.5, 2.0, NULL));
    th_vec_expect_free(&v, t, "(2, 3, 4).permute(2, 0, 1).normal_(0.5, 2)");
    ts_tensor_free(b);

    b = th_empty(TS_F64, 2, (int64_t[]){4, 6});
    TH_OK(ts_transpose(b, 0, 1, &t));
    TH_OK(ts_normal_(t, 0.0, 1.0, NULL));
    th_vec_expect_free(&v, t, "(4, 6) f64 .t().normal_()");
    ts_tensor_free(b);

    b = th_empty(TS_F32, 2, (int64_t[]){5, 8}); /* [1:4, 2:7] */
    TH_OK(ts_narrow(b, 0, 1, 3, &u));
    TH_OK(ts_narrow(u, 1, 2, 5, &t));
    TH_OK(ts_normal_(t, 0.0, 1.0, NULL));
    th_vec_expect_free(&v, t, "(5, 8)[1:4, 2:7].normal_()");
    ts_tensor_free(u);
    ts_tensor_free(b);

    b = th_empty(TS_F32, 1, (int64_t[]){40}); /* [::2]: 20 elements, not contiguous */
    TH_OK(ts_slice(b, 0, 0, 40, 2, &t));
    TH_OK(ts_normal_(t, 0.0, 1.0, NULL));
    th_vec_expect_free(&v, t, "(40,)[::2].normal_()");
    ts_tensor_free(b);

    b = th_empty(TS_F32, 2, (int64_t[]){8, 4});
    TH_OK(ts_transpose(b, 0, 1, &t));
    TH_OK(ts_bernoulli_(t, 0.3, NULL));
    th_vec_expect_free(&v, t, "(8, 4).t().bernoulli_(0.3)");
    ts_tensor_free(b);
    th_vec_close(&v);
}

Test(tensor_rng, size_one_dims_do_not_change_the_path)
{
    /* (16, 1) with an odd stride on the size-1 dim is still contiguous
     * for torch: the vectorised path, like randn(16) */
    ts_manual_seed(11);
    ts_tensor *a = randn1(TS_F32, 16);
    ts_tensor *b = th_empty(TS_F32, 2, (int64_t[]){1, 16}), *t;
    TH_OK(ts_transpose(b, 0, 1, &t)); /* (16, 1) strides (1, 16) */
    ts_manual_seed(11);
    TH_OK(ts_normal_(t, 0.0, 1.0, NULL));
    cr_assert_eq(memcmp(ts_tensor_data(a), ts_tensor_data(t), 16 * sizeof(float)), 0);
    ts_tensor_free(a);
    ts_tensor_free(t);
    ts_tensor_free(b);
}

/* ------------------------------------------------------------ integers */

Test(tensor_rng, randint_small_and_wide_ranges)
{
    th_vec v = th_vec_open("randint_ranges");
    ts_tensor *t;
    ts_manual_seed(5);
    TH_OK(ts_randint(-5, 5, 1, (int64_t[]){20}, NULL, &t));
    th_vec_expect_free(&v, t, "randint(-5, 5)");
    TH_OK(ts_randint(0, INT64_C(1) << 32, 1, (int64_t[]){10}, NULL, &t));
    th_vec_expect_free(&v, t, "randint(0, 2^32)");
    TH_OK(ts_randint(0, (INT64_C(1) << 32) - 1, 1, (int64_t[]){10}, NULL, &t));
    th_vec_expect_free(&v, t, "randint(0, 2^32 - 1)");
    TH_OK(ts_randint(-(INT64_C(1) << 40), INT64_C(1) << 40, 1, (int64_t[]){10}, NULL, &t));
    th_vec_expect_free(&v, t, "randint(-2^40, 2^40)");
    TH_OK(ts_randint(INT64_MIN, INT64_MAX, 1, (int64_t[]){8}, NULL, &t));
    th_vec_expect_free(&v, t, "randint(-2^63, 2^63 - 1)");
    TH_OK(ts_randint(7, 8, 1, (int64_t[]){3}, NULL, &t));
    th_vec_expect_free(&v, t, "randint(7, 8)");
    th_vec_expect_free(&v, rand1(TS_F32, 2), "rand(2) after");
    th_vec_close(&v);
}

Test(tensor_rng, randperm_draws_n_minus_one)
{
    th_vec v = th_vec_open("randperm_100");
    ts_tensor *t;
    ts_manual_seed(0);
    TH_OK(ts_randperm(100, NULL, &t));
    th_vec_expect_free(&v, t, "randperm(100)");
    TH_OK(ts_randperm(1, NULL, &t));
    th_vec_expect_free(&v, t, "randperm(1)");
    TH_OK(ts_randperm(2, NULL, &t));
    th_vec_expect_free(&v, t, "randperm(2)");
    th_vec_expect_free(&v, rand1(TS_F32, 3), "rand(3) after");
    th_vec_close(&v);

    TH_OK(ts_randperm(0, NULL, &t));
    cr_assert_eq(ts_tensor_numel(t), 0);
    cr_assert_eq(ts_tensor_dtype(t), TS_I64);
    ts_tensor_free(t);
}

/* ------------------------------------------------- bernoulli_, dropout */

Test(tensor_rng, bernoulli_two_draws_per_element)
{
    th_vec v = th_vec_open("bernoulli_p");
    ts_manual_seed(0);
    ts_tensor *t = th_empty(TS_F32, 1, (int64_t[]){37});
    TH_OK(ts_bernoulli_(t, 0.3, NULL));
    th_vec_expect_free(&v, t, "bernoulli_(0.3)");
    t = th_empty(TS_F64, 1, (int64_t[]){20});
    TH_OK(ts_bernoulli_(t, 0.7, NULL));
    th_vec_expect_free(&v, t, "bernoulli_(0.7) f64");
    t = th_empty(TS_F32, 1, (int64_t[]){5});
    TH_OK(ts_bernoulli_(t, 0.0, NULL));
    th_vec_expect_free(&v, t, "bernoulli_(0)");
    t = th_empty(TS_F32, 1, (int64_t[]){5});
    TH_OK(ts_bernoulli_(t, 1.0, NULL));
    th_vec_expect_free(&v, t, "bernoulli_(1)");
    th_vec_expect_free(&v, rand1(TS_F32, 2), "rand(2) after");
    th_vec_close(&v);
}

Test(tensor_rng, dropout_matches_torch)
{
    /* F.dropout on the CPU: bernoulli_(1 - p) mask / (1 - p), times x */
    th_vec v = th_vec_open("dropout_masks");
    const int64_t shape[2] = {5, 8};
    ts_tensor *x;
    TH_OK(ts_tensor_from_data(TS_F32, 2, shape, th_vec_take(&v, 40 * sizeof(float)), &x));
    static const double ps[] = {0.5, 0.1, 0.0, 1.0};
    ts_manual_seed(0);
    for (int i = 0; i < 4; i++) {
        ts_tensor *y;
        char what[64];
        snprintf(what, sizeof what, "dropout(p=%g)", ps[i]);
        TH_OK(ts_dropout(x, ps[i], true, NULL, &y));
        th_vec_expect_free(&v, y, what);
    }
    th_vec_expect_free(&v, rand1(TS_F32, 2), "rand(2) after");
    th_vec_close(&v);

    /* the mask itself: 1 exactly where torch's output is nonzero */
    v = th_vec_open("dropout_masks");
    const float *xs = (const float *)th_vec_take(&v, 40 * sizeof(float));
    const float *y5 = (const float *)th_vec_take(&v, 40 * sizeof(float));
    ts_manual_seed(0);
    ts_tensor *m = th_empty(TS_F32, 2, shape);
    TH_OK(ts_bernoulli_(m, 1.0 - 0.5, NULL));
    const float *mp = ts_tensor_data(m);
    for (int i = 0; i < 40; i++)
        if (xs[i] != 0.0f) cr_assert_eq(mp[i] != 0.0f, y5[i] != 0.0f, "mask element %d", i);
    ts_tensor_free(m);
    ts_tensor_free(x);
    free(v.buf);
}

/* ------------------------------------------------------ large runs */

/* CRC-32 (IEEE, reflected: zlib.crc32) of a tensor's row-major bytes. */
static uint32_t tensor_crc(const ts_tensor *t)
{
    size_t nb = (size_t)ts_tensor_numel(t) * ts_dtype_size(ts_tensor_dtype(t));
    uint8_t *buf = malloc(nb ? nb : 1);
    cr_assert_not_null(buf);
    TH_OK(ts_tensor_copy_to(t, buf, nb));
    uint32_t crc = th_crc32(0, buf, nb);
    free(buf);
    return crc;
}

static void expect_crc(ts_tensor *t, const char *name)
{
    uint32_t got = tensor_crc(t), want = th_fixture_crc("rng_crc32.txt", name);
    cr_assert_eq(got, want, "%s: crc 0x%08" PRIx32 ", torch 0x%08" PRIx32, name, got, want);
    ts_tensor_free(t);
}

static ts_tensor *transposed(ts_dtype dt, int64_t rows, int64_t cols, ts_tensor **base)
{
    ts_tensor *t;
    *base = th_empty(dt, 2, (int64_t[]){rows, cols});
    TH_OK(ts_transpose(*base, 0, 1, &t));
    return t;
}

Test(tensor_rng, large_runs_match_torch_crc)
{
    /* a million values per path: a single unfused step of avx_logf or a
     * wrong libm call shows up here even when the short vectors pass */
    ts_tensor *t, *b;
    ts_manual_seed(0);
    expect_crc(randn1(TS_F32, 1 << 20), "randn_f32_seed0_1048576");
    ts_manual_seed(1);
    expect_crc(randn1(TS_F32, 1000003), "randn_f32_seed1_1000003");
    ts_manual_seed(42);
    t = th_empty(TS_F32, 1, (int64_t[]){1000003});
    TH_OK(ts_normal_(t, 0.25, 2.5, NULL));
    expect_crc(t, "normal_f32_seed42_1000003_mean0.25_std2.5");
    ts_manual_seed(2);
    expect_crc(randn1(TS_F64, 262147), "randn_f64_seed2_262147");
    ts_manual_seed(3);
    t = transposed(TS_F32, 256, 512, &b);
    TH_OK(ts_normal_(t, 0.0, 1.0, NULL));
    expect_crc(t, "normal_f32_seed3_transposed_512x256");
    ts_tensor_free(b);
    ts_manual_seed(4);
    t = transposed(TS_F64, 256, 256, &b);
    TH_OK(ts_normal_(t, -1.0, 3.0, NULL));
    expect_crc(t, "normal_f64_seed4_transposed_256x256_mean-1_std3");
    ts_tensor_free(b);
    ts_manual_seed(5);
    t = th_empty(TS_F32, 1, (int64_t[]){1 << 20});
    TH_OK(ts_uniform_(t, -3.0, 5.0, NULL));
    expect_crc(t, "uniform_f32_seed5_1048576_-3_5");
    ts_manual_seed(6);
    t = th_empty(TS_F64, 1, (int64_t[]){1 << 18});
    TH_OK(ts_uniform_(t, -3.0, 5.0, NULL));
    expect_crc(t, "uniform_f64_seed6_262144_-3_5");
    ts_manual_seed(7);
    TH_OK(ts_randint(-1000, 1000, 1, (int64_t[]){1 << 18}, NULL, &t));
    expect_crc(t, "randint_seed7_262144_-1000_1000");
    ts_manual_seed(8);
    TH_OK(ts_randperm(100000, NULL, &t));
    expect_crc(t, "randperm_seed8_100000");
    ts_manual_seed(9);
    t = th_empty(TS_F32, 1, (int64_t[]){1 << 18});
    TH_OK(ts_bernoulli_(t, 0.3, NULL));
    expect_crc(t, "bernoulli_f32_seed9_262144_p0.3");
}

/* ---------------------------------------------------------------- state */

Test(tensor_rng, get_state_matches_torch_bytes)
{
    th_vec v = th_vec_open("rng_state");
    uint8_t st[TS_GENERATOR_STATE_BYTES];
    ts_tensor *t;

    ts_manual_seed(123);
    t = randn1(TS_F32, 3);
    ts_tensor_free(t);
    ts_generator_get_state(ts_default_generator(), st);
    th_vec_expect_bytes("state after manual_seed(123); randn(3)", TS_BOOL, st, th_vec_take(&v, sizeof st), sizeof st);
    /* docs/rng.md §1.5: left 617, next 8, normal valid */
    cr_assert_eq(st[8] | st[9] << 8, 617);
    cr_assert_eq(st[16], 8);
    cr_assert_eq(st[5040], 1);

    ts_manual_seed(0);
    ts_generator_get_state(NULL, st);
    th_vec_expect_bytes("state after manual_seed(0)", TS_BOOL, st, th_vec_take(&v, sizeof st), sizeof st);

    ts_manual_seed(UINT64_MAX);
    ts_generator_get_state(NULL, st);
    th_vec_expect_bytes("state after manual_seed(-1)", TS_BOOL, st, th_vec_take(&v, sizeof st), sizeof st);

    ts_manual_seed((UINT64_C(1) << 32) + 7);
    ts_tensor_free(rand1(TS_F32, 700));
    ts_generator_get_state(NULL, st);
    th_vec_expect_bytes("state after manual_seed(2^32 + 7); rand(700)", TS_BOOL, st, th_vec_take(&v, sizeof st),
                        sizeof st);

    ts_manual_seed(7);
    ts_tensor_free(randn1(TS_F64, 1));
    ts_generator_get_state(NULL, st);
    th_vec_expect_bytes("state after manual_seed(7); randn(1, float64)", TS_BOOL, st, th_vec_take(&v, sizeof st),
                        sizeof st);
    th_vec_close(&v);
}

Test(tensor_rng, set_state_resumes_torch_stream)
{
    th_vec v = th_vec_open("rng_state_resume");
    ts_generator *g;
    TH_OK(ts_generator_new(99, &g));
    TH_OK(ts_generator_set_state(g, th_vec_take(&v, TS_GENERATOR_STATE_BYTES)));
    ts_tensor *t;
    TH_OK(ts_randn(TS_F32, 1, (int64_t[]){5}, g, &t)); /* starts with the cached normal */
    th_vec_expect_free(&v, t, "randn(5) after set_state");
    TH_OK(ts_rand(TS_F32, 1, (int64_t[]){3}, g, &t));
    th_vec_expect_free(&v, t, "rand(3)");
    th_vec_close(&v);

    /* round trip: get, draw, set back, draw again gives the same */
    uint8_t st[TS_GENERATOR_STATE_BYTES], st2[TS_GENERATOR_STATE_BYTES];
    ts_generator_manual_seed(g, 5);
    ts_tensor_free(randn1(TS_F32, 1));                 /* default generator, unrelated */
    TH_OK(ts_randn(TS_F64, 1, (int64_t[]){3}, g, &t)); /* leaves a cache */
    ts_tensor_free(t);
    ts_generator_get_state(g, st);
    ts_tensor *a, *b;
    TH_OK(ts_randn(TS_F64, 1, (int64_t[]){40}, g, &a));
    TH_OK(ts_generator_set_state(g, st));
    ts_generator_get_state(g, st2);
    cr_assert_eq(memcmp(st, st2, sizeof st), 0);
    TH_OK(ts_randn(TS_F64, 1, (int64_t[]){40}, g, &b));
    cr_assert_eq(memcmp(ts_tensor_data(a), ts_tensor_data(b), 40 * sizeof(double)), 0);
    ts_tensor_free(a);
    ts_tensor_free(b);
    ts_generator_free(g);
}

Test(tensor_rng, set_state_rejects_a_broken_state)
{
    uint8_t st[TS_GENERATOR_STATE_BYTES], before[TS_GENERATOR_STATE_BYTES], after[TS_GENERATOR_STATE_BYTES];
    ts_manual_seed(1);
    (void)ts_generator_random(NULL);
    ts_generator_get_state(NULL, st);
    memcpy(before, st, sizeof st);

    st[8] = 0; /* left = 0 */
    st[9] = 0;
    TH_FAILS(ts_generator_set_state(NULL, st), TS_ERR_INVALID_ARGUMENT, "left=0");
    memcpy(st, before, sizeof st);
    st[8] = 0x71; /* left = 625 */
    st[9] = 0x02;
    TH_FAILS(ts_generator_set_state(NULL, st), TS_ERR_INVALID_ARGUMENT, "left=625");
    memcpy(st, before, sizeof st);
    st[12] = 0; /* seeded = 0 */
    TH_FAILS(ts_generator_set_state(NULL, st), TS_ERR_INVALID_ARGUMENT, "seeded=0");
    memcpy(st, before, sizeof st);
    st[16] = 200; /* next = 200 with left 623: would read past the array */
    TH_FAILS(ts_generator_set_state(NULL, st), TS_ERR_INVALID_ARGUMENT, "next=200");
    TH_FAILS(ts_generator_set_state(NULL, NULL), TS_ERR_INVALID_ARGUMENT, "NULL");
    ts_generator_get_state(NULL, after);
    cr_assert_eq(memcmp(before, after, sizeof before), 0, "a refused state changed the generator");
}

/* --------------------------------------------------------------- errors */

Test(tensor_rng, fills_refuse_bad_arguments)
{
    ts_tensor *t = th_empty(TS_F32, 1, (int64_t[]){4});
    uint8_t st[TS_GENERATOR_STATE_BYTES], st2[TS_GENERATOR_STATE_BYTES];
    ts_manual_seed(3);
    ts_generator_get_state(NULL, st);

    TH_FAILS(ts_uniform_(t, 2.0, 1.0, NULL), TS_ERR_INVALID_ARGUMENT, "uniform_", "from=2", "to=1");
    TH_FAILS(ts_uniform_(t, -1e39, 0.0, NULL), TS_ERR_INVALID_ARGUMENT, "uniform_", "from=-1e+39", "float32");
    TH_FAILS(ts_uniform_(t, 0.0, NAN, NULL), TS_ERR_INVALID_ARGUMENT, "uniform_", "to=nan");
    TH_FAILS(ts_uniform_(t, -3e38, 3e38, NULL), TS_ERR_INVALID_ARGUMENT, "uniform_", "to - from");
    TH_FAILS(ts_normal_(t, 0.0, -1.0, NULL), TS_ERR_INVALID_ARGUMENT, "normal_", "std=-1");
    TH_FAILS(ts_normal_(t, 0.0, NAN, NULL), TS_ERR_INVALID_ARGUMENT, "normal_", "std=nan");
    TH_FAILS(ts_bernoulli_(t, 1.5, NULL), TS_ERR_INVALID_ARGUMENT, "bernoulli_", "p=1.5");
    TH_FAILS(ts_bernoulli_(t, -0.25, NULL), TS_ERR_INVALID_ARGUMENT, "bernoulli_", "p=-0.25");
    TH_FAILS(ts_bernoulli_(t, NAN, NULL), TS_ERR_INVALID_ARGUMENT, "bernoulli_", "p=nan");

    ts_tensor *o = (ts_tensor *)&o;
    TH_FAILS(ts_randint(5, 5, 1, (int64_t[]){3}, NULL, &o), TS_ERR_INVALID_ARGUMENT, "randint", "low=5", "high=5");
    TH_FAILS(ts_randint(6, -2, 1, (int64_t[]){3}, NULL, &o), TS_ERR_INVALID_ARGUMENT, "randint", "low=6", "high=-2");
    TH_FAILS(ts_randperm(-1, NULL, &o), TS_ERR_INVALID_ARGUMENT, "randperm", "n=-1");
    TH_FAILS(ts_rand(TS_I64, 1, (int64_t[]){3}, NULL, &o), TS_ERR_DTYPE, "rand", "int64");
    TH_FAILS(ts_randn(TS_BF16, 1, (int64_t[]){3}, NULL, &o), TS_ERR_DTYPE, "randn", "bfloat16");
    TH_FAILS(ts_rand(TS_F32, 1, (int64_t[]){-3}, NULL, &o), TS_ERR_INVALID_ARGUMENT, "-3");
    cr_assert_eq(o, (ts_tensor *)&o, "an output was written on failure");

    /* std = 0 and from = to are allowed */
    TH_OK(ts_normal_(t, 1.5, 0.0, NULL));
    for (int i = 0; i < 4; i++) cr_assert_eq(((float *)ts_tensor_data(t))[i], 1.5f);
    TH_OK(ts_uniform_(t, -2.0, -2.0, NULL));
    for (int i = 0; i < 4; i++) cr_assert_eq(((float *)ts_tensor_data(t))[i], -2.0f);

    /* the refused calls drew nothing: the two accepted ones drew 4 + 4 */
    ts_manual_seed(3);
    ts_tensor *ref = th_empty(TS_F32, 1, (int64_t[]){4});
    TH_OK(ts_normal_(ref, 0.0, 1.0, NULL));
    TH_OK(ts_uniform_(ref, 0.0, 1.0, NULL));
    ts_generator_get_state(NULL, st);
    ts_manual_seed(3);
    TH_FAILS(ts_uniform_(t, 2.0, 1.0, NULL), TS_ERR_INVALID_ARGUMENT, "uniform_");
    TH_FAILS(ts_normal_(t, 0.0, -1.0, NULL), TS_ERR_INVALID_ARGUMENT, "normal_");
    TH_FAILS(ts_bernoulli_(t, 2.0, NULL), TS_ERR_INVALID_ARGUMENT, "bernoulli_");
    TH_OK(ts_normal_(t, 0.0, 1.0, NULL));
    TH_OK(ts_uniform_(t, 0.0, 1.0, NULL));
    ts_generator_get_state(NULL, st2);
    cr_assert_eq(memcmp(st, st2, sizeof st), 0);
    ts_tensor_free(ref);
    ts_tensor_free(t);
}

Test(tensor_rng, fills_refuse_wrong_dtypes)
{
    ts_tensor *t = th_empty(TS_I64, 1, (int64_t[]){4});
    TH_FAILS(ts_uniform_(t, 0.0, 1.0, NULL), TS_ERR_DTYPE, "uniform_", "int64");
    TH_FAILS(ts_normal_(t, 0.0, 1.0, NULL), TS_ERR_DTYPE, "normal_", "int64");
    TH_FAILS(ts_bernoulli_(t, 0.5, NULL), TS_ERR_DTYPE, "bernoulli_", "int64");
    ts_tensor_free(t);
    t = th_empty(TS_F16, 1, (int64_t[]){4});
    TH_FAILS(ts_normal_(t, 0.0, 1.0, NULL), TS_ERR_DTYPE, "normal_", "float16");
    ts_tensor_free(t);
}

Test(tensor_rng, fills_refuse_released_and_sharded_tensors)
{
    ts_tensor *t = th_empty(TS_F32, 2, (int64_t[]){4, 4});
    TH_OK(ts_storage_release(ts_tensor_storage(t)));
    TH_FAILS(ts_uniform_(t, 0.0, 1.0, NULL), TS_ERR_RELEASED, "uniform_");
    TH_FAILS(ts_normal_(t, 0.0, 1.0, NULL), TS_ERR_RELEASED, "normal_");
    TH_FAILS(ts_bernoulli_(t, 0.5, NULL), TS_ERR_RELEASED, "bernoulli_");
    TH_OK(ts_storage_restore(ts_tensor_storage(t)));
    TH_OK(ts_uniform_(t, 0.0, 1.0, NULL));

    int meta;
    ts_tensor_set_shard(t, &meta);
    TH_FAILS(ts_uniform_(t, 0.0, 1.0, NULL), TS_ERR_SHARDED, "uniform_");
    TH_FAILS(ts_normal_(t, 0.0, 1.0, NULL), TS_ERR_SHARDED, "normal_");
    TH_FAILS(ts_bernoulli_(t, 0.5, NULL), TS_ERR_SHARDED, "bernoulli_");
    /* a local view of the shard may be filled */
    ts_tensor *local;
    TH_OK(ts_tensor_local_view(t, &local));
    TH_OK(ts_normal_(local, 0.0, 1.0, NULL));
    ts_tensor_free(local);
    ts_tensor_clear_shard(t);
    TH_OK(ts_normal_(t, 0.0, 1.0, NULL));
    ts_tensor_free(t);
    TH_FAILS(ts_normal_(NULL, 0.0, 1.0, NULL), TS_ERR_INVALID_ARGUMENT, "normal_");
}

Test(tensor_rng, fills_refuse_overlapping_elements)
{
    ts_tensor *b = th_empty(TS_F32, 2, (int64_t[]){1, 3}), *e;
    TH_OK(ts_expand(b, 2, (int64_t[]){4, 3}, &e));
    TH_FAILS(ts_uniform_(e, 0.0, 1.0, NULL), TS_ERR_INVALID_ARGUMENT, "uniform_", "stride 0");
    TH_FAILS(ts_normal_(e, 0.0, 1.0, NULL), TS_ERR_INVALID_ARGUMENT, "normal_", "stride 0");
    ts_tensor_free(e);
    ts_tensor_free(b);
}

Test(tensor_rng, empty_tensors_draw_nothing)
{
    ts_manual_seed(8);
    ts_tensor *ref = rand1(TS_F32, 3);
    ts_manual_seed(8);
    ts_tensor *t = th_empty(TS_F32, 2, (int64_t[]){0, 5}), *o;
    TH_OK(ts_uniform_(t, 0.0, 1.0, NULL));
    TH_OK(ts_normal_(t, 0.0, 1.0, NULL));
    TH_OK(ts_bernoulli_(t, 0.5, NULL));
    TH_OK(ts_randn(TS_F64, 1, (int64_t[]){0}, NULL, &o));
    ts_tensor_free(o);
    TH_OK(ts_randint(0, 3, 2, (int64_t[]){2, 0}, NULL, &o));
    ts_tensor_free(o);
    TH_OK(ts_randperm(1, NULL, &o));
    ts_tensor_free(o);
    ts_tensor *got = rand1(TS_F32, 3);
    cr_assert_eq(memcmp(ts_tensor_data(ref), ts_tensor_data(got), 3 * sizeof(float)), 0);
    ts_tensor_free(got);
    ts_tensor_free(ref);
    ts_tensor_free(t);
}

Test(tensor_rng, fills_are_not_recorded_by_autograd)
{
    ts_tensor *t = th_empty(TS_F32, 1, (int64_t[]){20});
    TH_OK(ts_tensor_set_requires_grad(t, true));
    TH_OK(ts_normal_(t, 0.0, 1.0, NULL));
    TH_OK(ts_uniform_(t, 0.0, 1.0, NULL));
    cr_assert(ts_tensor_is_leaf(t));
    cr_assert(ts_tensor_requires_grad(t));
    ts_tensor_free(t);
}

Test(tensor_rng, nothing_leaks)
{
    size_t tensor0 = ts_mem_live_bytes(TS_MEM_TENSOR), storage0 = ts_mem_live_bytes(TS_MEM_STORAGE);
    size_t other0 = ts_mem_live_bytes(TS_MEM_OTHER);
    ts_generator *g;
    TH_OK(ts_generator_new(1, &g));
    ts_tensor *a, *b, *c, *d;
    TH_OK(ts_rand(TS_F32, 2, (int64_t[]){7, 9}, g, &a));
    TH_OK(ts_randn(TS_F64, 1, (int64_t[]){33}, g, &b));
    TH_OK(ts_randint(-3, 3, 1, (int64_t[]){5}, g, &c));
    TH_OK(ts_randperm(9, g, &d));
    ts_tensor *o;
    TH_FAILS(ts_randint(3, 3, 1, (int64_t[]){5}, g, &o), TS_ERR_INVALID_ARGUMENT, "randint");
    TH_FAILS(ts_rand(TS_I32, 1, (int64_t[]){5}, g, &o), TS_ERR_DTYPE, "rand", "int32");
    ts_tensor_free(a);
    ts_tensor_free(b);
    ts_tensor_free(c);
    ts_tensor_free(d);
    ts_generator_free(g);
    cr_assert_eq(ts_mem_live_bytes(TS_MEM_TENSOR), tensor0);
    cr_assert_eq(ts_mem_live_bytes(TS_MEM_STORAGE), storage0);
    cr_assert_eq(ts_mem_live_bytes(TS_MEM_OTHER), other0);
}
