/* fully_shard_shard_info: the public doors through which checkpoint/ reads
 * sharding (fully_shard.h: ts_fsdp_param_shard_info, ts_fsdp_is_idle,
 * ts_fsdp_world, ts_fsdp_reshard_tree, ts_fsdp_materialize_empty), checked
 * against what the public DTensor of each parameter says. */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <pthread.h>
#include <string.h>

#include "fully_shard/fully_shard.h"
#include "tests/loopback_ranks.h"

static pthread_mutex_t g_build_mu = PTHREAD_MUTEX_INITIALIZER;

/* Sequential(Linear(7, 5), Linear(5, 2)), the first sharded on its own,
 * the root holding the second; on meta when meta. 5 and 2 rows over 3
 * ranks leave rank 2 one row of the first and none of the second. */
static ts_status model_new(bool meta, ts_module **out, ts_module **first)
{
    ts_module *c[2] = {0};
    pthread_mutex_lock(&g_build_mu);
    ts_manual_seed(5);
    ts_status st = meta ? ts_device_scope_enter(TS_DEVICE_META) : TS_OK;
    if (!st) st = ts_linear_new(7, 5, true, &c[0]);
    if (!st) st = ts_linear_new(5, 2, true, &c[1]);
    if (!st) st = ts_sequential_new(2, c, out);
    if (meta) (void)ts_device_scope_exit();
    pthread_mutex_unlock(&g_build_mu);
    *first = c[0];
    return st;
}

static int shard_model(th_rank *rc, ts_mesh **mesh, ts_module *m, ts_module *first)
{
    int64_t shape[1] = {rc->W};
    const char *names[1] = {"dp"};
    TH_RK_OK(rc, ts_mesh_new(rc->c, "cpu", 1, shape, names, mesh));
    ts_fsdp_options o = ts_fsdp_options_default();
    o.mesh = *mesh;
    TH_RK_OK(rc, ts_fully_shard(first, &o));
    TH_RK_OK(rc, ts_fully_shard(m, &o));
    return 0;
}

/* Every parameter's shard_info agrees with its DTensor, and with
 * ts_chunk_range for this rank's rows. */
static int check_params(th_rank *rc, ts_module *m)
{
    ts_named_params np;
    TH_RK_OK(rc, ts_module_named_parameters(m, &np));
    for (int i = 0; i < np.n; i++) {
        ts_tensor *t = *np.items[i].slot;
        ts_fsdp_shard_info sh;
        TH_RK_OK(rc, ts_fsdp_param_shard_info(m, t, &sh));
        if (sh.shard != t) return th_rank_fail(rc, "%s: shard_info's shard is not the slot's shard", np.items[i].name);
        if (sh.dtensor != ts_fsdp_param_dtensor(t))
            return th_rank_fail(rc, "%s: shard_info's DTensor is not ts_fsdp_param_dtensor's", np.items[i].name);
        TH_RK_EQ(rc, sh.shard_world, rc->W);
        TH_RK_EQ(rc, ts_comm_size(sh.shard_group), rc->W);
        TH_RK_EQ(rc, sh.shard_rank, ts_comm_rank(sh.shard_group));
        TH_RK_EQ(rc, sh.shard_rank, rc->rank);
        if (sh.replicate_group) return th_rank_fail(rc, "%s: a replicate group without HSDP", np.items[i].name);
        int64_t row0 = 0, rows = 0;
        ts_chunk_range(ts_dtensor_shape(sh.dtensor)[0], sh.shard_world, sh.shard_rank, &row0, &rows);
        TH_RK_EQ(rc, ts_dtensor_local_offset(sh.dtensor, 0), row0);
        TH_RK_EQ(rc, ts_tensor_shape(t)[0], rows);
    }
    ts_named_params_free(&np);
    return 0;
}

