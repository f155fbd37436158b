/* The index of a sharded checkpoint ("index.json"): parsing and
 * validation (checkpoint/internal.h). Format (docs/checkpoint.md):
 *
 *   {"format": "tensorshard-dcp", "version": 2, "save_id": "<16 hex>",
 *    "world": W, "metadata": {"k": "v"},
 *    "optim": {"kind": "AdamW", "steps": 12},            (optional)
 *    "files": [{"name": "rank00000-<id>.safetensors", "rank": 0, "size": 1234}],
 *    "tensors": {"<key>": {"kind": "model", "dtype": "F32", "shape": [9, 4],
 *                          "placements": ["Shard(0)"],
 *                          "pieces": [{"file": 0, "rank": 0, "row": 0, "rows": 3,
 *                                      "offset": 136, "length": 48,
 *                                      "hash": "<16 hex>"}]}}}  (version 1: hash optional)
 *
 * Everything a loader later trusts is checked here, so that a malformed
 * or truncated index is TS_ERR_FORMAT with a message, never a crash. */
#include "checkpoint/internal.h"
#include "safetensors/safetensors.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#define CK_SHOWN 200

static const char *const kind_names[] = {"model", "optim", "extra", "rank_extra"};
_Static_assert(sizeof kind_names / sizeof kind_names[0] == TS__CKPT_KIND_COUNT, "one name per kind");

void ts__ckpt_index_free(ts__ckpt_index *ix)
{
    if (!ix) return;
    for (int i = 0; i < ix->n_tensors; i++) ts__free(TS_MEM_OTHER, ix->tensors[i].pieces);
    ts__free(TS_MEM_OTHER, ix->tensors);
    ts__free(TS_MEM_OTHER, ix->files);
    json_decref(ix->root);
    ts__free(TS_MEM_OTHER, ix);
}

#define CK_P1 0x9E3779B97F4A7C15ull
#define CK_P2 0xC2B2AE3D27D4EB4Full
#define CK_P3 0x165667B19E3779F9ull

static uint64_t ck_mix(uint64_t h, uint64_t w)
{
    h ^= w * CK_P2;
    h = (h << 31) | (h >> 33);
    return h * CK_P1;
}

static uint64_t ck_word(const unsigned char *b) /* little-endian on every host */
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint64_t w;
    memcpy(&w, b, sizeof w);
    return w;
#else
    uint64_t w = 0;
    for (int i = 7; i >= 0; i--) w = (w << 8) | b[i];
    return w;
#endif
}

uint64_t ts__ckpt_hash(const void *data, size_t n)
{
    const unsigned char *b = data;
    uint64_t l[4] = {CK_P1 + CK_P2, CK_P2, 0, 0 - CK_P1};
    size_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int k = 0; k < 4; k++) l[k] = ck_mix(l[k], ck_word(b + i + 8 * k));
    uint64_t h = (uint64_t)n * CK_P3;
    for (int k = 0; k < 4; k++) h = ck_mix(h, l[k]);
    for (; i + 8 <= n; i += 8) h = ck_mix(h, ck_word(b + i));
    if (i < n) {
        unsigned char tail[8] = {0};
        memcpy(tail, b + i, n - i);
        h = ck_mix(h, ck_word(tail) ^ (uint64_t)(n - i));
    }
    h ^= h >> 33;
    h *= CK_P2;
    h ^= h >> 29;
    h *= CK_P3;
    h ^= h >> 32;
    return h;
}

static bool js_uint(const json_t *v, uint64_t *out)
{
    if (!json_is_integer(v) || json_integer_value(v) < 0) return false;
    *out = (uint64_t)json_integer_value(v);
    return true;
}

static int cmp_tensor(const void *a, const void *b)
{
    return strcmp(((const ts__ckpt_tensor *)a)->key, ((const ts__ckpt_tensor *)b)->key);
}

