/* tensor_init_replay: deferred init ([Note: deferred init] in
 * tensor/internal.h). An initializer given a meta tensor records an
 * event; replaying it into each rank's rows, as 1 to 4 ranks shard dim 0,
 * gives bitwise the eagerly filled tensor, and leaves the generator where
 * the eager fill left it. No tolerance: the replay repeats the eager
 * fill's draws and arithmetic. */
#include <math.h>

#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "tensor/internal.h"
#include "tensor/kernels.h"
#include "tests/helpers.h"

/* ------------------------------------------------------------- the fills */

typedef enum fill_kind {
    F_UNIFORM,
    F_NORMAL,
    F_BERNOULLI,
    F_CONSTANT,
    F_KAIMING_UNIFORM,
    F_KAIMING_NORMAL,
    F_XAVIER_UNIFORM,
    F_XAVIER_NORMAL,
    F_COUNT
} fill_kind;

static const char *const kind_names[F_COUNT] = {"uniform_",        "normal_",          "bernoulli_",
                                                "fill_",           "kaiming_uniform_", "kaiming_normal_",
                                                "xavier_uniform_", "xavier_normal_"};

static bool needs_2d(fill_kind k) { return k >= F_KAIMING_UNIFORM; }

static ts_status apply(fill_kind k, ts_tensor *t, ts_generator *gen)
{
    switch (k) {
    case F_UNIFORM: return ts_uniform_(t, -0.5, 2.0, gen);
    case F_NORMAL: return ts_normal_(t, 0.25, 1.5, gen);
    case F_BERNOULLI: return ts_bernoulli_(t, 0.3, gen);
    case F_CONSTANT: return ts_tensor_fill_(t, 0.1);
    case F_KAIMING_UNIFORM: return ts_init_kaiming_uniform_(t, sqrt(5.0), TS_FAN_IN, TS_NL_LEAKY_RELU, gen);
    case F_KAIMING_NORMAL: return ts_init_kaiming_normal_(t, 0.0, TS_FAN_OUT, TS_NL_RELU, gen);
    case F_XAVIER_UNIFORM: return ts_init_xavier_uniform_(t, 1.0, gen);
    case F_XAVIER_NORMAL: return ts_init_xavier_normal_(t, 2.0, gen);
    default: return TS_ERR_INVALID_ARGUMENT;
    }
}

/* ------------------------------------------------------------- helpers */

typedef struct state {
    uint8_t b[TS_GENERATOR_STATE_BYTES];
} state;

static state state_of(ts_generator *g)
{
    state s;
    ts_generator_get_state(g, s.b);
    return s;
}

static void assert_state(const state *want, ts_generator *g, const char *what)
{
    state got = state_of(g);
    cr_assert(memcmp(got.b, want->b, sizeof got.b) == 0,
              "%s: the generator's state after the replay differs from "
              "its state after the eager fill",
              what);
}

/* The storage rows rank r of w keeps when rows are sharded as FSDP shards
 * dim 0: ceil(rows / w) per rank, the last ranks short or empty. */
static void rank_rows(int64_t rows, int w, int r, int64_t *begin, int64_t *end)
{
    int64_t chunk = (rows + w - 1) / w;
    *begin = r * chunk < rows ? r * chunk : rows;
    *end = (r + 1) * chunk < rows ? (r + 1) * chunk : rows;
}

/* Replays the events of the storages of n meta tensors (one target each,
 * in seq order across them) for every rank of 1..4, each rank from seed
 * `seed` on generator g, and asserts that the union of the ranks' rows of
 * each storage is bitwise want[i] (its eager bytes, dtype of the
 * storage) and that g ends in `after`. Rows are the storages' dim-0 rows
 * of row_elems[i] elements. */
