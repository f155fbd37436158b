/* Parity with PyTorch in bfloat16: the tiny GPT of tests/nn/test_parity.c
 * ("gpt": models.GPT(vocab_size=11, block_size=8, n_layer=2, n_head=2,
 * d_model=16, dropout=0.0), seed 303), converted with
 * ts_module_to_dtype(m, TS_BF16) as torch's model.to(torch.bfloat16), must
 * have the same bfloat16 parameters bit for bit, then give torch 1.13's
 * CPU forward logits, loss and every parameter's gradient. Golden values:
 * tests/fixtures/half/nn/gpt_bf16.bin, written by
 * tools/reference/make_half_nn.py (its docstring has the exact calls).
 * Also: TransformerEncoderLayer in bf16 and f16 tracks its f32 run.
 *
 * Tolerances. The parameters (the f32 ones, bit-exact with torch's, SPEC
 * §9, rounded to nearest even by both) and the token ids are exact.
 * Everything computed from them runs through about 20 ops that each
 * compute in float32 and round their result to bfloat16 (2^-8 relative
 * rounding error, 256 times float32's), in torch as here; where the two
 * accumulate in a different order (BLIS or this library's bf16 kernels
 * against oneDNN's; the softmax and layer-norm kernels that torch rounds
 * inside, tests/tensor/test_half_nn_ops.c), a result can land one
 * rounding step away, and the next op carries that ulp on. Elements are
 * held, as in test_half_nn_ops.c, to
 *
 *     |got - ref| <= limit * (ulp(ref) + ulp(max|ref|) / 4)
 *
 * with ulp() bfloat16's spacing at that magnitude; the second term is the
 * scale floor for elements that cancel to near zero (the key-projection
 * bias gradients, exactly zero in exact arithmetic, are the extreme case).
 * The limits below say what was measured. */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/helpers.h"

/* Each tensor is also held as a whole: ||got - ref|| / ||ref|| below a
 * limit, which a systematic error (a wrong formula, a missing rounding
 * that shifts everything, a wrong scale) exceeds even where single
 * elements stay inside their bound. */

/* Forward logits and loss: measured 2.67 units at most on the logits (a
 * bf16 rounding step of a logit, carried from a layer norm or attention
 * output that rounded the other way) and the same bits on the loss; norm
 * 6.1e-3 on the logits, 1.5 bf16 unit roundoffs (2^-8 = 3.9e-3). A wrong
 * op is off by tens to hundreds of units and a norm of 0.1 to 1. */
#define LIMIT_FORWARD 6.0
#define LIMIT_FORWARD_NORM 1.5e-2
/* Gradients: the backward pass runs the chain again, through the softmax
 * and layer-norm backward whose terms cancel, and the deepest gradients
 * carry the most: measured over the 29 gradient tensors at most 14 units
 * (blocks.0.ln1.weight, a sum over the 12 rows of g * xh whose g has
 * come back through both blocks; 9 on blocks.0.attn.in_proj_weight, 7.3
 * on blocks.0.mlp.0.weight, at most 5.3 elsewhere) and norms 4.5e-3 to
 * 2.1e-2 (blocks.0.ln1.weight again). Limits twice those. */
#define LIMIT_GRAD 28.0
#define LIMIT_GRAD_NORM 5e-2

/* ------------------------------------------------------------ fixtures */

/* The fixtures are loaded by th_half_fx_open() of tests/helpers.c. */

/* A new tensor with the fixture's tensor `name`; this group holds int64,
 * bfloat16 and float32 tensors only. */
static ts_tensor *fx_tensor(const th_half_fx *f, const char *name)
{
    ts_tensor *t = th_half_fx_tensor(f, name);
    ts_dtype dt = ts_tensor_dtype(t);
    cr_assert(dt == TS_I64 || dt == TS_BF16 || dt == TS_F32, "dtype %s", ts_dtype_name(dt));
    return t;
}

/* ------------------------------------------------------------ checks */

static bool verbose(void) { return getenv("TS_PARITY_VERBOSE") != NULL; }

static void expect_shape(const char *what, const ts_tensor *got, const ts_tensor *ref)
{
    char s1[96], s2[96];
    bool ok = ts_tensor_ndim(got) == ts_tensor_ndim(ref);
    for (int d = 0; ok && d < ts_tensor_ndim(got); d++) ok = ts_tensor_shape(got)[d] == ts_tensor_shape(ref)[d];
    cr_assert(ok, "%s: shape %s, PyTorch %s", what, ts_tensor_shape_str(got, s1, sizeof s1),
              ts_tensor_shape_str(ref, s2, sizeof s2));
}

