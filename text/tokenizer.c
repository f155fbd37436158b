/* GPT-2's byte-level BPE: loading, encoding, decoding, saving
 * (text/tokenizer.h; docs/tokenizer.md).
 *
 * Tokens are byte strings indexed by id; the files' strings in GPT-2's
 * byte-to-unicode alphabet are translated to bytes when read and back when
 * written. A merge is a pair of ids; its rank is its line in the merges
 * file. Encoding works on ids: a piece's bytes start as the 256 byte
 * tokens and the merges apply as in GPT-2's encoder.py (find the adjacent
 * pair of lowest rank, merge every occurrence of it left to right, repeat
 * until no pair has a rank), which is exactly what the reference encoder
 * does on strings, since a token's id names its string one to one. Pairs
 * are found through a hash table; each piece's ids are cached by its
 * bytes. */
#define _GNU_SOURCE
#include "text/internal.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <stddef.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define TAG TS_MEM_OTHER
#define NO_ID (-1)
/* The cache is dropped whole when it holds this many pieces (a bound on
 * its memory for an endless stream of distinct pieces). */
#define CACHE_MAX_ENTRIES (1u << 20)

/* ---- small helpers: hashing, an arena, a growable id array ---- */

static uint64_t hash_bytes(const uint8_t *p, size_t n)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 1099511628211ull;
    }
    return h ^ (h >> 29);
}

