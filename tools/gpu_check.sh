#!/usr/bin/env bash
# The GPU check: everything tpsim can only prove on a CUDA machine, in one run of under 6 minutes
# on one H200, for machines without a package registry.
#   tools/gpu_deps.sh              on a machine with apt, once: fetches .gpu-deps (carry it along)
#   tools/gpu_check.sh LOGDIR      on the GPU machine: builds in build-gpu/ (or uses binaries
#                                  brought along), then probes, tests, runs and benchmarks
# Every step writes LOGDIR/<step>.log and adds its row to LOGDIR/summary.txt as it ends, so a run cut
# short still leaves its rows; the whole table is printed last. The steps share one time budget,
# TPSIM_GPU_CHECK_SECONDS (default 345): each step's limit shrinks to what is left, and steps that
# would start with under 15 s left are skipped. A second run on the same machine rebuilds only what
# changed. Exit status: 0 when every step ran (compute-sanitizer may be missing) and passed, 1 when
# one failed or was skipped for time, 2 for a usage error.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

[ $# -eq 1 ] || { echo "usage: tools/gpu_check.sh LOGDIR" >&2; exit 2; }
logs=$1
mkdir -p "$logs" || exit 2
logs=$(cd "$logs" && pwd)
budget=${TPSIM_GPU_CHECK_SECONDS:-345}
[[ $budget =~ ^[0-9]+$ ]] || { echo "TPSIM_GPU_CHECK_SECONDS: expected whole seconds, got '$budget'" >&2; exit 2; }
started=$(date +%s)
deadline=$((started + budget))
failures=0
late=0  # steps skipped for lack of time
rows=()
: >"$logs/summary.txt"

row() { rows+=("$1"); printf '%s\n' "$1" >>"$logs/summary.txt"; }
skip() { row "$(printf '%-28s %-18s %7s  %s' "$1" SKIP - "$2")"; echo "tpsim gpu check: $1: SKIP ($2)"; }

# step NAME LIMIT_SECONDS COMMAND...: runs COMMAND within LIMIT_SECONDS and what is left of the
# budget, logs it, records one row with the test counts its log shows.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((deadline - $(date +%s)))
  if [ "$left" -lt 15 ]; then
    skip "$name" "out of time (TPSIM_GPU_CHECK_SECONDS=$budget)"
    late=$((late + 1))
    return 125
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0 status rc
  t0=$(date +%s.%N)
  timeout --kill-after=10 "$limit" "$@" >"$logs/$name.log" 2>&1
  rc=$?
  case $rc in
    0) status=PASS ;;
    124 | 137) status="FAIL (over ${limit}s)"; failures=$((failures + 1)) ;;
    *) status="FAIL (exit $rc)"; failures=$((failures + 1)) ;;
  esac
  row "$(printf '%-28s %-18s %7.1f  %s' "$name" "$status" "$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { print b - a }')" "$(note "$name")")"
  echo "tpsim gpu check: $name: $status"
  return $rc
}

# What a step's log says in a few words: test counts, so that a suite that only skipped is not
# read as a pass.
note() {
  local log="$logs/$1.log"
  if grep -q 'tests passed' "$log" 2>/dev/null; then
    echo "$(grep -E '[0-9]+% tests passed' "$log" | tail -1 | sed 's/^ *//'); $(grep -cF '***Skipped' "$log") skipped"
  elif grep -q '^\[==========\]' "$log" 2>/dev/null; then
    # Per-test lines end in their time; the closing lists repeat the names without it.
    echo "$(grep -c '^\[       OK \]' "$log") passed, $(grep -cE '^\[  SKIPPED \] .* \([0-9]+ ms\)$' "$log") skipped, $(grep -cE '^\[  FAILED  \] .* \([0-9]+ ms\)$' "$log") failed"
  fi
}

# ---- What this machine brings ---------------------------------------------------------------------
deps="$root/.gpu-deps/root"
# Unpacked again whenever the archive is newer: tools/gpu_deps.sh may have added a package since.
if [ -f "$root/.gpu-deps/root.tar.xz" ] && { [ ! -d "$deps" ] || [ "$root/.gpu-deps/root.tar.xz" -nt "$deps" ]; }; then
  rm -rf "$deps" && mkdir -p "$deps" && tar -C "$deps" -xJf "$root/.gpu-deps/root.tar.xz" && touch "$deps"
fi
prefix_path=""
[ -d "$deps/usr" ] && prefix_path="$deps/usr" &&
  export LD_LIBRARY_PATH="$deps/usr/lib/x86_64-linux-gnu:$deps/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
