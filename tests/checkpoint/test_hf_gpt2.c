/* Hugging Face GPT-2 files (checkpoint/hf_gpt2.c; docs/gpt2-weights.md)
 * against tests/fixtures/hf_gpt2/, written by
 * tools/reference/make_hf_gpt2.py (torch 1.13, HF's GPT-2 module written
 * from the published architecture): our GPT's logits are HF's, a load
 * then an export gives the file back byte for byte, sharded and deferred
 * models load the same, and bad files are refused with the tensor named. */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "checkpoint/checkpoint.h"
#include "tests/loopback_ranks.h"

#define FIX TS_FIXTURES_DIR "/hf_gpt2/"
#define MODEL FIX "model.safetensors"
#define HEADS 4 /* the fixture's: the head count is not in the weights */

/* The fixture's config, with its head count. */
static ts_gpt_config fixture_config(void)
{
    ts_gpt_config c;
    TH_OK(ts_ckpt_gpt2_config(MODEL, &c));
    c.n_head = HEADS;
    return c;
}

static ts_module *gpt_new(const ts_gpt_config *c)
{
    ts_module *m = NULL;
    TH_OK(ts_gpt_new(c, &m));
    return m;
}

/* logits of m on ids (no grad); the caller frees them */
static ts_status logits_of(ts_module *m, ts_tensor *ids, ts_tensor **out)
{
    bool prev = ts_grad_mode_set(false);
    ts_status st = ts_module_call1(m, ids, out);
    ts_grad_mode_set(prev);
    return st;
}

static float max_abs_diff(const ts_tensor *a, const ts_tensor *b)
{
    const float *x = ts_tensor_data(a), *y = ts_tensor_data(b);
    float m = 0;
    for (int64_t i = 0; i < ts_tensor_numel(a); i++) m = fmaxf(m, fabsf(x[i] - y[i]));
    return m;
}

/* the plain model loaded from path, and its logits on the fixture's ids */
static ts_tensor *plain_logits(const char *path, const ts_gpt_config *c, ts_state_dict *fx)
{
    ts_module *m = gpt_new(c);
    TH_OK(ts_ckpt_load_hf_gpt2(path, m));
    ts_tensor *y = NULL;
    TH_OK(logits_of(m, ts_state_dict_get(fx, "ids"), &y));
    ts_module_free(m);
    return y;
}

Test(checkpoint_hf_gpt2, config_from_the_file)
{
    ts_gpt_config c;
    TH_OK(ts_ckpt_gpt2_config(MODEL, &c));
    cr_assert_eq(c.vocab_size, 300);
    cr_assert_eq(c.block_size, 32);
    cr_assert_eq(c.n_layer, 2);
    cr_assert_eq(c.d_model, 64);
    cr_assert_eq(c.n_head, 1, "d_model / 64, GPT-2's head size: %lld", (long long)c.n_head);
    cr_assert(c.tie_weights, "no lm_head.weight in the file: tied");
    cr_assert_eq(c.gelu_approx, TS_GELU_TANH);
    cr_assert_eq(ts_ckpt_gpt2_config(FIX "nope.safetensors", &c), TS_ERR_IO);
    cr_assert(strstr(ts_last_error(), "nope.safetensors"), "%s", ts_last_error());
}

/* Our GPT computes HF's function: the logits of HF's module (torch) on
 * the fixture's ids. 1e-5: float32 sums in another order (matmul
 * blocking, layer-norm and softmax reductions) over logits up to 5.8;
 * erf's GELU instead of the tanh approximation is off by 1.4e-3
 * (make_hf_gpt2.py checks that). */
Test(checkpoint_hf_gpt2, logits_equal_hf_module)
{
    ts_gpt_config c = fixture_config();
    ts_state_dict *fx = NULL;
    TH_OK(ts_safetensors_load(FIX "logits.safetensors", &fx));
    ts_tensor *y = plain_logits(MODEL, &c, fx), *want = ts_state_dict_get(fx, "logits");
    cr_assert_eq(ts_tensor_numel(y), ts_tensor_numel(want));
    float d = max_abs_diff(y, want);
    cr_assert(d <= 1e-5f, "logits differ from HF's by %g", (double)d);
    ts_tensor_free(y);
    ts_state_dict_free(fx);
}

/* The GELU must be GPT-2's: a model with erf's is refused, not loaded
 * into a different function. */
