// GpuCompute's gemm on cuBLASLt: mapGemm maps strided tpsim views onto cuBLASLt's column-major
// operands (unit stride in mode 1 is row-major, read as the transpose; in mode 0 column-major;
// GpuCompute copies any other operand first), and Matmul holds one rank's workspace and plan cache
// and a cuBLASLt handle borrowed from its device's pool. Not a general BLAS wrapper: no batches,
// no epilogues, no FP8 (MXFP8 GEMM needs compute capability 10.0; tpsim dequantizes first).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <tuple>

#include "backends/view.h"

namespace tpsim::gpu {

// A matrix as cuBLASLt reads it: stored column-major, `rows` x `cols` with leading dimension `ld`
// (element (i, j) at data + i + j·ld), used transposed when `trans`.
struct LtMatrix {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;
  std::int64_t rows = 0, cols = 0, ld = 0;
  bool trans = false;
};

// D = alpha·op(a)·op(b) + beta·C with op(a): (m, k), op(b): (k, n); C and D are the same
// column-major (m, n) matrix at `c` with leading dimension ldc.
struct LtGemm {
  LtMatrix a, b;
  void* c = nullptr;
  DType cType = DType::kFloat32;
  std::int64_t m = 0, n = 0, k = 0, ldc = 0;
};

// True when v (R, C) is row-major or column-major with a leading dimension cuBLASLt accepts (at
// least the column-major row count): then mapGemm reads it in place.
bool hasLtLayout(ConstView v);

// c (M, N) = a (M, K) · b (K, N) as one cuBLASLt call. A column-major c is D itself; a row-major
// c is computed as cᵀ = bᵀ·aᵀ. Needs hasLtLayout for all three and M, N, K >= 1.
LtGemm mapGemm(ConstView a, ConstView b, View c);

class Matmul {
 public:
  // 32 MiB on Hopper, as cuBLAS recommends; owned by this rank alone, so results do not depend on
  // what other ranks' streams run (cuBLAS "Results reproducibility").
  static constexpr std::size_t kWorkspaceBytes = std::size_t(32) << 20;

  // On `device`, which must be current: borrows a handle and allocates the workspace on `stream`,
  // where run() enqueues every matmul.
  Matmul(int device, cudaStream_t stream);
  // Waits for nothing: frees the workspace on the stream, behind every matmul that reads it, and
  // returns the handle to the pool. The stream must still exist.
  ~Matmul();
  Matmul(const Matmul&) = delete;
  Matmul& operator=(const Matmul&) = delete;

  // Enqueues g on the stream. fp64 runs with CUBLAS_COMPUTE_64F, everything else with
  // CUBLAS_COMPUTE_32F and fp32 scale (never TF32); split-K may only reduce in the compute type, so
  // a 16-bit D is rounded once.
  void run(const LtGemm& g, float alpha, float beta);

 private:
  struct Plan;
  // Shapes, leading dimensions, transposes, dtypes and pointer alignments: all the heuristic sees.
  using Key = std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t, int,
                         int, int, int, int, unsigned, unsigned, unsigned>;
  static constexpr std::size_t kMaxPlans = 256;

  const Plan& plan(const LtGemm& g);

  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  std::map<Key, std::unique_ptr<Plan>> plans_;
};

}  // namespace tpsim::gpu
