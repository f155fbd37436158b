#!/usr/bin/env bash
# Installs the Debian packages tensorshard builds and tests with. Idempotent:
# when everything is installed it only checks, which takes well under a second.
set -euo pipefail

PKGS=(build-essential meson ninja-build pkg-config
      libucx-dev ucx-utils libuv1-dev libcriterion-dev libblis-dev libjansson-dev
      clang libclang-rt-14-dev clang-format valgrind
      iproute2  # ip netns: the multi-host suite (tests/comm/test_multihost.c; skips without it or root)
      python3-matplotlib)  # tools/trace_plot (its test skips without it)

missing=()
for p in "${PKGS[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$p")
    fi
done

if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi

echo "setup: installing ${missing[*]}" >&2
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
# A fresh machine has empty package lists.
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
