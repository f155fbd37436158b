/* Activation checkpointing (ts_checkpoint_module), unsharded: gradients,
 * losses and training with checkpointed modules equal those without, bit
 * for bit, with dropout drawing masks; the activations kept drop; nesting,
 * errors, and a recompute that fails. The sharded cases are in
 * tests/fully_shard/test_activation_checkpoint_fsdp.c. */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/helpers.h"

#define V 16 /* vocabulary */

static ts_module *gpt(int layers, int64_t d, int64_t T, double dropout)
{
    ts_gpt_config c = ts_gpt_config_default();
    c.vocab_size = V, c.block_size = T, c.n_layer = layers, c.n_head = 2, c.d_model = d;
    c.dropout = dropout;
    ts_manual_seed(5);
    ts_module *m;
    TH_OK(ts_gpt_new(&c, &m));
    return m;
}

static void checkpoint_blocks(ts_module *m, int layers)
{
    for (int l = 0; l < layers; l++) {
        char name[32];
        ts_module *b;
        snprintf(name, sizeof name, "blocks.%d", l);
        TH_OK(ts_module_get_submodule(m, name, &b));
        TH_OK(ts_checkpoint_module(b));
    }
}

/* tokens (B, T) and next-token targets (B*T), varying with `step` */
static void batch(int step, int64_t B, int64_t T, ts_tensor **ids, ts_tensor **tgt)
{
    int64_t sh[2] = {B, T}, st[1] = {B * T};
    TH_OK(ts_tensor_empty(TS_I64, 2, sh, ids));
    TH_OK(ts_tensor_empty(TS_I64, 1, st, tgt));
    int64_t *a = ts_tensor_data(*ids), *b = ts_tensor_data(*tgt);
    for (int64_t s = 0; s < B; s++)
        for (int64_t t = 0; t < T; t++) {
            a[s * T + t] = (s * 3 + t * 5 + step * 7) % V;
            b[s * T + t] = (s * 3 + (t + 1) * 5 + step * 7) % V;
        }
}

/* forward, cross-entropy loss, backward; the loss's value in *loss */
static ts_status fwd_bwd(ts_module *m, ts_tensor *ids, ts_tensor *tgt, float *loss_out)
{
    ts_tensor *logits = NULL, *flat = NULL, *loss = NULL;
    int64_t sh[2] = {-1, V};
    ts_status st = ts_module_call1(m, ids, &logits);
    if (!st) st = ts_reshape(logits, 2, sh, &flat);
    if (!st) st = ts_cross_entropy(flat, tgt, -100, TS_REDUCTION_MEAN, &loss);
    if (!st) *loss_out = *(float *)ts_tensor_data(loss);
    if (!st) st = ts_backward(loss, NULL, false);
    ts_tensor_free(logits), ts_tensor_free(flat), ts_tensor_free(loss);
    return st;
}

/* Every parameter's .grad of a and b: same names, same bits. */
static void assert_grads_equal(ts_module *a, ts_module *b, const char *what)
{
    ts_named_params pa, pb;
    TH_OK(ts_module_named_parameters(a, &pa));
    TH_OK(ts_module_named_parameters(b, &pb));
    cr_assert_eq(pa.n, pb.n);
    for (int i = 0; i < pa.n; i++) {
        cr_assert_str_eq(pa.items[i].name, pb.items[i].name);
        ts_tensor *ga = ts_tensor_grad(*pa.items[i].slot), *gb = ts_tensor_grad(*pb.items[i].slot);
        cr_assert(ga && gb, "%s: %s has no gradient (%p, %p)", what, pa.items[i].name, (void *)ga, (void *)gb);
        char w[160];
        snprintf(w, sizeof w, "%s: %s.grad", what, pa.items[i].name);
        th_vec_expect_bytes(w, ts_tensor_dtype(ga), ts_tensor_data(ga), ts_tensor_data(gb), ts_tensor_numel(ga));
    }
    ts_named_params_free(&pa);
    ts_named_params_free(&pb);
}

static void gen_state(uint8_t *s) { ts_generator_get_state(ts_default_generator(), s); }

/* 3 SGD steps of a GPT with dropout 0.1, every block checkpointed, against
 * the same GPT without: each step's loss, every gradient and the
 * generator's state after the step are the same bits. */
