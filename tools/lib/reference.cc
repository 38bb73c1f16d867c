#include "tools/lib/reference.h"

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <optional>
#include <thread>
#include <type_traits>
#include <utility>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "backends/errors.h"
#include "backends/huge_pages.h"
#include "sim/dgemm.h"
#include "sim/host_pool.h"
#include "sim/sgemm.h"
#include "sim/upper_gemm_bf16.h"
#include "tools/lib/layer_kind.h"

namespace tpsim::tools {
namespace {

// The products are the packed kernels of sim/sgemm.h and sim/dgemm.h, their blocks spread over the
// cores (Eigen's product in tiles on cores without AVX2 and FMA). Values are in double: their own
// rounding (about K·2^-53 relative, whatever order the kernel sums in) stays far below the bounds'
// fp32 terms. The bounds' magnitudes (the same computation on |values|) are in float, rounded so
// that they only ever err upwards (upperProduct).
using Matrix = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MatrixView = Eigen::Map<const Matrix>;
using FloatMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// Tiles of a product and chunks of an elementwise pass. They depend on the shapes alone, so no
// result depends on how many threads compute it.
constexpr std::int64_t kTileRows = 256, kTileCols = 512, kChunk = std::int64_t(1) << 16;

// Every core for large work, started at the first: the property suite computes thousands of tiny
// references, each best left on its calling thread.
sim::HostPool* poolIf(bool large) {
  if (!large) return nullptr;
  static sim::HostPool pool(std::max(0, int(std::thread::hardware_concurrency()) - 1));
  return &pool;
}

// task(begin, end) for consecutive chunks of [0, n).
void forChunks(std::int64_t n, const std::function<void(std::int64_t, std::int64_t)>& task) {
  sim::runTasks(poolIf(n >= 4 * kChunk), (n + kChunk - 1) / kChunk,
                [&](std::int64_t c) { task(c * kChunk, std::min(n, (c + 1) * kChunk)); });
}

// tile(row, col, height, width) for every tile of a (rows, cols) product of reduction length depth.
void forTiles(std::int64_t rows, std::int64_t cols, std::int64_t depth,
              const std::function<void(std::int64_t, std::int64_t, std::int64_t, std::int64_t)>& tile) {
  const std::int64_t across = (cols + kTileCols - 1) / kTileCols, down = (rows + kTileRows - 1) / kTileRows;
  sim::runTasks(poolIf(2.0 * double(rows) * double(cols) * double(depth) >= 1e7), down * across, [&](std::int64_t t) {
    const std::int64_t r = t / across * kTileRows, c = t % across * kTileCols;
    tile(r, c, std::min(kTileRows, rows - r), std::min(kTileCols, cols - c));
  });
}

// n zeroed elements, on huge pages (backends/huge_pages.h).
template <class T>
std::vector<T> freshVector(std::int64_t n) {
  std::vector<T> v;
  resizeFresh(v, std::size_t(n));
  return v;
}

// Row-major matrix of a HostTensor's values: (rows, cols) with cols = the last dim.
struct Mat {
  std::int64_t rows = 0, cols = 0;
  std::vector<double> v;
  operator MatrixView() const { return {v.data(), rows, cols}; }  // products read a Mat in place
};

// A tensor's values as a matrix, in place: (numel / last dim, last dim).
MatrixView viewOf(const HostTensor& t) {
  const std::int64_t cols = t.shape.back();
  return {t.values.data(), t.numel() / cols, cols};
}

template <class Expr>
Mat evaluate(const Eigen::MatrixBase<Expr>& e) {
  Mat m{e.rows(), e.cols(), freshVector<double>(e.rows() * e.cols())};
  Eigen::Map<Matrix>(m.v.data(), m.rows, m.cols).noalias() = e;
  return m;
}

Mat absMat(MatrixView m) { return evaluate(m.cwiseAbs()); }

// Element (row, col) of an Eigen map (or its transpose) onwards, as the packed kernels read it.
template <class T, class Expr>
sim::StridedMatrix<T> strided(const Expr& x, std::int64_t row, std::int64_t col) {
  return {x.data() + row * x.rowStride() + col * x.colStride(), x.rowStride(), x.colStride()};
}

// lhs·rhs into out (M, N) at out[i·ld + j], or added to it: the packed kernel over the whole product,
// its blocks on the cores; on cores without one, Eigen's product in tiles.
template <class T, class Lhs, class Rhs>
void productInto(const Lhs& lhs, const Rhs& rhs, T* out, std::int64_t ld, bool add = false) {
  static const sim::GemmKernel kernel = sim::bestGemmKernel();
  const std::int64_t rows = lhs.rows(), cols = rhs.cols(), depth = lhs.cols();
  if (kernel != sim::GemmKernel::kEigen) {
    sim::HostPool* pool = poolIf(2.0 * double(rows) * double(cols) * double(depth) >= 1e7);
    if constexpr (std::is_same_v<T, float>)
      sim::sgemm(kernel, rows, cols, depth, 1.f, strided<float>(lhs, 0, 0), strided<float>(rhs, 0, 0), add ? 1.f : 0.f,
                 out, ld, 1, pool);
    else
      sim::dgemm(kernel, rows, cols, depth, 1.0, strided<double>(lhs, 0, 0), strided<double>(rhs, 0, 0),
                 add ? 1.0 : 0.0, out, ld, 1, pool);
    return;
  }
  using Out = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  Eigen::Map<Out, 0, Eigen::OuterStride<>> o(out, rows, cols, Eigen::OuterStride<>(ld));
  forTiles(rows, cols, depth, [&](std::int64_t r, std::int64_t c, std::int64_t h, std::int64_t w) {
    if (add)
      o.block(r, c, h, w).noalias() += lhs.middleRows(r, h) * rhs.middleCols(c, w);
    else
      o.block(r, c, h, w).noalias() = lhs.middleRows(r, h) * rhs.middleCols(c, w);
  });
}

// lhs·rhs. lhs: (M, K)  rhs: (K, N)  -> (M, N)
template <class Lhs, class Rhs>
Mat product(const Lhs& lhs, const Rhs& rhs) {
  Mat out{lhs.rows(), rhs.cols(), freshVector<double>(lhs.rows() * rhs.cols())};
  productInto<double>(lhs, rhs, out.v.data(), out.cols);
  return out;
}

// m's rows += bias. m: (M, N)  bias: (N)
void addRows(Mat& m, const std::vector<double>& bias) {
  Eigen::Map<Matrix>(m.v.data(), m.rows, m.cols).rowwise() += Eigen::Map<const Eigen::RowVectorXd>(bias.data(), m.cols);
}

// a·b. a: (M, N)  b: (N, K)  -> (M, K)
Mat matmul(MatrixView a, MatrixView b) { return product(a, b); }

std::vector<double> columnSums(MatrixView m) { return evaluate(m.colwise().sum()).v; }

std::vector<double> absColumnSums(MatrixView m) { return evaluate(m.cwiseAbs().colwise().sum()).v; }

// A nonnegative matrix as the bounds' float products read it: v[i]·2^exponent >= value i, each
// value scaled by 2^-exponent (its largest finite one to [1/2, 1)) and rounded up to float.
// (rows, cols) row-major.
struct Upper {
  std::int64_t rows = 0, cols = 0;
  int exponent = 0;
  std::vector<float> v;
  Eigen::Map<const FloatMatrix> map() const { return {v.data(), rows, cols}; }
};

// x >= 0 rounded to the float at or above it; NaN and Inf stay what they are.
float roundUp(double x) {
  float f = float(x);
  std::uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  bits += double(f) < x;  // the next float up: for f >= 0 the next bit pattern (FLT_MAX's is Inf)
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The exponent an Upper scales by for values whose largest finite one is `max`: at least 2^-1000, so
// that its inverse, the scale, is finite.
int upperExponent(double max) { return max > 0 ? std::max(std::ilogb(max) + 1, -1000) : 0; }

// The largest finite value(i) for the flat indices i < n (0 when there is none).
template <class Value>
double largestFinite(std::int64_t n, Value value) {
  std::vector<double> largest(std::size_t((n + kChunk - 1) / kChunk), 0.0);
  forChunks(n, [&](std::int64_t begin, std::int64_t end) {
    double m = 0;
    for (std::int64_t i = begin; i < end; ++i) {
      const double x = value(i);
      if (x <= std::numeric_limits<double>::max()) m = std::max(m, x);  // Inf and NaN scale nothing
    }
    largest[std::size_t(begin / kChunk)] = m;
  });
  return largest.empty() ? 0.0 : *std::max_element(largest.begin(), largest.end());
}

// value(i) >= 0 for the flat index i of a (rows, cols) matrix, as an Upper scaled by 2^-exponent, in
// u's storage: a block of a larger Upper when `exponent` is that one's.
template <class Value>
void upperInto(std::int64_t rows, std::int64_t cols, Value value, int exponent, Upper& u) {
  const std::int64_t n = rows * cols;
  u.rows = rows;
  u.cols = cols;
  u.exponent = exponent;
  if (u.v.capacity() < std::size_t(n)) u.v = freshVector<float>(n);
  u.v.resize(std::size_t(n));
  const double scale = std::ldexp(1.0, -u.exponent);  // exact: a power of two, and no product overflows
  forChunks(n, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) {
      const double x = value(i);
      const float f = roundUp(x * scale);
      u.v[std::size_t(i)] = f == 0 && x > 0 ? std::numeric_limits<float>::denorm_min() : f;
    }
  });
}

template <class Value>
void upperInto(std::int64_t rows, std::int64_t cols, Value value, Upper& u) {
  upperInto(rows, cols, value, upperExponent(largestFinite(rows * cols, value)), u);
}

template <class Value>
Upper upper(std::int64_t rows, std::int64_t cols, Value value) {
  Upper u;
  upperInto(rows, cols, value, u);
  return u;
}

Upper upperAbs(MatrixView m) {
  return upper(m.rows(), m.cols(), [d = m.data()](std::int64_t i) { return std::fabs(d[i]); });
}

// An upper bound of lhs·rhs, in double, for nonnegative operands held as Upper (lhs.map() or its
// transpose, ...): never below the exact product of the values they hold, nor below that product
// computed in double. lhs: (M, K)  rhs: (K, N)  -> out (M, N) row-major, or added to it (a sum of
// such bounds, rounded to nearest in double, stays one: its few roundings fit the spare below).
//
// Why: in float, with u = 2^-24 and operands rounded up (to float, or further to bf16 by
// upperGemmBf16), each term of Σ_k a_k·b_k reaches the computed sum ŝ through at most K roundings
// (Eigen: its product or FMA, then at most K − 1 additions, in whatever tree it sums; the packed
// kernels: one FMA chain of at most 256 per K block, then one addition per later block, kc +
// blocks − 1 <= K), each multiplying it by some 1 + δ >= 1 − u or adding an underflow error of at
// most 2^-e (gradual underflow: e = 150; bf16's flush to zero below 2^-126, and its smallest input
// 2^-126: e = 126); the terms are nonnegative, so ŝ >= (1 − u)^K·s − 2K·2^-e·(1 + u)^K. With F =
// (1 − u)^-(K+2) >= (1 + u)^K: s <= F·ŝ + F²·(2K + 2)·2^-e after dividing by (1 − u)^2 as well.
// That spare (1 − u)^-2 >= 1 + 2^-23 covers the double product's own error (1 + 2^-53)^K for K <
// 2^29 and the few roundings of this scaling back; (2K + 2)·2^-1074 covers the double product's
// underflow. A product that is a part's share of a longer sum (ReferencePart) takes that sum's
// length for K (`sumLength`): a K above the product's own only raises the bound, and the parts'
// bounds then add to the whole's but for their float roundings.
template <class Lhs, class Rhs>
void upperProductInto(const Lhs& lhs, int lhsExponent, const Rhs& rhs, int rhsExponent, double* out, std::int64_t ld,
                      bool add, MagnitudeGemm gemm = bestMagnitudeGemm(), std::int64_t sumLength = 0) {
  const bool bf16 = gemm == MagnitudeGemm::kBf16;
  const std::int64_t rows = lhs.rows(), cols = rhs.cols(), own = lhs.cols(), depth = std::max(own, sumLength);
  const double f = std::pow(1 - 0x1p-24, -double(depth + 2));
  const int exponent = lhsExponent + rhsExponent;
  const double floor = std::ldexp(f * f * double(2 * depth + 2), exponent - (bf16 ? 126 : 150)) +
                       std::ldexp(double(2 * depth + 2), -1074);
  // F·2^exponent is one factor unless it over- or underflows (then 0·Inf would make a NaN).
  const bool oneFactor = std::abs(exponent) < 900;
  const double factor = oneFactor ? std::ldexp(f, exponent) : 0.0;
  // The float product in a buffer each thread keeps (its pages are touched once), then scaled.
  thread_local std::vector<float> product;
  if (product.size() < std::size_t(rows * cols)) product = freshVector<float>(rows * cols);
  if (bf16)
    sim::upperGemmBf16(rows, cols, own, strided<float>(lhs, 0, 0), strided<float>(rhs, 0, 0), product.data(), cols,
                       poolIf(2.0 * double(rows) * double(cols) * double(own) >= 1e7));
  else
    productInto<float>(lhs, rhs, product.data(), cols);
  forChunks(rows * cols, [&, t = product.data()](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin, r = begin / cols, c = begin % cols; i < end; ++i) {
      const double bound = oneFactor ? double(t[i]) * factor + floor : std::ldexp(double(t[i]) * f, exponent) + floor;
      double& o = out[r * ld + c];
      o = add ? o + bound : bound;
      if (++c == cols) c = 0, ++r;
    }
  });
}

