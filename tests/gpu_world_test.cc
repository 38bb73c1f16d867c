// gpu::World against sim::World: the same rank code, the same collectives on random data, and
// the same failures. DeviceFabric results must be bitwise equal to the simulator's (rank-order
// sums with the same roundings); NCCL's are checked where the order cannot matter. Every test
// skips with the probe's reason where no CUDA device is usable.
#include <cuda_runtime_api.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <thread>

#include "gpu/check.h"
#include "gpu/device.h"
#include "gpu/gpu_compute.h"
#include "gpu/world.h"
#include "sim/world.h"
#include "tests/gpu_stuck_kernel.h"
#include "tests/gpu_test_util.h"
#include "tests/sim_test_util.h"

namespace tpsim {
namespace {

using ::testing::HasSubstr;
using testing::tensorOf;
using testing::valuesOf;

#define SKIP_WITHOUT_GPU()                                                        \
  do {                                                                            \
    if (const std::string why = gpu::unusableReason(); !why.empty()) GTEST_SKIP() << why; \
  } while (0)

enum class Op { kAllReduceSum, kAllReduceMean, kReduceScatterSum, kReduceScatterMean, kAllGather, kBroadcast,
                kAllToAll };
const char* opName(Op op) {
  switch (op) {
    case Op::kAllReduceSum: return "allReduceSum";
    case Op::kAllReduceMean: return "allReduceMean";
    case Op::kReduceScatterSum: return "reduceScatterSum";
    case Op::kReduceScatterMean: return "reduceScatterMean";
    case Op::kAllGather: return "allGather";
    case Op::kBroadcast: return "broadcast";
    case Op::kAllToAll: return "allToAll";
  }
  return "?";
}

// Rank r's input: random values of every magnitude, so that each rounding of the sum shows.
std::vector<double> randomInput(int rank, std::int64_t count, DType dtype, std::uint64_t seed) {
  std::mt19937_64 rng(seed * 1000003 + std::uint64_t(rank));
  std::uniform_real_distribution<double> mantissa(-1.0, 1.0);
  std::uniform_int_distribution<int> exponent(-6, 6), small(-100, 100);
  std::vector<double> v(static_cast<std::size_t>(count));
  for (double& x : v) x = dtype == DType::kInt64 ? double(small(rng)) : std::ldexp(mantissa(rng), exponent(rng));
  return v;
}

// Runs one collective on `world` and returns every rank's output bytes, by rank.
std::vector<std::vector<char>> runCollective(World& world, Op op, DType dtype, std::int64_t blockCount, bool inPlace,
                                             std::uint64_t seed) {
  const int n = world.size();
  std::vector<std::vector<char>> outputs(static_cast<std::size_t>(n));
  world.run([&](RankContext& ctx) {
    Compute& c = ctx.compute;
    const int r = ctx.comm.rank();
    const bool gathers = op == Op::kAllGather;
    const bool scatters = op == Op::kReduceScatterSum || op == Op::kReduceScatterMean || op == Op::kAllToAll;
    const std::int64_t inCount = gathers ? blockCount : (scatters ? blockCount * n : blockCount);
    const std::int64_t outCount = gathers ? blockCount * n : (op == Op::kAllToAll ? blockCount * n : blockCount);
    Tensor in = tensorOf(c, dtype, randomInput(r, inCount, dtype, seed));
    Tensor out = c.zeros({outCount}, dtype);
    View dst = out;
    ConstView src = in;
    if (inPlace) {  // the in-place forms of collectives.h: the input inside the output
      if (gathers) {
        c.copy(in, out.view().slice(0, r * blockCount, (r + 1) * blockCount));
        src = out.view().slice(0, r * blockCount, (r + 1) * blockCount);
      } else if (op == Op::kReduceScatterSum || op == Op::kReduceScatterMean) {
        dst = in.view().slice(0, r * blockCount, (r + 1) * blockCount);
      } else {
        dst = in;
      }
    }
    switch (op) {
      case Op::kAllReduceSum: ctx.comm.allReduce(src, dst, {ReduceOp::kSum})->wait(); break;
      case Op::kAllReduceMean: ctx.comm.allReduce(src, dst, {ReduceOp::kMean})->wait(); break;
      case Op::kReduceScatterSum: ctx.comm.reduceScatter(src, dst, {ReduceOp::kSum})->wait(); break;
      case Op::kReduceScatterMean: ctx.comm.reduceScatter(src, dst, {ReduceOp::kMean})->wait(); break;
      case Op::kAllGather: ctx.comm.allGather(src, dst)->wait(); break;
      case Op::kBroadcast: ctx.comm.broadcast(src, dst, {n - 1})->wait(); break;
      case Op::kAllToAll: ctx.comm.allToAll(src, dst)->wait(); break;
    }
    std::vector<char> bytes(dst.bytes());
    c.download(dst, bytes.data());
    outputs[std::size_t(r)] = std::move(bytes);
  });
  return outputs;
}

// One test over every case: a process per case would pay the CUDA start-up hundreds of times.
TEST(FabricVsSim, EveryCollectiveDtypeSizeAndRankCountIsBitwiseEqual) {
  SKIP_WITHOUT_GPU();
  for (int n : {2, 3, 4, 8, 16}) {
    WorldOptions o;
    o.size = n;
    gpu::GpuWorldOptions g;
    g.transport = gpu::TransportKind::kDeviceFabric;
    gpu::World onGpu(o, g);
    sim::World onSim(o);
    for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat64, DType::kInt64})
      for (Op op : {Op::kAllReduceSum, Op::kAllReduceMean, Op::kReduceScatterSum, Op::kReduceScatterMean,
                    Op::kAllGather, Op::kBroadcast, Op::kAllToAll})
        for (bool inPlace : {false, true})
          for (std::int64_t blockCount : {std::int64_t(1), std::int64_t(37), std::int64_t(4096)}) {
            const auto want = runCollective(onSim, op, dtype, blockCount, inPlace, 7);
            const auto got = runCollective(onGpu, op, dtype, blockCount, inPlace, 7);
            for (int r = 0; r < n; ++r) {
              ASSERT_EQ(got[r].size(), want[r].size());
              const std::size_t e = dtypeSize(dtype);
              for (std::size_t i = 0; i < want[r].size(); i += e)
                ASSERT_EQ(std::memcmp(got[r].data() + i, want[r].data() + i, e), 0)
                    << opName(op) << (inPlace ? " in place " : " ") << dtypeName(dtype) << " n=" << n
                    << " block=" << blockCount << ": rank " << r << " differs from the simulator at element "
                    << i / e;
            }
          }
  }
}

