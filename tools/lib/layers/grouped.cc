// --layer grouped-column and --layer grouped-row: the routed experts' grouped linear
// (GroupedParallelLinear, Transformer Engine's GroupedLinear as TEColumnParallelGroupedLinear and
// TERowParallelGroupedLinear use it): E expert weights weight<i> (N, K), cut over the expert TP group
// along N (column) or K (row), and M tokens (M, K), token m going to expert expert_ids[m].
//
// The layer wants its tokens sorted by expert; each rank sorts its own (stable, so a token keeps its
// place among its expert's), runs the grouped GEMMs and puts the results back in token order: the
// token dispatcher's permute and unpermute. The partial sums over TP that the layer leaves to its
// dispatcher (the row output, the column input gradient) the run completes. Under GTP_remat the
// peers split the tokens and the E weights are one EGTP_remat batch.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>

#include "backends/errors.h"
#include "core/checkpoint.h"
#include "core/grouped_linear.h"
#include "tools/lib/layers/kinds.h"
#include "tools/lib/reference.h"

namespace tpsim::tools {
namespace {

class GroupedModules final : public LayerModules {
 public:
  GroupedModules(const LayerContext& lc, const ModelParallelConfig& mp, const RunConfig& c, GroupedParallelMode mode)
      : layer_(lc, withExpertGtp(mp), c.inFeatures, c.outFeatures, uninitialized(), options(c, mode)),
        tokens_(c.tokens) {}

  std::vector<std::pair<std::string, Parameter*>> parameters() override {
    std::vector<std::pair<std::string, Parameter*>> out;
    for (int i = 0; i < layer_.numGemms(); ++i) out.push_back({detail::concat("weight", i), &layer_.weight(i)});
    for (int i = 0; i < layer_.numGemms(); ++i) out.push_back({detail::concat("bias", i), layer_.bias(i)});
    return present(std::move(out));
  }
  // The layer's own placements, and the token ids, which the dispatcher holds as the tokens.
  std::vector<TensorPlacement> placements() override {
    std::vector<TensorPlacement> out = layerPlacements(layer_, tokens_);
    TensorPlacement ids = placementNamed(out, "input");
    ids.name = "expert_ids";
    ids.shape.resize(1);
    ids.tp = {AxisKind::kReplicate, ids.tp.size};
    out.insert(out.begin() + 1, ids);
    return out;
  }
  ShardedStateDict stateDict(ProcessGroups& pg) override {
    return shardedStateDict(layer_, "", {}, pg.expertTp(), pg.ep(), &pg.expertDp());
  }
  RankStep step(Compute& compute, const RankInputs& in, const std::function<void()>& forwardDone) override {
    const ConstView x = in.at("input"), dy = in.at("grad_output");
    // The tokens sorted by expert: row i of the sorted tokens is token order[i].
    const std::vector<double> ids = idsOf(compute, in.at("expert_ids"));
    std::vector<std::int64_t> order(ids.size()), splits(std::size_t(layer_.numGemms()), 0);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) { return ids[a] < ids[b]; });
    std::vector<std::int64_t> back(order.size());
    for (std::size_t i = 0; i < order.size(); ++i) {
      back[std::size_t(order[i])] = std::int64_t(i);
      ++splits[std::size_t(ids[i])];
    }
    const Tensor sort = indexTensor(compute, order), unsort = indexTensor(compute, back);
    const Tensor xs = rowsBy(compute, x, sort);
    Tensor ys = layer_.forward(xs, splits);
    Tensor y = rowsBy(compute, ys, unsort);
    forwardDone();
    const Tensor dys = rowsBy(compute, dy, sort);
    Tensor dxs = layer_.backward(dys);
    return {std::move(y), rowsBy(compute, dxs, unsort)};
  }

 private:
  static ModelParallelConfig withExpertGtp(ModelParallelConfig mp) {  // the experts' GTP_remat is EGTP_remat
    mp.expertGtpRematSize = mp.gtpRematSize;
    return mp;
  }
  static GroupedLinearOptions options(const RunConfig& c, GroupedParallelMode mode) {
    GroupedLinearOptions o;
    o.numGemms = int(c.experts);
    o.parallelMode = mode;
    o.bias = c.bias;
    o.name = "experts";
    return o;
  }
  static std::vector<double> idsOf(Compute& compute, ConstView ids) {
    const HostTensor host = fromBackend(compute, ids);
    return host.values;
  }
  static Tensor indexTensor(Compute& compute, const std::vector<std::int64_t>& index) {
    return toBackend(compute, makeHost({std::int64_t(index.size())}, DType::kInt64,
                                       std::vector<double>(index.begin(), index.end())));
  }
  // out[i] = rows[index[i]]: the gather a dispatcher's permutation is.
  static Tensor rowsBy(Compute& compute, ConstView rows, const Tensor& index) {
    Tensor out = compute.empty({index.shape()[0], rows.dim(1)}, rows.dtype());
    compute.gatherRows(rows, index, 0, out);
    return out;
  }