template <class Lhs, class Rhs>
Mat upperProduct(const Lhs& lhs, int lhsExponent, const Rhs& rhs, int rhsExponent,
                 MagnitudeGemm gemm = bestMagnitudeGemm(), std::int64_t sumLength = 0) {
  Mat out{lhs.rows(), rhs.cols(), freshVector<double>(lhs.rows() * rhs.cols())};
  upperProductInto(lhs, lhsExponent, rhs, rhsExponent, out.v.data(), out.cols, false, gemm, sumLength);
  return out;
}

// The bounds' product a·b, with a: (M, K).
Mat upperMatmul(const Upper& a, const Upper& b, MagnitudeGemm gemm = bestMagnitudeGemm()) {
  return upperProduct(a.map(), a.exponent, b.map(), b.exponent, gemm);
}

// Φ and φ of the standard normal distribution: GeLU(x) = x·Φ(x), GeLU'(x) = Φ(x) + x·φ(x).
double normalCdf(double x) { return 0.5 * (1.0 + std::erf(x * M_SQRT1_2)); }
double normalPdf(double x) { return std::exp(-0.5 * x * x) / std::sqrt(2.0 * M_PI); }

double unitRoundoff(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16: return std::ldexp(1.0, -8);
    case DType::kFloat16: return std::ldexp(1.0, -11);
    case DType::kFloat64: return std::ldexp(1.0, -53);
    default: return std::ldexp(1.0, -24);
  }
}

// `stages` roundings into `dtype`, relative: stages · u(dtype).
double roundings(int stages, DType dtype) { return double(stages) * unitRoundoff(dtype); }

// The relative part of a result's bound: (length + 2) · u_acc + its storage roundings.
double relativeBound(double uAcc, std::int64_t length, double rounding) { return double(length + 2) * uAcc + rounding; }

// A dense result and its bound: ((length + 2) · u_acc + rounding) · magnitude. The gradual
// underflow allowance is added once per reference (denseReference).
Checked checked(double uAcc, std::vector<std::int64_t> shape, DType dtype, Mat value, Mat magnitude,
                std::int64_t length, double rounding) {
  const double rel = relativeBound(uAcc, length, rounding);
  for (double& m : magnitude.v) m *= rel;
  return {HostTensor{std::move(shape), dtype, std::move(value.v)}, std::move(magnitude.v)};
}

// Whether `grad` is a gradient GTP_remat reduce-scatters: one whose placement is a GTP_remat shard's.
bool gtpReduced(const ReferenceOptions& o, const std::string& grad) {
  return o.gtpRemat > 1 && std::any_of(o.placements.begin(), o.placements.end(), [&](const TensorPlacement& p) {
           return p.name == grad && p.gtpShard;
         });
}

