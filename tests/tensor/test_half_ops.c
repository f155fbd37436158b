/* tensor_half_ops: the tensor ops in bfloat16 and float16, forward and
 * backward, against (1) the same op run in float32 on the upcast inputs and
 * rounded to the dtype, and (2) torch 1.13 (CPU) through the fixtures of
 * tests/fixtures/half/ (tools/reference/make_half_ops.py writes them; its
 * docstring has the command and the inputs). Also PyTorch's type
 * promotion for mixed inputs, ts_to_dtype with autograd, gradient
 * accumulation into 16-bit leaves, and the dtype errors.
 *
 * Comparison classes (the `fwd32`, `bwd32`, `torch_fwd`, `torch_bwd` fields
 * of a case; u = 2^-8 for bf16, 2^-11 for f16, the unit roundoff: one
 * rounding to the dtype changes a value v by at most u |v|):
 *  EXACT  bit for bit. Every forward against both references except the
 *         ones listed below; every backward whose formula reads only the
 *         16-bit inputs (relu, gelu, log, abs, pow 2, add/sub/mul, the
 *         scalar ops, reductions, shape ops, casts).
 *  RELk   |got - want| <= k u max(|want|, 2^-4 max|want| of the tensor)
 *         (the floor covers results near 0 that cancel).
 *         - vs the float32 run, backward of ops whose gradient reads a
 *           saved 16-bit tensor that the float32 run has unrounded: exp,
 *           sqrt (the rounded output, u, plus the result's rounding, u:
 *           REL2), rsqrt (the rounded output cubed, 3u + u: REL4), div's
 *           gradient for b (g/b rounded, times the rounded output: REL4),
 *           mul/div with a broadcast b (products rounded before the sum
 *           over 3 rows: up to 3 such terms plus the sum's rounding, REL8).
 *         - mean: torch 1.13's CPU mean is sum(x).div_(n) in the dtype (the
 *           sum rounded, then divided by n as a wrapped number rounded to
 *           the dtype: bf16(257) = 256), the library does the same; the
 *           float32 run rounds once: within two roundings, REL2.
 *         - vs torch 1.13, which rounds intermediates to the dtype in
 *           gelu(tanh) (x*x*x, the inner sum, tanh, the products: REL4),
 *           pow(x, 3) (x*x*x: REL2; its backward 3*x^2*g in steps: REL4),
 *           the backward of pow with other exponents and of rsqrt and div
 *           (chains of 2-4 rounded ops: REL4; div with broadcast b: REL8);
 *           the library rounds once, as PyTorch's later releases do.
 *  COTk   |got - want| <= k u (|want| + |g|), g the cotangent element: the
 *         backward of tanh and sigmoid reads the rounded output y in
 *         g (1 - y^2) and g y (1 - y), where the cancellation makes the
 *         error absolute, |g| |dh/dy| |y| u <= 2 |g| u (COT2); gelu(tanh)'s
 *         backward against torch's stepwise version: COT8.
 *  NONE   not compared (torch 1.13 has no CPU kernel for that float16 op:
 *         the fixture index says "unsupported", which the test checks).
 * HALF_DIAG=1 in the environment prints the worst error of every
 * comparison instead of asserting (to re-derive the classes).
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/helpers.h"

enum cmp { NONE = 0, EXACT, REL2, REL4, REL8, COT2, COT8 };

/* ------------------------------------------------------------ fixtures */

typedef struct fx {
    char *index;
    uint8_t *blob;
    size_t blen;
} fx;

static fx fx_open(void)
{
    fx f;
    size_t len;
    f.index = th_read_file(TS_FIXTURES_DIR "/half/index.txt", &len);
    cr_assert_not_null(f.index, "cannot read " TS_FIXTURES_DIR "/half/index.txt");
    f.blob = th_read_file(TS_FIXTURES_DIR "/half/ops.bin", &f.blen);
    cr_assert_not_null(f.blob, "cannot read " TS_FIXTURES_DIR "/half/ops.bin");
    return f;
}

static void fx_close(fx *f)
{
    free(f->index);
    free(f->blob);
}

static ts_dtype dtype_of(const char *name)
{
    for (int d = 0; d < TS_DTYPE_COUNT; d++)
        if (strcmp(ts_dtype_name((ts_dtype)d), name) == 0) return (ts_dtype)d;
    cr_assert_fail("fixture names unknown dtype %s", name);
    return TS_DTYPE_COUNT;
}

/* The fixture tensor NAME as a new tensor, or NULL if the index lacks it. */
static ts_tensor *fx_tensor(const fx *f, const char *name)
{
    size_t nl = strlen(name);
    for (const char *l = f->index; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL) {
        if (strncmp(l, "tensor ", 7) != 0 || strncmp(l + 7, name, nl) != 0 || l[7 + nl] != ' ') continue;
        const char *p = l + 7 + nl + 1;
        char dn[32];
        int nd, used;
        cr_assert_eq(sscanf(p, "%31s %d%n", dn, &nd, &used), 2, "bad index line for %s", name);
        p += used;
        int64_t shape[TS_MAX_DIMS];
        for (int i = 0; i < nd; i++) {
            long long s;
            cr_assert_eq(sscanf(p, "%lld%n", &s, &used), 1);
            shape[i] = s;
            p += used;
        }
        long long off, nb;
        cr_assert_eq(sscanf(p, "%lld %lld", &off, &nb), 2);
        ts_dtype dt = dtype_of(dn);
        cr_assert_leq((size_t)(off + nb), f->blen, "%s lies outside ops.bin", name);
        ts_tensor *t;
        TH_OK(ts_tensor_from_data(dt, nd, shape, f->blob + off, &t));
        cr_assert_eq((size_t)nb, (size_t)ts_tensor_numel(t) * ts_dtype_size(dt), "%s: byte count", name);
        return t;
    }
    return NULL;
}

