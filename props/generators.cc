#include "props/generators.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <numeric>
#include <random>
#include <set>
#include <sstream>

#include "core/gtp.h"

namespace tpsim::props {
namespace {

using tools::HostTensor;
using tools::makeHost;

// Extents where a layer does not need divisibility: 1, primes, a power of two.
const std::vector<std::int64_t> kAnyExtent = {1, 2, 3, 5, 7, 8, 11, 16};
// Multipliers of a divisible extent (extent = T·stride·q).
const std::vector<std::int64_t> kMultiplier = {1, 2, 3, 5};

rc::Gen<std::int64_t> anyExtent() { return pick(kAnyExtent); }
rc::Gen<std::int64_t> multiple(std::int64_t of) {
  return rc::gen::map(pick(kMultiplier), [of](std::int64_t q) { return of * q; });
}
// A value of `of`·q + r with 0 < r < of: not divisible by `of` (which must be >= 2).
rc::Gen<std::int64_t> nonMultiple(std::int64_t of) {
  return rc::gen::exec([of] { return of * *pick<std::int64_t>({0, 1, 2}) +
                                     *uniform<std::int64_t>(1, of); });
}

std::vector<std::int64_t> divisorsOf(int n) {
  std::vector<std::int64_t> d;
  for (int i = 1; i <= n; ++i)
    if (n % i == 0) d.push_back(i);
  return d;
}

HostTensor integers(std::vector<std::int64_t> shape, DType dtype, int amplitude) {
  std::int64_t n = 1;
  for (std::int64_t d : shape) n *= d;
  // 0, 1, -1, 2, -2, ...: shrinks towards 0, so a counterexample keeps only the values that matter.
  const auto zigzag = rc::gen::map(uniform<int>(0, 2 * amplitude + 1), [](int i) { return i % 2 ? (i + 1) / 2 : -i / 2; });
  const auto v = *rc::gen::container<std::vector<int>>(std::size_t(n), zigzag);
  return makeHost(std::move(shape), dtype, std::vector<double>(v.begin(), v.end()));
}

const std::vector<const LayerKind*>& kAllKinds = tools::layerKinds();

// The kinds that take, or do not take, an option: the cases an option's checks apply to.
std::vector<const LayerKind*> kindsTaking(LayerOption option, bool taking = true) {
  std::vector<const LayerKind*> out;
  for (const LayerKind* k : tools::layerKinds())
    if (k->takes(option) == taking) out.push_back(k);
  return out;
}
std::vector<const LayerKind*> kindsWithout(LayerOption option) { return kindsTaking(option, false); }

}  // namespace

rc::Gen<int> pickIndex(int n) {
  std::vector<int> all(std::size_t(n), 0);
  for (int i = 0; i < n; ++i) all[std::size_t(i)] = i;
  return pick(all);
}

std::vector<double> seededIntegers(std::uint64_t seed, std::int64_t count, int amplitude) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> value(-amplitude, amplitude);
  std::vector<double> v(static_cast<std::size_t>(count));
  for (double& x : v) x = value(rng);
  return v;
}

const char* numericsName(Numerics numerics) { return numerics == Numerics::kExact ? "exact" : "real"; }

rc::Gen<int> genTp() {
  return pick<int>({1, 2, 2, 3, 4, 4, 1, 2, 3, 4, 5, 6, 7, 8, 8, 16});
}
rc::Gen<int> genTpAbove1() {
  return pick<int>({2, 2, 3, 4, 4, 2, 3, 4, 5, 6, 7, 8, 8, 16});
}
rc::Gen<DType> genFloatDtype() { return pick<DType>({DType::kFloat32, DType::kBFloat16, DType::kFloat16}); }

std::vector<const LayerKind*> exactKinds() {
  std::vector<const LayerKind*> out;
  for (const LayerKind* k : tools::layerKinds())
    if (k->exactOnSmallIntegers()) out.push_back(k);
  return out;
}

