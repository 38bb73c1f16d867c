// ProcessGroups: the communicators of every named group of SPEC 1.4.2, split from the world.
//
// Built collectively: every rank of `world` constructs one with the same ParallelLayout, and the
// constructor splits the world once per named group (groupSpecs() order), so the split sequence
// matches on all ranks. It is not a global registry (each layer is handed the groups it uses), and
// it does not decide which group a layer picks (SPEC 1.4.4). Grid ranks are ranks of `world`.
#pragma once

#include <array>
#include <memory>

#include "backends/collectives.h"
#include "core/rank_grid.h"

namespace tpsim {

class ProcessGroups {
 public:
  // Collective over `world`. Throws InvalidArgument when world.size() != layout.world().
  ProcessGroups(Collectives& world, ParallelLayout layout);

  const ParallelLayout& layout() const { return layout_; }
  Collectives& world() const { return world_; }
  Collectives& group(GroupId id) const;

  Collectives& tp() const { return group(GroupId::kTp); }
  Collectives& gtpRemat() const { return group(GroupId::kGtpRemat); }
  Collectives& dp() const { return group(GroupId::kDp); }
  Collectives& dpCp() const { return group(GroupId::kDpCp); }
  Collectives& dpGtp() const { return group(GroupId::kDpGtp); }
  Collectives& dpCpGtp() const { return group(GroupId::kDpCpGtp); }
  Collectives& modelParallel() const { return group(GroupId::kModelParallel); }
  Collectives& tpDp() const { return group(GroupId::kTpDp); }
  Collectives& expertTp() const { return group(GroupId::kExpertTp); }
  Collectives& ep() const { return group(GroupId::kEp); }
  Collectives& expertGtpRemat() const { return group(GroupId::kExpertGtpRemat); }
  Collectives& expertDp() const { return group(GroupId::kExpertDp); }
  Collectives& expertDpGtp() const { return group(GroupId::kExpertDpGtp); }
  // The distributed optimizer's instance: the grad-stats group when an optimizer shards gradients
  // over data-parallel ranks (core/grad_stats.h). The whole world under GTP_remat.
  Collectives& intraDistOpt() const { return group(GroupId::kIntraDistOpt); }

 private:
  Collectives& world_;
  ParallelLayout layout_;
  std::array<std::unique_ptr<Collectives>, kNumGroupIds> groups_;
};

}  // namespace tpsim
