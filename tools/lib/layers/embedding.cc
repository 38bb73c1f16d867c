// --layer embedding: VocabParallelEmbedding on int64 ids (b, s), weight (V, h) cut along V.
#include <algorithm>
#include <cmath>

#include "core/checkpoint.h"
#include "core/embedding.h"
#include "tools/lib/layers/kinds.h"
#include "tools/lib/reference.h"

namespace tpsim::tools {
namespace {

class EmbeddingModules final : public LayerModules {
 public:
  EmbeddingModules(const LayerContext& lc, const ModelParallelConfig& mp, const RunConfig& c)
      : layer_(lc, withoutSequenceParallel(mp), c.vocab, c.outFeatures, uninitialized(), options(c)),
        seq_(c.seq),
        batch_(c.batch) {}

  std::vector<std::pair<std::string, Parameter*>> parameters() override { return {{"weight", &layer_.weight()}}; }
  std::vector<TensorPlacement> placements() override {
    return layerPlacements(layer_, seq_, batch_);
  }
  ShardedStateDict stateDict(ProcessGroups& pg) override {
    return shardedStateDict(layer_, "", {}, pg.tp(), &pg.dpCpGtp());
  }
  RankStep step(Compute&, const RankInputs& in, const std::function<void()>& forwardDone) override {
    Tensor y = layer_.forward(in.at("input"));  // token ids
    forwardDone();
    layer_.backward(in.at("grad_output"));
    return {std::move(y), Tensor()};  // token ids have no gradient
  }

 private:
  // The embedding's sequence parallelism is reduce_scatter_embeddings.
  static ModelParallelConfig withoutSequenceParallel(ModelParallelConfig mp) {
    mp.sequenceParallel = false;
    return mp;
  }
  static VocabParallelEmbeddingOptions options(const RunConfig& c) {
    VocabParallelEmbeddingOptions o;
    o.reduceScatterEmbeddings = c.reduceScatterEmbeddings;
    return o;
  }

