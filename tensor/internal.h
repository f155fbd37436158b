/*
 * Internal structures and helpers of the tensor layer. Not installed; the
 * layers above use tensor.h only (fully_shard may use the storage API).
 */
#ifndef TS_TENSOR_INTERNAL_H
#define TS_TENSOR_INTERNAL_H

#include "base/internal.h"
#include "tensor/kernels.h"
#include "tensor/tensor.h"
#include <stdatomic.h>

/* ------------------------------------------------------------- storage */

/* [Note: deferred init] An initializer (ts_uniform_, ts_normal_,
 * ts_bernoulli_, ts_tensor_fill_ and the ts_init_* built on them) given a
 * tensor whose storage is meta checks its arguments as it always does,
 * then records an event on the storage instead of writing or drawing:
 * what it would have done, with which generator, in which dtype, over
 * which elements of the storage. ts__init_replay later draws exactly the
 * numbers the eager fill would have drawn, block by block, and keeps the
 * elements of a range of the storage: a rank materializes its rows of a
 * parameter bitwise equal to building it eagerly and then sharding it.
 * docs/deferred-init.md describes the whole flow. */
typedef enum ts__init_kind {
    TS__INIT_UNIFORM,   /* ts_uniform_: a = from, b = to */
    TS__INIT_NORMAL,    /* ts_normal_: a = mean, b = std */
    TS__INIT_BERNOULLI, /* ts_bernoulli_: a = p */
    TS__INIT_FILL,      /* ts_tensor_fill_: a = the value (no draws) */
    TS__INIT_KIND_COUNT
} ts__init_kind;

typedef struct ts__init_event {
    uint64_t seq; /* process-wide recording order (ts__init_seq_next) */
    ts__init_kind kind;
    double a, b; /* the fill's arguments, as given */
    /* the generator given to the fill; NULL = the thread's default
     * generator at replay time. An explicit generator is not owned: it
     * must outlive the replay (materialization). */
    ts_generator *gen;
    /* the generator the fill would have drawn from when it was recorded
     * (gen, or the recording thread's default generator): which thread's
     * build an orphaned event belongs to (ts__init_orphans_take) */
    const ts_generator *owner;
    ts_dtype dtype; /* the tensor's dtype: the fill computes in it */
    /* the geometry of the tensor the fill was given, in elements of the
     * storage (a view: a slice of a packed weight) */
    int ndim;
    int64_t shape[TS_MAX_DIMS];
    int64_t strides[TS_MAX_DIMS];
    int64_t offset;
    /* 0, or the seq of the event this one repeats: the values of a copy
     * of a tensor that event initialized (TransformerEncoder's
     * deep-copied layers). Replayed from the generator state the source
     * started from, restoring the generator afterwards: it advances
     * nothing, as the copy drew nothing (ts__init_replay_targets only). */
    uint64_t repeat_of;
} ts__init_event;

/* A storage's recorded events, in ascending seq. */
typedef struct ts__init_log {
    ts__init_event *events;
    int n, cap;
} ts__init_log;

struct ts_storage {
    atomic_int refcount;
    size_t nbytes;      /* size when filled */
    void *data;         /* NULL while released */
    size_t block_bytes; /* size of the pool block behind data */
    bool released;
    bool pinned;                   /* data is a pinned block (ts__pinned_alloc), not a pool block */
    bool meta;                     /* a meta-device storage: nbytes and no bytes ever (data NULL) until
                      * materialized; block_bytes is what the pool would hand out */
    struct ts_meta_ledger *ledger; /* meta: the ledger that counts block_bytes (retained) */
    ts__init_log init_log;         /* meta only: the initializers recorded on it ([Note: deferred init]) */
};

/* New storage of nbytes from the caching pool (contents undefined). */
ts_status ts__storage_new(size_t nbytes, ts_storage **out);
/* New meta storage of nbytes: no bytes (data NULL), meta true, block_bytes
 * the pool's size class for nbytes. TS_ERR_NO_MEMORY for the handle. */
ts_status ts__storage_new_meta(size_t nbytes, ts_storage **out);
void ts__storage_retain(ts_storage *s);

/* ------------------------------------------------------------- meta device
 * (tensor/meta.c; docs/meta.md) */