// NCCL with one rank per GPU: a world of one rank runs on every GPU machine; larger worlds need as
// many devices. With one or two ranks every sum is bitwise (a + b is the same in either order),
// and a mean is one division after the sum, as on the simulator. In place as well: NCCL's
// allToAll is per-peer sends and receives, which the transport must not let overwrite its input.
TEST(NcclWorld, OneAndTwoRankWorldsMatchTheSimulatorBitwise) {
  SKIP_WITHOUT_GPU();
  const int devices = int(gpu::probe().devices.size());
  for (int n : {1, 2}) {
    if (n > devices) {
      std::printf("NcclWorld: %d ranks need %d GPUs, this machine has %d; not run\n", n, n, devices);
      continue;
    }
    WorldOptions o;
    o.size = n;
    gpu::GpuWorldOptions g;
    g.transport = gpu::TransportKind::kNccl;
    gpu::World onGpu(o, g);
    ASSERT_EQ(onGpu.transport(), gpu::TransportKind::kNccl);
    sim::World onSim(o);
    for (Op op : {Op::kAllReduceSum, Op::kAllReduceMean, Op::kReduceScatterSum, Op::kReduceScatterMean,
                  Op::kAllGather, Op::kBroadcast, Op::kAllToAll})
      for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat64}) {
        for (bool inPlace : {false, true}) {
          const auto want = runCollective(onSim, op, dtype, 1000, inPlace, 11);
          const auto got = runCollective(onGpu, op, dtype, 1000, inPlace, 11);
          for (int r = 0; r < n; ++r)
            EXPECT_TRUE(got[r] == want[r]) << opName(op) << " " << dtypeName(dtype) << (inPlace ? " in place" : "")
                                           << " n=" << n << " rank " << r;
        }
      }
  }
}

// A failed run aborts the NCCL communicators (nothing may wait on them); the same world then runs
// on new ones, as a simulator world does after a failure.
TEST(NcclWorld, AFailedRunLeavesTheWorldUsable) {
  SKIP_WITHOUT_GPU();
  WorldOptions o;
  o.size = 1;
  gpu::World world(o, {gpu::TransportKind::kNccl, 0, {}});
  EXPECT_THAT(
      [&] {
        world.run([](RankContext& ctx) {
          Tensor x = ctx.compute.zeros({4}, DType::kFloat32);
          ctx.comm.allReduce(x)->wait();  // the communicators exist, and the failure aborts them
          throw InvalidArgument("rank 0 gave up");
        });
      },
      ::testing::ThrowsMessage<WorldError>(HasSubstr("rank 0 gave up")));
  sim::World onSim(o);
  for (Op op : {Op::kAllReduceSum, Op::kAllGather})
    EXPECT_TRUE(runCollective(world, op, DType::kFloat32, 1000, false, 3) ==
                runCollective(onSim, op, DType::kFloat32, 1000, false, 3))
        << opName(op);
}

