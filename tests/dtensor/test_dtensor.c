#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "dtensor/dtensor.h"
#include "tests/loopback_ranks.h"

/* DTensors over W loopback ranks run as threads of this test, each with its
 * own world (tests/loopback_ranks.h). Rank threads never call cr_assert:
 * they return th_rank_fail(...) and th_run_world asserts on it.
 *
 * The global tensor of every case holds scale * (row-major index + 1), so
 * any element names its own position; float64 keeps every value, sum and
 * average of these small integers exact, so values compare exactly. The
 * expected local chunks come from ref_chunk below, written from PyTorch's
 * Shard._local_shard_size_and_offset as a running sum of chunk sizes
 * (torch.chunk padded with empty parts), independently of ts_chunk_range.
 * A rank thread that fails returns at once and may leak; the memory check
 * of a test only matters when every rank passed. */

typedef th_rank rank_ctx;
#define fail th_rank_fail
#define RK_OK TH_RK_OK
#define RK_EQ TH_RK_EQ

static void run_world(int W, th_rank_fn fn, void *arg) { th_run_world(W, fn, arg, 30.0); }

/* ------------------------------------------------------------ references */

static void ref_chunk(int64_t n, int k, int i, int64_t *start, int64_t *len)
{
    int64_t c = n > 0 ? (n + k - 1) / k : 0, pos = 0;
    for (int j = 0; j < k; j++) {
        int64_t l = n - pos < c ? n - pos : c;
        if (j == i) {
            *start = pos;
            *len = l;
            return;
        }
        pos += l;
    }
}

/* This rank's chunk (shape and offsets) of `shape` under pl. */
static void ref_local(const ts_mesh *m, const ts_placement *pl, int nd, const int64_t *shape, int64_t *lsh,
                      int64_t *off)
{
    int coord[TS_MESH_MAX_DIMS];
    ts_mesh_coordinate(m, coord);
    for (int d = 0; d < nd; d++) {
        lsh[d] = shape[d];
        off[d] = 0;
    }
    for (int i = 0; i < ts_mesh_ndim(m); i++) {
        if (pl[i].kind != TS_PLACEMENT_SHARD) continue;
        int d = pl[i].dim;
        int64_t s = 0, l = 0;
        ref_chunk(lsh[d], (int)ts_mesh_dim_size(m, i), coord[i], &s, &l);
        off[d] += s;
        lsh[d] = l;
    }
}

static int64_t numel_of(int nd, const int64_t *sh)
{
    int64_t n = 1;
    for (int d = 0; d < nd; d++) n *= sh[d];
    return n;
}

/* The global tensor: scale * (row-major index + 1), float64. */
static ts_status make_global(int nd, const int64_t *sh, double scale, ts_tensor **out)
{
    ts_status st = ts_tensor_empty(TS_F64, nd, sh, out);
    if (st != TS_OK) return st;
    double *p = ts_tensor_data(*out);
    for (int64_t i = 0; i < numel_of(nd, sh); i++) p[i] = scale * (double)(i + 1);
    return TS_OK;
}

/* A contiguous copy of this rank's chunk of `global` under pl. */
static ts_status make_chunk(const ts_mesh *m, const ts_placement *pl, ts_tensor *global, ts_tensor **out)
{
    int nd = ts_tensor_ndim(global);
    int64_t lsh[TS_MAX_DIMS], off[TS_MAX_DIMS];
    ref_local(m, pl, nd, ts_tensor_shape(global), lsh, off);
    ts_tensor *v = ts_tensor_retain(global);
    for (int d = 0; d < nd; d++) {
        ts_tensor *n = NULL;
        ts_status st = ts_narrow(v, d, off[d], lsh[d], &n);
        ts_tensor_free(v);
        if (st != TS_OK) return st;
        v = n;
    }
    ts_status st = ts_clone(v, out);
    ts_tensor_free(v);
    return st;
}

/* Checks that `local` is this rank's chunk under pl of the global tensor
 * of shape sh holding scale * (index + 1). */
static int check_chunk(rank_ctx *rc, const char *what, const ts_mesh *m, const ts_placement *pl, ts_tensor *local,
                       int nd, const int64_t *sh, double scale)
{
    int64_t lsh[TS_MAX_DIMS], off[TS_MAX_DIMS];
    ref_local(m, pl, nd, sh, lsh, off);
    if (!local) return fail(rc, "%s: NULL local tensor", what);
    if (ts_tensor_ndim(local) != nd)
        return fail(rc, "%s: local has %d dims, expected %d", what, ts_tensor_ndim(local), nd);
    for (int d = 0; d < nd; d++)
        if (ts_tensor_shape(local)[d] != lsh[d])
            return fail(rc, "%s: local dim %d is %lld, expected %lld", what, d, (long long)ts_tensor_shape(local)[d],
                        (long long)lsh[d]);
    int64_t n = numel_of(nd, lsh), idx[TS_MAX_DIMS] = {0};
    for (int64_t e = 0; e < n; e++) {
        int64_t rest = e, lin = 0;
        for (int d = nd - 1; d >= 0; d--) {
            idx[d] = rest % lsh[d];
            rest /= lsh[d];
        }
        for (int d = 0; d < nd; d++) lin = lin * sh[d] + off[d] + idx[d];
        double v = 0;
        RK_OK(rc, ts_tensor_get(local, idx, &v));
        if (v != scale * (double)(lin + 1))
            return fail(rc, "%s: local element %lld is %g, expected %g", what, (long long)e, v,
                        scale * (double)(lin + 1));
    }
    return 0;
}

/* Checks a DTensor: metadata, offsets, local chunk, and (collective)
 * full_tensor. */
