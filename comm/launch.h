/*
 * tensorshard launcher library: what tools/tsrun does, callable from C (the
 * multi-rank tests start their ranks through it), and what a rank calls to
 * learn its place in the job. Modelled on torchrun (docs/design.md D8).
 *
 * Launcher side: ts_launch starts the ranks of one node, relays their
 * output line by line, stops them all when one fails, and reports how they
 * ended. Node 0's launcher hosts the rendezvous store (comm/store.h).
 *
 * Rank side: ts_launch_env reads the rank, world and store address from the
 * environment that tsrun, torchrun, mpirun (Open MPI) or srun (Slurm) set;
 * ts_launch_rank_guard makes a rank die with its launcher.
 *
 * Live output: in a rank, stdout is a pipe (tsrun, mpirun) or a file
 * (srun -o), which C buffers by blocks, so a rank's lines would show only
 * when 4 KiB have piled up or the rank exits, and be lost when it is killed
 * (Ctrl-C, a failed peer, a timeout). The library therefore makes stdout
 * line-buffered (setvbuf(stdout, NULL, _IOLBF, 0), after flushing what is
 * pending) in every process that has the variables ts_launch_env reads
 * (TS_LAUNCHER_PID, RANK or WORLD_SIZE, OMPI_COMM_WORLD_RANK or _SIZE,
 * SLURM_PROCID): once when the library is loaded (a constructor, before
 * main) and again in ts_launch_rank_guard, which ts_dist_init calls.
 * TS_LINE_BUFFERED=0 keeps the C default; TS_LINE_BUFFERED=1 asks for
 * line buffering in any process. stderr is unbuffered already. The
 * launcher relays each line as soon as it is whole (see ts_launch).
 *
 * Lifetime rules: ts_launch runs the ranks to completion and returns; it
 * owns nothing afterwards. Strings in the options are borrowed for the
 * call. ts_rank_env holds its strings inline: nothing to free.
 *
 * Threads: ts_launch runs a private libuv loop on the calling thread (the
 * store server runs in a thread of its own); call it from one thread at a
 * time. The ranks' parent-death signal is tied to the calling thread, so
 * that thread must live until ts_launch returns (it does: the call blocks).
 * ts_launch_env and ts_launch_rank_guard may be called from any thread.
 */
#ifndef TS_LAUNCH_H
#define TS_LAUNCH_H

#include "base/base.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------- launcher */

typedef struct ts_launch_options {
    int nproc_per_node;      /* ranks on this node, 1..4096 (default 1) */
    int nnodes;              /* default 1 */
    int node_rank;           /* 0..nnodes-1 (default 0) */
    const char *master_addr; /* node 0's address, where the store listens (default "127.0.0.1");
                              * a host name is resolved (IPv4) for binding, and passed to the
                              * ranks as given */
    int master_port;         /* 0 picks a free port (node 0 hosts the store; the ranks get the
                              * real port). nnodes > 1 needs a fixed port. */
    const char *run_id;      /* job id; default: generated (nnodes > 1: "tsrun-ADDR-PORT") */
    const char *token;       /* store token; default: generated per job. nnodes > 1 needs
                              * one, the same on every node. */
    double grace_s;          /* SIGTERM -> SIGKILL grace when stopping the ranks (default 3) */
    bool prefix_output;      /* "[r] " before every line of rank r (default true). Output is
                              * relayed a whole line at a time either way. */
    bool forward_signals;    /* catch SIGINT, SIGTERM and SIGHUP while running and forward them
                              * to the ranks (default true). libuv resets their disposition to
                              * the default when ts_launch returns. */
    int out_fd, err_fd;      /* where the ranks' stdout and stderr go (default 1, 2) */
    const char *log_dir;     /* also copy each rank's output to log_dir/rank<R>.log (default
                              * NULL: no files); see ts_launch */
    int64_t memory_per_rank; /* bytes: each rank runs in a memory cgroup of its own with this
                              * limit and no swap (default 0: no cap); see "Memory caps" at
                              * ts_launch. 1 MiB .. 1 EiB (2^60). */
} ts_launch_options;

TS_API ts_launch_options ts_launch_options_default(void);

