// DeviceFabric: the collectives of T ranks that share one GPU, as device kernels on one stream.
//
// NCCL refuses two ranks of a communicator on one GPU, so this is what runs TP = 8 x GTP_remat = 2
// on a single H200. Each rank keeps its own GpuCompute stream; a collective starts once every
// member's "issued" event has fired and every member's later work waits on its "done" event, so
// the host never blocks on it. The kernels read every member's buffer directly and sum in rank
// order with the simulator's roundings (sim/reduce.h, backends/element_math.h): results are
// bitwise equal to sim::World's. Not a multi-GPU transport (gpu/nccl_transport.h is).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "gpu/device_transport.h"
#include "gpu/gpu_compute.h"

namespace tpsim::gpu {

// Kernel arguments carry every member's pointers, so a fabric group has at most this many ranks.
constexpr int kMaxFabricRanks = 64;

class DeviceFabric final : public DeviceTransport {
 public:
  // ranks[r] is global rank r's compute; all on `device`. Creates the fabric's stream there.
  DeviceFabric(int device, std::vector<GpuCompute*> ranks);
  // Waits for the fabric's stream within TPSIM_GPU_TIMEOUT_MS; leaks it if it is stuck.
  ~DeviceFabric() override;
  DeviceFabric(const DeviceFabric&) = delete;
  DeviceFabric& operator=(const DeviceFabric&) = delete;

  Device device() const override { return Device::kCuda; }
  world::TransportToken issued(int globalRank) override;
  world::TransportToken execute(const world::Collective& c) override;
  void completed(int globalRank, const world::TransportToken& done) override;
  bool drain(std::chrono::steady_clock::time_point deadline) noexcept override;

 private:
  int device_;
  long long timeoutMs_;
  std::vector<GpuCompute*> ranks_;
  cudaStream_t stream_ = nullptr;
};

// data[i] = data[i] / n for `count` elements of `dtype` on `stream`: kMean's single division after
// a sum (fp32 for 16-bit data, rounded once; truncating for int64), as the simulator does it.
void divideOnDevice(DType dtype, void* data, std::int64_t count, int n, cudaStream_t stream);

}  // namespace tpsim::gpu
