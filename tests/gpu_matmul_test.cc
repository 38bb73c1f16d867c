// Host checks of gpu/matmul.h's mapGemm, without a GPU: c = a·b on strided views is mapped onto
// cuBLASLt's column-major operands, the mapped problem is evaluated here exactly as cuBLASLt
// defines it (element (i, j) of a column-major matrix at data[i + j·ld], op = transpose when
// trans), and the result must be the product of the views, with nothing written outside c.
#include "gpu/matmul.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

namespace tpsim::gpu {
namespace {

// A (rows, cols) fp64 matrix view over its own buffer; `kind` picks the strides.
struct Matrix {
  std::vector<double> buffer;
  View view;
  std::string kind;
};

// Row-major, column-major, both with padded leading dimensions, and both with the stride of every
// extent-1 mode set to 0 (such a mode is never stepped, so any stride is valid there).
const char* const kKinds[] = {"row-major", "column-major", "row-major ld+3", "column-major ld+2",
                              "row-major, unit modes stride 0", "column-major, unit modes stride 0"};

Matrix makeMatrix(std::int64_t rows, std::int64_t cols, int kind, double base) {
  std::int64_t s0 = cols, s1 = 1;
  switch (kind) {
    case 1: s0 = 1, s1 = rows; break;
    case 2: s0 = cols + 3; break;
    case 3: s0 = 1, s1 = rows + 2; break;
    case 4: s0 = rows == 1 ? 0 : cols, s1 = cols == 1 ? 0 : 1; break;
    case 5: s0 = rows == 1 ? 0 : 1, s1 = cols == 1 ? 0 : rows; break;
    default: break;
  }
  Matrix m;
  m.kind = kKinds[kind];
  m.buffer.assign(std::size_t(rows * cols * 6 + 8), -999.0);  // sentinels outside the view
  m.view = View(m.buffer.data(), Shape{rows, cols}, Strides{s0, s1}, DType::kFloat64);
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < cols; ++j) m.buffer[std::size_t(i * s0 + j * s1)] = base + double(i * 7 + j * 3 % 5);
  return m;
}

// op(m)(i, j) as cuBLASLt reads it.
double opAt(const LtMatrix& m, std::int64_t i, std::int64_t j) {
  const std::int64_t r = m.trans ? j : i, c = m.trans ? i : j;
  EXPECT_TRUE(r < m.rows && c < m.cols && r < m.ld) << "read outside the matrix";
  return static_cast<const double*>(m.data)[r + c * m.ld];
}

void evaluate(const LtGemm& g) {
  EXPECT_EQ(g.a.trans ? g.a.rows : g.a.cols, g.k);
  EXPECT_EQ(g.a.trans ? g.a.cols : g.a.rows, g.m);
  EXPECT_EQ(g.b.trans ? g.b.cols : g.b.rows, g.k);
  EXPECT_EQ(g.b.trans ? g.b.rows : g.b.cols, g.n);
  EXPECT_GE(g.ldc, g.m);
  for (std::int64_t i = 0; i < g.m; ++i)
    for (std::int64_t j = 0; j < g.n; ++j) {
      double sum = 0;
      for (std::int64_t p = 0; p < g.k; ++p) sum += opAt(g.a, i, p) * opAt(g.b, p, j);
      static_cast<double*>(g.c)[i + j * g.ldc] = sum;
    }
}

TEST(GpuMatmul, MapGemmComputesTheProductForEveryLayout) {
  const std::int64_t shapes[][3] = {{3, 4, 5}, {1, 4, 5}, {3, 1, 5}, {3, 4, 1}, {1, 1, 1}, {2, 7, 1}, {1, 6, 3}};
  int cases = 0;
  for (const auto& s : shapes) {
    const std::int64_t m = s[0], k = s[1], n = s[2];
    for (int ka = 0; ka < 6; ++ka)
      for (int kb = 0; kb < 6; ++kb)
        for (int kc = 0; kc < 6; ++kc) {
          const Matrix a = makeMatrix(m, k, ka, 1.0), b = makeMatrix(k, n, kb, -2.0);
          Matrix c = makeMatrix(m, n, kc, 0.0);
          const std::vector<double> before = c.buffer;
          SCOPED_TRACE("M=" + std::to_string(m) + " K=" + std::to_string(k) + " N=" + std::to_string(n) + ", a " +
                       a.kind + ", b " + b.kind + ", c " + c.kind);
          ASSERT_TRUE(hasLtLayout(a.view) && hasLtLayout(b.view) && hasLtLayout(c.view));
          evaluate(mapGemm(a.view, b.view, c.view));
          std::vector<double> want = before;  // c's buffer with the product written into the view
          for (std::int64_t i = 0; i < m; ++i)
            for (std::int64_t j = 0; j < n; ++j) {
              double sum = 0;
              for (std::int64_t p = 0; p < k; ++p)
                sum += a.buffer[std::size_t(i * a.view.stride(0) + p * a.view.stride(1))] *
                       b.buffer[std::size_t(p * b.view.stride(0) + j * b.view.stride(1))];
              want[std::size_t(i * c.view.stride(0) + j * c.view.stride(1))] = sum;
            }
          ASSERT_EQ(c.buffer, want);
          ++cases;
        }
  }
  EXPECT_EQ(cases, 7 * 216);
}

// cuBLASLt needs a unit-stride mode and a leading dimension of at least the other extent.
TEST(GpuMatmul, HasLtLayoutRejectsWhatCuBlasLtCannotRead) {
  std::vector<double> buf(64);
  auto view = [&](Shape shape, Strides strides) { return ConstView(buf.data(), shape, strides, DType::kFloat64); };
  EXPECT_TRUE(hasLtLayout(view({3, 4}, {4, 1})));
  EXPECT_TRUE(hasLtLayout(view({3, 4}, {1, 3})));
  EXPECT_TRUE(hasLtLayout(view({3, 4}, {9, 1})));
  EXPECT_FALSE(hasLtLayout(view({3, 4}, {8, 2})));  // no unit-stride mode
  EXPECT_FALSE(hasLtLayout(view({3, 4}, {2, 1})));  // rows overlap: ld 2 < 4
  EXPECT_FALSE(hasLtLayout(view({3, 4}, {1, 1})));
  EXPECT_FALSE(hasLtLayout(view({3, 4}, {1, 2})));  // columns overlap: ld 2 < 3
  EXPECT_TRUE(hasLtLayout(view({1, 4}, {0, 1})));
  EXPECT_TRUE(hasLtLayout(view({3, 1}, {1, 0})));
  EXPECT_TRUE(hasLtLayout(view({1, 1}, {5, 7})));
  EXPECT_FALSE(hasLtLayout(view({12}, {1})));  // not a matrix
}

}  // namespace
}  // namespace tpsim::gpu