TEST(NcclWorld, MoreRanksThanDevicesIsRefusedWithTheReason) {
  SKIP_WITHOUT_GPU();
  WorldOptions o;
  o.size = int(gpu::probe().devices.size()) + 1;
  gpu::GpuWorldOptions g;
  g.transport = gpu::TransportKind::kNccl;
  EXPECT_THAT([&] { gpu::World(o, g); },
              ::testing::ThrowsMessage<InvalidArgument>(HasSubstr("the NCCL transport needs one GPU per rank")));
}

TEST(GpuWorld, AutomaticTransportFollowsTheDeviceCount) {
  SKIP_WITHOUT_GPU();
  const int devices = int(gpu::probe().devices.size());
  WorldOptions o;
  o.size = devices + 1;
  EXPECT_EQ(gpu::World(o).transport(), gpu::TransportKind::kDeviceFabric);
  o.size = devices;
  EXPECT_EQ(gpu::World(o).transport(), gpu::TransportKind::kNccl);
}

// The rendezvous is the simulator's: each failure reads as on sim::World, with the "gpu:" prefix.
WorldError runExpectingFailure(int n, std::chrono::milliseconds timeout, const std::function<void(RankContext&)>& fn) {
  WorldOptions o;
  o.size = n;
  o.timeout = timeout;
  gpu::GpuWorldOptions g;
  g.transport = gpu::TransportKind::kDeviceFabric;
  try {
    gpu::World(o, g).run(fn);
  } catch (const WorldError& e) {
    return e;
  }
  ADD_FAILURE() << "run() returned normally";
  return WorldError("", {}, false, CollectiveFailure::kPeerFailed);
}