Test(checkpoint_hf_gpt2, erf_gelu_model_refused)
{
    ts_gpt_config c = fixture_config();
    c.gelu_approx = TS_GELU_NONE;
    ts_module *m = gpt_new(&c);
    cr_assert_eq(ts_ckpt_load_hf_gpt2(MODEL, m), TS_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(ts_last_error(), "TS_GELU_TANH"), "%s", ts_last_error());
    ts_module_free(m);
    ts_module *lin = NULL;
    TH_OK(ts_linear_new(2, 2, true, &lin));
    cr_assert_eq(ts_ckpt_load_hf_gpt2(MODEL, lin), TS_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(ts_last_error(), "not a GPT"), "%s", ts_last_error());
    ts_module_free(lin);
}

static void assert_same_file(const char *a, const char *b)
{
    size_t la = 0, lb = 0;
    char *x = th_read_file(a, &la), *y = th_read_file(b, &lb);
    cr_assert_eq(la, lb, "%s has %zu bytes, %s %zu", a, la, b, lb);
    size_t i = 0;
    while (i < la && x[i] == y[i]) i++;
    cr_assert_eq(i, la, "%s and %s differ first at byte %zu", a, b, i);
    free(x);
    free(y);
}

/* load, then export: the same bytes (names, order, layouts, metadata) */
Test(checkpoint_hf_gpt2, load_then_export_is_byte_for_byte)
{
    char *dir = th_tmp_dir("ts_hf_gpt2"), out[600];
    snprintf(out, sizeof out, "%s/back.safetensors", dir);
    ts_gpt_config c = fixture_config();
    ts_module *m = gpt_new(&c);
    TH_OK(ts_ckpt_load_hf_gpt2(MODEL, m));
    TH_OK(ts_ckpt_save_hf_gpt2(out, m));
    assert_same_file(MODEL, out);
    ts_module_free(m);
    th_rm_rf(dir);
    free(dir);
}

/* An untied model: lm_head comes from wte (HF ties them); its export has
 * GPT2LMHeadModel's names and lm_head.weight, and loads back the same. */
Test(checkpoint_hf_gpt2, untied_model_round_trip)
{
    char *dir = th_tmp_dir("ts_hf_gpt2"), out[600];
    snprintf(out, sizeof out, "%s/untied.safetensors", dir);
    ts_gpt_config c = fixture_config();
    c.tie_weights = false;
    ts_state_dict *fx = NULL;
    TH_OK(ts_safetensors_load(FIX "logits.safetensors", &fx));
    ts_module *m = gpt_new(&c);
    TH_OK(ts_ckpt_load_hf_gpt2(MODEL, m));
    ts_tensor *y = NULL, *y2 = NULL;
    TH_OK(logits_of(m, ts_state_dict_get(fx, "ids"), &y));
    cr_assert(max_abs_diff(y, ts_state_dict_get(fx, "logits")) <= 1e-5f);
    TH_OK(ts_ckpt_save_hf_gpt2(out, m));
    ts_state_dict *back = NULL;
    TH_OK(ts_safetensors_load(out, &back));
    cr_assert(ts_state_dict_get(back, "lm_head.weight") && ts_state_dict_get(back, "transformer.wte.weight"));
    cr_assert_null(ts_state_dict_get(back, "wte.weight"));
    ts_gpt_config c2;
    TH_OK(ts_ckpt_gpt2_config(out, &c2));
    cr_assert(!c2.tie_weights, "the file has lm_head.weight");
    ts_module *m2 = gpt_new(&c);
    TH_OK(ts_ckpt_load_hf_gpt2(out, m2));
    TH_OK(logits_of(m2, ts_state_dict_get(fx, "ids"), &y2));
    cr_assert_eq(max_abs_diff(y, y2), 0.0f);
    ts_tensor_free(y);
    ts_tensor_free(y2);
    ts_state_dict_free(back);
    ts_state_dict_free(fx);
    ts_module_free(m);
    ts_module_free(m2);
    th_rm_rf(dir);
    free(dir);
}

/* ------------------------------------------------------------ variants of the fixture */

/* The fixture's tensors, renamed with prefix, edited by edit (may be
 * NULL), written to path. */
typedef void (*edit_fn)(ts_state_dict *sd);

