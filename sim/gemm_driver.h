// The driver that sgemm, dgemm and upperGemmBf16 share (sim/sgemm.h, sim/dgemm.h,
// sim/upper_gemm_bf16.h): one blocking, the packing of operands into panels, and the loops that
// run a GEMM's micro-kernel over them in one fixed order of additions. Also the start and finish of
// the 14 x 32 fp32 AVX-512 tile, which the kernels of sgemm and upperGemmBf16 both use. Internal
// to those three; each brings its own micro-kernels.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <type_traits>
#include <utility>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "backends/errors.h"
#include "backends/huge_pages.h"
#include "sim/host_pool.h"
#include "sim/sgemm.h"

namespace tpsim::sim::gemm_driver {

// Blocking, one set for every kernel (so that they add in the same order). A task owns a block of
// c (kMc x kNg, 252 KiB) and runs through all of K, so the block stays in L2 while each K block
// adds to it; the A block (kMc x kKc) it multiplies is in L2 too, each B micro-panel (kKc x NR,
// 32 KiB for NR = 32) in L1. kMc is a multiple of every MR, kNg of every NR.
constexpr std::int64_t kKc = 256;
constexpr std::int64_t kMc = 252;
constexpr std::int64_t kNg = 256;
// The packed operands hold at most about this many bytes each (more when K alone needs it): larger
// products are done in chunks of rows and of columns.
constexpr std::int64_t kPackedBytes = std::int64_t(32) << 20;
constexpr int kMaxTile = 14 * 32;  // MR x NR of the largest micro-kernel

// A chunk of an operand that packedGemm packs at once: `extent` rows of A (block kMc) or columns
// of B (block kNg) rounded up to whole blocks, as many as kPackedBytes holds at `steps` packed steps
// of K, `elementBytes` each (at least one block).
constexpr std::int64_t packedChunk(std::int64_t extent, std::int64_t block, std::int64_t steps,
                                   std::int64_t elementBytes) {
  const std::int64_t whole = (extent + block - 1) / block * block;
  return std::min(whole, std::max(block, kPackedBytes / elementBytes / steps / block * block));
}

// The bytes of the packed copies of A and of B that an (m x k)·(k x n) product leaves on the
// calling thread, which keeps them for its next product (they only grow): `elementBytes` a packed
// step of `perStep` values of K (8 and 1 for dgemm, 4 and 1 for sgemm, 4 and 2 for bf16 pairs).
struct PackedBytes {
  std::int64_t a = 0, b = 0;
};
constexpr PackedBytes packedOperandBytes(std::int64_t m, std::int64_t n, std::int64_t k, std::int64_t elementBytes,
                                         std::int64_t perStep) {
  const std::int64_t steps = (k + perStep - 1) / perStep;
  return {packedChunk(m, kMc, steps, elementBytes) * steps * elementBytes,
          packedChunk(n, kNg, steps, elementBytes) * steps * elementBytes};
}

// c (MR x NR tile, row stride ldc, unit column stride) = alpha·acc + beta·c, acc = Σ_p a_p·b_p
// over kc packed steps, each element one FMA chain in increasing p. A step is one value of T, or
// (Packed = std::uint32_t) a pair of bf16 values.
template <class T, class Packed = T>
using MicroKernel = void (*)(std::int64_t kc, const Packed* a, const Packed* b, T* c, std::int64_t ldc, T alpha,
                             T beta);

// Packs `count` lines of kc values into panels of w lines of Packed steps, zero-padded: panel s
// holds dst[s·w·steps + p·w + i] = line (s·w + i), step p. Line i, value p is at
// src[i·across + p·along].
template <class T, class Packed = T>
using PackFn = void (*)(const T* src, std::int64_t across, std::int64_t along, std::int64_t count, std::int64_t kc,
                        int w, Packed* dst);

// A micro-kernel with its tile shape and the packing its operands need.
template <class T, class Packed = T>
struct Kernel {
  int mr, nr;
  MicroKernel<T, Packed> run;
  PackFn<T, Packed> pack;
};

#if defined(__x86_64__)
// 14 x 32: 28 accumulators, the two B vectors and a broadcast A value fill the 32 registers.
// The kernels are written out without templates or lambdas, which the target attribute would not
// reach; the parts they share are functions of that target, inlined.
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
#endif

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

// The PackFn of kernels whose steps are single values: panel s holds dst[s·w·kc + p·w + i] = line
// (s·w + i), value p.
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
      if (huge) adviseHugePages(data_, bytes);
      size_ = count;
    }
    return data_;
  }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

// c = alpha·a·b + beta·c with the micro-kernel select(kernel) returns for a kernel that runs here,
// as sgemm states it (sim/sgemm.h).
template <class T, class Packed = T>
void packedGemm(GemmKernel kernel, Kernel<T, Packed> (*select)(GemmKernel), std::int64_t m, std::int64_t n,
                std::int64_t k, T alpha, StridedMatrix<T> a, StridedMatrix<T> b, T beta, T* c, std::int64_t cRowStride,
                std::int64_t cColStride, HostPool* pool) {
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
  TPSIM_INTERNAL_ASSERT(gemmKernelRuns(kernel) && kernel != GemmKernel::kEigen, "gemm: kernel ",
                        gemmKernelName(kernel), " does not run here");
  const Kernel<T, Packed> kern = select(kernel);
  // A packed step holds `per` values of K; kKc is even, so every K block but the last packs whole.
  constexpr std::int64_t per = std::is_same_v<T, Packed> ? 1 : 2;
  auto steps = [](std::int64_t values) { return (values + per - 1) / per; };
  const std::int64_t kBlocks = (k + kKc - 1) / kKc, ks = steps(k);
  const std::int64_t mChunk = packedChunk(m, kMc, ks, sizeof(Packed)), nChunk = packedChunk(n, kNg, ks, sizeof(Packed));
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
          kern.pack(a.data + (ic + i0) * a.rowStride + pc * a.colStride, a.rowStride, a.colStride,
                    std::min(kMc, mc - i0), kc, kern.mr, packedA + i0 * ks + kMc * pc / per);
        } else {
          const std::int64_t j0 = block * kNg;
          kern.pack(b.data + pc * b.rowStride + (jc + j0) * b.colStride, b.colStride, b.rowStride,
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

}  // namespace tpsim::sim::gemm_driver
