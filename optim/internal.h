/* Internal hooks of the optim layer (not installed). */
#ifndef TS_OPTIM_INTERNAL_H
#define TS_OPTIM_INTERNAL_H

#include "optim/optim.h"

/* Test hook: when true, the update and norm kernels run their plain scalar
 * reference build (libm fma calls) instead of the AVX2 build. Both must
 * give bit-identical results; tests compare them. */
extern bool ts__optim_use_reference;

/* True when the AVX2 build of the kernels is used (x86-64 CPU with AVX2
 * and FMA, and the hook above off). */
bool ts__optim_avx2_active(void);

/* A check an upper layer (fully_shard) installs: called by every
 * ts_optim_step, before anything changes, with the optimizer's name
 * ("AdamW"), its parameters as given, and whether this is its first step.
 * A non-OK status (with its detail) fails the step. One process-wide
 * check; installing again replaces it; NULL removes it. */
typedef ts_status (*ts__optim_param_check_fn)(const char *who, int n, ts_tensor *const *params, bool first_step);
void ts__optim_set_param_check(ts__optim_param_check_fn fn);

#endif
