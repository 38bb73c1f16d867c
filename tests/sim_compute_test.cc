// Unit tests of sim::SimCompute (sim/sim_compute.h).
//
// Expectations are closed-form or computed here in double precision from the values as stored;
// nothing calls SimCompute to compute an expected value. 16-bit values are written and read with
// dtype.h's conversions, which dtype_test.cc checks on their own.
#include "sim/sim_compute.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace tpsim::sim {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// ---- Element access without SimCompute ------------------------------------------------------------

double getAt(ConstView v, std::int64_t offset) {
  const void* p = v.at(offset);
  switch (v.dtype()) {
    case DType::kFloat32: return *static_cast<const float*>(p);
    case DType::kBFloat16: return bf16ToFloat(*static_cast<const std::uint16_t*>(p));
    case DType::kFloat16: return halfToFloat(*static_cast<const std::uint16_t*>(p));
    case DType::kFloat64: return *static_cast<const double*>(p);
    case DType::kInt64: return double(*static_cast<const std::int64_t*>(p));
    case DType::kFloat8E4M3: return e4m3ToFloat(*static_cast<const std::uint8_t*>(p));
    case DType::kFloat8E8M0: return e8m0ToFloat(*static_cast<const std::uint8_t*>(p));
  }
  return kNaN;
}

// Test inputs are chosen exact in their dtype; anything else is rounded through float.
void setAt(View v, std::int64_t offset, double value) {
  void* p = v.at(offset);
  switch (v.dtype()) {
    case DType::kFloat32: *static_cast<float*>(p) = float(value); return;
    case DType::kBFloat16: *static_cast<std::uint16_t*>(p) = floatToBf16(float(value)); return;
    case DType::kFloat16: *static_cast<std::uint16_t*>(p) = floatToHalf(float(value)); return;
    case DType::kFloat64: *static_cast<double*>(p) = value; return;
    case DType::kInt64: *static_cast<std::int64_t*>(p) = std::int64_t(value); return;
    case DType::kFloat8E4M3: *static_cast<std::uint8_t*>(p) = toE4m3(value); return;
    case DType::kFloat8E8M0: *static_cast<std::uint8_t*>(p) = toE8m0(value); return;
  }
}

std::uint16_t bitsAt(ConstView v, std::int64_t offset) {
  return *static_cast<const std::uint16_t*>(v.at(offset));
}
double at2(ConstView v, std::int64_t i, std::int64_t j) {
  return getAt(v, i * v.stride(0) + j * v.stride(1));
}
void set2(View v, std::int64_t i, std::int64_t j, double value) {
  setAt(v, i * v.stride(0) + j * v.stride(1), value);
}

// Contiguous tensor holding `values` in row-major order.
Tensor make(SimCompute& sc, Shape shape, DType dtype, const std::vector<double>& values) {
  Tensor t = sc.empty(shape, dtype);
  EXPECT_EQ(values.size(), std::size_t(t.numel())) << "test bug: wrong number of values for " << shape;
  for (std::size_t i = 0; i < values.size(); ++i) setAt(t.view(), std::int64_t(i), values[i]);
  return t;
}

Tensor makeBits(SimCompute& sc, Shape shape, DType dtype, const std::vector<std::uint16_t>& bits) {
  Tensor t = sc.empty(shape, dtype);
  EXPECT_EQ(bits.size(), std::size_t(t.numel()));
  std::memcpy(t.data(), bits.data(), bits.size() * sizeof(std::uint16_t));
  return t;
}

std::vector<std::int64_t> int64s(ConstView v) {
  const auto* p = v.typed<std::int64_t>();
  return std::vector<std::int64_t>(p, p + v.numel());
}

// Expects fn() to throw InvalidArgument whose message contains `expected`.
template <typename Fn>
void expectInvalid(Fn&& fn, const std::string& expected) {
  try {
    fn();
    ADD_FAILURE() << "expected InvalidArgument containing \"" << expected << "\"";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << "message: " << e.what();
  }
}

// Unit roundoff of each dtype (half an ulp at 1).
double unitRoundoff(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16: return std::ldexp(1.0, -8);
    case DType::kFloat16: return std::ldexp(1.0, -11);
    case DType::kFloat32: return std::ldexp(1.0, -24);
    default: return std::ldexp(1.0, -53);
  }
}

// 1 + 2^-8 + 2^-30 rounds to bf16 0x3F81 directly, but to 0x3F80 through fp32 (1 + 2^-8 is a tie).
const double kBf16TieAbove = 1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -30);
// The same for fp16: 1 + 2^-11 + 2^-30 -> 0x3C01 directly, 0x3C00 through fp32.
const double kHalfTieAbove = 1.0 + std::ldexp(1.0, -11) + std::ldexp(1.0, -30);

// ---- Memory -------------------------------------------------------------------------------------

TEST(SimCompute, EmptyIsAlignedHostMemory) {
  SimCompute sc;
  EXPECT_EQ(sc.device(), Device::kHost);
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat64, DType::kInt64}) {
    Tensor t = sc.empty({3, 5}, dtype);
    EXPECT_TRUE(t.defined());
    EXPECT_EQ(t.shape(), Shape({3, 5}));
    EXPECT_EQ(t.dtype(), dtype);
    EXPECT_EQ(t.device(), Device::kHost);
    EXPECT_TRUE(t.view().isContiguous());
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(t.data()) % 64, 0u) << dtypeName(dtype);
  }
  Tensor none = sc.empty({0, 7}, DType::kFloat32);
  EXPECT_TRUE(none.defined());
  EXPECT_EQ(none.numel(), 0);
}

TEST(SimCompute, UploadDownloadRoundTrip) {
  SimCompute sc;
  const std::vector<double> in = {1.5, -2.0, 3.25, 1e300, -0.0, 7.0};  // (2, 3)
  Tensor t = sc.empty({2, 3}, DType::kFloat64);
  sc.upload(in.data(), t);
  for (std::size_t i = 0; i < in.size(); ++i)
    EXPECT_EQ(getAt(t, std::int64_t(i)), in[i]) << "mismatch at index " << i;
  std::vector<double> out(6, kNaN);  // (2, 3)
  sc.download(t, out.data());
  for (std::size_t i = 0; i < in.size(); ++i) EXPECT_EQ(out[i], in[i]) << "mismatch at index " << i;

  sc.upload(nullptr, sc.empty({0}, DType::kFloat32));  // nothing to copy
  expectInvalid([&] { sc.upload(in.data(), t.view().t()); },
                "upload: dst must be contiguous, got fp64 (3, 2) strides (1, 3)");
  expectInvalid([&] { sc.download(t.view().t(), out.data()); }, "download: src must be contiguous");
  View gpu(t.data(), t.shape(), t.dtype(), Device::kCuda);
  expectInvalid([&] { sc.upload(in.data(), gpu); },
                "upload: dst must be host memory, got fp64 (2, 3) on cuda");
}

TEST(SimCompute, ZerosFillsEveryDtype) {
  SimCompute sc;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat64, DType::kInt64}) {
    Tensor t = sc.zeros({2, 3, 4}, dtype);
    std::vector<unsigned char> bytes(t.view().bytes(), 0xff);
    std::memcpy(bytes.data(), t.data(), bytes.size());
    for (std::size_t i = 0; i < bytes.size(); ++i)
      ASSERT_EQ(bytes[i], 0) << dtypeName(dtype) << " mismatch at index " << i;
  }
}

// ---- fill, copy, axpy, scale --------------------------------------------------------------------

