#!/usr/bin/env bash
# The GPU check: everything tpsim can only prove on a CUDA machine, in one run of under 6 minutes
# on one H200, for machines without a package registry.
#   tools/gpu_deps.sh              on a machine with apt, once: fetches .gpu-deps (carry it along)
#   tools/gpu_check.sh LOGDIR      on the GPU machine: builds in build-gpu/ (or reuses binaries
#                                  already there), then probes, tests, runs and benchmarks
# Every step writes LOGDIR/<step>.log; the summary table comes last and is also LOGDIR/summary.txt.
# Exit status: 0 when every step that ran passed, 1 otherwise, 2 for a usage error.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

[ $# -eq 1 ] || { echo "usage: tools/gpu_check.sh LOGDIR" >&2; exit 2; }
logs=$1
mkdir -p "$logs" || exit 2
logs=$(cd "$logs" && pwd)
: >"$logs/summary.txt"
started=$(date +%s)
failures=0
rows=()

# step NAME LIMIT_SECONDS COMMAND...: runs COMMAND with a time limit, logs it, records one row.
step() {
  local name=$1 limit=$2
  shift 2
  local t0 status rc
  t0=$(date +%s.%N)
  timeout --kill-after=10 "$limit" "$@" >"$logs/$name.log" 2>&1
  rc=$?
  case $rc in
    0) status=PASS ;;
    124 | 137) status="FAIL (over ${limit}s)"; failures=$((failures + 1)) ;;
    *) status="FAIL (exit $rc)"; failures=$((failures + 1)) ;;
  esac
  rows+=("$(printf '%-28s %-18s %7.1f' "$name" "$status" "$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { print b - a }')")")
  echo "tpsim gpu check: $name: $status"
  return $rc
}
skip() { rows+=("$(printf '%-28s %-18s %7s  %s' "$1" SKIP - "$2")"); echo "tpsim gpu check: $1: SKIP ($2)"; }

# ---- What this machine brings ---------------------------------------------------------------------
deps="$root/.gpu-deps/root"
if [ ! -d "$deps" ] && [ -f "$root/.gpu-deps/root.tar.xz" ]; then
  mkdir -p "$deps" && tar -C "$deps" -xJf "$root/.gpu-deps/root.tar.xz"
fi
prefix_path=""
[ -d "$deps/usr" ] && prefix_path="$deps/usr" && export LD_LIBRARY_PATH="$deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
# NCCL: NCCL_ROOT, the CUDA toolkit, or PyTorch's nvidia-nccl package (whose library has no
# unversioned libnccl.so for CMake to find: a shim folder provides one).
nccl_root=${NCCL_ROOT:-}
if [ -z "$nccl_root" ] && ! ls /usr/local/cuda/lib64/libnccl.so* >/dev/null 2>&1; then
  pkg=$(python3 -c 'import nvidia.nccl as m; print(m.__path__[0])' 2>/dev/null || true)
  if [ -n "$pkg" ] && [ -f "$pkg/include/nccl.h" ]; then
    nccl_root="$root/build-gpu/nccl-shim"
    mkdir -p "$nccl_root/lib"
    ln -sfn "$pkg/include" "$nccl_root/include"
    for f in "$pkg"/lib/libnccl.so*; do ln -sf "$f" "$nccl_root/lib/$(basename "$f")"; done
    ln -sf "$(ls "$pkg"/lib/libnccl.so* | head -1)" "$nccl_root/lib/libnccl.so"
    export LD_LIBRARY_PATH="$pkg/lib:$LD_LIBRARY_PATH"
  fi
fi
{
  echo "date: $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 || echo "nvidia-smi: not found"
  nvcc --version 2>&1 | tail -2
  echo "cmake: $(cmake --version | head -1); ninja: $(ninja --version); cxx: $(c++ --version | head -1)"
  echo "deps: ${prefix_path:-none (.gpu-deps missing: run tools/gpu_deps.sh where apt works)}; NCCL_ROOT: ${nccl_root:-default}"
} >"$logs/machine.log" 2>&1
cat "$logs/machine.log"

