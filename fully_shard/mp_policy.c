/*
 * The mixed-precision policy's value and its checks (fully_shard.h,
 * "mixed precision"; docs/fully_shard.md, "Mixed precision"). The casts themselves run
 * in the group's hooks.
 * Floor 1 (internal.h, "Floors"): calls no other file of fully_shard/.
 */
#include "fully_shard/fully_shard.h"

_Static_assert((int)TS_DTYPE_KEEP > (int)TS_DTYPE_COUNT, "TS_DTYPE_KEEP must not be a dtype");

ts_mp_policy ts_mp_policy_default(void)
{
    ts_mp_policy p;
    p.param_dtype = TS_DTYPE_KEEP;
    p.reduce_dtype = TS_DTYPE_KEEP;
    p.output_dtype = TS_DTYPE_KEEP;
    p.cast_forward_inputs = true;
    return p;
}

static ts_status check_field(const char *field, ts_dtype d)
{
    if (d == TS_DTYPE_KEEP) return TS_OK;
    if ((unsigned)d >= (unsigned)TS_DTYPE_COUNT)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "ts_mp_policy: %s %d is neither a ts_dtype nor TS_DTYPE_KEEP (start from "
                        "ts_mp_policy_default())",
                        field, (int)d);
    if (!ts_dtype_is_float(d))
        return ts_error(TS_ERR_DTYPE,
                        "ts_mp_policy: %s %s is not a floating-point dtype (float32, float64, bfloat16, float16, or "
                        "TS_DTYPE_KEEP for no cast)",
                        field, ts_dtype_name(d));
    return TS_OK;
}

ts_status ts_mp_policy_check(const ts_mp_policy *p)
{
    if (!p) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_mp_policy_check: policy is NULL");
    ts_status st;
    if ((st = check_field("param_dtype", p->param_dtype))) return st;
    if ((st = check_field("reduce_dtype", p->reduce_dtype))) return st;
    if ((st = check_field("output_dtype", p->output_dtype))) return st;
    return TS_OK;
}
