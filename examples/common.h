/* Small helpers shared by the examples: error checks, timing, memory,
 * and the built-in text corpus. */
#ifndef TS_EXAMPLES_COMMON_H
#define TS_EXAMPLES_COMMON_H

#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include "tensorshard.h"

#define CHECK(expr)                                                                                \
    do {                                                                                           \
        ts_status st_ = (expr);                                                                    \
        if (st_ != TS_OK) {                                                                        \
            fprintf(stderr, "error: %s: %s: %s\n", #expr, ts_status_name(st_), ts_last_error());   \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

static inline double ex_now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Peak resident set size of the process, MiB. */
static inline double ex_peak_rss_mib(void)
{
    struct rusage r;
    getrusage(RUSAGE_SELF, &r);
    return (double)r.ru_maxrss / 1024.0;
}

/* A deterministic corpus from a small English-like grammar: sentences of
 * determiners, adjectives, nouns and verbs with agreement, so that a
 * character model has structure to learn at several ranges. Returns a
 * malloc'd NUL-terminated string of about `len` characters. */
static inline char *ex_grammar_corpus(size_t len, uint64_t seed)
{
    static const char *det[] = {"the", "a", "every", "some"};
    static const char *adj[] = {"small", "red", "quiet", "old", "bright", ""};
    static const char *noun[] = {"cat", "dog", "bird", "fish", "child", "robot"};
    static const char *verb[] = {"sees", "likes", "chases", "finds", "follows"};
    static const char *end[] = {".", "!", " today.", " again."};
    ts_generator *g;
    if (ts_generator_new(seed, &g))
        return NULL;
    char *s = malloc(len + 64);
    size_t n = 0;
#define PICK(arr) arr[ts_generator_random(g) % (sizeof arr / sizeof *arr)]
    while (n < len) {
        const char *a1 = PICK(adj), *a2 = PICK(adj);
        n += (size_t)snprintf(s + n, len + 64 - n, "%s %s%s%s %s %s %s%s%s%s\n", PICK(det), a1, *a1 ? " " : "",
                              PICK(noun), PICK(verb), PICK(det), a2, *a2 ? " " : "", PICK(noun), PICK(end));
        if (n > len)
            n = len;
    }
#undef PICK
    s[n] = '\0';
    ts_generator_free(g);
    return s;
}

/* Reads a whole file; NULL on error (message printed). */
static inline char *ex_read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        perror(path);
        return NULL;
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)(n > 0 ? n : 0) + 1);
    size_t got = fread(buf, 1, (size_t)(n > 0 ? n : 0), f);
    fclose(f);
    buf[got] = '\0';
    *len = got;
    return buf;
}

#endif
