#!/usr/bin/env bash
# Runs every test: the sanitizer (ASan+UBSan) build of the loaders', allocators' and planning core's
# tests, a short run of each fuzz target, then the full build's unit, multi-process and Python tests under ctest.
# Environment: SHARDCAST_FUZZ_SECONDS (default 100: the total, split over the fuzz targets).
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS=0
tools/setup.sh >/dev/null
echo "== set-up checked (${SECONDS} s)"
jobs=${SHARDCAST_JOBS:-$(nproc)}
# ccache hits across build dirs at the same depth (build/, build-install/ of the install test) and clones.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}

phase_start=$SECONDS
echo "== sanitizer build (clang, ASan+UBSan) of loaders, allocators and the planning core (no libtorch), with the fuzzer"
CC=clang CXX=clang++ cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSHARDCAST_SANITIZE=ON \
  -DSHARDCAST_FUZZ=ON -DSHARDCAST_BUILD_RUNTIME=OFF -DSHARDCAST_BUILD_BENCH=OFF >/dev/null
cmake --build build-asan -j"$jobs"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan --output-on-failure -j"$jobs"

# Each target runs from its seeds in tests/fuzz/corpus/<target>/ (read-only) into a working corpus
# in build-asan/fuzz-corpus/<target>/ that grows from run to run; the header parser's also starts
# from the malformed-file corpus, the manifest decoder's from the wire blobs of today's manifest version
# (core_test writes them). The time is split evenly over the targets, and $jobs of them run at once
# (libFuzzer uses one core): the same fuzzing in 1/$jobs of the wall time.
fuzz_targets=(header_fuzzer index_fuzzer checkpoint_fuzzer read_fuzzer manifest_fuzzer)
fuzz_seconds=${SHARDCAST_FUZZ_SECONDS:-100}
per_target=$(( fuzz_seconds / ${#fuzz_targets[@]} ))
(( per_target >= 1 )) || per_target=1
echo "== sanitizer build and tests: $(( SECONDS - phase_start )) s"
phase_start=$SECONDS
echo "== fuzzing ${#fuzz_targets[@]} targets, ${per_target} s each, ${jobs} at a time"
mkdir -p build-asan/fuzz-corpus/header_fuzzer
SHARDCAST_CORPUS_DIR=build-asan/fuzz-corpus/header_fuzzer build-asan/tests/loaders_test --gtest_filter='Corpus/*' >/dev/null
mkdir -p build-asan/fuzz-corpus/manifest_fuzzer
SHARDCAST_CORPUS_DIR=build-asan/fuzz-corpus/manifest_fuzzer build-asan/tests/core_test \
  --gtest_filter='ManifestMapping.WireBlobsOfEveryLayoutEncodeBackToThemselves' >/dev/null
fuzz() {  # its exit status to build-asan/fuzz-<target>.rc
  local t=$1 rc=0
  mkdir -p "build-asan/fuzz-corpus/$t"
  build-asan/tests/fuzz/"$t" -max_total_time="$per_target" -max_len=8192 -timeout=10 -print_final_stats=1 \
    -artifact_prefix="build-asan/fuzz-$t-" "build-asan/fuzz-corpus/$t" "tests/fuzz/corpus/$t" \
    >"build-asan/fuzz-$t.log" 2>&1 || rc=$?
  echo "$rc" >"build-asan/fuzz-$t.rc"
}
rm -f build-asan/fuzz-*.rc
for t in "${fuzz_targets[@]}"; do
  while (( $(jobs -rp | wc -l) >= jobs )); do sleep 0.2; done
  fuzz "$t" &
done
wait
failed=0
for t in "${fuzz_targets[@]}"; do
  log="build-asan/fuzz-$t.log"
  if [[ "$(cat "build-asan/fuzz-$t.rc" 2>/dev/null)" != 0 ]]; then
    tail -n 40 "$log"
    echo "$t FAILED; the input is build-asan/fuzz-$t-*, the log $log"
    failed=1
    continue
  fi
  # The final stats: "#<execs> DONE cov: <edges> ft: <features> ... exec/s: <rate>".
  printf '%-18s %s\n' "$t" "$(grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -n 1)"
done
(( failed == 0 )) || exit 1

echo "== fuzzing: $(( SECONDS - phase_start )) s"
phase_start=$SECONDS
echo "== full build (build/, shared with the set-up's pip install), then unit, multi-process, Python and install tests"
tools/build.sh
echo "== full build: $(( SECONDS - phase_start )) s"
phase_start=$SECONDS
ctest --test-dir build --output-on-failure -j"$jobs"
echo "== ctest: $(( SECONDS - phase_start )) s; tools/test.sh in all: ${SECONDS} s"
