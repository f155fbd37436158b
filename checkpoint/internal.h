/* Internal pieces of the checkpoint layer (not installed): the index
 * parser (shared with the fuzz target fuzz/fuzz_ckpt_index.c and the
 * tests) and the crash-point hook of the atomicity tests. */
#ifndef TS_CHECKPOINT_INTERNAL_H
#define TS_CHECKPOINT_INTERNAL_H

#include "base/internal.h"
#include "checkpoint/checkpoint.h"

/* What a key of the index holds. */
typedef enum ts__ckpt_kind {
    TS__CKPT_MODEL = 0,  /* a parameter or buffer */
    TS__CKPT_OPTIM,      /* "optim.state.<fqn>.<name>" */
    TS__CKPT_EXTRA,      /* "extra.<name>": replicated */
    TS__CKPT_RANK_EXTRA, /* "rank_extra.<name>": one piece per saving rank */
    TS__CKPT_KIND_COUNT
} ts__ckpt_kind;

/* One saved piece of a tensor: rows [row, row + rows) of dim 0 (a 0-d
 * tensor is one row) in file `file` (an index into the files), at byte
 * `offset` of the file (absolute), `length` bytes; `rank` saved it. */
typedef struct ts__ckpt_piece {
    int file, rank;
    int64_t row, rows;
    uint64_t offset, length;
    bool has_hash; /* the index records "hash" (checkpoints before it do not) */
    uint64_t hash; /* ts__ckpt_hash of the piece's length bytes */
} ts__ckpt_piece;

typedef struct ts__ckpt_tensor {
    const char *key; /* borrowed from the index's JSON */
    ts__ckpt_kind kind;
    ts_dtype dtype;
    int ndim;
    int64_t shape[TS_MAX_DIMS];
    int64_t rows;       /* shape[0], 1 for 0-d */
    uint64_t row_bytes; /* bytes of one row */
    ts__ckpt_piece *pieces;
    int n_pieces;
} ts__ckpt_tensor;

typedef struct ts__ckpt_file {
    const char *name; /* borrowed; a plain file name inside the folder */
    int rank;
    uint64_t size;
} ts__ckpt_file;

/* The index version this code writes, and the versions it loads
 * (docs/checkpoint.md, "Index versions"): 1, written before every piece
 * had a checksum (its pieces may lack "hash"), and 2, whose every piece
 * has one. */
#define TS__CKPT_INDEX_VERSION 2
#define TS__CKPT_INDEX_VERSION_MIN 1

typedef struct ts__ckpt_index {
    struct json_t *root;
    int version;
    int world;
    const char *save_id;
    bool has_optim;
    const char *optim_kind;
    int64_t optim_steps;
    struct json_t *metadata; /* borrowed from root; NULL when absent */
    ts__ckpt_file *files;
    int n_files;
    ts__ckpt_tensor *tensors; /* sorted by key */
    int n_tensors;
} ts__ckpt_index;

/* A 64-bit checksum of n bytes (four lanes of little-endian 64-bit words,
 * multiply-rotate mixing; not cryptographic): the "hash" of a piece in the
 * index, checked when a load reads the whole piece. docs/checkpoint.md
 * gives the algorithm for other readers. */
uint64_t ts__ckpt_hash(const void *data, size_t n);

/* Parses and validates an index (len bytes at buf; src names it in
 * messages): the JSON's structure and types, the version (1 or 2), every
 * file name a plain name and every file's rank below "world" and its own,
 * every piece inside its file's recorded size with the length its rows
 * need, the pieces of every tensor (but rank extras) covering its rows
 * exactly once, the placements parsed ("Shard(0)", "Replicate()") and
 * agreeing with the pieces, and the checksums (version 2: every piece has
 * one; version 1: none, or every piece of a model or optimizer tensor). TS_ERR_FORMAT naming src and the problem, TS_ERR_NO_MEMORY.
 * *out (free with ts__ckpt_index_free) is written on success. */
ts_status ts__ckpt_index_parse(const char *src, const char *buf, size_t len, ts__ckpt_index **out);
void ts__ckpt_index_free(ts__ckpt_index *ix);
/* The tensor of key `key`, or NULL (binary search). */
const ts__ckpt_tensor *ts__ckpt_index_find(const ts__ckpt_index *ix, const char *key);

/* Test hook: when set, ts_ckpt_save calls it at each crash point with the
 * point's name and the calling rank (the atomicity tests kill the process
 * there): "file_begin" (before this rank's file), "file_done" (its file
 * durable), "index_tmp" (rank 0: the temporary index written, not synced),
 * "index_synced" (before the rename), "index_renamed" (before the folder
 * sync), "dir_synced" (before removing old files), "cleaned". */
extern void (*ts__ckpt_crash_hook)(const char *point, int rank);

#endif