// The storage roundings of the weight gradient `grad` once its sum is done: one into the dtype it
// lands in (wgradDtype: main_grad's under fusion) and, when GTP_remat reduce-scatters it, G more in
// the wire dtype (G − 1 partial sums and MEAN's 1/G pre-scale).
double wgradRoundings(const ReferenceOptions& o, const std::string& grad) {
  return roundings(1, o.wgradDtype) + (gtpReduced(o, grad) ? roundings(o.gtpRemat, o.gtpWireDtype) : 0.0);
}

// The indices along `weight`'s TP dim that TP rank t holds, in the rank's order: the layer's own
// placement decides (stride chunks included), not this file.
std::vector<std::int64_t> ownedIndices(const TensorPlacement& weight, int t) {
  std::vector<std::int64_t> owned;
  for (const Block& b : blocksOf(withoutGtp(weight), t, 0))
    for (std::int64_t i = b.global[std::size_t(weight.tp.dim)].begin; i < b.global[std::size_t(weight.tp.dim)].end; ++i)
      owned.push_back(i);
  return owned;
}

// Half the smallest subnormal: the absolute error of one rounding near zero.
double halfSubnormal(DType dtype) {
  switch (dtype) {
    case DType::kFloat16: return std::ldexp(1.0, -25);
    case DType::kBFloat16: return std::ldexp(1.0, -134);
    case DType::kFloat64: return std::ldexp(1.0, -1075);
    default: return std::ldexp(1.0, -150);
  }
}

// Gradual underflow, which a relative bound misses: each rounding near zero errs by up to half the
// smallest subnormal δ, at most T + 3 times per path (the GEMM, the MLP's two extra stages, the T
// partial sums), and a later GEMM multiplies an intermediate's error by at most the ℓ1 norm S of
// its other operand (1.13·S through GeLU'). Hence (T + 3)·δ·(1 + 1.13·S), with S the largest ℓ1
// norm of an input: nothing for fp32 and bf16, a few ulps of fp16's subnormals. A part's split
// inputs' norms are the sum of the parts' (whose rounding differs from one sum's in the last bit).
double underflowAllowance(const ReferenceOptions& o, const InputMap& inputs) {
  const double delta = std::max(halfSubnormal(o.computeDtype), halfSubnormal(o.outputDtype));
  if (delta == 0) return 0;
  std::vector<double> norms;  // by input, in name order
  for (const auto& [name, t] : inputs) {
    double sum = 0;
    const std::int64_t n = t.dtype == DType::kInt64 ? 0 : t.numel();
    for (std::int64_t i = 0; i < n; ++i) sum += std::fabs(t.at(i));
    norms.push_back(sum);
  }
  if (o.part) {
    const std::vector<double> all = o.part->allGather(norms);
    std::size_t i = 0;
    for (const auto& [name, t] : inputs) {
      if (o.part->split.count(name)) {
        norms[i] = 0;
        for (std::size_t at = i; at < all.size(); at += norms.size()) norms[i] += all[at];
      }
      ++i;
    }
  }
  double l1 = 0;
  for (double norm : norms) l1 = std::max(l1, norm);
  return (o.tp + 3) * delta * (1 + 1.13 * l1);
}

std::vector<std::int64_t> withLast(std::vector<std::int64_t> shape, std::int64_t n) {
  shape.back() = n;
  return shape;
}

const StoredTensor& need(const InputMap& m, const std::string& name) {
  auto it = m.find(name);
  TPSIM_INTERNAL_ASSERT(it != m.end(), "reference input ", name, " missing");
  return it->second;
}

// An input's values in double, which the reference computes in: a copy it holds while it needs it.
HostTensor needHost(const InputMap& m, const std::string& name) { return hostOf(need(m, name)); }

// m (rows, cols) row-major replaced by deq(Q(m)), blocks of 32 along `axis`; a NaN makes its
// block NaN.
void fakeQuantize(std::vector<double>& m, std::int64_t rows, std::int64_t cols, int axis) {
  const std::int64_t along = axis == 1 ? cols : rows, across = axis == 1 ? rows : cols;
  auto at = [&](std::int64_t a, std::int64_t k) -> double& {
    return m[std::size_t(axis == 1 ? a * cols + k : k * cols + a)];
  };
  for (std::int64_t a = 0; a < across; ++a)
    for (std::int64_t first = 0; first < along; first += 32) {
      const std::int64_t last = std::min(along, first + 32);
      double amax = 0;
      bool nan = false;
      for (std::int64_t k = first; k < last; ++k) {
        nan = nan || std::isnan(at(a, k));
        amax = std::max(amax, std::fabs(at(a, k)));
      }
      const double scale = std::ldexp(1.0, mxfp8ScaleExponent(amax));
      for (std::int64_t k = first; k < last; ++k)
        at(a, k) = nan ? std::nan("") : double(e4m3ToFloat(toE4m3(at(a, k) / scale))) * scale;
    }
}

// The MXFP8 copies of the weight `name` that a linear's GEMMs multiply by: fprop's rowwise one,
// dgrad's columnwise one, each stored in the compute dtype, which holds its values exactly. One
// weight in double at a time.
void mxfp8Copies(const ReferenceOptions& o, const StoredTensor& w, const std::string& name, StoredTensor& fprop,
                 StoredTensor& dgrad) {
  const HostTensor host = hostOf(w);
  const TensorPlacement& placement = placementNamed(o.placements, name);
  fprop = storedOf(mxfp8Weight(host, placement, 1, o.computeDtype));
  dgrad = storedOf(mxfp8Weight(host, placement, 0, o.computeDtype));
}

// A stored (rows, cols) matrix's absolute values as an Upper, read in place.
Upper upperAbs(const StoredTensor& m) {
  return upper(m.shape[0], m.shape[1], [&m](std::int64_t i) { return std::fabs(m.at(i)); });
}

// The parts' sums over the split dimension (ReferencePart): every part but the first sends its
// `sums`, one vector at a time, and the first adds the others' to its own, in part order. Whether
// this part is the first, the one that goes on to send those results.
bool sumParts(const ReferencePart& part, const std::vector<std::vector<double>*>& sums) {
  if (part.index > 0) {
    for (const std::vector<double>* mine : sums) part.send(*mine);
    return false;
  }
  std::vector<double> theirs;
  for (int from = 1; from < part.count; ++from)
    for (std::vector<double>* mine : sums) {
      part.receive(from, theirs);
      TPSIM_INTERNAL_ASSERT(theirs.size() == mine->size(), "part ", from, " sent ", theirs.size(), " sums for ",
                            mine->size());
      forChunks(std::int64_t(theirs.size()), [&](std::int64_t begin, std::int64_t end) {
        for (std::int64_t i = begin; i < end; ++i) (*mine)[std::size_t(i)] += theirs[std::size_t(i)];
      });
    }
  return true;
}

