// --layer column: ColumnParallelLinear on (s, b, K) input, weight (N, K) cut along N.
#include "tools/lib/layers/kinds.h"

#include <algorithm>
#include <cmath>

#include "core/checkpoint.h"
#include "tools/lib/reference.h"

namespace tpsim::tools {
namespace {

class ColumnModules final : public LayerModules {
 public:
  ColumnModules(const LayerContext& lc, const ModelParallelConfig& mp, const RunConfig& c)
      : layer_(lc, mp, c.inFeatures, c.outFeatures, uninitialized(), options(c)), dtype_(c.dtype) {}

  std::vector<std::pair<std::string, Parameter*>> parameters() override {
    return present({{"weight", layer_.weight()}, {"bias", layer_.bias()}});
  }
  std::vector<TensorPlacement> placements(std::int64_t seq, std::int64_t batch) override {
    return layerPlacements(layer_, seq, batch);
  }
  ShardedStateDict stateDict(Collectives& tp, Collectives* dpCp) override {
    return shardedStateDict(layer_, "", {}, tp, dpCp);
  }
  RankStep step(Compute& compute, ConstView x, ConstView dy) override {
    return linearStep(compute, layer_, x, dy, dtype_);
  }

 private:
  static ColumnParallelOptions options(const RunConfig& c) {
    ColumnParallelOptions o;
    o.bias = c.bias;
    o.gatherOutput = c.gatherOutput;
    o.stride = c.stride;
    o.skipBiasAdd = c.skipBiasAdd;
    o.outputDtype = c.outputDtype;
    o.disableGradReduce = c.disableGradReduce;
    o.name = "column";
    return o;
  }

  ColumnParallelLinear layer_;
  DType dtype_;
};

class ColumnKind final : public LayerKind {
 public:
  const char* name() const override { return "column"; }
  bool takes(LayerOption o) const override {
    switch (o) {
      case LayerOption::kSequenceParallel:
      case LayerOption::kBias:
      case LayerOption::kStride:
      case LayerOption::kOutputDtype:
      case LayerOption::kGatherOutput:
      case LayerOption::kDisableGradReduce:
      case LayerOption::kSkipBiasAdd:
      case LayerOption::kGradAccumulationFusion:
      case LayerOption::kMxfp8Weights: return true;
      default: return false;
    }
  }
  const std::vector<SizeSpec>& sizes() const override {
    using D = SizeSpec::Divisor;
    static const std::vector<SizeSpec> sizes = {
        {"s", "seq", &RunConfig::seq, "the sequence length s", "input", 0, D::kSequenceSplit},
        {"b", "batch", &RunConfig::batch, "the batch b", "input", 1, D::kGtpRemat},
        {"K", "in-features", &RunConfig::inFeatures, "K", "weight", 1, D::kNone},
        {"N", "out-features", &RunConfig::outFeatures, "N", "weight", 0, D::kTpStride}};
    return sizes;
  }
  std::vector<TensorSpec> tensors(const RunConfig& c) const override {
    std::vector<TensorSpec> t = {{"input", TensorRole::kInput, {"s", "b", "K"}, 1.0},
                                 {"weight", TensorRole::kParameter, {"N", "K"}, 1.0 / std::sqrt(double(c.inFeatures))}};
    if (c.bias) t.push_back({"bias", TensorRole::kParameter, {"N"}, 0.1});
    t.push_back({"grad_output", TensorRole::kGradient, {"s", "b", "N"}, 1.0});
    return t;
  }
  const std::vector<GtpWeightSpec>& gtpWeights() const override {
    static const std::vector<GtpWeightSpec> w = {{"weight", "N", true, "the TP-local rows N / --tp", "--out-features / --tp"}};
    return w;
  }
  std::int64_t longestSum(const RunConfig& c) const override {
    return std::max({c.inFeatures + 1, c.outFeatures, c.seq * c.batch});
  }
  std::unique_ptr<LayerModules> build(const LayerContext& lc, const ModelParallelConfig& mp,
                                      const RunConfig& c) const override {
    return std::make_unique<ColumnModules>(lc, mp, c);
  }
  std::map<std::string, Checked> reference(const ReferenceOptions& o, const TensorMap& in) const override {
    return linearReference(o, in);
  }
};

}  // namespace

const LayerKind& columnLayerKind() {
  static const ColumnKind kind;
  return kind;
}

}  // namespace tpsim::tools
