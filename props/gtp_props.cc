// The GTP_remat laws of SPEC 6, on every usable backend, over random G (1..8), T, padding
// (pad_for_alignment a in {0 when divisible, 1, 16, 32}), shapes (dim 0 of 1 and primes), dtypes,
// MEAN and SUM, synchronous and deferred reductions:
//   7  a wrapped weight's materialize() is the pre-wrap TP-local weight, bitwise, and every pad row
//      of every shard is zero; a GTP layer materializes exactly the weight the same layer has
//      without GTP_remat (CPU and GPU initialization, SPEC 4.10);
//   8  with identical data on all peers, outputs and dgrads equal the G = 1 run exactly and the
//      stripped main_grads equal the G = 1 wgrads (MEAN) or G times them (SUM), SUM = G × MEAN
//      exactly for G a power of two, for every layer kind and option of `tpsim run`; the random-data
//      half (runSharded against the dense reference) is in layer_props.cc;
//   9  gtp_local_pad_zero_count sums to pad_length·R over the peers, is additive over fragments,
//      counts exactly the shard's zero elements of a fragment, is 0 without padding or group and
//      never exceeds v − u or S·R;
//   10 the pad rows of weights and main_grads stay exactly zero through SGD and Adam steps, with
//      synchronous and deferred reduce-scatters;
//   11 grad norm and zero count are the same for every (T, G, D) factorization of one model and one
//      batch, and each distinct gradient element is counted exactly once; the simulator and the gpu
//      backend count the same zeros and pad zeros and agree on the norm within the bound;
//   18 the fp32-accumulation reduce-scatter is bypassed at G <= 2: bitwise the plain reduce-scatter,
//      no fp32 dispatch, the same collectives (no accuracy ordering is asserted at G > 2).
// The GTP rows of items 12 and 13 extend DuplicateLaws and CheckpointLaws in invariant_props.cc.
// Rank code cannot RC_ASSERT: it records what it saw (or what was wrong) in Problems (rank_checks.h)
// and the property asserts afterwards, on the test's thread.
#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <random>
#include <sstream>

#include "core/attributes.h"
#include "core/embedding.h"
#include "core/grad_stats.h"
#include "core/gtp.h"
#include "core/init.h"
#include "core/placement.h"
#include "core/layers.h"
#include "core/process_groups.h"
#include "core/random.h"
#include "props/backends.h"
#include "props/generators.h"
#include "props/harness.h"
#include "props/rank_checks.h"
#include "tests/sim_test_util.h"
#include "tools/lib/backend.h"
#include "tools/lib/host_tensor.h"

