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
  if (kernel == GemmKernel::kAvx512) return {kMr512, kNr512, microAvx512, packPanels<float>};
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
