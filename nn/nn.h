/*
 * tensorshard nn layer: the module base (a struct whose first member points
 * to a static const vtable), PyTorch-compatible layers, state dicts and
 * safetensors files.
 *
 * Lifetime rules
 * - A module is created by its constructor (ts_linear_new, ...) and freed
 *   with ts_module_free(), which frees its parameters and children.
 *   Containers own the children given to them.
 * - Parameters live in slots (ts_tensor **) that the module owns; an upper
 *   layer (fully_shard) may swap what a slot holds. Code that needs a
 *   parameter reads the slot each time.
 * - Forward outputs are new references the caller releases.
 * - Modules are used by one thread at a time.
 *
 * Calling convention: always call a module through ts_module_call (or
 * ts_module_call_method for a named extra method); containers do the same
 * for their children, so that hooks installed on any module run.
 *
 * Your own module type (examples/custom_module.c is a complete one,
 * docs/custom-modules.md the guide): a struct whose first member is a
 * ts_module and a static const ts_module_vtable with its type name and
 * forward. The constructor makes the struct with ts_module_new and
 * declares each parameter, buffer and child once, by name and slot
 * (ts_module_param_new, ts_module_buffer_new, ts_module_register_*);
 * the base derives the visit, the state-dict names, ts_module_print and
 * the freeing from those declarations. In forward, a ts_scope
 * (tensor/tensor.h) holds the temporaries: TS_SCOPED per op, and
 * ts_scope_return hands the output over; call children through
 * ts_module_call. The older way still works: a vtable with its own visit
 * (its slots in a fixed order: their names become the FQNs) and free
 * (its tensors, children and the struct), a struct the caller allocates
 * and passes to ts_module_init, and forwards that initialise every local
 * tensor to NULL and free each on every path (TS_TRY_GOTO to one cleanup
 * label).
 *
 * Limits (each an error that says so, never a crash): a fully qualified
 * name has at most 511 characters (TS_ERR_INVALID_ARGUMENT); a call takes
 * and returns at most TS_MODULE_MAX_IO tensors. Module types, named
 * methods, children and tree depth are not limited.
 */
#ifndef TS_NN_H
#define TS_NN_H

#include "tensor/tensor.h"
#include "safetensors/safetensors.h" /* ts_safetensors_save and _load below are built on it */

#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Most inputs or outputs a module call takes. */
#define TS_MODULE_MAX_IO 8

typedef struct ts_module ts_module;

/* Forward (or a named extra method): reads n_in inputs, writes *n_out new
 * references into out (capacity TS_MODULE_MAX_IO). */
typedef ts_status (*ts_module_fn)(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out);

/* A visitor over a module's direct parameter slots, buffer slots and
 * direct children, in registration order (PyTorch's _parameters,
 * _buffers, _modules). Any callback may be NULL: a module's visit calls
 * only the ones that are set, and reports each slot through exactly one
 * of them. A non-OK status stops the visit and is returned.
 *
 * Parameters are trainable (they normally require grad); buffers are not
 * (PyTorch's register_buffer: running statistics, counters, fixed masks).
 * Buffers are in state dicts, after their module's parameters, as in
 * PyTorch; they are never in ts_module_parameters (an optimizer never
 * sees them), never counted by ts_module_num_parameters, and never
 * sharded by fully_shard: every rank keeps its own whole copy (FSDP2
 * leaves buffers replicated; a buffer updated from each rank's own data,
 * as BatchNorm's running mean, then differs between ranks, as in
 * PyTorch). Every buffer is persistent (saved and loaded). */
typedef struct ts_module_visitor {
    ts_status (*param)(void *ctx, const char *name, ts_tensor **slot);
    ts_status (*child)(void *ctx, const char *name, ts_module *child);
    void *ctx;
    ts_status (*buffer)(void *ctx, const char *name, ts_tensor **slot);
} ts_module_visitor;

typedef struct ts_module_method {
    const char *name;
    ts_module_fn fn;
} ts_module_method;