rc::Gen<RunConfig> genRunConfig(const std::vector<const LayerKind*>& kinds, rc::Gen<int> tpGen, GtpMode gtp,
                                Numerics numerics) {
  return rc::gen::exec([kinds, tpGen, gtp, numerics] {
    RunConfig c;
    c.layer = *pick(kinds);
    auto takes = [&](LayerOption o) { return c.layer->takes(o); };
    c.tp = *tpGen;
    c.dtype = *genFloatDtype();
    c.seed = *genSeed();
    const int T = c.tp;
    c.sequenceParallel = T > 1 && takes(LayerOption::kSequenceParallel) && *flag();
    if (takes(LayerOption::kBias)) c.bias = *flag();
    if (takes(LayerOption::kStride)) c.stride = *pick<int>({1, 2, 3});
    if (takes(LayerOption::kGatherOutput)) c.gatherOutput = !c.sequenceParallel && *flag();
    if (takes(LayerOption::kSkipBiasAdd)) c.skipBiasAdd = c.bias && !c.gatherOutput && *flag();
    if (takes(LayerOption::kOutputDtype))
      c.outputDtype = *pick<std::optional<DType>>({std::nullopt, DType::kFloat32, DType::kBFloat16, DType::kFloat16});
    if (takes(LayerOption::kDisableGradReduce))
      c.disableGradReduce = !c.sequenceParallel && *pick<bool>({false, false, true});
    // Sequence parallelism needs the input already split, and so does a stride (the layer's own
    // scatter of the input is contiguous).
    if (takes(LayerOption::kInputIsParallel)) c.inputIsParallel = c.sequenceParallel || c.stride > 1 || *flag();
    if (takes(LayerOption::kGradAccumulationFusion)) {
      c.gradAccumulationFusion = *flag();
      if (c.gradAccumulationFusion && c.dtype == DType::kBFloat16)
        c.mainGradDtype = *pick<DType>({DType::kFloat32, DType::kBFloat16});
    }
    if (takes(LayerOption::kReduceScatterEmbeddings)) c.reduceScatterEmbeddings = *flag();
    // Every size as its kind's rules need it: divisible where a split or cut needs it, anything
    // (1, primes, powers of two) elsewhere.
    using D = SizeSpec::Divisor;
    const bool seqSplit = c.sequenceParallel || c.reduceScatterEmbeddings;
    for (const SizeSpec& size : c.layer->sizes()) {
      std::int64_t& v = c.*size.field;
      switch (size.divisor) {
        case D::kSequenceSplit: v = seqSplit ? T * *pick<std::int64_t>({1, 2, 3}) : *pick<std::int64_t>({1, 2, 3, 5, 7, 8}); break;
        case D::kGtpRemat: v = *pick<std::int64_t>({1, 2, 3}); break;
        case D::kTp: v = *multiple(T); break;
        case D::kTpStride: v = *multiple(std::int64_t(T) * c.stride); break;
        case D::kNone: v = *anyExtent(); break;
      }
    }
    if (gtp == GtpMode::kOff || (gtp == GtpMode::kSometimes && !*pick<bool>({false, false, true}))) return c;
    return *genWithGtp(c, {2, 2, 4, 3, 8, 5, 6, 7}, numerics);
  });
}

rc::Gen<RunConfig> genWithGtp(RunConfig base, std::vector<int> gtpSizes, Numerics numerics) {
  return rc::gen::exec([base, gtpSizes, numerics] {
    RunConfig c = base;
    const int T = c.tp;
    // MEAN (Megatron's default) or SUM; exact data need MEAN's 1/G to be a power of two.
    c.gtpReduceMean = !*flag();
    std::vector<int> sizes = gtpSizes;
    if (numerics == Numerics::kExact && c.gtpReduceMean) {
      sizes.erase(std::remove_if(sizes.begin(), sizes.end(), [](int g) { return (g & (g - 1)) != 0; }), sizes.end());
      if (sizes.empty()) sizes = {1};
    }
    int G = *pick(sizes);
    while (T * G > 32) G = (G & (G - 1)) == 0 || G % 2 == 0 ? G / 2 : G - 1;  // cost: at most 32 ranks
    c.gtpRemat = G;
    c.fp32AccumReduceScatter = *flag();
    for (const SizeSpec& size : c.layer->sizes())  // the peers split the batch (the experts' tokens)
      if (size.divisor == SizeSpec::Divisor::kGtpRemat) c.*size.field = G * *pick<std::int64_t>({1, 2});
    if (G > 1 && *flag()) {  // make every GTP weight's TP-local dim 0 a multiple of G, so that a = 0 is valid
      std::set<std::string> scaled;
      for (const GtpWeightSpec& w : c.layer->gtpWeights())
        if (scaled.insert(w.symbol).second) c.*tools::sizeNamed(c, w.symbol).field *= G;
    }
    bool divisible = true;
    for (std::int64_t d : gtpDims(c)) divisible = divisible && d % G == 0;
    c.padForAlignment = divisible ? *pick<int>({16, 0, 1, 0, 32}) : *pick<int>({16, 1, 32});
    return c;
  });
}