TEST(SimCompute, FillRoundsOnceAndSkipsGaps) {
  SimCompute sc;
  Tensor f32 = sc.empty({3}, DType::kFloat32);
  sc.fill(f32, 0.1);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(getAt(f32, i), double(0.1f)) << "mismatch at index " << i;

  Tensor bf = sc.empty({2}, DType::kBFloat16);
  sc.fill(bf, kBf16TieAbove);
  EXPECT_EQ(bitsAt(bf, 0), 0x3F81);
  sc.fill(bf, 1.0 / 3.0);  // 0x3EAAAAAB -> 0x3EAB
  EXPECT_EQ(bitsAt(bf, 1), 0x3EAB);

  Tensor half = sc.empty({1}, DType::kFloat16);
  sc.fill(half, kHalfTieAbove);
  EXPECT_EQ(bitsAt(half, 0), 0x3C01);
  sc.fill(half, 1e6);  // beyond 65504: inf
  EXPECT_EQ(bitsAt(half, 0), 0x7C00);

  Tensor f64 = sc.empty({1}, DType::kFloat64);
  sc.fill(f64, 0.1);
  EXPECT_EQ(getAt(f64, 0), 0.1);

  Tensor ids = sc.empty({2}, DType::kInt64);
  sc.fill(ids, 7.0);
  EXPECT_EQ(int64s(ids), (std::vector<std::int64_t>{7, 7}));
  expectInvalid([&] { sc.fill(ids, kNaN); }, "int64 output must receive values in [-2^63, 2^63), got nan");
  expectInvalid([&] { sc.fill(ids, 1e19); }, "int64 output");

  // A padded slice: only the view's elements change.
  Tensor big = make(sc, {3, 4}, DType::kFloat32, std::vector<double>(12, -1.0));
  sc.fill(big.view().slice(1, 1, 3), 5.0);  // (3, 2) strides (4, 1)
  for (int i = 0; i < 12; ++i)
    EXPECT_EQ(getAt(big, i), (i % 4 == 1 || i % 4 == 2) ? 5.0 : -1.0) << "mismatch at index " << i;
  View gpu(big.data(), big.shape(), big.dtype(), Device::kCuda);
  expectInvalid([&] { sc.fill(gpu, 0.0); }, "fill: y must be host memory, got fp32 (3, 4) on cuda");
}

TEST(SimCompute, CopyRoundsTiesToEvenFromFp32) {
  SimCompute sc;
  const float kOne = 1.0f;
  // 1 + 2^-8 (tie, to even 1), 1 + 3·2^-8 (tie, to even 1 + 2^-6), 1 + 2^-8 + 2^-23 (above tie).
  Tensor x = make(sc, {2, 2}, DType::kFloat32,
                  {kOne + 0x1p-8f, kOne + 0x3p-8f, kOne + 0x1p-8f + 0x1p-23f, -(kOne + 0x3p-8f)});
  Tensor y = sc.empty({2, 2}, DType::kBFloat16);
  sc.copy(x, y);
  const std::uint16_t expected[] = {0x3F80, 0x3F82, 0x3F81, 0xBF82};
  for (int i = 0; i < 4; ++i) EXPECT_EQ(bitsAt(y, i), expected[i]) << "mismatch at index " << i;
}

TEST(SimCompute, CopyFromFp64RoundsOnce) {
  SimCompute sc;
  Tensor x = make(sc, {2}, DType::kFloat64, {kBf16TieAbove, -kBf16TieAbove});
  Tensor bf = sc.empty({2}, DType::kBFloat16);
  sc.copy(x, bf);
  EXPECT_EQ(bitsAt(bf, 0), 0x3F81);
  EXPECT_EQ(bitsAt(bf, 1), 0xBF81);

  Tensor xh = make(sc, {3}, DType::kFloat64, {kHalfTieAbove, 1e-300, 1e300});
  Tensor half = sc.empty({3}, DType::kFloat16);
  sc.copy(xh, half);
  EXPECT_EQ(bitsAt(half, 0), 0x3C01);
  EXPECT_EQ(bitsAt(half, 1), 0x0000);  // far below the smallest subnormal
  EXPECT_EQ(bitsAt(half, 2), 0x7C00);  // beyond fp32 and fp16: inf
}

TEST(SimCompute, CopyWidensAndKeepsBits) {
  SimCompute sc;
  Tensor bf = makeBits(sc, {4}, DType::kBFloat16, {0x3F81, 0x0001, 0xFF80, 0x7F81});
  Tensor f32 = sc.empty({4}, DType::kFloat32);
  sc.copy(bf, f32);
  EXPECT_EQ(getAt(f32, 0), 1.0078125);
  EXPECT_EQ(getAt(f32, 1), std::ldexp(1.0, -133));
  EXPECT_EQ(getAt(f32, 2), -std::numeric_limits<double>::infinity());
  EXPECT_TRUE(std::isnan(getAt(f32, 3)));

  Tensor same = sc.empty({4}, DType::kBFloat16);  // same dtype: bitwise, NaN payload included
  sc.copy(bf, same);
  EXPECT_EQ(bitsAt(same, 3), 0x7F81);
}

TEST(SimCompute, CopyConvertsInt64) {
  SimCompute sc;
  Tensor ids = sc.empty({3}, DType::kInt64);
  const std::int64_t in[] = {3, -7, (std::int64_t(1) << 24) + 1};
  std::memcpy(ids.data(), in, sizeof in);
  Tensor f = sc.empty({3}, DType::kFloat32);
  sc.copy(ids, f);
  EXPECT_EQ(getAt(f, 0), 3.0);
  EXPECT_EQ(getAt(f, 1), -7.0);
  EXPECT_EQ(getAt(f, 2), 16777216.0);  // 2^24 + 1 ties to even
  Tensor d = sc.empty({3}, DType::kFloat64);
  sc.copy(ids, d);
  EXPECT_EQ(getAt(d, 2), 16777217.0);  // exact in fp64

  Tensor g = make(sc, {3}, DType::kFloat32, {2.9, -2.9, 5.0});
  Tensor back = sc.empty({3}, DType::kInt64);
  sc.copy(g, back);
  EXPECT_EQ(int64s(back), (std::vector<std::int64_t>{2, -2, 5}));  // truncates toward zero

  Tensor big = sc.empty({1}, DType::kInt64);
  const std::int64_t huge = (std::int64_t(1) << 62) + 1;  // not exact in fp64
  std::memcpy(big.data(), &huge, sizeof huge);
  Tensor bigCopy = sc.empty({1}, DType::kInt64);
  sc.copy(big, bigCopy);
  EXPECT_EQ(int64s(bigCopy)[0], huge);

  setAt(g, 0, kNaN);
  expectInvalid([&] { sc.copy(g, back); }, "int64 output must receive values");
}

TEST(SimCompute, CopyStrided4d) {
  SimCompute sc;
  Tensor x = sc.empty({2, 3, 4, 5}, DType::kFloat32);
  for (int i = 0; i < 120; ++i) setAt(x, i, i);
  View xt = x.view().transpose(0, 3).transpose(1, 2);  // (5, 4, 3, 2) strides (1, 5, 20, 60)
  Tensor y = sc.empty({5, 4, 3, 2}, DType::kFloat64);
  sc.copy(xt, y);
  int idx = 0;
  for (int a = 0; a < 5; ++a)
    for (int b = 0; b < 4; ++b)
      for (int c = 0; c < 3; ++c)
        for (int d = 0; d < 2; ++d, ++idx)
          EXPECT_EQ(getAt(y, idx), double(d * 60 + c * 20 + b * 5 + a)) << "mismatch at index " << idx;
  // And back into a permuted view of a bf16 tensor: z(a, b, c, d) lands at x's position again.
  Tensor z = sc.empty({2, 3, 4, 5}, DType::kBFloat16);
  sc.copy(y, z.view().transpose(0, 3).transpose(1, 2));
  for (int i = 0; i < 120; ++i) EXPECT_EQ(getAt(z, i), double(i)) << "mismatch at index " << i;
  expectInvalid([&] { sc.copy(x, y); }, "copy: y must have x's shape (2, 3, 4, 5), got fp64 (5, 4, 3, 2)");
}

