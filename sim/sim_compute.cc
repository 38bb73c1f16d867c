#include "sim/sim_compute.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <mutex>
#include <unordered_map>
#include <new>
#include <vector>

#include <Eigen/Core>

#include "backends/compute_checks.h"
#include "backends/element_math.h"
#include "backends/errors.h"
#include "backends/huge_pages.h"
#include "backends/stop.h"
#include "sim/gelu.h"

namespace tpsim::sim {
namespace {

using Eigen::Dynamic;
using Eigen::Index;

constexpr std::size_t kAlignment = 64;
constexpr double kSqrtHalf = 0.70710678118654752440;    // 1/√2
constexpr double kInvSqrt2Pi = 0.39894228040143267794;  // 1/√(2π)

// Operands with a unit-stride mode are mapped in place. OuterStride<> (inner stride fixed at 1),
// not Stride<Dynamic, Dynamic>: Eigen's gemm copies any operand whose inner stride is only known
// at run time (blas_traits::HasUsableDirectAccess), which would break the no-copy fp32 path.
template <typename T, int Order>
using ConstMap =
    Eigen::Map<const Eigen::Matrix<T, Dynamic, Dynamic, Order>, Eigen::Unaligned, Eigen::OuterStride<>>;
template <typename T, int Order>
using MutMap = Eigen::Map<Eigen::Matrix<T, Dynamic, Dynamic, Order>, Eigen::Unaligned, Eigen::OuterStride<>>;
template <typename T>
using Dense = Eigen::Matrix<T, Dynamic, Dynamic, Eigen::RowMajor>;

// Freed blocks of 1 MiB or more are kept for reuse, by exact size: a fresh block of that size
// page-faults on first touch, which cost about 5% of an MLP step of tpsim bench -W mlp. Small
// blocks go straight back to malloc, which reuses them well. The cache holds at most
// kMaxCachedBytes; AddressSanitizer builds bypass it so that use-after-free stays visible.
// A world's ranks reuse each other's blocks while it runs; when it returns, the blocks go back to
// malloc (releaseCachedHostBlocks), for whatever the process does next.
class BlockCache {
 public:
  static BlockCache& instance() {
    static BlockCache* cache = new BlockCache;  // never destroyed: tensors may outlive static destruction
    return *cache;
  }

  void* allocate(std::size_t bytes) {
    if (bytes >= kMinCachedBytes && kEnabled) {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.find(bytes);
      if (it != free_.end() && !it->second.empty()) {
        void* block = it->second.back();
        it->second.pop_back();
        cached_ -= bytes;
        return static_cast<char*>(block) + kAlignment;
      }
    }
    // One alignment unit in front of the data remembers the size for release().
    void* block = std::aligned_alloc(kAlignment, bytes + kAlignment);
    if (block == nullptr) throw std::bad_alloc();
    if (bytes >= kMinHugeBytes) adviseHugePages(block, bytes + kAlignment);
    *static_cast<std::size_t*>(block) = bytes;
    return static_cast<char*>(block) + kAlignment;
  }

  void release(void* data) {
    void* block = static_cast<char*>(data) - kAlignment;
    const std::size_t bytes = *static_cast<std::size_t*>(block);
    if (bytes >= kMinCachedBytes && kEnabled) {
      std::lock_guard<std::mutex> lock(mu_);
      if (cached_ + bytes <= kMaxCachedBytes) {
        free_[bytes].push_back(block);
        cached_ += bytes;
        return;
      }
    }
    std::free(block);
  }

  void releaseAll() {
    std::unordered_map<std::size_t, std::vector<void*>> blocks;
    {
      std::lock_guard<std::mutex> lock(mu_);
      blocks.swap(free_);
      cached_ = 0;
    }
    for (const auto& [bytes, list] : blocks)
      for (void* block : list) std::free(block);
  }

