/* nn_reset_parameters: the reset_parameters slot of every nn layer, and
 * deferred construction. Two properties, bitwise:
 * - resetting a freshly seeded module (recursively, children first)
 *   gives what building it gave, and leaves the generator where building
 *   left it (the constructors call the same functions);
 * - building on meta parameters records the initializers without drawing
 *   ([Note: deferred init] in tensor/internal.h); replaying every
 *   parameter's events in sequence order (and the orphaned draws of
 *   parameters freed while building: a tied weight) into fresh buffers
 *   gives the eager parameters and the eager generator state. */
#include <math.h>

#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "fully_shard/internal.h"
#include "nn/internal.h"
#include "tensor/internal.h"
#include "tests/helpers.h"

/* ------------------------------------------------------------- a user module type */

/* A user's module: its own scale (uniform) and shift (a constant), a
 * parameter it never fills (ts_param_new's zeros), a child Linear; the
 * constructor calls its reset_parameters. */
typedef struct scaled {
    ts_module base;
    ts_module *fc;
    ts_tensor *scale, *shift, *zero;
} scaled;

static ts_status scaled_visit(ts_module *m, const ts_module_visitor *v)
{
    scaled *s = (scaled *)m;
    ts_status st = TS_OK;
    if (v->param && !(st = v->param(v->ctx, "scale", &s->scale)) && !(st = v->param(v->ctx, "shift", &s->shift)))
        st = v->param(v->ctx, "zero", &s->zero);
    if (!st && v->child) st = v->child(v->ctx, "fc", s->fc);
    return st;
}

static void scaled_free(ts_module *m)
{
    scaled *s = (scaled *)m;
    ts_module_free(s->fc);
    ts_tensor_free(s->scale);
    ts_tensor_free(s->shift);
    ts_tensor_free(s->zero);
    free(s);
}

static ts_status scaled_reset(ts_module *m)
{
    scaled *s = (scaled *)m;
    ts_status st = ts_uniform_(s->scale, 0.5, 1.5, NULL);
    return st ? st : ts_tensor_fill_(s->shift, -0.25);
}

static const ts_module_vtable scaled_vt = {
    .type_name = "Scaled", .visit = scaled_visit, .free = scaled_free, .reset_parameters = scaled_reset};

static ts_status scaled_new(ts_module **out)
{
    scaled *s = calloc(1, sizeof *s);
    cr_assert_not_null(s);
    TH_OK(ts_module_init(&s->base, &scaled_vt));
    int64_t d = 37;
    ts_status st = ts_linear_new(d, 3, true, &s->fc);
    if (!st && !(st = ts_param_new(TS_F32, 1, &d, &s->scale)) && !(st = ts_param_new(TS_F32, 1, &d, &s->shift)) &&
        !(st = ts_param_new(TS_F32, 2, (int64_t[]){3, 5}, &s->zero)))
        st = scaled_reset(&s->base);
    if (st) {
        scaled_free(&s->base);
        return st;
    }
    *out = &s->base;
    return TS_OK;
}

/* ------------------------------------------------------------- the layers */

typedef ts_status (*build_fn)(ts_module **out);

static ts_status b_linear(ts_module **o) { return ts_linear_new(19, 33, true, o); }
static ts_status b_linear_nobias(ts_module **o) { return ts_linear_new(7, 5, false, o); }
static ts_status b_embedding(ts_module **o) { return ts_embedding_new(50, 17, o); }
static ts_status b_layer_norm(ts_module **o) { return ts_layer_norm_new(21, 1e-5, true, o); }
static ts_status b_mha(ts_module **o) { return ts_mha_new(16, 4, 0.0, true, o); }
static ts_status b_mha_nobias(ts_module **o) { return ts_mha_new(12, 3, 0.0, false, o); }
static ts_status b_encoder_layer(ts_module **o)
{
    ts_encoder_layer_config c = ts_encoder_layer_config_default(16, 2);
    c.dim_feedforward = 40;
    return ts_encoder_layer_new(&c, o);
}
static ts_status b_gpt(ts_module **o)
{
    ts_gpt_config c = ts_gpt_config_default();
    c.vocab_size = 61, c.block_size = 24, c.n_layer = 2, c.n_head = 2, c.d_model = 32;
    return ts_gpt_new(&c, o);
}
static ts_status b_gpt_tied(ts_module **o)
{
    ts_gpt_config c = ts_gpt_config_default();
    c.vocab_size = 61, c.block_size = 24, c.n_layer = 2, c.n_head = 2, c.d_model = 32, c.tie_weights = true;
    return ts_gpt_new(&c, o);
}
static ts_status b_encoder(ts_module **o)
{
    ts_encoder_layer_config c = ts_encoder_layer_config_default(8, 2);
    c.dim_feedforward = 12;
    return ts_transformer_encoder_new(&c, 3, o);
}
static ts_status b_user(ts_module **o) { return scaled_new(o); }
static ts_status b_sequential(ts_module **o)
{
    ts_module *k[3];
    TH_OK(ts_linear_new(6, 9, true, &k[0]));
    TH_OK(ts_relu_new(&k[1]));
    TH_OK(ts_layer_norm_new(9, 1e-5, true, &k[2]));
    return ts_sequential_new(3, k, o);
}

