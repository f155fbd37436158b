#define _GNU_SOURCE
#include "tests/helpers.h"

#include "tensor/internal.h"

#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <sys/mman.h>
#include <spawn.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

ts_tensor *th_empty(ts_dtype dtype, int ndim, const int64_t *shape)
{
    ts_tensor *t;
    TH_OK(ts_tensor_empty(dtype, ndim, shape, &t));
    return t;
}

ts_tensor *th_tensor(ts_dtype dtype, int ndim, const int64_t *shape, const double *vals)
{
    ts_tensor *t;
    TH_OK(ts_tensor_empty(dtype, ndim, shape, &t));
    int64_t n = ts_tensor_numel(t);
    double *buf = NULL;
    size_t es = ts_dtype_size(dtype);
    char *raw = malloc((size_t)(n ? n : 1) * es);
    for (int64_t i = 0; i < n; i++) {
        switch (dtype) {
        case TS_F32: ((float *)raw)[i] = (float)vals[i]; break;
        case TS_F64: ((double *)raw)[i] = vals[i]; break;
        case TS_BF16: ((uint16_t *)raw)[i] = ts_f32_to_bf16((float)vals[i]); break;
        case TS_F16: ((uint16_t *)raw)[i] = ts_f32_to_f16((float)vals[i]); break;
        case TS_I64: ((int64_t *)raw)[i] = (int64_t)vals[i]; break;
        case TS_I32: ((int32_t *)raw)[i] = (int32_t)vals[i]; break;
        case TS_BOOL: ((uint8_t *)raw)[i] = vals[i] != 0; break;
        default: cr_assert_fail("bad dtype");
        }
    }
    ts_tensor_free(t);
    TH_OK(ts_tensor_from_data(dtype, ndim, shape, raw, &t));
    free(raw);
    free(buf);
    return t;
}

ts_tensor *th_seq(ts_dtype dtype, int ndim, const int64_t *shape, double scale, bool rg)
{
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= shape[i];
    double *v = malloc((size_t)(n ? n : 1) * sizeof *v);
    for (int64_t i = 0; i < n; i++) v[i] = scale * sin(0.7 * (double)i + 0.3) * (1.0 + 0.01 * (double)(i % 7));
    ts_tensor *t = th_tensor(dtype, ndim, shape, v);
    free(v);
    if (rg) TH_OK(ts_tensor_set_requires_grad(t, true));
    return t;
}

void th_vals(const ts_tensor *t, double *buf, int64_t n)
{
    cr_assert_eq(ts_tensor_numel(t), n, "numel %lld, expected %lld", (long long)ts_tensor_numel(t), (long long)n);
    ts_tensor *d;
    bool prev = ts_grad_mode_set(false);
    TH_OK(ts_to_dtype((ts_tensor *)t, TS_F64, &d));
    ts_grad_mode_set(prev);
    TH_OK(ts_tensor_copy_to(d, buf, (size_t)n * sizeof *buf));
    ts_tensor_free(d);
}

double *th_vals_new(const ts_tensor *t)
{
    int64_t n = ts_tensor_numel(t);
    double *buf = malloc((size_t)(n ? n : 1) * sizeof *buf);
    th_vals(t, buf, n);
    return buf;
}

void th_assert_shape(const ts_tensor *t, int ndim, const int64_t *shape)
{
    char s[96];
    cr_assert_eq(ts_tensor_ndim(t), ndim, "ndim %d, expected %d (shape %s)", ts_tensor_ndim(t), ndim,
                 ts_tensor_shape_str(t, s, sizeof s));
    for (int i = 0; i < ndim; i++)
        cr_assert_eq(ts_tensor_shape(t)[i], shape[i], "dim %d is %lld, expected %lld (shape %s)", i,
                     (long long)ts_tensor_shape(t)[i], (long long)shape[i], ts_tensor_shape_str(t, s, sizeof s));
}

uint32_t th_lcg(uint32_t *st)
{
    *st = *st * 1664525u + 1013904223u;
    return *st >> 8;
}

