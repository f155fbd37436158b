/* The process floor (comm.h: ts_process_floor_get): measured at the first
 * call in a process without a world, and again by ts_dist_init once its
 * world is up; positive, and what it takes from the resident set is no
 * more than the resident set then. */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <stdlib.h>

#include "comm/comm.h"
#include "tensor/tensor.h"

static void check_floor(const ts_process_floor *f)
{
    ts_process_memory now;
    cr_assert_eq(ts_process_memory_read(&now), TS_OK, "%s", ts_last_error());
    cr_expect_gt(f->bytes, 0u);
    cr_expect_gt(f->blis_pack_bytes, 0u, "BLIS's packing buffers are counted");
    cr_expect_leq(f->bytes - f->blis_pack_bytes, f->resident_bytes, "floor %zu less BLIS %zu above the rss %zu",
                  f->bytes, f->blis_pack_bytes, f->resident_bytes);
    cr_expect_leq(f->resident_bytes, now.peak_rss_bytes, "the rss then %zu above the peak since %zu", f->resident_bytes,
                  now.peak_rss_bytes);
    cr_expect_eq(f->bytes, ts_process_floor_bytes());
}

Test(comm_floor, measured_at_first_use_then_at_dist_init, .timeout = 30)
{
    /* a process started alone: a one-rank world */
    unsetenv("RANK"), unsetenv("WORLD_SIZE"), unsetenv("MASTER_ADDR"), unsetenv("MASTER_PORT");
    ts_process_floor f;
    cr_assert_eq(ts_process_floor_get(&f), TS_OK, "%s", ts_last_error());
    cr_expect(!f.at_dist_init);
    check_floor(&f);
    /* tensors live at the measurement are not floor */
    int64_t n = 4 << 20;
    ts_tensor *t;
    cr_assert_eq(ts_tensor_ones(TS_F32, 1, &n, &t), TS_OK);
    cr_assert_eq(ts_dist_init(NULL), TS_OK, "%s", ts_last_error());
    ts_process_floor g;
    cr_assert_eq(ts_process_floor_get(&g), TS_OK);
    cr_expect(g.at_dist_init);
    check_floor(&g);
    cr_expect_geq(g.tracked_bytes, (size_t)n * 4, "the 16 MiB tensor is tracked, not floor: %zu", g.tracked_bytes);
    cr_expect_lt(g.bytes, f.bytes + (size_t)n * 2, "floor %zu after a 16 MiB tensor, %zu before", g.bytes, f.bytes);
    ts_tensor_free(t);
    cr_assert_eq(ts_dist_finalize(), TS_OK);
    cr_assert_eq(ts_process_floor_get(NULL), TS_ERR_INVALID_ARGUMENT);
}
