#!/usr/bin/env python3
"""Generates tests/api/test_null_args.c: one Criterion test per public
function (every TS_API declaration of the installed headers given on the
command line) that calls it once for each pointer argument with that
argument NULL and every other argument a valid object of its type.

Checks: a function returning ts_status returns TS_ERR_INVALID_ARGUMENT and
sets ts_last_error(); one returning a pointer returns NULL; one returning a
number or bool returns the neutral value its header documents (NEUTRAL
below, default 0); a void function simply returns. Nothing may crash.

Run by meson at build time (tests/meson.build, custom_target), so functions
added to the headers later are covered without editing anything here. A
pointer type without a factory below gives a failing test that says so.

Usage: gen_null_args_test.py HEADER... OUT.c   (python3, standard library)
"""
import re
import sys

# Functions left out, with the reason.
EXCLUDED = {
    'ts_launch': 'starts rank processes and waits for them',
    'ts_dist_init': 'initialises the process world from the launcher variables (TS_ERR_ALREADY once done); its only '
                    'pointer, the options, may be NULL; the factories call it with NULL',
    'ts_dist_finalize': 'tears down the world the factories share',
    'ts__assert_fail': 'aborts by design (internal)',
}

# (function, argument name) pairs for which the header documents that NULL
# is accepted; those arguments are not passed NULL (a free function taking
# only that argument is still called with NULL, to check it returns).
# '*' matches any function.
ALLOWED_NULL = {
    ('*', 'ctx'): 'user context pointers are passed through, NULL is a valid value',
    ('*', 'options'): 'NULL options mean the defaults',
    ('ts_sgd_new', 'o'): 'NULL options mean the defaults',
    ('ts_adam_new', 'o'): 'NULL options mean the defaults',
    ('ts_adamw_new', 'o'): 'NULL options mean the defaults',
    ('ts_dist_init', 'o'): 'NULL options mean the defaults',
    ('*', 'opts'): 'NULL options mean the defaults',
    ('ts_set_allocator', 'a'): 'NULL restores the default allocator',
    ('ts_set_abort_hook', 'fn'): 'NULL restores the default abort hook',
    ('ts_fsdp_set_event_hook', 'fn'): 'NULL removes the hook',
    ('ts_tensor_free', 't'): 'free functions accept NULL',
    ('ts_module_free', 'm'): 'free functions accept NULL',
    ('ts_state_dict_free', 'sd'): 'free functions accept NULL',
    ('ts_named_params_free', 'p'): 'free functions accept NULL',
    ('ts_optim_free', 'o'): 'free functions accept NULL',
    ('ts_generator_free', 'g'): 'free functions accept NULL',
    ('ts_store_server_stop', 's'): 'free functions accept NULL',
    ('ts_store_close', 's'): 'free functions accept NULL',
    ('ts_comm_free', 'c'): 'free functions accept NULL',
    ('ts_request_free', 'r'): 'free functions accept NULL',
    ('ts_mesh_free', 'm'): 'free functions accept NULL',
    ('ts_dtensor_free', 'd'): 'free functions accept NULL',
    ('ts__free', 'ptr'): 'free functions accept NULL',
    ('ts__free_raw', 'ptr'): 'free functions accept NULL',
    ('ts_storage_free', 's'): 'free functions accept NULL',
    ('ts_grad_scaler_free', 's'): 'free functions accept NULL',
    ('ts_tensor_retain', 't'): 'documented to return NULL for NULL',
    ('ts_backward', 'grad'): 'NULL gradient means ones for a scalar, as loss.backward()',
    ('ts_comm_new_group', 'ranks'): 'NULL ranks with n = 0 ... (see header)',
    ('ts_max_dim', 'indices_out'): 'the indices are optional',
    ('ts_min_dim', 'indices_out'): 'the indices are optional',
    ('ts_cross_entropy', 'weight'): 'optional class weights',
    ('ts_linear', 'bias'): 'optional bias',
    ('ts_layer_norm', 'weight'): 'optional affine weight',
    ('ts_layer_norm', 'bias'): 'optional affine bias',
    ('ts_safetensors_save', 'metadata'): 'optional metadata (with n_meta 0)',
    ('ts_sum', 'dims'): 'NULL dims (with ndims 0) reduce every dimension',
    ('ts_mean', 'dims'): 'NULL dims (with ndims 0) reduce every dimension',
    ('ts_mesh_new', 'names'): 'NULL names mean "dim0", "dim1", ...',
    ('ts_mesh_new', 'device'): 'NULL device means "cpu"',
    ('ts_store_server_start', 'host'): 'NULL host means every interface',
    ('ts_store_server_start', 'token'): 'NULL token means no token',
    ('ts_store_connect', 'token'): 'NULL token means no token',
    ('ts_trace_span', 'cat'): 'NULL category is accepted',
    ('*', 'ctx_free'): 'optional destructor of the context',
    ('ts_error', 'fmt'): 'a NULL format records the status with an empty detail',
    ('*', 'gen'): 'tensor.h: `gen` NULL means the default generator',
    ('ts_generator_random', 'g'): 'tensor.h: a NULL generator means the default one',
    ('ts_generator_manual_seed', 'g'): 'tensor.h: a NULL generator means the default one',
    ('ts_generator_get_state', 'g'): 'tensor.h: a NULL generator means the default one',
    ('ts_generator_set_state', 'g'): 'tensor.h: a NULL generator means the default one',
    ('ts_all_gather_into_tensor', 'r'): 'comm.h: r == NULL blocks (the blocking form)',
    ('ts_reduce_scatter_tensor', 'r'): 'comm.h: r == NULL blocks (the blocking form)',
    ('ts_all_reduce', 'r'): 'comm.h: r == NULL blocks (the blocking form)',
    ('ts_broadcast', 'r'): 'comm.h: r == NULL blocks (the blocking form)',
    ('ts_barrier', 'r'): 'comm.h: r == NULL blocks (the blocking form)',
    ('ts_all_gather', 'r'): 'comm.h: r == NULL blocks (the blocking form)',
    ('ts_all_to_all', 'r'): 'comm.h: r == NULL blocks (the blocking form)',
    ('ts_send', 'r'): 'comm.h: r == NULL blocks (the blocking form)',
    ('ts_recv', 'r'): 'comm.h: r == NULL blocks (the blocking form)',
    ('*', 'mask'): 'tensor.h: the attention mask is optional',
    ('ts_linear', 'b'): 'tensor.h: the bias is optional',
    ('ts_dtensor_from_local', 'global_shape'): 'dtensor.h: NULL global shape is inferred from the local one',
    ('ts_store_add', 'value_out'): 'store.h: value_out may be NULL',
    ('ts_store_delete', 'deleted_out'): 'store.h: deleted_out may be NULL',
    ('ts_store_get', 'len_out'): 'store.h: the outputs may be NULL when the value is not wanted',
    ('ts_store_compare_set', 'value_out'): 'store.h: value_out and len_out may both be NULL',
    ('ts_store_compare_set', 'len_out'): 'store.h: value_out and len_out may both be NULL',
    ('ts_store_connect', 'host'): 'store.h: NULL host is "127.0.0.1"',
    ('ts_tensor_set_grad', 'g'): 'tensor.h: NULL clears the gradient',
    ('ts_tensor_set_name', 'name'): 'tensor.h: NULL clears the name',
    ('ts_tensor_set_shard', 'meta'): 'the marker may carry no metadata',
    ('ts_mesh_new', 'world'): 'mesh.h: NULL world is the default world',
    ('ts_fsdp_unshard_wait', 'handle'): 'fully_shard.h: a NULL handle (synchronous unshard) is accepted',
    ('ts_fsdp_summon_end', 's'): 'fully_shard.h: NULL is accepted, as a free function',
    ('ts_mesh_size', 'name'): 'mesh.h: NULL name is the whole mesh',
    ('ts_mesh_get_local_rank', 'name'): 'mesh.h: NULL name is the only dim of a 1-d mesh',
    ('ts_mesh_group', 'name'): 'mesh.h: NULL name is the only dim of a 1-d mesh',
    ('ts_mesh_dim_index', 'name'): 'mesh.h: NULL name is reported as not found (-1)',
    ('ts_mha_new_opts', 'o'): 'nn.h: NULL o means the defaults',
    ('ts_fsdp_apply_by_type', 'count_out'): 'fully_shard.h: *count_out is optional',
    ('ts_fsdp_apply_by_size', 'count_out'): 'fully_shard.h: *count_out is optional',
    ('ts_grad_scaler_step', 'stepped_out'): 'grad_scaler.h: *stepped_out is optional',
    ('ts_ckpt_save', 'options'): 'checkpoint.h: NULL options are the defaults',
    ('ts_ckpt_load', 'options'): 'checkpoint.h: NULL options are the defaults',
    ('ts_ckpt_load', 'info_out'): 'checkpoint.h: info_out may be NULL',
    ('ts_ckpt_save_full', 'metadata'): 'checkpoint.h: metadata may be NULL when n_metadata is 0',
}

