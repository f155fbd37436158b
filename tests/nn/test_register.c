/* Declared slots (nn/nn.h, ts_module_register_*): a module type that
 * declares its parameter, buffer and child instead of writing visit and
 * free is, to every walker, the same module as one written by hand:
 * names, printing, state dicts, to_dtype, fully_shard's slot swaps,
 * activation checkpointing, deferred init and training give the same
 * strings and bits. Errors name what is wrong. */
#include "fully_shard/fully_shard.h"
#include "nn/nn.h"
#include "optim/optim.h"
#include "tests/loopback_ranks.h"

#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------ the two block types */

/* y = x + gain * tanh(fc(x)); a buffer counts training forwards. */
typedef struct block {
    ts_module base;
    ts_module *fc;
    ts_tensor *gain, *steps;
    int64_t dim;
} block;

static ts_status block_reset(ts_module *m)
{
    block *b = (block *)m;
    TS_TRY(ts_uniform_(b->gain, -1.0, 1.0, NULL)); /* a draw: deferred init must replay it */
    return ts_tensor_fill_(b->steps, 0.0);
}

static void count_step(ts_module *m)
{
    int64_t *n = ts_tensor_data(((block *)m)->steps);
    if (m->training && n) n[0]++;
}

/* Declared: ts_module_new, the slots declared, a scoped forward. */
static ts_status decl_forward(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    block *b = (block *)m;
    TS_CHECK(n_in == 1, TS_ERR_INVALID_ARGUMENT, "Block: 1 input, got %d", n_in);
    ts_scope s = ts_scope_begin();
    ts_tensor *h, *y;
    TS_SCOPED(s, h, ts_module_call1(b->fc, in[0], &h));
    TS_SCOPED(s, h, ts_tanh(h, &h));
    TS_SCOPED(s, h, ts_mul(h, b->gain, &h));
    TS_SCOPED(s, y, ts_add(in[0], h, &y));
    count_step(m);
    return ts_scope_return(s, 1, &y, n_out, out);
}

static const ts_module_vtable decl_vt = {
    .type_name = "Block", .forward = decl_forward, .reset_parameters = block_reset};

static ts_status decl_new(int64_t dim, ts_module **out)
{
    ts_module *m;
    TS_TRY(ts_module_new(sizeof(block), &decl_vt, &m));
    block *b = (block *)m;
    b->dim = dim;
    ts_status st = ts_module_param_new(m, "gain", TS_F32, 1, &dim, &b->gain);
    if (!st) st = ts_module_buffer_new(m, "steps", TS_I64, 0, NULL, &b->steps);
    if (!st) st = ts_module_register_child(m, "fc", &b->fc);
    if (!st) st = ts_linear_new(dim, dim, true, &b->fc);
    if (!st) st = block_reset(m);
    if (st) {
        ts_module_free(m);
        return st;
    }
    *out = m;
    return TS_OK;
}

/* By hand: visit, free, a forward with a cleanup label. */
static ts_status hand_forward(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    block *b = (block *)m;
    TS_CHECK(n_in == 1, TS_ERR_INVALID_ARGUMENT, "Block: 1 input, got %d", n_in);
    ts_status st;
    ts_tensor *h = NULL, *a = NULL, *g = NULL, *y = NULL;
    TS_TRY_GOTO(st, ts_module_call1(b->fc, in[0], &h), done);
    TS_TRY_GOTO(st, ts_tanh(h, &a), done);
    TS_TRY_GOTO(st, ts_mul(a, b->gain, &g), done);
    TS_TRY_GOTO(st, ts_add(in[0], g, &y), done);
    count_step(m);
    out[0] = y, y = NULL, *n_out = 1;
done:
    ts_tensor_free(h);
    ts_tensor_free(a);
    ts_tensor_free(g);
    ts_tensor_free(y);
    return st;
}

static ts_status hand_visit(ts_module *m, const ts_module_visitor *v)
{
    block *b = (block *)m;
    if (v->param) TS_TRY(v->param(v->ctx, "gain", &b->gain));
    if (v->buffer) TS_TRY(v->buffer(v->ctx, "steps", &b->steps));
    if (v->child) TS_TRY(v->child(v->ctx, "fc", b->fc));
    return TS_OK;
}

static void hand_free(ts_module *m)
{
    block *b = (block *)m;
    ts_module_free(b->fc);
    ts_tensor_free(b->gain);
    ts_tensor_free(b->steps);
    free(b);
}

