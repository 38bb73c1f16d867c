// The remaining invariants of SPEC 6 (the GTP_remat ones in gtp_props.cc, except the GTP rows of
// 12 and 13, which are here), each a law over random topologies (up to 64 ranks),
// shapes, dtypes and options, on every usable backend:
//   4  vocabulary ranges of t = 0..T−1 are disjoint and cover [0, V);
//   5  CPU-initialized shards interleave back to the master cast to params_dtype; the master does
//      not depend on T;
//   6  GPU-initialized shards are bitwise equal exactly when (seed, tp_rank) — (ep, etp) for expert
//      layers — are equal;
//   12 per TP × GTP_remat block a replicated param passes both duplicate filters on exactly one
//      rank, a TP-sharded one on the T ranks with g = 0, a GTP_remat shard on all T·G; and the
//      filters decide the same on the simulator and on the gpu backend;
//   13 the main replicas of every sharded_state_dict key tile its global shape exactly once, with
//      and without GTP_remat layers (padded or not);
//   14 deferred wgrads plus the drain == immediate fused accumulation, for any limit L >= 0 and
//      m >= 1 micro-batches (m = 1 included);
//   15 with fusion main_grad == Σ_i dY_iᵀ·X_i; without it the returned dW is each term;
//   16 the dummy wgrad has main_grad's shape and the input dtype, is zero on request, and flips
//      grad_added_to_main_grad;
//   17 dX, dW and db have the input dtype; the output has output_dtype when set, else the input's;
//   19 copying attributes twice == copying once, and never deletes one;
// plus the layer options `tpsim run` does not reach: a frozen weight or a supplied weight changes
// nothing but the weight gradient. Items 1-4 for whole layers are in layer_props.cc, item 3 in
// mapping_props.cc, item 20 in rank_grid_props.cc. Integer data keep every comparison exact.
#include <array>
#include <map>
#include <memory>
#include <mutex>
#include <set>

#include "core/attributes.h"
#include "core/checkpoint.h"
#include "core/embedding.h"
#include "core/gtp.h"
#include "core/init.h"
#include "core/layers.h"
#include "core/linear.h"
#include "core/process_groups.h"
#include "core/utils.h"
#include "props/backends.h"
#include "props/generators.h"
#include "props/harness.h"
#include "tests/sim_test_util.h"
#include "tools/lib/host_tensor.h"

