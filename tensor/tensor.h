/*
 * tensorshard tensor layer: dtypes, refcounted storage, tensor handles and
 * views, differentiable ops, the autograd tape, and PyTorch-exact random
 * numbers.
 *
 * Lifetime rules
 * - A ts_tensor is a reference-counted handle. Every function that writes
 *   a tensor to an `_out` parameter gives the caller a new reference, which
 *   the caller releases with ts_tensor_free(). Tensor arguments are
 *   borrowed: a function keeps its own reference if it needs one.
 * - Views share their base's storage; the storage lives while any tensor or
 *   autograd node refers to it.
 * - Output parameters are written only on success.
 * - Tensors are not thread-safe: one thread uses a tensor at a time.
 *   Reference counts are atomic, so handles may be released on any thread.
 *
 * Errors: every fallible function returns ts_status and records a detail
 * for ts_last_error() naming the op and the values that did not fit.
 * Common ones: TS_ERR_SHAPE (shapes do not broadcast or match),
 * TS_ERR_DTYPE (wrong or unsupported dtype), TS_ERR_INDEX (dim out of
 * range), TS_ERR_RELEASED (an input's storage is released),
 * TS_ERR_SHARDED (an input is a shard marked by an upper layer),
 * TS_ERR_STATE (an input is a meta tensor, which has no data, outside a
 * meta scope: "meta device" below), TS_ERR_NO_MEMORY.
 */
#ifndef TS_TENSOR_H
#define TS_TENSOR_H

#include "base/base.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------ dtype */

#define TS_DTYPE_TABLE(X) \
    X(TS_F32, "float32", 4, 1) \
    X(TS_F64, "float64", 8, 1) \
    X(TS_BF16, "bfloat16", 2, 1) \
    X(TS_F16, "float16", 2, 1) \
    X(TS_I64, "int64", 8, 0) \
    X(TS_I32, "int32", 4, 0) \
    X(TS_BOOL, "bool", 1, 0)

typedef enum ts_dtype {
#define TS__DTYPE_ENUM(e, name, size, isf) e,
    TS_DTYPE_TABLE(TS__DTYPE_ENUM)
#undef TS__DTYPE_ENUM
        TS_DTYPE_COUNT
} ts_dtype;

/* Bytes per element; 0 for an invalid dtype. */
TS_API size_t ts_dtype_size(ts_dtype d);
/* PyTorch's name ("float32"); "invalid" for an invalid dtype. Static. */
TS_API const char *ts_dtype_name(ts_dtype d);
/* True for f32, f64, bf16, f16. */
TS_API bool ts_dtype_is_float(ts_dtype d);

/* Conversions that match PyTorch (c10::BFloat16 / c10::Half) for every
 * input: round to nearest even, infinities kept, NaN stays NaN: bf16 NaN is
 * 0x7FC0 as c10::BFloat16 writes it (torch 1.13's vectorised contiguous
 * .to(bfloat16) writes 0xFFFF instead); f32 -> f16 NaN is sign | 0x7E00;
 * f16 -> f32 keeps the payload and sets the quiet bit. */
TS_API uint16_t ts_f32_to_bf16(float f);
TS_API float ts_bf16_to_f32(uint16_t h);
TS_API uint16_t ts_f32_to_f16(float f);
TS_API float ts_f16_to_f32(uint16_t h);

/* ---------------------------------------------------------------- storage */

#define TS_MAX_DIMS 8

/* Where a tensor's elements live. TS_DEVICE_META tensors have a shape, a
 * dtype and strides but no storage bytes (PyTorch's "meta" device): models
 * are built on it to be sharded before any rank holds their weights, and
 * the memory estimate runs a training step on it. */
typedef enum ts_device { TS_DEVICE_CPU = 0, TS_DEVICE_META = 1 } ts_device;

typedef struct ts_storage ts_storage;
typedef struct ts_tensor ts_tensor;
/* A random generator (see "random numbers" below). */
typedef struct ts_generator ts_generator;

/* Bytes the storage holds when filled (also while released). */
TS_API size_t ts_storage_nbytes(const ts_storage *s);
/* True while the storage's bytes are released. */
TS_API bool ts_storage_is_released(const ts_storage *s);
/* Returns the storage's bytes to the caching pool. Every tensor and
 * autograd node that refers to it stays valid; ops that read it fail with
 * TS_ERR_RELEASED until ts_storage_restore(). Releasing a released storage
 * is a no-op. On a meta storage, release and restore give its block back
 * to and take it from its meta ledger. */
TS_API ts_status ts_storage_release(ts_storage *s);
/* Gives a released storage bytes again (same size; contents undefined
 * until written). A no-op on a filled storage. TS_ERR_NO_MEMORY. */
TS_API ts_status ts_storage_restore(ts_storage *s);
/* Raw bytes of a storage; NULL while released, and for a meta storage.
 * Borrowed. */
TS_API void *ts_storage_data(ts_storage *s);

/* Pins the storage's bytes (base.h, "Pinned host memory"): moves them into
 * a page-aligned block locked with mlock and registered once with the
 * transport's memory map; every tensor over the storage stays valid and
 * sees the same values. The block is unlocked, deregistered and freed when
 * the storage is freed; a pinned storage that is released and restored
 * gets a pinned block again. A failing mlock (RLIMIT_MEMLOCK) is a warning,
 * not an error. Pinning a pinned storage is a no-op. TS_ERR_INVALID_ARGUMENT
 * for NULL, TS_ERR_NO_MEMORY. Not while another thread uses the storage. */
TS_API ts_status ts_storage_pin(ts_storage *s);
/* True when the storage's bytes are (or, while released, will be) a pinned block. */
TS_API bool ts_storage_is_pinned(const ts_storage *s);

/* Tensor memory comes from a caching pool that keeps freed blocks for
 * reuse (first touches of fresh pages are slow). This returns every cached
 * block to the system; call it between phases, not inside a step. */
TS_API void ts_pool_empty_cache(void);
/* Bytes the pool holds in free blocks. */
TS_API size_t ts_pool_cached_bytes(void);