static const ts_module_vtable hand_vt = {.type_name = "Block",
                                         .forward = hand_forward,
                                         .visit = hand_visit,
                                         .free = hand_free,
                                         .reset_parameters = block_reset};

static ts_status hand_new(int64_t dim, ts_module **out)
{
    block *b = calloc(1, sizeof *b);
    TS_CHECK(b, TS_ERR_NO_MEMORY, "out of memory");
    ts_module_init(&b->base, &hand_vt);
    b->dim = dim;
    ts_status st = ts_linear_new(dim, dim, true, &b->fc);
    if (!st) st = ts_param_new(TS_F32, 1, &dim, &b->gain);
    if (!st) st = ts_tensor_zeros(TS_I64, 0, NULL, &b->steps);
    if (!st) st = block_reset(&b->base);
    if (st) {
        hand_free(&b->base);
        return st;
    }
    *out = &b->base;
    return TS_OK;
}

typedef ts_status (*block_new_fn)(int64_t dim, ts_module **out);

/* Sequential(Linear(4, 8), Block(8), Block(8)), each piece from the seed. */
static ts_status model_new(block_new_fn make, ts_module **out)
{
    ts_module *k[3] = {NULL, NULL, NULL};
    ts_status st = ts_linear_new(4, 8, true, &k[0]);
    if (!st) st = make(8, &k[1]);
    if (!st) st = make(8, &k[2]);
    if (!st) st = ts_sequential_new(3, k, out);
    if (st)
        for (int i = 0; i < 3; i++) ts_module_free(k[i]);
    return st;
}

static ts_tensor *input(void)
{
    int64_t sh[2] = {6, 4};
    return th_seq(TS_F32, 2, sh, 0.1, false);
}

/* Asserts equal bits (or both NULL). */
static void same_bits(const ts_tensor *a, const ts_tensor *b, const char *what)
{
    cr_assert_eq(a == NULL, b == NULL, "%s: one is NULL", what);
    if (!a) return;
    cr_assert_eq(ts_tensor_dtype(a), ts_tensor_dtype(b), "%s", what);
    cr_assert_eq(ts_tensor_numel(a), ts_tensor_numel(b), "%s", what);
    cr_assert_eq(
        memcmp(ts_tensor_data(a), ts_tensor_data(b), (size_t)ts_tensor_numel(a) * ts_dtype_size(ts_tensor_dtype(a))), 0,
        "%s: the bits differ", what);
}

/* ------------------------------------------------------------ one process */

