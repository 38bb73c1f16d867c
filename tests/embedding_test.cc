// VocabParallelEmbedding against the unsharded lookup and scatter-add for T in {1,2,4,8}, with and
// without reduce_scatter_embeddings, for fp32/bf16/fp16 (SPEC 3.17, invariant 4, test facts E1,
// E2, I1, I2); and each rejected input.
#include "core/embedding.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <optional>

#include "core/attributes.h"
#include "core/init.h"
#include "tests/sim_test_util.h"

namespace tpsim {
namespace {

using ::testing::HasSubstr;
using testing::rows;
using testing::runRanks;
using testing::table;
using testing::tensorOf;
using testing::valuesOf;

// The unsharded layer in double: out = W[ids], dW[v] = Σ_{ids(i) = v} dY[i].
struct Dense {
  std::int64_t b, s, h, vocab;
  std::vector<double> ids, w, dy, y, dw;  // (b, s), (V, h), (b, s, h), (b, s, h), (V, h)
};

Dense dense(std::int64_t b, std::int64_t s, std::int64_t h, std::int64_t vocab, const std::vector<double>& ids) {
  Dense d{b, s, h, vocab, ids, {}, {}, {}, {}};
  d.w = table(vocab, h, [](auto v, auto c) { return double((v * 3 + c * 5) % 11) - 5; });
  d.dy = table(b * s, h, [](auto i, auto c) { return double((i + 2 * c) % 5) - 2; });
  d.y = table(b * s, h, [&](auto i, auto c) { return d.w[std::int64_t(ids[i]) * h + c]; });
  d.dw.assign(std::size_t(vocab * h), 0.0);
  for (std::int64_t i = 0; i < b * s; ++i)
    for (std::int64_t c = 0; c < h; ++c) d.dw[std::int64_t(ids[i]) * h + c] += d.dy[i * h + c];
  return d;
}

// (b, s, h) -> (s, b, h), row-major.
std::vector<double> sequenceMajor(const std::vector<double>& x, std::int64_t b, std::int64_t s, std::int64_t h) {
  std::vector<double> out(x.size());
  for (std::int64_t i = 0; i < b; ++i)
    for (std::int64_t j = 0; j < s; ++j)
      for (std::int64_t c = 0; c < h; ++c) out[(j * b + i) * h + c] = x[(i * s + j) * h + c];
  return out;
}

ModelParallelConfig configFor(DType dtype, bool deterministic = false) {
  ModelParallelConfig config;
  config.performInitialization = false;
  config.paramsDtype = dtype;
  config.deterministicMode = deterministic;
  return config;
}

// Rank t's rows of d.w into the layer's weight.
void loadShard(Compute& compute, VocabParallelEmbedding& layer, const Dense& d) {
  const std::int64_t first = layer.vocabStartIndex(), last = layer.vocabEndIndex();
  compute.copy(tensorOf(compute, layer.weight().data.dtype(), rows(d.w, d.h, first, last), Shape{last - first, d.h}),
               layer.weight().data);
}


// Invariant 4: every rank's output is the unsharded lookup (transposed and sliced under
// reduce_scatter_embeddings), and its weight gradient is its rows of the unsharded scatter-add.
void checkMatchesDense(int T, bool reduceScatter, DType dtype) {
  const std::int64_t b = 2, s = 8, h = 3, vocab = 16, sl = s / T, vl = vocab / T;
  // Repeated ids, and ids of every rank.
  const Dense d =
      dense(b, s, h, vocab, table(b, s, [](auto i, auto j) { return double((5 * i + 3 * j + i * j) % 16); }));
  runRanks(T, [&](RankContext& ctx) {
    const int t = ctx.comm.rank();
    VocabParallelEmbeddingOptions o;
    o.reduceScatterEmbeddings = reduceScatter;
    VocabParallelEmbedding layer({ctx.compute, ctx.comm}, configFor(dtype), vocab, h, initMethodNormal(0.02), o);
    ASSERT_EQ(layer.vocabStartIndex(), t * vl);
    ASSERT_EQ(layer.vocabEndIndex(), (t + 1) * vl);
    loadShard(ctx.compute, layer, d);
    Tensor ids = tensorOf(ctx.compute, DType::kInt64, d.ids, Shape{b, s});
    Tensor out = layer.forward(ids);
    EXPECT_EQ(out.dtype(), dtype);
    Tensor dy;
    if (reduceScatter) {
      EXPECT_EQ(out.shape(), Shape({sl, b, h}));
      EXPECT_EQ(valuesOf(ctx.compute, out), rows(sequenceMajor(d.y, b, s, h), b * h, t * sl, (t + 1) * sl))
          << "forward";
      dy = tensorOf(ctx.compute, dtype, rows(sequenceMajor(d.dy, b, s, h), b * h, t * sl, (t + 1) * sl),
                    Shape{sl, b, h});
    } else {
      EXPECT_EQ(out.shape(), Shape({b, s, h}));
      EXPECT_EQ(valuesOf(ctx.compute, out), d.y) << "forward";
      dy = tensorOf(ctx.compute, dtype, d.dy, Shape{b, s, h});  // replicated, as the all-reduce's output
    }
    layer.backward(dy);
    ASSERT_TRUE(layer.weight().hasGrad());
    EXPECT_EQ(layer.weight().grad.dtype(), dtype);
    EXPECT_EQ(valuesOf(ctx.compute, layer.weight().grad), rows(d.dw, h, t * vl, (t + 1) * vl)) << "wgrad";
  });
}

TEST(VocabParallelEmbedding, MatchesDense) {
  for (int T : {1, 2, 4, 8})
    for (bool reduceScatter : {false, true})
      for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
        SCOPED_TRACE(::testing::PrintToString(T) + (reduceScatter ? " reduce_scatter " : " ") + dtypeName(dtype));
        checkMatchesDense(T, reduceScatter, dtype);
      }
}

TEST(VocabParallelEmbedding, SpecWorkedExample) {  // 3.17: V = 8, T = 2, ids [1, 5, 3, 7]
  const Dense d = dense(1, 4, 2, 8, {1, 5, 3, 7});
  runRanks(2, [&](RankContext& ctx) {
    const int t = ctx.comm.rank();
    VocabParallelEmbedding layer({ctx.compute, ctx.comm}, configFor(DType::kFloat32), 8, 2, initMethodNormal(0.02));
    loadShard(ctx.compute, layer, d);
    Tensor ids = tensorOf(ctx.compute, DType::kInt64, d.ids, Shape{1, 4});
    std::vector<double> expect;
    for (int v : {1, 5, 3, 7})
      for (int c = 0; c < 2; ++c) expect.push_back(d.w[v * 2 + c]);
    EXPECT_EQ(valuesOf(ctx.compute, layer.forward(ids)), expect);
    // Each rank's gradient lands on its local rows 1 and 3 only (ids 1, 3 on rank 0; 5, 7 on rank 1).
    layer.backward(tensorOf(ctx.compute, DType::kFloat32, d.dy, Shape{1, 4, 2}));
    std::vector<double> dw(8, 0.0);
    for (int i = 0; i < 4; ++i)
      if (int(d.ids[i]) / 4 == t)
        for (int c = 0; c < 2; ++c) dw[(int(d.ids[i]) % 4) * 2 + c] = d.dy[i * 2 + c];
    EXPECT_EQ(valuesOf(ctx.compute, layer.weight().grad), dw);
  });
}

// E1: T = 1, either deterministic mode, equals the plain lookup.
TEST(VocabParallelEmbedding, SingleRankEqualsPlainLookup) {
  const Dense d = dense(2, 4, 8, 16, {0, 3, 3, 15, 1, 0, 7, 7});
  for (bool deterministic : {false, true}) {
    SCOPED_TRACE(deterministic ? "deterministic" : "default");
    runRanks(1, [&](RankContext& ctx) {
      VocabParallelEmbedding layer({ctx.compute, ctx.comm}, configFor(DType::kFloat32, deterministic), 16, 8,
                                   initMethodNormal(0.02));
      loadShard(ctx.compute, layer, d);
      Tensor ids = tensorOf(ctx.compute, DType::kInt64, d.ids, Shape{2, 4});
      EXPECT_EQ(valuesOf(ctx.compute, layer.forward(ids)), d.y);
    });
  }
}

// E2: with repeated ids both modes give equal values and equal weight gradients.
TEST(VocabParallelEmbedding, DeterministicModeChangesNothing) {
  const Dense d = dense(2, 4, 4, 8, {0, 3, 3, 7, 1, 0, 5, 5});
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    std::vector<double> out[2], grad[2];
    for (bool deterministic : {false, true})
      runRanks(1, [&](RankContext& ctx) {
        VocabParallelEmbedding layer({ctx.compute, ctx.comm}, configFor(dtype, deterministic), 8, 4,
                                     initMethodNormal(0.02));
        loadShard(ctx.compute, layer, d);
        out[deterministic] = valuesOf(ctx.compute, layer.forward(tensorOf(ctx.compute, DType::kInt64, d.ids,
                                                                          Shape{2, 4})));
        layer.backward(tensorOf(ctx.compute, dtype, d.dy, Shape{2, 4, 4}));
        grad[deterministic] = valuesOf(ctx.compute, layer.weight().grad);
      });
    EXPECT_EQ(out[0], out[1]) << dtypeName(dtype);
    EXPECT_EQ(grad[0], grad[1]) << dtypeName(dtype);
    EXPECT_EQ(out[1], d.y) << dtypeName(dtype);
    EXPECT_EQ(grad[1], d.dw) << dtypeName(dtype);
  }
}

