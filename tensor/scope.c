/* Scopes for temporaries (tensor/tensor.h, "scopes for temporaries"): a
 * per-thread stack of frames, each the list of references its scope owns.
 *
 * [Note: scope frames] The first SCOPE_INLINE_FRAMES frames live in
 * thread-local storage and each frame has room for SCOPE_INLINE_ITEMS
 * tensors of its own, so that a forward's scope allocates nothing in the
 * common case; deeper stacks and longer lists move to the heap, and the
 * heap stack is given back when the thread's outermost scope ends (a
 * thread that has no scope open holds no heap memory here). A frame's id
 * is unique over the process, so a scope that has ended, or another
 * thread's, is recognised (its depth holds another id, or none). */
#include "tensor/internal.h"

#include <stdatomic.h>
#include <string.h>

#define SCOPE_INLINE_FRAMES 16
#define SCOPE_INLINE_ITEMS 8

typedef struct frame {
    uint64_t id;
    ts_tensor **items; /* inline_items or a heap array */
    int n, cap;
    ts_tensor *inline_items[SCOPE_INLINE_ITEMS];
} frame;

static _Thread_local frame tl_inline[SCOPE_INLINE_FRAMES];
static _Thread_local frame *tl_heap; /* the stack once it outgrew tl_inline; NULL before */
static _Thread_local int tl_depth, tl_heap_cap;
static atomic_uint_fast64_t g_next_id = 1;

static frame *frames(void) { return tl_heap ? tl_heap : tl_inline; }
static int frames_cap(void) { return tl_heap ? tl_heap_cap : SCOPE_INLINE_FRAMES; }

/* Moves the stack to a heap array twice as deep; a frame whose list was
 * inline points at its new place. */
static bool grow_frames(void)
{
    int cap = 2 * frames_cap();
    frame *old = frames(), *f = ts__malloc(TS_MEM_TENSOR, (size_t)cap * sizeof *f);
    if (!f) return false;
    memcpy(f, old, (size_t)tl_depth * sizeof *f);
    for (int d = 0; d < tl_depth; d++)
        if (old[d].items == old[d].inline_items) f[d].items = f[d].inline_items;
    ts__free(TS_MEM_TENSOR, tl_heap);
    tl_heap = f;
    tl_heap_cap = cap;
    return true;
}

ts_scope ts_scope_begin(void)
{
    if (tl_depth == frames_cap() && !grow_frames()) return (ts_scope){-1, 0};
    frame *f = &frames()[tl_depth];
    f->id = atomic_fetch_add(&g_next_id, 1);
    f->items = f->inline_items;
    f->n = 0;
    f->cap = SCOPE_INLINE_ITEMS;
    return (ts_scope){tl_depth++, f->id};
}

int ts_scope_depth(void) { return tl_depth; }

/* The frame of s, or an error naming fn (recorded only when record). */
static ts_status lookup(const char *fn, ts_scope s, bool record, frame **out)
{
    if (s.id == 0)
        return record
            ? ts_error(TS_ERR_NO_MEMORY, "%s: the scope was not opened (ts_scope_begin ran out of memory)", fn)
            : TS_ERR_NO_MEMORY;
    if (s.depth < 0 || s.depth >= tl_depth || frames()[s.depth].id != s.id)
        return record ? ts_error(TS_ERR_STATE,
                                 "%s: the scope has ended (or was begun on another thread): %d scope%s open on this "
                                 "thread",
                                 fn, tl_depth, tl_depth == 1 ? "" : "s")
                      : TS_ERR_STATE;
    *out = &frames()[s.depth];
    return TS_OK;
}

ts_status ts_scope_add(ts_scope s, ts_tensor *t)
{
    if (!t) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_scope_add: the tensor is NULL (did the call before fail?)");
    frame *f = NULL;
    ts_status st = lookup("ts_scope_add", s, true, &f);
    if (st) {
        ts_tensor_free(t);
        return st;
    }
    if (f->n == f->cap) {
        int cap = 2 * f->cap;
        ts_tensor **items = ts__malloc(TS_MEM_TENSOR, (size_t)cap * sizeof *items);
        if (!items) {
            ts_tensor_free(t);
            return ts_error(TS_ERR_NO_MEMORY, "ts_scope_add: out of memory (a scope of %d tensors)", f->n);
        }
        memcpy(items, f->items, (size_t)f->n * sizeof *items);
        if (f->items != f->inline_items) ts__free(TS_MEM_TENSOR, f->items);
        f->items = items;
        f->cap = cap;
    }
    f->items[f->n++] = t;
    return TS_OK;
}

