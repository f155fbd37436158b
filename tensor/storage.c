#define _GNU_SOURCE
#include "tensor/internal.h"

#include <string.h>

ts_status ts__storage_new(size_t nbytes, ts_storage **out)
{
    ts_storage *s = ts__calloc(TS_MEM_TENSOR, 1, sizeof *s);
    if (!s) return TS_ERR_NO_MEMORY;
    s->data = ts__pool_alloc(nbytes, &s->block_bytes);
    if (!s->data) {
        ts__free(TS_MEM_TENSOR, s);
        return TS_ERR_NO_MEMORY;
    }
    atomic_init(&s->refcount, 1);
    s->nbytes = nbytes;
    *out = s;
    return TS_OK;
}

ts_status ts__storage_new_meta(size_t nbytes, ts_storage **out)
{
    ts_storage *s = ts__calloc(TS_MEM_TENSOR, 1, sizeof *s);
    if (!s) return TS_ERR_NO_MEMORY;
    atomic_init(&s->refcount, 1);
    s->nbytes = nbytes;
    s->meta = true;
    ts_status st = ts__meta_ledger_alloc(s, nbytes); /* sets block_bytes */
    if (st) {
        ts__free(TS_MEM_TENSOR, s);
        return st;
    }
    *out = s;
    return TS_OK;
}

void ts__storage_retain(ts_storage *s) { atomic_fetch_add_explicit(&s->refcount, 1, memory_order_relaxed); }

/* A storage's bytes: a pinned block (counted under TS_MEM_STORAGE too, as
 * the pool's blocks in use are) or a pool block. */
static void *data_alloc(bool pinned, size_t nbytes, size_t *block_bytes)
{
    if (!pinned) return ts__pool_alloc(nbytes, block_bytes);
    void *d = ts__pinned_alloc(nbytes, block_bytes);
    if (d) ts__mem_count(TS_MEM_STORAGE, *block_bytes, true);
    return d;
}

static void data_free(bool pinned, void *d, size_t block_bytes)
{
    if (!d) return;
    if (!pinned) {
        ts__pool_free(d, block_bytes);
        return;
    }
    ts__mem_count(TS_MEM_STORAGE, block_bytes, false);
    ts__pinned_free(d, block_bytes);
}

void ts__storage_release_ref(ts_storage *s)
{
    if (!s || atomic_fetch_sub_explicit(&s->refcount, 1, memory_order_acq_rel) != 1) return;
    if (s->meta) {
        ts__meta_ledger_free(s);
        ts__meta_ledger_detach(s);
    } else {
        data_free(s->pinned, s->data, s->block_bytes);
    }
    ts__init_storage_drop(s); /* [Note: deferred init] */
    ts__free(TS_MEM_TENSOR, s);
}

ts_status ts_storage_pin(ts_storage *s)
{
    if (!s) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_storage_pin: storage is NULL");
    if (s->pinned) return TS_OK;
    if (s->released) { /* restore gives it a pinned block */
        s->pinned = true;
        return TS_OK;
    }
    if (s->meta) { /* the pool block goes back to the ledger, a pinned block is counted */
        ts__meta_ledger_free(s);
        s->pinned = true;
        return ts__meta_ledger_alloc(s, s->nbytes);
    }
    size_t bb = 0;
    void *d = data_alloc(true, s->nbytes, &bb);
    if (!d) return ts_error(TS_ERR_NO_MEMORY, "ts_storage_pin: cannot allocate %zu pinned bytes", s->nbytes);
    if (s->nbytes) memcpy(d, s->data, s->nbytes);
    data_free(false, s->data, s->block_bytes);
    s->data = d;
    s->block_bytes = bb;
    s->pinned = true;
    return TS_OK;
}

bool ts_storage_is_pinned(const ts_storage *s) { return s && s->pinned; }
bool ts_storage_is_meta(const ts_storage *s) { return s && s->meta; }

size_t ts_storage_nbytes(const ts_storage *s) { return s ? s->nbytes : 0; }
bool ts_storage_is_released(const ts_storage *s) { return s && s->released; }
void *ts_storage_data(ts_storage *s) { return s && !s->released ? s->data : NULL; }

ts_status ts_storage_release(ts_storage *s)
{
    if (!s) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_storage_release: storage is NULL");
    if (s->released) return TS_OK;
    if (s->meta) ts__meta_ledger_free(s);
    else data_free(s->pinned, s->data, s->block_bytes);
    s->data = NULL;
    s->block_bytes = 0;
    s->released = true;
    return TS_OK;
}

ts_status ts_storage_restore(ts_storage *s)
{
    if (!s) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_storage_restore: storage is NULL");
    if (!s->released) return TS_OK;
    if (s->meta) {
        ts_status st = ts__meta_ledger_alloc(s, s->nbytes);
        if (!st) s->released = false;
        return st;
    }
    void *d = data_alloc(s->pinned, s->nbytes, &s->block_bytes);
    if (!d)
        return ts_error(TS_ERR_NO_MEMORY, "ts_storage_restore: cannot allocate %zu%s bytes", s->nbytes,
                        s->pinned ? " pinned" : "");
    s->data = d;
    s->released = false;
    return TS_OK;
}

ts_status ts_storage_materialize(ts_storage *s)
{
    if (!s) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_storage_materialize: storage is NULL");
    if (!s->meta) return TS_OK;
    if (s->released) { /* no block on the ledger: restore gives it real bytes */
        ts__meta_ledger_detach(s);
        s->meta = false;
        return TS_OK;
    }
    size_t bb = 0;
    void *d = data_alloc(s->pinned, s->nbytes, &bb);
    if (!d)
        return ts_error(TS_ERR_NO_MEMORY, "ts_storage_materialize: cannot allocate %zu%s bytes", s->nbytes,
                        s->pinned ? " pinned" : "");
    memset(d, 0, s->nbytes);
    ts__meta_ledger_forget(s);
    ts__meta_ledger_detach(s);
    s->data = d;
    s->block_bytes = bb;
    s->meta = false;
    return TS_OK;
}
