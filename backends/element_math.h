// Per-element math that every backend computes identically: dtype conversions and the bodies of
// the elementwise ops, compiled for the CPU (SimCompute, dtype.h) and for CUDA kernels (gpu/).
//
// One definition on both sides is what makes the GPU's elementwise results bitwise equal to the
// simulator's. Everything here is integer bit manipulation or a single correctly rounded IEEE
// operation: no libm call (whose last bit differs between glibc and CUDA), no fused multiply-add
// (add() and mul() use the _rn intrinsics on the device; host code builds with -ffp-contract=off).
// Not a math library: GeLU's erf is backend-specific and checked against a bound instead.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define TPSIM_HD __host__ __device__
#else
#define TPSIM_HD
#endif

namespace tpsim::elem {

// ---- Bit casts ----------------------------------------------------------------------------------

TPSIM_HD inline std::uint32_t bitsOf(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}
TPSIM_HD inline float floatFromBits(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}
TPSIM_HD inline std::uint64_t bitsOf(double d) {
#if defined(__CUDA_ARCH__)
  return std::uint64_t(__double_as_longlong(d));
#else
  std::uint64_t u;
  std::memcpy(&u, &d, sizeof u);
  return u;
#endif
}
TPSIM_HD inline double doubleFromBits(std::uint64_t u) {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(static_cast<long long>(u));
#else
  double d;
  std::memcpy(&d, &u, sizeof d);
  return d;
#endif
}

// ---- Single roundings ---------------------------------------------------------------------------

// a + b and a·b, each rounded once to nearest even and never contracted into an FMA.
TPSIM_HD inline float add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
TPSIM_HD inline float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
TPSIM_HD inline double add(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
TPSIM_HD inline double mul(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
TPSIM_HD inline float div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
TPSIM_HD inline double div(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}
// int64 collectives reduce with the same bodies: exact sums, means truncated toward zero.
TPSIM_HD inline std::int64_t add(std::int64_t a, std::int64_t b) { return a + b; }
TPSIM_HD inline std::int64_t div(std::int64_t a, std::int64_t b) { return a / b; }

TPSIM_HD inline bool isNan(float f) { return (bitsOf(f) & 0x7fffffffu) > 0x7f800000u; }
TPSIM_HD inline bool isNan(double d) { return (bitsOf(d) & 0x7fffffffffffffffull) > 0x7ff0000000000000ull; }

// 2^e as a double, for e in [-1022, 1023]: an exact scale factor.
TPSIM_HD inline double pow2(int e) { return doubleFromBits(std::uint64_t(1023 + e) << 52); }

// ---- bf16 and fp16 ------------------------------------------------------------------------------

TPSIM_HD inline float bf16ToFloat(std::uint16_t bits) { return floatFromBits(std::uint32_t(bits) << 16); }

TPSIM_HD inline std::uint16_t floatToBf16(float f) {
  std::uint32_t u = bitsOf(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return std::uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);                                               // nearest even
  return std::uint16_t(u >> 16);
}

TPSIM_HD inline float halfToFloat(std::uint16_t h) {
  const std::uint32_t sign = std::uint32_t(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  const std::uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return floatFromBits(sign | 0x7f800000u | (mant << 13));  // inf / NaN
  if (exp != 0) return floatFromBits(sign | ((exp + 112) << 23) | (mant << 13));
  // Zero or subnormal: mant·2^-24, exact in float (a power-of-two scale of a small integer).
  return floatFromBits(sign | bitsOf(mul(float(mant), 0x1p-24f)));
}

TPSIM_HD inline std::uint16_t floatToHalf(float f) {
  const std::uint32_t u = bitsOf(f);
  const std::uint16_t sign = std::uint16_t((u >> 16) & 0x8000u);
  const std::uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: inf
  if (abs < 0x38800000u) {                        // below 2^-14: subnormal or zero
    // a·2^24 < 2^10 is exact; adding and removing 2^23 rounds it to an integer, nearest even.
    const float scaled = mul(floatFromBits(abs), 16777216.0f);
    return sign | std::uint16_t(add(add(scaled, 0x1p23f), -0x1p23f));
  }
  // Normal: rebias the exponent, round the mantissa from 23 to 10 bits to nearest even.
  std::uint32_t v = abs - (112u << 23);
  v += 0xfffu + ((v >> 13) & 1u);
  return sign | std::uint16_t(v >> 13);
}

// double -> float rounded to odd (truncate, then set the last bit if inexact). Rounding that float
// to nearest bf16/fp16 (<= 11 significant bits of float's 24) equals rounding the double directly.
TPSIM_HD inline float toOddFloat(double v) {
  float f = float(v);  // nearest even (__double2float_rn on the device)
  if (isNan(v) || double(f) == v) return f;
  const bool awayFromZero = (double(f) < 0 ? -double(f) : double(f)) > (v < 0 ? -v : v);
  std::uint32_t u = bitsOf(f);
  if (awayFromZero) u -= 1;  // one step toward zero: f is finite or ±inf, never ±0 here
  return floatFromBits(u | 1u);
}
TPSIM_HD inline float toOddFloat(float v) { return v; }

// ---- E4M3 and E8M0 (MXFP8) ----------------------------------------------------------------------

// E4M3FN, rounded to nearest even, saturating at ±448 (CUDA's __NV_SATFINITE); NaN -> 0x7F/0xFF.
TPSIM_HD inline std::uint8_t toE4m3(double v) {
  const std::uint64_t u = bitsOf(v);
  const std::uint8_t sign = (u >> 63) ? 0x80 : 0x00;
  if (isNan(v)) return sign | 0x7f;
  const std::uint64_t abs = u & 0x7fffffffffffffffull;
  if (abs >= 0x407c000000000000ull) return sign | 0x7e;  // >= 448 or infinite: saturate
  if (abs < 0x3f90000000000000ull) {                     // below 2^-6: subnormal unit 2^-9
    // a·512 < 8 is exact; adding and removing 2^52 rounds it to an integer, nearest even.
    const double scaled = mul(doubleFromBits(abs), 512.0);
    return sign | std::uint8_t(add(add(scaled, 0x1p52), -0x1p52));
  }
  const int exponent = int(abs >> 52) - 1023;                  // in [-6, 8]
  const std::uint64_t mant = abs & 0xfffffffffffffull;         // 52 bits
  std::uint64_t q = mant >> 49;                                // top 3 bits
  const std::uint64_t rest = mant & ((1ull << 49) - 1), half = 1ull << 48;
  if (rest > half || (rest == half && (q & 1))) ++q;           // a carry into the exponent is right
  return sign | std::uint8_t(((exponent + 7) << 3) + int(q));  // < 448 never reaches 0x7F
}

TPSIM_HD inline float e4m3ToFloat(std::uint8_t bits) {
  const int exp = (bits >> 3) & 0xf, mant = bits & 0x7;
  if (exp == 0xf && mant == 0x7) return floatFromBits(0x7fc00000u);  // NaN
  // (8 + mant)·2^(exp-10), or mant·2^-9 for subnormals: small integers times powers of two, exact.
  const float magnitude = exp == 0 ? mul(float(mant), 0x1p-9f)
                                   : float(mul(double(8 + mant), pow2(exp - 10)));
  return (bits & 0x80) ? -magnitude : magnitude;
}

// 2^(bits - 127); 0xFF is NaN. 2^-127 is a float subnormal.
TPSIM_HD inline float e8m0ToFloat(std::uint8_t bits) {
  if (bits == 0xff) return floatFromBits(0x7fc00000u);
  if (bits == 0) return floatFromBits(0x00400000u);
  return floatFromBits(std::uint32_t(bits) << 23);
}

// The E8M0 exponent of an MXFP8 block whose largest magnitude is amax (Transformer Engine's rule,
// computed exactly): the least e in [-127, 127] with amax <= 448·2^e. -127 for 0; 127 for infinity.
TPSIM_HD inline int mxfp8ScaleExponent(double amax) {
  const std::uint64_t abs = bitsOf(amax) & 0x7fffffffffffffffull;
  const int biased = int(abs >> 52);
  if (biased == 0) return -127;      // zero or a double subnormal: far below 448·2^-127
  if (biased == 0x7ff) return 127;   // infinity (NaN blocks never get here)
  // amax = f·2^k with f in [0.5, 1) and 448 = 0.875·2^9: e = k - 9, or k - 8 when f > 0.875.
  const int k = biased - 1022;
  const bool above = (abs & 0xfffffffffffffull) > (3ull << 50);  // f > 0.875 <=> mantissa > 0.75
  const int e = k - 9 + (above ? 1 : 0);
  return e < -127 ? -127 : (e > 127 ? 127 : e);
}

// x / 2^e: the element of an MXFP8 block with scale exponent e, before E4M3 rounding. Exact but
// for fp64 quotients below 2^-1022, rounded once there, far below E4M3's smallest value.
TPSIM_HD inline double unscale(double x, int e) { return mul(x, pow2(-e)); }

// ---- Element bodies of the Compute ops (compute.h), in the accumulation type T ------------------

template <typename T> TPSIM_HD inline T axpyBody(T y, T alpha, T x) { return add(y, mul(alpha, x)); }
template <typename T> TPSIM_HD inline T scaleBody(T y, T alpha) { return mul(alpha, y); }
template <typename T> TPSIM_HD inline T addBiasBody(T y, T bias) { return add(y, bias); }
// One step of sumRows' running sum (rows in increasing order), and its final beta·out term.
template <typename T> TPSIM_HD inline T sumRowsStep(T acc, T y) { return add(acc, y); }
template <typename T> TPSIM_HD inline T sumRowsFinish(T acc, T beta, T out) {
  return beta != T(0) ? add(acc, mul(beta, out)) : acc;
}
// One step of a collective's rank-order sum, and kMean's single division by the group size.
template <typename T> TPSIM_HD inline T reduceStep(T acc, T x) { return add(acc, x); }
template <typename T> TPSIM_HD inline T meanFinish(T sum, T n) { return div(sum, n); }

}  // namespace tpsim::elem
