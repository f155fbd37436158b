/* Small helpers shared by the examples: error checks, timing, memory,
 * the built-in text corpus, command-line flags and file checks. */
#ifndef TS_EXAMPLES_COMMON_H
#define TS_EXAMPLES_COMMON_H

#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "tensorshard.h"

#define CHECK(expr) \
    do { \
        ts_status st_ = (expr); \
        if (st_ != TS_OK) { \
            fprintf(stderr, "error: %s: %s: %s\n", #expr, ts_status_name(st_), ts_last_error()); \
            exit(1); \
        } \
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
    if (ts_generator_new(seed, &g)) return NULL;
    char *s = malloc(len + 64);
    if (!s) {
        ts_generator_free(g);
        return NULL;
    }
    size_t n = 0;
#define PICK(arr) arr[ts_generator_random(g) % (sizeof arr / sizeof *arr)]
    while (n < len) {
        const char *a1 = PICK(adj), *a2 = PICK(adj);
        n += (size_t)snprintf(s + n, len + 64 - n, "%s %s%s%s %s %s %s%s%s%s\n", PICK(det), a1, *a1 ? " " : "",
                              PICK(noun), PICK(verb), PICK(det), a2, *a2 ? " " : "", PICK(noun), PICK(end));
        if (n > len) n = len;
    }
#undef PICK
    s[n] = '\0';
    ts_generator_free(g);
    return s;
}

/* ------------------------------------------------------------ flags
 *
 * The examples' command lines: `--name VALUE` or `--name=VALUE`, numbers
 * parsed strictly (the whole value, in range, no overflow), `--help`
 * printing the usage to stdout. ex_parse_flags exits the process: 0 after
 * --help, 2 (the launchers' "bad flags" status) after an error, which is
 * one stderr line naming the flag and the value. */

typedef enum ex_flag_kind {
    EX_FLAG_INT,    /* int *value, in [min, max] */
    EX_FLAG_U64,    /* uint64_t *value, in [min, max] (digits only: no sign) */
    EX_FLAG_DOUBLE, /* double *value, finite, in [min, max] (above min when min_exclusive) */
    EX_FLAG_STRING, /* const char **value (argv's string, borrowed), not empty */
} ex_flag_kind;

typedef struct ex_flag {
    const char *name;    /* "--steps" */
    const char *metavar; /* "N" */
    ex_flag_kind kind;
    void *value;        /* holds the default; written when the flag is given */
    double min, max;    /* numbers: the accepted range */
    bool min_exclusive; /* doubles: the value must be above min */
    const char *help;   /* one line */
    bool given;         /* set by ex_parse_flags */
} ex_flag;

static inline const char *ex_prog_name(const char *argv0)
{
    const char *s = strrchr(argv0, '/');
    return s ? s + 1 : argv0;
}

static inline void ex_print_usage(FILE *f, const char *prog, const char *about, const ex_flag *flags, int n)
{
    fprintf(f, "usage: %s", prog);
    for (int i = 0; i < n; i++) fprintf(f, " [%s %s]", flags[i].name, flags[i].metavar);
    fprintf(f, "\n\n%s\n\nflags:\n", about);
    for (int i = 0; i < n; i++) {
        char left[64], def[64] = "";
        snprintf(left, sizeof left, "%s %s", flags[i].name, flags[i].metavar);
        switch (flags[i].kind) {
        case EX_FLAG_INT: { /* a default outside the range means "off" */
            int d = *(const int *)flags[i].value;
            if (d >= flags[i].min && d <= flags[i].max) snprintf(def, sizeof def, " (default %d)", d);
            break;
        }
        case EX_FLAG_U64:
            snprintf(def, sizeof def, " (default %llu)", (unsigned long long)*(const uint64_t *)flags[i].value);
            break;
        case EX_FLAG_DOUBLE: {
            double d = *(const double *)flags[i].value;
            if (d <= flags[i].max && (flags[i].min_exclusive ? d > flags[i].min : d >= flags[i].min))
                snprintf(def, sizeof def, " (default %g)", d);
            break;
        }
        case EX_FLAG_STRING:
            if (*(const char *const *)flags[i].value)
                snprintf(def, sizeof def, " (default %s)", *(const char *const *)flags[i].value);
            break;
        }
        fprintf(f, "  %-22s %s%s\n", left, flags[i].help, def);
    }
    fprintf(f, "  %-22s %s\n", "--help", "print this and exit");
}

/* The range of a number flag, for an error message. */
static inline void ex_range_str(const ex_flag *fl, char *buf, size_t cap)
{
    if (fl->kind == EX_FLAG_DOUBLE)
        snprintf(buf, cap, "%s %g and at most %g", fl->min_exclusive ? "above" : "at least", fl->min, fl->max);
    else if (fl->kind == EX_FLAG_U64 && fl->max >= 18446744073709551615.0)
        snprintf(buf, cap, "an integer from %.0f to %llu", fl->min, (unsigned long long)UINT64_MAX);
    else snprintf(buf, cap, "an integer from %.0f to %.0f", fl->min, fl->max);
}

/* Parses one value for fl; 0, or -1 after printing the error. */
static inline int ex_parse_value(const char *prog, ex_flag *fl, const char *v)
{
    char range[128];
    ex_range_str(fl, range, sizeof range);
    if (fl->kind == EX_FLAG_STRING) {
        if (!*v) {
            fprintf(stderr, "%s: %s: the value is empty\n", prog, fl->name);
            return -1;
        }
        *(const char **)fl->value = v;
        return 0;
    }
    if (!*v || isspace((unsigned char)*v)) {
        fprintf(stderr, "%s: %s: '%s' is not a number (must be %s)\n", prog, fl->name, v, range);
        return -1;
    }
    char *end = NULL;
    errno = 0;
    if (fl->kind == EX_FLAG_DOUBLE) {
        double d = strtod(v, &end);
        if (*end || !isfinite(d)) {
            fprintf(stderr, "%s: %s: '%s' is not a finite number (must be %s)\n", prog, fl->name, v, range);
            return -1;
        }
        if (errno == ERANGE || d > fl->max || d < fl->min || (fl->min_exclusive && d == fl->min)) {
            fprintf(stderr, "%s: %s: '%s' is out of range (must be %s)\n", prog, fl->name, v, range);
            return -1;
        }
        *(double *)fl->value = d;
        return 0;
    }
    bool digits = true;
    for (const char *c = *v == '-' || *v == '+' ? v + 1 : v; digits && *c; c++) digits = isdigit((unsigned char)*c);
    if (!digits || !isdigit((unsigned char)v[*v == '-' || *v == '+' ? 1 : 0])) {
        fprintf(stderr, "%s: %s: '%s' is not an integer (must be %s)\n", prog, fl->name, v, range);
        return -1;
    }
    if (fl->kind == EX_FLAG_U64) {
        if (*v == '-' || *v == '+') {
            fprintf(stderr, "%s: %s: '%s' is out of range (must be %s)\n", prog, fl->name, v, range);
            return -1;
        }
        unsigned long long u = strtoull(v, &end, 10);
        if (errno == ERANGE || (double)u > fl->max || (double)u < fl->min) {
            fprintf(stderr, "%s: %s: '%s' is out of range (must be %s)\n", prog, fl->name, v, range);
            return -1;
        }
        *(uint64_t *)fl->value = (uint64_t)u;
        return 0;
    }
    long long x = strtoll(v, &end, 10);
    if (errno == ERANGE || x > INT_MAX || x < INT_MIN || (double)x > fl->max || (double)x < fl->min) {
        fprintf(stderr, "%s: %s: '%s' is out of range (must be %s)\n", prog, fl->name, v, range);
        return -1;
    }
    *(int *)fl->value = (int)x;
    return 0;
}

static inline void ex_parse_flags(int argc, char **argv, const char *about, ex_flag *flags, int n)
{
    const char *prog = ex_prog_name(argc > 0 ? argv[0] : "example");
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            ex_print_usage(stdout, prog, about, flags, n);
            exit(0);
        }
    }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *eq = strchr(a, '=');
        size_t len = eq ? (size_t)(eq - a) : strlen(a);
        ex_flag *fl = NULL;
        for (int k = 0; k < n && !fl; k++)
            if (strlen(flags[k].name) == len && !strncmp(flags[k].name, a, len)) fl = &flags[k];
        if (!fl) {
            fprintf(stderr, "%s: unknown %s '%.*s' (--help lists the flags)\n", prog, a[0] == '-' ? "flag" : "argument",
                    (int)len, a);
            exit(2);
        }
        const char *v = eq ? eq + 1 : (i + 1 < argc ? argv[++i] : NULL);
        if (!v) {
            fprintf(stderr, "%s: %s needs a value (%s %s)\n", prog, fl->name, fl->name, fl->metavar);
            exit(2);
        }
        if (ex_parse_value(prog, fl, v)) exit(2);
        fl->given = true;
    }
}

