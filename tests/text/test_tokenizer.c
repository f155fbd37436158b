/* GPT-2's byte-level BPE (text/tokenizer.h): ids against the npm package
 * gpt-3-encoder's on a varied corpus (tests/fixtures/gpt2/, made by
 * tools/reference/make_bpe_fixtures.sh), byte-exact round trips of that
 * corpus and of random bytes (invalid UTF-8), learning (exact merges on a
 * small text, determinism, save and reload), and bad input. */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/helpers.h"
#include "text/internal.h"

#define GPT2_DIR TS_FIXTURES_DIR "/gpt2"

static ts_tokenizer *gpt2(void)
{
    ts_tokenizer *t = NULL;
    TH_OK(ts_tokenizer_load(GPT2_DIR "/encoder.json", GPT2_DIR "/vocab.bpe", &t));
    return t;
}

static json_t *cases(void)
{
    json_error_t err;
    json_t *c = json_load_file(GPT2_DIR "/bpe_cases.json", 0, &err);
    cr_assert(c && json_is_array(c), "bpe_cases.json: %s", err.text);
    cr_assert_gt(json_array_size(c), 20);
    return c;
}

/* Encodes then decodes `len` bytes and asserts the bytes come back. */
static void assert_round_trip(ts_tokenizer *t, const char *text, size_t len, const char *what)
{
    int32_t *ids = NULL;
    size_t n = 0;
    TH_OK(ts_tokenizer_encode(t, text, len, &ids, &n));
    char *back = NULL;
    size_t blen = 0;
    TH_OK(ts_tokenizer_decode(t, ids, n, &back, &blen));
    cr_assert_eq(blen, len, "%s: %zu bytes came back from %zu", what, blen, len);
    cr_assert(len == 0 || memcmp(back, text, len) == 0, "%s: the bytes differ", what);
    ts_tokenizer_buffer_free(ids);
    ts_tokenizer_buffer_free(back);
}

Test(text_tokenizer, gpt2_files_load)
{
    ts_tokenizer *t = gpt2();
    cr_assert_eq(ts_tokenizer_vocab_size(t), 50257);
    cr_assert_eq(ts_tokenizer_merge_count(t), 50000);
    int32_t id = -1;
    TH_OK(ts_tokenizer_token_id(t, "<|endoftext|>", &id));
    cr_assert_eq(id, 50256);
    TH_OK(ts_tokenizer_token_id(t, " the", &id));
    cr_assert_eq(id, 262);
    const char *bytes = NULL;
    size_t len = 0;
    TH_OK(ts_tokenizer_token_bytes(t, 220, &bytes, &len)); /* "Ġ" */
    cr_assert(len == 1 && bytes[0] == ' ');
    ts_tokenizer_free(t);
}

/* The ids of every corpus entry equal the reference encoder's, through
 * GPT-2's rescan for every piece (heap_min SIZE_MAX), the heap for every
 * piece (0), and the default (the heap for long pieces only). */
static void ids_equal_reference(size_t heap_min)
{
    ts_tokenizer *t = gpt2();
    cr_assert(ts__tokenizer_heap_ordered(t), "GPT-2's merges should allow the heap");
    if (heap_min != 1) ts__tokenizer_set_heap_min_len(t, heap_min);
    json_t *c = cases();
    size_t i;
    json_t *e;
    size_t total = 0;
    json_array_foreach(c, i, e)
    {
        const char *name = json_string_value(json_object_get(e, "name"));
        json_t *text = json_object_get(e, "text"), *want = json_object_get(e, "ids");
        cr_assert(name && json_is_string(text) && json_is_array(want));
        int32_t *ids = NULL;
        size_t n = 0;
        TH_OK(ts_tokenizer_encode(t, json_string_value(text), json_string_length(text), &ids, &n));
        size_t first = 0;
        while (first < n && first < json_array_size(want) &&
               ids[first] == (int32_t)json_integer_value(json_array_get(want, first)))
            first++;
        cr_assert(n == json_array_size(want) && first == n,
                  "case '%s': %zu ids, the reference has %zu; first difference at %zu (ours %d, reference %d)", name, n,
                  json_array_size(want), first, first < n ? ids[first] : -1,
                  first < json_array_size(want) ? (int)json_integer_value(json_array_get(want, first)) : -1);
        total += n;
        ts_tokenizer_buffer_free(ids);
    }
    cr_assert_gt(total, 1000);
    json_decref(c);
    ts_tokenizer_free(t);
}