  GroupedParallelLinear layer_;
  std::int64_t tokens_;
};

using O = LayerOption;
constexpr std::int64_t kMaxExperts = 4096;

class GroupedKind final : public LayerKind {
 public:
  GroupedKind(const char* name, GroupedParallelMode mode) : name_(name), mode_(mode) {
    using D = SizeSpec::Divisor;
    const bool column = mode == GroupedParallelMode::kColumn;
    sizes_ = {{"M", "tokens", &RunConfig::tokens, "the tokens M", "input", 0, D::kGtpRemat},
              {"K", "in-features", &RunConfig::inFeatures, "K", "weight0", 1, column ? D::kNone : D::kTp},
              {"N", "out-features", &RunConfig::outFeatures, "N", "weight0", 0, column ? D::kTp : D::kNone},
              {"E", "experts", &RunConfig::experts, "the experts E", "", 0, D::kNone}};
    gtpWeights_ = {GtpWeightSpec{"weight<i>", "N", column}};
  }

  const char* name() const override { return name_; }
  bool takes(LayerOption o) const override { return o == O::kBias || o == O::kGradAccumulationFusion; }
  // Each expert is a file, a weight and a GEMM of its own.
  void validate(const RunConfig& c) const override {
    TPSIM_CHECK(c.experts <= kMaxExperts, "--experts: expected 1..", kMaxExperts, " (one weight file and one GEMM "
                "per expert), got ", c.experts);
  }
  const std::vector<SizeSpec>& sizes() const override { return sizes_; }
  std::vector<TensorSpec> tensors(const RunConfig& c) const override {
    std::vector<TensorSpec> t = {{"input", TensorRole::kInput, {"M", "K"}, 1.0},
                                 {"expert_ids", TensorRole::kInput, {"M"}, 0.0, "E"}};
    for (std::int64_t i = 0; i < c.experts; ++i)
      t.push_back({detail::concat("weight", i), TensorRole::kParameter, {"N", "K"}, 1.0 / std::sqrt(double(c.inFeatures))});
    if (c.bias)
      for (std::int64_t i = 0; i < c.experts; ++i) t.push_back({detail::concat("bias", i), TensorRole::kParameter, {"N"}, 0.1});
    t.push_back({"grad_output", TensorRole::kGradient, {"M", "N"}, 1.0});
    return t;
  }
  const std::vector<GtpWeightSpec>& gtpWeights() const override { return gtpWeights_; }
  // Column: the tokens whole, the output split along N. Row: the tokens split along K, the output
  // each rank's partial sum, whole.
  RankShare rankShare(const RunConfig& c) const override {
    const double split = 1.0 / double(c.tp);
    return column() ? RankShare{1.0, split} : RankShare{split, 1.0};
  }
  // Fitted in fp32 on 256 runs of E = 1-8 experts at T = 1-8, activations or weights nearly all of
  // the run (docs/memory.md), and counted in the run's dtype, d bytes an element, as its tensors are
  // (a parameter's working set under GTP_remat in the wire dtype: parameterBytes). Without GTP_remat
  // the ranks never wait on each other, so a thread runs one from start to end: each rank keeps d
  // bytes an element of its share of the input and grad_output (its results) and d a parameter,
  // and while it runs holds its working set besides: the tokens sorted by expert and back (each
  // mode's own bytes an element of its share of the input and grad_output) and 2.5d an element of
  // its parameters' shards.
  double runBytesPerActivation(const RunConfig& c) const override { return double(dtypeSize(c.dtype)); }
  RunningBytes runningBytesPerActivation(const RunConfig& c) const override {
    const double d = double(dtypeSize(c.dtype));
    return column() ? RunningBytes{1.5 * d, 5 * d} : RunningBytes{3 * d, 4 * d};
  }
  double runBytesPerParameter(const RunConfig& c, double threads) const override {
    const double d = parameterBytes(c);
    return d + 2.5 * d * threads / double(c.tp * c.gtpRemat);
  }
  // Each rank packs its experts' shards, gathers them all, and copies each expert's out, then for
  // the wgrads a send buffer of them all, each expert's logical wgrad and what it receives: 1.25 +
  // 2.5G elements of the wire dtype's, measured in fp32 at G = 2 and 4, T = 1 and 2, on one thread
  // and two (in bf16 with an fp32 wire the run took as many bytes a parameter as in fp32).
  std::optional<double> gtpBatchedBytes(const RunConfig& c) const override {
    return (1.25 + 2.5 * double(c.gtpRemat)) * parameterBytes(c);
  }
  double gemmWeightShare(const RunConfig& c) const override { return 1.0 / double(c.experts); }
  // The reference takes one expert at a time, as linearReference takes its weight: the expert's
  // tokens' rows in double, their results and magnitudes (52 bytes an element of them), |W| in float
  // for that expert alone, and its weight in blocks of rows (linearLayer).
  double referenceBytesPerActivation(const RunConfig& c) const override { return 52.0 / double(c.experts); }
  double referenceBytesPerParameter(const RunConfig& c) const override { return 4.0 / double(c.experts); }
  // A part of the reference holds its share of each weight's rows (a column's) or columns (a row's).
  double referenceIntermediates(const RunConfig& c, const ShapeMap&, double part) const override {
    std::int64_t n = c.outFeatures, k = c.inFeatures;
    (column() ? n : k) = std::int64_t(std::ceil(part * double(column() ? n : k)));
    return 4.5 * double(blockRows(ReferenceOptions(), n, k) * k);
  }
  // Each expert's rows of N (a column's, with its bias's) or columns of K (a row's) that the parts'
  // TP ranks hold, without GTP_remat (which cuts a rank's rows among its peers): the results of
  // those rows where the ranks split them, the column's output and the row's input.grad among them.
  std::vector<std::string> partResults(const RunConfig& c) const override {
    if (c.gtpRemat > 1) return {};
    std::vector<std::string> results = {column() ? "output" : "input.grad"};
    for (std::int64_t i = 0; i < c.experts; ++i) results.push_back(detail::concat("weight", i, ".grad"));
    if (column() && c.bias)
      for (std::int64_t i = 0; i < c.experts; ++i) results.push_back(detail::concat("bias", i, ".grad"));
    return results;
  }
  // The experts' weights and biases are saved as one key each, expert i at index i of its leading axis.
  CheckpointSlot checkpointSlot(const std::string& parameter) const override {
    const std::size_t digits = parameter.find_first_of("0123456789");
    return {parameter.substr(0, digits), std::stoll(parameter.substr(digits))};
  }
  // Both modes are one module (GroupedParallelLinear, as Transformer Engine's GroupedLinear takes a
  // parallel_mode) with the same E (N, K) weights: the mode is a cut, like --tp, and a checkpoint
  // of either loads as the other.
  std::string checkpointKind() const override { return "grouped"; }
  // A weight gradient sums its expert's tokens, up to all M.
  std::int64_t longestSum(const RunConfig& c) const override {
    return std::max({c.inFeatures + 1, c.outFeatures, c.tokens});
  }
  LayerContext context(Compute& compute, ProcessGroups& groups, GtpGradReducer& reducer) const override {
    return {compute, groups.expertTp(), nullptr, nullptr, &groups.expertGtpRemat(), &groups.expertDp(), &reducer};
  }
  std::unique_ptr<LayerModules> build(const LayerContext& lc, const ModelParallelConfig& mp,
                                      const RunConfig& c) const override {
    return std::make_unique<GroupedModules>(lc, mp, c, mode_);
  }
  void reference(const ReferenceOptions& o, const InputMap& in, ReferenceSink& sink) const override {
    std::int64_t experts = 0;
    while (in.count(detail::concat("weight", experts))) ++experts;
    groupedReference(o, in, experts, sink);
  }

 private:
  bool column() const { return mode_ == GroupedParallelMode::kColumn; }
  // A parameter element's bytes in the run's working set: under GTP_remat its wire dtype's.
  double parameterBytes(const RunConfig& c) const {
    return double(dtypeSize(c.gtpRemat > 1 ? gtpWireDtype(c) : c.dtype));
  }

  const char* name_;
  GroupedParallelMode mode_;
  std::vector<SizeSpec> sizes_;
  std::vector<GtpWeightSpec> gtpWeights_;
};

}  // namespace

const LayerKind& groupedColumnLayerKind() {
  static const GroupedKind kind("grouped-column", GroupedParallelMode::kColumn);
  return kind;
}

const LayerKind& groupedRowLayerKind() {
  static const GroupedKind kind("grouped-row", GroupedParallelMode::kRow);
  return kind;
}

}  // namespace tpsim::tools
