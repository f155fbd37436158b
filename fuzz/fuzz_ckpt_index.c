/* libFuzzer target for the sharded checkpoint's index parser
 * (checkpoint/index.c; fuzz/README.md says how to build and run it).
 * Every input must either parse into an index whose promises hold, or fail
 * with TS_ERR_FORMAT and a message, without crashing, reading out of
 * bounds or leaking. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint/internal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static size_t live_bytes(void) { return ts_mem_live_bytes(TS_MEM_OTHER); }

static void fail(const char *what, const char *key)
{
    fprintf(stderr, "accepted an index that breaks its promise: %s (key '%s')\n", what, key);
    abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    ts_log_set_level(TS_LOG_ERROR);
    size_t before = live_bytes();
    ts__ckpt_index *ix = NULL;
    ts_status st = ts__ckpt_index_parse("<fuzz>", (const char *)data, size, &ix);
    if (st == TS_OK) {
        /* what a parse promises the loader: files in range, pieces inside
         * their files with the length their rows need, rows covered once */
        if (ix->world < 1) fail("world < 1", "");
        if (ix->version < TS__CKPT_INDEX_VERSION_MIN || ix->version > TS__CKPT_INDEX_VERSION) fail("version", "");
        for (int f = 0; f < ix->n_files; f++)
            for (int g = 0; g < f; g++)
                if (ix->files[f].rank == ix->files[g].rank) fail("two files of one rank", ix->files[f].name);
        for (int i = 0; i < ix->n_tensors; i++) {
            const ts__ckpt_tensor *t = &ix->tensors[i];
            if (i && strcmp(ix->tensors[i - 1].key, t->key) >= 0) fail("keys not sorted", t->key);
            if (ts__ckpt_index_find(ix, t->key) != t) fail("lookup", t->key);
            int64_t covered = 0;
            for (int k = 0; k < t->n_pieces; k++) {
                const ts__ckpt_piece *p = &t->pieces[k];
                if (p->file < 0 || p->file >= ix->n_files) fail("file index", t->key);
                if (p->offset > ix->files[p->file].size || p->length > ix->files[p->file].size - p->offset)
                    fail("piece outside its file", t->key);
                if (p->length != (uint64_t)p->rows * t->row_bytes) fail("length", t->key);
                if (p->row < 0 || p->rows < 0 || p->row + p->rows > t->rows) fail("rows", t->key);
                if (ix->version >= 2 && !p->has_hash) fail("a version 2 piece without a hash", t->key);
                covered += p->rows;
            }
            if (t->kind != TS__CKPT_RANK_EXTRA && t->row_bytes && covered != t->rows) fail("coverage", t->key);
        }
        ts__ckpt_index_free(ix);
    } else if (st != TS_ERR_FORMAT || ix != NULL || !ts_last_error()[0]) {
        fprintf(stderr, "parse failed with %s, output %p, message '%s'\n", ts_status_name(st), (void *)ix,
                ts_last_error());
        abort();
    }
    if (live_bytes() != before) {
        fprintf(stderr, "library memory leaked: %zu live bytes before, %zu after\n", before, live_bytes());
        abort();
    }
    return 0;
}
