/* tokenize: a text file to llm.c's token file (text/tokenizer.h,
 * docs/tokenizer.md "Token files").
 *
 *   tokenize --vocab encoder.json --merges vocab.bpe [--eot] IN.txt OUT.bin
 *   tokenize --learn N [--vocab V --merges M] [--eot] IN.txt OUT.bin
 *
 * The first form encodes IN with GPT-2's (or any) vocabulary and merges.
 * The second learns a vocabulary of N tokens from IN first and writes it
 * to V and M (default: beside OUT, as OUT's name less ".bin" plus
 * ".encoder.json" and ".vocab.bpe"). --eot puts <|endoftext|> before the
 * text, as llm.c's data scripts do before each document. Prints the
 * counts; exits 0 on success, 1 on an error (with the library's message),
 * 2 on a usage error. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tensorshard.h"

static int usage(const char *msg)
{
    if (msg) fprintf(stderr, "tokenize: %s\n", msg);
    fprintf(stderr,
            "usage: tokenize --vocab encoder.json --merges vocab.bpe [--eot] IN.txt OUT.bin\n"
            "       tokenize --learn N [--vocab V --merges M] [--eot] IN.txt OUT.bin\n");
    return 2;
}

static int fail(const char *what, ts_status st)
{
    fprintf(stderr, "tokenize: %s: %s: %s\n", what, ts_status_name(st), ts_last_error());
    return 1;
}

static char *read_all(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 1 << 20, n = 0;
    char *buf = malloc(cap);
    while (buf) {
        if (n == cap) {
            char *b2 = realloc(buf, cap * 2);
            if (!b2) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = b2;
            cap *= 2;
        }
        size_t got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (got == 0) break;
    }
    if (buf && ferror(f)) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    *len = n;
    return buf;
}

int main(int argc, char **argv)
{
    const char *vocab = NULL, *merges = NULL, *in = NULL, *out = NULL;
    long learn = 0;
    int eot = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--vocab") && i + 1 < argc) vocab = argv[++i];
        else if (!strcmp(argv[i], "--merges") && i + 1 < argc) merges = argv[++i];
        else if (!strcmp(argv[i], "--learn") && i + 1 < argc) {
            char *end = NULL;
            learn = strtol(argv[++i], &end, 10);
            if (!end || *end || learn < 257 || learn > 65536)
                return usage("--learn takes a vocabulary size from 257 to 65536 (uint16 tokens)");
        } else if (!strcmp(argv[i], "--eot")) eot = 1;
        else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) return usage(NULL), 0;
        else if (argv[i][0] == '-' && argv[i][1]) return usage("unknown option"), 2;
        else if (!in) in = argv[i];
        else if (!out) out = argv[i];
        else return usage("more than two files");
    }
    if (!in || !out) return usage("IN.txt and OUT.bin are needed");
    if (!learn && (!vocab || !merges)) return usage("--vocab and --merges are needed (or --learn N)");
    if (learn && (!vocab) != (!merges)) return usage("with --learn, give both --vocab and --merges or neither");

    size_t len = 0;
    char *text = read_all(in, &len);
    if (!text) {
        perror(in);
        return 1;
    }
    ts_tokenizer *tok = NULL;
    int32_t *ids = NULL, *all = NULL;
    size_t n = 0;
    int rc = 1;
    ts_status st;
    char vbuf[4096], mbuf[4096];
    if (learn) {
        if (!vocab) {
            size_t base = strlen(out);
            if (base > 4 && !strcmp(out + base - 4, ".bin")) base -= 4;
            snprintf(vbuf, sizeof vbuf, "%.*s.encoder.json", (int)base, out);
            snprintf(mbuf, sizeof mbuf, "%.*s.vocab.bpe", (int)base, out);
            vocab = vbuf;
            merges = mbuf;
        }
        if ((st = ts_tokenizer_learn(text, len, (int32_t)learn, &tok))) {
            fail("learn", st);
            goto done;
        }
        if ((st = ts_tokenizer_save(tok, vocab, merges))) {
            fail("save", st);
            goto done;
        }
        printf("learned %d tokens (%d merges) from %zu bytes: %s, %s\n", ts_tokenizer_vocab_size(tok),
               ts_tokenizer_merge_count(tok), len, vocab, merges);
    } else if ((st = ts_tokenizer_load(vocab, merges, &tok))) {
        fail("load", st);
        goto done;
    }
    if (ts_tokenizer_vocab_size(tok) > 65536) {
        fprintf(stderr, "tokenize: the vocabulary has %d tokens; llm.c's files hold uint16 ids (at most 65536)\n",
                ts_tokenizer_vocab_size(tok));
        goto done;
    }
    if ((st = ts_tokenizer_encode(tok, text, len, &ids, &n))) {
        fail("encode", st);
        goto done;
    }
    all = ids;
    if (eot) {
        int32_t id;
        if ((st = ts_tokenizer_token_id(tok, "<|endoftext|>", &id))) {
            fail("--eot", st);
            goto done;
        }
        if (!(all = malloc((n + 1) * sizeof *all))) {
            fail("--eot", ts_error(TS_ERR_NO_MEMORY, "%zu tokens", n + 1));
            goto done;
        }
        all[0] = id;
        if (n) memcpy(all + 1, ids, n * sizeof *ids);
        n++;
    }
    if ((st = ts_tokenizer_write_bin(all, n, out))) {
        fail("write", st);
        goto done;
    }
    printf("%s: %zu bytes -> %zu tokens (%.2f bytes/token) -> %s\n", in, len, n, n ? (double)len / (double)n : 0.0,
           out);
    rc = 0;
done:
    if (all != ids) free(all);
    ts_tokenizer_buffer_free(ids);
    ts_tokenizer_free(tok);
    free(text);
    return rc;
}