 private:
#if defined(__SANITIZE_ADDRESS__)
  static constexpr bool kEnabled = false;
#else
  static constexpr bool kEnabled = true;
#endif
  static constexpr std::size_t kMinCachedBytes = std::size_t(1) << 20;
  // Fresh blocks this large go on huge pages (backends/huge_pages.h), whose faults cost a 2 MiB page
  // each instead of a 4 KiB one.
  static constexpr std::size_t kMinHugeBytes = std::size_t(4) << 20;
  static constexpr std::size_t kMaxCachedBytes = std::size_t(2) << 30;
  std::mutex mu_;
  std::unordered_map<std::size_t, std::vector<void*>> free_;
  std::size_t cached_ = 0;
};

void freeHost(void* p) { BlockCache::instance().release(p); }

}  // namespace

void releaseCachedHostBlocks() { BlockCache::instance().releaseAll(); }

namespace {

// True when every view is dense fp32: the elementwise ops then run plain loops over float
// pointers, doing exactly the float operations of the general path (same results, bit for bit).
template <typename... Views>
bool denseFp32(const Views&... views) {
  return ((views.dtype() == DType::kFloat32 && views.isContiguous()) && ...);
}

// ---- Element access -----------------------------------------------------------------------------

template <typename T>
T load(const void* p, DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return T(*static_cast<const float*>(p));
    case DType::kBFloat16: return T(bf16ToFloat(*static_cast<const std::uint16_t*>(p)));
    case DType::kFloat16: return T(halfToFloat(*static_cast<const std::uint16_t*>(p)));
    case DType::kFloat64: return T(*static_cast<const double*>(p));
    case DType::kInt64: return T(*static_cast<const std::int64_t*>(p));
    case DType::kFloat8E4M3: return T(e4m3ToFloat(*static_cast<const std::uint8_t*>(p)));
    case DType::kFloat8E8M0: return T(e8m0ToFloat(*static_cast<const std::uint8_t*>(p)));
  }
  TPSIM_INTERNAL_ASSERT(false, "unknown dtype ", int(dtype));
}

// Stores v rounded once (to nearest even) to `dtype`: a double reaches 16 bits through a float
// rounded to odd, which keeps that second rounding equal to a direct one.
template <typename T>
void store(void* p, DType dtype, T v) {
  switch (dtype) {
    case DType::kFloat32: *static_cast<float*>(p) = float(v); return;
    case DType::kBFloat16: *static_cast<std::uint16_t*>(p) = floatToBf16(elem::toOddFloat(v)); return;
    case DType::kFloat16: *static_cast<std::uint16_t*>(p) = floatToHalf(elem::toOddFloat(v)); return;
    case DType::kFloat64: *static_cast<double*>(p) = double(v); return;
    case DType::kInt64:
      // 2^63 is exact in float and double; NaN fails both comparisons.
      TPSIM_CHECK(v >= T(-9223372036854775808.0) && v < T(9223372036854775808.0),
                  "SimCompute: an int64 output must receive values in [-2^63, 2^63), got ", v);
      *static_cast<std::int64_t*>(p) = std::int64_t(v);
      return;
    case DType::kFloat8E4M3: *static_cast<std::uint8_t*>(p) = toE4m3(double(v)); return;
    case DType::kFloat8E8M0: *static_cast<std::uint8_t*>(p) = toE8m0(double(v)); return;
  }
  TPSIM_INTERNAL_ASSERT(false, "unknown dtype ", int(dtype));
}

// dst = src rounded once to dst's dtype; bitwise when the dtypes match (NaN payloads survive).
template <typename T>
void convert(const void* src, DType from, void* dst, DType to) {
  if (from == to)
    std::memcpy(dst, src, dtypeSize(to));
  else
    store<T>(dst, to, load<T>(src, from));
}

// Runs fn(T{}) with T = double when any operand is fp64 (or int64, which fp32 cannot hold), else
// T = float: compute.h's "fp32 arithmetic, fp64 for fp64 data".
template <typename Fn>
void withAccumType(std::initializer_list<DType> dtypes, Fn&& fn) {
  for (DType d : dtypes)
    if (d == DType::kFloat64 || d == DType::kInt64) return fn(double{});
  fn(float{});
}

// Calls fn(offsets) for every element of `shape` in row-major order; offsets[k] is the element's
// offset (in elements) in the k-th operand, whose strides are strides[k].
template <std::size_t N, typename Fn>
void forEach(const Shape& shape, const std::array<Strides, N>& strides, Fn&& fn) {
  static_assert(Shape::kMaxRank == 4, "forEach unrolls exactly four modes");
  std::int64_t dims[4] = {1, 1, 1, 1};
  std::int64_t st[N][4] = {};
  const int pad = 4 - shape.rank();  // leading modes of extent 1
  for (int i = 0; i < shape.rank(); ++i) {
    dims[pad + i] = shape[i];
    for (std::size_t k = 0; k < N; ++k) st[k][pad + i] = strides[k][i];
  }
  std::array<std::int64_t, N> off;
  for (std::int64_t i0 = 0; i0 < dims[0]; ++i0)
    for (std::int64_t i1 = 0; i1 < dims[1]; ++i1)
      for (std::int64_t i2 = 0; i2 < dims[2]; ++i2)
        for (std::int64_t i3 = 0; i3 < dims[3]; ++i3) {
          for (std::size_t k = 0; k < N; ++k)
            off[k] = i0 * st[k][0] + i1 * st[k][1] + i2 * st[k][2] + i3 * st[k][3];
          fn(off);
        }
}

// Strides that repeat a vector of v.dim(-1) elements (stride `inner`) over every row of v.
Strides rowBroadcast(ConstView v, std::int64_t inner) {
  Strides s = v.strides();
  for (int i = 0; i + 1 < v.rank(); ++i) s[i] = 0;
  s[v.rank() - 1] = inner;
  return s;
}

// The int64 ids, in row-major order.
std::vector<std::int64_t> flatIds(ConstView ids) {
  std::vector<std::int64_t> flat;  // (n)
  flat.reserve(std::size_t(ids.numel()));
  forEach<1>(ids.shape(), {ids.strides()},
             [&](const auto& o) { flat.push_back(*static_cast<const std::int64_t*>(ids.at(o[0]))); });
  return flat;
}

// ---- gemm ---------------------------------------------------------------------------------------

// A mode of extent <= 1 is never stepped along, so its stride does not matter.
bool unitStride(ConstView v, int mode) { return v.stride(mode) == 1 || v.dim(mode) <= 1; }
Eigen::OuterStride<> outerStride(ConstView v, int outer, int inner) {
  return Eigen::OuterStride<>(v.dim(outer) <= 1 ? std::max<Index>(v.dim(inner), 1) : v.stride(outer));
}

// v (R, C) widened to a dense row-major matrix of T.
template <typename T>
Dense<T> toDense(ConstView v) {
  Dense<T> m(v.dim(0), v.dim(1));  // (R, C)
  forEach<2>(v.shape(), {v.strides(), v.shape().contiguousStrides()},
             [&](const auto& o) { m.data()[o[1]] = load<T>(v.at(o[0]), v.dtype()); });
  return m;
}

// Calls fn(map) with v (R, C) as an Eigen matrix of T: in place when v already holds T with a
// unit-stride mode, else through a dense copy (16-bit widening, or no unit-stride mode).
template <typename T, typename Fn>
void withMatrix(ConstView v, Fn&& fn) {
  const Index rows = v.dim(0), cols = v.dim(1);
  if (v.dtype() == dtypeOf<T>() && unitStride(v, 1))
    return fn(ConstMap<T, Eigen::RowMajor>(v.typed<T>(), rows, cols, outerStride(v, 0, 1)));
  if (v.dtype() == dtypeOf<T>() && unitStride(v, 0))
    return fn(ConstMap<T, Eigen::ColMajor>(v.typed<T>(), rows, cols, outerStride(v, 1, 0)));
  const Dense<T> dense = toDense<T>(v);  // (R, C)
  fn(ConstMap<T, Eigen::RowMajor>(dense.data(), rows, cols, Eigen::OuterStride<>(cols)));
}

// C = alpha·A·B + beta·C in T: the plain Eigen expression, per tile of C for a large product
// (SimCompute::kGemmTile rows, or columns when N > M), the tiles on `pool`.
template <typename T, typename CMap, typename AMap, typename BMap>
void accumulate(CMap& c, const AMap& a, const BMap& b, float alpha, float beta, HostPool* pool) {  // (M,N) (M,K) (K,N)
  auto product = [&](auto&& ct, const auto& at, const auto& bt) {
    if (beta == 0.f)
      ct.setZero();  // ignores NaN in the old c
    else if (beta != 1.f)
      ct *= T(beta);
    ct.noalias() += T(alpha) * at * bt;
  };
  constexpr Index tile = SimCompute::kGemmTile;
  const bool byRows = c.rows() >= c.cols();
  const Index extent = byRows ? c.rows() : c.cols();
  if (double(c.rows()) * double(c.cols()) * double(a.cols()) < SimCompute::kGemmTiledMacs || extent < 2 * tile)
    return product(c, a, b);
  runTasks(pool, (extent + tile - 1) / tile, [&](std::int64_t i) {
    const Index first = i * tile, size = std::min(tile, extent - first);
    if (byRows)
      product(c.middleRows(first, size), a.middleRows(first, size), b);
    else
      product(c.middleCols(first, size), a, b.middleCols(first, size));
  });
}

template <typename T, typename AMap, typename BMap>
void gemmInto(const AMap& a, const BMap& b, View c, float alpha, float beta, HostPool* pool) {  // (M,K) (K,N) (M,N)
  const Index m = c.dim(0), n = c.dim(1);
  if (c.dtype() == dtypeOf<T>() && unitStride(c, 1)) {
    MutMap<T, Eigen::RowMajor> cm(c.typed<T>(), m, n, outerStride(c, 0, 1));  // (M, N)
    return accumulate<T>(cm, a, b, alpha, beta, pool);
  }
  if (c.dtype() == dtypeOf<T>() && unitStride(c, 0)) {
    MutMap<T, Eigen::ColMajor> cm(c.typed<T>(), m, n, outerStride(c, 1, 0));  // (M, N)
    return accumulate<T>(cm, a, b, alpha, beta, pool);
  }
  // c is 16-bit or has no unit-stride mode: accumulate in T, then round once into c.
  Dense<T> acc(m, n);  // (M, N)
  if (beta == 0.f)
    acc.setZero();
  else
    acc = T(beta) * toDense<T>(c);
  MutMap<T, Eigen::RowMajor> accMap(acc.data(), m, n, Eigen::OuterStride<>(n));  // (M, N)
  accumulate<T>(accMap, a, b, alpha, 1.f, pool);
  forEach<2>(c.shape(), {c.shape().contiguousStrides(), c.strides()},
             [&](const auto& o) { store<T>(c.at(o[1]), c.dtype(), acc.data()[o[0]]); });
}

template <typename T>
void gemmAs(ConstView a, ConstView b, View c, float alpha, float beta, HostPool* pool) {
  withMatrix<T>(a, [&](const auto& am) {
    withMatrix<T>(b, [&](const auto& bm) { gemmInto<T>(am, bm, c, alpha, beta, pool); });
  });
}

// fp32 gemm through sgemm: fp32 operands in place, 16-bit ones widened to dense fp32 first.
void gemmPacked(GemmKernel kernel, ConstView a, ConstView b, View c, float alpha, float beta, HostPool* pool) {
  const std::int64_t m = c.dim(0), n = c.dim(1), k = a.dim(1);
  if (double(m) * double(n) * double(k) < SimCompute::kGemmTiledMacs) pool = nullptr;
  Dense<float> aDense, bDense;  // (M, K) (K, N), when widened
  auto matrix = [](ConstView v, Dense<float>& dense) {
    if (v.dtype() == DType::kFloat32) return FloatMatrix{v.typed<float>(), v.stride(0), v.stride(1)};
    dense = toDense<float>(v);
    return FloatMatrix{dense.data(), v.dim(1), 1};
  };
  const FloatMatrix am = matrix(a, aDense), bm = matrix(b, bDense);
  if (c.dtype() == DType::kFloat32 && (unitStride(c, 0) || unitStride(c, 1)))
    return sgemm(kernel, m, n, k, alpha, am, bm, beta, c.typed<float>(), c.stride(0), c.stride(1), pool);
  // c is 16-bit or has no unit-stride mode: accumulate in fp32, then round once into c.
  Dense<float> acc(m, n);  // (M, N)
  if (beta != 0.f) acc = toDense<float>(c);
  sgemm(kernel, m, n, k, alpha, am, bm, beta, acc.data(), n, 1, pool);
  forEach<2>(c.shape(), {c.shape().contiguousStrides(), c.strides()},
             [&](const auto& o) { store<float>(c.at(o[1]), c.dtype(), acc.data()[o[0]]); });
}

// ---- MXFP8 --------------------------------------------------------------------------------------

constexpr std::int64_t kMxBlock = compute_checks::kMxfp8Block;

// Calls fn(a, b, first, last) for every block of an (R, C) matrix: block b of row (axis 1) or
// column (axis 0) a holds the elements [first, last) along `axis`.
template <typename Fn>
void forEachMxBlock(std::int64_t rows, std::int64_t cols, int axis, Fn&& fn) {
  const std::int64_t along = axis == 1 ? cols : rows, across = axis == 1 ? rows : cols;
  for (std::int64_t a = 0; a < across; ++a)
    for (std::int64_t b = 0; b * kMxBlock < along; ++b) fn(a, b, b * kMxBlock, std::min(along, (b + 1) * kMxBlock));
}

}  // namespace

