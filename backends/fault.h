// Injected faults: a plan of ranks that misbehave at one of their collectives, on purpose.
//
// A world (sim or gpu; the shared rendezvous acts on it) makes rank `rank`, at the `collective`-th
// collective it issues, do `kind` instead of what its code asked for, so that a reader sees what a
// broken rank looks like to its peers. Counting starts at 1 and covers every collective of every
// group the rank is in, in issue order; the splits that make groups are not counted. This is a
// teaching and testing aid, not a failure model of real hardware.
#pragma once

#include <cstdint>
#include <string>

namespace tpsim {

enum class FaultKind : std::uint8_t {
  kSkip,   // does not issue the collective; its Work completes at once, the output is left as is
  kOp,     // issues another op (allReduce <-> allGather, reduceScatter -> allGather, ...)
  kCount,  // issues another element count
  kDtype,  // issues another dtype (fp32 <-> bf16, anything else -> fp32)
  kGroup,  // issues it on another group (the world group, or for a world collective its last split)
  kThrow,  // throws instead of issuing it
  kStall,  // blocks before issuing it until the world's timeout fails the run
};
const char* faultKindName(FaultKind kind);  // "skip", "op", ...

struct Fault {
  int rank = 0;                // global rank, in [0, world size)
  std::int64_t collective = 1; // the rank's K-th collective, K >= 1
  FaultKind kind = FaultKind::kSkip;
  std::string str() const;     // "1:3:skip", the form parseFault reads
};

// "RANK:K:FAULT" -> Fault, RANK >= 0 and K >= 1 decimal integers. Throws InvalidArgument saying
// what was expected and what it got. The rank's upper bound is the world's business.
Fault parseFault(const std::string& spec);

}  // namespace tpsim
