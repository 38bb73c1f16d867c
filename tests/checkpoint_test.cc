// Tests for core/checkpoint.h on the simulator: fromRankOffsets (SPEC 2.8), the full per-rank table
// of SPEC 3.21 (world 8, T = 2, D = 4), layer offsets prepended by sharded_offsets, checkpoint tiling
// (SPEC 6 item 13) on several (T, C, D) grids, groups built by split, and every rejected input.
#include "core/checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "core/init.h"
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

std::string message(const std::function<void()>& f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "no error";
}

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
    return message([&] { fromRankOffsets("layer.weight", data, offsets, {0}, prepend); });
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
      Chunk c;
      Ints global;
      if (const auto* st = std::get_if<ShardedTensor>(&e)) {
        c.offset = st->globalOffset;
        c.extent = Ints(st->prependAxisNum, 1);
        c.extent.insert(c.extent.end(), st->localShape.begin(), st->localShape.end());
        c.replica = st->replicaId;
        c.main = st->isMainReplica();
        global = st->globalShape;
      } else {
        const auto& so = std::get<ShardedObject>(e);
        c.offset = so.globalOffset;
        c.extent = Ints(so.globalShape.size(), 1);  // an object fills one cell of its grid
        c.replica = so.replicaId;
        c.main = so.isMainReplica();
        global = so.globalShape;
      }
      const std::string& key = shardedKey(e);
      if (!globalShape.count(key)) globalShape[key] = global;
      if (globalShape[key] != global) out.push_back(key + ": ranks disagree on the global shape");
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

// ---- Rejected inputs ------------------------------------------------------------------------

TEST(Checkpoint, RejectedInputsNameTheArgument) {
  runRanks(2, [](RankContext& ctx) {
    Collectives& tp = ctx.comm;
    Collectives& dp = ctx.comm;
    Parameter gtp = param(ctx.compute, "shard", {2, 4});
    gtp.attrs.isGtpWeightRemat = true;
    EXPECT_THAT(message([&] { makeShardedTensorForCheckpoint(gtp, "k", std::nullopt, {}, tp, dp); }),
                HasSubstr("makeShardedTensorForCheckpoint: parameter 'shard' must not be a GTP_remat shard, got "
                          "is_gtp_weight_remat = True"));
    EXPECT_THAT(message([&] { makeTpShardedTensorForCheckpoint(gtp, "k", 0, std::nullopt, {}, tp, dp); }),
                HasSubstr("makeTpShardedTensorForCheckpoint: parameter 'shard' must not be a GTP_remat shard"));
    EXPECT_THAT(message([&] { makeShardedTensorsForCheckpoint({{"weight", &gtp}}, "", {{"weight", 0}}, {}, tp, dp); }),
                HasSubstr("makeShardedTensorsForCheckpoint: entry 'weight' must not be a GTP_remat shard"));
    gtp.attrs.isGtpWeightRemat = false;  // present but false: an ordinary parameter
    EXPECT_EQ(message([&] { makeShardedTensorForCheckpoint(gtp, "k", std::nullopt, {}, tp, dp); }), "no error");

    Parameter empty;
    empty.name = "empty";
    EXPECT_THAT(message([&] { makeShardedTensorForCheckpoint(empty, "k", std::nullopt, {}, tp, dp); }),
                HasSubstr("parameter 'empty' for key 'k' must hold data, got an undefined tensor"));
    EXPECT_THAT(message([&] { makeTpShardedTensorForCheckpoint(gtp, "k", 2, std::nullopt, {}, tp, dp); }),
                HasSubstr("tpAxis for key 'k' must be an axis of fp32 (2, 4), got 2"));
    EXPECT_THAT(message([&] { makeShardedTensorsForCheckpoint({{"bias", nullptr}}, "", {}, {}, tp, dp); }),
                HasSubstr("state-dict entry 'bias' must have a parameter"));
    EXPECT_THAT(message([&] { makeShardedObjectForCheckpoint("e", {{1, 0, 2}}, std::nullopt, tp, dp); }),
                HasSubstr("sharded offsets for key 'e' must cover axes 0..0 once each, got (axis 1, chunk 0 of 2)"));
    EXPECT_THAT(message([&] { makeShardedObjectForCheckpoint("e", {{0, 3, 2}}, std::nullopt, tp, dp); }),
                HasSubstr("makeShardedObjectForCheckpoint: rank offset for key 'e'"));
    EXPECT_THAT(message([&] { makeShardedTensorForCheckpoint(gtp, "k", std::nullopt, {{0, 0, 0}}, tp, dp); }),
                HasSubstr("fromRankOffsets: rank offset for key 'k'"));

    const ModelParallelConfig config = configFor(2);
    ColumnParallelLinear col({ctx.compute, tp}, config, 4, 8, initMethodNormal(0.02));
    RowParallelLinear row({ctx.compute, tp}, config, 8, 4, initMethodNormal(0.02));
    EXPECT_THAT(message([&] { shardedStateDict(col, "", {}, tp, nullptr); }),
                HasSubstr("shardedStateDict(ColumnParallelLinear): metadata must provide dp_cp_group, got nullptr"));
    EXPECT_THAT(message([&] { shardedStateDict(row, "", {}, tp, nullptr); }),
                HasSubstr("shardedStateDict(RowParallelLinear): metadata must provide dp_cp_group, got nullptr"));
  });
}

}  // namespace
}  // namespace tpsim
