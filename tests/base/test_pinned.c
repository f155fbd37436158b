/* Pinned host memory (base.h "Pinned host memory", tensor.h
 * ts_storage_pin / ts_tensor_pin_memory): values kept, blocks locked and
 * counted, unpinned on free, a too-low RLIMIT_MEMLOCK only warns, and the
 * transport's registrar sees every block once. */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <linux/capability.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "base/internal.h"
#include "tests/helpers.h"
#include "tests/log_capture.h"

static size_t page(void) { return (size_t)sysconf(_SC_PAGESIZE); }

Test(base_pinned, storage_pin_keeps_values_and_counts_the_bytes, .timeout = 30)
{
    th_mem_mark();
    size_t pinned0 = ts_mem_live_bytes(TS_MEM_PINNED), locked0 = ts_mem_locked_bytes();
    int64_t shape[2] = {37, 11}; /* 1628 bytes: less than a page */
    ts_tensor *t = th_seq(TS_F32, 2, shape, 1.0, false);
    ts_tensor *view = NULL;
    TH_OK(ts_slice(t, 0, 3, 20, 2, &view));
    float before[37 * 11];
    memcpy(before, ts_tensor_data(t), sizeof before);
    cr_assert(!ts_tensor_is_pinned(t));
    TH_OK(ts_storage_pin(ts_tensor_storage(t)));
    cr_assert(ts_tensor_is_pinned(t) && ts_tensor_is_pinned(view), "every tensor over the storage is pinned");
    cr_assert(ts_storage_is_pinned(ts_tensor_storage(view)));
    cr_assert_eq(memcmp(before, ts_tensor_data(t), sizeof before), 0, "pinning keeps the values");
    cr_assert_eq(((uintptr_t)ts_storage_data(ts_tensor_storage(t))) % page(), 0, "a pinned block is page-aligned");
    /* one page-rounded block */
    cr_assert_eq(ts_mem_live_bytes(TS_MEM_PINNED) - pinned0, page());
    cr_assert_eq(ts_mem_locked_bytes() - locked0, page(),
                 "mlock locked it (the test runs as root or under "
                 "RLIMIT_MEMLOCK >= a page)");
    cr_assert(ts__pinned_is_locked(ts_storage_data(ts_tensor_storage(t))));
    cr_assert_geq(ts_mem_peak_bytes(TS_MEM_PINNED), ts_mem_live_bytes(TS_MEM_PINNED));
    TH_OK(ts_storage_pin(ts_tensor_storage(t))); /* no-op */
    cr_assert_eq(ts_mem_live_bytes(TS_MEM_PINNED) - pinned0, page());
    /* the view still reads the storage's rows 3, 5, ... */
    double v = 0;
    int64_t idx[2] = {1, 4};
    TH_OK(ts_tensor_get(view, idx, &v));
    cr_assert_eq((float)v, before[5 * 11 + 4]);
    ts_tensor_free(view);
    ts_tensor_free(t);
    cr_assert_eq(ts_mem_live_bytes(TS_MEM_PINNED), pinned0, "unpinned and freed with the storage");
    cr_assert_eq(ts_mem_locked_bytes(), locked0, "munlocked with the storage");
    th_mem_assert_back();
}

Test(base_pinned, tensor_pin_memory_copies_once, .timeout = 30)
{
    th_mem_mark();
    int64_t shape[2] = {300, 40}; /* 48000 bytes: 12 pages of 4 KiB */
    ts_tensor *t = th_seq(TS_F32, 2, shape, 1.0, true);
    ts_tensor *tt = NULL, *p = NULL, *p2 = NULL;
    TH_OK(ts_transpose(t, 0, 1, &tt));
    size_t pinned0 = ts_mem_live_bytes(TS_MEM_PINNED);
    TH_OK(ts_tensor_pin_memory(tt, &p));
    cr_assert(ts_tensor_is_pinned(p) && !ts_tensor_is_pinned(tt));
    cr_assert(ts_tensor_is_contiguous(p));
    cr_assert(!ts_tensor_requires_grad(p), "a detached copy");
    th_assert_close(p, tt, 0, 0);
    size_t want = (48000 + page() - 1) / page() * page();
    cr_assert_eq(ts_mem_live_bytes(TS_MEM_PINNED) - pinned0, want);
    TH_OK(ts_tensor_pin_memory(p, &p2));
    cr_assert_eq(p2, p, "pinning a pinned tensor returns it");
    cr_assert_eq(ts_mem_live_bytes(TS_MEM_PINNED) - pinned0, want);
    ts_tensor_free(p2);
    ts_tensor_free(p);
    ts_tensor_free(tt);
    ts_tensor_free(t);
    th_mem_assert_back();
}

