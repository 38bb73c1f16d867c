// --layer mlp: the MLP block y = GeLU(x·W1ᵀ + b1)·W2ᵀ + b2, fc1 a ColumnParallelLinear (h -> F),
// fc2 a RowParallelLinear (F -> h) with input_is_parallel, both with biases, exact erf GeLU.
#include <algorithm>
#include <cmath>

#include "core/checkpoint.h"
#include "tools/lib/layers/kinds.h"
#include "tools/lib/reference.h"

namespace tpsim::tools {
namespace {

class MlpModules final : public LayerModules {
 public:
  MlpModules(const LayerContext& lc, const ModelParallelConfig& mp, const RunConfig& c)
      : fc1_(lc, mp, c.inFeatures, c.ffnHidden, uninitialized(), fc1Options()),
        fc2_(lc, mp, c.ffnHidden, c.inFeatures, uninitialized(), fc2Options()),
        seq_(c.seq),
        batch_(c.batch) {}

  std::vector<std::pair<std::string, Parameter*>> parameters() override {
    return present({{"fc1.weight", fc1_.weight()}, {"fc1.bias", fc1_.bias()}, {"fc2.weight", &fc2_.weight()},
                    {"fc2.bias", fc2_.bias()}});
  }
  std::vector<TensorPlacement> placements() override {
    std::vector<TensorPlacement> out = layerPlacements(fc1_, seq_, batch_, "fc1.");
    for (TensorPlacement& p : layerPlacements(fc2_, seq_, batch_, "fc2.")) out.push_back(std::move(p));
    return out;
  }
  ShardedStateDict stateDict(ProcessGroups& pg) override {
    ShardedStateDict out = shardedStateDict(fc1_, "fc1.", {}, pg.tp(), &pg.dpCpGtp());
    for (ShardedEntry& e : shardedStateDict(fc2_, "fc2.", {}, pg.tp(), &pg.dpCpGtp())) out.push_back(std::move(e));
    return out;
  }
  RankStep step(Compute& compute, const RankInputs& in, const std::function<void()>& forwardDone) override {
    const ConstView x = in.at("input"), dy = in.at("grad_output");
    Tensor h = fc1_.forward(x).output;  // (s, b, F/T)
    Tensor a = compute.empty(h.shape(), h.dtype());
    compute.gelu(h, a);
    Tensor y = fc2_.forward(a).output;  // (s, b, h), or (s/T, b, h) under SP
    forwardDone();
    Tensor dA = fc2_.backward(dy);
    Tensor dH = compute.empty(h.shape(), h.dtype());
    compute.geluBackward(h, dA, dH);
    return {std::move(y), fc1_.backward(dH)};
  }

 private:
  static ColumnParallelOptions fc1Options() {
    ColumnParallelOptions o;
    o.name = "fc1";
    return o;
  }
  static RowParallelOptions fc2Options() {
    RowParallelOptions o;
    o.inputIsParallel = true;
    o.name = "fc2";
    return o;
  }

