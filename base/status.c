#define _GNU_SOURCE
#include "base/base.h"
#include "base/internal.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

_Static_assert(TS_OK == 0, "TS_OK must be 0");

#define TS__COUNT_ONE(name, value, msg) +1
_Static_assert((0 TS_STATUS_TABLE(TS__COUNT_ONE)) == TS_STATUS_COUNT, "TS_STATUS_COUNT is stale");
#undef TS__COUNT_ONE

const char *ts_status_name(ts_status s)
{
    switch (s) {
#define TS__NAME_CASE(name, value, msg) \
    case name: return #name;
        TS_STATUS_TABLE(TS__NAME_CASE)
#undef TS__NAME_CASE
    }
    return "TS_UNKNOWN_STATUS";
}

const char *ts_status_str(ts_status s)
{
    switch (s) {
#define TS__STR_CASE(name, value, msg) \
    case name: return msg;
        TS_STATUS_TABLE(TS__STR_CASE)
#undef TS__STR_CASE
    }
    return "unknown status";
}

#define TS__ERRBUF 1024
static _Thread_local char tl_error[TS__ERRBUF];
static _Thread_local ts_status tl_status = TS_OK;

const char *ts_last_error(void) { return tl_error; }
ts_status ts_last_status(void) { return tl_status; }

/* The depth of quiet brackets on this thread (ts__error_quiet_begin). */
static _Thread_local int tl_quiet;

void ts__error_quiet_begin(void) { tl_quiet++; }

void ts__error_quiet_end(void)
{
    TS_ASSERT(tl_quiet > 0);
    tl_quiet--;
}

void ts_clear_error(void)
{
    if (tl_quiet) return;
    tl_error[0] = '\0';
    tl_status = TS_OK;
}

ts_status ts_error(ts_status s, const char *fmt, ...)
{
    if (tl_quiet) { /* a teardown path: the caller's error stays */
        if (fmt && TS_LOG_ENABLED(TS_LOG_DEBUG)) {
            char buf[sizeof tl_error];
            va_list ap;
            va_start(ap, fmt);
            vsnprintf(buf, sizeof buf, fmt, ap);
            va_end(ap);
            ts_logf(TS_LOG_DEBUG, "%s (quiet): %s", ts_status_name(s), buf);
        }
        return s;
    }
    if (!fmt) {
        tl_error[0] = '\0';
        tl_status = s;
        return s;
    }
    /* Format into a local buffer first: callers may pass ts_last_error()
     * (this very buffer) as an argument when they wrap an error. */
    char buf[sizeof tl_error];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    memcpy(tl_error, buf, sizeof buf);
    tl_status = s;
    ts_logf(TS_LOG_DEBUG, "%s: %s", ts_status_name(s), tl_error);
    return s;
}

static void default_abort(const char *msg, void *ctx)
{
    (void)ctx;
    fprintf(stderr, "tensorshard: internal error: %s\n", msg);
    fflush(stderr);
}

static ts_abort_fn abort_fn = default_abort;
static void *abort_ctx;

ts_abort_fn ts_set_abort_hook(ts_abort_fn fn, void *ctx)
{
    ts_abort_fn prev = abort_fn;
    abort_fn = fn ? fn : default_abort;
    abort_ctx = fn ? ctx : NULL;
    return prev;
}

void ts__assert_fail(const char *expr, const char *file, int line)
{
    char msg[512];
    snprintf(msg, sizeof msg, "assertion failed: %s (%s:%d)", expr, file, line);
    abort_fn(msg, abort_ctx);
    abort();
}