Test(base_pinned, release_and_restore_stay_pinned, .timeout = 30)
{
    th_mem_mark();
    int64_t n = 5000;
    ts_tensor *t = th_empty(TS_F64, 1, &n);
    size_t pinned0 = ts_mem_live_bytes(TS_MEM_PINNED);
    ts_storage *s = ts_tensor_storage(t);
    TH_OK(ts_storage_pin(s));
    size_t one = ts_mem_live_bytes(TS_MEM_PINNED) - pinned0;
    cr_assert_geq(one, 40000);
    TH_OK(ts_storage_release(s));
    cr_assert_eq(ts_mem_live_bytes(TS_MEM_PINNED), pinned0, "a released pinned storage gives its block back");
    cr_assert(ts_storage_is_pinned(s));
    TH_OK(ts_storage_restore(s));
    cr_assert_eq(ts_mem_live_bytes(TS_MEM_PINNED) - pinned0, one, "and gets a pinned one again");
    memset(ts_tensor_data(t), 0, 40000);
    /* a released storage pinned before it is restored */
    ts_tensor *u = th_empty(TS_F32, 1, &n);
    TH_OK(ts_storage_release(ts_tensor_storage(u)));
    TH_OK(ts_storage_pin(ts_tensor_storage(u)));
    cr_assert_eq(ts_mem_live_bytes(TS_MEM_PINNED) - pinned0, one);
    TH_OK(ts_storage_restore(ts_tensor_storage(u)));
    cr_assert(ts_tensor_is_pinned(u));
    cr_assert_eq(ts_mem_live_bytes(TS_MEM_PINNED) - pinned0, one + (20000 + page() - 1) / page() * page());
    ts_tensor_free(u);
    ts_tensor_free(t);
    cr_assert_eq(ts_mem_live_bytes(TS_MEM_PINNED), pinned0);
    th_mem_assert_back();
    TH_FAILS(ts_storage_pin(NULL), TS_ERR_INVALID_ARGUMENT, "NULL");
    TH_FAILS(ts_tensor_pin_memory(NULL, &u), TS_ERR_INVALID_ARGUMENT, "NULL");
    cr_assert(!ts_tensor_is_pinned(NULL) && !ts_storage_is_pinned(NULL));
}

/* A child without CAP_IPC_LOCK under RLIMIT_MEMLOCK = one page pins 64
 * KiB: the pin succeeds, the block is counted as pinned but not locked,
 * and one warning names the limit and the bytes. The child reports
 * through its exit code and its stderr (a file). */
static int memlock_child(void)
{
    /* drop CAP_IPC_LOCK (root ignores RLIMIT_MEMLOCK with it) */
    struct __user_cap_header_struct h = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct d[2];
    if (syscall(SYS_capget, &h, d) != 0) return 10;
    d[CAP_IPC_LOCK / 32].effective &= ~(1u << (CAP_IPC_LOCK % 32));
    d[CAP_IPC_LOCK / 32].permitted &= ~(1u << (CAP_IPC_LOCK % 32));
    if (syscall(SYS_capset, &h, d) != 0) return 11;
    struct rlimit rl = {4096, 4096};
    if (setrlimit(RLIMIT_MEMLOCK, &rl) != 0) return 12;
    ts_log_set_level(TS_LOG_WARN);
    size_t locked0 = ts_mem_locked_bytes(), pinned0 = ts_mem_live_bytes(TS_MEM_PINNED);
    int64_t n = 16384; /* 65536 bytes */
    ts_tensor *t = NULL;
    if (ts_tensor_zeros(TS_F32, 1, &n, &t) != TS_OK) return 13;
    if (ts_storage_pin(ts_tensor_storage(t)) != TS_OK) return 14; /* never a failure */
    if (!ts_tensor_is_pinned(t)) return 15;
    if (ts_mem_live_bytes(TS_MEM_PINNED) - pinned0 != 65536) return 16;
    if (ts_mem_locked_bytes() != locked0) return 17;
    if (ts__pinned_is_locked(ts_storage_data(ts_tensor_storage(t)))) return 18;
    /* a second failure is not a second warning */
    ts_tensor *u = NULL;
    if (ts_tensor_pin_memory(t, &u) != TS_OK || u != t) return 19;
    ts_tensor_free(u);
    ts_tensor *v = NULL;
    if (ts_tensor_zeros(TS_F32, 1, &n, &v) != TS_OK || ts_storage_pin(ts_tensor_storage(v)) != TS_OK) return 20;
    ((float *)ts_tensor_data(t))[100] = 3.0f; /* pageable, but usable */
    ts_tensor_free(v);
    ts_tensor_free(t);
    if (ts_mem_live_bytes(TS_MEM_PINNED) != pinned0) return 21;
    return 0;
}

