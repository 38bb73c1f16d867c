// ColumnParallelLinear and RowParallelLinear against the dense, unsharded computation for
// T in {1,2,3,4,8}, with and without sequence parallelism, for fp32/bf16/fp16 and their options
// (SPEC 3.18, 3.19, invariants 1 and 2, test facts I1-I3); and each rejected combination.
#include "core/layers.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>

#include "core/init.h"
#include "tests/sim_test_util.h"

namespace tpsim {
namespace {

using ::testing::HasSubstr;
using testing::errorOf;
using testing::columns;
using testing::rows;
using testing::runRanks;
using testing::table;
using testing::tensorOf;
using testing::valuesOf;

struct Dense {  // y = x·Wᵀ + b and its gradients for one dY, all (M, ·) row-major
  std::vector<double> x, w, b, dy, y, dx, dw, db;
};

Dense dense(std::int64_t m, std::int64_t k, std::int64_t n) {
  Dense d;
  d.x = table(m, k, [](auto r, auto c) { return double((r * 5 + c * 3) % 7) - 3; });
  d.w = table(n, k, [](auto r, auto c) { return double((r * 3 + c) % 5) - 2; });
  d.b = table(1, n, [](auto, auto c) { return double(c % 4) - 1; });
  d.dy = table(m, n, [](auto r, auto c) { return double((r + 2 * c) % 3) - 1; });
  d.y = table(m, n, [&](auto i, auto j) {
    double s = d.b[j];
    for (std::int64_t p = 0; p < k; ++p) s += d.x[i * k + p] * d.w[j * k + p];
    return s;
  });
  d.dx = table(m, k, [&](auto i, auto p) {
    double s = 0;
    for (std::int64_t j = 0; j < n; ++j) s += d.dy[i * n + j] * d.w[j * k + p];
    return s;
  });
  d.dw = table(n, k, [&](auto j, auto p) {
    double s = 0;
    for (std::int64_t i = 0; i < m; ++i) s += d.dy[i * n + j] * d.x[i * k + p];
    return s;
  });
  d.db = table(1, n, [&](auto, auto j) {
    double s = 0;
    for (std::int64_t i = 0; i < m; ++i) s += d.dy[i * n + j];
    return s;
  });
  return d;
}

struct Case {
  int T;
  bool sp;
  DType dtype;
  bool flag;  // gather_output (column) or input_is_parallel (row)
};

std::string name(const Case& c) {
  return ::testing::PrintToString(c.T) + (c.sp ? " sp" : "") + " " + dtypeName(c.dtype) + (c.flag ? " flag" : "");
}

ModelParallelConfig configFor(const Case& c) {
  ModelParallelConfig config;
  config.tensorModelParallelSize = std::max(2, c.T);  // SP validation reads the dense size
  config.sequenceParallel = c.sp;
  config.performInitialization = false;
  config.paramsDtype = c.dtype;
  return config;
}

void checkColumn(const Case& c) {
  const std::int64_t s = 2 * c.T, b = 2, k = 6, n = 2 * c.T, m = s * b;
  const Dense d = dense(m, k, n);
  const std::int64_t nl = n / c.T, ml = m / c.T;
  runRanks(c.T, [&](RankContext& ctx) {
    const int t = ctx.comm.rank();
    ColumnParallelOptions o;
    o.gatherOutput = c.flag;
    ColumnParallelLinear layer({ctx.compute, ctx.comm}, configFor(c), k, n, initMethodNormal(0.02), o);
    ctx.compute.copy(tensorOf(ctx.compute, c.dtype, rows(d.w, k, t * nl, (t + 1) * nl), Shape{nl, k}),
                     layer.weight()->data);
    ctx.compute.copy(tensorOf(ctx.compute, c.dtype, rows(d.b, n, 0, 1), Shape{n}).view().slice(0, t * nl, (t + 1) * nl),
                     layer.bias()->data);
    const bool sp = layer.sequenceParallel();
    Tensor x = tensorOf(ctx.compute, c.dtype, sp ? rows(d.x, k, t * ml, (t + 1) * ml) : d.x,
                        Shape{sp ? s / c.T : s, b, k});
    LayerOutput out = layer.forward(x);
    const auto yExpect = c.flag ? d.y : columns(d.y, n, t * nl, (t + 1) * nl);
    EXPECT_EQ(valuesOf(ctx.compute, out.output), yExpect) << "forward";
    Tensor dy = tensorOf(ctx.compute, c.dtype, c.flag ? d.dy : columns(d.dy, n, t * nl, (t + 1) * nl),
                         Shape{s, b, c.flag ? n : nl});
    Tensor dx = layer.backward(dy);
    EXPECT_EQ(valuesOf(ctx.compute, dx), sp ? rows(d.dx, k, t * ml, (t + 1) * ml) : d.dx) << "dgrad";
    EXPECT_EQ(valuesOf(ctx.compute, layer.weight()->grad), rows(d.dw, k, t * nl, (t + 1) * nl)) << "wgrad";
    EXPECT_EQ(valuesOf(ctx.compute, layer.bias()->grad), columns(d.db, n, t * nl, (t + 1) * nl)) << "bias grad";
  });
}

void checkRow(const Case& c) {
  const std::int64_t s = 2 * c.T, b = 2, k = 2 * c.T, n = 5, m = s * b;
  const Dense d = dense(m, k, n);
  const std::int64_t kl = k / c.T, ml = m / c.T;
  const bool inputIsParallel = c.flag || c.sp;
  runRanks(c.T, [&](RankContext& ctx) {
    const int t = ctx.comm.rank();
    RowParallelOptions o;
    o.inputIsParallel = inputIsParallel;
    RowParallelLinear layer({ctx.compute, ctx.comm}, configFor(c), k, n, initMethodNormal(0.02), o);
    ctx.compute.copy(tensorOf(ctx.compute, c.dtype, columns(d.w, k, t * kl, (t + 1) * kl), Shape{n, kl}),
                     layer.weight().data);
    ctx.compute.copy(tensorOf(ctx.compute, c.dtype, d.b, Shape{n}), layer.bias()->data);
    Tensor x = tensorOf(ctx.compute, c.dtype, inputIsParallel ? columns(d.x, k, t * kl, (t + 1) * kl) : d.x,
                        Shape{s, b, inputIsParallel ? kl : k});
    LayerOutput out = layer.forward(x);
    EXPECT_EQ(valuesOf(ctx.compute, out.output), c.sp ? rows(d.y, n, t * ml, (t + 1) * ml) : d.y) << "forward";
    Tensor dy = tensorOf(ctx.compute, c.dtype, c.sp ? rows(d.dy, n, t * ml, (t + 1) * ml) : d.dy,
                         Shape{c.sp ? s / c.T : s, b, n});
    Tensor dx = layer.backward(dy);
    EXPECT_EQ(valuesOf(ctx.compute, dx), inputIsParallel ? columns(d.dx, k, t * kl, (t + 1) * kl) : d.dx) << "dgrad";
    EXPECT_EQ(valuesOf(ctx.compute, layer.weight().grad), columns(d.dw, k, t * kl, (t + 1) * kl)) << "wgrad";
    // Under SP each rank holds the bias gradient of its sequence slice; their TP sum is the full one.
    auto db = valuesOf(ctx.compute, layer.bias()->grad);
    if (c.sp) {
      Tensor full = tensorOf(ctx.compute, DType::kFloat32, db, Shape{n});
      ctx.comm.allReduce(full)->wait();
      db = valuesOf(ctx.compute, full);
    }
    EXPECT_EQ(db, d.db) << "bias grad";
  });
}

std::vector<Case> cases() {
  std::vector<Case> all;
  for (int T : {1, 2, 3, 4, 8})
    for (bool sp : {false, true})
      for (DType dt : {DType::kFloat32, DType::kBFloat16, DType::kFloat16})
        for (bool flag : {false, true})
          if (!(sp && T == 1)) all.push_back({T, sp, dt, flag});
  return all;
}

TEST(ColumnParallelLinear, MatchesDense) {
  for (const Case& c : cases()) {
    if (c.sp && c.flag) continue;  // gather_output with SP output is not a Megatron configuration
    SCOPED_TRACE(name(c));
    checkColumn(c);
  }
}

TEST(RowParallelLinear, MatchesDense) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(name(c));
    checkRow(c);
  }
}