/* ------------------------------------------------------------ meta device */
/* docs/meta.md. A meta tensor has a shape, a dtype, strides and a storage
 * of known size without bytes. Models are built on it, and a training step
 * replayed on it gives every op's output shape and dtype and the memory the
 * caching pool would hand out, with no data computed (PyTorch's meta
 * kernels).
 *
 * The default device is per thread, a stack of scopes (PyTorch's
 * `with torch.device("meta")`):
 *     ts_device_scope_enter(TS_DEVICE_META); ... ts_device_scope_exit();
 * While the innermost scope of a thread is TS_DEVICE_META, every tensor the
 * library creates on that thread is a meta tensor: ts_tensor_empty, zeros,
 * ones, full, scalar, arange, from_data (the data is not read), ts_rand,
 * randn, randint, randperm (nothing is drawn: the generator is not
 * advanced), parameters (ts_param_new), every op's outputs and autograd's
 * gradients. Ops then run every check they run on the CPU (the same
 * errors for the same bad shapes and dtypes; checks of data values, such as
 * an embedding index out of range, are skipped), allocate their outputs and
 * the scratch the CPU path takes on the thread's ledger, and compute
 * nothing; in-place ops on meta tensors change nothing. Outside a meta
 * scope, an op, an in-place op, an optimizer step or a data accessor
 * (ts_tensor_get, item, copy_to, the random fills) given a meta tensor
 * fails with TS_ERR_STATE naming the op and the tensor ("'0.weight' (4, 3)
 * is on the meta device (it has no data): materialize the model or load a
 * checkpoint first"); ts_tensor_data and ts_storage_data return NULL for it.
 * Views of a meta tensor are meta tensors. */

/* "cpu", "meta"; "invalid" otherwise. Static. */
TS_API const char *ts_device_name(ts_device d);
/* Makes d the calling thread's default device until the matching
 * ts_device_scope_exit; scopes nest (an inner CPU scope inside a meta one
 * creates CPU tensors again). TS_ERR_INVALID_ARGUMENT for an unknown
 * device, TS_ERR_STATE when TS_DEVICE_SCOPE_MAX_DEPTH scopes are open on
 * the thread. */
#define TS_DEVICE_SCOPE_MAX_DEPTH 64
TS_API ts_status ts_device_scope_enter(ts_device d);
/* Closes the calling thread's innermost scope. TS_ERR_STATE when none is
 * open. */
TS_API ts_status ts_device_scope_exit(void);
/* The calling thread's default device: its innermost scope's, else CPU. */
TS_API ts_device ts_default_device(void);

/* The meta ledger of the calling thread ([Note: meta ledger] in
 * tensor/meta.c): every meta storage created on the thread counts the
 * block the caching pool would hand out for it (its size class) while it
 * holds it, as TS_MEM_STORAGE counts real blocks, and the ledger models
 * the pool's free lists (a freed block is cached; an allocation of its
 * class reuses it, else the pool grows), so that it also predicts
 * TS_MEM_POOL. Pool scratch an op takes (bfloat16 / float16 matrix
 * products) is counted the same way. Real allocations are not counted
 * here. A storage freed on another thread is counted on the ledger of the
 * thread that created it. */
typedef struct ts_meta_stats {
    size_t live;      /* bytes of meta blocks in use (as ts_mem_live_bytes(TS_MEM_STORAGE)) */
    size_t peak;      /* highest `live` since the thread's first meta allocation or ts_meta_reset_peak */
    size_t pool;      /* bytes the modeled pool holds, in use and cached (as TS_MEM_POOL) */
    size_t pool_peak; /* highest `pool` since the first allocation or ts_meta_reset_peak */
    size_t cached;    /* bytes of the modeled free blocks (as ts_pool_cached_bytes()) */
} ts_meta_stats;
/* The calling thread's ledger (all zeros before its first meta tensor). */
TS_API ts_meta_stats ts_meta_get_stats(void);
/* Sets the calling thread's peaks to the current values (as
 * ts_mem_reset_peak). */
TS_API void ts_meta_reset_peak(void);
/* Drops the modeled free blocks of the calling thread's ledger (as
 * ts_pool_empty_cache): `pool` falls by `cached`, and `cached` is 0. */
TS_API void ts_meta_empty_cache(void);
/* ts_meta_empty_cache, then ts_meta_reset_peak: the starting point of a
 * measurement. Meta storages still alive stay counted in `live`. */
TS_API void ts_meta_reset(void);

/* True when s is a meta storage (no bytes). */
TS_API bool ts_storage_is_meta(const ts_storage *s);
/* Gives a meta storage real bytes, zeroed, from the caching pool (a pinned
 * block if it was pinned); it leaves its ledger (`live` and `pool` fall by
 * its block), and every tensor over it is a CPU tensor from then on. A
 * released meta storage becomes a released CPU storage (restore gives it
 * bytes). A no-op on a CPU storage. TS_ERR_INVALID_ARGUMENT for NULL,
 * TS_ERR_NO_MEMORY. Not while another thread uses the storage. */
TS_API ts_status ts_storage_materialize(ts_storage *s);
/* ts_storage_materialize(ts_tensor_storage(t)). */
TS_API ts_status ts_tensor_materialize(ts_tensor *t);

/* --------------------------------------------------------- tensor handles */

/* New uninitialised tensor (contiguous, row-major). shape has `ndim`
 * entries (0..TS_MAX_DIMS), each >= 0. TS_ERR_INVALID_ARGUMENT for a bad
 * ndim, a negative size or an invalid dtype; TS_ERR_NO_MEMORY. */
TS_API ts_status ts_tensor_empty(ts_dtype dtype, int ndim, const int64_t *shape, ts_tensor **out);
/* New tensor filled with zeros / ones / `value` (converted to the dtype).
 * Errors as ts_tensor_empty, and TS_ERR_INVALID_ARGUMENT, naming the value
 * and the dtype, for a value the dtype cannot hold, as torch.full raises
 * "value cannot be converted to type ... without overflow": for int32 and
 * int64 NaN, an infinity, or a value outside the dtype's range (fractions
 * truncate toward zero); for a floating dtype a finite value beyond its
 * largest finite one (1e10 in float16; NaN and infinities are kept). bool
 * takes any value (value != 0). */
TS_API ts_status ts_tensor_zeros(ts_dtype dtype, int ndim, const int64_t *shape, ts_tensor **out);
/* A new contiguous CPU tensor whatever the thread's default device
 * (torch.empty / torch.zeros with device="cpu"), zeroed when zero is true:
 * the buffers a layer reads and writes itself (a collective's agreement
 * scalars, staging copies, a file's tensors), which must have bytes even
 * inside a meta device scope. The caller owns *out. Errors as
 * ts_tensor_empty, and those of ts_device_scope_enter (TS_ERR_STATE when
 * TS_DEVICE_SCOPE_MAX_DEPTH scopes are open). */