void th_assert_close(const ts_tensor *a, const ts_tensor *b, double rtol, double atol)
{
    char s1[96], s2[96];
    cr_assert_eq(ts_tensor_ndim(a), ts_tensor_ndim(b), "ndim %d vs %d (%s vs %s)", ts_tensor_ndim(a), ts_tensor_ndim(b),
                 ts_tensor_shape_str(a, s1, sizeof s1), ts_tensor_shape_str(b, s2, sizeof s2));
    for (int i = 0; i < ts_tensor_ndim(a); i++)
        cr_assert_eq(ts_tensor_shape(a)[i], ts_tensor_shape(b)[i], "shape %s vs %s",
                     ts_tensor_shape_str(a, s1, sizeof s1), ts_tensor_shape_str(b, s2, sizeof s2));
    int64_t n = ts_tensor_numel(a);
    double *x = th_vals_new(a), *y = th_vals_new(b);
    for (int64_t i = 0; i < n; i++) {
        bool ok = fabs(x[i] - y[i]) <= atol + rtol * fabs(y[i]) || (isnan(x[i]) && isnan(y[i])) ||
            (isinf(x[i]) && x[i] == y[i]);
        if (!ok) {
            double xi = x[i], yi = y[i];
            free(x);
            free(y);
            cr_assert_fail("element %lld differs: %.9g vs %.9g (rtol %g, atol %g)", (long long)i, xi, yi, rtol, atol);
        }
    }
    free(x);
    free(y);
}

static size_t marks[TS_MEM_TAG_COUNT];

void th_mem_mark(void)
{
    for (int i = 0; i < TS_MEM_TAG_COUNT; i++) marks[i] = ts_mem_live_bytes((ts_mem_tag)i);
}

void th_mem_assert_back(void)
{
    for (int i = 0; i < TS_MEM_TAG_COUNT; i++) {
        if (i == TS_MEM_POOL) continue; /* the pool keeps freed blocks cached by design */
        size_t now = ts_mem_live_bytes((ts_mem_tag)i);
        cr_assert_eq(now, marks[i], "memory tag '%s': %zu live bytes, %zu at the mark (leak of %lld bytes)",
                     ts_mem_tag_name((ts_mem_tag)i), now, marks[i], (long long)now - (long long)marks[i]);
    }
}

static double weighted_sum(th_fn fn, int n, ts_tensor **inputs, void *ctx, const double *w, int64_t wn)
{
    ts_tensor *out;
    TH_OK(fn(inputs, &out, ctx));
    cr_assert_eq(ts_tensor_numel(out), wn, "gradcheck: output size changed");
    double *o = th_vals_new(out);
    double s = 0;
    for (int64_t i = 0; i < wn; i++) s += o[i] * w[i];
    free(o);
    ts_tensor_free(out);
    (void)n;
    return s;
}

void th_gradcheck(th_fn fn, int n, ts_tensor **inputs, void *ctx, double eps, double atol, double rtol)
{
    ts_tensor *out;
    TH_OK(fn(inputs, &out, ctx));
    int64_t wn = ts_tensor_numel(out);
    double *w = malloc((size_t)(wn ? wn : 1) * sizeof *w);
    for (int64_t i = 0; i < wn; i++) w[i] = 0.5 + 0.25 * cos(1.3 * (double)i);
    ts_tensor *wt = th_tensor(ts_tensor_dtype(out), ts_tensor_ndim(out), ts_tensor_shape(out), w);
    for (int i = 0; i < n; i++)
        if (inputs[i] && ts_tensor_requires_grad(inputs[i])) ts_tensor_zero_grad(inputs[i], true);
    if (ts_tensor_requires_grad(out)) TH_OK(ts_backward(out, wt, false));
    ts_tensor_free(wt);
    ts_tensor_free(out);
    bool prev = ts_grad_mode_set(false);
    for (int i = 0; i < n; i++) {
        ts_tensor *x = inputs[i];
        if (!x || !ts_tensor_requires_grad(x)) continue;
        cr_assert_eq(ts_tensor_dtype(x), TS_F64, "gradcheck inputs must be float64");
        cr_assert(ts_tensor_is_contiguous(x), "gradcheck inputs must be contiguous");
        int64_t m = ts_tensor_numel(x);
        double *xd = ts_tensor_data(x);
        ts_tensor *g = ts_tensor_grad(x);
        double *gd = g ? th_vals_new(g) : NULL;
        for (int64_t j = 0; j < m; j++) {
            double keep = xd[j];
            xd[j] = keep + eps;
            double fp = weighted_sum(fn, n, inputs, ctx, w, wn);
            xd[j] = keep - eps;
            double fm = weighted_sum(fn, n, inputs, ctx, w, wn);
            xd[j] = keep;
            double num = (fp - fm) / (2 * eps), ana = gd ? gd[j] : 0.0;
            if (!(fabs(num - ana) <= atol + rtol * fabs(num))) {
                free(gd);
                free(w);
                ts_grad_mode_set(prev);
                cr_assert_fail("gradcheck: input %d element %lld: analytic %.10g vs numeric %.10g", i, (long long)j,
                               ana, num);
            }
        }
        free(gd);
    }
    ts_grad_mode_set(prev);
    free(w);
}

