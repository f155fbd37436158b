/*
 * tsrun: starts the ranks of a tensorshard job on this node (docs/design.md D8).
 * Flags modelled on torchrun; the work is done by ts_launch (comm/launch.h).
 *
 *   tsrun --nproc-per-node 4 ./train --steps 100
 *
 * Exit status: 0 when every rank exited 0; the first failed rank's status
 * (128 + signal when it was killed); 128 + signal when tsrun itself was
 * told to stop; 2 for bad flags; 1 when the job could not start (also
 * when --memory-per-rank finds no memory cgroup it may write).
 *
 * The last stderr line names the cause: a rank's exit or signal, a rank
 * the others found hung, or a rank over its --memory-per-rank cap
 * ("tsrun: rank 3 exceeded --memory-per-rank 1.5 GiB (killed by the
 * kernel's OOM killer; peak 1.5 GiB)"; docs/memory-caps.md).
 */
#define _GNU_SOURCE
#include "comm/launch.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#ifndef TS_VERSION
#error "TS_VERSION must be the project's version (tools/meson.build defines it)"
#endif

static void usage(FILE *f)
{
    fputs("usage: tsrun [options] PROGRAM [ARGS...]\n"
          "\n"
          "Starts PROGRAM as the ranks of this node with RANK, WORLD_SIZE, LOCAL_RANK,\n"
          "LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TS_STORE_TOKEN, TS_RUN_ID set;\n"
          "node 0 hosts the rendezvous store. Every output line of rank R is written\n"
          "as \"[R] line\". When a rank fails, the others are stopped.\n"
          "\n"
          "options (also as --flag=value; '_' may replace '-'):\n"
          "  --nproc-per-node N  ranks on this node (default 1); 'auto' (or 'cpu'):\n"
          "                      one per core this process may run on\n"
          "  --standalone        one node on 127.0.0.1 with a free port (as torchrun;\n"
          "                      --master-addr and --master-port are then ignored)\n"
          "  --nnodes N          nodes in the job (default 1)\n"
          "  --node-rank R       this node's index, 0..nnodes-1 (default 0)\n"
          "  --master-addr HOST  node 0's address, where the store listens (default 127.0.0.1)\n"
          "  --master-port PORT  the store's port; 0 picks a free one (default 0;\n"
          "                      several nodes need a fixed port)\n"
          "  --run-id ID         job id (default: generated)\n"
          "  --token-file F      read the store token from file F (one line)\n"
          "                      (default: $TS_STORE_TOKEN, else generated; several\n"
          "                      nodes need the same token on every node). There is\n"
          "                      no --token: a command line is visible to all in ps.\n"
          "  --log-dir DIR       also write each rank's output to DIR/rank<R>.log\n"
          "                      (created; R the global rank; stdout and stderr)\n"
          "  --grace S           seconds between SIGTERM and SIGKILL when stopping\n"
          "                      ranks (default 3)\n"
          "  --memory-per-rank SIZE  run each rank in a memory cgroup of its own\n"
          "                      limited to SIZE, without swap (bytes, or a binary\n"
          "                      unit: 1.5GiB, 800M, 2G); the ranks get\n"
          "                      TS_MEMORY_PER_RANK=<bytes>. Needs a writable memory\n"
          "                      cgroup (cgroup v2 or v1; root); a rank the kernel's\n"
          "                      OOM killer ends is reported as over the cap\n"
          "  --no-prefix         do not prefix output lines with \"[R] \"\n"
          "  --version           print the version and exit\n"
          "  -h, --help          this text\n"
          "\n"
          "exit status: 0 if every rank exited 0, else the first failed rank's status\n"
          "(128+signal if it was killed), 128+signal if tsrun was interrupted, 2 for\n"
          "bad flags, 1 if the job could not start.\n",
          f);
}

static int bad(const char *fmt, const char *a, const char *b)
{
    fputs("tsrun: ", stderr);
    fprintf(stderr, fmt, a, b);
    fputs("\ntry 'tsrun --help'\n", stderr);
    return 2;
}

static bool parse_int(const char *s, long lo, long hi, int *out)
{
    char *end;
    errno = 0;
    if (!s || !*s || *s == ' ') return false;
    long v = strtol(s, &end, 10);
    if (*end || errno || v < lo || v > hi) return false;
    *out = (int)v;
    return true;
}

/* One rank per core this process may run on (its affinity mask). */
static int cores(void)
{
    int n = ts_cpu_count();
    return n > 4096 ? 4096 : n;
}

/* The token: the file's one line (a trailing newline dropped). Returns
 * NULL after a message on stderr. O_NONBLOCK: a FIFO must not block the
 * open until a writer comes (it is refused as not a regular file). */
