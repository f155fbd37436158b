/* Parity with PyTorch: a 2-layer MLP, a 2-layer TransformerEncoder and a
 * tiny GPT (untied and tied) built here from the seeds PyTorch used must
 * have bit-identical parameters, then give the same forward output, loss,
 * parameter gradients and 10-step AdamW and SGD-momentum loss
 * trajectories. The golden values are tests/fixtures/parity/, written by
 * tools/reference/make_parity.py (twins in tools/reference/models.py;
 * PROVENANCE.md there has the torch version and the exact calls).
 *
 * Tolerances. Parameters and inputs are bit-exact (same generator, same
 * draws, docs/rng.md §9). Everything computed from them is float32 arithmetic in
 * a different order than torch's (this library's BLIS kernel set and
 * blocking versus torch's BLAS calls and ATen kernels, other reduction
 * trees in softmax, layer norm and the losses), so it agrees to rounding
 * only. Each element is checked as
 *
 *     |got - ref| <= rtol * |ref| + rtol * max|ref|
 *
 * with max|ref| the largest magnitude in that tensor. The second term is
 * there because a float32 sum of K terms carries an error of about
 * K * 2^-24 * sum|terms|, set by the size of the terms and not by the
 * size of the result: a gradient element that is a sum of positive and
 * negative contributions cancelling to near zero (the bias of a key
 * projection, whose true gradient is exactly zero, is the extreme case)
 * cannot be held to a relative bound of its own, but it is held to the
 * scale of its tensor. The constants below say how large each rtol is
 * and why. */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/helpers.h"

/* Measured (torch 1.13 fixtures; BLIS skx, haswell and generic kernels):
 * max |got - ref| / max|ref| is at most 2e-7 for outputs and losses and
 * 6e-7 for gradients, i.e. a few float32 ulps (2^-24 = 6e-8) of the
 * tensor's scale; element by element, relative errors reach 4e-5 only on
 * elements much smaller than their tensor (and ~10 on the key-projection
 * bias gradients, whose true value is exactly 0), which the max|ref|
 * term covers. */

/* Forward outputs and losses: the longest chain is the GPT (embedding,
 * 2 x (layer norm, attention with its softmax, GELU MLP), layer norm,
 * head), sums of at most 64 terms, each op adding rounding differences of
 * a few ulps: about 1e-6 of the scale in the worst case. 1e-5 is 50 times
 * what is measured. */
#define RTOL_FORWARD 1e-5
/* Gradients run the chain a second time, backwards (the softmax and
 * layer-norm backward subtract nearly equal quantities, hence the
 * cancellations above): 1e-5 of the scale is still 17 times the worst
 * measured error. */
#define RTOL_GRAD 1e-5
/* Loss trajectories, each value on its own (losses are means of terms of
 * one sign, far from 0): every step feeds the gradient differences above
 * into the parameters, so later losses are computed from slightly
 * different parameters. SGD's effect on the loss is first order in those
 * differences (lr times a gradient 6e-7 off); Adam divides by
 * sqrt(v) and so turns rounding noise on a gradient element near zero
 * into an update of up to +-lr; in exact arithmetic the only such
 * elements here are the key-projection biases, which do not change the
 * loss at all, and any other one moves the loss only to second order.
 * Measured with optim/optim.c: at most 2.7e-7 relative over the 11
 * values, for both optimizers and the three kernel sets. 1e-5 keeps a
 * margin of 37 and must stay this tight to mean something: a wrong update
 * rule moves these losses by only 1e-4 to 3e-4 relative in the first
 * steps (measured with deliberately broken scratch optimizers: AdamW
 * without the decoupled weight decay, eps inside the square root, SGD's
 * momentum buffer not started from the first gradient). */
#define RTOL_TRAJECTORY 1e-5

#define STEPS 10
#define MAX_TENSORS 128

/* ------------------------------------------------------------ fixtures */

typedef struct fixture {
    json_t *root;
    json_t *model; /* borrowed from root */
    uint8_t *blob;
    size_t len;
} fixture;

static json_t *fx_model_of(json_t *root, const char *name)
{
    json_t *models = json_object_get(root, "models"), *m;
    size_t i;
    json_array_foreach(models, i, m)
    {
        if (!strcmp(json_string_value(json_object_get(m, "name")), name)) return m;
    }
    return NULL;
}

