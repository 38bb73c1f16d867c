// GpuCompute's elementwise kernels: work-item functors, the one kernel that runs them, and run*,
// which pick each op's functor, accumulation type and operands and hand them to a launcher (a
// kernel on GpuCompute's stream, or a host loop in the tests, which so check what the GPU runs).
// Every rounding is a tpsim::elem function in SimCompute's order: results are the simulator's bit
// for bit, but GeLU's (device erf/exp differ from glibc's in the last bit; it is bounded instead).
// Nothing here checks arguments or allocates.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <utility>
#include <vector>

#include "backends/compute_checks.h"
#include "backends/dtype.h"
#include "backends/element_math.h"
#include "backends/view.h"

namespace tpsim::gpu::kern {

constexpr int kRank = 4;                                        // views have at most four modes
constexpr std::int64_t kMxBlock = compute_checks::kMxfp8Block;  // MXFP8 block length
constexpr double kSqrtHalf = 0.70710678118654752440;            // 1/√2, as SimCompute
constexpr double kInvSqrt2Pi = 0.39894228040143267794;          // 1/√(2π), as SimCompute

// ---- Element access -----------------------------------------------------------------------------

// The E8M0 code of v: 0xFF for NaN, e + 127 for an exact power of two 2^e with e in [-127, 127],
// and -1 for every other value, which an e8m0 store rejects (dtype.h's toE8m0 throws for them).
TPSIM_HD inline int e8m0Code(double v) {
  if (elem::isNan(v)) return 0xff;
  const std::uint64_t u = elem::bitsOf(v);
  const int biased = int(u >> 52);  // the sign bit lands above 0x7ff: negative values fail below
  if ((u & 0xfffffffffffffull) != 0 || biased == 0 || biased >= 0x7ff) return -1;
  const int e = biased - 1023;
  return e < -127 || e > 127 ? -1 : e + 127;
}

// True when storing v into `dtype` is defined: int64 takes [-2^63, 2^63) (NaN fails both
// comparisons), e8m0 exact powers of two and NaN; the other dtypes take anything.
template <typename T>
TPSIM_HD inline bool storable(T v, DType dtype) {
  if (dtype == DType::kInt64) return v >= T(-9223372036854775808.0) && v < T(9223372036854775808.0);
  if (dtype == DType::kFloat8E8M0) return e8m0Code(double(v)) >= 0;
  return true;
}

// The element at p widened to T (exact, but int64 beyond 2^24 or 2^53).
template <typename T>
TPSIM_HD inline T load(const char* p, DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return T(*reinterpret_cast<const float*>(p));
    case DType::kBFloat16: return T(elem::bf16ToFloat(*reinterpret_cast<const std::uint16_t*>(p)));
    case DType::kFloat16: return T(elem::halfToFloat(*reinterpret_cast<const std::uint16_t*>(p)));
    case DType::kFloat64: return T(*reinterpret_cast<const double*>(p));
    case DType::kInt64: return T(*reinterpret_cast<const std::int64_t*>(p));
    case DType::kFloat8E4M3: return T(elem::e4m3ToFloat(*reinterpret_cast<const std::uint8_t*>(p)));
    case DType::kFloat8E8M0: return T(elem::e8m0ToFloat(*reinterpret_cast<const std::uint8_t*>(p)));
  }
  return T(0);
}

// Stores v rounded once to `dtype` (fp64 -> 16-bit through the round-to-odd float). int64
// truncates toward zero; int64 and e8m0 stores need storable(v) (checked before the launch).
template <typename T>
TPSIM_HD inline void store(char* p, DType dtype, T v) {
  switch (dtype) {
    case DType::kFloat32: *reinterpret_cast<float*>(p) = float(v); return;
    case DType::kBFloat16: *reinterpret_cast<std::uint16_t*>(p) = elem::floatToBf16(elem::toOddFloat(v)); return;
    case DType::kFloat16: *reinterpret_cast<std::uint16_t*>(p) = elem::floatToHalf(elem::toOddFloat(v)); return;
    case DType::kFloat64: *reinterpret_cast<double*>(p) = double(v); return;
    case DType::kInt64: *reinterpret_cast<std::int64_t*>(p) = std::int64_t(v); return;
    case DType::kFloat8E4M3: *reinterpret_cast<std::uint8_t*>(p) = elem::toE4m3(double(v)); return;
    case DType::kFloat8E8M0: *reinterpret_cast<std::uint8_t*>(p) = std::uint8_t(e8m0Code(double(v))); return;
  }
}

