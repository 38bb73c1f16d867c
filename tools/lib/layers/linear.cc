// --layer column and --layer row: ColumnParallelLinear and RowParallelLinear on (s, b, K) input,
// weight (N, K) cut over TP along N (column) or K (row).
#include <algorithm>
#include <array>
#include <cmath>
#include <initializer_list>

#include "backends/errors.h"
#include "core/checkpoint.h"
#include "sim/gemm_driver.h"
#include "sim/upper_gemm_bf16.h"
#include "tools/lib/layers/kinds.h"
#include "tools/lib/reference.h"

namespace tpsim::tools {
namespace {

ColumnParallelOptions optionsOf(const ColumnParallelLinear*, const RunConfig& c) {
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

RowParallelOptions optionsOf(const RowParallelLinear*, const RunConfig& c) {
  RowParallelOptions o;
  o.bias = c.bias;
  o.inputIsParallel = c.inputIsParallel;
  o.skipBiasAdd = c.skipBiasAdd;
  o.stride = c.stride;
  o.name = "row";
  return o;
}

Parameter* weightOf(ColumnParallelLinear& layer) { return layer.weight(); }
Parameter* weightOf(RowParallelLinear& layer) { return &layer.weight(); }

template <class Linear>
class LinearModules final : public LayerModules {
 public:
  LinearModules(const LayerContext& lc, const ModelParallelConfig& mp, const RunConfig& c)
      : layer_(lc, mp, c.inFeatures, c.outFeatures, uninitialized(), optionsOf(&layer_, c)),
        dtype_(c.dtype),
        seq_(c.seq),
        batch_(c.batch) {}

  std::vector<std::pair<std::string, Parameter*>> parameters() override {
    return present({{"weight", weightOf(layer_)}, {"bias", layer_.bias()}});
  }
  std::vector<TensorPlacement> placements() override {
    return layerPlacements(layer_, seq_, batch_);
  }
  ShardedStateDict stateDict(ProcessGroups& pg) override {
    return shardedStateDict(layer_, "", {}, pg.tp(), &pg.dpCpGtp());
  }
  RankStep step(Compute& compute, const RankInputs& in, const std::function<void()>& forwardDone) override {
    return linearStep(compute, layer_, in.at("input"), in.at("grad_output"), dtype_, forwardDone);
  }

 private:
  Linear layer_;
  DType dtype_;
  std::int64_t seq_, batch_;
};

// What column and row share: the sizes and tensors of one linear layer. TP cuts N (column) or K
// (row) in stride chunks.
template <class Linear>
class LinearKind : public LayerKind {
 public:
  LinearKind(const char* name, bool cutsOutput, std::vector<LayerOption> options, GtpWeightSpec gtpWeight)
      : name_(name), cutsOutput_(cutsOutput), options_(std::move(options)), gtpWeights_{std::move(gtpWeight)} {
    using D = SizeSpec::Divisor;
    sizes_ = {{"s", "seq", &RunConfig::seq, "the sequence length s", "input", 0, D::kSequenceSplit},
              {"b", "batch", &RunConfig::batch, "the batch b", "input", 1, D::kGtpRemat},
              {"K", "in-features", &RunConfig::inFeatures, "K", "weight", 1, cutsOutput ? D::kNone : D::kTpStride},
              {"N", "out-features", &RunConfig::outFeatures, "N", "weight", 0, cutsOutput ? D::kTpStride : D::kNone}};
  }

  const char* name() const override { return name_; }
  bool takes(LayerOption o) const override { return std::count(options_.begin(), options_.end(), o) > 0; }
  const std::vector<SizeSpec>& sizes() const override { return sizes_; }
  std::vector<TensorSpec> tensors(const RunConfig& c) const override {
    std::vector<TensorSpec> t = {{"input", TensorRole::kInput, {"s", "b", "K"}, 1.0},
                                 {"weight", TensorRole::kParameter, {"N", "K"}, 1.0 / std::sqrt(double(c.inFeatures))}};
    if (c.bias) t.push_back({"bias", TensorRole::kParameter, {"N"}, 0.1});
    t.push_back({"grad_output", TensorRole::kGradient, {"s", "b", "N"}, 1.0});
    return t;
  }
  const std::vector<GtpWeightSpec>& gtpWeights() const override { return gtpWeights_; }
  // Each rank's shard and gradient as backend tensors and the gradient as the run keeps it (12), and
  // the shards the threads cut at once, 4.5 bytes an element of a rank's share on each: the whole
  // weight at T = 1, and at T = 2 on two threads (a column of 4096 x 8192 peaked at 650 MiB at both,
  // 586 at T = 2 on one thread); at least the 2 fitted on the table's runs of more ranks. Under
  // GTP_remat the peak is the weight gradients' reduce-scatter, long after the cutting: 2.
  double runBytesPerParameter(const RunConfig& c, double threads) const override {
    return 12 + (c.gtpRemat > 1 ? 2.0 : std::max(2.0, 4.5 * threads / double(c.tp)));
  }
  // The reference takes W a block of rows at a time (linearReference), then the products over the
  // whole |W| in float; MXFP8 weights first make their two copies in the run's dtype, the second
  // while the first is held.
  double referenceBytesPerParameter(const RunConfig& c) const override {
    return c.weightFormat == WeightFormat::kNative ? 0 : kMxfp8ReferenceBytes + double(dtypeSize(c.dtype));
  }
  // The larger of a block's rows of W (and of its dgrad copy under MXFP8) and of dW and its bound in
  // double, W's rows packed for the products, and the bound's float product; and |W| in float (half
  // a double an element) with the packed operands the verifying thread keeps by then: the blocks'
  // products' in double and the bounds' products' over the whole |W| (a row of
  // 2048 x 16384 at T = 4 on 512 tokens held 126 MB of them beside |W|, above the 42 bytes an
  // activation element fitted on smaller runs). Under MXFP8 the making of the copies is over before
  // the blocks start, which go with the two copies (2d bytes an element, d the dtype's): the larger
  // of the two counts. A part of the reference holds its share of the weight's rows (a column's) or
  // columns (a row's).
  double referenceIntermediates(const RunConfig& c, const ShapeMap& shapes, double part) const override {
    const auto w = shapes.find("weight"), x = shapes.find("input");
    if (w == shapes.end() || w->second.size() != 2 || x == shapes.end() || x->second.empty()) return 0;
    std::int64_t n = w->second[0], k = w->second[1];
    (cutsOutput_ ? n : k) = std::int64_t(std::ceil(part * double(cutsOutput_ ? n : k)));
    std::int64_t tokens = x->second.back() == 0 ? 0 : 1;
    for (std::size_t d = 0; d + 1 < x->second.size(); ++d) tokens *= x->second[d];
    const std::int64_t rows = blockRows(ReferenceOptions(), n, k), block = rows * k;
    // The larger of each operand's packed copies over the products that leave them (linearLayer's).
    auto packed = [](std::int64_t elementBytes, std::int64_t perStep,
                     std::initializer_list<std::array<std::int64_t, 3>> products) {
      std::int64_t a = 0, b = 0;
      for (const auto& [m, cols, depth] : products) {
        const sim::gemm_driver::PackedBytes p = sim::gemm_driver::packedOperandBytes(m, cols, depth, elementBytes,
                                                                                     perStep);
        a = std::max(a, p.a), b = std::max(b, p.b);
      }
      return double(a + b);
    };
    const double blocksPacked = packed(8, 1, {{tokens, rows, k}, {tokens, k, rows}, {rows, k, tokens}});
    // bf16 pairs, or floats where the cores lack AVX512-BF16
    const double boundsPacked =
        packed(4, sim::upperGemmBf16Runs() ? 2 : 1, {{rows, k, tokens}, {tokens, n, k}, {tokens, k, n}});
    const double wholeW = 0.5 * double(n * k) + (blocksPacked + boundsPacked) / 8;
    if (c.weightFormat == WeightFormat::kNative) return std::max(wholeW, 4.5 * double(block));
    const double making = kMxfp8ReferenceBytes + double(dtypeSize(c.dtype)), held = 2 * double(dtypeSize(c.dtype));
    return std::max(0.0, std::max(wholeW, 5.5 * double(block)) - (making - held) / 8 * double(n * k));
  }
  std::int64_t longestSum(const RunConfig& c) const override {
    return std::max({c.inFeatures + 1, c.outFeatures, c.seq * c.batch});
  }
  std::unique_ptr<LayerModules> build(const LayerContext& lc, const ModelParallelConfig& mp,
                                      const RunConfig& c) const override {
    return std::make_unique<LinearModules<Linear>>(lc, mp, c);
  }
  // N's rows of the weight and bias (column) or K's columns of the weight (row) that the parts' TP
  // ranks hold, one block each (stride 1), without GTP_remat, MXFP8 weights or disable_grad_reduce;
  // where the results of those rows are split among the ranks: the column's output not gathered,
  // the row's input.grad where its input comes parallel.
  std::vector<std::string> partResults(const RunConfig& c) const override {
    if (c.gtpRemat > 1 || c.weightFormat != WeightFormat::kNative || c.stride > 1 || c.disableGradReduce) return {};
    if (cutsOutput_ ? c.gatherOutput : !c.inputIsParallel) return {};
    std::vector<std::string> results = {cutsOutput_ ? "output" : "input.grad", "weight.grad"};
    if (cutsOutput_ && c.bias) results.push_back("bias.grad");
    return results;
  }
  void reference(const ReferenceOptions& o, const InputMap& in, ReferenceSink& sink) const override {
    linearReference(o, in, sink);
  }
  // Column: the input whole unless sequence-parallel, the output split unless gathered. Row: the
  // input split only when it comes parallel, the output whole unless sequence-parallel.
  RankShare rankShare(const RunConfig& c) const override {
    const double split = 1.0 / double(c.tp);
    if (cutsOutput_) return {c.sequenceParallel ? split : 1.0, c.gatherOutput ? 1.0 : split};
    return {c.inputIsParallel ? split : 1.0, c.sequenceParallel ? split : 1.0};
  }

 private:
  const char* name_;
  bool cutsOutput_;
  std::vector<LayerOption> options_;
  std::vector<SizeSpec> sizes_;
  std::vector<GtpWeightSpec> gtpWeights_;
};

using O = LayerOption;

class RowKind final : public LinearKind<RowParallelLinear> {
 public:
  RowKind()
      : LinearKind("row", false,
                   {O::kSequenceParallel, O::kBias, O::kStride, O::kInputIsParallel, O::kSkipBiasAdd,
                    O::kGradAccumulationFusion, O::kMxfp8Weights},
                   {"weight", "N", false}) {}
  void validate(const RunConfig& c) const override {
    TPSIM_CHECK(!(c.sequenceParallel && !c.inputIsParallel),
                "--sequence-parallel: RowParallelLinear needs --input-is-parallel with it");
    TPSIM_CHECK(!(c.stride > 1 && !c.inputIsParallel && c.tp > 1),
                "--stride: RowParallelLinear with stride > 1 needs --input-is-parallel (its input scatter is "
                "contiguous, its weight columns interleaved)");
  }
};

}  // namespace

const LayerKind& columnLayerKind() {
  static const LinearKind<ColumnParallelLinear> kind(
      "column", true,
      {O::kSequenceParallel, O::kBias, O::kStride, O::kOutputDtype, O::kGatherOutput, O::kDisableGradReduce,
       O::kSkipBiasAdd, O::kGradAccumulationFusion, O::kMxfp8Weights},
      {"weight", "N", true});
  return kind;
}

const LayerKind& rowLayerKind() {
  static const RowKind kind;
  return kind;
}

}  // namespace tpsim::tools
