/*
 * The fully_shard example programs (examples/unit_wrapped.c,
 * collective_counts.c, uneven.c), run through the launcher as tsrun runs
 * them, with their output checked against the seeds' printouts (seed 000:
 * the shard, summoned shape and gradient shard of layer 0; seed 001: the
 * collective counts of one step and the padding of an uneven shard).
 * The values are the PyTorch printouts' own strings: the RNG and
 * nn.Linear's initialization are bit-exact with PyTorch, and the
 * gradients are sums of a few such numbers printed to ten decimals.
 * examples/custom_module.c (a user-defined module type) runs once alone,
 * without a launcher, and once on 2 ranks: the same losses.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "comm/launch.h"
#include "fully_shard/fully_shard.h"
#include "tests/helpers.h"

#ifndef TS_BUILD_DIR
#error "TS_BUILD_DIR (the build root, where examples/ is) must be defined"
#endif

/* ------------------------------------------------------------ rank side */

/* TS_TEST_FSDP_ROLE=mesh: this binary is a rank program. A mesh made
 * before ts_dist_init (over the one-rank world) does not match the
 * initialized world: fully_shard refuses it, naming both sizes; the
 * world's own mesh is accepted. Exit 0 when all of that holds. */
static void role_mesh(void)
{
    ts_mesh *early = NULL, *good = NULL;
    int64_t one = 1;
    const char *dp[1] = {"dp"};
    if (ts_mesh_new(NULL, "cpu", 1, &one, dp, &early)) _exit(10);
    if (ts_dist_init(NULL)) _exit(11);
    ts_module *lin = NULL;
    if (ts_linear_new(4, 4, false, &lin)) _exit(12);
    ts_fsdp_options o = ts_fsdp_options_default();
    o.mesh = early;
    ts_status st = ts_fully_shard(lin, &o);
    if (st != TS_ERR_INVALID_ARGUMENT || !strstr(ts_last_error(), "initialized world")) {
        fprintf(stderr, "mismatched mesh: %s: %s\n", ts_status_name(st), ts_last_error());
        _exit(13);
    }
    int64_t w = ts_comm_size(ts_dist_world());
    if (ts_mesh_new(NULL, "cpu", 1, &w, dp, &good)) _exit(14);
    o.mesh = good;
    if (ts_fully_shard(lin, &o)) _exit(15);
    ts_module_free(lin);
    ts_mesh_free(good);
    ts_mesh_free(early);
    if (ts_dist_finalize()) _exit(16);
    fprintf(stderr, "mesh-ok\n");
    _exit(0);
}

__attribute__((constructor)) static void fsdp_test_role(void)
{
    const char *role = getenv("TS_TEST_FSDP_ROLE");
    if (!role) return;
    if (strcmp(role, "mesh") == 0) role_mesh();
    fprintf(stderr, "unknown TS_TEST_FSDP_ROLE=%s\n", role);
    _exit(6);
}

/* ------------------------------------------------------------ test side */