// Copies one element of `bytes` (1, 2, 4 or 8) bytes: same-dtype copies keep every bit, NaN payloads too.
TPSIM_HD inline void copyBytes(const char* from, char* to, int bytes) {
  switch (bytes) {
    case 1: *reinterpret_cast<std::uint8_t*>(to) = *reinterpret_cast<const std::uint8_t*>(from); return;
    case 2: *reinterpret_cast<std::uint16_t*>(to) = *reinterpret_cast<const std::uint16_t*>(from); return;
    case 4: *reinterpret_cast<std::uint32_t*>(to) = *reinterpret_cast<const std::uint32_t*>(from); return;
    default: *reinterpret_cast<std::uint64_t*>(to) = *reinterpret_cast<const std::uint64_t*>(from); return;
  }
}

// dst = src rounded once to dst's dtype; bitwise when the dtypes match (SimCompute's convert).
template <typename T>
TPSIM_HD inline void convert(const char* src, DType from, char* dst, DType to, int bytes) {
  if (from == to)
    copyBytes(src, dst, bytes);
  else
    store<T>(dst, to, load<T>(src, from));
}

TPSIM_HD inline float erfOf(float x) {
#if defined(__CUDA_ARCH__)
  return erff(x);
#else
  return std::erf(x);
#endif
}
TPSIM_HD inline double erfOf(double x) {
#if defined(__CUDA_ARCH__)
  return erf(x);
#else
  return std::erf(x);
#endif
}
TPSIM_HD inline float expOf(float x) {
#if defined(__CUDA_ARCH__)
  return expf(x);
#else
  return std::exp(x);
#endif
}
TPSIM_HD inline double expOf(double x) {
#if defined(__CUDA_ARCH__)
  return exp(x);
#else
  return std::exp(x);
#endif
}

// ---- Strided operands ---------------------------------------------------------------------------

// An element index over a shape padded to four modes (leading modes of extent 1), row-major.
struct Index {
  std::int64_t linear;
  std::int64_t i[kRank];
};

// A shape padded to four modes, as SimCompute's forEach walks it.
struct Extents {
  std::int64_t dim[kRank] = {1, 1, 1, 1};
  std::int64_t numel = 1;

  TPSIM_HD Index unravel(std::int64_t linear) const {
    Index ix;
    ix.linear = linear;
    std::int64_t rest = linear;
    for (int k = kRank - 1; k > 0; --k) {
      ix.i[k] = rest % dim[k];
      rest /= dim[k];
    }
    ix.i[0] = rest;
    return ix;
  }
};

// One view's memory: byte pointer, dtype and strides (in elements) over the padded Extents.
// `dense` (row-major contiguous) lets at() use the linear index directly.
struct Operand {
  char* data = nullptr;
  DType dtype = DType::kFloat32;
  int bytes = 4;
  std::int64_t stride[kRank] = {0, 0, 0, 0};
  bool dense = false;

  TPSIM_HD char* at(const Index& ix) const {
    const std::int64_t off =
        dense ? ix.linear : ix.i[0] * stride[0] + ix.i[1] * stride[1] + ix.i[2] * stride[2] + ix.i[3] * stride[3];
    return data + off * bytes;
  }
  // Element (r, c) of a matrix operand (strides in modes 2 and 3 of the padding).
  TPSIM_HD char* at2(std::int64_t r, std::int64_t c) const { return data + (r * stride[2] + c * stride[3]) * bytes; }
};

// ---- Elementwise ops ------------------------------------------------------------------------------
// Each functor is a plain struct of pointers, extents and strides (a kernel argument); fn(i) does
// work item i of fn.count().

