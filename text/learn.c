/* Learning a byte-level BPE vocabulary from a text (text/tokenizer.h:
 * ts_tokenizer_learn; docs/tokenizer.md).
 *
 * GPT-2's algorithm (Sennrich et al.'s BPE over bytes): the text is split
 * into pieces by the pre-tokenizer, identical pieces are counted, each
 * distinct piece starts as its bytes' tokens, and then, until the
 * vocabulary is full, the adjacent pair with the highest count (summed
 * over the pieces, each weighted by how often it occurs) becomes a merge
 * and a new token, and every occurrence of it in every piece is merged
 * left to right. Ties go to the smallest (left id, right id), so the
 * result depends only on the text and the size.
 *
 * Pair counts are kept up to date incrementally: merging a pair changes
 * only the pieces that hold it, and only their pairs' counts are
 * adjusted; the pieces holding a pair are found through a per-pair list
 * of piece indices (which may hold stale entries, checked when used). */
#include "text/internal.h"

#include <string.h>

#define TAG TS_MEM_OTHER

typedef struct piece {
    int32_t *ids;
    uint32_t n;
    int64_t count;
} piece;

/* A pair's entry: its count and the pieces that held it when counted. */
typedef struct pair_entry {
    uint64_t key; /* a << 32 | b; UINT64_MAX: empty */
    int64_t count;
    uint32_t *where; /* piece indices, may repeat or be stale */
    uint32_t n_where, cap_where;
} pair_entry;

typedef struct pair_map {
    pair_entry *e;
    uint32_t mask, used;
} pair_map;

static uint64_t mix(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static uint64_t hash_bytes(const uint8_t *p, size_t n)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 1099511628211ull;
    }
    return h;
}

static bool pm_init(pair_map *m, uint32_t cap)
{
    m->e = ts__malloc(TAG, (size_t)cap * sizeof *m->e);
    if (!m->e) return false;
    for (uint32_t i = 0; i < cap; i++) m->e[i] = (pair_entry){.key = UINT64_MAX};
    m->mask = cap - 1;
    m->used = 0;
    return true;
}

static void pm_fini(pair_map *m)
{
    for (uint32_t i = 0; m->e && i <= m->mask; i++) ts__free(TAG, m->e[i].where);
    ts__free(TAG, m->e);
    m->e = NULL;
}

static pair_entry *pm_get(pair_map *m, uint64_t key, bool *oom)
{
    uint32_t i = (uint32_t)mix(key) & m->mask;
    while (m->e[i].key != UINT64_MAX && m->e[i].key != key) i = (i + 1) & m->mask;
    if (m->e[i].key == key) return &m->e[i];
    if ((m->used + 1) * 2 > m->mask + 1) {
        pair_map bigger;
        if (!pm_init(&bigger, (m->mask + 1) * 2)) {
            *oom = true;
            return NULL;
        }
        for (uint32_t j = 0; j <= m->mask; j++) {
            if (m->e[j].key == UINT64_MAX) continue;
            uint32_t k = (uint32_t)mix(m->e[j].key) & bigger.mask;
            while (bigger.e[k].key != UINT64_MAX) k = (k + 1) & bigger.mask;
            bigger.e[k] = m->e[j];
        }
        bigger.used = m->used;
        ts__free(TAG, m->e);
        *m = bigger;
        i = (uint32_t)mix(key) & m->mask;
        while (m->e[i].key != UINT64_MAX) i = (i + 1) & m->mask;
    }
    m->e[i].key = key;
    m->used++;
    return &m->e[i];
}

static uint64_t pkey(int32_t a, int32_t b) { return ((uint64_t)(uint32_t)a << 32) | (uint32_t)b; }

/* Adds `delta` to the count of every adjacent pair of p (index pi);
 * records pi in the pair's list when adding. */
