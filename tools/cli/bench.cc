// tpsim bench: what the simulator costs, each figure next to a baseline measured in the same run.
// With --backend gpu the sections are the GPU's (tools/cli/bench_gpu.cc); this file parses for both.
//
//  latency    allReduce of one fp32 per rank, N ranks on the fiber world, against one OS thread
//             per rank meeting at a mutex/condition-variable barrier (the obvious alternative).
//  bandwidth  nccl-tests' table (size, count, type, redop, time, algbw, busbw, #wrong) for the
//             five collectives; busbw = algbw · factor, factor 2(n-1)/n for allReduce, (n-1)/n
//             for allGather, reduceScatter and allToAll, 1 for broadcast.
//  gemm       SimCompute::gemm against plain Eigen on the same shapes, threads and data.
//  mlp        the MLP block (column fc1, GeLU, row fc2, sequence parallel) forward + backward on
//             T = 1, 2, 4, 8 simulated ranks against the same unsharded computation in plain Eigen,
//             both on the same threads (--threads, 0 = every core).
//  mpi        under an MPI launcher: mpi::Session's collectives across processes against the MPI
//             library's (tools/cli/bench_mpi.cc).
#include <Eigen/Core>
#include <algorithm>
#include <boost/program_options.hpp>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>
#include <time.h>
#include <unistd.h>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "backends/compute.h"
#include "backends/errors.h"
#include "backends/threads.h"
#include "backends/world/fiber.h"
#include "core/layers.h"
#include "sim/dgemm.h"
#include "sim/gelu.h"
#include "sim/sgemm.h"
#include "sim/sim_compute.h"
#include "sim/upper_gemm_bf16.h"
#include "sim/world.h"
#include "tools/lib/backend.h"
#include "tools/lib/job.h"
#include "tools/lib/memory.h"
#include "tools/cli/bench_gpu.h"
#include "tools/cli/bench_mpi.h"
#include "tools/cli/cli.h"
#include "tpsim_config.h"

namespace po = boost::program_options;