Test(text_tokenizer, ids_equal_npm_gpt3_encoder) { ids_equal_reference(1); }

Test(text_tokenizer, ids_equal_npm_gpt3_encoder_rescan) { ids_equal_reference(SIZE_MAX); }

Test(text_tokenizer, ids_equal_npm_gpt3_encoder_heap) { ids_equal_reference(0); }

/* A long piece (random letters, no space) merges through the heap to the
 * same ids as GPT-2's rescan, which is quadratic in it. */
Test(text_tokenizer, long_piece_heap_equals_rescan)
{
    ts_tokenizer *t = gpt2(), *u = gpt2();
    ts__tokenizer_set_heap_min_len(u, SIZE_MAX);
    static char text[20000];
    uint32_t seed = 99;
    for (size_t i = 0; i < sizeof text; i++) text[i] = (char)('a' + th_lcg(&seed) % 26);
    int32_t *a = NULL, *b = NULL;
    size_t na = 0, nb = 0;
    TH_OK(ts_tokenizer_encode(t, text, sizeof text, &a, &na));
    TH_OK(ts_tokenizer_encode(u, text, sizeof text, &b, &nb));
    cr_assert(na == nb && memcmp(a, b, na * sizeof *a) == 0, "%zu ids against %zu", na, nb);
    ts_tokenizer_buffer_free(a);
    ts_tokenizer_buffer_free(b);
    ts_tokenizer_free(t);
    ts_tokenizer_free(u);
}

Test(text_tokenizer, corpus_round_trips)
{
    ts_tokenizer *t = gpt2();
    json_t *c = cases();
    size_t i;
    json_t *e;
    json_array_foreach(c, i, e)
    {
        json_t *text = json_object_get(e, "text");
        assert_round_trip(t, json_string_value(text), json_string_length(text),
                          json_string_value(json_object_get(e, "name")));
    }
    json_decref(c);
    ts_tokenizer_free(t);
}

/* Bytes that are not UTF-8 encode (each invalid byte a character of its
 * own) and decode back exactly. */
Test(text_tokenizer, invalid_utf8_round_trips)
{
    ts_tokenizer *t = gpt2();
    static const char *const bad[] = {
        "\xff",
        "\xc3",
        "a\xc3",
        "\xc0\xaf",
        "\xed\xa0\x80",
        "\xf4\x90\x80\x80",
        "\xe2\x82",
        " \xfe\xfe x",
        "caf\xe9 na\xefve",
        "\x80\x80\x80 \x80",
        "'s\xff's",
        "  \xf0\x9f\x98",
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) assert_round_trip(t, bad[k], strlen(bad[k]), bad[k]);
    /* one invalid byte is GPT-2's token of that byte */
    int32_t *ids = NULL, want = -1;
    size_t n = 0;
    TH_OK(ts_tokenizer_encode(t, "\xff", 1, &ids, &n));
    TH_OK(ts_tokenizer_token_id(t, "\xff", &want));
    cr_assert(n == 1 && ids[0] == want, "got %zu ids, first %d, want %d", n, n ? ids[0] : -1, want);
    ts_tokenizer_buffer_free(ids);

    uint32_t seed = 12345;
    for (int round = 0; round < 200; round++) {
        char buf[512];
        size_t len = th_lcg(&seed) % sizeof buf;
        for (size_t i = 0; i < len; i++) {
            uint32_t r = th_lcg(&seed);
            /* half high bytes (lead and continuation bytes, mostly
             * invalid sequences), a quarter spaces, the rest ASCII */
            buf[i] =
                r % 4 == 2 ? " \t\n'"[(r >> 8) % 4] : (char)(r % 4 < 2 ? 0x80 + (r >> 8) % 128 : 0x21 + (r >> 8) % 94);
        }
        assert_round_trip(t, buf, len, "random bytes");
    }
    ts_tokenizer_free(t);
}

