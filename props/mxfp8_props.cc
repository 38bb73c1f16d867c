// SPEC 6 item 8 for MXFP8 weights (core/mxfp8.h, SPEC 4.2 with a = 32·j): GTP_remat stays
// transparent when the GEMMs read an MXFP8 copy of the weight. Each peer quantizes its own shard and
// the group gathers E4M3 data and E8M0 scales; because the pad rows are zero and a shard holds whole
// 32-row blocks, no block's amax changes, so
//   - gemmWeight of a wrapped shard is bitwise gemmWeight of the unwrapped weight, for the fprop
//     (rowwise blocks) and the dgrad (columnwise blocks) operand and every compute dtype;
//   - a Column or Row layer with mxfp8 weights on T × G ranks gives the output and dX of the same
//     layer without GTP_remat, bitwise, with identical data on every peer.
// The data are real normals with spikes: a few elements scaled by 2^k, so that blocks get different
// scales and their small elements fall into E4M3's subnormals, where the cut of the blocks matters.
#include <algorithm>
#include <cmath>
#include <optional>
#include <random>
#include <sstream>

#include "core/gtp.h"
#include "core/init.h"
#include "core/layers.h"
#include "core/mxfp8.h"
#include "props/backends.h"
#include "props/generators.h"
#include "props/harness.h"
#include "props/rank_checks.h"
#include "tests/sim_test_util.h"

namespace tpsim::props {
namespace {

using testing::tensorOf;
using testing::valuesOf;

// Default case budgets (README.md, "Budget and soak").
constexpr int kOperandCases = 400;
constexpr int kLayerCases = 600;

// The largest spike exponent whose spikes of normal data stay finite in `dtype` (fp16 tops out at
// 65504; bf16 and fp32 share fp32's exponent range).
int maxSpikeExponent(DType dtype) { return dtype == DType::kFloat16 ? 8 : 24; }

// Scales `spikes` elements of `v` (positions and exponents in [-maxExponent, maxExponent] from a
// seeded engine) by 2^k, and with zeroRun zeroes a run of up to 70 consecutive elements (whole
// blocks of zeros: scale 2^-127).
void addSpikes(std::vector<float>& v, std::uint64_t seed, int spikes, int maxExponent, bool zeroRun) {
  if (v.empty()) return;
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<std::size_t> at(0, v.size() - 1);
  std::uniform_int_distribution<int> exponent(-maxExponent, maxExponent);
  for (int i = 0; i < spikes; ++i) {
    const std::size_t j = at(rng);
    v[j] = std::ldexp(v[j], exponent(rng));
  }
  if (zeroRun) {
    const std::size_t first = at(rng), length = std::uniform_int_distribution<std::size_t>(1, 70)(rng);
    std::fill(v.begin() + std::ptrdiff_t(first), v.begin() + std::ptrdiff_t(std::min(v.size(), first + length)), 0.f);
  }
}

const char* useName(GemmUse use) { return use == GemmUse::kFprop ? "fprop (rowwise)" : "dgrad (columnwise)"; }

// gemmWeight(kMxfp8) of a GTP_remat shard (G in 2..4, a in {32, 64}) against the same weight unwrapped,
// for (rows, cols) of 1, primes and around multiples of 32, weights in fp32, bf16 or fp16, both uses
// and compute dtypes fp32, bf16, fp16 and fp64: the same shape, dtype and bits on every peer.
TPSIM_PROP(Mxfp8Laws, GtpShardGivesTheGemmOperandOfTheUnwrappedWeightBitwise, kOperandCases) {
  const int G = *pick<int>({2, 4, 3});
  const int a = *pick<int>({32, 64});
  const std::int64_t rows = *pick<std::int64_t>({1, 5, 31, 32, 33, 40, 64, 65, 100, 130});
  const std::int64_t cols = *pick<std::int64_t>({1, 3, 31, 32, 33, 40, 64, 70});
  const DType dtype = *genFloatDtype();
  const int spikes = *pick<int>({2, 0, 1, 4});
  const bool zeroRun = *flag();
  const std::uint64_t seed = *genSeed();
  const GtpShardGeometry geo = gtpRematShardDim0(rows, G, a);
  std::vector<float> w(std::size_t(rows * cols));
  {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.f, 1.f);
    for (float& x : w) x = normal(rng);
  }
  addSpikes(w, seed + 1, spikes, maxSpikeExponent(dtype), zeroRun);
  const Values weight(w.begin(), w.end());
  RC_TAG(geo.padLength > geo.rows ? "padding spills" : "padded");
  RC_LOG() << "G=" << G << " a=" << a << " weight (" << rows << ", " << cols << ") " << dtypeName(dtype) << " -> S="
           << geo.rows << " pad " << geo.padLength << ", " << spikes << " spikes" << (zeroRun ? ", a run of zeros" : "")
           << "\n";
  for (const Backend* b : usableBackends()) {
    Problems problems;
    b->runRanks(G, [&](RankContext& ctx) {
      Compute& compute = ctx.compute;
      const std::string at = "rank " + std::to_string(ctx.comm.rank()) + ": ";
      Parameter plain, shard;
      plain.name = shard.name = "w";
      plain.data = tensorOf(compute, dtype, weight, Shape{rows, cols});
      shard.data = tensorOf(compute, dtype, weight, Shape{rows, cols});
      wrapGtp(compute, shard, ctx.comm, a);
      for (GemmUse use : {GemmUse::kFprop, GemmUse::kDgrad})
        for (DType computeDtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat64}) {
          const std::string what = std::string(useName(use)) + " operand in " + dtypeName(computeDtype);
          const GemmWeight got = gemmWeight(compute, shard, WeightFormat::kMxfp8, use, computeDtype);
          const GemmWeight want = gemmWeight(compute, plain, WeightFormat::kMxfp8, use, computeDtype);
          if (got.weight.shape() != Shape({rows, cols}) || got.weight.dtype() != computeDtype) {
            problems.add(at + what + " of the shard is " + got.weight.str() + ", expected " + want.weight.str());
            continue;
          }
          const std::string diff = firstDifference(valuesOf(compute, got.weight), valuesOf(compute, want.weight),
                                                   what + " of the shard vs the unwrapped weight");
          problems.check(diff.empty(), at + diff);
        }
    });
    problems.assertNone();
  }
}

