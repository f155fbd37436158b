/* Process memory (base/base.h: "Process memory"): the CPUs the process
 * may run on (ts_cpu_count), the resident set from
 * /proc/self/status and the memory cap the process runs under, from the
 * launcher's TS_MEMORY_PER_RANK or the process's own memory cgroup.
 *
 * The cgroup is found as the kernel names it: /proc/self/cgroup gives the
 * group's path in each hierarchy ("0::/a/b" for cgroup v2, "4:memory:/a/b"
 * for v1's memory controller), /proc/self/mountinfo where each hierarchy
 * is mounted and which of its folders the mount shows (its "root" field:
 * "/" for the whole hierarchy, the group itself inside a cgroup
 * namespace). The limit of the group and of every ancestor up to the
 * mount is read (v2 memory.max, v1 memory.limit_in_bytes) and the
 * smallest one is the cap: a parent's limit binds its children. */
#define _GNU_SOURCE
#include "base/base.h"
#include "base/internal.h"

#include <errno.h>
#include <limits.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* A limit at or above this is "no limit": v1 writes 2^63 rounded down to
 * a page (9223372036854771712) for none, v2 writes "max". */
#define NO_CAP_BYTES ((uint64_t)1 << 60)

ts_status ts__process_memory_parse(const char *path, ts_process_memory *out)
{
    if (!path || !out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_process_memory_read: path %p and out %p must not be NULL",
                        (const void *)path, (void *)out);
    FILE *f = fopen(path, "re");
    if (!f) return ts_error(TS_ERR_IO, "ts_process_memory_read: cannot open %s: %s", path, strerror(errno));
    char line[256];
    long long rss = -1, hwm = -1;
    while (fgets(line, sizeof line, f)) {
        long long v;
        char unit[8] = "";
        if (sscanf(line, "VmRSS: %lld %7s", &v, unit) == 2 && !strcmp(unit, "kB")) rss = v;
        else if (sscanf(line, "VmHWM: %lld %7s", &v, unit) == 2 && !strcmp(unit, "kB")) hwm = v;
    }
    bool err = ferror(f);
    fclose(f);
    if (err) return ts_error(TS_ERR_IO, "ts_process_memory_read: reading %s failed", path);
    if (rss < 0 || hwm < 0)
        return ts_error(TS_ERR_FORMAT,
                        "ts_process_memory_read: %s has no %s line in kB (the kernel's "
                        "/proc/<pid>/status has both)",
                        path, rss < 0 ? "VmRSS" : "VmHWM");
    ts_process_memory m = {(size_t)rss * 1024, (size_t)hwm * 1024};
    *out = m;
    return TS_OK;
}

ts_status ts_process_memory_read(ts_process_memory *out) { return ts__process_memory_parse("/proc/self/status", out); }

/* ------------------------------------------------------------ the cap */

/* The value of a limit file: bytes, or NO_CAP_BYTES for "max" or a huge
 * number; false when the file is absent or not a number. */
static bool read_limit(const char *path, uint64_t *bytes)
{
    FILE *f = fopen(path, "re");
    if (!f) return false;
    char buf[64] = "";
    bool ok = fgets(buf, sizeof buf, f) != NULL;
    fclose(f);
    if (!ok) return false;
    buf[strcspn(buf, "\n")] = '\0';
    if (!strcmp(buf, "max")) {
        *bytes = NO_CAP_BYTES;
        return true;
    }
    char *end;
    errno = 0;
    unsigned long long v = strtoull(buf, &end, 10);
    if (errno || end == buf || *end) return false;
    *bytes = v >= NO_CAP_BYTES ? NO_CAP_BYTES : (uint64_t)v;
    return true;
}

/* The group path of this process in the hierarchy that `v2` (the unified
 * one) or v1's memory controller names, from a /proc/<pid>/cgroup file. */
static bool group_path(const char *cgroup_file, bool v2, char *out, size_t cap)
{
    FILE *f = fopen(cgroup_file, "re");
    if (!f) return false;
    char line[4096];
    bool found = false;
    while (!found && fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = '\0';
        char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (!c2) continue;
        *c1 = *c2 = '\0';
        const char *ctrl = c1 + 1, *path = c2 + 1;
        if (v2) {
            found = !strcmp(line, "0") && !*ctrl;
        } else {
            char list[256];
            snprintf(list, sizeof list, ",%s,", ctrl);
            found = strstr(list, ",memory,") != NULL;
        }
        if (found) snprintf(out, cap, "%s", path);
    }
    fclose(f);
    return found;
}

/* Where the hierarchy is mounted (v2: fstype cgroup2; v1: fstype cgroup
 * with the memory option) and which of its folders the mount shows. */
