#include "tools/lib/trace.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <tuple>

#include <nlohmann/json.hpp>

#include "backends/errors.h"
#include "backends/world/rendezvous.h"
#include "tools/lib/input_file.h"
#include "tools/lib/output_files.h"

namespace tpsim::tools {
namespace {

using Step = RankRecord::Step;
// Insertion order kept: each event reads name first, as Chrome writes them.
using Json = nlohmann::ordered_json;

double since(TraceClock::time_point t0) {
  return std::chrono::duration<double, std::micro>(TraceClock::now() - t0).count();
}

double bytesOf(ConstView v) { return double(v.numel()) * double(dtypeSize(v.dtype())); }

class RecordingCompute final : public Compute {
 public:
  RecordingCompute(Compute& inner, RankRecord& record, TraceClock::time_point t0)
      : inner_(inner), record_(record), t0_(t0) {}

  Device device() const override { return inner_.device(); }
  // Allocation and the tool's own host transfers are not the layer's work: not logged.
  Tensor empty(Shape shape, DType dtype) override { return inner_.empty(shape, dtype); }
  void upload(const void* host, View dst) override { inner_.upload(host, dst); }
  void download(ConstView src, void* host) override { inner_.download(src, host); }

  void fill(View y, double value) override {
    timed(op("fill", y.dtype(), bytesOf(y)), [&] { inner_.fill(y, value); });
  }
  void copy(ConstView x, View y) override {
    const std::string name = x.dtype() == y.dtype()
                                 ? std::string("copy")
                                 : detail::concat("cast ", dtypeName(x.dtype()), "->", dtypeName(y.dtype()));
    timed(op(name, y.dtype(), bytesOf(x) + bytesOf(y)), [&] { inner_.copy(x, y); });
  }
  void axpy(float alpha, ConstView x, View y) override {
    timed(op("axpy", y.dtype(), bytesOf(x) + 2 * bytesOf(y)), [&] { inner_.axpy(alpha, x, y); });
  }
  void scale(View y, float alpha) override {
    timed(op("scale", y.dtype(), 2 * bytesOf(y)), [&] { inner_.scale(y, alpha); });
  }
  void gemm(ConstView a, ConstView b, View c, float alpha, float beta) override {
    ComputeRecord r = op("gemm", a.dtype(), bytesOf(a) + bytesOf(b) + (beta != 0.f ? 2 : 1) * bytesOf(c));
    if (a.shape().rank() == 2 && c.shape().rank() == 2) {
      r.m = c.dim(0);
      r.n = c.dim(1);
      r.k = a.dim(1);
      r.flops = 2.0 * double(r.m) * double(r.n) * double(r.k);
    }
    timed(std::move(r), [&] { inner_.gemm(a, b, c, alpha, beta); });
  }
  void addBias(ConstView bias, View y) override {
    timed(op("addBias", y.dtype(), bytesOf(bias) + 2 * bytesOf(y)), [&] { inner_.addBias(bias, y); });
  }
  void sumRows(ConstView y, View out, float beta) override {
    timed(op("sumRows", y.dtype(), bytesOf(y) + (beta != 0.f ? 2 : 1) * bytesOf(out)),
          [&] { inner_.sumRows(y, out, beta); });
  }
  void gelu(ConstView x, View y) override {
    timed(op("gelu", y.dtype(), bytesOf(x) + bytesOf(y)), [&] { inner_.gelu(x, y); });
  }
  void geluBackward(ConstView x, ConstView dy, View dx) override {
    timed(op("geluBackward", dx.dtype(), bytesOf(x) + bytesOf(dy) + bytesOf(dx)),
          [&] { inner_.geluBackward(x, dy, dx); });
  }
  void quantizeMxfp8(ConstView x, View data, View scales, int axis) override {
    timed(op("quantizeMxfp8", x.dtype(), bytesOf(x) + bytesOf(data) + bytesOf(scales)),
          [&] { inner_.quantizeMxfp8(x, data, scales, axis); });
  }
  void dequantizeMxfp8(ConstView data, ConstView scales, int axis, View y) override {
    timed(op("dequantizeMxfp8", y.dtype(), bytesOf(data) + bytesOf(scales) + bytesOf(y)),
          [&] { inner_.dequantizeMxfp8(data, scales, axis, y); });
  }
  void gatherRows(ConstView table, ConstView ids, std::int64_t first, View out) override {
    timed(op("gatherRows", out.dtype(), bytesOf(ids) + 2 * bytesOf(out)),
          [&] { inner_.gatherRows(table, ids, first, out); });
  }
  void scatterAddRows(ConstView grad, ConstView ids, std::int64_t first, View table) override {
    timed(op("scatterAddRows", table.dtype(), bytesOf(ids) + 3 * bytesOf(grad)),
          [&] { inner_.scatterAddRows(grad, ids, first, table); });
  }

