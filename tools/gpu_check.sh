#!/usr/bin/env bash
# tools/gpu_check.sh: GPU readiness in one command, on a machine with one (or more) NVIDIA GPUs.
#
#   1. python   the first of SHARDCAST_PYTHON, .venv/bin/python, python3 that imports torch (never installs it)
#   2. device   torch.cuda.is_available(), or "no CUDA device" and exit 1 before anything else runs
#   3. deps     Debian packages the build needs (apt-get, where it can); Python packages the tests need
#               and lack, pip-installed into build-gpu/venv layered over that Python (torch pinned to its own)
#   4. build    build-gpu/ against that torch with SHARDCAST_CUDA=ON: CUDA and NCCL compiled in, or it stops
#   5. tests    the C++ CUDA tests (pinned staging, cuda/pinned targets), tests/python/test_cuda.py,
#               test_pinned.py and test_materialize.py (the device follows the model: a CUDA mesh loads
#               into cuda:LOCAL_RANK, a CPU target there is refused, from_pretrained defaults to CUDA);
#               their skips count as failures here
#   6. loads    the embedded checkpoint (configs/tiny-moe.json, ~250 MB) with --target cuda, --target pinned,
#               and --target cuda --backend nccl over every GPU; each verified by xxHash on every rank
#   7. bench    pinned host-to-device: torch copy_ (what the cuda target does per chunk) against cudaMemcpy
#               from the same pinned buffer (bench/bench_h2d.py), and each load's GB/s per GPU
#   8. table    one Markdown table of all of it; exit 0 only when every row is ok
#
# Runs unchanged on a fresh GPU box with the repo tree and a PyTorch (system or venv), no .venv needed.
# Environment: SHARDCAST_PYTHON, SHARDCAST_JOBS (default: the number of cores), SHARDCAST_GPU_BUILD
# (default build-gpu), SHARDCAST_GPU_LAYERS (layers of tiny-moe to load; default all), SHARDCAST_CMAKE_ARGS
# (more -D, e.g. -DCUDAToolkit_ROOT=...), SHARDCAST_DEB_DIR (a folder of Debian .deb files for a machine with
# no package mirror: unpacked into build-gpu/sysroot, not installed, and searched first by the build; fill it
# on a Debian 12 machine with `apt-get download libcli11-dev libmimalloc-dev libmimalloc2.0 libxxhash-dev
# libxxhash0 libgloo-dev libgtest-dev libgmock-dev googletest libsimdjson-dev libsimdjson14`).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
root=$PWD
build=${SHARDCAST_GPU_BUILD:-$root/build-gpu}
jobs=${SHARDCAST_JOBS:-$(nproc)}
work=$build/gpu-check
mkdir -p "$work"
log=$work/log
: >"$log"
rows=()
failed=0
row() { rows+=("| $1 | $2 | $3 |"); [ "$2" = ok ] || failed=1; }
say() { echo "gpu_check: $*"; }
die() { say "$*"; exit 1; }

# ---- 1. a Python with torch ------------------------------------------------------------------------
py=""
for cand in ${SHARDCAST_PYTHON:-} "$root/.venv/bin/python" python3 python; do
  if command -v "$cand" >/dev/null 2>&1 && "$cand" -c "import torch" >/dev/null 2>&1; then
    py=$(command -v "$cand")
    break
  fi
done
[ -n "$py" ] || die "no Python with torch (tried ${SHARDCAST_PYTHON:-} .venv/bin/python python3); install the machine's PyTorch: this script never installs torch"
torch_info=$("$py" -c "import torch; print(torch.__version__, torch.version.cuda or 'none')")
read -r torch_version torch_cuda <<<"$torch_info"
say "python $py, torch $torch_version (CUDA $torch_cuda)"