static uint64_t hash_u64(uint64_t x)
{
    x ^= x >> 30; /* splitmix64's finalizer */
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

typedef struct arena_chunk {
    struct arena_chunk *next;
    size_t used, cap;
    uint8_t data[];
} arena_chunk;

static void *arena_alloc(arena_chunk **head, size_t n)
{
    n = (n + 7) & ~(size_t)7;
    arena_chunk *c = *head;
    if (!c || c->cap - c->used < n) {
        size_t cap = n > (1u << 20) ? n : (1u << 20);
        c = ts__malloc(TAG, sizeof *c + cap);
        if (!c) return NULL;
        c->next = *head;
        c->used = 0;
        c->cap = cap;
        *head = c;
    }
    void *p = c->data + c->used;
    c->used += n;
    return p;
}

static void arena_free(arena_chunk **head)
{
    for (arena_chunk *c = *head; c;) {
        arena_chunk *next = c->next;
        ts__free(TAG, c);
        c = next;
    }
    *head = NULL;
}

typedef struct id_vec {
    int32_t *v;
    size_t n, cap;
} id_vec;

static bool vec_reserve(id_vec *a, size_t need)
{
    if (need <= a->cap) return true;
    size_t cap = a->cap ? a->cap : 64;
    while (cap < need) cap *= 2;
    int32_t *v = ts__malloc(TAG, cap * sizeof *v);
    if (!v) return false;
    if (a->n) memcpy(v, a->v, a->n * sizeof *v);
    ts__free(TAG, a->v);
    a->v = v;
    a->cap = cap;
    return true;
}

/* ---- the tokenizer ---- */

typedef struct cache_entry {
    uint64_t hash;
    const uint8_t *key; /* NULL: empty slot */
    uint32_t key_len, n_ids;
    const int32_t *ids;
} cache_entry;

struct ts_tokenizer {
    int32_t n_tokens;
    ts__bytes *tokens;  /* id -> bytes */
    int32_t *tok_slots; /* open addressing: bytes -> id (NO_ID empty) */
    uint32_t tok_mask;
    int32_t byte_id[256];

    int32_t n_merges;
    int32_t (*merges)[2];  /* by rank */
    int32_t *merge_result; /* rank -> id */
    uint64_t *pair_keys;   /* open addressing: (a << 32 | b) -> rank */
    int32_t *pair_rank;
    uint32_t pair_mask;

    /* pieces of at least this many bytes merge through a heap
     * (SIZE_MAX: never; see [Note: merging through a heap]) */
    size_t heap_min_len;
    struct heap_item *heap;
    size_t heap_cap;
    int32_t *sym_next, *sym_prev; /* scratch of the heap path */
    size_t sym_cap;

    cache_entry *cache;
    uint32_t cache_mask, cache_used;
    arena_chunk *cache_arena;
    id_vec word; /* scratch: the piece being merged */
};

#define PAIR_EMPTY UINT64_MAX

typedef struct heap_item {
    int32_t rank;
    uint32_t pos; /* the left symbol's first byte in the piece */
} heap_item;

static uint32_t pow2_at_least(uint64_t n)
{
    uint32_t c = 16;
    while (c < n) c *= 2;
    return c;
}

static int32_t tok_find(const ts_tokenizer *t, const uint8_t *p, size_t n)
{
    for (uint32_t i = (uint32_t)hash_bytes(p, n) & t->tok_mask;; i = (i + 1) & t->tok_mask) {
        int32_t id = t->tok_slots[i];
        if (id == NO_ID) return NO_ID;
        if (t->tokens[id].len == n && memcmp(t->tokens[id].data, p, n) == 0) return id;
    }
}

static int32_t pair_find(const ts_tokenizer *t, int32_t a, int32_t b)
{
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    for (uint32_t i = (uint32_t)hash_u64(key) & t->pair_mask;; i = (i + 1) & t->pair_mask) {
        if (t->pair_keys[i] == key) return t->pair_rank[i];
        if (t->pair_keys[i] == PAIR_EMPTY) return NO_ID;
    }
}

void ts_tokenizer_free(ts_tokenizer *t)
{
    if (!t) return;
    for (int32_t i = 0; t->tokens && i < t->n_tokens; i++) ts__free(TAG, t->tokens[i].data);
    ts__free(TAG, t->tokens);
    ts__free(TAG, t->tok_slots);
    ts__free(TAG, t->merges);
    ts__free(TAG, t->merge_result);
    ts__free(TAG, t->pair_keys);
    ts__free(TAG, t->pair_rank);
    ts__free(TAG, t->cache);
    arena_free(&t->cache_arena);
    ts__free(TAG, t->word.v);
    ts__free(TAG, t->heap);
    ts__free(TAG, t->sym_next);
    ts__free(TAG, t->sym_prev);
    ts__free(TAG, t);
}

/* Takes the tokens (moved in), builds the bytes -> id index and checks
 * that every byte has its token. */
static ts_status build_vocab(ts_tokenizer *t, ts__bytes *tokens, int32_t n, const char *what)
{
    t->tokens = tokens;
    t->n_tokens = n;
    uint32_t cap = pow2_at_least((uint64_t)n * 2);
    t->tok_slots = ts__malloc(TAG, cap * sizeof *t->tok_slots);
    if (!t->tok_slots) return TS_ERR_NO_MEMORY;
    t->tok_mask = cap - 1;
    for (uint32_t i = 0; i < cap; i++) t->tok_slots[i] = NO_ID;
    for (int32_t id = 0; id < n; id++) {
        const ts__bytes *b = &tokens[id];
        if (b->len == 0) return ts_error(TS_ERR_FORMAT, "%s: token %d is empty", what, id);
        uint32_t i = (uint32_t)hash_bytes(b->data, b->len) & t->tok_mask;
        while (t->tok_slots[i] != NO_ID) {
            const ts__bytes *o = &tokens[t->tok_slots[i]];
            if (o->len == b->len && memcmp(o->data, b->data, b->len) == 0)
                return ts_error(TS_ERR_FORMAT, "%s: tokens %d and %d have the same bytes", what, t->tok_slots[i], id);
            i = (i + 1) & t->tok_mask;
        }
        t->tok_slots[i] = id;
    }
    for (int b = 0; b < 256; b++) {
        uint8_t c = (uint8_t)b;
        t->byte_id[b] = tok_find(t, &c, 1);
        if (t->byte_id[b] == NO_ID)
            return ts_error(TS_ERR_FORMAT, "%s: no token for the byte 0x%02x (GPT-2's character U+%04X)", what, b,
                            (unsigned)ts__byte_to_unicode(c));
    }
    return TS_OK;
}

/* Adds the merges (copied), by rank: each pair's result is the token of
 * the two tokens' bytes joined. A pair listed twice keeps its last rank,
 * as GPT-2's dict(zip(merges, range(...))) does. */
static ts_status add_merges(ts_tokenizer *t, const int32_t (*merges)[2], int32_t n, const char *what)
{
    t->n_merges = n;
    uint32_t cap = pow2_at_least((uint64_t)n * 2);
    t->merges = ts__malloc(TAG, (size_t)(n ? n : 1) * sizeof *t->merges);
    t->merge_result = ts__malloc(TAG, (size_t)(n ? n : 1) * sizeof *t->merge_result);
    t->pair_keys = ts__malloc(TAG, cap * sizeof *t->pair_keys);
    t->pair_rank = ts__malloc(TAG, cap * sizeof *t->pair_rank);
    if (!t->merges || !t->merge_result || !t->pair_keys || !t->pair_rank) return TS_ERR_NO_MEMORY;
    t->pair_mask = cap - 1;
    for (uint32_t i = 0; i < cap; i++) t->pair_keys[i] = PAIR_EMPTY;
    uint8_t *joined = NULL;
    size_t joined_cap = 0;
    ts_status st = TS_OK;
    for (int32_t r = 0; r < n && !st; r++) {
        int32_t a = merges[r][0], b = merges[r][1];
        if (a < 0 || a >= t->n_tokens || b < 0 || b >= t->n_tokens) {
            st = ts_error(TS_ERR_FORMAT, "%s: merge %d names token %d, outside the vocabulary of %d", what, r,
                          a < 0 || a >= t->n_tokens ? a : b, t->n_tokens);
            break;
        }
        size_t la = t->tokens[a].len, lb = t->tokens[b].len;
        if (la + lb > joined_cap) {
            ts__free(TAG, joined);
            joined_cap = 2 * (la + lb);
            joined = ts__malloc(TAG, joined_cap);
            if (!joined) {
                st = TS_ERR_NO_MEMORY;
                break;
            }
        }
        memcpy(joined, t->tokens[a].data, la);
        memcpy(joined + la, t->tokens[b].data, lb);
        int32_t res = tok_find(t, joined, la + lb);
        if (res == NO_ID) {
            st = ts_error(TS_ERR_FORMAT, "%s: merge %d joins tokens %d and %d into %zu bytes that are no token", what,
                          r, a, b, la + lb);
            break;
        }
        t->merges[r][0] = a;
        t->merges[r][1] = b;
        t->merge_result[r] = res;
        uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
        uint32_t i = (uint32_t)hash_u64(key) & t->pair_mask;
        while (t->pair_keys[i] != PAIR_EMPTY && t->pair_keys[i] != key) i = (i + 1) & t->pair_mask;
        t->pair_keys[i] = key;
        t->pair_rank[i] = r;
    }
    ts__free(TAG, joined);
    return st;
}

/* [Note: merging through a heap]
 * GPT-2's bpe() rescans the piece for its lowest-ranked pair after every
 * merge: quadratic in the piece's length (2.5 s for 100 KB of letters
 * without a space). Merging one pair at a time, lowest rank first and
 * leftmost first among equals, from a heap of the adjacent pairs, is
 * n log n, and gives the same result when no merge can create a pair
 * ranked below the one being merged: when, for every token s, every merge
 * that uses s ranks after every merge that makes s. Then the heap pops
 * ranks in order, all occurrences of one rank left to right as the
 * rescan merges them. Vocabularies learned by BPE have this by
 * construction (a token exists before a merge can use it; GPT-2's does),
 * so it is checked at load: a vocabulary without it keeps the rescan for
 * every piece. Short pieces keep the rescan too, which is faster there. */
static ts_status check_heap_order(ts_tokenizer *t)
{
    t->heap_min_len = SIZE_MAX;
    int32_t *max_make = ts__malloc(TAG, (size_t)t->n_tokens * sizeof *max_make);
    int32_t *min_use = ts__malloc(TAG, (size_t)t->n_tokens * sizeof *min_use);
    if (!max_make || !min_use) {
        ts__free(TAG, max_make);
        ts__free(TAG, min_use);
        return TS_ERR_NO_MEMORY;
    }
    for (int32_t i = 0; i < t->n_tokens; i++) {
        max_make[i] = -1;
        min_use[i] = INT32_MAX;
    }
    for (int32_t r = 0; r < t->n_merges; r++) {
        /* a pair listed twice is found at its last rank only */
        if (pair_find(t, t->merges[r][0], t->merges[r][1]) != r) continue;
        int32_t res = t->merge_result[r];
        if (r > max_make[res]) max_make[res] = r;
        for (int k = 0; k < 2; k++)
            if (r < min_use[t->merges[r][k]]) min_use[t->merges[r][k]] = r;
    }
    bool ordered = true;
    for (int32_t i = 0; i < t->n_tokens && ordered; i++) ordered = max_make[i] < min_use[i];
    ts__free(TAG, max_make);
    ts__free(TAG, min_use);
    if (ordered) t->heap_min_len = 48;
    return TS_OK;
}

void ts__tokenizer_set_heap_min_len(ts_tokenizer *t, size_t n) { t->heap_min_len = n; }

bool ts__tokenizer_heap_ordered(const ts_tokenizer *t) { return t->heap_min_len != SIZE_MAX; }

static ts_status cache_init(ts_tokenizer *t)
{
    TS_TRY(check_heap_order(t));
    uint32_t cap = 1u << 12;
    t->cache = ts__calloc(TAG, cap, sizeof *t->cache);
    if (!t->cache) return TS_ERR_NO_MEMORY;
    t->cache_mask = cap - 1;
    t->cache_used = 0;
    return TS_OK;
}

ts_status ts__tokenizer_build(ts__bytes *tokens, int32_t n_tokens, const int32_t (*merges)[2], int32_t n_merges,
                              const char *what, ts_tokenizer **tok_out)
{
    ts_tokenizer *t = ts__calloc(TAG, 1, sizeof *t);
    if (!t) {
        for (int32_t i = 0; i < n_tokens; i++) ts__free(TAG, tokens[i].data);
        ts__free(TAG, tokens);
        return TS_ERR_NO_MEMORY;
    }
    ts_status st = build_vocab(t, tokens, n_tokens, what);
    if (!st) st = add_merges(t, merges, n_merges, what);
    if (!st) st = cache_init(t);
    if (st) {
        ts_tokenizer_free(t);
        return st;
    }
    *tok_out = t;
    return TS_OK;
}

/* ---- reading GPT-2's files ---- */

static ts_status read_file(const char *path, const char *what, char **buf_out, size_t *len_out)
{
    FILE *f = fopen(path, "rb");
    if (!f) return ts_error(TS_ERR_IO, "ts_tokenizer_load: cannot open the %s '%s': %s", what, path, strerror(errno));
    struct stat sb;
    if (fstat(fileno(f), &sb) != 0 || !S_ISREG(sb.st_mode)) {
        fclose(f);
        return ts_error(TS_ERR_IO, "ts_tokenizer_load: the %s '%s' is not a regular file", what, path);
    }
    size_t len = (size_t)sb.st_size;
    char *buf = ts__malloc(TAG, len + 1);
    if (!buf) {
        fclose(f);
        return TS_ERR_NO_MEMORY;
    }
    size_t got = fread(buf, 1, len, f);
    int err = ferror(f) ? errno : 0;
    fclose(f);
    if (got != len) {
        ts__free(TAG, buf);
        return ts_error(TS_ERR_IO, "ts_tokenizer_load: reading the %s '%s' gave %zu of %zu bytes: %s", what, path, got,
                        len, err ? strerror(err) : "short read");
    }
    buf[len] = '\0';
    *buf_out = buf;
    *len_out = len;
    return TS_OK;
}

/* The byte each code point of GPT-2's alphabet stands for (-1: none). */
static void unicode_to_byte_table(int16_t table[0x144])
{
    for (int i = 0; i < 0x144; i++) table[i] = -1;
    for (int b = 0; b < 256; b++) table[ts__byte_to_unicode((uint8_t)b)] = (int16_t)b;
}

/* Translates a token string of GPT-2's alphabet (UTF-8, n bytes) into the
 * bytes it stands for, written to out (at most n bytes); false with the
 * offending code point (or 0xFFFFFFFF for invalid UTF-8) in *bad_out. */
static bool alphabet_to_bytes(const int16_t table[0x144], const uint8_t *s, size_t n, uint8_t *out, uint32_t *out_len,
                              uint32_t *bad_out)
{
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        size_t k;
        if (s[i] < 0x80) {
            cp = s[i], k = 1;
        } else if ((s[i] & 0xE0) == 0xC0 && i + 1 < n && (s[i + 1] & 0xC0) == 0x80) {
            cp = ((uint32_t)(s[i] & 0x1F) << 6) | (s[i + 1] & 0x3F), k = 2;
        } else {
            /* every character of the alphabet is below U+0800 */
            *bad_out = 0xFFFFFFFFu;
            if ((s[i] & 0xF0) == 0xE0 && i + 2 < n)
                *bad_out = ((uint32_t)(s[i] & 0x0F) << 12) | ((uint32_t)(s[i + 1] & 0x3F) << 6) | (s[i + 2] & 0x3F);
            return false;
        }
        if (cp >= 0x144 || table[cp] < 0) {
            *bad_out = cp;
            return false;
        }
        out[o++] = (uint8_t)table[cp];
        i += k;
    }
    *out_len = (uint32_t)o;
    return true;
}

