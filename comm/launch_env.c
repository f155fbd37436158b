/*
 * The rank side of comm/launch.h: ts_launch_env (where this rank sits in
 * the job, from the variables tsrun, torchrun, mpirun or srun set) and
 * ts_launch_rank_guard (die with the launcher). The launcher itself is in
 * comm/launch.c.
 */
#define _GNU_SOURCE
#include "comm/launch.h"
#include "comm/comm_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <unistd.h>

/* ================================================================ ranks */

const char *ts_launch_source_name(ts_launch_source s)
{
    switch (s) {
    case TS_LAUNCH_SOURCE_TSRUN: return "tsrun";
    case TS_LAUNCH_SOURCE_OMPI: return "ompi";
    case TS_LAUNCH_SOURCE_SLURM: return "slurm";
    }
    return "unknown";
}

/* A decimal integer in [lo, hi] from variable `name`. *set_out says whether
 * the variable is set; TS_ERR_INVALID_ARGUMENT when set to anything else. */
static ts_status env_int(const char *name, long lo, long hi, int *v_out, bool *set_out)
{
    const char *s = getenv(name);
    *set_out = s != NULL;
    if (!s) return TS_OK;
    char *end = NULL;
    long v = -1;
    errno = 0;
    if (*s >= '0' && *s <= '9') v = strtol(s, &end, 10);
    if (!end || *end != '\0' || errno != 0 || v < lo || v > hi)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_launch_env: %s='%s' is not an integer in %ld..%ld", name, s, lo,
                        hi);
    *v_out = (int)v;
    return TS_OK;
}

/* Like env_int, for a variable that must be set. */
static ts_status env_int_req(const char *name, long lo, long hi, int *v_out, const char *why)
{
    bool set;
    ts_status s = env_int(name, lo, hi, v_out, &set);
    if (s) return s;
    if (!set) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_launch_env: %s is not set (%s)", name, why);
    return TS_OK;
}

/* The task count of node `node` in a Slurm tasks-per-node list such as
 * "2(x3),1"; -1 when malformed, 0 when the list has no such node. */
static int slurm_tasks_on_node(const char *s, int node)
{
    int idx = 0, found = -1;
    const char *p = s;
    if (!*p) return -1;
    while (*p) {
        char *end;
        errno = 0;
        if (*p < '0' || *p > '9') return -1;
        long n = strtol(p, &end, 10);
        if (errno || n < 1 || n > INT_MAX) return -1;
        long rep = 1;
        p = end;
        if (p[0] == '(' && p[1] == 'x') {
            if (p[2] < '0' || p[2] > '9') return -1;
            rep = strtol(p + 2, &end, 10);
            if (errno || rep < 1 || *end != ')') return -1;
            p = end + 1;
        }
        if (*p != ',' && *p != '\0') return -1;
        if (*p == ',' && p[1] == '\0') return -1;
        if (found < 0 && node >= idx && node - idx < rep) found = (int)n;
        idx += (int)(rep > INT_MAX - idx ? INT_MAX - idx : rep);
        if (*p == ',') p++;
    }
    return found < 0 ? 0 : found;
}

static bool host_char(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '.' ||
        c == '_';
}

/* The first host of a simple Slurm node list: "a,b" -> "a",
 * "node[03-07,9]" -> "node03", "n[1-2]-ib" -> "n1-ib". False for anything
 * else (several bracket groups, odd characters). */
static bool slurm_first_host(const char *list, char *out, size_t cap)
{
    size_t len = 0;
    const char *p = list;
    const char *open = NULL, *close = NULL;
    int depth = 0;
    for (; *p && !(depth == 0 && *p == ','); p++) {
        if (*p == '[') {
            if (open) return false; /* several bracket groups: not simple */
            open = p;
            depth++;
        } else if (*p == ']') {
            if (depth != 1) return false;
            close = p;
            depth--;
        } else if (depth == 0 && !host_char(*p)) {
            return false;
        }
    }
    if (depth != 0 || p == list) return false;
    const char *item_end = p;
    char host[TS_LAUNCH_MAX_STR];
    if (!open) {
        len = (size_t)(item_end - list);
        if (len >= sizeof host) return false;
        memcpy(host, list, len);
    } else {
        /* prefix, then the first number of the group (zero padding kept) */
        size_t plen = (size_t)(open - list);
        const char *q = open + 1;
        const char *num_end = q;
        while (num_end < close && *num_end >= '0' && *num_end <= '9') num_end++;
        if (num_end == q || (num_end < close && *num_end != '-' && *num_end != ',')) return false;
        size_t nlen = (size_t)(num_end - q), slen = (size_t)(item_end - close - 1);
        if (plen + nlen + slen >= sizeof host) return false;
        memcpy(host, list, plen);
        memcpy(host + plen, q, nlen);
        memcpy(host + plen + nlen, close + 1, slen);
        len = plen + nlen + slen;
    }
    host[len] = '\0';
    if (len == 0 || len >= cap) return false;
    memcpy(out, host, len + 1);
    return true;
}