void *th_read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "cannot open fixture %s", path);
    cr_assert_eq(fseek(f, 0, SEEK_END), 0);
    long n = ftell(f);
    cr_assert_geq(n, 0);
    cr_assert_eq(fseek(f, 0, SEEK_SET), 0);
    uint8_t *buf = malloc((size_t)n + 1);
    cr_assert_not_null(buf);
    cr_assert_eq(fread(buf, 1, (size_t)n, f), (size_t)n, "short read of %s", path);
    fclose(f);
    buf[n] = 0;
    *len = (size_t)n;
    return buf;
}

/* One side of th_assert_kernels_agree: output and gradients are new references. */
static void run_kernels(th_fn fn, int n, ts_tensor **inputs, void *ctx, bool reference, double cot_scale,
                        ts_tensor **out, ts_tensor **grads)
{
    ts_tensor *x[8];
    ts__use_reference_kernels = reference;
    for (int i = 0; i < n; i++) TH_OK(ts_clone(inputs[i], &x[i]));
    for (int i = 0; i < n; i++) TH_OK(ts_tensor_set_requires_grad(x[i], true));
    TH_OK(fn(x, out, ctx));
    ts_tensor *cot = th_seq(ts_tensor_dtype(*out), ts_tensor_ndim(*out), ts_tensor_shape(*out), cot_scale, false);
    TH_OK(ts_backward(*out, cot, false));
    for (int i = 0; i < n; i++) grads[i] = ts_tensor_retain(ts_tensor_grad(x[i]));
    ts_tensor_free(cot);
    for (int i = 0; i < n; i++) ts_tensor_free(x[i]);
    ts__use_reference_kernels = false;
}

void th_assert_kernels_agree(th_fn fn, int n, ts_tensor **inputs, void *ctx, double cot_scale, double out_rtol,
                             double out_atol, double grad_rtol, double grad_atol)
{
    ts_tensor *out[2], *grads[2][8];
    cr_assert(n > 0 && n <= 8, "th_assert_kernels_agree: %d inputs", n);
    for (int ref = 0; ref < 2; ref++) run_kernels(fn, n, inputs, ctx, ref, cot_scale, &out[ref], grads[ref]);
    th_assert_close(out[0], out[1], out_rtol, out_atol);
    for (int i = 0; i < n; i++) th_assert_close(grads[0][i], grads[1][i], grad_rtol, grad_atol);
    for (int ref = 0; ref < 2; ref++) {
        ts_tensor_free(out[ref]);
        for (int i = 0; i < n; i++) ts_tensor_free(grads[ref][i]);
    }
}

/* ------------------------------------------------ torch fixture vectors */

uint8_t *th_fixture_read(const char *file, size_t *len)
{
    char path[512];
    snprintf(path, sizeof path, "%s/rng/%s", TS_FIXTURES_DIR, file);
    return th_read_file(path, len);
}

th_vec th_vec_open(const char *name)
{
    th_vec v;
    char file[160];
    snprintf(v.name, sizeof v.name, "%s", name);
    snprintf(file, sizeof file, "%s.bin", name);
    v.buf = th_fixture_read(file, &v.len);
    v.pos = 0;
    return v;
}