/* The pre-tokenizer's pieces on cases the regex's backtracking decides. */
Test(text_tokenizer, pretoken_whitespace_rules)
{
    static const struct {
        const char *text;
        const char *pieces[8];
    } c[] = {
        {"a   b", {"a", "  ", " b"}},
        {"x\n\ny", {"x", "\n", "\n", "y"}},
        {"end  ", {"end", "  "}},
        {"\t x", {"\t", " x"}},
        {" 's", {" '", "s"}},
        {"it's", {"it", "'s"}},
        {"IT'S", {"IT", "'", "S"}},
        {"\xff\xfe a", {"\xff\xfe", " a"}},
        /* JavaScript's \s, not Python's: U+001C..U+001F and U+0085 are
         * not white space */
        {"a\x1c\x1c"
         "b",
         {"a", "\x1c\x1c", "b"}},
        {"!\xc2\x85!", {"!\xc2\x85!"}},
        /* U+00A0 and U+3000 are */
        {".\xc2\xa0\xc2\xa0.", {".", "\xc2\xa0", "\xc2\xa0", "."}},
    };
    for (size_t k = 0; k < sizeof c / sizeof c[0]; k++) {
        const uint8_t *s = (const uint8_t *)c[k].text;
        size_t len = strlen(c[k].text), pos = 0, j = 0;
        while (pos < len) {
            size_t end = ts__pretoken_end(s, len, pos);
            cr_assert(c[k].pieces[j], "'%s': more pieces than expected", c[k].text);
            cr_assert(end - pos == strlen(c[k].pieces[j]) && memcmp(s + pos, c[k].pieces[j], end - pos) == 0,
                      "'%s': piece %zu is '%.*s', expected '%s'", c[k].text, j, (int)(end - pos), s + pos,
                      c[k].pieces[j]);
            pos = end;
            j++;
        }
        cr_assert_null(c[k].pieces[j], "'%s': fewer pieces than expected", c[k].text);
    }
}

static void assert_bytes(ts_tokenizer *t, int32_t id, const char *want)
{
    const char *b = NULL;
    size_t n = 0;
    TH_OK(ts_tokenizer_token_bytes(t, id, &b, &n));
    cr_assert(n == strlen(want) && memcmp(b, want, n) == 0, "token %d is '%.*s', expected '%s'", id, (int)n, b, want);
}

/* Pieces "ab" and " cd" once each: every pair counts 1, so the tie-break
 * (smallest left id, then right id; GPT-2's byte ids put 'a' at 64, 'c'
 * at 66 and ' ' at 220) decides: "ab", then "cd", then " cd"; then every
 * piece is one token and learning stops below the size asked for. */
Test(text_tokenizer, learn_tie_break_and_early_stop)
{
    ts_tokenizer *t = NULL;
    TH_OK(ts_tokenizer_learn("ab cd", 5, 300, &t));
    cr_assert_eq(ts_tokenizer_merge_count(t), 3);
    cr_assert_eq(ts_tokenizer_vocab_size(t), 260);
    assert_bytes(t, 256, "ab");
    assert_bytes(t, 257, "cd");
    assert_bytes(t, 258, " cd");
    assert_bytes(t, 259, "<|endoftext|>");
    assert_bytes(t, 64, "a");
    ts_tokenizer_free(t);
}

/* The most frequent pair is merged first, counted over repeated pieces. */
Test(text_tokenizer, learn_most_frequent_first)
{
    ts_tokenizer *t = NULL;
    TH_OK(ts_tokenizer_learn("xy zq zq zq xy", 14, 258, &t));
    cr_assert_eq(ts_tokenizer_vocab_size(t), 258);
    /* pairs: ' '-z and z-q 3 times (in " zq" x 3), x-y 2 (in "xy" and
     * " xy"), ' '-x once; of the two at 3, z-q has the smaller left id
     * (z 89, ' ' 220) */
    assert_bytes(t, 256, "zq");
    assert_bytes(t, 257, "<|endoftext|>");
    ts_tokenizer_free(t);
}

static char *learn_text(size_t *len)
{
    static const char *const words[] = {"the ",
                                        "quick ",
                                        "brown ",
                                        "fox ",
                                        "jumps ",
                                        "over ",
                                        "lazy ",
                                        "dog's ",
                                        "caf\xc3\xa9 ",
                                        "12345 ",
                                        "!!! ",
                                        "\n",
                                        "\xe4\xbd\xa0\xe5\xa5\xbd ",
                                        "   "};
    size_t cap = 64 * 1024, n = 0;
    char *s = malloc(cap);
    uint32_t seed = 7;
    while (n + 32 < cap) {
        const char *w = words[th_lcg(&seed) % (sizeof words / sizeof words[0])];
        memcpy(s + n, w, strlen(w));
        n += strlen(w);
    }
    *len = n;
    return s;
}