Test(nn_checkpoint, gpt_with_dropout_trains_bitwise_as_without)
{
    th_mem_mark();
    {
        const int L = 2;
        ts_module *ref = gpt(L, 16, 8, 0.1), *m = gpt(L, 16, 8, 0.1);
        checkpoint_blocks(m, L);
        ts_param_list pr, pm;
        TH_OK(ts_module_parameters(ref, &pr));
        TH_OK(ts_module_parameters(m, &pm));
        ts_sgd_options so = ts_sgd_options_default();
        so.lr = 0.3, so.momentum = 0.9;
        ts_optim *oref, *om;
        TH_OK(ts_sgd_new(pr.n, pr.items, &so, &oref));
        TH_OK(ts_sgd_new(pm.n, pm.items, &so, &om));
        ts_param_list_free(&pr);
        ts_param_list_free(&pm);
        static uint8_t s1[TS_GENERATOR_STATE_BYTES], s2[TS_GENERATOR_STATE_BYTES];
        float prev = 0;
        for (int step = 0; step < 3; step++) {
            ts_tensor *ids, *tgt;
            batch(step, 4, 8, &ids, &tgt);
            float lr = 0, lm = 0;
            ts_manual_seed(100 + (uint64_t)step);
            ts_optim_zero_grad(oref, true);
            TH_OK(fwd_bwd(ref, ids, tgt, &lr));
            gen_state(s1);
            ts_manual_seed(100 + (uint64_t)step);
            ts_optim_zero_grad(om, true);
            TH_OK(fwd_bwd(m, ids, tgt, &lm));
            gen_state(s2);
            cr_assert_eq(th_f32_bits(lr), th_f32_bits(lm), "step %d: loss %.9g without, %.9g with checkpointing", step,
                         (double)lr, (double)lm);
            cr_assert(memcmp(s1, s2, sizeof s1) == 0, "step %d: the generator's state after the step differs", step);
            assert_grads_equal(ref, m, "gpt step");
            TH_OK(ts_optim_step(oref));
            TH_OK(ts_optim_step(om));
            cr_assert(step == 0 || lr != prev, "the loss did not change between steps");
            prev = lr;
            ts_tensor_free(ids), ts_tensor_free(tgt);
        }
        ts_optim_free(oref), ts_optim_free(om);
        ts_module_free(ref), ts_module_free(m);
    }
    th_mem_assert_back();
}

/* The same GPT, different dropout masks from another seed: the check
 * above can fail (dropout is on and matters). */
Test(nn_checkpoint, dropout_masks_matter)
{
    ts_module *a = gpt(1, 16, 8, 0.1), *b = gpt(1, 16, 8, 0.1);
    checkpoint_blocks(b, 1);
    ts_tensor *ids, *tgt;
    batch(0, 2, 8, &ids, &tgt);
    float la, lb;
    ts_manual_seed(1);
    TH_OK(fwd_bwd(a, ids, tgt, &la));
    ts_manual_seed(2);
    TH_OK(fwd_bwd(b, ids, tgt, &lb));
    cr_assert_neq(th_f32_bits(la), th_f32_bits(lb), "two seeds gave the same loss: dropout draws nothing");
    ts_tensor_free(ids), ts_tensor_free(tgt);
    ts_module_free(a), ts_module_free(b);
}

/* A TransformerEncoderLayer (PyTorch's defaults, dropout 0.1) whose input
 * requires grad: output, input gradient and parameter gradients. */
Test(nn_checkpoint, encoder_layer_input_and_parameter_gradients_bitwise)
{
    th_mem_mark();
    {
        ts_encoder_layer_config c = ts_encoder_layer_config_default(16, 2);
        c.dim_feedforward = 32;
        ts_module *ref, *m;
        ts_manual_seed(9);
        TH_OK(ts_encoder_layer_new(&c, &ref));
        ts_manual_seed(9);
        TH_OK(ts_encoder_layer_new(&c, &m));
        TH_OK(ts_checkpoint_module(m));
        cr_assert_str_eq(ts_module_type_name(m), "TransformerEncoderLayerCheckpointed");
        int64_t sh[3] = {6, 3, 16};
        ts_tensor *x1 = th_seq(TS_F32, 3, sh, 1.0, true), *x2 = th_seq(TS_F32, 3, sh, 1.0, true);
        ts_tensor *y1, *y2, *s1, *s2;
        ts_manual_seed(4);
        TH_OK(ts_module_call1(ref, x1, &y1));
        TH_OK(ts_sum(y1, 0, NULL, false, &s1));
        TH_OK(ts_backward(s1, NULL, false));
        ts_manual_seed(4);
        TH_OK(ts_module_call1(m, x2, &y2));
        cr_assert(ts_tensor_requires_grad(y2));
        TH_OK(ts_sum(y2, 0, NULL, false, &s2));
        TH_OK(ts_backward(s2, NULL, false));
        th_vec_expect_bytes("output", TS_F32, ts_tensor_data(y2), ts_tensor_data(y1), ts_tensor_numel(y1));
        cr_assert_not_null(ts_tensor_grad(x2));
        th_vec_expect_bytes("input grad", TS_F32, ts_tensor_data(ts_tensor_grad(x2)),
                            ts_tensor_data(ts_tensor_grad(x1)), ts_tensor_numel(x1));
        assert_grads_equal(ref, m, "encoder layer");
        /* a second backward through the released graph is refused, as without */
        cr_assert_neq(ts_backward(s2, NULL, false), TS_OK);
        ts_tensor_free(x1), ts_tensor_free(x2), ts_tensor_free(y1), ts_tensor_free(y2);
        ts_tensor_free(s1), ts_tensor_free(s2);
        ts_module_free(ref), ts_module_free(m);
    }
    th_mem_assert_back();
}

