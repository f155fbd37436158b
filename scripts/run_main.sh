#!/usr/bin/env bash
# The main job: builds tensorshard and runs its most complete training
# example. Today that is single-process GPT training (examples/train_gpt:
# AdamW, warmup + cosine, a built-in grammar corpus); the multi-rank
# fully_shard run replaces it when that layer lands. Arguments go to
# train_gpt (--steps, --data FILE, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [ ! -f build/build.ninja ]; then
    meson setup build >/dev/null
fi
ninja -C build >/dev/null
exec build/examples/train_gpt "$@"