TS_API ts_status ts_tensor_new_cpu(bool zero, ts_dtype dtype, int ndim, const int64_t *shape, ts_tensor **out);
TS_API ts_status ts_tensor_ones(ts_dtype dtype, int ndim, const int64_t *shape, ts_tensor **out);
TS_API ts_status ts_tensor_full(ts_dtype dtype, int ndim, const int64_t *shape, double value, ts_tensor **out);
/* New tensor whose elements are copied from `data` (row-major, of the
 * given dtype, numel * ts_dtype_size(dtype) bytes). */
TS_API ts_status ts_tensor_from_data(ts_dtype dtype, int ndim, const int64_t *shape, const void *data, ts_tensor **out);
/* New 0-d tensor holding `value`. Errors as ts_tensor_full. */
TS_API ts_status ts_tensor_scalar(ts_dtype dtype, double value, ts_tensor **out);
/* New 1-d tensor [start, start + step, ...) below `end`.
 * TS_ERR_INVALID_ARGUMENT for an invalid dtype, a zero or non-finite step,
 * a non-finite bound, a step pointing away from `end`, an element count
 * beyond int64, or (int32, int64) an element outside the dtype's range;
 * TS_ERR_NO_MEMORY. */
TS_API ts_status ts_tensor_arange(ts_dtype dtype, double start, double end, double step, ts_tensor **out);

/* PyTorch's t.pin_memory(): a new contiguous tensor with t's values in
 * pinned storage (ts_storage_pin), or a new reference to t itself when its
 * storage is pinned already. No autograd history (a detached copy). The
 * caller owns *out. TS_ERR_INVALID_ARGUMENT for NULL, TS_ERR_RELEASED,
 * TS_ERR_NO_MEMORY. */
TS_API ts_status ts_tensor_pin_memory(const ts_tensor *t, ts_tensor **out);
/* PyTorch's t.is_pinned(): true when t's storage is pinned (false for NULL). */
TS_API bool ts_tensor_is_pinned(const ts_tensor *t);

/* Adds a reference; returns `t`. */
TS_API ts_tensor *ts_tensor_retain(ts_tensor *t);
/* Drops a reference; frees the handle (and the storage, graph node and
 * gradient it holds, if last) when it reaches zero. Accepts NULL. */
TS_API void ts_tensor_free(ts_tensor *t);

/* The accessors below return a neutral value for a NULL tensor:
 * ts_tensor_dtype TS_DTYPE_COUNT (no dtype), ndim, numel and offset 0,
 * size -1, shape, strides, storage, data and dist_meta NULL,
 * is_contiguous and is_shard false, name "", shape_str NULL (also for a
 * NULL buf or a len of 0); set_shard and clear_shard do nothing. */
TS_API ts_dtype ts_tensor_dtype(const ts_tensor *t);
/* TS_DEVICE_META while t's storage is a meta storage, else TS_DEVICE_CPU
 * (NULL: CPU). */
TS_API ts_device ts_tensor_device(const ts_tensor *t);
/* True when t's storage is a meta storage (no bytes): ts_tensor_device(t)
 * == TS_DEVICE_META. false for NULL. */
TS_API bool ts_tensor_is_meta(const ts_tensor *t);
/* Writes shape as PyTorch prints a torch.Size's tuple: "(2, 3)", "(4,)",
 * "()" into buf (len bytes, cut to fit, always NUL-terminated) and returns
 * buf, for messages. NULL (nothing written) for a NULL buf, len 0, ndim
 * outside [0, TS_MAX_DIMS], or a NULL shape with ndim > 0. */
TS_API char *ts_shape_str(int ndim, const int64_t *shape, char *buf, size_t len);
TS_API int ts_tensor_ndim(const ts_tensor *t);
/* Borrowed pointer to `ndim` sizes. */
TS_API const int64_t *ts_tensor_shape(const ts_tensor *t);
/* Size of `dim` (negative counts from the end); -1 if out of range. */
TS_API int64_t ts_tensor_size(const ts_tensor *t, int dim);
/* Borrowed pointer to `ndim` strides, in elements. */
TS_API const int64_t *ts_tensor_strides(const ts_tensor *t);
TS_API int64_t ts_tensor_offset(const ts_tensor *t);
TS_API int64_t ts_tensor_numel(const ts_tensor *t);
TS_API bool ts_tensor_is_contiguous(const ts_tensor *t);
/* The storage (borrowed). */
TS_API ts_storage *ts_tensor_storage(const ts_tensor *t);
/* Address of element 0 (storage data + offset); NULL while the storage is
 * released, and for a meta tensor. Borrowed. */
TS_API void *ts_tensor_data(const ts_tensor *t);
/* Writes "(2, 3)" into buf (always NUL-terminated); returns buf. */
TS_API char *ts_tensor_shape_str(const ts_tensor *t, char *buf, size_t len);

/* Optional name used in error messages ("weight"); copied. */
TS_API ts_status ts_tensor_set_name(ts_tensor *t, const char *name);
/* The name, or "" if none. Borrowed. */
TS_API const char *ts_tensor_name(const ts_tensor *t);

/* Reads the element at `index` (ndim entries) converted to double.
 * TS_ERR_INDEX when an index is out of range. */
TS_API ts_status ts_tensor_get(const ts_tensor *t, const int64_t *index, double *value_out);
/* The value of a one-element tensor, converted to double. */
TS_API ts_status ts_tensor_item(const ts_tensor *t, double *value_out);
/* Copies the elements in row-major order, in the tensor's dtype, into
 * `buf` (numel * dtype size bytes; TS_ERR_INVALID_ARGUMENT if `nbytes`
 * differs). */
TS_API ts_status ts_tensor_copy_to(const ts_tensor *t, void *buf, size_t nbytes);
/* Copies `src` into `dst` in place (broadcasting src to dst's shape,
 * converting dtypes). Not recorded by autograd; refuses a dst that
 * requires grad while grad mode is on, like PyTorch's leaf check. */
TS_API ts_status ts_tensor_copy_(ts_tensor *dst, const ts_tensor *src);
/* Sets every element of `t` to `value` in place (not recorded).
 * TS_ERR_INVALID_ARGUMENT for a value t's dtype cannot hold (as
 * ts_tensor_full); the ts__check_inputs errors (NULL, released, shard). */
TS_API ts_status ts_tensor_fill_(ts_tensor *t, double value);

/* ------------------------------------------------------ distributed marker */

/* Marks `t` as a shard owned by an upper layer (fully_shard). Ordinary ops
 * then refuse it with TS_ERR_SHARDED and a message that names it and says
 * to call the module or take a local view. `meta` is an opaque pointer
 * only the dtensor layer interprets (not owned). */
