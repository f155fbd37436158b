/* Layer initialisation bit-exact with PyTorch (vectors made by
 * ../shared/reference/torch-rng/make_vectors.py, copied under
 * tests/fixtures/rng/), forward semantics and errors. */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

#include "tensor/flash_attention.h"
#include "tests/helpers.h"

/* Compares every parameter of m, in named_parameters order, with the
 * float32 values concatenated in fixture file `name`.bin. */
static void assert_params_match(ts_module *m, const char *name)
{
    char path[512];
    snprintf(path, sizeof path, "%s/rng/%s.bin", TS_FIXTURES_DIR, name);
    size_t len;
    float *want = th_read_file(path, &len);
    ts_named_params p;
    TH_OK(ts_module_named_parameters(m, &p));
    size_t off = 0;
    for (int i = 0; i < p.n; i++) {
        ts_tensor *t = *p.items[i].slot;
        size_t k = (size_t)ts_tensor_numel(t);
        cr_assert_leq((off + k) * 4, len, "%s: fixture too short at %s", name, p.items[i].name);
        float *got = malloc(k * 4 + 4);
        TH_OK(ts_tensor_copy_to(t, got, k * 4));
        cr_assert_eq(memcmp(got, want + off, k * 4), 0, "%s: %s differs from PyTorch", name, p.items[i].name);
        free(got);
        off += k;
    }
    cr_assert_eq(off * 4, len, "%s: fixture has %zu values, model %zu", name, len / 4, off);
    ts_named_params_free(&p);
    free(want);
}

Test(nn_layers, linear_init_is_bit_exact)
{
    ts_module *m;
    ts_manual_seed(0);
    TH_OK(ts_linear_new(4, 4, false, &m));
    assert_params_match(m, "linear4x4_seed0_weight");
    ts_module_free(m);
    ts_manual_seed(42);
    TH_OK(ts_linear_new(8, 8, true, &m));
    assert_params_match(m, "linear8x8_seed42_weight_bias");
    ts_module_free(m);
    ts_manual_seed(0);
    TH_OK(ts_linear_new(64, 32, true, &m));
    assert_params_match(m, "linear64x32_seed0_weight_bias");
    ts_module_free(m);
}

Test(nn_layers, sequential_embedding_encoder_init_are_bit_exact)
{
    ts_module *k[3], *m;
    ts_manual_seed(0);
    TH_OK(ts_linear_new(4, 4, false, &k[0]));
    TH_OK(ts_relu_new(&k[1]));
    TH_OK(ts_linear_new(4, 4, false, &k[2]));
    TH_OK(ts_sequential_new(3, k, &m));
    assert_params_match(m, "seq2linear4_seed0_weights");
    ts_module_free(m);
    ts_manual_seed(0);
    TH_OK(ts_embedding_new(10, 3, &m));
    assert_params_match(m, "embedding10x3_seed0_weight");
    ts_module_free(m);
    ts_manual_seed(0);
    ts_encoder_layer_config c = ts_encoder_layer_config_default(8, 2);
    c.dim_feedforward = 16;
    TH_OK(ts_encoder_layer_new(&c, &m));
    assert_params_match(m, "encoderlayer_d8_h2_ff16_seed0_params");
    ts_module_free(m);
}

Test(nn_layers, encoder_copies_draw_nothing)
{
    ts_encoder_layer_config c = ts_encoder_layer_config_default(8, 2);
    c.dim_feedforward = 16;
    ts_module *one, *two;
    ts_manual_seed(3);
    TH_OK(ts_encoder_layer_new(&c, &one));
    uint32_t after_one = ts_generator_random(ts_default_generator());
    ts_manual_seed(3);
    TH_OK(ts_transformer_encoder_new(&c, 3, &two));
    cr_assert_eq(ts_generator_random(ts_default_generator()), after_one,
                 "TransformerEncoder must consume exactly one layer's draws (deep copies)");
    ts_state_dict *a, *b;
    TH_OK(ts_module_state_dict(one, &a));
    TH_OK(ts_module_state_dict(two, &b));
    for (int layer = 0; layer < 3; layer++)
        for (int i = 0; i < ts_state_dict_size(a); i++) {
            char key[256];
            snprintf(key, sizeof key, "layers.%d.%s", layer, ts_state_dict_name(a, i));
            th_assert_close(ts_state_dict_get(b, key), ts_state_dict_tensor(a, i), 0, 0);
        }
    ts_state_dict_free(a);
    ts_state_dict_free(b);
    ts_module_free(one);
    ts_module_free(two);
}

