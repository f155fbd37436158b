#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <string.h>

#include "tests/helpers.h"

Test(tensor_storage, pool_reuses_freed_blocks)
{
    int64_t s[2] = {256, 256};
    ts_tensor *a, *b;
    TH_OK(ts_tensor_empty(TS_F32, 2, s, &a));
    void *p = ts_tensor_data(a);
    size_t live = ts_mem_live_bytes(TS_MEM_POOL);
    ts_tensor_free(a);
    TH_OK(ts_tensor_empty(TS_F32, 2, s, &b));
    cr_assert_eq(ts_tensor_data(b), p, "the same block comes back");
    cr_assert_eq(ts_mem_live_bytes(TS_MEM_POOL), live, "no new memory was taken from the system");
    ts_tensor_free(b);
}

/* The fully_shard pattern: an unsharded parameter's storage is released
 * after forward (reshard), restored and refilled before backward
 * (unshard); tensors and autograd references stay valid throughout. */
Test(tensor_storage, release_and_refill_through_backward)
{
    th_mem_mark();
    int64_t ws[2] = {3, 4}, xs[2] = {2, 3};
    ts_tensor *full = th_seq(TS_F64, 2, ws, 1.0, true);
    ts_tensor *x = th_seq(TS_F64, 2, xs, 0.5, true);
    ts_tensor *keep = th_seq(TS_F64, 2, ws, 1.0, false); /* a copy of full's values */
    ts_tensor *y, *l, *y2;
    TH_OK(ts_matmul(x, full, &y));
    TH_OK(ts_sum(y, 0, NULL, false, &l));
    ts_storage *st = ts_tensor_storage(full);
    size_t in_use = ts_mem_live_bytes(TS_MEM_STORAGE);
    TH_OK(ts_storage_release(st));
    cr_assert(ts_storage_is_released(st));
    cr_assert_lt(ts_mem_live_bytes(TS_MEM_STORAGE), in_use, "released bytes go back to the pool");
    cr_assert_null(ts_tensor_data(full));
    cr_assert_eq(ts_storage_nbytes(st), 12 * sizeof(double));
    /* reading it while released is an error with a clear status */
    cr_assert_eq(ts_matmul(x, full, &y2), TS_ERR_RELEASED);
    cr_assert(strstr(ts_last_error(), "released") != NULL, "%s", ts_last_error());
    cr_assert_eq(ts_backward(l, NULL, true), TS_ERR_RELEASED, "backward would read the saved weight");
    cr_assert(strstr(ts_last_error(), "matmul") != NULL, "%s", ts_last_error());
    /* restore and refill, then backward works and gives the right grads */
    TH_OK(ts_storage_restore(st));
    bool prev = ts_grad_mode_set(false);
    TH_OK(ts_tensor_copy_(full, keep));
    ts_grad_mode_set(prev);
    TH_OK(ts_backward(l, NULL, false));
    /* d sum(x @ W) / dW[k][j] = sum_i x[i][k] */
    for (int64_t k = 0; k < 3; k++) {
        double want = 0, got;
        for (int64_t i = 0; i < 2; i++) {
            double v;
            int64_t ix[2] = {i, k};
            TH_OK(ts_tensor_get(x, ix, &v));
            want += v;
        }
        int64_t ig[2] = {k, 2};
        TH_OK(ts_tensor_get(ts_tensor_grad(full), ig, &got));
        cr_assert_float_eq(got, want, 1e-12);
    }
    ts_tensor_free(full);
    ts_tensor_free(x);
    ts_tensor_free(keep);
    ts_tensor_free(y);
    ts_tensor_free(l);
    th_mem_assert_back();
}

Test(tensor_storage, shard_marker_refuses_ops_but_local_view_works)
{
    th_mem_mark();
    int64_t ws[2] = {2, 3}, xs[2] = {4, 3};
    ts_tensor *w = th_seq(TS_F64, 2, ws, 1.0, true), *x = th_seq(TS_F64, 2, xs, 1.0, false), *y, *lv, *l;
    TH_OK(ts_tensor_set_name(w, "layers.0.weight"));
    int meta;
    ts_tensor_set_shard(w, &meta);
    cr_assert(ts_tensor_is_shard(w));
    cr_assert_eq(ts_tensor_dist_meta(w), &meta);
    cr_assert_eq(ts_linear(x, w, NULL, &y), TS_ERR_SHARDED);
    const char *msg = ts_last_error();
    cr_assert(strstr(msg, "layers.0.weight") != NULL, "%s", msg);
    cr_assert(strstr(msg, "ts_module_call") != NULL, "%s", msg);
    cr_assert(strstr(msg, "local") != NULL, "%s", msg);
    /* an explicit local view works, through a backward too */
    TH_OK(ts_tensor_local_view(w, &lv));
    cr_assert(!ts_tensor_is_shard(lv));
    cr_assert_eq(ts_tensor_data(lv), ts_tensor_data(w), "same data");
    TH_OK(ts_tensor_set_requires_grad(lv, true));
    TH_OK(ts_linear(x, lv, NULL, &y));
    TH_OK(ts_sum(y, 0, NULL, false, &l));
    TH_OK(ts_backward(l, NULL, false));
    cr_assert_not_null(ts_tensor_grad(lv));
    /* an optimizer-style in-place update through the view is seen by w */
    bool prev = ts_grad_mode_set(false);
    TH_OK(ts_tensor_fill_(lv, 7.0));
    ts_grad_mode_set(prev);
    int64_t i0[2] = {1, 2};
    double v;
    ts_tensor_clear_shard(w);
    TH_OK(ts_tensor_get(w, i0, &v));
    cr_assert_float_eq(v, 7.0, 0);
    ts_tensor_free(w);
    ts_tensor_free(x);
    ts_tensor_free(y);
    ts_tensor_free(lv);
    ts_tensor_free(l);
    th_mem_assert_back();
}

Test(tensor_storage, copy_into_grad_requiring_leaf_is_refused_in_grad_mode)
{
    int64_t s[1] = {3};
    ts_tensor *w = th_seq(TS_F32, 1, s, 1.0, true), *src = th_seq(TS_F32, 1, s, 2.0, false);
    cr_assert_eq(ts_tensor_copy_(w, src), TS_ERR_AUTOGRAD);
    bool prev = ts_grad_mode_set(false);
    TH_OK(ts_tensor_copy_(w, src));
    ts_grad_mode_set(prev);
    th_assert_close(w, src, 0, 0);
    ts_tensor_free(w);
    ts_tensor_free(src);
}

Test(tensor_storage, large_blocks_are_huge_page_aligned_and_returned)
{
    th_mem_mark();
    ts_pool_empty_cache();
    size_t pool0 = ts_mem_live_bytes(TS_MEM_POOL);
    int64_t s[1] = {1 << 20}; /* 4 MiB of float */
    ts_tensor *t;
    TH_OK(ts_tensor_empty(TS_F32, 1, s, &t));
    cr_assert_eq((uintptr_t)ts_tensor_data(t) % (2u << 20), 0, "blocks >= 2 MiB start on a huge page");
    cr_assert_geq(ts_mem_live_bytes(TS_MEM_POOL), pool0 + ((size_t)4 << 20));
    ts_tensor_free(t);
    ts_pool_empty_cache();
    cr_assert_eq(ts_mem_live_bytes(TS_MEM_POOL), pool0, "emptying the cache gives every byte back");
    th_mem_assert_back();
}