// One linear layer y = x·Wᵀ + b and its gradients: output, input.grad (when inputGrad),
// <weight>.grad and bias.grad, each announced to `sink`; `weight` names the weight as its placement
// does. wFprop and wDgrad are the weight as the forward and the dgrad GEMM read it (W itself unless
// quantized). The weight goes through in blocks of its rows, read in double, and its gradient is
// sent a block at a time; after the blocks, the reference holds |W| in float for the bounds'
// products. The other results are returned whole, for the caller to send (sendBlocks) once it has
// let go of what it computed them from.
// The blocks change no bit: y's columns and dW's rows are computed as by one product, and the
// blocks, a multiple of the packed kernels' K block (kKc, 256) each, add to input.grad in the order
// of one product's K blocks; its bound and y's are products of the whole |W|.
// A part (o.part) holds the weight's rows [nBegin, nBegin + n) of N (a column's, with the bias's) or
// its columns [kBegin, kBegin + k) of K (a row's) and sends every result itself, returning none: the
// results of its own rows or columns where they lie, and the sums over the split dimension (a
// column's input.grad, a row's output) through the first part, which adds the others' and sends them
// (a row's bias.grad with them).
std::map<std::string, Checked> linearLayer(const ReferenceOptions& o, const HostTensor& x, const StoredTensor& wFprop,
                                          const StoredTensor& wDgrad, const HostTensor* b, const HostTensor& dy,
                                          const std::string& weight, bool inputGrad, ReferenceSink& sink) {
  const MatrixView X = viewOf(x), dY = viewOf(dy);
  const ReferencePart* part = o.part;
  const int splitDim = part ? part->split.at(weight) : -1;
  TPSIM_INTERNAL_ASSERT(!part || (&wDgrad == &wFprop && inputGrad), "linearLayer: a part of MXFP8 weights or of "
                        "disable_grad_reduce");
  const std::int64_t tokens = X.rows(), n = wFprop.shape[0], k = wFprop.shape[1];
  const std::int64_t nBegin = splitDim == 0 ? part->begin : 0, kBegin = splitDim == 1 ? part->begin : 0;
  const std::int64_t nWhole = splitDim == 0 ? part->whole : n, kWhole = splitDim == 1 ? part->whole : k;
  TPSIM_INTERNAL_ASSERT(X.cols() == kWhole && dY.cols() == nWhole && (!b || b->numel() == (splitDim == 1 ? nWhole : n)),
                        "linearLayer: ", weight, " of ", shapeText(wFprop.shape), " for input ", X.cols(),
                        " and grad_output ", dY.cols(), " wide");
  const auto Xk = X.middleCols(kBegin, k);  // the input's columns the weight here multiplies
  const bool sameDgrad = &wDgrad == &wFprop;
  const Upper aX = upperAbs(X), adY = upperAbs(dY);
  const DType c = o.computeDtype;
  const int stages = 1 + o.tp;  // the GEMM's (or the sum's) rounding; T partial sums rounded and added
  const std::vector<std::int64_t> biasShape = b ? withLast(b->shape, splitDim == 0 ? nWhole : n)
                                                : std::vector<std::int64_t>{};
  sink.result("output", withLast(x.shape, nWhole), o.outputDtype);
  if (inputGrad) sink.result("input.grad", x.shape, c);
  sink.result(weight + ".grad", {nWhole, kWhole}, c);
  if (b) sink.result("bias.grad", biasShape, c);

  const std::int64_t block = blockRows(o, n, k);
  const double relW = relativeBound(o.accumulationUnit, tokens, wgradRoundings(o, weight + ".grad"));
  Mat y{tokens, n, freshVector<double>(tokens * n)}, dX{tokens, k, freshVector<double>(inputGrad ? tokens * k : 0)};
  // The pass over the weight's blocks, whose buffers are gone before the products over the whole |W|.
  auto weightBlocks = [&] {
    const std::int64_t blockSize = std::min(n, block) * k;
    std::vector<double> wBlock = freshVector<double>(blockSize), wdBlock = freshVector<double>(sameDgrad ? 0 : blockSize),
                        dW = freshVector<double>(blockSize), boundW = freshVector<double>(blockSize);
    for (std::int64_t n0 = 0; n0 < n; n0 += block) {
      const std::int64_t nb = std::min(block, n - n0);
      readDoubles(wFprop, n0 * k, nb * k, wBlock.data());
      const MatrixView Wb(wBlock.data(), nb, k);
      const auto dYb = dY.middleCols(nBegin + n0, nb);
      productInto<double>(Xk, Wb.transpose(), y.v.data() + n0, n);
      if (inputGrad) {
        if (!sameDgrad) readDoubles(wDgrad, n0 * k, nb * k, wdBlock.data());
        productInto<double>(dYb, sameDgrad ? Wb : MatrixView(wdBlock.data(), nb, k), dX.v.data(), k, n0 > 0);
      }
      productInto<double>(dYb.transpose(), Xk, dW.data(), k);
      upperProductInto(adY.map().middleCols(nBegin + n0, nb).transpose(), adY.exponent,
                       aX.map().middleCols(kBegin, k), aX.exponent, boundW.data(), k, false);
      for (std::int64_t i = 0; i < nb * k; ++i) boundW[std::size_t(i)] *= relW;
      sink.block(weight + ".grad", {nBegin + n0, kBegin, nb, k, k, dW.data(), boundW.data()});
    }
  };
  weightBlocks();
  // The products over the whole |W| once the blocks' buffers are gone: |W| in float is not held
  // beside them. Their pages go back to the system first: |W| would otherwise land on pages handed
  // back before the verification began (tools/cli/run.cc) and leave the freed blocks resident
  // beside it (a verified column of 2048 x 4096 at T = 2 peaked at 224 MiB instead of 172-187).
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
  // |W| scaled by the whole weight's exponent: a part's bounds are the whole's.
  auto upperWeight = [part](const StoredTensor& w) {
    auto value = [&w](std::int64_t i) { return std::fabs(w.at(i)); };
    double largest = largestFinite(w.numel(), value);
    if (part)
      for (double theirs : part->allGather({largest})) largest = std::max(largest, theirs);
    Upper u;
    upperInto(w.shape[0], w.shape[1], value, upperExponent(largest), u);
    return u;
  };
  Mat ay, dXBound;
  {
    const Upper aW = upperWeight(wFprop);
    ay = upperProduct(aX.map().middleCols(kBegin, k), aX.exponent, aW.map().transpose(), aW.exponent,
                      bestMagnitudeGemm(), kWhole);
    if (inputGrad && sameDgrad)
      dXBound = upperProduct(adY.map().middleCols(nBegin, n), adY.exponent, aW.map(), aW.exponent,
                             bestMagnitudeGemm(), nWhole);
  }
  if (inputGrad && !sameDgrad) dXBound = upperMatmul(adY, upperAbs(wDgrad));
  const bool sumsOutput = splitDim == 1;  // a row part's output is its share of the sum over K
  if (b && !sumsOutput) {
    addRows(y, b->values);
    addRows(ay, absColumnSums(viewOf(*b)));
  }
  std::map<std::string, Checked> whole;
  whole["output"] = checked(o.accumulationUnit, withLast(x.shape, n), o.outputDtype, std::move(y), std::move(ay),
                            kWhole, roundings(stages, o.outputDtype));
  if (inputGrad)
    whole["input.grad"] = checked(o.accumulationUnit, withLast(x.shape, k), c, std::move(dX), std::move(dXBound),
                                  nWhole, roundings(stages, c));
  if (b) {
    Mat db{1, dY.cols(), columnSums(dY)}, adb{1, dY.cols(), absColumnSums(dY)};
    whole["bias.grad"] = checked(o.accumulationUnit, biasShape, c, std::move(db), std::move(adb), tokens,
                                 roundings(stages, c));
  }
  if (!part) return whole;

  // A part's results: first the sum over the split dimension, then the rest where they lie.
  // The sums' relative bounds are the same in every part (their length is the whole's).
  Checked& sum = whole.at(sumsOutput ? "output" : "input.grad");
  if (!sumParts(*part, {&sum.value.values, &sum.bound})) {
    whole.erase(sumsOutput ? "output" : "input.grad");
    if (sumsOutput) whole.erase("bias.grad");  // the first part's
  }
  if (sumsOutput && whole.count("output") && b) {
    Mat total{tokens, nWhole, std::move(sum.value.values)}, totalBound{tokens, nWhole, std::move(sum.bound)};
    addRows(total, b->values);
    const double rel = relativeBound(o.accumulationUnit, kWhole, roundings(stages, o.outputDtype));
    addRows(totalBound, evaluate(rel * viewOf(*b).cwiseAbs()).v);
    sum.value.values = std::move(total.v), sum.bound = std::move(totalBound.v);
  }
  // Each where it lies in the whole result: the part's own columns, or all of the whole's.
  for (auto& [name, result] : whole) {
    const std::int64_t cols = result.value.shape.back(), rows = result.value.numel() / cols;
    std::int64_t col = 0, width = cols, from = 0;
    if (name == "output" && !sumsOutput) col = nBegin;
    if (name == "input.grad" && sumsOutput) col = kBegin;
    if (name == "bias.grad" && !sumsOutput) col = from = nBegin, width = n;  // its slice of the whole's sums
    sink.block(name, {0, col, rows, width, cols, result.value.values.data() + from, result.bound.data() + from});
  }
  return {};
}