namespace tpsim::tools {
namespace {

using Clock = std::chrono::steady_clock;

double secondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// --- latency ----------------------------------------------------------------------------------

// This process's resident memory in bytes (0 where /proc is missing).
double residentBytes() {
  std::ifstream statm("/proc/self/statm");
  double pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * double(sysconf(_SC_PAGESIZE));
}

struct TinyAllReduce {
  double seconds = 0;       // per collective, startup cost subtracted
  double bytesPerRank = 0;  // resident memory a rank adds while parked in a collective
};

TinyAllReduce simTinyAllReduce(int n, int threads, int iters) {
  WorldOptions o;
  o.size = n;
  o.threads = threads;
  const double residentBefore = residentBytes();
  sim::World world(o);
  TinyAllReduce result;
  // Every rank has run and waits in the second allReduce while rank 0 reads the resident size.
  world.run([&](RankContext& ctx) {
    Tensor x = ctx.compute.zeros({1}, DType::kFloat32);
    ctx.comm.allReduce(x)->wait();
    if (ctx.comm.rank() == 0) result.bytesPerRank = (residentBytes() - residentBefore) / n;
    ctx.comm.allReduce(x)->wait();
  });
  auto timeRun = [&](int count) {
    const auto start = Clock::now();
    world.run([count](RankContext& ctx) {
      Tensor x = ctx.compute.zeros({1}, DType::kFloat32);
      for (int i = 0; i < count; ++i) ctx.comm.allReduce(x)->wait();
    });
    return secondsSince(start);
  };
  timeRun(iters / 10);  // warm up allocators and page in stacks
  double best = 1e30;   // best of three: a shared VM's noise only ever adds time
  for (int rep = 0; rep < 3; ++rep) best = std::min(best, std::max(0.0, timeRun(iters) - timeRun(0)) / iters);
  result.seconds = best;
  return result;
}

// The same allReduce with one OS thread per rank and a generation-counting barrier.
double threadTinyAllReduce(int n, int iters) {
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  long generation = 0;
  std::vector<float> slots(n);
  float sum = 0;
  auto barrier = [&](std::unique_lock<std::mutex>& lock) {
    const long gen = generation;
    if (++arrived == n) {
      arrived = 0;
      ++generation;
      cv.notify_all();
    } else {
      cv.wait(lock, [&] { return generation != gen; });
    }
  };
  const auto start = Clock::now();
  std::vector<std::thread> threads = startThreads(n, [&](int r) {
      float x = 0;
      for (int i = 0; i < iters; ++i) {
        std::unique_lock<std::mutex> lock(mu);
        slots[r] = x;
        barrier(lock);
        if (r == 0) {
          sum = 0;
          for (float v : slots) sum += v;  // rank order, like the fabric
        }
        barrier(lock);
        x = sum;
      }
    }, "OS threads, one per rank (--ranks)");
  for (auto& t : threads) t.join();
  return secondsSince(start) / iters;
}

void benchLatency(const BenchConfig& c) {
  std::printf("\n# Tiny collectives: allReduce of 1 fp32 per rank; us per collective and per rank, best of 3\n");
  std::printf("# baseline: one OS thread per rank, mutex + condition-variable barrier, same run\n");
  std::printf("# KiB/rank: resident memory the world adds per rank while every rank waits in a collective\n");
  std::printf("# (touched fiber stack pages, rank state; the world's fixed cost shows at few ranks); each fiber\n");
  std::printf("# maps %zu KiB of stack, resident only as far as it is used\n", world::Fiber::defaultStackBytes() >> 10);
  std::printf("#%6s %8s %12s %12s %14s %9s %10s\n", "ranks", "threads", "sim(us)", "sim/rank", "thread/rank",
              "speedup", "KiB/rank");
  for (int n : c.ranks) {
    const int threads = c.threads ? c.threads : std::min<int>(n, int(std::thread::hardware_concurrency()));
    // Fewer collectives for many ranks, so that 1024 ranks take seconds, not minutes.
    const TinyAllReduce sim = simTinyAllReduce(n, c.threads, std::max(50, c.iters / std::max(1, n / 16)));
    const int baseIters = std::max(20, c.iters / std::max(1, n / 4));
    double thread = 1e30;
    for (int rep = 0; rep < 3; ++rep) thread = std::min(thread, threadTinyAllReduce(n, baseIters));
    std::printf(" %6d %8d %12.2f %12.3f %14.3f %8.1fx %10.1f\n", n, threads, sim.seconds * 1e6,
                sim.seconds * 1e6 / n, thread * 1e6 / n, thread / sim.seconds, sim.bytesPerRank / 1024);
  }
}

// --- bandwidth --------------------------------------------------------------------------------

enum class BwOp { kAllReduce, kAllGather, kReduceScatter, kBroadcast, kAllToAll };

struct BwCase {
  BwOp op;
  const char* name;
  double busFactor;  // busbw / algbw
};

// The bytes of the table's largest size: --min-bytes times the largest power of 4 within --max-bytes.
long long largestBandwidthBytes(const BenchConfig& c) {
  long long bytes = c.minBytes;
  while (bytes <= c.maxBytes / 4) bytes *= 4;
  return bytes;
}

// Every rank holds an input and an output of up to the largest size at once (fewer elements for the
// blocked collectives' smaller side): sizes whose buffers alone exceed the memory available are
// refused before the table starts, not left to fail or to page mid-way.
void checkBandwidthMemory(const BenchConfig& c) {
  const std::optional<AvailableMemory> available = availableMemory();
  const long long largest = largestBandwidthBytes(c);
  const double need = 2.0 * double(c.bwRanks) * double(largest / 4 / c.bwRanks * c.bwRanks * 4);
  if (!available || need <= double(available->bytes)) return;
  throw InvalidArgument(detail::concat(
      "tpsim bench: --bw-ranks (-p) ", c.bwRanks, " and --max-bytes (-e) ", sizeText(c.maxBytes),
      ": expected collective buffers that fit in memory, got ", bytesText(need), " (an input and an output of ",
      bytesText(need / 2 / c.bwRanks), " on each rank), more than the ", bytesText(double(available->bytes)),
      " available (", available->source, "); use a smaller --max-bytes or fewer --bw-ranks"));
}

// Returns the number of wrong output elements over all sizes and collectives.
long benchBandwidth(const BenchConfig& c) {
  const int n = c.bwRanks;
  std::printf("\n# Collective bandwidth on %d simulated ranks (fp32; size = bytes of the larger buffer per rank)\n", n);
  long allWrong = 0;
  const BwCase cases[] = {{BwOp::kAllReduce, "allReduce", 2.0 * (n - 1) / n},
                          {BwOp::kAllGather, "allGather", double(n - 1) / n},
                          {BwOp::kReduceScatter, "reduceScatter", double(n - 1) / n},
                          {BwOp::kBroadcast, "broadcast", 1.0},
                          {BwOp::kAllToAll, "allToAll", double(n - 1) / n}};
  for (const BwCase& bc : cases) {
    std::printf("# %s\n#%12s %12s %6s %6s %10s %8s %8s %7s\n", bc.name, "size", "count", "type", "redop",
                "time", "algbw", "busbw", "#wrong");
    std::printf("#%12s %12s %6s %6s %10s %8s %8s %7s\n", "(B)", "(elements)", "", "", "(us)", "(GB/s)", "(GB/s)",
                "");
    const bool reduces = bc.op == BwOp::kAllReduce || bc.op == BwOp::kReduceScatter;
    for (long long bytes = c.minBytes; bytes <= c.maxBytes; bytes *= 4) {
      const std::int64_t count = bytes / 4 / n * n;  // divisible by n for the blocked collectives
      const std::int64_t block = count / n;
      const std::int64_t inCount = bc.op == BwOp::kAllGather ? block : count;
      const std::int64_t outCount = bc.op == BwOp::kReduceScatter ? block : count;
      std::vector<double> seconds(n, 0);
      std::vector<long> wrong(n, 0);
      WorldOptions o;
      o.size = n;
      o.threads = c.threads;
      sim::World world(o);
      runWorld(world, [&](RankContext& ctx) {
        const int r = ctx.comm.rank();
        // Input value r+1 everywhere: every output element has a closed form.
        Tensor in = ctx.compute.empty({inCount}, DType::kFloat32);
        Tensor out = ctx.compute.empty({outCount}, DType::kFloat32);
        ctx.compute.fill(in, r + 1);
        auto issue = [&] {
          switch (bc.op) {
            case BwOp::kAllReduce: return ctx.comm.allReduce(in, out);
            case BwOp::kAllGather: return ctx.comm.allGather(in, out);
            case BwOp::kReduceScatter: return ctx.comm.reduceScatter(in, out);
            case BwOp::kBroadcast: return ctx.comm.broadcast(in, out);
            case BwOp::kAllToAll: break;
          }
          return ctx.comm.allToAll(in, out);
        };
        issue()->wait();  // warm-up: pages in the output
        ctx.comm.barrier()->wait();
        const auto start = Clock::now();
        for (int i = 0; i < c.bwIters; ++i) issue()->wait();
        ctx.comm.barrier()->wait();
        seconds[r] = secondsSince(start) / c.bwIters;
        const float* y = out.view().typed<float>();
        const float sum = float(n * (n + 1) / 2);
        for (std::int64_t i = 0; i < outCount; ++i) {
          const float expect = reduces ? sum : bc.op == BwOp::kBroadcast ? 1.f : float(i / block + 1);
          wrong[r] += y[i] != expect;
        }
      });
      const double t = *std::max_element(seconds.begin(), seconds.end());
      long totalWrong = 0;
      for (long w : wrong) totalWrong += w;
      allWrong += totalWrong;
      const double sizeBytes = double(count) * 4;
      const double algbw = sizeBytes / t / 1e9;
      std::printf(" %12.0f %12lld %6s %6s %10.1f %8.2f %8.2f %7ld\n", sizeBytes, (long long)count, "float",
                  reduces ? "sum" : "none", t * 1e6, algbw, algbw * bc.busFactor, totalWrong);
    }
  }
  return allWrong;
}

// --- gemm -------------------------------------------------------------------------------------

// The layers' three products: forward x·Wᵀ (b is the transpose of a row-major W (N, K)), dgrad
// dy·W, and wgrad dyᵀ·x (a is the transpose of a row-major dy (K, M)).
enum class GemmForm { kForward, kDgrad, kWgrad };

struct GemmShape {
  int m, k, n;
  GemmForm form;
};

const char* gemmFormName(GemmForm form) {
  switch (form) {
    case GemmForm::kForward: return "a*b^T";
    case GemmForm::kDgrad: return "a*b";
    case GemmForm::kWgrad: return "a^T*b";
  }
  return "?";
}

// CPU time of the calling thread: a pass timed by it is not slowed by other processes sharing the
// core, so the peak is the core's own, not what a loaded machine leaves of it.
double threadSeconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

// One core's fp32 FMA peak: 12 independent FMA chains (enough to cover the FMA latency on two
// pipes) on the widest vectors the core has, not the build's ISA. The chains start from different
// values: chains that start equal compute equal values, and the compiler folds them into one chain,
// whose latency-bound time would overstate the peak by 12 / (latency · pipes), 1.5x on Zen 5. GFLOP/s of one pass over
// `iters` iterations; fmaPeak keeps the best of 3. Each width is written out in full: code that a
// target attribute compiles for AVX-512 must not be a template or lambda shared with other code.
#if defined(__x86_64__)
__attribute__((target("avx512f"))) double fmaPassAvx512(long iters) {
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-3f);
  __m512 c0 = _mm512_set1_ps(0.f), c1 = _mm512_set1_ps(1.f), c2 = _mm512_set1_ps(2.f), c3 = _mm512_set1_ps(3.f);
  __m512 c4 = _mm512_set1_ps(4.f), c5 = _mm512_set1_ps(5.f), c6 = _mm512_set1_ps(6.f), c7 = _mm512_set1_ps(7.f);
  __m512 c8 = _mm512_set1_ps(8.f), c9 = _mm512_set1_ps(9.f), c10 = _mm512_set1_ps(10.f), c11 = _mm512_set1_ps(11.f);
  const double start = threadSeconds();
  for (long i = 0; i < iters; ++i) {
    c0 = _mm512_fmadd_ps(c0, a, b), c1 = _mm512_fmadd_ps(c1, a, b), c2 = _mm512_fmadd_ps(c2, a, b);
    c3 = _mm512_fmadd_ps(c3, a, b), c4 = _mm512_fmadd_ps(c4, a, b), c5 = _mm512_fmadd_ps(c5, a, b);
    c6 = _mm512_fmadd_ps(c6, a, b), c7 = _mm512_fmadd_ps(c7, a, b), c8 = _mm512_fmadd_ps(c8, a, b);
    c9 = _mm512_fmadd_ps(c9, a, b), c10 = _mm512_fmadd_ps(c10, a, b), c11 = _mm512_fmadd_ps(c11, a, b);
  }
  const double seconds = threadSeconds() - start;
  __m512 sink[] = {c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11};
  asm volatile("" : : "r"(sink) : "memory");  // the chains' results are used
  return 12.0 * 2 * 16 * double(iters) / seconds / 1e9;
}

__attribute__((target("avx2,fma"))) double fmaPassAvx2(long iters) {
  const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-3f);
  __m256 c0 = _mm256_set1_ps(0.f), c1 = _mm256_set1_ps(1.f), c2 = _mm256_set1_ps(2.f), c3 = _mm256_set1_ps(3.f);
  __m256 c4 = _mm256_set1_ps(4.f), c5 = _mm256_set1_ps(5.f), c6 = _mm256_set1_ps(6.f), c7 = _mm256_set1_ps(7.f);
  __m256 c8 = _mm256_set1_ps(8.f), c9 = _mm256_set1_ps(9.f), c10 = _mm256_set1_ps(10.f), c11 = _mm256_set1_ps(11.f);
  const double start = threadSeconds();
  for (long i = 0; i < iters; ++i) {
    c0 = _mm256_fmadd_ps(c0, a, b), c1 = _mm256_fmadd_ps(c1, a, b), c2 = _mm256_fmadd_ps(c2, a, b);
    c3 = _mm256_fmadd_ps(c3, a, b), c4 = _mm256_fmadd_ps(c4, a, b), c5 = _mm256_fmadd_ps(c5, a, b);
    c6 = _mm256_fmadd_ps(c6, a, b), c7 = _mm256_fmadd_ps(c7, a, b), c8 = _mm256_fmadd_ps(c8, a, b);
    c9 = _mm256_fmadd_ps(c9, a, b), c10 = _mm256_fmadd_ps(c10, a, b), c11 = _mm256_fmadd_ps(c11, a, b);
  }
  const double seconds = threadSeconds() - start;
  __m256 sink[] = {c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11};
  asm volatile("" : : "r"(sink) : "memory");
  return 12.0 * 2 * 8 * double(iters) / seconds / 1e9;
}
#endif