static char *file_text(const char *path, size_t *len)
{
    char *s = th_read_file(path, len);
    cr_assert_not_null(s, "%s", path);
    return s;
}

/* Learned twice, the same files; saved and reloaded, the same ids; and
 * text round-trips through it, including text it never saw. */
Test(text_tokenizer, learn_deterministic_and_round_trips)
{
    size_t len = 0;
    char *text = learn_text(&len);
    ts_tokenizer *a = NULL, *b = NULL, *c = NULL;
    TH_OK(ts_tokenizer_learn(text, len, 400, &a));
    TH_OK(ts_tokenizer_learn(text, len, 400, &b));
    cr_assert_gt(ts_tokenizer_merge_count(a), 50);
    char *dir = th_tmp_dir("ts_bpe_learn");
    char va[4200], ma[4200], vb[4200], mb[4200];
    snprintf(va, sizeof va, "%s/a.json", dir);
    snprintf(ma, sizeof ma, "%s/a.bpe", dir);
    snprintf(vb, sizeof vb, "%s/b.json", dir);
    snprintf(mb, sizeof mb, "%s/b.bpe", dir);
    TH_OK(ts_tokenizer_save(a, va, ma));
    TH_OK(ts_tokenizer_save(b, vb, mb));
    size_t l1, l2, l3, l4;
    char *f1 = file_text(va, &l1), *f2 = file_text(vb, &l2), *f3 = file_text(ma, &l3), *f4 = file_text(mb, &l4);
    cr_assert(l1 == l2 && memcmp(f1, f2, l1) == 0, "two learns gave different vocabularies");
    cr_assert(l3 == l4 && memcmp(f3, f4, l3) == 0, "two learns gave different merges");
    TH_OK(ts_tokenizer_load(va, ma, &c));
    cr_assert_eq(ts_tokenizer_vocab_size(c), ts_tokenizer_vocab_size(a));
    cr_assert_eq(ts_tokenizer_merge_count(c), ts_tokenizer_merge_count(a));
    int32_t *ia = NULL, *ic = NULL;
    size_t na = 0, nc = 0;
    TH_OK(ts_tokenizer_encode(a, text, len, &ia, &na));
    TH_OK(ts_tokenizer_encode(c, text, len, &ic, &nc));
    cr_assert(na == nc && memcmp(ia, ic, na * sizeof *ia) == 0, "reloaded vocabulary encodes differently");
    cr_assert_lt(na, len / 3, "%zu ids for %zu bytes: the merges do not compress", na, len);
    assert_round_trip(a, text, len, "learned text");
    static const char unseen[] = "Zebras \xf0\x9f\xa6\x93 never saw this \xff text 999.";
    assert_round_trip(c, unseen, sizeof unseen - 1, "unseen text");
    ts_tokenizer_buffer_free(ia);
    ts_tokenizer_buffer_free(ic);
    free(f1), free(f2), free(f3), free(f4);
    free(text);
    ts_tokenizer_free(a);
    ts_tokenizer_free(b);
    ts_tokenizer_free(c);
    th_rm_rf(dir);
    free(dir);
}

/* ---- bad input ---- */

static char g_dir[4096];

static const char *put(const char *name, const char *content)
{
    static char path[32][4200];
    static int k;
    if (!g_dir[0]) {
        char *d = th_tmp_dir("ts_bpe_err");
        snprintf(g_dir, sizeof g_dir, "%s", d);
        free(d);
    }
    char *p = path[k++ % 32];
    snprintf(p, 4200, "%s/%s", g_dir, name);
    FILE *f = fopen(p, "wb");
    cr_assert_not_null(f);
    fputs(content, f);
    fclose(f);
    return p;
}

/* A vocabulary of the 256 byte tokens plus `extra` ("\"ab\": 256"...). */
static const char *byte_vocab(const char *name, const char *extra)
{
    static char buf[16384];
    size_t o = (size_t)snprintf(buf, sizeof buf, "{");
    for (int b = 0; b < 256; b++) {
        uint32_t cp = ts__byte_to_unicode((uint8_t)b);
        char u[8];
        if (cp == '"' || cp == '\\') snprintf(u, sizeof u, "\\%c", (char)cp);
        else if (cp < 0x80) snprintf(u, sizeof u, "%c", (char)cp);
        else snprintf(u, sizeof u, "%c%c", (char)(0xC0 | (cp >> 6)), (char)(0x80 | (cp & 0x3F)));
        o += (size_t)snprintf(buf + o, sizeof buf - o, "%s\"%s\": %d", b ? ", " : "", u, ts__byte_rank((uint8_t)b));
    }
    snprintf(buf + o, sizeof buf - o, "%s%s}", extra[0] ? ", " : "", extra);
    return put(name, buf);
}