static bool mount_of(const char *mountinfo, bool v2, char *root, char *point, size_t cap)
{
    FILE *f = fopen(mountinfo, "re");
    if (!f) return false;
    char line[4096];
    bool found = false;
    while (!found && fgets(line, sizeof line, f)) {
        /* id parent maj:min root point options [optional...] - fstype source superoptions */
        char r[1024], p[1024], fstype[64], superopts[1024] = "";
        const char *sep = strstr(line, " - ");
        if (!sep || sscanf(line, "%*s %*s %*s %1023s %1023s", r, p) != 2) continue;
        if (sscanf(sep + 3, "%63s %*s %1023s", fstype, superopts) < 1) continue;
        if (v2) {
            found = !strcmp(fstype, "cgroup2");
        } else {
            char list[1040];
            snprintf(list, sizeof list, ",%s,", superopts);
            found = !strcmp(fstype, "cgroup") && strstr(list, ",memory,") != NULL;
        }
        if (found) {
            snprintf(root, cap, "%s", r);
            snprintf(point, cap, "%s", p);
        }
    }
    fclose(f);
    return found;
}

/* The smallest limit of the group and its ancestors in one hierarchy;
 * false when the hierarchy or its limit files are not there. */
static bool hierarchy_cap(const char *cgroup_file, const char *mountinfo, bool v2, uint64_t *bytes, char *where,
                          size_t where_cap)
{
    char path[1024], root[1024], point[1024];
    if (!group_path(cgroup_file, v2, path, sizeof path) || !mount_of(mountinfo, v2, root, point, sizeof root))
        return false;
    /* the group's folder under the mount: its path less the mount's root */
    const char *rel = path;
    size_t rl = strlen(root);
    if (strcmp(root, "/") != 0 && !strncmp(path, root, rl) && (path[rl] == '/' || !path[rl])) rel = path + rl;
    char dir[2200];
    snprintf(dir, sizeof dir, "%s%s%s", point, *rel && *rel != '/' ? "/" : "", rel);
    size_t pl = strlen(point);
    bool any = false;
    uint64_t best = NO_CAP_BYTES;
    for (;;) {
        char file[2300];
        snprintf(file, sizeof file, "%s/%s", dir, v2 ? "memory.max" : "memory.limit_in_bytes");
        uint64_t v;
        if (read_limit(file, &v)) {
            if (!any || v < best) {
                best = v;
                size_t n = strlen(file) < where_cap ? strlen(file) : where_cap - 1; /* a path cut short only names it */
                memcpy(where, file, n);
                where[n] = '\0';
            }
            any = true;
        }
        char *slash = strrchr(dir, '/');
        if (!slash || (size_t)(slash - dir) < pl || strlen(dir) <= pl) break; /* at the mount */
        *slash = '\0';
    }
    if (any) *bytes = best;
    return any;
}

ts_status ts__memory_cap_from(const char *env_value, const char *cgroup_file, const char *mountinfo, ts_memory_cap *out)
{
    if (!out) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_memory_cap_read: out must not be NULL");
    ts_memory_cap c;
    memset(&c, 0, sizeof c);
    if (env_value && *env_value) {
        char *end;
        errno = 0;
        unsigned long long v = strtoull(env_value, &end, 10);
        if (errno || end == env_value || *end || v == 0 || env_value[0] == '-')
            return ts_error(TS_ERR_INVALID_ARGUMENT,
                            "ts_memory_cap_read: " TS_MEMORY_PER_RANK_ENV "='%s' is not a "
                            "number of bytes above 0",
                            env_value);
        c.bytes = (size_t)v;
        snprintf(c.source, sizeof c.source, TS_MEMORY_PER_RANK_ENV);
        *out = c;
        return TS_OK;
    }
    uint64_t v1 = NO_CAP_BYTES, v2 = NO_CAP_BYTES;
    char w1[sizeof c.source] = "", w2[sizeof c.source] = "";
    bool h1 = cgroup_file && mountinfo && hierarchy_cap(cgroup_file, mountinfo, false, &v1, w1, sizeof w1);
    bool h2 = cgroup_file && mountinfo && hierarchy_cap(cgroup_file, mountinfo, true, &v2, w2, sizeof w2);
    uint64_t best = NO_CAP_BYTES;
    const char *where = "";
    if (h1 && v1 < best) best = v1, where = w1;
    if (h2 && v2 < best) best = v2, where = w2;
    if (best < NO_CAP_BYTES) {
        c.bytes = (size_t)best;
        snprintf(c.source, sizeof c.source, "%s", where);
    }
    *out = c;
    return TS_OK;
}

ts_status ts_memory_cap_read(ts_memory_cap *out)
{
    return ts__memory_cap_from(getenv(TS_MEMORY_PER_RANK_ENV), "/proc/self/cgroup", "/proc/self/mountinfo", out);
}

int ts_cpu_count(void)
{
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        int n = CPU_COUNT(&set);
        if (n > 0) return n;
    }
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 && n < INT_MAX ? (int)n : 1;
}