typedef struct ts_launch_result {
    int exit_code;            /* 0 if every rank exited 0; else the first failure's code (128 + signal
                          * when killed); 128 + received_signal when the launcher was told to
                          * stop before any rank failed */
    int failed_rank;          /* global rank of the first failure, -1 if none */
    int failed_signal;        /* signal that killed it, 0 if it exited */
    int received_signal;      /* SIGINT/SIGTERM/SIGHUP the launcher caught and forwarded, 0 if none */
    int master_port;          /* the store's port (the one picked when master_port was 0) */
    int hung_rank;            /* the rank the others' deadlines found had never entered a collective
                          * (TS_LAUNCH_HUNG_KEY; node 0 only), -1 if none: the cause of the
                          * failure, whichever rank exited first */
    char hung_collective[64]; /* that collective ("all_reduce #5"), "" if none */
    int oom_rank;             /* with memory_per_rank: the global rank whose failure was the kernel's OOM
                          * killer in its group (the first failure), -1 if none */
    int64_t oom_peak_bytes;   /* that group's peak usage in bytes, -1 when the kernel does not say */
    char oom_message[256];    /* "rank 3 exceeded --memory-per-rank 1.5 GiB (killed by the kernel's OOM
                             * killer; peak 1.5 GiB)", "" if none: what tsrun prints after "tsrun: " */
} ts_launch_result;