struct FmaPeak {
  double gflops = 0;
  const char* unit = "none";
  int lanes = 0;  // fp32 lanes of one FMA
};

// `cores` threads run the chains at once, so that the rate is the cores' together, at the clock
// they hold when all of them are busy; gflops is the sum, the best of 3 passes.
FmaPeak fmaPeak(int cores = 1) {
  FmaPeak peak;
#if defined(__x86_64__)
  const bool avx512 = __builtin_cpu_supports("avx512f");
  if (!avx512 && !__builtin_cpu_supports("fma")) return peak;
  peak.unit = avx512 ? "AVX-512 (16 lanes)" : "AVX2 FMA (8 lanes)";
  peak.lanes = avx512 ? 16 : 8;
  for (int rep = 0; rep < 3; ++rep) {
    std::vector<double> rates(std::size_t(cores), 0.0);
    std::vector<std::thread> others = startThreads(cores - 1, [&](int i) {
        rates[std::size_t(i) + 1] = avx512 ? fmaPassAvx512(20'000'000) : fmaPassAvx2(20'000'000);
      }, "FMA peak threads (--threads)");
    rates[0] = avx512 ? fmaPassAvx512(20'000'000) : fmaPassAvx2(20'000'000);
    for (auto& t : others) t.join();
    double sum = 0;
    for (double r : rates) sum += r;
    peak.gflops = std::max(peak.gflops, sum);
  }
#endif
  return peak;
}