typedef struct ts_module_vtable {
    const char *type_name; /* "Linear" */
    ts_module_fn forward;
    /* NULL: the slots declared with ts_module_register_* (none if none
     * were). Call it through ts_module_visit. */
    ts_status (*visit)(ts_module *m, const ts_module_visitor *v);
    /* Frees what the module owns: its parameter tensors, children (via
     * ts_module_free) and the struct itself. The base has released the
     * declared slots (ts_module_register_*) before it runs, and set them
     * to NULL. May be NULL for a module made by ts_module_new: the base
     * then frees the struct. */
    void (*free)(ts_module *m);
    const ts_module_method *methods; /* optional named extra methods */
    int n_methods;
    /* For a vtable made by an upper layer that extends another one
     * (fully_shard's "<Type>FSDPModule"): the one it extends. NULL for a
     * layer's own vtable. */
    const struct ts_module_vtable *base;
    /* Optional, PyTorch's extra_repr: writes a one-line description of the
     * module's settings ("in_features=4, out_features=8") into buf
     * (capacity cap; NUL-terminated, truncated to fit) and returns the
     * length the whole text needs, as snprintf does (negative: nothing).
     * ts_module_print shows it after the type name. NULL: nothing. */
    int (*extra_repr)(const ts_module *m, char *buf, size_t cap);
    /* Optional dispatcher of the named methods, for vtables made by an
     * upper layer (fully_shard wraps methods with it): when set,
     * ts_module_call_method calls call_method(m, i, ...) with i the index
     * of the method in `methods`, instead of methods[i].fn. */
    ts_status (*call_method)(ts_module *m, int index, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out);
    /* Optional, for vtables made by an upper layer: makes module m (whose
     * vtable is this one) extend `inner` instead of its current base, where
     * inner itself extends that base, by switching m to this layer's
     * vtable for inner. ts_checkpoint_module uses it to slide
     * "<Type>Checkpointed" under fully_shard's "<Type>FSDPModule". NULL:
     * the layer cannot be re-based (ts_checkpoint_module then fails). */
    ts_status (*rebase)(ts_module *m, const struct ts_module_vtable *inner);
    /* Optional, PyTorch's reset_parameters: re-initializes the module's OWN
     * parameters and buffers (not its children's: ts_module_reset_parameters
     * recurses), drawing from the default generator, and returns the
     * status of its fills. A type's constructor should call the same
     * function, so that building it and resetting it draw the same
     * numbers. It must write only through ts_init_*, ts_uniform_,
     * ts_normal_, ts_bernoulli_ and ts_tensor_fill_: those record
     * themselves on a meta (deferred) parameter, and materializing
     * replays them (docs/deferred-init.md). NULL: nothing to reset.
     * Extended vtables (fully_shard's, the checkpoint wrapper's) carry the
     * original's slot. */
    ts_status (*reset_parameters)(ts_module *m);
    /* Optional: how many inputs forward takes (1 to TS_MODULE_MAX_IO).
     * ts_module_call then refuses another count with
     * TS_ERR_INVALID_ARGUMENT naming the type and both counts, before
     * forward runs (also through the vtables that extend it), so forward
     * need not check. 0: any count (forward checks, as before). */
    int n_inputs;
} ts_module_vtable;

/* The base every module struct starts with. */
struct ts_module {
    const ts_module_vtable *vtable;
    bool training;  /* train mode (default true, as in PyTorch) */
    void *ext;      /* owned by upper layers (fully_shard state); NULL here */
    int extra_refs; /* owners beyond the first (ts_module_retain); 0 after init */
    /* The slots declared with ts_module_register_* and whether the base
     * allocated the struct (ts_module_new); owned by the base, NULL after
     * ts_module_init until the first declaration. */
    struct ts__module_reg *reg;
};

/* Initialises the base of a module struct the caller allocated (training
 * mode, no upper-layer state), after checking the vtable. A NULL forward
 * is allowed (a container such as ModuleList; calling it is then
 * TS_ERR_UNSUPPORTED), and so is a NULL visit (the slots declared with
 * ts_module_register_*, if any). Errors, TS_ERR_INVALID_ARGUMENT naming what is wrong: NULL m
 * or vt; a vtable without a type name (NULL or "") or without free;
 * n_methods < 0, or > 0 with methods NULL; a method without a name or
 * function, or two methods of one name. On error m->vtable is NULL:
 * calling m then fails with a message, ts_module_free(m) does nothing,
 * and the caller frees the struct itself. */
TS_API ts_status ts_module_init(ts_module *m, const ts_module_vtable *vt);

/* ------------------------------------------------------------ declared slots */

/* Allocates a zeroed module struct of `size` bytes (sizeof your struct,
 * whose first member is the ts_module) and initialises its base with vt,
 * as ts_module_init does, except that vt->free may be NULL: the base then
 * frees the struct itself (after the declared slots) when the last owner
 * calls ts_module_free. *out is the caller's reference, written on
 * success. Errors: ts_module_init's, TS_ERR_INVALID_ARGUMENT for a NULL
 * out or a size smaller than a ts_module, TS_ERR_NO_MEMORY. Any thread. */
TS_API ts_status ts_module_new(size_t size, const ts_module_vtable *vt, ts_module **out);

