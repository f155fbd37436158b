#!/usr/bin/env python3
"""Generates tests/api/test_null_args.c: one Criterion test per public
function (every TS_API declaration of the installed headers given on the
command line) that calls it once for each pointer argument with that
argument NULL and every other argument a valid object of its type.

Checks: a function returning ts_status returns TS_ERR_INVALID_ARGUMENT and
sets ts_last_error(); one returning a pointer returns NULL; one returning a
number or bool returns the neutral value its header documents (NEUTRAL
below, default 0); a void function simply returns. Nothing may crash.

A second suite, api_bad_values, calls every public function once for
each argument given a value out of its range, every other argument valid
as above: integer sizes and counts negative or huge (INT_MAX, INT64_MAX,
SIZE_MAX), dims and indices beyond any tensor or world (99, -99), enum
values that are none of the enum's (-1, 999), NaN and infinities where a
float must be finite, size and dim arrays holding such values, and arrays
of pointers with a NULL inside. Arguments are classified by type and name
(the tables below); a ts_status function must refuse the value with an
error status (not TS_ERR_INTERNAL) and a ts_last_error() detail; other
functions must return without crashing. Each exception is listed with its
reason (BAD_EXCEPT: the argument is not tried with that value; BAD_OK: the
value is valid, or documented as clamped or neutral, so TS_OK is fine).

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
    ('ts_store_value_free', 'value'): 'free functions accept NULL',
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
    ('ts_token_file_close', 'file'): 'free functions accept NULL',
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
    ('ts__memory_cap_from', 'env_value'): 'base.h: NULL is TS_MEMORY_PER_RANK unset',
    ('ts__memory_cap_from', 'cgroup_file'): 'base.h: NULL is no cgroup (no cap)',
    ('ts__memory_cap_from', 'mountinfo'): 'base.h: NULL is no mount table (no cap)',
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
    'ts_fsdp_shard_info *': '&f_shard_info',
    'ts_optim_hparams *': '&f_optim_hparams',
    'ts_fsdp_accum_memory *': '&f_accum_memory',
    'ts_ckpt_info *': '&f_ckpt_info',
    'const ts_ckpt_options *': '&f_ckpt_opts',
    'ts_rank_env *': '&f_rank_env',
    'ts_process_memory *': '&f_process_memory',
    'ts_memory_cap *': '&f_memory_cap',
    'ts_process_floor *': '&f_process_floor',
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
    'ts_gpt_config *': '&f_gpt_cfg',
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
    'ts_tokenizer *': 'f_tok()',
    'const ts_tokenizer *': 'f_tok()',
    'ts_tokenizer **': 'f_tok_outs',
    'ts_token_file *': 'f_tokfile()',
    'const ts_token_file *': 'f_tokfile()',
    'ts_token_file **': 'f_tokfile_outs',
    'const int32_t *': 'f_i32',
    'int32_t *': 'f_i32',
    'int32_t **': 'f_i32_outs',
    'const ts_grad_scaler *': 'f_scaler()',
    'ts_grad_scaler **': 'f_scaler_outs',
    'const ts_grad_scaler_options *': '&f_scaler_opts',
    'const ts_mp_policy *': '&f_mp_policy',
    'const ts_fsdp_memory_options *': '&f_mem_opts',
    'ts_fsdp_memory_report *': '&f_mem_report',
}

FN_TYPES = {'ts_module_each_fn', 'ts_fsdp_event_fn', 'ts_abort_fn', 'ts_autograd_backward_fn',
            'ts_autograd_callback_fn', 'ts_module_fn'}

# ---------------------------------------------------------------- bad values

# Integer arguments by name: counts and sizes (negative or huge is bad),
# sizes that divide (0 is bad too), dims (beyond any tensor) and indices
# (ranks, positions: beyond any world or list).
SIZE_NAMES = {'n', 'ndim', 'ndims', 'len', 'size', 'cap', 'nbytes', 'max_out', 'n_in', 'nout', 'num_layers',
              'global_ndim', 'n_meta', 'n_metadata', 'n_norm_dims', 'n_args', 'in_features', 'out_features',
              'num_embeddings', 'embedding_dim', 'embed_dim', 'd_model', 'length', 'min_params', 'bytes',
              'block_bytes', 'expected_len', 'desired_len', 'growth_tracker'}
DIVISOR_NAMES = {'k', 'chunks', 'world', 'num_heads', 'nhead', 'split_size', 'align'}
DIM_NAMES = {'dim', 'dim0', 'dim1'}
# Integers where any value may be valid, tried at both extremes of their
# type (offsets, bounds, steps: arithmetic on them must not overflow).
EXTREME_NAMES = {'diagonal', 'delta', 'ignore_index', 'low', 'high', 'start', 'end', 'step', 'seed'}
INDEX_NAMES = {'i', 'param_index', 'rank', 'src', 'dst', 'root', 'src_rank', 'port'}
# Floating arguments that must be finite (rates, probabilities, scales,
# bounds, timeouts).
FINITE_NAMES = {'lr', 'eps', 'p', 'dropout', 'dropout_p', 'gain', 'std', 'mean', 'a', 'from', 'to', 'start',
                'end', 'step', 'scale', 'new_scale', 'factor', 'pre_div', 'post_div', 'param', 'timeout_s',
                'max_norm'}
# Floating arguments that become elements of a tensor: tried NaN, inf and
# 1e300 into an int32 tensor (the first tensor argument an int32 one, a
# dtype argument TS_I32): torch raises for a value an integer cannot hold.
INT_VALUE_NAMES = {'value', 's', 'start', 'end', 'step', 'from', 'to', 'exponent'}
INT_VALUES = [('nan', 'NAN'), ('inf', 'INFINITY'), ('1e300', '1e300')]
# Enum types: (T)-1 and (T)999 are none of their values.
ENUM_TYPES = {'ts_dtype', 'ts_fan_mode', 'ts_gelu_approx', 'ts_launch_source', 'ts_log_level', 'ts_mem_tag',
              'ts_nonlinearity', 'ts_reduce_op', 'ts_reduction', 'ts_status'}
# Pointer arguments given a bad array: arrays of pointers with a NULL
# inside, and size / dim arrays holding bad values.
BAD_ARRAYS = {
    'ts_tensor *const *': [('a NULL tensor inside', 'f_tensors_with_null()')],
    'ts_module *const *': [('a NULL module inside', 'f_modules_with_null()')],
    'const char *const *': [('a NULL string inside', 'f_strs_with_null')],
    'char *const *': [('a NULL string inside', '(char *const *)f_strs_with_null')],
    'const int64_t *': [('sizes INT64_MAX', 'f_i64_huge'), ('sizes -2', 'f_i64_neg')],
    'const int *': [('entries 99', 'f_int_99')],
    'const ts_placement *': [('Shard(99)', 'f_placements_shard99'), ('kind 999', 'f_placements_kind999'),
                             ('Partial(op 999)', 'f_placements_op999')],
}

# (function, argument) pairs, or (function, argument, value label); '*'
# matches any function. Not tried with a bad value, with the reason.
BAD_EXCEPT = {
    ('ts__free', 'tag'): 'frees its pointer: the factory buffer is no block of the allocator',
    ('ts__free_raw', 'tag'): 'frees its pointer: the factory buffer is no block of the allocator',
    ('ts__free_raw', 'size'): 'frees its pointer: the factory buffer is no block of the allocator',
    ('ts__pinned_free', 'block_bytes'): 'frees its pointer: the factory buffer is no block of the allocator',
    ('ts__mem_count', 'bytes'): 'internal counter: any size is counted as given',
    ('ts__assert_fail', 'line'): 'aborts by design (internal)',
    ('ts_set_num_threads', 'n', 'INT_MAX'): 'asks for INT_MAX threads: capped by the thread library, slow',
    ('ts_trace_span', 'start_ns'): 'uint64_t timestamps: every value is a time',
    ('ts_trace_span', 'end_ns'): 'uint64_t timestamps: every value is a time',
    ('ts_trace_span_args', 'start_ns'): 'uint64_t timestamps: every value is a time',
    ('ts_trace_span_args', 'end_ns'): 'uint64_t timestamps: every value is a time',
    ('*', 'cap', 'SIZE_MAX'): 'a capacity beyond the buffer is the caller\'s promise, which no callee can check',
    ('*', 'size', 'SIZE_MAX'): 'a capacity beyond the buffer is the caller\'s promise, which no callee can check',
    ('*', 'len', 'SIZE_MAX'): 'a capacity beyond the buffer is the caller\'s promise, which no callee can check',
}

# Bad values a function accepts (TS_OK is then correct), with the reason.
BAD_OK = {
    ('ts_slice', 'start'): 'tensor.h: start and end are clamped, as Python slicing',
    ('ts_slice', 'end'): 'tensor.h: start and end are clamped, as Python slicing',
    ('ts_error', 's'): 'records and returns whatever status it is given',
    ('ts_scope_fail', 'st'): 'tensor.h: ends the scope and returns whatever status it is given',
    ('*', 'timeout_s', 'inf'): 'an infinite timeout waits forever, as documented',
    ('*', 'max_norm', 'inf'): 'clip_grad_norm: an infinite max_norm never clips (torch)',
    ('*', 'max_out', 'INT_MAX'): 'the capacity of the caller\'s array: any size is valid',
    ('*', 'seed', 'UINT64_MAX'): 'every 64-bit seed is valid',
    ('ts_chunk', 'chunks', 'INT_MAX'): 'torch.chunk: more chunks than rows gives one row each',
    ('ts_split', 'split_size', 'INT64_MAX'): 'torch.split: a size beyond the dim gives one piece',
    ('ts_slice', 'step', 'INT64_MAX'): 'a step beyond the dim takes the first element, as a[1::2**63-1]',
    ('ts_tril_mask', 'diagonal'): 'torch.tril: any diagonal is valid (all or nothing kept)',
    ('ts_randint', 'low'): 'torch.randint: any bounds with low < high (the range is computed in uint64)',
    ('ts_randint', 'high'): 'torch.randint: any bounds with low < high (the range is computed in uint64)',
    ('ts_store_add', 'delta'): 'any delta is valid: the counter wraps in two\'s complement (store_proto.c)',
    ('ts_distribute_tensor', 'src_rank', '-1'): 'dtensor.h: src_rank < 0 means every rank passes its full tensor',
    ('ts_trace_rank_path', 'rank'): 'base.h: any rank is a file name (rank < 0: a process that is not a rank)',
    ('ts_fsdp_apply_by_size', 'min_params', 'INT64_MAX'): 'a threshold no module reaches: nothing is sharded',
    ('ts_layer_norm_new', 'dim', '99'): 'dim is the normalized size here, and 99 a valid one',
    ('ts_normal_', 'mean'): 'torch\'s normal_ checks only std >= 0: a NaN or infinite mean fills NaN or inf',
    ('ts_tensor_arange', 'step', '1e300 into int32'): 'with start == end the range is empty: no element to convert',
    ('ts_normal_', 'std', 'inf'): 'torch\'s normal_ checks only std >= 0: an infinite std fills infinities',
}

PRELUDE = r'''/* Generated by tools/gen_null_args_test.py from the installed headers:
 * do not edit. Every public function, called with NULL for each pointer
 * argument in turn. */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "tensorshard.h"

/* api_bad_values asks for huge sizes: under AddressSanitizer an allocation
 * that cannot succeed must return NULL (the library's TS_ERR_NO_MEMORY),
 * as malloc does, not abort the test. Options given in ASAN_OPTIONS still
 * apply. */
const char *__asan_default_options(void);
const char *__asan_default_options(void) { return "allocator_may_return_null=1"; }

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
static ts_fsdp_shard_info f_shard_info;
static ts_optim_hparams f_optim_hparams;
static ts_fsdp_accum_memory f_accum_memory;
static ts_ckpt_info f_ckpt_info;
static ts_ckpt_options f_ckpt_opts = {.strict = true};
static ts_rank_env f_rank_env;
static ts_process_memory f_process_memory;
static ts_memory_cap f_memory_cap;
static ts_process_floor f_process_floor;
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
/* bad arrays (api_bad_values) */
static const char *const f_strs_with_null[4] = {NULL, "/nonexistent/b", "/nonexistent/c", NULL};
static int64_t f_i64_huge[8] = {INT64_MAX, INT64_MAX, INT64_MAX, INT64_MAX, INT64_MAX, INT64_MAX, INT64_MAX, INT64_MAX};
static int64_t f_i64_neg[8] = {-2, -2, -2, -2, -2, -2, -2, -2};
static int f_int_99[8] = {99, 99, 99, 99, 99, 99, 99, 99};
static ts_placement f_placements_shard99[4] = {{TS_PLACEMENT_SHARD, 99, TS_REDUCE_SUM}, {TS_PLACEMENT_SHARD, 99, TS_REDUCE_SUM}};
static ts_placement f_placements_kind999[4] = {{(ts_placement_kind)999, 0, TS_REDUCE_SUM}, {(ts_placement_kind)999, 0, TS_REDUCE_SUM}};
static ts_placement f_placements_op999[4] = {{TS_PLACEMENT_PARTIAL, 0, (ts_reduce_op)999}, {TS_PLACEMENT_PARTIAL, 0, (ts_reduce_op)999}};
static ts_tensor *f_null_tensors[4];
static ts_module *f_null_modules[2];
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
/* A (2, 3) int32 tensor 0..5 */
static ts_tensor *g_tensor_i32;
static ts_tensor *f_tensor_i32(void)
{
    if (!g_tensor_i32) {
        int32_t v[6] = {0, 1, 2, 3, 4, 5};
        F_OK(ts_tensor_from_data(TS_I32, 2, (int64_t[]){2, 3}, v, &g_tensor_i32));
    }
    return g_tensor_i32;
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
/* {NULL, valid, valid, valid}: NULL first, so that a count of 1 sees it */
static ts_tensor *const *f_tensors_with_null(void)
{
    for (int i = 1; i < 4; i++)
        f_null_tensors[i] = f_tensors()[i];
    return f_null_tensors;
}
static ts_module *const *f_modules_with_null(void)
{
    f_null_modules[1] = f_modules()[1];
    return f_null_modules;
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

static int32_t f_i32[8] = {0, 1, 2, 3, 4, 5, 6, 7};
static int32_t *f_i32_outs[8];
static ts_tokenizer *f_tok_outs[8];
static ts_tokenizer *g_tok;
/* A tokenizer learned from a few bytes (GPT-2's files are not needed). */
static ts_tokenizer *f_tok(void)
{
    if (!g_tok)
        F_OK(ts_tokenizer_learn("abab abab abc", 13, 260, &g_tok));
    return g_tok;
}

static ts_token_file *f_tokfile_outs[8];
static ts_token_file *g_tokfile;
/* A token file of 64 tokens (written to /tmp, removed once mapped), split
 * into windows of 2 with 16 validation tokens. */
static ts_token_file *f_tokfile(void)
{
    if (!g_tokfile) {
        int32_t ids[64];
        for (int i = 0; i < 64; i++)
            ids[i] = i;
        char path[64];
        /* a name of this process's own (the address differs between processes under ASLR) */
        snprintf(path, sizeof path, "/tmp/ts-null-args-%p.bin", (void *)&ids);
        F_OK(ts_tokenizer_write_bin(ids, 64, path));
        F_OK(ts_token_file_open(path, &g_tokfile));
        remove(path);
        F_OK(ts_token_file_split(g_tokfile, 16, 2));
    }
    return g_tokfile;
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

/* Frees what a call that succeeded wrote to the output factories. */
static void release_outs(void)
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
    FREE_OUTS(f_tok_outs, ts_tokenizer_free);
    FREE_OUTS(f_tokfile_outs, ts_token_file_close);
    FREE_OUTS(f_i32_outs, ts_tokenizer_buffer_free);
}

static void teardown(void)
{
    release_outs();
    ts_grad_scaler_free(g_scaler);
    g_scaler = NULL;
    ts_tokenizer_free(g_tok);
    g_tok = NULL;
    ts_token_file_close(g_tokfile);
    g_tokfile = NULL;
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
    ts_tensor_free(g_tensor_i32);
    g_tensor_i32 = NULL;
    if (ts_dist_is_initialized())
        ts_dist_finalize();
    if (g_file)
        fclose(g_file);
}

TestSuite(api_null_args, .init = setup, .fini = teardown, .timeout = 60);
TestSuite(api_bad_values, .init = setup, .fini = teardown, .timeout = 60);

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

/* A ts_status call given a bad value: an error status that is not
 * TS_ERR_INTERNAL, with a detail; what a call that succeeded anyway made
 * is freed. */
#define EXPECT_REFUSED(fname, what, expr)                                                                    \
    do {                                                                                                     \
        ts_clear_error();                                                                                    \
        ts_status st_ = (expr);                                                                              \
        cr_expect(st_ != TS_OK && st_ != TS_ERR_INTERNAL, "%s with %s -> %s, expected an error status (%s)",  \
                  fname, what, ts_status_name(st_), ts_last_error());                                        \
        if (st_ != TS_OK)                                                                                    \
            cr_expect(ts_last_error()[0] != '\0', "%s with %s: no ts_last_error() detail", fname, what);     \
        release_outs();                                                                                      \
    } while (0)
/* A call that may succeed (BAD_OK) or returns no status: it returns. */
#define EXPECT_RETURNS(expr)   \
    do {                       \
        ts_clear_error();      \
        (void)(expr);          \
        release_outs();        \
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


def bad_match(table, fn, arg, label):
    for key in ((fn, arg), ('*', arg), (fn, arg, label), ('*', arg, label)):
        if key in table:
            return True
    return False


INT_LIMITS = {'int': ('INT_MIN', 'INT_MAX'), 'int64_t': ('INT64_MIN', 'INT64_MAX'), 'size_t': (None, 'SIZE_MAX'),
              'uint64_t': (None, 'UINT64_MAX')}


def bad_values(t, a):
    """(label, C expression) pairs of values out of range for a parameter
    of type t named a; [] when it has no bad value."""
    if t in BAD_ARRAYS:
        return BAD_ARRAYS[t]
    if t in ENUM_TYPES:
        return [('(%s)-1' % t, '(%s)-1' % t), ('(%s)999' % t, '(%s)999' % t)]
    if t in ('double', 'float') and a in FINITE_NAMES:
        return [('nan', 'NAN'), ('inf', 'INFINITY'), ('-inf', '-INFINITY')]
    if t not in INT_LIMITS:
        return []
    lo, hi = INT_LIMITS[t]
    signed = lo is not None
    if a in DIM_NAMES:
        return [('99', '99'), ('-99', '-99'), (lo, lo)] if signed else [(hi, hi)]
    if a in EXTREME_NAMES:
        return ([(lo, lo)] if signed else []) + [(hi, hi)] + ([('0', '0'), ('-1', '-1')] if a == 'step' else [])
    if a in SIZE_NAMES or a in DIVISOR_NAMES or a in INDEX_NAMES:
        out = ([('-1', '-1')] if signed else []) + [(hi, hi)]
        if a in DIVISOR_NAMES:
            out.append(('0', '0'))
        return out
    return []


# Results a bad-value call may allocate, freed after it (C, r_ the result).
FREE_RESULT = {
    'ts__malloc': 'ts__free(TS_MEM_OTHER, r_)',
    'ts__calloc': 'ts__free(TS_MEM_OTHER, r_)',
    'ts__strdup': 'ts__free(TS_MEM_OTHER, r_)',
    'ts__malloc_raw': 'ts__free_raw(TS_MEM_OTHER, r_, 64)',
    'ts__pinned_alloc': 'ts__pinned_free(r_, *f_size)',
}


# Counts of the entries of an array argument: a count beyond the array is
# the caller's promise (nothing can check it), so they are not tried huge
# when the function takes an array.
ARRAY_COUNT_NAMES = {'n', 'n_in', 'n_args', 'n_meta', 'n_metadata'}
ARRAY_TYPES = {'ts_tensor *const *', 'ts_module *const *', 'const char *const *', 'char *const *', 'const int *',
               'const int64_t *', 'const ts_trace_arg *', 'const ts_placement *', 'ts_tensor **', 'const double *'}


def bad_call_args(params, vi, expr, other):
    """The arguments of one bad-value call: `expr` for argument vi,
    other(j, type, name) where it gives one, a factory's object for the
    other pointers and a valid scalar for the rest; None when a pointer
    type has no factory."""
    args = []
    for j, (tj, aj) in enumerate(params):
        if tj == '...':
            continue
        o = None if j == vi else other(j, tj, aj)
        if j == vi:
            args.append(expr)
        elif o is not None:
            args.append(o)
        elif is_pointer(tj):
            if tj not in FACTORY:
                return None
            args.append(FACTORY[tj])
        else:
            args.append(scalar_value(tj, aj))
    return args


def gen_bad_test(ret, name, params):
    body = []
    has_array = any(t in ARRAY_TYPES for t, a in params)
    for vi, (t, a) in enumerate(params):
        if t == '...':
            continue
        for label, expr in bad_values(t, a):
            if bad_match(BAD_EXCEPT, name, a, label):
                continue
            if has_array and a in ARRAY_COUNT_NAMES and label in ('INT_MAX', 'INT64_MAX', 'SIZE_MAX'):
                continue
            def two_sizes(j, tj, aj):  # two bad sizes: their product overflows
                if t in ('const int64_t *', 'const int *') and not is_pointer(tj) and aj in ('ndim', 'ndims', 'global_ndim'):
                    return '(%s)2' % tj
                return None
            args = bad_call_args(params, vi, expr, two_sizes)
            if args is None:
                return None  # the null-args test reports the missing factory
            call = '%s(%s)' % (name, ', '.join(args))
            what = '%s = %s' % (a or 'argument %d' % (vi + 1), label)
            if ret == 'ts_status' and not bad_match(BAD_OK, name, a, label):
                body.append('    EXPECT_REFUSED("%s", "%s", %s);' % (name, what, call))
            elif name in FREE_RESULT:
                body.append('    {\n        void *r_ = (void *)%s;\n        if (r_)\n            %s;\n        release_outs();\n    }'
                            % (call, FREE_RESULT[name]))
            else:
                body.append('    EXPECT_RETURNS(%s);' % call)
    # values an integer tensor cannot hold
    first_tensor = next((j for j, (tj, aj) in enumerate(params) if tj in ('ts_tensor *', 'const ts_tensor *')), None)
    has_dtype = any(tj == 'ts_dtype' for tj, aj in params)
    for vi, (t, a) in enumerate(params):
        if t != 'double' or a not in INT_VALUE_NAMES or (first_tensor is None and not has_dtype):
            continue
        for label, expr in INT_VALUES:
            label = '%s into int32' % label
            if bad_match(BAD_EXCEPT, name, a, label):
                continue
            def int32(j, tj, aj):
                return 'f_tensor_i32()' if j == first_tensor else 'TS_I32' if tj == 'ts_dtype' else None
            args = bad_call_args(params, vi, expr, int32)
            if args is None:
                return None
            call = '%s(%s)' % (name, ', '.join(args))
            what = '%s = %s' % (a, label)
            if ret == 'ts_status' and not bad_match(BAD_OK, name, a, label):
                body.append('    EXPECT_REFUSED("%s", "%s", %s);' % (name, what, call))
            else:
                body.append('    EXPECT_RETURNS(%s);' % call)
    if not body:
        return None
    return 'Test(api_bad_values, %s)\n{\n%s\n}\n' % (name, '\n'.join(body))


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
        t = gen_bad_test(ret, name, params)
        if t:
            parts.append(t)
    parts.extend(excluded)
    if not decls:
        sys.exit('gen_null_args_test.py: no TS_API declaration found in %s' % ' '.join(headers))
    with open(out, 'w', encoding='utf-8') as f:
        f.write('\n'.join(parts) + '\n')


if __name__ == '__main__':
    main()
