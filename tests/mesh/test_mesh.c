#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "mesh/mesh.h"
#include "tests/loopback_ranks.h"

/* Meshes over W loopback ranks run as threads of this test, each with its
 * own world (as tests/comm/test_collectives.c). Rank threads never call
 * cr_assert: they write their first failure into their slot and the test
 * asserts on it. Group membership is checked with an all-reduce of
 * one-hot vectors: the sum is 1 exactly at the group's global ranks. */

#define MAXW TH_MAXW
typedef th_rank rank_ctx;
typedef th_rank_fn rank_fn;
#define fail th_rank_fail
#define RK_OK TH_RK_OK
#define RK_EQ TH_RK_EQ

static void run_world(int W, rank_fn fn, const void *arg) { th_run_world(W, fn, (void *)arg, 30.0); }

/* Checks that g holds exactly the global ranks in want[0..n) (in group
 * rank order: want[i] is group rank i) and that an all-reduce over it sums
 * over exactly them. */
static int check_group(rank_ctx *rc, ts_comm *g, int n, const int *want)
{
    if (!g) return fail(rc, "NULL group");
    RK_EQ(rc, ts_comm_size(g), n);
    int me = -1;
    for (int i = 0; i < n; i++)
        if (want[i] == rc->rank) me = i;
    RK_EQ(rc, ts_comm_rank(g), me);
    /* one-hot at this rank's global rank, weighted by its group rank + 1 */
    int64_t shape[1] = {rc->W};
    ts_tensor *t = NULL;
    RK_OK(rc, ts_tensor_empty(TS_I64, 1, shape, &t));
    int64_t *p = ts_tensor_data(t);
    for (int i = 0; i < rc->W; i++) p[i] = 0;
    p[rc->rank] = ts_comm_rank(g) + 1;
    ts_status s = ts_all_reduce(g, t, TS_REDUCE_SUM, NULL);
    if (s != TS_OK) {
        ts_tensor_free(t);
        return fail(rc, "all_reduce: %s", ts_last_error());
    }
    int64_t want_v[MAXW] = {0};
    for (int i = 0; i < n; i++) want_v[want[i]] = i + 1;
    for (int i = 0; i < rc->W; i++) {
        if (p[i] != want_v[i]) {
            long long got = (long long)p[i];
            ts_tensor_free(t);
            return fail(rc, "all_reduce sum at global rank %d is %lld, expected %lld", i, got, (long long)want_v[i]);
        }
    }
    ts_tensor_free(t);
    return 0;
}

/* ------------------------------------------------------------ one rank */

Test(mesh_mesh, one_rank_without_world, .timeout = 30)
{
    th_mem_mark();
    const char *names[2] = {"dp", "tp"};
    int64_t shape[2] = {1, 1};
    ts_mesh *m = NULL;
    TH_OK(ts_mesh_new(NULL, "cpu", 2, shape, names, &m));
    cr_assert_eq(ts_mesh_ndim(m), 2);
    cr_assert_str_eq(ts_mesh_device_type(m), "cpu");
    cr_assert_str_eq(ts_mesh_dim_name(m, 1), "tp");
    cr_assert_eq(ts_mesh_size(m, NULL), 1);
    cr_assert_eq(ts_mesh_size(m, "dp"), 1);
    cr_assert_eq(ts_mesh_get_local_rank(m, "tp"), 0);
    int coord[2] = {-1, -1};
    ts_mesh_coordinate(m, coord);
    cr_assert(coord[0] == 0 && coord[1] == 0);
    ts_comm *g = ts_mesh_group(m, "dp");
    cr_assert_not_null(g);
    cr_assert_eq(ts_comm_size(g), 1);
    cr_assert_eq(ts_comm_rank(g), 0);
    int64_t three[1] = {3};
    ts_tensor *t = NULL;
    TH_OK(ts_tensor_empty(TS_I64, 1, three, &t));
    int64_t *p = ts_tensor_data(t);
    p[0] = 5;
    p[1] = 6;
    p[2] = 7;
    TH_OK(ts_all_reduce(g, t, TS_REDUCE_SUM, NULL));
    cr_assert(p[0] == 5 && p[1] == 6 && p[2] == 7);
    ts_tensor_free(t);
    ts_mesh *s = NULL, *fl = NULL;
    TH_OK(ts_mesh_slice(m, "tp", &s));
    TH_OK(ts_mesh_flatten(m, 2, names, "dp_tp", &fl));
    ts_mesh_free(m);
    cr_assert_eq(ts_mesh_ndim(s), 1);
    cr_assert_eq(ts_comm_size(ts_mesh_group(s, NULL)), 1);
    cr_assert_eq(ts_mesh_size(fl, "dp_tp"), 1);
    ts_mesh_free(s);
    ts_mesh_free(fl);

    const char *n1[1] = {"x"};
    int64_t shape1[1] = {1};
    TH_OK(ts_mesh_new(NULL, "cpu", 1, shape1, n1, &m));
    cr_assert_eq(ts_mesh_group(m, NULL), ts_comm_world());
    ts_mesh_free(m);
    ts_mesh_free(NULL);
    th_mem_assert_back();
}