static void check_ranks(int n, ts_tensor *const *meta, const void *const *want, const int64_t *rows,
                        const int64_t *row_elems, ts_generator *g, uint64_t seed, const state *after, const char *what)
{
    for (int w = 1; w <= 4; w++)
        for (int r = 0; r < w; r++) {
            ts__init_target tg[8];
            void *buf[8];
            cr_assert(n <= 8);
            for (int i = 0; i < n; i++) {
                int64_t b, e;
                rank_rows(rows[i], w, r, &b, &e);
                size_t es = ts_dtype_size(meta[i]->dtype);
                buf[i] = malloc((size_t)((e - b) * row_elems[i]) * es + 1);
                /* a pattern the replay must overwrite everywhere */
                memset(buf[i], 0xA5, (size_t)((e - b) * row_elems[i]) * es + 1);
                tg[i] = (ts__init_target){&meta[i]->storage->init_log, b * row_elems[i], e * row_elems[i],
                                          meta[i]->dtype, buf[i]};
            }
            ts_generator_manual_seed(g, seed);
            TH_OK(ts__init_replay_targets(n, tg));
            char msg[160];
            snprintf(msg, sizeof msg, "%s, rank %d of %d", what, r, w);
            assert_state(after, g, msg);
            for (int i = 0; i < n; i++) {
                size_t es = ts_dtype_size(meta[i]->dtype);
                const char *wp = (const char *)want[i] + (size_t)tg[i].elem_begin * es;
                th_vec_expect_bytes(msg, meta[i]->dtype, buf[i], wp, tg[i].elem_end - tg[i].elem_begin);
                free(buf[i]);
            }
        }
}

/* One fill of a fresh contiguous tensor of `shape`: eager with seed on g
 * (the default generator when explicit is false), then recorded on a meta
 * tensor and replayed rank by rank. */
static void check_fill(fill_kind k, ts_dtype dt, int ndim, const int64_t *shape, bool explicit_gen)
{
    const uint64_t seed = 1234;
    ts_generator *own = NULL;
    if (explicit_gen) TH_OK(ts_generator_new(7, &own));
    ts_generator *g = explicit_gen ? own : ts_default_generator();
    ts_generator *pass = explicit_gen ? own : NULL;

    ts_tensor *eager = th_empty(dt, ndim, shape);
    ts_generator_manual_seed(g, seed);
    TH_OK(apply(k, eager, pass));
    state after = state_of(g);

    ts_tensor *meta;
    TH_OK(ts__tensor_new_meta(dt, ndim, shape, &meta));
    ts_generator_manual_seed(g, seed);
    state before = state_of(g);
    TH_OK(apply(k, meta, pass));
    char what[160], sb[64];
    snprintf(what, sizeof what, "%s %s %s%s", kind_names[k], ts_dtype_name(dt),
             ts_shape_str(ndim, shape, sb, sizeof sb), explicit_gen ? " (explicit generator)" : "");
    assert_state(&before, g, what); /* recording draws nothing */
    int n_ev = 0;
    const ts__init_event *ev = ts__init_events(meta->storage, &n_ev);
    cr_assert_eq(n_ev, 1, "%s: %d events recorded", what, n_ev);
    cr_assert_eq(ev[0].gen, k == F_CONSTANT ? NULL : pass, "%s: the event's generator", what);
    cr_assert_eq(ev[0].dtype, dt, "%s: the event's dtype", what);

    int64_t rows = shape[0], row_elems = ts__numel(ndim, shape) / (rows ? rows : 1);
    const void *want = ts_tensor_data(eager);
    check_ranks(1, &meta, &want, &rows, &row_elems, g, seed, &after, what);
    ts_tensor_free(meta);
    ts_tensor_free(eager);
    ts_generator_free(own);
}

static const int64_t sizes[] = {1, 15, 16, 17, 31, 32, 33, 1000, 65536 + 17};
#define N_SIZES ((int)(sizeof sizes / sizeof sizes[0]))

/* 2-d shapes around the same sizes (rows, cols): few rows (ranks empty),
 * rows of one element, a block crossed in the middle of a row. */
static const int64_t shapes2d[][2] = {{1, 1}, {3, 5},  {2, 8},   {17, 1},    {1, 31},
                                      {4, 8}, {11, 3}, {40, 25}, {3, 21851}, {129, 509}};