// ---- Memory -------------------------------------------------------------------------------------

Tensor SimCompute::empty(Shape shape, DType dtype) {
  // aligned_alloc wants a multiple of the alignment; never 0 bytes, so the Tensor stays defined.
  const std::size_t bytes = std::size_t(shape.numel()) * dtypeSize(dtype);
  const std::size_t padded = std::max(kAlignment, (bytes + kAlignment - 1) / kAlignment * kAlignment);
  return Tensor(BlockCache::instance().allocate(padded), shape, dtype, Device::kHost, &freeHost);
}

void SimCompute::upload(const void* host, View dst) {
  compute_checks::checkUpload(Device::kHost, dst);
  if (dst.bytes() != 0) std::memcpy(dst.data(), host, dst.bytes());
}

void SimCompute::download(ConstView src, void* host) {
  compute_checks::checkDownload(Device::kHost, src);
  if (src.bytes() != 0) std::memcpy(host, src.data(), src.bytes());
}

// ---- Elementwise --------------------------------------------------------------------------------

void SimCompute::fill(View y, double value) {
  compute_checks::checkFill(Device::kHost, y);
  if (denseFp32(y)) {
    float* p = y.typed<float>();
    std::fill(p, p + y.numel(), float(value));
    return;
  }
  forEach<1>(y.shape(), {y.strides()}, [&](const auto& o) { store<double>(y.at(o[0]), y.dtype(), value); });
}

