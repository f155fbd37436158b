/* safetensors save/load: round trips, the exact byte layout, and every
 * kind of truncated, oversized or malformed file failing cleanly. */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "tests/helpers.h"

/* ------------------------------------------------------------ helpers */

static char tmpdir[64];

static int rm_one(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    chmod(p, 0700);
    return remove(p);
}

static void make_tmpdir(void)
{
    snprintf(tmpdir, sizeof tmpdir, "/tmp/ts_safetensors_XXXXXX");
    cr_assert_not_null(mkdtemp(tmpdir), "mkdtemp: %s", strerror(errno));
}

static void remove_tmpdir(void)
{
    if (tmpdir[0]) nftw(tmpdir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

TestSuite(nn_safetensors, .init = make_tmpdir, .fini = remove_tmpdir);

/* tmpdir + "/" + name in a static buffer (one at a time per call site) */
static const char *tpath(char *buf, size_t len, const char *name)
{
    snprintf(buf, len, "%s/%s", tmpdir, name);
    return buf;
}

static void write_bytes(const char *path, const void *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f, "fopen %s: %s", path, strerror(errno));
    cr_assert_eq(fwrite(p, 1, n, f), n);
    cr_assert_eq(fclose(f), 0);
}

static size_t count_dir_entries(void)
{
    size_t n = 0;
    DIR *d = opendir(tmpdir);
    cr_assert_not_null(d);
    struct dirent *e;
    while ((e = readdir(d))) n += strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0;
    closedir(d);
    return n;
}

/* A safetensors buffer from a header string (not padded) and data bytes.
 * Returns malloc'd bytes of exactly *len_out bytes. */
static unsigned char *mk_file(const char *header, const void *data, size_t dlen, size_t *len_out)
{
    size_t h = strlen(header);
    unsigned char *b = malloc(8 + h + dlen + 1);
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)((uint64_t)h >> (8 * i));
    memcpy(b + 8, header, h);
    if (dlen) memcpy(b + 8 + h, data, dlen);
    *len_out = 8 + h + dlen;
    return b;
}

/* Parses header+data and asserts the status; the message must contain
 * every string in `want` (NULL-terminated). */
static void expect_parse_error(const char *header, const void *data, size_t dlen, ts_status want_st,
                               const char *const *want)
{
    size_t len;
    unsigned char *b = mk_file(header, data, dlen, &len);
    ts_state_dict *sd = (ts_state_dict *)0x1;
    ts_status st = ts_safetensors_parse(b, len, &sd);
    free(b);
    cr_assert_eq(st, want_st, "header %s: got %s (%s), want %s", header, ts_status_name(st), ts_last_error(),
                 ts_status_name(want_st));
    cr_assert_eq(sd, (ts_state_dict *)0x1, "output written on failure");
    for (int i = 0; want && want[i]; i++)
        cr_assert_not_null(strstr(ts_last_error(), want[i]), "header %s: message '%s' lacks '%s'", header,
                           ts_last_error(), want[i]);
}

#define EXPECT_FORMAT(header, data, dlen, ...) \
    do { \
        const char *const want_[] = {__VA_ARGS__, NULL}; \
        expect_parse_error((header), (data), (dlen), TS_ERR_FORMAT, want_); \
    } while (0)

/* Asserts two tensors have the same dtype, shape and bytes. */
static void assert_same(const ts_tensor *a, const ts_tensor *b)
{
    char s1[96], s2[96];
    cr_assert_eq(ts_tensor_dtype(a), ts_tensor_dtype(b), "dtype %s vs %s", ts_dtype_name(ts_tensor_dtype(a)),
                 ts_dtype_name(ts_tensor_dtype(b)));
    cr_assert_eq(ts_tensor_ndim(a), ts_tensor_ndim(b), "shape %s vs %s", ts_tensor_shape_str(a, s1, sizeof s1),
                 ts_tensor_shape_str(b, s2, sizeof s2));
    for (int i = 0; i < ts_tensor_ndim(a); i++)
        cr_assert_eq(ts_tensor_shape(a)[i], ts_tensor_shape(b)[i], "shape %s vs %s",
                     ts_tensor_shape_str(a, s1, sizeof s1), ts_tensor_shape_str(b, s2, sizeof s2));
    size_t n = (size_t)ts_tensor_numel(a) * ts_dtype_size(ts_tensor_dtype(a));
    unsigned char *x = malloc(n + 1), *y = malloc(n + 1);
    TH_OK(ts_tensor_copy_to(a, x, n));
    TH_OK(ts_tensor_copy_to(b, y, n));
    cr_assert(memcmp(x, y, n) == 0, "bytes differ");
    free(x);
    free(y);
}

/* ------------------------------------------------------------ round trips */

Test(nn_safetensors, round_trip_every_dtype_with_scalars_and_empty_tensors)
{
    th_mem_mark();
    ts_state_dict *sd;
    TH_OK(ts_state_dict_new(&sd));
    /* insertion order is deliberately not alphabetical: it must be kept */
    const int64_t s23[] = {2, 3}, s4[] = {4}, s0[] = {0}, s203[] = {2, 0, 3}, s2x[] = {2, 1, 2};
    struct {
        const char *name;
        ts_dtype dt;
        int ndim;
        const int64_t *shape;
    } cases[] = {
        {"z.f32", TS_F32, 2, s23},
        {"y.f64", TS_F64, 1, s4},
        {"x.bf16", TS_BF16, 2, s23},
        {"w.f16", TS_F16, 3, s2x},
        {"v.i64", TS_I64, 1, s4},
        {"u.i32", TS_I32, 2, s23},
        {"t.bool", TS_BOOL, 1, s4},
        {"scalar.f32", TS_F32, 0, NULL},
        {"scalar.i64", TS_I64, 0, NULL},
        {"scalar.bool", TS_BOOL, 0, NULL},
        {"empty.f32", TS_F32, 1, s0},
        {"empty.bf16", TS_BF16, 3, s203},
        {"\xc3\xa9t\xc3\xa9.unicode", TS_F16, 1, s4},
    };
    int n = (int)(sizeof cases / sizeof cases[0]);
    for (int i = 0; i < n; i++) {
        ts_tensor *t = th_seq(cases[i].dt, cases[i].ndim, cases[i].shape, 50.0, false);
        TH_OK(ts_state_dict_set(sd, cases[i].name, t));
        ts_tensor_free(t);
    }
    /* special values survive byte for byte */
    ts_tensor *special;
    const int64_t s5[] = {5};
    const double sv[] = {0.0, -0.0, INFINITY, -INFINITY, NAN};
    special = th_tensor(TS_F64, 1, s5, sv);
    TH_OK(ts_state_dict_set(sd, "special", special));
    ts_tensor_free(special);

    char p[128];
    TH_OK(ts_safetensors_save(tpath(p, sizeof p, "all.safetensors"), sd, NULL, 0));
    ts_state_dict *back;
    TH_OK(ts_safetensors_load(p, &back));
    cr_assert_eq(ts_state_dict_size(back), n + 1);
    for (int i = 0; i < n + 1; i++) {
        cr_assert_str_eq(ts_state_dict_name(back, i), ts_state_dict_name(sd, i), "order at %d", i);
        assert_same(ts_state_dict_tensor(back, i), ts_state_dict_tensor(sd, i));
    }
    /* the same bytes through the buffer parser */
    size_t len;
    void *raw = th_read_file(p, &len);
    ts_state_dict *back2;
    TH_OK(ts_safetensors_parse(raw, len, &back2));
    cr_assert_eq(ts_state_dict_size(back2), n + 1);
    for (int i = 0; i < n + 1; i++) assert_same(ts_state_dict_tensor(back2, i), ts_state_dict_tensor(sd, i));
    /* the loaded tensors own their data */
    memset(raw, 0, len);
    free(raw);
    for (int i = 0; i < n + 1; i++) assert_same(ts_state_dict_tensor(back2, i), ts_state_dict_tensor(sd, i));
    ts_state_dict_free(back2);
    ts_state_dict_free(back);
    ts_state_dict_free(sd);
    cr_assert_eq(count_dir_entries(), 1, "no temporary file is left");
    th_mem_assert_back();
}

Test(nn_safetensors, empty_state_dict_round_trips)
{
    th_mem_mark();
    ts_state_dict *sd, *back;
    TH_OK(ts_state_dict_new(&sd));
    char p[128];
    TH_OK(ts_safetensors_save(tpath(p, sizeof p, "empty.safetensors"), sd, NULL, 0));
    size_t len;
    unsigned char *raw = th_read_file(p, &len);
    /* "{}" padded with six spaces to 8 bytes; the length field says 8 */
    static const unsigned char want[] = {8, 0, 0, 0, 0, 0, 0, 0, '{', '}', ' ', ' ', ' ', ' ', ' ', ' '};
    cr_assert_eq(len, sizeof want);
    cr_assert(memcmp(raw, want, len) == 0);
    free(raw);
    TH_OK(ts_safetensors_load(p, &back));
    cr_assert_eq(ts_state_dict_size(back), 0);
    ts_state_dict_free(back);
    ts_state_dict_free(sd);
    th_mem_assert_back();
}