static ts_status load_vocab(const char *path, ts__bytes **tokens_out, int32_t *n_out)
{
    char *buf = NULL;
    size_t len = 0;
    TS_TRY(read_file(path, "vocabulary", &buf, &len));
    json_error_t jerr;
    json_t *root = json_loadb(buf, len, JSON_REJECT_DUPLICATES, &jerr);
    ts__free(TAG, buf);
    if (!root)
        return ts_error(TS_ERR_FORMAT, "ts_tokenizer_load: vocabulary '%s': line %d column %d: %s", path, jerr.line,
                        jerr.column, jerr.text);
    ts_status st = TS_OK;
    ts__bytes *tokens = NULL;
    size_t n = json_is_object(root) ? json_object_size(root) : 0;
    if (!json_is_object(root))
        st = ts_error(TS_ERR_FORMAT, "ts_tokenizer_load: vocabulary '%s' is not a JSON object of token -> id", path);
    else if (n == 0 || n > (1u << 24))
        st = ts_error(TS_ERR_FORMAT, "ts_tokenizer_load: vocabulary '%s' has %zu tokens (1 to %u allowed)", path, n,
                      1u << 24);
    if (!st && !(tokens = ts__calloc(TAG, n, sizeof *tokens))) st = TS_ERR_NO_MEMORY;
    int16_t table[0x144];
    unicode_to_byte_table(table);
    const char *key;
    json_t *val;
    if (!st) {
        json_object_foreach(root, key, val)
        {
            if (!json_is_integer(val) || json_integer_value(val) < 0 || json_integer_value(val) >= (json_int_t)n) {
                st = ts_error(
                    TS_ERR_FORMAT, "ts_tokenizer_load: vocabulary '%s': token '%s' has %s; ids are the integers 0..%zu",
                    path, key, json_is_integer(val) ? "an id out of range" : "a value that is not an id", n - 1);
                break;
            }
            int32_t id = (int32_t)json_integer_value(val);
            if (tokens[id].data) {
                st = ts_error(TS_ERR_FORMAT, "ts_tokenizer_load: vocabulary '%s': id %d is given twice (token '%s')",
                              path, id, key);
                break;
            }
            size_t klen = strlen(key);
            uint8_t *bytes = ts__malloc(TAG, klen ? klen : 1);
            uint32_t blen = 0, bad = 0;
            if (!bytes) {
                st = TS_ERR_NO_MEMORY;
                break;
            }
            if (!alphabet_to_bytes(table, (const uint8_t *)key, klen, bytes, &blen, &bad)) {
                ts__free(TAG, bytes);
                st = ts_error(TS_ERR_FORMAT,
                              "ts_tokenizer_load: vocabulary '%s': token '%s' (id %d) has the character U+%04X, "
                              "which stands for no byte in GPT-2's byte-to-unicode alphabet",
                              path, key, id, (unsigned)bad);
                break;
            }
            if (blen == 0) {
                ts__free(TAG, bytes);
                st = ts_error(TS_ERR_FORMAT, "ts_tokenizer_load: vocabulary '%s': id %d is the empty token", path, id);
                break;
            }
            tokens[id].data = bytes;
            tokens[id].len = blen;
        }
    }
    json_decref(root);
    if (!st) {
        /* n distinct ids in [0, n): every id is there */
        *tokens_out = tokens;
        *n_out = (int32_t)n;
        return TS_OK;
    }
    for (size_t i = 0; tokens && i < n; i++) ts__free(TAG, tokens[i].data);
    ts__free(TAG, tokens);
    return st;
}