/* Declares a parameter, a buffer or a child of m by name and slot,
 * once, in m's constructor (PyTorch's register_parameter, register_buffer
 * and add_module). The slot is a field of m's struct (its address must
 * stay valid for m's life); it may still be NULL and be filled after the
 * declaration (declare, then make: a failure then leaks nothing, since
 * ts_module_free(m) releases every declared slot). From the declarations,
 * in their order (parameters, then buffers, then children), the base
 * derives m's visit (so FQNs, named_parameters, state dicts,
 * ts_fully_shard, which swaps what the slots hold, ts_checkpoint_module,
 * deferred init and ts_module_print see the slots as the layers' own) and
 * releases them when m is freed: a tensor slot by ts_tensor_free, a child
 * slot by ts_module_free, each then set to NULL. A slot holds one
 * reference, owned by m. Only for types whose vtable leaves visit NULL.
 *
 * Errors (nothing is declared; the slot is left as it is and what it
 * holds stays the caller's): TS_ERR_INVALID_ARGUMENT for a NULL m, name
 * or slot, a module without vtable, a name that is empty, contains '.'
 * or has more than 255 characters, a name m already declared (of any
 * kind), a slot already declared, or a type with its own visit;
 * TS_ERR_STATE when m was rewritten by an upper layer (ts_fully_shard,
 * ts_checkpoint_module: declare everything before); TS_ERR_SHARDED when
 * the slot or a parameter m declared before holds a shard (an enclosing
 * module was sharded); TS_ERR_NO_MEMORY. The caller's thread, as the
 * module's. */
TS_API ts_status ts_module_register_param(ts_module *m, const char *name, ts_tensor **slot);
TS_API ts_status ts_module_register_buffer(ts_module *m, const char *name, ts_tensor **slot);
TS_API ts_status ts_module_register_child(ts_module *m, const char *name, ts_module **slot);

/* Declares a parameter (ts_module_register_param) and fills its slot with
 * a new zero-filled one of dtype and shape (ts_param_new: meta inside a
 * meta device scope, deferred init records the zeros). Errors as the two,
 * with nothing declared and *slot unchanged. */
TS_API ts_status ts_module_param_new(ts_module *m, const char *name, ts_dtype dtype, int ndim, const int64_t *shape,
                                     ts_tensor **slot);
/* The same for a buffer: a new zero-filled tensor of any dtype that does
 * not require grad (meta in a meta scope, its zeros recorded). */
TS_API ts_status ts_module_buffer_new(ts_module *m, const char *name, ts_dtype dtype, int ndim, const int64_t *shape,
                                      ts_tensor **slot);

/* In a constructor, after ts_module_new: evaluates expr (a ts_status); on
 * error frees m (ts_module_free: every slot declared so far, then the
 * struct) and returns the status, so that a constructor has no cleanup
 * of its own:
 *
 *     ts_module *m;
 *     TS_TRY(ts_module_new(sizeof(block), &block_vt, &m));
 *     block *b = (block *)m;
 *     TS_MODULE_TRY(m, ts_module_register_child(m, "fc", &b->fc));
 *     TS_MODULE_TRY(m, ts_linear_new(dim, dim, true, &b->fc));
 *     TS_MODULE_TRY(m, ts_module_param_new(m, "gain", TS_F32, 1, &dim, &b->gain));
 *     *out = m;
 *     return TS_OK;
 */
#define TS_MODULE_TRY(m, expr) \
    do { \
        ts_status ts_module_try_st_ = (expr); \
        if (ts_module_try_st_ != TS_OK) { \
            ts_module_free(m); \
            return ts_module_try_st_; \
        } \
    } while (0)

/* Visits m's own slots and children: through the vtable's visit when it
 * has one, else the declared slots (nothing when there are none). The
 * visitor's rules are ts_module_visitor's. TS_ERR_INVALID_ARGUMENT for a
 * NULL m or v or a module without vtable; a callback's status. */
TS_API ts_status ts_module_visit(ts_module *m, const ts_module_visitor *v);

/* Calls the module's forward (through its current vtable, so that hooks
 * run). TS_ERR_INVALID_ARGUMENT for NULL or too many inputs; errors of the
 * module's forward otherwise. */
TS_API ts_status ts_module_call(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out);
/* One input, one output. TS_ERR_INVALID_ARGUMENT if the module returns
 * more than one output. */
TS_API ts_status ts_module_call1(ts_module *m, ts_tensor *in, ts_tensor **out);
/* Calls a named extra method. TS_ERR_NOT_FOUND names the type and method. */
TS_API ts_status ts_module_call_method(ts_module *m, const char *name, int n_in, ts_tensor *const *in, int *n_out,
                                       ts_tensor **out);
/* Type name ("Linear", or "LinearFSDPModule" once rewritten); "(null)" for
 * NULL, "(no vtable)" or "(unnamed type)" for a module that has none. */
TS_API const char *ts_module_type_name(const ts_module *m);
/* Drops one owner's reference: frees the module (its parameters and
 * children) when it was the last one. NULL is accepted. */
TS_API void ts_module_free(ts_module *m);
/* Adds an owner: a module that two parents hold (a block shared by two
 * containers, as a PyTorch module may be the child of several) is
 * retained once per extra parent, so that each parent's free drops one
 * reference and the last one frees it. A container given the same child
 * in several slots (Sequential(l, l)) retains it itself. Returns m (NULL
 * for NULL). Not thread-safe against a concurrent free of m. */
