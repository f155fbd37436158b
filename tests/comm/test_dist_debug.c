/*
 * TS_DISTRIBUTED_DEBUG (OFF, INFO, DETAIL in any case; an unknown value is
 * a warning that names it) and the info-level line of ts_dist_init on
 * every rank. Two real ranks through ts_launch; this binary is also the
 * rank program (TS_TEST_DEBUG_ROLE, run by a constructor before Criterion
 * starts): it all-reduces twice, makes and frees a subgroup, finalizes.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "comm/comm.h"
#include "comm/comm_internal.h"
#include "comm/launch.h"
#include "tests/helpers.h"

/* ------------------------------------------------------------ rank side */

static void rank_main(void)
{
    ts_comm *virt; /* a memory estimate's world (train_gpt estimates before it starts): not the run's, no summary */
    TH_RANK_OK(9, ts__virtual_world_new(2, &virt));
    ts__world_free(virt);
    TH_RANK_OK(10, ts_dist_init(NULL));
    ts_comm *w = ts_dist_world();
    int64_t n = 4;
    ts_tensor *t;
    TH_RANK_OK(11, ts_tensor_full(TS_F32, 1, &n, 1.0, &t));
    TH_RANK_OK(12, ts_all_reduce(w, t, TS_REDUCE_SUM, NULL));
    TH_RANK_OK(12, ts_all_reduce(w, t, TS_REDUCE_SUM, NULL));
    int both[2] = {0, 1};
    ts_comm *g;
    TH_RANK_OK(13, ts_comm_new_group(w, 2, both, &g));
    TH_RANK_OK(14, ts_broadcast(g, t, 0, NULL));
    ts_comm_free(g);
    ts_tensor_free(t);
    TH_RANK_OK(15, ts_dist_finalize());
    fflush(stderr);
    _exit(0);
}

__attribute__((constructor)) static void debug_role(void)
{
    if (getenv("TS_TEST_DEBUG_ROLE")) rank_main();
}

/* ------------------------------------------------------------ test side */

/* Runs this binary as 2 ranks with TS_DISTRIBUTED_DEBUG=value (NULL:
 * unset) and TS_LOG_LEVEL=info; returns what they wrote on stderr
 * ("[r] line"), malloc'd. */
static char *run_ranks(const char *value)
{
    static const char *vars[] = {
        "RANK",        "WORLD_SIZE",           "LOCAL_RANK",   "LOCAL_WORLD_SIZE", "MASTER_ADDR",
        "MASTER_PORT", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "TS_LAUNCHER_PID",  "TS_STORE_HOSTED"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) unsetenv(vars[i]);
    if (value) setenv("TS_DISTRIBUTED_DEBUG", value, 1);
    else unsetenv("TS_DISTRIBUTED_DEBUG");
    setenv("TS_LOG_LEVEL", "info", 1); /* the ranks' */
    ts_log_set_level(TS_LOG_ERROR);    /* this process's own */
    setenv("TS_TEST_DEBUG_ROLE", "1", 1);
    ts_launch_options o = ts_launch_options_default();
    o.nproc_per_node = 2;
    o.forward_signals = false;
    o.out_fd = memfd_create("ts-debug-out", MFD_CLOEXEC);
    o.err_fd = memfd_create("ts-debug-err", MFD_CLOEXEC);
    cr_assert_geq(o.out_fd, 0);
    cr_assert_geq(o.err_fd, 0);
    char *argv[] = {th_self_exe(), NULL};
    ts_launch_result res;
    TH_OK(ts_launch(&o, argv, &res));
    unsetenv("TS_TEST_DEBUG_ROLE");
    char *out = th_slurp_fd(o.out_fd), *err = th_slurp_fd(o.err_fd);
    close(o.out_fd);
    close(o.err_fd);
    cr_assert_eq(res.exit_code, 0, "rank %d failed: exit %d\nstdout:\n%s\nstderr:\n%s", res.failed_rank, res.exit_code,
                 out, err);
    free(out);
    return err;
}

/* Lines of `text` that contain every one of the n strings. */
static int lines_with(const char *text, int n, const char *const *parts)
{
    int count = 0;
    for (const char *p = text; *p;) {
        const char *e = strchr(p, '\n');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        char *line = strndup(p, len);
        bool all = true;
        for (int i = 0; i < n && all; i++) all = strstr(line, parts[i]) != NULL;
        count += all;
        free(line);
        p += len + (e ? 1 : 0);
    }
    return count;
}

