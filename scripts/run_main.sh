#!/usr/bin/env bash
# The main job: builds tensorshard and trains a small GPT on two ranks of
# this machine with fully_shard (examples/train_gpt under tools/tsrun: each
# transformer block one FSDP group, the root another; AdamW, warmup +
# cosine, clip_grad_norm over the shards, a built-in grammar corpus).
# TS_NPROC sets the number of ranks (default 2). Arguments go to train_gpt
# (--steps, --data FILE, --save DIR, --resume DIR, --save-full FILE.safetensors, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [ ! -f build/build.ninja ]; then
    meson setup build >/dev/null
fi
ninja -C build >/dev/null
exec build/tools/tsrun --nproc-per-node "${TS_NPROC:-2}" build/examples/train_gpt "$@"