 private:
  static ComputeRecord op(std::string name, DType dtype, double bytes) {
    ComputeRecord r;
    r.name = std::move(name);
    r.dtype = dtypeName(dtype);
    r.bytes = bytes;
    return r;
  }

  template <typename F>
  void timed(ComputeRecord r, F&& run) {
    r.start = since(t0_);
    run();
    r.end = since(t0_);
    record_.steps.push_back({Step::kCompute, record_.compute.size()});
    record_.compute.push_back(std::move(r));
  }

  Compute& inner_;
  RankRecord& record_;
  TraceClock::time_point t0_;
};

class RecordingWork final : public Work {
 public:
  RecordingWork(std::unique_ptr<Work> inner, RankRecord& record, std::size_t index, TraceClock::time_point t0)
      : inner_(std::move(inner)), record_(record), index_(index), t0_(t0) {}

  void wait() override {
    const bool first = record_.comms[index_].waitStart < 0;
    if (first) record_.comms[index_].waitStart = since(t0_);
    inner_->wait();
    if (!first) return;
    record_.comms[index_].completed = since(t0_);
    record_.steps.push_back({Step::kWait, index_});
  }
  bool isCompleted() override { return inner_->isCompleted(); }

 private:
  std::unique_ptr<Work> inner_;
  RankRecord& record_;
  std::size_t index_;
  TraceClock::time_point t0_;
};

class RecordingCollectives final : public Collectives {
 public:
  // Logs `inner`'s collectives; owns it when `owned` is set (a split's result).
  RecordingCollectives(Collectives& inner, std::unique_ptr<Collectives> owned, RankRecord& record,
                       TraceClock::time_point t0)
      : inner_(inner), owned_(std::move(owned)), record_(record), t0_(t0),
        name_(inner.label() + "[" + world::rankList(inner.globalRanks()) + "]") {}

  using Collectives::allReduce;
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  const std::vector<int>& globalRanks() const override { return inner_.globalRanks(); }
  const std::string& label() const override { return inner_.label(); }

  std::unique_ptr<Work> allReduce(ConstView in, View out, const AllReduceOptions& opts) override {
    return logged("allReduce", in, out, [&] { return inner_.allReduce(in, out, opts); });
  }
  std::unique_ptr<Work> allGather(ConstView in, View out, const CollectiveOptions& opts) override {
    return logged("allGather", in, out, [&] { return inner_.allGather(in, out, opts); });
  }
  std::unique_ptr<Work> allGatherShared(ConstView in, const Shape& outShape, Compute& compute, SharedTensor& out,
                                        const CollectiveOptions& opts) override {
    const ConstView planned(nullptr, outShape, in.dtype(), in.device());
    return logged("allGather", in, planned,
                  [&] { return inner_.allGatherShared(in, outShape, compute, out, opts); });
  }
  std::unique_ptr<Work> reduceScatter(ConstView in, View out, const ReduceScatterOptions& opts) override {
    return logged("reduceScatter", in, out, [&] { return inner_.reduceScatter(in, out, opts); });
  }
  std::unique_ptr<Work> reduceScatterConsuming(Tensor in, View out, const ReduceScatterOptions& opts) override {
    const ConstView given = in;
    return logged("reduceScatter", given, out,
                  [&] { return inner_.reduceScatterConsuming(std::move(in), out, opts); });
  }
  std::unique_ptr<Work> broadcast(ConstView in, View out, const BroadcastOptions& opts) override {
    // Only the root's input is read: every member logs the output's size.
    return logged("broadcast", out, out, [&] { return inner_.broadcast(in, out, opts); });
  }
  std::unique_ptr<Work> allToAll(ConstView in, View out, const CollectiveOptions& opts) override {
    return logged("allToAll", in, out, [&] { return inner_.allToAll(in, out, opts); });
  }
  std::unique_ptr<Work> barrier(const CollectiveOptions& opts) override {
    return logged("barrier", ConstView(), ConstView(), [&] { return inner_.barrier(opts); });
  }
  std::unique_ptr<Collectives> split(int color, int key, const std::string& label) override {
    std::unique_ptr<Collectives> sub = inner_.split(color, key, label);
    ++nextSeq_;  // a split takes a sequence number on the parent like any collective
    if (!sub) return nullptr;
    Collectives& ref = *sub;
    return std::make_unique<RecordingCollectives>(ref, std::move(sub), record_, t0_);
  }

