// SPEC 5.4 test facts of GTP_remat that need whole layers: G5, G7, G9, G10, G12, G14, G18, G19,
// and pad rows that stay zero through several optimizer steps (invariant 10).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <mutex>

#include "core/attributes.h"
#include "core/grad_stats.h"
#include "core/gtp.h"
#include "core/layers.h"
#include "core/process_groups.h"
#include "tests/sim_test_util.h"

namespace tpsim {
namespace {

using testing::maxRelError;
using testing::runRanks;
using testing::tensorOf;
using testing::valuesOf;
using testing::wave;

// G5: Linear(64 -> 128) over G = 4, bf16, batch 16: output = x·gather(shards)[:128]ᵀ, and dX matches.
// G7: with an fp32 main_grad and bf16 compute the wgrad that is reduce-scattered is fp32, and with
// dY = 1 every row of it is the fp32 column sum of the input.
TEST(GtpFacts, G5AndG7) {
  runRanks(4, [](RankContext& ctx) {
    GtpGradReducer reducer(ctx.compute, {false, false, false});  // SUM: main_grad = the full wgrad rows
    auto tp = ctx.comm.split(ctx.comm.rank(), 0, "tp");
    Generator gen(5);
    ModelParallelConfig config;
    config.useCpuInitialization = true;
    config.paramsDtype = DType::kBFloat16;
    ColumnParallelOptions o;
    o.bias = false;
    ColumnParallelLinear col({ctx.compute, *tp, nullptr, &gen, &ctx.comm, nullptr, &reducer}, config, 64, 128,
                             initMethodNormal(0.1), o);
    ASSERT_EQ(col.weight()->data.shape(), Shape({32, 64}));
    col.weight()->mainGrad = ctx.compute.zeros({32, 64}, DType::kFloat32);
    const auto xv = wave(16 * 64, 0.5);
    Tensor x = tensorOf(ctx.compute, DType::kBFloat16, xv, Shape{16, 64});
    Tensor y = col.forward(x).output;
    Materialized w = materialize(ctx.compute, *col.weight());
    const auto wv = valuesOf(ctx.compute, w.weight), xr = valuesOf(ctx.compute, x), yv = valuesOf(ctx.compute, y);
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 128; ++j) {
        double ref = 0;
        for (int k = 0; k < 64; ++k) ref += xr[i * 64 + k] * wv[j * 64 + k];
        ASSERT_NEAR(yv[i * 128 + j], ref, 1e-2 * (1 + std::fabs(ref))) << "bf16 output (" << i << ", " << j << ")";
      }
    Tensor dy = ctx.compute.empty({16, 128}, DType::kBFloat16);
    ctx.compute.fill(dy, 1.0);
    Tensor dx = col.backward(dy);
    const auto dxv = valuesOf(ctx.compute, dx);
    for (int i = 0; i < 16; ++i)
      for (int k = 0; k < 64; ++k) {
        double ref = 0;
        for (int j = 0; j < 128; ++j) ref += wv[j * 64 + k];
        ASSERT_NEAR(dxv[i * 64 + k], ref, 2e-2 * (1 + std::fabs(ref))) << "dX (" << i << ", " << k << ")";
      }
    // Every peer's wgrad is dYᵀ·X: row o is Σ_b x[b, :]; SUM over 4 identical peers gives 4×.
    std::vector<double> colSum(64, 0.0);
    for (int i = 0; i < 16; ++i)
      for (int k = 0; k < 64; ++k) colSum[k] += xr[i * 64 + k];
    const auto mg = valuesOf(ctx.compute, col.weight()->mainGrad);
    EXPECT_EQ(col.weight()->mainGrad.dtype(), DType::kFloat32);
    for (int r = 0; r < 32; ++r)
      for (int k = 0; k < 64; ++k)
        ASSERT_NEAR(mg[r * 64 + k], 4 * colSum[k], 1e-5 * std::fabs(4 * colSum[k]) + 1e-4) << "row " << r;
  });
}

// G9, G10: T = 2 x G = 2. Column N = 128, K = 64: shard 32 rows, output (16, 64) = x·W_tᵀ. Row K = 128,
// N = 128: shard (64, 64), output equals the full reference.
TEST(GtpFacts, G9G10TwoByTwo) {
  ParallelSizes s;
  s.world = 4;
  s.tp = 2;
  s.gtpRemat = 2;
  const ParallelLayout layout(s);
  std::vector<double> fullRow;
  runRanks(4, [&](RankContext& ctx) {
    ProcessGroups pg(ctx.comm, layout);
    GtpGradReducer reducer(ctx.compute, {});
    Generator g1(1), g2(2);
    ModelParallelConfig config;
    config.useCpuInitialization = true;
    config.tensorModelParallelSize = 2;
    ColumnParallelOptions co;
    co.bias = false;
    ColumnParallelLinear col({ctx.compute, pg.tp(), nullptr, &g1, &pg.gtpRemat(), &pg.dpCp(), &reducer}, config, 64,
                             128, initMethodNormal(0.1), co);
    EXPECT_EQ(col.weight()->data.shape(), Shape({32, 64}));
    RowParallelOptions ro;
    ro.bias = false;
    ro.inputIsParallel = true;
    RowParallelLinear row({ctx.compute, pg.tp(), nullptr, &g2, &pg.gtpRemat(), &pg.dpCp(), &reducer}, config, 128,
                          128, initMethodNormal(0.1), ro);
    EXPECT_EQ(row.weight().data.shape(), Shape({64, 64}));
    Tensor x = tensorOf(ctx.compute, DType::kFloat32, wave(16 * 64, 1.0), Shape{16, 64});
    Tensor y = col.forward(x).output;
    EXPECT_EQ(y.shape(), Shape({16, 64}));
    Materialized w = materialize(ctx.compute, *col.weight());
    const auto wv = valuesOf(ctx.compute, w.weight), xv = valuesOf(ctx.compute, x), yv = valuesOf(ctx.compute, y);
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 64; ++j) {
        double ref = 0;
        for (int k = 0; k < 64; ++k) ref += xv[i * 64 + k] * wv[j * 64 + k];
        ASSERT_NEAR(yv[i * 64 + j], ref, 1e-4) << "column output";
      }
    Tensor z = row.forward(y).output;  // (16, 128): Σ_t over the two TP ranks' partial products
    EXPECT_EQ(z.shape(), Shape({16, 128}));
    Materialized wr = materialize(ctx.compute, row.weight());  // (128, 64): columns of this TP slice
    const auto wrv = valuesOf(ctx.compute, wr.weight), zv = valuesOf(ctx.compute, z);
    // Reference: all-reduce the TP-local partial y·W_rᵀ.
    std::vector<double> partial(16 * 128, 0.0);
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 128; ++j)
        for (int k = 0; k < 64; ++k) partial[i * 128 + j] += yv[i * 64 + k] * wrv[j * 64 + k];
    Tensor p = tensorOf(ctx.compute, DType::kFloat64, partial, Shape{16, 128});
    pg.tp().allReduce(p)->wait();
    const auto ref = valuesOf(ctx.compute, p);
    for (std::size_t i = 0; i < ref.size(); ++i) ASSERT_NEAR(zv[i], ref[i], 1e-4) << "row output " << i;
  });
}

