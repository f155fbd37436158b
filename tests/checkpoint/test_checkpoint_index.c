/* What a checkpoint's index must say to be loaded (checkpoint/index.c;
 * docs/checkpoint.md, "Index versions"): placements that parse and agree
 * with the pieces, a "world" that agrees with the files, a checksum on
 * every piece once the index records them, the versions that load; and
 * the typed metadata pairs (ts_ckpt_meta) the saves check. Each bad index
 * is a saved one edited with jansson, refused with TS_ERR_FORMAT naming
 * the field and the value. */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint/internal.h"
#include "tests/helpers.h"

static char *tmp_dir(void) { return th_tmp_dir("ts_ckpt_index"); }

/* Linear(4, 3) ("weight" (3, 4), "bias" (3,)) saved on one rank into a
 * fresh folder; the caller frees both. */
static ts_module *saved(char **dir_out)
{
    ts_module *m = NULL;
    TH_OK(ts_linear_new(4, 3, true, &m));
    char *dir = tmp_dir();
    TH_OK(ts_ckpt_save(dir, m, NULL));
    *dir_out = dir;
    return m;
}

static json_t *index_read(const char *dir)
{
    char p[400];
    snprintf(p, sizeof p, "%s/index.json", dir);
    json_error_t e;
    json_t *ix = json_load_file(p, 0, &e);
    cr_assert(ix, "%s: %s", p, e.text);
    return ix;
}

static void index_write(const char *dir, const json_t *ix)
{
    char p[400];
    snprintf(p, sizeof p, "%s/index.json", dir);
    cr_assert_eq(json_dump_file(ix, p, JSON_INDENT(1)), 0);
}

static json_t *tensor_of(json_t *ix, const char *key)
{
    json_t *t = json_object_get(json_object_get(ix, "tensors"), key);
    cr_assert(t, "no key '%s' in the index", key);
    return t;
}

/* Loads dir into m; asserts TS_ERR_FORMAT and that the message holds both needles. */
static void refused(const char *dir, ts_module *m, const char *what, const char *n1, const char *n2)
{
    ts_status st = ts_ckpt_load(dir, m, NULL, NULL);
    cr_assert_eq(st, TS_ERR_FORMAT, "%s: loaded (%s)", what, ts_status_name(st));
    cr_assert(strstr(ts_last_error(), n1) && strstr(ts_last_error(), n2), "%s: '%s' or '%s' not in: %s", what, n1, n2,
              ts_last_error());
}

/* Placements were read as any array: ["x"], [], [1e300] and
 * ["Shard(99999999999)"] loaded. */
Test(checkpoint_index, placements_must_parse, .timeout = 60)
{
    char *dir = NULL;
    ts_module *m = saved(&dir);
    json_t *good = index_read(dir);
    static const struct {
        const char *json, *n1, *n2;
    } bad[] = {
        {"[\"x\"]", "\"placements\"", "\"x\""},
        {"[]", "\"placements\"", "[]"},
        {"[1e300]", "\"placements\"", "e300"},
        {"[\"Shard(99999999999)\"]", "Shard(99999999999)", "dims"},
        {"[\"Shard(1)\"]", "Shard(1)", "dim 0"}, /* inside the dims, but the pieces are rows */
        {"[\"Shard(0)\",\"Shard(0)\"]", "second Shard", "Shard(0)"},
        {"\"Shard(0)\"", "\"placements\"", "\"Shard(0)\""}, /* not an array */
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        json_t *ix = json_deep_copy(good);
        json_t *pl = json_loads(bad[i].json, JSON_DECODE_ANY, NULL);
        cr_assert(pl, "case %zu", i);
        json_object_set_new(tensor_of(ix, "weight"), "placements", pl);
        index_write(dir, ix);
        json_decref(ix);
        refused(dir, m, bad[i].json, bad[i].n1, bad[i].n2);
    }
    /* a missing "placements" too */
    json_t *ix = json_deep_copy(good);
    json_object_del(tensor_of(ix, "bias"), "placements");
    index_write(dir, ix);
    json_decref(ix);
    refused(dir, m, "no placements", "\"placements\"", "(missing)");
    /* put back: it loads */
    index_write(dir, good);
    TH_OK(ts_ckpt_load(dir, m, NULL, NULL));
    json_decref(good);
    ts_module_free(m);
    th_rm_rf(dir);
    free(dir);
}