TS_API ts_module *ts_module_retain(ts_module *m);

/* Sets training mode on the module and every descendant. */
TS_API void ts_module_train(ts_module *m, bool training);
TS_API void ts_module_eval(ts_module *m);

/* One named parameter: the fully qualified name ("layers.1.weight", owned
 * by the list) and the slot. */
typedef struct ts_named_param {
    char *name;
    ts_tensor **slot;
    ts_module *owner; /* the module whose slot it is */
    bool is_buffer;   /* a buffer (ts_module_named_buffers), not a parameter */
} ts_named_param;

typedef struct ts_named_params {
    ts_named_param *items;
    int n;
} ts_named_params;

/* Every parameter of the module tree in PyTorch's named_parameters()
 * order, each tensor once (a tied parameter appears under its first name).
 * Empty slots (a NULL tensor, such as an absent bias) are skipped. Free the
 * list with ts_named_params_free. */
TS_API ts_status ts_module_named_parameters(ts_module *m, ts_named_params *out);
TS_API void ts_named_params_free(ts_named_params *p);
/* Every buffer of the module tree in PyTorch's named_buffers() order (each
 * module's own, pre-order), each tensor once, empty slots skipped; the
 * entries have is_buffer set. Free with ts_named_params_free. */
TS_API ts_status ts_module_named_buffers(ts_module *m, ts_named_params *out);
/* Every parameter and buffer of the module tree under every name, in
 * state-dict order (per module: its parameters, then its buffers, then its
 * children; a tied tensor under each of its names), empty slots skipped.
 * Each entry points to the module's slot itself (borrowed; the list owns
 * its names); buffers have is_buffer set. Free with ts_named_params_free.
 * TS_ERR_INVALID_ARGUMENT for NULL; TS_ERR_NO_MEMORY. */
TS_API ts_status ts_module_named_tensors(ts_module *m, ts_named_params *out);

/* A list of tensors, each a reference owned by the list. */
typedef struct ts_param_list {
    ts_tensor **items;
    int n;
} ts_param_list;

/* The list an optimizer takes, as PyTorch's model.parameters(): every
 * parameter of the tree that requires grad, each tensor once (a tied
 * weight once), in named_parameters order. Frozen parameters
 * (requires_grad false) are left out, since the optimizers refuse them;
 * buffers are never in it. Ownership: each item is a new reference held by
 * the list; release the list with ts_param_list_free. An optimizer takes
 * its own references, so the list can be freed right after:
 *
 *     ts_param_list p;
 *     TS_TRY(ts_module_parameters(model, &p));
 *     ts_status st = ts_adamw_new(p.n, p.items, &opts, &opt);
 *     ts_param_list_free(&p);
 *
 * Call it after ts_fully_shard (the items are then the shards; the
 * tensors fully_shard replaced are no longer the module's, and an
 * optimizer over them fails at its step) and outside a forward, backward
 * or summon (when the slots hold gathered full tensors). An empty tree
 * gives n = 0 and items NULL. TS_ERR_INVALID_ARGUMENT for NULL arguments;
 * TS_ERR_NO_MEMORY. */
TS_API ts_status ts_module_parameters(ts_module *m, ts_param_list *out);
/* Releases the references and the array; sets n = 0 (NULL accepted). */
TS_API void ts_param_list_free(ts_param_list *l);

/* A new parameter for a module you write: a zero-filled leaf of dtype
 * (f32 or f64 for an optimizer) and shape that requires grad (PyTorch's
 * nn.Parameter(torch.zeros(shape))). Fill it with the init functions
 * (ts_uniform_, ts_init_kaiming_uniform_, ...; they are not recorded by
 * autograd). The caller owns the reference (normally the module's slot,
 * released by its free). TS_ERR_INVALID_ARGUMENT (NULL out, bad shape),
 * TS_ERR_DTYPE (not a floating-point dtype: only those can require grad),
 * TS_ERR_NO_MEMORY. */
TS_API ts_status ts_param_new(ts_dtype dtype, int ndim, const int64_t *shape, ts_tensor **out);

/* The tensor the parameter slot `fqn` ("blocks.1.fc.weight") holds now,
 * borrowed (after fully_shard: this rank's shard), as PyTorch's
 * get_parameter. TS_ERR_NOT_FOUND names the module and the missing name
 * (a buffer is not a parameter); TS_ERR_INVALID_ARGUMENT for NULL. */
TS_API ts_status ts_module_get_parameter(ts_module *m, const char *fqn, ts_tensor **out);
/* The same for a buffer ("blocks.1.num_batches_tracked"). */
TS_API ts_status ts_module_get_buffer(ts_module *m, const char *fqn, ts_tensor **out);