/* ------------------------------------------------------------ 2 x 2 */

static int r_2x2(rank_ctx *rc)
{
    int r = rc->rank;
    const char *names[2] = {"dp", "tp"};
    int64_t shape[2] = {2, 2};
    ts_mesh *m = NULL;
    RK_OK(rc, ts_mesh_new(rc->c, "cpu", 2, shape, names, &m));
    RK_EQ(rc, ts_mesh_ndim(m), 2);
    RK_EQ(rc, ts_mesh_size(m, NULL), 4);
    RK_EQ(rc, ts_mesh_size(m, "dp"), 2);
    RK_EQ(rc, ts_mesh_dim_size(m, 1), 2);
    int coord[2];
    ts_mesh_coordinate(m, coord);
    RK_EQ(rc, coord[0], r / 2);
    RK_EQ(rc, coord[1], r % 2);
    RK_EQ(rc, ts_mesh_get_local_rank(m, "dp"), r / 2);
    RK_EQ(rc, ts_mesh_get_local_rank(m, "tp"), r % 2);
    int dp[2] = {r % 2, r % 2 + 2}, tp[2] = {2 * (r / 2), 2 * (r / 2) + 1};
    if (check_group(rc, ts_mesh_group(m, "dp"), 2, dp) || check_group(rc, ts_mesh_group(m, "tp"), 2, tp)) {
        ts_mesh_free(m);
        return 1;
    }
    /* groups are made once: the same pointer each time, shared by slices */
    ts_mesh *s = NULL;
    RK_OK(rc, ts_mesh_slice(m, "tp", &s));
    if (ts_mesh_group(s, "tp") != ts_mesh_group(m, "tp")) return fail(rc, "slice does not share the group");
    RK_EQ(rc, ts_mesh_ndim(s), 1);
    RK_EQ(rc, ts_mesh_size(s, NULL), 2);
    RK_EQ(rc, ts_mesh_get_local_rank(s, NULL), r % 2);
    /* flatten over both dims: the whole world in rank order */
    ts_mesh *fl = NULL;
    RK_OK(rc, ts_mesh_flatten(m, 2, names, "dp_tp", &fl));
    ts_mesh_free(m); /* the slice keeps its group alive */
    int all[4] = {0, 1, 2, 3};
    if (check_group(rc, ts_mesh_group(s, NULL), 2, tp) || check_group(rc, ts_mesh_group(fl, "dp_tp"), 4, all)) {
        ts_mesh_free(s);
        ts_mesh_free(fl);
        return 1;
    }
    RK_EQ(rc, ts_mesh_get_local_rank(fl, "dp_tp"), r);
    RK_EQ(rc, ts_mesh_size(fl, "dp_tp"), 4);
    RK_EQ(rc, ts_mesh_ndim(fl), 1);
    /* a single-dim flatten renames and shares */
    ts_mesh *f1 = NULL;
    const char *tpn[1] = {"tp"};
    RK_OK(rc, ts_mesh_flatten(s, 1, tpn, "tp2", &f1));
    if (ts_mesh_group(f1, "tp2") != ts_mesh_group(s, "tp")) return fail(rc, "1-dim flatten does not share");
    ts_mesh_free(f1);
    ts_mesh_free(s);
    ts_mesh_free(fl);
    return 0;
}

