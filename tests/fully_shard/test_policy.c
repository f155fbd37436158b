/*
 * Wrap policies (fully_shard/policy.c): ts_fsdp_apply_by_type and
 * ts_fsdp_apply_by_size on seed 000's model (two Blocks of two
 * Linear(6, 6, bias=False), 144 parameters), in one process on the
 * one-rank mesh (which modules are sharded and which group holds what do
 * not depend on the world size; examples/wrap_policies runs the same on 4
 * ranks).
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "fully_shard/fully_shard.h"
#include "tests/helpers.h"
#include "tests/log_capture.h"

/* ------------------------------------------------ a Block type of its own */

typedef struct block {
    ts_module base;
    ts_module *a, *b;
} block;

static ts_status block_forward(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    block *bk = (block *)m;
    ts_tensor *h = NULL, *r = NULL;
    ts_status st = n_in == 1 ? ts_module_call1(bk->a, in[0], &h) : TS_ERR_INVALID_ARGUMENT;
    if (!st) st = ts_relu(h, &r);
    if (!st) st = ts_module_call1(bk->b, r, &out[0]);
    ts_tensor_free(r);
    ts_tensor_free(h);
    if (!st) *n_out = 1;
    return st;
}

static ts_status block_visit(ts_module *m, const ts_module_visitor *v)
{
    block *bk = (block *)m;
    ts_status st = TS_OK;
    if (v->child && !(st = v->child(v->ctx, "a", bk->a))) st = v->child(v->ctx, "b", bk->b);
    return st;
}

static void block_free(ts_module *m)
{
    block *bk = (block *)m;
    ts_module_free(bk->a);
    ts_module_free(bk->b);
    free(bk);
}

static const ts_module_vtable block_vt = {
    .type_name = "Block", .forward = block_forward, .visit = block_visit, .free = block_free};

static ts_module *block_new(void)
{
    block *bk = calloc(1, sizeof *bk);
    cr_assert(bk);
    ts_module_init(&bk->base, &block_vt);
    TH_OK(ts_linear_new(6, 6, false, &bk->a));
    TH_OK(ts_linear_new(6, 6, false, &bk->b));
    return &bk->base;
}

/* Sequential(Block(), Block()) */
static ts_module *seed_model(void)
{
    ts_manual_seed(0);
    ts_module *b[2] = {block_new(), block_new()}, *m;
    TH_OK(ts_sequential_new(2, b, &m));
    return m;
}

static ts_module *sub(ts_module *m, const char *fqn)
{
    ts_module *s;
    TH_OK(ts_module_get_submodule(m, fqn, &s));
    return s;
}

static int group_params(ts_module *m)
{
    ts_fsdp_group_info gi;
    TH_OK(ts_fsdp_group_info_get(m, &gi));
    return gi.n_params;
}

static ts_status count_fsdp(void *ctx, const char *fqn, ts_module *m)
{
    (void)fqn;
    if (ts_module_is_fsdp(m)) (*(int *)ctx)++;
    return TS_OK;
}

static int fsdp_modules(ts_module *m)
{
    int n = 0;
    TH_OK(ts_module_named_modules(m, count_fsdp, &n));
    return n;
}

/* "fsdp units" and "groups with parameters" of seed 000 */
static void expect_counts(ts_module *m, int units, int groups)
{
    static const char *names[] = {"", "0", "0.a", "0.b", "1", "1.a", "1.b"};
    int g = 0;
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
        ts_module *s = sub(m, names[i]);
        if (ts_module_is_fsdp(s) && group_params(s) > 0) g++;
    }
    cr_expect_eq(fsdp_modules(m), units, "fsdp units %d, expected %d", fsdp_modules(m), units);
    cr_expect_eq(g, groups, "groups with parameters %d, expected %d", g, groups);
}

/* ------------------------------------------------------------ by type */

Test(fully_shard_policy, by_type_shards_each_block_and_not_the_root)
{
    ts_module *m = seed_model();
    int count = -1;
    TH_OK(ts_fsdp_apply_by_type(m, "Block", NULL, &count));
    cr_expect_eq(count, 2);
    cr_expect(!ts_module_is_fsdp(m), "the root is left to the caller");
    cr_expect(ts_module_is_fsdp(sub(m, "0")) && ts_module_is_fsdp(sub(m, "1")));
    cr_expect(!ts_module_is_fsdp(sub(m, "0.a")) && !ts_module_is_fsdp(sub(m, "1.b")));
    cr_expect_eq(group_params(sub(m, "0")), 2);
    cr_expect_str_eq(ts_module_type_name(sub(m, "1")), "BlockFSDPModule");
    TH_OK(ts_fully_shard(m, NULL));
    cr_expect_eq(group_params(m), 0, "the root has nothing left");
    expect_counts(m, 3, 2);
    /* the sharded model still runs */
    int64_t xs[2] = {2, 6};
    ts_tensor *x, *y;
    TH_OK(ts_tensor_ones(TS_F32, 2, xs, &x));
    TH_OK(ts_module_call1(m, x, &y));
    int64_t want[2] = {2, 6};
    th_assert_shape(y, 2, want);
    ts_tensor_free(y);
    ts_tensor_free(x);
    ts_module_free(m);
}