// Column (gather_output or not) or Row (input_is_parallel or not), T in {1, 2} with or without
// sequence parallelism, G in 1..4, a in {32, 64}, bias, a frozen weight (which keeps its columnwise
// copy from forward), fp32, bf16 or fp16, K and N/T around multiples of 32 (tail blocks) and
// CPU-initialized weights with spikes: with mxfp8 weights and identical data on every GTP peer, the
// GTP_remat layer's output, dX and bias gradient are those of the same layer without GTP_remat on
// the same rank, bitwise.
TPSIM_PROP(Mxfp8Laws, GtpLayersGiveTheOutputAndDgradOfTheLayerWithoutGtpBitwise, kLayerCases) {
  const bool column = !*flag();
  const int T = *pick<int>({1, 2});
  const int G = *pick<int>({2, 1, 4, 3});
  const int a = *pick<int>({32, 64});
  const DType dtype = *genFloatDtype();
  const std::int64_t dLog = *pick<std::int64_t>({7, 1, 31, 32, 33, 72});   // N/T (column) or N (row)
  const std::int64_t kLocal = *pick<std::int64_t>({5, 1, 31, 33, 40, 64});  // K (column) or K/T (row)
  const bool sp = T > 1 && *flag();
  const bool bias = *flag(), frozen = *flag();
  const bool gatherOutput = column && !sp && *flag();
  const bool inputIsParallel = !column && (sp || !*flag());
  const std::int64_t s = (sp ? T : 1) * *pick<std::int64_t>({1, 2, 3}), batch = *pick<std::int64_t>({1, 2});
  const int spikes = *pick<int>({2, 0, 1, 4});
  const std::uint64_t seed = *genSeed();
  const std::int64_t N = column ? T * dLog : dLog, K = column ? kLocal : T * kLocal;
  RC_TAG(column ? "column" : "row", G == 1 ? "G = 1" : "GTP_remat");
  RC_LOG() << (column ? "column" : "row") << " T=" << T << " G=" << G << " a=" << a << " " << dtypeName(dtype)
           << " s=" << s << " b=" << batch << " K=" << K << " N=" << N << (sp ? " sequence-parallel" : "")
           << (bias ? " bias" : "") << (frozen ? " frozen" : "") << (gatherOutput ? " gather-output" : "")
           << (inputIsParallel ? " input-is-parallel" : "") << ", " << spikes << " spikes\n";
  // The master weight (N, K): normal, with spikes at the same places on every rank and in both layers.
  const InitMethod init = [seed, spikes, dtype](Generator& gen, std::vector<float>& master) {
    initMethodNormal(0.5)(gen, master);
    addSpikes(master, seed + 3, spikes, maxSpikeExponent(dtype), false);
  };
  const LayerGrid grid(T, G);
  for (const Backend* b : usableBackends()) {
    Problems problems;
    b->runRanks(grid.size(), [&](RankContext& ctx) {
      const int r = ctx.comm.rank(), t = grid.t(r), g = grid.g(r);
      const std::string at =
          "rank " + std::to_string(r) + " (t " + std::to_string(t) + ", g " + std::to_string(g) + "): ";
      Compute& compute = ctx.compute;
      auto tp = ctx.comm.split(g, t, "tp");
      auto gtp = ctx.comm.split(t, g, "gtp");
      GtpGradReducer reducer(compute, {});
      ModelParallelConfig config;
      config.tensorModelParallelSize = T;
      config.gtpRematSize = G;
      config.sequenceParallel = sp;
      config.useCpuInitialization = true;
      config.paramsDtype = dtype;
      config.gtpPadForAlignment = a;
      config.weightFormat = WeightFormat::kMxfp8;
      ModelParallelConfig plain = config;
      plain.gtpRematSize = 1;
      Generator gen(seed), twinGen(seed);
      const LayerContext lc{compute, *tp, nullptr, &gen, gtp.get(), nullptr, &reducer};
      const LayerContext lcTwin{compute, *tp, nullptr, &twinGen};
      std::optional<ColumnParallelLinear> col, colTwin;
      std::optional<RowParallelLinear> row, rowTwin;
      Parameter *w, *wTwin;
      if (column) {
        ColumnParallelOptions o;
        o.bias = bias;
        o.gatherOutput = gatherOutput;
        col.emplace(lc, config, K, N, init, o);
        colTwin.emplace(lcTwin, plain, K, N, init, o);
        w = col->weight();
        wTwin = colTwin->weight();
      } else {
        RowParallelOptions o;
        o.bias = bias;
        o.inputIsParallel = inputIsParallel;
        row.emplace(lc, config, K, N, init, o);
        rowTwin.emplace(lcTwin, plain, K, N, init, o);
        w = &row->weight();
        wTwin = &rowTwin->weight();
      }
      problems.check(isGtpShard(*w) == (G > 1), at + "the weight is " + (isGtpShard(*w) ? "" : "not ") +
                                                    "a GTP_remat shard at G = " + std::to_string(G));
      w->requiresGrad = wTwin->requiresGrad = !frozen;
      if (G > 1 && !frozen) w->mainGrad = compute.zeros(w->data.shape(), DType::kFloat32);
      // The input: this rank's sequence chunk under SP, its K/T slice for a parallel row input, else
      // the whole (replicated) input.
      const bool inputPerRank = sp || inputIsParallel;
      const std::int64_t xLast = column || !inputIsParallel ? K : K / T;
      const Shape xShape{sp && column ? s / T : s, batch, xLast};
      Tensor x = tensorOf(compute, dtype, nonZeroNormals(seed + 5 + (inputPerRank ? 11 * std::uint64_t(t) : 0),
                                                         xShape.numel()), xShape);
      const Tensor y = column ? col->forward(x).output : row->forward(x).output;
      const Tensor yTwin = column ? colTwin->forward(x).output : rowTwin->forward(x).output;
      const std::string fwd = firstDifference(valuesOf(compute, y), valuesOf(compute, yTwin), "output");
      problems.check(fwd.empty(), at + fwd);
      const bool outputPerRank = column ? !gatherOutput : sp;
      Tensor dy = tensorOf(compute, dtype, nonZeroNormals(seed + 7 + (outputPerRank ? 13 * std::uint64_t(t) : 0),
                                                          y.numel()), y.shape());
      const Tensor dx = column ? col->backward(dy) : row->backward(dy);
      const Tensor dxTwin = column ? colTwin->backward(dy) : rowTwin->backward(dy);
      reducer.drain();
      const std::string bwd = firstDifference(valuesOf(compute, dx), valuesOf(compute, dxTwin), "dX");
      problems.check(bwd.empty(), at + bwd);
      if (bias) {
        Parameter* pb = column ? col->bias() : row->bias();
        Parameter* pbTwin = column ? colTwin->bias() : rowTwin->bias();
        const std::string db = firstDifference(valuesOf(compute, pb->grad), valuesOf(compute, pbTwin->grad),
                                               "bias.grad");
        problems.check(db.empty(), at + db);
      }
    });
    problems.assertNone();
  }
}

}  // namespace
}  // namespace tpsim::props