static bool is_blank(char c) { return c == ' ' || c == '\t' || c == '\r'; }

/* Parses the merges file into id pairs with the vocabulary's index. */
static ts_status load_merges(ts_tokenizer *t, const char *path, int32_t (**merges_out)[2], int32_t *n_out)
{
    char *buf = NULL;
    size_t len = 0;
    TS_TRY(read_file(path, "merges file", &buf, &len));
    size_t lines = 1;
    for (size_t i = 0; i < len; i++) lines += buf[i] == '\n';
    int32_t(*merges)[2] = ts__malloc(TAG, lines * sizeof *merges);
    uint8_t *bytes = ts__malloc(TAG, len + 1);
    int16_t table[0x144];
    unicode_to_byte_table(table);
    ts_status st = merges && bytes ? TS_OK : TS_ERR_NO_MEMORY;
    int32_t n = 0;
    size_t line_no = 0;
    for (size_t pos = 0; pos < len && !st;) {
        size_t end = pos;
        while (end < len && buf[end] != '\n') end++;
        line_no++;
        size_t next = end + 1;
        if (line_no == 1 && end - pos >= 8 && memcmp(buf + pos, "#version", 8) == 0) {
            pos = next;
            continue;
        }
        /* fields separated by blanks */
        size_t f_start[3], f_len[3];
        int nf = 0;
        for (size_t i = pos; i < end;) {
            while (i < end && is_blank(buf[i])) i++;
            if (i == end) break;
            size_t s = i;
            while (i < end && !is_blank(buf[i])) i++;
            if (nf < 3) {
                f_start[nf] = s;
                f_len[nf] = i - s;
            }
            nf++;
        }
        if (nf == 0) {
            pos = next;
            continue;
        }
        if (nf != 2) {
            st = ts_error(TS_ERR_FORMAT,
                          "ts_tokenizer_load: merges file '%s' line %zu: %d fields ('%.*s'); a merge is "
                          "two tokens separated by a space",
                          path, line_no, nf, (int)(end - pos > 80 ? 80 : end - pos), buf + pos);
            break;
        }
        for (int f = 0; f < 2 && !st; f++) {
            uint32_t blen = 0, bad = 0;
            const char *tokstr = buf + f_start[f];
            int32_t id = NO_ID;
            if (alphabet_to_bytes(table, (const uint8_t *)tokstr, f_len[f], bytes, &blen, &bad))
                id = tok_find(t, bytes, blen);
            if (id == NO_ID)
                st = ts_error(TS_ERR_FORMAT,
                              "ts_tokenizer_load: merges file '%s' line %zu: the token '%.*s' is not "
                              "in the vocabulary",
                              path, line_no, (int)f_len[f], tokstr);
            else merges[n][f] = id;
        }
        n++;
        pos = next;
    }
    ts__free(TAG, buf);
    ts__free(TAG, bytes);
    if (st) {
        ts__free(TAG, merges);
        return st;
    }
    *merges_out = merges;
    *n_out = n;
    return TS_OK;
}