// A repeated id sums its gradients in fp32 and rounds once: 1 + 2⁻⁸ + 2⁻⁸ is 1 + 2⁻⁷ in bf16,
// where adding in bf16 would round each 2⁻⁸ away (ties to even).
TEST(VocabParallelEmbedding, RepeatedIdsAccumulateInFp32) {
  runRanks(1, [](RankContext& ctx) {
    VocabParallelEmbedding layer({ctx.compute, ctx.comm}, configFor(DType::kBFloat16), 2, 1, initMethodNormal(0.02));
    layer.forward(tensorOf(ctx.compute, DType::kInt64, {0, 0, 0}, Shape{1, 3}));
    const double tiny = std::ldexp(1.0, -8);
    layer.backward(tensorOf(ctx.compute, DType::kBFloat16, {1, tiny, tiny}, Shape{1, 3, 1}));
    EXPECT_EQ(valuesOf(ctx.compute, layer.weight().grad), (std::vector<double>{1 + std::ldexp(1.0, -7), 0}));
  });
}

TEST(VocabParallelEmbedding, GradientsAccumulateAcrossMicroBatches) {
  runRanks(2, [](RankContext& ctx) {
    VocabParallelEmbedding layer({ctx.compute, ctx.comm}, configFor(DType::kFloat32), 4, 1, initMethodNormal(0.02));
    Tensor ids = tensorOf(ctx.compute, DType::kInt64, {0, 3}, Shape{1, 2});
    Tensor dy = tensorOf(ctx.compute, DType::kFloat32, {1, 2}, Shape{1, 2, 1});
    for (int mb = 0; mb < 3; ++mb) {
      layer.forward(ids);
      layer.backward(dy);
    }
    const std::vector<double> expect = ctx.comm.rank() == 0 ? std::vector<double>{3, 0} : std::vector<double>{0, 6};
    EXPECT_EQ(valuesOf(ctx.compute, layer.weight().grad), expect);
  });
}