/* True if the index says torch 1.13 has no kernel for CASE in DTYPE. */
static bool fx_unsupported(const fx *f, ts_dtype dt, const char *cs)
{
    char key[96];
    snprintf(key, sizeof key, "unsupported %s %s ", ts_dtype_name(dt), cs);
    for (const char *l = f->index; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL)
        if (strncmp(l, key, strlen(key)) == 0) return true;
    return false;
}

/* ------------------------------------------------------------ comparisons */

static double relative_ulp(ts_dtype dt) { return dt == TS_BF16 ? 0x1p-8 : 0x1p-11; }

static void expect_match(enum cmp c, const char *what, const ts_tensor *got, const ts_tensor *want,
                         const ts_tensor *cot)
{
    if (c == NONE) return;
    cr_assert_not_null(got, "%s: no result", what);
    cr_assert_not_null(want, "%s: no reference", what);
    cr_assert_eq(ts_tensor_ndim(got), ts_tensor_ndim(want), "%s: ndim", what);
    cr_assert_eq(ts_tensor_dtype(got), ts_tensor_dtype(want), "%s: dtype %s vs %s", what,
                 ts_dtype_name(ts_tensor_dtype(got)), ts_dtype_name(ts_tensor_dtype(want)));
    for (int i = 0; i < ts_tensor_ndim(got); i++)
        cr_assert_eq(ts_tensor_size(got, i), ts_tensor_size(want, i), "%s: size of dim %d", what, i);
    int64_t n = ts_tensor_numel(got);
    double *a = th_vals_new(got), *b = th_vals_new(want), *gc = NULL;
    if (c == COT2 || c == COT8) {
        cr_assert_not_null(cot, "%s: no cotangent", what);
        cr_assert_eq(ts_tensor_numel(cot), n, "%s: cotangent size", what);
        gc = th_vals_new(cot);
    }
    ts_dtype dt = ts_tensor_dtype(got);
    double maxw = 0;
    for (int64_t i = 0; i < n; i++) maxw = fmax(maxw, fabs(b[i]));
    bool diag = getenv("HALF_DIAG") != NULL; /* prints the worst error of every comparison */
    int64_t bad = 0;
    double worst = 0;
    for (int64_t i = 0; i < n; i++) {
        if (c == EXACT || dt == TS_I64 || !ts_dtype_is_float(dt)) {
            bool same = a[i] == b[i] || (a[i] != a[i] && b[i] != b[i]);
            if (!same || signbit(a[i]) != signbit(b[i]))
                cr_assert_fail("%s: element %lld is %.9g, expected %.9g (bit-exact)", what, (long long)i, a[i], b[i]);
            continue;
        }
        double u = relative_ulp(dt), k = c == REL2 || c == COT2 ? 2 : c == REL4 ? 4 : 8;
        double scale = gc ? fabs(b[i]) + fabs(gc[i]) : fmax(fabs(b[i]), 0x1p-4 * maxw);
        double tol = k * u * scale;
        if (diag) {
            bad += a[i] != b[i];
            if (scale > 0) worst = fmax(worst, fabs(a[i] - b[i]) / (u * scale));
            continue;
        }
        cr_assert(fabs(a[i] - b[i]) <= tol, "%s: element %lld is %.9g, expected %.9g (tolerance %.3g)", what,
                  (long long)i, a[i], b[i], tol);
    }
    if (diag) fprintf(stderr, "DIAG %-55s cmp %d mismatches %5lld worst %.3g\n", what, (int)c, (long long)bad, worst);
    free(a);
    free(b);
    free(gc);
}

/* t converted (no autograd) to dt. */
static ts_tensor *cast(ts_tensor *t, ts_dtype dt)
{
    bool g = ts_grad_mode_set(false);
    ts_tensor *o;
    TH_OK(ts_to_dtype(t, dt, &o));
    ts_grad_mode_set(g);
    ts_tensor *c;
    TH_OK(ts_clone(o, &c)); /* a private copy: to_dtype may return t itself */
    ts_tensor_free(o);
    return c;
}

/* ------------------------------------------------------------ cases */

typedef ts_status (*case_fn)(ts_tensor **in, ts_tensor **out);

/* The dtype the cases' scalar constants are rounded to: the dtype under
 * test, also during its float32 run, since the library (as torch 1.13)
 * converts a scalar to the tensor's dtype first. */
static ts_dtype scalar_dtype = TS_F32;

static double sc(double v)
{
    ts_tensor *t;
    TH_OK(ts_tensor_scalar(scalar_dtype, v, &t));
    double r;
    TH_OK(ts_tensor_item(t, &r));
    ts_tensor_free(t);
    return r;
}

