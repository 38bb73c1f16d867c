// SPEC 6 item 8 (with 7 and 10) for the routed experts of SPEC 4.8: GroupedParallelLinear with E
// local experts, column or row mode, on T × G ranks (G the EGTP_remat group) against the same layer
// without GTP_remat on the same rank, with identical data on every GTP peer. On exact data the
// grouped GEMM's forward output, dX and bias gradients are bitwise those of the layer without
// GTP_remat, every expert's main_grad, gathered over the peers with the padding stripped, is its
// wgrad (MEAN) or G times it (SUM), pad rows of every shard and main_grad are zero, and the batch
// costs one gather per forward and per backward and one reduce-scatter per backward whatever E is.
#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <sstream>

#include "core/grouped_linear.h"
#include "core/gtp.h"
#include "core/init.h"
#include "props/backends.h"
#include "props/generators.h"
#include "props/harness.h"
#include "props/rank_checks.h"
#include "tests/sim_test_util.h"

namespace tpsim::props {
namespace {

using testing::tensorOf;
using testing::valuesOf;

// Default case budget (README.md, "Budget and soak").
constexpr int kGroupedCases = 1000;

// Small integers in [-amplitude, amplitude] drawn from the layer's own generator, so that a layer
// with GTP_remat and one without, built from equally seeded generators, hold the same experts, and
// the experts differ from each other.
InitMethod initIntegers(int amplitude) {
  return [amplitude](Generator& gen, std::vector<float>& master) {
    gen.uniform(master, 0.0, 1.0);
    for (float& v : master) v = std::min(float(amplitude), std::floor(v * float(2 * amplitude + 1)) - float(amplitude));
  };
}

bool powerOfTwo(int n) { return (n & (n - 1)) == 0; }

// E experts in 1..4 with random token counts (an expert without tokens, and no tokens at all,
// included), column or row mode, T in {1, 2}, G in {1, 2, 3, 4}, Dlog and K_local small (1, primes,
// Dlog a multiple of G half the time), a in {0 when G divides Dlog, 1, 16, 32}, MEAN (only for G a
// power of two: 1/G exact) or SUM, the fp32-accumulation reduce-scatter on or off, fp32, bf16 or
// fp16 with an fp32 or same-dtype main_grad, bias on or off. The data are integers small enough
// that every product and partial sum, the SUM over G identical peers included, is exact in every
// dtype involved, so the wgrads compare with ==.
TPSIM_PROP(GroupedLinearLaws, IdenticalDataOnEveryPeerGivesTheExpertsWithoutGtpBitwise, kGroupedCases) {
  const int T = *pick<int>({1, 2});
  const int G = *pick<int>({2, 1, 4, 3});
  const int E = *pick<int>({2, 1, 3, 4});
  const bool column = !*flag();
  std::vector<std::int64_t> splits;
  for (int e = 0; e < E; ++e) splits.push_back(*pick<std::int64_t>({1, 0, 2, 3, 5}));
  std::int64_t dLog = *pick<std::int64_t>({1, 2, 3, 5, 7, 8, 13});  // N/T in column mode, N in row mode
  if (*flag()) dLog *= G;
  const std::int64_t kLocal = *pick<std::int64_t>({1, 2, 3, 5, 8});  // K in column mode, K/T in row mode
  const int a = *genPadForAlignment({dLog}, G);
  const DType dtype = *genFloatDtype();
  const DType mainGradDtype = dtype == DType::kFloat32 ? dtype : *pick<DType>({DType::kFloat32, dtype});
  const bool mean = powerOfTwo(G) && !*flag();
  const bool fp32Accum = *flag(), async = *flag(), bias = *flag();
  const std::uint64_t seed = *genSeed();
  std::int64_t M = 0, maxTokens = 0;
  for (std::int64_t m : splits) M += m, maxTokens = std::max(maxTokens, m);
  // The longest sum: K_local products and the bias (forward), Dlog products (dX), and the SUM over
  // the G peers of an expert's m_i products (wgrad).
  const std::int64_t longest = std::max({kLocal + 1, dLog, G * maxTokens, std::int64_t(1)});
  const std::int64_t limit = std::min(exactLimit(dtype), exactLimit(mainGradDtype));
  const int amplitude = int(std::clamp<double>(std::floor(std::sqrt(double(limit) / double(longest))), 1.0, 8.0));
  const std::int64_t N = column ? T * dLog : dLog, K = column ? kLocal : T * kLocal;
  const GtpShardGeometry geo = gtpRematShardDim0(dLog, G, a);
  RC_TAG(column ? "column" : "row", G == 1 ? "G = 1" : geo.padLength == 0 ? "no padding" : "padded");
  std::ostringstream splitText;
  for (std::int64_t m : splits) splitText << " " << m;
  RC_LOG() << (column ? "column" : "row") << " E=" << E << " mSplits" << splitText.str() << " T=" << T << " G=" << G
           << " K=" << K << " N=" << N << " Dlog=" << dLog << " a=" << a << " -> S=" << geo.rows << " pad "
           << geo.padLength << ", " << dtypeName(dtype) << " main_grad " << dtypeName(mainGradDtype)
           << (mean ? " MEAN" : " SUM") << (fp32Accum ? " fp32-accum" : "") << (async ? " async" : " sync")
           << (bias ? " bias" : "") << ", integers up to " << amplitude << "\n";
  const LayerGrid grid(T, G);
  for (const Backend* b : usableBackends()) {
    Problems problems;
    std::mutex mu;
    // (t, e) -> the wgrad of the layer without GTP_remat on TP rank t; (t, e, g) -> main_grad shard g.
    std::map<std::pair<int, int>, Values> wgrads;
    std::map<std::tuple<int, int, int>, Values> shards;
    b->runRanks(grid.size(), [&](RankContext& ctx) {
      const int r = ctx.comm.rank(), t = grid.t(r), g = grid.g(r);
      const std::string at =
          "rank " + std::to_string(r) + " (t " + std::to_string(t) + ", g " + std::to_string(g) + "): ";
      Compute& compute = ctx.compute;
      auto tp = ctx.comm.split(g, t, "etp");
      auto egtp = ctx.comm.split(t, g, "egtp");
      GtpGradReducer reducer(compute, {mean, fp32Accum, async});
      ModelParallelConfig config;
      config.tensorModelParallelSize = T;
      config.expertGtpRematSize = G;
      config.useCpuInitialization = true;
      config.paramsDtype = dtype;
      config.gtpPadForAlignment = a;
      ModelParallelConfig plain = config;
      plain.expertGtpRematSize = 1;
      GroupedLinearOptions o;
      o.numGemms = E;
      o.parallelMode = column ? GroupedParallelMode::kColumn : GroupedParallelMode::kRow;
      o.bias = bias;
      Generator gen(seed), twinGen(seed);
      GroupedParallelLinear layer({compute, *tp, nullptr, &gen, egtp.get(), nullptr, &reducer}, config, K, N,
                                  initIntegers(amplitude), o);
      GroupedParallelLinear twin({compute, *tp, nullptr, &twinGen}, plain, K, N, initIntegers(amplitude), o);
      problems.check(layer.gtpBatched() == (G > 1), at + "gtpBatched() is " + (layer.gtpBatched() ? "true" : "false"));
      for (int e = 0; e < E; ++e) {
        if (bias) {  // the same integer biases on both layers
          const Values v = seededIntegers(seed + 101 * std::uint64_t(e + 1) + 7 * std::uint64_t(column ? t : 0),
                                          layer.outputSizePerPartition(), amplitude);
          compute.copy(tensorOf(compute, dtype, v), layer.bias(e)->data);
          compute.copy(tensorOf(compute, dtype, v), twin.bias(e)->data);
        }
        if (G > 1) layer.weight(e).mainGrad = compute.zeros(layer.weight(e).data.shape(), mainGradDtype);
      }
      // Identical on every GTP peer; per TP rank where the tensor is a TP slice.
      const std::int64_t kIn = layer.inputSizePerPartition(), nOut = layer.outputSizePerPartition();
      Tensor x = tensorOf(compute, dtype, seededIntegers(seed + 1 + (column ? 0 : 13 * std::uint64_t(t)), M * kIn,
                                                         amplitude), Shape{M, kIn});  // (M, K_local)
      Tensor dy = tensorOf(compute, dtype, seededIntegers(seed + 2 + (column ? 17 * std::uint64_t(t) : 0), M * nOut,
                                                          amplitude), Shape{M, nOut});  // (M, N_local)
      const Tensor y = layer.forward(x, splits), yTwin = twin.forward(x, splits);
      const std::string fwd = firstDifference(valuesOf(compute, y), valuesOf(compute, yTwin), "output");
      problems.check(fwd.empty(), at + fwd);
      const Tensor dx = layer.backward(dy), dxTwin = twin.backward(dy);
      reducer.drain();
      const std::string bwd = firstDifference(valuesOf(compute, dx), valuesOf(compute, dxTwin), "dX");
      problems.check(bwd.empty(), at + bwd);
      for (int e = 0; e < E; ++e) {
        const std::string ex = "expert " + std::to_string(e) + " ";
        if (bias) {
          const std::string db = firstDifference(valuesOf(compute, layer.bias(e)->grad),
                                                 valuesOf(compute, twin.bias(e)->grad), ex + "bias.grad");
          problems.check(db.empty(), at + db);
        }
        const Parameter& w = layer.weight(e);
        if (G == 1) {  // nothing wrapped: the same layer
          const std::string dw = firstDifference(valuesOf(compute, w.grad), valuesOf(compute, twin.weight(e).grad),
                                                 ex + "weight.grad at G = 1");
          problems.check(dw.empty(), at + dw);
          continue;
        }
        const std::int64_t from = firstPadRow(dLog, geo.rows, g);
        problems.check(w.data.shape() == Shape({geo.rows, kIn}),
                       at + ex + "shard shape " + w.data.shape().str() + ", expected (" + std::to_string(geo.rows) +
                           ", " + std::to_string(kIn) + ")");
        const std::string padW = padRowsNonZero(valuesOf(compute, w.data), geo.rows, from, ex + "weight shard");
        problems.check(padW.empty(), at + padW);
        const Values mainGrad = valuesOf(compute, w.mainGrad);
        const std::string padG = padRowsNonZero(mainGrad, geo.rows, from, ex + "main_grad");
        problems.check(padG.empty(), at + padG);
        std::lock_guard<std::mutex> lock(mu);
        shards[{t, e, g}] = mainGrad;
        if (g == 0) wgrads[{t, e}] = valuesOf(compute, twin.weight(e).grad);
      }
      const int gathers = layer.coalescedGathers(), scatters = layer.coalescedReduceScatters();
      const int dispatches = layer.fp32AccumDispatches();
      const int wantGathers = G > 1 ? 2 : 0, wantScatters = G > 1 ? 1 : 0, wantDispatches = fp32Accum && G > 2 ? 1 : 0;
      problems.check(gathers == wantGathers && scatters == wantScatters && dispatches == wantDispatches,
                     at + "one forward and one backward issued " + std::to_string(gathers) + " gathers, " +
                         std::to_string(scatters) + " reduce-scatters, " + std::to_string(dispatches) +
                         " fp32-accumulation dispatches; expected " + std::to_string(wantGathers) + ", " +
                         std::to_string(wantScatters) + ", " + std::to_string(wantDispatches) + " for E = " +
                         std::to_string(E));
    });
    problems.assertNone();
    if (G == 1) continue;
    // Every expert's main_grad over the peers, padding stripped: its wgrad (MEAN) or G times it (SUM).
    for (int t = 0; t < T; ++t)
      for (int e = 0; e < E; ++e) {
        Values assembled;
        for (int g = 0; g < G; ++g) {
          const Values& s = shards.at({t, e, g});
          assembled.insert(assembled.end(), s.begin(), s.end());
        }
        Values want = wgrads.at({t, e});
        assembled.resize(want.size());
        for (double& v : want) v *= mean ? 1.0 : double(G);
        const std::string diff = firstDifference(assembled, want,
                                                 "t " + std::to_string(t) + " expert " + std::to_string(e) +
                                                     " main_grad over the peers vs " + (mean ? "" : "G × ") +
                                                     "the wgrad without GTP_remat");
        if (!diff.empty()) RC_FAIL(diff);
      }
  }
}

}  // namespace
}  // namespace tpsim::props