// The verifier's two products (tools/lib/reference.cc) on fc1's forward shape: its values in fp64
// (dgemm; an fp64 FMA does half the fp32 lanes) and its bounds' magnitudes in bf16 pairs
// (upperGemmBf16; one bf16 dot-product instruction does twice an FMA's work).
void benchVerifierGemms(const BenchConfig& c, const FmaPeak& peak) {
  const sim::GemmKernel kernel = sim::bestGemmKernel();
  if (kernel == sim::GemmKernel::kEigen) return;
  const std::int64_t m = 2048, k = 1024, n = 4096;
  const std::vector<double> a(std::size_t(m * k), 0.5), b(std::size_t(n * k), 0.25);
  const std::vector<float> af(a.begin(), a.end()), bf(b.begin(), b.end());
  std::vector<double> cd(std::size_t(m * n));
  std::vector<float> cf(std::size_t(m * n));
  auto best = [&](const std::function<void()>& product) {
    double seconds = 1e30;
    for (int rep = 0; rep < c.gemmReps + 1; ++rep) {
      const auto start = Clock::now();
      product();
      if (rep > 0) seconds = std::min(seconds, secondsSince(start));  // the first warms up
    }
    return 2.0 * double(m * k * n) / seconds / 1e9;
  };
  std::printf("# the verifier's products, one thread, %lld x %lld x %lld a*b^T, against the fp32 peak:\n",
              (long long)m, (long long)k, (long long)n);
  const double fp64 = best([&] {
    sim::dgemm(kernel, m, n, k, 1.0, {a.data(), k, 1}, {b.data(), 1, k}, 0.0, cd.data(), n, 1, nullptr);
  });
  auto ofPeak = [&](double rate) { return peak.gflops > 0 ? 100 * rate / peak.gflops : 0.0; };
  std::printf("#   values  dgemm (fp64)          %8.1f GF/s %7.1f%%\n", fp64, ofPeak(fp64));
  if (!sim::upperGemmBf16Runs()) {
    std::printf("#   bounds  upperGemmBf16: not run (this core lacks AVX512-BF16; the bounds use sgemm)\n");
    return;
  }
  const double bf16 = best([&] {
    sim::upperGemmBf16(m, n, k, {af.data(), k, 1}, {bf.data(), 1, k}, cf.data(), n, nullptr);
  });
  std::printf("#   bounds  upperGemmBf16 (bf16)  %8.1f GF/s %7.1f%%\n", bf16, ofPeak(bf16));
}