TEST(SimCompute, AxpyAccumulatesIntoSameOrWider) {
  SimCompute sc;
  Tensor x = make(sc, {3}, DType::kFloat32, {4, 5, 6});
  Tensor y = make(sc, {3}, DType::kFloat32, {1, 2, 3});
  sc.axpy(0.5f, x, y);
  const double expected[] = {3, 4.5, 6};
  for (int i = 0; i < 3; ++i) EXPECT_EQ(getAt(y, i), expected[i]) << "mismatch at index " << i;

  // bf16 grad into an fp32 main grad, y a transposed view.
  Tensor g = make(sc, {2, 3}, DType::kBFloat16, {1, 2, 3, 4, 5, 0.0078125});
  Tensor main = make(sc, {3, 2}, DType::kFloat32, {10, 20, 30, 40, 50, 60});
  sc.axpy(2.f, g, main.view().t());
  const double expectedMain[] = {12, 28, 34, 50, 56, 60.015625};
  for (int i = 0; i < 6; ++i) EXPECT_EQ(getAt(main, i), expectedMain[i]) << "mismatch at index " << i;

  expectInvalid([&] { sc.axpy(1.f, x, sc.empty({3}, DType::kBFloat16)); },
                "axpy: y must have x's dtype fp32 or a wider one, got bf16 (3,)");
  expectInvalid([&] { sc.axpy(1.f, x, sc.empty({4}, DType::kFloat32)); },
                "axpy: y must have x's shape (3,), got fp32 (4,)");
  expectInvalid([&] { sc.axpy(1.f, sc.empty({3}, DType::kInt64), y); },
                "axpy: x must be fp32, bf16, fp16 or fp64, got int64 (3,)");
}

TEST(SimCompute, AxpyRoundsOnceInBf16) {
  SimCompute sc;
  // alpha·x = 2^-8 + 2^-17 exactly in fp32; y + alpha·x lies above the tie at 1 + 2^-8, so it
  // rounds up. Rounding alpha·x to bf16 first would give 2^-8 and a tie that rounds down to 1.
  Tensor x = make(sc, {1}, DType::kBFloat16, {0x1p-8});
  Tensor y = make(sc, {1}, DType::kBFloat16, {1.0});
  sc.axpy(1.0f + 0x1p-9f, x, y);
  EXPECT_EQ(bitsAt(y, 0), 0x3F81);
}

TEST(SimCompute, Scale) {
  SimCompute sc;
  Tensor y = make(sc, {3}, DType::kFloat32, {1, -2, 4});
  sc.scale(y, 0.25f);
  const double expected[] = {0.25, -0.5, 1};
  for (int i = 0; i < 3; ++i) EXPECT_EQ(getAt(y, i), expected[i]) << "mismatch at index " << i;

  Tensor bf = makeBits(sc, {1}, DType::kBFloat16, {0x3F81});  // 1.0078125
  sc.scale(bf, 1.0078125f);                                   // 1.01568603515625 -> nearest bf16 1.015625
  EXPECT_EQ(bitsAt(bf, 0), 0x3F82);

  Tensor d = make(sc, {1}, DType::kFloat64, {0.1});
  sc.scale(d, 3.f);
  EXPECT_EQ(getAt(d, 0), 0.1 * 3.0);
  expectInvalid([&] { sc.scale(sc.empty({2}, DType::kInt64), 2.f); },
                "scale: y must be fp32, bf16, fp16 or fp64, got int64");
}

// ---- gemm ---------------------------------------------------------------------------------------

enum class Layout { kRowMajor, kTransposed, kPadded, kNoUnitStride };

const char* layoutName(Layout layout) {
  switch (layout) {
    case Layout::kRowMajor: return "row";
    case Layout::kTransposed: return "t";
    case Layout::kPadded: return "pad";
    case Layout::kNoUnitStride: return "gap";
  }
  return "?";
}

// A (rows, cols) operand laid out as `layout`, inside storage full of NaN so stray reads show.
struct Operand {
  Tensor storage;
  View view;
};

Operand makeOperand(SimCompute& sc, std::int64_t rows, std::int64_t cols, DType dtype, Layout layout) {
  Operand op;
  switch (layout) {
    case Layout::kRowMajor:  // strides (cols, 1)
      op.storage = sc.empty({rows, cols}, dtype);
      op.view = op.storage.view();
      break;
    case Layout::kTransposed:  // strides (1, rows), as w.t() arrives
      op.storage = sc.empty({cols, rows}, dtype);
      op.view = op.storage.view().t();
      break;
    case Layout::kPadded:  // strides (cols + 3, 1): a column slice, row stride wider than the row
      op.storage = sc.empty({rows, cols + 3}, dtype);
      op.view = op.storage.view().slice(1, 2, 2 + cols);
      break;
    case Layout::kNoUnitStride:  // strides (2·cols + 1, 2): neither mode is unit-stride
      op.storage = sc.empty({rows, 2 * cols + 1}, dtype);
      op.view = View(op.storage.data(), Shape{rows, cols}, Strides{2 * cols + 1, 2}, dtype);
      break;
  }
  for (std::int64_t i = 0; i < op.storage.numel(); ++i) setAt(op.storage, i, kNaN);
  return op;
}

// Fills v with uniform values in [-1, 1), or integers in [-2, 2] when `integers`.
void fillRandom(View v, std::mt19937& rng, bool integers) {
  std::uniform_real_distribution<double> real(-1.0, 1.0);
  std::uniform_int_distribution<int> small(-2, 2);
  for (std::int64_t i = 0; i < v.dim(0); ++i)
    for (std::int64_t j = 0; j < v.dim(1); ++j) set2(v, i, j, integers ? small(rng) : real(rng));
}

struct GemmReference {
  std::vector<double> value;  // (M, N) row-major
  std::vector<double> bound;  // (M, N) allowed |error|
};

// c = alpha·a·b + beta·c0 in double from the stored values; the bound covers fp32 (or fp64)
// accumulation over K and the final rounding into outDtype.
GemmReference referenceGemm(ConstView a, ConstView b, ConstView c0, double alpha, double beta,
                            DType outDtype) {
  const std::int64_t m = a.dim(0), k = a.dim(1), n = b.dim(1);
  const double accU = unitRoundoff(a.dtype() == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32);
  GemmReference ref;
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      double sum = 0, mag = 0;
      for (std::int64_t p = 0; p < k; ++p) {
        sum += at2(a, i, p) * at2(b, p, j);
        mag += std::fabs(at2(a, i, p) * at2(b, p, j));
      }
      const double old = beta == 0 ? 0.0 : beta * at2(c0, i, j);
      const double value = alpha * sum + old;
      ref.value.push_back(value);
      ref.bound.push_back((std::fabs(alpha) * mag + std::fabs(old)) * accU * double(k + 2) +
                          std::fabs(value) * unitRoundoff(outDtype) + 1e-300);
    }
  return ref;
}

struct GemmCase {
  DType in, out;  // a and b, c
  Layout a, b, c;
};

std::ostream& operator<<(std::ostream& os, const GemmCase& g) {
  return os << dtypeName(g.in) << " -> " << dtypeName(g.out) << ", a " << layoutName(g.a) << ", b "
            << layoutName(g.b) << ", c " << layoutName(g.c);
}

// Every pair of dtypes gemm accepts, with every layout of each operand.
std::vector<GemmCase> allGemmCases() {
  const Layout layouts[] = {Layout::kRowMajor, Layout::kTransposed, Layout::kPadded, Layout::kNoUnitStride};
  std::vector<GemmCase> cases;
  for (auto [in, out] :
       {std::pair{DType::kFloat32, DType::kFloat32}, std::pair{DType::kBFloat16, DType::kBFloat16},
        std::pair{DType::kFloat16, DType::kFloat16}, std::pair{DType::kFloat64, DType::kFloat64},
        std::pair{DType::kBFloat16, DType::kFloat32}, std::pair{DType::kFloat16, DType::kFloat32}})
    for (Layout a : layouts)
      for (Layout b : layouts)
        for (Layout c : layouts) cases.push_back({in, out, a, b, c});
  return cases;
}

class GemmLayouts : public ::testing::TestWithParam<GemmCase> {};

