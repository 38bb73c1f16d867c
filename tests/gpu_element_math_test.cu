// Host checks of the gpu backend's element math, compiled by nvcc and run without a GPU.
//
// 1. tpsim::elem's conversions (backends/element_math.h) against CUDA's own host implementations
//    in cuda_bf16.h, cuda_fp16.h and cuda_fp8.h: every bf16, fp16, E4M3 and E8M0 pattern, and
//    float/double inputs at every rounding boundary (ties and their neighbours, for every exponent).
// 2. Every elementwise op of gpu/kernels.cuh, run on the host through the kern::run* dispatch
//    GpuCompute uses, against SimCompute on random data for every dtype combination: bitwise.
// NaN results compare as NaN: CUDA's conversions return a canonical NaN, elem keeps the sign.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <vector>

#include "backends/element_math.h"
#include "gpu/kernels.cuh"
#include "sim/sim_compute.h"
#include "tests/gpu_test_util.h"

namespace tpsim::gpu {
namespace {

using gputest::kInf;

// ---- CUDA's host conversions, on raw bits ------------------------------------------------------

std::uint16_t cudaFloatToBf16(float f) { return __nv_bfloat16_raw(__float2bfloat16_rn(f)).x; }
float cudaBf16ToFloat(std::uint16_t bits) {
  __nv_bfloat16_raw r;
  r.x = bits;
  return __bfloat162float(__nv_bfloat16(r));
}
std::uint16_t cudaFloatToHalf(float f) { return __half_raw(__float2half_rn(f)).x; }
float cudaHalfToFloat(std::uint16_t bits) {
  __half_raw r;
  r.x = bits;
  return __half2float(__half(r));
}
std::uint16_t cudaDoubleToBf16(double d) { return __nv_bfloat16_raw(__double2bfloat16(d)).x; }
std::uint16_t cudaDoubleToHalf(double d) { return __half_raw(__double2half(d)).x; }
std::uint8_t cudaDoubleToE4m3(double d) { return __nv_cvt_double_to_fp8(d, __NV_SATFINITE, __NV_E4M3); }
float cudaE4m3ToFloat(std::uint8_t code) { return cudaHalfToFloat(__nv_cvt_fp8_to_halfraw(code, __NV_E4M3).x); }
float cudaE8m0ToFloat(std::uint8_t code) { return cudaBf16ToFloat(__nv_cvt_e8m0_to_bf16raw(code).x); }
std::uint8_t cudaDoubleToE8m0(double d) { return __nv_cvt_double_to_e8m0(d, __NV_SATFINITE, cudaRoundZero); }

float floatOf(std::uint32_t u) { return elem::floatFromBits(u); }

bool sameFloat(float a, float b) { return elem::bitsOf(a) == elem::bitsOf(b) || (elem::isNan(a) && elem::isNan(b)); }
bool sameBf16(std::uint16_t a, std::uint16_t b) { return a == b || ((a & 0x7fff) > 0x7f80 && (b & 0x7fff) > 0x7f80); }
bool sameHalf(std::uint16_t a, std::uint16_t b) { return a == b || ((a & 0x7fff) > 0x7c00 && (b & 0x7fff) > 0x7c00); }
bool sameE4m3(std::uint8_t a, std::uint8_t b) { return a == b || ((a & 0x7f) == 0x7f && (b & 0x7f) == 0x7f); }

// Counts checks and mismatches, keeping the first mismatch's description.
struct Tally {
  std::int64_t checked = 0, bad = 0;
  std::string first;
  void check(bool ok, const std::function<std::string()>& describe) {
    ++checked;
    if (!ok && bad++ == 0) first = describe();
  }
};
#define EXPECT_CLEAN(tally, minChecked)                                                    \
  do {                                                                                     \
    EXPECT_EQ((tally).bad, 0) << (tally).bad << " of " << (tally).checked                  \
                              << " differ; first: " << (tally).first;                      \
    EXPECT_GE((tally).checked, (minChecked)) << "the sample is smaller than it should be"; \
  } while (0)

std::string hex(std::uint64_t u) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(u));
  return buf;
}
// "<input kind> <bits>: elem <bits>, CUDA <bits>"
std::string mismatch(const char* input, std::uint64_t in, std::uint64_t ours, std::uint64_t cuda) {
  return std::string(input) + " " + hex(in) + ": elem " + hex(ours) + ", CUDA " + hex(cuda);
}

