#!/usr/bin/env bash
# Installs whatever shardcast needs and is missing; safe to run again (it then does nothing).
#   Debian packages: compilers, CMake, GoogleTest, Google Benchmark, mimalloc, nlohmann-json, CLI11,
#                    xxHash, gloo headers (the torch wheel ships none), clang (fuzzing), ccache.
#   .venv/:          torch (the PyPI wheel users have), numpy, pytest, safetensors, transformers, accelerate.
# Environment: SHARDCAST_PYTHON picks the interpreter that creates .venv (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(build-essential cmake pkg-config ccache clang libclang-rt-14-dev
          libgtest-dev libgmock-dev libbenchmark-dev libmimalloc-dev nlohmann-json3-dev libcli11-dev
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
if ! .venv/bin/python -c "import torch, numpy, pytest, safetensors, transformers, accelerate" 2>/dev/null; then
  echo "setup: installing torch, numpy, pytest, safetensors, transformers, accelerate into .venv"
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q "torch>=2.4" numpy pytest safetensors transformers accelerate
fi
.venv/bin/python -c "import torch; print('setup: ok, torch', torch.__version__)"
