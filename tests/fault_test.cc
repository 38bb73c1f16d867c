// Injected faults (backends/fault.h): the plan's syntax, and what each fault looks like to the
// faulty rank's peers on a sim world: the failure kind, the message, and how soon it comes.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <tuple>
#include <vector>

#include "backends/fault.h"
#include "sim/world.h"

namespace tpsim {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using ::testing::AllOf;
using ::testing::AnyOf;
using ::testing::HasSubstr;

TEST(ParseFault, ReadsRankCollectiveAndKind) {
  const Fault f = parseFault("3:12:stall");
  EXPECT_EQ(f.rank, 3);
  EXPECT_EQ(f.collective, 12);
  EXPECT_EQ(f.kind, FaultKind::kStall);
  for (const char* kind : {"skip", "op", "count", "dtype", "group", "throw", "stall", "corrupt"})
    EXPECT_EQ(parseFault(std::string("0:1:") + kind).str(), std::string("0:1:") + kind);
  const Fault corrupt = parseFault("3:2:corrupt:17:5");
  EXPECT_EQ(corrupt.kind, FaultKind::kCorrupt);
  EXPECT_EQ(corrupt.element, 17);
  EXPECT_EQ(corrupt.bit, 5);
  EXPECT_EQ(corrupt.str(), "3:2:corrupt:17:5");
}

TEST(ParseFault, BadSpecsSayWhatWasExpectedAndWhatCame) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"1:2", "expected RANK:K:FAULT (three fields separated by ':'), got '1:2'"},
      {"1:2:skip:x", "expected RANK:K:FAULT (three fields separated by ':'), got '1:2:skip:x'"},
      {"x:2:skip", "expected RANK to be a rank number >= 0, got 'x' in 'x:2:skip'"},
      {"-1:2:skip", "expected RANK to be a rank number >= 0, got '-1'"},
      {"1:0:skip", "expected K >= 1 (the rank's K-th collective, counted from 1), got '0'"},
      {"1::skip", "expected K >= 1 (the rank's K-th collective, counted from 1), got ''"},
      {"1:2:explode", "expected FAULT to be skip, op, count, dtype, group, throw, stall or corrupt, got 'explode'"},
      {"1:2:skip:0:3", "expected RANK:K:FAULT (three fields separated by ':'), got '1:2:skip:0:3'"},
      {"1:2:corrupt:x:3", "expected ELEMENT to be a flat index >= 0, got 'x'"},
      {"1:2:corrupt:0:64", "expected BIT in 0..63, got '64'"},
  };
  for (const auto& [spec, message] : cases) {
    try {
      parseFault(spec);
      ADD_FAILURE() << spec << " was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_THAT(e.what(), HasSubstr(message)) << spec;
    }
  }
}

TEST(Faults, TheWorldRefusesAPlanOutsideIt) {
  WorldOptions o;
  o.size = 2;
  o.faults = {parseFault("2:1:skip")};
  EXPECT_THROW(sim::World{o}, InvalidArgument);
  o.faults = {parseFault("1:1:skip"), parseFault("1:1:throw")};
  EXPECT_THROW(sim::World{o}, InvalidArgument);
}

struct Outcome {
  bool failed = false;
  std::string what;
  CollectiveFailure kind = CollectiveFailure::kPeerFailed;
  bool collective = false;
  std::vector<std::string> rankErrors;
  milliseconds elapsed{0};
};

