#!/usr/bin/env bash
# Installs tensorshard into a temporary prefix and builds programs against it
# the way an outside user would: pkg-config only, the shared library, no
# access to the source tree. Usage: scripts/check_install.sh [build-dir]
# (default build-install: set up with the tests off when it does not exist)
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=$PWD
BUILD=${1:-build-install}
PREFIX=$(mktemp -d "${TMPDIR:-/tmp}/ts-prefix.XXXXXX")
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ts-outside.XXXXXX")
trap 'rm -rf "$PREFIX" "$WORK"' EXIT

# A build directory that exists already (CI passes build-ci, built and
# tested just before) is installed from as it is: its prefix is pointed at
# the temporary one for the install and set back afterwards, which
# regenerates build.ninja but recompiles nothing.
if [ ! -f "$BUILD/build.ninja" ]; then
    meson setup "$BUILD" --prefix="$PREFIX" -Dtests=disabled >/dev/null
else
    OLD_PREFIX=$(meson introspect "$BUILD" --buildoptions |
        python3 -c 'import json, sys; print(next(o["value"] for o in json.load(sys.stdin) if o["name"] == "prefix"))')
    trap '(cd "$SRC" && meson configure "$BUILD" --prefix="$OLD_PREFIX" >/dev/null); rm -rf "$PREFIX" "$WORK"' EXIT
    meson configure "$BUILD" --prefix="$PREFIX" >/dev/null
fi
ninja -C "$BUILD" >/dev/null
meson install -C "$BUILD" --quiet >/dev/null

# Debian's multiarch layout puts the .pc file under lib/<triplet>/pkgconfig.
PC=$(find "$PREFIX" -name tensorshard.pc -print -quit)
[ -n "$PC" ] || { echo "check_install: no tensorshard.pc under $PREFIX" >&2; exit 1; }
export PKG_CONFIG_PATH=$(dirname "$PC")
LIBDIR=$(pkg-config --variable=libdir tensorshard)
SHARE="$PREFIX/share/tensorshard"
for f in examples/common.h examples/unit_wrapped.c examples/train_gpt.c examples/quickstart.c reference/models.py; do
    [ -f "$SHARE/$f" ] || { echo "check_install: $SHARE/$f is not installed" >&2; exit 1; }
done
[ -f "$(pkg-config --variable=includedir tensorshard)/tensorshard/tensorshard.h" ] || {
    echo "check_install: tensorshard.h is not under include/tensorshard/" >&2; exit 1; }

# The installed headers are the public API: no library-internal function
# (`ts__*`, declared in base/internal.h and each layer's internal header,
# which are not installed) may be exported from them, nor TS_ASSERT.
INCDIR="$(pkg-config --variable=includedir tensorshard)/tensorshard"
if grep -rnE 'TS_API[^;(]*[ *]ts__[a-z0-9_]+ *\(|define TS_ASSERT\b' "$INCDIR"; then
    echo "check_install: an installed header above exports a library-internal symbol" >&2; exit 1
fi

cd "$WORK"
cp "$SRC/tests/install/outside.c" .
# -Wl,-rpath makes the programs find the library without LD_LIBRARY_PATH.
CFLAGS="-std=c11 -Wall -Werror $(pkg-config --cflags tensorshard)"
LIBS="$(pkg-config --libs tensorshard) -Wl,-rpath,$LIBDIR"
cc $CFLAGS outside.c -o outside $LIBS
cc $CFLAGS "$SHARE/examples/unit_wrapped.c" -o unit_wrapped $LIBS -lm
# the README's recipe for train_gpt, which writes --metrics with jansson
cc $CFLAGS $(pkg-config --cflags jansson) "$SHARE/examples/train_gpt.c" -o train_gpt $LIBS $(pkg-config --libs jansson) -lm
# (ldd's output is captured first: grep -q closing the pipe early would fail
# the pipeline under pipefail.)
deps=$(ldd ./outside)
grep -q "$LIBDIR/libtensorshard.so" <<<"$deps" || {
    echo "check_install: outside does not link the installed shared library:" >&2; echo "$deps" >&2; exit 1; }
./outside
"$PREFIX/bin/tsrun" --nproc-per-node 2 ./unit_wrapped > unit_wrapped.out
# Seed 000's values: rank 0's shard of layer 0 starts with -0.0037434101.
grep -q "^\[0\] rank 0: shard of layer0 \[-0.0037434101, 0.2682217956" unit_wrapped.out || {
    echo "check_install: unit_wrapped printed:" >&2; cat unit_wrapped.out >&2; exit 1; }
# The README's quickstart, as its "Against an installed library" line builds it.
cc $CFLAGS "$SHARE/examples/quickstart.c" -o quickstart $LIBS
"$PREFIX/bin/tsrun" --nproc-per-node 2 ./quickstart > quickstart.out
grep -q "^\[1\] rank 1 step 5 loss " quickstart.out || {
    echo "check_install: quickstart printed:" >&2; cat quickstart.out >&2; exit 1; }
echo "check_install: OK (prefix $PREFIX, pkg-config file $PC)"
