// GroupedParallelLinear (SPEC 4.8 routed experts, G4, G14): the grouped GEMM against per-expert dense
// math in double, EGTP_remat on against off (MEAN and SUM, same and different data per peer, with
// padding that spills over whole shards), one coalesced collective per direction for all E experts,
// the fp32-accumulation all-to-all, interleaving with the dense layers' deferred reduce-scatters,
// pad rows through SGD, and the argument errors.
#include "core/grouped_linear.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "core/attributes.h"
#include "core/gtp.h"
#include "core/layers.h"
#include "core/process_groups.h"
#include "sim/world.h"
#include "tests/sim_test_util.h"

namespace tpsim {
namespace {

using ::testing::HasSubstr;
using testing::columns;
using testing::errorOf;
using testing::maxRelError;
using testing::rows;
using testing::runRanks;
using testing::tensorOf;
using testing::valuesOf;
using testing::wave;

using Splits = std::vector<std::int64_t>;
using Matrix = std::vector<double>;  // row-major host matrix

void expectNear(const std::vector<double>& got, const std::vector<double>& want, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (std::size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(got[i], want[i], tol * (1 + std::fabs(want[i]))) << what << " mismatch at index " << i;
}

// Per-expert dense math in double. Expert i owns rows [o_i, o_i + m_i) of the (M, ·) operands.
Splits offsetsOf(const Splits& splits) {
  Splits o(splits.size() + 1, 0);
  for (std::size_t i = 0; i < splits.size(); ++i) o[i + 1] = o[i] + splits[i];
  return o;
}

// y = x_i·W_iᵀ + b_i.  x: (M, K)  w[i]: (N, K)  b[i]: (N) or empty.  Returns (M, N).
Matrix refForward(const Matrix& x, const std::vector<Matrix>& w, const std::vector<Matrix>& b, const Splits& splits,
                  std::int64_t K, std::int64_t N) {
  const Splits o = offsetsOf(splits);
  Matrix y(o.back() * N, 0.0);
  for (std::size_t e = 0; e < splits.size(); ++e)
    for (std::int64_t r = o[e]; r < o[e + 1]; ++r)
      for (std::int64_t n = 0; n < N; ++n) {
        double acc = b.empty() ? 0.0 : b[e][n];
        for (std::int64_t k = 0; k < K; ++k) acc += x[r * K + k] * w[e][n * K + k];
        y[r * N + n] = acc;
      }
  return y;
}

// dX = dY_i·W_i.  dy: (M, N)  Returns (M, K).
Matrix refDgrad(const Matrix& dy, const std::vector<Matrix>& w, const Splits& splits, std::int64_t K, std::int64_t N) {
  const Splits o = offsetsOf(splits);
  Matrix dx(o.back() * K, 0.0);
  for (std::size_t e = 0; e < splits.size(); ++e)
    for (std::int64_t r = o[e]; r < o[e + 1]; ++r)
      for (std::int64_t k = 0; k < K; ++k)
        for (std::int64_t n = 0; n < N; ++n) dx[r * K + k] += dy[r * N + n] * w[e][n * K + k];
  return dx;
}

// dW_e = dY_eᵀ·X_e: (N, K).
Matrix refWgrad(const Matrix& dy, const Matrix& x, const Splits& splits, std::size_t e, std::int64_t K,
                std::int64_t N) {
  const Splits o = offsetsOf(splits);
  Matrix dw(N * K, 0.0);
  for (std::int64_t r = o[e]; r < o[e + 1]; ++r)
    for (std::int64_t n = 0; n < N; ++n)
      for (std::int64_t k = 0; k < K; ++k) dw[n * K + k] += dy[r * N + n] * x[r * K + k];
  return dw;
}

// db_e = Σ rows of dY_e: (N).
Matrix refBiasGrad(const Matrix& dy, const Splits& splits, std::size_t e, std::int64_t N) {
  const Splits o = offsetsOf(splits);
  Matrix db(N, 0.0);
  for (std::int64_t r = o[e]; r < o[e + 1]; ++r)
    for (std::int64_t n = 0; n < N; ++n) db[n] += dy[r * N + n];
  return db;
}

// Rows [g·S, (g+1)·S) of m (dLog, cols) padded with zero rows: GTP shard g's rows (SPEC 4.2).
Matrix shardRows(const Matrix& m, std::int64_t cols, std::int64_t S, int g) {
  Matrix out(S * cols, 0.0);
  for (std::int64_t r = 0; r < S; ++r)
    for (std::int64_t c = 0; c < cols; ++c) {
      const std::int64_t src = (g * S + r) * cols + c;
      if (src < std::int64_t(m.size())) out[r * cols + c] = m[src];
    }
  return out;
}

// The TP-local logical weights of every expert, read from a layer without GTP_remat.
std::vector<Matrix> weightsOf(Compute& compute, GroupedParallelLinear& layer) {
  std::vector<Matrix> w;
  for (int e = 0; e < layer.numGemms(); ++e) w.push_back(valuesOf(compute, layer.weight(e).data));
  return w;
}

void allocateMainGrads(Compute& compute, GroupedParallelLinear& layer, DType dtype = DType::kFloat32) {
  for (int e = 0; e < layer.numGemms(); ++e)
    layer.weight(e).mainGrad = compute.zeros(layer.weight(e).data.shape(), dtype);
}

// ---- G4 and the no-GTP case -------------------------------------------------------------------

// G4: a grouped linear of 3 GEMMs over G = 4: weight0's weight_list is the 3 shards in expert order,
// each stamped with its expert_idx and the GTP attributes; only weight0 carries the list.
TEST(GroupedLinear, G4WeightListNamesEveryExpert) {
  runRanks(4, [](RankContext& ctx) {
    GtpGradReducer reducer(ctx.compute, {});
    auto tp = ctx.comm.split(ctx.comm.rank(), 0, "tp");
    Generator gen(3);
    ModelParallelConfig config;
    config.useCpuInitialization = true;
    GroupedLinearOptions o;
    o.numGemms = 3;
    GroupedParallelLinear layer({ctx.compute, *tp, nullptr, &gen, &ctx.comm, nullptr, &reducer}, config, 8, 20,
                                initMethodNormal(0.5), o);
    ASSERT_TRUE(layer.gtpBatched());
    const auto& list = layer.weight(0).attrs.weightList;
    ASSERT_TRUE(list.has_value());
    ASSERT_EQ(list->size(), 3u);
    for (int e = 0; e < 3; ++e) {
      const Parameter& w = layer.weight(e);
      EXPECT_EQ((*list)[e], &w) << "entry " << e;
      EXPECT_EQ((*list)[e]->attrs.expertIdx, std::optional<int>(e));
      EXPECT_EQ(w.name, "experts.weight" + std::to_string(e));
      EXPECT_EQ(w.attrs.isGtpWeightRemat, std::optional<bool>(true));
      EXPECT_EQ(w.attrs.group, std::optional<Collectives*>(&ctx.comm));
      EXPECT_EQ(w.attrs.padLength, std::optional<int>(44)) << "Dlog 20 pads to 64 = a·G";
      EXPECT_EQ(w.data.shape(), Shape({16, 8}));
      EXPECT_EQ(w.attrs.partitionDim, std::optional<int>(0));
      EXPECT_EQ(w.attrs.weightList.has_value(), e == 0) << "weight" << e;
      EXPECT_FALSE(layer.bias(e)->attrs.isGtpWeightRemat.has_value()) << "biases are never sharded";
    }
    // copy_gtp_attributes copies its five names only (SPEC 3.4): not the expert batch.
    ParamAttributes copy;
    copyGtpAttributes(copy, layer.weight(0).attrs);
    EXPECT_EQ(copy.padLength, std::optional<int>(44));
    EXPECT_FALSE(copy.expertIdx.has_value());
    EXPECT_FALSE(copy.weightList.has_value());
  });
}

// G6 for experts, and SPEC 3.18/I3 tagging: without GTP_remat (no group, or a group of one) nothing is
// wrapped; the weights carry the TP attributes of their mode, every parameter of an expert layer
// with ET != T has allreduce = False, and GPU-style initialization draws each expert in turn.
TEST(GroupedLinear, WithoutGtpNothingIsWrapped) {
  runRanks(1, [](RankContext& ctx) {
    RngTracker tracker;
    modelParallelManualSeed(tracker, 123, {});
    ModelParallelConfig config;
    config.tensorModelParallelSize = 2;
    config.expertTensorParallelSize = 1;
    auto single = ctx.comm.split(0, 0, "gtp");
    for (Collectives* gtp : {static_cast<Collectives*>(nullptr), single.get()})
      for (GroupedParallelMode mode : {GroupedParallelMode::kColumn, GroupedParallelMode::kRow}) {
        GroupedLinearOptions o;
        o.numGemms = 2;
        o.parallelMode = mode;
        GroupedParallelLinear layer({ctx.compute, ctx.comm, &tracker, nullptr, gtp}, config, 6, 10,
                                    initMethodNormal(1.0), o);
        const bool column = mode == GroupedParallelMode::kColumn;
        EXPECT_FALSE(layer.gtpBatched());
        for (int e = 0; e < 2; ++e) {
          const Parameter& w = layer.weight(e);
          EXPECT_EQ(w.data.shape(), Shape({10, 6}));
          EXPECT_FALSE(w.attrs.isGtpWeightRemat.has_value());
          EXPECT_FALSE(w.attrs.expertIdx.has_value());
          EXPECT_FALSE(w.attrs.weightList.has_value());
          EXPECT_EQ(w.attrs.tensorModelParallel, std::optional<bool>(true));
          EXPECT_EQ(w.attrs.partitionDim, std::optional<int>(column ? 0 : 1));
          EXPECT_EQ(w.attrs.allreduce, std::optional<bool>(false));
          EXPECT_EQ(layer.bias(e)->attrs.allreduce, std::optional<bool>(false));
          EXPECT_EQ(layer.bias(e)->attrs.partitionDim, column ? std::optional<int>(0) : std::nullopt)
              << "the row bias is replicated";
        }
        EXPECT_NE(valuesOf(ctx.compute, layer.weight(0).data), valuesOf(ctx.compute, layer.weight(1).data))
            << "experts are distinct draws";
      }
  });
}

// ---- GTP_remat on against off -------------------------------------------------------------------

struct GtpCase {
  int G;
  bool mean;
  bool perPeerData;  // GTP peers hold different micro-batches
};

std::string caseName(const ::testing::TestParamInfo<GtpCase>& info) {
  return "G" + std::to_string(info.param.G) + (info.param.mean ? "Mean" : "Sum") +
         (info.param.perPeerData ? "PerPeerData" : "SameData");
}

class GroupedGtpParity : public ::testing::TestWithParam<GtpCase> {};

// E = 3 experts with uneven splits and an expert without tokens, Dlog = 20 (pad 12 at G = 2; pad 44
// > S = 16 at G = 4, so shards 2 and 3 are all padding). Forward and dX are bitwise those of the
// same layer without GTP_remat (the gather only moves data) and match the dense math; each rank's
// main_grad holds its rows of the MEAN (or SUM) of the peers' wgrads, pad rows exactly zero.
TEST_P(GroupedGtpParity, MatchesPerExpertDenseMath) {
  const GtpCase c = GetParam();
  const std::int64_t K = 12, N = 20, S = gtpRematShardDim0(N, c.G, 16).rows;
  const Splits splits = {3, 0, 5};
  const std::int64_t M = 8;
  runRanks(c.G, [&](RankContext& ctx) {
    GtpGradReducer reducer(ctx.compute, {c.mean, false, false});
    auto tp = ctx.comm.split(ctx.comm.rank(), 0, "tp");
    ModelParallelConfig config;
    config.useCpuInitialization = true;
    GroupedLinearOptions o;
    o.numGemms = 3;
    Generator gen(11), twinGen(11);
    GroupedParallelLinear layer({ctx.compute, *tp, nullptr, &gen, &ctx.comm, nullptr, &reducer}, config, K, N,
                                initMethodNormal(0.4), o);
    GroupedParallelLinear twin({ctx.compute, *tp, nullptr, &twinGen}, config, K, N, initMethodNormal(0.4), o);
    EXPECT_EQ(layer.gtpBatched(), c.G > 1);
    const std::vector<Matrix> w = weightsOf(ctx.compute, twin);
    std::vector<Matrix> b;
    for (int e = 0; e < 3; ++e) {  // non-zero biases, the same on both layers
      b.push_back(wave(N, 0.9 * e));
      ctx.compute.copy(tensorOf(ctx.compute, DType::kFloat32, b[e]), layer.bias(e)->data);
      ctx.compute.copy(tensorOf(ctx.compute, DType::kFloat32, b[e]), twin.bias(e)->data);
    }
    allocateMainGrads(ctx.compute, layer);
    for (int e = 0; e < 3; ++e) layer.weight(e).attrs.gradAddedToMainGrad = false;

    const int q = ctx.comm.rank();
    auto xOf = [&](int peer) { return wave(M * K, 0.3 + (c.perPeerData ? 7.0 * peer : 0.0)); };
    auto dyOf = [&](int peer) { return wave(M * N, 1.1 + (c.perPeerData ? 5.0 * peer : 0.0)); };
    Tensor x = tensorOf(ctx.compute, DType::kFloat32, xOf(q), Shape{M, K});
    Tensor dy = tensorOf(ctx.compute, DType::kFloat32, dyOf(q), Shape{M, N});
    Tensor y = layer.forward(x, splits);
    Tensor yTwin = twin.forward(x, splits);
    EXPECT_EQ(valuesOf(ctx.compute, y), valuesOf(ctx.compute, yTwin)) << "forward bitwise";
    expectNear(valuesOf(ctx.compute, y), refForward(xOf(q), w, b, splits, K, N), 1e-5, "forward");
    Tensor dx = layer.backward(dy);
    Tensor dxTwin = twin.backward(dy);
    EXPECT_EQ(valuesOf(ctx.compute, dx), valuesOf(ctx.compute, dxTwin)) << "dX bitwise";
    expectNear(valuesOf(ctx.compute, dx), refDgrad(dyOf(q), w, splits, K, N), 1e-5, "dX");

    for (std::size_t e = 0; e < 3; ++e) {
      Parameter& shard = layer.weight(int(e));
      const Matrix local = refWgrad(dyOf(q), xOf(q), splits, e, K, N);
      expectNear(valuesOf(ctx.compute, twin.weight(int(e)).grad), local, 1e-5, "wgrad without GTP");
      expectNear(valuesOf(ctx.compute, layer.bias(int(e))->grad), refBiasGrad(dyOf(q), splits, e, N), 1e-5,
                 "bias grad");
      if (c.G == 1) {
        expectNear(valuesOf(ctx.compute, shard.grad), local, 1e-5, "wgrad");
        continue;
      }
      Matrix total(N * K, 0.0);  // Σ_p dW_p, or its mean
      for (int p = 0; p < c.G; ++p) {
        const Matrix dw = refWgrad(dyOf(p), xOf(p), splits, e, K, N);
        for (std::size_t i = 0; i < total.size(); ++i) total[i] += dw[i] / (c.mean ? c.G : 1);
      }
      const auto mg = valuesOf(ctx.compute, shard.mainGrad);
      expectNear(mg, shardRows(total, K, S, q), 1e-5, "main_grad of expert " + std::to_string(e));
      for (std::int64_t r = std::clamp<std::int64_t>(N - q * S, 0, S); r < S; ++r)
        for (std::int64_t k = 0; k < K; ++k) ASSERT_EQ(mg[r * K + k], 0.0) << "pad row " << r;
      EXPECT_EQ(shard.attrs.gradAddedToMainGrad, std::optional<bool>(true));
      EXPECT_EQ(shard.grad.shape(), shard.mainGrad.shape()) << "the dummy gradient";
    }
    EXPECT_EQ(layer.coalescedGathers(), c.G > 1 ? 2 : 0) << "one gather in forward, one for dgrad";
    EXPECT_EQ(layer.coalescedReduceScatters(), c.G > 1 ? 1 : 0);
  });
}

INSTANTIATE_TEST_SUITE_P(GroupedLinear, GroupedGtpParity,
                         ::testing::Values(GtpCase{1, true, false}, GtpCase{2, true, false}, GtpCase{2, true, true},
                                           GtpCase{2, false, false}, GtpCase{2, false, true}, GtpCase{4, true, false},
                                           GtpCase{4, true, true}, GtpCase{4, false, false}, GtpCase{4, false, true}),
                         caseName);

// ET = 2 x EG = 2 on the expert grid (world 4): a column grouped linear (H -> F) feeding a row
// grouped linear (F -> H), the caller summing their partial results over expert TP as the token
// dispatcher does. Outputs, dX, biases and every main_grad match the unsharded per-expert MLP; the
// EGTP peers hold different tokens, so main_grad is the MEAN over them.
TEST(GroupedLinear, ColumnThenRowOnTheExpertGridMatchesDenseMath) {
  const std::int64_t H = 8, F = 40, M = 7, T = 2, EG = 2;
  const Splits splits = {2, 0, 5};
  ParallelSizes sizes;
  sizes.world = 4;
  sizes.tp = 2;
  sizes.expertTp = 2;
  sizes.expertGtpRemat = 2;
  const ParallelLayout layout(sizes);
  runRanks(4, [&](RankContext& ctx) {
    ProcessGroups pg(ctx.comm, layout);
    GtpGradReducer reducer(ctx.compute, {true, false, false});
    ModelParallelConfig config;
    config.tensorModelParallelSize = 2;
    config.expertTensorParallelSize = 2;
    config.expertGtpRematSize = 2;
    config.useCpuInitialization = true;
    GroupedLinearOptions co, ro;
    co.numGemms = ro.numGemms = 3;
    ro.parallelMode = GroupedParallelMode::kRow;
    Generator g1(31), g2(32), full1(31), full2(32);
    LayerContext c1{ctx.compute, pg.expertTp(), nullptr, &g1, &pg.expertGtpRemat(), &pg.expertDp(), &reducer};
    LayerContext c2{ctx.compute, pg.expertTp(), nullptr, &g2, &pg.expertGtpRemat(), &pg.expertDp(), &reducer};
    GroupedParallelLinear fc1(c1, config, H, F, initMethodNormal(0.3), co);
    GroupedParallelLinear fc2(c2, config, F, H, initMethodNormal(0.3), ro);
    // The same draws without TP or GTP_remat: the full (F, H) and (H, F) expert weights.
    auto solo = ctx.comm.split(ctx.comm.rank(), 0, "solo");
    ModelParallelConfig plain;
    plain.useCpuInitialization = true;
    GroupedParallelLinear fc1Full({ctx.compute, *solo, nullptr, &full1}, plain, H, F, initMethodNormal(0.3), co);
    GroupedParallelLinear fc2Full({ctx.compute, *solo, nullptr, &full2}, plain, F, H, initMethodNormal(0.3), co);
    const std::vector<Matrix> w1 = weightsOf(ctx.compute, fc1Full), w2 = weightsOf(ctx.compute, fc2Full);
    const int t = pg.expertTp().rank(), g = pg.expertGtpRemat().rank();
    EXPECT_EQ(fc1.weight(0).data.shape(), Shape({16, H})) << "Dlog F/T = 20 pads to 32";
    EXPECT_EQ(fc2.weight(0).data.shape(), Shape({16, F / T})) << "Dlog H = 8 pads to 32: spill";
    EXPECT_EQ(fc1.weight(0).attrs.allreduce, std::optional<bool>(false)) << "EG != G: expert data-parallel";
    std::vector<Matrix> b1, b2;
    for (int e = 0; e < 3; ++e) {
      b1.push_back(wave(F, 0.4 * e));
      b2.push_back(wave(H, 2.0 + e));
      ctx.compute.copy(tensorOf(ctx.compute, DType::kFloat32, rows(b1[e], 1, t * F / T, (t + 1) * F / T)),
                       fc1.bias(e)->data);
      ctx.compute.copy(tensorOf(ctx.compute, DType::kFloat32, b2[e]), fc2.bias(e)->data);
    }
    allocateMainGrads(ctx.compute, fc1);
    allocateMainGrads(ctx.compute, fc2);

    // What peer q of the EGTP pair computes, unsharded.
    struct Ref {
      Matrix x, dz, y1, z, dy1, dx;
      std::vector<Matrix> dw1, dw2;
    };
    auto refFor = [&](int peer) {
      Ref r;
      r.x = wave(M * H, 0.5 + 3.0 * peer);
      r.dz = wave(M * H, 1.7 + 5.0 * peer);
      r.y1 = refForward(r.x, w1, b1, splits, H, F);
      r.z = refForward(r.y1, w2, b2, splits, F, H);
      r.dy1 = refDgrad(r.dz, w2, splits, F, H);
      r.dx = refDgrad(r.dy1, w1, splits, H, F);
      for (std::size_t e = 0; e < 3; ++e) {
        r.dw1.push_back(refWgrad(r.dy1, r.x, splits, e, H, F));
        r.dw2.push_back(refWgrad(r.dz, r.y1, splits, e, F, H));
      }
      return r;
    };
    const Ref mine = refFor(g), other = refFor(1 - g);

    Tensor x = tensorOf(ctx.compute, DType::kFloat32, mine.x, Shape{M, H});
    Tensor y1 = fc1.forward(x, splits);  // (M, F/T)
    expectNear(valuesOf(ctx.compute, y1), columns(mine.y1, F, t * F / T, (t + 1) * F / T), 1e-5, "fc1 output");
    Tensor z = fc2.forward(y1, splits);  // (M, H), partial over expert TP
    pg.expertTp().allReduce(z)->wait();
    expectNear(valuesOf(ctx.compute, z), mine.z, 1e-5, "fc2 output, the bias added once");
    Tensor dy1 = fc2.backward(tensorOf(ctx.compute, DType::kFloat32, mine.dz, Shape{M, H}));
    expectNear(valuesOf(ctx.compute, dy1), columns(mine.dy1, F, t * F / T, (t + 1) * F / T), 1e-5, "fc2 dX");
    Tensor dx = fc1.backward(dy1);  // partial over expert TP
    pg.expertTp().allReduce(dx)->wait();
    expectNear(valuesOf(ctx.compute, dx), mine.dx, 1e-5, "fc1 dX");

    for (std::size_t e = 0; e < 3; ++e) {
      const int ei = int(e);
      // fc1: this TP rank's rows of dW1, averaged over the two peers, then shard g of them.
      Matrix avg1(F / T * H), avg2(H * F / T);
      const Matrix m1 = rows(mine.dw1[e], H, t * F / T, (t + 1) * F / T), o1 = rows(other.dw1[e], H, t * F / T,
                                                                                  (t + 1) * F / T);
      const Matrix m2 = columns(mine.dw2[e], F, t * F / T, (t + 1) * F / T),
                   o2 = columns(other.dw2[e], F, t * F / T, (t + 1) * F / T);
      for (std::size_t i = 0; i < avg1.size(); ++i) avg1[i] = (m1[i] + o1[i]) / 2;
      for (std::size_t i = 0; i < avg2.size(); ++i) avg2[i] = (m2[i] + o2[i]) / 2;
      expectNear(valuesOf(ctx.compute, fc1.weight(ei).mainGrad), shardRows(avg1, H, 16, g), 1e-5,
                 "fc1 main_grad " + std::to_string(e));
      expectNear(valuesOf(ctx.compute, fc2.weight(ei).mainGrad), shardRows(avg2, F / T, 16, g), 1e-5,
                 "fc2 main_grad " + std::to_string(e));
      expectNear(valuesOf(ctx.compute, fc1.bias(ei)->grad),
                 rows(refBiasGrad(mine.dy1, splits, e, F), 1, t * F / T, (t + 1) * F / T), 1e-5, "fc1 bias grad");
      expectNear(valuesOf(ctx.compute, fc2.bias(ei)->grad), refBiasGrad(mine.dz, splits, e, H), 1e-5,
                 "fc2 bias grad on every TP rank");
    }
    EXPECT_EQ(EG, pg.expertGtpRemat().size());
  });
}

// ---- One collective per direction -------------------------------------------------------------

struct TracedRun {
  std::vector<std::vector<double>> mainGrads;  // per expert: gathered over G, pad stripped
  std::vector<std::vector<TraceEvent>> trace;
  int fp32Dispatches = 0;
};

// E = 3 bf16 experts with bf16 main_grads (the wire dtype), different tokens on every GTP peer.
TracedRun tracedRun(int G, bool fp32Accum) {
  const std::int64_t K = 16, N = 40, M = 16, E = 3;
  const Splits splits = {5, 0, 11};
  const std::int64_t S = gtpRematShardDim0(N, G, 16).rows;
  WorldOptions wo;
  wo.size = G;
  wo.trace = true;
  sim::World world(wo);
  TracedRun out;
  std::vector<std::vector<Matrix>> shards(E, std::vector<Matrix>(G));
  std::mutex mu;
  world.run([&](RankContext& ctx) {
    auto tp = ctx.comm.split(ctx.comm.rank(), 0, "tp");
    auto gtp = ctx.comm.split(0, ctx.comm.rank(), "egtp");
    GtpGradReducer reducer(ctx.compute, {true, fp32Accum, false});
    Generator gen(17);
    ModelParallelConfig config;
    config.useCpuInitialization = true;
    config.paramsDtype = DType::kBFloat16;
    GroupedLinearOptions o;
    o.numGemms = int(E);
    o.bias = false;
    GroupedParallelLinear layer({ctx.compute, *tp, nullptr, &gen, gtp.get(), nullptr, &reducer}, config, K, N,
                                initMethodNormal(0.3), o);
    allocateMainGrads(ctx.compute, layer, DType::kBFloat16);
    const int q = gtp->rank();
    Tensor x = tensorOf(ctx.compute, DType::kBFloat16, wave(M * K, 0.2 + 3.0 * q), Shape{M, K});
    layer.forward(x, splits);
    layer.backward(tensorOf(ctx.compute, DType::kBFloat16, wave(M * N, 0.8 + 7.0 * q), Shape{M, N}));
    std::lock_guard<std::mutex> lock(mu);
    for (int e = 0; e < E; ++e) shards[e][q] = valuesOf(ctx.compute, layer.weight(e).mainGrad);
    EXPECT_EQ(layer.coalescedGathers(), 2);
    EXPECT_EQ(layer.coalescedReduceScatters(), 1);
    if (q == 0) out.fp32Dispatches = layer.fp32AccumDispatches();
  });
  for (int e = 0; e < E; ++e) {
    Matrix all;
    for (const Matrix& s : shards[e]) all.insert(all.end(), s.begin(), s.end());
    EXPECT_EQ(all.size(), std::size_t(S * G * K));
    all.resize(N * K);
    out.mainGrads.push_back(all);
  }
  out.trace = world.trace();
  return out;
}

// How many collectives of each kind a rank issued on the egtp group.
std::map<std::string, int> egtpOps(const std::vector<TraceEvent>& events) {
  std::map<std::string, int> ops;
  for (const TraceEvent& ev : events)
    if (ev.group.rfind("egtp[", 0) == 0) ++ops[ev.op];
  return ops;
}

// G14 (MoE): at G = 4 the three experts' wgrads go through ONE all-to-all, then fp32 sums, and agree
// with the plain reduce-scatter within 2e-2; the forward and the dgrad each cost ONE all-gather.
// G15: at G = 2 the fp32 path is bypassed: one plain reduce-scatter, no all-to-all.
TEST(GroupedLinear, G14OneCoalescedCollectivePerDirection) {
  const TracedRun plain = tracedRun(4, false), fp32 = tracedRun(4, true);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(egtpOps(plain.trace[r]), (std::map<std::string, int>{{"allGather", 2}, {"reduceScatter", 1}}))
        << "rank " << r;
    EXPECT_EQ(egtpOps(fp32.trace[r]), (std::map<std::string, int>{{"allGather", 2}, {"allToAll", 1}})) << "rank " << r;
  }
  EXPECT_EQ(plain.fp32Dispatches, 0);
  EXPECT_EQ(fp32.fp32Dispatches, 1);
  for (std::size_t e = 0; e < 3; ++e) {
    if (e == 1) {  // no tokens: an exact zero gradient either way
      EXPECT_EQ(fp32.mainGrads[e], std::vector<double>(40 * 16, 0.0));
      continue;
    }
    EXPECT_LT(maxRelError(fp32.mainGrads[e], plain.mainGrads[e]), 2e-2) << "expert " << e;
  }
  const TracedRun bypassed = tracedRun(2, true);
  EXPECT_EQ(bypassed.fp32Dispatches, 0);
  for (int r = 0; r < 2; ++r)
    EXPECT_EQ(egtpOps(bypassed.trace[r]), (std::map<std::string, int>{{"allGather", 2}, {"reduceScatter", 1}}));
  EXPECT_EQ(bypassed.mainGrads, tracedRun(2, false).mainGrads) << "bypassed means the same reduce-scatter";
}

// ---- Interplay with the dense reducer, and training -------------------------------------------

// A dense GTP layer after the grouped one in forward runs first in backward; with async reduction its
// reduce-scatter is left in flight. The grouped backward finalizes it before issuing its batch, so
// afterwards nothing is pending and a drain changes nothing. Over SGD steps, the pad rows of every
// expert shard and main_grad (Dlog 20 at G = 4: pad 44 covers shards 2 and 3 entirely) stay exact
// zeros.
TEST(GroupedLinear, DenseDeferredReductionsAndPadRowsThroughTraining) {
  const std::int64_t K = 8, N = 20, H = 64, M = 6, S = 16;
  const Splits splits = {1, 3, 2};
  runRanks(4, [&](RankContext& ctx) {
    GtpGradReducer reducer(ctx.compute, {true, false, true});
    auto tp = ctx.comm.split(ctx.comm.rank(), 0, "tp");
    Generator g1(41), g2(42);
    ModelParallelConfig config;
    config.useCpuInitialization = true;
    GroupedLinearOptions o;
    o.numGemms = 3;
    GroupedParallelLinear experts({ctx.compute, *tp, nullptr, &g1, &ctx.comm, nullptr, &reducer}, config, K, N,
                                  initMethodNormal(0.5), o);
    ColumnParallelOptions co;
    co.bias = false;
    ColumnParallelLinear dense({ctx.compute, *tp, nullptr, &g2, &ctx.comm, nullptr, &reducer}, config, N, H,
                               initMethodNormal(0.5), co);
    Parameter& dw = *dense.weight();  // (16, 20): Dlog 64, no padding
    const int q = ctx.comm.rank();
    for (int step = 0; step < 4; ++step) {
      allocateMainGrads(ctx.compute, experts);
      dw.mainGrad = ctx.compute.zeros(dw.data.shape(), DType::kFloat32);
      Tensor x = tensorOf(ctx.compute, DType::kFloat32, wave(M * K, step + q), Shape{M, K});
      Tensor h = experts.forward(x, splits);
      Tensor y = dense.forward(h).output;
      Tensor dh = dense.backward(tensorOf(ctx.compute, DType::kFloat32, wave(M * H, 3.0 * step - q), Shape{M, H}));
      ASSERT_EQ(valuesOf(ctx.compute, dw.mainGrad), std::vector<double>(16 * N, 0.0)) << "deferred";
      experts.backward(dh);
      const auto finalized = valuesOf(ctx.compute, dw.mainGrad);
      EXPECT_NE(finalized, std::vector<double>(16 * N, 0.0)) << "the grouped backward finalized the dense one";
      reducer.drain();
      EXPECT_EQ(valuesOf(ctx.compute, dw.mainGrad), finalized) << "nothing was left in flight";
      for (int e = 0; e < 3; ++e) {
        Parameter& w = experts.weight(e);
        ctx.compute.axpy(-0.1f, w.mainGrad, w.data);  // SGD on the shard
        ctx.compute.axpy(-0.1f, experts.bias(e)->grad, experts.bias(e)->data);
        experts.bias(e)->grad = Tensor();
        const auto wv = valuesOf(ctx.compute, w.data), gv = valuesOf(ctx.compute, w.mainGrad);
        for (std::int64_t i = std::clamp<std::int64_t>(N - q * S, 0, S) * K; i < S * K; ++i) {
          ASSERT_EQ(wv[i], 0.0) << "step " << step << " expert " << e << " weight element " << i;
          ASSERT_EQ(gv[i], 0.0) << "step " << step << " expert " << e << " main_grad element " << i;
        }
      }
      ctx.compute.axpy(-0.1f, dw.mainGrad, dw.data);
    }
  });
}

// Gradient-accumulation fusion without GTP_remat: main_grad accumulates dW over micro-batches and
// grad is the zeroed dummy (SPEC 3.15); without fusion grad accumulates the same values.
TEST(GroupedLinear, FusionAccumulatesIntoMainGrad) {
  runRanks(1, [](RankContext& ctx) {
    ModelParallelConfig config;
    config.useCpuInitialization = true;
    GroupedLinearOptions o;
    o.numGemms = 2;
    Generator g1(5), g2(5);
    ModelParallelConfig fused = config;
    fused.gradientAccumulationFusion = true;
    GroupedParallelLinear a({ctx.compute, ctx.comm, nullptr, &g1}, fused, 4, 6, initMethodNormal(1.0), o);
    GroupedParallelLinear b({ctx.compute, ctx.comm, nullptr, &g2}, config, 4, 6, initMethodNormal(1.0), o);
    allocateMainGrads(ctx.compute, a);
    for (int e = 0; e < 2; ++e) {
      a.weight(e).attrs.gradAddedToMainGrad = false;
      a.weight(e).attrs.zeroOutWgrad = true;
    }
    for (int step = 0; step < 2; ++step) {
      Tensor x = tensorOf(ctx.compute, DType::kFloat32, wave(5 * 4, step), Shape{5, 4});
      Tensor dy = tensorOf(ctx.compute, DType::kFloat32, wave(5 * 6, 2.0 + step), Shape{5, 6});
      a.forward(x, {2, 3});
      b.forward(x, {2, 3});
      a.backward(dy);
      b.backward(dy);
    }
    for (int e = 0; e < 2; ++e) {
      EXPECT_EQ(valuesOf(ctx.compute, a.weight(e).mainGrad), valuesOf(ctx.compute, b.weight(e).grad));
      EXPECT_EQ(valuesOf(ctx.compute, a.weight(e).grad), std::vector<double>(24, 0.0)) << "zeroed dummy";
      EXPECT_EQ(a.weight(e).attrs.gradAddedToMainGrad, std::optional<bool>(true));
    }
  });
}

// ---- Errors -------------------------------------------------------------------------------------

TEST(GroupedLinear, BadArgumentsNameTheArgument) {
  runRanks(1, [](RankContext& ctx) {
    Generator gen(1);
    ModelParallelConfig config;
    config.useCpuInitialization = true;
    GroupedLinearOptions o;
    o.numGemms = 3;
    GroupedParallelLinear layer({ctx.compute, ctx.comm, nullptr, &gen}, config, 12, 20, initMethodNormal(0.1), o);
    Tensor x = ctx.compute.zeros({8, 12}, DType::kFloat32);
    EXPECT_THAT(errorOf([&] { layer.forward(x, {3, 5}); }),
                HasSubstr("GroupedParallelLinear::forward: mSplits must have one count per GEMM (3), got 2"));
    EXPECT_THAT(errorOf([&] { layer.forward(x, {3, -1, 6}); }),
                HasSubstr("GroupedParallelLinear::forward: mSplits[1] must be >= 0, got -1"));
    EXPECT_THAT(errorOf([&] { layer.forward(x, {3, 0, 4}); }),
                HasSubstr("GroupedParallelLinear::forward: mSplits must sum to the input's M=8, got 7"));
    Tensor wide = ctx.compute.zeros({8, 10}, DType::kFloat32);
    EXPECT_THAT(errorOf([&] { layer.forward(wide, {3, 0, 5}); }),
                HasSubstr("GroupedParallelLinear::forward: input must be (M, K=12), got fp32 (8, 10)"));
    EXPECT_THAT(errorOf([&] { layer.backward(ctx.compute.zeros({8, 20}, DType::kFloat32)); }),
                HasSubstr("GroupedParallelLinear::backward: called before forward"));
    layer.forward(x, {3, 0, 5});
    EXPECT_THAT(errorOf([&] { layer.backward(ctx.compute.zeros({8, 19}, DType::kFloat32)); }),
                HasSubstr("GroupedParallelLinear::backward: dOutput must be (M=8, N=20) like the forward output"));
    GroupedLinearOptions none;
    none.numGemms = 0;
    EXPECT_THAT(errorOf([&] { GroupedParallelLinear({ctx.compute, ctx.comm, nullptr, &gen}, config, 4, 4,
                                                    initMethodNormal(0.1), none); }),
                HasSubstr("GroupedParallelLinear: numGemms must be >= 1, got 0"));
    EXPECT_THAT(errorOf([&] { layer.weight(3); }), HasSubstr("GroupedParallelLinear::weight: expert must be in [0, 3), got 3"));
  });
  runRanks(2, [](RankContext& ctx) {
    Generator gen(1);
    ModelParallelConfig config;
    config.useCpuInitialization = true;
    GroupedLinearOptions dense;
    dense.isExpert = false;
    EXPECT_THAT(errorOf([&] { GroupedParallelLinear({ctx.compute, ctx.comm, nullptr, &gen}, config, 4, 4,
                                                    initMethodNormal(0.1), dense); }),
                HasSubstr("with a TP group of size 2 it must be an expert layer"));
    auto tp = ctx.comm.split(ctx.comm.rank(), 0, "tp");
    EXPECT_THAT(errorOf([&] { GroupedParallelLinear({ctx.compute, *tp, nullptr, &gen, &ctx.comm}, config, 4, 4,
                                                    initMethodNormal(0.1)); }),
                HasSubstr("a GTP_remat group of size 2 needs LayerContext::gtpReducer"));
    GtpGradReducer reducer(ctx.compute, {});
    GroupedParallelLinear layer({ctx.compute, *tp, nullptr, &gen, &ctx.comm, nullptr, &reducer}, config, 4, 4,
                                initMethodNormal(0.1));
    Tensor x = ctx.compute.zeros({2, 4}, DType::kFloat32);
    layer.forward(x, {2});
    EXPECT_THAT(errorOf([&] { layer.backward(ctx.compute.zeros({2, 4}, DType::kFloat32)); }),
                HasSubstr("experts.weight0.main_grad must be allocated before backward (GTP_remat accumulates"));
  });
}

}  // namespace
}  // namespace tpsim