/* The activations kept between forward and backward: a 4-block GPT keeps
 * each block's intermediates without checkpointing, only each block's
 * input with it. Peak tensor storage of a forward and backward, measured
 * with the allocator's counters (TS_MEM_STORAGE). */
static size_t peak_of_step(ts_module *m, ts_tensor *ids, ts_tensor *tgt)
{
    float l;
    size_t base = ts_mem_live_bytes(TS_MEM_STORAGE);
    ts_mem_reset_peak();
    ts_manual_seed(1);
    TH_OK(fwd_bwd(m, ids, tgt, &l));
    return ts_mem_peak_bytes(TS_MEM_STORAGE) - base;
}

Test(nn_checkpoint, peak_storage_drops)
{
    const int L = 4;
    ts_module *ref = gpt(L, 64, 32, 0.1), *m = gpt(L, 64, 32, 0.1);
    checkpoint_blocks(m, L);
    ts_tensor *ids, *tgt;
    batch(0, 8, 32, &ids, &tgt);
    /* one step each first: .grad buffers exist in both, as in training */
    (void)peak_of_step(ref, ids, tgt);
    (void)peak_of_step(m, ids, tgt);
    size_t pr = peak_of_step(ref, ids, tgt), pm = peak_of_step(m, ids, tgt);
    cr_log_info("peak storage of a step: %zu bytes without checkpointing, %zu with (%.2f)", pr, pm,
                (double)pm / (double)pr);
    /* 4 blocks keep ~a dozen (B, T, d) or (B, H, T, T) tensors each
     * without; with, one (B, T, d) input each plus one block's
     * intermediates at a time: at least a third less */
    cr_assert_lt(pm, pr * 2 / 3, "peak %zu with checkpointing, %zu without", pm, pr);
    ts_tensor_free(ids), ts_tensor_free(tgt);
    ts_module_free(ref), ts_module_free(m);
}

/* Checkpointed modules inside checkpointed modules: a block and its MLP,
 * and the whole model around them. */
Test(nn_checkpoint, nested_checkpoints_bitwise)
{
    th_mem_mark();
    {
        ts_module *ref = gpt(2, 16, 8, 0.1), *m = gpt(2, 16, 8, 0.1);
        checkpoint_blocks(m, 2);
        ts_module *mlp;
        TH_OK(ts_module_get_submodule(m, "blocks.1.mlp", &mlp));
        TH_OK(ts_checkpoint_module(mlp));
        TH_OK(ts_checkpoint_module(m));
        cr_assert_str_eq(ts_module_type_name(m), "GPTCheckpointed");
        ts_tensor *ids, *tgt;
        batch(1, 2, 8, &ids, &tgt);
        float lr, lm;
        for (int rep = 0; rep < 2; rep++) {
            ts_manual_seed(6);
            ts_module_zero_grad(ref, true);
            TH_OK(fwd_bwd(ref, ids, tgt, &lr));
            ts_manual_seed(6);
            ts_module_zero_grad(m, true);
            TH_OK(fwd_bwd(m, ids, tgt, &lm));
            cr_assert_eq(th_f32_bits(lr), th_f32_bits(lm));
            assert_grads_equal(ref, m, "nested");
        }
        ts_tensor_free(ids), ts_tensor_free(tgt);
        ts_module_free(ref), ts_module_free(m);
    }
    th_mem_assert_back();
}