Test(mesh_mesh, two_by_two_row_major, .timeout = 60) { run_world(4, r_2x2, NULL); }

/* ------------------------------------------------------------ 2 x 1 x 2 flatten of outer dims */

static int r_2x1x2(rank_ctx *rc)
{
    int r = rc->rank;
    const char *names[3] = {"pp", "dp", "tp"};
    int64_t shape[3] = {2, 1, 2};
    ts_mesh *m = NULL;
    RK_OK(rc, ts_mesh_new(rc->c, "cpu", 3, shape, names, &m));
    int coord[3];
    ts_mesh_coordinate(m, coord);
    RK_EQ(rc, coord[0], r / 2);
    RK_EQ(rc, coord[1], 0);
    RK_EQ(rc, coord[2], r % 2);
    int self[1] = {r}, pp[2] = {r % 2, r % 2 + 2};
    if (check_group(rc, ts_mesh_group(m, "dp"), 1, self) || check_group(rc, ts_mesh_group(m, "pp"), 2, pp)) {
        ts_mesh_free(m);
        return 1;
    }
    /* pp and dp merged: same ranks as pp */
    ts_mesh *fl = NULL;
    const char *pd[2] = {"pp", "dp"};
    RK_OK(rc, ts_mesh_flatten(m, 2, pd, "pd", &fl));
    RK_EQ(rc, ts_mesh_get_local_rank(fl, "pd"), r / 2);
    int bad = check_group(rc, ts_mesh_group(fl, NULL), 2, pp);
    ts_mesh_free(fl);
    ts_mesh_free(m);
    return bad;
}

Test(mesh_mesh, flatten_outer_dims, .timeout = 60) { run_world(4, r_2x1x2, NULL); }

/* ------------------------------------------------------------ 1-d, 4x1, 1x4 */

static int r_1d(rank_ctx *rc)
{
    const char *names[1] = {"dp"};
    int64_t shape[1] = {4};
    ts_mesh *m = NULL;
    RK_OK(rc, ts_mesh_new(rc->c, "cpu", 1, shape, names, &m));
    if (ts_mesh_group(m, "dp") != rc->c) return fail(rc, "1-d mesh over the world does not reuse it");
    RK_EQ(rc, ts_mesh_get_local_rank(m, NULL), rc->rank);
    int all[4] = {0, 1, 2, 3};
    int bad = check_group(rc, ts_mesh_group(m, NULL), 4, all);
    ts_mesh_free(m);
    return bad;
}

Test(mesh_mesh, one_dim_of_four, .timeout = 60) { run_world(4, r_1d, NULL); }

static int r_4x1_1x4(rank_ctx *rc)
{
    int r = rc->rank, all[4] = {0, 1, 2, 3}, self[1] = {r};
    const char *names[2] = {"a", "b"};
    for (int k = 0; k < 2; k++) {
        int64_t shape[2] = {k ? 1 : 4, k ? 4 : 1};
        ts_mesh *m = NULL;
        RK_OK(rc, ts_mesh_new(rc->c, "cpu", 2, shape, names, &m));
        int coord[2];
        ts_mesh_coordinate(m, coord);
        RK_EQ(rc, coord[k], r);
        RK_EQ(rc, coord[1 - k], 0);
        RK_EQ(rc, ts_mesh_get_local_rank(m, k ? "b" : "a"), r);
        RK_EQ(rc, ts_mesh_get_local_rank(m, k ? "a" : "b"), 0);
        int bad = check_group(rc, ts_mesh_group(m, k ? "b" : "a"), 4, all) ||
            check_group(rc, ts_mesh_group(m, k ? "a" : "b"), 1, self);
        ts_mesh_free(m);
        if (bad) return 1;
    }
    return 0;
}

