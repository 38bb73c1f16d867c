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
#include <optional>
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
  x.resize(x.size() / 16 * 16 + 7, 0.5f);  // a tail either width leaves to the scalar loop
  return x;
}

// Each instruction set the core runs, whichever vectorGeluIsa() picks: an AVX-512 core checks
// the AVX2 loops too.
class VectorGelu : public ::testing::TestWithParam<GeluIsa> {
 protected:
  void SetUp() override {
    if (!geluIsaRuns(GetParam())) GTEST_SKIP() << "this core lacks " << geluIsaName(GetParam());
  }
};

TEST_P(VectorGelu, MatchesTheScalarFormulaBitForBit) {
  const std::vector<float> x = inputs();
  std::vector<float> y(x.size());
  vectorGelu(GetParam(), x.data(), y.data(), std::int64_t(x.size()));
  for (std::size_t i = 0; i < x.size(); ++i) ASSERT_TRUE(sameFloat(y[i], geluOf(x[i]), x[i])) << "index " << i;
}

TEST_P(VectorGelu, BackwardMatchesTheScalarFormulaBitForBit) {
  const std::vector<float> x = inputs();
  std::vector<float> dy(x.size()), dx(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) dy[i] = 0.75f + float(i % 5) * 0.5f - (i % 3 == 0 ? 2.f : 0.f);
  vectorGeluBackward(GetParam(), x.data(), dy.data(), dx.data(), std::int64_t(x.size()));
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

TEST_P(VectorGelu, ProbeRejectsALibmThatRoundsOneValueDifferently) {
  EXPECT_TRUE(vectorGeluMatches(GetParam(), geluOf, geluBackwardOf));
  EXPECT_FALSE(vectorGeluMatches(GetParam(), geluOneUlpOff, geluBackwardOf));
  EXPECT_FALSE(vectorGeluMatches(GetParam(), geluOf, backwardOneUlpOff));
}

INSTANTIATE_TEST_SUITE_P(Isa, VectorGelu, ::testing::Values(GeluIsa::kAvx512, GeluIsa::kAvx2),
                         [](const ::testing::TestParamInfo<GeluIsa>& info) { return geluIsaName(info.param); });

// SimCompute takes the widest set that runs and passes the probe; with AVX2 and FMA (every x86-64
// core these builds target in practice) one is taken, as this process's libm is glibc's.
TEST(VectorGeluIsa, PicksTheWidestInstructionSetThatRuns) {
  const std::optional<GeluIsa> isa = vectorGeluIsa();
  if (geluIsaRuns(GeluIsa::kAvx512)) {
    ASSERT_TRUE(isa.has_value());
    EXPECT_EQ(*isa, GeluIsa::kAvx512);
  } else if (geluIsaRuns(GeluIsa::kAvx2)) {
    ASSERT_TRUE(isa.has_value());
    EXPECT_EQ(*isa, GeluIsa::kAvx2);
  } else {
    EXPECT_FALSE(isa.has_value());
  }
}

}  // namespace
}  // namespace tpsim::sim