/* Whether the flag `name` was given on the command line. */
static inline bool ex_flag_given(const ex_flag *flags, int n, const char *name)
{
    for (int i = 0; i < n; i++)
        if (!strcmp(flags[i].name, name)) return flags[i].given;
    return false;
}

/* ------------------------------------------------------------ files */

/* Opens `path` (given to `flag`) for reading if it is a regular file:
 * a directory, a FIFO or a device is refused before anything could block
 * on it (stat first; the open is non-blocking and checked again with
 * fstat). Returns the descriptor, or -1 after printing why. */
static inline int ex_open_regular(const char *prog, const char *flag, const char *path)
{
    struct stat sb;
    if (stat(path, &sb) != 0) {
        fprintf(stderr, "%s: %s '%s': %s\n", prog, flag, path, strerror(errno));
        return -1;
    }
    int fd = -1;
    if (S_ISREG(sb.st_mode)) fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd >= 0 && (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode))) {
        close(fd);
        fd = -1;
        errno = 0;
    }
    if (fd < 0) {
        const char *what = S_ISDIR(sb.st_mode)           ? "is a directory, not a file"
            : S_ISFIFO(sb.st_mode)                       ? "is a FIFO (named pipe), not a regular file"
            : S_ISSOCK(sb.st_mode)                       ? "is a socket, not a regular file"
            : S_ISCHR(sb.st_mode) || S_ISBLK(sb.st_mode) ? "is a device, not a regular file"
            : !S_ISREG(sb.st_mode)                       ? "is not a regular file"
                                                         : NULL;
        if (what) fprintf(stderr, "%s: %s '%s' %s\n", prog, flag, path, what);
        else fprintf(stderr, "%s: %s '%s': %s\n", prog, flag, path, strerror(errno ? errno : EINVAL));
        return -1;
    }
    return fd;
}