std::vector<std::int64_t> gtpDims(const RunConfig& c) {
  std::vector<std::int64_t> dims;
  for (const GtpWeightSpec& w : c.layer->gtpWeights())
    dims.push_back(tools::sizeValue(c, w.symbol) / (w.tpCutsDim0 ? c.tp : 1));
  return dims;
}

std::string gtpSummary(const RunConfig& c) {
  if (c.gtpRemat <= 1) return "";
  std::ostringstream os;
  os << "GTP_remat G=" << c.gtpRemat << " a=" << c.padForAlignment << (c.gtpReduceMean ? " MEAN" : " SUM")
     << (c.fp32AccumReduceScatter ? " fp32-accum" : "") << ":";
  const std::vector<GtpWeightSpec>& weights = c.layer->gtpWeights();
  const std::vector<std::int64_t> dims = gtpDims(c);
  for (std::size_t i = 0; i < dims.size(); ++i) {
    os << " " << weights[i].name << " Dlog=" << dims[i];
    if (c.padForAlignment == 0 && dims[i] % c.gtpRemat != 0) {
      os << " (not divisible by G)";
      continue;
    }
    const GtpShardGeometry geo = gtpRematShardDim0(dims[i], c.gtpRemat, c.padForAlignment);
    os << " -> S=" << geo.rows << " rows per peer, pad " << geo.padLength << ";";
  }
  os << " each peer takes b/G = " << c.batch / c.gtpRemat << " of the b = " << c.batch << " samples";
  return os.str();
}

std::int64_t exactLimit(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16: return 256;
    case DType::kFloat16: return 2048;
    default: return std::int64_t(1) << 24;  // fp32 data, fp32 accumulators
  }
}

std::int64_t exactLimit(const RunConfig& c) {
  std::int64_t limit = exactLimit(c.dtype);
  if (c.outputDtype) limit = std::min(limit, exactLimit(*c.outputDtype));
  if (c.gradAccumulationFusion) limit = std::min(limit, exactLimit(c.mainGradDtype));
  return limit;
}

int exactAmplitude(const RunConfig& c) {
  const std::int64_t terms = c.layer->longestSum(c);  // the longest sum any result element is
  const std::int64_t limit = exactLimit(c);
  int a = int(std::floor(std::sqrt(double(limit) / double(terms))));
  while (std::int64_t(a) * a * terms > limit) --a;  // guard the floating-point sqrt
  return std::clamp(a, 1, 64);  // 64 is plenty of bits to exercise in fp32; 1 still fits 16-bit
}

rc::Gen<TensorMap> genExactInputs(const RunConfig& c) { return genExactInputs(c, exactAmplitude(c)); }

rc::Gen<TensorMap> genExactInputs(const RunConfig& c, int a) {
  return rc::gen::exec([c, a] {
    const ShapeMap shapes = tools::tensorShapes(c);
    TensorMap m;
    for (const TensorSpec& t : c.layer->tensors(c)) {
      const std::vector<std::int64_t>& shape = shapes.at(t.name);
      if (t.idRange.empty()) {  // the MLP has no exact mode (GeLU), but integer inputs still make a readable case
        m[t.name] = integers(shape, c.dtype, a);
        continue;
      }
      std::int64_t n = 1;
      for (std::int64_t d : shape) n *= d;
      const auto ids = *rc::gen::container<std::vector<std::int64_t>>(
          std::size_t(n), uniform<std::int64_t>(0, tools::sizeValue(c, t.idRange)));
      m[t.name] = makeHost(shape, DType::kInt64, std::vector<double>(ids.begin(), ids.end()));
    }
    return m;
  });
}