# Documented neutral results of non-status functions given NULL (C
# expressions); pointers must be NULL, other results default to 0.
NEUTRAL = {
    'ts_tensor_dtype': 'TS_DTYPE_COUNT',
    'ts_tensor_size': '-1',
    'ts_mesh_size': '-1',
    'ts_mesh_dim_size': '-1',
    'ts_dtensor_ndim': '-1',
    'ts_dtensor_local_offset': '-1',
    'ts_comm_size': '-1',
    'ts_optim_get_lr': 'NAN',
    'ts_lr_at': 'NAN',
    'ts_module_type_name': '"(null)"',
    'ts_tensor_name': '""',
    'ts_mesh_dim_index': '-1',
    'ts_mesh_get_local_rank': '-1',
    'ts_comm_rank': '-1',
    'ts_store_server_port': '-1',
    'ts_module_num_parameters': '0',
    'ts_state_dict_size': '0',
    'ts_container_size': '0',
    'ts_optim_step_count': '0',
    'ts_trace_total_ns': '0',
    'ts_grad_scaler_get_scale': '1.0',
}

# Value expressions for non-pointer parameters (default: (T){0}, or 1 for
# counts and sizes).
SCALAR_BY_NAME = {
    'n': '1', 'ndim': '1', 'ndims': '1', 'n_in': '1', 'nout': '1', 'k': '1', 'world': '1', 'len': '64',
    'nbytes': '24', 'size': '64', 'cap': '64', 'max_out': '4', 'timeout_s': '1.0', 'num_classes': '3',
    'n_meta': '0', 'dim': '0', 'p': '0.5', 'port': '1', 'global_ndim': '2', 'expected_len': '1',
    'desired_len': '1', 'align': '64',
}

