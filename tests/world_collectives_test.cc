// Each collective on N in {1,2,3,4,5,8,64} ranks, with values built from the rank (nccl-tests'
// style) so every expectation is closed-form; in-place and out-of-place; sub-groups via split;
// determinism across worker-thread counts.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <mutex>
#include <tuple>

#include "sim/world.h"
#include "tests/sim_test_util.h"

namespace tpsim {
namespace {

using testing::runRanks;
using testing::tensorOf;
using testing::valuesOf;

// Rank r's element i: small integers, exact in every dtype (bf16 holds integers up to 256).
double elem(int r, std::int64_t i) { return double((r * 3 + i) % 5); }

std::vector<double> rankData(int r, std::int64_t count, std::int64_t offset = 0) {
  std::vector<double> v(static_cast<std::size_t>(count));
  for (std::int64_t i = 0; i < count; ++i) v[std::size_t(i)] = elem(r, offset + i);
  return v;
}

double sumOver(int n, std::int64_t i) {
  double s = 0;
  for (int r = 0; r < n; ++r) s += elem(r, i);
  return s;
}

class CollectiveTest : public ::testing::TestWithParam<std::tuple<int, DType, bool>> {
 protected:
  int n() const { return std::get<0>(GetParam()); }
  DType dtype() const { return std::get<1>(GetParam()); }
  bool inPlace() const { return std::get<2>(GetParam()); }
};

TEST_P(CollectiveTest, AllReduceSumsInRankOrder) {
  const std::int64_t count = 7;
  runRanks(n(), [&](RankContext& ctx) {
    const int r = ctx.comm.rank();
    Tensor in = tensorOf(ctx.compute, dtype(), rankData(r, count));
    Tensor out = inPlace() ? Tensor() : ctx.compute.empty({count}, dtype());
    View dst = inPlace() ? in.view() : out.view();
    ctx.comm.allReduce(in, dst)->wait();
    auto got = valuesOf(ctx.compute, dst);
    for (std::int64_t i = 0; i < count; ++i)
      ASSERT_EQ(got[i], sumOver(n(), i)) << "rank " << r << " mismatch at index " << i;
  });
}

TEST_P(CollectiveTest, AllReduceMeanDividesOnce) {
  const std::int64_t count = 5;
  runRanks(n(), [&](RankContext& ctx) {
    // Every rank contributes 2^(i mod 4): each partial sum k·2^j is exact even in bf16 (k <= 64),
    // so the mean is exactly the contribution, whatever n.
    std::vector<double> v(count);
    for (int i = 0; i < count; ++i) v[i] = double(1 << (i % 4));
    Tensor x = tensorOf(ctx.compute, dtype(), v);
    ctx.comm.allReduce(x, AllReduceOptions{ReduceOp::kMean})->wait();
    auto got = valuesOf(ctx.compute, x);
    for (int i = 0; i < count; ++i) ASSERT_EQ(got[i], v[i]) << "mismatch at index " << i;
  });
}

TEST_P(CollectiveTest, AllGatherConcatenatesInRankOrder) {
  const std::int64_t count = 3;
  runRanks(n(), [&](RankContext& ctx) {
    const int r = ctx.comm.rank();
    Tensor out = ctx.compute.empty({n() * count}, dtype());
    Tensor own = tensorOf(ctx.compute, dtype(), rankData(r, count));
    ConstView in = own;
    if (inPlace()) {
      ctx.compute.copy(own, out.view().slice(0, r * count, (r + 1) * count));
      in = out.view().slice(0, r * count, (r + 1) * count);
    }
    ctx.comm.allGather(in, out)->wait();
    auto got = valuesOf(ctx.compute, out);
    for (int q = 0; q < n(); ++q)
      for (std::int64_t i = 0; i < count; ++i)
        ASSERT_EQ(got[q * count + i], elem(q, i)) << "rank " << r << " block " << q << " index " << i;
  });
}

TEST_P(CollectiveTest, ReduceScatterGivesRankItsBlockOfTheSum) {
  const std::int64_t count = 2;  // per rank
  runRanks(n(), [&](RankContext& ctx) {
    const int r = ctx.comm.rank();
    Tensor in = tensorOf(ctx.compute, dtype(), rankData(r, n() * count));
    Tensor out = ctx.compute.empty({count}, dtype());
    View dst = inPlace() ? in.view().slice(0, r * count, (r + 1) * count) : out.view();
    ctx.comm.reduceScatter(in, dst)->wait();
    auto got = valuesOf(ctx.compute, dst);
    for (std::int64_t i = 0; i < count; ++i)
      ASSERT_EQ(got[i], sumOver(n(), r * count + i)) << "rank " << r << " mismatch at index " << i;
  });
}

TEST_P(CollectiveTest, BroadcastCopiesTheRootsBuffer) {
  const std::int64_t count = 4;
  const int root = n() - 1;
  runRanks(n(), [&](RankContext& ctx) {
    const int r = ctx.comm.rank();
    Tensor in = tensorOf(ctx.compute, dtype(), rankData(r, count));
    Tensor out = ctx.compute.empty({count}, dtype());
    View dst = inPlace() ? in.view() : out.view();
    ctx.comm.broadcast(in, dst, BroadcastOptions{root})->wait();
    auto got = valuesOf(ctx.compute, dst);
    for (std::int64_t i = 0; i < count; ++i) ASSERT_EQ(got[i], elem(root, i)) << "rank " << r << " index " << i;
  });
}

TEST_P(CollectiveTest, AllToAllTransposesBlocks) {
  const std::int64_t block = 2;
  runRanks(n(), [&](RankContext& ctx) {
    const int r = ctx.comm.rank();
    // Block q of rank r's input holds 10·r + q (+ i): rank q must receive it as its block r.
    std::vector<double> v(n() * block);
    for (int q = 0; q < n(); ++q)
      for (int i = 0; i < block; ++i) v[q * block + i] = double((10 * r + q + i) % 200);
    Tensor in = tensorOf(ctx.compute, dtype(), v);
    Tensor out = ctx.compute.empty({n() * block}, dtype());
    View dst = inPlace() ? in.view() : out.view();
    ctx.comm.allToAll(in, dst)->wait();
    auto got = valuesOf(ctx.compute, dst);
    for (int q = 0; q < n(); ++q)
      for (int i = 0; i < block; ++i)
        ASSERT_EQ(got[q * block + i], double((10 * q + r + i) % 200)) << "rank " << r << " block " << q;
  });
}

INSTANTIATE_TEST_SUITE_P(
    Sizes, CollectiveTest,
    ::testing::Combine(::testing::Values(1, 2, 3, 4, 5, 8, 64),
                       ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat64,
                                         DType::kInt64),
                       ::testing::Bool()),
    [](const auto& info) {
      return "n" + std::to_string(std::get<0>(info.param)) + "_" + dtypeName(std::get<1>(info.param)) +
             (std::get<2>(info.param) ? "_inplace" : "_outofplace");
    });

// fp8 data moves byte for byte; summing it is rejected before anything is issued, naming the op.
TEST(Collectives, Fp8IsMovedButNeverReduced) {
  runRanks(3, [](RankContext& ctx) {
    const int r = ctx.comm.rank();
    Tensor data = tensorOf(ctx.compute, DType::kFloat8E4M3, {double(r) + 0.5, -448.0});
    Tensor scales = tensorOf(ctx.compute, DType::kFloat8E8M0, {std::ldexp(1.0, r - 1)});
    Tensor allData = ctx.compute.empty({6}, DType::kFloat8E4M3);
    Tensor allScales = ctx.compute.empty({3}, DType::kFloat8E8M0);
    ctx.comm.allGather(data, allData)->wait();
    ctx.comm.allGather(scales, allScales)->wait();
    EXPECT_EQ(valuesOf(ctx.compute, allData), (std::vector<double>{0.5, -448, 1.5, -448, 2.5, -448}));
    EXPECT_EQ(valuesOf(ctx.compute, allScales), (std::vector<double>{0.5, 1, 2}));
    ctx.comm.broadcast(data, data, BroadcastOptions{2})->wait();
    EXPECT_EQ(valuesOf(ctx.compute, data), (std::vector<double>{2.5, -448}));
    EXPECT_EQ(testing::errorOf([&] { ctx.comm.allReduce(data)->wait(); }),
              "allReduce on world[0-2] (rank " + std::to_string(r) + "): cannot reduce fp8e4m3 data; expected fp32, "
              "bf16, fp16, fp64 or int64, got fp8e4m3 (2,); fp8 tensors can be all-gathered, broadcast or "
              "exchanged, dequantize them to reduce");
    Tensor one = ctx.compute.empty({1}, DType::kFloat8E8M0);
    const std::string rs = testing::errorOf([&] { ctx.comm.reduceScatter(allScales, one)->wait(); });
    EXPECT_NE(rs.find("reduceScatter on world[0-2]"), std::string::npos) << rs;
    EXPECT_NE(rs.find("cannot reduce e8m0 data"), std::string::npos) << rs;
  });
}

// Disjoint buffers and each op's documented in-place form pass; any other overlap is rejected on
// the rank that passes it, before anything is issued (NCCL and the DeviceFabric give it no defined
// result), and the world goes on.
TEST(Collectives, BuffersOverlappingOtherThanInPlaceAreRejected) {
  runRanks(2, [](RankContext& ctx) {
    const int r = ctx.comm.rank(), other = 1 - r;
    const std::string on = " on world[0,1] (rank " + std::to_string(r) + "): in and out overlap; expected disjoint "
                           "buffers or the in-place form ";
    Tensor buffer = tensorOf(ctx.compute, DType::kFloat32, {1, 2, 3, 4, 5, 6, 7, 8});
    const View all = buffer.view();
    auto part = [&](std::int64_t begin, std::int64_t end) { return all.slice(0, begin, end); };
    EXPECT_EQ(testing::errorOf([&] { ctx.comm.allReduce(part(0, 4), part(1, 5))->wait(); }),
              "allReduce" + on + "in == out, got in = out - 1 elements (in fp32 (4,), out fp32 (4,))");
    EXPECT_EQ(testing::errorOf([&] { ctx.comm.allGather(part(2 * other, 2 * other + 2), part(0, 4))->wait(); }),
              "allGather" + on + "in == out + r·in.numel(), this rank's block of out, got in = out + " +
                  std::to_string(2 * other) + " elements (in fp32 (2,), out fp32 (4,))");
    EXPECT_EQ(testing::errorOf([&] { ctx.comm.reduceScatter(part(0, 4), part(2 * other, 2 * other + 2))->wait(); }),
              "reduceScatter" + on + "out == in + r·out.numel(), this rank's block of in, got in = out " +
                  (other == 0 ? "+ 0" : "- 2") + " elements (in fp32 (4,), out fp32 (2,))");
    EXPECT_EQ(testing::errorOf([&] { ctx.comm.broadcast(part(0, 4), part(2, 6), BroadcastOptions{r})->wait(); }),
              "broadcast" + on + "in == out, got in = out - 2 elements (in fp32 (4,), out fp32 (4,))");
    const View bytes(static_cast<char*>(all.data()) + 2, Shape{4}, DType::kFloat32, all.device());
    EXPECT_EQ(testing::errorOf([&] { ctx.comm.allToAll(part(0, 4), bytes)->wait(); }),
              "allToAll" + on + "in == out, got in = out - 2 bytes (in fp32 (4,), out fp32 (4,))");

    // The in-place forms and disjoint buffers: rank r's block of (1..4) + (1..4) is (2r+1, 2r+2)·2.
    ctx.comm.reduceScatter(part(0, 4), part(2 * r, 2 * r + 2))->wait();
    EXPECT_EQ(valuesOf(ctx.compute, part(2 * r, 2 * r + 2)), (std::vector<double>{4.0 * r + 2, 4.0 * r + 4}));
    ctx.comm.allGather(part(2 * r, 2 * r + 2), part(0, 4))->wait();
    EXPECT_EQ(valuesOf(ctx.compute, part(0, 4)), (std::vector<double>{2, 4, 6, 8}));
    ctx.comm.allReduce(part(0, 4), part(4, 8))->wait();
    EXPECT_EQ(valuesOf(ctx.compute, part(4, 8)), (std::vector<double>{4, 8, 12, 16}));
  });
}

TEST(Collectives, IntegerMeanTruncates) {
  runRanks(3, [](RankContext& ctx) {
    Tensor x = tensorOf(ctx.compute, DType::kInt64, {double(ctx.comm.rank()), -double(ctx.comm.rank())});
    ctx.comm.allReduce(x, AllReduceOptions{ReduceOp::kMean})->wait();
    EXPECT_EQ(valuesOf(ctx.compute, x), (std::vector<double>{1, -1}));  // 3/3, -3/3
  });
}

TEST(Collectives, Bf16PartialSumsRoundInRankOrder) {
  // 256 + 1 rounds to 256 in bf16 (8 mantissa bits), so ((256 + 1) + 1) = 256 while 256 + 2 = 258:
  // the sum depends on rounding each partial sum, and the sim fixes that order.
  runRanks(3, [](RankContext& ctx) {
    Tensor x = tensorOf(ctx.compute, DType::kBFloat16, {ctx.comm.rank() == 0 ? 256.0 : 1.0});
    ctx.comm.allReduce(x)->wait();
    EXPECT_EQ(valuesOf(ctx.compute, x)[0], 256.0);
  });
}

TEST(Collectives, EmptyBuffersAndBarrierComplete) {
  runRanks(4, [](RankContext& ctx) {
    Tensor in = ctx.compute.empty({0}, DType::kFloat32);
    Tensor out = ctx.compute.empty({0}, DType::kFloat32);
    ctx.comm.allReduce(in, out)->wait();
    ctx.comm.allGather(in, out)->wait();
    ctx.comm.barrier()->wait();
  });
}

TEST(Collectives, AsyncWorkOverlapsAndCompletesInAnyWaitOrder) {
  runRanks(4, [](RankContext& ctx) {
    Tensor a = tensorOf(ctx.compute, DType::kFloat32, {1.0});
    Tensor b = tensorOf(ctx.compute, DType::kFloat32, {2.0});
    auto wa = ctx.comm.allReduce(a);
    auto wb = ctx.comm.allReduce(b);
    // Odd ranks wait in reverse order: matching is by sequence number, not by wait order.
    if (ctx.comm.rank() % 2) {
      wb->wait();
      wa->wait();
    } else {
      wa->wait();
      wb->wait();
    }
    EXPECT_TRUE(wa->isCompleted());
    EXPECT_EQ(valuesOf(ctx.compute, a)[0], 4.0);
    EXPECT_EQ(valuesOf(ctx.compute, b)[0], 8.0);
  });
}

TEST(Collectives, SplitFormsGroupsOrderedByKey) {
  runRanks(8, [](RankContext& ctx) {
    const int r = ctx.comm.rank();
    // Two groups by parity; keys reversed so group rank 0 is the highest global rank.
    auto group = ctx.comm.split(r % 2, -r, "parity");
    ASSERT_TRUE(group);
    std::vector<int> expect = r % 2 ? std::vector<int>{7, 5, 3, 1} : std::vector<int>{6, 4, 2, 0};
    EXPECT_EQ(group->globalRanks(), expect);
    EXPECT_EQ(group->globalRanks()[group->rank()], r);
    EXPECT_EQ(group->label(), "parity");
    Tensor x = tensorOf(ctx.compute, DType::kFloat32, {double(r)});
    group->allReduce(x)->wait();
    EXPECT_EQ(valuesOf(ctx.compute, x)[0], r % 2 ? 16.0 : 12.0);
    // Groups are independent streams: a collective on the world interleaves freely with them.
    auto none = ctx.comm.split(r < 2 ? 0 : -1, r, "first-two");
    EXPECT_EQ(bool(none), r < 2);
    if (none) {
      EXPECT_EQ(none->size(), 2);
    }
  });
}

TEST(Collectives, SubGroupsOfSubGroups) {
  runRanks(8, [](RankContext& ctx) {
    const int r = ctx.comm.rank();
    auto half = ctx.comm.split(r / 4, r, "half");
    auto quarter = half->split(half->rank() / 2, half->rank(), "quarter");
    EXPECT_EQ(quarter->globalRanks(), (std::vector<int>{r / 2 * 2, r / 2 * 2 + 1}));
    Tensor x = tensorOf(ctx.compute, DType::kInt64, {double(r)});
    Tensor out = ctx.compute.empty({2}, DType::kInt64);
    quarter->allGather(x, out)->wait();
    EXPECT_EQ(valuesOf(ctx.compute, out), (std::vector<double>{double(r / 2 * 2), double(r / 2 * 2 + 1)}));
  });
}

TEST(Collectives, TraceRecordsWhatEachRankIssued) {
  WorldOptions o;
  o.size = 2;
  o.trace = true;
  sim::World world(o);
  world.run([](RankContext& ctx) {
    Tensor x = ctx.compute.zeros({4}, DType::kBFloat16);
    Tensor y = ctx.compute.empty({8}, DType::kBFloat16);
    ctx.comm.allReduce(x)->wait();
    ctx.comm.allGather(x, y)->wait();
  });
  ASSERT_EQ(world.trace().size(), 2u);
  for (const auto& events : world.trace()) {
    ASSERT_EQ(events.size(), 2u);
    EXPECT_EQ(events[0].op, "allReduce");
    EXPECT_EQ(events[0].group, "world[0,1]");
    EXPECT_EQ(events[0].bytes, 8);
    EXPECT_EQ(events[1].op, "allGather");
    EXPECT_EQ(events[1].seq, 1u);
    EXPECT_EQ(events[1].dtype, "bf16");
  }
}

// The same chain of rounding-sensitive reductions gives bitwise identical results for any number
// of worker threads: the fabric reduces in rank order regardless of which rank arrives last.
TEST(Collectives, ResultsAreBitwiseIdenticalForAnyThreadCount) {
  const int n = 8;
  auto chain = [&](int threads) {
    std::vector<std::vector<double>> results(n);
    std::mutex mu;
    runRanks(n, [&](RankContext& ctx) {
      const int r = ctx.comm.rank();
      std::vector<double> v(64);
      for (int i = 0; i < 64; ++i) v[i] = 1.0 / (1 + r + i) + 1e-3 * r;
      Tensor x = tensorOf(ctx.compute, DType::kBFloat16, v);
      Tensor y = tensorOf(ctx.compute, DType::kFloat32, v);
      for (int step = 0; step < 5; ++step) {
        ctx.comm.allReduce(x, AllReduceOptions{ReduceOp::kMean})->wait();
        ctx.comm.allReduce(y)->wait();
        ctx.compute.scale(y, 0.37f);
      }
      auto a = valuesOf(ctx.compute, x), b = valuesOf(ctx.compute, y);
      a.insert(a.end(), b.begin(), b.end());
      std::lock_guard<std::mutex> lock(mu);
      results[r] = a;
    }, threads);
    return results;
  };
  const auto reference = chain(1);
  for (int threads : {2, 3, 8}) EXPECT_EQ(chain(threads), reference) << threads << " worker threads";
}

}  // namespace
}  // namespace tpsim