// Σ over rank t's output rows [t·N/T, (t+1)·N/T) of dY·W: its partial input gradient (M, K).
std::vector<double> partialDgrad(const Dense& d, std::int64_t m, std::int64_t k, std::int64_t n, int T, int t) {
  const std::int64_t nl = n / T;
  return table(m, k, [&](auto i, auto p) {
    double s = 0;
    for (std::int64_t j = t * nl; j < (t + 1) * nl; ++j) s += d.dy[i * n + j] * d.w[j * k + p];
    return s;
  });
}

// The names of the collectives each rank issued.
std::vector<std::vector<std::string>> opsOf(const sim::World& world) {
  std::vector<std::vector<std::string>> ops;
  for (const auto& events : world.trace()) {
    ops.emplace_back();
    for (const TraceEvent& e : events) ops.back().push_back(e.op);
  }
  return ops;
}

// disable_grad_reduce (SPEC 3.18 steps 3, 8): backward hands back each rank's own partial
// dY_t·W_t, not summed over TP, and the layer issues no TP collective at all; the weight and bias
// gradients are unchanged. Without the flag the same layer all-reduces dX once per backward.
TEST(ColumnParallelLinear, DisableGradReduceReturnsEachRanksPartialDgrad) {
  for (int T : {2, 4})
    for (bool bias : {false, true})
      for (DType dt : {DType::kFloat32, DType::kBFloat16})
        for (bool disable : {true, false}) {
          SCOPED_TRACE(::testing::Message() << "T=" << T << (bias ? " bias " : " ") << dtypeName(dt)
                                            << (disable ? " disable_grad_reduce" : ""));
          const std::int64_t s = 3, b = 2, k = 6, n = 2 * T, m = s * b, nl = n / T;
          const Dense d = dense(m, k, n);
          WorldOptions wo;
          wo.size = T;
          wo.trace = true;
          sim::World world(wo);
          world.run([&](RankContext& ctx) {
            const int t = ctx.comm.rank();
            ModelParallelConfig config;
            config.tensorModelParallelSize = T;
            config.performInitialization = false;
            config.paramsDtype = dt;
            ColumnParallelOptions o;
            o.bias = bias;
            o.disableGradReduce = disable;
            ColumnParallelLinear layer({ctx.compute, ctx.comm}, config, k, n, initMethodNormal(0.02), o);
            EXPECT_EQ(layer.allreduceDgrad(), !disable);
            ctx.compute.copy(tensorOf(ctx.compute, dt, rows(d.w, k, t * nl, (t + 1) * nl), Shape{nl, k}),
                             layer.weight()->data);
            if (bias)
              ctx.compute.copy(tensorOf(ctx.compute, dt, columns(d.b, n, t * nl, (t + 1) * nl), Shape{nl}),
                               layer.bias()->data);
            Tensor x = tensorOf(ctx.compute, dt, d.x, Shape{s, b, k});
            LayerOutput out = layer.forward(x);
            if (bias) {
              EXPECT_EQ(valuesOf(ctx.compute, out.output), columns(d.y, n, t * nl, (t + 1) * nl)) << "forward";
            }
            Tensor dx = layer.backward(tensorOf(ctx.compute, dt, columns(d.dy, n, t * nl, (t + 1) * nl), Shape{s, b, nl}));
            EXPECT_EQ(valuesOf(ctx.compute, dx), disable ? partialDgrad(d, m, k, n, T, t) : d.dx) << "dgrad";
            EXPECT_EQ(valuesOf(ctx.compute, layer.weight()->grad), rows(d.dw, k, t * nl, (t + 1) * nl)) << "wgrad";
            if (bias) {
              EXPECT_EQ(valuesOf(ctx.compute, layer.bias()->grad), columns(d.db, n, t * nl, (t + 1) * nl)) << "bias grad";
            }
          });
          const std::vector<std::string> issued = disable ? std::vector<std::string>{}
                                                          : std::vector<std::string>{"allReduce"};
          for (const auto& ops : opsOf(world)) EXPECT_EQ(ops, issued);
        }
}

