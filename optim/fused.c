/*
 * The fused step (ts_optim_step with the options' fused): runs of
 * parameters adjacent in memory updated by one kernel call each.
 */
#define _GNU_SOURCE
#include "optim/optim_internal.h"
#include "tensor/kernels.h"

/* A run of parameters updated by one kernel call: the first one's kernel
 * arguments (its state pointers and, for Adam, its step's bias
 * corrections, which every parameter of the run shares), its data and
 * gradient, and the run's element count. */
typedef struct fused_run {
    bool open, f32;
    int64_t n;
    size_t es;
    unsigned char *p;
    const unsigned char *g;
    sgd_k sk;
    adam_k ak;
} fused_run;

static void run_flush(ts_optim *o, fused_run *r)
{
    if (!r->open) return;
    o->last_calls++;
    if (o->kind == OPT_SGD) ts__optim_sgd_kernel(r->f32)(&r->sk, r->n, r->p, 1, r->g, 1, 0);
    else ts__optim_adam_kernel(r->f32)(&r->ak, r->n, r->p, 1, r->g, 1, 0);
    r->open = false;
}

/* a + n elements of size es == b, for possibly NULL pointers */
static bool adjacent(const void *a, int64_t n, size_t es, const void *b)
{
    return a && b && (const unsigned char *)a + (size_t)n * es == (const unsigned char *)b;
}

/* True if parameter pp (kernel arguments sk / ak, data p, gradient g) is
 * where run r ends in every buffer (data, gradient, each state) and takes
 * the same kernel arguments but for those pointers. */
static bool run_extends(const ts_optim *o, const fused_run *r, bool f32, const unsigned char *p, const unsigned char *g,
                        const sgd_k *sk, const adam_k *ak)
{
    if (!r->open || r->f32 != f32 || !adjacent(r->p, r->n, r->es, p) || !adjacent(r->g, r->n, r->es, g)) return false;
    if (o->kind == OPT_SGD) return r->sk.first == sk->first && (!sk->buf || adjacent(r->sk.buf, r->n, r->es, sk->buf));
    return r->ak.bc2_sqrt == ak->bc2_sqrt && r->ak.neg_step_size == ak->neg_step_size &&
        adjacent(r->ak.exp_avg, r->n, r->es, ak->exp_avg) && adjacent(r->ak.exp_avg_sq, r->n, r->es, ak->exp_avg_sq) &&
        (!ak->max_exp_avg_sq || adjacent(r->ak.max_exp_avg_sq, r->n, r->es, ak->max_exp_avg_sq));
}

/* The fused step: every parameter with a gradient, in order; contiguous
 * ones join the open run of their dtype when they continue it in memory,
 * else start a new one (updates of different parameters are independent,
 * so their order does not matter); non-contiguous ones are walked by rows
 * as without fused. Each
 * element is computed by the same kernel with the same arguments as in
 * the per-parameter step, so the bits are the same. */
void ts__optim_fused_step(ts_optim *o)
{
    fused_run runs[2] = {{0}}; /* the open run of float32 and of float64 parameters */
    o->last_calls = 0;
    for (int i = 0; i < o->n; i++) {
        opt_param *pp = &o->p[i];
        ts_tensor *g = ts_tensor_grad(pp->param);
        if (!g) continue;
        if (ts_tensor_is_meta(pp->local) || ts_tensor_is_meta(g)) { /* meta: state allocated, nothing to compute */
            pp->ready = true;
            continue;
        }
        sgd_k sk = {0};
        adam_k ak = {0};
        if (o->kind == OPT_SGD) sk = ts__optim_sgd_args(o, pp);
        else ak = ts__optim_adam_args(o, pp);
        pp->ready = true;
        int64_t n = ts_tensor_numel(pp->local);
        if (n == 0) continue;
        bool f32 = ts_tensor_dtype(pp->local) == TS_F32;
        if (!ts_tensor_is_contiguous(pp->local) || !ts_tensor_is_contiguous(g)) {
            ts__optim_walk_rows(pp->local, g,
                                o->kind == OPT_SGD ? ts__optim_sgd_kernel(f32) : ts__optim_adam_kernel(f32),
                                o->kind == OPT_SGD ? (const void *)&sk : (const void *)&ak);
            o->last_calls++;
            continue;
        }
        unsigned char *p = ts_tensor_data(pp->local);
        const unsigned char *gd = ts_tensor_data(g);
        fused_run *r = &runs[f32 ? 0 : 1];
        if (run_extends(o, r, f32, p, gd, &sk, &ak)) {
            r->n += n;
            continue;
        }
        run_flush(o, r);
        *r = (fused_run){.open = true, .f32 = f32, .n = n, .es = f32 ? 4 : 8, .p = p, .g = gd, .sk = sk, .ak = ak};
    }
    run_flush(o, &runs[0]);
    run_flush(o, &runs[1]);
}
