// The argument checks of compute.h's contracts, shared by every Compute backend so that a bad
// argument gets the same message from SimCompute and GpuCompute; only the memory they expect
// (`device`) differs. One function per op checks all of its arguments, in the order both backends
// report them. Checks only: no backend state, no arithmetic; a backend's own limits (which values
// a dtype can store) stay with the backend.
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

// The embedding ops' table (V, h), ids (n int64 values, any shape) and rows (n, h): gatherRows'
// out, scatterAddRows' grad.
inline void checkRowsOf(Device device, const char* op, ConstView table, ConstView ids, const char* rowsArg,
                        ConstView rows) {
  TPSIM_CHECK(table.rank() == 2, op, ": table must be (V, h), got ", table.str());
  checkDevice(device, op, "ids", ids);
  TPSIM_CHECK(ids.dtype() == DType::kInt64, op, ": ids must be int64, got ", ids.str());
  const std::int64_t h = table.dim(1), n = ids.numel();
  TPSIM_CHECK(rows.rank() == 2 && rows.dim(0) == n && rows.dim(1) == h, op, ": ", rowsArg, " must be (n=", n,
              ", h=", h, "), got ", rows.str());
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

// ---- One check per op of compute.h ----------------------------------------------------------

inline void checkUpload(Device device, ConstView dst) {
  checkDevice(device, "upload", "dst", dst);
  TPSIM_CHECK(dst.isContiguous(), "upload: dst must be contiguous, got ", dst.str(),
              "; upload into a contiguous tensor and copy() into the strided view");
}

inline void checkDownload(Device device, ConstView src) {
  checkDevice(device, "download", "src", src);
  TPSIM_CHECK(src.isContiguous(), "download: src must be contiguous, got ", src.str(),
              "; copy() it into a contiguous tensor first");
}

inline void checkFill(Device device, ConstView y) { checkDevice(device, "fill", "y", y); }

inline void checkCopy(Device device, ConstView x, ConstView y) {
  checkDevice(device, "copy", "x", x);
  checkDevice(device, "copy", "y", y);
  checkSameShape("copy", "y", y, "x", x);
}

inline void checkAxpy(Device device, ConstView x, ConstView y) {
  checkFloating(device, "axpy", "x", x);
  checkFloating(device, "axpy", "y", y);
  checkSameShape("axpy", "y", y, "x", x);
  checkHolds("axpy", "y", y, "x", x);
}

inline void checkScale(Device device, ConstView y) { checkFloating(device, "scale", "y", y); }

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

inline void checkAddBias(Device device, ConstView bias, ConstView y) {
  checkFloating(device, "addBias", "bias", bias);
  checkFloating(device, "addBias", "y", y);
  TPSIM_CHECK(bias.rank() == 1, "addBias: bias must be a vector (N), got ", bias.str());
  TPSIM_CHECK(y.rank() >= 1 && y.dim(-1) == bias.dim(0), "addBias: y must be (..., N=", bias.dim(0),
              "), got ", y.str());
}

inline void checkSumRows(Device device, ConstView y, ConstView out) {
  checkFloating(device, "sumRows", "y", y);
  checkFloating(device, "sumRows", "out", out);
  TPSIM_CHECK(y.rank() >= 1, "sumRows: y must be (..., N), got a scalar ", y.str());
  const std::int64_t n = y.dim(-1);
  TPSIM_CHECK(out.rank() == 1 && out.dim(0) == n, "sumRows: out must be (N=", n, "), got ", out.str());
}

inline void checkGelu(Device device, ConstView x, ConstView y) {
  checkFloating(device, "gelu", "x", x);
  checkFloating(device, "gelu", "y", y);
  checkSameShape("gelu", "y", y, "x", x);
}

inline void checkGeluBackward(Device device, ConstView x, ConstView dy, ConstView dx) {
  checkFloating(device, "geluBackward", "x", x);
  checkFloating(device, "geluBackward", "dy", dy);
  checkFloating(device, "geluBackward", "dx", dx);
  checkSameShape("geluBackward", "dy", dy, "x", x);
  checkSameShape("geluBackward", "dx", dx, "x", x);
}

inline void checkQuantizeMxfp8(Device device, ConstView x, ConstView data, ConstView scales, int axis) {
  checkFloating(device, "quantizeMxfp8", "x", x);
  TPSIM_CHECK(x.rank() == 2, "quantizeMxfp8: x must be a matrix (R, C), got ", x.str());
  checkSameShape("quantizeMxfp8", "data", data, "x", x);
  checkMxfp8(device, "quantizeMxfp8", data, scales, axis);
}

inline void checkDequantizeMxfp8(Device device, ConstView data, ConstView scales, int axis, ConstView y) {
  checkFloating(device, "dequantizeMxfp8", "y", y);
  TPSIM_CHECK(data.rank() == 2, "dequantizeMxfp8: data must be a matrix (R, C), got ", data.str());
  checkMxfp8(device, "dequantizeMxfp8", data, scales, axis);
  checkSameShape("dequantizeMxfp8", "y", y, "data", data);
}

inline void checkGatherRows(Device device, ConstView table, ConstView ids, ConstView out) {
  checkFloating(device, "gatherRows", "table", table);
  checkFloating(device, "gatherRows", "out", out);
  checkRowsOf(device, "gatherRows", table, ids, "out", out);
}

inline void checkScatterAddRows(Device device, ConstView grad, ConstView ids, ConstView table) {
  checkFloating(device, "scatterAddRows", "grad", grad);
  checkFloating(device, "scatterAddRows", "table", table);
  checkRowsOf(device, "scatterAddRows", table, ids, "grad", grad);
  checkHolds("scatterAddRows", "table", table, "grad", grad);
}

}  // namespace tpsim::compute_checks