/* "world" was checked only against the files' ranks: a one-rank
 * checkpoint whose index says 2 loaded. Every file records the world,
 * rank and save id that wrote it; the index must agree. */
Test(checkpoint_index, world_must_agree_with_the_files, .timeout = 60)
{
    char *dir = NULL;
    ts_module *m = saved(&dir);
    json_t *good = index_read(dir);
    json_t *ix = json_deep_copy(good);
    json_object_set_new(ix, "world", json_integer(2));
    index_write(dir, ix);
    json_decref(ix);
    refused(dir, m, "world 2", "\"world\" is 2", "world of 1");
    index_write(dir, good);
    TH_OK(ts_ckpt_load(dir, m, NULL, NULL));
    json_decref(good);
    ts_module_free(m);
    th_rm_rf(dir);
    free(dir);
}

/* Flips one byte of the file inside the piece of key's rows. */
static void flip_byte(const char *dir, json_t *ix, const char *key)
{
    json_t *p = json_array_get(json_object_get(tensor_of(ix, key), "pieces"), 0);
    json_t *f = json_array_get(json_object_get(ix, "files"), (size_t)json_integer_value(json_object_get(p, "file")));
    char path[600];
    snprintf(path, sizeof path, "%s/%s", dir, json_string_value(json_object_get(f, "name")));
    FILE *fp = fopen(path, "r+b");
    cr_assert(fp);
    long at =
        (long)(json_integer_value(json_object_get(p, "offset")) + json_integer_value(json_object_get(p, "length")) / 2);
    cr_assert_eq(fseek(fp, at, SEEK_SET), 0);
    int c = fgetc(fp);
    cr_assert_eq(fseek(fp, at, SEEK_SET), 0);
    fputc(c ^ 0x10, fp);
    fclose(fp);
}

static void drop_hashes(json_t *ix, const char *only_key)
{
    const char *k;
    json_t *t;
    json_object_foreach(json_object_get(ix, "tensors"), k, t)
    {
        if (only_key && strcmp(k, only_key)) continue;
        size_t i;
        json_t *p;
        json_array_foreach(json_object_get(t, "pieces"), i, p) json_object_del(p, "hash");
    }
}

/* A removed "hash" and a flipped byte loaded silently: the piece was read
 * unchecked. Version 2 indexes (written now) need a hash on every piece;
 * version 1 ones (written before) load with none or with one on every
 * piece of a model or optimizer tensor. */
Test(checkpoint_index, every_piece_has_its_hash, .timeout = 60)
{
    char *dir = NULL;
    ts_module *m = saved(&dir);
    json_t *good = index_read(dir);
    cr_assert_eq(json_integer_value(json_object_get(good, "version")), 2, "the index written is not version 2");
    json_t *ix = json_deep_copy(good);
    drop_hashes(ix, "weight");
    index_write(dir, ix);
    flip_byte(dir, ix, "weight");
    refused(dir, m, "v2 without a hash", "\"hash\"", "'weight'");
    /* as version 1, with the other pieces hashed: refused too */
    json_object_set_new(ix, "version", json_integer(1));
    index_write(dir, ix);
    refused(dir, m, "v1 with one hash removed", "\"hash\"", "version 1");
    json_decref(ix);
    /* the byte back: a version 1 index with every hash, or with none (before checksums), loads */
    ix = index_read(dir);
    flip_byte(dir, ix, "weight");
    json_decref(ix);
    ix = json_deep_copy(good);
    json_object_set_new(ix, "version", json_integer(1));
    index_write(dir, ix);
    TH_OK(ts_ckpt_load(dir, m, NULL, NULL));
    drop_hashes(ix, NULL);
    index_write(dir, ix);
    TH_OK(ts_ckpt_load(dir, m, NULL, NULL));
    /* a version this code does not know */
    json_object_set_new(ix, "version", json_integer(3));
    index_write(dir, ix);
    refused(dir, m, "version 3", "\"version\" is 3", "1 to 2");
    json_decref(ix);
    json_decref(good);
    ts_module_free(m);
    th_rm_rf(dir);
    free(dir);
}

/* The parser alone: placements that disagree with the pieces, and files
 * that disagree with the world. */