/* FQNs and the state dict are those of the module as it was. */
Test(nn_checkpoint, names_unchanged_and_errors)
{
    ts_module *ref = gpt(2, 16, 8, 0.0), *m = gpt(2, 16, 8, 0.0);
    checkpoint_blocks(m, 2);
    ts_module *b;
    TH_OK(ts_module_get_submodule(m, "blocks.0", &b));
    cr_assert_str_eq(ts_module_type_name(b), "BlockCheckpointed");
    cr_assert(ts_module_is_checkpointed(b));
    cr_assert(!ts_module_is_checkpointed(m));
    cr_assert(!ts_module_is_checkpointed(NULL));
    ts_state_dict *a, *c;
    TH_OK(ts_module_state_dict(ref, &a));
    TH_OK(ts_module_state_dict(m, &c));
    cr_assert_eq(ts_state_dict_size(a), ts_state_dict_size(c));
    for (int i = 0; i < ts_state_dict_size(a); i++)
        cr_assert_str_eq(ts_state_dict_name(a, i), ts_state_dict_name(c, i));
    TH_OK(ts_module_load_state_dict(m, a, true));
    ts_state_dict_free(a), ts_state_dict_free(c);

    TH_FAILS(ts_checkpoint_module(NULL), TS_ERR_INVALID_ARGUMENT, "NULL");
    TH_FAILS(ts_checkpoint_module(b), TS_ERR_ALREADY, "BlockCheckpointed", "already checkpointed");
    ts_module *lst, *kids[1];
    TH_OK(ts_linear_new(2, 2, true, &kids[0]));
    TH_OK(ts_module_list_new(1, kids, &lst));
    TH_FAILS(ts_checkpoint_module(lst), TS_ERR_UNSUPPORTED, "ModuleList", "no forward");
    cr_assert_str_eq(ts_module_type_name(lst), "ModuleList");
    ts_module_free(lst);
    ts_module_free(ref), ts_module_free(m);
}

/* Without grad (or with nothing requiring grad) the call is the plain
 * forward: same output, nothing recorded. */
Test(nn_checkpoint, no_grad_is_the_plain_forward)
{
    ts_module *ref, *m;
    ts_manual_seed(2);
    TH_OK(ts_linear_new(4, 3, true, &ref));
    ts_manual_seed(2);
    TH_OK(ts_linear_new(4, 3, true, &m));
    TH_OK(ts_checkpoint_module(m));
    int64_t sh[2] = {2, 4};
    ts_tensor *x = th_seq(TS_F32, 2, sh, 1.0, false), *y1, *y2;
    bool prev = ts_grad_mode_set(false);
    TH_OK(ts_module_call1(ref, x, &y1));
    TH_OK(ts_module_call1(m, x, &y2));
    ts_grad_mode_set(prev);
    cr_assert(!ts_tensor_requires_grad(y2));
    th_vec_expect_bytes("no-grad output", TS_F32, ts_tensor_data(y2), ts_tensor_data(y1), 6);
    ts_tensor_free(y1), ts_tensor_free(y2), ts_tensor_free(x);
    ts_module_free(ref), ts_module_free(m);
}

/* ------------------------------------------------ a recompute that fails */

static ts_module *flaky_new(void)
{
    th_flaky *f = NULL;
    ts_manual_seed(8);
    TH_OK(th_flaky_new(&f));
    return &f->base;
}

/* The recompute fails: ts_backward says which module and why, the
 * generator is as it was, and the next step works and equals the
 * module without checkpointing. */
Test(nn_checkpoint, failed_recompute_leaves_module_usable)
{
    th_mem_mark();
    {
        ts_module *m = flaky_new(), *ref = flaky_new();
        TH_OK(ts_checkpoint_module(m));
        int64_t sh[2] = {3, 4};
        ts_tensor *x = th_seq(TS_F32, 2, sh, 1.0, true), *y, *s;
        ((th_flaky *)m)->fail_at = 2; /* the recompute */
        TH_OK(ts_module_call1(m, x, &y));
        TH_OK(ts_sum(y, 0, NULL, false, &s));
        static uint8_t g1[TS_GENERATOR_STATE_BYTES], g2[TS_GENERATOR_STATE_BYTES];
        gen_state(g1);
        TH_FAILS(ts_backward(s, NULL, false), TS_ERR_STATE, "FlakyCheckpointed", "recompute", "injected failure");
        gen_state(g2);
        cr_assert(memcmp(g1, g2, sizeof g1) == 0, "the failed recompute left the generator changed");
        cr_assert(!ts_autograd_in_backward());
        ts_tensor_free(y), ts_tensor_free(s);
        /* usable: the next forward and backward work and are right */
        ts_module_zero_grad(m, true);
        ts_tensor_zero_grad(x, true);
        ((th_flaky *)m)->fail_at = 0;
        TH_OK(ts_module_call1(m, x, &y));
        TH_OK(ts_sum(y, 0, NULL, false, &s));
        TH_OK(ts_backward(s, NULL, false));
        ts_tensor *x2 = th_seq(TS_F32, 2, sh, 1.0, true), *y2, *s2;
        TH_OK(ts_module_call1(ref, x2, &y2));
        TH_OK(ts_sum(y2, 0, NULL, false, &s2));
        TH_OK(ts_backward(s2, NULL, false));
        assert_grads_equal(ref, m, "after a failed recompute");
        th_vec_expect_bytes("input grad", TS_F32, ts_tensor_data(ts_tensor_grad(x)), ts_tensor_data(ts_tensor_grad(x2)),
                            12);
        ts_tensor_free(y), ts_tensor_free(s), ts_tensor_free(x);
        ts_tensor_free(y2), ts_tensor_free(s2), ts_tensor_free(x2);
        ts_module_free(m), ts_module_free(ref);
    }
    th_mem_assert_back();
}

