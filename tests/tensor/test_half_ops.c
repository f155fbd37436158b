/* tensor_half_ops: the tensor ops in bfloat16 and float16, forward and
 * backward, against (1) the same op run in float32 on the upcast inputs and
 * rounded to the dtype, and (2) torch 1.13 (CPU) through the fixtures of
 * tests/fixtures/half/ (tools/reference/make_half_ops.py writes them; its
 * docstring has the command and the inputs). Also PyTorch's type
 * promotion for mixed inputs, ts_to_dtype with autograd, gradient
 * accumulation into 16-bit leaves, and the dtype errors.
 *
 * Comparison classes (the `fwd32`, `bwd32`, `torch_fwd`, `torch_bwd` fields
 * of a case; u = 2^-8 for bf16, 2^-11 for f16, the largest relative
 * spacing of the dtype, so one rounding is at most u/2 * |value|):
 *  EXACT  bit for bit. Every forward against both references except the
 *         ones listed below; every backward whose formula reads only the
 *         16-bit inputs (relu, gelu, log, abs, pow 2, add/sub/mul, the
 *         scalar ops, reductions, shape ops, casts).
 *  RELk   |got - want| <= k u max(|want|, 2^-4 max|want| of the tensor)
 *         (the floor covers results near 0 that cancel).
 *         - vs the float32 run, backward of ops whose gradient reads a
 *           saved 16-bit tensor that the float32 run has unrounded: exp,
 *           sqrt (rounded output, one u/2 plus the result's u/2: REL2),
 *           rsqrt (the rounded output cubed, 3 u/2 + u/2: REL4), div's
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
 *         error absolute, |g| |dh/dy| |y| u/2 <= |g| u (COT2); gelu(tanh)'s
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
        if (strcmp(ts_dtype_name((ts_dtype)d), name) == 0)
            return (ts_dtype)d;
    cr_assert_fail("fixture names unknown dtype %s", name);
    return TS_DTYPE_COUNT;
}

/* The fixture tensor NAME as a new tensor, or NULL if the index lacks it. */
static ts_tensor *fx_tensor(const fx *f, const char *name)
{
    size_t nl = strlen(name);
    for (const char *l = f->index; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL) {
        if (strncmp(l, "tensor ", 7) != 0 || strncmp(l + 7, name, nl) != 0 || l[7 + nl] != ' ')
            continue;
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
        if (strncmp(l, key, strlen(key)) == 0)
            return true;
    return false;
}

/* ------------------------------------------------------------ comparisons */

static double relative_ulp(ts_dtype dt) { return dt == TS_BF16 ? 0x1p-8 : 0x1p-11; }

static void expect_match(enum cmp c, const char *what, const ts_tensor *got, const ts_tensor *want,
                         const ts_tensor *cot)
{
    if (c == NONE)
        return;
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
    for (int64_t i = 0; i < n; i++)
        maxw = fmax(maxw, fabs(b[i]));
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
            if (scale > 0)
                worst = fmax(worst, fabs(a[i] - b[i]) / (u * scale));
            continue;
        }
        cr_assert(fabs(a[i] - b[i]) <= tol, "%s: element %lld is %.9g, expected %.9g (tolerance %.3g)", what,
                  (long long)i, a[i], b[i], tol);
    }
    if (diag)
        fprintf(stderr, "DIAG %-55s cmp %d mismatches %5lld worst %.3g\n", what, (int)c, (long long)bad, worst);
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
    if (st)
        return st;
    st = ts_gt(x, z, o);
    ts_tensor_free(z);
    return st;
}

/* torch.where(x > 0, x, y) */
static ts_status f_where(ts_tensor **x, ts_tensor **o)
{
    ts_tensor *c;
    ts_status st = gt_scalar(x[0], 0.0, &c);
    if (st)
        return st;
    st = ts_where(c, x[0], x[1], o);
    ts_tensor_free(c);
    return st;
}

/* x.masked_fill(x > 0.5, 0.25) */
static ts_status f_masked_fill(ts_tensor **x, ts_tensor **o)
{
    ts_tensor *c;
    ts_status st = gt_scalar(x[0], 0.5, &c);
    if (st)
        return st;
    st = ts_masked_fill(x[0], c, 0.25, o);
    ts_tensor_free(c);
    return st;
}

static ts_status f_to_f32(ts_tensor **x, ts_tensor **o) { return ts_to_dtype(x[0], TS_F32, o); }

static ts_status f_t_contiguous(ts_tensor **x, ts_tensor **o)
{
    ts_tensor *t;
    ts_status st = ts_transpose(x[0], 0, 1, &t);
    if (st)
        return st;
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
    enum cmp fwd32, bwd32;     /* against the float32 run, rounded */
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
static void run_case(const hcase *c, ts_dtype dt, ts_tensor **ins, ts_tensor *cot, ts_tensor **out,
                     ts_tensor **grads)
{
    ts_tensor *leaves[2] = {NULL, NULL};
    for (int i = 0; i < c->n; i++) {
        leaves[i] = cast(ins[i], dt);
        TH_OK(ts_tensor_set_requires_grad(leaves[i], true));
    }
    ts_tensor *o;
    TH_OK(c->fn(leaves, &o));
    ts_tensor *g = cast(cot, ts_tensor_dtype(cot) == TS_F32 && strcmp(c->name, "to_f32") == 0 ? TS_F32
                             : ts_tensor_dtype(o));
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