# Open MPI: the machine's own mpirun, else the one .gpu-deps brings, relocated to where it lies
# (OPAL_PREFIX; PMIx and hwloc load their plugins from paths of their own). Its wrapper tells CMake
# where the headers and libraries are.
mpirun=$(command -v mpirun || true)
mpi_flags=()
if [ -z "$mpirun" ] && [ -x "$deps/usr/bin/mpirun.openmpi" ]; then
  mpirun="$deps/usr/bin/mpirun.openmpi"
  export OPAL_PREFIX="$deps/usr"
  export PMIX_MCA_mca_base_component_path="$deps/usr/lib/x86_64-linux-gnu/pmix2/lib/pmix"
  export HWLOC_PLUGINS_PATH="$deps/usr/lib/x86_64-linux-gnu/hwloc"
  export LD_LIBRARY_PATH="$deps/usr/lib/x86_64-linux-gnu/openmpi/lib:$LD_LIBRARY_PATH"
  mpi_flags=(-DMPI_CXX_COMPILER="$deps/usr/bin/mpicxx.openmpi")
fi
# Python's CUDA packages: where the toolkit lacks NCCL or cuBLASLt, the ones PyTorch brings.
python=${PYTHON:-python3}
pypkg() { "$python" -c "import $1 as m; print(m.__path__[0])" 2>/dev/null || true; }
# NCCL: NCCL_ROOT, the CUDA toolkit, or PyTorch's nvidia-nccl package (whose library has no
# unversioned libnccl.so for CMake to find: a shim folder provides one).
nccl_root=${NCCL_ROOT:-}
if [ -z "$nccl_root" ] && ! ls /usr/local/cuda/lib64/libnccl.so* >/dev/null 2>&1; then
  pkg=$(pypkg nvidia.nccl)
  if [ -n "$pkg" ] && [ -f "$pkg/include/nccl.h" ]; then
    nccl_root="$root/build-gpu/nccl-shim"
    mkdir -p "$nccl_root/lib"
    ln -sfn "$pkg/include" "$nccl_root/include"
    for f in "$pkg"/lib/libnccl.so*; do ln -sf "$f" "$nccl_root/lib/$(basename "$f")"; done
    ln -sf "$(ls "$pkg"/lib/libnccl.so* | head -1)" "$nccl_root/lib/libnccl.so"
    export LD_LIBRARY_PATH="$pkg/lib:${LD_LIBRARY_PATH:-}"
  fi
fi
# cuBLASLt: CUDA 13's wheels keep it in nvidia/cu13 (no unversioned .so for CMake to find either).
cublas_flags=()
if ! ls "${CUDA_HOME:-/usr/local/cuda}"/lib64/libcublasLt.so* >/dev/null 2>&1; then
  pkg=$(pypkg nvidia.cu13)
  lib=$(ls "$pkg"/lib/libcublasLt.so.* 2>/dev/null | head -1)
  if [ -n "$pkg" ] && [ -n "$lib" ] && [ -f "$pkg/include/cublasLt.h" ]; then
    mkdir -p "$root/build-gpu/cublas-shim"
    ln -sf "$lib" "$root/build-gpu/cublas-shim/libcublasLt.so"
    cublas_flags=(-DCUDA_cublasLt_LIBRARY="$root/build-gpu/cublas-shim/libcublasLt.so"
                  -DCMAKE_CXX_FLAGS="-isystem $pkg/include" -DCMAKE_CUDA_FLAGS="-isystem $pkg/include")
    export LD_LIBRARY_PATH="$pkg/lib:${LD_LIBRARY_PATH:-}"
  fi
fi
{
  echo "date: $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 || echo "nvidia-smi: not found"
  nvcc --version 2>&1 | tail -2
  echo "cmake: $(cmake --version | head -1); ninja: $(ninja --version); cxx: $(c++ --version | head -1)"
  echo "deps: ${prefix_path:-none (.gpu-deps missing: run tools/gpu_deps.sh where apt works)}; NCCL_ROOT: ${nccl_root:-default}; cuBLASLt: ${cublas_flags[0]:-toolkit}"
  echo "mpirun: ${mpirun:-none (install Open MPI, or run tools/gpu_deps.sh where apt works)}"
  echo "python: $(command -v "$python" || echo "$python: not found"); budget: ${budget}s"
} >"$logs/machine.log" 2>&1
cat "$logs/machine.log"

# ---- Build ----------------------------------------------------------------------------------------
# Configured here before: an incremental build (seconds when nothing changed). Binaries without
# their build files (built elsewhere and brought along): used as they are. Else configure and build.
bin="$root/build-gpu"
if grep -qx "CMAKE_HOME_DIRECTORY:INTERNAL=$root" "$bin/CMakeCache.txt" 2>/dev/null; then
  configured=1
elif [ -x "$bin/tools/tpsim" ] && [ -x "$bin/props/tpsim_props" ]; then
  configured=0
  skip build "binaries brought along in build-gpu/"
else
  step configure 120 cmake -S "$root" -B "$bin" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTPSIM_GPU=ON \
    ${prefix_path:+-DCMAKE_PREFIX_PATH="$prefix_path"} ${nccl_root:+-DNCCL_ROOT="$nccl_root"} "${cublas_flags[@]}" "${mpi_flags[@]}" \
    && configured=1 || configured=0
fi
if [ "$configured" -eq 1 ]; then
  # What the steps below run; the simulator's own suites ran in CI already.
  step build 240 cmake --build "$bin" -j "$(nproc)" --target tpsim tpsim_props tpsim_gpu_host_tests \
    tpsim_gpu_device_tests tpsim_gpu_world_tests tpsim_backends_tests tpsim_tools_tests
