// The rendezvous' contract with its transport, which every world (sim, gpu) relies on: each
// member's issue token reaches execute(), execute() runs once per collective after every member
// issued, its token reaches completed() on every member, and a transport that throws fails the
// world with the same kBackend error on every rank (and aborts the transport once). A Work dropped
// while its rank unwinds still reaches completed() when its collective was executed.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "backends/fault.h"
#include "backends/world/rendezvous.h"
#include "sim/reduce.h"
#include "sim/sim_compute.h"
#include "sim/world.h"

namespace tpsim {
namespace {

using ::testing::HasSubstr;

// A transport that records its calls and moves data with the host transport.
class RecordingTransport final : public world::Transport {
 public:
  explicit RecordingTransport(int failAtExecute = -1, bool sharesMemory = false)
      : failAtExecute_(failAtExecute), sharesMemory_(sharesMemory) {}
  Device device() const override { return Device::kHost; }
  bool sharesMemory() const override { return sharesMemory_; }
  bool foldsReductions() const override { return sharesMemory_; }
  world::TransportToken fold(const world::Collective& c) override {
    folds_.push_back(c.foldedCount);
    return host_.fold(c);
  }
  world::TransportToken issued(int globalRank) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (onIssue_) onIssue_(globalRank);
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
  std::vector<int> folds_;                         // each fold's member, under the rendezvous lock
  std::function<void(int)> onIssue_;               // called as a rank issues, before the lock
  std::vector<std::pair<int, int>> completed_;     // (rank, execute index)
  int aborts_ = 0;