// G12 + G14 + G18: one model, one global batch. G = 2 x D = 2 against D = 4 (both loss modes), the
// fp32-accumulation reduce-scatter against the plain one at G = 4, and GTP pairs permuted by a custom
// split against the grid's pairs: gradients agree to rounding (the spec allows 2e-2).
struct GradRun {
  int G, D;
  bool mean = true;
  bool fp32Accum = false;
  bool permutedPairs = false;
};

std::vector<double> gradients(const GradRun& run) {
  const std::int64_t B = 8, s = 2, K = 16, N = 40, b = B / (run.G * run.D);
  ParallelSizes sizes;
  sizes.world = run.G * run.D;
  sizes.gtpRemat = run.G;
  const ParallelLayout layout(sizes);
  std::vector<std::vector<double>> shards(run.G);
  std::mutex mu;
  runRanks(sizes.world, [&](RankContext& ctx) {
    ProcessGroups pg(ctx.comm, layout);
    // A custom GTP group pairs ranks differently: peers are reversed within each group.
    std::unique_ptr<Collectives> custom;
    if (run.permutedPairs)
      custom = ctx.comm.split(pg.gtpRemat().globalRanks()[0], -pg.gtpRemat().rank(), "gtp_custom");
    Collectives& gtp = run.permutedPairs ? *custom : pg.gtpRemat();
    GtpGradReducer reducer(ctx.compute, {run.mean, run.fp32Accum, true});
    Generator gen(3);
    ModelParallelConfig config;
    config.useCpuInitialization = true;
    config.paramsDtype = DType::kBFloat16;
    ColumnParallelOptions o;
    o.bias = false;
    ColumnParallelLinear col({ctx.compute, pg.tp(), nullptr, &gen, &gtp, &pg.dpCp(), &reducer}, config, K, N,
                             initMethodNormal(0.2), o);
    Parameter& w = *col.weight();
    w.mainGrad = ctx.compute.zeros(w.data.shape(), DType::kFloat32);
    const int q = run.permutedPairs ? gtp.rank() + run.G * pg.dp().rank() : pg.dpGtp().rank();
    Tensor x = tensorOf(ctx.compute, DType::kBFloat16, wave(s * b * K, 0.3 + 7.0 * q), Shape{s, b, K});
    Tensor y = col.forward(x).output;
    // The loss is each replica's mean over its samples; SUM mode then divides by the global count.
    const double scale = run.mean ? 1.0 / double(b) : 1.0 / double(B);
    std::vector<double> dy = wave(y.numel(), 2.0 + 5.0 * q);
    for (double& v : dy) v *= scale;
    col.backward(tensorOf(ctx.compute, DType::kBFloat16, dy, y.shape()));
    reducer.drain();
    if (!isGtpShard(w)) ctx.compute.axpy(1.f, w.grad, w.mainGrad);  // G = 1: the plain wgrad
    if (run.D > 1) pg.dp().allReduce(w.mainGrad, AllReduceOptions{run.mean ? ReduceOp::kMean : ReduceOp::kSum})->wait();
    if (pg.dp().rank() != 0) return;
    std::lock_guard<std::mutex> lock(mu);
    shards[gtp.rank()] = valuesOf(ctx.compute, w.mainGrad);
  });
  std::vector<double> all;
  for (const auto& sh : shards) all.insert(all.end(), sh.begin(), sh.end());
  all.resize(N * K);  // strip the padding rows
  return all;
}

