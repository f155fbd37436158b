#define _GNU_SOURCE
/*
 * Cross-memory reads and the same-host probe (comm/xmem.h), which the UCX
 * bypass, the direct collectives and ts_dist_init's rendezvous share.
 * Reads this process's own memory (always permitted).
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "comm/xmem.h"
#include "tests/helpers.h"

Test(comm_xmem, readv_spans_more_than_iov_max_entries_and_counts_the_bytes)
{
    enum { N = IOV_MAX + 300 };
    static unsigned char src[N], dst[N];
    static struct iovec l[N], r[N / 2];
    for (int i = 0; i < N; i++) {
        src[i] = (unsigned char)(i * 7 + 1);
        l[i] = (struct iovec){&dst[i], 1}; /* one byte each locally */
    }
    for (int i = 0; i < N / 2; i++) r[i] = (struct iovec){&src[2 * i], 2}; /* two each remotely */
    size_t done = 0;
    cr_assert_eq(ts__xmem_readv(getpid(), l, N, r, N / 2, &done), 0);
    cr_assert_eq(done, (size_t)N);
    cr_assert_eq(memcmp(src, dst, N), 0);
}

Test(comm_xmem, read_of_an_unmapped_address_returns_its_errno)
{
    uint64_t got = 0;
    cr_assert_eq(ts__xmem_read(getpid(), &got, 8, 8), EFAULT);
    uint64_t v = 0x1122334455667788ull;
    cr_assert_eq(ts__xmem_read(getpid(), &got, (uint64_t)(uintptr_t)&v, 8), 0);
    cr_assert_eq(got, v);
}

Test(comm_xmem, host_ids_have_their_two_forms_and_compare_equal_on_this_host)
{
    char pids[160], net[64], net2[64];
    ts__host_id(TS_HOST_ID_PIDS, pids, sizeof pids);
    ts__host_id(TS_HOST_ID_NET, net, sizeof net);
    ts__host_id(TS_HOST_ID_NET, net2, sizeof net2);
    cr_assert(strstr(pids, "/pid:[") != NULL, "%s", pids);
    cr_assert(strchr(net, '[') == NULL && strchr(net, '/') != NULL, "%s", net);
    size_t k = strlen(net);
    for (size_t i = k; i < sizeof net; i++) cr_assert_eq(net[i], 0, "NUL-padded");
    cr_assert(ts__host_same(net, net2, sizeof net));
    net2[0] ^= 1;
    cr_assert(!ts__host_same(net, net2, sizeof net));
    int fd = ts__host_watch(getpid());
    cr_assert(fd >= 0 || errno == ENOSYS, "pidfd_open: %s", strerror(errno));
    if (fd >= 0) close(fd);
}