const uint8_t *th_vec_take(th_vec *v, size_t nbytes)
{
    cr_assert_leq(v->pos + nbytes, v->len, "%s: wants %zu bytes at %zu of %zu", v->name, nbytes, v->pos, v->len);
    const uint8_t *p = v->buf + v->pos;
    v->pos += nbytes;
    return p;
}

void th_vec_close(th_vec *v)
{
    cr_assert_eq(v->pos, v->len, "%s: %zu of %zu bytes compared", v->name, v->pos, v->len);
    free(v->buf);
    v->buf = NULL;
}

/* One element of dt at p, as its value and its bits. */
static void describe_bits(ts_dtype dt, const uint8_t *p, char *out, size_t len)
{
    switch (dt) {
    case TS_F32: {
        float f;
        uint32_t u;
        memcpy(&f, p, 4);
        memcpy(&u, p, 4);
        snprintf(out, len, "%.9g (0x%08" PRIx32 ")", (double)f, u);
        return;
    }
    case TS_F64: {
        double d;
        uint64_t u;
        memcpy(&d, p, 8);
        memcpy(&u, p, 8);
        snprintf(out, len, "%.17g (0x%016" PRIx64 ")", d, u);
        return;
    }
    case TS_I64: {
        int64_t i;
        memcpy(&i, p, 8);
        snprintf(out, len, "%" PRId64, i);
        return;
    }
    default: snprintf(out, len, "0x%02x", p[0]); return;
    }
}

void th_vec_expect_bytes(const char *what, ts_dtype dt, const void *got, const void *want, int64_t n)
{
    size_t es = ts_dtype_size(dt);
    const uint8_t *g = got, *w = want;
    for (int64_t i = 0; i < n; i++) {
        if (memcmp(g + (size_t)i * es, w + (size_t)i * es, es) != 0) {
            char gs[64], ws[64];
            describe_bits(dt, g + (size_t)i * es, gs, sizeof gs);
            describe_bits(dt, w + (size_t)i * es, ws, sizeof ws);
            cr_assert_fail("%s: element %" PRId64 " of %" PRId64 " is %s, torch has %s", what, i, n, gs, ws);
        }
    }
}

void th_vec_expect_tensor(th_vec *v, const ts_tensor *t, const char *what)
{
    ts_dtype dt = ts_tensor_dtype(t);
    size_t nb = (size_t)ts_tensor_numel(t) * ts_dtype_size(dt);
    const uint8_t *want = th_vec_take(v, nb);
    uint8_t *got = malloc(nb ? nb : 1);
    cr_assert_not_null(got);
    ts_status st = ts_tensor_copy_to(t, got, nb);
    cr_assert_eq(st, TS_OK, "%s: copy_to: %s", what, ts_last_error());
    char label[256];
    snprintf(label, sizeof label, "%s: %s", v->name, what);
    th_vec_expect_bytes(label, dt, got, want, ts_tensor_numel(t));
    free(got);
}

void th_vec_expect_free(th_vec *v, ts_tensor *t, const char *what)
{
    th_vec_expect_tensor(v, t, what);
    ts_tensor_free(t);
}

uint32_t th_crc32(uint32_t crc, const void *p, size_t n)
{
    static uint32_t table[256];
    if (!table[1])
        for (uint32_t i = 0; i < 256; i++) {
            uint32_t c = i;
            for (int k = 0; k < 8; k++) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
            table[i] = c;
        }
    const uint8_t *b = p;
    crc = ~crc;
    for (size_t i = 0; i < n; i++) crc = table[(crc ^ b[i]) & 0xFF] ^ (crc >> 8);
    return ~crc;
}

uint32_t th_fixture_crc(const char *file, const char *name)
{
    size_t len;
    char *txt = (char *)th_fixture_read(file, &len);
    uint32_t found = 0;
    bool ok = false;
    for (size_t i = 0; i < len && !ok;) {
        char key[128];
        unsigned int v;
        if (txt[i] != '#' && sscanf(txt + i, "%127s %x", key, &v) == 2 && strcmp(key, name) == 0) {
            found = (uint32_t)v;
            ok = true;
        }
        while (i < len && txt[i] != '\n') i++;
        i++;
    }
    free(txt);
    cr_assert(ok, "%s has no %s", file, name);
    return found;
}