// Four ranks in two groups "tp" of two ({0,1}, {2,3}); each rank all-reduces and then all-gathers
// over its tp group. Rank 1's first collective is the allReduce, its second the allGather.
Outcome runWith(const std::string& fault, int threads, milliseconds timeout = milliseconds(60'000)) {
  WorldOptions o;
  o.size = 4;
  o.threads = threads;
  o.timeout = timeout;
  o.faults = {parseFault(fault)};
  Outcome out;
  const auto start = Clock::now();
  try {
    sim::World(o).run([](RankContext& ctx) {
      auto tp = ctx.comm.split(ctx.comm.rank() / 2, ctx.comm.rank(), "tp");
      Tensor x = ctx.compute.zeros({4}, DType::kFloat32);
      Tensor y = ctx.compute.zeros({8}, DType::kFloat32);
      tp->allReduce(x)->wait();
      tp->allGather(x, y)->wait();
    });
  } catch (const WorldError& e) {
    out = {true, e.what(), e.kind(), e.causeIsCollective(), e.rankErrors()};
  }
  out.elapsed = std::chrono::duration_cast<milliseconds>(Clock::now() - start);
  return out;
}

class FaultKinds : public ::testing::TestWithParam<int> {};  // worker threads

TEST_P(FaultKinds, SkipShiftsTheRanksLaterCollectives) {
  const Outcome o = runWith("1:1:skip", GetParam());
  ASSERT_TRUE(o.failed);
  EXPECT_EQ(o.kind, CollectiveFailure::kMismatch);
  EXPECT_THAT(o.what, HasSubstr("collective mismatch on tp[0,1] at seq 0"));
  EXPECT_THAT(o.what, HasSubstr("rank 1 issued allGather(fp32 x4 -> x8)"));
  EXPECT_THAT(o.what, HasSubstr("rank 1 1:1:skip: its collective 1, allReduce(sum, fp32 x4) on tp[0,1] (seq 0)"));
  EXPECT_LT(o.elapsed, milliseconds(1000));
}

TEST_P(FaultKinds, AnotherOpCountOrDtypeIsAMismatch) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"1:1:op", "rank 1 issued allGather(fp32 x4 -> x8)"},
      {"1:1:count", "rank 1 issued allReduce(sum, fp32 x5)"},
      {"1:1:dtype", "rank 1 issued allReduce(sum, bf16 x4)"},
      {"1:2:op", "rank 1 issued allReduce(sum, fp32 x4)"},
      {"1:2:count", "rank 1 issued allGather(fp32 x5 -> x10)"},
  };
  for (const auto& [fault, issued] : cases) {
    const Outcome o = runWith(fault, GetParam());
    ASSERT_TRUE(o.failed) << fault;
    EXPECT_EQ(o.kind, CollectiveFailure::kMismatch) << fault;
    EXPECT_THAT(o.what, HasSubstr(issued)) << fault;
    EXPECT_THAT(o.what, HasSubstr("rank 0 issued")) << fault;
    // Ranks 2 and 3 share no group with rank 1: they fail only if they had not finished by then.
    for (std::size_t r = 0; r < o.rankErrors.size(); ++r)
      if (r < 2 || !o.rankErrors[r].empty()) {
        EXPECT_THAT(o.rankErrors[r], HasSubstr("collective mismatch")) << fault << ", rank " << r;
      }
    EXPECT_LT(o.elapsed, milliseconds(1000)) << fault;
  }
}

TEST_P(FaultKinds, AnotherGroupIsADeadlock) {
  const Outcome o = runWith("1:1:group", GetParam());
  ASSERT_TRUE(o.failed);
  EXPECT_EQ(o.kind, CollectiveFailure::kDeadlock);
  EXPECT_THAT(o.what, HasSubstr("rank 0 waits on allReduce(sum, fp32 x4) on tp[0,1] (seq 0)"));
  EXPECT_THAT(o.what, HasSubstr("rank 1 has not issued it: it waits on allReduce(sum, fp32 x4) on world[0-3]"));
  EXPECT_LT(o.elapsed, milliseconds(1000));
}

TEST_P(FaultKinds, ThrowIsAPeerFailure) {
  const Outcome o = runWith("1:2:throw", GetParam());
  ASSERT_TRUE(o.failed);
  EXPECT_EQ(o.kind, CollectiveFailure::kPeerFailed);
  EXPECT_FALSE(o.collective);
  EXPECT_THAT(o.what, HasSubstr("rank 1 failed: injected fault: rank 1 throws at its collective 2, "
                                "allGather(fp32 x4 -> x8) on tp[0,1] (seq 1)"));
  EXPECT_THAT(o.rankErrors[0], HasSubstr("peer rank 1 failed: injected fault"));
  EXPECT_LT(o.elapsed, milliseconds(1000));
}

TEST_P(FaultKinds, StallEndsWithTheTimeout) {
  const Outcome o = runWith("1:2:stall", GetParam(), milliseconds(300));
  ASSERT_TRUE(o.failed);
  EXPECT_EQ(o.kind, CollectiveFailure::kTimeout);
  // Whichever clock started first ends the run: rank 0's wait for the allGather, or rank 1's stall.
  EXPECT_THAT(o.what,
              AnyOf(AllOf(HasSubstr("allGather(fp32 x4 -> x8) on tp[0,1] (seq 1) waited more than 300 ms"),
                          HasSubstr("rank 1 has not issued it: it stalls (an injected fault) before issuing its "
                                    "collective 2")),
                    HasSubstr("rank 1 stalled (an injected fault) for more than 300 ms before issuing its "
                              "collective 2, allGather(fp32 x4 -> x8) on tp[0,1] (seq 1)")));
  EXPECT_GE(o.elapsed, milliseconds(300));
  EXPECT_LT(o.elapsed, milliseconds(3000));
}

