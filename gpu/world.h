// gpu::World: the same SPMD rank code as sim::World, on CUDA devices.
//
// Each rank gets a GpuCompute (its own stream, cuBLASLt handle and workspace) and a world
// communicator from the rendezvous both worlds share (backends/world/rendezvous.h), so matching,
// deadlocks, timeouts, failed ranks and dropped Work behave and read exactly as on the simulator.
// Only the data movement differs: DeviceFabric (every rank on one GPU) or NCCL (one GPU per
// rank). One process drives every rank, or, in an MPI job (mpirun -np N), each process drives one
// rank on one GPU (ProcessJob; tools/lib/job.cc joins it to mpi::Session).
#pragma once

#include <functional>
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

// What a world of one rank per process needs of the job, which gpu/ knows only through this.
struct ProcessJob {
  int process = 0;  // the rank this process runs
  int processes = 1;
  int localProcess = 0;  // among the job's processes on this machine: the CUDA device it takes
  // Every process gets process 0's bytes (the NCCL id); every process calls it at the same point.
  std::function<std::string(const std::string& fromProcess0)> broadcast;
  // The rendezvous' transport: `local` (NCCL for this process's rank) with the peers behind it.
  std::function<std::shared_ptr<world::Transport>(std::shared_ptr<world::Transport> local)> spread;
};

// Why a world of `size` ranks cannot run one rank per process over `processes` ("" when it can).
std::string processPlacementError(int size, int processes);
// The CUDA device of the job's `localProcess`-th process on a machine with `devices` devices;
// throws InvalidArgument naming both numbers when there is none.
int deviceForLocalProcess(int localProcess, int devices);

struct GpuWorldOptions {
  // kAuto: NCCL when there are at least as many devices as ranks, else DeviceFabric.
  TransportKind transport = TransportKind::kAuto;
  int device = 0;  // DeviceFabric's device
  // Set: one rank per process of this job, on NCCL (the transport must be kAuto or kNccl).
  std::shared_ptr<const ProcessJob> job;
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
  // than ranks, more than kMaxFabricRanks on one device), for a job whose processes are not the
  // ranks or whose machine has too few devices, and BackendError when CUDA fails. In a job every
  // process constructs its world at the same point: NCCL's world communicator is made here.
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
  // Rank r's compute, for benchmarks that time device work directly; in a job, only this process's.
  GpuCompute& compute(int rank);

 private:
  // Waits, within one TPSIM_GPU_TIMEOUT_MS and without throwing, for the transport's and every
  // rank's device work: after a failure, so that the next run cannot race with the last one.
  void drain() noexcept;

  // Sets fabric_ and spread_: new ones, in a job over a new NCCL id from process 0.
  void makeTransport();

  world::Rendezvous rendezvous_;
  TransportKind transport_;
  long long timeoutMs_;
  std::string deviceName_;
  std::shared_ptr<const ProcessJob> job_;
  std::vector<std::shared_ptr<Compute>> computes_;  // by rank; in a job, null but this process's
  std::vector<GpuCompute*> ranks_;  // computes_, by rank
  std::shared_ptr<DeviceTransport> fabric_;
  std::shared_ptr<world::Transport> spread_;  // what the rendezvous sees: fabric_, or fabric_ spread in a job
  bool transportAborted_ = false;  // by the last run's failure
};

}  // namespace tpsim::gpu
