#!/usr/bin/env bash
# Runs every test: the sanitizer (ASan+UBSan) build of the loader tests, a short fuzz run of the
# header parser, then the full build's unit, multi-process and Python tests under ctest.
# Environment: SHARDCAST_FUZZ_SECONDS (default 60).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh >/dev/null
jobs=${SHARDCAST_JOBS:-$(nproc)}
# ccache hits across build dirs at the same depth (build/, build-install/ of the install test) and clones.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}

echo "== sanitizer build (clang, ASan+UBSan) of loaders and allocators, with the fuzzer"
CC=clang CXX=clang++ cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSHARDCAST_SANITIZE=ON \
  -DSHARDCAST_FUZZ=ON -DSHARDCAST_BUILD_RUNTIME=OFF -DSHARDCAST_BUILD_BENCH=OFF >/dev/null
cmake --build build-asan -j"$jobs"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan --output-on-failure -j"$jobs"

echo "== fuzzing the header parser for ${SHARDCAST_FUZZ_SECONDS:-60} s"
corpus=build-asan/fuzz-corpus
mkdir -p "$corpus"
SHARDCAST_CORPUS_DIR="$corpus" build-asan/tests/loaders_test --gtest_filter='Corpus/*' >/dev/null
build-asan/tests/fuzz/header_fuzzer -max_total_time="${SHARDCAST_FUZZ_SECONDS:-60}" -max_len=4096 \
  -print_final_stats=1 "$corpus" 2>&1 | tail -n 3

echo "== full build (build/, shared with the set-up's pip install), then unit, multi-process, Python and install tests"
tools/build.sh
ctest --test-dir build --output-on-failure -j"$jobs"