/* MHA against the attention formula written out with plain ops. */
Test(nn_layers, mha_matches_the_formula_and_masks)
{
    ts_manual_seed(5);
    ts_module *m;
    ts_mha_options mo = ts_mha_options_default();
    mo.batch_first = true; /* x below is (B, T, E) */
    TH_OK(ts_mha_new_opts(8, 2, &mo, &m));
    ts_nn_mha *a = (ts_nn_mha *)m;
    /* non-zero biases so that they matter */
    bool prev = ts_grad_mode_set(false);
    TH_OK(ts_uniform_(a->in_proj_bias, -0.5, 0.5, NULL));
    TH_OK(ts_uniform_(((ts_nn_linear *)a->out_proj)->bias, -0.5, 0.5, NULL));
    ts_grad_mode_set(prev);
    int64_t xs[3] = {2, 5, 8};
    ts_tensor *x = th_seq(TS_F32, 3, xs, 1.0, false), *mask, *y;
    TH_OK(ts_tril_mask(5, 0, &mask)); /* attend only to the future... */
    ts_tensor *args[4] = {x, x, x, mask}, *outs[TS_MODULE_MAX_IO];
    int n;
    TH_OK(ts_module_call(m, 4, args, &n, outs));
    y = outs[0];
    /* reference: per batch and head, softmax((q k^T) / sqrt(4) masked) v */
    float xv[80], wv[192], bv[24], ow[64], ob[8], yv[80];
    TH_OK(ts_tensor_copy_to(x, xv, sizeof xv));
    TH_OK(ts_tensor_copy_to(a->in_proj_weight, wv, sizeof wv));
    TH_OK(ts_tensor_copy_to(a->in_proj_bias, bv, sizeof bv));
    TH_OK(ts_tensor_copy_to(((ts_nn_linear *)a->out_proj)->weight, ow, sizeof ow));
    TH_OK(ts_tensor_copy_to(((ts_nn_linear *)a->out_proj)->bias, ob, sizeof ob));
    TH_OK(ts_tensor_copy_to(y, yv, sizeof yv));
    for (int b = 0; b < 2; b++) {
        double qkv[3][5][8];
        for (int k = 0; k < 3; k++)
            for (int t = 0; t < 5; t++)
                for (int e = 0; e < 8; e++) {
                    double s = bv[k * 8 + e];
                    for (int i = 0; i < 8; i++) s += (double)xv[(b * 5 + t) * 8 + i] * wv[(k * 8 + e) * 8 + i];
                    qkv[k][t][e] = s;
                }
        double att[5][8] = {{0}};
        for (int h = 0; h < 2; h++)
            for (int t = 0; t < 5; t++) {
                double sc[5], mx = -INFINITY, z = 0;
                for (int s = 0; s < 5; s++) {
                    double d = 0;
                    for (int e = 0; e < 4; e++) d += qkv[0][t][h * 4 + e] * qkv[1][s][h * 4 + e];
                    sc[s] = s <= t ? -INFINITY : d / 2.0; /* tril true = masked */
                    mx = sc[s] > mx ? sc[s] : mx;
                }
                for (int s = 0; s < 5; s++) z += (sc[s] = (mx == -INFINITY) ? NAN : exp(sc[s] - mx));
                for (int e = 0; e < 4; e++)
                    for (int s = 0; s < 5; s++) att[t][h * 4 + e] += sc[s] / z * qkv[2][s][h * 4 + e];
            }
        for (int t = 0; t < 5; t++)
            for (int e = 0; e < 8; e++) {
                double want = ob[e];
                for (int i = 0; i < 8; i++) want += att[t][i] * ow[e * 8 + i];
                double got = yv[(b * 5 + t) * 8 + e];
                if (isnan(want)) cr_assert(isnan(got), "fully masked rows give NaN, as in PyTorch");
                else /* f32 through two projections and a softmax: 1e-5 absolute */
                    cr_assert_float_eq(got, want, 1e-5, "b %d t %d e %d: %g vs %g", b, t, e, got, want);
            }
    }
    ts_tensor_free(x);
    ts_tensor_free(mask);
    ts_tensor_free(y);
    ts_module_free(m);
}

