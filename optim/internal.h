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

#endif
