/*
 * safetensors files (github.com/huggingface/safetensors): the format on
 * the tensor floor, for the layers that write or read such files piece by
 * piece (checkpoint/: a rank's rows of each parameter, Hugging Face's
 * GPT-2 weights). A state dict is saved and loaded whole with
 * ts_safetensors_save / ts_safetensors_load (nn/nn.h), which are built on
 * the writer and the header reader here, so the bytes are the same.
 *
 * Format: 8 bytes N (little-endian u64), N bytes of a JSON header (name ->
 * {"dtype", "shape", "data_offsets"}, optional "__metadata__"), then the
 * data buffer the offsets point into.
 *
 * Lifetime rules: a header read or parsed here is the caller's, released
 * with ts_safetensors_header_fini (the entries' names are borrowed from
 * it); a writer is the caller's until ts_safetensors_writer_commit or
 * ts_safetensors_writer_abort, which free it. `op` names the caller in
 * error messages ("ts_ckpt_save"). Any thread; one thread per writer.
 */
#ifndef TS_SAFETENSORS_H
#define TS_SAFETENSORS_H

#include "tensor/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The safetensors dtype name of d ("F32", "BF16", ...; "?" for a value
 * that is no dtype). Static string. */
TS_API const char *ts_safetensors_dtype_name(ts_dtype d);
/* The dtype a safetensors dtype name stands for, in *out; false (out
 * untouched) for a name the library has no dtype for, or NULL. */
TS_API bool ts_safetensors_dtype_from_name(const char *s, ts_dtype *out);

/* One validated tensor entry of a header: name (borrowed from the
 * header's JSON), dtype, shape, and [begin, end) in the data buffer. */
typedef struct ts_safetensors_entry {
    const char *name;
    ts_dtype dtype;
    int ndim;
    int64_t shape[TS_MAX_DIMS];
    uint64_t begin, end;
} ts_safetensors_entry;

/* A parsed, validated header: the entries in header order, where the
 * data buffer starts (8 + the header length) and the file's (buffer's)
 * size. root is the parsed JSON (jansson's json_t), which owns the names:
 * the reader's, not to be touched. */
typedef struct ts_safetensors_header {
    struct json_t *root;
    ts_safetensors_entry *entries;
    size_t n;
    uint64_t data_start, file_size;
} ts_safetensors_header;

/* Reads and validates the header of the safetensors file open as fd
 * (every check ts_safetensors_load makes: the length, the JSON, each
 * entry's dtype, shape and offsets, the offsets covering the data exactly;
 * messages prefixed with op and naming path). *out is the caller's
 * (ts_safetensors_header_fini) and written on success. TS_ERR_IO (the
 * file cannot be read, is a directory or not a regular file),
 * TS_ERR_FORMAT naming what is wrong, TS_ERR_NO_MEMORY,
 * TS_ERR_INVALID_ARGUMENT for a NULL argument. */
TS_API ts_status ts_safetensors_header_read(const char *op, const char *path, int fd, ts_safetensors_header *out);
/* The same for a whole file held in data (len bytes; src names it in
 * messages, "<buffer>"): the entries' offsets are relative to
 * data + out->data_start. Errors as ts_safetensors_header_read, without
 * TS_ERR_IO. */
TS_API ts_status ts_safetensors_header_parse(const char *op, const char *src, const void *data, size_t len,
                                             ts_safetensors_header *out);
/* Frees what a header holds and zeroes it (h itself is the caller's;
 * NULL accepted). */
TS_API void ts_safetensors_header_fini(ts_safetensors_header *h);
/* pread of exactly n bytes at offset off of the file open as fd:
 * TS_ERR_IO naming path and `what` ("tensor 'w'"), short reads included
 * (the file changed while being read); TS_ERR_INVALID_ARGUMENT for a NULL
 * argument. */
TS_API ts_status ts_safetensors_read_at(const char *op, const char *path, int fd, void *buf, size_t n, uint64_t off,
                                        const char *what);

/* What the writer's header says of one tensor: name, dtype and shape
 * (copied by ts_safetensors_writer_open). tensor, when not NULL, is the
 * tensor that will be put, checked at open as ts_safetensors_save checks
 * it (not a shard: TS_ERR_SHARDED; storage not released:
 * TS_ERR_RELEASED); NULL to describe a tensor that does not exist yet. */
typedef struct ts_safetensors_desc {
    const char *name;
    ts_dtype dtype;
    int ndim;
    const int64_t *shape;
    const ts_tensor *tensor;
} ts_safetensors_desc;

/* Streaming writer of one safetensors file, written atomically as
 * ts_safetensors_save writes (nn/nn.h: a temporary file in path's folder,
 * renamed over path at commit). */
typedef struct ts_safetensors_writer ts_safetensors_writer;
/* Checks the n descriptions and the n_meta metadata key/value pairs as
 * ts_safetensors_save does and writes the header to a new temporary file
 * next to path; *out (the caller's: commit or abort it) written on
 * success. Errors as ts_safetensors_save (TS_ERR_INVALID_ARGUMENT for
 * names, metadata and NULL arguments, TS_ERR_IO, TS_ERR_NO_MEMORY). */
TS_API ts_status ts_safetensors_writer_open(const char *op, const char *path, int n, const ts_safetensors_desc *descs,
                                            const char *const *metadata, int n_meta, ts_safetensors_writer **out);
/* Writes the next tensor's data: its dtype and element count must be
 * those of the next description (TS_ERR_SHAPE otherwise); TS_ERR_STATE
 * for a meta tensor; TS_ERR_IO; TS_ERR_INVALID_ARGUMENT for a tensor more
 * than described or a NULL argument. After an error the writer can only
 * be aborted (commit returns that error). */
TS_API ts_status ts_safetensors_writer_put(ts_safetensors_writer *w, const ts_tensor *t);
/* Flushes, fsyncs, renames the file to path, syncs the folder and frees
 * the writer, also on error (when the temporary file is removed):
 * TS_ERR_IO; TS_ERR_INVALID_ARGUMENT when fewer tensors were put than
 * described, or for NULL. */
TS_API ts_status ts_safetensors_writer_commit(ts_safetensors_writer *w);
/* Removes the temporary file and frees the writer (NULL accepted). */
TS_API void ts_safetensors_writer_abort(ts_safetensors_writer *w);

#ifdef __cplusplus
}
#endif

#endif
