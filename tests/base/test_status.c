#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdlib.h>
#include <string.h>

#include "base/internal.h"
#include "tests/helpers.h"

Test(base_status, ok_is_zero_and_errors_negative)
{
    cr_assert_eq(TS_OK, 0);
#define CHECK_NEG(name, value, msg) \
    if (name != TS_OK) cr_assert_lt(name, 0, "%s must be negative", #name);
    TS_STATUS_TABLE(CHECK_NEG)
#undef CHECK_NEG
}

Test(base_status, names_and_messages_come_from_the_table)
{
    cr_assert_str_eq(ts_status_name(TS_OK), "TS_OK");
    cr_assert_str_eq(ts_status_name(TS_ERR_SHAPE), "TS_ERR_SHAPE");
    cr_assert_str_eq(ts_status_str(TS_ERR_SHAPE), "shape mismatch");
    cr_assert_str_eq(ts_status_name((ts_status)-999), "TS_UNKNOWN_STATUS");
    cr_assert_str_eq(ts_status_str((ts_status)-999), "unknown status");
    /* every status has a distinct name */
    const char *names[TS_STATUS_COUNT];
    int k = 0;
#define COLLECT(name, value, msg) names[k++] = ts_status_name(name);
    TS_STATUS_TABLE(COLLECT)
#undef COLLECT
    cr_assert_eq(k, TS_STATUS_COUNT);
    for (int i = 0; i < k; i++)
        for (int j = i + 1; j < k; j++) cr_assert_str_neq(names[i], names[j]);
}

Test(base_status, last_error_is_thread_local_detail)
{
    ts_clear_error();
    cr_assert_str_eq(ts_last_error(), "");
    cr_assert_eq(ts_last_status(), TS_OK);
    ts_status s = ts_error(TS_ERR_SHAPE, "op: %d vs %d", 3, 4);
    cr_assert_eq(s, TS_ERR_SHAPE);
    cr_assert_str_eq(ts_last_error(), "op: 3 vs 4");
    cr_assert_eq(ts_last_status(), TS_ERR_SHAPE);
    ts_clear_error();
    cr_assert_str_eq(ts_last_error(), "");
}

static jmp_buf jb;
static char seen[512];

static void jump_hook(const char *msg, void *ctx)
{
    (void)ctx;
    strncpy(seen, msg, sizeof seen - 1);
    longjmp(jb, 1);
}

Test(base_status, assert_goes_through_the_abort_hook)
{
    ts_set_abort_hook(jump_hook, NULL);
    volatile int reached = 0;
    if (setjmp(jb) == 0) {
        TS_ASSERT(1 + 1 == 3);
        reached = 1;
    }
    ts_set_abort_hook(NULL, NULL);
    cr_assert_eq(reached, 0, "the assert did not fire");
    cr_assert(strstr(seen, "1 + 1 == 3") != NULL, "message: %s", seen);
    cr_assert(strstr(seen, "test_status.c") != NULL, "message: %s", seen);
}

static void info_env(void) { setenv("TS_LOG_LEVEL", "info", 1); }

/* Each Criterion test runs in a fresh worker process, so the level is read
 * from the environment set by .init. */
Test(base_status, log_level_from_environment_and_override, .init = info_env)
{
    cr_assert_eq(ts_log_get_level(), TS_LOG_INFO);
    ts_log_set_level(TS_LOG_DEBUG);
    cr_assert(TS_LOG_ENABLED(TS_LOG_DEBUG));
    cr_assert(!TS_LOG_ENABLED(TS_LOG_TRACE));
    ts_log_set_level(TS_LOG_ERROR);
    cr_assert(!TS_LOG_ENABLED(TS_LOG_WARN));
}

/* Wrapping the last error in a new one (ts_error(s, "...: %s",
 * ts_last_error())) reads the buffer it writes: the message must come out
 * whole. */
Test(base_status, wrapping_the_last_error)
{
    ts_error(TS_ERR_IO, "inner problem with %s", "file.bin");
    ts_error(TS_ERR_COMM, "outer: %s (again: %s)", ts_last_error(), ts_last_error());
    cr_assert_str_eq(ts_last_error(), "outer: inner problem with file.bin (again: inner problem with file.bin)");
    cr_assert_eq(ts_last_status(), TS_ERR_COMM);
}

/* The quiet bracket (ts__error_quiet_begin/end): teardown paths run in
 * one, so that the error they follow keeps its detail. */
Test(base_status, quiet_bracket_keeps_the_last_error_and_returns_the_status)
{
    ts_error(TS_ERR_SHAPE, "the first error");
    ts__error_quiet_begin();
    cr_assert_eq(ts_error(TS_ERR_IO, "a teardown's error %d", 7), TS_ERR_IO);
    cr_assert_eq(ts_error(TS_ERR_COMM, NULL), TS_ERR_COMM);
    ts_clear_error();
    cr_assert_str_eq(ts_last_error(), "the first error");
    cr_assert_eq(ts_last_status(), TS_ERR_SHAPE);
    ts__error_quiet_end();
    /* out of the bracket: written again */
    cr_assert_eq(ts_error(TS_ERR_IO, "after"), TS_ERR_IO);
    cr_assert_str_eq(ts_last_error(), "after");
    cr_assert_eq(ts_last_status(), TS_ERR_IO);
    ts_clear_error();
}

Test(base_status, quiet_brackets_nest)
{
    ts_clear_error();
    ts__error_quiet_begin();
    ts__error_quiet_begin();
    ts_error(TS_ERR_IO, "inner");
    ts__error_quiet_end();
    ts_error(TS_ERR_IO, "outer, still quiet");
    cr_assert_eq(ts_last_status(), TS_OK);
    cr_assert_str_eq(ts_last_error(), "");
    ts__error_quiet_end();
    ts_error(TS_ERR_STATE, "loud");
    cr_assert_eq(ts_last_status(), TS_ERR_STATE);
    cr_assert_str_eq(ts_last_error(), "loud");
    ts_clear_error();
}

static void *quiet_on_another_thread(void *arg)
{
    (void)arg;
    ts_error(TS_ERR_IO, "the other thread's");
    static int written;
    written = ts_last_status() == TS_ERR_IO && strcmp(ts_last_error(), "the other thread's") == 0;
    return &written;
}

Test(base_status, quiet_bracket_is_per_thread)
{
    ts_clear_error();
    ts__error_quiet_begin();
    pthread_t th;
    int *got = NULL;
    cr_assert_eq(pthread_create(&th, NULL, quiet_on_another_thread, NULL), 0);
    cr_assert_eq(pthread_join(th, (void **)&got), 0);
    ts__error_quiet_end();
    cr_assert(got && *got, "a bracket on this thread quieted another thread");
}
