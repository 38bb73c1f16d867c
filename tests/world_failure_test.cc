// Nothing hangs: every failure mode of the simulated fabric becomes a named error on every rank
// within a bounded time (mismatch, failed peer, deadlock, stuck rank, dropped Work).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

#include "sim/world.h"
#include "tests/sim_test_util.h"

namespace tpsim {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using ::testing::HasSubstr;

struct Outcome {
  WorldError error;
  milliseconds elapsed;
};

// Runs fn and returns the WorldError it must throw, with the wall time it took.
Outcome runExpectingFailure(WorldOptions o, const std::function<void(RankContext&)>& fn) {
  const auto start = Clock::now();
  try {
    sim::World(o).run(fn);
  } catch (const WorldError& e) {
    return {e, std::chrono::duration_cast<milliseconds>(Clock::now() - start)};
  }
  ADD_FAILURE() << "run() returned normally";
  return {WorldError("", {}, false, CollectiveFailure::kPeerFailed), milliseconds(0)};
}

WorldOptions options(int size, int threads = 0, milliseconds timeout = milliseconds(60'000)) {
  WorldOptions o;
  o.size = size;
  o.threads = threads;
  o.timeout = timeout;
  return o;
}

class FailureTest : public ::testing::TestWithParam<int> {};  // worker threads

TEST_P(FailureTest, MismatchedOpsNameWhatEachRankIssued) {
  auto [error, elapsed] = runExpectingFailure(options(3, GetParam()), [](RankContext& ctx) {
    Tensor x = ctx.compute.zeros({4}, DType::kFloat32);
    Tensor y = ctx.compute.zeros({12}, DType::kFloat32);
    ctx.comm.allReduce(x)->wait();  // seq 0 agrees
    if (ctx.comm.rank() == 1)
      ctx.comm.allGather(x, y)->wait();
    else
      ctx.comm.allReduce(x)->wait();
  });
  EXPECT_TRUE(error.causeIsCollective());
  EXPECT_EQ(error.kind(), CollectiveFailure::kMismatch);
  EXPECT_THAT(error.what(), HasSubstr("collective mismatch on world[0-2] at seq 1"));
  EXPECT_THAT(error.what(), HasSubstr("rank 1 issued allGather(fp32 x4 -> x12)"));
  EXPECT_THAT(error.what(), HasSubstr("issued allReduce(sum, fp32 x4)"));
  for (const auto& e : error.rankErrors()) EXPECT_THAT(e, HasSubstr("collective mismatch")) << "every rank errs";
}

TEST_P(FailureTest, MismatchedDtypeCountRootAndReduceOpAreCaught) {
  using Issue = std::function<void(RankContext&, int)>;
  const std::vector<std::pair<Issue, std::string>> cases = {
      {[](RankContext& c, int r) {
         Tensor x = c.compute.zeros({4}, r ? DType::kBFloat16 : DType::kFloat32);
         c.comm.allReduce(x)->wait();
       }, "allReduce(sum, bf16 x4)"},
      {[](RankContext& c, int r) {
         Tensor x = c.compute.zeros({r ? 5 : 4}, DType::kFloat32);
         c.comm.allReduce(x)->wait();
       }, "allReduce(sum, fp32 x5)"},
      {[](RankContext& c, int r) {
         Tensor x = c.compute.zeros({4}, DType::kFloat32);
         c.comm.broadcast(x, x, BroadcastOptions{r})->wait();
       }, "broadcast(root 1, fp32 x4)"},
      {[](RankContext& c, int r) {
         Tensor x = c.compute.zeros({4}, DType::kFloat32);
         c.comm.allReduce(x, AllReduceOptions{r ? ReduceOp::kMean : ReduceOp::kSum})->wait();
       }, "allReduce(mean, fp32 x4)"},
  };
  for (const auto& [issue, expected] : cases) {
    auto [error, elapsed] = runExpectingFailure(options(2, GetParam()),
                                                [&](RankContext& ctx) { issue(ctx, ctx.comm.rank()); });
    EXPECT_EQ(error.kind(), CollectiveFailure::kMismatch) << expected;
    EXPECT_THAT(error.what(), HasSubstr("rank 1 issued " + expected));
  }
}

TEST_P(FailureTest, ThrowingRankFailsPendingAndFutureCollectivesOfPeers) {
  std::mutex mu;
  std::vector<std::string> seen(4);
  auto [error, elapsed] = runExpectingFailure(options(4, GetParam()), [&](RankContext& ctx) {
    const int r = ctx.comm.rank();
    auto sync = ctx.comm.split(0, r, "sync");  // a second communicator over the same ranks
    Tensor x = ctx.compute.zeros({2}, DType::kFloat32);
    ctx.comm.allReduce(x)->wait();
    if (r == 3) {
      sync->barrier()->wait();  // returns once the peers' next world collective is pending
      throw std::runtime_error("boom on purpose");
    }
    auto pending = ctx.comm.allReduce(x);  // rank 3 never issues it
    sync->barrier()->wait();
    try {
      pending->wait();
    } catch (const CollectiveError& e) {
      EXPECT_EQ(e.kind(), CollectiveFailure::kPeerFailed);
      std::lock_guard<std::mutex> lock(mu);
      seen[r] = e.what();
    }
    ctx.comm.barrier()->wait();  // future collectives throw too
    ADD_FAILURE() << "barrier after a peer failed must throw";
  });
  EXPECT_FALSE(error.causeIsCollective());
  EXPECT_THAT(error.what(), HasSubstr("rank 3 failed: boom on purpose"));
  EXPECT_EQ(error.rankErrors()[3], "boom on purpose");
  for (int r : {0, 1, 2}) {
    EXPECT_EQ(seen[r], "peer rank 3 failed: boom on purpose") << "rank " << r;
    EXPECT_EQ(error.rankErrors()[r], "peer rank 3 failed: boom on purpose") << "rank " << r;
  }
  EXPECT_LT(elapsed, milliseconds(5000));
}

TEST_P(FailureTest, RankThatReturnsEarlyIsADeadlockReportedAtOnce) {
  auto [error, elapsed] = runExpectingFailure(options(3, GetParam()), [](RankContext& ctx) {
    if (ctx.comm.rank() == 1) return;
    Tensor x = ctx.compute.zeros({2}, DType::kFloat32);
    ctx.comm.allReduce(x)->wait();
  });
  EXPECT_EQ(error.kind(), CollectiveFailure::kDeadlock);
  EXPECT_THAT(error.what(), HasSubstr("deadlock: every live rank is blocked"));
  EXPECT_THAT(error.what(), HasSubstr("rank 0 waits on allReduce(sum, fp32 x2) on world[0-2] (seq 0)"));
  EXPECT_THAT(error.what(), HasSubstr("rank 1 has not issued it: it finished"));
  EXPECT_LT(elapsed, milliseconds(2000)) << "a deadlock is reported at once, not after the timeout";
}

TEST_P(FailureTest, CrossedWaitsOnTwoGroupsAreADeadlock) {
  auto [error, elapsed] = runExpectingFailure(options(2, GetParam()), [](RankContext& ctx) {
    const int r = ctx.comm.rank();
    auto other = ctx.comm.split(0, r, "pair");
    Tensor x = ctx.compute.zeros({1}, DType::kFloat32);
    // Rank 0 waits on the world group, rank 1 on "pair": each needs the other to issue first.
    if (r == 0) ctx.comm.allReduce(x)->wait(); else other->allReduce(x)->wait();
  });
  EXPECT_EQ(error.kind(), CollectiveFailure::kDeadlock);
  EXPECT_THAT(error.what(), HasSubstr("rank 0 waits on allReduce(sum, fp32 x1) on world[0,1]"));
  EXPECT_THAT(error.what(), HasSubstr("rank 1 waits on allReduce(sum, fp32 x1) on pair[0,1]"));
  EXPECT_LT(elapsed, milliseconds(2000));
}

TEST_P(FailureTest, StuckRankHitsTheTimeoutOnItsPeers) {
  // Rank 1 sleeps far past the timeout outside any collective; its peers must give up at the
  // timeout and name it. shared_ptr state: a stuck rank may outlive this test's stack.
  auto release = std::make_shared<std::atomic<bool>>(false);
  auto peerErrorAt = std::make_shared<std::atomic<long>>(-1);
  const auto start = Clock::now();
  auto [error, elapsed] = runExpectingFailure(options(2, GetParam(), milliseconds(200)), [=](RankContext& ctx) {
    Tensor x = ctx.compute.zeros({1}, DType::kFloat32);
    if (ctx.comm.rank() == 1) {
      for (int i = 0; i < 100 && !*release; ++i) std::this_thread::sleep_for(milliseconds(10));
      return;
    }
    try {
      ctx.comm.allReduce(x)->wait();
    } catch (const CollectiveError&) {
      *peerErrorAt = long(std::chrono::duration_cast<milliseconds>(Clock::now() - start).count());
      *release = true;
      throw;
    }
  });
  EXPECT_EQ(error.kind(), CollectiveFailure::kTimeout);
  EXPECT_THAT(error.what(), HasSubstr("timeout: allReduce(sum, fp32 x1) on world[0,1] (seq 0) waited more "
                                      "than 200 ms"));
  EXPECT_THAT(error.what(), HasSubstr("rank 1 has not issued it: it is running (outside collectives)"));
  if (GetParam() == 1) {
    // One worker: the peer can run only after the stuck rank yields, so run() gives up on the
    // stuck rank one timeout after the failure and says so.
    EXPECT_THAT(error.rankErrors()[1], HasSubstr("did not return within 200 ms after the failure"));
    // The abandoned worker finishes on its own once rank 1 returns; let it, so the run's state is
    // freed before the process exits (LeakSanitizer).
    for (int i = 0; i < 300 && *peerErrorAt < 0; ++i) std::this_thread::sleep_for(milliseconds(10));
    std::this_thread::sleep_for(milliseconds(100));
  } else {
    EXPECT_GE(*peerErrorAt, 200);
    EXPECT_LT(*peerErrorAt, 1000);
  }
  EXPECT_LT(elapsed, milliseconds(3000));
}

TEST_P(FailureTest, DroppedWorkIsReportedOnEveryRank) {
  auto [error, elapsed] = runExpectingFailure(options(2, GetParam()), [](RankContext& ctx) {
    Tensor x = ctx.compute.zeros({3}, DType::kFloat32);
    if (ctx.comm.rank() == 0) {
      auto forgotten = ctx.comm.allReduce(x);  // destroyed without wait()
    } else {
      ctx.comm.allReduce(x)->wait();
    }
    ctx.comm.barrier()->wait();
  });
  EXPECT_EQ(error.kind(), CollectiveFailure::kDroppedWork);
  EXPECT_THAT(error.what(), HasSubstr("rank 0 destroyed the Work of allReduce(sum, fp32 x3) on world[0,1] "
                                      "(seq 0) without wait()"));
}

TEST_P(FailureTest, WorkAbandonedDuringUnwindingNeverTouchesFreedBuffers) {
  // Rank 0 issues, then throws before waiting: its buffer dies during unwinding. The collective
  // must not write into it when rank 1 arrives, and rank 1 must see rank 0's real error.
  auto [error, elapsed] = runExpectingFailure(options(2, GetParam()), [](RankContext& ctx) {
    if (ctx.comm.rank() == 0) {
      Tensor x = ctx.compute.zeros({1024}, DType::kFloat32);
      auto work = ctx.comm.allReduce(x);
      throw std::runtime_error("failed with a collective in flight");
    }
    std::this_thread::sleep_for(milliseconds(20));
    Tensor y = ctx.compute.zeros({1024}, DType::kFloat32);
    ctx.comm.allReduce(y)->wait();
  });
  EXPECT_THAT(error.what(), HasSubstr("rank 0 failed: failed with a collective in flight"));
  EXPECT_EQ(error.rankErrors()[1], "peer rank 0 failed: failed with a collective in flight");
}

TEST_P(FailureTest, CollectiveAbandonedByACaughtExceptionIsNamedInTheDeadlock) {
  // Rank 0's buffer dies while its allReduce is pending, and rank 0 carries on. When rank 1 arrives
  // the collective must not write into the freed buffer (ASan checks), and the hang that follows
  // is reported with the reason.
  auto abandoned = std::make_shared<std::atomic<bool>>(false);
  auto [error, elapsed] = runExpectingFailure(options(2, GetParam()), [=](RankContext& ctx) {
    if (ctx.comm.rank() == 0) {
      try {
        Tensor x = ctx.compute.zeros({1024}, DType::kFloat32);
        auto work = ctx.comm.allReduce(x);
        throw std::runtime_error("caught below");
      } catch (const std::runtime_error&) {
        *abandoned = true;
      }
      ctx.comm.barrier()->wait();
    } else {
      // Arrive only after rank 0 abandoned its half (rank 0 runs first on a single worker).
      for (int i = 0; i < 500 && !*abandoned; ++i) std::this_thread::sleep_for(milliseconds(2));
      Tensor y = ctx.compute.zeros({1024}, DType::kFloat32);
      ctx.comm.allReduce(y)->wait();
    }
  });
  EXPECT_EQ(error.kind(), CollectiveFailure::kDeadlock);
  EXPECT_THAT(error.what(), HasSubstr("rank 1 waits on allReduce(sum, fp32 x1024) on world[0,1] (seq 0); rank 0 "
                                      "abandoned it while unwinding an exception"));
}

TEST_P(FailureTest, BadArgumentsNameTheArgument) {
  auto [error, elapsed] = runExpectingFailure(options(2, GetParam()), [](RankContext& ctx) {
    Tensor x = ctx.compute.zeros({4}, DType::kFloat32);
    Tensor y = ctx.compute.zeros({5}, DType::kFloat32);
    ctx.comm.allGather(x, y)->wait();
  });
  EXPECT_THAT(error.rankErrors()[0], HasSubstr("allGather on world[0,1] (rank 0): out must have n·in = 2·4 "
                                               "elements, got fp32 (5,)"));
}

INSTANTIATE_TEST_SUITE_P(Threads, FailureTest, ::testing::Values(1, 2, 4),
                         [](const auto& info) { return "threads" + std::to_string(info.param); });

TEST(World, RejectsBadOptions) {
  EXPECT_THROW(sim::World(options(0)), InvalidArgument);
  EXPECT_THROW(sim::World(options(2, -1)), InvalidArgument);
  EXPECT_THROW(sim::World(options(2, 0, milliseconds(0))), InvalidArgument);
}

TEST(World, SixtyFourRanksOnFewThreads) {
  for (int threads : {1, 2}) {
    std::atomic<int> done{0};
    testing::runRanks(64, [&](RankContext& ctx) {
      Tensor x = ctx.compute.zeros({1}, DType::kFloat32);
      for (int i = 0; i < 200; ++i) ctx.comm.allReduce(x)->wait();
      ++done;
    }, threads);
    EXPECT_EQ(done, 64);
  }
}

TEST(World, RunCanBeRepeated) {
  sim::World world(options(3));
  for (int i = 0; i < 3; ++i)
    world.run([](RankContext& ctx) { ctx.comm.barrier()->wait(); });
}

}  // namespace
}  // namespace tpsim