static void expect_bits(const char *what, ts_tensor *got, ts_tensor *ref)
{
    cr_assert_eq(ts_tensor_dtype(got), ts_tensor_dtype(ref), "%s: dtype %s, PyTorch %s", what,
                 ts_dtype_name(ts_tensor_dtype(got)), ts_dtype_name(ts_tensor_dtype(ref)));
    expect_shape(what, got, ref);
    size_t nb = (size_t)ts_tensor_numel(got) * ts_dtype_size(ts_tensor_dtype(got));
    uint8_t *a = malloc(nb + 1), *b = malloc(nb + 1);
    TH_OK(ts_tensor_copy_to(got, a, nb));
    TH_OK(ts_tensor_copy_to(ref, b, nb));
    cr_assert(memcmp(a, b, nb) == 0, "%s differs from PyTorch's", what);
    free(a);
    free(b);
}

static double ulp_bf16(double a)
{
    int e = a > 0 ? (int)floor(log2(a)) : -126;
    return ldexp(1.0, (e < -126 ? -126 : e) - 7);
}

/* Asserts the bf16 tensor got is within `limit` units (see the top) of
 * PyTorch's ref element by element, and within norm_limit as a whole;
 * returns the worst element error in those units. */
static double expect_close(const char *what, ts_tensor *got, ts_tensor *ref, double limit, double norm_limit)
{
    cr_assert_eq(ts_tensor_dtype(got), TS_BF16, "%s: dtype %s", what, ts_dtype_name(ts_tensor_dtype(got)));
    expect_shape(what, got, ref);
    int64_t n = ts_tensor_numel(got);
    double *g = th_vals_new(got), *r = th_vals_new(ref), scale = 0, worst = 0;
    for (int64_t i = 0; i < n; i++) scale = fmax(scale, fabs(r[i]));
    int64_t bad = -1;
    double dd = 0, rr = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs(g[i] - r[i]), unit = ulp_bf16(fabs(r[i])) + ulp_bf16(scale) / 4;
        double e = g[i] == r[i] ? 0 : isnan(d) ? INFINITY : d / unit;
        worst = fmax(worst, e);
        if (!(e <= limit) && bad < 0) bad = i;
        dd += d * d;
        rr += r[i] * r[i];
    }
    /* and as a whole: ||got - ref|| / ||ref|| */
    double rel = rr > 0 ? sqrt(dd / rr) : sqrt(dd);
    if (verbose())
        fprintf(stderr, "  %-40s n %4lld  max err %.2f (limit %g)  norm rel %.2e (limit %g)\n", what, (long long)n,
                worst, limit, rel, norm_limit);
    cr_assert_eq(bad, -1, "%s: element %lld is %.9g, PyTorch %.9g (max|ref| %.6g; limit %g units, worst %.2f)", what,
                 (long long)bad, bad >= 0 ? g[bad] : 0.0, bad >= 0 ? r[bad] : 0.0, scale, limit, worst);
    cr_assert(rel <= norm_limit, "%s: ||got - ref|| / ||ref|| = %.3g > %g", what, rel, norm_limit);
    free(g);
    free(r);
    return worst;
}

/* ------------------------------------------------------------ model */

/* Our GPT after ts_manual_seed(seed), in train mode (dropout 0), then
 * ts_module_to_dtype(bf16): torch's m.train(); m.to(torch.bfloat16). */
static ts_module *build(const th_half_fx *f)
{
    json_t *c = json_object_get(f->group, "config");
    ts_gpt_config cfg = ts_gpt_config_default();
    cfg.vocab_size = th_json_int(c, "vocab_size");
    cfg.block_size = th_json_int(c, "block_size");
    cfg.n_layer = th_json_int(c, "n_layer");
    cfg.n_head = th_json_int(c, "n_head");
    cfg.d_model = th_json_int(c, "d_model");
    cfg.dropout = json_real_value(json_object_get(c, "dropout"));
    cfg.tie_weights = json_is_true(json_object_get(c, "tie_weights"));
    ts_manual_seed((uint64_t)th_json_int(f->group, "seed"));
    ts_module *m;
    TH_OK(ts_gpt_new(&cfg, &m));
    ts_module_train(m, true);
    TH_OK(ts_module_to_dtype(m, TS_BF16));
    return m;
}

/* seq = torch.randint(0, vocab, (B, T + 1)) after manual_seed(input_seed);
 * idx = seq[:, :-1]; targets = seq[:, 1:]; checked bit for bit. */