static ts_status env_str(const char *name, char *out, const char *dflt)
{
    const char *s = getenv(name);
    if (!s) s = dflt;
    if (strlen(s) >= TS_LAUNCH_MAX_STR)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_launch_env: %s is %zu bytes long (at most %d)", name, strlen(s),
                        TS_LAUNCH_MAX_STR - 1);
    snprintf(out, TS_LAUNCH_MAX_STR, "%s", s);
    return TS_OK;
}

/* ts_launch_env's work on a zeroed *e, which keeps what was read before an
 * error (ts__launch_env_world_size needs the world size of incomplete
 * variables). */
static ts_status parse_env(ts_rank_env *e)
{
    ts_status s;
    const char *rank_v, *size_v, *lrank_v, *lsize_v;
    const int big = 1 << 24;
    bool set1, set2;
    if (getenv("RANK") || getenv("WORLD_SIZE")) {
        e->source = TS_LAUNCH_SOURCE_TSRUN;
        rank_v = "RANK", size_v = "WORLD_SIZE", lrank_v = "LOCAL_RANK", lsize_v = "LOCAL_WORLD_SIZE";
        const char *why = "tsrun and torchrun set RANK and WORLD_SIZE together";
        if ((s = env_int_req(rank_v, 0, big, &e->rank, why)) || (s = env_int_req(size_v, 1, big, &e->world_size, why)))
            return s;
        if ((s = env_int(lrank_v, 0, big, &e->local_rank, &set1)) ||
            (s = env_int(lsize_v, 1, big, &e->local_world_size, &set2)))
            return s;
        if (set1 != set2)
            return ts_error(TS_ERR_INVALID_ARGUMENT,
                            "ts_launch_env: %s is set but %s is not (set both, or neither for one node)",
                            set1 ? lrank_v : lsize_v, set1 ? lsize_v : lrank_v);
        if (!set1) {
            e->local_rank = e->rank;
            e->local_world_size = e->world_size;
        }
    } else if (getenv("OMPI_COMM_WORLD_RANK") || getenv("OMPI_COMM_WORLD_SIZE")) {
        e->source = TS_LAUNCH_SOURCE_OMPI;
        rank_v = "OMPI_COMM_WORLD_RANK", size_v = "OMPI_COMM_WORLD_SIZE";
        lrank_v = "OMPI_COMM_WORLD_LOCAL_RANK", lsize_v = "OMPI_COMM_WORLD_LOCAL_SIZE";
        const char *why = "mpirun (Open MPI) sets all four OMPI_COMM_WORLD_ variables";
        if ((s = env_int_req(rank_v, 0, big, &e->rank, why)) ||
            (s = env_int_req(size_v, 1, big, &e->world_size, why)) ||
            (s = env_int_req(lrank_v, 0, big, &e->local_rank, why)) ||
            (s = env_int_req(lsize_v, 1, big, &e->local_world_size, why)))
            return s;
    } else if (getenv("SLURM_PROCID")) {
        e->source = TS_LAUNCH_SOURCE_SLURM;
        rank_v = "SLURM_PROCID", lrank_v = "SLURM_LOCALID";
        size_v = getenv("SLURM_NTASKS") || !getenv("SLURM_NPROCS") ? "SLURM_NTASKS" : "SLURM_NPROCS";
        const char *why = "srun sets it for every task";
        if ((s = env_int_req(rank_v, 0, big, &e->rank, why)) ||
            (s = env_int_req(size_v, 1, big, &e->world_size, why)) ||
            (s = env_int_req(lrank_v, 0, big, &e->local_rank, why)))
            return s;
        static const char *const per_node[] = {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
                                               "SLURM_NTASKS_PER_NODE"};
        const char *spec = NULL;
        lsize_v = NULL;
        for (int i = 0; i < 3 && !spec; i++)
            if ((spec = getenv(per_node[i]))) lsize_v = per_node[i];
        if (!spec)
            return ts_error(TS_ERR_INVALID_ARGUMENT,
                            "ts_launch_env: none of SLURM_STEP_TASKS_PER_NODE, SLURM_TASKS_PER_NODE, "
                            "SLURM_NTASKS_PER_NODE is set: the tasks on this node are unknown");
        int node = 0;
        bool node_set;
        if ((s = env_int("SLURM_NODEID", 0, big, &node, &node_set))) return s;
        bool list = strchr(spec, ',') || strchr(spec, '(');
        if (list && !node_set)
            return ts_error(TS_ERR_INVALID_ARGUMENT,
                            "ts_launch_env: %s='%s' lists several nodes but SLURM_NODEID is not set", lsize_v, spec);
        int n = slurm_tasks_on_node(spec, node_set ? node : 0);
        if (n < 0)
            return ts_error(TS_ERR_INVALID_ARGUMENT,
                            "ts_launch_env: %s='%s' is not a Slurm task count list such as '2(x3),1'", lsize_v, spec);
        if (n == 0)
            return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_launch_env: %s='%s' has no entry for SLURM_NODEID=%d", lsize_v,
                            spec, node);
        e->local_world_size = n;
    } else {
        return ts_error(TS_ERR_NOT_FOUND,
                        "ts_launch_env: no launcher variables: neither RANK/WORLD_SIZE (tsrun, torchrun), "
                        "OMPI_COMM_WORLD_RANK (mpirun) nor SLURM_PROCID (srun) is set");
    }
    if (e->rank >= e->world_size)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_launch_env: %s=%d is not below %s=%d", rank_v, e->rank, size_v,
                        e->world_size);
    if (e->local_rank >= e->local_world_size)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_launch_env: %s=%d is not below %s=%d", lrank_v, e->local_rank,
                        lsize_v, e->local_world_size);
    if (e->local_world_size > e->world_size)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_launch_env: %s=%d exceeds %s=%d", lsize_v, e->local_world_size,
                        size_v, e->world_size);

    /* the store's address */
    if ((s = env_int("MASTER_PORT", 1, 65535, &e->master_port, &set1))) return s;
    if (!set1 && e->world_size > 1)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "ts_launch_env: MASTER_PORT is not set (%s=%d ranks need the store's port; tsrun sets "
                        "it, under mpirun or srun export it, e->g. MASTER_PORT=29500)",
                        size_v, e->world_size);
    const char *addr = getenv("MASTER_ADDR");
    if (addr && *addr) {
        if ((s = env_str("MASTER_ADDR", e->master_addr, ""))) return s;
    } else if (e->world_size == 1 || e->local_world_size == e->world_size) {
        snprintf(e->master_addr, sizeof e->master_addr, "127.0.0.1");
    } else {
        bool found = false;
        const char *list_v = NULL;
        if (e->source == TS_LAUNCH_SOURCE_SLURM) {
            static const char *const lists[] = {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"};
            for (int i = 0; i < 3 && !list_v; i++)
                if (getenv(lists[i])) list_v = lists[i];
            if (list_v) found = slurm_first_host(getenv(list_v), e->master_addr, sizeof e->master_addr);
        }
        if (!found) {
            if (list_v)
                return ts_error(TS_ERR_INVALID_ARGUMENT,
                                "ts_launch_env: MASTER_ADDR is not set and %s='%s' is not a simple node list; "
                                "export MASTER_ADDR=<host of rank 0>",
                                list_v, getenv(list_v));
            return ts_error(TS_ERR_INVALID_ARGUMENT,
                            "ts_launch_env: MASTER_ADDR is not set and the ranks span several nodes "
                            "(%s=%d of %s=%d); export MASTER_ADDR=<host of rank 0>",
                            lsize_v, e->local_world_size, size_v, e->world_size);
        }
    }
    if ((s = env_str("TS_STORE_TOKEN", e->token, ""))) return s;
    if (getenv("TS_RUN_ID")) {
        if ((s = env_str("TS_RUN_ID", e->run_id, ""))) return s;
    } else if (e->source == TS_LAUNCH_SOURCE_SLURM && getenv("SLURM_JOB_ID")) {
        const char *step = getenv("SLURM_STEP_ID");
        snprintf(e->run_id, sizeof e->run_id, "slurm-%.100s%s%.100s", getenv("SLURM_JOB_ID"), step ? "." : "",
                 step ? step : "");
    }
    const char *hosted = getenv("TS_STORE_HOSTED");
    e->store_hosted = hosted && strcmp(hosted, "1") == 0;
    if ((s = env_int("TS_LAUNCHER_PID", 1, INT_MAX, &e->launcher_pid, &set1))) return s;
    const char *cap = getenv(TS_MEMORY_PER_RANK_ENV);
    if (cap && ts_launch_parse_size(cap, &e->memory_per_rank) != TS_OK)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "ts_launch_env: " TS_MEMORY_PER_RANK_ENV "='%.64s' is not a memory "
                        "size (bytes, or a number with a unit such as 1.5GiB)",
                        cap);
    return TS_OK;
}