# C expressions for a valid object of each pointer type, built by the
# prelude below (f_* are set up in the test's init).
FACTORY = {
    'ts_tensor *': 'f_tensor()',
    'const ts_tensor *': 'f_tensor()',
    'ts_tensor *const *': 'f_tensors()',
    'ts_module *': 'f_module()',
    'const ts_module *': 'f_module()',
    'ts_module *const *': 'f_modules()',
    'ts_comm *': 'f_world()',
    'const ts_comm *': 'f_world()',
    'ts_mesh *': 'f_mesh()',
    'const ts_mesh *': 'f_mesh()',
    'ts_generator *': 'f_gen()',
    'const ts_generator *': 'f_gen()',
    'ts_storage *': 'ts_tensor_storage(f_tensor())',
    'const ts_storage *': 'ts_tensor_storage(f_tensor())',
    'ts_state_dict *': 'f_sd()',
    'const ts_state_dict *': 'f_sd()',
    'ts_optim *': 'f_optim()',
    'const ts_optim *': 'f_optim()',
    'ts_dtensor *': 'f_dtensor()',
    'const ts_dtensor *': 'f_dtensor()',
    'ts_store *': 'f_store()',
    'ts_store_server *': 'f_server()',
    'const ts_store_server *': 'f_server()',
    'ts_request *': 'f_request()',
    'const ts_request *': 'f_request()',
    'const ts_module_vtable *': 'f_module()->vtable',
    'const ts_placement *': 'f_placements',
    'const char *': 'f_str',
    'const char *const *': 'f_strs',
    'char *const *': '(char *const *)f_strs',
    'char *': 'f_chars',
    'void *': 'f_bytes',
    'const void *': 'f_bytes',
    'void **': 'f_ptrs',
    'const int64_t *': 'f_i64',
    'int64_t *': 'f_i64',
    'const int *': 'f_int',
    'int *': 'f_int',
    'double *': 'f_dbl',
    'const double *': 'f_dbl',
    'float *': 'f_flt',
    'bool *': 'f_bool',
    'size_t *': 'f_size',
    'uint64_t *': 'f_u64',
    'uint8_t *': 'f_bytes',
    'const uint8_t *': 'f_gen_state',
    'ts_tensor **': 'f_tensor_outs',
    'ts_module **': 'f_module_outs',
    'ts_state_dict **': 'f_sd_outs',
    'ts_optim **': 'f_optim_outs',
    'ts_mesh **': 'f_mesh_outs',
    'ts_dtensor **': 'f_dtensor_outs',
    'ts_request **': 'f_request_outs',
    'ts_comm **': 'f_comm_outs',
    'ts_generator **': 'f_gen_outs',
    'ts_store **': 'f_store_outs',
    'ts_store_server **': 'f_server_outs',
    'ts_fsdp_unshard_handle **': 'f_handle_outs',
    'ts_fsdp_summon **': 'f_summon_outs',
    'ts_comm_counters *': '&f_counters',
    'ts_fsdp_group_info *': '&f_group_info',
    'ts_fsdp_offload_stats *': '&f_offload_stats',
    'ts_fsdp_accum_memory *': '&f_accum_memory',
    'ts_ckpt_info *': '&f_ckpt_info',
    'const ts_ckpt_options *': '&f_ckpt_opts',
    'ts_rank_env *': '&f_rank_env',
    'ts_launch_result *': '&f_launch_result',
    'ts_named_params *': '&f_named',
    'const ts_sgd_options *': '&f_sgd_opts',
    'const ts_adam_options *': '&f_adam_opts',
    'const ts_fsdp_options *': '&f_fsdp_opts',
    'const ts_dist_options *': '&f_dist_opts',
    'const ts_launch_options *': '&f_launch_opts',
    'const ts_encoder_layer_config *': '&f_enc_cfg',
    'const ts_mha_options *': '&f_mha_opts',
    'ts_param_list *': '&f_param_list',
    'const ts_trace_arg *': 'f_trace_args',
    'const ts_gpt_config *': '&f_gpt_cfg',
    'const ts_lr_schedule *': '&f_lr',
    'const ts_allocator *': '&f_allocator',
    'ts_module_each_fn': 'f_each_fn',
    'ts_fsdp_event_fn': 'f_event_fn',
    'ts_abort_fn': 'f_abort_fn',
    'ts_autograd_backward_fn': 'f_backward_fn',
    'ts_autograd_callback_fn': 'f_callback_fn',
    'ts_module_fn': 'f_module_fn',
    'FILE *': 'f_file()',
    'const ts_module_visitor *': '&f_visitor',
    'ts_module_visitor *': '&f_visitor',
    'char **': 'f_char_ptrs',
    'const char **': '(const char **)f_char_ptrs',
    'const ts_fsdp_group_info *': '&f_group_info',
    'ts_fsdp_group_info **': 'f_ptrs',
    'ts_grad_scaler *': 'f_scaler()',
    'const ts_grad_scaler *': 'f_scaler()',
    'ts_grad_scaler **': 'f_scaler_outs',
    'const ts_grad_scaler_options *': '&f_scaler_opts',
    'const ts_mp_policy *': '&f_mp_policy',
    'const ts_fsdp_memory_options *': '&f_mem_opts',
    'ts_fsdp_memory_report *': '&f_mem_report',
}