// Every float whose low 16 bits are one of the patterns that decide bf16 and fp16 rounding (a
// tie, just below and just above it, for both parities of the last kept bit), with every high
// half: all signs, exponents and leading mantissa bits. Then 2^22 random floats.
void forEachRoundingFloat(const std::function<void(float)>& fn) {
  for (std::uint32_t hi = 0; hi < 0x10000; ++hi)
    for (std::uint32_t top = 0; top < 8; ++top)  // bits 13..15: fp16's last kept bit and above
      for (std::uint32_t tail : {0x0u, 0x1u, 0x2u, 0x7ffu, 0x800u, 0x801u, 0xfffu, 0x1000u, 0x1001u, 0x1ffeu, 0x1fffu})
        fn(floatOf(hi << 16 | top << 13 | tail));
  std::mt19937 rng(42);
  for (int i = 0; i < (1 << 22); ++i) fn(floatOf(std::uint32_t(rng())));
}

// For consecutive finite values lo < hi of a format: the doubles where rounding decides, the
// midpoint and its neighbours, points a tiny fraction of the spacing away, and lo itself.
std::vector<double> roundingDoubles(double lo, double hi) {
  const double mid = lo + (hi - lo) / 2, gap = hi - lo;
  return {lo,
          mid,
          std::nextafter(mid, 0.0),
          std::nextafter(mid, kInf),
          mid - gap * 0x1p-30,
          mid + gap * 0x1p-30,
          lo + gap * 0x1p-40};
}

// ---- Conversions ----------------------------------------------------------------------------------

TEST(GpuElementMath, Bf16ToFloatMatchesCudaForEveryPattern) {
  Tally t;
  for (std::uint32_t b = 0; b < 0x10000; ++b) {
    const float a = elem::bf16ToFloat(std::uint16_t(b)), c = cudaBf16ToFloat(std::uint16_t(b));
    t.check(sameFloat(a, c), [&] { return mismatch("bf16", b, elem::bitsOf(a), elem::bitsOf(c)); });
  }
  EXPECT_CLEAN(t, 0x10000);
}

TEST(GpuElementMath, FloatToBf16MatchesCudaAtEveryRoundingBoundary) {
  Tally t;
  forEachRoundingFloat([&](float f) {
    const std::uint16_t a = elem::floatToBf16(f), c = cudaFloatToBf16(f);
    t.check(sameBf16(a, c), [&] { return mismatch("float", elem::bitsOf(f), a, c); });
  });
  EXPECT_CLEAN(t, 5000000);
}

TEST(GpuElementMath, HalfToFloatMatchesCudaForEveryPattern) {
  Tally t;
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const float a = elem::halfToFloat(std::uint16_t(h)), c = cudaHalfToFloat(std::uint16_t(h));
    t.check(sameFloat(a, c), [&] { return mismatch("fp16", h, elem::bitsOf(a), elem::bitsOf(c)); });
  }
  EXPECT_CLEAN(t, 0x10000);
}

TEST(GpuElementMath, FloatToHalfMatchesCudaAtEveryRoundingBoundary) {
  Tally t;
  forEachRoundingFloat([&](float f) {
    const std::uint16_t a = elem::floatToHalf(f), c = cudaFloatToHalf(f);
    t.check(sameHalf(a, c), [&] { return mismatch("float", elem::bitsOf(f), a, c); });
  });
  EXPECT_CLEAN(t, 5000000);
}