ts_status ts_launch_env(ts_rank_env *env_out)
{
    if (!env_out) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_launch_env: env_out is NULL");
    ts_rank_env e;
    memset(&e, 0, sizeof e);
    ts_status s = parse_env(&e);
    if (!s) *env_out = e;
    return s;
}

/* ========================================================= memory sizes */

#define SIZE_MAX_BYTES ((int64_t)1 << 60)

ts_status ts_launch_parse_size(const char *text, int64_t *bytes_out)
{
    if (!text || !bytes_out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_launch_parse_size: %s is NULL", text ? "bytes_out" : "text");
    /* digits, an optional fraction, an optional space, an optional unit */
    const char *p = text;
    uint64_t whole = 0;
    int digits = 0;
    while (*p >= '0' && *p <= '9') {
        if (whole > (uint64_t)SIZE_MAX_BYTES) goto bad;
        whole = whole * 10 + (uint64_t)(*p++ - '0');
        digits++;
    }
    uint64_t frac = 0, frac_div = 1; /* up to 9 fractional digits; more are dropped */
    if (*p == '.') {
        p++;
        while (*p >= '0' && *p <= '9') {
            if (frac_div < 1000000000u) {
                frac = frac * 10 + (uint64_t)(*p - '0');
                frac_div *= 10;
            }
            p++;
            digits++;
        }
    }
    if (digits == 0) goto bad;
    if (*p == ' ') p++;
    static const char units[] = "bkmgtpe";
    int shift = 0;
    if (*p) {
        const char *u = strchr(units, *p >= 'A' && *p <= 'Z' ? *p - 'A' + 'a' : *p);
        if (!u || !*u) goto bad;
        shift = 10 * (int)(u - units);
        p++;
        if (shift > 0 && (*p == 'i' || *p == 'I')) p++;
        if (shift > 0 && (*p == 'b' || *p == 'B')) p++;
        if (*p) goto bad;
    }
    if (shift == 0 && frac != 0)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_launch_parse_size: '%.64s' is a fraction of a byte", text);
    if (shift > 0 && whole > ((uint64_t)SIZE_MAX_BYTES >> shift)) goto big;
    /* frac < 2^30: the fraction's bytes without overflow (past 2^30, to
     * within 2^(shift - 30) bytes) */
    int sh = shift < 30 ? shift : 30;
    uint64_t bytes = (whole << shift) + (((frac << sh) / frac_div) << (shift - sh));
    if (bytes > (uint64_t)SIZE_MAX_BYTES) goto big;
    if (bytes == 0)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "ts_launch_parse_size: '%.64s' is no memory at all (a size must be "
                        "at least one byte)",
                        text);
    *bytes_out = (int64_t)bytes;
    return TS_OK;
big:
    return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_launch_parse_size: '%.64s' is more than 1 EiB", text);
bad:
    return ts_error(TS_ERR_INVALID_ARGUMENT,
                    "ts_launch_parse_size: '%.64s' is not a memory size: give bytes (1073741824) or a number with a "
                    "binary unit K, M, G, T, P or E (1.5GiB, 800M, 2G)",
                    text);
}

