/*
 * tensorshard base layer: status codes, last-error detail, allocator hook
 * with per-tag live-byte counters, logging, and a Chrome-trace span recorder.
 *
 * Lifetime rules: nothing in this header allocates memory that the caller
 * must free, except ts_trace_flush()'s file. Every function may be called
 * from any thread unless it says otherwise.
 */
#ifndef TS_BASE_H
#define TS_BASE_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(TS_BUILDING_LIBRARY)
#define TS_API __attribute__((visibility("default")))
#else
#define TS_API
#endif

#if defined(__GNUC__)
#define TS_PRINTF(f, a) __attribute__((format(printf, f, a)))
#else
#define TS_PRINTF(f, a)
#endif

/*
 * Status codes. OK is 0; every error is negative. One table makes the enum,
 * the names and the messages: X(name, value, message).
 */
#define TS_STATUS_TABLE(X) \
    X(TS_OK, 0, "success") \
    X(TS_ERR_INVALID_ARGUMENT, -1, "invalid argument") \
    X(TS_ERR_SHAPE, -2, "shape mismatch") \
    X(TS_ERR_DTYPE, -3, "dtype mismatch or unsupported dtype") \
    X(TS_ERR_INDEX, -4, "index or dimension out of range") \
    X(TS_ERR_NO_MEMORY, -5, "out of memory") \
    X(TS_ERR_NOT_VIEWABLE, -6, "view not possible on this layout") \
    X(TS_ERR_RELEASED, -7, "storage has been released") \
    X(TS_ERR_SHARDED, -8, "tensor is a shard; use the module or a local view") \
    X(TS_ERR_AUTOGRAD, -9, "autograd error") \
    X(TS_ERR_STATE, -10, "operation not valid in the current state") \
    X(TS_ERR_ALREADY, -11, "already done") \
    X(TS_ERR_IO, -12, "input/output error") \
    X(TS_ERR_FORMAT, -13, "malformed data") \
    X(TS_ERR_UNSUPPORTED, -14, "not supported") \
    X(TS_ERR_TIMEOUT, -15, "timed out") \
    X(TS_ERR_PEER_FAILED, -16, "a peer process failed") \
    X(TS_ERR_COMM, -17, "communication error") \
    X(TS_ERR_NOT_FOUND, -18, "not found") \
    X(TS_ERR_INTERNAL, -19, "internal error")

typedef enum ts_status {
#define TS__STATUS_ENUM(name, value, msg) name = value,
    TS_STATUS_TABLE(TS__STATUS_ENUM)
#undef TS__STATUS_ENUM
} ts_status;

/* Number of entries in TS_STATUS_TABLE (OK plus the errors). */
#define TS_STATUS_COUNT 20

/* The enum name of a status ("TS_ERR_SHAPE"); "TS_UNKNOWN_STATUS" if unknown.
 * The string is static. */
TS_API const char *ts_status_name(ts_status s);

/* A short English description of a status; static string. */
TS_API const char *ts_status_str(ts_status s);

/* The detail of the last error detected on this thread, written where the
 * error was first detected ("matmul: shapes (2, 3) and (4, 5) do not
 * match"). Empty string when there is none. The buffer is thread-local and
 * valid until the next error on this thread. */
TS_API const char *ts_last_error(void);

/* The status that went with ts_last_error() on this thread (TS_OK if none). */
TS_API ts_status ts_last_status(void);

/* Clears this thread's last error. */
TS_API void ts_clear_error(void);

/* Records an error detail for this thread and returns `s`, so that a
 * detecting site can write `return ts_error(TS_ERR_SHAPE, "...", ...)`.
 * Layers above the library use it too (for their own errors). A NULL fmt
 * records `s` with an empty detail. */
TS_API ts_status ts_error(ts_status s, const char *fmt, ...) TS_PRINTF(2, 3);

/*
 * Propagating a ts_status, for code written on top of the library (your
 * own modules, layers, training loops). Each is a statement; the
 * enclosing function must return ts_status.
 *
 *   TS_TRY(expr)                  evaluates expr (a ts_status) once; if it is
 *                                 not TS_OK, returns it at once. The detail
 *                                 stays what the failing call recorded.
 *   TS_CHECK(cond, status, fmt, ...)
 *                                 if cond is false, records the detail
 *                                 (printf-style, as ts_error) and returns
 *                                 `status`. Name the values in the message.
 *   TS_TRY_GOTO(st, expr, label)  assigns expr to the ts_status variable st;
 *                                 if it is not TS_OK, jumps to label (the
 *                                 cleanup that frees what the function
 *                                 holds, then `return st;`).
 *
 * Example:
 *   ts_status block_forward(...) {
 *       TS_CHECK(n_in == 1, TS_ERR_INVALID_ARGUMENT, "Block: 1 input, got %d", n_in);
 *       ts_status st;
 *       ts_tensor *h = NULL;               // NULL: freeing it is a no-op
 *       TS_TRY_GOTO(st, ts_tanh(in[0], &h), done);
 *       ...
 *   done:
 *       ts_tensor_free(h);
 *       return st;
 *   }
 */