// A column layer's input gradient under disable_grad_reduce: for each TP rank t, dY over its
// output rows times those rows of W, one GEMM rounded once, stacked (T, …, K).
Checked partialDgrads(const ReferenceOptions& o, const HostTensor& x, const StoredTensor& wDgrad, const HostTensor& dy,
                      const TensorPlacement& weight) {
  const MatrixView dY = viewOf(dy);
  const std::int64_t k = wDgrad.shape[1];
  std::vector<std::int64_t> shape = x.shape;
  shape.insert(shape.begin(), o.tp);
  Checked all{HostTensor{shape, o.computeDtype, {}}, {}};
  for (int t = 0; t < o.tp; ++t) {
    const std::vector<std::int64_t> rows = ownedIndices(weight, t);
    const std::int64_t n = std::int64_t(rows.size());
    const Eigen::Map<const Eigen::Array<std::int64_t, Eigen::Dynamic, 1>> owned(rows.data(), n);
    Mat Wt{n, k, freshVector<double>(n * k)};
    for (std::int64_t i = 0; i < n; ++i) readDoubles(wDgrad, rows[std::size_t(i)] * k, k, Wt.v.data() + i * k);
    const Mat dYt = evaluate(dY(Eigen::all, owned));
    const Checked part = checked(o.accumulationUnit, x.shape, o.computeDtype, matmul(dYt, Wt),
                                 upperMatmul(upperAbs(dYt), upperAbs(Wt)), n, roundings(1, o.computeDtype));
    all.value.values.insert(all.value.values.end(), part.value.values.begin(), part.value.values.end());
    all.bound.insert(all.bound.end(), part.bound.begin(), part.bound.end());
  }
  return all;
}

}  // namespace

double gelu(double x) { return x * normalCdf(x); }

double geluGrad(double x) { return normalCdf(x) + x * normalPdf(x); }

void sendWhole(std::map<std::string, Checked>& results, ReferenceSink& sink) {
  for (const auto& [name, c] : results) sink.result(name, c.value.shape, c.value.dtype);
  sendBlocks(results, sink);
}

void sendBlocks(std::map<std::string, Checked>& results, ReferenceSink& sink) {
  for (auto& [name, c] : results) {
    const std::int64_t cols = c.value.shape.empty() ? 1 : c.value.shape.back();
    const std::int64_t rows = cols == 0 ? 0 : c.value.numel() / cols;
    sink.block(name, {0, 0, rows, cols, cols, c.value.values.data(), c.bound.data()});
  }
}

namespace {

// Adds to each bound what every kind shares, then passes the block on.
class AllowanceSink final : public ReferenceSink {
 public:
  AllowanceSink(const ReferenceOptions& o, const InputMap& in, ReferenceSink& next)
      : o_(o), underflow_(underflowAllowance(o, in)), next_(next) {}

  void result(const std::string& name, const std::vector<std::int64_t>& shape, DType dtype) override {
    // The GTP_remat reduce-scatter's roundings are in each kind's weight gradients (wgradRoundings);
    // their underflow, up to G roundings near zero in the wire dtype, is added here.
    const double gtpUnderflow = o_.gtpRemat * halfSubnormal(o_.gtpWireDtype);
    allowance_[name] = underflow_ + (gtpReduced(o_, name) ? gtpUnderflow : 0.0);
    next_.result(name, shape, dtype);
  }
  void block(const std::string& name, const ReferenceBlock& b) override {
    const double allowance = allowance_.at(name);
    for (std::int64_t r = 0; r < b.rows; ++r)
      for (std::int64_t c = 0; c < b.cols; ++c) b.bound[r * b.ld + c] += allowance;
    next_.block(name, b);
  }

 private:
  const ReferenceOptions& o_;
  const double underflow_;
  ReferenceSink& next_;
  std::map<std::string, double> allowance_;
};

// Collects every result whole.
class DenseSink final : public ReferenceSink {
 public:
  void result(const std::string& name, const std::vector<std::int64_t>& shape, DType dtype) override {
    HostTensor value{shape, dtype, {}};
    const std::size_t n = std::size_t(value.numel());
    value.values.assign(n, 0.0);
    out[name] = {std::move(value), std::vector<double>(n, 0.0)};
  }
  void block(const std::string& name, const ReferenceBlock& b) override {
    Checked& c = out.at(name);
    const std::int64_t cols = c.value.shape.empty() ? 1 : c.value.shape.back();
    for (std::int64_t r = 0; r < b.rows; ++r) {
      const std::int64_t at = (b.row + r) * cols + b.col;
      std::copy_n(b.value + r * b.ld, b.cols, c.value.values.begin() + at);
      std::copy_n(b.bound + r * b.ld, b.cols, c.bound.begin() + at);
    }
  }
  std::map<std::string, Checked> out;
};

}  // namespace

void streamReference(const ReferenceOptions& o, const InputMap& in, ReferenceSink& sink) {
  TPSIM_INTERNAL_ASSERT(o.layer != nullptr, "streamReference: no layer kind");
  AllowanceSink withAllowance(o, in, sink);
  o.layer->reference(o, in, withAllowance);
}

std::map<std::string, Checked> denseReference(const ReferenceOptions& o, const InputMap& in) {
  DenseSink dense;
  streamReference(o, in, dense);
  return std::move(dense.out);
}

std::int64_t blockRows(const ReferenceOptions& o, std::int64_t n, std::int64_t k) {
  return std::min<std::int64_t>(std::max<std::int64_t>(n, 1),
                                std::max<std::int64_t>(256, o.blockElements / std::max<std::int64_t>(k, 1) / 256 * 256));
}

void linearReference(const ReferenceOptions& o, const InputMap& in, ReferenceSink& sink) {
  std::map<std::string, Checked> whole;
  {  // the operands in double, gone before the results are checked
    const HostTensor x = needHost(in, "input"), dy = needHost(in, "grad_output");
    const std::optional<HostTensor> b = in.count("bias") ? std::optional(needHost(in, "bias")) : std::nullopt;
    const StoredTensor& w = need(in, "weight");
    StoredTensor fpropMxfp8, dgradMxfp8;
    const bool quantized = o.weightFormat != WeightFormat::kNative;
    if (quantized) mxfp8Copies(o, w, "weight", fpropMxfp8, dgradMxfp8);
    const StoredTensor &wFprop = quantized ? fpropMxfp8 : w, &wDgrad = quantized ? dgradMxfp8 : w;
    whole = linearLayer(o, x, wFprop, wDgrad, b ? &*b : nullptr, dy, "weight", !o.disableGradReduce, sink);
    if (o.disableGradReduce) {
      whole["input.grad"] = partialDgrads(o, x, wDgrad, dy, placementNamed(o.placements, "weight"));
      sink.result("input.grad", whole.at("input.grad").value.shape, o.computeDtype);
    }
  }
  sendBlocks(whole, sink);
}

