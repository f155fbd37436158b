/*
 * TS_DISTRIBUTED_DEBUG=INFO for fully_shard: per FSDP group, the
 * all-gathers, reduce-scatters (and HSDP all-reduces) it issued, their
 * bytes and the time waited for them, printed per rank on stderr when the
 * root module is freed, and by ts_fsdp_print_stats on demand. Two real
 * ranks through ts_launch; this binary is also the rank program
 * (TS_TEST_FSDP_DEBUG_ROLE, run by a constructor before Criterion starts).
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "comm/launch.h"
#include "tests/helpers.h"

enum { STEPS = 3 };

/* ------------------------------------------------------------ rank side */

/* Sequential(Linear(7, 5), Linear(5, 3)): the first Linear its own group,
 * the root the second; both reshard after forward (so each group is
 * all-gathered in forward and again in backward). STEPS forwards and
 * backwards of a (4, 7) batch; then ts_fsdp_print_stats on stdout, then
 * the root is freed (with INFO: the same lines on stderr). */
static void rank_main(void)
{
    TH_RANK_OK(10, ts_dist_init(NULL));
    ts_manual_seed(1);
    ts_module *lin[2], *root;
    TH_RANK_OK(11, ts_linear_new(7, 5, true, &lin[0]));
    TH_RANK_OK(11, ts_linear_new(5, 3, true, &lin[1]));
    TH_RANK_OK(12, ts_sequential_new(2, lin, &root));
    ts_fsdp_options o = ts_fsdp_options_default();
    o.reshard_after_forward = TS_RESHARD_TRUE;
    TH_RANK_OK(13, ts_fully_shard(lin[0], &o));
    TH_RANK_OK(13, ts_fully_shard(root, &o));
    int64_t xs[2] = {4, 7};
    ts_tensor *x;
    TH_RANK_OK(14, ts_tensor_full(TS_F32, 2, xs, 0.5, &x));
    for (int s = 0; s < STEPS; s++) {
        ts_tensor *y, *l;
        TH_RANK_OK(15, ts_module_call1(root, x, &y));
        TH_RANK_OK(16, ts_sum(y, 0, NULL, false, &l));
        TH_RANK_OK(17, ts_backward(l, NULL, false));
        ts_tensor_free(l);
        ts_tensor_free(y);
    }
    ts_tensor_free(x);
    TH_RANK_OK(18, ts_fsdp_print_stats(root, stdout));
    fflush(stdout);
    ts_module_free(root);
    TH_RANK_OK(19, ts_dist_finalize());
    fflush(stderr);
    _exit(0);
}

__attribute__((constructor)) static void fsdp_debug_role(void)
{
    if (getenv("TS_TEST_FSDP_DEBUG_ROLE")) rank_main();
}

/* ------------------------------------------------------------ test side */

/* Runs this binary as 2 ranks with TS_DISTRIBUTED_DEBUG=value (NULL:
 * unset); their stdout in *out and stderr in *err ("[r] line"),
 * malloc'd. */
static void run_ranks(const char *value, char **out, char **err)
{
    th_clear_launch_env();
    if (value) setenv("TS_DISTRIBUTED_DEBUG", value, 1);
    else unsetenv("TS_DISTRIBUTED_DEBUG");
    setenv("TS_TEST_FSDP_DEBUG_ROLE", "1", 1);
    setenv("TS_LOG_LEVEL", "warn", 1); /* the ranks' (the warning); this process's own is read already */
    ts_launch_result res;
    th_launch_capture(th_self_exe(), 2, NULL, &res, out, err);
    unsetenv("TS_TEST_FSDP_DEBUG_ROLE");
    unsetenv("TS_DISTRIBUTED_DEBUG");
    cr_assert_eq(res.exit_code, 0, "rank %d failed: exit %d\nstdout:\n%s\nstderr:\n%s", res.failed_rank, res.exit_code,
                 *out, *err);
}

/* The figures of rank r's line for `group` in text: all-gathers and
 * reduce-scatters, their bytes and waits (ms). Fails unless there is
 * exactly one such line. */
typedef struct figures {
    unsigned long long ag, ag_bytes, rs, rs_bytes;
    double ag_ms, rs_ms;
} figures;

static figures group_line(const char *text, int r, const char *group)
{
    char head[160];
    snprintf(head, sizeof head, "[%d] [ts fsdp] rank %d/2 %s", r, r, group);
    const char *l = strstr(text, head);
    cr_assert_not_null(l, "no line '%s':\n%s", head, text);
    cr_assert_null(strstr(l + 1, head), "two lines '%s':\n%s", head, text);
    const char *f = strstr(l, "all_gather ");
    const char *eol = strchr(l, '\n');
    cr_assert(f && (!eol || f < eol), "no all_gather figures in '%s':\n%s", head, text);
    figures x;
    int n = sscanf(f, "all_gather %llu (%llu bytes, wait %lf ms), reduce_scatter %llu (%llu bytes, wait %lf ms)", &x.ag,
                   &x.ag_bytes, &x.ag_ms, &x.rs, &x.rs_bytes, &x.rs_ms);
    cr_assert_eq(n, 6, "unreadable figures: %.*s", (int)(eol ? eol - l : (long)strlen(l)), l);
    return x;
}