void benchGemm(const BenchConfig& c) {
  using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const FmaPeak peak = fmaPeak();
  std::printf("\n# GEMM c = a·b, fp32, one thread: SimCompute::gemm vs plain Eigen, same data, same run\n");
  if (peak.gflops > 0)
    std::printf("# peak: one core's fp32 FMA rate, %s, 12 independent chains: %.1f GF/s (measured now)\n",
                peak.unit, peak.gflops);
  else
    std::printf("# peak: not measured (this core has no FMA instruction tpsim knows)\n");
  std::printf("#%6s %6s %6s %6s %12s %12s %10s %9s %9s\n", "M", "K", "N", "form", "sim GF/s", "eigen GF/s", "sim/eigen",
              "sim/peak", "eig/peak");
  // The MLP's fc1 at 2048 tokens, h 1024, ffn 4096 in its three forms, then a cube and a unit shape.
  const GemmShape shapes[] = {{2048, 1024, 4096, GemmForm::kForward}, {2048, 4096, 1024, GemmForm::kDgrad},
                              {4096, 2048, 1024, GemmForm::kWgrad},   {512, 512, 512, GemmForm::kDgrad},
                              {64, 32, 128, GemmForm::kForward}};
  sim::SimCompute compute;
  for (const GemmShape& s : shapes) {
    const bool transposedA = s.form == GemmForm::kWgrad, transposedB = s.form == GemmForm::kForward;
    RowMajor a = transposedA ? RowMajor::Random(s.k, s.m) : RowMajor::Random(s.m, s.k);
    RowMajor w = transposedB ? RowMajor::Random(s.n, s.k) : RowMajor::Random(s.k, s.n);
    RowMajor cs(s.m, s.n), ce(s.m, s.n);
    ConstView aStored(a.data(), Shape{a.rows(), a.cols()}, DType::kFloat32);
    ConstView wv(w.data(), Shape{w.rows(), w.cols()}, DType::kFloat32);
    ConstView av = transposedA ? aStored.t() : aStored;
    ConstView bv = transposedB ? wv.t() : wv;
    View cv(cs.data(), Shape{s.m, s.n}, DType::kFloat32);
    const double flops = 2.0 * s.m * s.k * s.n;
    // Enough calls per sample for ~50 ms; best of gemmReps samples, sim and Eigen interleaved.
    const int calls = std::max(1, int(5e9 / flops));
    double bestSim = 1e30, bestEigen = 1e30;
    for (int rep = 0; rep < c.gemmReps + 1; ++rep) {
      auto start = Clock::now();
      for (int i = 0; i < calls; ++i) compute.gemm(av, bv, cv);
      const double tSim = secondsSince(start) / calls;
      start = Clock::now();
      for (int i = 0; i < calls; ++i) {
        if (transposedB)
          ce.noalias() = a * w.transpose();
        else if (transposedA)
          ce.noalias() = a.transpose() * w;
        else
          ce.noalias() = a * w;
      }
      const double tEigen = secondsSince(start) / calls;
      if (rep == 0) continue;  // warm-up
      bestSim = std::min(bestSim, tSim);
      bestEigen = std::min(bestEigen, tEigen);
    }
    if (!cs.isApprox(ce, 1e-4f)) throw Error("bench gemm: SimCompute and Eigen disagree");
    const double simRate = flops / bestSim / 1e9, eigenRate = flops / bestEigen / 1e9;
    auto ofPeak = [&](double rate) { return peak.gflops > 0 ? 100 * rate / peak.gflops : 0.0; };
    std::printf(" %6d %6d %6d %6s %12.1f %12.1f %9.3fx %8.1f%% %8.1f%%\n", s.m, s.k, s.n, gemmFormName(s.form),
                simRate, eigenRate, bestSim / bestEigen, ofPeak(simRate),
                ofPeak(eigenRate));
  }
  benchVerifierGemms(c, peak);
}


// --- mlp --------------------------------------------------------------------------------------

using RowMajorF = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// Seconds per forward + backward of the unsharded block in plain Eigen (best of reps), its GEMMs
// through SimCompute::gemm's Eigen kernel on `threads` threads: Eigen's products, tiled as the
// simulator tiles them, so both sides have the same cores.
double eigenMlp(std::int64_t m, std::int64_t h, std::int64_t f, int reps, int threads) {
  // The simulator's values (simMlp): erf's cost depends on its argument, so the data must match.
  RowMajorF x = RowMajorF::Constant(m, h, 0.5f), w1 = RowMajorF::Constant(f, h, 0.01f),
            w2 = RowMajorF::Constant(h, f, 0.01f);
  Eigen::RowVectorXf b1 = Eigen::RowVectorXf::Zero(f), b2 = Eigen::RowVectorXf::Zero(h);
  RowMajorF dy = RowMajorF::Constant(m, h, 1.f), hid(m, f), a(m, f), y(m, h), dA(m, f), dX(m, h), dW1(f, h),
            dW2(h, f);
  Eigen::RowVectorXf db1(f), db2(h);
  sim::HostPool pool(threads - 1);
  sim::SimCompute compute(&pool, sim::GemmKernel::kEigen);
  auto view = [](auto& mat) { return View(mat.data(), Shape{mat.rows(), mat.cols()}, DType::kFloat32); };
  auto product = [&](ConstView lhs, ConstView rhs, View out) { compute.gemm(lhs, rhs, out); };
  double best = 1e30;
  for (int rep = 0; rep < reps; ++rep) {
    const auto start = Clock::now();
    product(view(x), view(w1).t(), view(hid));  // x·W1ᵀ
    hid.rowwise() += b1;
    // The same float formulas as SimCompute's gelu and geluBackward.
    a = hid.unaryExpr([](float v) { return v * 0.5f * (1.f + std::erf(v * 0.70710678118654752440f)); });
    product(view(a), view(w2).t(), view(y));  // a·W2ᵀ
    y.rowwise() += b2;
    product(view(dy), view(w2), view(dA));     // dy·W2
    product(view(dy).t(), view(a), view(dW2));  // dyᵀ·a
    db2 = dy.colwise().sum();
    dA = dA.cwiseProduct(hid.unaryExpr([](float v) {
      return 0.5f * (1.f + std::erf(v * 0.70710678118654752440f)) + v * std::exp(-0.5f * v * v) * 0.39894228040143267794f;
    }));
    product(view(dA).t(), view(x), view(dW1));  // dAᵀ·x
    db1 = dA.colwise().sum();
    product(view(dA), view(w1), view(dX));  // dA·W1
    best = std::min(best, secondsSince(start));
  }
  if (!y.allFinite() || !dX.allFinite()) throw Error("bench mlp: Eigen baseline produced non-finite values");
  return best;
}