void embeddingReference(const ReferenceOptions& o, const InputMap& in, ReferenceSink& sink) {
  const StoredTensor& w = need(in, "weight");
  const HostTensor ids = needHost(in, "input");  // (b, s)
  // A part (o.part) holds the table's rows [vBegin, vBegin + rows): it looks up the tokens whose ids
  // fall there, zeros for the others, so that the parts' lookups add to the whole's exactly (each
  // element is one part's), and sends its rows of the gradient.
  const ReferencePart* part = o.part;
  const std::int64_t rows = w.shape[0], h = w.shape[1], tokens = ids.numel();
  const std::int64_t vBegin = part ? part->begin : 0, vocab = part ? part->whole : rows;
  const std::vector<std::int64_t> outputShape =
      o.reduceScatterEmbeddings ? std::vector<std::int64_t>{ids.shape[1], ids.shape[0], h}
                                : std::vector<std::int64_t>{ids.shape[0], ids.shape[1], h};
  sink.result("output", outputShape, w.dtype);
  sink.result("weight.grad", {vocab, h}, w.dtype);
  auto here = [&](double id) { return id >= double(vBegin) && id < double(vBegin + rows); };
  {  // the looked-up rows: exact, but for the reduction's roundings
    HostTensor e{{ids.shape[0], ids.shape[1], h}, w.dtype, freshVector<double>(tokens * h)};
    for (std::int64_t i = 0; i < tokens; ++i)
      if (here(ids.values[std::size_t(i)]))
        readDoubles(w, (std::int64_t(ids.values[std::size_t(i)]) - vBegin) * h, h, e.values.data() + i * h);
    if (o.reduceScatterEmbeddings) e = swap01(e);  // (s, b, h)
    Mat eMat{tokens, h, std::move(e.values)};
    Mat magnitude = absMat(eMat);
    std::map<std::string, Checked> output;
    Checked& out = output["output"] = checked(o.accumulationUnit, outputShape, w.dtype, std::move(eMat),
                                              std::move(magnitude), 0, roundings(1 + o.tp, w.dtype));
    if (!part || sumParts(*part, {&out.value.values, &out.bound})) sendBlocks(output, sink);
  }
  // The table's gradient, a scatter-add of grad_output's rows, a block of the table's rows at a time:
  // each row's tokens in token order, as one pass over the tokens adds them.
  HostTensor dy = needHost(in, "grad_output");
  if (o.reduceScatterEmbeddings) dy = swap01(dy);  // back to (b, s, h)
  std::vector<std::int64_t> byId(std::size_t(tokens), 0);
  std::iota(byId.begin(), byId.end(), std::int64_t(0));
  std::stable_sort(byId.begin(), byId.end(), [&](std::int64_t a, std::int64_t b) {
    return ids.values[std::size_t(a)] < ids.values[std::size_t(b)];
  });
  const std::int64_t block = blockRows(o, rows, h);
  const double relW = relativeBound(o.accumulationUnit, tokens, wgradRoundings(o, "weight.grad"));
  std::vector<double> dW = freshVector<double>(std::min(rows, block) * h),
                      boundW = freshVector<double>(std::min(rows, block) * h);
  auto token = std::partition_point(byId.begin(), byId.end(),
                                    [&](std::int64_t i) { return ids.values[std::size_t(i)] < double(vBegin); });
  for (std::int64_t v0 = vBegin; v0 < vBegin + rows; v0 += block) {
    const std::int64_t nb = std::min(block, vBegin + rows - v0);
    std::fill_n(dW.begin(), nb * h, 0.0);
    std::fill_n(boundW.begin(), nb * h, 0.0);
    for (; token != byId.end() && ids.values[std::size_t(*token)] < double(v0 + nb); ++token) {
      const std::int64_t row = std::int64_t(ids.values[std::size_t(*token)]) - v0;
      const double* g = dy.values.data() + *token * h;
      for (std::int64_t j = 0; j < h; ++j) {
        dW[std::size_t(row * h + j)] += g[j];
        boundW[std::size_t(row * h + j)] += std::fabs(g[j]);
      }
    }
    for (std::int64_t i = 0; i < nb * h; ++i) boundW[std::size_t(i)] *= relW;
    sink.block("weight.grad", {v0, 0, nb, h, h, dW.data(), boundW.data()});
  }
}