Test(nn_safetensors, non_contiguous_sources_are_written_row_major)
{
    th_mem_mark();
    const int64_t s34[] = {3, 4};
    ts_tensor *base = th_seq(TS_F32, 2, s34, 1.0, false);
    ts_tensor *tr, *sl, *big_base, *big_tr;
    TH_OK(ts_transpose(base, 0, 1, &tr));   /* (4, 3), strides (1, 4) */
    TH_OK(ts_slice(base, 1, 0, 4, 2, &sl)); /* (3, 2), strides (4, 2) */
    /* larger than the 1 MiB write buffer, so it takes the other path */
    const int64_t sbig[] = {700, 500};
    big_base = th_seq(TS_F64, 2, sbig, 1.0, false);
    TH_OK(ts_transpose(big_base, 0, 1, &big_tr));
    cr_assert(!ts_tensor_is_contiguous(tr) && !ts_tensor_is_contiguous(sl) && !ts_tensor_is_contiguous(big_tr));

    ts_state_dict *sd, *back;
    TH_OK(ts_state_dict_new(&sd));
    TH_OK(ts_state_dict_set(sd, "transposed", tr));
    TH_OK(ts_state_dict_set(sd, "sliced", sl));
    TH_OK(ts_state_dict_set(sd, "big_transposed", big_tr));
    TH_OK(ts_state_dict_set(sd, "base", base));
    char p[128];
    TH_OK(ts_safetensors_save(tpath(p, sizeof p, "views.safetensors"), sd, NULL, 0));
    TH_OK(ts_safetensors_load(p, &back));
    cr_assert_eq(ts_state_dict_size(back), 4);
    for (int i = 0; i < 4; i++) {
        ts_tensor *want;
        TH_OK(ts_contiguous(ts_state_dict_tensor(sd, i), &want));
        assert_same(ts_state_dict_tensor(back, i), want);
        cr_assert(ts_tensor_is_contiguous(ts_state_dict_tensor(back, i)));
        ts_tensor_free(want);
    }
    /* element (r, c) of the transposed tensor is base (c, r) */
    double a, b;
    TH_OK(ts_tensor_get(ts_state_dict_get(back, "transposed"), (int64_t[]){3, 1}, &a));
    TH_OK(ts_tensor_get(base, (int64_t[]){1, 3}, &b));
    cr_assert_eq(a, b);
    ts_state_dict_free(back);
    ts_state_dict_free(sd);
    ts_tensor_free(tr);
    ts_tensor_free(sl);
    ts_tensor_free(big_tr);
    ts_tensor_free(big_base);
    ts_tensor_free(base);
    th_mem_assert_back();
}