static int check_dt(rank_ctx *rc, const char *what, const ts_dtensor *dt, const ts_mesh *m, const ts_placement *pl,
                    int nd, const int64_t *sh, double scale)
{
    char buf[160];
    RK_EQ(rc, ts_dtensor_ndim(dt), nd);
    for (int d = 0; d < nd; d++) RK_EQ(rc, ts_dtensor_shape(dt)[d], sh[d]);
    if (ts_dtensor_mesh(dt) != m) return fail(rc, "%s: wrong mesh", what);
    for (int i = 0; i < ts_mesh_ndim(m); i++) {
        ts_placement p = ts_dtensor_placements(dt)[i];
        if (p.kind != pl[i].kind || (p.kind == TS_PLACEMENT_SHARD && p.dim != pl[i].dim))
            return fail(rc, "%s: placement %d differs", what, i);
    }
    int64_t lsh[TS_MAX_DIMS], off[TS_MAX_DIMS];
    ref_local(m, pl, nd, sh, lsh, off);
    for (int d = 0; d < nd; d++) RK_EQ(rc, ts_dtensor_local_offset(dt, d), off[d]);
    ts_tensor *loc = ts_dtensor_local(dt);
    if (!ts_tensor_is_contiguous(loc)) return fail(rc, "%s: local tensor is not contiguous", what);
    if (ts_tensor_requires_grad(loc)) return fail(rc, "%s: local tensor requires grad", what);
    snprintf(buf, sizeof buf, "%s (local)", what);
    if (check_chunk(rc, buf, m, pl, loc, nd, sh, scale)) return 1;
    ts_tensor *full = NULL;
    RK_OK(rc, ts_dtensor_full_tensor(dt, &full));
    ts_placement rep[TS_MESH_MAX_DIMS];
    for (int i = 0; i < ts_mesh_ndim(m); i++) rep[i] = ts_replicate();
    snprintf(buf, sizeof buf, "%s (full_tensor)", what);
    int bad = check_chunk(rc, buf, m, rep, full, nd, sh, scale);
    ts_tensor_free(full);
    return bad;
}

static int err_has(rank_ctx *rc, ts_status got, ts_status want, const char *a, const char *b)
{
    if (got != want)
        return fail(rc, "got %s (%s), expected %s", ts_status_name(got), ts_last_error(), ts_status_name(want));
    if (a && !strstr(ts_last_error(), a)) return fail(rc, "error \"%s\" lacks \"%s\"", ts_last_error(), a);
    if (b && !strstr(ts_last_error(), b)) return fail(rc, "error \"%s\" lacks \"%s\"", ts_last_error(), b);
    return 0;
}

static ts_status mesh_1d(rank_ctx *rc, ts_mesh **out)
{
    const char *names[1] = {"dp"};
    int64_t shape[1] = {rc->W};
    return ts_mesh_new(rc->c, "cpu", 1, shape, names, out);
}

/* ------------------------------------------------------------ chunk table */

static void expect_chunks(int64_t n, int k, const int64_t *lens)
{
    int64_t pos = 0;
    for (int i = 0; i < k; i++) {
        int64_t s = -1, l = -1;
        ts_chunk_range(n, k, i, &s, &l);
        cr_assert_eq(l, lens[i], "n=%lld k=%d part %d: len %lld, expected %lld", (long long)n, k, i, (long long)l,
                     (long long)lens[i]);
        if (l > 0)
            cr_assert_eq(s, pos, "n=%lld k=%d part %d: start %lld, expected %lld", (long long)n, k, i, (long long)s,
                         (long long)pos);
        cr_assert(s >= 0 && s <= n);
        pos += l;
    }
    cr_assert_eq(pos, n);
}

Test(dtensor_dtensor, chunk_range_follows_torch_chunk, .timeout = 60)
{
    const int64_t a[8] = {3, 3, 3, 3, 3, 2, 0, 0};
    expect_chunks(17, 8, a);
    const int64_t b[4] = {2, 2, 1, 0};
    expect_chunks(5, 4, b);
    const int64_t c[2] = {1, 0};
    expect_chunks(1, 2, c);
    const int64_t d[3] = {0, 0, 0};
    expect_chunks(0, 3, d);
    const int64_t e[4] = {2, 2, 2, 0};
    expect_chunks(6, 4, e);
    const int64_t f[1] = {7};
    expect_chunks(7, 1, f);
    const int64_t g[3] = {2, 2, 2};
    expect_chunks(6, 3, g);
    /* the offsets of 5 rows on 4 ranks (torch: 0, 2, 4, 5) */
    int64_t s, l;
    ts_chunk_range(5, 4, 3, &s, &l);
    cr_assert(s == 5 && l == 0);
    ts_chunk_range(5, 4, 2, &s, &l);
    cr_assert(s == 4 && l == 1);
}

Test(dtensor_dtensor, placement_names, .timeout = 60)
{
    char buf[32];
    cr_assert_str_eq(ts_placement_str(ts_shard(1), buf, sizeof buf), "Shard(1)");
    cr_assert_str_eq(ts_placement_str(ts_replicate(), buf, sizeof buf), "Replicate()");
    cr_assert_str_eq(ts_placement_str(ts_partial(TS_REDUCE_SUM), buf, sizeof buf), "Partial(sum)");
    cr_assert_str_eq(ts_placement_str(ts_partial(TS_REDUCE_AVG), buf, sizeof buf), "Partial(avg)");
    char small[4];
    cr_assert_str_eq(ts_placement_str(ts_replicate(), small, sizeof small), "Rep");
}

/* ------------------------------------------------------------ distribute, 1-d */

