#include "gpu/device.h"

#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cerrno>
#include <cstdlib>
#include <sstream>
#include <thread>

#include "backends/errors.h"

namespace tpsim::gpu {
namespace {

std::string describe(const char* call, cudaError_t e) {
  std::ostringstream os;
  os << call << ": " << cudaGetErrorName(e) << " (" << cudaGetErrorString(e) << ")";
  return os.str();
}

// 13000 -> "13.0" (CUDA's major·1000 + minor·10).
std::string cudaVersionStr(int v) {
  return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10);
}
// 130100 -> "13.1.0" (cuBLAS's major·10000 + minor·100 + patch); NCCL >= 2.9 encodes the same way.
std::string tripleStr(std::size_t v) {
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

}  // namespace

Probe probe() {
  Probe p;
  // Version queries work without a device; a failure leaves the field 0.
  if (cudaDriverGetVersion(&p.driverVersion) != cudaSuccess) p.driverVersion = 0;
  if (cudaRuntimeGetVersion(&p.runtimeVersion) != cudaSuccess) p.runtimeVersion = 0;
  p.cublasLtVersion = cublasLtGetVersion();
  if (ncclGetVersion(&p.ncclVersion) != ncclSuccess) p.ncclVersion = 0;

  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    // Without a driver this is cudaErrorInsufficientDriver, not cudaErrorNoDevice: any error means
    // "no GPU", and its name says which case this is.
    cudaGetLastError();
    p.reason = "no CUDA device: " + std::string(cudaGetErrorName(e)) + " (" + cudaGetErrorString(e) + ")";
    return p;
  }
  if (count == 0) {
    p.reason = "no CUDA device: cudaGetDeviceCount returned 0";
    return p;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    const cudaError_t pe = cudaGetDeviceProperties(&prop, i);
    if (pe != cudaSuccess) {
      cudaGetLastError();
      p.devices.clear();
      p.reason = "CUDA device " + std::to_string(i) + " unusable: " + describe("cudaGetDeviceProperties", pe);
      return p;
    }
    DeviceInfo d;
    d.index = i;
    d.name = prop.name;
    d.major = prop.major;
    d.minor = prop.minor;
    d.smCount = prop.multiProcessorCount;
    d.totalMemory = prop.totalGlobalMem;
    p.devices.push_back(d);
  }
  return p;
}

long long deviceTimeoutMs() {
  const char* s = std::getenv("TPSIM_GPU_TIMEOUT_MS");
  if (s == nullptr || *s == '\0') return 60000;
  char* end = nullptr;
  errno = 0;
  const long long ms = std::strtoll(s, &end, 10);
  TPSIM_CHECK(errno == 0 && *end == '\0' && ms > 0,
              "TPSIM_GPU_TIMEOUT_MS must be a positive number of milliseconds, got '", s, "'");
  return ms;
}

// Spins briefly (most waits are short), then sleeps between polls.
cudaError_t pollStream(cudaStream_t stream, std::chrono::steady_clock::time_point deadline) {
  for (int polls = 0;; ++polls) {
    const cudaError_t e = cudaStreamQuery(stream);
    if (e != cudaErrorNotReady) return e;
    if (cudaPeekAtLastError() == cudaErrorNotReady) cudaGetLastError();  // "not ready" is no error to keep
    if (std::chrono::steady_clock::now() >= deadline) return cudaErrorNotReady;
    if (polls < 1000)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

std::string Probe::str() const {
  std::ostringstream os;
  os << "CUDA driver " << (driverVersion ? cudaVersionStr(driverVersion) : std::string("none")) << ", runtime "
     << cudaVersionStr(runtimeVersion) << ", cuBLASLt " << tripleStr(cublasLtVersion) << ", NCCL "
     << tripleStr(std::size_t(ncclVersion)) << "\n";
  if (devices.empty()) os << reason << "\n";
  for (const DeviceInfo& d : devices)
    os << "cuda:" << d.index << " " << d.name << ", sm_" << d.major << d.minor << ", " << d.smCount << " SMs, "
       << d.totalMemory / (std::size_t(1) << 20) << " MiB\n";
  return os.str();
}

}  // namespace tpsim::gpu