void SimCompute::copy(ConstView x, View y) {
  compute_checks::checkCopy(Device::kHost, x, y);
  if (x.dtype() == y.dtype() && x.isContiguous() && y.isContiguous()) {
    if (x.bytes() != 0 && x.data() != y.data()) std::memmove(y.data(), x.data(), x.bytes());
    return;
  }
  withAccumType({x.dtype(), y.dtype()}, [&](auto zero) {
    using T = decltype(zero);
    forEach<2>(x.shape(), {x.strides(), y.strides()},
               [&](const auto& o) { convert<T>(x.at(o[0]), x.dtype(), y.at(o[1]), y.dtype()); });
  });
}

void SimCompute::axpy(float alpha, ConstView x, View y) {
  compute_checks::checkAxpy(Device::kHost, x, y);
  if (denseFp32(x, y)) {
    const float* xp = x.typed<float>();
    float* yp = y.typed<float>();
    for (std::int64_t i = 0, n = x.numel(); i < n; ++i) yp[i] = elem::axpyBody(yp[i], alpha, xp[i]);
    return;
  }
  withAccumType({x.dtype(), y.dtype()}, [&](auto zero) {
    using T = decltype(zero);
    forEach<2>(x.shape(), {x.strides(), y.strides()}, [&](const auto& o) {
      void* yp = y.at(o[1]);
      store<T>(yp, y.dtype(), elem::axpyBody(load<T>(yp, y.dtype()), T(alpha), load<T>(x.at(o[0]), x.dtype())));
    });
  });
}