static void write_variant(const char *path, const char *prefix, edit_fn edit)
{
    ts_state_dict *sd = NULL, *out = NULL;
    TH_OK(ts_safetensors_load(MODEL, &sd));
    TH_OK(ts_state_dict_new(&out));
    for (int i = 0; i < ts_state_dict_size(sd); i++) {
        char name[200];
        snprintf(name, sizeof name, "%s%s", prefix, ts_state_dict_name(sd, i));
        TH_OK(ts_state_dict_set(out, name, ts_state_dict_tensor(sd, i)));
    }
    if (edit) edit(out);
    const char *meta[2] = {"format", "pt"};
    TH_OK(ts_safetensors_save(path, out, meta, 1));
    ts_state_dict_free(sd);
    ts_state_dict_free(out);
}

/* GPT2LMHeadModel's naming, with the causal-mask buffers older
 * transformers saved and a tied lm_head.weight: the same logits. */
static void add_buffers_and_head(ts_state_dict *sd)
{
    for (int l = 0; l < 2; l++) {
        char name[100];
        int64_t s[4] = {1, 1, 32, 32}, one = 1;
        ts_tensor *mask = NULL, *mb = NULL;
        TH_OK(ts_tensor_ones(TS_F32, 4, s, &mask));
        TH_OK(ts_tensor_zeros(TS_F32, 0, &one, &mb));
        snprintf(name, sizeof name, "transformer.h.%d.attn.bias", l);
        TH_OK(ts_state_dict_set(sd, name, mask));
        snprintf(name, sizeof name, "transformer.h.%d.attn.masked_bias", l);
        TH_OK(ts_state_dict_set(sd, name, mb));
        ts_tensor_free(mask);
        ts_tensor_free(mb);
    }
    TH_OK(ts_state_dict_set(sd, "lm_head.weight", ts_state_dict_get(sd, "transformer.wte.weight")));
}

Test(checkpoint_hf_gpt2, prefixed_names_buffers_and_tied_head)
{
    char *dir = th_tmp_dir("ts_hf_gpt2"), path[600];
    snprintf(path, sizeof path, "%s/lmhead.safetensors", dir);
    write_variant(path, "transformer.", add_buffers_and_head);
    ts_gpt_config c = fixture_config(), c2;
    TH_OK(ts_ckpt_gpt2_config(path, &c2));
    cr_assert_eq(c2.n_layer, 2);
    ts_state_dict *fx = NULL;
    TH_OK(ts_safetensors_load(FIX "logits.safetensors", &fx));
    ts_tensor *a = plain_logits(MODEL, &c, fx), *b = plain_logits(path, &c, fx);
    cr_assert_eq(max_abs_diff(a, b), 0.0f);
    ts_tensor_free(a);
    ts_tensor_free(b);
    ts_state_dict_free(fx);
    th_rm_rf(dir);
    free(dir);
}

/* ------------------------------------------------------------ bad files */

/* the fixture with one tensor replaced by t (a new name or the same) */
static ts_state_dict *fixture_with(const char *drop, const char *name, ts_tensor *t)
{
    ts_state_dict *sd = NULL, *out = NULL;
    TH_OK(ts_safetensors_load(MODEL, &sd));
    TH_OK(ts_state_dict_new(&out));
    for (int i = 0; i < ts_state_dict_size(sd); i++)
        if (!drop || strcmp(ts_state_dict_name(sd, i), drop) != 0)
            TH_OK(ts_state_dict_set(out, ts_state_dict_name(sd, i), ts_state_dict_tensor(sd, i)));
    if (name) TH_OK(ts_state_dict_set(out, name, t));
    ts_state_dict_free(sd);
    return out;
}

/* The model's values, to check that a refused load changed nothing. */
static ts_tensor *param_copy(ts_module *m, const char *name)
{
    ts_state_dict *sd = NULL;
    TH_OK(ts_module_state_dict(m, &sd));
    ts_tensor *c = NULL;
    TH_OK(ts_clone(ts_state_dict_get(sd, name), &c));
    ts_state_dict_free(sd);
    return c;
}

