// tpsim bench --backend gpu: what the layers and the DeviceFabric cost on a CUDA GPU, each figure
// next to a baseline measured in the same run (tools/cli/bench.cc does the same for the simulator).
//
//  layers  ColumnParallelLinear (h -> F), RowParallelLinear (F -> h, input parallel) and the MLP
//          block (column fc1, GeLU, row fc2), forward + backward, bf16, no bias, on gpu::World
//          with DeviceFabric: T ranks share one GPU, sequence parallel for T > 1. Baseline: the
//          unsharded layer's cuBLASLt GEMMs alone (same shapes, dtypes and FLOPs) on one
//          GpuCompute stream. Then, where PyTorch sees the GPU, the same unsharded layers in
//          torch.nn.functional.linear with autograd, in a child process of python3 (or $PYTHON).
//  fabric  DeviceFabric allGather and reduceScatter, bf16 and fp32, on 2, 4, 8 ranks sharing the
//          GPU: nccl-tests' table, against a device-to-device cudaMemcpyAsync that reads and
//          writes as many bytes as the collective's kernel does.
//
// Run time of the defaults on one H200 (~650 TFLOP/s bf16 on these shapes, ~4 TB/s of HBM):
// a column or row step is 3 GEMMs of 8192 x 8192 x 28672, 11.5 TFLOP, ~18 ms; an MLP step twice
// that. Each (layer, T) row times 13 steps of the layer and 13 of its baseline: ~0.5 s (column,
// row) and ~1 s (MLP), so the 12 rows take ~10 s with their setup. PyTorch: 5-15 s, mostly
// `import torch` and CUDA start-up, cut off at 60 s. Fabric: 60 rows, the largest (256 MiB per rank
// on 8 ranks, 4 GiB moved per collective, ~1 ms) ~50 ms with its memcpy; small ones are bound by
// the host's ~0.1 ms per collective: ~5 s. About 30 s in all, 80 s at most.
#include <sys/wait.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "backends/element_math.h"
#include "core/layers.h"
#include "gpu/check.h"
#include "gpu/device.h"
#include "gpu/gpu_compute.h"
#include "gpu/world.h"
#include "tools/cli/bench_gpu.h"
#include "tools/cli/cli.h"

