// Tests for core/init.h: worked examples A, B and C of SPEC 3.11, stride recombination and
// TP-invariance of CPU init (I1, SPEC 6 item 5), the GTP branch, dtype rounding, GPU-init sharing
// (SPEC 6 item 6), the attribute tags (I2), and every argument error.
#include "core/init.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <numeric>
#include <optional>
#include <vector>

#include "backends/errors.h"
#include "core/attributes.h"
#include "sim/sim_compute.h"
#include "tests/sim_test_util.h"

namespace tpsim {
namespace {

using Values = std::vector<double>;

// M(r, c) = r·K + c: every master element names its own position.
void iotaInit(Generator&, std::vector<float>& v) { std::iota(v.begin(), v.end(), 0.f); }

Parameter weightOf(Compute& compute, Shape shape, DType dtype = DType::kFloat32) {
  Parameter p;
  p.name = "weight";
  p.data = compute.empty(shape, dtype);
  compute.fill(p.data, 7.0);  // anything the init does not write stays visible
  return p;
}

// Rows `rows` of the iota master with K columns, concatenated.
Values iotaRows(const std::vector<std::int64_t>& rows, std::int64_t k) {
  Values v;
  for (std::int64_t r : rows)
    for (std::int64_t c = 0; c < k; ++c) v.push_back(double(r * k + c));
  return v;
}

// Columns `cols` of the iota master (N rows, K columns), row-major.
Values iotaCols(std::int64_t n, std::int64_t k, const std::vector<std::int64_t>& cols) {
  Values v;
  for (std::int64_t r = 0; r < n; ++r)
    for (std::int64_t c : cols) v.push_back(double(r * k + c));
  return v;
}

// This rank's CPU-initialized shard of an (n, k) iota master.
Values cpuShard(Compute& compute, std::int64_t n, std::int64_t k, int dim, int stride, int rank, int world) {
  const std::int64_t size = dim == 0 ? n : k;
  Parameter w = weightOf(compute, dim == 0 ? Shape{size / world, k} : Shape{n, size / world});
  Generator gen(1);
  initializeAffineWeightCpu(compute, w, n, k, size / world, dim, iotaInit, gen, stride, false, DType::kFloat32,
                            rank, world);
  return testing::valuesOf(compute, w.data);
}

// Worked example A: N = 8, T = 2, stride 2 → rows {0,1,4,5} and {2,3,6,7}; stride 1 → halves.
TEST(InitializeAffineWeightCpu, WorkedExampleA) {
  sim::SimCompute compute;
  EXPECT_EQ(cpuShard(compute, 8, 3, 0, 2, 0, 2), iotaRows({0, 1, 4, 5}, 3));
  EXPECT_EQ(cpuShard(compute, 8, 3, 0, 2, 1, 2), iotaRows({2, 3, 6, 7}, 3));
  EXPECT_EQ(cpuShard(compute, 8, 3, 0, 1, 0, 2), iotaRows({0, 1, 2, 3}, 3));
  EXPECT_EQ(cpuShard(compute, 8, 3, 0, 1, 1, 2), iotaRows({4, 5, 6, 7}, 3));
}

// Worked example B: N = 12, T = 2, stride 3.
TEST(InitializeAffineWeightCpu, WorkedExampleB) {
  sim::SimCompute compute;
  EXPECT_EQ(cpuShard(compute, 12, 2, 0, 3, 0, 2), iotaRows({0, 1, 4, 5, 8, 9}, 2));
  EXPECT_EQ(cpuShard(compute, 12, 2, 0, 3, 1, 2), iotaRows({2, 3, 6, 7, 10, 11}, 2));
}

// Worked example C: row-parallel, K = 8, T = 2: columns 0..3 and 4..7, every row kept.
TEST(InitializeAffineWeightCpu, WorkedExampleC) {
  sim::SimCompute compute;
  EXPECT_EQ(cpuShard(compute, 3, 8, 1, 1, 0, 2), iotaCols(3, 8, {0, 1, 2, 3}));
  EXPECT_EQ(cpuShard(compute, 3, 8, 1, 1, 1, 2), iotaCols(3, 8, {4, 5, 6, 7}));
}

// SPEC 6 item 5: chunk j of rank t is master chunk t + j·T, for any T and stride, on either dim;
// the returned master does not depend on T.
TEST(InitializeAffineWeightCpu, StrideChunksRecombineToTheMaster) {
  sim::SimCompute compute;
  const std::int64_t other = 3;
  for (int dim : {0, 1})
    for (int world : {1, 2, 3, 4})
      for (int stride : {1, 2, 3}) {
        const std::int64_t chunk = 2, size = chunk * stride * world, n = dim == 0 ? size : other,
                           k = dim == 0 ? other : size;
        Values master;
        std::vector<Values> shards;
        for (int t = 0; t < world; ++t) {
          Parameter w = weightOf(compute, dim == 0 ? Shape{size / world, k} : Shape{n, size / world});
          Generator gen(99);
          Tensor m = initializeAffineWeightCpu(compute, w, n, k, size / world, dim, initMethodNormal(1.0), gen,
                                               stride, true, DType::kFloat32, t, world);
          Values mv = testing::valuesOf(compute, m);
          if (t == 0) master = mv;
          EXPECT_EQ(mv, master);
          shards.push_back(testing::valuesOf(compute, w.data));
        }
        // Reassemble: master index i along dim is chunk i / chunk, held by rank (i / chunk) % T as
        // its local chunk (i / chunk) / T.
        const std::int64_t local = size / world;
        for (std::int64_t r = 0; r < n; ++r)
          for (std::int64_t c = 0; c < k; ++c) {
            const std::int64_t i = dim == 0 ? r : c, j = i / chunk, t = j % world;
            const std::int64_t li = (j / world) * chunk + i % chunk;
            const std::int64_t at = dim == 0 ? li * k + c : r * local + li;
            ASSERT_EQ(shards[std::size_t(t)][std::size_t(at)], master[std::size_t(r * k + c)])
                << "dim " << dim << " T " << world << " stride " << stride << " at (" << r << ", " << c << ")";
          }
        Generator gen1(99);
        Parameter full = weightOf(compute, {n, k});
        initializeAffineWeightCpu(compute, full, n, k, size, dim, initMethodNormal(1.0), gen1, stride);
        EXPECT_EQ(testing::valuesOf(compute, full.data), master);  // T = 1, rank/worldSize defaulted
      }
}

// I1: T = 1 vs T = 4 with the same CPU seed 42 and different tracker seeds (42 vs 41): shard t is
// rows [4t, 4t+4) (embedding 16×4, column 16→16) or columns [4t, 4t+4) (row 16→16).
TEST(InitializeAffineWeightCpu, TensorParallelInvariance) {
  struct Layer {
    std::int64_t n, k;
    int dim;
  };
  const std::vector<Layer> layers = {{16, 4, 0}, {16, 16, 0}, {16, 16, 1}};  // embedding, column, row
  // Builds the three layers from one CPU generator on a rank of a TP group, after using the tracker.
  auto build = [&](Compute& compute, int rank, int world, std::uint64_t trackerSeed) {
    RngTracker tracker;
    modelParallelManualSeed(tracker, trackerSeed, RankSeeds{rank, 0, 0, 0, 1, 0, 1});
    Parameter unrelated = weightOf(compute, {4, 4});
    initializeAffineWeightGpu(compute, unrelated, initMethodNormal(1.0), 0, 1, false, tracker);
    Generator cpu(42);
    std::vector<Values> out;
    for (const Layer& l : layers) {
      const std::int64_t size = l.dim == 0 ? l.n : l.k;
      Parameter w = weightOf(compute, l.dim == 0 ? Shape{size / world, l.k} : Shape{l.n, size / world});
      initializeAffineWeightCpu(compute, w, l.n, l.k, size / world, l.dim, initMethodNormal(0.5), cpu, 1, false,
                                DType::kFloat32, rank, world);
      out.push_back(testing::valuesOf(compute, w.data));
    }
    return out;
  };
  sim::SimCompute single;
  const std::vector<Values> t1 = build(single, 0, 1, 42);
  std::vector<std::vector<Values>> t4(4);
  testing::runRanks(4, [&](RankContext& ctx) {
    t4[std::size_t(ctx.comm.rank())] = build(ctx.compute, ctx.comm.rank(), ctx.comm.size(), 41);
  });
  for (int t = 0; t < 4; ++t)
    for (std::size_t li = 0; li < layers.size(); ++li) {
      const Layer& l = layers[li];
      Values expected;
      for (std::int64_t r = 0; r < l.n; ++r)
        for (std::int64_t c = 0; c < l.k; ++c) {
          const std::int64_t i = l.dim == 0 ? r : c;
          if (i >= 4 * t && i < 4 * t + 4) expected.push_back(t1[li][std::size_t(r * l.k + c)]);
        }
      EXPECT_EQ(t4[std::size_t(t)][li], expected) << "layer " << li << " rank " << t;
    }
}

// params_dtype: the master is cast once to paramsDtype, the shard once more into the weight dtype.
TEST(InitializeAffineWeightCpu, ParamsDtypeRoundsOnce) {
  sim::SimCompute compute;
  Generator ref(5);
  std::vector<float> draws(8 * 4);
  initMethodNormal(1.0)(ref, draws);
  Values bf16Draws, fp32Draws;
  for (float d : draws) {
    bf16Draws.push_back(roundTo(DType::kBFloat16, d));
    fp32Draws.push_back(d);
  }
  ASSERT_NE(bf16Draws, fp32Draws);
  struct Case {
    DType params, weight;
    const Values& master;
    const Values& shard;
  };
  for (const Case& c : {Case{DType::kBFloat16, DType::kBFloat16, bf16Draws, bf16Draws},
                        Case{DType::kFloat32, DType::kBFloat16, fp32Draws, bf16Draws},   // Column: master stays fp32
                        Case{DType::kBFloat16, DType::kFloat32, bf16Draws, bf16Draws},
                        Case{DType::kFloat32, DType::kFloat32, fp32Draws, fp32Draws}}) {
    Generator gen(5);
    Parameter w = weightOf(compute, {8, 4}, c.weight);
    Tensor master = initializeAffineWeightCpu(compute, w, 8, 4, 8, 0, initMethodNormal(1.0), gen, 1, true, c.params);
    EXPECT_EQ(master.dtype(), c.params);
    EXPECT_EQ(master.shape(), Shape({8, 4}));
    EXPECT_EQ(testing::valuesOf(compute, master), c.master) << dtypeName(c.params) << " -> " << dtypeName(c.weight);
    EXPECT_EQ(testing::valuesOf(compute, w.data), c.shard) << dtypeName(c.params) << " -> " << dtypeName(c.weight);
    EXPECT_EQ(gen, ref);  // drew exactly the master
  }
  Generator gen(5);
  Parameter w = weightOf(compute, {8, 4});
  EXPECT_FALSE(initializeAffineWeightCpu(compute, w, 8, 4, 8, 0, initMethodNormal(1.0), gen).defined());
}

// I2: the tags every init leaves (column-like dim 0, row-like dim 1, stride 1), and none with skip.
TEST(InitializeAffineWeight, TagsTheWeight) {
  sim::SimCompute compute;
  RngTracker tracker;
  modelParallelManualSeed(tracker, 3, RankSeeds{});
  for (int dim : {0, 1}) {
    Parameter gpu = weightOf(compute, {4, 4});
    initializeAffineWeightGpu(compute, gpu, initMethodNormal(1.0), dim, 1, false, tracker);
    Parameter cpu = weightOf(compute, {4, 4});
    Generator gen(1);
    initializeAffineWeightCpu(compute, cpu, 4, 4, 4, dim, initMethodNormal(1.0), gen);
    ParamAttributes untouched;  // perform_initialization = False: the layer tags directly
    setTensorModelParallelAttributes(untouched, true, dim, 1);
    for (const ParamAttributes* a : {&gpu.attrs, &cpu.attrs, &untouched}) {
      EXPECT_EQ(a->tensorModelParallel, true);
      EXPECT_EQ(a->partitionDim, dim);
      EXPECT_EQ(a->partitionStride, 1);
      EXPECT_FALSE(a->isQkv.has_value());
    }
  }
  Parameter skipped = weightOf(compute, {4, 4});
  Generator gen(1);
  initializeAffineWeightCpu(compute, skipped, 4, 4, 4, 0, initMethodNormal(1.0), gen, 1, false, DType::kFloat32,
                            std::nullopt, std::nullopt, true);
  EXPECT_FALSE(skipped.attrs.tensorModelParallel.has_value());
  Parameter strided = weightOf(compute, {4, 4});
  initializeAffineWeightGpu(compute, strided, initMethodNormal(1.0), 0, 2, false, tracker);
  EXPECT_EQ(strided.attrs.partitionStride, 2);  // recorded only
}

// SPEC 6 item 6 on world 4, T = 2 (TP rank r % 2): same seed and tp rank → bitwise equal shards,
// different tp rank → different. Expert weights share by (ep, etp) instead: here etp = r / 2.
TEST(InitializeAffineWeightGpu, SharingFollowsTheTrackerSeeds) {
  std::vector<Values> first(4), second(4), expert(4), bf16(4);
  testing::runRanks(4, [&](RankContext& ctx) {
    const int r = ctx.comm.rank();
    std::unique_ptr<Collectives> tp = ctx.comm.split(r / 2, r % 2, "tp");
    RngTracker tracker;
    modelParallelManualSeed(tracker, 1234, RankSeeds{tp->rank(), 0, r / 2, 0, 1, 0, 1});
    const Generator defaultBefore = tracker.defaultGenerator();
    Parameter a = weightOf(ctx.compute, {4, 3}), b = weightOf(ctx.compute, {4, 3});
    Parameter e = weightOf(ctx.compute, {4, 3}), h = weightOf(ctx.compute, {2, 3}, DType::kBFloat16);
    initializeAffineWeightGpu(ctx.compute, a, initMethodNormal(0.02), 0, 1, false, tracker);
    initializeAffineWeightGpu(ctx.compute, b, initMethodNormal(0.02), 0, 1, false, tracker);
    initializeAffineWeightGpu(ctx.compute, e, initMethodNormal(0.02), 1, 1, true, tracker);
    initializeAffineWeightGpu(ctx.compute, h, initMethodNormal(0.02), 0, 1, false, tracker);
    first[r] = testing::valuesOf(ctx.compute, a.data);
    second[r] = testing::valuesOf(ctx.compute, b.data);
    expert[r] = testing::valuesOf(ctx.compute, e.data);
    bf16[r] = testing::valuesOf(ctx.compute, h.data);

    // The draws are this rank's TP stream, in order; the expert draw its expert stream.
    Generator tpStream(1234 + 2718 + std::uint64_t(tp->rank())), expertStream(1234 + 1024 + std::uint64_t(r / 2));
    std::vector<float> v(12), x(12), y(6);
    initMethodNormal(0.02)(tpStream, v);
    initMethodNormal(0.02)(tpStream, x);
    initMethodNormal(0.02)(tpStream, y);
    EXPECT_EQ(first[r], Values(v.begin(), v.end()));
    EXPECT_EQ(second[r], Values(x.begin(), x.end()));
    Values rounded;
    for (float f : y) rounded.push_back(roundTo(DType::kBFloat16, f));  // one rounding from fp32
    EXPECT_EQ(bf16[r], rounded);
    initMethodNormal(0.02)(expertStream, v);
    EXPECT_EQ(expert[r], Values(v.begin(), v.end()));
    EXPECT_EQ(tracker.getStates().at(kModelParallelRngName), tpStream);
    EXPECT_EQ(tracker.defaultGenerator(), defaultBefore);
  });
  for (int r = 0; r < 4; ++r)
    for (int q = 0; q < 4; ++q) {
      EXPECT_EQ(first[r] == first[q], r % 2 == q % 2) << r << " vs " << q;
      EXPECT_EQ(second[r] == second[q], r % 2 == q % 2) << r << " vs " << q;
      EXPECT_EQ(expert[r] == expert[q], r / 2 == q / 2) << r << " vs " << q;
    }
  EXPECT_NE(first[0], second[0]);  // the stream advanced
}

TEST(InitializeAffineWeightGpu, Errors) {
  sim::SimCompute compute;
  RngTracker empty;
  Parameter w = weightOf(compute, {2, 2});
  EXPECT_THROW(initializeAffineWeightGpu(compute, w, initMethodNormal(1.0), 0, 1, false, empty), InvalidArgument);
  EXPECT_FALSE(w.attrs.tensorModelParallel.has_value());  // unchanged on error
  EXPECT_EQ(testing::valuesOf(compute, w.data), Values(4, 7.0));

  RngTracker tracker;
  modelParallelManualSeed(tracker, 1, RankSeeds{});
  initializeAffineWeightGpu(compute, w, initMethodNormal(1.0), 0, 1, false, tracker);
  const Generator before = tracker.getStates().at(kModelParallelRngName);
  EXPECT_THROW(initializeAffineWeightGpu(compute, w, initMethodNormal(1.0), 0, 1, false, tracker),
               InvalidArgument);  // one-shot tags
  EXPECT_EQ(tracker.getStates().at(kModelParallelRngName), before);

  Parameter unallocated;
  EXPECT_THROW(initializeAffineWeightGpu(compute, unallocated, initMethodNormal(1.0), 0, 1, false, tracker),
               InvalidArgument);
  Parameter fresh = weightOf(compute, {2, 2});
  EXPECT_THROW(initializeAffineWeightGpu(compute, fresh, InitMethod(), 0, 1, false, tracker), InvalidArgument);
  auto shrinking = [](Generator&, std::vector<float>& v) { v.pop_back(); };
  Parameter fresh2 = weightOf(compute, {2, 2});
  EXPECT_THROW(initializeAffineWeightGpu(compute, fresh2, shrinking, 0, 1, false, tracker), InvalidArgument);
}

TEST(InitializeAffineWeightCpu, Errors) {
  sim::SimCompute compute;
  const Generator start(3);
  auto call = [&](Shape shape, std::int64_t n, std::int64_t k, std::int64_t per, int dim, int stride,
                  std::optional<int> rank, std::optional<int> world, DType params = DType::kFloat32) {
    Parameter w = weightOf(compute, shape);
    Generator gen = start;
    try {
      initializeAffineWeightCpu(compute, w, n, k, per, dim, initMethodNormal(1.0), gen, stride, false, params, rank,
                                world);
    } catch (const InvalidArgument&) {
      EXPECT_EQ(gen, start) << "drew before failing";
      EXPECT_FALSE(w.attrs.tensorModelParallel.has_value()) << "tagged before failing";
      throw;
    }
  };
  // SPEC 8 item 6: exactly one of rank and worldSize.
  EXPECT_THROW(call({4, 4}, 8, 4, 4, 0, 1, 1, std::nullopt), InvalidArgument);
  EXPECT_THROW(call({4, 4}, 8, 4, 4, 0, 1, std::nullopt, 2), InvalidArgument);
  // Neither, with more than one partition: no global TP group to default to.
  EXPECT_THROW(call({4, 4}, 8, 4, 4, 0, 1, std::nullopt, std::nullopt), InvalidArgument);
  EXPECT_THROW(call({4, 4}, 8, 4, 4, 0, 1, 2, 2), InvalidArgument);     // rank out of range
  EXPECT_THROW(call({4, 4}, 8, 4, 4, 0, 1, -1, 2), InvalidArgument);
  EXPECT_THROW(call({4, 4}, 8, 4, 4, 0, 1, 0, 0), InvalidArgument);     // worldSize 0
  EXPECT_THROW(call({6, 4}, 12, 4, 6, 0, 4, 0, 2), InvalidArgument);    // 6 not divisible by stride 4
  EXPECT_THROW(call({4, 3}, 8, 4, 4, 0, 1, 0, 2), InvalidArgument);     // weight shape
  EXPECT_THROW(call({4, 4}, 8, 4, 4, 2, 1, 0, 2), InvalidArgument);     // partitionDim
  EXPECT_THROW(call({4, 4}, 8, 4, 4, 0, 0, 0, 2), InvalidArgument);     // stride 0
  EXPECT_THROW(call({4, 4}, 8, 4, 0, 0, 1, 0, 2), InvalidArgument);     // perPartitionSize 0
  EXPECT_THROW(call({4, 4}, 8, 4, 4, 0, 1, 0, 2, DType::kInt64), InvalidArgument);
  EXPECT_THROW(call({16}, 8, 2, 4, 0, 1, 0, 2), InvalidArgument);       // not a matrix
  EXPECT_NO_THROW(call({4, 4}, 8, 4, 4, 0, 1, 1, 2));

  Parameter tagged = weightOf(compute, {4, 4});
  setTensorModelParallelAttributes(tagged.attrs, true, 0, 1);
  Generator gen = start;
  EXPECT_THROW(initializeAffineWeightCpu(compute, tagged, 4, 4, 4, 0, initMethodNormal(1.0), gen), InvalidArgument);
  EXPECT_EQ(gen, start);
}

// The GTP branch [Seed]: a shard gets rows [g·S, (g+1)·S) of the TP-local chunk X zero-padded by
// padLength rows, with G = 2 GTP ranks. X comes from the stride selection first.
struct GtpCase {
  std::int64_t n, k, per;
  int dim, stride, tpRank, tpSize, pad;
  std::int64_t s;  // shard rows
};

// Each GTP rank's shard, and the X of a plain (non-GTP) init with the same arguments.
void runGtpCase(const GtpCase& c, std::vector<Values>& shards, Values& x, std::int64_t& xCols) {
  sim::SimCompute compute;
  const std::int64_t xRows = c.dim == 0 ? c.per : c.n;
  xCols = c.dim == 0 ? c.k : c.per;
  Parameter plain = weightOf(compute, {xRows, xCols});
  Generator gen(1);
  initializeAffineWeightCpu(compute, plain, c.n, c.k, c.per, c.dim, iotaInit, gen, c.stride, false,
                            DType::kFloat32, c.tpRank, c.tpSize);
  x = testing::valuesOf(compute, plain.data);
  shards.assign(2, {});
  testing::runRanks(2, [&](RankContext& ctx) {
    Parameter shard = weightOf(ctx.compute, {c.s, xCols});
    setTensorModelParallelAttributes(shard.attrs, true, c.dim, c.stride);  // copied at wrap time
    shard.attrs.isGtpWeightRemat = true;
    shard.attrs.group = &ctx.comm;
    shard.attrs.padLength = c.pad;
    Generator g(1);
    EXPECT_THROW(initializeAffineWeightCpu(ctx.compute, shard, c.n, c.k, c.per, c.dim, iotaInit, g, c.stride, false,
                                           DType::kFloat32, c.tpRank, c.tpSize),
                 InvalidArgument);  // a shard is already tagged: skip is required
    initializeAffineWeightCpu(ctx.compute, shard, c.n, c.k, c.per, c.dim, iotaInit, g, c.stride, false,
                              DType::kFloat32, c.tpRank, c.tpSize, true);
    EXPECT_EQ(shard.attrs.partitionStride, c.stride);
    shards[std::size_t(ctx.comm.rank())] = testing::valuesOf(ctx.compute, shard.data);
  });
}

// Expected shard g: rows [g·S, (g+1)·S) of X padded with zero rows.
Values paddedSlice(const Values& x, std::int64_t xCols, std::int64_t s, int g) {
  Values out(std::size_t(s * xCols), 0.0);
  const std::int64_t xRows = std::int64_t(x.size()) / xCols;
  for (std::int64_t r = 0; r < s && g * s + r < xRows; ++r)
    for (std::int64_t c = 0; c < xCols; ++c)
      out[std::size_t(r * xCols + c)] = x[std::size_t((g * s + r) * xCols + c)];
  return out;
}

TEST(InitializeAffineWeightCpu, GtpShardsSliceThePaddedTpLocalChunk) {
  const std::vector<GtpCase> cases = {
      // Column N = 12, T = 2, stride 2: TP rank 1 keeps master rows 3-5, 9-11 (Dlog 6); pad 2, S 4.
      {12, 3, 6, 0, 2, 1, 2, 2, 4},
      // Same X, pad 10 (S 8): the padding spills into GTP rank 0, rank 1 is all padding.
      {12, 3, 6, 0, 2, 1, 2, 10, 8},
      // Row-parallel: TP cuts K = 4 (X = (6, 2), columns 0-1), GTP still cuts dim 0; pad 2, S 4.
      {6, 4, 2, 1, 1, 0, 2, 2, 4},
      // No padding, no TP.
      {8, 2, 8, 0, 1, 0, 1, 0, 4},
  };
  for (const GtpCase& c : cases) {
    std::vector<Values> shards;
    Values x;
    std::int64_t xCols = 0;
    runGtpCase(c, shards, x, xCols);
    for (int g = 0; g < 2; ++g)
      EXPECT_EQ(shards[std::size_t(g)], paddedSlice(x, xCols, c.s, g)) << "pad " << c.pad << " dim " << c.dim
                                                                       << " GTP rank " << g;
  }
  // The first case spelled out: stride selection before padding.
  std::vector<Values> shards;
  Values x;
  std::int64_t xCols = 0;
  runGtpCase(cases[0], shards, x, xCols);
  EXPECT_EQ(shards[0], iotaRows({3, 4, 5, 9}, 3));
  Values tail = iotaRows({10, 11}, 3);
  tail.resize(12, 0.0);
  EXPECT_EQ(shards[1], tail);
}

TEST(InitializeAffineWeightCpu, GtpShardErrors) {
  testing::runRanks(2, [&](RankContext& ctx) {
    auto shardOf = [&](std::int64_t rows, bool withGroup) {
      Parameter p = weightOf(ctx.compute, {rows, 3});
      p.attrs.isGtpWeightRemat = true;
      if (withGroup) p.attrs.group = &ctx.comm;
      p.attrs.padLength = 2;
      return p;
    };
    Generator gen(1);
    Parameter noGroup = shardOf(4, false);
    EXPECT_THROW(initializeAffineWeightCpu(ctx.compute, noGroup, 6, 3, 6, 0, iotaInit, gen), InvalidArgument);
    Parameter wrongRows = shardOf(3, true);  // 2·3 != 6 + 2
    EXPECT_THROW(initializeAffineWeightCpu(ctx.compute, wrongRows, 6, 3, 6, 0, iotaInit, gen), InvalidArgument);
    Parameter ok = shardOf(4, true);
    EXPECT_NO_THROW(initializeAffineWeightCpu(ctx.compute, ok, 6, 3, 6, 0, iotaInit, gen));
  });
}

}  // namespace
}  // namespace tpsim