FN_TYPES = {'ts_module_each_fn', 'ts_fsdp_event_fn', 'ts_abort_fn', 'ts_autograd_backward_fn',
            'ts_autograd_callback_fn', 'ts_module_fn'}

PRELUDE = r'''/* Generated by tools/gen_null_args_test.py from the installed headers:
 * do not edit. Every public function, called with NULL for each pointer
 * argument in turn. */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "tensorshard.h"

/* not every factory is used by every version of the headers */
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wunused-variable"

static ts_tensor *g_tensor, *g_tensors[4];
static ts_module *g_module, *g_modules[2];
static ts_generator *g_gen;
static ts_state_dict *g_sd;
static ts_optim *g_optim;
static ts_mesh *g_mesh;
static ts_dtensor *g_dtensor;
static ts_store_server *g_server;
static ts_store *g_store;
static ts_request *g_request;
static ts_grad_scaler *g_scaler;
static ts_grad_scaler *f_scaler_outs[8];
static ts_grad_scaler_options f_scaler_opts;
static ts_mp_policy f_mp_policy;

static ts_placement f_placements[4];
static const char *f_str = "/nonexistent/ts_null_args";
static const char *const f_strs[4] = {"/nonexistent/a", "/nonexistent/b", "/nonexistent/c", NULL};
static char f_chars[256];
static _Alignas(64) unsigned char f_bytes[16384];
static void *f_ptrs[8];
static int64_t f_i64[8] = {1, 1, 1, 1, 1, 1, 1, 1};
static int f_int[8];
static double f_dbl[8];
static float f_flt[8];
static bool f_bool[8];
static size_t f_size[8];
static uint64_t f_u64[8];
static uint8_t f_gen_state[TS_GENERATOR_STATE_BYTES];
static ts_tensor *f_tensor_outs[8];
static ts_module *f_module_outs[8];
static ts_state_dict *f_sd_outs[8];
static ts_optim *f_optim_outs[8];
static ts_mesh *f_mesh_outs[8];
static ts_dtensor *f_dtensor_outs[8];
static ts_request *f_request_outs[8];
static ts_comm *f_comm_outs[8];
static ts_generator *f_gen_outs[8];
static ts_store *f_store_outs[8];
static ts_store_server *f_server_outs[8];
static ts_fsdp_unshard_handle *f_handle_outs[8];
static ts_fsdp_summon *f_summon_outs[8];
static ts_comm_counters f_counters;
static ts_fsdp_group_info f_group_info;
static ts_fsdp_offload_stats f_offload_stats;
static ts_fsdp_accum_memory f_accum_memory;
static ts_ckpt_info f_ckpt_info;
static ts_ckpt_options f_ckpt_opts = {.strict = true};
static ts_rank_env f_rank_env;
static ts_launch_result f_launch_result;
static ts_named_params f_named;
static ts_sgd_options f_sgd_opts;
static ts_adam_options f_adam_opts;
static ts_fsdp_options f_fsdp_opts;
static ts_dist_options f_dist_opts;
static ts_launch_options f_launch_opts;
static ts_encoder_layer_config f_enc_cfg;
static ts_mha_options f_mha_opts;
static ts_param_list f_param_list;
static ts_trace_arg f_trace_args[1] = {{"k", NULL, 1}};
static ts_gpt_config f_gpt_cfg;
static ts_fsdp_memory_options f_mem_opts;
static ts_fsdp_memory_report f_mem_report;
static ts_lr_schedule f_lr;
static ts_allocator f_allocator;
static ts_module_visitor f_visitor;
static char *f_char_ptrs[8];
static FILE *g_file;

/* where printing functions write: /dev/null */
static FILE *f_file(void)
{
    if (!g_file)
        cr_assert_not_null(g_file = fopen("/dev/null", "w"));
    return g_file;
}

static ts_status f_each_fn(void *ctx, const char *fqn, ts_module *m) { return TS_OK; }
static void f_event_fn(void *ctx, const char *event, const char *fqn) {}
static void f_abort_fn(const char *msg, void *ctx) {}
static ts_status f_backward_fn(void *ctx, int n, ts_tensor **grads) { return TS_OK; }
static ts_status f_callback_fn(void *ctx) { return TS_OK; }
static ts_status f_module_fn(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    return TS_OK;
}

#define F_OK(e) cr_assert_eq((e), TS_OK, "%s: %s", #e, ts_last_error())

/* A (2, 3) float32 tensor 0..5 */
static ts_tensor *f_tensor(void)
{
    if (!g_tensor) {
        float v[6] = {0, 1, 2, 3, 4, 5};
        F_OK(ts_tensor_from_data(TS_F32, 2, (int64_t[]){2, 3}, v, &g_tensor));
    }
    return g_tensor;
}
static ts_tensor *const *f_tensors(void)
{
    if (!g_tensors[0])
        for (int i = 0; i < 4; i++)
            F_OK(ts_clone(f_tensor(), &g_tensors[i]));
    return g_tensors;
}
/* Linear(3, 3) */
static ts_module *f_module(void)
{
    if (!g_module)
        F_OK(ts_linear_new(3, 3, true, &g_module));
    return g_module;
}
static ts_module *const *f_modules(void)
{
    if (!g_modules[0])
        for (int i = 0; i < 2; i++)
            F_OK(ts_linear_new(3, 3, true, &g_modules[i]));
    return g_modules;
}
/* the one-rank world (ts_dist_init without a launcher) */
static ts_comm *f_world(void)
{
    if (!ts_dist_is_initialized())
        F_OK(ts_dist_init(NULL));
    return ts_dist_world();
}
static ts_mesh *f_mesh(void)
{
    if (!g_mesh)
        F_OK(ts_mesh_new(f_world(), "cpu", 1, (int64_t[]){1}, (const char *[]){"dp"}, &g_mesh));
    return g_mesh;
}
static ts_generator *f_gen(void)
{
    if (!g_gen)
        F_OK(ts_generator_new(1, &g_gen));
    return g_gen;
}
static ts_state_dict *f_sd(void)
{
    if (!g_sd)
        F_OK(ts_module_state_dict(f_module(), &g_sd));
    return g_sd;
}
static ts_optim *f_optim(void)
{
    if (!g_optim)
        F_OK(ts_sgd_new(1, &((ts_nn_linear *)f_module())->weight, NULL, &g_optim));
    return g_optim;
}
static ts_dtensor *f_dtensor(void)
{
    if (!g_dtensor) {
        ts_placement r = ts_replicate();
        F_OK(ts_distribute_tensor(f_tensor(), f_mesh(), &r, 0, &g_dtensor));
    }
    return g_dtensor;
}
static ts_store_server *f_server(void)
{
    if (!g_server)
        F_OK(ts_store_server_start("127.0.0.1", 0, "tok", &g_server));
    return g_server;
}
static ts_store *f_store(void)
{
    if (!g_store) {
        F_OK(ts_store_connect("127.0.0.1", ts_store_server_port(f_server()), "tok", 5.0, &g_store));
        ts_store_set_timeout(g_store, 0.5);
    }
    return g_store;
}
static ts_request *f_request(void)
{
    if (!g_request) {
        F_OK(ts_barrier(f_world(), &g_request));
        F_OK(ts_request_wait(g_request));
    }
    return g_request;
}

static ts_grad_scaler *f_scaler(void)
{
    if (!g_scaler)
        F_OK(ts_grad_scaler_new(NULL, &g_scaler));
    return g_scaler;
}

static void setup(void)
{
    for (int i = 0; i < 4; i++)
        f_placements[i] = ts_replicate();
    f_sgd_opts = ts_sgd_options_default();
    f_adam_opts = ts_adam_options_default();
    f_fsdp_opts = ts_fsdp_options_default();
    f_dist_opts = ts_dist_options_default();
    f_launch_opts = ts_launch_options_default();
    f_enc_cfg = ts_encoder_layer_config_default(4, 2);
    f_mha_opts = ts_mha_options_default();
    f_gpt_cfg = ts_gpt_config_default();
    f_mem_opts = ts_fsdp_memory_options_default();
    f_mem_opts.input_ndim = 2, f_mem_opts.input_shape[0] = 1, f_mem_opts.input_shape[1] = 4;
    f_scaler_opts = ts_grad_scaler_options_default();
    f_mp_policy = ts_mp_policy_default();
}

#define FREE_OUTS(arr, fn)                                \
    do {                                                  \
        for (int i_ = 0; i_ < 8; i_++) {                  \
            if (arr[i_])                                  \
                fn(arr[i_]);                              \
            arr[i_] = NULL;                               \
        }                                                 \
    } while (0)

static void teardown(void)
{
    FREE_OUTS(f_tensor_outs, ts_tensor_free);
    FREE_OUTS(f_module_outs, ts_module_free);
    FREE_OUTS(f_sd_outs, ts_state_dict_free);
    FREE_OUTS(f_optim_outs, ts_optim_free);
    FREE_OUTS(f_dtensor_outs, ts_dtensor_free);
    FREE_OUTS(f_mesh_outs, ts_mesh_free);
    FREE_OUTS(f_request_outs, ts_request_free);
    FREE_OUTS(f_comm_outs, ts_comm_free);
    FREE_OUTS(f_gen_outs, ts_generator_free);
    FREE_OUTS(f_store_outs, ts_store_close);
    FREE_OUTS(f_server_outs, ts_store_server_stop);
    FREE_OUTS(f_scaler_outs, ts_grad_scaler_free);
    ts_grad_scaler_free(g_scaler);
    g_scaler = NULL;
    ts_request_free(g_request);
    ts_store_close(g_store);
    ts_store_server_stop(g_server);
    ts_dtensor_free(g_dtensor);
    ts_optim_free(g_optim);
    ts_state_dict_free(g_sd);
    ts_generator_free(g_gen);
    ts_mesh_free(g_mesh);
    ts_module_free(g_module);
    for (int i = 0; i < 2; i++)
        ts_module_free(g_modules[i]);
    for (int i = 0; i < 4; i++)
        ts_tensor_free(g_tensors[i]);
    ts_tensor_free(g_tensor);
    if (ts_dist_is_initialized())
        ts_dist_finalize();
    if (g_file)
        fclose(g_file);
}

TestSuite(api_null_args, .init = setup, .fini = teardown, .timeout = 60);

/* A ts_status call: TS_ERR_INVALID_ARGUMENT with a message naming the
 * function. */
#define EXPECT_INVALID(fname, argname, expr)                                                                  \
    do {                                                                                                      \
        ts_clear_error();                                                                                     \
        ts_status st_ = (expr);                                                                               \
        cr_expect_eq(st_, TS_ERR_INVALID_ARGUMENT, "%s with %s NULL -> %s, expected TS_ERR_INVALID_ARGUMENT (%s)", \
                     fname, argname, ts_status_name(st_), ts_last_error());                                   \
        if (st_ == TS_ERR_INVALID_ARGUMENT)                                                                   \
            cr_expect(ts_last_error()[0] != '\0', "%s with %s NULL: no ts_last_error() detail", fname, argname); \
    } while (0)
'''