// Seconds per forward + backward of the block on T simulated ranks with sequence parallelism.
double simMlp(int T, int threads, std::int64_t m, std::int64_t h, std::int64_t f, int reps) {
  WorldOptions o;
  o.size = T;
  o.threads = threads;
  std::vector<double> seconds(T, 1e30);
  sim::World world(o);
  runWorld(world, [&](RankContext& ctx) {
    ModelParallelConfig config;
    config.tensorModelParallelSize = std::max(2, T);
    config.sequenceParallel = T > 1;
    config.performInitialization = false;
    ColumnParallelOptions o1;
    RowParallelOptions o2;
    o2.inputIsParallel = true;
    const InitMethod init = initMethodNormal(0.02);
    ColumnParallelLinear fc1({ctx.compute, ctx.comm}, config, h, f, init, o1);
    RowParallelLinear fc2({ctx.compute, ctx.comm}, config, f, h, init, o2);
    ctx.compute.fill(fc1.weight()->data, 0.01);
    ctx.compute.fill(fc2.weight().data, 0.01);
    const std::int64_t local = T > 1 ? m / T : m;  // tokens on this rank under SP
    Tensor x = ctx.compute.empty({local, 1, h}, DType::kFloat32);
    Tensor dy = ctx.compute.empty({local, 1, h}, DType::kFloat32);
    ctx.compute.fill(x, 0.5);  // eigenMlp uses the same values
    ctx.compute.fill(dy, 1.0);
    for (int rep = 0; rep < reps; ++rep) {
      ctx.comm.barrier()->wait();
      const auto start = Clock::now();
      Tensor hid = fc1.forward(x).output;  // (m, 1, f/T)
      Tensor a = ctx.compute.empty(hid.shape(), hid.dtype());
      ctx.compute.gelu(hid, a);
      Tensor y = fc2.forward(a).output;
      Tensor dA = fc2.backward(dy);
      Tensor dH = ctx.compute.empty(hid.shape(), hid.dtype());
      ctx.compute.geluBackward(hid, dA, dH);
      Tensor dX = fc1.backward(dH);
      ctx.comm.barrier()->wait();
      seconds[ctx.comm.rank()] = std::min(seconds[ctx.comm.rank()], secondsSince(start));
    }
  });
  return *std::max_element(seconds.begin(), seconds.end());
}

void benchMlp(const BenchConfig& c) {
  const int threads = c.threads ? c.threads : std::max(1, int(std::thread::hardware_concurrency()));
  const int cores = std::min<int>(threads, std::max(1u, std::thread::hardware_concurrency()));
  const FmaPeak peak = fmaPeak(cores);
  std::printf("\n# MLP block fc1 (h -> F, column) · GeLU · fc2 (F -> h, row), fp32, forward + backward,\n");
  std::printf("# sequence parallel for T > 1; %d thread(s) for the simulator and for Eigen; best of %d\n", threads,
              c.mlpReps);
  std::printf("# eigen: the unsharded block, Eigen's GEMMs tiled over the same threads (SimCompute::gemm),\n");
  std::printf("# GeLU and bias on one thread; sim: min(T, threads) threads run ranks, the rest share GEMM tiles\n");
  const std::optional<sim::GeluIsa> geluIsa = sim::vectorGeluIsa();
  std::printf("# sim's kernels: GEMM %s, GeLU %s\n", sim::gemmKernelName(sim::bestGemmKernel()),
              geluIsa ? sim::geluIsaName(*geluIsa) : "scalar (libm's erff and expf per element)");
  // A core's FMA rate is its clock x FMA pipes x lanes x 2 flops; the chains measure that product
  // directly, on every core the block uses at once (a core may clock lower when all are busy).
  if (peak.gflops > 0)
    std::printf("# peak: %d core(s)' fp32 FMA rate, %s, 12 independent chains on each at once: %.1f GF/s\n"
                "# (%.1f GF/s a core: clock x FMA pipes = %.2f G/s at %d lanes x 2 flops; measured now)\n",
                cores, peak.unit, peak.gflops, peak.gflops / cores, peak.gflops / cores / (2.0 * peak.lanes),
                peak.lanes);
  else
    std::printf("# peak: not measured (this core has no FMA instruction tpsim knows)\n");
  std::printf("# GF/s: the 6 GEMMs' 12·tokens·h·F flops over sim(ms); %%peak: GF/s over the peak\n");
  std::printf("#%7s %6s %6s %4s %12s %12s %10s %9s %7s\n", "tokens", "h", "F", "T", "sim(ms)", "eigen(ms)",
              "sim/eigen", "GF/s", "%peak");
  for (auto [m, h, f] : {std::tuple{c.tokens, c.hidden, c.ffn}, std::tuple{std::int64_t(64), std::int64_t(32),
                                                                           std::int64_t(128)}}) {
    const bool tiny = m * h * f < 1e7;
    const int reps = tiny ? 50 : c.mlpReps;
    const double eigen = eigenMlp(m, h, f, reps, threads);
    for (int T : c.mlpTp) {
      if (m % T || f % T) continue;
      const double sim = simMlp(T, threads, m, h, f, reps);
      const double rate = 12.0 * double(m) * double(h) * double(f) / sim / 1e9;
      std::printf(" %7lld %6lld %6lld %4d %12.3f %12.3f %9.3fx %9.1f %6.1f%%\n", (long long)m, (long long)h,
                  (long long)f, T, sim * 1e3, eigen * 1e3, sim / eigen, rate,
                  peak.gflops > 0 ? 100 * rate / peak.gflops : 0.0);
    }
  }
}
}  // namespace

