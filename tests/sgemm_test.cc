// Tests of fp32 gemm's kernels (sim/sgemm.h) through SimCompute, each kernel this core runs, of
// their fp64 twins (sim/dgemm.h) directly, and of the bounds' bf16 product (sim/upper_gemm_bf16.h)
// against a scalar model of its arithmetic, bit for bit.
//
// Every result is checked against a double-precision product of the stored values, within
// (K + 2)·2^-24 of the sum of the magnitudes it adds: shapes around the micro-kernels' and the
// blocks' sizes, each operand stored either way, alpha and beta, NaN in c with beta 0.
#include "sim/sgemm.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "sim/dgemm.h"
#include "sim/sim_compute.h"
#include "sim/upper_gemm_bf16.h"

namespace tpsim::sim {
namespace {

std::vector<GemmKernel> runnableKernels() {
  std::vector<GemmKernel> kernels;
  for (GemmKernel kernel : {GemmKernel::kAvx512, GemmKernel::kAvx2, GemmKernel::kEigen})
    if (gemmKernelRuns(kernel)) kernels.push_back(kernel);
  return kernels;
}

struct Case {
  std::int64_t m, k, n;
  bool aTransposed, bTransposed, cTransposed;  // stored as the transpose, read through .t()
  float alpha, beta;
};

std::string describe(const Case& g, GemmKernel kernel) {
  return std::string(gemmKernelName(kernel)) + " m=" + std::to_string(g.m) + " k=" + std::to_string(g.k) +
         " n=" + std::to_string(g.n) + (g.aTransposed ? " a^T" : "") + (g.bTransposed ? " b^T" : "") +
         (g.cTransposed ? " c^T" : "") + " alpha=" + std::to_string(g.alpha) + " beta=" + std::to_string(g.beta);
}

// A (rows, cols) matrix of normal values; `at(i, j)` reads it whichever way it is stored.
struct Matrix {
  std::int64_t rows, cols;
  bool transposed;
  std::vector<float> data;  // (rows, cols), or (cols, rows) when transposed

