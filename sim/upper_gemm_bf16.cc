#include "sim/upper_gemm_bf16.h"

#include "sim/gemm_driver.h"

namespace tpsim::sim {
namespace {

using namespace gemm_driver;

#if defined(__x86_64__)
// 14 x 32 as sgemm's AVX-512 kernel, one vdpbf16ps a pair of K steps. Each pair adds its odd
// product, then its even one, each an FMA rounded to nearest, a result below 2^-126 flushed to
// zero, subnormal inputs read as zero (Intel SDM, VDPBF16PS; AMD's is the same).
__attribute__((target("avx512f,avx512bf16"))) void microAvx512Bf16(std::int64_t kc, const std::uint32_t* a,
                                                                   const std::uint32_t* b, float* c,
                                                                   std::int64_t ldc, float alpha, float beta) {
  __m512 acc[kMr512][2];
  startTile512(acc, c, ldc);
  for (std::int64_t p = 0; p < kc; ++p, a += kMr512, b += kNr512) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b), b1 = (__m512bh)_mm512_loadu_si512(b + 16);
#pragma GCC unroll 14
    for (int i = 0; i < kMr512; ++i) {
      const __m512bh ai = (__m512bh)_mm512_set1_epi32(int(a[i]));
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], ai, b0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], ai, b1);
    }
  }
  finishTile512(acc, c, ldc, alpha, beta);
}

// Each of 16 floats rounded toward +Inf to bf16, in the low half of its 32-bit lane: a positive
// value below bf16's smallest normal goes up to it (the kernel reads subnormal inputs as zero),
// FLT_MAX to Inf, NaN stays NaN.
__attribute__((target("avx512f"))) __m512i bf16Up(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x), zero = _mm512_setzero_si512();
  const __mmask16 positive = _mm512_cmpge_epi32_mask(bits, zero);
  const __mmask16 inexact = _mm512_test_epi32_mask(bits, _mm512_set1_epi32(0xffff));
  // Shifts and narrowing in maskz forms: GCC 12 warns of an uninitialized value in the plain ones.
  const __m512i up = _mm512_mask_add_epi32(bits, positive & inexact, bits, _mm512_set1_epi32(0x10000));
  __m512i h = _mm512_maskz_srli_epi32(0xffff, up, 16);
  const __mmask16 subnormal =
      positive & _mm512_cmpgt_epi32_mask(h, zero) & _mm512_cmplt_epi32_mask(h, _mm512_set1_epi32(0x80));
  h = _mm512_mask_mov_epi32(h, subnormal, _mm512_set1_epi32(0x80));
  return _mm512_mask_mov_epi32(h, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
}

// The bf16 kernel's PackFn: step p of a line holds its values 2p (low half) and 2p + 1 (high
// half), each rounded by bf16Up; a value past kc is zero. w <= 32.
__attribute__((target("avx512f"))) void packPairPanels(const float* src, std::int64_t across, std::int64_t along,
                                                       std::int64_t count, std::int64_t kc, int w,
                                                       std::uint32_t* dst) {
  const std::int64_t steps = (kc + 1) / 2;
  auto mask = [](std::int64_t n) { return __mmask16(n >= 16 ? 0xffff : n <= 0 ? 0 : (1u << n) - 1); };
  for (std::int64_t s = 0; s < count; s += w, dst += w * steps) {
    const std::int64_t lines = std::min<std::int64_t>(w, count - s);
    const float* first = src + s * across;
    if (across == 1) {  // the lines sit side by side: 16 lines a vector, both values of a step
      for (std::int64_t p = 0; p < steps; ++p) {
        const float* even = first + 2 * p * along;
        const bool odd = 2 * p + 1 < kc;
        for (int l = 0; l < w; l += 16) {
          const __mmask16 in = mask(lines - l);
          const __m512i lo = bf16Up(_mm512_maskz_loadu_ps(in, even + l));
          const __m512i hi = odd ? bf16Up(_mm512_maskz_loadu_ps(in, even + along + l)) : _mm512_setzero_si512();
          const __m512i pair = _mm512_or_si512(lo, _mm512_maskz_slli_epi32(0xffff, hi, 16));
          _mm512_mask_storeu_epi32(dst + p * w + l, mask(w - l), pair);
        }
      }
      continue;
    }
    // Line by line, 16 values (8 steps) a vector, their pairs narrowed into 8 words.
    alignas(64) float values[16];
    alignas(32) std::uint32_t pairs[8];
    for (std::int64_t i = 0; i < w; ++i) {
      const float* from = first + i * across;
      for (std::int64_t p0 = 0; p0 < steps; p0 += 8) {
        const std::int64_t n = i < lines ? std::min<std::int64_t>(16, kc - 2 * p0) : 0;
        __m512 v;
        if (along == 1) {
          v = _mm512_maskz_loadu_ps(mask(n), from + 2 * p0);
        } else {
          for (std::int64_t q = 0; q < 16; ++q) values[q] = q < n ? from[(2 * p0 + q) * along] : 0.f;
          v = _mm512_load_ps(values);
        }
        _mm256_store_si256(reinterpret_cast<__m256i*>(pairs), _mm512_maskz_cvtepi32_epi16(0xffff, bf16Up(v)));
        for (std::int64_t q = 0; q < std::min<std::int64_t>(8, steps - p0); ++q) dst[(p0 + q) * w + i] = pairs[q];
      }
    }
  }
}
#endif

Kernel<float, std::uint32_t> kernelFor(GemmKernel kernel) {
  TPSIM_INTERNAL_ASSERT(kernel == GemmKernel::kAvx512 && upperGemmBf16Runs(), "gemm: no bf16 kernel here");
#if defined(__x86_64__)
  return {kMr512, kNr512, microAvx512Bf16, packPairPanels};
#else
  return {};
#endif
}

}  // namespace

bool upperGemmBf16Runs() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

void upperGemmBf16(std::int64_t m, std::int64_t n, std::int64_t k, FloatMatrix a, FloatMatrix b, float* c,
                   std::int64_t cRowStride, HostPool* pool) {
  gemm_driver::packedGemm(GemmKernel::kAvx512, kernelFor, m, n, k, 1.f, a, b, 0.f, c, cRowStride, 1, pool);
}

}  // namespace tpsim::sim