/* Starts the ranks of this node running argv[0] (searched in PATH) with argv
 * (NULL-terminated), each in a process group of its own, and waits for
 * them. Each rank's environment is the caller's, minus any earlier launcher
 * variables, plus:
 *   RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
 *   GROUP_RANK (node_rank), GROUP_WORLD_SIZE (nnodes), TS_STORE_TOKEN,
 *   TS_RUN_ID, TS_STORE_HOSTED=1, TS_LAUNCHER_PID (the caller's pid),
 *   TS_MEMORY_PER_RANK (bytes, when memory_per_rank is set);
 *   unless already set: UCX_TLS=posix,cma,self (",tcp" added when nnodes > 1),
 *   UCX_MM_ERROR_HANDLING=y, UCX_KEEPALIVE_INTERVAL=1s,
 *   UCX_WARN_UNUSED_ENV_VARS=n, and BLIS_NUM_THREADS and TS_NUM_THREADS =
 *   max(1, cores / nproc_per_node).
 * Global rank = node_rank * nproc_per_node + local rank. Node 0 hosts the
 * store (ts_store_server_start on master_addr:master_port with the token)
 * for the duration of the call. The ranks' stdin is /dev/null. The caller
 * must not reap children it did not start (waitpid(-1, ...)) meanwhile.
 *
 * Output: every line a rank writes to stdout (stderr) goes to out_fd
 * (err_fd) as "[r] line\n" in one write(), so lines of different ranks never
 * mix; a last line without a newline gets one at end of file; lines longer
 * than 64 KiB are split. A write error on out_fd/err_fd (a closed pipe)
 * drops the output and never kills the launcher. Lines are relayed as they
 * arrive, never held until a rank exits; a rank's stdout must be
 * line-buffered for its lines to arrive one by one (the library does it:
 * see "Live output" above).
 *
 * Log files (log_dir set, as torchrun's --log-dir with --tee): the
 * directory is created (with its parents) if missing, and every rank R of
 * this node (R its global rank) gets log_dir/rank<R>.log, created or
 * truncated before any rank starts, holding that rank's stdout and stderr
 * lines in the order they are relayed, without the "[r] " prefix; the
 * output still goes to out_fd/err_fd as well. Unlike torchrun's
 * <dir>/<run id>/attempt_0/<local rank>/{stdout,stderr}.log, the layout is
 * flat: one file per rank, a rerun overwrites it. A symbolic link in place
 * of a log file is refused (O_NOFOLLOW). A write error on a log file stops
 * that file (one warning on err_fd), not the job.
 *
 * Exits in the store: node 0 records the exit of each of its ranks (any
 * status, as soon as it is reaped) in the store it hosts: it adds one to
 * the counter TS_LAUNCH_EXITS_KEY and sets TS_LAUNCH_EXIT_KEY (the run id
 * and that ticket n) to "<rank> <exit status> <signal> <pid>" (signal 0
 * when it exited). A rendezvous (ts_dist_init) that still waits for that
 * rank fails at once on every rank, naming it, rather than at its
 * deadline. Known limit: the launchers of other nodes host no store and
 * record nothing, so there only the deadline (or the failure of a rank
 * that exits non-zero, which stops the job) ends the wait.
 *
 * Ending: when a rank exits non-zero or is killed, every other rank's
 * process group gets SIGTERM, then SIGKILL after grace_s. When a rank
 * exits, its process group gets SIGKILL (leftover children would hold its
 * output pipe). A signal the launcher catches is forwarded to every rank's
 * group (SIGKILL after grace_s; a second SIGINT/SIGTERM kills at once).
 * Should the launcher itself die without cleaning up (SIGKILL, a crash), a
 * watchdog process it forked at the start SIGKILLs every rank's group, so
 * ranks and their children never outlive it (ts_launch_rank_guard is a
 * second line of defence inside the ranks).
 * Pipes still held open by processes outside the groups (a grandchild that
 * called setsid) are abandoned max(grace_s, 1 s) after the last rank exited.
 *
 * Memory caps (memory_per_rank > 0, tsrun --memory-per-rank): before any
 * rank starts, the launcher creates a memory cgroup per rank of this node,
 * <own>/tensorshard-<launcher pid>/rank<R> under the directory of its own
 * group in the memory hierarchy: cgroup v2's memory.max = the cap and
 * memory.swap.max = 0 where the v2 hierarchy has the memory controller in
 * the launcher's group (it enables it in cgroup.subtree_control); else
 * cgroup v1's memory.limit_in_bytes = the cap and
 * memory.memsw.limit_in_bytes = the cap (or memory.swappiness = 0 where
 * swap is not accounted). Each rank is born in its group (the launcher
 * moves its forking thread, on v2 itself, into the group for the fork),
 * its children with it, and the groups are removed once the ranks have
 * been reaped (processes left in one are killed first), on every path out
 * of ts_launch, and by the watchdog should the launcher die. The ranks
 * get TS_MEMORY_PER_RANK=<bytes> (see ts_rank_env). A rank that fails
 * with the OOM killer's kill counted in its group (v2 memory.events
 * oom_kill, v1 memory.oom_control oom_kill; on kernels without that
 * counter, SIGKILL with memory.failcnt > 0) is reported in
 * ts_launch_result.oom_rank (tsrun prints "tsrun: rank R exceeded
 * --memory-per-rank 1.5 GiB (killed by the kernel's OOM killer; peak
 * 1.5 GiB)"). On node 0 the launcher also tells the other ranks: it posts
 * a failure notice, "rank R exceeded --memory-per-rank ... (killed by the
 * kernel's OOM killer ...)", to the world the ranks last formed
 * (TS_LAUNCH_WORLD_KEY), whose watch threads (ts_dist_init) fail every
 * collective with TS_ERR_PEER_FAILED and that message; it then gives
 * them grace_s to fail and exit by themselves before the SIGTERM (with
 * grace_s 0, or when no world has met, the SIGTERM follows at once).
 * Known limits: the launchers of other nodes post no notice (their ranks'
 * peers find the death over the transport); a rank killed before the
 * rendezvous completes is named by the others' rendezvous as a rank that
 * exited, not as over the cap.
 * Where no group can be made (no memory controller, a read-only cgroupfs,
 * no permission) ts_launch fails before starting anything, naming the
 * path and the errno.
 *
 * Returns TS_OK when the job ran (whatever its ranks' exit codes: see
 * *result_out, written only on TS_OK), TS_ERR_INVALID_ARGUMENT for bad
 * options (the detail names the option), TS_ERR_UNSUPPORTED when
 * memory_per_rank is set and no memory cgroup controller is there,
 * TS_ERR_IO when a memory cgroup cannot be created or written, when the store cannot
 * listen, log_dir or a log file cannot be created (the detail names the
 * path and the system error; no rank has started then) or a rank cannot be
 * started (the detail names the program and the system error; ranks
 * started already are killed and reaped first). */