  float& at(std::int64_t i, std::int64_t j) { return transposed ? data[j * rows + i] : data[i * cols + j]; }
  View view() {
    return transposed ? View(data.data(), Shape{cols, rows}, DType::kFloat32).t()
                      : View(data.data(), Shape{rows, cols}, DType::kFloat32);
  }
};

Matrix randomMatrix(std::int64_t rows, std::int64_t cols, bool transposed, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  Matrix x{rows, cols, transposed, std::vector<float>(std::size_t(rows * cols))};
  for (float& v : x.data) v = normal(rng);
  return x;
}

// Runs the case on `kernel` and checks every element of every rowStep-th row; returns c as stored.
std::vector<float> checkCase(const Case& g, GemmKernel kernel, std::mt19937& rng, std::int64_t rowStep = 1) {
  Matrix a = randomMatrix(g.m, g.k, g.aTransposed, rng);  // (M, K)
  Matrix b = randomMatrix(g.k, g.n, g.bTransposed, rng);  // (K, N)
  Matrix c = randomMatrix(g.m, g.n, g.cTransposed, rng);  // (M, N)
  if (g.beta == 0.f)
    for (float& v : c.data) v = std::numeric_limits<float>::quiet_NaN();  // must not leak
  Matrix before = c;
  SimCompute(nullptr, kernel).gemm(a.view(), b.view(), c.view(), g.alpha, g.beta);
  int wrong = 0;
  for (std::int64_t i = 0; i < g.m && wrong < 5; i += rowStep)
    for (std::int64_t j = 0; j < g.n && wrong < 5; ++j) {
      double sum = 0, magnitude = 0;
      for (std::int64_t p = 0; p < g.k; ++p) {
        const double product = double(a.at(i, p)) * b.at(p, j);
        sum += product;
        magnitude += std::fabs(product);
      }
      const double old = g.beta == 0.f ? 0.0 : double(before.at(i, j));
      const double want = double(g.alpha) * sum + double(g.beta) * old;
      const double bound = (double(g.k) + 2) * 0x1p-24 * (std::fabs(g.alpha) * magnitude + std::fabs(g.beta * old));
      const double got = c.at(i, j);
      if (!(std::fabs(got - want) <= bound)) {
        ++wrong;
        ADD_FAILURE() << describe(g, kernel) << ": c(" << i << ", " << j << ") = " << got << ", want " << want
                      << " within " << bound;
      }
    }
  return c.data;
}

// Sizes below, at and past the micro-kernels' MR (6, 14) and NR (16, 32), the blocks (252 rows,
// 256 columns, 256 of K), and 1.
TEST(Sgemm, EveryKernelMatchesADoubleProductOnEveryLayout) {
  struct Shape3 {
    std::int64_t m, k, n;
  };
  std::mt19937 rng(5);
  for (GemmKernel kernel : runnableKernels())
    for (const Shape3& s : {Shape3{1, 1, 1}, Shape3{1, 7, 1}, Shape3{13, 1, 17}, Shape3{1, 300, 40},
                            Shape3{40, 300, 1}, Shape3{6, 16, 16}, Shape3{14, 256, 32}, Shape3{15, 33, 31},
                            Shape3{29, 257, 65}, Shape3{253, 100, 37}, Shape3{37, 70, 257}, Shape3{260, 520, 270}})
      for (int layout = 0; layout < 8; ++layout)
        for (float alpha : {1.f, -1.5f})
          for (float beta : {0.f, 1.f, 0.5f})
            checkCase({s.m, s.k, s.n, bool(layout & 1), bool(layout & 2), bool(layout & 4), alpha, beta}, kernel,
                      rng);
}

// K long enough (2^23 / K between 252 and 504) that the packed operands are cut into chunks of 252
// rows and 256 columns, close to the least K that does, so that sanitizer builds stay quick; every 7th row
// includes row 252, the second chunk's first. Only the packed kernels chunk.
TEST(Sgemm, ChunkedProductsMatchADoubleProduct) {
  std::mt19937 rng(6);
  for (GemmKernel kernel : runnableKernels()) {
    if (kernel == GemmKernel::kEigen) continue;
    checkCase({253, 16700, 257, false, true, false, 1.f, 0.5f}, kernel, rng, 7);
    checkCase({253, 16700, 257, true, false, true, -1.5f, 0.f}, kernel, rng, 7);
  }
}

// Both packed kernels add every element's products in the same order, so they agree bit for bit.
TEST(Sgemm, PackedKernelsGiveTheSameBits) {
  if (!gemmKernelRuns(GemmKernel::kAvx512) || !gemmKernelRuns(GemmKernel::kAvx2))
    GTEST_SKIP() << "this core does not run both packed kernels";
  for (const Case& g : {Case{29, 257, 65, false, true, false, 1.f, 0.f}, Case{260, 520, 270, true, false, true, -1.5f, 0.5f}}) {
    std::mt19937 rng512(7), rng256(7);
    EXPECT_EQ(checkCase(g, GemmKernel::kAvx512, rng512), checkCase(g, GemmKernel::kAvx2, rng256))
        << describe(g, GemmKernel::kAvx512);
  }
}

TEST(Sgemm, BestKernelRunsHere) {
  EXPECT_TRUE(gemmKernelRuns(bestGemmKernel()));
  EXPECT_EQ(SimCompute().fp32Kernel(), bestGemmKernel());
}

// dgemm on `kernel`: c = alpha·a·b + beta·c for a case, every element against a long double
// product within (K + 2)·2^-53 of the sum of the magnitudes it adds; returns c as stored.
std::vector<double> checkDgemmCase(const Case& g, GemmKernel kernel, std::mt19937& rng) {
  std::normal_distribution<double> normal;
  auto random = [&](std::int64_t n) {
    std::vector<double> v(static_cast<std::size_t>(n));
    for (double& x : v) x = normal(rng);
    return v;
  };
  // Element (i, j) of a (rows, cols) matrix stored as itself or as its transpose.
  auto at = [](const std::vector<double>& v, std::int64_t rows, std::int64_t cols, bool transposed, std::int64_t i,
               std::int64_t j) { return transposed ? v[std::size_t(j * rows + i)] : v[std::size_t(i * cols + j)]; };
  auto strides = [](std::int64_t rows, std::int64_t cols, bool transposed) {
    return transposed ? std::pair<std::int64_t, std::int64_t>{1, rows} : std::pair<std::int64_t, std::int64_t>{cols, 1};
  };
  const std::vector<double> a = random(g.m * g.k), b = random(g.k * g.n);
  std::vector<double> c = random(g.m * g.n);
  if (g.beta == 0.f)
    for (double& v : c) v = std::numeric_limits<double>::quiet_NaN();  // must not leak
  const std::vector<double> before = c;
  const auto [ars, acs] = strides(g.m, g.k, g.aTransposed);
  const auto [brs, bcs] = strides(g.k, g.n, g.bTransposed);
  const auto [crs, ccs] = strides(g.m, g.n, g.cTransposed);
  dgemm(kernel, g.m, g.n, g.k, g.alpha, {a.data(), ars, acs}, {b.data(), brs, bcs}, g.beta, c.data(), crs, ccs,
        nullptr);
  int wrong = 0;
  for (std::int64_t i = 0; i < g.m && wrong < 5; ++i)
    for (std::int64_t j = 0; j < g.n && wrong < 5; ++j) {
      long double sum = 0, magnitude = 0;
      for (std::int64_t p = 0; p < g.k; ++p) {
        const long double product =
            (long double)at(a, g.m, g.k, g.aTransposed, i, p) * at(b, g.k, g.n, g.bTransposed, p, j);
        sum += product;
        magnitude += std::fabs(product);
      }
      const long double old = g.beta == 0.f ? 0.0L : (long double)at(before, g.m, g.n, g.cTransposed, i, j);
      const long double want = (long double)g.alpha * sum + (long double)g.beta * old;
      const long double bound =
          (g.k + 2) * 0x1p-53L * (std::fabs((long double)g.alpha) * magnitude + std::fabs((long double)g.beta * old));
      const double got = at(c, g.m, g.n, g.cTransposed, i, j);
      if (!(std::fabs(got - want) <= bound)) {
        ++wrong;
        ADD_FAILURE() << "dgemm " << describe(g, kernel) << ": c(" << i << ", " << j << ") = " << got << ", want "
                      << double(want) << " within " << double(bound);
      }
    }
  return c;
}

std::vector<GemmKernel> packedKernels() {
  std::vector<GemmKernel> kernels;
  for (GemmKernel kernel : runnableKernels())
    if (kernel != GemmKernel::kEigen) kernels.push_back(kernel);
  return kernels;
}

TEST(Dgemm, EveryKernelMatchesALongDoubleProductOnEveryLayout) {
  struct Shape3 {
    std::int64_t m, k, n;
  };
  std::mt19937 rng(8);
  if (packedKernels().empty()) GTEST_SKIP() << "this core runs neither packed kernel (AVX-512 or AVX2 with FMA)";
  for (GemmKernel kernel : packedKernels())
    for (const Shape3& s : {Shape3{1, 1, 1}, Shape3{13, 1, 9}, Shape3{6, 8, 8}, Shape3{14, 256, 16},
                            Shape3{15, 33, 17}, Shape3{29, 257, 65}, Shape3{253, 100, 37}, Shape3{37, 70, 257},
                            Shape3{0, 5, 3}, Shape3{4, 0, 3}})
      for (int layout = 0; layout < 8; ++layout)
        for (float alpha : {1.f, -1.5f})
          for (float beta : {0.f, 1.f, 0.5f})
            checkDgemmCase({s.m, s.k, s.n, bool(layout & 1), bool(layout & 2), bool(layout & 4), alpha, beta}, kernel,
                           rng);
}

TEST(Dgemm, PackedKernelsGiveTheSameBits) {
  if (!gemmKernelRuns(GemmKernel::kAvx512) || !gemmKernelRuns(GemmKernel::kAvx2))
    GTEST_SKIP() << "this core does not run both packed kernels";
  const Case g{260, 520, 270, true, false, true, -1.5f, 0.5f};
  std::mt19937 rng512(9), rng256(9);
  EXPECT_EQ(checkDgemmCase(g, GemmKernel::kAvx512, rng512), checkDgemmCase(g, GemmKernel::kAvx2, rng256))
      << describe(g, GemmKernel::kAvx512);
}

// x rounded up to 8 significant bits, a positive value below 2^-126 up to 2^-126: upperGemmBf16's
// operands, by way of frexp rather than bit patterns.
float bf16Up(float x) {
  if (x == 0) return 0;
  int e;
  const double m = std::frexp(double(x), &e);  // x = m·2^e, m in [1/2, 1)
  return std::max(float(std::ldexp(std::ceil(std::ldexp(m, 8)), e - 8)), 0x1p-126f);
}

// upperGemmBf16's sums as sim/upper_gemm_bf16.h states them: per K block of 256, pairs of K steps odd first,
// each one fmaf with a result below 2^-126 flushed to 0; then the blocks added in order.
float upperModel(const std::vector<float>& a, const std::vector<float>& b, std::int64_t k) {
  float c = 0;
  for (std::int64_t pc = 0; pc < k; pc += 256) {
    const std::int64_t kc = std::min<std::int64_t>(256, k - pc);
    float acc = 0;
    auto step = [&](std::int64_t p) {
      acc = std::fma(bf16Up(a[std::size_t(pc + p)]), bf16Up(b[std::size_t(pc + p)]), acc);
      if (acc < 0x1p-126f) acc = 0;
    };
    for (std::int64_t p = 0; p < kc; p += 2) {
      if (p + 1 < kc) step(p + 1);
      step(p);
    }
    c = pc == 0 ? acc : c + acc;
  }
  return c;
}

// Nonnegative values that exercise the rounding: |normal|, values bf16 holds exactly, values that
// round up across a power of two, values below 2^-126 (bumped) and far below (products flushed),
// zeros.
float upperOperand(std::mt19937& rng) {
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> kind(0, 9);
  switch (kind(rng)) {
    case 0: return 0.f;
    case 1: return bf16Up(std::fabs(normal(rng)));
    case 2: return std::nextafter(2.f, 0.f);
    case 3: return std::fabs(normal(rng)) * 0x1p-128f;
    case 4: return std::fabs(normal(rng)) * 0x1p-70f;
    default: return std::fabs(normal(rng));
  }
}

TEST(UpperGemmBf16, MatchesItsArithmeticBitForBit) {
  if (!upperGemmBf16Runs()) GTEST_SKIP() << "this core lacks AVX512-BF16";
  struct Shape3 {
    std::int64_t m, k, n;
  };
  std::mt19937 rng(10);
  HostPool pool(1);
  // Sizes below, at and past the kernel's 14 x 32 tile, the blocks (252 rows, 256 columns, 256 of
  // K), odd K (a last step of one value), and empty products.
  for (const Shape3& s : {Shape3{1, 1, 1}, Shape3{13, 1, 9}, Shape3{14, 2, 32}, Shape3{15, 3, 33},
                          Shape3{29, 257, 65}, Shape3{253, 513, 37}, Shape3{37, 70, 257}, Shape3{0, 5, 3},
                          Shape3{4, 0, 3}})
    // a: row-major, column-major, or every other value of a wider matrix (neither stride 1); b:
    // row-major or column-major.
    for (int aLayout = 0; aLayout < 3; ++aLayout)
      for (bool bTransposed : {false, true}) {
        std::vector<float> a(std::size_t(2 * s.m * s.k)), b(std::size_t(s.k * s.n));
        for (float& x : a) x = upperOperand(rng);
        for (float& x : b) x = upperOperand(rng);
        const FloatMatrix av = aLayout == 0   ? FloatMatrix{a.data(), s.k, 1}
                               : aLayout == 1 ? FloatMatrix{a.data(), 1, s.m}
                                              : FloatMatrix{a.data(), 2 * s.k, 2};
        const FloatMatrix bv = bTransposed ? FloatMatrix{b.data(), 1, s.k} : FloatMatrix{b.data(), s.n, 1};
        std::vector<float> c(std::size_t(s.m * s.n), std::numeric_limits<float>::quiet_NaN());
        upperGemmBf16(s.m, s.n, s.k, av, bv, c.data(), s.n, s.m * s.n > 4096 ? &pool : nullptr);
        int wrong = 0;
        for (std::int64_t i = 0; i < s.m && wrong < 5; ++i)
          for (std::int64_t j = 0; j < s.n && wrong < 5; ++j) {
            std::vector<float> row(std::size_t(s.k)), column(std::size_t(s.k));
            for (std::int64_t p = 0; p < s.k; ++p) {
              row[std::size_t(p)] = av.data[i * av.rowStride + p * av.colStride];
              column[std::size_t(p)] = bv.data[p * bv.rowStride + j * bv.colStride];
            }
            const float want = upperModel(row, column, s.k), got = c[std::size_t(i * s.n + j)];
            if (std::memcmp(&want, &got, sizeof want) != 0) {
              ++wrong;
              ADD_FAILURE() << "m=" << s.m << " k=" << s.k << " n=" << s.n << " a layout " << aLayout
                            << (bTransposed ? " b^T" : "") << ": c(" << i << ", " << j << ") = " << got << ", want "
                            << want;
            }
          }
      }
}

// Rounding up to bf16 keeps NaN and Inf, takes FLT_MAX to Inf, and a product with NaN stays NaN.
TEST(UpperGemmBf16, KeepsInfinityAndNan) {
  if (!upperGemmBf16Runs()) GTEST_SKIP() << "this core lacks AVX512-BF16";
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> a = {inf, std::numeric_limits<float>::max(), nan, 1.f}, b = {1.f, 1.f};  // (4, 1)·(1, 2)
  std::vector<float> c(8);
  upperGemmBf16(4, 2, 1, {a.data(), 1, 1}, {b.data(), 2, 1}, c.data(), 2, nullptr);
  EXPECT_EQ(c[0], inf);
  EXPECT_EQ(c[2], inf);
  EXPECT_TRUE(std::isnan(c[4]));
  EXPECT_EQ(c[6], 1.f);
}

}  // namespace
}  // namespace tpsim::sim