def strip(src):
    src = re.sub(r'/\*.*?\*/', ' ', src, flags=re.S)
    src = re.sub(r'//[^\n]*', ' ', src)
    # preprocessor lines (with continuations)
    src = re.sub(r'^\s*#(?:[^\n]*\\\n)*[^\n]*', ' ', src, flags=re.M)
    return src


def split_params(s):
    out, depth, cur = [], 0, ''
    for ch in s:
        if ch == '(':
            depth += 1
        elif ch == ')':
            depth -= 1
        if ch == ',' and depth == 0:
            out.append(cur.strip())
            cur = ''
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def parse_param(p):
    """(type, name) of one parameter; arrays become pointers."""
    p = ' '.join(p.split())
    m = re.match(r'^.*\(\s*\*\s*([A-Za-z_]\w*)\s*\)\s*\(.*\)$', p)
    if m:
        return '(*)' + p, m.group(1)
    m = re.match(r'^(.*?)\s*\b([A-Za-z_]\w*)\s*\[[^\]]*\]$', p)
    if m:
        return normalize(m.group(1) + ' *'), m.group(2)
    m = re.match(r'^(.*?[\s*])([A-Za-z_]\w*)$', p)
    if not m:
        return normalize(p), ''
    return normalize(m.group(1)), m.group(2)


