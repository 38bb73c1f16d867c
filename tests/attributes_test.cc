// Tests for core/attributes.h: the SPEC 3.2 defaults table, the one-shot tagging of 3.7, the copies
// of 3.4 and 3.9 (A2, A3, idempotence, SPEC 6 item 19), the duplicate filters of 3.3 (A1 and the
// full truth table) and 3.5, and the pad count of 3.6 (A4, P1, the spill case, SPEC 6 item 9).
#include "core/attributes.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backends/errors.h"
#include "tests/sim_test_util.h"

namespace tpsim {
namespace {

using Shapes = std::optional<std::vector<std::int64_t>>;

// Every attribute present, none at its 3.2 default.
ParamAttributes fullyTagged() {
  ParamAttributes a;
  a.expertTp = true;
  a.isQkv = true;
  a.qkvSplitShapes = Shapes(std::vector<std::int64_t>{256, 64, 64});
  a.tensorModelParallel = true;
  a.partitionDim = 1;
  a.partitionStride = 3;
  return a;
}

TEST(ModelParallelAttributeDefaults, TableMatchesSpec) {
  std::vector<std::string> names;
  forEachModelParallelAttribute([&](const auto& row) { names.push_back(row.name); });
  EXPECT_EQ(names, (std::vector<std::string>{"expert_tp", "is_qkv", "qkv_split_shapes", "tensor_model_parallel",
                                             "partition_dim", "partition_stride"}));
  ParamAttributes a;
  setDefaultsIfNotSetTensorModelParallelAttributes(a);
  EXPECT_EQ(a.expertTp, false);
  EXPECT_EQ(a.isQkv, false);
  ASSERT_TRUE(a.qkvSplitShapes.has_value());  // present, holding None
  EXPECT_FALSE(a.qkvSplitShapes->has_value());
  EXPECT_EQ(a.tensorModelParallel, false);
  EXPECT_EQ(a.partitionDim, -1);
  EXPECT_EQ(a.partitionStride, 1);
  EXPECT_FALSE(a.allreduce.has_value());  // only the six are touched
  EXPECT_FALSE(a.isGtpWeightRemat.has_value());
}

TEST(SetDefaults, LeavesPresentAttributesAlone) {
  ParamAttributes a;
  a.partitionDim = 0;
  a.isQkv = true;
  setDefaultsIfNotSetTensorModelParallelAttributes(a);
  EXPECT_EQ(a.partitionDim, 0);
  EXPECT_EQ(a.isQkv, true);
  EXPECT_EQ(a.partitionStride, 1);
}

TEST(SetTensorModelParallelAttributes, SetsThreeAndLeavesThreeAbsent) {
  ParamAttributes a;
  setTensorModelParallelAttributes(a, true, 1, 2);
  EXPECT_EQ(a.tensorModelParallel, true);
  EXPECT_EQ(a.partitionDim, 1);
  EXPECT_EQ(a.partitionStride, 2);
  EXPECT_FALSE(a.expertTp.has_value());
  EXPECT_FALSE(a.isQkv.has_value());
  EXPECT_FALSE(a.qkvSplitShapes.has_value());
}

// SPEC 3.7 / 8 item 5: any of the six present is an error, even the three it does not write.
TEST(SetTensorModelParallelAttributes, IsOneShot) {
  ParamAttributes twice;
  setTensorModelParallelAttributes(twice, true, 0, 1);
  EXPECT_THROW(setTensorModelParallelAttributes(twice, false, 1, 1), InvalidArgument);
  EXPECT_EQ(twice.partitionDim, 0);  // unchanged by the failed call

  ParamAttributes defaulted;
  setDefaultsIfNotSetTensorModelParallelAttributes(defaulted);
  EXPECT_THROW(setTensorModelParallelAttributes(defaulted, true, 0, 1), InvalidArgument);

  ParamAttributes qkv;
  qkv.isQkv = true;
  try {
    setTensorModelParallelAttributes(qkv, true, 0, 1);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'is_qkv'"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(qkv.tensorModelParallel.has_value());
}

// A2: is_qkv and qkv_split_shapes arrive unchanged; absent names are neither copied nor cleared.
TEST(CopyTensorModelParallelAttributes, CopiesPresentOnly) {
  ParamAttributes src;
  src.isQkv = true;
  src.qkvSplitShapes = Shapes(std::vector<std::int64_t>{256, 64, 64});
  ParamAttributes dst;
  dst.partitionDim = 1;
  dst.allreduce = false;
  copyTensorModelParallelAttributes(dst, src);
  EXPECT_EQ(dst.isQkv, true);
  ASSERT_TRUE(dst.qkvSplitShapes.has_value() && dst.qkvSplitShapes->has_value());
  EXPECT_EQ(**dst.qkvSplitShapes, (std::vector<std::int64_t>{256, 64, 64}));
  EXPECT_EQ(dst.partitionDim, 1);
  EXPECT_EQ(dst.allreduce, false);
  EXPECT_FALSE(dst.tensorModelParallel.has_value());

  // All six, overwriting, and a present-with-None value is copied as such.
  ParamAttributes all = fullyTagged();
  all.qkvSplitShapes = Shapes();
  ParamAttributes over;
  setDefaultsIfNotSetTensorModelParallelAttributes(over);
  over.qkvSplitShapes = Shapes(std::vector<std::int64_t>{1});
  copyTensorModelParallelAttributes(over, all);
  EXPECT_EQ(over.expertTp, true);
  EXPECT_EQ(over.partitionDim, 1);
  EXPECT_EQ(over.partitionStride, 3);
  ASSERT_TRUE(over.qkvSplitShapes.has_value());
  EXPECT_FALSE(over.qkvSplitShapes->has_value());
}

// A3.
TEST(CopyGtpAttributes, CopiesTheTestedThree) {
  ParamAttributes src;
  src.isGtpWeightRemat = true;
  src.allreduce = false;
  src.padLength = 3;
  ParamAttributes dst;
  dst.partitionDim = 0;
  dst.group = nullptr;
  copyGtpAttributes(dst, src);
  EXPECT_EQ(dst.isGtpWeightRemat, true);
  EXPECT_EQ(dst.allreduce, false);
  EXPECT_EQ(dst.padLength, 3);
  EXPECT_EQ(dst.partitionDim, 0);     // not a GTP name
  EXPECT_TRUE(dst.group.has_value());  // absent on source: left as it was
  EXPECT_FALSE(dst.gtpReplicaGroup.has_value());
}

// SPEC 6 item 19: applying either copy twice equals applying it once; neither deletes.
TEST(AttributeCopies, AreIdempotentAndNeverDelete) {
  auto withGtp = [](ParamAttributes a) {
    a.isGtpWeightRemat = true;
    a.allreduce = true;
    a.padLength = 5;
    return a;
  };
  ParamAttributes src = withGtp(fullyTagged());
  ParamAttributes partial;
  partial.isQkv = false;
  partial.padLength = 1;
  for (const ParamAttributes* source : {&src, &partial}) {
    ParamAttributes once;
    once.sequenceParallel = true;
    once.gtpPadZeros = 7;
    copyTensorModelParallelAttributes(once, *source);
    copyGtpAttributes(once, *source);
    ParamAttributes twice = once;
    copyTensorModelParallelAttributes(twice, *source);
    copyGtpAttributes(twice, *source);
    EXPECT_EQ(twice.isQkv, once.isQkv);
    EXPECT_EQ(twice.qkvSplitShapes, once.qkvSplitShapes);
    EXPECT_EQ(twice.partitionStride, once.partitionStride);
    EXPECT_EQ(twice.padLength, once.padLength);
    EXPECT_EQ(twice.allreduce, once.allreduce);
    EXPECT_EQ(once.sequenceParallel, true);
    EXPECT_EQ(once.gtpPadZeros, 7);
  }
}

// A1 and the whole SPEC 3.3 table. Two ranks: rank r has TP rank r and expert-TP rank 1 − r, so
// rank 0 is the table's (0, 1) row and rank 1 its (1, 0) row.
TEST(ParamIsNotTensorParallelDuplicate, TruthTable) {
  struct Seen {
    bool allreduceTrue, allreduceFalse, absent, absentNoExpert, falseNoExpert, sharded, shardedNoGroups,
        expertOnly;
  };
  std::vector<Seen> seen(2);
  testing::runRanks(2, [&](RankContext& ctx) {
    const int r = ctx.comm.rank();
    std::unique_ptr<Collectives> tp = ctx.comm.split(0, r, "tp");
    std::unique_ptr<Collectives> etp = ctx.comm.split(0, 1 - r, "etp");
    Parameter p;
    p.name = "bias";
    Seen& s = seen[r];
    p.attrs.allreduce = true;
    s.allreduceTrue = paramIsNotTensorParallelDuplicate(p, tp.get(), etp.get());
    p.attrs.allreduce = false;
    s.allreduceFalse = paramIsNotTensorParallelDuplicate(p, tp.get(), etp.get());
    s.falseNoExpert = paramIsNotTensorParallelDuplicate(p, tp.get(), nullptr);  // falls back to tp
    s.expertOnly = paramIsNotTensorParallelDuplicate(p, nullptr, etp.get());    // tp not needed
    p.attrs.allreduce.reset();
    s.absent = paramIsNotTensorParallelDuplicate(p, tp.get(), etp.get());
    s.absentNoExpert = paramIsNotTensorParallelDuplicate(p, tp.get());
    p.attrs.tensorModelParallel = true;
    s.sharded = paramIsNotTensorParallelDuplicate(p, tp.get(), etp.get());
    s.shardedNoGroups = paramIsNotTensorParallelDuplicate(p, nullptr);
  });
  // allreduce | TP rank | expert-TP rank | result
  EXPECT_TRUE(seen[0].allreduceTrue);    // True | 0 | 1 | True   [S]
  EXPECT_FALSE(seen[1].allreduceTrue);   // True | 1 | 0 | False  [S]
  EXPECT_FALSE(seen[0].allreduceFalse);  // False | 0 | 1 | False [S]
  EXPECT_TRUE(seen[1].allreduceFalse);   // False | 1 | 0 | True  [T]
  EXPECT_FALSE(seen[1].absentNoExpert);  // absent | 1 | not passed | False [T]
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(seen[r].absent, r == 0) << "rank " << r;
    EXPECT_EQ(seen[r].falseNoExpert, r == 0) << "rank " << r;
    EXPECT_EQ(seen[r].expertOnly, r == 1) << "rank " << r;
    EXPECT_TRUE(seen[r].sharded) << "rank " << r;
    EXPECT_TRUE(seen[r].shardedNoGroups) << "rank " << r;
  }
}

// Megatron's global-TP fallback has no counterpart: a needed but missing tpGroup is an error.
TEST(ParamIsNotTensorParallelDuplicate, MissingTpGroupThrows) {
  Parameter p;
  p.name = "layernorm.weight";
  EXPECT_THROW(paramIsNotTensorParallelDuplicate(p, nullptr), InvalidArgument);
  p.attrs.allreduce = false;  // expert param, but no expert group either
  EXPECT_THROW(paramIsNotTensorParallelDuplicate(p, nullptr, nullptr), InvalidArgument);
  p.attrs.tensorModelParallel = false;
  EXPECT_THROW(paramIsNotTensorParallelDuplicate(p, nullptr), InvalidArgument);
}

// SPEC 3.5 with the module's groups passed explicitly. Rank r has GTP rank r and EGTP rank 1 − r.
TEST(ParamIsNotGtpDuplicate, UsesThePassedGroups) {
  struct Seen {
    bool shard, replicated, expert, noGroups, expertNoEgtp;
  };
  std::vector<Seen> seen(2);
  testing::runRanks(2, [&](RankContext& ctx) {
    const int r = ctx.comm.rank();
    std::unique_ptr<Collectives> gtp = ctx.comm.split(0, r, "gtp");
    std::unique_ptr<Collectives> egtp = ctx.comm.split(0, 1 - r, "egtp");
    Parameter p;
    Seen& s = seen[r];
    s.replicated = paramIsNotGtpDuplicate(p, gtp.get(), egtp.get());
    s.noGroups = paramIsNotGtpDuplicate(p, nullptr, nullptr);
    p.attrs.allreduce = false;
    s.expert = paramIsNotGtpDuplicate(p, gtp.get(), egtp.get());
    s.expertNoEgtp = paramIsNotGtpDuplicate(p, gtp.get(), nullptr);  // EGTP off: rank 0
    p.attrs.isGtpWeightRemat = true;
    s.shard = paramIsNotGtpDuplicate(p, gtp.get(), egtp.get());
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(seen[r].shard) << "rank " << r;
    EXPECT_EQ(seen[r].replicated, r == 0) << "rank " << r;
    EXPECT_EQ(seen[r].expert, r == 1) << "rank " << r;
    EXPECT_TRUE(seen[r].noGroups) << "rank " << r;
    EXPECT_TRUE(seen[r].expertNoEgtp) << "rank " << r;
  }
}

// A GTP shard of `shape` on `group` with `padLength`.
Parameter gtpShard(Compute& compute, Shape shape, Collectives* group, std::optional<int> padLength) {
  Parameter p;
  p.name = "shard";
  p.data = compute.zeros(shape, DType::kFloat32);
  p.attrs.isGtpWeightRemat = true;
  if (group) p.attrs.group = group;
  p.attrs.padLength = padLength;
  return p;
}

// P1: the SPEC 3.6 table (shard 8×4, G = 4), and A4: the copy counts what the source counts.
TEST(GtpLocalPadZeroCount, SpecTableAndCopyParity) {
  std::vector<std::vector<std::int64_t>> counts(4);
  std::vector<std::int64_t> copyCount(4, -1), noGroupCount(4, -1);
  testing::runRanks(4, [&](RankContext& ctx) {
    const int r = ctx.comm.rank();
    Parameter none = gtpShard(ctx.compute, {8, 4}, &ctx.comm, 0);
    Parameter pad3 = gtpShard(ctx.compute, {8, 4}, &ctx.comm, 3);
    counts[r] = {gtpLocalPadZeroCount(none, 0, 32), gtpLocalPadZeroCount(pad3, 0, 32),
                 gtpLocalPadZeroCount(pad3, 0, 20), gtpLocalPadZeroCount(pad3, 18, 32),
                 gtpLocalPadZeroCount(pad3, 21, 31)};
    Parameter copy;
    copy.data = ctx.compute.zeros({8, 4}, DType::kFloat32);  // e.g. an fp32 optimizer master
    copyGtpAttributes(copy.attrs, pad3.attrs);
    copyCount[r] = gtpLocalPadZeroCount(copy, 0, 32);
    noGroupCount[r] = gtpLocalPadZeroCount(gtpShard(ctx.compute, {8, 4}, nullptr, 3), 0, 32);
  });
  EXPECT_EQ(counts[3], (std::vector<std::int64_t>{0, 12, 0, 12, 10}));
  EXPECT_EQ(counts[0][1], 0);  // padding fits in the tail shard
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(copyCount[r], r == 3 ? 12 : 0) << "rank " << r;
    EXPECT_EQ(noGroupCount[r], 0) << "rank " << r;
  }
}

// Spill: shard 16×8, p = 63, G = 4 (Dlog = 1): per-rank totals [120, 128, 128, 128].
TEST(GtpLocalPadZeroCount, SpillCase) {
  std::vector<std::int64_t> totals(4, -1);
  testing::runRanks(4, [&](RankContext& ctx) {
    totals[ctx.comm.rank()] = gtpLocalPadZeroCount(gtpShard(ctx.compute, {16, 8}, &ctx.comm, 63), 0, 128);
  });
  EXPECT_EQ(totals, (std::vector<std::int64_t>{120, 128, 128, 128}));
}

// Recommended edge cases: clamping, empty and inverted ranges, zero rows; and bad input.
TEST(GtpLocalPadZeroCount, EdgeCases) {
  std::vector<std::vector<std::int64_t>> seen(4);
  testing::runRanks(4, [&](RankContext& ctx) {
    Parameter pad3 = gtpShard(ctx.compute, {8, 4}, &ctx.comm, 3);
    Parameter empty = gtpShard(ctx.compute, {0, 4}, &ctx.comm, 3);
    Parameter flat = gtpShard(ctx.compute, {8}, &ctx.comm, 3);  // 1-D: one element per row
    seen[ctx.comm.rank()] = {gtpLocalPadZeroCount(pad3, -100, 100), gtpLocalPadZeroCount(pad3, 25, 25),
                             gtpLocalPadZeroCount(pad3, 31, 21), gtpLocalPadZeroCount(pad3, 40, 50),
                             gtpLocalPadZeroCount(empty, 0, 32), gtpLocalPadZeroCount(flat, 0, 8)};
    Parameter negative = gtpShard(ctx.compute, {8, 4}, &ctx.comm, -1);
    EXPECT_THROW(gtpLocalPadZeroCount(negative, 0, 32), InvalidArgument);
    Parameter unallocated;
    unallocated.attrs.padLength = 3;
    unallocated.attrs.group = &ctx.comm;
    EXPECT_THROW(gtpLocalPadZeroCount(unallocated, 0, 32), InvalidArgument);
  });
  EXPECT_EQ(seen[3], (std::vector<std::int64_t>{12, 0, 0, 0, 0, 3}));
  EXPECT_EQ(seen[0], (std::vector<std::int64_t>{0, 0, 0, 0, 0, 0}));
}

// SPEC 6 item 9 over a sweep of (Dlog, G, a, R): the per-rank counts sum to padLength·R, each is
// at most S·R, and the count is additive over fragments.
TEST(GtpLocalPadZeroCount, ConservationAndAdditivity) {
  for (int g : {1, 2, 3, 4}) {
    for (std::int64_t dlog : {1, 7, 8, 48, 63, 120}) {
      for (std::int64_t a : {1, 4, 16}) {
        const std::int64_t align = a * g;
        const std::int64_t pad = (align - dlog % align) % align;
        const std::int64_t s = (dlog + pad) / g;
        const std::int64_t row = 3;
        std::vector<std::int64_t> total(std::size_t(g), -1);
        testing::runRanks(g, [&](RankContext& ctx) {
          Parameter shard = gtpShard(ctx.compute, {s, row}, &ctx.comm, int(pad));
          const std::int64_t n = s * row;
          const std::int64_t whole = gtpLocalPadZeroCount(shard, 0, n);
          total[std::size_t(ctx.comm.rank())] = whole;
          EXPECT_LE(whole, n);
          for (std::int64_t u = 0; u <= n; u += 2)
            for (std::int64_t v = u; v <= n; v += 3) {
              const std::int64_t part = gtpLocalPadZeroCount(shard, u, v);
              EXPECT_LE(part, v - u);
              EXPECT_EQ(part + gtpLocalPadZeroCount(shard, v, n), gtpLocalPadZeroCount(shard, u, n))
                  << "u " << u << " v " << v;
            }
        });
        std::int64_t sum = 0;
        for (std::int64_t t : total) sum += t;
        EXPECT_EQ(sum, pad * row) << "Dlog " << dlog << " G " << g << " a " << a;
      }
    }
  }
}

}  // namespace
}  // namespace tpsim
