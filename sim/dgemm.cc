#include "sim/dgemm.h"

#include "sim/gemm_driver.h"

namespace tpsim::sim {
namespace {

using namespace gemm_driver;

#if defined(__x86_64__)
// The fp64 kernels: sgemm's shapes in 8- and 4-lane vectors, 14 x 16 and 6 x 8.
constexpr int kMr512d = 14, kNr512d = 16;

__attribute__((target("avx512f"))) void microAvx512Double(std::int64_t kc, const double* a, const double* b, double* c,
                                                          std::int64_t ldc, double alpha, double beta) {
  __m512d acc[kMr512d][2];
#pragma GCC unroll 14
  for (int i = 0; i < kMr512d; ++i) {
    acc[i][0] = acc[i][1] = _mm512_setzero_pd();
    _mm_prefetch(reinterpret_cast<const char*>(c + i * ldc), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(c + i * ldc + kNr512d - 1), _MM_HINT_T0);
  }
  for (std::int64_t p = 0; p < kc; ++p, a += kMr512d, b += kNr512d) {
    const __m512d b0 = _mm512_loadu_pd(b), b1 = _mm512_loadu_pd(b + 8);
#pragma GCC unroll 14
    for (int i = 0; i < kMr512d; ++i) {
      const __m512d ai = _mm512_set1_pd(a[i]);
      acc[i][0] = _mm512_fmadd_pd(ai, b0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_pd(ai, b1, acc[i][1]);
    }
  }
  const __m512d va = _mm512_set1_pd(alpha), vb = _mm512_set1_pd(beta);
#pragma GCC unroll 14
  for (int i = 0; i < kMr512d; ++i) {
    double* row = c + i * ldc;
    __m512d t0 = _mm512_mul_pd(va, acc[i][0]), t1 = _mm512_mul_pd(va, acc[i][1]);
    if (beta == 1.0) {
      t0 = _mm512_add_pd(_mm512_loadu_pd(row), t0);
      t1 = _mm512_add_pd(_mm512_loadu_pd(row + 8), t1);
    } else if (beta != 0.0) {
      t0 = _mm512_add_pd(_mm512_mul_pd(vb, _mm512_loadu_pd(row)), t0);
      t1 = _mm512_add_pd(_mm512_mul_pd(vb, _mm512_loadu_pd(row + 8)), t1);
    }
    _mm512_storeu_pd(row, t0);
    _mm512_storeu_pd(row + 8, t1);
  }
}

constexpr int kMr256d = 6, kNr256d = 8;

__attribute__((target("avx2,fma"))) void microAvx2Double(std::int64_t kc, const double* a, const double* b, double* c,
                                                         std::int64_t ldc, double alpha, double beta) {
  __m256d acc[kMr256d][2];
#pragma GCC unroll 6
  for (int i = 0; i < kMr256d; ++i) {
    acc[i][0] = acc[i][1] = _mm256_setzero_pd();
    _mm_prefetch(reinterpret_cast<const char*>(c + i * ldc), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(c + i * ldc + kNr256d - 1), _MM_HINT_T0);
  }
  for (std::int64_t p = 0; p < kc; ++p, a += kMr256d, b += kNr256d) {
    const __m256d b0 = _mm256_loadu_pd(b), b1 = _mm256_loadu_pd(b + 4);
#pragma GCC unroll 6
    for (int i = 0; i < kMr256d; ++i) {
      const __m256d ai = _mm256_broadcast_sd(a + i);
      acc[i][0] = _mm256_fmadd_pd(ai, b0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_pd(ai, b1, acc[i][1]);
    }
  }
  const __m256d va = _mm256_set1_pd(alpha), vb = _mm256_set1_pd(beta);
#pragma GCC unroll 6
  for (int i = 0; i < kMr256d; ++i) {
    double* row = c + i * ldc;
    __m256d t0 = _mm256_mul_pd(va, acc[i][0]), t1 = _mm256_mul_pd(va, acc[i][1]);
    if (beta == 1.0) {
      t0 = _mm256_add_pd(_mm256_loadu_pd(row), t0);
      t1 = _mm256_add_pd(_mm256_loadu_pd(row + 4), t1);
    } else if (beta != 0.0) {
      t0 = _mm256_add_pd(_mm256_mul_pd(vb, _mm256_loadu_pd(row)), t0);
      t1 = _mm256_add_pd(_mm256_mul_pd(vb, _mm256_loadu_pd(row + 4)), t1);
    }
    _mm256_storeu_pd(row, t0);
    _mm256_storeu_pd(row + 4, t1);
  }
}
#endif

Kernel<double> kernelFor([[maybe_unused]] GemmKernel kernel) {
#if defined(__x86_64__)
  if (kernel == GemmKernel::kAvx512) return {kMr512d, kNr512d, microAvx512Double, packPanels<double>};
  return {kMr256d, kNr256d, microAvx2Double, packPanels<double>};
#else
  return {};
#endif
}

}  // namespace

void dgemm(GemmKernel kernel, std::int64_t m, std::int64_t n, std::int64_t k, double alpha, DoubleMatrix a,
           DoubleMatrix b, double beta, double* c, std::int64_t cRowStride, std::int64_t cColStride, HostPool* pool) {
  gemm_driver::packedGemm(kernel, kernelFor, m, n, k, alpha, a, b, beta, c, cRowStride, cColStride, pool);
}

}  // namespace tpsim::sim
