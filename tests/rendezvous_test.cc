// The rendezvous' contract with its transport, which every world (sim, gpu) relies on: each
// member's issue token reaches execute(), execute() runs once per collective after every member
// issued, its token reaches completed() on every member, and a transport that throws fails the
// world with the same kBackend error on every rank (and aborts the transport once). A Work dropped
// while its rank unwinds still reaches completed() when its collective was executed.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <mutex>
#include <vector>

#include "backends/world/rendezvous.h"
#include "sim/sim_compute.h"
#include "sim/world.h"

namespace tpsim {
namespace {

using ::testing::HasSubstr;

// A transport that records its calls and moves data with the host transport.
class RecordingTransport final : public world::Transport {
 public:
  explicit RecordingTransport(int failAtExecute = -1) : failAtExecute_(failAtExecute) {}
  Device device() const override { return Device::kHost; }
  world::TransportToken issued(int globalRank) override {
    std::lock_guard<std::mutex> lock(mu_);
    return std::make_shared<int>(globalRank * 1000 + int(issuedCount_++));
  }
  world::TransportToken execute(const world::Collective& c) override {
    const int index = int(executed_.size());
    executed_.push_back(c);
    if (index == failAtExecute_) throw BackendError("device lost while executing");
    host_.execute(c);
    return std::make_shared<int>(index);
  }
  void completed(int globalRank, const world::TransportToken& done) override {
    std::lock_guard<std::mutex> lock(mu_);
    completed_.push_back({globalRank, *std::static_pointer_cast<int>(done)});
  }
  void abort() override { ++aborts_; }

  std::vector<world::Collective> executed_;        // under the rendezvous lock
  std::vector<std::pair<int, int>> completed_;     // (rank, execute index)
  int aborts_ = 0;

