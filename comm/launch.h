/*
 * tensorshard launcher library: what tools/tsrun does, callable from C (the
 * multi-rank tests start their ranks through it). Modelled on torchrun.
 *
 * Lifetime rules: ts_launch runs the ranks to completion and returns; it
 * owns nothing afterwards. Strings in the options are borrowed for the
 * call.
 */
#ifndef TS_LAUNCH_H
#define TS_LAUNCH_H

#include "base/base.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ts_launch_options {
    int nproc_per_node;      /* ranks on this node (default 1) */
    int nnodes;              /* default 1 */
    int node_rank;           /* default 0 */
    const char *master_addr; /* default "127.0.0.1" */
    int master_port;         /* 0 picks a free port (node 0 hosts the store) */
    const char *run_id;      /* job id; default: generated */
    const char *token;       /* store token; default: generated per job */
    double grace_s;          /* SIGTERM -> SIGKILL grace after a failure (default 3) */
    bool prefix_output;      /* "[r] " before every line of rank r (default true) */
    int out_fd, err_fd;      /* where the prefixed output goes (default 1, 2) */
} ts_launch_options;

TS_API ts_launch_options ts_launch_options_default(void);

typedef struct ts_launch_result {
    int exit_code;    /* 0 if every rank exited 0; else the first failure's code (128 + signal when killed) */
    int failed_rank;  /* global rank of the first failure, -1 if none */
    int failed_signal;/* signal that killed it, 0 if it exited */
} ts_launch_result;

/* Starts the ranks of this node running argv[0] with argv (NULL-terminated)
 * with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
 * MASTER_PORT, TS_STORE_TOKEN, TS_RUN_ID and the UCX settings the
 * deps guide found necessary (unless the caller's environment sets them),
 * waits for them, and reports how they ended. If a rank fails, the others
 * are stopped (whole process groups: SIGTERM, then SIGKILL after grace_s).
 * SIGINT/SIGTERM to the caller are forwarded. Returns TS_OK when the job
 * ran (whatever its ranks' exit codes: see result), TS_ERR_INVALID_ARGUMENT
 * for bad options, TS_ERR_IO when a rank cannot be started. */
TS_API ts_status ts_launch(const ts_launch_options *o, char *const *argv, ts_launch_result *result_out);

#ifdef __cplusplus
}
#endif
#endif /* TS_LAUNCH_H */
