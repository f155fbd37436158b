#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "fully_shard/fully_shard.h"
#include "tests/helpers.h"

/* ts_mp_policy: its value and its checks. */

Test(fully_shard_mp_policy, default_keeps_every_dtype)
{
    ts_mp_policy p = ts_mp_policy_default();
    cr_assert_eq(p.param_dtype, TS_DTYPE_KEEP);
    cr_assert_eq(p.reduce_dtype, TS_DTYPE_KEEP);
    cr_assert_eq(p.output_dtype, TS_DTYPE_KEEP);
    cr_assert(p.cast_forward_inputs);
    TH_OK(ts_mp_policy_check(&p));
    /* KEEP is no dtype a tensor can have */
    cr_assert_eq(ts_dtype_size(TS_DTYPE_KEEP), 0);
    cr_assert_null(ts_fsdp_options_default().mp_policy);
}

Test(fully_shard_mp_policy, every_floating_dtype_is_accepted)
{
    const ts_dtype fl[5] = {TS_F32, TS_F64, TS_BF16, TS_F16, TS_DTYPE_KEEP};
    for (int a = 0; a < 5; a++)
        for (int b = 0; b < 5; b++)
            for (int c = 0; c < 5; c++) {
                ts_mp_policy p = {fl[a], fl[b], fl[c], (a + b + c) % 2 == 0};
                TH_OK(ts_mp_policy_check(&p));
            }
    /* zeroed: every field float32, which is a valid policy */
    ts_mp_policy z;
    memset(&z, 0, sizeof z);
    TH_OK(ts_mp_policy_check(&z));
}

Test(fully_shard_mp_policy, integer_dtypes_are_refused_by_name)
{
    const ts_dtype ints[3] = {TS_I64, TS_I32, TS_BOOL};
    const char *fields[3] = {"param_dtype", "reduce_dtype", "output_dtype"};
    for (int f = 0; f < 3; f++)
        for (int i = 0; i < 3; i++) {
            ts_mp_policy p = ts_mp_policy_default();
            ts_dtype *slot = f == 0 ? &p.param_dtype : f == 1 ? &p.reduce_dtype : &p.output_dtype;
            *slot = ints[i];
            cr_assert_eq(ts_mp_policy_check(&p), TS_ERR_DTYPE, "%s %s", fields[f], ts_dtype_name(ints[i]));
            char want[64];
            snprintf(want, sizeof want, "%s %s is not a floating-point dtype", fields[f], ts_dtype_name(ints[i]));
            cr_assert(strstr(ts_last_error(), want), "%s", ts_last_error());
        }
}

Test(fully_shard_mp_policy, values_that_are_no_dtype_are_refused)
{
    const int vals[3] = {(int)TS_DTYPE_COUNT, 42, -1};
    for (int i = 0; i < 3; i++) {
        ts_mp_policy p = ts_mp_policy_default();
        p.reduce_dtype = (ts_dtype)vals[i];
        cr_assert_eq(ts_mp_policy_check(&p), TS_ERR_INVALID_ARGUMENT);
        char want[80];
        snprintf(want, sizeof want, "reduce_dtype %d is neither a ts_dtype nor TS_DTYPE_KEEP", (int)(ts_dtype)vals[i]);
        cr_assert(strstr(ts_last_error(), want), "%s", ts_last_error());
    }
    cr_assert_eq(ts_mp_policy_check(NULL), TS_ERR_INVALID_ARGUMENT);
}