BenchArgs parseBenchArgs(const std::vector<std::string>& args) {
  BenchArgs out;
  BenchConfig& c = out.sim;
  GpuBenchConfig& g = out.gpu;  // its defaults, where --backend gpu differs from the simulator's
  std::string backend = "sim", ranks = "2..1024", minBytes = "1M", maxBytes = "64M", mlpTp = "1,2,4,8",
              fabricRanks = "2,4,8";
  auto gpuDefault = [](const std::string& help, const std::string& value) { return help + "; gpu: " + value; };
  po::options_description run("Run");
  run.add_options()
      ("help,h", "show this help")
      ("backend,B", po::value(&backend)->default_value(backend),
       "sim | gpu (gpu: the layers and the DeviceFabric on one CUDA GPU)")
      ("what,W", po::value(&c.what)->default_value(c.what),
       "sim: latency | bandwidth | gemm | mlp | all, or mpi (under mpirun: the session's collectives across "
       "processes against MPI's); gpu: layers | fabric | all")
      ("threads,t", po::value(&c.threads)->default_value(c.threads), "threads (0 = every core; latency: min(cores, ranks))")
      ("warmup,w", po::value(&g.warmup)->default_value(g.warmup),
       "gpu: untimed steps (layers) and collectives (fabric) before timing");
  po::options_description size("Problem size");
  size.add_options()
      ("ranks,r", po::value(&ranks)->default_value(ranks), "latency: rank counts, 2..1024 (powers of 2) or 2,8,64")
      ("iters,i", po::value(&c.iters)->default_value(c.iters), "latency: collectives per measurement")
      ("bw-ranks,p", po::value(&c.bwRanks)->default_value(c.bwRanks), "bandwidth: number of ranks")
      ("fabric-ranks,R", po::value(&fabricRanks)->default_value(fabricRanks), "gpu fabric: rank counts")
      ("min-bytes,b", po::value(&minBytes)->default_value(minBytes),
       "bandwidth, fabric: smallest size (K/M/G); mpi: the smallest power of 4 >= 4·processes")
      ("max-bytes,e", po::value(&maxBytes)->default_value(maxBytes),
       gpuDefault("bandwidth, fabric: largest size (K/M/G)", sizeText(g.maxBytes)).c_str())
      ("bw-iters,n", po::value(&c.bwIters)->default_value(c.bwIters),
       gpuDefault("bandwidth, fabric: iterations per size; mpi: 10, their median", std::to_string(g.iters)).c_str())
      ("gemm-reps,g", po::value(&c.gemmReps)->default_value(c.gemmReps), "gemm: timed samples (best is kept)")
      ("tokens,m", po::value(&c.tokens)->default_value(c.tokens),
       gpuDefault("mlp, layers: tokens s·b", std::to_string(g.tokens)).c_str())
      ("hidden,k", po::value(&c.hidden)->default_value(c.hidden),
       gpuDefault("mlp, layers: hidden size h", std::to_string(g.hidden)).c_str())
      ("ffn,f", po::value(&c.ffn)->default_value(c.ffn),
       gpuDefault("mlp, layers: ffn hidden size F", std::to_string(g.ffn)).c_str())
      ("mlp-tp", po::value(&mlpTp)->default_value(mlpTp), "mlp, layers: TP sizes")
      ("mlp-reps", po::value(&c.mlpReps)->default_value(c.mlpReps),
       gpuDefault("mlp: timed samples (best is kept); layers: timed steps (best and median)",
                  std::to_string(g.steps)).c_str());
  po::options_description all("tpsim bench [options]");
  all.add(run).add(size);
  const po::variables_map vm = parseOptions(args, all);
  if (vm.count("help")) {
    std::ostringstream help;
    help << all << "\n";
    out.help = help.str();
    return out;
  }
  if (!isBackendName(backend)) throw UsageError{"--backend: expected sim or gpu, got '" + backend + "'"};
  if (c.threads < 0 || c.threads > kMaxThreads)
    throw UsageError{"--threads: expected 0.." + std::to_string(kMaxThreads) + " (0 = every core), got " +
                     std::to_string(c.threads)};
  out.gpuBackend = backend == "gpu";
  if (out.gpuBackend) {
    auto given = [&](const char* name) { return !vm[name].defaulted(); };
    g.what = c.what;
    g.threads = c.threads;
    g.tp = parseIntList("mlp-tp", mlpTp);
    g.fabricRanks = parseIntList("fabric-ranks", fabricRanks);
    g.minBytes = parseSize("min-bytes", minBytes);
    if (given("max-bytes")) g.maxBytes = parseSize("max-bytes", maxBytes);
    if (given("bw-iters")) g.iters = c.bwIters;
    if (given("tokens")) g.tokens = c.tokens;
    if (given("hidden")) g.hidden = c.hidden;
    if (given("ffn")) g.ffn = c.ffn;
    if (given("mlp-reps")) g.steps = c.mlpReps;
    if (g.what != "all" && g.what != "layers" && g.what != "fabric")
      throw UsageError{"--what: with --backend gpu expected layers, fabric or all, got '" + g.what + "'"};
    if (g.tokens < 1 || g.hidden < 1 || g.ffn < 1 || g.steps < 1 || g.iters < 1 || g.warmup < 0)
      throw UsageError{"--tokens, --hidden, --ffn, --mlp-reps and --bw-iters must be >= 1, --warmup >= 0"};
    for (int T : g.tp)
      if (T > 64 || g.tokens % T || g.ffn % T)
        throw UsageError{"--mlp-tp: every TP size must be <= 64 and divide --tokens and --ffn, got " +
                         std::to_string(T) + " for tokens " + std::to_string(g.tokens) + " and ffn " +
                         std::to_string(g.ffn)};
    const int maxRanks = *std::max_element(g.fabricRanks.begin(), g.fabricRanks.end());
    if (maxRanks > 64)
      throw UsageError{"--fabric-ranks: at most 64 ranks share one GPU, got " + std::to_string(maxRanks)};
    if (g.minBytes < 4 * maxRanks || g.maxBytes < g.minBytes)
      throw UsageError{"--min-bytes/--max-bytes: expected 4·fabric-ranks <= min <= max, got " + minBytes + " and " +
                       sizeText(g.maxBytes)};
    if (const std::string whyNot = backendUnusableReason("gpu"); !whyNot.empty())
      throw UsageError{"--backend gpu: cannot run here: " + whyNot};
    return out;
  }
  if (c.what == "mpi") {
    // One rank per process; without a launcher (or MPI in the build) there is nothing to cross.
    const int p = jobProcesses();
    if (p < 2)
      throw UsageError{"--what mpi: expected an MPI job of 2 or more processes (mpirun -np 2 tpsim bench --what mpi, "
                       "in a build with MPI), got " + std::to_string(p) + " process"};
    if (vm["min-bytes"].defaulted()) {
      c.minBytes = 4;
      while (c.minBytes < 4LL * p) c.minBytes *= 4;
    } else {
      c.minBytes = parseSize("min-bytes", minBytes);
    }
    c.maxBytes = parseSize("max-bytes", maxBytes);
    if (vm["bw-iters"].defaulted()) c.bwIters = 10;
    if (c.minBytes < 4LL * p || c.maxBytes < c.minBytes)
      throw UsageError{"--min-bytes/--max-bytes: with --what mpi expected 4·processes (" + std::to_string(4 * p) +
                       ") <= min <= max, got " + sizeText(c.minBytes) + " and " + sizeText(c.maxBytes)};
    // MPI's counts are int.
    if (c.maxBytes > (2LL << 30))
      throw UsageError{"--max-bytes: with --what mpi expected at most 2G, got " + sizeText(c.maxBytes)};
    if (c.bwIters < 1) throw UsageError{"--bw-iters: expected >= 1, got " + std::to_string(c.bwIters)};
    c.ranksText = "-";
    return out;
  }
  c.ranks = parseIntList("ranks", ranks);
  // The baseline starts one OS thread per rank.
  if (const int most = *std::max_element(c.ranks.begin(), c.ranks.end()); most > 1024)
    throw UsageError{"--ranks: expected rank counts <= 1024, got " + std::to_string(most)};
  c.ranksText = ranks;
  c.mlpTp = parseIntList("mlp-tp", mlpTp);
  c.minBytes = parseSize("min-bytes", minBytes);
  c.maxBytes = parseSize("max-bytes", maxBytes);
  if (c.what != "all" && c.what != "latency" && c.what != "bandwidth" && c.what != "gemm" && c.what != "mlp")
    throw UsageError{"--what: expected latency, bandwidth, gemm, mlp, all or mpi, got '" + c.what + "'"};
  if (c.tokens < 1 || c.hidden < 1 || c.ffn < 1 || c.mlpReps < 1)
    throw UsageError{"--tokens, --hidden, --ffn and --mlp-reps must be >= 1"};
  if (c.iters < 10) throw UsageError{"--iters: expected >= 10, got " + std::to_string(c.iters)};
  if (c.bwRanks < 1 || c.bwRanks > 1024)
    throw UsageError{"--bw-ranks: expected 1..1024, got " + std::to_string(c.bwRanks)};
  if (c.minBytes < 4LL * c.bwRanks || c.maxBytes < c.minBytes)
    throw UsageError{"--min-bytes/--max-bytes: expected 4·bw-ranks <= min <= max, got " + minBytes + " and " +
                     maxBytes};
  if (c.bwIters < 1 || c.gemmReps < 1) throw UsageError{"--bw-iters and --gemm-reps must be >= 1"};
  // A TP size that cannot split the block would leave its row out: refused, not an empty table.
  for (int T : c.mlpTp)
    if (T < 1 || T > 64 || c.tokens % T || c.ffn % T)
      throw UsageError{"--mlp-tp: expected TP sizes in 1..64 that divide --tokens and --ffn, got " +
                       std::to_string(T) + " for tokens " + std::to_string(c.tokens) + " and ffn " +
                       std::to_string(c.ffn)};
  return out;
}

