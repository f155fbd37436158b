#define _GNU_SOURCE
#include "tensor/internal.h"

ts_status ts__storage_new(size_t nbytes, ts_storage **out)
{
    ts_storage *s = ts__calloc(TS_MEM_TENSOR, 1, sizeof *s);
    if (!s)
        return TS_ERR_NO_MEMORY;
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

void ts__storage_retain(ts_storage *s) { atomic_fetch_add_explicit(&s->refcount, 1, memory_order_relaxed); }

void ts__storage_release_ref(ts_storage *s)
{
    if (!s || atomic_fetch_sub_explicit(&s->refcount, 1, memory_order_acq_rel) != 1)
        return;
    ts__pool_free(s->data, s->block_bytes);
    ts__free(TS_MEM_TENSOR, s);
}

size_t ts_storage_nbytes(const ts_storage *s) { return s ? s->nbytes : 0; }
bool ts_storage_is_released(const ts_storage *s) { return s && s->released; }
void *ts_storage_data(ts_storage *s) { return s && !s->released ? s->data : NULL; }

ts_status ts_storage_release(ts_storage *s)
{
    if (!s)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_storage_release: storage is NULL");
    if (s->released)
        return TS_OK;
    ts__pool_free(s->data, s->block_bytes);
    s->data = NULL;
    s->block_bytes = 0;
    s->released = true;
    return TS_OK;
}

ts_status ts_storage_restore(ts_storage *s)
{
    if (!s)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_storage_restore: storage is NULL");
    if (!s->released)
        return TS_OK;
    void *d = ts__pool_alloc(s->nbytes, &s->block_bytes);
    if (!d)
        return ts_error(TS_ERR_NO_MEMORY, "ts_storage_restore: cannot allocate %zu bytes", s->nbytes);
    s->data = d;
    s->released = false;
    return TS_OK;
}
