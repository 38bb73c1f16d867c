// SPEC 4.7 and invariant 11: with the duplicate filters, the finalize steps (sequence-parallel
// params over TP, replicated params over GTP_remat) and the padding correction, the grad norm and
// the zero count of one model on one global batch are the same for every (TP, GTP_remat, DP)
// factorization of 8 and of 16 ranks, with and without sequence parallelism.
#include "core/grad_stats.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <mutex>
#include <optional>
#include <tuple>
#include <utility>

#include "core/attributes.h"
#include "core/gtp.h"
#include "core/layers.h"
#include "core/process_groups.h"
#include "tests/sim_test_util.h"

namespace tpsim {
namespace {

using ::testing::HasSubstr;
using testing::errorOf;
using testing::maxRelError;
using testing::runRanks;
using testing::tensorOf;
using testing::valuesOf;

struct Stats {
  double norm;
  // Rank 0's finalized bias gradients: the row bias whole, the column bias's first F/T; their
  // share of `norm` is too small to show an error in them.
  std::vector<double> rowBiasGrad, columnBiasGrad;
  std::int64_t zeros;
  std::int64_t zerosWithoutPadCorrection;
  // With a distributed optimizer: fragments over the gtp-excluded dp_cp, reduced over the
  // optimizer instance (the world), and, wrongly, over the model-parallel group.
  double distOptNorm;
  std::int64_t distOptZeros;
  double distOptNormOverModelParallel;
};

// A layer that tags its parameters wrongly for finalize_model_grads.
enum class Mistag { kNone, kRowBiasUntagged, kRowBiasTaggedFalse, kColumnBiasTagged };

// Column(K -> F, bias) then Row(F -> K, input_is_parallel, bias) on a global batch of B samples,
// split over the D·G data-parallel positions, and under sequence parallelism each TP rank's input
// and output gradient cut to its s/T sequence slice; gradients averaged the way Megatron's DDP (1/D
// pre-scale) and GTP_remat (MEAN) do.
Stats run(int T, int G, int D, bool sequenceParallel = false, Mistag mistag = Mistag::kNone) {
  const std::int64_t s = 8, B = 16, K = 8, F = 24, b = B / (D * G);
  ParallelSizes sizes;
  sizes.world = T * G * D;
  sizes.tp = T;
  sizes.gtpRemat = G;
  const ParallelLayout layout(sizes);
  Stats out{};
  std::mutex mu;
  testing::runRanks(sizes.world, [&](RankContext& ctx) {
    ProcessGroups pg(ctx.comm, layout);
    GtpGradReducer reducer(ctx.compute, {true, false, true});
    Generator g1(11), g2(12);
    ModelParallelConfig config;
    config.tensorModelParallelSize = std::max(2, T);
    config.useCpuInitialization = true;
    config.sequenceParallel = sequenceParallel;
    LayerContext c1{ctx.compute, pg.tp(), nullptr, &g1, &pg.gtpRemat(), &pg.dpCp(), &reducer};
    LayerContext c2{ctx.compute, pg.tp(), nullptr, &g2, &pg.gtpRemat(), &pg.dpCp(), &reducer};
    ColumnParallelLinear fc1(c1, config, K, F, initMethodNormal(0.5));
    RowParallelOptions ro;
    ro.inputIsParallel = true;
    RowParallelLinear fc2(c2, config, F, K, initMethodNormal(0.5), ro);
    if (mistag == Mistag::kRowBiasUntagged) fc2.bias()->attrs.sequenceParallel.reset();
    if (mistag == Mistag::kRowBiasTaggedFalse) fc2.bias()->attrs.sequenceParallel = false;
    if (mistag == Mistag::kColumnBiasTagged) fc1.bias()->attrs.sequenceParallel = true;
    std::vector<Parameter*> params = {fc1.weight(), fc1.bias(), &fc2.weight(), fc2.bias()};
    for (Parameter* p : params) p->mainGrad = ctx.compute.zeros(p->data.shape(), DType::kFloat32);
    // This rank's slice of the global batch: data-parallel position q = g + G·d; under sequence
    // parallelism, positions [i0, i0 + sl) of the sequence.
    const int q = pg.dpGtp().rank();
    const std::int64_t sl = sequenceParallel ? s / T : s, i0 = sequenceParallel ? pg.tp().rank() * sl : 0;
    std::vector<double> x(sl * b * K), dy(sl * b * K);
    for (std::int64_t i = 0; i < sl; ++i)
      for (std::int64_t j = 0; j < b; ++j)
        for (std::int64_t k = 0; k < K; ++k) {
          const std::int64_t sample = q * b + j, at = (i * b + j) * K + k, pos = i0 + i;
          // Input feature 5 is always zero: column 5 of fc1's wgrad is a true zero to count.
          x[at] = k == 5 ? 0.0 : std::sin(double(1 + pos * 131 + sample * 17 + k * 7));
          // Each replica's loss is the mean over its own samples: after the DP and GTP means the
          // gradient is the mean over the global batch, whatever the factorization.
          dy[at] = std::cos(double(3 + pos * 37 + sample * 11 + k * 5)) / double(b);
        }
    Tensor input = tensorOf(ctx.compute, DType::kFloat32, x, Shape{sl, b, K});  // alive until backward
    Tensor h = fc1.forward(input).output;
    fc2.forward(h);
    Tensor dh = fc2.backward(tensorOf(ctx.compute, DType::kFloat32, dy, Shape{sl, b, K}));
    fc1.backward(dh);
    reducer.drain();
    // Non-shard gradients went to grad; give every parameter one accumulation buffer.
    for (Parameter* p : params)
      if (!isGtpShard(*p)) ctx.compute.axpy(1.f, p->grad, p->mainGrad);
    for (Parameter* p : params) pg.dp().allReduce(p->mainGrad, AllReduceOptions{ReduceOp::kMean})->wait();
    finalizeSequenceParallelGrads(params, pg.tp(), config.sequenceParallel);
    finalizeReplicatedGrads(params, &pg.gtpRemat(), nullptr, true);
    const DuplicateFilter filter{&pg.tp(), nullptr, &pg.gtpRemat(), nullptr};
    // Every DP replica holds the whole gradient (no distributed optimizer), so the statistics
    // reduce over the model-parallel group tp-gtp_remat-pp.
    Collectives& stats = pg.modelParallel();
    const std::int64_t uncorrected = countZeros(ctx.compute, params, filter, stats);
    stampGtpPadZeros(params);
    const double norm = gradNormL2(ctx.compute, params, filter, stats);
    const std::int64_t zeros = countZeros(ctx.compute, params, filter, stats);
    const auto fragments = distOptFragments(params, pg.dpCp().rank(), pg.dpCp().size());
    const double distOptNorm = gradNormL2(ctx.compute, fragments, filter, pg.intraDistOpt());
    const std::int64_t distOptZeros = countZeros(ctx.compute, fragments, filter, pg.intraDistOpt());
    const double distOptNormOverModelParallel = gradNormL2(ctx.compute, fragments, filter, stats);
    std::lock_guard<std::mutex> lock(mu);
    if (ctx.comm.rank() == 0)
      out = {norm, valuesOf(ctx.compute, fc2.bias()->mainGrad), valuesOf(ctx.compute, fc1.bias()->mainGrad), zeros,
             uncorrected, distOptNorm, distOptZeros, distOptNormOverModelParallel};
  });
  return out;
}

// The reference's column bias gradient cut to what rank 0 of `sharded` holds.
std::vector<double> columnPrefix(const Stats& reference, const Stats& sharded) {
  return std::vector<double>(reference.columnBiasGrad.begin(),
                             reference.columnBiasGrad.begin() + std::ptrdiff_t(sharded.columnBiasGrad.size()));
}

void expectBiasGradsOf(const Stats& reference, const Stats& sharded) {
  EXPECT_LT(maxRelError(sharded.rowBiasGrad, reference.rowBiasGrad), 1e-4) << "row bias";
  EXPECT_LT(maxRelError(sharded.columnBiasGrad, columnPrefix(reference, sharded)), 1e-4) << "column bias";
}

TEST(GradStats, TopologyIndependentNormAndZeroCount) {
  const Stats reference = run(1, 1, 1);
  // fc1.weight column 5 is zero in every row: F zeros, found once whatever the sharding.
  EXPECT_EQ(reference.zeros, 24);
  struct Factorization {
    int T, G, D;
  };
  for (const Factorization& f : {Factorization{1, 1, 8}, {2, 1, 4}, {1, 2, 4}, {2, 2, 2}, {4, 2, 1}, {2, 4, 1},
                                 {1, 8, 1}, {8, 1, 1}, {2, 2, 4}, {4, 4, 1}, {1, 16, 1}, {2, 8, 1}}) {
    SCOPED_TRACE(::testing::Message() << "T=" << f.T << " G=" << f.G << " D=" << f.D);
    const Stats s = run(f.T, f.G, f.D);
    EXPECT_NEAR(s.norm, reference.norm, 1e-5 * reference.norm);
    expectBiasGradsOf(reference, s);
    EXPECT_EQ(s.zeros, reference.zeros);
    if (f.G > 1) {
      EXPECT_GT(s.zerosWithoutPadCorrection, s.zeros) << "the padding rows would count as zeros";
    }
    // G13 with a distributed optimizer: the fragments tile every gradient once over the world.
    EXPECT_NEAR(s.distOptNorm, reference.norm, 1e-5 * reference.norm);
    EXPECT_EQ(s.distOptZeros, reference.zeros);
    if (f.D > 1) {
      EXPECT_LT(s.distOptNormOverModelParallel, 0.99 * reference.norm) << "one fragment per replica";
    }
  }
}

// Under sequence parallelism each rank's row-bias gradient covers its own sequence slice; finalize
// sums it over TP because the bias is tagged sequence_parallel (SPEC 3.19 step 6), so the statistics
// match the run without it. A layer that leaves the tag out, sets it false, or puts it on the
// TP-sharded column bias leaves the finalized bias gradients wrong.
TEST(GradStats, SequenceParallelGradsAreFinalizedByTheirTag) {
  const Stats reference = run(1, 1, 1);
  struct Factorization {
    int T, G, D;
  };
  for (const Factorization& f : {Factorization{2, 1, 4}, {4, 1, 2}, {8, 1, 1}, {2, 2, 2}, {4, 2, 1}}) {
    SCOPED_TRACE(::testing::Message() << "T=" << f.T << " G=" << f.G << " D=" << f.D);
    const Stats s = run(f.T, f.G, f.D, true);
    EXPECT_NEAR(s.norm, reference.norm, 1e-5 * reference.norm);
    expectBiasGradsOf(reference, s);
    EXPECT_EQ(s.zeros, reference.zeros);
    EXPECT_NEAR(s.distOptNorm, reference.norm, 1e-5 * reference.norm);
    const Stats untagged = run(f.T, f.G, f.D, true, Mistag::kRowBiasUntagged);
    EXPECT_GT(maxRelError(untagged.rowBiasGrad, reference.rowBiasGrad), 0.1) << "row bias without the tag";
    const Stats taggedFalse = run(f.T, f.G, f.D, true, Mistag::kRowBiasTaggedFalse);
    EXPECT_GT(maxRelError(taggedFalse.rowBiasGrad, reference.rowBiasGrad), 0.1) << "row bias tagged false";
    const Stats columnTagged = run(f.T, f.G, f.D, true, Mistag::kColumnBiasTagged);
    EXPECT_GT(maxRelError(columnTagged.columnBiasGrad, columnPrefix(reference, s)), 0.1) << "column bias tagged";
  }
}

// finalizeSequenceParallelGrads sums over TP exactly the trainable parameters tagged
// sequence_parallel = true, main_grad when there is one, and only when the config's sequence
// parallelism is on.
TEST(GradStats, FinalizeSequenceParallelGradsReadsTheTag) {
  runRanks(2, [](RankContext& ctx) {
    const double mine = ctx.comm.rank() + 1;  // 1 on rank 0, 2 on rank 1: the sum is 3
    auto param = [&](const char* name, std::optional<bool> tag) {
      Parameter p;
      p.name = name;
      p.grad = tensorOf(ctx.compute, DType::kFloat32, {mine, mine});
      p.attrs.sequenceParallel = tag;
      return p;
    };
    Parameter tagged = param("tagged", true), untagged = param("untagged", std::nullopt),
              taggedFalse = param("taggedFalse", false), frozen = param("frozen", true),
              fused = param("fused", true);
    frozen.requiresGrad = false;
    fused.mainGrad = tensorOf(ctx.compute, DType::kFloat32, {mine, mine});
    const std::vector<Parameter*> params = {&tagged, &untagged, &taggedFalse, &frozen, &fused};
    finalizeSequenceParallelGrads(params, ctx.comm, false);
    for (const Parameter* p : params) EXPECT_EQ(valuesOf(ctx.compute, p->grad), std::vector<double>(2, mine)) << p->name;
    finalizeSequenceParallelGrads(params, ctx.comm, true);
    const std::vector<double> summed(2, 3.0), own(2, mine);
    EXPECT_EQ(valuesOf(ctx.compute, tagged.grad), summed);
    EXPECT_EQ(valuesOf(ctx.compute, untagged.grad), own);
    EXPECT_EQ(valuesOf(ctx.compute, taggedFalse.grad), own);
    EXPECT_EQ(valuesOf(ctx.compute, frozen.grad), own);
    EXPECT_EQ(valuesOf(ctx.compute, fused.mainGrad), summed);
    EXPECT_EQ(valuesOf(ctx.compute, fused.grad), own);
    Parameter empty;
    empty.name = "empty";
    empty.attrs.sequenceParallel = true;
    EXPECT_THAT(errorOf([&] { finalizeSequenceParallelGrads({&empty}, ctx.comm, true); }),
                HasSubstr("empty is tagged sequence_parallel but has neither main_grad nor grad"));
  });
}

// Fragments cut the buffer [w (2·3) | b (4)] into equal contiguous ranges; pad rows inside a
// range are counted per fragment (SPEC 3.6), so the pieces add up to the whole shard's count.
TEST(GradStats, DistOptFragmentsTileTheBuffer) {
  testing::runRanks(2, [](RankContext& ctx) {
    Parameter w, b;
    w.name = "w";
    b.name = "b";
    w.mainGrad = ctx.compute.zeros({2, 3}, DType::kFloat32);
    b.mainGrad = ctx.compute.zeros({4}, DType::kFloat32);
    w.data = ctx.compute.zeros({2, 3}, DType::kFloat32);
    w.attrs.isGtpWeightRemat = true;
    w.attrs.group = &ctx.comm;
    w.attrs.padLength = 3;  // Dlog 1: rank 0 holds 1 real + 1 pad row, rank 1 two pad rows
    const std::vector<Parameter*> params = {&w, &b};
    auto f = distOptFragments(params, 0, 3);  // buffer of 10 -> ranges of 4: [0, 4) [4, 8) [8, 10)
    ASSERT_EQ(f.size(), 1u);
    EXPECT_EQ(f[0].param, &w);
    EXPECT_EQ(std::make_pair(f[0].begin, f[0].end), std::make_pair(std::int64_t{0}, std::int64_t{4}));
    f = distOptFragments(params, 1, 3);
    ASSERT_EQ(f.size(), 2u);
    EXPECT_EQ(std::make_tuple(f[0].param, f[0].begin, f[0].end), std::make_tuple(&w, std::int64_t{4}, std::int64_t{6}));
    EXPECT_EQ(std::make_tuple(f[1].param, f[1].begin, f[1].end), std::make_tuple(&b, std::int64_t{0}, std::int64_t{2}));
    EXPECT_EQ(f[1].gtpPadZeros, 0);
    std::int64_t pads = 0;
    for (int d = 0; d < 3; ++d)
      for (const GradFragment& g : distOptFragments(params, d, 3)) pads += g.gtpPadZeros;
    EXPECT_EQ(pads, gtpLocalPadZeroCount(w, 0, 6));
    EXPECT_EQ(pads, ctx.comm.rank() == 0 ? 3 : 6);
    EXPECT_THROW(distOptFragments(params, 3, 3), InvalidArgument);
  });
}

}  // namespace
}  // namespace tpsim