TensorMap realInputs(const RunConfig& c) { return tools::hostOf(tools::generateInputs(c)); }

std::string shapesOf(const RunConfig& c) {
  std::ostringstream os;
  for (const SizeSpec& size : c.layer->sizes()) os << (os.tellp() > 0 ? " " : "") << size.symbol << "=" << c.*size.field;
  return os.str();
}

// ---- Topologies -----------------------------------------------------------------------------

rc::Gen<Topology> genTopology(int maxWorld, bool withGtp) {
  return rc::gen::exec([maxWorld, withGtp] {
    Topology t;
    t.tp = *pick<int>({1, 2, 4, 3, 8, 5, 6, 7});
    t.cp = *pick<int>({1, 2});
    t.pp = *pick<int>({1, 2});
    if (withGtp) t.gtp = *pick<int>({1, 2, 2, 4, 3});
    if (t.tp * t.gtp * t.cp * t.pp > maxWorld) t.cp = t.pp = 1;
    if (t.tp * t.gtp > maxWorld) t.gtp = 1;
    if (t.tp > maxWorld) t.tp = 1;
    std::vector<int> dps;
    for (int d = 1; d <= std::min(8, maxWorld / (t.tp * t.gtp * t.cp * t.pp)); ++d) dps.push_back(d);
    t.dp = *pick(dps);
    // The expert grid (ET, E, EG, ED, P) must tile the same world: ET·E·EG divides W/P.
    const int perStage = t.world() / t.pp;
    t.expertTp = int(*pick(divisorsOf(perStage)));
    t.ep = int(*pick(divisorsOf(perStage / t.expertTp)));
    if (withGtp) t.expertGtp = int(*pick(divisorsOf(perStage / (t.expertTp * t.ep))));
    if (t.gtp == 1 && t.expertGtp == 1) {
      const int expertDp = perStage / (t.expertTp * t.ep);
      std::vector<int> instances;
      for (auto d : divisorsOf(std::gcd(t.dp * t.cp, expertDp))) instances.push_back(int(d));
      t.distOptInstances = *pick(instances);
    }
    std::vector<std::string> axes = {"tp", "cp", "ep", "dp"};
    const int rotation = *pickIndex(4);
    const bool swapFirstTwo = *flag();
    std::rotate(axes.begin(), axes.begin() + rotation, axes.end());
    if (swapFirstTwo) std::swap(axes[0], axes[1]);
    t.order = axes[0] + "-" + axes[1] + "-" + axes[2] + "-" + axes[3] + "-pp";
    return t;
  });
}

ParallelSizes sizesOf(const Topology& t) {
  ParallelSizes s;
  s.world = t.world();
  s.tp = t.tp;
  s.cp = t.cp;
  s.pp = t.pp;
  s.ep = t.ep;
  s.expertTp = t.expertTp;
  s.gtpRemat = t.gtp;
  s.expertGtpRemat = t.expertGtp;
  s.distOptInstances = t.distOptInstances;
  s.order = t.order;
  return s;
}

// ---- Invalid configurations -----------------------------------------------------------------