// fp64 -> 16 bits through toOddFloat rounds once: it must match CUDA's direct conversions at every
// midpoint, where a nearest-even float in between would round twice.
TEST(GpuElementMath, DoubleTo16BitRoundsOnceAsCuda) {
  Tally bf, half;
  auto checkBoth = [&](double d) {
    for (double v : {d, -d}) {
      const std::uint16_t a = elem::floatToBf16(elem::toOddFloat(v)), c = cudaDoubleToBf16(v);
      bf.check(sameBf16(a, c), [&] { return mismatch("double", elem::bitsOf(v), a, c); });
      const std::uint16_t ah = elem::floatToHalf(elem::toOddFloat(v)), ch = cudaDoubleToHalf(v);
      half.check(sameHalf(ah, ch), [&] { return mismatch("double", elem::bitsOf(v), ah, ch); });
    }
  };
  for (std::uint32_t p = 0; p < 0x7f7f; ++p)  // bf16: every pair of consecutive finite values
    for (double d : roundingDoubles(elem::bf16ToFloat(std::uint16_t(p)), elem::bf16ToFloat(std::uint16_t(p + 1))))
      checkBoth(d);
  for (std::uint32_t p = 0; p < 0x7bff; ++p)  // fp16
    for (double d : roundingDoubles(elem::halfToFloat(std::uint16_t(p)), elem::halfToFloat(std::uint16_t(p + 1))))
      checkBoth(d);
  // The overflow boundaries (max + half a spacing), below the float range, and specials.
  const double bfMax = elem::bf16ToFloat(0x7f7f), bfGap = bfMax - elem::bf16ToFloat(0x7f7e);
  for (double d : roundingDoubles(bfMax, bfMax + bfGap)) checkBoth(d);
  for (double d : roundingDoubles(65504.0, 65536.0)) checkBoth(d);
  for (double d : {1e-50, 1e-300, 4.9e-324, 1e39, 1e300, kInf, std::numeric_limits<double>::quiet_NaN()}) checkBoth(d);
  std::mt19937_64 rng(7);
  for (int i = 0; i < (1 << 20); ++i) checkBoth(std::ldexp(std::uniform_real_distribution<double>(1, 2)(rng),
                                                           std::uniform_int_distribution<int>(-140, 130)(rng)));
  EXPECT_CLEAN(bf, 400000);
  EXPECT_CLEAN(half, 400000);
}

TEST(GpuElementMath, E4m3ToFloatMatchesCudaForEveryCode) {
  Tally t;
  for (std::uint32_t code = 0; code < 256; ++code) {
    const float a = elem::e4m3ToFloat(std::uint8_t(code)), c = cudaE4m3ToFloat(std::uint8_t(code));
    t.check(sameFloat(a, c), [&] { return mismatch("E4M3", code, elem::bitsOf(a), elem::bitsOf(c)); });
  }
  EXPECT_CLEAN(t, 256);
}

TEST(GpuElementMath, ToE4m3MatchesCudaAtEveryRoundingBoundary) {
  Tally t;
  auto check = [&](double d) {
    for (double v : {d, -d}) {
      const std::uint8_t a = elem::toE4m3(v), c = cudaDoubleToE4m3(v);
      t.check(sameE4m3(a, c), [&] { return mismatch("double", elem::bitsOf(v), a, c); });
    }
  };
  for (std::uint32_t code = 0; code < 0x7e; ++code)  // every pair of consecutive finite codes
    for (double d : roundingDoubles(elem::e4m3ToFloat(std::uint8_t(code)), elem::e4m3ToFloat(std::uint8_t(code + 1))))
      check(d);
  // Saturation above 448, underflow below 2^-10, and specials.
  for (double d : {448.0, std::nextafter(448.0, 1e9), 464.0, 480.0, 1e5, 1e300, kInf, 0x1p-10,
                   std::nextafter(0x1p-10, 1.0), 1e-300, 4.9e-324, std::numeric_limits<double>::quiet_NaN()})
    check(d);
  std::mt19937_64 rng(8);
  for (int i = 0; i < (1 << 20); ++i) check(std::ldexp(std::uniform_real_distribution<double>(1, 2)(rng),
                                                       std::uniform_int_distribution<int>(-14, 10)(rng)));
  EXPECT_CLEAN(t, 2000000);
}

TEST(GpuElementMath, E8m0ToFloatMatchesCudaForEveryCode) {
  Tally t;
  for (std::uint32_t code = 0; code < 256; ++code) {
    const float a = elem::e8m0ToFloat(std::uint8_t(code)), c = cudaE8m0ToFloat(std::uint8_t(code));
    t.check(sameFloat(a, c), [&] { return mismatch("E8M0", code, elem::bitsOf(a), elem::bitsOf(c)); });
  }
  EXPECT_CLEAN(t, 256);
}