/* True when the calling thread's default device is TS_DEVICE_META: ops
 * then allocate their outputs (and the scratch the CPU path would take) as
 * meta storages on the thread's ledger and compute nothing. */
bool ts__meta_mode(void);
/* The ledger (a model of the caching pool, one per thread) of meta
 * storages. ts__meta_ledger_alloc counts a block of the pool's size class
 * for nbytes (a page-rounded pinned block when s->pinned: live, not pool)
 * on the calling thread's ledger (s keeps a reference to it) and sets
 * s->block_bytes; TS_ERR_NO_MEMORY when the thread's ledger cannot be made.
 * ts__meta_ledger_free counts s's block as freed (to the modeled free
 * lists) on the ledger that counted it and sets block_bytes to 0;
 * ts__meta_ledger_forget removes it from the ledger altogether (live and
 * pool: materialization); ts__meta_ledger_detach drops s's reference to
 * its ledger. Any thread. */
ts_status ts__meta_ledger_alloc(ts_storage *s, size_t nbytes);
void ts__meta_ledger_free(ts_storage *s);
void ts__meta_ledger_forget(ts_storage *s);
void ts__meta_ledger_detach(ts_storage *s);
/* Models n pool blocks (of nbytes[i] bytes each) that a kernel takes at
 * once and gives back (ts__pool_alloc scratch) on the calling thread's
 * ledger. */
void ts__meta_scratch(int n, const size_t *nbytes);
/* Adds n cached (free) blocks to the calling thread's ledger, one of the
 * pool class of each nbytes[i]: the modeled pool grows by them and later
 * allocations of their classes reuse them, as blocks a real pool keeps
 * from before (ts_fsdp_memory_estimate's eager start-up). */
void ts__meta_cache_blocks(int n, const size_t *nbytes);
/* Records and returns the error for meta tensor t read where data is
 * needed: TS_ERR_STATE naming op, the input index (-1: the tensor an
 * accessor reads), t's name and shape, and what to do. */
ts_status ts__meta_error(const char *op, int index, const ts_tensor *t);
void ts__storage_release_ref(ts_storage *s);

/* ------------------------------------------------------------- autograd */

typedef struct ts_node ts_node;

/* An edge from a node's input slot to the producer of that input: either
 * another node's output `index`, or a leaf tensor to accumulate into. */
typedef struct ts_edge {
    ts_node *node;   /* retained; NULL for leaf or no-grad inputs */
    int index;       /* output index in `node` */
    ts_tensor *leaf; /* retained leaf that requires grad, else NULL */
} ts_edge;

/* Backward of one node: `grad_outs[i]` (may be NULL: treat as zero) is the
 * gradient of output i; write the gradient of input j into grad_ins[j]
 * (a new reference), or leave it NULL when needs_input_grad(j) is false or
 * the gradient is zero. */
typedef ts_status (*ts_node_backward_fn)(ts_node *n, ts_tensor **grad_outs, ts_tensor **grad_ins);

#define TS_NODE_MAX_SAVED 7

struct ts_node {
    atomic_int refcount;
    uint64_t seq;     /* creation order; backward runs high to low */
    const char *name; /* op name, static */
    ts_node_backward_fn backward;
    int n_inputs;
    ts_edge *inputs; /* n_inputs entries */
    int n_outputs;
    /* metadata of each output, so a missing gradient can be zero-filled */
    ts_dtype *out_dtype;
    int *out_ndim;
    int64_t (*out_shape)[TS_MAX_DIMS];
    ts_tensor *saved[TS_NODE_MAX_SAVED]; /* detached handles; released after backward */
    double dargs[4];                     /* op arguments */
    int64_t iargs[TS_MAX_DIMS * 2];
    void *ctx; /* custom nodes */
    void (*ctx_free)(void *ctx);
    bool ctx_is_saved; /* ctx holds saved state (a checkpoint's inputs): freed with
                              * the saved tensors when a backward without retain_graph
                              * has run the node, not when the node is freed */
    bool released;     /* saved tensors dropped by a backward */
    /* set during a backward */
    ts_tensor **grad_buf; /* n_outputs accumulating gradients */
    int pending;
};

/* Runs a backward from n roots (NULL roots or grads are skipped) inside
 * the backward now running on this thread (a node's backward that
 * recomputes and differentiates a subgraph: activation checkpointing).
 * Accumulates into leaves' .grad; callbacks it queues run at the end of
 * the outer backward. TS_ERR_STATE outside a backward; TS_ERR_SHAPE or
 * TS_ERR_DTYPE when a gradient does not fit its root; errors of the
 * nodes. Saved tensors of the nodes it runs are released. */