static void expect_load_error(const char *vocab, const char *merges, ts_status want, const char *needle)
{
    ts_tokenizer *t = (ts_tokenizer *)0x1;
    ts_status st = ts_tokenizer_load(vocab, merges, &t);
    cr_assert_eq(st, want, "got %s (%s), want %s", ts_status_name(st), ts_last_error(), ts_status_name(want));
    cr_assert(strstr(ts_last_error(), needle), "message '%s' lacks '%s'", ts_last_error(), needle);
    cr_assert_eq(t, (ts_tokenizer *)0x1, "tok_out written on failure");
}

Test(text_tokenizer, bad_files)
{
    const char *ok_merges = put("ok.bpe", "#version: 0.2\na b\n");
    const char *ok_vocab = byte_vocab("ok.json", "\"ab\": 256");
    ts_tokenizer *t = NULL;
    TH_OK(ts_tokenizer_load(ok_vocab, ok_merges, &t));
    cr_assert_eq(ts_tokenizer_merge_count(t), 1);
    ts_tokenizer_free(t);

    expect_load_error("/nonexistent/encoder.json", ok_merges, TS_ERR_IO, "/nonexistent/encoder.json");
    expect_load_error(ok_vocab, "/nonexistent/vocab.bpe", TS_ERR_IO, "/nonexistent/vocab.bpe");
    expect_load_error(put("trunc.json", "{\"a\": 0, "), ok_merges, TS_ERR_FORMAT, "line 1");
    expect_load_error(put("arr.json", "[1, 2]"), ok_merges, TS_ERR_FORMAT, "not a JSON object");
    expect_load_error(put("str.json", "{\"a\": \"x\"}"), ok_merges, TS_ERR_FORMAT, "not an id");
    expect_load_error(put("range.json", "{\"a\": 5}"), ok_merges, TS_ERR_FORMAT, "out of range");
    expect_load_error(put("dup.json", "{\"a\": 0, \"b\": 0}"), ok_merges, TS_ERR_FORMAT, "id 0 is given twice");
    expect_load_error(put("alpha.json", "{\"a b\": 0}"), ok_merges, TS_ERR_FORMAT, "U+0020");
    expect_load_error(put("nobyte.json", "{\"a\": 0}"), ok_merges, TS_ERR_FORMAT, "no token for the byte");
    expect_load_error(ok_vocab, put("unk.bpe", "#version: 0.2\na b\nab zz\n"), TS_ERR_FORMAT,
                      "line 3: the token 'zz' is not in the vocabulary");
    expect_load_error(ok_vocab, put("three.bpe", "#version: 0.2\na b c\n"), TS_ERR_FORMAT, "line 2: 3 fields");
    expect_load_error(ok_vocab, put("nores.bpe", "#version: 0.2\nb a\n"), TS_ERR_FORMAT, "are no token");
    th_rm_rf(g_dir);
}

Test(text_tokenizer, bad_arguments)
{
    ts_tokenizer *t = NULL;
    int32_t *ids = NULL;
    size_t n = 0;
    char *bytes = NULL;
    cr_assert_eq(ts_tokenizer_load(NULL, "x", &t), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_tokenizer_learn("abc", 3, 256, &t), TS_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(ts_last_error(), "vocab_size 256"), "%s", ts_last_error());
    cr_assert_eq(ts_tokenizer_learn(NULL, 3, 300, &t), TS_ERR_INVALID_ARGUMENT);
    TH_OK(ts_tokenizer_learn("hello hello", 11, 270, &t));
    cr_assert_eq(ts_tokenizer_encode(t, NULL, 4, &ids, &n), TS_ERR_INVALID_ARGUMENT);
    TH_OK(ts_tokenizer_encode(t, NULL, 0, &ids, &n));
    cr_assert(n == 0 && ids == NULL);
    int32_t bad[] = {3, 1 << 20};
    cr_assert_eq(ts_tokenizer_decode(t, bad, 2, &bytes, &n), TS_ERR_INDEX);
    cr_assert(strstr(ts_last_error(), "id 1048576 at position 1"), "%s", ts_last_error());
    int32_t neg = -1;
    cr_assert_eq(ts_tokenizer_decode(t, &neg, 1, &bytes, &n), TS_ERR_INDEX);
    cr_assert_eq(ts_tokenizer_token_id(t, "nope-not-a-token", &neg), TS_ERR_NOT_FOUND);
    const char *b = NULL;
    cr_assert_eq(ts_tokenizer_token_bytes(t, 99999, &b, &n), TS_ERR_INDEX);
    cr_assert_eq(ts_tokenizer_save(t, "/nonexistent/dir/v.json", "/nonexistent/dir/m.bpe"), TS_ERR_IO);
    cr_assert_eq(ts_tokenizer_vocab_size(NULL), 0);
    ts_tokenizer_free(t);
    ts_tokenizer_free(NULL);
    ts_tokenizer_buffer_free(NULL);
}