void SimCompute::scale(View y, float alpha) {
  compute_checks::checkScale(Device::kHost, y);
  withAccumType({y.dtype()}, [&](auto zero) {
    using T = decltype(zero);
    forEach<1>(y.shape(), {y.strides()}, [&](const auto& o) {
      void* yp = y.at(o[0]);
      store<T>(yp, y.dtype(), elem::scaleBody(load<T>(yp, y.dtype()), T(alpha)));
    });
  });
}

// ---- gemm ---------------------------------------------------------------------------------------

SimCompute::SimCompute(HostPool* pool, GemmKernel fp32Kernel) : pool_(pool), fp32Kernel_(fp32Kernel) {
  TPSIM_CHECK(gemmKernelRuns(fp32Kernel), "SimCompute: GEMM kernel ", gemmKernelName(fp32Kernel),
              " does not run on this core");
}

void SimCompute::gemm(ConstView a, ConstView b, View c, float alpha, float beta) {
  compute_checks::checkGemm(Device::kHost, a, b, c);
  throwIfStopped(currentStopFlag(), "sim");  // a progress point for the Eigen products too, which have no tasks
  if (a.dtype() == DType::kFloat64)
    gemmAs<double>(a, b, c, alpha, beta, pool_);
  else if (fp32Kernel_ == GemmKernel::kEigen)
    gemmAs<float>(a, b, c, alpha, beta, pool_);
  else
    gemmPacked(fp32Kernel_, a, b, c, alpha, beta, pool_);
}

