#include "backends/dtype.h"

#include <algorithm>
#include <cmath>

#include "backends/errors.h"

namespace tpsim {

std::size_t dtypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 4;
    case DType::kBFloat16: return 2;
    case DType::kFloat16: return 2;
    case DType::kFloat64: return 8;
    case DType::kInt64: return 8;
    case DType::kFloat8E4M3: return 1;
    case DType::kFloat8E8M0: return 1;
  }
  TPSIM_INTERNAL_ASSERT(false, "unknown dtype ", int(dtype));
}

const char* dtypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "fp32";
    case DType::kBFloat16: return "bf16";
    case DType::kFloat16: return "fp16";
    case DType::kFloat64: return "fp64";
    case DType::kInt64: return "int64";
    case DType::kFloat8E4M3: return "fp8e4m3";
    case DType::kFloat8E8M0: return "e8m0";
  }
  return "unknown";
}

DType parseDType(const std::string& name) {
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat64, DType::kInt64,
                  DType::kFloat8E4M3, DType::kFloat8E8M0})
    if (name == dtypeName(d)) return d;
  TPSIM_CHECK(false, "dtype must be one of fp32, bf16, fp16, fp64, int64, fp8e4m3, e8m0, got '", name, "'");
}

double loadAsDouble(DType dtype, const void* p) {
  switch (dtype) {
    case DType::kFloat32: { float f; std::memcpy(&f, p, 4); return f; }
    case DType::kFloat64: { double d; std::memcpy(&d, p, 8); return d; }
    case DType::kInt64: { std::int64_t x; std::memcpy(&x, p, 8); return double(x); }
    case DType::kBFloat16: { std::uint16_t x; std::memcpy(&x, p, 2); return bf16ToFloat(x); }
    case DType::kFloat16: { std::uint16_t x; std::memcpy(&x, p, 2); return halfToFloat(x); }
    case DType::kFloat8E4M3: return e4m3ToFloat(*static_cast<const std::uint8_t*>(p));
    case DType::kFloat8E8M0: return e8m0ToFloat(*static_cast<const std::uint8_t*>(p));
  }
  TPSIM_INTERNAL_ASSERT(false, "unknown dtype ", int(dtype));
}

void storeFromDouble(DType dtype, double v, void* p) {
  switch (dtype) {
    case DType::kFloat32: { const float f = float(v); std::memcpy(p, &f, 4); return; }
    case DType::kFloat64: std::memcpy(p, &v, 8); return;
    case DType::kInt64: { const std::int64_t x = std::int64_t(v); std::memcpy(p, &x, 8); return; }
    case DType::kBFloat16: { const std::uint16_t x = floatToBf16(float(v)); std::memcpy(p, &x, 2); return; }
    case DType::kFloat16: { const std::uint16_t x = floatToHalf(float(v)); std::memcpy(p, &x, 2); return; }
    case DType::kFloat8E4M3: *static_cast<std::uint8_t*>(p) = toE4m3(v); return;
    case DType::kFloat8E8M0: *static_cast<std::uint8_t*>(p) = toE8m0(v); return;
  }
  TPSIM_INTERNAL_ASSERT(false, "unknown dtype ", int(dtype));
}

float halfToFloat(std::uint16_t h) {
  const std::uint32_t sign = std::uint32_t(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  const std::uint32_t mant = h & 0x3ffu;
  std::uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (mant << 13);  // inf / NaN
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    u = sign;
  } else {  // subnormal: value = mant * 2^-24
    float f = std::ldexp(float(mant), -24);
    std::memcpy(&u, &f, sizeof u);
    u |= sign;
  }
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

std::uint16_t floatToHalf(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const std::uint16_t sign = std::uint16_t((u >> 16) & 0x8000u);
  const std::uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;     // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;    // rounds to >= 65520: inf
  if (abs < 0x38800000u) {                          // below 2^-14: subnormal or zero
    // Scale so the subnormal unit 2^-24 becomes 1, then round to nearest even in float.
    float a;
    std::memcpy(&a, &abs, sizeof a);
    return sign | std::uint16_t(std::nearbyint(a * 16777216.0f));
  }
  // Normal: rebias exponent, round mantissa from 23 to 10 bits to nearest even.
  std::uint32_t v = abs - (112u << 23);
  v += 0xfffu + ((v >> 13) & 1u);
  return sign | std::uint16_t(v >> 13);
}

// Every step below scales by powers of two or rounds a small integer, so it is exact in double.
std::uint8_t toE4m3(double v) {
  const std::uint8_t sign = std::signbit(v) ? 0x80 : 0x00;
  if (std::isnan(v)) return sign | 0x7f;
  const double a = std::fabs(v);
  if (a >= 448.0) return sign | 0x7e;                    // saturate, infinity included
  if (a < 0x1p-6) return sign | std::uint8_t(std::nearbyint(a * 512.0));  // subnormal unit 2^-9; 8 is 2^-6
  int e;
  std::frexp(a, &e);                                     // a = f·2^e, f in [0.5, 1)
  const int exponent = e - 1;                            // a = m·2^exponent, m in [1, 2)
  const double q = std::nearbyint((std::ldexp(a, -exponent) - 1.0) * 8.0);  // 3 mantissa bits, may carry
  return sign | std::uint8_t(((exponent + 7) << 3) + int(q));
}

float e4m3ToFloat(std::uint8_t bits) {
  const float sign = (bits & 0x80) ? -1.f : 1.f;
  const int exp = (bits >> 3) & 0xf, mant = bits & 0x7;
  if (exp == 0xf && mant == 0x7) return std::nanf("");
  if (exp == 0) return sign * std::ldexp(float(mant), -9);
  return sign * std::ldexp(float(8 + mant), exp - 10);
}

float e8m0ToFloat(std::uint8_t bits) {
  if (bits == 0xff) return std::nanf("");
  return std::ldexp(1.f, int(bits) - 127);
}

std::uint8_t toE8m0(double v) {
  if (std::isnan(v)) return 0xff;
  int e = 0;
  const double f = std::isfinite(v) && v > 0 ? std::frexp(v, &e) : 0.0;
  TPSIM_CHECK(f == 0.5 && e - 1 >= -127 && e - 1 <= 127, "e8m0: a value must be an exact power of two 2^e with e "
              "in [-127, 127], got ", v);
  return std::uint8_t(e - 1 + 127);
}

int mxfp8ScaleExponent(double amax) {
  if (amax == 0) return -127;
  if (std::isinf(amax)) return 127;
  // amax = f·2^k with f in [0.5, 1) and 448 = 0.875·2^9: e = k - 9, or k - 8 when f > 0.875.
  int k;
  const double f = std::frexp(amax, &k);
  return std::clamp(k - 9 + (f > 0.875 ? 1 : 0), -127, 127);
}

}  // namespace tpsim