static void clear_launch_env(void)
{
    static const char *vars[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                 "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "TS_LAUNCHER_PID", "TS_STORE_HOSTED"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) unsetenv(vars[i]);
}

/* Runs build/examples/PROG on `nproc` ranks; asserts that every rank
 * exited 0 and returns the relayed stdout ("[r] line" lines), malloc'd. */
/* Runs build/examples/PROG with the arguments args[0..nargs) on `nproc`
 * ranks; asserts that every rank exited 0 and returns the relayed stdout
 * ("[r] line" lines), malloc'd. */
static char *run_example_args(const char *prog, int nproc, int nargs, const char *const *args)
{
    clear_launch_env();
    char path[4096];
    snprintf(path, sizeof path, "%s/examples/%s", TS_BUILD_DIR, prog);
    cr_assert_eq(access(path, X_OK), 0, "%s is not built", path);
    ts_launch_options o = ts_launch_options_default();
    o.nproc_per_node = nproc;
    o.forward_signals = false;
    o.out_fd = memfd_create("ts-example-out", MFD_CLOEXEC);
    o.err_fd = memfd_create("ts-example-err", MFD_CLOEXEC);
    cr_assert_geq(o.out_fd, 0);
    cr_assert_geq(o.err_fd, 0);
    char *argv[16] = {path};
    cr_assert_lt(nargs, 15);
    for (int i = 0; i < nargs; i++) argv[i + 1] = (char *)args[i];
    argv[nargs + 1] = NULL;
    ts_launch_result res;
    TH_OK(ts_launch(&o, argv, &res));
    char *out = th_slurp_fd(o.out_fd), *err = th_slurp_fd(o.err_fd);
    close(o.out_fd);
    close(o.err_fd);
    cr_assert_eq(res.exit_code, 0, "%s: rank %d failed: exit %d signal %d\nstdout:\n%s\nstderr:\n%s", prog,
                 res.failed_rank, res.exit_code, res.failed_signal, out, err);
    free(err);
    return out;
}

static char *run_example(const char *prog, int nproc) { return run_example_args(prog, nproc, 0, NULL); }

/* The lines rank r wrote, without their "[r] " prefix, in order, each
 * followed by '\n', after a leading '\n' (so that "\nLINE\n" finds a whole
 * line). malloc'd. */
static char *rank_lines(const char *out, int r)
{
    char prefix[32];
    int np = snprintf(prefix, sizeof prefix, "[%d] ", r);
    char *text = malloc(strlen(out) + 2);
    cr_assert(text);
    size_t n = 0;
    text[n++] = '\n';
    for (const char *line = out; *line;) {
        const char *end = strchr(line, '\n');
        size_t len = end ? (size_t)(end - line) : strlen(line);
        if (len >= (size_t)np && strncmp(line, prefix, (size_t)np) == 0) {
            memcpy(text + n, line + np, len - (size_t)np);
            n += len - (size_t)np;
            text[n++] = '\n';
        }
        line += len + (end ? 1 : 0);
    }
    text[n] = '\0';
    return text;
}

/* Asserts that rank r wrote the lines of `want` ('\n'-separated, in
 * order, with nothing of its own between them). */
static void expect_lines(const char *out, int r, const char *want)
{
    char *text = rank_lines(out, r);
    size_t wl = strlen(want);
    char *needle = malloc(wl + 3);
    cr_assert(needle);
    snprintf(needle, wl + 3, "\n%s\n", want);
    cr_expect_not_null(strstr(text, needle), "rank %d did not print\n%s\nwhole output:\n%s", r, want, out);
    free(needle);
    free(text);
}

Test(fully_shard_examples, unit_wrapped, .timeout = 90)
{
    char *out = run_example("unit_wrapped", 2);
    /* Seed 000's printout, line for line. */
    expect_lines(out, 0,
                 "rank 0: shard of layer0 [-0.0037434101, 0.2682217956, -0.4115225673, -0.3679695129,\n"
                 "                        -0.1925771832, 0.1340786815, -0.0099065900, 0.3964447379]\n"
                 "layer0 full, row 0 and 1: [-0.0037434101, 0.2682217956, -0.4115225673, -0.3679695129]\n"
                 "                          [-0.1925771832, 0.1340786815, -0.0099065900, 0.3964447379]");
    expect_lines(out, 0, "rank 0: summoned layer0 shape (4, 4)");
    expect_lines(out, 1, "rank 1: summoned layer0 shape (4, 4)");
    expect_lines(out, 0,
                 "rank 0: grad shard of layer0 [0.0, 0.0, 0.0, 0.0, 1.2830595970, 1.2830595970, 1.2830595970, "
                 "1.2830595970]");
    expect_lines(out, 1, "rank 1: grad shard of layer0 [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]");
    /* Rank 1's shard (rows 2 and 3) is printed in the same layout. */
    char *r1 = rank_lines(out, 1);
    cr_expect_not_null(strstr(r1, "\nrank 1: shard of layer0 ["), "%s", out);
    free(r1);
    free(out);
}

Test(fully_shard_examples, collective_counts, .timeout = 90)
{
    char *out = run_example("collective_counts", 2);
    for (int r = 0; r < 2; r++) {
        /* FULL_SHARD: one all-gather per block in forward, one more per
         * block in backward, one reduce-scatter per block. */
        expect_lines(out, r,
                     "reshard_after_forward=True\n"
                     "after forward : {\"all_gather_into_tensor\": 3}\n"
                     "after backward: {\"all_gather_into_tensor\": 6, \"reduce_scatter_tensor\": 3}\n"
                     "fsdp units    : 4");
        /* SHARD_GRAD_OP: the backward gathers nothing. */
        expect_lines(out, r,
                     "reshard_after_forward=False\n"
                     "after forward : {\"all_gather_into_tensor\": 3}\n"
                     "after backward: {\"all_gather_into_tensor\": 3, \"reduce_scatter_tensor\": 3}\n"
                     "fsdp units    : 4");
    }
    free(out);
}

Test(fully_shard_examples, uneven, .timeout = 90)
{
    char *out = run_example("uneven", 4);
    for (int r = 0; r < 4; r++) {
        /* torch.chunk rows 1, 1, 1, 0; buffers padded to one row each. */
        const char *rows = r < 3 ? "(1, 3)" : "(0, 3)";
        char want[512];
        snprintf(want, sizeof want,
                 "rank %d | 9 params over world 4: shard %s\n"
                 "rank %d | padded communication size 4 x 3 = 12, 3 of them padding\n"
                 "rank %d | grad shard %s after forward and backward",
                 r, rows, r, r, rows);
        expect_lines(out, r, want);
    }
    free(out);
}

/* A mesh that does not match the initialized world is refused (on real
 * ranks: the check needs ts_dist_init). */
Test(fully_shard_examples, mesh_not_matching_the_world, .timeout = 90)
{
    clear_launch_env();
    setenv("TS_TEST_FSDP_ROLE", "mesh", 1);
    static char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    cr_assert_gt(n, 0);
    self[n] = '\0';
    ts_launch_options o = ts_launch_options_default();
    o.nproc_per_node = 2;
    o.forward_signals = false;
    char *argv[] = {self, NULL};
    ts_launch_result res;
    TH_OK(ts_launch(&o, argv, &res));
    unsetenv("TS_TEST_FSDP_ROLE");
    cr_assert_eq(res.exit_code, 0, "rank %d exited %d", res.failed_rank, res.exit_code);
}

/* The main job's program on 2 ranks: the loss falls; a full checkpoint
 * saved on rank 0 and loaded back by both ranks resumes where it ended
 * (the resumed first loss is within 10% of the saved run's last). */
Test(fully_shard_examples, train_gpt_checkpoint_round_trip, .timeout = 120)
{
    char path[128];
    snprintf(path, sizeof path, "/tmp/ts-test-gpt-%d.safetensors", (int)getpid());
    const char *a1[] = {"--steps", "60", "--save", path};
    char *out = run_example_args("train_gpt", 2, 4, a1);
    double first = 0, last = 0;
    const char *l = strstr(out, "[0] loss ");
    cr_assert(l && sscanf(l, "[0] loss %lf -> %lf", &first, &last) == 2, "no loss line:\n%s", out);
    cr_assert_lt(last, first * 0.6, "the loss did not fall: %g -> %g", first, last);
    cr_assert(strstr(out, "saved 29 full tensors"), "%s", out);
    free(out);
    const char *a2[] = {"--steps", "3", "--load", path, "--lr", "1e-5"};
    out = run_example_args("train_gpt", 2, 6, a2);
    double rfirst = 0, rlast = 0;
    l = strstr(out, "[0] loss ");
    cr_assert(l && sscanf(l, "[0] loss %lf -> %lf", &rfirst, &rlast) == 2, "no loss line:\n%s", out);
    cr_assert_lt(fabs(rfirst - last), 0.1 * last, "resumed at %g, the saved run ended at %g", rfirst, last);
    free(out);
    unlink(path);
}

/* Runs build/examples/PROG alone (no launcher: one rank); asserts exit 0
 * and returns its stdout, malloc'd. */
static char *run_alone(const char *prog)
{
    clear_launch_env();
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "%s/examples/%s", TS_BUILD_DIR, prog);
    cr_assert_eq(access(cmd, X_OK), 0, "%s is not built", cmd);
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p, "popen %s", cmd);
    size_t cap = 1 << 16, n = 0;
    char *out = malloc(cap);
    cr_assert(out);
    for (size_t got; (got = fread(out + n, 1, cap - n - 1, p)) > 0;) {
        n += got;
        if (n + 1 == cap) {
            cap *= 2;
            out = realloc(out, cap);
            cr_assert(out);
        }
    }
    out[n] = '\0';
    int status = pclose(p);
    cr_assert_eq(status, 0, "%s alone: status %d\n%s", prog, status, out);
    return out;
}