static bool count_pairs(pair_map *m, const piece *p, uint32_t pi, int64_t delta)
{
    bool oom = false;
    for (uint32_t i = 0; i + 1 < p->n; i++) {
        pair_entry *e = pm_get(m, pkey(p->ids[i], p->ids[i + 1]), &oom);
        if (!e) return false;
        e->count += delta;
        if (delta > 0 && (e->n_where == 0 || e->where[e->n_where - 1] != pi)) {
            if (e->n_where == e->cap_where) {
                uint32_t cap = e->cap_where ? e->cap_where * 2 : 4;
                uint32_t *w = ts__malloc(TAG, (size_t)cap * sizeof *w);
                if (!w) return false;
                if (e->n_where) memcpy(w, e->where, e->n_where * sizeof *w);
                ts__free(TAG, e->where);
                e->where = w;
                e->cap_where = cap;
            }
            e->where[e->n_where++] = pi;
        }
    }
    return true;
}

/* The distinct pieces of the text with their counts. */
static ts_status split_pieces(const uint8_t *s, size_t len, piece **pieces_out, uint32_t *n_out)
{
    /* open addressing over (offset, length) of a first occurrence */
    uint32_t cap = 1024, used = 0;
    struct slot {
        size_t off;
        uint32_t len, idx; /* idx + 1; 0: empty */
    } *slots = ts__calloc(TAG, cap, sizeof *slots);
    piece *pieces = NULL;
    size_t *offs = NULL;
    uint32_t n = 0, pcap = 0;
    ts_status st = slots ? TS_OK : TS_ERR_NO_MEMORY;
    for (size_t pos = 0; pos < len && !st;) {
        size_t end = ts__pretoken_end(s, len, pos);
        if (end - pos > UINT32_MAX) {
            st = ts_error(TS_ERR_INVALID_ARGUMENT,
                          "ts_tokenizer_learn: a piece of %zu bytes at offset %zu is "
                          "longer than 4 GiB",
                          end - pos, pos);
            break;
        }
        uint32_t plen = (uint32_t)(end - pos);
        uint64_t h = hash_bytes(s + pos, plen);
        uint32_t i = (uint32_t)h & (cap - 1);
        while (slots[i].idx && !(slots[i].len == plen && memcmp(s + slots[i].off, s + pos, plen) == 0))
            i = (i + 1) & (cap - 1);
        if (slots[i].idx) {
            pieces[slots[i].idx - 1].count++;
        } else {
            if (n == pcap) {
                uint32_t c2 = pcap ? pcap * 2 : 1024;
                piece *p2 = ts__malloc(TAG, (size_t)c2 * sizeof *p2);
                size_t *o2 = ts__malloc(TAG, (size_t)c2 * sizeof *o2);
                if (!p2 || !o2) {
                    ts__free(TAG, p2);
                    ts__free(TAG, o2);
                    st = TS_ERR_NO_MEMORY;
                    break;
                }
                if (n) {
                    memcpy(p2, pieces, n * sizeof *p2);
                    memcpy(o2, offs, n * sizeof *o2);
                }
                ts__free(TAG, pieces);
                ts__free(TAG, offs);
                pieces = p2, offs = o2, pcap = c2;
            }
            pieces[n] = (piece){.ids = NULL, .n = plen, .count = 1};
            offs[n] = pos;
            slots[i] = (struct slot){.off = pos, .len = plen, .idx = ++n};
            if (++used * 2 > cap) {
                uint32_t c2 = cap * 2;
                struct slot *s2 = ts__calloc(TAG, c2, sizeof *s2);
                if (!s2) {
                    st = TS_ERR_NO_MEMORY;
                    break;
                }
                for (uint32_t j = 0; j < cap; j++) {
                    if (!slots[j].idx) continue;
                    uint32_t k = (uint32_t)hash_bytes(s + slots[j].off, slots[j].len) & (c2 - 1);
                    while (s2[k].idx) k = (k + 1) & (c2 - 1);
                    s2[k] = slots[j];
                }
                ts__free(TAG, slots);
                slots = s2, cap = c2;
            }
        }
        pos = end;
    }
    ts__free(TAG, slots);
    int32_t rank[256];
    for (int b = 0; b < 256; b++) rank[b] = ts__byte_rank((uint8_t)b);
    for (uint32_t i = 0; i < n && !st; i++) {
        pieces[i].ids = ts__malloc(TAG, (size_t)pieces[i].n * sizeof(int32_t));
        if (!pieces[i].ids) {
            st = TS_ERR_NO_MEMORY;
            break;
        }
        for (uint32_t k = 0; k < pieces[i].n; k++) pieces[i].ids[k] = rank[s[offs[i] + k]];
    }
    ts__free(TAG, offs);
    if (st) {
        for (uint32_t i = 0; i < n; i++) ts__free(TAG, pieces[i].ids);
        ts__free(TAG, pieces);
        return st;
    }
    *pieces_out = pieces;
    *n_out = n;
    return TS_OK;
}