TEST(GpuWorldFailures, MismatchDeadlockPeerFailureTimeoutAndDroppedWork) {
  SKIP_WITHOUT_GPU();
  const auto kLong = std::chrono::milliseconds(60'000);
  WorldError mismatch = runExpectingFailure(3, kLong, [](RankContext& ctx) {
    Tensor x = ctx.compute.zeros({4}, DType::kFloat32);
    Tensor y = ctx.compute.zeros({12}, DType::kFloat32);
    if (ctx.comm.rank() == 1)
      ctx.comm.allGather(x, y)->wait();
    else
      ctx.comm.allReduce(x)->wait();
  });
  EXPECT_EQ(mismatch.kind(), CollectiveFailure::kMismatch);
  EXPECT_THAT(mismatch.what(), HasSubstr("gpu: collective mismatch on world[0-2] at seq 0"));

  WorldError deadlock = runExpectingFailure(2, kLong, [](RankContext& ctx) {
    Tensor x = ctx.compute.zeros({4}, DType::kFloat32);
    if (ctx.comm.rank() == 0) ctx.comm.allReduce(x)->wait();
  });
  EXPECT_EQ(deadlock.kind(), CollectiveFailure::kDeadlock);
  EXPECT_THAT(deadlock.what(), HasSubstr("gpu: deadlock"));

  WorldError peer = runExpectingFailure(4, kLong, [](RankContext& ctx) {
    Tensor x = ctx.compute.zeros({4}, DType::kFloat32);
    if (ctx.comm.rank() == 2) throw InvalidArgument("rank 2 gave up");
    ctx.comm.allReduce(x)->wait();
  });
  EXPECT_FALSE(peer.causeIsCollective());
  for (int r : {0, 1, 3}) EXPECT_THAT(peer.rankErrors()[r], HasSubstr("peer rank 2 failed: rank 2 gave up"));

  WorldError timeout = runExpectingFailure(2, std::chrono::milliseconds(300), [](RankContext& ctx) {
    Tensor x = ctx.compute.zeros({4}, DType::kFloat32);
    if (ctx.comm.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(900));
    ctx.comm.allReduce(x)->wait();
  });
  EXPECT_EQ(timeout.kind(), CollectiveFailure::kTimeout);
  EXPECT_THAT(timeout.what(), HasSubstr("gpu: timeout"));

  WorldError dropped = runExpectingFailure(2, kLong, [](RankContext& ctx) {
    Tensor x = ctx.compute.zeros({4}, DType::kFloat32);
    { auto work = ctx.comm.allReduce(x); }
    ctx.comm.barrier()->wait();
  });
  EXPECT_EQ(dropped.kind(), CollectiveFailure::kDroppedWork);
}

// A rank that throws past a collective every member issued (its Work dies unwaited, its buffer is
// freed) still orders the free after the collective, and run() lets the device settle before it
// throws: the same world then runs as if nothing had happened.
TEST(GpuWorldFailures, ARankThrowingPastAnExecutedCollectiveLeavesTheWorldUsable) {
  SKIP_WITHOUT_GPU();
  WorldOptions o;
  o.size = 4;
  gpu::World world(o, {gpu::TransportKind::kDeviceFabric, 0, {}});
  try {
    world.run([](RankContext& ctx) {
      Tensor x = ctx.compute.empty({1 << 22}, DType::kFloat32);
      ctx.compute.fill(x, 1.0);
      auto sum = ctx.comm.allReduce(x);
      ctx.comm.barrier()->wait();  // every member issued the allReduce: it is on the device
      if (ctx.comm.rank() == 0) throw InvalidArgument("rank 0 gave up");
      sum->wait();
    });
    ADD_FAILURE() << "run() returned normally";
  } catch (const WorldError& e) {
    EXPECT_FALSE(e.causeIsCollective());
    EXPECT_THAT(e.rankErrors()[0], HasSubstr("rank 0 gave up"));
  }
  sim::World onSim(o);
  const auto want = runCollective(onSim, Op::kAllReduceSum, DType::kFloat32, 1 << 20, false, 5);
  const auto got = runCollective(world, Op::kAllReduceSum, DType::kFloat32, 1 << 20, false, 5);
  for (int r = 0; r < o.size; ++r) EXPECT_TRUE(got[r] == want[r]) << "rank " << r;
}

// A stream that never finishes (a kernel that hangs) fails run() with kBackend within
// TPSIM_GPU_TIMEOUT_MS, and the world's teardown returns instead of hanging.
TEST(GpuWorldFailures, AStuckStreamFailsRunAndTeardownWithinTheDeadline) {
  SKIP_WITHOUT_GPU();
  gputest::EnvGuard env("TPSIM_GPU_TIMEOUT_MS", "300");
  std::unique_ptr<gputest::StuckKernel> stuck;
  const auto start = std::chrono::steady_clock::now();
  {
    WorldOptions o;
    o.size = 2;
    gpu::World world(o, {gpu::TransportKind::kDeviceFabric, 0, {}});
    try {
      world.run([&](RankContext& ctx) {
        Tensor x = ctx.compute.zeros({4}, DType::kFloat32);
        if (ctx.comm.rank() == 0)
          stuck = std::make_unique<gputest::StuckKernel>(static_cast<gpu::GpuCompute&>(ctx.compute).stream());
        ctx.comm.allReduce(x)->wait();  // the fabric's stream, and rank 1's after it, wait for rank 0's
      });
      ADD_FAILURE() << "run() returned normally";
    } catch (const WorldError& e) {
      EXPECT_TRUE(e.causeIsCollective());
      EXPECT_EQ(e.kind(), CollectiveFailure::kBackend);
      EXPECT_THAT(e.what(), HasSubstr("gpu: the device work of rank 0 failed after its function returned"));
      EXPECT_THAT(e.rankErrors()[0], HasSubstr("did not finish within 300 ms (TPSIM_GPU_TIMEOUT_MS)"));
    }
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  stuck.reset();  // released: the streams the world left behind drain on their own
}

// Rank code that never reads a result on the host still ends with its collectives done: the next
// run on the same world sees the previous run's sums.
TEST(GpuWorld, WorkOrderedOnTheDeviceIsCompleteWhenRunReturns) {
  SKIP_WITHOUT_GPU();
  WorldOptions o;
  o.size = 4;
  gpu::World world(o, {gpu::TransportKind::kDeviceFabric, 0, {}});
  std::vector<std::shared_ptr<Tensor>> kept(4);
  world.run([&](RankContext& ctx) {
    auto x = std::make_shared<Tensor>(ctx.compute.empty({1 << 20}, DType::kFloat32));
    ctx.compute.fill(*x, 1.0);
    ctx.comm.allReduce(*x)->wait();
    kept[ctx.comm.rank()] = x;
  });
  world.run([&](RankContext& ctx) {
    const std::vector<double> v = valuesOf(ctx.compute, *kept[ctx.comm.rank()]);
    EXPECT_EQ(v.front(), 4.0);
    EXPECT_EQ(v.back(), 4.0);
    kept[ctx.comm.rank()].reset();
  });
}

}  // namespace
}  // namespace tpsim
