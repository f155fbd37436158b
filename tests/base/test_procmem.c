/* Process memory (base/procmem.c): the resident set from /proc and the
 * memory cap from TS_MEMORY_PER_RANK or the cgroup, read from files the
 * test writes in the kernel's formats. */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/internal.h"
#include "tests/helpers.h"

static char dir[64];

static void make_dir(void)
{
    snprintf(dir, sizeof dir, "/tmp/ts_procmem_XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
}

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f, "%s", path);
    fputs(text, f);
    fclose(f);
}

static void remove_tree(void)
{
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    cr_assert_eq(system(cmd), 0);
}

Test(base_procmem, reads_this_process_resident_set)
{
    ts_process_memory m;
    cr_assert_eq(ts_process_memory_read(&m), TS_OK, "%s", ts_last_error());
    cr_assert_gt(m.rss_bytes, 0);
    cr_assert_geq(m.peak_rss_bytes, m.rss_bytes, "VmHWM %zu below VmRSS %zu", m.peak_rss_bytes, m.rss_bytes);
    /* 64 MiB touched shows in both */
    size_t n = (size_t)64 << 20;
    char *p = malloc(n);
    cr_assert_not_null(p);
    memset(p, 1, n);
    ts_process_memory after;
    cr_assert_eq(ts_process_memory_read(&after), TS_OK);
    cr_assert_geq(after.rss_bytes, m.rss_bytes + n / 2, "rss %zu -> %zu after touching %zu", m.rss_bytes,
                  after.rss_bytes, n);
    cr_assert_geq(after.peak_rss_bytes, after.rss_bytes);
    free(p);
}

Test(base_procmem, parses_status_lines_in_kilobytes)
{
    make_dir();
    char path[128];
    snprintf(path, sizeof path, "%s/status", dir);
    write_file(path, "Name:\tx\nVmPeak:\t  900 kB\nVmHWM:\t    2048 kB\nVmRSS:\t    1024 kB\nThreads:\t1\n");
    ts_process_memory m;
    cr_assert_eq(ts__process_memory_parse(path, &m), TS_OK, "%s", ts_last_error());
    cr_assert_eq(m.rss_bytes, 1024u * 1024);
    cr_assert_eq(m.peak_rss_bytes, 2048u * 1024);
    remove_tree();
}

Test(base_procmem, unreadable_or_malformed_files_are_errors)
{
    make_dir();
    char path[128];
    ts_process_memory m = {7, 7};
    snprintf(path, sizeof path, "%s/absent", dir);
    cr_assert_eq(ts__process_memory_parse(path, &m), TS_ERR_IO);
    cr_assert(strstr(ts_last_error(), path) != NULL, "%s", ts_last_error());
    snprintf(path, sizeof path, "%s/status", dir);
    write_file(path, "Name:\tx\nVmRSS:\t 1024 kB\n");
    cr_assert_eq(ts__process_memory_parse(path, &m), TS_ERR_FORMAT);
    cr_assert(strstr(ts_last_error(), "VmHWM") != NULL, "%s", ts_last_error());
    cr_assert_eq(m.rss_bytes, 7u, "out is written only on success");
    cr_assert_eq(ts__process_memory_parse(NULL, &m), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_process_memory_read(NULL), TS_ERR_INVALID_ARGUMENT);
    remove_tree();
}

Test(base_procmem, cap_from_the_launcher_variable)
{
    ts_memory_cap c;
    cr_assert_eq(ts__memory_cap_from("1610612736", NULL, NULL, &c), TS_OK, "%s", ts_last_error());
    cr_assert_eq(c.bytes, (size_t)1610612736);
    cr_assert_str_eq(c.source, "TS_MEMORY_PER_RANK");
    const char *bad[] = {"1.5G", "-3", "0", "12x"};
    for (int i = 0; i < 4; i++) {
        cr_assert_eq(ts__memory_cap_from(bad[i], NULL, NULL, &c), TS_ERR_INVALID_ARGUMENT, "%s", bad[i]);
        cr_assert(strstr(ts_last_error(), bad[i]) != NULL, "%s", ts_last_error());
    }
    /* nothing found: no cap */
    cr_assert_eq(ts__memory_cap_from(NULL, NULL, NULL, &c), TS_OK);
    cr_assert_eq(c.bytes, 0u);
    cr_assert_str_eq(c.source, "");
}

/* A v1 memory hierarchy mounted at <dir>/memory showing the whole tree;
 * the process in /job/rank0, whose parent /job has the smaller limit. */
