// Tests of backends/element_math.h against references written here with libm and double
// arithmetic (frexp, ldexp, nearbyint, nextafter), independent of the header's bit manipulation.
//
// Exhaustive where the domain is small (every 16-bit and 8-bit pattern, every E4M3 tie, every
// MXFP8 scale boundary); elsewhere every exponent combined with the mantissas around every
// rounding position (ties, one ulp either side, carries into the exponent), plus random values.
// All 2^32 floats would take about two minutes against the libm reference, hence the structure.
#include "backends/element_math.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

namespace tpsim::elem {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Equal values with equal signs (+0 is not -0); any NaN matches any NaN.
::testing::AssertionResult sameValue(double got, double want) {
  if ((std::isnan(got) && std::isnan(want)) || (got == want && std::signbit(got) == std::signbit(want)))
    return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << std::hexfloat << "got " << got << ", want " << want;
}

// ---- References ---------------------------------------------------------------------------------

// A binary format: `precision` significant bits (the implicit one included), smallest normal
// 2^minExp, largest finite value maxFinite; past it IEEE formats overflow to infinity and
// saturating ones (E4M3 with __NV_SATFINITE) clamp to ±maxFinite.
struct Format {
  int precision;
  int minExp;
  double maxFinite;
  bool saturates;
};
constexpr Format kBf16{8, -126, 0x1.fep127, false};
constexpr Format kHalf{11, -14, 65504.0, false};
constexpr Format kE4m3{4, -6, 448.0, true};

// v (not NaN) rounded to nearest even in `format`: scale the quantum of v's binade to 1, round to
// an integer, scale back; every step is exact in double.
double referenceRound(double v, Format format) {
  if (std::isinf(v)) return format.saturates ? std::copysign(format.maxFinite, v) : v;
  int e;
  std::frexp(std::fabs(v), &e);  // |v| in [2^(e-1), 2^e)
  const int quantum = std::max(e - 1, format.minExp) - (format.precision - 1);
  double r = std::ldexp(std::nearbyint(std::ldexp(std::fabs(v), -quantum)), quantum);
  if (r > format.maxFinite) r = format.saturates ? format.maxFinite : kInf;
  return std::copysign(r, v);
}

// The value of a sign | exponent | mantissa pattern from its fields: subnormals at exponent 0,
// no special values.
double fieldValue(unsigned bits, int expBits, int mantBits, int bias) {
  const unsigned mant = bits & ((1u << mantBits) - 1), exp = (bits >> mantBits) & ((1u << expBits) - 1);
  const double magnitude = exp == 0 ? std::ldexp(mant, 1 - bias - mantBits)
                                    : std::ldexp((1u << mantBits) + mant, int(exp) - bias - mantBits);
  return (bits >> (expBits + mantBits)) & 1u ? -magnitude : magnitude;
}
// IEEE patterns: the all-ones exponent holds infinity and NaN.
double ieeeValue(unsigned bits, int expBits, int mantBits, int bias) {
  const unsigned expMask = (1u << expBits) - 1;
  if (((bits >> mantBits) & expMask) != expMask) return fieldValue(bits, expBits, mantBits, bias);
  if (bits & ((1u << mantBits) - 1)) return kNaN;
  return (bits >> (expBits + mantBits)) & 1u ? -kInf : kInf;
}
double bf16Value(std::uint16_t b) { return ieeeValue(b, 8, 7, 127); }
double halfValue(std::uint16_t h) { return ieeeValue(h, 5, 10, 15); }
// E4M3FN: no infinity; S.1111.111 is NaN.
double e4m3Value(std::uint8_t c) { return (c & 0x7f) == 0x7f ? kNaN : fieldValue(c, 4, 3, 7); }

// double -> float rounded to odd, by stepping the nearest float toward zero when it overshoots.
float referenceToOddFloat(double v) {
  float f = float(v);
  if (std::isnan(v) || double(f) == v) return f;
  if (std::fabs(double(f)) > std::fabs(v)) f = std::nextafter(f, 0.f);
  return floatFromBits(bitsOf(f) | 1u);
}

// The least e in [-127, 127] with amax <= 448·2^e, by trying them in turn; 127 when none is.
int referenceScaleExponent(double amax) {
  for (int e = -127; e < 127; ++e)
    if (amax <= std::ldexp(448.0, e)) return e;
  return 127;
}

// ---- Inputs -------------------------------------------------------------------------------------

// Mantissas of `width` bits around every rounding position r (r low bits rounded off): those r
// bits at 0, 1, just under, at and just over half, and all ones; bit r clear and set (ties to
// even); the bits above clear, all set (the carry into the exponent) and alternating.
std::vector<std::uint64_t> boundaryMantissas(int width) {
  const std::uint64_t all = (std::uint64_t(1) << width) - 1;
  std::vector<std::uint64_t> out;
  for (int r = 1; r <= width; ++r) {
    const std::uint64_t half = std::uint64_t(1) << (r - 1);
    for (std::uint64_t low : {std::uint64_t(0), std::uint64_t(1), half - 1, half, half + 1, 2 * half - 1})
      for (std::uint64_t bit : {0, 1})
        for (std::uint64_t high : {std::uint64_t(0), all, std::uint64_t(0x5555555555555555)})
          out.push_back(((high << (r + 1)) | (bit << r) | low) & all);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

// Both signs of every float exponent with every boundary mantissa.
std::vector<float> boundaryFloats() {
  const std::vector<std::uint64_t> mantissas = boundaryMantissas(23);
  std::vector<float> out;
  for (std::uint32_t sign : {0u, 1u})
    for (std::uint32_t exp = 0; exp < 256; ++exp)
      for (std::uint64_t mant : mantissas)
        out.push_back(floatFromBits(sign << 31 | exp << 23 | std::uint32_t(mant)));
  return out;
}
// Both signs of every biased exponent in `exponents` with every boundary mantissa.
std::vector<double> boundaryDoubles(const std::vector<std::uint64_t>& exponents) {
  const std::vector<std::uint64_t> mantissas = boundaryMantissas(52);
  std::vector<double> out;
  for (std::uint64_t sign : {0, 1})
    for (std::uint64_t exp : exponents)
      for (std::uint64_t mant : mantissas) out.push_back(doubleFromBits(sign << 63 | exp << 52 | mant));
  return out;
}
// Biased double exponents [1023 + lo, 1023 + hi], plus zero/subnormal, the extremes and inf/NaN.
std::vector<std::uint64_t> doubleExponents(int lo, int hi) {
  std::vector<std::uint64_t> out = {0, 1, 0x7fe, 0x7ff};
  for (int e = lo; e <= hi; ++e) out.push_back(std::uint64_t(1023 + e));
  return out;
}

// ---- bf16 and fp16 ------------------------------------------------------------------------------

TEST(ElementMath, EveryBf16AndHalfPatternToFloat) {
  for (unsigned b = 0; b < 0x10000; ++b) {
    const auto bits = std::uint16_t(b);
    const float bf16 = bf16ToFloat(bits), half = halfToFloat(bits);
    EXPECT_TRUE(sameValue(bf16, bf16Value(bits))) << "bf16 0x" << std::hex << b;
    EXPECT_TRUE(sameValue(half, halfValue(bits))) << "fp16 0x" << std::hex << b;
    // NaNs keep their sign and payload, which the store back to 16 bits returns quieted.
    const std::uint32_t sign = (b & 0x8000u) << 16;
    if (std::isnan(bf16)) {
      EXPECT_EQ(bitsOf(bf16), b << 16) << std::hex << b;
      EXPECT_EQ(floatToBf16(bf16), bits | 0x40) << std::hex << b;
    } else {
      EXPECT_EQ(floatToBf16(bf16), bits) << std::hex << b;
    }
    if (std::isnan(half)) {
      EXPECT_EQ(bitsOf(half), sign | 0x7f800000u | (b & 0x3ffu) << 13) << std::hex << b;
      EXPECT_EQ(floatToHalf(half), (b & 0x8000u) | 0x7e00u) << std::hex << b;
    } else {
      EXPECT_EQ(floatToHalf(half), bits) << std::hex << b;
    }
    if (HasFailure()) return;
  }
}

// Rounding of one float to bf16 and fp16; NaN becomes a quiet NaN of the same sign (bf16 keeps the
// top payload bits, fp16 the canonical 0x7E00).
void checkFloatTo16Bit(float f) {
  const std::uint16_t bf16 = floatToBf16(f), half = floatToHalf(f);
  if (std::isnan(f)) {
    EXPECT_EQ(bf16, (bitsOf(f) >> 16) | 0x40) << std::hexfloat << f;
    EXPECT_EQ(half, ((bitsOf(f) >> 16) & 0x8000u) | 0x7e00u) << std::hexfloat << f;
    return;
  }
  EXPECT_TRUE(sameValue(bf16Value(bf16), referenceRound(f, kBf16))) << "bf16 of " << std::hexfloat << f;
  EXPECT_TRUE(sameValue(halfValue(half), referenceRound(f, kHalf))) << "fp16 of " << std::hexfloat << f;
}

TEST(ElementMath, FloatTo16BitAtEveryRoundingBoundary) {
  for (float f : boundaryFloats()) {
    checkFloatTo16Bit(f);
    if (HasFailure()) return;
  }
}

TEST(ElementMath, RandomFloatsTo16Bit) {
  std::mt19937 rng(7);
  for (int i = 0; i < 1 << 20; ++i) {
    checkFloatTo16Bit(floatFromBits(rng()));
    if (HasFailure()) return;
  }
}

// ---- double -> float rounded to odd -------------------------------------------------------------

// Every float exponent and the doubles beyond both ends of float's range.
TEST(ElementMath, ToOddFloatMatchesNextafterAndRoundsOnceTo16Bit) {
  std::vector<double> inputs = boundaryDoubles(doubleExponents(-152, 129));
  for (double v : {0x1.fffffefffffffp127, 0x1.ffffffp127, 0x1p128, 0x1p-150, 0x1.0000000000001p-150})
    inputs.insert(inputs.end(), {v, -v});
  for (double v : inputs) {
    const float odd = toOddFloat(v);
    EXPECT_EQ(bitsOf(odd), bitsOf(referenceToOddFloat(v))) << std::hexfloat << v;
    // The reason for rounding to odd: one more rounding to 16 bits equals rounding v directly.
    if (!std::isnan(v)) {
      EXPECT_TRUE(sameValue(bf16Value(floatToBf16(odd)), referenceRound(v, kBf16))) << "bf16 of " << std::hexfloat << v;
      EXPECT_TRUE(sameValue(halfValue(floatToHalf(odd)), referenceRound(v, kHalf))) << "fp16 of " << std::hexfloat << v;
    }
    if (HasFailure()) return;
  }
  EXPECT_EQ(bitsOf(toOddFloat(1.f / 3)), bitsOf(1.f / 3));  // the float overload is the identity
}

TEST(ElementMath, RandomDoublesToOddFloat) {
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> mantissa(-2.0, 2.0);
  std::uniform_int_distribution<int> exponent(-160, 135);
  for (int i = 0; i < 1 << 18; ++i) {
    // Random bit patterns are mostly far outside float's range, so half are drawn within it.
    const double v = i % 2 ? doubleFromBits(rng()) : std::ldexp(mantissa(rng), exponent(rng));
    EXPECT_EQ(bitsOf(toOddFloat(v)), bitsOf(referenceToOddFloat(v))) << std::hexfloat << v;
    if (HasFailure()) return;
  }
}

// ---- E4M3 ---------------------------------------------------------------------------------------

TEST(ElementMath, EveryE4m3CodeToFloatAndBack) {
  for (unsigned c = 0; c < 256; ++c) {
    const auto code = std::uint8_t(c);
    const float f = e4m3ToFloat(code);
    EXPECT_TRUE(sameValue(f, e4m3Value(code))) << "code 0x" << std::hex << c;
    if (std::isnan(f))
      EXPECT_EQ(bitsOf(f), 0x7fc00000u) << std::hex << c;  // both NaN codes: the positive quiet NaN
    else
      EXPECT_EQ(toE4m3(f), code) << std::hex << c;
  }
}

// Ties between neighbouring codes go to the even code (the even mantissa), and one double ulp
// either side of a tie decides it; both signs, subnormals included.
TEST(ElementMath, ToE4m3TiesToEven) {
  for (std::uint8_t c = 0; c < 0x7e; ++c)
    for (std::uint8_t sign : {0x00, 0x80}) {
      const double lo = e4m3Value(sign | c), hi = e4m3Value(sign | (c + 1));
      const double mid = (lo + hi) / 2;  // exact: both have at most 4 significant bits
      EXPECT_EQ(toE4m3(mid), sign | (c % 2 ? c + 1 : c)) << std::hexfloat << mid;
      EXPECT_EQ(toE4m3(std::nextafter(mid, lo)), sign | c) << std::hexfloat << mid;
      EXPECT_EQ(toE4m3(std::nextafter(mid, hi)), sign | (c + 1)) << std::hexfloat << mid;
      EXPECT_EQ(toE4m3(std::nextafter(lo, hi)), sign | c) << std::hexfloat << lo;
      EXPECT_EQ(toE4m3(std::nextafter(hi, lo)), sign | (c + 1)) << std::hexfloat << hi;
    }
}

TEST(ElementMath, ToE4m3SpecialValues) {
  const double denormMin = std::numeric_limits<double>::denorm_min(), dblMin = std::numeric_limits<double>::min();
  for (double sign : {1.0, -1.0}) {
    const std::uint8_t s = sign < 0 ? 0x80 : 0x00;
    // Saturation at ±448: from just above it to infinity.
    for (double v : {448.0, std::nextafter(448.0, kInf), 464.0, 480.0, 1e300, std::numeric_limits<double>::max(), kInf})
      EXPECT_EQ(toE4m3(sign * v), s | 0x7e) << sign * v;
    EXPECT_EQ(toE4m3(sign * std::nextafter(448.0, 0.0)), s | 0x7e);
    EXPECT_EQ(toE4m3(sign * 432.0), s | 0x7e);  // 416 and 448 tie: 448's mantissa 6 is even
    EXPECT_EQ(toE4m3(sign * std::nextafter(432.0, 0.0)), s | 0x7d);
    // Zeros and fp64 subnormals keep their sign and round to zero.
    for (double v : {0.0, denormMin, 3 * denormMin, dblMin - denormMin, dblMin, 0x1p-10})
      EXPECT_EQ(toE4m3(sign * v), s) << sign * v;
    EXPECT_EQ(toE4m3(sign * std::nextafter(0x1p-10, 1.0)), s | 0x01);
    // NaN of either sign, quiet or signalling, any payload.
    for (std::uint64_t payload : {std::uint64_t(0x8000000000000), std::uint64_t(1), std::uint64_t(0xfffffffffffff)})
      EXPECT_EQ(toE4m3(doubleFromBits((sign < 0 ? 1ull << 63 : 0) | 0x7ff0000000000000ull | payload)), s | 0x7f);
  }
}

TEST(ElementMath, ToE4m3AtEveryRoundingBoundary) {
  for (double v : boundaryDoubles(doubleExponents(-14, 10))) {
    const std::uint8_t code = toE4m3(v);
    if (std::isnan(v))
      EXPECT_EQ(code, std::signbit(v) ? 0xff : 0x7f) << std::hexfloat << v;
    else
      EXPECT_TRUE(sameValue(e4m3Value(code), referenceRound(v, kE4m3))) << std::hexfloat << v;
    if (HasFailure()) return;
  }
}

TEST(ElementMath, RandomDoublesToE4m3) {
  std::mt19937_64 rng(13);
  std::uniform_real_distribution<double> mantissa(-2.0, 2.0);
  std::uniform_int_distribution<int> exponent(-14, 10);
  for (int i = 0; i < 1 << 18; ++i) {
    const double v = std::ldexp(mantissa(rng), exponent(rng));
    EXPECT_TRUE(sameValue(e4m3Value(toE4m3(v)), referenceRound(v, kE4m3))) << std::hexfloat << v;
    if (HasFailure()) return;
  }
}

// ---- E8M0 and the MXFP8 scale -------------------------------------------------------------------

TEST(ElementMath, EveryE8m0Exponent) {
  for (unsigned b = 0; b < 255; ++b)
    EXPECT_TRUE(sameValue(e8m0ToFloat(std::uint8_t(b)), std::ldexp(1.0, int(b) - 127))) << b;
  EXPECT_EQ(bitsOf(e8m0ToFloat(0xff)), 0x7fc00000u);
}

TEST(ElementMath, Mxfp8ScaleExponentAtEveryBoundary) {
  for (int e = -127; e <= 127; ++e) {
    const double bound = std::ldexp(448.0, e);
    EXPECT_EQ(mxfp8ScaleExponent(std::nextafter(bound, 0.0)), e) << e;
    EXPECT_EQ(mxfp8ScaleExponent(bound), e) << e;
    EXPECT_EQ(mxfp8ScaleExponent(std::nextafter(bound, kInf)), std::min(e + 1, 127)) << e;
  }
  // Below the least bound every amax takes -127; infinity and anything past the greatest take 127.
  for (double v : {0.0, std::numeric_limits<double>::denorm_min(), 0x1.fffffffffffffp-1023,
                   std::numeric_limits<double>::min(), std::ldexp(448.0, -128)})
    EXPECT_EQ(mxfp8ScaleExponent(v), -127) << v;
  for (double v : {std::ldexp(448.0, 128), std::numeric_limits<double>::max(), kInf})
    EXPECT_EQ(mxfp8ScaleExponent(v), 127) << v;
}

// Every power of two, and every binade at the mantissas around 448's (1.75).
TEST(ElementMath, Mxfp8ScaleExponentMatchesReference) {
  std::vector<double> inputs;
  for (int k = -1074; k <= 1023; ++k) inputs.push_back(std::ldexp(1.0, k));
  const std::uint64_t m = std::uint64_t(3) << 50;  // 1.75's mantissa bits
  for (std::uint64_t exp = 0; exp < 0x7ff; ++exp)
    for (std::uint64_t mant : {std::uint64_t(1), m - 1, m, m + 1, (std::uint64_t(1) << 52) - 1})
      inputs.push_back(doubleFromBits(exp << 52 | mant));
  for (double v : inputs) {
    EXPECT_EQ(mxfp8ScaleExponent(v), referenceScaleExponent(v)) << std::hexfloat << v;
    if (HasFailure()) return;
  }
}

TEST(ElementMath, UnscaleIsLdexp) {
  std::mt19937_64 rng(17);
  std::vector<double> inputs = {0.0, -0.0, kInf, -kInf, std::numeric_limits<double>::denorm_min(),
                                std::numeric_limits<double>::max()};
  for (int i = 0; i < 2000; ++i) inputs.push_back(doubleFromBits(rng()));
  for (int e = -127; e <= 127; ++e)
    for (double v : inputs)
      if (!std::isnan(v)) {
        EXPECT_EQ(bitsOf(unscale(v, e)), bitsOf(std::ldexp(v, -e))) << std::hexfloat << v << " " << e;
        if (HasFailure()) return;
      }
}

// ---- Element bodies -----------------------------------------------------------------------------

// alpha·x = 1 + 2^-11 + 2^-24 exactly in float's case (1 + 2^-26 + 2^-54 in double's). Rounded on
// its own it loses the last term, so y + alpha·x is 0; a fused multiply-add would keep it. The
// operands pass through volatile: constants folded at compile time would round every step anyway.
template <typename T>
void checkNoFusedMultiplyAdd(T eps) {
  volatile T operands[] = {1 + eps, -(1 + 2 * eps)};
  const T alpha = operands[0], x = operands[0], y = operands[1];
  EXPECT_EQ(axpyBody(y, alpha, x), T(0));
  EXPECT_EQ(sumRowsFinish(y, alpha, x), T(0));
}

TEST(ElementMath, BodiesRoundEveryOperation) {
  checkNoFusedMultiplyAdd(0x1p-12f);
  checkNoFusedMultiplyAdd(0x1p-27);
  EXPECT_EQ(scaleBody(3.f, 0.1f), 0.1f * 3.f);
  EXPECT_EQ(addBiasBody(1.f, 0x1p-24f), 1.f);  // a tie, to even
  EXPECT_EQ(sumRowsStep(1.0, 0x1p-53), 1.0);
  EXPECT_EQ(sumRowsFinish(2.f, 0.f, float(kNaN)), 2.f);  // beta = 0 ignores out, NaN included
  EXPECT_EQ(reduceStep(0.1f, 0.2f), 0.1f + 0.2f);
  EXPECT_EQ(meanFinish(7.f, 3.f), 7.f / 3.f);  // not 7·(1/3), one ulp above
  EXPECT_EQ(meanFinish(7.0, 3.0), 7.0 / 3.0);
  EXPECT_EQ(reduceStep<std::int64_t>(std::int64_t(1) << 60, 1), (std::int64_t(1) << 60) + 1);  // no rounding
  EXPECT_EQ(meanFinish<std::int64_t>(-7, 2), -3);  // C++ integer division
}

}  // namespace
}  // namespace tpsim::elem