rc::Gen<InvalidRunConfig> genInvalidRunConfig() {
  using O = LayerOption;
  return rc::gen::exec([]() -> InvalidRunConfig {
    switch (*pickIndex(20)) {
      case 0: {
        RunConfig c = *genRunConfig(kAllKinds);
        c.tp = *pick<int>({0, -1, 65, 128});
        return {c, "--tp: expected 1..64, got " + std::to_string(c.tp)};
      }
      case 1: {
        RunConfig c = *genRunConfig(kindsTaking(O::kSequenceParallel), genTpAbove1());
        c.tp = 1;
        c.sequenceParallel = true;
        c.gatherOutput = c.disableGradReduce = false;
        if (c.layer->takes(O::kInputIsParallel)) c.inputIsParallel = true;
        return {c, "--sequence-parallel: needs --tp > 1, got --tp 1"};
      }
      case 2: {
        RunConfig c = *genRunConfig(kindsWithout(O::kStride));
        c.stride = *pick<int>({2, 3});
        return {c, std::string("--stride: applies to --layer column or row, got --layer ") + c.layer->name()};
      }
      case 3: {
        RunConfig c = *genRunConfig(kAllKinds);
        c.stride = *pick<int>({0, -1});
        return {c, "--stride: expected >= 1, got " + std::to_string(c.stride)};
      }
      case 4: {
        RunConfig c = *genRunConfig(kindsWithout(O::kOutputDtype));
        c.outputDtype = *genFloatDtype();
        return {c, std::string("--output-dtype: only ColumnParallelLinear has output_dtype, got --layer ") +
                       c.layer->name()};
      }
      case 5: {
        RunConfig c = *genRunConfig(kindsWithout(O::kGatherOutput));
        c.gatherOutput = true;
        return {c, "--gather-output: applies to --layer column"};
      }
      case 6: {
        RunConfig c = *genRunConfig(kindsWithout(O::kInputIsParallel));
        c.inputIsParallel = true;
        return {c, "--input-is-parallel: applies to --layer row"};
      }
      case 7: {
        RunConfig c = *genRunConfig(kindsWithout(O::kReduceScatterEmbeddings));
        c.reduceScatterEmbeddings = true;
        return {c, "--reduce-scatter-embeddings: applies to --layer embedding"};
      }
      case 8: {
        RunConfig c = *genRunConfig({layerKind("row")}, genTpAbove1());
        c.sequenceParallel = true;
        c.inputIsParallel = false;
        return {c, "--sequence-parallel: RowParallelLinear needs --input-is-parallel with it"};
      }
      case 9: {
        RunConfig c = *genRunConfig({layerKind("embedding")}, genTpAbove1());
        c.sequenceParallel = true;
        return {c, "--sequence-parallel: the embedding's sequence parallelism is --reduce-scatter-embeddings"};
      }
      case 10: {
        RunConfig c = *genRunConfig(kindsTaking(O::kGatherOutput), genTpAbove1());
        c.sequenceParallel = c.gatherOutput = true;
        c.skipBiasAdd = c.disableGradReduce = false;
        return {c, "--gather-output: not with --sequence-parallel"};
      }
      case 11: {
        RunConfig c = *genRunConfig(kAllKinds);
        if (c.layer->takes(O::kSkipBiasAdd)) c.bias = false;
        c.skipBiasAdd = true;
        return {c, "--skip-bias-add: needs --bias and --layer column or row"};
      }
      case 12: {
        RunConfig c = *genRunConfig(kindsTaking(O::kGatherOutput));
        c.sequenceParallel = false;
        c.bias = c.gatherOutput = c.skipBiasAdd = true;
        return {c, "--skip-bias-add: not with --gather-output"};
      }
      case 13: {
        RunConfig c = *genRunConfig({layerKind("embedding")});
        c.gradAccumulationFusion = true;
        return {c, "--grad-accumulation-fusion: the embedding has no fused wgrad path"};
      }
      case 14: {
        RunConfig c = *genRunConfig(kAllKinds);
        c.dtype = *pick<DType>({DType::kInt64, DType::kFloat64});
        return {c, std::string("--dtype: expected fp32, bf16 or fp16, got ") + dtypeName(c.dtype)};
      }
      case 15: {
        RunConfig c = *genRunConfig(kAllKinds);
        c.mainGradDtype = *pick<DType>({DType::kFloat16, DType::kFloat64, DType::kInt64});
        return {c, std::string("--main-grad-dtype: expected fp32 or bf16, got ") + dtypeName(c.mainGradDtype)};
      }
      case 16: {
        RunConfig c = *genRunConfig(kindsTaking(O::kGradAccumulationFusion));
        c.dtype = *pick<DType>({DType::kFloat32, DType::kFloat16});
        c.gradAccumulationFusion = true;
        c.mainGradDtype = DType::kBFloat16;
        return {c, std::string("--main-grad-dtype bf16: needs --dtype bf16 (the 16-bit fused kernel), got --dtype ") +
                       dtypeName(c.dtype)};
      }
      case 17: {
        RunConfig c = *genRunConfig(kindsWithout(O::kDisableGradReduce));
        c.disableGradReduce = true;
        return {c, "--disable-grad-reduce: applies to --layer column"};
      }
      case 18: {
        RunConfig c = *genRunConfig(kindsTaking(O::kDisableGradReduce), genTpAbove1());
        c.sequenceParallel = c.disableGradReduce = true;
        c.gatherOutput = false;
        return {c, "--disable-grad-reduce: not with --sequence-parallel"};
      }
      default: {
        RunConfig c = *genRunConfig(kAllKinds);
        const std::int64_t bad = *pick<std::int64_t>({0, -1, -7});
        const int which = *pickIndex(6);
        std::int64_t* fields[] = {&c.seq, &c.batch, &c.inFeatures, &c.outFeatures, &c.ffnHidden, &c.vocab};
        const char* flags[] = {"seq", "batch", "in-features", "out-features", "ffn-hidden", "vocab"};
        *fields[which] = bad;
        return {c, std::string("--") + flags[which] + ": expected >= 1, got " + std::to_string(bad)};
      }
    }
  });
}