Test(nn_register, the_same_tree_as_written_by_hand)
{
    ts_module *hand = NULL, *decl = NULL;
    ts_manual_seed(7);
    TH_OK(model_new(hand_new, &hand));
    ts_manual_seed(7);
    TH_OK(model_new(decl_new, &decl));

    /* printing: the same text */
    char rh[2048], rd[2048];
    size_t lh = 0, ld = 0;
    TH_OK(ts_module_repr(hand, rh, sizeof rh, &lh));
    TH_OK(ts_module_repr(decl, rd, sizeof rd, &ld));
    cr_assert_str_eq(rd, rh);
    cr_assert_not_null(strstr(rd, "(1): Block(\n    gain (8,), buffer steps int64 ()\n    (fc): Linear("), "%s", rd);

    /* state dicts: the same names in the same order, the same bits */
    ts_state_dict *sh = NULL, *sd = NULL;
    TH_OK(ts_module_state_dict(hand, &sh));
    TH_OK(ts_module_state_dict(decl, &sd));
    cr_assert_eq(ts_state_dict_size(sd), ts_state_dict_size(sh));
    cr_assert_eq(ts_state_dict_size(sd), 10); /* Linear's 2, each block's gain, steps and fc's 2 */
    for (int i = 0; i < ts_state_dict_size(sh); i++) {
        cr_assert_str_eq(ts_state_dict_name(sd, i), ts_state_dict_name(sh, i));
        same_bits(ts_state_dict_tensor(sd, i), ts_state_dict_tensor(sh, i), ts_state_dict_name(sh, i));
    }
    cr_assert_eq(ts_module_num_parameters(decl), ts_module_num_parameters(hand));
    TH_OK(ts_module_load_state_dict(decl, sh, true));
    ts_state_dict_free(sh);
    ts_state_dict_free(sd);

    /* lookups by name */
    ts_tensor *t = NULL;
    TH_OK(ts_module_get_parameter(decl, "2.gain", &t));
    TH_OK(ts_module_get_buffer(decl, "2.steps", &t));
    TH_FAILS(ts_module_get_parameter(decl, "2.steps", &t), TS_ERR_NOT_FOUND, "(it is a buffer)");

    /* forward and backward: the same bits, the buffers counted */
    ts_tensor *x = input(), *yh = NULL, *yd = NULL, *lh_ = NULL, *ld_ = NULL;
    TH_OK(ts_module_call1(hand, x, &yh));
    TH_OK(ts_module_call1(decl, x, &yd));
    same_bits(yd, yh, "output");
    TH_OK(ts_sum(yh, 0, NULL, false, &lh_));
    TH_OK(ts_sum(yd, 0, NULL, false, &ld_));
    TH_OK(ts_backward(lh_, NULL, false));
    TH_OK(ts_backward(ld_, NULL, false));
    ts_named_params ph, pd;
    TH_OK(ts_module_named_parameters(hand, &ph));
    TH_OK(ts_module_named_parameters(decl, &pd));
    cr_assert_eq(pd.n, ph.n);
    for (int i = 0; i < ph.n; i++) {
        cr_assert_str_eq(pd.items[i].name, ph.items[i].name);
        same_bits(ts_tensor_grad(*pd.items[i].slot), ts_tensor_grad(*ph.items[i].slot), ph.items[i].name);
    }
    ts_named_params_free(&ph);
    ts_named_params_free(&pd);
    double steps = 0;
    TH_OK(ts_module_get_buffer(decl, "1.steps", &t));
    TH_OK(ts_tensor_item(t, &steps));
    cr_assert_eq(steps, 1.0);

    /* reset and conversion reach the declared slots */
    ts_manual_seed(3);
    TH_OK(ts_module_reset_parameters(hand, true));
    ts_manual_seed(3);
    TH_OK(ts_module_reset_parameters(decl, true));
    ts_tensor *gh = NULL, *gd = NULL;
    TH_OK(ts_module_get_parameter(hand, "1.gain", &gh));
    TH_OK(ts_module_get_parameter(decl, "1.gain", &gd));
    same_bits(gd, gh, "1.gain after reset");
    TH_OK(ts_module_to_dtype(decl, TS_F64));
    TH_OK(ts_module_get_parameter(decl, "1.gain", &gd));
    cr_assert_eq(ts_tensor_dtype(gd), TS_F64);

    ts_tensor_free(lh_);
    ts_tensor_free(ld_);
    ts_tensor_free(yh);
    ts_tensor_free(yd);
    ts_tensor_free(x);
    ts_module_free(hand);
    ts_module_free(decl);
}

/* The base frees the declared slots and the struct: nothing stays
 * allocated, also when the constructor fails half-way (every slot
 * declared before it is filled). */
static ts_status failing_new(ts_module **out)
{
    ts_module *m;
    TS_TRY(ts_module_new(sizeof(block), &decl_vt, &m));
    block *b = (block *)m;
    int64_t dim = 4, bad = -1;
    ts_status st = ts_module_param_new(m, "gain", TS_F32, 1, &dim, &b->gain);
    if (!st) st = ts_module_register_child(m, "fc", &b->fc);
    if (!st) st = ts_linear_new(dim, dim, true, &b->fc);
    if (!st) st = ts_module_buffer_new(m, "steps", TS_I64, 1, &bad, &b->steps); /* a negative size */
    if (st) {
        ts_module_free(m);
        return st;
    }
    *out = m;
    return TS_OK;
}

/* A declared block checkpointed, then sharded (fully_shard's free puts
 * the checkpoint's vtable back, whose free puts the block's back). */
static void wrapped_block_free(void)
{
    ts_module *m = NULL;
    TH_OK(decl_new(4, &m));
    TH_OK(ts_checkpoint_module(m));
    TH_OK(ts_fully_shard(m, NULL));
    cr_assert_str_eq(ts_module_type_name(m), "BlockCheckpointedFSDPModule");
    ts_module_free(m);
}

Test(nn_register, freeing_releases_everything)
{
    ts_module *m = NULL;
    TH_OK(decl_new(4, &m)); /* first use: the library's one-time tables */
    ts_module_free(m);
    wrapped_block_free();
    th_mem_mark();
    wrapped_block_free();
    TH_OK(model_new(decl_new, &m));
    ts_module *shared = NULL;
    TH_OK(decl_new(4, &shared));
    ts_module *k[2] = {shared, ts_module_retain(shared)}, *two = NULL;
    TH_OK(ts_sequential_new(2, k, &two)); /* one child in two parents: freed once, by the last */
    ts_module_free(two);
    ts_module_free(shared);
    ts_module_free(m);
    m = NULL;
    cr_assert_neq(failing_new(&m), TS_OK);
    cr_assert_null(m);
    th_mem_assert_back();
}

