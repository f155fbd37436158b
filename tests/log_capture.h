/* Capturing what the library logs (base/log.c writes each line to stderr
 * with one call) in a test: redirect file descriptor 2 into a temporary
 * file, run the code, then read the file back. The log level is raised to
 * at least `level` meanwhile (the suites run with TS_LOG_LEVEL=error). */
#ifndef TS_TEST_LOG_CAPTURE_H
#define TS_TEST_LOG_CAPTURE_H

#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "base/base.h"

typedef struct th_log_capture {
    int saved_fd;
    FILE *file;
    ts_log_level saved_level;
} th_log_capture;

static inline void th_log_capture_begin(th_log_capture *c, ts_log_level level)
{
    fflush(stderr);
    c->file = tmpfile();
    cr_assert_not_null(c->file, "tmpfile failed");
    c->saved_fd = dup(2);
    cr_assert_geq(c->saved_fd, 0);
    cr_assert_geq(dup2(fileno(c->file), 2), 0);
    c->saved_level = ts_log_get_level();
    if (c->saved_level < level) ts_log_set_level(level);
}

/* Restores stderr and the level; returns what was written (malloc'd,
 * NUL-terminated). */
static inline char *th_log_capture_end(th_log_capture *c)
{
    fflush(stderr);
    dup2(c->saved_fd, 2);
    close(c->saved_fd);
    ts_log_set_level(c->saved_level);
    long n = ftell(c->file);
    cr_assert_geq(n, 0);
    char *text = malloc((size_t)n + 1);
    cr_assert_not_null(text);
    rewind(c->file);
    size_t got = fread(text, 1, (size_t)n, c->file);
    text[got] = '\0';
    fclose(c->file);
    return text;
}

#endif