/* The last "step N loss X" line of `text` (rank prefixes skipped). */
static double last_loss(const char *text, int *steps_out)
{
    double loss = NAN;
    int steps = 0;
    for (const char *l = strstr(text, "step "); l; l = strstr(l + 1, "step ")) {
        int s;
        double v;
        if (sscanf(l, "step %d loss %lf", &s, &v) == 2) {
            loss = v;
            steps++;
        }
    }
    *steps_out = steps;
    return loss;
}

/* examples/custom_module.c: a user-defined module type, sharded bottom-up,
 * trains alone and on 2 ranks to the same losses (gradients are averaged
 * over the ranks, each rank holding half the batch). */
Test(fully_shard_examples, custom_module_alone_and_on_two_ranks, .timeout = 120)
{
    char *alone = run_alone("custom_module");
    int steps1 = 0, steps2 = 0;
    double l1 = last_loss(alone, &steps1);
    cr_assert_eq(steps1, 20, "%s", alone);
    cr_expect_not_null(strstr(alone, "(1): ResidualBlockFSDPModule(\n"), "%s", alone);
    cr_expect_not_null(strstr(alone, "gain (16,) [shard], buffer num_batches_tracked int64 ()"), "%s", alone);
    cr_expect_not_null(strstr(alone, "group '1' (ResidualBlockFSDPModule): 3 params, 288 elements"), "%s", alone);
    cr_expect_not_null(strstr(alone, "rank 0: 2.num_batches_tracked = 20\n"), "%s", alone);
    double first = 0;
    cr_assert_eq(sscanf(strstr(alone, "step  0 loss "), "step  0 loss %lf", &first), 1);
    cr_expect_lt(l1, 0.2 * first, "the loss did not fall: %g -> %g", first, l1);

    char *two = run_example("custom_module", 2);
    double l2 = last_loss(two, &steps2);
    cr_assert_eq(steps2, 20, "only rank 0 prints the losses:\n%s", two);
    /* The same computation up to the order of float32 sums (the ranks'
     * halves, then the average): 1e-4 covers 20 AdamW steps of it (it
     * was 1e-8 when measured), a different trajectory is off by 1e-2. */
    cr_expect_lt(fabs(l1 - l2), 1e-4, "alone %.8f, on 2 ranks %.8f", l1, l2);
    expect_lines(two, 0, "rank 0: 1.gain holds (8,) of (16,)");
    expect_lines(two, 1, "rank 1: 1.gain holds (8,) of (16,)");
    expect_lines(two, 1, "rank 1: 2.num_batches_tracked = 20");
    cr_expect_not_null(strstr(two, "[0] group '1' (ResidualBlockFSDPModule): 3 params, 288 elements, float32, "
                                   "mesh (dp=2)"), "%s", two);
    free(two);
    free(alone);
}
