/*
 * The memory cgroups of ts_launch's memory_per_rank (tsrun
 * --memory-per-rank): finding the memory hierarchy, one group per rank
 * with its limit, placing a rank in it, reading its OOM counters, and
 * removing it. See comm/launch_internal.h for the layout.
 */
#define _GNU_SOURCE
#include "comm/launch_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#define HOW_WITHOUT "drop --memory-per-rank (ts_launch_options.memory_per_rank = 0) to run without caps"

static const char *errname(int e)
{
    const char *n = strerrorname_np(e);
    return n ? n : "?";
}

static ts_status io_error(const char *what, const char *path, int e)
{
    return ts_error(TS_ERR_IO,
                    "ts_launch: --memory-per-rank: cannot %s '%s': %s (%s); per-rank caps need a memory cgroup this "
                    "process may write (root, or a delegated cgroup, on a writable cgroupfs); " HOW_WITHOUT,
                    what, path, strerror(e), errname(e));
}

/* Writes `text` to the file at path; 0 or an errno value. */
static int write_file(const char *path, const char *text)
{
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return errno;
    size_t n = strlen(text);
    ssize_t w = write(fd, text, n);
    int e = w < 0 ? errno : (size_t)w != n ? EIO : 0;
    close(fd);
    return e;
}

/* Reads up to cap-1 bytes of the file at path into buf (NUL-terminated);
 * 0 or an errno value. */
static int read_file(const char *path, char *buf, size_t cap)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return errno;
    size_t got = 0;
    while (got < cap - 1) {
        ssize_t r = read(fd, buf + got, cap - 1 - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        got += (size_t)r;
    }
    close(fd);
    buf[got] = '\0';
    return 0;
}

/* Whether the comma- or space-separated list holds `word`. */
static bool has_word(const char *list, const char *word, const char *seps)
{
    size_t n = strlen(word);
    for (const char *p = list; *p;) {
        size_t len = strcspn(p, seps);
        if (len == n && strncmp(p, word, n) == 0) return true;
        p += len;
        if (*p) p++;
    }
    return false;
}

/* mountinfo's octal escapes (\040 for a space) undone in place. */
static void unescape(char *s)
{
    char *o = s;
    for (char *p = s; *p;) {
        if (p[0] == '\\' && p[1] >= '0' && p[1] <= '7' && p[2] >= '0' && p[2] <= '7' && p[3] >= '0' && p[3] <= '7') {
            *o++ = (char)((p[1] - '0') * 64 + (p[2] - '0') * 8 + (p[3] - '0'));
            p += 4;
        } else {
            *o++ = *p++;
        }
    }
    *o = '\0';
}

/* The mount of cgroup v2 (v2 true) or of v1's memory hierarchy: its mount
 * point and the root it shows. False when there is none. */
static bool find_mount(bool v2, char *point, char *root, size_t cap)
{
    FILE *f = fopen("/proc/self/mountinfo", "re");
    if (!f) return false;
    char line[4096];
    bool found = false;
    while (!found && fgets(line, sizeof line, f)) {
        /* id parent maj:min root point options [optional...] - fstype source superoptions */
        char *dash = strstr(line, " - ");
        if (!dash) continue;
        char fstype[64] = "", source[256] = "", super[1024] = "", mroot[PATH_MAX] = "", mpoint[PATH_MAX] = "";
        if (sscanf(dash + 3, "%63s %255s %1023s", fstype, source, super) < 2) continue;
        if (sscanf(line, "%*s %*s %*s %4095s %4095s", mroot, mpoint) != 2) continue;
        if (v2 ? strcmp(fstype, "cgroup2") != 0 : strcmp(fstype, "cgroup") != 0 || !has_word(super, "memory", ","))
            continue;
        unescape(mroot);
        unescape(mpoint);
        if (strlen(mroot) >= cap || strlen(mpoint) >= cap) continue;
        snprintf(point, cap, "%s", mpoint);
        snprintf(root, cap, "%s", mroot);
        found = true;
    }
    fclose(f);
    return found;
}

/* This process's group path in the v2 hierarchy (v2 true) or in v1's
 * memory hierarchy, from /proc/self/cgroup. */
