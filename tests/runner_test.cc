// The engine of `tpsim run` and `tpsim demo`: every layer kind and option, sharded on the
// simulator and reassembled, agrees with the dense double-precision computation within the
// data-derived bound; bad inputs are named.
#include "tools/runner.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace tpsim::tools {
namespace {

using ::testing::HasSubstr;

void expectAgreement(const RunConfig& c) {
  const TensorMap inputs = generateInputs(c);
  const RunResult r = runSharded(c, inputs);
  const auto verdicts = verify(c, inputs, r.results);
  ASSERT_FALSE(verdicts.empty());
  for (const Verdict& v : verdicts)
    EXPECT_EQ(v.outside, 0) << c.str() << ": " << v.name << " max error " << v.maxError << " bound " << v.maxBound;
}

TEST(Runner, EveryLayerKindAndOptionAgreesWithTheDenseComputation) {
  for (int tp : {1, 2, 4})
    for (DType dt : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      RunConfig c;
      c.tp = tp;
      c.dtype = dt;
      c.seq = 8;
      for (LayerKind kind : {LayerKind::kColumn, LayerKind::kRow, LayerKind::kEmbedding, LayerKind::kMlp}) {
        c.layer = kind;
        c.bias = kind != LayerKind::kEmbedding;
        c.sequenceParallel = false;
        c.inputIsParallel = false;
        c.reduceScatterEmbeddings = false;
        expectAgreement(c);
        if (tp > 1 && kind != LayerKind::kEmbedding) {
          c.sequenceParallel = true;
          c.inputIsParallel = kind == LayerKind::kRow;
          expectAgreement(c);
          c.sequenceParallel = false;
        }
      }
      c.layer = LayerKind::kEmbedding;
      c.bias = false;
      c.reduceScatterEmbeddings = true;
      expectAgreement(c);
    }
}

TEST(Runner, ColumnAndRowOptions) {
  RunConfig c;
  c.tp = 2;
  c.bias = true;
  c.layer = LayerKind::kColumn;
  for (auto set : std::vector<std::function<void(RunConfig&)>>{
           [](RunConfig& r) { r.gatherOutput = true; }, [](RunConfig& r) { r.skipBiasAdd = true; },
           [](RunConfig& r) { r.stride = 2; }, [](RunConfig& r) { r.outputDtype = DType::kFloat32; r.dtype = DType::kBFloat16; },
           [](RunConfig& r) { r.gradAccumulationFusion = true; },
           [](RunConfig& r) { r.gradAccumulationFusion = true; r.dtype = DType::kBFloat16; r.mainGradDtype = DType::kBFloat16; }}) {
    RunConfig k = c;
    set(k);
    expectAgreement(k);
  }
  c.layer = LayerKind::kRow;
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
  const TensorMap inputs = generateInputs(c);
  const RunResult r = runSharded(c, inputs);
  // SPEC 3.11 worked example A: rank 0 holds master rows 0,1,4,5; rank 1 rows 2,3,6,7.
  EXPECT_THAT(r.shards[0][0], HasSubstr("rows [0, 2)+[4, 6) of (8, 16)"));
  EXPECT_THAT(r.shards[1][0], HasSubstr("rows [2, 4)+[6, 8) of (8, 16)"));
}

TEST(Runner, SequenceParallelRowBiasGradientIsFinalizedOverTp) {
  RunConfig c;
  c.layer = LayerKind::kRow;
  c.tp = 4;
  c.bias = true;
  c.sequenceParallel = c.inputIsParallel = true;
  const TensorMap inputs = generateInputs(c);
  const RunResult r = runSharded(c, inputs);
  const HostTensor& dy = inputs.at("grad_output");
  const std::int64_t n = dy.shape.back();
  for (std::int64_t j = 0; j < n; ++j) {
    double full = 0;
    for (std::size_t i = j; i < dy.values.size(); i += n) full += dy.values[i];
    EXPECT_NEAR(r.results.at("bias.grad").values[j], full, 1e-4) << "bias.grad " << j;
  }
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
  c.layer = LayerKind::kRow;
  c.sequenceParallel = true;
  EXPECT_THAT(message([&] { c.validate(); }), HasSubstr("RowParallelLinear needs --input-is-parallel"));
  c = RunConfig();
  c.outputDtype = DType::kFloat32;
  c.layer = LayerKind::kMlp;
  EXPECT_THAT(message([&] { c.validate(); }), HasSubstr("--output-dtype: only ColumnParallelLinear"));
  c = RunConfig();
  c.tp = 3;
  EXPECT_THAT(message([&] { runSharded(c, generateInputs(c)); }),
              HasSubstr("N (weight.npy dim 0) = 16 must be divisible by --tp x --stride = 3"));
  c = RunConfig();
  TensorMap in = generateInputs(c);
  in["grad_output"].shape = {8, 2, 15};
  EXPECT_THAT(message([&] { runSharded(c, in); }),
              HasSubstr("grad_output.npy must have shape (8, 2, 16), got (8, 2, 15)"));
  in.erase("grad_output");
  EXPECT_THAT(message([&] { runSharded(c, in); }), HasSubstr("grad_output.npy is missing"));
  c.layer = LayerKind::kEmbedding;
  in = generateInputs(c);
  in["input"].values[3] = 999;
  EXPECT_THAT(message([&] { runSharded(c, in); }), HasSubstr("input.npy holds id 999 at flat position 3"));
}

}  // namespace
}  // namespace tpsim::tools
