// Compute: the math one rank runs locally, on whatever device its backend drives.
//
// This is one of the two interfaces between core/ and a backend (the other is collectives.h).
// Every method works on views of the backend's own memory. Precision rule shared by all backends:
// 16-bit inputs are widened to fp32, arithmetic runs in fp32 (fp64 for fp64 data), and each result
// is rounded once to the output's dtype. It is not a tensor library: only the operations the
// tensor-parallel layers need are here, each with the shape contract in its comment.
#pragma once

#include <cstdint>

#include "backends/tensor.h"
#include "backends/view.h"

namespace tpsim {

class Compute {
 public:
  virtual ~Compute() = default;

  virtual Device device() const = 0;

  // Uninitialized contiguous tensor in this backend's memory.
  virtual Tensor empty(Shape shape, DType dtype) = 0;
  Tensor zeros(Shape shape, DType dtype) {
    Tensor t = empty(shape, dtype);
    fill(t, 0.0);
    return t;
  }

  // Host <-> backend transfers. `host` is a dense C array of dst's (or src's) dtype and numel.
  virtual void upload(const void* host, View dst) = 0;
  virtual void download(ConstView src, void* host) = 0;

  // y[i] = value (rounded to y's dtype).
  virtual void fill(View y, double value) = 0;
  // y = x elementwise, any strides, same shape; converts dtype (rounds once).
  virtual void copy(ConstView x, View y) = 0;
  // y += alpha·x, same shape. y may be wider than x (fp32 main_grad += bf16 grad).
  virtual void axpy(float alpha, ConstView x, View y) = 0;
  // y *= alpha.
  virtual void scale(View y, float alpha) = 0;

  // c = alpha·a·b + beta·c.  a: (M,K)  b: (K,N)  c: (M,N).
  // a and b share a floating dtype; c has that dtype or a wider one (bf16·bf16 -> fp32).
  // Transposes are views (w.t()): each operand must be unit-stride in one of its two modes.
  // Accumulates in fp32 (fp64 for fp64 operands) and rounds once into c.
  virtual void gemm(ConstView a, ConstView b, View c, float alpha = 1.f, float beta = 0.f) = 0;

  // y(m, n) += bias(n).  bias: (N)  y: (M, N), or any rank whose last mode is N.
  virtual void addBias(ConstView bias, View y) = 0;
  // out(n) = Σ_m y(m, n) + beta·out(n).  y: (M, N) or any rank whose last mode is N; out: (N).
  virtual void sumRows(ConstView y, View out, float beta = 0.f) = 0;

  // Exact (erf) GeLU: y = x·Φ(x).  dx = dy·(Φ(x) + x·φ(x)).
  virtual void gelu(ConstView x, View y) = 0;
  virtual void geluBackward(ConstView x, ConstView dy, View dx) = 0;

  // MXFP8 (OCP microscaling): every block of 32 consecutive elements along `axis` shares one E8M0
  // scale. x: (R, C) fp32, bf16, fp16 or fp64  data: (R, C) fp8e4m3.
  //   axis 1, rowwise:    scales (R, ceil(C/32)) e8m0; block j of row r is x(r, [32j, 32j+32)).
  //   axis 0, columnwise: scales (ceil(R/32), C) e8m0; block i of column c is x([32i, 32i+32), c).
  // A tail block is shorter. Per block, with amax = max |x| (Transformer Engine's rule):
  //   - amax finite and > 0: scale = 2^e, e = ceil(log2(amax/448)) taken exactly from amax's
  //     exponent and mantissa (so amax/scale <= 448), clamped to [-127, 127];
  //   - amax = 0: scale = 2^-127 (bits 0x00), data ±0;
  //   - an infinite element (no NaN): e = 127 (TE's saturating E8M0 conversion gives 0xFE), and
  //     the infinite element saturates to ±448;
  //   - a NaN anywhere in the block: scale NaN (0xFF) and every element of the block NaN (0x7F),
  //     so the whole block dequantizes to NaN, as the OCP MX spec reads a NaN scale.
  //   data = E4M3(x / scale), rounded to nearest even and saturating at ±448; the division by a
  //   power of two is exact.
  virtual void quantizeMxfp8(ConstView x, View data, View scales, int axis) = 0;
  // y = E4M3(data) · scale of its block, rounded once to y's dtype. data: (R, C) fp8e4m3, scales
  // as for quantizeMxfp8 with the same axis, y: (R, C) fp32, bf16, fp16 or fp64.
  virtual void dequantizeMxfp8(ConstView data, ConstView scales, int axis, View y) = 0;

  // Embedding lookup on a vocab shard owning ids [first, first + V).
  // out(i, :) = table(ids(i) - first, :) when the id is owned, else 0.
  // table: (V, h)  ids: int64 (n)  out: (n, h).
  virtual void gatherRows(ConstView table, ConstView ids, std::int64_t first, View out) = 0;
  // table(ids(i) - first, :) += grad(i, :) for owned ids, in increasing i.
  // grad: (n, h)  ids: int64 (n)  table: (V, h).
  virtual void scatterAddRows(ConstView grad, ConstView ids, std::int64_t first, View table) = 0;
};

}  // namespace tpsim
