// The GPU probe: which CUDA devices this process can use, and the library versions it runs with;
// and the bounded wait on a stream that every part of the gpu backend uses instead of blocking.
//
// probe() never throws for a missing GPU, driver or library: it returns the reason, which tests
// print when they skip and the tools print when gpu is unusable ("no CUDA device:
// cudaErrorInsufficientDriver (CUDA driver version is insufficient for CUDA runtime version)").
// It does not pick a device or create a context beyond what the CUDA runtime does on first use.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>
#include <string>
#include <vector>

namespace tpsim::gpu {

struct DeviceInfo {
  int index = 0;
  std::string name;             // "NVIDIA H200"
  int major = 0, minor = 0;     // compute capability, 9.0 for sm_90
  int smCount = 0;              // streaming multiprocessors
  std::size_t totalMemory = 0;  // bytes
};

struct Probe {
  std::vector<DeviceInfo> devices;
  // Why no device can be used; empty when `devices` is not.
  std::string reason;
  int driverVersion = 0;            // cudaDriverGetVersion: 13000 for 13.0; 0 without a driver
  int runtimeVersion = 0;           // cudaRuntimeGetVersion, same encoding
  std::size_t cublasLtVersion = 0;  // cublasLtGetVersion: 130100 for 13.1.0
  int ncclVersion = 0;              // ncclGetVersion: 22809 for 2.28.9

  bool hasDevice() const { return !devices.empty(); }
  // One line per fact: versions, then each device or the reason there is none.
  std::string str() const;
};

Probe probe();

// TPSIM_GPU_TIMEOUT_MS (default 60000): how long any wait for device work may take. Throws
// InvalidArgument naming the variable for anything but a positive number of milliseconds.
long long deviceTimeoutMs();

// Polls until `stream` is idle: cudaSuccess, the stream's error, or cudaErrorNotReady once
// `deadline` has passed. Never blocks in the driver, so a stuck kernel cannot hang the caller.
// The caller selects the stream's device.
cudaError_t pollStream(cudaStream_t stream, std::chrono::steady_clock::time_point deadline);

// The deadline `timeoutMs` from now.
inline std::chrono::steady_clock::time_point deadlineIn(long long timeoutMs) {
  return std::chrono::steady_clock::now() + std::chrono::milliseconds(timeoutMs);
}

}  // namespace tpsim::gpu
