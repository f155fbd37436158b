/*
 * Internal to the launcher (comm/launch.c): the memory cgroups of
 * --memory-per-rank (comm/launch_cgroup.c). Not installed.
 *
 * A job's groups live under the memory hierarchy's directory of the
 * launcher's own group: <own>/tensorshard-<launcher pid>/rank<R>, one per
 * rank of this node, each with memory.max (v2) or memory.limit_in_bytes
 * (v1) set to the cap and swap shut off (v2 memory.swap.max 0; v1
 * memory.memsw.limit_in_bytes = the cap where swap accounting exists,
 * else memory.swappiness 0). A rank is born in its group: the launcher
 * moves the thread that forks it there (v1: `tasks` takes a thread; v2:
 * `cgroup.procs` takes the whole launcher process) for the fork only.
 */
#ifndef TS_LAUNCH_INTERNAL_H
#define TS_LAUNCH_INTERNAL_H

#include <limits.h>
#include <stdint.h>

#include "base/base.h"

typedef struct ts__cgroup_job {
    int version;        /* 1 or 2 */
    int64_t limit;      /* bytes */
    char own[PATH_MAX]; /* the launcher's own group in the memory hierarchy */
    char job[PATH_MAX]; /* own/tensorshard-<pid>, created */
} ts__cgroup_job;

/* Finds the memory hierarchy (cgroup v2 with the memory controller in the
 * launcher's group, else v1's memory hierarchy) and creates the job's
 * directory. TS_ERR_UNSUPPORTED when no memory controller is there,
 * TS_ERR_IO when a directory or file cannot be created or written (the
 * detail names the path and the errno, and says to drop
 * --memory-per-rank to run without caps). */
ts_status ts__cgroup_job_init(ts__cgroup_job *j, int64_t limit);

/* Creates rank R's group with the limits (dir_out: its path). Errors as
 * ts__cgroup_job_init's. */
ts_status ts__cgroup_rank_create(const ts__cgroup_job *j, int rank, char *dir_out, size_t cap);

/* Moves the calling thread (v1) or process (v2) into `dir`, so that a
 * child forked now is born there; ts__cgroup_leave moves it back. */
ts_status ts__cgroup_enter(const ts__cgroup_job *j, const char *dir);
ts_status ts__cgroup_leave(const ts__cgroup_job *j);

/* A group's counters after its rank ended: *oom_kills the kernel's OOM
 * kills in it (-1 when the kernel does not count them: v1 before Linux
 * 4.13), *failcnt the times usage hit the limit (v1; -1 on v2), *peak the
 * highest usage in bytes (-1 when unknown). */
void ts__cgroup_counters(const ts__cgroup_job *j, const char *dir, int64_t *oom_kills, int64_t *failcnt, int64_t *peak);

/* SIGKILLs every process left in `dir` and removes it. Returns 0 or the
 * errno of rmdir (EBUSY while killed processes are still exiting). */
int ts__cgroup_remove(const char *dir);

/* Removes the job's directory (its rank groups removed before); returns
 * 0 or an errno value. */
int ts__cgroup_job_remove(const ts__cgroup_job *j);

#endif /* TS_LAUNCH_INTERNAL_H */
