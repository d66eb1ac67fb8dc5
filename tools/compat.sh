#!/usr/bin/env bash
# tools/compat.sh TORCH_VERSION: builds shardcast against that torch and runs the Python tests, in a
# throwaway venv that is removed afterwards, and prints one row of the compatibility table.
#
#   torch:   the same version as .venv's is reused from .venv (the throwaway venv is layered over it);
#            any other is installed from a wheelhouse, downloaded there once and reused afterwards
#            (SHARDCAST_WHEELHOUSE, default ~/.cache/shardcast/wheels; ~3 GB per CUDA torch).
#   others:  transformers, accelerate, ... pinned as in tools/constraints.txt (torch's own dependencies
#            follow the torch asked for).
#   build:   `pip install --no-build-isolation .` with build-dir build-compat-VERSION (removed
#            afterwards; ccache keeps the objects for the next run).
#   tests:   tests/python against the installed package (no PYTHONPATH), the CLI tests with that
#            build's shardcast; less the reader/writer round trip, which needs tests/st_copy, a torch-free
#            C++ test tool the pip build does not build (tools/test.sh runs it).
# Supported: torch 2.6 (the first release whose torch.distributed.fsdp.fully_shard is public) to 2.15.
# Environment: SHARDCAST_PYTHON (base interpreter, default python3), SHARDCAST_JOBS, SHARDCAST_KEEP=1
#              (keep the venv and build dir), SHARDCAST_COMPAT_VENV=DIR (use and keep this venv: installing
#              a CUDA torch's ~3 GB of wheels takes minutes, so iterating on a fix reuses it),
#              SHARDCAST_COMPAT_PYTEST_ARGS (extra pytest arguments).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
version=${1:?usage: tools/compat.sh TORCH_VERSION (e.g. 2.6.0)}
py=${SHARDCAST_PYTHON:-python3}
jobs=${SHARDCAST_JOBS:-$(nproc)}
wheelhouse=${SHARDCAST_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/shardcast/wheels}
work=$(mktemp -d "${TMPDIR:-/tmp}/shardcast-compat-$version.XXXXXX")
venv=${SHARDCAST_COMPAT_VENV:-$work/venv}
build=$root/build-compat-$version   # beside build/, at its depth, so ccache (CCACHE_BASEDIR) can hit
log=$work/log
cleanup() {
  if [ "${SHARDCAST_KEEP:-0}" != 1 ]; then rm -rf "$work" "$build"
  else echo "compat: kept $work and $build"; fi
}
trap cleanup EXIT
start=$(date +%s)
elapsed() { local s=$(($(date +%s) - start)); printf '%dm%02ds' $((s / 60)) $((s % 60)); }

# Pins for everything but torch and what torch itself pins (CUDA wheels, triton, sympy).
constraints=$work/constraints.txt
grep -v -i -E '^(torch|triton|sympy|mpmath|nvidia-[^=]*|cuda-[^=]*)==' tools/constraints.txt >"$constraints"
deps=(transformers accelerate safetensors huggingface_hub numpy pytest scikit-build-core)

venv_torch=$(.venv/bin/python -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null || echo none)
have_torch=$("$venv/bin/python" -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null || echo none)
if [ "$have_torch" = "$version" ]; then
  echo "compat: reusing $venv (torch $version)"
elif [ "$venv_torch" = "$version" ]; then
  echo "compat: torch $version is .venv's: layering a throwaway venv over .venv"
  .venv/bin/python -m venv "$venv"
  site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  .venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" >"$site/_shardcast_base.pth"
  "$venv/bin/python" -c "import scikit_build_core" 2>/dev/null ||
    "$venv/bin/pip" install -q -c "$constraints" scikit-build-core
else
  echo "compat: torch $version into a throwaway venv (wheels from $wheelhouse)"
  mkdir -p "$wheelhouse"
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  # --no-compile: byte-compiling torch's thousands of files costs minutes and a throwaway venv nothing.
  if ! "$venv/bin/pip" install -q --no-compile --no-index --find-links "$wheelhouse" -c "$constraints" "torch==$version" "${deps[@]}" 2>/dev/null; then
    "$venv/bin/pip" download -q -d "$wheelhouse" -c "$constraints" "torch==$version" "${deps[@]}"
    "$venv/bin/pip" install -q --no-compile --no-index --find-links "$wheelhouse" -c "$constraints" "torch==$version" "${deps[@]}"
  fi
fi
pyver=$("$venv/bin/python" -c "import platform; print(platform.python_version())")
torchver=$("$venv/bin/python" -c "import torch; print(torch.__version__)")
echo "compat: python $pyver, torch $torchver; building (log: $log)"

[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$root}
build_ok=ok
if ! (cd "$work" && CMAKE_BUILD_PARALLEL_LEVEL=$jobs "$venv/bin/python" -m pip install --no-build-isolation --no-deps \
        -C "build-dir=$build" "$root") >"$log" 2>&1; then
  build_ok=FAILED
  grep -m5 -E "error|shardcast needs|CMake Error" "$log" || true
  tail -n 40 "$log"
fi
build_time=$(elapsed)

summary="not run"
if [ "$build_ok" = ok ]; then
  echo "compat: built in $build_time; running tests/python against the installed package"
  # No PYTHONPATH: `import shardcast` is the installed package. The CLI tests use this build's binary.
  set +e
  (cd "$work" && env -u PYTHONPATH SHARDCAST_BUILD_DIR="$build" OMP_NUM_THREADS=1 PATH="$venv/bin:$PATH" \
     timeout 1800 "$venv/bin/python" -m pytest -q -p no:cacheprovider -o addopts="" -rfE \
     -k "not test_reference_file_through_our_reader_and_writer" \
     ${SHARDCAST_COMPAT_PYTEST_ARGS:-} "$root/tests/python") 2>&1 | tee -a "$log" | tail -n 40
  set -e
  summary=$(grep -E "^(=+ )?[0-9]+ (passed|failed|skipped|error)" "$log" | tail -n 1 | sed -E 's/^=+ //; s/ in [0-9.]+s.*//; s/ =+$//')
fi
echo
echo "| torch | Python | build | tests | time |"
echo "| --- | --- | --- | --- | --- |"
echo "| $torchver | $pyver | $build_ok ($build_time) | ${summary:-no summary} | $(elapsed) |"
[ "$build_ok" = ok ] && ! grep -q -E "[0-9]+ (failed|error)" <<<"$summary"