ts_status ts__backward_nested(int n, ts_tensor *const *roots, ts_tensor *const *grads);

/* True when an op with these inputs must record a node (grad mode on and
 * some input requires grad). */
bool ts__needs_grad(int n, ts_tensor *const *inputs);

/* New node for op `name` over n_inputs (edges made from the inputs) with
 * n_outputs outputs. Returns NULL and records TS_ERR_NO_MEMORY on failure. */
ts_node *ts__node_new(const char *name, ts_node_backward_fn backward, int n_inputs, ts_tensor *const *inputs,
                      int n_outputs);
/* Saves a detached alias of `t` in slot i (t may be NULL). */
ts_status ts__node_save(ts_node *n, int i, ts_tensor *t);
/* Makes `out` output `index` of node n (sets grad_fn, requires_grad and
 * the output metadata). */
void ts__node_set_output(ts_node *n, int index, ts_tensor *out);
/* Finishes recording a one-output op: saves s0 and s1 (either may be
 * NULL) in slots 0 and 1, makes `o` output 0, and drops the creator's
 * reference to n. On failure `o` is freed too. */
ts_status ts__record1(ts_node *n, ts_tensor *o, ts_tensor *s0, ts_tensor *s1);
void ts__node_retain(ts_node *n);
void ts__node_free(ts_node *n);
/* True if input j's edge leads to something that wants a gradient. */
bool ts__node_needs_input_grad(const ts_node *n, int j);

/* ------------------------------------------------------------- tensor */

struct ts_tensor {
    atomic_int refcount;
    ts_dtype dtype;
    ts_device device;
    int ndim;
    int64_t shape[TS_MAX_DIMS];
    int64_t strides[TS_MAX_DIMS]; /* in elements */
    int64_t offset;               /* in elements */
    ts_storage *storage;          /* retained */
    bool requires_grad;
    bool is_shard;
    ts_tensor *grad;  /* retained, leaves only */
    ts_node *grad_fn; /* retained, NULL for leaves */
    int output_index; /* which output of grad_fn */
    void *dist;       /* opaque, dtensor layer */
    char *name;       /* for messages, owned */
};

/* Allocates a contiguous tensor handle with fresh storage. */
ts_status ts__tensor_new(ts_dtype dtype, int ndim, const int64_t *shape, ts_tensor **out);
/* Allocates a contiguous meta tensor handle (ts__storage_new_meta). */
ts_status ts__tensor_new_meta(ts_dtype dtype, int ndim, const int64_t *shape, ts_tensor **out);
/* True when t's storage is a meta storage (no bytes). */
static inline bool ts__is_meta(const ts_tensor *t) { return t && t->storage && t->storage->meta; }
/* A new handle aliasing t's storage with the given geometry (no autograd). */
ts_status ts__tensor_alias(const ts_tensor *t, int ndim, const int64_t *shape, const int64_t *strides, int64_t offset,
                           ts_tensor **out);
int64_t ts__numel(int ndim, const int64_t *shape);
bool ts__is_contiguous(const ts_tensor *t);
/* Normalises a possibly negative dim; records TS_ERR_INDEX naming op. */
ts_status ts__wrap_dim(const char *op, int dim, int ndim, int *out);

/* Checks every tensor input of an op: not NULL, storage not released, not
 * a shard. Records an error naming the op and the tensor. */
ts_status ts__check_inputs(const char *op, int n, ts_tensor *const *inputs);
/* float32 or float64 (ops not yet written for the 16-bit dtypes). */
ts_status ts__check_float(const char *op, const ts_tensor *t);
/* Any floating dtype: float32, float64, bfloat16, float16. */
ts_status ts__check_floating(const char *op, const ts_tensor *t);
ts_status ts__check_same_dtype(const char *op, const ts_tensor *a, const ts_tensor *b);
/* torch.result_type(a, b): the dtype PyTorch's type promotion gives two
 * tensor operands (see "Type promotion" in tensor.h). */
