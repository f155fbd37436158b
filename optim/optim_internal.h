/* What the files of optim/ share among themselves (optim.c, kernels.c,
 * fused.c, clip.c; not installed, and for no other layer: the cross-layer
 * hooks are in optim/internal.h): the optimizer object, the kernels'
 * argument blocks and the row walk. */
#ifndef TS_OPTIM_OPTIM_INTERNAL_H
#define TS_OPTIM_OPTIM_INTERNAL_H

#include "optim/internal.h"

typedef enum opt_kind { OPT_SGD = 0, OPT_ADAM, OPT_ADAMW } opt_kind;

typedef struct opt_param {
    ts_tensor *param;                /* retained, as given (may be shard-marked) */
    ts_tensor *local;                /* retained local view on param's data */
    bool ready;                      /* state exists (torch: self.state[p] not empty) */
    ts_tensor *momentum_buffer;      /* SGD with momentum */
    ts_tensor *exp_avg, *exp_avg_sq; /* Adam(W) */
    ts_tensor *max_exp_avg_sq;       /* Adam(W) amsgrad */
    ts_tensor *step;                 /* Adam(W): 0-d f32, torch's state['step'] */
} opt_param;

struct ts_optim {
    opt_kind kind;
    int n;
    opt_param *p;
    ts_tensor **params;  /* p[i].param, in order (borrowed), for the upper layer's check */
    bool warned_no_grad; /* a step without any gradient was reported */
    double lr;
    ts_sgd_options sgd;
    ts_adam_options adam;
    int64_t steps;
    bool fused;     /* the options' fused: state in one buffer per dtype, runs updated at once */
    bool arenas;    /* fused: every parameter's state views exist */
    int last_calls; /* fused: kernel calls (runs and strided parameters) of the last step */
};

/* An update kernel over one row of n elements: param row p (stride sp),
 * gradient row g (stride sg), state at linear element index `lin` (state
 * tensors are contiguous, in the parameter's row-major order). */
typedef void (*row_fn)(const void *k, int64_t n, void *p, int64_t sp, const void *g, int64_t sg, int64_t lin);

/* SGD kernel arguments (kernels.c; made by ts__optim_sgd_args). */
typedef struct sgd_k {
    double lr, wd, momentum, damp1; /* damp1 = 1 - dampening */
    bool nesterov, maximize, first; /* first: the buffer is new (buf = d_p.clone()) */
    void *buf;                      /* momentum buffer data or NULL */
} sgd_k;

/* Adam(W) kernel arguments (kernels.c; made by ts__optim_adam_args). */
typedef struct adam_k {
    double wd;                       /* Adam's L2 term (0 for AdamW) */
    double decay;                    /* AdamW: 1 - lr * weight_decay */
    double beta1, omb1, beta2, omb2; /* omb = 1 - beta */
    double bc2_sqrt, eps, neg_step_size;
    bool adamw, amsgrad, maximize;
    void *exp_avg, *exp_avg_sq, *max_exp_avg_sq;
} adam_k;

/* optim.c: "parameter 3 ('fc.weight')" or "parameter 3", written to buf. */
const char *ts__optim_param_label(int i, const ts_tensor *t, char *buf, size_t len);
/* kernels.c: runs fn over every innermost row of a and b (same shape). */
void ts__optim_walk_rows(ts_tensor *a, const ts_tensor *b, row_fn fn, const void *k);
/* kernels.c: the SGD / Adam(W) row kernel of this step's build for f32 (else f64) data. */
row_fn ts__optim_sgd_kernel(bool f32);
row_fn ts__optim_adam_kernel(bool f32);
/* optim.c: the SGD kernel's arguments for parameter pp's update this step. */
sgd_k ts__optim_sgd_args(const ts_optim *o, const opt_param *pp);
/* optim.c: counts pp's step (its "step" state += 1) and returns its Adam kernel arguments. */
adam_k ts__optim_adam_args(const ts_optim *o, opt_param *pp);
/* fused.c: the fused step over every parameter with a gradient (state allocated). */
void ts__optim_fused_step(ts_optim *o);

#endif