// corrupt flips exactly the bit it names in the faulty rank's result only, after the collective:
// every peer keeps the true sum, and the run itself does not fail.
TEST_P(FaultKinds, CorruptFlipsOneBitOfOneRanksResult) {
  for (const auto& [spec, element, bit] : {std::tuple{"1:1:corrupt", 0, 30}, std::tuple{"1:1:corrupt:3:5", 3, 5}}) {
    WorldOptions o;
    o.size = 2;
    o.threads = GetParam();
    o.faults = {parseFault(spec)};
    std::vector<std::uint32_t> bits[2];
    sim::World(o).run([&](RankContext& ctx) {
      const std::vector<float> mine = {1.5f, -2.f, 0.25f, 3.f};
      Tensor x = ctx.compute.empty({4}, DType::kFloat32);
      ctx.compute.upload(mine.data(), x);
      ctx.comm.allReduce(x)->wait();
      bits[ctx.comm.rank()].resize(4);
      ctx.compute.download(x, bits[ctx.comm.rank()].data());
    });
    for (int i = 0; i < 4; ++i)
      EXPECT_EQ(bits[1][i] ^ bits[0][i], i == element ? std::uint32_t(1) << bit : 0u) << spec << " element " << i;
  }
  WorldOptions o;
  o.size = 2;
  o.faults = {parseFault("0:1:corrupt:4:0")};  // a result of 4 elements has no element 4: bad input
  try {
    sim::World(o).run([](RankContext& ctx) { ctx.comm.allReduce(ctx.compute.zeros({4}, DType::kFloat32))->wait(); });
    ADD_FAILURE() << "a corrupt fault past the result was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("injected fault 0:1:corrupt:4:0: expected an element below 4 and a bit below 32"));
  }
}

INSTANTIATE_TEST_SUITE_P(Threads, FaultKinds, ::testing::Values(1, 2),
                         [](const auto& info) { return "threads" + std::to_string(info.param); });

TEST(Faults, AStallWithNobodyWaitingStillTimesOut) {
  WorldOptions o;
  o.size = 1;
  o.timeout = milliseconds(200);
  o.faults = {parseFault("0:1:stall")};
  try {
    sim::World(o).run([](RankContext& ctx) { ctx.comm.barrier()->wait(); });
    ADD_FAILURE() << "run() returned normally";
  } catch (const WorldError& e) {
    EXPECT_EQ(e.kind(), CollectiveFailure::kTimeout);
    EXPECT_THAT(e.what(), HasSubstr("rank 0 stalled (an injected fault) for more than 200 ms before issuing its "
                                    "collective 1, barrier() on world[0] (seq 0)"));
  }
}

// On a group of one nobody can notice another count; the collective moves no data.
TEST(Faults, AFaultyCollectiveThatCompletesMovesNoData) {
  WorldOptions o;
  o.size = 1;
  o.faults = {parseFault("0:1:count")};
  sim::World(o).run([](RankContext& ctx) {
    Tensor x = ctx.compute.zeros({4}, DType::kFloat32);
    Tensor y = ctx.compute.zeros({4}, DType::kFloat32);
    ctx.compute.fill(x, 1.0);
    ctx.comm.allReduce(x, y)->wait();
    float host[4];
    ctx.compute.download(y, host);
    EXPECT_EQ(host[0], 0.f);
  });
}

TEST(Faults, AFaultThatNeverFiresIsAnError) {
  WorldOptions o;
  o.size = 2;
  o.faults = {parseFault("1:5:skip")};
  try {
    sim::World(o).run([](RankContext& ctx) {
      Tensor x = ctx.compute.zeros({4}, DType::kFloat32);
      ctx.comm.allReduce(x)->wait();
    });
    ADD_FAILURE() << "run() returned normally";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("injected fault 1:5:skip never fired: rank 1 issued 1 collectives (group splits "
                                    "not counted); expected K <= 1"));
  }
}

}  // namespace
}  // namespace tpsim
