#!/usr/bin/env bash
# Builds tensorshard and runs every test suite. Usage: scripts/test.sh [build-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
BUILD=${1:-build}
WERROR=${TS_WERROR:-false}
if [ ! -f "$BUILD/build.ninja" ]; then
    meson setup "$BUILD" -Dwerror="$WERROR" >/dev/null
else
    meson configure "$BUILD" -Dwerror="$WERROR" >/dev/null
fi
ninja -C "$BUILD"
# Criterion prints a "Synthesis" line per suite; meson prints the totals.
# Three suites at a time: the multi-process suites, which mostly wait, run
# beside the others (tests/meson.build).
meson test -C "$BUILD" --print-errorlogs --num-processes 3 "${@:2}"