char *th_slurp_fd(int fd)
{
    off_t size = lseek(fd, 0, SEEK_END);
    cr_assert_geq(size, 0);
    char *buf = malloc((size_t)size + 1);
    cr_assert(buf);
    ssize_t got = pread(fd, buf, (size_t)size, 0);
    cr_assert_eq(got, size);
    buf[size] = '\0';
    return buf;
}

/* ------------------------------------------------ processes and ranks */

double th_now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

double th_cpu_s(void)
{
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    return (double)u.ru_utime.tv_sec + 1e-6 * (double)u.ru_utime.tv_usec + (double)u.ru_stime.tv_sec +
        1e-6 * (double)u.ru_stime.tv_usec;
}

char *th_self_exe(void)
{
    static char path[4096];
    ssize_t n = readlink("/proc/self/exe", path, sizeof path - 1);
    cr_assert_gt(n, 0);
    path[n] = '\0';
    return path;
}

int th_free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert_geq(fd, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    socklen_t len = sizeof a;
    cr_assert_eq(getsockname(fd, (struct sockaddr *)&a, &len), 0);
    close(fd);
    return ntohs(a.sin_port);
}

void th_wait_pids(const pid_t *pids, int n, int skip, double limit_s, int *status)
{
    double deadline = th_now_s() + limit_s;
    for (int r = 0; r < n; r++) {
        if (r == skip) continue;
        pid_t got;
        /* polling the children; bounded by limit_s */
        while ((got = waitpid(pids[r], &status[r], WNOHANG)) == 0 && th_now_s() < deadline) usleep(10000);
        if (got != pids[r]) {
            for (int k = 0; k < n; k++)
                if (k >= r || k == skip) {
                    kill(pids[k], SIGKILL);
                    waitpid(pids[k], NULL, 0);
                }
            cr_assert_fail("rank %d did not finish within %.0f s", r, limit_s);
        }
    }
}

char **th_environ_without(const char *const *drop, size_t n_drop, size_t extra, size_t *n_out)
{
    size_t ne = 0;
    while (environ[ne]) ne++;
    char **envp = calloc(ne + extra + 1, sizeof *envp);
    cr_assert_not_null(envp);
    size_t k = 0;
    for (size_t i = 0; i < ne; i++) {
        bool keep = true;
        for (size_t d = 0; d < n_drop; d++)
            if (strncmp(environ[i], drop[d], strlen(drop[d])) == 0) keep = false;
        if (keep) envp[k++] = environ[i];
    }
    *n_out = k;
    return envp;
}

char **th_job_environ(size_t extra, size_t *n_out)
{
    static const char *const drop[] = {
        "TS_TRACE=",       "RANK=",        "WORLD_SIZE=",           "LOCAL_RANK=",   "LOCAL_WORLD_SIZE=",
        "MASTER_ADDR=",    "MASTER_PORT=", "OMPI_COMM_WORLD_RANK=", "SLURM_PROCID=", "TS_LAUNCHER_PID=",
        "TS_STORE_HOSTED="};
    return th_environ_without(drop, sizeof drop / sizeof drop[0], extra, n_out);
}

char *th_tsrun_self(const char *build_dir, int W, const char *role)
{
    char *exe = th_self_exe(), tsrun[4096], nproc[16], role_env[256], timeout[] = "TS_DIST_TIMEOUT=120";
    snprintf(tsrun, sizeof tsrun, "%s/tools/tsrun", build_dir);
    snprintf(nproc, sizeof nproc, "%d", W);
    snprintf(role_env, sizeof role_env, "%s", role);
    cr_assert_eq(access(tsrun, X_OK), 0, "%s is not built", tsrun);
    size_t k;
    char **envp = th_job_environ(2, &k);
    envp[k++] = role_env;
    envp[k++] = timeout;
    envp[k] = NULL;
    int fd = memfd_create("ts-tsrun-out", MFD_CLOEXEC);
    cr_assert_geq(fd, 0);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, fd, 1);
    posix_spawn_file_actions_adddup2(&fa, fd, 2);
    char *argv[] = {tsrun, "--nproc-per-node", nproc, exe, NULL};
    pid_t pid;
    cr_assert_eq(posix_spawn(&pid, tsrun, &fa, NULL, argv, envp), 0);
    posix_spawn_file_actions_destroy(&fa);
    free(envp);
    int status;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    char *out = th_slurp_fd(fd);
    close(fd);
    cr_log_info("%s", out);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "tsrun: status %d; output:\n%s", status, out);
    return out;
}