TS_API void ts_tensor_set_shard(ts_tensor *t, void *meta);
/* Removes the marker. */
TS_API void ts_tensor_clear_shard(ts_tensor *t);
TS_API bool ts_tensor_is_shard(const ts_tensor *t);
/* The opaque distributed pointer (NULL if none). */
TS_API void *ts_tensor_dist_meta(const ts_tensor *t);
/* New handle on the same data, same shape and strides, without the shard
 * marker and without autograd history: what an optimizer or a copy-in
 * uses to work on a shard's local data. */
TS_API ts_status ts_tensor_local_view(ts_tensor *t, ts_tensor **out);

/* ------------------------------------------------------------------ views */
/* Views share storage with the input and are differentiable. */

/* View with a new shape (one entry may be -1). TS_ERR_NOT_VIEWABLE when
 * the strides cannot express it (use ts_reshape), TS_ERR_SHAPE when the
 * element counts differ. */
TS_API ts_status ts_view(ts_tensor *t, int ndim, const int64_t *shape, ts_tensor **out);
/* Like ts_view, but copies when a view is impossible. */
TS_API ts_status ts_reshape(ts_tensor *t, int ndim, const int64_t *shape, ts_tensor **out);
TS_API ts_status ts_transpose(ts_tensor *t, int dim0, int dim1, ts_tensor **out);
/* `dims` is a permutation of 0..ndim-1. */
TS_API ts_status ts_permute(ts_tensor *t, const int *dims, ts_tensor **out);
/* Elements start..start+length-1 of `dim`. */
TS_API ts_status ts_narrow(ts_tensor *t, int dim, int64_t start, int64_t length, ts_tensor **out);
/* Python slicing t[start:end:step] on `dim` (negative start/end count from
 * the end and are clamped; step >= 1). */
TS_API ts_status ts_slice(ts_tensor *t, int dim, int64_t start, int64_t end, int64_t step, ts_tensor **out);
/* Broadcast view to `shape` (-1 keeps a size; new leading dims allowed). */
TS_API ts_status ts_expand(ts_tensor *t, int ndim, const int64_t *shape, ts_tensor **out);
/* Removes `dim` if its size is 1 (otherwise returns an unchanged view). */
TS_API ts_status ts_squeeze(ts_tensor *t, int dim, ts_tensor **out);
TS_API ts_status ts_unsqueeze(ts_tensor *t, int dim, ts_tensor **out);
/* `t` itself (a new reference) when contiguous, else a contiguous copy. */
TS_API ts_status ts_contiguous(ts_tensor *t, ts_tensor **out);
/* Contiguous copy with the same autograd connection (clone). */
TS_API ts_status ts_clone(ts_tensor *t, ts_tensor **out);
/* Same data, no autograd history, requires_grad false. */
TS_API ts_status ts_detach(ts_tensor *t, ts_tensor **out);

/* -------------------------------------------------------------------- ops */
/* Elementwise binary ops broadcast by PyTorch's rules.
 *
 * 16-bit dtypes (bfloat16, float16), PyTorch's CPU semantics: every
 * elementwise op (the arithmetic, scalar and unary ops below, their
 * gradients) loads each element as float32, computes in float32 and rounds
 * the result once to the dtype, so it equals the float32 op on the upcast
 * inputs, rounded. A double scalar `s` is first converted to the tensor's
 * dtype, as PyTorch converts a Python number (a "wrapped number"): bf16
 * `x * 0.1` multiplies by bf16(0.1). Reductions (sum, mean, amax, max)
 * accumulate at least in float32 and round to the dtype; mean is, as in
 * torch 1.13, the rounded sum divided by the element count taken as a
 * scalar of the dtype. Gradients of a 16-bit tensor have its dtype.
 * Differences from torch 1.13 (whose bf16 kernels round some
 * intermediates: gelu(tanh), pow(x, 3), and most backward formulas):
 * within a few ulps, listed in tests/tensor/test_half_ops.c.
 *
 * Type promotion (torch.result_type): operands of different dtypes are
 * converted (differentiably, gradients flow back in each operand's dtype)
 * to a common dtype before the op. Categories bool < integer < floating;
 * within floating, float64 > float32 > {bfloat16, float16}, and bfloat16
 * with float16 gives float32; int32 with int64 gives int64. A 0-d tensor
 * takes part only if it is of a higher category than the tensors with
 * dims: bf16 (n) + f32 () is bf16, bf16 (n) + f32 (n) is f32, int64 (n) +
 * f32 () is f32. Arithmetic needs a floating common dtype: otherwise
 * TS_ERR_DTYPE naming both dtypes and the result. Comparisons accept every
 * dtype. Ops outside this group (cat, where, matmul, ...) require equal
 * dtypes and fail with TS_ERR_DTYPE naming both (torch 1.13 promotes in
 * cat and where; here the cast is the caller's, with ts_to_dtype). */
TS_API ts_status ts_add(ts_tensor *a, ts_tensor *b, ts_tensor **out);
TS_API ts_status ts_sub(ts_tensor *a, ts_tensor *b, ts_tensor **out);
TS_API ts_status ts_mul(ts_tensor *a, ts_tensor *b, ts_tensor **out);
TS_API ts_status ts_div(ts_tensor *a, ts_tensor *b, ts_tensor **out);
/* a + s, a - s, s - a, a * s, a / s. */
TS_API ts_status ts_add_scalar(ts_tensor *a, double s, ts_tensor **out);
TS_API ts_status ts_sub_scalar(ts_tensor *a, double s, ts_tensor **out);
TS_API ts_status ts_rsub_scalar(ts_tensor *a, double s, ts_tensor **out);
TS_API ts_status ts_mul_scalar(ts_tensor *a, double s, ts_tensor **out);
TS_API ts_status ts_div_scalar(ts_tensor *a, double s, ts_tensor **out);
TS_API ts_status ts_pow_scalar(ts_tensor *a, double exponent, ts_tensor **out);

TS_API ts_status ts_neg(ts_tensor *a, ts_tensor **out);
TS_API ts_status ts_exp(ts_tensor *a, ts_tensor **out);
TS_API ts_status ts_log(ts_tensor *a, ts_tensor **out);
TS_API ts_status ts_sqrt(ts_tensor *a, ts_tensor **out);
TS_API ts_status ts_rsqrt(ts_tensor *a, ts_tensor **out);
TS_API ts_status ts_tanh(ts_tensor *a, ts_tensor **out);
TS_API ts_status ts_sigmoid(ts_tensor *a, ts_tensor **out);
TS_API ts_status ts_relu(ts_tensor *a, ts_tensor **out);
/* |a| (torch.abs). Gradient g * sign(a), 0 where a is 0 (or NaN), as
 * torch's abs backward. */