static ts_status f_neg(ts_tensor **x, ts_tensor **o) { return ts_neg(x[0], o); }
static ts_status f_exp(ts_tensor **x, ts_tensor **o) { return ts_exp(x[0], o); }
static ts_status f_log(ts_tensor **x, ts_tensor **o) { return ts_log(x[0], o); }
static ts_status f_sqrt(ts_tensor **x, ts_tensor **o) { return ts_sqrt(x[0], o); }
static ts_status f_rsqrt(ts_tensor **x, ts_tensor **o) { return ts_rsqrt(x[0], o); }
static ts_status f_tanh(ts_tensor **x, ts_tensor **o) { return ts_tanh(x[0], o); }
static ts_status f_sigmoid(ts_tensor **x, ts_tensor **o) { return ts_sigmoid(x[0], o); }
static ts_status f_relu(ts_tensor **x, ts_tensor **o) { return ts_relu(x[0], o); }
static ts_status f_gelu(ts_tensor **x, ts_tensor **o) { return ts_gelu(x[0], TS_GELU_NONE, o); }
static ts_status f_gelu_tanh(ts_tensor **x, ts_tensor **o) { return ts_gelu(x[0], TS_GELU_TANH, o); }
static ts_status f_abs(ts_tensor **x, ts_tensor **o) { return ts_abs(x[0], o); }
static ts_status f_pow2(ts_tensor **x, ts_tensor **o) { return ts_pow_scalar(x[0], 2.0, o); }
static ts_status f_pow3(ts_tensor **x, ts_tensor **o) { return ts_pow_scalar(x[0], 3.0, o); }
static ts_status f_pow05(ts_tensor **x, ts_tensor **o) { return ts_pow_scalar(x[0], 0.5, o); }
static ts_status f_pow17(ts_tensor **x, ts_tensor **o) { return ts_pow_scalar(x[0], sc(1.7), o); }
static ts_status f_add_s(ts_tensor **x, ts_tensor **o) { return ts_add_scalar(x[0], sc(0.1), o); }
static ts_status f_sub_s(ts_tensor **x, ts_tensor **o) { return ts_sub_scalar(x[0], sc(0.1), o); }
static ts_status f_rsub_s(ts_tensor **x, ts_tensor **o) { return ts_rsub_scalar(x[0], sc(0.1), o); }
static ts_status f_mul_s(ts_tensor **x, ts_tensor **o) { return ts_mul_scalar(x[0], sc(0.1), o); }
static ts_status f_div_s(ts_tensor **x, ts_tensor **o) { return ts_div_scalar(x[0], sc(0.3), o); }
static ts_status f_add(ts_tensor **x, ts_tensor **o) { return ts_add(x[0], x[1], o); }
static ts_status f_sub(ts_tensor **x, ts_tensor **o) { return ts_sub(x[0], x[1], o); }
static ts_status f_mul(ts_tensor **x, ts_tensor **o) { return ts_mul(x[0], x[1], o); }
static ts_status f_div(ts_tensor **x, ts_tensor **o) { return ts_div(x[0], x[1], o); }
static ts_status f_sum_all(ts_tensor **x, ts_tensor **o) { return ts_sum(x[0], 0, NULL, false, o); }
static ts_status f_sum1(ts_tensor **x, ts_tensor **o) { return ts_sum(x[0], 1, (int[]){1}, false, o); }
static ts_status f_mean_all(ts_tensor **x, ts_tensor **o) { return ts_mean(x[0], 0, NULL, false, o); }
static ts_status f_mean1(ts_tensor **x, ts_tensor **o) { return ts_mean(x[0], 1, (int[]){1}, false, o); }
static ts_status f_amax1(ts_tensor **x, ts_tensor **o) { return ts_amax(x[0], 1, (int[]){1}, false, o); }
static ts_status f_max1(ts_tensor **x, ts_tensor **o) { return ts_max_dim(x[0], 1, false, o, NULL); }
static ts_status f_cat(ts_tensor **x, ts_tensor **o) { return ts_cat(2, x, 0, o); }

/* A bool tensor x > v, v a 0-d float32 tensor: promotion keeps x's dtype
 * (a 0-d operand of the same category does not take part). */
static ts_status gt_scalar(ts_tensor *x, double v, ts_tensor **o)
{
    ts_tensor *z;
    ts_status st = ts_tensor_scalar(TS_F32, v, &z);
    if (st) return st;
    st = ts_gt(x, z, o);
    ts_tensor_free(z);
    return st;
}

/* torch.where(x > 0, x, y) */
static ts_status f_where(ts_tensor **x, ts_tensor **o)
{
    ts_tensor *c;
    ts_status st = gt_scalar(x[0], 0.0, &c);
    if (st) return st;
    st = ts_where(c, x[0], x[1], o);
    ts_tensor_free(c);
    return st;
}

/* x.masked_fill(x > 0.5, 0.25) */
static ts_status f_masked_fill(ts_tensor **x, ts_tensor **o)
{
    ts_tensor *c;
    ts_status st = gt_scalar(x[0], 0.5, &c);
    if (st) return st;
    st = ts_masked_fill(x[0], c, 0.25, o);
    ts_tensor_free(c);
    return st;
}

static ts_status f_to_f32(ts_tensor **x, ts_tensor **o) { return ts_to_dtype(x[0], TS_F32, o); }

static ts_status f_t_contiguous(ts_tensor **x, ts_tensor **o)
{
    ts_tensor *t;
    ts_status st = ts_transpose(x[0], 0, 1, &t);
    if (st) return st;
    st = ts_contiguous(t, o);
    ts_tensor_free(t);
    return st;
}

typedef struct hcase {
    const char *name;
    case_fn fn;
    int n;
    const char *in[2];
    const char *cot;
    enum cmp fwd32, bwd32;         /* against the float32 run, rounded */
    enum cmp torch_fwd, torch_bwd; /* against torch 1.13 (bf16; f16 where torch has the kernel) */
} hcase;