Test(nn_register, errors_name_the_problem)
{
    ts_module *m = NULL, *lin = NULL;
    TH_OK(decl_new(4, &m));
    block *b = (block *)m;
    ts_tensor *extra = NULL, *other = NULL;
    int64_t two = 2;
    TH_FAILS(ts_module_register_param(m, "gain", &extra), TS_ERR_INVALID_ARGUMENT,
             "Block already has a parameter "
             "named 'gain'");
    TH_FAILS(ts_module_register_buffer(m, "fc", &extra), TS_ERR_INVALID_ARGUMENT, "already has a child named 'fc'");
    TH_FAILS(ts_module_register_param(m, "w", NULL), TS_ERR_INVALID_ARGUMENT, "the slot is NULL");
    TH_FAILS(ts_module_register_param(m, NULL, &extra), TS_ERR_INVALID_ARGUMENT, "the name is NULL");
    TH_FAILS(ts_module_register_param(NULL, "w", &extra), TS_ERR_INVALID_ARGUMENT, "the module is NULL");
    TH_FAILS(ts_module_register_param(m, "a.b", &extra), TS_ERR_INVALID_ARGUMENT, "'a.b' contains '.'");
    TH_FAILS(ts_module_register_param(m, "", &extra), TS_ERR_INVALID_ARGUMENT, "the name is empty");
    char longname[300];
    memset(longname, 'x', sizeof longname - 1);
    longname[sizeof longname - 1] = '\0';
    TH_FAILS(ts_module_register_param(m, longname, &extra), TS_ERR_INVALID_ARGUMENT, "299 characters (at most 255)");
    TH_FAILS(ts_module_register_param(m, "again", &b->gain), TS_ERR_INVALID_ARGUMENT,
             "the slot given for 'again' is declared already, as parameter 'gain'");
    TH_FAILS(ts_module_param_new(m, "w", TS_F32, 1, &two, &b->gain), TS_ERR_INVALID_ARGUMENT,
             "the slot for 'w' already holds a tensor");
    TH_FAILS(ts_module_param_new(m, "w", TS_I64, 1, &two, &extra), TS_ERR_DTYPE, "floating-point");
    cr_assert_null(extra, "a failed declaration leaves the slot as it was");
    TH_OK(ts_module_param_new(m, "w", TS_F32, 1, &two, &extra)); /* the failed one declared nothing */
    TH_FAILS(ts_module_new(sizeof(ts_module) - 1, &decl_vt, &lin), TS_ERR_INVALID_ARGUMENT, "smaller than a ts_module");
    /* a type with its own visit lists its slots there */
    TH_OK(ts_linear_new(2, 2, false, &lin));
    TH_FAILS(ts_module_register_param(lin, "extra", &other), TS_ERR_INVALID_ARGUMENT, "Linear has its own visit");
    /* ts_module_init still wants a free: the base frees only what it allocated */
    block on_stack;
    TH_FAILS(ts_module_init(&on_stack.base, &decl_vt), TS_ERR_INVALID_ARGUMENT, "the vtable of Block has no free");
    /* after an upper layer rewrote the module */
    TH_OK(ts_checkpoint_module(m));
    TH_FAILS(ts_module_register_param(m, "late", &other), TS_ERR_STATE, "Block", "rewritten by an upper layer");
    /* the new parameter is in the tree, and freed with it */
    ts_tensor *w = NULL;
    TH_OK(ts_module_get_parameter(m, "w", &w));
    cr_assert_eq(w, extra);
    ts_module_free(lin);
    ts_module_free(m);
    cr_assert_null(extra, "the base set the slot to NULL when it freed it");
}

/* ------------------------------------------------------------ sharded, checkpointed, deferred */

#define TIMEOUT_S 30.0

static ts_status sharded_model(block_new_fn make, bool deferred, ts_mesh *mesh, ts_module **out)
{
    ts_module *m = NULL;
    ts_manual_seed(11);
    if (deferred) TS_TRY(ts_device_scope_enter(TS_DEVICE_META));
    ts_status st = model_new(make, &m);
    if (deferred) ts_device_scope_exit();
    TS_TRY(st);
    ts_fsdp_options o = ts_fsdp_options_default();
    o.mesh = mesh;
    ts_module *b1 = ts_container_child(m, 1), *b2 = ts_container_child(m, 2);
    /* block 1 checkpointed then sharded; block 2 in the root's group, checkpointed after */
    if (!st) st = ts_checkpoint_module(b1);
    if (!st) st = ts_fully_shard(b1, &o);
    if (!st) st = ts_fully_shard(m, &o);
    if (!st) st = ts_checkpoint_module(b2);
    if (!st && deferred) st = ts_fsdp_materialize(m);
    if (st) {
        ts_module_free(m);
        return st;
    }
    *out = m;
    return TS_OK;
}