TS_API ts_status ts_abs(ts_tensor *a, ts_tensor **out);

typedef enum ts_gelu_approx { TS_GELU_NONE = 0, TS_GELU_TANH = 1 } ts_gelu_approx;
TS_API ts_status ts_gelu(ts_tensor *a, ts_gelu_approx approx, ts_tensor **out);

/* Reductions over `dims` (ndims entries, negative allowed; ndims == 0
 * reduces over every dim). */
TS_API ts_status ts_sum(ts_tensor *a, int ndims, const int *dims, bool keepdim, ts_tensor **out);
TS_API ts_status ts_mean(ts_tensor *a, int ndims, const int *dims, bool keepdim, ts_tensor **out);
/* Maximum over `dims` (torch.amax: the gradient is shared evenly between
 * tied maxima). */
TS_API ts_status ts_amax(ts_tensor *a, int ndims, const int *dims, bool keepdim, ts_tensor **out);
/* torch.max(a, dim): values and int64 indices of the first maximum;
 * `indices_out` may be NULL. The gradient flows to the index. */
TS_API ts_status ts_max_dim(ts_tensor *a, int dim, bool keepdim, ts_tensor **values_out, ts_tensor **indices_out);

TS_API ts_status ts_softmax(ts_tensor *a, int dim, ts_tensor **out);
TS_API ts_status ts_log_softmax(ts_tensor *a, int dim, ts_tensor **out);
/* Attention weights in one pass: softmax over the last dim of
 * scale * scores, with -inf where the bool mask (T, S) is true (PyTorch's
 * attn_mask rule; broadcast over the leading dims of scores (..., T, S)).
 * A fully masked row gives NaN, as in PyTorch. Differentiable in scores.
 * TS_ERR_SHAPE when the mask does not fit. */
TS_API ts_status ts_scaled_masked_softmax(ts_tensor *scores, ts_tensor *mask, double scale, ts_tensor **out);

/* Multi-head attention core (PyTorch's scaled dot-product attention as
 * MultiheadAttention computes it): q (B, T, E), k and v (B, S, E), any
 * strides with a unit last stride (views of a packed projection work
 * without copies); per head h of num_heads, softmax(q_h k_h^T / sqrt(E/H)
 * with -inf where the bool mask (T, S) is true), dropout on the weights
 * when training (PyTorch's RNG stream over (B*H, T, S)), times v_h; out
 * (B, T, E) with the heads side by side. Differentiable in q, k and v.
 * In float32 it runs a fused kernel (FlashAttention-2 style: no (T, S)
 * score matrix in memory; keeps only the output and a log-sum-exp
 * (B, H, T) for backward, which recomputes the weights, plus with dropout
 * the keep mask in bits, drawn as the unfused path draws its noise (the
 * same weights dropped, the generator left in the same state); within a
 * float32 rounding bound of the unfused path, not bitwise;
 * docs/attention.md), unless a row of the mask is wholly true (NaN rows,
 * as PyTorch) or TS_ATTENTION=reference. The out tensor is a
 * new reference. TS_ERR_SHAPE, TS_ERR_INVALID_ARGUMENT (heads, dropout),
 * TS_ERR_NOT_VIEWABLE (last stride not 1), TS_ERR_NO_MEMORY. */
TS_API ts_status ts_attention(ts_tensor *q, ts_tensor *k, ts_tensor *v, int64_t num_heads, ts_tensor *mask,
                              double dropout_p, bool training, ts_generator *gen, ts_tensor **out);

/* torch.matmul: 1-d/2-d/batched with broadcast batch dims. Transposed
 * operands are passed to BLIS as strides, without copies. */
TS_API ts_status ts_matmul(ts_tensor *a, ts_tensor *b, ts_tensor **out);
/* x (..., in) @ w (out, in)^T + b (out) (b may be NULL): torch's F.linear. */
TS_API ts_status ts_linear(ts_tensor *x, ts_tensor *w, ts_tensor *b, ts_tensor **out);

/* Normalizes over the last `n_norm_dims` dims of x; weight and bias (shape
 * of those dims) may be NULL. */
TS_API ts_status ts_layer_norm(ts_tensor *x, int n_norm_dims, ts_tensor *weight, ts_tensor *bias, double eps,
                               ts_tensor **out);
/* Rows of weight (num, dim) picked by int64 `indices` (any shape):
 * out (*indices.shape, dim). Indices out of range give TS_ERR_INDEX. */
TS_API ts_status ts_embedding(ts_tensor *weight, ts_tensor *indices, ts_tensor **out);

typedef enum ts_reduction { TS_REDUCTION_MEAN = 0, TS_REDUCTION_SUM, TS_REDUCTION_NONE } ts_reduction;
/* logits (N, C), int64 targets (N). Targets equal to ignore_index add
 * nothing and do not count in the mean (PyTorch's rule; a mean over zero
 * targets is NaN, as in PyTorch). */
TS_API ts_status ts_cross_entropy(ts_tensor *logits, ts_tensor *targets, int64_t ignore_index, ts_reduction reduction,
                                  ts_tensor **out);
TS_API ts_status ts_mse_loss(ts_tensor *input, ts_tensor *target, ts_reduction reduction, ts_tensor **out);
/* torch's F.l1_loss: |input - target| averaged (TS_REDUCTION_MEAN),
 * summed (SUM, both 0-d) or kept elementwise (NONE). Same shapes required
 * (TS_ERR_SHAPE names both); differentiable in both (sign of the
 * difference, 0 where it is 0). TS_ERR_INVALID_ARGUMENT for NULL or an
 * unknown reduction. */
TS_API ts_status ts_l1_loss(ts_tensor *input, ts_tensor *target, ts_reduction reduction, ts_tensor **out);

/* Inverted dropout with PyTorch's CPU random stream (bernoulli(1-p) mask
 * scaled by 1/(1-p)). Identity (a new reference) when !training or p == 0.
 * p in [0, 1]. Uses the default generator when `gen` is NULL. */
TS_API ts_status ts_dropout(ts_tensor *a, double p, bool training, ts_generator *gen, ts_tensor **out);

