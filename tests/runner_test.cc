// The engine of `tpsim run` and `tpsim demo`: every layer kind and option, sharded on the
// simulator and reassembled, agrees with the dense double-precision computation within the
// data-derived bound; bad inputs are named.
#include "tools/lib/runner.h"

#include "backends/fault.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

namespace tpsim::tools {
namespace {

using ::testing::HasSubstr;

void expectAgreement(const RunConfig& c, const InputMap& inputs) {
  const RunResult r = runSharded(c, inputs);
  const auto verdicts = verify(c, inputs, r.results);
  ASSERT_FALSE(verdicts.empty());
  for (const Verdict& v : verdicts)
    EXPECT_EQ(v.outside, 0) << c.str() << ": " << v.name << " max error " << v.maxError << " bound " << v.maxBound;
}
void expectAgreement(const RunConfig& c, const TensorMap& inputs) { expectAgreement(c, storedOf(inputs)); }
void expectAgreement(const RunConfig& c) { expectAgreement(c, generateInputs(c)); }

TEST(Runner, EveryLayerKindAndOptionAgreesWithTheDenseComputation) {
  for (int tp : {1, 2, 4})
    for (DType dt : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      RunConfig c;
      c.tp = tp;
      c.dtype = dt;
      c.seq = 8;
      for (const LayerKind* kind : {layerKind("column"), layerKind("row"), layerKind("embedding"), layerKind("mlp")}) {
        c.layer = kind;
        c.bias = kind != layerKind("embedding");
        c.sequenceParallel = false;
        c.inputIsParallel = false;
        c.reduceScatterEmbeddings = false;
        expectAgreement(c);
        if (tp > 1 && kind != layerKind("embedding")) {
          c.sequenceParallel = true;
          c.inputIsParallel = kind == layerKind("row");
          expectAgreement(c);
          c.sequenceParallel = false;
        }
      }
      c.layer = layerKind("embedding");
      c.bias = false;
      c.reduceScatterEmbeddings = true;
      expectAgreement(c);
    }
}

TEST(Runner, ColumnAndRowOptions) {
  RunConfig c;
  c.tp = 2;
  c.bias = true;
  c.layer = layerKind("column");
  for (auto set : std::vector<std::function<void(RunConfig&)>>{
           [](RunConfig& r) { r.gatherOutput = true; }, [](RunConfig& r) { r.skipBiasAdd = true; },
           [](RunConfig& r) { r.stride = 2; }, [](RunConfig& r) { r.outputDtype = DType::kFloat32; r.dtype = DType::kBFloat16; },
           [](RunConfig& r) { r.gradAccumulationFusion = true; },
           [](RunConfig& r) { r.gradAccumulationFusion = true; r.dtype = DType::kBFloat16; r.mainGradDtype = DType::kBFloat16; }}) {
    RunConfig k = c;
    set(k);
    expectAgreement(k);
  }
  c.layer = layerKind("row");
  for (auto set : std::vector<std::function<void(RunConfig&)>>{
           [](RunConfig& r) { r.inputIsParallel = true; }, [](RunConfig& r) { r.skipBiasAdd = true; },
           [](RunConfig& r) { r.stride = 2; r.inputIsParallel = true; },
           [](RunConfig& r) { r.gradAccumulationFusion = true; r.sequenceParallel = true; r.inputIsParallel = true; }}) {
    RunConfig k = c;
    set(k);
    expectAgreement(k);
  }
}

TEST(Runner, StrideShardsInterleavedChunks) {
  RunConfig c;
  c.tp = 2;
  c.stride = 2;
  c.outFeatures = 8;
  const TensorMap inputs = hostOf(generateInputs(c));
  const RunResult r = runSharded(c, storedOf(inputs));
  // SPEC 3.11 worked example A: rank 0 holds master rows 0,1,4,5; rank 1 rows 2,3,6,7.
  const auto weight = std::find_if(r.placements.begin(), r.placements.end(),
                                   [](const TensorPlacement& p) { return p.name == "weight"; });
  ASSERT_NE(weight, r.placements.end());
  EXPECT_EQ(holdsText(*weight, 0, 0), "[0, 2) x [0, 16) + [4, 6) x [0, 16)");
  EXPECT_EQ(holdsText(*weight, 1, 0), "[2, 4) x [0, 16) + [6, 8) x [0, 16)");
  const HostTensor shard = shardOf(*weight, inputs.at("weight"), 1, 0);
  ASSERT_EQ(shard.shape, (std::vector<std::int64_t>{4, 16}));
  for (std::int64_t i = 0; i < 4; ++i)
    for (std::int64_t j = 0; j < 16; ++j)
      EXPECT_EQ(shard.values[std::size_t(i * 16 + j)], inputs.at("weight").values[std::size_t(((i / 2) * 4 + 2 + i % 2) * 16 + j)]);
  expectAgreement(c, inputs);
}

TEST(Runner, SequenceParallelRowBiasGradientIsFinalizedOverTp) {
  RunConfig c;
  c.layer = layerKind("row");
  c.tp = 4;
  c.bias = true;
  c.sequenceParallel = c.inputIsParallel = true;
  const TensorMap inputs = hostOf(generateInputs(c));
  const RunResult r = runSharded(c, storedOf(inputs));
  const HostTensor& dy = inputs.at("grad_output");
  const std::int64_t n = dy.shape.back();
  for (std::int64_t j = 0; j < n; ++j) {
    double full = 0;
    for (std::size_t i = j; i < dy.values.size(); i += n) full += dy.values[i];
    EXPECT_NEAR(r.results.at("bias.grad").values[j], full, 1e-4) << "bias.grad " << j;
  }
}

// --disable-grad-reduce: input.grad is every TP rank's own partial dY_t·W_t, stacked (T, s, b, K)
// and checked against those partial products; they add up to the reduced input gradient, and no
// rank reduces anything over TP.
TEST(Runner, DisableGradReduceReturnsEachRanksPartialInputGradient) {
  for (int tp : {2, 4})
    for (DType dt : {DType::kFloat32, DType::kBFloat16})
      for (auto set : std::vector<std::function<void(RunConfig&)>>{
               [](RunConfig&) {}, [](RunConfig& r) { r.bias = true; }, [](RunConfig& r) { r.gatherOutput = true; },
               [](RunConfig& r) { r.stride = 2; }, [](RunConfig& r) { r.gradAccumulationFusion = true; },
               [](RunConfig& r) { r.gtpRemat = 2; r.batch = 4; }}) {
        RunConfig c;
        c.tp = tp;
        c.dtype = dt;
        c.disableGradReduce = true;
        set(c);
        const TensorMap inputs = hostOf(generateInputs(c));
        expectAgreement(c, inputs);
        const RunResult r = runSharded(c, storedOf(inputs));
        const HostTensor& partials = r.results.at("input.grad");
        ASSERT_EQ(partials.shape, (std::vector<std::int64_t>{tp, c.seq, c.batch, c.inFeatures})) << c.str();
        RunConfig reduced = c;
        reduced.disableGradReduce = false;
        const HostTensor full = runSharded(reduced, storedOf(inputs)).results.at("input.grad");
        const std::size_t each = full.values.size();
        double worst = 0, scale = 0;
        for (std::size_t i = 0; i < each; ++i) {
          double total = 0;
          for (int t = 0; t < tp; ++t) total += partials.values[t * each + i];
          worst = std::max(worst, std::fabs(total - full.values[i]));
          scale = std::max(scale, std::fabs(full.values[i]));
        }
        EXPECT_LT(worst, (dt == DType::kFloat32 ? 1e-5 : 3e-2) * scale) << c.str();
        for (const auto& events : r.trace)
          for (const TraceEvent& e : events)
            if (e.group.rfind("tp[", 0) == 0) {
              EXPECT_TRUE(e.op != "allReduce" && e.op != "reduceScatter") << c.str() << ": " << e.op << " on " << e.group;
            }
      }
}

// GTP_remat through the whole tool: every layer kind, MEAN and SUM, padding that spills over
// several peers (a = 16 on tiny dims), no padding (a = 0), and the fp32-accumulation variant.
TEST(Runner, GtpRematAgreesWithTheDenseComputation) {
  for (const LayerKind* kind : {layerKind("column"), layerKind("row"), layerKind("embedding"), layerKind("mlp")})
    for (int g : {2, 4})
      for (bool mean : {true, false}) {
        RunConfig c;
        c.layer = kind;
        c.tp = 2;
        c.gtpRemat = g;
        c.gtpReduceMean = mean;
        c.batch = 4;
        c.bias = kind != layerKind("embedding");
        c.fp32AccumReduceScatter = g == 4;
        expectAgreement(c);
        c.dtype = DType::kBFloat16;
        c.sequenceParallel = kind == layerKind("column") || kind == layerKind("mlp");
        expectAgreement(c);
      }
  RunConfig c;
  c.gtpRemat = 2;
  c.padForAlignment = 0;
  c.tp = 2;
  expectAgreement(c);  // 16/2 = 8 rows per TP rank, divisible by G
}

// Generated inputs with every weight's element (0, 0) multiplied by 2^18: the small elements of
// its rowwise and columnwise blocks fall to E4M3's subnormals or zero, so the results depend on
// how the blocks are cut (TP-local, stride chunks, along rows or columns). Elsewhere MXFP8 rounds
// each element to 3 mantissa bits whatever its block.
TensorMap spikedWeights(const RunConfig& c) {
  TensorMap in = hostOf(generateInputs(c));
  for (auto& [name, t] : in)
    if (name.find("weight") != std::string::npos) t.values[0] *= 262144.0;
  return in;
}

// MXFP8 weights through the whole tool: the dense reference multiplies by each rank's TP-local
// weight quantized on its own (rowwise for outputs, columnwise for input gradients; N/T = 20 rows
// and stride 2 cut blocks differently from the unsharded weight), with and without GTP_remat.
TEST(Runner, Mxfp8WeightsAgreeWithTheQuantizedReference) {
  for (const LayerKind* kind : {layerKind("column"), layerKind("row"), layerKind("mlp")})
    for (int g : {1, 2})
      for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
        RunConfig c;
        c.layer = kind;
        c.tp = 2;
        c.gtpRemat = g;
        c.padForAlignment = 32;
        c.batch = 4;
        c.bias = true;
        c.dtype = dt;
        c.inFeatures = 48;
        c.outFeatures = 40;
        c.ffnHidden = 72;
        c.weightFormat = WeightFormat::kMxfp8;
        expectAgreement(c, spikedWeights(c));
        if (kind == layerKind("mlp")) continue;
        c.stride = 2;
        c.inputIsParallel = kind == layerKind("row");
        expectAgreement(c, spikedWeights(c));
      }
  // The quantization is visible: against the unquantized reference, outputs and dgrads fail.
  RunConfig c;
  c.inFeatures = 48;
  c.outFeatures = 40;
  c.weightFormat = WeightFormat::kMxfp8;
  const TensorMap inputs = hostOf(generateInputs(c));
  const RunResult r = runSharded(c, storedOf(inputs));
  RunConfig native = c;
  native.weightFormat = WeightFormat::kNative;
  for (const Verdict& v : verify(native, storedOf(inputs), r.results))
    EXPECT_EQ(v.outside > 0, v.name != "weight.grad" && v.name != "bias.grad") << v.name << ": " << v.outside;
}

TEST(Runner, BadConfigurationsAndInputsAreNamed) {
  auto message = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  RunConfig c;
  c.sequenceParallel = true;
  c.tp = 1;
  EXPECT_THAT(message([&] { c.validate(); }), HasSubstr("--sequence-parallel: needs --tp > 1"));
  c = RunConfig();
  c.layer = layerKind("row");
  c.sequenceParallel = true;
  EXPECT_THAT(message([&] { c.validate(); }), HasSubstr("RowParallelLinear needs --input-is-parallel"));
  c = RunConfig();
  c.layer = layerKind("row");
  c.disableGradReduce = true;
  EXPECT_THAT(message([&] { c.validate(); }), HasSubstr("--disable-grad-reduce: applies to --layer column"));
  c.layer = layerKind("column");
  c.sequenceParallel = true;
  EXPECT_THAT(message([&] { c.validate(); }), HasSubstr("--disable-grad-reduce: not with --sequence-parallel"));
  c = RunConfig();
  c.outputDtype = DType::kFloat32;
  c.layer = layerKind("mlp");
  EXPECT_THAT(message([&] { c.validate(); }), HasSubstr("--output-dtype: only ColumnParallelLinear"));
  c = RunConfig();
  c.tp = 3;
  EXPECT_THAT(message([&] { runSharded(c, generateInputs(c)); }),
              HasSubstr("N (weight.npy dim 0) = 16 must be divisible by --tp x --stride = 3"));
  c = RunConfig();
  TensorMap in = hostOf(generateInputs(c));
  in["grad_output"].shape = {8, 2, 15};
  in["grad_output"].values.resize(8 * 2 * 15);
  EXPECT_THAT(message([&] { runSharded(c, storedOf(in)); }),
              HasSubstr("grad_output.npy must have shape (8, 2, 16), got (8, 2, 15)"));
  c.gtpRemat = 3;
  EXPECT_THAT(message([&] { runSharded(c, generateInputs(c)); }),
              HasSubstr("the batch b (input.npy dim 1) = 2 must be divisible by --gtp-remat = 3"));
  c.gtpRemat = 1;
  in.erase("grad_output");
  EXPECT_THAT(message([&] { runSharded(c, storedOf(in)); }), HasSubstr("grad_output.npy is missing"));
  c = RunConfig();
  c.weightFormat = WeightFormat::kMxfp8;
  c.gtpRemat = 2;
  EXPECT_THAT(message([&] { c.validate(); }),
              HasSubstr("--pad-for-alignment: expected a positive multiple of 32 for --weight-format mxfp8 with "
                        "--gtp-remat 2, got 16"));
  c.layer = layerKind("embedding");
  c.gtpRemat = 1;
  EXPECT_THAT(message([&] { c.validate(); }), HasSubstr("--weight-format mxfp8: applies to --layer column, row or "
                                                        "mlp (the embedding is a lookup, not a GEMM)"));
  c.weightFormat = WeightFormat::kNative;
  in = hostOf(generateInputs(c));
  in["input"].values[3] = 999;
  EXPECT_THAT(message([&] { runSharded(c, storedOf(in)); }), HasSubstr("input.npy holds id 999 at flat position 3"));
}

// Pieces of at most `most` elements, of lengths that cut rows, runs and blocks anywhere.
void sendInPieces(const InputMap& inputs, const RunConfig& c, std::int64_t most, InputSink& sink) {
  std::int64_t length = 1;
  for (const TensorSpec& spec : c.layer->tensors(c)) {
    const StoredTensor& t = inputs.at(spec.name);
    const std::size_t size = dtypeSize(t.dtype);
    sink.begin(spec.name, {t.shape, t.dtype});
    for (std::int64_t first = 0; first < t.numel(); first += length, length = 1 + (length * 7 + 3) % most) {
      const std::int64_t count = std::min(length, t.numel() - first);
      sink.piece(first, count, t.bytes.data() + std::size_t(first) * size);
    }
    sink.end();
  }
}

// Every rank's shards cut from pieces run the world as the whole inputs do, bit for bit: strided
// and sequence-parallel cuts, GTP_remat's padded rows, the embedding's and the experts' tensors.
TEST(Runner, ShardsCutFromPiecesRunAsTheWholeInputs) {
  std::vector<RunConfig> configs(7);
  configs[0].layer = layerKind("column"), configs[0].tp = 4, configs[0].stride = 2, configs[0].bias = true;
  configs[0].outFeatures = 24;
  configs[1].layer = layerKind("row"), configs[1].tp = 2, configs[1].sequenceParallel = true;
  configs[1].inputIsParallel = true;
  configs[2].layer = layerKind("mlp"), configs[2].tp = 2, configs[2].gtpRemat = 2, configs[2].batch = 4;
  configs[2].padForAlignment = 8, configs[2].dtype = DType::kBFloat16;
  configs[3].layer = layerKind("embedding"), configs[3].tp = 4, configs[3].reduceScatterEmbeddings = true;
  configs[4].layer = layerKind("grouped-column"), configs[4].tp = 2, configs[4].experts = 3;
  configs[5].layer = layerKind("grouped-row"), configs[5].tp = 2, configs[5].gtpRemat = 2, configs[5].bias = true;
  configs[6].layer = layerKind("column"), configs[6].tp = 2, configs[6].gtpRemat = 3, configs[6].batch = 3;
  configs[6].outFeatures = 20;
  for (RunConfig& c : configs) {
    applyLayerConventions(c);
    const InputMap inputs = generateInputs(c);
    const RunResult want = runSharded(c, inputs);
    for (std::int64_t most : {std::int64_t(1), std::int64_t(5), std::int64_t(64), std::int64_t(1) << 20}) {
      ShardedInputs shards(c, placementsOf(c));
      sendInPieces(inputs, c, most, shards);
      const RunResult got = runSharded(c, shards.release());
      ASSERT_EQ(got.results.size(), want.results.size());
      for (const auto& [name, t] : want.results) {
        const HostTensor& g = got.results.at(name);
        EXPECT_EQ(g.shape, t.shape) << c.str() << " " << name;
        EXPECT_TRUE(std::equal(t.values.begin(), t.values.end(), g.values.begin(), g.values.end(),
                               [](double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }))
            << c.str() << ": " << name << " differs with pieces of at most " << most;
      }
    }
  }
}

TEST(Runner, CommandLineNamesEveryNonDefaultFlag) {
  RunConfig c;
  c.layer = layerKind("row");
  c.tp = 4;
  c.sequenceParallel = c.inputIsParallel = c.bias = c.skipBiasAdd = true;
  c.stride = 2;
  c.dtype = DType::kBFloat16;
  c.gradAccumulationFusion = true;
  c.mainGradDtype = DType::kBFloat16;
  c.seed = 77;
  c.seq = 12;
  c.inFeatures = 24;
  c.outFeatures = 5;
  EXPECT_EQ(commandLine(c), "tpsim run --layer row --tp 4 --sequence-parallel --bias --input-is-parallel "
                            "--skip-bias-add --stride 2 --dtype bf16 --grad-accumulation-fusion --main-grad-dtype bf16 "
                            "--seed 77 --seq 12 --batch 2 --in-features 24 --out-features 5");
  // --load replaces the shape flags, which it would ignore.
  EXPECT_EQ(commandLine(c, "/tmp/tpsim-props/case"),
            "tpsim run --layer row --tp 4 --sequence-parallel --bias --input-is-parallel --skip-bias-add --stride 2 "
            "--dtype bf16 --grad-accumulation-fusion --main-grad-dtype bf16 --seed 77 --load /tmp/tpsim-props/case");
  c = RunConfig();
  c.layer = layerKind("column");
  c.gatherOutput = true;
  c.disableGradReduce = true;
  c.outputDtype = DType::kFloat32;
  EXPECT_EQ(commandLine(c, "/tmp/a dir/it's"),
            "tpsim run --layer column --tp 2 --gather-output --disable-grad-reduce --dtype fp32 --output-dtype fp32 "
            "--seed 1234 --load '/tmp/a dir/it'\\''s'");
  c = RunConfig();
  c.layer = layerKind("embedding");
  c.reduceScatterEmbeddings = true;
  c.vocab = 64;
  EXPECT_EQ(commandLine(c), "tpsim run --layer embedding --tp 2 --reduce-scatter-embeddings --dtype fp32 --seed 1234 "
                            "--seq 8 --batch 2 --out-features 16 --vocab 64");
  c.layer = layerKind("mlp");
  c.reduceScatterEmbeddings = false;
  c.threads = 1;
  EXPECT_EQ(commandLine(c), "tpsim run --layer mlp --tp 2 --dtype fp32 --threads 1 --seed 1234 --seq 8 --batch 2 "
                            "--in-features 16 --ffn-hidden 64");
  c.weightFormat = WeightFormat::kMxfp8;
  c.gtpRemat = 2;
  c.padForAlignment = 32;
  EXPECT_EQ(commandLine(c, "d"), "tpsim run --layer mlp --tp 2 --dtype fp32 --weight-format mxfp8 --gtp-remat 2 "
                                 "--pad-for-alignment 32 --gtp-reduce mean --threads 1 --seed 1234 --load d");
}

}  // namespace
}  // namespace tpsim::tools