Test(nn_safetensors, metadata_is_written_and_accepted_on_load)
{
    th_mem_mark();
    ts_state_dict *sd, *back;
    TH_OK(ts_state_dict_new(&sd));
    ts_tensor *t = th_seq(TS_F32, 1, (int64_t[]){3}, 1.0, false);
    TH_OK(ts_state_dict_set(sd, "t", t));
    const char *meta[] = {"format", "pt", "step", "1200", "note", "quote \" and \xc3\xa9"};
    char p[128];
    TH_OK(ts_safetensors_save(tpath(p, sizeof p, "meta.safetensors"), sd, meta, 3));

    size_t len;
    unsigned char *raw = th_read_file(p, &len);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = n << 8 | raw[i];
    cr_assert_eq(n % 8, 0, "header length %llu is a multiple of 8", (unsigned long long)n);
    json_error_t err;
    json_t *root = json_loadb((const char *)raw + 8, (size_t)n, 0, &err);
    cr_assert_not_null(root, "%s", err.text);
    /* __metadata__ comes first, then the tensors */
    void *it = json_object_iter(root);
    cr_assert_str_eq(json_object_iter_key(it), "__metadata__");
    json_t *m = json_object_get(root, "__metadata__");
    cr_assert_eq(json_object_size(m), 3);
    cr_assert_str_eq(json_string_value(json_object_get(m, "format")), "pt");
    cr_assert_str_eq(json_string_value(json_object_get(m, "step")), "1200");
    cr_assert_str_eq(json_string_value(json_object_get(m, "note")), "quote \" and \xc3\xa9");
    json_decref(root);
    free(raw);

    TH_OK(ts_safetensors_load(p, &back));
    cr_assert_eq(ts_state_dict_size(back), 1);
    assert_same(ts_state_dict_get(back, "t"), t);
    ts_state_dict_free(back);

    /* bad metadata: nothing is written */
    const char *dup[] = {"k", "1", "k", "2"};
    const char *nul[] = {"k", NULL};
    const char *bad_utf8[] = {"k", "\xff\xfe"};
    const char *bad_key[] = {"\xc3", "v"};
    char q[128];
    tpath(q, sizeof q, "bad_meta.safetensors");
    cr_assert_eq(ts_safetensors_save(q, sd, dup, 2), TS_ERR_INVALID_ARGUMENT);
    cr_assert_not_null(strstr(ts_last_error(), "'k' is given twice"), "%s", ts_last_error());
    cr_assert_eq(ts_safetensors_save(q, sd, nul, 1), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_safetensors_save(q, sd, bad_utf8, 1), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_safetensors_save(q, sd, bad_key, 1), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_safetensors_save(q, sd, NULL, 1), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_safetensors_save(q, sd, meta, -1), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(access(q, F_OK), -1);
    cr_assert_eq(count_dir_entries(), 1);

    /* "__metadata__": null is no metadata (the Rust reader's Option) */
    size_t nlen;
    unsigned char *nb = mk_file("{\"__metadata__\":null}", NULL, 0, &nlen);
    TH_OK(ts_safetensors_parse(nb, nlen, &back));
    cr_assert_eq(ts_state_dict_size(back), 0);
    ts_state_dict_free(back);
    free(nb);

    /* a metadata value that is not a string is malformed */
    EXPECT_FORMAT("{\"__metadata__\":{\"step\":12}}", NULL, 0, "__metadata__", "'step'", "not a string");
    EXPECT_FORMAT("{\"__metadata__\":[\"a\"]}", NULL, 0, "__metadata__", "not an object");
    ts_tensor_free(t);
    ts_state_dict_free(sd);
    th_mem_assert_back();
}

/* ------------------------------------------------------------ byte layout */

/*
 * The expected file, written out by hand from the format description
 * (github.com/huggingface/safetensors README, "Format"), for a state dict
 * {"w": f32 [1, -2], "s": bool scalar true, "e": int64 shape (0,)} with
 * metadata {"format": "pt"}:
 *
 * - The header is compact JSON (no spaces), "__metadata__" first, then the
 *   entries in insertion order, each {"dtype", "shape", "data_offsets"} in
 *   that order (the Rust TensorInfo field order):
 *     {"__metadata__":{"format":"pt"},                        32 bytes
 *     "w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},   53 bytes
 *     "s":{"dtype":"BOOL","shape":[],"data_offsets":[8,9]},   53 bytes
 *     "e":{"dtype":"I64","shape":[0],"data_offsets":[9,9]}}   53 bytes
 *   = 191 bytes; "w" holds 2 * 4 bytes at [0, 8), "s" 1 byte at [8, 9), and
 *   the empty "e" 0 bytes at [9, 9).
 * - The Rust writer pads the JSON with spaces to a multiple of 8: 191 -> 192,
 *   one space. The length field is 192 = 0xC0 as a little-endian u64.
 * - Data, little-endian: 1.0f = 0x3F800000 -> 00 00 80 3F;
 *   -2.0f = 0xC0000000 -> 00 00 00 C0; true -> 01.
 * Total 8 + 192 + 9 = 209 bytes.
 */
static const char expected_json[] = "{\"__metadata__\":{\"format\":\"pt\"},"
                                    "\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                                    "\"s\":{\"dtype\":\"BOOL\",\"shape\":[],\"data_offsets\":[8,9]},"
                                    "\"e\":{\"dtype\":\"I64\",\"shape\":[0],\"data_offsets\":[9,9]}}"
                                    " ";
static const unsigned char expected_prefix[8] = {0xC0, 0, 0, 0, 0, 0, 0, 0};
static const unsigned char expected_data[9] = {0x00, 0x00, 0x80, 0x3F, 0x00, 0x00, 0x00, 0xC0, 0x01};

static unsigned char *expected_file(size_t *len)
{
    cr_assert_eq(sizeof expected_json - 1, 192);
    *len = 8 + 192 + 9;
    unsigned char *b = malloc(*len);
    memcpy(b, expected_prefix, 8);
    memcpy(b + 8, expected_json, 192);
    memcpy(b + 200, expected_data, 9);
    return b;
}

static ts_state_dict *expected_dict(void)
{
    ts_state_dict *sd;
    TH_OK(ts_state_dict_new(&sd));
    ts_tensor *w = th_tensor(TS_F32, 1, (int64_t[]){2}, (double[]){1.0, -2.0});
    ts_tensor *s, *e;
    TH_OK(ts_tensor_scalar(TS_BOOL, 1.0, &s));
    TH_OK(ts_tensor_empty(TS_I64, 1, (int64_t[]){0}, &e));
    TH_OK(ts_state_dict_set(sd, "w", w));
    TH_OK(ts_state_dict_set(sd, "s", s));
    TH_OK(ts_state_dict_set(sd, "e", e));
    ts_tensor_free(w);
    ts_tensor_free(s);
    ts_tensor_free(e);
    return sd;
}

Test(nn_safetensors, writes_the_exact_bytes_of_the_format)
{
    th_mem_mark();
    ts_state_dict *sd = expected_dict();
    const char *meta[] = {"format", "pt"};
    char p[128];
    TH_OK(ts_safetensors_save(tpath(p, sizeof p, "exact.safetensors"), sd, meta, 1));
    size_t len, wlen;
    unsigned char *raw = th_read_file(p, &len);
    unsigned char *want = expected_file(&wlen);
    cr_assert_eq(len, wlen, "file has %zu bytes, expected %zu", len, wlen);
    for (size_t i = 0; i < len; i++)
        cr_assert_eq(raw[i], want[i], "byte %zu: 0x%02x, expected 0x%02x", i, raw[i], want[i]);
    free(raw);
    free(want);
    ts_state_dict_free(sd);
    th_mem_assert_back();
}

Test(nn_safetensors, reads_the_hand_written_file)
{
    th_mem_mark();
    size_t len;
    unsigned char *b = expected_file(&len);
    ts_state_dict *got, *want = expected_dict();
    TH_OK(ts_safetensors_parse(b, len, &got));
    cr_assert_eq(ts_state_dict_size(got), 3);
    for (int i = 0; i < 3; i++) {
        cr_assert_str_eq(ts_state_dict_name(got, i), ts_state_dict_name(want, i));
        assert_same(ts_state_dict_tensor(got, i), ts_state_dict_tensor(want, i));
    }
    ts_state_dict_free(got);
    ts_state_dict_free(want);
    free(b);
    th_mem_assert_back();
}

Test(nn_safetensors, reads_entries_in_any_offset_order)
{
    /* as the Rust writer does, entries may be listed in another order than
     * their data (it sorts by dtype alignment, then name); the dict keeps
     * the header order */
    th_mem_mark();
    const float fa[2] = {1.5f, 2.5f};
    const int32_t ib[3] = {7, -8, 9};
    unsigned char data[20];
    memcpy(data, ib, 12);
    memcpy(data + 12, fa, 8);
    size_t len;
    unsigned char *b = mk_file("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[12,20]},"
                               "\"b\":{\"dtype\":\"I32\",\"shape\":[3],\"data_offsets\":[0,12]},"
                               "\"e\":{\"dtype\":\"F64\",\"shape\":[0,4],\"data_offsets\":[12,12],\"extra\":1}}  ",
                               data, sizeof data, &len);
    ts_state_dict *sd;
    TH_OK(ts_safetensors_parse(b, len, &sd));
    free(b);
    cr_assert_eq(ts_state_dict_size(sd), 3);
    cr_assert_str_eq(ts_state_dict_name(sd, 0), "a");
    cr_assert_str_eq(ts_state_dict_name(sd, 1), "b");
    double v;
    TH_OK(ts_tensor_get(ts_state_dict_get(sd, "a"), (int64_t[]){1}, &v));
    cr_assert_eq(v, 2.5);
    TH_OK(ts_tensor_get(ts_state_dict_get(sd, "b"), (int64_t[]){1}, &v));
    cr_assert_eq(v, -8.0);
    cr_assert_eq(ts_tensor_size(ts_state_dict_get(sd, "e"), 1), 4);
    ts_state_dict_free(sd);
    th_mem_assert_back();
}

/* ------------------------------------------------------------ bad files */

Test(nn_safetensors, every_truncation_of_a_valid_file_fails_cleanly)
{
    th_mem_mark();
    size_t full;
    unsigned char *b = expected_file(&full);
    char p[128];
    tpath(p, sizeof p, "truncated.safetensors");
    for (size_t len = 0; len < full; len++) {
        /* an exact-size copy, so that the sanitizer sees any over-read */
        unsigned char *c = malloc(len ? len : 1);
        memcpy(c, b, len);
        ts_state_dict *sd = NULL;
        ts_status st = ts_safetensors_parse(c, len, &sd);
        cr_assert_eq(st, TS_ERR_FORMAT, "parse of %zu bytes: %s (%s)", len, ts_status_name(st), ts_last_error());
        cr_assert_null(sd);
        cr_assert_neq(ts_last_error()[0], '\0');
        free(c);

        write_bytes(p, b, len);
        st = ts_safetensors_load(p, &sd);
        cr_assert_eq(st, TS_ERR_FORMAT, "load of %zu bytes: %s (%s)", len, ts_status_name(st), ts_last_error());
        cr_assert_null(sd);
        cr_assert_not_null(strstr(ts_last_error(), p), "message names the path: %s", ts_last_error());
    }
    /* the full length loads */
    ts_state_dict *sd;
    TH_OK(ts_safetensors_parse(b, full, &sd));
    ts_state_dict_free(sd);
    /* a few lengths with the messages they give */
    cr_assert_eq(ts_safetensors_parse(b, 5, &sd), TS_ERR_FORMAT);
    cr_assert_not_null(strstr(ts_last_error(), "fewer than the 8-byte header length"), "%s", ts_last_error());
    cr_assert_eq(ts_safetensors_parse(b, 100, &sd), TS_ERR_FORMAT);
    cr_assert_not_null(strstr(ts_last_error(), "header length 192 exceeds the 92 bytes"), "%s", ts_last_error());
    cr_assert_eq(ts_safetensors_parse(b, 204, &sd), TS_ERR_FORMAT);
    cr_assert_not_null(strstr(ts_last_error(), "data_offsets [0, 8] do not lie within the data buffer of 4 bytes"),
                       "%s", ts_last_error());
    /* one byte too many is malformed too: the tensors must cover the buffer */
    unsigned char *longer = malloc(full + 1);
    memcpy(longer, b, full);
    longer[full] = 0;
    cr_assert_eq(ts_safetensors_parse(longer, full + 1, &sd), TS_ERR_FORMAT);
    cr_assert_not_null(strstr(ts_last_error(), "the tensors end at byte 9 (key 'e') but the data buffer has 10"), "%s",
                       ts_last_error());
    free(longer);
    free(b);
    th_mem_assert_back();
}

Test(nn_safetensors, oversized_header_length_is_rejected)
{
    th_mem_mark();
    unsigned char b[64];
    memset(b, ' ', sizeof b);
    memcpy(b + 8, "{}", 2);
    ts_state_dict *sd = NULL;
    /* 2^64 - 1 */
    memset(b, 0xFF, 8);
    cr_assert_eq(ts_safetensors_parse(b, sizeof b, &sd), TS_ERR_FORMAT);
    cr_assert_not_null(strstr(ts_last_error(), "header length 18446744073709551615 exceeds the limit of 100000000"),
                       "%s", ts_last_error());
    /* 100 MB + 1: over the limit even though a file could hold it */
    uint64_t n = 100000001;
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)(n >> (8 * i));
    cr_assert_eq(ts_safetensors_parse(b, sizeof b, &sd), TS_ERR_FORMAT);
    cr_assert_not_null(strstr(ts_last_error(), "exceeds the limit"), "%s", ts_last_error());
    /* one more than what follows the length field */
    memset(b, 0, 8);
    b[0] = 57;
    cr_assert_eq(ts_safetensors_parse(b, sizeof b, &sd), TS_ERR_FORMAT);
    cr_assert_not_null(strstr(ts_last_error(), "header length 57 exceeds the 56 bytes"), "%s", ts_last_error());
    /* exactly what follows is fine ("{}" and spaces, no data) */
    b[0] = 56;
    TH_OK(ts_safetensors_parse(b, sizeof b, &sd));
    ts_state_dict_free(sd);
    /* on disk too */
    char p[128];
    b[0] = 0xFF;
    b[4] = 0x01;
    write_bytes(tpath(p, sizeof p, "huge.safetensors"), b, sizeof b);
    sd = NULL;
    cr_assert_eq(ts_safetensors_load(p, &sd), TS_ERR_FORMAT);
    cr_assert_null(sd);
    cr_assert_not_null(strstr(ts_last_error(), p));
    th_mem_assert_back();
}