TEST(GtpFacts, G12G14G18GradientsAgree) {
  for (bool mean : {true, false}) {
    const auto reference = gradients({1, 4, mean});
    EXPECT_LT(maxRelError(gradients({2, 2, mean}), reference), 2e-2) << (mean ? "MEAN" : "SUM");
  }
  const auto plain = gradients({4, 1});
  EXPECT_LT(maxRelError(gradients({4, 1, true, true}), plain), 2e-2) << "fp32 accumulation";
  EXPECT_LT(maxRelError(gradients({2, 2, true, false, true}), gradients({2, 2})), 2e-2) << "permuted pairs";
}

// G19: N = 48, K = 64, G = 2, a = 16 gives pad_length 16: with the pad correction the zero count of
// random gradients is 0; without it, exactly 16·64 = 1024 more.
TEST(GtpFacts, G19PadCorrectedZeroCount) {
  runRanks(2, [](RankContext& ctx) {
    GtpGradReducer reducer(ctx.compute, {});
    auto tp = ctx.comm.split(ctx.comm.rank(), 0, "tp");
    Generator gen(9);
    ModelParallelConfig config;
    config.useCpuInitialization = true;
    ColumnParallelOptions o;
    o.bias = false;
    ColumnParallelLinear col({ctx.compute, *tp, nullptr, &gen, &ctx.comm, nullptr, &reducer}, config, 64, 48,
                             initMethodNormal(0.2), o);
    Parameter& w = *col.weight();
    EXPECT_EQ(w.attrs.padLength, std::optional<int>(16));
    w.mainGrad = ctx.compute.zeros(w.data.shape(), DType::kFloat32);
    Tensor x = tensorOf(ctx.compute, DType::kFloat32, wave(4 * 64, 0.1), Shape{4, 64});
    Tensor y = col.forward(x).output;
    col.backward(tensorOf(ctx.compute, DType::kFloat32, wave(4 * 48, 0.7), Shape{4, 48}));
    const DuplicateFilter filter{tp.get(), nullptr, &ctx.comm, nullptr};
    std::vector<Parameter*> params = {&w};
    const std::int64_t raw = countZeros(ctx.compute, params, filter, ctx.comm);
    stampGtpPadZeros(params);
    EXPECT_EQ(countZeros(ctx.compute, params, filter, ctx.comm), 0);
    EXPECT_EQ(raw, 1024);
  });
}