/* Concatenates n tensors along `dim` (same shape elsewhere). */
TS_API ts_status ts_cat(int n, ts_tensor *const *tensors, int dim, ts_tensor **out);
/* Splits into views of `split_size` along `dim` (the last may be
 * shorter). Writes at most `max_out` views into outs and their count into
 * n_out; TS_ERR_INVALID_ARGUMENT if more would be needed. */
TS_API ts_status ts_split(ts_tensor *a, int64_t split_size, int dim, int max_out, ts_tensor **outs, int *n_out);
/* torch.chunk: ceil(size / chunks) per piece; possibly fewer pieces. */
TS_API ts_status ts_chunk(ts_tensor *a, int chunks, int dim, int max_out, ts_tensor **outs, int *n_out);
/* cond (bool) ? a : b, broadcasting all three. */
TS_API ts_status ts_where(ts_tensor *cond, ts_tensor *a, ts_tensor *b, ts_tensor **out);
/* a with `value` where mask (bool, broadcastable to a) is true.
 * TS_ERR_INVALID_ARGUMENT for a value a's dtype cannot hold (as
 * ts_tensor_full, and torch's masked_fill). */
TS_API ts_status ts_masked_fill(ts_tensor *a, ts_tensor *mask, double value, ts_tensor **out);
/* Copy converted to `dtype` (a new reference to `a` if it already has it).
 * Differentiable between floating dtypes: the gradient is converted back
 * to a's dtype (so a bf16 leaf cast to float32 gets a bf16 gradient).
 * Conversions are PyTorch's: to bf16/f16 rounded to nearest even (from
 * float64 through float32, as c10 does), to integers truncated. */
TS_API ts_status ts_to_dtype(ts_tensor *a, ts_dtype dtype, ts_tensor **out);
/* Elementwise a == b / a < b as bool (not differentiable). */
TS_API ts_status ts_eq(ts_tensor *a, ts_tensor *b, ts_tensor **out);
/* a != b, a < b, a <= b, a > b, a >= b as bool (not differentiable),
 * broadcasting, compared in the promoted dtype (as torch.lt & co.); NaN
 * compares unequal to everything. */
TS_API ts_status ts_ne(ts_tensor *a, ts_tensor *b, ts_tensor **out);
TS_API ts_status ts_lt(ts_tensor *a, ts_tensor *b, ts_tensor **out);
TS_API ts_status ts_le(ts_tensor *a, ts_tensor *b, ts_tensor **out);
TS_API ts_status ts_gt(ts_tensor *a, ts_tensor *b, ts_tensor **out);
TS_API ts_status ts_ge(ts_tensor *a, ts_tensor *b, ts_tensor **out);
/* Lower-triangular bool mask (n, n) with ones where col <= row + diagonal. */
TS_API ts_status ts_tril_mask(int64_t n, int64_t diagonal, ts_tensor **out);

/* --------------------------------------------------------------- autograd */

/* Marks a leaf as requiring grad (TS_ERR_AUTOGRAD for a non-leaf or a
 * non-floating tensor). */
TS_API ts_status ts_tensor_set_requires_grad(ts_tensor *t, bool requires_grad);
TS_API bool ts_tensor_requires_grad(const ts_tensor *t);
/* True if `t` was not produced by a recorded op. */
TS_API bool ts_tensor_is_leaf(const ts_tensor *t);
/* The accumulated gradient (borrowed; NULL if none). */
TS_API ts_tensor *ts_tensor_grad(const ts_tensor *t);
/* Replaces the gradient (takes a new reference to `g`; NULL clears). The
 * shape and dtype must match `t` (TS_ERR_SHAPE / TS_ERR_DTYPE). */
TS_API ts_status ts_tensor_set_grad(ts_tensor *t, ts_tensor *g);
/* set_to_none: drops the gradient; otherwise fills it with zeros. */
TS_API void ts_tensor_zero_grad(ts_tensor *t, bool set_to_none);

/* Runs backward from `root`. `grad` may be NULL only when root has one
 * element (it is then 1). Nodes run in reverse creation order; gradients
 * of leaves accumulate into their .grad. Unless retain_graph, the graph's
 * saved tensors are released and a second backward through it returns
 * TS_ERR_AUTOGRAD. */
TS_API ts_status ts_backward(ts_tensor *root, ts_tensor *grad, bool retain_graph);

/* Grad mode (thread-local, on by default). ts_grad_mode_set returns the
 * previous mode so that a scope can restore it:
 *     bool prev = ts_grad_mode_set(false); ...; ts_grad_mode_set(prev); */
TS_API bool ts_grad_mode_set(bool enabled);
TS_API bool ts_grad_mode_enabled(void);

/* Backward callback of a custom function node: `grads` holds one gradient
 * per output (NULL where none flowed). The callback may replace a gradient
 * (release the old reference, store a new one). An error status stops the
 * backward and is returned by ts_backward. */
typedef ts_status (*ts_autograd_backward_fn)(void *ctx, int n, ts_tensor **grads);

/* Custom function node: identity in forward (outputs are views of the
 * inputs), `fn` in backward, which then passes the gradients through. If no
 * input requires grad (or grad mode is off) the outputs are plain aliases
 * and `fn` never runs. `ctx_free` (may be NULL) runs when the node dies.
 * Writes n new references into outs. */
TS_API ts_status ts_autograd_custom(int n, ts_tensor *const *inputs, ts_autograd_backward_fn fn, void *ctx,
                                    void (*ctx_free)(void *ctx), ts_tensor **outs);

/* Queues `fn(ctx)` to run once when the backward now running ends (after
 * every node). TS_ERR_STATE when no backward is running on this thread. */
typedef ts_status (*ts_autograd_callback_fn)(void *ctx);
TS_API ts_status ts_autograd_queue_callback(ts_autograd_callback_fn fn, void *ctx);
/* True while a backward runs on this thread. */
TS_API bool ts_autograd_in_backward(void);