Test(checkpoint_index, parser_checks_placements_against_pieces)
{
    static const char good[] =
        "{\"format\":\"tensorshard-dcp\",\"version\":2,\"save_id\":\"ab\",\"world\":2,"
        "\"files\":[{\"name\":\"a\",\"rank\":0,\"size\":100},{\"name\":\"b\",\"rank\":1,\"size\":100}],"
        "\"tensors\":{\"w\":{\"kind\":\"model\",\"dtype\":\"F32\",\"shape\":[3,2],\"placements\":[\"Replicate()\","
        "\"Shard(0)\"],\"pieces\":["
        "{\"file\":0,\"rank\":0,\"row\":0,\"rows\":2,\"offset\":8,\"length\":16,\"hash\":\"0123456789abcdef\"},"
        "{\"file\":1,\"rank\":1,\"row\":2,\"rows\":1,\"offset\":8,\"length\":8,\"hash\":\"0123456789abcdef\"}]}}}";
    ts__ckpt_index *ix = NULL;
    TH_OK(ts__ckpt_index_parse("good", good, strlen(good), &ix));
    ts__ckpt_index_free(ix);
    static const struct {
        const char *from, *to, *n1, *n2;
    } bad[] = {
        {"[\"Replicate()\",\"Shard(0)\"]", "[\"Replicate()\"]", "no Shard", "2 pieces"},
        {"\"kind\":\"model\"", "\"kind\":\"extra\"", "extra", "Shard(0)"},
        {"\"rank\":1,\"size\"", "\"rank\":0,\"size\"", "\"rank\" 0", "'b'"},
        {"\"Replicate()\",", "\"Replicate\",", "\"Replicate\"", "\"placements\" entry 0"},
        {",\"hash\":\"0123456789abcdef\"}]", "}]", "\"hash\"", "version 2"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char buf[2048];
        const char *at = strstr(good, bad[i].from);
        cr_assert(at, "case %zu: '%s' not in the good index", i, bad[i].from);
        snprintf(buf, sizeof buf, "%.*s%s%s", (int)(at - good), good, bad[i].to, at + strlen(bad[i].from));
        ix = NULL;
        ts_status st = ts__ckpt_index_parse("bad", buf, strlen(buf), &ix);
        cr_assert_eq(st, TS_ERR_FORMAT, "case %zu (%s): %s", i, bad[i].to, ts_status_name(st));
        cr_assert_null(ix);
        cr_assert(strstr(ts_last_error(), bad[i].n1) && strstr(ts_last_error(), bad[i].n2), "case %zu: %s", i,
                  ts_last_error());
    }
}

/* ------------------------------------------------------------ metadata pairs */

/* The metadata was a flat string array and a count of pairs: a count
 * off by the factor of two read past the array (a crash after a whole
 * training run). It is now a typed list whose entries are checked. */
Test(checkpoint_index, metadata_pairs_are_checked, .timeout = 60)
{
    char *dir = NULL;
    ts_module *m = saved(&dir);
    static const struct {
        ts_ckpt_meta meta[3];
        int n;
        const char *n1, *n2;
    } bad[] = {
        {{{"a", "1"}, {NULL, "2"}}, 2, "pair 1", "NULL key"},
        {{{"a", NULL}}, 1, "pair 0", "NULL value"},
        {{{"", "1"}}, 1, "pair 0", "empty key"},
        {{{"a", "1"}, {"b", "2"}, {"a", "3"}}, 3, "pairs 0 and 2", "'a'"},
        {{{"a", "1"}}, -2, "-2 metadata pairs", ""},
        {{{"a", "1"}, {"a", NULL}}, TS_CKPT_META_END, "pair 1", "NULL value"},
    };
    char full[400];
    snprintf(full, sizeof full, "%s.full.safetensors", dir);
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ts_ckpt_options o = ts_ckpt_options_default();
        o.metadata = bad[i].meta;
        o.n_metadata = bad[i].n;
        cr_assert_eq(ts_ckpt_save(dir, m, &o), TS_ERR_INVALID_ARGUMENT, "case %zu saved", i);
        cr_assert(strstr(ts_last_error(), bad[i].n1) && strstr(ts_last_error(), bad[i].n2), "case %zu: %s", i,
                  ts_last_error());
        cr_assert_eq(ts_ckpt_save_full(full, m, bad[i].meta, bad[i].n), TS_ERR_INVALID_ARGUMENT, "case %zu: full", i);
        cr_assert(strstr(ts_last_error(), bad[i].n1) && strstr(ts_last_error(), bad[i].n2), "case %zu: %s", i,
                  ts_last_error());
        cr_assert_neq(access(full, F_OK), 0, "case %zu: the full file was written", i);
    }
    /* the checkpoint's own record's key is reserved in a sharded save only */
    const ts_ckpt_meta own[1] = {{"ts_ckpt", "x"}};
    ts_ckpt_options o = ts_ckpt_options_default();
    o.metadata = own;
    o.n_metadata = 1;
    cr_assert_eq(ts_ckpt_save(dir, m, &o), TS_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(ts_last_error(), "reserved"), "%s", ts_last_error());
    TH_OK(ts_ckpt_save_full(full, m, own, 1));
    /* good pairs round-trip */
    const ts_ckpt_meta meta[2] = {{"n_layer", "12"}, {"vocab", "gpt2"}};
    o.metadata = meta;
    o.n_metadata = 2;
    TH_OK(ts_ckpt_save(dir, m, &o));
    char *v = NULL;
    TH_OK(ts_ckpt_metadata(dir, "vocab", &v));
    cr_assert_str_eq(v, "gpt2");
    free(v);
    TH_OK(ts_ckpt_load(dir, m, &o, NULL));
    /* a list ended by {NULL, NULL}: no count to get wrong */
    const ts_ckpt_meta ended[3] = {{"n_layer", "24"}, {"tok", "bpe"}, {NULL, NULL}};
    o.metadata = ended;
    o.n_metadata = TS_CKPT_META_END;
    TH_OK(ts_ckpt_save(dir, m, &o));
    TH_OK(ts_ckpt_metadata(dir, "tok", &v));
    cr_assert_str_eq(v, "bpe");
    free(v);
    TH_OK(ts_ckpt_save_full(full, m, ended, TS_CKPT_META_END));
    /* one without its end within TS_CKPT_META_MAX pairs is refused, not read on */
    ts_ckpt_meta *endless = calloc(TS_CKPT_META_MAX + 1, sizeof *endless);
    cr_assert(endless);
    for (int i = 0; i <= TS_CKPT_META_MAX; i++) endless[i] = (ts_ckpt_meta){"k", "v"};
    o.metadata = endless;
    cr_assert_eq(ts_ckpt_save(dir, m, &o), TS_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(ts_last_error(), "no {NULL, NULL} end"), "%s", ts_last_error());
    free(endless);
    unlink(full);
    ts_module_free(m);
    th_rm_rf(dir);
    free(dir);
}