 private:
  int failAtExecute_;
  std::mutex mu_;
  std::size_t issuedCount_ = 0;
  sim::HostTransport host_;
};

WorldOptions options(int size, int threads) {
  WorldOptions o;
  o.size = size;
  o.threads = threads;
  return o;
}

std::vector<std::shared_ptr<Compute>> computes(int n) {
  std::vector<std::shared_ptr<Compute>> c;
  for (int r = 0; r < n; ++r) c.push_back(std::make_shared<sim::SimCompute>());
  return c;
}

class RendezvousTest : public ::testing::TestWithParam<int> {};  // worker threads

TEST_P(RendezvousTest, TokensFlowFromIssueThroughExecuteToCompleted) {
  constexpr int kRanks = 3;
  world::Rendezvous rendezvous("sim", options(kRanks, GetParam()));
  auto transport = std::make_shared<RecordingTransport>();
  rendezvous.run(
      [](RankContext& ctx) {
        Tensor x = ctx.compute.empty({2}, DType::kFloat32);  // (2)
        ctx.compute.fill(x, ctx.comm.rank() + 1);
        ctx.comm.allReduce(x)->wait();
        std::vector<float> host(2);
        ctx.compute.download(x, host.data());
        EXPECT_EQ(host[0], 6.f);  // 1 + 2 + 3
        auto pair = ctx.comm.split(ctx.comm.rank() < 2 ? 0 : -1, 0, "pair");
        if (pair) pair->barrier()->wait();
      },
      computes(kRanks), transport);
  // The split moves no data: two collectives reach the transport, the allReduce and the barrier.
  ASSERT_EQ(transport->executed_.size(), 2u);
  const world::Collective& allReduce = transport->executed_[0];
  EXPECT_EQ(allReduce.kind, world::OpKind::kAllReduce);
  EXPECT_EQ(allReduce.group, "world[0-2]");
  EXPECT_EQ(allReduce.globalRanks, (std::vector<int>{0, 1, 2}));
  ASSERT_EQ(allReduce.issued.size(), 3u);
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_TRUE(allReduce.issued[r]) << "rank " << r;
    EXPECT_EQ(*std::static_pointer_cast<int>(allReduce.issued[r]) / 1000, r) << "token of another rank";
  }
  EXPECT_EQ(transport->executed_[1].kind, world::OpKind::kBarrier);
  EXPECT_EQ(transport->executed_[1].group, "pair[0,1]");
  // completed() ran once per member and collective, with that collective's token.
  std::vector<std::pair<int, int>> done = transport->completed_;
  std::sort(done.begin(), done.end());
  EXPECT_EQ(done, (std::vector<std::pair<int, int>>{{0, 0}, {0, 1}, {1, 0}, {1, 1}, {2, 0}}));
  EXPECT_EQ(transport->aborts_, 0);
}

TEST_P(RendezvousTest, ATransportErrorFailsEveryRankWithTheSameBackendError) {
  constexpr int kRanks = 4;
  world::Rendezvous rendezvous("gpu", options(kRanks, GetParam()));
  auto transport = std::make_shared<RecordingTransport>(/*failAtExecute=*/1);
  try {
    rendezvous.run(
        [](RankContext& ctx) {
          Tensor x = ctx.compute.zeros({4}, DType::kFloat32);  // (4)
          ctx.comm.allReduce(x)->wait();
          ctx.comm.allReduce(x)->wait();  // the transport throws here
          ctx.comm.barrier()->wait();     // never reached
        },
        computes(kRanks), transport);
    FAIL() << "run() returned normally";
  } catch (const WorldError& e) {
    EXPECT_TRUE(e.causeIsCollective());
    EXPECT_EQ(e.kind(), CollectiveFailure::kBackend);
    EXPECT_THAT(e.what(), HasSubstr("gpu: allReduce(sum, fp32 x4) on world[0-3] (seq 1) failed in the transport: "
                                    "device lost while executing"));
    for (int r = 0; r < kRanks; ++r) EXPECT_THAT(e.rankErrors()[r], HasSubstr("device lost")) << "rank " << r;
  }
  EXPECT_EQ(transport->executed_.size(), 2u);
  EXPECT_EQ(transport->aborts_, 1);
}

TEST_P(RendezvousTest, ARankUnwindingPastAnExecutedCollectiveStillOrdersItsWorkAfterIt) {
  constexpr int kRanks = 3;
  world::Rendezvous rendezvous("sim", options(kRanks, GetParam()));
  auto transport = std::make_shared<RecordingTransport>();
  try {
    rendezvous.run(
        [](RankContext& ctx) {
          Tensor x = ctx.compute.zeros({2}, DType::kFloat32);  // (2)
          auto sum = ctx.comm.allReduce(x);
          // Once the barrier completes every member has issued the allReduce: it was executed.
          ctx.comm.barrier()->wait();
          if (ctx.comm.rank() == 0) throw InvalidArgument("rank 0 gave up");
          sum->wait();
        },
        computes(kRanks), transport);
    FAIL() << "run() returned normally";
  } catch (const WorldError& e) {
    EXPECT_FALSE(e.causeIsCollective());
    EXPECT_THAT(e.rankErrors()[0], HasSubstr("rank 0 gave up"));
  }
  ASSERT_EQ(transport->executed_.size(), 2u);
  // Rank 0 never waited on the allReduce (execute index 0), yet it reached completed() for it.
  std::vector<std::pair<int, int>> done = transport->completed_;
  std::sort(done.begin(), done.end());
  EXPECT_EQ(done, (std::vector<std::pair<int, int>>{{0, 0}, {0, 1}, {1, 0}, {1, 1}, {2, 0}, {2, 1}}));
}

INSTANTIATE_TEST_SUITE_P(Threads, RendezvousTest, ::testing::Values(1, 2),
                         [](const auto& info) { return std::to_string(info.param) + "threads"; });

TEST(Rendezvous, OptionsErrorsNameTheWorld) {
  WorldOptions o;
  o.size = 0;
  EXPECT_THAT([&] { world::Rendezvous("gpu", o); },
              ::testing::ThrowsMessage<InvalidArgument>(HasSubstr("gpu::World: size must be >= 1, got 0")));
}

}  // namespace
}  // namespace tpsim