Test(nn_safetensors, header_that_is_not_json_is_rejected)
{
    th_mem_mark();
    EXPECT_FORMAT("{not json}", NULL, 0, "<buffer>", "not valid JSON");
    EXPECT_FORMAT("{\"a\":{\"dtype\":\"F32\"", NULL, 0, "not valid JSON");
    EXPECT_FORMAT("{}x", NULL, 0, "not valid JSON");
    EXPECT_FORMAT("{} {}", NULL, 0, "not valid JSON");
    EXPECT_FORMAT("", NULL, 0, "does not start with '{'");
    EXPECT_FORMAT("[1, 2]  ", NULL, 0, "does not start with '{'");
    EXPECT_FORMAT(" {}     ", NULL, 0, "does not start with '{'");
    EXPECT_FORMAT("\"str\"", NULL, 0, "does not start with '{'");
    /* invalid UTF-8 in a name, a NUL escape in a name */
    EXPECT_FORMAT("{\"\xff\":{}}", NULL, 0, "not valid JSON");
    EXPECT_FORMAT("{\"a\\u0000b\":{}}", NULL, 0, "not valid JSON");
    /* a raw NUL byte inside the header */
    size_t len;
    unsigned char *b = mk_file("{}  ", NULL, 0, &len);
    b[10] = 0;
    ts_state_dict *sd = NULL;
    cr_assert_eq(ts_safetensors_parse(b, len, &sd), TS_ERR_FORMAT);
    free(b);
    /* a tensor entry that is not an object, a name that is empty */
    EXPECT_FORMAT("{\"a\":[1,2]}", NULL, 0, "key 'a'", "not an object");
    EXPECT_FORMAT("{\"\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,4]}}", "abcd", 4, "empty name");
    /* duplicate keys */
    EXPECT_FORMAT("{\"a\":{\"dtype\":\"BOOL\",\"shape\":[],\"data_offsets\":[0,1]},"
                  "\"a\":{\"dtype\":\"BOOL\",\"shape\":[],\"data_offsets\":[1,2]}}",
                  "\x01\x00", 2, "duplicate");
    EXPECT_FORMAT("{\"__metadata__\":{},\"__metadata__\":{}}", NULL, 0, "duplicate");
    th_mem_assert_back();
}

Test(nn_safetensors, wrong_dtype_string_is_rejected)
{
    th_mem_mark();
    EXPECT_FORMAT("{\"w\":{\"dtype\":\"F8_E4M3\",\"shape\":[4],\"data_offsets\":[0,4]}}", "abcd", 4, "key 'w'",
                  "dtype 'F8_E4M3' is unknown or not supported");
    EXPECT_FORMAT("{\"w\":{\"dtype\":\"f32\",\"shape\":[1],\"data_offsets\":[0,4]}}", "abcd", 4, "dtype 'f32'");
    EXPECT_FORMAT("{\"w\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]}}", "abcd", 4, "dtype 'U8'");
    EXPECT_FORMAT("{\"w\":{\"dtype\":4,\"shape\":[1],\"data_offsets\":[0,4]}}", "abcd", 4, "key 'w'",
                  "\"dtype\" is missing or not a string");
    EXPECT_FORMAT("{\"w\":{\"shape\":[1],\"data_offsets\":[0,4]}}", "abcd", 4, "\"dtype\" is missing");
    th_mem_assert_back();
}

Test(nn_safetensors, shape_and_offset_mismatches_are_rejected)
{
    th_mem_mark();
    const char d[16] = {0};
    /* shape (3,) of F32 is 12 bytes, the offsets hold 8 */
    EXPECT_FORMAT("{\"w\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", d, 8, "key 'w'",
                  "shape (3,) of F32 needs 3 elements of 4 bytes, but data_offsets [0, 8] hold 8 bytes");
    EXPECT_FORMAT("{\"w\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,0]}}", d, 0, "shape () of F32");
    EXPECT_FORMAT("{\"w\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", d, 4,
                  "shape entry 0 is not a non-negative integer");
    EXPECT_FORMAT("{\"w\":{\"dtype\":\"F32\",\"shape\":[1.0],\"data_offsets\":[0,4]}}", d, 4,
                  "shape entry 0 is not a non-negative integer");
    EXPECT_FORMAT("{\"w\":{\"dtype\":\"F32\",\"shape\":[1,\"2\"],\"data_offsets\":[0,8]}}", d, 8, "shape entry 1");
    EXPECT_FORMAT("{\"w\":{\"dtype\":\"F32\",\"shape\":4,\"data_offsets\":[0,16]}}", d, 16,
                  "\"shape\" is missing or not an array");
    EXPECT_FORMAT("{\"w\":{\"dtype\":\"BOOL\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,1]}}", d, 1,
                  "shape has 9 dims, more than the 8 supported");
    /* sizes whose product overflows: caught, not wrapped */
    EXPECT_FORMAT("{\"w\":{\"dtype\":\"F64\",\"shape\":[4611686018427387904,8],\"data_offsets\":[0,0]}}", d, 0,
                  "more elements than a tensor may have");
    EXPECT_FORMAT("{\"w\":{\"dtype\":\"F64\",\"shape\":[576460752303423487],\"data_offsets\":[0,0]}}", d, 0,
                  "needs 576460752303423487 elements of 8 bytes");
    EXPECT_FORMAT("{\"w\":{\"dtype\":\"F32\",\"shape\":[0,4294967296,4294967296],\"data_offsets\":[0,0]}}", d, 0,
                  "more elements than a tensor may have");
    /* found by the fuzzer: more elements than ts_tensor_empty accepts
     * (INT64_MAX / 16) must be a format error, not the tensor layer's
     * TS_ERR_INVALID_ARGUMENT */
    EXPECT_FORMAT("{\"a\":{\"dtype\":\"F64\",\"shape\":[92233720368,7387904,0],\"data_offsets\":[0,0]}}", d, 0,
                  "key 'a'", "shape (92233720368, 7387904, 0) has more elements than a tensor may have");
    EXPECT_FORMAT("{\"a\":{\"dtype\":\"BOOL\",\"shape\":[0,576460752303423488],\"data_offsets\":[0,0]}}", d, 0,
                  "more elements than a tensor may have (576460752303423487");
    /* the limit itself is fine: an empty tensor of that many "rows" */
    size_t len;
    unsigned char *b =
        mk_file("{\"a\":{\"dtype\":\"F64\",\"shape\":[576460752303423487,0],\"data_offsets\":[0,0]}}", NULL, 0, &len);
    ts_state_dict *sd;
    TH_OK(ts_safetensors_parse(b, len, &sd));
    cr_assert_eq(ts_tensor_size(ts_state_dict_get(sd, "a"), 0), 576460752303423487LL);
    cr_assert_eq(ts_tensor_numel(ts_state_dict_get(sd, "a")), 0);
    ts_state_dict_free(sd);
    free(b);
    EXPECT_FORMAT("{\"w\":{\"dtype\":\"F32\",\"shape\":[99999999999999999999],\"data_offsets\":[0,0]}}", d, 0,
                  "not valid JSON");
    /* offsets: outside the buffer, reversed, malformed */
    EXPECT_FORMAT("{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}", d, 8,
                  "data_offsets [8, 16] do not lie within the data buffer of 8 bytes");
    EXPECT_FORMAT("{\"w\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,4]}}", d, 8,
                  "data_offsets [8, 4] do not lie within");
    EXPECT_FORMAT("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,8]}}", d, 8,
                  "not two non-negative integers");
    EXPECT_FORMAT("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-4,0]}}", d, 8,
                  "not two non-negative integers");
    EXPECT_FORMAT("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":{\"a\":0}}}", d, 8,
                  "not two non-negative integers");
    EXPECT_FORMAT("{\"w\":{\"dtype\":\"F32\",\"shape\":[1]}}", d, 4, "\"data_offsets\" is missing");
    th_mem_assert_back();
}

Test(nn_safetensors, overlapping_and_gapped_offsets_are_rejected)
{
    th_mem_mark();
    const char d[24] = {0};
    EXPECT_FORMAT("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                  "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
                  d, 12, "key 'b': data_offsets [4, 12] overlap those of key 'a' [0, 8]");
    /* the same data for two keys */
    EXPECT_FORMAT("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                  "\"b\":{\"dtype\":\"I32\",\"shape\":[2],\"data_offsets\":[0,8]}}",
                  d, 8, "overlap");
    /* an empty tensor inside another one's bytes */
    EXPECT_FORMAT("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                  "\"e\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[4,4]}}",
                  d, 8, "key 'e'", "overlap");
    EXPECT_FORMAT("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                  "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[12,20]}}",
                  d, 20, "key 'b': data_offsets [12, 20] leave a gap: bytes [8, 12)");
    EXPECT_FORMAT("{\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", d, 12, "key 'b'",
                  "bytes [0, 4) of the data buffer belong to no tensor");
    /* bytes after the last tensor */
    EXPECT_FORMAT("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", d, 12,
                  "the tensors end at byte 8 (key 'a') but the data buffer has 12 bytes");
    EXPECT_FORMAT("{}", d, 3, "lists no tensor but the data buffer has 3 bytes");
    EXPECT_FORMAT("{\"__metadata__\":{\"a\":\"b\"}}", d, 1, "lists no tensor");
    th_mem_assert_back();
}