#define TS_TRY(expr) \
    do { \
        ts_status ts_try_st_ = (expr); \
        if (ts_try_st_ != TS_OK) return ts_try_st_; \
    } while (0)
#define TS_CHECK(cond, status, ...) \
    do { \
        if (!(cond)) return ts_error((status), __VA_ARGS__); \
    } while (0)
#define TS_TRY_GOTO(st, expr, label) \
    do { \
        if (((st) = (expr)) != TS_OK) goto label; \
    } while (0)

/*
 * Abort hook. The library's internal invariants (never user errors) call
 * the hook with a message when one fails, then abort() if the hook
 * returns. Tests install a hook that longjmps or records.
 */
typedef void (*ts_abort_fn)(const char *msg, void *ctx);
/* Installs `fn` (NULL restores the default, which prints to stderr) and
 * returns the previous one. Not thread-safe against concurrent asserts. */
TS_API ts_abort_fn ts_set_abort_hook(ts_abort_fn fn, void *ctx);

/*
 * Memory. Every allocation the library makes goes through the allocator
 * hook and is counted by tag, so that tests can prove nothing leaks.
 */
typedef enum ts_mem_tag {
    TS_MEM_OTHER = 0,
    TS_MEM_TENSOR,   /* tensor and storage handles */
    TS_MEM_STORAGE,  /* tensor data blocks handed out by the caching pool */
    TS_MEM_POOL,     /* bytes the caching pool holds (in use and cached) */
    TS_MEM_AUTOGRAD, /* autograd nodes and their bookkeeping */
    TS_MEM_COMM,     /* communication layer */
    TS_MEM_NN,       /* modules and optimizers */
    TS_MEM_PINNED,   /* pinned host blocks (ts_storage_pin; also under TS_MEM_STORAGE while a storage holds them) */
    TS_MEM_TAG_COUNT
} ts_mem_tag;

typedef struct ts_allocator {
    void *(*alloc)(size_t size, size_t align, void *ctx); /* NULL on failure */
    void (*free)(void *ptr, size_t size, void *ctx);
    void *ctx;
} ts_allocator;

/* Installs an allocator (NULL restores the default, aligned_alloc/free).
 * Must be called while no library memory is live (before the first
 * allocation or after everything was freed); returns TS_ERR_STATE if any
 * tag has live bytes. */
TS_API ts_status ts_set_allocator(const ts_allocator *a);

/* Live bytes currently allocated under `tag` (0 for an unknown tag). */
TS_API size_t ts_mem_live_bytes(ts_mem_tag tag);
/* Live bytes over all tags. */
TS_API size_t ts_mem_live_total(void);
/* Highest ts_mem_live_bytes(tag) since start or the last reset. */
TS_API size_t ts_mem_peak_bytes(ts_mem_tag tag);
/* Resets every tag's peak to its current live value. */
TS_API void ts_mem_reset_peak(void);
/* Name of a tag ("storage"); static string. */
TS_API const char *ts_mem_tag_name(ts_mem_tag tag);

/*
 * Pinned host memory. A pinned block is page-aligned and page-rounded (so
 * that two blocks never share a page that one of them would unlock),
 * locked in RAM with mlock (CUDA's cudaHostAlloc, PyTorch's pin_memory()
 * on a CPU machine), and registered once with the communication
 * transport's memory map when a transport that has one is running (UCX:
 * ucp_mem_map), so that transfers from or to it pass that registration
 * instead of having the transport register the buffer on each transfer.
 * An mlock that fails (RLIMIT_MEMLOCK too low, no CAP_IPC_LOCK) is never
 * an error: the block stays pageable, and the first such failure logs a
 * warning naming the limit and the bytes (later ones log at debug level).
 * Accounting: ts_mem_live_bytes(TS_MEM_PINNED) and ts_mem_peak_bytes
 * (TS_MEM_PINNED) are the bytes of pinned blocks (locked or not);
 * ts_mem_locked_bytes() the part that mlock actually locked.
 */
/* Bytes of pinned blocks that mlock locked (<= ts_mem_live_bytes(TS_MEM_PINNED)). */
TS_API size_t ts_mem_locked_bytes(void);

/*
 * Process memory (base/procmem.c). What the kernel counts for the whole
 * process, beside the library's own counters above: the resident set
 * (every page of the process in RAM: tensors, the library's code and
 * data, UCX's buffers, BLIS's packing buffers, the C allocator's slack)
 * and the memory cap the process runs under. docs/memory.md says how
 * the two relate to the tensors.
 */