static bool own_path(bool v2, char *out, size_t cap)
{
    FILE *f = fopen("/proc/self/cgroup", "re");
    if (!f) return false;
    char line[PATH_MAX + 128];
    bool found = false;
    while (!found && fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = '\0';
        char *c1 = strchr(line, ':');
        char *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (!c2) continue;
        *c2 = '\0';
        const char *ctrls = c1 + 1;
        bool match = v2 ? strcmp(line, "0") == 0 && *ctrls == '\0' : has_word(ctrls, "memory", ",");
        if (match && strlen(c2 + 1) < cap) {
            snprintf(out, cap, "%s", c2 + 1);
            found = true;
        }
    }
    fclose(f);
    return found;
}

/* The directory of this process's group in the hierarchy mounted at
 * point (showing root). */
static bool own_dir(bool v2, char *out, size_t cap)
{
    char point[PATH_MAX], root[PATH_MAX], path[PATH_MAX];
    if (!find_mount(v2, point, root, sizeof point) || !own_path(v2, path, sizeof path)) return false;
    const char *rel = path;
    size_t rl = strlen(root);
    if (strcmp(root, "/") != 0) {
        if (strncmp(path, root, rl) != 0 || (path[rl] != '/' && path[rl] != '\0'))
            return false; /* the group is outside what this mount shows */
        rel = path + rl;
    }
    if (strcmp(rel, "/") == 0) rel = "";
    int n = snprintf(out, cap, "%s%s", point, rel);
    return n > 0 && (size_t)n < cap;
}

ts_status ts__cgroup_job_init(ts__cgroup_job *j, int64_t limit)
{
    memset(j, 0, sizeof *j);
    j->limit = limit;
    char file[PATH_MAX + 32], text[1024];
    if (own_dir(true, j->own, sizeof j->own)) {
        snprintf(file, sizeof file, "%s/cgroup.controllers", j->own);
        if (read_file(file, text, sizeof text) == 0 && has_word(text, "memory", " \n")) j->version = 2;
    }
    if (j->version == 0 && own_dir(false, j->own, sizeof j->own)) j->version = 1;
    if (j->version == 0)
        return ts_error(TS_ERR_UNSUPPORTED,
                        "ts_launch: --memory-per-rank: no memory cgroup controller for this process: neither a "
                        "cgroup v2 mount whose group lists 'memory' in cgroup.controllers nor a v1 memory hierarchy "
                        "in /proc/self/mountinfo and /proc/self/cgroup; " HOW_WITHOUT);
    if (snprintf(j->job, sizeof j->job, "%s/tensorshard-%ld", j->own, (long)getpid()) >= (int)sizeof j->job - 16)
        return ts_error(TS_ERR_IO, "ts_launch: --memory-per-rank: the cgroup path under '%s' is too long", j->own);
    int e;
    if (j->version == 2) {
        /* the children of a group have a controller only when its
         * subtree_control enables it */
        snprintf(file, sizeof file, "%s/cgroup.subtree_control", j->own);
        if (read_file(file, text, sizeof text) != 0 || !has_word(text, "memory", " \n"))
            if ((e = write_file(file, "+memory")) != 0)
                return io_error("enable the memory controller for the children of this process's cgroup (write "
                                "'+memory' to)",
                                file, e);
    }
    if (mkdir(j->job, 0755) != 0) return io_error("create the memory cgroup", j->job, errno);
    if (j->version == 2) {
        snprintf(file, sizeof file, "%s/cgroup.subtree_control", j->job);
        if ((e = write_file(file, "+memory")) != 0) {
            ts_status s = io_error("enable the memory controller (write '+memory' to)", file, e);
            rmdir(j->job);
            return s;
        }
    }
    return TS_OK;
}