fi
tpsim="$bin/tools/tpsim"

# ---- Device, tests, runs ----------------------------------------------------------------------------
if [ -x "$tpsim" ]; then
  # Passes only where the probe finds a usable device: every later step depends on one.
  step devices 30 bash -c '"$1" devices && "$1" devices | grep -q "^gpu: usable"' _ "$tpsim"
  [ -f "$logs/devices.log" ] && cat "$logs/devices.log"
  step ctest-gpu 180 ctest --test-dir "$bin" -L gpu --no-tests=error --output-on-failure -j 4
  # DeviceFabric against the simulator's bound on whole layers, T = 2, 4, 8, 16 on one GPU.
  for t in 2 4 8 16; do
    step "fabric-mlp-tp$t" 60 env TPSIM_GPU_TRANSPORT=fabric "$tpsim" run --backend gpu --layer mlp --tp "$t" \
      --sequence-parallel --bias --seq 64 --batch 4 --in-features 256 --ffn-hidden 1024 --dtype bf16
  done
  step fabric-tp8-gtp2-column 60 env TPSIM_GPU_TRANSPORT=fabric "$tpsim" run --backend gpu --layer column --tp 8 \
    --gtp-remat 2 --sequence-parallel --bias --seq 32 --batch 4 --in-features 128 --out-features 512
  step fabric-embedding-tp4 60 env TPSIM_GPU_TRANSPORT=fabric "$tpsim" run --backend gpu --layer embedding --tp 4 \
    --vocab 1024 --out-features 64 --seq 32 --batch 4
  # NCCL itself (a one-rank layer run issues no collective): the NCCL world's tests on their own row.
  step nccl-world 60 "$bin/tests/tpsim_gpu_world_tests" --gtest_filter='NcclWorld.*:GpuWorld.*'
  # One process of an MPI job on one GPU: the local rank's device, process 0's NCCL id over MPI,
  # the world communicator and ncclCommSplit's groups, its results gathered as the simulator's
  # are; checked against the same run on the simulator (tests/mpi/mpi_test.sh gpurun). Open MPI
  # without its Debian settings (/etc/openmpi) would pick UCX, which hangs in containers.
  if [ -z "$mpirun" ]; then
    skip mpirun-gpu-np1 "no mpirun (install Open MPI, or run tools/gpu_deps.sh where apt works)"
  elif [ -f "$bin/tpsim_config.h" ] && ! grep -q "define TPSIM_HAVE_MPI 1" "$bin/tpsim_config.h"; then
    skip mpirun-gpu-np1 "tpsim built without MPI (see $logs/configure.log)"
  else
    step mpirun-gpu-np1 90 env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_pml=ob1 \
      OMPI_MCA_btl=self,vader,tcp bash "$root/tests/mpi/mpi_test.sh" "$mpirun" "$tpsim" gpurun 1
  fi
  step demo-gpu 60 "$tpsim" demo --backend gpu
  step bench-gpu 150 "$tpsim" bench --backend gpu
  [ -f "$logs/bench-gpu.log" ] && grep -E '^[^#]' "$logs/bench-gpu.log" | head -120
  # The property suite's cross-backend laws, at a reduced budget. No shrinking: each step of it
  # reruns both backends, and a failing case prints itself and its replay line anyway.
  step props-cross-backend 120 env RC_PARAMS="max_success=25 noshrink=1" "$bin/props/tpsim_props" \
    --gtest_filter='CrossBackend.*:Backends.*'
  # Here a cross-backend law that skipped checked nothing.
  if grep -qE '^\[  SKIPPED \] CrossBackend\..* \([0-9]+ ms\)$' "$logs/props-cross-backend.log" 2>/dev/null; then
    row "$(printf '%-28s %-18s %7s  %s' cross-backend-skips FAIL - "a cross-backend law skipped on a GPU machine")"
    failures=$((failures + 1))
  fi
  if command -v compute-sanitizer >/dev/null; then
    step compute-sanitizer 120 compute-sanitizer --tool memcheck --error-exitcode 9 "$tpsim" run --backend gpu \
      --layer mlp --tp 2 --sequence-parallel --bias --seq 8 --batch 2 --in-features 32 --ffn-hidden 64
  else
    skip compute-sanitizer "not installed"
  fi
  # The CLI script (minutes, simulator runs) is CI's; here the host suites link this machine's libraries.
  step ctest-host 90 ctest --test-dir "$bin" -L 'backends|tools' -E '^tpsim_cli$' --no-tests=error -j "$(nproc)"
else
  skip tests "no tpsim binary (see $logs/configure.log and build.log)"
fi

# ---- Summary --------------------------------------------------------------------------------------
{
  echo
  echo "# tpsim gpu check: $(( $(date +%s) - started )) s, $failures failed, $late skipped for time; logs in $logs"
  printf '%-28s %-18s %7s  %s\n' step status seconds note
  printf '%s\n' "${rows[@]}"
} | tee "$logs/summary.txt"
[ "$failures" -eq 0 ] && [ "$late" -eq 0 ]
