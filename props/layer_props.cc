// The central laws, over random layer kinds, T, dtypes, options and awkward shapes, on every usable
// backend (SPEC 6 items 1, 2, 4, 17 for the layers as a whole, and 8 for GTP_remat through
// tools::runSharded):
//   Column / Row / VocabParallelEmbedding sharded == unsharded, bitwise, on exact data;
//   the same within the data-derived bound of tools/lib/reference.h, on real data;
//   Column(gather_output=false) -> GeLU -> Row(input_is_parallel) == the dense MLP, within the bound;
//   an exact case gives bitwise the same results at T = 1 and at T = k.
// About one case in three also shards the weights over G GTP_remat peers that split the batch
// (genRunConfig's GtpMode::kSometimes): the results are then the full-batch ones, with parameter
// gradients divided by G under MEAN (tools::verify's scaling); exact cases use MEAN only with G a
// power of two, where the 1/G pre-scale is exact.
// A failure writes the case's unsharded inputs as .npy files and prints the `tpsim run --load`
// command line that replays it (props/harness.h).
#include <algorithm>
#include <cmath>
#include <map>
#include <sstream>

#include "props/backends.h"
#include "props/generators.h"
#include "props/harness.h"
#include "tools/lib/reference.h"

namespace tpsim::props {
namespace {

using tools::Checked;
using tools::HostTensor;

// Default case budgets: about 20 s of the 2-core CI machine together (README.md, "Budget and soak").
constexpr int kExactCases = 10000;
constexpr int kRealCases = 10000;
constexpr int kMlpCases = 5000;
constexpr int kCrossTopologyCases = 5000;

const std::vector<const LayerKind*> kExactKinds = exactKinds();

// "[1, 0, 5]": the multi-index of flat position i in `shape`.
std::string indexOf(const std::vector<std::int64_t>& shape, std::int64_t i) {
  std::vector<std::int64_t> at(shape.size());
  for (std::size_t d = shape.size(); d-- > 0;) {
    at[d] = i % shape[d];
    i /= shape[d];
  }
  std::string s = "[";
  for (std::size_t d = 0; d < at.size(); ++d) s += (d ? ", " : "") + std::to_string(at[d]);
  return s + "]";
}

// "" when `got` equals `want` element for element, else what differs, naming both sides.
std::string difference(const std::string& name, const HostTensor& got, const std::string& gotSide,
                       const HostTensor& want, const std::string& wantSide) {
  std::ostringstream os;
  if (got.shape != want.shape) {
    os << name << ": " << gotSide << " has shape " << shapeText(got.shape) << ", " << wantSide << " " << shapeText(want.shape);
    return os.str();
  }
  std::int64_t first = -1, count = 0;
  for (std::size_t i = 0; i < got.values.size(); ++i)
    if (!(got.values[i] == want.values[i])) {
      if (first < 0) first = std::int64_t(i);
      ++count;
    }
  if (count == 0) return "";
  os.precision(9);
  os << name << " " << shapeText(got.shape) << " " << dtypeName(got.dtype) << ": " << count << " of " << got.values.size()
     << " elements differ; first at " << indexOf(got.shape, first) << ": " << gotSide << " " << got.values[first]
     << ", " << wantSide << " " << want.values[first];
  return os.str();
}

bool isParameterGradient(const std::string& name) {
  return name != "input.grad" && name.size() >= 5 && name.compare(name.size() - 5, 5, ".grad") == 0;
}

// The first result that differs from the dense reference rounded to the result's dtype, or "".
std::string differenceFromReference(const RunConfig& c, const TensorMap& inputs, const TensorMap& results) {
  for (const auto& [name, ref] : tools::referenceFor(c, tools::storedOf(inputs))) {
    auto it = results.find(name);
    if (it == results.end()) return name + ": the sharded run produced no such result";
    const HostTensor want = tools::makeHost(ref.value.shape, it->second.dtype, ref.value.values);
    const std::string d = difference(name, it->second, "sharded", want, "unsharded");
    if (!d.empty()) return d;
  }
  return "";
}

// "" when tools::verify (what `tpsim run` checks) finds every element within its bound; else which
// elements are outside, worst first, from the same reference.
std::string outsideTheBound(const RunConfig& c, const TensorMap& inputs, const TensorMap& results) {
  std::ostringstream os;
  os.precision(4);
  for (const auto& [name, ref] : tools::referenceFor(c, tools::storedOf(inputs))) {
    auto it = results.find(name);
    if (it == results.end()) return name + ": the sharded run produced no such result";
    const HostTensor& got = it->second;
    if (got.shape != ref.value.shape) return name + ": sharded " + shapeText(got.shape) + ", unsharded " + shapeText(ref.value.shape);
    std::int64_t outside = 0, worst = -1;
    double worstRatio = 0;
    for (std::size_t i = 0; i < got.values.size(); ++i) {
      const double err = std::fabs(got.values[i] - ref.value.values[i]), bound = ref.bound[i];
      if (!(err <= bound)) {
        ++outside;
        if (worst < 0 || err / bound > worstRatio) worst = std::int64_t(i), worstRatio = err / bound;
      }
    }
    if (outside != 0)
      os << (os.tellp() > 0 ? "; " : "") << name << " " << shapeText(got.shape) << " " << dtypeName(got.dtype) << ": "
         << outside << " elements outside their bound; worst at " << indexOf(got.shape, worst) << ": sharded "
         << got.values[worst] << ", unsharded " << ref.value.values[worst] << ", |err| "
         << std::fabs(got.values[worst] - ref.value.values[worst]) << " > bound " << ref.bound[worst];
  }
  return os.str();
}

// Every usable backend runs the case; `check` returns what is wrong with its results, or "". It gets
// the case as run there (its backend sets the bound's accumulation unit and the replay line).
void onEveryBackend(const RunConfig& c, Numerics numerics, const TensorMap& inputs,
                    const std::function<std::string(const RunConfig& onBackend, const TensorMap& results)>& check) {
  for (const Backend* b : usableBackends()) {
    const RunConfig onBackend = runConfigOn(c, *b);
    tools::RunResult r;
    try {
      r = b->runLayer(c, inputs);
    } catch (const std::exception& e) {
      failLayerCase(onBackend, numerics, b->name, inputs, std::string("the sharded run threw: ") + e.what());
    }
    const std::string wrong = check(onBackend, r.results);
    if (!wrong.empty()) failLayerCase(onBackend, numerics, b->name, inputs, wrong);
  }
}

}  // namespace

// Exact data: every product and partial sum is an integer the dtypes hold, so sharded == unsharded
// holds bitwise (as values: +0 == -0) for forward, dgrad, wgrad and bias grads of every option.
TPSIM_PROP(LayerLaws, ShardedEqualsUnshardedBitwiseOnExactData, kExactCases) {
  const RunConfig c = *genRunConfig(kExactKinds, genTp(), GtpMode::kSometimes, Numerics::kExact);
  const TensorMap inputs = *genExactInputs(c);
  RC_TAG(c.layer->name(), dtypeName(c.dtype), c.gtpRemat > 1 ? "GTP_remat" : "no GTP_remat");
  onEveryBackend(c, Numerics::kExact, inputs,
                 [&](const RunConfig& on, const TensorMap& results) {
                   return differenceFromReference(on, inputs, results);
                 });
}

// Real data: |sharded − unsharded| <= the bound tools/lib/reference.h derives from |X|·|W|, the
// reduction length and the dtypes, for every element of every result.
TPSIM_PROP(LayerLaws, ShardedEqualsUnshardedWithinTheDataDerivedBound, kRealCases) {
  const RunConfig c = *genRunConfig(kExactKinds, genTp(), GtpMode::kSometimes);
  RC_TAG(c.layer->name(), c.tp > 4 ? "T > 4" : "T <= 4", c.gtpRemat > 1 ? "GTP_remat" : "no GTP_remat");
  const TensorMap inputs = realInputs(c);
  onEveryBackend(c, Numerics::kReal, inputs,
                 [&](const RunConfig& on, const TensorMap& results) {
                   return outsideTheBound(on, inputs, results);
                 });
}

// Column(gather_output=false) -> GeLU -> Row(input_is_parallel) == the dense MLP block, forward and
// every gradient, within the bound (GeLU has no exact mode), with and without sequence parallelism.
TPSIM_PROP(LayerLaws, MlpBlockEqualsTheDenseMlpWithinTheBound, kMlpCases) {
  const RunConfig c = *genRunConfig({layerKind("mlp")}, genTp(), GtpMode::kSometimes);
  RC_TAG(c.gtpRemat > 1 ? "GTP_remat" : "no GTP_remat");
  const TensorMap inputs = realInputs(c);
  onEveryBackend(c, Numerics::kReal, inputs,
                 [&](const RunConfig& on, const TensorMap& results) {
                   return outsideTheBound(on, inputs, results);
                 });
}

// The same exact case gives bitwise the same results at T = k (and G GTP_remat peers) as unsharded
// at T = 1, G = 1 (sequence parallelism off there): the topology changes nothing but the shards, and
// MEAN divides the parameter gradients by G. Under --disable-grad-reduce the k partial input
// gradients add up to the T = 1 one.
TPSIM_PROP(LayerLaws, ExactCaseGivesTheSameBitsAtAnyT, kCrossTopologyCases) {
  const RunConfig c = *genRunConfig(kExactKinds, genTpAbove1(), GtpMode::kSometimes, Numerics::kExact);
  const TensorMap inputs = *genExactInputs(c);
  RC_TAG(c.gtpRemat > 1 ? "GTP_remat" : "no GTP_remat");
  RunConfig single = c;
  single.tp = 1;
  single.sequenceParallel = false;
  single.disableGradReduce = false;
  single.gtpRemat = 1;
  for (const Backend* b : usableBackends()) {
    TensorMap dense, sharded;
    try {
      dense = b->runLayer(single, inputs).results;
      sharded = b->runLayer(c, inputs).results;
    } catch (const std::exception& e) {
      failLayerCase(c, Numerics::kExact, b->name, inputs, std::string("a run threw: ") + e.what());
    }
    if (c.disableGradReduce) {  // (T, s, b, K) -> their sum (s, b, K), exact on exact data
      const HostTensor& partials = sharded.at("input.grad");
      std::vector<HostTensor> perRank;
      for (int t = 0; t < c.tp; ++t) perRank.push_back(tools::chunk(partials, 0, t, c.tp));
      HostTensor total = tools::sum(perRank);
      total.shape.erase(total.shape.begin());
      sharded["input.grad"] = total;
    }
    if (c.gtpRemat > 1 && c.gtpReduceMean)  // exact: G is a power of two here
      for (auto& [name, t] : dense)
        if (isParameterGradient(name))
          for (double& v : t.values) v /= double(c.gtpRemat);
    if (sharded.size() != dense.size())
      failLayerCase(c, Numerics::kExact, b->name, inputs, "T = 1 and T = k produce different sets of results");
    const std::string at = "T = " + std::to_string(c.tp) + (c.gtpRemat > 1 ? ", G = " + std::to_string(c.gtpRemat) : "");
    for (const auto& [name, t] : dense) {
      auto it = sharded.find(name);
      const std::string d = it == sharded.end() ? name + ": missing at " + at
                                                : difference(name, it->second, at, t, "T = 1");
      if (!d.empty()) failLayerCase(c, Numerics::kExact, b->name, inputs, d);
    }
  }
}

}  // namespace tpsim::props
