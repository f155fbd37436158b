/*
 * tsrun: starts the ranks of a tensorshard job on this node (DESIGN.md D8).
 * Flags modelled on torchrun; the work is done by ts_launch (comm/launch.h).
 *
 *   tsrun --nproc-per-node 4 ./train --steps 100
 *
 * Exit status: 0 when every rank exited 0; the first failed rank's status
 * (128 + signal when it was killed); 128 + signal when tsrun itself was
 * told to stop; 2 for bad flags; 1 when the job could not start.
 */
#define _GNU_SOURCE
#include "comm/launch.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
          "  --nproc-per-node N  ranks on this node (default 1)\n"
          "  --nnodes N          nodes in the job (default 1)\n"
          "  --node-rank R       this node's index, 0..nnodes-1 (default 0)\n"
          "  --master-addr HOST  node 0's address, where the store listens (default 127.0.0.1)\n"
          "  --master-port PORT  the store's port; 0 picks a free one (default 0;\n"
          "                      several nodes need a fixed port)\n"
          "  --run-id ID         job id (default: generated)\n"
          "  --token T           store token (default: generated; several nodes need\n"
          "                      the same token on every node)\n"
          "  --grace S           seconds between SIGTERM and SIGKILL when stopping\n"
          "                      ranks (default 3)\n"
          "  --no-prefix         do not prefix output lines with \"[R] \"\n"
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
    if (!s || !*s || *s == ' ')
        return false;
    long v = strtol(s, &end, 10);
    if (*end || errno || v < lo || v > hi)
        return false;
    *out = (int)v;
    return true;
}

static const char *signame(int sig)
{
    static char buf[32];
    const char *a = sigabbrev_np(sig);
    if (a)
        snprintf(buf, sizeof buf, "SIG%s", a);
    else
        snprintf(buf, sizeof buf, "signal %d", sig);
    return buf;
}

int main(int argc, char **argv)
{
    /* TS_TRACE is the ranks' (each writes its own file): the launcher
     * records none and leaves no file of its own (base/base.h) */
    ts_trace_stop(false);
    ts_launch_options o = ts_launch_options_default();
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
        if (arg[0] != '-' || arg[1] == '\0')
            break; /* the program */
        if (arg[1] != '-')
            return bad("unknown option '%s'%s", arg, "");
        /* --name, --name=value or --name value; '_' spelled as '-' */
        char name[64];
        const char *eq = strchr(arg, '=');
        size_t nlen = eq ? (size_t)(eq - arg) : strlen(arg);
        if (nlen >= sizeof name)
            return bad("unknown option '%s'%s", arg, "");
        for (size_t k = 0; k < nlen; k++)
            name[k] = arg[k] == '_' ? '-' : arg[k];
        name[nlen] = '\0';
        if (strcmp(name, "--no-prefix") == 0) {
            if (eq)
                return bad("option '%s' takes no value%s", name, "");
            o.prefix_output = false;
            continue;
        }
        static const char *const valued[] = {"--nproc-per-node", "--nnodes", "--node-rank", "--master-addr",
                                             "--master-port", "--run-id", "--token", "--grace"};
        int which = -1;
        for (int k = 0; k < 8; k++)
            if (strcmp(name, valued[k]) == 0)
                which = k;
        if (which < 0)
            return bad("unknown option '%s'%s", arg, "");
        const char *val;
        if (eq) {
            val = eq + 1;
        } else {
            if (i + 1 >= argc)
                return bad("option '%s' needs a value%s", name, "");
            val = argv[++i];
        }
        bool ok = true;
        switch (which) {
        case 0: ok = parse_int(val, 1, 4096, &o.nproc_per_node); break;
        case 1: ok = parse_int(val, 1, 65536, &o.nnodes); break;
        case 2: ok = parse_int(val, 0, 65535, &o.node_rank); break;
        case 3: o.master_addr = val; ok = *val != '\0'; break;
        case 4: ok = parse_int(val, 0, 65535, &o.master_port); break;
        case 5: o.run_id = val; ok = *val != '\0'; break;
        case 6: o.token = val; ok = *val != '\0'; break;
        case 7: {
            char *end;
            errno = 0;
            double g = strtod(val, &end);
            ok = *val && !*end && !errno && g >= 0.0 && g <= 86400.0;
            o.grace_s = g;
            break;
        }
        }
        if (!ok)
            return bad("bad value for %s: '%s'", name, val);
    }
    if (i >= argc)
        return bad("no program to run%s%s", "", "");
    if (o.node_rank >= o.nnodes)
        return bad("--node-rank must be below --nnodes%s%s", "", "");
    if (o.nnodes > 1 && o.master_port == 0)
        return bad("--nnodes > 1 needs a fixed --master-port%s%s", "", "");
    if (o.nnodes > 1 && !o.token)
        return bad("--nnodes > 1 needs --token, the same on every node%s%s", "", "");

    /* a closed stderr must not kill tsrun (the ranks get default dispositions) */
    signal(SIGPIPE, SIG_IGN);
    ts_launch_result res;
    ts_status s = ts_launch(&o, argv + i, &res);
    if (s != TS_OK) {
        fprintf(stderr, "tsrun: %s\n", ts_last_error());
        return s == TS_ERR_INVALID_ARGUMENT ? 2 : 1;
    }
    if (res.failed_rank >= 0) {
        if (res.failed_signal)
            fprintf(stderr, "tsrun: rank %d killed by signal %s\n", res.failed_rank, signame(res.failed_signal));
        else
            fprintf(stderr, "tsrun: rank %d exited with status %d\n", res.failed_rank, res.exit_code);
    } else if (res.received_signal) {
        fprintf(stderr, "tsrun: received %s; stopped the ranks\n", signame(res.received_signal));
    }
    return res.exit_code;
}