ts_status ts__cgroup_rank_create(const ts__cgroup_job *j, int rank, char *dir_out, size_t cap)
{
    if (snprintf(dir_out, cap, "%s/rank%d", j->job, rank) >= (int)cap)
        return ts_error(TS_ERR_IO, "ts_launch: --memory-per-rank: the cgroup path under '%s' is too long", j->job);
    if (mkdir(dir_out, 0755) != 0 && errno != EEXIST) return io_error("create the memory cgroup", dir_out, errno);
    char file[PATH_MAX + 64], val[32];
    snprintf(val, sizeof val, "%lld", (long long)j->limit);
    int e;
    ts_status s = TS_OK;
    if (j->version == 2) {
        snprintf(file, sizeof file, "%s/memory.max", dir_out);
        if ((e = write_file(file, val)) != 0) {
            s = io_error("write the limit to", file, e);
        } else {
            /* absent without swap accounting: then there is no swap to use */
            snprintf(file, sizeof file, "%s/memory.swap.max", dir_out);
            if ((e = write_file(file, "0")) != 0 && e != ENOENT) s = io_error("shut off swap in", file, e);
        }
    } else {
        snprintf(file, sizeof file, "%s/memory.limit_in_bytes", dir_out);
        if ((e = write_file(file, val)) != 0) {
            s = io_error("write the limit to", file, e);
        } else {
            /* memory + swap at the same limit: no swap. Without swap
             * accounting (no memsw files), swappiness 0 instead. */
            snprintf(file, sizeof file, "%s/memory.memsw.limit_in_bytes", dir_out);
            if ((e = write_file(file, val)) == ENOENT) {
                snprintf(file, sizeof file, "%s/memory.swappiness", dir_out);
                e = write_file(file, "0");
            }
            if (e != 0) s = io_error("shut off swap in", file, e);
        }
    }
    if (s != TS_OK) rmdir(dir_out);
    return s;
}

static ts_status move_to(const ts__cgroup_job *j, const char *dir)
{
    char file[PATH_MAX + 32], val[32];
    /* v1: `tasks` moves one thread, whose forks are born in its group */
    snprintf(file, sizeof file, "%s/%s", dir, j->version == 1 ? "tasks" : "cgroup.procs");
    snprintf(val, sizeof val, "%ld", j->version == 1 ? (long)gettid() : (long)getpid());
    int e = write_file(file, val);
    return e ? io_error("move the launcher into", file, e) : TS_OK;
}

ts_status ts__cgroup_enter(const ts__cgroup_job *j, const char *dir) { return move_to(j, dir); }

ts_status ts__cgroup_leave(const ts__cgroup_job *j) { return move_to(j, j->own); }

/* The number after `key` at the start of a line of text; -1 when none. */
static int64_t field(const char *text, const char *key)
{
    size_t n = strlen(key);
    for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
        if (strncmp(p, key, n) == 0 && p[n] == ' ') return strtoll(p + n + 1, NULL, 10);
    return -1;
}

static int64_t number_file(const char *dir, const char *name)
{
    char file[PATH_MAX + 64], text[64];
    snprintf(file, sizeof file, "%s/%s", dir, name);
    if (read_file(file, text, sizeof text) != 0 || text[0] < '0' || text[0] > '9') return -1;
    return strtoll(text, NULL, 10);
}

void ts__cgroup_counters(const ts__cgroup_job *j, const char *dir, int64_t *oom_kills, int64_t *failcnt, int64_t *peak)
{
    char file[PATH_MAX + 64], text[1024];
    *oom_kills = *failcnt = *peak = -1;
    snprintf(file, sizeof file, "%s/%s", dir, j->version == 2 ? "memory.events" : "memory.oom_control");
    if (read_file(file, text, sizeof text) == 0) *oom_kills = field(text, "oom_kill");
    if (j->version == 1) {
        *failcnt = number_file(dir, "memory.failcnt");
        *peak = number_file(dir, "memory.max_usage_in_bytes");
    } else {
        *peak = number_file(dir, "memory.peak"); /* Linux 5.19 and later */
    }
}

int ts__cgroup_remove(const char *dir)
{
    if (rmdir(dir) == 0 || errno == ENOENT) return 0;
    int e = errno;
    if (e != EBUSY) return e;
    /* processes left behind (children that left the rank's process
     * group): they go with the rank */
    char file[PATH_MAX + 32], text[4096];
    snprintf(file, sizeof file, "%s/cgroup.procs", dir);
    if (read_file(file, text, sizeof text) == 0)
        for (char *p = text; *p;) {
            long pid = strtol(p, &p, 10);
            if (pid > 0) kill((pid_t)pid, SIGKILL);
            while (*p == '\n' || *p == ' ') p++;
            if (*p && (*p < '0' || *p > '9')) break;
        }
    return rmdir(dir) == 0 ? 0 : errno;
}

int ts__cgroup_job_remove(const ts__cgroup_job *j)
{
    if (!j->job[0] || rmdir(j->job) == 0 || errno == ENOENT) return 0;
    return errno;
}