Test(nn_layers, gpt_forward_is_causal)
{
    ts_manual_seed(0);
    ts_gpt_config c = ts_gpt_config_default();
    c.vocab_size = 13;
    c.block_size = 8;
    c.n_layer = 2;
    c.n_head = 2;
    c.d_model = 16;
    ts_module *g;
    TH_OK(ts_gpt_new(&c, &g));
    int64_t is[2] = {1, 6};
    double ids1[6] = {1, 2, 3, 4, 5, 6}, ids2[6] = {1, 2, 3, 9, 9, 9};
    ts_tensor *a = th_tensor(TS_I64, 2, is, ids1), *b = th_tensor(TS_I64, 2, is, ids2), *ya, *yb, *pa, *pb;
    TH_OK(ts_module_call1(g, a, &ya));
    TH_OK(ts_module_call1(g, b, &yb));
    cr_assert_eq(ts_tensor_size(ya, 2), 13);
    /* positions 0..2 see the same prefix: identical logits */
    TH_OK(ts_narrow(ya, 1, 0, 3, &pa));
    TH_OK(ts_narrow(yb, 1, 0, 3, &pb));
    th_assert_close(pa, pb, 0, 0);
    ts_tensor_free(pa);
    ts_tensor_free(pb);
    TH_OK(ts_narrow(ya, 1, 3, 1, &pa));
    TH_OK(ts_narrow(yb, 1, 3, 1, &pb));
    double va, vb;
    int64_t z[3] = {0, 0, 0};
    TH_OK(ts_tensor_get(pa, z, &va));
    TH_OK(ts_tensor_get(pb, z, &vb));
    cr_assert(va != vb, "position 3 sees a different token");
    ts_tensor *long_ids;
    int64_t ls[2] = {1, 9};
    TH_OK(ts_tensor_zeros(TS_I64, 2, ls, &long_ids));
    ts_tensor *bad = NULL;
    cr_assert_eq(ts_module_call1(g, long_ids, &bad), TS_ERR_SHAPE);
    cr_assert(strstr(ts_last_error(), "block_size 8") != NULL, "%s", ts_last_error());
    ts_tensor *all[] = {a, b, ya, yb, pa, pb, long_ids};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) ts_tensor_free(all[i]);
    ts_module_free(g);
}

Test(nn_layers, dropout_follows_train_and_eval)
{
    ts_module *d;
    TH_OK(ts_dropout_new(0.5, &d));
    int64_t s[1] = {1000};
    ts_tensor *x, *y;
    TH_OK(ts_tensor_ones(TS_F32, 1, s, &x));
    TH_OK(ts_module_call1(d, x, &y));
    float v[1000];
    TH_OK(ts_tensor_copy_to(y, v, sizeof v));
    int zeros = 0;
    for (int i = 0; i < 1000; i++) {
        cr_assert(v[i] == 0.0f || v[i] == 2.0f);
        zeros += v[i] == 0.0f;
    }
    cr_assert(zeros > 400 && zeros < 600, "%d zeros", zeros);
    ts_tensor_free(y);
    ts_module_eval(d);
    TH_OK(ts_module_call1(d, x, &y));
    th_assert_close(y, x, 0, 0);
    ts_tensor_free(x);
    ts_tensor_free(y);
    ts_module_free(d);
    cr_assert_eq(ts_dropout_new(1.5, &d), TS_ERR_INVALID_ARGUMENT);
}