Test(fully_shard_policy, by_type_matches_the_original_type_name_only)
{
    ts_module *m = seed_model();
    int count = -1;
    TH_OK(ts_fsdp_apply_by_type(m, "Linear", NULL, &count));
    cr_expect_eq(count, 4);
    /* applied again: the Linears are already sharded and skipped */
    count = -1;
    TH_OK(ts_fsdp_apply_by_type(m, "Linear", NULL, &count));
    cr_expect_eq(count, 0);
    TH_OK(ts_fsdp_apply_by_type(m, "LinearFSDPModule", NULL, &count));
    cr_expect_eq(count, 0, "the rewritten name is not a type to match");
    TH_OK(ts_fully_shard(m, NULL));
    expect_counts(m, 5, 4);
    ts_module_free(m);
}

Test(fully_shard_policy, by_type_without_a_match_reports_zero)
{
    ts_module *m = seed_model();
    int count = -1;
    /* not an error, but a warning that names the types there are (a typo
     * would otherwise leave everything to the root without a word) */
    th_log_capture c;
    th_log_capture_begin(&c, TS_LOG_WARN);
    ts_status st = ts_fsdp_apply_by_type(m, "TransformerEncoderLayer", NULL, &count);
    char *log = th_log_capture_end(&c);
    TH_OK(st);
    cr_expect_eq(count, 0);
    cr_expect(strstr(log, "no module below the root has type 'TransformerEncoderLayer'") && strstr(log, "Linear"), "%s",
              log);
    free(log);
    TH_OK(ts_fsdp_apply_by_type(m, "TransformerEncoderLayer", NULL, NULL)); /* count is optional */
    cr_expect_eq(fsdp_modules(m), 0);
    /* the root's own type matches: still not sharded by the policy */
    TH_OK(ts_fsdp_apply_by_type(m, "Sequential", NULL, &count));
    cr_expect_eq(count, 0);
    cr_expect(!ts_module_is_fsdp(m));
    TH_OK(ts_fully_shard(m, NULL));
    expect_counts(m, 1, 1);
    ts_module_free(m);
}

Test(fully_shard_policy, by_type_nested_matches_bottom_up)
{
    /* Sequential(Sequential(Sequential(Linear), Linear)): the innermost
     * Sequential is sharded before the middle one, so each keeps its own
     * Linear. */
    ts_module *l1, *l2, *inner, *mid, *root;
    TH_OK(ts_linear_new(4, 4, false, &l1));
    TH_OK(ts_linear_new(4, 4, false, &l2));
    TH_OK(ts_sequential_new(1, &l1, &inner));
    ts_module *k[2] = {inner, l2};
    TH_OK(ts_sequential_new(2, k, &mid));
    TH_OK(ts_sequential_new(1, &mid, &root));
    int count = -1;
    TH_OK(ts_fsdp_apply_by_type(root, "Sequential", NULL, &count));
    cr_expect_eq(count, 2);
    cr_expect_eq(group_params(inner), 1);
    cr_expect_eq(group_params(mid), 1, "the middle Sequential keeps only its own Linear");
    cr_expect(!ts_module_is_fsdp(root));
    ts_module_free(root);
}

/* ------------------------------------------------------------ by size */

Test(fully_shard_policy, by_size_30_shards_each_linear_and_no_block)
{
    ts_module *m = seed_model();
    int count = -1;
    TH_OK(ts_fsdp_apply_by_size(m, 30, NULL, &count));
    cr_expect_eq(count, 4);
    cr_expect(!ts_module_is_fsdp(sub(m, "0")) && !ts_module_is_fsdp(sub(m, "1")),
              "the Linears took everything: nothing is left to the Blocks");
    cr_expect(ts_module_is_fsdp(sub(m, "0.a")) && ts_module_is_fsdp(sub(m, "1.b")));
    cr_expect(!ts_module_is_fsdp(m));
    TH_OK(ts_fully_shard(m, NULL));
    expect_counts(m, 5, 4);
    ts_module_free(m);
}