/* Visits every module of the tree (the root with name "") in PyTorch's
 * named_modules() order (pre-order), each once. */
typedef ts_status (*ts_module_each_fn)(void *ctx, const char *fqn, ts_module *m);
TS_API ts_status ts_module_named_modules(ts_module *m, ts_module_each_fn fn, void *ctx);

/* Re-initializes m's parameters and buffers through its vtable's
 * reset_parameters slot (NULL: nothing to do), and with recurse those of
 * every submodule, each module once, children before their parent: the
 * modules of ts_module_named_modules in post-order (a parent's children
 * in visit order, each child's subtree before the next child, then the
 * parent). That is the order nn's constructors draw in (a module builds
 * its children, then initializes its own parameters: MultiheadAttention
 * builds out_proj, then draws in_proj_weight and zeroes out_proj.bias),
 * so resetting a freshly seeded tree without tied weights reproduces
 * building it. Tied weights are reset by each owner in turn (the last
 * wins, as in PyTorch); TransformerEncoder's layers, copies of one
 * another when built, are reset independently (as PyTorch's are).
 * Stops at the first error: TS_ERR_INVALID_ARGUMENT for a NULL m or a
 * module without vtable; a slot's error (TS_ERR_SHARDED on a sharded
 * module: materialize it instead). Caller's thread; not during a
 * forward or backward. */
TS_API ts_status ts_module_reset_parameters(ts_module *m, bool recurse);

/* The module at fully qualified name `fqn` ("blocks.1", "" for m itself),
 * borrowed, as PyTorch's get_submodule. TS_ERR_NOT_FOUND names it;
 * TS_ERR_INVALID_ARGUMENT for NULL arguments. */
TS_API ts_status ts_module_get_submodule(ts_module *m, const char *fqn, ts_module **out);

/* Zeroes (set_to_none=false) or drops (true) every parameter's .grad. */
TS_API void ts_module_zero_grad(ts_module *m, bool set_to_none);
/* Number of parameter elements (each tensor once). */
TS_API int64_t ts_module_num_parameters(ts_module *m);

/* Converts every floating parameter and buffer of the tree to `dtype`, as
 * PyTorch's model.to(dtype): each slot then holds a new leaf with the
 * converted values, the same name and requires_grad, and its .grad
 * converted too; a tensor in several slots (tied weights) stays one
 * tensor; integer and bool buffers are kept. Slots already in `dtype` are
 * left alone. Call it before building an optimizer (one built earlier
 * holds the old tensors) and before ts_fully_shard. Layers then compute in
 * `dtype` and take inputs of that dtype. Errors (nothing is changed):
 * TS_ERR_INVALID_ARGUMENT for NULL m or an invalid dtype; TS_ERR_DTYPE for
 * a non-floating dtype (PyTorch's Module.to refuses them too);
 * TS_ERR_SHARDED if a slot holds a shard (after ts_fully_shard);
 * TS_ERR_RELEASED for a released tensor; TS_ERR_NO_MEMORY. On a deferred
 * (meta) model each parameter becomes a meta tensor of `dtype` that takes
 * over the initializers recorded on the old one (docs/deferred-init.md):
 * materializing replays them into `dtype`, bitwise the conversion of the
 * eager values; TS_ERR_UNSUPPORTED for a meta view of a larger storage. */
TS_API ts_status ts_module_to_dtype(ts_module *m, ts_dtype dtype);

/* The module tree as PyTorch's repr prints it, with each module's own
 * parameter and buffer shapes (non-float32 dtypes named; "[shard]" marks
 * a slot that holds this rank's shard) and, for an FSDP module, its group
 * (through the FSDP vtable's extra_repr):
 *
 *   Sequential(
 *     (0): Linear(in_features=4, out_features=16, bias=True)  weight (16, 4), bias (16,)
 *     (1): ResidualBlockFSDPModule(
 *       dim=16; FSDP: 3 params, 288 elements, 144 per rank + 0 padding in all, mesh (dp=2), ...
 *       gain (8,) [shard], buffer num_batches_tracked int64 ()
 *       (fc): Linear(in_features=16, out_features=16, bias=True)  weight (8, 16) [shard], bias (8,) [shard]
 *     )
 *   )
 *
 * A leaf is one line: "(name): Type(extra_repr)" and its slots; a module
 * with children has its extra_repr, then its own slots, then its children
 * inside the parentheses. A module reachable twice (shared) is printed in
 * full the first time and as "(name): Type (shared with 'fqn')"
 * afterwards. ts_module_print writes to `f` (TS_ERR_IO when writing
 * fails). ts_module_repr writes into buf (capacity cap, NUL-terminated,
 * truncated to fit; buf may be NULL when cap is 0) and sets *len_out to
 * the length of the whole text, so that a caller can allocate
 * *len_out + 1 and call again. Both: TS_ERR_INVALID_ARGUMENT for NULL
 * arguments, TS_ERR_NO_MEMORY. */