#define N_SHAPES2D ((int)(sizeof shapes2d / sizeof shapes2d[0]))

/* ------------------------------------------------------------- contiguous */

Test(tensor_init_replay, every_fill_1d_every_size_f32_f64)
{
    ts_dtype dts[2] = {TS_F32, TS_F64};
    for (int k = 0; k < F_COUNT; k++)
        if (!needs_2d(k))
            for (int d = 0; d < 2; d++)
                for (int i = 0; i < N_SIZES; i++) check_fill(k, dts[d], 1, &sizes[i], false);
}

Test(tensor_init_replay, every_fill_2d_split_by_rows_f32_f64)
{
    ts_dtype dts[2] = {TS_F32, TS_F64};
    for (int k = 0; k < F_COUNT; k++)
        for (int d = 0; d < 2; d++)
            for (int i = 0; i < N_SHAPES2D; i++) check_fill(k, dts[d], 2, shapes2d[i], false);
}

Test(tensor_init_replay, explicit_generator)
{
    for (int k = 0; k < F_COUNT; k++) {
        check_fill(k, TS_F32, 2, (int64_t[]){17, 3}, true);
        check_fill(k, TS_F64, 2, (int64_t[]){5, 3}, true);
    }
}

/* ------------------------------------------------------------- views */

typedef struct view_case {
    const char *name;
    int64_t base[2];
    /* the view of the (rows, cols) base: ndim, shape, strides, offset */
    int ndim;
    int64_t shape[2], strides[2], offset;
} view_case;

/* MHA's packed (3E, E) in_proj_weight, one third of it; a transpose; a
 * row slice with step 2; a column narrow; a small transposed corner (the
 * scalar normal_ path on a view). */
static const view_case views[] = {
    {"packed middle third", {3 * 40, 40}, 2, {40, 40}, {40, 1}, 40 * 40},
    {"transpose", {24, 37}, 2, {37, 24}, {1, 37}, 0},
    {"rows step 2", {33, 17}, 2, {17, 17}, {34, 1}, 0},
    {"column narrow", {50, 30}, 2, {50, 7}, {30, 1}, 11},
    {"small transposed corner", {9, 9}, 2, {3, 4}, {1, 9}, 10},
    {"tail of a flat buffer", {1, 70000}, 1, {65553}, {1}, 70000 - 65553},
};

static void check_view(const view_case *vc, fill_kind k, ts_dtype dt)
{
    const uint64_t seed = 99;
    ts_generator *g = ts_default_generator();
    int64_t rows = vc->base[0], row_elems = vc->base[1];
    /* the base is filled first (a constant), then the view: two events */
    ts_tensor *eager = th_empty(dt, 2, vc->base), *ev_view;
    ts_generator_manual_seed(g, seed);
    TH_OK(ts_tensor_fill_(eager, -3.0));
    TH_OK(ts__tensor_alias(eager, vc->ndim, vc->shape, vc->strides, vc->offset, &ev_view));
    TH_OK(apply(k, ev_view, NULL));
    state after = state_of(g);

    ts_tensor *meta, *mv;
    TH_OK(ts__tensor_new_meta(dt, 2, vc->base, &meta));
    TH_OK(ts_tensor_fill_(meta, -3.0));
    TH_OK(ts__tensor_alias(meta, vc->ndim, vc->shape, vc->strides, vc->offset, &mv));
    TH_OK(apply(k, mv, NULL));
    int n_ev = 0;
    ts__init_events(meta->storage, &n_ev);
    cr_assert_eq(n_ev, 2);
    char what[160];
    snprintf(what, sizeof what, "%s of %s %s", kind_names[k], vc->name, ts_dtype_name(dt));
    const void *want = ts_tensor_data(eager);
    check_ranks(1, &meta, &want, &rows, &row_elems, g, seed, &after, what);
    ts_tensor_free(mv);
    ts_tensor_free(meta);
    ts_tensor_free(ev_view);
    ts_tensor_free(eager);
}

