#!/usr/bin/env bash
# The main job: builds tensorshard and runs its most complete training
# example. (Today: single-process MLP training on the foundation layer; the
# multi-rank fully_shard run replaces it when that layer lands.)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [ ! -f build/build.ninja ]; then
    meson setup build >/dev/null
fi
ninja -C build >/dev/null
exec build/examples/train_regression "$@"
