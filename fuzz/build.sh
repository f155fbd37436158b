#!/usr/bin/env bash
# Builds the libFuzzer targets with Debian's clang (clang-14 and
# libclang-rt-14-dev): the library sources and the target compiled
# together with -fsanitize=fuzzer,address,undefined, linked against the
# library's dependencies as pkg-config names them (UCX, libuv, jansson)
# plus BLIS, which has no .pc file. .ci/run builds and runs both. Usage:
# fuzz/build.sh [out-dir]  (default build-fuzz)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-build-fuzz}
CC=${CC:-clang}
mkdir -p "$OUT"
CFLAGS=(-std=c11 -g -O1 -fno-omit-frame-pointer -ffp-contract=off -fno-math-errno
        -fsanitize=address,undefined -fno-sanitize-recover=undefined
        -Wall -Wextra -Wno-unused-parameter -I.)
lib_sources=(base/*.c tensor/*.c nn/*.c optim/*.c comm/*.c mesh/*.c dtensor/*.c fully_shard/*.c checkpoint/*.c)
# shellcheck disable=SC2207
dep_cflags=($(pkg-config --cflags ucx libuv jansson))
# shellcheck disable=SC2207
dep_libs=($(pkg-config --libs ucx libuv jansson))
# The library's objects once, instrumented for coverage (fuzzer-no-link),
# two at a time; then each target links them with libFuzzer's main.
mkdir -p "$OUT/obj"
export CC OUT
printf '%s\n' "${lib_sources[@]}" | xargs -P "${FUZZ_BUILD_JOBS:-2}" -I{} sh -c \
    'src=$1; shift; exec "$CC" "$@" -c "$src" -o "$OUT/obj/$(echo "$src" | tr / _).o"' _ {} \
    "${CFLAGS[@]}" -fsanitize=fuzzer-no-link "${dep_cflags[@]}"
objs=()
for src in "${lib_sources[@]}"; do
    objs+=("$OUT/obj/$(echo "$src" | tr / _).o")
done
for target in safetensors store ckpt_index; do
    "$CC" "${CFLAGS[@]}" -fsanitize=fuzzer "${dep_cflags[@]}" "fuzz/fuzz_$target.c" "${objs[@]}" \
        -o "$OUT/fuzz_$target" "${dep_libs[@]}" -lblis -lm -lpthread
    echo "built $OUT/fuzz_$target"
done
