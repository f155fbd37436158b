#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <stdlib.h>

#include "base/internal.h"
#include "tests/helpers.h"

Test(base_alloc, live_bytes_are_counted_by_tag)
{
    size_t before = ts_mem_live_bytes(TS_MEM_NN);
    void *p = ts__malloc(TS_MEM_NN, 1000);
    cr_assert_not_null(p);
    cr_assert_eq(ts_mem_live_bytes(TS_MEM_NN), before + 1000);
    cr_assert_eq((uintptr_t)p % 64, 0, "allocations are 64-byte aligned");
    void *q = ts__calloc(TS_MEM_NN, 10, 10);
    for (int i = 0; i < 100; i++) cr_assert_eq(((unsigned char *)q)[i], 0);
    cr_assert_eq(ts_mem_live_bytes(TS_MEM_NN), before + 1100);
    cr_assert_geq(ts_mem_peak_bytes(TS_MEM_NN), before + 1100);
    ts__free(TS_MEM_NN, p);
    ts__free(TS_MEM_NN, q);
    ts__free(TS_MEM_NN, NULL);
    cr_assert_eq(ts_mem_live_bytes(TS_MEM_NN), before);
    ts_mem_reset_peak();
    cr_assert_eq(ts_mem_peak_bytes(TS_MEM_NN), before);
}

Test(base_alloc, huge_request_fails_with_status)
{
    ts_clear_error();
    void *p = ts__malloc(TS_MEM_OTHER, SIZE_MAX - 8);
    cr_assert_null(p);
    cr_assert_eq(ts_last_status(), TS_ERR_NO_MEMORY);
    cr_assert(strstr(ts_last_error(), "too large") != NULL, "%s", ts_last_error());
}

static size_t hook_allocs, hook_frees;

static void *count_alloc(size_t size, size_t align, void *ctx)
{
    (void)ctx;
    hook_allocs++;
    return aligned_alloc(align, (size + align - 1) / align * align);
}

static void count_free(void *p, size_t size, void *ctx)
{
    (void)ctx;
    (void)size;
    hook_frees++;
    free(p);
}

Test(base_alloc, allocator_hook_sees_every_allocation)
{
    ts_allocator a = {count_alloc, count_free, NULL};
    TH_OK(ts_set_allocator(&a));
    int64_t shape[2] = {3, 4};
    ts_tensor *t;
    TH_OK(ts_tensor_zeros(TS_F32, 2, shape, &t));
    cr_assert_geq(hook_allocs, 2, "tensor handle, storage and data go through the hook");
    /* installing while memory is live is refused */
    cr_assert_eq(ts_set_allocator(NULL), TS_ERR_STATE);
    cr_assert(strstr(ts_last_error(), "still live") != NULL);
    ts_tensor_free(t);
    ts_pool_empty_cache();
    cr_assert_eq(hook_allocs, hook_frees, "allocs %zu frees %zu", hook_allocs, hook_frees);
    TH_OK(ts_set_allocator(NULL));
}

Test(base_alloc, tensors_leave_nothing_behind)
{
    th_mem_mark();
    int64_t shape[3] = {2, 3, 4};
    for (int i = 0; i < 10; i++) {
        ts_tensor *a = th_seq(TS_F32, 3, shape, 1.0, true), *b, *c;
        TH_OK(ts_mul_scalar(a, 2.0, &b));
        TH_OK(ts_sum(b, 0, NULL, false, &c));
        TH_OK(ts_backward(c, NULL, false));
        ts_tensor_free(a);
        ts_tensor_free(b);
        ts_tensor_free(c);
    }
    th_mem_assert_back();
    cr_assert_gt(ts_pool_cached_bytes(), 0, "freed blocks stay cached in the pool");
    ts_pool_empty_cache();
    cr_assert_eq(ts_pool_cached_bytes(), 0);
}