Test(nn_safetensors, missing_or_corrupt_checkpoint_file_gives_a_clear_error)
{
    th_mem_mark();
    char p[128];
    ts_state_dict *sd = NULL;
    tpath(p, sizeof p, "no_such.safetensors");
    cr_assert_eq(ts_safetensors_load(p, &sd), TS_ERR_IO);
    cr_assert_null(sd);
    cr_assert_not_null(strstr(ts_last_error(), p), "names the path: %s", ts_last_error());
    cr_assert_not_null(strstr(ts_last_error(), "No such file or directory"), "%s", ts_last_error());
    /* a directory */
    cr_assert_eq(ts_safetensors_load(tmpdir, &sd), TS_ERR_IO);
    cr_assert_not_null(strstr(ts_last_error(), "is a directory"), "%s", ts_last_error());
    /* a FIFO with no writer: refused at once, not a blocked open */
    cr_assert_eq(mkfifo(tpath(p, sizeof p, "fifo.safetensors"), 0600), 0, "mkfifo: %s", strerror(errno));
    cr_assert_eq(ts_safetensors_load(p, &sd), TS_ERR_IO);
    cr_assert_null(sd);
    cr_assert_not_null(strstr(ts_last_error(), "not a regular file"), "%s", ts_last_error());
    unlink(p);
    /* garbage: a text file */
    const char text[] = "this is not a checkpoint, just some text in a file\n";
    write_bytes(tpath(p, sizeof p, "garbage.safetensors"), text, sizeof text - 1);
    cr_assert_eq(ts_safetensors_load(p, &sd), TS_ERR_FORMAT);
    cr_assert_not_null(strstr(ts_last_error(), p), "%s", ts_last_error());
    /* a valid file with a byte of its header flipped */
    size_t len;
    unsigned char *b = expected_file(&len);
    b[8 + 60] = '!';
    write_bytes(p, b, len);
    cr_assert_eq(ts_safetensors_load(p, &sd), TS_ERR_FORMAT);
    cr_assert_not_null(strstr(ts_last_error(), "not valid JSON"), "%s", ts_last_error());
    free(b);
    /* an empty file */
    write_bytes(p, "", 0);
    cr_assert_eq(ts_safetensors_load(p, &sd), TS_ERR_FORMAT);
    cr_assert_not_null(strstr(ts_last_error(), "has 0 bytes"), "%s", ts_last_error());
    cr_assert_null(sd);
    /* NULL arguments */
    cr_assert_eq(ts_safetensors_load(NULL, &sd), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_safetensors_load(p, NULL), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_safetensors_parse(NULL, 4, &sd), TS_ERR_INVALID_ARGUMENT);
    th_mem_assert_back();
}

/* ------------------------------------------------------------ failed saves */

/* Writes a known good file at `p` and returns its bytes. */
static unsigned char *existing_file(const char *p, size_t *len)
{
    unsigned char *b = expected_file(len);
    write_bytes(p, b, *len);
    return b;
}

static void assert_file_is(const char *p, const unsigned char *want, size_t wlen)
{
    size_t len;
    unsigned char *raw = th_read_file(p, &len);
    cr_assert_not_null(raw, "%s still exists", p);
    cr_assert_eq(len, wlen, "%s has %zu bytes, expected %zu", p, len, wlen);
    cr_assert(memcmp(raw, want, len) == 0, "%s is unchanged", p);
    free(raw);
}

Test(nn_safetensors, failed_save_leaves_the_existing_file_untouched)
{
    th_mem_mark();
    char p[128], q[160];
    size_t len;
    unsigned char *orig = existing_file(tpath(p, sizeof p, "ckpt.safetensors"), &len);
    ts_state_dict *sd;
    TH_OK(ts_state_dict_new(&sd));
    ts_tensor *big;
    TH_OK(ts_tensor_zeros(TS_F32, 1, (int64_t[]){1 << 20}, &big)); /* 4 MiB */
    TH_OK(ts_state_dict_set(sd, "big", big));

    /* the write fails part way: the file size limit stops it at 64 KiB */
    struct rlimit old, lim = {.rlim_cur = 65536, .rlim_max = RLIM_INFINITY};
    cr_assert_eq(getrlimit(RLIMIT_FSIZE, &old), 0);
    lim.rlim_max = old.rlim_max;
    signal(SIGXFSZ, SIG_IGN);
    cr_assert_eq(setrlimit(RLIMIT_FSIZE, &lim), 0);
    ts_status st = ts_safetensors_save(p, sd, NULL, 0);
    cr_assert_eq(setrlimit(RLIMIT_FSIZE, &old), 0);
    cr_assert_eq(st, TS_ERR_IO, "%s: %s", ts_status_name(st), ts_last_error());
    cr_assert_not_null(strstr(ts_last_error(), p), "%s", ts_last_error());
    cr_assert_not_null(strstr(ts_last_error(), "File too large"), "%s", ts_last_error());
    assert_file_is(p, orig, len);
    cr_assert_eq(count_dir_entries(), 1, "the temporary file is removed");

    /* a tensor that cannot be read (released storage) */
    ts_tensor *rel;
    TH_OK(ts_tensor_zeros(TS_F32, 1, (int64_t[]){4}, &rel));
    TH_OK(ts_state_dict_set(sd, "released", rel));
    TH_OK(ts_storage_release(ts_tensor_storage(rel)));
    st = ts_safetensors_save(p, sd, NULL, 0);
    cr_assert_eq(st, TS_ERR_RELEASED, "%s: %s", ts_status_name(st), ts_last_error());
    cr_assert_not_null(strstr(ts_last_error(), "'released'"), "%s", ts_last_error());
    TH_OK(ts_storage_restore(ts_tensor_storage(rel)));
    ts_tensor_free(rel);
    assert_file_is(p, orig, len);

    /* names the format cannot hold */
    ts_state_dict *bad;
    ts_tensor *one = th_seq(TS_F32, 1, (int64_t[]){1}, 1.0, false);
    const char *bad_names[] = {"", "__metadata__", "\xff\xfe"};
    for (int i = 0; i < 3; i++) {
        TH_OK(ts_state_dict_new(&bad));
        TH_OK(ts_state_dict_set(bad, "ok", one));
        TH_OK(ts_state_dict_set(bad, bad_names[i], one));
        cr_assert_eq(ts_safetensors_save(p, bad, NULL, 0), TS_ERR_INVALID_ARGUMENT, "name %d", i);
        ts_state_dict_free(bad);
        assert_file_is(p, orig, len);
    }
    ts_tensor_free(one);

    /* the path is an existing directory: the rename fails */
    snprintf(q, sizeof q, "%s/subdir", tmpdir);
    cr_assert_eq(mkdir(q, 0700), 0);
    ts_state_dict *small = expected_dict();
    st = ts_safetensors_save(q, small, NULL, 0);
    cr_assert_eq(st, TS_ERR_IO, "%s", ts_last_error());
    cr_assert_not_null(strstr(ts_last_error(), q), "%s", ts_last_error());
    struct stat sb;
    cr_assert_eq(stat(q, &sb), 0);
    cr_assert(S_ISDIR(sb.st_mode));

    /* a folder that does not exist */
    snprintf(q, sizeof q, "%s/missing/ckpt.safetensors", tmpdir);
    st = ts_safetensors_save(q, small, NULL, 0);
    cr_assert_eq(st, TS_ERR_IO);
    cr_assert_not_null(strstr(ts_last_error(), q), "%s", ts_last_error());
    cr_assert_not_null(strstr(ts_last_error(), "No such file or directory"), "%s", ts_last_error());
    cr_assert_eq(count_dir_entries(), 2, "ckpt.safetensors and subdir only");
    assert_file_is(p, orig, len);

    /* after all that, a good save replaces the file */
    TH_OK(ts_safetensors_save(p, small, (const char *[]){"format", "pt"}, 1));
    assert_file_is(p, orig, len); /* expected_dict + metadata gives the same bytes */
    ts_state_dict_free(small);
    cr_assert_eq(count_dir_entries(), 2);

    ts_tensor_free(big);
    ts_state_dict_free(sd);
    free(orig);
    th_mem_assert_back();
}

