#include "backends/collectives.h"

namespace tpsim {

const char* reduceOpName(ReduceOp op) { return op == ReduceOp::kSum ? "sum" : "mean"; }

const char* collectiveFailureName(CollectiveFailure kind) {
  switch (kind) {
    case CollectiveFailure::kPeerFailed: return "peer failed";
    case CollectiveFailure::kMismatch: return "mismatch";
    case CollectiveFailure::kDeadlock: return "deadlock";
    case CollectiveFailure::kTimeout: return "timeout";
    case CollectiveFailure::kDroppedWork: return "dropped work";
    case CollectiveFailure::kBackend: return "backend";
    case CollectiveFailure::kStopped: return "stopped";
  }
  return "unknown";
}

}  // namespace tpsim