static int cmp_piece_row(const void *a, const void *b)
{
    const ts__ckpt_piece *x = a, *y = b;
    if (x->row != y->row) return x->row < y->row ? -1 : 1;
    return (x->rows > y->rows) - (x->rows < y->rows);
}

const ts__ckpt_tensor *ts__ckpt_index_find(const ts__ckpt_index *ix, const char *key)
{
    if (!ix || !key || !ix->n_tensors) return NULL;
    ts__ckpt_tensor probe = {.key = key};
    return bsearch(&probe, ix->tensors, (size_t)ix->n_tensors, sizeof probe, cmp_tensor);
}

static bool plain_file_name(const char *s)
{
    return s[0] && strcmp(s, ".") && strcmp(s, "..") && !strchr(s, '/') && strlen(s) < 256;
}

static ts_status parse_files(const char *src, const json_t *files, ts__ckpt_index *ix)
{
    if (!json_is_array(files))
        return ts_error(TS_ERR_FORMAT, "checkpoint index '%s': \"files\" is missing or not an array", src);
    size_t n = json_array_size(files);
    if (n > 1000000) return ts_error(TS_ERR_FORMAT, "checkpoint index '%s': %zu files is too many", src, n);
    if (n && !(ix->files = ts__calloc(TS_MEM_OTHER, n, sizeof *ix->files))) return TS_ERR_NO_MEMORY;
    for (size_t i = 0; i < n; i++) {
        const json_t *f = json_array_get(files, i);
        const json_t *name = json_object_get(f, "name");
        uint64_t rank, size;
        if (!json_is_object(f) || !json_is_string(name) || !js_uint(json_object_get(f, "rank"), &rank) ||
            !js_uint(json_object_get(f, "size"), &size))
            return ts_error(TS_ERR_FORMAT,
                            "checkpoint index '%s': file %zu is not an object with \"name\" (string), \"rank\" and "
                            "\"size\" (non-negative integers)",
                            src, i);
        if (!plain_file_name(json_string_value(name)))
            return ts_error(TS_ERR_FORMAT, "checkpoint index '%s': file %zu is named '%.*s', not a plain file name",
                            src, i, CK_SHOWN, json_string_value(name));
        if (rank >= (uint64_t)ix->world)
            return ts_error(TS_ERR_FORMAT,
                            "checkpoint index '%s': file %zu ('%s') has rank %llu, not below the world %d", src, i,
                            json_string_value(name), (unsigned long long)rank, ix->world);
        for (size_t j = 0; j < i; j++) {
            if (!strcmp(ix->files[j].name, json_string_value(name)))
                return ts_error(TS_ERR_FORMAT, "checkpoint index '%s': file '%s' is listed twice", src,
                                json_string_value(name));
            if (ix->files[j].rank == (int)rank) /* each rank writes one file: world >= the files listed */
                return ts_error(TS_ERR_FORMAT,
                                "checkpoint index '%s': files %zu ('%s') and %zu ('%s') both have \"rank\" %llu; each "
                                "rank of the world (%d) writes one file",
                                src, j, ix->files[j].name, i, json_string_value(name), (unsigned long long)rank,
                                ix->world);
        }
        ix->files[i] = (ts__ckpt_file){json_string_value(name), (int)rank, size};
        ix->n_files = (int)i + 1;
    }
    return TS_OK;
}