ts_dtype ts__result_type(const ts_tensor *a, const ts_tensor *b);
/* torch.promote_types(a, b). */
ts_dtype ts__promote_types(ts_dtype a, ts_dtype b);
/* Broadcast shape of a and b (PyTorch's rule); TS_ERR_SHAPE naming op. */
ts_status ts__broadcast_shape(const char *op, int na, const int64_t *sa, int nb, const int64_t *sb, int *nout,
                              int64_t *sout);

/* dst = src broadcast to dst's shape, converting dtypes (no checks on
 * release/shard; TS_ERR_SHAPE naming op if src does not broadcast). */
ts_status ts__copy_into(const char *op, ts_tensor *dst, const ts_tensor *src);

/* Contiguous copy of t in `dtype`, recorded by autograd as a copy. */
ts_status ts__copy_op(const char *name, ts_tensor *t, ts_dtype dtype, ts_tensor **out);

/* TS_OK when `v` converts to dtype d without overflow, as PyTorch's
 * checked scalar conversion (c10::checked_convert) that torch.full,
 * Tensor.fill_ and masked_fill apply: integer dtypes refuse NaN, infinities
 * and values outside their range (fractions truncate); floating dtypes
 * refuse finite values beyond their largest finite value (NaN and
 * infinities pass); bool takes anything (v != 0). Otherwise
 * TS_ERR_INVALID_ARGUMENT naming op, the value and the dtype. d must be
 * valid. */
ts_status ts__check_scalar(const char *op, ts_dtype d, double v);

/* Element load/store as double for any dtype. */
double ts__load(ts_dtype d, const void *p, int64_t i);
void ts__store(ts_dtype d, void *p, int64_t i, double v);

/* Strided N-d iteration: for tensors with strides (in elements) aligned to
 * an output shape (0 stride for broadcast dims). */
typedef struct ts_iter {
    int ndim;
    int64_t shape[TS_MAX_DIMS];
    int64_t idx[TS_MAX_DIMS];
} ts_iter;

/* Strides of `t` expanded to the output shape (ndim_out >= t->ndim). */
void ts__broadcast_strides(const ts_tensor *t, int ndim_out, const int64_t *shape_out, int64_t *strides_out);

/* Sum-reduces gradient `g` to `shape` (undoing broadcasting). Returns a new
 * reference (g itself retained if shapes already equal). */
ts_status ts__reduce_to_shape(ts_tensor *g, int ndim, const int64_t *shape, ts_tensor **out);
/* dst += src in place (same shape and dtype), not recorded. */
ts_status ts__add_inplace(ts_tensor *dst, const ts_tensor *src);
/* a + b without recording (broadcasting). */
ts_status ts__add_nograd(ts_tensor *a, ts_tensor *b, ts_tensor **out);
/* Sum over dims without recording. */
ts_status ts__sum_nograd(ts_tensor *a, int ndims, const int *dims, bool keepdim, ts_tensor **out);
/* Adds src into *acc (creating it if NULL); used to accumulate grads. */
ts_status ts__accumulate(ts_tensor **acc, ts_tensor *src);

/* ------------------------------------------------------------- kernels */

/* C (m, n) = alpha * A (m, k) B (k, n) + beta * C, general strides (in
 * elements). BLIS path, and the plain reference. */
void ts__gemm_f32(int64_t m, int64_t n, int64_t k, float alpha, const float *a, int64_t rsa, int64_t csa,
                  const float *b, int64_t rsb, int64_t csb, float beta, float *c, int64_t rsc, int64_t csc);
void ts__gemm_f64(int64_t m, int64_t n, int64_t k, double alpha, const double *a, int64_t rsa, int64_t csa,
                  const double *b, int64_t rsb, int64_t csb, double beta, double *c, int64_t rsc, int64_t csc);
void ts__gemm_ref_f32(int64_t m, int64_t n, int64_t k, float alpha, const float *a, int64_t rsa, int64_t csa,
                      const float *b, int64_t rsb, int64_t csb, float beta, float *c, int64_t rsc, int64_t csc);
void ts__gemm_ref_f64(int64_t m, int64_t n, int64_t k, double alpha, const double *a, int64_t rsa, int64_t csa,
                      const double *b, int64_t rsb, int64_t csb, double beta, double *c, int64_t rsc, int64_t csc);
/* Selects BLIS's kernel set from cpuid before BLIS initialises (unless
 * BLIS_ARCH_TYPE is set) and applies the thread count. Idempotent and
 * thread-safe; every BLIS call in the library goes through it first. */