TS_API ts_status ts_module_print(ts_module *m, FILE *f);
TS_API ts_status ts_module_repr(ts_module *m, char *buf, size_t cap, size_t *len_out);

/* ------------------------------------------------------------ activation checkpointing */

/* Activation checkpointing of a module, in place (PyTorch's non-reentrant
 * torch.utils.checkpoint applied to it, as checkpoint_wrapper or the
 * composable checkpoint(module) do). When the module is called with grad
 * enabled, its forward runs without recording a graph and keeps only its
 * inputs (references to them) and the default generator's state; its
 * floating outputs carry one autograd node. That node's backward (a) sets
 * the default generator to the state it had at the forward (dropout draws
 * the same masks) and puts the current state back afterwards, (b) runs the
 * forward again with grad enabled on detached inputs that require grad as
 * the originals did, and (c) runs the backward of that recomputed graph
 * with the outputs' gradients, inside the backward now running:
 * parameters' .grad accumulate as without checkpointing and the inputs'
 * gradients flow on. Gradients are bitwise those without checkpointing.
 * The node releases the inputs it holds (and its reference to the module)
 * as soon as its backward has run, unless that ts_backward had
 * retain_graph: a second backward through it is then TS_ERR_AUTOGRAD, as
 * through any released node. With grad disabled, or when neither the inputs nor the parameters
 * require grad, the call is the plain forward.
 *
 * The module's vtable becomes "<Type>Checkpointed" (extending its own;
 * same address, parameter names and FQNs: no "_checkpoint_wrapped_module."
 * prefix as PyTorch's checkpoint_wrapper adds). It composes with
 * fully_shard in either order, with the same result: checkpoint then
 * ts_fully_shard gives "<Type>CheckpointedFSDPModule"; ts_fully_shard then
 * checkpoint re-bases the FSDP vtable onto the Checkpointed one (through
 * its rebase slot), which gives the same. fully_shard's hooks thus run
 * outside the checkpoint: the pre-backward all-gather happens before the
 * recompute, and the post-backward reduce-scatter after its backward.
 * Named extra methods are not checkpointed. Modules inside the
 * checkpointed one are called again in the recompute (their hooks run
 * twice). Nested checkpointed modules work (each recompute recomputes
 * the inner one again in its backward).
 *
 * Errors (the module unchanged): TS_ERR_INVALID_ARGUMENT for NULL or a
 * module without vtable; TS_ERR_ALREADY when it is checkpointed already;
 * TS_ERR_UNSUPPORTED for a module without forward (ModuleList: checkpoint
 * its modules), or rewritten by an upper layer that cannot be re-based
 * (no rebase slot, or two layers deep). A failure in the recompute or its
 * backward fails the ts_backward running, naming the module; the module
 * stays usable. Same thread rules as the module. */
TS_API ts_status ts_checkpoint_module(ts_module *m);
/* True when ts_checkpoint_module was applied to m (false for NULL). */
TS_API bool ts_module_is_checkpointed(const ts_module *m);

/* ------------------------------------------------------------ state dicts */

/* An ordered name -> tensor map. Tensors are references owned by the dict. */
typedef struct ts_state_dict ts_state_dict;

TS_API ts_status ts_state_dict_new(ts_state_dict **out);
TS_API void ts_state_dict_free(ts_state_dict *sd);
/* Adds or replaces `name` (copied); the dict takes a new reference. */
TS_API ts_status ts_state_dict_set(ts_state_dict *sd, const char *name, ts_tensor *t);
/* Borrowed tensor for `name`, or NULL. */
TS_API ts_tensor *ts_state_dict_get(const ts_state_dict *sd, const char *name);
TS_API int ts_state_dict_size(const ts_state_dict *sd);
/* Entry i in insertion order (borrowed name and tensor). */
TS_API const char *ts_state_dict_name(const ts_state_dict *sd, int i);
TS_API ts_tensor *ts_state_dict_tensor(const ts_state_dict *sd, int i);

/* Every parameter and buffer under every name (tied ones under each name,
 * as PyTorch's state_dict; per module its parameters, then its buffers,
 * then its children) as detached aliases of the slots' tensors (no
 * copies). */
TS_API ts_status ts_module_state_dict(ts_module *m, ts_state_dict **out);

/* Copies the dict's tensors into the module's parameters and buffers.
 * strict: every key must match a parameter or buffer and every parameter
 * and buffer must have a key. Keys are looked up in O(1) (hashed). Errors,
 * in this order: TS_ERR_SHAPE naming each key whose shape differs (both
 * shapes); TS_ERR_DTYPE naming each key whose dtype differs from the
 * tensor's (both dtypes: nothing is converted or reinterpreted; convert
 * with ts_to_dtype first); TS_ERR_NOT_FOUND with the lists of missing and
 * unexpected keys. Nothing is copied when an error is returned. */
