// Laws of the region mappings (core/mappings.h, SPEC 2.2 and 6 item 3) on the TP groups of random
// topologies (up to 32 ranks, several TP groups side by side), random shapes, uneven splits and
// dtypes, on every usable backend:
//   ⟨f(x), y⟩ == ⟨x, f*(y)⟩ for every mapping f and its backward f*, each inner product taken as
//     its side is held: per rank Σ_r ⟨u_r, v_r⟩, replicated ⟨u_0, v_0⟩ counted once;
//   gather(scatter(x)) == x along the last dim (Tp) and along the sequence (Sp);
//   gather_from_sp(reduce_scatter_to_sp(x)) == reduce_from_tp(x).
// Data are small integers, so every sum is exact and both sides are compared with ==.
#include <memory>
#include <mutex>

#include "core/mappings.h"
#include "core/process_groups.h"
#include "props/backends.h"
#include "props/generators.h"
#include "props/harness.h"
#include "tests/sim_test_util.h"

namespace tpsim::props {
namespace {

using testing::tensorOf;
using testing::valuesOf;

constexpr int kAdjointCases = 4000;
constexpr int kRoundTripCases = 1500;

enum class Held { kPerRank, kReplicated };

// One mapping as an adjoint pair: how its input and output are held, their shapes on group rank q
// of n, and its two halves (in-place halves run on a copy).
struct Mapping {
  const char* name;
  Held input, output;
  std::function<Shape(int n, int q)> inShape, outShape;
  std::function<Tensor(Compute&, Collectives&, ConstView)> forward, backward;
};

Tensor copyOf(Compute& compute, ConstView x) {
  Tensor out = compute.empty(x.shape(), x.dtype());  // shape of x
  compute.copy(x, out);
  return out;
}

template <void (*kInPlace)(Compute&, Collectives&, View)>
Tensor onCopy(Compute& compute, Collectives& group, ConstView x) {
  Tensor y = copyOf(compute, x);  // shape of x
  kInPlace(compute, group, y);
  return y;
}

// The extents a case draws: d0, d1 (any), c (last-dim chunk) and the uneven dim-0 split sizes.
struct Extents {
  std::int64_t d0, d1, c;
  SplitSizes uneven;  // one per group rank, zeros allowed
};

std::int64_t total(const SplitSizes& s) {
  std::int64_t t = 0;
  for (std::int64_t v : s) t += v;
  return t;
}

std::vector<Mapping> mappings(const Extents& e) {
  using C = Compute&;
  using G = Collectives&;
  const std::int64_t d0 = e.d0, d1 = e.d1, c = e.c;
  const SplitSizes u = e.uneven;
  auto same = [d0, d1](int, int) { return Shape{d0, d1}; };
  return {
      {"copy_to_tp", Held::kReplicated, Held::kPerRank, same, same, onCopy<copyToTpRegionForward>,
       onCopy<copyToTpRegionBackward>},
      {"reduce_from_tp", Held::kPerRank, Held::kReplicated, same, same, onCopy<reduceFromTpRegionForward>,
       onCopy<reduceFromTpRegionBackward>},
      {"scatter_to_tp", Held::kReplicated, Held::kPerRank, [=](int n, int) { return Shape{d0, c * n}; },
       [=](int, int) { return Shape{d0, c}; },
       [](C x, G g, ConstView v) { return scatterToTpRegionForward(x, g, v); },
       [](C x, G g, ConstView v) { return scatterToTpRegionBackward(x, g, v); }},
      {"gather_from_tp", Held::kPerRank, Held::kReplicated, [=](int, int) { return Shape{d0, c}; },
       [=](int n, int) { return Shape{d0, c * n}; },
       [](C x, G g, ConstView v) { return gatherFromTpRegionForward(x, g, v); },
       [](C x, G g, ConstView v) { return gatherFromTpRegionBackward(x, g, v); }},
      {"scatter_to_sp", Held::kReplicated, Held::kPerRank, [=](int n, int) { return Shape{d0 * n, d1}; }, same,
       [](C x, G g, ConstView v) { return scatterToSpRegionForward(x, g, v); },
       [](C x, G g, ConstView v) { return scatterToSpRegionBackward(x, g, v); }},
      {"gather_from_sp(tensor_parallel_output_grad=false)", Held::kPerRank, Held::kReplicated, same,
       [=](int n, int) { return Shape{d0 * n, d1}; },
       [](C x, G g, ConstView v) { return gatherFromSpRegionForward(x, g, v); },
       [](C x, G g, ConstView v) { return gatherFromSpRegionBackward(x, g, v, false); }},
      {"gather_from_sp(tensor_parallel_output_grad=true)", Held::kPerRank, Held::kPerRank, same,
       [=](int n, int) { return Shape{d0 * n, d1}; },
       [](C x, G g, ConstView v) { return gatherFromSpRegionForward(x, g, v); },
       [](C x, G g, ConstView v) { return gatherFromSpRegionBackward(x, g, v, true); }},
      {"gather_from_sp(uneven)", Held::kPerRank, Held::kPerRank, [=](int, int q) { return Shape{u[q], d1}; },
       [=](int, int) { return Shape{total(u), d1}; },
       [u](C x, G g, ConstView v) { return gatherFromSpRegionForward(x, g, v, u); },
       [u](C x, G g, ConstView v) { return gatherFromSpRegionBackward(x, g, v, true, u); }},
      {"reduce_scatter_to_sp", Held::kPerRank, Held::kPerRank, [=](int n, int) { return Shape{d0 * n, d1}; }, same,
       [](C x, G g, ConstView v) { return reduceScatterToSpRegionForward(x, g, v); },
       [](C x, G g, ConstView v) { return reduceScatterToSpRegionBackward(x, g, v); }},
      {"reduce_scatter_to_sp(uneven)", Held::kPerRank, Held::kPerRank, [=](int, int) { return Shape{total(u), d1}; },
       [=](int, int q) { return Shape{u[q], d1}; },
       [u](C x, G g, ConstView v) { return reduceScatterToSpRegionForward(x, g, v, u); },
       [u](C x, G g, ConstView v) { return reduceScatterToSpRegionBackward(x, g, v, u); }},
      {"all_gather_last_dim_from_tp", Held::kPerRank, Held::kPerRank, [=](int, int) { return Shape{d0, d1, c}; },
       [=](int n, int) { return Shape{d0, d1, c * n}; },
       [](C x, G g, ConstView v) { return allGatherLastDimFromTpRegionForward(x, g, v); },
       [](C x, G g, ConstView v) { return allGatherLastDimFromTpRegionBackward(x, g, v); }},
      {"reduce_scatter_last_dim_to_tp", Held::kPerRank, Held::kPerRank,
       [=](int n, int) { return Shape{d0, d1, c * n}; }, [=](int, int) { return Shape{d0, d1, c}; },
       [](C x, G g, ConstView v) { return reduceScatterLastDimToTpRegionForward(x, g, v); },
       [](C x, G g, ConstView v) { return reduceScatterLastDimToTpRegionBackward(x, g, v); }},
  };
}

// Small integers in [-3, 3]: with at most 8 ranks every sum stays below 2^8, exact in every dtype.
std::vector<double> smallIntegers(std::uint64_t seed, std::int64_t count) { return seededIntegers(seed, count, 3); }

double dot(const std::vector<double>& u, const std::vector<double>& v) {
  double s = 0;
  for (std::size_t i = 0; i < u.size(); ++i) s += u[i] * v[i];
  return s;
}

// The topology's TP groups: each rank runs fn with its ProcessGroups.
void onTpGroups(const Backend& b, const Topology& t,
                const std::function<void(RankContext&, ProcessGroups&, int globalRank)>& fn) {
  const ParallelLayout layout(sizesOf(t));
  b.runRanks(layout.world(), [&](RankContext& ctx) {
    ProcessGroups groups(ctx.comm, layout);
    fn(ctx, groups, ctx.comm.rank());
  });
}

}  // namespace

// ⟨f(x), y⟩ == ⟨x, f*(y)⟩ per TP group, with the replicated side counted once (SPEC 6 item 3).
TPSIM_PROP(MappingLaws, BackwardIsTheAdjointOfForward, kAdjointCases) {
  const Topology t = *genTopology(32);
  const int n = t.tp;
  const Extents e{*pick<std::int64_t>({1, 2, 3}), *pick<std::int64_t>({1, 2, 3, 5}), *pick<std::int64_t>({1, 2, 3}),
                  *rc::gen::container<SplitSizes>(std::size_t(n), pick<std::int64_t>({0, 1, 2, 3}))};
  const std::vector<Mapping> all = mappings(e);
  const Mapping& m = all[std::size_t(*pickIndex(int(all.size())))];
  const DType dtype = *genFloatDtype();
  const std::uint64_t seed = *genSeed();
  RC_TAG(m.name);
  RC_LOG() << "mapping " << m.name << ", " << dtypeName(dtype) << ", d0=" << e.d0 << " d1=" << e.d1 << " c=" << e.c
           << "\n";
  const ParallelLayout layout(sizesOf(t));
  for (const Backend* b : usableBackends()) {
    std::vector<double> lhs(std::size_t(t.world())), rhs(std::size_t(t.world()));  // per global rank
    std::mutex mu;
    std::vector<std::string> wrongShapes;
    onTpGroups(*b, t, [&](RankContext& ctx, ProcessGroups& groups, int r) {
      Compute& compute = ctx.compute;
      Collectives& tp = groups.tp();
      const int q = tp.rank(), group = layout.groupIndex(GroupId::kTp, r);
      const Shape xShape = m.inShape(n, q), yShape = m.outShape(n, q);
      // A replicated side is drawn once per TP group; a per-rank side once per rank.
      const std::uint64_t xKey = m.input == Held::kReplicated ? 1000 + group : 2000 + r;
      const std::uint64_t yKey = m.output == Held::kReplicated ? 3000 + group : 4000 + r;
      Tensor x = tensorOf(compute, dtype, smallIntegers(seed * 7919 + xKey, xShape.numel()), xShape);  // inShape
      Tensor y = tensorOf(compute, dtype, smallIntegers(seed * 7919 + yKey, yShape.numel()), yShape);  // outShape
      Tensor fx = m.forward(compute, tp, x);    // f(x): y's shape
      Tensor fty = m.backward(compute, tp, y);  // f*(y): x's shape
      if (fx.shape() != yShape || fty.shape() != xShape) {
        std::lock_guard<std::mutex> lock(mu);
        wrongShapes.push_back(std::string(m.name) + " on rank " + std::to_string(r) + ": f(x) is " +
                              fx.shape().str() + " and f*(y) " + fty.shape().str() + ", expected " + yShape.str() +
                              " and " + xShape.str());
        return;
      }
      lhs[std::size_t(r)] = m.output == Held::kReplicated && q != 0 ? 0.0 : dot(valuesOf(compute, fx), valuesOf(compute, y));
      rhs[std::size_t(r)] = m.input == Held::kReplicated && q != 0 ? 0.0 : dot(valuesOf(compute, x), valuesOf(compute, fty));
    });
    if (!wrongShapes.empty()) RC_FAIL(wrongShapes.front());
    for (const auto& members : layout.groups(GroupId::kTp)) {
      double left = 0, right = 0;
      for (int r : members) {
        left += lhs[std::size_t(r)];
        right += rhs[std::size_t(r)];
      }
      RC_ASSERT(left == right);
    }
  }
}

// gather_from_tp(scatter_to_tp(x)) == x and gather_from_sp(scatter_to_sp(x)) == x for a
// replicated x; gather_from_sp(reduce_scatter_to_sp(x)) == reduce_from_tp(x) for per-rank x.
TPSIM_PROP(MappingLaws, GatherUndoesScatterAndReduceScatterThenGatherIsReduce, kRoundTripCases) {
  const Topology t = *genTopology(32);
  const std::int64_t d0 = *pick<std::int64_t>({1, 2, 3}), d1 = *pick<std::int64_t>({1, 2, 3, 5});
  const DType dtype = *genFloatDtype();
  const std::uint64_t seed = *genSeed();
  const ParallelLayout layout(sizesOf(t));
  const int n = t.tp;
  for (const Backend* b : usableBackends()) {
    std::mutex mu;
    std::vector<std::string> wrong;
    onTpGroups(*b, t, [&](RankContext& ctx, ProcessGroups& groups, int r) {
      Compute& compute = ctx.compute;
      Collectives& tp = groups.tp();
      const int group = layout.groupIndex(GroupId::kTp, r);
      const std::vector<double> rep = smallIntegers(seed + 17 * group, d0 * n * d1 * n);  // replicated
      Tensor lastDim = tensorOf(compute, dtype, rep, Shape{d0 * n, d1 * n});  // (d0·n, d1·n), replicated
      Tensor tpRoundTrip =  // (d0·n, d1·n) via (d0·n, d1)
          gatherFromTpRegionForward(compute, tp, scatterToTpRegionForward(compute, tp, lastDim));
      Tensor spRoundTrip =  // (d0·n, d1·n) via (d0, d1·n)
          gatherFromSpRegionForward(compute, tp, scatterToSpRegionForward(compute, tp, lastDim));
      Tensor mine =  // (d0·n, d1), per rank
          tensorOf(compute, dtype, smallIntegers(seed + 100003 * (r + 1), d0 * n * d1), Shape{d0 * n, d1});
      Tensor viaSp =  // (d0·n, d1) via (d0, d1)
          gatherFromSpRegionForward(compute, tp, reduceScatterToSpRegionForward(compute, tp, mine));
      reduceFromTpRegionForward(compute, tp, mine);  // in place: the TP sum
      std::lock_guard<std::mutex> lock(mu);
      if (valuesOf(compute, tpRoundTrip) != rep) wrong.push_back("gather_from_tp(scatter_to_tp(x)) != x on rank " + std::to_string(r));
      if (valuesOf(compute, spRoundTrip) != rep) wrong.push_back("gather_from_sp(scatter_to_sp(x)) != x on rank " + std::to_string(r));
      if (valuesOf(compute, viaSp) != valuesOf(compute, mine))
        wrong.push_back("gather_from_sp(reduce_scatter_to_sp(x)) != reduce_from_tp(x) on rank " + std::to_string(r));
    });
    if (!wrong.empty()) RC_FAIL(wrong.front());
  }
}

}  // namespace tpsim::props
