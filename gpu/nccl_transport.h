// NcclTransport: one rank per GPU, one process driving every local GPU through NCCL, or one
// process of an MPI job driving its one rank (a world id: process 0's ncclUniqueId).
//
// In one process, each member set (the world, and each group the ranks split off) gets its own
// communicators on its first collective: grouped, non-blocking ncclCommInitRankConfig calls from
// one thread (one process owns every rank, so no parent rank outside the set has to take part, as
// ncclCommSplit would require). In a job, the world communicator is made from the world id when
// the transport is, and each split's communicators from its parent's with ncclCommSplit, which
// every process of the parent calls (split()); the rendezvous issues both in one order everywhere. A collective is one ncclGroupStart/End over its members, issued under the
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
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "gpu/device_transport.h"
#include "gpu/gpu_compute.h"

namespace tpsim::gpu {

// What one member passes ncclCommSplit for its place after a split: NCCL orders the members of a
// color by (key, parent rank), as the rendezvous does, so the color and key pass as they are; a
// member that joins no group passes NCCL_SPLIT_NOCOLOR.
struct NcclSplitArgs {
  int color = 0;
  int key = 0;
};
NcclSplitArgs ncclSplitArgs(const world::SplitPlace& place);

// The job's NCCL id: process 0 makes it with `make` and broadcasts its bytes; every process gets
// the same id. Throws InternalError when the bytes that arrive are not an id.
ncclUniqueId shareUniqueId(int process, const std::function<std::string(const std::string&)>& broadcast,
                           const std::function<ncclUniqueId()>& make);

class NcclTransport final : public DeviceTransport {
 public:
  // ranks[r] is global rank r's compute, each on its own device; null for a rank another process
  // runs, when worldId is given (the job's, from shareUniqueId: this process's ranks join its world
  // communicator here, waiting for every process within `timeout`). Creates one NCCL stream per
  // rank and grants every rank's device access to the other devices' default pools where it can.
  NcclTransport(std::vector<GpuCompute*> ranks, std::chrono::milliseconds timeout,
                const ncclUniqueId* worldId = nullptr);
  // Ends the communicators within the world's timeout and the streams within TPSIM_GPU_TIMEOUT_MS;
  // leaks what does not finish in time rather than hang.
  ~NcclTransport() override;
  NcclTransport(const NcclTransport&) = delete;
  NcclTransport& operator=(const NcclTransport&) = delete;

  Device device() const override { return Device::kCuda; }
  world::TransportToken issued(int globalRank) override;
  world::TransportToken execute(const world::Collective& c) override;
  void split(const world::Collective& c) override;
  bool carriesPeerData() const override { return spread_; }
  void completed(int globalRank, const world::TransportToken& done) override;
  void abort() override;
  bool drain(std::chrono::steady_clock::time_point deadline) noexcept override;

 private:
  struct Communicators {
    std::vector<int> members;          // global ranks, by group rank
    std::vector<ncclComm_t> comms;     // by group rank; null for another process's member
    // One device float per member, a barrier being a 1-element sum. Allocated and freed on the
    // member's NCCL stream: freeing never waits for the whole device, which may be stuck.
    std::vector<void*> barrierFloats;
  };
  Communicators& communicatorsFor(const world::Collective& c);
  // Adds set (its comms initialized) under `key`, with a barrier float for each local member.
  Communicators& add(const std::string& key, Communicators set);
  // Polls until no communicator reports ncclInProgress; aborts all and throws on an error or at
  // the deadline, naming `what`.
  void awaitComms(const std::vector<ncclComm_t>& comms, const char* what);
  int deviceOf(int globalRank) const { return ranks_[globalRank]->deviceIndex(); }
  bool local(int globalRank) const { return ranks_[globalRank] != nullptr; }

  std::vector<GpuCompute*> ranks_;
  bool spread_;  // over the processes of a job
  std::chrono::milliseconds timeout_;
  long long streamTimeoutMs_;
  std::vector<cudaStream_t> streams_;  // by global rank; null for another process's
  // In one process by member set ("0-3"), reused by every group of those members; in a job by the
  // group's id, as each split made it.
  std::map<std::string, Communicators> comms_;
  bool aborted_ = false;
};

}  // namespace tpsim::gpu
