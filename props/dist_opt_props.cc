// The distributed optimizer's view of the gradients (core/grad_stats.h, SPEC 4.7 with invariants 9
// and 11): distOptFragments cuts the gradients, laid end to end, into dpSize equal contiguous
// ranges, so over the data-parallel ranks the fragments tile every parameter's [0, numel) exactly
// once, in order, and split each GTP_remat shard's padding count without losing or doubling any;
// and the grad norm and zero count over those fragments, reduced over the optimizer instance
// (ProcessGroups::intraDistOpt), count every distinct gradient element exactly once.
#include <algorithm>
#include <cmath>
#include <mutex>
#include <random>
#include <sstream>

#include "core/attributes.h"
#include "core/grad_stats.h"
#include "core/gtp.h"
#include "core/process_groups.h"
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
constexpr int kTilingCases = 2000;
constexpr int kStatisticsCases = 300;

// One parameter of a drawn model: a weight (TP-sharded along dim 0 and, when G > 1, a GTP_remat
// shard), a TP-sharded bias (never GTP_remat-sharded) or a replicated one.
struct ParamSpec {
  enum Kind { kWeight, kTpBias, kReplicated } kind = kWeight;
  std::int64_t rows = 1;                // per TP rank: Dlog of a weight
  std::vector<std::int64_t> trailing;  // weights only
  int a = 16;                           // pad_for_alignment of a weight
  bool inMainGrad = true;               // the gradient lives in main_grad, else in grad
};

void showValue(const ParamSpec& p, std::ostream& os) {
  const char* kinds[] = {"weight", "tp-bias", "replicated"};
  os << kinds[p.kind] << " rows " << p.rows;
  for (std::int64_t d : p.trailing) os << " x " << d;
  if (p.kind == ParamSpec::kWeight) os << " a=" << p.a;
  os << (p.inMainGrad ? " (main_grad)" : " (grad)");
}

rc::Gen<ParamSpec> genParamSpec(int G, bool withBiases) {
  return rc::gen::exec([G, withBiases] {
    ParamSpec p;
    p.kind = withBiases ? *pick<ParamSpec::Kind>({ParamSpec::kWeight, ParamSpec::kTpBias, ParamSpec::kReplicated})
                        : ParamSpec::kWeight;
    p.rows = *pick<std::int64_t>({3, 1, 2, 5, 7, 16, 31});
    if (p.kind == ParamSpec::kWeight) {
      if (*flag()) p.rows *= G;
      p.trailing = *pick<std::vector<std::int64_t>>({{4}, {}, {1}, {3}, {2, 3}});
      p.a = *genPadForAlignment({p.rows}, G);
    }
    p.inMainGrad = !*flag();
    return p;
  });
}