// The ids are copied: changing the caller's tensor between forward and backward changes nothing.
TEST(VocabParallelEmbedding, BackwardUsesTheForwardIds) {
  runRanks(1, [](RankContext& ctx) {
    VocabParallelEmbedding layer({ctx.compute, ctx.comm}, configFor(DType::kFloat32), 4, 1, initMethodNormal(0.02));
    Tensor ids = tensorOf(ctx.compute, DType::kInt64, {1, 2}, Shape{1, 2});
    layer.forward(ids);
    ctx.compute.upload(std::vector<std::int64_t>{3, 3}.data(), ids);
    layer.backward(tensorOf(ctx.compute, DType::kFloat32, {5, 7}, Shape{1, 2, 1}));
    EXPECT_EQ(valuesOf(ctx.compute, layer.weight().grad), (std::vector<double>{0, 5, 7, 0}));
  });
}

// I1: CPU initialization is TP-invariant: the T = 4 shard is rows [4t, 4t + 4) of the T = 1 table.
TEST(VocabParallelEmbedding, CpuInitializationIsTpInvariant) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    SCOPED_TRACE(dtypeName(dtype));
    ModelParallelConfig config;
    config.useCpuInitialization = true;
    config.paramsDtype = dtype;
    std::vector<double> full;
    runRanks(1, [&](RankContext& ctx) {
      Generator g(42);
      VocabParallelEmbedding layer({ctx.compute, ctx.comm, nullptr, &g}, config, 16, 4, initMethodNormal(1.0));
      full = valuesOf(ctx.compute, layer.weight().data);
    });
    runRanks(4, [&](RankContext& ctx) {
      const int t = ctx.comm.rank();
      Generator g(42);
      RngTracker tracker;  // a different tracker seed changes nothing: CPU init never touches it
      tracker.add(kModelParallelRngName, 41 + std::uint64_t(t));
      VocabParallelEmbedding layer({ctx.compute, ctx.comm, &tracker, &g}, config, 16, 4, initMethodNormal(1.0));
      EXPECT_EQ(layer.weight().data.dtype(), dtype);
      EXPECT_EQ(valuesOf(ctx.compute, layer.weight().data), rows(full, 4, 4 * t, 4 * t + 4));
      EXPECT_EQ(layer.weight().attrs.partitionDim, std::optional<int>(0));
    });
  }
}

