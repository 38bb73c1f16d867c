// SPEC 4.7 and invariant 11: with the duplicate filters, the GTP finalize of replicated params
// and the padding correction, the grad norm and the zero count of one model on one global batch
// are the same for every (TP, GTP_remat, DP) factorization of 8 and of 16 ranks.
#include "core/grad_stats.h"

#include <gtest/gtest.h>

#include <cmath>
#include <mutex>

#include "core/gtp.h"
#include "core/layers.h"
#include "core/process_groups.h"
#include "tests/sim_test_util.h"

namespace tpsim {
namespace {

using testing::tensorOf;

struct Stats {
  double norm;
  std::int64_t zeros;
  std::int64_t zerosWithoutPadCorrection;
};

// Column(K -> F, bias) then Row(F -> K, input_is_parallel, bias) on a global batch of B samples,
// split over the D·G data-parallel positions; gradients averaged the way Megatron's DDP (1/D
// pre-scale) and GTP_remat (MEAN) do.
Stats run(int T, int G, int D) {
  const std::int64_t s = 3, B = 16, K = 8, F = 24, b = B / (D * G);
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
    LayerContext c1{ctx.compute, pg.tp(), nullptr, &g1, &pg.gtpRemat(), &pg.dpCp(), &reducer};
    LayerContext c2{ctx.compute, pg.tp(), nullptr, &g2, &pg.gtpRemat(), &pg.dpCp(), &reducer};
    ColumnParallelLinear fc1(c1, config, K, F, initMethodNormal(0.5));
    RowParallelOptions ro;
    ro.inputIsParallel = true;
    RowParallelLinear fc2(c2, config, F, K, initMethodNormal(0.5), ro);
    std::vector<Parameter*> params = {fc1.weight(), fc1.bias(), &fc2.weight(), fc2.bias()};
    for (Parameter* p : params) p->mainGrad = ctx.compute.zeros(p->data.shape(), DType::kFloat32);
    // This rank's slice of the global batch: data-parallel position q = g + G·d.
    const int q = pg.dpGtp().rank();
    std::vector<double> x(s * b * K), dy(s * b * K);
    for (std::int64_t i = 0; i < s; ++i)
      for (std::int64_t j = 0; j < b; ++j)
        for (std::int64_t k = 0; k < K; ++k) {
          const std::int64_t sample = q * b + j, at = (i * b + j) * K + k;
          // Input feature 5 is always zero: column 5 of fc1's wgrad is a true zero to count.
          x[at] = k == 5 ? 0.0 : std::sin(double(1 + i * 131 + sample * 17 + k * 7));
          // Each replica's loss is the mean over its own samples: after the DP and GTP means the
          // gradient is the mean over the global batch, whatever the factorization.
          dy[at] = std::cos(double(3 + i * 37 + sample * 11 + k * 5)) / double(b);
        }
    Tensor input = tensorOf(ctx.compute, DType::kFloat32, x, Shape{s, b, K});  // alive until backward
    Tensor h = fc1.forward(input).output;
    fc2.forward(h);
    Tensor dh = fc2.backward(tensorOf(ctx.compute, DType::kFloat32, dy, Shape{s, b, K}));
    fc1.backward(dh);
    reducer.drain();
    // Non-shard gradients went to grad; give every parameter one accumulation buffer.
    for (Parameter* p : params)
      if (!isGtpShard(*p)) ctx.compute.axpy(1.f, p->grad, p->mainGrad);
    for (Parameter* p : params) pg.dp().allReduce(p->mainGrad, AllReduceOptions{ReduceOp::kMean})->wait();
    finalizeReplicatedGrads(params, &pg.gtpRemat(), nullptr, true);
    const DuplicateFilter filter{&pg.tp(), nullptr, &pg.gtpRemat(), nullptr};
    // Every DP replica holds the whole gradient (no distributed optimizer), so the statistics
    // reduce over the model-parallel group tp-gtp_remat-pp.
    Collectives& stats = pg.modelParallel();
    const std::int64_t uncorrected = countZeros(ctx.compute, params, filter, stats);
    stampGtpPadZeros(params);
    const double norm = gradNormL2(ctx.compute, params, filter, stats);
    const std::int64_t zeros = countZeros(ctx.compute, params, filter, stats);
    std::lock_guard<std::mutex> lock(mu);
    out = {norm, zeros, uncorrected};
  });
  return out;
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
    EXPECT_EQ(s.zeros, reference.zeros);
    if (f.G > 1) {
      EXPECT_GT(s.zerosWithoutPadCorrection, s.zeros) << "the padding rows would count as zeros";
    }
  }
}

}  // namespace
}  // namespace tpsim
