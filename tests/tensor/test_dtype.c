#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "tests/helpers.h"

Test(tensor_dtype, sizes_and_names)
{
    cr_assert_eq(ts_dtype_size(TS_F32), 4);
    cr_assert_eq(ts_dtype_size(TS_BF16), 2);
    cr_assert_eq(ts_dtype_size(TS_I64), 8);
    cr_assert_eq(ts_dtype_size(TS_BOOL), 1);
    cr_assert_eq(ts_dtype_size(TS_DTYPE_COUNT), 0);
    cr_assert_str_eq(ts_dtype_name(TS_BF16), "bfloat16");
    cr_assert_str_eq(ts_dtype_name(TS_F16), "float16");
    cr_assert_str_eq(ts_dtype_name((ts_dtype)99), "invalid");
    cr_assert(ts_dtype_is_float(TS_F16));
    cr_assert(!ts_dtype_is_float(TS_I32));
}

Test(tensor_dtype, casts_between_every_pair)
{
    th_mem_mark();
    int64_t s[1] = {6};
    double v[6] = {0.0, 1.0, -2.5, 3.75, 100.0, -0.0};
    ts_dtype all[] = {TS_F32, TS_F64, TS_BF16, TS_F16, TS_I64, TS_I32, TS_BOOL};
    for (size_t i = 0; i < 7; i++)
        for (size_t j = 0; j < 7; j++) {
            ts_tensor *a = th_tensor(all[i], 1, s, v), *b, *back;
            TH_OK(ts_to_dtype(a, all[j], &b));
            cr_assert_eq(ts_tensor_dtype(b), all[j]);
            TH_OK(ts_to_dtype(b, TS_F64, &back));
            for (int64_t k = 0; k < 6; k++) {
                double want = v[k], got;
                if (!ts_dtype_is_float(all[i]) || !ts_dtype_is_float(all[j]))
                    want = trunc(want); /* an integer on either side truncates */
                if (all[i] == TS_BOOL || all[j] == TS_BOOL) want = v[k] != 0;
                int64_t ix[1] = {k};
                TH_OK(ts_tensor_get(back, ix, &got));
                cr_assert_float_eq(got, want, 0, "%s -> %s element %lld: %g vs %g", ts_dtype_name(all[i]),
                                   ts_dtype_name(all[j]), (long long)k, got, want);
            }
            ts_tensor_free(a);
            ts_tensor_free(b);
            ts_tensor_free(back);
        }
    th_mem_assert_back();
}

Test(tensor_dtype, creation_rejects_bad_shapes)
{
    ts_tensor *t;
    int64_t neg[2] = {2, -1};
    cr_assert_eq(ts_tensor_empty(TS_F32, 2, neg, &t), TS_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(ts_last_error(), "-1") != NULL, "%s", ts_last_error());
    int64_t s[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
    cr_assert_eq(ts_tensor_empty(TS_F32, 9, s, &t), TS_ERR_INVALID_ARGUMENT);
    cr_assert_eq(ts_tensor_empty((ts_dtype)42, 1, s, &t), TS_ERR_INVALID_ARGUMENT);
    int64_t z[2] = {0, 5};
    TH_OK(ts_tensor_zeros(TS_F32, 2, z, &t));
    cr_assert_eq(ts_tensor_numel(t), 0);
    ts_tensor_free(t);
}

Test(tensor_dtype, item_get_and_copy_to)
{
    int64_t s[2] = {2, 2};
    double v[4] = {1, 2, 3, 4};
    ts_tensor *a = th_tensor(TS_I32, 2, s, v), *sc;
    double x;
    cr_assert_eq(ts_tensor_item(a, &x), TS_ERR_SHAPE);
    int64_t bad[2] = {0, 2};
    cr_assert_eq(ts_tensor_get(a, bad, &x), TS_ERR_INDEX);
    int32_t buf[4];
    cr_assert_eq(ts_tensor_copy_to(a, buf, 8), TS_ERR_INVALID_ARGUMENT);
    TH_OK(ts_tensor_copy_to(a, buf, sizeof buf));
    cr_assert(buf[0] == 1 && buf[3] == 4);
    TH_OK(ts_tensor_scalar(TS_F64, 2.5, &sc));
    TH_OK(ts_tensor_item(sc, &x));
    cr_assert_float_eq(x, 2.5, 0);
    char str[32];
    cr_assert_str_eq(ts_tensor_shape_str(a, str, sizeof str), "(2, 2)");
    ts_tensor_free(a);
    ts_tensor_free(sc);
}