Test(tensor_init_replay, views_of_a_storage)
{
    ts_dtype dts[2] = {TS_F32, TS_F64};
    for (size_t v = 0; v < sizeof views / sizeof views[0]; v++)
        for (int k = 0; k < F_COUNT; k++)
            for (int d = 0; d < 2; d++)
                if (!needs_2d(k) || views[v].ndim == 2) check_view(&views[v], k, dts[d]);
}

/* ------------------------------------------------------------- sequences */

/* A model's worth: several storages, several events each, interleaved;
 * scalar-path normal_ calls whose cached second value crosses events and
 * storages. Replayed in seq order across the storages: the eager values
 * of every storage and the eager final state. */
static void sequence(ts_tensor *t[4], ts_tensor *v[2])
{
    TH_OK(ts_init_kaiming_uniform_(t[0], sqrt(5.0), TS_FAN_IN, TS_NL_LEAKY_RELU, NULL));
    TH_OK(ts_normal_(v[0], 0.0, 1.0, NULL)); /* 3 elements: scalar path, leaves a cached value */
    TH_OK(ts_uniform_(t[1], -1.0, 1.0, NULL));
    TH_OK(ts_normal_(t[2], 1.0, 0.02, NULL)); /* dense, with the tail re-draw */
    TH_OK(ts_tensor_fill_(t[1], 0.0));
    TH_OK(ts_normal_(v[1], 0.0, 2.0, NULL)); /* uses the cached value first */
    TH_OK(ts_init_xavier_normal_(t[3], 1.0, NULL));
    TH_OK(ts_bernoulli_(t[1], 0.5, NULL));
}

static void make_all(bool meta, ts_dtype dt, ts_tensor *t[4], ts_tensor *v[2])
{
    int64_t shapes[4][2] = {{33, 7}, {5, 3}, {70, 1000}, {13, 17}};
    for (int i = 0; i < 4; i++) {
        if (meta) TH_OK(ts__tensor_new_meta(dt, 2, shapes[i], &t[i]));
        else t[i] = th_empty(dt, 2, shapes[i]);
    }
    /* v[0]: 3 elements of t[3]'s column 2; v[1]: t[0] transposed, rows 1-4 */
    TH_OK(ts__tensor_alias(t[3], 1, (int64_t[]){3}, (int64_t[]){17}, 2, &v[0]));
    TH_OK(ts__tensor_alias(t[0], 2, (int64_t[]){7, 4}, (int64_t[]){1, 7}, 7, &v[1]));
}

Test(tensor_init_replay, several_storages_in_sequence)
{
    ts_dtype dts[2] = {TS_F32, TS_F64};
    for (int d = 0; d < 2; d++) {
        ts_tensor *e[4], *ev[2], *m[4], *mv[2];
        make_all(false, dts[d], e, ev);
        ts_manual_seed(5);
        sequence(e, ev);
        state after = state_of(ts_default_generator());
        make_all(true, dts[d], m, mv);
        ts_manual_seed(5);
        sequence(m, mv);
        const void *want[4];
        int64_t rows[4], row_elems[4];
        for (int i = 0; i < 4; i++) {
            want[i] = ts_tensor_data(e[i]);
            rows[i] = e[i]->shape[0];
            row_elems[i] = e[i]->shape[1];
        }
        check_ranks(4, m, want, rows, row_elems, ts_default_generator(), 5, &after, "sequence");
        for (int i = 0; i < 4; i++) {
            ts_tensor_free(e[i]);
            ts_tensor_free(m[i]);
        }
        for (int i = 0; i < 2; i++) {
            ts_tensor_free(ev[i]);
            ts_tensor_free(mv[i]);
        }
    }
}

/* A storage freed after its initializer drew (a weight replaced by a tied
 * one): the eager run drew for it, so the replay must too. Its events
 * become orphans; the materializer takes those of its recording's seq
 * range and replays them with an empty range. */
