#!/usr/bin/env bash
# bench/gpu_dcp_load.sh: the GPU checks of shardcast.dcp in one device call, inside a deadline.
#
#   DEADLINE=540 SHARDCAST_DEB_DIR=.debs bench/gpu_dcp_load.sh OUTDIR
#
# On a machine with one NVIDIA GPU and a PyTorch (its python3): builds build-gpu/ against that torch
# (CUDA on; the Debian packages it lacks unpacked from SHARDCAST_DEB_DIR, see tools/gpu_check.sh), runs the
# GPU tests (tests/python/test_cuda.py: shardcast.dcp, from_pretrained's stream beside the build into GPU
# buffers, the CLI's cuda target and NCCL) and the staging ring's pinned test, then
# bench/bench_dcp_load.py --device cuda on the 1.91 GB Llama, warm: torch's reader at 1 and 4 threads,
# shardcast.dcp with its defaults (a CUDA target's: 8 readers over 8 page-locked slots of 8 MiB) and with 16
# readers over 16 slots of 8 MiB, and shardcast.load; each shardcast row prints its engine split, pin_seconds
# included (on an H200: 2.47x on 2026-11-26, 3.02x on 2026-11-27 with torch slower; 16 readers no better).
# Then, where the deadline leaves room, cold (torch t=4 against shardcast.dcp; on an H200 1.03x in 3 rounds,
# then 0.77x and 0.90x in 2), then the CPU target at W=4 over Gloo on the host's cores (torch t=4 against
# shardcast.dcp: 0.64x on an H200 host, before the readers committed their own pages and the commit beside
# them went to idle priority; 0.94x on the next start, 2026-11-27 evening, where cpu-init and cpu-cold did not
# fit the call: STEPS="cpu-init cpu-cold" is the next call's). Each launch took
# ~19 s on an H100 and ~22 s on an H200 (a warm run of 5 methods ~334 s there), so a call of DEADLINE=560
# ends before the cold run: run STEPS="cold cpu" as a second call at once. A held machine is released
# after ~30 s idle, and the next call starts a bare one (its build-gpu/ gone): have the second command
# ready. Each step is skipped once the deadline (seconds from the start; default 540) leaves it less than it
# needs. STEPS (default "tests warm cold cpu") picks the steps
# ("ring": the staging ring's tests alone; "cpu-init": the cpu step with the shards written before the load;
# "cpu-cold": the cpu step with the page cache evicted before each run; "peers": issue 34's whole set-up on
# this host's cores, bench_peers.py at W=4 CPU ranks (~6 min with the checkpoint's writing: a call of its
# own, STEPS=peers DEADLINE=580); "imports": bench/import_times.py, what each import before and beside
# from_pretrained's stream costs, 1 and 4 processes at once and -X importtime's slowest modules, run before
# the build and needing none of it (~30 s);
# the build is reused where build-gpu/ is still there); WARM_METHODS and CPU_METHODS replace the warm and cpu
# runs' lists. Exits 1 when a test failed (the benchmarks run all the same). Results:
# OUTDIR/*.json, *.txt.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
out=${1:?usage: bench/gpu_dcp_load.sh OUTDIR}
mkdir -p "$out"
t0=$(date +%s)
deadline=${DEADLINE:-540}
steps=" ${STEPS:-tests warm cold cpu} "
step() { [[ $steps == *" $1 "* ]]; }
for s in $steps; do
  case $s in ring | tests | warm | cold | cpu | cpu-init | cpu-cold | peers | imports) ;;
    *) echo "STEPS: unknown step '$s' (ring, tests, warm, cold, cpu, cpu-init, cpu-cold, peers, imports;" \
      "space-separated)"
      exit 2 ;;
  esac