/* Checks that `path` names a readable regular file (see ex_open_regular);
 * 0, or -1 after printing why. */
static inline int ex_check_regular(const char *prog, const char *flag, const char *path)
{
    int fd = ex_open_regular(prog, flag, path);
    if (fd < 0) return -1;
    close(fd);
    return 0;
}

/* Reads the whole regular file `path` (given to `flag`) into a malloc'd
 * NUL-terminated buffer; NULL after printing why. */
static inline char *ex_read_file(const char *prog, const char *flag, const char *path, size_t *len)
{
    int fd = ex_open_regular(prog, flag, path);
    if (fd < 0) return NULL;
    struct stat sb;
    char *buf = NULL;
    if (fstat(fd, &sb) == 0 && (uintmax_t)sb.st_size < SIZE_MAX / 2) buf = malloc((size_t)sb.st_size + 1);
    if (!buf) {
        fprintf(stderr, "%s: %s '%s': cannot hold %lld bytes in memory\n", prog, flag, path, (long long)sb.st_size);
        close(fd);
        return NULL;
    }
    size_t got = 0, want = (size_t)sb.st_size;
    while (got < want) {
        ssize_t r = read(fd, buf + got, want - got);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            fprintf(stderr, "%s: %s '%s': %s\n", prog, flag, path, strerror(errno));
            free(buf);
            close(fd);
            return NULL;
        }
        if (r == 0) break; /* shrank while read */
        got += (size_t)r;
    }
    close(fd);
    buf[got] = '\0';
    *len = got;
    return buf;
}

/* Checks, before any work, that a file can be written at `path` (given to
 * `flag`): its folder exists and accepts a new file (probed by creating
 * and removing one, which also catches read-only file systems), and the
 * path is not a directory. 0, or -1 after printing why. */
static inline int ex_check_writable(const char *prog, const char *flag, const char *path)
{
    char dir[4096];
    const char *slash = strrchr(path, '/');
    if (!slash) snprintf(dir, sizeof dir, ".");
    else if (slash == path) snprintf(dir, sizeof dir, "/");
    else snprintf(dir, sizeof dir, "%.*s", (int)(slash - path), path);
    struct stat sb;
    if (stat(dir, &sb) != 0) {
        fprintf(stderr, "%s: %s '%s': the folder '%s' %s\n", prog, flag, path, dir,
                errno == ENOENT ? "does not exist" : strerror(errno));
        return -1;
    }
    if (!S_ISDIR(sb.st_mode)) {
        fprintf(stderr, "%s: %s '%s': '%s' is not a folder\n", prog, flag, path, dir);
        return -1;
    }
    if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode)) {
        fprintf(stderr, "%s: %s '%s' is a directory: give a file name\n", prog, flag, path);
        return -1;
    }
    char probe[4200];
    snprintf(probe, sizeof probe, "%s/.%s-write-check-XXXXXX", dir, prog);
    int fd = mkstemp(probe);
    if (fd < 0) {
        fprintf(stderr, "%s: %s '%s': the folder '%s' is not writable: %s\n", prog, flag, path, dir, strerror(errno));
        return -1;
    }
    close(fd);
    unlink(probe);
    return 0;
}

/* "12.3 MiB", "4.0 GiB", ... into buf; returns buf. */
static inline const char *ex_fmt_bytes(double b, char *buf, size_t cap)
{
    static const char *unit[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
    int u = 0;
    while (b >= 1024.0 && u < 6) {
        b /= 1024.0;
        u++;
    }
    snprintf(buf, cap, "%.1f %s", b, unit[u]);
    return buf;
}

/* Physical memory of this machine, bytes (0 if unknown). */
static inline double ex_physical_memory(void)
{
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    return pages > 0 && page > 0 ? (double)pages * (double)page : 0.0;
}

#endif