static ts_status parse_piece(const char *src, const char *key, size_t k, const json_t *pj, const ts__ckpt_index *ix,
                             const ts__ckpt_tensor *t, ts__ckpt_piece *p)
{
    uint64_t file, rank, row, rows, off, len;
    if (!json_is_object(pj) || !js_uint(json_object_get(pj, "file"), &file) ||
        !js_uint(json_object_get(pj, "rank"), &rank) || !js_uint(json_object_get(pj, "row"), &row) ||
        !js_uint(json_object_get(pj, "rows"), &rows) || !js_uint(json_object_get(pj, "offset"), &off) ||
        !js_uint(json_object_get(pj, "length"), &len))
        return ts_error(TS_ERR_FORMAT,
                        "checkpoint index '%s': key '%.*s': piece %zu is not an object of non-negative integers "
                        "\"file\", \"rank\", \"row\", \"rows\", \"offset\", \"length\"",
                        src, CK_SHOWN, key, k);
    if (file >= (uint64_t)ix->n_files)
        return ts_error(TS_ERR_FORMAT, "checkpoint index '%s': key '%.*s': piece %zu names file %llu of %d", src,
                        CK_SHOWN, key, k, (unsigned long long)file, ix->n_files);
    if (rank >= (uint64_t)ix->world)
        return ts_error(TS_ERR_FORMAT, "checkpoint index '%s': key '%.*s': piece %zu has rank %llu, world %d", src,
                        CK_SHOWN, key, k, (unsigned long long)rank, ix->world);
    if (row > (uint64_t)t->rows || rows > (uint64_t)t->rows - row)
        return ts_error(TS_ERR_FORMAT,
                        "checkpoint index '%s': key '%.*s': piece %zu has rows [%llu, +%llu) outside the %lld rows",
                        src, CK_SHOWN, key, k, (unsigned long long)row, (unsigned long long)rows, (long long)t->rows);
    uint64_t need = rows * t->row_bytes; /* rows <= t->rows, whose bytes fit (checked with the shape) */
    if (len != need)
        return ts_error(TS_ERR_FORMAT,
                        "checkpoint index '%s': key '%.*s': piece %zu has length %llu, but %llu rows of %llu bytes "
                        "need %llu",
                        src, CK_SHOWN, key, k, (unsigned long long)len, (unsigned long long)rows,
                        (unsigned long long)t->row_bytes, (unsigned long long)need);
    uint64_t fsz = ix->files[file].size;
    if (off > fsz || len > fsz - off)
        return ts_error(TS_ERR_FORMAT,
                        "checkpoint index '%s': key '%.*s': piece %zu, bytes [%llu, +%llu), lies outside file '%s' "
                        "of %llu bytes",
                        src, CK_SHOWN, key, k, (unsigned long long)off, (unsigned long long)len, ix->files[file].name,
                        (unsigned long long)fsz);
    *p = (ts__ckpt_piece){(int)file, (int)rank, (int64_t)row, (int64_t)rows, off, len, false, 0};
    const json_t *hj = json_object_get(pj, "hash");
    if (hj) {
        const char *hs = json_string_value(hj);
        char *end = NULL;
        if (!hs || strlen(hs) != 16 || strspn(hs, "0123456789abcdef") != 16)
            return ts_error(TS_ERR_FORMAT,
                            "checkpoint index '%s': key '%.*s': piece %zu has a \"hash\" that is not 16 lowercase "
                            "hex digits",
                            src, CK_SHOWN, key, k);
        p->hash = strtoull(hs, &end, 16);
        p->has_hash = true;
    }
    return TS_OK;
}

/* A JSON value as short text for a message ("\"x\"", "1e300", "[]"). */
static void js_show(const json_t *v, char *buf, size_t cap)
{
    char *s = v ? json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT) : NULL;
    snprintf(buf, cap, "%.60s%s", s ? s : "(missing)", s && strlen(s) > 60 ? "..." : "");
    free(s); /* json_dumps allocates with jansson's allocator (libc) */
}

/* "placements": one entry per mesh dim of the tensor's DTensor, as
 * ts_placement_str writes them: "Replicate()" or "Shard(d)". The pieces
 * are rows of dim 0, so the one Shard a tensor may have is Shard(0) of a
 * tensor of at least one dim, and extras (replicated, or one per rank)
 * have none. *shard_dim is 0 for Shard(0), -1 when all are Replicate(). */
