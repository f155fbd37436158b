#!/usr/bin/env bash
# scripts/run_main.sh (the README's first command) builds only what the
# main job runs, says so first, and lets ninja's progress show: run on a
# copy of the script in a scratch tree whose setup.sh, ninja and tsrun are
# stubs that record how they were called. Then the targets it names must
# be targets of the real build (BUILD_DIR, the first argument), so that a
# renamed target fails here and not on a user's first run.
# Usage: test_run_main.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
BUILD_DIR=$1 SRC=$2
T=$(mktemp -d "${TMPDIR:-/tmp}/ts-run-main.XXXXXX")
trap 'rm -rf "$T"' EXIT
fail() { echo "test_run_main: $*" >&2; exit 1; }

mkdir -p "$T/tree/scripts" "$T/tree/build/tools" "$T/bin"
cp "$SRC/scripts/run_main.sh" "$T/tree/scripts/"
printf '#!/bin/sh\nexit 0\n' > "$T/tree/scripts/setup.sh"
touch "$T/tree/build/build.ninja"   # configured: no meson setup
cat > "$T/tree/build/tools/tsrun" <<'STUB'
#!/bin/sh
echo "tsrun $*"
STUB
cat > "$T/bin/ninja" <<STUB
#!/bin/sh
echo "\$*" > "$T/ninja.args"
echo "[1/88] Compiling C object (ninja progress)"
STUB
chmod +x "$T/tree/scripts/setup.sh" "$T/tree/build/tools/tsrun" "$T/bin/ninja"

PATH="$T/bin:$PATH" TS_NPROC=2 "$T/tree/scripts/run_main.sh" --steps 3 >"$T/out" 2>"$T/err" ||
    fail "run_main.sh exited $?: $(cat "$T/err")"

read -r -a args < "$T/ninja.args"
[ "${args[0]:-}" = "-C" ] && [ "${args[1]:-}" = "build" ] || fail "ninja was called as 'ninja ${args[*]}', not 'ninja -C build ...'"
targets=("${args[@]:2}")
[ "${targets[*]}" = "tools/tsrun examples/train_gpt" ] ||
    fail "ninja was asked for '${targets[*]:-(everything)}', not 'tools/tsrun examples/train_gpt'"
grep -q "(ninja progress)" "$T/out" "$T/err" || fail "ninja's progress was thrown away (stdout: $(cat "$T/out"); stderr: $(cat "$T/err"))"
first=$(head -n 1 "$T/err")
case "$first" in
    run_main:\ building*) ;;
    *) fail "the first line is '$first', not the one saying what is built" ;;
esac
grep -qx "tsrun --nproc-per-node 2 build/examples/train_gpt --steps 3" "$T/out" ||
    fail "tsrun was not run as the main job: $(cat "$T/out")"
grep -q "ninja progress" "$T/out" && fail "ninja's progress went to stdout, where the training's lines are"

# The targets exist in the real build.
for t in "${targets[@]}"; do
    ninja -C "$BUILD_DIR" -t query "$t" >/dev/null 2>&1 || fail "'$t' is not a target of $BUILD_DIR"
done
echo "test_run_main: OK (ninja -C build ${targets[*]})"