// A store into e8m0 takes exactly the powers of two 2^e, e in [-127, 127], and NaN: as dtype.h's
// toE8m0 (which throws for the rest) and with CUDA's codes.
TEST(GpuElementMath, E8m0StoreTakesExactlyThePowersOfTwo) {
  for (int e = -140; e <= 140; ++e) {
    const double v = std::ldexp(1.0, e);
    const int code = kern::e8m0Code(v);
    if (e >= -127 && e <= 127) {
      EXPECT_EQ(code, e + 127) << "2^" << e;
      EXPECT_EQ(code, int(cudaDoubleToE8m0(v))) << "2^" << e;
      EXPECT_EQ(code, int(toE8m0(v))) << "2^" << e;
    } else {
      EXPECT_EQ(code, -1) << "2^" << e;
      EXPECT_THROW(toE8m0(v), InvalidArgument) << "2^" << e;
    }
  }
  for (double v : {3.0, 0.75, 1.5 * 0x1p-127, -2.0, -0.5, 0.0, -0.0, kInf, -kInf, 4.9e-324}) {
    EXPECT_EQ(kern::e8m0Code(v), -1) << v;
    EXPECT_THROW(toE8m0(v), InvalidArgument) << v;
  }
  const double nan = std::numeric_limits<double>::quiet_NaN();
  EXPECT_EQ(kern::e8m0Code(nan), 0xff);
  EXPECT_EQ(toE8m0(nan), 0xff);
  EXPECT_EQ(cudaDoubleToE8m0(nan), 0xff);
}

// int64 stores take [-2^63, 2^63), in the arithmetic type the value arrives in, as SimCompute's.
TEST(GpuElementMath, Int64StoreRangeMatchesSimCompute) {
  sim::SimCompute sim;
  Tensor t = sim.empty(Shape{1}, DType::kInt64);
  const double below = std::nextafter(-0x1p63, -kInf), top = std::nextafter(0x1p63, 0.0);
  for (double v : {0.0, -0.5, 1e18, top, 0x1p63, -0x1p63, below, kInf, -kInf,
                   std::numeric_limits<double>::quiet_NaN()}) {
    bool simTakes = true;
    try {
      sim.fill(t, v);
    } catch (const InvalidArgument&) {
      simTakes = false;
    }
    EXPECT_EQ(kern::storable(v, DType::kInt64), simTakes) << v;
  }
  EXPECT_TRUE(kern::storable(std::nextafter(0x1p63f, 0.f), DType::kInt64));
  EXPECT_FALSE(kern::storable(0x1p63f, DType::kInt64));
  EXPECT_TRUE(kern::storable(-0x1p63f, DType::kInt64));
}

TEST(GpuElementMath, Mxfp8ScaleExponentMatchesDtype) {
  Tally t;
  auto check = [&](double amax) {
    const int a = elem::mxfp8ScaleExponent(amax), d = mxfp8ScaleExponent(amax);
    t.check(a == d, [&] {
      return "amax " + hex(elem::bitsOf(amax)) + ": elem " + std::to_string(a) + ", dtype.h " + std::to_string(d);
    });
  };
  for (int e = -1074; e <= 1023; ++e)
    for (double f : {1.0, 1.75 - 0x1p-52, 1.75, 1.75 + 0x1p-52, 2.0 - 0x1p-52}) check(std::ldexp(f, e));
  for (double v : {0.0, kInf, 448.0, 448.0 * 0x1p-127, 448.0 * 0x1p127}) check(v);
  EXPECT_CLEAN(t, 10000);
}

// ---- The kernels on the host, against SimCompute -------------------------------------------------

// The kernels.cuh functors, run on the host through the kern::run* dispatch GpuCompute uses: a
// Compute whose elementwise ops compute what GpuCompute's kernels compute. Memory is SimCompute's;
// arguments are not checked (SimCompute's twin call checks them). gemm is cuBLASLt's, not here.
class HostKernels final : public Compute {
 public:
  Device device() const override { return Device::kHost; }
  Tensor empty(Shape shape, DType dtype) override { return sim_.empty(shape, dtype); }
  void upload(const void* host, View dst) override { sim_.upload(host, dst); }
  void download(ConstView src, void* host) override { sim_.download(src, host); }

