// Timelines (tools/lib/trace.h): the logging decorators, the device models, the model clock's costs
// and ordering (a collective starts when its last member arrives; async collectives overlap
// compute), and the summary's arithmetic on a real run.
#include "tools/lib/trace.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>

#include "sim/sim_compute.h"
#include "sim/world.h"
#include "tools/lib/input_file.h"
#include "tools/lib/runner.h"

namespace tpsim::tools {
namespace {

using ::testing::HasSubstr;
using Step = RankRecord::Step;

// Round numbers: 1 TFLOP/s = 1e6 FLOP/µs, 1 GB/s = 1e3 B/µs.
DeviceModel unitDevice() {
  DeviceModel d;
  d.name = "unit";
  d.tflopsFp32 = d.tflopsBf16 = d.tflopsFp16 = d.tflopsFp64 = 1;
  d.memoryGBps = 1000;
  d.linkLatencyUs = 2;
  d.linkGBps = 1;
  return d;
}

TEST(Trace, RecordingComputeLogsEachOpWithItsShapeAndFlops) {
  sim::SimCompute inner;
  RankRecord record;
  auto compute = recordingCompute(inner, record, TraceClock::now());
  Tensor a = compute->zeros({8, 4}, DType::kFloat32);   // (M, K)
  Tensor b = compute->zeros({4, 16}, DType::kFloat32);  // (K, N)
  Tensor c = compute->empty({8, 16}, DType::kFloat32);  // (M, N)
  compute->gemm(a, b, c);
  Tensor h = compute->empty({8, 16}, DType::kBFloat16);
  compute->copy(c, h);
  ASSERT_EQ(record.compute.size(), 4u);  // two fills (zeros), the gemm, the cast
  const ComputeRecord& g = record.compute[2];
  EXPECT_EQ(g.name, "gemm");
  EXPECT_EQ(g.m, 8);
  EXPECT_EQ(g.n, 16);
  EXPECT_EQ(g.k, 4);
  EXPECT_EQ(g.flops, 2.0 * 8 * 16 * 4);
  EXPECT_EQ(g.bytes, 4.0 * (8 * 4 + 4 * 16 + 8 * 16));
  EXPECT_LE(g.start, g.end);
  EXPECT_EQ(record.compute[3].name, "cast fp32->bf16");
  EXPECT_EQ(record.steps.size(), 4u);
}

TEST(Trace, RecordingCollectivesLogIssueAndWaitWithTheFabricsGroupNames) {
  WorldOptions o;
  o.size = 4;
  std::vector<RankRecord> records(4);
  const auto t0 = TraceClock::now();
  sim::World(o).run([&](RankContext& base) {
    auto comm = recordingCollectives(base.comm, records[base.comm.rank()], t0);
    auto tp = comm->split(base.comm.rank() / 2, 0, "tp");
    Tensor x = base.compute.zeros({6}, DType::kFloat32);
    auto work = tp->allReduce(x);
    work->wait();
  });
  for (int r = 0; r < 4; ++r) {
    ASSERT_EQ(records[r].comms.size(), 1u) << "the split is not logged";
    const CommRecord& c = records[r].comms[0];
    EXPECT_EQ(c.op, "allReduce");
    EXPECT_EQ(c.group, r < 2 ? "tp[0,1]" : "tp[2,3]");
    EXPECT_EQ(c.seq, 0u);
    EXPECT_EQ(c.inBytes, 24);
    EXPECT_EQ(c.size, 2);
    EXPECT_LE(c.issued, c.waitStart);
    EXPECT_LE(c.waitStart, c.completed);
    ASSERT_EQ(records[r].steps.size(), 2u);
    EXPECT_EQ(records[r].steps[0].first, Step::kIssue);
    EXPECT_EQ(records[r].steps[1].first, Step::kWait);
  }
}

TEST(Trace, CollectiveCostsUseNcclTestsBusBandwidthFactors) {
  const DeviceModel d = unitDevice();
  CommRecord c;
  c.size = 4;
  c.inBytes = c.outBytes = 4000;
  c.op = "allReduce";
  EXPECT_DOUBLE_EQ(collectiveCostUs(d, c), 2 + 2 * 0.75 * 4000 / 1000);
  c.op = "allGather";
  c.outBytes = 16000;
  EXPECT_DOUBLE_EQ(collectiveCostUs(d, c), 2 + 0.75 * 16000 / 1000);
  c.op = "reduceScatter";
  c.inBytes = 16000;
  EXPECT_DOUBLE_EQ(collectiveCostUs(d, c), 2 + 0.75 * 16000 / 1000);
  c.size = 1;
  EXPECT_EQ(collectiveCostUs(d, c), 0) << "a group of one moves nothing";
  ComputeRecord g;
  g.dtype = "fp32";
  g.flops = 3e6;
  g.bytes = 1e3;
  EXPECT_DOUBLE_EQ(computeCostUs(d, g), 3) << "compute-bound";
  g.bytes = 5e6;
  EXPECT_DOUBLE_EQ(computeCostUs(d, g), 5) << "memory-bound";
}

// Rank 0: gemm (3 µs), issue allReduce, gemm (3 µs), wait. Rank 1: issue allReduce at once, wait.
std::vector<RankRecord> overlapLog() {
  std::vector<RankRecord> records(2);
  ComputeRecord g;
  g.name = "gemm";
  g.dtype = "fp32";
  g.flops = 3e6;
  CommRecord c;
  c.op = "allReduce";
  c.group = "tp[0,1]";
  c.size = 2;
  c.inBytes = c.outBytes = 4000;  // 2 µs + 2·(1/2)·4000 B / 1000 B/µs = 6 µs
  records[0].compute = {g, g};
  records[0].comms = {c};
  records[0].steps = {{Step::kCompute, 0}, {Step::kIssue, 0}, {Step::kCompute, 1}, {Step::kWait, 0}};
  records[1].comms = {c};
  records[1].steps = {{Step::kIssue, 0}, {Step::kWait, 0}};
  return records;
}

TEST(Trace, ModelCollectiveStartsAtItsLastMemberAndOverlapsLaterCompute) {
  const auto records = overlapLog();
  const auto t = modelTimeline(records, unitDevice());
  EXPECT_DOUBLE_EQ(t[0].issued[0], 3);
  EXPECT_DOUBLE_EQ(t[1].issued[0], 0);
  EXPECT_DOUBLE_EQ(t[0].completed[0], 3 + 6) << "starts when rank 0, the last member, issues it";
  EXPECT_DOUBLE_EQ(t[1].completed[0], 9);
  EXPECT_DOUBLE_EQ(t[0].computeStart[1], 3) << "issuing does not block";
  const auto s = summarize(records, t);
  EXPECT_DOUBLE_EQ(s[0].compute, 6);
  EXPECT_DOUBLE_EQ(s[0].overlap, 3) << "the second gemm runs under the allReduce";
  EXPECT_DOUBLE_EQ(s[0].exposed, 3);
  EXPECT_DOUBLE_EQ(s[0].total, 9);
  EXPECT_DOUBLE_EQ(s[1].exposed, 9) << "rank 1 waits for rank 0's arrival and the transfer";
  EXPECT_DOUBLE_EQ(s[1].communication, 9);
  for (const RankSummary& x : s) EXPECT_DOUBLE_EQ(x.other, 0);
}

TEST(Trace, ModelTotalsAreTheSumOfTheirPartsOnARealRun) {
  RunConfig c;
  c.layer = layerKind("mlp");
  c.tp = 2;
  c.gtpRemat = 2;
  c.batch = 4;
  c.sequenceParallel = true;
  c.bias = true;
  c.record = true;
  const RunResult r = runSharded(c, generateInputs(c));
  ASSERT_EQ(r.records.size(), 4u);
  for (const char* device : {"h100-nvlink", "h200-nvlink", "a100-nvlink", "pcie"}) {
    const auto summary = summarize(r.records, modelTimeline(r.records, deviceModel(device)));
    for (std::size_t rank = 0; rank < summary.size(); ++rank) {
      const RankSummary& s = summary[rank];
      EXPECT_NEAR(s.total, s.compute + s.exposed, 1e-9 * s.total) << device << " rank " << rank;
      EXPECT_GT(s.overlap, 0) << device << " rank " << rank << ": the wgrad GEMMs run under the dgrad collectives";
      EXPECT_LE(s.overlap, std::min(s.compute, s.communication) + 1e-9);
    }
  }
  const auto measured = summarize(r.records, measuredTimeline(r.records));
  for (const RankSummary& s : measured) EXPECT_NEAR(s.total, s.compute + s.exposed + s.other, 1e-6 * s.total);
}

TEST(Trace, FileIsStrictJsonWithEveryEventAndNamesMadeValidUtf8) {
  RunConfig c;
  c.layer = layerKind("row");
  c.tp = 2;
  c.record = true;
  const RunResult r = runSharded(c, generateInputs(c));
  const std::vector<RankTimeline> timeline = measuredTimeline(r.records);
  // A rank name with a stray byte, a quote and a newline; a clock naming a path that is not UTF-8.
  const std::string text =
      chromeTrace(r.records, timeline, {"rank \xff\"0\n", "rank 1"}, "model (/tmp/\xc3(device.txt)");
  const nlohmann::json trace = nlohmann::json::parse(text);  // throws on invalid UTF-8, inf or NaN
  EXPECT_EQ(trace["otherData"]["clock"], "model (/tmp/\xEF\xBF\xBD(device.txt)");
  std::size_t spans = 0;
  for (const nlohmann::json& e : trace["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "process_name" && e["pid"] == 0) {
      EXPECT_EQ(e["args"]["name"], "rank \xEF\xBF\xBD\"0\n");
    }
    if (e["ph"] == "X") ++spans;
  }
  std::size_t logged = 0;
  for (const RankRecord& rec : r.records) logged += rec.compute.size() + rec.comms.size();
  EXPECT_EQ(spans, logged) << "one complete event per logged op";
  const std::vector<RankSummary> summary = summarize(r.records, timeline);
  ASSERT_EQ(trace["otherData"]["ranks"].size(), summary.size());
  EXPECT_NEAR(trace["otherData"]["ranks"][1]["total_us"].get<double>(), summary[1].total, 5e-4);
}

TEST(Trace, DeviceModelsArePresetsOrKeyValueFiles) {
  EXPECT_EQ(deviceModel("h100-nvlink").tflopsBf16, 989);
  EXPECT_EQ(deviceModel("a100-nvlink").memoryGBps, 2039);
  const std::string path = ::testing::TempDir() + "tpsim_device.txt";
  {
    std::ofstream f(path);
    f << "# a made-up part\ntflops.fp32 = 10\ntflops.bf16=100\ntflops.fp16 = 100\ntflops.fp64 = 5\n"
         "memory_gbps = 1000  # HBM\nlink_latency_us = 0\nlink_gbps = 50\n";
  }
  const DeviceModel d = deviceModel(path);
  EXPECT_EQ(d.tflopsBf16, 100);
  EXPECT_EQ(d.linkGBps, 50);
  EXPECT_EQ(d.name, path);
  {
    std::ofstream f(path);
    f << "tflops.fp32 = fast\n";
  }
  EXPECT_THAT([&] { deviceModel(path); }, ::testing::ThrowsMessage<InvalidArgument>(HasSubstr(
                                               ":1: expected tflops.fp32 to be a decimal number > 0, got 'fast'")));
  // strtod's other spellings are no decimal numbers; a NUL byte is shown, not the end of the message.
  for (const std::string& value : std::vector<std::string>{"0x14", "inf", "nan", "1e999", std::string("20\0x", 4)}) {
    {
      std::ofstream f(path);
      f << "tflops.fp32 = " << value << "\n";
    }
    EXPECT_THAT([&] { deviceModel(path); },
                ::testing::ThrowsMessage<InvalidArgument>(HasSubstr(
                    ":1: expected tflops.fp32 to be a decimal number > 0, got '" + printable(value) + "'")))
        << printable(value);
  }
  {
    std::ofstream f(path);
    f << "tflops.fp32 = 1\n";
  }
  EXPECT_THAT([&] { deviceModel(path); }, ::testing::ThrowsMessage<InvalidArgument>(
                                               HasSubstr("expected a value for link_gbps, got none")));
  std::remove(path.c_str());
  EXPECT_THAT([&] { deviceModel("b200"); }, ::testing::ThrowsMessage<InvalidArgument>(HasSubstr(
                                                "expected h100-nvlink, h200-nvlink, a100-nvlink, pcie or a readable")));
}

}  // namespace
}  // namespace tpsim::tools
