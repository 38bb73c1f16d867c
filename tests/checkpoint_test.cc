// Tests for core/checkpoint.h on the simulator: fromRankOffsets (SPEC 2.8), the full per-rank table
// of SPEC 3.21 (world 8, T = 2, D = 4), layer offsets prepended by sharded_offsets, checkpoint tiling
// (SPEC 6 item 13) on several (T, C, D) grids, groups built by split, and every rejected input.
// Under GTP_remat (SPEC 4.11): the worked example 4.11.3, the checks of 4.11.5, tiling on (T, G, D, C)
// grids with and without padding, and the resharding check of 4.11.4. Routed experts (SPEC 4.8,
// 4.11.5 item 8): the global expert axis, EP × EGTP_remat grids with padding, and the plain expert-TP
// layout.
#include "core/checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/grouped_linear.h"
#include "core/gtp.h"
#include "core/init.h"
#include "core/mxfp8.h"
#include "core/process_groups.h"
#include "tests/sim_test_util.h"

namespace tpsim {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;
using testing::runRanks;
using Ints = std::vector<std::int64_t>;


Parameter param(Compute& compute, const std::string& name, Shape shape, DType dtype = DType::kFloat32) {
  Parameter p;
  p.name = name;
  p.data = compute.zeros(shape, dtype);
  return p;
}

ModelParallelConfig configFor(int tp) {
  ModelParallelConfig config;
  config.tensorModelParallelSize = tp;
  config.performInitialization = false;
  return config;
}

ParallelSizes sizesFor(int tp, int cp, int dp) {
  ParallelSizes s;
  s.world = tp * cp * dp;
  s.tp = tp;
  s.cp = cp;
  return s;
}

std::vector<std::string> keysOf(const ShardedStateDict& sd) {
  std::vector<std::string> keys;
  for (const ShardedEntry& e : sd) keys.push_back(shardedKey(e));
  return keys;
}

const ShardedTensor& tensorAt(const ShardedStateDict& sd, const std::string& key) {
  for (const ShardedEntry& e : sd)
    if (shardedKey(e) == key) return std::get<ShardedTensor>(e);
  throw std::out_of_range("no entry " + key);
}
const ShardedObject& objectAt(const ShardedStateDict& sd, const std::string& key) {
  for (const ShardedEntry& e : sd)
    if (shardedKey(e) == key) return std::get<ShardedObject>(e);
  throw std::out_of_range("no entry " + key);
}

// ---- fromRankOffsets ------------------------------------------------------------------------

TEST(FromRankOffsets, ScalesOffsetsByTheLocalExtentAndPrependsAxesOfExtentOne) {
  const ConstView data(nullptr, Shape{2, 3}, DType::kBFloat16);  // metadata only: never read
  const ShardedTensor st = fromRankOffsets("w", data, {{0, 1, 5}, {2, 2, 4}}, {0, 1}, 1);
  EXPECT_EQ(st.key, "w");
  EXPECT_EQ(st.dtype, DType::kBFloat16);
  EXPECT_EQ(st.localShape, (Ints{2, 3}));
  EXPECT_EQ(st.globalShape, (Ints{5, 2, 12}));
  EXPECT_EQ(st.globalOffset, (Ints{1, 0, 6}));
  EXPECT_EQ(st.axisFragmentations, (std::vector<int>{5, 1, 4}));
  EXPECT_EQ(st.replicaId, (ReplicaId{0, 1}));
  EXPECT_EQ(st.prependAxisNum, 1);
  EXPECT_FALSE(st.allowShapeMismatch);
  EXPECT_FALSE(st.isMainReplica());

  const ShardedTensor plain = fromRankOffsets("b", ConstView(nullptr, Shape{7}, DType::kFloat32), {});
  EXPECT_EQ(plain.globalShape, (Ints{7}));
  EXPECT_EQ(plain.globalOffset, (Ints{0}));
  EXPECT_EQ(plain.axisFragmentations, (std::vector<int>{1}));
  EXPECT_EQ(plain.replicaId, (ReplicaId{0}));
  EXPECT_TRUE(plain.isMainReplica());
}

TEST(FromRankOffsets, MainReplicaIsAllZeros) {
  EXPECT_TRUE(isMainReplica({0}));
  EXPECT_TRUE(isMainReplica({0, 0, 0}));
  EXPECT_TRUE(isMainReplica({}));
  EXPECT_FALSE(isMainReplica({1}));
  EXPECT_FALSE(isMainReplica({0, 0, 2}));
  EXPECT_FALSE(isMainReplica({0, 1, 0}));
}

TEST(FromRankOffsets, RejectsInvalidOffsets) {
  const ConstView data(nullptr, Shape{4, 4}, DType::kFloat32);
  auto bad = [&](std::vector<RankOffset> offsets, int prepend = 0) {
    return testing::errorOf([&] { fromRankOffsets("layer.weight", data, offsets, {0}, prepend); });
  };
  const char* range = "must have axis >= 0, numChunks >= 1 and 0 <= chunkIndex < numChunks";
  EXPECT_THAT(bad({{-1, 0, 2}}), HasSubstr(range));
  EXPECT_THAT(bad({{-1, 0, 2}}), HasSubstr("fromRankOffsets: rank offset for key 'layer.weight'"));
  EXPECT_THAT(bad({{0, -1, 2}}), HasSubstr("got (axis 0, chunk -1 of 2)"));
  EXPECT_THAT(bad({{0, 0, 0}}), HasSubstr(range));
  EXPECT_THAT(bad({{0, 2, 2}}), HasSubstr("got (axis 0, chunk 2 of 2)"));
  EXPECT_THAT(bad({{2, 0, 2}}), HasSubstr("must name an axis in [0, 2)"));
  EXPECT_THAT(bad({{3, 0, 2}}, 1),
              HasSubstr("must name an axis in [0, 3) (1 prepended, then those of fp32 (4, 4)), got (axis 3"));
  EXPECT_THAT(bad({{1, 0, 2}, {1, 1, 2}}),
              HasSubstr("each axis may be sharded once for key 'layer.weight', got axis 1 twice"));
  EXPECT_THAT(bad({}, -1), HasSubstr("prependAxisNum for key 'layer.weight' must be >= 0, got -1"));
  EXPECT_EQ(bad({{0, 1, 2}, {1, 0, 1}}), "no error");
}

// ---- SPEC 3.21: the complete per-rank table ---------------------------------------------------

struct LayerDicts {
  ShardedStateDict col, row;
};

TEST(ShardedStateDict, Spec321TableWorld8Tp2Dp4) {
  const ParallelLayout layout(sizesFor(2, 1, 4));
  std::vector<LayerDicts> seen(8);
  runRanks(8, [&](RankContext& ctx) {
    ProcessGroups groups(ctx.comm, layout);
    const ModelParallelConfig config = configFor(2);
    ColumnParallelLinear col({ctx.compute, groups.tp()}, config, 4, 8, initMethodNormal(0.02));
    RowParallelLinear row({ctx.compute, groups.tp()}, config, 8, 4, initMethodNormal(0.02));
    LayerDicts d{shardedStateDict(col, "col.", {}, groups.tp(), &groups.dpCpGtp()),
                 shardedStateDict(row, "row.", {}, groups.tp(), &groups.dpCpGtp())};
    // The entries describe the layer's own memory; nothing is copied.
    EXPECT_EQ(tensorAt(d.col, "col.weight").data.data(), col.weight()->data.data());
    EXPECT_EQ(tensorAt(d.col, "col.bias").data.data(), col.bias()->data.data());
    EXPECT_EQ(tensorAt(d.row, "row.weight").data.data(), row.weight().data.data());
    EXPECT_EQ(tensorAt(d.row, "row.bias").data.data(), row.bias()->data.data());
    seen[ctx.comm.rank()] = std::move(d);
  });

  for (int r = 0; r < 8; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const int t = r % 2, d = r / 2;
    const LayerDicts& s = seen[r];
    EXPECT_THAT(keysOf(s.col), ElementsAre("col.weight", "col.bias", "col._extra_state"));
    EXPECT_THAT(keysOf(s.row), ElementsAre("row.weight", "row.bias", "row._extra_state"));

    struct Row {
      const ShardedTensor& st;
      Ints local, global, offset;
      std::vector<int> fragments;
      ReplicaId replica;
      bool main;
    };
    for (const Row& e : {
             Row{tensorAt(s.col, "col.weight"), {4, 4}, {8, 4}, {4 * t, 0}, {2, 1}, {0, 0, d}, r < 2},
             Row{tensorAt(s.col, "col.bias"), {4}, {8}, {4 * t}, {2}, {0, 0, d}, r < 2},
             Row{tensorAt(s.row, "row.weight"), {4, 4}, {4, 8}, {0, 4 * t}, {1, 2}, {0, 0, d}, r < 2},
             Row{tensorAt(s.row, "row.bias"), {4}, {4}, {0}, {1}, {0, t, d}, r == 0},
         }) {
      SCOPED_TRACE(e.st.key);
      EXPECT_EQ(e.st.localShape, e.local);
      EXPECT_EQ(e.st.globalShape, e.global);
      EXPECT_EQ(e.st.globalOffset, e.offset);
      EXPECT_EQ(e.st.axisFragmentations, e.fragments);
      EXPECT_EQ(e.st.replicaId, e.replica);
      EXPECT_EQ(e.st.isMainReplica(), e.main);
      EXPECT_EQ(e.st.prependAxisNum, 0);
      EXPECT_EQ(e.st.dtype, DType::kFloat32);
      EXPECT_FALSE(e.st.allowShapeMismatch);
    }
    for (const ShardedObject* o : {&objectAt(s.col, "col._extra_state"), &objectAt(s.row, "row._extra_state")}) {
      SCOPED_TRACE(o->key);
      EXPECT_EQ(o->globalShape, (Ints{1}));
      EXPECT_EQ(o->globalOffset, (Ints{0}));
      EXPECT_EQ(o->replicaId, (ReplicaId{0, t, d}));
      EXPECT_EQ(o->isMainReplica(), r == 0);
    }
  }
}

// SPEC 3.17: the embedding's single entry, world 8, T = 2, D = 4, V = 8, h = 4.
TEST(ShardedStateDict, EmbeddingWeightAllowsShapeMismatch) {
  const ParallelLayout layout(sizesFor(2, 1, 4));
  std::vector<ShardedStateDict> seen(8);
  runRanks(8, [&](RankContext& ctx) {
    ProcessGroups groups(ctx.comm, layout);
    VocabParallelEmbedding emb({ctx.compute, groups.tp()}, configFor(2), 8, 4, initMethodNormal(0.02));
    seen[ctx.comm.rank()] = shardedStateDict(emb, "emb.", {}, groups.tp(), &groups.dpCpGtp());
    EXPECT_THROW(shardedStateDict(emb, "emb.", {}, groups.tp(), nullptr), InvalidArgument);
  });
  for (int r = 0; r < 8; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const int t = r % 2, d = r / 2;
    EXPECT_THAT(keysOf(seen[r]), ElementsAre("emb.weight"));
    const ShardedTensor& w = tensorAt(seen[r], "emb.weight");
    EXPECT_EQ(w.localShape, (Ints{4, 4}));
    EXPECT_EQ(w.globalShape, (Ints{8, 4}));
    EXPECT_EQ(w.globalOffset, (Ints{4 * t, 0}));
    EXPECT_EQ(w.replicaId, (ReplicaId{0, 0, d}));
    EXPECT_TRUE(w.allowShapeMismatch);
  }
}

// sharded_offsets ((0, layer_idx, num_layers),) prepend a layer axis and shift the TP axis by one;
// two prepended axes given out of order are sorted for the extra state.
TEST(ShardedStateDict, ShardedOffsetsPrependAxesAndShiftTheTpAxis) {
  const ParallelLayout layout(sizesFor(2, 1, 2));
  std::vector<LayerDicts> one(4), two(4);
  runRanks(4, [&](RankContext& ctx) {
    ProcessGroups groups(ctx.comm, layout);
    const ModelParallelConfig config = configFor(2);
    ColumnParallelLinear col({ctx.compute, groups.tp()}, config, 4, 8, initMethodNormal(0.02));
    RowParallelLinear row({ctx.compute, groups.tp()}, config, 8, 4, initMethodNormal(0.02));
    const int r = ctx.comm.rank();
    const std::vector<RankOffset> layer{{0, 1, 3}};
    one[r] = {shardedStateDict(col, "", layer, groups.tp(), &groups.dpCpGtp()),
              shardedStateDict(row, "", layer, groups.tp(), &groups.dpCpGtp())};
    const std::vector<RankOffset> twoAxes{{1, 0, 2}, {0, 2, 4}};
    two[r] = {shardedStateDict(col, "", twoAxes, groups.tp(), &groups.dpCpGtp()),
              shardedStateDict(row, "", twoAxes, groups.tp(), &groups.dpCpGtp())};
  });

  for (int r = 0; r < 4; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const int t = r % 2, d = r / 2;
    const ShardedTensor& cw = tensorAt(one[r].col, "weight");
    EXPECT_EQ(cw.localShape, (Ints{4, 4}));
    EXPECT_EQ(cw.globalShape, (Ints{3, 8, 4}));
    EXPECT_EQ(cw.globalOffset, (Ints{1, 4 * t, 0}));
    EXPECT_EQ(cw.axisFragmentations, (std::vector<int>{3, 2, 1}));
    EXPECT_EQ(cw.prependAxisNum, 1);
    EXPECT_EQ(cw.replicaId, (ReplicaId{0, 0, d}));
    const ShardedTensor& cb = tensorAt(one[r].col, "bias");
    EXPECT_EQ(cb.globalShape, (Ints{3, 8}));
    EXPECT_EQ(cb.globalOffset, (Ints{1, 4 * t}));
    const ShardedTensor& rw = tensorAt(one[r].row, "weight");
    EXPECT_EQ(rw.globalShape, (Ints{3, 4, 8}));
    EXPECT_EQ(rw.globalOffset, (Ints{1, 0, 4 * t}));
    EXPECT_EQ(rw.axisFragmentations, (std::vector<int>{3, 1, 2}));
    const ShardedTensor& rb = tensorAt(one[r].row, "bias");
    EXPECT_EQ(rb.globalShape, (Ints{3, 4}));
    EXPECT_EQ(rb.globalOffset, (Ints{1, 0}));
    EXPECT_EQ(rb.replicaId, (ReplicaId{0, t, d}));
    for (const ShardedObject* o : {&objectAt(one[r].col, "_extra_state"), &objectAt(one[r].row, "_extra_state")}) {
      EXPECT_EQ(o->globalShape, (Ints{3}));
      EXPECT_EQ(o->globalOffset, (Ints{1}));
      EXPECT_EQ(o->replicaId, (ReplicaId{0, t, d}));
    }

    const ShardedTensor& cw2 = tensorAt(two[r].col, "weight");
    EXPECT_EQ(cw2.globalShape, (Ints{4, 2, 8, 4}));
    EXPECT_EQ(cw2.globalOffset, (Ints{2, 0, 4 * t, 0}));
    EXPECT_EQ(cw2.prependAxisNum, 2);
    const ShardedTensor& rw2 = tensorAt(two[r].row, "weight");
    EXPECT_EQ(rw2.globalShape, (Ints{4, 2, 4, 8}));
    EXPECT_EQ(rw2.globalOffset, (Ints{2, 0, 0, 4 * t}));
    const ShardedObject& o2 = objectAt(two[r].col, "_extra_state");
    EXPECT_EQ(o2.globalShape, (Ints{4, 2}));
    EXPECT_EQ(o2.globalOffset, (Ints{2, 0}));
  }
}

TEST(ShardedStateDict, AbsentParametersAreLeftOut) {
  runRanks(2, [](RankContext& ctx) {
    const ModelParallelConfig config = configFor(2);
    ColumnParallelOptions noWeight;
    noWeight.skipWeightParamAllocation = true;
    ColumnParallelLinear col({ctx.compute, ctx.comm}, config, 4, 8, initMethodNormal(0.02), noWeight);
    RowParallelOptions noBias;
    noBias.bias = false;
    RowParallelLinear row({ctx.compute, ctx.comm}, config, 8, 4, initMethodNormal(0.02), noBias);
    EXPECT_THAT(keysOf(shardedStateDict(col, "c.", {}, ctx.comm, &ctx.comm)), ElementsAre("c.bias", "c._extra_state"));
    EXPECT_THAT(keysOf(shardedStateDict(row, "r.", {}, ctx.comm, &ctx.comm)),
                ElementsAre("r.weight", "r._extra_state"));
  });
}

// ---- The multi-tensor helper and the single makers ----------------------------------------------

TEST(MakeShardedTensorsForCheckpoint, AxisMapSelectsShardedReplicatedAndObjects) {
  runRanks(4, [](RankContext& ctx) {
    // tp = {0,1}, {2,3}; dp = {0,2}, {1,3}, split directly from the world.
    std::unique_ptr<Collectives> tp = ctx.comm.split(ctx.comm.rank() / 2, ctx.comm.rank(), "tp");
    std::unique_ptr<Collectives> dp = ctx.comm.split(ctx.comm.rank() % 2, ctx.comm.rank(), "dp");
    const int t = tp->rank(), d = dp->rank();
    Parameter a = param(ctx.compute, "a", {2, 6}, DType::kFloat16);
    Parameter b = param(ctx.compute, "b", {6}, DType::kFloat16);
    const ShardedStateDict sd = makeShardedTensorsForCheckpoint(
        {{"a", &a}, {"b", &b}, {"mlp_extra_state", nullptr}}, "m.", {{"a", 1}}, {}, *tp, *dp);
    EXPECT_THAT(keysOf(sd), ElementsAre("m.a", "m.b", "m.mlp_extra_state"));
    EXPECT_EQ(tensorAt(sd, "m.a").globalShape, (Ints{2, 12}));
    EXPECT_EQ(tensorAt(sd, "m.a").globalOffset, (Ints{0, 6 * t}));
    EXPECT_EQ(tensorAt(sd, "m.a").replicaId, (ReplicaId{0, 0, d}));
    EXPECT_EQ(tensorAt(sd, "m.a").dtype, DType::kFloat16);
    EXPECT_EQ(tensorAt(sd, "m.b").globalShape, (Ints{6}));
    EXPECT_EQ(tensorAt(sd, "m.b").replicaId, (ReplicaId{0, t, d}));
    EXPECT_EQ(objectAt(sd, "m.mlp_extra_state").replicaId, (ReplicaId{0, t, d}));

    // An explicit replica id replaces the default; allowShapeMismatch is the caller's to set.
    const ShardedTensor st = makeTpShardedTensorForCheckpoint(a, "x", 0, ReplicaId{7}, {}, *tp, *dp);
    EXPECT_EQ(st.replicaId, (ReplicaId{7}));
    EXPECT_EQ(st.globalShape, (Ints{4, 6}));
    EXPECT_EQ(st.globalOffset, (Ints{2 * t, 0}));
    EXPECT_EQ(makeShardedTensorForCheckpoint(b, "y", ReplicaId{0, 0}, {}, *tp, *dp).replicaId, (ReplicaId{0, 0}));
    EXPECT_EQ(makeShardedObjectForCheckpoint("z", {}, ReplicaId{1}, *tp, *dp).replicaId, (ReplicaId{1}));
  });
}

// ---- SPEC 6 item 13: tiling -----------------------------------------------------------------

// Every way the entries of all ranks fail to tile their global shapes; empty when they do.
std::vector<std::string> tilingViolations(const std::vector<ShardedStateDict>& ranks) {
  struct Chunk {
    Ints offset, extent;
    ReplicaId replica;
    bool main;
  };
  std::map<std::string, Ints> globalShape;
  std::map<std::string, std::vector<Chunk>> chunks;
  std::vector<std::string> out;
  for (const ShardedStateDict& sd : ranks) {
    for (const ShardedEntry& e : sd) {
      const auto* st = std::get_if<ShardedTensor>(&e);
      const auto* so = std::get_if<ShardedObject>(&e);
      // An object fills one cell of its grid.
      Ints extent(st ? std::size_t(st->prependAxisNum) : so->globalShape.size(), 1);
      if (st) extent.insert(extent.end(), st->localShape.begin(), st->localShape.end());
      const Ints& global = st ? st->globalShape : so->globalShape;
      Chunk c{st ? st->globalOffset : so->globalOffset, std::move(extent), st ? st->replicaId : so->replicaId,
              st ? st->isMainReplica() : so->isMainReplica()};
      const std::string& key = shardedKey(e);
      if (globalShape.emplace(key, global).first->second != global)
        out.push_back(key + ": ranks disagree on the global shape");
      chunks[key].push_back(std::move(c));
    }
  }
  for (const auto& [key, list] : chunks) {
    const Ints& global = globalShape[key];
    std::int64_t cells = 1;
    for (std::int64_t g : global) cells *= g;
    std::vector<int> covered(cells, 0);
    std::map<std::pair<Ints, Ints>, std::set<ReplicaId>> replicas;
    for (const Chunk& c : list) {
      if (!replicas[{c.offset, c.extent}].insert(c.replica).second)
        out.push_back(key + ": two ranks hold the same chunk with the same replica id");
      bool inside = c.offset.size() == global.size();
      for (std::size_t a = 0; inside && a < global.size(); ++a)
        inside = c.offset[a] >= 0 && c.offset[a] + c.extent[a] <= global[a];
      if (!inside) {
        out.push_back(key + ": a chunk lies outside the global shape");
        continue;
      }
      if (!c.main) continue;
      // Visit every cell of the chunk: a mixed-radix counter over its extent.
      Ints i(global.size(), 0);
      for (bool more = true; more;) {
        std::int64_t flat = 0;
        for (std::size_t a = 0; a < global.size(); ++a) flat = flat * global[a] + c.offset[a] + i[a];
        ++covered[flat];
        more = false;
        for (std::size_t a = global.size(); a-- > 0;) {
          if (++i[a] < c.extent[a]) {
            more = true;
            break;
          }
          i[a] = 0;
        }
      }
    }
    for (std::int64_t cell = 0; cell < cells; ++cell)
      if (covered[cell] != 1)
        out.push_back(key + ": cell " + std::to_string(cell) + " is written " + std::to_string(covered[cell]) +
                      " times");
  }
  return out;
}

struct Grid {
  int tp, cp, dp;
};

// Each rank holds kLayers column and row layers under one key each, layer i at sharded offset
// (0, i, kLayers). dpCpOf picks the replica group: the gtp-inclusive DP-CP group, or a wrong one.
std::vector<ShardedStateDict> layerDicts(const Grid& g,
                                         const std::function<Collectives&(RankContext&, ProcessGroups&)>& dpCpOf) {
  constexpr int kLayers = 2;
  const ParallelLayout layout(sizesFor(g.tp, g.cp, g.dp));
  std::vector<ShardedStateDict> seen(layout.world());
  runRanks(layout.world(), [&](RankContext& ctx) {
    ProcessGroups groups(ctx.comm, layout);
    Collectives& dpCp = dpCpOf(ctx, groups);
    const ModelParallelConfig config = configFor(g.tp);
    ShardedStateDict all;
    for (int i = 0; i < kLayers; ++i) {
      ColumnParallelLinear col({ctx.compute, groups.tp()}, config, 3, 2 * g.tp, initMethodNormal(0.02));
      RowParallelLinear row({ctx.compute, groups.tp()}, config, 2 * g.tp, 3, initMethodNormal(0.02));
      for (ShardedEntry& e : shardedStateDict(col, "layers.col.", {{0, i, kLayers}}, groups.tp(), &dpCp))
        all.push_back(std::move(e));
      for (ShardedEntry& e : shardedStateDict(row, "layers.row.", {{0, i, kLayers}}, groups.tp(), &dpCp))
        all.push_back(std::move(e));
    }
    seen[ctx.comm.rank()] = std::move(all);
  });
  return seen;
}

class TilingGrid : public ::testing::TestWithParam<Grid> {};

TEST_P(TilingGrid, MainReplicasTileEveryKeyExactlyOnce) {
  const auto seen = layerDicts(GetParam(), [](RankContext&, ProcessGroups& g) -> Collectives& { return g.dpCpGtp(); });
  EXPECT_THAT(tilingViolations(seen), IsEmpty());
  for (const ShardedStateDict& sd : seen) EXPECT_EQ(sd.size(), 12u);  // 2 layers × 2 modules × 3 entries
}

INSTANTIATE_TEST_SUITE_P(Grids, TilingGrid,
                         ::testing::Values(Grid{1, 1, 1}, Grid{1, 1, 4}, Grid{2, 1, 2}, Grid{4, 1, 1}, Grid{2, 1, 3},
                                           Grid{3, 1, 2}, Grid{2, 2, 2}, Grid{2, 1, 4}),
                         [](const auto& info) {
                           const Grid& g = info.param;
                           return "T" + std::to_string(g.tp) + "C" + std::to_string(g.cp) + "D" +
                                  std::to_string(g.dp);
                         });

// What Megatron does when only dp_cp_group is None (SPEC 8 item 3): a size-1 stand-in gives every DP
// replica the same id, so each chunk gets D writers. The tiling check must catch it.
TEST(Tiling, ASingletonReplicaGroupGivesEveryReplicaTheWriterId) {
  std::vector<std::unique_ptr<Collectives>> selves(4);
  const auto seen = layerDicts({2, 1, 2}, [&](RankContext& ctx, ProcessGroups&) -> Collectives& {
    selves[ctx.comm.rank()] = ctx.comm.split(ctx.comm.rank(), 0, "self");
    return *selves[ctx.comm.rank()];
  });
  const auto violations = tilingViolations(seen);
  EXPECT_THAT(violations, Not(IsEmpty()));
  EXPECT_THAT(violations, ::testing::Contains(HasSubstr("is written 2 times")));
  EXPECT_THAT(violations, ::testing::Contains(HasSubstr("same chunk with the same replica id")));
}

// ---- GTP_remat (SPEC 4.11) ------------------------------------------------------------------------

ParallelLayout gtpLayout(int tp, int gtp, int dp, int cp = 1) {
  ParallelSizes s;
  s.world = tp * gtp * cp * dp;
  s.tp = tp;
  s.gtpRemat = gtp;
  s.cp = cp;
  return ParallelLayout(s);
}

ModelParallelConfig gtpConfig(int tp, int gtp, int padForAlignment) {
  ModelParallelConfig config = configFor(tp);
  config.gtpRematSize = gtp;
  config.gtpPadForAlignment = padForAlignment;
  return config;
}

// Runs fn on every rank of `layout` with a LayerContext built as in tests/gtp_test.cc: the TP group,
// the GTP_remat group and the gtp-excluded DP-CP group that wrapGtp stamps as gtp_replica_group.
void runGtpRanks(const ParallelLayout& layout,
                 const std::function<void(RankContext&, ProcessGroups&, LayerContext&)>& fn) {
  runRanks(layout.world(), [&](RankContext& ctx) {
    ProcessGroups pg(ctx.comm, layout);
    GtpGradReducer reducer(ctx.compute, {});
    LayerContext lc{ctx.compute, pg.tp(), nullptr, nullptr, &pg.gtpRemat(), &pg.dpCp(), &reducer};
    fn(ctx, pg, lc);
  });
}

// Every field but the data pointer's target values: what a second build must reproduce.
void expectSameMetadata(const ShardedEntry& a, const ShardedEntry& b) {
  ASSERT_EQ(a.index(), b.index());
  SCOPED_TRACE(shardedKey(a));
  EXPECT_EQ(shardedKey(a), shardedKey(b));
  if (const auto* x = std::get_if<ShardedTensor>(&a)) {
    const auto& y = std::get<ShardedTensor>(b);
    EXPECT_EQ(x->data.data(), y.data.data());
    EXPECT_EQ(x->dtype, y.dtype);
    EXPECT_EQ(x->localShape, y.localShape);
    EXPECT_EQ(x->globalShape, y.globalShape);
    EXPECT_EQ(x->globalOffset, y.globalOffset);
    EXPECT_EQ(x->axisFragmentations, y.axisFragmentations);
    EXPECT_EQ(x->replicaId, y.replicaId);
    EXPECT_EQ(x->prependAxisNum, y.prependAxisNum);
    EXPECT_EQ(x->allowShapeMismatch, y.allowShapeMismatch);
    ASSERT_EQ(x->gtpPadding.has_value(), y.gtpPadding.has_value());
    if (x->gtpPadding) {
      EXPECT_EQ(x->gtpPadding->tpAxis, y.gtpPadding->tpAxis);
      EXPECT_EQ(x->gtpPadding->tpSize, y.gtpPadding->tpSize);
      EXPECT_EQ(x->gtpPadding->padLength, y.gtpPadding->padLength);
    }
  } else {
    const auto& x2 = std::get<ShardedObject>(a);
    const auto& y2 = std::get<ShardedObject>(b);
    EXPECT_EQ(x2.globalShape, y2.globalShape);
    EXPECT_EQ(x2.globalOffset, y2.globalOffset);
    EXPECT_EQ(x2.replicaId, y2.replicaId);
  }
}

void expectGtpPadding(const ShardedTensor& st, int tpAxis, int tpSize, std::int64_t padLength) {
  ASSERT_TRUE(st.gtpPadding.has_value()) << st.key;
  EXPECT_EQ(st.gtpPadding->tpAxis, tpAxis) << st.key;
  EXPECT_EQ(st.gtpPadding->tpSize, tpSize) << st.key;
  EXPECT_EQ(st.gtpPadding->padLength, padLength) << st.key;
}

// SPEC 4.11.3: W = 8, T = 2, G = 2, D = 2 (rank = t + 2g + 4d), a = 0. Column 8 -> 16 and row 16 -> 8,
// both with TP-local (8, 8) weights and (4, 8) shards.
TEST(GtpShardedStateDict, Spec4113WorkedExampleWorld8) {
  std::vector<LayerDicts> seen(8);
  std::vector<LayerDicts> singletonDpCp(8);
  runGtpRanks(gtpLayout(2, 2, 2), [&](RankContext& ctx, ProcessGroups& pg, LayerContext& lc) {
    const ModelParallelConfig config = gtpConfig(2, 2, 0);
    ColumnParallelLinear col(lc, config, 8, 16, initMethodNormal(0.02));
    RowParallelLinear row(lc, config, 16, 8, initMethodNormal(0.02));
    LayerDicts d{shardedStateDict(col, "col.", {}, pg.tp(), &pg.dpCpGtp()),
                 shardedStateDict(row, "row.", {}, pg.tp(), &pg.dpCpGtp())};
    EXPECT_EQ(tensorAt(d.col, "col.weight").data.data(), col.weight()->data.data());
    EXPECT_EQ(tensorAt(d.row, "row.weight").data.data(), row.weight().data.data());
    // Under GTP_remat the passed dp_cp_group reaches no replica id (SPEC 4.11.2): any group will do.
    std::unique_ptr<Collectives> self = ctx.comm.split(ctx.comm.rank(), 0, "self");
    singletonDpCp[ctx.comm.rank()] = {shardedStateDict(col, "col.", {}, pg.tp(), self.get()),
                                      shardedStateDict(row, "row.", {}, pg.tp(), self.get())};
    seen[ctx.comm.rank()] = std::move(d);
  });

  struct Expect {
    Ints col, row;
    ReplicaId colBias, rowBias;
  };
  const Expect table[4] = {{{0, 0}, {0, 0}, {0, 0, 0}, {0, 0, 0}},
                           {{8, 0}, {0, 8}, {0, 0, 0}, {0, 2, 0}},
                           {{4, 0}, {4, 0}, {0, 1, 0}, {0, 1, 0}},
                           {{12, 0}, {4, 8}, {0, 1, 0}, {0, 3, 0}}};
  std::map<std::pair<std::string, Ints>, int> writers;
  for (int r = 0; r < 8; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const int t = r % 2, g = (r / 2) % 2, d = r / 4;
    Expect e = table[r % 4];  // ranks 4-7: as rank - 4, with d = 1 in the last place
    e.colBias.back() = d;
    e.rowBias.back() = d;
    const LayerDicts& s = seen[r];
    EXPECT_THAT(keysOf(s.col), ElementsAre("col.weight", "col.bias", "col._extra_state"));
    EXPECT_THAT(keysOf(s.row), ElementsAre("row.weight", "row.bias", "row._extra_state"));

    const ShardedTensor& cw = tensorAt(s.col, "col.weight");
    EXPECT_EQ(cw.localShape, (Ints{4, 8}));
    EXPECT_EQ(cw.globalShape, (Ints{16, 8}));
    EXPECT_EQ(cw.globalOffset, e.col);
    EXPECT_EQ(cw.globalOffset[0], (2 * t + g) * 4);
    EXPECT_EQ(cw.axisFragmentations, (std::vector<int>{4, 1}));
    const ShardedTensor& rw = tensorAt(s.row, "row.weight");
    EXPECT_EQ(rw.localShape, (Ints{4, 8}));
    EXPECT_EQ(rw.globalShape, (Ints{8, 16}));
    EXPECT_EQ(rw.globalOffset, e.row);
    EXPECT_EQ(rw.axisFragmentations, (std::vector<int>{2, 2}));
    for (const ShardedTensor* w : {&cw, &rw}) {
      EXPECT_EQ(w->replicaId, (ReplicaId{0, 0, d})) << w->key;
      EXPECT_EQ(w->isMainReplica(), r < 4) << w->key;
      EXPECT_FALSE(w->allowShapeMismatch) << w->key << ": a = 0 pads nothing";
      if (w->isMainReplica()) ++writers[{w->key, w->globalOffset}];
    }
    expectGtpPadding(cw, 0, 2, 0);
    expectGtpPadding(rw, 1, 2, 0);

    const ShardedTensor& cb = tensorAt(s.col, "col.bias");
    EXPECT_EQ(cb.globalShape, (Ints{16}));
    EXPECT_EQ(cb.globalOffset, (Ints{8 * t}));
    EXPECT_EQ(cb.replicaId, e.colBias);
    EXPECT_EQ(cb.isMainReplica(), r == 0 || r == 1);
    EXPECT_FALSE(cb.gtpPadding.has_value());
    const ShardedTensor& rb = tensorAt(s.row, "row.bias");
    EXPECT_EQ(rb.globalShape, (Ints{8}));
    EXPECT_EQ(rb.globalOffset, (Ints{0}));
    EXPECT_EQ(rb.replicaId, e.rowBias);
    EXPECT_EQ(rb.isMainReplica(), r == 0);
    for (const ShardedObject* o : {&objectAt(s.col, "col._extra_state"), &objectAt(s.row, "row._extra_state")}) {
      EXPECT_EQ(o->replicaId, (ReplicaId{0, 2 * t + g, d})) << o->key;
      EXPECT_EQ(o->isMainReplica(), r == 0) << o->key;
    }
    for (std::size_t i = 0; i < s.col.size(); ++i) expectSameMetadata(s.col[i], singletonDpCp[r].col[i]);
    for (std::size_t i = 0; i < s.row.size(); ++i) expectSameMetadata(s.row[i], singletonDpCp[r].row[i]);
  }
  EXPECT_EQ(writers.size(), 8u) << "four chunks of each weight";
  for (const auto& [chunk, n] : writers) EXPECT_EQ(n, 1) << chunk.first << " chunk at row " << chunk.second[0];

  std::vector<ShardedStateDict> all;
  for (const LayerDicts& s : seen) {
    all.push_back(s.col);
    all.back().insert(all.back().end(), s.row.begin(), s.row.end());
  }
  EXPECT_THAT(tilingViolations(all), IsEmpty());
}

// SPEC 4.11.5 items 1-3, 7, 9, 10 on world 4, T = 2 x G = 2 (rank = t + 2g), a = 0.
TEST(GtpShardedStateDict, Spec4115ColumnRowEmbeddingOnTp2Gtp2) {
  runGtpRanks(gtpLayout(2, 2, 1), [&](RankContext& ctx, ProcessGroups& pg, LayerContext& lc) {
    const int t = pg.tp().rank(), g = pg.gtpRemat().rank();
    const ModelParallelConfig config = gtpConfig(2, 2, 0);
    // 1. Column, full (8, 4): shard (2, 4), axis-0 offset (2t + g)·2, global axis 0 = 8.
    ColumnParallelLinear col(lc, config, 4, 8, initMethodNormal(0.02));
    const ShardedTensor c =
        makeTpShardedTensorForCheckpoint(*col.weight(), "col.weight", 0, std::nullopt, {}, pg.tp(), pg.dpCpGtp());
    EXPECT_EQ(c.localShape, (Ints{2, 4}));
    EXPECT_EQ(c.globalOffset, (Ints{(2 * t + g) * 2, 0}));
    EXPECT_EQ(c.globalShape, (Ints{8, 4}));
    EXPECT_EQ(c.replicaId, (ReplicaId{0, 0, 0}));
    // 2. Row, full (8, 4): TP-local (8, 2), shard (4, 2), offsets (4g, 2t), global (8, 4).
    RowParallelLinear row(lc, config, 4, 8, initMethodNormal(0.02));
    const ShardedTensor w =
        makeTpShardedTensorForCheckpoint(row.weight(), "row.weight", 1, std::nullopt, {}, pg.tp(), pg.dpCpGtp());
    EXPECT_EQ(w.localShape, (Ints{4, 2}));
    EXPECT_EQ(w.globalOffset, (Ints{4 * g, 2 * t}));
    EXPECT_EQ(w.globalShape, (Ints{8, 4}));
    // 3. No GTP_remat param: the vanilla TP offsets, replica over the gtp-inclusive group.
    Parameter plain = param(ctx.compute, "plain", {4, 4});
    const ShardedStateDict vanilla =
        makeShardedTensorsForCheckpoint({{"weight", &plain}}, "", {{"weight", 0}}, {}, pg.tp(), pg.dpCpGtp());
    EXPECT_EQ(tensorAt(vanilla, "weight").globalOffset, (Ints{4 * t, 0}));
    EXPECT_EQ(tensorAt(vanilla, "weight").globalShape, (Ints{8, 4}));
    EXPECT_EQ(tensorAt(vanilla, "weight").replicaId, (ReplicaId{0, 0, g}));
    EXPECT_FALSE(tensorAt(vanilla, "weight").gtpPadding.has_value());
    // 7. Building twice gives identical metadata.
    const auto buildTwice = [&](auto& layer, const std::vector<RankOffset>& offsets) {
      const ShardedStateDict a = shardedStateDict(layer, "m.", offsets, pg.tp(), &pg.dpCpGtp());
      const ShardedStateDict b = shardedStateDict(layer, "m.", offsets, pg.tp(), &pg.dpCpGtp());
      ASSERT_EQ(a.size(), b.size());
      for (std::size_t i = 0; i < a.size(); ++i) expectSameMetadata(a[i], b[i]);
    };
    buildTwice(col, {{0, 1, 2}});
    buildTwice(row, {});
    // 9. The embedding, vocab 8: composite offset (2t + g)·2, global 8, allowShapeMismatch even unpadded.
    VocabParallelEmbedding emb(lc, config, 8, 4, initMethodNormal(0.02));
    const ShardedStateDict e = shardedStateDict(emb, "emb.", {}, pg.tp(), &pg.dpCpGtp());
    EXPECT_THAT(keysOf(e), ElementsAre("emb.weight"));
    EXPECT_EQ(tensorAt(e, "emb.weight").localShape, (Ints{2, 4}));
    EXPECT_EQ(tensorAt(e, "emb.weight").globalOffset, (Ints{(2 * t + g) * 2, 0}));
    EXPECT_EQ(tensorAt(e, "emb.weight").globalShape, (Ints{8, 4}));
    EXPECT_TRUE(tensorAt(e, "emb.weight").allowShapeMismatch);
    expectGtpPadding(tensorAt(e, "emb.weight"), 0, 2, 0);
    // 10. The public multi-tensor helper delegates: the composite offset again.
    const ShardedStateDict pub =
        makeShardedTensorsForCheckpoint({{"weight", col.weight()}}, "layer.", {{"weight", 0}}, {}, pg.tp(), ctx.comm);
    EXPECT_EQ(tensorAt(pub, "layer.weight").globalOffset, (Ints{(2 * t + g) * 2, 0}));
    EXPECT_EQ(tensorAt(pub, "layer.weight").globalShape, (Ints{8, 4}));
    // A GTP_remat shard missing from the axis map is described with tp_axis 0.
    const ShardedStateDict unmapped =
        makeShardedTensorsForCheckpoint({{"weight", col.weight()}}, "", {}, {}, pg.tp(), ctx.comm);
    EXPECT_EQ(tensorAt(unmapped, "weight").globalOffset, (Ints{(2 * t + g) * 2, 0}));
  });
}

// SPEC 4.11.5 items 4, 5 and 4.11.4: Dlog 1152 and 1160 over G = 4 (no TP), a = 16.
TEST(GtpCheckpoint, Spec4115PaddedGlobalShapeIsThePaddedOne) {
  runGtpRanks(gtpLayout(1, 4, 1), [](RankContext& ctx, ProcessGroups& pg, LayerContext&) {
    const int r = pg.gtpRemat().rank();
    for (const auto& [dLog, pad, rows] : {std::tuple{1152, 0, 288}, std::tuple{1160, 56, 304}}) {
      SCOPED_TRACE("Dlog " + std::to_string(dLog));
      Parameter w = param(ctx.compute, "w", {dLog, 2});  // TP-local (Dlog, 2)
      wrapGtp(ctx.compute, w, pg.gtpRemat(), 16, &pg.dpCp());
      EXPECT_EQ(w.attrs.padLength, std::optional<int>(pad)) << "stamped on every rank";
      const ShardedTensor st = makeTpShardedTensorForCheckpoint(w, "w", 0, std::nullopt, {}, pg.tp(), pg.dpCpGtp());
      EXPECT_EQ(st.localShape, (Ints{rows, 2}));
      EXPECT_EQ(st.globalShape, (Ints{4 * rows, 2}));
      EXPECT_EQ(st.globalOffset, (Ints{rows * r, 0}));
      EXPECT_LE(st.globalOffset[0] + st.localShape[0], st.globalShape[0]);
      EXPECT_EQ(st.allowShapeMismatch, pad > 0);
      expectGtpPadding(st, 0, 1, pad);
      EXPECT_TRUE(st.isMainReplica());  // D = 1: every shard has one holder
    }
  });
}

// SPEC 4.11.5 item 11: world 4, T = 1 x G = 2 x D = 2 (rank = g + 2d): GTP peers [0,1] [2,3] hold
// different shards, replicas [0,2] [1,3] the same one. The stamped group elects the writer.
TEST(GtpCheckpoint, Spec4115StampedReplicaGroupElectsTheWriter) {
  struct Seen {
    int g = 0, d = 0;
    ReplicaId weight, bias, biasOverride, weightWithOverride;
  };
  std::vector<Seen> seen(4);
  runGtpRanks(gtpLayout(1, 2, 2), [&](RankContext& ctx, ProcessGroups& pg, LayerContext&) {
    const int g = pg.gtpRemat().rank(), d = pg.dpCp().rank();
    Parameter stamped = param(ctx.compute, "stamped", {8, 4});
    wrapGtp(ctx.compute, stamped, pg.gtpRemat(), 0, &pg.dpCp());
    Parameter unstamped = param(ctx.compute, "unstamped", {8, 4});
    wrapGtp(ctx.compute, unstamped, pg.gtpRemat(), 0);
    Parameter bias = param(ctx.compute, "bias", {4});
    Collectives& world = ctx.comm;  // a wrong dp_cp_group: it must reach no replica id

    const ShardedTensor single = makeTpShardedTensorForCheckpoint(stamped, "w", 0, std::nullopt, {}, pg.tp(), world);
    EXPECT_EQ(single.globalShape, (Ints{8, 4}));
    EXPECT_EQ(single.globalOffset, (Ints{4 * g, 0}));
    EXPECT_EQ(single.replicaId, (ReplicaId{0, 0, d}));
    EXPECT_EQ(gtpReplicaRank(stamped), d);
    const ShardedStateDict sd = makeShardedTensorsForCheckpoint({{"weight", &stamped}, {"bias", &bias}}, "",
                                                                {{"weight", 0}}, {}, pg.tp(), world);
    EXPECT_EQ(tensorAt(sd, "weight").globalOffset, single.globalOffset);
    // With the override equal to the GTP pair, replicated entries take g, the weight keeps its own.
    const ShardedStateDict over = makeShardedTensorsForCheckpoint({{"weight", &stamped}, {"bias", &bias}}, "",
                                                                  {{"weight", 0}}, {}, pg.tp(), world, &pg.gtpRemat());
    seen[ctx.comm.rank()] = {g, d, tensorAt(sd, "weight").replicaId, tensorAt(sd, "bias").replicaId,
                             tensorAt(over, "bias").replicaId, tensorAt(over, "weight").replicaId};

    // An explicit group wins over the stamped one and stands in for a missing one.
    EXPECT_EQ(makeTpShardedTensorForCheckpoint(stamped, "w", 0, std::nullopt, {}, pg.tp(), world, &pg.gtpRemat())
                  .replicaId,
              (ReplicaId{0, 0, g}));
    EXPECT_EQ(makeTpShardedTensorForCheckpoint(unstamped, "w", 0, std::nullopt, {}, pg.tp(), world, &pg.dpCp())
                  .replicaId,
              (ReplicaId{0, 0, d}));
    // So does an explicit replica id: no election happens.
    EXPECT_EQ(makeTpShardedTensorForCheckpoint(unstamped, "w", 0, ReplicaId{0, 5}, {}, pg.tp(), world).replicaId,
              (ReplicaId{0, 5}));
    // Unstamped, no group: an error naming gtp_replica_group, from every path that elects.
    const char* missing = "GTP_remat shard 'unstamped' must carry a gtp_replica_group to elect its checkpoint writer";
    EXPECT_THAT(testing::errorOf([&] { makeTpShardedTensorForCheckpoint(unstamped, "w", 0, std::nullopt, {}, pg.tp(), world); }),
                HasSubstr(missing));
    EXPECT_THAT(testing::errorOf([&] {
                  makeShardedTensorsForCheckpoint({{"weight", &unstamped}}, "", {{"weight", 0}}, {}, pg.tp(), world);
                }),
                HasSubstr(missing));
    // The override covers the replicated entries only; the unstamped weight still has no writer group.
    EXPECT_THAT(testing::errorOf([&] {
                  makeShardedTensorsForCheckpoint({{"weight", &unstamped}}, "", {{"weight", 0}}, {}, pg.tp(), world,
                                                  &pg.dpCp());
                }),
                HasSubstr("gtp_replica_group"));
  });
  for (int r = 0; r < 4; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const Seen& s = seen[r];
    EXPECT_EQ(s.weight, (ReplicaId{0, 0, s.d}));
    EXPECT_EQ(s.weightWithOverride, s.weight) << "GTP weights ignore intra_dp_cp_group";
    EXPECT_EQ(s.bias, (ReplicaId{0, s.g, s.d}));
    EXPECT_EQ(s.biasOverride, (ReplicaId{0, s.g, s.g}));
  }
  for (int shard = 0; shard < 2; ++shard) {  // exactly one writer per shard
    int writers = 0;
    for (const Seen& s : seen) writers += s.g == shard && isMainReplica(s.weight);
    EXPECT_EQ(writers, 1) << "shard " << shard;
  }
  int biasWriters = 0;
  for (const Seen& s : seen) biasWriters += isMainReplica(s.bias);
  EXPECT_EQ(biasWriters, 1);
}

// SPEC 4.11.5 item 13: a state dict with only a replicated param takes its replica id from the
// passed dp_cp_group, which must then be the gtp-inclusive one (world 4, T = 1 x G = 2 x D = 2).
TEST(GtpCheckpoint, Spec4115ReplicatedOnlyStateDictNeedsTheGtpInclusiveGroup) {
  std::vector<ShardedStateDict> excluded(4), inclusive(4);
  runGtpRanks(gtpLayout(1, 2, 2), [&](RankContext& ctx, ProcessGroups& pg, LayerContext&) {
    Parameter w = param(ctx.compute, "w", {8, 4});
    excluded[ctx.comm.rank()] = makeShardedTensorsForCheckpoint({{"w", &w}}, "", {}, {}, pg.tp(), pg.dpCp());
    inclusive[ctx.comm.rank()] = makeShardedTensorsForCheckpoint({{"w", &w}}, "", {}, {}, pg.tp(), pg.dpCpGtp());
  });
  EXPECT_THAT(tilingViolations(excluded), ::testing::Contains(HasSubstr("is written 2 times")));
  EXPECT_THAT(tilingViolations(inclusive), IsEmpty());
  std::set<ReplicaId> ids;
  int writers = 0;
  for (const ShardedStateDict& sd : inclusive) {
    ids.insert(tensorAt(sd, "w").replicaId);
    writers += tensorAt(sd, "w").isMainReplica();
  }
  EXPECT_EQ(ids.size(), 4u);
  EXPECT_EQ(writers, 1);
}

// SPEC 4.11.5 item 14: the embedding with T = 1, G = 2, D = 2, vocab 8: offsets {0, 4}, one writer each.
TEST(GtpCheckpoint, Spec4115EmbeddingWriterElection) {
  std::vector<ShardedStateDict> seen(4);
  runGtpRanks(gtpLayout(1, 2, 2), [&](RankContext& ctx, ProcessGroups& pg, LayerContext& lc) {
    VocabParallelEmbedding emb(lc, gtpConfig(1, 2, 0), 8, 3, initMethodNormal(0.02));
    seen[ctx.comm.rank()] = shardedStateDict(emb, "emb.", {}, pg.tp(), &pg.dpCpGtp());
  });
  std::map<std::int64_t, int> writers;
  for (const ShardedStateDict& sd : seen) {
    const ShardedTensor& w = tensorAt(sd, "emb.weight");
    EXPECT_EQ(w.globalShape, (Ints{8, 3}));
    writers[w.globalOffset[0]] += w.isMainReplica();
  }
  EXPECT_EQ(writers, (std::map<std::int64_t, int>{{0, 1}, {4, 1}}));
  EXPECT_THAT(tilingViolations(seen), IsEmpty());
}

// SPEC 6 item 13 under GTP_remat: column, row and embedding of every rank, layer offsets prepended.
struct GtpGrid {
  int tp, gtp, dp, cp, pad;  // pad: ModelParallelConfig::gtpPadForAlignment
};

class GtpTilingGrid : public ::testing::TestWithParam<GtpGrid> {};

TEST_P(GtpTilingGrid, MainReplicasTileEveryKeyExactlyOnce) {
  constexpr int kLayers = 2;
  const GtpGrid grid = GetParam();
  const int T = grid.tp, G = grid.gtp;
  const ParallelLayout layout = gtpLayout(T, G, grid.dp, grid.cp);
  std::vector<ShardedStateDict> seen(layout.world());
  runGtpRanks(layout, [&](RankContext& ctx, ProcessGroups& pg, LayerContext& lc) {
    const ModelParallelConfig config = gtpConfig(T, G, grid.pad);
    ShardedStateDict all;
    auto add = [&](ShardedStateDict sd) {
      for (ShardedEntry& e : sd) all.push_back(std::move(e));
    };
    for (int i = 0; i < kLayers; ++i) {
      // TP-local dim 0: 2G rows for the column, 3G for the row (divisible by G for a = 0).
      ColumnParallelLinear col(lc, config, 3, 2 * T * G, initMethodNormal(0.02));
      RowParallelLinear row(lc, config, 2 * T, 3 * G, initMethodNormal(0.02));
      add(shardedStateDict(col, "layers.col.", {{0, i, kLayers}}, pg.tp(), &pg.dpCpGtp()));
      add(shardedStateDict(row, "layers.row.", {{0, i, kLayers}}, pg.tp(), &pg.dpCpGtp()));
    }
    VocabParallelEmbedding emb(lc, config, 4 * T * G, 3, initMethodNormal(0.02));
    add(shardedStateDict(emb, "emb.", {}, pg.tp(), &pg.dpCpGtp()));
    if (G > 1) {
      const std::int64_t pad = grid.pad > 0 ? *emb.weight().attrs.padLength : 0;
      EXPECT_EQ(pad > 0, grid.pad > 0);
      EXPECT_EQ(tensorAt(all, "emb.weight").globalShape[0], T * (4 * G + pad)) << "the padded extent";
    }
    seen[ctx.comm.rank()] = std::move(all);
  });
  EXPECT_THAT(tilingViolations(seen), IsEmpty());
  for (const ShardedStateDict& sd : seen) EXPECT_EQ(sd.size(), 13u);  // 2 layers × 2 modules × 3 entries + 1
}

INSTANTIATE_TEST_SUITE_P(Grids, GtpTilingGrid,
                         ::testing::Values(GtpGrid{1, 2, 1, 1, 0}, GtpGrid{1, 2, 2, 1, 0}, GtpGrid{2, 2, 2, 1, 0},
                                           GtpGrid{3, 2, 1, 1, 0}, GtpGrid{1, 2, 2, 2, 0}, GtpGrid{2, 2, 1, 1, 16},
                                           GtpGrid{1, 4, 2, 1, 16}, GtpGrid{2, 2, 2, 1, 16}, GtpGrid{2, 3, 1, 1, 16},
                                           GtpGrid{1, 1, 2, 1, 16}),
                         [](const auto& info) {
                           const GtpGrid& g = info.param;
                           return "T" + std::to_string(g.tp) + "G" + std::to_string(g.gtp) + "D" +
                                  std::to_string(g.dp) + "C" + std::to_string(g.cp) + "A" + std::to_string(g.pad);
                         });

// SPEC 4.11.5 item 15: an MXFP8 weight is saved as its dequantized bf16 value, of the shard's shape,
// at the composite offset. T = 2 x G = 2, N = 120: TP-local Dlog 60, a = 32 pads it to 64, S = 32.
// Each rank's saved rows are the rows of the whole weight's rowwise quantization that it owns
// (gemmWeight gathers and dequantizes that independently); pad rows stay zero. Native weights are
// saved from the parameter's own memory.
TEST(GtpCheckpoint, Spec4115Mxfp8WeightsAreSavedAsDequantizedBf16) {
  runGtpRanks(gtpLayout(2, 2, 1), [&](RankContext& ctx, ProcessGroups& pg, LayerContext& lc) {
    Generator gen(7);
    lc.cpuGenerator = &gen;
    ModelParallelConfig config = gtpConfig(2, 2, 32);
    config.performInitialization = true;
    config.useCpuInitialization = true;
    config.weightFormat = WeightFormat::kMxfp8;
    ColumnParallelLinear col(lc, config, 64, 120, initMethodNormal(0.3));
    const int t = pg.tp().rank(), g = pg.gtpRemat().rank();
    const ShardedStateDict sd = shardedStateDict(col, "", {}, pg.tp(), &pg.dpCpGtp());
    const ShardedTensor& w = tensorAt(sd, "weight");
    EXPECT_EQ(w.dtype, DType::kBFloat16);
    ASSERT_TRUE(w.owned != nullptr);
    EXPECT_EQ(w.data.data(), w.owned->data());
    EXPECT_EQ(w.localShape, (Ints{32, 64}));
    EXPECT_EQ(w.globalShape, (Ints{128, 64}));
    EXPECT_EQ(w.globalOffset, (Ints{(2 * t + g) * 32, 0}));
    const std::vector<double> saved = testing::valuesOf(ctx.compute, w.data);
    const GemmWeight full = gemmWeight(ctx.compute, *col.weight(), WeightFormat::kMxfp8, GemmUse::kFprop,
                                       DType::kBFloat16);  // (60, 64)
    const std::vector<double> quantized = testing::valuesOf(ctx.compute, full.weight);
    const std::vector<double> raw = testing::valuesOf(ctx.compute, col.weight()->data);
    int changed = 0;
    for (std::int64_t r = 0; r < 32; ++r)
      for (std::int64_t c = 0; c < 64; ++c) {
        const std::int64_t row = g * 32 + r, at = r * 64 + c;
        ASSERT_EQ(saved[at], row < 60 ? quantized[row * 64 + c] : 0.0) << "row " << row << " col " << c;
        changed += saved[at] != raw[at];
      }
    EXPECT_GT(changed, 32 * 64 / 2) << "the saved value is the quantized one, not the master";

    ModelParallelConfig native = gtpConfig(2, 2, 32);
    ColumnParallelLinear plain(lc, native, 64, 120, initMethodNormal(0.3));
    const ShardedStateDict plainSd = shardedStateDict(plain, "", {}, pg.tp(), &pg.dpCpGtp());
    const ShardedTensor& p = tensorAt(plainSd, "weight");
    EXPECT_EQ(p.owned, nullptr);
    EXPECT_EQ(p.data.data(), plain.weight()->data.data());
  });
}

// ---- Resharding (SPEC 4.11.4, 8 item 26) -------------------------------------------------------

// Every rank's metadata for the weight of ColumnParallelLinear(K = 4 -> N) (or RowParallelLinear(4 -> N))
// on T x G ranks with pad_for_alignment a; G = 1 is a layer without GTP_remat. Rank order t + T·g.
std::vector<ShardedTensor> weightsOf(bool column, int T, int G, int a, std::int64_t n) {
  std::vector<ShardedTensor> out(T * G);
  runGtpRanks(gtpLayout(T, G, 1), [&](RankContext& ctx, ProcessGroups& pg, LayerContext& lc) {
    const ModelParallelConfig config = gtpConfig(T, G, a);
    ShardedStateDict sd;
    if (column) {
      ColumnParallelLinear layer(lc, config, 4, n, initMethodNormal(0.02));
      sd = shardedStateDict(layer, "w.", {}, pg.tp(), &pg.dpCpGtp());
    } else {
      RowParallelLinear layer(lc, config, 4, n, initMethodNormal(0.02));
      sd = shardedStateDict(layer, "w.", {}, pg.tp(), &pg.dpCpGtp());
    }
    ShardedTensor w = tensorAt(sd, "w.weight");
    w.data = ConstView();  // the layer is gone; only the metadata is compared
    out[ctx.comm.rank()] = std::move(w);
  });
  return out;
}
ShardedTensor columnWeight(int T, int G, int a, std::int64_t n) { return weightsOf(true, T, G, a, n)[0]; }

TEST(GtpCheckpointResharding, PerSlicePaddingIsInterleavedInTheSavedTensor) {
  // SPEC 4.11.4: N = 16, T = 2, G = 2, a = 16: per-TP Dlog 8, pad 24, S 16, extent 64; real rows
  // [0, 8) from TP slice 0 and [32, 40) from slice 1.
  const std::vector<ShardedTensor> ranks = weightsOf(true, 2, 2, 16, 16);
  for (int r = 0; r < 4; ++r) {
    const int t = r % 2, g = r / 2;
    EXPECT_EQ(ranks[r].localShape, (Ints{16, 4}));
    EXPECT_EQ(ranks[r].globalShape, (Ints{64, 4}));
    EXPECT_EQ(ranks[r].globalOffset, (Ints{(2 * t + g) * 16, 0}));
    EXPECT_TRUE(ranks[r].allowShapeMismatch);
    expectGtpPadding(ranks[r], 0, 2, 24);
  }
}

TEST(GtpCheckpointResharding, InterleavedPaddingLoadsOnlyIntoTheSameLayout) {
  const ShardedTensor saved = columnWeight(2, 2, 16, 16);  // global (64, 4), pad 24 per TP slice
  auto load = [&](const ShardedTensor& target) { return testing::errorOf([&] { checkReshardable(saved, target); }); };
  EXPECT_EQ(load(saved), "no error");
  EXPECT_EQ(load(columnWeight(2, 4, 8, 16)), "no error") << "G = 4, a = 8 lays the rows out the same way";
  EXPECT_THAT(load(columnWeight(1, 2, 16, 16)),
              HasSubstr("checkReshardable: key 'w.weight' pads each TP slice of axis 0 separately on the saved side "
                        "(tp_axis 0, T > 1, pad_length > 0), so it loads only with the same T, pad_length and global "
                        "shape; saved tp_axis 0, T = 2, pad_length 24, global (64, 4), got target tp_axis 0, T = 1, "
                        "pad_length 16, global (32, 4), whose rows would not line up"));
  EXPECT_THAT(load(columnWeight(2, 2, 0, 16)), HasSubstr("got target tp_axis 0, T = 2, pad_length 0, global (16, 4)"));
  EXPECT_THAT(load(columnWeight(4, 2, 16, 16)),
              HasSubstr("got target tp_axis 0, T = 4, pad_length 28, global (128, 4)"));
  ShardedTensor plain = columnWeight(2, 1, 16, 16);  // no GTP_remat: T = 2, global (16, 4)
  plain.allowShapeMismatch = true;
  EXPECT_THAT(load(plain), HasSubstr("got target no GTP_remat padding, global (16, 4)"));
  // The other direction misaligns too: an unpadded T = 2 checkpoint into the padded T = 2 layout.
  EXPECT_THAT(testing::errorOf([&] { checkReshardable(columnWeight(2, 2, 0, 16), saved); }),
              HasSubstr("pads each TP slice of axis 0 separately on the target side"));
}

TEST(GtpCheckpointResharding, TailPaddingReshardsFreely) {
  // Padded T = 1 (SPEC 4.11.4's tested case): Dlog 1160 over G = 4 is saved as 1216 rows.
  const ShardedTensor saved = columnWeight(1, 4, 16, 1160);
  ASSERT_EQ(saved.globalShape, (Ints{1216, 4}));
  EXPECT_NO_THROW(checkReshardable(saved, columnWeight(1, 2, 16, 1160)));  // 1184 rows
  EXPECT_NO_THROW(checkReshardable(saved, columnWeight(1, 8, 16, 1160)));  // 1280 rows
  EXPECT_NO_THROW(checkReshardable(columnWeight(1, 2, 16, 1160), saved));
  // An unpadded target of any T, once it allows the mismatch (a G = 1 layer does not by itself).
  ShardedTensor plain = columnWeight(2, 1, 16, 1160);
  EXPECT_THAT(testing::errorOf([&] { checkReshardable(saved, plain); }),
              HasSubstr("the target global shape must equal the saved (1216, 4) unless the target allows a shape "
                        "mismatch, got (1160, 4)"));
  plain.allowShapeMismatch = true;
  EXPECT_NO_THROW(checkReshardable(saved, plain));
  EXPECT_NO_THROW(checkReshardable(columnWeight(2, 2, 0, 16), columnWeight(1, 2, 0, 16)));  // unpadded, any T
  // A row weight pads only its tail whatever T is: T = 2, a = 16 loads into T = 1 with more padding.
  const ShardedTensor row = weightsOf(false, 2, 2, 16, 16)[0];
  const ShardedTensor rowTarget = weightsOf(false, 1, 4, 16, 16)[0];
  ASSERT_EQ(row.globalShape, (Ints{32, 4}));
  ASSERT_EQ(rowTarget.globalShape, (Ints{64, 4}));
  EXPECT_NO_THROW(checkReshardable(row, rowTarget));
}

TEST(GtpCheckpointResharding, RejectsAnotherKeyOrRank) {
  const ShardedTensor saved = columnWeight(2, 2, 0, 16);
  ShardedTensor renamed = saved;
  renamed.key = "x.weight";
  EXPECT_THAT(testing::errorOf([&] { checkReshardable(saved, renamed); }),
              HasSubstr("checkReshardable: the target must have the saved key 'w.weight', got 'x.weight'"));
  ShardedTensor rank3 = saved;
  rank3.globalShape.push_back(1);
  rank3.allowShapeMismatch = true;
  EXPECT_THAT(testing::errorOf([&] { checkReshardable(saved, rank3); }),
              HasSubstr("the target global shape must have the saved rank 2 (saved (16, 4)), got (16, 4, 1)"));
  EXPECT_THAT(testing::errorOf([&] { checkReshardable(saved, columnWeight(1, 2, 0, 24)); }),
              HasSubstr("must equal the saved (16, 4) unless the target allows a shape mismatch, got (24, 4)"));
}

// ---- Routed experts (SPEC 4.8, 4.11.5 item 8) ---------------------------------------------------

// The expert grid `tp-cp-ep-gtp_remat-dp-pp` with sizes (ET, 1, EP, EG, ED, 1), so expert rank
// t + ET·(e + EP·(g + EG·d)); the dense side is T = ET, G = 1, D = world / ET.
ParallelLayout expertLayout(int world, int et, int ep, int eg) {
  ParallelSizes s;
  s.world = world;
  s.tp = et;
  s.ep = ep;
  s.expertTp = et;
  s.expertGtpRemat = eg;
  return ParallelLayout(s);
}

ModelParallelConfig expertConfig(int et, int ep, int eg, int padForAlignment) {
  ModelParallelConfig config = configFor(et);
  config.expertTensorParallelSize = et;
  config.expertModelParallelSize = ep;
  config.expertGtpRematSize = eg;
  config.gtpPadForAlignment = padForAlignment;
  return config;
}

// Runs fn on every rank with the LayerContext an expert layer gets: the expert TP group, the EGTP_remat
// group and, as gtp_replica_group, the gtp-excluded expert DP group (SPEC 1.4.4, 4.8).
void runExpertRanks(const ParallelLayout& layout,
                    const std::function<void(RankContext&, ProcessGroups&, LayerContext&)>& fn) {
  runRanks(layout.world(), [&](RankContext& ctx) {
    ProcessGroups pg(ctx.comm, layout);
    GtpGradReducer reducer(ctx.compute, {});
    LayerContext lc{ctx.compute, pg.expertTp(), nullptr, nullptr, &pg.expertGtpRemat(), &pg.expertDp(), &reducer};
    fn(ctx, pg, lc);
  });
}

GroupedLinearOptions expertOptions(int numGemms, GroupedParallelMode mode) {
  GroupedLinearOptions o;
  o.numGemms = numGemms;
  o.parallelMode = mode;
  return o;
}

// The entries under `key`, one per local expert, in expert order.
template <class Entry>
std::vector<const Entry*> entriesAt(const ShardedStateDict& sd, const std::string& key) {
  std::vector<const Entry*> out;
  for (const ShardedEntry& e : sd)
    if (shardedKey(e) == key) out.push_back(&std::get<Entry>(e));
  return out;
}

// SPEC 4.11.5 item 8: world 4, ET = 1, EP = 2, EG = 2, so ED = 1 and expert rank = e + 2g; one local
// expert, full (4, 4) column weight, a = 0: shard (2, 4), global (2, 4, 4), offset (e, 2g, 0). The
// SPEC calls [0, 2] / [1, 3] the expert-DP group, but on this grid they are the EGTP pairs: a replica
// id taken over a pair would make EGTP rank 1 replica 1 of a shard nobody else holds, leaving it
// without a writer. The replica rank comes from the gtp-excluded expert DP (size 1 here), so each
// rank holds a distinct chunk and writes it: 4 chunks, one writer each.
TEST(ExpertCheckpoint, Spec4115Item8Ep2Egtp2) {
  std::vector<ShardedStateDict> seen(4);
  runExpertRanks(expertLayout(4, 1, 2, 2), [&](RankContext& ctx, ProcessGroups& pg, LayerContext& lc) {
    ASSERT_EQ(pg.expertDp().size(), 1);
    const int r = ctx.comm.rank();
    ASSERT_EQ(pg.expertGtpRemat().rank(), r / 2) << "EGTP pair [" << r % 2 << ", " << r % 2 + 2 << "]";
    GroupedParallelLinear experts(lc, expertConfig(1, 2, 2, 0), 4, 4, initMethodNormal(0.02),
                                  expertOptions(1, GroupedParallelMode::kColumn));
    seen[r] = shardedStateDict(experts, "experts.", {}, pg.expertTp(), pg.ep(), &pg.expertDp());
    EXPECT_EQ(tensorAt(seen[r], "experts.weight").data.data(), experts.weight(0).data.data());
    EXPECT_EQ(tensorAt(seen[r], "experts.bias").data.data(), experts.bias(0)->data.data());
  });
  std::map<Ints, int> writers;  // weight chunk offset -> main replicas
  for (int r = 0; r < 4; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const int e = r % 2, g = r / 2;
    EXPECT_THAT(keysOf(seen[r]), ElementsAre("experts.weight", "experts.bias", "experts._extra_state"));
    const ShardedTensor& w = tensorAt(seen[r], "experts.weight");
    EXPECT_EQ(w.localShape, (Ints{2, 4}));
    EXPECT_EQ(w.globalShape, (Ints{2, 4, 4}));
    EXPECT_EQ(w.globalOffset, (Ints{e, 2 * g, 0}));
    EXPECT_EQ(w.axisFragmentations, (std::vector<int>{2, 2, 1}));
    EXPECT_EQ(w.prependAxisNum, 1);
    EXPECT_EQ(w.replicaId, (ReplicaId{0, 0, 0})) << "replica_id[2]: rank 0 of the singleton expert DP";
    EXPECT_FALSE(w.allowShapeMismatch);
    expectGtpPadding(w, 0, 1, 0);
    writers[w.globalOffset] += w.isMainReplica();
    // The bias is not sharded over EGTP: peer g folds into replica_id[1], so EGTP rank 0 writes it.
    const ShardedTensor& b = tensorAt(seen[r], "experts.bias");
    EXPECT_EQ(b.globalShape, (Ints{2, 4}));
    EXPECT_EQ(b.globalOffset, (Ints{e, 0}));
    EXPECT_EQ(b.replicaId, (ReplicaId{0, g, 0}));
    const ShardedObject& x = objectAt(seen[r], "experts._extra_state");
    EXPECT_EQ(x.globalShape, (Ints{2}));
    EXPECT_EQ(x.globalOffset, (Ints{e}));
    EXPECT_EQ(x.replicaId, (ReplicaId{0, g, 0}));
  }
  EXPECT_EQ(writers, (std::map<Ints, int>{{{0, 0, 0}, 1}, {{0, 2, 0}, 1}, {{1, 0, 0}, 1}, {{1, 2, 0}, 1}}));
  EXPECT_THAT(tilingViolations(seen), IsEmpty());
}

// SPEC 6 item 13 for experts: E = 3 local experts of two layers (sharded offset (0, l, 2), so the
// expert axis is 1), column K = 6 -> N = 20·ET and row K = 3·ET -> N = 20: TP-local dim 0 Dlog = 20
// in both modes, padded to a multiple of a·EG when a > 0. Every entry's metadata in closed form,
// and the main replicas tile every key exactly once.
struct ExpertGrid {
  int world, et, ep, eg, pad;  // ED = world / (ET·EP·EG); pad: gtpPadForAlignment
};

class ExpertTilingGrid : public ::testing::TestWithParam<ExpertGrid> {};

TEST_P(ExpertTilingGrid, MetadataAndTiling) {
  constexpr int kLayers = 2, kE = 3;
  constexpr std::int64_t kDlog = 20;
  const ExpertGrid grid = GetParam();
  const int ET = grid.et, EP = grid.ep, EG = grid.eg, a = grid.pad;
  const std::int64_t dPad = a > 0 && EG > 1 ? (kDlog + a * EG - 1) / (a * EG) * (a * EG) : kDlog;
  const std::int64_t S = dPad / EG, pad = dPad - kDlog;
  std::vector<ShardedStateDict> seen(grid.world);
  runExpertRanks(expertLayout(grid.world, ET, EP, EG), [&](RankContext& ctx, ProcessGroups& pg, LayerContext& lc) {
    const ModelParallelConfig config = expertConfig(ET, EP, EG, a);
    ShardedStateDict all;
    for (int l = 0; l < kLayers; ++l) {
      GroupedParallelLinear fc1(lc, config, 6, kDlog * ET, initMethodNormal(0.02),
                                expertOptions(kE, GroupedParallelMode::kColumn));
      GroupedParallelLinear fc2(lc, config, 3 * ET, kDlog, initMethodNormal(0.02),
                                expertOptions(kE, GroupedParallelMode::kRow));
      EXPECT_EQ(fc1.gtpBatched(), EG > 1);
      for (GroupedParallelLinear* layer : {&fc1, &fc2})
        for (ShardedEntry& e : shardedStateDict(*layer, layer == &fc1 ? "fc1." : "fc2.", {{0, l, kLayers}},
                                                pg.expertTp(), pg.ep(), &pg.expertDp()))
          all.push_back(std::move(e));
    }
    seen[ctx.comm.rank()] = std::move(all);
  });

  const std::int64_t experts = EP * kE;
  for (int r = 0; r < grid.world; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const int t = r % ET, e = r / ET % EP, g = r / (ET * EP) % EG, d = r / (ET * EP * EG);
    const ShardedStateDict& sd = seen[r];
    ASSERT_EQ(sd.size(), std::size_t(kLayers * 2 * kE * 3));
    const auto cw = entriesAt<ShardedTensor>(sd, "fc1.weight"), cb = entriesAt<ShardedTensor>(sd, "fc1.bias");
    const auto rw = entriesAt<ShardedTensor>(sd, "fc2.weight"), rb = entriesAt<ShardedTensor>(sd, "fc2.bias");
    const auto cx = entriesAt<ShardedObject>(sd, "fc1._extra_state");
    const auto rx = entriesAt<ShardedObject>(sd, "fc2._extra_state");
    for (const auto* list : {&cw, &cb, &rw, &rb}) ASSERT_EQ(list->size(), std::size_t(kLayers * kE));
    for (int l = 0; l < kLayers; ++l) {
      for (int i = 0; i < kE; ++i) {
        SCOPED_TRACE("layer " + std::to_string(l) + ", local expert " + std::to_string(i));
        const std::size_t k = std::size_t(l * kE + i);
        const std::int64_t x = std::int64_t(e) * kE + i;  // the global expert
        EXPECT_EQ(cw[k]->globalShape, (Ints{kLayers, experts, ET * EG * S, 6}));
        EXPECT_EQ(cw[k]->globalOffset, (Ints{l, x, (t * EG + g) * S, 0}));
        EXPECT_EQ(rw[k]->globalShape, (Ints{kLayers, experts, EG * S, 3 * ET}));
        EXPECT_EQ(rw[k]->globalOffset, (Ints{l, x, g * S, 3 * t}));
        for (const ShardedTensor* w : {cw[k], rw[k]}) {
          EXPECT_EQ(w->localShape[0], S) << w->key;
          EXPECT_EQ(w->prependAxisNum, 2) << w->key;
          EXPECT_EQ(w->replicaId, (ReplicaId{0, 0, d})) << w->key;
          EXPECT_EQ(w->allowShapeMismatch, EG > 1 && pad > 0) << w->key;
        }
        if (EG > 1) {
          expectGtpPadding(*cw[k], 0, ET, pad);
          expectGtpPadding(*rw[k], 1, ET, pad);
        }
        EXPECT_EQ(cb[k]->globalShape, (Ints{kLayers, experts, kDlog * ET}));
        EXPECT_EQ(cb[k]->globalOffset, (Ints{l, x, kDlog * t}));
        EXPECT_EQ(cb[k]->replicaId, (ReplicaId{0, g, d}));
        EXPECT_EQ(rb[k]->globalShape, (Ints{kLayers, experts, kDlog}));
        EXPECT_EQ(rb[k]->globalOffset, (Ints{l, x, 0}));
        EXPECT_EQ(rb[k]->replicaId, (ReplicaId{0, t * EG + g, d}));
        for (const ShardedObject* o : {cx[k], rx[k]}) {
          EXPECT_EQ(o->globalShape, (Ints{kLayers, experts})) << o->key;
          EXPECT_EQ(o->globalOffset, (Ints{l, x})) << o->key;
          EXPECT_EQ(o->replicaId, (ReplicaId{0, t * EG + g, d})) << o->key;
        }
      }
    }
  }
  EXPECT_THAT(tilingViolations(seen), IsEmpty());
}

INSTANTIATE_TEST_SUITE_P(Grids, ExpertTilingGrid,
                         ::testing::Values(ExpertGrid{8, 2, 2, 2, 16}, ExpertGrid{8, 1, 2, 2, 16},
                                           ExpertGrid{8, 2, 2, 2, 0}, ExpertGrid{16, 2, 2, 2, 16},
                                           ExpertGrid{16, 1, 2, 4, 16}, ExpertGrid{8, 1, 2, 4, 0},
                                           ExpertGrid{8, 2, 2, 1, 16}, ExpertGrid{6, 1, 3, 2, 16}),
                         [](const auto& info) {
                           const ExpertGrid& g = info.param;
                           return "W" + std::to_string(g.world) + "ET" + std::to_string(g.et) + "EP" +
                                  std::to_string(g.ep) + "EG" + std::to_string(g.eg) + "A" + std::to_string(g.pad);
                         });

// Without EGTP_remat (EG = 1): world 8, ET = 2, EP = 2, ED = 2 (expert rank t + 2e + 4d), E = 2,
// column 4 -> 8 and row 8 -> 4 with (4, 4) weights, layer 1 of 3. The plain expert-TP layout of
// SPEC 3.21 behind the layer and global-expert axes, replicas over expert DP.
TEST(ExpertCheckpoint, WithoutEgtpTheExpertTpLayoutGetsTheExpertAxis) {
  std::vector<std::pair<ShardedStateDict, ShardedStateDict>> seen(8);
  runExpertRanks(expertLayout(8, 2, 2, 1), [&](RankContext& ctx, ProcessGroups& pg, LayerContext& lc) {
    const ModelParallelConfig config = expertConfig(2, 2, 1, 16);
    GroupedParallelLinear col(lc, config, 4, 8, initMethodNormal(0.02), expertOptions(2, GroupedParallelMode::kColumn));
    GroupedParallelLinear row(lc, config, 8, 4, initMethodNormal(0.02), expertOptions(2, GroupedParallelMode::kRow));
    EXPECT_FALSE(isGtpShard(col.weight(0)));
    seen[ctx.comm.rank()] = {shardedStateDict(col, "col.", {{0, 1, 3}}, pg.expertTp(), pg.ep(), &pg.expertDp()),
                             shardedStateDict(row, "row.", {{0, 1, 3}}, pg.expertTp(), pg.ep(), &pg.expertDp())};
    EXPECT_EQ(entriesAt<ShardedTensor>(seen[ctx.comm.rank()].first, "col.weight")[1]->data.data(),
              col.weight(1).data.data());
  });
  std::map<std::pair<std::string, Ints>, int> writers;
  for (int r = 0; r < 8; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const int t = r % 2, e = r / 2 % 2, d = r / 4;
    const ShardedStateDict& col = seen[r].first;
    const ShardedStateDict& row = seen[r].second;
    EXPECT_THAT(keysOf(col), ElementsAre("col.weight", "col.bias", "col._extra_state", "col.weight", "col.bias",
                                         "col._extra_state"));
    for (int i = 0; i < 2; ++i) {
      SCOPED_TRACE("local expert " + std::to_string(i));
      const int x = 2 * e + i;
      const ShardedTensor& cw = *entriesAt<ShardedTensor>(col, "col.weight")[i];
      const ShardedTensor& rw = *entriesAt<ShardedTensor>(row, "row.weight")[i];
      const ShardedTensor& cb = *entriesAt<ShardedTensor>(col, "col.bias")[i];
      const ShardedTensor& rb = *entriesAt<ShardedTensor>(row, "row.bias")[i];
      EXPECT_EQ(cw.globalShape, (Ints{3, 4, 8, 4}));
      EXPECT_EQ(cw.globalOffset, (Ints{1, x, 4 * t, 0}));
      EXPECT_EQ(cw.axisFragmentations, (std::vector<int>{3, 4, 2, 1}));
      EXPECT_EQ(rw.globalShape, (Ints{3, 4, 4, 8}));
      EXPECT_EQ(rw.globalOffset, (Ints{1, x, 0, 4 * t}));
      for (const ShardedTensor* w : {&cw, &rw}) {
        EXPECT_EQ(w->localShape, (Ints{4, 4})) << w->key;
        EXPECT_EQ(w->prependAxisNum, 2) << w->key;
        EXPECT_EQ(w->replicaId, (ReplicaId{0, 0, d})) << w->key;
        EXPECT_FALSE(w->gtpPadding.has_value()) << w->key;
        EXPECT_FALSE(w->allowShapeMismatch) << w->key;
        if (w->isMainReplica()) ++writers[{w->key, w->globalOffset}];
      }
      EXPECT_EQ(cb.globalShape, (Ints{3, 4, 8}));
      EXPECT_EQ(cb.globalOffset, (Ints{1, x, 4 * t}));
      EXPECT_EQ(cb.replicaId, (ReplicaId{0, 0, d}));
      EXPECT_EQ(rb.globalShape, (Ints{3, 4, 4}));
      EXPECT_EQ(rb.globalOffset, (Ints{1, x, 0}));
      EXPECT_EQ(rb.replicaId, (ReplicaId{0, t, d}));
      for (const ShardedObject* o : {entriesAt<ShardedObject>(col, "col._extra_state")[i],
                                     entriesAt<ShardedObject>(row, "row._extra_state")[i]}) {
        EXPECT_EQ(o->globalShape, (Ints{3, 4})) << o->key;
        EXPECT_EQ(o->globalOffset, (Ints{1, x})) << o->key;
        EXPECT_EQ(o->replicaId, (ReplicaId{0, t, d})) << o->key;
      }
    }
  }
  EXPECT_EQ(writers.size(), 16u) << "2 weights × 4 experts × 2 TP slices";
  for (const auto& [chunk, n] : writers) EXPECT_EQ(n, 1) << chunk.first;
}

TEST(ExpertCheckpoint, RejectedInputsNameTheArgument) {
  const std::string where = "shardedStateDict(GroupedParallelLinear): ";
  // The grid of SPEC 4.11.5 item 8: ET = 1, EP = 2, EG = 2, ED = 1; dense D = 4.
  runExpertRanks(expertLayout(4, 1, 2, 2), [&](RankContext& ctx, ProcessGroups& pg, LayerContext& lc) {
    const int e = pg.ep().rank(), g = pg.expertGtpRemat().rank();
    const ModelParallelConfig config = expertConfig(1, 2, 2, 0);
    GroupedParallelLinear experts(lc, config, 4, 4, initMethodNormal(0.02));
    Collectives& et = pg.expertTp();
    Collectives& ep = pg.ep();
    EXPECT_THAT(testing::errorOf([&] { shardedStateDict(experts, "", {}, et, ep, nullptr); }),
                HasSubstr(where + "expertDp must be the expert replicate-DP group (pg_collection.expt_dp), got "
                                  "nullptr"));
    EXPECT_THAT(testing::errorOf([&] { shardedStateDict(experts, "", {}, ep, et, &pg.expertDp()); }),
                HasSubstr(where + "expertTp must be the layer's expert TP group (size 1, rank 0), got size 2, rank " +
                          std::to_string(e)));
    EXPECT_THAT(testing::errorOf([&] { shardedStateDict(experts, "", {}, et, pg.expertGtpRemat(), &pg.expertDp()); }),
                HasSubstr(where + "ep must be the expert-parallel group, got the layer's EGTP_remat group (size 2)"));
    // A replica id over the EGTP pair (the SPEC's "[0,2] / [1,3]") would leave EGTP rank 1's shard unwritten.
    EXPECT_THAT(testing::errorOf([&] { shardedStateDict(experts, "", {}, et, ep, &pg.expertGtpRemat()); }),
                HasSubstr(where + "expertDp must be the gtp_replica_group stamped on 'experts.weight0', the "
                                  "gtp-excluded expert DP (size 1, rank 0), got size 2, rank " + std::to_string(g)));
    // The expert axis goes after the given offsets: an offset already on it is refused.
    EXPECT_THAT(testing::errorOf([&] { shardedStateDict(experts, "e.", {{1, 0, 2}}, et, ep, &pg.expertDp()); }),
                HasSubstr("each axis may be sharded once for key 'e.weight', got axis 1 twice"));

    // Layers stamped with the wrong gtp_replica_group: the dense one, the EGTP group itself, none.
    LayerContext dense = lc;
    dense.gtpReplica = &pg.dpCp();
    GroupedParallelLinear denseStamped(dense, config, 4, 4, initMethodNormal(0.02));
    EXPECT_THAT(testing::errorOf([&] { shardedStateDict(denseStamped, "", {}, et, ep, &pg.expertDp()); }),
                HasSubstr(where + "expertDp must be the gtp_replica_group stamped on 'experts.weight0', the "
                                  "gtp-excluded expert DP (size 4, rank " + std::to_string(ctx.comm.rank()) +
                          "), got size 1, rank 0"));
    LayerContext pair = lc;
    pair.gtpReplica = &pg.expertGtpRemat();
    GroupedParallelLinear pairStamped(pair, config, 4, 4, initMethodNormal(0.02));
    EXPECT_THAT(testing::errorOf([&] { shardedStateDict(pairStamped, "", {}, et, ep, &pg.expertGtpRemat()); }),
                HasSubstr(where + "the gtp_replica_group stamped on 'experts.weight0' must be the gtp-excluded "
                                  "expert DP group, got its EGTP_remat group (size 2)"));
    LayerContext unstamped = lc;
    unstamped.gtpReplica = nullptr;
    GroupedParallelLinear noReplica(unstamped, config, 4, 4, initMethodNormal(0.02));
    EXPECT_THAT(testing::errorOf([&] { shardedStateDict(noReplica, "", {}, et, ep, &pg.expertDp()); }),
                HasSubstr(where + "GTP_remat shard 'experts.weight0' must carry a gtp_replica_group, got none"));
  });
  // ET = 2, EP = 2, no EGTP_remat: the expert TP group passed as ep.
  runExpertRanks(expertLayout(4, 2, 2, 1), [&](RankContext&, ProcessGroups& pg, LayerContext& lc) {
    GroupedParallelLinear experts(lc, expertConfig(2, 2, 1, 0), 4, 4, initMethodNormal(0.02));
    EXPECT_THAT(testing::errorOf([&] { shardedStateDict(experts, "", {}, pg.expertTp(), pg.expertTp(), &pg.expertDp()); }),
                HasSubstr(where + "ep must be the expert-parallel group, got the layer's expert TP group (size 2)"));
    EXPECT_EQ(testing::errorOf([&] { shardedStateDict(experts, "", {}, pg.expertTp(), pg.ep(), &pg.expertDp()); }),
              "no error");
  });
}

// ---- Rejected inputs ------------------------------------------------------------------------

TEST(Checkpoint, RejectedInputsNameTheArgument) {
  runRanks(2, [](RankContext& ctx) {
    Collectives& tp = ctx.comm;
    Collectives& dp = ctx.comm;
    Parameter gtp = param(ctx.compute, "shard", {2, 4});
    gtp.attrs.isGtpWeightRemat = true;
    EXPECT_THAT(testing::errorOf([&] { makeShardedTensorForCheckpoint(gtp, "k", std::nullopt, {}, tp, dp); }),
                HasSubstr("makeShardedTensorForCheckpoint: parameter 'shard' must not be a GTP_remat shard, got "
                          "is_gtp_weight_remat = True"));
    EXPECT_THAT(testing::errorOf([&] { makeTpShardedTensorForCheckpoint(gtp, "k", 0, std::nullopt, {}, tp, dp); }),
                HasSubstr("makeTpShardedTensorForCheckpoint: GTP_remat shard 'shard' must carry its group (stamped by "
                          "wrapGtp), got none"));
    EXPECT_THAT(testing::errorOf([&] { makeShardedTensorsForCheckpoint({{"weight", &gtp}}, "", {{"weight", 0}}, {}, tp, dp); }),
                HasSubstr("makeShardedTensorsForCheckpoint: GTP_remat shard 'shard' must carry its group"));
    gtp.attrs.group = &ctx.comm;  // a group but no gtp_replica_group: nobody can elect the writer
    EXPECT_THAT(testing::errorOf([&] { makeTpShardedTensorForCheckpoint(gtp, "k", 0, std::nullopt, {}, tp, dp); }),
                HasSubstr("gtpReplicaRank: GTP_remat shard 'shard' must carry a gtp_replica_group to elect its "
                          "checkpoint writer, got none"));
    gtp.attrs.group.reset();
    gtp.attrs.isGtpWeightRemat = false;  // present but false: an ordinary parameter
    EXPECT_EQ(testing::errorOf([&] { makeShardedTensorForCheckpoint(gtp, "k", std::nullopt, {}, tp, dp); }), "no error");

    Parameter empty;
    empty.name = "empty";
    EXPECT_THAT(testing::errorOf([&] { makeShardedTensorForCheckpoint(empty, "k", std::nullopt, {}, tp, dp); }),
                HasSubstr("parameter 'empty' for key 'k' must hold data, got an undefined tensor"));
    EXPECT_THAT(testing::errorOf([&] { makeTpShardedTensorForCheckpoint(gtp, "k", 2, std::nullopt, {}, tp, dp); }),
                HasSubstr("tpAxis for key 'k' must be an axis of fp32 (2, 4), got 2"));
    EXPECT_THAT(testing::errorOf([&] { makeShardedTensorsForCheckpoint({{"bias", nullptr}}, "", {}, {}, tp, dp); }),
                HasSubstr("state-dict entry 'bias' must have a parameter"));
    EXPECT_THAT(testing::errorOf([&] { makeShardedObjectForCheckpoint("e", {{1, 0, 2}}, std::nullopt, tp, dp); }),
                HasSubstr("sharded offsets for key 'e' must cover axes 0..0 once each, got (axis 1, chunk 0 of 2)"));
    EXPECT_THAT(testing::errorOf([&] { makeShardedObjectForCheckpoint("e", {{0, 3, 2}}, std::nullopt, tp, dp); }),
                HasSubstr("makeShardedObjectForCheckpoint: rank offset for key 'e'"));
    EXPECT_THAT(testing::errorOf([&] { makeShardedTensorForCheckpoint(gtp, "k", std::nullopt, {{0, 0, 0}}, tp, dp); }),
                HasSubstr("fromRankOffsets: rank offset for key 'k'"));

    const ModelParallelConfig config = configFor(2);
    ColumnParallelLinear col({ctx.compute, tp}, config, 4, 8, initMethodNormal(0.02));
    RowParallelLinear row({ctx.compute, tp}, config, 8, 4, initMethodNormal(0.02));
    EXPECT_THAT(testing::errorOf([&] { shardedStateDict(col, "", {}, tp, nullptr); }),
                HasSubstr("shardedStateDict(ColumnParallelLinear): metadata must provide dp_cp_group, got nullptr"));
    EXPECT_THAT(testing::errorOf([&] { shardedStateDict(row, "", {}, tp, nullptr); }),
                HasSubstr("shardedStateDict(RowParallelLinear): metadata must provide dp_cp_group, got nullptr"));
  });
}

}  // namespace
}  // namespace tpsim
