// The memory estimate measured: `tpsim run` at 1, 4, 16 and 64 ranks, on a row layer whose input
// and output every rank holds whole, so that the ranks' copies dominate the peak (and without
// verification at batch 64, where the gemms' packed operands are a fifth of it), and at 8 and 64
// ranks on sequence-parallel MLPs, whose groups gather the whole sequence. The estimate `tpsim run`
// checks (parseRunArgs, tensorShapes, estimateRunBytes: what runMain calls) must be at least the
// child's peak resident memory, and at most 1.3 times it. And the long sequence-parallel MLP, whose
// whole-sequence tensors are most of its peak, must peak at 64 ranks at most 1.25 times its peak
// at 8: its ranks share the gathered sequence and give their partial sums up as they make them.
// One run of each kind whose reference holds the peak checks that kind's own coefficients, and a
// column loaded from a checkpoint the checkpoint's term.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

#include "tests/scratch_dir.h"
#include "tools/cli/cli.h"
#include "tools/lib/checkpoint_files.h"
#include "tools/lib/memory.h"

namespace tpsim::tools {
namespace {

struct Peak {
  long maxRssKiB = -1;
  int status = -1;  // the run's wait status
};

// Runs `tpsim args...` with its output discarded, from a process forked for it alone, so that
// getrusage(RUSAGE_CHILDREN) there reports this run's peak and no earlier one's.
Peak peakOf(const std::vector<std::string>& args) {
  std::vector<std::string> argv{TPSIM_BINARY};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> cargv;
  for (std::string& a : argv) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  int fds[2];
  if (pipe(fds) != 0) return {};
  const pid_t measurer = fork();
  if (measurer == 0) {  // only async-signal-safe calls from here on
    close(fds[0]);
    Peak p;
    const pid_t run = fork();
    if (run == 0) {
      const int null = open("/dev/null", O_WRONLY);
      dup2(null, STDOUT_FILENO);
      execv(cargv[0], cargv.data());
      _exit(127);
    }
    rusage usage{};
    if (run > 0 && waitpid(run, &p.status, 0) == run && getrusage(RUSAGE_CHILDREN, &usage) == 0)
      p.maxRssKiB = usage.ru_maxrss;
    _exit(write(fds[1], &p, sizeof p) == ssize_t(sizeof p) ? 0 : 1);
  }
  close(fds[1]);
  Peak p;
  if (measurer < 0 || read(fds[0], &p, sizeof p) != ssize_t(sizeof p)) p = {};
  close(fds[0]);
  if (measurer > 0) waitpid(measurer, nullptr, 0);
  return p;
}

// Shapes whose peaks grow with the ranks in different ways: a row layer whose input and output
// every rank holds whole (unverified, the run alone is the peak), a sequence-parallel MLP whose
// ranks each gather the whole sequence, and a column layer whose weight is nearly all of it (the
// reference takes it a block of rows at a time), alone and with GTP_remat (whose gathers left
// resident would add a fifth to its peak were they not handed back before the verification).
struct Shape {
  const char* name;
  std::vector<std::string> flags;
  const char* threads = "2";
};
const Shape kRow{"row", {"--layer", "row", "--batch", "16", "--seq", "64", "--in-features", "1024", "--out-features",
                         "256"}};
const Shape kRowUnverified{"row unverified", {"--layer", "row", "--batch", "64", "--seq", "64", "--in-features", "1024",
                                             "--out-features", "256", "--verify", "none"}};
const Shape kMlp{"mlp", {"--layer", "mlp", "--sequence-parallel", "--batch", "2", "--seq", "256", "--in-features",
                         "512", "--ffn-hidden", "4096"}};
// On one thread: its reduce-scatters fold the ranks' partial sums in rank order as they arrive, and
// over two threads how many of the 64 wait to be folded varies from run to run (peaks of 368-498
// MiB at T = 64 against an estimate of 456 MiB), which the estimate does not model.
const Shape kLongMlp{"long mlp", {"--layer", "mlp", "--sequence-parallel", "--batch", "2", "--seq", "2048",
                                  "--in-features", "1024", "--ffn-hidden", "1024", "--verify", "none"},
                  "1"};
const Shape kWideColumn{"column", {"--layer", "column", "--batch", "2", "--seq", "16", "--in-features", "2048",
                                   "--out-features", "4096"}};
// A column whose weight is nearly all of the run, unverified, at T = 1: its one rank cuts the whole
// weight at once (0.99 with the 2 bytes an element fitted on runs of more ranks).
const Shape kColumnWeights{"column weights", {"--layer", "column", "--batch", "2", "--seq", "16", "--in-features",
                                              "4096", "--out-features", "8192", "--verify", "none"}};
// One of each kind whose reference holds the peak, each by its own coefficients: the linear kinds'
// and the grouped experts' bytes an activation element, the embedding's blocks of its gradient.
const Shape kColumn{"column", {"--layer", "column", "--batch", "4", "--seq", "256", "--in-features", "1024",
                               "--out-features", "1024"}};
const Shape kSequenceParallelRow{"row SP", {"--layer", "row", "--batch", "4", "--seq", "256", "--in-features", "1024",
                                            "--out-features", "1024", "--sequence-parallel", "--input-is-parallel"}};
const Shape kEmbedding{"embedding", {"--layer", "embedding", "--vocab", "8192", "--out-features", "512", "--batch", "4",
                                     "--seq", "256"}};
const Shape kGroupedColumn{"grouped column", {"--layer", "grouped-column", "--tokens", "4096", "--experts", "4",
                                              "--in-features", "512", "--out-features", "1024"}};
const Shape kGroupedRow{"grouped row", {"--layer", "grouped-row", "--tokens", "4096", "--experts", "4", "--in-features",
                                        "1024", "--out-features", "512"}};
// The grouped experts: one expert, whose reference holds its tokens' results and magnitudes whole
// (0.84 when they were counted as the reference's share of every expert's, 32 bytes an element),
// and eight whose weights are nearly all of the run, which the run holds for each rank's experts
// only while the threads run them (1.66 at 14 bytes a parameter whatever the threads).
const Shape kGroupedOneExpert{"grouped one expert", {"--layer", "grouped-row", "--tokens", "4096", "--experts", "1",
                                                     "--in-features", "1024", "--out-features", "512"}};
const Shape kGroupedWeights{"grouped weights", {"--layer", "grouped-column", "--tokens", "64", "--experts", "8",
                                                "--in-features", "2048", "--out-features", "2048"}};
// GTP_remat gathers all eight experts' weights at once and reduce-scatters all their wgrads at once
// (0.46 with one weight's counted, as for the other kinds), on one thread.
const Shape kGroupedWeightsGtp{"grouped weights G=2", {"--layer", "grouped-column", "--tokens", "64", "--experts",
                                                       "8", "--in-features", "2048", "--out-features", "2048",
                                                       "--gtp-remat", "2", "--verify", "none"},
                               "1"};
// bf16: the results the ranks keep counted in the run's dtype (at 4 bytes an element the fused
// column reads 1.32 on a Zen 3 EPYC; with the embedding's 46 bytes a table element, not 40, as well,
// the embedding 1.35).
const Shape kEmbeddingBf16{"embedding bf16", {"--layer", "embedding", "--vocab", "8192", "--out-features", "512",
                                              "--batch", "4", "--seq", "256", "--dtype", "bf16"}};
const Shape kColumnBf16Fused{"column bf16 fused", {"--layer", "column", "--batch", "4", "--seq", "256", "--in-features",
                                                   "1024", "--out-features", "1024", "--dtype", "bf16",
                                                   "--grad-accumulation-fusion"}};
// GTP_remat 4, on one thread: over two its peak depends on how many peers wait at the weight
// gradients' reduce-scatter with their wgrads held, 1150 MiB with the machine otherwise idle and
// 988 MiB (the one thread's) beside another test.
const Shape kWideColumnGtp{"column G=4", {"--layer", "column", "--batch", "4", "--seq", "16", "--in-features", "4096",
                                          "--out-features", "8192", "--gtp-remat", "4"},
                           "1"};

// Weights that are nearly all of the run, verified: the MLP's reference holds its weights whole in
// blocks of F when there are few tokens (with them packed and their gradients' bounds' float
// products: 0.94 without), and MXFP8 weights' quantized copies and their making (the column 0.90,
// the MLP 0.67 without). The column on one thread: over two its peak varies from run to run by a
// fifth (322-392 MiB, 1.11-1.35), with the threads' heaps holding the copies; on one, 358-365.
const Shape kWideMlp{"mlp weights", {"--layer", "mlp", "--batch", "2", "--seq", "16", "--in-features", "1024",
                                     "--ffn-hidden", "4096"}};
const Shape kWideMlpMxfp8{"mlp weights mxfp8", {"--layer", "mlp", "--batch", "2", "--seq", "16", "--in-features",
                                                "1024", "--ffn-hidden", "4096", "--weight-format", "mxfp8"}};
const Shape kWideColumnMxfp8{"column mxfp8", {"--layer", "column", "--batch", "2", "--seq", "16", "--in-features",
                                              "2048", "--out-features", "4096", "--weight-format", "mxfp8"},
                             "1"};

// A verified row whose weight (2048 x 16384) is most of the run: the reference's products over the
// whole |W| keep the packed operands of its blocks' products in double and of their own beside |W|
// in float, 126 MB at 512 tokens (0.97 before the estimate counted them).
const Shape kWideRowVerified{"row wide weight", {"--layer", "row", "--input-is-parallel", "--batch", "2", "--seq",
                                                 "256", "--in-features", "16384", "--out-features", "2048"}};

// A table that is nearly all of the run, verified: the reference reads it in place and takes its
// gradient a block of rows at a time, so the run holds the peak, where the ranks' backend gradients
// are scatter-adds that touch few rows (at 14 bytes a table element, as for the linear kinds, and
// with packed operands, T = 8 read 1.44), and under GTP_remat the peers' gathered tables (on one
// thread: at 2 its reduce-scatter's peak varies as the column's does).
const Shape kEmbeddingTable{"embedding table", {"--layer", "embedding", "--vocab", "65536", "--out-features", "512",
                                                "--batch", "4", "--seq", "256"}};
const Shape kEmbeddingTableGtp{"embedding table G=4", {"--layer", "embedding", "--vocab", "65536", "--out-features",
                                                       "512", "--batch", "4", "--seq", "256", "--gtp-remat", "4"},
                               "1"};

// An embedding whose output is the run, unverified: each rank makes its whole output, a partial
// lookup, before the reduce-scatter leaves it its share (0.60 where the estimate counted the share
// alone), and in bf16 every copy is of 2-byte elements (2.09 at fp32's bytes).
std::vector<std::string> embeddingOutputFlags() {
  return {"--layer", "embedding", "--vocab", "1024", "--out-features", "4096", "--batch", "4", "--seq", "512",
          "--verify", "none"};
}
std::vector<std::string> withFlags(std::vector<std::string> flags, const std::vector<std::string>& more) {
  flags.insert(flags.end(), more.begin(), more.end());
  return flags;
}
const Shape kEmbeddingOutputReduceScattered{
    "embedding output reduce-scattered",
    withFlags(embeddingOutputFlags(), {"--reduce-scatter-embeddings", "--sequence-parallel"})};
const Shape kEmbeddingOutputBf16{"embedding output bf16", withFlags(embeddingOutputFlags(), {"--dtype", "bf16"})};

// GTP_remat on a column whose weight is nearly all of the run, unverified: the peak is the weight
// gradients' reduce-scatter, where a group's peers hold their whole TP-local wgrads beside the sum.
// On two threads at T = 1, whose peak is steady (1124-1157 MiB at G = 3), and on one thread, where
// the peers arrive one after another: on two, from T = 2 the peak depends on the schedule (G = 4,
// T = 2: 991-1154 MiB, the least beside another test), and at T = 1 with G = 4 it varies too
// (1201-1330 MiB).
std::vector<std::string> gtpWeightFlags(int gtp) {
  return {"--layer", "column", "--batch", "24", "--seq", "4", "--in-features", "4096", "--out-features", "8208",
          "--verify", "none", "--pad-for-alignment", "0", "--gtp-remat", std::to_string(gtp)};
}
const Shape kGtpWeightsG3{"gtp weights G=3", gtpWeightFlags(3)};
const Shape kGtpWeightsG3OneThread{"gtp weights G=3 one thread", gtpWeightFlags(3), "1"};
const Shape kGtpWeightsG4OneThread{"gtp weights G=4 one thread", gtpWeightFlags(4), "1"};

class MemoryEstimate : public ::testing::TestWithParam<std::tuple<Shape, int>> {};

TEST_P(MemoryEstimate, CoversTheMeasuredPeakWithin30Percent) {
  const auto& [shape, tp] = GetParam();
  std::vector<std::string> args = shape.flags;
  for (const std::string& flag : {std::string("--tp"), std::to_string(tp), std::string("--threads"), std::string(shape.threads)})
    args.push_back(flag);
  const RunArgs parsed = parseRunArgs(args);
  RunScope scope;
  scope.resultsRead = parsed.verify != VerifyMode::kNone || !parsed.saveDir.empty();
  const double estimate = estimateRunBytes(parsed.config, tensorShapes(parsed.config), parsed.verify, scope);
  std::vector<std::string> run{"run"};
  run.insert(run.end(), args.begin(), args.end());
  const Peak peak = peakOf(run);
  ASSERT_GT(peak.maxRssKiB, 0) << shape.name << " T=" << tp << ": no peak resident memory read for the run";
  ASSERT_TRUE(WIFEXITED(peak.status) && WEXITSTATUS(peak.status) == 0)
      << shape.name << " T=" << tp << ": tpsim run ended with wait status " << peak.status;
  const double measured = double(peak.maxRssKiB) * 1024, ratio = estimate / measured;
  char ratioText[16];
  std::snprintf(ratioText, sizeof ratioText, "%.3f", ratio);
  const std::string figures = std::string(shape.name) + " T=" + std::to_string(tp) + ": estimate " + bytesText(estimate) + ", peak RSS " +
                              bytesText(measured) + ", ratio " + ratioText;
  EXPECT_GE(ratio, 1.0) << figures << ": the estimate must not be under the peak";
  EXPECT_LE(ratio, 1.3) << figures << ": the estimate must be within 1.3 times the peak";
  std::printf("%s\n", figures.c_str());
}

// A test's name from its shape's and its rank count: "column_mxfp8_T2", "gtp_weights_G_3_one_thread_T1".
std::string shapeAndRanks(const ::testing::TestParamInfo<std::tuple<Shape, int>>& info) {
  std::string name = std::get<0>(info.param).name;
  for (char& ch : name)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return name + "_T" + std::to_string(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Row, MemoryEstimate, ::testing::Combine(::testing::Values(kRow), ::testing::Values(1, 4, 16, 64)),
                         [](const auto& info) { return "T" + std::to_string(std::get<1>(info.param)); });
INSTANTIATE_TEST_SUITE_P(RowUnverified, MemoryEstimate,
                         ::testing::Combine(::testing::Values(kRowUnverified), ::testing::Values(1, 4)),
                         [](const auto& info) { return "T" + std::to_string(std::get<1>(info.param)); });
INSTANTIATE_TEST_SUITE_P(WideColumn, MemoryEstimate, ::testing::Combine(::testing::Values(kWideColumn), ::testing::Values(2)),
                         [](const auto& info) { return "T" + std::to_string(std::get<1>(info.param)); });
INSTANTIATE_TEST_SUITE_P(ColumnWeights, MemoryEstimate,
                         ::testing::Combine(::testing::Values(kColumnWeights), ::testing::Values(1)), shapeAndRanks);
INSTANTIATE_TEST_SUITE_P(WideColumnGtp, MemoryEstimate,
                         ::testing::Combine(::testing::Values(kWideColumnGtp), ::testing::Values(2)),
                         [](const auto& info) { return "T" + std::to_string(std::get<1>(info.param)); });
INSTANTIATE_TEST_SUITE_P(WeightsAreTheRun, MemoryEstimate,
                         ::testing::Combine(::testing::Values(kWideMlp, kWideMlpMxfp8, kWideColumnMxfp8),
                                            ::testing::Values(2)),
                         shapeAndRanks);
INSTANTIATE_TEST_SUITE_P(WideRowVerified, MemoryEstimate,
                         ::testing::Combine(::testing::Values(kWideRowVerified), ::testing::Values(4)), shapeAndRanks);
// The peers' whole wgrads at the reduce-scatter: the estimate's term for two threads and more, and
// its term for one.
INSTANTIATE_TEST_SUITE_P(GtpWeightsG3, MemoryEstimate,
                         ::testing::Combine(::testing::Values(kGtpWeightsG3), ::testing::Values(1)),
                         [](const auto& info) { return "T" + std::to_string(std::get<1>(info.param)); });
INSTANTIATE_TEST_SUITE_P(GtpWeightsOneThread, MemoryEstimate,
                         ::testing::Combine(::testing::Values(kGtpWeightsG3OneThread, kGtpWeightsG4OneThread),
                                            ::testing::Values(1, 2, 4)),
                         shapeAndRanks);
INSTANTIATE_TEST_SUITE_P(EmbeddingTable, MemoryEstimate,
                         ::testing::Combine(::testing::Values(kEmbeddingTable), ::testing::Values(1, 8)),
                         shapeAndRanks);
INSTANTIATE_TEST_SUITE_P(EmbeddingTableGtp, MemoryEstimate,
                         ::testing::Combine(::testing::Values(kEmbeddingTableGtp), ::testing::Values(2)),
                         shapeAndRanks);
INSTANTIATE_TEST_SUITE_P(EmbeddingOutputReduceScattered, MemoryEstimate,
                         ::testing::Combine(::testing::Values(kEmbeddingOutputReduceScattered), ::testing::Values(4)),
                         shapeAndRanks);
INSTANTIATE_TEST_SUITE_P(EmbeddingOutputBf16, MemoryEstimate,
                         ::testing::Combine(::testing::Values(kEmbeddingOutputBf16), ::testing::Values(2)),
                         shapeAndRanks);
INSTANTIATE_TEST_SUITE_P(Grouped, MemoryEstimate,
                         ::testing::Combine(::testing::Values(kGroupedOneExpert, kGroupedWeights), ::testing::Values(4)),
                         shapeAndRanks);
INSTANTIATE_TEST_SUITE_P(GroupedGtp, MemoryEstimate,
                         ::testing::Combine(::testing::Values(kGroupedWeightsGtp), ::testing::Values(2)), shapeAndRanks);
INSTANTIATE_TEST_SUITE_P(EachKind, MemoryEstimate,
                         ::testing::Combine(::testing::Values(kColumn, kSequenceParallelRow, kEmbedding, kGroupedColumn,
                                                             kGroupedRow, kEmbeddingBf16, kColumnBf16Fused),
                                            ::testing::Values(4)),
                         shapeAndRanks);
INSTANTIATE_TEST_SUITE_P(SequenceParallelMlp, MemoryEstimate,
                         ::testing::Combine(::testing::Values(kMlp), ::testing::Values(8, 64)),
                         [](const auto& info) { return "T" + std::to_string(std::get<1>(info.param)); });
INSTANTIATE_TEST_SUITE_P(LongSequenceParallelMlp, MemoryEstimate,
                         ::testing::Combine(::testing::Values(kLongMlp), ::testing::Values(8, 64)),
                         [](const auto& info) { return "T" + std::to_string(std::get<1>(info.param)); });

// A column whose weight is nearly all of the run, unverified, loaded from a checkpoint saved at
// another TP: its files are held whole through the run, besides the parameters as a generated run
// holds them, and the buffers its ranks read their chunks into, which the results the ranks keep
// mostly reuse. Where the heap reuses them decides the peak, 785 or 849 MiB, so each load runs three
// times. At 849 the estimate reads 0.97 without the files counted; at 785, 1.38 with the files
// counted twice and 1.31 with the buffers (tpsim_mpi_memory_p8 fails without the files too, and with
// them counted twice).
class CheckpointMemoryEstimate : public ::testing::TestWithParam<int> {};

TEST_P(CheckpointMemoryEstimate, ALoadIsCoveredWithin30Percent) {
  const testing::ScratchDir dir;
  const std::string checkpoint = dir.file("checkpoint");
  const std::vector<std::string> sizes{"--layer", "column", "--batch", std::to_string(GetParam()), "--seq", "16",
                                       "--in-features", "4096", "--out-features", "8192", "--verify", "none",
                                       "--threads", "2"};
  std::vector<std::string> save = withFlags(withFlags({"run"}, sizes), {"--tp", "4", "--save-checkpoint", checkpoint});
  const Peak saved = peakOf(save);
  ASSERT_TRUE(WIFEXITED(saved.status) && WEXITSTATUS(saved.status) == 0) << "saving: wait status " << saved.status;
  const std::vector<std::string> args = withFlags(sizes, {"--tp", "2", "--load-checkpoint", checkpoint});
  const RunArgs parsed = parseRunArgs(args);
  const CheckpointIndex index(checkpoint);
  const CheckpointBuffers buffers{true, double(index.chunkCacheBytes(kInputPieceElements)),
                                  double(index.largestChunkBytes())};
  const double estimate = estimateRunBytes(parsed.config, tensorShapes(parsed.config), parsed.verify,
                                          {false, 1, true, buffers});
  for (int run = 0; run < 3; ++run) {
    const Peak peak = peakOf(withFlags({"run"}, args));
    ASSERT_TRUE(peak.maxRssKiB > 0 && WIFEXITED(peak.status) && WEXITSTATUS(peak.status) == 0)
        << "loading: wait status " << peak.status << ", peak " << peak.maxRssKiB << " KiB";
    const double measured = double(peak.maxRssKiB) * 1024, ratio = estimate / measured;
    const std::string figures = "batch " + std::to_string(GetParam()) + ": chunk cache " +
                                bytesText(buffers.cacheBytes) + ", estimate " + bytesText(estimate) +
                                ", peak RSS " + bytesText(measured) + ", ratio " + std::to_string(ratio);
    EXPECT_GE(ratio, 1.0) << figures << ": the estimate must not be under the peak";
    EXPECT_LE(ratio, 1.3) << figures << ": the estimate must be within 1.3 times the peak";
    std::printf("%s\n", figures.c_str());
  }
}

INSTANTIATE_TEST_SUITE_P(Batch, CheckpointMemoryEstimate, ::testing::Values(1, 2));

TEST(MemoryGrowth, ASequenceParallelMlpPeaksAtMost25PercentHigherAt64RanksThanAt8) {
  long peaks[2] = {0, 0};
  for (int i = 0; i < 2; ++i) {
    std::vector<std::string> run{"run"};
    run.insert(run.end(), kLongMlp.flags.begin(), kLongMlp.flags.end());
    for (const char* flag : {"--tp", i == 0 ? "8" : "64", "--threads", kLongMlp.threads}) run.push_back(flag);
    const Peak peak = peakOf(run);
    ASSERT_TRUE(peak.maxRssKiB > 0 && WIFEXITED(peak.status) && WEXITSTATUS(peak.status) == 0)
        << "T=" << (i == 0 ? 8 : 64) << ": wait status " << peak.status << ", peak " << peak.maxRssKiB << " KiB";
    peaks[i] = peak.maxRssKiB;
  }
  const double growth = double(peaks[1]) / double(peaks[0]);
  EXPECT_LE(growth, 1.25) << "peak at T=8 " << peaks[0] << " KiB, at T=64 " << peaks[1] << " KiB";
  std::printf("long mlp: peak at T=8 %ld KiB, at T=64 %ld KiB, growth %.3f\n", peaks[0], peaks[1], growth);
}

}  // namespace
}  // namespace tpsim::tools