ts_status ts_launch_format_size(int64_t bytes, char *buf, size_t cap)
{
    if (!buf || cap < 16 || bytes < 0 || bytes > SIZE_MAX_BYTES)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_launch_format_size: %s (bytes %lld)",
                        !buf           ? "buf is NULL"
                            : cap < 16 ? "cap is below 16"
                                       : "bytes is not in 0 .. 2^60",
                        (long long)bytes);
    static const char *const names[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
    int u = 0;
    double v = (double)bytes;
    while (u < 6 && v >= 1024.0) {
        v /= 1024.0;
        u++;
    }
    if (u == 0) {
        snprintf(buf, cap, "%lld B", (long long)bytes);
        return TS_OK;
    }
    /* three significant digits, trailing zeros dropped: 1.5 GiB, 64 MiB */
    int decimals = v < 10.0 ? 2 : v < 100.0 ? 1 : 0;
    char num[32];
    snprintf(num, sizeof num, "%.*f", decimals, v);
    if (strchr(num, '.')) {
        size_t n = strlen(num);
        while (num[n - 1] == '0') num[--n] = '\0';
        if (num[n - 1] == '.') num[--n] = '\0';
    }
    snprintf(buf, cap, "%s %s", num, names[u]);
    return TS_OK;
}

/* The link /proc/self/ns/<name> into out (n bytes), "?" if unreadable. */
static void ns_link(const char *name, char *out, size_t n)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/self/ns/%s", name);
    ssize_t k = readlink(path, out, n - 1);
    if (k <= 0) k = (ssize_t)snprintf(out, n, "?");
    out[k] = '\0';
}