void mlpReference(const ReferenceOptions& o, const InputMap& in, ReferenceSink& sink) {
  // fc1 (column) -> GeLU -> fc2 (row), each with its bias; SPEC's MLP block.
  // fc1 is column-parallel, fc2 row-parallel (stride 1): each GEMM reads its own copy.
  // A bound is rel · (the same computation on |values|) plus the error that a rounded
  // intermediate (GeLU(H), dH) carries through the products after it. Both terms are products
  // with the same non-negative right operand: each bound is one product of the summed left ones.
  const HostTensor x = needHost(in, "input"), dy = needHost(in, "grad_output");
  const HostTensor b1 = needHost(in, "fc1.bias"), b2 = needHost(in, "fc2.bias");
  // The weights as the GEMMs read them: the inputs themselves, or their MXFP8 copies (the dgrads
  // read the columnwise ones), in double a block of F at a time.
  const StoredTensor &w1 = need(in, "fc1.weight"), &w2 = need(in, "fc2.weight");
  const bool quantized = o.weightFormat != WeightFormat::kNative;
  StoredTensor w1fMxfp8, w1dMxfp8, w2fMxfp8, w2dMxfp8;
  if (quantized) {
    mxfp8Copies(o, w1, "fc1.weight", w1fMxfp8, w1dMxfp8);
    mxfp8Copies(o, w2, "fc2.weight", w2fMxfp8, w2dMxfp8);
  }
  const StoredTensor &w1f = quantized ? w1fMxfp8 : w1, &w1d = quantized ? w1dMxfp8 : w1;
  const StoredTensor &w2f = quantized ? w2fMxfp8 : w2, &w2d = quantized ? w2dMxfp8 : w2;
  const MatrixView X = viewOf(x), dY = viewOf(dy);
  // F, and the rows of it this reference computes: all, or a part's, of which alone it holds W1's
  // rows, W2's columns and b1.
  const ReferencePart* part = o.part;
  TPSIM_INTERNAL_ASSERT(!part || !quantized, "mlpReference: a part of MXFP8 weights");
  const std::int64_t tokens = X.rows(), h = X.cols(), f = part ? part->whole : w1.shape[0];
  const std::int64_t fBegin = part ? part->begin : 0, fEnd = part ? part->end : f, fHere = fEnd - fBegin;
  TPSIM_INTERNAL_ASSERT(w1.shape[0] == fHere && w2.shape[1] == fHere && b1.numel() == fHere,
                        "mlpReference: weights of ", shapeText(w1.shape), " and ", shapeText(w2.shape), " for rows [",
                        fBegin, ", ", fEnd, ") of F");
  const double uAcc = o.accumulationUnit;
  const DType c = o.computeDtype;
  const int stages = 3, T = o.tp;  // the GEMM's rounding and the MLP's two more; the T partial sums
  const Upper aX = upperAbs(X), adY = upperAbs(dY);
  // |W1| and |W2| exist a block at a time as well, each block scaled by its whole matrix's exponent,
  // so that they hold what the whole matrices' Uppers would.
  auto largest = [](const StoredTensor& w) {
    return largestFinite(w.numel(), [&w](std::int64_t i) { return std::fabs(w.at(i)); });
  };
  double largestW1 = largest(w1f), largestW2 = largest(w2f);
  if (part) {  // the whole weights'
    const std::vector<double> all = part->allGather({largestW1, largestW2});
    for (std::size_t i = 0; i + 1 < all.size(); i += 2)
      largestW1 = std::max(largestW1, all[i]), largestW2 = std::max(largestW2, all[i + 1]);
  }
  const int eW1 = upperExponent(largestW1), eW2 = upperExponent(largestW2);
  const int eW1d = quantized ? upperExponent(largest(w1d)) : eW1, eW2d = quantized ? upperExponent(largest(w2d)) : eW2;
  // Rows [f0, f0 + fb) of F of a (F, h) weight, or columns [f0, f0 + fb) of an (h, F) one, in double.
  auto rowsInto = [h, fBegin](const StoredTensor& w, std::int64_t f0, std::int64_t fb, std::vector<double>& out) {
    out.resize(std::size_t(fb * h));
    readDoubles(w, (f0 - fBegin) * h, fb * h, out.data());
  };
  auto columnsInto = [h, fBegin, fHere](const StoredTensor& w, std::int64_t f0, std::int64_t fb,
                                        std::vector<double>& out) {
    out.resize(std::size_t(h * fb));
    for (std::int64_t r = 0; r < h; ++r) readDoubles(w, r * fHere + f0 - fBegin, fb, out.data() + r * fb);
  };
  auto absInto = [](const std::vector<double>& block, std::int64_t rows, std::int64_t cols, int exponent, Upper& u) {
    upperInto(rows, cols, [d = block.data()](std::int64_t i) { return std::fabs(d[i]); }, exponent, u);
  };
  std::vector<double> w1Block, w2Block, w1dBlock, w2dBlock;
  Upper aW1b, aW2b, aW1db, aW2db;

  // fc2 reads GeLU(H) rounded: an error of up to aErr·aH (|GeLU'| < 1.13) in each element. dH
  // carries fc2's dgrad error, up to dhErr·adA (adA = |dY|·|W2d|), into fc1's backward. Each
  // adds its own fp32 evaluation, relative to |H| <= aH and |dA| <= adA: GeLU's erf (2 ulp on
  // the device, 1 in glibc) and three roundings, under 4 units; GeLU''s erf, exp and seven
  // roundings, under 8.
  const double uEval = unitRoundoff(DType::kFloat32);
  const double aErr = 1.13 * (double(h + 2) * uAcc + 2 * unitRoundoff(c)) + 4 * uEval;
  const double dhErr = 1.13 * (double(h + 2) * uAcc + 4 * unitRoundoff(c)) + 8 * uEval;
  // A weight gradient's own GEMM rounds into its dtype (main_grad's under fusion), the MLP's two
  // more stages stay in the compute dtype.
  const double relY = relativeBound(uAcc, f, roundings(stages + T, o.outputDtype));
  const double relW2 = relativeBound(uAcc, tokens, roundings(stages - 1, c) + wgradRoundings(o, "fc2.weight.grad"));
  const double relX = relativeBound(uAcc, f, roundings(stages + T, c));
  const double relW1 = relativeBound(uAcc, tokens, roundings(stages - 1, c) + wgradRoundings(o, "fc1.weight.grad"));
  const double relB1 = relativeBound(uAcc, tokens, roundings(stages + T, c));

  // Every element of the (tokens, F) intermediates depends on one row of W1 and one column of
  // W2, so F goes through in blocks: the intermediates exist for one block at a time, in
  // buffers that stay in use (fresh memory is dear: freshVector), each weight is read once, the
  // weight gradients' rows and columns of a block are sent once it is done, and the results that
  // sum over F (y, dX) add the blocks' products, in block order. The blocks depend on the shapes
  // alone; a part's start at its first row. Where a row of a weight gradient falls in its block
  // changes no bit of it or of its bound (each is one product's row, its bound's operands scaled
  // by powers of two).
  const std::int64_t fBlock = blockRows(o, f, tokens);
  std::vector<std::pair<std::int64_t, std::int64_t>> blocks;  // (first row, rows)
  for (std::int64_t f0 = fBegin; f0 < fEnd; f0 += fBlock) blocks.emplace_back(f0, std::min(fBlock, fEnd - f0));
  auto zeros = [](std::int64_t rows, std::int64_t cols) {
    return Mat{rows, cols, freshVector<double>(rows * cols)};
  };
  sink.result("output", withLast(x.shape, h), o.outputDtype);
  sink.result("input.grad", x.shape, c);
  sink.result("fc1.weight.grad", {f, h}, c);
  sink.result("fc1.bias.grad", {f}, c);
  sink.result("fc2.weight.grad", {h, f}, c);
  sink.result("fc2.bias.grad", b2.shape, c);
  Mat y = zeros(tokens, h), boundY = zeros(tokens, h), dX = zeros(tokens, h), boundX = zeros(tokens, h);
  std::vector<double> db1(std::size_t(fHere), 0.0), db1Bound(std::size_t(fHere), 0.0);
  bool later = false;  // y and dX add to the earlier blocks'
  std::int64_t mostRows = 0;
  for (const auto& block : blocks) mostRows = std::max(mostRows, block.second);
  const std::int64_t bufferSize = tokens * mostRows, weightBlock = h * mostRows;
  std::vector<double> A = freshVector<double>(bufferSize), dGelu = freshVector<double>(bufferSize),
                      dH = freshVector<double>(bufferSize), aH = freshVector<double>(bufferSize),
                      adA = freshVector<double>(bufferSize);
  // A block's rows of dW1 (fb, h) and columns of dW2 (h, fb), with their bounds.
  std::vector<double> dW1 = freshVector<double>(weightBlock), boundW1 = freshVector<double>(weightBlock),
                      dW2 = freshVector<double>(weightBlock), boundW2 = freshVector<double>(weightBlock);
  Upper left;  // the bounds' (tokens, block) operands: |intermediate| · rel + its carried error
  for (auto block = blocks.begin(); block != blocks.end(); ++block, later = true) {
    const std::int64_t f0 = block->first, fb = block->second;
    const std::int64_t n = tokens * fb;
    auto operand = [&](double rel, const std::vector<double>& value, double carried,
                       const std::vector<double>& magnitude) -> const Upper& {
      upperInto(tokens, fb, [&, v = value.data(), m = magnitude.data()](std::int64_t i) {
        return rel * std::fabs(v[i]) + carried * m[i];
      }, left);
      return left;
    };
    const Eigen::Map<const Matrix> Ab(A.data(), tokens, fb), dHb(dH.data(), tokens, fb);
    rowsInto(w1f, f0, fb, w1Block);
    columnsInto(w2f, f0, fb, w2Block);
    absInto(w1Block, fb, h, eW1, aW1b);
    absInto(w2Block, h, fb, eW2, aW2b);
    if (quantized) {
      rowsInto(w1d, f0, fb, w1dBlock);
      columnsInto(w2d, f0, fb, w2dBlock);
      absInto(w1dBlock, fb, h, eW1d, aW1db);
      absInto(w2dBlock, h, fb, eW2d, aW2db);
    }
    const Upper &w1Dgrad = quantized ? aW1db : aW1b, &w2Dgrad = quantized ? aW2db : aW2b;
    const MatrixView W1b(w1Block.data(), fb, h), W2b(w2Block.data(), h, fb);
    const MatrixView W1db(quantized ? w1dBlock.data() : w1Block.data(), fb, h),
        W2db(quantized ? w2dBlock.data() : w2Block.data(), h, fb);

    // H = X·W1ᵀ + b1 (in A's place), its magnitude aH = |X|·|W1|ᵀ, then GeLU(H) and GeLU'(H).
    productInto<double>(X, W1b.transpose(), A.data(), fb);
    upperProductInto(aX.map(), aX.exponent, aW1b.map().transpose(), aW1b.exponent, aH.data(), fb, false);
    forChunks(n, [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t i = begin, j = begin % fb; i < end; ++i, j = j + 1 == fb ? 0 : j + 1) {
        const double z = A[std::size_t(i)] + b1.values[std::size_t(f0 - fBegin + j)], cdf = normalCdf(z);
        A[std::size_t(i)] = z * cdf;
        dGelu[std::size_t(i)] = cdf + z * normalPdf(z);
      }
    });

    // fc2: y = A·W2ᵀ + b2; dA = dY·W2d (in dH's place); dW2 = dYᵀ·A.
    productInto<double>(Ab, W2b.transpose(), y.v.data(), h, later);
    const Upper& yLeft = operand(relY, A, aErr, aH);
    upperProductInto(yLeft.map(), yLeft.exponent, aW2b.map().transpose(), aW2b.exponent, boundY.v.data(), h, later);
    productInto<double>(dY, W2db, dH.data(), fb);
    upperProductInto(adY.map(), adY.exponent, w2Dgrad.map(), w2Dgrad.exponent, adA.data(), fb, false);
    productInto<double>(dY.transpose(), Ab, dW2.data(), fb);
    const Upper& w2Right = operand(relW2, A, aErr, aH);
    upperProductInto(adY.map().transpose(), adY.exponent, w2Right.map(), w2Right.exponent, boundW2.data(), fb, false);
    sink.block("fc2.weight.grad", {0, f0, h, fb, fb, dW2.data(), boundW2.data()});

    // GeLU's backward: dH = dA ⊙ GeLU'(H).
    forChunks(n, [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t i = begin; i < end; ++i) dH[std::size_t(i)] *= dGelu[std::size_t(i)];
    });

    // fc1: dX = dH·W1d; dW1 = dHᵀ·X; db1 = Σ dH.
    productInto<double>(dHb, W1db, dX.v.data(), h, later);
    const Upper& xLeft = operand(relX, dH, dhErr, adA);
    upperProductInto(xLeft.map(), xLeft.exponent, w1Dgrad.map(), w1Dgrad.exponent, boundX.v.data(), h, later);
    productInto<double>(dHb.transpose(), X, dW1.data(), h);
    const Upper& w1Left = operand(relW1, dH, dhErr, adA);
    upperProductInto(w1Left.map().transpose(), w1Left.exponent, aX.map(), aX.exponent, boundW1.data(), h, false);
    sink.block("fc1.weight.grad", {f0, 0, fb, h, h, dW1.data(), boundW1.data()});
    for (std::int64_t i = 0; i < tokens; ++i)
      for (std::int64_t j = 0; j < fb; ++j) {
        const std::size_t at = std::size_t(i * fb + j);
        db1[std::size_t(f0 - fBegin + j)] += dH[at];
        db1Bound[std::size_t(f0 - fBegin + j)] += relB1 * std::fabs(dH[at]) + dhErr * adA[at];
      }
  }
  sink.block("fc1.bias.grad", {0, fBegin, 1, fHere, fHere, db1.data(), db1Bound.data()});
  if (part && !sumParts(*part, {&y.v, &boundY.v, &dX.v, &boundX.v})) return;
  addRows(y, b2.values);
  addRows(boundY, evaluate(relY * viewOf(b2).cwiseAbs()).v);

  sink.block("output", {0, 0, tokens, h, h, y.v.data(), boundY.v.data()});
  sink.block("input.grad", {0, 0, tokens, h, h, dX.v.data(), boundX.v.data()});
  Checked db2 = checked(uAcc, b2.shape, c, Mat{1, h, columnSums(dY)}, Mat{1, h, absColumnSums(dY)}, tokens,
                        roundings(stages + T, c));
  sink.block("fc2.bias.grad", {0, 0, 1, h, h, db2.value.values.data(), db2.bound.data()});
}