// Invariant 10: the pad rows of a shard and of its main_grad stay exact zeros through SGD steps.
TEST(GtpFacts, PadRowsStayZeroThroughTraining) {
  runRanks(4, [](RankContext& ctx) {
    GtpGradReducer reducer(ctx.compute, {true, false, true});
    auto tp = ctx.comm.split(ctx.comm.rank(), 0, "tp");
    Generator gen(4);
    ModelParallelConfig config;
    config.useCpuInitialization = true;
    ColumnParallelLinear col({ctx.compute, *tp, nullptr, &gen, &ctx.comm, nullptr, &reducer}, config, 8, 20,
                             initMethodNormal(0.5));
    Parameter& w = *col.weight();  // Dlog 20, a 16, G 4: S 16, pad 44 spills over ranks 1-3
    w.mainGrad = ctx.compute.zeros(w.data.shape(), DType::kFloat32);
    for (int step = 0; step < 5; ++step) {
      Tensor x = tensorOf(ctx.compute, DType::kFloat32, wave(6 * 8, step + ctx.comm.rank()), Shape{6, 8});
      Tensor y = col.forward(x).output;
      col.backward(tensorOf(ctx.compute, DType::kFloat32, wave(6 * 20, 3.0 * step), Shape{6, 20}));
      reducer.drain();
      ctx.compute.axpy(-0.1f, w.mainGrad, w.data);  // SGD on the shard
      const std::int64_t firstPad = std::clamp<std::int64_t>(20 - ctx.comm.rank() * 16, 0, 16);
      const auto wv = valuesOf(ctx.compute, w.data), g = valuesOf(ctx.compute, w.mainGrad);
      for (std::int64_t i = firstPad * 8; i < 16 * 8; ++i) {
        ASSERT_EQ(wv[i], 0.0) << "step " << step << " weight element " << i;
        ASSERT_EQ(g[i], 0.0) << "step " << step << " main_grad element " << i;
      }
    }
  });
}

