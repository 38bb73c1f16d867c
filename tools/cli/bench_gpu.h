// tpsim bench --backend gpu: its configuration, which bench.cc parses, and its entry point,
// built only with the gpu backend (tools/cli/bench_gpu.cc).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tpsim::tools {

struct GpuBenchConfig {
  std::string what = "all";  // layers | fabric | all
  int threads = 0;           // rank worker threads; 0 = min(cores, ranks)
  int warmup = 3;            // untimed steps (layers) or collectives (fabric) before timing
  int steps = 10;            // layers: timed steps; the best and the median are printed
  std::int64_t tokens = 8192, hidden = 8192, ffn = 28672;
  std::vector<int> tp{1, 2, 4, 8};
  std::vector<int> fabricRanks{2, 4, 8};
  long long minBytes = 1LL << 20, maxBytes = 256LL << 20;
  int iters = 20;  // fabric: timed collectives per size, nccl-tests' -n; their mean is printed
};

// Runs the sections; returns the exit code: 0, or 1 when a collective's result was wrong.
int benchGpu(const GpuBenchConfig& c);

}  // namespace tpsim::tools