static void fx_open(fixture *f, const char *name)
{
    char path[1024];
    json_error_t err;
    snprintf(path, sizeof path, "%s/parity/index.json", TS_FIXTURES_DIR);
    f->root = json_load_file(path, 0, &err);
    cr_assert(f->root != NULL, "%s:%d: %s", path, err.line, err.text);
    f->model = fx_model_of(f->root, name);
    cr_assert(f->model != NULL, "no model '%s' in %s", name, path);
    snprintf(path, sizeof path, "%s/parity/%s", TS_FIXTURES_DIR, json_string_value(json_object_get(f->model, "file")));
    f->blob = th_read_file(path, &f->len);
}

static void fx_close(fixture *f)
{
    json_decref(f->root);
    free(f->blob);
}

static json_t *fx_config(const fixture *f) { return json_object_get(f->model, "config"); }

/* The tensor entry `name`, or NULL. */
static json_t *fx_entry(const fixture *f, const char *name)
{
    json_t *ts = json_object_get(f->model, "tensors"), *e;
    size_t i;
    json_array_foreach(ts, i, e)
    {
        if (!strcmp(json_string_value(json_object_get(e, "name")), name)) return e;
    }
    return NULL;
}

/* Shape, dtype and bytes of tensor `name` (asserted present and inside
 * the blob); returns the bytes. */
static const void *fx_raw(const fixture *f, const char *name, ts_dtype *dtype, int *ndim, int64_t *shape,
                          size_t *nbytes)
{
    json_t *e = fx_entry(f, name), *dim;
    cr_assert(e != NULL, "fixture has no tensor '%s'", name);
    const char *dt = json_string_value(json_object_get(e, "dtype"));
    *dtype = !strcmp(dt, "int64") ? TS_I64 : TS_F32;
    json_t *sh = json_object_get(e, "shape");
    size_t i;
    *ndim = (int)json_array_size(sh);
    cr_assert(*ndim <= TS_MAX_DIMS);
    size_t numel = 1;
    json_array_foreach(sh, i, dim)
    {
        shape[i] = (int64_t)json_integer_value(dim);
        numel *= (size_t)shape[i];
    }
    int64_t off = th_json_int(e, "offset");
    *nbytes = (size_t)th_json_int(e, "nbytes");
    cr_assert_eq(*nbytes, numel * ts_dtype_size(*dtype), "fixture tensor '%s': size mismatch", name);
    cr_assert(off >= 0 && (size_t)off + *nbytes <= f->len, "fixture tensor '%s' lies outside the file", name);
    return f->blob + off;
}

/* ------------------------------------------------------------ comparisons */

static bool verbose(void) { return getenv("TS_PARITY_VERBOSE") != NULL; }

/* Asserts `got` equals fixture tensor `name` bit for bit (shape, dtype,
 * bytes). */
static void expect_bits(const fixture *f, const char *name, const ts_tensor *got)
{
    ts_dtype dt;
    int nd;
    int64_t shape[TS_MAX_DIMS];
    size_t nb;
    const void *ref = fx_raw(f, name, &dt, &nd, shape, &nb);
    char s[96];
    cr_assert_eq(ts_tensor_dtype(got), dt, "%s: dtype %s", name, ts_dtype_name(ts_tensor_dtype(got)));
    cr_assert_eq(ts_tensor_ndim(got), nd, "%s: shape %s", name, ts_tensor_shape_str(got, s, sizeof s));
    for (int i = 0; i < nd; i++)
        cr_assert_eq(ts_tensor_shape(got)[i], shape[i], "%s: shape %s", name, ts_tensor_shape_str(got, s, sizeof s));
    void *buf = malloc(nb ? nb : 1);
    TH_OK(ts_tensor_copy_to(got, buf, nb));
    int64_t first = -1;
    for (size_t i = 0; i < nb && first < 0; i++)
        if (((const uint8_t *)buf)[i] != ((const uint8_t *)ref)[i]) first = (int64_t)(i / ts_dtype_size(dt));
    free(buf);
    cr_assert_eq(first, -1, "%s (%s) differs from PyTorch's from element %lld on", name,
                 f->model ? json_string_value(json_object_get(f->model, "name")) : "", (long long)first);
}

typedef struct errs {
    double rel;    /* max |got - ref| / |ref| over elements with ref != 0 */
    double scaled; /* max |got - ref| / max|ref| */
} errs;