static int r_distribute(rank_ctx *rc)
{
    ts_mesh *m = NULL;
    RK_OK(rc, mesh_1d(rc, &m));
    static const int64_t shapes[][2] = {{5, 3}, {3, 5}, {2, 7}, {0, 3}};
    static const int sdims[] = {0, 1, 1, 0};
    for (int c = 0; c < 4; c++) {
        const int64_t *sh = shapes[c];
        ts_tensor *g = NULL;
        RK_OK(rc, make_global(2, sh, 1.0, &g));
        ts_placement pls[2] = {ts_shard(sdims[c]), ts_replicate()};
        for (int p = 0; p < 2; p++) {
            ts_dtensor *dt = NULL;
            RK_OK(rc, ts_distribute_tensor(g, m, &pls[p], -1, &dt));
            if (ts_dtensor_local(dt) == g) return fail(rc, "distribute did not copy");
            char what[64];
            snprintf(what, sizeof what, "case %d placement %d", c, p);
            if (check_dt(rc, what, dt, m, &pls[p], 2, sh, 1.0)) return 1;
            ts_dtensor_free(dt);
        }
        ts_tensor_free(g);
    }
    /* 5 x 3 as Shard(0) on 4 ranks is torch.chunk's 2, 2, 1, 0 rows at 0, 2, 4, 5 */
    if (rc->W == 4) {
        int64_t sh[2] = {5, 3};
        ts_tensor *g = NULL;
        RK_OK(rc, make_global(2, sh, 1.0, &g));
        ts_placement p = ts_shard(0);
        ts_dtensor *dt = NULL;
        RK_OK(rc, ts_distribute_tensor(g, m, &p, -1, &dt));
        static const int64_t rows[4] = {2, 2, 1, 0}, offs[4] = {0, 2, 4, 5};
        RK_EQ(rc, ts_tensor_shape(ts_dtensor_local(dt))[0], rows[rc->rank]);
        RK_EQ(rc, ts_tensor_shape(ts_dtensor_local(dt))[1], 3);
        RK_EQ(rc, ts_dtensor_local_offset(dt, 0), offs[rc->rank]);
        RK_EQ(rc, ts_dtensor_local_offset(dt, 1), 0);
        ts_dtensor_free(dt);
        ts_tensor_free(g);
    }
    ts_mesh_free(m);
    return 0;
}

Test(dtensor_dtensor, distribute_uneven_shards_follow_torch_chunk, .timeout = 60)
{
    th_mem_mark();
    for (int W = 1; W <= 4; W++) run_world(W, r_distribute, NULL);
    th_mem_assert_back();
}

/* Only src's tensor is read; the others hold garbage, left unchanged. */
static int r_distribute_src(rank_ctx *rc)
{
    ts_mesh *m = NULL;
    RK_OK(rc, mesh_1d(rc, &m));
    int src = rc->W - 1;
    int64_t sh[2] = {3, 5};
    ts_placement pls[3] = {ts_shard(0), ts_shard(1), ts_replicate()};
    for (int p = 0; p < 3; p++) {
        ts_tensor *g = NULL;
        if (rc->rank == src) {
            RK_OK(rc, make_global(2, sh, 1.0, &g));
        } else {
            RK_OK(rc, ts_tensor_full(TS_F64, 2, sh, -7.0, &g));
        }
        ts_dtensor *dt = NULL;
        RK_OK(rc, ts_distribute_tensor(g, m, &pls[p], src, &dt));
        if (check_dt(rc, "from src_rank", dt, m, &pls[p], 2, sh, 1.0)) return 1;
        if (rc->rank != src) {
            const double *v = ts_tensor_data(g);
            for (int i = 0; i < 15; i++)
                if (v[i] != -7.0) return fail(rc, "the non-source tensor was written at %d: %g", i, v[i]);
        }
        ts_dtensor_free(dt);
        ts_tensor_free(g);
    }
    ts_mesh_free(m);
    return 0;
}

Test(dtensor_dtensor, distribute_from_src_rank, .timeout = 60)
{
    th_mem_mark();
    for (int W = 1; W <= 4; W++) run_world(W, r_distribute_src, NULL);
    th_mem_assert_back();
}

/* A rank whose tensor does not match the source's fails with the shapes or
 * dtypes named; every other rank fails too (nobody hangs). */
static int r_distribute_src_mismatch(rank_ctx *rc)
{
    ts_mesh *m = NULL;
    RK_OK(rc, mesh_1d(rc, &m));
    int64_t sh[2] = {5, 3}, other[2] = {3, 5};
    ts_placement p = ts_shard(0);
    ts_tensor *g = NULL;
    ts_dtensor *dt = NULL;
    /* shape */
    RK_OK(rc, ts_tensor_zeros(TS_F64, 2, rc->rank == 1 ? other : sh, &g));
    ts_status st = ts_distribute_tensor(g, m, &p, 0, &dt);
    if (err_has(rc, st, TS_ERR_SHAPE, "(5, 3)", rc->rank == 1 ? "(3, 5)" : "source rank 0")) return 1;
    if (dt) return fail(rc, "out written on failure");
    ts_tensor_free(g);
    /* dtype */
    RK_OK(rc, ts_tensor_zeros(rc->rank == 1 ? TS_F32 : TS_F64, 2, sh, &g));
    st = ts_distribute_tensor(g, m, &p, 0, &dt);
    if (err_has(rc, st, TS_ERR_DTYPE, "float64", rc->rank == 1 ? "float32" : "source rank 0")) return 1;
    ts_tensor_free(g);
    /* the world still works afterwards */
    RK_OK(rc, make_global(2, sh, 1.0, &g));
    RK_OK(rc, ts_distribute_tensor(g, m, &p, 1, &dt));
    if (check_dt(rc, "after the failures", dt, m, &p, 2, sh, 1.0)) return 1;
    ts_dtensor_free(dt);
    ts_tensor_free(g);
    ts_mesh_free(m);
    return 0;
}

Test(dtensor_dtensor, distribute_from_src_rank_mismatch_fails_everywhere, .timeout = 60)
{
    th_mem_mark();
    for (int W = 2; W <= 3; W++) run_world(W, r_distribute_src_mismatch, NULL);
    th_mem_assert_back();
}

/* ------------------------------------------------------------ from_local */