# ---- Build ----------------------------------------------------------------------------------------
bin="$root/build-gpu"
if [ -x "$bin/tools/tpsim" ] && [ -x "$bin/props/tpsim_props" ]; then
  skip build "binaries already in build-gpu/"
else
  step configure 120 cmake -S "$root" -B "$bin" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTPSIM_GPU=ON \
    ${prefix_path:+-DCMAKE_PREFIX_PATH="$prefix_path"} ${nccl_root:+-DNCCL_ROOT="$nccl_root"}
  # What the steps below run; the simulator's own suites ran in CI already.
  step build 240 cmake --build "$bin" -j "$(nproc)" --target tpsim tpsim_props tpsim_gpu_host_tests \
    tpsim_gpu_device_tests tpsim_gpu_world_tests tpsim_backends_tests tpsim_tools_tests || true
fi
tpsim="$bin/tools/tpsim"

# ---- Device, tests, runs ----------------------------------------------------------------------------
if [ -x "$tpsim" ]; then
  step devices 30 "$tpsim" devices && cat "$logs/devices.log"
  step ctest-gpu 180 ctest --test-dir "$bin" -L gpu --output-on-failure -j 4
  step ctest-host 90 ctest --test-dir "$bin" -L 'backends|tools' -j "$(nproc)"
  # DeviceFabric against the simulator's bound on whole layers, T = 2, 4, 8, 16 on one GPU.
  for t in 2 4 8 16; do
    step "fabric-mlp-tp$t" 60 env TPSIM_GPU_TRANSPORT=fabric "$tpsim" run --backend gpu --layer mlp --tp "$t" \
      --sequence-parallel --bias --seq 64 --batch 4 --in-features 256 --ffn-hidden 1024 --dtype bf16
  done
  step fabric-tp8-gtp2-column 60 env TPSIM_GPU_TRANSPORT=fabric "$tpsim" run --backend gpu --layer column --tp 8 \
    --gtp-remat 2 --sequence-parallel --bias --seq 32 --batch 4 --in-features 128 --out-features 512
  step fabric-embedding-tp4 60 env TPSIM_GPU_TRANSPORT=fabric "$tpsim" run --backend gpu --layer embedding --tp 4 \
    --vocab 1024 --out-features 64 --seq 32 --batch 4
  step nccl-one-rank 60 env TPSIM_GPU_TRANSPORT=nccl "$tpsim" run --backend gpu --layer column --tp 1 --bias
  step demo-gpu 60 "$tpsim" demo --backend gpu
  # The property suite's cross-backend laws, at a reduced budget.
  step props-cross-backend 120 env RC_PARAMS="max_success=25" "$bin/props/tpsim_props" \
    --gtest_filter='CrossBackend.*:Backends.*'
  if command -v compute-sanitizer >/dev/null; then
    step compute-sanitizer 120 compute-sanitizer --tool memcheck --error-exitcode 9 "$tpsim" run --backend gpu \
      --layer mlp --tp 2 --sequence-parallel --bias --seq 8 --batch 2 --in-features 32 --ffn-hidden 64
  else
    skip compute-sanitizer "not installed"
  fi
  step bench-gpu 150 "$tpsim" bench --backend gpu
  grep -E '^[^#]' "$logs/bench-gpu.log" | head -40
else
  skip tests "no tpsim binary (the build failed: see $logs/build.log)"
fi

# ---- Summary --------------------------------------------------------------------------------------
{
  echo
  echo "# tpsim gpu check: $(( $(date +%s) - started )) s, $failures failed; logs in $logs"
  printf '%-28s %-18s %7s\n' step status seconds
  printf '%s\n' "${rows[@]}"
} | tee "$logs/summary.txt"
[ "$failures" -eq 0 ]