// GPU-style initialization draws the local shard from the dense tracker's model-parallel stream.
TEST(VocabParallelEmbedding, GpuInitializationUsesTheDenseTracker) {
  runRanks(2, [](RankContext& ctx) {
    ModelParallelConfig config;
    RngTracker tracker, reference;
    tracker.add(kModelParallelRngName, 7);
    tracker.add(kExpertParallelRngName, 8);
    reference.add(kModelParallelRngName, 7);
    VocabParallelEmbedding layer({ctx.compute, ctx.comm, &tracker}, config, 8, 3, initMethodNormal(1.0));
    Parameter expect;
    expect.data = ctx.compute.empty({4, 3}, DType::kFloat32);
    initializeAffineWeightGpu(ctx.compute, expect, initMethodNormal(1.0), 0, 1, false, reference);
    EXPECT_EQ(valuesOf(ctx.compute, layer.weight().data), valuesOf(ctx.compute, expect.data));
    EXPECT_EQ(layer.weight().attrs.tensorModelParallel, std::optional<bool>(true));
    EXPECT_EQ(layer.weight().attrs.partitionDim, std::optional<int>(0));
    EXPECT_EQ(layer.weight().attrs.partitionStride, std::optional<int>(1));
  });
}

TEST(VocabParallelEmbedding, AttributesWithoutInitialization) {  // I2
  for (bool cpu : {false, true}) {
    SCOPED_TRACE(cpu ? "cpu" : "gpu");
    runRanks(2, [&](RankContext& ctx) {
      ModelParallelConfig config = configFor(DType::kBFloat16);
      config.tensorModelParallelSize = 2;
      config.useCpuInitialization = cpu;
      VocabParallelEmbedding layer({ctx.compute, ctx.comm}, config, 8, 4, initMethodNormal(0.02));
      const Parameter& w = layer.weight();
      EXPECT_EQ(w.name, "embedding.weight");
      EXPECT_EQ(w.data.shape(), Shape({4, 4}));
      EXPECT_EQ(w.data.dtype(), DType::kBFloat16);
      EXPECT_EQ(w.attrs.tensorModelParallel, std::optional<bool>(true));
      EXPECT_EQ(w.attrs.partitionDim, std::optional<int>(0));
      EXPECT_EQ(w.attrs.partitionStride, std::optional<int>(1));
      EXPECT_EQ(layer.numEmbeddingsPerPartition(), 4);
    });
  }
}