TEST_P(GemmLayouts, MatchesDoubleReference) {
  const GemmCase g = GetParam();
  const DType in = g.in, out = g.out;
  const Layout la = g.a, lb = g.b, lc = g.c;
  SimCompute sc;
  std::mt19937 rng(1234);
  struct Size {
    std::int64_t m, k, n;
  };
  // Small sizes take Eigen's coefficient-wise path, 37x70x29 its blocked gemm, M or N == 1 gemv.
  for (Size s : {Size{5, 7, 3}, Size{37, 70, 29}, Size{1, 33, 17}, Size{19, 33, 1}, Size{4, 1, 6}}) {
    for (auto [alpha, beta] : {std::pair{1.f, 0.f}, std::pair{1.5f, -0.5f}, std::pair{-1.f, 1.f}}) {
      Operand a = makeOperand(sc, s.m, s.k, in, la);   // (M, K)
      Operand b = makeOperand(sc, s.k, s.n, in, lb);   // (K, N)
      Operand c = makeOperand(sc, s.m, s.n, out, lc);  // (M, N)
      fillRandom(a.view, rng, false);
      fillRandom(b.view, rng, false);
      if (beta != 0.f) fillRandom(c.view, rng, false);  // beta == 0: c stays NaN and must not leak
      const GemmReference ref = referenceGemm(a.view, b.view, c.view, alpha, beta, out);
      sc.gemm(a.view, b.view, c.view, alpha, beta);
      for (std::int64_t i = 0; i < s.m; ++i)
        for (std::int64_t j = 0; j < s.n; ++j) {
          const std::size_t idx = std::size_t(i * s.n + j);
          ASSERT_NEAR(at2(c.view, i, j), ref.value[idx], ref.bound[idx])
              << "mismatch at index " << idx << " (" << i << ", " << j << ") of (M=" << s.m << ", K=" << s.k
              << ", N=" << s.n << "), alpha " << alpha << ", beta " << beta;
        }
      // The storage around c is untouched (still NaN).
      std::vector<bool> inView(std::size_t(c.storage.numel()), false);  // (storage numel)
      const std::int64_t base = (static_cast<char*>(c.view.data()) - static_cast<char*>(c.storage.data())) /
                                std::int64_t(dtypeSize(out));
      for (std::int64_t i = 0; i < s.m; ++i)
        for (std::int64_t j = 0; j < s.n; ++j)
          inView[std::size_t(base + i * c.view.stride(0) + j * c.view.stride(1))] = true;
      for (std::int64_t i = 0; i < c.storage.numel(); ++i)
        ASSERT_TRUE(inView[std::size_t(i)] || std::isnan(getAt(c.storage, i)))
            << "gemm wrote outside c: mismatch at index " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(SimCompute, GemmLayouts, ::testing::ValuesIn(allGemmCases()),
                         [](const ::testing::TestParamInfo<GemmCase>& info) {
                           const GemmCase& g = info.param;
                           return std::string(dtypeName(g.in)) + "_to_" + dtypeName(g.out) + "_a_" +
                                  layoutName(g.a) + "_b_" + layoutName(g.b) + "_c_" + layoutName(g.c);
                         });

TEST(SimCompute, GemmIsExactOnSmallIntegers) {
  SimCompute sc;
  std::mt19937 rng(7);
  const std::int64_t m = 9, k = 40, n = 11;  // |a·b| <= 160, |c| <= 2: exact even in bf16
  for (auto [in, out] :
       {std::pair{DType::kFloat32, DType::kFloat32}, std::pair{DType::kBFloat16, DType::kBFloat16},
        std::pair{DType::kBFloat16, DType::kFloat32}, std::pair{DType::kFloat16, DType::kFloat16},
        std::pair{DType::kFloat64, DType::kFloat64}}) {
    for (Layout layout : {Layout::kRowMajor, Layout::kTransposed, Layout::kNoUnitStride}) {
      Operand a = makeOperand(sc, m, k, in, layout);
      Operand b = makeOperand(sc, k, n, in, Layout::kTransposed);
      Operand c = makeOperand(sc, m, n, out, layout);
      fillRandom(a.view, rng, true);
      fillRandom(b.view, rng, true);
      fillRandom(c.view, rng, true);
      const GemmReference ref = referenceGemm(a.view, b.view, c.view, 1.0, 1.0, out);
      sc.gemm(a.view, b.view, c.view, 1.f, 1.f);
      for (std::int64_t i = 0; i < m; ++i)
        for (std::int64_t j = 0; j < n; ++j)
          ASSERT_EQ(at2(c.view, i, j), ref.value[std::size_t(i * n + j)])
              << dtypeName(in) << " -> " << dtypeName(out) << " " << layoutName(layout)
              << ": mismatch at index " << i * n + j;
    }
  }
}

TEST(SimCompute, GemmRoundsOnceIntoBf16) {
  SimCompute sc;
  // 1 + 4·2^-8 = 1 + 2^-6 is a bf16 value; adding 2^-8 four times with bf16 rounding after
  // each add would stay at 1 (every step is a tie that rounds to even).
  Tensor a = make(sc, {1, 5}, DType::kBFloat16, {1, 0x1p-8, 0x1p-8, 0x1p-8, 0x1p-8});
  Tensor b = make(sc, {5, 1}, DType::kBFloat16, {1, 1, 1, 1, 1});
  Tensor c = sc.empty({1, 1}, DType::kBFloat16);
  sc.gemm(a, b, c);
  EXPECT_EQ(bitsAt(c, 0), 0x3F82);
  // alpha·a·b and beta·c join in fp32 before the one rounding: 1 + (1 + 2^-9)·2^-8 rounds up.
  // Rounding alpha·a·b to bf16 first would give 2^-8 and a tie that rounds down to 1.
  Tensor one = make(sc, {1, 1}, DType::kBFloat16, {1});
  Tensor small = make(sc, {1, 1}, DType::kBFloat16, {0x1p-8});
  setAt(c, 0, 1.0);
  sc.gemm(small, one, c, 1.0f + 0x1p-9f, 1.f);
  EXPECT_EQ(bitsAt(c, 0), 0x3F81);
}

TEST(SimCompute, GemmBf16IntoFp32KeepsFullPrecision) {
  SimCompute sc;
  Tensor a = make(sc, {1, 3}, DType::kBFloat16, {1, 0x1p-8, 0x1p-9});
  Tensor b = make(sc, {3, 2}, DType::kBFloat16, {1, 1, 1, -1, 1, 1});
  Tensor c = make(sc, {1, 2}, DType::kFloat32, {0x1p-20, 100});
  sc.gemm(a, b, c, 1.f, 1.f);
  EXPECT_EQ(getAt(c, 0), 1 + 0x1p-8 + 0x1p-9 + 0x1p-20);
  EXPECT_EQ(getAt(c, 1), 100 + 1 - 0x1p-8 + 0x1p-9);
}

TEST(SimCompute, GemmBetaZeroIgnoresNaN) {
  SimCompute sc;
  for (auto [in, out] :
       {std::pair{DType::kFloat32, DType::kFloat32}, std::pair{DType::kBFloat16, DType::kFloat32},
        std::pair{DType::kBFloat16, DType::kBFloat16}}) {
    for (Layout layout : {Layout::kRowMajor, Layout::kTransposed, Layout::kNoUnitStride}) {
      Tensor a = make(sc, {2, 2}, in, {1, 2, 3, 4});
      Tensor b = make(sc, {2, 2}, in, {1, 0, 0, 1});
      Operand c = makeOperand(sc, 2, 2, out, layout);  // all NaN
      sc.gemm(a, b, c.view, 2.f, 0.f);
      for (int i = 0; i < 4; ++i)
        EXPECT_EQ(at2(c.view, i / 2, i % 2), 2.0 * (i + 1))
            << layoutName(layout) << ": mismatch at index " << i;
    }
  }
}

TEST(SimCompute, GemmEmptyShapes) {
  SimCompute sc;
  // K == 0: c = beta·c.
  Tensor a = sc.empty({2, 0}, DType::kFloat32);
  Tensor b = sc.empty({0, 3}, DType::kFloat32);
  Tensor c = make(sc, {2, 3}, DType::kFloat32, {1, 2, 3, 4, 5, 6});
  sc.gemm(a, b, c, 1.f, 0.5f);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(getAt(c, i), 0.5 * (i + 1)) << "mismatch at index " << i;
  Tensor cb = make(sc, {2, 3}, DType::kBFloat16, {1, 2, 3, 4, 5, 6});
  sc.gemm(sc.empty({2, 0}, DType::kBFloat16), sc.empty({0, 3}, DType::kBFloat16), cb, 1.f, 0.f);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(getAt(cb, i), 0.0) << "mismatch at index " << i;
  // M == 0 or N == 0: nothing to compute.
  Tensor c0 = sc.empty({0, 3}, DType::kFloat32);
  sc.gemm(sc.empty({0, 4}, DType::kFloat32), sc.empty({4, 3}, DType::kFloat32), c0, 1.f, 1.f);
  Tensor cn = sc.empty({2, 0}, DType::kFloat64);
  sc.gemm(sc.empty({2, 4}, DType::kFloat64), sc.empty({4, 0}, DType::kFloat64), cn);
  EXPECT_EQ(c0.numel() + cn.numel(), 0);
}

TEST(SimCompute, GemmRejectsBadArguments) {
  SimCompute sc;
  Tensor a = sc.empty({8, 64}, DType::kFloat32);
  Tensor b = sc.empty({64, 16}, DType::kFloat32);
  Tensor c = sc.empty({8, 16}, DType::kFloat32);
  expectInvalid(
      [&] {
        sc.gemm(a, sc.empty({32, 16}, DType::kFloat32), c);
      },
      "gemm: b must be (K=64, N), got fp32 (32, 16)");
  expectInvalid([&] { sc.gemm(a, sc.empty({64}, DType::kFloat32), c); },
                "gemm: b must be (K=64, N), got fp32 (64,)");
  expectInvalid(
      [&] {
        sc.gemm(a, b, sc.empty({8, 15}, DType::kFloat32));
      },
      "gemm: c must be (M=8, N=16), got fp32 (8, 15)");
  expectInvalid([&] { sc.gemm(a, b, c.view().t()); },
                "gemm: c must be (M=8, N=16), got fp32 (16, 8) strides (1, 16)");
  expectInvalid([&] { sc.gemm(sc.empty({8}, DType::kFloat32), b, c); },
                "gemm: a must be a matrix (M, K), got fp32 (8,)");
  expectInvalid(
      [&] {
        sc.gemm(sc.empty({8, 64}, DType::kBFloat16), b, c);
      },
      "gemm: b must have a's dtype bf16, got fp32 (64, 16)");
  expectInvalid(
      [&] {
        sc.gemm(sc.empty({8, 64}, DType::kInt64), sc.empty({64, 16}, DType::kInt64), c);
      },
      "gemm: a must be fp32, bf16, fp16 or fp64, got int64 (8, 64)");
  // Narrower or unsupported outputs.
  expectInvalid(
      [&] {
        sc.gemm(a, b, sc.empty({8, 16}, DType::kBFloat16));
      },
      "gemm: c must have a's dtype fp32, got bf16 (8, 16)");
  expectInvalid(
      [&] {
        sc.gemm(a, b, sc.empty({8, 16}, DType::kFloat64));
      },
      "gemm: c must have a's dtype fp32, got fp64 (8, 16)");
  expectInvalid(
      [&] {
        sc.gemm(sc.empty({8, 64}, DType::kFloat64), sc.empty({64, 16}, DType::kFloat64), c);
      },
      "gemm: c must have a's dtype fp64, got fp32 (8, 16)");
  expectInvalid(
      [&] {
        sc.gemm(sc.empty({8, 64}, DType::kBFloat16), sc.empty({64, 16}, DType::kBFloat16),
                sc.empty({8, 16}, DType::kFloat16));
      },
      "gemm: c must have a's dtype bf16 or fp32, got fp16 (8, 16)");
  expectInvalid(
      [&] {
        sc.gemm(a, b, sc.empty({8, 16}, DType::kInt64));
      },
      "gemm: c must have a's dtype fp32, got int64");
  View gpu(b.data(), b.shape(), b.dtype(), Device::kCuda);
  expectInvalid([&] { sc.gemm(a, gpu, c); }, "gemm: b must be host memory, got fp32 (64, 16) on cuda");
}

// ---- addBias, sumRows ---------------------------------------------------------------------------

TEST(SimCompute, AddBiasBroadcastsOverLeadingModes) {
  SimCompute sc;
  Tensor y = sc.zeros({2, 2, 3}, DType::kFloat32);  // (s, b, N)
  for (int i = 0; i < 12; ++i) setAt(y, i, i);
  Tensor bias = make(sc, {3}, DType::kFloat32, {100, 200, 300});
  sc.addBias(bias, y);
  for (int i = 0; i < 12; ++i) EXPECT_EQ(getAt(y, i), i + 100.0 * (i % 3 + 1)) << "mismatch at index " << i;

  // Strided bias (a column of a matrix) into a transposed bf16 y.
  Tensor w = make(sc, {3, 2}, DType::kFloat64, {1, -1, 2, -2, 3, -3});
  Tensor yt = sc.zeros({3, 4}, DType::kBFloat16);                                 // y = yt.t(): (4, 3)
  const ConstView column(w.view().at(1), Shape{3}, Strides{2}, DType::kFloat64);  // (N) = (-1, -2, -3)
  sc.addBias(column, yt.view().t());
  for (int i = 0; i < 12; ++i) EXPECT_EQ(getAt(yt, i), -(i / 4 + 1.0)) << "mismatch at index " << i;

  expectInvalid(
      [&] {
        sc.addBias(bias, sc.empty({2, 4}, DType::kFloat32));
      },
      "addBias: y must be (..., N=3), got fp32 (2, 4)");
  expectInvalid(
      [&] {
        sc.addBias(sc.empty({1, 3}, DType::kFloat32), y);
      },
      "addBias: bias must be a vector (N), got fp32 (1, 3)");
}

TEST(SimCompute, AddBiasRoundsOnce) {
  SimCompute sc;
  // 1 + (2^-8 + 2^-17) rounds up in bf16; rounding the fp32 bias to bf16 first would give a tie.
  Tensor y = make(sc, {1, 1}, DType::kBFloat16, {1});
  Tensor bias = make(sc, {1}, DType::kFloat32, {0x1p-8 + 0x1p-17});
  sc.addBias(bias, y);
  EXPECT_EQ(bitsAt(y, 0), 0x3F81);
}

TEST(SimCompute, SumRowsAddsRowsInIncreasingOrder) {
  SimCompute sc;
  // Column 0: 2^24 + 1 + 1 in fp32, in order, stays 2^24 (each + 1 is a tie to even); any other
  // order would give 2^24 + 2.
  Tensor y = make(sc, {3, 2}, DType::kBFloat16, {0x1p24, 1, 1, 1, 1, 1});
  Tensor out = make(sc, {2}, DType::kFloat32, {kNaN, kNaN});
  sc.sumRows(y, out);  // beta = 0: NaN in out does not leak
  EXPECT_EQ(getAt(out, 0), 0x1p24);
  EXPECT_EQ(getAt(out, 1), 3.0);
}

TEST(SimCompute, SumRowsBetaAndRank3) {
  SimCompute sc;
  Tensor y = sc.empty({2, 2, 3}, DType::kFloat64);  // (s, b, N)
  for (int i = 0; i < 12; ++i) setAt(y, i, i);
  Tensor out = make(sc, {3}, DType::kFloat64, {1, 2, 3});
  sc.sumRows(y, out, 2.f);
  // Σ rows of column j = j + (3 + j) + (6 + j) + (9 + j) = 18 + 4j.
  for (int j = 0; j < 3; ++j)
    EXPECT_EQ(getAt(out, j), 18.0 + 4 * j + 2.0 * (j + 1)) << "mismatch at index " << j;

  // A transposed fp32 y into a bf16 out.
  Tensor yt = make(sc, {2, 3}, DType::kFloat32, {1, 2, 3, 4, 5, 6});  // y = yt.t(): (3, 2)
  Tensor outBf = sc.empty({2}, DType::kBFloat16);
  sc.sumRows(yt.view().t(), outBf);
  EXPECT_EQ(getAt(outBf, 0), 6.0);
  EXPECT_EQ(getAt(outBf, 1), 15.0);

  expectInvalid([&] { sc.sumRows(y, sc.empty({4}, DType::kFloat64)); },
                "sumRows: out must be (N=3), got fp64 (4,)");
  expectInvalid([&] { sc.sumRows(sc.empty({2}, DType::kInt64), out); },
                "sumRows: y must be fp32, bf16, fp16 or fp64, got int64 (2,)");
}

// ---- gelu ---------------------------------------------------------------------------------------

const std::vector<double> kGeluX = {-3, -1, -0.5, 0, 0.5, 1, 2, 3};
// x·Φ(x) and Φ(x) + x·φ(x) at kGeluX, from 0.5·x·(1 + erf(x/√2)) in double (closed form).
const std::vector<double> kGelu = {
    -0.00404969409489031, -0.15865525393145707, -0.15426876936299344, 0.0,
    0.34573123063700656,  0.8413447460685429,   1.9544997361036416,   2.99595030590511};
const std::vector<double> kGeluGrad = {
    -0.011945647204183918, -0.08331547058768629, 0.13250487534383712, 0.5,
    0.8674951246561629,    1.0833154705876864,   1.085231801078197,   1.011945647204184};

TEST(SimCompute, GeluMatchesClosedForm) {
  SimCompute sc;
  const std::int64_t n = std::int64_t(kGeluX.size());
  for (auto [in, out] :
       {std::pair{DType::kFloat64, DType::kFloat64}, std::pair{DType::kFloat32, DType::kFloat32},
        std::pair{DType::kBFloat16, DType::kBFloat16}, std::pair{DType::kBFloat16, DType::kFloat32},
        std::pair{DType::kFloat16, DType::kFloat16}}) {
    Tensor x = make(sc, {2, n / 2}, in, kGeluX);
    Tensor y = sc.empty({2, n / 2}, out);
    sc.gelu(x, y);
    const double tol = in == DType::kFloat64 ? 1e-15 : 4e-7;
    for (std::int64_t i = 0; i < n; ++i)
      EXPECT_NEAR(getAt(y, i), kGelu[std::size_t(i)],
                  tol + std::fabs(kGelu[std::size_t(i)]) * unitRoundoff(out))
          << dtypeName(in) << " -> " << dtypeName(out) << ": mismatch at index " << i;
  }
  expectInvalid([&] { sc.gelu(sc.empty({2}, DType::kFloat32), sc.empty({3}, DType::kFloat32)); },
                "gelu: y must have x's shape (2,), got fp32 (3,)");
}

TEST(SimCompute, GeluBackwardMatchesClosedForm) {
  SimCompute sc;
  const std::int64_t n = std::int64_t(kGeluX.size());
  for (DType dtype : {DType::kFloat64, DType::kFloat32, DType::kBFloat16}) {
    Tensor x = make(sc, {n}, dtype, kGeluX);
    Tensor dy = make(sc, {n}, dtype, std::vector<double>(std::size_t(n), -2.0));
    Tensor dx = sc.empty({n}, dtype);
    sc.geluBackward(x, dy, dx);
    const double tol = dtype == DType::kFloat64 ? 1e-15 : 1e-6;
    for (std::int64_t i = 0; i < n; ++i) {
      const double expected = -2.0 * kGeluGrad[std::size_t(i)];
      EXPECT_NEAR(getAt(dx, i), expected, tol + std::fabs(expected) * unitRoundoff(dtype))
          << dtypeName(dtype) << ": mismatch at index " << i;
    }
  }
  expectInvalid(
      [&] {
        sc.geluBackward(sc.empty({2}, DType::kFloat32), sc.empty({2, 1}, DType::kFloat32),
                        sc.empty({2}, DType::kFloat32));
      },
      "geluBackward: dy must have x's shape (2,), got fp32 (2, 1)");
}

// ---- gatherRows, scatterAddRows -----------------------------------------------------------------

Tensor makeIds(SimCompute& sc, Shape shape, const std::vector<std::int64_t>& ids) {
  Tensor t = sc.empty(shape, DType::kInt64);
  std::memcpy(t.data(), ids.data(), ids.size() * sizeof(std::int64_t));
  return t;
}

TEST(SimCompute, GatherRowsMasksForeignIds) {
  SimCompute sc;
  // This shard owns ids [10, 14): table row r holds 10·(r + 1) + column. The rows around the
  // table hold -1 so a read past either end shows.
  Tensor storage = make(sc, {6, 3}, DType::kFloat32,
                        {-1, -1, -1, 10, 11, 12, 20, 21, 22, 30, 31, 32, 40, 41, 42, -1, -1, -1});
  const ConstView table = storage.view().slice(0, 1, 5);  // (V=4, h=3)
  Tensor ids = makeIds(sc, {2, 3}, {9, 10, 13, 14, 11, 10});
  Tensor out = make(sc, {6, 3}, DType::kBFloat16, std::vector<double>(18, kNaN));
  sc.gatherRows(table, ids, 10, out);
  const int rows[] = {-1, 0, 3, -1, 1, 0};  // -1: not owned, zeros
  for (int i = 0; i < 18; ++i) {
    const int r = rows[i / 3];
    EXPECT_EQ(getAt(out, i), r < 0 ? 0.0 : 10.0 * (r + 1) + i % 3) << "mismatch at index " << i;
  }
  expectInvalid(
      [&] {
        sc.gatherRows(table, ids, 10, sc.empty({5, 3}, DType::kFloat32));
      },
      "gatherRows: out must be (n=6, h=3), got fp32 (5, 3)");
  expectInvalid([&] { sc.gatherRows(table, sc.empty({6}, DType::kFloat32), 10, out); },
                "gatherRows: ids must be int64, got fp32 (6,)");
}

TEST(SimCompute, ScatterAddRowsAccumulatesRepeatedIds) {
  SimCompute sc;
  Tensor ids = makeIds(sc, {6}, {11, 9, 11, 13, 14, 10});
  Tensor grad = sc.empty({6, 2}, DType::kBFloat16);  // grad row i = (i + 1, -(i + 1))
  for (int i = 0; i < 12; ++i) setAt(grad, i, (i % 2 ? -1 : 1) * (i / 2 + 1));
  Tensor storage = sc.zeros({6, 2}, DType::kFloat32);  // rows 0 and 5 lie outside the table
  const View table = storage.view().slice(0, 1, 5);    // (V=4, h=2), owns ids [10, 14)
  sc.scatterAddRows(grad, ids, 10, table);
  // 9 and 14 are not owned; 11 collects grad rows 0 and 2.
  const double expected[] = {0, 0, 6, -6, 1 + 3, -(1 + 3), 0, 0, 4, -4, 0, 0};
  for (int i = 0; i < 12; ++i) EXPECT_EQ(getAt(storage, i), expected[i]) << "mismatch at index " << i;

  expectInvalid(
      [&] {
        sc.scatterAddRows(sc.empty({5, 2}, DType::kBFloat16), ids, 10, table);
      },
      "scatterAddRows: grad must be (n=6, h=2), got bf16 (5, 2)");
  expectInvalid(
      [&] {
        sc.scatterAddRows(sc.empty({6, 2}, DType::kFloat32), ids, 10, sc.zeros({4, 2}, DType::kBFloat16));
      },
      "scatterAddRows: table must have grad's dtype fp32 or a wider one, got bf16 (4, 2)");
}

TEST(SimCompute, ScatterAddRowsRoundsEachAdd) {
  SimCompute sc;
  Tensor ids = makeIds(sc, {2}, {10, 10});
  Tensor grad = make(sc, {2, 1}, DType::kBFloat16, {0x1p-8, 0x1p-8});
  // bf16 table: each add of 2^-8 to 1 is a tie that rounds back to 1.
  Tensor bf = make(sc, {1, 1}, DType::kBFloat16, {1});
  sc.scatterAddRows(grad, ids, 10, bf);
  EXPECT_EQ(bitsAt(bf, 0), 0x3F80);
  // fp32 table keeps both adds.
  Tensor f32 = make(sc, {1, 1}, DType::kFloat32, {1});
  sc.scatterAddRows(grad, ids, 10, f32);
  EXPECT_EQ(getAt(f32, 0), 1 + 0x1p-7);
}


// ---- MXFP8 quantize / dequantize ------------------------------------------------------------------

// Reference scale exponent, searched rather than read off amax's fields: the least e in
// [-127, 127] with amax <= 448·2^e; 2^-127 for an all-zero block, 2^127 when nothing fits.
int referenceMxExponent(double amax) {
  if (amax == 0) return -127;
  for (int e = -127; e < 127; ++e)
    if (amax <= 448.0 * std::ldexp(1.0, e)) return e;
  return 127;
}

// The expected data bits and scale bits of `x` (R, C) quantized along `axis`, by plain loops.
struct MxExpected {
  std::vector<std::uint8_t> data;    // (R, C)
  std::vector<std::uint8_t> scales;  // the scales' shape, row-major
};
MxExpected referenceMxfp8(ConstView x, int axis) {
  const std::int64_t rows = x.dim(0), cols = x.dim(1);
  const std::int64_t blocksAlong = ((axis == 1 ? cols : rows) + 31) / 32;
  MxExpected out{std::vector<std::uint8_t>(std::size_t(rows * cols)), {}};
  const std::int64_t scaleRows = axis == 1 ? rows : blocksAlong, scaleCols = axis == 1 ? blocksAlong : cols;
  out.scales.resize(std::size_t(scaleRows * scaleCols));
  for (std::int64_t si = 0; si < scaleRows; ++si)
    for (std::int64_t sj = 0; sj < scaleCols; ++sj) {
      std::vector<std::pair<std::int64_t, std::int64_t>> block;  // (row, col) of each element
      for (std::int64_t k = 0; k < 32; ++k) {
        const std::int64_t r = axis == 1 ? si : si * 32 + k, c = axis == 1 ? sj * 32 + k : sj;
        if (r < rows && c < cols) block.emplace_back(r, c);
      }
      double amax = 0;
      bool nan = false;
      for (auto [r, c] : block) {
        nan = nan || std::isnan(at2(x, r, c));
        amax = std::max(amax, std::fabs(at2(x, r, c)));
      }
      const int e = referenceMxExponent(amax);
      out.scales[std::size_t(si * scaleCols + sj)] = nan ? 0xff : std::uint8_t(e + 127);
      for (auto [r, c] : block)
        out.data[std::size_t(r * cols + c)] = nan ? 0x7f : toE4m3(at2(x, r, c) / std::ldexp(1.0, e));
    }
  return out;
}

std::uint8_t byteAt2(ConstView v, std::int64_t i, std::int64_t j) {
  return *static_cast<const std::uint8_t*>(v.at(i * v.stride(0) + j * v.stride(1)));
}

// 5 rows of 70 (two full blocks and a tail of 6 per row), one kind of block per row: ordinary
// values; zeros, float subnormals, huge values; amax exactly at 448·2^e and just past it; a wide
// dynamic range that sends small elements to E4M3 subnormals and zero; exponents spread widely.
std::vector<double> mxfp8Input() {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::uniform_int_distribution<int> spread(-20, 20);
  std::vector<double> v(5 * 70);
  for (int c = 0; c < 70; ++c) {
    const int block = c / 32;
    v[0 * 70 + c] = 3 * u(rng);
    v[1 * 70 + c] = block == 0 ? 0.0 : block == 1 ? 1e-39 * u(rng) : 1e30 * u(rng);
    v[2 * 70 + c] = u(rng);
    v[3 * 70 + c] = c % 7 == 0 ? 100.0 : 1e-3 * u(rng);
    v[4 * 70 + c] = std::ldexp(u(rng), spread(rng));
  }
  v[2 * 70 + 5] = 448.0;       // block 0: e = 0 exactly
  v[2 * 70 + 40] = -449.0;     // block 1: just past, e = 1
  v[2 * 70 + 66] = 448.0 / 8;  // tail block: e = -3 exactly
  return v;
}

double roundedTo(DType dtype, double v) {
  switch (dtype) {
    case DType::kFloat32: return float(v);
    case DType::kBFloat16: return bf16ToFloat(floatToBf16(float(v)));  // v fits float exactly
    case DType::kFloat16: return halfToFloat(floatToHalf(float(v)));
    default: return v;
  }
}

class Mxfp8 : public ::testing::TestWithParam<DType> {};

TEST_P(Mxfp8, QuantizeAndDequantizeMatchReference) {
  SimCompute sc;
  const Tensor rowMajor = make(sc, {5, 70}, GetParam(), mxfp8Input());  // (5, 70)
  Tensor colMajor = sc.empty({70, 5}, GetParam());  // (70, 5): the same values transposed
  sc.copy(rowMajor.view().t(), colMajor);
  for (int axis : {1, 0}) {
    const ConstView x = axis == 1 ? ConstView(rowMajor) : ConstView(colMajor);
    const Shape scaleShape = axis == 1 ? Shape{x.dim(0), 3} : Shape{3, x.dim(1)};
    Tensor data = sc.empty(x.shape(), DType::kFloat8E4M3);
    Tensor scales = sc.empty(scaleShape, DType::kFloat8E8M0);
    sc.quantizeMxfp8(x, data, scales, axis);
    const MxExpected want = referenceMxfp8(x, axis);
    for (std::int64_t i = 0; i < scaleShape[0]; ++i)
      for (std::int64_t j = 0; j < scaleShape[1]; ++j)
        ASSERT_EQ(int(byteAt2(scales, i, j)), int(want.scales[std::size_t(i * scaleShape[1] + j)]))
            << "axis " << axis << " scale mismatch at (" << i << ", " << j << ")";
    for (std::int64_t r = 0; r < x.dim(0); ++r)
      for (std::int64_t c = 0; c < x.dim(1); ++c)
        ASSERT_EQ(int(byteAt2(data, r, c)), int(want.data[std::size_t(r * x.dim(1) + c)]))
            << "axis " << axis << " data mismatch at (" << r << ", " << c << ")";
    for (DType out : {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat64}) {
      Tensor y = sc.empty(x.shape(), out);
      sc.dequantizeMxfp8(data, scales, axis, y);
      for (std::int64_t r = 0; r < x.dim(0); ++r)
        for (std::int64_t c = 0; c < x.dim(1); ++c) {
          const std::int64_t bi = axis == 1 ? r : r / 32, bj = axis == 1 ? c / 32 : c;
          const double exact = e4m3ToFloat(byteAt2(data, r, c)) * std::ldexp(1.0, int(byteAt2(scales, bi, bj)) - 127);
          ASSERT_EQ(at2(y, r, c), roundedTo(out, exact))
              << "axis " << axis << " " << dtypeName(out) << " mismatch at (" << r << ", " << c << ")";
        }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, Mxfp8,
                         ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat64),
                         [](const auto& info) { return std::string(dtypeName(info.param)); });

TEST(SimCompute, Mxfp8ScaleRuleOnHandPickedBlocks) {
  SimCompute sc;
  // One row per block: amax 448 -> 2^0; 449 -> 2^1; 1 -> 2^-8 (1/2^-8 = 256 <= 448); 0 -> 2^-127;
  // 2^-140 and 2^-136 (below every scale) -> 2^-127 with the element rounded to E4M3 zero or a
  // subnormal.
  const std::vector<double> amax = {448, 449, 1, 0, std::ldexp(1.0, -140), std::ldexp(1.0, -136)};
  const int wantExp[] = {0, 1, -8, -127, -127, -127};
  // The block's first element x / scale: 448; 224.5 -> 224; 256; 0; 2^-13 -> 0; 2^-9, the smallest subnormal.
  const std::uint8_t wantFirst[] = {0x7e, 0x76, 0x78, 0x00, 0x00, 0x01};
  Tensor x = sc.empty({6, 3}, DType::kFloat64);
  for (int r = 0; r < 6; ++r) {
    set2(x, r, 0, amax[r]);
    set2(x, r, 1, -amax[r] / 4);
    set2(x, r, 2, 0.0);
  }
  Tensor data = sc.empty({6, 3}, DType::kFloat8E4M3);
  Tensor scales = sc.empty({6, 1}, DType::kFloat8E8M0);
  sc.quantizeMxfp8(x, data, scales, 1);
  for (int r = 0; r < 6; ++r) {
    EXPECT_EQ(int(byteAt2(scales, r, 0)), wantExp[r] + 127) << "row " << r;
    EXPECT_EQ(int(byteAt2(data, r, 0)), int(wantFirst[r])) << "row " << r;
    EXPECT_EQ(byteAt2(data, r, 2), 0) << "row " << r;
  }
}

TEST(SimCompute, Mxfp8NaNPoisonsItsBlockAndInfSaturates) {
  SimCompute sc;
  std::vector<double> v(2 * 40, 1.0);
  v[3] = kNaN;                                       // row 0, block 0
  v[40 + 35] = std::numeric_limits<double>::infinity();  // row 1, tail block
  Tensor x = make(sc, {2, 40}, DType::kFloat32, v);
  Tensor data = sc.empty({2, 40}, DType::kFloat8E4M3);
  Tensor scales = sc.empty({2, 2}, DType::kFloat8E8M0);
  sc.quantizeMxfp8(x, data, scales, 1);
  EXPECT_EQ(byteAt2(scales, 0, 0), 0xff);
  for (int c = 0; c < 32; ++c) ASSERT_EQ(byteAt2(data, 0, c), 0x7f) << "column " << c;
  EXPECT_EQ(byteAt2(scales, 0, 1), 127 - 8);       // the other block is untouched: amax 1 -> 2^-8
  EXPECT_EQ(byteAt2(data, 0, 35), 0x78);           // 1 / 2^-8 = 256
  EXPECT_EQ(byteAt2(scales, 1, 1), 254);           // inf: the top scale 2^127
  EXPECT_EQ(byteAt2(data, 1, 35), 0x7e);           // inf saturates to 448
  EXPECT_EQ(byteAt2(data, 1, 36), 0x00);           // 1 / 2^127 is far below E4M3's subnormals
  Tensor y = sc.empty({2, 40}, DType::kFloat32);
  sc.dequantizeMxfp8(data, scales, 1, y);
  for (int c = 0; c < 32; ++c) ASSERT_TRUE(std::isnan(at2(y, 0, c))) << "column " << c;
  EXPECT_EQ(at2(y, 0, 35), 1.0);
  EXPECT_EQ(at2(y, 1, 35), std::numeric_limits<double>::infinity());  // 448·2^127 overflows fp32
  EXPECT_EQ(at2(y, 1, 0), 1.0);
}

TEST(SimCompute, Mxfp8ColumnwiseOfATransposeIsRowwise) {
  SimCompute sc;
  const Tensor x = make(sc, {5, 70}, DType::kBFloat16, mxfp8Input());  // (5, 70)
  Tensor rowData = sc.empty({5, 70}, DType::kFloat8E4M3), rowScales = sc.empty({5, 3}, DType::kFloat8E8M0);
  sc.quantizeMxfp8(x, rowData, rowScales, 1);
  // Strided operands: x.t() (70, 5) read in place, data and scales written through transposes.
  Tensor colData = sc.empty({5, 70}, DType::kFloat8E4M3), colScales = sc.empty({5, 3}, DType::kFloat8E8M0);
  sc.quantizeMxfp8(x.view().t(), colData.view().t(), colScales.view().t(), 0);
  for (std::int64_t r = 0; r < 5; ++r) {
    for (std::int64_t c = 0; c < 70; ++c)
      ASSERT_EQ(byteAt2(colData, r, c), byteAt2(rowData, r, c)) << "mismatch at (" << r << ", " << c << ")";
    for (std::int64_t b = 0; b < 3; ++b)
      ASSERT_EQ(byteAt2(colScales, r, b), byteAt2(rowScales, r, b)) << "scale mismatch at (" << r << ", " << b << ")";
  }
}

TEST(SimCompute, Mxfp8RejectsBadArguments) {
  SimCompute sc;
  Tensor x = sc.zeros({4, 40}, DType::kFloat32);
  Tensor data = sc.empty({4, 40}, DType::kFloat8E4M3);
  Tensor rowScales = sc.empty({4, 2}, DType::kFloat8E8M0);
  expectInvalid([&] { sc.quantizeMxfp8(x, data, sc.empty({4, 1}, DType::kFloat8E8M0), 1); },
                "quantizeMxfp8: scales of rowwise (axis 1) blocks of a (4, 40) matrix must be (4, 2), got e8m0 (4, 1)");
  expectInvalid([&] { sc.quantizeMxfp8(x, data, rowScales, 0); },
                "scales of columnwise (axis 0) blocks of a (4, 40) matrix must be (1, 40), got e8m0 (4, 2)");
  expectInvalid([&] { sc.quantizeMxfp8(x, data, rowScales, 2); },
                "quantizeMxfp8: axis must be 0 (columnwise) or 1 (rowwise), got 2");
  expectInvalid([&] { sc.quantizeMxfp8(x, sc.empty({4, 40}, DType::kBFloat16), rowScales, 1); },
                "quantizeMxfp8: data must be fp8e4m3, got bf16 (4, 40)");
  expectInvalid([&] { sc.quantizeMxfp8(x, data, sc.empty({4, 2}, DType::kFloat8E4M3), 1); },
                "quantizeMxfp8: scales must be e8m0, got fp8e4m3 (4, 2)");
  expectInvalid([&] { sc.quantizeMxfp8(data, data, rowScales, 1); },
                "quantizeMxfp8: x must be fp32, bf16, fp16 or fp64, got fp8e4m3 (4, 40); fp8 is a storage type");
  expectInvalid([&] { sc.quantizeMxfp8(sc.zeros({160}, DType::kFloat32), data, rowScales, 1); },
                "quantizeMxfp8: x must be a matrix (R, C), got fp32 (160,)");
  expectInvalid([&] { sc.dequantizeMxfp8(data, rowScales, 1, sc.empty({4, 40}, DType::kInt64)); },
                "dequantizeMxfp8: y must be fp32, bf16, fp16 or fp64, got int64 (4, 40)");
  expectInvalid([&] { sc.dequantizeMxfp8(data, rowScales, 1, sc.empty({40, 4}, DType::kFloat32)); },
                "dequantizeMxfp8: y must have data's shape (4, 40), got fp32 (40, 4)");
  expectInvalid([&] { sc.gemm(data, sc.empty({40, 4}, DType::kFloat8E4M3), sc.empty({4, 4}, DType::kFloat32)); },
                "gemm: a must be fp32, bf16, fp16 or fp64, got fp8e4m3 (4, 40); fp8 is a storage type, "
                "dequantizeMxfp8 it first");
  expectInvalid([&] { sc.axpy(1.f, data, x); }, "axpy: x must be fp32, bf16, fp16 or fp64, got fp8e4m3");
}

TEST(SimCompute, CopyConvertsToAndFromFp8) {
  SimCompute sc;
  Tensor x = make(sc, {4}, DType::kFloat32, {0.3, -1000, 0.0, 2.0});
  Tensor q = sc.empty({4}, DType::kFloat8E4M3);
  sc.copy(x, q);
  EXPECT_EQ(getAt(q, 0), 0.3125);  // nearest even
  EXPECT_EQ(getAt(q, 1), -448.0);  // saturates
  Tensor back = sc.empty({4}, DType::kBFloat16);
  sc.copy(q, back);
  EXPECT_EQ(getAt(back, 3), 2.0);
  Tensor s = sc.empty({4}, DType::kFloat8E8M0);
  expectInvalid([&] { sc.copy(x, s); }, "e8m0: a value must be an exact power of two");
}

}  // namespace
}  // namespace tpsim::sim