# ---- 2. a CUDA device, before anything else --------------------------------------------------------
if ! devices=$("$py" - <<'EOF' 2>>"$log"
import torch
if not torch.cuda.is_available():
    raise SystemExit(1)
names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
try:
    v = torch.cuda.nccl.version()  # a tuple in recent torch, an int in older ones
    nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
except Exception:  # noqa: BLE001 -- a torch without NCCL: the build says so later
    nccl = "none"
print(len(names), nccl, "; ".join(names))
EOF
); then
  smi=$( (nvidia-smi -L 2>&1 || true) | head -n 1)
  command -v nvidia-smi >/dev/null 2>&1 || smi="not installed"
  die "no CUDA device: torch $torch_version (built for CUDA $torch_cuda) says torch.cuda.is_available() is False; nvidia-smi: ${smi:-not found}"
fi
read -r ngpu nccl_version gpu_names <<<"$devices"
say "$ngpu GPU(s): $gpu_names; NCCL $nccl_version"
[ "$torch_cuda" != none ] || die "torch $torch_version is a CPU build: no CUDA device can be used"

# ---- 3. what the build and the tests need ------------------------------------------------------------
packages=(build-essential cmake pkg-config libgtest-dev libgmock-dev libmimalloc-dev nlohmann-json3-dev
          libcli11-dev libxxhash-dev libgloo-dev python3-dev)
