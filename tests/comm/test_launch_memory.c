/*
 * tsrun --memory-per-rank (ts_launch_options.memory_per_rank): each rank in
 * a memory cgroup of its own with the cap, TS_MEMORY_PER_RANK in its
 * environment, the groups removed afterwards; a rank over the cap is
 * OOM-killed and reported as such by tsrun and ts_launch_result, and the
 * other rank, blocked in a collective, fails naming it; bad sizes and
 * unwritable cgroups are clear errors. This binary is its own rank program
 * (TS_TEST_MEM_ROLE, run by a constructor before Criterion starts). The
 * cases that need a writable memory cgroup skip, saying why, where there
 * is none.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "comm/comm_internal.h"
#include "comm/launch.h"
#include "comm/launch_internal.h"
#include "tests/helpers.h"

#ifndef TS_BUILD_DIR
#error "TS_BUILD_DIR must name the build root (tests/meson.build defines it)"
#endif
#define TSRUN TS_BUILD_DIR "/tools/tsrun"
#define CAP (64ll << 20)

/* ------------------------------------------------------------ rank side */

/* "hog": every rank meets the others and all-reduces; rank 1 then
 * allocates and touches 4 x CAP (it should never finish: exit 13), while
 * rank 0 blocks in the next all-reduce and prints "mem-test 0: <status>:
 * <error>" when it fails (exit 5).
 * "wait": prints "ready" and waits to be killed.
 * "fit": prints "env <TS_MEMORY_PER_RANK>", "cgroup <its memory cgroup
 * path>" and "limit <its group's limit>", touches CAP / 4 and exits 0. */
__attribute__((constructor)) static void mem_test_role(void)
{
    const char *role = getenv("TS_TEST_MEM_ROLE");
    if (!role) return;
    if (strcmp(role, "wait") == 0) { /* until killed */
        printf("ready\n");
        fflush(stdout);
        for (;;) pause();
    }
    if (strcmp(role, "fit") == 0) {
        const char *env = getenv(TS_MEMORY_PER_RANK_ENV);
        printf("env %s\n", env ? env : "(unset)");
        /* v1's memory line, else v2's "0::" */
        char line[4096], v1[4096] = "", v2[4096] = "";
        FILE *f = fopen("/proc/self/cgroup", "re");
        while (f && fgets(line, sizeof line, f)) {
            line[strcspn(line, "\n")] = '\0';
            char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
            if (c2 && strstr(c1, ":memory:") == c1) snprintf(v1, sizeof v1, "%s", c2 + 1);
            else if (c2 && c1 == line + 1 && line[0] == '0' && c2 == c1 + 1) snprintf(v2, sizeof v2, "%s", c2 + 1);
        }
        if (f) fclose(f);
        printf("cgroup %s\n", v1[0] ? v1 : v2);
        ts_rank_env e;
        if (ts_launch_env(&e) != TS_OK) _exit(10);
        printf("parsed %lld\n", (long long)e.memory_per_rank);
        size_t n = (size_t)(CAP / 4);
        char *p = malloc(n);
        if (!p) _exit(11);
        memset(p, 1, n);
        free(p);
        fflush(stdout);
        _exit(0);
    }
    ts_dist_options o = ts_dist_options_default();
    o.timeout_s = 60;
    ts_status s = ts_dist_init(&o);
    if (s != TS_OK) {
        fprintf(stderr, "init %s: %s\n", ts_status_name(s), ts_last_error());
        _exit(10);
    }
    ts_comm *c = ts_dist_world();
    int rank = ts_comm_rank(c);
    int64_t n = 64;
    ts_tensor *t = NULL;
    if (ts_tensor_zeros(TS_F32, 1, &n, &t) != TS_OK) _exit(11);
    if (ts_all_reduce(c, t, TS_REDUCE_SUM, NULL) != TS_OK) _exit(12);
    if (rank == 1) {
        for (long long used = 0; used < 4 * CAP; used += 1 << 20) {
            char *p = malloc(1 << 20);
            if (!p) _exit(14);
            memset(p, 1, 1 << 20);
        }
        _exit(13); /* the cap did not hold */
    }
    for (;;) {
        s = ts_all_reduce(c, t, TS_REDUCE_SUM, NULL);
        if (s == TS_OK) continue;
        fprintf(stderr, "mem-test %d: %s: %s\n", rank, ts_status_name(s), ts_last_error());
        fflush(stderr);
        (void)ts_dist_finalize();
        _exit(5);
    }
}

