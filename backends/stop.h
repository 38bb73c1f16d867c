// Stopping a long computation from outside it: a flag that a signal handler or another thread
// sets, and that the work polls at its progress points (a collective, a GEMM's block).
//
// A thread obeys the flag installed on it with StopScope; whoever hands work to other threads
// passes the flag on (a world's worker threads, a GEMM's tasks), so one flag stops everything a
// call started. Polling is cooperative: code between progress points runs to its next one.
#pragma once

#include <atomic>

#include "backends/errors.h"

namespace tpsim {

// Set to true, from any thread or a signal handler (it is lock-free), to ask for a stop.
using StopFlag = std::atomic<bool>;

// What the work throws at its next progress point once its flag is set; World::run throws it too.
class Stopped : public Error {
 public:
  using Error::Error;
};

// The flag the calling thread obeys, or null.
const StopFlag* currentStopFlag();

// Installs `flag` (null: none) on the calling thread for the scope's lifetime.
class StopScope {
 public:
  explicit StopScope(const StopFlag* flag);
  ~StopScope();
  StopScope(const StopScope&) = delete;
  StopScope& operator=(const StopScope&) = delete;

 private:
  const StopFlag* previous_;
};

inline bool stopRequested(const StopFlag* flag) { return flag && flag->load(std::memory_order_relaxed); }

// A progress point: throws Stopped("<where>: stopped from outside") when `flag` is set.
void throwIfStopped(const StopFlag* flag, const char* where);

}  // namespace tpsim