static const char *read_token_file(const char *path, char *buf, size_t cap)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        fprintf(stderr, "tsrun: cannot read the token file '%s': %s\n", path, strerror(errno));
        if (fd >= 0) close(fd);
        return NULL;
    }
    if (!S_ISREG(st.st_mode)) {
        fprintf(stderr, "tsrun: the token file '%s' is not a regular file\n", path);
        close(fd);
        return NULL;
    }
    size_t got = 0;
    for (;;) {
        ssize_t r = read(fd, buf + got, cap - 1 - got);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            fprintf(stderr, "tsrun: cannot read the token file '%s': %s\n", path, strerror(errno));
            close(fd);
            return NULL;
        }
        got += (size_t)r;
        if (r == 0 || got == cap - 1) break;
    }
    close(fd);
    buf[got] = '\0';
    if (got > 0 && buf[got - 1] == '\n') buf[--got] = '\0';
    if (got > 0 && buf[got - 1] == '\r') buf[--got] = '\0';
    if (got == 0 || got >= TS_LAUNCH_MAX_STR || strpbrk(buf, "\r\n") || strlen(buf) != got) {
        fprintf(stderr,
                "tsrun: the token file '%s' must hold one line of 1..%d bytes (a trailing newline "
                "is dropped)\n",
                path, TS_LAUNCH_MAX_STR - 1);
        return NULL;
    }
    if (st.st_mode & (S_IRGRP | S_IROTH))
        fprintf(stderr,
                "tsrun: warning: the token file '%s' is readable by other users (mode %04o); "
                "chmod 600 it\n",
                path, (unsigned)(st.st_mode & 07777));
    return buf;
}

static const char *signame(int sig)
{
    static char buf[32];
    const char *a = sigabbrev_np(sig);
    if (a) snprintf(buf, sizeof buf, "SIG%s", a);
    else snprintf(buf, sizeof buf, "signal %d", sig);
    return buf;
}

/* TS_TRACE is the ranks' (each writes its own file): the launcher records
 * none, leaves no file and says nothing about it (base/trace.c reads this
 * before main). */
extern const int ts__trace_env_ignored;
const int ts__trace_env_ignored = 1;