/* ------------------------------------------------------------ batch_first */

Test(nn_layers, mha_and_encoder_layer_default_to_seq_first)
{
    ts_mha_options o = ts_mha_options_default();
    cr_assert(!o.batch_first && o.bias && o.dropout == 0.0, "PyTorch's MultiheadAttention defaults");
    ts_encoder_layer_config c = ts_encoder_layer_config_default(128, 4);
    cr_assert(!c.batch_first && c.dim_feedforward == 2048 && c.dropout == 0.1 && !c.gelu && c.layer_norm_eps == 1e-5 &&
                  !c.norm_first,
              "PyTorch 1.13's TransformerEncoderLayer defaults");
    ts_module *m;
    TH_OK(ts_mha_new(8, 2, 0.0, true, &m));
    cr_assert(!((ts_nn_mha *)m)->batch_first, "ts_mha_new is batch_first=False, as PyTorch");
    ts_module_free(m);
    TH_OK(ts_mha_new_opts(8, 2, NULL, &m));
    cr_assert(!((ts_nn_mha *)m)->batch_first && ((ts_nn_mha *)m)->in_proj_bias, "NULL options are the defaults");
    ts_module_free(m);
}

/* A contiguous copy of x with dims 0 and 1 swapped. */
static ts_tensor *swapped(ts_tensor *x)
{
    ts_tensor *t, *c;
    TH_OK(ts_transpose(x, 0, 1, &t));
    TH_OK(ts_clone(t, &c));
    ts_tensor_free(t);
    return c;
}

/* swapped(x) as a new leaf that requires grad (no history to x). */
static ts_tensor *swapped_leaf(ts_tensor *x)
{
    ts_tensor *c = swapped(x), *d;
    TH_OK(ts_detach(c, &d));
    ts_tensor_free(c);
    TH_OK(ts_tensor_set_requires_grad(d, true));
    return d;
}

/* Calls m on in[0..n) in train mode with the generator at `seed`, then
 * backward of sum(out * w) with w = th_seq(out's shape, 0.5) in the
 * layout given (w_swapped: w is built (B, T, E) and swapped). */
static ts_tensor *call_and_backward(ts_module *m, int n, ts_tensor **in, uint64_t seed, bool w_swapped)
{
    ts_manual_seed(seed);
    ts_tensor *outs[TS_MODULE_MAX_IO], *w, *p, *s;
    int no;
    TH_OK(ts_module_call(m, n, in, &no, outs));
    cr_assert_eq(no, 1);
    if (w_swapped) {
        int64_t ws[3] = {ts_tensor_size(outs[0], 1), ts_tensor_size(outs[0], 0), ts_tensor_size(outs[0], 2)};
        ts_tensor *w0 = th_seq(TS_F32, 3, ws, 0.5, false);
        w = swapped(w0);
        ts_tensor_free(w0);
    } else {
        int64_t ws[3] = {ts_tensor_size(outs[0], 0), ts_tensor_size(outs[0], 1), ts_tensor_size(outs[0], 2)};
        w = th_seq(TS_F32, 3, ws, 0.5, false);
    }
    TH_OK(ts_mul(outs[0], w, &p));
    TH_OK(ts_sum(p, 0, NULL, false, &s));
    TH_OK(ts_backward(s, NULL, false));
    ts_tensor_free(s);
    ts_tensor_free(p);
    ts_tensor_free(w);
    return outs[0];
}

/* batch_first=False on (T, B, E) computes the transpose of batch_first=True
 * on (B, T, E), dropout on the attention weights included: PyTorch draws
 * that mask over (B*H, T, S) in both layouts, so the same seed gives the
 * same mask. Self-attention (the packed projection) and cross-attention
 * (three projections, S != T), values and input gradients. */
