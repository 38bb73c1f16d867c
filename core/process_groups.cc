#include "core/process_groups.h"

#include <utility>
#include <vector>

#include "backends/errors.h"

namespace tpsim {

ProcessGroups::ProcessGroups(Collectives& world, ParallelLayout layout)
    : world_(world), layout_(std::move(layout)) {
  TPSIM_CHECK(world.size() == layout_.world(), "ProcessGroups: world communicator '", world.label(),
              "' must have the layout's world size ", layout_.world(), ", got ", world.size());
  const int rank = world.rank();
  for (const GroupSpec& spec : groupSpecs()) {
    // color = which group holds this rank, key = its place in it, so split orders members exactly
    // as the grid lists them.
    auto& comm = groups_[int(spec.id)];
    comm = world.split(layout_.groupIndex(spec.id, rank), layout_.groupRank(spec.id, rank), spec.label);
    std::vector<int> expected;
    for (int member : layout_.groupOf(spec.id, rank)) expected.push_back(world.globalRanks()[member]);
    TPSIM_INTERNAL_ASSERT(comm && comm->globalRanks() == expected, "split of group '", spec.label,
                          "' did not return the grid's members in grid order");
  }
}

Collectives& ProcessGroups::group(GroupId id) const {
  int index = int(id);
  TPSIM_CHECK(index >= 0 && index < kNumGroupIds, "ProcessGroups::group: id must be in [0, ", kNumGroupIds,
              "), got ", index);
  return *groups_[index];
}

}  // namespace tpsim