ts_status ts_tokenizer_load(const char *vocab_path, const char *merges_path, ts_tokenizer **tok_out)
{
    if (!vocab_path || !merges_path || !tok_out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_tokenizer_load: NULL %s",
                        !vocab_path        ? "vocab_path"
                            : !merges_path ? "merges_path"
                                           : "tok_out");
    ts__bytes *tokens = NULL;
    int32_t n_tokens = 0;
    TS_TRY(load_vocab(vocab_path, &tokens, &n_tokens));
    ts_tokenizer *t = ts__calloc(TAG, 1, sizeof *t);
    if (!t) {
        for (int32_t i = 0; i < n_tokens; i++) ts__free(TAG, tokens[i].data);
        ts__free(TAG, tokens);
        return TS_ERR_NO_MEMORY;
    }
    char what[64 + 4096];
    snprintf(what, sizeof what, "ts_tokenizer_load: '%s'", vocab_path);
    ts_status st = build_vocab(t, tokens, n_tokens, what);
    int32_t(*merges)[2] = NULL;
    int32_t n_merges = 0;
    if (!st) st = load_merges(t, merges_path, &merges, &n_merges);
    if (!st) {
        snprintf(what, sizeof what, "ts_tokenizer_load: '%s'", merges_path);
        st = add_merges(t, (const int32_t(*)[2])merges, n_merges, what);
    }
    ts__free(TAG, merges);
    if (!st) st = cache_init(t);
    if (st) {
        ts_tokenizer_free(t);
        return st;
    }
    *tok_out = t;
    return TS_OK;
}

int32_t ts_tokenizer_vocab_size(const ts_tokenizer *t) { return t ? t->n_tokens : 0; }

int32_t ts_tokenizer_merge_count(const ts_tokenizer *t) { return t ? t->n_merges : 0; }

/* ---- encoding ---- */

/* Applies the merges to t->word (GPT-2's bpe()). */
static void bpe_merge(ts_tokenizer *t)
{
    int32_t *w = t->word.v;
    size_t n = t->word.n;
    while (n >= 2) {
        int32_t best = NO_ID;
        for (size_t i = 0; i + 1 < n; i++) {
            int32_t r = pair_find(t, w[i], w[i + 1]);
            if (r != NO_ID && (best == NO_ID || r < best)) best = r;
        }
        if (best == NO_ID) break;
        int32_t a = t->merges[best][0], b = t->merges[best][1], res = t->merge_result[best];
        size_t o = 0;
        for (size_t i = 0; i < n;) {
            if (i + 1 < n && w[i] == a && w[i + 1] == b) {
                w[o++] = res;
                i += 2;
            } else {
                w[o++] = w[i++];
            }
        }
        n = o;
    }
    t->word.n = n;
}

static bool heap_less(heap_item a, heap_item b) { return a.rank < b.rank || (a.rank == b.rank && a.pos < b.pos); }

