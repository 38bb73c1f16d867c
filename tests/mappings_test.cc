// Tests for core/mappings.h and core/utils.h on the simulator: SPEC 5.1 rows M1-M11, SPEC 5.2 rows
// U1-U4, closed-form last-dim and uneven cases, strided inputs, size-1 groups, every error message,
// and the adjointness of each forward/backward pair (SPEC 6 item 3) for groups of 1 to 4 ranks.
// All data are small integers, so every expectation is exact.
#include "core/mappings.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "core/utils.h"
#include "sim/world.h"
#include "tests/sim_test_util.h"

namespace tpsim {
namespace {

using testing::runRanks;
using testing::tensorOf;
using testing::valuesOf;

constexpr DType kF32 = DType::kFloat32;

// Row-major values of a (rows, cols) matrix with element (i, j) = f(i, j).
std::vector<double> matrix(std::int64_t rows, std::int64_t cols,
                           const std::function<double(std::int64_t, std::int64_t)>& f) {
  std::vector<double> v;
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < cols; ++j) v.push_back(f(i, j));
  return v;
}

// `len` copies of each value in turn: blocks({1, 2}, 3) = [1, 1, 1, 2, 2, 2].
std::vector<double> blocks(const std::vector<double>& values, std::int64_t len) {
  std::vector<double> v;
  for (double value : values) v.insert(v.end(), std::size_t(len), value);
  return v;
}

void expectTensor(Compute& compute, ConstView got, const Shape& shape, const std::vector<double>& want,
                  const std::string& what = "") {
  ASSERT_EQ(got.shape(), shape) << what;
  const std::vector<double> values = valuesOf(compute, got);
  ASSERT_EQ(values.size(), want.size()) << what;
  for (std::size_t i = 0; i < values.size(); ++i) ASSERT_EQ(values[i], want[i]) << what << " mismatch at index " << i;
}

template <typename F>
void expectInvalid(F f, const std::string& message) {
  try {
    f();
    ADD_FAILURE() << "expected InvalidArgument: " << message;
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(std::string(e.what()), message);
  }
}

// ---- SPEC 5.1: world 8, T = 4; TP groups are ranks [0, 4) and [4, 8), built by split. ----------

// Runs fn on the 8 ranks with their TP group, TP rank t = r mod 4 and base = r - t.
void runSpecWorld(const std::function<void(RankContext&, Collectives&, int r, int t, int base)>& fn) {
  runRanks(8, [&](RankContext& ctx) {
    const int r = ctx.comm.rank();
    std::unique_ptr<Collectives> tp = ctx.comm.split(r / 4, r, "tp");
    ASSERT_EQ(tp->rank(), r % 4);
    fn(ctx, *tp, r, r % 4, r - r % 4);
  });
}

// X ∈ R^{8×4} of M3, M6, M7, the same on every rank: X(i, j) = 10·i + j.
double specX(std::int64_t i, std::int64_t j) { return double(10 * i + j); }

TEST(MappingsSpec, M1CopyToIsIdentityForwardAndAllReducesBackward) {
  runSpecWorld([](RankContext& ctx, Collectives& tp, int r, int, int) {
    Tensor x = tensorOf(ctx.compute, kF32, {double(r)});  // (1)
    copyToTpRegionForward(ctx.compute, tp, x);
    expectTensor(ctx.compute, x, Shape{1}, {double(r)}, "forward");
    copyToTpRegionBackward(ctx.compute, tp, x);
    expectTensor(ctx.compute, x, Shape{1}, {r < 4 ? 6.0 : 22.0}, "backward");
  });
}

TEST(MappingsSpec, M2ReduceFromAllReducesForwardAndIsIdentityBackward) {
  runSpecWorld([](RankContext& ctx, Collectives& tp, int r, int, int) {
    Tensor x = tensorOf(ctx.compute, kF32, {double(r)});  // (1)
    reduceFromTpRegionForward(ctx.compute, tp, x);
    expectTensor(ctx.compute, x, Shape{1}, {r < 4 ? 6.0 : 22.0}, "forward");
    Tensor dy = tensorOf(ctx.compute, kF32, {double(r)});  // (1)
    reduceFromTpRegionBackward(ctx.compute, tp, dy);
    expectTensor(ctx.compute, dy, Shape{1}, {double(r)}, "backward");
  });
}

TEST(MappingsSpec, M3ScatterToTpForwardKeepsColumnT) {
  runSpecWorld([](RankContext& ctx, Collectives& tp, int, int t, int) {
    Tensor x = tensorOf(ctx.compute, kF32, matrix(8, 4, specX), Shape{8, 4});  // (8, 4)
    Tensor y = scatterToTpRegionForward(ctx.compute, tp, x);                   // (8, 1)
    expectTensor(ctx.compute, y, Shape{8, 1}, matrix(8, 1, [t](std::int64_t i, std::int64_t) { return specX(i, t); }));
  });
}

TEST(MappingsSpec, M4ScatterToTpBackwardGathersTheGroup) {
  runSpecWorld([](RankContext& ctx, Collectives& tp, int r, int, int base) {
    Tensor dy = tensorOf(ctx.compute, kF32, blocks({double(r)}, 8));  // (8)
    Tensor dx = scatterToTpRegionBackward(ctx.compute, tp, dy);       // (32)
    expectTensor(ctx.compute, dx, Shape{32}, blocks({double(base), base + 1.0, base + 2.0, base + 3.0}, 8));
  });
}

TEST(MappingsSpec, M5GatherFromTpForwardGathersTheGroup) {
  runSpecWorld([](RankContext& ctx, Collectives& tp, int r, int, int base) {
    Tensor x = tensorOf(ctx.compute, kF32, blocks({double(r)}, 8));  // (8)
    Tensor y = gatherFromTpRegionForward(ctx.compute, tp, x);        // (32)
    expectTensor(ctx.compute, y, Shape{32}, blocks({double(base), base + 1.0, base + 2.0, base + 3.0}, 8));
  });
}

TEST(MappingsSpec, M6GatherFromTpBackwardKeepsColumnT) {
  runSpecWorld([](RankContext& ctx, Collectives& tp, int, int t, int) {
    Tensor dy = tensorOf(ctx.compute, kF32, matrix(8, 4, specX), Shape{8, 4});  // (8, 4)
    Tensor dx = gatherFromTpRegionBackward(ctx.compute, tp, dy);                // (8, 1)
    expectTensor(ctx.compute, dx, Shape{8, 1}, matrix(8, 1, [t](std::int64_t i, std::int64_t) { return specX(i, t); }));
  });
}

TEST(MappingsSpec, M7ScatterToSpForwardKeepsRows2tTo2tPlus2) {
  runSpecWorld([](RankContext& ctx, Collectives& tp, int, int t, int) {
    Tensor x = tensorOf(ctx.compute, kF32, matrix(8, 4, specX), Shape{8, 4});  // (8, 4)
    Tensor y = scatterToSpRegionForward(ctx.compute, tp, x);                   // (2, 4)
    expectTensor(ctx.compute, y, Shape{2, 4},
                 matrix(2, 4, [t](std::int64_t i, std::int64_t j) { return specX(2 * t + i, j); }));
  });
}

TEST(MappingsSpec, M8GatherFromSpForwardGathersTheGroup) {
  runSpecWorld([](RankContext& ctx, Collectives& tp, int r, int, int base) {
    Tensor x = tensorOf(ctx.compute, kF32, blocks({double(r)}, 4));  // (4)
    Tensor y = gatherFromSpRegionForward(ctx.compute, tp, x);        // (16)
    expectTensor(ctx.compute, y, Shape{16}, blocks({double(base), base + 1.0, base + 2.0, base + 3.0}, 4));
  });
}

// Row i of the 4×4 input holds i on all four ranks, so row t of the sum holds 4·t.
TEST(MappingsSpec, M9GatherFromSpBackwardReduceScatters) {
  runSpecWorld([](RankContext& ctx, Collectives& tp, int, int t, int) {
    Tensor dy = tensorOf(ctx.compute, kF32, matrix(4, 4, [](std::int64_t i, std::int64_t) { return double(i); }),
                         Shape{4, 4});                                                               // (4, 4)
    Tensor dx = gatherFromSpRegionBackward(ctx.compute, tp, dy, /*tensorParallelOutputGrad=*/true);  // (1, 4)
    expectTensor(ctx.compute, dx, Shape{1, 4}, blocks({4.0 * t}, 4));
  });
}

TEST(MappingsSpec, M10ReduceScatterToSpForward) {
  runSpecWorld([](RankContext& ctx, Collectives& tp, int, int t, int) {
    Tensor x = tensorOf(ctx.compute, kF32, matrix(4, 4, [](std::int64_t i, std::int64_t) { return double(i); }),
                        Shape{4, 4});                               // (4, 4)
    Tensor y = reduceScatterToSpRegionForward(ctx.compute, tp, x);  // (1, 4)
    expectTensor(ctx.compute, y, Shape{1, 4}, blocks({4.0 * t}, 4));
  });
}

TEST(MappingsSpec, M11ReduceScatterToSpBackwardGathersTheGroup) {
  runSpecWorld([](RankContext& ctx, Collectives& tp, int r, int, int base) {
    Tensor dy = tensorOf(ctx.compute, kF32, blocks({double(r)}, 4));   // (4)
    Tensor dx = reduceScatterToSpRegionBackward(ctx.compute, tp, dy);  // (16)
    expectTensor(ctx.compute, dx, Shape{16}, blocks({double(base), base + 1.0, base + 2.0, base + 3.0}, 4));
  });
}

// ---- SPEC 5.2 U1-U4. Megatron's local split and 1-D chunk helpers are the primitives here. -----

// The 3×4 of U1 and U2: element (i, j) holds its flat index 4·i + j.
double flatIndex(std::int64_t i, std::int64_t j) { return double(4 * i + j); }

TEST(MappingsSpec, U1SplitAlongLastDimInTwo) {
  runRanks(2, [](RankContext& ctx) {
    const int r = ctx.comm.rank();
    Tensor x = tensorOf(ctx.compute, kF32, matrix(3, 4, flatIndex), Shape{3, 4});  // (3, 4)
    Tensor chunk = splitAlongLastDim(ctx.compute, ctx.comm, x);                    // (3, 2)
    expectTensor(ctx.compute, chunk, Shape{3, 2},
                 matrix(3, 2, [r](std::int64_t i, std::int64_t j) { return flatIndex(i, 2 * r + j); }));
  });
}

// World 8 with T = 2 (so P = 4): TP groups are rank pairs {2k, 2k+1}.
TEST(MappingsSpec, U2OneDimChunkSplitOfA3x4) {
  runRanks(8, [](RankContext& ctx) {
    const int r = ctx.comm.rank();
    std::unique_ptr<Collectives> tp = ctx.comm.split(r / 2, r, "tp");
    Tensor x = tensorOf(ctx.compute, kF32, matrix(3, 4, flatIndex), Shape{3, 4});      // (3, 4)
    Tensor chunk = splitAlongFirstDim(ctx.compute, *tp, x.view().reshape(Shape{12}));  // (6)
    const double first = r % 2 == 0 ? 0 : 6;
    expectTensor(ctx.compute, chunk, Shape{6}, {first, first + 1, first + 2, first + 3, first + 4, first + 5});
  });
}

TEST(MappingsSpec, U3OneDimChunkGatherOfOnesTimesR) {
  runRanks(8, [](RankContext& ctx) {
    const int r = ctx.comm.rank();
    std::unique_ptr<Collectives> tp = ctx.comm.split(r / 2, r, "tp");
    Tensor x = tensorOf(ctx.compute, kF32, blocks({double(r)}, 8), Shape{2, 4});     // (2, 4)
    Tensor all = gatherAlongFirstDim(ctx.compute, *tp, x.view().reshape(Shape{8}));  // (16)
    const std::vector<double> owners =
        r % 2 == 0 ? std::vector<double>{double(r), r + 1.0} : std::vector<double>{r - 1.0, double(r)};
    expectTensor(ctx.compute, all, Shape{16}, blocks(owners, 8));
  });
}

TEST(MappingsSpec, U4VocabRangesOf1600Over8) {
  for (int r = 0; r < 8; ++r) {
    const VocabRange global = vocabRangeFromGlobalVocabSize(1600, r, 8);
    const VocabRange local = vocabRangeFromPerPartitionVocabSize(200, r);
    EXPECT_EQ(global.first, 200 * r) << "rank " << r;
    EXPECT_EQ(global.last, 200 * r + 200) << "rank " << r;
    EXPECT_EQ(local.first, global.first) << "rank " << r;
    EXPECT_EQ(local.last, global.last) << "rank " << r;
  }
}

// SPEC 6 item 4: the ranges of t = 0..T-1 are disjoint and cover [0, V).
TEST(Utils, VocabRangesTileTheVocabulary) {
  for (int world : {1, 2, 3, 5, 8}) {
    const std::int64_t vocab = 120;
    std::int64_t next = 0;
    for (int r = 0; r < world; ++r) {
      const VocabRange range = vocabRangeFromGlobalVocabSize(vocab, r, world);
      EXPECT_EQ(range.first, next) << "world " << world << " rank " << r;
      next = range.last;
    }
    EXPECT_EQ(next, vocab) << "world " << world;
  }
}

TEST(Utils, DivideIsExactDivision) {
  EXPECT_EQ(divide(12, 4, "x"), 3);
  EXPECT_EQ(divide(0, 5, "x"), 0);
  EXPECT_EQ(divide(-6, 3, "x"), -2);
}

TEST(Utils, ErrorsNameTheArgument) {
  expectInvalid([] { divide(7, 2, "Layer: hidden by heads"); }, "Layer: hidden by heads: 7 is not divisible by 2");
  expectInvalid([] { divide(4, 0, "Layer: hidden by heads"); },
                "Layer: hidden by heads: the divisor must be positive, got 0");
  expectInvalid([] { vocabRangeFromGlobalVocabSize(1601, 0, 8); },
                "vocabRangeFromGlobalVocabSize: globalVocabSize by worldSize: 1601 is not divisible by 8");
  expectInvalid([] { vocabRangeFromGlobalVocabSize(1600, 8, 8); },
                "vocabRangeFromGlobalVocabSize: rank must be in [0, 8), got 8");
  expectInvalid([] { vocabRangeFromGlobalVocabSize(1600, 0, 0); },
                "vocabRangeFromGlobalVocabSize: worldSize must be positive, got 0");
  expectInvalid([] { vocabRangeFromPerPartitionVocabSize(-1, 0); },
                "vocabRangeFromPerPartitionVocabSize: perPartitionVocabSize must be >= 0, got -1");
  expectInvalid([] { vocabRangeFromPerPartitionVocabSize(10, -1); },
                "vocabRangeFromPerPartitionVocabSize: rank must be >= 0, got -1");
}

// ---- Primitives: last-dim rearrangement, uneven splits, strided inputs, n == 1. ---------------

// Rank q's (2, 3, 2) holds 1000·q + 100·a + 10·b + k; the gather puts rank q at columns [2q, 2q+2).
TEST(Primitives, GatherAlongLastDimOf3d) {
  runRanks(3, [](RankContext& ctx) {
    const int r = ctx.comm.rank();
    std::vector<double> v;
    for (int a = 0; a < 2; ++a)
      for (int b = 0; b < 3; ++b)
        for (int k = 0; k < 2; ++k) v.push_back(1000 * r + 100 * a + 10 * b + k);
    Tensor x = tensorOf(ctx.compute, kF32, v, Shape{2, 3, 2});  // (2, 3, 2)
    Tensor y = gatherAlongLastDim(ctx.compute, ctx.comm, x);    // (2, 3, 6)
    std::vector<double> want;
    for (int a = 0; a < 2; ++a)
      for (int b = 0; b < 3; ++b)
        for (int j = 0; j < 6; ++j) want.push_back(1000 * (j / 2) + 100 * a + 10 * b + j % 2);
    expectTensor(ctx.compute, y, Shape{2, 3, 6}, want);
  });
}

// Rank q's (2, 2, 6) holds q + f with f = 100·a + 10·b + j; the sum is 3 + 3·f, and rank r keeps
// columns [2r, 2r+2).
TEST(Primitives, ReduceScatterAlongLastDimOf3d) {
  runRanks(3, [](RankContext& ctx) {
    const int r = ctx.comm.rank();
    std::vector<double> v;
    for (int a = 0; a < 2; ++a)
      for (int b = 0; b < 2; ++b)
        for (int j = 0; j < 6; ++j) v.push_back(r + 100 * a + 10 * b + j);
    Tensor x = tensorOf(ctx.compute, kF32, v, Shape{2, 2, 6});       // (2, 2, 6)
    Tensor y = reduceScatterAlongLastDim(ctx.compute, ctx.comm, x);  // (2, 2, 2)
    std::vector<double> want;
    for (int a = 0; a < 2; ++a)
      for (int b = 0; b < 2; ++b)
        for (int k = 0; k < 2; ++k) want.push_back(3 + 3 * (100 * a + 10 * b + 2 * r + k));
    expectTensor(ctx.compute, y, Shape{2, 2, 2}, want);
  });
}

// Splits {2, 0, 3} over 3 ranks; rows are 2 wide.
const SplitSizes kUneven{2, 0, 3};
const std::int64_t kUnevenOffset[] = {0, 2, 2};

TEST(Primitives, UnevenGatherAlongFirstDimConcatenatesTheBlocks) {
  runRanks(3, [](RankContext& ctx) {
    const int r = ctx.comm.rank();
    Tensor x =
        tensorOf(ctx.compute, kF32,
                 matrix(kUneven[r], 2, [r](std::int64_t i, std::int64_t j) { return double(100 * r + 10 * i + j); }),
                 Shape{kUneven[r], 2});                                 // (s_r, 2)
    Tensor y = gatherAlongFirstDim(ctx.compute, ctx.comm, x, kUneven);  // (5, 2)
    expectTensor(ctx.compute, y, Shape{5, 2}, {0, 1, 10, 11, 200, 201, 210, 211, 220, 221});
  });
}

// Rank q's (5, 2) holds q + 10·i + j; the sum is 3 + 3·(10·i + j) and rank r keeps its rows.
TEST(Primitives, UnevenReduceScatterAlongFirstDimKeepsTheOwnBlockOfTheSum) {
  runRanks(3, [](RankContext& ctx) {
    const int r = ctx.comm.rank();
    Tensor x = tensorOf(ctx.compute, kF32,
                        matrix(5, 2, [r](std::int64_t i, std::int64_t j) { return double(r + 10 * i + j); }),
                        Shape{5, 2});                                          // (5, 2)
    Tensor y = reduceScatterAlongFirstDim(ctx.compute, ctx.comm, x, kUneven);  // (s_r, 2)
    const std::int64_t first = kUnevenOffset[r];
    expectTensor(ctx.compute, y, Shape{kUneven[r], 2}, matrix(kUneven[r], 2, [first](std::int64_t i, std::int64_t j) {
                   return 3.0 + 3 * (10 * (first + i) + j);
                 }));
  });
}

// Inputs that are transposed views go through a contiguous copy; reduce writes the sum back
// through the caller's strides.
TEST(Primitives, StridedInputs) {
  runRanks(2, [](RankContext& ctx) {
    Compute& compute = ctx.compute;
    const int r = ctx.comm.rank();
    // base(i, j) = 10·r + 3·i + j on rank r; the two ranks sum to 10 + 2·(3·i + j).
    Tensor base = tensorOf(compute, kF32,
                           matrix(2, 3, [r](std::int64_t i, std::int64_t j) { return double(10 * r + 3 * i + j); }),
                           Shape{2, 3});  // (2, 3)
    const View baseT = base.view().t();   // (3, 2), strides (1, 3)
    ASSERT_FALSE(baseT.isContiguous());

    Tensor gathered = gatherAlongLastDim(compute, ctx.comm, baseT);  // (3, 4): column 2q + i = base_q(i, ·)
    expectTensor(compute, gathered, Shape{3, 4},
                 matrix(3, 4, [](std::int64_t j, std::int64_t c) { return double(10 * (c / 2) + 3 * (c % 2) + j); }),
                 "gatherAlongLastDim");

    // (1, 2): row r of Σ_q baseT_q
    Tensor scattered = reduceScatterAlongFirstDim(compute, ctx.comm, baseT.slice(0, 0, 2));
    expectTensor(compute, scattered, Shape{1, 2}, {10.0 + 2 * r, 10.0 + 2 * (3 + r)}, "reduceScatterAlongFirstDim");

    Tensor unevenGathered = gatherAlongFirstDim(compute, ctx.comm, baseT.slice(0, 0, 2 - r), {2, 1});  // (3, 2)
    expectTensor(compute, unevenGathered, Shape{3, 2}, {0, 3, 1, 4, 10, 13}, "uneven gatherAlongFirstDim");

    reduce(compute, ctx.comm, baseT);
    expectTensor(compute, base, Shape{2, 3},
                 matrix(2, 3, [](std::int64_t i, std::int64_t j) { return 10.0 + 2 * (3 * i + j); }), "reduce");
  });
}

TEST(Primitives, KeepTheInputDtype) {
  runRanks(2, [](RankContext& ctx) {
    Tensor x = tensorOf(ctx.compute, DType::kBFloat16, {1, 2, 3, 4}, Shape{2, 2});  // (2, 2)
    EXPECT_EQ(gatherAlongLastDim(ctx.compute, ctx.comm, x).dtype(), DType::kBFloat16);
    EXPECT_EQ(reduceScatterAlongLastDim(ctx.compute, ctx.comm, x).dtype(), DType::kBFloat16);
    EXPECT_EQ(gatherAlongFirstDim(ctx.compute, ctx.comm, x, {2, 2}).dtype(), DType::kBFloat16);
    EXPECT_EQ(reduceScatterAlongFirstDim(ctx.compute, ctx.comm, x, {1, 1}).dtype(), DType::kBFloat16);
  });
}

// n == 1: every primitive returns its input's values in new storage and issues no collective.
TEST(Primitives, SizeOneGroupReturnsACopyWithoutCommunicating) {
  WorldOptions options;
  options.size = 1;
  options.trace = true;
  sim::World world(options);
  world.run([](RankContext& ctx) {
    Compute& compute = ctx.compute;
    const std::vector<double> values = matrix(2, 4, flatIndex);
    Tensor x = tensorOf(compute, kF32, values, Shape{2, 4});  // (2, 4)
    const std::vector<std::pair<const char*, std::function<Tensor()>>> calls = {
        {"splitAlongLastDim", [&] { return splitAlongLastDim(compute, ctx.comm, x); }},
        {"splitAlongFirstDim", [&] { return splitAlongFirstDim(compute, ctx.comm, x); }},
        {"gatherAlongLastDim", [&] { return gatherAlongLastDim(compute, ctx.comm, x); }},
        {"gatherAlongFirstDim", [&] { return gatherAlongFirstDim(compute, ctx.comm, x); }},
        {"uneven gatherAlongFirstDim", [&] { return gatherAlongFirstDim(compute, ctx.comm, x, {2}); }},
        {"reduceScatterAlongFirstDim", [&] { return reduceScatterAlongFirstDim(compute, ctx.comm, x); }},
        {"uneven reduceScatterAlongFirstDim", [&] { return reduceScatterAlongFirstDim(compute, ctx.comm, x, {2}); }},
        {"reduceScatterAlongLastDim", [&] { return reduceScatterAlongLastDim(compute, ctx.comm, x); }},
    };
    for (const auto& [name, call] : calls) {
      Tensor y = call();  // (2, 4)
      EXPECT_NE(y.data(), x.data()) << name;
      expectTensor(compute, y, Shape{2, 4}, values, name);
    }
    reduce(compute, ctx.comm, x);
    expectTensor(compute, x, Shape{2, 4}, values, "reduce");
  });
  EXPECT_TRUE(world.trace()[0].empty()) << world.trace()[0].size() << " collectives issued, first "
                                        << (world.trace()[0].empty() ? "" : world.trace()[0][0].op);
}

// ---- Errors: every rank makes the same mistake, so each throws before any collective. ----------

TEST(Primitives, ErrorsNameTheArgumentAndTheGroup) {
  runRanks(2, [](RankContext& ctx) {
    Compute& compute = ctx.compute;
    Collectives& group = ctx.comm;
    const int r = group.rank();
    Tensor x33 = compute.zeros(Shape{3, 3}, kF32);  // (3, 3)
    Tensor x32 = compute.zeros(Shape{3, 2}, kF32);  // (3, 2)
    Tensor scalar = compute.zeros(Shape{}, kF32);   // ()
    const std::string lastDim = "the last dim of x must be divisible by the size 2 of group 'world', got x (3, 3)";
    const std::string firstDim = "dim 0 of x must be divisible by the size 2 of group 'world', got x (3, 2)";
    expectInvalid([&] { splitAlongLastDim(compute, group, x33); }, "splitAlongLastDim: " + lastDim);
    expectInvalid([&] { reduceScatterAlongLastDim(compute, group, x33); }, "reduceScatterAlongLastDim: " + lastDim);
    expectInvalid([&] { splitAlongFirstDim(compute, group, x32); }, "splitAlongFirstDim: " + firstDim);
    expectInvalid([&] { reduceScatterAlongFirstDim(compute, group, x32); }, "reduceScatterAlongFirstDim: " + firstDim);
    // The mappings report the primitive they run.
    expectInvalid([&] { scatterToTpRegionForward(compute, group, x33); }, "splitAlongLastDim: " + lastDim);
    expectInvalid([&] { reduceScatterToSpRegionForward(compute, group, x32); },
                  "reduceScatterAlongFirstDim: " + firstDim);
    expectInvalid([&] { gatherAlongLastDim(compute, group, scalar); },
                  "gatherAlongLastDim: x must have at least one dim, got a scalar");

    expectInvalid([&] { gatherAlongFirstDim(compute, group, x32, {3}); },
                  "gatherAlongFirstDim: outputSplitSizes must have one entry per rank of group 'world' (2), got 1");
    expectInvalid(
        [&] {
          gatherAlongFirstDim(compute, group, x32, {-1, 4});
        },
        "gatherAlongFirstDim: outputSplitSizes[0] must be >= 0, got -1");
    expectInvalid(
        [&] {
          gatherAlongFirstDim(compute, group, x32, {1, 2});
        },
        "gatherAlongFirstDim: dim 0 of x must be outputSplitSizes[" + std::to_string(r) +
            "] = " + std::to_string(r + 1) + " on rank " + std::to_string(r) + ", got x (3, 2)");
    expectInvalid(
        [&] {
          reduceScatterAlongFirstDim(compute, group, x32, {1, 1});
        },
        "reduceScatterAlongFirstDim: dim 0 of x must be the sum 2 of inputSplitSizes, got x (3, 2)");
    expectInvalid(
        [&] {
          reduceScatterToSpRegionBackward(compute, group, x32, {1, 1, 1});
        },
        "gatherAlongFirstDim: outputSplitSizes must have one entry per rank of group 'world' (2), got 3");

    Tensor dy = compute.zeros(Shape{4, 2}, kF32);  // (4, 2)
    expectInvalid(
        [&] {
          gatherFromSpRegionBackward(compute, group, dy, /*tensorParallelOutputGrad=*/false, {2, 2});
        },
        "gatherFromSpRegionBackward: outputSplitSizes must be empty when tensorParallelOutputGrad is false, "
        "got 2 sizes");
  });
}

// The duplicated-consumer backward of gather_from_SP keeps the rank's rows of the full dY.
TEST(Mappings, GatherFromSpBackwardWithoutTpOutputGradSplits) {
  runRanks(2, [](RankContext& ctx) {
    const int r = ctx.comm.rank();
    Tensor dy =
        tensorOf(ctx.compute, kF32, matrix(4, 2, [](std::int64_t i, std::int64_t j) { return double(2 * i + j); }),
                 Shape{4, 2});                                                                              // (4, 2)
    Tensor dx = gatherFromSpRegionBackward(ctx.compute, ctx.comm, dy, /*tensorParallelOutputGrad=*/false);  // (2, 2)
    expectTensor(ctx.compute, dx, Shape{2, 2}, {4.0 * r, 4.0 * r + 1, 4.0 * r + 2, 4.0 * r + 3});
  });
}

// ---- Adjointness (SPEC 6 item 3): ⟨f(x), y⟩ = ⟨x, f*(y)⟩. A replicated side (the same value on
// every rank) is counted once; a per-rank side is summed over ranks. ----------------------------

enum class Held { kPerRank, kReplicated };

// Uneven dim-0 blocks for n ranks: (2q + 1) mod 3 = 1, 0, 2, 1, ... (a zero block from n = 2 on).
SplitSizes unevenSizes(int n) {
  SplitSizes s;
  for (int q = 0; q < n; ++q) s.push_back((2 * q + 1) % 3);
  return s;
}
std::int64_t unevenTotal(int n) {
  std::int64_t total = 0;
  for (std::int64_t s : unevenSizes(n)) total += s;
  return total;
}

Tensor copyOf(Compute& compute, ConstView x) {
  Tensor out = compute.empty(x.shape(), x.dtype());  // shape of x
  compute.copy(x, out);
  return out;
}

// Runs an in-place mapping half (the all-reduce pair) on a copy, so it fits the table below.
template <void (*kInPlace)(Compute&, Collectives&, View)>
Tensor onCopy(Compute& compute, Collectives& group, ConstView x, int) {
  Tensor y = copyOf(compute, x);  // shape of x
  kInPlace(compute, group, y);
  return y;
}

struct AdjointCase {
  const char* name;
  Held input;
  Held output;
  Shape (*inShape)(int n, int r);   // x on rank r of n
  Shape (*outShape)(int n, int r);  // f(x), and y
  Tensor (*forward)(Compute&, Collectives&, ConstView x, int n);
  Tensor (*backward)(Compute&, Collectives&, ConstView dy, int n);
};

const std::vector<AdjointCase>& adjointCases() {
  using C = Compute&;
  using G = Collectives&;
  static const std::vector<AdjointCase> cases = {
      {"CopyToTp", Held::kReplicated, Held::kPerRank, [](int, int) -> Shape { return {2, 3}; },
       [](int, int) -> Shape { return {2, 3}; },
       onCopy<copyToTpRegionForward>, onCopy<copyToTpRegionBackward>},
      {"ReduceFromTp", Held::kPerRank, Held::kReplicated, [](int, int) -> Shape { return {2, 3}; },
       [](int, int) -> Shape { return {2, 3}; },
       onCopy<reduceFromTpRegionForward>, onCopy<reduceFromTpRegionBackward>},
      {"ScatterToTp", Held::kReplicated, Held::kPerRank, [](int n, int) -> Shape { return {3, 2 * n}; },
       [](int, int) -> Shape { return {3, 2}; },
       [](C c, G g, ConstView x, int) { return scatterToTpRegionForward(c, g, x); },
       [](C c, G g, ConstView dy, int) { return scatterToTpRegionBackward(c, g, dy); }},
      {"GatherFromTp", Held::kPerRank, Held::kReplicated, [](int, int) -> Shape { return {3, 2}; },
       [](int n, int) -> Shape { return {3, 2 * n}; },
       [](C c, G g, ConstView x, int) { return gatherFromTpRegionForward(c, g, x); },
       [](C c, G g, ConstView dy, int) { return gatherFromTpRegionBackward(c, g, dy); }},
      {"ScatterToSp", Held::kReplicated, Held::kPerRank, [](int n, int) -> Shape { return {2 * n, 3}; },
       [](int, int) -> Shape { return {2, 3}; },
       [](C c, G g, ConstView x, int) { return scatterToSpRegionForward(c, g, x); },
       [](C c, G g, ConstView dy, int) { return scatterToSpRegionBackward(c, g, dy); }},
      {"GatherFromSpDuplicatedConsumer", Held::kPerRank, Held::kReplicated, [](int, int) -> Shape { return {2, 3}; },
       [](int n, int) -> Shape { return {2 * n, 3}; },
       [](C c, G g, ConstView x, int) { return gatherFromSpRegionForward(c, g, x); },
       [](C c, G g, ConstView dy, int) { return gatherFromSpRegionBackward(c, g, dy, false); }},
      {"GatherFromSpTpOutputGrad", Held::kPerRank, Held::kPerRank, [](int, int) -> Shape { return {2, 3}; },
       [](int n, int) -> Shape { return {2 * n, 3}; },
       [](C c, G g, ConstView x, int) { return gatherFromSpRegionForward(c, g, x); },
       [](C c, G g, ConstView dy, int) { return gatherFromSpRegionBackward(c, g, dy, true); }},
      {"GatherFromSpTpOutputGradUneven", Held::kPerRank, Held::kPerRank,
       [](int n, int r) -> Shape { return {unevenSizes(n)[r], 3}; },
       [](int n, int) -> Shape { return {unevenTotal(n), 3}; },
       [](C c, G g, ConstView x, int n) { return gatherFromSpRegionForward(c, g, x, unevenSizes(n)); },
       [](C c, G g, ConstView dy, int n) { return gatherFromSpRegionBackward(c, g, dy, true, unevenSizes(n)); }},
      {"ReduceScatterToSp", Held::kPerRank, Held::kPerRank, [](int n, int) -> Shape { return {2 * n, 3}; },
       [](int, int) -> Shape { return {2, 3}; },
       [](C c, G g, ConstView x, int) { return reduceScatterToSpRegionForward(c, g, x); },
       [](C c, G g, ConstView dy, int) { return reduceScatterToSpRegionBackward(c, g, dy); }},
      {"ReduceScatterToSpUneven", Held::kPerRank, Held::kPerRank,
       [](int n, int) -> Shape { return {unevenTotal(n), 3}; },
       [](int n, int r) -> Shape { return {unevenSizes(n)[r], 3}; },
       [](C c, G g, ConstView x, int n) { return reduceScatterToSpRegionForward(c, g, x, unevenSizes(n)); },
       [](C c, G g, ConstView dy, int n) { return reduceScatterToSpRegionBackward(c, g, dy, unevenSizes(n)); }},
      {"AllGatherLastDimFromTp", Held::kPerRank, Held::kPerRank, [](int, int) -> Shape { return {2, 3, 2}; },
       [](int n, int) -> Shape { return {2, 3, 2 * n}; },
       [](C c, G g, ConstView x, int) { return allGatherLastDimFromTpRegionForward(c, g, x); },
       [](C c, G g, ConstView dy, int) { return allGatherLastDimFromTpRegionBackward(c, g, dy); }},
      {"ReduceScatterLastDimToTp", Held::kPerRank, Held::kPerRank, [](int n, int) -> Shape { return {2, 3, 2 * n}; },
       [](int, int) -> Shape { return {2, 3, 2}; },
       [](C c, G g, ConstView x, int) { return reduceScatterLastDimToTpRegionForward(c, g, x); },
       [](C c, G g, ConstView dy, int) { return reduceScatterLastDimToTpRegionBackward(c, g, dy); }},
  };
  return cases;
}

// Small integers in [-6, 6] that differ by rank (a replicated side uses rank 0's for everyone).
std::vector<double> xData(int r, std::int64_t count) {
  std::vector<double> v;
  for (std::int64_t i = 0; i < count; ++i) v.push_back(double((7 * r + 3 * i + 1) % 11 - 5));
  return v;
}
std::vector<double> yData(int r, std::int64_t count) {
  std::vector<double> v;
  for (std::int64_t i = 0; i < count; ++i) v.push_back(double((5 * r + 7 * i + 3) % 13 - 6));
  return v;
}

double dot(Compute& compute, ConstView a, ConstView b) {
  const std::vector<double> u = valuesOf(compute, a), v = valuesOf(compute, b);
  double sum = 0;
  for (std::size_t i = 0; i < u.size(); ++i) sum += u[i] * v[i];
  return sum;
}

class AdjointTest : public ::testing::TestWithParam<std::tuple<std::size_t, int>> {};

TEST_P(AdjointTest, BackwardIsTheAdjointOfForward) {
  const AdjointCase& c = adjointCases()[std::get<0>(GetParam())];
  const int n = std::get<1>(GetParam());
  std::vector<double> lhs(std::size_t(n), 0.0), rhs(std::size_t(n), 0.0);  // per rank
  runRanks(n, [&](RankContext& ctx) {
    Compute& compute = ctx.compute;
    const int r = ctx.comm.rank();
    const Shape xShape = c.inShape(n, r), yShape = c.outShape(n, r);
    Tensor x = tensorOf(compute, kF32, xData(c.input == Held::kReplicated ? 0 : r, xShape.numel()), xShape);
    Tensor y = tensorOf(compute, kF32, yData(c.output == Held::kReplicated ? 0 : r, yShape.numel()), yShape);
    Tensor fx = c.forward(compute, ctx.comm, x, n);    // f(x), shaped like y
    Tensor fty = c.backward(compute, ctx.comm, y, n);  // f*(y), shaped like x
    ASSERT_EQ(fx.shape(), yShape);
    ASSERT_EQ(fty.shape(), xShape);
    lhs[std::size_t(r)] = c.output == Held::kReplicated && r != 0 ? 0.0 : dot(compute, fx, y);
    rhs[std::size_t(r)] = c.input == Held::kReplicated && r != 0 ? 0.0 : dot(compute, x, fty);
  });
  double left = 0, right = 0;
  for (int r = 0; r < n; ++r) {
    left += lhs[std::size_t(r)];
    right += rhs[std::size_t(r)];
  }
  EXPECT_EQ(left, right) << c.name << " on " << n << " ranks";
  EXPECT_NE(left, 0.0) << "vacuous data for " << c.name << " on " << n << " ranks";
}

INSTANTIATE_TEST_SUITE_P(Mappings, AdjointTest,
                         ::testing::Combine(::testing::Range(std::size_t(0), adjointCases().size()),
                                            ::testing::Values(1, 2, 3, 4)),
                         [](const auto& info) {
                           return std::string(adjointCases()[std::get<0>(info.param)].name) + "_n" +
                                  std::to_string(std::get<1>(info.param));
                         });

}  // namespace
}  // namespace tpsim