void ts__host_parts(char *boot, size_t nb, char *pidns, size_t np, char *netns, size_t nn)
{
    snprintf(boot, nb, "?");
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "re");
    if (f) {
        if (!fgets(boot, (int)nb, f)) snprintf(boot, nb, "?");
        fclose(f);
        boot[strcspn(boot, "\n")] = '\0';
    }
    ns_link("pid", pidns, np);
    ns_link("net", netns, nn);
}

int ts__launch_env_world_size(void)
{
    ts_rank_env e;
    memset(&e, 0, sizeof e);
    ts__error_quiet_begin(); /* a probe: its failure is expected, the caller's error stays */
    parse_env(&e);
    ts__error_quiet_end();
    return e.world_size;
}

/* The parent of `pid` from /proc, or -1. */
static int parent_of(int pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return -1;
    buf[n] = '\0';
    const char *p = strrchr(buf, ')'); /* the command name may hold spaces and parentheses */
    char state;
    int ppid;
    if (!p || sscanf(p + 1, " %c %d", &state, &ppid) != 2) return -1;
    return ppid;
}

/* Live output (launch.h): stdout line-buffered in a launched rank, so
 * that its lines reach the launcher as they are printed and survive a
 * kill. Self-contained: a constructor and ts_launch_rank_guard call it. */
static void rank_stdout_line_buffered(void)
{
    const char *want = getenv("TS_LINE_BUFFERED");
    if (want && strcmp(want, "0") == 0) return;
    static const char *const rank_vars[] = {"TS_LAUNCHER_PID",      "RANK",        "WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                                            "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID"};
    bool rank = want && strcmp(want, "1") == 0;
    for (size_t i = 0; !rank && i < sizeof rank_vars / sizeof rank_vars[0]; i++) rank = getenv(rank_vars[i]) != NULL;
    if (!rank) return;
    /* glibc allows the change after output: pending bytes go out first */
    fflush(stdout);
    setvbuf(stdout, NULL, _IOLBF, 0);
}

/* Before main, and (a priority) before the program's own constructors
 * when it links the static library: lines printed before the program
 * calls into the library are live too. */
__attribute__((constructor(200))) static void rank_stdout_at_load(void) { rank_stdout_line_buffered(); }

ts_status ts_launch_rank_guard(void)
{
    rank_stdout_line_buffered();
    int lpid = 0;
    bool set;
    ts_status s = env_int("TS_LAUNCHER_PID", 1, INT_MAX, &lpid, &set);
    if (s) return s;
    if (!set) return TS_OK;
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0)
        return ts_error(TS_ERR_IO, "ts_launch_rank_guard: prctl(PR_SET_PDEATHSIG): %s", strerror(errno));
    /* checked after prctl: a launcher that died before it is seen here */
    int p = (int)getppid();
    if (p == lpid) return TS_OK;
    for (int depth = 0; p > 1 && depth < 64; depth++) {
        p = parent_of(p);
        if (p == lpid) return TS_OK;
    }
    return ts_error(TS_ERR_PEER_FAILED,
                    "ts_launch_rank_guard: the launcher (TS_LAUNCHER_PID=%d) is not an ancestor of this process "
                    "(parent %d): it has exited",
                    lpid, (int)getppid());
}
