/*
 * llm.c's token files, memory-mapped, with a training part sampled in one
 * order shared by the ranks and a fixed validation part (text/tokens.h).
 */
#define _GNU_SOURCE
#include "base/internal.h"
#include "text/tokens.h"
#include "text/tokenizer.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define TAG TS_MEM_OTHER

struct ts_token_file {
    char *path;
    void *map; /* the whole file, read-only (NULL for an empty map) */
    size_t map_bytes;
    uint16_t *owned; /* ts_token_file_from_ids: the tokens, in memory (map NULL) */
    const uint16_t *tokens;
    size_t count;
    size_t train; /* tokens [0, train) are training tokens (count until split) */
    int32_t seq;  /* window length; 0 until split */
    size_t val_windows;
};

enum { HEADER_BYTES = TS_TOKENS_BIN_HEADER_INTS * 4 };

ts_status ts_token_file_open(const char *path, ts_token_file **file_out)
{
    static const char op[] = "ts_token_file_open";
    if (!path || !file_out) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL %s", op, !path ? "path" : "file_out");
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ts_error(TS_ERR_IO, "%s: cannot open '%s': %s", op, path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return ts_error(TS_ERR_IO, "%s: cannot stat '%s': %s", op, path, strerror(e));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return ts_error(TS_ERR_IO, "%s: '%s' is not a regular file", op, path);
    }
    size_t size = (size_t)sb.st_size;
    if (size < HEADER_BYTES) {
        close(fd);
        return ts_error(TS_ERR_FORMAT, "%s: '%s' has %zu bytes, fewer than the %d of a token file's header", op, path,
                        size, HEADER_BYTES);
    }
    void *map = mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0);
    int e = errno;
    close(fd);
    if (map == MAP_FAILED)
        return ts_error(TS_ERR_IO, "%s: cannot map '%s' (%zu bytes): %s", op, path, size, strerror(e));
    int32_t h[3];
    memcpy(h, map, sizeof h);
    ts_status st = TS_OK;
    if (h[0] != TS_TOKENS_BIN_MAGIC)
        st = ts_error(TS_ERR_FORMAT, "%s: '%s' is not a token file: magic %d, expected %d", op, path, h[0],
                      TS_TOKENS_BIN_MAGIC);
    else if (h[1] != TS_TOKENS_BIN_VERSION)
        st = ts_error(TS_ERR_FORMAT, "%s: '%s': version %d, expected %d (uint16 tokens)", op, path, h[1],
                      TS_TOKENS_BIN_VERSION);
    else if (h[2] < 0) st = ts_error(TS_ERR_FORMAT, "%s: '%s': a token count of %d", op, path, h[2]);
    else if (size != HEADER_BYTES + 2 * (size_t)h[2])
        st = ts_error(TS_ERR_FORMAT, "%s: '%s' has %zu bytes, but its header's count of %d tokens makes %zu (%s)", op,
                      path, size, h[2], HEADER_BYTES + 2 * (size_t)h[2],
                      size < HEADER_BYTES + 2 * (size_t)h[2] ? "truncated" : "bytes after the tokens");
    ts_token_file *f = st ? NULL : ts__calloc(TAG, 1, sizeof *f);
    if (!st && (!f || !(f->path = ts__strdup(TAG, path)))) st = TS_ERR_NO_MEMORY;
    if (st) {
        if (f) ts__free(TAG, f);
        munmap(map, size);
        return st;
    }
    f->map = map;
    f->map_bytes = size;
    f->count = (size_t)h[2];
    f->tokens = (const uint16_t *)((const char *)map + HEADER_BYTES);
    f->train = f->count;
    madvise(map, size, MADV_RANDOM); /* windows are read at random places */
    *file_out = f;
    return TS_OK;
}

ts_status ts_token_file_from_ids(const int32_t *ids, size_t n, const char *name, ts_token_file **file_out)
{
    static const char op[] = "ts_token_file_from_ids";
    if (!name || !file_out || (!ids && n))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL %s", op, !name ? "name" : !file_out ? "file_out" : "ids");
    if (n > (size_t)INT32_MAX)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %zu tokens, more than a token file counts (%d)", op, n,
                        INT32_MAX);
    for (size_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] > 65535)
            return ts_error(TS_ERR_INDEX, "%s: '%s': the id %d at position %zu does not fit uint16 [0, 65535]", op,
                            name, ids[i], i);
    ts_token_file *f = ts__calloc(TAG, 1, sizeof *f);
    uint16_t *t = n ? ts__malloc(TAG, n * sizeof *t) : NULL;
    char *path = ts__strdup(TAG, name);
    if (!f || (n && !t) || !path) {
        ts__free(TAG, f);
        ts__free(TAG, t);
        ts__free(TAG, path);
        return ts_error(TS_ERR_NO_MEMORY, "%s: '%s': %zu tokens", op, name, n);
    }
    for (size_t i = 0; i < n; i++) t[i] = (uint16_t)ids[i];
    f->path = path;
    f->owned = t;
    f->tokens = t;
    f->count = n;
    f->train = n;
    *file_out = f;
    return TS_OK;
}