/* retain_graph: a second backward through a checkpointed module recomputes
 * again and adds the same gradients, as without checkpointing. */
Test(nn_checkpoint, retain_graph_backward_twice)
{
    th_mem_mark();
    {
        ts_module *ref = gpt(1, 16, 8, 0.1), *m = gpt(1, 16, 8, 0.1);
        checkpoint_blocks(m, 1);
        ts_tensor *ids, *tgt;
        batch(2, 2, 8, &ids, &tgt);
        ts_module *mods[2] = {ref, m};
        for (int k = 0; k < 2; k++) {
            ts_tensor *logits, *flat, *loss;
            int64_t sh[2] = {-1, V};
            ts_manual_seed(3);
            TH_OK(ts_module_call1(mods[k], ids, &logits));
            TH_OK(ts_reshape(logits, 2, sh, &flat));
            TH_OK(ts_cross_entropy(flat, tgt, -100, TS_REDUCTION_MEAN, &loss));
            TH_OK(ts_backward(loss, NULL, true));
            TH_OK(ts_backward(loss, NULL, false));
            ts_tensor_free(logits), ts_tensor_free(flat), ts_tensor_free(loss);
        }
        assert_grads_equal(ref, m, "two backwards");
        ts_tensor_free(ids), ts_tensor_free(tgt);
        ts_module_free(ref), ts_module_free(m);
    }
    th_mem_assert_back();
}

/* The checkpoint node's context (the block's inputs, the module reference)
 * goes when the node's backward has run, not when the caller frees the
 * loss: with the loss still held after backward (as through an optimizer
 * step), nothing of the 4 blocks' inputs stays alive. A second backward
 * through the released graph is refused as for any other node. */
Test(nn_checkpoint, inputs_released_after_backward)
{
    th_mem_mark();
    {
        const int L = 4;
        const int64_t B = 4, T = 16, d = 32;
        ts_module *m = gpt(L, d, T, 0.1);
        checkpoint_blocks(m, L);
        ts_tensor *ids, *tgt;
        batch(1, B, T, &ids, &tgt);
        for (int step = 0; step < 2; step++) { /* the second with .grad buffers already made */
            ts_tensor *logits, *flat, *loss;
            int64_t sh[2] = {-1, V};
            TH_OK(ts_module_call1(m, ids, &logits));
            TH_OK(ts_reshape(logits, 2, sh, &flat));
            TH_OK(ts_cross_entropy(flat, tgt, -100, TS_REDUCTION_MEAN, &loss));
            ts_tensor_free(logits), ts_tensor_free(flat);
            TH_OK(ts_backward(loss, NULL, false));
            size_t held = ts_mem_live_bytes(TS_MEM_STORAGE);
            ts_status st = ts_backward(loss, NULL, false);
            cr_assert_eq(st, TS_ERR_AUTOGRAD, "second backward: %s", ts_status_str(st));
            cr_assert(strstr(ts_last_error(), "second time"), "%s", ts_last_error());
            ts_tensor_free(loss);
            size_t after = ts_mem_live_bytes(TS_MEM_STORAGE);
            /* before the fix the loss held L block inputs of B*T*d floats */
            cr_assert_lt(held - after, (size_t)(B * T * d) * sizeof(float),
                         "step %d: the loss held %zu bytes of storage after backward", step, held - after);
        }
        ts_tensor_free(ids), ts_tensor_free(tgt);
        ts_module_free(m);
    }
    th_mem_assert_back();
}
