/* llm.c's token files memory-mapped (text/tokens.h): a file written by
 * ts_tokenizer_write_bin reads back; each header error, a truncated file
 * and garbage are refused with the file and the values named; the vocab
 * check names the id; training windows are the file's tokens shifted by
 * one, drawn in one order that two simulated ranks split disjointly (and
 * together equal one rank's global batch); validation windows are fixed,
 * tile the held-out part and never overlap a training window. */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/helpers.h"
#include "text/tokenizer.h"
#include "text/tokens.h"

static char *dir;
static char path[512];

static void setup(void)
{
    dir = th_tmp_dir("ts-test-tokens");
    snprintf(path, sizeof path, "%s/t.bin", dir);
}

static void teardown(void)
{
    th_rm_rf(dir);
    free(dir);
}

TestSuite(text_tokens, .init = setup, .fini = teardown);

/* n tokens i * 7 % 1000, written by the tokenizer's writer. */
static void write_tokens(size_t n)
{
    int32_t *ids = malloc(n * sizeof *ids + 1);
    for (size_t i = 0; i < n; i++) ids[i] = (int32_t)(i * 7 % 1000);
    TH_OK(ts_tokenizer_write_bin(ids, n, path));
    free(ids);
}

/* Writes `bytes` bytes of `data` to path. */
static void write_raw(const void *data, size_t bytes)
{
    FILE *f = fopen(path, "wb");
    cr_assert(f);
    cr_assert_eq(fwrite(data, 1, bytes, f), bytes);
    cr_assert_eq(fclose(f), 0);
}

/* Opening fails with `want`, and the message holds the path and `needle`. */
static void assert_refused(ts_status want, const char *needle)
{
    ts_token_file *f = (ts_token_file *)0x1;
    ts_status st = ts_token_file_open(path, &f);
    cr_assert_eq(st, want, "%s: %s", ts_status_name(st), ts_last_error());
    cr_assert_eq(f, (ts_token_file *)0x1, "the output was written on failure");
    cr_assert(strstr(ts_last_error(), path), "the file is not named: %s", ts_last_error());
    cr_assert(strstr(ts_last_error(), needle), "'%s' not in: %s", needle, ts_last_error());
}

Test(text_tokens, a_written_file_reads_back)
{
    write_tokens(5000);
    ts_token_file *f = NULL;
    TH_OK(ts_token_file_open(path, &f));
    cr_assert_eq(ts_token_file_count(f), 5000);
    const uint16_t *t = ts_token_file_tokens(f);
    for (size_t i = 0; i < 5000; i++) cr_assert_eq(t[i], i * 7 % 1000, "token %zu", i);
    cr_assert_str_eq(ts_token_file_path(f), path);
    TH_OK(ts_token_file_check_vocab(f, 1000));
    ts_status st = ts_token_file_check_vocab(f, 999);
    cr_assert_eq(st, TS_ERR_INDEX);
    /* the first id >= 999 is 999 itself, at 999 * 7^-1 mod 1000 = 857 (857 * 7 = 5999) */
    cr_assert(strstr(ts_last_error(), "id 999 at position 857") && strstr(ts_last_error(), path), "%s",
              ts_last_error());
    uint64_t h = ts_token_file_hash(f);
    ts_token_file_close(f);
    write_tokens(4999); /* another file, another identity */
    TH_OK(ts_token_file_open(path, &f));
    cr_assert_neq(ts_token_file_hash(f), h);
    ts_token_file_close(f);
    ts_token_file_close(NULL);
}

Test(text_tokens, header_errors_are_named)
{
    int32_t h[256 + 8] = {20240520, 1, 16};
    uint16_t *tok = (uint16_t *)(h + 256);
    for (int i = 0; i < 16; i++) tok[i] = (uint16_t)i;
    write_raw(h, 1024 + 32);
    ts_token_file *f = NULL;
    TH_OK(ts_token_file_open(path, &f)); /* the valid one first */
    ts_token_file_close(f);

    h[0] = 20240521;
    write_raw(h, 1024 + 32);
    assert_refused(TS_ERR_FORMAT, "magic 20240521, expected 20240520");
    h[0] = 20240520, h[1] = 2;
    write_raw(h, 1024 + 32);
    assert_refused(TS_ERR_FORMAT, "version 2, expected 1");
    h[1] = 1, h[2] = -5;
    write_raw(h, 1024 + 32);
    assert_refused(TS_ERR_FORMAT, "count of -5");
    h[2] = 17; /* one token more than the file holds */
    write_raw(h, 1024 + 32);
    assert_refused(TS_ERR_FORMAT, "1056 bytes, but its header's count of 17 tokens makes 1058 (truncated)");
    h[2] = 15;
    write_raw(h, 1024 + 32);
    assert_refused(TS_ERR_FORMAT, "bytes after the tokens");
    h[2] = 16;
    write_raw(h, 1024 + 31); /* cut inside the last token */
    assert_refused(TS_ERR_FORMAT, "truncated");
    write_raw(h, 100); /* cut inside the header */
    assert_refused(TS_ERR_FORMAT, "100 bytes, fewer than the 1024");
    write_raw("", 0);
    assert_refused(TS_ERR_FORMAT, "0 bytes");
    char garbage[3000];
    for (size_t i = 0; i < sizeof garbage; i++) garbage[i] = (char)(i * 131 + 17);
    write_raw(garbage, sizeof garbage);
    assert_refused(TS_ERR_FORMAT, "is not a token file");
    unlink(path);
    assert_refused(TS_ERR_IO, "cannot open");
    snprintf(path, sizeof path, "%s", dir); /* a folder */
    assert_refused(TS_ERR_IO, "not a regular file");
    cr_assert_eq(ts_token_file_open(NULL, &f), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_token_file_open(path, NULL), TS_ERR_INVALID_ARGUMENT);
}