TS_API ts_status ts_module_load_state_dict(ts_module *m, const ts_state_dict *sd, bool strict);

/* Writes a state dict as a safetensors file (little-endian u64 header
 * length, JSON header with dtype/shape/data_offsets, raw data), atomically:
 * a temporary file ".<name>.tmp.<pid>.<16 random hex digits>" in the same
 * folder, created with O_CREAT | O_EXCL | O_NOFOLLOW and mode 0600 while it
 * is written, then given mode 0644 less the process's umask (never more
 * than 0644: 0644 under umask 022 or 0, 0600 under 077), fsync'ed, renamed over `path`, and the folder fsync'ed. The temporary
 * file is removed on every failure. Temporary files of `path` left in that
 * folder by savers whose pid no longer runs are removed first (only names
 * of that exact pattern; pids are read in this process's pid namespace,
 * so a saver in another container that shares the folder may lose its
 * temporary file and fail with TS_ERR_IO, never a checkpoint). `metadata` (may be NULL) is a list of n_meta
 * key/value string pairs for "__metadata__". TS_ERR_IO names the path and
 * the system error; TS_ERR_STATE naming the key for a meta tensor (no data:
 * materialize first), with no file left. */
TS_API ts_status ts_safetensors_save(const char *path, const ts_state_dict *sd, const char *const *metadata,
                                     int n_meta);
/* Reads a safetensors file into a new state dict. A missing file is
 * TS_ERR_IO; a truncated, oversized or malformed file is TS_ERR_FORMAT
 * naming what is wrong. Never crashes on bad input. Floating-point tensors
 * holding NaN or Inf load as they are (as torch.load and
 * safetensors.torch.load_file do), with one warning per such tensor that
 * names the key and the count ("... tensor 'w' holds 3 non-finite values
 * (NaN or Inf) of 12"). The tensors are CPU tensors, also when called
 * inside a meta device scope. */
TS_API ts_status ts_safetensors_load(const char *path, ts_state_dict **out);
/* The same, from a buffer (what the fuzz target drives). */
TS_API ts_status ts_safetensors_parse(const void *data, size_t len, ts_state_dict **out);

/* ------------------------------------------------------------ layers */

/* torch.nn.Linear(in, out, bias): weight (out, in), bias (out,). */
typedef struct ts_nn_linear {
    ts_module base;
    ts_tensor *weight, *bias; /* bias NULL without bias */
    int64_t in_features, out_features;
} ts_nn_linear;
TS_API ts_status ts_linear_new(int64_t in_features, int64_t out_features, bool bias, ts_module **out);

/* Activations and dropout (no parameters). */
TS_API ts_status ts_relu_new(ts_module **out);
TS_API ts_status ts_tanh_new(ts_module **out);
TS_API ts_status ts_gelu_new(ts_gelu_approx approx, ts_module **out);
TS_API ts_status ts_dropout_new(double p, ts_module **out);

/* Sequential and ModuleList: children named "0", "1", ... */
TS_API ts_status ts_sequential_new(int n, ts_module *const *children, ts_module **out);
TS_API ts_status ts_module_list_new(int n, ts_module *const *children, ts_module **out);
/* Child i of a Sequential or ModuleList (borrowed), NULL if out of range. */
TS_API ts_module *ts_container_child(ts_module *m, int i);
TS_API int ts_container_size(ts_module *m);

/* torch.nn.Embedding(num, dim): weight (num, dim) ~ N(0, 1). */
typedef struct ts_nn_embedding {
    ts_module base;
    ts_tensor *weight;
    int64_t num_embeddings, embedding_dim;
} ts_nn_embedding;
TS_API ts_status ts_embedding_new(int64_t num_embeddings, int64_t embedding_dim, ts_module **out);

/* torch.nn.LayerNorm(normalized_shape): weight = 1, bias = 0. */
typedef struct ts_nn_layer_norm {
    ts_module base;
    ts_tensor *weight, *bias;
    int64_t dim;
    double eps;
} ts_nn_layer_norm;
TS_API ts_status ts_layer_norm_new(int64_t dim, double eps, bool elementwise_affine, ts_module **out);

/* torch.nn.MultiheadAttention(E, H, dropout, bias, batch_first):
 * in_proj_weight (3E, E), in_proj_bias (3E,), out_proj (Linear E -> E).
 * Forward inputs: query (T, B, E), key and value (S, B, E) -- or (B, T, E)
 * and (B, S, E) with batch_first -- and optionally a bool mask (T, S)
 * where true means "may not attend" (PyTorch's attn_mask rule). Output:
 * (T, B, E), or (B, T, E) with batch_first. Dropout on the attention
 * weights draws over (B*H, T, S) in either layout, as PyTorch. */
