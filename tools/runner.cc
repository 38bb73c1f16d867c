#include "tools/runner.h"

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
#include "tools/backend.h"

namespace tpsim::tools {
namespace {

using Range = std::pair<std::int64_t, std::int64_t>;

// The rows (or columns) of a dim of `total` that TP rank t owns: chunks t, t+T, ... of size
// total/(T·stride) (SPEC 3.11; stride 1 is one contiguous block).
std::vector<Range> ownedRanges(std::int64_t total, int T, int stride, int t) {
  const std::int64_t chunk = total / (std::int64_t(T) * stride);
  std::vector<Range> out;
  for (int j = 0; j < stride; ++j) out.push_back({(t + std::int64_t(j) * T) * chunk, (t + std::int64_t(j) * T + 1) * chunk});
  return out;
}

HostTensor take(const HostTensor& full, int dim, const std::vector<Range>& ranges);

// `full` rearranged so that TP rank t's rows (ownedRanges) come as its t-th contiguous block: the
// layout of a gathered output under stride > 1.
HostTensor rankOrder(const HostTensor& full, int dim, std::int64_t total, int T, int stride) {
  std::vector<HostTensor> parts;
  for (int t = 0; t < T; ++t) parts.push_back(take(full, dim, ownedRanges(total, T, stride, t)));
  return concat(parts, dim);
}

HostTensor take(const HostTensor& full, int dim, const std::vector<Range>& ranges) {
  std::vector<HostTensor> parts;
  for (auto [b, e] : ranges) parts.push_back(slice(full, dim, b, e));
  return concat(parts, dim);
}

// Inverse of take() over all ranks: rank t's tensor holds its ranges, in order, along `dim`.
HostTensor place(const std::vector<HostTensor>& perRank, int dim, std::int64_t total, int stride) {
  const int T = int(perRank.size());
  std::vector<std::pair<std::int64_t, HostTensor>> pieces;
  for (int t = 0; t < T; ++t) {
    const auto ranges = ownedRanges(total, T, stride, t);
    std::int64_t at = 0;
    for (auto [b, e] : ranges) {
      pieces.push_back({b, slice(perRank[t], dim, at, at + (e - b))});
      at += e - b;
    }
  }
  std::sort(pieces.begin(), pieces.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<HostTensor> ordered;
  for (auto& p : pieces) ordered.push_back(std::move(p.second));
  return concat(ordered, dim);
}

std::string describe(const std::string& name, const HostTensor& shard, const HostTensor& full, int dim,
                     const std::vector<Range>& ranges) {
  std::string what = dim == 0 ? "rows " : "columns ";
  for (std::size_t i = 0; i < ranges.size(); ++i)
    what += (i ? "+[" : "[") + std::to_string(ranges[i].first) + ", " + std::to_string(ranges[i].second) + ")";
  return name + " " + shard.shapeStr() + " = " + what + " of " + full.shapeStr();
}

const HostTensor& need(const TensorMap& m, const std::string& name) {
  auto it = m.find(name);
  TPSIM_CHECK(it != m.end(), "tpsim run: ", name, ".npy is missing");
  return it->second;
}

// Each rank's results, gathered under a lock and reassembled after the run.
struct PerRank {
  std::mutex mu;
  std::vector<TensorMap> results;
  std::vector<std::vector<std::string>> shards;
  void put(int rank, const std::string& name, HostTensor t) {
    std::lock_guard<std::mutex> lock(mu);
    results[rank][name] = std::move(t);
  }
  void shard(int rank, std::string text) {
    std::lock_guard<std::mutex> lock(mu);
    shards[rank].push_back(std::move(text));
  }
  std::vector<HostTensor> all(const std::string& name) const {
    std::vector<HostTensor> out;
    for (const auto& r : results) out.push_back(r.at(name));
    return out;
  }
};

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

void setShard(Compute& compute, Parameter& p, const HostTensor& shard, const RunConfig& c) {
  compute.copy(toBackend(compute, shard), p.data);
  if (c.gradAccumulationFusion && p.data.shape().rank() == 2) p.mainGrad = compute.zeros(p.data.shape(), c.mainGradDtype);
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

RunResult runSharded(const RunConfig& c, const TensorMap& in, const CheckpointHooks& hooks) {
  c.validate();
  checkInputs(c, in);
  if (hooks.load || hooks.save) checkCheckpointable(c);
  const int T = c.tp, G = c.gtpRemat;
  ParallelSizes sizes;
  sizes.world = T * G;
  sizes.tp = T;
  sizes.gtpRemat = G;
  const ParallelLayout layout(sizes);
  PerRank per;
  per.results.resize(sizes.world);
  per.shards.resize(sizes.world);
  WorldOptions wo;
  wo.size = sizes.world;
  wo.threads = c.threads;
  wo.trace = true;
  wo.faults = c.faults;
  wo.timeout = c.timeout;
  const std::unique_ptr<World> world = makeWorld(c.backend, wo);
  const InitMethod unused = initMethodNormal(0.02);  // weights are copied in
  const bool embeddingBatchFirst = c.layer == LayerKind::kEmbedding && !c.reduceScatterEmbeddings;
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
    // finalize_model_grads' TP step: the parameters' sequence_parallel tags decide what it sums.
    auto finalize = [&](std::vector<Parameter*> params) {
      params.erase(std::remove(params.begin(), params.end(), nullptr), params.end());
      finalizeSequenceParallelGrads(params, pg.tp(), mp.sequenceParallel);
    };
    // GTP_remat peers are data parallel: peer g takes batch block g (b is dim 1 of (s, b, ·)).
    auto batch = [&](const HostTensor& h, int dim) { return G > 1 ? chunk(h, dim, g, G) : h; };
    const HostTensor input = batch(in.at("input"), c.layer == LayerKind::kEmbedding ? 0 : 1);
    const HostTensor dyFull = batch(in.at("grad_output"), embeddingBatchFirst ? 0 : 1);
    auto put = [&](const std::string& name, ConstView v) { per.put(r, name, fromBackend(compute, v)); };
    // A weight's TP-local rows, or under GTP_remat this peer's rows of them padded (SPEC 4.2).
    auto setWeight = [&](Parameter& p, const HostTensor& tpLocal, const std::string& text) {
      if (!isGtpShard(p)) {
        setShard(compute, p, tpLocal, c);
        per.shard(r, text);
        return;
      }
      const std::int64_t rows = p.data.shape()[0], dLog = tpLocal.shape[0];
      const std::int64_t begin = std::min(g * rows, dLog), end = std::min((g + 1) * rows, dLog);
      HostTensor shard = slice(tpLocal, 0, begin, end);
      HostTensor pad{shard.shape, shard.dtype, {}};
      pad.shape[0] = rows - (end - begin);
      pad.values.assign(std::size_t(pad.numel()), 0.0);
      shard = concat({shard, pad}, 0);
      compute.copy(toBackend(compute, shard), p.data);
      p.mainGrad = compute.zeros(p.data.shape(), c.mainGradDtype);
      per.shard(r, detail::concat(text, "; GTP_remat rank ", g, " of ", G, " keeps rows [", g * rows, ", ",
                                  (g + 1) * rows, ") of it padded by ", *p.attrs.padLength, " to ", rows * G,
                                  ": ", shard.shapeStr()));
    };
    // Once the parameters are set: this rank's chunks read from, or added to, the checkpoint.
    auto checkpoint = [&](const ShardedStateDict& sd, const std::map<std::string, Parameter*>& params) {
      if (!hooks.load && !hooks.save) return;
      if (hooks.load)
        for (const ShardedEntry& e : sd) {
          if (const auto* o = std::get_if<ShardedObject>(&e)) {
            hooks.load->checkObject(*o);
          } else {
            const auto& st = std::get<ShardedTensor>(e);
            hooks.load->load(st, params.at(st.key)->data, compute);
          }
        }
      if (hooks.save) hooks.save->add(r, sd, compute);
    };
    auto joined = [](ShardedStateDict a, const ShardedStateDict& b) {
      a.insert(a.end(), b.begin(), b.end());
      return a;
    };
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
        const HostTensor& w = in.at("weight");
        ColumnParallelLinear layer(lc, mp, w.shape[1], w.shape[0], unused, o);
        const auto rows = ownedRanges(w.shape[0], T, c.stride, t);
        const HostTensor wLocal = take(w, 0, rows);
        setWeight(*layer.weight(), wLocal, describe("weight", wLocal, w, 0, rows));
        if (c.bias) {
          const HostTensor bShard = take(in.at("bias"), 0, rows);
          setShard(compute, *layer.bias(), bShard, c);
          per.shard(r, describe("bias", bShard, in.at("bias"), 0, rows));
        }
        checkpoint(shardedStateDict(layer, "", {}, pg.tp(), &pg.dpCpGtp()),
                   {{"weight", layer.weight()}, {"bias", layer.bias()}});
        const HostTensor x = c.sequenceParallel ? chunk(input, 0, t, T) : input;
        Tensor xt = toBackend(compute, x);
        LayerOutput out = layer.forward(xt);
        // A gathered output is in rank order, each rank's interleaved chunks in turn: give the
        // layer dY in that order (it splits dY contiguously).
        const HostTensor dy = c.gatherOutput ? rankOrder(dyFull, -1, w.shape[0], T, c.stride) : take(dyFull, -1, rows);
        Tensor dyt = toBackend(compute, dy);
        Tensor dBias;
        if (out.outputBias) {  // the caller's use of the returned bias: y = output + b
          compute.addBias(out.outputBias->data, out.output);
          dBias = sumRowsOf(compute, dyt, c.dtype);
        }
        Tensor dx = layer.backward(dyt, dBias.defined() ? ConstView(dBias) : ConstView());
        reducer.drain();
        finalize({layer.weight(), layer.bias()});
        put("output", out.output);
        put("input.grad", dx);
        per.put(r, "weight.grad", gradOf(compute, *layer.weight()));
        if (c.bias) per.put(r, "bias.grad", gradOf(compute, *layer.bias()));
        break;
      }
      case LayerKind::kRow: {
        RowParallelOptions o;
        o.bias = c.bias;
        o.inputIsParallel = c.inputIsParallel;
        o.skipBiasAdd = c.skipBiasAdd;
        o.stride = c.stride;
        o.name = "row";
        const HostTensor& w = in.at("weight");
        RowParallelLinear layer(lc, mp, w.shape[1], w.shape[0], unused, o);
        const auto cols = ownedRanges(w.shape[1], T, c.stride, t);
        const HostTensor wLocal = take(w, 1, cols);
        setWeight(layer.weight(), wLocal, describe("weight", wLocal, w, 1, cols));
        if (c.bias) {
          setShard(compute, *layer.bias(), in.at("bias"), c);
          per.shard(r, "bias " + in.at("bias").shapeStr() + " replicated");
        }
        checkpoint(shardedStateDict(layer, "", {}, pg.tp(), &pg.dpCpGtp()),
                   {{"weight", &layer.weight()}, {"bias", layer.bias()}});
        const HostTensor x = c.inputIsParallel ? take(input, -1, cols) : input;
        Tensor xt = toBackend(compute, x);
        LayerOutput out = layer.forward(xt);
        Tensor dyt = toBackend(compute, c.sequenceParallel ? chunk(dyFull, 0, t, T) : dyFull);
        Tensor dBias;
        if (out.outputBias) {
          compute.addBias(out.outputBias->data, out.output);
          dBias = sumRowsOf(compute, dyt, c.dtype);
        }
        Tensor dx = layer.backward(dyt, dBias.defined() ? ConstView(dBias) : ConstView());
        reducer.drain();
        finalize({&layer.weight(), layer.bias()});
        put("output", out.output);
        put("input.grad", dx);
        per.put(r, "weight.grad", gradOf(compute, layer.weight()));
        if (c.bias) per.put(r, "bias.grad", gradOf(compute, *layer.bias()));
        break;
      }
      case LayerKind::kEmbedding: {
        const HostTensor& w = in.at("weight");
        VocabParallelEmbeddingOptions o;
        o.reduceScatterEmbeddings = c.reduceScatterEmbeddings;
        ModelParallelConfig emp = mp;
        emp.sequenceParallel = false;  // the embedding's sequence parallelism is reduce_scatter_embeddings
        VocabParallelEmbedding layer(lc, emp, w.shape[0], w.shape[1], unused, o);
        const auto rows = ownedRanges(w.shape[0], T, 1, t);
        const HostTensor wLocal = take(w, 0, rows);
        setWeight(layer.weight(), wLocal, describe("weight", wLocal, w, 0, rows));
        checkpoint(shardedStateDict(layer, "", {}, pg.tp(), &pg.dpCpGtp()), {{"weight", &layer.weight()}});
        Tensor ids = toBackend(compute, input);
        Tensor y = layer.forward(ids);
        layer.backward(toBackend(compute, c.reduceScatterEmbeddings ? chunk(dyFull, 0, t, T) : dyFull));
        reducer.drain();
        finalize({&layer.weight()});
        put("output", y);
        per.put(r, "weight.grad", gradOf(compute, layer.weight()));
        break;
      }
      case LayerKind::kMlp: {
        const HostTensor &w1 = in.at("fc1.weight"), &w2 = in.at("fc2.weight");
        ColumnParallelOptions o1;
        o1.name = "fc1";
        RowParallelOptions o2;
        o2.inputIsParallel = true;
        o2.name = "fc2";
        ColumnParallelLinear fc1(lc, mp, w1.shape[1], w1.shape[0], unused, o1);
        RowParallelLinear fc2(lc, mp, w2.shape[1], w2.shape[0], unused, o2);
        const auto rows = ownedRanges(w1.shape[0], T, 1, t);
        const HostTensor w1s = take(w1, 0, rows), b1s = take(in.at("fc1.bias"), 0, rows), w2s = take(w2, 1, rows);
        setWeight(*fc1.weight(), w1s, describe("fc1.weight", w1s, w1, 0, rows));
        setShard(compute, *fc1.bias(), b1s, c);
        setWeight(fc2.weight(), w2s, describe("fc2.weight", w2s, w2, 1, rows));
        setShard(compute, *fc2.bias(), in.at("fc2.bias"), c);
        per.shard(r, describe("fc1.bias", b1s, in.at("fc1.bias"), 0, rows));
        per.shard(r, "fc2.bias " + in.at("fc2.bias").shapeStr() + " replicated");
        checkpoint(joined(shardedStateDict(fc1, "fc1.", {}, pg.tp(), &pg.dpCpGtp()),
                          shardedStateDict(fc2, "fc2.", {}, pg.tp(), &pg.dpCpGtp())),
                   {{"fc1.weight", fc1.weight()}, {"fc1.bias", fc1.bias()}, {"fc2.weight", &fc2.weight()},
                    {"fc2.bias", fc2.bias()}});
        Tensor xt = toBackend(compute, c.sequenceParallel ? chunk(input, 0, t, T) : input);
        Tensor h = fc1.forward(xt).output;  // (s, b, F/T)
        Tensor a = compute.empty(h.shape(), h.dtype());
        compute.gelu(h, a);
        Tensor y = fc2.forward(a).output;  // (s, b, h), or (s/T, b, h) under SP
        Tensor dA = fc2.backward(toBackend(compute, c.sequenceParallel ? chunk(dyFull, 0, t, T) : dyFull));
        Tensor dH = compute.empty(h.shape(), h.dtype());
        compute.geluBackward(h, dA, dH);
        Tensor dx = fc1.backward(dH);
        reducer.drain();
        finalize({fc1.weight(), fc1.bias(), &fc2.weight(), fc2.bias()});
        put("output", y);
        put("input.grad", dx);
        per.put(r, "fc1.weight.grad", gradOf(compute, *fc1.weight()));
        per.put(r, "fc1.bias.grad", gradOf(compute, *fc1.bias()));
        per.put(r, "fc2.weight.grad", gradOf(compute, fc2.weight()));
        per.put(r, "fc2.bias.grad", gradOf(compute, *fc2.bias()));
        break;
      }
    }
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

  // Back to the unsharded layout: first across the GTP_remat peers of each TP rank t (global
  // rank t + T·g), then across TP as without GTP_remat.
  RunResult r;
  r.shards = per.shards;
  r.trace = world->trace();
  r.records = std::move(records);
  auto peers = [&](const std::string& name, int t) {
    std::vector<HostTensor> out;
    for (int g = 0; g < G; ++g) out.push_back(per.results[t + T * g].at(name));
    return out;
  };
  // Activations: the peers' batch blocks side by side.
  auto batchT = [&](const std::string& name, int dim) {
    std::vector<HostTensor> out;
    for (int t = 0; t < T; ++t) out.push_back(concat(peers(name, t), dim));
    return out;
  };
  // GTP_remat weights: the peers' shards stacked, padding stripped back to dLog rows.
  auto shardsT = [&](const std::string& name, std::int64_t dLog) {
    std::vector<HostTensor> out;
    for (int t = 0; t < T; ++t) out.push_back(G > 1 ? slice(concat(peers(name, t), 0), 0, 0, dLog) : peers(name, t)[0]);
    return out;
  };
  // Replicated parameters: finalize reduces them over the peers, MEAN or SUM like the shards.
  auto replicatedT = [&](const std::string& name) {
    std::vector<HostTensor> out;
    for (int t = 0; t < T; ++t) {
      HostTensor total = sum(peers(name, t));
      if (c.gtpReduceMean)
        for (double& v : total.values) v /= double(G);
      out.push_back(std::move(total));
    }
    return out;
  };
  const bool sp = c.sequenceParallel;
  const int batchDim = embeddingBatchFirst ? 0 : 1;
  auto activation = [&](const std::string& name, bool splitOverTp) {
    auto perT = batchT(name, batchDim);
    return splitOverTp ? concat(perT, 0) : perT[0];
  };
  // Each TP rank's own activation, stacked along a new dim 0.
  auto stacked = [&](const std::string& name) {
    auto perT = batchT(name, batchDim);
    for (HostTensor& h : perT) h.shape.insert(h.shape.begin(), 1);
    return concat(perT, 0);
  };
  switch (c.layer) {
    case LayerKind::kColumn: {
      const std::int64_t n = in.at("weight").shape[0];
      // Gathered or not, each rank's block of the last dim holds its interleaved rows.
      std::vector<HostTensor> outputs = batchT("output", batchDim);
      if (c.gatherOutput) {
        HostTensor gathered = outputs[0];
        outputs.clear();
        for (int t = 0; t < T; ++t) outputs.push_back(chunk(gathered, -1, t, T));
      }
      r.results["output"] = place(outputs, -1, n, c.stride);
      r.results["input.grad"] = c.disableGradReduce ? stacked("input.grad") : activation("input.grad", sp);
      r.results["weight.grad"] = place(shardsT("weight.grad", n / T), 0, n, c.stride);
      if (c.bias) r.results["bias.grad"] = place(replicatedT("bias.grad"), 0, n, c.stride);
      break;
    }
    case LayerKind::kRow: {
      const std::int64_t k = in.at("weight").shape[1], n = in.at("weight").shape[0];
      r.results["output"] = activation("output", sp);
      r.results["input.grad"] = c.inputIsParallel ? place(batchT("input.grad", 1), -1, k, c.stride)
                                                  : batchT("input.grad", 1)[0];
      r.results["weight.grad"] = place(shardsT("weight.grad", n), 1, k, c.stride);
      if (c.bias) r.results["bias.grad"] = replicatedT("bias.grad")[0];
      break;
    }
    case LayerKind::kEmbedding: {
      const std::int64_t v = in.at("weight").shape[0];
      r.results["output"] = activation("output", c.reduceScatterEmbeddings);
      r.results["weight.grad"] = concat(shardsT("weight.grad", v / T), 0);
      break;
    }
    case LayerKind::kMlp: {
      const std::int64_t f = in.at("fc1.weight").shape[0], h = in.at("fc2.weight").shape[0];
      r.results["output"] = activation("output", sp);
      r.results["input.grad"] = activation("input.grad", sp);
      r.results["fc1.weight.grad"] = concat(shardsT("fc1.weight.grad", f / T), 0);
      r.results["fc1.bias.grad"] = concat(replicatedT("fc1.bias.grad"), 0);
      r.results["fc2.weight.grad"] = concat(shardsT("fc2.weight.grad", h), 1);
      r.results["fc2.bias.grad"] = replicatedT("fc2.bias.grad")[0];
      break;
    }
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
  s += detail::concat(" --seq ", c.seq, " --batch ", c.batch);
  switch (c.layer) {
    case LayerKind::kColumn:
    case LayerKind::kRow: return s + detail::concat(" --in-features ", c.inFeatures, " --out-features ", c.outFeatures);
    case LayerKind::kEmbedding: return s + detail::concat(" --out-features ", c.outFeatures, " --vocab ", c.vocab);
    case LayerKind::kMlp: return s + detail::concat(" --in-features ", c.inFeatures, " --ffn-hidden ", c.ffnHidden);
  }
  return s;
}

}  // namespace tpsim::tools