if [ -n "${SHARDCAST_DEB_DIR:-}" ]; then
  # No mirror to install from: unpack the given packages into a prefix of our own (never into /, where a
  # Debian package could replace the distribution's files) that the build searches before the system.
  sysroot=$build/sysroot
  debs=("$SHARDCAST_DEB_DIR"/*.deb)
  [ -e "${debs[0]}" ] || die "SHARDCAST_DEB_DIR=$SHARDCAST_DEB_DIR holds no .deb files"
  rm -rf "$sysroot" && mkdir -p "$sysroot"
  for d in "${debs[@]}"; do
    dpkg-deb -x "$d" "$sysroot" >>"$log" 2>&1 || die "cannot unpack $d (log: $log)"
  done
  export CMAKE_PREFIX_PATH="$sysroot/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  # Their pkg-config files name /usr (xxhash's include dir, say): the compiler, the linker and the loader
  # search the unpacked tree too (an H200 image without libxxhash-dev failed on xxhash.h without this).
  lib=$sysroot/usr/lib/x86_64-linux-gnu
  export CPATH="$sysroot/usr/include${CPATH:+:$CPATH}" LIBRARY_PATH="$lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
  export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  say "unpacked ${#debs[@]} packages from $SHARDCAST_DEB_DIR into $sysroot"
elif command -v dpkg-query >/dev/null 2>&1; then
  missing=()
  for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    say "installing Debian packages: ${missing[*]}"
    sudo_cmd=""
    [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
    if ! { $sudo_cmd apt-get update -q && DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -q \
           --no-install-recommends "${missing[@]}"; } >>"$log" 2>&1; then
      die "missing Debian packages the build needs, and apt-get could not install them: ${missing[*]} (log: $log); with no package mirror, carry their .deb files and set SHARDCAST_DEB_DIR"
    fi
  fi
fi
command -v cmake >/dev/null 2>&1 || die "no cmake on PATH"
[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"
# The CUDA host code (pinned staging, device copies, the NCCL communicator) needs the toolkit's headers.
[ -d /usr/local/cuda ] || command -v nvcc >/dev/null 2>&1 ||
  die "no CUDA toolkit (/usr/local/cuda or nvcc on PATH): install CUDA $torch_cuda's toolkit, or set CUDAToolkit_ROOT through SHARDCAST_CMAKE_ARGS"

wanted=(pytest safetensors numpy transformers accelerate huggingface_hub)
lacking=$("$py" - "${wanted[@]}" <<'EOF'
import importlib.util, sys
print(" ".join(n for n in sys.argv[1:] if importlib.util.find_spec(n) is None))
EOF
)
if [ -n "$lacking" ]; then
  say "the tests need $lacking: installing into $build/venv (over $py's packages; torch stays $torch_version)"
  if [ ! -x "$build/venv/bin/python" ]; then
    # Layered over $py's own packages through a .pth file (--system-site-packages would expose the base
    # interpreter's, not a venv's): its torch is the one imported, and what pip adds shadows nothing of it.
    "$py" -m venv "$build/venv" >>"$log" 2>&1 || die "cannot create $build/venv (apt install python3-venv?) (log: $log)"
    site=$("$build/venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    "$py" -c "import sys; print('\n'.join(p for p in sys.path if p.endswith(('site-packages', 'dist-packages'))))" \
      >"$site/_shardcast_base.pth"
  fi
  echo "torch==$torch_version" >"$work/constraints.txt"
  # shellcheck disable=SC2086
  "$build/venv/bin/python" -m pip install -q -c "$work/constraints.txt" ${lacking//huggingface_hub/huggingface-hub} \
    >>"$log" 2>&1 || die "pip could not install $lacking (no network?); install them for $py (log: $log)"
  py=$build/venv/bin/python
fi

# ---- 4. build against this torch ---------------------------------------------------------------------
say "building in $build (log: $log)"
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$root}
targets=(shardcast _shardcast shardcast_python_package allocators_test runtime_test core_test)
# shellcheck disable=SC2086
if cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DSHARDCAST_PYTHON="$py" -DSHARDCAST_CUDA=ON \
     -DSHARDCAST_BUILD_TESTS=ON -DSHARDCAST_BUILD_BENCH=OFF ${SHARDCAST_CMAKE_ARGS:-} >>"$log" 2>&1 &&
   cmake --build "$build" -j"$jobs" --target "${targets[@]}" >>"$log" 2>&1; then
  row "build (torch $torch_version, CUDA $torch_cuda, NCCL $nccl_version)" ok "$build"
else
  grep -m3 -E "shardcast needs|shardcast: SHARDCAST_CUDA|CMake Error|error:" "$log" | sed 's/^/  /'
  row "build (torch $torch_version, CUDA $torch_cuda, NCCL $nccl_version)" FAILED "see $log"
  printf '%s\n' "| check | result | detail |" "| --- | --- | --- |" "${rows[@]}"
  exit 1
fi
grep -q "define SHARDCAST_HAVE_CUDA 1" "$build/generated/shardcast_config.h" ||
  die "the build has no CUDA (see 'shardcast: building without CUDA' in $log)"
sc=$build/tools/shardcast

# ---- 5. tests ----------------------------------------------------------------------------------------
# gtests BINARY FILTER: passes when the filter ran at least one test and none failed (a filter that matches
# nothing exits 0, and once hid a renamed suite here).
gtests() {
  local o
  o=$("$build/tests/$1" --gtest_filter="$2" 2>&1)
  local rc=$?
  echo "$o" >>"$log"
  [ "$rc" = 0 ] && grep -q '^\[  PASSED  \] [1-9]' <<<"$o"
}
if gtests allocators_test 'Pinned.*' && gtests runtime_test 'Materializer.PinnedAndCuda*' &&
   gtests core_test 'StagingRingTest.Pinned*'; then
  row "C++ CUDA tests (pinned staging, cuda and pinned targets)" ok "allocators_test Pinned.*, runtime_test Materializer, core_test StagingRingTest.Pinned*"
else
  row "C++ CUDA tests (pinned staging, cuda and pinned targets)" FAILED "see $log"
fi
pytest_out=$work/pytest.txt
(SHARDCAST_BUILD_DIR=$build PYTHONPATH=$build/python OMP_NUM_THREADS=1 "$py" -m pytest -q -rs -p no:cacheprovider \
   tests/python/test_cuda.py tests/python/test_pinned.py tests/python/test_materialize.py) >"$pytest_out" 2>&1
pytest_rc=$?
cat "$pytest_out" >>"$log"
summary=$(grep -E "[0-9]+ (passed|failed|skipped|error)" "$pytest_out" | tail -n 1 | sed -E 's/=//g; s/ in [0-9.]+s.*//; s/^ +//')
# test_pinned's no-CUDA case skips on a GPU machine by design; any other skip means the GPU path did not run.
other_skips=$(grep -E "^SKIPPED" "$pytest_out" | grep -v "a CUDA device is here" | wc -l)
if [ $pytest_rc -eq 0 ] && [ "$other_skips" -eq 0 ]; then
  row "tests/python/test_cuda.py, test_pinned.py, test_materialize.py" ok "$summary"
else
  row "tests/python/test_cuda.py, test_pinned.py, test_materialize.py" FAILED "${summary:-no summary}; see $pytest_out"
fi

# ---- 6. loads of the embedded checkpoint, with their GB/s per GPU ---------------------------------------
ckpt=$work/tiny-moe
if [ ! -f "$ckpt/model.safetensors.index.json" ]; then
  layer_args=()
  [ -n "${SHARDCAST_GPU_LAYERS:-}" ] && layer_args=(--layers "$SHARDCAST_GPU_LAYERS")
  "$sc" synth --config configs/tiny-moe.json --out "$ckpt" --max-shard-size 64M --seed 1 "${layer_args[@]}" \
    >>"$log" 2>&1 || die "cannot synthesize $ckpt (log: $log)"
fi
gb=$(du -sb "$ckpt" | awk '{printf "%.2f", $1 / 1e9}')
load() {  # load LABEL NPROC ARGS...: one verified load; the row says GB/s per GPU (each rank's stored bytes / its seconds)
  local label=$1 n=$2
  shift 2
  local json=$work/load-${label//[^a-z0-9]/_}.json
  rm -f "$json"
  if "$sc" load --checkpoint "$ckpt" --nproc "$n" --verify --quiet --json "$json" "$@" >>"$log" 2>&1 && [ -s "$json" ]; then
    local detail
    detail=$("$py" - "$json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
ranks = r["ranks"]
ok = all(x["verify"] == "ok" for x in ranks)
per_gpu = [x["bytes_stored"] / x["seconds"] / 1e9 for x in ranks if x["seconds"] > 0]
print("ok" if ok else "FAILED", f"{r['target']} over {r['backend']}, {r['world_size']} rank(s): "
      f"{min(per_gpu):.2f}-{max(per_gpu):.2f} GB/s per GPU (stream {max(x['stream_seconds'] for x in ranks):.3f} s)"
      + ("" if ok else "; verify failed"))
EOF
)
    row "load --target $label ($gb GB)" "${detail%% *}" "${detail#* }"
  else
    row "load --target $label ($gb GB)" FAILED "$(grep -m1 "shardcast load" "$log" | cut -c1-160)"
  fi
}
load cuda 1 --target cuda
load pinned 1 --target pinned
load "cuda --backend nccl" "$ngpu" --target cuda --backend nccl

# ---- 7. pinned host-to-device against cudaMemcpy ----------------------------------------------------------
if h2d=$("$py" bench/bench_h2d.py --sizes 64M,1G 2>>"$log"); then
  while read -r line; do
    [ -n "$line" ] || continue
    read -r size copy raw ratio ok <<<"$("$py" -c "
import json, sys
r = json.loads(sys.argv[1])
print(f\"{r['bytes'] >> 20}MiB {r['torch_copy_gbps']:.2f} {r['cudamemcpy_gbps']:.2f} {r['ratio']:.2f} \"
      f\"{'ok' if r['torch_copy_ok'] and r['cudamemcpy_ok'] and r['pinned'] else 'FAILED'}\")" "$line")"
    row "pinned H2D $size: torch copy_ vs cudaMemcpy" "$ok" "$copy GB/s vs $raw GB/s ($ratio x)"
  done <<<"$h2d"
else
  row "pinned H2D: torch copy_ vs cudaMemcpy" FAILED "see $log"
fi

# ---- 8. the table ---------------------------------------------------------------------------------------
echo
echo "gpu_check on $gpu_names ($(date -u +%Y-%m-%d)), torch $torch_version, CUDA $torch_cuda, NCCL $nccl_version:"
echo
printf '%s\n' "| check | result | detail |" "| --- | --- | --- |" "${rows[@]}"
exit $failed