Test(nn_layers, mha_seq_first_is_batch_first_transposed)
{
    th_mem_mark();
    for (int cross = 0; cross < 2; cross++) {
        ts_module *bf, *sf;
        ts_mha_options o = ts_mha_options_default();
        o.dropout = 0.25;
        o.batch_first = true;
        ts_manual_seed(11);
        TH_OK(ts_mha_new_opts(8, 2, &o, &bf));
        o.batch_first = false;
        ts_manual_seed(11);
        TH_OK(ts_mha_new_opts(8, 2, &o, &sf));
        int64_t xs[3] = {3, 5, 8}, zs[3] = {3, 4, 8}; /* B 3, T 5, S 4 */
        ts_tensor *x = th_seq(TS_F32, 3, xs, 1.0, true), *z = th_seq(TS_F32, 3, zs, 0.8, true);
        ts_tensor *xt = swapped_leaf(x), *zt = swapped_leaf(z);
        ts_tensor *in_bf[3] = {x, cross ? z : x, cross ? z : x}, *in_sf[3] = {xt, cross ? zt : xt, cross ? zt : xt};
        ts_tensor *ybf = call_and_backward(bf, 3, in_bf, 99, false);
        ts_tensor *ysf = call_and_backward(sf, 3, in_sf, 99, true);
        int64_t want_sf[3] = {5, 3, 8};
        th_assert_shape(ysf, 3, want_sf);
        cr_assert(ts_tensor_is_contiguous(ysf), "the (T, B, E) output is contiguous, as PyTorch's");
        ts_tensor *ybf_t = swapped(ybf);
        /* the same float operations on the same rows, in another order of
         * rows: 1e-6 relative + 1e-6 absolute (values of order 1) */
        th_assert_close(ysf, ybf_t, 1e-6, 1e-6);
        ts_tensor *gx_t = swapped(ts_tensor_grad(x));
        th_assert_close(ts_tensor_grad(xt), gx_t, 1e-6, 1e-6);
        if (cross) {
            ts_tensor *gz_t = swapped(ts_tensor_grad(z));
            th_assert_close(ts_tensor_grad(zt), gz_t, 1e-6, 1e-6);
            ts_tensor_free(gz_t);
        }
        ts_tensor_free(gx_t);
        ts_tensor_free(ybf_t);
        ts_tensor_free(ybf);
        ts_tensor_free(ysf);
        ts_tensor_free(x);
        ts_tensor_free(z);
        ts_tensor_free(xt);
        ts_tensor_free(zt);
        ts_module_free(bf);
        ts_module_free(sf);
    }
    th_mem_assert_back();
}

Test(nn_layers, mha_seq_first_shape_errors_name_the_layout)
{
    th_mem_mark();
    ts_module *m;
    TH_OK(ts_mha_new(8, 2, 0.0, true, &m));
    int64_t qs[3] = {5, 2, 8}, ks[3] = {4, 3, 8}, ms[2] = {5, 5};
    ts_tensor *q = th_seq(TS_F32, 3, qs, 1, false), *k = th_seq(TS_F32, 3, ks, 1, false), *outs[TS_MODULE_MAX_IO];
    int n;
    /* key batch 3 != query batch 2 (dim 1 without batch_first) */
    ts_tensor *args[3] = {q, k, k};
    cr_assert_eq(ts_module_call(m, 3, args, &n, outs), TS_ERR_SHAPE);
    cr_assert(strstr(ts_last_error(), "(T, B, E), (S, B, E)") && strstr(ts_last_error(), "batch_first=false"), "%s",
              ts_last_error());
    /* the mask is (T, S) with T = size(0) of the query */
    ts_tensor *mask;
    TH_OK(ts_tensor_zeros(TS_BOOL, 2, ms, &mask));
    ts_tensor *a2[4] = {q, q, q, mask};
    TH_OK(ts_module_call(m, 4, a2, &n, outs));
    th_assert_shape(outs[0], 3, qs);
    ts_tensor_free(outs[0]);
    ts_tensor_free(mask);
    int64_t bad[2] = {2, 2};
    TH_OK(ts_tensor_zeros(TS_BOOL, 2, bad, &mask));
    a2[3] = mask;
    cr_assert_eq(ts_module_call(m, 4, a2, &n, outs), TS_ERR_SHAPE);
    cr_assert(strstr(ts_last_error(), "(5, 5)"), "%s", ts_last_error());
    ts_tensor_free(mask);
    ts_tensor_free(q);
    ts_tensor_free(k);
    ts_module_free(m);
    th_mem_assert_back();
}