static const hcase cases[] = {
    {"neg", f_neg, 1, {"x"}, "g", EXACT, EXACT, EXACT, EXACT},
    {"exp", f_exp, 1, {"x"}, "g", EXACT, REL2, EXACT, EXACT},
    {"log", f_log, 1, {"xp"}, "g", EXACT, EXACT, EXACT, EXACT},
    {"sqrt", f_sqrt, 1, {"xp"}, "g", EXACT, REL2, EXACT, EXACT},
    {"rsqrt", f_rsqrt, 1, {"xp"}, "g", EXACT, REL4, EXACT, REL4},
    {"tanh", f_tanh, 1, {"x"}, "g", EXACT, COT2, EXACT, EXACT},
    {"sigmoid", f_sigmoid, 1, {"x"}, "g", EXACT, COT2, EXACT, EXACT},
    {"relu", f_relu, 1, {"x"}, "g", EXACT, EXACT, EXACT, EXACT},
    {"gelu", f_gelu, 1, {"x"}, "g", EXACT, EXACT, EXACT, EXACT},
    {"gelu_tanh", f_gelu_tanh, 1, {"x"}, "g", EXACT, EXACT, REL4, COT8},
    {"abs", f_abs, 1, {"x"}, "g", EXACT, EXACT, EXACT, EXACT},
    {"pow2", f_pow2, 1, {"x"}, "g", EXACT, EXACT, EXACT, EXACT},
    {"pow3", f_pow3, 1, {"x"}, "g", EXACT, EXACT, REL2, REL4},
    {"pow0.5", f_pow05, 1, {"xp"}, "g", EXACT, EXACT, EXACT, REL4},
    {"pow1.7", f_pow17, 1, {"xp"}, "g", EXACT, EXACT, EXACT, REL4},
    {"add_s", f_add_s, 1, {"x"}, "g", EXACT, EXACT, EXACT, EXACT},
    {"sub_s", f_sub_s, 1, {"x"}, "g", EXACT, EXACT, EXACT, EXACT},
    {"rsub_s", f_rsub_s, 1, {"x"}, "g", EXACT, EXACT, EXACT, EXACT},
    {"mul_s", f_mul_s, 1, {"x"}, "g", EXACT, EXACT, EXACT, EXACT},
    {"div_s", f_div_s, 1, {"x"}, "g", EXACT, EXACT, EXACT, EXACT},
    {"add", f_add, 2, {"x", "y"}, "g", EXACT, EXACT, EXACT, EXACT},
    {"sub", f_sub, 2, {"x", "y"}, "g", EXACT, EXACT, EXACT, EXACT},
    {"mul", f_mul, 2, {"x", "y"}, "g", EXACT, EXACT, EXACT, EXACT},
    {"div", f_div, 2, {"x", "xp"}, "g", EXACT, REL4, EXACT, REL4},
    {"add_b", f_add, 2, {"x", "yb"}, "g", EXACT, EXACT, EXACT, EXACT},
    {"mul_b", f_mul, 2, {"x", "yb"}, "g", EXACT, REL8, EXACT, EXACT},
    {"div_b", f_div, 2, {"x", "ybp"}, "g", EXACT, REL8, EXACT, REL8},
    {"sum_all", f_sum_all, 1, {"x"}, "g0", EXACT, EXACT, EXACT, EXACT},
    {"sum1", f_sum1, 1, {"x"}, "gr", EXACT, EXACT, EXACT, EXACT},
    {"mean_all", f_mean_all, 1, {"x"}, "g0", REL2, REL2, EXACT, EXACT},
    {"mean1", f_mean1, 1, {"x"}, "gr", REL2, REL2, EXACT, EXACT},
    {"amax1", f_amax1, 1, {"x"}, "gr", EXACT, EXACT, EXACT, EXACT},
    {"max1", f_max1, 1, {"x"}, "gr", EXACT, EXACT, EXACT, EXACT},
    {"cat", f_cat, 2, {"x", "y"}, "gcat", EXACT, EXACT, EXACT, EXACT},
    {"where", f_where, 2, {"x", "y"}, "g", EXACT, EXACT, EXACT, EXACT},
    {"masked_fill", f_masked_fill, 1, {"x"}, "g", EXACT, EXACT, EXACT, EXACT},
    {"to_f32", f_to_f32, 1, {"x"}, "gf", EXACT, EXACT, EXACT, EXACT},
    {"t_contiguous", f_t_contiguous, 1, {"x"}, "gt", EXACT, EXACT, EXACT, EXACT},
};
#define N_CASES ((int)(sizeof cases / sizeof *cases))

/* Runs case c on fresh leaves made from `ins` (cast to dt), backward with
 * `cot` (cast to dt unless it is float32 already); writes the output and
 * the leaves' gradients. */
static void run_case(const hcase *c, ts_dtype dt, ts_tensor **ins, ts_tensor *cot, ts_tensor **out, ts_tensor **grads)
{
    ts_tensor *leaves[2] = {NULL, NULL};
    for (int i = 0; i < c->n; i++) {
        leaves[i] = cast(ins[i], dt);
        TH_OK(ts_tensor_set_requires_grad(leaves[i], true));
    }
    ts_tensor *o;
    TH_OK(c->fn(leaves, &o));
    ts_tensor *g =
        cast(cot, ts_tensor_dtype(cot) == TS_F32 && strcmp(c->name, "to_f32") == 0 ? TS_F32 : ts_tensor_dtype(o));
    TH_OK(ts_backward(o, g, false));
    ts_tensor_free(g);
    *out = o;
    for (int i = 0; i < c->n; i++) {
        ts_tensor *gr = ts_tensor_grad(leaves[i]);
        cr_assert_not_null(gr, "%s: input %d got no gradient", c->name, i);
        grads[i] = ts_tensor_retain(gr);
        ts_tensor_free(leaves[i]);
    }
}