/* Checks n float32 values against ref: |got - ref| <= rtol*|ref| +
 * rtol*max|ref| (see the top of the file). Returns the errors seen. */
static errs expect_close_f32(const char *what, const float *got, const float *ref, int64_t n, double rtol)
{
    double scale = 0;
    for (int64_t i = 0; i < n; i++) scale = fmax(scale, fabs((double)ref[i]));
    errs e = {0, 0};
    int64_t bad = -1;
    for (int64_t i = 0; i < n; i++) {
        double g = got[i], r = ref[i], d = fabs(g - r);
        if (!(d <= rtol * fabs(r) + rtol * scale) && bad < 0) bad = i;
        if (r != 0) e.rel = fmax(e.rel, d / fabs(r));
        if (scale > 0) e.scaled = fmax(e.scaled, d / scale);
        if (isnan(g)) e.rel = e.scaled = INFINITY;
    }
    if (verbose())
        fprintf(stderr, "  %-44s n %5lld  max rel %.2e  max err/max|ref| %.2e\n", what, (long long)n, e.rel, e.scaled);
    cr_assert_eq(bad, -1, "%s: element %lld is %.9g, PyTorch %.9g (rtol %g, max|ref| %.6g; max rel err %.3g)", what,
                 (long long)bad, bad >= 0 ? got[bad] : 0.0, bad >= 0 ? ref[bad] : 0.0, rtol, scale, e.rel);
    return e;
}

/* Checks `got` (float32) against fixture tensor `name`. */
static errs expect_close(const fixture *f, const char *label, const char *name, const ts_tensor *got, double rtol)
{
    ts_dtype dt;
    int nd;
    int64_t shape[TS_MAX_DIMS];
    size_t nb;
    const float *ref = fx_raw(f, name, &dt, &nd, shape, &nb);
    char s[96], what[160];
    snprintf(what, sizeof what, "%s %s", label, name);
    cr_assert_eq(ts_tensor_dtype(got), TS_F32, "%s: dtype %s", what, ts_dtype_name(ts_tensor_dtype(got)));
    cr_assert_eq(ts_tensor_ndim(got), nd, "%s: shape %s", what, ts_tensor_shape_str(got, s, sizeof s));
    for (int i = 0; i < nd; i++)
        cr_assert_eq(ts_tensor_shape(got)[i], shape[i], "%s: shape %s", what, ts_tensor_shape_str(got, s, sizeof s));
    float *buf = malloc(nb ? nb : 1);
    TH_OK(ts_tensor_copy_to(got, buf, nb));
    errs e = expect_close_f32(what, buf, ref, (int64_t)(nb / sizeof(float)), rtol);
    free(buf);
    return e;
}

/* ------------------------------------------------------------ models */

/* Builds the fixture's model after ts_manual_seed(seed), in train mode
 * (as the fixtures were made; every dropout is 0). */
static ts_module *build(const fixture *f)
{
    json_t *c = fx_config(f);
    const char *kind = json_string_value(json_object_get(c, "kind"));
    ts_module *m = NULL;
    ts_manual_seed((uint64_t)th_json_int(f->model, "seed"));
    if (!strcmp(kind, "mlp")) {
        json_t *sz = json_object_get(c, "sizes");
        int64_t a = (int64_t)json_integer_value(json_array_get(sz, 0));
        int64_t b = (int64_t)json_integer_value(json_array_get(sz, 1));
        int64_t o = (int64_t)json_integer_value(json_array_get(sz, 2));
        ts_module *kids[3];
        TH_OK(ts_linear_new(a, b, true, &kids[0]));
        TH_OK(ts_relu_new(&kids[1]));
        TH_OK(ts_linear_new(b, o, true, &kids[2]));
        TH_OK(ts_sequential_new(3, kids, &m));
    } else if (!strcmp(kind, "encoder")) {
        ts_encoder_layer_config cfg =
            ts_encoder_layer_config_default(th_json_int(c, "d_model"), th_json_int(c, "nhead"));
        cfg.dim_feedforward = th_json_int(c, "dim_feedforward");
        cfg.dropout = 0.0;
        cfg.norm_first = json_is_true(json_object_get(c, "norm_first"));
        cfg.gelu = json_is_true(json_object_get(c, "gelu"));
        cfg.batch_first = true; /* the fixtures' layers are batch_first=True, inputs (B, T, d) */
        TH_OK(ts_transformer_encoder_new(&cfg, (int)th_json_int(c, "num_layers"), &m));
    } else if (!strcmp(kind, "gpt")) {
        ts_gpt_config cfg = ts_gpt_config_default();
        cfg.vocab_size = th_json_int(c, "vocab_size");
        cfg.block_size = th_json_int(c, "block_size");
        cfg.n_layer = th_json_int(c, "n_layer");
        cfg.n_head = th_json_int(c, "n_head");
        cfg.d_model = th_json_int(c, "d_model");
        cfg.dropout = json_real_value(json_object_get(c, "dropout"));
        cfg.tie_weights = json_is_true(json_object_get(c, "tie_weights"));
        TH_OK(ts_gpt_new(&cfg, &m));
    } else {
        cr_assert_fail("unknown model kind '%s'", kind);
    }
    ts_module_train(m, true);
    return m;
}