// y[i] = the element whose bytes are `bits` (fill's value, rounded once on the host).
struct FillFn {
  Extents e;
  Operand y;
  std::uint64_t bits;
  TPSIM_HD std::int64_t count() const { return e.numel; }
  TPSIM_HD void operator()(std::int64_t i) const {
    copyBytes(reinterpret_cast<const char*>(&bits), y.at(e.unravel(i)), y.bytes);
  }
};

template <typename T>
struct CopyFn {
  Extents e;
  Operand x, y;
  TPSIM_HD std::int64_t count() const { return e.numel; }
  TPSIM_HD void operator()(std::int64_t i) const {
    const Index ix = e.unravel(i);
    convert<T>(x.at(ix), x.dtype, y.at(ix), y.dtype, y.bytes);
  }
};

// Lowers *firstBad to the least i whose element of x cannot be stored into `to` (see storable).
template <typename T>
struct FindUnstorableFn {
  Extents e;
  Operand x;
  DType to;
  unsigned long long* firstBad;
  TPSIM_HD std::int64_t count() const { return e.numel; }
  TPSIM_HD void operator()(std::int64_t i) const {
    if (storable(load<T>(x.at(e.unravel(i)), x.dtype), to)) return;
#if defined(__CUDA_ARCH__)
    atomicMin(firstBad, static_cast<unsigned long long>(i));
#else
    if (static_cast<unsigned long long>(i) < *firstBad) *firstBad = static_cast<unsigned long long>(i);
#endif
  }
};

template <typename T>
struct AxpyFn {
  Extents e;
  Operand x, y;
  T alpha;
  TPSIM_HD std::int64_t count() const { return e.numel; }
  TPSIM_HD void operator()(std::int64_t i) const {
    const Index ix = e.unravel(i);
    char* yp = y.at(ix);
    store<T>(yp, y.dtype, elem::axpyBody(load<T>(yp, y.dtype), alpha, load<T>(x.at(ix), x.dtype)));
  }
};

template <typename T>
struct ScaleFn {
  Extents e;
  Operand y;
  T alpha;
  TPSIM_HD std::int64_t count() const { return e.numel; }
  TPSIM_HD void operator()(std::int64_t i) const {
    char* yp = y.at(e.unravel(i));
    store<T>(yp, y.dtype, elem::scaleBody(load<T>(yp, y.dtype), alpha));
  }
};

// bias has stride 0 in every mode of y but the last.
template <typename T>
struct AddBiasFn {
  Extents e;
  Operand bias, y;
  TPSIM_HD std::int64_t count() const { return e.numel; }
  TPSIM_HD void operator()(std::int64_t i) const {
    const Index ix = e.unravel(i);
    char* yp = y.at(ix);
    store<T>(yp, y.dtype, elem::addBiasBody(load<T>(yp, y.dtype), load<T>(bias.at(ix), bias.dtype)));
  }
};

// Work item j sums column j of y over all leading modes in row-major order, starting from 0 as
// SimCompute does (so a column of -0 sums to +0), then adds beta·out(j). out: stride in mode 3.
template <typename T>
struct SumRowsFn {
  Extents e;  // y's shape; e.dim[3] = N
  Operand y, out;
  T beta;
  TPSIM_HD std::int64_t count() const { return e.dim[3]; }
  TPSIM_HD void operator()(std::int64_t j) const {
    T acc = T(0);
    Index ix;
    ix.i[3] = j;
    for (ix.i[0] = 0; ix.i[0] < e.dim[0]; ++ix.i[0])
      for (ix.i[1] = 0; ix.i[1] < e.dim[1]; ++ix.i[1])
        for (ix.i[2] = 0; ix.i[2] < e.dim[2]; ++ix.i[2]) {
          ix.linear = ((ix.i[0] * e.dim[1] + ix.i[1]) * e.dim[2] + ix.i[2]) * e.dim[3] + j;
          acc = elem::sumRowsStep(acc, load<T>(y.at(ix), y.dtype));
        }
    char* op = out.data + j * out.stride[3] * out.bytes;
    const T old = beta != T(0) ? load<T>(op, out.dtype) : T(0);  // beta == 0 never reads out
    store<T>(op, out.dtype, elem::sumRowsFinish(acc, beta, old));
  }
};

