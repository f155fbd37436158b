/*
 * Sharded and full checkpoints across real processes (UCX through tsrun's
 * launcher): saved on 2 ranks, loaded on 3 and on 1 (resharded), the full
 * model gathered after the load equals the one gathered before the save
 * bit for bit, and so do the streamed full file's and a full file loaded
 * with ts_ckpt_load_full. This binary is its own rank program
 * (TS_TEST_CKPT_ROLE, handled by a constructor before Criterion starts);
 * ranks report through their exit code and stderr and leave with _exit.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "checkpoint/checkpoint.h"
#include "comm/launch.h"
#include "tests/helpers.h"

static int g_rank = -1;

#define RFAIL(code, ...) th_rank_exit(g_rank, (code), __VA_ARGS__)
#define ROK(code, expr) \
    do { \
        ts_status s_ = (expr); \
        if (s_) RFAIL(code, "%s -> %s: %s", #expr, ts_status_name(s_), ts_last_error()); \
    } while (0)

/* Linear(4, 9), Tanh, Linear(9, 5): 9 and 5 rows on 2 and 3 ranks. */
static ts_module *build(uint64_t seed, ts_optim **opt)
{
    ts_manual_seed(seed);
    ts_module *c[3] = {0}, *m = NULL;
    ROK(30, ts_linear_new(4, 9, true, &c[0]));
    ROK(31, ts_tanh_new(&c[1]));
    ROK(32, ts_linear_new(9, 5, true, &c[2]));
    ROK(33, ts_sequential_new(3, c, &m));
    ROK(34, ts_fsdp_apply_by_type(m, "Linear", NULL, NULL));
    ROK(35, ts_fully_shard(m, NULL));
    ts_param_list pl;
    ROK(36, ts_module_parameters(m, &pl));
    ROK(37, ts_adamw_new(pl.n, pl.items, NULL, opt));
    ts_param_list_free(&pl);
    return m;
}

/* One AdamW step with gradients of 0.5 + 0.01 * i on every shard. */
static void step(ts_optim *opt)
{
    for (int i = 0; i < ts_optim_num_params(opt); i++) {
        ts_tensor *t = ts_optim_param(opt, i), *lv = NULL, *g = NULL;
        ROK(40, ts_tensor_local_view(t, &lv));
        ROK(41, ts_tensor_zeros(ts_tensor_dtype(lv), ts_tensor_ndim(lv), ts_tensor_shape(lv), &g));
        ROK(42, ts_tensor_fill_(g, 0.5 + 0.01 * i));
        ROK(43, ts_tensor_set_grad(t, g));
        ts_tensor_free(g);
        ts_tensor_free(lv);
    }
    ROK(44, ts_optim_step(opt));
}

static void save_full_dict(ts_module *m, const char *path)
{
    ts_state_dict *sd = NULL;
    ROK(50, ts_fsdp_full_state_dict(m, true, &sd));
    if (g_rank == 0) ROK(51, ts_safetensors_save(path, sd, NULL, 0));
    ts_state_dict_free(sd);
}