void th_rank_check(int code, const char *expr, ts_status s)
{
    if (s == TS_OK) return;
    fprintf(stderr, "%s -> %s: %s\n", expr, ts_status_name(s), ts_last_error());
    _exit(code);
}

void th_rank_exit(int rank, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "rank %d: ", rank);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, " (%s)\n", ts_last_error());
    fflush(stderr);
    _exit(code);
}

/* ------------------------------------------------ half-precision nn fixtures */

void th_half_fx_open(th_half_fx *f, const char *group)
{
    char path[1024];
    json_error_t err;
    snprintf(path, sizeof path, "%s/half/nn/index.json", TS_FIXTURES_DIR);
    f->root = json_load_file(path, 0, &err);
    cr_assert(f->root != NULL, "%s:%d: %s", path, err.line, err.text);
    json_t *g;
    size_t i;
    f->group = NULL;
    json_array_foreach(json_object_get(f->root, "groups"), i, g)
    {
        if (!strcmp(json_string_value(json_object_get(g, "name")), group)) f->group = g;
    }
    cr_assert(f->group != NULL, "no group '%s' in %s", group, path);
    snprintf(path, sizeof path, "%s/half/nn/%s", TS_FIXTURES_DIR, json_string_value(json_object_get(f->group, "file")));
    f->blob = th_read_file(path, &f->len);
}

void th_half_fx_close(th_half_fx *f)
{
    json_decref(f->root);
    free(f->blob);
}

static ts_dtype half_fx_dtype(const char *name)
{
    static const struct {
        const char *name;
        ts_dtype dt;
    } tab[] = {{"bfloat16", TS_BF16}, {"float16", TS_F16}, {"float32", TS_F32}, {"int64", TS_I64}};
    for (size_t i = 0; i < sizeof tab / sizeof tab[0]; i++)
        if (!strcmp(tab[i].name, name)) return tab[i].dt;
    cr_assert_fail("fixture dtype '%s' unknown", name);
    return TS_F32;
}

int64_t th_json_int(json_t *obj, const char *key)
{
    json_t *v = json_object_get(obj, key);
    cr_assert(json_is_integer(v), "fixture: '%s' is not an integer", key);
    return (int64_t)json_integer_value(v);
}

ts_tensor *th_half_fx_tensor(const th_half_fx *f, const char *name)
{
    json_t *e = NULL, *x;
    size_t i;
    json_array_foreach(json_object_get(f->group, "tensors"), i, x)
    {
        if (!strcmp(json_string_value(json_object_get(x, "name")), name)) e = x;
    }
    cr_assert(e != NULL, "fixture has no tensor '%s'", name);
    ts_dtype dt = half_fx_dtype(json_string_value(json_object_get(e, "dtype")));
    json_t *sh = json_object_get(e, "shape");
    int nd = (int)json_array_size(sh);
    int64_t shape[TS_MAX_DIMS];
    size_t numel = 1;
    cr_assert(nd <= TS_MAX_DIMS);
    for (int d = 0; d < nd; d++) {
        shape[d] = (int64_t)json_integer_value(json_array_get(sh, (size_t)d));
        numel *= (size_t)shape[d];
    }
    size_t off = (size_t)th_json_int(e, "offset"), nb = (size_t)th_json_int(e, "nbytes");
    cr_assert_eq(nb, numel * ts_dtype_size(dt), "fixture tensor '%s': size mismatch", name);
    cr_assert(off + nb <= f->len, "fixture tensor '%s' lies outside the file", name);
    ts_tensor *t;
    TH_OK(ts_tensor_from_data(dt, nd, shape, f->blob + off, &t));
    return t;
}