  VocabParallelEmbedding layer_;
  std::int64_t seq_, batch_;
};

class EmbeddingKind final : public LayerKind {
 public:
  const char* name() const override { return "embedding"; }
  bool takes(LayerOption o) const override { return o == LayerOption::kReduceScatterEmbeddings; }
  std::string whyNot(LayerOption o) const override {
    if (o == LayerOption::kGradAccumulationFusion) return "the embedding has no fused wgrad path";
    if (o == LayerOption::kMxfp8Weights) return "the embedding is a lookup, not a GEMM";
    if (o == LayerOption::kSequenceParallel) return "the embedding's sequence parallelism is --reduce-scatter-embeddings";
    return "";
  }
  // --sequence-parallel means what Megatron's language model does with it: the output
  // reduce-scattered along the sequence.
  void applyConventions(RunConfig& c) const override {
    if (!c.sequenceParallel) return;
    c.sequenceParallel = false;
    c.reduceScatterEmbeddings = true;
  }
  const std::vector<SizeSpec>& sizes() const override {
    using D = SizeSpec::Divisor;
    static const std::vector<SizeSpec> sizes = {
        {"s", "seq", &RunConfig::seq, "the sequence length s", "input", 1, D::kSequenceSplit},
        {"b", "batch", &RunConfig::batch, "the batch b", "input", 0, D::kGtpRemat},
        {"h", "out-features", &RunConfig::outFeatures, "h", "weight", 1, D::kNone},
        {"V", "vocab", &RunConfig::vocab, "the vocabulary size V", "weight", 0, D::kTp}};
    return sizes;
  }
  std::vector<TensorSpec> tensors(const RunConfig& c) const override {
    // Batch-first output, or (s, b, h) through the sequence-parallel reduce-scatter.
    const std::vector<std::string> out = c.reduceScatterEmbeddings ? std::vector<std::string>{"s", "b", "h"}
                                                                   : std::vector<std::string>{"b", "s", "h"};
    return {{"input", TensorRole::kInput, {"b", "s"}, 0.0, "V"},
            {"weight", TensorRole::kParameter, {"V", "h"}, 1.0},
            {"grad_output", TensorRole::kGradient, out, 1.0}};
  }
  const std::vector<GtpWeightSpec>& gtpWeights() const override {
    static const std::vector<GtpWeightSpec> w = {{"weight", "V", true}};
    return w;
  }
  // The table's gradient has no main_grad: it is reduce-scattered in the table's dtype.
  DType gtpWireDtype(const RunConfig& c) const override { return c.dtype; }
  // A repeated id sums up to b·s gradient rows.
  std::int64_t longestSum(const RunConfig& c) const override { return c.seq * c.batch; }
  // Every rank holds the token ids, and the output whole unless reduce-scattered; it makes the
  // output whole either way, its partial lookup.
  RankShare rankShare(const RunConfig& c) const override {
    return {1.0, c.reduceScatterEmbeddings ? 1.0 / double(c.tp) : 1.0, 1.0};
  }
  // 4 elements of the dtype an element of a rank's grad_output and output where TP is on, 3.5 at
  // T = 1 (measured at T = 1-8 on outputs of 8-17M elements, fp32 and bf16).
  double runBytesPerActivation(const RunConfig& c) const override {
    return (c.tp > 1 ? 4 : 3.5) * double(dtypeSize(c.dtype));
  }
  // The shard and the gradient as the run keeps it, in the table's dtype (the backend gradient, a
  // scatter-add into zeros, touches only the rows looked up), and on each thread a shard being cut
  // and its backend copy, 8 bytes an element of a rank's share; under GTP_remat, beside the term
  // measured on the linear kinds, G more elements of the dtype (the gradient, its reduce-scatter's
  // padded send buffer, written whole, and the peers' gathered tables). Measured at T = 1-8, G = 1,
  // 2 and 4, one thread and two, on tables of 16-66M elements, fp32 and bf16.
  double runBytesPerParameter(const RunConfig& c, double threads) const override {
    const double elements = 2 + (c.gtpRemat > 1 ? c.gtpRemat : 0);
    return double(dtypeSize(c.dtype)) * elements + 8 * threads / double(c.tp * c.gtpRemat);
  }
  // A lookup: no products, in the run or in the reference.
  bool packsOperands() const override { return false; }
  // The table's gradient is a scatter-add, not a product: the reference reads the table in place
  // and holds a block of the gradient's rows and their bounds in double (embeddingReference).
  double referenceBytesPerParameter(const RunConfig&) const override { return 0; }
  // A part of the reference holds its share of the table's rows.
  double referenceIntermediates(const RunConfig&, const ShapeMap& shapes, double part) const override {
    const auto w = shapes.find("weight");
    if (w == shapes.end() || w->second.size() != 2) return 0;
    const std::int64_t v = std::int64_t(std::ceil(part * double(w->second[0]))), h = w->second[1];
    return 2 * double(blockRows(ReferenceOptions(), v, h) * h);
  }
  // The vocabulary's rows that the parts' TP ranks hold, without GTP_remat: each process checks its
  // rows of the table's gradient where they are; the lookups add up at process 0.
  std::vector<std::string> partResults(const RunConfig& c) const override {
    if (c.gtpRemat > 1) return {};
    return {"weight.grad"};
  }
  std::unique_ptr<LayerModules> build(const LayerContext& lc, const ModelParallelConfig& mp,
                                      const RunConfig& c) const override {
    return std::make_unique<EmbeddingModules>(lc, mp, c);
  }
  void reference(const ReferenceOptions& o, const InputMap& in, ReferenceSink& sink) const override {
    embeddingReference(o, in, sink);
  }
};

}  // namespace

const LayerKind& embeddingLayerKind() {
  static const EmbeddingKind kind;
  return kind;
}

}  // namespace tpsim::tools