/* A strided extra (a transposed view) had no "hash" (the version 1 writer
 * hashed contiguous tensors only); it is now hashed as the file holds it
 * (compacted), so a version 2 index has one on every piece and it loads. */
Test(checkpoint_index, strided_extra_is_hashed_and_loads, .timeout = 60)
{
    char *dir = NULL;
    ts_module *m = saved(&dir);
    int64_t shape[2] = {2, 3};
    ts_tensor *base = th_seq(TS_F32, 2, shape, 1.0, false), *tv = NULL, *back = NULL;
    TH_OK(ts_transpose(base, 0, 1, &tv));
    cr_assert(!ts_tensor_is_contiguous(tv));
    ts_state_dict *ex = NULL;
    TH_OK(ts_state_dict_new(&ex));
    TH_OK(ts_state_dict_set(ex, "view", tv));
    ts_ckpt_options o = ts_ckpt_options_default();
    o.extra = ex;
    TH_OK(ts_ckpt_save(dir, m, &o));
    json_t *ix = index_read(dir);
    json_t *p = json_array_get(json_object_get(tensor_of(ix, "extra.view"), "pieces"), 0);
    cr_assert(json_is_string(json_object_get(p, "hash")), "the strided extra's piece has no hash");
    json_decref(ix);
    /* loads into a contiguous tensor of the view's shape, equal to it */
    int64_t tshape[2] = {3, 2};
    TH_OK(ts_tensor_zeros(TS_F32, 2, tshape, &back));
    ts_state_dict *ld = NULL;
    TH_OK(ts_state_dict_new(&ld));
    TH_OK(ts_state_dict_set(ld, "view", back));
    o.extra = ld;
    TH_OK(ts_ckpt_load(dir, m, &o, NULL));
    th_assert_close(back, tv, 0, 0);
    ts_state_dict_free(ld);
    ts_state_dict_free(ex);
    ts_tensor_free(back);
    ts_tensor_free(tv);
    ts_tensor_free(base);
    ts_module_free(m);
    th_rm_rf(dir);
    free(dir);
}
