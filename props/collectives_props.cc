// Laws of the simulated collectives, over random group sizes, worker counts, sub-groups and data:
//   allReduce equals the rank-order sum computed on one thread, whatever the scheduling;
//   allGather(block_r(x)) == x;   allToAll(allToAll(x)) == x;
//   reduceScatter then allGather == allReduce.
// Worlds of 1 to 16 ranks, and 32 and 64, on 1 to 4 worker threads. These are laws of the simulator
// itself; the gpu backend's collectives are compared with its bit for bit in backend_props.cc.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <mutex>

#include "props/generators.h"
#include "props/harness.h"
#include "sim/world.h"
#include "tests/sim_test_util.h"

namespace tpsim {
namespace {

using testing::tensorOf;
using testing::valuesOf;

struct Topology {
  int ranks;
  int threads;
  int groups;  // the world is split into this many interleaved sub-groups (rank % groups)
};

rc::Gen<Topology> genTopology() {
  return rc::gen::build<Topology>(rc::gen::set(&Topology::ranks, props::pick<int>({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
                                                                                  13, 14, 15, 16, 32, 64})),
                                  rc::gen::set(&Topology::threads, props::uniform<int>(1, 5)),
                                  rc::gen::set(&Topology::groups, props::uniform<int>(1, 4)));
}

void runOn(const Topology& t, const std::function<void(RankContext&, Collectives&)>& fn) {
  WorldOptions o;
  o.size = t.ranks;
  o.threads = t.threads;
  sim::World(o).run([&](RankContext& ctx) {
    const int r = ctx.comm.rank();
    auto group = ctx.comm.split(r % t.groups, r, "sub");
    fn(ctx, *group);
  });
}

// Rank-order sum with the data's rounding, computed without the fabric.
std::vector<double> rankOrderSum(DType dtype, const std::vector<std::vector<double>>& data) {
  std::vector<double> acc = data[0];
  for (std::size_t r = 1; r < data.size(); ++r)
    for (std::size_t i = 0; i < acc.size(); ++i) acc[i] = double(roundTo(dtype, float(acc[i] + data[r][i])));
  return acc;
}

TPSIM_PROP(CollectiveLaws, AllReduceEqualsTheRankOrderSumForAnySchedule, 600) {
  const Topology t = *genTopology();
  const DType dtype = *rc::gen::element(DType::kFloat32, DType::kBFloat16, DType::kFloat16);
  const int count = *props::uniform<int>(0, 9);
  // Real-valued data: the sum's rounding depends on the order, so this checks the order too.
  const auto data = *rc::gen::container<std::vector<std::vector<double>>>(
      t.ranks, rc::gen::container<std::vector<double>>(
                   count, rc::gen::map(props::uniform<int>(-1000, 1000), [](int v) { return v / 7.0; })));
  std::mutex mu;
  std::vector<std::vector<double>> got(t.ranks);
  runOn(t, [&](RankContext& ctx, Collectives& g) {
    std::vector<double> mine(count);
    for (int i = 0; i < count; ++i) mine[i] = double(roundTo(dtype, float(data[ctx.comm.rank()][i])));
    Tensor x = tensorOf(ctx.compute, dtype, mine, Shape{count});
    g.allReduce(x)->wait();
    std::lock_guard<std::mutex> lock(mu);
    got[ctx.comm.rank()] = valuesOf(ctx.compute, x);
  });
  for (int r = 0; r < t.ranks; ++r) {
    std::vector<std::vector<double>> members;
    for (int q = r % t.groups; q < t.ranks; q += t.groups) {
      std::vector<double> v(count);
      for (int i = 0; i < count; ++i) v[i] = double(roundTo(dtype, float(data[q][i])));
      members.push_back(v);
    }
    RC_ASSERT(got[r] == rankOrderSum(dtype, members));
  }
}

TPSIM_PROP(CollectiveLaws, AllGatherOfBlocksRebuildsTheTensor, 600) {
  const Topology t = *genTopology();
  const int block = *props::uniform<int>(0, 6);
  const auto x = *rc::gen::container<std::vector<int>>(std::size_t(t.ranks * block), props::uniform<int>(-50, 50));
  runOn(t, [&](RankContext& ctx, Collectives& g) {
    // Every group gathers the blocks of x its members own; compare with those blocks of x.
    std::vector<double> mine(x.begin() + ctx.comm.rank() * block, x.begin() + (ctx.comm.rank() + 1) * block);
    Tensor in = tensorOf(ctx.compute, DType::kInt64, mine, Shape{block});
    Tensor out = ctx.compute.empty({g.size() * block}, DType::kInt64);
    g.allGather(in, out)->wait();
    auto got = valuesOf(ctx.compute, out);
    for (int q = 0; q < g.size(); ++q)
      for (int i = 0; i < block; ++i) RC_ASSERT(got[q * block + i] == double(x[g.globalRanks()[q] * block + i]));
  });
}

TPSIM_PROP(CollectiveLaws, AllToAllTwiceIsIdentity, 600) {
  const Topology t = *genTopology();
  const int block = *props::uniform<int>(0, 4);
  runOn(t, [&](RankContext& ctx, Collectives& g) {
    std::vector<double> v(g.size() * block);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = double(ctx.comm.rank() * 1000 + int(i));
    Tensor x = tensorOf(ctx.compute, DType::kFloat32, v, Shape{std::int64_t(v.size())});
    g.allToAll(x, x)->wait();
    g.allToAll(x, x)->wait();
    RC_ASSERT(valuesOf(ctx.compute, x) == v);
  });
}

TPSIM_PROP(CollectiveLaws, ReduceScatterThenAllGatherIsAllReduce, 600) {
  const Topology t = *genTopology();
  const int block = *props::uniform<int>(1, 5);
  runOn(t, [&](RankContext& ctx, Collectives& g) {
    const int n = g.size();
    std::vector<double> v(n * block);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = double((ctx.comm.rank() * 7 + int(i)) % 11);
    Tensor x = tensorOf(ctx.compute, DType::kFloat32, v, Shape{n * block});
    Tensor y = tensorOf(ctx.compute, DType::kFloat32, v, Shape{n * block});
    g.reduceScatter(x, x.view().slice(0, g.rank() * block, (g.rank() + 1) * block))->wait();
    g.allGather(x.view().slice(0, g.rank() * block, (g.rank() + 1) * block), x)->wait();
    g.allReduce(y)->wait();
    RC_ASSERT(valuesOf(ctx.compute, x) == valuesOf(ctx.compute, y));
  });
}

}  // namespace
}  // namespace tpsim
