#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz/) with clang, ASan and UBSan in build-fuzz/ and fuzzes
# each for SECONDS (default 60) from its checked-in seeds (tests/fuzz/corpus/TARGET); new inputs
# go to build-fuzz/corpus/TARGET. Exits 1 at the first crash and says where its input is.
#   tools/fuzz.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-60}"
[[ "$seconds" =~ ^[1-9][0-9]*$ ]] || { echo "tools/fuzz.sh: expected SECONDS >= 1, got '$seconds'" >&2; exit 2; }
cxx=$(command -v clang++-14 || command -v clang++) || { echo "tools/fuzz.sh: needs clang++ (apt install clang-14 libclang-rt-14-dev)" >&2; exit 2; }

tools/install_deps.sh
cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER="$cxx" -DTPSIM_FUZZ=ON \
  -DTPSIM_SANITIZE=address,undefined -DTPSIM_TESTS=OFF -DTPSIM_GPU=OFF -DTPSIM_NATIVE=OFF \
  >build-fuzz.configure.log 2>&1 || { cat build-fuzz.configure.log; exit 1; }
targets=()  # every tests/fuzz/NAME_fuzz.cc, built as tpsim_fuzz_NAME
for source in tests/fuzz/*_fuzz.cc; do
  name="${source##*/}"
  targets+=("${name%_fuzz.cc}")
done
cmake --build build-fuzz -j "$(nproc)" --target "${targets[@]/#/tpsim_fuzz_}"

export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1}"
mkdir -p build-fuzz/crashes
for target in "${targets[@]}"; do
  mkdir -p "build-fuzz/corpus/$target"
  args=(-max_total_time="$seconds" -print_final_stats=1 -artifact_prefix="build-fuzz/crashes/$target-")
  [ -f "tests/fuzz/$target.dict" ] && args+=(-dict="tests/fuzz/$target.dict")
  log="build-fuzz/$target.log"
  if ! "build-fuzz/tests/fuzz/tpsim_fuzz_$target" "${args[@]}" "build-fuzz/corpus/$target" \
      "tests/fuzz/corpus/$target" >"$log" 2>&1; then
    tail -n 40 "$log"
    crash=$(ls -t build-fuzz/crashes/"$target"-* 2>/dev/null | head -n 1 || true)
    echo "tools/fuzz.sh: tpsim_fuzz_$target failed; input: ${crash:-none written, see $log}" >&2
    echo "  replay: build-fuzz/tests/fuzz/tpsim_fuzz_$target ${crash:-FILE}" >&2
    echo "  fix it, then add the input to tests/fuzz/corpus/$target/" >&2
    exit 1
  fi
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log")
  echo "tpsim_fuzz_$target: ${runs:-?} inputs in ${seconds}s (${rate:-?}/s), no crash"
done
