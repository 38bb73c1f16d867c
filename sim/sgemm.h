// sgemm and dgemm: packed, cache-blocked GEMMs the GotoBLAS/BLIS way, in fp32 for the simulator
// and in fp64 for the reference that checks it (tools/lib/reference.h); upperGemmBf16, the same driver
// over bf16 pairs, for the reference's error bounds.
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
using DoubleMatrix = StridedMatrix<double>;

// c = alpha·a·b + beta·c, a (M, K), b (K, N), c (M, N) at c[i·cRowStride + j·cColStride], which
// must not overlap a or b, nor itself. beta == 0 ignores c's old contents (NaN there does not
// leak). `kernel` is kAvx512 or kAvx2 and must run on this core. The blocks of c are tasks on
// `pool` (null: the calling thread does all).
void sgemm(GemmKernel kernel, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, FloatMatrix a,
           FloatMatrix b, float beta, float* c, std::int64_t cRowStride, std::int64_t cColStride, HostPool* pool);

// The same in fp64.
void dgemm(GemmKernel kernel, std::int64_t m, std::int64_t n, std::int64_t k, double alpha, DoubleMatrix a,
           DoubleMatrix b, double beta, double* c, std::int64_t cRowStride, std::int64_t cColStride, HostPool* pool);

// For the reference's error bounds (tools/lib/reference.cc): c ≈ a·b for nonnegative a and b, faster
// than sgemm through AVX512-BF16 (an instruction does two FMAs' work; 1.7x on Zen 5). Each value of a and b is rounded toward +Inf to bf16 (a
// positive one below 2^-126 up to 2^-126); their products, exact, are summed in fp32 in sgemm's
// order (an FMA chain per K block of 256, pairs of K steps odd first, then one addition per later
// block), each addition rounded to nearest, except that a chain's result below 2^-126 becomes 0. c
// is row-major (M, N) with unit column stride. Runs where upperGemmBf16Runs().
bool upperGemmBf16Runs();
void upperGemmBf16(std::int64_t m, std::int64_t n, std::int64_t k, FloatMatrix a, FloatMatrix b, float* c,
                   std::int64_t cRowStride, HostPool* pool);

}  // namespace tpsim::sim