/* ------------------------------------------------------------ test side */

extern char **environ;

/* This process's memory cgroup directory, where tsrun (a child) makes
 * tensorshard-<its pid>; set by need_cgroups. */
static char g_own[PATH_MAX];

/* Skips the test, saying why, where no memory cgroup can be written. */
static void need_cgroups(void)
{
    ts__cgroup_job j;
    ts_status s = ts__cgroup_job_init(&j, CAP);
    if (s != TS_OK) cr_skip_test("no writable memory cgroup here: %s", ts_last_error());
    snprintf(g_own, sizeof g_own, "%s", j.own);
    char dir[PATH_MAX + 32];
    s = ts__cgroup_rank_create(&j, 0, dir, sizeof dir);
    if (s == TS_OK) ts__cgroup_remove(dir);
    ts__cgroup_job_remove(&j);
    if (s != TS_OK) cr_skip_test("memory cgroups cannot be limited here: %s", ts_last_error());
}

/* Runs tsrun with args (NULL-terminated, after "tsrun") and this binary
 * as the program, role `role`; returns its output (stdout and stderr,
 * malloc'd), its wait status and its pid. */
static char *run_tsrun(const char *const *args, const char *role, int *status, pid_t *pid_out)
{
    th_clear_launch_env();
    unsetenv("TS_DIST_TIMEOUT");
    unsetenv(TS_MEMORY_PER_RANK_ENV);
    if (role) setenv("TS_TEST_MEM_ROLE", role, 1);
    char log[256];
    const char *tmp = getenv("TMPDIR");
    static int seq;
    snprintf(log, sizeof log, "%s/memcap-%d-%d.log", tmp && *tmp ? tmp : "/tmp", (int)getpid(), seq++);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    const char *argv[32] = {TSRUN};
    int k = 1;
    for (; args[k - 1]; k++) argv[k] = args[k - 1];
    if (role) argv[k++] = th_self_exe();
    argv[k] = NULL;
    pid_t pid;
    cr_assert_eq(posix_spawn(&pid, argv[0], &fa, NULL, (char **)argv, environ), 0);
    posix_spawn_file_actions_destroy(&fa);
    unsetenv("TS_TEST_MEM_ROLE");
    th_wait_pids(&pid, 1, -1, 90, status);
    size_t len = 0;
    char *out = th_read_file(log, &len);
    unlink(log);
    if (pid_out) *pid_out = pid;
    return out;
}

/* tsrun's job directory (need_cgroups first) */
static void job_dir(pid_t tsrun, char *out, size_t cap) { snprintf(out, cap, "%s/tensorshard-%d", g_own, (int)tsrun); }

static bool exists(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0;
}

Test(comm_launch_memory, a_rank_over_the_cap_is_reported_as_oom_and_the_other_fails_naming_it, .timeout = 180)
{
    need_cgroups();
    static const char *const args[] = {"--nproc-per-node", "2", "--memory-per-rank", "64M", NULL};
    int status = 0;
    pid_t pid;
    char *out = run_tsrun(args, "hog", &status, &pid);
    cr_log_info("%s", out);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 128 + SIGKILL, "tsrun status 0x%x:\n%s", status, out);
    const char *want = "tsrun: rank 1 exceeded --memory-per-rank 64 MiB (killed by the kernel's OOM killer; peak ";
    cr_assert(strstr(out, want), "tsrun does not report the OOM as such:\n%s", out);
    /* the survivor, blocked in an all-reduce, names it, through the store */
    const char *line = strstr(out, "[0] mem-test 0: ");
    cr_assert_not_null(line, "rank 0 printed no failure:\n%s", out);
    const char *eol = strchr(line, '\n');
    char buf[1024];
    snprintf(buf, sizeof buf, "%.*s", (int)(eol ? eol - line : (long)strlen(line)), line);
    cr_assert(strstr(buf, "TS_ERR_PEER_FAILED") && strstr(buf, "rank 1 exceeded --memory-per-rank 64 MiB"),
              "rank 0's failure does not name the OOM: %s", buf);
    char dir[PATH_MAX + 64];
    job_dir(pid, dir, sizeof dir);
    cr_assert(!exists(dir), "tsrun left %s behind", dir);
    free(out);
}