// G16: the fp32-accumulation reduce-scatter on the data-parallel axis (DDP's gradient buckets)
// against the plain one, on a data-parallel group of 4, three steps of bf16 gradients: norms agree
// within 1e-3.
TEST(GtpFacts, G16Fp32AccumulationOnTheDataParallelAxis) {
  std::vector<double> norms[2];
  for (bool fp32 : {false, true})
    runRanks(4, [&](RankContext& ctx) {
      Tensor grad = ctx.compute.zeros({4 * 64}, DType::kFloat32);  // this rank's block, accumulated
      for (int step = 0; step < 3; ++step) {
        Tensor bucket = tensorOf(ctx.compute, DType::kBFloat16, wave(4 * 4 * 64, 0.9 * ctx.comm.rank() + step),
                                 Shape{4 * 4 * 64});
        Tensor mine = ctx.compute.empty({4 * 64}, DType::kBFloat16);
        const bool used = fp32 ? reduceScatterWithFp32Accumulation(ctx.compute, ctx.comm, bucket, mine)
                               : (ctx.comm.reduceScatter(bucket, mine)->wait(), false);
        EXPECT_EQ(used, fp32) << "4 ranks: the fp32 path runs when asked";
        ctx.compute.axpy(1.f, mine, grad);
        const auto v = valuesOf(ctx.compute, grad);
        double sq = 0;
        for (double x : v) sq += x * x;
        Tensor total = tensorOf(ctx.compute, DType::kFloat64, {sq});
        ctx.comm.allReduce(total)->wait();
        if (ctx.comm.rank() == 0) norms[fp32].push_back(std::sqrt(valuesOf(ctx.compute, total)[0]));
      }
    });
  ASSERT_EQ(norms[0].size(), 3u);
  for (int step = 0; step < 3; ++step) EXPECT_NEAR(norms[1][step], norms[0][step], 1e-3 * norms[0][step]);
  runRanks(2, [](RankContext& ctx) {  // bypassed at two ranks
    Tensor in = ctx.compute.zeros({4}, DType::kBFloat16), out = ctx.compute.empty({2}, DType::kBFloat16);
    EXPECT_FALSE(reduceScatterWithFp32Accumulation(ctx.compute, ctx.comm, in, out));
  });
}

// EGTP_remat (SPEC 4.8): an expert ColumnParallelLinear shards over the expert grid's GTP group;
// its parameters carry allreduce = False, so the duplicate filter reads the EGTP rank.
TEST(GtpFacts, ExpertLayersShardOverEgtp) {
  ParallelSizes sizes;
  sizes.world = 4;
  sizes.tp = 2;
  sizes.ep = 2;
  sizes.expertTp = 1;
  sizes.expertGtpRemat = 2;
  const ParallelLayout layout(sizes);
  runRanks(4, [&](RankContext& ctx) {
    ProcessGroups pg(ctx.comm, layout);
    GtpGradReducer reducer(ctx.compute, {true, false, false});
    Generator gen(8);
    ModelParallelConfig config;
    config.tensorModelParallelSize = 2;
    config.expertTensorParallelSize = 1;
    config.expertModelParallelSize = 2;
    config.expertGtpRematSize = 2;
    config.useCpuInitialization = true;
    ColumnParallelOptions o;
    o.isExpert = true;
    ColumnParallelLinear expert({ctx.compute, pg.expertTp(), nullptr, &gen, &pg.expertGtpRemat(), &pg.expertDp(),
                                 &reducer},
                                config, 8, 6, initMethodNormal(0.5), o);
    Parameter& w = *expert.weight();
    ASSERT_TRUE(isGtpShard(w));
    EXPECT_EQ(*w.attrs.group, &pg.expertGtpRemat());
    EXPECT_EQ(w.attrs.allreduce, std::optional<bool>(false));
    EXPECT_EQ(expert.bias()->attrs.allreduce, std::optional<bool>(false));
    // The bias is replicated: counted on EGTP rank 0 only, whatever the dense GTP rank says.
    EXPECT_EQ(paramIsNotGtpDuplicate(*expert.bias(), &pg.gtpRemat(), &pg.expertGtpRemat()),
              pg.expertGtpRemat().rank() == 0);
    EXPECT_TRUE(paramIsNotGtpDuplicate(w, &pg.gtpRemat(), &pg.expertGtpRemat()));
    w.mainGrad = ctx.compute.zeros(w.data.shape(), DType::kFloat32);
    Tensor x = tensorOf(ctx.compute, DType::kFloat32, wave(3 * 8, 0.4), Shape{3, 8});
    Tensor y = expert.forward(x).output;
    Materialized full = materialize(ctx.compute, w);
    const auto wv = valuesOf(ctx.compute, full.weight), xv = valuesOf(ctx.compute, x), yv = valuesOf(ctx.compute, y);
    for (int i = 0; i < 3; ++i)
      for (int j = 0; j < 6; ++j) {
        double ref = 0;
        for (int k = 0; k < 8; ++k) ref += xv[i * 8 + k] * wv[j * 8 + k];
        ASSERT_NEAR(yv[i * 6 + j], ref, 1e-5);
      }
    expert.backward(tensorOf(ctx.compute, DType::kFloat32, wave(3 * 6, 1.1), Shape{3, 6}));
    double sq = 0;
    for (double v : valuesOf(ctx.compute, w.mainGrad)) sq += v * v;
    // Dlog 6 pads to 32 over EG = 2: shard 1 is all padding, shard 0 receives every real row.
    EXPECT_EQ(sq > 0.0, pg.expertGtpRemat().rank() == 0) << "the EGTP reduce-scatter lands in main_grad";
  });
}

