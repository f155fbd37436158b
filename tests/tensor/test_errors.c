/* Bad input gives the right status and a ts_last_error() detail that
 * names the op and the values that did not fit (docs/design.md D1), and
 * nothing is written to the output. */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "tests/helpers.h"

/* Asserts that `expr` returns `status` and that the last error contains
 * every one of the NULL-terminated strings. */
#define EXPECT_ERR(expr, status, ...) \
    do { \
        ts_status e_st_ = (expr); \
        cr_assert_eq(e_st_, (status), "%s -> %s, expected %s (%s)", #expr, ts_status_name(e_st_), \
                     ts_status_name(status), ts_last_error()); \
        cr_assert_eq(ts_last_status(), (status), "%s: last status %s", #expr, ts_status_name(ts_last_status())); \
        const char *e_want_[] = {__VA_ARGS__, NULL}; \
        for (int e_i_ = 0; e_want_[e_i_]; e_i_++) \
            cr_assert(strstr(ts_last_error(), e_want_[e_i_]) != NULL, "%s: '%s' not in \"%s\"", #expr, e_want_[e_i_], \
                      ts_last_error()); \
    } while (0)

Test(tensor_errors, add_shape_mismatch_names_both_shapes)
{
    th_mem_mark();
    int64_t s1[2] = {2, 3}, s2[2] = {4, 5};
    ts_tensor *a = th_seq(TS_F32, 2, s1, 1, false), *b = th_seq(TS_F32, 2, s2, 1, false), *o = NULL;
    EXPECT_ERR(ts_add(a, b, &o), TS_ERR_SHAPE, "add", "(2, 3)", "(4, 5)");
    cr_assert_null(o, "out written on failure");
    EXPECT_ERR(ts_mul(b, a, &o), TS_ERR_SHAPE, "mul", "(4, 5)", "(2, 3)");
    cr_assert_null(o);
    ts_tensor_free(a);
    ts_tensor_free(b);
    th_mem_assert_back();
}

Test(tensor_errors, dtype_mismatch_names_both_dtypes)
{
    th_mem_mark();
    int64_t s[1] = {3};
    ts_tensor *a = th_seq(TS_F32, 1, s, 1, false), *b = th_seq(TS_F64, 1, s, 1, false), *o = NULL;
    double iv[3] = {1, 2, 3};
    ts_tensor *i = th_tensor(TS_I64, 1, s, iv);
    /* float32 + float64 promotes (PyTorch's rule, tests/tensor/test_half_ops.c);
     * int64 + bool promotes to int64, which arithmetic refuses */
    ts_tensor *bo = th_tensor(TS_BOOL, 1, s, iv);
    EXPECT_ERR(ts_add(i, bo, &o), TS_ERR_DTYPE, "add", "int64", "bool");
    ts_tensor_free(bo);
    EXPECT_ERR(ts_matmul(a, b, &o), TS_ERR_DTYPE, "matmul", "float32", "float64");
    /* integers are not arithmetic dtypes here */
    EXPECT_ERR(ts_sub(i, i, &o), TS_ERR_DTYPE, "sub", "int64");
    EXPECT_ERR(ts_exp(i, &o), TS_ERR_DTYPE, "exp", "int64");
    EXPECT_ERR(ts_sum(i, 0, NULL, false, &o), TS_ERR_DTYPE, "sum", "int64");
    cr_assert_null(o);
    ts_tensor_free(a);
    ts_tensor_free(b);
    ts_tensor_free(i);
    th_mem_assert_back();
}

Test(tensor_errors, out_of_range_dims)
{
    th_mem_mark();
    int64_t s[2] = {2, 3};
    ts_tensor *a = th_seq(TS_F32, 2, s, 1, false), *o = NULL, *outs[4];
    int d3 = 3, dm3 = -3;
    int n;
    EXPECT_ERR(ts_sum(a, 1, &d3, false, &o), TS_ERR_INDEX, "sum", "dimension 3", "2 dims");
    EXPECT_ERR(ts_mean(a, 1, &dm3, true, &o), TS_ERR_INDEX, "mean", "-3");
    EXPECT_ERR(ts_softmax(a, 2, &o), TS_ERR_INDEX, "softmax", "dimension 2");
    EXPECT_ERR(ts_log_softmax(a, -3, &o), TS_ERR_INDEX, "log_softmax", "-3");
    EXPECT_ERR(ts_max_dim(a, 5, false, &o, NULL), TS_ERR_INDEX, "max", "5");
    EXPECT_ERR(ts_transpose(a, 0, 4, &o), TS_ERR_INDEX, "transpose", "4");
    EXPECT_ERR(ts_split(a, 1, 2, 4, outs, &n), TS_ERR_INDEX, "split", "2");
    EXPECT_ERR(ts_cat(1, &a, -3, &o), TS_ERR_INDEX, "cat", "-3");
    EXPECT_ERR(ts_unsqueeze(a, 4, &o), TS_ERR_INDEX, "unsqueeze", "4");
    cr_assert_null(o);
    ts_tensor_free(a);
    th_mem_assert_back();
}

Test(tensor_errors, view_of_non_viewable_layout)
{
    th_mem_mark();
    int64_t s[2] = {3, 4}, flat[1] = {12};
    ts_tensor *a = th_seq(TS_F32, 2, s, 1, false), *t, *o = NULL;
    TH_OK(ts_transpose(a, 0, 1, &t)); /* (4, 3), strides (1, 4) */
    EXPECT_ERR(ts_view(t, 1, flat, &o), TS_ERR_NOT_VIEWABLE, "view", "(4, 3)", "(12,)", "ts_reshape");
    cr_assert_null(o);
    /* reshape copies instead, and view still refuses wrong element counts */
    TH_OK(ts_reshape(t, 1, flat, &o));
    ts_tensor_free(o);
    o = NULL;
    int64_t bad[1] = {10};
    EXPECT_ERR(ts_view(a, 1, bad, &o), TS_ERR_SHAPE, "view", "(10,)", "12");
    cr_assert_null(o);
    ts_tensor_free(t);
    ts_tensor_free(a);
    th_mem_assert_back();
}

Test(tensor_errors, backward_on_non_scalar_without_gradient)
{
    th_mem_mark();
    int64_t s[2] = {2, 3};
    ts_tensor *x = th_seq(TS_F32, 2, s, 1, true), *y;
    TH_OK(ts_mul_scalar(x, 2.0, &y));
    EXPECT_ERR(ts_backward(y, NULL, false), TS_ERR_AUTOGRAD, "ts_backward", "(2, 3)", "one element");
    cr_assert_null(ts_tensor_grad(x), "a failed backward wrote a gradient");
    /* with a gradient of the right shape it works */
    ts_tensor *g;
    TH_OK(ts_tensor_ones(TS_F32, 2, s, &g));
    TH_OK(ts_backward(y, g, false));
    cr_assert_not_null(ts_tensor_grad(x));
    ts_tensor_free(g);
    ts_tensor_free(y);
    ts_tensor_free(x);
    th_mem_assert_back();
}

Test(tensor_errors, backward_twice_through_released_graph)
{
    th_mem_mark();
    int64_t s[1] = {3};
    ts_tensor *x = th_seq(TS_F64, 1, s, 1, true), *y, *l;
    TH_OK(ts_mul(x, x, &y));
    TH_OK(ts_sum(y, 0, NULL, false, &l));
    TH_OK(ts_backward(l, NULL, false));
    EXPECT_ERR(ts_backward(l, NULL, false), TS_ERR_AUTOGRAD, "second time", "retain_graph");
    ts_tensor_free(l);
    ts_tensor_free(y);
    ts_tensor_free(x);
    th_mem_assert_back();
}

Test(tensor_errors, matmul_inner_dim_mismatch)
{
    th_mem_mark();
    int64_t s1[2] = {2, 3}, s2[2] = {4, 5}, s3[3] = {7, 2, 3};
    ts_tensor *a = th_seq(TS_F32, 2, s1, 1, false), *b = th_seq(TS_F32, 2, s2, 1, false),
              *c = th_seq(TS_F32, 3, s3, 1, false), *o = NULL;
    EXPECT_ERR(ts_matmul(a, b, &o), TS_ERR_SHAPE, "matmul", "(2, 3)", "(4, 5)", "3 columns", "4 rows");
    EXPECT_ERR(ts_matmul(c, b, &o), TS_ERR_SHAPE, "matmul", "(7, 2, 3)", "(4, 5)");
    EXPECT_ERR(ts_linear(a, b, NULL, &o), TS_ERR_SHAPE, "linear", "(2, 3)", "(4, 5)");
    cr_assert_null(o);
    ts_tensor_free(a);
    ts_tensor_free(b);
    ts_tensor_free(c);
    th_mem_assert_back();
}

Test(tensor_errors, embedding_index_out_of_range)
{
    th_mem_mark();
    int64_t sw[2] = {5, 2}, si[1] = {3};
    double iv[3] = {0, 7, 2};
    ts_tensor *w = th_seq(TS_F32, 2, sw, 1, true), *i = th_tensor(TS_I64, 1, si, iv), *o = NULL;
    EXPECT_ERR(ts_embedding(w, i, &o), TS_ERR_INDEX, "embedding", "index 7", "position 1", "5 rows");
    cr_assert_null(o);
    ts_tensor_free(w);
    ts_tensor_free(i);
    th_mem_assert_back();
}

Test(tensor_errors, cross_entropy_target_out_of_range)
{
    th_mem_mark();
    int64_t sl[2] = {2, 3}, st[1] = {2};
    double tv[2] = {1, 9};
    ts_tensor *x = th_seq(TS_F32, 2, sl, 1, true), *t = th_tensor(TS_I64, 1, st, tv), *o = NULL;
    EXPECT_ERR(ts_cross_entropy(x, t, -100, TS_REDUCTION_MEAN, &o), TS_ERR_INDEX, "cross_entropy", "target 9",
               "3 classes", "-100");
    cr_assert_null(o);
    ts_tensor_free(x);
    ts_tensor_free(t);
    th_mem_assert_back();
}

Test(tensor_errors, released_storage_is_refused_until_restored)
{
    th_mem_mark();
    int64_t s[2] = {2, 3};
    ts_tensor *x = th_seq(TS_F32, 2, s, 1, false), *y = th_seq(TS_F32, 2, s, 1, false), *v, *o = NULL;
    TH_OK(ts_tensor_set_name(x, "blocks.0.bias"));
    TH_OK(ts_transpose(x, 0, 1, &v)); /* a view shares the storage */
    TH_OK(ts_storage_release(ts_tensor_storage(x)));
    cr_assert(ts_storage_is_released(ts_tensor_storage(x)));
    cr_assert_null(ts_tensor_data(x));
    EXPECT_ERR(ts_add(x, y, &o), TS_ERR_RELEASED, "add", "blocks.0.bias", "released", "(2, 3)");
    EXPECT_ERR(ts_add(y, x, &o), TS_ERR_RELEASED, "add", "input 1");
    EXPECT_ERR(ts_relu(x, &o), TS_ERR_RELEASED, "relu");
    EXPECT_ERR(ts_sum(x, 0, NULL, false, &o), TS_ERR_RELEASED, "sum");
    EXPECT_ERR(ts_matmul(v, y, &o), TS_ERR_RELEASED, "matmul", "(3, 2)");
    EXPECT_ERR(ts_contiguous(v, &o), TS_ERR_RELEASED, "contiguous");
    double val;
    int64_t idx[2] = {0, 0};
    EXPECT_ERR(ts_tensor_get(x, idx, &val), TS_ERR_RELEASED, "released");
    cr_assert_null(o);
    /* restored (contents undefined until written), ops work again */
    TH_OK(ts_storage_restore(ts_tensor_storage(x)));
    TH_OK(ts_tensor_fill_(x, 2.0));
    TH_OK(ts_add(x, y, &o));
    ts_tensor_free(o);
    ts_tensor_free(v);
    ts_tensor_free(x);
    ts_tensor_free(y);
    th_mem_assert_back();
}

Test(tensor_errors, backward_through_released_saved_tensor)
{
    th_mem_mark();
    int64_t s[1] = {3};
    ts_tensor *x = th_seq(TS_F32, 1, s, 1, true), *w = th_seq(TS_F32, 1, s, 1, false), *y, *l;
    TH_OK(ts_mul(x, w, &y)); /* saves w for x's gradient */
    TH_OK(ts_sum(y, 0, NULL, false, &l));
    TH_OK(ts_storage_release(ts_tensor_storage(w)));
    EXPECT_ERR(ts_backward(l, NULL, false), TS_ERR_RELEASED, "backward", "mul", "(3,)");
    TH_OK(ts_storage_restore(ts_tensor_storage(w)));
    ts_tensor_free(l);
    ts_tensor_free(y);
    ts_tensor_free(w);
    ts_tensor_free(x);
    th_mem_assert_back();
}

Test(tensor_errors, sharded_tensor_is_refused_but_local_view_works)
{
    th_mem_mark();
    int64_t sx[2] = {2, 4}, sw[2] = {3, 4};
    ts_tensor *x = th_seq(TS_F32, 2, sx, 1, false), *w = th_seq(TS_F32, 2, sw, 1, true), *o = NULL;
    int meta = 42;
    TH_OK(ts_tensor_set_name(w, "layers.0.weight"));
    ts_tensor_set_shard(w, &meta);
    cr_assert(ts_tensor_is_shard(w));
    cr_assert_eq(ts_tensor_dist_meta(w), &meta);
    EXPECT_ERR(ts_linear(x, w, NULL, &o), TS_ERR_SHARDED, "linear", "layers.0.weight", "ts_module_call",
               "ts_tensor_local_view", "(3, 4)");
    EXPECT_ERR(ts_matmul(w, x, &o), TS_ERR_SHARDED, "matmul", "layers.0.weight", "ts_module_call");
    EXPECT_ERR(ts_add(w, w, &o), TS_ERR_SHARDED, "add", "layers.0.weight");
    EXPECT_ERR(ts_sum(w, 0, NULL, false, &o), TS_ERR_SHARDED, "sum", "layers.0.weight");
    EXPECT_ERR(ts_transpose(w, 0, 1, &o), TS_ERR_SHARDED, "transpose", "layers.0.weight");
    int64_t s3[1] = {4};
    ts_tensor *ln_w = th_seq(TS_F32, 1, s3, 1, false);
    TH_OK(ts_tensor_set_name(ln_w, "norm.weight"));
    ts_tensor_set_shard(ln_w, &meta);
    EXPECT_ERR(ts_layer_norm(x, 1, ln_w, NULL, 1e-5, &o), TS_ERR_SHARDED, "layer_norm", "norm.weight");
    cr_assert_null(o);
    /* the local view: same data, no marker, no history; ops accept it */
    ts_tensor *lv;
    TH_OK(ts_tensor_local_view(w, &lv));
    cr_assert(!ts_tensor_is_shard(lv));
    cr_assert(ts_tensor_is_leaf(lv));
    cr_assert(!ts_tensor_requires_grad(lv));
    cr_assert_eq(ts_tensor_data(lv), ts_tensor_data(w));
    TH_OK(ts_linear(x, lv, NULL, &o));
    int64_t so[2] = {2, 3};
    cr_assert(ts_tensor_ndim(o) == 2 && ts_tensor_shape(o)[0] == so[0] && ts_tensor_shape(o)[1] == so[1]);
    ts_tensor_free(o);
    /* the marker stays on w until cleared */
    cr_assert(ts_tensor_is_shard(w));
    ts_tensor_clear_shard(w);
    TH_OK(ts_linear(x, w, NULL, &o));
    ts_tensor_free(o);
    ts_tensor_clear_shard(ln_w);
    ts_tensor_free(ln_w);
    ts_tensor_free(lv);
    ts_tensor_free(x);
    ts_tensor_free(w);
    th_mem_assert_back();
}

Test(tensor_errors, null_out_pointer_is_refused)
{
    th_mem_mark();
    int64_t s[1] = {2};
    ts_tensor *a = th_seq(TS_F32, 1, s, 1, false);
    EXPECT_ERR(ts_add(a, a, NULL), TS_ERR_INVALID_ARGUMENT, "add", "NULL");
    EXPECT_ERR(ts_exp(a, NULL), TS_ERR_INVALID_ARGUMENT, "exp", "NULL");
    EXPECT_ERR(ts_matmul(a, a, NULL), TS_ERR_INVALID_ARGUMENT, "matmul", "NULL");
    EXPECT_ERR(ts_add(a, NULL, NULL), TS_ERR_INVALID_ARGUMENT, "add", "input 1");
    EXPECT_ERR(ts_sum(a, 0, NULL, false, NULL), TS_ERR_INVALID_ARGUMENT, "sum", "NULL");
    EXPECT_ERR(ts_softmax(a, 0, NULL), TS_ERR_INVALID_ARGUMENT, "softmax", "NULL");
    EXPECT_ERR(ts_eq(a, a, NULL), TS_ERR_INVALID_ARGUMENT, "eq", "NULL");
    EXPECT_ERR(ts_mse_loss(a, a, TS_REDUCTION_MEAN, NULL), TS_ERR_INVALID_ARGUMENT, "mse_loss", "NULL");
    EXPECT_ERR(ts_to_dtype(a, TS_F64, NULL), TS_ERR_INVALID_ARGUMENT, "to_dtype", "NULL");
    EXPECT_ERR(ts_transpose(a, 0, 0, NULL), TS_ERR_INVALID_ARGUMENT, "permute", "NULL");
    int64_t s2[2] = {1, 2};
    EXPECT_ERR(ts_view(a, 2, s2, NULL), TS_ERR_INVALID_ARGUMENT, "view", "NULL");
    ts_tensor_free(a);
    th_mem_assert_back();
}

Test(tensor_errors, null_arguments_are_invalid_arguments_not_crashes)
{
    th_mem_mark();
    int64_t s[2] = {2, 3};
    ts_tensor *a = th_seq(TS_F32, 2, s, 1, false), *one = th_seq(TS_F32, 0, NULL, 1, false);
    double v = -1;
    int64_t idx[2] = {0, 0};
    float buf[6];
    char str[32];
    EXPECT_ERR(ts_tensor_item(one, NULL), TS_ERR_INVALID_ARGUMENT, "ts_tensor_item", "value_out");
    EXPECT_ERR(ts_tensor_item(NULL, &v), TS_ERR_INVALID_ARGUMENT, "ts_tensor_item");
    EXPECT_ERR(ts_tensor_get(a, NULL, &v), TS_ERR_INVALID_ARGUMENT, "ts_tensor_get", "index");
    EXPECT_ERR(ts_tensor_get(a, idx, NULL), TS_ERR_INVALID_ARGUMENT, "ts_tensor_get", "value_out");
    EXPECT_ERR(ts_tensor_get(NULL, idx, &v), TS_ERR_INVALID_ARGUMENT, "ts_tensor_get");
    cr_assert_eq(v, -1, "nothing written");
    EXPECT_ERR(ts_tensor_copy_to(a, NULL, sizeof buf), TS_ERR_INVALID_ARGUMENT, "ts_tensor_copy_to", "buf");
    EXPECT_ERR(ts_tensor_copy_to(NULL, buf, sizeof buf), TS_ERR_INVALID_ARGUMENT, "ts_tensor_copy_to");
    cr_assert_null(ts_tensor_shape_str(a, NULL, 32));
    cr_assert_null(ts_tensor_shape_str(a, str, 0));
    cr_assert_null(ts_tensor_shape_str(NULL, str, sizeof str));
    cr_assert_str_eq(ts_tensor_shape_str(a, str, sizeof str), "(2, 3)");
    /* the accessors' neutral values (tensor/tensor.h) */
    cr_assert_eq(ts_tensor_ndim(NULL), 0);
    cr_assert_eq(ts_tensor_numel(NULL), 0);
    cr_assert_eq(ts_tensor_dtype(NULL), TS_DTYPE_COUNT);
    cr_assert_null(ts_tensor_shape(NULL));
    cr_assert_null(ts_tensor_strides(NULL));
    cr_assert_null(ts_tensor_storage(NULL));
    cr_assert_null(ts_tensor_data(NULL));
    cr_assert_eq(ts_tensor_size(NULL, 0), -1);
    cr_assert_not(ts_tensor_is_contiguous(NULL));
    cr_assert_not(ts_tensor_is_shard(NULL));
    ts_tensor_free(a);
    ts_tensor_free(one);
    th_mem_assert_back();
}

Test(tensor_errors, narrow_with_a_huge_length_is_an_index_error)
{
    th_mem_mark();
    int64_t s[2] = {4, 3};
    ts_tensor *a = th_seq(TS_F32, 2, s, 1, false), *o = NULL;
    /* start + length overflowed int64 and passed the check */
    EXPECT_ERR(ts_narrow(a, 0, INT64_MAX, 2, &o), TS_ERR_INDEX, "narrow", "9223372036854775807", "size 4");
    EXPECT_ERR(ts_narrow(a, 0, 2, INT64_MAX, &o), TS_ERR_INDEX, "narrow", "9223372036854775807");
    EXPECT_ERR(ts_narrow(a, 0, 3, INT64_MAX - 2, &o), TS_ERR_INDEX, "narrow");
    EXPECT_ERR(ts_narrow(a, 0, 5, 0, &o), TS_ERR_INDEX, "narrow", "start 5");
    cr_assert_null(o);
    TH_OK(ts_narrow(a, 0, 4, 0, &o)); /* an empty slice at the end is fine, as in torch */
    cr_assert_eq(ts_tensor_numel(o), 0);
    ts_tensor_free(o);
    TH_OK(ts_narrow(a, 0, -2, 2, &o));
    cr_assert_eq(ts_tensor_shape(o)[0], 2);
    ts_tensor_free(o);
    ts_tensor_free(a);
    th_mem_assert_back();
}

/* A shape whose product overflows int64 is refused, naming the size; the
 * product used to overflow (undefined behaviour) before the comparison
 * with the input's element count. */
Test(tensor_errors, view_and_reshape_with_huge_sizes_are_errors)
{
    th_mem_mark();
    int64_t s[1] = {6};
    ts_tensor *a = th_seq(TS_F32, 1, s, 1, false), *o = NULL;
    int64_t huge[3] = {INT64_MAX, INT64_MAX, 0}, infer[3] = {-1, INT64_MAX, 4}, neg[2] = {3, INT64_MIN};
    EXPECT_ERR(ts_view(a, 3, huge, &o), TS_ERR_INVALID_ARGUMENT, "view", "9223372036854775807", "overflows");
    EXPECT_ERR(ts_reshape(a, 3, huge, &o), TS_ERR_INVALID_ARGUMENT, "reshape", "9223372036854775807");
    EXPECT_ERR(ts_reshape(a, 3, infer, &o), TS_ERR_INVALID_ARGUMENT, "reshape", "dim 2 of size 4");
    EXPECT_ERR(ts_view(a, 2, neg, &o), TS_ERR_INVALID_ARGUMENT, "view", "-9223372036854775808");
    cr_assert_null(o);
    ts_tensor_free(a);
    th_mem_assert_back();
}

/* A step near INT64_MAX takes the first element, as torch's a[1::2**63-1];
 * ceil((end - start) / step) and stride * step used to overflow. */
Test(tensor_errors, slice_with_a_huge_step_takes_one_element)
{
    th_mem_mark();
    int64_t s[2] = {4, 3};
    double vals[12] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
    ts_tensor *a = th_tensor(TS_F32, 2, s, vals), *o = NULL;
    TH_OK(ts_slice(a, 0, 1, INT64_MAX, INT64_MAX, &o));
    cr_assert_eq(ts_tensor_ndim(o), 2);
    cr_assert_eq(ts_tensor_shape(o)[0], 1, "rows %lld", (long long)ts_tensor_shape(o)[0]);
    double v[3];
    th_vals(o, v, 3);
    cr_assert(v[0] == 3 && v[1] == 4 && v[2] == 5, "row 1 of a: %g %g %g", v[0], v[1], v[2]);
    ts_tensor_free(o);
    TH_OK(ts_slice(a, 1, INT64_MIN, INT64_MAX, INT64_MAX - 1, &o));
    cr_assert_eq(ts_tensor_shape(o)[1], 1);
    ts_tensor_free(o);
    TH_OK(ts_slice(a, 0, 4, INT64_MAX, INT64_MAX, &o)); /* empty */
    cr_assert_eq(ts_tensor_numel(o), 0);
    ts_tensor_free(o);
    ts_tensor_free(a);
    th_mem_assert_back();
}

/* A fill value the dtype cannot hold is refused, as torch.full, fill_ and
 * masked_fill raise "value cannot be converted to type ... without
 * overflow" (torch 1.13's
 * torch.full((2,), v, dtype=...), checked with Debian's python3-torch); integer fills used to clamp NaN to 0 and infinities to
 * the range silently. bool takes anything; floating dtypes keep NaN and
 * infinities. */
Test(tensor_errors, fill_values_the_dtype_cannot_hold)
{
    th_mem_mark();
    int64_t s[1] = {2};
    ts_tensor *o = NULL;
    EXPECT_ERR(ts_tensor_full(TS_I32, 1, s, NAN, &o), TS_ERR_INVALID_ARGUMENT, "ts_tensor_full", "nan", "int32");
    EXPECT_ERR(ts_tensor_full(TS_I32, 1, s, INFINITY, &o), TS_ERR_INVALID_ARGUMENT, "inf", "int32");
    EXPECT_ERR(ts_tensor_full(TS_I32, 1, s, -INFINITY, &o), TS_ERR_INVALID_ARGUMENT, "-inf", "int32");
    EXPECT_ERR(ts_tensor_full(TS_I32, 1, s, 3e9, &o), TS_ERR_INVALID_ARGUMENT, "3000000000", "int32",
               "-2147483648 to 2147483647");
    EXPECT_ERR(ts_tensor_full(TS_I32, 1, s, -2147483648.9, &o), TS_ERR_INVALID_ARGUMENT, "int32");
    EXPECT_ERR(ts_tensor_full(TS_I64, 1, s, NAN, &o), TS_ERR_INVALID_ARGUMENT, "nan", "int64");
    EXPECT_ERR(ts_tensor_full(TS_I64, 1, s, 9223372036854775808.0, &o), TS_ERR_INVALID_ARGUMENT, "9223372036854775808",
               "int64");
    EXPECT_ERR(ts_tensor_scalar(TS_I64, -INFINITY, &o), TS_ERR_INVALID_ARGUMENT, "-inf", "int64");
    EXPECT_ERR(ts_tensor_full(TS_F16, 1, s, 1e10, &o), TS_ERR_INVALID_ARGUMENT, "10000000000", "float16", "65504");
    EXPECT_ERR(ts_tensor_full(TS_BF16, 1, s, 1e300, &o), TS_ERR_INVALID_ARGUMENT, "bfloat16");
    EXPECT_ERR(ts_tensor_full(TS_F32, 1, s, -1e300, &o), TS_ERR_INVALID_ARGUMENT, "float32");
    cr_assert_null(o);
    ts_tensor *a = NULL, *m = NULL;
    TH_OK(ts_tensor_zeros(TS_I32, 1, s, &a));
    TH_OK(ts_tensor_ones(TS_BOOL, 1, s, &m));
    EXPECT_ERR(ts_tensor_fill_(a, NAN), TS_ERR_INVALID_ARGUMENT, "ts_tensor_fill_", "nan", "int32");
    EXPECT_ERR(ts_masked_fill(a, m, INFINITY, &o), TS_ERR_INVALID_ARGUMENT, "masked_fill", "inf", "int32");
    cr_assert_null(o);
    double v[2];
    th_vals(a, v, 2);
    cr_assert(v[0] == 0 && v[1] == 0, "a failed fill_ changes nothing");
    /* what torch accepts */
    TH_OK(ts_tensor_fill_(a, 2147483647.0));
    TH_OK(ts_tensor_fill_(a, -2.7)); /* truncates */
    th_vals(a, v, 2);
    cr_assert_eq(v[0], -2);
    const ts_dtype fl[4] = {TS_F32, TS_F64, TS_BF16, TS_F16};
    for (int i = 0; i < 4; i++) {
        TH_OK(ts_tensor_full(fl[i], 1, s, INFINITY, &o));
        ts_tensor_free(o);
        TH_OK(ts_tensor_full(fl[i], 1, s, NAN, &o));
        ts_tensor_free(o);
    }
    TH_OK(ts_tensor_full(TS_F16, 1, s, 65504.0, &o));
    ts_tensor_free(o);
    TH_OK(ts_tensor_full(TS_BOOL, 1, s, NAN, &o));
    th_vals(o, v, 2);
    cr_assert(v[0] == 1 && v[1] == 1, "bool(nan) is true, as in torch");
    ts_tensor_free(o);
    TH_OK(ts_tensor_full(TS_BOOL, 1, s, -1e300, &o));
    ts_tensor_free(o);
    ts_tensor_free(a);
    ts_tensor_free(m);
    th_mem_assert_back();
}

/* arange whose element count does not fit int64, or whose integer
 * elements do not fit the dtype: an error (the count's conversion was
 * undefined). */
Test(tensor_errors, arange_beyond_int64_or_the_dtype)
{
    th_mem_mark();
    ts_tensor *o = NULL;
    EXPECT_ERR(ts_tensor_arange(TS_F32, 0, 1e300, 1, &o), TS_ERR_INVALID_ARGUMENT, "ts_tensor_arange", "1e+300");
    EXPECT_ERR(ts_tensor_arange(TS_F32, -1e308, 1e308, 1, &o), TS_ERR_INVALID_ARGUMENT, "ts_tensor_arange");
    EXPECT_ERR(ts_tensor_arange(TS_I32, 0, 5e9, 2e9, &o), TS_ERR_INVALID_ARGUMENT, "4000000000", "int32");
    EXPECT_ERR(ts_tensor_arange(TS_I32, 0, NAN, 1, &o), TS_ERR_INVALID_ARGUMENT, "ts_tensor_arange");
    cr_assert_null(o);
    TH_OK(ts_tensor_arange(TS_I32, 0, 3e9, 1e9, &o)); /* 0, 1e9, 2e9 fit */
    cr_assert_eq(ts_tensor_numel(o), 3);
    ts_tensor_free(o);
    th_mem_assert_back();
}

/* Found by the generated api_bad_values test (tools/gen_null_args_test.py):
 * tril_mask's n * n and c <= r + diagonal, and split's size + split_size - 1
 * overflowed int64 (a crash, and undefined behaviour); kaiming's slope and
 * xavier's gain filled NaN or infinities when not finite. */
Test(tensor_errors, huge_or_non_finite_arguments_found_by_the_generated_test)
{
    th_mem_mark();
    ts_tensor *o = NULL;
    EXPECT_ERR(ts_tril_mask(INT64_MAX, 0, &o), TS_ERR_INVALID_ARGUMENT, "tril_mask", "9223372036854775807");
    TH_OK(ts_tril_mask(3, INT64_MAX, &o));
    double v[9];
    th_vals(o, v, 9);
    for (int i = 0; i < 9; i++) cr_assert_eq(v[i], 1.0, "a huge diagonal keeps everything");
    ts_tensor_free(o);
    TH_OK(ts_tril_mask(3, INT64_MIN, &o));
    th_vals(o, v, 9);
    for (int i = 0; i < 9; i++) cr_assert_eq(v[i], 0.0, "a hugely negative diagonal keeps nothing");
    ts_tensor_free(o);
    int64_t s[2] = {4, 3};
    ts_tensor *a = th_seq(TS_F32, 2, s, 1, false), *outs[4] = {NULL};
    int n = 0;
    TH_OK(ts_split(a, INT64_MAX, 0, 4, outs, &n));
    cr_assert_eq(n, 1, "one piece, as torch.split with a size beyond the dim");
    cr_assert_eq(ts_tensor_shape(outs[0])[0], 4);
    ts_tensor_free(outs[0]);
    EXPECT_ERR(ts_init_kaiming_uniform_(a, NAN, TS_FAN_IN, TS_NL_LEAKY_RELU, NULL), TS_ERR_INVALID_ARGUMENT,
               "kaiming_uniform_", "nan");
    EXPECT_ERR(ts_init_kaiming_normal_(a, INFINITY, TS_FAN_IN, TS_NL_LEAKY_RELU, NULL), TS_ERR_INVALID_ARGUMENT,
               "kaiming_normal_", "inf");
    EXPECT_ERR(ts_init_xavier_normal_(a, INFINITY, NULL), TS_ERR_INVALID_ARGUMENT, "xavier_normal_", "gain inf");
    EXPECT_ERR(ts_init_xavier_uniform_(a, NAN, NULL), TS_ERR_INVALID_ARGUMENT, "xavier_uniform_", "gain nan");
    ts_tensor_free(a);
    th_mem_assert_back();
}