/* TransformerEncoderLayer with batch_first=False on (T, B, d) is the
 * transpose of batch_first=True on (B, T, d) when no dropout mask is drawn
 * (train mode, dropout 0; with dropout the masks follow each layout's own
 * order, checked against torch by Test(fully_shard_examples,
 * seed001_encoder_*)). Post-norm and pre-norm; the causal mask takes T
 * from dim 0 without batch_first (T 5 != B 3 here). */
Test(nn_layers, encoder_layer_seq_first_is_batch_first_transposed)
{
    th_mem_mark();
    for (int variant = 0; variant < 2; variant++) {
        ts_encoder_layer_config c = ts_encoder_layer_config_default(8, 2);
        c.dim_feedforward = 16;
        c.dropout = 0.0;
        c.norm_first = variant == 1;
        c.causal = true;
        ts_module *bf, *sf;
        c.batch_first = true;
        ts_manual_seed(21);
        TH_OK(ts_encoder_layer_new(&c, &bf));
        c.batch_first = false;
        ts_manual_seed(21);
        TH_OK(ts_encoder_layer_new(&c, &sf));
        int64_t xs[3] = {3, 5, 8};
        ts_tensor *x = th_seq(TS_F32, 3, xs, 1.0, true), *xt = swapped_leaf(x);
        ts_tensor *ybf = call_and_backward(bf, 1, &x, 5, false), *ysf = call_and_backward(sf, 1, &xt, 5, true);
        ts_tensor *ybf_t = swapped(ybf), *gx_t = swapped(ts_tensor_grad(x));
        /* layer norm and two residuals over the same rows: as above */
        th_assert_close(ysf, ybf_t, 1e-6, 1e-6);
        th_assert_close(ts_tensor_grad(xt), gx_t, 1e-6, 1e-6);
        ts_tensor_free(gx_t);
        ts_tensor_free(ybf_t);
        ts_tensor_free(ybf);
        ts_tensor_free(ysf);
        ts_tensor_free(x);
        ts_tensor_free(xt);
        ts_module_free(bf);
        ts_module_free(sf);
    }
    th_mem_assert_back();
}

/* One training step of a GPT with dropout 0.1 (embeddings, attention
 * weights, MLP; T 40 across two key blocks, causal) with the fused
 * attention kernel and with the reference path, from the same seeds: the
 * fused kernel draws the attention masks as the reference path does, so
 * every later dropout (MLP, the next layer) draws the same numbers too,
 * the default generator ends in the same state, and the loss and the
 * gradients differ only by float32 rounding. Tolerance: the attention's
 * outputs agree within ~1e-6 relative (tests/tensor/
 * test_flash_attention.c); through 2 layers, the loss within 1e-5
 * relative and each gradient within 1e-3 relative of its largest
 * element (measured: the same loss to 9 digits, gradients within 4.6e-7
 * of their largest element). Attention masks drawn with keep
 * probability 0.91 instead of 0.9 (about 1% of the elements flipped)
 * moved the loss by 4.2e-5 relative, 4x the tolerance. */
