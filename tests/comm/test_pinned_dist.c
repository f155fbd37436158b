/*
 * Pinned host memory over UCX (base.h "Pinned host memory"): a pinned
 * block is registered with the transport's memory map once, by the
 * world's communication thread (also blocks pinned before ts_dist_init),
 * every transfer from or into it passes that registration, transfers of
 * pageable memory do not, and ts_dist_finalize gives every registration
 * back. This binary is its own rank program (TS_TEST_PINNED_ROLE, handled
 * by a constructor before Criterion starts); ranks report through their
 * exit code and stderr and leave with _exit.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "comm/comm.h"
#include "comm/comm_internal.h"
#include "comm/launch.h"
#include "tests/helpers.h"

static int g_rank = -1;

#define RFAIL(code, ...) th_rank_exit(g_rank, (code), __VA_ARGS__)

static float val(int r, int64_t i) { return (float)(r * 1000 + (i % 997)); }

/* An all-gather of n floats per rank into out (n * W); checks the values
 * and returns the transfers posted and registered meanwhile. */
static void gather(ts_comm *c, ts_tensor *out, int64_t n, uint64_t *posted, uint64_t *registered)
{
    int W = ts_comm_size(c);
    ts_tensor *in = NULL;
    if (ts_tensor_empty(TS_F32, 1, &n, &in)) RFAIL(20, "empty");
    for (int64_t i = 0; i < n; i++) ((float *)ts_tensor_data(in))[i] = val(g_rank, i);
    uint64_t p0, r0, p1, r1;
    ts__comm_xfer_stats(c, &p0, &r0);
    if (ts_all_gather_into_tensor(c, out, in, NULL)) RFAIL(21, "all_gather of %lld", (long long)n);
    ts__comm_xfer_stats(c, &p1, &r1);
    const float *o = ts_tensor_data(out);
    for (int j = 0; j < W; j++)
        for (int64_t i = 0; i < n; i++)
            if (o[j * n + i] != val(j, i))
                RFAIL(22, "out[%d][%lld] = %g, want %g", j, (long long)i, o[j * n + i], val(j, i));
    ts_tensor_free(in);
    *posted = p1 - p0;
    *registered = r1 - r0;
}

static ts_tensor *pinned_empty(int64_t n)
{
    ts_tensor *t = NULL;
    if (ts_tensor_empty(TS_F32, 1, &n, &t) || ts_storage_pin(ts_tensor_storage(t))) RFAIL(23, "pinned tensor");
    return t;
}

static void role_pinned(void)
{
    g_rank = atoi(getenv("RANK") ? getenv("RANK") : "-1");
    int64_t ws = atoi(getenv("WORLD_SIZE") ? getenv("WORLD_SIZE") : "1");
    ts_tensor *early = pinned_empty(1000 * ws); /* pinned before the world exists */
    if (ts__pinned_registered_count() != 0) RFAIL(10, "registered without a transport");
    ts_dist_options o = ts_dist_options_default();
    o.timeout_s = 60;
    if (ts_dist_init(&o)) RFAIL(11, "ts_dist_init");
    ts_comm *c = ts_dist_world();
    int W = ts_comm_size(c);
    if (ts__pinned_registered_count() != 1)
        RFAIL(12, "%d blocks registered at init, want 1", ts__pinned_registered_count());
    uint64_t p, r;
    /* 1000 floats: UCX's eager path; 20000 (80 KB): UCX's rendezvous. A
     * 4000-byte block goes inside the fingerprint's message by default
     * (comm.c, "Fingerprints": inline blocks), sent and received as
     * pieces, which pass no registration: step 0 is then no transfer of
     * the pinned block alone. With inline blocks off (every rank alike)
     * each step is one. */
    ts__comm_set_fp_inline(c, 0);
    gather(c, early, 1000, &p, &r);
    if (r < 2 * (uint64_t)(W - 1))
        RFAIL(13, "pinned 4000-byte all-gather: %llu of %llu transfers registered", (unsigned long long)r,
              (unsigned long long)p);
    fprintf(stderr, "rank %d: pinned 4 KB all-gather: %llu of %llu transfers passed the registration\n", g_rank,
            (unsigned long long)r, (unsigned long long)p);
    /* inline (the default): right, and the later steps' transfers (W > 2)
     * still pass the registration */
    ts__comm_set_fp_inline(c, 16 << 10);
    gather(c, early, 1000, &p, &r);
    if (r < 2 * (uint64_t)(W - 2) || p < 2 * (uint64_t)(W - 1))
        RFAIL(27, "pinned 4000-byte all-gather, inline: %llu of %llu transfers registered", (unsigned long long)r,
              (unsigned long long)p);
    ts_tensor *mid = pinned_empty(20000 * (int64_t)W);
    if (ts__pinned_registered_count() != 2) RFAIL(14, "%d blocks registered, want 2", ts__pinned_registered_count());
    gather(c, mid, 20000, &p, &r);
    if (r < 2 * (uint64_t)(W - 1))
        RFAIL(15, "pinned 80 KB all-gather: %llu of %llu transfers registered", (unsigned long long)r,
              (unsigned long long)p);
    /* pageable memory: transfers, none registered */
    int64_t nn = 20000 * (int64_t)W;
    ts_tensor *plain = NULL;
    if (ts_tensor_empty(TS_F32, 1, &nn, &plain)) RFAIL(16, "empty");
    gather(c, plain, 20000, &p, &r);
    if (p == 0 || r != 0)
        RFAIL(17, "pageable all-gather: %llu of %llu transfers registered", (unsigned long long)r,
              (unsigned long long)p);
    /* 300 KB blocks: the shared-memory bypass reads them; still right */
    ts_tensor *big = pinned_empty(75000 * (int64_t)W);
    gather(c, big, 75000, &p, &r);
    ts_tensor_free(mid);
    if (ts__pinned_registered_count() != 2) RFAIL(18, "freeing a pinned tensor keeps its registration");
    if (ts_dist_finalize()) RFAIL(19, "ts_dist_finalize");
    if (ts__pinned_registered_count() != 0) RFAIL(24, "registrations left after finalize");
    if (!ts_tensor_is_pinned(early)) RFAIL(25, "still pinned (locked) after finalize");
    ts_tensor_free(early);
    ts_tensor_free(big);
    ts_tensor_free(plain);
    if (ts_mem_live_bytes(TS_MEM_PINNED) != 0) RFAIL(26, "%zu pinned bytes left", ts_mem_live_bytes(TS_MEM_PINNED));
    fprintf(stderr, "rank %d ok\n", g_rank);
    fflush(stderr);
    _exit(0);
}

__attribute__((constructor)) static void pinned_test_role(void)
{
    const char *role = getenv("TS_TEST_PINNED_ROLE");
    if (!role) return;
    if (strcmp(role, "pinned") == 0) role_pinned();
    fprintf(stderr, "unknown TS_TEST_PINNED_ROLE=%s\n", role);
    _exit(6);
}

static void launch(int W)
{
    th_clear_launch_env();
    setenv("TS_TEST_PINNED_ROLE", "pinned", 1);
    ts_launch_result res;
    th_launch_self(W, &res);
    unsetenv("TS_TEST_PINNED_ROLE");
    cr_assert_eq(res.exit_code, 0, "rank %d failed: exit %d signal %d", res.failed_rank, res.exit_code,
                 res.failed_signal);
}

Test(comm_pinned, transfers_of_pinned_memory_pass_its_registration_on_2_ranks, .timeout = 120) { launch(2); }

Test(comm_pinned, transfers_of_pinned_memory_pass_its_registration_on_3_ranks, .timeout = 120) { launch(3); }