static int r_from_local(rank_ctx *rc)
{
    ts_mesh *m = NULL;
    RK_OK(rc, mesh_1d(rc, &m));
    /* explicit global shape, uneven, on dim 0 and dim 1 */
    static const int64_t shapes[][2] = {{5, 3}, {3, 5}};
    for (int c = 0; c < 2; c++) {
        ts_placement p = ts_shard(c);
        ts_tensor *g = NULL, *loc = NULL;
        RK_OK(rc, make_global(2, shapes[c], 1.0, &g));
        RK_OK(rc, make_chunk(m, &p, g, &loc));
        ts_dtensor *dt = NULL;
        RK_OK(rc, ts_dtensor_from_local(loc, m, &p, 2, shapes[c], &dt));
        if (ts_dtensor_local(dt) != loc) return fail(rc, "from_local copied its tensor");
        ts_tensor *back = ts_dtensor_to_local(dt);
        if (back != loc) return fail(rc, "to_local is not the local tensor");
        ts_tensor_free(back);
        if (check_dt(rc, "from_local explicit", dt, m, &p, 2, shapes[c], 1.0)) return 1;
        ts_dtensor_free(dt);
        ts_tensor_free(loc);
        ts_tensor_free(g);
    }
    /* inferred global shape: even shards of 2 rows */
    {
        int64_t lsh[2] = {2, 3}, gsh[2] = {2 * rc->W, 3};
        ts_placement p = ts_shard(0);
        ts_tensor *g = NULL, *loc = NULL;
        RK_OK(rc, make_global(2, gsh, 1.0, &g));
        RK_OK(rc, make_chunk(m, &p, g, &loc));
        RK_EQ(rc, ts_tensor_shape(loc)[0], lsh[0]);
        ts_dtensor *dt = NULL;
        RK_OK(rc, ts_dtensor_from_local(loc, m, &p, 2, NULL, &dt));
        if (check_dt(rc, "from_local inferred", dt, m, &p, 2, gsh, 1.0)) return 1;
        ts_dtensor_free(dt);
        /* Replicate: the global shape is the local one */
        ts_placement r = ts_replicate();
        RK_OK(rc, ts_dtensor_from_local(g, m, &r, 2, NULL, &dt));
        if (check_dt(rc, "from_local replicate", dt, m, &r, 2, gsh, 1.0)) return 1;
        ts_dtensor_free(dt);
        ts_tensor_free(loc);
        ts_tensor_free(g);
    }
    /* a non-contiguous local tensor, marked as a shard by an upper layer */
    {
        int64_t gsh[2] = {5, 3};
        ts_placement p = ts_shard(0), s1 = ts_shard(1);
        ts_tensor *g = NULL, *loc = NULL, *store = NULL, *nc = NULL;
        RK_OK(rc, make_global(2, gsh, 1.0, &g));
        RK_OK(rc, make_chunk(m, &p, g, &loc));
        int64_t tsh[2] = {3, ts_tensor_shape(loc)[0]};
        RK_OK(rc, ts_tensor_empty(TS_F64, 2, tsh, &store));
        RK_OK(rc, ts_transpose(store, 0, 1, &nc));
        RK_OK(rc, ts_tensor_copy_(nc, loc));
        if (rc->W > 1 && ts_tensor_shape(loc)[0] > 1 && ts_tensor_is_contiguous(nc))
            return fail(rc, "the transposed local tensor is contiguous");
        ts_tensor_set_shard(nc, NULL);
        ts_dtensor *dt = NULL, *d1 = NULL;
        RK_OK(rc, ts_dtensor_from_local(nc, m, &p, 2, gsh, &dt));
        ts_tensor *full = NULL;
        RK_OK(rc, ts_dtensor_full_tensor(dt, &full));
        ts_placement r = ts_replicate();
        if (check_chunk(rc, "non-contiguous shard (full_tensor)", m, &r, full, 2, gsh, 1.0)) return 1;
        RK_OK(rc, ts_dtensor_redistribute(dt, &s1, &d1));
        if (check_dt(rc, "non-contiguous shard -> Shard(1)", d1, m, &s1, 2, gsh, 1.0)) return 1;
        if (!ts_tensor_is_shard(nc)) return fail(rc, "the marker was removed");
        ts_tensor_clear_shard(nc);
        ts_tensor_free(full);
        ts_dtensor_free(d1);
        ts_dtensor_free(dt);
        ts_tensor_free(nc);
        ts_tensor_free(store);
        ts_tensor_free(loc);
        ts_tensor_free(g);
    }
    /* a local tensor that is not this rank's chunk */
    if (rc->W >= 2) {
        int64_t gsh[2] = {5, 3}, bad[2] = {4, 3};
        ts_placement p = ts_shard(0);
        ts_tensor *loc = NULL;
        RK_OK(rc, ts_tensor_zeros(TS_F64, 2, bad, &loc));
        ts_dtensor *dt = NULL;
        ts_status st = ts_dtensor_from_local(loc, m, &p, 2, gsh, &dt);
        if (err_has(rc, st, TS_ERR_SHAPE, "(4, 3)", "(5, 3)")) return 1;
        if (!strstr(ts_last_error(), "Shard(0)")) return fail(rc, "\"%s\" lacks the placement", ts_last_error());
        if (dt) return fail(rc, "out written on failure");
        /* a global shape with another number of dims */
        int64_t g1[1] = {5};
        st = ts_dtensor_from_local(loc, m, &p, 1, g1, &dt);
        if (err_has(rc, st, TS_ERR_SHAPE, "(5,)", "(4, 3)")) return 1;
        ts_tensor_free(loc);
    }
    ts_mesh_free(m);
    return 0;
}

Test(dtensor_dtensor, from_local_and_full_tensor, .timeout = 60)
{
    th_mem_mark();
    for (int W = 1; W <= 4; W++) run_world(W, r_from_local, NULL);
    th_mem_assert_back();
}

/* ------------------------------------------------------------ redistribute, 1-d */

/* A DTensor of global shape sh holding scale * (index + 1) under pl, made
 * with from_local. A Partial mesh dim holds scale * (coord + 1) * value on
 * each rank of the dim, and the returned *scale_out is the reduced scale. */
