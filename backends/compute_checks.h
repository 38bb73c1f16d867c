// The argument checks of compute.h's contracts, shared by every Compute backend so that a bad
// argument gets the same message from SimCompute and GpuCompute; only the memory they expect
// (`device`) differs. Checks only: no backend state, no arithmetic.
#pragma once

#include <cstdint>

#include "backends/errors.h"
#include "backends/view.h"

namespace tpsim::compute_checks {

// Elements per MXFP8 block (one E8M0 scale each): compute.h's quantizeMxfp8.
constexpr std::int64_t kMxfp8Block = 32;

inline const char* memoryName(Device device) { return device == Device::kHost ? "host" : "CUDA"; }

inline void checkDevice(Device device, const char* op, const char* arg, ConstView v) {
  TPSIM_CHECK(v.device() == device, op, ": ", arg, " must be ", memoryName(device), " memory, got ", v.str(), " on ",
              deviceName(v.device()));
}

inline void checkFloating(Device device, const char* op, const char* arg, ConstView v) {
  checkDevice(device, op, arg, v);
  TPSIM_CHECK(isFloating(v.dtype()), op, ": ", arg, " must be fp32, bf16, fp16 or fp64, got ", v.str(),
              isFloat8(v.dtype()) ? "; fp8 is a storage type, dequantizeMxfp8 it first" : "");
}

inline void checkSameShape(const char* op, const char* arg, ConstView v, const char* refArg, ConstView ref) {
  TPSIM_CHECK(v.shape() == ref.shape(), op, ": ", arg, " must have ", refArg, "'s shape ", ref.shape(), ", got ",
              v.str());
}

// True when `wide` holds every value of `narrow` exactly: same dtype, or 16-bit -> fp32 -> fp64.
inline bool holds(DType wide, DType narrow) {
  if (wide == narrow) return true;
  if (wide == DType::kFloat64) return narrow == DType::kFloat32 || is16Bit(narrow);
  return wide == DType::kFloat32 && is16Bit(narrow);
}

// Accumulations (axpy, scatterAddRows) may widen but never narrow.
inline void checkHolds(const char* op, const char* dstArg, ConstView dst, const char* srcArg, ConstView src) {
  TPSIM_CHECK(holds(dst.dtype(), src.dtype()), op, ": ", dstArg, " must have ", srcArg, "'s dtype ",
              dtypeName(src.dtype()), " or a wider one, got ", dst.str());
}

// gemm's operands: a (M, K) floating, b (K, N) of a's dtype, c (M, N) of a's dtype or fp32 for
// 16-bit a and b.
inline void checkGemm(Device device, ConstView a, ConstView b, ConstView c) {
  checkFloating(device, "gemm", "a", a);
  checkDevice(device, "gemm", "b", b);
  checkDevice(device, "gemm", "c", c);
  TPSIM_CHECK(a.rank() == 2, "gemm: a must be a matrix (M, K), got ", a.str());
  const std::int64_t m = a.dim(0), k = a.dim(1);
  TPSIM_CHECK(b.dtype() == a.dtype(), "gemm: b must have a's dtype ", dtypeName(a.dtype()), ", got ",
              b.str());
  TPSIM_CHECK(b.rank() == 2 && b.dim(0) == k, "gemm: b must be (K=", k, ", N), got ", b.str());
  const std::int64_t n = b.dim(1);
  TPSIM_CHECK(c.rank() == 2 && c.dim(0) == m && c.dim(1) == n, "gemm: c must be (M=", m, ", N=", n, "), got ",
              c.str());
  const bool wideOut = is16Bit(a.dtype()) && c.dtype() == DType::kFloat32;
  TPSIM_CHECK(c.dtype() == a.dtype() || wideOut, "gemm: c must have a's dtype ", dtypeName(a.dtype()),
              is16Bit(a.dtype()) ? " or fp32" : "", ", got ", c.str(),
              "; for another output dtype, gemm into a temporary and copy()");
}

// The (R, C) fp8e4m3 data and the shape of its e8m0 block scales for `axis`.
inline void checkMxfp8(Device device, const char* op, ConstView data, ConstView scales, int axis) {
  TPSIM_CHECK(axis == 0 || axis == 1, op, ": axis must be 0 (columnwise) or 1 (rowwise), got ", axis);
  checkDevice(device, op, "data", data);
  checkDevice(device, op, "scales", scales);
  TPSIM_CHECK(data.dtype() == DType::kFloat8E4M3, op, ": data must be fp8e4m3, got ", data.str());
  TPSIM_CHECK(scales.dtype() == DType::kFloat8E8M0, op, ": scales must be e8m0, got ", scales.str());
  const std::int64_t r = data.dim(0), c = data.dim(1), b = kMxfp8Block;
  const Shape want = axis == 1 ? Shape{r, (c + b - 1) / b} : Shape{(r + b - 1) / b, c};
  TPSIM_CHECK(scales.shape() == want, op, ": scales of ", axis == 1 ? "rowwise" : "columnwise", " (axis ", axis,
              ") blocks of a ", data.shape(), " matrix must be ", want, ", got ", scales.str());
}

}  // namespace tpsim::compute_checks