/* INFO: each rank prints, when the root is freed, one line per group:
 * each group all-gathered twice per step (forward and backward: reshard
 * after forward) and reduce-scattered once, each collective the padded
 * group's bytes; and a total. ts_fsdp_print_stats printed the same
 * figures on stdout. */
Test(fully_shard_debug, info_prints_each_groups_collectives_at_the_roots_free, .timeout = 120)
{
    char *out, *err;
    run_ranks("INFO", &out, &err);
    /* Padded sizes on 2 ranks (rows split in chunks of ceil(rows / 2)):
     * '0' = Linear(7, 5): weight (5, 7) -> 3 rows of 7 per rank, bias (5)
     * -> 3: 24 elements per rank, 48 over both (40 real), float32: 192
     * bytes; the root's Linear(5, 3): weight (3, 5) -> 2 rows of 5, bias
     * (3) -> 2: 12 per rank, 24 over both (18 real): 96 bytes. */
    const struct {
        const char *name;
        unsigned long long bytes;
    } groups[2] = {{"group '0' (2 parameters, 40 elements, mesh (dp=2)): ", 192},
                   {"group '(root)' (2 parameters, 18 elements, mesh (dp=2)): ", 96}};
    for (int r = 0; r < 2; r++) {
        unsigned long long ag = 0, rs = 0, agb = 0, rsb = 0;
        for (int g = 0; g < 2; g++) {
            figures e = group_line(err, r, groups[g].name), o = group_line(out, r, groups[g].name);
            cr_expect_eq(e.ag, 2 * STEPS, "rank %d %s: %llu all-gathers", r, groups[g].name, e.ag);
            cr_expect_eq(e.rs, STEPS, "rank %d %s: %llu reduce-scatters", r, groups[g].name, e.rs);
            cr_expect_eq(e.ag_bytes, 2 * STEPS * groups[g].bytes, "rank %d %s", r, groups[g].name);
            cr_expect_eq(e.rs_bytes, STEPS * groups[g].bytes, "rank %d %s", r, groups[g].name);
            cr_expect(e.ag_ms >= 0 && e.rs_ms >= 0, "waits %g %g ms", e.ag_ms, e.rs_ms);
            /* stdout's call came before the free, with nothing in between */
            cr_expect(o.ag == e.ag && o.rs == e.rs && o.ag_bytes == e.ag_bytes && o.rs_bytes == e.rs_bytes,
                      "rank %d: ts_fsdp_print_stats and the free disagree:\n%s\n%s", r, out, err);
            ag += e.ag, rs += e.rs, agb += e.ag_bytes, rsb += e.rs_bytes;
        }
        figures t = group_line(err, r, "total over 2 groups: ");
        cr_expect(t.ag == ag && t.rs == rs && t.ag_bytes == agb && t.rs_bytes == rsb, "rank %d's total:\n%s", r, err);
        cr_expect_eq(t.ag, 2 * STEPS * 2, "steps x forward and backward x groups");
    }
    free(out);
    free(err);
}

/* Unset (and OFF): nothing on stderr; stdout still has the explicit call's
 * lines (ts_fsdp_print_stats does not depend on the variable). An unknown
 * value is one warning line per rank naming it and the accepted values. */
Test(fully_shard_debug, off_prints_nothing_and_an_unknown_value_is_named, .timeout = 120)
{
    char *out, *err;
    run_ranks(NULL, &out, &err);
    cr_expect_null(strstr(err, "[ts fsdp]"), "nothing without TS_DISTRIBUTED_DEBUG:\n%s", err);
    cr_expect_not_null(strstr(out, "[0] [ts fsdp] rank 0/2 total over 2 groups: all_gather 12"), "%s", out);
    free(out);
    free(err);
    run_ranks("loud", &out, &err);
    cr_expect_null(strstr(err, "[ts fsdp]"), "an unknown value means OFF:\n%s", err);
    for (int r = 0; r < 2; r++) {
        char want[160];
        snprintf(want, sizeof want, "[%d] [ts WARN] TS_DISTRIBUTED_DEBUG=loud is not one of OFF, INFO, DETAIL", r);
        cr_expect_not_null(strstr(err, want), "no warning on rank %d:\n%s", r, err);
    }
    free(out);
    free(err);
}

/* Bad arguments are refused, naming them. */
Test(fully_shard_debug, print_stats_refuses_null)
{
    ts_module *lin;
    TH_OK(ts_linear_new(2, 2, false, &lin));
    cr_assert_eq(ts_fsdp_print_stats(NULL, stdout), TS_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(ts_last_error(), "module"), "%s", ts_last_error());
    cr_assert_eq(ts_fsdp_print_stats(lin, NULL), TS_ERR_INVALID_ARGUMENT);
    ts_module_free(lin);
}