static int make_dt(rank_ctx *rc, const ts_mesh *m, const ts_placement *pl, int nd, const int64_t *sh, ts_dtensor **out,
                   double *scale_out)
{
    int n = ts_mesh_ndim(m), coord[TS_MESH_MAX_DIMS];
    ts_mesh_coordinate(m, coord);
    double mine = 1.0, global = 1.0;
    for (int i = 0; i < n; i++) {
        if (pl[i].kind != TS_PLACEMENT_PARTIAL) continue;
        double k = (double)ts_mesh_dim_size(m, i);
        mine *= coord[i] + 1;
        global *= pl[i].op == TS_REDUCE_SUM ? k * (k + 1) / 2 : (k + 1) / 2;
    }
    ts_tensor *g = NULL, *loc = NULL;
    RK_OK(rc, make_global(nd, sh, mine, &g));
    RK_OK(rc, make_chunk(m, pl, g, &loc));
    RK_OK(rc, ts_dtensor_from_local(loc, m, pl, nd, sh, out));
    ts_tensor_free(loc);
    ts_tensor_free(g);
    *scale_out = global;
    return 0;
}

typedef struct trans {
    ts_placement from, to;
} trans;

static int r_redistribute_1d(rank_ctx *rc)
{
    ts_mesh *m = NULL;
    RK_OK(rc, mesh_1d(rc, &m));
    const ts_placement S0 = ts_shard(0), S1 = ts_shard(1), R = ts_replicate(), PS = ts_partial(TS_REDUCE_SUM),
                       PA = ts_partial(TS_REDUCE_AVG);
    const trans ts[] = {
        {S0, R},  {S1, R},  {R, S0},  {R, S1},  {S0, S1}, {S1, S0}, {PS, R},  {PA, R},
        {PS, S0}, {PA, S0}, {PS, S1}, {PA, S1}, {R, R},   {S0, S0}, {PS, PS},
    };
    static const int64_t shapes[][2] = {{5, 3}, {3, 5}, {7, 6}, {2, 2}};
    for (size_t t = 0; t < sizeof ts / sizeof ts[0]; t++) {
        for (int c = 0; c < 4; c++) {
            const int64_t *sh = shapes[c];
            ts_dtensor *a = NULL, *b = NULL;
            double scale = 1;
            if (make_dt(rc, m, &ts[t].from, 2, sh, &a, &scale)) return 1;
            ts_tensor *before = NULL;
            RK_OK(rc, ts_clone(ts_dtensor_local(a), &before));
            RK_OK(rc, ts_dtensor_redistribute(a, &ts[t].to, &b));
            char what[96], x[32], y[32];
            snprintf(what, sizeof what, "%s -> %s on (%lld, %lld)", ts_placement_str(ts[t].from, x, sizeof x),
                     ts_placement_str(ts[t].to, y, sizeof y), (long long)sh[0], (long long)sh[1]);
            if (ts[t].to.kind == TS_PLACEMENT_PARTIAL) {
                /* Partial -> the same Partial: the local values stay */
                if (check_chunk(rc, what, m, &ts[t].to, ts_dtensor_local(b), 2, sh, rc->rank + 1)) return 1;
                ts_tensor *full = NULL;
                RK_OK(rc, ts_dtensor_full_tensor(b, &full));
                if (check_chunk(rc, what, m, &R, full, 2, sh, scale)) return 1;
                ts_tensor_free(full);
            } else if (check_dt(rc, what, b, m, &ts[t].to, 2, sh, scale)) {
                return 1;
            }
            /* the source is untouched */
            const double *p = ts_tensor_data(ts_dtensor_local(a)), *q = ts_tensor_data(before);
            for (int64_t i = 0; i < ts_tensor_numel(before); i++)
                if (p[i] != q[i]) return fail(rc, "%s: the source's local tensor changed at %lld", what, (long long)i);
            ts_tensor_free(before);
            ts_dtensor_free(b);
            ts_dtensor_free(a);
        }
    }
    ts_mesh_free(m);
    return 0;
}

Test(dtensor_dtensor, redistribute_every_transition_1d, .timeout = 60)
{
    th_mem_mark();
    for (int W = 1; W <= 4; W++) run_world(W, r_redistribute_1d, NULL);
    th_mem_assert_back();
}

/* Shard(0) -> Replicate moves exactly one all-gather; Replicate -> Shard
 * none; Partial -> Shard one reduce-scatter. */
static int r_comm_counts(rank_ctx *rc)
{
    ts_mesh *m = NULL;
    RK_OK(rc, mesh_1d(rc, &m));
    ts_comm *g = ts_mesh_group(m, "dp");
    int64_t sh[2] = {5, 3};
    const ts_placement S0 = ts_shard(0), R = ts_replicate(), PS = ts_partial(TS_REDUCE_SUM);
    const trans ts[3] = {{S0, R}, {R, S0}, {PS, S0}};
    const int kind[3] = {TS_COLL_ALL_GATHER, -1, TS_COLL_REDUCE_SCATTER};
    for (int t = 0; t < 3; t++) {
        ts_dtensor *a = NULL, *b = NULL;
        double scale;
        if (make_dt(rc, m, &ts[t].from, 2, sh, &a, &scale)) return 1;
        ts_comm_stats_reset(g);
        RK_OK(rc, ts_dtensor_redistribute(a, &ts[t].to, &b));
        ts_comm_counters cnt;
        ts_comm_stats(g, &cnt);
        uint64_t total = 0;
        for (int k = 0; k < TS_COLL_KIND_COUNT; k++) total += cnt.calls[k];
        RK_EQ(rc, total, kind[t] < 0 ? 0 : 1);
        if (kind[t] >= 0) RK_EQ(rc, cnt.calls[kind[t]], 1);
        ts_dtensor_free(b);
        ts_dtensor_free(a);
    }
    ts_mesh_free(m);
    return 0;
}

Test(dtensor_dtensor, redistribute_uses_one_collective, .timeout = 60)
{
    th_mem_mark();
    for (int W = 2; W <= 4; W += 2) run_world(W, r_comm_counts, NULL);
    th_mem_assert_back();
}