TS_API ts_status ts_launch(const ts_launch_options *o, char *const *argv, ts_launch_result *result_out);

/* ---------------------------------------------------------------- ranks */

typedef enum ts_launch_source {
    TS_LAUNCH_SOURCE_TSRUN = 1, /* RANK, WORLD_SIZE, ... (tsrun, torchrun, or set by hand) */
    TS_LAUNCH_SOURCE_OMPI,      /* OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE (mpirun) */
    TS_LAUNCH_SOURCE_SLURM      /* SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, ... (srun) */
} ts_launch_source;

/* "tsrun", "ompi", "slurm"; "unknown" otherwise. Static string. */
TS_API const char *ts_launch_source_name(ts_launch_source s);

#define TS_LAUNCH_MAX_STR 256
/* The store keys of the ranks' exits (see ts_launch): printf formats of
 * the run id, and of the run id and the ticket (long long). */
#define TS_LAUNCH_EXITS_KEY "tsrun/%s/exits"
#define TS_LAUNCH_EXIT_KEY "tsrun/%s/exit/%lld"
/* The key (printf format of the run id) where the first rank whose
 * collective passed its deadline records the rank that never entered it,
 * as "<rank> <collective>" ("2 all_reduce #5"); ts_launch reads it into
 * ts_launch_result.hung_rank. */
#define TS_LAUNCH_HUNG_KEY "tsrun/%s/hung"
/* The key (printf format of the run id) where every rank, once the
 * rendezvous of ts_dist_init has met, records "<world size> <store
 * prefix of that world>", so that the launcher can post a failure notice
 * to the ranks' watch (the OOM report of "Memory caps" at ts_launch). */
#define TS_LAUNCH_WORLD_KEY "tsrun/%s/world"

/* The variable through which ts_launch gives each rank its memory cap
 * (memory_per_rank) in bytes; read by ts_launch_env. */
#define TS_MEMORY_PER_RANK_ENV "TS_MEMORY_PER_RANK"

/* Parses a memory size: a whole number of bytes ("1073741824", "512B"),
 * or a number, possibly with a fraction, and a binary unit K, M, G, T, P
 * or E (also spelled KiB, KB, k...: case-insensitive, all powers of 1024,
 * as Docker's and Slurm's sizes), optionally separated by a space: "1.5GiB",
 * "800M", "2G", "64 MiB". A fractional result is rounded down to a whole
 * byte. Returns TS_OK and *bytes_out; TS_ERR_INVALID_ARGUMENT (text or
 * bytes_out NULL, no number, an unknown unit, a negative or zero size, a
 * fraction of a byte, or more than 1 EiB = 2^60 bytes), the detail naming
 * the text.
 * Any thread. */
TS_API ts_status ts_launch_parse_size(const char *text, int64_t *bytes_out);

/* Writes `bytes` (0 .. 2^60) into buf as tsrun's messages show it: at
 * most three significant digits in the largest binary unit it fills
 * ("1.5 GiB", "64 MiB", "800 B"). Returns TS_OK; TS_ERR_INVALID_ARGUMENT
 * when buf is NULL, cap < 16 or bytes is out of range. Any thread. */
TS_API ts_status ts_launch_format_size(int64_t bytes, char *buf, size_t cap);

typedef struct ts_rank_env {
    ts_launch_source source;
    int rank, world_size;                /* 0 <= rank < world_size */
    int local_rank, local_world_size;    /* 0 <= local_rank < local_world_size <= world_size */
    char master_addr[TS_LAUNCH_MAX_STR]; /* where the store listens */
    int master_port;                     /* 1..65535; 0 only for world_size 1 without MASTER_PORT */
    char token[TS_LAUNCH_MAX_STR];       /* TS_STORE_TOKEN; "" when unset (then rank 0's store serves only
                                       * this user's processes on its host: see below) */
    char run_id[TS_LAUNCH_MAX_STR];      /* TS_RUN_ID; else "slurm-JOB.STEP" under Slurm; else "" */
    bool store_hosted;                   /* true: a launcher hosts the store (TS_STORE_HOSTED=1);
                                       * false: rank 0 must host it on master_addr:master_port */
    int launcher_pid;                    /* TS_LAUNCHER_PID, 0 when unset */
    int64_t memory_per_rank;             /* TS_MEMORY_PER_RANK: the cap this rank runs under in bytes
                                       * (tsrun --memory-per-rank; a size as ts_launch_parse_size
                                       * reads it), 0 when unset */
} ts_rank_env;

