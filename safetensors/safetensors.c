/* safetensors files: the format (header reader, streaming writer); nn/state_dict.c
 * saves and loads state dicts with it.
 *
 * Format (github.com/huggingface/safetensors, "Format"):
 *   8 bytes   N, the header length, little-endian u64
 *   N bytes   a JSON object, UTF-8, starting with '{', possibly padded with
 *             trailing spaces: name -> {"dtype": "F32", "shape": [2, 3],
 *             "data_offsets": [begin, end]}, plus an optional
 *             "__metadata__": {string: string}
 *   rest      the byte buffer; offsets are relative to its start, the
 *             tensors are row-major little-endian, and together they cover
 *             the buffer exactly, without gaps or overlaps.
 *
 * The JSON is read and written with jansson. The writer keeps the state
 * dict's insertion order (no sorting), writes compact JSON padded with
 * spaces to a multiple of 8 bytes (as the Rust implementation does) and
 * lays the data out contiguously in entry order. Every check the Rust
 * implementation makes on load is made here too, each failing with
 * TS_ERR_FORMAT and a message that names the source and the key. */
#define _GNU_SOURCE
#include "safetensors/safetensors.h"
#include "safetensors/internal.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <signal.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors/safetensors.c writes tensor bytes as they are in memory: it needs a little-endian host"
#endif

/* The Rust implementation's limit on the header (MAX_HEADER_SIZE). */
#define ST_MAX_HEADER 100000000ull
#define ST_METADATA_KEY "__metadata__"
/* The most elements (sizes of 0 counted as 1) ts_tensor_empty accepts. */
#define ST_MAX_SPAN ((unsigned long long)INT64_MAX / 16)
/* Names and strings from a file are cut to this in messages. */
#define ST_NAME_MAX_SHOWN 200

/* safetensors dtype strings, in ts_dtype order. */
static const char *const st_dtype_names[] = {
    [TS_F32] = "F32", [TS_F64] = "F64", [TS_BF16] = "BF16", [TS_F16] = "F16",
    [TS_I64] = "I64", [TS_I32] = "I32", [TS_BOOL] = "BOOL",
};
_Static_assert(sizeof st_dtype_names / sizeof st_dtype_names[0] == TS_DTYPE_COUNT, "one safetensors name per ts_dtype");

bool ts_safetensors_dtype_from_name(const char *s, ts_dtype *out)
{
    if (!s || !out) return false;
    for (int d = 0; d < TS_DTYPE_COUNT; d++)
        if (strcmp(st_dtype_names[d], s) == 0) {
            *out = (ts_dtype)d;
            return true;
        }
    return false;
}

const char *ts_safetensors_dtype_name(ts_dtype d) { return (unsigned)d < TS_DTYPE_COUNT ? st_dtype_names[d] : "?"; }

/* ------------------------------------------------------------ parsing */

/* "(2, 3)" for a shape, "(4,)" for one dim, "()" for none; cut to fit
 * (len >= 4; always NUL-terminated). */
static char *st_shape_str(int ndim, const int64_t *shape, char *buf, size_t len)
{
    size_t n = 1;
    snprintf(buf, len, "(");
    for (int i = 0; i < ndim && n < len; i++) {
        int w = snprintf(buf + n, len - n, i ? ", %lld" : "%lld", (long long)shape[i]);
        n += w > 0 ? (size_t)w : 0;
    }
    if (n < len) snprintf(buf + n, len - n, ndim == 1 ? ",)" : ")");
    return buf;
}

/* One validated tensor entry of a header, and a parsed header: the JSON
 * (which owns the names) and the entries in header order
 * (safetensors/safetensors.h). */
typedef ts_safetensors_entry st_entry;
typedef ts_safetensors_header st_header;

void ts_safetensors_header_fini(st_header *h)
{
    if (!h) return;
    json_decref(h->root);
    ts__free(TS_MEM_NN, h->entries);
    memset(h, 0, sizeof *h);
}