static bool is_gpt(const fixture *f)
{
    return !strcmp(json_string_value(json_object_get(fx_config(f), "kind")), "gpt");
}

typedef struct batch {
    ts_tensor *x, *target;
} batch;

/* Draws the inputs here after ts_manual_seed(input_seed), as the script
 * did, checks them bit for bit against the recorded ones and returns
 * them. */
static batch make_batch(const fixture *f)
{
    batch b = {0};
    ts_manual_seed((uint64_t)th_json_int(f->model, "input_seed"));
    if (is_gpt(f)) {
        /* seq = torch.randint(0, vocab, (B, T + 1)); idx = seq[:, :-1]; targets = seq[:, 1:] */
        json_t *c = fx_config(f);
        int64_t B = th_json_int(c, "batch"), T = th_json_int(c, "seq"), shape[2] = {B, T + 1};
        ts_tensor *seq, *v;
        TH_OK(ts_randint(0, th_json_int(c, "vocab_size"), 2, shape, NULL, &seq));
        TH_OK(ts_slice(seq, 1, 0, T, 1, &v));
        TH_OK(ts_contiguous(v, &b.x));
        ts_tensor_free(v);
        TH_OK(ts_slice(seq, 1, 1, T + 1, 1, &v));
        TH_OK(ts_contiguous(v, &b.target));
        ts_tensor_free(v);
        ts_tensor_free(seq);
        expect_bits(f, "input.idx", b.x);
        expect_bits(f, "input.targets", b.target);
    } else {
        /* x = torch.randn(...); target = torch.randn(...) */
        ts_dtype dt;
        int nd;
        int64_t shape[TS_MAX_DIMS];
        size_t nb;
        fx_raw(f, "input.x", &dt, &nd, shape, &nb);
        TH_OK(ts_randn(TS_F32, nd, shape, NULL, &b.x));
        fx_raw(f, "input.target", &dt, &nd, shape, &nb);
        TH_OK(ts_randn(TS_F32, nd, shape, NULL, &b.target));
        expect_bits(f, "input.x", b.x);
        expect_bits(f, "input.target", b.target);
    }
    return b;
}

static void batch_free(batch *b)
{
    ts_tensor_free(b->x);
    ts_tensor_free(b->target);
}

/* Forward and loss: MLP and encoder mse_loss(m(x), target); GPT
 * cross_entropy(logits.view(-1, V), targets.view(-1)). *out_out (may be
 * NULL) receives the model output. */
static ts_tensor *run(const fixture *f, ts_module *m, const batch *b, ts_tensor **out_out)
{
    ts_tensor *out, *loss;
    TH_OK(ts_module_call1(m, b->x, &out));
    if (is_gpt(f)) {
        int64_t V = ts_tensor_size(out, -1), ls[2] = {-1, V}, ts[1] = {-1};
        ts_tensor *l2, *t1;
        TH_OK(ts_reshape(out, 2, ls, &l2));
        TH_OK(ts_reshape(b->target, 1, ts, &t1));
        TH_OK(ts_cross_entropy(l2, t1, -100, TS_REDUCTION_MEAN, &loss));
        ts_tensor_free(l2);
        ts_tensor_free(t1);
    } else {
        TH_OK(ts_mse_loss(out, b->target, TS_REDUCTION_MEAN, &loss));
    }
    if (out_out) *out_out = out;
    else ts_tensor_free(out);
    return loss;
}