/* ------------------------------------------------- scopes for temporaries */
/* A scope holds the references to a function's temporary tensors and
 * releases them all when it ends, so that a forward reads like the math
 * with one error path (docs/custom-modules.md):
 *
 *     ts_scope s = ts_scope_begin();
 *     ts_tensor *h, *y;
 *     TS_SCOPED(s, h, ts_tanh(x, &h));          // the scope owns h
 *     TS_SCOPED(s, y, ts_mul(h, gain, &y));     // on error: every temporary released, the status returned
 *     return ts_scope_return(s, 1, &y, n_out, out);   // y handed to the caller, h released
 *
 * A scope owns what is added to it (ts_scope_add, or TS_SCOPED after a
 * call that wrote a new reference): each tensor added is one reference,
 * released (ts_tensor_free) when the scope ends, unless ts_scope_keep took
 * it back for the caller first. Nothing else changes: ops called inside
 * a scope return new references as everywhere, and the library's own
 * tensors are never added (only the caller adds). A variable may be
 * rebound (TS_SCOPED(s, x, ts_add(x, y, &x)) in a loop): each value
 * added stays owned until the end.
 *
 * Autograd: releasing a temporary releases its handle only. The graph
 * holds what its backward needs by references of its own (each node holds
 * the nodes it came from, and detached handles of the tensors it saved),
 * so a loss computed through scoped temporaries backpropagates after the
 * scope ended, with gradients bitwise those of the same ops without a
 * scope (tests/tensor/test_scope.c).
 *
 * Scopes are per thread and nest: ts_scope_begin opens a scope inside the
 * thread's innermost open one; ts_scope_end ends the innermost. Ending a
 * scope while scopes opened inside it are still open (a function that
 * returned without ending its own) ends those too, releasing their
 * tensors, and returns TS_ERR_STATE. A scope is used on the thread that
 * began it; using one that has ended (or another thread's) is
 * TS_ERR_STATE. There is no limit on depth or on the tensors a scope
 * holds. */
typedef struct ts_scope {
    int depth;   /* its place on the thread's stack; -1: not opened */
    uint64_t id; /* unique over the process; 0: not opened */
} ts_scope;

/* Opens a scope on the calling thread. Never fails as a call: when the
 * scope cannot be opened (no memory for the thread's stack), the scope
 * returned is not open, and every call given it fails with
 * TS_ERR_NO_MEMORY (TS_SCOPED's first call then returns that status). */
TS_API ts_scope ts_scope_begin(void);
/* Hands the caller's reference to t over to scope s, which releases it
 * when it ends. On error t is released too (so that a failed hand-over
 * leaks nothing): TS_ERR_INVALID_ARGUMENT for a NULL t, TS_ERR_STATE for
 * a scope that has ended, TS_ERR_NO_MEMORY (also for a scope that could
 * not be opened). */
TS_API ts_status ts_scope_add(ts_scope s, ts_tensor *t);
/* Takes t back from scope s for the caller, who then owns one reference
 * to t that s will not release: the one s held when t was added to s
 * (the most recent such, if added twice), else a new one (an input, a
 * parameter, a tensor of another scope: as ts_tensor_retain). Errors (no
 * reference given): TS_ERR_INVALID_ARGUMENT for a NULL t, TS_ERR_STATE
 * for a scope that has ended, TS_ERR_NO_MEMORY for one not opened. */
TS_API ts_status ts_scope_keep(ts_scope s, ts_tensor *t);
/* Ends scope s: releases every tensor it holds (the last added first) and
 * those of the scopes opened inside it that are still open. TS_ERR_STATE
 * (after ending them) when inner scopes were still open, naming how
 * many; TS_ERR_STATE for a scope that has ended or belongs to another
 * thread (nothing done); TS_ERR_NO_MEMORY for one not opened. */
TS_API ts_status ts_scope_end(ts_scope s);
/* The error path: ends s (as ts_scope_end) and returns st, whatever it is
 * and whatever ending reported, so that the caller sees the error that
 * happened and ts_last_error() keeps its detail. */
TS_API ts_status ts_scope_fail(ts_scope s, ts_status st);
/* The success path of a function that returns n tensors: keeps ts[0..n)
 * (ts_scope_keep), ends s, then writes out[i] = ts[i] (the caller's new
 * references) and *n_out = n. On error nothing is written, what it kept
 * is released, and s is ended: TS_ERR_INVALID_ARGUMENT for NULL ts (with
 * n > 0), n_out or out, n < 0, or a NULL tensor in ts; the errors of
 * ts_scope_keep and ts_scope_end. */
TS_API ts_status ts_scope_return(ts_scope s, int n, ts_tensor *const *ts, int *n_out, ts_tensor **out);
/* Scopes open on the calling thread (0 outside any). */
TS_API int ts_scope_depth(void);

/* In a function returning ts_status, with scope s open:
 *
 *   TS_SCOPED(s, var, expr)   evaluates expr (a call that writes a new
 *                             reference to the ts_tensor * variable var on
 *                             success); on success hands var to s; on
 *                             error returns ts_scope_fail(s, status): every
 *                             tensor of s released, the status returned.
 *   TS_SCOPE_TRY(s, expr)     evaluates expr (a ts_status: a call that
 *                             makes no tensor, as ts_backward); on error
 *                             returns ts_scope_fail(s, status).
 *   TS_SCOPE_CHECK(s, cond, status, fmt, ...)
 *                             TS_CHECK for code inside a scope: if cond is
 *                             false, records the detail and returns
 *                             ts_scope_fail(s, status).
 */
#define TS_SCOPED(s, var, expr) \
    do { \
        ts_status ts_scoped_st_ = (expr); \
        if (ts_scoped_st_ == TS_OK) ts_scoped_st_ = ts_scope_add((s), (var)); \
        if (ts_scoped_st_ != TS_OK) return ts_scope_fail((s), ts_scoped_st_); \
    } while (0)
#define TS_SCOPE_TRY(s, expr) \
    do { \
        ts_status ts_scoped_st_ = (expr); \
        if (ts_scoped_st_ != TS_OK) return ts_scope_fail((s), ts_scoped_st_); \
    } while (0)
#define TS_SCOPE_CHECK(s, cond, status, ...) \
    do { \
        if (!(cond)) return ts_scope_fail((s), ts_error((status), __VA_ARGS__)); \
    } while (0)

/* -------------------------------------------------------- random numbers */
/* Bit-exact with PyTorch 1.13's CPU generator (AVX2 kernels, the default on
 * x86-64): ts_manual_seed(s) then the same calls give the same numbers as
 * torch.manual_seed(s). `gen` NULL means the default generator in every
 * function below. The default generator starts from torch's default seed,
 * 67280421310721; ts_generator_free ignores it. */

TS_API void ts_manual_seed(uint64_t seed);
/* The default generator (borrowed): the calling thread's own when
 * ts_generator_set_thread_default gave it one, else the process-wide one. */
TS_API ts_generator *ts_default_generator(void);
/* Makes g (borrowed: it must outlive its use; NULL: back to the
 * process-wide one) the default generator of the calling thread, as a
 * rank simulated by a thread has its own default generator like a rank
 * process; ts_manual_seed and every function given gen NULL then use it.
 * Returns the thread's previous own default (NULL if none). */