Test(tensor_init_replay, freed_storage_draws_still_replayed)
{
    int64_t s[2] = {20, 9};
    ts_manual_seed(11);
    ts_tensor *x = th_empty(TS_F32, 2, s), *y = th_empty(TS_F32, 2, s);
    TH_OK(ts_uniform_(x, 0.0, 1.0, NULL));
    TH_OK(ts_normal_(y, 0.0, 1.0, NULL));
    state after = state_of(ts_default_generator());

    uint64_t seq0 = ts__init_seq_next();
    ts_tensor *mx, *my;
    TH_OK(ts__tensor_new_meta(TS_F32, 2, s, &mx));
    TH_OK(ts__tensor_new_meta(TS_F32, 2, s, &my));
    TH_OK(ts_uniform_(mx, 0.0, 1.0, NULL));
    TH_OK(ts_tensor_fill_(mx, 2.0)); /* draws nothing: not kept */
    TH_OK(ts_normal_(my, 0.0, 1.0, NULL));
    ts_tensor_free(mx);
    uint64_t seq1 = ts__init_seq_next();
    ts__init_log orphans = {0};
    TH_OK(ts__init_orphans_take(seq0, seq1, &orphans));
    cr_assert_eq(orphans.n, 1, "the freed storage's uniform_ is kept, its fill is not (%d)", orphans.n);
    ts__init_log none = {0};
    TH_OK(ts__init_orphans_take(seq0, seq1, &none));
    cr_assert_eq(none.n, 0, "taken once");

    float *got = malloc(180 * sizeof *got);
    ts__init_target tg[2] = {{&my->storage->init_log, 0, 180, TS_F32, got}, {&orphans, 0, 0, TS_F32, NULL}};
    ts_manual_seed(11);
    TH_OK(ts__init_replay_targets(2, tg));
    assert_state(&after, ts_default_generator(), "orphans");
    th_vec_expect_bytes("y after an orphan", TS_F32, got, ts_tensor_data(y), 180);
    free(got);
    ts__init_log_fini(&orphans);
    ts_tensor_free(my);
    ts_tensor_free(x);
    ts_tensor_free(y);
}

/* A copy made while building (TransformerEncoder deep-copies its first
 * layer: it builds the others, restores the generator, copies the values
 * in): the copy's storage repeats the source's events. Replayed, it gets
 * the source's values and advances nothing. */