static ts_status parse_placements(const char *src, const char *key, const json_t *pl, const ts__ckpt_tensor *t,
                                  int *shard_dim)
{
    const int W = CK_SHOWN;
    char shown[80];
    *shard_dim = -1;
    size_t n = json_array_size(pl);
    if (!json_is_array(pl) || n == 0 || n > TS_MESH_MAX_DIMS) {
        js_show(pl, shown, sizeof shown);
        return ts_error(TS_ERR_FORMAT,
                        "checkpoint index '%s': key '%.*s': \"placements\" is %s, not an array of 1 to %d placements",
                        src, W, key, shown, TS_MESH_MAX_DIMS);
    }
    for (size_t i = 0; i < n; i++) {
        const json_t *e = json_array_get(pl, i);
        const char *s = json_string_value(e);
        long long dim = -1;
        if (s && !strcmp(s, "Replicate()")) continue;
        if (s && !strncmp(s, "Shard(", 6)) { /* Shard(<decimal>): up to 18 digits, no overflow */
            const char *d = s + 6;
            size_t nd = strspn(d, "0123456789");
            if (nd >= 1 && nd <= 18 && !strcmp(d + nd, ")") && (nd == 1 || d[0] != '0')) dim = strtoll(d, NULL, 10);
        }
        js_show(e, shown, sizeof shown);
        if (dim < 0)
            return ts_error(TS_ERR_FORMAT,
                            "checkpoint index '%s': key '%.*s': \"placements\" entry %zu is %s, not \"Replicate()\" "
                            "or \"Shard(<dim>)\"",
                            src, W, key, i, shown);
        if (dim >= t->ndim)
            return ts_error(TS_ERR_FORMAT,
                            "checkpoint index '%s': key '%.*s': \"placements\" entry %zu is %s, but the tensor has %d "
                            "dims",
                            src, W, key, i, shown, t->ndim);
        if (dim != 0)
            return ts_error(TS_ERR_FORMAT,
                            "checkpoint index '%s': key '%.*s': \"placements\" entry %zu is %s, but the pieces hold "
                            "rows of dim 0 (Shard(0))",
                            src, W, key, i, shown);
        if (*shard_dim >= 0)
            return ts_error(TS_ERR_FORMAT,
                            "checkpoint index '%s': key '%.*s': \"placements\" entry %zu is a second Shard (%s)", src,
                            W, key, i, shown);
        if (t->kind == TS__CKPT_EXTRA || t->kind == TS__CKPT_RANK_EXTRA)
            return ts_error(TS_ERR_FORMAT,
                            "checkpoint index '%s': key '%.*s': \"placements\" entry %zu is %s, but an extra is "
                            "never sharded",
                            src, W, key, i, shown);
        *shard_dim = 0;
    }
    return TS_OK;
}