static void heap_push(heap_item *h, size_t *n, heap_item it)
{
    size_t i = (*n)++;
    while (i > 0 && heap_less(it, h[(i - 1) / 2])) {
        h[i] = h[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    h[i] = it;
}

static heap_item heap_pop(heap_item *h, size_t *n)
{
    heap_item top = h[0], last = h[--*n];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && heap_less(h[c + 1], h[c])) c++;
        if (!heap_less(h[c], last)) break;
        h[i] = h[c];
        i = c;
    }
    if (*n) h[i] = last;
    return top;
}

/* The heap form of bpe_merge for t->word (see [Note: merging through a
 * heap]): symbols are a linked list over the byte positions; a popped
 * pair is still valid when its left symbol is alive and the pair there
 * still has the popped rank (a rank names one pair). */
static ts_status bpe_merge_heap(ts_tokenizer *t)
{
    size_t n = t->word.n;
    if (n > t->sym_cap) {
        ts__free(TAG, t->sym_next);
        ts__free(TAG, t->sym_prev);
        ts__free(TAG, t->heap);
        t->sym_cap = 0;
        t->sym_next = ts__malloc(TAG, n * sizeof *t->sym_next);
        t->sym_prev = ts__malloc(TAG, n * sizeof *t->sym_prev);
        t->heap = ts__malloc(TAG, n * 3 * sizeof *t->heap);
        if (!t->sym_next || !t->sym_prev || !t->heap) return TS_ERR_NO_MEMORY;
        t->sym_cap = n;
        t->heap_cap = 3 * n;
    }
    int32_t *w = t->word.v, *next = t->sym_next, *prev = t->sym_prev;
    heap_item *h = t->heap;
    size_t hn = 0;
    for (size_t i = 0; i < n; i++) {
        next[i] = i + 1 < n ? (int32_t)(i + 1) : -1;
        prev[i] = (int32_t)i - 1;
    }
    for (size_t i = 0; i + 1 < n; i++) {
        int32_t r = pair_find(t, w[i], w[i + 1]);
        if (r != NO_ID) heap_push(h, &hn, (heap_item){r, (uint32_t)i});
    }
    /* n - 1 pairs at first, and each of the at most n - 1 merges pushes
     * at most two: the heap never holds more than 3n items */
    while (hn) {
        heap_item it = heap_pop(h, &hn);
        int32_t p = (int32_t)it.pos;
        if (w[p] == NO_ID || next[p] < 0 || pair_find(t, w[p], w[next[p]]) != it.rank) continue;
        int32_t q = next[p];
        w[p] = t->merge_result[it.rank];
        w[q] = NO_ID;
        next[p] = next[q];
        if (next[q] >= 0) prev[next[q]] = p;
        int32_t r;
        if (prev[p] >= 0 && (r = pair_find(t, w[prev[p]], w[p])) != NO_ID)
            heap_push(h, &hn, (heap_item){r, (uint32_t)prev[p]});
        if (next[p] >= 0 && (r = pair_find(t, w[p], w[next[p]])) != NO_ID)
            heap_push(h, &hn, (heap_item){r, (uint32_t)p});
    }
    size_t o = 0;
    for (int32_t i = 0; i >= 0 && (size_t)i < n; i = next[i]) w[o++] = w[i];
    t->word.n = o;
    return TS_OK;
}

static void cache_clear(ts_tokenizer *t)
{
    memset(t->cache, 0, ((size_t)t->cache_mask + 1) * sizeof *t->cache);
    t->cache_used = 0;
    arena_free(&t->cache_arena);
}

static ts_status cache_grow(ts_tokenizer *t)
{
    uint32_t cap = (t->cache_mask + 1) * 2;
    cache_entry *c = ts__calloc(TAG, cap, sizeof *c);
    if (!c) return TS_ERR_NO_MEMORY;
    for (uint32_t i = 0; i <= t->cache_mask; i++) {
        cache_entry *e = &t->cache[i];
        if (!e->key) continue;
        uint32_t j = (uint32_t)e->hash & (cap - 1);
        while (c[j].key) j = (j + 1) & (cap - 1);
        c[j] = *e;
    }
    ts__free(TAG, t->cache);
    t->cache = c;
    t->cache_mask = cap - 1;
    return TS_OK;
}

/* Appends the ids of one piece to out, through the cache. */
static ts_status encode_piece(ts_tokenizer *t, const uint8_t *p, size_t n, id_vec *out)
{
    uint64_t h = hash_bytes(p, n);
    uint32_t i = (uint32_t)h & t->cache_mask;
    for (; t->cache[i].key; i = (i + 1) & t->cache_mask) {
        const cache_entry *e = &t->cache[i];
        if (e->hash == h && e->key_len == n && memcmp(e->key, p, n) == 0) {
            if (!vec_reserve(out, out->n + e->n_ids)) return TS_ERR_NO_MEMORY;
            memcpy(out->v + out->n, e->ids, e->n_ids * sizeof *e->ids);
            out->n += e->n_ids;
            return TS_OK;
        }
    }
    t->word.n = 0;
    if (!vec_reserve(&t->word, n)) return TS_ERR_NO_MEMORY;
    for (size_t k = 0; k < n; k++) t->word.v[k] = t->byte_id[p[k]];
    t->word.n = n;
    if (n >= t->heap_min_len && n < INT32_MAX) TS_TRY(bpe_merge_heap(t));
    else bpe_merge(t);
    if (!vec_reserve(out, out->n + t->word.n)) return TS_ERR_NO_MEMORY;
    memcpy(out->v + out->n, t->word.v, t->word.n * sizeof *t->word.v);
    out->n += t->word.n;

    /* remember it (a piece longer than 4 GiB is never cached) */
    if (n > UINT32_MAX) return TS_OK;
    if (t->cache_used >= CACHE_MAX_ENTRIES) {
        cache_clear(t);
        i = (uint32_t)h & t->cache_mask;
    } else if ((t->cache_used + 1) * 2 > t->cache_mask + 1) {
        TS_TRY(cache_grow(t));
        i = (uint32_t)h & t->cache_mask;
        while (t->cache[i].key) i = (i + 1) & t->cache_mask;
    }
    uint8_t *key = arena_alloc(&t->cache_arena, n + t->word.n * sizeof(int32_t));
    if (!key) return TS_ERR_NO_MEMORY;
    /* ids first, so that they stay 4-byte aligned */
    int32_t *ids = (int32_t *)key;
    memcpy(ids, t->word.v, t->word.n * sizeof *ids);
    memcpy(key + t->word.n * sizeof *ids, p, n);
    t->cache[i] = (cache_entry){.hash = h,
                                .key = key + t->word.n * sizeof *ids,
                                .key_len = (uint32_t)n,
                                .n_ids = (uint32_t)t->word.n,
                                .ids = ids};
    t->cache_used++;
    return TS_OK;
}