/* ------------------------------------------------------------ 2 x 2 mesh */

static ts_status mesh_2x2(rank_ctx *rc, ts_mesh **out)
{
    const char *names[2] = {"dp", "tp"};
    int64_t shape[2] = {2, 2};
    return ts_mesh_new(rc->c, "cpu", 2, shape, names, out);
}

static int r_2x2(rank_ctx *rc)
{
    ts_mesh *m = NULL;
    RK_OK(rc, mesh_2x2(rc, &m));
    const ts_placement S0 = ts_shard(0), S1 = ts_shard(1), R = ts_replicate();
    const ts_placement pls[][2] = {{R, S0}, {S0, S0}, {S0, S1}, {S1, S0}, {R, R}, {S0, R}, {S1, S1}, {R, S1}};
    const int np = (int)(sizeof pls / sizeof pls[0]);
    static const int64_t shapes[][2] = {{7, 5}, {4, 4}, {3, 2}};
    for (int c = 0; c < 3; c++) {
        const int64_t *sh = shapes[c];
        ts_tensor *g = NULL;
        RK_OK(rc, make_global(2, sh, 1.0, &g));
        for (int a = 0; a < np; a++) {
            char what[128], x[32], y[32];
            ts_dtensor *da = NULL;
            RK_OK(rc, ts_distribute_tensor(g, m, pls[a], -1, &da));
            snprintf(what, sizeof what, "distribute (%s, %s) of (%lld, %lld)", ts_placement_str(pls[a][0], x, sizeof x),
                     ts_placement_str(pls[a][1], y, sizeof y), (long long)sh[0], (long long)sh[1]);
            if (check_dt(rc, what, da, m, pls[a], 2, sh, 1.0)) return 1;
            for (int b = 0; b < np; b++) {
                ts_dtensor *db = NULL;
                RK_OK(rc, ts_dtensor_redistribute(da, pls[b], &db));
                char z[32], w[32];
                snprintf(what, sizeof what, "(%s, %s) -> (%s, %s) of (%lld, %lld)",
                         ts_placement_str(pls[a][0], x, sizeof x), ts_placement_str(pls[a][1], y, sizeof y),
                         ts_placement_str(pls[b][0], z, sizeof z), ts_placement_str(pls[b][1], w, sizeof w),
                         (long long)sh[0], (long long)sh[1]);
                if (check_dt(rc, what, db, m, pls[b], 2, sh, 1.0)) return 1;
                ts_dtensor_free(db);
            }
            ts_dtensor_free(da);
        }
        ts_tensor_free(g);
    }
    ts_mesh_free(m);
    return 0;
}

Test(dtensor_dtensor, mesh_2x2_hsdp_nested_and_mixed, .timeout = 60)
{
    th_mem_mark();
    run_world(4, r_2x2, NULL);
    th_mem_assert_back();
}

/* Partial on one or both mesh dims of a 2 x 2 mesh, to Replicate and
 * Shard layouts. */
static int r_2x2_partial(rank_ctx *rc)
{
    ts_mesh *m = NULL;
    RK_OK(rc, mesh_2x2(rc, &m));
    const ts_placement S0 = ts_shard(0), S1 = ts_shard(1), R = ts_replicate(), PS = ts_partial(TS_REDUCE_SUM),
                       PA = ts_partial(TS_REDUCE_AVG);
    const ts_placement from[][2] = {{PS, S0}, {PA, S1}, {S0, PS}, {PS, PA}, {R, PS}, {PS, R}};
    const ts_placement to[][2] = {{R, R}, {S0, S0}, {R, S0}, {S0, S1}, {S1, S0}, {S0, R}, {R, S1}};
    int64_t sh[2] = {5, 3};
    for (size_t a = 0; a < sizeof from / sizeof from[0]; a++) {
        for (size_t b = 0; b < sizeof to / sizeof to[0]; b++) {
            ts_dtensor *da = NULL, *db = NULL;
            double scale;
            if (make_dt(rc, m, from[a], 2, sh, &da, &scale)) return 1;
            RK_OK(rc, ts_dtensor_redistribute(da, to[b], &db));
            char what[128], x[32], y[32], z[32], w[32];
            snprintf(what, sizeof what, "(%s, %s) -> (%s, %s)", ts_placement_str(from[a][0], x, sizeof x),
                     ts_placement_str(from[a][1], y, sizeof y), ts_placement_str(to[b][0], z, sizeof z),
                     ts_placement_str(to[b][1], w, sizeof w));
            if (check_dt(rc, what, db, m, to[b], 2, sh, scale)) return 1;
            ts_dtensor_free(db);
            ts_dtensor_free(da);
        }
    }
    ts_mesh_free(m);
    return 0;
}

Test(dtensor_dtensor, mesh_2x2_partial_reductions, .timeout = 60)
{
    th_mem_mark();
    run_world(4, r_2x2_partial, NULL);
    th_mem_assert_back();
}

/* distribute from a src_rank on 2 x 2: src 3 is coordinate (1, 1). */
static int r_2x2_src(rank_ctx *rc)
{
    ts_mesh *m = NULL;
    RK_OK(rc, mesh_2x2(rc, &m));
    int64_t sh[2] = {7, 5};
    const ts_placement pls[][2] = {
        {ts_replicate(), ts_shard(0)}, {ts_shard(0), ts_shard(0)}, {ts_shard(0), ts_shard(1)}};
    for (int src = 0; src < 4; src += 3) {
        for (int p = 0; p < 3; p++) {
            ts_tensor *g = NULL;
            if (rc->rank == src) {
                RK_OK(rc, make_global(2, sh, 1.0, &g));
            } else {
                RK_OK(rc, ts_tensor_full(TS_F64, 2, sh, -3.0, &g));
            }
            ts_dtensor *dt = NULL;
            RK_OK(rc, ts_distribute_tensor(g, m, pls[p], src, &dt));
            if (check_dt(rc, "2x2 from src_rank", dt, m, pls[p], 2, sh, 1.0)) return 1;
            if (rc->rank != src) {
                const double *v = ts_tensor_data(g);
                for (int i = 0; i < 35; i++)
                    if (v[i] != -3.0) return fail(rc, "the non-source tensor was written at %d", i);
            }
            ts_dtensor_free(dt);
            ts_tensor_free(g);
        }
    }
    ts_mesh_free(m);
    return 0;
}

