/*
 * The UCX transport's address value (comm/ucx_internal.h): the struct's
 * encode writes the wire layout the transport has always published
 * (u32 magic | i32 pid | host[64] | u64 cookie address | u64 cookie |
 * worker address, native byte order), decode reads it back, and a value
 * that is too short or not one is TS_ERR_FORMAT naming the lengths.
 */
#include <criterion/criterion.h>
#include <stdint.h>
#include <string.h>

#include "comm/ucx_internal.h"
#include "tests/helpers.h"

static const unsigned char worker[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};

static ts_ucx_addr sample(void)
{
    ts_ucx_addr a = {
        .hdr = {.magic = TS_UCX_MAGIC, .pid = 4242, .cookie_addr = 0x7ffd12345678ull, .cookie = 0x9e3779b97f4a7c15ull},
        .worker = worker,
        .worker_len = sizeof worker};
    snprintf(a.hdr.host, sizeof a.hdr.host, "%s", "0f1e2d3c-boot/4026531836/4026531840");
    return a;
}

Test(comm_ucx_addr, encode_writes_the_published_layout_and_decode_reads_it_back)
{
    ts_ucx_addr a = sample();
    size_t n = ts__ucx_addr_encode(&a, NULL, 0);
    cr_assert_eq(n, 88 + sizeof worker);
    unsigned char v[128];
    memset(v, 0xAB, sizeof v);
    cr_assert_eq(ts__ucx_addr_encode(&a, v, sizeof v), n);
    /* the bytes at the offsets the transport has always used */
    uint32_t magic;
    int32_t pid;
    uint64_t caddr, cookie;
    memcpy(&magic, v, 4);
    memcpy(&pid, v + 4, 4);
    memcpy(&caddr, v + 8 + 64, 8);
    memcpy(&cookie, v + 8 + 64 + 8, 8);
    cr_assert_eq(magic, 0x32555354u);
    cr_assert_eq(pid, 4242);
    cr_assert_str_eq((const char *)v + 8, a.hdr.host);
    cr_assert_eq(caddr, a.hdr.cookie_addr);
    cr_assert_eq(cookie, a.hdr.cookie);
    cr_assert_eq(memcmp(v + 88, worker, sizeof worker), 0);
    cr_assert_eq(v[n], 0xAB, "nothing written past the value");

    ts_ucx_addr b;
    TH_OK(ts__ucx_addr_decode(v, n, 0, "p/ucx/1", &b));
    cr_assert_eq(memcmp(&b.hdr, &a.hdr, sizeof a.hdr), 0);
    cr_assert_eq(b.worker_len, sizeof worker);
    cr_assert_eq(b.worker, (const void *)(v + 88), "the worker address points into the value");
}

Test(comm_ucx_addr, encode_into_too_small_a_buffer_writes_nothing)
{
    ts_ucx_addr a = sample();
    unsigned char v[64];
    memset(v, 0xAB, sizeof v);
    cr_assert_eq(ts__ucx_addr_encode(&a, v, sizeof v), 88 + sizeof worker);
    for (size_t i = 0; i < sizeof v; i++) cr_assert_eq(v[i], 0xAB);
}

Test(comm_ucx_addr, decode_of_a_value_no_longer_than_the_header_names_both_lengths)
{
    ts_ucx_addr a = sample(), b = {.worker_len = 77};
    unsigned char v[128];
    size_t n = ts__ucx_addr_encode(&a, v, sizeof v);
    cr_assert_eq(ts__ucx_addr_decode(v, 88, 3, "p/ucx/5", &b), TS_ERR_FORMAT);
    const char *e = ts_last_error();
    cr_assert(strstr(e, "rank 3") && strstr(e, "'p/ucx/5' (88 bytes)") && strstr(e, "88-byte header"), "%s", e);
    cr_assert_eq(ts__ucx_addr_decode(v, 0, 3, "p/ucx/5", &b), TS_ERR_FORMAT);
    cr_assert(strstr(ts_last_error(), "(0 bytes)"), "%s", ts_last_error());
    cr_assert_eq(b.worker_len, 77, "the output is untouched on error");
    TH_OK(ts__ucx_addr_decode(v, n, 3, "p/ucx/5", &b));
}

Test(comm_ucx_addr, decode_of_a_value_without_the_magic_names_it)
{
    ts_ucx_addr a = sample(), b = {.worker_len = 77};
    unsigned char v[128];
    size_t n = ts__ucx_addr_encode(&a, v, sizeof v);
    v[0] ^= 0xFF;
    cr_assert_eq(ts__ucx_addr_decode(v, n, 0, "p/ucx/2", &b), TS_ERR_FORMAT);
    const char *e = ts_last_error();
    cr_assert(strstr(e, "is not a tensorshard UCX address") && strstr(e, "(99 bytes)") &&
                  strstr(e, "expected 0x32555354"),
              "%s", e);
    cr_assert_eq(b.worker_len, 77);
}
