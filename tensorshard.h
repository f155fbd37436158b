/* tensorshard: fully sharded data parallel training in C. This header
 * includes every public header of the library. */
#ifndef TENSORSHARD_H
#define TENSORSHARD_H

#include "base/base.h"
#include "tensor/tensor.h"
#include "safetensors/safetensors.h"
#include "nn/nn.h"
#include "optim/optim.h"
#include "comm/store.h"
#include "comm/launch.h"
#include "comm/comm.h"
#include "mesh/mesh.h"
#include "dtensor/dtensor.h"
#include "fully_shard/fully_shard.h"
#include "fully_shard/grad_scaler.h"
#include "checkpoint/checkpoint.h"
#include "text/tokenizer.h"
#include "text/tokens.h"

#endif
