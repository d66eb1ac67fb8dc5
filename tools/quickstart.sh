#!/usr/bin/env bash
# The main job on the embedded default: set up, build, synthesize a small MoE checkpoint
# (configs/tiny-moe.json, ~250 MB, uneven shapes) and load it into 4 local ranks over Gloo, every
# rank receiving only its rows, every entry verified by xxHash against the sender.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
tools/build.sh
out=${SHARDCAST_OUT:-out/tiny-moe}
rm -rf "$out"
mkdir -p "$(dirname "$out")"
build/tools/shardcast synth --config configs/tiny-moe.json --out "$out" --max-shard-size 64M --seed 1
build/tools/shardcast inspect "$out" | tail -n 1
build/tools/shardcast plan --config configs/tiny-moe.json --world-size 4 | sed -n '/per rank/,/^$/p'
build/tools/shardcast load --checkpoint "$out" --nproc 4 --verify