// Expert layers with explicit expert communication (is_expert with T > 1; SPEC 3.18 step 6, 3.19
// step 4): the token dispatcher communicates, so no TP collective runs inside either layer, even
// under sequence parallelism. The column's dX and the row's output are each rank's partial, and
// the row needs skip_bias_add (its bias would otherwise be added to every partial).
TEST(Layers, ExpertLayersLeaveTheCommunicationToTheCaller) {
  const int T = 2;
  for (bool sp : {false, true}) {
    SCOPED_TRACE(sp ? "sequence_parallel" : "no sequence_parallel");
    const std::int64_t s = 2, b = 2, k = 4, n = 4, m = s * b, half = 2;
    const Dense d = dense(m, k, n);
    WorldOptions wo;
    wo.size = T;
    wo.trace = true;
    sim::World world(wo);
    world.run([&](RankContext& ctx) {
      const int t = ctx.comm.rank();
      ModelParallelConfig config;
      config.tensorModelParallelSize = T;
      config.sequenceParallel = sp;
      config.performInitialization = false;
      ColumnParallelOptions co;
      co.isExpert = true;
      co.bias = false;
      ColumnParallelLinear col({ctx.compute, ctx.comm}, config, k, n, initMethodNormal(0.02), co);
      ctx.compute.copy(tensorOf(ctx.compute, DType::kFloat32, rows(d.w, k, t * half, (t + 1) * half), Shape{half, k}),
                       col.weight()->data);
      Tensor x = tensorOf(ctx.compute, DType::kFloat32, d.x, Shape{s, b, k});  // not gathered along s
      col.forward(x);
      Tensor dx = col.backward(
          tensorOf(ctx.compute, DType::kFloat32, columns(d.dy, n, t * half, (t + 1) * half), Shape{s, b, half}));
      EXPECT_EQ(valuesOf(ctx.compute, dx), partialDgrad(d, m, k, n, T, t)) << "column dgrad";

      RowParallelOptions ro;
      ro.isExpert = true;
      ro.inputIsParallel = true;
      RowParallelLinear unskipped({ctx.compute, ctx.comm}, config, k, n, initMethodNormal(0.02), ro);
      Tensor xLocal = tensorOf(ctx.compute, DType::kFloat32, columns(d.x, k, t * half, (t + 1) * half), Shape{s, b, half});
      EXPECT_THAT(errorOf([&] { unskipped.forward(xLocal); }), HasSubstr("need skip_bias_add = True"));
      ro.skipBiasAdd = true;
      RowParallelLinear row({ctx.compute, ctx.comm}, config, k, n, initMethodNormal(0.02), ro);
      ctx.compute.copy(tensorOf(ctx.compute, DType::kFloat32, columns(d.w, k, t * half, (t + 1) * half), Shape{n, half}),
                       row.weight().data);
      LayerOutput out = row.forward(xLocal);
      EXPECT_EQ(out.outputBias, row.bias());
      const auto partialY = table(m, n, [&](auto i, auto j) {
        double v = 0;
        for (std::int64_t p = t * half; p < (t + 1) * half; ++p) v += d.x[i * k + p] * d.w[j * k + p];
        return v;
      });
      EXPECT_EQ(valuesOf(ctx.compute, out.output), partialY) << "row output, not reduced over TP";
      Tensor dxRow = row.backward(tensorOf(ctx.compute, DType::kFloat32, d.dy, Shape{s, b, n}));
      EXPECT_EQ(valuesOf(ctx.compute, dxRow), columns(d.dx, k, t * half, (t + 1) * half)) << "row dgrad";
    });
    for (const auto& ops : opsOf(world)) EXPECT_TRUE(ops.empty()) << ops.size() << " collectives, first " << ops[0];
  }
}

