#!/usr/bin/env bash
# Runs runtime tests under AddressSanitizer + UBSan, by hand (not in CI: the ASan runtime build takes
# ~30 min of one core from cold, and CI must stay under 30 min on 2 cores; CI's sanitizer build covers
# loaders/ and allocators/ only, see tools/test.sh).
#
#   tools/asan_runtime.sh [GTEST_FILTER]     default: the stream-failure tests (issue 20)
#
# Builds build-asan-rt/ (clang, RelWithDebInfo, SHARDCAST_SANITIZE=ON, no CUDA, no benchmarks) and in it
# only runtime_load_test, the multi-process load test: its ranks are the same binary re-executed, so
# every rank runs instrumented. libtorch is the wheel's, not instrumented: ASan sees its heap through the
# malloc interceptors and gloo's socket writes through the writev interceptor, and in this build the
# stream's staging buffers come from the heap (runtime/stream/source.cc), so a transport reading a freed slot
# is a heap-use-after-free report. Leak checking is off: libtorch keeps allocations to exit.
# Environment: SHARDCAST_JOBS (default 1), CCACHE_BASEDIR (default this checkout).
set -euo pipefail
cd "$(dirname "$0")/.."
filter=${1:-'*SendsInFlight*:Matrix/Faults.*stream*:*AllocationRefused*'}
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
CC=clang CXX=clang++ cmake -S . -B build-asan-rt -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSHARDCAST_SANITIZE=ON \
  -DSHARDCAST_BUILD_BENCH=OFF -DSHARDCAST_CUDA=OFF >/dev/null
cmake --build build-asan-rt -j"${SHARDCAST_JOBS:-1}" --target runtime_load_test
ASAN_OPTIONS=detect_leaks=0:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  build-asan-rt/tests/runtime_load_test --gtest_filter="$filter"