Test(base_procmem, cap_from_a_v1_group_and_its_ancestors)
{
    make_dir();
    char p[256], cg[128], mi[128], text[1024];
    snprintf(p, sizeof p, "%s/memory/job/rank0", dir);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "mkdir -p %s", p);
    cr_assert_eq(system(cmd), 0);
    snprintf(p, sizeof p, "%s/memory/memory.limit_in_bytes", dir);
    write_file(p, "9223372036854771712\n");
    snprintf(p, sizeof p, "%s/memory/job/memory.limit_in_bytes", dir);
    write_file(p, "2147483648\n");
    snprintf(p, sizeof p, "%s/memory/job/rank0/memory.limit_in_bytes", dir);
    write_file(p, "3221225472\n");
    snprintf(cg, sizeof cg, "%s/cgroup", dir);
    write_file(cg, "9:name=systemd:/\n4:cpu,memory:/job/rank0\n0::/\n");
    snprintf(mi, sizeof mi, "%s/mountinfo", dir);
    snprintf(text, sizeof text,
             "30 22 0:27 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
             "34 30 0:31 / %s/memory rw,relatime - cgroup cgroup rw,cpu,memory\n",
             dir);
    write_file(mi, text);
    ts_memory_cap c;
    cr_assert_eq(ts__memory_cap_from(NULL, cg, mi, &c), TS_OK, "%s", ts_last_error());
    cr_assert_eq(c.bytes, (size_t)2147483648u, "the parent's limit binds: got %zu", c.bytes);
    cr_assert(strstr(c.source, "/memory/job/memory.limit_in_bytes") != NULL, "%s", c.source);
    /* unlimited everywhere: no cap */
    snprintf(p, sizeof p, "%s/memory/job/memory.limit_in_bytes", dir);
    write_file(p, "9223372036854771712\n");
    snprintf(p, sizeof p, "%s/memory/job/rank0/memory.limit_in_bytes", dir);
    write_file(p, "9223372036854771712\n");
    cr_assert_eq(ts__memory_cap_from(NULL, cg, mi, &c), TS_OK);
    cr_assert_eq(c.bytes, 0u);
    /* the launcher's variable wins over the cgroup */
    cr_assert_eq(ts__memory_cap_from("1000", cg, mi, &c), TS_OK);
    cr_assert_eq(c.bytes, 1000u);
    remove_tree();
}

/* cgroup v2 inside a cgroup namespace: the mount's root is the group
 * itself, so its folder is the mount point. */
Test(base_procmem, cap_from_a_v2_group_under_a_namespaced_mount)
{
    make_dir();
    char p[256], cg[128], mi[128], text[1024];
    snprintf(p, sizeof p, "%s/unified/memory.max", dir);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "mkdir -p %s/unified", dir);
    cr_assert_eq(system(cmd), 0);
    write_file(p, "1073741824\n");
    snprintf(cg, sizeof cg, "%s/cgroup", dir);
    write_file(cg, "0::/user.slice/job\n");
    snprintf(mi, sizeof mi, "%s/mountinfo", dir);
    snprintf(text, sizeof text, "40 30 0:37 /user.slice/job %s/unified rw,relatime shared:9 - cgroup2 cgroup2 rw\n",
             dir);
    write_file(mi, text);
    ts_memory_cap c;
    cr_assert_eq(ts__memory_cap_from(NULL, cg, mi, &c), TS_OK, "%s", ts_last_error());
    cr_assert_eq(c.bytes, (size_t)1073741824u);
    write_file(p, "max\n");
    cr_assert_eq(ts__memory_cap_from(NULL, cg, mi, &c), TS_OK);
    cr_assert_eq(c.bytes, 0u, "\"max\" is no cap");
    remove_tree();
}

Test(base_procmem, this_process_cap_reads_without_error)
{
    ts_memory_cap c;
    unsetenv("TS_MEMORY_PER_RANK");
    cr_assert_eq(ts_memory_cap_read(&c), TS_OK, "%s", ts_last_error());
    cr_assert_eq(ts_memory_cap_read(NULL), TS_ERR_INVALID_ARGUMENT);
}

/* ts_cpu_count is the affinity mask's count, not the machine's: with one
 * CPU allowed it says 1 (the default thread count and tsrun's
 * --nproc-per-node auto rely on it). */
Test(base_procmem, cpu_count_is_the_affinity_mask)
{
    cpu_set_t all;
    cr_assert_eq(sched_getaffinity(0, sizeof all, &all), 0);
    cr_assert_eq(ts_cpu_count(), CPU_COUNT(&all));
    int first = 0;
    while (!CPU_ISSET(first, &all)) first++;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(first, &one);
    cr_assert_eq(sched_setaffinity(0, sizeof one, &one), 0);
    int n = ts_cpu_count();
    sched_setaffinity(0, sizeof all, &all);
    cr_assert_eq(n, 1);
}
