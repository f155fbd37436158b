/* The meta device (docs/meta.md): each thread's scoped default device, and
 * the ledger that counts the blocks the caching pool would hand out for
 * meta storages, with a model of the pool's free lists so that it predicts
 * the pool's growth as well as the bytes in use.
 *
 * [Note: meta ledger]
 * tensor/pool.c rounds every allocation up to a size class, keeps freed
 * blocks on per-class free lists and grows (TS_MEM_POOL) only when the
 * class has no cached block; TS_MEM_STORAGE counts the blocks in use. The
 * ledger repeats that bookkeeping with counts instead of blocks: an
 * allocation of class c takes a cached block of c if the ledger holds one,
 * else the modeled pool grows by the class's bytes; a free caches the
 * block. Replaying a step on meta tensors therefore gives the same
 * storage peak and the same pool growth as the step on the CPU, from the
 * same starting cache (both empty: ts_pool_empty_cache, ts_meta_reset).
 * One ledger per thread (ranks simulated by threads each have theirs); a
 * storage keeps a reference to the ledger that counted it, so a free on
 * another thread, or after the counting thread ended, lands there. */
#define _GNU_SOURCE
#include "tensor/internal.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ------------------------------------------------------------ device scope */

static _Thread_local ts_device tl_scope[TS_DEVICE_SCOPE_MAX_DEPTH];
static _Thread_local int tl_depth;

const char *ts_device_name(ts_device d)
{
    switch (d) {
    case TS_DEVICE_CPU: return "cpu";
    case TS_DEVICE_META: return "meta";
    }
    return "invalid";
}

ts_status ts_device_scope_enter(ts_device d)
{
    if (d != TS_DEVICE_CPU && d != TS_DEVICE_META)
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "ts_device_scope_enter: invalid device %d (TS_DEVICE_CPU or "
                        "TS_DEVICE_META)",
                        (int)d);
    if (tl_depth == TS_DEVICE_SCOPE_MAX_DEPTH)
        return ts_error(TS_ERR_STATE,
                        "ts_device_scope_enter: %d device scopes are open on this thread, the limit "
                        "(is a ts_device_scope_exit missing?)",
                        tl_depth);
    tl_scope[tl_depth++] = d;
    return TS_OK;
}

ts_status ts_device_scope_exit(void)
{
    if (tl_depth == 0)
        return ts_error(TS_ERR_STATE,
                        "ts_device_scope_exit: no device scope is open on this thread (each exit "
                        "closes a ts_device_scope_enter of the same thread)");
    tl_depth--;
    return TS_OK;
}

ts_device ts_default_device(void) { return tl_depth ? tl_scope[tl_depth - 1] : TS_DEVICE_CPU; }

bool ts__meta_mode(void) { return tl_depth && tl_scope[tl_depth - 1] == TS_DEVICE_META; }

/* ------------------------------------------------------------------ ledger */

/* The ledgers live in plain calloc memory, not under a ts_mem tag: they
 * are bookkeeping of the thread, like autograd's callback queue, and must
 * not keep ts_set_allocator from finding the library's memory empty. */
typedef struct ts_meta_ledger {
    atomic_int refcount; /* the thread's, and one per storage that points at it */
    pthread_mutex_t lock;
    size_t live, peak, pool, pool_peak;
    size_t cached_bytes;
    uint32_t cached[TS__POOL_CLASSES]; /* modeled free blocks per size class */
} ts_meta_ledger;

static pthread_once_t key_once = PTHREAD_ONCE_INIT;
static pthread_key_t ledger_key;
static _Thread_local ts_meta_ledger *tl_ledger;

static void ledger_release(ts_meta_ledger *l)
{
    if (!l || atomic_fetch_sub_explicit(&l->refcount, 1, memory_order_acq_rel) != 1) return;
    pthread_mutex_destroy(&l->lock);
    free(l); /* calloc'd by thread_ledger: libc, see there */
}

static void thread_ended(void *l) { ledger_release(l); }
static void key_init(void) { (void)pthread_key_create(&ledger_key, thread_ended); }

/* The calling thread's ledger; made at its first meta allocation when
 * `make` (NULL if it cannot be). */
static ts_meta_ledger *thread_ledger(bool make)
{
    if (tl_ledger || !make) return tl_ledger;
    pthread_once(&key_once, key_init);
    /* libc, not the hook: the ledger lives as long as its thread (the main
     * thread's for good), and the thread-exit destructor may run after
     * ts_set_allocator swapped the allocator */
    ts_meta_ledger *l = calloc(1, sizeof *l);
    if (!l) return NULL;
    atomic_init(&l->refcount, 1);
    pthread_mutex_init(&l->lock, NULL);
    (void)pthread_setspecific(ledger_key, l); /* the thread's reference, dropped when it ends */
    tl_ledger = l;
    return l;
}

static size_t page_bytes(void)
{
    long p = sysconf(_SC_PAGESIZE);
    return p >= 64 ? (size_t)p : 4096;
}

/* What the pool (or, pinned, ts__pinned_alloc) hands out for nbytes. */
static size_t block_for(size_t nbytes, bool pinned)
{
    if (!pinned) return ts__pool_block_bytes(nbytes);
    size_t pg = page_bytes();
    return (nbytes ? nbytes + pg - 1 : pg) / pg * pg;
}