// y = x·Φ(x), Φ(x) = (1 + erf(x·(1/√2)))/2, in SimCompute's operation order.
template <typename T>
struct GeluFn {
  Extents e;
  Operand x, y;
  TPSIM_HD std::int64_t count() const { return e.numel; }
  TPSIM_HD void operator()(std::int64_t i) const {
    const Index ix = e.unravel(i);
    const T v = load<T>(x.at(ix), x.dtype);
    const T cdf2 = elem::add(T(1), erfOf(elem::mul(v, T(kSqrtHalf))));
    store<T>(y.at(ix), y.dtype, elem::mul(elem::mul(v, T(0.5)), cdf2));
  }
};

// dx = dy·(Φ(x) + x·φ(x)), φ(x) = exp(-x²/2)/√(2π).
template <typename T>
struct GeluBackwardFn {
  Extents e;
  Operand x, dy, dx;
  TPSIM_HD std::int64_t count() const { return e.numel; }
  TPSIM_HD void operator()(std::int64_t i) const {
    const Index ix = e.unravel(i);
    const T v = load<T>(x.at(ix), x.dtype);
    const T cdf = elem::mul(T(0.5), elem::add(T(1), erfOf(elem::mul(v, T(kSqrtHalf)))));
    const T pdf = elem::mul(expOf(elem::mul(elem::mul(T(-0.5), v), v)), T(kInvSqrt2Pi));
    const T g = load<T>(dy.at(ix), dy.dtype);
    store<T>(dx.at(ix), dx.dtype, elem::mul(g, elem::add(cdf, elem::mul(v, pdf))));
  }
};

// ---- MXFP8 ----------------------------------------------------------------------------------------

// Work item = one block: (row a, block b) for axis 1, (column a, block b) for axis 0. x, data and
// scales are matrices (at2); element k of block (a, b) is (a, k) for axis 1, (k, a) for axis 0.
struct QuantizeMxfp8Fn {
  Operand x, data, scales;
  std::int64_t rows, cols;
  int axis;
  TPSIM_HD std::int64_t along() const { return axis == 1 ? cols : rows; }
  TPSIM_HD std::int64_t blocks() const { return (along() + kMxBlock - 1) / kMxBlock; }
  TPSIM_HD std::int64_t count() const { return (axis == 1 ? rows : cols) * blocks(); }
  TPSIM_HD void operator()(std::int64_t item) const {
    const std::int64_t a = item / blocks(), b = item % blocks();
    const std::int64_t first = b * kMxBlock, last = first + kMxBlock < along() ? first + kMxBlock : along();
    auto elem2 = [&](const Operand& v, std::int64_t k) { return axis == 1 ? v.at2(a, k) : v.at2(k, a); };
    char* scale = axis == 1 ? scales.at2(a, b) : scales.at2(b, a);
    double amax = 0.0;
    bool nan = false;
    for (std::int64_t k = first; k < last; ++k) {
      const double v = load<double>(elem2(x, k), x.dtype);
      const double mag = elem::doubleFromBits(elem::bitsOf(v) & 0x7fffffffffffffffull);
      nan = nan || elem::isNan(v);
      amax = amax < mag ? mag : amax;  // std::max's rule, as SimCompute
    }
    if (nan) {
      *reinterpret_cast<std::uint8_t*>(scale) = 0xff;
      for (std::int64_t k = first; k < last; ++k) *reinterpret_cast<std::uint8_t*>(elem2(data, k)) = 0x7f;
      return;
    }
    const int e = elem::mxfp8ScaleExponent(amax);
    *reinterpret_cast<std::uint8_t*>(scale) = std::uint8_t(e + 127);
    for (std::int64_t k = first; k < last; ++k)
      *reinterpret_cast<std::uint8_t*>(elem2(data, k)) =
          elem::toE4m3(elem::unscale(load<double>(elem2(x, k), x.dtype), e));
  }
};