static ts_status parse_tensor(const char *src, const char *key, const json_t *v, const ts__ckpt_index *ix,
                              ts__ckpt_tensor *t)
{
    const int W = CK_SHOWN;
    memset(t, 0, sizeof *t);
    t->key = key;
    if (!json_is_object(v))
        return ts_error(TS_ERR_FORMAT, "checkpoint index '%s': key '%.*s' is not an object", src, W, key);
    const json_t *kind = json_object_get(v, "kind"), *dt = json_object_get(v, "dtype"),
                 *sh = json_object_get(v, "shape"), *pl = json_object_get(v, "placements"),
                 *pieces = json_object_get(v, "pieces");
    int ki = -1;
    for (int i = 0; json_is_string(kind) && i < TS__CKPT_KIND_COUNT; i++)
        if (!strcmp(json_string_value(kind), kind_names[i])) ki = i;
    if (ki < 0)
        return ts_error(TS_ERR_FORMAT,
                        "checkpoint index '%s': key '%.*s': \"kind\" is missing or not one of model, optim, extra, "
                        "rank_extra",
                        src, W, key);
    t->kind = (ts__ckpt_kind)ki;
    if (!json_is_string(dt) || !ts_safetensors_dtype_from_name(json_string_value(dt), &t->dtype))
        return ts_error(TS_ERR_FORMAT, "checkpoint index '%s': key '%.*s': \"dtype\" is missing or unknown", src, W,
                        key);
    if (!json_is_array(sh) || json_array_size(sh) > TS_MAX_DIMS)
        return ts_error(
            TS_ERR_FORMAT,
            "checkpoint index '%s': key '%.*s': \"shape\" is missing, not an array or has more than %d dims", src, W,
            key, TS_MAX_DIMS);
    t->ndim = (int)json_array_size(sh);
    uint64_t numel = 1, span = 1;
    bool ovf = false;
    for (int d = 0; d < t->ndim; d++) {
        uint64_t s;
        if (!js_uint(json_array_get(sh, (size_t)d), &s))
            return ts_error(TS_ERR_FORMAT,
                            "checkpoint index '%s': key '%.*s': shape entry %d is not a non-negative integer", src, W,
                            key, d);
        t->shape[d] = (int64_t)s;
        ovf |= __builtin_mul_overflow(numel, s, &numel);
        ovf |= __builtin_mul_overflow(span, s ? s : 1, &span);
    }
    uint64_t bytes;
    ovf |= __builtin_mul_overflow(span, (uint64_t)ts_dtype_size(t->dtype), &bytes);
    if (ovf || span > (uint64_t)INT64_MAX / 16)
        return ts_error(TS_ERR_FORMAT,
                        "checkpoint index '%s': key '%.*s': the shape has more elements than a tensor may have", src, W,
                        key);
    t->rows = t->ndim ? t->shape[0] : 1;
    uint64_t per_row = 1;
    for (int d = 1; d < t->ndim; d++) per_row *= (uint64_t)t->shape[d];
    t->row_bytes = per_row * ts_dtype_size(t->dtype);
    int shard_dim = -1;
    ts_status pst = parse_placements(src, key, pl, t, &shard_dim);
    if (pst) return pst;
    if (!json_is_array(pieces))
        return ts_error(TS_ERR_FORMAT, "checkpoint index '%s': key '%.*s': \"pieces\" is missing or not an array", src,
                        W, key);
    size_t np = json_array_size(pieces);
    if (np > 1000000) return ts_error(TS_ERR_FORMAT, "checkpoint index '%s': key '%.*s': too many pieces", src, W, key);
    if (np && !(t->pieces = ts__calloc(TS_MEM_OTHER, np, sizeof *t->pieces))) return TS_ERR_NO_MEMORY;
    for (size_t k = 0; k < np; k++) {
        ts_status st = parse_piece(src, key, k, json_array_get(pieces, k), ix, t, &t->pieces[k]);
        if (st) return st;
        t->n_pieces = (int)k + 1;
    }
    if (t->kind == TS__CKPT_RANK_EXTRA) { /* whole tensors, one per rank */
        for (int k = 0; k < t->n_pieces; k++) {
            if (t->pieces[k].row != 0 || t->pieces[k].rows != t->rows)
                return ts_error(TS_ERR_FORMAT,
                                "checkpoint index '%s': key '%.*s': a rank extra's piece %d is not the whole tensor",
                                src, W, key, k);
            for (int j = 0; j < k; j++)
                if (t->pieces[j].rank == t->pieces[k].rank)
                    return ts_error(TS_ERR_FORMAT, "checkpoint index '%s': key '%.*s': rank %d has two pieces", src, W,
                                    key, t->pieces[k].rank);
        }
        return TS_OK;
    }
    /* the pieces tile [0, rows) exactly (empty pieces are not written) */
    if (t->n_pieces > 1) qsort(t->pieces, (size_t)t->n_pieces, sizeof *t->pieces, cmp_piece_row);
    int64_t pos = 0;
    for (int k = 0; k < t->n_pieces; k++) {
        const ts__ckpt_piece *p = &t->pieces[k];
        if (p->rows == 0)
            return ts_error(TS_ERR_FORMAT, "checkpoint index '%s': key '%.*s': a piece of 0 rows", src, W, key);
        if (p->row != pos)
            return ts_error(TS_ERR_FORMAT,
                            "checkpoint index '%s': key '%.*s': the pieces %s at row %lld (rows [%lld, %lld) of "
                            "rank %d)",
                            src, W, key, p->row < pos ? "overlap" : "leave a gap", (long long)pos, (long long)p->row,
                            (long long)(p->row + p->rows), p->rank);
        pos += p->rows;
    }
    if (pos != t->rows && t->row_bytes)
        return ts_error(TS_ERR_FORMAT, "checkpoint index '%s': key '%.*s': the pieces cover %lld of its %lld rows", src,
                        W, key, (long long)pos, (long long)t->rows);
    /* a replicated tensor is written once, by the lowest rank holding it */
    if (shard_dim < 0 && t->n_pieces > 1)
        return ts_error(TS_ERR_FORMAT,
                        "checkpoint index '%s': key '%.*s': \"placements\" has no Shard, but the tensor is saved in "
                        "%d pieces (a replicated tensor is one piece)",
                        src, W, key, t->n_pieces);
    return TS_OK;
}

