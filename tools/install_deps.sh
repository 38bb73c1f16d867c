#!/usr/bin/env bash
# Installs the Debian packages tpsim builds with, when any is missing. The CUDA toolkit and NCCL
# are not Debian packages: the gpu backend uses them when /usr/local/cuda (or CUDAToolkit_ROOT,
# NCCL_ROOT) provides them, and is skipped otherwise. python3 to python3-pytest build and test the
# Python module (tools/python/), against Debian's /usr/bin/python3; Open MPI (the last two) builds
# and tests worlds spread over processes (mpi/, docs/distributed.md); GNU time measures the peaks of
# tools/memory_table.py.
#   tools/install_deps.sh           what tpsim builds with
#   tools/install_deps.sh --tests   and Slurm (slurm-wlm, with munge), which tests/mpi/srun_test.sh
#                                   starts a one-node cluster of to launch tpsim with srun
set -euo pipefail

packages=(cmake ninja-build g++ libeigen3-dev libboost-program-options-dev libboost-context-dev
          libgtest-dev libgmock-dev librapidcheck-dev nlohmann-json3-dev python3
          python3-dev pybind11-dev python3-numpy python3-pytest libopenmpi-dev openmpi-bin time)
case "${1:-}" in
  "") ;;
  --tests) packages+=(slurm-wlm) ;;
  *) echo "tools/install_deps.sh: unknown argument '$1' (expected --tests or nothing)" >&2; exit 2 ;;
esac
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "tpsim: installing ${missing[*]}"
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "tpsim: need root or sudo to install ${missing[*]}" >&2; exit 1; }
  sudo="sudo"
fi
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