def normalize(t):
    t = ' '.join(t.replace('*', ' * ').split())
    t = t.replace('* *', '**').replace('* const', '*const')
    return t


def parse_decls(paths):
    decls = []
    for path in paths:
        src = strip(open(path, encoding='utf-8').read())
        for m in re.finditer(r'\bTS_API\b\s+([^;{}]*?)\s*;', src, re.S):
            d = ' '.join(m.group(1).split())
            d = re.sub(r'\s*(TS_PRINTF\([^)]*\)|__attribute__\(\(.*\)\))\s*$', '', d)
            fm = re.match(r'^(.*?)\b([A-Za-z_]\w*)\s*\((.*)\)$', d)
            if not fm:
                continue
            ret, name, params = normalize(fm.group(1)), fm.group(2), fm.group(3).strip()
            plist = [] if params in ('', 'void') else split_params(params)
            decls.append((path, ret, name, [parse_param(p) for p in plist]))
    return decls


def is_pointer(t):
    return t.endswith('*') or t in FN_TYPES or t.startswith('(*)')


def allowed(fn, arg):
    return (fn, arg) in ALLOWED_NULL or ('*', arg) in ALLOWED_NULL


SCALAR_BY_TYPE = {'ts_placement': 'ts_replicate()'}


def scalar_value(t, name):
    if t in SCALAR_BY_TYPE:
        return SCALAR_BY_TYPE[t]
    if name in SCALAR_BY_NAME:
        return '(%s)%s' % (t, SCALAR_BY_NAME[name])
    if t in ('int', 'int64_t', 'size_t', 'uint64_t', 'double', 'float'):
        return '(%s)1' % t
    return '(%s){0}' % t


