/* Internal helpers of the nn layer. */
#ifndef TS_NN_INTERNAL_H
#define TS_NN_INTERNAL_H

#include "base/internal.h"
#include "nn/nn.h"

#include <pthread.h>

/* named parameters with (dedup) or without duplicates */
ts_status ts__module_params(ts_module *m, bool dedup, ts_named_params *out);
/* parameters and/or buffers in state-dict order (per module: parameters,
 * buffers, then children), with or without duplicates */
ts_status ts__module_entries(ts_module *m, bool params, bool buffers, bool dedup, ts_named_params *out);
/* dst = "prefix.name" ("name" when prefix is empty), the fully qualified
 * name of a child; TS_ERR_INVALID_ARGUMENT when it needs cap bytes or more
 * (nn/traverse.c) */
ts_status ts__module_fqn_join(char *dst, size_t cap, const char *prefix, const char *name);
/* TS_ERR_INVALID_ARGUMENT (prefixed with fn) unless vt is a usable module
 * vtable: type name, free (when need_free), well-formed methods
 * (ts_module_init's rules) */
ts_status ts__module_vtable_check(const char *fn, const ts_module_vtable *vt, bool need_free);
/* TS_ERR_INVALID_ARGUMENT "<fn>: the vtable of <Type> has no free
 * function" unless m's vtable has a free or the base allocated m
 * (ts_module_new). OK for NULL m or a module without vtable. */
ts_status ts__module_check_free(const char *fn, const ts_module *m);
/* Frees m once its last owner let go. Under an upper layer's vtable
 * (base set) it calls that vtable's free, which puts the vtable below back
 * and calls this again; under the original it releases the declared slots
 * ([Note: declared slots] in nn/register.c), then calls the vtable's free,
 * or frees the struct the base allocated. */
void ts__module_release(ts_module *m);
/* TS_ERR_INVALID_ARGUMENT naming the module type unless min <= n <= max */
ts_status ts__module_check_inputs(ts_module *m, int n_in, int min_in, int max_in);
/* TS_ERR_SHAPE unless x has >= min_ndim dims and last size `want` */
ts_status ts__module_check_last_dim(ts_module *m, const char *what, ts_tensor *x, int min_ndim, int64_t want);
/* TS_ERR_DTYPE naming the module type and both dtypes when input x
 * (called `what`) and parameter p (`pname`) differ in dtype, as torch's
 * layers refuse them (matmul: "mat1 and mat2 must have the same dtype";
 * layer_norm: "expected scalar type"); OK when either is NULL */
ts_status ts__module_check_dtype(ts_module *m, const char *what, ts_tensor *x, const char *pname, ts_tensor *p);
/* A new uninitialised leaf that requires grad (meta inside a meta device scope) */
ts_status ts__param_new(ts_dtype dtype, int ndim, const int64_t *shape, ts_tensor **out);
/* Bool (T, T), true above the diagonal: torch.triu(ones, 1), the causal
 * attention mask (true = may not attend). */
ts_status ts__causal_mask(int64_t T, ts_tensor **out);
/* Copies every parameter value of src into dst (same architecture). */
ts_status ts__module_copy_params(ts_module *dst, ts_module *src);

/* A process-wide cache of the vtables an upper layer makes to extend
 * module types ("<Type><suffix>": nn/activation_checkpoint.c's "Checkpointed",
 * fully_shard's "FSDPModule"), one per original vtable, made on first use
 * and kept for the life of the process. Declare one per layer as a static
 * initialised with TS__VT_CACHE_INIT. */
struct ts__vt_cache_entry;
typedef struct ts__vt_cache {
    pthread_mutex_t mu;
    const char *op;     /* prefix of error messages: "fully_shard" */
    const char *suffix; /* appended to the original type name */
    /* sets the layer's slots of the new vtable vt extending orig (forward,
     * free and whatever else the layer changes); type_name, base, visit,
     * methods and n_methods are set before it is called */
    void (*fill)(ts_module_vtable *vt, const ts_module_vtable *orig);
    struct ts__vt_cache_entry *entries;
    int n, cap;
} ts__vt_cache;
#define TS__VT_CACHE_INIT(op, suffix, fill) \
    { \
        PTHREAD_MUTEX_INITIALIZER, (op), (suffix), (fill), NULL, 0, 0 \
    }
/* The vtable of cache c extending orig (made and cached on first call,
 * owned by the cache): *out written on success. TS_ERR_NO_MEMORY (prefixed
 * with c->op) when it cannot be made; orig is not checked here. */
ts_status ts__vt_cache_get(ts__vt_cache *c, const ts_module_vtable *orig, const ts_module_vtable **out);

/* The parameter-free layers (ReLU, Tanh, GELU, Dropout): one struct, a
 * vtable each (nn/relu.c, nn/tanh.c, nn/gelu.c, nn/dropout.c). */
typedef struct ts__act {
    ts_module base;
    ts_gelu_approx approx;
    double p;
} ts__act;
ts_status ts__act_new(const ts_module_vtable *vt, ts_gelu_approx approx, double p, ts_module **out);
void ts__act_free(ts_module *m);

/* Grows two parallel arrays of n used entries to cap entries (elements of
 * size_a and size_b bytes): on success *a_out and *b_out are the new
 * arrays with the n entries copied and the old arrays a and b are freed;
 * on failure (TS_ERR_NO_MEMORY) nothing changes and nothing is written. */
ts_status ts__grow_pair(void *a, size_t size_a, void *b, size_t size_b, int n, int cap, void **a_out, void **b_out);

/* Name comparisons made by state-dict lookups since the process started
 * (tests check that a lookup costs O(1) of them). */
uint64_t ts__state_dict_compares(void);

#endif