typedef struct ts_process_memory {
    size_t rss_bytes;      /* VmRSS of /proc/self/status: resident now */
    size_t peak_rss_bytes; /* VmHWM: the highest resident set since the process started */
} ts_process_memory;
/* Reads /proc/self/status into *out (written only on success). TS_ERR_IO
 * naming the file and the system error when it cannot be opened or read
 * (no /proc: not Linux, or /proc not mounted); TS_ERR_FORMAT when it has
 * no VmRSS or VmHWM line in kB; TS_ERR_INVALID_ARGUMENT for NULL. */
TS_API ts_status ts_process_memory_read(ts_process_memory *out);

/* The launcher's per-rank cap, in bytes (tsrun --memory-per-rank sets it
 * for each rank it starts). */
#define TS_MEMORY_PER_RANK_ENV "TS_MEMORY_PER_RANK"
typedef struct ts_memory_cap {
    size_t bytes;     /* the cap; 0: none found */
    char source[512]; /* what set it: "TS_MEMORY_PER_RANK", or the cgroup file that holds it; "" for none */
} ts_memory_cap;
/* The memory cap of this process: TS_MEMORY_PER_RANK when set (a decimal
 * number of bytes), else the smallest limit of its memory cgroup and the
 * group's ancestors (cgroup v2's memory.max and v1's memory.limit_in_bytes
 * of the group /proc/self/cgroup names, found under the mount
 * /proc/self/mountinfo lists); "max" and values of 2^60 bytes and more
 * are no cap. No cgroup, no /proc, or unreadable files: no cap (bytes 0),
 * not an error. *out is written only on success. TS_ERR_INVALID_ARGUMENT
 * for a TS_MEMORY_PER_RANK that is not a number of bytes above 0 (naming
 * it) or a NULL out. */
TS_API ts_status ts_memory_cap_read(ts_memory_cap *out);
/* The number of CPUs this process may run on: the count of its affinity
 * mask (sched_getaffinity; taskset, cgroup cpusets and tsrun's binding
 * shrink it), else the online processors (sysconf), at least 1. The
 * default thread count (TS_NUM_THREADS unset: this divided by
 * LOCAL_WORLD_SIZE) and tsrun's --nproc-per-node auto start from it. Any
 * thread. */
TS_API int ts_cpu_count(void);

/*
 * Logging. The level comes from TS_LOG_LEVEL (error, warn, info, debug,
 * trace; default warn), read once; ts_log_set_level overrides it.
 */
typedef enum ts_log_level { TS_LOG_ERROR = 0, TS_LOG_WARN, TS_LOG_INFO, TS_LOG_DEBUG, TS_LOG_TRACE } ts_log_level;

TS_API void ts_log_set_level(ts_log_level level);
TS_API ts_log_level ts_log_get_level(void);
/* Writes one line "[ts LEVEL] message" to stderr if `level` is enabled
 * (nothing for a NULL fmt). */
TS_API void ts_logf(ts_log_level level, const char *fmt, ...) TS_PRINTF(2, 3);
#define TS_LOG_ENABLED(lvl) ((lvl) <= ts_log_get_level())

/*
 * Trace. Named spans per thread with start and end times, off by default.
 * When TS_TRACE=FILE is set (or ts_trace_start is called), spans are
 * recorded and written as a Chrome trace event JSON file (object form:
 * "traceEvents" with phase "X" spans in microseconds, "M" metadata events
 * naming the process "rank R" and each thread, "otherData" with the clock
 * origin) at ts_trace_flush() or at process exit; chrome://tracing,
 * ui.perfetto.dev and tools/trace_plot read it. Spans of a thread that
 * overlap without nesting (the communication thread's collectives) are
 * written on extra tracks of that thread, "comm (2)", ...
 *
 * TS_TRACE=FILE, one file per rank: a process that is a rank (RANK, set by
 * tsrun and torchrun; OMPI_COMM_WORLD_RANK, mpirun; SLURM_PROCID, srun)
 * writes FILE with ".rank<R>" inserted before its extension
 * (trace.json -> trace.rank0.json, trace -> trace.rank0); if FILE holds
 * "%r", every "%r" is replaced by the rank instead (t/%r.json ->
 * t/0.json), and by 0 in a process that is not a rank. A process that is
 * not a rank writes FILE itself. tsrun records nothing. The file is
 * created (holding an empty trace) or checked for writing when the process
 * starts: a path that cannot be written is a warning then, and nothing is
 * recorded. SIGTERM and SIGINT still flush the trace (tsrun stopping a
 * job, Ctrl-C): when tracing starts and such a signal has its default
 * disposition, a handler is installed that hands the signal to a watcher
 * thread, which flushes, then lets the signal take its default action (a
 * second signal does at once). A program that installs its own handler
 * afterwards replaces that; ts_trace_stop removes it.
 *
 * A flush replaces the file atomically: the trace is written into a
 * temporary file of a random name in the file's folder, created with
 * O_CREAT | O_EXCL | O_NOFOLLOW and mode 0600 (a file or
 * symbolic link another user planted in a shared folder is never opened
 * or followed), given mode 0644 under the umask and renamed over the
 * file; a symbolic link at the file's own name is replaced, not followed.
 * Only a character device or FIFO the path itself names (/dev/null) is
 * written straight into.
 *
 * Spans recorded by the library: "forward" (the outermost ts_module_call),
 * "backward" (ts_backward), "optimizer.step", "matmul"; fully_shard's
 * "fsdp.pre_forward", "fsdp.post_forward", "fsdp.pre_backward",
 * "fsdp.post_backward" (args: the module's "fqn" and its "group") and
 * inside them "fsdp.wait_all_gather", "fsdp.wait_reduce" (cat "wait"),
 * "fsdp.copy_out", "fsdp.pack_grads", "fsdp.grad_into_shards" (cat
 * "copy"; the last only when a reduction is added into existing shard
 * gradients in a separate pass); on the communication thread one span per collective, from its
 * submission to its completion, named by its kind ("all_gather",
 * "reduce_scatter", ...; cat "comm"; args: kind, bytes, group, seq, rank,
 * status).
 */