Test(comm_launch_memory, ts_launch_result_names_the_oom_rank_and_its_peak, .timeout = 180)
{
    need_cgroups();
    th_clear_launch_env();
    unsetenv(TS_MEMORY_PER_RANK_ENV);
    setenv("TS_TEST_MEM_ROLE", "hog", 1);
    char log[256];
    const char *tmp = getenv("TMPDIR");
    snprintf(log, sizeof log, "%s/memcap-api-%d.log", tmp && *tmp ? tmp : "/tmp", (int)getpid());
    int fd = open(log, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    cr_assert(fd >= 0);
    ts_launch_options o = ts_launch_options_default();
    o.nproc_per_node = 2;
    o.memory_per_rank = CAP;
    o.forward_signals = false;
    o.out_fd = o.err_fd = fd;
    char *argv[] = {th_self_exe(), NULL};
    ts_launch_result res;
    ts_status s = ts_launch(&o, argv, &res);
    unsetenv("TS_TEST_MEM_ROLE");
    close(fd);
    size_t len = 0;
    char *out = th_read_file(log, &len);
    unlink(log);
    cr_assert_eq(s, TS_OK, "%s", ts_last_error());
    cr_assert_eq(res.oom_rank, 1, "oom_rank %d (failed_rank %d, signal %d):\n%s", res.oom_rank, res.failed_rank,
                 res.failed_signal, out);
    cr_assert_eq(res.failed_rank, 1);
    cr_assert_eq(res.failed_signal, SIGKILL);
    cr_assert_eq(res.exit_code, 128 + SIGKILL);
    /* the kernel stops it at the cap (within a few pages) */
    cr_assert(res.oom_peak_bytes > CAP - (4 << 20) && res.oom_peak_bytes <= CAP, "peak %lld",
              (long long)res.oom_peak_bytes);
    cr_assert(strncmp(res.oom_message, "rank 1 exceeded --memory-per-rank 64 MiB (killed by the kernel's OOM killer",
                      60) == 0,
              "%s", res.oom_message);
    free(out);
}

Test(comm_launch_memory, a_rank_under_the_cap_runs_in_its_group_which_is_removed, .timeout = 120)
{
    need_cgroups();
    static const char *const args[] = {"--nproc-per-node", "2", "--memory-per-rank=64MiB", NULL};
    int status = 0;
    pid_t pid;
    char *out = run_tsrun(args, "fit", &status, &pid);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "tsrun status 0x%x:\n%s", status, out);
    for (int r = 0; r < 2; r++) {
        char want[128];
        snprintf(want, sizeof want, "[%d] env %lld\n", r, CAP);
        cr_assert(strstr(out, want), "rank %d has no %s=%lld:\n%s", r, TS_MEMORY_PER_RANK_ENV, CAP, out);
        snprintf(want, sizeof want, "[%d] parsed %lld\n", r, CAP);
        cr_assert(strstr(out, want), "rank %d: ts_launch_env does not give the cap:\n%s", r, out);
        snprintf(want, sizeof want, "/tensorshard-%d/rank%d\n", (int)pid, r);
        cr_assert(strstr(out, want), "rank %d is not in its group (%s):\n%s", r, want, out);
    }
    char dir[PATH_MAX + 64];
    job_dir(pid, dir, sizeof dir);
    cr_assert(!exists(dir), "tsrun left %s behind", dir);
    free(out);
}

Test(comm_launch_memory, bad_sizes_are_refused_naming_the_value, .timeout = 60)
{
    static const char *const bad[] = {"abc", "0", "-5", "1.5", "12Q", "", "2000E", "100K", "1.5 GiBs", "G"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        const char *args[] = {"--memory-per-rank", bad[i], "true", NULL};
        int status = 0;
        char *out = run_tsrun(args, NULL, &status, NULL);
        cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 2, "'%s': tsrun status 0x%x:\n%s", bad[i], status, out);
        char want[96];
        snprintf(want, sizeof want, "bad value for --memory-per-rank: '%s'", bad[i]);
        cr_assert(strstr(out, want), "'%s': %s", bad[i], out);
        free(out);
    }
    int64_t b = 0;
    cr_assert_eq(ts_launch_parse_size("12Q", &b), TS_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(ts_last_error(), "'12Q'"), "%s", ts_last_error());
    cr_assert_eq(ts_launch_parse_size("0.5", &b), TS_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(ts_last_error(), "fraction of a byte"), "%s", ts_last_error());
    cr_assert_eq(ts_launch_parse_size("2E", &b), TS_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(ts_last_error(), "more than 1 EiB"), "%s", ts_last_error());
    /* ts_launch itself refuses caps below 1 MiB */
    ts_launch_options o = ts_launch_options_default();
    o.memory_per_rank = 4096;
    char *argv[] = {"true", NULL};
    ts_launch_result res;
    cr_assert_eq(ts_launch(&o, argv, &res), TS_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(ts_last_error(), "memory_per_rank") && strstr(ts_last_error(), "4096"), "%s", ts_last_error());
}