namespace tpsim::tools {
namespace {

// The experts' grouped linear in both modes: every TP size, GTP_remat (EGTP_remat) with and
// without padding, MEAN and SUM, biases, fusion, the 16-bit dtypes, agree with the dense
// per-token computation; experts without tokens get zero gradients.
TEST(Runner, GroupedExpertsAgreeWithTheDenseComputation) {
  for (const char* kind : {"grouped-column", "grouped-row"})
    for (int tp : {1, 2, 4})
      for (int gtp : {1, 2})
        for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
          RunConfig c;
          c.layer = layerKind(kind);
          c.tp = tp;
          c.gtpRemat = gtp;
          c.dtype = dt;
          c.bias = true;
          c.tokens = 12 * gtp;
          c.experts = 3;
          c.inFeatures = 8 * tp;
          c.outFeatures = 4 * tp;
          c.padForAlignment = gtp > 1 ? 4 : 16;
          c.gtpReduceMean = tp != 2;
          c.gradAccumulationFusion = tp == 4;
          expectAgreement(c);
        }
  RunConfig c;
  c.layer = layerKind("grouped-row");
  c.experts = 5;
  c.tokens = 3;  // at most three experts get tokens
  TensorMap in = hostOf(generateInputs(c));
  in["expert_ids"].values = {4, 0, 4};
  expectAgreement(c, in);
  const RunResult r = runSharded(c, storedOf(in));
  for (int e : {1, 2, 3})
    for (double v : r.results.at("weight" + std::to_string(e) + ".grad").values) EXPECT_EQ(v, 0.0) << "expert " << e;
}

// Tokens reach their own expert whatever their order: on small integers the sharded run equals the
// dense computation exactly, with the tokens of the experts interleaved.
TEST(Runner, GroupedExpertsAreExactOnIntegers) {
  for (const char* kind : {"grouped-column", "grouped-row"}) {
    RunConfig c;
    c.layer = layerKind(kind);
    c.tp = 2;
    c.gtpRemat = 2;
    c.tokens = 8;
    c.experts = 3;
    c.gtpReduceMean = false;
    TensorMap in = hostOf(generateInputs(c));
    for (auto& [name, t] : in)
      if (t.dtype != DType::kInt64)
        for (double& v : t.values) v = std::round(v * 4);
    in["expert_ids"].values = {2, 0, 1, 2, 0, 0, 2, 1};
    const RunResult r = runSharded(c, storedOf(in));
    for (const Verdict& v : verify(c, storedOf(in), r.results, VerifyMode::kExact, r.placements))
      EXPECT_EQ(v.outside, 0) << kind << ": " << v.name << " max error " << v.maxError;
  }
}

// The table's slack is the least bound/|err| over a result's elements: "inf" where every element
// is exact, "-" under --verify exact, below 1 once an element leaves its bound.
TEST(Runner, SlackIsTheLeastBoundOverErrorOfAnElement) {
  RunConfig c;
  c.tp = 2;
  c.dtype = DType::kBFloat16;
  const TensorMap in = hostOf(generateInputs(c));
  const RunResult r = runSharded(c, storedOf(in));
  const auto reference = referenceFor(c, storedOf(in), r.placements);
  TensorMap exact;
  for (const Verdict& v : verify(c, storedOf(in), r.results, VerifyMode::kBound, r.placements)) {
    const Checked& ref = reference.at(v.name);
    double least = INFINITY;
    for (std::size_t i = 0; i < ref.bound.size(); ++i)
      least = std::min(least, ref.bound[i] / std::fabs(r.results.at(v.name).values[i] - ref.value.values[i]));
    EXPECT_EQ(v.slack, least) << v.name;
    EXPECT_GT(v.slack, 1) << v.name;
    char text[32];
    std::snprintf(text, sizeof text, "%.3g", least);
    EXPECT_EQ(slackText(v), text) << v.name;
    exact[v.name] = ref.value;
  }
  for (const Verdict& v : verify(c, storedOf(in), exact, VerifyMode::kBound, r.placements)) EXPECT_EQ(slackText(v), "inf");
  for (const Verdict& v : verify(c, storedOf(in), r.results, VerifyMode::kExact, r.placements)) EXPECT_EQ(slackText(v), "-");
  TensorMap corrupt = r.results;
  corrupt.at("output").values[3] += 1;
  for (const Verdict& v : verify(c, storedOf(in), corrupt, VerifyMode::kBound, r.placements))
    EXPECT_TRUE(v.name != "output" || v.slack < 1) << v.name << " slack " << v.slack;
}

// verify reads a run's results from the ranks' tensors in place, a block of the reference at a
// time: the same verdicts, field by field, as from the assembled results and their farthest copies,
// whether the ranks' copies agree, a partial sum over the GTP_remat peers is divided (MEAN), the
// input gradient is left partial, or a fault makes one rank's copy of a replicated result wrong.
TEST(Runner, VerifyInPlaceGivesTheVerdictsOfTheAssembledResults) {
  std::vector<RunConfig> configs;
  for (const char* kind : {"column", "row", "embedding", "mlp", "grouped-column", "grouped-row"}) {
    RunConfig c;
    c.layer = layerKind(kind);
    c.tp = 2;
    c.gtpRemat = 2;
    c.seq = 8;
    c.tokens = 16;
    c.bias = c.layer != layerKind("embedding");
    configs.push_back(c);
  }
  RunConfig partial;
  partial.layer = layerKind("column");
  partial.tp = 4;
  partial.disableGradReduce = true;
  configs.push_back(partial);
  RunConfig corrupt;  // rank 1's output all-gather: its replicated copy of the output is wrong
  corrupt.layer = layerKind("column");
  corrupt.tp = 2;
  corrupt.gatherOutput = true;
  corrupt.faults = {parseFault("1:1:corrupt:3:30")};
  configs.push_back(corrupt);
  for (const RunConfig& c : configs) {
    const TensorMap in = hostOf(generateInputs(c));
    const RunResult r = runSharded(c, storedOf(in));
    EXPECT_EQ(r.otherCopies.empty(), c.faults.empty()) << c.str();
    for (VerifyMode mode : {VerifyMode::kBound, VerifyMode::kExact}) {
      const std::vector<Verdict> inPlace = verify(c, storedOf(in), r, mode),
                                 assembledVerdicts = verify(c, storedOf(in), r.results, mode, r.placements, r.otherCopies);
      ASSERT_EQ(inPlace.size(), assembledVerdicts.size()) << c.str();
      for (std::size_t i = 0; i < inPlace.size(); ++i) {
        const Verdict &a = inPlace[i], &b = assembledVerdicts[i];
        EXPECT_EQ(a.name, b.name);
        EXPECT_EQ(a.shape, b.shape) << a.name;
        EXPECT_EQ(a.maxError, b.maxError) << c.str() << " " << a.name;
        EXPECT_EQ(a.maxBound, b.maxBound) << c.str() << " " << a.name;
        EXPECT_TRUE(a.slack == b.slack || (std::isnan(a.slack) && std::isnan(b.slack))) << c.str() << " " << a.name;
        EXPECT_EQ(a.outside, b.outside) << c.str() << " " << a.name;
        EXPECT_EQ(a.firstOutside, b.firstOutside) << c.str() << " " << a.name;
        EXPECT_EQ(a.nonFinite, b.nonFinite) << c.str() << " " << a.name;
      }
      if (!c.faults.empty() && mode == VerifyMode::kBound) {
        const auto output = std::find_if(inPlace.begin(), inPlace.end(), [](const Verdict& v) { return v.name == "output"; });
        ASSERT_NE(output, inPlace.end());
        EXPECT_GT(output->outside, 0) << "a rank's wrong copy went unseen";
      }
    }
  }
}

// The MLP's reference sends its weight gradients a block of F at a time, fc2's as columns: the first
// element outside its bound is still the least flat index, whichever block arrives first.
TEST(Runner, TheFirstElementOutsideIsTheLeastFlatIndexAcrossBlocks) {
  RunConfig c;
  c.layer = layerKind("mlp");
  c.tp = 2;
  c.seq = 4096;        // 8192 tokens: the reference takes F in blocks of 256
  c.ffnHidden = 1024;
  const TensorMap in = hostOf(generateInputs(c));
  const RunResult r = runSharded(c, storedOf(in));
  TensorMap wrong = r.results;
  std::vector<double>& dW2 = wrong.at("fc2.weight.grad").values;  // (h, F)
  const std::int64_t f = wrong.at("fc2.weight.grad").shape[1];
  dW2[std::size_t(1 * f + 900)] += 1e6;  // row 1 of the last block
  dW2[std::size_t(2 * f + 10)] += 1e6;   // row 2 of the first block, verified first
  dW2[std::size_t(0 * f + 600)] += 1e6;  // row 0 of the third block: the least index
  bool checked = false;
  for (const Verdict& v : verify(c, storedOf(in), wrong, VerifyMode::kBound, r.placements))
    if (v.name == "fc2.weight.grad") {
      checked = true;
      EXPECT_EQ(v.outside, 3);
      EXPECT_EQ(v.firstOutside, 600);
    }
  EXPECT_TRUE(checked);
}

TEST(Runner, GroupedExpertIdsOutsideTheExpertsAreNamed) {
  RunConfig c;
  c.layer = layerKind("grouped-column");
  TensorMap in = hostOf(generateInputs(c));
  in["expert_ids"].values[5] = double(c.experts);
  try {
    runSharded(c, storedOf(in));
    ADD_FAILURE() << "an expert id out of range was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("tpsim run: expert_ids.npy holds id 4 at flat position 5, outside [0, E=4)"));
  }
}

}  // namespace
}  // namespace tpsim::tools