static void check_dtype(ts_dtype dt)
{
    th_mem_mark();
    fx f = fx_open();
    int torch_checked = 0;
    scalar_dtype = dt;
    for (int k = 0; k < N_CASES; k++) {
        const hcase *c = &cases[k];
        char nm[128], what[160];
        ts_tensor *ins[2] = {NULL, NULL}, *cot;
        for (int i = 0; i < c->n; i++) {
            snprintf(nm, sizeof nm, "%s.in.%s", ts_dtype_name(dt), c->in[i]);
            ins[i] = fx_tensor(&f, nm);
            cr_assert_not_null(ins[i], "fixture lacks %s", nm);
        }
        snprintf(nm, sizeof nm, "%s.in.%s", ts_dtype_name(dt), strcmp(c->cot, "gf") == 0 ? "g" : c->cot);
        cot = fx_tensor(&f, nm);
        cr_assert_not_null(cot, "fixture lacks %s", nm);
        if (strcmp(c->cot, "gf") == 0) {
            ts_tensor *cf = cast(cot, TS_F32);
            ts_tensor_free(cot);
            cot = cf;
        }

        /* in the dtype */
        ts_tensor *o, *gr[2] = {NULL, NULL};
        run_case(c, dt, ins, cot, &o, gr);
        ts_dtype odt = ts_tensor_dtype(o);

        /* in float32 on the upcast inputs, rounded */
        ts_tensor *o32, *gr32[2] = {NULL, NULL};
        run_case(c, TS_F32, ins, cot, &o32, gr32);
        ts_tensor *o32r = cast(o32, odt);
        snprintf(what, sizeof what, "%s %s forward vs float32 rounded", ts_dtype_name(dt), c->name);
        expect_match(c->fwd32, what, o, o32r, cot);
        for (int i = 0; i < c->n; i++) {
            ts_tensor *r = cast(gr32[i], dt);
            snprintf(what, sizeof what, "%s %s grad %s vs float32 rounded", ts_dtype_name(dt), c->name, c->in[i]);
            cr_assert_eq(ts_tensor_dtype(gr[i]), dt, "%s: gradient dtype %s", what,
                         ts_dtype_name(ts_tensor_dtype(gr[i])));
            expect_match(c->bwd32, what, gr[i], r, cot);
            ts_tensor_free(r);
        }

        /* against torch 1.13 */
        snprintf(nm, sizeof nm, "%s.%s.out", ts_dtype_name(dt), c->name);
        ts_tensor *want = fx_tensor(&f, nm);
        if (!want) {
            cr_assert(dt == TS_F16 && fx_unsupported(&f, dt, c->name), "fixture lacks %s and does not say why", nm);
        } else {
            torch_checked++;
            snprintf(what, sizeof what, "%s %s forward vs torch 1.13", ts_dtype_name(dt), c->name);
            expect_match(c->torch_fwd, what, o, want, cot);
            ts_tensor_free(want);
            for (int i = 0; i < c->n; i++) {
                snprintf(nm, sizeof nm, "%s.%s.grad.%s", ts_dtype_name(dt), c->name, c->in[i]);
                ts_tensor *wg = fx_tensor(&f, nm);
                cr_assert_not_null(wg, "fixture lacks %s", nm);
                snprintf(what, sizeof what, "%s %s grad %s vs torch 1.13", ts_dtype_name(dt), c->name, c->in[i]);
                expect_match(c->torch_bwd, what, gr[i], wg, cot);
                ts_tensor_free(wg);
            }
        }
        ts_tensor_free(o);
        ts_tensor_free(o32);
        ts_tensor_free(o32r);
        for (int i = 0; i < c->n; i++) {
            ts_tensor_free(gr[i]);
            ts_tensor_free(gr32[i]);
            ts_tensor_free(ins[i]);
        }
        ts_tensor_free(cot);
    }
    cr_assert_geq(torch_checked, dt == TS_BF16 ? N_CASES : N_CASES - 9, "only %d cases met torch", torch_checked);
    fx_close(&f);
    th_mem_assert_back();
}

Test(tensor_half_ops, bfloat16_against_float32_and_torch) { check_dtype(TS_BF16); }
Test(tensor_half_ops, float16_against_float32_and_torch) { check_dtype(TS_F16); }

/* ------------------------------------------------------------ promotion */

/* result dtype of ts_add(a, b) for a of shape (2,) or () and b likewise */
static ts_dtype add_dtype(ts_dtype da, bool a0d, ts_dtype db, bool b0d)
{
    int64_t s[1] = {2};
    ts_tensor *a, *b, *o;
    TH_OK(ts_tensor_ones(da, a0d ? 0 : 1, s, &a));
    TH_OK(ts_tensor_ones(db, b0d ? 0 : 1, s, &b));
    TH_OK(ts_add(a, b, &o));
    ts_dtype r = ts_tensor_dtype(o);
    ts_tensor_free(a);
    ts_tensor_free(b);
    ts_tensor_free(o);
    return r;
}

Test(tensor_half_ops, type_promotion_follows_torch_result_type)
{
    th_mem_mark();
    /* each row: torch.result_type of the two operands (checked with torch
     * 1.13: bf16 + f16 -> f32; bf16 (n) + f32 () -> bf16; bf16 () + f16 (n)
     * -> f16; f64 () + f16 (n) -> f16; f64 (n) + f16 (n) -> f64) */
    static const struct {
        ts_dtype a;
        bool a0;
        ts_dtype b;
        bool b0;
        ts_dtype want;
    } rows[] = {
        {TS_BF16, false, TS_F16, false, TS_F32},  {TS_BF16, false, TS_F32, false, TS_F32},
        {TS_F16, false, TS_F32, false, TS_F32},   {TS_BF16, false, TS_F32, true, TS_BF16},
        {TS_BF16, true, TS_F16, false, TS_F16},   {TS_F64, true, TS_F16, false, TS_F16},
        {TS_F64, false, TS_F16, false, TS_F64},   {TS_F32, false, TS_F64, false, TS_F64},
        {TS_I64, false, TS_BF16, false, TS_BF16}, {TS_I64, false, TS_F32, true, TS_F32},
        {TS_BOOL, false, TS_F16, true, TS_F16},   {TS_BF16, true, TS_F16, true, TS_F32},
    };
    for (size_t k = 0; k < sizeof rows / sizeof *rows; k++) {
        ts_dtype got = add_dtype(rows[k].a, rows[k].a0, rows[k].b, rows[k].b0);
        cr_assert_eq(got, rows[k].want, "row %zu: %s%s + %s%s gave %s, torch gives %s", k, ts_dtype_name(rows[k].a),
                     rows[k].a0 ? " 0-d" : "", ts_dtype_name(rows[k].b), rows[k].b0 ? " 0-d" : "", ts_dtype_name(got),
                     ts_dtype_name(rows[k].want));
        /* symmetric */
        cr_assert_eq(add_dtype(rows[k].b, rows[k].b0, rows[k].a, rows[k].a0), rows[k].want, "row %zu swapped", k);
    }
    th_mem_assert_back();
}

