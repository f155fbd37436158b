#define _GNU_SOURCE
#include "base/base.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

static atomic_int level = -1;

static int level_from_env(void)
{
    const char *e = getenv("TS_LOG_LEVEL");
    if (!e || !*e) return TS_LOG_WARN;
    static const char *const names[] = {"error", "warn", "info", "debug", "trace"};
    for (int i = 0; i < 5; i++)
        if (strcasecmp(e, names[i]) == 0) return i;
    if (strcasecmp(e, "warning") == 0) return TS_LOG_WARN;
    char *end;
    long v = strtol(e, &end, 10);
    if (*end == '\0' && v >= 0 && v <= 4) return (int)v;
    fprintf(stderr, "[ts WARN] TS_LOG_LEVEL=%s is not one of error, warn, info, debug, trace; using warn\n", e);
    return TS_LOG_WARN;
}

ts_log_level ts_log_get_level(void)
{
    int l = atomic_load_explicit(&level, memory_order_relaxed);
    if (l < 0) {
        l = level_from_env();
        int expected = -1;
        if (!atomic_compare_exchange_strong(&level, &expected, l)) l = expected;
    }
    return (ts_log_level)l;
}

void ts_log_set_level(ts_log_level l)
{
    if ((int)l < TS_LOG_ERROR) l = TS_LOG_ERROR;
    if (l > TS_LOG_TRACE) l = TS_LOG_TRACE;
    atomic_store(&level, (int)l);
}

void ts_logf(ts_log_level l, const char *fmt, ...)
{
    if (!fmt) return;
    if (!TS_LOG_ENABLED(l)) return;
    static const char *const tags[] = {"ERROR", "WARN", "INFO", "DEBUG", "TRACE"};
    char line[2048];
    va_list ap;
    va_start(ap, fmt);
    int n = snprintf(line, sizeof line, "[ts %s] ", tags[l]);
    vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
    va_end(ap);
    /* one write per line, so that lines of several threads never mix */
    fprintf(stderr, "%s\n", line);
}
