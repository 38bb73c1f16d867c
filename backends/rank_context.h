// RankContext: everything a rank's code may touch (gloo::Context: rank + size + transport).
//
// Layers in core/ see only this: the rank's Compute and its world communicator, from which
// sub-groups are split (core/process_groups.h). The same rank code runs on the simulator and on
// a GPU; the backend builds the context.
#pragma once

#include "backends/collectives.h"
#include "backends/compute.h"

namespace tpsim {

struct RankContext {
  Compute& compute;
  Collectives& comm;  // the world group
};

}  // namespace tpsim
