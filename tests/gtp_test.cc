// GTP_remat on the simulator (SPEC 4, 5.4): the padding rule, wrapping, materialization, the
// wgrad reduce-scatter (MEAN and SUM, synchronous and deferred, fp32 accumulation), and the
// layers with GTP_remat on against the same layers with it off.
#include "core/gtp.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <mutex>

#include "core/embedding.h"
#include "core/layers.h"
#include "core/process_groups.h"
#include "tests/sim_test_util.h"

namespace tpsim {
namespace {

using ::testing::HasSubstr;
using testing::errorOf;
using testing::runRanks;
using testing::tensorOf;
using testing::valuesOf;

TEST(GtpGeometry, SpecPaddingTable) {  // SPEC 4.2
  struct Row {
    std::int64_t dLog;
    int g, a;
    std::int64_t pad, rows;
  };
  for (const Row& r : {Row{128, 4, 16, 0, 32}, Row{63, 4, 16, 1, 16}, Row{120, 4, 16, 8, 32}, Row{1152, 4, 16, 0, 288},
                       Row{1160, 4, 16, 56, 304}, Row{96, 2, 32, 32, 64}, Row{48, 2, 16, 16, 32}, Row{8, 2, 16, 24, 16},
                       Row{1, 4, 16, 63, 16}, Row{12, 3, 0, 0, 4}}) {
    const GtpShardGeometry geo = gtpRematShardDim0(r.dLog, r.g, r.a);
    EXPECT_EQ(geo.padLength, r.pad) << "Dlog " << r.dLog;
    EXPECT_EQ(geo.rows, r.rows) << "Dlog " << r.dLog;
  }
  EXPECT_THAT(errorOf([] { gtpRematShardDim0(10, 4, 0); }),
              HasSubstr("with pad_for_alignment 0 the TP-local dim 0 (10) must be divisible by the GTP_remat size 4"));
}

// The grid of SPEC 1.4.2 for T x G ranks; groups built on every rank.
ParallelLayout layoutFor(int T, int G, int D = 1) {
  ParallelSizes s;
  s.world = T * G * D;
  s.tp = T;
  s.gtpRemat = G;
  return ParallelLayout(s);
}

TEST(WrapGtp, ShardsAreRowsOfThePaddedWeight) {  // G1, G2, G3, G6
  runRanks(4, [](RankContext& ctx) {
    const int g = ctx.comm.rank();
    for (std::int64_t rows : {128, 63}) {
      Parameter w;
      w.name = "w";
      std::vector<double> v(rows * 16);
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = double(i / 16 + 1);  // row r holds r + 1
      w.data = tensorOf(ctx.compute, DType::kFloat32, v, Shape{rows, 16});
      w.requiresGrad = false;
      wrapGtp(ctx.compute, w, ctx.comm, 16);
      const std::int64_t s = rows == 128 ? 32 : 16;
      ASSERT_EQ(w.data.shape(), Shape({s, 16}));
      EXPECT_EQ(w.attrs.padLength, std::optional<int>(rows == 128 ? 0 : 1));  // stamped on every rank
      EXPECT_EQ(w.attrs.isGtpWeightRemat, std::optional<bool>(true));
      EXPECT_EQ(w.attrs.group, std::optional<Collectives*>(&ctx.comm));
      EXPECT_FALSE(w.requiresGrad) << "requires_grad is kept (SPEC 8 item 24)";
      auto got = valuesOf(ctx.compute, w.data);
      for (std::int64_t r = 0; r < s; ++r) {
        const std::int64_t global = g * s + r;
        ASSERT_EQ(got[r * 16], global < rows ? double(global + 1) : 0.0) << "rank " << g << " row " << r;
      }
      // Materialization gives back the unpadded weight on every rank.
      Materialized m = materialize(ctx.compute, w);
      EXPECT_EQ(m.weight.shape(), Shape({rows, 16}));
      EXPECT_EQ(valuesOf(ctx.compute, m.weight), v);
    }
    auto one = ctx.comm.split(g, 0, "single");
    Parameter w;
    w.data = ctx.compute.zeros({8, 2}, DType::kFloat32);
    wrapGtp(ctx.compute, w, *one, 16);
    EXPECT_FALSE(w.attrs.isGtpWeightRemat.has_value()) << "a group of one wraps nothing";
    EXPECT_EQ(w.data.shape(), Shape({8, 2}));
  });
}

// MEAN and SUM, synchronous and deferred: main_grad_g += (Σ_q dW_q · scale)[g-rows], pad rows 0.
// The config picks the reduction: calculate_per_token_loss is SUM, and
// gtp_reduce_scatter_with_fp32_accumulation the all-to-all variant.
TEST(GtpGradReducer, ReduceScatterIntoMainGrad) {
  for (bool mean : {true, false})
    for (bool async : {false, true})
      for (bool fp32Accum : {false, true})
        runRanks(4, [&](RankContext& ctx) {
          const int g = ctx.comm.rank();
          ModelParallelConfig config;
          config.calculatePerTokenLoss = !mean;
          config.gtpReduceScatterWithFp32Accumulation = fp32Accum;
          GtpGradReducer reducer(ctx.compute, GtpReduceOptions::fromConfig(config, async));
          EXPECT_EQ(reducer.options().async, async);
          std::vector<Parameter> shards(2);
          for (int i = 0; i < 2; ++i) {
            shards[i].name = "w" + std::to_string(i);
            shards[i].data = ctx.compute.zeros({10, 3}, DType::kFloat32);  // Dlog = 10: S = 16, pad 54
            wrapGtp(ctx.compute, shards[i], ctx.comm, 16);
            shards[i].mainGrad = ctx.compute.zeros(shards[i].data.shape(), DType::kFloat32);
          }
          for (int step = 0; step < 2; ++step)
            for (int i = 0; i < 2; ++i) {
              std::vector<double> dw(30);
              for (int e = 0; e < 30; ++e) dw[e] = double((g + 1) * 4 * (e + 1 + i));  // peer q sends 4(q+1)(e+1+i)
              Tensor t = tensorOf(ctx.compute, DType::kFloat32, dw, Shape{10, 3});
              Tensor dummy = reducer.reduceScatter(shards[i], t);
              EXPECT_EQ(dummy.defined(), !async) << "the dummy comes back only from a synchronous reduction";
            }
          reducer.drain();
          EXPECT_EQ(reducer.fp32AccumDispatches(), fp32Accum ? 4 : 0);
          for (int i = 0; i < 2; ++i) {
            auto got = valuesOf(ctx.compute, shards[i].mainGrad);
            for (std::int64_t r = 0; r < 16; ++r)
              for (int c = 0; c < 3; ++c) {
                const std::int64_t row = g * 16 + r;  // padded-buffer row
                // Σ_q 4(q+1)(e+1+i) = 40(e+1+i); MEAN divides by 4; two steps.
                const double expect = row < 10 ? 2.0 * (mean ? 10.0 : 40.0) * double(row * 3 + c + 1 + i) : 0.0;
                ASSERT_EQ(got[r * 3 + c], expect) << "shard " << i << " rank " << g << " row " << r;
              }
          }
        });
}

TEST(GtpGradReducer, Fp32AccumulationIsBypassedAtTwoPeers) {  // G15
  runRanks(2, [](RankContext& ctx) {
    GtpGradReducer reducer(ctx.compute, {true, true, false});
    Parameter w;
    w.name = "w";
    w.data = ctx.compute.zeros({4, 2}, DType::kBFloat16);
    wrapGtp(ctx.compute, w, ctx.comm, 0);
    w.mainGrad = ctx.compute.zeros(w.data.shape(), DType::kFloat32);
    Tensor dw = ctx.compute.zeros({4, 2}, DType::kBFloat16);
    reducer.reduceScatter(w, dw);
    EXPECT_EQ(reducer.fp32AccumDispatches(), 0);
  });
}

// A wgrad made in paddedWgrad's buffer (as the linear layers make theirs) reduces to the bits of the
// same wgrad handed over as a view and copied; the buffer's pad rows are zero; another shape is refused.
TEST(GtpGradReducer, AWgradMadeInThePaddedBufferReducesAsACopiedOne) {
  runRanks(4, [](RankContext& ctx) {
    const int g = ctx.comm.rank();
    GtpGradReducer reducer(ctx.compute, {});  // MEAN: the logical rows are scaled in place
    std::vector<Parameter> shards(2);
    for (int i = 0; i < 2; ++i) {
      shards[i].name = "w" + std::to_string(i);
      // Dlog = 10: S = 16, pad 54; the padded buffer, 1 MiB, comes from the host cache of blocks.
      shards[i].data = ctx.compute.zeros({10, 4096}, DType::kFloat32);
      wrapGtp(ctx.compute, shards[i], ctx.comm, 16);
      shards[i].mainGrad = ctx.compute.zeros(shards[i].data.shape(), DType::kFloat32);
    }
    std::vector<double> dw(10 * 4096);
    for (std::size_t e = 0; e < dw.size(); ++e) dw[e] = 0.1 * double((g + 1) * (int(e % 97) + 3));  // not exact in fp32, nor its mean
    {
      // A freed block of the buffer's size, non-zero: the one the host cache hands out next.
      Tensor used = ctx.compute.empty({64, 4096}, DType::kFloat32);
      ctx.compute.fill(used, 7.0);
    }
    Tensor padded = reducer.paddedWgrad(shards[1], DType::kFloat32);
    ASSERT_EQ(padded.shape(), (Shape{64, 4096}));
    const std::vector<double> pads = valuesOf(ctx.compute, padded.view().slice(0, 10, 64));
    for (std::size_t e = 0; e < pads.size(); ++e) ASSERT_EQ(pads[e], 0.0) << "pad element " << e;
    ctx.compute.copy(tensorOf(ctx.compute, DType::kFloat32, dw, Shape{10, 4096}), padded.view().slice(0, 0, 10));
    Tensor copied = tensorOf(ctx.compute, DType::kFloat32, dw, Shape{10, 4096});
    reducer.reduceScatter(shards[0], copied);
    reducer.reduceScatterPadded(shards[1], std::move(padded));
    EXPECT_EQ(valuesOf(ctx.compute, shards[1].mainGrad), valuesOf(ctx.compute, shards[0].mainGrad));
    Tensor oneRowShort = ctx.compute.zeros({63, 4096}, DType::kFloat32);
    EXPECT_THAT(errorOf([&] { reducer.reduceScatterPadded(shards[1], std::move(oneRowShort)); }),
                HasSubstr("the padded wgrad of w1 must have shape (64, 4096), got (63, 4096)"));
  });
}

// Everything a GTP-on run and the matching GTP-off run of one layer kind produce.
struct Outcome {
  std::vector<double> output, dInput, weightGrad;  // weightGrad: unsharded, padding stripped
};

enum class Kind { kColumn, kRow, kEmbedding };

// Runs `kind` on T·G ranks with identical data on every GTP peer, CPU-initialized from the same
// seed so the TP-local weights match the G = 1 run. Returns what TP rank 0, GTP rank 0 sees, with
// the weight gradient assembled from every peer's main_grad (or the plain grad when G = 1).
Outcome runLayer(Kind kind, int T, int G, DType dtype, bool sp, bool mean, bool async) {
  Outcome out;
  std::mutex mu;
  std::vector<std::vector<double>> shardGrads(G);
  const ParallelLayout layout = layoutFor(T, G);
  runRanks(T * G, [&](RankContext& ctx) {
    ProcessGroups pg(ctx.comm, layout);
    GtpGradReducer reducer(ctx.compute, {mean, false, async});
    Generator gen(42);
    LayerContext lc{ctx.compute, pg.tp(), nullptr, &gen, &pg.gtpRemat(), &pg.dpCp(), &reducer};
    ModelParallelConfig config;
    config.tensorModelParallelSize = std::max(2, T);
    config.sequenceParallel = sp;
    config.useCpuInitialization = true;
    config.paramsDtype = dtype;
    const std::int64_t s = 2 * T, b = 2, k = 8, n = 6 * T;
    auto data = [&](std::int64_t count, int salt) {
      std::vector<double> v(count);
      for (std::int64_t i = 0; i < count; ++i) v[i] = double((i * 7 + salt) % 9) / 4.0 - 1.0;
      return v;
    };
    Parameter* weight = nullptr;
    Tensor y, dx;
    std::optional<ColumnParallelLinear> col;
    std::optional<RowParallelLinear> row;
    std::optional<VocabParallelEmbedding> emb;
    const int t = pg.tp().rank();
    if (kind == Kind::kColumn) {
      col.emplace(lc, config, k, n, initMethodNormal(0.5));
      weight = col->weight();
    } else if (kind == Kind::kRow) {
      RowParallelOptions o;
      o.inputIsParallel = true;
      row.emplace(lc, config, k * T, n, initMethodNormal(0.5), o);
      weight = &row->weight();
    } else {
      emb.emplace(lc, config, 4 * T, k, initMethodNormal(0.5));
      weight = &emb->weight();
    }
    if (G > 1) weight->mainGrad = ctx.compute.zeros(weight->data.shape(), DType::kFloat32);
    const std::int64_t sl = sp ? s / T : s;
    if (kind == Kind::kColumn) {
      Tensor x = tensorOf(ctx.compute, dtype, data(sl * b * k, t), Shape{sl, b, k});
      y = col->forward(x).output;
      dx = col->backward(tensorOf(ctx.compute, dtype, data(y.numel(), 3 + t), y.shape()));
    } else if (kind == Kind::kRow) {
      Tensor x = tensorOf(ctx.compute, dtype, data(s * b * k, t), Shape{s, b, k});
      y = row->forward(x).output;
      dx = row->backward(tensorOf(ctx.compute, dtype, data(y.numel(), 3 + t), y.shape()));
    } else {
      std::vector<double> ids(b * s);
      for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = double((i * 5) % (4 * T));
      y = emb->forward(tensorOf(ctx.compute, DType::kInt64, ids, Shape{b, s}));
      emb->backward(tensorOf(ctx.compute, dtype, data(y.numel(), 3), y.shape()));
    }
    reducer.drain();
    EXPECT_EQ(isGtpShard(*weight), G > 1);
    if (G > 1) {
      // Pad rows of the shard and of its main_grad are exact zeros (SPEC 6 item 10).
      const std::int64_t rows = weight->data.shape()[0], cols = weight->data.numel() / rows;
      const std::int64_t dLog = rows * G - *weight->attrs.padLength;
      const std::int64_t firstPad = std::clamp<std::int64_t>(dLog - pg.gtpRemat().rank() * rows, 0, rows);
      const auto w = valuesOf(ctx.compute, weight->data), mg = valuesOf(ctx.compute, weight->mainGrad);
      for (std::int64_t i = firstPad * cols; i < rows * cols; ++i) {
        ASSERT_EQ(w[i], 0.0) << "weight pad element " << i;
        ASSERT_EQ(mg[i], 0.0) << "main_grad pad element " << i;
      }
    }
    if (t != 0) return;
    std::lock_guard<std::mutex> lock(mu);
    const int g = pg.gtpRemat().rank();
    shardGrads[g] = valuesOf(ctx.compute, G > 1 ? ConstView(weight->mainGrad) : ConstView(weight->grad));
    if (g == 0) {
      out.output = valuesOf(ctx.compute, y);
      if (dx.defined()) out.dInput = valuesOf(ctx.compute, dx);
    }
  });
  for (const auto& g : shardGrads) out.weightGrad.insert(out.weightGrad.end(), g.begin(), g.end());
  return out;
}

// Invariant 8 (GTP transparency), with identical data on every peer: outputs and dgrads equal the
// G = 1 run exactly; the stripped main_grads equal the G = 1 wgrad under MEAN and G times it under
// SUM (exact for power-of-two G).
TEST(GtpLayers, TransparentAgainstGtpOff) {
  for (Kind kind : {Kind::kColumn, Kind::kRow, Kind::kEmbedding})
    for (int T : {1, 2})
      for (int G : {2, 4})
        for (DType dt : {DType::kFloat32, DType::kBFloat16, DType::kFloat16})
          for (bool sp : {false, true}) {
            if (sp && (T == 1 || kind == Kind::kEmbedding)) continue;
            for (bool mean : {true, false}) {
              SCOPED_TRACE(::testing::Message() << "kind " << int(kind) << " T=" << T << " G=" << G << " "
                                                << dtypeName(dt) << (sp ? " sp" : "") << (mean ? " mean" : " sum"));
              const Outcome off = runLayer(kind, T, 1, dt, sp, mean, false);
              const Outcome on = runLayer(kind, T, G, dt, sp, mean, /*async=*/G == 4);
              EXPECT_EQ(on.output, off.output);
              EXPECT_EQ(on.dInput, off.dInput);
              ASSERT_GE(on.weightGrad.size(), off.weightGrad.size());
              for (std::size_t i = 0; i < on.weightGrad.size(); ++i) {
                const double expect = i < off.weightGrad.size() ? off.weightGrad[i] * (mean ? 1.0 : G) : 0.0;
                ASSERT_EQ(on.weightGrad[i], expect) << "main_grad element " << i << (i >= off.weightGrad.size()
                                                                                       ? " (a pad row)" : "");
              }
            }
          }
}

TEST(GtpLayers, FrozenWeightsGatherToo) {
  runRanks(2, [](RankContext& ctx) {
    GtpGradReducer reducer(ctx.compute, {});
    Generator gen(7);
    ModelParallelConfig config;
    config.useCpuInitialization = true;
    auto single = ctx.comm.split(ctx.comm.rank(), 0, "tp");
    LayerContext lc{ctx.compute, *single, nullptr, &gen, &ctx.comm, nullptr, &reducer};
    ColumnParallelLinear col(lc, config, 4, 6, initMethodNormal(1.0));
    col.weight()->requiresGrad = false;
    Tensor x = tensorOf(ctx.compute, DType::kFloat32, {1, 0, 0, 0}, Shape{1, 4});
    Tensor y = col.forward(x).output;
    Tensor dy = tensorOf(ctx.compute, DType::kFloat32, {1, 0, 0, 0, 0, 0}, Shape{1, 6});
    Tensor dx = col.backward(dy);
    // y = column 0 of W; dX = row 0 of W: both read from the gathered weight.
    Materialized w = materialize(ctx.compute, *col.weight());
    auto wv = valuesOf(ctx.compute, w.weight);
    for (int r = 0; r < 6; ++r) EXPECT_EQ(valuesOf(ctx.compute, y)[r], wv[r * 4]);
    for (int c = 0; c < 4; ++c) EXPECT_EQ(valuesOf(ctx.compute, dx)[c], wv[c]);
    EXPECT_FALSE(col.weight()->grad.defined());
  });
}

TEST(GtpLayers, RejectedUsesNameTheProblem) {
  runRanks(2, [](RankContext& ctx) {
    GtpGradReducer reducer(ctx.compute, {});
    auto single = ctx.comm.split(ctx.comm.rank(), 0, "tp");
    ModelParallelConfig config;
    config.performInitialization = false;
    LayerContext lc{ctx.compute, *single, nullptr, nullptr, &ctx.comm, nullptr, &reducer};
    ColumnParallelLinear col(lc, config, 4, 6, initMethodNormal(1.0));
    Tensor x = ctx.compute.zeros({1, 4}, DType::kFloat32);
    col.forward(x);
    EXPECT_THAT(errorOf([&] { col.backward(ctx.compute.zeros({1, 6}, DType::kFloat32)); }),
                HasSubstr("column.weight.main_grad must be allocated before backward"));
    Parameter plain;
    plain.name = "plain";
    plain.data = ctx.compute.zeros({6, 4}, DType::kFloat32);
    EXPECT_THAT(errorOf([&] { col.forward(x, &plain); }),
                HasSubstr("the supplied weight plain is not a GTP_remat shard"));
    ModelParallelConfig noPad = config;
    noPad.gtpPadForAlignment = 0;
    EXPECT_THAT(errorOf([&] { ColumnParallelLinear(lc, noPad, 4, 5, initMethodNormal(1.0)); }),
                HasSubstr("must be divisible by the GTP_remat size 2"));
  });
}

}  // namespace
}  // namespace tpsim