Test(nn_safetensors, save_into_a_read_only_folder_fails_cleanly)
{
    if (geteuid() == 0) {
        remove_tmpdir(); /* a skipped test does not run .fini */
        cr_skip_test("root ignores folder permissions");
    }
    char d[128], p[160];
    snprintf(d, sizeof d, "%s/ro", tmpdir);
    cr_assert_eq(mkdir(d, 0700), 0);
    snprintf(p, sizeof p, "%s/ckpt.safetensors", d);
    size_t len;
    unsigned char *orig = existing_file(p, &len);
    cr_assert_eq(chmod(d, 0500), 0);
    ts_state_dict *sd = expected_dict();
    ts_status st = ts_safetensors_save(p, sd, NULL, 0);
    cr_assert_eq(st, TS_ERR_IO);
    cr_assert_not_null(strstr(ts_last_error(), p), "%s", ts_last_error());
    cr_assert_not_null(strstr(ts_last_error(), "Permission denied"), "%s", ts_last_error());
    assert_file_is(p, orig, len);
    chmod(d, 0700);
    ts_state_dict_free(sd);
    free(orig);
}

Test(nn_safetensors, save_overwrites_and_rejects_bad_arguments)
{
    th_mem_mark();
    char p[128];
    tpath(p, sizeof p, "over.safetensors");
    write_bytes(p, "old contents", 12);
    ts_state_dict *sd = expected_dict(), *back;
    TH_OK(ts_safetensors_save(p, sd, NULL, 0));
    TH_OK(ts_safetensors_load(p, &back));
    cr_assert_eq(ts_state_dict_size(back), 3);
    ts_state_dict_free(back);
    cr_assert_eq(ts_safetensors_save(NULL, sd, NULL, 0), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_safetensors_save(p, NULL, NULL, 0), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_safetensors_save("", sd, NULL, 0), TS_ERR_INVALID_ARGUMENT);
    /* a path in the current folder (no '/'): the folder sync uses "." */
    char cwd[256];
    cr_assert_not_null(getcwd(cwd, sizeof cwd));
    cr_assert_eq(chdir(tmpdir), 0);
    TH_OK(ts_safetensors_save("rel.safetensors", sd, NULL, 0));
    TH_OK(ts_safetensors_load("rel.safetensors", &back));
    ts_state_dict_free(back);
    cr_assert_eq(chdir(cwd), 0);
    ts_state_dict_free(sd);
    th_mem_assert_back();
}

Test(nn_safetensors, module_state_dict_round_trip)
{
    th_mem_mark();
    ts_manual_seed(3);
    ts_module *a, *b;
    TH_OK(ts_linear_new(5, 3, true, &a));
    ts_manual_seed(4);
    TH_OK(ts_linear_new(5, 3, true, &b));
    ts_state_dict *sa, *loaded, *sb;
    TH_OK(ts_module_state_dict(a, &sa));
    char p[128];
    TH_OK(ts_safetensors_save(tpath(p, sizeof p, "linear.safetensors"), sa, NULL, 0));
    TH_OK(ts_safetensors_load(p, &loaded));
    TH_OK(ts_module_load_state_dict(b, loaded, true));
    TH_OK(ts_module_state_dict(b, &sb));
    for (int i = 0; i < ts_state_dict_size(sa); i++)
        assert_same(ts_state_dict_tensor(sb, i), ts_state_dict_tensor(sa, i));
    ts_state_dict_free(sa);
    ts_state_dict_free(sb);
    ts_state_dict_free(loaded);
    ts_module_free(a);
    ts_module_free(b);
    th_mem_assert_back();
}

/* ------------------------------------------------------------ temporary files */

#include <sys/wait.h>

#include "nn/internal.h"
#include "safetensors/internal.h" /* ts__safetensors_save_hook */

/* What the save hook saw of the temporary file. */
static struct {
    char path[512];
    struct stat sb;
    int lstat_rc;
    int fail;
} hook_seen;

static int record_tmp(const char *tmp)
{
    snprintf(hook_seen.path, sizeof hook_seen.path, "%s", tmp);
    hook_seen.lstat_rc = lstat(tmp, &hook_seen.sb);
    return hook_seen.fail;
}

/* True if `name` is ".<base>.tmp.<pid>.<16 lowercase hex digits>". */
static bool is_tmp_name(const char *name, const char *base, long pid)
{
    char prefix[256];
    snprintf(prefix, sizeof prefix, ".%s.tmp.%ld.", base, pid);
    size_t pl = strlen(prefix);
    if (strncmp(name, prefix, pl) != 0 || strlen(name) != pl + 16) return false;
    for (const char *c = name + pl; *c; c++)
        if (!((*c >= '0' && *c <= '9') || (*c >= 'a' && *c <= 'f'))) return false;
    return true;
}

Test(nn_safetensors, temporary_file_is_private_and_unpredictable_while_written)
{
    th_mem_mark();
    char p[128];
    tpath(p, sizeof p, "ckpt.safetensors");
    ts_state_dict *sd = expected_dict();
    umask(022);
    ts__safetensors_save_hook = record_tmp;
    memset(&hook_seen, 0, sizeof hook_seen);
    TH_OK(ts_safetensors_save(p, sd, NULL, 0));
    char first[512];
    snprintf(first, sizeof first, "%s", hook_seen.path);
    /* in the target's folder, hidden, with the pid and 64 random bits */
    const char *slash = strrchr(first, '/');
    cr_assert_not_null(slash);
    cr_assert_eq((size_t)(slash - first), strlen(tmpdir), "temporary file %s is in %s", first, tmpdir);
    cr_assert(strncmp(first, tmpdir, strlen(tmpdir)) == 0);
    cr_assert(is_tmp_name(slash + 1, "ckpt.safetensors", (long)getpid()), "temporary name %s", slash + 1);
    cr_assert_eq(hook_seen.lstat_rc, 0);
    cr_assert(S_ISREG(hook_seen.sb.st_mode), "a regular file, not a link");
    cr_assert_eq(hook_seen.sb.st_mode & 07777, 0600, "mode while written is %o, expected 0600",
                 (unsigned)(hook_seen.sb.st_mode & 07777));
    cr_assert_eq(hook_seen.sb.st_uid, geteuid());
    /* renamed: the mode of a new file under the umask, no temporary left */
    struct stat sb;
    cr_assert_eq(stat(p, &sb), 0);
    cr_assert_eq(sb.st_mode & 07777, 0644, "final mode %o under umask 022", (unsigned)(sb.st_mode & 07777));
    cr_assert_eq(sb.st_ino, hook_seen.sb.st_ino, "the file written is the file renamed");
    cr_assert_eq(count_dir_entries(), 1);
    umask(027);
    TH_OK(ts_safetensors_save(p, sd, NULL, 0));
    cr_assert_eq(stat(p, &sb), 0);
    cr_assert_eq(sb.st_mode & 07777, 0640, "final mode %o under umask 027", (unsigned)(sb.st_mode & 07777));
    cr_assert_str_neq(hook_seen.path, first, "a second save picks another random name");
    umask(022);
    ts__safetensors_save_hook = NULL;
    ts_state_dict_free(sd);
    th_mem_assert_back();
}

Test(nn_safetensors, a_precreated_link_or_file_at_the_old_temporary_name_is_not_followed)
{
    th_mem_mark();
    char p[128], victim[160], old_tmp[192], own[192];
    tpath(p, sizeof p, "ckpt.safetensors");
    snprintf(victim, sizeof victim, "%s/victim", tmpdir);
    write_bytes(victim, "precious", 8);
    /* another user's trap at the name the saver used to use: a link to a
     * file of the victim's, and a world-writable file the attacker owns */
    snprintf(old_tmp, sizeof old_tmp, "%s.tmp.%ld", p, (long)getpid());
    cr_assert_eq(symlink(victim, old_tmp), 0, "symlink: %s", strerror(errno));
    snprintf(own, sizeof own, "%s/.ckpt.safetensors.tmp.%ld", tmpdir, (long)getpid());
    write_bytes(own, "", 0);
    cr_assert_eq(chmod(own, 0666), 0);
    struct stat own_sb;
    cr_assert_eq(stat(own, &own_sb), 0);

    ts_state_dict *sd = expected_dict(), *back;
    TH_OK(ts_safetensors_save(p, sd, NULL, 0));
    assert_file_is(victim, (const unsigned char *)"precious", 8);
    struct stat sb;
    cr_assert_eq(lstat(old_tmp, &sb), 0);
    cr_assert(S_ISLNK(sb.st_mode), "the link is left as it was");
    cr_assert_eq(stat(own, &sb), 0);
    cr_assert_eq(sb.st_size, 0, "the pre-created file was not written");
    cr_assert_eq(stat(p, &sb), 0);
    cr_assert_neq(sb.st_ino, own_sb.st_ino, "the checkpoint is a file of the saver's own");
    TH_OK(ts_safetensors_load(p, &back));
    cr_assert_eq(ts_state_dict_size(back), 3);
    ts_state_dict_free(back);
    cr_assert_eq(count_dir_entries(), 4, "checkpoint, victim and the two traps");
    ts_state_dict_free(sd);
    th_mem_assert_back();
}