/* Reads this process's place in the job from the environment. The first
 * source present wins:
 *   1. RANK (tsrun, torchrun): RANK and WORLD_SIZE, and LOCAL_RANK with
 *      LOCAL_WORLD_SIZE (both or neither; neither means one node:
 *      local = global).
 *   2. OMPI_COMM_WORLD_RANK (mpirun): OMPI_COMM_WORLD_RANK, _SIZE,
 *      _LOCAL_RANK and _LOCAL_SIZE.
 *   3. SLURM_PROCID (srun): SLURM_PROCID, SLURM_NTASKS (or SLURM_NPROCS),
 *      SLURM_LOCALID, and this node's task count from
 *      SLURM_STEP_TASKS_PER_NODE, SLURM_TASKS_PER_NODE or
 *      SLURM_NTASKS_PER_NODE (the first set; a list such as "2(x3),1" is
 *      indexed by SLURM_NODEID).
 * The store's address, in every case:
 *   MASTER_PORT is required when world_size > 1 (tsrun and torchrun set
 *   it; under mpirun or srun, export it: `mpirun -x MASTER_PORT=29500`).
 *   MASTER_ADDR when set is used as is. When unset: "127.0.0.1" if every
 *   rank is on this node (local_world_size == world_size) or world_size is
 *   1; else, under Slurm, the first host of SLURM_STEP_NODELIST,
 *   SLURM_JOB_NODELIST or SLURM_NODELIST (where task 0 runs unless
 *   --distribution=arbitrary) if that list is simple ("n1,n2" or one
 *   bracket group, "node[03-07,9]" -> "node03"); otherwise an error.
 *   Under mpirun or srun no launcher hosts the store: rank 0 does
 *   (store_hosted false).
 * Store security without a launcher: tsrun gives every job a random
 * token; mpirun and srun give none. Without TS_STORE_TOKEN, rank 0's
 * store serves only processes of its own user on its own host
 * (ts_store_server_start), so no other user can read the ranks' addresses
 * or stall the rendezvous; ts_dist_init refuses a job whose ranks span
 * several hosts without a token, on every rank, saying how to set one
 * (the same secret on every rank: `mpirun -x TS_STORE_TOKEN`, or export
 * it before srun).
 * Any source: TS_MEMORY_PER_RANK, when set, is the cap the rank runs
 * under (memory_per_rank), read by ts_launch_parse_size.
 * Returns TS_OK and writes *env_out; TS_ERR_NOT_FOUND when no source is present
 * (a process started alone: the caller may run as world 1);
 * TS_ERR_INVALID_ARGUMENT when a value is missing, not a number, out of
 * range or inconsistent, with a detail naming the variables and values. */
TS_API ts_status ts_launch_env(ts_rank_env *env_out);

/* First, in any process with launcher variables (see "Live output" at the
 * top), makes stdout line-buffered. Then, for a rank started by tsrun or
 * ts_launch (TS_LAUNCHER_PID set): asks the
 * kernel to SIGKILL this process when its parent dies
 * (prctl(PR_SET_PDEATHSIG)), then checks that the launcher is still there:
 * it must be the parent or, when a wrapper (a shell) sits between them, an
 * ancestor (the signal then follows the wrapper's death, not the
 * launcher's). Call it first thing in main(). Returns TS_OK (also when
 * TS_LAUNCHER_PID is unset: nothing to guard), TS_ERR_PEER_FAILED when the
 * launcher is gone already (the caller should exit), TS_ERR_INVALID_ARGUMENT
 * when TS_LAUNCHER_PID is not a pid, TS_ERR_IO when prctl fails. */
TS_API ts_status ts_launch_rank_guard(void);

#ifdef __cplusplus
}
#endif
#endif /* TS_LAUNCH_H */