  ColumnParallelLinear fc1_;
  RowParallelLinear fc2_;
  std::int64_t seq_, batch_;
};

// tokens x F: the elements of each (tokens, F) intermediate, from the shapes of input and fc1.weight.
double hiddenElements(const ShapeMap& shapes, double& tokens) {
  auto in = shapes.find("input"), fc1 = shapes.find("fc1.weight");
  if (in == shapes.end() || fc1 == shapes.end() || in->second.empty() || in->second.back() <= 0 || fc1->second.empty())
    return 0;
  double x = 1;
  for (std::int64_t d : in->second) x *= double(d);
  tokens = x / double(in->second.back());
  return tokens * double(fc1->second[0]);
}

class MlpKind final : public LayerKind {
 public:
  const char* name() const override { return "mlp"; }
  bool takes(LayerOption o) const override {
    return o == LayerOption::kSequenceParallel || o == LayerOption::kGradAccumulationFusion ||
           o == LayerOption::kMxfp8Weights;
  }
  const std::vector<SizeSpec>& sizes() const override {
    using D = SizeSpec::Divisor;
    static const std::vector<SizeSpec> sizes = {
        {"s", "seq", &RunConfig::seq, "the sequence length s", "input", 0, D::kSequenceSplit},
        {"b", "batch", &RunConfig::batch, "the batch b", "input", 1, D::kGtpRemat},
        {"h", "in-features", &RunConfig::inFeatures, "the hidden size h", "fc1.weight", 1, D::kNone},
        {"F", "ffn-hidden", &RunConfig::ffnHidden, "the ffn hidden size F", "fc1.weight", 0, D::kTp}};
    return sizes;
  }
  std::vector<TensorSpec> tensors(const RunConfig& c) const override {
    return {{"input", TensorRole::kInput, {"s", "b", "h"}, 1.0},
            {"fc1.weight", TensorRole::kParameter, {"F", "h"}, 1.0 / std::sqrt(double(c.inFeatures))},
            {"fc1.bias", TensorRole::kParameter, {"F"}, 0.1},
            {"fc2.weight", TensorRole::kParameter, {"h", "F"}, 1.0 / std::sqrt(double(c.ffnHidden))},
            {"fc2.bias", TensorRole::kParameter, {"h"}, 0.1},
            {"grad_output", TensorRole::kGradient, {"s", "b", "h"}, 1.0}};
  }
  const std::vector<GtpWeightSpec>& gtpWeights() const override {
    static const std::vector<GtpWeightSpec> w = {
        {"fc1.weight", "F", true}, {"fc2.weight", "h", false}};
    return w;
  }
  bool exactOnSmallIntegers() const override { return false; }  // GeLU
  std::string inputPlacement() const override { return "fc1.input"; }
  std::string outputPlacement() const override { return "fc2.output"; }
  std::int64_t longestSum(const RunConfig& c) const override {
    return std::max({c.inFeatures + 1, c.ffnHidden + 1, c.seq * c.batch});
  }
  // H, GeLU(H), dA and dH in the run's dtype (counted as two doubles' worth of (tokens, F)).
  double stepIntermediates(const RunConfig&, const ShapeMap& shapes) const override {
    double tokens = 0;
    return 2 * hiddenElements(shapes, tokens);
  }
  // The block's input and output: whole on every rank, split along the sequence when sequence-parallel.
  RankShare rankShare(const RunConfig& c) const override {
    const double share = c.sequenceParallel ? 1.0 / double(c.tp) : 1.0;
    return {share, share};
  }
  // The reference holds its (tokens, F) matrices for a block of F at a time, and the block's rows of
  // W1 and dW1 and columns of W2 and dW2 in double, the gradients' bounds, |W1| and |W2| in float
  // (mlpReference); under MXFP8 the blocks of the dgrads' copies and their magnitudes as well. A
  // weight's block is also packed for the products, in double and in float (at most 32 MiB each),
  // and its gradient's bound is made in a float product first (measured where the weights are the
  // run: a few tokens, so that a block is all of F).
  // A part's blocks are at most its rows of F.
  double referenceIntermediates(const RunConfig& c, const ShapeMap& shapes, double part) const override {
    double tokens = 0;
    const double h = hiddenElements(shapes, tokens);
    const double f = tokens > 0 ? h / tokens : 0;
    const double rows = double(blockRows(ReferenceOptions(), std::int64_t(f), std::int64_t(tokens)));
    const double block = tokens * std::min(std::ceil(part * f), rows);
    const auto in = shapes.find("input");
    const double features = in == shapes.end() || in->second.empty() ? 0 : double(in->second.back());
    const double weightBlock = features * (tokens > 0 ? block / tokens : 0);
    const double perWeightElement = c.weightFormat == WeightFormat::kNative ? 7.5 : 10.5;
    const double packed = std::min(weightBlock, double(1 << 22)) + std::min(weightBlock / 2, double(1 << 22));
    return 11 * block + perWeightElement * weightBlock + packed;
  }
  // Nothing whole but, under MXFP8, the weights' quantized copies, made one weight at a time (each
  // half the parameters): fc1's two copies are held while fc2's are made.
  double referenceBytesPerParameter(const RunConfig& c) const override {
    const double d = double(dtypeSize(c.dtype));
    return c.weightFormat == WeightFormat::kNative ? 0 : (kMxfp8ReferenceBytes + d) / 2 + d;
  }
  std::unique_ptr<LayerModules> build(const LayerContext& lc, const ModelParallelConfig& mp,
                                      const RunConfig& c) const override {
    return std::make_unique<MlpModules>(lc, mp, c);
  }
  // F's: the rows of W1 and b1 and the columns of W2 that the parts' TP ranks hold, without GTP_remat
  // (which cuts a rank's rows among its peers) or MXFP8 (quantized per TP rank, before the blocks).
  std::vector<std::string> partResults(const RunConfig& c) const override {
    if (c.gtpRemat > 1 || c.weightFormat != WeightFormat::kNative) return {};
    return {"fc1.bias.grad", "fc1.weight.grad", "fc2.weight.grad"};
  }
  void reference(const ReferenceOptions& o, const InputMap& in, ReferenceSink& sink) const override {
    mlpReference(o, in, sink);
  }
};

}  // namespace

const LayerKind& mlpLayerKind() {
  static const MlpKind kind;
  return kind;
}

}  // namespace tpsim::tools