Test(dtensor_dtensor, mesh_2x2_distribute_from_src_rank, .timeout = 60)
{
    th_mem_mark();
    run_world(4, r_2x2_src, NULL);
    th_mem_assert_back();
}

/* ------------------------------------------------------------ other dtypes and ranks */

/* float32 and int64 move through gathers and reductions; a 3-d tensor
 * sharded on its last dim; a 1-d tensor; a 0-d replicated scalar. */
static int r_dtypes_and_dims(rank_ctx *rc)
{
    ts_mesh *m = NULL;
    RK_OK(rc, mesh_1d(rc, &m));
    const ts_dtype dts[2] = {TS_F32, TS_I64};
    for (int k = 0; k < 2; k++) {
        int64_t sh[3] = {2, 3, 5};
        ts_tensor *g64 = NULL, *g = NULL;
        RK_OK(rc, make_global(3, sh, 1.0, &g64));
        RK_OK(rc, ts_tensor_empty(dts[k], 3, sh, &g));
        RK_OK(rc, ts_tensor_copy_(g, g64));
        ts_placement s2 = ts_shard(2), r = ts_replicate();
        ts_dtensor *a = NULL, *b = NULL;
        RK_OK(rc, ts_distribute_tensor(g, m, &s2, -1, &a));
        RK_EQ(rc, ts_tensor_dtype(ts_dtensor_local(a)), dts[k]);
        RK_OK(rc, ts_dtensor_redistribute(a, &r, &b));
        RK_EQ(rc, ts_tensor_dtype(ts_dtensor_local(b)), dts[k]);
        if (check_chunk(rc, "3-d Shard(2) -> Replicate", m, &r, ts_dtensor_local(b), 3, sh, 1.0)) return 1;
        ts_dtensor_free(b);
        ts_dtensor_free(a);
        ts_tensor_free(g);
        ts_tensor_free(g64);
    }
    {
        int64_t sh[1] = {6};
        ts_tensor *g = NULL;
        RK_OK(rc, make_global(1, sh, 1.0, &g));
        ts_placement s0 = ts_shard(0);
        ts_dtensor *a = NULL;
        RK_OK(rc, ts_distribute_tensor(g, m, &s0, -1, &a));
        if (check_dt(rc, "1-d", a, m, &s0, 1, sh, 1.0)) return 1;
        ts_dtensor_free(a);
        ts_tensor_free(g);
    }
    {
        ts_tensor *s = NULL, *full = NULL;
        RK_OK(rc, ts_tensor_scalar(TS_F64, rc->rank + 1, &s));
        ts_placement ps = ts_partial(TS_REDUCE_SUM);
        ts_dtensor *a = NULL;
        RK_OK(rc, ts_dtensor_from_local(s, m, &ps, 0, NULL, &a));
        RK_OK(rc, ts_dtensor_full_tensor(a, &full));
        double v = 0;
        RK_OK(rc, ts_tensor_item(full, &v));
        if (v != rc->W * (rc->W + 1) / 2.0) return fail(rc, "0-d Partial(sum) gave %g", v);
        double l = 0;
        RK_OK(rc, ts_tensor_item(s, &l));
        RK_EQ(rc, l, rc->rank + 1);
        ts_tensor_free(full);
        ts_dtensor_free(a);
        ts_tensor_free(s);
    }
    ts_mesh_free(m);
    return 0;
}

Test(dtensor_dtensor, dtypes_and_ranks, .timeout = 60)
{
    th_mem_mark();
    for (int W = 1; W <= 4; W++) run_world(W, r_dtypes_and_dims, NULL);
    th_mem_assert_back();
}

/* ------------------------------------------------------------ errors (one process) */

static ts_mesh *one_rank_mesh(int ndim)
{
    const char *names[2] = {"dp", "tp"};
    int64_t shape[2] = {1, 1};
    ts_mesh *m = NULL;
    TH_OK(ts_mesh_new(NULL, "cpu", ndim, shape, names, &m));
    return m;
}

Test(dtensor_dtensor, one_rank_round_trip_and_autograd_off, .timeout = 60)
{
    th_mem_mark();
    ts_mesh *m = one_rank_mesh(2);
    int64_t sh[2] = {3, 4};
    ts_tensor *g = th_seq(TS_F64, 2, sh, 1.0, true);
    ts_placement pl[2] = {ts_shard(1), ts_shard(0)};
    ts_dtensor *dt = NULL;
    TH_OK(ts_distribute_tensor(g, m, pl, -1, &dt));
    cr_assert(ts_grad_mode_enabled());
    cr_assert_not(ts_tensor_requires_grad(ts_dtensor_local(dt)));
    th_assert_close(ts_dtensor_local(dt), g, 0, 0);
    ts_tensor *full = NULL;
    TH_OK(ts_dtensor_full_tensor(dt, &full));
    cr_assert_not(ts_tensor_requires_grad(full));
    th_assert_close(full, g, 0, 0);
    ts_tensor_free(full);
    ts_placement rep[2] = {ts_replicate(), ts_replicate()};
    ts_dtensor *r = NULL;
    TH_OK(ts_dtensor_redistribute(dt, rep, &r));
    th_assert_close(ts_dtensor_local(r), g, 0, 0);
    /* all-Replicate: full_tensor is the local tensor itself */
    TH_OK(ts_dtensor_full_tensor(r, &full));
    cr_assert_eq(full, ts_dtensor_local(r));
    ts_tensor_free(full);
    ts_dtensor_free(r);
    ts_dtensor_free(dt);
    ts_tensor_free(g);
    ts_mesh_free(m);
    th_mem_assert_back();
}

