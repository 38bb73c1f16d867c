// Tests of the vectorized GeLU loops (sim/gelu.h): bit for bit the scalar formulas over libm, on a
// spread of float bit patterns through every branch of erff and expf, the branch bounds, lengths
// that leave a tail, and the values libm handles itself. (All 2^32 inputs agree too; too slow to
// run here.)
#include "sim/gelu.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace tpsim::sim {
namespace {

float fromBits(std::uint32_t bits) {
  float v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// Same bits, or both NaN: a NaN's sign and payload follow the compiler's operand order.
::testing::AssertionResult sameFloat(float got, float want, float x) {
  if (std::memcmp(&got, &want, sizeof got) == 0 || (std::isnan(got) && std::isnan(want)))
    return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "x = " << std::hexfloat << x << ": got " << got << ", want " << want;
}

std::vector<float> inputs() {
  std::vector<float> x;
  // Every 1021st bit pattern from 2^-40 to 2^10, both signs: erf's arguments through all its
  // branches, exp's past -88.
  for (std::uint32_t b = 0x2b800000; b < 0x44800000; b += 1021) {
    x.push_back(fromBits(b));
    x.push_back(fromBits(b | 0x80000000u));
  }
  // erf's branch bounds (|t| = 2^-28, 0.84375, 1.25, 1/0.35, 6), reached through t = x·(1/√2).
  for (std::uint32_t bound : {0x31800000u, 0x3f580000u, 0x3fa00000u, 0x4036db6eu, 0x40c00000u})
    for (std::uint32_t d = 0; d < 256; ++d) {
      const float t = fromBits(bound - 128 + d);
      x.push_back(t / kGeluSqrtHalf);
      x.push_back(-t / kGeluSqrtHalf);
    }
  const float inf = std::numeric_limits<float>::infinity();
  for (float v : {0.f, -0.f, 1e-45f, 13.31f, 13.32f, 14.5f, 1e30f, inf, -inf, std::nanf("")}) x.push_back(v);
  x.resize(x.size() / 16 * 16 + 7, 0.5f);  // a tail the 16 lanes leave to the scalar loop
  return x;
}

TEST(VectorGelu, MatchesTheScalarFormulaBitForBit) {
  if (!vectorGeluRuns()) GTEST_SKIP() << "no AVX-512, or this libm's erff/expf are not the ported ones";
  const std::vector<float> x = inputs();
  std::vector<float> y(x.size());
  vectorGelu(x.data(), y.data(), std::int64_t(x.size()));
  for (std::size_t i = 0; i < x.size(); ++i) ASSERT_TRUE(sameFloat(y[i], geluOf(x[i]), x[i])) << "index " << i;
}

TEST(VectorGelu, BackwardMatchesTheScalarFormulaBitForBit) {
  if (!vectorGeluRuns()) GTEST_SKIP() << "no AVX-512, or this libm's erff/expf are not the ported ones";
  const std::vector<float> x = inputs();
  std::vector<float> dy(x.size()), dx(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) dy[i] = 0.75f + float(i % 5) * 0.5f - (i % 3 == 0 ? 2.f : 0.f);
  vectorGeluBackward(x.data(), dy.data(), dx.data(), std::int64_t(x.size()));
  for (std::size_t i = 0; i < x.size(); ++i)
    ASSERT_TRUE(sameFloat(dx[i], geluBackwardOf(x[i], dy[i]), x[i])) << "index " << i;
}

// The probe turns the vector loops off when libm rounds one value of its inputs differently.
float geluOneUlpOff(float v) {
  const float y = geluOf(v);
  return v == 3.f ? std::nextafter(y, 0.f) : y;
}
float backwardOneUlpOff(float v, float dy) {
  const float dx = geluBackwardOf(v, dy);
  return v == -1e-30f ? std::nextafter(dx, 0.f) : dx;
}

TEST(VectorGelu, ProbeRejectsALibmThatRoundsOneValueDifferently) {
  if (!vectorGeluRuns()) GTEST_SKIP() << "no AVX-512, or this libm's erff/expf are not the ported ones";
  EXPECT_TRUE(vectorGeluMatches(geluOf, geluBackwardOf));
  EXPECT_FALSE(vectorGeluMatches(geluOneUlpOff, geluBackwardOf));
  EXPECT_FALSE(vectorGeluMatches(geluOf, backwardOneUlpOff));
}

}  // namespace
}  // namespace tpsim::sim
