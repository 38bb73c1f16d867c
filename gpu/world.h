// gpu::World: the same SPMD rank code as sim::World, on CUDA devices.
//
// Each rank gets a GpuCompute (its own stream, cuBLASLt handle and workspace) and a world
// communicator from the rendezvous both worlds share (backends/world/rendezvous.h), so matching,
// deadlocks, timeouts, failed ranks and dropped Work behave and read exactly as on the simulator.
// Only the data movement differs: DeviceFabric (every rank on one GPU) or NCCL (one GPU per
// rank). Not a multi-process world: one process drives every rank.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "backends/world.h"
#include "backends/world/rendezvous.h"

namespace tpsim::gpu {

class DeviceTransport;
class GpuCompute;

enum class TransportKind { kAuto, kDeviceFabric, kNccl };
const char* transportName(TransportKind kind);  // "auto", "fabric", "nccl"

struct GpuWorldOptions {
  // kAuto: NCCL when there are at least as many devices as ranks, else DeviceFabric.
  TransportKind transport = TransportKind::kAuto;
  int device = 0;  // DeviceFabric's device
};

// TPSIM_GPU_TRANSPORT=auto|fabric|nccl and TPSIM_GPU_DEVICE=N; throws InvalidArgument naming
// the variable for any other value.
GpuWorldOptions worldOptionsFromEnvironment();

// Why no gpu::World can run in this process ("no CUDA device: cudaErrorInsufficientDriver (...)"),
// or "" when one can. Probes once.
std::string unusableReason();

class World final : public tpsim::World {
 public:
  // Throws InvalidArgument for a transport the devices cannot support (NCCL with fewer devices
  // than ranks, more than kMaxFabricRanks on one device) and BackendError when CUDA fails.
  World(WorldOptions options, GpuWorldOptions gpuOptions = {});
  ~World() override;

  int size() const override { return rendezvous_.options().size; }
  std::string description() const override;
  // A fault that surfaces only after every rank returned (a kernel that failed on the device, a
  // stream that never finishes) is a WorldError of kind kBackend as well.
  // A failed run aborts NCCL's communicators; the next run gets new ones, so a world stays usable
  // after a failure on either transport, as on the simulator.
  void run(const std::function<void(RankContext&)>& fn) override;
  const std::vector<std::vector<TraceEvent>>& trace() const override { return rendezvous_.trace(); }

  TransportKind transport() const { return transport_; }
  // Rank r's compute, for benchmarks that time device work directly.
  GpuCompute& compute(int rank);

 private:
  // Waits, within one TPSIM_GPU_TIMEOUT_MS and without throwing, for the transport's and every
  // rank's device work: after a failure, so that the next run cannot race with the last one.
  void drain() noexcept;

  std::shared_ptr<DeviceTransport> makeTransport();

  world::Rendezvous rendezvous_;
  TransportKind transport_;
  long long timeoutMs_;
  std::string deviceName_;
  std::vector<std::shared_ptr<Compute>> computes_;
  std::vector<GpuCompute*> ranks_;  // computes_, by rank
  std::shared_ptr<DeviceTransport> fabric_;
  bool transportAborted_ = false;  // by the last run's failure
};

}  // namespace tpsim::gpu
