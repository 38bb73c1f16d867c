// DeviceTransport: what both GPU transports (DeviceFabric, NcclTransport) add to the rendezvous'
// Transport, for gpu::World.
#pragma once

#include <chrono>

#include "backends/world/rendezvous.h"

namespace tpsim::gpu {

class DeviceTransport : public world::Transport {
 public:
  // Waits, until `deadline` at most and without throwing, for the data movement enqueued so far;
  // true when all of it finished. After a failed run, collectives may still be in flight that no
  // rank's stream was ordered after.
  virtual bool drain(std::chrono::steady_clock::time_point deadline) noexcept = 0;
};

}  // namespace tpsim::gpu