typedef struct layer_case {
    const char *name;
    build_fn build;
    /* a weight shared by two modules, or layers copied from one another:
     * resetting is not building */
    bool tied;
} layer_case;

static const layer_case cases[] = {
    {"Linear", b_linear, false},
    {"Linear(bias=False)", b_linear_nobias, false},
    {"Embedding", b_embedding, false},
    {"LayerNorm", b_layer_norm, false},
    {"MultiheadAttention", b_mha, false},
    {"MultiheadAttention(bias=False)", b_mha_nobias, false},
    {"TransformerEncoderLayer", b_encoder_layer, false},
    {"Sequential", b_sequential, false},
    {"GPT", b_gpt, false},
    {"GPT(tie_weights)", b_gpt_tied, true},
    {"TransformerEncoder (copied layers)", b_encoder, true},
    {"user module", b_user, false},
};
#define N_CASES ((int)(sizeof cases / sizeof cases[0]))

/* ------------------------------------------------------------- helpers */

typedef struct state {
    uint8_t b[TS_GENERATOR_STATE_BYTES];
} state;

static state gen_state(void)
{
    state s;
    ts_generator_get_state(NULL, s.b);
    return s;
}

/* Bytes of every parameter of m, in named_parameters order (each tensor
 * once), into one malloc'd buffer; *n_out the parameter count. */
static uint8_t *param_bytes(ts_module *m, size_t *len_out, int *n_out)
{
    ts_named_params p;
    TH_OK(ts_module_named_parameters(m, &p));
    size_t len = 0;
    for (int i = 0; i < p.n; i++) len += (size_t)ts_tensor_numel(*p.items[i].slot) * 4;
    uint8_t *buf = malloc(len + 1), *q = buf;
    for (int i = 0; i < p.n; i++) {
        ts_tensor *t = *p.items[i].slot;
        cr_assert(ts_tensor_is_contiguous(t));
        size_t nb = (size_t)ts_tensor_numel(t) * 4;
        memcpy(q, ts_tensor_data(t), nb);
        q += nb;
    }
    *len_out = len;
    *n_out = p.n;
    ts_named_params_free(&p);
    return buf;
}

/* ------------------------------------------------------------- reset = build */

Test(nn_reset_parameters, reset_after_reseed_is_building)
{
    for (int c = 0; c < N_CASES; c++) {
        if (cases[c].tied) continue;
        ts_module *m;
        ts_manual_seed(77);
        TH_OK(cases[c].build(&m));
        state built = gen_state();
        size_t len, len2;
        int n, n2;
        uint8_t *want = param_bytes(m, &len, &n);
        /* scramble, so that a reset that skips a parameter shows */
        ts_named_params p;
        TH_OK(ts_module_named_parameters(m, &p));
        for (int i = 0; i < p.n; i++)
            if (!strstr(p.items[i].name, "zero")) /* the user module's never-filled parameter */
                TH_OK(ts_tensor_fill_(*p.items[i].slot, 123.0));
        ts_named_params_free(&p);
        ts_manual_seed(77);
        TH_OK(ts_module_reset_parameters(m, true));
        state reset = gen_state();
        uint8_t *got = param_bytes(m, &len2, &n2);
        cr_assert_eq(len, len2);
        cr_assert(memcmp(got, want, len) == 0, "%s: reset_parameters(recurse) after reseeding differs from building",
                  cases[c].name);
        cr_assert(memcmp(&built, &reset, sizeof built) == 0,
                  "%s: the generator after reset differs from after building", cases[c].name);
        free(got);
        free(want);
        ts_module_free(m);
    }
}

