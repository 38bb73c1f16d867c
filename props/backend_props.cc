// The backend registry and the cross-backend laws. Every other property runs on each usable
// backend in turn; these run the same case on two backends and compare:
//   an exact layer case gives bitwise the same results on sim and gpu (forward, dgrad, wgrad, with
//     and without GTP_remat);
//   a real layer case agrees within the data-derived bound on both, and they differ by at most
//     twice the gpu's;
//   every collective gives the simulator's bits (the DeviceFabric sums in rank order);
//   on the simulator, results do not depend on the number of worker threads (bitwise).
// The duplicate filters (invariant_props.cc) and the grad norm and zero counts (gtp_props.cc) have
// their cross-backend laws next to their own. Without a usable gpu backend the sim-vs-gpu
// properties SKIP with the reason, never pass.
#include <cmath>
#include <cstdio>
#include <mutex>
#include <random>

#include "props/backends.h"
#include "props/generators.h"
#include "props/harness.h"
#include "props/rank_checks.h"
#include "tests/sim_test_util.h"
#include "tools/lib/reference.h"
#include "tpsim_config.h"

namespace tpsim::props {
namespace {

using tools::HostTensor;

constexpr int kCrossBackendCases = 500;
constexpr int kThreadCases = 1500;

const std::vector<const LayerKind*>& kAllKinds = tools::layerKinds();

// The first element where two result maps differ beyond `slack(name, i)`, or "".
std::string compareResults(const TensorMap& a, const std::string& aName, const TensorMap& b, const std::string& bName,
                           const std::function<double(const std::string&, std::size_t)>& slack) {
  if (a.size() != b.size()) return aName + " and " + bName + " produce different sets of results";
  for (const auto& [name, t] : a) {
    auto it = b.find(name);
    if (it == b.end()) return name + ": missing on " + bName;
    if (it->second.shape != t.shape || it->second.dtype != t.dtype)
      return name + ": " + aName + " gives " + dtypeName(t.dtype) + " " + shapeText(t.shape) + ", " + bName + " " +
             dtypeName(it->second.dtype) + " " + shapeText(it->second.shape);
    for (std::size_t i = 0; i < t.values.size(); ++i)
      if (!(std::fabs(t.values[i] - it->second.values[i]) <= slack(name, i))) {
        char values[96];  // 9 significant digits: a one-ulp difference of an fp32 value shows
        std::snprintf(values, sizeof values, "%s %.9g, %s %.9g", aName.c_str(), t.values[i], bName.c_str(),
                      it->second.values[i]);
        return name + " element " + std::to_string(i) + ": " + values;
      }
  }
  return "";
}


}  // namespace

TEST(Backends, SimulatorIsAlwaysRegisteredAndUsable) {
  const Backend& sim = backendNamed("sim");
  EXPECT_TRUE(sim.usable);
  ASSERT_FALSE(usableBackends().empty());
  EXPECT_EQ(usableBackends().front(), &sim);
  EXPECT_TRUE(bool(sim.runLayer));
  EXPECT_TRUE(bool(sim.runRanks));
}

// A backend is usable, or says why not: the gpu backend is unusable exactly when it was not built
// or no device is present, and then says which.
TEST(Backends, EveryBackendIsUsableOrSaysWhyNot) {
  for (const Backend& b : backends()) {
    SCOPED_TRACE(b.name);
    if (b.usable) {
      EXPECT_TRUE(bool(b.runLayer) && bool(b.runRanks));
    } else {
      EXPECT_FALSE(b.whyNot.empty());
    }
  }
  const Backend& gpu = backendNamed("gpu");
  if (!TPSIM_HAVE_GPU) {
    EXPECT_FALSE(gpu.usable);
    EXPECT_NE(gpu.whyNot.find("gpu backend not built"), std::string::npos) << gpu.whyNot;
  } else {
    EXPECT_TRUE(gpu.usable || gpu.whyNot.find("no CUDA device") != std::string::npos)
        << "the gpu backend is built but unusable: " << gpu.whyNot;
  }
  std::printf("[  props   ] backends:");
  for (const Backend& b : backends()) std::printf(" %s (%s)", b.name.c_str(), b.usable ? "usable" : b.whyNot.c_str());
  std::printf("\n");
}

// An exact case gives bitwise the same results on the simulator and on the gpu backend, GTP_remat
// cases (padding, MEAN or SUM, the fp32-accumulation reduce-scatter) included.
TEST(CrossBackend, ExactLayerCaseIsBitwiseEqualOnSimAndGpu) {
  TPSIM_REQUIRE_BACKEND("gpu");
  const Backend& sim = backendNamed("sim");
  checkProperty(kCrossBackendCases, [&] {
    const RunConfig c = *genRunConfig(exactKinds(), genTp(),
                                      GtpMode::kSometimes, Numerics::kExact);
    RC_TAG(c.gtpRemat > 1 ? "GTP_remat" : "no GTP_remat");
    const TensorMap inputs = *genExactInputs(c);
    const TensorMap a = sim.runLayer(c, inputs).results, b = other.runLayer(c, inputs).results;
    const std::string d = compareResults(a, "sim", b, other.name, [](const std::string&, std::size_t) { return 0.0; });
    if (!d.empty()) failLayerCase(runConfigOn(c, other), Numerics::kExact, "sim vs " + other.name, inputs, d);
  });
}

// A real case agrees within the bound on both backends (each its own: the gpu's GEMMs may
// accumulate less exactly); they differ by at most twice the gpu's, which covers the simulator's.
TEST(CrossBackend, RealLayerCaseAgreesWithinTheBoundOnSimAndGpu) {
  TPSIM_REQUIRE_BACKEND("gpu");
  const Backend& sim = backendNamed("sim");
  checkProperty(kCrossBackendCases, [&] {
    const RunConfig c = *genRunConfig(kAllKinds, genTp(), GtpMode::kSometimes);
    RC_TAG(c.layer->name(), c.gtpRemat > 1 ? "GTP_remat" : "no GTP_remat");
    const TensorMap inputs = realInputs(c);
    const TensorMap a = sim.runLayer(c, inputs).results, b = other.runLayer(c, inputs).results;
    for (const auto& [backend, results] : {std::pair<const Backend*, const TensorMap*>{&sim, &a}, {&other, &b}})
      for (const tools::Verdict& v : tools::verify(runConfigOn(c, *backend), tools::storedOf(inputs), *results))
        if (v.outside != 0)
          failLayerCase(runConfigOn(c, *backend), Numerics::kReal, backend->name, inputs,
                        v.name + ": " + std::to_string(v.outside) + " elements outside their bound");
    const auto ref = tools::referenceFor(runConfigOn(c, other), tools::storedOf(inputs));
    const std::string d = compareResults(a, "sim", b, other.name, [&](const std::string& name, std::size_t i) {
      return 2 * ref.at(name).bound[i];
    });
    if (!d.empty()) failLayerCase(runConfigOn(c, other), Numerics::kReal, "sim vs " + other.name, inputs, d);
  });
}

// Every collective, in sub-groups of worlds of 1 to 64 ranks (more than one on a GPU: the
// DeviceFabric), gives the simulator's bits: rank-order sums with the same roundings, a mean as one
// division after the sum, and data moved byte for byte.
TEST(CrossBackend, CollectivesAreBitwiseEqualOnSimAndGpu) {
  TPSIM_REQUIRE_BACKEND("gpu");
  const Backend& sim = backendNamed("sim");
  checkProperty(kCrossBackendCases, [&] {
    const int ranks = *pick<int>({2, 4, 8, 1, 3, 5, 16, 32, 64});
    const int groups = *uniform<int>(1, 4), block = *uniform<int>(0, 6);
    const DType dtype = *pick<DType>({DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat64});
    const ReduceOp op = *flag() ? ReduceOp::kMean : ReduceOp::kSum;
    const bool inPlace = *flag();
    const std::uint64_t seed = *genSeed();
    RC_LOG() << ranks << " ranks in " << groups << " interleaved groups, blocks of " << block << " "
             << dtypeName(dtype) << (op == ReduceOp::kMean ? ", mean" : ", sum") << (inPlace ? ", in place" : "")
             << ", seed " << seed << "\n";
    auto run = [&](const Backend& b) {
      std::mutex mu;
      std::vector<std::vector<Values>> out(static_cast<std::size_t>(ranks));  // by rank: each collective's output
      b.runRanks(ranks, [&](RankContext& ctx) {
        const int r = ctx.comm.rank();
        auto g = ctx.comm.split(r % groups, r, "sub");
        const int n = g->size(), q = g->rank();
        // Normal draws of every magnitude: each rounding of a partial sum shows.
        std::mt19937_64 rng(seed * 1000003 + std::uint64_t(r));
        std::normal_distribution<double> normal(0.0, 1.0);
        std::uniform_int_distribution<int> exponent(-8, 8);
        Values v(std::size_t(n * block));
        for (double& x : v) x = std::ldexp(normal(rng), exponent(rng));
        Compute& c = ctx.compute;
        const std::int64_t whole = std::int64_t(n) * block;
        const Tensor input = testing::tensorOf(c, dtype, v);  // read only; every op starts from it
        Tensor sum = c.empty({whole}, dtype), x = c.empty({whole}, dtype);
        c.copy(input, sum);
        Tensor part = c.empty({block}, dtype), gathered = c.zeros({whole}, dtype), exchanged = c.empty({whole}, dtype),
               root = c.empty({whole}, dtype);
        const View mine = x.view().slice(0, q * block, (q + 1) * block);             // block q of x (in place)
        const View ownBlock = gathered.view().slice(0, q * block, (q + 1) * block);  // block q of gathered
        g->allReduce(sum, AllReduceOptions{op})->wait();
        if (inPlace) {  // each op's in-place form (collectives.h)
          c.copy(input, x);
          g->reduceScatter(x, mine, ReduceScatterOptions{op})->wait();
          c.copy(mine, part);
          c.copy(part, ownBlock);
          g->allGather(ownBlock, gathered)->wait();
          c.copy(input, exchanged);
          g->allToAll(exchanged, exchanged)->wait();
          c.copy(input, root);
          g->broadcast(root, root, BroadcastOptions{n - 1})->wait();
        } else {
          g->reduceScatter(input, part, ReduceScatterOptions{op})->wait();
          g->allGather(part, gathered)->wait();
          g->allToAll(input, exchanged)->wait();
          g->broadcast(input, root, BroadcastOptions{n - 1})->wait();
        }
        std::vector<Values> results;
        for (const Tensor* t : {&sum, &part, &gathered, &exchanged, &root}) results.push_back(testing::valuesOf(c, *t));
        std::lock_guard<std::mutex> lock(mu);
        out[std::size_t(r)] = std::move(results);
      });
      return out;
    };
    const auto a = run(sim), b = run(other);
    const char* names[] = {"allReduce", "reduceScatter", "allGather", "allToAll", "broadcast"};
    for (int r = 0; r < ranks; ++r)
      for (std::size_t k = 0; k < a[std::size_t(r)].size(); ++k) {
        const std::string d = firstDifference(b[std::size_t(r)][k], a[std::size_t(r)][k],
                                              std::string(names[k]) + " on rank " + std::to_string(r) + ", " +
                                                  other.name + " vs sim");
        if (!d.empty()) RC_FAIL(d);
      }
  });
}

// On the simulator the results are bitwise the same for 1 worker thread and for several, on real
// data, for every layer kind: reductions sum in rank order whatever the schedule.
TPSIM_PROP(SimLaws, ShardedRunIsBitwiseIdenticalForAnyWorkerThreadCount, kThreadCases) {
  RunConfig c = *genRunConfig(kAllKinds);
  const int threads = *pick<int>({2, 3, 4});
  const TensorMap inputs = realInputs(c);
  const Backend& sim = backendNamed("sim");
  c.threads = 1;
  const TensorMap one = sim.runLayer(c, inputs).results;
  c.threads = threads;
  const TensorMap many = sim.runLayer(c, inputs).results;
  const std::string d = compareResults(one, "1 thread", many, std::to_string(threads) + " threads",
                                       [](const std::string&, std::size_t) { return 0.0; });
  if (!d.empty()) failLayerCase(c, Numerics::kReal, "sim", inputs, d);
}

}  // namespace tpsim::props
