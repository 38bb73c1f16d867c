#!/usr/bin/env bash
# Builds tpsim (installing missing dependencies) and runs the test suite with CTest.
#   tools/test.sh                         every test: unit, world, sim, core and props labels
#   tools/test.sh --sanitize=thread -L sim   the sim tests under ThreadSanitizer
#   tools/test.sh -- -DTPSIM_NATIVE=OFF       every test of a portable build (as CI runs it)
# Arguments other than --sanitize go to ctest (-L LABEL, -R REGEX, ...); those after -- go to
# CMake's configure step (tools/build.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

sanitize_args=()
ctest_args=()
cmake_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --sanitize=*) sanitize_args+=("$1") ;;
    --) shift; cmake_args+=("$@"); break ;;
    *) ctest_args+=("$1") ;;
  esac
  shift
done
tools/install_deps.sh --tests
tools/build.sh --all "${sanitize_args[@]}" -- "${cmake_args[@]}"

build_dir=build
for a in "${sanitize_args[@]}"; do build_dir="build-$(echo "${a#--sanitize=}" | tr , -)"; done
export TSAN_OPTIONS="${TSAN_OPTIONS:-halt_on_error=1 second_deadlock_stack=1}"
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:detect_stack_use_after_return=0}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
cd "$build_dir"
ctest --output-on-failure --no-tests=error -j "$(nproc)" "${ctest_args[@]}"
