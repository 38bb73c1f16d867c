#!/usr/bin/env bash
# Builds tpsim (installing missing dependencies) and runs the test suite with CTest.
#   tools/test.sh                         every test: unit, sim, core and props labels
#   tools/test.sh --sanitize=thread -L sim   the sim tests under ThreadSanitizer
# Arguments other than --sanitize go to ctest (-L LABEL, -R REGEX, ...).
set -euo pipefail
cd "$(dirname "$0")/.."

build_args=()
ctest_args=()
for a in "$@"; do
  case "$a" in
    --sanitize=*) build_args+=("$a") ;;
    *) ctest_args+=("$a") ;;
  esac
done
tools/build.sh "${build_args[@]}"

build_dir=build
for a in "${build_args[@]}"; do build_dir="build-$(echo "${a#--sanitize=}" | tr , -)"; done
export TSAN_OPTIONS="${TSAN_OPTIONS:-halt_on_error=1 second_deadlock_stack=1}"
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:detect_stack_use_after_return=0}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
cd "$build_dir"
ctest --output-on-failure --no-tests=error -j "$(nproc)" "${ctest_args[@]}"