Test(dtensor_dtensor, errors_name_placements_and_shapes, .timeout = 60)
{
    th_mem_mark();
    ts_mesh *m = one_rank_mesh(1);
    int64_t sh[2] = {5, 3};
    ts_tensor *g = th_seq(TS_F64, 2, sh, 1.0, false);
    ts_dtensor *dt = NULL;

    /* Shard dim out of range */
    ts_placement s2 = ts_shard(2), sm = ts_shard(-1);
    TH_FAILS(ts_distribute_tensor(g, m, &s2, -1, &dt), TS_ERR_INDEX, "Shard(2)", "(5, 3)");
    TH_FAILS(ts_distribute_tensor(g, m, &sm, -1, &dt), TS_ERR_INDEX, "Shard(-1)", "(5, 3)");
    TH_FAILS(ts_dtensor_from_local(g, m, &s2, 2, sh, &dt), TS_ERR_INDEX, "Shard(2)", "(5, 3)");
    /* Partial in distribute_tensor */
    ts_placement ps = ts_partial(TS_REDUCE_SUM);
    TH_FAILS(ts_distribute_tensor(g, m, &ps, -1, &dt), TS_ERR_INVALID_ARGUMENT, "Partial(sum)");
    /* unknown placement kind and reduce op */
    ts_placement bad = {(ts_placement_kind)7, 0, TS_REDUCE_SUM};
    TH_FAILS(ts_distribute_tensor(g, m, &bad, -1, &dt), TS_ERR_INVALID_ARGUMENT, "kind 7");
    ts_placement badop = ts_partial((ts_reduce_op)9);
    TH_FAILS(ts_dtensor_from_local(g, m, &badop, 2, sh, &dt), TS_ERR_INVALID_ARGUMENT, "op 9");
    /* src_rank outside the mesh */
    ts_placement s0 = ts_shard(0), r = ts_replicate();
    TH_FAILS(ts_distribute_tensor(g, m, &s0, 1, &dt), TS_ERR_INVALID_ARGUMENT, "src_rank 1", "Shard(0)");
    /* NULL arguments */
    TH_FAILS(ts_distribute_tensor(NULL, m, &s0, -1, &dt), TS_ERR_INVALID_ARGUMENT, "NULL");
    TH_FAILS(ts_distribute_tensor(g, NULL, &s0, -1, &dt), TS_ERR_INVALID_ARGUMENT, "NULL");
    TH_FAILS(ts_distribute_tensor(g, m, NULL, -1, &dt), TS_ERR_INVALID_ARGUMENT, "NULL");
    TH_FAILS(ts_distribute_tensor(g, m, &s0, -1, NULL), TS_ERR_INVALID_ARGUMENT, "NULL");
    TH_FAILS(ts_dtensor_from_local(NULL, m, &s0, 2, sh, &dt), TS_ERR_INVALID_ARGUMENT, "NULL");
    TH_FAILS(ts_dtensor_from_local(g, m, &s0, 2, sh, NULL), TS_ERR_INVALID_ARGUMENT, "NULL");
    TH_FAILS(ts_dtensor_redistribute(NULL, &s0, &dt), TS_ERR_INVALID_ARGUMENT, "NULL");
    ts_tensor *full = NULL;
    TH_FAILS(ts_dtensor_full_tensor(NULL, &full), TS_ERR_INVALID_ARGUMENT, "NULL");
    cr_assert_null(dt);

    /* Replicate or Shard -> Partial is unsupported */
    ts_dtensor *a = NULL;
    TH_OK(ts_distribute_tensor(g, m, &r, -1, &a));
    TH_FAILS(ts_dtensor_redistribute(a, &ps, &dt), TS_ERR_UNSUPPORTED, "Replicate()", "Partial(sum)");
    TH_FAILS(ts_dtensor_redistribute(a, &s2, &dt), TS_ERR_INDEX, "Shard(2)", "(5, 3)");
    TH_FAILS(ts_dtensor_redistribute(a, NULL, &dt), TS_ERR_INVALID_ARGUMENT, "NULL");
    TH_FAILS(ts_dtensor_redistribute(a, &s0, NULL), TS_ERR_INVALID_ARGUMENT, "NULL");
    TH_FAILS(ts_dtensor_full_tensor(a, NULL), TS_ERR_INVALID_ARGUMENT, "NULL");
    cr_assert_eq(ts_dtensor_local_offset(a, 2), -1);
    cr_assert_eq(ts_last_status(), TS_ERR_INDEX);
    ts_dtensor_free(a);
    TH_OK(ts_distribute_tensor(g, m, &s0, -1, &a));
    TH_FAILS(ts_dtensor_redistribute(a, &ps, &dt), TS_ERR_UNSUPPORTED, "Shard(0)", "Partial(sum)");
    ts_dtensor_free(a);
    /* Partial(sum) -> Partial(avg) too */
    TH_OK(ts_dtensor_from_local(g, m, &ps, 2, sh, &a));
    ts_placement pa = ts_partial(TS_REDUCE_AVG);
    TH_FAILS(ts_dtensor_redistribute(a, &pa, &dt), TS_ERR_UNSUPPORTED, "Partial(sum)", "Partial(avg)");
    ts_dtensor_free(a);
    cr_assert_null(dt);

    /* accessors accept NULL */
    cr_assert_null(ts_dtensor_local(NULL));
    cr_assert_null(ts_dtensor_to_local(NULL));
    cr_assert_null(ts_dtensor_mesh(NULL));
    cr_assert_null(ts_dtensor_placements(NULL));
    cr_assert_null(ts_dtensor_shape(NULL));
    cr_assert_eq(ts_dtensor_ndim(NULL), -1);
    ts_dtensor_free(NULL);

    ts_tensor_free(g);
    ts_mesh_free(m);
    th_mem_assert_back();
}