Test(tensor_half_ops, mixed_operands_compute_in_the_promoted_dtype_and_grads_keep_their_dtypes)
{
    th_mem_mark();
    fx f = fx_open();
    ts_tensor *xb = fx_tensor(&f, "bfloat16.in.x"), *yh = fx_tensor(&f, "float16.in.y");
    TH_OK(ts_tensor_set_requires_grad(xb, true));
    TH_OK(ts_tensor_set_requires_grad(yh, true));
    ts_tensor *o;
    TH_OK(ts_mul(xb, yh, &o)); /* bf16 * f16 -> f32 */
    cr_assert_eq(ts_tensor_dtype(o), TS_F32);
    ts_tensor *xf = cast(xb, TS_F32), *yf = cast(yh, TS_F32), *want;
    TH_OK(ts_mul(xf, yf, &want));
    expect_match(EXACT, "bf16 * f16 vs f32 * f32", o, want, NULL);
    ts_tensor *s;
    TH_OK(ts_sum(o, 0, NULL, false, &s));
    TH_OK(ts_backward(s, NULL, false));
    /* d/dx = y (f32), cast back to bf16: round(y) in bf16 */
    ts_tensor *gx = ts_tensor_grad(xb), *gy = ts_tensor_grad(yh);
    cr_assert_eq(ts_tensor_dtype(gx), TS_BF16, "grad of the bf16 operand is %s", ts_dtype_name(ts_tensor_dtype(gx)));
    cr_assert_eq(ts_tensor_dtype(gy), TS_F16, "grad of the f16 operand is %s", ts_dtype_name(ts_tensor_dtype(gy)));
    ts_tensor *wx = cast(yf, TS_BF16), *wy = cast(xf, TS_F16);
    expect_match(EXACT, "grad x", gx, wx, NULL);
    expect_match(EXACT, "grad y", gy, wy, NULL);
    ts_tensor *objs[] = {xb, yh, o, xf, yf, want, s, wx, wy};
    for (size_t i = 0; i < sizeof objs / sizeof *objs; i++) ts_tensor_free(objs[i]);
    fx_close(&f);
    th_mem_assert_back();
}

Test(tensor_half_ops, zero_dim_operand_of_the_same_category_keeps_the_dtype)
{
    th_mem_mark();
    int64_t s[1] = {4};
    double v[4] = {1.0, 1.00390625, -3.0, 0.3};
    ts_tensor *x = th_tensor(TS_BF16, 1, s, v), *c, *o, *w;
    TH_OK(ts_tensor_scalar(TS_F32, 0.1, &c));
    TH_OK(ts_add(x, c, &o));
    cr_assert_eq(ts_tensor_dtype(o), TS_BF16);
    /* the 0-d float32 operand is converted to bf16 first, as torch does */
    TH_OK(ts_add_scalar(x, 0.1, &w));
    expect_match(EXACT, "bf16 + f32 0-d vs bf16 + 0.1", o, w, NULL);
    ts_tensor_free(x);
    ts_tensor_free(c);
    ts_tensor_free(o);
    ts_tensor_free(w);
    th_mem_assert_back();
}

/* ------------------------------------------------------------ casts */

Test(tensor_half_ops, to_dtype_backward_casts_the_gradient_back)
{
    th_mem_mark();
    static const ts_dtype from[] = {TS_F32, TS_F32, TS_BF16, TS_F16, TS_F64, TS_BF16, TS_F64};
    static const ts_dtype to[] = {TS_BF16, TS_F16, TS_F32, TS_F32, TS_BF16, TS_F16, TS_F16};
    int64_t s[1] = {5};
    double v[5] = {1.0, -0.3, 1.0 + 0x1p-9, 65504.0, 1e-6};
    for (size_t k = 0; k < sizeof from / sizeof *from; k++) {
        ts_tensor *x = th_tensor(from[k], 1, s, v), *y, *g, *w;
        TH_OK(ts_tensor_set_requires_grad(x, true));
        TH_OK(ts_to_dtype(x, to[k], &y));
        cr_assert_eq(ts_tensor_dtype(y), to[k]);
        /* values: PyTorch's conversion (through float32 to 16 bits) */
        double got[5], want[5];
        th_vals(y, got, 5);
        for (int i = 0; i < 5; i++) {
            double xi;
            TH_OK(ts_tensor_get(x, (int64_t[]){i}, &xi));
            float f = (float)xi;
            want[i] = to[k] == TS_BF16 ? ts_bf16_to_f32(ts_f32_to_bf16(f))
                : to[k] == TS_F16      ? ts_f16_to_f32(ts_f32_to_f16(f))
                                       : xi;
            cr_assert(got[i] == want[i], "%s -> %s element %d: %.9g, expected %.9g", ts_dtype_name(from[k]),
                      ts_dtype_name(to[k]), i, got[i], want[i]);
        }
        double gv[5] = {0.5, 3.0, 1.0 + 0x1p-12, -2.0, 0.125};
        g = th_tensor(to[k], 1, s, gv);
        TH_OK(ts_backward(y, g, false));
        ts_tensor *gx = ts_tensor_grad(x);
        cr_assert_eq(ts_tensor_dtype(gx), from[k], "%s -> %s: gradient dtype %s", ts_dtype_name(from[k]),
                     ts_dtype_name(to[k]), ts_dtype_name(ts_tensor_dtype(gx)));
        w = cast(g, from[k]);
        expect_match(EXACT, "to_dtype gradient", gx, w, NULL);
        ts_tensor_free(x);
        ts_tensor_free(y);
        ts_tensor_free(g);
        ts_tensor_free(w);
    }
    th_mem_assert_back();
}