Test(tensor_init_replay, copies_repeat_their_source)
{
    int64_t s[2] = {21, 6};
    uint8_t st[TS_GENERATOR_STATE_BYTES];
    ts_tensor *e[3], *m[3];
    for (int i = 0; i < 3; i++) {
        e[i] = th_empty(TS_F32, 2, s);
        TH_OK(ts__tensor_new_meta(TS_F32, 2, s, &m[i]));
    }
    ts_manual_seed(8);
    TH_OK(ts_normal_(e[2], 0.0, 1.0, NULL)); /* 126 elements: the dense path */
    TH_OK(ts_normal_(e[0], 0.0, 1.0, NULL));
    TH_OK(ts_tensor_fill_(e[0], 1.0)); /* a later fill is copied too */
    TH_OK(ts_uniform_(e[0], -1.0, 1.0, NULL));
    ts_generator_get_state(NULL, st);
    TH_OK(ts_uniform_(e[1], 0.0, 9.0, NULL)); /* drawn, then the state restored */
    TH_OK(ts_generator_set_state(NULL, st));
    TH_OK(ts_tensor_copy_(e[1], e[0]));
    ts_tensor *v;
    TH_OK(ts__tensor_alias(e[2], 1, (int64_t[]){5}, (int64_t[]){6}, 1, &v));
    TH_OK(ts_normal_(v, 0.0, 1.0, NULL)); /* the scalar path: draws after the copy continue from the source */
    ts_tensor_free(v);
    state after = state_of(ts_default_generator());

    ts_manual_seed(8);
    TH_OK(ts_normal_(m[2], 0.0, 1.0, NULL));
    TH_OK(ts_normal_(m[0], 0.0, 1.0, NULL));
    TH_OK(ts_tensor_fill_(m[0], 1.0));
    TH_OK(ts_uniform_(m[0], -1.0, 1.0, NULL));
    TH_OK(ts_uniform_(m[1], 0.0, 9.0, NULL));
    TH_OK(ts__init_events_repeat(m[1]->storage, m[0]->storage));
    TH_OK(ts__tensor_alias(m[2], 1, (int64_t[]){5}, (int64_t[]){6}, 1, &v));
    TH_OK(ts_normal_(v, 0.0, 1.0, NULL));
    ts_tensor_free(v);
    int n = 0;
    const ts__init_event *ev = ts__init_events(m[1]->storage, &n);
    cr_assert_eq(n, 3, "the copy's own uniform_ is replaced by the source's 3 events");
    cr_assert_neq(ev[0].repeat_of, 0);
    cr_assert_eq(ev[1].repeat_of, 0, "a fill is copied as it is");
    float buf[8];
    TH_FAILS(ts__init_replay(&ev[0], 0, 1, TS_F32, buf), TS_ERR_INVALID_ARGUMENT, "repeats event",
             "ts__init_replay_targets");

    const void *want[3];
    int64_t rows[3], row_elems[3];
    for (int i = 0; i < 3; i++) {
        want[i] = ts_tensor_data(e[i]);
        rows[i] = s[0];
        row_elems[i] = s[1];
    }
    check_ranks(3, m, want, rows, row_elems, ts_default_generator(), 8, &after, "copy");

    /* without its source among the targets, a repeat is refused */
    float *out = malloc(126 * sizeof *out);
    ts__init_target alone = {&m[1]->storage->init_log, 0, 126, TS_F32, out};
    TH_FAILS(ts__init_replay_targets(1, &alone), TS_ERR_INVALID_ARGUMENT, "not among the targets");
    free(out);
    for (int i = 0; i < 3; i++) {
        ts_tensor_free(e[i]);
        ts_tensor_free(m[i]);
    }
}

/* ------------------------------------------------------------- dtypes */

/* Replaying into bf16, f16 (from f32) or f32 (from f64) gives what
 * ts_to_dtype makes of the eager tensor (the converters of
 * ts_module_to_dtype). */
Test(tensor_init_replay, converts_as_to_dtype)
{
    struct {
        ts_dtype from, to;
    } cs[] = {{TS_F32, TS_BF16}, {TS_F32, TS_F16}, {TS_F64, TS_F32}, {TS_F64, TS_BF16}};
    int64_t s[2] = {37, 29};
    for (size_t c = 0; c < sizeof cs / sizeof cs[0]; c++)
        for (int k = 0; k < F_COUNT; k++) {
            ts_tensor *e = th_empty(cs[c].from, 2, s), *conv, *m;
            ts_manual_seed(3);
            TH_OK(apply(k, e, NULL));
            TH_OK(ts_to_dtype(e, cs[c].to, &conv));
            TH_OK(ts__tensor_new_meta(cs[c].from, 2, s, &m));
            TH_OK(apply(k, m, NULL));
            int n_ev = 0;
            const ts__init_event *ev = ts__init_events(m->storage, &n_ev);
            void *got = malloc(37 * 29 * 8);
            ts_manual_seed(3);
            /* rows 5..20 */
            TH_OK(ts__init_replay(&ev[0], 5 * 29, 20 * 29, cs[c].to, got));
            char what[96];
            snprintf(what, sizeof what, "%s %s -> %s", kind_names[k], ts_dtype_name(cs[c].from),
                     ts_dtype_name(cs[c].to));
            th_vec_expect_bytes(what, cs[c].to, got,
                                (const char *)ts_tensor_data(conv) + 5 * 29 * ts_dtype_size(cs[c].to), 15 * 29);
            free(got);
            ts_tensor_free(m);
            ts_tensor_free(conv);
            ts_tensor_free(e);
        }
}