Test(mesh_mesh, four_by_one_and_one_by_four, .timeout = 60) { run_world(4, r_4x1_1x4, NULL); }

/* ------------------------------------------------------------ errors */

static void expect_err(ts_status got, ts_status want, const char *needle)
{
    cr_assert_eq(got, want, "got %s (%s), expected %s", ts_status_name(got), ts_last_error(), ts_status_name(want));
    cr_assert(strstr(ts_last_error(), needle) != NULL, "message '%s' lacks '%s'", ts_last_error(), needle);
}

static int r_bad_product(rank_ctx *rc)
{
    const char *names[2] = {"dp", "tp"};
    int64_t shape[2] = {2, 3};
    ts_mesh *m = NULL;
    ts_status s = ts_mesh_new(rc->c, "cpu", 2, shape, names, &m);
    if (s != TS_ERR_INVALID_ARGUMENT || m) return fail(rc, "2x3 over 4: %s", ts_status_name(s));
    if (!strstr(ts_last_error(), "(2, 3)") || !strstr(ts_last_error(), "world has 4"))
        return fail(rc, "message: %s", ts_last_error());
    int64_t shape2[2] = {1, 2};
    s = ts_mesh_new(rc->c, "cpu", 2, shape2, names, &m);
    if (s != TS_ERR_INVALID_ARGUMENT || m) return fail(rc, "1x2 over 4: %s", ts_status_name(s));
    if (!strstr(ts_last_error(), "2 ranks but the world has 4")) return fail(rc, "message: %s", ts_last_error());
    return 0;
}

Test(mesh_mesh, product_not_world_size, .timeout = 60) { run_world(4, r_bad_product, NULL); }

