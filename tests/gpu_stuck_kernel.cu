#include "tests/gpu_stuck_kernel.h"

#include "gpu/check.h"

namespace tpsim::gputest {
namespace {

// Spins until the host sets *flag, or for at most `cycles` clock cycles (so a failing test ends).
__global__ void spinUntilReleased(const volatile int* flag, long long cycles) {
  const long long start = clock64();
  while (*flag == 0 && clock64() - start < cycles) {
  }
}

}  // namespace

StuckKernel::StuckKernel(cudaStream_t stream) {
  TPSIM_CUDA_CHECK(cudaHostAlloc(&flag_, sizeof(int), cudaHostAllocMapped));
  *static_cast<volatile int*>(flag_) = 0;
  int* deviceFlag = nullptr;
  TPSIM_CUDA_CHECK(cudaHostGetDevicePointer(&deviceFlag, flag_, 0));
  spinUntilReleased<<<1, 1, 0, stream>>>(deviceFlag, 40'000'000'000LL);
  TPSIM_CUDA_CHECK_LAUNCH("spinUntilReleased");
}

StuckKernel::~StuckKernel() {
  release();
  cudaDeviceSynchronize();  // the kernel reads the flag until it ends
  cudaFreeHost(flag_);
}

}  // namespace tpsim::gputest