namespace tpsim::props {
namespace {

using testing::tensorOf;
using testing::valuesOf;
using tools::HostTensor;

// Default case budgets (README.md, "Budget and soak").
constexpr int kReconstructionCases = 2000;
constexpr int kLayerReconstructionCases = 1000;
constexpr int kPaddingRuleCases = 1000;
constexpr int kTransparencyCases = 1000;
constexpr int kPadCountCases = 2000;
constexpr int kTrainingCases = 500;
constexpr int kStatisticsCases = 400;
constexpr int kCrossBackendStatisticsCases = 200;
constexpr int kBypassCases = 1500;
constexpr int kRunnerBypassCases = 600;

ParallelLayout gtpLayout(int T, int G, int D = 1) {
  ParallelSizes s;
  s.world = T * G * D;
  s.tp = T;
  s.gtpRemat = G;
  return ParallelLayout(s);
}

// ---- Item 7 -----------------------------------------------------------------------------------

// wrapGtp on G ranks: the shard is rows [g·S, (g+1)·S) of the zero-padded weight, attributes are
// stamped (pad_length alike on every rank, requires_grad kept), materialize() gives back the
// pre-wrap weight bit for bit and the gathered tail is zero. G = 1 wraps nothing.
TPSIM_PROP(GtpLaws, MaterializeIsThePreWrapWeightBitwiseAndPadRowsAreZero, kReconstructionCases) {
  const int G = *pick<int>({1, 2, 4, 3, 8, 5, 6, 7});
  const std::int64_t dLog = *flag() ? G * *pick<std::int64_t>({1, 2, 3, 5})
                                    : *pick<std::int64_t>({1, 2, 3, 5, 7, 8, 11, 13, 16, 31, 64, 97});
  const std::vector<std::int64_t> trailing =
      *pick<std::vector<std::int64_t>>({{3}, {}, {1}, {2}, {5}, {2, 3}});
  const int a = *genPadForAlignment({dLog}, G);
  const DType dtype = *genFloatDtype();
  const bool requiresGrad = !*flag(), stampReplica = *flag();
  const std::uint64_t seed = *genSeed();
  const GtpShardGeometry geo = gtpRematShardDim0(dLog, G, a);
  RC_TAG(G == 1 ? "G = 1" : geo.padLength == 0 ? "no padding" : geo.padLength > geo.rows ? "padding spills" : "padded");
  RC_LOG() << "G=" << G << " Dlog=" << dLog << " trailing " << trailing.size() << " a=" << a << " "
           << dtypeName(dtype) << " -> S=" << geo.rows << " pad=" << geo.padLength << "\n";
  const std::int64_t perRow = product(trailing);
  for (const Backend* b : usableBackends()) {
    Problems problems;
    b->runRanks(G, [&](RankContext& ctx) {
      const int g = ctx.comm.rank();
      const std::string at = "rank " + std::to_string(g) + ": ";
      Parameter w;
      w.name = "w";
      w.requiresGrad = requiresGrad;
      w.data = tensorOf(ctx.compute, dtype, nonZeroNormals(seed, dLog * perRow), shapeOf(dLog, trailing));
      const Values before = valuesOf(ctx.compute, w.data);
      wrapGtp(ctx.compute, w, ctx.comm, a, stampReplica ? &ctx.comm : nullptr);
      problems.check(w.requiresGrad == requiresGrad, at + "requires_grad changed");
      if (G == 1) {
        problems.check(!w.attrs.isGtpWeightRemat.has_value() && !w.attrs.padLength.has_value(),
                       at + "a group of one stamped GTP attributes");
        problems.check(sameBits(valuesOf(ctx.compute, w.data), before), at + "a group of one changed the weight");
        return;
      }
      problems.check(w.data.shape() == shapeOf(geo.rows, trailing),
                     at + "shard shape " + w.data.shape().str() + ", expected " + shapeOf(geo.rows, trailing).str());
      problems.check(w.attrs.padLength == std::optional<int>(int(geo.padLength)),
                     at + "pad_length " + std::to_string(w.attrs.padLength.value_or(-1)) + ", expected " +
                         std::to_string(geo.padLength));
      problems.check(w.attrs.isGtpWeightRemat == std::optional<bool>(true), at + "is_gtp_weight_remat not True");
      problems.check(w.attrs.group == std::optional<Collectives*>(&ctx.comm), at + "group is not the GTP group");
      problems.check(w.attrs.gtpReplicaGroup.has_value() == stampReplica, at + "gtp_replica_group stamped wrongly");
      if (w.data.shape() != shapeOf(geo.rows, trailing)) return;
      const Values shard = valuesOf(ctx.compute, w.data);
      for (std::int64_t r = 0; r < geo.rows; ++r) {
        const std::int64_t global = g * geo.rows + r;
        for (std::int64_t e = 0; e < perRow; ++e) {
          const double want = global < dLog ? before[std::size_t(global * perRow + e)] : 0.0;
          if (!(shard[std::size_t(r * perRow + e)] == want)) {
            problems.add(at + "shard row " + std::to_string(r) + " (padded row " + std::to_string(global) +
                         (global < dLog ? ", real" : ", padding") + ") element " + std::to_string(e) + " is " +
                         std::to_string(shard[std::size_t(r * perRow + e)]) + ", expected " + std::to_string(want));
            return;
          }
        }
      }
      const Materialized m = materialize(ctx.compute, w);
      problems.check(m.weight.shape() == shapeOf(dLog, trailing), at + "materialized shape " + m.weight.shape().str());
      problems.check(m.gathered->shape() == shapeOf(geo.rows * G, trailing),
                     at + "gathered shape " + m.gathered->shape().str());
      const Values rebuilt = valuesOf(ctx.compute, m.weight);
      problems.check(sameBits(rebuilt, before),
                     at + "materialize() " + str(rebuilt) + " is not the pre-wrap weight " + str(before));
      const std::string tail = padRowsNonZero(valuesOf(ctx.compute, *m.gathered), geo.rows * G, dLog, "gathered");
      problems.check(tail.empty(), at + tail);
    });
    problems.assertNone();
  }
}

// SPEC 4.2 stated again here instead of computed by the code under test (the laws around take
// their expected values from gtpRematShardDim0, so a changed rule would change them too): with a > 0
// each GTP_remat peer holds S rows, the smallest multiple of a with G·S >= Dlog; with a = 0,
// S = Dlog / G; peer g holds TP-local rows [g·S, (g+1)·S), those from Dlog on zero padding, which a
// column weight keeps behind each TP slice and a row weight at its tail. Checked on the shards
// column and row layers built at T x G hold, and on what their placement says each rank holds.
TPSIM_PROP(GtpLaws, ShardsFollowThePaddingRuleStatedIndependently, kPaddingRuleCases) {
  const int T = *pick<int>({1, 2, 3, 4});
  int G = *pick<int>({2, 3, 4, 5, 8});
  while (T * G > 16) G = G % 2 == 0 ? G / 2 : G - 1;
  const bool column = !*flag();
  std::int64_t dLog = *pick<std::int64_t>({1, 2, 3, 5, 7, 16, 31, 40});
  if (*flag()) dLog *= G;  // so that a = 0 is possible
  const int a = *genPadForAlignment({dLog}, G);
  const std::int64_t other = *pick<std::int64_t>({1, 2, 3});
  std::int64_t S = (dLog + G - 1) / G;  // the fewest rows that hold Dlog, then up to a multiple of a
  while (a > 0 && S % a != 0) ++S;
  const std::int64_t pad = G * S - dLog;
  RC_TAG(column ? "column" : "row", pad == 0 ? "no padding" : "padded");
  RC_LOG() << (column ? "column" : "row") << " T=" << T << " G=" << G << " Dlog=" << dLog << " a=" << a
           << " -> S=" << S << " pad=" << pad << "\n";
  const ParallelLayout layout = gtpLayout(T, G);
  for (const Backend* b : usableBackends()) {
    Problems problems;
    b->runRanks(layout.world(), [&](RankContext& ctx) {
      ProcessGroups pg(ctx.comm, layout);
      const int t = pg.tp().rank(), g = pg.gtpRemat().rank();
      const std::string at = "rank (t " + std::to_string(t) + ", g " + std::to_string(g) + "): ";
      GtpGradReducer reducer(ctx.compute, {});
      ModelParallelConfig config;
      config.tensorModelParallelSize = T;
      config.gtpRematSize = G;
      config.gtpPadForAlignment = a;
      config.performInitialization = false;
      const LayerContext lc{ctx.compute, pg.tp(), nullptr, nullptr, &pg.gtpRemat(), &pg.dpCp(), &reducer};
      const InitMethod init = initMethodNormal(1.0);
      std::optional<ColumnParallelLinear> col;
      std::optional<RowParallelLinear> row;
      if (column) col.emplace(lc, config, other, T * dLog, init);
      else row.emplace(lc, config, T * other, dLog, init);
      const Parameter& w = column ? *col->weight() : row->weight();
      problems.check(w.data.shape()[0] == S, at + "the shard holds " + std::to_string(w.data.shape()[0]) +
                                                 " rows, the rule gives S = " + std::to_string(S));
      problems.check(w.attrs.padLength == std::optional<int>(int(pad)),
                     at + "pad_length " + std::to_string(w.attrs.padLength.value_or(-1)) + ", the rule gives " +
                         std::to_string(pad));
      const TensorPlacement p = parameterPlacement(w, "weight", T, G);
      const std::int64_t slices = column ? T : 1, cols = w.data.shape()[1];
      problems.check(p.layoutShape()[0] == slices * G * S, at + "the placement lays out " +
                                                               std::to_string(p.layoutShape()[0]) + " rows, expected " +
                                                               std::to_string(slices * G * S));
      // TP-local rows [g·S, g·S + real) in global rows: behind the slices of lower TP ranks for a column.
      const std::int64_t real = std::clamp<std::int64_t>(dLog - g * S, 0, S), first = (column ? t * dLog : 0) + g * S;
      std::int64_t held = 0;
      for (const Block& blk : blocksOf(p, t, g)) {
        if (blk.pad) continue;
        problems.check(blk.global[0].begin >= first && blk.global[0].end <= first + real,
                       at + "holds global rows [" + std::to_string(blk.global[0].begin) + ", " +
                           std::to_string(blk.global[0].end) + "), outside [" + std::to_string(first) + ", " +
                           std::to_string(first + real) + ")");
        held += blk.global[0].size() * blk.global[1].size();
      }
      problems.check(held == real * cols, at + "holds " + std::to_string(held) + " real elements, the rule gives " +
                                             std::to_string(real * cols));
      problems.check(padZeroCount(p, t, g) == (S - real) * cols,
                     at + "placement counts " + std::to_string(padZeroCount(p, t, g)) + " pad zeros, the rule gives " +
                         std::to_string((S - real) * cols));
    });
    problems.assertNone();
  }
}

// Column, Row and the embedding with GTP_remat materialize exactly the TP-local weight the same
// layer initializes without it (CPU master slicing or the TP-seeded GPU tracker, SPEC 4.10), keep the
// TP attributes, stamp the replica group, and hold zeros in their pad rows.
TPSIM_PROP(GtpLaws, GtpLayersMaterializeTheWeightOfTheSameLayerWithoutGtp, kLayerReconstructionCases) {
  const int T = *pick<int>({1, 2, 3, 4});
  int G = *pick<int>({2, 4, 3, 8, 5});
  while (T * G > 16) G = G % 2 == 0 ? G / 2 : G - 1;
  const int kind = *pickIndex(3);  // column, row, embedding
  const int stride = kind == 2 ? 1 : *pick<int>({1, 2});
  const bool cpuInit = *flag();
  const DType dtype = *genFloatDtype();
  const std::uint64_t seed = *genSeed();
  std::int64_t q = *pick<std::int64_t>({1, 2, 3, 5, 7});
  if (*flag()) q *= G;  // Dlog divisible by G, so that a = 0 is possible
  const std::int64_t other = *pick<std::int64_t>({1, 2, 3, 5});
  // Column (K = other -> N = T·stride·q): Dlog = stride·q. Row (K = T·stride·other -> N = q): Dlog = q.
  // Embedding (V = T·q, h = other): Dlog = q.
  const std::int64_t dLog = kind == 0 ? stride * q : q;
  const int a = *genPadForAlignment({dLog}, G);
  const char* kinds[] = {"column", "row", "embedding"};
  RC_TAG(kinds[kind], cpuInit ? "cpu init" : "gpu init");
  RC_LOG() << kinds[kind] << " T=" << T << " G=" << G << " stride=" << stride << " " << dtypeName(dtype)
           << " Dlog=" << dLog << " a=" << a << "\n";
  const ParallelLayout layout = gtpLayout(T, G);
  const GtpShardGeometry geo = gtpRematShardDim0(dLog, G, a);
  for (const Backend* b : usableBackends()) {
    Problems problems;
    b->runRanks(layout.world(), [&](RankContext& ctx) {
      ProcessGroups pg(ctx.comm, layout);
      const int g = pg.gtpRemat().rank();
      const std::string at = "rank " + std::to_string(ctx.comm.rank()) + " (t " + std::to_string(pg.tp().rank()) +
                             ", g " + std::to_string(g) + "): ";
      GtpGradReducer reducer(ctx.compute, {});
      ModelParallelConfig off;
      off.tensorModelParallelSize = T;
      off.useCpuInitialization = cpuInit;
      off.paramsDtype = dtype;
      off.gtpPadForAlignment = a;
      ModelParallelConfig on = off;
      on.gtpRematSize = G;
      Generator genOn(seed), genOff(seed);
      RngTracker trackerOn, trackerOff;
      RankSeeds seeds;
      seeds.tpRank = pg.tp().rank();
      modelParallelManualSeed(trackerOff, seed, seeds);
      seeds.gtpRank = g;
      seeds.gtpSize = G;
      modelParallelManualSeed(trackerOn, seed, seeds);
      const LayerContext lcOn{ctx.compute, pg.tp(), cpuInit ? nullptr : &trackerOn, cpuInit ? &genOn : nullptr,
                              &pg.gtpRemat(), &pg.dpCp(), &reducer};
      const LayerContext lcOff{ctx.compute, pg.tp(), cpuInit ? nullptr : &trackerOff, cpuInit ? &genOff : nullptr};
      const InitMethod init = initMethodNormal(1.0);
      auto compare = [&](const Parameter& shard, const Parameter& plain) {
        problems.check(isGtpShard(shard), at + "the GTP layer's weight is not a GTP_remat shard");
        if (!isGtpShard(shard)) return;
        problems.check(shard.data.shape()[0] == geo.rows, at + "shard rows " + std::to_string(shard.data.shape()[0]) +
                                                              ", expected " + std::to_string(geo.rows));
        problems.check(shard.attrs.gtpReplicaGroup == std::optional<Collectives*>(&pg.dpCp()),
                       at + "gtp_replica_group is not the gtp-excluded DP-CP group");
        problems.check(shard.attrs.tensorModelParallel == plain.attrs.tensorModelParallel &&
                           shard.attrs.partitionDim == plain.attrs.partitionDim &&
                           shard.attrs.partitionStride == plain.attrs.partitionStride &&
                           shard.attrs.allreduce == plain.attrs.allreduce,
                       at + "the TP attributes were not copied onto the shard");
        const Values rebuilt = valuesOf(ctx.compute, materialize(ctx.compute, shard).weight);
        const Values want = valuesOf(ctx.compute, plain.data);
        problems.check(sameBits(rebuilt, want), at + "materialize() " + str(rebuilt) +
                                                    " is not the weight without GTP_remat " + str(want));
        const std::string pad = padRowsNonZero(valuesOf(ctx.compute, shard.data), geo.rows,
                                               firstPadRow(dLog, geo.rows, g), "shard");
        problems.check(pad.empty(), at + pad);
      };
      if (kind == 0) {
        ColumnParallelOptions o;
        o.stride = stride;
        ColumnParallelLinear withGtp(lcOn, on, other, T * stride * q, init, o);
        ColumnParallelLinear without(lcOff, off, other, T * stride * q, init, o);
        compare(*withGtp.weight(), *without.weight());
      } else if (kind == 1) {
        RowParallelOptions o;
        o.stride = stride;
        o.inputIsParallel = true;
        RowParallelLinear withGtp(lcOn, on, T * stride * other, q, init, o);
        RowParallelLinear without(lcOff, off, T * stride * other, q, init, o);
        compare(withGtp.weight(), without.weight());
      } else {
        VocabParallelEmbedding withGtp(lcOn, on, T * q, other, init);
        VocabParallelEmbedding without(lcOff, off, T * q, other, init);
        compare(withGtp.weight(), without.weight());
      }
    });
    problems.assertNone();
  }
}

// ---- Item 8 (identical data on every peer) ------------------------------------------------------

bool isParameterGradient(const std::string& name) {
  return name != "input.grad" && name.size() >= 5 && name.compare(name.size() - 5, 5, ".grad") == 0;
}
bool isBiasGradient(const std::string& name) { return name.find("bias.grad") != std::string::npos; }

// The batch dim of a tensor tools::runSharded splits over GTP_remat peers (its `batch` lambda).
int batchDim(const RunConfig& c, const std::string& name) {
  if (c.layer != layerKind("embedding")) return 1;  // (s, b, ·)
  if (name == "input") return 0;                   // ids (b, s)
  return c.reduceScatterEmbeddings ? 1 : 0;        // (s, b, h) or (b, s, h)
}

// `inputs` of a G = 1 case with every batch-split tensor repeated G times along the batch: peer g
// of the G run gets block g, i.e. exactly the G = 1 data.
TensorMap repeatedOnEveryPeer(const RunConfig& c, const TensorMap& inputs) {
  TensorMap out = inputs;
  for (const std::string name : {"input", "grad_output"})
    out[name] = tools::concat(std::vector<HostTensor>(std::size_t(c.gtpRemat), inputs.at(name)), batchDim(c, name));
  return out;
}

double unitRoundoff(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16: return std::ldexp(1.0, -8);
    case DType::kFloat16: return std::ldexp(1.0, -11);
    default: return std::ldexp(1.0, -24);
  }
}

// With identical data on every peer (each peer's batch block is the whole G = 1 batch), tools::
// runSharded at G gives: output and input.grad, the G = 1 ones repeated per peer, bitwise; every
// parameter gradient the G = 1 one under MEAN and G times it under SUM, and SUM = G × MEAN bitwise
// for G a power of two. Exact data (Column, Row, embedding) make MEAN and SUM exact too (MEAN for G
// a power of two); otherwise (MEAN's 1/G rounded, the MLP's real data) they hold within the
// roundings of the pre-scale and the reduce-scatter's partial sums: (2G + 2) units of the wire
// dtype. Biases are averaged or summed over identical peers, which is exact.
TPSIM_PROP(GtpLaws, IdenticalDataOnEveryPeerGivesTheGtpOffRun, kTransparencyCases) {
  const LayerKind* kind = *pick<const LayerKind*>({layerKind("column"), layerKind("row"), layerKind("embedding"), layerKind("mlp")});
  RunConfig c = *genRunConfig({kind}, genTp(), GtpMode::kAlways);
  const bool exact = kind != layerKind("mlp");
  if (!exact) {  // compare with a G = 1 main_grad in fp32 (fusion), not a wgrad rounded to the dtype
    c.gradAccumulationFusion = true;
    c.mainGradDtype = DType::kFloat32;
  }
  const int G = c.gtpRemat;
  const bool powerOfTwo = (G & (G - 1)) == 0;
  RunConfig off = c;
  off.gtpRemat = 1;
  off.batch = c.batch / G;
  off.fp32AccumReduceScatter = false;
  RunConfig mean = c, sum = c;
  mean.gtpReduceMean = true;
  sum.gtpReduceMean = false;
  // Exact data sized for the G run, whose reductions add G copies of each G = 1 sum.
  const TensorMap offInputs = exact ? *genExactInputs(off, exactAmplitude(c)) : realInputs(off);
  const TensorMap inputs = repeatedOnEveryPeer(c, offInputs);
  const Numerics numerics = exact ? Numerics::kExact : Numerics::kReal;
  RC_TAG(kind->name(), powerOfTwo ? "G a power of two" : "other G");
  const double u = unitRoundoff(c.layer->gtpWireDtype(c));
  for (const Backend* b : usableBackends()) {
    TensorMap r1, rMean, rSum;
    try {
      r1 = b->runLayer(off, offInputs).results;
      rMean = b->runLayer(mean, inputs).results;
      rSum = b->runLayer(sum, inputs).results;
    } catch (const std::exception& e) {
      failLayerCase(c, numerics, b->name, inputs, std::string("a run threw: ") + e.what());
    }
    for (const auto& [name, t1] : r1) {
      const auto im = rMean.find(name), is = rSum.find(name);
      if (im == rMean.end() || is == rSum.end())
        failLayerCase(c, numerics, b->name, inputs, name + ": missing from the G = " + std::to_string(G) + " run");
      const HostTensor &m = im->second, &s = is->second;
      if (!isParameterGradient(name)) {  // output, input.grad: the G = 1 result on every peer, bitwise
        // input.grad: (s, b, K), or (T, s, b, K) with --disable-grad-reduce.
        const HostTensor want = tools::concat(std::vector<HostTensor>(std::size_t(G), t1),
                                              name == "output" ? batchDim(c, "grad_output") : c.disableGradReduce ? 2 : 1);
        for (const auto& [mode, got] : {std::pair<const char*, const HostTensor*>{"MEAN", &m}, {"SUM", &s}})
          if (got->shape != want.shape || !sameBits(got->values, want.values))
            failLayerCase(c, numerics, b->name, inputs,
                          std::string(mode) + " " + name + " " + shapeText(got->shape) + " " + str(got->values) +
                              " is not the G = 1 result on every peer " + shapeText(want.shape) + " " + str(want.values));
        continue;
      }
      if (m.shape != t1.shape || s.shape != t1.shape)
        failLayerCase(c, numerics, b->name, inputs, name + ": G = 1 gives " + shapeText(t1.shape) + ", MEAN " + shapeText(m.shape) +
                                                        ", SUM " + shapeText(s.shape));
      const bool exactHere = isBiasGradient(name) || exact;
      for (std::size_t i = 0; i < t1.values.size(); ++i) {
        const double w = t1.values[i];
        const double slack = (2.0 * G + 2.0) * u * std::fabs(w);
        const bool meanOk = exactHere && (powerOfTwo || isBiasGradient(name)) ? m.values[i] == w
                                                                               : std::fabs(m.values[i] - w) <= slack;
        const bool sumOk = exactHere ? s.values[i] == G * w : std::fabs(s.values[i] - G * w) <= G * slack;
        const bool scaleOk = !powerOfTwo || s.values[i] == G * m.values[i];
        if (meanOk && sumOk && scaleOk) continue;
        std::ostringstream os;
        os.precision(9);
        os << name << " element " << i << ": G = 1 wgrad " << w << ", MEAN " << m.values[i] << ", SUM " << s.values[i]
           << " (want MEAN = G=1" << (meanOk ? " ok" : " FAILS") << ", SUM = " << G << "·G=1" << (sumOk ? " ok" : " FAILS")
           << ", SUM = G·MEAN" << (scaleOk ? " ok" : " FAILS") << "; ";
        if (exactHere) os << "exact";
        else os << "MEAN slack " << slack;
        os << ")";
        failLayerCase(c, numerics, b->name, inputs, os.str());
      }
    }
    if (rMean.size() != r1.size() || rSum.size() != r1.size())
      failLayerCase(c, numerics, b->name, inputs, "G = 1 and G > 1 produce different sets of results");
  }
}

// ---- Item 9 -----------------------------------------------------------------------------------

// A fragment [u, w) of a shard split at v, u <= v <= w, drawn a little past both ends of [0, n]
// (the count clamps its range).
struct Fragment {
  std::int64_t u, v, w;
};

TPSIM_PROP(GtpLaws, PadZeroCountIsConservedAdditiveAndBounded, kPadCountCases) {
  const int G = *pick<int>({1, 2, 4, 3, 8, 5, 6, 7});
  const std::int64_t dLog = *flag() ? G * *pick<std::int64_t>({1, 2, 3})
                                    : *pick<std::int64_t>({1, 2, 3, 5, 7, 8, 11, 13, 16, 31, 63, 120});
  const std::vector<std::int64_t> trailing = *pick<std::vector<std::int64_t>>({{4}, {}, {1}, {3}, {8}, {2, 3}});
  const int a = *genPadForAlignment({dLog}, G);
  const DType dtype = *genFloatDtype();
  const GtpShardGeometry geo = gtpRematShardDim0(dLog, G, a);
  const std::int64_t perRow = product(trailing), n = geo.rows * perRow;
  std::vector<std::vector<Fragment>> fragments(static_cast<std::size_t>(G));
  for (auto& list : fragments)
    for (int i = 0; i < 6; ++i) {
      std::vector<std::int64_t> p = {*uniform<std::int64_t>(-2, n + 3), *uniform<std::int64_t>(-2, n + 3),
                                     *uniform<std::int64_t>(-2, n + 3)};
      std::sort(p.begin(), p.end());
      list.push_back({p[0], p[1], p[2]});
    }
  RC_TAG(G == 1 ? "G = 1" : geo.padLength == 0 ? "no padding" : geo.padLength > geo.rows ? "padding spills" : "padded");
  RC_LOG() << "G=" << G << " Dlog=" << dLog << " R=" << perRow << " a=" << a << " -> S=" << geo.rows
           << " pad=" << geo.padLength << "\n";
  for (const Backend* b : usableBackends()) {
    Problems problems;
    std::vector<std::int64_t> totals(std::size_t(G), 0);
    b->runRanks(G, [&](RankContext& ctx) {
      const int g = ctx.comm.rank();
      const std::string at = "rank " + std::to_string(g) + ": ";
      Parameter w;
      w.name = "w";
      w.data = tensorOf(ctx.compute, dtype, nonZeroNormals(7, dLog * perRow), shapeOf(dLog, trailing));
      wrapGtp(ctx.compute, w, ctx.comm, a);
      const Values shard = valuesOf(ctx.compute, w.data);
      const std::int64_t size = std::int64_t(shard.size());
      // The zeros of flat [u, v) of the shard: with a weight free of zeros, exactly its padding.
      auto zerosIn = [&](std::int64_t u, std::int64_t v) {
        std::int64_t z = 0;
        for (std::int64_t i = std::clamp<std::int64_t>(u, 0, size); i < std::clamp<std::int64_t>(v, 0, size); ++i)
          z += shard[std::size_t(i)] == 0.0;
        return z;
      };
      const std::int64_t whole = gtpLocalPadZeroCount(w, 0, size);
      totals[std::size_t(g)] = whole;
      problems.check(whole == zerosIn(0, size), at + "count(0, numel) = " + std::to_string(whole) + " but the shard holds " +
                                                    std::to_string(zerosIn(0, size)) + " zeros");
      problems.check(whole <= geo.rows * perRow, at + "count exceeds S·R");
      if (geo.padLength == 0) problems.check(whole == 0, at + "a shard without padding counts " + std::to_string(whole));
      for (const Fragment& f : fragments[std::size_t(g)]) {
        const std::int64_t uv = gtpLocalPadZeroCount(w, f.u, f.v), vw = gtpLocalPadZeroCount(w, f.v, f.w),
                           uw = gtpLocalPadZeroCount(w, f.u, f.w);
        const std::string range = "[" + std::to_string(f.u) + ", " + std::to_string(f.v) + ", " + std::to_string(f.w) + ")";
        problems.check(uv + vw == uw, at + "count(u,v) + count(v,w) = " + std::to_string(uv) + " + " + std::to_string(vw) +
                                          " != count(u,w) = " + std::to_string(uw) + " for u,v,w " + range);
        problems.check(uv == zerosIn(f.u, f.v), at + "count(u,v) = " + std::to_string(uv) + " but the fragment holds " +
                                                    std::to_string(zerosIn(f.u, f.v)) + " zeros, u,v,w " + range);
        problems.check(uw >= 0 && uw <= f.w - f.u && uw <= geo.rows * perRow, at + "count(u,w) out of [0, min(w-u, S·R)]");
        problems.check(gtpLocalPadZeroCount(w, f.w, f.u) == 0 || f.u == f.w, at + "an inverted range counts");
      }
      const ParamAttributes stamped = w.attrs;
      w.attrs.group.reset();  // the same shard without its group attribute: nothing is padding
      problems.check(gtpLocalPadZeroCount(w, 0, size) == 0, at + "a shard without a group counts padding");
      w.attrs = stamped;
      w.attrs.padLength = 0;
      problems.check(gtpLocalPadZeroCount(w, 0, size) == 0, at + "pad_length 0 counts padding");
      w.attrs = stamped;
    });
    std::int64_t total = 0;
    for (std::int64_t t : totals) total += t;
    problems.check(total == (G > 1 ? geo.padLength * perRow : 0),
                   "the peers count " + std::to_string(total) + " pad elements, expected pad_length·R = " +
                       std::to_string(geo.padLength * perRow));
    problems.assertNone();
  }
}

// ---- Item 10 ----------------------------------------------------------------------------------

// embedding (V -> h) -> column (h -> F) -> row (F -> h, input_is_parallel) on T x G ranks, trained
// for a few steps of SGD or Adam (with decoupled weight decay) on each peer's own data: after every
// backward and every update the pad rows of the three shards and of their main_grads are exact zeros.
TPSIM_PROP(GtpLaws, PadRowsOfWeightsAndMainGradsStayZeroThroughTraining, kTrainingCases) {
  const int T = *pick<int>({1, 2, 3});
  int G = *pick<int>({2, 4, 3, 8});
  while (T * G > 12) G = G % 2 == 0 ? G / 2 : G - 1;
  std::int64_t v0 = *pick<std::int64_t>({1, 2, 3, 5}), h = *pick<std::int64_t>({1, 2, 3, 5, 8}),
               f0 = *pick<std::int64_t>({1, 2, 3, 7});
  if (*flag()) v0 *= G, h *= G, f0 *= G;  // every Dlog divisible: a = 0 possible
  const int a = *genPadForAlignment({v0, f0, h}, G);
  const DType dtype = *pick<DType>({DType::kFloat32, DType::kBFloat16, DType::kFloat16});
  const DType mainGradDtype = dtype == DType::kBFloat16 ? *pick<DType>({DType::kFloat32, dtype}) : DType::kFloat32;
  const bool mean = !*flag(), async = *flag(), fp32Accum = *flag(), adam = *flag(), zeroGrads = !*flag();
  const bool bias = *flag();
  const int steps = *pick<int>({3, 1, 2, 4});
  const std::int64_t bsz = *pick<std::int64_t>({1, 2}), s = *pick<std::int64_t>({1, 2, 3});
  const std::uint64_t seed = *genSeed();
  RC_TAG(adam ? "Adam" : "SGD", async ? "async" : "sync");
  RC_LOG() << "T=" << T << " G=" << G << " V=" << T * v0 << " h=" << h << " F=" << T * f0 << " a=" << a << " "
           << dtypeName(dtype) << " main_grad " << dtypeName(mainGradDtype) << (mean ? " MEAN" : " SUM")
           << (async ? " async" : " sync") << (fp32Accum ? " fp32-accum" : "") << (adam ? " Adam" : " SGD")
           << " steps " << steps << (zeroGrads ? " (main_grad zeroed per step)" : " (main_grad accumulates)") << "\n";
  const ParallelLayout layout = gtpLayout(T, G);
  for (const Backend* b : usableBackends()) {
    Problems problems;
    b->runRanks(layout.world(), [&](RankContext& ctx) {
      ProcessGroups pg(ctx.comm, layout);
      const int g = pg.gtpRemat().rank();
      Compute& compute = ctx.compute;
      GtpGradReducer reducer(compute, {mean, fp32Accum, async});
      Generator g1(seed), g2(seed + 1), g3(seed + 2);
      ModelParallelConfig config;
      config.tensorModelParallelSize = T;
      config.gtpRematSize = G;
      config.gtpPadForAlignment = a;
      config.useCpuInitialization = true;
      config.paramsDtype = dtype;
      auto lc = [&](Generator& gen) {
        return LayerContext{compute, pg.tp(), nullptr, &gen, &pg.gtpRemat(), &pg.dpCp(), &reducer};
      };
      VocabParallelEmbedding emb(lc(g1), config, T * v0, h, initMethodNormal(1.0));
      ColumnParallelOptions co;
      co.bias = bias;
      ColumnParallelLinear fc1(lc(g2), config, h, T * f0, initMethodNormal(0.5), co);
      RowParallelOptions ro;
      ro.bias = bias;
      ro.inputIsParallel = true;
      RowParallelLinear fc2(lc(g3), config, T * f0, h, initMethodNormal(0.5), ro);
      struct Tracked {
        Parameter* p;
        std::int64_t dLog;
        Values m, v;  // Adam's moments
      };
      std::vector<Tracked> weights = {{&emb.weight(), v0, {}, {}}, {fc1.weight(), f0, {}, {}}, {&fc2.weight(), h, {}, {}}};
      for (Tracked& w : weights) w.p->mainGrad = compute.zeros(w.p->data.shape(), mainGradDtype);
      auto checkPads = [&](const std::string& when) {
        for (const Tracked& w : weights) {
          const std::int64_t rows = w.p->data.shape()[0], from = firstPadRow(w.dLog, rows, g);
          const std::string where = "rank " + std::to_string(ctx.comm.rank()) + " " + when + ": " + w.p->name;
          const std::string wrong = padRowsNonZero(valuesOf(compute, w.p->data), rows, from, where + " weight");
          problems.check(wrong.empty(), wrong);
          const std::string wrongGrad = padRowsNonZero(valuesOf(compute, w.p->mainGrad), rows, from, where + " main_grad");
          problems.check(wrongGrad.empty(), wrongGrad);
        }
      };
      checkPads("after wrapping");
      for (int step = 0; step < steps; ++step) {
        // Each peer's own batch, the same on its TP ranks.
        const std::uint64_t data = seed + 1000 * std::uint64_t(step + 1) + std::uint64_t(g);
        std::mt19937_64 rng(data);
        std::uniform_int_distribution<std::int64_t> id(0, T * v0 - 1);
        Values ids(std::size_t(bsz * s));
        for (double& x : ids) x = double(id(rng));
        Tensor y = emb.forward(tensorOf(compute, DType::kInt64, ids, Shape{bsz, s}));  // (b, s, h)
        Tensor hidden = fc1.forward(y).output;                                         // (b, s, F/T)
        Tensor out = fc2.forward(hidden).output;                                       // (b, s, h)
        Tensor dHidden = fc2.backward(tensorOf(compute, dtype, nonZeroNormals(data + 7, out.numel()), out.shape()));
        Tensor dY = fc1.backward(dHidden);
        emb.backward(dY);
        reducer.drain();
        checkPads("step " + std::to_string(step) + " after backward");
        for (Tracked& w : weights) {  // the optimizer step on this rank's shard, in double, stored in the dtype
          Values p = valuesOf(compute, w.p->data);
          const Values grad = valuesOf(compute, w.p->mainGrad);
          if (adam) {
            if (w.m.empty()) w.m.assign(p.size(), 0.0), w.v.assign(p.size(), 0.0);
            const double b1 = 0.9, b2 = 0.999, lr = 1e-2, eps = 1e-8, decay = 0.1;
            for (std::size_t i = 0; i < p.size(); ++i) {
              w.m[i] = b1 * w.m[i] + (1 - b1) * grad[i];
              w.v[i] = b2 * w.v[i] + (1 - b2) * grad[i] * grad[i];
              const double mHat = w.m[i] / (1 - std::pow(b1, step + 1)), vHat = w.v[i] / (1 - std::pow(b2, step + 1));
              p[i] -= lr * (mHat / (std::sqrt(vHat) + eps) + decay * p[i]);
            }
          } else {
            for (std::size_t i = 0; i < p.size(); ++i) p[i] -= 0.1 * grad[i];
          }
          compute.copy(tensorOf(compute, dtype, p, w.p->data.shape()), w.p->data);
          if (zeroGrads) compute.fill(w.p->mainGrad, 0.0);
        }
        checkPads("step " + std::to_string(step) + " after the update");
      }
    });
    problems.assertNone();
  }
}

// ---- Item 11 ----------------------------------------------------------------------------------

struct GradStatistics {
  double norm = 0;
  std::int64_t zeros = 0, uncorrectedZeros = 0, countedElements = 0;
  Values w1, b1, w2, b2;  // the whole weights, from a T = G = 1 run (for the bound)
};

struct StatisticsCase {
  std::int64_t s, samples, k, f;  // samples: the global batch B
  std::vector<bool> deadFeature;  // input features that are always zero: whole zero columns of fc1's wgrad
  bool mean, async, fp32Accum;
  bool sequenceParallel = false;  // at T > 1: each TP rank holds s/T of the sequence
  int a;
  std::uint64_t seed;