namespace tpsim::tools {
namespace {

using Clock = std::chrono::steady_clock;
constexpr DType kBf16 = DType::kBFloat16;
constexpr const char* kSync = "tpsim bench";  // names the wait in a timeout message

// The machine's limits every figure is also stated against (NVIDIA's H200 datasheet, SXM and NVL:
// dense bf16 tensor-core rate, HBM3e bandwidth). 0 = unknown: another GPU, printed as nan.
struct Peak {
  double flops = 0, bytesPerSecond = 0;
};
Peak peakOf(const std::string& deviceName) {
  if (deviceName.find("H200 NVL") != std::string::npos) return {835e12, 4.8e12};
  if (deviceName.find("H200") != std::string::npos) return {989e12, 4.8e12};
  return {};
}
double percentOf(double value, double peak) { return peak > 0 ? 100 * value / peak : std::nan(""); }

double secondsSince(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

std::string joined(const std::vector<int>& v) {
  std::string s;
  for (int x : v) s += (s.empty() ? "" : ",") + std::to_string(x);
  return s;
}

struct Samples {
  double best, median;  // seconds
};

// A timing event on `device`, destroyed with its owner.
std::shared_ptr<CUevent_st> timingEvent(int device) {
  TPSIM_CUDA_CHECK(cudaSetDevice(device));
  cudaEvent_t e = nullptr;
  TPSIM_CUDA_CHECK(cudaEventCreate(&e));  // with timing
  return std::shared_ptr<CUevent_st>(e, [](cudaEvent_t x) { cudaEventDestroy(x); });
}

// Seconds from `start` to `end`, both recorded and completed on one device.
double eventSeconds(cudaEvent_t start, cudaEvent_t end) {
  float ms = 0;
  TPSIM_CUDA_CHECK(cudaEventElapsedTime(&ms, start, end));
  return ms / 1e3;
}

Samples summarize(std::vector<double> s) {
  std::sort(s.begin(), s.end());
  return {s.front(), s[s.size() / 2]};
}

// ---- Data --------------------------------------------------------------------------------------

// GEMM throughput depends on the data (tensor cores draw less power on constants), so the operands
// are random like PyTorch's randn: one tile of standard normals, uploaded once per rank and
// repeated from a different offset for each tensor, so that no two operands are the same matrix.
constexpr std::int64_t kTile = std::int64_t(1) << 20;

std::vector<float> normalTile() {
  std::mt19937 rng(1234);
  std::normal_distribution<float> normal;
  std::vector<float> v(static_cast<std::size_t>(kTile));
  for (float& x : v) x = normal(rng);
  return v;
}

Tensor deviceTile(Compute& compute, const std::vector<float>& host) {
  Tensor t = compute.empty({std::int64_t(host.size())}, DType::kFloat32);
  compute.upload(host.data(), t);
  return t;
}

// v = sigma · the tile repeated from element `offset`, rounded to v's dtype.
void fillNormal(Compute& compute, ConstView tile, View v, float sigma, std::int64_t offset) {
  const View flat = v.reshape(Shape{v.numel()});
  std::int64_t from = offset % tile.numel();
  for (std::int64_t at = 0; at < flat.numel(); from = 0) {
    const std::int64_t len = std::min(flat.numel() - at, tile.numel() - from);
    compute.copy(tile.slice(0, from, from + len), flat.slice(0, at, at + len));
    at += len;
  }
  compute.scale(v, sigma);
}

// ---- Layers ------------------------------------------------------------------------------------

enum class Layer { kColumn, kRow, kMlp };

const char* layerName(Layer l) {
  switch (l) {
    case Layer::kColumn: return "column";
    case Layer::kRow: return "row";
    case Layer::kMlp: break;
  }
  return "mlp";
}

// 2·M·N·K per GEMM; forward 1 and backward 2 GEMMs per linear, every one tokens x h x F.
double stepFlops(const GpuBenchConfig& c, Layer l) {
  return (l == Layer::kMlp ? 6 : 3) * 2.0 * double(c.tokens) * double(c.hidden) * double(c.ffn);
}

// Seconds of each timed forward + backward step of `layer` on T ranks sharing the GPU. A step is
// over when every rank's stream has drained: each rank synchronizes its GpuCompute and meets the
// others at a barrier before rank 0 reads the clock, so every kernel and collective is inside.
std::vector<double> layerSteps(const GpuBenchConfig& c, const gpu::GpuWorldOptions& go, Layer layer, int T,
                               const std::vector<float>& hostTile) {
  WorldOptions o;
  o.size = T;
  o.threads = c.threads;
  gpu::World world(o, go);
  std::vector<double> seconds;
  std::vector<std::shared_ptr<CUevent_st>> starts(static_cast<std::size_t>(T)), ends(static_cast<std::size_t>(T));
  world.run([&](RankContext& ctx) {
    Compute& compute = ctx.compute;
    const int rank = ctx.comm.rank();
    gpu::GpuCompute& device = world.compute(rank);
    starts[std::size_t(rank)] = timingEvent(device.deviceIndex());
    ends[std::size_t(rank)] = timingEvent(device.deviceIndex());
    const std::int64_t m = c.tokens, h = c.hidden, f = c.ffn, local = T > 1 ? m / T : m;
    ModelParallelConfig mp;
    mp.tensorModelParallelSize = T;
    mp.sequenceParallel = T > 1;
    mp.performInitialization = false;
    mp.paramsDtype = kBf16;
    const LayerContext lc{compute, ctx.comm};
    const InitMethod unused = initMethodNormal(0.02);  // the weights are filled below
    ColumnParallelOptions o1;
    o1.bias = false;
    o1.name = "fc1";
    RowParallelOptions o2;
    o2.bias = false;
    o2.inputIsParallel = true;
    o2.name = "fc2";
    const Tensor tile = deviceTile(compute, hostTile);
    std::optional<ColumnParallelLinear> fc1;
    std::optional<RowParallelLinear> fc2;
    if (layer != Layer::kRow) {
      fc1.emplace(lc, mp, h, f, unused, o1);
      fillNormal(compute, tile, fc1->weight()->data, float(1 / std::sqrt(double(h))), 1);
    }
    if (layer != Layer::kColumn) {
      fc2.emplace(lc, mp, f, h, unused, o2);
      fillNormal(compute, tile, fc2->weight().data, float(1 / std::sqrt(double(f))), 2);
    }
    // column: x (s/T, b, h) -> (s, b, F/T); row: x (s, b, F/T) -> (s/T, b, h); the MLP: both.
    Tensor x = compute.empty(layer == Layer::kRow ? Shape{m, 1, f / T} : Shape{local, 1, h}, kBf16);
    Tensor dy = compute.empty(layer == Layer::kColumn ? Shape{m, 1, f / T} : Shape{local, 1, h}, kBf16);
    fillNormal(compute, tile, x, 1.f, 3);
    fillNormal(compute, tile, dy, 1.f, 4);
    auto step = [&] {
      switch (layer) {
        case Layer::kColumn:
          fc1->forward(x);
          fc1->backward(dy);
          break;
        case Layer::kRow:
          fc2->forward(x);
          fc2->backward(dy);
          break;
        case Layer::kMlp: {
          Tensor hid = fc1->forward(x).output;  // (s, b, F/T)
          Tensor a = compute.empty(hid.shape(), kBf16);
          compute.gelu(hid, a);
          fc2->forward(a);
          Tensor dA = fc2->backward(dy);
          Tensor dH = compute.empty(hid.shape(), kBf16);
          compute.geluBackward(hid, dA, dH);
          fc1->backward(dH);
          break;
        }
      }
      // Every step starts without gradients (zero_grad(set_to_none=True)), so none is accumulated
      // into the last step's: that would add an axpy pass over the weights.
      if (fc1) fc1->weight()->grad = Tensor();
      if (fc2) fc2->weight().grad = Tensor();
    };
    for (int i = 0; i < c.warmup; ++i) step();
    // Device time: from the first rank's start event to the last rank's end event (elapsed times
    // from rank 0's start; negative for a rank that started before it). The barrier before the next
    // step keeps the events from being recorded again before rank 0 read them.
    for (int i = 0; i < c.steps; ++i) {
      device.synchronize(kSync);
      ctx.comm.barrier()->wait();
      TPSIM_CUDA_CHECK(cudaEventRecord(starts[std::size_t(rank)].get(), device.stream()));
      step();
      TPSIM_CUDA_CHECK(cudaEventRecord(ends[std::size_t(rank)].get(), device.stream()));
      device.synchronize(kSync);
      ctx.comm.barrier()->wait();
      if (rank == 0) {
        double first = 0, last = 0;
        for (int q = 0; q < T; ++q) {
          first = std::min(first, eventSeconds(starts[0].get(), starts[std::size_t(q)].get()));
          last = std::max(last, eventSeconds(starts[0].get(), ends[std::size_t(q)].get()));
        }
        seconds.push_back(last - first);
      }
    }
  });
  return seconds;
}

// One unsharded linear y = x·Wᵀ with its gradient operands and outputs.
struct LinearGemms {
  Tensor x, w, dy;  // (M, K), (N, K), (M, N)
  Tensor y, dx, dw;  // (M, N), (M, K), (N, K)

  LinearGemms(Compute& g, ConstView tile, std::int64_t m, std::int64_t k, std::int64_t n, std::int64_t offset)
      : x(g.empty({m, k}, kBf16)), w(g.empty({n, k}, kBf16)), dy(g.empty({m, n}, kBf16)), y(g.empty({m, n}, kBf16)),
        dx(g.empty({m, k}, kBf16)), dw(g.empty({n, k}, kBf16)) {
    fillNormal(g, tile, x, 1.f, offset);
    fillNormal(g, tile, w, float(1 / std::sqrt(double(k))), offset + 1);
    fillNormal(g, tile, dy, 1.f, offset + 2);
  }
  // The calls linearForward and LinearWithGradAccumulation::backward make, with the same views.
  void forward(Compute& g) { g.gemm(x, w.view().t(), y); }
  void backward(Compute& g) {
    g.gemm(dy, w, dx);
    g.gemm(dy.view().t(), x, dw);
  }
};

// Seconds of each timed step of the unsharded layer's GEMMs alone on one stream, outputs
// preallocated, timed like layerSteps: synchronize, clock, the GEMMs, synchronize, clock.
std::vector<double> gemmSteps(const GpuBenchConfig& c, gpu::GpuCompute& g, Layer layer, ConstView tile) {
  const std::int64_t m = c.tokens, h = c.hidden, f = c.ffn;
  std::optional<LinearGemms> fc1, fc2;
  if (layer != Layer::kRow) fc1.emplace(g, tile, m, h, f, 5);
  if (layer != Layer::kColumn) fc2.emplace(g, tile, m, f, h, 9);
  auto step = [&] {
    if (fc1) fc1->forward(g);
    if (fc2) fc2->forward(g);
    if (fc2) fc2->backward(g);
    if (fc1) fc1->backward(g);
  };
  for (int i = 0; i < c.warmup; ++i) step();
  const auto start = timingEvent(g.deviceIndex()), end = timingEvent(g.deviceIndex());
  std::vector<double> seconds;
  for (int i = 0; i < c.steps; ++i) {
    g.synchronize(kSync);
    TPSIM_CUDA_CHECK(cudaEventRecord(start.get(), g.stream()));
    step();
    TPSIM_CUDA_CHECK(cudaEventRecord(end.get(), g.stream()));
    g.synchronize(kSync);
    seconds.push_back(eventSeconds(start.get(), end.get()));
  }
  return seconds;
}

// Best tpsim step per (layer, T), for the PyTorch comparison.
using LayerBest = std::map<std::pair<Layer, int>, double>;

LayerBest benchLayers(const GpuBenchConfig& c, const gpu::GpuWorldOptions& go, const Peak& peak,
                      const std::vector<float>& hostTile) {
  std::printf("\n# Layers: forward + backward, bf16 (fp32 accumulation), no bias, on gpu::World: T ranks share\n");
  std::printf("# cuda:%d (DeviceFabric), sequence parallel for T > 1; best and median of %d steps after %d warm-up;\n",
              go.device, c.steps, c.warmup);
  std::printf("# TFLOP/s of the best step, 2·M·N·K per GEMM, 3 GEMMs per linear (forward, dgrad, wgrad)\n");
  std::printf("# baseline: the unsharded layer's cuBLASLt GEMMs alone, one GpuCompute stream, same run\n");
  if (peak.flops > 0)
    std::printf("# %%peak: TFLOP/s over the GPU's dense bf16 rate, %.0f TFLOP/s\n", peak.flops / 1e12);
  else
    std::printf("# %%peak: nan, the dense bf16 rate of this GPU is not in tpsim's table\n");
  std::printf("#%6s %7s %6s %6s %3s %10s %11s %8s %6s %10s %9s %6s %12s\n", "layer", "tokens", "h", "F", "T",
              "best(ms)", "median(ms)", "TFLOP/s", "%peak", "gemms(ms)", "gemm TF/s", "%peak", "layer/gemms");
  std::fflush(stdout);
  gpu::GpuCompute baseline(go.device);
  const Tensor tile = deviceTile(baseline, hostTile);
  LayerBest best;
  for (Layer layer : {Layer::kColumn, Layer::kRow, Layer::kMlp}) {
    const double flops = stepFlops(c, layer);
    for (int T : c.tp) {
      // The baseline right before each row: the GPU's clocks drift as it warms up.
      const Samples gemms = summarize(gemmSteps(c, baseline, layer, tile));
      const Samples s = summarize(layerSteps(c, go, layer, T, hostTile));
      best[{layer, T}] = s.best;
      std::printf(" %6s %7lld %6lld %6lld %3d %10.3f %11.3f %8.1f %6.1f %10.3f %9.1f %6.1f %11.3fx\n",
                  layerName(layer), (long long)c.tokens, (long long)c.hidden, (long long)c.ffn, T, s.best * 1e3,
                  s.median * 1e3, flops / s.best / 1e12, percentOf(flops / s.best, peak.flops), gemms.best * 1e3,
                  flops / gemms.best / 1e12, percentOf(flops / gemms.best, peak.flops), s.best / gemms.best);
      std::fflush(stdout);
    }
  }
  return best;
}

// ---- PyTorch -----------------------------------------------------------------------------------

// The same unsharded layers in PyTorch, timed with CUDA events. Arguments: tokens, h, F, warm-up,
// steps, device. Prints "skip: why", or "torch VERSION GPU" and one "result NAME BEST_MS MEDIAN_MS"
// per layer. bf16 split-K reductions are turned off: tpsim's cuBLASLt reduces in fp32.
// (No single quote in it: the shell gets it in single quotes.)
constexpr const char* kTorchScript = R"(
import sys
try:
    import torch
    import torch.nn.functional as F
except Exception as e:
    print("skip: cannot import torch:", type(e).__name__, e)
    sys.exit(0)
if not torch.cuda.is_available():
    print("skip: torch", torch.__version__, "sees no CUDA device")
    sys.exit(0)
m, h, f, warmup, steps, device = (int(a) for a in sys.argv[1:7])
torch.cuda.set_device(device)
torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
def leaf(rows, cols, sigma):
    return (torch.randn(rows, cols, device="cuda") * sigma).bfloat16().requires_grad_()
x = leaf(m, h, 1.0)
xr = leaf(m, f, 1.0)
w1 = leaf(f, h, h ** -0.5)
w2 = leaf(h, f, f ** -0.5)
dy_f = torch.randn(m, f, device="cuda").bfloat16()
dy_h = torch.randn(m, h, device="cuda").bfloat16()
def column():
    F.linear(x, w1).backward(dy_f)
def row():
    F.linear(xr, w2).backward(dy_h)
def mlp():
    F.linear(F.gelu(F.linear(x, w1)), w2).backward(dy_h)
def timed(step):
    ms = []
    for i in range(warmup + steps):
        x.grad = xr.grad = w1.grad = w2.grad = None
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        if i >= warmup:
            ms.append(start.elapsed_time(end))
    ms.sort()
    return ms[0], ms[len(ms) // 2]
print("torch", torch.__version__, torch.cuda.get_device_name(device))
for name, step in (("column", column), ("row", row), ("mlp", mlp)):
    best, median = timed(step)
    print("result", name, best, median)
)";

constexpr int kTorchTimeoutSeconds = 60;

struct TorchRun {
  std::string skipped;  // why there are no results; empty when there are
  std::string version;  // "torch 2.5.1 NVIDIA H200"
  std::map<std::string, Samples> results;  // by layer name, in seconds
};

TorchRun runTorch(const GpuBenchConfig& c, int device) {
  TPSIM_INTERNAL_ASSERT(std::strchr(kTorchScript, '\'') == nullptr, "the PyTorch script must not contain '");
  // SIGTERM at the limit, SIGKILL 5 s later should it be ignored. $PYTHON, when set, names the
  // interpreter that has PyTorch (the shell expands it).
  const char* python = std::getenv("PYTHON");
  const std::string shown = python && *python ? python : "python3";
  // --foreground: timeout stays in tpsim's process group, so that a signal to the group (Ctrl-C, an
  // outer `timeout`, as tools/gpu_check.sh runs this command) reaches python as well.
  const std::string command =
      detail::concat("timeout --foreground -k 5 ", kTorchTimeoutSeconds, " \"${PYTHON:-python3}\" -c '", kTorchScript,
                     "' ", c.tokens, " ", c.hidden, " ", c.ffn, " ", c.warmup, " ", c.steps, " ", device, " 2>&1");
  TorchRun run;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) {
    run.skipped = detail::concat("cannot start a shell: ", std::strerror(errno));
    return run;
  }
  std::string output, line, last;
  char buffer[4096];
  while (std::fgets(buffer, sizeof buffer, pipe)) output += buffer;
  const int status = pclose(pipe);
  std::istringstream lines(output);
  while (std::getline(lines, line)) {
    if (line.empty()) continue;
    last = line;
    std::istringstream words(line);
    std::string word, name;
    words >> word;
    Samples ms{};
    if (word == "skip:") run.skipped = line.substr(6);
    else if (word == "torch") run.version = line;
    else if (word == "result" && words >> name >> ms.best >> ms.median)
      run.results[name] = {ms.best / 1e3, ms.median / 1e3};
  }
  if (!run.skipped.empty()) return run;
  const int code = status != -1 && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  if (code == 124 || code == 137)
    run.skipped = detail::concat(shown, " did not finish within ", kTorchTimeoutSeconds, " s");
  else if (code != 0 || run.results.size() != 3)
    run.skipped = detail::concat(shown, " exited with status ", code, ": ", last.empty() ? "(no output)" : last);
  return run;
}

void benchTorch(const GpuBenchConfig& c, int device, const LayerBest& tpsim) {
  std::printf("\n# PyTorch: the same unsharded layers, torch.nn.functional.linear (+ exact gelu) with autograd,\n");
  std::printf("# bf16, no bias, CUDA-event timing, best of %d steps after %d warm-up (child process, %d s limit)\n",
              c.steps, c.warmup, kTorchTimeoutSeconds);
  std::fflush(stdout);
  const TorchRun run = runTorch(c, device);
  if (!run.skipped.empty()) {
    std::printf("# skipped: %s\n", run.skipped.c_str());
    std::fflush(stdout);
    return;
  }
  std::printf("# %s\n", run.version.c_str());
  std::printf("#%6s %3s %10s %10s %11s %10s %12s\n", "layer", "T", "tpsim(ms)", "torch(ms)", "torch med", "torch TF/s",
              "tpsim/torch");
  for (Layer layer : {Layer::kColumn, Layer::kRow, Layer::kMlp}) {
    const Samples& torch = run.results.at(layerName(layer));
    for (int T : c.tp) {
      const double ours = tpsim.at({layer, T});
      std::printf(" %6s %3d %10.3f %10.3f %11.3f %10.1f %11.3fx\n", layerName(layer), T, ours * 1e3, torch.best * 1e3,
                  torch.median * 1e3, stepFlops(c, layer) / torch.best / 1e12, ours / torch.best);
    }
  }
  std::fflush(stdout);
}

// ---- Fabric ------------------------------------------------------------------------------------

struct FabricCase {
  bool gather;  // allGather, else reduceScatter (sum)
  DType dtype;
  std::int64_t count;  // elements of the larger buffer per rank, a multiple of the rank count
};

// Σ_{r<n} (r + 1) in rank order with every partial sum rounded to dtype, as the fabric sums.
float rankOrderSum(int n, DType dtype) {
  float acc = 1;
  for (int r = 1; r < n; ++r) {
    acc = elem::add(acc, float(r + 1));
    if (dtype == kBf16) acc = elem::bf16ToFloat(elem::floatToBf16(acc));
  }
  return acc;
}

// Wrong values among the first, middle and last element of each of out's `blocks` blocks: a
// download of a few elements instead of the whole output, which would outlast the collectives.
long wrongSamples(gpu::GpuCompute& device, ConstView out, int blocks, const std::function<float(int)>& expect) {
  const std::int64_t len = out.numel() / blocks;
  long wrong = 0;
  for (int q = 0; q < blocks; ++q)
    for (std::int64_t j : {std::int64_t(0), len / 2, len - 1}) {
      const std::int64_t at = q * len + j;
      float value = 0;
      if (out.dtype() == kBf16) {
        std::uint16_t bits = 0;
        device.download(out.slice(0, at, at + 1), &bits);
        value = elem::bf16ToFloat(bits);
      } else {
        device.download(out.slice(0, at, at + 1), &value);
      }
      wrong += value != expect(q);
    }
  return wrong;
}

// Seconds per device-to-device cudaMemcpyAsync of `bytes` on the baseline's stream: warm-up, then
// the mean of `iters`, timed like the collectives.
double memcpySeconds(gpu::GpuCompute& g, std::int64_t bytes, int warmup, int iters) {
  const Tensor src = g.empty({bytes / 2}, kBf16);  // bytes is even
  Tensor dst = g.empty({bytes / 2}, kBf16);
  auto copy = [&] {
    TPSIM_CUDA_CHECK(cudaSetDevice(g.deviceIndex()));
    TPSIM_CUDA_CHECK(
        cudaMemcpyAsync(dst.data(), src.data(), std::size_t(bytes), cudaMemcpyDeviceToDevice, g.stream()));
  };
  for (int i = 0; i < warmup; ++i) copy();
  g.synchronize(kSync);
  const auto start = Clock::now();
  for (int i = 0; i < iters; ++i) copy();
  g.synchronize(kSync);
  return secondsSince(start) / iters;
}

// Returns the number of wrong samples over every rank count, collective, dtype and size.
long benchFabric(const GpuBenchConfig& c, const gpu::GpuWorldOptions& go, const Peak& peak) {
  std::printf("\n# DeviceFabric collectives, n ranks sharing cuda:%d; size = bytes of the larger buffer per rank;\n",
              go.device);
  std::printf("# algbw = size / time, busbw = algbw · (n-1)/n (nccl-tests); time: mean of %d after %d warm-up\n",
              c.iters, c.warmup);
  std::printf("# moved: the kernel's bytes read + written over all ranks / time (allGather 2·n·size, reduceScatter\n");
  std::printf("# (n+1)·size); memcpy: one cudaMemcpyAsync device to device of moved/2 bytes, read + written / time,\n");
  std::printf("# same run; #wrong: wrong values among the first, middle and last element of every output block\n");
  std::printf("# of every rank (input of rank r: r + 1); %%HBM: moved over the GPU's memory bandwidth, ");
  if (peak.bytesPerSecond > 0)
    std::printf("%.1f TB/s\n", peak.bytesPerSecond / 1e12);
  else
    std::printf("not in tpsim's table for this GPU (nan)\n");
  std::fflush(stdout);
  gpu::GpuCompute baseline(go.device);
  std::map<std::int64_t, double> memcpyCache;  // by bytes
  long allWrong = 0;
  for (int n : c.fabricRanks) {
    std::vector<FabricCase> cases;
    for (bool gather : {true, false})
      for (DType dtype : {kBf16, DType::kFloat32})
        for (long long bytes = c.minBytes;; bytes *= 4) {  // stops before bytes·4 could overflow
          cases.push_back({gather, dtype, std::int64_t(bytes) / std::int64_t(dtypeSize(dtype)) / n * n});
          if (bytes > c.maxBytes / 4) break;
        }
    std::vector<double> seconds(cases.size());
    std::vector<std::vector<long>> wrong(cases.size(), std::vector<long>(std::size_t(n)));  // [case][rank]
    WorldOptions o;
    o.size = n;
    o.threads = c.threads;
    gpu::World world(o, go);
    world.run([&](RankContext& ctx) {
      const int r = ctx.comm.rank();
      gpu::GpuCompute& device = world.compute(r);
      for (std::size_t i = 0; i < cases.size(); ++i) {
        const FabricCase& fc = cases[i];
        const std::int64_t block = fc.count / n;
        Tensor in = device.empty({fc.gather ? block : fc.count}, fc.dtype);   // (count/n) or (count)
        Tensor out = device.empty({fc.gather ? fc.count : block}, fc.dtype);  // (count) or (count/n)
        device.fill(in, r + 1);
        device.fill(out, -1);  // pool memory may hold a previous size's correct values
        auto issue = [&] { return fc.gather ? ctx.comm.allGather(in, out) : ctx.comm.reduceScatter(in, out); };
        for (int k = 0; k < c.warmup; ++k) issue()->wait();
        device.synchronize(kSync);
        ctx.comm.barrier()->wait();
        const auto start = Clock::now();
        for (int k = 0; k < c.iters; ++k) issue()->wait();
        device.synchronize(kSync);
        ctx.comm.barrier()->wait();
        if (r == 0) seconds[i] = secondsSince(start) / c.iters;
        const float sum = rankOrderSum(n, fc.dtype);
        wrong[i][std::size_t(r)] =
            wrongSamples(device, out, fc.gather ? n : 1, [&](int q) { return fc.gather ? float(q + 1) : sum; });
      }
    });
    for (bool gather : {true, false}) {
      std::printf("# %s on %d ranks\n", gather ? "allGather" : "reduceScatter", n);
      std::printf("#%12s %12s %8s %6s %10s %8s %8s %7s %9s %9s %8s %6s\n", "size", "count", "type", "redop", "time",
                  "algbw", "busbw", "#wrong", "moved", "memcpy", "fabric/", "%HBM");
      std::printf("#%12s %12s %8s %6s %10s %8s %8s %7s %9s %9s %8s %6s\n", "(B)", "(elements)", "", "", "(us)",
                  "(GB/s)", "(GB/s)", "", "(GB/s)", "(GB/s)", "memcpy", "");
      for (std::size_t i = 0; i < cases.size(); ++i) {
        const FabricCase& fc = cases[i];
        if (fc.gather != gather) continue;
        const std::int64_t size = fc.count * std::int64_t(dtypeSize(fc.dtype));
        const std::int64_t moved = gather ? 2 * n * size : (n + 1) * size;
        auto [cached, fresh] = memcpyCache.try_emplace(moved / 2, 0.0);
        if (fresh) cached->second = memcpySeconds(baseline, moved / 2, c.warmup, c.iters);
        long rowWrong = 0;
        for (long w : wrong[i]) rowWrong += w;
        allWrong += rowWrong;
        const double t = seconds[i], algbw = double(size) / t / 1e9;
        const double movedBw = double(moved) / t / 1e9, memcpyBw = double(moved) / cached->second / 1e9;
        std::printf(" %12lld %12lld %8s %6s %10.1f %8.2f %8.2f %7ld %9.1f %9.1f %7.3fx %6.1f\n", (long long)size,
                    (long long)fc.count, fc.dtype == kBf16 ? "bfloat16" : "float", gather ? "none" : "sum", t * 1e6,
                    algbw, algbw * (n - 1) / n, rowWrong, movedBw, memcpyBw, movedBw / memcpyBw,
                    percentOf(movedBw * 1e9, peak.bytesPerSecond));
      }
      std::fflush(stdout);
    }
  }
  return allWrong;
}

}  // namespace

int benchGpu(const GpuBenchConfig& c) {
  gpu::GpuWorldOptions go = gpu::worldOptionsFromEnvironment();
  go.transport = gpu::TransportKind::kDeviceFabric;  // T ranks on one GPU, T = 1 included
  const gpu::Probe probe = gpu::probe();
  TPSIM_CHECK(go.device < int(probe.devices.size()), "TPSIM_GPU_DEVICE=", go.device, ": there are ",
              probe.devices.size(), " CUDA device(s)");
  std::printf("# tpsim bench: backend=gpu what=%s threads=%d warmup=%d steps=%d tokens=%lld hidden=%lld ffn=%lld "
              "tp=%s fabric-ranks=%s bytes=%s..%s bw-iters=%d\n",
              c.what.c_str(), c.threads, c.warmup, c.steps, (long long)c.tokens, (long long)c.hidden,
              (long long)c.ffn, joined(c.tp).c_str(), joined(c.fabricRanks).c_str(), sizeText(c.minBytes).c_str(),
              sizeText(c.maxBytes).c_str(), c.iters);
  std::istringstream facts(probe.str());
  for (std::string line; std::getline(facts, line);) std::printf("# %s\n", line.c_str());
  std::fflush(stdout);
  // The probe only enumerates: a device that is listed but cannot be used (exclusive-process mode
  // held by another process, no memory left, a broken context) fails at its first context, stream
  // or allocation. That is an unusable device, exit 2, not a failed run.
  try {
    gpu::GpuCompute check(go.device);
    check.synchronize(kSync);
  } catch (const BackendError& e) {
    throw InvalidArgument(detail::concat("--backend gpu: cuda:", go.device, " cannot be used: ", e.what()));
  }
  const Peak peak = peakOf(probe.devices[std::size_t(go.device)].name);
  if (c.what == "all" || c.what == "layers") {
    const LayerBest best = benchLayers(c, go, peak, normalTile());
    benchTorch(c, go.device, best);
  }
  long wrong = 0;
  if (c.what == "all" || c.what == "fabric") wrong = benchFabric(c, go, peak);
  return wrong == 0 ? 0 : 1;
}

}  // namespace tpsim::tools
