// World: N ranks running one SPMD function to completion, whatever backend drives them.
//
// sim::World runs the ranks on the host with exact collectives; gpu::World runs the same rank code
// on CUDA devices. Both match collectives by per-group sequence number and turn a mismatch, a
// deadlock, a failed rank, a timeout or a dropped Work into a CollectiveError on every rank and a
// WorldError from run(), and a stop asked from outside (backends/stop.h) into Stopped. This header
// holds only what the tools need to drive either one; how a world is built (and which backends
// exist) is the tools' business.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "backends/collectives.h"
#include "backends/errors.h"
#include "backends/fault.h"
#include "backends/rank_context.h"

namespace tpsim {

struct WorldOptions {
  int size = 1;                                  // number of ranks, >= 1
  // Threads the world may use; 0 = one per hardware thread. min(threads, size) run ranks; the
  // simulator lends the rest to large GEMMs (sim::HostPool), so every core works at any size.
  int threads = 0;
  std::chrono::milliseconds timeout{60'000};     // default collective timeout
  std::size_t stackBytes = 0;                    // rank stack; 0 = 1 MiB (8 MiB under sanitizers)
  bool trace = false;                            // record every collective each rank issues
  std::vector<Fault> faults;                     // injected on purpose (backends/fault.h); one per (rank, K)
};

// One collective as a rank issued it; filled when WorldOptions::trace is set.
struct TraceEvent {
  std::string op;        // "allReduce", "allGather", ...
  std::string group;     // label and members: "tp[0,1]"
  std::uint64_t seq;     // per-group sequence number
  std::string dtype;     // "fp32"
  std::int64_t bytes;    // bytes this rank sent (its input buffer)
};

// What run() throws when any rank ended with an exception. rankErrors()[r] is rank r's error
// message ("" if it returned normally); what() names the first cause and summarizes the rest.
class WorldError : public Error {
 public:
  WorldError(const std::string& what, std::vector<std::string> rankErrors, bool causeIsCollective,
             CollectiveFailure kind)
      : Error(what), rankErrors_(std::move(rankErrors)), collective_(causeIsCollective), kind_(kind) {}
  const std::vector<std::string>& rankErrors() const { return rankErrors_; }
  // True when the first cause was detected by the fabric (mismatch, deadlock, timeout, dropped
  // Work, a backend error); kind() then says which. False when a rank's own code threw first.
  bool causeIsCollective() const { return collective_; }
  CollectiveFailure kind() const { return kind_; }

 private:
  std::vector<std::string> rankErrors_;
  bool collective_;
  CollectiveFailure kind_;
};

class World {
 public:
  virtual ~World() = default;

  virtual int size() const = 0;
  // "sim", "gpu (DeviceFabric, NVIDIA H200)": for headers and messages.
  virtual std::string description() const = 0;

  // Runs fn on every rank and returns when all ranks returned. Throws WorldError if any rank threw.
  // A rank still running `timeout` after the world failed is abandoned and named in the error.
  // The ranks obey the caller's stop flag (backends/stop.h): once it is set, every rank's next
  // collective or compute progress point throws, and run() throws Stopped when all have returned.
  virtual void run(const std::function<void(RankContext&)>& fn) = 0;

  // Per rank, the collectives it issued in the last run() (empty unless options.trace).
  virtual const std::vector<std::vector<TraceEvent>>& trace() const = 0;
};

}  // namespace tpsim
