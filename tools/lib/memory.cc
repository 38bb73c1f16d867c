#include "tools/lib/memory.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "backends/errors.h"
#include "core/gtp.h"

namespace tpsim::tools {
namespace {

double numel(const ShapeMap& shapes, const std::string& name) {
  auto it = shapes.find(name);
  if (it == shapes.end()) return 0;
  double n = 1;
  for (std::int64_t d : it->second) n *= double(d);
  return n;
}

// The first number in `file` ("max" and unreadable files: nullopt).
std::optional<double> readNumber(const std::string& file) {
  std::ifstream in(file);
  double v = 0;
  if (in >> v) return v;
  return std::nullopt;
}

}  // namespace

// Counted in doubles (8 bytes), as the tools hold every unsharded tensor. With X, Y and W the
// input, output-gradient and parameter elements, H the MLP's tokens x F, T ranks and G GTP_remat
// peers:
//   run:    8(X + Y)  the inputs, the per-rank results as doubles, their reassembly
//         + T(2X + Y) each rank's own copy of the full input and output gradient, and of x
//         + (8 + 4(G - 1))Wp shards, backend copies, gradients, main_grad, GTP_remat gathers, with
//                     Wp the parameters' elements with GTP_remat's pad rows
//         + S         the kind's per-rank intermediates (LayerKind::stepIntermediates: the MLP's
//                     H, GeLU(H), dA, dH in fp32, 2H)
//   verify: 4W + R    the reference's |W| copies and products, and what the kind's reference holds
//                     at once (LayerKind::referenceIntermediates: the MLP's (tokens, F) matrices,
//                     for a block of F at a time, 8·min(H, max(2^21, 256 tokens))); freed run memory
//                     that malloc keeps is why it adds to the run, not maxes.
// Estimate / peak RSS measured with /usr/bin/time -v (Release, 2-core VM), 26 runs: 1.17-1.62.
// column (s=256, b=4, K=N=1024) T=1 1.46, T=4 1.47 (--verify none 1.34), T=8 SP bias 1.50,
// T=4 G=2 1.49, --disable-grad-reduce 1.46; (s=16, b=2, K=2048, N=4096) T=2 1.56 (none 1.17);
// mxfp8 T=8 G=4 1.44; row T=4 1.24, SP 1.60; embedding (V=8192, h=512) T=1 1.36, T=4 1.21,
// T=4 G=2 1.26; mlp (s=128, b=4, h=256, F=2048) T=4 1.31 (none 1.36), T=2 G=2 SP 1.41, --load
// T=2 1.27; (s=64, b=4, h=128, F=4096) T=1 1.40, T=8 1.62. Since the reference takes F in blocks
// and the CLI keeps freed memory for reuse (tools/cli/main.cc), 6 runs: 1.47-2.39: mlp (s=512, b=4,
// h=1024, F=4096) T=4 SP 2.39 (none 1.92), (s=128, b=4, h=256, F=2048) T=4 1.57, (s=64, b=4,
// h=128, F=4096) T=1 1.48, T=8 1.47, (s=256, b=8, h=512, F=8192) T=2 1.88; column (s=256, b=4,
// K=N=1024) T=4 2.01.
double estimateRunBytes(const RunConfig& c, const ShapeMap& shapes, VerifyMode verify) {
  const double T = c.tp, G = c.gtpRemat;
  const double x = numel(shapes, "input"), y = numel(shapes, "grad_output");
  // W as the run's tensors hold it, and as the ranks hold it: GTP_remat pads the TP-local rows of
  // each weight it shards, in every copy the ranks make.
  double w = 0, held = 0;
  for (const TensorSpec& t : c.layer->tensors(c)) {
    if (t.role != TensorRole::kParameter) continue;
    const double n = numel(shapes, t.name);
    w += n;
    held += n;
    const GtpWeightSpec* gtp = c.gtpRemat > 1 ? gtpWeightOf(c, t.name) : nullptr;
    const auto shape = shapes.find(t.name);
    if (gtp == nullptr || c.padForAlignment == 0 || shape == shapes.end() || shape->second.empty() ||
        shape->second[0] < 1)
      continue;
    const std::int64_t slices = gtp->tpCutsDim0 ? c.tp : 1, rows = shape->second[0];
    const double padRows = double(slices) * double(gtpRematShardDim0(rows / slices, c.gtpRemat, c.padForAlignment).padLength);
    held += padRows * (n / double(rows));
  }
  double doubles = 8 * (x + y) + T * (2 * x + y) + (8 + 4 * (G - 1)) * held + c.layer->stepIntermediates(c, shapes);
  if (c.disableGradReduce) doubles += 3 * T * x;  // input.grad is (T, s, b, K): results and reference
  if (verify != VerifyMode::kNone) doubles += 4 * w + c.layer->referenceIntermediates(c, shapes);
  const double base = 16.0 * (1 << 20) + 256.0 * 1024 * T * G;  // the program, threads, fiber stacks
  return base + 8 * doubles;
}

std::optional<AvailableMemory> availableMemory() {
  std::optional<AvailableMemory> out;
  std::ifstream meminfo("/proc/meminfo");
  for (std::string line; std::getline(meminfo, line);) {
    long long kb = 0;
    if (std::sscanf(line.c_str(), "MemAvailable: %lld kB", &kb) == 1)
      out = AvailableMemory{kb * 1024, "MemAvailable in /proc/meminfo"};
  }
  // cgroup v2, then v1 (where "no limit" is a number near 2^63).
  for (auto [limitFile, usageFile] : {std::pair{"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"},
                                      {"/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                       "/sys/fs/cgroup/memory/memory.usage_in_bytes"}}) {
    const std::optional<double> limit = readNumber(limitFile);
    if (!limit || *limit >= 0x1p62) continue;
    const double left = *limit - readNumber(usageFile).value_or(0);
    if (!out || left < double(out->bytes))
      out = AvailableMemory{std::int64_t(std::max(left, 0.0)), std::string("the cgroup's ") + limitFile +
                                                                   " less its usage"};
    break;
  }
  return out;
}

std::string bytesText(double bytes) {
  const char* units[] = {"bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  while (bytes >= 1024 && u < 6) {
    bytes /= 1024;
    ++u;
  }
  char text[64];
  std::snprintf(text, sizeof text, u == 0 ? "%.0f %s" : "%.1f %s", bytes, units[u]);
  return text;
}

void checkMemory(const RunConfig& c, const ShapeMap& shapes, VerifyMode verify, std::optional<std::int64_t> maxMemory,
                 const std::string& loadDir) {
  const double need = estimateRunBytes(c, shapes, verify);
  const std::optional<AvailableMemory> available = availableMemory();
  std::string limit;
  if (maxMemory && double(*maxMemory) < need) limit = "--max-memory " + bytesText(double(*maxMemory));
  else if (available && double(available->bytes) < need)
    limit = "the " + bytesText(double(available->bytes)) + " available (" + available->source + ")";
  if (limit.empty()) return;
  std::string from = "--tp " + std::to_string(c.tp);
  if (c.gtpRemat > 1) from += " --gtp-remat " + std::to_string(c.gtpRemat);
  if (loadDir.empty()) {
    for (const auto& [flag, value] : shapeFlags(c)) from += " --" + flag + " " + std::to_string(value);
  } else {
    from += ", the shapes of the --load files";
  }
  const char* verifyName = verify == VerifyMode::kBound ? "bound" : verify == VerifyMode::kExact ? "exact" : "none";
  throw InvalidArgument(detail::concat(
      "tpsim run: expected a run that fits in memory, got an estimated peak of ", bytesText(need), " for --layer ",
      c.layer->name(), " ", from, " and --verify ", verifyName, ", more than ", limit,
      "; use smaller sizes or fewer ranks", verify == VerifyMode::kNone ? "" : ", or --verify none"));
}

}  // namespace tpsim::tools
