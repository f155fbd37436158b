/*
 * text: GPT-2's byte-level BPE tokenizer (docs/tokenizer.md).
 *
 * A tokenizer maps bytes to token ids and back. It reads GPT-2's standard
 * files: the vocabulary ("encoder.json", also called "vocab.json": a JSON
 * object from token string to id) and the merges ("vocab.bpe", also called
 * "merges.txt": an optional "#version" line, then one merge "a b" per line,
 * by rank). Token strings are written in GPT-2's byte-to-unicode alphabet
 * (each byte one printable character: 'Ġ' for a space, 'Ċ' for a newline).
 *
 * Encoding splits the text as GPT-2's pre-tokenization regex does,
 *   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 * (with JavaScript's \s and Unicode letter and number classes), then
 * applies the merges to each piece's bytes, lowest rank first, as GPT-2's
 * encoder.py. Any bytes encode, not only UTF-8: an invalid byte is a
 * piece character of its own outside every class, and decoding gives the
 * bytes back exactly. Special tokens ("<|endoftext|>") are never produced
 * by encode; look them up with ts_tokenizer_token_id.
 *
 * ts_tokenizer_learn makes a new vocabulary and merges from a text (the
 * same pre-tokenization, then the most frequent adjacent pair merged
 * repeatedly), and ts_tokenizer_save writes it in the same two formats.
 *
 * Lifetime: a tokenizer owns its memory; arrays the functions return are
 * the caller's, freed with ts_tokenizer_buffer_free. Threads: a tokenizer
 * is used by one thread at a time (encode fills its cache); different
 * tokenizers are independent. All memory goes through the library's
 * allocator (tag TS_MEM_OTHER).
 */
#ifndef TS_TEXT_TOKENIZER_H
#define TS_TEXT_TOKENIZER_H

#include "base/base.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ts_tokenizer ts_tokenizer;

/* Reads a vocabulary (encoder.json) and its merges (vocab.bpe). Ids must
 * be the integers 0..n-1, each once; every one of the 256 bytes must have
 * its single-character token; each merge "a b" must name two tokens of the
 * vocabulary whose concatenation is a token too. *tok_out (free with
 * ts_tokenizer_free) is written on success.
 * Errors: TS_ERR_INVALID_ARGUMENT (a NULL argument); TS_ERR_IO (a file
 * that cannot be opened or read, naming it and the system error);
 * TS_ERR_FORMAT (malformed JSON, a value that is not an id, a duplicate
 * or missing id, a character no byte maps to, a merge line without two
 * tokens, a merge naming an unknown token: the message names the file,
 * the line or token and the value); TS_ERR_NO_MEMORY. */
TS_API ts_status ts_tokenizer_load(const char *vocab_path, const char *merges_path, ts_tokenizer **tok_out);

/* Frees a tokenizer (NULL accepted). */
TS_API void ts_tokenizer_free(ts_tokenizer *tok);

/* The number of tokens (GPT-2: 50257), merges (GPT-2: 50000); 0 for NULL. */
TS_API int32_t ts_tokenizer_vocab_size(const ts_tokenizer *tok);
TS_API int32_t ts_tokenizer_merge_count(const ts_tokenizer *tok);

/* Encodes `len` bytes of `text` (any bytes; NULL with len 0 is the empty
 * text). *ids_out is a new array of *n_out ids (NULL when *n_out is 0),
 * the caller's: free it with ts_tokenizer_buffer_free. Both written on
 * success only.
 * Errors: TS_ERR_INVALID_ARGUMENT (NULL tok, outputs, or text with len >
 * 0); TS_ERR_NO_MEMORY. */
TS_API ts_status ts_tokenizer_encode(ts_tokenizer *tok, const char *text, size_t len, int32_t **ids_out, size_t *n_out);

/* Decodes `n` ids into their bytes: *bytes_out is a new buffer of
 * *len_out bytes plus a terminating NUL (not counted), the caller's: free
 * it with ts_tokenizer_buffer_free. The bytes need not be UTF-8 (an id can
 * hold part of a character).
 * Errors: TS_ERR_INVALID_ARGUMENT (NULL tok or outputs, NULL ids with n >
 * 0, n more than any array holds); TS_ERR_INDEX (an id outside [0, vocab size), naming it and its
 * position); TS_ERR_NO_MEMORY. */