/* Finds the token of the bytes a ++ b among tokens[0..n) through a map
 * of token hashes; returns -1 when none. Kept simple: the learned
 * vocabulary is small next to the pieces. */
typedef struct tok_map {
    int32_t *slot;
    uint32_t mask;
} tok_map;

static bool tm_insert(tok_map *m, const ts__bytes *tokens, int32_t id)
{
    uint32_t i = (uint32_t)hash_bytes(tokens[id].data, tokens[id].len) & m->mask;
    while (m->slot[i] >= 0) i = (i + 1) & m->mask;
    m->slot[i] = id;
    return true;
}

static int32_t tm_find(const tok_map *m, const ts__bytes *tokens, const uint8_t *p, uint32_t n)
{
    for (uint32_t i = (uint32_t)hash_bytes(p, n) & m->mask;; i = (i + 1) & m->mask) {
        int32_t id = m->slot[i];
        if (id < 0) return -1;
        if (tokens[id].len == n && memcmp(tokens[id].data, p, n) == 0) return id;
    }
}

ts_status ts_tokenizer_learn(const char *text, size_t len, int32_t vocab_size, ts_tokenizer **tok_out)
{
    if (!tok_out || (!text && len > 0))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_tokenizer_learn: NULL %s", !tok_out ? "tok_out" : "text");
    if (vocab_size < 257 || vocab_size > (1 << 24))
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "ts_tokenizer_learn: vocab_size %d; it must hold the 256 bytes and <|endoftext|> (>= 257) "
                        "and be at most %d",
                        vocab_size, 1 << 24);
    piece *pieces = NULL;
    uint32_t n_pieces = 0;
    TS_TRY(split_pieces((const uint8_t *)text, len, &pieces, &n_pieces));

    int32_t max_tokens = vocab_size - 1; /* the last is <|endoftext|> */
    ts__bytes *tokens = ts__calloc(TAG, (size_t)vocab_size, sizeof *tokens);
    /* merges can outnumber new tokens (two merges may make the same
     * bytes), but each merge removes at least one token from the pieces */
    size_t merge_cap = 1024;
    int32_t(*merges)[2] = ts__malloc(TAG, merge_cap * sizeof *merges);
    uint32_t tcap = 16;
    while (tcap < (uint32_t)vocab_size * 2u) tcap *= 2;
    tok_map tm = {.slot = ts__malloc(TAG, (size_t)tcap * sizeof(int32_t)), .mask = tcap - 1};
    pair_map pm = {0};
    ts_status st = tokens && merges && tm.slot && pm_init(&pm, 1024) ? TS_OK : TS_ERR_NO_MEMORY;
    int32_t n_tokens = 0, n_merges = 0;
    for (uint32_t i = 0; !st && i <= tm.mask; i++) tm.slot[i] = -1;
    for (int b = 0; b < 256 && !st; b++) {
        int32_t id = ts__byte_rank((uint8_t)b);
        tokens[id].data = ts__malloc(TAG, 1);
        if (!tokens[id].data) {
            st = TS_ERR_NO_MEMORY;
            break;
        }
        tokens[id].data[0] = (uint8_t)b;
        tokens[id].len = 1;
    }
    if (!st) {
        n_tokens = 256;
        for (int32_t id = 0; id < 256; id++) tm_insert(&tm, tokens, id);
    }
    for (uint32_t i = 0; i < n_pieces && !st; i++)
        if (!count_pairs(&pm, &pieces[i], i, pieces[i].count)) st = TS_ERR_NO_MEMORY;

    uint8_t *joined = NULL;
    uint32_t joined_cap = 0;
    while (!st && n_tokens < max_tokens) {
        /* the best pair: highest count, then smallest (a, b) */
        pair_entry *best = NULL;
        for (uint32_t i = 0; i <= pm.mask; i++) {
            pair_entry *e = &pm.e[i];
            if (e->key == UINT64_MAX || e->count <= 0) continue;
            if (!best || e->count > best->count || (e->count == best->count && e->key < best->key)) best = e;
        }
        if (!best) break; /* every piece is one token */
        int32_t a = (int32_t)(best->key >> 32), b = (int32_t)(best->key & 0xFFFFFFFFu);
        uint32_t jl = tokens[a].len + tokens[b].len;
        if (jl > joined_cap) {
            ts__free(TAG, joined);
            joined_cap = jl * 2;
            if (!(joined = ts__malloc(TAG, joined_cap))) {
                st = TS_ERR_NO_MEMORY;
                break;
            }
        }
        memcpy(joined, tokens[a].data, tokens[a].len);
        memcpy(joined + tokens[a].len, tokens[b].data, tokens[b].len);
        int32_t res = tm_find(&tm, tokens, joined, jl);
        if (res < 0) {
            res = n_tokens;
            if (!(tokens[res].data = ts__malloc(TAG, jl))) {
                st = TS_ERR_NO_MEMORY;
                break;
            }
            memcpy(tokens[res].data, joined, jl);
            tokens[res].len = jl;
            n_tokens++;
            tm_insert(&tm, tokens, res);
        }
        if ((size_t)n_merges == merge_cap) {
            int32_t(*m2)[2] = ts__malloc(TAG, 2 * merge_cap * sizeof *m2);
            if (!m2) {
                st = TS_ERR_NO_MEMORY;
                break;
            }
            memcpy(m2, merges, merge_cap * sizeof *m2);
            ts__free(TAG, merges);
            merges = m2;
            merge_cap *= 2;
        }
        merges[n_merges][0] = a;
        merges[n_merges][1] = b;
        n_merges++;

        /* merge it in every piece that holds it; the list is taken from
         * the entry first (the map may grow while counting) */
        uint32_t *where = best->where, n_where = best->n_where;
        best->where = NULL;
        best->n_where = best->cap_where = 0;
        for (uint32_t k = 0; k < n_where && !st; k++) {
            uint32_t pi = where[k];
            if (k > 0 && where[k - 1] == pi) continue;
            piece *p = &pieces[pi];
            bool holds = false;
            for (uint32_t i = 0; i + 1 < p->n && !holds; i++) holds = p->ids[i] == a && p->ids[i + 1] == b;
            if (!holds) continue; /* a stale entry */
            if (!count_pairs(&pm, p, pi, -p->count)) {
                st = TS_ERR_NO_MEMORY;
                break;
            }
            uint32_t o = 0;
            for (uint32_t i = 0; i < p->n;) {
                if (i + 1 < p->n && p->ids[i] == a && p->ids[i + 1] == b) {
                    p->ids[o++] = res;
                    i += 2;
                } else {
                    p->ids[o++] = p->ids[i++];
                }
            }
            p->n = o;
            if (!count_pairs(&pm, p, pi, p->count)) st = TS_ERR_NO_MEMORY;
        }
        ts__free(TAG, where);
    }
    ts__free(TAG, joined);
    pm_fini(&pm);
    ts__free(TAG, tm.slot);
    for (uint32_t i = 0; i < n_pieces; i++) ts__free(TAG, pieces[i].ids);
    ts__free(TAG, pieces);

    static const char eot[] = "<|endoftext|>";
    if (!st) {
        if (!(tokens[n_tokens].data = ts__malloc(TAG, sizeof eot - 1))) st = TS_ERR_NO_MEMORY;
        else {
            memcpy(tokens[n_tokens].data, eot, sizeof eot - 1);
            tokens[n_tokens].len = sizeof eot - 1;
            n_tokens++;
        }
    }
    if (st) {
        for (int32_t i = 0; tokens && i < vocab_size; i++) ts__free(TAG, tokens[i].data);
        ts__free(TAG, tokens);
        ts__free(TAG, merges);
        return st;
    }
    st = ts__tokenizer_build(tokens, n_tokens, (const int32_t(*)[2])merges, n_merges, "ts_tokenizer_learn", tok_out);
    ts__free(TAG, merges);
    return st;
}