TEST(VocabParallelEmbedding, RejectedInputsNameTheArgument) {
  const InitMethod init = initMethodNormal(0.02);
  runRanks(4, [&](RankContext& ctx) {
    const ModelParallelConfig config = configFor(DType::kFloat32);
    EXPECT_THAT(testing::errorOf([&] { VocabParallelEmbedding({ctx.compute, ctx.comm}, config, 50257, 4, init); }),
                HasSubstr("VocabParallelEmbedding: vocab_size 50257 is not divisible by tp_size 4; pad it to 50260"));
    LayerContext gtpWithoutReducer{ctx.compute, ctx.comm};
    gtpWithoutReducer.gtp = &ctx.comm;
    EXPECT_THAT(testing::errorOf([&] { VocabParallelEmbedding(gtpWithoutReducer, config, 8, 4, init); }),
                HasSubstr("VocabParallelEmbedding: a GTP_remat group of size 4 needs LayerContext::gtpReducer"));
    ModelParallelConfig gpuInit = config;
    gpuInit.performInitialization = true;
    EXPECT_THAT(testing::errorOf([&] { VocabParallelEmbedding({ctx.compute, ctx.comm}, gpuInit, 8, 4, init); }),
                HasSubstr("needs LayerContext::rngTracker"));
    gpuInit.useCpuInitialization = true;
    EXPECT_THAT(testing::errorOf([&] { VocabParallelEmbedding({ctx.compute, ctx.comm}, gpuInit, 8, 4, init); }),
                HasSubstr("needs LayerContext::cpuGenerator"));

    VocabParallelEmbeddingOptions rs;
    rs.reduceScatterEmbeddings = true;
    VocabParallelEmbedding layer({ctx.compute, ctx.comm}, config, 8, 2, init, rs);
    Tensor ids = tensorOf(ctx.compute, DType::kInt64, {0, 1, 2, 3, 4, 5}, Shape{1, 6});
    EXPECT_THAT(testing::errorOf([&] { layer.forward(ids); }),
                HasSubstr("reduce_scatter_embeddings needs the sequence length s divisible by tp_size 4, got s = 6"));
    Tensor floatIds = tensorOf(ctx.compute, DType::kFloat32, {0, 1, 2, 3}, Shape{1, 4});
    EXPECT_THAT(testing::errorOf([&] { layer.forward(floatIds); }), HasSubstr("ids must be int64 (b, s), got fp32 (1, 4)"));
    Tensor flatIds = tensorOf(ctx.compute, DType::kInt64, {0, 1, 2, 3});
    EXPECT_THAT(testing::errorOf([&] { layer.forward(flatIds); }), HasSubstr("ids must be int64 (b, s), got int64 (4,)"));
    Tensor dy = ctx.compute.zeros({1, 1, 2}, DType::kFloat32);
    EXPECT_THAT(testing::errorOf([&] { layer.backward(dy); }), HasSubstr("backward: called before forward"));
    layer.forward(tensorOf(ctx.compute, DType::kInt64, {0, 1, 2, 3}, Shape{1, 4}));
    Tensor wrong = ctx.compute.zeros({1, 4, 2}, DType::kFloat32);
    EXPECT_THAT(testing::errorOf([&] { layer.backward(wrong); }),
                HasSubstr("dOutput must be fp32 (1, 1, 2) like the output, got fp32 (1, 4, 2)"));
  });
  runRanks(1, [&](RankContext& ctx) {
    VocabParallelEmbedding layer({ctx.compute, ctx.comm}, configFor(DType::kFloat32), 16, 2, init);
    Tensor tooBig = tensorOf(ctx.compute, DType::kInt64, {0, 3, 3, 15, 1, 0, 16, 7}, Shape{2, 4});
    EXPECT_THAT(testing::errorOf([&] { layer.forward(tooBig); }),
                HasSubstr("VocabParallelEmbedding::forward: ids must lie in [0, V=16), got id 16 at position (1, 2)"));
    Tensor negative = tensorOf(ctx.compute, DType::kInt64, {-1}, Shape{1, 1});
    EXPECT_THAT(testing::errorOf([&] { layer.forward(negative); }), HasSubstr("got id -1 at position (0, 0)"));
  });
}

// At T > 1 ids outside [0, V) are owned by no rank and give zero rows, as Megatron's mask does.
TEST(VocabParallelEmbedding, UnownedIdsGiveZeroRowsAtTpAboveOne) {
  runRanks(2, [](RankContext& ctx) {
    VocabParallelEmbedding layer({ctx.compute, ctx.comm}, configFor(DType::kFloat32), 4, 1, initMethodNormal(0.02));
    ctx.compute.fill(layer.weight().data, 1.0);
    Tensor ids = tensorOf(ctx.compute, DType::kInt64, {-1, 0, 3, 4}, Shape{1, 4});
    EXPECT_EQ(valuesOf(ctx.compute, layer.forward(ids)), (std::vector<double>{0, 1, 1, 0}));
  });
}

}  // namespace
}  // namespace tpsim
