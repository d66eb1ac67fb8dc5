#!/usr/bin/env bash
# Installs whatever shardcast needs and is missing; safe to run again (it then does next to nothing).
#   Debian packages: compilers, CMake, GoogleTest, Google Benchmark, mimalloc, nlohmann-json, simdjson, CLI11,
#                    xxHash, gloo headers (the torch wheel ships none), clang (fuzzing), ccache.
#   .venv/:          the pinned Python stack of tools/constraints.txt (torch, transformers, accelerate,
#                    safetensors, huggingface_hub, numpy, pytest, scikit-build-core; torchtitan with --no-deps
#                    plus spmd_types and tyro, for tests/python/test_dcp_torchtitan.py), then shardcast itself
#                    with `pip install --no-build-isolation .` (built in build/, the directory
#                    tools/build.sh uses, so the tests' build reuses every object the install compiled).
# shardcast is reinstalled when HEAD moved since the last install (or with SHARDCAST_REINSTALL=1); the
# tests never use the install: they test build/ and the working tree.
# Environment: SHARDCAST_PYTHON picks the interpreter that creates .venv (default python3);
#              SHARDCAST_JOBS the build's parallelism (default: the number of cores).
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(build-essential cmake pkg-config ccache clang libclang-rt-14-dev
          libgtest-dev libgmock-dev libbenchmark-dev libmimalloc-dev nlohmann-json3-dev libsimdjson-dev libcli11-dev
          libxxhash-dev libgloo-dev python3-venv)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

py=${SHARDCAST_PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($py --version)"
  "$py" -m venv .venv
fi

# The pinned stack: pip runs only when an installed version differs from tools/constraints.txt.
wanted=(torch transformers accelerate safetensors huggingface_hub numpy pytest scikit-build-core)
pinned() {  # succeeds when every package named is installed at its tools/constraints.txt version
.venv/bin/python - "$@" <<'EOF'
import re, sys
from importlib.metadata import PackageNotFoundError, version
pins = {}
for line in open("tools/constraints.txt"):
    m = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s#;]+)", line)
    if m:
        pins[re.sub(r"[-_.]+", "-", m[1]).lower()] = m[2]
for name in sys.argv[1:]:
    try:
        have = version(name)
    except PackageNotFoundError:
        sys.exit(f"setup: {name} is missing")
    want = pins.get(re.sub(r"[-_.]+", "-", name).lower())
    if want and have.split("+")[0] != want.split("+")[0]:
        sys.exit(f"setup: {name} {have} is installed, tools/constraints.txt pins {want}")
EOF
}
if ! pinned "${wanted[@]}"; then
  echo "setup: installing ${wanted[*]} into .venv (pinned by tools/constraints.txt)"
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -c tools/constraints.txt "${wanted[@]}"
fi

# torchtitan, for tests/python/test_dcp_torchtitan.py: --no-deps (its declared training stack is not
# imported by its models, parallelize_* and HF loading), plus the two packages that code imports.
titan_deps=(spmd_types tyro)
if ! pinned torchtitan "${titan_deps[@]}"; then
  echo "setup: installing torchtitan (--no-deps) and ${titan_deps[*]} into .venv (pinned by tools/constraints.txt)"
  .venv/bin/pip install -q -c tools/constraints.txt "${titan_deps[@]}"
  .venv/bin/pip install -q --no-deps -c tools/constraints.txt torchtitan
fi

# shardcast itself, the way PyTorch extensions are installed: against the torch just installed.
head=$(git rev-parse HEAD 2>/dev/null || echo none)
stamp=.venv/.shardcast-installed
if [ "${SHARDCAST_REINSTALL:-0}" = 1 ] || [ "$(cat "$stamp" 2>/dev/null)" != "$head" ] \
   || ! (cd / && "$OLDPWD/.venv/bin/python" -c "import shardcast" 2>/dev/null); then
  echo "setup: pip install --no-build-isolation . (into .venv, built in build/)"
  [ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"
  export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
  log=$(mktemp)
  if ! CMAKE_BUILD_PARALLEL_LEVEL=${SHARDCAST_JOBS:-$(nproc)} \
       .venv/bin/pip install --no-build-isolation --no-deps . >"$log" 2>&1; then
    # The first error (a missing package is one line naming what to apt install), then the tail.
    grep -m1 -A3 -E "shardcast needs|CMake Error|error:" "$log" || true
    tail -n 30 "$log"
    rm -f "$log"
    exit 1
  fi
  rm -f "$log"
  echo "$head" >"$stamp"
fi
.venv/bin/python -c "import torch, shardcast; print('setup: ok, torch', torch.__version__, '+ shardcast', shardcast.__file__)"