Test(fully_shard_policy, by_size_floors_at_the_boundaries)
{
    /* 36 reaches 36 (>=); 37 does not, and a Block then has 72 >= 37 */
    struct {
        int64_t min;
        int count;
        bool linears, blocks;
    } cases[] = {{1, 4, true, false},  {36, 4, true, false},  {37, 2, false, true},
                 {72, 2, false, true}, {73, 0, false, false}, {145, 0, false, false}};
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        ts_module *m = seed_model();
        int count = -1;
        TH_OK(ts_fsdp_apply_by_size(m, cases[i].min, NULL, &count));
        cr_expect_eq(count, cases[i].count, "min %lld: %d sharded, expected %d", (long long)cases[i].min, count,
                     cases[i].count);
        cr_expect_eq(ts_module_is_fsdp(sub(m, "1.a")), cases[i].linears, "min %lld", (long long)cases[i].min);
        cr_expect_eq(ts_module_is_fsdp(sub(m, "0")), cases[i].blocks, "min %lld", (long long)cases[i].min);
        cr_expect(!ts_module_is_fsdp(m));
        ts_module_free(m);
    }
}

Test(fully_shard_policy, by_size_counts_what_sharded_descendants_took)
{
    /* 0.a already sharded by the user: Block 0 has 36 left (< 40), Block 1
     * has 72 (>= 40); no Linear reaches 40 */
    ts_module *m = seed_model();
    TH_OK(ts_fully_shard(sub(m, "0.a"), NULL));
    int count = -1;
    TH_OK(ts_fsdp_apply_by_size(m, 40, NULL, &count));
    cr_expect_eq(count, 1);
    cr_expect(!ts_module_is_fsdp(sub(m, "0")));
    cr_expect(ts_module_is_fsdp(sub(m, "1")));
    cr_expect_eq(group_params(sub(m, "1")), 2);
    TH_OK(ts_fully_shard(m, NULL));
    cr_expect_eq(group_params(m), 1, "the root takes 0.b");
    ts_module_free(m);
}

Test(fully_shard_policy, by_size_does_not_count_ignored_parameters)
{
    ts_module *m = seed_model();
    ts_nn_linear *a0 = (ts_nn_linear *)sub(m, "0.a");
    ts_tensor *ign[1] = {a0->weight};
    ts_fsdp_options o = ts_fsdp_options_default();
    o.ignored_params = ign;
    o.n_ignored_params = 1;
    int count = -1;
    TH_OK(ts_fsdp_apply_by_size(m, 36, &o, &count));
    cr_expect_eq(count, 3, "0.a has nothing to shard once its weight is ignored");
    cr_expect(!ts_module_is_fsdp(sub(m, "0.a")));
    cr_expect(ts_module_is_fsdp(sub(m, "0.b")));
    TH_OK(ts_fully_shard(m, &o));
    cr_expect_eq(group_params(m), 0);
    cr_expect_null(ts_fsdp_param_dtensor(a0->weight), "the ignored weight stays whole");
    ts_module_free(m);
}

Test(fully_shard_policy, by_size_keeps_multihead_attention_whole_and_skips_module_lists)
{
    /* FSDP1's defaults: nothing inside a MultiheadAttention on its own */
    ts_encoder_layer_config cfg = ts_encoder_layer_config_default(8, 2);
    cfg.dim_feedforward = 16;
    ts_module *layer;
    TH_OK(ts_encoder_layer_new(&cfg, &layer));
    int count = -1;
    TH_OK(ts_fsdp_apply_by_size(layer, 1, NULL, &count));
    cr_expect(ts_module_is_fsdp(sub(layer, "self_attn")));
    cr_expect(!ts_module_is_fsdp(sub(layer, "self_attn.out_proj")), "out_proj stays in the attention's group");
    cr_expect_eq(group_params(sub(layer, "self_attn")), 4);
    cr_expect(ts_module_is_fsdp(sub(layer, "linear1")) && ts_module_is_fsdp(sub(layer, "norm2")));
    cr_expect_eq(count, 5, "self_attn, linear1, linear2, norm1, norm2");
    ts_module_free(layer);

    /* a ModuleList is never sharded: its Linears (36 < 50) are left to the root */
    ts_module *l[2], *list, *root;
    TH_OK(ts_linear_new(6, 6, false, &l[0]));
    TH_OK(ts_linear_new(6, 6, false, &l[1]));
    TH_OK(ts_module_list_new(2, l, &list));
    TH_OK(ts_sequential_new(1, &list, &root));
    TH_OK(ts_fsdp_apply_by_size(root, 50, NULL, &count));
    cr_expect_eq(count, 0);
    cr_expect(!ts_module_is_fsdp(list));
    ts_module_free(root);
}

/* ------------------------------------------------------------ errors */

