/* Shared helpers for the Criterion suites. */
#ifndef TS_TEST_HELPERS_H
#define TS_TEST_HELPERS_H

#include <jansson.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/types.h>

#include "tensorshard.h"

/* Held by a simulated rank thread while it seeds the global generator
 * and builds its model, so that every rank draws the same weights. */
extern pthread_mutex_t th_build_mu;
/* Sequential(Linear(in, h1), Tanh, Linear(h1, h2), Tanh, Linear(h2, out)),
 * with biases, built after ts_manual_seed(seed) under th_build_mu: the
 * root in *root (the caller frees it), its three Linears in lin. */
ts_status th_mlp3_new(uint64_t seed, int64_t in, int64_t h1, int64_t h2, int64_t out, ts_module **root,
                      ts_module *lin[3]);

/* A new uninitialized tensor (ts_tensor_empty), asserting success. */
ts_tensor *th_empty(ts_dtype dtype, int ndim, const int64_t *shape);
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
#define TH_OK(expr) \
    do { \
        ts_status th_s_ = (expr); \
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

/* Reads a whole file (fixtures); returns malloc'd bytes, length in len,
 * followed by a NUL byte (not counted). */
void *th_read_file(const char *path, size_t *len);
/* The whole content of fd (a memfd a launch wrote into), NUL-terminated,
 * malloc'd; asserts on failure. */
char *th_slurp_fd(int fd);

/* ------------------------------------------------ values, shapes, checks */

/* Gradcheck settings of the op suites: central differences in float64 with
 * eps 1e-6 have truncation error ~eps^2 * f''' (1e-12) and rounding
 * ~1e-16 * |f| / eps (1e-10), so 1e-6 absolute plus 1e-5 relative leaves a
 * wide margin while a wrong gradient is off by O(1). */
#define TH_GC_EPS 1e-6
#define TH_GC_ATOL 1e-6
#define TH_GC_RTOL 1e-5

/* Copies the n values of t (asserting numel(t) == n), converted to double
 * with grad mode off, into buf in row-major order. */
void th_vals(const ts_tensor *t, double *buf, int64_t n);
/* Like th_vals, into a new malloc'd array of numel(t) doubles (free it). */
double *th_vals_new(const ts_tensor *t);
/* Asserts t has ndim dims of sizes shape, naming the first that differs. */
void th_assert_shape(const ts_tensor *t, int ndim, const int64_t *shape);
/* The float32 whose bits are u, and the bits of f (bit casts). */
float th_f32_of(uint32_t u);
uint32_t th_f32_bits(float f);

/* A tiny linear congruential generator: advances *st, returns its top 24 bits. */
uint32_t th_lcg(uint32_t *st);
/* Runs fn (forward, then backward of th_seq(out's dtype and shape,
 * cot_scale)) on fresh clones requiring grad of the n <= 8 inputs, once with
 * the optimized kernels and once with the reference ones, and asserts
 * th_assert_close(optimized, reference) on the outputs with out_rtol /
 * out_atol and on each input's gradients with grad_rtol / grad_atol. */
void th_assert_kernels_agree(th_fn fn, int n, ts_tensor **inputs, void *ctx, double cot_scale, double out_rtol,
                             double out_atol, double grad_rtol, double grad_atol);

/* ---------------------------------------- torch fixture vectors (rng/) */

/* Reads TS_FIXTURES_DIR/rng/FILE whole into a malloc'd buffer (len bytes
 * plus a terminating NUL); fails the test if it cannot. */
uint8_t *th_fixture_read(const char *file, size_t *len);

/* A vector file NAME.bin: the raw little-endian values of one or more
 * tensors, concatenated; consumed front to back. */
typedef struct th_vec {
    char name[128];
    uint8_t *buf;
    size_t len;
    size_t pos;
} th_vec;

/* Opens the vector rng/NAME.bin (read whole, position 0). */
th_vec th_vec_open(const char *name);
/* The next nbytes of the vector, asserting that they are there. */
const uint8_t *th_vec_take(th_vec *v, size_t nbytes);
/* Asserts that the whole vector was consumed, and frees it. */
void th_vec_close(th_vec *v);
/* Compares n elements of dtype dt in got and want bit for bit; fails
 * naming the first difference (both values printed with their bits). */
void th_vec_expect_bytes(const char *what, ts_dtype dt, const void *got, const void *want, int64_t n);
/* Compares the next numel values of the vector with t (row-major). */
void th_vec_expect_tensor(th_vec *v, const ts_tensor *t, const char *what);
/* th_vec_expect_tensor, then frees t. */
void th_vec_expect_free(th_vec *v, ts_tensor *t, const char *what);

/* Expects `expr` to fail with `status` and a detail containing each of
 * the (one or more) strings. */
#define TH_FAILS(expr, status, ...) \
    do { \
        ts_status th_fs_ = (expr); \
        cr_assert_eq(th_fs_, (status), "%s -> %s, expected %s (%s)", #expr, ts_status_name(th_fs_), \
                     ts_status_name(status), ts_last_error()); \
        const char *th_want_[] = {__VA_ARGS__, NULL}; \
        for (int th_i_ = 0; th_want_[th_i_]; th_i_++) \
            cr_assert_not_null(strstr(ts_last_error(), th_want_[th_i_]), "%s: detail \"%s\" lacks \"%s\"", #expr, \
                               ts_last_error(), th_want_[th_i_]); \
    } while (0)

/* CRC-32 (IEEE 802.3, reflected, as zlib.crc32) of n bytes at p, continued
 * from `crc` (0 to start). */
uint32_t th_crc32(uint32_t crc, const void *p, size_t n);
/* The CRC that the rng fixture text FILE (lines "NAME HEX", '#' comments)
 * gives for `name`; fails the test if it has none. */
uint32_t th_fixture_crc(const char *file, const char *name);

/* ------------------------------------------------ processes and ranks */

/* Seconds on the monotonic clock. */
double th_now_s(void);
/* CPU seconds (user and system) this process has used. */
double th_cpu_s(void);
/* The path of this test binary (a static buffer), to start it again as a
 * rank or a helper process. */
char *th_self_exe(void);
/* A TCP port on 127.0.0.1 that was free a moment ago. */
int th_free_port(void);
/* Waits for the n processes pids[0..n) but `skip` (-1: none), putting each
 * wait status in status[i], until limit_s seconds from now; then kills
 * every one not yet reaped (`skip` too), reaps them and fails the test
 * naming the first rank that did not finish. */
void th_wait_pids(const pid_t *pids, int n, int skip, double limit_s, int *status);
/* A calloc'd copy of `environ` without the variables that start with one
 * of the prefixes drop[0..n_drop) ("NAME="), with room for `extra` more
 * entries and the NULL after them; *n_out is the number kept (where the
 * caller appends). */
char **th_environ_without(const char *const *drop, size_t n_drop, size_t extra, size_t *n_out);
/* th_environ_without for a job a test starts with tools/tsrun: environ
 * without the variables that would make the job take itself for (part of)
 * another launch or trace (TS_TRACE, RANK, WORLD_SIZE, LOCAL_RANK,
 * LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, OMPI_COMM_WORLD_RANK,
 * SLURM_PROCID, TS_LAUNCHER_PID, TS_STORE_HOSTED), room for `extra` more
 * entries; the caller frees it. */
char **th_job_environ(size_t extra, size_t *n_out);
/* Runs this test binary (th_self_exe) on W ranks under
 * build_dir/tools/tsrun (pass TS_BUILD_DIR) with th_job_environ plus `role` ("VAR=1": the rank's
 * role variable) and TS_DIST_TIMEOUT=120, its stdout and stderr in one
 * memfd; asserts that tsrun exited 0 (printing the output otherwise) and
 * returns the output (the caller frees it). */
char *th_tsrun_self(const char *build_dir, int W, const char *role);
/* Unsets the variables a launcher or scheduler sets for a rank (RANK,
 * WORLD_SIZE, MASTER_ADDR, ...), so a test starts from none of them. */
void th_clear_launch_env(void);
/* Starts W ranks of this test binary mpirun-style, without a launcher
 * (OMPI_COMM_WORLD_* variables; rank 0 hosts the store on a free
 * MASTER_PORT), with role_var=role in their environment and each rank's
 * stderr in a memfd: pid[r] and err_fd[r] (the caller closes it). Clears
 * the launch variables and UCX_LOG_LEVEL first (the library decides what
 * UCX prints), and unsets what it set after. */
void th_spawn_mpi_ranks(int W, const char *role_var, const char *role, pid_t *pid, int *err_fd);
/* Runs this test binary (th_self_exe) on W local ranks with ts_launch,
 * signals not forwarded and output inherited, and waits for them: their
 * result in *res; asserts that ts_launch itself returned TS_OK. Call
 * th_clear_launch_env and set the ranks' role variables first. */
void th_launch_self(int W, ts_launch_result *res);
/* Runs the program at `path` with the NULL-terminated args (NULL: none;
 * at most 62) on `nproc` local ranks through ts_launch, as tsrun does
 * (signals not forwarded), after th_clear_launch_env: returns the job's
 * exit code, the relayed stdout and stderr ("[r] line" lines) in *out and
 * *err (malloc'd: the caller frees them) and, when res is not NULL, the
 * launch result. Asserts that ts_launch itself returned TS_OK. */
int th_launch_capture(const char *path, int nproc, const char *const *args, ts_launch_result *res, char **out,
                      char **err);
/* In a rank process: unless `expr` gives TS_OK, prints "EXPR -> STATUS:
 * detail" on stderr and exits with `code` (the test reads the rank's exit
 * code). */
#define TH_RANK_OK(code, expr) th_rank_check((code), #expr, (expr))
void th_rank_check(int code, const char *expr, ts_status s);
/* In a rank process: prints "rank RANK: MESSAGE (last error)" on stderr
 * (MESSAGE formatted from fmt) and exits with `code`. */
_Noreturn void th_rank_exit(int rank, int code, const char *fmt, ...) TS_PRINTF(3, 4);

/* ------------------------------------------------ half-precision nn fixtures */

/* The integer member `key` of a fixture's JSON object; fails the test when
 * it is missing or not an integer. */
int64_t th_json_int(json_t *obj, const char *key);

/* One group of tests/fixtures/half/nn/index.json and its blob of tensors
 * (group is borrowed from root). th_half_fx_open loads the index and the
 * group's blob and fails the test when either or the group is missing;
 * th_half_fx_close frees both. th_half_fx_tensor returns a new tensor (the
 * caller frees it) with the dtype, shape and bytes of the group's tensor
 * `name`; it fails the test when the tensor is missing, its dtype unknown,
 * its offset or size not integers, or its bytes outside the blob. */
typedef struct th_half_fx {
    json_t *root, *group;
    uint8_t *blob;
    size_t len;
} th_half_fx;
void th_half_fx_open(th_half_fx *f, const char *group);
void th_half_fx_close(th_half_fx *f);
ts_tensor *th_half_fx_tensor(const th_half_fx *f, const char *name);

/* The fully_shard suites' deterministic data: element (r, j) of a fixed
 * global input batch (th_xval, about sin) and target batch (th_yval). */
double th_xval(int64_t r, int64_t j);
double th_yval(int64_t r, int64_t j);
/* Rows [row0, row0 + rows) of the global batch f as a new f32 tensor
 * (rows, cols), owned by the caller (ts_tensor_free); NULL when it cannot
 * be allocated (ts_last_error() says why). */
ts_tensor *th_batch(int64_t row0, int64_t rows, int64_t cols, double (*f)(int64_t, int64_t));
/* m's n parameters, in ts_module_named_parameters order, into ps
 * (borrowed); TS_ERR_INTERNAL naming both counts when m has another
 * number of them (ps then holds the first min(count, n)). */
ts_status th_param_slots(ts_module *m, int n, ts_tensor **ps);

/* "Flaky", a test module around one child Linear(4, 4) "fc" (its
 * parameters drawn from the default generator): its forward calls fc, but
 * fails with TS_ERR_STATE ("Flaky: injected failure at call N") at call
 * number fail_at (0: never), to make a recompute or a step fail. */
typedef struct th_flaky {
    ts_module base;
    ts_module *fc;
    int calls, fail_at;
} th_flaky;
/* A new Flaky module with fail_at 0, owned by the caller (ts_module_free);
 * the status of the allocation, ts_module_init or ts_linear_new that
 * failed, nothing made then. */
ts_status th_flaky_new(th_flaky **out);

/* One forward of `root` on x, the mean-squared-error loss against y and
 * its backward (gradients accumulate into the parameters); the first
 * failing status. x and y stay the caller's. */
ts_status th_mse_backward(ts_module *root, ts_tensor *x, ts_tensor *y);
/* The same on rows [row0, row0 + rows) of the global batches th_xval
 * (in columns) and th_yval (out columns); TS_ERR_NO_MEMORY when they
 * cannot be made. */
ts_status th_mse_backward_rows(ts_module *root, int64_t row0, int64_t rows, int64_t in, int64_t out);

/* A new folder /tmp/<tag>.XXXXXX (mkdtemp), as a malloc'd path the
 * caller frees; the test fails when it cannot be made. */
char *th_tmp_dir(const char *tag);
/* Removes `dir`, its files and its empty subfolders (one level: what a
 * checkpoint or trace test leaves). Missing: nothing happens. */
void th_rm_rf(const char *dir);

#endif