// The law of the fragments, on G ranks (each a GTP peer holding its own shards): for dpSize in 1..8,
// the fragments of dp ranks 0, 1, ..., dpSize − 1, read in that order, are non-empty contiguous
// pieces that walk through every parameter's [0, numel) exactly once, in `params` order; dp rank d's
// pieces are exactly [d·share, (d+1)·share) of the concatenated buffer (share = ceil(total/dpSize),
// the last rank's cut short), so no rank holds more than share elements; a fragment's gtpPadZeros is
// the number of padding elements (the zeros of a zero-free weight's shard) in its range, 0 for a
// parameter that is not a GTP_remat shard, and they add up over the dp ranks to the whole shard's
// gtpLocalPadZeroCount.
TPSIM_PROP(DistOptLaws, FragmentsTileEveryGradientOnceInOrderAndSplitItsPadding, kTilingCases) {
  const int G = *pick<int>({2, 1, 4, 3});
  const int dpSize = *uniform<int>(1, 9);
  const std::vector<ParamSpec> specs = *rc::gen::resize(
      8, rc::gen::suchThat(rc::gen::container<std::vector<ParamSpec>>(genParamSpec(G, true)),
                           [](const std::vector<ParamSpec>& v) { return !v.empty() && v.size() <= 6; }));
  const std::uint64_t seed = *genSeed();
  RC_TAG(G == 1 ? "G = 1" : "GTP_remat", dpSize == 1 ? "dpSize 1" : "dpSize > 1");
  RC_LOG() << "G=" << G << " dpSize=" << dpSize << "\n";
  for (const Backend* b : usableBackends()) {
    Problems problems;
    b->runRanks(G, [&](RankContext& ctx) {
      Compute& compute = ctx.compute;
      const int g = ctx.comm.rank();
      const std::string at = "rank " + std::to_string(g) + ": ";
      std::vector<Parameter> storage(specs.size());
      std::vector<Parameter*> params;
      std::vector<Values> data;  // each parameter's own values (a shard's, padding included)
      for (std::size_t i = 0; i < specs.size(); ++i) {
        const ParamSpec& s = specs[i];
        Parameter& p = storage[i];
        p.name = "p" + std::to_string(i);
        const Shape shape = shapeOf(s.rows, s.trailing);
        p.data = tensorOf(compute, DType::kFloat32, nonZeroNormals(seed + i, shape.numel()), shape);
        if (s.kind != ParamSpec::kReplicated) setTensorModelParallelAttributes(p.attrs, true, 0, 1);
        if (s.kind == ParamSpec::kWeight) wrapGtp(compute, p, ctx.comm, s.a);
        (s.inMainGrad ? p.mainGrad : p.grad) = compute.zeros(p.data.shape(), DType::kFloat32);
        data.push_back(valuesOf(compute, p.data));
        params.push_back(&p);
      }
      std::int64_t total = 0;
      for (const Values& v : data) total += std::int64_t(v.size());
      const std::int64_t share = (total + dpSize - 1) / dpSize;
      std::size_t param = 0;        // the walk: the parameter the next fragment must continue
      std::int64_t offset = 0;      // its next element
      std::int64_t position = 0;    // the next element of the concatenated buffer
      std::vector<std::int64_t> padSums(specs.size(), 0);
      for (int d = 0; d < dpSize; ++d) {
        const std::string rank = at + "dp rank " + std::to_string(d) + " of " + std::to_string(dpSize) + ": ";
        const std::int64_t mineBegin = std::min(total, d * share), mineEnd = std::min(total, (d + 1) * share);
        problems.check(position == mineBegin, rank + "its fragments start at buffer element " +
                                                  std::to_string(position) + ", expected " + std::to_string(mineBegin));
        std::int64_t held = 0;
        for (const GradFragment& f : distOptFragments(params, d, dpSize)) {
          std::ostringstream piece;
          piece << (f.param ? f.param->name : std::string("null")) << " [" << f.begin << ", " << f.end << ")";
          if (param >= params.size()) {
            problems.add(rank + "fragment " + piece.str() + " after every parameter was covered");
            return;
          }
          const std::int64_t numel = std::int64_t(data[param].size());
          if (f.param != params[param] || f.begin != offset || f.end <= f.begin || f.end > numel) {
            problems.add(rank + "fragment " + piece.str() + ", expected a non-empty piece of " + params[param]->name +
                         " starting at " + std::to_string(offset) + " and ending by " + std::to_string(numel));
            return;
          }
          std::int64_t zeros = 0;  // the shard's padding in [begin, end): its zeros
          for (std::int64_t j = f.begin; j < f.end; ++j) zeros += data[param][std::size_t(j)] == 0.0;
          problems.check(f.gtpPadZeros == zeros, rank + "fragment " + piece.str() + " has gtpPadZeros " +
                                                     std::to_string(f.gtpPadZeros) + ", but " + std::to_string(zeros) +
                                                     " padding elements");
          padSums[param] += f.gtpPadZeros;
          held += f.end - f.begin;
          position += f.end - f.begin;
          offset = f.end;
          if (offset == numel) ++param, offset = 0;
        }
        problems.check(held <= share, rank + "holds " + std::to_string(held) + " elements, more than ceil(" +
                                          std::to_string(total) + " / " + std::to_string(dpSize) + ") = " +
                                          std::to_string(share));
        problems.check(position == mineEnd, rank + "its fragments end at buffer element " + std::to_string(position) +
                                                ", expected " + std::to_string(mineEnd));
      }
      const std::string stop = param < params.size() ? params[param]->name : std::string("the end");
      problems.check(param == params.size(), at + "the fragments stop at " + stop + " element " +
                                                 std::to_string(offset) + " of " + std::to_string(specs.size()) +
                                                 " parameters");
      for (std::size_t i = 0; i < specs.size(); ++i) {
        const std::int64_t whole =
            isGtpShard(*params[i]) ? gtpLocalPadZeroCount(*params[i], 0, std::int64_t(data[i].size())) : 0;
        problems.check(padSums[i] == whole, at + params[i]->name + ": the fragments' gtpPadZeros add up to " +
                                                std::to_string(padSums[i]) + " over the dp ranks, the whole shard " +
                                                "counts " + std::to_string(whole));
      }
    });
    problems.assertNone();
  }
}