 private:
  int failAtExecute_;
  bool sharesMemory_;
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

// What each rank of an allGatherShared world received: its tensor and the values in it.
struct SharedGathers {
  std::mutex mu;
  std::vector<SharedTensor> tensors;
  std::vector<std::vector<float>> values;
};

// Every rank gathers {rank, rank + 0.5} over `group` (the world, or the pairs {0, 1}, {2, 3}) with
// allGatherShared, except plainRank, which uses allGather into a tensor of its own.
void gatherShared(RankContext& ctx, bool pairs, int plainRank, SharedGathers& seen) {
  std::unique_ptr<Collectives> pair = pairs ? ctx.comm.split(ctx.comm.rank() / 2, 0, "pair") : nullptr;
  Collectives& group = pairs ? *pair : ctx.comm;
  const int r = ctx.comm.rank();
  Tensor in = ctx.compute.empty({2}, DType::kFloat32);  // (2)
  const float mine[2] = {float(r), float(r) + 0.5f};
  ctx.compute.upload(mine, in);
  SharedTensor out;
  if (r == plainRank) {
    auto own = std::make_shared<Tensor>(ctx.compute.empty({group.size(), 2}, DType::kFloat32));
    group.allGather(in, *own)->wait();
    out = own;
  } else {
    group.allGatherShared(in, Shape{group.size(), 2}, ctx.compute, out)->wait();
  }
  std::vector<float> host(std::size_t(out->numel()));
  ctx.compute.download(*out, host.data());
  ctx.comm.barrier()->wait();  // every member has read its result before any drops it
  std::lock_guard<std::mutex> lock(seen.mu);
  seen.tensors[std::size_t(r)] = out;
  seen.values[std::size_t(r)] = host;
}

std::vector<float> gatheredValues(const std::vector<int>& members) {
  std::vector<float> v;
  for (int q : members) v.insert(v.end(), {float(q), float(q) + 0.5f});
  return v;
}

TEST_P(RendezvousTest, AllGatherSharedHandsAGroupOneTensorWhereMemoryIsShared) {
  constexpr int kRanks = 4;
  for (bool pairs : {false, true}) {
    world::Rendezvous rendezvous("sim", options(kRanks, GetParam()));
    auto transport = std::make_shared<RecordingTransport>(-1, /*sharesMemory=*/true);
    SharedGathers seen;
    seen.tensors.resize(kRanks);
    seen.values.resize(kRanks);
    rendezvous.run([&](RankContext& ctx) { gatherShared(ctx, pairs, -1, seen); }, computes(kRanks), transport);
    for (int r = 0; r < kRanks; ++r) {
      const int group = pairs ? r / 2 : 0;
      EXPECT_EQ(seen.values[r], pairs ? gatheredValues({2 * group, 2 * group + 1}) : gatheredValues({0, 1, 2, 3}))
          << "rank " << r << (pairs ? " (pairs)" : " (world)");
      // One tensor a group: members of one share it, members of two do not.
      const int first = pairs ? 2 * group : 0;
      EXPECT_EQ(seen.tensors[r].get(), seen.tensors[first].get()) << "rank " << r;
    }
    if (pairs) EXPECT_NE(seen.tensors[0].get(), seen.tensors[2].get());
    // The transport saw every member's out as that one buffer.
    for (const world::Collective& c : transport->executed_) {
      if (c.kind != world::OpKind::kAllGather) continue;
      for (const View& out : c.out) EXPECT_EQ(out.data(), c.out[0].data()) << c.group;
    }
  }
}

TEST_P(RendezvousTest, AllGatherSharedGivesEachRankItsOwnTensorWhereMemoryIsNot) {
  constexpr int kRanks = 4;
  world::Rendezvous rendezvous("gpu", options(kRanks, GetParam()));
  auto transport = std::make_shared<RecordingTransport>(-1, /*sharesMemory=*/false);
  SharedGathers seen;
  seen.tensors.resize(kRanks);
  seen.values.resize(kRanks);
  rendezvous.run([&](RankContext& ctx) { gatherShared(ctx, false, -1, seen); }, computes(kRanks), transport);
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(seen.values[r], gatheredValues({0, 1, 2, 3})) << "rank " << r;
    for (int q = 0; q < r; ++q) EXPECT_NE(seen.tensors[r].get(), seen.tensors[q].get()) << r << " and " << q;
  }
}

TEST_P(RendezvousTest, AMemberGatheringIntoItsOwnTensorOrWithAFaultKeepsItsOwn) {
  constexpr int kRanks = 4;
  // Rank 3 corrupts element 1 of its first collective's result (bit 31: the sign).
  WorldOptions o = options(kRanks, GetParam());
  Fault fault;
  fault.rank = 3;
  fault.collective = 1;
  fault.kind = FaultKind::kCorrupt;
  fault.element = 1;
  fault.bit = 31;
  o.faults = {fault};
  world::Rendezvous rendezvous("sim", o);
  auto transport = std::make_shared<RecordingTransport>(-1, /*sharesMemory=*/true);
  SharedGathers seen;
  seen.tensors.resize(kRanks);
  seen.values.resize(kRanks);
  rendezvous.run([&](RankContext& ctx) { gatherShared(ctx, false, /*plainRank=*/0, seen); }, computes(kRanks),
                 transport);
  std::vector<float> corrupted = gatheredValues({0, 1, 2, 3});
  corrupted[1] = -corrupted[1];
  for (int r = 0; r < 3; ++r) EXPECT_EQ(seen.values[r], gatheredValues({0, 1, 2, 3})) << "rank " << r;
  EXPECT_EQ(seen.values[3], corrupted) << "the fault is rank 3's alone";
  EXPECT_EQ(seen.tensors[1].get(), seen.tensors[2].get());
  EXPECT_NE(seen.tensors[0].get(), seen.tensors[1].get()) << "rank 0 gathered into its own tensor";
  EXPECT_NE(seen.tensors[3].get(), seen.tensors[1].get()) << "rank 3's corrupted copy is shared";
}

// Host tensors whose frees are counted: how many inputs of a reduction are still held.
std::atomic<int> liveInputs{0};
void countedFree(void* p) {
  --liveInputs;
  std::free(p);
}
Tensor countedTensor(const std::vector<float>& values) {
  void* data = std::malloc(values.size() * sizeof(float));
  std::memcpy(data, values.data(), values.size() * sizeof(float));
  ++liveInputs;
  return Tensor(data, Shape{std::int64_t(values.size())}, DType::kFloat32, Device::kHost, &countedFree);
}

// Rank r's input: values whose fp32 sum depends on the order they are added in.
std::vector<float> foldInput(int r) {
  const float big = r % 2 == 0 ? 1e8f : -1e8f;
  return {big, 1.f + float(r), 0.25f * float(r), float(r) - big};
}

TEST_P(RendezvousTest, AReduceScatterOfGivenUpInputsAddsThemUpAsTheyArrive) {
  constexpr int kRanks = 4;
  std::vector<const void*> inputs;
  std::vector<std::vector<float>> storage;
  for (int r = 0; r < kRanks; ++r) storage.push_back(foldInput(r));
  for (const auto& v : storage) inputs.push_back(v.data());
  std::vector<float> want(4);
  sim::reduceInRankOrder(DType::kFloat32, ReduceOp::kSum, inputs, 4, want.data());
  // plainRank issues the plain reduceScatter: the members after it wait for the execute.
  for (int plainRank : {-1, 1}) {
    world::Rendezvous rendezvous("sim", options(kRanks, GetParam()));
    auto transport = std::make_shared<RecordingTransport>(-1, /*sharesMemory=*/true);
    std::vector<int> liveAtIssue;
    transport->onIssue_ = [&](int) { liveAtIssue.push_back(liveInputs.load()); };
    std::vector<float> got(kRanks, -1.f);
    std::mutex mu;
    rendezvous.run(
        [&](RankContext& ctx) {
          const int r = ctx.comm.rank();
          Tensor out = ctx.compute.empty({1}, DType::kFloat32);  // (1)
          Tensor in = countedTensor(foldInput(r));                // (4)
          if (r == plainRank) ctx.comm.reduceScatter(in, out)->wait();
          else ctx.comm.reduceScatterConsuming(std::move(in), out)->wait();
          float v = 0;
          ctx.compute.download(out, &v);
          std::lock_guard<std::mutex> lock(mu);
          got[std::size_t(r)] = v;
        },
        computes(kRanks), transport);
    EXPECT_EQ(liveInputs.load(), 0);
    EXPECT_EQ(got, want) << "plain rank " << plainRank << ": not the rank-order sum, bitwise";
    ASSERT_EQ(transport->executed_.size(), 1u);
    const world::Collective& c = transport->executed_[0];
    if (plainRank < 0) {
      EXPECT_EQ(c.foldedCount, kRanks) << "every input was added before the execute";
      EXPECT_EQ(transport->folds_, (std::vector<int>{0, 1, 2, 3}));
      if (GetParam() == 1) {
        // One worker runs the ranks in order: each input was freed as its member arrived, so the
        // next rank's was the only one alive when it issued.
        EXPECT_EQ(liveAtIssue, (std::vector<int>{1, 1, 1, 1}));
      }
    } else {
      EXPECT_EQ(c.foldedCount, plainRank) << "the plain member holds back the members after it";
      for (int r = plainRank; r < kRanks; ++r) EXPECT_NE(c.in[std::size_t(r)].data(), nullptr) << r;
    }
  }
}

TEST(Rendezvous, AReduceScatterOfAGivenUpInputRejectsAnOutputInsideIt) {
  world::Rendezvous rendezvous("sim", options(1, 1));
  auto transport = std::make_shared<RecordingTransport>(-1, /*sharesMemory=*/true);
  std::vector<std::string> errors(1);
  try {
    rendezvous.run(
        [&](RankContext& ctx) {
          Tensor in = ctx.compute.zeros({4}, DType::kFloat32);  // (4)
          View inside = in.view().slice(0, 0, 2);
          try {
            ctx.comm.reduceScatterConsuming(std::move(in), inside)->wait();
          } catch (const Error& e) {
            errors[std::size_t(ctx.comm.rank())] = e.what();
            throw;
          }
        },
        computes(1), transport);
  } catch (const WorldError&) {
  }
  for (const std::string& e : errors) EXPECT_THAT(e, HasSubstr("out must not lie in the input given up"));
}

// An output shape without n·in elements is refused before anything moves, on the shared path and
// on the rank's own.
TEST(Rendezvous, AllGatherSharedRejectsAnOutputOfTheWrongSize) {
  for (bool sharesMemory : {true, false}) {
    constexpr int kRanks = 2;
    world::Rendezvous rendezvous("sim", options(kRanks, 1));
    auto transport = std::make_shared<RecordingTransport>(-1, sharesMemory);
    std::vector<std::string> errors(kRanks);
    try {
      rendezvous.run(
          [&](RankContext& ctx) {
            Tensor in = ctx.compute.zeros({2}, DType::kFloat32);  // (2)
            SharedTensor out;
            try {
              ctx.comm.allGatherShared(in, Shape{3}, ctx.compute, out)->wait();
            } catch (const Error& e) {
              errors[std::size_t(ctx.comm.rank())] = e.what();
              throw;
            }
          },
          computes(kRanks), transport);
    } catch (const WorldError&) {
    }
    for (const std::string& e : errors)
      EXPECT_THAT(e, HasSubstr("out must have n·in = 2·2 elements, got ")) << (sharesMemory ? "shared" : "own");
    EXPECT_TRUE(transport->executed_.empty());
  }
}

TEST(Rendezvous, OptionsErrorsNameTheWorld) {
  WorldOptions o;
  o.size = 0;
  EXPECT_THAT([&] { world::Rendezvous("gpu", o); },
              ::testing::ThrowsMessage<InvalidArgument>(HasSubstr("gpu::World: size must be >= 1, got 0")));
}

}  // namespace
}  // namespace tpsim
