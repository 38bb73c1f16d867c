// sgemm: a packed, cache-blocked fp32 GEMM the GotoBLAS/BLIS way, for the simulator, and the
// choice of kernel it shares with its fp64 twin dgemm (sim/dgemm.h) and with upperGemmBf16
// (sim/upper_gemm_bf16.h), which run the same driver (sim/gemm_driver.h).
//
// B is packed into panels of NR columns by KC rows, A into slivers of MR rows, and an MR x NR
// register-blocked FMA micro-kernel (AVX-512 or AVX2, chosen at run time) multiplies them. Every
// element of c sums its K products in one fixed order, KC blocks of increasing k, whatever the
// tiling, the threads or c's layout: results depend on the shape alone, and both kernels give the
// same bits. SimCompute keeps Eigen for fp64 and for cores without AVX2 and FMA.
#pragma once

#include <cstdint>

#include "sim/host_pool.h"

namespace tpsim::sim {

// kEigen: SimCompute's Eigen product, on any x86-64 (or other) core.
enum class GemmKernel { kAvx512, kAvx2, kEigen };

// The fastest kernel this core runs.
GemmKernel bestGemmKernel();
bool gemmKernelRuns(GemmKernel kernel);
const char* gemmKernelName(GemmKernel kernel);

// A read-only matrix: element (i, j) at data[i·rowStride + j·colStride], any strides.
template <class T>
struct StridedMatrix {
  const T* data;
  std::int64_t rowStride, colStride;
};
using FloatMatrix = StridedMatrix<float>;

// c = alpha·a·b + beta·c, a (M, K), b (K, N), c (M, N) at c[i·cRowStride + j·cColStride], which
// must not overlap a or b, nor itself. beta == 0 ignores c's old contents (NaN there does not
// leak). `kernel` is kAvx512 or kAvx2 and must run on this core. The blocks of c are tasks on
// `pool` (null: the calling thread does all).
void sgemm(GemmKernel kernel, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, FloatMatrix a,
           FloatMatrix b, float beta, float* c, std::int64_t cRowStride, std::int64_t cColStride, HostPool* pool);

}  // namespace tpsim::sim