ts_status ts_scope_keep(ts_scope s, ts_tensor *t)
{
    if (!t) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_scope_keep: the tensor is NULL");
    frame *f = NULL;
    ts_status st = lookup("ts_scope_keep", s, true, &f);
    if (st) return st;
    for (int i = f->n - 1; i >= 0; i--)
        if (f->items[i] == t) { /* the scope's reference becomes the caller's */
            memmove(&f->items[i], &f->items[i + 1], (size_t)(f->n - i - 1) * sizeof *f->items);
            f->n--;
            return TS_OK;
        }
    ts_tensor_retain(t); /* not the scope's: the caller gets a reference of its own */
    return TS_OK;
}

/* Releases the tensors of the frame at depth d, the last added first, and
 * pops it. The frame is found again after each release, which may run
 * code (a node's context freeing a module) that opens scopes above it. */
static void release_top(int d)
{
    while (frames()[d].n > 0) {
        frame *f = &frames()[d];
        ts_tensor *t = f->items[--f->n];
        ts_tensor_free(t);
    }
    frame *f = &frames()[d];
    if (f->items != f->inline_items) ts__free(TS_MEM_TENSOR, f->items);
    f->items = f->inline_items;
    f->id = 0;
    tl_depth = d;
}

static ts_status end_impl(ts_scope s, bool record)
{
    frame *f = NULL;
    ts_status st = lookup("ts_scope_end", s, record, &f);
    if (st) return st;
    int inner = tl_depth - 1 - s.depth;
    for (int d = tl_depth - 1; d >= s.depth; d--) release_top(d);
    if (tl_depth == 0 && tl_heap) { /* no scope open: the thread holds nothing here */
        ts__free(TS_MEM_TENSOR, tl_heap);
        tl_heap = NULL;
        tl_heap_cap = 0;
    }
    if (inner && record)
        return ts_error(TS_ERR_STATE,
                        "ts_scope_end: %d scope%s begun inside this one %s still open (a function returned without "
                        "ending its scope): ended %s too, releasing %s tensors",
                        inner, inner == 1 ? "" : "s", inner == 1 ? "was" : "were", inner == 1 ? "it" : "them",
                        inner == 1 ? "its" : "their");
    return inner ? TS_ERR_STATE : TS_OK;
}

ts_status ts_scope_end(ts_scope s) { return end_impl(s, true); }

ts_status ts_scope_fail(ts_scope s, ts_status st)
{
    (void)end_impl(s, false); /* the error that happened is the one to report */
    return st;
}

ts_status ts_scope_return(ts_scope s, int n, ts_tensor *const *ts, int *n_out, ts_tensor **out)
{
    if (n < 0 || (n > 0 && !ts) || !n_out || !out)
        return ts_scope_fail(s,
                             ts_error(TS_ERR_INVALID_ARGUMENT, "ts_scope_return: %s",
                                      n < 0        ? "n is negative"
                                          : !n_out ? "n_out is NULL"
                                          : !out   ? "out is NULL"
                                                   : "the tensors are NULL"));
    for (int i = 0; i < n; i++)
        if (!ts[i])
            return ts_scope_fail(s,
                                 ts_error(TS_ERR_INVALID_ARGUMENT, "ts_scope_return: tensor %d of %d is NULL", i, n));
    ts_status st = TS_OK;
    int kept = 0;
    while (kept < n && !(st = ts_scope_keep(s, ts[kept]))) kept++;
    if (!st) st = ts_scope_end(s);
    if (st) {
        for (int i = 0; i < kept; i++) ts_tensor_free(ts[i]);
        return ts_scope_fail(s, st);
    }
    for (int i = 0; i < n; i++) out[i] = ts[i];
    *n_out = n;
    return TS_OK;
}
