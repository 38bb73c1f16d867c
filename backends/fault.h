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

#include "backends/dtype.h"

namespace tpsim {

enum class FaultKind : std::uint8_t {
  kSkip,   // does not issue the collective; its Work completes at once, the output is left as is
  kOp,     // issues another op (allReduce <-> allGather, reduceScatter -> allGather, ...)
  kCount,  // issues another element count
  kDtype,  // issues another dtype (fp32 <-> bf16, anything else -> fp32)
  kGroup,  // issues it on another group (the world group, or for a world collective its last split)
  kThrow,  // throws instead of issuing it
  kStall,  // blocks before issuing it until the world's timeout fails the run
  // Issues it as asked, then flips one bit of one element of the result it receives: a silent data
  // corruption, which no peer notices and only a check of the results can.
  kCorrupt,
};
const char* faultKindName(FaultKind kind);  // "skip", "op", ...

struct Fault {
  int rank = 0;                // global rank, in [0, world size)
  std::int64_t collective = 1; // the rank's K-th collective, K >= 1
  FaultKind kind = FaultKind::kSkip;
  // kCorrupt: the flat index of the element of the result, and the bit flipped in its storage
  // (-1: the top bit of the exponent, which changes a value's magnitude the most).
  std::int64_t element = 0;
  int bit = -1;
  std::string str() const;     // "1:3:skip", "1:2:corrupt:5:3": the form parseFault reads
};

// The bit of a value of `dtype` that kCorrupt flips by default: the top bit of the exponent (for
// int64, the top bit below the sign).
int topExponentBit(DType dtype);

// "RANK:K:FAULT" -> Fault, RANK >= 0 and K >= 1 decimal integers; "RANK:K:corrupt:ELEMENT:BIT" names
// the element and bit to flip (ELEMENT >= 0, BIT in 0..63). Throws InvalidArgument saying what was
// expected and what it got. The rank's upper bound, and whether the element and bit fit the result,
// are the world's business.
Fault parseFault(const std::string& spec);

}  // namespace tpsim