static void expect_refused(const char *dir, ts_state_dict *bad, ts_status want, const char *const *needles, int n)
{
    char path[600];
    snprintf(path, sizeof path, "%s/bad.safetensors", dir);
    TH_OK(ts_safetensors_save(path, bad, NULL, 0));
    ts_state_dict_free(bad);
    ts_gpt_config c = fixture_config();
    ts_module *m = gpt_new(&c);
    ts_tensor *before = param_copy(m, "blocks.0.attn.in_proj_weight");
    ts_status st = ts_ckpt_load_hf_gpt2(path, m);
    cr_assert_eq(st, want, "got %s: %s", ts_status_name(st), ts_last_error());
    for (int i = 0; i < n; i++)
        cr_assert(strstr(ts_last_error(), needles[i]), "'%s' not in: %s", needles[i], ts_last_error());
    ts_tensor *after = param_copy(m, "blocks.0.attn.in_proj_weight");
    cr_assert_eq(max_abs_diff(before, after), 0.0f, "a refused load changed the model");
    ts_tensor_free(before);
    ts_tensor_free(after);
    ts_module_free(m);
}

Test(checkpoint_hf_gpt2, bad_files_name_the_tensor)
{
    char *dir = th_tmp_dir("ts_hf_gpt2");
    /* a missing tensor */
    const char *miss[] = {"missing tensors", "'h.1.mlp.c_fc.bias'"};
    expect_refused(dir, fixture_with("h.1.mlp.c_fc.bias", NULL, NULL), TS_ERR_NOT_FOUND, miss, 2);
    /* a wrong shape: c_attn stored as a Linear would store it (3d, d) */
    int64_t s[2] = {192, 64};
    ts_tensor *t = NULL;
    TH_OK(ts_tensor_zeros(TS_F32, 2, s, &t));
    const char *shape[] = {"'h.0.attn.c_attn.weight' is (192, 64) in the file, the model expects (64, 192)"};
    expect_refused(dir, fixture_with(NULL, "h.0.attn.c_attn.weight", t), TS_ERR_SHAPE, shape, 1);
    ts_tensor_free(t);
    /* a wrong dtype */
    int64_t b[1] = {64};
    TH_OK(ts_tensor_zeros(TS_F64, 1, b, &t));
    const char *dt[] = {"'ln_f.bias' is F64"};
    expect_refused(dir, fixture_with(NULL, "ln_f.bias", t), TS_ERR_DTYPE, dt, 1);
    ts_tensor_free(t);
    /* another layer count: a third block the model has no place for */
    TH_OK(ts_tensor_zeros(TS_F32, 1, b, &t));
    const char *extra[] = {"unexpected tensors: 'h.2.ln_1.weight'", "3 layers"};
    expect_refused(dir, fixture_with(NULL, "h.2.ln_1.weight", t), TS_ERR_NOT_FOUND, extra, 2);
    ts_tensor_free(t);
    /* not a GPT-2 file */
    const char *nowte[] = {"not a Hugging Face GPT-2 file"};
    expect_refused(dir, fixture_with("wte.weight", NULL, NULL), TS_ERR_NOT_FOUND, nowte, 1);
    /* a tied model, and a file whose lm_head is not wte */
    int64_t hs[2] = {300, 64};
    TH_OK(ts_tensor_zeros(TS_F32, 2, hs, &t));
    const char *head[] = {"'lm_head.weight' differs from 'wte.weight'"};
    expect_refused(dir, fixture_with(NULL, "lm_head.weight", t), TS_ERR_INVALID_ARGUMENT, head, 1);
    ts_tensor_free(t);
    /* a model of another size: the file's sizes are named */
    ts_gpt_config c = fixture_config();
    c.vocab_size = 301;
    ts_module *m = gpt_new(&c);
    cr_assert_eq(ts_ckpt_load_hf_gpt2(MODEL, m), TS_ERR_SHAPE);
    cr_assert(strstr(ts_last_error(), "'wte.weight' is (300, 64) in the file, the model expects (301, 64)") &&
                  strstr(ts_last_error(), "vocab 300"),
              "%s", ts_last_error());
    ts_module_free(m);
    th_rm_rf(dir);
    free(dir);
}

/* ------------------------------------------------------------ sharded and deferred */

typedef struct shard_arg {
    ts_gpt_config cfg;
    ts_tensor *ids, *want; /* the plain model's logits */
    const char *dir;
} shard_arg;