/* ------------------------------------------------------------ checks */

/* Same names, in the same order, same shapes, same bits. */
static void check_params(const fixture *f, ts_module *m)
{
    ts_named_params np;
    TH_OK(ts_module_named_parameters(m, &np));
    json_t *names = json_object_get(f->model, "params");
    cr_assert_eq((size_t)np.n, json_array_size(names), "%d parameters here, PyTorch has %zu", np.n,
                 json_array_size(names));
    for (int i = 0; i < np.n; i++) {
        const char *want = json_string_value(json_array_get(names, (size_t)i));
        cr_assert_str_eq(np.items[i].name, want, "parameter %d is '%s' here, '%s' in PyTorch", i, np.items[i].name,
                         want);
        char key[256];
        snprintf(key, sizeof key, "param.%s", want);
        expect_bits(f, key, *np.items[i].slot);
    }
    ts_named_params_free(&np);
}

static void test_params_bit_exact(const char *name)
{
    fixture f;
    fx_open(&f, name);
    ts_module *m = build(&f);
    check_params(&f, m);
    batch b = make_batch(&f); /* inputs bit-exact too */
    batch_free(&b);
    ts_module_free(m);
    fx_close(&f);
}

static void test_forward_backward(const char *name)
{
    fixture f;
    fx_open(&f, name);
    if (verbose()) fprintf(stderr, "%s:\n", name);
    th_mem_mark();
    ts_module *m = build(&f);
    batch b = make_batch(&f);
    ts_tensor *out, *loss = run(&f, m, &b, &out);
    expect_close(&f, name, "output", out, RTOL_FORWARD);
    expect_close(&f, name, "loss", loss, RTOL_FORWARD);
    TH_OK(ts_backward(loss, NULL, false));
    ts_named_params np;
    TH_OK(ts_module_named_parameters(m, &np));
    errs worst = {0, 0};
    for (int i = 0; i < np.n; i++) {
        char key[256];
        snprintf(key, sizeof key, "grad.%s", np.items[i].name);
        ts_tensor *g = ts_tensor_grad(*np.items[i].slot);
        cr_assert(g != NULL, "%s: no gradient for %s", name, np.items[i].name);
        errs e = expect_close(&f, name, key, g, RTOL_GRAD);
        worst.rel = fmax(worst.rel, e.rel);
        worst.scaled = fmax(worst.scaled, e.scaled);
    }
    if (verbose())
        fprintf(stderr, "  %-44s max rel %.2e  max err/max|ref| %.2e\n", "all gradients", worst.rel, worst.scaled);
    ts_named_params_free(&np);
    ts_tensor_free(out);
    ts_tensor_free(loss);
    batch_free(&b);
    ts_module_free(m);
    th_mem_assert_back();
    fx_close(&f);
}

typedef enum opt_kind { OPT_ADAMW, OPT_SGD } opt_kind;

/* 10 steps on the same batch from the freshly built model: losses[k] is
 * the loss after k steps (k = 0..10), as the script records them. */