  void fill(View y, double value) override { kern::runFill(onHost, y, value); }
  void copy(ConstView x, View y) override { kern::runCopy(onHost, x, y); }
  void axpy(float alpha, ConstView x, View y) override { kern::runAxpy(onHost, alpha, x, y); }
  void scale(View y, float alpha) override { kern::runScale(onHost, y, alpha); }
  void gemm(ConstView, ConstView, View, float, float) override {
    throw InternalError("HostKernels: gemm runs on cuBLASLt, not in kernels.cuh");
  }
  void addBias(ConstView bias, View y) override { kern::runAddBias(onHost, bias, y); }
  void sumRows(ConstView y, View out, float beta) override { kern::runSumRows(onHost, y, out, beta); }
  void gelu(ConstView x, View y) override { kern::runGelu(onHost, x, y); }
  void geluBackward(ConstView x, ConstView dy, View dx) override { kern::runGeluBackward(onHost, x, dy, dx); }
  void quantizeMxfp8(ConstView x, View data, View scales, int axis) override {
    kern::runQuantizeMxfp8(onHost, x, data, scales, axis);
  }
  void dequantizeMxfp8(ConstView data, ConstView scales, int axis, View y) override {
    kern::runDequantizeMxfp8(onHost, data, scales, axis, y);
  }
  void gatherRows(ConstView table, ConstView ids, std::int64_t first, View out) override {
    const std::vector<std::int64_t> flat = flatIds(ids);  // (n)
    kern::runGatherRows(onHost, table, flat.data(), first, out);
  }
  void scatterAddRows(ConstView grad, ConstView ids, std::int64_t first, View table) override {
    const kern::ScatterPlan plan = kern::planScatter(flatIds(ids), first, table.dim(0));
    kern::runScatterAddRows(onHost, grad, plan, plan.buffer.data(), table);
  }

 private:
  static constexpr auto onHost = [](const char*, const auto& fn) {
    for (std::int64_t i = 0, n = fn.count(); i < n; ++i) fn(i);
  };
  static std::vector<std::int64_t> flatIds(ConstView ids) {  // a vector of any stride
    std::vector<std::int64_t> flat(std::size_t(ids.numel()));
    for (std::int64_t i = 0; i < ids.numel(); ++i)
      flat[std::size_t(i)] = *static_cast<const std::int64_t*>(ids.at(i * ids.stride(0)));
    return flat;
  }
  sim::SimCompute sim_;
};

class GpuKernelsOnHost : public ::testing::Test {
 protected:
  sim::SimCompute sim_;
  HostKernels kernels_;
};

TEST_F(GpuKernelsOnHost, FillMatchesSimCompute) { gputest::checkFill(sim_, kernels_); }
TEST_F(GpuKernelsOnHost, CopyMatchesSimCompute) { gputest::checkCopy(sim_, kernels_); }
TEST_F(GpuKernelsOnHost, AxpyMatchesSimCompute) { gputest::checkAxpy(sim_, kernels_); }
TEST_F(GpuKernelsOnHost, ScaleMatchesSimCompute) { gputest::checkScale(sim_, kernels_); }
TEST_F(GpuKernelsOnHost, AddBiasMatchesSimCompute) { gputest::checkAddBias(sim_, kernels_); }
TEST_F(GpuKernelsOnHost, SumRowsMatchesSimCompute) { gputest::checkSumRows(sim_, kernels_); }
TEST_F(GpuKernelsOnHost, GeluMatchesSimCompute) { gputest::checkGelu(sim_, kernels_, /*bitwise=*/true); }
TEST_F(GpuKernelsOnHost, GeluBackwardMatchesSimCompute) { gputest::checkGeluBackward(sim_, kernels_, true); }
TEST_F(GpuKernelsOnHost, QuantizeMxfp8MatchesSimCompute) { gputest::checkQuantizeMxfp8(sim_, kernels_); }
TEST_F(GpuKernelsOnHost, DequantizeMxfp8MatchesSimCompute) { gputest::checkDequantizeMxfp8(sim_, kernels_); }
TEST_F(GpuKernelsOnHost, GatherRowsMatchesSimCompute) { gputest::checkGatherRows(sim_, kernels_); }
TEST_F(GpuKernelsOnHost, ScatterAddRowsMatchesSimCompute) { gputest::checkScatterAddRows(sim_, kernels_); }

// Repeated ids add in increasing i, one rounding per add: the plan lists every table row's grad
// rows in that order.
TEST(GpuKernels, ScatterPlanOrdersEachRowsAddsByIndex) {
  const kern::ScatterPlan plan = kern::planScatter({105, 3, 101, 105, 101, 99, 105}, 100, 6);
  // Owned: i=0 (row 5), 2 (1), 3 (5), 4 (1), 6 (5); ids 3 and 99 lie outside [100, 106).
  EXPECT_EQ(plan.owned, 5);
  EXPECT_EQ(plan.segments, 2);
  EXPECT_EQ(plan.buffer, (std::vector<std::int64_t>{2, 4, 0, 3, 6, /*segStart*/ 0, 2, 5, /*segRow*/ 1, 5}));
}

}  // namespace
}  // namespace tpsim::gpu
