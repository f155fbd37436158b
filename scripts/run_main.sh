#!/usr/bin/env bash
# The main job: builds tensorshard and trains a small GPT on two ranks of
# this machine with fully_shard (examples/train_gpt under tools/tsrun: each
# transformer block one FSDP group, the root another; AdamW, warmup +
# cosine, clip_grad_norm over the shards, a built-in grammar corpus).
# TS_NPROC sets the number of ranks (default 2). Arguments go to train_gpt
# (--steps, --data FILE, --save DIR, --resume DIR, --save-full FILE.safetensors, ...).
#
# It builds only what the job runs (the library, tools/tsrun and
# examples/train_gpt: about a minute and a half on 2 cores from a fresh
# clone), in build/ with the default options, so scripts/test.sh builds the
# test suites and benchmarks in the same folder afterwards without
# configuring it again.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [ ! -f build/build.ninja ]; then
    meson setup build >/dev/null
fi
# train_gpt links the shared library and tsrun the static one, so these two
# targets build the whole library (both from the same objects).
TARGETS=(tools/tsrun examples/train_gpt)
echo "run_main: building the library, tools/tsrun and examples/train_gpt in build/" \
     "(only what this job runs; scripts/test.sh builds the tests and benchmarks)" >&2
ninja -C build "${TARGETS[@]}" >&2  # progress on the terminal, stdout left to the training
exec build/tools/tsrun --nproc-per-node "${TS_NPROC:-2}" build/examples/train_gpt "$@"
