// GeLU's dense fp32 loops on AVX-512 or AVX2, with the bits of the scalar loops that call libm.
//
// SimCompute's GeLU is defined by glibc's erff and expf (erf and exp of float). These loops are
// those two functions ported to 16 or 8 lanes operation for operation (Debian 12's glibc 2.36: the
// fdlibm erff, built without FMA, and the expf that glibc picks on cores with FMA), so each lane
// rounds exactly as the scalar call does; lanes outside the ported ranges (NaN, infinities, |x|
// below 2^-28, exp arguments of magnitude 88 or more) call libm itself. Not a math library: only
// the two formulas of SimCompute::gelu and geluBackward.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>

namespace tpsim::sim {

constexpr float kGeluSqrtHalf = float(0.70710678118654752440);    // 1/√2
constexpr float kGeluInvSqrt2Pi = float(0.39894228040143267794);  // 1/√(2π)

// SimCompute's fp32 formulas for one element, which the loops below reproduce: Φ(x) and φ(x) as
// PyTorch writes them, erf of x·(1/√2), not x/√2.
inline float geluOf(float v) { return v * 0.5f * (1.f + std::erf(v * kGeluSqrtHalf)); }
inline float geluBackwardOf(float v, float dy) {
  const float cdf = 0.5f * (1.f + std::erf(v * kGeluSqrtHalf));
  const float pdf = std::exp(-0.5f * v * v) * kGeluInvSqrt2Pi;
  return dy * (cdf + v * pdf);
}

// The vector loops' instruction sets: 16 lanes of AVX-512, or 8 of AVX2 with FMA.
enum class GeluIsa { kAvx512, kAvx2 };
const char* geluIsaName(GeluIsa isa);
bool geluIsaRuns(GeluIsa isa);

// The widest instruction set this core runs whose loops give this process's libm's bits on a probe
// of every branch of both functions (another libm may round differently); nullopt where none does,
// and callers keep the scalar loop. Decided once per process.
std::optional<GeluIsa> vectorGeluIsa();

// y[i] = x[i]·0.5·(1 + erf(x[i]·(1/√2))) for i < n, in float, as SimCompute::gelu. Requires
// geluIsaRuns(isa).
void vectorGelu(GeluIsa isa, const float* x, float* y, std::int64_t n);

// dx[i] = dy[i]·(Φ + x[i]·φ), Φ = 0.5·(1 + erf(x[i]·(1/√2))), φ = exp(-0.5·x[i]·x[i])·(1/√(2π)), as
// SimCompute::geluBackward. Requires geluIsaRuns(isa).
void vectorGeluBackward(GeluIsa isa, const float* x, const float* dy, float* dx, std::int64_t n);

// The probe behind vectorGeluIsa(): whether isa's loops give the bits of `gelu` and `backward`
// (there geluOf and geluBackwardOf) on inputs through every branch of both functions. Requires
// geluIsaRuns(isa).
bool vectorGeluMatches(GeluIsa isa, float (*gelu)(float), float (*backward)(float, float));

}  // namespace tpsim::sim