int main(int argc, char **argv)
{
    ts_launch_options o = ts_launch_options_default();
    bool standalone = false, addr_set = false, port_set = false, nnodes_set = false, node_rank_set = false;
    const char *token_file = NULL;
    int i = 1;
    for (; i < argc; i++) {
        const char *arg = argv[i];
        if (strcmp(arg, "--") == 0) {
            i++;
            break;
        }
        if (strcmp(arg, "-h") == 0 || strcmp(arg, "--help") == 0) {
            usage(stdout);
            return 0;
        }
        if (arg[0] != '-' || arg[1] == '\0') break; /* the program */
        if (arg[1] != '-') return bad("unknown option '%s'%s", arg, "");
        /* --name, --name=value or --name value; '_' spelled as '-' */
        char name[64];
        const char *eq = strchr(arg, '=');
        size_t nlen = eq ? (size_t)(eq - arg) : strlen(arg);
        if (nlen >= sizeof name) return bad("unknown option '%s'%s", arg, "");
        for (size_t k = 0; k < nlen; k++) name[k] = arg[k] == '_' ? '-' : arg[k];
        name[nlen] = '\0';
        if (strcmp(name, "--no-prefix") == 0 || strcmp(name, "--standalone") == 0 || strcmp(name, "--version") == 0) {
            if (eq) return bad("option '%s' takes no value%s", name, "");
            if (strcmp(name, "--version") == 0) {
                printf("tsrun (tensorshard) %s\n", TS_VERSION);
                return 0;
            }
            if (strcmp(name, "--standalone") == 0) standalone = true;
            else o.prefix_output = false;
            continue;
        }
        if (strcmp(name, "--token") == 0) /* the value is not echoed: it is a secret */
            return bad("--token is not accepted: a command line is visible to every user in ps; set "
                       "TS_STORE_TOKEN in tsrun's environment or use --token-file FILE%s%s",
                       "", "");
        static const char *const valued[] = {"--nproc-per-node", "--nnodes",         "--node-rank",  "--master-addr",
                                             "--master-port",    "--run-id",         "--token-file", "--grace",
                                             "--log-dir",        "--memory-per-rank"};
        int which = -1;
        for (int k = 0; k < (int)(sizeof valued / sizeof valued[0]); k++)
            if (strcmp(name, valued[k]) == 0) which = k;
        if (which < 0) return bad("unknown option '%s'%s", arg, "");
        const char *val;
        if (eq) {
            val = eq + 1;
        } else {
            if (i + 1 >= argc) return bad("option '%s' needs a value%s", name, "");
            val = argv[++i];
        }
        bool ok = true;
        switch (which) {
        case 0:
            if (strcmp(val, "auto") == 0 || strcmp(val, "cpu") == 0) o.nproc_per_node = cores();
            else ok = parse_int(val, 1, 4096, &o.nproc_per_node);
            break;
        case 1:
            ok = parse_int(val, 1, 65536, &o.nnodes);
            nnodes_set = true;
            break;
        case 2:
            ok = parse_int(val, 0, 65535, &o.node_rank);
            node_rank_set = true;
            break;
        case 3:
            o.master_addr = val;
            ok = *val != '\0';
            addr_set = true;
            break;
        case 4:
            ok = parse_int(val, 0, 65535, &o.master_port);
            port_set = true;
            break;
        case 5:
            o.run_id = val;
            ok = *val != '\0';
            break;
        case 6:
            token_file = val;
            ok = *val != '\0';
            break;
        case 8:
            o.log_dir = val;
            ok = *val != '\0';
            break;
        case 9:
            if (ts_launch_parse_size(val, &o.memory_per_rank) != TS_OK)
                return bad("bad value for --memory-per-rank: '%s': %s", val,
                           "give bytes (1073741824) or a number with a binary unit K, M, G, T (1.5GiB, 800M, 2G)");
            if (o.memory_per_rank < ((int64_t)1 << 20))
                return bad("bad value for --memory-per-rank: '%s': %s", val,
                           "a cap below 1 MiB leaves no room to start a program");
            break;
        case 7: {
            char *end;
            errno = 0;
            double g = strtod(val, &end);
            ok = *val && !*end && !errno && g >= 0.0 && g <= 86400.0;
            o.grace_s = g;
            break;
        }
        }
        if (!ok) return bad("bad value for %s: '%s'", name, val);
    }
    if (i >= argc) return bad("no program to run%s%s", "", "");
    if (standalone) {
        if ((nnodes_set && o.nnodes != 1) || (node_rank_set && o.node_rank != 0))
            return bad("--standalone runs one node: it cannot go with --nnodes > 1 or --node-rank > 0%s%s", "", "");
        if (addr_set || port_set)
            fprintf(stderr,
                    "tsrun: --standalone: ignoring --master-addr and --master-port (the store listens "
                    "on 127.0.0.1, on a free port)\n");
        o.nnodes = 1;
        o.node_rank = 0;
        o.master_addr = "127.0.0.1";
        o.master_port = 0;
    }
    char token_buf[4096];
    if (token_file) {
        if (!(o.token = read_token_file(token_file, token_buf, sizeof token_buf))) return 2;
    } else if (getenv("TS_STORE_TOKEN") && *getenv("TS_STORE_TOKEN")) {
        o.token = getenv("TS_STORE_TOKEN");
    }
    if (o.node_rank >= o.nnodes) return bad("--node-rank must be below --nnodes%s%s", "", "");
    if (o.nnodes > 1 && o.master_port == 0) return bad("--nnodes > 1 needs a fixed --master-port%s%s", "", "");
    if (o.nnodes > 1 && !o.token)
        return bad("--nnodes > 1 needs a token, the same on every node: set TS_STORE_TOKEN or use "
                   "--token-file FILE%s%s",
                   "", "");

    /* A closed stderr must not kill tsrun, nor a --log-dir file that reaches
     * RLIMIT_FSIZE (the write then fails with EFBIG and is warned about);
     * uv_spawn gives the ranks default dispositions again. */
    signal(SIGPIPE, SIG_IGN);
    signal(SIGXFSZ, SIG_IGN);
    ts_launch_result res;
    ts_status s = ts_launch(&o, argv + i, &res);
    if (s != TS_OK) {
        fprintf(stderr, "tsrun: %s\n", ts_last_error());
        return s == TS_ERR_INVALID_ARGUMENT ? 2 : 1;
    }
    if (res.oom_rank >= 0) {
        fprintf(stderr, "tsrun: %s\n", res.oom_message);
    } else if (res.failed_rank >= 0 && res.hung_rank >= 0) {
        /* the ranks that exited timed out waiting for this one: it is the
         * cause, whichever of them exited first */
        fprintf(stderr,
                "tsrun: rank %d hung: it never entered %s, where the other ranks passed their deadline "
                "(exit status %d, that of the first to stop)\n",
                res.hung_rank, res.hung_collective[0] ? res.hung_collective : "a collective", res.exit_code);
    } else if (res.failed_rank >= 0) {
        if (res.failed_signal)
            fprintf(stderr, "tsrun: rank %d killed by signal %s\n", res.failed_rank, signame(res.failed_signal));
        else fprintf(stderr, "tsrun: rank %d exited with status %d\n", res.failed_rank, res.exit_code);
    } else if (res.received_signal) {
        fprintf(stderr, "tsrun: received %s; stopped the ranks\n", signame(res.received_signal));
    }
    return res.exit_code;
}
