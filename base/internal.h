/*
 * Library-internal part of the base layer: the allocation helpers every
 * layer allocates through (so the allocator hook and the per-tag counters
 * see every byte), TS_ASSERT, the pinned-block internals the storage and
 * the transports use, the temporary file of an atomic write, and the
 * parsers the tests drive with given inputs. Not installed: a program
 * built against the installed headers sees base/base.h only.
 *
 * The symbols stay exported from the shared library (TS_API), because
 * the tests and the tools link against it and call them.
 */
#ifndef TS_BASE_INTERNAL_H
#define TS_BASE_INTERNAL_H

#include "base/base.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Internal invariants (never user errors): TS_ASSERT(e) calls the abort
 * hook (ts_set_abort_hook) with a message naming e, the file and the
 * line, then abort()s if the hook returns. Library code only: a program
 * states its own invariants with its own assert. */
TS_API void ts__assert_fail(const char *expr, const char *file, int line) __attribute__((noreturn));
#define TS_ASSERT(e) ((e) ? (void)0 : ts__assert_fail(#e, __FILE__, __LINE__))

/* Internal (tensor/storage.c, comm/): a pinned block of at least `size`
 * bytes (the rounded size in *block_bytes_out); NULL and TS_ERR_NO_MEMORY
 * when it cannot be allocated (never because mlock failed), NULL and
 * TS_ERR_INVALID_ARGUMENT for a NULL block_bytes_out. */
TS_API void *ts__pinned_alloc(size_t size, size_t *block_bytes_out);
/* Deregisters, unlocks and frees a block from ts__pinned_alloc (NULL accepted). */
TS_API void ts__pinned_free(void *p, size_t block_bytes);
/* True when p is the start of a pinned block that mlock locked. */
TS_API bool ts__pinned_is_locked(const void *p);
/* The registrar the communication layer installs while a transport with a
 * memory map runs: reg registers [addr, addr + len) and returns a handle
 * (TS_OK) or an error (then the block is used unregistered, with a debug
 * line); dereg releases a handle. Installing registers every block pinned
 * so far; clearing (ts__pin_registrar_clear with the installer's ctx)
 * deregisters them all. One at a time: TS_ERR_ALREADY while another is
 * installed. Both run with the pinned-block table locked: they must not
 * pin or unpin. */
typedef struct ts__pin_registrar {
    ts_status (*reg)(void *ctx, void *addr, size_t len, void **handle_out);
    void (*dereg)(void *ctx, void *handle);
    void *ctx;
} ts__pin_registrar;
TS_API ts_status ts__pin_registrar_set(const ts__pin_registrar *r);
TS_API void ts__pin_registrar_clear(void *ctx);
/* Pinned blocks that hold a registration now (tests). */
TS_API int ts__pinned_registered_count(void);

/* Library-internal allocation helpers (exported for the upper layers and
 * tests; alignment 64). ts__malloc returns NULL and records
 * TS_ERR_NO_MEMORY on failure; ts__free accepts NULL. */
TS_API void *ts__malloc(ts_mem_tag tag, size_t size);
TS_API void *ts__calloc(ts_mem_tag tag, size_t n, size_t size);
TS_API void ts__free(ts_mem_tag tag, void *ptr);
TS_API char *ts__strdup(ts_mem_tag tag, const char *s);
/* Header-less allocation through the allocator hook with a given alignment
 * (a power of two >= 64), counted under `tag`; the caller remembers the
 * size and passes it back to ts__free_raw. For pools of large blocks. */
TS_API void *ts__malloc_raw(ts_mem_tag tag, size_t size, size_t align);
TS_API void ts__free_raw(ts_mem_tag tag, void *ptr, size_t size);
/* Files: the exclusive temporary file of an atomic write (base/file.c).
 * Creates "<dir>/.<base>.tmp.<pid>.<16 random hex digits>" with
 * O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC and mode 0600, retrying on a
 * name that exists (a planted file or symbolic link is never opened).
 * `target` (the file it will be renamed to) and `op` name it in messages.
 * *tmp_out (free with ts__free(tag, ...)) and *fd_out (open for writing)
 * are written on success; the caller removes the file on every failure.
 * TS_ERR_IO naming the path and the system error; TS_ERR_NO_MEMORY;
 * TS_ERR_INVALID_ARGUMENT for a NULL argument. */
#define TS__TMP_INFIX ".tmp."
TS_API ts_status ts__tmp_create(ts_mem_tag tag, const char *op, const char *dir, const char *base, const char *target,
                                char **tmp_out, int *fd_out);
/* The same beside `path`: in its folder ("." when it has none), named
 * after its last component. Errors as ts__tmp_create. */
TS_API ts_status ts__tmp_create_beside(ts_mem_tag tag, const char *op, const char *path, char **tmp_out, int *fd_out);
/* The mode to give a file the library writes: max_mode (0644 for every
 * file it writes) less the process's umask. */
TS_API unsigned ts__file_mode(unsigned max_mode);
/* Adjusts a tag's live count for memory that is handed out from a cache
 * (the tensor pool counts blocks in use under TS_MEM_STORAGE). */
TS_API void ts__mem_count(ts_mem_tag tag, size_t bytes, bool add);
/* Quiet brackets (base/status.c): between ts__error_quiet_begin and its
 * ts__error_quiet_end, ts_error returns its status, logs the detail at
 * debug level and writes nothing: ts_last_error() and ts_last_status()
 * keep what they held (ts_clear_error clears nothing either). Brackets
 * nest (a depth per thread); every begin has its end on the same thread.
 * Teardown paths run quiet, so that a failure's detail survives the
 * cleanup that follows it (docs/design.md, D1). */
TS_API void ts__error_quiet_begin(void);
TS_API void ts__error_quiet_end(void);

/* The same from another file in /proc/<pid>/status's format (tests). */
TS_API ts_status ts__process_memory_parse(const char *path, ts_process_memory *out);

/* The same from given inputs (tests): env_value as TS_MEMORY_PER_RANK's
 * value (NULL: unset), cgroup_file and mountinfo in the formats of
 * /proc/self/cgroup and /proc/self/mountinfo (NULL: none). */
TS_API ts_status ts__memory_cap_from(const char *env_value, const char *cgroup_file, const char *mountinfo,
                                     ts_memory_cap *out);

#ifdef __cplusplus
}
#endif

#endif
