#define _GNU_SOURCE
#include "base/base.h"
#include "base/internal.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

/* Every block carries a 64-byte header (size and tag) so that ts__free
 * can count it back without the caller passing the size. */
#define TS__HDR 64

typedef struct {
    size_t size;
    int tag;
    uint32_t magic;
} alloc_hdr;
_Static_assert(sizeof(alloc_hdr) <= TS__HDR, "header too large");
#define TS__MAGIC 0x7E50A11Cu

static atomic_size_t live[TS_MEM_TAG_COUNT];
static atomic_size_t peak[TS_MEM_TAG_COUNT];

/* The default allocator: malloc with room to align the block, the
 * distance back to malloc's pointer stored in the 8 bytes before it
 * (malloc's 16-byte alignment leaves at least 16). glibc's aligned_alloc
 * splits a chunk on every call and merges it back on free: on the small
 * blocks that tensors, autograd nodes and collective requests take
 * (a few a microsecond in a step of many small modules) it cost several
 * times malloc's own work (bench_fsdp_overhead, issue 12). */
static void *default_alloc(size_t size, size_t align, void *ctx)
{
    (void)ctx;
    if (align < 16) align = 16;
    if (size > SIZE_MAX - align) return NULL;
    unsigned char *raw = malloc(size + align);
    if (!raw) return NULL;
    uintptr_t a = ((uintptr_t)raw + align) & ~(uintptr_t)(align - 1); /* raw + [16, align] */
    unsigned char *p = raw + (a - (uintptr_t)raw);
    size_t back = (size_t)(p - raw);
    memcpy(p - sizeof back, &back, sizeof back);
    return p;
}

static void default_free(void *p, size_t size, void *ctx)
{
    (void)size;
    (void)ctx;
    size_t back;
    memcpy(&back, (unsigned char *)p - sizeof back, sizeof back);
    free((unsigned char *)p - back);
}

static ts_allocator allocator = {default_alloc, default_free, NULL};

ts_status ts_set_allocator(const ts_allocator *a)
{
    size_t total = ts_mem_live_total();
    if (total != 0)
        return ts_error(TS_ERR_STATE,
                        "ts_set_allocator: %zu bytes are still live; install the allocator "
                        "before the first allocation",
                        total);
    if (a && (!a->alloc || !a->free))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_set_allocator: alloc and free must both be set");
    if (a) allocator = *a;
    else allocator = (ts_allocator){default_alloc, default_free, NULL};
    return TS_OK;
}

static void count(int tag, size_t n, bool add)
{
    if (add) {
        size_t now = atomic_fetch_add_explicit(&live[tag], n, memory_order_relaxed) + n;
        size_t p = atomic_load_explicit(&peak[tag], memory_order_relaxed);
        while (
            now > p &&
            !atomic_compare_exchange_weak_explicit(&peak[tag], &p, now, memory_order_relaxed, memory_order_relaxed)) {}
    } else {
        atomic_fetch_sub_explicit(&live[tag], n, memory_order_relaxed);
    }
}

void ts__mem_count(ts_mem_tag tag, size_t bytes, bool add)
{
    if ((unsigned)tag < TS_MEM_TAG_COUNT) count(tag, bytes, add);
}

void *ts__malloc(ts_mem_tag tag, size_t size)
{
    if ((unsigned)tag >= TS_MEM_TAG_COUNT) tag = TS_MEM_OTHER;
    if (size > SIZE_MAX - TS__HDR) {
        ts_error(TS_ERR_NO_MEMORY, "allocation of %zu bytes (%s) is too large", size, ts_mem_tag_name(tag));
        return NULL;
    }
    char *p = allocator.alloc(size + TS__HDR, 64, allocator.ctx);
    if (!p) {
        ts_error(TS_ERR_NO_MEMORY, "out of memory allocating %zu bytes (%s)", size, ts_mem_tag_name(tag));
        return NULL;
    }
    alloc_hdr *h = (alloc_hdr *)p;
    h->size = size;
    h->tag = (int)tag;
    h->magic = TS__MAGIC;
    count(tag, size, true);
    return p + TS__HDR;
}

void *ts__malloc_raw(ts_mem_tag tag, size_t size, size_t align)
{
    if ((unsigned)tag >= TS_MEM_TAG_COUNT) tag = TS_MEM_OTHER;
    if (align < 64 || (align & (align - 1)) || size > SIZE_MAX - align) {
        ts_error(TS_ERR_NO_MEMORY, "allocation of %zu bytes aligned to %zu (%s) is not possible", size, align,
                 ts_mem_tag_name(tag));
        return NULL;
    }
    void *p = allocator.alloc(size, align, allocator.ctx);
    if (!p) {
        ts_error(TS_ERR_NO_MEMORY, "out of memory allocating %zu bytes (%s)", size, ts_mem_tag_name(tag));
        return NULL;
    }
    count(tag, size, true);
    return p;
}

void ts__free_raw(ts_mem_tag tag, void *ptr, size_t size)
{
    if (!ptr) return;
    if ((unsigned)tag >= TS_MEM_TAG_COUNT) tag = TS_MEM_OTHER;
    count(tag, size, false);
    allocator.free(ptr, size, allocator.ctx);
}

void *ts__calloc(ts_mem_tag tag, size_t n, size_t size)
{
    if (size && n > SIZE_MAX / size) {
        ts_error(TS_ERR_NO_MEMORY, "allocation of %zu x %zu bytes overflows", n, size);
        return NULL;
    }
    void *p = ts__malloc(tag, n * size);
    if (p) memset(p, 0, n * size);
    return p;
}

void ts__free(ts_mem_tag tag, void *ptr)
{
    (void)tag;
    if (!ptr) return;
    char *p = (char *)ptr - TS__HDR;
    alloc_hdr *h = (alloc_hdr *)p;
    TS_ASSERT(h->magic == TS__MAGIC);
    h->magic = 0;
    count(h->tag, h->size, false);
    allocator.free(p, h->size + TS__HDR, allocator.ctx);
}

char *ts__strdup(ts_mem_tag tag, const char *s)
{
    if (!s) return NULL;
    size_t n = strlen(s) + 1;
    char *d = ts__malloc(tag, n);
    if (d) memcpy(d, s, n);
    return d;
}

size_t ts_mem_live_bytes(ts_mem_tag tag)
{
    if ((unsigned)tag >= TS_MEM_TAG_COUNT) return 0;
    return atomic_load_explicit(&live[tag], memory_order_relaxed);
}

size_t ts_mem_live_total(void)
{
    size_t t = 0;
    for (int i = 0; i < TS_MEM_TAG_COUNT; i++) t += atomic_load_explicit(&live[i], memory_order_relaxed);
    return t;
}

size_t ts_mem_peak_bytes(ts_mem_tag tag)
{
    if ((unsigned)tag >= TS_MEM_TAG_COUNT) return 0;
    return atomic_load_explicit(&peak[tag], memory_order_relaxed);
}

void ts_mem_reset_peak(void)
{
    for (int i = 0; i < TS_MEM_TAG_COUNT; i++)
        atomic_store_explicit(&peak[i], atomic_load_explicit(&live[i], memory_order_relaxed), memory_order_relaxed);
}

const char *ts_mem_tag_name(ts_mem_tag tag)
{
    static const char *const names[TS_MEM_TAG_COUNT] = {"other",    "tensor", "storage", "pool",
                                                        "autograd", "comm",   "nn",      "pinned"};
    if ((unsigned)tag >= TS_MEM_TAG_COUNT) return "invalid";
    return names[tag];
}