/* ------------------------------------------------------------- errors */

Test(tensor_init_replay, meta_fills_validate_as_eager_and_record_nothing_on_error)
{
    ts_tensor *m;
    TH_OK(ts__tensor_new_meta(TS_F32, 2, (int64_t[]){4, 4}, &m));
    TH_FAILS(ts_uniform_(m, 2.0, 1.0, NULL), TS_ERR_INVALID_ARGUMENT, "from=2 > to=1");
    TH_FAILS(ts_normal_(m, 0.0, -1.0, NULL), TS_ERR_INVALID_ARGUMENT, "std >= 0.0");
    TH_FAILS(ts_bernoulli_(m, 1.5, NULL), TS_ERR_INVALID_ARGUMENT, "p in [0, 1]");
    TH_FAILS(ts_tensor_fill_(m, 1e39), TS_ERR_INVALID_ARGUMENT, "overflow");
    TH_FAILS(ts_init_kaiming_uniform_(m, NAN, TS_FAN_IN, TS_NL_LEAKY_RELU, NULL), TS_ERR_INVALID_ARGUMENT,
             "not finite");
    ts_tensor *m1;
    TH_OK(ts__tensor_new_meta(TS_F32, 1, (int64_t[]){4}, &m1));
    TH_FAILS(ts_init_xavier_uniform_(m1, 1.0, NULL), TS_ERR_SHAPE, "fewer than 2 dimensions");
    ts_tensor *mi;
    TH_OK(ts__tensor_new_meta(TS_I64, 1, (int64_t[]){4}, &mi));
    TH_FAILS(ts_uniform_(mi, 0.0, 1.0, NULL), TS_ERR_DTYPE, "int64");
    int n = -1;
    cr_assert_null(ts__init_events(m->storage, &n));
    cr_assert_eq(n, 0);
    ts_tensor *e0;
    TH_OK(ts__tensor_new_meta(TS_F32, 2, (int64_t[]){0, 4}, &e0));
    TH_OK(ts_normal_(e0, 0.0, 1.0, NULL));
    ts__init_events(e0->storage, &n);
    cr_assert_eq(n, 0, "an empty tensor draws nothing and records nothing");
    ts_tensor_free(e0);
    ts_tensor_free(mi);
    ts_tensor_free(m1);
    ts_tensor_free(m);
}

Test(tensor_init_replay, replay_rejects_bad_arguments)
{
    ts_tensor *m;
    TH_OK(ts__tensor_new_meta(TS_F32, 1, (int64_t[]){8}, &m));
    TH_OK(ts_uniform_(m, 0.0, 1.0, NULL));
    const ts__init_event *ev = ts__init_events(m->storage, NULL);
    float buf[8];
    TH_FAILS(ts__init_replay(NULL, 0, 1, TS_F32, buf), TS_ERR_INVALID_ARGUMENT, "NULL");
    TH_FAILS(ts__init_replay(ev, -1, 1, TS_F32, buf), TS_ERR_INVALID_ARGUMENT, "[-1, 1)", "negative");
    TH_FAILS(ts__init_replay(ev, 5, 2, TS_F32, buf), TS_ERR_INVALID_ARGUMENT, "[5, 2)", "reversed");
    TH_FAILS(ts__init_replay(ev, 0, 4, TS_F32, NULL), TS_ERR_INVALID_ARGUMENT, "dst is NULL");
    TH_FAILS(ts__init_replay(ev, 0, 4, (ts_dtype)99, buf), TS_ERR_INVALID_ARGUMENT, "not a dtype");
    ts__init_event bad = *ev;
    bad.kind = TS__INIT_KIND_COUNT;
    TH_FAILS(ts__init_replay(&bad, 0, 4, TS_F32, buf), TS_ERR_INVALID_ARGUMENT, "not a recorded initializer");
    TH_FAILS(ts__init_replay_targets(1, NULL), TS_ERR_INVALID_ARGUMENT, "targets is NULL");
    ts_tensor_free(m);
}