void ts_token_file_close(ts_token_file *file)
{
    if (!file) return;
    if (file->map) munmap(file->map, file->map_bytes);
    ts__free(TAG, file->owned);
    ts__free(TAG, file->path);
    ts__free(TAG, file);
}

size_t ts_token_file_count(const ts_token_file *file) { return file ? file->count : 0; }

const uint16_t *ts_token_file_tokens(const ts_token_file *file) { return file && file->count ? file->tokens : NULL; }

const char *ts_token_file_path(const ts_token_file *file) { return file ? file->path : NULL; }

uint64_t ts_token_file_hash(const ts_token_file *file)
{
    if (!file) return 0;
    uint64_t h = 14695981039346656037ull;
    const unsigned char *b = (const unsigned char *)file->tokens;
    for (size_t i = 0; i < 2 * file->count; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

ts_status ts_token_file_check_vocab(const ts_token_file *file, int32_t vocab)
{
    static const char op[] = "ts_token_file_check_vocab";
    if (!file) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL file", op);
    if (vocab < 1) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: vocab %d (must be at least 1)", op, vocab);
    for (size_t i = 0; i < file->count; i++)
        if (file->tokens[i] >= vocab)
            return ts_error(TS_ERR_INDEX, "%s: '%s' has the token id %u at position %zu, outside a vocabulary of %d",
                            op, file->path, (unsigned)file->tokens[i], i, vocab);
    return TS_OK;
}

ts_status ts_token_file_split(ts_token_file *file, size_t val_tokens, int32_t seq)
{
    static const char op[] = "ts_token_file_split";
    if (!file) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL file", op);
    if (seq < 1) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: seq %d (must be at least 1)", op, seq);
    if (val_tokens > file->count || file->count - val_tokens < (size_t)seq + 2)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "%s: '%s' has %zu tokens; holding out %zu for validation leaves %zu for training, fewer than "
                        "the %lld one window of %d needs",
                        op, file->path, file->count, val_tokens,
                        val_tokens > file->count ? (size_t)0 : file->count - val_tokens, (long long)seq + 2, seq);
    if (val_tokens > 0 && val_tokens < (size_t)seq + 1)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "%s: '%s': %zu validation tokens are fewer than the %lld one window of %d needs", op,
                        file->path, val_tokens, (long long)seq + 1, seq);
    file->train = file->count - val_tokens;
    file->seq = seq;
    file->val_windows = val_tokens ? (val_tokens - 1) / (size_t)seq : 0;
    return TS_OK;
}

size_t ts_token_file_train_tokens(const ts_token_file *file) { return file ? file->train : 0; }

size_t ts_token_file_val_windows(const ts_token_file *file) { return file ? file->val_windows : 0; }

static void window(const ts_token_file *f, size_t at, int64_t *inputs, int64_t *targets)
{
    for (int32_t t = 0; t < f->seq; t++) {
        inputs[t] = f->tokens[at + (size_t)t];
        targets[t] = f->tokens[at + (size_t)t + 1];
    }
}

ts_status ts_token_file_train_batch(const ts_token_file *file, ts_generator *order, int32_t global, int32_t first,
                                    int32_t batch, int64_t *inputs, int64_t *targets)
{
    static const char op[] = "ts_token_file_train_batch";
    if (!file || !order || !inputs || !targets)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL %s", op,
                        !file         ? "file"
                            : !order  ? "order"
                            : !inputs ? "inputs"
                                      : "targets");
    if (!file->seq)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: '%s' has no split yet (ts_token_file_split)", op, file->path);
    if (global < 1 || batch < 1 || first < 0 || (int64_t)first + batch > global)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "%s: the slice [%d, %lld) of a global batch of %d (needs 0 <= first, 1 <= batch, "
                        "first + batch <= global)",
                        op, first, (long long)first + batch, global);
    size_t starts = file->train - (size_t)file->seq - 1; /* >= 1 (split) */
    for (int32_t g = 0; g < global; g++) {
        size_t at = ts_generator_random(order) % starts;
        int32_t b = g - first;
        if (b >= 0 && b < batch)
            window(file, at, inputs + (size_t)b * (size_t)file->seq, targets + (size_t)b * (size_t)file->seq);
    }
    return TS_OK;
}

ts_status ts_token_file_val_window(const ts_token_file *file, size_t index, int64_t *inputs, int64_t *targets)
{
    static const char op[] = "ts_token_file_val_window";
    if (!file || !inputs || !targets)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL %s", op, !file ? "file" : !inputs ? "inputs" : "targets");
    if (!file->seq)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: '%s' has no split yet (ts_token_file_split)", op, file->path);
    if (index >= file->val_windows)
        return ts_error(TS_ERR_INDEX, "%s: window %zu of '%s', which has %zu validation windows", op, index, file->path,
                        file->val_windows);
    window(file, file->train + index * (size_t)file->seq, inputs, targets);
    return TS_OK;
}