Test(nn_layers, gpt_dropout_fused_attention_follows_the_reference_draws)
{
    double loss[2];
    uint8_t state[2][TS_GENERATOR_STATE_BYTES];
    ts_tensor *grads[2][64] = {{0}};
    int np = 0;
    for (int fused = 0; fused < 2; fused++) {
        ts__flash_force(fused);
        ts_manual_seed(5);
        ts_gpt_config c = ts_gpt_config_default();
        c.vocab_size = 32, c.block_size = 40, c.n_layer = 2, c.n_head = 2, c.d_model = 32, c.dropout = 0.1;
        ts_module *m;
        TH_OK(ts_gpt_new(&c, &m));
        int64_t is[2] = {2, 40}, ys[1] = {80}, fs[2] = {80, 32};
        ts_tensor *x, *y, *logits, *flat, *l;
        TH_OK(ts_randint(0, 32, 2, is, NULL, &x));
        TH_OK(ts_randint(0, 32, 1, ys, NULL, &y));
        TH_OK(ts_module_call1(m, x, &logits));
        TH_OK(ts_reshape(logits, 2, fs, &flat));
        TH_OK(ts_cross_entropy(flat, y, -100, TS_REDUCTION_MEAN, &l));
        TH_OK(ts_backward(l, NULL, false));
        ts_generator_get_state(ts_default_generator(), state[fused]);
        double *lv = th_vals_new(l);
        loss[fused] = lv[0];
        free(lv);
        ts_named_params p;
        TH_OK(ts_module_named_parameters(m, &p));
        cr_assert_leq(p.n, 64);
        np = p.n;
        for (int i = 0; i < p.n; i++) grads[fused][i] = ts_tensor_retain(ts_tensor_grad(*p.items[i].slot));
        ts_named_params_free(&p);
        ts_tensor *all[] = {x, y, logits, flat, l};
        for (size_t i = 0; i < sizeof all / sizeof *all; i++) ts_tensor_free(all[i]);
        ts_module_free(m);
    }
    ts__flash_force(-1);
    cr_assert(memcmp(state[0], state[1], sizeof state[0]) == 0, "the generators' states differ after the step");
    cr_assert(fabs(loss[1] - loss[0]) <= 1e-5 * fabs(loss[0]), "loss fused %.9g, reference %.9g", loss[1], loss[0]);
    for (int i = 0; i < np; i++) {
        cr_assert_not_null(grads[0][i]);
        double *a = th_vals_new(grads[1][i]), *b = th_vals_new(grads[0][i]), mx = 0, worst = 0;
        for (int64_t e = 0; e < ts_tensor_numel(grads[0][i]); e++) {
            mx = fmax(mx, fabs(b[e]));
            worst = fmax(worst, fabs(a[e] - b[e]));
        }
        cr_assert(worst <= 1e-3 * mx, "parameter %d: gradient differs by %g (largest %g)", i, worst, mx);
        if (getenv("TS_TEST_VERBOSE"))
            cr_log_info("parameter %d: %g of the largest gradient", i, mx > 0 ? worst / mx : 0.0);
        free(a);
        free(b);
        ts_tensor_free(grads[0][i]);
        ts_tensor_free(grads[1][i]);
    }
    if (getenv("TS_TEST_VERBOSE"))
        cr_log_info("loss %.9g vs %.9g: relative %g", loss[1], loss[0], fabs(loss[1] - loss[0]) / fabs(loss[0]));
}

/* An embed_dim whose 3 * embed_dim rows overflow int64 is refused, naming
 * it (the product used to overflow: undefined behaviour, caught by UBSan). */
Test(nn_layers, mha_with_a_huge_embed_dim_is_an_error)
{
    ts_module *m = NULL;
    ts_status st = ts_mha_new(INT64_MAX, 1, 0.0, true, &m);
    cr_assert_eq(st, TS_ERR_INVALID_ARGUMENT, "%s: %s", ts_status_name(st), ts_last_error());
    cr_assert_not_null(strstr(ts_last_error(), "embed_dim 9223372036854775807"), "%s", ts_last_error());
    cr_assert_null(m);
}
