// Unit tests of backends/dtype.h conversions and of Shape (dims.h) and View (view.h).
//
// Conversions are checked on hand-picked bit patterns (ties, subnormals, overflow, inf, NaN),
// exhaustively over all 16-bit and 8-bit patterns, and on random values against a reference
// rounding written here from the IEEE definition (nearest of the two neighbours, ties to even
// mantissa; fp8 by brute force over its 127 magnitudes).
#include "backends/dtype.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>

#include "backends/dims.h"
#include "backends/errors.h"
#include "backends/view.h"

namespace tpsim {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

float fromBits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
std::uint32_t bitsOf(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

bool isBf16NaN(std::uint16_t b) { return (b & 0x7F80) == 0x7F80 && (b & 0x007F) != 0; }
bool isHalfNaN(std::uint16_t h) { return (h & 0x7C00) == 0x7C00 && (h & 0x03FF) != 0; }

// Value of a finite or infinite fp16 pattern from its fields (independent of halfToFloat).
double halfValue(std::uint16_t h) {
  const int exp = (h >> 10) & 0x1f;
  const int mant = h & 0x3ff;
  const double sign = (h & 0x8000) ? -1.0 : 1.0;
  if (exp == 0x1f) return sign * std::numeric_limits<double>::infinity();
  if (exp == 0) return sign * std::ldexp(mant, -24);
  return sign * std::ldexp(1024 + mant, exp - 25);
}

// Magnitude of a non-negative 16-bit pattern; the infinity pattern stands for the value one ulp
// past the largest finite one, which is where IEEE puts the overflow threshold's other neighbour.
double bf16Magnitude(std::uint16_t b) { return b == 0x7F80 ? std::ldexp(1.0, 128) : double(bf16ToFloat(b)); }
double halfMagnitude(std::uint16_t h) { return h == 0x7C00 ? 65536.0 : halfValue(h); }

// Round-to-nearest-even of a finite float to the 16-bit pattern, by choosing between the two
// neighbouring magnitudes [lo, lo + 1] with `magnitude`; `maxFinite` is the largest finite pattern.
template <typename Magnitude>
std::uint16_t referenceRound(float f, std::uint16_t maxFinite, Magnitude magnitude) {
  const double a = std::fabs(double(f));
  const std::uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  std::uint16_t lo = 0, hi = std::uint16_t(maxFinite + 1);  // magnitude(lo) <= a < magnitude(hi)
  if (a >= magnitude(hi)) return sign | hi;
  while (hi - lo > 1) {
    const std::uint16_t mid = std::uint16_t((lo + hi) / 2);
    (magnitude(mid) <= a ? lo : hi) = mid;
  }
  const double dLo = a - magnitude(lo), dHi = magnitude(hi) - a;
  if (dLo < dHi || (dLo == dHi && (lo & 1) == 0)) return sign | lo;
  return sign | hi;
}

// ---- bf16 ---------------------------------------------------------------------------------------

TEST(Bf16, ExactValues) {
  EXPECT_EQ(floatToBf16(1.0f), 0x3F80);
  EXPECT_EQ(floatToBf16(-2.0f), 0xC000);
  EXPECT_EQ(floatToBf16(0.0f), 0x0000);
  EXPECT_EQ(floatToBf16(-0.0f), 0x8000);
  EXPECT_EQ(bf16ToFloat(0x3F80), 1.0f);
  EXPECT_EQ(bf16ToFloat(0x4049), 3.140625f);
  EXPECT_EQ(bf16ToFloat(0x7F7F), fromBits(0x7F7F0000));  // largest finite, 3.3895314e38
}

TEST(Bf16, RoundsToNearestEven) {
  EXPECT_EQ(floatToBf16(fromBits(0x3F808000)), 0x3F80);  // 1 + 2^-8: tie, lsb 0 stays
  EXPECT_EQ(floatToBf16(fromBits(0x3F818000)), 0x3F82);  // 1 + 3·2^-8: tie, lsb 1 rounds up
  EXPECT_EQ(floatToBf16(fromBits(0x3F808001)), 0x3F81);  // just above the tie
  EXPECT_EQ(floatToBf16(fromBits(0x3F807FFF)), 0x3F80);  // just below the tie
  EXPECT_EQ(floatToBf16(fromBits(0xBF818000)), 0xBF82);  // negative tie
  EXPECT_EQ(floatToBf16(fromBits(0x3FFF8000)), 0x4000);  // carry into the exponent
}

TEST(Bf16, Subnormals) {
  EXPECT_EQ(bf16ToFloat(0x0001), std::ldexp(1.0f, -133));  // smallest subnormal
  EXPECT_EQ(bf16ToFloat(0x807F), -std::ldexp(127.0f, -133));
  EXPECT_EQ(floatToBf16(std::ldexp(1.0f, -133)), 0x0001);
  EXPECT_EQ(floatToBf16(fromBits(0x00008000)), 0x0000);  // 2^-134: tie to even (zero)
  EXPECT_EQ(floatToBf16(fromBits(0x00018000)), 0x0002);  // 3·2^-134: tie to even (2)
  EXPECT_EQ(floatToBf16(fromBits(0x007F8000)), 0x0080);  // rounds up into the smallest normal
}

TEST(Bf16, InfNaNAndOverflow) {
  EXPECT_EQ(floatToBf16(kInf), 0x7F80);
  EXPECT_EQ(floatToBf16(-kInf), 0xFF80);
  EXPECT_EQ(bf16ToFloat(0x7F80), kInf);
  EXPECT_EQ(bf16ToFloat(0xFF80), -kInf);
  EXPECT_EQ(floatToBf16(std::numeric_limits<float>::max()), 0x7F80);  // beyond max + half ulp
  EXPECT_EQ(floatToBf16(-std::numeric_limits<float>::max()), 0xFF80);
  EXPECT_EQ(floatToBf16(fromBits(0x7F7F7FFF)), 0x7F7F);  // just below the overflow tie
  EXPECT_EQ(floatToBf16(fromBits(0x7F7F8000)), 0x7F80);  // the tie: odd max rounds up to inf
  EXPECT_TRUE(isBf16NaN(floatToBf16(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(isBf16NaN(floatToBf16(fromBits(0x7F800001))));      // low payload must not become inf
  EXPECT_EQ(floatToBf16(fromBits(0xFF800001)) & 0x8000, 0x8000);  // sign kept
  EXPECT_TRUE(std::isnan(bf16ToFloat(0x7FC0)));
}

TEST(Bf16, EveryPatternRoundTrips) {
  for (std::uint32_t b = 0; b <= 0xFFFF; ++b) {
    const std::uint16_t bits = std::uint16_t(b);
    const float f = bf16ToFloat(bits);
    if (isBf16NaN(bits)) {
      ASSERT_TRUE(std::isnan(f)) << "mismatch at index " << b;
      ASSERT_TRUE(isBf16NaN(floatToBf16(f))) << "mismatch at index " << b;
    } else {
      ASSERT_EQ(floatToBf16(f), bits) << "mismatch at index " << b;
    }
  }
}

TEST(Bf16, RandomFloatsMatchReference) {
  std::mt19937 rng(42);
  for (int i = 0; i < 300000; ++i) {
    const float f = fromBits(rng());
    if (std::isnan(f)) continue;
    const std::uint16_t expected = std::isinf(f) ? floatToBf16(f) : referenceRound(f, 0x7F7F, bf16Magnitude);
    ASSERT_EQ(floatToBf16(f), expected)
        << "mismatch at index " << i << " (float bits 0x" << std::hex << bitsOf(f) << ")";
  }
}

// ---- fp16 ---------------------------------------------------------------------------------------

TEST(Half, ExactValues) {
  EXPECT_EQ(floatToHalf(1.0f), 0x3C00);
  EXPECT_EQ(floatToHalf(-2.0f), 0xC000);
  EXPECT_EQ(floatToHalf(-0.0f), 0x8000);
  EXPECT_EQ(floatToHalf(65504.0f), 0x7BFF);
  EXPECT_EQ(halfToFloat(0x3C00), 1.0f);
  EXPECT_EQ(halfToFloat(0x7BFF), 65504.0f);
  EXPECT_EQ(halfToFloat(0x3555), 0.333251953125f);
  EXPECT_EQ(halfToFloat(0x8000), -0.0f);
  EXPECT_TRUE(std::signbit(halfToFloat(0x8000)));
}

TEST(Half, RoundsToNearestEven) {
  EXPECT_EQ(floatToHalf(1.0f + 0x1p-11f), 0x3C00);             // tie, lsb 0 stays
  EXPECT_EQ(floatToHalf(1.0f + 0x3p-11f), 0x3C02);             // tie, lsb 1 rounds up
  EXPECT_EQ(floatToHalf(1.0f + 0x1p-11f + 0x1p-20f), 0x3C01);  // above the tie
  EXPECT_EQ(floatToHalf(-(1.0f + 0x3p-11f)), 0xBC02);
  EXPECT_EQ(floatToHalf(2047.5f), 0x6800);  // 2047.5 ties to 2048
}

TEST(Half, Subnormals) {
  EXPECT_EQ(halfToFloat(0x0001), 0x1p-24f);
  EXPECT_EQ(halfToFloat(0x03FF), 1023 * 0x1p-24f);
  EXPECT_EQ(halfToFloat(0x0400), 0x1p-14f);  // smallest normal
  EXPECT_EQ(floatToHalf(0x1p-24f), 0x0001);
  EXPECT_EQ(floatToHalf(0x1p-25f), 0x0000);                      // tie to even (zero)
  EXPECT_EQ(floatToHalf(0x1p-25f * (1.0f + 0x1p-23f)), 0x0001);  // just above the tie
  EXPECT_EQ(floatToHalf(0x3p-25f), 0x0002);                      // tie to even (2)
  EXPECT_EQ(floatToHalf(0x7FFp-25f), 0x0400);                    // 1023.5·2^-24 ties up to normal
  EXPECT_EQ(floatToHalf(-0x1p-24f), 0x8001);
  EXPECT_EQ(floatToHalf(0x1p-30f), 0x0000);  // underflows to zero
}

TEST(Half, InfNaNAndOverflow) {
  EXPECT_EQ(floatToHalf(kInf), 0x7C00);
  EXPECT_EQ(floatToHalf(-kInf), 0xFC00);
  EXPECT_EQ(halfToFloat(0x7C00), kInf);
  EXPECT_EQ(halfToFloat(0xFC00), -kInf);
  EXPECT_EQ(floatToHalf(65519.996f), 0x7BFF);  // below max + half ulp
  EXPECT_EQ(floatToHalf(65520.0f), 0x7C00);    // the tie: odd max rounds up to inf
  EXPECT_EQ(floatToHalf(1e10f), 0x7C00);
  EXPECT_EQ(floatToHalf(-1e10f), 0xFC00);
  EXPECT_TRUE(isHalfNaN(floatToHalf(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(isHalfNaN(floatToHalf(fromBits(0x7F800001))));
  EXPECT_TRUE(std::isnan(halfToFloat(0x7E00)));
  EXPECT_TRUE(std::isnan(halfToFloat(0x7C01)));
}

TEST(Half, EveryPatternRoundTripsAndMatchesFields) {
  for (std::uint32_t b = 0; b <= 0xFFFF; ++b) {
    const std::uint16_t bits = std::uint16_t(b);
    const float f = halfToFloat(bits);
    if (isHalfNaN(bits)) {
      ASSERT_TRUE(std::isnan(f)) << "mismatch at index " << b;
      ASSERT_TRUE(isHalfNaN(floatToHalf(f))) << "mismatch at index " << b;
    } else {
      ASSERT_EQ(double(f), halfValue(bits)) << "mismatch at index " << b;
      ASSERT_EQ(floatToHalf(f), bits) << "mismatch at index " << b;
    }
  }
}

TEST(Half, RandomFloatsMatchReference) {
  std::mt19937 rng(43);
  // Exponents 2^-27 .. 2^17 cover fp16's subnormals, normals and overflow.
  std::uniform_int_distribution<std::uint32_t> exponent(100, 144);
  for (int i = 0; i < 300000; ++i) {
    const std::uint32_t u = (rng() & 0x807FFFFFu) | (exponent(rng) << 23);
    const float f = fromBits(u);
    ASSERT_EQ(floatToHalf(f), referenceRound(f, 0x7BFF, halfMagnitude))
        << "mismatch at index " << i << " (float bits 0x" << std::hex << u << ")";
  }
}

// ---- fp8 (E4M3FN data, E8M0 scales) -------------------------------------------------------------

// Value of a non-NaN E4M3 pattern from its fields (independent of e4m3ToFloat).
double e4m3Value(std::uint8_t b) {
  const int exp = (b >> 3) & 0xf, mant = b & 0x7;
  const double sign = (b & 0x80) ? -1.0 : 1.0;
  return exp == 0 ? sign * mant / 512.0 : sign * (1.0 + mant / 8.0) * std::pow(2.0, exp - 7);
}
bool isE4m3NaN(std::uint8_t b) { return (b & 0x7f) == 0x7f; }

// Brute force: the nearest of the 127 non-negative finite patterns, ties to the even pattern,
// magnitudes above 448 saturated.
std::uint8_t referenceE4m3(double v) {
  const std::uint8_t sign = std::signbit(v) ? 0x80 : 0x00;
  const double a = std::min(std::fabs(v), 448.0);
  std::uint8_t best = 0;
  for (int b = 1; b <= 0x7e; ++b) {
    const double d = std::fabs(e4m3Value(std::uint8_t(b)) - a), dBest = std::fabs(e4m3Value(best) - a);
    if (d < dBest || (d == dBest && b % 2 == 0)) best = std::uint8_t(b);
  }
  return sign | best;
}

TEST(Fp8E4m3, ConversionTable) {
  struct Case { double value; std::uint8_t bits; };
  const Case cases[] = {
      {0.0, 0x00}, {-0.0, 0x80}, {1.0, 0x38}, {-1.0, 0xb8},
      {std::ldexp(1.0, -9), 0x01},        // smallest subnormal
      {7 * std::ldexp(1.0, -9), 0x07},    // largest subnormal
      {std::ldexp(1.0, -6), 0x08},        // smallest normal
      {448.0, 0x7e}, {-448.0, 0xfe},      // largest finite
      {1000.0, 0x7e}, {-1000.0, 0xfe}, {449.0, 0x7e}, {464.0, 0x7e},  // saturate
      {kInf, 0x7e}, {-kInf, 0xfe},
      {1.0 + 1.0 / 16, 0x38},             // tie between 1 and 1.125: even mantissa 0
      {1.0 + 3.0 / 16, 0x3a},             // tie between 1.125 and 1.25: even mantissa 2
      {1.0 + 1.0 / 16 + 1e-9, 0x39},      // just above the tie
      {std::ldexp(1.0, -10), 0x00},       // half the smallest subnormal: tie to 0
      {3 * std::ldexp(1.0, -10), 0x02},   // tie between subnormals 1 and 2
      {7.5 * std::ldexp(1.0, -9), 0x08},  // tie between the largest subnormal and 2^-6
      {15.5 * 16, 0x78},                  // 248, tie between 240 and 256: 256 (mantissa 0)
  };
  for (const Case& c : cases) {
    EXPECT_EQ(int(toE4m3(c.value)), int(c.bits)) << "value " << c.value;
    EXPECT_EQ(int(referenceE4m3(c.value)), int(c.bits)) << "reference, value " << c.value;
  }
  EXPECT_EQ(int(toE4m3(std::nan(""))), 0x7f);
  EXPECT_EQ(int(toE4m3(-std::nan(""))), 0xff);
  EXPECT_TRUE(std::isnan(e4m3ToFloat(0x7f)));
  EXPECT_TRUE(std::isnan(e4m3ToFloat(0xff)));
  EXPECT_EQ(e4m3ToFloat(0x7e), 448.f);
  EXPECT_EQ(e4m3ToFloat(0x01), std::ldexp(1.f, -9));
  EXPECT_TRUE(std::signbit(e4m3ToFloat(0x80)));
}

TEST(Fp8E4m3, EveryPatternRoundTripsAndMatchesFields) {
  for (int b = 0; b < 256; ++b) {
    const std::uint8_t bits = std::uint8_t(b);
    if (isE4m3NaN(bits)) continue;
    ASSERT_EQ(double(e4m3ToFloat(bits)), e4m3Value(bits)) << "mismatch at pattern " << b;
    ASSERT_EQ(int(toE4m3(e4m3ToFloat(bits))), b) << "mismatch at pattern " << b;
  }
}

TEST(Fp8E4m3, RandomValuesMatchReference) {
  std::mt19937 rng(44);
  std::uniform_real_distribution<double> mantissa(-1.0, 1.0);
  std::uniform_int_distribution<int> exponent(-12, 10);  // below the subnormals to past 448
  for (int i = 0; i < 100000; ++i) {
    // Half of the values sit exactly on a midpoint between neighbouring patterns.
    double v = std::ldexp(mantissa(rng), exponent(rng));
    if (i % 2) {
      const std::uint8_t lo = toE4m3(v) & 0x7f;
      if (lo < 0x7e) v = std::copysign((e4m3Value(lo) + e4m3Value(std::uint8_t(lo + 1))) / 2, v);
    }
    ASSERT_EQ(int(toE4m3(v)), int(referenceE4m3(v))) << "mismatch at index " << i << " (value " << v << ")";
  }
}

// The least e with amax <= 448·2^e, clamped to the E8M0 range.
TEST(Fp8E8m0, Mxfp8ScaleExponent) {
  EXPECT_EQ(mxfp8ScaleExponent(448.0), 0);
  EXPECT_EQ(mxfp8ScaleExponent(std::nextafter(448.0, 1e9)), 1);
  EXPECT_EQ(mxfp8ScaleExponent(1.0), -8);     // 448·2^-9 = 0.875 < 1 <= 448·2^-8
  EXPECT_EQ(mxfp8ScaleExponent(0.875), -9);
  EXPECT_EQ(mxfp8ScaleExponent(0.0), -127);
  EXPECT_EQ(mxfp8ScaleExponent(1e-300), -127);
  EXPECT_EQ(mxfp8ScaleExponent(1e300), 127);
  EXPECT_EQ(mxfp8ScaleExponent(std::numeric_limits<double>::infinity()), 127);
}

TEST(Fp8E8m0, PowersOfTwoOnly) {
  EXPECT_EQ(e8m0ToFloat(127), 1.f);
  EXPECT_EQ(e8m0ToFloat(0), std::ldexp(1.f, -127));
  EXPECT_EQ(e8m0ToFloat(254), std::ldexp(1.f, 127));
  EXPECT_EQ(e8m0ToFloat(120), 1.f / 128);
  EXPECT_TRUE(std::isnan(e8m0ToFloat(0xff)));
  EXPECT_EQ(int(toE8m0(1.0)), 127);
  EXPECT_EQ(int(toE8m0(std::ldexp(1.0, -127))), 0);
  EXPECT_EQ(int(toE8m0(std::ldexp(1.0, 127))), 254);
  EXPECT_EQ(int(toE8m0(0.25)), 125);
  EXPECT_EQ(int(toE8m0(std::nan(""))), 0xff);
  for (int b = 0; b < 255; ++b) ASSERT_EQ(int(toE8m0(e8m0ToFloat(std::uint8_t(b)))), b) << "pattern " << b;
  for (double bad : {3.0, 0.75, 0.0, -2.0, double(kInf), std::ldexp(1.0, 128), std::ldexp(1.0, -128)}) {
    try {
      toE8m0(bad);
      ADD_FAILURE() << "expected InvalidArgument for " << bad;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("exact power of two"), std::string::npos) << e.what();
    }
  }
}

TEST(Fp8, LoadStoreAsDouble) {
  std::uint8_t b = 0;
  storeFromDouble(DType::kFloat8E4M3, 0.3, &b);  // 0.3 -> 0.3125 = 1.25·2^-2
  EXPECT_EQ(int(b), 0x2a);
  EXPECT_EQ(loadAsDouble(DType::kFloat8E4M3, &b), 0.3125);
  storeFromDouble(DType::kFloat8E4M3, -1e6, &b);
  EXPECT_EQ(loadAsDouble(DType::kFloat8E4M3, &b), -448.0);
  storeFromDouble(DType::kFloat8E8M0, 0.5, &b);
  EXPECT_EQ(int(b), 126);
  EXPECT_EQ(loadAsDouble(DType::kFloat8E8M0, &b), 0.5);
  EXPECT_THROW(storeFromDouble(DType::kFloat8E8M0, 0.3, &b), InvalidArgument);
}

// ---- DType helpers ------------------------------------------------------------------------------

TEST(DType, NamesSizesAndRoundTo) {
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat64, DType::kInt64,
                  DType::kFloat8E4M3, DType::kFloat8E8M0})
    EXPECT_EQ(parseDType(dtypeName(d)), d) << dtypeName(d);
  EXPECT_EQ(std::string(dtypeName(DType::kFloat8E4M3)), "fp8e4m3");
  EXPECT_EQ(std::string(dtypeName(DType::kFloat8E8M0)), "e8m0");
  EXPECT_EQ(dtypeSize(DType::kFloat8E4M3), 1u);
  EXPECT_EQ(dtypeSize(DType::kFloat8E8M0), 1u);
  EXPECT_TRUE(isFloat8(DType::kFloat8E4M3));
  EXPECT_FALSE(isFloat8(DType::kBFloat16));
  EXPECT_FALSE(isFloating(DType::kFloat8E4M3));  // storage only, not an arithmetic operand
  EXPECT_FALSE(isFloating(DType::kFloat8E8M0));
  EXPECT_EQ(std::string(dtypeName(DType::kBFloat16)), "bf16");
  EXPECT_EQ(dtypeSize(DType::kFloat32), 4u);
  EXPECT_EQ(dtypeSize(DType::kBFloat16), 2u);
  EXPECT_EQ(dtypeSize(DType::kFloat16), 2u);
  EXPECT_EQ(dtypeSize(DType::kFloat64), 8u);
  EXPECT_EQ(dtypeSize(DType::kInt64), 8u);
  EXPECT_TRUE(is16Bit(DType::kFloat16));
  EXPECT_FALSE(is16Bit(DType::kFloat32));
  EXPECT_FALSE(isFloating(DType::kInt64));
  EXPECT_THROW(parseDType("float32"), InvalidArgument);
  EXPECT_EQ(roundTo(DType::kBFloat16, 1.0f + 0x3p-8f), 1.0f + 0x1p-6f);
  EXPECT_EQ(roundTo(DType::kFloat16, 1.0f + 0x3p-11f), 1.0f + 0x1p-9f);
  EXPECT_EQ(roundTo(DType::kFloat32, 0.1f), 0.1f);
}

// ---- Shape --------------------------------------------------------------------------------------

TEST(Shape, BasicsAndStr) {
  const Shape s{8, 1024};
  EXPECT_EQ(s.rank(), 2);
  EXPECT_EQ(s.numel(), 8192);
  EXPECT_EQ(s.str(), "(8, 1024)");
  EXPECT_EQ(Shape{5}.str(), "(5,)");
  EXPECT_EQ(Shape{}.str(), "()");
  EXPECT_EQ(Shape{}.numel(), 1);
  EXPECT_EQ(Shape({2, 0, 3}).numel(), 0);
  EXPECT_EQ(Shape({2, 3, 4}).contiguousStrides(), Shape({12, 4, 1}));
  EXPECT_EQ(Shape({2, 3}), Shape({2, 3}));
  EXPECT_NE(Shape({2, 3}), Shape({3, 2}));
  EXPECT_NE(Shape({2, 3}), Shape({2, 3, 1}));
  const std::int64_t dims[] = {4, 5, 6};
  EXPECT_EQ(Shape(dims, 3), Shape({4, 5, 6}));
  std::ostringstream os;
  os << Shape{3, 4};
  EXPECT_EQ(os.str(), "(3, 4)");
}

TEST(Shape, RejectsBadModes) {
  EXPECT_THROW((Shape{1, 2, 3, 4, 5}), InvalidArgument);
  EXPECT_THROW((Shape{2, -1}), InvalidArgument);
  const std::int64_t dims[] = {1, 2, 3, 4, 5};
  EXPECT_THROW(Shape(dims, 5), InvalidArgument);
}

// ---- View ---------------------------------------------------------------------------------------

TEST(View, SliceTransposeAndT) {
  float data[24] = {};
  View v(data, Shape{4, 6}, DType::kFloat32);  // (4, 6)
  EXPECT_TRUE(v.isContiguous());
  EXPECT_EQ(v.strides(), Strides({6, 1}));

  View rows = v.slice(0, 1, 3);  // (2, 6)
  EXPECT_EQ(rows.data(), static_cast<void*>(data + 6));
  EXPECT_EQ(rows.shape(), Shape({2, 6}));
  EXPECT_TRUE(rows.isContiguous());

  View cols = v.slice(-1, 2, 5);  // (4, 3) strides (6, 1)
  EXPECT_EQ(cols.data(), static_cast<void*>(data + 2));
  EXPECT_EQ(cols.shape(), Shape({4, 3}));
  EXPECT_FALSE(cols.isContiguous());
  EXPECT_EQ(cols.str(), "fp32 (4, 3) strides (6, 1)");

  View t = v.t();  // (6, 4) strides (1, 6)
  EXPECT_EQ(t.shape(), Shape({6, 4}));
  EXPECT_EQ(t.strides(), Strides({1, 6}));
  EXPECT_EQ(t.data(), static_cast<void*>(data));
  EXPECT_EQ(t.dim(-1), 4);
  EXPECT_EQ(t.stride(-1), 6);
  EXPECT_EQ(t.t().strides(), v.strides());

  float cube[24] = {};
  View c(cube, Shape{2, 3, 4}, DType::kFloat32);
  View ct = c.transpose(0, 2);
  EXPECT_EQ(ct.shape(), Shape({4, 3, 2}));
  EXPECT_EQ(ct.strides(), Strides({1, 4, 12}));

  EXPECT_THROW(c.t(), InvalidArgument);
  EXPECT_THROW(c.transpose(0, 3), InvalidArgument);
  EXPECT_THROW(v.slice(0, 3, 5), InvalidArgument);
  EXPECT_THROW(v.slice(0, 2, 1), InvalidArgument);
  EXPECT_THROW(v.slice(2, 0, 1), InvalidArgument);
  EXPECT_EQ(v.slice(0, 4, 4).numel(), 0);
}

TEST(View, Reshape) {
  double data[12] = {};
  ConstView v(data, Shape{3, 4}, DType::kFloat64);
  ConstView r = v.reshape({2, 2, 3});
  EXPECT_EQ(r.shape(), Shape({2, 2, 3}));
  EXPECT_EQ(r.strides(), Strides({6, 3, 1}));
  EXPECT_EQ(r.data(), static_cast<const void*>(data));
  try {
    v.reshape({5, 2});
    ADD_FAILURE() << "reshape to the wrong numel must throw";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(std::string(e.what()),
              "View::reshape: new shape (5, 2) must have 12 elements like (3, 4), got 10");
  }
  try {
    v.t().reshape({12});
    ADD_FAILURE() << "reshape of a transposed view must throw";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(std::string(e.what()), "View::reshape: view fp64 (4, 3) strides (1, 4) must be contiguous");
  }
}

TEST(View, FlattenTo2d) {
  float data[60] = {};
  View v(data, Shape{3, 4, 5}, DType::kFloat32);  // (s, b, h)
  View f = v.flattenTo2d();
  EXPECT_EQ(f.shape(), Shape({12, 5}));
  EXPECT_EQ(f.strides(), Strides({5, 1}));

  View padded = View(data, Shape{3, 4, 5}, DType::kFloat32).slice(2, 0, 3);  // (3, 4, 3) strides (20, 5, 1)
  View pf = padded.flattenTo2d();
  EXPECT_EQ(pf.shape(), Shape({12, 3}));
  EXPECT_EQ(pf.strides(), Strides({5, 1}));

  EXPECT_EQ(View(data, Shape{7}, DType::kFloat32).flattenTo2d().shape(), Shape({1, 7}));
  EXPECT_EQ(v.slice(0, 0, 2).reshape({8, 5}).flattenTo2d().shape(), Shape({8, 5}));  // rank 2: itself
  EXPECT_THROW(v.slice(1, 0, 2).flattenTo2d(), InvalidArgument);                     // rows 0..1 then a gap
  EXPECT_THROW(View(data, Shape{}, DType::kFloat32).flattenTo2d(), InvalidArgument);

  // Modes of extent 1 carry meaningless strides and must not decide the row stride.
  View unit = View(data, Shape{1, 3, 1, 4}, DType::kFloat32).transpose(0, 2).transpose(0, 1);  // (3, 1, 1, 4)
  EXPECT_EQ(unit.flattenTo2d().shape(), Shape({3, 4}));
  EXPECT_EQ(unit.flattenTo2d().strides(), Strides({4, 1}));
}

TEST(View, IsContiguousIgnoresUnitModes) {
  float data[8] = {};
  EXPECT_TRUE(View(data, Shape{1, 8}, Strides{99, 1}, DType::kFloat32).isContiguous());
  EXPECT_TRUE(View(data, Shape{8, 1}, Strides{1, 7}, DType::kFloat32).isContiguous());
  EXPECT_FALSE(View(data, Shape{4, 2}, Strides{1, 4}, DType::kFloat32).isContiguous());
  EXPECT_FALSE(View(data, Shape{4}, Strides{2}, DType::kFloat32).isContiguous());
}

TEST(View, TypedAtBytesAndConstConversion) {
  std::uint16_t data[6] = {};
  View v(data, Shape{2, 3}, DType::kBFloat16);
  EXPECT_EQ(v.typed<std::uint16_t>(), data);
  EXPECT_THROW(v.typed<float>(), InvalidArgument);
  EXPECT_EQ(v.at(4), static_cast<void*>(data + 4));
  EXPECT_EQ(v.bytes(), 12u);
  EXPECT_EQ(v.str(), "bf16 (2, 3)");
  ConstView c = v;
  EXPECT_EQ(c.data(), static_cast<const void*>(data));
  EXPECT_EQ(c.dtype(), DType::kBFloat16);
  EXPECT_EQ(c.device(), Device::kHost);
  EXPECT_EQ(std::string(deviceName(Device::kCuda)), "cuda");
  float f32[2] = {};
  EXPECT_THROW(View(f32, Shape{2}, DType::kFloat32).typed<std::uint16_t>(), InvalidArgument);
}

}  // namespace
}  // namespace tpsim