def gen_test(ret, name, params):
    lines = []
    ptr_idx = [i for i, (t, a) in enumerate(params) if is_pointer(t)]
    if not ptr_idx:
        return None
    variants = []
    for i in ptr_idx:
        t, a = params[i]
        if allowed(name, a):
            # free-like functions with only that pointer: still call them
            if ret == 'void' and len(ptr_idx) == 1:
                variants.append((i, True))
            continue
        variants.append((i, False))
    if not variants:
        return None
    missing = set()
    for vi, only_call in variants:
        args = []
        for j, (t, a) in enumerate(params):
            if t == '...':
                continue
            if j == vi:
                args.append('NULL')
            elif is_pointer(t):
                if t in FACTORY:
                    args.append(FACTORY[t])
                elif allowed(name, a):
                    args.append('NULL')
                else:
                    missing.add(t)
                    args.append('NULL')
            else:
                args.append(scalar_value(t, a))
        call = '%s(%s)' % (name, ', '.join(args))
        argname = params[vi][1] or 'argument %d' % (vi + 1)
        if only_call or ret == 'void':
            lines.append('    %s;' % call)
        elif ret == 'ts_status':
            lines.append('    EXPECT_INVALID("%s", "%s", %s);' % (name, argname, call))
        elif NEUTRAL.get(name, '').startswith('"'):
            lines.append('    cr_expect_str_eq(%s, %s, "%s with %s NULL");' % (call, NEUTRAL[name], name, argname))
        elif NEUTRAL.get(name) == 'NAN':
            lines.append('    cr_expect(isnan(%s), "%s with %s NULL: expected NaN");' % (call, name, argname))
        elif is_pointer(ret):
            lines.append('    cr_expect(%s == NULL, "%s with %s NULL: expected NULL");' % (call, name, argname))
        else:
            want = NEUTRAL.get(name, '0')
            lines.append('    cr_expect_eq(%s, %s, "%s with %s NULL: expected %s");'
                         % (call, want, name, argname, want.replace('"', '')))
    body = []
    if missing:
        body.append('    cr_assert_fail("tools/gen_null_args_test.py has no factory for %s: add one or exclude %s");'
                    % (', '.join(sorted(missing)), name))
    else:
        body.extend(lines)
    return 'Test(api_null_args, %s)\n{\n%s\n}\n' % (name, '\n'.join(body))


def main():
    headers, out = sys.argv[1:-1], sys.argv[-1]
    decls = parse_decls(headers)
    seen = set()
    parts = [PRELUDE]
    excluded = []
    for path, ret, name, params in decls:
        if name in seen:
            continue
        seen.add(name)
        if name in EXCLUDED:
            excluded.append('/* %s excluded: %s */' % (name, EXCLUDED[name]))
            continue
        t = gen_test(ret, name, params)
        if t:
            parts.append(t)
    parts.extend(excluded)
    if not decls:
        sys.exit('gen_null_args_test.py: no TS_API declaration found in %s' % ' '.join(headers))
    with open(out, 'w', encoding='utf-8') as f:
        f.write('\n'.join(parts) + '\n')


if __name__ == '__main__':
    main()