Test(comm_launch_memory, sizes_parse_and_print_in_binary_units)
{
    static const struct {
        const char *text;
        int64_t bytes;
    } ok[] = {
        {"1073741824", 1073741824}, {"1.5GiB", 1610612736}, {"800M", 838860800}, {"2G", 2147483648},
        {"64 MiB", 64 << 20},       {"1k", 1024},           {"512B", 512},       {"0.5KB", 512},
        {"1E", (int64_t)1 << 60},   {"3t", 3ll << 40},
    };
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        int64_t b = -1;
        cr_assert_eq(ts_launch_parse_size(ok[i].text, &b), TS_OK, "'%s': %s", ok[i].text, ts_last_error());
        cr_assert_eq(b, ok[i].bytes, "'%s' -> %lld, want %lld", ok[i].text, (long long)b, (long long)ok[i].bytes);
    }
    static const struct {
        int64_t bytes;
        const char *text;
    } shown[] = {
        {1610612736, "1.5 GiB"}, {64 << 20, "64 MiB"},           {800, "800 B"},
        {1536, "1.5 KiB"},       {(100ll << 20) + 1, "100 MiB"},
    };
    for (size_t i = 0; i < sizeof shown / sizeof shown[0]; i++) {
        char buf[32];
        cr_assert_eq(ts_launch_format_size(shown[i].bytes, buf, sizeof buf), TS_OK);
        cr_assert_str_eq(buf, shown[i].text);
    }
}

/* tsrun in a mount namespace of its own where the memory cgroups are
 * read-only (ro) or not mounted at all (gone): exits 1 before starting
 * anything, naming the path and errno (or the missing controller) and how
 * to run without. */
static char *run_without_cgroups(bool gone, int *status)
{
    char log[256];
    const char *tmp = getenv("TMPDIR");
    snprintf(log, sizeof log, "%s/memcap-ns-%d.log", tmp && *tmp ? tmp : "/tmp", (int)getpid());
    th_clear_launch_env();
    pid_t pid = fork();
    if (pid == 0) {
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        dup2(fd, 1);
        dup2(fd, 2);
        if (unshare(CLONE_NEWNS) != 0 || mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0) {
            printf("SKIP: unshare: %s\n", strerror(errno));
            _exit(77);
        }
        /* every cgroup mount (v1 hierarchies and v2) */
        FILE *f = fopen("/proc/self/mountinfo", "re");
        char line[4096];
        while (f && fgets(line, sizeof line, f)) {
            char point[2048], *dash = strstr(line, " - ");
            if (!dash || sscanf(line, "%*s %*s %*s %*s %2047s", point) != 1) continue;
            if (strncmp(dash + 3, "cgroup ", 7) != 0 && strncmp(dash + 3, "cgroup2 ", 8) != 0) continue;
            if (gone) umount2(point, MNT_DETACH);
            else mount(NULL, point, NULL, MS_REMOUNT | MS_BIND | MS_RDONLY, NULL);
        }
        if (f) fclose(f);
        char *argv[] = {TSRUN, "--memory-per-rank", "64M", "true", NULL};
        execv(argv[0], argv);
        _exit(126);
    }
    th_wait_pids(&pid, 1, -1, 60, status);
    size_t len = 0;
    char *out = th_read_file(log, &len);
    unlink(log);
    if (WIFEXITED(*status) && WEXITSTATUS(*status) == 77) cr_skip_test("%s", out);
    return out;
}

