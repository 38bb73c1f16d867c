#include "sim/sgemm.h"

#include <algorithm>
#include <cstdlib>
#include <new>
#include <type_traits>

#include <sys/mman.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "backends/errors.h"

namespace tpsim::sim {
namespace {

// Blocking, one set for both kernels (so that they add in the same order). A task owns a block of
// c (kMc x kNg, 252 KiB) and runs through all of K, so the block stays in L2 while each K block
// adds to it; the A block (kMc x kKc) it multiplies is in L2 too, each B micro-panel (kKc x NR,
// 32 KiB for NR = 32) in L1. kMc is a multiple of both MR, kNg of both NR.
constexpr std::int64_t kKc = 256;
constexpr std::int64_t kMc = 252;
constexpr std::int64_t kNg = 256;
// The packed operands hold at most about this many bytes each (more when K alone needs it): larger
// products are done in chunks of rows and of columns.
constexpr std::int64_t kPackedBytes = std::int64_t(32) << 20;
constexpr int kMaxTile = 14 * 32;  // MR x NR of the largest micro-kernel

// c (MR x NR tile, row stride ldc, unit column stride) = alpha·acc + beta·c, acc = Σ_p a_p·b_p
// over kc packed steps, each element one FMA chain in increasing p. A step is one value of T, or
// (Packed = std::uint32_t) a pair of bf16 values.
template <class T, class Packed = T>
using MicroKernel = void (*)(std::int64_t kc, const Packed* a, const Packed* b, T* c, std::int64_t ldc, T alpha,
                             T beta);

template <class T, class Packed = T>
struct Kernel {
  int mr, nr;
  MicroKernel<T, Packed> run;
};

#if defined(__x86_64__)
// 14 x 32: 28 accumulators, the two B vectors and a broadcast A value fill the 32 registers.
// Written out without templates or lambdas, which the target attribute would not reach; the parts
// the kernels share are functions of that target, inlined.
constexpr int kMr512 = 14, kNr512 = 32;

// The fp32 14 x 32 kernels' accumulators zeroed, and their tile of c fetched: it is wanted only
// after the loop, which hides a fetch from memory (large c: it is not cached).
__attribute__((target("avx512f"), always_inline)) inline void startTile512(__m512 (&acc)[kMr512][2], const float* c,
                                                                           std::int64_t ldc) {
#pragma GCC unroll 14
  for (int i = 0; i < kMr512; ++i) {
    acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    _mm_prefetch(reinterpret_cast<const char*>(c + i * ldc), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(c + i * ldc + kNr512 - 1), _MM_HINT_T0);
  }
}

// c = alpha·acc + beta·c on the tile.
__attribute__((target("avx512f"), always_inline)) inline void finishTile512(const __m512 (&acc)[kMr512][2], float* c,
                                                                            std::int64_t ldc, float alpha, float beta) {
  const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
#pragma GCC unroll 14
  for (int i = 0; i < kMr512; ++i) {
    float* row = c + i * ldc;
    __m512 t0 = _mm512_mul_ps(va, acc[i][0]), t1 = _mm512_mul_ps(va, acc[i][1]);
    if (beta == 1.f) {
      t0 = _mm512_add_ps(_mm512_loadu_ps(row), t0);
      t1 = _mm512_add_ps(_mm512_loadu_ps(row + 16), t1);
    } else if (beta != 0.f) {
      t0 = _mm512_add_ps(_mm512_mul_ps(vb, _mm512_loadu_ps(row)), t0);
      t1 = _mm512_add_ps(_mm512_mul_ps(vb, _mm512_loadu_ps(row + 16)), t1);
    }
    _mm512_storeu_ps(row, t0);
    _mm512_storeu_ps(row + 16, t1);
  }
}

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

// The fp64 kernels: the same shapes in 8- and 4-lane vectors, 14 x 16 and 6 x 8.
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

// The upper bound's kernel: 14 x 32 as microAvx512, one vdpbf16ps a pair of K steps. Each pair
// adds its odd product, then its even one, each an FMA rounded to nearest, a result below 2^-126
// flushed to zero, subnormal inputs read as zero (Intel SDM, VDPBF16PS; AMD's is the same).
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
#endif

template <class T, class Packed = T>
Kernel<T, Packed> kernelFor(GemmKernel kernel) {
  TPSIM_INTERNAL_ASSERT(gemmKernelRuns(kernel) && kernel != GemmKernel::kEigen, "gemm: kernel ",
                        gemmKernelName(kernel), " does not run here");
#if defined(__x86_64__)
  if constexpr (std::is_same_v<Packed, std::uint32_t>) {
    TPSIM_INTERNAL_ASSERT(kernel == GemmKernel::kAvx512 && upperGemmBf16Runs(), "gemm: no bf16 kernel here");
    return {kMr512, kNr512, microAvx512Bf16};
  } else if constexpr (std::is_same_v<T, float>) {
    if (kernel == GemmKernel::kAvx512) return {kMr512, kNr512, microAvx512};
    return {kMr256, kNr256, microAvx2};
  } else {
    if (kernel == GemmKernel::kAvx512) return {kMr512d, kNr512d, microAvx512Double};
    return {kMr256d, kNr256d, microAvx2Double};
  }
#else
  return {};
#endif
}

// The tile's update done element by element, with the micro-kernels' operations in their order.
template <class T>
void updateTile(const T* acc, int ldAcc, std::int64_t rows, std::int64_t cols, T* c, std::int64_t rs, std::int64_t cs,
                T alpha, T beta) {
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < cols; ++j) {
      T& x = c[i * rs + j * cs];
      const T t = alpha * acc[i * ldAcc + j];
      x = beta == T(0) ? t : beta == T(1) ? x + t : beta * x + t;
    }
}

// Packs `count` lines of kc values into panels of w lines, zero-padded: panel s holds
// dst[s·w·kc + p·w + i] = line (s·w + i), value p. Line i, value p is at src[i·across + p·along].
template <class T>
void packPanels(const T* src, std::int64_t across, std::int64_t along, std::int64_t count, std::int64_t kc, int w,
                T* dst) {
  for (std::int64_t s = 0; s < count; s += w, dst += w * kc) {
    const std::int64_t lines = std::min<std::int64_t>(w, count - s);
    const T* first = src + s * across;
    if (across == 1) {  // the lines sit side by side: copy rows of the panel
      for (std::int64_t p = 0; p < kc; ++p) {
        const T* from = first + p * along;
        T* to = dst + p * w;
        for (std::int64_t i = 0; i < lines; ++i) to[i] = from[i];
        for (std::int64_t i = lines; i < w; ++i) to[i] = T(0);
      }
      continue;
    }
    // Each line along its values, a cache line of them at a time for all lines: the few panel
    // rows written stay in L1, and the lines are read as parallel streams.
    constexpr std::int64_t kStep = 64 / sizeof(T);
    for (std::int64_t p0 = 0; p0 < kc; p0 += kStep) {
      const std::int64_t p1 = std::min(kc, p0 + kStep);
      for (std::int64_t i = 0; i < lines; ++i) {
        const T* from = first + i * across;
        for (std::int64_t p = p0; p < p1; ++p) dst[p * w + i] = from[p * along];
      }
    }
    for (std::int64_t i = lines; i < w; ++i)
      for (std::int64_t p = 0; p < kc; ++p) dst[p * w + i] = T(0);
  }
}

#if defined(__x86_64__)
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

// packPanels for the bf16 kernel: step p of a line holds its values 2p (low half) and 2p + 1 (high
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

// The packing of Packed steps: values, or bf16 pairs.
template <class T, class Packed>
void pack(const T* src, std::int64_t across, std::int64_t along, std::int64_t count, std::int64_t kc, int w,
          Packed* dst) {
  if constexpr (std::is_same_v<T, Packed>) {
    packPanels(src, across, along, count, kc, w, dst);
  } else {
#if defined(__x86_64__)
    packPairPanels(src, across, along, count, kc, w, dst);
#endif
  }
}

// A scratch block that only grows, one per calling thread and element type: the packed operands.
// Blocks of several MiB go on huge pages where the kernel gives them on request (a first touch of
// each 4 KiB page is a page fault); small ones, which short-lived threads ask for, do not.
template <class T>
class Scratch {
 public:
  ~Scratch() { std::free(data_); }
  T* get(std::size_t count) {
    if (count > size_) {
      std::free(data_);
      constexpr std::size_t kHuge = std::size_t(2) << 20;
      const bool huge = count * sizeof(T) >= 4 * kHuge;
      const std::size_t align = huge ? kHuge : 64, bytes = (count * sizeof(T) + align - 1) / align * align;
      data_ = static_cast<T*>(std::aligned_alloc(align, bytes));
      if (data_ == nullptr) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
      if (huge) madvise(data_, bytes, MADV_HUGEPAGE);  // a hint: failure is fine
#endif
      size_ = count;
    }
    return data_;
  }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

template <class T, class Packed = T>
void packedGemm(GemmKernel kernel, std::int64_t m, std::int64_t n, std::int64_t k, T alpha, StridedMatrix<T> a,
                StridedMatrix<T> b, T beta, T* c, std::int64_t cRowStride, std::int64_t cColStride, HostPool* pool) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t j = 0; j < n; ++j) {
        T& x = c[i * cRowStride + j * cColStride];
        x = beta == T(0) ? T(0) : beta * x;
      }
    return;
  }
  // A column-major c is the row-major cᵀ = bᵀ·aᵀ; fma(a, b, acc) == fma(b, a, acc), so the bits
  // do not change.
  if (cColStride != 1 && cRowStride == 1) {
    std::swap(m, n);
    std::swap(a, b);
    std::swap(a.rowStride, a.colStride);
    std::swap(b.rowStride, b.colStride);
    std::swap(cRowStride, cColStride);
  }
  const Kernel<T, Packed> kern = kernelFor<T, Packed>(kernel);
  // A packed step holds `per` values of K; kKc is even, so every K block but the last packs whole.
  constexpr std::int64_t per = std::is_same_v<T, Packed> ? 1 : 2;
  auto steps = [](std::int64_t values) { return (values + per - 1) / per; };
  const std::int64_t kBlocks = (k + kKc - 1) / kKc, ks = steps(k);
  constexpr std::int64_t kPackedElements = kPackedBytes / std::int64_t(sizeof(Packed));
  auto chunk = [&](std::int64_t extent, std::int64_t block) {  // a multiple of block, up to extent rounded up
    const std::int64_t whole = (extent + block - 1) / block * block;
    return std::min(whole, std::max(block, kPackedElements / ks / block * block));
  };
  const std::int64_t mChunk = chunk(m, kMc), nChunk = chunk(n, kNg);
  thread_local Scratch<Packed> scratchA, scratchB;
  // A block i, K block p at packedA[i·kMc·ks + p·kMc·kKc / per], its sliver s kc·MR further on (kc:
  // the K block's steps); B likewise in groups of kNg columns and panels of NR.
  Packed* packedA = scratchA.get(std::size_t(mChunk * ks));
  Packed* packedB = scratchB.get(std::size_t(nChunk * ks));
  for (std::int64_t ic = 0; ic < m; ic += mChunk) {
    const std::int64_t mc = std::min(mChunk, m - ic), mBlocks = (mc + kMc - 1) / kMc;
    for (std::int64_t jc = 0; jc < n; jc += nChunk) {
      const std::int64_t nc = std::min(nChunk, n - jc), nGroups = (nc + kNg - 1) / kNg;
      // Pack one (block, K block) of A or of B per task: A's chunk once per chunk of rows, B's
      // chunk again for each chunk of rows unless it is all of B.
      const std::int64_t aTasks = jc == 0 ? mBlocks * kBlocks : 0;
      const std::int64_t bTasks = ic == 0 || nc < n ? nGroups * kBlocks : 0;
      runTasks(pool, aTasks + bTasks, [&](std::int64_t t) {
        const bool packsA = t < aTasks;
        const std::int64_t u = packsA ? t : t - aTasks, block = u / kBlocks, pc = u % kBlocks * kKc;
        const std::int64_t kc = std::min(kKc, k - pc);
        if (packsA) {
          const std::int64_t i0 = block * kMc;
          pack(a.data + (ic + i0) * a.rowStride + pc * a.colStride, a.rowStride, a.colStride,
               std::min(kMc, mc - i0), kc, kern.mr, packedA + i0 * ks + kMc * pc / per);
        } else {
          const std::int64_t j0 = block * kNg;
          pack(b.data + pc * b.rowStride + (jc + j0) * b.colStride, b.colStride, b.rowStride,
               std::min(kNg, nc - j0), kc, kern.nr, packedB + j0 * ks + kNg * pc / per);
        }
      });
      // Multiply: a block of c through all K blocks, in increasing order.
      runTasks(pool, mBlocks * nGroups, [&](std::int64_t t) {
        const std::int64_t i0 = t / nGroups * kMc, j0 = t % nGroups * kNg;
        const std::int64_t rows = std::min(kMc, mc - i0), cols = std::min(kNg, nc - j0);
        for (std::int64_t pc = 0; pc < k; pc += kKc) {
          const std::int64_t kc = steps(std::min(kKc, k - pc));
          const T betaNow = pc == 0 ? beta : T(1);  // later K blocks add to the first's result
          for (std::int64_t jr = 0; jr < cols; jr += kern.nr)
            for (std::int64_t ir = 0; ir < rows; ir += kern.mr) {
              const Packed* ap = packedA + i0 * ks + kMc * pc / per + ir * kc;
              const Packed* bp = packedB + j0 * ks + kNg * pc / per + jr * kc;
              T* ct = c + (ic + i0 + ir) * cRowStride + (jc + j0 + jr) * cColStride;
              const std::int64_t h = std::min<std::int64_t>(kern.mr, rows - ir);
              const std::int64_t w = std::min<std::int64_t>(kern.nr, cols - jr);
              if (h == kern.mr && w == kern.nr && cColStride == 1) {
                kern.run(kc, ap, bp, ct, cRowStride, alpha, betaNow);
              } else {
                alignas(64) T tile[kMaxTile];
                kern.run(kc, ap, bp, tile, kern.nr, T(1), T(0));
                updateTile(tile, kern.nr, h, w, ct, cRowStride, cColStride, alpha, betaNow);
              }
            }
        }
      });
    }
  }
}

}  // namespace

bool upperGemmBf16Runs() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

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
  packedGemm(kernel, m, n, k, alpha, a, b, beta, c, cRowStride, cColStride, pool);
}

void dgemm(GemmKernel kernel, std::int64_t m, std::int64_t n, std::int64_t k, double alpha, DoubleMatrix a,
           DoubleMatrix b, double beta, double* c, std::int64_t cRowStride, std::int64_t cColStride, HostPool* pool) {
  packedGemm(kernel, m, n, k, alpha, a, b, beta, c, cRowStride, cColStride, pool);
}

void upperGemmBf16(std::int64_t m, std::int64_t n, std::int64_t k, FloatMatrix a, FloatMatrix b, float* c,
                   std::int64_t cRowStride, HostPool* pool) {
  packedGemm<float, std::uint32_t>(GemmKernel::kAvx512, m, n, k, 1.f, a, b, 0.f, c, cRowStride, 1, pool);
}

}  // namespace tpsim::sim