Test(tensor_half_ops, copy_across_dtypes_and_strided_copies)
{
    th_mem_mark();
    int64_t s[2] = {3, 5};
    ts_tensor *x = th_seq(TS_F32, 2, s, 3.0, false);
    for (int d = 0; d < 2; d++) {
        ts_dtype dt = d ? TS_F16 : TS_BF16;
        ts_tensor *h = th_empty(dt, 2, s), *w = cast(x, dt);
        TH_OK(ts_tensor_copy_(h, x)); /* contiguous f32 -> 16-bit */
        expect_match(EXACT, "copy_ f32 -> 16-bit", h, w, NULL);
        /* strided: a transposed 16-bit view copied into f64 and back */
        ts_tensor *t, *tc, *d64, *back;
        TH_OK(ts_transpose(h, 0, 1, &t));
        TH_OK(ts_contiguous(t, &tc));
        int64_t s2[2] = {5, 3};
        d64 = th_empty(TS_F64, 2, s2);
        TH_OK(ts_tensor_copy_(d64, t));
        back = th_empty(dt, 2, s2);
        TH_OK(ts_tensor_copy_(back, d64));
        expect_match(EXACT, "16-bit -> f64 -> 16-bit through a transposed view", back, tc, NULL);
        /* fill rounds the value once */
        TH_OK(ts_tensor_fill_(back, 0.1));
        double v;
        TH_OK(ts_tensor_get(back, (int64_t[]){4, 2}, &v));
        double want = dt == TS_BF16 ? ts_bf16_to_f32(ts_f32_to_bf16(0.1f)) : ts_f16_to_f32(ts_f32_to_f16(0.1f));
        cr_assert(v == want, "fill_: %.9g, expected %.9g", v, want);
        ts_tensor *objs[] = {h, w, t, tc, d64, back};
        for (size_t i = 0; i < sizeof objs / sizeof *objs; i++) ts_tensor_free(objs[i]);
    }
    ts_tensor_free(x);
    th_mem_assert_back();
}

/* ------------------------------------------------------------ autograd */

Test(tensor_half_ops, bf16_leaf_gradients_accumulate_in_bf16)
{
    th_mem_mark();
    int64_t s[1] = {3};
    double xv[3] = {1.0, -2.0, 0.3};
    ts_tensor *x = th_tensor(TS_BF16, 1, s, xv);
    TH_OK(ts_tensor_set_requires_grad(x, true));
    /* y = x * 1.0078125 + x * 3 (both exact in bf16): the two gradients
     * meet inside the graph and are summed in bf16, 4.0078125 rounding to
     * 4 (the ulp at 4 is 2^-5); a float32 accumulator would hold
     * 4.0078125, and 8.015625 after the second backward */
    for (int pass = 0; pass < 2; pass++) {
        ts_tensor *a, *b, *y, *l;
        TH_OK(ts_mul_scalar(x, 1.0078125, &a));
        TH_OK(ts_mul_scalar(x, 3.0, &b));
        TH_OK(ts_add(a, b, &y));
        TH_OK(ts_sum(y, 0, NULL, false, &l));
        TH_OK(ts_backward(l, NULL, false));
        ts_tensor_free(a);
        ts_tensor_free(b);
        ts_tensor_free(y);
        ts_tensor_free(l);
    }
    ts_tensor *g = ts_tensor_grad(x);
    cr_assert_eq(ts_tensor_dtype(g), TS_BF16);
    /* the second backward adds 4 in place: 8 */
    double gv[3];
    th_vals(g, gv, 3);
    for (int i = 0; i < 3; i++) cr_assert(gv[i] == 8.0, "grad[%d] = %.9g, expected 8 (bf16 accumulation)", i, gv[i]);
    ts_tensor_free(x);
    th_mem_assert_back();
}

/* ------------------------------------------------------------ layouts */

Test(tensor_half_ops, strided_and_broadcast_inputs_give_the_contiguous_bits)
{
    th_mem_mark();
    int64_t s[2] = {6, 7};
    for (int d = 0; d < 2; d++) {
        ts_dtype dt = d ? TS_F16 : TS_BF16;
        ts_tensor *a32 = th_seq(TS_F32, 2, s, 2.0, false), *a = cast(a32, dt), *at, *atc, *o1, *o2;
        TH_OK(ts_transpose(a, 0, 1, &at));
        TH_OK(ts_contiguous(at, &atc));
        ts_status (*un[])(ts_tensor *, ts_tensor **) = {ts_exp, ts_tanh, ts_sigmoid, ts_relu, ts_neg};
        for (size_t k = 0; k < sizeof un / sizeof *un; k++) {
            TH_OK(un[k](at, &o1));
            TH_OK(un[k](atc, &o2));
            expect_match(EXACT, "unary on a transposed view", o1, o2, NULL);
            ts_tensor_free(o1);
            ts_tensor_free(o2);
        }
        /* binary: transposed view times a broadcast row */
        int64_t rs[2] = {1, 6};
        ts_tensor *r32 = th_seq(TS_F32, 2, rs, 1.0, false), *r = cast(r32, dt), *r32c;
        TH_OK(ts_mul(at, r, &o1));
        TH_OK(ts_mul(atc, r, &o2));
        expect_match(EXACT, "mul transposed x broadcast", o1, o2, NULL);
        ts_tensor *at32;
        TH_OK(ts_transpose(a32, 0, 1, &at32));
        r32c = cast(r, TS_F32);
        ts_tensor *ax = cast(at, TS_F32), *w32, *w;
        TH_OK(ts_mul(ax, r32c, &w32));
        w = cast(w32, dt);
        expect_match(EXACT, "mul vs float32 rounded", o1, w, NULL);
        ts_tensor *objs[] = {a32, a, at, atc, o1, o2, r32, r, r32c, at32, ax, w32, w};
        for (size_t i = 0; i < sizeof objs / sizeof *objs; i++) ts_tensor_free(objs[i]);
    }
    th_mem_assert_back();
}

