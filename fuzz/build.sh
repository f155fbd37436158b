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
lib_sources=(base/*.c tensor/*.c safetensors/*.c nn/*.c optim/*.c comm/*.c mesh/*.c dtensor/*.c fully_shard/*.c checkpoint/*.c)
# shellcheck disable=SC2207
dep_cflags=($(pkg-config --cflags ucx libuv jansson))
# shellcheck disable=SC2207
dep_libs=($(pkg-config --libs ucx libuv jansson))
# Which of the library's objects the targets need is the linker's answer:
# every source compiled once quickly (clang -O0, no debug information, no
# instrumentation: about 20 s of CPU), archived, and each target linked
# against the archive with a stub main; the members the linker pulled in
# are the ones built instrumented (fuzzer-no-link), two at a time. That
# skips the objects no target reaches (tensor/flash_attention.c alone
# takes three minutes of CPU instrumented). A target links the same
# objects either way: whatever it does not reference was never executed
# by the fuzzer. Should the instrumented link still miss a symbol, the
# remaining objects are built and the targets linked again with all of
# them. FUZZ_ALL_OBJECTS=1 builds every object instrumented from the start.
export CC
obj_of() { echo "$OUT/obj/$(echo "$1" | tr / _).o"; }
compile() {  # compile DIR [flags...]: the sources on stdin, two at a time, into DIR
    local dir=$1; shift
    xargs -P "${FUZZ_BUILD_JOBS:-2}" -I{} sh -c \
        'dir=$1; src=$2; shift 2; exec "$CC" "$@" -c "$src" -o "$dir/$(echo "$src" | tr / _).o"' \
        _ "$dir" {} "$@"
}
link_targets() {  # link_targets obj...: each target with libFuzzer's main
    for target in safetensors store ckpt_index; do
        "$CC" "${CFLAGS[@]}" -fsanitize=fuzzer "${dep_cflags[@]}" "fuzz/fuzz_$target.c" "$@" \
            -o "$OUT/fuzz_$target" "${dep_libs[@]}" -lblis -lm -lpthread || return 1
        echo "built $OUT/fuzz_$target"
    done
}
rm -rf "$OUT/obj" "$OUT/scan"
mkdir -p "$OUT/obj" "$OUT/scan"
needed=("${lib_sources[@]}")
if [ "${FUZZ_ALL_OBJECTS:-0}" != 1 ]; then
    printf '%s\n' "${lib_sources[@]}" | compile "$OUT/scan" -std=c11 -O0 -g0 -w -I. "${dep_cflags[@]}"
    ar rcs "$OUT/scan/fuzzscan.a" "$OUT"/scan/*.o
    printf 'int LLVMFuzzerTestOneInput(const unsigned char *, unsigned long);\n%s\n' \
        'int main(void) { return LLVMFuzzerTestOneInput(0, 0); }' >"$OUT/scan/stub_main.c"
    for target in safetensors store ckpt_index; do
        "$CC" -std=c11 -O0 -g0 -w -I. "${dep_cflags[@]}" "$OUT/scan/stub_main.c" "fuzz/fuzz_$target.c" \
            "$OUT/scan/fuzzscan.a" "${dep_libs[@]}" -lblis -lm -lpthread -o "$OUT/scan/scan_$target" \
            -Wl,-Map,"$OUT/scan/$target.map"
    done
    members=$(cat "$OUT"/scan/*.map | grep -o 'fuzzscan\.a([^)]*)' | sort -u)
    needed=()
    for src in "${lib_sources[@]}"; do
        if grep -qF "fuzzscan.a($(basename "$(obj_of "$src")"))" <<<"$members"; then needed+=("$src"); fi
    done
    echo "${#needed[@]} of ${#lib_sources[@]} library sources reached from the targets"
fi
printf '%s\n' "${needed[@]}" | compile "$OUT/obj" "${CFLAGS[@]}" -fsanitize=fuzzer-no-link "${dep_cflags[@]}"
objs=()
for src in "${needed[@]}"; do objs+=("$(obj_of "$src")"); done
if ! link_targets "${objs[@]}"; then
    echo "fuzz: a target needs more than the scan found; building every library object"
    rest=()
    for src in "${lib_sources[@]}"; do [ -f "$(obj_of "$src")" ] || rest+=("$src"); done
    printf '%s\n' "${rest[@]}" | compile "$OUT/obj" "${CFLAGS[@]}" -fsanitize=fuzzer-no-link "${dep_cflags[@]}"
    objs=()
    for src in "${lib_sources[@]}"; do objs+=("$(obj_of "$src")"); done
    link_targets "${objs[@]}"
fi