// One element of a drawn model's gradient: a small integer, zero about one time in three (so the
// count has zeros to find and every square and sum is exact in fp64, fp32 and bf16).
double gradientElement(std::uint64_t seed, std::size_t param, std::int64_t index) {
  std::mt19937_64 rng(seed * 1000003u + param * 7919u + std::uint64_t(index));
  return double(std::int64_t(rng() % 7) - 3) * (rng() % 3 == 0 ? 0.0 : 1.0);
}

// On (T, G, D) topologies of up to 16 ranks, the expert grid's EG = 1 or G (G = 1: 1 to D
// distributed-optimizer instances), every rank holds its TP slice and GTP_remat shard of a drawn
// model's gradient (integers, zeros included, identical over the D replicas, pad rows zero) in fp32
// or bf16. The grad norm and zero count over distOptFragments (cut over the dp ranks of the rank's
// optimizer instance) reduced over intraDistOpt, and those over whole gradients (stamped
// gtp_pad_zeros) reduced over the model-parallel group, both equal the norm and the zero count of
// the model's distinct elements, exactly: each element is counted once, padding never.
TPSIM_PROP(DistOptLaws, StatisticsOverTheFragmentsOfAnInstanceCountEveryElementOnce, kStatisticsCases) {
  const int T = *pick<int>({1, 2});
  const int G = *pick<int>({2, 1, 4, 3});
  std::vector<int> ds;
  for (int d = 1; d <= 4 && T * G * d <= 16; ++d) ds.push_back(d);
  const int D = *pick(ds);
  std::vector<int> instanceChoices = {1};
  if (G == 1)
    for (int i = 2; i <= D; ++i)
      if (D % i == 0) instanceChoices.push_back(i);
  const int instances = *pick(instanceChoices);
  // The expert grid's EGTP_remat: 1 (the GTP peers are expert data-parallel) or G (an instance must
  // then span the EGTP peers too).
  const int expertGtp = G > 1 ? *pick<int>({G, 1}) : 1;
  const std::vector<ParamSpec> specs = *rc::gen::resize(
      8, rc::gen::suchThat(rc::gen::container<std::vector<ParamSpec>>(genParamSpec(G, true)),
                           [](const std::vector<ParamSpec>& v) { return !v.empty() && v.size() <= 5; }));
  const DType gradDtype = *pick<DType>({DType::kFloat32, DType::kBFloat16});
  const std::uint64_t seed = *genSeed();
  // The model's distinct elements: a weight (T·rows, trailing), a TP bias (T·rows), a replicated (rows).
  double squares = 0;
  std::int64_t zeros = 0, distinct = 0;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const std::int64_t copies = specs[i].kind == ParamSpec::kReplicated ? 1 : T;
    const std::int64_t n = copies * specs[i].rows * product(specs[i].trailing);
    for (std::int64_t j = 0; j < n; ++j) {
      const double v = gradientElement(seed, i, j);
      squares += v * v;
      zeros += v == 0.0;
    }
    distinct += n;
  }
  const double norm = std::sqrt(squares);
  RC_TAG(G > 1 ? "GTP_remat" : instances > 1 ? "several instances" : "one instance");
  RC_LOG() << "T=" << T << " G=" << G << " EG=" << expertGtp << " D=" << D << " instances=" << instances << " "
           << dtypeName(gradDtype) << ": " << distinct << " distinct elements, " << zeros << " zeros, norm " << norm
           << "\n";
  ParallelSizes sizes;
  sizes.world = T * G * D;
  sizes.tp = T;
  sizes.gtpRemat = G;
  sizes.expertGtpRemat = expertGtp;
  sizes.distOptInstances = instances;
  const ParallelLayout layout(sizes);
  for (const Backend* b : usableBackends()) {
    Problems problems;
    b->runRanks(layout.world(), [&](RankContext& ctx) {
      Compute& compute = ctx.compute;
      ProcessGroups pg(ctx.comm, layout);
      const int t = pg.tp().rank(), g = pg.gtpRemat().rank();
      const std::string at = "rank " + std::to_string(ctx.comm.rank()) + " (t " + std::to_string(t) + ", g " +
                             std::to_string(g) + ", dp " + std::to_string(pg.dpCp().rank()) + "): ";
      std::vector<Parameter> storage(specs.size());
      std::vector<Parameter*> params;
      for (std::size_t i = 0; i < specs.size(); ++i) {
        const ParamSpec& s = specs[i];
        Parameter& p = storage[i];
        p.name = "p" + std::to_string(i);
        const Shape shape = shapeOf(s.rows, s.trailing);
        const std::int64_t perRow = product(s.trailing);
        // This rank's TP slice (rows [t·rows, (t+1)·rows) of the distinct elements) or the whole.
        const std::int64_t first = s.kind == ParamSpec::kReplicated ? 0 : t * s.rows * perRow;
        Values slice(std::size_t(shape.numel()));
        for (std::int64_t j = 0; j < shape.numel(); ++j) slice[std::size_t(j)] = gradientElement(seed, i, first + j);
        p.data = tensorOf(compute, gradDtype, slice, shape);  // the gradient's values stand in for the weight
        if (s.kind != ParamSpec::kReplicated) setTensorModelParallelAttributes(p.attrs, true, 0, 1);
        if (s.kind == ParamSpec::kWeight) wrapGtp(compute, p, pg.gtpRemat(), s.a);  // pad rows zero
        Tensor grad = compute.empty(p.data.shape(), gradDtype);
        compute.copy(p.data, grad);
        (s.inMainGrad ? p.mainGrad : p.grad) = std::move(grad);
        params.push_back(&p);
      }
      const DuplicateFilter filter{&pg.tp(), nullptr, &pg.gtpRemat(), nullptr};
      // The dp ranks of this rank's optimizer instance are consecutive: D/instances of them.
      const int perInstance = pg.dpCp().size() / instances;
      const auto fragments = distOptFragments(params, pg.dpCp().rank() % perInstance, perInstance);
      const double fragmentNorm = gradNormL2(compute, fragments, filter, pg.intraDistOpt());
      const std::int64_t fragmentZeros = countZeros(compute, fragments, filter, pg.intraDistOpt());
      stampGtpPadZeros(params);
      const double wholeNorm = gradNormL2(compute, params, filter, pg.modelParallel());
      const std::int64_t wholeZeros = countZeros(compute, params, filter, pg.modelParallel());
      auto report = [&](const char* what, double gotNorm, std::int64_t gotZeros) {
        std::ostringstream os;
        os.precision(17);
        os << at << what << ": norm " << gotNorm << ", zeros " << gotZeros << "; the model's " << distinct
           << " distinct elements have norm " << norm << ", " << zeros << " zeros";
        problems.check(gotNorm == norm && gotZeros == zeros, os.str());
      };
      report("over the fragments, reduced over intraDistOpt", fragmentNorm, fragmentZeros);
      report("over whole gradients, reduced over the model-parallel group", wholeNorm, wholeZeros);
    });
    problems.assertNone();
  }
}

}  // namespace
}  // namespace tpsim::props
