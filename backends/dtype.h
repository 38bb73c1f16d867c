// Element types and the scalar conversions every backend and tool agrees on.
//
// fp32, bf16, fp16 and fp64 are floating types; int64 holds token ids. 16-bit values are stored as
// raw uint16_t bit patterns; the conversions round to nearest even (as torch .to() and CUDA's
// __float2bfloat16_rn / __float2half_rn do). fp8e4m3 and e8m0 are the storage types of MXFP8
// (OCP microscaling) weights: data and block scales, one byte each, never arithmetic operands.
// This header is not a math library: backends widen 16-bit data to fp32 for arithmetic and round
// once when they store.
#pragma once

#include <cstdint>
#include <string>

#include "backends/element_math.h"

namespace tpsim {

// kFloat8E4M3: OCP E4M3FN, bias 7, max ±448, subnormals down to 2^-9, no infinity, NaN = 0x7F/0xFF.
// kFloat8E8M0: an unsigned power of two 2^(bits - 127), bits 0..254; 0xFF is NaN.
enum class DType : std::uint8_t { kFloat32, kBFloat16, kFloat16, kFloat64, kInt64, kFloat8E4M3, kFloat8E8M0 };

std::size_t dtypeSize(DType dtype);
// "fp32", "bf16", "fp16", "fp64", "int64", "fp8e4m3", "e8m0"
const char* dtypeName(DType dtype);
DType parseDType(const std::string& name);          // inverse of dtypeName; throws InvalidArgument
inline bool isFloat8(DType dtype) { return dtype == DType::kFloat8E4M3 || dtype == DType::kFloat8E8M0; }
// The arithmetic floating types: operands of gemm and the elementwise ops. The fp8 types hold real
// values too but are storage only (quantize/dequantize, copy, collectives that move bytes).
inline bool isFloating(DType dtype) { return dtype != DType::kInt64 && !isFloat8(dtype); }
inline bool is16Bit(DType dtype) { return dtype == DType::kBFloat16 || dtype == DType::kFloat16; }

// The scalar conversions are element_math.h's, so that the GPU kernels compute the same bits.
using elem::bf16ToFloat;
using elem::floatToBf16;
using elem::floatToHalf;
using elem::halfToFloat;

// E4M3FN. The conversion takes a double so fp64 sources round once; it rounds to nearest even and
// saturates: every finite or infinite magnitude above 448 becomes ±448 (CUDA's __NV_SATFINITE).
// NaN stays NaN (0x7F, or 0xFF when negative).
using elem::e4m3ToFloat;
using elem::toE4m3;

// E8M0: exact powers of two only. toE8m0 maps NaN to 0xFF and throws InvalidArgument for any other
// value that is not 2^e with e in [-127, 127] (no rounding: a scale is chosen, never approximated).
using elem::e8m0ToFloat;
std::uint8_t toE8m0(double v);

// The E8M0 exponent of an MXFP8 block whose largest magnitude is amax (Transformer Engine's rule,
// computed exactly): the least e in [-127, 127] with amax <= 448·2^e, so no element saturates.
// -127 for amax = 0; infinity gives 127. amax must not be NaN (a NaN block has the NaN scale).
using elem::mxfp8ScaleExponent;

// One element at `p` of `dtype`, widened to double (exact for every dtype but int64 beyond 2^53).
double loadAsDouble(DType dtype, const void* p);
// Stores v into one element at `p` of `dtype`, rounded once (to nearest even; int64 truncates;
// fp8e4m3 saturates; e8m0 accepts exact powers of two only).
void storeFromDouble(DType dtype, double v, void* p);

// Rounds a float to the nearest value representable in `dtype` (identity for fp32 and wider).
inline float roundTo(DType dtype, float f) {
  if (dtype == DType::kBFloat16) return bf16ToFloat(floatToBf16(f));
  if (dtype == DType::kFloat16) return halfToFloat(floatToHalf(f));
  return f;
}

}  // namespace tpsim