float th_f32_of(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

uint32_t th_f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

void th_clear_launch_env(void)
{
    static const char *vars[] = {
        "RANK",        "WORLD_SIZE",           "LOCAL_RANK",   "LOCAL_WORLD_SIZE", "MASTER_ADDR",
        "MASTER_PORT", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "TS_LAUNCHER_PID",  "TS_STORE_HOSTED"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) unsetenv(vars[i]);
}

void th_spawn_mpi_ranks(int W, const char *role_var, const char *role, pid_t *pid, int *err_fd)
{
    th_clear_launch_env();
    unsetenv("UCX_LOG_LEVEL");
    char port[16], ws[16];
    snprintf(port, sizeof port, "%d", th_free_port());
    snprintf(ws, sizeof ws, "%d", W);
    setenv(role_var, role, 1);
    setenv("MASTER_PORT", port, 1);
    setenv("OMPI_COMM_WORLD_SIZE", ws, 1);
    setenv("OMPI_COMM_WORLD_LOCAL_SIZE", ws, 1);
    setenv("UCX_WARN_UNUSED_ENV_VARS", "n", 0);
    char *argv[] = {th_self_exe(), NULL};
    for (int r = 0; r < W; r++) {
        char rs[16];
        snprintf(rs, sizeof rs, "%d", r);
        setenv("OMPI_COMM_WORLD_RANK", rs, 1);
        setenv("OMPI_COMM_WORLD_LOCAL_RANK", rs, 1);
        err_fd[r] = memfd_create("ts-rank-err", MFD_CLOEXEC);
        cr_assert_geq(err_fd[r], 0);
        posix_spawn_file_actions_t fa;
        posix_spawn_file_actions_init(&fa);
        posix_spawn_file_actions_adddup2(&fa, err_fd[r], 2);
        cr_assert_eq(posix_spawn(&pid[r], argv[0], &fa, NULL, argv, environ), 0);
        posix_spawn_file_actions_destroy(&fa);
    }
    unsetenv(role_var);
    static const char *const vars[] = {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE",
                                       "OMPI_COMM_WORLD_LOCAL_SIZE", "MASTER_PORT"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) unsetenv(vars[i]);
}

double th_xval(int64_t r, int64_t j) { return sin(0.37 * (double)(r * 7 + j) + 0.1); }
double th_yval(int64_t r, int64_t j) { return cos(0.23 * (double)(r * 5 + j)); }

ts_tensor *th_batch(int64_t row0, int64_t rows, int64_t cols, double (*f)(int64_t, int64_t))
{
    int64_t shape[2] = {rows, cols};
    ts_tensor *t = NULL;
    if (ts_tensor_empty(TS_F32, 2, shape, &t)) return NULL;
    float *p = ts_tensor_data(t);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < cols; j++) p[r * cols + j] = (float)f(row0 + r, j);
    return t;
}

static ts_status flaky_forward(ts_module *mm, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    th_flaky *f = (th_flaky *)mm;
    if (++f->calls == f->fail_at) return ts_error(TS_ERR_STATE, "Flaky: injected failure at call %d", f->calls);
    return ts_module_call(f->fc, n_in, in, n_out, out);
}

static ts_status flaky_visit(ts_module *mm, const ts_module_visitor *v)
{
    return v->child ? v->child(v->ctx, "fc", ((th_flaky *)mm)->fc) : TS_OK;
}

static void flaky_free(ts_module *mm)
{
    ts_module_free(((th_flaky *)mm)->fc);
    free(mm);
}

static const ts_module_vtable flaky_vt = {
    .type_name = "Flaky", .forward = flaky_forward, .visit = flaky_visit, .free = flaky_free};

ts_status th_flaky_new(th_flaky **out)
{
    th_flaky *f = calloc(1, sizeof *f);
    if (!f) return ts_error(TS_ERR_NO_MEMORY, "th_flaky_new: out of memory");
    ts_status st = ts_module_init(&f->base, &flaky_vt);
    if (st) {
        free(f);
        return st;
    }
    if ((st = ts_linear_new(4, 4, true, &f->fc))) {
        ts_module_free(&f->base);
        return st;
    }
    *out = f;
    return TS_OK;
}

ts_status th_param_slots(ts_module *m, int n, ts_tensor **ps)
{
    ts_named_params np;
    ts_status st = ts_module_named_parameters(m, &np);
    if (st) return st;
    if (np.n != n) st = ts_error(TS_ERR_INTERNAL, "%d parameters, expected %d", np.n, n);
    for (int i = 0; i < np.n && i < n; i++) ps[i] = *np.items[i].slot;
    ts_named_params_free(&np);
    return st;
}