// ---- Bias, reductions, activations ---------------------------------------------------------------

void SimCompute::addBias(ConstView bias, View y) {
  compute_checks::checkAddBias(Device::kHost, bias, y);
  if (denseFp32(bias, y)) {
    const float* b = bias.typed<float>();
    float* yp = y.typed<float>();
    const std::int64_t n = bias.dim(0), rows = n ? y.numel() / n : 0;
    for (std::int64_t r = 0; r < rows; ++r, yp += n)
      for (std::int64_t j = 0; j < n; ++j) yp[j] = elem::addBiasBody(yp[j], b[j]);
    return;
  }
  withAccumType({bias.dtype(), y.dtype()}, [&](auto zero) {
    using T = decltype(zero);
    forEach<2>(y.shape(), {y.strides(), rowBroadcast(y, bias.stride(0))}, [&](const auto& o) {
      void* yp = y.at(o[0]);
      store<T>(yp, y.dtype(), elem::addBiasBody(load<T>(yp, y.dtype()), load<T>(bias.at(o[1]), bias.dtype())));
    });
  });
}

void SimCompute::sumRows(ConstView y, View out, float beta) {
  compute_checks::checkSumRows(Device::kHost, y, out);
  const std::int64_t n = y.dim(-1);
  if (denseFp32(y, out)) {
    std::vector<float> acc(std::size_t(n), 0.f);  // (N), rows added in increasing order
    const float* yp = y.typed<float>();
    const std::int64_t rows = n ? y.numel() / n : 0;
    for (std::int64_t r = 0; r < rows; ++r, yp += n)
      for (std::int64_t j = 0; j < n; ++j) acc[j] = elem::sumRowsStep(acc[j], yp[j]);
    float* o = out.typed<float>();
    for (std::int64_t j = 0; j < n; ++j) o[j] = elem::sumRowsFinish(acc[j], beta, o[j]);
    return;
  }
  withAccumType({y.dtype(), out.dtype()}, [&](auto zero) {
    using T = decltype(zero);
    std::vector<T> acc(std::size_t(n), T(0));  // (N); forEach visits rows in increasing order
    forEach<2>(y.shape(), {y.strides(), rowBroadcast(y, 1)}, [&](const auto& o) {
      T& sum = acc[std::size_t(o[1])];
      sum = elem::sumRowsStep(sum, load<T>(y.at(o[0]), y.dtype()));
    });
    for (std::int64_t j = 0; j < n; ++j) {
      void* op = out.at(j * out.stride(0));
      store<T>(op, out.dtype(), elem::sumRowsFinish(acc[std::size_t(j)], T(beta), load<T>(op, out.dtype())));
    }
  });
}

