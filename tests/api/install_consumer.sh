#!/usr/bin/env bash
# shardcast installed for C++ programs (cmake/Package.cmake), used as a user uses it:
#   1. `cmake --install BUILD --prefix` a fresh directory, then move it (the prefix must be relocatable);
#   2. a project outside the tree (tests/api/installed/) finds it with find_package(shardcast), builds
#      tests/api/consumer.cc against it, and loads CHECKPOINT; the program must run on the moved
#      prefix's libshardcast;
#   3. without torch on CMAKE_PREFIX_PATH, and with a prefix built for another torch release, the
#      configure fails with shardcast's message naming the way out, not a later link or ABI failure.
# usage: install_consumer.sh SOURCE_ROOT BUILD_DIR PYTHON CHECKPOINT WORK_DIR
set -euo pipefail
root=$1 build=$2 python=$3 checkpoint=$4 work=$5
rm -rf "$work" && mkdir -p "$work"
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
torch_prefix=$("$python" -c 'import torch; print(torch.utils.cmake_prefix_path)')

cmake --install "$build" --prefix "$work/staged" >/dev/null
mv "$work/staged" "$work/prefix"
prefix=$work/prefix
for f in lib/libshardcast.so include/shardcast/runtime/load.h lib/cmake/shardcast/shardcast-config.cmake; do
  [ -e "$prefix/$f" ] || { echo "FAIL: the install has no $f"; exit 1; }
done
# The API only: no internal header is installed.
if [ -e "$prefix/include/shardcast/runtime/engine/stream.h" ]; then echo "FAIL: runtime/engine/stream.h was installed"; exit 1; fi

said() {  # said LOG REGEX: CMake wraps its messages; match on the log's words joined into one line
  tr '\n' ' ' <"$1" | tr -s ' ' | grep -qE "$2"
}
configure() {  # configure DIR PREFIX_PATH [more cmake args]
  local dir=$1 path=$2; shift 2
  cmake -S "$root/tests/api/installed" -B "$dir" -DCMAKE_BUILD_TYPE=Release "-DCMAKE_PREFIX_PATH=$path" \
    "-DCONSUMER_SOURCE=$root/tests/api/consumer.cc" "${launcher[@]}" "$@"
}
configure "$work/consumer" "$prefix;$torch_prefix" >"$work/configure.log" 2>&1 || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/consumer" -j2 >"$work/build.log" 2>&1 || { tail -n 40 "$work/build.log"; exit 1; }
lib=$(ldd "$work/consumer/consumer" | awk '$1 ~ /^libshardcast[.]so/ {print $3}')
case "$lib" in
  "$prefix"/lib/*) ;;
  *) echo "FAIL: the program loads libshardcast from '$lib', not from the installed prefix $prefix/lib"; exit 1 ;;
esac
"$work/consumer/consumer" "$checkpoint"

# No torch: shardcast's message, naming cmake_prefix_path.
if configure "$work/no-torch" "$prefix" -DCMAKE_DISABLE_FIND_PACKAGE_Torch=ON >"$work/no-torch.log" 2>&1; then
  echo "FAIL: configured without torch"; exit 1
fi
said "$work/no-torch.log" "needs torch .*torch[.]utils[.]cmake_prefix_path.* to CMAKE_PREFIX_PATH" ||
  { cat "$work/no-torch.log"; echo "FAIL: no torch, and not shardcast's message"; exit 1; }

# A prefix built for another torch release: refused at configure time, naming both releases.
cp -r "$prefix" "$work/other-torch"
sed -i 's/^set(shardcast_TORCH_VERSION "[^"]*")/set(shardcast_TORCH_VERSION "1.0.0")/' \
  "$work/other-torch/lib/cmake/shardcast/shardcast-config.cmake"
if configure "$work/mismatch" "$work/other-torch;$torch_prefix" >"$work/mismatch.log" 2>&1; then
  echo "FAIL: configured against a shardcast built for torch 1.0.0"; exit 1
fi
said "$work/mismatch.log" "built against torch 1.0.0 .* this build found torch [0-9.]+ .* rebuild shardcast" ||
  { cat "$work/mismatch.log"; echo "FAIL: a torch release mismatch, and not shardcast's message"; exit 1; }
echo "installed shardcast: found, built against, loaded from $lib; refusals clear"