done
left() { echo $((deadline - ($(date +%s) - t0))); }
at() { echo "== $* at $(($(date +%s) - t0)) s"; }
export PYTHONUNBUFFERED=1 PATH=/usr/local/cuda/bin:$PATH
build=$PWD/build-gpu
if [ -n "${SHARDCAST_DEB_DIR:-}" ]; then
  sysroot=$build/sysroot lib=$build/sysroot/usr/lib/x86_64-linux-gnu
  mkdir -p "$sysroot"
  for d in "$SHARDCAST_DEB_DIR"/*.deb; do dpkg-deb -x "$d" "$sysroot"; done
  export CMAKE_PREFIX_PATH=$sysroot/usr CPATH=$sysroot/usr/include LIBRARY_PATH=$lib LD_LIBRARY_PATH=$lib
fi
{ nvidia-smi -L; grep -c ^processor /proc/cpuinfo; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"; } 2>&1 | tee "$out/machine.txt"
if step imports; then  # CUDA_VISIBLE_DEVICES= as for the peers step's CPU ranks
  for n in 1 4; do
    CUDA_VISIBLE_DEVICES= timeout 200 python3 bench/import_times.py --procs $n --importtime $((n == 1 ? 30 : 0)) \
      2>&1 | tee -a "$out/imports.txt"
  done
  at imports
fi
tests=()  # core_test only where a step runs it (the staging ring's tests)
{ step tests || step ring; } && tests=(core_test)
gen=()  # the generator of a build-gpu/ already there (tools/gpu_check.sh makes one with Unix Makefiles)
[ -f "$build/CMakeCache.txt" ] || { command -v ninja >/dev/null && gen=(-G Ninja); }
cmake -S . -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DSHARDCAST_PYTHON="$(command -v python3)" -DSHARDCAST_CUDA=ON \
  -DSHARDCAST_BUILD_TESTS=ON -DSHARDCAST_BUILD_BENCH=OFF >"$out/build.log" 2>&1 &&
  cmake --build "$build" -j"$(grep -c ^processor /proc/cpuinfo)" --target shardcast _shardcast shardcast_python_package "${tests[@]}" \
    >>"$out/build.log" 2>&1 || { grep -m5 -A8 -E "error|CMake Error" "$out/build.log"; exit 1; }
at built
export SHARDCAST_BUILD_DIR=$build PYTHONPATH=$build/python OMP_NUM_THREADS=1
rc=0
if step tests || step ring; then
  if ! "$build/tests/core_test" --gtest_filter='StagingRing*' >"$out/ring.txt" 2>&1 ||
    ! grep -q '^\[  PASSED  \] [1-9]' "$out/ring.txt" || grep -q '^\[  FAILED  \]' "$out/ring.txt"; then
    echo "the staging ring's tests failed or none ran:"
    tail -5 "$out/ring.txt"
    rc=1
  fi
  tail -1 "$out/ring.txt"
fi
if step tests; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_cuda.py \
    >"$out/test_cuda_full.txt" 2>&1 || rc=1  # whole: a failure's rank logs are in its assertion
  tail -5 "$out/test_cuda_full.txt" | tee "$out/test_dcp_cuda.txt"
  at tested
fi
bench() {  # bench NAME MIN ARGS...: one bench_dcp_load run, if the deadline leaves it MIN seconds (NAME.partial.json
  local name=$1 least=$2 room=$(($(left) - 10))  # after each round: a run cut short leaves its rounds there)
  shift 2
  ((room >= least)) || { echo "skipped $name: $room s left, it needs ~$least"; return; }
  timeout "$room" python3 bench/bench_dcp_load.py --device cuda --world-size 1 --layers 16 --out "$out/$name.json" "$@" 2>&1 |
    grep -v Warning | tail -14
  at "$name"
}
warm=${WARM_METHODS:-torch-t1,torch-t4,shardcast-dcp,shardcast-dcp@cs=8M@sl=16@rt=16,shardcast-load}
needs() {  # needs METHODS SECONDS: the least room for 3 rounds of METHODS (comma-separated), SECONDS a launch
  local commas=${1//[^,]/}
  echo $((3 * $2 * (${#commas} + 1) + 10))
}
step warm && bench dcp-load-16L-cuda-warm "$(needs "$warm" 22)" --repeat 3 --methods "$warm"
step cold && bench dcp-load-16L-cuda-cold 170 --repeat 3 --cold --methods torch-t4,shardcast-dcp
# The CPU target at W=4 on this host's cores (the dev VM has 2; its warm ratio is bound by them there).
# On an H200 host's 16 cores this was 0.64x (2026-11-27). dcp-floor is DCP's own work around any reader;
# CPU_METHODS=torch-t4,shardcast-dcp,dcp-floor,shardcast-dcp@rt=2 (or @pr=0, @ra=0) asks which part is slow
# (~17 s a launch).
cpu=${CPU_METHODS:-torch-t4,shardcast-dcp,dcp-floor}
step cpu && bench dcp-load-16L-cpu-w4-warm "$(needs "$cpu" 17)" --device cpu --world-size 4 --repeat 3 \
  --methods "$cpu"
# The same with every shard written before the load (torchtitan's order: to_empty, init_weights, load): no
# page is faulted or committed in the timed call, so what is left is the copy and the agreement.
step cpu-init && bench dcp-load-16L-cpu-w4-warm-init "$(needs "$cpu" 17)" --device cpu --world-size 4 \
  --repeat 3 --init --methods "$cpu"
# The same cold: every file evicted from the page cache before each run.
step cpu-cold && bench dcp-load-16L-cpu-w4-cold "$(needs "$cpu" 20)" --device cpu --world-size 4 \
  --repeat 3 --cold --methods "$cpu"
# Issue 34's whole set-up on this host's cores: 6.38 GB Qwen3-MoE (written here first, ~1 min), W=4 CPU ranks
# over Gloo (CUDA_VISIBLE_DEVICES= so that transformers does not put four ranks on one GPU), warm:
# transformers' distributed_config against from_pretrained's default (beside the build where a rank has two
# cores, as here) and the load after the build; a run cut short leaves its rounds in
# peers-40L-w4-warm.json.partial.json.
peers=${PEERS_METHODS:-transformers,shardcast-from-pretrained-default,shardcast-from-pretrained-after}
if step peers; then
  room=$(($(left) - 10)) least=$(($(needs "$peers" 40) + 60))  # ~60 s to write the checkpoint, ~40 s a launch
  if ((room >= least)); then
    CUDA_VISIBLE_DEVICES= timeout "$room" python3 bench/bench_peers.py --world-size 4 --layers 40 --repeat 3 \
      --methods "$peers" --out "$out/peers-40L-w4-warm.json" 2>&1 | grep -v Warning | tail -24
    at peers
  else
    echo "skipped peers: $room s left, it needs ~$least"
  fi
fi
at done
exit $rc