Test(text_tokens, split_sizes_are_checked)
{
    write_tokens(100);
    ts_token_file *f = NULL;
    TH_OK(ts_token_file_open(path, &f));
    int64_t x[8], y[8];
    ts_generator *g = NULL;
    TH_OK(ts_generator_new(1, &g));
    cr_assert_eq(ts_token_file_train_batch(f, g, 1, 0, 1, x, y), TS_ERR_INVALID_ARGUMENT); /* no split yet */
    cr_assert(strstr(ts_last_error(), "no split"), "%s", ts_last_error());
    cr_assert_eq(ts_token_file_split(f, 95, 4), TS_ERR_INVALID_ARGUMENT); /* 5 training tokens, a window needs 6 */
    cr_assert(strstr(ts_last_error(), "leaves 5 for training, fewer than the 6"), "%s", ts_last_error());
    cr_assert_eq(ts_token_file_split(f, 101, 4), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_token_file_split(f, 4, 4), TS_ERR_INVALID_ARGUMENT); /* a validation window needs 5 */
    cr_assert(strstr(ts_last_error(), "4 validation tokens are fewer than the 5"), "%s", ts_last_error());
    cr_assert_eq(ts_token_file_split(f, 10, 0), TS_ERR_INVALID_ARGUMENT);
    TH_OK(ts_token_file_split(f, 94, 4));           /* 6 training tokens: one start */
    cr_assert_eq(ts_token_file_val_windows(f), 23); /* (94 - 1) / 4 */
    TH_OK(ts_token_file_split(f, 0, 4));
    cr_assert_eq(ts_token_file_val_windows(f), 0);
    cr_assert_eq(ts_token_file_val_window(f, 0, x, y), TS_ERR_INDEX);
    TH_OK(ts_token_file_split(f, 20, 4));
    cr_assert_eq(ts_token_file_train_batch(f, g, 2, 1, 2, x, y), TS_ERR_INVALID_ARGUMENT); /* [1, 3) of 2 */
    cr_assert_eq(ts_token_file_train_batch(f, g, 2, -1, 1, x, y), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_token_file_val_window(f, 4, x, y), TS_ERR_INDEX); /* (20 - 1) / 4 = 4 windows */
    cr_assert(strstr(ts_last_error(), "window 4") && strstr(ts_last_error(), "4 validation windows"), "%s",
              ts_last_error());
    ts_generator_free(g);
    ts_token_file_close(f);
}

/* The window starting at `at`: inputs tokens[at .. at + T), targets one on. */
static size_t window_start(const uint16_t *tok, size_t n, const int64_t *x, const int64_t *y, int T)
{
    for (size_t at = 0; at + (size_t)T < n; at++) {
        bool same = true;
        for (int t = 0; t < T && same; t++) same = x[t] == tok[at + (size_t)t] && y[t] == tok[at + (size_t)t + 1];
        if (same) return at;
    }
    return SIZE_MAX;
}

