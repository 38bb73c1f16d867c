#!/usr/bin/env bash
# Installs missing dependencies, configures and builds tpsim.
#   tools/build.sh                      Release build of the tpsim CLI (and the Python module) in build/
#   tools/build.sh --all                every target: the CLI, the unit tests and the property suite
#   tools/build.sh --sanitize=thread    ThreadSanitizer build in build-thread/
#   tools/build.sh --sanitize=address,undefined   ASan+UBSan build in build-address-undefined/
# Extra arguments after -- go to CMake's configure step (e.g. -- -DTPSIM_GPU=OFF, or
# -- -DTPSIM_NATIVE=OFF for binaries that run on any CPU of the architecture, not only this one's kind).
set -euo pipefail
cd "$(dirname "$0")/.."

sanitize=""
targets=(--target tpsim)  # README's first command needs only the CLI; the tests are most of the build
cmake_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --sanitize=*) sanitize="${1#--sanitize=}" ;;
    --all) targets=() ;;
    --) shift; cmake_args+=("$@"); break ;;
    *) echo "tools/build.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift
done

tools/install_deps.sh

build_dir=build
build_type=Release
if [ -n "$sanitize" ]; then
  build_dir="build-${sanitize//,/-}"
  build_type=RelWithDebInfo
fi
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE="$build_type" -DTPSIM_SANITIZE="$sanitize" \
  "${cmake_args[@]}" >"$build_dir.configure.log" 2>&1 || { cat "$build_dir.configure.log"; exit 1; }
grep '^-- tpsim:' "$build_dir.configure.log" || true
# The Python module too where it is configured (build/tools/python, for PYTHONPATH).
if [ ${#targets[@]} -gt 0 ] && grep -q '^-- tpsim: python module ON' "$build_dir.configure.log"; then
  targets+=(tpsim_python)
fi
cmake --build "$build_dir" -j "$(nproc)" "${targets[@]}"