namespace tpsim::props {
namespace {

using testing::tensorOf;
using testing::valuesOf;
using tools::HostTensor;
using Values = std::vector<double>;

constexpr int kCrossBackendFilterCases = 300;

// A parameter's values on one rank, collected from rank code.
struct PerRank {
  std::mutex mu;
  std::map<int, std::map<std::string, Values>> values;
  void put(int rank, const std::string& name, Values v) {
    std::lock_guard<std::mutex> lock(mu);
    values[rank][name] = std::move(v);
  }
};

// Rows [r0, r1) of a row-major (rows, cols) table.
Values rowsOf(const Values& m, std::int64_t cols, std::int64_t r0, std::int64_t r1) {
  return Values(m.begin() + r0 * cols, m.begin() + r1 * cols);
}
// Columns [c0, c1) of a row-major (·, cols) table.
Values columnsOf(const Values& m, std::int64_t cols, std::int64_t c0, std::int64_t c1) {
  Values out;
  for (std::size_t r = 0; r < m.size() / std::size_t(cols); ++r)
    for (std::int64_t c = c0; c < c1; ++c) out.push_back(m[r * cols + c]);
  return out;
}

// dYᵀ·X in double. dY: (M, N)  X: (M, K)  -> (N, K)
Values wgrad(const Values& dy, const Values& x, std::int64_t m, std::int64_t n, std::int64_t k) {
  Values out(std::size_t(n * k), 0.0);
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j)
      for (std::int64_t p = 0; p < k; ++p) out[j * k + p] += dy[i * n + j] * x[i * k + p];
  return out;
}

Values rounded(DType dtype, Values v) {
  for (double& x : v) x = roundTo(dtype, float(x));
  return v;
}

// ---- Item 4 -----------------------------------------------------------------------------------

TPSIM_PROP(VocabLaws, RangesOfAllRanksAreDisjointAndCoverTheVocabulary, 1000) {
  const int T = *genTp();
  const std::int64_t V = T * *pick<std::int64_t>({1, 2, 3, 5, 7, 64, 1000});
  std::int64_t next = 0;  // ranges come in rank order, each starting where the last ended
  for (int t = 0; t < T; ++t) {
    const VocabRange r = vocabRangeFromGlobalVocabSize(V, t, T);
    RC_ASSERT(r.first == next);
    RC_ASSERT(r.last - r.first == V / T);
    next = r.last;
  }
  RC_ASSERT(next == V);
}

// ---- Item 5 -----------------------------------------------------------------------------------

// The master (N, K) initMethodNormal draws from Generator(seed), as fp32 values.
Values masterOf(std::uint64_t seed, std::int64_t n, std::int64_t k) {
  Generator g(seed);
  std::vector<float> v(std::size_t(n * k));
  initMethodNormal(1.0)(g, v);
  return Values(v.begin(), v.end());
}

TPSIM_PROP(InitLaws, CpuInitShardsInterleaveBackToTheMasterWhateverT, 1500) {
  const int T = *genTp();
  const int stride = *pick<int>({1, 2, 3});
  const bool column = *flag();
  const DType dtype = *genFloatDtype();
  const std::int64_t split = std::int64_t(T) * stride, q = *pick<std::int64_t>({1, 2, 3});
  const std::int64_t n = column ? split * q : *pick<std::int64_t>({1, 2, 5});
  const std::int64_t k = column ? *pick<std::int64_t>({1, 2, 5}) : split * q;
  const std::int64_t vocab = T * *pick<std::int64_t>({1, 2, 3}), h = *pick<std::int64_t>({1, 3});
  const std::uint64_t seed = *genSeed();
  RC_LOG() << (column ? "column" : "row") << " T=" << T << " stride=" << stride << " " << dtypeName(dtype)
           << " N=" << n << " K=" << k << " V=" << vocab << " h=" << h << "\n";
  const Values master = masterOf(seed, n, k), embeddingMaster = masterOf(seed + 1, vocab, h);
  for (const Backend* b : usableBackends()) {
    PerRank seen;
    b->runRanks(T, [&](RankContext& ctx) {
      const int t = ctx.comm.rank();
      ModelParallelConfig config;
      config.tensorModelParallelSize = T;
      config.useCpuInitialization = true;
      config.paramsDtype = dtype;
      Generator g(seed), ge(seed + 1);
      if (column) {
        ColumnParallelOptions o;
        o.stride = stride;
        o.keepMasterWeightForTest = true;
        ColumnParallelLinear layer({ctx.compute, ctx.comm, nullptr, &g}, config, k, n, initMethodNormal(1.0), o);
        seen.put(t, "shard", valuesOf(ctx.compute, layer.weight()->data));
        seen.put(t, "master", valuesOf(ctx.compute, layer.masterWeight()));
        seen.put(t, "masterIsFp32", {double(layer.masterWeight().dtype() == DType::kFloat32)});
      } else {
        RowParallelOptions o;
        o.stride = stride;
        o.inputIsParallel = true;  // stride > 1 needs it (the layer's own input scatter is contiguous)
        o.keepMasterWeightForTest = true;
        RowParallelLinear layer({ctx.compute, ctx.comm, nullptr, &g}, config, k, n, initMethodNormal(1.0), o);
        seen.put(t, "shard", valuesOf(ctx.compute, layer.weight().data));
        seen.put(t, "master", valuesOf(ctx.compute, layer.masterWeight()));
        seen.put(t, "masterIsFp32", {double(layer.masterWeight().dtype() == DType::kFloat32)});
      }
      VocabParallelEmbedding emb({ctx.compute, ctx.comm, nullptr, &ge}, config, vocab, h, initMethodNormal(1.0));
      seen.put(t, "embedding", valuesOf(ctx.compute, emb.weight().data));
    });
    // Column's master stays fp32; Row's is already in params_dtype (SPEC 3.11).
    const Values castMaster = rounded(dtype, master);
    for (int t = 0; t < T; ++t) {
      auto& mine = seen.values[t];
      RC_ASSERT(mine["master"] == (column ? master : castMaster));
      RC_ASSERT(mine["masterIsFp32"] == Values{column || dtype == DType::kFloat32 ? 1.0 : 0.0});
      // Chunk j of rank t is master chunk t + j·T along the partition dim.
      const std::int64_t chunk = (column ? n : k) / split;
      Values expect;
      for (int j = 0; j < stride; ++j) {
        const std::int64_t first = (t + std::int64_t(j) * T) * chunk;
        if (column) {
          const Values rows = rowsOf(castMaster, k, first, first + chunk);
          expect.insert(expect.end(), rows.begin(), rows.end());
        }
      }
      if (!column) {  // interleave along columns: row by row, chunk by chunk
        for (std::int64_t r = 0; r < n; ++r)
          for (int j = 0; j < stride; ++j)
            for (std::int64_t c = 0; c < chunk; ++c) expect.push_back(castMaster[r * k + (t + j * T) * chunk + c]);
      }
      RC_ASSERT(mine["shard"] == expect);
      RC_ASSERT(mine["embedding"] == rowsOf(rounded(dtype, embeddingMaster), h, t * vocab / T, (t + 1) * vocab / T));
    }
  }
}

// ---- Item 6 -----------------------------------------------------------------------------------

TPSIM_PROP(InitLaws, GpuInitSharesExactlyAlongEqualSeedAndTpRank, 1000) {
  const Topology topo = *genTopology(64);
  const DType dtype = *pick<DType>({DType::kFloat32, DType::kBFloat16});
  const std::uint64_t seed = *genSeed();
  const std::int64_t k = *pick<std::int64_t>({4, 5, 8});
  const ParallelLayout layout(sizesOf(topo));
  // Megatron's seeds collide when 100·ep_rank + etp_rank − tp_rank = 1694 (SPEC 8 item 4), and the
  // tracker then rejects the add (ErrorLaws.CollidingRngSeedsAreRejectedNamingTheSeed): not a case
  // of this law.
  bool collides = false;
  for (int tp = 0; tp < topo.tp; ++tp)
    for (int ep = 0; ep < topo.ep; ++ep)
      for (int etp = 0; etp < topo.expertTp; ++etp) collides = collides || 100 * ep + etp - tp == 1694;
  RC_PRE(!collides);
  for (const Backend* b : usableBackends()) {
    PerRank seen;
    std::vector<std::array<int, 3>> ranks(std::size_t(layout.world()));  // (tp, ep, etp)
    b->runRanks(layout.world(), [&](RankContext& ctx) {
      ProcessGroups groups(ctx.comm, layout);
      const int r = ctx.comm.rank();
      RngTracker tracker;
      RankSeeds s;
      s.tpRank = groups.tp().rank();
      s.epRank = groups.ep().rank();
      s.etpRank = groups.expertTp().rank();
      ranks[std::size_t(r)] = {s.tpRank, s.epRank, s.etpRank};
      modelParallelManualSeed(tracker, seed, s);
      ModelParallelConfig config;
      config.tensorModelParallelSize = topo.tp;
      config.expertTensorParallelSize = topo.expertTp;
      config.expertModelParallelSize = topo.ep;
      config.paramsDtype = dtype;
      ColumnParallelLinear dense({ctx.compute, groups.tp(), &tracker}, config, k, 2 * topo.tp, initMethodNormal(1.0));
      RowParallelLinear row({ctx.compute, groups.tp(), &tracker}, config, 2 * topo.tp, k, initMethodNormal(1.0));
      ColumnParallelOptions eo;
      eo.isExpert = true;
      ColumnParallelLinear expert({ctx.compute, groups.expertTp(), &tracker}, config, k, 2 * topo.expertTp,
                                  initMethodNormal(1.0), eo);
      Values denseValues = valuesOf(ctx.compute, dense.weight()->data);
      const Values rowValues = valuesOf(ctx.compute, row.weight().data);
      denseValues.insert(denseValues.end(), rowValues.begin(), rowValues.end());
      seen.put(r, "dense", denseValues);
      seen.put(r, "expert", valuesOf(ctx.compute, expert.weight()->data));
    });
    for (int r = 0; r < layout.world(); ++r)
      for (int q = r + 1; q < layout.world(); ++q) {
        const auto &a = ranks[std::size_t(r)], &c = ranks[std::size_t(q)];
        const bool sameTp = a[0] == c[0], sameExpert = a[1] == c[1] && a[2] == c[2];
        RC_ASSERT((seen.values[r]["dense"] == seen.values[q]["dense"]) == sameTp);
        RC_ASSERT((seen.values[r]["expert"] == seen.values[q]["expert"]) == sameExpert);
      }
  }
}

// ---- Item 12 ----------------------------------------------------------------------------------

// Per TP × GTP_remat block (expert-TP × EGTP block for expert params), on (T, G, C, P, D, ET, E, EG)
// topologies: a GTP shard passes on all T·G ranks of its block, a TP-sharded non-GTP param on the
// T ranks with g = 0, a replicated param on exactly one. With G = EG = 1 (GTP off) that is the
// per-TP-block law, and passing the size-1 GTP groups or none makes no difference.
// What the duplicate filters decide for each rank's parameters, and the facts that decide it.
struct FilterSeen {
  std::map<std::string, bool> pass, sharded, expert, gtpShard;
  int tpBlock = 0, expertBlock = 0;
};

// Dense and expert column, row (and an embedding) on every rank of topo on backend b; the size-1
// GTP groups are passed when gtpGroupsPassed, else none.
std::vector<FilterSeen> duplicateFilterDecisions(const Backend& b, const Topology& topo, bool gtpGroupsPassed) {
  const ParallelLayout layout(sizesOf(topo));
  std::vector<FilterSeen> seen(std::size_t(layout.world()));
  b.runRanks(layout.world(), [&](RankContext& ctx) {
    ProcessGroups groups(ctx.comm, layout);
    const int r = ctx.comm.rank();
    ModelParallelConfig config;
    config.tensorModelParallelSize = topo.tp;
    config.expertTensorParallelSize = topo.expertTp;
    config.expertModelParallelSize = topo.ep;
    config.gtpRematSize = topo.gtp;
    config.expertGtpRematSize = topo.expertGtp;
    config.performInitialization = false;
    const InitMethod init = initMethodNormal(1.0);
    Collectives* gtp = gtpGroupsPassed ? &groups.gtpRemat() : nullptr;
    Collectives* egtp = gtpGroupsPassed ? &groups.expertGtpRemat() : nullptr;
    GtpGradReducer reducer(ctx.compute, {});
    // Dense layers resolve the GTP_remat group, expert layers EGTP_remat (SPEC 4.8).
    const LayerContext dense{ctx.compute, groups.tp(), nullptr, nullptr, gtp, &groups.dpCp(), &reducer};
    const LayerContext expert{ctx.compute, groups.expertTp(), nullptr, nullptr, egtp, &groups.expertDp(), &reducer};
    ColumnParallelLinear col(dense, config, 3, 2 * topo.tp, init);
    RowParallelLinear row(dense, config, 2 * topo.tp, 3, init);
    VocabParallelEmbedding emb(dense, config, 4 * topo.tp, 2, init);
    ColumnParallelOptions eco;
    eco.isExpert = true;
    eco.name = "expert_column";
    RowParallelOptions ero;
    ero.isExpert = true;
    ero.skipBiasAdd = true;
    ero.name = "expert_row";
    ColumnParallelLinear ecol(expert, config, 3, 2 * topo.expertTp, init, eco);
    RowParallelLinear erow(expert, config, 2 * topo.expertTp, 3, init, ero);
    FilterSeen& s = seen[std::size_t(r)];
    s.tpBlock = layout.dense().groupIndex("tp-gtp_remat", r);
    s.expertBlock = layout.expert().groupIndex("tp-gtp_remat", r);
    for (const Parameter* p : {col.weight(), col.bias(), &row.weight(), row.bias(), &emb.weight(), ecol.weight(),
                               ecol.bias(), &erow.weight(), erow.bias()}) {
      s.pass[p->name] =
          paramIsNotTensorParallelDuplicate(*p, &groups.tp(), &groups.expertTp()) && paramIsNotGtpDuplicate(*p, gtp, egtp);
      s.sharded[p->name] = p->attrs.tensorModelParallel.value_or(false);
      s.expert[p->name] = p->attrs.allreduce == false;
      s.gtpShard[p->name] = isGtpShard(*p);
    }
  });
  return seen;
}

// Per TP × GTP_remat block (expert-TP × EGTP block for expert params), on (T, G, C, P, D, ET, E, EG)
// topologies: a GTP shard passes on all T·G ranks of its block, a TP-sharded non-GTP param on the
// T ranks with g = 0, a replicated param on exactly one. With G = EG = 1 (GTP off) that is the
// per-TP-block law, and passing the size-1 GTP groups or none makes no difference.
TPSIM_PROP(DuplicateLaws, PerTpBlockReplicatedParamsPassOnceAndShardsOnEveryRank, 1000) {
  const Topology topo = *genTopology(64, /*withGtp=*/true);
  // The size-1 GTP groups, or nullptr (GTP off): the same. G > 1 needs the real groups.
  const bool gtpGroupsPassed = topo.gtp > 1 || topo.expertGtp > 1 || *flag();
  RC_TAG(topo.gtp > 1 || topo.expertGtp > 1 ? "GTP_remat" : "no GTP_remat");
  for (const Backend* b : usableBackends()) {
    const std::vector<FilterSeen> seen = duplicateFilterDecisions(*b, topo, gtpGroupsPassed);
    // Count passes per block: TP × GTP_remat blocks for dense params, expert-TP × EGTP blocks for
    // expert params (allreduce = false).
    std::map<std::pair<std::string, int>, int> passes, members;
    for (const FilterSeen& s : seen)
      for (const auto& [name, pass] : s.pass) {
        const int block = s.expert.at(name) ? s.expertBlock : s.tpBlock;
        passes[{name, block}] += pass;
        ++members[{name, block}];
      }
    for (const auto& [key, count] : passes) {
      const bool sharded = seen[0].sharded.at(key.first), gtpShard = seen[0].gtpShard.at(key.first);
      const int blockGtp = seen[0].expert.at(key.first) ? topo.expertGtp : topo.gtp;
      const int expected = gtpShard ? members[key] : sharded ? members[key] / blockGtp : 1;
      RC_LOG() << key.first << (gtpShard ? " (GTP shard)" : sharded ? " (TP-sharded)" : " (replicated)") << " block "
               << key.second << ": " << count << " of " << members[key] << " pass, expected " << expected << "\n";
      RC_ASSERT(count == expected);
    }
  }
}

// The duplicate filters pass the same parameters on the same ranks on the simulator and on the gpu
// backend: the same topologies, GTP_remat and expert groups included.
TEST(CrossBackend, DuplicateFiltersAgreeOnSimAndGpu) {
  TPSIM_REQUIRE_BACKEND("gpu");
  const Backend& sim = backendNamed("sim");
  checkProperty(kCrossBackendFilterCases, [&] {
    const Topology topo = *genTopology(64, /*withGtp=*/true);
    const bool gtpGroupsPassed = topo.gtp > 1 || topo.expertGtp > 1 || *flag();
    const std::vector<FilterSeen> want = duplicateFilterDecisions(sim, topo, gtpGroupsPassed);
    const std::vector<FilterSeen> got = duplicateFilterDecisions(other, topo, gtpGroupsPassed);
    for (std::size_t r = 0; r < want.size(); ++r)
      for (const auto& [name, pass] : want[r].pass) {
        RC_LOG() << "rank " << r << " " << name << ": sim " << (pass ? "passes" : "filters") << "\n";
        RC_ASSERT(got[r].pass.at(name) == pass);
      }
  });
}

// ---- Item 13 ----------------------------------------------------------------------------------

using Ints = std::vector<std::int64_t>;

// Every way the entries of all ranks fail to tile their global shapes; empty when they tile.
std::vector<std::string> tilingViolations(const std::vector<ShardedStateDict>& ranks) {
  struct Chunk {
    Ints offset, extent;
    ReplicaId replica;
    bool main;
  };
  std::map<std::string, Ints> globalShape;
  std::map<std::string, std::vector<Chunk>> chunks;
  std::vector<std::string> out;
  for (const ShardedStateDict& sd : ranks)
    for (const ShardedEntry& e : sd) {
      const auto* st = std::get_if<ShardedTensor>(&e);
      const auto* so = std::get_if<ShardedObject>(&e);
      Ints extent;
      if (st) {
        extent.assign(std::size_t(st->prependAxisNum), 1);
        extent.insert(extent.end(), st->localShape.begin(), st->localShape.end());
      } else {
        extent.assign(so->globalShape.size(), 1);  // an object fills one cell of its grid
      }
      const Ints& global = st ? st->globalShape : so->globalShape;
      const std::string& key = shardedKey(e);
      const auto known = globalShape.emplace(key, global).first;
      if (known->second != global) out.push_back(key + ": ranks disagree on the global shape");
      chunks[key].push_back(Chunk{st ? st->globalOffset : so->globalOffset, std::move(extent),
                                  st ? st->replicaId : so->replicaId, st ? st->isMainReplica() : so->isMainReplica()});
    }
  for (const auto& [key, list] : chunks) {
    const Ints& global = globalShape[key];
    std::int64_t cells = 1;
    for (std::int64_t g : global) cells *= g;
    std::vector<int> covered(std::size_t(cells), 0);
    std::map<std::pair<Ints, Ints>, std::set<ReplicaId>> replicas;
    for (const Chunk& c : list) {
      if (!replicas[{c.offset, c.extent}].insert(c.replica).second)
        out.push_back(key + ": two ranks hold the same chunk with the same replica id");
      bool inside = c.offset.size() == global.size() && c.extent.size() == global.size();
      for (std::size_t a = 0; inside && a < global.size(); ++a)
        inside = c.offset[a] >= 0 && c.offset[a] + c.extent[a] <= global[a];
      if (!inside) {
        out.push_back(key + ": a chunk lies outside the global shape");
        continue;
      }
      if (!c.main) continue;
      Ints i(global.size(), 0);  // a mixed-radix counter over the chunk's cells
      for (bool more = true; more;) {
        std::int64_t flat = 0;
        for (std::size_t a = 0; a < global.size(); ++a) flat = flat * global[a] + c.offset[a] + i[a];
        ++covered[std::size_t(flat)];
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
      if (covered[std::size_t(cell)] != 1)
        out.push_back(key + ": cell " + std::to_string(cell) + " is written " +
                      std::to_string(covered[std::size_t(cell)]) + " times");
  }
  return out;
}

// On (T, G, C, P, D) topologies, with GTP_remat layers (padded or not) when G > 1: the passed
// dp_cp group is the gtp-inclusive one, which is what a state dict without GTP shards needs (the
// column without its weight); with a shard, replica ids come from the stamped gtp-excluded group.
TPSIM_PROP(CheckpointLaws, MainReplicasTileEveryKeyOnceAndReplicaIdsDiffer, 1000) {
  const Topology topo = *genTopology(64, /*withGtp=*/true);
  const int layersPerStage = *pick<int>({1, 2, 3});
  const bool columnBias = *flag(), rowBias = *flag(), columnWeight = !*flag();
  std::int64_t q = *pick<std::int64_t>({1, 2, 3}), other = *pick<std::int64_t>({1, 2, 5});
  if (topo.gtp > 1 && *flag()) q *= topo.gtp, other *= topo.gtp;  // every Dlog divisible by G
  // pad_for_alignment: 0 only when the TP-local dim 0 of every weight (q, other) divides by G.
  const int padForAlignment = q % topo.gtp == 0 && other % topo.gtp == 0 ? *pick<int>({16, 0, 1, 32})
                                                                         : *pick<int>({16, 1, 32});
  const ParallelLayout layout(sizesOf(topo));
  RC_TAG(topo.gtp == 1 ? "no GTP_remat" : padForAlignment == 0 ? "GTP_remat unpadded" : "GTP_remat padded");
  RC_TAG(topo.world() > 32 ? "world 33-64" : topo.world() > 16 ? "world 17-32" : topo.world() > 8 ? "world 9-16"
                                                                                                    : "world 1-8");
  RC_LOG() << "layers per stage " << layersPerStage << ", column bias " << columnBias << ", row bias " << rowBias
           << ", column weight " << columnWeight << ", q " << q << ", other " << other << ", a " << padForAlignment
           << "\n";
  for (const Backend* b : usableBackends()) {
    std::vector<ShardedStateDict> seen(std::size_t(layout.world()));
    b->runRanks(layout.world(), [&](RankContext& ctx) {
      ProcessGroups groups(ctx.comm, layout);
      const int r = ctx.comm.rank();
      const RankGrid& grid = layout.dense();
      const auto axes = grid.axes();
      const int pp = grid.coordinates(r)[std::size_t(std::find(axes.begin(), axes.end(), "pp") - axes.begin())];
      ModelParallelConfig config;
      config.tensorModelParallelSize = topo.tp;
      config.gtpRematSize = topo.gtp;
      config.gtpPadForAlignment = padForAlignment;
      config.performInitialization = false;
      const InitMethod init = initMethodNormal(1.0);
      GtpGradReducer reducer(ctx.compute, {});
      // wrapGtp stamps the gtp-excluded DP-CP group as gtp_replica_group (SPEC 4.11.1).
      const LayerContext lc{ctx.compute, groups.tp(), nullptr, nullptr, &groups.gtpRemat(), &groups.dpCp(), &reducer};
      ShardedStateDict all;
      auto append = [&](ShardedStateDict sd) {
        for (ShardedEntry& e : sd) all.push_back(std::move(e));
      };
      for (int i = 0; i < layersPerStage; ++i) {
        const std::vector<RankOffset> layer{{0, pp * layersPerStage + i, topo.pp * layersPerStage}};
        ColumnParallelOptions co;
        co.bias = columnBias;
        co.skipWeightParamAllocation = !columnWeight;
        RowParallelOptions ro;
        ro.bias = rowBias;
        ColumnParallelLinear col(lc, config, other, q * topo.tp, init, co);
        RowParallelLinear row(lc, config, q * topo.tp, other, init, ro);
        append(shardedStateDict(col, "decoder.layers.fc1.", layer, groups.tp(), &groups.dpCpGtp()));
        append(shardedStateDict(row, "decoder.layers.fc2.", layer, groups.tp(), &groups.dpCpGtp()));
      }
      if (pp == 0) {  // the first stage holds the embedding
        VocabParallelEmbedding emb(lc, config, q * topo.tp, other, init);
        append(shardedStateDict(emb, "embedding.word_embeddings.", {}, groups.tp(), &groups.dpCpGtp()));
      }
      seen[std::size_t(r)] = std::move(all);
    });
    const std::vector<std::string> violations = tilingViolations(seen);
    for (const std::string& v : violations) RC_LOG() << v << "\n";
    RC_ASSERT(violations.empty());
  }
}

// ---- Items 14-17: the linear functions under fusion, deferral and output_dtype ----------------

// One micro-batch of a column-style case on rank t: X (s or s/T, b, K) and dY (s, b, N/T).
struct MicroBatch {
  Values x, dy;
};

// Exact data for m micro-batches of a column layer with T ranks: the full X (s, b, K) and dY
// (s, b, N) of each, small enough that every wgrad sum over all micro-batches is exact in fp32.
struct ColumnData {
  std::int64_t s, b, k, n;
  std::vector<Values> x, dy;  // per micro-batch, full
};

ColumnData columnData(int T, int microBatches, std::uint64_t seed, int amplitude = 3) {
  ColumnData d{2 * T, 2, 3, 2 * T, {}, {}};
  for (int i = 0; i < microBatches; ++i) {
    d.x.push_back(seededIntegers(seed + 2 * i, d.s * d.b * d.k, amplitude));
    d.dy.push_back(seededIntegers(seed + 2 * i + 1, d.s * d.b * d.n, amplitude));
  }
  return d;
}

TPSIM_PROP(LinearLaws, DeferredWgradsPlusTheDrainEqualImmediateFusion, 2500) {
  const int T = *pick<int>({1, 2, 3, 4, 8});
  const bool sp = T > 1 && *flag();
  const int limit = *pick<int>({0, 1, 2, 3});
  const int microBatches = *pick<int>({1, 2, 3, 4});
  const DType dtype = *genFloatDtype();
  const ColumnData d = columnData(T, microBatches, *genSeed());
  RC_LOG() << "T=" << T << " sp=" << sp << " L=" << limit << " m=" << microBatches << " " << dtypeName(dtype) << "\n";
  const std::int64_t nl = d.n / T, sl = d.s / T;
  for (const Backend* b : usableBackends()) {
    PerRank seen;
    b->runRanks(T, [&](RankContext& ctx) {
      const int t = ctx.comm.rank();
      auto run = [&](bool defer) {
        ModelParallelConfig config;
        config.tensorModelParallelSize = T;
        config.sequenceParallel = sp;
        config.performInitialization = false;
        config.paramsDtype = dtype;
        config.gradientAccumulationFusion = true;
        config.deferEmbeddingWgradCompute = defer;
        config.pipelineModelParallelSize = 2;
        config.wgradDeferralLimit = limit;
        std::vector<Tensor> activations, gradOutputs;
        ColumnParallelOptions o;
        o.bias = false;
        o.embeddingActivationBuffer = &activations;
        o.gradOutputBuffer = &gradOutputs;
        ColumnParallelLinear layer({ctx.compute, ctx.comm}, config, d.k, d.n, initMethodNormal(1.0), o);
        layer.weight()->mainGrad = ctx.compute.zeros(layer.weight()->data.shape(), DType::kFloat32);
        for (int i = 0; i < microBatches; ++i) {
          const Values x = sp ? rowsOf(d.x[i], d.b * d.k, t * sl, (t + 1) * sl) : d.x[i];
          Tensor xt = tensorOf(ctx.compute, dtype, x, Shape{sp ? sl : d.s, d.b, d.k});
          layer.forward(xt);
          layer.backward(tensorOf(ctx.compute, dtype, columnsOf(d.dy[i], d.n, t * nl, (t + 1) * nl),
                                  Shape{d.s, d.b, nl}));
        }
        drainEmbeddingWgrad(ctx.compute, ctx.comm, layer.sequenceParallel(), activations, gradOutputs,
                            *layer.weight());
        seen.put(t, defer ? "buffersEmpty" : "unused", {double(activations.empty() && gradOutputs.empty())});
        return valuesOf(ctx.compute, layer.weight()->mainGrad);
      };
      seen.put(t, "deferred", run(true));
      seen.put(t, "immediate", run(false));
    });
    for (int t = 0; t < T; ++t) {
      RC_ASSERT(seen.values[t]["deferred"] == seen.values[t]["immediate"]);
      RC_ASSERT(seen.values[t]["buffersEmpty"] == Values{1.0});
    }
  }
}

TPSIM_PROP(LinearLaws, FusedMainGradIsTheSumOfMicroBatchWgradsAndUnfusedDwIsEachTerm, 2500) {
  const int T = *pick<int>({1, 2, 3, 4, 8});
  const bool sp = T > 1 && *flag();
  const int microBatches = *pick<int>({1, 2, 3});
  const DType dtype = *genFloatDtype();
  const DType mainGradDtype = dtype == DType::kBFloat16 ? *pick<DType>({DType::kFloat32, DType::kBFloat16})
                                                        : DType::kFloat32;
  // A bf16 main_grad holds every partial sum exactly while it stays within 256: with |x|, |dy| <= 1
  // the sums have at most m·s·b <= 3·16·2 = 96 unit terms.
  const ColumnData d = columnData(T, microBatches, *genSeed(),
                                  mainGradDtype == DType::kBFloat16 ? 1 : 3);
  RC_LOG() << "T=" << T << " sp=" << sp << " m=" << microBatches << " " << dtypeName(dtype) << " main_grad "
           << dtypeName(mainGradDtype) << "\n";
  const std::int64_t nl = d.n / T, sl = d.s / T, m = d.s * d.b;
  Values sum(std::size_t(d.n * d.k), 0.0);
  for (int i = 0; i < microBatches; ++i) {
    const Values term = wgrad(d.dy[i], d.x[i], m, d.n, d.k);
    for (std::size_t j = 0; j < sum.size(); ++j) sum[j] += term[j];
  }
  for (const Backend* b : usableBackends()) {
    PerRank seen;
    b->runRanks(T, [&](RankContext& ctx) {
      const int t = ctx.comm.rank();
      Parameter fused, plain;
      fused.name = "fused.weight";
      plain.name = "plain.weight";
      const Values w = seededIntegers(7, nl * d.k, 2);
      fused.data = tensorOf(ctx.compute, dtype, w, Shape{nl, d.k});
      plain.data = tensorOf(ctx.compute, dtype, w, Shape{nl, d.k});
      fused.mainGrad = ctx.compute.zeros({nl, d.k}, mainGradDtype);
      LinearOptions fo;
      fo.gradientAccumulationFusion = true;
      fo.sequenceParallel = sp;
      fo.allreduceDgrad = !sp && T > 1;
      LinearOptions po = fo;
      po.gradientAccumulationFusion = false;
      for (int i = 0; i < microBatches; ++i) {
        const Values x = sp ? rowsOf(d.x[i], d.b * d.k, t * sl, (t + 1) * sl) : d.x[i];
        Tensor xt = tensorOf(ctx.compute, dtype, x, Shape{sp ? sl : d.s, d.b, d.k});
        Tensor dy = tensorOf(ctx.compute, dtype, columnsOf(d.dy[i], d.n, t * nl, (t + 1) * nl), Shape{d.s, d.b, nl});
        LinearWithGradAccumulation f(ctx.compute, ctx.comm, fo), p(ctx.compute, ctx.comm, po);
        f.forward(xt, fused, nullptr);
        p.forward(xt, plain, nullptr);
        const LinearGrads fg = f.backward(dy), pg = p.backward(dy);
        seen.put(t, "fusedDwIsNone" + std::to_string(i), {double(!fg.dW.defined())});
        seen.put(t, "plainDw" + std::to_string(i), valuesOf(ctx.compute, pg.dW));
        seen.put(t, "plainDwIsInputDtype" + std::to_string(i), {double(pg.dW.dtype() == dtype && !pg.dWIsDummy)});
      }
      seen.put(t, "mainGrad", valuesOf(ctx.compute, fused.mainGrad));
    });
    for (int t = 0; t < T; ++t) {
      auto& mine = seen.values[t];
      RC_ASSERT(mine["mainGrad"] == rowsOf(sum, d.k, t * nl, (t + 1) * nl));
      for (int i = 0; i < microBatches; ++i) {
        const Values term = rounded(dtype, wgrad(d.dy[i], d.x[i], m, d.n, d.k));
        RC_ASSERT(mine["fusedDwIsNone" + std::to_string(i)] == Values{1.0});  // no grad_added_to_main_grad
        RC_ASSERT(mine["plainDw" + std::to_string(i)] == rowsOf(term, d.k, t * nl, (t + 1) * nl));
        RC_ASSERT(mine["plainDwIsInputDtype" + std::to_string(i)] == Values{1.0});
      }
    }
  }
}

TPSIM_PROP(LinearLaws, DummyWgradHasMainGradShapeAndInputDtypeAndZerosOnRequest, 1500) {
  const int T = *pick<int>({1, 2, 4});
  const DType dtype = *genFloatDtype();
  const DType mainGradDtype = is16Bit(dtype) ? *pick<DType>({DType::kFloat32, dtype}) : DType::kFloat32;
  const bool hasAttribute = *flag();
  const std::optional<bool> zeroOut = *pick<std::optional<bool>>({std::nullopt, false, true});
  const std::optional<bool> before = *pick<std::optional<bool>>({false, true});
  const std::int64_t n = *pick<std::int64_t>({1, 2, 3}), k = *pick<std::int64_t>({1, 2, 5});
  RC_LOG() << "T=" << T << " " << dtypeName(dtype) << " main_grad " << dtypeName(mainGradDtype) << " attribute "
           << hasAttribute << "\n";
  for (const Backend* b : usableBackends()) {
    std::mutex mu;
    std::vector<std::string> wrong;
    b->runRanks(T, [&](RankContext& ctx) {
      Parameter w;
      w.name = "weight";
      w.data = tensorOf(ctx.compute, dtype, seededIntegers(3, n * k, 2), Shape{n, k});
      w.mainGrad = ctx.compute.zeros({n, k}, mainGradDtype);
      if (hasAttribute) w.attrs.gradAddedToMainGrad = before;
      w.attrs.zeroOutWgrad = zeroOut;
      LinearOptions o;
      o.gradientAccumulationFusion = true;
      o.allreduceDgrad = T > 1;
      LinearWithGradAccumulation linear(ctx.compute, ctx.comm, o);
      Tensor x = tensorOf(ctx.compute, dtype, seededIntegers(4, 3 * k, 2), Shape{3, k});
      linear.forward(x, w, nullptr);
      const LinearGrads g = linear.backward(tensorOf(ctx.compute, dtype, seededIntegers(5, 3 * n, 2), Shape{3, n}));
      std::vector<std::string> bad;
      if (hasAttribute) {
        if (!g.dW.defined() || !g.dWIsDummy) bad.push_back("no dummy wgrad although grad_added_to_main_grad exists");
        else {
          if (g.dW.shape() != w.mainGrad.shape()) bad.push_back("dummy wgrad shape " + g.dW.shape().str());
          if (g.dW.dtype() != dtype) bad.push_back(std::string("dummy wgrad dtype ") + dtypeName(g.dW.dtype()));
          if (zeroOut.value_or(false) && valuesOf(ctx.compute, g.dW) != Values(std::size_t(n * k), 0.0))
            bad.push_back("zero_out_wgrad but the dummy wgrad is not zero");
        }
        if (w.attrs.gradAddedToMainGrad != std::optional<bool>(true)) bad.push_back("grad_added_to_main_grad not True");
      } else {
        if (g.dW.defined()) bad.push_back("a weight gradient without grad_added_to_main_grad");
        if (w.attrs.gradAddedToMainGrad.has_value()) bad.push_back("grad_added_to_main_grad appeared");
      }
      std::lock_guard<std::mutex> lock(mu);
      wrong.insert(wrong.end(), bad.begin(), bad.end());
    });
    if (!wrong.empty()) RC_FAIL(wrong.front());
  }
}

TPSIM_PROP(LinearLaws, GradientsHaveTheInputDtypeAndTheOutputHasOutputDtype, 1500) {
  const int T = *pick<int>({1, 2, 3, 4});
  const DType dtype = *genFloatDtype();
  const std::optional<DType> outputDtype =
      *pick<std::optional<DType>>({std::nullopt, DType::kFloat32, DType::kBFloat16, DType::kFloat16});
  const bool bias = *flag();
  const bool gather = *flag();
  RC_LOG() << "T=" << T << " " << dtypeName(dtype) << " output_dtype "
           << (outputDtype ? dtypeName(*outputDtype) : "None") << " bias " << bias << " gather " << gather << "\n";
  for (const Backend* b : usableBackends()) {
    std::mutex mu;
    std::vector<std::string> wrong;
    b->runRanks(T, [&](RankContext& ctx) {
      ModelParallelConfig config;
      config.tensorModelParallelSize = T;
      config.performInitialization = false;
      config.paramsDtype = dtype;
      ColumnParallelOptions o;
      o.bias = bias;
      o.outputDtype = outputDtype;
      o.gatherOutput = gather;
      ColumnParallelLinear col({ctx.compute, ctx.comm}, config, 3, 2 * T, initMethodNormal(1.0), o);
      RowParallelOptions ro;
      ro.bias = bias;
      RowParallelLinear row({ctx.compute, ctx.comm}, config, 2 * T, 3, initMethodNormal(1.0), ro);
      Tensor x = tensorOf(ctx.compute, dtype, seededIntegers(1, 4 * 3, 2), Shape{2, 2, 3});
      Tensor rx = tensorOf(ctx.compute, dtype, seededIntegers(2, 4 * 2 * T, 2), Shape{2, 2, 2 * T});
      LayerOutput y = col.forward(x);  // (2, 2, 2) or gathered (2, 2, 2T)
      Tensor dy = ctx.compute.zeros(y.output.shape(), y.output.dtype());  // the output's gradient
      Tensor dx = col.backward(dy);  // (2, 2, 3)
      LayerOutput ry = row.forward(rx);  // (2, 2, 3)
      Tensor rdx = row.backward(ctx.compute.zeros(ry.output.shape(), ry.output.dtype()));  // (2, 2, 2T)
      std::vector<std::string> bad;
      auto expect = [&](const char* what, DType got, DType want) {
        if (got != want) bad.push_back(std::string(what) + " is " + dtypeName(got) + ", expected " + dtypeName(want));
      };
      expect("column output", y.output.dtype(), outputDtype.value_or(dtype));
      expect("column dX", dx.dtype(), dtype);
      expect("column weight.grad", col.weight()->grad.dtype(), dtype);
      if (bias) expect("column bias.grad", col.bias()->grad.dtype(), dtype);
      expect("row output", ry.output.dtype(), dtype);
      expect("row dX", rdx.dtype(), dtype);
      expect("row weight.grad", row.weight().grad.dtype(), dtype);
      if (bias) expect("row bias.grad", row.bias()->grad.dtype(), dtype);
      std::lock_guard<std::mutex> lock(mu);
      wrong.insert(wrong.end(), bad.begin(), bad.end());
    });
    if (!wrong.empty()) RC_FAIL(wrong.front());
  }
}

// ---- Layer options `tpsim run` does not reach --------------------------------------------------

// A frozen weight (requires_grad = False) or a weight supplied to forward (skip_weight_param_
// allocation) gives the same output, dX and bias gradient as the layer's own trainable weight;
// the frozen one gets no weight gradient, the supplied one gets the trainable one's.
TPSIM_PROP(LayerOptionLaws, FrozenOrSuppliedWeightsChangeOnlyTheWeightGradient, 2500) {
  const int T = *pick<int>({1, 2, 3, 4});
  const bool sp = T > 1 && *flag(), row = *flag(), bias = *flag();
  const DType dtype = *genFloatDtype();
  const std::uint64_t seed = *genSeed();
  RC_LOG() << (row ? "row" : "column") << " T=" << T << " sp=" << sp << " bias=" << bias << " " << dtypeName(dtype)
           << "\n";
  const std::int64_t s = 2 * T, bsz = 2, k = row ? 2 * T : 3, n = row ? 3 : 2 * T;
  for (const Backend* b : usableBackends()) {
    PerRank seen;
    b->runRanks(T, [&](RankContext& ctx) {
      const int t = ctx.comm.rank();
      ModelParallelConfig config;
      config.tensorModelParallelSize = T;
      config.sequenceParallel = sp;
      config.performInitialization = false;
      config.paramsDtype = dtype;
      const std::int64_t sl = sp ? s / T : s, kl = row ? k / T : k, nl = row ? n : n / T;
      const Values w = seededIntegers(seed, (row ? n : nl) * (row ? kl : k), 2);
      // Row: x (s, b, K/T), dY (s/T or s, b, N). Column: x (s/T or s, b, K), dY (s, b, N/T).
      const Shape xShape{row ? s : sl, bsz, kl}, dyShape{row ? sl : s, bsz, nl};
      const Values x = seededIntegers(seed + 1 + (sp || row ? t : 0), xShape.numel(), 2);
      const Values dy = seededIntegers(seed + 100 + (row && !sp ? 0 : t), dyShape.numel(), 2);
      for (const char* mode : {"own", "frozen", "supplied"}) {
        const std::string m = mode;
        Tensor out, dx;
        Values wgradValues, bgradValues;
        if (row) {
          RowParallelOptions o;
          o.bias = bias;
          o.inputIsParallel = true;
          RowParallelLinear layer({ctx.compute, ctx.comm}, config, k, n, initMethodNormal(1.0), o);
          ctx.compute.copy(tensorOf(ctx.compute, dtype, w, layer.weight().data.shape()), layer.weight().data);
          if (bias) ctx.compute.fill(layer.bias()->data, 1.0);
          if (m == "supplied") continue;  // Row has no supplied-weight path
          layer.weight().requiresGrad = m != "frozen";
          Tensor xt = tensorOf(ctx.compute, dtype, x, xShape);
          out = layer.forward(xt).output;
          dx = layer.backward(tensorOf(ctx.compute, dtype, dy, dyShape));
          if (layer.weight().hasGrad()) wgradValues = valuesOf(ctx.compute, layer.weight().grad);
          if (bias) bgradValues = valuesOf(ctx.compute, layer.bias()->grad);
        } else {
          ColumnParallelOptions o;
          o.bias = bias;
          o.skipWeightParamAllocation = m == "supplied";
          ColumnParallelLinear layer({ctx.compute, ctx.comm}, config, k, n, initMethodNormal(1.0), o);
          Parameter supplied;
          supplied.name = "supplied.weight";
          supplied.data = tensorOf(ctx.compute, dtype, w, Shape{nl, k});
          Parameter* weight = m == "supplied" ? &supplied : layer.weight();
          if (m != "supplied") ctx.compute.copy(supplied.data, layer.weight()->data);
          weight->requiresGrad = m != "frozen";
          if (bias) ctx.compute.fill(layer.bias()->data, 1.0);
          Tensor xt = tensorOf(ctx.compute, dtype, x, xShape);
          out = layer.forward(xt, m == "supplied" ? &supplied : nullptr).output;
          dx = layer.backward(tensorOf(ctx.compute, dtype, dy, dyShape));
          if (weight->hasGrad()) wgradValues = valuesOf(ctx.compute, weight->grad);
          if (bias) bgradValues = valuesOf(ctx.compute, layer.bias()->grad);
        }
        seen.put(t, m + ".out", valuesOf(ctx.compute, out));
        seen.put(t, m + ".dx", valuesOf(ctx.compute, dx));
        seen.put(t, m + ".wgrad", wgradValues);
        seen.put(t, m + ".bgrad", bgradValues);
      }
    });
    for (int t = 0; t < T; ++t) {
      auto& v = seen.values[t];
      RC_ASSERT(!v["own.wgrad"].empty());
      RC_ASSERT(v["frozen.out"] == v["own.out"]);
      RC_ASSERT(v["frozen.dx"] == v["own.dx"]);
      RC_ASSERT(v["frozen.bgrad"] == v["own.bgrad"]);
      RC_ASSERT(v["frozen.wgrad"].empty());
      if (!row) {
        RC_ASSERT(v["supplied.out"] == v["own.out"]);
        RC_ASSERT(v["supplied.dx"] == v["own.dx"]);
        RC_ASSERT(v["supplied.bgrad"] == v["own.bgrad"]);
        RC_ASSERT(v["supplied.wgrad"] == v["own.wgrad"]);
      }
    }
  }
}

// ---- Item 19 ----------------------------------------------------------------------------------

// Random attributes: each of the fifteen present or absent, with small values. The two group
// attributes are drawn as a choice (0 absent, 1 or 2 one of two groups) and set by withGroups.
struct AttributeDraw {
  ParamAttributes attrs;
  int group = 0, replicaGroup = 0;
};

rc::Gen<AttributeDraw> genAttributes() {
  return rc::gen::exec([] {
    AttributeDraw d;
    ParamAttributes& a = d.attrs;
    auto maybeBool = [] { return *pick<std::optional<bool>>({std::nullopt, false, true}); };
    a.expertTp = maybeBool();
    a.isQkv = maybeBool();
    switch (*pickIndex(3)) {  // absent, present-with-None, or split shapes
      case 1: a.qkvSplitShapes.emplace(); break;
      case 2: a.qkvSplitShapes.emplace(std::vector<std::int64_t>{2, 1, 1}); break;
      default: break;
    }
    a.tensorModelParallel = maybeBool();
    a.partitionDim = *pick<std::optional<int>>({std::nullopt, -1, 0, 1});
    a.partitionStride = *pick<std::optional<int>>({std::nullopt, 1, 2});
    a.allreduce = maybeBool();
    a.sequenceParallel = maybeBool();
    a.gradAddedToMainGrad = maybeBool();
    a.zeroOutWgrad = maybeBool();
    a.isGtpWeightRemat = maybeBool();
    d.group = *pickIndex(3);
    a.padLength = *pick<std::optional<int>>({std::nullopt, 0, 3});
    d.replicaGroup = *pickIndex(3);
    a.gtpPadZeros = *pick<std::optional<std::int64_t>>({std::nullopt, 0, 5});
    return d;
  });
}

ParamAttributes withGroups(const AttributeDraw& d, Collectives* a, Collectives* b) {
  ParamAttributes out = d.attrs;
  if (d.group) out.group = d.group == 1 ? a : b;
  if (d.replicaGroup) out.gtpReplicaGroup = d.replicaGroup == 1 ? a : b;
  return out;
}

// Which attributes are present, and their values, as comparable text.
std::vector<std::string> describe(const ParamAttributes& a) {
  auto opt = [](const auto& o, auto show) { return o ? "=" + show(*o) : std::string("absent"); };
  auto b = [](bool v) { return std::string(v ? "True" : "False"); };
  auto i = [](auto v) { return std::to_string(v); };
  auto p = [](Collectives* g) { return std::to_string(reinterpret_cast<std::uintptr_t>(g)); };
  auto shapes = [](const std::optional<std::vector<std::int64_t>>& v) {
    std::string s = v ? "[" : "None";
    if (v)
      for (std::int64_t x : *v) s += std::to_string(x) + ",";
    return v ? s + "]" : s;
  };
  return {"expert_tp" + opt(a.expertTp, b),
          "is_qkv" + opt(a.isQkv, b),
          "qkv_split_shapes" + opt(a.qkvSplitShapes, shapes),
          "tensor_model_parallel" + opt(a.tensorModelParallel, b),
          "partition_dim" + opt(a.partitionDim, i),
          "partition_stride" + opt(a.partitionStride, i),
          "allreduce" + opt(a.allreduce, b),
          "sequence_parallel" + opt(a.sequenceParallel, b),
          "grad_added_to_main_grad" + opt(a.gradAddedToMainGrad, b),
          "zero_out_wgrad" + opt(a.zeroOutWgrad, b),
          "is_gtp_weight_remat" + opt(a.isGtpWeightRemat, b),
          "group" + opt(a.group, p),
          "pad_length" + opt(a.padLength, i),
          "gtp_replica_group" + opt(a.gtpReplicaGroup, p),
          "gtp_pad_zeros" + opt(a.gtpPadZeros, i)};
}

void showValue(const AttributeDraw& d, std::ostream& os) {
  for (const std::string& a : describe(d.attrs))
    if (a.find("absent") == std::string::npos && a.rfind("group", 0) != 0 && a.rfind("gtp_replica_group", 0) != 0)
      os << a << " ";
  os << "group=" << (d.group ? "g" + std::to_string(d.group) : "absent")
     << " gtp_replica_group=" << (d.replicaGroup ? "g" + std::to_string(d.replicaGroup) : "absent");
}

TPSIM_PROP(AttributeLaws, CopyingTwiceEqualsCopyingOnceAndNeverDeletes, 3000) {
  const bool tpCopy = *flag(), gtpCopy = *flag();
  const AttributeDraw sourceDraw = *genAttributes(), destinationDraw = *genAttributes();
  std::vector<std::string> original, once, twice;
  // Real groups for the two group attributes: a world of one rank and a split of it.
  backendNamed("sim").runRanks(1, [&](RankContext& ctx) {
    std::unique_ptr<Collectives> other = ctx.comm.split(0, 0, "other");
    const ParamAttributes source = withGroups(sourceDraw, &ctx.comm, other.get());
    ParamAttributes attrs = withGroups(destinationDraw, &ctx.comm, other.get());
    auto copy = [&] {
      if (tpCopy) copyTensorModelParallelAttributes(attrs, source);
      if (gtpCopy) copyGtpAttributes(attrs, source);
    };
    original = describe(attrs);
    copy();
    once = describe(attrs);
    copy();
    twice = describe(attrs);
  });
  RC_ASSERT(twice == once);
  for (std::size_t i = 0; i < original.size(); ++i)
    if (original[i].find("absent") == std::string::npos) RC_ASSERT(once[i].find("absent") == std::string::npos);
}

}  // namespace
}  // namespace tpsim::props
