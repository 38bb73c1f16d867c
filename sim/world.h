// sim::World: N simulated ranks in one process, running one SPMD function to completion.
//
// Rank code is ordinary blocking code, the same a GPU rank runs: it sees a RankContext and waits
// on Work handles. Ranks run on fibers (backends/world/rendezvous.h), so 64 ranks on 2 cores cost a stack
// switch per wait, not an OS thread. Collectives are exact and deterministic: reductions sum in
// rank order (sim/reduce.h), whatever the number of worker threads. Nothing hangs: a mismatch, a
// deadlock, a failed rank, a timeout or a dropped Work becomes a CollectiveError on every rank and
// a WorldError from run().
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "backends/world.h"
#include "backends/world/rendezvous.h"
#include "sim/host_pool.h"

namespace tpsim::sim {

// Host memory, data moved under the rendezvous lock by the last member to arrive.
class HostTransport final : public world::Transport {
 public:
  Device device() const override { return Device::kHost; }
  bool sharesMemory() const override { return true; }
  bool foldsReductions() const override { return true; }
  world::TransportToken fold(const world::Collective& c) override;
  world::TransportToken execute(const world::Collective& c) override;

 private:
  std::vector<char> scratch_;  // staging of the collective being executed; guarded by the lock
};

class World final : public tpsim::World {
 public:
  explicit World(WorldOptions options);
  // Ranks a peer process runs, as transport.processOf says, are only named here (backends/mpi/session.h).
  World(WorldOptions options, std::shared_ptr<world::Transport> transport);

  int size() const override { return rendezvous_.options().size; }
  std::string description() const override { return "sim"; }
  void run(const std::function<void(RankContext&)>& fn) override;
  const std::vector<std::vector<TraceEvent>>& trace() const override { return rendezvous_.trace(); }

 private:
  world::Rendezvous rendezvous_;
  std::unique_ptr<HostPool> gemmPool_;  // the threads that run no rank; outlives computes_
  std::vector<std::shared_ptr<Compute>> computes_;
  std::shared_ptr<world::Transport> transport_;
};

}  // namespace tpsim::sim