rc::Gen<InvalidRunInputs> genInvalidRunInputs() {
  return rc::gen::exec([]() -> InvalidRunInputs {
    auto str = [](std::int64_t v) { return std::to_string(v); };
    switch (*pickIndex(10)) {
      case 0: {  // column: N not divisible by T·stride
        RunConfig c = *genRunConfig({layerKind("column")}, genTpAbove1());
        c.outFeatures = *nonMultiple(std::int64_t(c.tp) * c.stride);
        return {c, realInputs(c), "tpsim run: N (weight.npy dim 0) = " + str(c.outFeatures) +
                                       " must be divisible by --tp x --stride = " + str(c.tp * c.stride)};
      }
      case 1: {  // row: K not divisible by T·stride
        RunConfig c = *genRunConfig({layerKind("row")}, genTpAbove1());
        c.inFeatures = *nonMultiple(std::int64_t(c.tp) * c.stride);
        // input_is_parallel would cut K itself; the runner checks K first either way.
        return {c, realInputs(c), "tpsim run: K (weight.npy dim 1) = " + str(c.inFeatures) +
                                       " must be divisible by --tp x --stride = " + str(c.tp * c.stride)};
      }
      case 2: {  // sequence parallelism: s not divisible by T
        RunConfig c = *genRunConfig(kindsTaking(LayerOption::kSequenceParallel), genTpAbove1());
        c.sequenceParallel = true;
        c.gatherOutput = c.disableGradReduce = false;
        if (c.layer->takes(LayerOption::kInputIsParallel)) c.inputIsParallel = true;
        c.seq = *nonMultiple(c.tp);
        return {c, realInputs(c), "tpsim run: the sequence length s (input.npy dim 0) = " + str(c.seq) +
                                       " must be divisible by --tp = " + str(c.tp)};
      }
      case 3: {  // embedding: V not divisible by T
        RunConfig c = *genRunConfig({layerKind("embedding")}, genTpAbove1());
        c.vocab = *nonMultiple(c.tp);
        return {c, realInputs(c), "tpsim run: the vocabulary size V (weight.npy dim 0) = " + str(c.vocab) +
                                       " must be divisible by --tp = " + str(c.tp)};
      }
      case 4: {  // embedding with reduce_scatter_embeddings: s not divisible by T
        RunConfig c = *genRunConfig({layerKind("embedding")}, genTpAbove1());
        c.reduceScatterEmbeddings = true;
        c.seq = *nonMultiple(c.tp);
        return {c, realInputs(c), "tpsim run: the sequence length s (input.npy dim 1) = " + str(c.seq) +
                                       " must be divisible by --tp = " + str(c.tp)};
      }
      case 5: {  // mlp: F not divisible by T
        RunConfig c = *genRunConfig({layerKind("mlp")}, genTpAbove1());
        c.ffnHidden = *nonMultiple(c.tp);
        return {c, realInputs(c), "tpsim run: the ffn hidden size F (fc1.weight.npy dim 0) = " + str(c.ffnHidden) +
                                       " must be divisible by --tp = " + str(c.tp)};
      }
      case 6: {  // embedding: an id outside [0, V)
        RunConfig c = *genRunConfig({layerKind("embedding")});
        TensorMap in = realInputs(c);
        const std::size_t at = *uniform<std::size_t>(0, in["input"].values.size());
        const std::int64_t id = *pick<std::int64_t>({-1, c.vocab, c.vocab + 5, -100});
        in["input"].values[at] = double(id);
        return {c, in, "tpsim run: input.npy holds id " + str(id) + " at flat position " + str(std::int64_t(at)) +
                           ", outside [0, V=" + str(c.vocab) + ")"};
      }
      case 7: {  // grad_output of the wrong shape
        RunConfig c = *genRunConfig(kAllKinds);
        TensorMap in = realInputs(c);
        HostTensor& dy = in["grad_output"];
        const tools::HostTensor want = dy;
        dy.shape.back() += *pick<std::int64_t>({1, 2});
        dy.values.resize(std::size_t(dy.numel()), 0.0);  // a whole tensor, as a file of that shape holds
        return {c, in, "tpsim run: grad_output.npy must have shape " + shapeText(want.shape) + ", got " + shapeText(dy.shape)};
      }
      case 8: {  // a missing tensor
        RunConfig c = *genRunConfig(kAllKinds);
        TensorMap in = realInputs(c);
        std::vector<std::string> names;
        for (const auto& [name, t] : in) names.push_back(name);
        const std::string gone = *pick(names);
        in.erase(gone);
        return {c, in, "tpsim run: " + gone + ".npy is missing"};
      }
      default: {  // a bias of the wrong length
        RunConfig c = *genRunConfig({layerKind("column"), layerKind("row")});
        c.bias = true;
        TensorMap in = realInputs(c);
        in["bias"] = makeHost({c.outFeatures + 1}, c.dtype, std::vector<double>(std::size_t(c.outFeatures + 1), 0.5));
        return {c, in, "tpsim run: bias.npy must have shape (" + str(c.outFeatures) + ",), got (" +
                           str(c.outFeatures + 1) + ",)"};
      }
    }
  });
}