/* Under l->lock. A pinned block is live storage but no pool block. */
static void count_alloc(ts_meta_ledger *l, size_t bytes, bool pinned)
{
    size_t cb;
    int c = pinned ? -1 : ts__pool_size_class(bytes, &cb);
    if (c >= 0 && l->cached[c]) {
        l->cached[c]--;
        l->cached_bytes -= bytes;
    } else if (!pinned) {
        l->pool += bytes;
        if (l->pool > l->pool_peak) l->pool_peak = l->pool;
    }
    l->live += bytes;
    if (l->live > l->peak) l->peak = l->live;
}

static void count_free(ts_meta_ledger *l, size_t bytes, bool pinned)
{
    size_t cb;
    int c = pinned ? -1 : ts__pool_size_class(bytes, &cb);
    l->live -= bytes;
    if (c >= 0) {
        l->cached[c]++;
        l->cached_bytes += bytes;
    } else if (!pinned) {
        l->pool -= bytes;
    }
}

ts_status ts__meta_ledger_alloc(ts_storage *s, size_t nbytes)
{
    ts_meta_ledger *l = s->ledger;
    if (!l) {
        if (!(l = thread_ledger(true)))
            return ts_error(TS_ERR_NO_MEMORY, "meta device: cannot allocate this thread's ledger");
        atomic_fetch_add_explicit(&l->refcount, 1, memory_order_relaxed);
        s->ledger = l;
    }
    size_t bytes = block_for(nbytes, s->pinned);
    pthread_mutex_lock(&l->lock);
    count_alloc(l, bytes, s->pinned);
    pthread_mutex_unlock(&l->lock);
    s->block_bytes = bytes;
    return TS_OK;
}

void ts__meta_ledger_free(ts_storage *s)
{
    ts_meta_ledger *l = s->ledger;
    if (!l || !s->block_bytes) return;
    pthread_mutex_lock(&l->lock);
    count_free(l, s->block_bytes, s->pinned);
    pthread_mutex_unlock(&l->lock);
    s->block_bytes = 0;
}

void ts__meta_ledger_forget(ts_storage *s)
{
    ts_meta_ledger *l = s->ledger;
    if (!l || !s->block_bytes) return;
    pthread_mutex_lock(&l->lock);
    l->live -= s->block_bytes;
    if (!s->pinned) l->pool -= s->block_bytes;
    pthread_mutex_unlock(&l->lock);
    s->block_bytes = 0;
}

void ts__meta_ledger_detach(ts_storage *s)
{
    ledger_release(s->ledger);
    s->ledger = NULL;
}

void ts__meta_scratch(int n, const size_t *nbytes)
{
    ts_meta_ledger *l = thread_ledger(true);
    if (!l || n <= 0) return;
    pthread_mutex_lock(&l->lock);
    for (int i = 0; i < n; i++) count_alloc(l, ts__pool_block_bytes(nbytes[i]), false);
    for (int i = 0; i < n; i++) count_free(l, ts__pool_block_bytes(nbytes[i]), false);
    pthread_mutex_unlock(&l->lock);
}

void ts__meta_cache_blocks(int n, const size_t *nbytes)
{
    ts_meta_ledger *l = thread_ledger(true);
    if (!l || n <= 0) return;
    pthread_mutex_lock(&l->lock);
    for (int i = 0; i < n; i++) {
        size_t cb;
        int c = ts__pool_size_class(nbytes[i], &cb);
        if (c < 0) continue; /* larger than every class: the pool does not keep it */
        l->cached[c]++;
        l->cached_bytes += cb;
        l->pool += cb;
        if (l->pool > l->pool_peak) l->pool_peak = l->pool;
    }
    pthread_mutex_unlock(&l->lock);
}

ts_meta_stats ts_meta_get_stats(void)
{
    ts_meta_stats r = {0};
    ts_meta_ledger *l = thread_ledger(false);
    if (!l) return r;
    pthread_mutex_lock(&l->lock);
    r = (ts_meta_stats){
        .live = l->live, .peak = l->peak, .pool = l->pool, .pool_peak = l->pool_peak, .cached = l->cached_bytes};
    pthread_mutex_unlock(&l->lock);
    return r;
}

void ts_meta_reset_peak(void)
{
    ts_meta_ledger *l = thread_ledger(false);
    if (!l) return;
    pthread_mutex_lock(&l->lock);
    l->peak = l->live;
    l->pool_peak = l->pool;
    pthread_mutex_unlock(&l->lock);
}

void ts_meta_empty_cache(void)
{
    ts_meta_ledger *l = thread_ledger(false);
    if (!l) return;
    pthread_mutex_lock(&l->lock);
    l->pool -= l->cached_bytes;
    l->cached_bytes = 0;
    memset(l->cached, 0, sizeof l->cached);
    pthread_mutex_unlock(&l->lock);
}

void ts_meta_reset(void)
{
    ts_meta_empty_cache();
    ts_meta_reset_peak();
}

/* ------------------------------------------------------------------ errors */

ts_status ts__meta_error(const char *op, int index, const ts_tensor *t)
{
    char s[96], who[48];
    if (index >= 0) snprintf(who, sizeof who, "input %d", index);
    else snprintf(who, sizeof who, "tensor");
    return ts_error(TS_ERR_STATE,
                    "%s: %s%s%s%s %s is on the meta device (it has no data): materialize the model or "
                    "load a checkpoint first%s",
                    op, who, t->name ? " '" : "", t->name ? t->name : "", t->name ? "'" : "",
                    ts_shape_str(t->ndim, t->shape, s, sizeof s),
                    index >= 0 ? " (inside ts_device_scope_enter(TS_DEVICE_META) ops compute only shapes and memory)"
                               : "");
}