static void role(const char *what)
{
    g_rank = atoi(getenv("RANK") ? getenv("RANK") : "-1");
    const char *dir = getenv("TS_TEST_CKPT_DIR");
    ts_dist_options o = ts_dist_options_default();
    o.timeout_s = 60;
    ROK(11, ts_dist_init(&o));
    int W = ts_comm_size(ts_dist_world());
    char ck[512], full[512], ref[512], out[512];
    snprintf(ck, sizeof ck, "%s/ck", dir);
    snprintf(full, sizeof full, "%s/full.safetensors", dir);
    ts_optim *opt = NULL;
    if (!strcmp(what, "save")) {
        ts_module *m = build(1, &opt);
        step(opt);
        ts_ckpt_options co = ts_ckpt_options_default();
        co.optim = opt;
        ROK(12, ts_ckpt_save(ck, m, &co));
        ROK(13, ts_ckpt_save_full(full, m, NULL, 0));
        snprintf(ref, sizeof ref, "%s/ref.safetensors", dir);
        save_full_dict(m, ref);
        step(opt); /* the step after: the loaders must reach the same model */
        snprintf(ref, sizeof ref, "%s/ref_next.safetensors", dir);
        save_full_dict(m, ref);
        ts_module_free(m);
    } else {
        ts_module *m = build(2, &opt);
        ts_ckpt_options co = ts_ckpt_options_default();
        co.optim = opt;
        ts_ckpt_info info;
        ROK(14, ts_ckpt_load(ck, m, &co, &info));
        if (info.saved_world != 2 || info.loaded_world != W || info.optim_steps != 1)
            RFAIL(15, "info: saved %d, loaded %d, steps %lld", info.saved_world, info.loaded_world,
                  (long long)info.optim_steps);
        snprintf(out, sizeof out, "%s/loaded%d.safetensors", dir, W);
        save_full_dict(m, out);
        step(opt);
        snprintf(out, sizeof out, "%s/loaded%d_next.safetensors", dir, W);
        save_full_dict(m, out);
        ts_optim *opt2 = NULL;
        ts_module *m2 = build(3, &opt2);
        ROK(16, ts_ckpt_load_full(full, m2, true));
        snprintf(out, sizeof out, "%s/loadfull%d.safetensors", dir, W);
        save_full_dict(m2, out);
        ts_optim_free(opt2);
        ts_module_free(m2);
        ts_module_free(m);
    }
    ts_optim_free(opt);
    ROK(17, ts_dist_finalize());
    fflush(stderr);
    _exit(0);
}

__attribute__((constructor)) static void ckpt_test_role(void)
{
    const char *r = getenv("TS_TEST_CKPT_ROLE");
    if (!r) return;
    if (!strcmp(r, "save") || !strcmp(r, "load")) role(r);
    fprintf(stderr, "unknown TS_TEST_CKPT_ROLE=%s\n", r);
    _exit(6);
}

static void launch(const char *role, int W, const char *dir)
{
    th_clear_launch_env();
    setenv("TS_TEST_CKPT_ROLE", role, 1);
    setenv("TS_TEST_CKPT_DIR", dir, 1);
    ts_launch_result res;
    th_launch_self(W, &res);
    unsetenv("TS_TEST_CKPT_ROLE");
    cr_assert_eq(res.exit_code, 0, "%s on %d ranks: rank %d failed: exit %d signal %d", role, W, res.failed_rank,
                 res.exit_code, res.failed_signal);
}

static void same_file(const char *dir, const char *a, const char *b)
{
    char pa[512], pb[512];
    snprintf(pa, sizeof pa, "%s/%s", dir, a);
    snprintf(pb, sizeof pb, "%s/%s", dir, b);
    size_t na, nb;
    void *x = th_read_file(pa, &na), *y = th_read_file(pb, &nb);
    cr_assert(x && y, "%s or %s missing", a, b);
    cr_assert(na == nb && memcmp(x, y, na) == 0, "%s and %s differ", a, b);
    free(x);
    free(y);
}

Test(checkpoint_dist, saved_on_2_processes_loads_on_3_and_1, .timeout = 240)
{
    char dir[] = "/tmp/ts_ckpt_dist.XXXXXX";
    cr_assert(mkdtemp(dir));
    launch("save", 2, dir);
    /* the streamed full file is the gathered state dict's file */
    same_file(dir, "full.safetensors", "ref.safetensors");
    launch("load", 3, dir);
    launch("load", 1, dir);
    same_file(dir, "ref.safetensors", "loaded3.safetensors");
    same_file(dir, "ref.safetensors", "loaded1.safetensors");
    same_file(dir, "ref.safetensors", "loadfull3.safetensors");
    same_file(dir, "ref.safetensors", "loadfull1.safetensors");
    /* the step after the load: the same gradients on every world, and a
     * sum over ranks does not enter AdamW here (the gradients are set,
     * not reduced), so it is bitwise */
    same_file(dir, "ref_next.safetensors", "loaded3_next.safetensors");
    same_file(dir, "ref_next.safetensors", "loaded1_next.safetensors");
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
}
