// Stopping from outside (backends/stop.h): a set flag stops a world at its ranks' next collective
// or GEMM block, every rank returns, and run() throws Stopped; tasks not begun are skipped.
#include "backends/stop.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "sim/host_pool.h"
#include "sim/sim_compute.h"
#include "sim/world.h"

namespace tpsim {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// What run() threw, how long after the flag was set it returned, and what each rank ended with.
struct Stop {
  bool stopped = false;
  std::string what;
  milliseconds afterFlag{0};
};

// Runs fn on `size` ranks under a flag that another thread sets once `busy` says the ranks are at
// work (which a loaded machine can delay any length of time).
Stop runAndStop(int size, int threads, const std::function<void(RankContext&)>& fn,
                const std::function<bool()>& busy) {
  StopFlag flag{false};
  Clock::time_point setAt;
  std::thread setter([&] {
    while (!busy()) std::this_thread::sleep_for(milliseconds(1));
    setAt = Clock::now();
    flag.store(true);
  });
  Stop out;
  {
    const StopScope scope(&flag);
    WorldOptions o;
    o.size = size;
    o.threads = threads;
    try {
      sim::World(o).run(fn);
    } catch (const Stopped& e) {
      out.stopped = true;
      out.what = e.what();
    }
  }
  const auto end = Clock::now();
  setter.join();
  out.afterFlag = std::chrono::duration_cast<milliseconds>(end - setAt);
  return out;
}

TEST(Stop, StopsRanksThatOnlyIssueCollectives) {
  for (int threads : {1, 2}) {
    std::vector<std::string> caught(4);
    std::atomic<int> returned{0}, waited{0};
    const Stop s = runAndStop(
        4, threads,
        [&](RankContext& ctx) {
          Tensor x = ctx.compute.zeros({64}, DType::kFloat32);
          try {
            for (;;) {
              ctx.comm.allReduce(x)->wait();
              ++waited;
            }
          } catch (const CollectiveError& e) {
            caught[std::size_t(ctx.comm.rank())] = collectiveFailureName(e.kind());
            ++returned;
            throw;
          }
        },
        [&] { return waited.load() >= 100; });
    ASSERT_TRUE(s.stopped) << "threads " << threads;
    EXPECT_EQ(s.what, "sim: stopped from outside");
    EXPECT_LT(s.afterFlag, milliseconds(1000)) << "threads " << threads;
    EXPECT_EQ(returned.load(), 4) << "every rank returned";
    for (int r = 0; r < 4; ++r) EXPECT_EQ(caught[std::size_t(r)], "stopped") << "rank " << r;
  }
}

TEST(Stop, StopsARankInsideALongRunOfGemms) {
  std::atomic<long> gemms{0};
  const Stop s = runAndStop(
      2, 2,
      [&](RankContext& ctx) {
        Tensor a = ctx.compute.zeros({1024, 1024}, DType::kFloat32);
        Tensor c = ctx.compute.zeros({1024, 1024}, DType::kFloat32);
        if (ctx.comm.rank() == 0)
          for (;;) {  // never reaches a collective: only the GEMMs' blocks can stop it
            ctx.compute.gemm(a, a, c);
            ++gemms;
          }
        ctx.comm.barrier()->wait();
      },
      [&] { return gemms.load() >= 1; });
  ASSERT_TRUE(s.stopped);
  EXPECT_EQ(s.what, "sim: stopped from outside");
  EXPECT_LT(s.afterFlag, milliseconds(1000));
}

TEST(Stop, EveryGemmIsAProgressPoint) {
  StopFlag flag{false};
  const StopScope scope(&flag);
  for (sim::GemmKernel kernel : {sim::GemmKernel::kEigen, sim::bestGemmKernel()})
    for (DType dtype : {DType::kFloat32, DType::kFloat64}) {
      sim::SimCompute compute(nullptr, kernel);
      Tensor a = compute.zeros({64, 64}, dtype), c = compute.zeros({64, 64}, dtype);
      flag.store(false);
      EXPECT_NO_THROW(compute.gemm(a, a, c));
      flag.store(true);
      EXPECT_THROW(compute.gemm(a, a, c), Stopped) << sim::gemmKernelName(kernel) << " " << dtypeName(dtype);
    }
}

TEST(Stop, AnUnsetFlagChangesNothing) {
  StopFlag flag{false};
  const StopScope scope(&flag);
  WorldOptions o;
  o.size = 3;
  std::atomic<int> sum{0};
  sim::World(o).run([&](RankContext& ctx) {
    Tensor x = ctx.compute.empty({1}, DType::kFloat32);
    ctx.compute.fill(x, double(ctx.comm.rank()));
    ctx.comm.allReduce(x)->wait();
    float v;
    ctx.compute.download(x, &v);
    sum += int(v);
  });
  EXPECT_EQ(sum.load(), 3 * (0 + 1 + 2));
}

TEST(Stop, TasksNotBegunThrowStoppedWithAnyNumberOfHelpers) {
  for (int helpers : {0, 1, 3}) {
    sim::HostPool pool(helpers);
    StopFlag flag{false};
    const StopScope scope(&flag);
    std::atomic<int> ran{0};
    // One caller thread claims tasks in order; helpers may have claimed a few more already.
    EXPECT_THROW(sim::runTasks(helpers ? &pool : nullptr, 1000,
                               [&](std::int64_t i) {
                                 ++ran;
                                 if (i == 10) flag.store(true);
                               }),
                 Stopped)
        << "helpers " << helpers;
    EXPECT_GE(ran.load(), 11);
    EXPECT_LE(ran.load(), 11 + helpers) << "helpers " << helpers;
  }
}

TEST(Stop, ScopesNestAndRestore) {
  StopFlag outer{false}, inner{true};
  EXPECT_EQ(currentStopFlag(), nullptr);
  {
    const StopScope a(&outer);
    {
      const StopScope b(&inner);
      EXPECT_EQ(currentStopFlag(), &inner);
      EXPECT_THROW(throwIfStopped(currentStopFlag(), "here"), Stopped);
    }
    EXPECT_EQ(currentStopFlag(), &outer);
    EXPECT_NO_THROW(throwIfStopped(currentStopFlag(), "here"));
  }
  EXPECT_EQ(currentStopFlag(), nullptr);
  try {
    throwIfStopped(&inner, "tpsim run");
  } catch (const Stopped& e) {
    EXPECT_STREQ(e.what(), "tpsim run: stopped from outside");
  }
}

}  // namespace
}  // namespace tpsim
