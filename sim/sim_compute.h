// SimCompute: the simulator's Compute backend; host memory, a packed GEMM, plain loops elsewhere.
//
// It follows compute.h's precision rule exactly and converts 16-bit values with dtype.h (never
// Eigen::bfloat16/half), so its results match the other backends bit for bit where the math
// allows. It holds no data and runs on the calling thread, which large GEMMs may share with a
// HostPool's helpers: one instance per rank, or one shared by all. It is not a fast CPU backend
// beyond gemm: fp32 runs sim/sgemm.h's packed kernels, fp64 plain Eigen.
#pragma once

#include <cstdint>

#include "backends/compute.h"
#include "sim/host_pool.h"
#include "sim/sgemm.h"

namespace tpsim::sim {

// What SimCompute adds to compute.h's contracts:
//  - Every view must be host memory. Arithmetic runs in fp64 when any operand is fp64, else in
//    fp32; fp64 -> 16-bit stores round once (no detour through a rounded fp32).
//  - int64 data is accepted only by fill, copy, upload and download (and as ids). Storing to int64
//    truncates toward zero (as torch .to(int64)) and rejects NaN and values outside int64's range.
//    The same four accept fp8e4m3 and e8m0 (besides the MXFP8 ops); storing to e8m0 rejects any
//    value but an exact power of two.
//  - axpy and scatterAddRows accumulate into a destination of the source's dtype or a wider one
//    (16-bit -> fp32 -> fp64); the other elementwise ops take any floating dtypes.
//  - gemm accepts c of a's dtype, or fp32 for 16-bit a and b. fp32 runs sgemm (16-bit operands
//    widened to fp32 first), which reads fp32 operands in place whatever their strides, and c when
//    it has a unit-stride mode. Each element sums its products in an order fixed by K alone, so a
//    result is the same with any pool, or none, and with either packed kernel. fp64 (and fp32 with
//    GemmKernel::kEigen) runs as Eigen's c.noalias() += alpha·a·b on operands with a unit-stride
//    mode, for a large product once per tile of kGemmTile rows (or columns, when N > M) of c: tiles
//    of the shape alone, for the same reason.
//  - beta == 0 ignores the old contents of c (gemm) and out (sumRows): NaN there does not leak.
//  - sumRows adds rows in increasing order, then beta·out. scatterAddRows rounds each add once
//    into the table's dtype, so repeated ids in a bf16 table round once per occurrence.
class SimCompute final : public Compute {
 public:
  static constexpr std::int64_t kGemmTile = 256;
  // A product of at least this many multiply-adds (M·N·K) shares its tiles with the pool, the
  // others run on the calling thread.
  static constexpr double kGemmTiledMacs = 1 << 24;

  // pool: helpers for large GEMMs' tiles (not owned; null: the calling thread does all).
  // fp32Kernel: fp32 gemm's kernel, one that runs on this core (gemmKernelRuns).
  explicit SimCompute(HostPool* pool = nullptr, GemmKernel fp32Kernel = bestGemmKernel());

  Device device() const override { return Device::kHost; }
  HostPool* pool() const { return pool_; }
  GemmKernel fp32Kernel() const { return fp32Kernel_; }

  // 64-byte aligned, freed by the Tensor; a zero-size tensor still owns a small block.
  Tensor empty(Shape shape, DType dtype) override;

  void upload(const void* host, View dst) override;
  void download(ConstView src, void* host) override;

  void fill(View y, double value) override;
  void copy(ConstView x, View y) override;
  void axpy(float alpha, ConstView x, View y) override;
  void scale(View y, float alpha) override;

  void gemm(ConstView a, ConstView b, View c, float alpha = 1.f, float beta = 0.f) override;

  void addBias(ConstView bias, View y) override;
  void sumRows(ConstView y, View out, float beta = 0.f) override;

  void gelu(ConstView x, View y) override;
  void geluBackward(ConstView x, ConstView dy, View dx) override;

  void quantizeMxfp8(ConstView x, View data, View scales, int axis) override;
  void dequantizeMxfp8(ConstView data, ConstView scales, int axis, View y) override;

  void gatherRows(ConstView table, ConstView ids, std::int64_t first, View out) override;
  void scatterAddRows(ConstView grad, ConstView ids, std::int64_t first, View table) override;

 private:
  HostPool* pool_;
  GemmKernel fp32Kernel_;
};

// Returns the freed host blocks SimCompute keeps for reuse (1 MiB and more) to malloc.
void releaseCachedHostBlocks();

}  // namespace tpsim::sim
