// dgemm: sgemm (sim/sgemm.h) in fp64, for the reference that checks the simulator
// (tools/reference.h): the same driver and order of additions, with 14 x 16 (AVX-512) and 6 x 8
// (AVX2) micro-kernels. Not used by SimCompute, whose fp64 gemm is Eigen's.
#pragma once

#include <cstdint>

#include "sim/host_pool.h"
#include "sim/sgemm.h"

namespace tpsim::sim {

using DoubleMatrix = StridedMatrix<double>;

// sgemm's contract in fp64.
void dgemm(GemmKernel kernel, std::int64_t m, std::int64_t n, std::int64_t k, double alpha, DoubleMatrix a,
           DoubleMatrix b, double beta, double* c, std::int64_t cRowStride, std::int64_t cColStride, HostPool* pool);

}  // namespace tpsim::sim