/* GPT-2's own files saved and read back encode the same. */
Test(text_tokenizer, gpt2_save_reload)
{
    ts_tokenizer *t = gpt2(), *u = NULL;
    char *dir = th_tmp_dir("ts_bpe_save");
    char v[4200], m[4200];
    snprintf(v, sizeof v, "%s/encoder.json", dir);
    snprintf(m, sizeof m, "%s/vocab.bpe", dir);
    TH_OK(ts_tokenizer_save(t, v, m));
    TH_OK(ts_tokenizer_load(v, m, &u));
    size_t mlen = 0, olen = 0;
    char *mine = file_text(m, &mlen), *orig = file_text(GPT2_DIR "/vocab.bpe", &olen);
    cr_assert(mlen == olen && memcmp(mine, orig, olen) == 0, "vocab.bpe written differs from GPT-2's");
    json_t *c = cases();
    size_t i;
    json_t *e;
    json_array_foreach(c, i, e)
    {
        json_t *text = json_object_get(e, "text");
        int32_t *a = NULL, *b = NULL;
        size_t na = 0, nb = 0;
        TH_OK(ts_tokenizer_encode(t, json_string_value(text), json_string_length(text), &a, &na));
        TH_OK(ts_tokenizer_encode(u, json_string_value(text), json_string_length(text), &b, &nb));
        cr_assert(na == nb && (na == 0 || memcmp(a, b, na * sizeof *a) == 0));
        ts_tokenizer_buffer_free(a);
        ts_tokenizer_buffer_free(b);
    }
    json_decref(c);
    free(mine), free(orig);
    ts_tokenizer_free(t);
    ts_tokenizer_free(u);
    th_rm_rf(dir);
    free(dir);
}

/* ---- llm.c's token files ---- */

/* Reads a token file: asserts the header, returns the tokens (malloc'd). */
static uint16_t *read_bin(const char *path, size_t *n_out)
{
    size_t len = 0;
    uint8_t *d = th_read_file(path, &len);
    cr_assert_not_null(d, "%s", path);
    cr_assert_geq(len, 1024);
    int32_t h[256];
    memcpy(h, d, sizeof h);
    cr_assert_eq(h[0], 20240520);
    cr_assert_eq(h[1], 1);
    for (int i = 3; i < 256; i++) cr_assert_eq(h[i], 0, "header int %d is %d", i, h[i]);
    cr_assert_eq(len, 1024 + 2 * (size_t)h[2], "%zu bytes for %d tokens", len, h[2]);
    uint16_t *t = malloc(2 * (size_t)h[2] + 2);
    memcpy(t, d + 1024, 2 * (size_t)h[2]);
    free(d);
    *n_out = (size_t)h[2];
    return t;
}

Test(text_tokenizer, write_bin_llmc_format)
{
    char *dir = th_tmp_dir("ts_bpe_bin");
    char p[4200];
    snprintf(p, sizeof p, "%s/t.bin", dir);
    int32_t ids[] = {50256, 0, 65535, 1234};
    TH_OK(ts_tokenizer_write_bin(ids, 4, p));
    size_t n = 0;
    uint16_t *t = read_bin(p, &n);
    cr_assert(n == 4 && t[0] == 50256 && t[1] == 0 && t[2] == 65535 && t[3] == 1234);
    free(t);
    TH_OK(ts_tokenizer_write_bin(NULL, 0, p));
    t = read_bin(p, &n);
    cr_assert_eq(n, 0);
    free(t);
    int32_t big[] = {1, 65536};
    cr_assert_eq(ts_tokenizer_write_bin(big, 2, p), TS_ERR_INDEX);
    cr_assert(strstr(ts_last_error(), "id 65536 at position 1"), "%s", ts_last_error());
    t = read_bin(p, &n); /* the previous file is still whole */
    cr_assert_eq(n, 0);
    free(t);
    cr_assert_eq(ts_tokenizer_write_bin(ids, 4, "/nonexistent/dir/t.bin"), TS_ERR_IO);
    cr_assert_eq(ts_tokenizer_write_bin(NULL, 3, p), TS_ERR_INVALID_ARGUMENT);
    th_rm_rf(dir);
    free(dir);
}