/* Starts recording; `path` is where flush writes (copied; used as given,
 * without the per-rank naming of TS_TRACE). Creates the file with an
 * empty trace if it does not exist (an existing one is only checked, and
 * replaced at the first flush). Returns TS_ERR_INVALID_ARGUMENT for a NULL
 * or empty path, TS_ERR_IO naming the path and the errno text when it
 * cannot be created or opened for writing (nothing is recorded then). */
TS_API ts_status ts_trace_start(const char *path);
/* True while recording. Cheap: one relaxed atomic load. */
TS_API bool ts_trace_enabled(void);
/* Monotonic time in nanoseconds. */
TS_API uint64_t ts_now_ns(void);
/* Records a finished span on the calling thread. `name` and `cat` must be
 * static strings (they are stored by pointer). No effect when disabled. */
TS_API void ts_trace_span(const char *name, const char *cat, uint64_t start_ns, uint64_t end_ns);

/* One argument of a span: `key` a static string; the value is `str`
 * (copied) or, when str is NULL, the integer `num`. */
typedef struct ts_trace_arg {
    const char *key;
    const char *str;
    int64_t num;
} ts_trace_arg;
/* Arguments kept per span; more are dropped. */
#define TS_TRACE_MAX_ARGS 8
/* ts_trace_span with n_args arguments (the event's "args" object).
 * Entries with a NULL key are skipped. No effect when disabled. */
TS_API void ts_trace_span_args(const char *name, const char *cat, uint64_t start_ns, uint64_t end_ns, int n_args,
                               const ts_trace_arg *args);
/* Names the calling thread in the trace ("compute", "comm"). Copied. The
 * main thread is "main" unless named. */
TS_API void ts_trace_thread_name(const char *name);
/* Writes every span recorded so far to the file given at start (all
 * threads), replacing the file (through a temporary file and a rename,
 * or straight into a path that is not a regular file, such as
 * /dev/null); recording continues. Returns TS_ERR_IO with the path and
 * errno text if the file cannot be written, TS_ERR_STATE if tracing was
 * never started. */
TS_API ts_status ts_trace_flush(void);
/* Stops recording and discards recorded spans (after flushing if
 * `flush`). A file that ts_trace_start created and no flush wrote is
 * removed (so a process that turns tracing off at once, as tsrun does,
 * leaves none); the signal handlers are removed. */
TS_API ts_status ts_trace_stop(bool flush);
/* Total nanoseconds of recorded spans named `name` on all threads (for
 * benchmarks that report time per category). */
TS_API uint64_t ts_trace_total_ns(const char *name);
/* The file rank `rank` writes for TS_TRACE=`file` (the naming above; rank
 * < 0: a process that is not a rank), into buf (size bytes, NUL
 * included). TS_ERR_INVALID_ARGUMENT for a NULL or empty file, a NULL buf
 * or a name that does not fit. */
TS_API ts_status ts_trace_rank_path(const char *file, int rank, char *buf, size_t size);

/* Scoped span helper: `TS_TRACE_BEGIN(t); ...; TS_TRACE_END(t, "matmul", "compute");` */
#define TS_TRACE_BEGIN(var) uint64_t var = ts_trace_enabled() ? ts_now_ns() : 0
#define TS_TRACE_END(var, name, cat) \
    do { \
        if (var) ts_trace_span((name), (cat), (var), ts_now_ns()); \
    } while (0)

#ifdef __cplusplus
}
#endif
#endif /* TS_BASE_H */