TS_API ts_status ts_tokenizer_decode(const ts_tokenizer *tok, const int32_t *ids, size_t n, char **bytes_out,
                                     size_t *len_out);

/* The bytes of token `id`, borrowed from the tokenizer (valid while it
 * lives; not NUL-terminated), in *bytes_out and *len_out.
 * Errors: TS_ERR_INVALID_ARGUMENT (NULL argument); TS_ERR_INDEX (id out of
 * range). */
TS_API ts_status ts_tokenizer_token_bytes(const ts_tokenizer *tok, int32_t id, const char **bytes_out, size_t *len_out);

/* The id of the token whose bytes are the NUL-terminated `token`
 * ("<|endoftext|>" gives GPT-2's 50256), in *id_out.
 * Errors: TS_ERR_INVALID_ARGUMENT (NULL argument); TS_ERR_NOT_FOUND (no
 * such token, naming it). */
TS_API ts_status ts_tokenizer_token_id(const ts_tokenizer *tok, const char *token, int32_t *id_out);

/* Frees an array returned by ts_tokenizer_encode or ts_tokenizer_decode
 * (NULL accepted). */
TS_API void ts_tokenizer_buffer_free(void *buffer);

/* Learns a vocabulary of `vocab_size` tokens from `len` bytes of `text`
 * (GPT-2's layout: ids 0..255 the bytes in GPT-2's order, then one token
 * per merge, then "<|endoftext|>" last). The text is pre-tokenized as by
 * encode and every distinct piece counted; then, until the vocabulary has
 * vocab_size tokens, the adjacent pair of tokens with the highest count
 * over all pieces is merged into a new token. Ties go to the pair whose
 * left token id is smallest, then whose right token id is smallest, so the
 * result depends on the text and vocab_size only. Learning stops early
 * when every piece is one token (the vocabulary is then smaller: see
 * ts_tokenizer_vocab_size). *tok_out (free with ts_tokenizer_free) is
 * written on success.
 * Errors: TS_ERR_INVALID_ARGUMENT (NULL tok_out, NULL text with len > 0,
 * vocab_size < 257 or > 1 << 24, naming it); TS_ERR_NO_MEMORY. */
TS_API ts_status ts_tokenizer_learn(const char *text, size_t len, int32_t vocab_size, ts_tokenizer **tok_out);

/* Writes the vocabulary as encoder.json (tokens in id order) and the
 * merges as vocab.bpe ("#version: 0.2", then one "a b" line per merge,
 * by rank), both in GPT-2's byte-to-unicode alphabet, so that
 * ts_tokenizer_load and GPT-2's own encoder read them back. Each file is
 * written to a temporary name and renamed into place.
 * Errors: TS_ERR_INVALID_ARGUMENT (NULL argument); TS_ERR_IO (naming the
 * file and the system error); TS_ERR_NO_MEMORY. */
TS_API ts_status ts_tokenizer_save(const ts_tokenizer *tok, const char *vocab_path, const char *merges_path);

/* llm.c's token file: a header of 256 int32 (magic
 * 20240520, version 1, the token count, the rest 0), then the tokens as
 * uint16, both in the machine's byte order (little-endian on x86 and
 * ARM, as llm.c writes them). */
#define TS_TOKENS_BIN_MAGIC 20240520
#define TS_TOKENS_BIN_VERSION 1
#define TS_TOKENS_BIN_HEADER_INTS 256

/* Writes `n` ids to `path` in llm.c's token file format, through a
 * temporary file renamed into place (a failure leaves no partial file).
 * Errors: TS_ERR_INVALID_ARGUMENT (NULL path, NULL ids with n > 0, more
 * than INT32_MAX tokens); TS_ERR_INDEX (an id outside [0, 65535], which
 * uint16 cannot hold: naming it and its position); TS_ERR_IO (naming the
 * file and the system error); TS_ERR_NO_MEMORY. */
TS_API ts_status ts_tokenizer_write_bin(const int32_t *ids, size_t n, const char *path);

#ifdef __cplusplus
}
#endif

#endif