static int shard_rank(th_rank *rc)
{
    shard_arg *a = rc->arg;
    ts_mesh *mesh = th_rank_mesh(rc, false);
    if (!mesh) return th_rank_fail(rc, "mesh: %s", ts_last_error());
    int bad = 0;
    for (int deferred = 0; deferred < 2 && !bad; deferred++) {
        ts_module *m = NULL;
        pthread_mutex_lock(&th_build_mu);
        if (deferred) ts_device_scope_enter(TS_DEVICE_META);
        ts_status st = ts_gpt_new(&a->cfg, &m);
        if (deferred) ts_device_scope_exit();
        pthread_mutex_unlock(&th_build_mu);
        TH_RK_OK(rc, st);
        ts_fsdp_options o = ts_fsdp_options_default();
        o.mesh = mesh;
        TH_RK_OK(rc, ts_fsdp_apply_by_type(m, "Block", &o, NULL));
        TH_RK_OK(rc, ts_fully_shard(m, &o));
        TH_RK_OK(rc, ts_ckpt_load_hf_gpt2(MODEL, m));
        ts_tensor *y = NULL;
        TH_RK_OK(rc, logits_of(m, a->ids, &y));
        bad = th_rank_same_bits(rc, y, a->want, "%s model's logits", deferred ? "deferred sharded" : "sharded");
        ts_tensor_free(y);
        /* and the export, gathered on rank 0, is the file */
        char out[600];
        snprintf(out, sizeof out, "%s/sharded%d.safetensors", a->dir, deferred);
        if (!bad) TH_RK_OK(rc, ts_ckpt_save_hf_gpt2(out, m));
        ts_module_free(m);
    }
    ts_mesh_free(mesh);
    return bad;
}

Test(checkpoint_hf_gpt2, sharded_and_deferred_on_two_ranks, .timeout = 60)
{
    char *dir = th_tmp_dir("ts_hf_gpt2");
    ts_state_dict *fx = NULL;
    TH_OK(ts_safetensors_load(FIX "logits.safetensors", &fx));
    shard_arg a = {.cfg = fixture_config(), .ids = ts_state_dict_get(fx, "ids"), .dir = dir};
    a.want = plain_logits(MODEL, &a.cfg, fx);
    th_run_world(2, shard_rank, &a, 30);
    for (int k = 0; k < 2; k++) {
        char out[600];
        snprintf(out, sizeof out, "%s/sharded%d.safetensors", dir, k);
        assert_same_file(MODEL, out);
    }
    ts_tensor_free(a.want);
    ts_state_dict_free(fx);
    th_rm_rf(dir);
    free(dir);
}

/* A deferred plain model (meta, not sharded) loads too, and an export of
 * a model still on the meta device is refused. */
Test(checkpoint_hf_gpt2, deferred_plain_model)
{
    char *dir = th_tmp_dir("ts_hf_gpt2"), out[600];
    snprintf(out, sizeof out, "%s/meta.safetensors", dir);
    ts_gpt_config c = fixture_config();
    ts_module *m = NULL;
    TH_OK(ts_device_scope_enter(TS_DEVICE_META));
    ts_status st = ts_gpt_new(&c, &m);
    TH_OK(ts_device_scope_exit());
    TH_OK(st);
    cr_assert_eq(ts_ckpt_save_hf_gpt2(out, m), TS_ERR_STATE, "%s", ts_last_error());
    TH_OK(ts_ckpt_load_hf_gpt2(MODEL, m));
    ts_state_dict *fx = NULL;
    TH_OK(ts_safetensors_load(FIX "logits.safetensors", &fx));
    ts_tensor *y = NULL, *want = plain_logits(MODEL, &c, fx);
    TH_OK(logits_of(m, ts_state_dict_get(fx, "ids"), &y));
    cr_assert_eq(max_abs_diff(y, want), 0.0f);
    TH_OK(ts_ckpt_save_hf_gpt2(out, m));
    assert_same_file(MODEL, out);
    ts_tensor_free(y);
    ts_tensor_free(want);
    ts_state_dict_free(fx);
    ts_module_free(m);
    th_rm_rf(dir);
    free(dir);
}

/* ts_gpt_config.gelu_approx: the two GELUs, anything else refused */
Test(checkpoint_hf_gpt2, gpt_gelu_approx_checked)
{
    ts_gpt_config c = fixture_config();
    c.gelu_approx = (ts_gelu_approx)7;
    ts_module *m = NULL;
    cr_assert_eq(ts_gpt_new(&c, &m), TS_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(ts_last_error(), "gelu_approx") && strstr(ts_last_error(), "7"), "%s", ts_last_error());
    cr_assert_eq(ts_gpt_config_default().gelu_approx, TS_GELU_NONE, "the default stays erf's");
}
