/* CPUOffloadPolicy (fully_shard.h): the policy's defaults. */
#define _GNU_SOURCE
#include "fully_shard/fully_shard.h"

ts_offload_policy ts_offload_policy_default(void) { return (ts_offload_policy){.pin_memory = true}; }
