// Timelines of a run: what each rank computed and communicated, and when, as a Chrome Trace
// Event file (Perfetto, chrome://tracing) and a per-rank summary.
//
// Recording wraps a rank's Compute and Collectives in decorators that log every op in program
// order, so neither the layers nor the backends know about it. Two clocks place the log in time:
// measured (this run's host wall time per rank) and model (a device's roofline per compute op,
// an alpha-beta cost per collective that starts when its last member arrives). Not a profiler:
// the simulator's wall time says little about a GPU, and the model ignores launch overheads,
// contention between overlapping collectives and everything that is not in the log.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backends/collectives.h"
#include "backends/compute.h"
#include "core/rank_grid.h"

namespace tpsim::tools {

struct ComputeRecord {
  std::string name;                  // "gemm", "gelu", "cast fp32->bf16", ...
  std::string dtype;                 // the dtype the op computes in (gemm: its operands')
  std::int64_t m = 0, n = 0, k = 0;  // gemm: (M,K)·(K,N)
  double flops = 0;                  // gemm: 2·M·N·K; elementwise ops count bytes only
  double bytes = 0;                  // memory read and written
  double start = 0, end = 0;         // measured, µs since the recording began
};

struct CommRecord {
  std::string op;      // "allReduce", ...
  std::string group;   // "tp[0-3]", as the fabric's messages name it
  std::uint64_t seq = 0;
  std::string dtype;
  std::int64_t inBytes = 0, outBytes = 0;  // this member's buffers
  int size = 1;                            // group members
  double issued = 0, waitStart = -1, completed = -1;  // measured µs; -1: never waited on
};

// One rank's log. Steps keep program order across the two kinds of record.
struct RankRecord {
  enum class Step : std::uint8_t { kCompute, kIssue, kWait };
  std::vector<ComputeRecord> compute;
  std::vector<CommRecord> comms;
  std::vector<std::pair<Step, std::size_t>> steps;  // (kind, index into compute or comms)
};

// Decorators that log into `record`, timing from `t0`. The group splits are not logged (they
// only build groups) but the communicators they return log too.
using TraceClock = std::chrono::steady_clock;
std::unique_ptr<Compute> recordingCompute(Compute& inner, RankRecord& record, TraceClock::time_point t0);
std::unique_ptr<Collectives> recordingCollectives(Collectives& inner, RankRecord& record, TraceClock::time_point t0);

// What --device-model names: peak matrix throughput per dtype, memory bandwidth, and one link.
struct DeviceModel {
  std::string name;
  double tflopsFp32 = 0, tflopsBf16 = 0, tflopsFp16 = 0, tflopsFp64 = 0;  // dense matrix TFLOP/s
  double memoryGBps = 0;     // HBM bandwidth, GB/s
  double linkLatencyUs = 0;  // alpha: fixed cost of one collective, µs
  double linkGBps = 0;       // beta: per-GPU bus bandwidth of the link, one direction, GB/s
};
// A preset (h100-nvlink, h200-nvlink, a100-nvlink, pcie) or a key=value file with tflops.fp32,
// tflops.bf16, tflops.fp16, tflops.fp64, memory_gbps, link_latency_us and link_gbps, '#'
// comments. Throws InvalidArgument naming the preset or file, the key and the value.
DeviceModel deviceModel(const std::string& presetOrFile);
// Costs in µs: max(flops/peak, bytes/bandwidth) per op, and alpha + bytes·factor/bandwidth
// with nccl-tests' bus-bandwidth factors (allReduce 2(n-1)/n over its buffer, allGather and
// reduceScatter (n-1)/n over the full buffer, broadcast 1); nothing moves on a group of one.
double computeCostUs(const DeviceModel& d, const ComputeRecord& op);
double collectiveCostUs(const DeviceModel& d, const CommRecord& c);

// Every record placed in time. Per rank, parallel to RankRecord's vectors.
struct RankTimeline {
  std::vector<double> computeStart, computeEnd;
  std::vector<double> issued, waitStart, completed;
};
std::vector<RankTimeline> measuredTimeline(const std::vector<RankRecord>& records);
// Ranks run their logs in order; a collective completes collectiveCostUs after its last member
// issued it, and a wait holds the rank's clock until then. Throws InternalError on a log that
// cannot complete (a run that succeeded never produces one).
std::vector<RankTimeline> modelTimeline(const std::vector<RankRecord>& records, const DeviceModel& device);

// Per rank, µs. total = compute + exposed + other; on the model clock other is 0.
struct RankSummary {
  double compute = 0;        // sum of compute ops
  double communication = 0;  // union of collectives, issue to completion
  double exposed = 0;        // waiting in wait() for a collective to complete
  double overlap = 0;        // communication while a compute op runs
  double other = 0;          // the rest: host work outside the logged ops (measured clock)
  double total = 0;          // the rank's last event
};
std::vector<RankSummary> summarize(const std::vector<RankRecord>& records, const std::vector<RankTimeline>& timeline);

// The Chrome Trace Event file (JSON object format): a process per rank named processNames[r],
// a compute track and as many communication tracks as collectives overlap, a complete event per
// op and collective, flow events linking each collective's members, and the summary under
// "otherData". clock: "measured" or "model (<device name>)".
std::string chromeTrace(const std::vector<RankRecord>& records, const std::vector<RankTimeline>& timeline,
                        const std::vector<std::string>& processNames, const std::string& clock);

// --trace FILE, --clock measured|model and --device-model, as run and demo take them.
struct TraceOptions {
  std::string file;                    // empty: no trace
  std::string clock = "measured";      // measured | model
  std::string device = "h100-nvlink";  // a preset or a file, for the model clock
  DeviceModel model;                   // set by checkTraceOptions
  std::string clockText() const;       // "measured" or "model (h100-nvlink)"
  std::string modelFile() const;       // the file the model is read from; empty for a preset or none
};
// Before the run: the clock's name, the device model (a file is read now), --clock and
// --device-model only with what they apply to, and a file path in an existing directory.
// Throws InvalidArgument naming the flag.
void checkTraceOptions(TraceOptions& options, bool clockGiven, bool deviceGiven);
// Places the records on the options' clock, writes the file (process names "rank r (t=.., g=..)"
// on the ranks of `grid`) and returns the per-rank summary.
std::vector<RankSummary> writeTrace(const TraceOptions& options, const std::vector<RankRecord>& records,
                                    const LayerGrid& grid);
// The summary as a fixed-column table, one rank a line, in µs.
std::string summaryTable(const std::vector<RankSummary>& summary);

}  // namespace tpsim::tools