Test(fully_shard_policy, errors_name_the_problem_and_change_nothing)
{
    ts_module *m = seed_model();
    int count = 7;
    cr_expect_eq(ts_fsdp_apply_by_type(NULL, "Block", NULL, &count), TS_ERR_INVALID_ARGUMENT);
    cr_expect(strstr(ts_last_error(), "root"), "%s", ts_last_error());
    cr_expect_eq(ts_fsdp_apply_by_type(m, NULL, NULL, &count), TS_ERR_INVALID_ARGUMENT);
    cr_expect(strstr(ts_last_error(), "NULL"), "%s", ts_last_error());
    cr_expect_eq(ts_fsdp_apply_by_type(m, "", NULL, &count), TS_ERR_INVALID_ARGUMENT);
    cr_expect(strstr(ts_last_error(), "empty"), "%s", ts_last_error());
    cr_expect_eq(ts_fsdp_apply_by_size(NULL, 30, NULL, &count), TS_ERR_INVALID_ARGUMENT);
    cr_expect_eq(ts_fsdp_apply_by_size(m, 0, NULL, &count), TS_ERR_INVALID_ARGUMENT);
    cr_expect(strstr(ts_last_error(), "got 0"), "%s", ts_last_error());
    cr_expect_eq(ts_fsdp_apply_by_size(m, -5, NULL, &count), TS_ERR_INVALID_ARGUMENT);
    cr_expect(strstr(ts_last_error(), "got -5"), "%s", ts_last_error());
    cr_expect_eq(count, 7, "count_out is written only on success");
    cr_expect_eq(fsdp_modules(m), 0);

    /* a bad option fails at the first module, naming it; nothing is sharded */
    ts_fsdp_options o = ts_fsdp_options_default();
    o.reshard_after_forward = TS_RESHARD_EVERY_N;
    o.reshard_every_n = 0;
    cr_expect_eq(ts_fsdp_apply_by_type(m, "Block", &o, &count), TS_ERR_INVALID_ARGUMENT);
    cr_expect(strstr(ts_last_error(), "'0'"), "%s", ts_last_error());
    cr_expect_eq(fsdp_modules(m), 0);

    /* the root already sharded: its group holds everything */
    TH_OK(ts_fully_shard(m, NULL));
    cr_expect_eq(ts_fsdp_apply_by_size(m, 30, NULL, &count), TS_ERR_ALREADY);
    cr_expect(strstr(ts_last_error(), "already sharded"), "%s", ts_last_error());
    cr_expect_eq(ts_fsdp_apply_by_type(m, "Block", NULL, &count), TS_ERR_ALREADY);
    cr_expect_eq(count, 7);
    ts_module_free(m);
}

/* On a GPT (d_model 64): with a floor of 10000, each block's attention
 * (16640, out_proj inside it) and both MLP Linears (16640, 16448) are
 * sharded, the LayerNorms (128) and what is left of a block (256) are not,
 * and the sharded model runs forward and backward with a gradient on
 * every parameter. */
Test(fully_shard_policy, by_size_on_a_gpt_runs_forward_and_backward, .timeout = 60)
{
    ts_gpt_config cfg = ts_gpt_config_default();
    cfg.vocab_size = 26;
    cfg.block_size = 16;
    cfg.n_layer = 2;
    cfg.n_head = 4;
    cfg.d_model = 64;
    ts_module *m;
    ts_manual_seed(1);
    TH_OK(ts_gpt_new(&cfg, &m));
    int count = -1;
    TH_OK(ts_fsdp_apply_by_size(m, 10000, NULL, &count));
    cr_expect_eq(count, 6, "3 per block");
    cr_expect(ts_module_is_fsdp(sub(m, "blocks.1.attn")));
    cr_expect(!ts_module_is_fsdp(sub(m, "blocks.1.attn.out_proj")));
    cr_expect(ts_module_is_fsdp(sub(m, "blocks.0.mlp.0")) && ts_module_is_fsdp(sub(m, "blocks.0.mlp.2")));
    cr_expect(!ts_module_is_fsdp(sub(m, "blocks.0")) && !ts_module_is_fsdp(sub(m, "blocks.0.ln1")));
    TH_OK(ts_fully_shard(m, NULL));
    int64_t is[2] = {2, 16};
    int64_t ids[32];
    for (int i = 0; i < 32; i++) ids[i] = (i * 7) % 26;
    ts_tensor *x, *logits, *loss;
    TH_OK(ts_tensor_from_data(TS_I64, 2, is, ids, &x));
    TH_OK(ts_module_call1(m, x, &logits));
    TH_OK(ts_mean(logits, 0, NULL, false, &loss));
    TH_OK(ts_backward(loss, NULL, false));
    ts_named_params np;
    TH_OK(ts_module_named_parameters(m, &np));
    for (int i = 0; i < np.n; i++)
        cr_expect_not_null(ts_tensor_grad(*np.items[i].slot), "%s has no gradient", np.items[i].name);
    ts_named_params_free(&np);
    ts_tensor_free(loss);
    ts_tensor_free(logits);
    ts_tensor_free(x);
    ts_module_free(m);
}