Test(nn_safetensors, failed_saves_leave_no_temporary_file)
{
    th_mem_mark();
    char p[128];
    size_t len;
    unsigned char *orig = existing_file(tpath(p, sizeof p, "ckpt.safetensors"), &len);
    ts_state_dict *sd = expected_dict();
    /* a write failure injected once the temporary file exists */
    ts__safetensors_save_hook = record_tmp;
    memset(&hook_seen, 0, sizeof hook_seen);
    hook_seen.fail = 1;
    ts_status st = ts_safetensors_save(p, sd, NULL, 0);
    cr_assert_eq(st, TS_ERR_IO, "%s: %s", ts_status_name(st), ts_last_error());
    cr_assert_not_null(strstr(ts_last_error(), hook_seen.path), "%s", ts_last_error());
    struct stat sb;
    cr_assert_eq(lstat(hook_seen.path, &sb), -1, "%s was removed", hook_seen.path);
    cr_assert_eq(count_dir_entries(), 1);
    assert_file_is(p, orig, len);
    ts__safetensors_save_hook = NULL;

    /* a real write failure part way through: the file size limit */
    ts_tensor *big;
    TH_OK(ts_tensor_zeros(TS_F32, 1, (int64_t[]){1 << 20}, &big));
    TH_OK(ts_state_dict_set(sd, "big", big));
    ts_tensor_free(big);
    struct rlimit old, lim;
    cr_assert_eq(getrlimit(RLIMIT_FSIZE, &old), 0);
    lim = (struct rlimit){.rlim_cur = 4096, .rlim_max = old.rlim_max};
    signal(SIGXFSZ, SIG_IGN);
    cr_assert_eq(setrlimit(RLIMIT_FSIZE, &lim), 0);
    st = ts_safetensors_save(p, sd, NULL, 0);
    cr_assert_eq(setrlimit(RLIMIT_FSIZE, &old), 0);
    cr_assert_eq(st, TS_ERR_IO, "%s: %s", ts_status_name(st), ts_last_error());
    cr_assert_eq(count_dir_entries(), 1, "no temporary file after a failed write");
    assert_file_is(p, orig, len);

    /* the rename fails (the target is a folder) */
    char d[160];
    snprintf(d, sizeof d, "%s/adir", tmpdir);
    cr_assert_eq(mkdir(d, 0700), 0);
    cr_assert_eq(ts_safetensors_save(d, sd, NULL, 0), TS_ERR_IO);
    cr_assert_eq(count_dir_entries(), 2, "ckpt.safetensors and adir only");
    ts_state_dict_free(sd);
    free(orig);
    th_mem_assert_back();
}

/* A pid that has just exited (reaped), so no process has it now. */
static pid_t dead_pid(void)
{
    pid_t c = fork();
    cr_assert_geq(c, 0);
    if (c == 0) _exit(0);
    int status;
    cr_assert_eq(waitpid(c, &status, 0), c);
    cr_assert_eq(kill(c, 0), -1, "pid %d is free", (int)c);
    return c;
}

Test(nn_safetensors, stale_temporaries_of_dead_savers_are_removed_and_live_ones_kept)
{
    th_mem_mark();
    char p[128], f[256];
    tpath(p, sizeof p, "ckpt.safetensors");
    pid_t dead = dead_pid(), live = getppid();
    const char *hex = "0123456789abcdef";
    /* removed: this checkpoint's pattern, dead pid */
    char stale[256];
    snprintf(stale, sizeof stale, "%s/.ckpt.safetensors.tmp.%d.%s", tmpdir, (int)dead, hex);
    write_bytes(stale, "stale", 5);
    /* kept: a live saver, another checkpoint, names off the pattern, another folder */
    const char *keep_fmt[] = {"%s/.ckpt.safetensors.tmp.%d.%s", "%s/.other.safetensors.tmp.%d.%s",
                              "%s/.ckpt.safetensors.tmp.%d.%s0", "%s/ckpt.safetensors.tmp.%d.%s",
                              "%s/.ckpt.safetensors.tmp.%dx.%s"};
    int keep_pid[] = {(int)live, (int)dead, (int)dead, (int)dead, (int)dead};
    for (int i = 0; i < 5; i++) {
        snprintf(f, sizeof f, keep_fmt[i], tmpdir, keep_pid[i], hex);
        write_bytes(f, "keep", 4);
    }
    char sub[160];
    snprintf(sub, sizeof sub, "%s/sub", tmpdir);
    cr_assert_eq(mkdir(sub, 0700), 0);
    snprintf(f, sizeof f, "%s/.ckpt.safetensors.tmp.%d.%s", sub, (int)dead, hex);
    write_bytes(f, "keep", 4);

    ts_state_dict *sd = expected_dict();
    TH_OK(ts_safetensors_save(p, sd, NULL, 0));
    struct stat sb;
    cr_assert_eq(stat(stale, &sb), -1, "%s (pid %d is gone) was removed", stale, (int)dead);
    for (int i = 0; i < 5; i++) {
        snprintf(f, sizeof f, keep_fmt[i], tmpdir, keep_pid[i], hex);
        cr_assert_eq(stat(f, &sb), 0, "%s is kept", f);
    }
    snprintf(f, sizeof f, "%s/.ckpt.safetensors.tmp.%d.%s", sub, (int)dead, hex);
    cr_assert_eq(stat(f, &sb), 0, "%s in another folder is kept", f);
    cr_assert_eq(count_dir_entries(), 7, "the checkpoint, five kept files and sub");
    ts_state_dict_free(sd);
    th_mem_assert_back();
}

/* ------------------------------------------------------------ loading */

Test(nn_safetensors, loading_into_a_parameter_of_another_dtype_is_an_error)
{
    th_mem_mark();
    ts_module *lin;
    TH_OK(ts_linear_new(3, 2, true, &lin));
    ts_state_dict *mine;
    TH_OK(ts_module_state_dict(lin, &mine));
    ts_tensor *w0;
    TH_OK(ts_clone(ts_state_dict_get(mine, "weight"), &w0));
    const ts_dtype bad[] = {TS_I32, TS_BOOL, TS_F64, TS_I64};
    const char *bad_name[] = {"int32", "bool", "float64", "int64"};
    for (int k = 0; k < 4; k++) {
        /* through a file, as a checkpoint of another program would come */
        ts_state_dict *sd;
        TH_OK(ts_state_dict_new(&sd));
        ts_tensor *w;
        TH_OK(ts_tensor_zeros(bad[k], 2, (int64_t[]){2, 3}, &w));
        TH_OK(ts_state_dict_set(sd, "weight", w));
        TH_OK(ts_state_dict_set(sd, "bias", ts_state_dict_get(mine, "bias")));
        ts_tensor_free(w);
        char p[128];
        TH_OK(ts_safetensors_save(tpath(p, sizeof p, "int.safetensors"), sd, NULL, 0));
        ts_state_dict_free(sd);
        TH_OK(ts_safetensors_load(p, &sd));
        TH_FAILS(ts_module_load_state_dict(lin, sd, true), TS_ERR_DTYPE, "'weight", bad_name[k], "float32", "Linear");
        cr_assert_null(strstr(ts_last_error(), "bias"), "only the mismatching key is named: %s", ts_last_error());
        TH_FAILS(ts_module_load_state_dict(lin, sd, false), TS_ERR_DTYPE, "weight");
        ts_state_dict_free(sd);
        /* nothing was copied */
        th_assert_close(((ts_nn_linear *)lin)->weight, w0, 0, 0);
    }
    ts_tensor_free(w0);
    ts_state_dict_free(mine);
    ts_module_free(lin);
    th_mem_assert_back();
}

static double cpu_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