Test(tensor_half_ops, comparisons_in_the_promoted_dtype)
{
    th_mem_mark();
    int64_t s[1] = {4};
    double av[4] = {1.0, 2.0, NAN, -1.0}, bv[4] = {1.0, 1.0, 1.0, 0.0};
    ts_tensor *a = th_tensor(TS_BF16, 1, s, av), *b = th_tensor(TS_F16, 1, s, bv), *o;
    static const struct {
        ts_status (*fn)(ts_tensor *, ts_tensor *, ts_tensor **);
        const char *name;
        double want[4];
    } cmp[] = {
        {ts_eq, "eq", {1, 0, 0, 0}}, {ts_ne, "ne", {0, 1, 1, 1}}, {ts_lt, "lt", {0, 0, 0, 1}},
        {ts_le, "le", {1, 0, 0, 1}}, {ts_gt, "gt", {0, 1, 0, 0}}, {ts_ge, "ge", {1, 1, 0, 0}},
    };
    for (size_t k = 0; k < sizeof cmp / sizeof *cmp; k++) {
        TH_OK(cmp[k].fn(a, b, &o));
        cr_assert_eq(ts_tensor_dtype(o), TS_BOOL);
        double got[4];
        th_vals(o, got, 4);
        for (int i = 0; i < 4; i++)
            cr_assert(got[i] == cmp[k].want[i], "%s[%d] = %g, expected %g", cmp[k].name, i, got[i], cmp[k].want[i]);
        ts_tensor_free(o);
    }
    /* int64 2^24 + 1 against float32 2^24: equal in float32 (torch.eq) */
    int64_t one[1] = {1};
    double iv[1] = {16777217.0}, fv[1] = {16777216.0};
    ts_tensor *i = th_tensor(TS_I64, 1, one, iv), *fl = th_tensor(TS_F32, 1, one, fv);
    TH_OK(ts_eq(i, fl, &o));
    double e;
    TH_OK(ts_tensor_item(o, &e));
    cr_assert(e == 1.0, "int64 2^24+1 == float32 2^24 must hold after promotion");
    ts_tensor_free(o);
    ts_tensor_free(i);
    ts_tensor_free(fl);
    ts_tensor_free(a);
    ts_tensor_free(b);
    th_mem_assert_back();
}

/* ------------------------------------------------------------ errors */

Test(tensor_half_ops, unsupported_combinations_name_the_dtypes)
{
    th_mem_mark();
    int64_t s[1] = {3};
    double v[3] = {1, 2, 3};
    ts_tensor *b = th_tensor(TS_BF16, 1, s, v), *h = th_tensor(TS_F16, 1, s, v), *i = th_tensor(TS_I64, 1, s, v),
              *i32 = th_tensor(TS_I32, 1, s, v), *bo = th_tensor(TS_BOOL, 1, s, v), *o = NULL;
    TH_FAILS(ts_add(i, i32, &o), TS_ERR_DTYPE, "add", "int64", "int32");
    TH_FAILS(ts_mul(bo, bo, &o), TS_ERR_DTYPE, "mul", "bool");
    TH_FAILS(ts_div(i, bo, &o), TS_ERR_DTYPE, "div", "int64", "bool");
    TH_FAILS(ts_exp(i32, &o), TS_ERR_DTYPE, "exp", "int32");
    TH_FAILS(ts_mean(i, 0, NULL, false, &o), TS_ERR_DTYPE, "mean", "int64");
    TH_FAILS(ts_amax(bo, 0, NULL, false, &o), TS_ERR_DTYPE, "amax", "bool");
    TH_FAILS(ts_max_dim(i, 0, false, &o, NULL), TS_ERR_DTYPE, "max", "int64");
    ts_tensor *two[2] = {b, h};
    TH_FAILS(ts_cat(2, two, 0, &o), TS_ERR_DTYPE, "cat", "bfloat16", "float16");
    ts_tensor *c;
    TH_OK(ts_gt(b, h, &c));
    TH_FAILS(ts_where(c, b, h, &o), TS_ERR_DTYPE, "where", "bfloat16", "float16");
    TH_FAILS(ts_masked_fill(b, h, 0.0, &o), TS_ERR_DTYPE, "masked_fill", "float16");
    cr_assert_null(o, "out written on failure");
    ts_tensor *objs[] = {b, h, i, i32, bo, c};
    for (size_t k = 0; k < sizeof objs / sizeof *objs; k++) ts_tensor_free(objs[k]);
    th_mem_assert_back();
}

/* ------------------------------------------------------------ reference kernels */

static ts_status run_case_fn(ts_tensor **in, ts_tensor **out, void *ctx)
{
    const hcase *c = ctx;
    return c->fn(in, out);
}

/* The typed 16-bit loops against the reference kernels (through double,
 * rounded to float32, then to the dtype). Both round a value within u of
 * the exact result once more to the dtype, so they differ by at most one
 * ulp (2u relative) in the forward; the backward formulas compose two such
 * steps on the saved tensors: 4u relative, and 4u absolute for gradients
 * that cancel near 0 (the cotangent and the inputs are O(1)). */
Test(tensor_half_ops, typed_loops_agree_with_the_reference_kernels)
{
    th_mem_mark();
    fx f = fx_open();
    for (int d = 0; d < 2; d++) {
        ts_dtype dt = d ? TS_F16 : TS_BF16;
        double u = relative_ulp(dt);
        scalar_dtype = dt;
        for (int k = 0; k < N_CASES; k++) {
            const hcase *c = &cases[k];
            if (strcmp(c->cot, "g") != 0 || strcmp(c->name, "where") == 0 || strcmp(c->name, "masked_fill") == 0)
                continue; /* the elementwise ops */
            ts_tensor *in[2];
            char nm[96];
            for (int i = 0; i < c->n; i++) {
                snprintf(nm, sizeof nm, "%s.in.%s", ts_dtype_name(dt), c->in[i]);
                in[i] = fx_tensor(&f, nm);
            }
            th_assert_kernels_agree(run_case_fn, c->n, in, (void *)c, 0.8, 2 * u, 2 * u, 4 * u, 4 * u);
            for (int i = 0; i < c->n; i++) ts_tensor_free(in[i]);
        }
    }
    fx_close(&f);
    th_mem_assert_back();
}