typedef struct ts_nn_mha {
    ts_module base;
    ts_tensor *in_proj_weight, *in_proj_bias;
    ts_module *out_proj;
    int64_t embed_dim, num_heads;
    double dropout;
    bool batch_first;
} ts_nn_mha;

/* MultiheadAttention's keyword arguments, PyTorch's defaults from
 * ts_mha_options_default(): dropout 0.0, bias true, batch_first false
 * ((T, B, E) inputs). */
typedef struct ts_mha_options {
    double dropout;   /* on the attention weights in train mode, in [0, 1] */
    bool bias;        /* in_proj_bias and out_proj.bias */
    bool batch_first; /* (B, T, E) inputs and output instead of (T, B, E) */
} ts_mha_options;
TS_API ts_mha_options ts_mha_options_default(void);
/* A MultiheadAttention(embed_dim, num_heads, **o); NULL o: the defaults.
 * TS_ERR_INVALID_ARGUMENT names embed_dim, num_heads and dropout when
 * embed_dim is not a positive multiple of num_heads or dropout is outside
 * [0, 1], and names embed_dim when 3 * embed_dim overflows int64;
 * TS_ERR_NO_MEMORY. The caller owns *out (ts_module_free). */
TS_API ts_status ts_mha_new_opts(int64_t embed_dim, int64_t num_heads, const ts_mha_options *o, ts_module **out);
/* ts_mha_new_opts with batch_first false (PyTorch's default: (T, B, E)). */
TS_API ts_status ts_mha_new(int64_t embed_dim, int64_t num_heads, double dropout, bool bias, ts_module **out);

typedef struct ts_encoder_layer_config {
    int64_t d_model, nhead, dim_feedforward;
    double dropout;        /* default 0.1 */
    bool gelu;             /* activation: false relu (default), true gelu */
    double layer_norm_eps; /* default 1e-5 */
    bool norm_first;       /* default false */
    bool causal;           /* apply a causal mask in self-attention */
    bool batch_first;      /* default false: src (T, B, d) as PyTorch; true: (B, T, d) */
} ts_encoder_layer_config;
/* PyTorch's defaults: dim_feedforward 2048, dropout 0.1, relu, eps 1e-5,
 * post-norm, batch_first false. */
TS_API ts_encoder_layer_config ts_encoder_layer_config_default(int64_t d_model, int64_t nhead);

/* torch.nn.TransformerEncoderLayer: self_attn, linear1, dropout, linear2,
 * norm1, norm2, dropout1, dropout2. Input and output (T, B, d), or
 * (B, T, d) with cfg.batch_first; each dropout draws its mask over the
 * tensor in that layout, as PyTorch. TS_ERR_INVALID_ARGUMENT for a NULL
 * or invalid config. */
TS_API ts_status ts_encoder_layer_new(const ts_encoder_layer_config *cfg, ts_module **out);
/* torch.nn.TransformerEncoder(layer, num_layers): "layers" holds
 * num_layers copies of one freshly made layer (deep copies, as PyTorch). */
TS_API ts_status ts_transformer_encoder_new(const ts_encoder_layer_config *cfg, int num_layers, ts_module **out);

typedef struct ts_gpt_config {
    int64_t vocab_size, block_size, n_layer, n_head, d_model;
    double dropout;   /* default 0.0 */
    bool tie_weights; /* lm_head.weight is tok_emb.weight (default false) */
    /* the MLP's GELU: TS_GELU_NONE (erf, the default) or TS_GELU_TANH
     * (GPT-2's "gelu_new"; docs/gpt2-weights.md) */
    ts_gelu_approx gelu_approx;
} ts_gpt_config;
TS_API ts_gpt_config ts_gpt_config_default(void);

/* A GPT-style decoder (see tools/reference/models.py for the PyTorch
 * twin): tok_emb, pos_emb, blocks.N (ln1, attn, ln2, mlp.0, mlp.2), ln_f,
 * lm_head. Forward input: int64 token ids (B, T) with T <= block_size;
 * output logits (B, T, vocab). With gelu_approx TS_GELU_TANH and
 * tie_weights it computes Hugging Face's GPT-2 (checkpoint.h,
 * ts_ckpt_load_hf_gpt2). TS_ERR_INVALID_ARGUMENT for an invalid config
 * (naming the sizes, or the gelu_approx value). */
TS_API ts_status ts_gpt_new(const ts_gpt_config *cfg, ts_module **out);
/* The config m was made with, when m is a GPT of ts_gpt_new (sharded or
 * checkpointed too): writes *out and returns true; false for any other
 * module (or NULL). */
TS_API bool ts_gpt_get_config(const ts_module *m, ts_gpt_config *out);

#ifdef __cplusplus
}
#endif
#endif /* TS_NN_H */