namespace {

// One expert's linear, as linearLayer sends it, passed on as the layer's: each row of output and
// input.grad as a block of its own, at its token's row; the expert's bias.grad as its own (`bias`.grad).
class ExpertSink final : public ReferenceSink {
 public:
  ExpertSink(ReferenceSink& next, const std::vector<std::int64_t>& tokens, std::string bias)
      : next_(next), tokens_(tokens), bias_(std::move(bias)) {}

  // The layer announced its output and input.grad.
  void result(const std::string& name, const std::vector<std::int64_t>& shape, DType dtype) override {
    if (!byToken(name)) next_.result(ownName(name), shape, dtype);
  }
  void block(const std::string& name, const ReferenceBlock& b) override {
    if (!byToken(name)) return next_.block(ownName(name), b);
    for (std::int64_t r = 0; r < b.rows; ++r)
      next_.block(name, {tokens_[std::size_t(b.row + r)], b.col, 1, b.cols, b.ld, b.value + r * b.ld,
                         b.bound + r * b.ld});
  }

 private:
  static bool byToken(const std::string& name) { return name == "output" || name == "input.grad"; }
  std::string ownName(const std::string& name) const { return name == "bias.grad" ? bias_ + ".grad" : name; }

  ReferenceSink& next_;
  const std::vector<std::int64_t>& tokens_;
  const std::string bias_;
};

// A result of zeros, announced and sent `rowsPerBlock` rows at a time: all of it, or only the
// indices [begin, begin + count) along its dimension `dim` (a vector's along its one).
void sendZeros(const std::string& name, const std::vector<std::int64_t>& shape, DType dtype,
               std::int64_t rowsPerBlock, ReferenceSink& sink, int dim = -1, std::int64_t begin = 0,
               std::int64_t count = 0) {
  sink.result(name, shape, dtype);
  const std::int64_t cols = shape.empty() ? 1 : shape.back();
  std::int64_t rows = 1;
  for (std::int64_t d : shape) rows *= d;
  rows = cols == 0 ? 0 : rows / cols;
  const bool alongCols = dim >= 0 && dim + 1 == int(shape.size()), alongRows = dim >= 0 && !alongCols;
  const std::int64_t rowBegin = alongRows ? begin : 0, rowEnd = alongRows ? begin + count : rows;
  const std::int64_t col = alongCols ? begin : 0, width = alongCols ? count : cols;
  std::vector<double> value, bound;
  for (std::int64_t r0 = rowBegin; r0 < rowEnd; r0 += rowsPerBlock) {
    const std::int64_t n = std::min(rowsPerBlock, rowEnd - r0);
    value.assign(std::size_t(n * width), 0.0);  // again for each block: the sink may change them
    bound.assign(std::size_t(n * width), 0.0);
    sink.block(name, {r0, col, n, width, width, value.data(), bound.data()});
  }
}

}  // namespace

void groupedReference(const ReferenceOptions& o, const InputMap& in, std::int64_t experts, ReferenceSink& sink) {
  const StoredTensor &x = need(in, "input"), &dy = need(in, "grad_output");
  const HostTensor ids = needHost(in, "expert_ids");
  const std::int64_t M = x.shape[0], K = x.shape[1], N = dy.shape[1];
  // Each expert's tokens' rows, read in place, as one linear of its expert (ExpertSink puts them
  // back in token order).
  auto rowsOf = [](const StoredTensor& t, const std::vector<std::int64_t>& rows) {
    const std::int64_t width = t.shape[1];
    const std::int64_t n = std::int64_t(rows.size());
    HostTensor part{{n, width}, t.dtype, freshVector<double>(n * width)};
    for (std::int64_t i = 0; i < n; ++i)
      readDoubles(t, rows[std::size_t(i)] * width, width, part.values.data() + i * width);
    return part;
  };
  std::vector<std::vector<std::int64_t>> tokensOf(static_cast<std::size_t>(experts));  // in token order
  for (std::int64_t i = 0; i < M; ++i) {
    const double id = ids.values[std::size_t(i)];
    TPSIM_CHECK(id >= 0 && id < double(experts), "groupedReference: expert_ids[", i, "] must be in [0, ", experts,
                "), got ", id);
    tokensOf[std::size_t(id)].push_back(i);
  }
  sink.result("output", {M, N}, o.outputDtype);
  sink.result("input.grad", {M, K}, o.computeDtype);
  for (std::int64_t e = 0; e < experts; ++e) {
    const std::string weight = detail::concat("weight", e), bias = detail::concat("bias", e);
    const std::optional<HostTensor> b = in.count(bias) ? std::optional(needHost(in, bias)) : std::nullopt;
    const std::vector<std::int64_t>& rows = tokensOf[std::size_t(e)];
    const StoredTensor& w = need(in, weight);
    if (rows.empty()) {  // an expert without tokens gets no gradient
      if (!o.part) {
        sendZeros(weight + ".grad", {N, K}, o.computeDtype, blockRows(o, N, K), sink);
        if (b) sendZeros(bias + ".grad", {N}, o.computeDtype, 1, sink);
        continue;
      }
      // A part's rows (a column's) or columns (a row's) of it; the first part a row's bias.grad.
      const int dim = o.part->split.at(weight);
      const std::int64_t count = w.shape[std::size_t(dim)];
      sendZeros(weight + ".grad", {N, K}, o.computeDtype, blockRows(o, N, K), sink, dim, o.part->begin, count);
      if (b && o.part->split.count(bias))
        sendZeros(bias + ".grad", {N}, o.computeDtype, 1, sink, 0, o.part->begin, count);
      else if (b && o.part->index == 0)
        sendZeros(bias + ".grad", {N}, o.computeDtype, 1, sink);
      continue;
    }
    ExpertSink expert(sink, rows, bias);
    std::map<std::string, Checked> whole =
        linearLayer(o, rowsOf(x, rows), w, w, b ? &*b : nullptr, rowsOf(dy, rows), weight, true, expert);
    sendBlocks(whole, expert);
  }
}

MagnitudeGemm bestMagnitudeGemm() {
  static const MagnitudeGemm best = sim::upperGemmBf16Runs() ? MagnitudeGemm::kBf16 : MagnitudeGemm::kFloat;
  return best;
}

std::vector<double> magnitudeProduct(const std::vector<double>& a, const std::vector<double>& b, std::int64_t m,
                                     std::int64_t k, std::int64_t n, MagnitudeGemm gemm) {
  TPSIM_CHECK(gemm == MagnitudeGemm::kFloat || sim::upperGemmBf16Runs(),
              "magnitudeProduct: bf16 needs AVX512-BF16, which this core lacks");
  TPSIM_CHECK(std::int64_t(a.size()) == m * k && std::int64_t(b.size()) == k * n, "magnitudeProduct: a must hold ", m,
              "·", k, " values and b ", k, "·", n, ", got ", a.size(), " and ", b.size());
  return upperMatmul(upperAbs(MatrixView(a.data(), m, k)), upperAbs(MatrixView(b.data(), k, n)), gemm).v;
}

HostTensor mxfp8Weight(const HostTensor& w, const TensorPlacement& placement, int axis, DType dtype) {
  TPSIM_CHECK(w.shape.size() == 2, "mxfp8Weight: the weight must be (N, K), got ", shapeText(w.shape));
  const TensorPlacement tpLocal = withoutGtp(placement);
  std::vector<HostTensor> quantized;  // each TP rank's own weight, quantized on its own
  for (int t = 0; t < tpLocal.tp.size; ++t) {
    HostTensor m = shardOf(tpLocal, w, t, 0);
    fakeQuantize(m.values, m.shape[0], m.shape[1], axis);
    quantized.push_back(std::move(m));
  }
  HostTensor out = assemble(tpLocal, [&](int t, int) -> const HostTensor& { return quantized[std::size_t(t)]; });
  return makeHost(w.shape, dtype, std::move(out.values));
}

}  // namespace tpsim::tools