ts_status ts_tokenizer_encode(ts_tokenizer *t, const char *text, size_t len, int32_t **ids_out, size_t *n_out)
{
    if (!t || !ids_out || !n_out || (!text && len > 0))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_tokenizer_encode: NULL %s",
                        !t             ? "tokenizer"
                            : !ids_out ? "ids_out"
                            : !n_out   ? "n_out"
                                       : "text with len > 0");
    const uint8_t *s = (const uint8_t *)text;
    id_vec out = {0};
    ts_status st = TS_OK;
    for (size_t pos = 0; pos < len && !st;) {
        size_t end = ts__pretoken_end(s, len, pos);
        st = encode_piece(t, s + pos, end - pos, &out);
        pos = end;
    }
    if (st) {
        ts__free(TAG, out.v);
        return st;
    }
    if (out.n == 0) {
        ts__free(TAG, out.v);
        out.v = NULL;
    }
    *ids_out = out.v;
    *n_out = out.n;
    return TS_OK;
}

/* ---- decoding ---- */

ts_status ts_tokenizer_decode(const ts_tokenizer *t, const int32_t *ids, size_t n, char **bytes_out, size_t *len_out)
{
    if (!t || !bytes_out || !len_out || (!ids && n > 0))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_tokenizer_decode: NULL %s",
                        !t               ? "tokenizer"
                            : !bytes_out ? "bytes_out"
                            : !len_out   ? "len_out"
                                         : "ids with n > 0");
    if (n > (size_t)PTRDIFF_MAX / sizeof *ids)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_tokenizer_decode: n %zu ids: more than any array holds", n);
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= t->n_tokens)
            return ts_error(TS_ERR_INDEX,
                            "ts_tokenizer_decode: id %d at position %zu is outside the vocabulary [0, %d)", ids[i], i,
                            t->n_tokens);
        total += t->tokens[ids[i]].len;
    }
    char *buf = ts__malloc(TAG, total + 1);
    if (!buf) return TS_ERR_NO_MEMORY;
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        memcpy(buf + o, t->tokens[ids[i]].data, t->tokens[ids[i]].len);
        o += t->tokens[ids[i]].len;
    }
    buf[o] = '\0';
    *bytes_out = buf;
    *len_out = o;
    return TS_OK;
}

ts_status ts_tokenizer_token_bytes(const ts_tokenizer *t, int32_t id, const char **bytes_out, size_t *len_out)
{
    if (!t || !bytes_out || !len_out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_tokenizer_token_bytes: NULL %s",
                        !t               ? "tokenizer"
                            : !bytes_out ? "bytes_out"
                                         : "len_out");
    if (id < 0 || id >= t->n_tokens)
        return ts_error(TS_ERR_INDEX, "ts_tokenizer_token_bytes: id %d is outside the vocabulary [0, %d)", id,
                        t->n_tokens);
    *bytes_out = (const char *)t->tokens[id].data;
    *len_out = t->tokens[id].len;
    return TS_OK;
}

ts_status ts_tokenizer_token_id(const ts_tokenizer *t, const char *token, int32_t *id_out)
{
    if (!t || !token || !id_out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_tokenizer_token_id: NULL %s",
                        !t           ? "tokenizer"
                            : !token ? "token"
                                     : "id_out");
    int32_t id = tok_find(t, (const uint8_t *)token, strlen(token));
    if (id == NO_ID)
        return ts_error(TS_ERR_NOT_FOUND, "ts_tokenizer_token_id: no token '%s' in the vocabulary of %d", token,
                        t->n_tokens);
    *id_out = id;
    return TS_OK;
}

void ts_tokenizer_buffer_free(void *buffer) { ts__free(TAG, buffer); }

/* ---- saving ---- */

typedef struct str_buf {
    char *p;
    size_t n, cap;
    bool oom;
} str_buf;

static void sb_put(str_buf *b, const void *data, size_t n)
{
    if (b->oom) return;
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->n + n) cap *= 2;
        char *p = ts__malloc(TAG, cap);
        if (!p) {
            b->oom = true;
            return;
        }
        if (b->n) memcpy(p, b->p, b->n);
        ts__free(TAG, b->p);
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, data, n);
    b->n += n;
}

static void sb_str(str_buf *b, const char *s) { sb_put(b, s, strlen(s)); }

