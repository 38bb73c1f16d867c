// NcclTransport: one rank per GPU, one process driving every local GPU through NCCL.
//
// Each member set (the world, and each group the ranks split off) gets its own communicators on
// its first collective: grouped, non-blocking ncclCommInitRankConfig calls from one thread (one
// process owns every rank, so no parent rank outside the set has to take part, as ncclCommSplit
// would require). A collective is one ncclGroupStart/End over its members, issued under the
// rendezvous lock, so every device sees the same launch order. Errors and stalls never hang: each
// wait polls ncclCommGetAsyncError against the world's timeout, and a failure aborts every
// communicator. kMean is a sum, then one division (ncclAvg pre-scales by a rounded 1/n). Sums
// follow NCCL's algorithm order, not rank order: bounded against the simulator, not bitwise.
// Tensors come from each device's default memory pool (cudaMallocAsync), which peer access does
// not cover: every device that can reach another is granted access to its pool, so that NCCL's
// kernels may read and write peers' buffers directly.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <map>
#include <vector>

#include "gpu/device_transport.h"
#include "gpu/gpu_compute.h"

namespace tpsim::gpu {

class NcclTransport final : public DeviceTransport {
 public:
  // ranks[r] is global rank r's compute, each on its own device. Creates one NCCL stream per rank
  // and grants every rank's device access to the other devices' default pools where it can.
  NcclTransport(std::vector<GpuCompute*> ranks, std::chrono::milliseconds timeout);
  // Ends the communicators within the world's timeout and the streams within TPSIM_GPU_TIMEOUT_MS;
  // leaks what does not finish in time rather than hang.
  ~NcclTransport() override;
  NcclTransport(const NcclTransport&) = delete;
  NcclTransport& operator=(const NcclTransport&) = delete;

  Device device() const override { return Device::kCuda; }
  world::TransportToken issued(int globalRank) override;
  world::TransportToken execute(const world::Collective& c) override;
  void completed(int globalRank, const world::TransportToken& done) override;
  void abort() override;
  bool drain(std::chrono::steady_clock::time_point deadline) noexcept override;

 private:
  struct Communicators {
    std::vector<ncclComm_t> comms;     // by group rank
    // One device float per member, a barrier being a 1-element sum. Allocated and freed on the
    // member's NCCL stream: freeing never waits for the whole device, which may be stuck.
    std::vector<void*> barrierFloats;
  };
  Communicators& communicatorsFor(const std::vector<int>& members);
  // Polls until no communicator reports ncclInProgress; aborts all and throws on an error or at
  // the deadline, naming `what`.
  void awaitComms(const std::vector<ncclComm_t>& comms, const char* what);
  int deviceOf(int globalRank) const { return ranks_[globalRank]->deviceIndex(); }

  std::vector<GpuCompute*> ranks_;
  std::chrono::milliseconds timeout_;
  long long streamTimeoutMs_;
  std::vector<cudaStream_t> streams_;  // by global rank
  std::map<std::vector<int>, Communicators> comms_;
  bool aborted_ = false;
};

}  // namespace tpsim::gpu