 private:
  template <typename Issue>
  std::unique_ptr<Work> logged(const char* opName, ConstView in, ConstView out, Issue&& issue) {
    CommRecord c;
    c.op = opName;
    c.group = name_;
    c.seq = nextSeq_++;
    c.dtype = in.data() || out.data() ? dtypeName(out.dtype()) : "none";
    c.inBytes = std::int64_t(bytesOf(in));
    c.outBytes = std::int64_t(bytesOf(out));
    c.size = inner_.size();
    c.issued = since(t0_);
    std::unique_ptr<Work> work = issue();
    const std::size_t index = record_.comms.size();
    record_.steps.push_back({Step::kIssue, index});
    record_.comms.push_back(std::move(c));
    return std::make_unique<RecordingWork>(std::move(work), record_, index, t0_);
  }

  Collectives& inner_;
  std::unique_ptr<Collectives> owned_;
  RankRecord& record_;
  TraceClock::time_point t0_;
  std::string name_;
  std::uint64_t nextSeq_ = 0;
};

// Datasheet figures; TFLOP/s are dense (no sparsity) tensor-core rates, except fp32, which is
// the non-tensor rate a plain fp32 GEMM gets (PyTorch does not use TF32 for matmuls by default).
// Link bandwidth is per GPU and direction (NVLink's quoted totals count both directions). The
// latency is not a datasheet figure: it is the few microseconds NCCL's small-message collectives
// take within one node, as nccl-tests reports them.
DeviceModel preset(const std::string& name) {
  DeviceModel d;
  d.name = name;
  if (name == "h100-nvlink") {
    // NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: FP32 67, BF16/FP16 989, FP64 tensor 67
    // TFLOP/s; HBM3 3.35 TB/s; NVLink 4 900 GB/s bidirectional.
    d.tflopsFp32 = 67, d.tflopsBf16 = d.tflopsFp16 = 989, d.tflopsFp64 = 67;
    d.memoryGBps = 3350, d.linkLatencyUs = 5, d.linkGBps = 450;
  } else if (name == "h200-nvlink") {
    // NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: the H100 SXM's compute, HBM3e 4.8 TB/s,
    // NVLink 900 GB/s bidirectional.
    d.tflopsFp32 = 67, d.tflopsBf16 = d.tflopsFp16 = 989, d.tflopsFp64 = 67;
    d.memoryGBps = 4800, d.linkLatencyUs = 5, d.linkGBps = 450;
  } else if (name == "a100-nvlink") {
    // NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM: FP32 19.5, BF16/FP16 312, FP64
    // tensor 19.5 TFLOP/s; HBM2e 2,039 GB/s; NVLink 3 600 GB/s bidirectional.
    d.tflopsFp32 = 19.5, d.tflopsBf16 = d.tflopsFp16 = 312, d.tflopsFp64 = 19.5;
    d.memoryGBps = 2039, d.linkLatencyUs = 5, d.linkGBps = 300;
  } else if (name == "pcie") {
    // NVIDIA H100 Tensor Core GPU datasheet, H100 PCIe: FP32 51, BF16/FP16 756, FP64 tensor 51
    // TFLOP/s; HBM2e 2 TB/s; PCIe Gen5 x16 128 GB/s bidirectional, no NVLink bridge.
    d.tflopsFp32 = 51, d.tflopsBf16 = d.tflopsFp16 = 756, d.tflopsFp64 = 51;
    d.memoryGBps = 2000, d.linkLatencyUs = 10, d.linkGBps = 64;
  } else {
    d.name.clear();
  }
  return d;
}

// A device model is a few hundred bytes (seven key = value lines and comments): these bounds keep
// any file named there from filling memory.
constexpr std::uint64_t kMaxDeviceModelBytes = 1 << 20;
constexpr std::size_t kMaxDeviceModelLine = 4096;

// What a device model file may say: TFLOP/s and GB/s from a millionth to a billion, link latencies
// up to a thousand seconds.
constexpr double kSlowestRate = 1e-6, kFastestRate = 1e9, kLongestLatencyUs = 1e9;

DeviceModel fromFile(const std::string& path) {
  const std::string where = "--device-model " + path;
  InputFile file(path, where, "a key=value file", [&](int) {
    return detail::concat("--device-model: expected h100-nvlink, h200-nvlink, a100-nvlink, pcie or a readable "
                          "key=value file, got '", path, "'");
  });
  file.checkSize(kMaxDeviceModelBytes);
  DeviceModel d;
  d.name = path;
  std::map<std::string, double*> keys = {
      {"tflops.fp32", &d.tflopsFp32},   {"tflops.bf16", &d.tflopsBf16},         {"tflops.fp16", &d.tflopsFp16},
      {"tflops.fp64", &d.tflopsFp64},   {"memory_gbps", &d.memoryGBps},         {"link_latency_us", &d.linkLatencyUs},
      {"link_gbps", &d.linkGBps}};
  std::map<std::string, bool> seen;
  std::string line;
  for (int number = 1; file.readLine(line, kMaxDeviceModelLine); ++number) {
    line = line.substr(0, line.find('#'));
    const auto notSpace = [](unsigned char ch) { return !std::isspace(ch); };
    const auto trim = [&](std::string s) {
      s.erase(s.begin(), std::find_if(s.begin(), s.end(), notSpace));
      s.erase(std::find_if(s.rbegin(), s.rend(), notSpace).base(), s.end());
      return s;
    };
    if (trim(line).empty()) continue;
    const std::size_t eq = line.find('=');
    const std::string key = trim(line.substr(0, eq)), text = eq == std::string::npos ? "" : trim(line.substr(eq + 1));
    TPSIM_CHECK(eq != std::string::npos && keys.count(key), where, ":", number,
                ": expected key = value with a key of tflops.fp32, tflops.bf16, tflops.fp16, tflops.fp64, "
                "memory_gbps, link_latency_us, link_gbps, got '", printable(trim(line)), "'");
    TPSIM_CHECK(!seen.count(key), where, ":", number, ": expected each key once, got ", key, " again");
    // Decimal numbers only: strtod would also read hex (0x14), "inf" and "nan".
    std::size_t used = 0;
    double v = -1;
    if (!text.empty() && text.find_first_not_of("0123456789.eE+-") == std::string::npos) {
      try {
        v = std::stod(text, &used);
      } catch (const std::exception&) {
        used = 0;
      }
    }
    const bool latency = key == "link_latency_us";
    TPSIM_CHECK(used != 0 && used == text.size() && std::isfinite(v) && (latency ? v >= 0 : v > 0), where, ":",
                number, ": expected ", key, " to be a decimal number", latency ? " >= 0" : " > 0", ", got '",
                printable(text), "'");
    // Rates and latencies a machine can have: any op or collective then costs a finite time.
    const double lowest = latency ? 0 : kSlowestRate, highest = latency ? kLongestLatencyUs : kFastestRate;
    TPSIM_CHECK(v >= lowest && v <= highest, where, ":", number, ": expected ", key, " in [", lowest, ", ", highest,
                "], got '", printable(text), "'");
    *keys[key] = v;
    seen[key] = true;
  }
  for (const auto& [key, ptr] : keys)
    TPSIM_CHECK(seen.count(key), where, ": expected a value for ", key, ", got none");
  return d;
}

double peakTflops(const DeviceModel& d, const std::string& dtype) {
  if (dtype == "bf16") return d.tflopsBf16;
  if (dtype == "fp16") return d.tflopsFp16;
  if (dtype == "fp64") return d.tflopsFp64;
  return d.tflopsFp32;
}

// The union of intervals, as sorted disjoint intervals.
std::vector<std::pair<double, double>> merged(std::vector<std::pair<double, double>> spans) {
  std::sort(spans.begin(), spans.end());
  std::vector<std::pair<double, double>> out;
  for (const auto& s : spans) {
    if (!out.empty() && s.first <= out.back().second)
      out.back().second = std::max(out.back().second, s.second);
    else
      out.push_back(s);
  }
  return out;
}

double lengthOf(const std::vector<std::pair<double, double>>& spans) {
  double total = 0;
  for (const auto& [b, e] : spans) total += e - b;
  return total;
}

// Both inputs merged (sorted, disjoint).
double intersection(const std::vector<std::pair<double, double>>& a, const std::vector<std::pair<double, double>>& b) {
  double total = 0;
  for (std::size_t i = 0, j = 0; i < a.size() && j < b.size();) {
    total += std::max(0.0, std::min(a[i].second, b[j].second) - std::max(a[i].first, b[j].first));
    a[i].second < b[j].second ? ++i : ++j;
  }
  return total;
}

// Microseconds rounded to the nanosecond. Spans write their start and end rounded and their
// duration as the difference, so touching spans on one track never overlap after rounding.
double toNs(double v) {
  TPSIM_INTERNAL_ASSERT(std::isfinite(v), "a trace time of ", v, " µs");  // the device model's ranges keep it finite
  return std::round(v * 1000) / 1000;
}

}  // namespace

std::string TraceOptions::clockText() const { return clock == "model" ? "model (" + model.name + ")" : clock; }

std::string TraceOptions::modelFile() const {
  return !file.empty() && clock == "model" && preset(device).name.empty() ? device : "";
}

void checkTraceOptions(TraceOptions& o, bool clockGiven, bool deviceGiven) {
  TPSIM_CHECK(!clockGiven || !o.file.empty(), "--clock: applies with --trace FILE, got no --trace");
  TPSIM_CHECK(o.clock == "measured" || o.clock == "model", "--clock: expected measured or model, got '", o.clock, "'");
  TPSIM_CHECK(!deviceGiven || o.clock == "model", "--device-model: applies to --clock model, got --clock ", o.clock);
  if (o.file.empty()) return;
  const std::filesystem::path path(o.file);
  const std::filesystem::path dir = path.has_parent_path() ? path.parent_path() : std::filesystem::path(".");
  // A symlink to a directory passes here: the writer refuses it, naming what it leads to.
  TPSIM_CHECK(path.has_filename() &&
                  (!std::filesystem::is_directory(path) || std::filesystem::is_symlink(path)) &&
                  std::filesystem::is_directory(dir),
              "--trace: expected a file path in an existing directory, got '", o.file, "'");
  if (o.clock == "model") o.model = deviceModel(o.device);
}

std::vector<RankSummary> writeTrace(const TraceOptions& o, const std::vector<RankRecord>& records,
                                    const LayerGrid& grid) {
  const std::vector<RankTimeline> timeline =
      o.clock == "model" ? modelTimeline(records, o.model) : measuredTimeline(records);
  std::vector<std::string> names;
  for (std::size_t r = 0; r < records.size(); ++r)
    names.push_back(detail::concat("rank ", r, " (t=", grid.t(int(r)), ", g=", grid.g(int(r)), ")"));
  OutputFiles output("--trace");
  output.write(o.file, chromeTrace(records, timeline, names, o.clockText()));
  output.commit();
  return summarize(records, timeline);
}

std::string summaryTable(const std::vector<RankSummary>& summary) {
  char line[160];
  std::snprintf(line, sizeof line, "%-6s %12s %14s %12s %12s %12s %12s\n", "rank", "compute", "communication",
                "exposed", "overlap", "other", "total");
  std::string s = line;
  for (std::size_t r = 0; r < summary.size(); ++r) {
    const RankSummary& x = summary[r];
    std::snprintf(line, sizeof line, "%-6zu %12.3f %14.3f %12.3f %12.3f %12.3f %12.3f\n", r, x.compute,
                  x.communication, x.exposed, x.overlap, x.other, x.total);
    s += line;
  }
  return s;
}

std::unique_ptr<Compute> recordingCompute(Compute& inner, RankRecord& record, TraceClock::time_point t0) {
  return std::make_unique<RecordingCompute>(inner, record, t0);
}

std::unique_ptr<Collectives> recordingCollectives(Collectives& inner, RankRecord& record, TraceClock::time_point t0) {
  return std::make_unique<RecordingCollectives>(inner, nullptr, record, t0);
}

DeviceModel deviceModel(const std::string& presetOrFile) {
  DeviceModel d = preset(presetOrFile);
  return d.name.empty() ? fromFile(presetOrFile) : d;
}

double computeCostUs(const DeviceModel& d, const ComputeRecord& op) {
  const double flopsPerUs = peakTflops(d, op.dtype) * 1e6, bytesPerUs = d.memoryGBps * 1e3;
  return std::max(op.flops / flopsPerUs, op.bytes / bytesPerUs);
}

double collectiveCostUs(const DeviceModel& d, const CommRecord& c) {
  if (c.size <= 1) return 0;
  const double n = c.size, ring = (n - 1) / n;
  double bytes = 0;  // what crosses each GPU's link, as nccl-tests' busbw counts it
  if (c.op == "allReduce") bytes = 2 * ring * double(c.inBytes);
  else if (c.op == "allGather") bytes = ring * double(c.outBytes);
  else if (c.op == "reduceScatter" || c.op == "allToAll") bytes = ring * double(c.inBytes);
  else if (c.op == "broadcast") bytes = double(c.outBytes);
  return d.linkLatencyUs + bytes / (d.linkGBps * 1e3);
}

std::vector<RankTimeline> measuredTimeline(const std::vector<RankRecord>& records) {
  std::vector<RankTimeline> out(records.size());
  for (std::size_t r = 0; r < records.size(); ++r) {
    for (const ComputeRecord& op : records[r].compute) {
      out[r].computeStart.push_back(op.start);
      out[r].computeEnd.push_back(op.end);
    }
    for (const CommRecord& c : records[r].comms) {
      out[r].issued.push_back(c.issued);
      out[r].waitStart.push_back(c.waitStart);
      out[r].completed.push_back(c.completed < 0 ? c.issued : c.completed);
    }
  }
  return out;
}

std::vector<RankTimeline> modelTimeline(const std::vector<RankRecord>& records, const DeviceModel& device) {
  struct Pending {
    int arrived = 0;
    double lastArrival = 0;
    double done = -1;
  };
  std::map<std::pair<std::string, std::uint64_t>, Pending> collectives;
  const std::size_t n = records.size();
  std::vector<RankTimeline> out(n);
  std::vector<double> clock(n, 0.0);
  std::vector<std::size_t> next(n, 0);
  for (std::size_t r = 0; r < n; ++r) {
    out[r].computeStart.assign(records[r].compute.size(), 0);
    out[r].computeEnd.assign(records[r].compute.size(), 0);
    out[r].issued.assign(records[r].comms.size(), 0);
    out[r].waitStart.assign(records[r].comms.size(), -1);
    out[r].completed.assign(records[r].comms.size(), 0);
  }
  // Run every rank as far as it can; a rank stops at a wait whose collective some member has not
  // issued yet. The log of a run that completed always drains.
  for (bool progress = true; progress;) {
    progress = false;
    for (std::size_t r = 0; r < n; ++r) {
      const RankRecord& rec = records[r];
      for (; next[r] < rec.steps.size(); ++next[r], progress = true) {
        const auto [step, i] = rec.steps[next[r]];
        if (step == Step::kCompute) {
          out[r].computeStart[i] = clock[r];
          clock[r] += computeCostUs(device, rec.compute[i]);
          out[r].computeEnd[i] = clock[r];
          continue;
        }
        const CommRecord& c = rec.comms[i];
        Pending& p = collectives[{c.group, c.seq}];
        if (step == Step::kIssue) {
          out[r].issued[i] = clock[r];
          out[r].completed[i] = -1;
          p.lastArrival = std::max(p.lastArrival, clock[r]);
          if (++p.arrived == c.size) p.done = p.lastArrival + collectiveCostUs(device, c);
          continue;
        }
        if (p.done < 0) break;  // kWait on a collective still missing members
        out[r].waitStart[i] = clock[r];
        clock[r] = std::max(clock[r], p.done);
      }
    }
  }
  for (std::size_t r = 0; r < n; ++r) {
    TPSIM_INTERNAL_ASSERT(next[r] == records[r].steps.size(), "rank ", r, "'s log stops at step ", next[r], " of ",
                          records[r].steps.size(), ": a collective never got all its members");
    // A collective's span ends when it completes, whether or not (or when) the rank waited.
    for (std::size_t i = 0; i < records[r].comms.size(); ++i) {
      const CommRecord& c = records[r].comms[i];
      out[r].completed[i] = collectives.at({c.group, c.seq}).done;
    }
  }
  return out;
}

std::vector<RankSummary> summarize(const std::vector<RankRecord>& records, const std::vector<RankTimeline>& timeline) {
  std::vector<RankSummary> out(records.size());
  for (std::size_t r = 0; r < records.size(); ++r) {
    const RankTimeline& t = timeline[r];
    RankSummary& s = out[r];
    std::vector<std::pair<double, double>> compute, comm;
    for (std::size_t i = 0; i < t.computeStart.size(); ++i) {
      s.compute += t.computeEnd[i] - t.computeStart[i];
      compute.push_back({t.computeStart[i], t.computeEnd[i]});
      s.total = std::max(s.total, t.computeEnd[i]);
    }
    for (std::size_t i = 0; i < t.issued.size(); ++i) {
      comm.push_back({t.issued[i], t.completed[i]});
      if (t.waitStart[i] >= 0) {
        s.exposed += std::max(0.0, t.completed[i] - t.waitStart[i]);
        s.total = std::max(s.total, std::max(t.completed[i], t.waitStart[i]));
      }
      s.total = std::max(s.total, t.issued[i]);
    }
    const auto computeSpans = merged(compute), commSpans = merged(comm);
    s.communication = lengthOf(commSpans);
    s.overlap = intersection(commSpans, computeSpans);
    s.other = s.total - s.compute - s.exposed;
  }
  return out;
}

std::string chromeTrace(const std::vector<RankRecord>& records, const std::vector<RankTimeline>& timeline,
                        const std::vector<std::string>& processNames, const std::string& clock) {
  Json events = Json::array();
  auto meta = [&](const char* name, std::size_t pid, int tid, Json args) {
    events.push_back({{"name", name}, {"ph", "M"}, {"ts", 0}, {"pid", pid}, {"tid", tid}, {"args", std::move(args)}});
  };
  // Each collective's op and members (pid, tid, span start, span end), to draw flows between.
  struct Members {
    std::string op;
    std::vector<std::tuple<std::size_t, int, double, double>> spans;
  };
  std::map<std::pair<std::string, std::uint64_t>, Members> members;
  for (std::size_t r = 0; r < records.size(); ++r) {
    const RankRecord& rec = records[r];
    const RankTimeline& t = timeline[r];
    meta("process_name", r, 0, {{"name", processNames[r]}});
    meta("process_sort_index", r, 0, {{"sort_index", r}});
    meta("thread_name", r, 0, {{"name", "compute"}});
    for (std::size_t i = 0; i < rec.compute.size(); ++i) {
      const ComputeRecord& op = rec.compute[i];
      Json args = {{"dtype", op.dtype}, {"bytes", std::int64_t(op.bytes)}};
      if (op.name == "gemm") {
        args["M"] = op.m;
        args["N"] = op.n;
        args["K"] = op.k;
        args["flops"] = std::int64_t(op.flops);
      }
      const double begin = toNs(t.computeStart[i]), end = toNs(t.computeEnd[i]);
      events.push_back({{"name", op.name}, {"cat", "compute"}, {"ph", "X"}, {"ts", begin}, {"dur", toNs(end - begin)},
                        {"pid", r}, {"tid", 0}, {"args", std::move(args)}});
    }
    // Collectives in flight at once go to separate tracks, so no track holds overlapping spans.
    std::vector<double> laneEnd;
    for (std::size_t i = 0; i < rec.comms.size(); ++i) {
      const CommRecord& c = rec.comms[i];
      const double begin = toNs(t.issued[i]), end = toNs(t.completed[i]);
      std::size_t lane = 0;
      while (lane < laneEnd.size() && laneEnd[lane] > begin) ++lane;
      if (lane == laneEnd.size()) {
        laneEnd.push_back(0);
        meta("thread_name", r, int(lane) + 1,
             {{"name", lane == 0 ? std::string("communication") : detail::concat("communication ", lane + 1)}});
      }
      laneEnd[lane] = end;
      events.push_back({{"name", c.op}, {"cat", "collective"}, {"ph", "X"}, {"ts", begin}, {"dur", toNs(end - begin)},
                        {"pid", r}, {"tid", lane + 1},
                        {"args", {{"op", c.op}, {"group", c.group}, {"seq", c.seq}, {"dtype", c.dtype},
                                  {"bytes", c.inBytes}}}});
      Members& m = members[{c.group, c.seq}];
      m.op = c.op;
      m.spans.push_back({r, int(lane) + 1, begin, end});
    }
  }
  // A flow from the collective's lowest rank to each other member, bound to the enclosing spans.
  std::int64_t id = 0;
  for (const auto& [key, m] : members) {
    const auto& spans = m.spans;
    const auto& [pid0, tid0, b0, e0] = spans.front();
    const std::string name = detail::concat(m.op, " ", key.first, " seq ", key.second);
    for (std::size_t i = 1; i < spans.size(); ++i) {
      const auto& [pid, tid, b, e] = spans[i];
      ++id;
      events.push_back({{"name", name}, {"cat", "collective"}, {"id", id}, {"ph", "s"}, {"ts", toNs((b0 + e0) / 2)},
                        {"pid", pid0}, {"tid", tid0}});
      events.push_back({{"name", name}, {"cat", "collective"}, {"id", id}, {"ph", "f"}, {"bp", "e"},
                        {"ts", toNs((b + e) / 2)}, {"pid", pid}, {"tid", tid}});
    }
  }
  Json ranks = Json::array();
  const std::vector<RankSummary> summary = summarize(records, timeline);
  for (std::size_t r = 0; r < summary.size(); ++r) {
    const RankSummary& s = summary[r];
    ranks.push_back({{"rank", r}, {"compute_us", toNs(s.compute)}, {"communication_us", toNs(s.communication)},
                     {"exposed_us", toNs(s.exposed)}, {"overlap_us", toNs(s.overlap)}, {"other_us", toNs(s.other)},
                     {"total_us", toNs(s.total)}});
  }
  const Json trace = {{"displayTimeUnit", "ns"},
                      {"traceEvents", std::move(events)},
                      {"otherData", {{"clock", clock}, {"ranks", std::move(ranks)}}}};
  // Bytes that are no part of a UTF-8 character (a path's, say) become U+FFFD, so the file stays
  // valid JSON; an indent of one keeps it readable line by line.
  return trace.dump(1, ' ', false, Json::error_handler_t::replace) + "\n";
}

}  // namespace tpsim::tools
