/* Shared helpers for the Criterion suites. */
#ifndef TS_TEST_HELPERS_H
#define TS_TEST_HELPERS_H

#include "tensorshard.h"

/* Builds a tensor from doubles (converted to dtype). Aborts the test on
 * failure (cr_assert). */
ts_tensor *th_tensor(ts_dtype dtype, int ndim, const int64_t *shape, const double *vals);
/* A tensor filled from a simple deterministic sequence (values in about
 * [-1, 1], distinct per element), requiring grad if `rg`. */
ts_tensor *th_seq(ts_dtype dtype, int ndim, const int64_t *shape, double scale, bool rg);
/* Asserts same shape and |a-b| <= atol + rtol*|b| elementwise; reports the
 * first bad index. */
void th_assert_close(const ts_tensor *a, const ts_tensor *b, double rtol, double atol);
/* Asserts a status is TS_OK, printing ts_last_error() otherwise. */
#define TH_OK(expr)                                                                            \
    do {                                                                                       \
        ts_status th_s_ = (expr);                                                              \
        cr_assert_eq(th_s_, TS_OK, "%s -> %s: %s", #expr, ts_status_name(th_s_), ts_last_error()); \
    } while (0)

/* Live-memory bookkeeping: th_mem_mark() records the live bytes of every
 * tag; th_mem_assert_back() asserts each is back at the mark. */
void th_mem_mark(void);
void th_mem_assert_back(void);

/* Gradient check by central finite differences in float64. `fn` computes
 * one output from the inputs (all f64). The check backpropagates a fixed
 * random-like cotangent and compares every input's gradient with
 * (f(x+eps) - f(x-eps)) / 2eps. Inputs that do not require grad are
 * skipped. */
typedef ts_status (*th_fn)(ts_tensor **inputs, ts_tensor **out, void *ctx);
void th_gradcheck(th_fn fn, int n, ts_tensor **inputs, void *ctx, double eps, double atol, double rtol);

/* Reads a whole file (fixtures); returns malloc'd bytes, length in len. */
void *th_read_file(const char *path, size_t *len);

#endif
