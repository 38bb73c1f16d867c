// A stream that does not finish, for the gpu tests of deadlines and teardown: a kernel that spins
// until released. A real kernel, not a host function (cudaLaunchHostFunc) that waits: work queued
// behind a host function is not yet submitted to the GPU, so another stream's wait on an event
// recorded after it blocks that stream's next launch on the host (seen on an H200, driver 580: the
// DeviceFabric's reduce launch never returned), which no stuck kernel does.
#pragma once

#include <cuda_runtime_api.h>

namespace tpsim::gputest {

// Spins on `stream` until release() (or for ~20 s at 2 GHz, so a failing test ends), through a
// pinned and mapped flag. The destructor releases it and waits for the device.
class StuckKernel {
 public:
  explicit StuckKernel(cudaStream_t stream);
  ~StuckKernel();
  StuckKernel(const StuckKernel&) = delete;
  StuckKernel& operator=(const StuckKernel&) = delete;

  void release() { *static_cast<volatile int*>(flag_) = 1; }

 private:
  int* flag_ = nullptr;
};

}  // namespace tpsim::gputest