/* Version 2: every piece has a "hash". Version 1 (written before the
 * checksums, then with them): no piece has one, or every piece of a model
 * or optimizer tensor has one (the version-1 writer left it out only for
 * extras given as strided views). A piece without its hash among hashed
 * ones would be read unchecked: a removed "hash" and a corrupted byte
 * loaded silently. */
static ts_status check_hashes(const char *src, const ts__ckpt_index *ix)
{
    bool any = false;
    for (int i = 0; i < ix->n_tensors && !any; i++)
        for (int k = 0; k < ix->tensors[i].n_pieces && !any; k++) any = ix->tensors[i].pieces[k].has_hash;
    if (ix->version < 2 && !any) return TS_OK;
    for (int i = 0; i < ix->n_tensors; i++) {
        const ts__ckpt_tensor *t = &ix->tensors[i];
        if (ix->version < 2 && (t->kind == TS__CKPT_EXTRA || t->kind == TS__CKPT_RANK_EXTRA)) continue;
        for (int k = 0; k < t->n_pieces; k++)
            if (!t->pieces[k].has_hash)
                return ts_error(TS_ERR_FORMAT,
                                "checkpoint index '%s': key '%.*s': the piece of rows [%lld, %lld) (rank %d) has no "
                                "\"hash\"; %s",
                                src, CK_SHOWN, t->key, (long long)t->pieces[k].row,
                                (long long)(t->pieces[k].row + t->pieces[k].rows), t->pieces[k].rank,
                                ix->version >= 2 ? "every piece of a version 2 index has one"
                                                 : "the other pieces of this version 1 index have one");
    }
    return TS_OK;
}