// Work item = element (r, c) of y. Both factors are exact in double, so the store is the only
// rounding.
struct DequantizeMxfp8Fn {
  Operand data, scales, y;
  std::int64_t rows, cols;
  int axis;
  TPSIM_HD std::int64_t count() const { return rows * cols; }
  TPSIM_HD void operator()(std::int64_t item) const {
    const std::int64_t r = item / cols, c = item % cols;
    const char* s = axis == 1 ? scales.at2(r, c / kMxBlock) : scales.at2(r / kMxBlock, c);
    const double v = elem::mul(double(elem::e4m3ToFloat(*reinterpret_cast<const std::uint8_t*>(data.at2(r, c)))),
                               double(elem::e8m0ToFloat(*reinterpret_cast<const std::uint8_t*>(s))));
    store<double>(y.at2(r, c), y.dtype, v);
  }
};

// ---- Embedding rows -------------------------------------------------------------------------------

// Work item = element (i, j) of out (n, h); ids is a dense int64 array of n.
template <typename T>
struct GatherRowsFn {
  Operand table, out;
  const std::int64_t* ids;
  std::int64_t first, vocab, n, h;
  TPSIM_HD std::int64_t count() const { return n * h; }
  TPSIM_HD void operator()(std::int64_t item) const {
    const std::int64_t i = item / h, j = item % h;
    const std::int64_t row = ids[i] - first;
    char* dst = out.at2(i, j);
    if (0 <= row && row < vocab)
      convert<T>(table.at2(row, j), table.dtype, dst, out.dtype, out.bytes);
    else
      store<T>(dst, out.dtype, T(0));
  }
};

// Work item = (segment s, column j). Segment s lists, in increasing i, the grad rows order[p] for p
// in [segStart[s], segStart[s+1]) that all add into table row segRow[s]: every table element gets
// its adds in increasing i, each rounded once into the table's dtype, as SimCompute does.
template <typename T>
struct ScatterAddRowsFn {
  Operand grad, table;
  const std::int64_t* order;     // (owned ids), grad rows sorted by (table row, i)
  const std::int64_t* segStart;  // (segments + 1)
  const std::int64_t* segRow;    // (segments)
  std::int64_t segments, h;
  TPSIM_HD std::int64_t count() const { return segments * h; }
  TPSIM_HD void operator()(std::int64_t item) const {
    const std::int64_t s = item / h, j = item % h;
    char* dst = table.at2(segRow[s], j);
    for (std::int64_t p = segStart[s]; p < segStart[s + 1]; ++p) {
      const T g = load<T>(grad.at2(order[p], j), grad.dtype);
      store<T>(dst, table.dtype, elem::add(load<T>(dst, table.dtype), g));
    }
  }
};

// ---- The kernel -------------------------------------------------------------------------------------

#if defined(__CUDACC__)
// Grid-stride loop over fn's work items; GpuCompute::launch picks the grid.
template <typename Fn>
__global__ void forEachItem(Fn fn, std::int64_t count) {
  const std::int64_t step = std::int64_t(gridDim.x) * blockDim.x;
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += step) fn(i);
}
#endif

// ---- Operands from views (host) -----------------------------------------------------------------

inline Extents extentsOf(const Shape& s) {
  Extents e;
  const int pad = kRank - s.rank();
  for (int i = 0; i < s.rank(); ++i) e.dim[pad + i] = s[i];
  e.numel = s.numel();
  return e;
}

// v over an iteration shape of strides.rank() modes: v's own strides, or broadcast ones.
inline Operand operandOf(ConstView v, const Strides& strides, bool dense) {
  Operand o;
  o.data = static_cast<char*>(const_cast<void*>(v.data()));
  o.dtype = v.dtype();
  o.bytes = int(dtypeSize(v.dtype()));
  const int pad = kRank - strides.rank();
  for (int i = 0; i < strides.rank(); ++i) o.stride[pad + i] = strides[i];
  o.dense = dense;
  return o;
}
inline Operand operandOf(ConstView v) { return operandOf(v, v.strides(), v.isContiguous()); }

