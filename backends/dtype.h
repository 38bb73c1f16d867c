// Element types and the scalar conversions every backend and tool agrees on.
//
// fp32, bf16, fp16 and fp64 are floating types; int64 holds token ids. 16-bit values are stored as
// raw uint16_t bit patterns; the conversions round to nearest even (as torch .to() and CUDA's
// __float2bfloat16_rn / __float2half_rn do). This header is not a math library: backends widen
// 16-bit data to fp32 for arithmetic and round once when they store.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

namespace tpsim {

enum class DType : std::uint8_t { kFloat32, kBFloat16, kFloat16, kFloat64, kInt64 };

std::size_t dtypeSize(DType dtype);
const char* dtypeName(DType dtype);                 // "fp32", "bf16", "fp16", "fp64", "int64"
DType parseDType(const std::string& name);          // inverse of dtypeName; throws InvalidArgument
inline bool isFloating(DType dtype) { return dtype != DType::kInt64; }
inline bool is16Bit(DType dtype) { return dtype == DType::kBFloat16 || dtype == DType::kFloat16; }

inline float bf16ToFloat(std::uint16_t bits) {
  std::uint32_t u = std::uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline std::uint16_t floatToBf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return std::uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);                                               // nearest even
  return std::uint16_t(u >> 16);
}

float halfToFloat(std::uint16_t bits);
std::uint16_t floatToHalf(float f);

// One element at `p` of `dtype`, widened to double (exact for every dtype but int64 beyond 2^53).
double loadAsDouble(DType dtype, const void* p);
// Stores v into one element at `p` of `dtype`, rounded once (to nearest even; int64 truncates).
void storeFromDouble(DType dtype, double v, void* p);

// Rounds a float to the nearest value representable in `dtype` (identity for fp32 and wider).
inline float roundTo(DType dtype, float f) {
  if (dtype == DType::kBFloat16) return bf16ToFloat(floatToBf16(f));
  if (dtype == DType::kFloat16) return halfToFloat(floatToHalf(f));
  return f;
}

}  // namespace tpsim
