#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/helpers.h"

static ts_module *mlp(int64_t hidden)
{
    ts_module *k[3], *m;
    TH_OK(ts_linear_new(4, hidden, true, &k[0]));
    TH_OK(ts_tanh_new(&k[1]));
    TH_OK(ts_linear_new(hidden, 2, true, &k[2]));
    TH_OK(ts_sequential_new(3, k, &m));
    return m;
}

Test(nn_state_dict, round_trip_between_models)
{
    th_mem_mark();
    ts_manual_seed(1);
    ts_module *a = mlp(8);
    ts_manual_seed(2);
    ts_module *b = mlp(8);
    ts_state_dict *sa;
    TH_OK(ts_module_state_dict(a, &sa));
    cr_assert_eq(ts_state_dict_size(sa), 4);
    cr_assert_str_eq(ts_state_dict_name(sa, 0), "0.weight");
    cr_assert_str_eq(ts_state_dict_name(sa, 3), "2.bias");
    TH_OK(ts_module_load_state_dict(b, sa, true));
    ts_state_dict *sb;
    TH_OK(ts_module_state_dict(b, &sb));
    for (int i = 0; i < 4; i++) th_assert_close(ts_state_dict_tensor(sb, i), ts_state_dict_tensor(sa, i), 0, 0);
    ts_state_dict_free(sa);
    ts_state_dict_free(sb);
    ts_module_free(a);
    ts_module_free(b);
    th_mem_assert_back();
}

Test(nn_state_dict, strict_lists_missing_and_unexpected_keys)
{
    ts_module *a = mlp(8);
    ts_state_dict *sd, *orig;
    TH_OK(ts_module_state_dict(a, &orig));
    TH_OK(ts_state_dict_new(&sd));
    TH_OK(ts_state_dict_set(sd, "0.weight", ts_state_dict_get(orig, "0.weight")));
    TH_OK(ts_state_dict_set(sd, "0.bias", ts_state_dict_get(orig, "0.bias")));
    TH_OK(ts_state_dict_set(sd, "3.weight", ts_state_dict_get(orig, "2.weight")));
    cr_assert_eq(ts_module_load_state_dict(a, sd, true), TS_ERR_NOT_FOUND);
    const char *msg = ts_last_error();
    cr_assert(strstr(msg, "missing keys (2)") && strstr(msg, "'2.weight'") && strstr(msg, "'2.bias'"), "%s", msg);
    cr_assert(strstr(msg, "unexpected keys (1)") && strstr(msg, "'3.weight'"), "%s", msg);
    /* non-strict loads what matches */
    TH_OK(ts_module_load_state_dict(a, sd, false));
    ts_state_dict_free(sd);
    ts_state_dict_free(orig);
    ts_module_free(a);
}

Test(nn_state_dict, shape_mismatch_names_key_and_shapes_and_copies_nothing)
{
    ts_manual_seed(1);
    ts_module *a = mlp(8);
    ts_manual_seed(2);
    ts_module *b = mlp(6);
    ts_state_dict *sb, *live;
    TH_OK(ts_module_state_dict(b, &sb));
    TH_OK(ts_module_state_dict(a, &live));
    /* state dicts alias the parameters: keep copies of the values */
    ts_tensor *before[4];
    for (int i = 0; i < 4; i++) TH_OK(ts_clone(ts_state_dict_tensor(live, i), &before[i]));
    cr_assert_eq(ts_module_load_state_dict(a, sb, true), TS_ERR_SHAPE);
    const char *msg = ts_last_error();
    cr_assert(strstr(msg, "0.weight: checkpoint (6, 4) vs model (8, 4)") != NULL, "%s", msg);
    cr_assert(strstr(msg, "3 parameters") != NULL, "%s", msg);
    /* 2.bias has the same shape in both, but nothing is copied on error */
    for (int i = 0; i < 4; i++) {
        th_assert_close(ts_state_dict_tensor(live, i), before[i], 0, 0);
        ts_tensor_free(before[i]);
    }
    ts_state_dict_free(sb);
    ts_state_dict_free(live);
    ts_module_free(a);
    ts_module_free(b);
}
