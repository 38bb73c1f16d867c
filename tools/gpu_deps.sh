#!/usr/bin/env bash
# Fetches what tools/gpu_check.sh needs on a GPU machine that has the CUDA toolkit, CMake and ninja
# but no package registry: the Debian packages tpsim builds with (Eigen, Boost, GoogleTest,
# rapidcheck, nlohmann-json) and Open MPI (mpirun, its libraries and what they load, the headers
# tpsim's MPI build needs), downloaded here with apt-get, unpacked and packed again as
# .gpu-deps/root.tar.xz (about 18 MB; unpacked, Boost's headers alone are 150 MB). Open MPI runs
# from there relocated (OPAL_PREFIX; tools/gpu_check.sh sets it up). Carry .gpu-deps to the GPU machine
# with the working tree; tools/gpu_check.sh unpacks it there. NCCL and cuBLASLt are not carried
# (hundreds of MB): the check uses the GPU machine's own (its CUDA toolkit, or the nvidia-* Python
# packages).
#   tools/gpu_deps.sh        (re)creates .gpu-deps/ in the repository root
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(libeigen3-dev libboost1.74-dev libboost-context1.74-dev libboost-context1.74.0
          libboost-program-options1.74-dev libboost-program-options1.74.0 libboost-context-dev
          libboost-program-options-dev libgtest-dev libgmock-dev librapidcheck-dev nlohmann-json3-dev
          # Open MPI 4.1 and the libraries it links or loads that a bare machine may lack (its
          # transports: UCX, libfabric, verbs, PSM; PMIx with munge; hwloc with its plugins).
          openmpi-bin openmpi-common libopenmpi3 libopenmpi-dev libpmix2 libmunge2 libevent-core-2.1-7
          libevent-pthreads-2.1-7 libhwloc15 libhwloc-plugins libxnvctrl0 libnuma1 libfabric1 libibverbs1
          librdmacm1 libnl-3-200 libnl-route-3-200 libpsm-infinipath1 libpsm2-2 libucx0)
rm -rf .gpu-deps
mkdir -p .gpu-deps/debs .gpu-deps/root
if ! (cd .gpu-deps/debs && apt-get download "${packages[@]}" >/dev/null 2>&1); then
  apt-get update -qq
  (cd .gpu-deps/debs && apt-get download "${packages[@]}" >/dev/null)
fi
for deb in .gpu-deps/debs/*.deb; do dpkg -x "$deb" .gpu-deps/root; done
rm -rf .gpu-deps/debs .gpu-deps/root/usr/share/doc .gpu-deps/root/usr/share/lintian
XZ_OPT=-T0 tar -C .gpu-deps/root -cJf .gpu-deps/root.tar.xz .
rm -rf .gpu-deps/root
echo "tpsim: .gpu-deps ready ($(du -sh .gpu-deps | cut -f1)); carry it with the working tree"
