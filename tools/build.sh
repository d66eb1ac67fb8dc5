#!/usr/bin/env bash
# Configures and builds shardcast in build/ (Release). CUDA/NCCL code is built where the toolkit is.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"
jobs=${SHARDCAST_JOBS:-$(nproc)}
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release ${SHARDCAST_CMAKE_ARGS:-} >/dev/null
cmake --build build -j"$jobs"