static int rank_shard_info(th_rank *rc)
{
    ts_module *m = NULL, *first = NULL;
    ts_mesh *mesh = NULL;
    TH_RK_OK(rc, model_new(false, &m, &first));
    /* before fully_shard: nothing is sharded, the world is the initialized one */
    ts_named_params np;
    TH_RK_OK(rc, ts_module_named_parameters(m, &np));
    ts_fsdp_shard_info sh;
    memset(&sh, 0xab, sizeof sh);
    TH_RK_OK(rc, ts_fsdp_param_shard_info(m, *np.items[0].slot, &sh));
    if (sh.shard || sh.dtensor || sh.shard_group || sh.replicate_group || sh.shard_world)
        return th_rank_fail(rc, "a plain parameter has a shard_info");
    ts_named_params_free(&np);
    ts_comm *world = NULL;
    TH_RK_OK(rc, ts_fsdp_world(m, &world));
    if (world != ts_dist_world()) return th_rank_fail(rc, "an unsharded model's world is not ts_dist_world()");

    if (shard_model(rc, &mesh, m, first)) return 1;
    TH_RK_OK(rc, ts_fsdp_world(m, &world));
    if (world != rc->c) return th_rank_fail(rc, "the world is not the one the mesh was made over");
    bool idle = false;
    TH_RK_OK(rc, ts_fsdp_is_idle(m, &idle));
    if (!idle) return th_rank_fail(rc, "a model at rest is not idle");
    if (check_params(rc, m)) return 1;

    /* unsharded: the slots hold the full tensors, shard_info still finds the shards */
    ts_fsdp_unshard_handle *h = NULL;
    TH_RK_OK(rc, ts_fsdp_unshard(first, false, &h));
    TH_RK_OK(rc, ts_module_named_parameters(first, &np));
    for (int i = 0; i < np.n; i++) {
        ts_tensor *t = *np.items[i].slot;
        if (ts_fsdp_param_dtensor(t)) return th_rank_fail(rc, "%s: still sharded after unshard", np.items[i].name);
        TH_RK_OK(rc, ts_fsdp_param_shard_info(m, t, &sh));
        if (!sh.shard || !ts_fsdp_param_dtensor(sh.shard))
            return th_rank_fail(rc, "%s: no shard for the unsharded tensor", np.items[i].name);
    }
    ts_named_params_free(&np);
    TH_RK_OK(rc, ts_fsdp_reshard_tree(m));
    if (check_params(rc, m)) return 1;     /* sharded again, every slot */
    TH_RK_OK(rc, ts_fsdp_reshard_tree(m)); /* already sharded: unchanged */
    if (check_params(rc, m)) return 1;
    ts_module_free(m);
    ts_mesh_free(mesh);
    return 0;
}

Test(fully_shard_shard_info, matches_the_dtensors, .timeout = 30) { th_run_world(3, rank_shard_info, NULL, 20.0); }

/* ts_fsdp_materialize_empty gives the meta shards zeros (no replay), where
 * ts_fsdp_materialize replays the recorded initializers. */
static int rank_materialize_empty(th_rank *rc)
{
    for (int replay = 0; replay < 2; replay++) {
        ts_module *m = NULL, *first = NULL;
        ts_mesh *mesh = NULL;
        TH_RK_OK(rc, model_new(true, &m, &first));
        if (shard_model(rc, &mesh, m, first)) return 1;
        TH_RK_OK(rc, replay ? ts_fsdp_materialize(m) : ts_fsdp_materialize_empty(m));
        ts_named_params np;
        TH_RK_OK(rc, ts_module_named_parameters(m, &np));
        int64_t nonzero = 0;
        for (int i = 0; i < np.n; i++) {
            ts_tensor *t = *np.items[i].slot;
            if (ts_tensor_is_meta(t)) return th_rank_fail(rc, "%s: still on meta", np.items[i].name);
            const float *d = ts_tensor_data(t);
            for (int64_t k = 0; k < ts_tensor_numel(t); k++) nonzero += d[k] != 0.0f;
        }
        ts_named_params_free(&np);
        if (!replay && nonzero) return th_rank_fail(rc, "materialize_empty: %lld nonzero values", (long long)nonzero);
        if (replay && !nonzero) return th_rank_fail(rc, "materialize replayed nothing");
        ts_module_free(m);
        ts_mesh_free(mesh);
    }
    return 0;
}

Test(fully_shard_shard_info, materialize_empty_leaves_zeros, .timeout = 30)
{
    th_run_world(2, rank_materialize_empty, NULL, 20.0);
}

Test(fully_shard_shard_info, null_arguments)
{
    ts_fsdp_shard_info sh;
    bool idle;
    ts_comm *w;
    cr_assert_eq(ts_fsdp_param_shard_info(NULL, NULL, &sh), TS_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(ts_last_error(), "ts_fsdp_param_shard_info"), "%s", ts_last_error());
    cr_assert_eq(ts_fsdp_is_idle(NULL, &idle), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_fsdp_world(NULL, &w), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_fsdp_reshard_tree(NULL), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_fsdp_materialize_empty(NULL), TS_ERR_INVALID_ARGUMENT);
}