/* Two SGD steps; the losses in *losses. */
static ts_status train(ts_module *m, double *losses)
{
    ts_param_list p = {NULL, 0};
    ts_optim *opt = NULL;
    ts_tensor *x = input(), *y = NULL, *l = NULL;
    TS_TRY(ts_module_parameters(m, &p));
    ts_sgd_options so = ts_sgd_options_default();
    so.lr = 0.1;
    ts_status st = ts_sgd_new(p.n, p.items, &so, &opt);
    ts_param_list_free(&p);
    for (int i = 0; i < 2 && !st; i++) {
        st = ts_module_call1(m, x, &y);
        if (!st) st = ts_mean(y, 0, NULL, false, &l);
        if (!st) st = ts_backward(l, NULL, false);
        if (!st) st = ts_optim_step(opt);
        if (!st) st = ts_tensor_item(l, &losses[i]);
        ts_optim_zero_grad(opt, true);
        ts_tensor_free(y);
        ts_tensor_free(l);
        y = l = NULL;
    }
    ts_optim_free(opt);
    ts_tensor_free(x);
    return st;
}

static int rank_body(th_rank *rc)
{
    ts_generator *gen = NULL, *prev = NULL;
    TH_RK_OK(rc, ts_generator_new(0, &gen)); /* the rank's own: ts_manual_seed seeds it */
    prev = ts_generator_set_thread_default(gen);
    ts_mesh *mesh = th_rank_mesh(rc, false);
    if (!mesh) return th_rank_fail(rc, "mesh: %s", ts_last_error());
    ts_module *hand = NULL, *decl = NULL;
    TH_RK_OK(rc, sharded_model(hand_new, false, mesh, &hand));
    TH_RK_OK(rc, sharded_model(decl_new, true, mesh, &decl));
    int bad = 0;
    char rh[4096], rd[4096];
    size_t len = 0;
    if (ts_module_repr(hand, rh, sizeof rh, &len) || ts_module_repr(decl, rd, sizeof rd, &len))
        bad = th_rank_fail(rc, "repr: %s", ts_last_error());
    if (!bad && strcmp(rh, rd)) bad = th_rank_fail(rc, "the trees print differently:\n%s\n%s", rh, rd);
    if (!bad && !strstr(rd, "(1): BlockCheckpointedFSDPModule("))
        bad = th_rank_fail(rc, "block 1 is not checkpointed and sharded:\n%s", rd);
    if (!bad && !strstr(rd, "(2): BlockCheckpointed(\n    gain (4,) [shard], buffer steps int64 ()"))
        bad = th_rank_fail(rc, "block 2 is not checkpointed with its gain in the root's group:\n%s", rd);
    /* the shards after deferred init and after training: the same bits */
    double lh[2], ld[2];
    if (!bad && (train(hand, lh) || train(decl, ld))) bad = th_rank_fail(rc, "train: %s", ts_last_error());
    if (!bad && memcmp(lh, ld, sizeof lh))
        bad = th_rank_fail(rc, "losses %.9g %.9g by hand, %.9g %.9g declared", lh[0], lh[1], ld[0], ld[1]);
    ts_state_dict *sh = NULL, *sd = NULL;
    if (!bad && (ts_fsdp_full_state_dict(hand, false, &sh) || ts_fsdp_full_state_dict(decl, false, &sd)))
        bad = th_rank_fail(rc, "full state dict: %s", ts_last_error());
    if (!bad && ts_state_dict_size(sh) != ts_state_dict_size(sd))
        bad = th_rank_fail(rc, "%d entries by hand, %d declared", ts_state_dict_size(sh), ts_state_dict_size(sd));
    for (int i = 0; !bad && i < ts_state_dict_size(sh); i++) {
        if (strcmp(ts_state_dict_name(sh, i), ts_state_dict_name(sd, i)))
            bad = th_rank_fail(rc, "entry %d: '%s' by hand, '%s' declared", i, ts_state_dict_name(sh, i),
                               ts_state_dict_name(sd, i));
        else
            bad = th_rank_same_bits(rc, ts_state_dict_tensor(sh, i), ts_state_dict_tensor(sd, i), "%s",
                                    ts_state_dict_name(sh, i));
    }
    if (!bad && ts_fsdp_load_full_state_dict(decl, sh, true)) bad = th_rank_fail(rc, "load: %s", ts_last_error());
    /* declaring after sharding: the module itself, or one inside a sharded root */
    ts_tensor *late = NULL;
    if (!bad &&
        (ts_module_register_param(ts_container_child(decl, 1), "late", &late) != TS_ERR_SHARDED ||
         !strstr(ts_last_error(), "BlockCheckpointedFSDPModule: cannot declare 'late'")))
        bad = th_rank_fail(rc, "declaring in a sharded module: %s", ts_last_error());
    if (!bad &&
        (ts_module_register_param(ts_container_child(decl, 2), "late", &late) != TS_ERR_SHARDED ||
         !strstr(ts_last_error(), "its parameter 'gain' is sharded already")))
        bad = th_rank_fail(rc, "declaring in a module of the root's group: %s", ts_last_error());
    ts_state_dict_free(sh);
    ts_state_dict_free(sd);
    ts_module_free(hand);
    ts_module_free(decl);
    ts_mesh_free(mesh);
    ts_generator_set_thread_default(prev);
    ts_generator_free(gen);
    return bad;
}

