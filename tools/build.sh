#!/usr/bin/env bash
# Configures and builds shardcast in build/ (Release), tests and micro-benchmarks included. CUDA/NCCL
# code is built where the toolkit is.
#
# build/ is also where `pip install --no-build-isolation .` builds (pyproject.toml's build-dir, with the
# tests and benchmarks off): both use the same compiler, generator and flags, so whichever runs second
# compiles only what the other did not. The options a pip build set (SKBUILD*, tests/bench off) are put
# back here. Environment: SHARDCAST_JOBS (default: the number of cores), SHARDCAST_CMAKE_ARGS (more -D).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
jobs=${SHARDCAST_JOBS:-$(nproc)}
cmake -S . -B build -U 'SKBUILD*' -DCMAKE_BUILD_TYPE=Release -DSHARDCAST_BUILD_TESTS=ON -DSHARDCAST_BUILD_BENCH=ON \
  ${SHARDCAST_CMAKE_ARGS:-} >/dev/null
cmake --build build -j"$jobs"
