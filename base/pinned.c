/* Pinned host memory (base.h, "Pinned host memory"): page-aligned blocks
 * locked with mlock and registered once with the transport's memory map
 * through the registrar the communication layer installs. The table of
 * blocks is a list under one mutex: blocks are few (a shard buffer and a
 * gradient buffer per FSDP group) and live long. */
#define _GNU_SOURCE
#include "base/base.h"
#include "base/internal.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct pin_block {
    struct pin_block *next;
    void *addr;
    size_t len;
    bool locked;
    bool registered;
    void *handle; /* the registrar's */
} pin_block;

#define HUGE_BYTES ((size_t)2 << 20)

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pin_block *g_blocks;
static ts__pin_registrar g_reg;
static bool g_has_reg;
static atomic_size_t g_locked;
static bool g_warned;

static size_t page_size(void)
{
    long p = sysconf(_SC_PAGESIZE);
    return p >= 64 ? (size_t)p : 4096;
}

/* Under g_mu. */
static void register_block(pin_block *b)
{
    if (!g_has_reg || b->registered) return;
    void *h = NULL;
    ts_status st = g_reg.reg(g_reg.ctx, b->addr, b->len, &h);
    if (st) {
        ts_logf(TS_LOG_DEBUG, "pinned memory: %zu bytes at %p stay unregistered with the transport: %s", b->len,
                b->addr, ts_last_error());
        return;
    }
    b->registered = true;
    b->handle = h;
}

static void deregister_block(pin_block *b)
{
    if (!b->registered) return;
    if (g_has_reg) g_reg.dereg(g_reg.ctx, b->handle);
    b->registered = false;
    b->handle = NULL;
}

/* mlock(2) and munlock(2) through syscall(): AddressSanitizer intercepts
 * the libc wrappers and makes them no-ops that report success, which
 * would hide a too-low RLIMIT_MEMLOCK (and lock nothing) in sanitized
 * builds. */
static int sys_mlock(void *p, size_t len) { return (int)syscall(SYS_mlock, p, len); }
static int sys_munlock(void *p, size_t len) { return (int)syscall(SYS_munlock, p, len); }

/* mlock, or the warning that says why not (once at warn level). */
static bool lock_block(void *p, size_t len)
{
    if (sys_mlock(p, len) == 0) return true;
    int e = errno;
    struct rlimit rl = {0, 0};
    char lim[64];
    if (getrlimit(RLIMIT_MEMLOCK, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY)
        snprintf(lim, sizeof lim, "%llu bytes", (unsigned long long)rl.rlim_cur);
    else snprintf(lim, sizeof lim, "unlimited");
    ts_log_level lv = g_warned ? TS_LOG_DEBUG : TS_LOG_WARN;
    g_warned = true;
    ts_logf(lv,
            "pinned memory: mlock of %zu bytes failed (%s); RLIMIT_MEMLOCK is %s and %zu bytes are locked "
            "already: the memory stays pageable (raise the limit, e.g. ulimit -l, to pin it)",
            len, strerror(e), lim, atomic_load(&g_locked));
    return false;
}

void *ts__pinned_alloc(size_t size, size_t *block_bytes_out)
{
    if (!block_bytes_out) {
        ts_error(TS_ERR_INVALID_ARGUMENT, "ts__pinned_alloc: block_bytes_out is NULL");
        return NULL;
    }
    size_t pg = page_size();
    if (size > SIZE_MAX - pg) {
        ts_error(TS_ERR_NO_MEMORY, "pinned allocation of %zu bytes is too large", size);
        return NULL;
    }
    size_t cb = (size ? size + pg - 1 : pg) / pg * pg;
    pin_block *b = ts__calloc(TS_MEM_OTHER, 1, sizeof *b);
    if (!b) return NULL;
    /* as the tensor pool's blocks (tensor/pool.c): 2 MiB and more are
     * 2 MiB-aligned and advised as huge pages, before mlock faults them in */
    size_t align = cb >= HUGE_BYTES ? HUGE_BYTES : pg;
    void *p = ts__malloc_raw(TS_MEM_PINNED, cb, align);
#ifdef MADV_HUGEPAGE
    if (p && align == HUGE_BYTES) madvise(p, cb, MADV_HUGEPAGE); /* advice only */
#endif
    if (!p) {
        ts__free(TS_MEM_OTHER, b);
        return NULL;
    }
    b->addr = p;
    b->len = cb;
    pthread_mutex_lock(&g_mu);
    b->locked = lock_block(p, cb);
    if (b->locked) atomic_fetch_add(&g_locked, cb);
    register_block(b);
    b->next = g_blocks;
    g_blocks = b;
    pthread_mutex_unlock(&g_mu);
    *block_bytes_out = cb;
    return p;
}

void ts__pinned_free(void *p, size_t block_bytes)
{
    if (!p) return;
    pthread_mutex_lock(&g_mu);
    pin_block **pp = &g_blocks;
    while (*pp && (*pp)->addr != p) pp = &(*pp)->next;
    pin_block *b = *pp;
    TS_ASSERT(b && b->len == block_bytes);
    *pp = b->next;
    deregister_block(b);
    if (b->locked) {
        sys_munlock(p, b->len);
        atomic_fetch_sub(&g_locked, b->len);
    }
    pthread_mutex_unlock(&g_mu);
    ts__free_raw(TS_MEM_PINNED, p, b->len);
    ts__free(TS_MEM_OTHER, b);
}

bool ts__pinned_is_locked(const void *p)
{
    bool locked = false;
    pthread_mutex_lock(&g_mu);
    for (pin_block *b = g_blocks; b; b = b->next)
        if (b->addr == p) locked = b->locked;
    pthread_mutex_unlock(&g_mu);
    return locked;
}

size_t ts_mem_locked_bytes(void) { return atomic_load(&g_locked); }

ts_status ts__pin_registrar_set(const ts__pin_registrar *r)
{
    if (!r || !r->reg || !r->dereg)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts__pin_registrar_set: NULL registrar or function");
    pthread_mutex_lock(&g_mu);
    if (g_has_reg) {
        pthread_mutex_unlock(&g_mu);
        return ts_error(TS_ERR_ALREADY, "ts__pin_registrar_set: another transport's registrar is installed");
    }
    g_reg = *r;
    g_has_reg = true;
    for (pin_block *b = g_blocks; b; b = b->next) register_block(b);
    pthread_mutex_unlock(&g_mu);
    return TS_OK;
}

void ts__pin_registrar_clear(void *ctx)
{
    pthread_mutex_lock(&g_mu);
    if (g_has_reg && g_reg.ctx == ctx) {
        for (pin_block *b = g_blocks; b; b = b->next) deregister_block(b);
        g_has_reg = false;
        memset(&g_reg, 0, sizeof g_reg);
    }
    pthread_mutex_unlock(&g_mu);
}

int ts__pinned_registered_count(void)
{
    int n = 0;
    pthread_mutex_lock(&g_mu);
    for (pin_block *b = g_blocks; b; b = b->next) n += b->registered;
    pthread_mutex_unlock(&g_mu);
    return n;
}