Test(text_tokens, two_ranks_split_one_order_and_validation_is_apart)
{
    enum { N = 3000, T = 16, G = 8, W = 2, STEPS = 20, VAL = 1000 };
    /* distinct tokens so that a window identifies its start */
    int32_t *ids = malloc(N * sizeof *ids);
    for (int i = 0; i < N; i++) ids[i] = i;
    TH_OK(ts_tokenizer_write_bin(ids, N, path));
    free(ids);
    ts_token_file *f = NULL;
    TH_OK(ts_token_file_open(path, &f));
    TH_OK(ts_token_file_split(f, VAL, T));
    cr_assert_eq(ts_token_file_train_tokens(f), N - VAL);
    const uint16_t *tok = ts_token_file_tokens(f);
    ts_generator *one = NULL, *rank[W];
    TH_OK(ts_generator_new(42, &one)); /* one rank taking the whole global batch */
    for (int r = 0; r < W; r++) TH_OK(ts_generator_new(42, &rank[r]));
    int64_t gx[G * T], gy[G * T], rx[W][G / W * T], ry[W][G / W * T];
    for (int s = 0; s < STEPS; s++) {
        TH_OK(ts_token_file_train_batch(f, one, G, 0, G, gx, gy));
        for (int r = 0; r < W; r++) TH_OK(ts_token_file_train_batch(f, rank[r], G, r * (G / W), G / W, rx[r], ry[r]));
        /* rank r's windows are the global batch's slice r: disjoint slices of one order */
        for (int r = 0; r < W; r++)
            cr_assert(!memcmp(rx[r], gx + r * (G / W) * T, sizeof rx[r]) &&
                          !memcmp(ry[r], gy + r * (G / W) * T, sizeof ry[r]),
                      "step %d: rank %d's slice is not the global batch's", s, r);
        for (int b = 0; b < G; b++) {
            size_t at = window_start(tok, N, gx + b * T, gy + b * T, T);
            cr_assert_neq(at, SIZE_MAX, "step %d window %d is no window of the file", s, b);
            cr_assert_leq(at + T, (size_t)(N - VAL - 1), "step %d: window at %zu reaches the validation part", s, at);
        }
    }
    /* the slices of one step hold different windows (not both the same draw) */
    cr_assert(memcmp(rx[0], rx[1], sizeof rx[0]) != 0);
    size_t nw = ts_token_file_val_windows(f);
    cr_assert_eq(nw, (VAL - 1) / T);
    int64_t x[T], y[T];
    for (size_t i = 0; i < nw; i++) { /* fixed, back to back from the end of the training part */
        TH_OK(ts_token_file_val_window(f, i, x, y));
        cr_assert_eq(window_start(tok, N, x, y, T), N - VAL + i * T, "validation window %zu", i);
    }
    ts_generator_free(one);
    for (int r = 0; r < W; r++) ts_generator_free(rank[r]);
    ts_token_file_close(f);
}

/* ts_token_file_from_ids (a text tokenized in memory) is the file that
 * ts_tokenizer_write_bin writes from the same ids: the same tokens, hash,
 * split and training and validation windows drawn from the same order;
 * an id past uint16 is refused naming it and its position. */
Test(text_tokens, ids_in_memory_behave_as_their_file)
{
    enum { N = 3000, T = 8, G = 6 };
    int32_t *ids = malloc(N * sizeof *ids);
    cr_assert(ids);
    for (size_t i = 0; i < N; i++) ids[i] = (int32_t)(i * 7 % 1000);
    TH_OK(ts_tokenizer_write_bin(ids, N, path));
    ts_token_file *file = NULL, *mem = NULL;
    TH_OK(ts_token_file_open(path, &file));
    TH_OK(ts_token_file_from_ids(ids, N, "corpus.txt", &mem));
    cr_assert_eq(ts_token_file_count(mem), N);
    cr_assert_str_eq(ts_token_file_path(mem), "corpus.txt");
    cr_assert_eq(ts_token_file_hash(mem), ts_token_file_hash(file));
    cr_assert_eq(memcmp(ts_token_file_tokens(mem), ts_token_file_tokens(file), N * 2), 0);
    TH_OK(ts_token_file_split(mem, 300, T));
    TH_OK(ts_token_file_split(file, 300, T));
    cr_assert_eq(ts_token_file_val_windows(mem), ts_token_file_val_windows(file));
    ts_generator *a = NULL, *b = NULL;
    TH_OK(ts_generator_new(5, &a));
    TH_OK(ts_generator_new(5, &b));
    int64_t x[2][G * T], y[2][G * T];
    for (int step = 0; step < 4; step++) {
        TH_OK(ts_token_file_train_batch(mem, a, G, 0, G, x[0], y[0]));
        TH_OK(ts_token_file_train_batch(file, b, G, 0, G, x[1], y[1]));
        cr_assert_eq(memcmp(x[0], x[1], sizeof x[0]), 0, "step %d's inputs", step);
        cr_assert_eq(memcmp(y[0], y[1], sizeof y[0]), 0, "step %d's targets", step);
    }
    TH_OK(ts_token_file_val_window(mem, 3, x[0], y[0]));
    TH_OK(ts_token_file_val_window(file, 3, x[1], y[1]));
    cr_assert_eq(memcmp(x[0], x[1], T * sizeof x[0][0]), 0);
    cr_assert_eq(memcmp(y[0], y[1], T * sizeof y[0][0]), 0);
    ts_generator_free(a);
    ts_generator_free(b);
    ts_token_file_close(mem);
    ts_token_file_close(file);

    ids[17] = 70000;
    mem = (ts_token_file *)0x1;
    cr_assert_eq(ts_token_file_from_ids(ids, N, "corpus.txt", &mem), TS_ERR_INDEX);
    cr_assert(strstr(ts_last_error(), "id 70000 at position 17") && strstr(ts_last_error(), "corpus.txt"), "%s",
              ts_last_error());
    ids[17] = -1;
    cr_assert_eq(ts_token_file_from_ids(ids, N, "corpus.txt", &mem), TS_ERR_INDEX);
    cr_assert_eq(mem, (ts_token_file *)0x1, "the output was written on failure");
    TH_OK(ts_token_file_from_ids(NULL, 0, "empty", &mem));
    cr_assert_eq(ts_token_file_count(mem), 0);
    cr_assert_null(ts_token_file_tokens(mem));
    ts_token_file_close(mem);
    free(ids);
}