TS_API ts_generator *ts_generator_set_thread_default(ts_generator *g);
/* A new generator seeded with `seed`; free with ts_generator_free. */
TS_API ts_status ts_generator_new(uint64_t seed, ts_generator **out);
TS_API void ts_generator_free(ts_generator *g);
TS_API void ts_generator_manual_seed(ts_generator *g, uint64_t seed);
/* Serialised state in torch.get_rng_state()'s 5056-byte layout. */
#define TS_GENERATOR_STATE_BYTES 5056
TS_API void ts_generator_get_state(const ts_generator *g, uint8_t state_out[TS_GENERATOR_STATE_BYTES]);
/* TS_ERR_INVALID_ARGUMENT for a state that is not one get_state could
 * write (left/next outside the state array). */
TS_API ts_status ts_generator_set_state(ts_generator *g, const uint8_t state[TS_GENERATOR_STATE_BYTES]);
/* The next raw 32-bit output (mt19937). */
TS_API uint32_t ts_generator_random(ts_generator *g);

/* New tensors: torch.rand / randn (f32 or f64), randint (int64, low < high),
 * randperm (int64). */
TS_API ts_status ts_rand(ts_dtype dtype, int ndim, const int64_t *shape, ts_generator *gen, ts_tensor **out);
TS_API ts_status ts_randn(ts_dtype dtype, int ndim, const int64_t *shape, ts_generator *gen, ts_tensor **out);
TS_API ts_status ts_randint(int64_t low, int64_t high, int ndim, const int64_t *shape, ts_generator *gen,
                            ts_tensor **out);
TS_API ts_status ts_randperm(int64_t n, ts_generator *gen, ts_tensor **out);
/* In-place fills (not recorded by autograd): Tensor.uniform_, normal_,
 * bernoulli_ (f32/f64). */
TS_API ts_status ts_uniform_(ts_tensor *t, double from, double to, ts_generator *gen);
TS_API ts_status ts_normal_(ts_tensor *t, double mean, double std, ts_generator *gen);
TS_API ts_status ts_bernoulli_(ts_tensor *t, double p, ts_generator *gen);

typedef enum ts_nonlinearity {
    TS_NL_LINEAR = 0,
    TS_NL_SIGMOID,
    TS_NL_TANH,
    TS_NL_RELU,
    TS_NL_LEAKY_RELU,
    TS_NL_SELU
} ts_nonlinearity;
typedef enum ts_fan_mode { TS_FAN_IN = 0, TS_FAN_OUT } ts_fan_mode;
/* torch.nn.init.calculate_gain (param is leaky_relu's negative slope; pass
 * 0.01 for torch's default, sqrt(5) for Linear's init). */
TS_API double ts_init_calculate_gain(ts_nonlinearity nl, double param);
/* torch.nn.init.kaiming_uniform_ / kaiming_normal_ / xavier_uniform_ /
 * xavier_normal_ (tensor of >= 2 dims; TS_ERR_SHAPE otherwise).
 * TS_ERR_INVALID_ARGUMENT for a non-finite slope `a` or gain (which would
 * fill NaN, zeros or infinities), an unknown mode or nonlinearity. */
TS_API ts_status ts_init_kaiming_uniform_(ts_tensor *t, double a, ts_fan_mode mode, ts_nonlinearity nl,
                                          ts_generator *gen);
TS_API ts_status ts_init_kaiming_normal_(ts_tensor *t, double a, ts_fan_mode mode, ts_nonlinearity nl,
                                         ts_generator *gen);
TS_API ts_status ts_init_xavier_uniform_(ts_tensor *t, double gain, ts_generator *gen);
TS_API ts_status ts_init_xavier_normal_(ts_tensor *t, double gain, ts_generator *gen);

/* -------------------------------------------------------------- threading */

/* Number of BLIS threads every matmul uses (process-wide; BLIS's own
 * setting). Default, read once at the first BLIS use: TS_NUM_THREADS if
 * set (1 to 4096; other values are ignored with a warning); else, when the
 * launcher set LOCAL_WORLD_SIZE, max(1, cores / LOCAL_WORLD_SIZE), cores
 * being the CPUs this process may run on; else 1, so that a process
 * started alone (a test, a script) never oversubscribes the machine.
 * ts_set_num_threads(n) overrides it at any time between products (n < 1
 * means 1). Both may be called from any thread. */
TS_API void ts_set_num_threads(int n);
TS_API int ts_get_num_threads(void);
/* The BLIS kernel set in use ("skx", "zen3", "haswell", "generic", ...;
 * a static string). The first call (or the first product) sets BLIS up:
 * unless BLIS_ARCH_TYPE holds a kernel set this CPU runs (a BLIS arch
 * number or name), the library chooses one from cpuid and sets
 * BLIS_ARCH_TYPE before BLIS initialises, because BLIS 0.9 falls back to
 * slow kernels on CPUs it does not know (Zen 5, some Xeons): skx with
 * AVX-512 F/DQ/CD/BW/VL and OS support for the zmm state; with AVX2+FMA
 * zen3 on AMD family >= 0x19, zen2 on family 0x17, else haswell;
 * sandybridge with AVX; penryn with SSSE3; else generic. A value BLIS would
 * abort on or that the CPU cannot execute is replaced, with a warning. The
 * choice is logged at info level (TS_LOG_LEVEL=info). Call this before
 * using BLIS directly anywhere else in the process: BLIS reads the
 * variable only once. */
TS_API const char *ts_blis_arch_name(void);
/* The kernel bfloat16 matrix products use ("avx512bf16" or "sgemm"; a
 * static string; float16 always uses "sgemm"). Every bfloat16 or float16
 * product sums in float32 and rounds each output element once (PyTorch's
 * CPU semantics). "avx512bf16" is a blocked kernel built on vdpbf16ps,
 * chosen on CPUs with AVX512_BF16 (and OS zmm support), AMX CPUs
 * included: no AMX kernel is built; "sgemm" converts blocks of the
 * operands to float32 while packing them and multiplies them with BLIS's
 * sgemm, on every CPU. The environment variable TS_BF16_GEMM_KERNEL
 * (read once, at the first bfloat16 product) forces one: "sgemm" (so that
 * tests cover the fallback on any machine), "avx512bf16" (ignored with a
 * warning where the CPU lacks it), or "auto" (the default). The choice is
 * logged at info level. Any thread may call this. */
TS_API const char *ts_bf16_gemm_kernel_name(void);

#ifdef __cplusplus
}
#endif
#endif /* TS_TENSOR_H */