Test(mesh_mesh, argument_errors, .timeout = 30)
{
    th_mem_mark();
    ts_mesh *m = NULL;
    const char *ok[2] = {"dp", "tp"};
    int64_t one[TS_MESH_MAX_DIMS + 1] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
    int64_t two[2] = {2, 1}, zero[2] = {0, 1};

    expect_err(ts_mesh_new(NULL, "cuda", 2, one, ok, &m), TS_ERR_UNSUPPORTED, "cuda");
    expect_err(ts_mesh_new(NULL, "cuda:0", 2, one, ok, &m), TS_ERR_UNSUPPORTED, "only \"cpu\"");
    expect_err(ts_mesh_new(NULL, NULL, 2, one, ok, &m), TS_ERR_INVALID_ARGUMENT, "NULL");
    expect_err(ts_mesh_new(NULL, "cpu", 2, NULL, ok, &m), TS_ERR_INVALID_ARGUMENT, "NULL");
    expect_err(ts_mesh_new(NULL, "cpu", 2, one, NULL, &m), TS_ERR_INVALID_ARGUMENT, "NULL");
    expect_err(ts_mesh_new(NULL, "cpu", 2, one, ok, NULL), TS_ERR_INVALID_ARGUMENT, "NULL");
    expect_err(ts_mesh_new(NULL, "cpu", 0, one, ok, &m), TS_ERR_INVALID_ARGUMENT, "ndim 0");
    expect_err(ts_mesh_new(NULL, "cpu", -1, one, ok, &m), TS_ERR_INVALID_ARGUMENT, "ndim -1");
    const char *many[TS_MESH_MAX_DIMS + 1] = {"a", "b", "c", "d", "e", "f", "g", "h", "i"};
    expect_err(ts_mesh_new(NULL, "cpu", TS_MESH_MAX_DIMS + 1, one, many, &m), TS_ERR_INVALID_ARGUMENT, "ndim 9");
    TH_OK(ts_mesh_new(NULL, "cpu", TS_MESH_MAX_DIMS, one, many, &m));
    ts_mesh_free(m);
    m = NULL;
    expect_err(ts_mesh_new(NULL, "cpu", 2, two, ok, &m), TS_ERR_INVALID_ARGUMENT, "(2, 1)");
    expect_err(ts_mesh_new(NULL, "cpu", 2, zero, ok, &m), TS_ERR_INVALID_ARGUMENT, "size 0");
    const char *dup[2] = {"dp", "dp"}, *empty[2] = {"dp", ""}, *nul[2] = {NULL, "tp"};
    expect_err(ts_mesh_new(NULL, "cpu", 2, one, dup, &m), TS_ERR_INVALID_ARGUMENT, "same name 'dp'");
    expect_err(ts_mesh_new(NULL, "cpu", 2, one, empty, &m), TS_ERR_INVALID_ARGUMENT, "empty");
    expect_err(ts_mesh_new(NULL, "cpu", 2, one, nul, &m), TS_ERR_INVALID_ARGUMENT, "NULL");
    char longname[TS_MESH_NAME_MAX + 2];
    memset(longname, 'x', sizeof longname - 1);
    longname[sizeof longname - 1] = '\0';
    const char *lng[2] = {"dp", longname};
    expect_err(ts_mesh_new(NULL, "cpu", 2, one, lng, &m), TS_ERR_INVALID_ARGUMENT, "longer than");
    cr_assert_null(m);

    TH_OK(ts_mesh_new(NULL, "cpu", 2, one, ok, &m));
    ts_mesh *s = NULL;
    expect_err(ts_mesh_slice(m, "pp", &s), TS_ERR_NOT_FOUND, "no dim named 'pp' (dims: 'dp', 'tp')");
    expect_err(ts_mesh_slice(m, NULL, &s), TS_ERR_INVALID_ARGUMENT, "NULL");
    cr_assert_null(s);
    cr_assert_eq(ts_mesh_size(m, "pp"), -1);
    cr_assert_eq(ts_last_status(), TS_ERR_NOT_FOUND);
    cr_assert_eq(ts_mesh_get_local_rank(m, "pp"), -1);
    cr_assert_eq(ts_mesh_get_local_rank(m, NULL), -1);
    cr_assert_eq(ts_last_status(), TS_ERR_INVALID_ARGUMENT);
    cr_assert_null(ts_mesh_group(m, "pp"));
    cr_assert_null(ts_mesh_group(m, NULL));
    cr_assert_null(ts_mesh_dim_name(m, 2));
    cr_assert_eq(ts_last_status(), TS_ERR_INDEX);
    cr_assert_eq(ts_mesh_dim_size(m, -1), -1);
    cr_assert_eq(ts_mesh_dim_index(m, "tp"), 1);

    const char *rev[2] = {"tp", "dp"}, *rep[2] = {"dp", "dp"}, *unk[2] = {"dp", "zz"};
    expect_err(ts_mesh_flatten(m, 2, rev, "x", &s), TS_ERR_INVALID_ARGUMENT, "out of order");
    expect_err(ts_mesh_flatten(m, 2, rep, "x", &s), TS_ERR_INVALID_ARGUMENT, "repeated");
    expect_err(ts_mesh_flatten(m, 2, unk, "x", &s), TS_ERR_NOT_FOUND, "'zz'");
    expect_err(ts_mesh_flatten(m, 3, ok, "x", &s), TS_ERR_INVALID_ARGUMENT, "outside [1, 2]");
    expect_err(ts_mesh_flatten(m, 0, ok, "x", &s), TS_ERR_INVALID_ARGUMENT, "outside [1, 2]");
    expect_err(ts_mesh_flatten(m, 2, ok, "", &s), TS_ERR_INVALID_ARGUMENT, "empty");
    expect_err(ts_mesh_flatten(m, 2, ok, NULL, &s), TS_ERR_INVALID_ARGUMENT, "NULL");
    cr_assert_null(s);
    ts_mesh_free(m);
    th_mem_assert_back();
}
