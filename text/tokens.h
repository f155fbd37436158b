/*
 * text: llm.c's token files, memory-mapped (docs/tokenizer.md, "Token
 * files").
 *
 * A token file (written by ts_tokenizer_write_bin or tools/tokenize, or by
 * llm.c's own scripts) is a header of 256 int32 (magic 20240520, version
 * 1, the token count) and then the tokens as uint16. ts_token_file_open
 * checks the header against the file's size and maps the tokens read-only:
 * every rank of a host shares the page cache's one copy, nothing is read
 * into the process.
 *
 * Training and validation: ts_token_file_split holds out the last tokens
 * of the file for validation and fixes the window length T. Training
 * windows (T inputs, the T next tokens as targets) start at positions
 * drawn from a data-order generator in the training part only; every rank
 * seeds the same generator, draws the global batch's G starts and keeps
 * its own slice [first, first + B), as train_gpt --global-batch does for
 * text, so the order is one for all ranks and a resumed run that restores
 * the generator's state continues it exactly. Validation windows are
 * fixed: window i starts at train_tokens + i * T; they never touch a
 * training token, and rank r of W evaluates windows r, r + W, ...
 *
 * Lifetime: a ts_token_file owns its mapping; the tokens pointer is valid
 * until ts_token_file_close. Threads: the functions only read the file
 * after ts_token_file_split, so several threads may sample from one file
 * with their own generators. Memory: the handle goes through the library's
 * allocator (tag TS_MEM_OTHER); the mapping is the kernel's.
 */
#ifndef TS_TEXT_TOKENS_H
#define TS_TEXT_TOKENS_H

#include "base/base.h"
#include "tensor/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ts_token_file ts_token_file;

/* Opens and maps a token file. *file_out (close with ts_token_file_close)
 * is written on success.
 * Errors: TS_ERR_INVALID_ARGUMENT (NULL argument); TS_ERR_IO (a file that
 * cannot be opened, stat'ed or mapped, or is not a regular file: naming
 * it and the system error); TS_ERR_FORMAT (a file shorter than the 1024
 * byte header, a magic other than 20240520, a version other than 1, a
 * negative count, or a size other than 1024 + 2 x count bytes: the
 * message names the file, the value found and the one expected);
 * TS_ERR_NO_MEMORY. */
TS_API ts_status ts_token_file_open(const char *path, ts_token_file **file_out);

/* The same object made from `n` token ids in memory (a text tokenized
 * on the fly: train_gpt --data --tokenizer) instead of a file: the ids are
 * copied as uint16 into a buffer the object owns (2 bytes a token, freed
 * by ts_token_file_close), and everything below behaves as for a file
 * holding those tokens (the hash too: it equals the hash of the token
 * file tools/tokenize writes from the same ids). `name` (copied) stands
 * for the path in messages and ts_token_file_path. *file_out is written
 * on success.
 * Errors: TS_ERR_INVALID_ARGUMENT (NULL name or file_out, NULL ids with
 * n > 0, more than INT32_MAX tokens, which a token file cannot count);
 * TS_ERR_INDEX (an id outside [0, 65535], which uint16 cannot hold:
 * naming it and its position); TS_ERR_NO_MEMORY. */
TS_API ts_status ts_token_file_from_ids(const int32_t *ids, size_t n, const char *name, ts_token_file **file_out);

/* Unmaps (or frees) and frees (NULL accepted). */
TS_API void ts_token_file_close(ts_token_file *file);

/* The header's token count (0 for NULL). */
TS_API size_t ts_token_file_count(const ts_token_file *file);

/* The tokens (count of them), borrowed: valid until close; NULL for NULL
 * or an empty file. */
TS_API const uint16_t *ts_token_file_tokens(const ts_token_file *file);

/* The path the file was opened with, borrowed (NULL for NULL). */
TS_API const char *ts_token_file_path(const ts_token_file *file);

/* FNV-1a (64 bit) over the tokens' bytes: an identity for checkpoints
 * (0 for NULL). Reads the whole file. */
TS_API uint64_t ts_token_file_hash(const ts_token_file *file);

/* Checks that every token is below `vocab`.
 * Errors: TS_ERR_INVALID_ARGUMENT (NULL file, vocab < 1); TS_ERR_INDEX (the
 * first token >= vocab: the message names it, its position and the
 * file). */
TS_API ts_status ts_token_file_check_vocab(const ts_token_file *file, int32_t vocab);

/* Holds out the last `val_tokens` tokens for validation and sets the
 * window length to `seq` (T): training windows then lie in tokens
 * [0, count - val_tokens), validation windows in the rest. May be called
 * again to change either.
 * Errors: TS_ERR_INVALID_ARGUMENT (NULL file, seq < 1, a training part of
 * fewer than seq + 2 tokens, or a validation part (when not 0) of fewer
 * than seq + 1 tokens: naming the counts). */
TS_API ts_status ts_token_file_split(ts_token_file *file, size_t val_tokens, int32_t seq);

/* The training part's tokens and the number of validation windows
 * ((val_tokens - 1) / seq; 0 without a split). */
TS_API size_t ts_token_file_train_tokens(const ts_token_file *file);
TS_API size_t ts_token_file_val_windows(const ts_token_file *file);

/* One slice of a global batch: draws `global` window starts from `order`
 * (each ts_generator_random(order) % (train_tokens - seq - 1), in draw
 * order, whether kept or not) and writes windows first .. first + batch -
 * 1 into inputs and targets, each (batch, seq) int64: the window's tokens
 * and the tokens one after them. Every rank calling it with the same
 * generator state and `global` advances the generator alike.
 * Errors: TS_ERR_INVALID_ARGUMENT (NULL argument, no split yet, global <
 * 1, batch < 1, first < 0 or first + batch > global). */
TS_API ts_status ts_token_file_train_batch(const ts_token_file *file, ts_generator *order, int32_t global,
                                           int32_t first, int32_t batch, int64_t *inputs, int64_t *targets);

/* Validation window `index`: inputs and targets (seq) int64, the tokens
 * from train_tokens + index * seq and the tokens one after them.
 * Errors: TS_ERR_INVALID_ARGUMENT (NULL argument, no split yet);
 * TS_ERR_INDEX (index >= ts_token_file_val_windows, naming both). */
TS_API ts_status ts_token_file_val_window(const ts_token_file *file, size_t index, int64_t *inputs, int64_t *targets);

#ifdef __cplusplus
}
#endif

#endif
