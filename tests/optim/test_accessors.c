/* optim_accessors: what a checkpoint reads of an optimizer through
 * optim.h (kind, state names, hyperparameters, step count). */
#include <criterion/criterion.h>
#include <string.h>

#include "optim/optim.h"
#include "tests/helpers.h"

static ts_tensor *param(void)
{
    int64_t shape[1] = {3};
    ts_tensor *t = NULL;
    TH_OK(ts_tensor_full(TS_F32, 1, shape, 0.5, &t));
    TH_OK(ts_tensor_set_requires_grad(t, true));
    return t;
}

Test(optim_accessors, sgd)
{
    ts_tensor *p = param();
    ts_sgd_options o = ts_sgd_options_default();
    o.lr = 0.25;
    o.momentum = 0.9;
    o.nesterov = true;
    ts_optim *opt = NULL;
    TH_OK(ts_sgd_new(1, &p, &o, &opt));
    cr_assert_str_eq(ts_optim_kind_name(opt), "SGD");
    cr_assert_eq(ts_optim_num_states(opt), 1);
    cr_assert_str_eq(ts_optim_state_name(opt, 0), "momentum_buffer");
    cr_assert_null(ts_optim_state_name(opt, 1));
    cr_assert_null(ts_optim_state_name(opt, -1));
    ts_optim_hparams hp;
    TH_OK(ts_optim_hparams_get(opt, &hp));
    cr_assert(hp.sgd && hp.nesterov && hp.lr == 0.25 && hp.momentum == 0.9 && hp.beta1 == 0.0);
    TH_OK(ts_optim_set_step_count(opt, 7));
    cr_assert_eq(ts_optim_step_count(opt), 7);
    cr_assert_eq(ts_optim_set_step_count(opt, -1), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_optim_step_count(opt), 7, "a refused count changes nothing");
    ts_optim_free(opt);

    o.momentum = 0.0;
    o.nesterov = false;
    TH_OK(ts_sgd_new(1, &p, &o, &opt));
    cr_assert_eq(ts_optim_num_states(opt), 0, "SGD without momentum keeps no state");
    ts_optim_free(opt);
    ts_tensor_free(p);
}

Test(optim_accessors, adam)
{
    ts_tensor *p = param();
    ts_adam_options o = ts_adamw_options_default();
    o.amsgrad = true;
    ts_optim *opt = NULL;
    TH_OK(ts_adamw_new(1, &p, &o, &opt));
    cr_assert_str_eq(ts_optim_kind_name(opt), "AdamW");
    static const char *const want[] = {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
    cr_assert_eq(ts_optim_num_states(opt), 4);
    for (int i = 0; i < 4; i++) cr_assert_str_eq(ts_optim_state_name(opt, i), want[i]);
    ts_optim_hparams hp;
    TH_OK(ts_optim_hparams_get(opt, &hp));
    cr_assert(!hp.sgd && hp.amsgrad && hp.beta1 == o.beta1 && hp.beta2 == o.beta2 && hp.eps == o.eps);
    ts_optim_free(opt);
    cr_assert_null(ts_optim_kind_name(NULL));
    cr_assert_eq(ts_optim_num_states(NULL), 0);
    cr_assert_eq(ts_optim_hparams_get(NULL, &hp), TS_ERR_INVALID_ARGUMENT);
    ts_tensor_free(p);
}