// G20: the drain finalizes a deferred reduce-scatter exactly once; draining again changes nothing,
// and a weight that was only gathered has nothing to finalize.
TEST(GtpFacts, G20DrainFinalizesOnce) {
  runRanks(2, [](RankContext& ctx) {
    GtpGradReducer reducer(ctx.compute, {false, false, true});
    std::vector<Parameter> w(2);
    for (auto& p : w) {
      p.name = "w";
      p.data = ctx.compute.zeros({2, 1}, DType::kFloat32);
      wrapGtp(ctx.compute, p, ctx.comm, 0);
      p.mainGrad = ctx.compute.zeros({1, 1}, DType::kFloat32);
      p.attrs.gradAddedToMainGrad = false;
    }
    Tensor dw = tensorOf(ctx.compute, DType::kFloat32, {1, 1}, Shape{2, 1});
    EXPECT_FALSE(reducer.reduceScatter(w[0], dw).defined());  // deferred: None to autograd
    EXPECT_EQ(valuesOf(ctx.compute, w[0].mainGrad), std::vector<double>{0.0}) << "not finalized yet";
    reducer.drain();
    EXPECT_EQ(valuesOf(ctx.compute, w[0].mainGrad), std::vector<double>{2.0});
    EXPECT_EQ(w[0].attrs.gradAddedToMainGrad, std::optional<bool>(true));
    reducer.drain();
    EXPECT_EQ(valuesOf(ctx.compute, w[0].mainGrad), std::vector<double>{2.0}) << "finalized once";
    materialize(ctx.compute, w[1]);  // only gathered
    reducer.drain();
    EXPECT_EQ(valuesOf(ctx.compute, w[1].mainGrad), std::vector<double>{0.0});
    EXPECT_EQ(w[1].attrs.gradAddedToMainGrad, std::optional<bool>(false));
  });
}

