// The dense reference's magnitudes: computed in float, they must never fall below the same
// products computed in double (the bound they replace), whatever the magnitudes, and stay close.
#include "tools/reference.h"

#include <gtest/gtest.h>

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

namespace tpsim::tools {
namespace {

using Matrix = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// rows·cols nonnegative values 10^e with e uniform in [lo, hi], a fifth of them zero.
std::vector<double> magnitudes(std::int64_t n, double lo, double hi, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> exponent(lo, hi), unit(0, 1);
  std::vector<double> v(static_cast<std::size_t>(n));
  for (double& x : v) x = unit(rng) < 0.2 ? 0.0 : std::pow(10.0, exponent(rng));
  return v;
}

struct Range {
  double lo, hi;
};

TEST(Reference, MagnitudeProductIsAnUpperBoundOfTheDoubleProduct) {
  std::mt19937_64 rng(7);
  // Normal, tiny (below float's range), huge (beyond it), and spread over 70 decades in one matrix.
  const std::vector<Range> ranges = {{-1, 1}, {-45, -38}, {-200, -150}, {30, 40}, {140, 150}, {-40, 30}};
  for (const Range& ra : ranges)
    for (const Range& rb : ranges)
      for (std::int64_t k : {1, 7, 300, 5000}) {
        const std::int64_t m = 9, n = 600;  // n spans two column tiles
        const std::vector<double> a = magnitudes(m * k, ra.lo, ra.hi, rng), b = magnitudes(k * n, rb.lo, rb.hi, rng);
        const Matrix exact = Eigen::Map<const Matrix>(a.data(), m, k) * Eigen::Map<const Matrix>(b.data(), k, n);
        const std::vector<double> got = magnitudeProduct(a, b, m, k, n);
        const double slack = 1 + (2.2 * double(k) + 10) * 0x1p-24;  // rounded-up operands, F, the float sums
        // Above it by gradual underflow at most: float's subnormals, scaled by the largest a and b.
        const double aMax = *std::max_element(a.begin(), a.end()), bMax = *std::max_element(b.begin(), b.end());
        const double underflow = 16 * double(k + 2) * 0x1p-149 * aMax * bMax + 0x1p-1000;
        for (std::int64_t i = 0; i < m * n; ++i) {
          const double want = exact.data()[i], upper = got[std::size_t(i)];
          ASSERT_GE(upper, want) << "a 10^[" << ra.lo << ", " << ra.hi << "] b 10^[" << rb.lo << ", " << rb.hi
                                 << "] K=" << k << ": element " << i;
          ASSERT_LE(upper, want * slack + underflow)
              << "K=" << k << ": element " << i;
        }
      }
}

TEST(Reference, MagnitudeProductKeepsInfinityAndNan) {
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<double> a = {inf, 1, 0, 2}, b = {1, 0, 3, 4};  // (2, 2) · (2, 2)
  const std::vector<double> got = magnitudeProduct(a, b, 2, 2, 2);
  EXPECT_EQ(got[0], inf);
  EXPECT_TRUE(std::isnan(got[1]));  // ∞·0, as in double
  EXPECT_GE(got[2], 6.0);
  EXPECT_GE(got[3], 8.0);
}

}  // namespace
}  // namespace tpsim::tools