int benchMain(const std::vector<std::string>& args) {
  const BenchArgs parsed = parseBenchArgs(args);
  if (!parsed.help.empty()) {
    std::cout << parsed.help;
    return 0;
  }
#if TPSIM_HAVE_GPU
  if (parsed.gpuBackend) return benchGpu(parsed.gpu);  // parseBenchArgs refused it where it cannot run
#endif
  const BenchConfig& c = parsed.sim;
  if (c.what == "mpi") {
    std::printf("# tpsim bench: what=mpi processes=%d bytes=%s..%s iters=%d isa=%s\n", jobProcesses(),
                sizeText(c.minBytes).c_str(), sizeText(c.maxBytes).c_str(), c.bwIters, TPSIM_ISA);
#if TPSIM_HAVE_MPI
    return benchMpi(c.minBytes, c.maxBytes, c.bwIters) == 0 ? 0 : 1;
#endif
  }
  if (c.what == "all" || c.what == "bandwidth") checkBandwidthMemory(c);
  std::printf("# tpsim bench: what=%s threads=%d (hardware %u) ranks=%s iters=%d bw-ranks=%d bytes=%s..%s isa=%s\n",
              c.what.c_str(), c.threads, std::thread::hardware_concurrency(), c.ranksText.c_str(), c.iters, c.bwRanks,
              sizeText(c.minBytes).c_str(), sizeText(c.maxBytes).c_str(), TPSIM_ISA);
  if (c.what == "all" || c.what == "latency") benchLatency(c);
  long wrong = 0;
  if (c.what == "all" || c.what == "bandwidth") wrong = benchBandwidth(c);
  if (c.what == "all" || c.what == "gemm") benchGemm(c);
  if (c.what == "all" || c.what == "mlp") benchMlp(c);
  return wrong == 0 ? 0 : 1;
}

}  // namespace tpsim::tools