Test(base_pinned, memlock_limit_too_low_is_a_warning, .timeout = 30)
{
    FILE *err = tmpfile();
    cr_assert_not_null(err);
    fflush(NULL);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        dup2(fileno(err), 2);
        int rc = memlock_child();
        fflush(stderr);
        _exit(rc);
    }
    int status = 0;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    char text[4096] = {0};
    rewind(err);
    size_t got = fread(text, 1, sizeof text - 1, err);
    text[got] = '\0';
    fclose(err);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child: status 0x%x, stderr: %s", status, text);
    cr_assert_not_null(strstr(text, "[ts WARN] pinned memory: mlock of 65536 bytes failed"), "%s", text);
    cr_assert_not_null(strstr(text, "RLIMIT_MEMLOCK is 4096 bytes"), "%s", text);
    cr_assert_not_null(strstr(text, "stays pageable"), "%s", text);
    const char *second = strstr(strstr(text, "pinned memory:") + 1, "pinned memory:");
    cr_assert_null(second, "one warning, not one per block: %s", text);
}

/* A registrar as the communication layer installs one: it sees each
 * block once, existing ones at installation, and gives every handle
 * back at clearing or when the block is freed. */
typedef struct fake_reg {
    int regs, deregs, live;
    void *last_addr;
    size_t last_len;
} fake_reg;

static ts_status fake_register(void *ctx, void *addr, size_t len, void **handle_out)
{
    fake_reg *f = ctx;
    f->regs++;
    f->live++;
    f->last_addr = addr;
    f->last_len = len;
    *handle_out = addr;
    return TS_OK;
}

static void fake_deregister(void *ctx, void *handle)
{
    fake_reg *f = ctx;
    (void)handle;
    f->deregs++;
    f->live--;
}

Test(base_pinned, registrar_registers_each_block_once, .timeout = 30)
{
    th_mem_mark();
    int64_t n = 3000;
    ts_tensor *a = th_empty(TS_F32, 1, &n), *b = th_empty(TS_F32, 1, &n);
    TH_OK(ts_storage_pin(ts_tensor_storage(a)));
    fake_reg f = {0};
    ts__pin_registrar r = {fake_register, fake_deregister, &f};
    TH_OK(ts__pin_registrar_set(&r));
    cr_assert_eq(f.regs, 1, "the block pinned before is registered at installation");
    cr_assert_eq(ts__pinned_registered_count(), 1);
    fake_reg g = {0};
    ts__pin_registrar r2 = {fake_register, fake_deregister, &g};
    TH_FAILS(ts__pin_registrar_set(&r2), TS_ERR_ALREADY, "another");
    TH_OK(ts_storage_pin(ts_tensor_storage(b)));
    cr_assert_eq(f.regs, 2);
    cr_assert_eq(f.last_addr, ts_tensor_data(b));
    cr_assert_eq(f.last_len % page(), 0);
    cr_assert_geq(f.last_len, 12000);
    TH_OK(ts_storage_pin(ts_tensor_storage(b)));
    cr_assert_eq(f.regs, 2, "once");
    ts_tensor_free(b);
    cr_assert_eq(f.deregs, 1, "deregistered when freed");
    ts__pin_registrar_clear(&g); /* not the installer: nothing */
    cr_assert_eq(f.live, 1);
    ts__pin_registrar_clear(&f);
    cr_assert_eq(f.live, 0, "clearing deregisters every block");
    cr_assert_eq(ts__pinned_registered_count(), 0);
    ts_tensor_free(a);
    cr_assert_eq(f.deregs, 2, "a block freed after clearing is not deregistered twice");
    cr_assert_eq(g.regs, 0);
    th_mem_assert_back();
}

Test(base_pinned, large_blocks_are_huge_page_aligned, .timeout = 30)
{
    th_mem_mark();
    int64_t n = (3 << 20) / 4; /* 3 MiB */
    ts_tensor *t = th_empty(TS_F32, 1, &n);
    TH_OK(ts_storage_pin(ts_tensor_storage(t)));
    cr_assert_eq((uintptr_t)ts_tensor_data(t) % ((size_t)2 << 20), 0, "2 MiB-aligned, as the pool's large blocks");
    memset(ts_tensor_data(t), 1, (size_t)n * 4);
    ts_tensor_free(t);
    th_mem_assert_back();
}