static void test_trajectory(const char *name, opt_kind kind)
{
    fixture f;
    fx_open(&f, name);
    ts_module *m = build(&f);
    batch b = make_batch(&f);
    ts_named_params np;
    TH_OK(ts_module_named_parameters(m, &np)); /* a tied weight once, as PyTorch's parameters() */
    cr_assert(np.n <= MAX_TENSORS);
    ts_tensor *params[MAX_TENSORS];
    for (int i = 0; i < np.n; i++) params[i] = *np.items[i].slot;
    ts_optim *o;
    if (kind == OPT_ADAMW) {
        ts_adam_options ao = ts_adamw_options_default(); /* betas 0.9/0.999, eps 1e-8, weight_decay 1e-2 */
        ao.lr = 1e-2;
        TH_OK(ts_adamw_new(np.n, params, &ao, &o));
    } else {
        ts_sgd_options so = ts_sgd_options_default();
        so.lr = 0.05;
        so.momentum = 0.9;
        TH_OK(ts_sgd_new(np.n, params, &so, &o));
    }
    float losses[STEPS + 1];
    for (int k = 0; k < STEPS; k++) {
        ts_optim_zero_grad(o, true);
        ts_tensor *loss = run(&f, m, &b, NULL);
        double v;
        TH_OK(ts_tensor_item(loss, &v));
        losses[k] = (float)v;
        TH_OK(ts_backward(loss, NULL, false));
        ts_tensor_free(loss);
        TH_OK(ts_optim_step(o));
    }
    bool prev = ts_grad_mode_set(false);
    ts_tensor *loss = run(&f, m, &b, NULL);
    ts_grad_mode_set(prev);
    double v;
    TH_OK(ts_tensor_item(loss, &v));
    losses[STEPS] = (float)v;
    ts_tensor_free(loss);
    cr_assert_eq(ts_optim_step_count(o), STEPS);

    const char *key = kind == OPT_ADAMW ? "adamw_losses" : "sgd_losses";
    ts_dtype dt;
    int nd;
    int64_t shape[TS_MAX_DIMS];
    size_t nb;
    const float *ref = fx_raw(&f, key, &dt, &nd, shape, &nb);
    cr_assert_eq(nb, sizeof losses);
    /* Per value, not against the largest: every loss is a mean of many
     * terms of one sign (squares; -log p), far from zero. */
    char what[96];
    snprintf(what, sizeof what, "%s %s", name, key);
    double rel = 0;
    for (int k = 0; k <= STEPS; k++) {
        double d = fabs((double)losses[k] - ref[k]) / fabs((double)ref[k]);
        rel = fmax(rel, d);
        cr_assert(d <= RTOL_TRAJECTORY, "%s: after %d steps the loss is %.9g, PyTorch %.9g (rel err %.3g > %g)", what,
                  k, losses[k], ref[k], d, RTOL_TRAJECTORY);
    }
    if (verbose()) fprintf(stderr, "%-46s max rel %.2e (%.7g -> %.7g)\n", what, rel, losses[0], losses[STEPS]);
    ts_optim_free(o);
    ts_named_params_free(&np);
    batch_free(&b);
    ts_module_free(m);
    fx_close(&f);
}

/* ------------------------------------------------------------ cases */

Test(nn_parity, mlp_params_bit_exact) { test_params_bit_exact("mlp"); }
Test(nn_parity, mlp_forward_backward) { test_forward_backward("mlp"); }
Test(nn_parity, mlp_adamw_trajectory) { test_trajectory("mlp", OPT_ADAMW); }
Test(nn_parity, mlp_sgd_trajectory) { test_trajectory("mlp", OPT_SGD); }

Test(nn_parity, encoder_params_bit_exact) { test_params_bit_exact("encoder"); }
Test(nn_parity, encoder_forward_backward) { test_forward_backward("encoder"); }
Test(nn_parity, encoder_adamw_trajectory) { test_trajectory("encoder", OPT_ADAMW); }
Test(nn_parity, encoder_sgd_trajectory) { test_trajectory("encoder", OPT_SGD); }
Test(nn_parity, encoder_prenorm_gelu_params_bit_exact) { test_params_bit_exact("encoder_prenorm_gelu"); }
Test(nn_parity, encoder_prenorm_gelu_forward_backward) { test_forward_backward("encoder_prenorm_gelu"); }
Test(nn_parity, encoder_prenorm_gelu_adamw_trajectory) { test_trajectory("encoder_prenorm_gelu", OPT_ADAMW); }
Test(nn_parity, encoder_prenorm_gelu_sgd_trajectory) { test_trajectory("encoder_prenorm_gelu", OPT_SGD); }

Test(nn_parity, gpt_params_bit_exact) { test_params_bit_exact("gpt"); }
Test(nn_parity, gpt_forward_backward) { test_forward_backward("gpt"); }
Test(nn_parity, gpt_adamw_trajectory) { test_trajectory("gpt", OPT_ADAMW); }
Test(nn_parity, gpt_sgd_trajectory) { test_trajectory("gpt", OPT_SGD); }

Test(nn_parity, gpt_tied_params_bit_exact) { test_params_bit_exact("gpt_tied"); }
Test(nn_parity, gpt_tied_forward_backward) { test_forward_backward("gpt_tied"); }
Test(nn_parity, gpt_tied_adamw_trajectory) { test_trajectory("gpt_tied", OPT_ADAMW); }
Test(nn_parity, gpt_tied_sgd_trajectory) { test_trajectory("gpt_tied", OPT_SGD); }
