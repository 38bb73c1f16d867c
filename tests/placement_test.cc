// Placement: the blocks each rank holds tile every tensor of a layer exactly once over its sharded
// axes; a parameter's blocks are where the layers' own initialization and GTP_remat wrapping put the
// master weight's elements (pad rows zero); pad counts equal gtpLocalPadZeroCount; the duplicate
// filters' choice equals the core filters'.
#include "core/placement.h"

#include <gtest/gtest.h>

#include <map>
#include <mutex>
#include <optional>

#include "core/attributes.h"
#include "core/grouped_linear.h"
#include "core/gtp.h"
#include "core/process_groups.h"
#include "sim_test_util.h"

namespace tpsim {
namespace {

using testing::runRanks;
using testing::valuesOf;

enum class Kind { kColumn, kRow, kEmbedding };

struct Case {
  Kind kind;
  int T, G, stride, pad;
  bool sp = false, option = false;  // option: gather_output / input_is_parallel / reduce_scatter_embeddings
  std::string str() const {
    const char* names[] = {"column", "row", "embedding"};
    return detail::concat(names[int(kind)], " T=", T, " G=", G, " stride=", stride, " pad=", pad, " sp=", sp,
                          " option=", option);
  }
};

// Every element of every tensor's layout is held by exactly the ranks its replicated and partial
// axes repeat it over: copies = (TP not a shard ? T : 1) x (GTP_remat not a shard ? G : 1).
void expectTiles(const TensorPlacement& p, const std::string& where) {
  const auto shape = p.layoutShape();
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  std::vector<int> cover(std::size_t(n), 0);
  for (int t = 0; t < p.tp.size; ++t)
    for (int g = 0; g < p.gtp.size; ++g)
      for (const Block& b : blocksOf(p, t, g)) {
        std::vector<std::int64_t> i(shape.size());
        for (std::size_t d = 0; d < shape.size(); ++d) i[d] = b.layout[d].begin;
        bool empty = false;
        for (const Range& r : b.layout) empty = empty || r.size() <= 0;
        ASSERT_FALSE(empty) << where << " " << p.name << ": empty block";
        while (true) {
          std::int64_t flat = 0;
          for (std::size_t d = 0; d < shape.size(); ++d) {
            ASSERT_LT(i[d], shape[d]) << where << " " << p.name;
            flat = flat * shape[d] + i[d];
          }
          ++cover[flat];
          int d = int(shape.size()) - 1;
          while (d >= 0 && ++i[d] == b.layout[d].end) i[d] = b.layout[d].begin, --d;
          if (d < 0) break;
        }
      }
  const int copies = (p.tp.kind == AxisKind::kShard ? 1 : p.tp.size) * (p.gtp.kind == AxisKind::kShard ? 1 : p.gtp.size);
  for (std::int64_t k = 0; k < n; ++k) ASSERT_EQ(cover[k], copies) << where << " " << p.name << " at layout flat " << k;
  // holdersOf inverts blocksOf; at the layout's last element: one holder per copy, inside its tensor.
  std::vector<std::int64_t> last;
  for (auto d : shape) last.push_back(d - 1);
  const auto holders = holdersOf(p, last);
  ASSERT_EQ(int(holders.size()), copies) << where << " " << p.name;
  for (const Holder& h : holders) {
    const auto local = localShape(p, h.t, h.g);
    for (std::size_t d = 0; d < local.size(); ++d) EXPECT_LT(h.local[d], local[d]) << where << " " << p.name;
  }
}

// Builds the layer on T x G ranks with CPU initialization from a master holding flat index + 1, and
// checks each rank's parameters against the placement. Returns rank (0, 0)'s placements.
std::vector<TensorPlacement> check(const Case& c) {
  ParallelSizes sizes;
  sizes.world = c.T * c.G;
  sizes.tp = c.T;
  sizes.gtpRemat = c.G;
  const ParallelLayout layout(sizes);
  std::mutex mu;
  std::vector<TensorPlacement> first;
  const std::int64_t s = 4, b = 2 * c.G, k = 8 * c.T * c.stride, n = 4 * c.T * c.stride;
  const InitMethod indexed = [](Generator&, std::vector<float>& m) {
    for (std::size_t i = 0; i < m.size(); ++i) m[i] = float(i + 1);
  };
  runRanks(c.T * c.G, [&](RankContext& ctx) {
    ProcessGroups pg(ctx.comm, layout);
    GtpGradReducer reducer(ctx.compute, {});
    Generator gen(1);
    LayerContext lc{ctx.compute, pg.tp(), nullptr, &gen, &pg.gtpRemat(), &pg.dpCp(), &reducer};
    ModelParallelConfig mp;
    mp.tensorModelParallelSize = c.T;
    mp.gtpRematSize = c.G;
    mp.gtpPadForAlignment = c.pad;
    mp.useCpuInitialization = true;
    mp.sequenceParallel = c.sp;
    std::optional<ColumnParallelLinear> col;
    std::optional<RowParallelLinear> row;
    std::optional<VocabParallelEmbedding> emb;
    std::vector<TensorPlacement> ps;
    std::map<std::string, Parameter*> params;
    if (c.kind == Kind::kColumn) {
      ColumnParallelOptions o;
      o.stride = c.stride;
      o.gatherOutput = c.option;
      col.emplace(lc, mp, k, n, indexed, o);
      ps = layerPlacements(*col, s, b);
      params = {{"weight", col->weight()}, {"bias", col->bias()}};
    } else if (c.kind == Kind::kRow) {
      RowParallelOptions o;
      o.stride = c.stride;
      o.inputIsParallel = c.option || c.sp || c.stride > 1;
      row.emplace(lc, mp, k, n, indexed, o);
      ps = layerPlacements(*row, s, b);
      params = {{"weight", &row->weight()}, {"bias", row->bias()}};
    } else {
      VocabParallelEmbeddingOptions o;
      o.reduceScatterEmbeddings = c.option;
      mp.sequenceParallel = false;
      emb.emplace(lc, mp, n, k, indexed, o);
      ps = layerPlacements(*emb, s, b);
      params = {{"weight", &emb->weight()}};
    }
    const int t = pg.tp().rank(), g = pg.gtpRemat().rank();
    for (const TensorPlacement& p : ps) {
      auto it = params.find(p.name);
      if (it == params.end()) continue;
      const Parameter& param = *it->second;
      std::vector<std::int64_t> want;
      for (int d = 0; d < param.data.shape().rank(); ++d) want.push_back(param.data.shape()[d]);
      EXPECT_EQ(localShape(p, t, g), want) << c.str() << " " << p.name;
      EXPECT_EQ(padZeroCount(p, t, g), gtpLocalPadZeroCount(param, 0, param.data.shape().numel())) << c.str() << " " << p.name;
      EXPECT_EQ(p.countedOn(t, g),
                paramIsNotTensorParallelDuplicate(param, &pg.tp()) && paramIsNotGtpDuplicate(param, &pg.gtpRemat(), nullptr))
          << c.str() << " " << p.name;
      if (p.name != "weight") continue;  // biases start at zero; the weight holds the indexed master
      const std::vector<double> v = valuesOf(ctx.compute, param.data);
      const std::int64_t localCols = want[1], cols = p.shape[1];
      for (const Block& blk : blocksOf(p, t, g))
        for (std::int64_t i = 0; i < blk.layout[0].size(); ++i)
          for (std::int64_t j = 0; j < blk.layout[1].size(); ++j) {
            const double got = v[std::size_t((blk.local[0] + i) * localCols + blk.local[1] + j)];
            const double expect = blk.pad ? 0.0 : double((blk.global[0].begin + i) * cols + blk.global[1].begin + j + 1);
            ASSERT_EQ(got, expect) << c.str() << " rank (" << t << ", " << g << ") local (" << blk.local[0] + i << ", "
                                   << blk.local[1] + j << ")";
          }
    }
    std::lock_guard<std::mutex> lock(mu);
    if (t == 0 && g == 0) first = ps;
  });
  for (const TensorPlacement& p : first) expectTiles(p, c.str());
  return first;
}

TEST(Placement, BlocksTileEveryTensorAndMatchTheLayersShards) {
  for (Kind kind : {Kind::kColumn, Kind::kRow, Kind::kEmbedding})
    for (int T : {1, 2, 4})
      for (int G : {1, 2})
        for (int stride : {1, 2})
          for (int pad : {0, 16}) {
            if (stride > 1 && kind == Kind::kEmbedding) continue;
            for (bool option : {false, true}) check({kind, T, G, stride, pad, false, option});
            if (T > 1 && kind != Kind::kEmbedding) check({kind, T, G, stride, pad, true, false});
          }
}

TEST(Placement, ColumnWeightPadRowsFollowEachTpSlice) {
  // SPEC 4.11.4: N = 16, T = 2, G = 2, a = 16: TP-local 8 rows padded by 24; real rows at [0, 8)
  // and [32, 40) of a 64-row layout.
  TensorPlacement p;
  p.name = "weight";
  p.shape = {16, 4};
  p.tp = {AxisKind::kShard, 2, 0, 1};
  p.gtp = {AxisKind::kShard, 2, 0, 1, 24};
  EXPECT_EQ(p.layoutShape(), (std::vector<std::int64_t>{64, 4}));
  const auto b10 = blocksOf(p, 1, 0);
  ASSERT_EQ(b10.size(), 2u);
  EXPECT_FALSE(b10[0].pad);
  EXPECT_EQ(b10[0].global[0].begin, 8);
  EXPECT_EQ(b10[0].layout[0].begin, 32);
  EXPECT_TRUE(b10[1].pad);
  EXPECT_EQ(b10[1].layout[0].begin, 40);
  EXPECT_EQ(b10[1].layout[0].end, 48);
  EXPECT_EQ(padZeroCount(p, 1, 0), 8 * 4);
  EXPECT_EQ(padZeroCount(p, 1, 1), 16 * 4);  // spill: GTP rank 1 is all padding
  EXPECT_EQ(localShape(p, 0, 1), (std::vector<std::int64_t>{16, 4}));
  // Layout row 33 is global row 9, TP rank 1's second row, on GTP_remat rank 0; row 20 is padding
  // of TP slice 0, row 4 of GTP_remat rank 1's shard.
  const auto row33 = holdersOf(p, {33, 2});
  ASSERT_EQ(row33.size(), 1u);
  EXPECT_EQ(row33[0].t, 1);
  EXPECT_EQ(row33[0].g, 0);
  EXPECT_EQ(row33[0].local, (std::vector<std::int64_t>{1, 2}));
  EXPECT_FALSE(row33[0].pad);
  const auto row20 = holdersOf(p, {20, 0});
  ASSERT_EQ(row20.size(), 1u);
  EXPECT_EQ(row20[0].t, 0);
  EXPECT_EQ(row20[0].g, 1);
  EXPECT_EQ(row20[0].local, (std::vector<std::int64_t>{4, 0}));
  EXPECT_TRUE(row20[0].pad);
}

// The experts' placements against GroupedParallelLinear's own shards: every expert weight initialized
// from the indexed master sits where its blocks say (EGTP_remat pad rows zero), and the activations
// and gradients tile their tensors.
TEST(Placement, ExpertWeightsMatchTheGroupedLayersShards) {
  constexpr int E = 3;
  const InitMethod indexed = [](Generator&, std::vector<float>& m) {
    for (std::size_t i = 0; i < m.size(); ++i) m[i] = float(i + 1);
  };
  for (GroupedParallelMode mode : {GroupedParallelMode::kColumn, GroupedParallelMode::kRow})
    for (int T : {1, 2})
      for (int G : {1, 2})
        for (int pad : {0, 16}) {
          const std::string where = detail::concat(mode == GroupedParallelMode::kColumn ? "column" : "row", " T=", T,
                                                   " G=", G, " pad=", pad);
          ParallelSizes sizes;
          sizes.world = T * G;
          sizes.tp = T;
          sizes.gtpRemat = G;
          const ParallelLayout layout(sizes);
          std::mutex mu;
          std::vector<TensorPlacement> first;
          const std::int64_t K = 8 * T, N = 12 * T, tokens = 6 * G;
          runRanks(T * G, [&](RankContext& ctx) {
            ProcessGroups pg(ctx.comm, layout);
            GtpGradReducer reducer(ctx.compute, {});
            Generator gen(1);
            ModelParallelConfig mp;
            mp.tensorModelParallelSize = T;
            mp.gtpRematSize = G;
            mp.gtpPadForAlignment = pad;
            mp.useCpuInitialization = true;
            GroupedLinearOptions o;
            o.numGemms = E;
            o.parallelMode = mode;
            o.isExpert = true;
            GroupedParallelLinear layer({ctx.compute, pg.tp(), nullptr, &gen, &pg.gtpRemat(), nullptr, &reducer}, mp, K, N,
                                        indexed, o);
            const std::vector<TensorPlacement> ps = layerPlacements(layer, tokens, "experts.");
            const int t = pg.tp().rank(), g = pg.gtpRemat().rank();
            int weights = 0;
            for (const TensorPlacement& p : ps) {
              if (p.role != TensorRole::kParameter) continue;
              const bool isWeight = p.name.rfind("experts.weight", 0) == 0;
              const int i = std::stoi(p.name.substr(isWeight ? 14 : 12));
              const Parameter& param = isWeight ? layer.weight(i) : *layer.bias(i);
              std::vector<std::int64_t> want;
              for (int d = 0; d < param.data.shape().rank(); ++d) want.push_back(param.data.shape()[d]);
              EXPECT_EQ(localShape(p, t, g), want) << where << " " << p.name;
              EXPECT_EQ(padZeroCount(p, t, g), gtpLocalPadZeroCount(param, 0, param.data.shape().numel())) << where;
              // The layer's TP and GTP_remat groups are the expert ones, whichever the filters pick.
              EXPECT_EQ(p.countedOn(t, g), paramIsNotTensorParallelDuplicate(param, &pg.tp(), &pg.tp()) &&
                                               paramIsNotGtpDuplicate(param, &pg.gtpRemat(), &pg.gtpRemat()))
                  << where << " " << p.name;
              if (!isWeight) continue;
              ++weights;
              const std::vector<double> v = valuesOf(ctx.compute, param.data);
              for (const Block& blk : blocksOf(p, t, g))
                for (std::int64_t r = 0; r < blk.layout[0].size(); ++r)
                  for (std::int64_t j = 0; j < blk.layout[1].size(); ++j) {
                    const double got = v[std::size_t((blk.local[0] + r) * want[1] + blk.local[1] + j)];
                    const double expect = blk.pad ? 0.0 : double((blk.global[0].begin + r) * K + blk.global[1].begin + j + 1);
                    ASSERT_EQ(got, expect) << where << " " << p.name << " rank (" << t << ", " << g << ")";
                  }
            }
            EXPECT_EQ(weights, E) << where;
            std::lock_guard<std::mutex> lock(mu);
            if (t == 0 && g == 0) first = ps;
          });
          for (const TensorPlacement& p : first) expectTiles(p, where);
          // Column: dX is partial over TP; row: y is. Both are the token dispatcher's to sum.
          for (const TensorPlacement& p : first) {
            if (p.tp.kind == AxisKind::kPartial) {
              EXPECT_EQ(p.name, mode == GroupedParallelMode::kColumn ? "experts.input.grad" : "experts.output") << where;
            }
          }
        }
}

TEST(Placement, PartialSumsAndReplicatedTensorsAreFullCopies) {
  const auto ps = check({Kind::kRow, 2, 2, 1, 16, true, false});
  std::map<std::string, TensorPlacement> byName;
  for (const auto& p : ps) byName[p.name] = p;
  ASSERT_TRUE(byName.count("output.partial"));
  EXPECT_EQ(byName["output.partial"].tp.kind, AxisKind::kPartial);
  EXPECT_EQ(byName["output.partial"].reduction, "reduce-scatter over TP");
  EXPECT_EQ(byName["output"].tp.kind, AxisKind::kShard);  // sequence parallel: dim 0 over TP
  EXPECT_EQ(byName["bias"].tp.kind, AxisKind::kReplicate);
  EXPECT_TRUE(byName["bias"].countedOn(0, 0));
  EXPECT_FALSE(byName["bias"].countedOn(1, 0));
  EXPECT_FALSE(byName["bias"].countedOn(0, 1));
  EXPECT_TRUE(byName["weight"].countedOn(1, 1));
}

}  // namespace
}  // namespace tpsim