Test(nn_reset_parameters, not_recursive_touches_only_the_module)
{
    ts_module *m;
    TH_OK(b_mha(&m));
    ts_tensor *w, *ow;
    TH_OK(ts_module_get_parameter(m, "out_proj.weight", &ow));
    TH_OK(ts_module_get_parameter(m, "in_proj_weight", &w));
    TH_OK(ts_tensor_fill_(ow, 5.0));
    TH_OK(ts_tensor_fill_(w, 5.0));
    TH_OK(ts_module_reset_parameters(m, false));
    float wv, owv;
    memcpy(&wv, ts_tensor_data(w), 4);
    memcpy(&owv, ts_tensor_data(ow), 4);
    cr_assert_neq(wv, 5.0f, "in_proj_weight is the MHA's own: reset");
    cr_assert_eq(owv, 5.0f, "out_proj.weight is the child's: not reset without recurse");
    ts_module_free(m);

    ts_module *r;
    TH_OK(ts_relu_new(&r));
    TH_OK(ts_module_reset_parameters(r, true)); /* NULL slot: nothing to do */
    ts_module_free(r);
    TH_FAILS(ts_module_reset_parameters(NULL, true), TS_ERR_INVALID_ARGUMENT, "NULL");
}

/* The vtables the checkpoint wrapper and fully_shard make carry the slot. */
Test(nn_reset_parameters, extended_vtables_forward_the_slot)
{
    ts_module *m;
    TH_OK(b_linear(&m));
    ts_status (*orig)(ts_module *) = m->vtable->reset_parameters;
    cr_assert_not_null(orig);
    const ts_module_vtable *fv = NULL;
    TH_OK(ts__fsdp_vtable(m->vtable, &fv));
    cr_assert_eq(fv->reset_parameters, orig, "%s lacks the slot", fv->type_name);
    TH_OK(ts_checkpoint_module(m));
    cr_assert_neq(m->vtable, fv);
    cr_assert_eq(m->vtable->reset_parameters, orig, "%s lacks the slot", m->vtable->type_name);
    ts_manual_seed(1);
    TH_OK(ts_module_reset_parameters(m, true));
    ts_module_free(m);
}

/* ------------------------------------------------------------- deferred = eager */

/* One replay target per storage of m's parameters, in named_parameters
 * order (a tied weight once), full range, f32 buffers. */
typedef struct replay_set {
    ts__init_target tg[64];
    ts_tensor *param[64];
    int n;
} replay_set;

static void collect_targets(ts_module *m, replay_set *rs)
{
    ts_named_params p;
    TH_OK(ts_module_named_parameters(m, &p));
    rs->n = 0;
    for (int i = 0; i < p.n; i++) {
        ts_tensor *t = *p.items[i].slot;
        cr_assert(ts__is_meta(t), "%s is not meta", p.items[i].name);
        cr_assert_lt(rs->n, 64);
        int64_t n = ts_tensor_numel(t);
        rs->param[rs->n] = t;
        rs->tg[rs->n++] = (ts__init_target){&t->storage->init_log, 0, n, TS_F32, malloc((size_t)n * 4 + 1)};
    }
    ts_named_params_free(&p);
}