static void make_batch(const th_half_fx *f, ts_tensor **idx, ts_tensor **targets)
{
    json_t *c = json_object_get(f->group, "config");
    int64_t B = th_json_int(c, "batch"), T = th_json_int(c, "seq"), shape[2] = {B, T + 1};
    ts_manual_seed((uint64_t)th_json_int(f->group, "input_seed"));
    ts_tensor *seq, *v;
    TH_OK(ts_randint(0, th_json_int(c, "vocab_size"), 2, shape, NULL, &seq));
    TH_OK(ts_slice(seq, 1, 0, T, 1, &v));
    TH_OK(ts_contiguous(v, idx));
    ts_tensor_free(v);
    TH_OK(ts_slice(seq, 1, 1, T + 1, 1, &v));
    TH_OK(ts_contiguous(v, targets));
    ts_tensor_free(v);
    ts_tensor_free(seq);
    ts_tensor *ri = fx_tensor(f, "input.idx"), *rt = fx_tensor(f, "input.targets");
    expect_bits("input.idx", *idx, ri);
    expect_bits("input.targets", *targets, rt);
    ts_tensor_free(ri);
    ts_tensor_free(rt);
}

Test(nn_half_parity, gpt_bf16_params_bit_exact)
{
    th_half_fx f;
    th_half_fx_open(&f, "gpt_bf16");
    ts_module *m = build(&f);
    ts_named_params np;
    TH_OK(ts_module_named_parameters(m, &np));
    json_t *names = json_object_get(f.group, "params");
    cr_assert_eq((size_t)np.n, json_array_size(names));
    for (int i = 0; i < np.n; i++) {
        const char *want = json_string_value(json_array_get(names, (size_t)i));
        cr_assert_str_eq(np.items[i].name, want);
        char key[256];
        snprintf(key, sizeof key, "param.%s", want);
        ts_tensor *ref = fx_tensor(&f, key);
        expect_bits(key, *np.items[i].slot, ref);
        ts_tensor_free(ref);
    }
    ts_named_params_free(&np);
    ts_module_free(m);
    th_half_fx_close(&f);
}

Test(nn_half_parity, gpt_bf16_forward_loss_and_gradients)
{
    th_half_fx f;
    th_half_fx_open(&f, "gpt_bf16");
    th_mem_mark();
    ts_module *m = build(&f);
    ts_tensor *idx, *targets, *logits, *l2, *t1, *loss;
    make_batch(&f, &idx, &targets);
    TH_OK(ts_module_call1(m, idx, &logits));
    int64_t V = ts_tensor_size(logits, -1), ls[2] = {-1, V}, tsh[1] = {-1};
    TH_OK(ts_reshape(logits, 2, ls, &l2));
    TH_OK(ts_reshape(targets, 1, tsh, &t1));
    TH_OK(ts_cross_entropy(l2, t1, -100, TS_REDUCTION_MEAN, &loss));
    ts_tensor *ref = fx_tensor(&f, "output");
    expect_close("output", logits, ref, LIMIT_FORWARD, LIMIT_FORWARD_NORM);
    ts_tensor_free(ref);
    ref = fx_tensor(&f, "loss");
    expect_close("loss", loss, ref, LIMIT_FORWARD, LIMIT_FORWARD_NORM);
    ts_tensor_free(ref);
    TH_OK(ts_backward(loss, NULL, false));
    ts_named_params np;
    TH_OK(ts_module_named_parameters(m, &np));
    double worst = 0;
    for (int i = 0; i < np.n; i++) {
        char key[256];
        snprintf(key, sizeof key, "grad.%s", np.items[i].name);
        ts_tensor *g = ts_tensor_grad(*np.items[i].slot);
        cr_assert(g != NULL, "no gradient for %s", np.items[i].name);
        ref = fx_tensor(&f, key);
        worst = fmax(worst, expect_close(key, g, ref, LIMIT_GRAD, LIMIT_GRAD_NORM));
        ts_tensor_free(ref);
    }
    if (verbose()) fprintf(stderr, "  %-40s max err %.2f\n", "all gradients", worst);
    ts_named_params_free(&np);
    ts_tensor_free(loss);
    ts_tensor_free(l2);
    ts_tensor_free(t1);
    ts_tensor_free(logits);
    ts_tensor_free(idx);
    ts_tensor_free(targets);
    ts_module_free(m);
    th_mem_assert_back();
    th_half_fx_close(&f);
}

/* ------------------------------------------------------------ encoder */

/* ||a - b|| / ||b|| over the values of two tensors of the same shape. */
static double norm_rel(ts_tensor *a, ts_tensor *b)
{
    int64_t n = ts_tensor_numel(a);
    cr_assert_eq(n, ts_tensor_numel(b));
    double *x = th_vals_new(a), *y = th_vals_new(b), dd = 0, yy = 0;
    for (int64_t i = 0; i < n; i++) {
        dd += (x[i] - y[i]) * (x[i] - y[i]);
        yy += y[i] * y[i];
    }
    free(x);
    free(y);
    return sqrt(dd / yy);
}

