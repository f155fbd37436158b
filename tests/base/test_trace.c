#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "tests/helpers.h"

static void *worker(void *arg)
{
    (void)arg;
    ts_trace_thread_name("worker");
    uint64_t t0 = ts_now_ns();
    ts_trace_span("work", "test", t0, t0 + 2000);
    return NULL;
}

Test(base_trace, off_by_default_and_records_spans_when_started)
{
    cr_assert(!ts_trace_enabled(), "tracing must be off unless TS_TRACE is set");
    ts_trace_span("ignored", "test", 0, 10);
    char path[] = "/tmp/ts_trace_XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    close(fd);
    TH_OK(ts_trace_start(path));
    cr_assert(ts_trace_enabled());
    uint64_t t0 = ts_now_ns();
    ts_trace_span("step", "test", t0, t0 + 5000);
    TS_TRACE_BEGIN(tb);
    TS_TRACE_END(tb, "scoped", "test");
    pthread_t th;
    pthread_create(&th, NULL, worker, NULL);
    pthread_join(th, NULL);
    cr_assert_eq(ts_trace_total_ns("step"), 5000);
    cr_assert_eq(ts_trace_total_ns("ignored"), 0);
    TH_OK(ts_trace_flush());

    json_error_t err;
    json_t *root = json_load_file(path, 0, &err);
    cr_assert_not_null(root, "trace is not valid JSON: %s", err.text);
    json_t *ev = json_object_get(root, "traceEvents");
    cr_assert(json_is_array(ev));
    int steps = 0, works = 0, names = 0;
    size_t i;
    json_t *e;
    json_array_foreach(ev, i, e)
    {
        const char *name = json_string_value(json_object_get(e, "name"));
        const char *ph = json_string_value(json_object_get(e, "ph"));
        if (strcmp(name, "step") == 0) {
            steps++;
            cr_assert_str_eq(ph, "X");
            cr_assert_float_eq(json_number_value(json_object_get(e, "dur")), 5.0, 1e-9);
        }
        if (strcmp(name, "work") == 0)
            works++;
        if (strcmp(name, "thread_name") == 0 &&
            strcmp(json_string_value(json_object_get(json_object_get(e, "args"), "name")), "worker") == 0)
            names++;
    }
    cr_assert_eq(steps, 1);
    cr_assert_eq(works, 1, "spans of other threads are written too");
    cr_assert_eq(names, 1);
    json_decref(root);
    TH_OK(ts_trace_stop(false));
    cr_assert(!ts_trace_enabled());
    unlink(path);
}

Test(base_trace, unwritable_path_is_an_io_error_at_start)
{
    cr_assert_eq(ts_trace_start("/nonexistent-dir/trace.json"), TS_ERR_IO);
    cr_assert(strstr(ts_last_error(), "/nonexistent-dir/trace.json") != NULL, "%s", ts_last_error());
    cr_assert(strstr(ts_last_error(), "No such file or directory") != NULL, "%s", ts_last_error());
    cr_assert(!ts_trace_enabled(), "nothing is recorded for a path that cannot be written");
    cr_assert_eq(ts_trace_start("/tmp"), TS_ERR_IO, "a directory is not a trace file");
    cr_assert_eq(ts_trace_flush(), TS_ERR_STATE);
    cr_assert_eq(ts_trace_start(""), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_trace_start(NULL), TS_ERR_INVALID_ARGUMENT);
}