Test(nn_reset_parameters, built_on_meta_and_replayed_is_eager)
{
    for (int c = 0; c < N_CASES; c++) {
        ts_module *e, *m;
        ts_manual_seed(2024);
        TH_OK(cases[c].build(&e));
        state built = gen_state();
        size_t len;
        int n;
        uint8_t *want = param_bytes(e, &len, &n);

        ts_manual_seed(2024);
        state seeded = gen_state();
        uint64_t seq0 = ts__init_seq_next();
        TH_OK(ts_device_scope_enter(TS_DEVICE_META));
        ts_status st = cases[c].build(&m);
        TH_OK(ts_device_scope_exit());
        TH_OK(st);
        uint64_t seq1 = ts__init_seq_next();
        state after_meta = gen_state();
        cr_assert(memcmp(&seeded, &after_meta, sizeof seeded) == 0, "%s: building on meta drew numbers", cases[c].name);

        replay_set rs;
        collect_targets(m, &rs);
        cr_assert_eq(rs.n, n, "%s: %d meta parameters, %d eager", cases[c].name, rs.n, n);
        ts__init_log orphans = {0};
        TH_OK(ts__init_orphans_take(seq0, seq1, &orphans));
        if (cases[c].build == b_gpt_tied)
            cr_assert_gt(orphans.n, 0, "%s: the replaced lm_head weight's draws are kept", cases[c].name);
        rs.tg[rs.n] = (ts__init_target){&orphans, 0, 0, TS_F32, NULL};
        ts_manual_seed(2024);
        TH_OK(ts__init_replay_targets(rs.n + 1, rs.tg));
        state replayed = gen_state();
        cr_assert(memcmp(&built, &replayed, sizeof built) == 0,
                  "%s: the generator after the replay differs from "
                  "after building eagerly",
                  cases[c].name);
        size_t off = 0;
        for (int i = 0; i < rs.n; i++) {
            size_t nb = (size_t)ts_tensor_numel(rs.param[i]) * 4;
            th_vec_expect_bytes(cases[c].name, TS_F32, rs.tg[i].dst, want + off, (int64_t)(nb / 4));
            off += nb;
            free(rs.tg[i].dst);
        }
        cr_assert_eq(off, len);
        ts__init_log_fini(&orphans);
        free(want);
        ts_module_free(m);
        ts_module_free(e);
    }
}

/* ts_module_to_dtype on a deferred model moves each parameter's events to
 * its converted meta storage; replayed into that dtype, they give what
 * converting the eager model gives. */
Test(nn_reset_parameters, deferred_to_dtype_replays_in_the_new_dtype)
{
    ts_dtype dts[2] = {TS_BF16, TS_F16};
    for (int d = 0; d < 2; d++) {
        ts_module *e, *m;
        ts_manual_seed(9);
        TH_OK(b_gpt_tied(&e));
        TH_OK(ts_module_to_dtype(e, dts[d]));
        ts_manual_seed(9);
        uint64_t seq0 = ts__init_seq_next();
        TH_OK(ts_device_scope_enter(TS_DEVICE_META));
        ts_status st = b_gpt_tied(&m);
        TH_OK(ts_device_scope_exit());
        TH_OK(st);
        TH_OK(ts_module_to_dtype(m, dts[d]));
        uint64_t seq1 = ts__init_seq_next();
        ts_named_params pe, pm;
        TH_OK(ts_module_named_parameters(e, &pe));
        TH_OK(ts_module_named_parameters(m, &pm));
        cr_assert_eq(pe.n, pm.n);
        cr_assert_lt(pm.n, 63);
        ts__init_target tg[64];
        for (int i = 0; i < pm.n; i++) {
            ts_tensor *t = *pm.items[i].slot;
            cr_assert(ts__is_meta(t) && ts_tensor_dtype(t) == dts[d], "%s", pm.items[i].name);
            int64_t n = ts_tensor_numel(t);
            tg[i] = (ts__init_target){&t->storage->init_log, 0, n, dts[d], malloc((size_t)n * 2)};
        }
        ts__init_log orphans = {0};
        TH_OK(ts__init_orphans_take(seq0, seq1, &orphans));
        tg[pm.n] = (ts__init_target){&orphans, 0, 0, dts[d], NULL};
        ts_manual_seed(9);
        TH_OK(ts__init_replay_targets(pm.n + 1, tg));
        for (int i = 0; i < pm.n; i++) {
            th_vec_expect_bytes(pm.items[i].name, dts[d], tg[i].dst, ts_tensor_data(*pe.items[i].slot),
                                ts_tensor_numel(*pe.items[i].slot));
            free(tg[i].dst);
        }
        ts__init_log_fini(&orphans);
        ts_named_params_free(&pe);
        ts_named_params_free(&pm);
        ts_module_free(m);
        ts_module_free(e);
    }
}