  // Element (i, sample, k) of the input and of the output gradient of the whole batch, the latter
  // already scaled so that the reduced gradient is the mean over the B samples.
  double x(std::int64_t i, std::int64_t sample, std::int64_t k) const {
    return deadFeature[std::size_t(k)] ? 0.0 : std::sin(1.0 + phase(i, sample, k));
  }
  double dy(std::int64_t i, std::int64_t sample, std::int64_t k) const {
    return std::cos(3.0 + 0.37 * phase(i, sample, k)) / double(samples);
  }
  double phase(std::int64_t i, std::int64_t sample, std::int64_t k) const {
    return double(seed % 1000) + double(i * 131 + sample * 17 + k * 7);
  }
};

// Column(K -> F, bias) -> Row(F -> K, input_is_parallel, bias) over T x G x D ranks, as
// tests/grad_stats_test.cc sets it up: data-parallel position q = g + G·d takes samples
// [q·b, (q+1)·b) of the global batch; under MEAN each position's loss is the mean over its own
// samples, DP means main_grad over D, the GTP reduce-scatter and finalizeReplicatedGrads mean over
// G; under SUM (per-token loss) dY is divided by B and every reduction sums. Under sequence
// parallelism each TP rank takes its s/T slice of the sequence, and finalizeSequenceParallelGrads
// sums the row bias's slice gradients over TP by its tag. Statistics over the
// model-parallel group tp-gtp_remat-pp with the duplicate filters, before and after stamping
// gtp_pad_zeros; then, every main_grad zeroed, the zero count is the number of distinct elements
// the statistics count.
GradStatistics gradStatistics(const Backend& backend, const StatisticsCase& c, int T, int G, int D) {
  const std::int64_t b = c.samples / (G * D);
  const ParallelLayout layout = gtpLayout(T, G, D);
  GradStatistics out;
  std::mutex mu;
  backend.runRanks(layout.world(), [&](RankContext& ctx) {
    ProcessGroups pg(ctx.comm, layout);
    Compute& compute = ctx.compute;
    GtpGradReducer reducer(compute, {c.mean, c.fp32Accum, c.async});
    Generator g1(c.seed), g2(c.seed + 1);
    ModelParallelConfig config;
    config.tensorModelParallelSize = T;
    config.sequenceParallel = c.sequenceParallel && T > 1;
    config.gtpRematSize = G;
    config.gtpPadForAlignment = c.a;
    config.useCpuInitialization = true;
    ColumnParallelLinear fc1({compute, pg.tp(), nullptr, &g1, &pg.gtpRemat(), &pg.dpCp(), &reducer}, config, c.k, c.f,
                             initMethodNormal(0.5));
    RowParallelOptions ro;
    ro.inputIsParallel = true;
    RowParallelLinear fc2({compute, pg.tp(), nullptr, &g2, &pg.gtpRemat(), &pg.dpCp(), &reducer}, config, c.f, c.k,
                          initMethodNormal(0.5), ro);
    std::vector<Parameter*> params = {fc1.weight(), fc1.bias(), &fc2.weight(), fc2.bias()};
    GradStatistics mine;
    if (T == 1 && G == 1 && ctx.comm.rank() == 0) {
      mine.w1 = valuesOf(compute, fc1.weight()->data);
      mine.b1 = valuesOf(compute, fc1.bias()->data);
      mine.w2 = valuesOf(compute, fc2.weight().data);
      mine.b2 = valuesOf(compute, fc2.bias()->data);
    }
    for (Parameter* p : params) p->mainGrad = compute.zeros(p->data.shape(), DType::kFloat32);
    const int q = pg.dpGtp().rank();
    // MEAN: each position's loss is the mean over its b samples, and the reductions average the
    // D·G positions; SUM: the loss is already the global mean (c.dy divides by B).
    const double scale = c.mean ? double(c.samples) / double(b) : 1.0;
    const std::int64_t sl = config.sequenceParallel ? c.s / T : c.s, i0 = config.sequenceParallel ? pg.tp().rank() * sl : 0;
    Values x(static_cast<std::size_t>(sl * b * c.k)), dy(static_cast<std::size_t>(sl * b * c.k));
    for (std::int64_t i = 0; i < sl; ++i)
      for (std::int64_t j = 0; j < b; ++j)
        for (std::int64_t k = 0; k < c.k; ++k) {
          const std::int64_t sample = q * b + j, at = (i * b + j) * c.k + k;
          x[std::size_t(at)] = c.x(i0 + i, sample, k);
          dy[std::size_t(at)] = c.dy(i0 + i, sample, k) * scale;
        }
    Tensor input = tensorOf(compute, DType::kFloat32, x, Shape{sl, b, c.k});
    Tensor hidden = fc1.forward(input).output;
    fc2.forward(hidden);
    Tensor dHidden = fc2.backward(tensorOf(compute, DType::kFloat32, dy, Shape{sl, b, c.k}));
    fc1.backward(dHidden);
    reducer.drain();
    for (Parameter* p : params)
      if (!isGtpShard(*p)) compute.axpy(1.f, p->grad, p->mainGrad);
    for (Parameter* p : params)
      pg.dp().allReduce(p->mainGrad, AllReduceOptions{c.mean ? ReduceOp::kMean : ReduceOp::kSum})->wait();
    finalizeSequenceParallelGrads(params, pg.tp(), config.sequenceParallel);
    finalizeReplicatedGrads(params, &pg.gtpRemat(), nullptr, c.mean);
    const DuplicateFilter filter{&pg.tp(), nullptr, &pg.gtpRemat(), nullptr};
    Collectives& stats = pg.modelParallel();
    mine.uncorrectedZeros = countZeros(compute, params, filter, stats);
    stampGtpPadZeros(params);
    mine.norm = gradNormL2(compute, params, filter, stats);
    mine.zeros = countZeros(compute, params, filter, stats);
    for (Parameter* p : params) compute.fill(p->mainGrad, 0.0);
    mine.countedElements = countZeros(compute, params, filter, stats);
    std::lock_guard<std::mutex> lock(mu);
    if (ctx.comm.rank() == 0) out = std::move(mine);
  });
  return out;
}

// ‖M‖, the L2 norm of the gradient's magnitudes (each element's sum of |terms|), in double: every
// factorization computes each element in fp32 within (L + 8)·2^-24 of M_e, L the longest reduction
// (s·B samples, K or F features, D·G partial sums), the wgrads once more through the rounded hidden
// activation or its gradient. So the two norms differ by at most 4·(L + 8)·2^-24·‖M‖, a bound that
// still holds where the gradient cancels (sin/cos data sum to far less than their magnitudes).
double normOfMagnitudes(const StatisticsCase& c, const GradStatistics& weights) {
  const std::int64_t m = c.s * c.samples, K = c.k, F = c.f;
  std::vector<double> aH(std::size_t(m * F)), adH(std::size_t(m * F), 0.0), aX(std::size_t(m * K)),
      adY(std::size_t(m * K));
  for (std::int64_t i = 0; i < c.s; ++i)
    for (std::int64_t n = 0; n < c.samples; ++n)
      for (std::int64_t k = 0; k < K; ++k) {
        aX[std::size_t((i * c.samples + n) * K + k)] = std::fabs(c.x(i, n, k));
        adY[std::size_t((i * c.samples + n) * K + k)] = std::fabs(c.dy(i, n, k));
      }
  for (std::int64_t r = 0; r < m; ++r)
    for (std::int64_t f = 0; f < F; ++f) {
      double h = std::fabs(weights.b1[std::size_t(f)]), dh = 0;
      for (std::int64_t k = 0; k < K; ++k) {
        h += aX[std::size_t(r * K + k)] * std::fabs(weights.w1[std::size_t(f * K + k)]);
        dh += adY[std::size_t(r * K + k)] * std::fabs(weights.w2[std::size_t(k * F + f)]);
      }
      aH[std::size_t(r * F + f)] = h;
      adH[std::size_t(r * F + f)] = dh;
    }
  double sq = 0;
  for (std::int64_t f = 0; f < F; ++f) {
    double db1 = 0;
    for (std::int64_t r = 0; r < m; ++r) db1 += adH[std::size_t(r * F + f)];
    sq += db1 * db1;
    for (std::int64_t k = 0; k < K; ++k) {
      double dw1 = 0, dw2 = 0;
      for (std::int64_t r = 0; r < m; ++r) {
        dw1 += adH[std::size_t(r * F + f)] * aX[std::size_t(r * K + k)];
        dw2 += adY[std::size_t(r * K + k)] * aH[std::size_t(r * F + f)];
      }
      sq += dw1 * dw1 + dw2 * dw2;
    }
  }
  for (std::int64_t k = 0; k < K; ++k) {
    double db2 = 0;
    for (std::int64_t r = 0; r < m; ++r) db2 += adY[std::size_t(r * K + k)];
    sq += db2 * db2;
  }
  return std::sqrt(sq);
}

// A statistics case and the factorization T x G x D it runs on.
struct Factorization {
  StatisticsCase c;
  int T = 1, G = 1, D = 1;
  std::int64_t distinct = 0;     // the distinct gradient elements: both weights and both biases, unpadded
  std::int64_t padElements = 0;  // the pad rows' elements over all TP slices
  std::int64_t longest = 0;      // the longest reduction any gradient element goes through
};

rc::Gen<Factorization> genFactorization() {
  return rc::gen::exec([] {
    Factorization x;
    StatisticsCase& c = x.c;
    x.T = *pick<int>({2, 1, 3, 4});
    std::vector<int> gs, ds;
    for (int g : {2, 1, 4, 3, 8})
      if (x.T * g <= 16) gs.push_back(g);
    x.G = *pick(gs);
    for (int d : {2, 1, 3, 4})
      if (x.T * x.G * d <= 16) ds.push_back(d);
    x.D = *pick(ds);
    const int T = x.T, G = x.G, D = x.D;
    c.sequenceParallel = T > 1 && *flag();
    c.s = *pick<std::int64_t>({2, 1, 3}) * (c.sequenceParallel ? T : 1);
    c.samples = G * D * *pick<std::int64_t>({1, 2});
    c.k = *pick<std::int64_t>({3, 1, 2, 5, 8});
    std::int64_t f0 = *pick<std::int64_t>({2, 1, 3, 5});
    if (*flag()) f0 *= G;
    c.f = T * f0;
    c.deadFeature = *rc::gen::container<std::vector<bool>>(std::size_t(c.k), pick<bool>({false, false, true}));
    c.mean = !*flag();
    c.async = *flag();
    c.fp32Accum = *flag();
    c.a = *genPadForAlignment({f0, c.k}, G);  // fc1's Dlog F/T, fc2's Dlog K
    c.seed = *genSeed();
    x.distinct = 2 * c.k * c.f + c.f + c.k;
    // Per TP slice: fc1 pads (F/T + pad)·K, fc2 pads (K + pad)·F/T.
    if (G > 1)
      x.padElements =
          T * gtpRematShardDim0(f0, G, c.a).padLength * c.k + gtpRematShardDim0(c.k, G, c.a).padLength * c.f;
    // Sequence parallelism adds the T partial sums of the row bias gradient.
    x.longest = std::max({c.s * c.samples, c.k, c.f}) + G * D + (c.sequenceParallel ? T : 0);
    return x;
  });
}

void logFactorization(const Factorization& x) {
  const StatisticsCase& c = x.c;
  RC_TAG(x.G > 1 ? "GTP_remat" : "no GTP_remat");
  RC_LOG() << "T=" << x.T << " G=" << x.G << " D=" << x.D << " s=" << c.s << " B=" << c.samples << " K=" << c.k
           << " F=" << c.f << " a=" << c.a << (c.mean ? " MEAN" : " SUM") << (c.async ? " async" : " sync")
           << (c.fp32Accum ? " fp32-accum" : "") << (c.sequenceParallel ? " sequence-parallel" : "") << "\n";
}

// How far a norm computed on `backend` may be from the exact one's: see normOfMagnitudes.
double normBound(const Backend& backend, const Factorization& x, const GradStatistics& weights) {
  return 4.0 * double(x.longest + 8) * tools::gemmAccumulationUnit(backend.name) * normOfMagnitudes(x.c, weights);
}

TPSIM_PROP(GtpLaws, GradNormAndZeroCountAreTheSameForEveryFactorization, kStatisticsCases) {
  const Factorization x = *genFactorization();
  logFactorization(x);
  for (const Backend* b : usableBackends()) {
    const GradStatistics reference = gradStatistics(*b, x.c, 1, 1, 1);
    const GradStatistics got = gradStatistics(*b, x.c, x.T, x.G, x.D);
    const double bound = normBound(*b, x, reference);
    RC_LOG() << b->name << ": T=G=D=1: norm " << reference.norm << ", zeros " << reference.zeros
             << "; this factorization: norm " << got.norm << " (|difference| " << std::fabs(got.norm - reference.norm)
             << ", bound " << bound << "), zeros " << got.zeros << " (" << got.uncorrectedZeros
             << " before the pad correction), " << got.countedElements << " elements counted of " << x.distinct << "\n";
    RC_ASSERT(reference.countedElements == x.distinct);
    RC_ASSERT(got.countedElements == x.distinct);
    RC_ASSERT(std::fabs(got.norm - reference.norm) <= bound);
    RC_ASSERT(got.zeros == reference.zeros);
    RC_ASSERT(got.uncorrectedZeros - got.zeros == x.padElements);
  }
}

// The same factorization on the simulator and on the gpu backend: the same zero counts before and
// after the pad correction (so the same pad counts), the same number of elements counted, and
// norms within the gpu's bound of each other.
TEST(CrossBackend, GradNormAndZeroCountsAgreeOnSimAndGpu) {
  TPSIM_REQUIRE_BACKEND("gpu");
  const Backend& sim = backendNamed("sim");
  checkProperty(kCrossBackendStatisticsCases, [&] {
    const Factorization x = *genFactorization();
    logFactorization(x);
    const GradStatistics want = gradStatistics(sim, x.c, x.T, x.G, x.D);
    const GradStatistics got = gradStatistics(other, x.c, x.T, x.G, x.D);
    const double bound = normBound(other, x, gradStatistics(sim, x.c, 1, 1, 1));
    RC_LOG() << "sim: norm " << want.norm << ", zeros " << want.zeros << " (" << want.uncorrectedZeros << "); "
             << other.name << ": norm " << got.norm << ", zeros " << got.zeros << " (" << got.uncorrectedZeros
             << "); bound " << bound << "\n";
    RC_ASSERT(got.countedElements == want.countedElements);
    RC_ASSERT(got.zeros == want.zeros);
    RC_ASSERT(got.uncorrectedZeros == want.uncorrectedZeros);
    RC_ASSERT(std::fabs(got.norm - want.norm) <= bound);
  });
}

// ---- Item 18 ----------------------------------------------------------------------------------

// The reducer itself on G ranks: one to three GTP shards reduced over one or two steps, once with the
// fp32-accumulation option and once without, on identical wgrads. At G <= 2 main_grad is bitwise
// the plain reduce-scatter's and no fp32 dispatch is issued; at G > 2 every reduction dispatches the
// variant (its accuracy is an expectation, not asserted). reduceScatterWithFp32Accumulation on the
// same group likewise: bitwise the plain reduce-scatter at G = 2, its fp32 path only at G > 2.
TPSIM_PROP(GtpLaws, Fp32AccumulationReduceScatterIsBypassedBitwiseAtTwoPeers, kBypassCases) {
  const int G = *pick<int>({2, 2, 2, 3, 4, 8});
  const int weights = *pick<int>({1, 2, 3}), steps = *pick<int>({1, 2});
  const DType wire = *genFloatDtype();
  const DType mainGradDtype = *pick<DType>({DType::kFloat32, wire});
  const bool mean = !*flag(), async = *flag();
  std::vector<std::int64_t> dims;
  for (int i = 0; i < weights; ++i) dims.push_back(*pick<std::int64_t>({1, 2, 3, 5, 8, 13, 16, 31}));
  const std::int64_t perRow = *pick<std::int64_t>({1, 2, 3, 5});
  const int a = *genPadForAlignment(dims, G);
  const std::uint64_t seed = *genSeed();
  RC_TAG(G <= 2 ? "G = 2" : "G > 2");
  RC_LOG() << "G=" << G << " weights " << weights << " steps " << steps << " wire " << dtypeName(wire) << " main_grad "
           << dtypeName(mainGradDtype) << (mean ? " MEAN" : " SUM") << (async ? " async" : " sync") << " a=" << a
           << "\n";
  for (const Backend* b : usableBackends()) {
    Problems problems;
    b->runRanks(G, [&](RankContext& ctx) {
      const int g = ctx.comm.rank();
      std::map<bool, std::vector<Values>> mainGrads;
      std::map<bool, int> dispatches;
      for (bool fp32Accum : {false, true}) {
        GtpGradReducer reducer(ctx.compute, {mean, fp32Accum, async});
        std::vector<Parameter> shards(static_cast<std::size_t>(weights));
        for (int i = 0; i < weights; ++i) {
          shards[std::size_t(i)].name = "w" + std::to_string(i);
          shards[std::size_t(i)].data = ctx.compute.zeros({dims[std::size_t(i)], perRow}, wire);
          wrapGtp(ctx.compute, shards[std::size_t(i)], ctx.comm, a);
          shards[std::size_t(i)].mainGrad = ctx.compute.zeros(shards[std::size_t(i)].data.shape(), mainGradDtype);
        }
        for (int step = 0; step < steps; ++step)
          for (int i = 0; i < weights; ++i) {
            const std::int64_t n = dims[std::size_t(i)] * perRow;
            Tensor dW = tensorOf(ctx.compute, wire, nonZeroNormals(seed + 97 * std::uint64_t(g) + 13 * std::uint64_t(i) +
                                                                        5 * std::uint64_t(step), n),
                                 Shape{dims[std::size_t(i)], perRow});
            reducer.reduceScatter(shards[std::size_t(i)], dW);
          }
        reducer.drain();
        for (const Parameter& p : shards) mainGrads[fp32Accum].push_back(valuesOf(ctx.compute, p.mainGrad));
        dispatches[fp32Accum] = reducer.fp32AccumDispatches();
      }
      const std::string at = "rank " + std::to_string(g) + ": ";
      // The free function on the same group: the plain reduce-scatter at size <= 2, the fp32 path above.
      const std::int64_t m = dims[0] * perRow;
      Tensor in = tensorOf(ctx.compute, wire, nonZeroNormals(seed + 31 * std::uint64_t(g) + 7, G * m), Shape{G * m});
      Tensor plain = ctx.compute.empty({m}, wire), viaFp32 = ctx.compute.empty({m}, wire);
      ctx.comm.reduceScatter(in, plain)->wait();
      const bool ranFp32 = reduceScatterWithFp32Accumulation(ctx.compute, ctx.comm, in, viaFp32);
      problems.check(ranFp32 == (G > 2), at + "reduceScatterWithFp32Accumulation says its fp32 path " +
                                             (ranFp32 ? "ran" : "did not run") + " at G = " + std::to_string(G));
      if (G <= 2)
        problems.check(sameBits(valuesOf(ctx.compute, viaFp32), valuesOf(ctx.compute, plain)),
                       at + "reduceScatterWithFp32Accumulation differs from the plain reduce-scatter at G = 2");
      problems.check(dispatches[false] == 0, at + "the plain reducer dispatched the fp32 variant");
      if (G <= 2) {
        problems.check(dispatches[true] == 0, at + "fp32 accumulation dispatched " + std::to_string(dispatches[true]) +
                                                  " times at G = " + std::to_string(G));
        for (int i = 0; i < weights; ++i)
          problems.check(sameBits(mainGrads[true][std::size_t(i)], mainGrads[false][std::size_t(i)]),
                         at + "w" + std::to_string(i) + ": main_grad with fp32 accumulation " +
                             str(mainGrads[true][std::size_t(i)]) + " differs from the plain reduce-scatter's " +
                             str(mainGrads[false][std::size_t(i)]));
      } else {
        problems.check(dispatches[true] == weights * steps, at + "fp32 accumulation dispatched " +
                                                                 std::to_string(dispatches[true]) + " times for " +
                                                                 std::to_string(weights * steps) + " reductions");
      }
    });
    problems.assertNone();
  }
}

// The option through tools::runSharded at G in {1, 2}: every result is bitwise the same with and
// without --fp32-accum-reduce-scatter, and every rank issues the same collectives (no all-to-all).
TPSIM_PROP(GtpLaws, Fp32AccumulationFlagChangesNothingAtTwoPeersOrFewer, kRunnerBypassCases) {
  const RunConfig base = *genWithGtp(*genRunConfig(tools::layerKinds()), {2, 2, 1});
  RunConfig with = base, without = base;
  with.fp32AccumReduceScatter = true;
  without.fp32AccumReduceScatter = false;
  const TensorMap inputs = realInputs(base);
  RC_TAG(base.layer->name(), base.gtpRemat == 1 ? "G = 1" : "G = 2");
  for (const Backend* b : usableBackends()) {
    tools::RunResult r1, r2;
    try {
      r1 = b->runLayer(with, inputs);
      r2 = b->runLayer(without, inputs);
    } catch (const std::exception& e) {
      failLayerCase(with, Numerics::kReal, b->name, inputs, std::string("a run threw: ") + e.what());
    }
    for (const auto& [name, t] : r2.results) {
      auto it = r1.results.find(name);
      if (it == r1.results.end() || it->second.shape != t.shape || it->second.dtype != t.dtype ||
          !sameBits(it->second.values, t.values))
        failLayerCase(with, Numerics::kReal, b->name, inputs,
                      name + " with --fp32-accum-reduce-scatter " +
                          (it == r1.results.end() ? std::string("missing") : str(it->second.values)) +
                          " differs from the plain reduce-scatter's " + str(t.values));
    }
    if (r1.trace.size() != r2.trace.size())
      failLayerCase(with, Numerics::kReal, b->name, inputs, "the two runs have different worlds");
    auto event = [](const std::vector<TraceEvent>& t, std::size_t i) {
      return i < t.size() ? t[i].op + " on " + t[i].group + " (" + t[i].dtype + ", " + std::to_string(t[i].bytes) +
                                " bytes)"
                          : std::string("nothing");
    };
    for (std::size_t r = 0; r < r1.trace.size(); ++r) {
      const auto &a = r1.trace[r], &c = r2.trace[r];
      for (std::size_t i = 0; i < std::max(a.size(), c.size()); ++i)
        if (event(a, i) != event(c, i))
          failLayerCase(with, Numerics::kReal, b->name, inputs,
                        "rank " + std::to_string(r) + "'s collective " + std::to_string(i) + " is " + event(a, i) +
                            " with --fp32-accum-reduce-scatter, " + event(c, i) + " without (" +
                            std::to_string(a.size()) + " and " + std::to_string(c.size()) + " events)");
    }
  }
}

}  // namespace
}  // namespace tpsim::props