// Φ(x) and φ(x) as PyTorch writes them: erf of x·(1/√2), not x/√2.
void SimCompute::gelu(ConstView x, View y) {
  compute_checks::checkGelu(Device::kHost, x, y);
  if (denseFp32(x, y)) {
    const float* xp = x.typed<float>();
    float* yp = y.typed<float>();
    if (const auto isa = vectorGeluIsa()) return vectorGelu(*isa, xp, yp, x.numel());
    for (std::int64_t i = 0, n = x.numel(); i < n; ++i) yp[i] = geluOf(xp[i]);
    return;
  }
  withAccumType({x.dtype(), y.dtype()}, [&](auto zero) {
    using T = decltype(zero);
    forEach<2>(x.shape(), {x.strides(), y.strides()}, [&](const auto& o) {
      const T v = load<T>(x.at(o[0]), x.dtype());
      store<T>(y.at(o[1]), y.dtype(), v * T(0.5) * (T(1) + std::erf(v * T(kSqrtHalf))));
    });
  });
}

void SimCompute::geluBackward(ConstView x, ConstView dy, View dx) {
  compute_checks::checkGeluBackward(Device::kHost, x, dy, dx);
  if (denseFp32(x, dy, dx)) {
    const float *xp = x.typed<float>(), *dyp = dy.typed<float>();
    float* dxp = dx.typed<float>();
    if (const auto isa = vectorGeluIsa()) return vectorGeluBackward(*isa, xp, dyp, dxp, x.numel());
    for (std::int64_t i = 0, n = x.numel(); i < n; ++i) dxp[i] = geluBackwardOf(xp[i], dyp[i]);
    return;
  }
  withAccumType({x.dtype(), dy.dtype(), dx.dtype()}, [&](auto zero) {
    using T = decltype(zero);
    forEach<3>(x.shape(), {x.strides(), dy.strides(), dx.strides()}, [&](const auto& o) {
      const T v = load<T>(x.at(o[0]), x.dtype());
      const T cdf = T(0.5) * (T(1) + std::erf(v * T(kSqrtHalf)));
      const T pdf = std::exp(T(-0.5) * v * v) * T(kInvSqrt2Pi);
      store<T>(dx.at(o[2]), dx.dtype(), load<T>(dy.at(o[1]), dy.dtype()) * (cdf + v * pdf));
    });
  });
}

// ---- MXFP8 --------------------------------------------------------------------------------------

