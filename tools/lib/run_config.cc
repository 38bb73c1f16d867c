#include "tools/lib/run_config.h"

#include <algorithm>

#include "backends/errors.h"
#include "core/mxfp8.h"
#include "tools/lib/layer_kind.h"

namespace tpsim::tools {
namespace {

// A setting of a RunConfig as a flag (without dashes) and its value ("" for a switch): the one
// place a field becomes text. `unit` follows the value in the "flag=value" form only.
struct Setting {
  std::string flag, value;
  std::string unit = "";
};

enum class Field {
  kLayer, kTp, kDtype, kBackend, kOutputDtype, kSequenceParallel, kBias, kGatherOutput, kInputIsParallel,
  kReduceScatterEmbeddings, kSkipBiasAdd, kDisableGradReduce, kStride, kGradAccumulationFusion, kWeightFormat,
  kGtpRemat, kThreads, kFaults, kTimeout, kSeed,
};

// What `field` adds to a description of c: nothing where it has its default value (the layer, the
// TP size, the dtype and the seed are always shown).
std::vector<Setting> settingsOf(const RunConfig& c, Field field) {
  auto on = [](bool set, const char* flag) { return set ? std::vector<Setting>{{flag, ""}} : std::vector<Setting>{}; };
  switch (field) {
    case Field::kLayer: return {{"layer", c.layer->name()}};
    case Field::kTp: return {{"tp", std::to_string(c.tp)}};
    case Field::kDtype: return {{"dtype", dtypeName(c.dtype)}};
    case Field::kBackend: return c.backend == "sim" ? std::vector<Setting>{} : std::vector<Setting>{{"backend", c.backend}};
    case Field::kOutputDtype:
      return c.outputDtype ? std::vector<Setting>{{"output-dtype", dtypeName(*c.outputDtype)}} : std::vector<Setting>{};
    case Field::kSequenceParallel: return on(c.sequenceParallel, "sequence-parallel");
    case Field::kBias: return on(c.bias, "bias");
    case Field::kGatherOutput: return on(c.gatherOutput, "gather-output");
    case Field::kInputIsParallel: return on(c.inputIsParallel, "input-is-parallel");
    case Field::kReduceScatterEmbeddings: return on(c.reduceScatterEmbeddings, "reduce-scatter-embeddings");
    case Field::kSkipBiasAdd: return on(c.skipBiasAdd, "skip-bias-add");
    case Field::kDisableGradReduce: return on(c.disableGradReduce, "disable-grad-reduce");
    case Field::kStride: return c.stride == 1 ? std::vector<Setting>{} : std::vector<Setting>{{"stride", std::to_string(c.stride)}};
    case Field::kGradAccumulationFusion:
      if (!c.gradAccumulationFusion) return {};
      return {{"grad-accumulation-fusion", ""}, {"main-grad-dtype", dtypeName(c.mainGradDtype)}};
    case Field::kWeightFormat:
      if (c.weightFormat == WeightFormat::kNative) return {};
      return {{"weight-format", weightFormatName(c.weightFormat)}};
    case Field::kGtpRemat: {
      if (c.gtpRemat <= 1) return {};
      std::vector<Setting> s{{"gtp-remat", std::to_string(c.gtpRemat)},
                             {"pad-for-alignment", std::to_string(c.padForAlignment)},
                             {"gtp-reduce", c.gtpReduceMean ? "mean" : "sum"}};
      if (c.fp32AccumReduceScatter) s.push_back({"fp32-accum-reduce-scatter", ""});
      return s;
    }
    case Field::kThreads: return c.threads == 0 ? std::vector<Setting>{} : std::vector<Setting>{{"threads", std::to_string(c.threads)}};
    case Field::kFaults: {
      std::vector<Setting> s;
      for (const Fault& f : c.faults) s.push_back({"inject", f.str()});
      return s;
    }
    case Field::kTimeout:
      if (c.timeout == RunConfig().timeout) return {};
      return {{"timeout", detail::concat(double(c.timeout.count()) / 1000), "s"}};
    case Field::kSeed: return {{"seed", std::to_string(c.seed)}};
  }
  return {};
}

std::vector<Setting> settingsOf(const RunConfig& c, std::initializer_list<Field> fields) {
  std::vector<Setting> out;
  for (Field f : fields)
    for (Setting& s : settingsOf(c, f)) out.push_back(std::move(s));
  return out;
}

// "flag=value flag" and "--flag value --flag".
std::string assignments(const std::vector<Setting>& settings) {
  std::string s;
  for (const Setting& x : settings) s += (s.empty() ? "" : " ") + x.flag + (x.value.empty() ? "" : "=" + x.value + x.unit);
  return s;
}
std::string flags(const std::vector<Setting>& settings) {
  std::string s;
  for (const Setting& x : settings) s += " --" + x.flag + (x.value.empty() ? "" : " " + x.value);
  return s;
}

// The message for an option c's layer does not take (LayerKind::takes).
std::string refusal(const RunConfig& c, LayerOption option) {
  const std::string kind = c.layer->name(), why = c.layer->whyNot(option), kinds = layerKindsTaking(option);
  switch (option) {
    case LayerOption::kSequenceParallel:
      return "--sequence-parallel: " + (why.empty() ? "applies to --layer " + kinds + ", got --layer " + kind : why);
    case LayerOption::kStride: return "--stride: applies to --layer " + kinds + ", got --layer " + kind;
    case LayerOption::kOutputDtype: return "--output-dtype: only ColumnParallelLinear has output_dtype, got --layer " + kind;
    case LayerOption::kGatherOutput: return "--gather-output: applies to --layer " + kinds;
    case LayerOption::kDisableGradReduce: return "--disable-grad-reduce: applies to --layer " + kinds;
    case LayerOption::kInputIsParallel: return "--input-is-parallel: applies to --layer " + kinds;
    case LayerOption::kReduceScatterEmbeddings: return "--reduce-scatter-embeddings: applies to --layer " + kinds;
    case LayerOption::kSkipBiasAdd: return "--skip-bias-add: needs --bias and --layer " + kinds;
    case LayerOption::kGradAccumulationFusion:
      return "--grad-accumulation-fusion: " + (why.empty() ? "applies to --layer " + kinds + ", got --layer " + kind : why);
    case LayerOption::kMxfp8Weights:
      return "--weight-format mxfp8: applies to --layer " + kinds + (why.empty() ? "" : " (" + why + ")") +
             ", got --layer " + kind;
    case LayerOption::kBias: break;  // a kind without an optional bias ignores --bias: the MLP always has its own
  }
  return "";
}

}  // namespace

RunConfig::RunConfig() : layer(layerKind("column")) {}

void applyLayerConventions(RunConfig& config) { config.layer->applyConventions(config); }

void RunConfig::validate() const {
  TPSIM_INTERNAL_ASSERT(layer != nullptr, "RunConfig without a layer kind");
  auto takes = [&](LayerOption o) { return layer->takes(o); };
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
  TPSIM_CHECK(stride == 1 || takes(LayerOption::kStride), refusal(*this, LayerOption::kStride));
  TPSIM_CHECK(!outputDtype || takes(LayerOption::kOutputDtype), refusal(*this, LayerOption::kOutputDtype));
  TPSIM_CHECK(!gatherOutput || takes(LayerOption::kGatherOutput), refusal(*this, LayerOption::kGatherOutput));
  TPSIM_CHECK(!disableGradReduce || takes(LayerOption::kDisableGradReduce), refusal(*this, LayerOption::kDisableGradReduce));
  TPSIM_CHECK(!(disableGradReduce && sequenceParallel), "--disable-grad-reduce: not with --sequence-parallel (the "
              "input gradient would still be reduce-scattered over TP)");
  TPSIM_CHECK(!inputIsParallel || takes(LayerOption::kInputIsParallel), refusal(*this, LayerOption::kInputIsParallel));
  TPSIM_CHECK(!reduceScatterEmbeddings || takes(LayerOption::kReduceScatterEmbeddings),
              refusal(*this, LayerOption::kReduceScatterEmbeddings));
  layer->validate(*this);
  TPSIM_CHECK(!sequenceParallel || takes(LayerOption::kSequenceParallel), refusal(*this, LayerOption::kSequenceParallel));
  TPSIM_CHECK(!(sequenceParallel && gatherOutput), "--gather-output: not with --sequence-parallel (the column "
              "output would be gathered along both the sequence and the features)");
  TPSIM_CHECK(!skipBiasAdd || (bias && takes(LayerOption::kSkipBiasAdd)), refusal(*this, LayerOption::kSkipBiasAdd));
  TPSIM_CHECK(!(skipBiasAdd && gatherOutput), "--skip-bias-add: not with --gather-output (the returned bias is "
              "sharded while the output is gathered)");
  TPSIM_CHECK(!gradAccumulationFusion || takes(LayerOption::kGradAccumulationFusion),
              refusal(*this, LayerOption::kGradAccumulationFusion));
  TPSIM_CHECK(dtype != DType::kInt64 && dtype != DType::kFloat64, "--dtype: expected fp32, bf16 or fp16, got ",
              dtypeName(dtype));
  TPSIM_CHECK(mainGradDtype == DType::kFloat32 || mainGradDtype == DType::kBFloat16,
              "--main-grad-dtype: expected fp32 or bf16, got ", dtypeName(mainGradDtype));
  TPSIM_CHECK(!gradAccumulationFusion || mainGradDtype == DType::kFloat32 || mainGradDtype == dtype,
              "--main-grad-dtype bf16: needs --dtype bf16 (the 16-bit fused kernel), got --dtype ", dtypeName(dtype));
  TPSIM_CHECK(weightFormat == WeightFormat::kNative || takes(LayerOption::kMxfp8Weights),
              refusal(*this, LayerOption::kMxfp8Weights));
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
  TPSIM_CHECK(threads >= 0 && threads <= kMaxThreads, "--threads: expected 0..", kMaxThreads,
              " (0 = every core), got ", threads);
  for (auto [flag, v] : {std::pair{"seq", seq}, {"batch", batch}, {"in-features", inFeatures},
                         {"out-features", outFeatures}, {"ffn-hidden", ffnHidden}, {"vocab", vocab},
                         {"tokens", tokens}, {"experts", experts}})
    TPSIM_CHECK(v >= 1, "--", flag, ": expected >= 1, got ", v);
}

std::string RunConfig::str() const {
  using F = Field;
  return assignments(settingsOf(*this, {F::kLayer, F::kTp, F::kDtype, F::kBackend, F::kOutputDtype, F::kSequenceParallel,
                                        F::kBias, F::kGatherOutput, F::kInputIsParallel, F::kReduceScatterEmbeddings,
                                        F::kSkipBiasAdd, F::kDisableGradReduce, F::kStride, F::kGradAccumulationFusion,
                                        F::kWeightFormat, F::kGtpRemat, F::kFaults, F::kTimeout, F::kSeed}));
}

std::vector<std::pair<std::string, std::int64_t>> shapeFlags(const RunConfig& c) {
  std::vector<std::pair<std::string, std::int64_t>> out;
  for (const SizeSpec& s : c.layer->sizes()) out.push_back({s.flag, c.*s.field});
  return out;
}

std::string layoutLine(const RunConfig& c) {
  using F = Field;
  // The topology first: every drawing depends on it; then what changes a placement.
  std::vector<Setting> s = settingsOf(c, {F::kLayer, F::kTp});
  s.push_back({"gtp-remat", std::to_string(c.gtpRemat)});
  if (c.gtpRemat > 1) s.push_back({"pad-for-alignment", std::to_string(c.padForAlignment)});
  for (Setting& x : settingsOf(c, {F::kSequenceParallel, F::kBias, F::kGatherOutput, F::kInputIsParallel,
                                   F::kReduceScatterEmbeddings, F::kDisableGradReduce, F::kStride}))
    s.push_back(std::move(x));
  for (const auto& [flag, value] : shapeFlags(c)) s.push_back({flag, std::to_string(value)});
  return assignments(s);
}

std::string commandLine(const RunConfig& c, const std::string& loadDir) {
  using F = Field;
  std::string s = "tpsim run" + flags(settingsOf(c, {F::kLayer, F::kTp, F::kSequenceParallel, F::kBias, F::kGatherOutput,
                                                      F::kInputIsParallel, F::kReduceScatterEmbeddings, F::kSkipBiasAdd,
                                                      F::kDisableGradReduce, F::kStride, F::kDtype, F::kOutputDtype,
                                                      F::kGradAccumulationFusion, F::kWeightFormat, F::kGtpRemat,
                                                      F::kThreads, F::kFaults, F::kTimeout, F::kBackend, F::kSeed}));
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

void checkCheckpointable(const RunConfig& c) {
  TPSIM_CHECK(c.stride == 1, "--stride: checkpoints need stride 1 (sharded_state_dict records a rank's interleaved "
              "rows as one contiguous chunk, which another --tp would read as the wrong rows), got ", c.stride);
  TPSIM_CHECK(c.weightFormat == WeightFormat::kNative, "--weight-format: checkpoints need native weights (an MXFP8 "
              "weight is saved as its dequantized copy, not the parameter), got ", weightFormatName(c.weightFormat));
}

}  // namespace tpsim::tools