/* One line per rank: rank, world, local rank, transport, store address. */
Test(comm_dist_debug, dist_init_logs_one_line_per_rank, .timeout = 120)
{
    char *err = run_ranks(NULL);
    for (int r = 0; r < 2; r++) {
        char prefix[64], who[96];
        snprintf(prefix, sizeof prefix, "[%d] [ts INFO] ts_dist_init:", r);
        snprintf(who, sizeof who, "rank %d of 2, local rank %d of 2, transport ucx, store 127.0.0.1:", r, r);
        const char *parts[] = {prefix, who};
        cr_assert_eq(lines_with(err, 2, parts), 1, "rank %d's ts_dist_init line:\n%s", r, err);
    }
    const char *summary[] = {"summary:"};
    cr_assert_eq(lines_with(err, 1, summary), 0, "no summary without TS_DISTRIBUTED_DEBUG:\n%s", err);
    free(err);
}

/* INFO: a summary per group and rank when the group is freed (the world at
 * ts_dist_finalize), no line per collective. */
Test(comm_dist_debug, info_prints_a_summary_per_group, .timeout = 120)
{
    char *err = run_ranks("info");
    for (int r = 0; r < 2; r++) {
        char world[96], sub[96];
        snprintf(world, sizeof world, "[%d] [ts comm] group 0 rank %d/2 summary:", r, r);
        /* two all-reduces, the group's agreement all-reduce, the finalize barrier */
        const char *wparts[] = {world, "all_reduce 3 (", "barrier 1 (0 bytes)"};
        cr_assert_eq(lines_with(err, 3, wparts), 1, "rank %d's world summary:\n%s", r, err);
        snprintf(sub, sizeof sub, "[%d] [ts comm] group 1 rank %d/2 summary: broadcast 1 (16 bytes)", r, r);
        const char *sparts[] = {sub};
        cr_assert_eq(lines_with(err, 1, sparts), 1, "rank %d's subgroup summary:\n%s", r, err);
    }
    const char *detail[] = {"[ts comm] group 0", " #"};
    cr_assert_eq(lines_with(err, 2, detail), 0, "INFO prints no line per collective:\n%s", err);
    const char *none[] = {"summary: no collectives"};
    cr_assert_eq(lines_with(err, 1, none), 0, "a virtual world's summary printed:\n%s", err);
    free(err);
}

/* DETAIL (any case): one line per collective, and the summary. */
Test(comm_dist_debug, detail_in_any_case, .timeout = 120)
{
    char *err = run_ranks("dEtAiL");
    for (int r = 0; r < 2; r++) {
        char pre[96];
        snprintf(pre, sizeof pre, "[%d] [ts comm] group 0 rank %d/2 #", r, r);
        const char *parts[] = {pre, "all_reduce 16 bytes: TS_OK in"};
        cr_assert_eq(lines_with(err, 2, parts), 2, "rank %d's all-reduce lines:\n%s", r, err);
        char sum[96];
        snprintf(sum, sizeof sum, "[%d] [ts comm] group 0 rank %d/2 summary:", r, r);
        const char *summary[] = {sum};
        cr_assert_eq(lines_with(err, 1, summary), 1, "rank %d's summary:\n%s", r, err);
    }
    free(err);
}

/* OFF (any case) prints nothing; an unknown value is a warning naming it,
 * and then OFF. */
Test(comm_dist_debug, off_and_unknown_values, .timeout = 120)
{
    char *err = run_ranks("Off");
    const char *any[] = {"[ts comm]"};
    cr_assert_eq(lines_with(err, 1, any), 0, "OFF prints nothing:\n%s", err);
    cr_assert_eq(strstr(err, "TS_DISTRIBUTED_DEBUG"), NULL, "OFF is a known value:\n%s", err);
    free(err);
    err = run_ranks("verbose");
    cr_assert_eq(lines_with(err, 1, any), 0, "an unknown value means OFF:\n%s", err);
    for (int r = 0; r < 2; r++) {
        char pre[32];
        snprintf(pre, sizeof pre, "[%d] [ts WARN]", r);
        const char *parts[] = {pre, "TS_DISTRIBUTED_DEBUG=verbose is not one of OFF, INFO, DETAIL"};
        cr_assert_eq(lines_with(err, 2, parts), 1, "rank %d's warning:\n%s", r, err);
    }
    free(err);
}