/* A token in GPT-2's alphabet, UTF-8; with JSON escapes when json. */
static void sb_token(str_buf *b, const ts__bytes *tok, bool json)
{
    for (uint32_t i = 0; i < tok->len; i++) {
        uint32_t cp = ts__byte_to_unicode(tok->data[i]);
        char u[2];
        if (json && (cp == '"' || cp == '\\')) {
            u[0] = '\\', u[1] = (char)cp;
            sb_put(b, u, 2);
        } else if (cp < 0x80) {
            u[0] = (char)cp;
            sb_put(b, u, 1);
        } else {
            u[0] = (char)(0xC0 | (cp >> 6)), u[1] = (char)(0x80 | (cp & 0x3F));
            sb_put(b, u, 2);
        }
    }
}

static ts_status write_all(const char *op, int fd, const void *p, size_t n, const char *path, const char *tmp)
{
    const char *c = p;
    while (n) {
        ssize_t w = write(fd, c, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0)
            return ts_error(TS_ERR_IO, "%s: cannot write '%s' (temporary '%s'): %s", op, path, tmp,
                            w < 0 ? strerror(errno) : "no progress");
        c += w;
        n -= (size_t)w;
    }
    return TS_OK;
}

/* Gives the written temporary file its mode, closes it and renames it over
 * path; on any failure (st included) removes it. Frees tmp. */
static ts_status finish_atomic(const char *op, int fd, char *tmp, const char *path, ts_status st)
{
    if (!st && fchmod(fd, (mode_t)ts__file_mode(0644)) != 0)
        st = ts_error(TS_ERR_IO, "%s: setting the mode of '%s' failed: %s", op, tmp, strerror(errno));
    if (close(fd) != 0 && !st)
        st = ts_error(TS_ERR_IO, "%s: cannot write '%s' (temporary '%s'): %s", op, path, tmp, strerror(errno));
    if (!st && rename(tmp, path) != 0)
        st = ts_error(TS_ERR_IO, "%s: cannot rename '%s' to '%s': %s", op, tmp, path, strerror(errno));
    if (st) unlink(tmp);
    ts__free(TAG, tmp);
    return st;
}

static ts_status write_atomic(const char *path, const str_buf *b)
{
    static const char op[] = "ts_tokenizer_save";
    char *tmp = NULL;
    int fd = -1;
    TS_TRY(ts__tmp_create_beside(TAG, op, path, &tmp, &fd));
    return finish_atomic(op, fd, tmp, path, write_all(op, fd, b->p, b->n, path, tmp));
}

ts_status ts_tokenizer_save(const ts_tokenizer *t, const char *vocab_path, const char *merges_path)
{
    if (!t || !vocab_path || !merges_path)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_tokenizer_save: NULL %s",
                        !t                ? "tokenizer"
                            : !vocab_path ? "vocab_path"
                                          : "merges_path");
    str_buf v = {0}, m = {0};
    sb_str(&v, "{");
    for (int32_t id = 0; id < t->n_tokens; id++) {
        char num[32];
        sb_str(&v, id ? ", \"" : "\"");
        sb_token(&v, &t->tokens[id], true);
        snprintf(num, sizeof num, "\": %d", id);
        sb_str(&v, num);
    }
    sb_str(&v, "}");
    sb_str(&m, "#version: 0.2\n");
    for (int32_t r = 0; r < t->n_merges; r++) {
        sb_token(&m, &t->tokens[t->merges[r][0]], false);
        sb_str(&m, " ");
        sb_token(&m, &t->tokens[t->merges[r][1]], false);
        sb_str(&m, "\n");
    }
    ts_status st = v.oom || m.oom ? ts_error(TS_ERR_NO_MEMORY, "ts_tokenizer_save: out of memory") : TS_OK;
    if (!st) st = write_atomic(vocab_path, &v);
    if (!st) st = write_atomic(merges_path, &m);
    ts__free(TAG, v.p);
    ts__free(TAG, m.p);
    return st;
}

/* ---- llm.c's token files ---- */

ts_status ts_tokenizer_write_bin(const int32_t *ids, size_t n, const char *path)
{
    static const char op[] = "ts_tokenizer_write_bin";
    if (!path || (!ids && n > 0))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL %s", op, !path ? "path" : "ids with n > 0");
    if (n > INT32_MAX)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: %zu tokens; the header's count holds at most %d", op, n,
                        INT32_MAX);
    for (size_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] > UINT16_MAX)
            return ts_error(TS_ERR_INDEX,
                            "%s: id %d at position %zu does not fit in uint16 (a vocabulary of at "
                            "most 65536 tokens)",
                            op, ids[i], i);
    char *tmp = NULL;
    int fd = -1;
    TS_TRY(ts__tmp_create_beside(TAG, op, path, &tmp, &fd));
    int32_t header[TS_TOKENS_BIN_HEADER_INTS] = {TS_TOKENS_BIN_MAGIC, TS_TOKENS_BIN_VERSION, (int32_t)n};
    ts_status st = write_all(op, fd, header, sizeof header, path, tmp);
    uint16_t chunk[8192];
    for (size_t i = 0; i < n && !st;) {
        size_t k = 0;
        for (; k < 8192 && i < n; k++, i++) chunk[k] = (uint16_t)ids[i];
        st = write_all(op, fd, chunk, k * sizeof *chunk, path, tmp);
    }
    return finish_atomic(op, fd, tmp, path, st);
}