Test(nn_register, sharded_checkpointed_deferred_as_by_hand, .timeout = 60)
{
    th_run_world(2, rank_body, NULL, TIMEOUT_S);
}

/* ------------------------------------------------------------ the vtable's input count */

/* y = a + b, with no check of its own: the vtable says 2 inputs. */
static ts_status pair_forward(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    (void)m, (void)n_in;
    *n_out = 1;
    return ts_add(in[0], in[1], &out[0]);
}

static const ts_module_vtable pair_vt = {.type_name = "Pair", .forward = pair_forward, .n_inputs = 2};

/* ts_module_call refuses another count than the vtable's n_inputs, naming
 * the type and both counts, before forward runs (which would read in[1]
 * past one input), also once checkpointed and sharded; a count out of
 * range is refused when the type is made. */
Test(nn_register, vtable_input_count_is_checked_for_forward)
{
    typedef struct pair {
        ts_module base;
        ts_tensor *w;
    } pair;
    ts_module *m;
    cr_assert_eq(ts_module_new(sizeof(pair), &pair_vt, &m), TS_OK, "%s", ts_last_error());
    int64_t n = 3;
    cr_assert_eq(ts_module_param_new(m, "w", TS_F32, 1, &n, &((pair *)m)->w), TS_OK, "%s", ts_last_error());
    ts_tensor *a, *b, *outs[TS_MODULE_MAX_IO];
    cr_assert_eq(ts_tensor_full(TS_F32, 1, &n, 2.0, &a), TS_OK);
    cr_assert_eq(ts_tensor_full(TS_F32, 1, &n, 3.0, &b), TS_OK);
    for (int stage = 0; stage < 3; stage++) {
        if (stage == 1) cr_assert_eq(ts_checkpoint_module(m), TS_OK, "%s", ts_last_error());
        if (stage == 2) cr_assert_eq(ts_fully_shard(m, NULL), TS_OK, "%s", ts_last_error());
        int nout = -1;
        cr_assert_eq(ts_module_call(m, 1, &a, &nout, outs), TS_ERR_INVALID_ARGUMENT, "stage %d", stage);
        cr_expect(strstr(ts_last_error(), "Pair's forward takes 2 inputs, got 1"), "stage %d: %s", stage,
                  ts_last_error());
        ts_tensor *ab[2] = {a, b};
        cr_assert_eq(ts_module_call(m, 2, ab, &nout, outs), TS_OK, "stage %d: %s", stage, ts_last_error());
        cr_assert_eq(nout, 1);
        cr_expect_eq(((const float *)ts_tensor_data(outs[0]))[2], 5.0f);
        ts_tensor_free(outs[0]);
    }
    ts_module_free(m);
    ts_tensor_free(a), ts_tensor_free(b);
    static const ts_module_vtable bad_vt = {.type_name = "Bad", .forward = pair_forward, .n_inputs = -1};
    cr_assert_eq(ts_module_new(sizeof(pair), &bad_vt, &m), TS_ERR_INVALID_ARGUMENT);
    cr_expect(strstr(ts_last_error(), "Bad takes n_inputs -1"), "%s", ts_last_error());
}
