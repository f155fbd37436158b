#!/usr/bin/env bash
# CI step (.ci/run): builds both libFuzzer targets with clang (fuzz/build.sh)
# and runs them side by side for FUZZ_SECONDS each (default 60) on scratch
# copies of the committed corpus. Prints one line per target; on a finding (crash, leak,
# timeout, sanitizer report) prints the end of the fuzzer's log and the
# reproducer's path and exits 1. Usage: fuzz/ci.sh [out-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-build-fuzz}
SECS=${FUZZ_SECONDS:-60}
mkdir -p "$OUT"
built=$(date +%s)
if ! fuzz/build.sh "$OUT" >"$OUT/build.log" 2>&1; then
    tail -n 30 "$OUT/build.log"
    echo "fuzz: building the targets failed (log: $OUT/build.log)"
    exit 1
fi
echo "fuzz: targets built in $(( $(date +%s) - built )) s ($(grep -m1 'library sources reached' "$OUT/build.log" || echo 'every library source'))"
# The targets run side by side, each on a scratch copy of its corpus for
# FUZZ_SECONDS of wall time (three on two cores: each gets about two
# thirds of a core), and report in order once all have ended.
targets=(safetensors store ckpt_index)
pids=()
works=()
for target in "${targets[@]}"; do
    work=$(mktemp -d "$OUT/work-$target.XXXXXX")
    works+=("$work")
    (cd "$OUT" && exec "./fuzz_$target" -max_total_time="$SECS" -timeout=25 -max_len=4096 \
        -dict="../fuzz/$target.dict" -artifact_prefix="./$target-" -print_final_stats=1 \
        "$(basename "$work")" "../fuzz/corpus/$target") >"$OUT/fuzz_$target.log" 2>&1 &
    pids+=($!)
done
status=0
for i in "${!targets[@]}"; do
    target=${targets[$i]} log="$OUT/fuzz_${targets[$i]}.log"
    if wait "${pids[$i]}"; then
        runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
        cov=$(grep -o 'cov: [0-9]*' "$log" | tail -n 1 | cut -d' ' -f2)
        echo "fuzz_$target: ${runs:-?} runs in $SECS s, ${cov:-?} edges covered, nothing found"
    else
        tail -n 40 "$log"
        echo "fuzz_$target: FOUND A BUG (log: $log; reproducer: $(ls "$OUT/$target"-crash-* "$OUT/$target"-leak-* \
            "$OUT/$target"-timeout-* "$OUT/$target"-oom-* 2>/dev/null | head -n 1))"
        status=1
    fi
    rm -rf "${works[$i]}"
done
exit $status