TEST(RowParallelLinear, SpecWorkedExample) {  // 3.19, T = 2
  runRanks(2, [](RankContext& ctx) {
    ModelParallelConfig config;
    config.performInitialization = false;
    RowParallelLinear layer({ctx.compute, ctx.comm}, config, 4, 2, initMethodNormal(0.02), {});
    ctx.compute.upload(std::vector<float>{1, 0, 0, 1}.data(), layer.weight().data);
    ctx.compute.upload(std::vector<float>{10, 20}.data(), layer.bias()->data);
    Tensor x = tensorOf(ctx.compute, DType::kFloat32, {1, 2, 3, 4}, Shape{1, 4});
    EXPECT_EQ(valuesOf(ctx.compute, layer.forward(x).output), (std::vector<double>{14, 26}));
  });
}

TEST(Layers, GradientsAccumulateAcrossMicroBatches) {
  runRanks(2, [](RankContext& ctx) {
    ModelParallelConfig config;
    config.performInitialization = false;
    ColumnParallelLinear layer({ctx.compute, ctx.comm}, config, 3, 4, initMethodNormal(0.02), {});
    ctx.compute.fill(layer.weight()->data, 1.0);
    Tensor x = tensorOf(ctx.compute, DType::kFloat32, {1, 2, 3}, Shape{1, 3});
    Tensor dy = tensorOf(ctx.compute, DType::kFloat32, {1, 1}, Shape{1, 2});
    for (int mb = 0; mb < 3; ++mb) {
      layer.forward(x);
      layer.backward(dy);
    }
    EXPECT_EQ(valuesOf(ctx.compute, layer.weight()->grad), (std::vector<double>{3, 6, 9, 3, 6, 9}));
    EXPECT_EQ(valuesOf(ctx.compute, layer.bias()->grad), (std::vector<double>{3, 3}));
  });
}