void ts__blis_ensure_init(void);
/* Softmax over rows of a contiguous (rows, n) buffer (in place allowed),
 * and its backward gx = y * (g - sum(g * y)). */
void ts__softmax_rows(ts_dtype dt, const void *x, void *y, int64_t rows, int64_t n);
void ts__softmax_bw_rows(ts_dtype dt, const void *g, const void *y, void *gx, int64_t rows, int64_t n);
/* The ops' matrix product: C = A B + beta C (f32 or f64, strides in
 * elements), reported to ts__gemm_observer and traced as "matmul". */
void ts__gemm(ts_dtype dt, int64_t m, int64_t n, int64_t k, const void *a, int64_t rsa, int64_t csa, const void *b,
              int64_t rsb, int64_t csb, double beta, void *c, int64_t rsc, int64_t csc);
/* The meta device's ts__gemm: models on the ledger the pool scratch the
 * product would take (16-bit dtypes), computes nothing. */
void ts__gemm_meta(ts_dtype dt, int64_t m, int64_t n, int64_t k, double beta, int64_t csc);
/* Benchmark hook: when set, every matrix product the ops make is reported
 * (dtype, sizes, operand strides, beta) before it runs. */
typedef void (*ts_gemm_observer_fn)(ts_dtype dt, int64_t m, int64_t n, int64_t k, int64_t rsa, int64_t csa, int64_t rsb,
                                    int64_t csb, double beta);
extern ts_gemm_observer_fn ts__gemm_observer;
/* C = A B + beta C in bfloat16 or float16 (dt), float32 accumulation and
 * one rounding per element; the kernel chosen from cpuid or
 * TS_BF16_GEMM_KERNEL (tensor/gemm_half.h), the reference when
 * ts__use_reference_kernels is set. */
void ts__gemm_half(ts_dtype dt, int64_t m, int64_t n, int64_t k, const void *a, int64_t rsa, int64_t csa, const void *b,
                   int64_t rsb, int64_t csb, float beta, void *c, int64_t rsc, int64_t csc);
/* Test hook: when true, ops use the reference kernels. */
extern bool ts__use_reference_kernels;

/* ------------------------------------------ deferred init ([Note: deferred init]) */

/* Records an initializer on meta tensor t's storage (the caller has
 * checked its arguments): kind, a, b and gen as ts__init_event holds
 * them, t's dtype and geometry, the next sequence number. Nothing is
 * drawn. A tensor of no elements records nothing. TS_ERR_NO_MEMORY
 * naming op. */
ts_status ts__init_record(const char *op, const ts_tensor *t, ts__init_kind kind, double a, double b,
                          ts_generator *gen);
/* The sequence number the next recorded event gets (events recorded from
 * now on have seq >= it). Thread-safe. */
uint64_t ts__init_seq_next(void);
/* The events recorded on s, in ascending seq, borrowed (valid until s's
 * events change); *n_out their number (0 and NULL for none). */
const ts__init_event *ts__init_events(const ts_storage *s, int *n_out);
/* Appends n events to log, then keeps it in ascending seq (a merge: the
 * events of two storages interleave by seq). TS_ERR_NO_MEMORY: log
 * unchanged. */
ts_status ts__init_log_append(ts__init_log *log, const ts__init_event *events, int n);
/* Moves src's events into dst's (merged by seq); src is left with none.
 * dst == src does nothing. TS_ERR_NO_MEMORY: both unchanged. */
ts_status ts__init_events_move(ts_storage *dst, ts_storage *src);
/* Makes dst's events those of a copy of src's values (a deep copy made
 * while building: TransformerEncoder's layers): dst's own events are
 * dropped (the eager build restored the generator after drawing them) and
 * src's are appended as repeats (repeat_of set, new seq numbers; fills
 * are copied as they are). dst's and src's tensors must have the same
 * geometry. TS_ERR_NO_MEMORY: dst unchanged. */
ts_status ts__init_events_repeat(ts_storage *dst, const ts_storage *src);
/* Frees a log's events (log itself is the caller's; NULL accepted). */
void ts__init_log_fini(ts__init_log *log);
/* Drops s's events (they will not be replayed). */
void ts__init_events_clear(ts_storage *s);
/* Called when storage s is freed: its events that draw (all but fills)
 * are kept in the process's orphan log, since an eager run would have
 * drawn them too (a tied weight's first initializer, a temporary); the
 * rest are freed. */
