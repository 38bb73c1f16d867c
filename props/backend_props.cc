// The backend registry and the cross-backend laws. Every other property runs on each usable
// backend in turn; these run the same case on two backends and compare:
//   an exact layer case gives bitwise the same results on sim and gpu (forward, dgrad, wgrad);
//   a real layer case agrees within the data-derived bound on both, and they differ by at most the
//     sum of the two bounds;
//   the duplicate filters pass the same parameters on the same ranks on both;
//   on the simulator, results do not depend on the number of worker threads (bitwise).
// Without a usable gpu backend the sim-vs-gpu properties SKIP with the reason, never pass.
#include <mutex>

#include "core/attributes.h"
#include "core/layers.h"
#include "core/process_groups.h"
#include "props/backends.h"
#include "props/generators.h"
#include "props/harness.h"
#include "tools/reference.h"
#include "tpsim_config.h"

namespace tpsim::props {
namespace {

using tools::HostTensor;

constexpr int kCrossBackendCases = 500;
constexpr int kThreadCases = 1500;

const std::vector<LayerKind> kAllKinds = {LayerKind::kColumn, LayerKind::kRow, LayerKind::kEmbedding,
                                          LayerKind::kMlp};

// The gpu backend, or a skip naming why there is none.
#define TPSIM_REQUIRE_BACKEND(name)                                          \
  const Backend& other = backendNamed(name);                                 \
  if (!other.usable) GTEST_SKIP() << name << " backend unusable: " << other.whyNot

// The first element where two result maps differ beyond `slack(name, i)`, or "".
std::string compareResults(const TensorMap& a, const std::string& aName, const TensorMap& b, const std::string& bName,
                           const std::function<double(const std::string&, std::size_t)>& slack) {
  if (a.size() != b.size()) return aName + " and " + bName + " produce different sets of results";
  for (const auto& [name, t] : a) {
    auto it = b.find(name);
    if (it == b.end()) return name + ": missing on " + bName;
    if (it->second.shape != t.shape || it->second.dtype != t.dtype)
      return name + ": " + aName + " gives " + dtypeName(t.dtype) + " " + t.shapeStr() + ", " + bName + " " +
             dtypeName(it->second.dtype) + " " + it->second.shapeStr();
    for (std::size_t i = 0; i < t.values.size(); ++i)
      if (!(std::fabs(t.values[i] - it->second.values[i]) <= slack(name, i)))
        return name + " element " + std::to_string(i) + ": " + aName + " " + std::to_string(t.values[i]) + ", " +
               bName + " " + std::to_string(it->second.values[i]);
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

// An exact case gives bitwise the same results on the simulator and on the gpu backend.
TEST(CrossBackend, ExactLayerCaseIsBitwiseEqualOnSimAndGpu) {
  TPSIM_REQUIRE_BACKEND("gpu");
  const Backend& sim = backendNamed("sim");
  checkProperty(kCrossBackendCases, [&] {
    const RunConfig c = *genRunConfig({LayerKind::kColumn, LayerKind::kRow, LayerKind::kEmbedding});
    const TensorMap inputs = *genExactInputs(c);
    const TensorMap a = sim.runLayer(c, inputs).results, b = other.runLayer(c, inputs).results;
    const std::string d = compareResults(a, "sim", b, other.name, [](const std::string&, std::size_t) { return 0.0; });
    if (!d.empty()) failLayerCase(c, Numerics::kExact, "sim vs " + other.name, inputs, d);
  });
}

// A real case agrees within the bound on both backends; they differ by at most both bounds.
TEST(CrossBackend, RealLayerCaseAgreesWithinTheBoundOnSimAndGpu) {
  TPSIM_REQUIRE_BACKEND("gpu");
  const Backend& sim = backendNamed("sim");
  checkProperty(kCrossBackendCases, [&] {
    const RunConfig c = *genRunConfig(kAllKinds);
    const TensorMap inputs = realInputs(c);
    const TensorMap a = sim.runLayer(c, inputs).results, b = other.runLayer(c, inputs).results;
    // The other backend's bound (its GEMMs may accumulate less exactly), which covers the simulator's.
    RunConfig onOther = c;
    onOther.backend = other.name;
    const auto ref = tools::referenceFor(onOther, inputs);
    for (const tools::Verdict& v : tools::verify(onOther, inputs, b))
      if (v.outside != 0) failLayerCase(c, Numerics::kReal, other.name, inputs, v.name + " outside its bound");
    const std::string d = compareResults(a, "sim", b, other.name, [&](const std::string& name, std::size_t i) {
      return 2 * ref.at(name).bound[i];
    });
    if (!d.empty()) failLayerCase(c, Numerics::kReal, "sim vs " + other.name, inputs, d);
  });
}

// The duplicate filters pass the same parameters on the same ranks on both backends.
TEST(CrossBackend, DuplicateFiltersAgreeOnSimAndGpu) {
  TPSIM_REQUIRE_BACKEND("gpu");
  const Backend& sim = backendNamed("sim");
  checkProperty(kCrossBackendCases, [&] {
    const Topology t = *genTopology(64);
    const ParallelLayout layout(sizesOf(t));
    auto passes = [&](const Backend& b) {
      std::mutex mu;
      std::map<std::pair<int, std::string>, bool> out;
      b.runRanks(layout.world(), [&](RankContext& ctx) {
        ProcessGroups groups(ctx.comm, layout);
        ModelParallelConfig config;
        config.tensorModelParallelSize = t.tp;
        config.performInitialization = false;
        ColumnParallelLinear col({ctx.compute, groups.tp()}, config, 3, 2 * t.tp, initMethodNormal(1.0));
        RowParallelLinear row({ctx.compute, groups.tp()}, config, 2 * t.tp, 3, initMethodNormal(1.0));
        std::lock_guard<std::mutex> lock(mu);
        for (const Parameter* p : {col.weight(), col.bias(), &row.weight(), row.bias()})
          out[{ctx.comm.rank(), p->name}] = paramIsNotTensorParallelDuplicate(*p, &groups.tp()) &&
                                            paramIsNotGtpDuplicate(*p, &groups.gtpRemat(), nullptr);
      });
      return out;
    };
    RC_ASSERT(passes(sim) == passes(other));
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