TEST(Layers, SkipBiasAddHandsTheBiasToTheCaller) {
  runRanks(2, [](RankContext& ctx) {
    ModelParallelConfig config;
    config.performInitialization = false;
    RowParallelOptions o;
    o.skipBiasAdd = true;
    RowParallelLinear row({ctx.compute, ctx.comm}, config, 4, 2, initMethodNormal(0.02), o);
    ctx.compute.fill(row.bias()->data, 5.0);
    Tensor x = ctx.compute.zeros({1, 4}, DType::kFloat32);
    LayerOutput out = row.forward(x);
    ASSERT_EQ(out.outputBias, row.bias());
    EXPECT_EQ(valuesOf(ctx.compute, out.output), (std::vector<double>{0, 0}));  // not added
    Tensor dBias = tensorOf(ctx.compute, DType::kFloat32, {7, 8});
    row.backward(ctx.compute.zeros({1, 2}, DType::kFloat32), dBias);
    EXPECT_EQ(valuesOf(ctx.compute, row.bias()->grad), (std::vector<double>{7, 8}));
  });
}

// I1: CPU initialization is TP-invariant: the T = 4 shard equals rows (Column) or columns (Row)
// of the T = 1 weight drawn from the same generator seed.
TEST(Layers, CpuInitializationIsTpInvariant) {
  std::vector<double> columnFull, rowFull;
  ModelParallelConfig config;
  config.useCpuInitialization = true;
  runRanks(1, [&](RankContext& ctx) {
    Generator g1(42), g2(42);
    ColumnParallelLinear col({ctx.compute, ctx.comm, nullptr, &g1}, config, 16, 16, initMethodNormal(1.0), {});
    RowParallelLinear row({ctx.compute, ctx.comm, nullptr, &g2}, config, 16, 16, initMethodNormal(1.0), {});
    columnFull = valuesOf(ctx.compute, col.weight()->data);
    rowFull = valuesOf(ctx.compute, row.weight().data);
  });
  runRanks(4, [&](RankContext& ctx) {
    const int t = ctx.comm.rank();
    Generator g1(42), g2(42);
    RngTracker tracker;  // different tracker seeds change nothing: CPU init never touches it
    tracker.add("model-parallel-rng", 41 + std::uint64_t(t));
    ColumnParallelLinear col({ctx.compute, ctx.comm, &tracker, &g1}, config, 16, 16, initMethodNormal(1.0), {});
    RowParallelLinear row({ctx.compute, ctx.comm, &tracker, &g2}, config, 16, 16, initMethodNormal(1.0), {});
    EXPECT_EQ(valuesOf(ctx.compute, col.weight()->data), rows(columnFull, 16, 4 * t, 4 * t + 4));
    EXPECT_EQ(valuesOf(ctx.compute, row.weight().data), columns(rowFull, 16, 4 * t, 4 * t + 4));
  });
}

TEST(Layers, AttributesWithoutInitializationAndForExperts) {  // I2, I3
  runRanks(2, [](RankContext& ctx) {
    ModelParallelConfig config;
    config.performInitialization = false;
    config.tensorModelParallelSize = 2;
    ColumnParallelLinear col({ctx.compute, ctx.comm}, config, 4, 4, initMethodNormal(0.02), {});
    RowParallelLinear row({ctx.compute, ctx.comm}, config, 4, 4, initMethodNormal(0.02), {});
    EXPECT_EQ(col.weight()->attrs.tensorModelParallel, std::optional<bool>(true));
    EXPECT_EQ(col.weight()->attrs.partitionDim, std::optional<int>(0));
    EXPECT_EQ(col.weight()->attrs.partitionStride, std::optional<int>(1));
    EXPECT_EQ(row.weight().attrs.partitionDim, std::optional<int>(1));
    EXPECT_FALSE(row.bias()->attrs.tensorModelParallel.has_value());  // replicated
    EXPECT_EQ(col.weight()->attrs.allreduce, std::optional<bool>(true));
    config.expertTensorParallelSize = 1;  // ET = 1 != T = 2
    ColumnParallelOptions co;
    co.isExpert = true;
    RowParallelOptions ro;
    ro.isExpert = true;
    ro.skipBiasAdd = true;
    ColumnParallelLinear ecol({ctx.compute, ctx.comm}, config, 4, 4, initMethodNormal(0.02), co);
    RowParallelLinear erow({ctx.compute, ctx.comm}, config, 4, 4, initMethodNormal(0.02), ro);
    for (const Parameter* p : {ecol.weight(), ecol.bias(), &erow.weight(), erow.bias()})
      EXPECT_EQ(p->attrs.allreduce, std::optional<bool>(false)) << p->name;
    EXPECT_EQ(col.extraRepr(), "in_features=4, out_features=4, bias=True, TP=2");
    EXPECT_EQ(row.extraRepr(), "in_features=4, out_features=4, bias=True, TP=2");
  });
}

