#!/usr/bin/env bash
# tools/check_build_options.sh [--build]: configures every combination of the build options a packager
# uses, each in its own build-opt-NAME directory, and builds what is cheap:
#
#   name             options                                              built by default
#   default          (none)                                               configure only (tools/build.sh builds it)
#   pip              TESTS=OFF BENCH=OFF (what pip install builds)        the shardcast command and _shardcast
#   tests-no-bench   TESTS=ON BENCH=OFF                                   the shardcast command
#   bench-no-tests   TESTS=OFF BENCH=ON                                   the shardcast command
#   no-cuda          SHARDCAST_CUDA=OFF                                   the shardcast command and _shardcast
#   no-runtime       BUILD_RUNTIME=OFF (loaders/allocators only)          everything (no libtorch: cheap)
#   no-runtime-min   BUILD_RUNTIME=OFF TESTS=OFF BENCH=OFF                everything
#
# --build builds every combination completely. ccache (CCACHE_BASEDIR = the repository) makes the
# libtorch objects the pip and test builds share a cache hit, but each combination still links.
# Prints a table; exits non-zero if any combination failed. Environment: SHARDCAST_JOBS.
set -uo pipefail
cd "$(dirname "$0")/.."
[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
jobs=${SHARDCAST_JOBS:-$(nproc)}
full=0
[ "${1:-}" = --build ] && full=1

#        name             cmake options                                                          targets (default mode)
combos=("default         |                                                                        |"
        "pip             |-DSHARDCAST_BUILD_TESTS=OFF -DSHARDCAST_BUILD_BENCH=OFF                 |shardcast _shardcast"
        "tests-no-bench  |-DSHARDCAST_BUILD_TESTS=ON -DSHARDCAST_BUILD_BENCH=OFF                  |shardcast"
        "bench-no-tests  |-DSHARDCAST_BUILD_TESTS=OFF -DSHARDCAST_BUILD_BENCH=ON                  |shardcast"
        "no-cuda         |-DSHARDCAST_CUDA=OFF                                                    |shardcast _shardcast"
        "no-runtime      |-DSHARDCAST_BUILD_RUNTIME=OFF                                           |all"
        "no-runtime-min  |-DSHARDCAST_BUILD_RUNTIME=OFF -DSHARDCAST_BUILD_TESTS=OFF -DSHARDCAST_BUILD_BENCH=OFF|all")

rows=()
failed=0
for combo in "${combos[@]}"; do
  IFS='|' read -r name opts targets <<<"$combo"
  name=$(echo $name); opts=$(echo $opts); targets=$(echo $targets)
  ((full)) && targets=all
  dir=build-opt-$name   # beside build/, at its depth: ccache (CCACHE_BASEDIR) hits its objects
  mkdir -p "$dir"; log=$dir/check_build_options.log
  t0=$(date +%s)
  configure=ok; build="-"
  if ! cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=Release $opts >"$log" 2>&1; then
    configure=FAILED; build="not run"
  elif [ -n "$targets" ]; then
    build=ok
    for t in $targets; do
      if [ "$t" = all ]; then cmake --build "$dir" -j"$jobs" >>"$log" 2>&1 || build="FAILED ($t)"
      else cmake --build "$dir" -j"$jobs" --target "$t" >>"$log" 2>&1 || build="FAILED ($t)"; fi
    done
    [ "$build" = ok ] && build="ok ($targets)"
  fi
  [[ "$configure$build" == *FAILED* ]] && { failed=1; echo "== $name failed: $log"; grep -m5 -E "Error|error" "$log"; }
  rows+=("| $name | ${opts:-(defaults)} | $configure | $build | $(( $(date +%s) - t0 )) s |")
  echo "${rows[-1]}"
done
echo
echo "| combination | options | configure | build | time |"
echo "| --- | --- | --- | --- | --- |"
printf '%s\n' "${rows[@]}"
exit $failed