/* The tokenize program (tools/tokenize, built beside the tests) on the
 * fixtures' prose: the file holds <|endoftext|> and then the reference
 * encoder's ids; with --learn it writes a vocabulary beside the file that
 * loads and gives the same ids. */
Test(text_tokenizer, tokenize_tool)
{
    char tool[4200];
    snprintf(tool, sizeof tool, "%s", th_self_exe());
    char *slash = strrchr(tool, '/');
    cr_assert_not_null(slash);
    *slash = '\0';
    slash = strrchr(tool, '/'); /* build/tests -> build */
    cr_assert_not_null(slash);
    snprintf(slash, sizeof tool - (size_t)(slash - tool), "/tools/tokenize");
    cr_assert_eq(access(tool, X_OK), 0, "%s is not built", tool);

    json_t *c = cases(), *prose = NULL;
    size_t i;
    json_t *e;
    json_array_foreach(c, i, e) if (!strcmp(json_string_value(json_object_get(e, "name")), "prose")) prose = e;
    cr_assert_not_null(prose);
    char *dir = th_tmp_dir("ts_bpe_tool");
    char in[4200], out[4200], cmd[20000];
    snprintf(in, sizeof in, "%s/in.txt", dir);
    snprintf(out, sizeof out, "%s/out.bin", dir);
    FILE *f = fopen(in, "wb");
    json_t *text = json_object_get(prose, "text");
    fwrite(json_string_value(text), 1, json_string_length(text), f);
    fclose(f);
    snprintf(cmd, sizeof cmd, "'%s' --vocab '%s' --merges '%s' --eot '%s' '%s' >/dev/null", tool,
             GPT2_DIR "/encoder.json", GPT2_DIR "/vocab.bpe", in, out);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
    size_t n = 0;
    uint16_t *t = read_bin(out, &n);
    json_t *want = json_object_get(prose, "ids");
    cr_assert_eq(n, json_array_size(want) + 1);
    cr_assert_eq(t[0], 50256);
    for (size_t k = 0; k + 1 < n; k++)
        cr_assert_eq(t[k + 1], json_integer_value(json_array_get(want, k)), "token %zu", k);
    free(t);

    snprintf(cmd, sizeof cmd, "'%s' --learn 300 '%s' '%s' >/dev/null", tool, in, out);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
    char v[4200], m[4200];
    snprintf(v, sizeof v, "%s/out.encoder.json", dir);
    snprintf(m, sizeof m, "%s/out.vocab.bpe", dir);
    ts_tokenizer *tok = NULL;
    TH_OK(ts_tokenizer_load(v, m, &tok));
    cr_assert_eq(ts_tokenizer_vocab_size(tok), 300);
    int32_t *ids = NULL;
    size_t nids = 0;
    TH_OK(ts_tokenizer_encode(tok, json_string_value(text), json_string_length(text), &ids, &nids));
    t = read_bin(out, &n);
    cr_assert_eq(n, nids);
    for (size_t k = 0; k < n; k++) cr_assert_eq(t[k], ids[k], "token %zu", k);
    free(t);
    ts_tokenizer_buffer_free(ids);
    ts_tokenizer_free(tok);

    /* a usage error and a missing vocabulary exit non-zero */
    snprintf(cmd, sizeof cmd, "'%s' '%s' '%s' 2>/dev/null", tool, in, out);
    cr_assert_eq(WEXITSTATUS(system(cmd)), 2);
    snprintf(cmd, sizeof cmd, "'%s' --vocab /nonexistent.json --merges '%s' '%s' '%s' 2>/dev/null", tool,
             GPT2_DIR "/vocab.bpe", in, out);
    cr_assert_eq(WEXITSTATUS(system(cmd)), 1);
    json_decref(c);
    th_rm_rf(dir);
    free(dir);
}
