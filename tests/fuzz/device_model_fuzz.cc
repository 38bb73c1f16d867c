// libFuzzer target: the --device-model FILE parser (tools/lib/trace.cc) on arbitrary file contents.
// Each input must give a model whose every rate and latency is finite and within the bounds that
// keep a trace's times finite, or fail with InvalidArgument; the costs it gives a GEMM and a
// collective must be finite too. Anything else (a crash, a sanitizer report, another exception) is a
// bug.
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "backends/errors.h"
#include "tools/lib/trace.h"

namespace {

// An in-memory file that deviceModel opens by path, as it would a file on disk.
struct MemoryFile {
  int fd = memfd_create("tpsim_fuzz_device_model", 0);
  std::string path = "/proc/self/fd/" + std::to_string(fd);
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace tpsim::tools;
  static const MemoryFile in;
  if (in.fd < 0 || ftruncate(in.fd, 0) != 0 || pwrite(in.fd, data, size, 0) != ssize_t(size)) std::abort();
  DeviceModel d;
  try {
    d = deviceModel(in.path);
  } catch (const tpsim::InvalidArgument&) {
    return 0;
  }
  for (double v : {d.tflopsFp32, d.tflopsBf16, d.tflopsFp16, d.tflopsFp64, d.memoryGBps, d.linkGBps})
    if (!(v > 0) || !std::isfinite(v)) std::abort();
  if (!(d.linkLatencyUs >= 0) || !std::isfinite(d.linkLatencyUs)) std::abort();
  ComputeRecord gemm;
  gemm.name = "gemm";
  gemm.dtype = "bf16";
  gemm.flops = 1e18;
  gemm.bytes = 1e15;
  CommRecord allReduce;
  allReduce.op = "allReduce";
  allReduce.size = 64;
  allReduce.inBytes = allReduce.outBytes = std::int64_t(1) << 40;
  if (!std::isfinite(computeCostUs(d, gemm)) || !std::isfinite(collectiveCostUs(d, allReduce))) std::abort();
  return 0;
}