// Strides that repeat a vector of v.dim(-1) elements (stride `inner`) over every row of v.
inline Strides rowBroadcast(ConstView v, std::int64_t inner) {
  Strides s = v.strides();
  for (int i = 0; i + 1 < v.rank(); ++i) s[i] = 0;
  s[v.rank() - 1] = inner;
  return s;
}

// Runs fn(T{}) with T = double when any operand is fp64 (or int64, which fp32 cannot hold), else
// T = float: compute.h's "fp32 arithmetic, fp64 for fp64 data", as SimCompute picks it.
template <typename Fn>
void withAccumType(std::initializer_list<DType> dtypes, Fn&& fn) {
  for (DType d : dtypes)
    if (d == DType::kFloat64 || d == DType::kInt64) return fn(double{});
  fn(float{});
}

// The bytes of `value` rounded once to `dtype` (SimCompute's fill stores the double), low bytes
// first. Needs storable(value, dtype).
inline std::uint64_t elementBits(DType dtype, double value) {
  alignas(8) char element[8] = {};
  store<double>(element, dtype, value);
  std::uint64_t bits = 0;
  std::memcpy(&bits, element, sizeof bits);
  return bits;
}

// scatterAddRows' work list: the owned (table row, i) pairs sorted, cut into one segment per row.
// buffer = order (owned) | segStart (segments + 1) | segRow (segments), as ScatterAddRowsFn reads it.
struct ScatterPlan {
  std::vector<std::int64_t> buffer;
  std::int64_t owned = 0, segments = 0;
};

inline ScatterPlan planScatter(const std::vector<std::int64_t>& ids, std::int64_t first, std::int64_t vocab) {
  std::vector<std::pair<std::int64_t, std::int64_t>> rows;  // (table row, i)
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const std::int64_t row = ids[i] - first;
    if (0 <= row && row < vocab) rows.emplace_back(row, std::int64_t(i));
  }
  std::sort(rows.begin(), rows.end());  // i is unique, so within a row the order is increasing i
  std::vector<std::int64_t> segStart, segRow;
  ScatterPlan plan;
  plan.owned = std::int64_t(rows.size());
  for (std::size_t p = 0; p < rows.size(); ++p) {
    if (p == 0 || rows[p].first != rows[p - 1].first) {
      segStart.push_back(std::int64_t(p));
      segRow.push_back(rows[p].first);
    }
    plan.buffer.push_back(rows[p].second);
  }
  segStart.push_back(plan.owned);
  plan.segments = std::int64_t(segRow.size());
  plan.buffer.insert(plan.buffer.end(), segStart.begin(), segStart.end());
  plan.buffer.insert(plan.buffer.end(), segRow.begin(), segRow.end());
  return plan;
}

// ---- Ops: launch(op, fn) runs all of fn's work items; arguments are already checked -------------

template <typename Launch>
void runFill(Launch&& launch, View y, double value) {
  launch("fill", FillFn{extentsOf(y.shape()), operandOf(y), elementBits(y.dtype(), value)});
}

// Element by element, converting; same-dtype dense copies are a memcpy at the caller.
template <typename Launch>
void runCopy(Launch&& launch, ConstView x, View y) {
  withAccumType({x.dtype(), y.dtype()}, [&](auto zero) {
    using T = decltype(zero);
    launch("copy", CopyFn<T>{extentsOf(x.shape()), operandOf(x), operandOf(y)});
  });
}

// Lowers *firstBad to the least row-major index of an element of x that `to` cannot hold, in the
// accumulation type runCopy converts in.
template <typename Launch>
void runFindUnstorable(Launch&& launch, const char* op, ConstView x, DType to, unsigned long long* firstBad) {
  withAccumType({x.dtype(), to}, [&](auto zero) {
    using T = decltype(zero);
    launch(op, FindUnstorableFn<T>{extentsOf(x.shape()), operandOf(x), to, firstBad});
  });
}