/* A TransformerEncoderLayer (post-norm relu, (T, B, d) layout; pre-norm
 * gelu, batch_first) converted to bf16 / f16 runs forward and backward in
 * that dtype and stays close to the same layer in f32 on the same
 * (rounded) input and cotangent: every op rounds to the dtype once, so
 * the results differ from f32 by the accumulated rounding of about 15
 * ops, as ||d|| / ||ref||. Measured: outputs bf16 3.1e-3, f16 4.9e-4
 * (0.8 and 1.0 unit roundoffs, 2^-8 and 2^-11); gradients bf16 up to
 * 5.8e-2 and f16 2.8e-3 (the largest on linear1 of the post-norm ReLU
 * layer: its gradient comes back through norm2's backward, whose terms
 * cancel, and ReLU's mask, which flips for a pre-activation that rounds
 * across 0). Limits about 2.5 times those; a wrong op is off by O(1). */
Test(nn_half_parity, encoder_layer_in_bf16_and_f16_tracks_f32)
{
    for (int variant = 0; variant < 2; variant++)
        for (int i = 0; i < 2; i++) {
            ts_dtype dt = i ? TS_F16 : TS_BF16;
            double limit = i ? 1.5e-3 : 8e-3, glimit = i ? 7e-3 : 0.15;
            ts_encoder_layer_config cfg = ts_encoder_layer_config_default(8, 2);
            cfg.dim_feedforward = 16;
            cfg.dropout = 0.0;
            cfg.norm_first = variant == 1;
            cfg.gelu = variant == 1;
            cfg.batch_first = variant == 1;
            ts_module *m32, *mh;
            ts_manual_seed(11);
            TH_OK(ts_encoder_layer_new(&cfg, &m32));
            ts_manual_seed(11);
            TH_OK(ts_encoder_layer_new(&cfg, &mh));
            TH_OK(ts_module_to_dtype(mh, dt));
            int64_t xs[3] = {3, 2, 8};
            ts_tensor *x0 = th_seq(TS_F32, 3, xs, 2.0, false), *xh, *x32;
            TH_OK(ts_to_dtype(x0, dt, &xh));
            TH_OK(ts_to_dtype(xh, TS_F32, &x32));
            ts_tensor *y32, *yh;
            TH_OK(ts_module_call1(m32, x32, &y32));
            TH_OK(ts_module_call1(mh, xh, &yh));
            cr_assert_eq(ts_tensor_dtype(yh), dt);
            double r = norm_rel(yh, y32);
            if (verbose()) fprintf(stderr, "  encoder %d %s output norm rel %.2e\n", variant, ts_dtype_name(dt), r);
            cr_assert(r <= limit, "encoder %d %s: output ||d|| / ||ref|| %.3g > %g", variant, ts_dtype_name(dt), r,
                      limit);
            /* backward of sum(y * c) for a fixed cotangent c (in dt, and
             * the same values in f32) */
            ts_tensor *c0 = th_seq(TS_F32, 3, xs, -1.5, false), *ch, *c32;
            TH_OK(ts_to_dtype(c0, dt, &ch));
            TH_OK(ts_to_dtype(ch, TS_F32, &c32));
            TH_OK(ts_backward(y32, c32, false));
            TH_OK(ts_backward(yh, ch, false));
            ts_tensor_free(c0);
            ts_tensor_free(ch);
            ts_tensor_free(c32);
            ts_named_params p32, ph;
            TH_OK(ts_module_named_parameters(m32, &p32));
            TH_OK(ts_module_named_parameters(mh, &ph));
            cr_assert_eq(p32.n, ph.n);
            for (int k = 0; k < ph.n; k++) {
                ts_tensor *g = ts_tensor_grad(*ph.items[k].slot), *gr = ts_tensor_grad(*p32.items[k].slot);
                cr_assert(g != NULL && gr != NULL, "%s: no gradient", ph.items[k].name);
                cr_assert_eq(ts_tensor_dtype(g), dt, "%s: gradient dtype %s", ph.items[k].name,
                             ts_dtype_name(ts_tensor_dtype(g)));
                double rg = norm_rel(g, gr);
                if (verbose())
                    fprintf(stderr, "  encoder %d %s grad %-28s norm rel %.2e\n", variant, ts_dtype_name(dt),
                            ph.items[k].name, rg);
                cr_assert(rg <= glimit, "encoder %d %s: gradient of %s: ||d|| / ||ref|| %.3g > %g", variant,
                          ts_dtype_name(dt), ph.items[k].name, rg, glimit);
            }
            ts_named_params_free(&p32);
            ts_named_params_free(&ph);
            ts_tensor_free(y32);
            ts_tensor_free(yh);
            ts_tensor_free(x0);
            ts_tensor_free(xh);
            ts_tensor_free(x32);
            ts_module_free(m32);
            ts_module_free(mh);
        }
}
