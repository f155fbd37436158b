/* libFuzzer target for the safetensors parser (fuzz/README.md says how to
 * build and run it). Every input must either parse or fail with
 * TS_ERR_FORMAT, without crashing, reading out of bounds or leaking. */
#include <stdio.h>
#include <stdlib.h>

#include "nn/nn.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Bytes the library counts as live under the tags a parse allocates in
 * (the caching pool's own tag is left out: it keeps freed blocks). */
static size_t live_bytes(void)
{
    return ts_mem_live_bytes(TS_MEM_NN) + ts_mem_live_bytes(TS_MEM_TENSOR) + ts_mem_live_bytes(TS_MEM_STORAGE) +
        ts_mem_live_bytes(TS_MEM_OTHER);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* parses of NaN data warn; keep the fuzzer's output to findings */
    ts_log_set_level(TS_LOG_ERROR);
    size_t before = live_bytes();
    ts_state_dict *sd = NULL;
    ts_status st = ts_safetensors_parse(data, size, &sd);
    if (st == TS_OK) {
        /* what a parse promises: every tensor exists and owns its bytes */
        for (int i = 0; i < ts_state_dict_size(sd); i++) {
            ts_tensor *t = ts_state_dict_tensor(sd, i);
            size_t n = (size_t)ts_tensor_numel(t) * ts_dtype_size(ts_tensor_dtype(t));
            if (!ts_state_dict_name(sd, i)[0] || n > size) {
                fprintf(stderr, "bad entry %d accepted\n", i);
                abort();
            }
            volatile unsigned char sink = 0;
            const unsigned char *p = ts_tensor_data(t);
            for (size_t k = 0; k < n; k++) sink ^= p[k];
            (void)sink;
        }
        ts_state_dict_free(sd);
    } else if (st != TS_ERR_FORMAT || sd != NULL || !ts_last_error()[0]) {
        fprintf(stderr, "parse failed with %s, output %p, message '%s'\n", ts_status_name(st), (void *)sd,
                ts_last_error());
        abort();
    }
    /* return cached blocks, so that ASan sees any later use of them */
    ts_pool_empty_cache();
    if (live_bytes() != before) {
        fprintf(stderr, "library memory leaked: %zu live bytes before, %zu after\n", before, live_bytes());
        abort();
    }
    return 0;
}