TEST(Layers, RejectedConfigurationsNameTheArgument) {
  runRanks(2, [](RankContext& ctx) {
    ModelParallelConfig config;
    config.performInitialization = false;
    config.tensorModelParallelSize = 2;
    const InitMethod init = initMethodNormal(0.02);
    EXPECT_THAT(errorOf([&] { ColumnParallelLinear({ctx.compute, ctx.comm}, config, 4, 5, init, {}); }),
                HasSubstr("output_size by the TP size"));
    EXPECT_THAT(errorOf([&] { RowParallelLinear({ctx.compute, ctx.comm}, config, 5, 4, init, {}); }),
                HasSubstr("input_size by the TP size"));
    ModelParallelConfig sp = config;
    sp.sequenceParallel = true;
    EXPECT_THAT(errorOf([&] { RowParallelLinear({ctx.compute, ctx.comm}, sp, 4, 4, init, {}); }),
                HasSubstr("sequence_parallel needs input_is_parallel = True"));
    ColumnParallelOptions noReduce;
    noReduce.disableGradReduce = true;
    EXPECT_THAT(errorOf([&] { ColumnParallelLinear({ctx.compute, ctx.comm}, sp, 4, 4, init, noReduce); }),
                HasSubstr("disable_grad_reduce = True with sequence_parallel = True"));
    ModelParallelConfig spT1;
    spT1.sequenceParallel = true;
    EXPECT_THAT(errorOf([&] { RowParallelLinear({ctx.compute, ctx.comm}, spT1, 4, 4, init, {}); }),
                HasSubstr("sequence_parallel needs tensor_model_parallel_size > 1"));
    RowParallelOptions strided;
    strided.stride = 2;
    EXPECT_THAT(errorOf([&] { RowParallelLinear({ctx.compute, ctx.comm}, config, 8, 4, init, strided); }),
                HasSubstr("stride 2 needs input_is_parallel = True"));
    ColumnParallelOptions skip;
    skip.skipWeightParamAllocation = true;
    ColumnParallelLinear noWeight({ctx.compute, ctx.comm}, config, 4, 4, init, skip);
    Tensor x = ctx.compute.zeros({1, 4}, DType::kFloat32);
    EXPECT_THAT(errorOf([&] { noWeight.forward(x); }), HasSubstr("weight was not supplied"));
    Parameter wrong;
    wrong.data = ctx.compute.zeros({4, 4}, DType::kFloat32);
    EXPECT_THAT(errorOf([&] { noWeight.forward(x, &wrong); }), HasSubstr("supplied weight must be (2, 4)"));
    ModelParallelConfig defer = config;
    defer.deferEmbeddingWgradCompute = true;
    defer.gradientAccumulationFusion = true;
    defer.pipelineModelParallelSize = 2;
    std::vector<Tensor> activations;
    ColumnParallelOptions half;
    half.embeddingActivationBuffer = &activations;
    EXPECT_THAT(errorOf([&] { ColumnParallelLinear({ctx.compute, ctx.comm}, defer, 4, 4, init, half); }),
                HasSubstr("grad_output_buffer is missing"));
    LayerContext gtpWithoutReducer{ctx.compute, ctx.comm};
    gtpWithoutReducer.gtp = &ctx.comm;
    EXPECT_THAT(errorOf([&] { ColumnParallelLinear(gtpWithoutReducer, config, 4, 4, init, {}); }),
                HasSubstr("a GTP_remat group of size 2 needs LayerContext::gtpReducer"));
    ColumnParallelLinear col({ctx.compute, ctx.comm}, config, 4, 4, init, {});
    Tensor badX = ctx.compute.zeros({1, 3}, DType::kFloat32);
    EXPECT_THAT(errorOf([&] { col.forward(badX); }), HasSubstr("input must end in K=4, got fp32 (1, 3)"));
  });
}

}  // namespace
}  // namespace tpsim