void th_launch_self(int W, ts_launch_result *res)
{
    ts_launch_options o = ts_launch_options_default();
    o.nproc_per_node = W;
    o.forward_signals = false;
    char *argv[] = {th_self_exe(), NULL};
    TH_OK(ts_launch(&o, argv, res));
}

int th_launch_capture(const char *path, int nproc, const char *const *args, ts_launch_result *res, char **out,
                      char **err)
{
    th_clear_launch_env();
    ts_launch_options o = ts_launch_options_default();
    o.nproc_per_node = nproc;
    o.forward_signals = false;
    o.out_fd = memfd_create("ts-launch-out", MFD_CLOEXEC);
    o.err_fd = memfd_create("ts-launch-err", MFD_CLOEXEC);
    cr_assert(o.out_fd >= 0 && o.err_fd >= 0);
    char *argv[64] = {(char *)path};
    int n = 1;
    for (; args && args[n - 1]; n++) {
        cr_assert_lt(n, 63, "more than 62 arguments for %s", path);
        argv[n] = (char *)args[n - 1];
    }
    argv[n] = NULL;
    ts_launch_result r;
    TH_OK(ts_launch(&o, argv, &r));
    *out = th_slurp_fd(o.out_fd);
    *err = th_slurp_fd(o.err_fd);
    close(o.out_fd);
    close(o.err_fd);
    if (res) *res = r;
    return r.exit_code;
}

pthread_mutex_t th_build_mu = PTHREAD_MUTEX_INITIALIZER;

ts_status th_mlp3_new(uint64_t seed, int64_t in, int64_t h1, int64_t h2, int64_t out, ts_module **root,
                      ts_module *lin[3])
{
    pthread_mutex_lock(&th_build_mu);
    ts_manual_seed(seed);
    ts_module *c[5] = {0};
    ts_status st = ts_linear_new(in, h1, true, &c[0]);
    if (!st) st = ts_tanh_new(&c[1]);
    if (!st) st = ts_linear_new(h1, h2, true, &c[2]);
    if (!st) st = ts_tanh_new(&c[3]);
    if (!st) st = ts_linear_new(h2, out, true, &c[4]);
    if (!st) st = ts_sequential_new(5, c, root);
    pthread_mutex_unlock(&th_build_mu);
    if (st) return st;
    lin[0] = c[0], lin[1] = c[2], lin[2] = c[4];
    return TS_OK;
}

char *th_tmp_dir(const char *tag)
{
    char *d = NULL;
    cr_assert_geq(asprintf(&d, "/tmp/%s.XXXXXX", tag), 0);
    cr_assert(mkdtemp(d), "mkdtemp %s: %s", d, strerror(errno));
    return d;
}

void th_rm_rf(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *de;
    while ((de = readdir(d)))
        if (strcmp(de->d_name, ".") && strcmp(de->d_name, "..") && unlinkat(dirfd(d), de->d_name, 0) != 0)
            unlinkat(dirfd(d), de->d_name, AT_REMOVEDIR);
    closedir(d);
    rmdir(dir);
}

ts_status th_mse_backward(ts_module *root, ts_tensor *x, ts_tensor *y)
{
    ts_tensor *o = NULL, *loss = NULL;
    ts_status st = ts_module_call1(root, x, &o);
    if (!st) st = ts_mse_loss(o, y, TS_REDUCTION_MEAN, &loss);
    if (!st) st = ts_backward(loss, NULL, false);
    ts_tensor_free(o);
    ts_tensor_free(loss);
    return st;
}

ts_status th_mse_backward_rows(ts_module *root, int64_t row0, int64_t rows, int64_t in, int64_t out)
{
    ts_tensor *x = th_batch(row0, rows, in, th_xval), *y = th_batch(row0, rows, out, th_yval);
    ts_status st = x && y ? th_mse_backward(root, x, y) : TS_ERR_NO_MEMORY;
    ts_tensor_free(x);
    ts_tensor_free(y);
    return st;
}