// ---- Printing -------------------------------------------------------------------------------

void showValue(const Topology& t, std::ostream& os) {
  os << "Topology{T=" << t.tp << " G=" << t.gtp << " C=" << t.cp << " P=" << t.pp << " D=" << t.dp
     << " ET=" << t.expertTp << " E=" << t.ep << " EG=" << t.expertGtp << " world=" << t.world()
     << " order=" << t.order << "}";
}

void showValue(const InvalidRunConfig& invalid, std::ostream& os) {
  os << invalid.config.str() << " " << shapesOf(invalid.config) << "\n  expected error containing: "
     << invalid.expected;
}

void showValue(const InvalidRunInputs& invalid, std::ostream& os) {
  os << invalid.config.str() << "\n  inputs:";
  for (const auto& [name, t] : invalid.inputs) os << " " << name << " " << shapeText(t.shape);
  os << "\n  expected error containing: " << invalid.expected;
}

}  // namespace tpsim::props

namespace tpsim::tools {

void showValue(const RunConfig& c, std::ostream& os) { os << c.str() << " " << props::shapesOf(c); }

void showValue(const TensorMap& tensors, std::ostream& os) {
  constexpr std::size_t kShown = 48;  // values per tensor; the .npy files of a failure hold them all
  for (const auto& [name, t] : tensors) {
    os << "\n  " << name << " " << shapeText(t.shape) << " " << dtypeName(t.dtype) << ": [";
    for (std::size_t i = 0; i < t.values.size() && i < kShown; ++i) os << (i ? " " : "") << t.values[i];
    os << (t.values.size() > kShown ? " ...]" : "]");
  }
}

}  // namespace tpsim::tools

namespace tpsim {
void showValue(DType dtype, std::ostream& os) { os << dtypeName(dtype); }
}  // namespace tpsim