Test(comm_launch_memory, a_read_only_cgroupfs_is_a_clear_error_up_front, .timeout = 60)
{
    need_cgroups();
    int status = 0;
    char *out = run_without_cgroups(false, &status);
    cr_log_info("%s", out);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 1, "tsrun status 0x%x:\n%s", status, out);
    cr_assert(strstr(out, "tsrun: ts_launch: --memory-per-rank: cannot ") && strstr(out, " '/") &&
                  strstr(out, "(EROFS)") && strstr(out, "drop --memory-per-rank"),
              "%s", out);
    free(out);
}

Test(comm_launch_memory, no_memory_controller_is_a_clear_error_up_front, .timeout = 60)
{
    need_cgroups();
    int status = 0;
    char *out = run_without_cgroups(true, &status);
    cr_log_info("%s", out);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 1, "tsrun status 0x%x:\n%s", status, out);
    cr_assert(strstr(out, "no memory cgroup controller") && strstr(out, "drop --memory-per-rank"), "%s", out);
    free(out);
}

Test(comm_launch_memory, help_lists_the_flag)
{
    static const char *const args[] = {"--help", NULL};
    int status = 0;
    char *out = run_tsrun(args, NULL, &status, NULL);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    cr_assert(strstr(out, "--memory-per-rank SIZE"), "%s", out);
    free(out);
}

/* Starts tsrun with 2 capped ranks of role "wait" and returns once both
 * said "ready" (the groups exist): its pid, its output in *log. */
static pid_t start_waiting_job(char *log, size_t cap)
{
    th_clear_launch_env();
    unsetenv(TS_MEMORY_PER_RANK_ENV);
    setenv("TS_TEST_MEM_ROLE", "wait", 1);
    const char *tmp = getenv("TMPDIR");
    snprintf(log, cap, "%s/memcap-wait-%d.log", tmp && *tmp ? tmp : "/tmp", (int)getpid());
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    char *argv[] = {TSRUN, "--nproc-per-node", "2", "--memory-per-rank", "64M", th_self_exe(), NULL};
    pid_t pid;
    cr_assert_eq(posix_spawn(&pid, argv[0], &fa, NULL, argv, environ), 0);
    posix_spawn_file_actions_destroy(&fa);
    unsetenv("TS_TEST_MEM_ROLE");
    double t0 = th_now_s();
    for (;;) {
        size_t len = 0;
        char *out = th_read_file(log, &len);
        bool ready = out && strstr(out, "[0] ready") && strstr(out, "[1] ready");
        free(out);
        if (ready) break;
        if (th_now_s() - t0 > 60) {
            kill(pid, SIGKILL);
            cr_assert_fail("the ranks did not start within 60 s");
        }
        struct timespec step = {0, 10 * 1000 * 1000};
        nanosleep(&step, NULL);
    }
    return pid;
}

Test(comm_launch_memory, an_interrupted_tsrun_removes_the_groups, .timeout = 120)
{
    need_cgroups();
    char log[256], dir[PATH_MAX + 64];
    pid_t pid = start_waiting_job(log, sizeof log);
    job_dir(pid, dir, sizeof dir);
    cr_assert(exists(dir), "no %s while the ranks run", dir);
    kill(pid, SIGTERM);
    int status = 0;
    th_wait_pids(&pid, 1, -1, 60, &status);
    unlink(log);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 128 + SIGTERM, "tsrun status 0x%x", status);
    cr_assert(!exists(dir), "tsrun left %s behind", dir);
}

/* tsrun itself SIGKILLed: its watchdog kills the ranks and removes the
 * groups once they have left them. */
Test(comm_launch_memory, a_killed_tsrun_leaves_no_groups, .timeout = 120)
{
    need_cgroups();
    char log[256], dir[PATH_MAX + 64];
    pid_t pid = start_waiting_job(log, sizeof log);
    job_dir(pid, dir, sizeof dir);
    cr_assert(exists(dir), "no %s while the ranks run", dir);
    kill(pid, SIGKILL);
    int status = 0;
    th_wait_pids(&pid, 1, -1, 60, &status);
    unlink(log);
    double t0 = th_now_s();
    while (exists(dir) && th_now_s() - t0 < 30) {
        struct timespec step = {0, 10 * 1000 * 1000};
        nanosleep(&step, NULL);
    }
    cr_assert(!exists(dir), "%s is still there 30 s after tsrun was killed", dir);
}