ts_status ts__ckpt_index_parse(const char *src, const char *buf, size_t len, ts__ckpt_index **out)
{
    if (!src || (!buf && len) || !out) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts__ckpt_index_parse: NULL argument");
    json_error_t jerr;
    json_t *root = json_loadb(buf ? buf : "", len, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return ts_error(TS_ERR_FORMAT, "checkpoint index '%s' is not valid JSON: %s (at byte %d of %zu; truncated?)",
                        src, jerr.text, jerr.position, len);
    ts__ckpt_index *ix = ts__calloc(TS_MEM_OTHER, 1, sizeof *ix);
    if (!ix) {
        json_decref(root);
        return TS_ERR_NO_MEMORY;
    }
    ix->root = root;
    ts_status st = TS_OK;
    const json_t *fmt = json_object_get(root, "format"), *ver = json_object_get(root, "version"),
                 *sid = json_object_get(root, "save_id"), *meta = json_object_get(root, "metadata"),
                 *opt = json_object_get(root, "optim"), *tens = json_object_get(root, "tensors");
    uint64_t world = 0, version = 0;
    if (!json_is_object(root)) st = ts_error(TS_ERR_FORMAT, "checkpoint index '%s' is JSON but not an object", src);
    else if (!json_is_string(fmt) || strcmp(json_string_value(fmt), "tensorshard-dcp") != 0)
        st = ts_error(TS_ERR_FORMAT, "checkpoint index '%s': \"format\" is not \"tensorshard-dcp\"", src);
    else if (!js_uint(ver, &version) || version < TS__CKPT_INDEX_VERSION_MIN || version > TS__CKPT_INDEX_VERSION) {
        char shown[80];
        js_show(ver, shown, sizeof shown);
        st = ts_error(TS_ERR_FORMAT,
                      "checkpoint index '%s': \"version\" is %s; this code loads versions %d to %d (a newer "
                      "tensorshard wrote it?)",
                      src, shown, TS__CKPT_INDEX_VERSION_MIN, TS__CKPT_INDEX_VERSION);
    } else if (!js_uint(json_object_get(root, "world"), &world) || world < 1 || world > 1000000)
        st = ts_error(TS_ERR_FORMAT, "checkpoint index '%s': \"world\" is missing or not an integer in [1, 1000000]",
                      src);
    else if (!json_is_string(sid))
        st = ts_error(TS_ERR_FORMAT, "checkpoint index '%s': \"save_id\" is missing or not a string", src);
    if (!st && meta) {
        const char *k;
        json_t *v;
        if (!json_is_object(meta))
            st = ts_error(TS_ERR_FORMAT, "checkpoint index '%s': \"metadata\" is not an object", src);
        else
            json_object_foreach((json_t *)meta, k, v) if (!st && !json_is_string(v)) st =
                ts_error(TS_ERR_FORMAT, "checkpoint index '%s': metadata '%.*s' is not a string", src, CK_SHOWN, k);
        ix->metadata = (json_t *)meta;
    }
    if (!st && opt) {
        const json_t *kind = json_object_get(opt, "kind");
        uint64_t steps;
        if (!json_is_object(opt) || !json_is_string(kind) || !js_uint(json_object_get(opt, "steps"), &steps) ||
            steps > (uint64_t)INT64_MAX)
            st = ts_error(
                TS_ERR_FORMAT,
                "checkpoint index '%s': \"optim\" is not an object with \"kind\" (string) and \"steps\" (integer >= 0)",
                src);
        else {
            ix->has_optim = true;
            ix->optim_kind = json_string_value(kind);
            ix->optim_steps = (int64_t)steps;
        }
    }
    if (!st) {
        ix->version = (int)version;
        ix->world = (int)world;
        ix->save_id = json_string_value(sid);
        st = parse_files(src, json_object_get(root, "files"), ix);
    }
    if (!st && !json_is_object(tens))
        st = ts_error(TS_ERR_FORMAT, "checkpoint index '%s': \"tensors\" is missing or not an object", src);
    if (!st) {
        size_t n = json_object_size(tens);
        if (n && !(ix->tensors = ts__calloc(TS_MEM_OTHER, n, sizeof *ix->tensors))) st = TS_ERR_NO_MEMORY;
        const char *k;
        json_t *v;
        json_object_foreach((json_t *)tens, k, v)
        {
            if (st) break;
            st = parse_tensor(src, k, v, ix, &ix->tensors[ix->n_tensors]);
            ix->n_tensors++; /* counted even on error: its pieces are freed */
        }
        if (!st && ix->n_tensors > 1) qsort(ix->tensors, (size_t)ix->n_tensors, sizeof *ix->tensors, cmp_tensor);
    }
    if (!st) st = check_hashes(src, ix);
    if (st) {
        ts__ckpt_index_free(ix);
        return st;
    }
    *out = ix;
    return TS_OK;
}
