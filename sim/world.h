// sim::World: N simulated ranks in one process, running one SPMD function to completion.
//
// Rank code is ordinary blocking code, the same a GPU rank runs: it sees a RankContext and waits
// on Work handles. Each rank runs on its own fiber (a small stack), and a few worker threads run
// whichever fibers are ready, so 64 ranks on 2 cores cost a stack switch per wait, not an OS
// thread. Collectives are exact and deterministic: reductions sum in rank order, whatever the
// number of worker threads. Nothing hangs: a mismatch, a deadlock, a failed rank, a timeout or a
// dropped Work becomes a CollectiveError on every rank and a WorldError from run().
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backends/collectives.h"
#include "backends/errors.h"
#include "backends/rank_context.h"

namespace tpsim::sim {

struct WorldOptions {
  int size = 1;                                  // number of ranks, >= 1
  int threads = 0;                               // worker threads; 0 = min(hardware threads, size)
  std::chrono::milliseconds timeout{60'000};     // default collective timeout
  std::size_t stackBytes = 0;                    // fiber stack; 0 = 1 MiB (8 MiB under sanitizers)
  bool trace = false;                            // record every collective each rank issues
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
  // Work); kind() then says which. False when a rank's own code threw first.
  bool causeIsCollective() const { return collective_; }
  CollectiveFailure kind() const { return kind_; }

 private:
  std::vector<std::string> rankErrors_;
  bool collective_;
  CollectiveFailure kind_;
};

class World {
 public:
  explicit World(WorldOptions options);
  ~World();
  World(const World&) = delete;
  World& operator=(const World&) = delete;

  int size() const;

  // Runs fn on every rank and returns when all ranks returned. Throws WorldError if any rank threw.
  // A rank still running `timeout` after the world failed is abandoned (its thread is detached)
  // and named in the error.
  void run(const std::function<void(RankContext&)>& fn);

  // Per rank, the collectives it issued in the last run() (empty unless options.trace).
  const std::vector<std::vector<TraceEvent>>& trace() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tpsim::sim
