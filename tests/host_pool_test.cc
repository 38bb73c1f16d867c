// HostPool: every task runs once, errors reach the caller, helpers really run tasks, and a tiled
// GEMM is bitwise the same with any number of helpers (results never depend on --threads).
#include "sim/host_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <random>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include "backends/dtype.h"
#include "sim/sim_compute.h"
#include "sim/world.h"

namespace tpsim::sim {
namespace {

TEST(HostPool, RunsEveryTaskOnceForConcurrentCallers) {
  for (int helpers : {0, 1, 3}) {
    HostPool pool(helpers);
    constexpr int kCallers = 4, kTasks = 257;
    std::vector<std::vector<std::atomic<int>>> runs(kCallers);
    for (auto& r : runs) r = std::vector<std::atomic<int>>(kTasks);
    std::vector<std::thread> callers;
    for (int c = 0; c < kCallers; ++c)
      callers.emplace_back([&, c] {
        for (int round = 0; round < 20; ++round) pool.run(kTasks, [&](std::int64_t i) { ++runs[c][i]; });
      });
    for (auto& t : callers) t.join();
    for (int c = 0; c < kCallers; ++c)
      for (int i = 0; i < kTasks; ++i) ASSERT_EQ(runs[c][i].load(), 20) << "helpers " << helpers << " caller " << c;
  }
}

TEST(HostPool, RethrowsTheFirstErrorAfterEveryTaskRan) {
  for (HostPool* pool : {static_cast<HostPool*>(nullptr), new HostPool(2)}) {
    std::atomic<int> ran{0};
    EXPECT_THROW(runTasks(pool, 50,
                          [&](std::int64_t i) {
                            ++ran;
                            if (i % 10 == 3) throw std::runtime_error("task failed");
                          }),
                 std::runtime_error);
    EXPECT_EQ(ran.load(), 50);
    delete pool;
  }
}

// Two tasks that each wait for the other to start can only finish if a helper runs one of them.
TEST(HostPool, HelpersRunTasksAlongsideTheCaller) {
  HostPool pool(1);
  std::atomic<int> started{0};
  std::set<std::thread::id> threads;
  std::mutex mu;
  pool.run(2, [&](std::int64_t) {
    {
      std::lock_guard<std::mutex> lock(mu);
      threads.insert(std::this_thread::get_id());
    }
    ++started;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (started.load() < 2 && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
  });
  EXPECT_EQ(started.load(), 2);
  EXPECT_EQ(threads.size(), 2u) << "both tasks ran on one thread: the helper never took a task";
}

// A world runs min(threads, size) ranks at once and lends its other threads to the GEMM tiles.
TEST(HostPool, WorldLendsTheThreadsNoRankUsesToGemms) {
  const int cores = std::max(1, int(std::thread::hardware_concurrency()));
  struct Case {
    int size, threads, helpers;
  };
  for (const Case& c : {Case{1, 3, 2}, Case{2, 2, 0}, Case{2, 5, 3}, Case{8, 4, 0},
                        Case{1, 0, cores - 1}, Case{64, 0, 0}}) {
    WorldOptions o;
    o.size = c.size;
    o.threads = c.threads;
    std::atomic<int> wrong{0};
    World(o).run([&](RankContext& ctx) {
      HostPool* pool = dynamic_cast<SimCompute&>(ctx.compute).pool();
      if ((pool ? pool->helpers() : 0) != c.helpers) ++wrong;
    });
    EXPECT_EQ(wrong.load(), 0) << "size " << c.size << " threads " << c.threads << ": expected " << c.helpers
                               << " helpers";
  }
}

// c = a·b for a product large enough to be tiled, with c row-major, column-major and 16-bit.
TEST(HostPool, TiledGemmIsBitwiseTheSameForAnyNumberOfHelpers) {
  struct Case {
    std::int64_t m, k, n;
    bool cTransposed;
    DType out;
  };
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  for (const Case& g : {Case{1024, 160, 700, false, DType::kFloat32}, Case{600, 200, 1100, true, DType::kFloat32},
                        Case{700, 128, 520, false, DType::kBFloat16}}) {
    ASSERT_GE(double(g.m) * double(g.n) * double(g.k), SimCompute::kGemmTiledMacs);
    std::vector<float> a(std::size_t(g.m * g.k)), b(std::size_t(g.k * g.n));
    for (float& v : a) v = normal(rng);
    for (float& v : b) v = normal(rng);
    // 16-bit c takes 16-bit a and b.
    std::vector<std::uint16_t> a16, b16;
    for (float v : a) a16.push_back(floatToBf16(v));
    for (float v : b) b16.push_back(floatToBf16(v));
    const bool half = g.out == DType::kBFloat16;
    ConstView av = half ? ConstView(a16.data(), Shape{g.m, g.k}, g.out) : ConstView(a.data(), Shape{g.m, g.k}, g.out);
    ConstView bv = half ? ConstView(b16.data(), Shape{g.k, g.n}, g.out) : ConstView(b.data(), Shape{g.k, g.n}, g.out);
    std::vector<std::vector<char>> results;
    for (int helpers : {0, 1, 3}) {
      HostPool pool(helpers);
      SimCompute compute(helpers ? &pool : nullptr);
      const std::size_t bytes = std::size_t(g.m * g.n) * dtypeSize(g.out);
      std::vector<char> c(bytes);
      View cv = g.cTransposed ? View(c.data(), Shape{g.n, g.m}, g.out).t() : View(c.data(), Shape{g.m, g.n}, g.out);
      compute.gemm(av, bv, cv);
      results.push_back(c);
    }
    EXPECT_EQ(results[0], results[1]) << "1 helper differs from none, m=" << g.m;
    EXPECT_EQ(results[0], results[2]) << "3 helpers differ from none, m=" << g.m;
    if (g.out == DType::kFloat32 && !g.cTransposed) {  // and the tiles add up to the product
      std::vector<float> c(std::size_t(g.m * g.n));
      std::memcpy(c.data(), results[0].data(), c.size() * sizeof(float));
      for (std::int64_t i : {std::int64_t(0), g.m / 2, g.m - 1})
        for (std::int64_t j : {std::int64_t(0), g.n / 3, g.n - 1}) {
          double want = 0, magnitude = 0;
          for (std::int64_t p = 0; p < g.k; ++p) {
            want += double(a[i * g.k + p]) * b[p * g.n + j];
            magnitude += std::fabs(double(a[i * g.k + p]) * b[p * g.n + j]);
          }
          EXPECT_NEAR(c[i * g.n + j], want, (g.k + 2) * 0x1p-24 * magnitude) << i << ", " << j;
        }
    }
  }
}

}  // namespace
}  // namespace tpsim::sim