void SimCompute::quantizeMxfp8(ConstView x, View data, View scales, int axis) {
  compute_checks::checkQuantizeMxfp8(Device::kHost, x, data, scales, axis);
  // Element k of the block (a, b): row-major (a, k) for rowwise blocks, (k, a) for columnwise ones.
  auto offset = [axis](ConstView v, std::int64_t a, std::int64_t k) {
    return axis == 1 ? a * v.stride(0) + k * v.stride(1) : k * v.stride(0) + a * v.stride(1);
  };
  forEachMxBlock(x.dim(0), x.dim(1), axis, [&](std::int64_t a, std::int64_t b, std::int64_t first, std::int64_t last) {
    double amax = 0.0;
    bool nan = false;
    for (std::int64_t k = first; k < last; ++k) {
      const double v = load<double>(x.at(offset(x, a, k)), x.dtype());
      nan = nan || std::isnan(v);
      amax = std::max(amax, std::fabs(v));
    }
    void* scale = axis == 1 ? scales.at(a * scales.stride(0) + b * scales.stride(1))
                            : scales.at(b * scales.stride(0) + a * scales.stride(1));
    if (nan) {
      *static_cast<std::uint8_t*>(scale) = 0xff;
      for (std::int64_t k = first; k < last; ++k) *static_cast<std::uint8_t*>(data.at(offset(data, a, k))) = 0x7f;
      return;
    }
    const int e = mxfp8ScaleExponent(amax);
    *static_cast<std::uint8_t*>(scale) = std::uint8_t(e + 127);
    for (std::int64_t k = first; k < last; ++k) {
      const double v = load<double>(x.at(offset(x, a, k)), x.dtype());
      *static_cast<std::uint8_t*>(data.at(offset(data, a, k))) = toE4m3(elem::unscale(v, e));
    }
  });
}

void SimCompute::dequantizeMxfp8(ConstView data, ConstView scales, int axis, View y) {
  compute_checks::checkDequantizeMxfp8(Device::kHost, data, scales, axis, y);
  // Both factors fit double exactly (4 significant bits times a power of two), so the product is
  // exact and the store below is the only rounding.
  for (std::int64_t r = 0; r < data.dim(0); ++r)
    for (std::int64_t c = 0; c < data.dim(1); ++c) {
      const std::int64_t i = axis == 1 ? r : r / kMxBlock, j = axis == 1 ? c / kMxBlock : c;
      const auto* scale = static_cast<const std::uint8_t*>(scales.at(i * scales.stride(0) + j * scales.stride(1)));
      const auto* v = static_cast<const std::uint8_t*>(data.at(r * data.stride(0) + c * data.stride(1)));
      store<double>(y.at(r * y.stride(0) + c * y.stride(1)), y.dtype(), double(e4m3ToFloat(*v)) * e8m0ToFloat(*scale));
    }
}

// ---- Embedding rows -----------------------------------------------------------------------------

void SimCompute::gatherRows(ConstView table, ConstView ids, std::int64_t first, View out) {
  compute_checks::checkGatherRows(Device::kHost, table, ids, out);
  const std::vector<std::int64_t> flat = flatIds(ids);  // (n)
  const std::int64_t vocab = table.dim(0), h = table.dim(1), n = ids.numel();
  withAccumType({table.dtype(), out.dtype()}, [&](auto zero) {
    using T = decltype(zero);
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t row = flat[std::size_t(i)] - first;
      const bool owned = 0 <= row && row < vocab;
      for (std::int64_t j = 0; j < h; ++j) {
        void* dst = out.at(i * out.stride(0) + j * out.stride(1));
        if (owned)
          convert<T>(table.at(row * table.stride(0) + j * table.stride(1)), table.dtype(), dst, out.dtype());
        else
          store<T>(dst, out.dtype(), T(0));
      }
    }
  });
}

void SimCompute::scatterAddRows(ConstView grad, ConstView ids, std::int64_t first, View table) {
  compute_checks::checkScatterAddRows(Device::kHost, grad, ids, table);
  const std::vector<std::int64_t> flat = flatIds(ids);  // (n)
  const std::int64_t vocab = table.dim(0), h = table.dim(1), n = ids.numel();
  withAccumType({grad.dtype(), table.dtype()}, [&](auto zero) {
    using T = decltype(zero);
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t row = flat[std::size_t(i)] - first;
      if (row < 0 || row >= vocab) continue;
      for (std::int64_t j = 0; j < h; ++j) {
        void* dst = table.at(row * table.stride(0) + j * table.stride(1));
        const T g = load<T>(grad.at(i * grad.stride(0) + j * grad.stride(1)), grad.dtype());
        store<T>(dst, table.dtype(), load<T>(dst, table.dtype()) + g);
      }
    }
  });
}

}  // namespace tpsim::sim