template <typename Launch>
void runAxpy(Launch&& launch, float alpha, ConstView x, View y) {
  withAccumType({x.dtype(), y.dtype()}, [&](auto zero) {
    using T = decltype(zero);
    launch("axpy", AxpyFn<T>{extentsOf(x.shape()), operandOf(x), operandOf(y), T(alpha)});
  });
}

template <typename Launch>
void runScale(Launch&& launch, View y, float alpha) {
  withAccumType({y.dtype()}, [&](auto zero) {
    using T = decltype(zero);
    launch("scale", ScaleFn<T>{extentsOf(y.shape()), operandOf(y), T(alpha)});
  });
}

template <typename Launch>
void runAddBias(Launch&& launch, ConstView bias, View y) {
  withAccumType({bias.dtype(), y.dtype()}, [&](auto zero) {
    using T = decltype(zero);
    launch("addBias", AddBiasFn<T>{extentsOf(y.shape()), operandOf(bias, rowBroadcast(y, bias.stride(0)), false),
                                   operandOf(y)});
  });
}

template <typename Launch>
void runSumRows(Launch&& launch, ConstView y, View out, float beta) {
  withAccumType({y.dtype(), out.dtype()}, [&](auto zero) {
    using T = decltype(zero);
    launch("sumRows", SumRowsFn<T>{extentsOf(y.shape()), operandOf(y), operandOf(out), T(beta)});
  });
}

template <typename Launch>
void runGelu(Launch&& launch, ConstView x, View y) {
  withAccumType({x.dtype(), y.dtype()}, [&](auto zero) {
    using T = decltype(zero);
    launch("gelu", GeluFn<T>{extentsOf(x.shape()), operandOf(x), operandOf(y)});
  });
}

template <typename Launch>
void runGeluBackward(Launch&& launch, ConstView x, ConstView dy, View dx) {
  withAccumType({x.dtype(), dy.dtype(), dx.dtype()}, [&](auto zero) {
    using T = decltype(zero);
    launch("geluBackward", GeluBackwardFn<T>{extentsOf(x.shape()), operandOf(x), operandOf(dy), operandOf(dx)});
  });
}

template <typename Launch>
void runQuantizeMxfp8(Launch&& launch, ConstView x, View data, View scales, int axis) {
  launch("quantizeMxfp8",
         QuantizeMxfp8Fn{operandOf(x), operandOf(data), operandOf(scales), x.dim(0), x.dim(1), axis});
}

template <typename Launch>
void runDequantizeMxfp8(Launch&& launch, ConstView data, ConstView scales, int axis, View y) {
  launch("dequantizeMxfp8",
         DequantizeMxfp8Fn{operandOf(data), operandOf(scales), operandOf(y), data.dim(0), data.dim(1), axis});
}

// ids: a dense int64 array of out.dim(0), in the memory the launcher runs on.
template <typename Launch>
void runGatherRows(Launch&& launch, ConstView table, const std::int64_t* ids, std::int64_t first, View out) {
  withAccumType({table.dtype(), out.dtype()}, [&](auto zero) {
    using T = decltype(zero);
    launch("gatherRows", GatherRowsFn<T>{operandOf(table), operandOf(out), ids, first, table.dim(0), out.dim(0),
                                         out.dim(1)});
  });
}

// buffer: plan.buffer, in the memory the launcher runs on.
template <typename Launch>
void runScatterAddRows(Launch&& launch, ConstView grad, const ScatterPlan& plan, const std::int64_t* buffer,
                       View table) {
  const std::int64_t* segStart = buffer + plan.owned;
  withAccumType({grad.dtype(), table.dtype()}, [&](auto zero) {
    using T = decltype(zero);
    launch("scatterAddRows", ScatterAddRowsFn<T>{operandOf(grad), operandOf(table), buffer, segStart,
                                                 segStart + plan.segments + 1, plan.segments, table.dim(1)});
  });
}

}  // namespace tpsim::gpu::kern