static uint64_t st_load_u64le(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

/* Reads the header length from the first 8 bytes of a source of `total`
 * bytes and checks it against the size and the limit. */
static ts_status st_check_prefix(const char *op, const char *src, uint64_t total, const unsigned char *prefix,
                                 uint64_t *n_out)
{
    if (total < 8)
        return ts_error(TS_ERR_FORMAT,
                        "%s: '%s' has %llu bytes, fewer than the 8-byte header length (truncated or not a "
                        "safetensors file)",
                        op, src, (unsigned long long)total);
    uint64_t n = st_load_u64le(prefix);
    if (n > ST_MAX_HEADER)
        return ts_error(TS_ERR_FORMAT, "%s: '%s': header length %llu exceeds the limit of %llu bytes", op, src,
                        (unsigned long long)n, ST_MAX_HEADER);
    if (n > total - 8)
        return ts_error(TS_ERR_FORMAT,
                        "%s: '%s': header length %llu exceeds the %llu bytes that follow the length field "
                        "(truncated file?)",
                        op, src, (unsigned long long)n, (unsigned long long)(total - 8));
    *n_out = n;
    return TS_OK;
}

/* A JSON value that is an integer >= 0. */
static bool st_json_uint(const json_t *v, uint64_t *out)
{
    if (!json_is_integer(v) || json_integer_value(v) < 0) return false;
    *out = (uint64_t)json_integer_value(v);
    return true;
}

static ts_status st_check_metadata(const char *op, const char *src, const json_t *meta)
{
    if (json_is_null(meta)) return TS_OK;
    if (!json_is_object(meta))
        return ts_error(TS_ERR_FORMAT, "%s: '%s': \"" ST_METADATA_KEY "\" is not an object of strings", op, src);
    const char *k;
    const json_t *v;
    json_object_foreach((json_t *)meta, k, v)
    {
        if (!json_is_string(v))
            return ts_error(TS_ERR_FORMAT, "%s: '%s': \"" ST_METADATA_KEY "\" value of '%.*s' is not a string", op, src,
                            ST_NAME_MAX_SHOWN, k);
    }
    return TS_OK;
}

/* Checks one tensor entry and fills `e`. */
static ts_status st_parse_entry(const char *op, const char *src, const char *name, const json_t *v, uint64_t data_len,
                                st_entry *e)
{
    const int W = ST_NAME_MAX_SHOWN;
    if (!json_is_object(v))
        return ts_error(TS_ERR_FORMAT,
                        "%s: '%s': key '%.*s': entry is not an object with \"dtype\", \"shape\" and "
                        "\"data_offsets\"",
                        op, src, W, name);
    e->name = name;

    const json_t *dt = json_object_get(v, "dtype");
    if (!json_is_string(dt))
        return ts_error(TS_ERR_FORMAT, "%s: '%s': key '%.*s': \"dtype\" is missing or not a string", op, src, W, name);
    if (!ts_safetensors_dtype_from_name(json_string_value(dt), &e->dtype))
        return ts_error(TS_ERR_FORMAT,
                        "%s: '%s': key '%.*s': dtype '%.32s' is unknown or not supported (supported: F32, F64, "
                        "BF16, F16, I64, I32, BOOL)",
                        op, src, W, name, json_string_value(dt));

    const json_t *sh = json_object_get(v, "shape");
    if (!json_is_array(sh))
        return ts_error(TS_ERR_FORMAT, "%s: '%s': key '%.*s': \"shape\" is missing or not an array", op, src, W, name);
    size_t nd = json_array_size(sh);
    if (nd > TS_MAX_DIMS)
        return ts_error(TS_ERR_FORMAT, "%s: '%s': key '%.*s': shape has %zu dims, more than the %d supported", op, src,
                        W, name, nd, TS_MAX_DIMS);
    e->ndim = (int)nd;
    /* numel must fit in 64 bits, and the product of the sizes with 0
     * counted as 1 (what the strides of an empty tensor reach) within the
     * tensor layer's limit (ts_tensor_empty refuses more than
     * INT64_MAX / 16, which keeps every byte offset in range) */
    uint64_t numel = 1, span = 1;
    bool overflow = false;
    for (size_t i = 0; i < nd; i++) {
        uint64_t d;
        if (!st_json_uint(json_array_get(sh, i), &d))
            return ts_error(TS_ERR_FORMAT, "%s: '%s': key '%.*s': shape entry %zu is not a non-negative integer", op,
                            src, W, name, i);
        e->shape[i] = (int64_t)d;
        overflow |= __builtin_mul_overflow(numel, d, &numel);
        overflow |= __builtin_mul_overflow(span, d ? d : 1, &span);
    }
    char shs[96];
    if (overflow || span > ST_MAX_SPAN)
        return ts_error(TS_ERR_FORMAT,
                        "%s: '%s': key '%.*s': shape %s has more elements than a tensor may have (%llu, not "
                        "counting sizes of 0)",
                        op, src, W, name, st_shape_str(e->ndim, e->shape, shs, sizeof shs), ST_MAX_SPAN);

    const json_t *off = json_object_get(v, "data_offsets");
    if (!json_is_array(off) || json_array_size(off) != 2 || !st_json_uint(json_array_get(off, 0), &e->begin) ||
        !st_json_uint(json_array_get(off, 1), &e->end))
        return ts_error(TS_ERR_FORMAT,
                        "%s: '%s': key '%.*s': \"data_offsets\" is missing or not two non-negative integers [begin, "
                        "end]",
                        op, src, W, name);
    if (e->begin > e->end || e->end > data_len)
        return ts_error(TS_ERR_FORMAT,
                        "%s: '%s': key '%.*s': data_offsets [%llu, %llu] do not lie within the data buffer of %llu "
                        "bytes",
                        op, src, W, name, (unsigned long long)e->begin, (unsigned long long)e->end,
                        (unsigned long long)data_len);
    uint64_t nbytes;
    if (__builtin_mul_overflow(numel, (uint64_t)ts_dtype_size(e->dtype), &nbytes) || nbytes != e->end - e->begin)
        return ts_error(TS_ERR_FORMAT,
                        "%s: '%s': key '%.*s': shape %s of %s needs %llu elements of %zu bytes, but data_offsets "
                        "[%llu, %llu] hold %llu bytes",
                        op, src, W, name, st_shape_str(e->ndim, e->shape, shs, sizeof shs), st_dtype_names[e->dtype],
                        (unsigned long long)numel, ts_dtype_size(e->dtype), (unsigned long long)e->begin,
                        (unsigned long long)e->end, (unsigned long long)(e->end - e->begin));
    return TS_OK;
}

static int st_cmp_offsets(const void *a, const void *b)
{
    const st_entry *x = *(const st_entry *const *)a, *y = *(const st_entry *const *)b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

/* The entries, sorted by offsets, must tile [0, data_len) exactly. */
static ts_status st_check_cover(const char *op, const char *src, const st_header *h, uint64_t data_len)
{
    const int W = ST_NAME_MAX_SHOWN;
    const st_entry **order = NULL;
    if (h->n) {
        order = ts__malloc(TS_MEM_NN, h->n * sizeof *order);
        if (!order) return TS_ERR_NO_MEMORY;
    }
    for (size_t i = 0; i < h->n; i++) order[i] = &h->entries[i];
    if (h->n > 1) qsort(order, h->n, sizeof *order, st_cmp_offsets);
    ts_status st = TS_OK;
    uint64_t pos = 0;
    const st_entry *prev = NULL;
    for (size_t i = 0; i < h->n && !st; i++) {
        const st_entry *e = order[i];
        if (e->begin < pos)
            st = ts_error(TS_ERR_FORMAT,
                          "%s: '%s': key '%.*s': data_offsets [%llu, %llu] overlap those of key '%.*s' [%llu, %llu]",
                          op, src, W, e->name, (unsigned long long)e->begin, (unsigned long long)e->end, W, prev->name,
                          (unsigned long long)prev->begin, (unsigned long long)prev->end);
        else if (e->begin > pos)
            st = ts_error(TS_ERR_FORMAT,
                          "%s: '%s': key '%.*s': data_offsets [%llu, %llu] leave a gap: bytes [%llu, %llu) of the "
                          "data buffer belong to no tensor",
                          op, src, W, e->name, (unsigned long long)e->begin, (unsigned long long)e->end,
                          (unsigned long long)pos, (unsigned long long)e->begin);
        pos = e->end;
        prev = e;
    }
    if (!st && pos != data_len) {
        if (prev)
            st = ts_error(TS_ERR_FORMAT,
                          "%s: '%s': the tensors end at byte %llu (key '%.*s') but the data buffer has %llu bytes", op,
                          src, (unsigned long long)pos, W, prev->name, (unsigned long long)data_len);
        else
            st = ts_error(TS_ERR_FORMAT, "%s: '%s': the header lists no tensor but the data buffer has %llu bytes", op,
                          src, (unsigned long long)data_len);
    }
    ts__free(TS_MEM_NN, order);
    return st;
}

/* Parses and validates the n header bytes against a data buffer of
 * data_len bytes. */
static ts_status st_parse_header(const char *op, const char *src, const char *hdr, size_t n, uint64_t data_len,
                                 st_header *out)
{
    memset(out, 0, sizeof *out);
    if (n == 0 || hdr[0] != '{')
        return ts_error(TS_ERR_FORMAT,
                        "%s: '%s': the %zu-byte header does not start with '{' (not a safetensors "
                        "JSON header)",
                        op, src, n);
    json_error_t jerr;
    json_t *root = json_loadb(hdr, n, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return ts_error(TS_ERR_FORMAT, "%s: '%s': the header is not valid JSON: %s (at byte %d of %zu)", op, src,
                        jerr.text, jerr.position, n);
    if (!json_is_object(root)) {
        json_decref(root);
        return ts_error(TS_ERR_FORMAT, "%s: '%s': the header is JSON but not an object", op, src);
    }
    st_header h = {.root = root};
    size_t cap = json_object_size(root);
    if (cap) {
        h.entries = ts__malloc(TS_MEM_NN, cap * sizeof *h.entries);
        if (!h.entries) {
            ts_safetensors_header_fini(&h);
            return TS_ERR_NO_MEMORY;
        }
    }
    ts_status st = TS_OK;
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v)
    {
        if (strcmp(key, ST_METADATA_KEY) == 0) st = st_check_metadata(op, src, v);
        else if (key[0] == '\0') st = ts_error(TS_ERR_FORMAT, "%s: '%s': a tensor entry has an empty name", op, src);
        else st = st_parse_entry(op, src, key, v, data_len, &h.entries[h.n++]);
        if (st) break;
    }
    if (!st) st = st_check_cover(op, src, &h, data_len);
    if (st) {
        ts_safetensors_header_fini(&h);
        return st;
    }
    *out = h;
    return TS_OK;
}

static ts_status st_header_bytes(const char *op, const char *src, uint64_t n, char **out)
{
    /* one spare byte so that a 0-byte header still gets a buffer */
    char *p = ts__malloc(TS_MEM_NN, (size_t)n + 1);
    if (!p)
        return ts_error(TS_ERR_NO_MEMORY, "%s: '%s': no memory for the %llu-byte header", op, src,
                        (unsigned long long)n);
    *out = p;
    return TS_OK;
}

/* Logs a warning naming the key when a floating-point tensor just read
 * holds NaN or Inf (it is loaded as it is, as PyTorch does). */
/* The header of a safetensors file held in a buffer: what
 * ts_safetensors_parse reads before making tensors of the buffer. */
ts_status ts_safetensors_header_parse(const char *op, const char *src, const void *data, size_t len,
                                      ts_safetensors_header *out)
{
    if (!op || !src || (!data && len) || !out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL argument", op ? op : "ts_safetensors_header_parse");
    const unsigned char *b = data;
    uint64_t n;
    ts_status st = st_check_prefix(op, src, len, b, &n);
    if (st) return st;
    st_header h;
    if ((st = st_parse_header(op, src, (const char *)b + 8, (size_t)n, len - 8 - n, &h))) return st;
    h.data_start = 8 + n;
    h.file_size = len;
    *out = h;
    return TS_OK;
}

/* pread until n bytes are read; returns the bytes read (short at end of
 * file) or -1 with errno. */
static ssize_t st_pread_full(int fd, void *buf, size_t n, uint64_t off)
{
    size_t got = 0;
    while (got < n) {
        size_t chunk = n - got < ((size_t)1 << 30) ? n - got : (size_t)1 << 30;
        ssize_t r = pread(fd, (char *)buf + got, chunk, (off_t)(off + got));
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return -1;
        if (r == 0) break;
        got += (size_t)r;
    }
    return (ssize_t)got;
}

/* Reads n bytes at `off` or fails naming what. */
ts_status ts_safetensors_read_at(const char *op, const char *path, int fd, void *buf, size_t n, uint64_t off,
                                 const char *what)
{
    if (!op || !path || (!buf && n) || !what)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL argument", op ? op : "ts_safetensors_read_at");
    ssize_t r = st_pread_full(fd, buf, n, off);
    if (r < 0) return ts_error(TS_ERR_IO, "%s: reading %s of '%s': %s", op, what, path, strerror(errno));
    if ((size_t)r != n)
        return ts_error(TS_ERR_IO,
                        "%s: '%s' ended after %lld of the %zu bytes of %s at offset %llu (it changed "
                        "while being read?)",
                        op, path, (long long)r, n, what, (unsigned long long)off);
    return TS_OK;
}

ts_status ts_safetensors_header_read(const char *op, const char *path, int fd, st_header *out)
{
    if (!op || !path || !out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL argument", op ? op : "ts_safetensors_header_read");
    struct stat sb;
    if (fstat(fd, &sb) != 0) return ts_error(TS_ERR_IO, "%s: cannot stat '%s': %s", op, path, strerror(errno));
    if (S_ISDIR(sb.st_mode)) return ts_error(TS_ERR_IO, "%s: '%s' is a directory, not a safetensors file", op, path);
    if (!S_ISREG(sb.st_mode)) return ts_error(TS_ERR_IO, "%s: '%s' is not a regular file", op, path);
    uint64_t total = (uint64_t)sb.st_size;
    unsigned char prefix[8] = {0};
    ts_status st;
    if (total >= 8 && (st = ts_safetensors_read_at(op, path, fd, prefix, 8, 0, "the header length"))) return st;
    uint64_t n;
    if ((st = st_check_prefix(op, path, total, prefix, &n))) return st;
    char *hdr = NULL;
    if ((st = st_header_bytes(op, path, n, &hdr))) return st;
    st_header h;
    if (!(st = ts_safetensors_read_at(op, path, fd, hdr, (size_t)n, 8, "the header")))
        st = st_parse_header(op, path, hdr, (size_t)n, total - 8 - n, &h);
    ts__free(TS_MEM_NN, hdr);
    if (st) return st;
    h.data_start = 8 + n;
    h.file_size = total;
    *out = h;
    return TS_OK;
}

/* ------------------------------------------------------------ writing */

/* Buffered writes to the temporary file: small tensors are gathered,
 * large ones are written straight from their data. */
#define ST_WBUF (1u << 20)

typedef struct st_writer {
    int fd;
    char *buf;
    size_t used;
} st_writer;

static int st_write_full(int fd, const void *p, size_t n)
{
    const char *c = p;
    while (n) {
        size_t chunk = n < ((size_t)1 << 30) ? n : (size_t)1 << 30;
        ssize_t w = write(fd, c, chunk);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) return -1;
        if (w == 0) {
            errno = EIO;
            return -1;
        }
        c += w;
        n -= (size_t)w;
    }
    return 0;
}

static int st_flush(st_writer *w)
{
    if (w->used && st_write_full(w->fd, w->buf, w->used) != 0) return -1;
    w->used = 0;
    return 0;
}

static int st_put(st_writer *w, const void *p, size_t n)
{
    if (w->used + n > ST_WBUF && st_flush(w) != 0) return -1;
    if (n >= ST_WBUF) return st_write_full(w->fd, p, n);
    memcpy(w->buf + w->used, p, n);
    w->used += n;
    return 0;
}

/* Builds the JSON header (without padding) in insertion order and checks
 * every name and tensor. Writes a new JSON object into root_out. */
static ts_status st_build_header(const char *op, const char *path, int n, const ts_safetensors_desc *descs,
                                 const char *const *metadata, int n_meta, json_t **root_out)
{
    const int W = ST_NAME_MAX_SHOWN;
    json_t *root = json_object();
    if (!root) return ts_error(TS_ERR_NO_MEMORY, "%s: '%s': no memory for the header", op, path);
    ts_status st = TS_OK;
    if (n_meta > 0) {
        json_t *meta = json_object();
        if (!meta || json_object_set_new(root, ST_METADATA_KEY, meta) != 0)
            st = ts_error(TS_ERR_NO_MEMORY, "%s: '%s': no memory for the header", op, path);
        for (int i = 0; i < n_meta && !st; i++) {
            const char *k = metadata[2 * i], *v = metadata[2 * i + 1];
            json_t *js;
            if (!k || !v)
                st = ts_error(TS_ERR_INVALID_ARGUMENT, "%s: '%s': metadata pair %d has a NULL key or value", op, path,
                              i);
            else if (json_object_get(meta, k))
                st = ts_error(TS_ERR_INVALID_ARGUMENT, "%s: '%s': metadata key '%.*s' is given twice", op, path, W, k);
            /* json_string and json_object_set_new refuse invalid UTF-8;
             * json_object_set_new consumes js even when it fails */
            else if (!(js = json_string(v)) || json_object_set_new(meta, k, js) != 0)
                st = ts_error(TS_ERR_INVALID_ARGUMENT, "%s: '%s': metadata pair '%.*s' is not valid UTF-8", op, path, W,
                              k);
        }
    }
    uint64_t off = 0;
    for (int i = 0; i < n && !st; i++) {
        const char *name = descs[i].name;
        const ts_tensor *t = descs[i].tensor;
        if (name[0] == '\0') {
            st = ts_error(TS_ERR_INVALID_ARGUMENT, "%s: '%s': entry %d has an empty name", op, path, i);
            break;
        }
        if (strcmp(name, ST_METADATA_KEY) == 0) {
            st = ts_error(TS_ERR_INVALID_ARGUMENT, "%s: '%s': a tensor may not be named \"" ST_METADATA_KEY "\"", op,
                          path);
            break;
        }
        if (t && ts_tensor_is_shard(t)) {
            st = ts_error(TS_ERR_SHARDED,
                          "%s: '%s': tensor '%.*s' is a shard; save full tensors or local views (ts_tensor_local_view)",
                          op, path, W, name);
            break;
        }
        if (t && ts_storage_is_released(ts_tensor_storage(t))) {
            st = ts_error(TS_ERR_RELEASED, "%s: '%s': tensor '%.*s' has released storage; restore it first", op, path,
                          W, name);
            break;
        }
        uint64_t nbytes = (uint64_t)ts_dtype_size(descs[i].dtype);
        for (int d = 0; d < descs[i].ndim; d++) nbytes *= (uint64_t)descs[i].shape[d];
        json_t *e = json_object(), *shape = json_array(), *offs = json_array();
        bool ok = e && shape && offs;
        ok = ok && json_object_set_new(e, "dtype", json_string(st_dtype_names[descs[i].dtype])) == 0;
        for (int d = 0; ok && d < descs[i].ndim; d++)
            ok = json_array_append_new(shape, json_integer((json_int_t)descs[i].shape[d])) == 0;
        ok = ok && json_array_append_new(offs, json_integer((json_int_t)off)) == 0 &&
            json_array_append_new(offs, json_integer((json_int_t)(off + nbytes))) == 0;
        ok = ok && json_object_set(e, "shape", shape) == 0 && json_object_set(e, "data_offsets", offs) == 0;
        json_decref(shape);
        json_decref(offs);
        if (!ok) {
            json_decref(e);
            st = ts_error(TS_ERR_NO_MEMORY, "%s: '%s': no memory for the header", op, path);
        } else if (json_object_set_new(root, name, e) != 0) {
            /* jansson refuses keys that are not valid UTF-8 */
            st =
                ts_error(TS_ERR_INVALID_ARGUMENT, "%s: '%s': tensor name '%.*s' is not valid UTF-8", op, path, W, name);
        }
        off += nbytes;
    }
    if (st) {
        json_decref(root);
        return st;
    }
    *root_out = root;
    return TS_OK;
}

/* The folder and the last component of `path` ("." for a bare name, "/"
 * for a file at the root), as new strings. */
static ts_status st_split_path(const char *path, char **dir_out, char **base_out)
{
    const char *slash = strrchr(path, '/');
    char *dir;
    if (!slash) dir = ts__strdup(TS_MEM_NN, ".");
    else if (slash == path) dir = ts__strdup(TS_MEM_NN, "/");
    else if ((dir = ts__malloc(TS_MEM_NN, (size_t)(slash - path) + 1))) {
        memcpy(dir, path, (size_t)(slash - path));
        dir[slash - path] = '\0';
    }
    char *base = dir ? ts__strdup(TS_MEM_NN, slash ? slash + 1 : path) : NULL;
    if (!base) {
        ts__free(TS_MEM_NN, dir);
        return TS_ERR_NO_MEMORY;
    }
    *dir_out = dir;
    *base_out = base;
    return TS_OK;
}

/* fsync of the folder `dir` that holds `path`, so that the rename is
 * durable. Filesystems that cannot sync a folder (EINVAL, ENOTSUP) are
 * accepted. */
static ts_status st_sync_dir(const char *op, const char *path, const char *dir)
{
    ts_status st = TS_OK;
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        st = ts_error(TS_ERR_IO, "%s: '%s' was written but its folder '%s' cannot be opened to sync it: %s", op, path,
                      dir, strerror(errno));
    else if (fsync(fd) != 0 && errno != EINVAL && errno != ENOTSUP)
        st = ts_error(TS_ERR_IO, "%s: '%s' was written but syncing its folder '%s' failed: %s", op, path, dir,
                      strerror(errno));
    if (fd >= 0) close(fd);
    return st;
}

/* Temporary files are named ".<base>.tmp.<pid>.<16 hex digits>" in the
 * target's folder: hidden, unpredictable (64 random bits), and with the
 * saver's pid so that the leftovers of a saver that died can be told from
 * the files of one still writing. */
#define ST_TMP_INFIX TS__TMP_INFIX
#define ST_TMP_RAND_HEX 16

int (*ts__safetensors_save_hook)(const char *tmp_path);

/* If `name` is ".<base>.tmp.<pid>.<hex>", the pid; else 0. */
static long st_tmp_pid(const char *name, const char *base)
{
    size_t bl = strlen(base);
    if (name[0] != '.' || strncmp(name + 1, base, bl) != 0) return 0;
    const char *p = name + 1 + bl;
    if (strncmp(p, ST_TMP_INFIX, strlen(ST_TMP_INFIX)) != 0) return 0;
    p += strlen(ST_TMP_INFIX);
    long pid = 0;
    const char *d = p;
    while (*d >= '0' && *d <= '9' && d - p < 10) pid = pid * 10 + (*d++ - '0');
    if (d == p || *d != '.' || pid <= 0) return 0;
    d++;
    size_t nh = 0;
    for (; d[nh]; nh++)
        if (!((d[nh] >= '0' && d[nh] <= '9') || (d[nh] >= 'a' && d[nh] <= 'f'))) return 0;
    return nh == ST_TMP_RAND_HEX ? pid : 0;
}

/* Removes, in `dir` only, the temporary files of `base` whose saver's pid
 * no longer exists (kill(pid, 0) fails with ESRCH). A pid that exists,
 * even one of another user, keeps its file. Best effort: a folder that
 * cannot be listed is skipped. */
static void st_clean_stale(const char *dir, const char *base)
{
    DIR *d = opendir(dir);
    if (!d) return;
    int dfd = dirfd(d);
    struct dirent *de;
    while ((de = readdir(d))) {
        long pid = st_tmp_pid(de->d_name, base);
        if (pid <= 0 || pid == (long)getpid()) continue;
        if (kill((pid_t)pid, 0) == 0 || errno != ESRCH) continue;
        struct stat sb;
        if (fstatat(dfd, de->d_name, &sb, AT_SYMLINK_NOFOLLOW) != 0 || S_ISDIR(sb.st_mode)) continue;
        if (unlinkat(dfd, de->d_name, 0) == 0)
            ts_logf(TS_LOG_INFO, "ts_safetensors_save: removed '%s/%s', left by process %ld that no longer runs", dir,
                    de->d_name, pid);
    }
    closedir(d);
}

/* ------------------------------------------------------------ streaming writer */

struct ts_safetensors_writer {
    const char *op;
    char *path, *dir, *tmp;
    int fd;
    int n, next;                /* tensors in the header, the next one to write */
    ts_safetensors_desc *descs; /* names and shapes copied */
    char **names;
    int64_t *shapes; /* n * TS_MAX_DIMS */
    st_writer w;
    ts_status failed; /* a write already failed (the rest is skipped) */
};

static void st_stream_free(ts_safetensors_writer *s)
{
    for (int i = 0; s->names && i < s->n; i++) ts__free(TS_MEM_NN, s->names[i]);
    ts__free(TS_MEM_NN, s->names);
    ts__free(TS_MEM_NN, s->descs);
    ts__free(TS_MEM_NN, s->shapes);
    ts__free(TS_MEM_NN, s->w.buf);
    ts__free(TS_MEM_NN, s->path);
    ts__free(TS_MEM_NN, s->dir);
    ts__free(TS_MEM_NN, s->tmp);
    ts__free(TS_MEM_NN, s);
}

void ts_safetensors_writer_abort(ts_safetensors_writer *s)
{
    if (!s) return;
    if (s->fd >= 0) close(s->fd);
    if (s->tmp) unlink(s->tmp);
    st_stream_free(s);
}

ts_status ts_safetensors_writer_open(const char *op, const char *path, int n, const ts_safetensors_desc *descs,
                                     const char *const *metadata, int n_meta, ts_safetensors_writer **out)
{
    if (!op || !path || (n && !descs) || !out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL argument", op ? op : "ts_safetensors_writer_open");
    if (n < 0) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: '%s': %d tensors", op, path, n);
    if (path[0] == '\0') return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: the path is empty", op);
    if (n_meta < 0 || (n_meta > 0 && !metadata))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: '%s': %d metadata pairs given with %s list", op, path, n_meta,
                        metadata ? "a" : "a NULL");
    size_t plen = strlen(path);
    if (path[plen - 1] == '/')
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: '%s' ends with '/': give a file name", op, path);

    json_t *root = NULL;
    ts_status st = st_build_header(op, path, n, descs, metadata, n_meta, &root);
    if (st) return st;
    /* compact JSON, then spaces up to a multiple of 8 bytes */
    size_t jlen = json_dumpb(root, NULL, 0, JSON_COMPACT);
    size_t hlen = (jlen + 7) & ~(size_t)7;
    char *hdr = jlen ? ts__malloc(TS_MEM_NN, hlen) : NULL;
    if (!hdr || json_dumpb(root, hdr, jlen, JSON_COMPACT) != jlen) {
        json_decref(root);
        ts__free(TS_MEM_NN, hdr);
        return ts_error(TS_ERR_NO_MEMORY, "%s: '%s': cannot serialise the header", op, path);
    }
    json_decref(root);
    memset(hdr + jlen, ' ', hlen - jlen);

    ts_safetensors_writer *s = ts__calloc(TS_MEM_NN, 1, sizeof *s);
    if (!s) {
        ts__free(TS_MEM_NN, hdr);
        return TS_ERR_NO_MEMORY;
    }
    s->op = op;
    s->fd = -1;
    s->n = n;
    char *base = NULL;
    if (!(s->path = ts__strdup(TS_MEM_NN, path))) st = TS_ERR_NO_MEMORY;
    if (!st && n) {
        s->descs = ts__calloc(TS_MEM_NN, (size_t)n, sizeof *s->descs);
        s->names = ts__calloc(TS_MEM_NN, (size_t)n, sizeof *s->names);
        s->shapes = ts__calloc(TS_MEM_NN, (size_t)n * TS_MAX_DIMS, sizeof *s->shapes);
        if (!s->descs || !s->names || !s->shapes) st = TS_ERR_NO_MEMORY;
        for (int i = 0; i < n && !st; i++) {
            if (!(s->names[i] = ts__strdup(TS_MEM_NN, descs[i].name))) {
                st = TS_ERR_NO_MEMORY;
                break;
            }
            memcpy(s->shapes + (size_t)i * TS_MAX_DIMS, descs[i].shape, (size_t)descs[i].ndim * sizeof(int64_t));
            s->descs[i] = (ts_safetensors_desc){s->names[i], descs[i].dtype, descs[i].ndim,
                                                s->shapes + (size_t)i * TS_MAX_DIMS, NULL};
        }
    }
    if (!st && !(s->w.buf = ts__malloc(TS_MEM_NN, ST_WBUF)))
        st = ts_error(TS_ERR_NO_MEMORY, "%s: '%s': no memory for the write buffer", op, path);
    if (!st) st = st_split_path(path, &s->dir, &base);
    if (!st) {
        st_clean_stale(s->dir, base);
        /* mode 0600 while it is written; 0644 under the umask only just
         * before the rename */
        st = ts__tmp_create(TS_MEM_NN, op, s->dir, base, path, &s->tmp, &s->fd);
    }
    ts__free(TS_MEM_NN, base);
    if (!st && ts__safetensors_save_hook && ts__safetensors_save_hook(s->tmp) != 0)
        st = ts_error(TS_ERR_IO, "%s: writing '%s' (temporary file '%s'): failure injected by a test hook", op, path,
                      s->tmp);
    if (!st) {
        s->w.fd = s->fd;
        unsigned char prefix[8];
        for (int i = 0; i < 8; i++) prefix[i] = (unsigned char)((uint64_t)hlen >> (8 * i));
        if (st_put(&s->w, prefix, 8) || st_put(&s->w, hdr, hlen))
            st = ts_error(TS_ERR_IO, "%s: writing '%s' (temporary file '%s'): %s", op, path, s->tmp, strerror(errno));
    }
    ts__free(TS_MEM_NN, hdr);
    if (st) {
        ts_safetensors_writer_abort(s);
        return st;
    }
    *out = s;
    return TS_OK;
}

ts_status ts_safetensors_writer_put(ts_safetensors_writer *s, const ts_tensor *t)
{
    if (!s || !t)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL argument", s ? s->op : "ts_safetensors_writer_put");
    const char *op = s->op;
    if (s->failed) return s->failed;
    if (s->next >= s->n)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: '%s': more tensors than the %d of the header", op, s->path, s->n);
    const ts_safetensors_desc *d = &s->descs[s->next];
    int64_t numel = 1;
    for (int k = 0; k < d->ndim; k++) numel *= d->shape[k];
    if (ts_tensor_dtype(t) != d->dtype || ts_tensor_numel(t) != numel)
        return s->failed = ts_error(TS_ERR_SHAPE,
                                    "%s: '%s': tensor %d ('%.*s') has dtype %s and %lld elements; the header says %s "
                                    "and %lld",
                                    op, s->path, s->next, ST_NAME_MAX_SHOWN, d->name, ts_dtype_name(ts_tensor_dtype(t)),
                                    (long long)ts_tensor_numel(t), ts_dtype_name(d->dtype), (long long)numel);
    if (ts_tensor_device(t) == TS_DEVICE_META)
        return s->failed = ts_error(TS_ERR_STATE,
                                    "%s: '%s': tensor %d ('%.*s') is on the meta device (it has no data): materialize "
                                    "the model (ts_fsdp_materialize) or load a checkpoint first",
                                    op, s->path, s->next, ST_NAME_MAX_SHOWN, d->name);
    s->next++;
    st_writer *w = &s->w;
    size_t nbytes = (size_t)numel * ts_dtype_size(d->dtype);
    ts_status st = TS_OK;
    int rc = 0;
    if (!nbytes) return TS_OK;
    if (ts_tensor_is_contiguous(t)) {
        rc = st_put(w, ts_tensor_data(t), nbytes);
    } else {
        /* row-major copy of a strided tensor: through the write buffer
         * when it fits, else through a buffer of its own */
        void *tmpbuf = NULL, *dst = NULL;
        if (nbytes <= ST_WBUF) {
            if (w->used + nbytes > ST_WBUF) rc = st_flush(w);
            dst = w->buf + w->used;
        } else if (!(dst = tmpbuf = ts__malloc(TS_MEM_NN, nbytes))) {
            st = ts_error(TS_ERR_NO_MEMORY, "%s: '%s': no memory to copy tensor '%s' (%zu bytes)", op, s->path, d->name,
                          nbytes);
        }
        if (!rc && !st && !(st = ts_tensor_copy_to(t, dst, nbytes))) {
            if (tmpbuf) rc = st_put(w, tmpbuf, nbytes);
            else w->used += nbytes;
        }
        ts__free(TS_MEM_NN, tmpbuf);
    }
    if (rc && !st)
        st = ts_error(TS_ERR_IO, "%s: writing '%s' (temporary file '%s'): %s", op, s->path, s->tmp, strerror(errno));
    return s->failed = st;
}

ts_status ts_safetensors_writer_commit(ts_safetensors_writer *s)
{
    if (!s) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_safetensors_writer_commit: NULL argument");
    const char *op = s->op;
    ts_status st = s->failed;
    if (!st && s->next != s->n)
        st = ts_error(TS_ERR_INVALID_ARGUMENT, "%s: '%s': %d of the header's %d tensors were written", op, s->path,
                      s->next, s->n);
    if (!st && st_flush(&s->w) != 0)
        st = ts_error(TS_ERR_IO, "%s: writing '%s' (temporary file '%s'): %s", op, s->path, s->tmp, strerror(errno));
    if (!st && fchmod(s->fd, (mode_t)ts__file_mode(0644)) != 0)
        st = ts_error(TS_ERR_IO, "%s: setting the mode of the temporary file '%s' for '%s' failed: %s", op, s->tmp,
                      s->path, strerror(errno));
    if (!st && fsync(s->fd) != 0)
        st = ts_error(TS_ERR_IO, "%s: fsync of the temporary file '%s' for '%s' failed: %s", op, s->tmp, s->path,
                      strerror(errno));
    int fd = s->fd;
    s->fd = -1;
    if (close(fd) != 0 && !st)
        st = ts_error(TS_ERR_IO, "%s: closing the temporary file '%s' for '%s' failed: %s", op, s->tmp, s->path,
                      strerror(errno));
    if (!st && rename(s->tmp, s->path) != 0)
        st = ts_error(TS_ERR_IO, "%s: cannot rename '%s' to '%s': %s", op, s->tmp, s->path, strerror(errno));
    if (st) {
        ts_safetensors_writer_abort(s);
        return st;
    }
    st = st_sync_dir(op, s->path, s->dir);
    st_stream_free(s);
    return st;
}