Test(nn_safetensors, name_lookup_is_constant_time_with_100k_entries)
{
    th_mem_mark();
    enum { N = 100000 };
    ts_state_dict *sd;
    TH_OK(ts_state_dict_new(&sd));
    ts_tensor *one = th_seq(TS_F32, 1, (int64_t[]){1}, 1.0, false);
    uint64_t c0 = ts__state_dict_compares();
    for (int i = 0; i < N; i++) {
        char name[32];
        snprintf(name, sizeof name, "layers.%d.weight", i);
        TH_OK(ts_state_dict_set(sd, name, one));
    }
    /* an O(n) lookup would make 5e9 comparisons here */
    uint64_t c_build = ts__state_dict_compares() - c0;
    cr_assert_lt(c_build, 4ull * N, "%llu name comparisons to build %d entries", (unsigned long long)c_build, N);
    char p[128];
    TH_OK(ts_safetensors_save(tpath(p, sizeof p, "many.safetensors"), sd, NULL, 0));
    ts_state_dict *back;
    c0 = ts__state_dict_compares();
    double t0 = cpu_seconds();
    TH_OK(ts_safetensors_load(p, &back));
    double secs = cpu_seconds() - t0;
    uint64_t c_load = ts__state_dict_compares() - c0;
    cr_log_info("loading %d entries: %.3f s of CPU, %llu name comparisons", N, secs, (unsigned long long)c_load);
    cr_assert_eq(ts_state_dict_size(back), N);
    cr_assert_lt(c_load, 4ull * N, "%llu name comparisons to load %d entries", (unsigned long long)c_load, N);
    /* CPU time, so that a loaded machine does not fail it; generous (ASan):
     * the O(n^2) lookup took 26 s */
    cr_assert_lt(secs, 8.0, "loading %d entries took %.1f s of CPU", N, secs);
    c0 = ts__state_dict_compares();
    for (int i = 0; i < N; i += 997) {
        char name[32];
        snprintf(name, sizeof name, "layers.%d.weight", i);
        cr_assert_not_null(ts_state_dict_get(back, name), "%s", name);
    }
    cr_assert_null(ts_state_dict_get(back, "layers.100000.weight"));
    cr_assert_eq(ts_state_dict_name(back, 12345)[7], '1');
    cr_assert_str_eq(ts_state_dict_name(back, 12345), "layers.12345.weight");
    cr_assert_lt(ts__state_dict_compares() - c0, 4ull * 102, "lookups stay O(1)");
    ts_tensor_free(one);
    ts_state_dict_free(sd);
    ts_state_dict_free(back);
    th_mem_assert_back();
}

Test(nn_safetensors, load_state_dict_into_a_wide_module_is_linear)
{
    th_mem_mark();
    enum { L = 2000 };
    ts_module *kids[L], *list;
    for (int i = 0; i < L; i++) TH_OK(ts_linear_new(1, 1, true, &kids[i]));
    TH_OK(ts_module_list_new(L, kids, &list));
    ts_state_dict *sd;
    TH_OK(ts_module_state_dict(list, &sd));
    uint64_t c0 = ts__state_dict_compares();
    TH_OK(ts_module_load_state_dict(list, sd, true));
    uint64_t c = ts__state_dict_compares() - c0;
    cr_assert_lt(c, 8ull * 2 * L, "%llu name comparisons for %d parameters", (unsigned long long)c, 2 * L);
    ts_state_dict_free(sd);
    ts_module_free(list);
    th_mem_assert_back();
}

/* Runs load with stderr sent to a file; returns what was written (free). */
static char *stderr_of_load(const char *path, ts_state_dict **out)
{
    char f[160];
    snprintf(f, sizeof f, "%s/stderr.txt", tmpdir);
    fflush(stderr);
    int saved = dup(2), fd = open(f, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    cr_assert_geq(fd, 0);
    dup2(fd, 2);
    close(fd);
    TH_OK(ts_safetensors_load(path, out));
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    size_t len;
    char *txt = th_read_file(f, &len);
    cr_assert_not_null(txt);
    char *z = realloc(txt, len + 1);
    z[len] = '\0';
    unlink(f);
    return z;
}

Test(nn_safetensors, non_finite_values_load_with_a_warning_naming_the_key)
{
    th_mem_mark();
    ts_log_set_level(TS_LOG_WARN);
    ts_state_dict *sd;
    TH_OK(ts_state_dict_new(&sd));
    double w[6] = {1, NAN, 3, INFINITY, -INFINITY, 6}, ok[3] = {1, 2, 3};
    ts_tensor *a = th_tensor(TS_F32, 2, (int64_t[]){2, 3}, w), *b = th_tensor(TS_F32, 1, (int64_t[]){3}, ok),
              *h = th_tensor(TS_BF16, 2, (int64_t[]){2, 3}, w), *g = th_tensor(TS_F16, 2, (int64_t[]){2, 3}, w);
    TH_OK(ts_state_dict_set(sd, "diverged.weight", a));
    TH_OK(ts_state_dict_set(sd, "fine.bias", b));
    TH_OK(ts_state_dict_set(sd, "half.bf16", h));
    TH_OK(ts_state_dict_set(sd, "half.f16", g));
    char p[128];
    TH_OK(ts_safetensors_save(tpath(p, sizeof p, "nan.safetensors"), sd, NULL, 0));
    ts_state_dict *back;
    char *err = stderr_of_load(p, &back);
    cr_assert_not_null(strstr(err, "tensor 'diverged.weight' holds 3 non-finite values (NaN or Inf) of 6"), "%s", err);
    cr_assert_not_null(strstr(err, "tensor 'half.bf16' holds 3 non-finite"), "%s", err);
    cr_assert_not_null(strstr(err, "tensor 'half.f16' holds 3 non-finite"), "%s", err);
    cr_assert_null(strstr(err, "fine.bias"), "%s", err);
    cr_assert_not_null(strstr(err, p), "the file is named: %s", err);
    free(err);
    /* loaded as they are, as PyTorch does */
    double v[6];
    th_vals(ts_state_dict_get(back, "diverged.weight"), v, 6);
    cr_assert(isnan(v[1]) && isinf(v[3]) && v[0] == 1);
    ts_state_dict_free(back);
    /* a warning, not a failure, at the default level; silent under error */
    ts_log_set_level(TS_LOG_ERROR);
    err = stderr_of_load(p, &back);
    cr_assert_str_empty(err);
    free(err);
    ts_state_dict_free(back);
    ts_tensor_free(a);
    ts_tensor_free(b);
    ts_tensor_free(h);
    ts_tensor_free(g);
    ts_state_dict_free(sd);
    th_mem_assert_back();
}

/* A meta tensor has no bytes to save: a clear error naming the key, and
 * no file; a load inside a meta device scope still gives CPU tensors with
 * the file's values. */
Test(nn_safetensors, meta_tensors_are_refused_and_loads_stay_on_the_cpu)
{
    ts_state_dict *sd;
    TH_OK(ts_state_dict_new(&sd));
    double w[3] = {1, 2, 3};
    ts_tensor *a = th_tensor(TS_F32, 1, (int64_t[]){3}, w), *m = NULL;
    TH_OK(ts_device_scope_enter(TS_DEVICE_META));
    TH_OK(ts_tensor_zeros(TS_F32, 2, (int64_t[]){2, 2}, &m));
    TH_OK(ts_device_scope_exit());
    TH_OK(ts_state_dict_set(sd, "a", a));
    TH_OK(ts_state_dict_set(sd, "deferred.weight", m));
    char p[128];
    cr_assert_eq(ts_safetensors_save(tpath(p, sizeof p, "meta.safetensors"), sd, NULL, 0), TS_ERR_STATE);
    cr_assert_not_null(strstr(ts_last_error(), "'deferred.weight'"), "%s", ts_last_error());
    cr_assert_not_null(strstr(ts_last_error(), "meta device"), "%s", ts_last_error());
    cr_assert_neq(access(p, F_OK), 0, "a file was left at %s", p);
    ts_state_dict_free(sd);
    TH_OK(ts_state_dict_new(&sd));
    TH_OK(ts_state_dict_set(sd, "a", a));
    TH_OK(ts_safetensors_save(p, sd, NULL, 0));
    ts_state_dict *back = NULL;
    TH_OK(ts_device_scope_enter(TS_DEVICE_META));
    ts_status st = ts_safetensors_load(p, &back);
    TH_OK(ts_device_scope_exit());
    TH_OK(st);
    cr_assert_eq(ts_tensor_device(ts_state_dict_get(back, "a")), TS_DEVICE_CPU);
    double v[3];
    th_vals(ts_state_dict_get(back, "a"), v, 3);
    cr_assert(v[0] == 1 && v[1] == 2 && v[2] == 3);
    ts_state_dict_free(back);
    ts_state_dict_free(sd);
    ts_tensor_free(a);
    ts_tensor_free(m);
}