// G21, in the MEAN scale the spec trusts: ten SGD steps of an MLP at T = 2 x G = 2 follow the same
// loss trajectory as T = 2 x D = 2 (replicas averaged by DDP) on the same data, with the shards
// updated by LR·main_grad and the replicated biases by LR·(their GTP-averaged gradient).
std::vector<double> trajectory(int G, int D) {
  const std::int64_t s = 2, b = 2, h = 8, f = 24, steps = 10;
  ParallelSizes sizes;
  sizes.world = 2 * G * D;
  sizes.tp = 2;
  sizes.gtpRemat = G;
  const ParallelLayout layout(sizes);
  std::vector<double> losses(steps, 0.0);
  std::mutex mu;
  runRanks(sizes.world, [&](RankContext& ctx) {
    ProcessGroups pg(ctx.comm, layout);
    GtpGradReducer reducer(ctx.compute, {true, false, true});
    Generator g1(21), g2(22);
    ModelParallelConfig config;
    config.tensorModelParallelSize = 2;
    config.useCpuInitialization = true;
    LayerContext c1{ctx.compute, pg.tp(), nullptr, &g1, &pg.gtpRemat(), &pg.dpCp(), &reducer};
    LayerContext c2{ctx.compute, pg.tp(), nullptr, &g2, &pg.gtpRemat(), &pg.dpCp(), &reducer};
    ColumnParallelLinear fc1(c1, config, h, f, initMethodNormal(0.3));
    RowParallelOptions ro;
    ro.inputIsParallel = true;
    RowParallelLinear fc2(c2, config, f, h, initMethodNormal(0.3), ro);
    std::vector<Parameter*> params = {fc1.weight(), fc1.bias(), &fc2.weight(), fc2.bias()};
    const int q = pg.dpGtp().rank();  // this replica's batch block of the global batch 2·G·D... per step
    for (std::int64_t step = 0; step < steps; ++step) {
      for (Parameter* p : params) {
        p->mainGrad = ctx.compute.zeros(p->data.shape(), DType::kFloat32);
        p->grad = Tensor();
      }
      Tensor x = tensorOf(ctx.compute, DType::kFloat32, wave(s * b * h, 0.2 + q + 10.0 * step), Shape{s, b, h});
      Tensor target = tensorOf(ctx.compute, DType::kFloat32, wave(s * b * h, 1.3 + q + 7.0 * step), Shape{s, b, h});
      Tensor hid = fc1.forward(x).output;
      Tensor y = fc2.forward(hid).output;
      // loss = mean over local elements of (y - target)² / 2: dY = (y - target) / count.
      const auto yv = valuesOf(ctx.compute, y), tv = valuesOf(ctx.compute, target);
      std::vector<double> dy(yv.size());
      double local = 0;
      for (std::size_t i = 0; i < yv.size(); ++i) {
        local += 0.5 * (yv[i] - tv[i]) * (yv[i] - tv[i]) / double(yv.size());
        dy[i] = (yv[i] - tv[i]) / double(yv.size());
      }
      fc1.backward(fc2.backward(tensorOf(ctx.compute, DType::kFloat32, dy, y.shape())));
      reducer.drain();
      for (Parameter* p : params)
        if (!isGtpShard(*p)) ctx.compute.axpy(1.f, p->grad, p->mainGrad);
      for (Parameter* p : params)
        if (D > 1) pg.dp().allReduce(p->mainGrad, AllReduceOptions{ReduceOp::kMean})->wait();
      std::vector<Parameter*> replicated;
      for (Parameter* p : params)
        if (!isGtpShard(*p)) replicated.push_back(p);
      finalizeReplicatedGrads(replicated, &pg.gtpRemat(), nullptr, true);
      for (Parameter* p : params) ctx.compute.axpy(-0.5f, p->mainGrad, p->data);
      if (pg.tp().rank() == 0) {
        std::lock_guard<std::mutex> lock(mu);
        losses[step] += local / double(G * D);
      }
    }
  });
  return losses;
}

TEST(GtpFacts, G21LossTrajectoryMatchesDataParallel) {
  const auto gtp = trajectory(2, 1), dp = trajectory(1, 2);
  EXPECT_GT(gtp.front(), gtp.back()) << "the loss falls";
  for (std::size_t i = 0; i < gtp.size(); ++i) EXPECT_NEAR(gtp[i], dp[i], 1e-5 * dp[i]) << "step " << i;
}

}  // namespace
}  // namespace tpsim
