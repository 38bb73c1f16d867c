#include "tools/lib/runner.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <mutex>
#include <random>

#include "backends/errors.h"
#include "core/checkpoint.h"
#include "core/embedding.h"
#include "core/grad_stats.h"
#include "core/gtp.h"
#include "core/layers.h"
#include "core/process_groups.h"
#include "tools/lib/backend.h"

namespace tpsim::tools {
namespace {

const HostTensor& need(const TensorMap& m, const std::string& name) {
  auto it = m.find(name);
  TPSIM_CHECK(it != m.end(), "tpsim run: ", name, ".npy is missing");
  return it->second;
}

// Each rank's results, gathered under a lock and reassembled after the run.
struct PerRank {
  std::mutex mu;
  std::vector<TensorMap> results;
  std::vector<TensorPlacement> placements;  // rank 0's
  void put(int rank, const std::string& name, HostTensor t) {
    std::lock_guard<std::mutex> lock(mu);
    results[rank][name] = std::move(t);
  }
};

// A parameter's shard, and the main_grad its wgrad accumulates into under fusion or GTP_remat.
void setShard(Compute& compute, Parameter& p, const HostTensor& shard, const RunConfig& c) {
  compute.copy(toBackend(compute, shard), p.data);
  if (isGtpShard(p) || (c.gradAccumulationFusion && p.data.shape().rank() == 2))
    p.mainGrad = compute.zeros(p.data.shape(), c.mainGradDtype);
}

const TensorPlacement& placementNamed(const std::vector<TensorPlacement>& ps, const std::string& name) {
  for (const TensorPlacement& p : ps)
    if (p.name == name) return p;
  TPSIM_INTERNAL_ASSERT(false, "no placement named ", name);
  return ps.front();
}

// The output's placement before gather_output: sharded over TP along its last dim like the
// weight's rows, interleaved chunks included.
TensorPlacement beforeGather(TensorPlacement output, const TensorPlacement& weight) {
  output.tp = weight.tp;
  output.tp.dim = int(output.shape.size()) - 1;
  return output;
}

// GTP_remat peer g's block of the gathered output's gradient, its columns in the gathered output's
// rank order: every TP rank's shard (beforeGather) in turn.
HostTensor rankOrdered(const TensorPlacement& outputGrad, const TensorPlacement& weight, const HostTensor& full, int g) {
  const TensorPlacement sharded = beforeGather(outputGrad, weight);
  std::vector<HostTensor> parts;
  for (int t = 0; t < sharded.tp.size; ++t) parts.push_back(shardOf(sharded, full, t, g));
  return concat(parts, -1);
}

// The run's sizes as its tensors have them (loaded tensors may differ from the shape flags).
RunConfig withShapesOf(RunConfig c, const TensorMap& in) {
  const HostTensor &x = in.at("input"), &w = in.at(c.layer == LayerKind::kMlp ? "fc1.weight" : "weight");
  if (c.layer == LayerKind::kEmbedding) {
    c.batch = x.shape[0];
    c.seq = x.shape[1];
    c.vocab = w.shape[0];
    c.outFeatures = w.shape[1];
    return c;
  }
  c.seq = x.shape[0];
  c.batch = x.shape[1];
  c.inFeatures = w.shape[1];
  if (c.layer == LayerKind::kMlp) c.ffnHidden = w.shape[0];
  else c.outFeatures = w.shape[0];
  return c;
}

// What the optimizer reads: main_grad under fusion (weights), else grad.
HostTensor gradOf(Compute& compute, const Parameter& p) {
  TPSIM_CHECK(p.mainGrad.defined() || p.grad.defined(), "tpsim run: ", p.name, " received no gradient");
  return fromBackend(compute, p.mainGrad.defined() ? ConstView(p.mainGrad) : ConstView(p.grad));
}

Tensor sumRowsOf(Compute& compute, ConstView y, DType dtype) {
  Tensor db = compute.empty({y.dim(-1)}, dtype);
  compute.sumRows(y, db);
  return db;
}

}  // namespace

ModelParallelConfig layerConfig(const RunConfig& c) {
  ModelParallelConfig mp;
  mp.tensorModelParallelSize = c.tp;
  mp.sequenceParallel = c.sequenceParallel;
  mp.performInitialization = false;  // the tool copies its tensors in
  mp.paramsDtype = c.dtype;
  mp.gradientAccumulationFusion = c.gradAccumulationFusion;
  mp.gtpRematSize = c.gtpRemat;
  mp.gtpPadForAlignment = c.padForAlignment;
  mp.calculatePerTokenLoss = !c.gtpReduceMean;
  mp.gtpReduceScatterWithFp32Accumulation = c.fp32AccumReduceScatter;
  mp.weightFormat = c.weightFormat;
  return mp;
}

RankLayers buildLayers(const LayerContext& lc, const ModelParallelConfig& mp, const RunConfig& c) {
  const InitMethod unused = initMethodNormal(0.02);  // perform_initialization is off: weights come from elsewhere
  RankLayers layers;
  switch (c.layer) {
    case LayerKind::kColumn: {
      ColumnParallelOptions o;
      o.bias = c.bias;
      o.gatherOutput = c.gatherOutput;
      o.stride = c.stride;
      o.skipBiasAdd = c.skipBiasAdd;
      o.outputDtype = c.outputDtype;
      o.disableGradReduce = c.disableGradReduce;
      o.name = "column";
      layers.column = std::make_unique<ColumnParallelLinear>(lc, mp, c.inFeatures, c.outFeatures, unused, o);
      break;
    }
    case LayerKind::kRow: {
      RowParallelOptions o;
      o.bias = c.bias;
      o.inputIsParallel = c.inputIsParallel;
      o.skipBiasAdd = c.skipBiasAdd;
      o.stride = c.stride;
      o.name = "row";
      layers.row = std::make_unique<RowParallelLinear>(lc, mp, c.inFeatures, c.outFeatures, unused, o);
      break;
    }
    case LayerKind::kEmbedding: {
      VocabParallelEmbeddingOptions o;
      o.reduceScatterEmbeddings = c.reduceScatterEmbeddings;
      ModelParallelConfig emp = mp;
      emp.sequenceParallel = false;  // the embedding's sequence parallelism is reduce_scatter_embeddings
      layers.embedding = std::make_unique<VocabParallelEmbedding>(lc, emp, c.vocab, c.outFeatures, unused, o);
      break;
    }
    case LayerKind::kMlp: {
      ColumnParallelOptions o1;
      o1.name = "fc1";
      RowParallelOptions o2;
      o2.inputIsParallel = true;
      o2.name = "fc2";
      layers.column = std::make_unique<ColumnParallelLinear>(lc, mp, c.inFeatures, c.ffnHidden, unused, o1);
      layers.row = std::make_unique<RowParallelLinear>(lc, mp, c.ffnHidden, c.inFeatures, unused, o2);
      break;
    }
  }
  return layers;
}

std::vector<std::pair<std::string, Parameter*>> RankLayers::parameters() const {
  if (embedding) return {{"weight", &embedding->weight()}};
  const std::string fc1 = column && row ? "fc1." : "", fc2 = column && row ? "fc2." : "";
  std::vector<std::pair<std::string, Parameter*>> out;
  if (column) out.insert(out.end(), {{fc1 + "weight", column->weight()}, {fc1 + "bias", column->bias()}});
  if (row) out.insert(out.end(), {{fc2 + "weight", &row->weight()}, {fc2 + "bias", row->bias()}});
  out.erase(std::remove_if(out.begin(), out.end(), [](const auto& e) { return e.second == nullptr; }), out.end());
  return out;
}

std::vector<TensorPlacement> RankLayers::placements(std::int64_t seq, std::int64_t batch) const {
  if (embedding) return layerPlacements(*embedding, seq, batch);
  if (!row) return layerPlacements(*column, seq, batch);
  if (!column) return layerPlacements(*row, seq, batch);
  std::vector<TensorPlacement> out = layerPlacements(*column, seq, batch, "fc1.");
  for (TensorPlacement& p : layerPlacements(*row, seq, batch, "fc2.")) out.push_back(std::move(p));
  return out;
}

ShardedStateDict RankLayers::stateDict(Collectives& tp, Collectives* dpCp) const {
  if (embedding) return shardedStateDict(*embedding, "", {}, tp, dpCp);
  if (!row) return shardedStateDict(*column, "", {}, tp, dpCp);
  if (!column) return shardedStateDict(*row, "", {}, tp, dpCp);
  ShardedStateDict out = shardedStateDict(*column, "fc1.", {}, tp, dpCp);
  for (ShardedEntry& e : shardedStateDict(*row, "fc2.", {}, tp, dpCp)) out.push_back(std::move(e));
  return out;
}

void applyEmbeddingSequenceParallel(RunConfig& config) {
  if (config.layer != LayerKind::kEmbedding || !config.sequenceParallel) return;
  config.sequenceParallel = false;
  config.reduceScatterEmbeddings = true;
}

void RunConfig::validate() const {
  TPSIM_CHECK(tp >= 1 && tp <= 64, "--tp: expected 1..64, got ", tp);
  // G <= 64 / T rather than T x G <= 64, which can overflow.
  TPSIM_CHECK(gtpRemat >= 1 && gtpRemat <= 64 / std::max(tp, 1), "--gtp-remat: expected G >= 1 with --tp x --gtp-remat <= 64, got ",
              gtpRemat, " with --tp ", tp);
  TPSIM_CHECK(padForAlignment >= 0, "--pad-for-alignment: expected >= 0, got ", padForAlignment);
  TPSIM_CHECK(gtpRemat == 1 || mainGradDtype == DType::kFloat32 || mainGradDtype == dtype,
              "--main-grad-dtype ", dtypeName(mainGradDtype), ": GTP_remat reduce-scatters into main_grad in the "
              "wgrad's dtype; needs --dtype ", dtypeName(mainGradDtype), ", got --dtype ", dtypeName(dtype));
  TPSIM_CHECK(!sequenceParallel || tp > 1, "--sequence-parallel: needs --tp > 1, got --tp ", tp);
  TPSIM_CHECK(stride >= 1, "--stride: expected >= 1, got ", stride);
  TPSIM_CHECK(stride == 1 || layer == LayerKind::kColumn || layer == LayerKind::kRow,
              "--stride: applies to --layer column or row, got --layer ", layerName(layer));
  TPSIM_CHECK(!outputDtype || layer == LayerKind::kColumn, "--output-dtype: only ColumnParallelLinear has "
              "output_dtype, got --layer ", layerName(layer));
  TPSIM_CHECK(!gatherOutput || layer == LayerKind::kColumn, "--gather-output: applies to --layer column");
  TPSIM_CHECK(!disableGradReduce || layer == LayerKind::kColumn, "--disable-grad-reduce: applies to --layer column");
  TPSIM_CHECK(!(disableGradReduce && sequenceParallel), "--disable-grad-reduce: not with --sequence-parallel (the "
              "input gradient would still be reduce-scattered over TP)");
  TPSIM_CHECK(!inputIsParallel || layer == LayerKind::kRow, "--input-is-parallel: applies to --layer row");
  TPSIM_CHECK(!reduceScatterEmbeddings || layer == LayerKind::kEmbedding,
              "--reduce-scatter-embeddings: applies to --layer embedding");
  TPSIM_CHECK(!(sequenceParallel && layer == LayerKind::kRow && !inputIsParallel),
              "--sequence-parallel: RowParallelLinear needs --input-is-parallel with it");
  TPSIM_CHECK(!(stride > 1 && layer == LayerKind::kRow && !inputIsParallel && tp > 1),
              "--stride: RowParallelLinear with stride > 1 needs --input-is-parallel (its input scatter is "
              "contiguous, its weight columns interleaved)");
  TPSIM_CHECK(!(sequenceParallel && layer == LayerKind::kEmbedding),
              "--sequence-parallel: the embedding's sequence parallelism is --reduce-scatter-embeddings");
  TPSIM_CHECK(!(sequenceParallel && gatherOutput), "--gather-output: not with --sequence-parallel (the column "
              "output would be gathered along both the sequence and the features)");
  TPSIM_CHECK(!skipBiasAdd || (bias && (layer == LayerKind::kColumn || layer == LayerKind::kRow)),
              "--skip-bias-add: needs --bias and --layer column or row");
  TPSIM_CHECK(!(skipBiasAdd && gatherOutput), "--skip-bias-add: not with --gather-output (the returned bias is "
              "sharded while the output is gathered)");
  TPSIM_CHECK(!gradAccumulationFusion || layer != LayerKind::kEmbedding,
              "--grad-accumulation-fusion: the embedding has no fused wgrad path");
  TPSIM_CHECK(dtype != DType::kInt64 && dtype != DType::kFloat64, "--dtype: expected fp32, bf16 or fp16, got ",
              dtypeName(dtype));
  TPSIM_CHECK(mainGradDtype == DType::kFloat32 || mainGradDtype == DType::kBFloat16,
              "--main-grad-dtype: expected fp32 or bf16, got ", dtypeName(mainGradDtype));
  TPSIM_CHECK(!gradAccumulationFusion || mainGradDtype == DType::kFloat32 || mainGradDtype == dtype,
              "--main-grad-dtype bf16: needs --dtype bf16 (the 16-bit fused kernel), got --dtype ", dtypeName(dtype));
  TPSIM_CHECK(weightFormat == WeightFormat::kNative || layer != LayerKind::kEmbedding,
              "--weight-format mxfp8: applies to --layer column, row or mlp (the embedding is a lookup, not a "
              "GEMM), got --layer embedding");
  const bool blockAligned = padForAlignment > 0 && padForAlignment % kMxfp8BlockSize == 0;
  TPSIM_CHECK(weightFormat == WeightFormat::kNative || gtpRemat == 1 || blockAligned,
              "--pad-for-alignment: expected a positive multiple of 32 for --weight-format mxfp8 with --gtp-remat ",
              gtpRemat, ", got ", padForAlignment);
  const int worldSize = tp * gtpRemat;
  for (const Fault& f : faults) {
    TPSIM_CHECK(f.rank < worldSize, "--inject: expected RANK in [0, ", worldSize, ") (the world's --tp x --gtp-remat "
                "ranks), got ", f.rank, " in '", f.str(), "'");
    for (const Fault& g : faults)
      TPSIM_CHECK(&f == &g || f.rank != g.rank || f.collective != g.collective, "--inject: expected one fault per "
                  "rank and collective, got '", f.str(), "' and '", g.str(), "'");
  }
  TPSIM_CHECK(timeout.count() > 0, "--timeout: expected a positive number of seconds, got ", timeout.count(), " ms");
  TPSIM_CHECK(threads >= 0, "--threads: expected >= 0 (0 = every core), got ", threads);
  for (auto [flag, v] : {std::pair{"seq", seq}, {"batch", batch}, {"in-features", inFeatures},
                         {"out-features", outFeatures}, {"ffn-hidden", ffnHidden}, {"vocab", vocab}})
    TPSIM_CHECK(v >= 1, "--", flag, ": expected >= 1, got ", v);
}

std::string RunConfig::str() const {
  std::string s = detail::concat("layer=", layerName(layer), " tp=", tp, " dtype=", dtypeName(dtype));
  if (backend != "sim") s += " backend=" + backend;
  if (outputDtype) s += detail::concat(" output-dtype=", dtypeName(*outputDtype));
  if (sequenceParallel) s += " sequence-parallel";
  if (bias) s += " bias";
  if (gatherOutput) s += " gather-output";
  if (inputIsParallel) s += " input-is-parallel";
  if (reduceScatterEmbeddings) s += " reduce-scatter-embeddings";
  if (skipBiasAdd) s += " skip-bias-add";
  if (disableGradReduce) s += " disable-grad-reduce";
  if (stride > 1) s += detail::concat(" stride=", stride);
  if (gradAccumulationFusion) s += detail::concat(" grad-accumulation-fusion main-grad-dtype=", dtypeName(mainGradDtype));
  if (weightFormat != WeightFormat::kNative) s += detail::concat(" weight-format=", weightFormatName(weightFormat));
  if (gtpRemat > 1)
    s += detail::concat(" gtp-remat=", gtpRemat, " pad-for-alignment=", padForAlignment, " gtp-reduce=",
                        gtpReduceMean ? "mean" : "sum", fp32AccumReduceScatter ? " fp32-accum-reduce-scatter" : "");
  for (const Fault& f : faults) s += " inject=" + f.str();
  if (timeout != RunConfig().timeout) s += detail::concat(" timeout=", double(timeout.count()) / 1000, "s");
  return s + detail::concat(" seed=", seed);
}

ShapeMap generatedShapes(const RunConfig& c) {
  const std::int64_t s = c.seq, b = c.batch, k = c.inFeatures, n = c.outFeatures, v = c.vocab, f = c.ffnHidden;
  ShapeMap m;
  // Every tensor's bytes as doubles checked once, so no product of these sizes can wrap later.
  auto add = [&](const std::string& name, std::vector<std::int64_t> dims, const std::string& flags) {
    std::int64_t bytes = sizeof(double);
    for (std::int64_t d : dims) bytes = checkedMul(bytes, d, flags);
    m[name] = std::move(dims);
  };
  switch (c.layer) {
    case LayerKind::kColumn:
    case LayerKind::kRow:
      add("input", {s, b, k}, "--seq x --batch x --in-features");
      add("weight", {n, k}, "--out-features x --in-features");
      if (c.bias) add("bias", {n}, "--out-features");
      add("grad_output", {s, b, n}, "--seq x --batch x --out-features");
      break;
    case LayerKind::kEmbedding:
      add("input", {b, s}, "--batch x --seq");
      add("weight", {v, n}, "--vocab x --out-features");
      add("grad_output", c.reduceScatterEmbeddings ? std::vector{s, b, n} : std::vector{b, s, n},
          "--seq x --batch x --out-features");
      break;
    case LayerKind::kMlp:
      add("input", {s, b, k}, "--seq x --batch x --in-features");
      add("fc1.weight", {f, k}, "--ffn-hidden x --in-features");
      add("fc1.bias", {f}, "--ffn-hidden");
      add("fc2.weight", {k, f}, "--in-features x --ffn-hidden");
      add("fc2.bias", {k}, "--in-features");
      add("grad_output", {s, b, k}, "--seq x --batch x --in-features");
      break;
  }
  return m;
}

TensorMap generateInputs(const RunConfig& c) {
  const ShapeMap shapes = generatedShapes(c);
  std::mt19937_64 rng(c.seed);
  auto normal = [&](const std::string& name, double sigma) {
    const std::vector<std::int64_t>& shape = shapes.at(name);
    std::normal_distribution<double> dist(0.0, sigma);
    std::int64_t n = 1;
    for (auto d : shape) n *= d;
    std::vector<double> v(static_cast<std::size_t>(n));
    for (double& x : v) x = dist(rng);
    return makeHost(shape, c.dtype, std::move(v));
  };
  const std::int64_t k = c.inFeatures;
  // The draws keep their order (input, weight, bias, grad_output), so a seed makes the same data.
  TensorMap m;
  switch (c.layer) {
    case LayerKind::kColumn:
    case LayerKind::kRow:
      m["input"] = normal("input", 1.0);
      m["weight"] = normal("weight", 1.0 / std::sqrt(double(k)));
      if (c.bias) m["bias"] = normal("bias", 0.1);
      m["grad_output"] = normal("grad_output", 1.0);
      break;
    case LayerKind::kEmbedding: {
      std::uniform_int_distribution<std::int64_t> id(0, c.vocab - 1);
      std::vector<double> ids(static_cast<std::size_t>(c.batch * c.seq));
      for (double& x : ids) x = double(id(rng));
      m["input"] = makeHost(shapes.at("input"), DType::kInt64, std::move(ids));
      m["weight"] = normal("weight", 1.0);
      m["grad_output"] = normal("grad_output", 1.0);
      break;
    }
    case LayerKind::kMlp:
      m["input"] = normal("input", 1.0);
      m["fc1.weight"] = normal("fc1.weight", 1.0 / std::sqrt(double(k)));
      m["fc1.bias"] = normal("fc1.bias", 0.1);
      m["fc2.weight"] = normal("fc2.weight", 1.0 / std::sqrt(double(c.ffnHidden)));
      m["fc2.bias"] = normal("fc2.bias", 0.1);
      m["grad_output"] = normal("grad_output", 1.0);
      break;
  }
  return m;
}

void checkInputs(const RunConfig& c, const TensorMap& in) {
  auto expectShape = [&](const std::string& name, const std::vector<std::int64_t>& shape) {
    const HostTensor& t = need(in, name);
    HostTensor want{shape, t.dtype, {}};
    TPSIM_CHECK(t.shape == shape, "tpsim run: ", name, ".npy must have shape ", want.shapeStr(), ", got ",
                t.shapeStr());
  };
  auto divisible = [&](const std::string& what, std::int64_t v, std::int64_t by, const std::string& why) {
    TPSIM_CHECK(v % by == 0, "tpsim run: ", what, " = ", v, " must be divisible by ", why, " = ", by);
  };
  const int T = c.tp;
  // Empty tensors are refused: the layers and the reference divide by these sizes.
  for (const auto& [name, t] : in)
    TPSIM_CHECK(std::all_of(t.shape.begin(), t.shape.end(), [](std::int64_t d) { return d >= 1; }), "tpsim run: ",
                name, ".npy: expected every dim >= 1, got shape ", t.shapeStr());
  // Non-finite inputs would only surface as a result outside its bound.
  for (const auto& [name, t] : in) {
    const auto bad = std::count_if(t.values.begin(), t.values.end(), [](double x) { return !std::isfinite(x); });
    const auto first = std::find_if(t.values.begin(), t.values.end(), [](double x) { return !std::isfinite(x); });
    TPSIM_CHECK(bad == 0, "tpsim run: ", name, ".npy: expected finite values, got ", bad, " NaN or Inf, the first at "
                "flat index ", first - t.values.begin());
  }
  // Each GTP_remat peer keeps dim 0 / G rows of a TP-local weight; checked here, before the ranks
  // would each fail on it.
  auto gtpSplits = [&](const std::string& what, std::int64_t dim0) {
    if (c.gtpRemat > 1 && c.padForAlignment == 0)
      divisible(what, dim0, c.gtpRemat, "--gtp-remat (with --pad-for-alignment 0)");
  };
  const HostTensor& input = need(in, "input");
  if (c.layer == LayerKind::kEmbedding) {
    TPSIM_CHECK(input.dtype == DType::kInt64 && input.shape.size() == 2, "tpsim run: input.npy of the embedding "
                "must hold int64 token ids of shape (b, s), got ", dtypeName(input.dtype), " ", input.shapeStr());
    const HostTensor& w = need(in, "weight");
    TPSIM_CHECK(w.shape.size() == 2, "tpsim run: weight.npy must be (V, h), got ", w.shapeStr());
    divisible("the vocabulary size V (weight.npy dim 0)", w.shape[0], T, "--tp");
    gtpSplits("the TP-local rows V / --tp", w.shape[0] / T);
    for (std::size_t i = 0; i < input.values.size(); ++i)
      TPSIM_CHECK(input.values[i] >= 0 && input.values[i] < double(w.shape[0]), "tpsim run: input.npy holds id ",
                  std::int64_t(input.values[i]), " at flat position ", i, ", outside [0, V=", w.shape[0], ")");
    const std::int64_t b = input.shape[0], s = input.shape[1], h = w.shape[1];
    if (c.reduceScatterEmbeddings) divisible("the sequence length s (input.npy dim 1)", s, T, "--tp");
    divisible("the batch b (input.npy dim 0)", b, c.gtpRemat, "--gtp-remat");
    expectShape("grad_output", c.reduceScatterEmbeddings ? std::vector<std::int64_t>{s, b, h}
                                                         : std::vector<std::int64_t>{b, s, h});
    return;
  }
  TPSIM_CHECK(input.shape.size() == 3 && isFloating(input.dtype), "tpsim run: input.npy must be a float (s, b, K) "
              "tensor, got ", dtypeName(input.dtype), " ", input.shapeStr());
  const std::int64_t s = input.shape[0], b = input.shape[1], k = input.shape[2];
  if (c.sequenceParallel) divisible("the sequence length s (input.npy dim 0)", s, T, "--tp");
  divisible("the batch b (input.npy dim 1)", b, c.gtpRemat, "--gtp-remat");
  if (c.layer == LayerKind::kMlp) {
    const HostTensor& w1 = need(in, "fc1.weight");
    TPSIM_CHECK(w1.shape.size() == 2, "tpsim run: fc1.weight.npy must be (F, h), got ", w1.shapeStr());
    const std::int64_t f = w1.shape[0];
    expectShape("fc1.weight", {f, k});
    expectShape("fc1.bias", {f});
    expectShape("fc2.weight", {k, f});
    expectShape("fc2.bias", {k});
    divisible("the ffn hidden size F (fc1.weight.npy dim 0)", f, T, "--tp");
    gtpSplits("fc1's TP-local rows F / --tp", f / T);
    gtpSplits("fc2's rows h (fc2.weight.npy dim 0)", k);
    expectShape("grad_output", {s, b, k});
    return;
  }
  const HostTensor& w = need(in, "weight");
  TPSIM_CHECK(w.shape.size() == 2, "tpsim run: weight.npy must be (N, K), got ", w.shapeStr());
  const std::int64_t n = w.shape[0];
  expectShape("weight", {n, k});
  if (c.bias) expectShape("bias", {n});
  // Dims are >= 1 (above), so divisibility by --tp x --stride also keeps --stride within the dim.
  if (c.layer == LayerKind::kColumn) divisible("N (weight.npy dim 0)", n, std::int64_t(T) * c.stride, "--tp x --stride");
  if (c.layer == LayerKind::kRow) divisible("K (weight.npy dim 1)", k, std::int64_t(T) * c.stride, "--tp x --stride");
  gtpSplits(c.layer == LayerKind::kColumn ? "the TP-local rows N / --tp" : "N (weight.npy dim 0)",
            c.layer == LayerKind::kColumn ? n / T : n);
  expectShape("grad_output", {s, b, n});
}

void checkCheckpointable(const RunConfig& c) {
  TPSIM_CHECK(c.stride == 1, "--stride: checkpoints need stride 1 (sharded_state_dict records a rank's interleaved "
              "rows as one contiguous chunk, which another --tp would read as the wrong rows), got ", c.stride);
  TPSIM_CHECK(c.weightFormat == WeightFormat::kNative, "--weight-format: checkpoints need native weights (an MXFP8 "
              "weight is saved as its dequantized copy, not the parameter), got ", weightFormatName(c.weightFormat));
}

RunResult runSharded(const RunConfig& config, const TensorMap& in, const CheckpointHooks& hooks) {
  config.validate();
  checkInputs(config, in);
  if (hooks.load || hooks.save) checkCheckpointable(config);
  const RunConfig c = withShapesOf(config, in);
  const int T = c.tp, G = c.gtpRemat;
  ParallelSizes sizes;
  sizes.world = T * G;
  sizes.tp = T;
  sizes.gtpRemat = G;
  const ParallelLayout layout(sizes);
  PerRank per;
  per.results.resize(sizes.world);
  WorldOptions wo;
  wo.size = sizes.world;
  wo.threads = c.threads;
  wo.trace = true;
  wo.faults = c.faults;
  wo.timeout = c.timeout;
  const std::unique_ptr<World> world = makeWorld(c.backend, wo);
  // The MLP's input and input gradient are fc1's, its output and output gradient fc2's.
  const std::string first = c.layer == LayerKind::kMlp ? "fc1." : "", last = c.layer == LayerKind::kMlp ? "fc2." : "";
  std::vector<RankRecord> records(c.record ? sizes.world : 0);
  const TraceClock::time_point t0 = TraceClock::now();
  auto rankMain = [&](RankContext& base) {
    // Under --trace every op goes through a logging decorator; the layers see no difference.
    std::unique_ptr<Compute> loggedCompute;
    std::unique_ptr<Collectives> loggedComm;
    if (c.record) {
      RankRecord& record = records[base.comm.rank()];
      loggedCompute = recordingCompute(base.compute, record, t0);
      loggedComm = recordingCollectives(base.comm, record, t0);
    }
    RankContext ctx{c.record ? *loggedCompute : base.compute, c.record ? *loggedComm : base.comm};
    Compute& compute = ctx.compute;
    const int r = ctx.comm.rank();
    ProcessGroups pg(ctx.comm, layout);
    const int t = pg.tp().rank(), g = pg.gtpRemat().rank();
    const ModelParallelConfig mp = layerConfig(c);
    GtpGradReducer reducer(compute, GtpReduceOptions::fromConfig(mp, true));
    const LayerContext lc{compute, pg.tp(), nullptr, nullptr, &pg.gtpRemat(), &pg.dpCp(), &reducer};
    RankLayers layers = buildLayers(lc, mp, c);
    const std::vector<TensorPlacement> placements = layers.placements(c.seq, c.batch);
    if (r == 0) {
      per.placements = placements;
      if (hooks.save)
        for (const TensorPlacement& p : placements)
          if (p.role == TensorRole::kParameter) hooks.save->describe(p);
    }
    auto shardOfInput = [&](const std::string& placement, const std::string& input) {
      return shardOf(placementNamed(placements, placement), in.at(input), t, g);
    };
    const std::vector<std::pair<std::string, Parameter*>> params = layers.parameters();
    for (const auto& [name, param] : params) setShard(compute, *param, shardOfInput(name, name), c);
    // Once the parameters are set: this rank's chunks read from, or added to, the checkpoint.
    if (hooks.load || hooks.save) {
      const ShardedStateDict sd = layers.stateDict(pg.tp(), &pg.dpCpGtp());
      if (hooks.load)
        for (const ShardedEntry& e : sd) {
          if (const auto* o = std::get_if<ShardedObject>(&e)) {
            hooks.load->checkObject(*o);
          } else {
            const auto& st = std::get<ShardedTensor>(e);
            const auto it = std::find_if(params.begin(), params.end(), [&](const auto& p) { return p.first == st.key; });
            TPSIM_INTERNAL_ASSERT(it != params.end(), "checkpoint key ", st.key, " is no parameter of the layer");
            hooks.load->load(st, it->second->data, compute);
          }
        }
      if (hooks.save) hooks.save->add(r, sd, compute);
    }
    // gather_output concatenates the ranks' output shards in rank order, which under stride > 1 is
    // not the logical column order (SPEC 3.11): the layer's dY is in that order too.
    const bool gathered = c.layer == LayerKind::kColumn && c.gatherOutput;
    const HostTensor dyHost = gathered ? rankOrdered(placementNamed(placements, "output.grad"),
                                                     placementNamed(placements, "weight"), in.at("grad_output"), g)
                                       : shardOfInput(last + "output.grad", "grad_output");
    Tensor x = toBackend(compute, shardOfInput(first + "input", "input"));
    Tensor dy = toBackend(compute, dyHost);
    // The caller's use of a returned bias: y = output + b, so db = the row sums of dY.
    auto addReturnedBias = [&](LayerOutput& out) {
      if (!out.outputBias) return Tensor();
      compute.addBias(out.outputBias->data, out.output);
      return sumRowsOf(compute, dy, c.dtype);
    };
    Tensor y, dx;
    switch (c.layer) {
      case LayerKind::kColumn:
      case LayerKind::kRow: {
        LayerOutput out = layers.column ? layers.column->forward(x) : layers.row->forward(x);
        Tensor db = addReturnedBias(out);
        const ConstView dbView = db.defined() ? ConstView(db) : ConstView();
        dx = layers.column ? layers.column->backward(dy, dbView) : layers.row->backward(dy, dbView);
        y = std::move(out.output);
        break;
      }
      case LayerKind::kEmbedding:
        y = layers.embedding->forward(x);
        layers.embedding->backward(dy);
        break;
      case LayerKind::kMlp: {
        Tensor h = layers.column->forward(x).output;  // (s, b, F/T)
        Tensor a = compute.empty(h.shape(), h.dtype());
        compute.gelu(h, a);
        y = layers.row->forward(a).output;  // (s, b, h), or (s/T, b, h) under SP
        Tensor dA = layers.row->backward(dy);
        Tensor dH = compute.empty(h.shape(), h.dtype());
        compute.geluBackward(h, dA, dH);
        dx = layers.column->backward(dH);
        break;
      }
    }
    reducer.drain();
    // finalize_model_grads' TP step: the parameters' sequence_parallel tags decide what it sums.
    std::vector<Parameter*> finalized;
    for (const auto& entry : params) finalized.push_back(entry.second);
    finalizeSequenceParallelGrads(finalized, pg.tp(), mp.sequenceParallel);
    per.put(r, "output", fromBackend(compute, y));
    if (dx.defined()) per.put(r, "input.grad", fromBackend(compute, dx));
    for (const auto& [name, param] : params) per.put(r, name + ".grad", gradOf(compute, *param));
  };
  // A rank out of memory fails the world like any rank error; it is reported as what it is, an
  // allocation failure (exit 2 in the CLI), not as a failure of the simulated world.
  std::atomic<bool> outOfMemory{false};
  try {
    world->run([&](RankContext& ctx) {
      try {
        rankMain(ctx);
      } catch (const std::bad_alloc&) {
        outOfMemory = true;
        throw;
      }
    });
  } catch (const WorldError&) {
    if (outOfMemory) throw std::bad_alloc();
    throw;
  }

  // Back to the unsharded layout, each result through its placement.
  RunResult r;
  r.trace = world->trace();
  r.records = std::move(records);
  r.placements = std::move(per.placements);
  auto local = [&](const std::string& name) {
    return [&per, name, T](int t, int g) -> const HostTensor& { return per.results[t + T * g].at(name); };
  };
  auto placement = [&](const std::string& name) { return placementNamed(r.placements, name); };
  if (c.layer == LayerKind::kColumn && c.gatherOutput) {
    // Rank t's shard of the rank-ordered gathered output is its block t.
    std::vector<HostTensor> blocks(std::size_t(T * G));
    for (int g = 0; g < G; ++g)
      for (int t = 0; t < T; ++t) blocks[t + T * g] = chunk(per.results[T * g].at("output"), -1, t, T);
    r.results["output"] = assemble(beforeGather(placement("output"), placement("weight")),
                                   [&](int t, int g) -> const HostTensor& { return blocks[t + T * g]; });
  } else {
    r.results["output"] = assemble(placement(last + "output"), local("output"));
  }
  if (c.layer != LayerKind::kEmbedding) {
    const TensorPlacement& dx = placement(first + "input.grad");
    if (c.disableGradReduce) {
      // disable_grad_reduce: every TP rank's partial, stacked along a new dim 0: (T, s, b, K).
      TensorPlacement own = dx;
      own.tp = {AxisKind::kReplicate, 1};
      std::vector<HostTensor> partials;
      for (int t = 0; t < T; ++t) {
        HostTensor p = assemble(own, [&](int, int g) -> const HostTensor& { return per.results[t + T * g].at("input.grad"); });
        p.shape.insert(p.shape.begin(), 1);
        partials.push_back(std::move(p));
      }
      r.results["input.grad"] = concat(partials, 0);
    } else {
      r.results["input.grad"] = assemble(dx, local("input.grad"));
    }
  }
  for (const TensorPlacement& p : r.placements) {
    if (p.role != TensorRole::kParameter) continue;
    TensorPlacement grad = placement(p.name + ".grad");
    // The peers' gradients of a parameter they replicate are data-parallel partial sums: the DP
    // gradient reduction over them (MEAN or SUM, as the shards' reduce-scatter) happens here.
    const bool dataParallel = grad.gtp.kind == AxisKind::kReplicate && G > 1;
    if (dataParallel) grad.gtp.kind = AxisKind::kPartial;
    HostTensor total = assemble(grad, local(p.name + ".grad"));
    if (dataParallel && c.gtpReduceMean)
      for (double& v : total.values) v /= double(G);
    r.results[p.name + ".grad"] = std::move(total);
  }
  return r;
}

ReferenceOptions referenceOptions(const RunConfig& c) {
  ReferenceOptions o;
  o.kind = c.layer;
  o.reduceScatterEmbeddings = c.reduceScatterEmbeddings;
  o.tp = c.tp;
  o.computeDtype = c.dtype;
  o.outputDtype = c.outputDtype.value_or(c.dtype);
  o.gtpRemat = c.gtpRemat;
  // The wire dtype of the GTP_remat wgrad reduce-scatter (SPEC 4.5): the table's for the embedding,
  // main_grad's for the linears.
  o.gtpWireDtype = c.layer == LayerKind::kEmbedding ? c.dtype : c.mainGradDtype;
  o.weightFormat = c.weightFormat;
  o.stride = c.stride;
  o.accumulationUnit = gemmAccumulationUnit(c.backend);
  o.disableGradReduce = c.disableGradReduce;
  return o;
}

std::map<std::string, Checked> referenceFor(const RunConfig& c, const TensorMap& inputs) {
  auto reference = denseReference(referenceOptions(c), inputs);
  if (c.gtpRemat > 1 && c.gtpReduceMean)
    for (auto& [name, ref] : reference)
      if (name.size() >= 5 && name.compare(name.size() - 5, 5, ".grad") == 0 && name != "input.grad") {
        for (double& v : ref.value.values) v /= double(c.gtpRemat);
        for (double& b : ref.bound) b /= double(c.gtpRemat);
      }
  return reference;
}

std::vector<Verdict> verify(const RunConfig& c, const TensorMap& inputs, const TensorMap& results, VerifyMode mode) {
  std::vector<Verdict> out;
  if (mode == VerifyMode::kNone) return out;
  auto reference = referenceFor(c, inputs);
  for (auto& [name, ref] : reference) {
    auto it = results.find(name);
    TPSIM_INTERNAL_ASSERT(it != results.end(), "no sharded result named ", name);
    const HostTensor& got = it->second;
    TPSIM_INTERNAL_ASSERT(got.shape == ref.value.shape, name, ": sharded ", got.shapeStr(), " vs dense ",
                          ref.value.shapeStr());
    if (mode == VerifyMode::kExact) {  // the dense value as the result's storage holds it, no tolerance
      ref.value = makeHost(ref.value.shape, got.dtype, std::move(ref.value.values));
      std::fill(ref.bound.begin(), ref.bound.end(), 0.0);
    }
    Verdict v{name, got.shapeStr()};
    for (std::size_t i = 0; i < got.values.size(); ++i) {
      const double err = std::fabs(got.values[i] - ref.value.values[i]);
      if (std::isnan(err) || err > v.maxError) v.maxError = err;  // once NaN, max|err| stays NaN
      v.maxBound = std::max(v.maxBound, ref.bound[i]);
      v.outside += !(err <= ref.bound[i]);
      if (!std::isfinite(got.values[i]) && v.nonFinite++ == 0) v.firstNonFinite = std::int64_t(i);
    }
    out.push_back(v);
  }
  return out;
}

std::string verdictResult(const Verdict& v) { return v.nonFinite ? "NON-FINITE" : v.outside == 0 ? "OK" : "FAIL"; }

std::string nonFiniteNote(const Verdict& v) {
  if (v.nonFinite == 0) return "";
  return detail::concat(v.name, ": ", v.nonFinite, " NaN or Inf values, the first at flat index ", v.firstNonFinite,
                        "\n");
}

std::vector<std::pair<std::string, std::int64_t>> shapeFlags(const RunConfig& c) {
  std::vector<std::pair<std::string, std::int64_t>> out{{"seq", c.seq}, {"batch", c.batch}};
  switch (c.layer) {
    case LayerKind::kColumn:
    case LayerKind::kRow: out.insert(out.end(), {{"in-features", c.inFeatures}, {"out-features", c.outFeatures}}); break;
    case LayerKind::kEmbedding: out.insert(out.end(), {{"out-features", c.outFeatures}, {"vocab", c.vocab}}); break;
    case LayerKind::kMlp: out.insert(out.end(), {{"in-features", c.inFeatures}, {"ffn-hidden", c.ffnHidden}}); break;
  }
  return out;
}

std::string commandLine(const RunConfig& c, const std::string& loadDir) {
  std::string s = detail::concat("tpsim run --layer ", layerName(c.layer), " --tp ", c.tp);
  if (c.sequenceParallel) s += " --sequence-parallel";
  if (c.bias) s += " --bias";
  if (c.gatherOutput) s += " --gather-output";
  if (c.inputIsParallel) s += " --input-is-parallel";
  if (c.reduceScatterEmbeddings) s += " --reduce-scatter-embeddings";
  if (c.skipBiasAdd) s += " --skip-bias-add";
  if (c.disableGradReduce) s += " --disable-grad-reduce";
  if (c.stride != 1) s += detail::concat(" --stride ", c.stride);
  s += detail::concat(" --dtype ", dtypeName(c.dtype));
  if (c.outputDtype) s += detail::concat(" --output-dtype ", dtypeName(*c.outputDtype));
  if (c.gradAccumulationFusion)
    s += detail::concat(" --grad-accumulation-fusion --main-grad-dtype ", dtypeName(c.mainGradDtype));
  if (c.weightFormat != WeightFormat::kNative)
    s += detail::concat(" --weight-format ", weightFormatName(c.weightFormat));
  if (c.gtpRemat > 1) {
    s += detail::concat(" --gtp-remat ", c.gtpRemat, " --pad-for-alignment ", c.padForAlignment, " --gtp-reduce ",
                        c.gtpReduceMean ? "mean" : "sum");
    if (c.fp32AccumReduceScatter) s += " --fp32-accum-reduce-scatter";
  }
  if (c.threads != 0) s += detail::concat(" --threads ", c.threads);
  for (const Fault& f : c.faults) s += " --inject " + f.str();
  if (c.timeout != RunConfig().timeout) s += detail::concat(" --timeout ", double(c.timeout.count()) / 1000);
  if (c.backend != "sim") s += " --backend " + c.backend;
  s += detail::concat(" --seed ", c.seed);
  if (!loadDir.empty()) {
    // Single quotes keep a path with spaces or shell characters one word; ' itself becomes '\''.
    const bool plain = loadDir.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
                                                 "/._-+:=@%,") == std::string::npos;
    std::string quoted = "'";
    for (char ch : loadDir) quoted += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
    return s + " --load " + (plain ? loadDir : quoted + "'");
  }
  for (const auto& [flag, value] : shapeFlags(c)) s += detail::concat(" --", flag, " ", value);
  return s;
}

}  // namespace tpsim::tools
