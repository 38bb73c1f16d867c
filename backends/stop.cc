#include "backends/stop.h"

#include <string>

namespace tpsim {
namespace {
thread_local const StopFlag* current = nullptr;
}  // namespace

const StopFlag* currentStopFlag() { return current; }

StopScope::StopScope(const StopFlag* flag) : previous_(current) { current = flag; }

StopScope::~StopScope() { current = previous_; }

void throwIfStopped(const StopFlag* flag, const char* where) {
  if (stopRequested(flag)) throw Stopped(std::string(where) + ": stopped from outside");
}

}  // namespace tpsim
