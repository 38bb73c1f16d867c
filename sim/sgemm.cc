#include "sim/sgemm.h"

#include "sim/gemm_driver.h"

namespace tpsim::sim {
namespace {

using namespace gemm_driver;

#if defined(__x86_64__)
// 14 x 32 on the tile of gemm_driver.h.
__attribute__((target("avx512f"))) void microAvx512(std::int64_t kc, const float* a, const float* b, float* c,
                                                    std::int64_t ldc, float alpha, float beta) {
  __m512 acc[kMr512][2];
  startTile512(acc, c, ldc);
  for (std::int64_t p = 0; p < kc; ++p, a += kMr512, b += kNr512) {
    const __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16);
#pragma GCC unroll 14
    for (int i = 0; i < kMr512; ++i) {
      const __m512 ai = _mm512_set1_ps(a[i]);
      acc[i][0] = _mm512_fmadd_ps(ai, b0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(ai, b1, acc[i][1]);
    }
  }
  finishTile512(acc, c, ldc, alpha, beta);
}

// r[i][j] -> r[j][i] for a 16 x 16 block: unpacks pair rows, then 128-bit lanes change places.
__attribute__((target("avx512f"), always_inline)) inline void transpose16(__m512 (&r)[16]) {
  __m512 a[16], b[16];
#pragma GCC unroll 8
  for (int k = 0; k < 8; ++k) {
    a[2 * k] = _mm512_unpacklo_ps(r[2 * k], r[2 * k + 1]);
    a[2 * k + 1] = _mm512_unpackhi_ps(r[2 * k], r[2 * k + 1]);
  }
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {  // b[4k + c], 128-bit lane L: rows 4k..4k+3 of column 4L + c
    const __m512d lo0 = _mm512_castps_pd(a[4 * k]), lo1 = _mm512_castps_pd(a[4 * k + 2]);
    const __m512d hi0 = _mm512_castps_pd(a[4 * k + 1]), hi1 = _mm512_castps_pd(a[4 * k + 3]);
    b[4 * k] = _mm512_castpd_ps(_mm512_unpacklo_pd(lo0, lo1));
    b[4 * k + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(lo0, lo1));
    b[4 * k + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(hi0, hi1));
    b[4 * k + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(hi0, hi1));
  }
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {  // row 4L + c: lane L of b[c], b[4 + c], b[8 + c], b[12 + c]
    const __m512 x0 = _mm512_shuffle_f32x4(b[c], b[4 + c], 0x44), x1 = _mm512_shuffle_f32x4(b[c], b[4 + c], 0xee);
    const __m512 x2 = _mm512_shuffle_f32x4(b[8 + c], b[12 + c], 0x44);
    const __m512 x3 = _mm512_shuffle_f32x4(b[8 + c], b[12 + c], 0xee);
    r[c] = _mm512_shuffle_f32x4(x0, x2, 0x88);
    r[4 + c] = _mm512_shuffle_f32x4(x0, x2, 0xdd);
    r[8 + c] = _mm512_shuffle_f32x4(x1, x3, 0x88);
    r[12 + c] = _mm512_shuffle_f32x4(x1, x3, 0xdd);
  }
}

// packPanels<float> for lines that are stored contiguously (along == 1, the operands x and W of
// x·Wᵀ): 16 lines by 16 values at a time through a register transpose, where the element-wise
// copy cost about a tenth of a large product's time.
__attribute__((target("avx512f"))) void packPanelsAvx512(const float* src, std::int64_t across, std::int64_t along,
                                                         std::int64_t count, std::int64_t kc, int w, float* dst) {
  if (across == 1 || along != 1) return packPanels<float>(src, across, along, count, kc, w, dst);
  for (std::int64_t s = 0; s < count; s += w, dst += w * kc) {
    const std::int64_t lines = std::min<std::int64_t>(w, count - s);
    const float* first = src + s * across;
    for (int g = 0; g < w; g += 16) {  // panel columns [g, g + 16)
      const int used = std::min(16, w - g);
      const __mmask16 store = __mmask16((1u << used) - 1);
      std::int64_t p = 0;
      for (; p + 16 <= kc; p += 16) {
        __m512 r[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i)
          r[i] = g + i < lines ? _mm512_loadu_ps(first + (g + i) * across + p) : _mm512_setzero_ps();
        transpose16(r);
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) _mm512_mask_storeu_ps(dst + (p + j) * w + g, store, r[j]);
      }
      for (; p < kc; ++p)
        for (int i = 0; i < used; ++i) dst[p * w + g + i] = g + i < lines ? first[(g + i) * across + p] : 0.f;
    }
  }
}

// 6 x 16: 12 accumulators, two B vectors and a broadcast in the 16 registers.
constexpr int kMr256 = 6, kNr256 = 16;

__attribute__((target("avx2,fma"))) void microAvx2(std::int64_t kc, const float* a, const float* b, float* c,
                                                   std::int64_t ldc, float alpha, float beta) {
  __m256 acc[kMr256][2];
#pragma GCC unroll 6
  for (int i = 0; i < kMr256; ++i) {
    acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    _mm_prefetch(reinterpret_cast<const char*>(c + i * ldc), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(c + i * ldc + kNr256 - 1), _MM_HINT_T0);
  }
  for (std::int64_t p = 0; p < kc; ++p, a += kMr256, b += kNr256) {
    const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
#pragma GCC unroll 6
    for (int i = 0; i < kMr256; ++i) {
      const __m256 ai = _mm256_broadcast_ss(a + i);
      acc[i][0] = _mm256_fmadd_ps(ai, b0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(ai, b1, acc[i][1]);
    }
  }
  const __m256 va = _mm256_set1_ps(alpha), vb = _mm256_set1_ps(beta);
#pragma GCC unroll 6
  for (int i = 0; i < kMr256; ++i) {
    float* row = c + i * ldc;
    __m256 t0 = _mm256_mul_ps(va, acc[i][0]), t1 = _mm256_mul_ps(va, acc[i][1]);
    if (beta == 1.f) {
      t0 = _mm256_add_ps(_mm256_loadu_ps(row), t0);
      t1 = _mm256_add_ps(_mm256_loadu_ps(row + 8), t1);
    } else if (beta != 0.f) {
      t0 = _mm256_add_ps(_mm256_mul_ps(vb, _mm256_loadu_ps(row)), t0);
      t1 = _mm256_add_ps(_mm256_mul_ps(vb, _mm256_loadu_ps(row + 8)), t1);
    }
    _mm256_storeu_ps(row, t0);
    _mm256_storeu_ps(row + 8, t1);
  }
}
#endif

Kernel<float> kernelFor([[maybe_unused]] GemmKernel kernel) {
#if defined(__x86_64__)
  if (kernel == GemmKernel::kAvx512) return {kMr512, kNr512, microAvx512, packPanelsAvx512};
  return {kMr256, kNr256, microAvx2, packPanels<float>};
#else
  return {};
#endif
}

}  // namespace

bool gemmKernelRuns(GemmKernel kernel) {
  switch (kernel) {
    case GemmKernel::kEigen: return true;
#if defined(__x86_64__)
    case GemmKernel::kAvx512: return __builtin_cpu_supports("avx512f");
    case GemmKernel::kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    default: return false;
#endif
  }
  return false;
}

GemmKernel bestGemmKernel() {
  static const GemmKernel best = gemmKernelRuns(GemmKernel::kAvx512) ? GemmKernel::kAvx512
                                 : gemmKernelRuns(GemmKernel::kAvx2) ? GemmKernel::kAvx2
                                                                     : GemmKernel::kEigen;
  return best;
}

const char* gemmKernelName(GemmKernel kernel) {
  switch (kernel) {
    case GemmKernel::kAvx512: return "avx512";
    case GemmKernel::kAvx2: return "avx2";
    case GemmKernel::kEigen: return "eigen";
  }
  return "?";
}

void sgemm(GemmKernel kernel, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, FloatMatrix a,
           FloatMatrix b, float beta, float* c, std::int64_t cRowStride, std::int64_t cColStride, HostPool* pool) {
  gemm_driver::packedGemm(kernel, kernelFor, m, n, k, alpha, a, b, beta, c, cRowStride, cColStride, pool);
}

}  // namespace tpsim::sim