void ts__init_storage_drop(ts_storage *s);
/* Moves the orphaned events with seq in [seq_begin, seq_end) that the
 * calling thread's build drew (their owner is the calling thread's
 * default generator, or they name an explicit generator) into out
 * (merged by seq); the others stay, so that ranks simulated by threads,
 * each building its own model, take only their own. A materializer takes
 * the span from its model's first event to now and replays them with an
 * empty range (draw and drop). TS_ERR_NO_MEMORY: nothing moved.
 * Thread-safe. */
ts_status ts__init_orphans_take(uint64_t seq_begin, uint64_t seq_end, ts__init_log *out);

/* Replays one event: draws from ev->gen (or the default generator)
 * exactly the numbers the eager fill of ev's geometry draws, in the same
 * order, leaving the generator in the same state (normal_'s tail re-draw
 * and the scalar path's cached second value included), and writes each
 * element whose storage offset o is in [elem_begin, elem_end) to element
 * o - elem_begin of dst, converted from ev->dtype to dst_dtype as
 * ts_module_to_dtype converts (f32 to bf16/f16 round to nearest even).
 * Elements outside the range are drawn and dropped; elem_begin ==
 * elem_end (dst may be NULL) only advances the generator. Works in blocks
 * of TS__INIT_REPLAY_BLOCK elements: peak extra memory one block of
 * ev->dtype values (512 KiB for f64), never a whole parameter.
 * TS_ERR_INVALID_ARGUMENT for NULL ev, a negative or reversed range, NULL
 * dst with a non-empty range, an unknown kind or dtype; TS_ERR_NO_MEMORY
 * for the block, or for a repeat event (replay those through
 * ts__init_replay_targets). The generator is not thread-safe
 * (tensor/rng.c). */
#define TS__INIT_REPLAY_BLOCK 65536
ts_status ts__init_replay(const ts__init_event *ev, int64_t elem_begin, int64_t elem_end, ts_dtype dst_dtype,
                          void *dst);

/* One storage's part of a model replay: its events, the range of its
 * elements kept and where they go (ts__init_replay's arguments). */
typedef struct ts__init_target {
    const ts__init_log *log; /* NULL or empty: nothing */
    int64_t elem_begin, elem_end;
    ts_dtype dst_dtype;
    void *dst; /* elem_end - elem_begin elements of dst_dtype */
} ts__init_target;
/* Replays the events of all targets in ascending seq, interleaved across
 * targets (the order they were recorded in, so the generator advances as
 * the eager construction advanced it). Each storage must appear once (a
 * tied weight is one storage). A repeat event (repeat_of) is replayed from
 * the generator state saved when its source event was replayed (one state,
 * 5056 bytes, per source repeated), and the generator restored after it;
 * TS_ERR_INVALID_ARGUMENT when its source is not among the targets' events.
 * Errors of ts__init_replay; events already replayed stay written. */
ts_status ts__init_replay_targets(int n, const ts__init_target *targets);

/* Generator internals, for dropout. */
/* bernoulli(p) over a contiguous (rows, cols) tensor, packed into bits:
 * draws exactly what ts_bernoulli_(t, p, gen) draws for such a tensor, in
 * the same order (row-major, two mt19937 words per element: U53 < p), and
 * leaves the generator in the same state; element (r, c) is bit c % 32 of
 * bits[r * row_words + c / 32] (1 = the bernoulli draw is 1). row_words
 * >= ceil(cols / 32); the unused bits of a row are 0. gen NULL: the
 * thread's default generator. p must be in [0, 1] (asserted by callers). */
void ts__rng_bernoulli_bits(ts_generator *gen, double p, int64_t rows, int64_t cols, int64_t row_words, uint32_t *bits);
/* The same on kernel path kpath (a ts__kpath, tensor/kernels.h, that the
 * CPU supports); ts__rng_bernoulli_bits takes ts__kpath_active(). Every
 * path gives the same bits and generator state (integer operations only). */
void ts__rng_bernoulli_bits_on(int kpath, ts_generator *gen, double p, int64_t rows, int64_t cols, int64_t row_words,
                               uint32_t *bits);

#endif
