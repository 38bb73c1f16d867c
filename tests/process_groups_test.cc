// Tests for core/process_groups.h on the simulator: every named communicator has the grid's
// members in grid order, and an allReduce over it sums exactly those members' contributions.
#include "core/process_groups.h"

#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "sim/world.h"
#include "tests/sim_test_util.h"

namespace tpsim {
namespace {

// What one rank saw of one group.
struct Seen {
  std::vector<int> globalRanks;
  int rank = -1;
  int size = -1;
  std::string label;
  std::vector<double> sum;  // allReduce of (r + 1)·(i + 1), i = 0..2, r = global rank
};

// Builds ProcessGroups on every rank of a world of layout.world() ranks and checks each group
// against the grid after the run, on the test thread.
void checkAgainstGrid(const ParallelSizes& sizes) {
  const ParallelLayout layout(sizes);
  const int world = layout.world();
  std::vector<std::vector<Seen>> seen(world);  // [rank][group id]
  testing::runRanks(world, [&](RankContext& ctx) {
    ProcessGroups groups(ctx.comm, layout);
    const int r = ctx.comm.rank();
    for (const GroupSpec& spec : groupSpecs()) {
      Collectives& comm = groups.group(spec.id);
      Seen s{comm.globalRanks(), comm.rank(), comm.size(), comm.label(), {}};
      Tensor x = testing::tensorOf(ctx.compute, DType::kFloat32, {r + 1.0, 2.0 * (r + 1), 3.0 * (r + 1)});
      comm.allReduce(x.view())->wait();
      s.sum = testing::valuesOf(ctx.compute, x);
      seen[r].push_back(std::move(s));
    }
  });

  for (int r = 0; r < world; ++r) {
    ASSERT_EQ(int(seen[r].size()), kNumGroupIds) << "rank " << r;
    for (const GroupSpec& spec : groupSpecs()) {
      SCOPED_TRACE(std::string("rank ") + std::to_string(r) + ", group " + spec.label);
      const Seen& s = seen[r][int(spec.id)];
      const std::vector<int> members = layout.groupOf(spec.id, r);
      EXPECT_EQ(s.globalRanks, members);
      EXPECT_EQ(s.rank, layout.groupRank(spec.id, r));
      EXPECT_EQ(s.size, int(members.size()));
      EXPECT_EQ(s.label, spec.label);
      double memberSum = 0;  // Σ_{m ∈ group} (m + 1)
      for (int m : members) memberSum += m + 1;
      EXPECT_EQ(s.sum, (std::vector<double>{memberSum, 2 * memberSum, 3 * memberSum}));
    }
  }
}

ParallelSizes w8Example(int expertTp, int ep, int expertGtpRemat) {
  ParallelSizes s;
  s.world = 8;
  s.tp = 2;
  s.gtpRemat = 2;
  s.expertTp = expertTp;
  s.ep = ep;
  s.expertGtpRemat = expertGtpRemat;
  return s;
}

TEST(ProcessGroups, W8ExampleMatchesGrid) { checkAgainstGrid(w8Example(2, 1, 1)); }
TEST(ProcessGroups, W8ExampleWithEgtpMatchesGrid) { checkAgainstGrid(w8Example(2, 1, 2)); }
TEST(ProcessGroups, W8ExampleWithEpAndEgtpMatchesGrid) { checkAgainstGrid(w8Example(1, 2, 2)); }

TEST(ProcessGroups, W8Tp4Pp2MatchesGrid) {
  ParallelSizes s;
  s.world = 8;
  s.tp = 4;
  s.pp = 2;
  checkAgainstGrid(s);
}

TEST(ProcessGroups, W24AllAxesMatchesGrid) {
  ParallelSizes s;
  s.world = 24;
  s.tp = 2;
  s.gtpRemat = 3;
  s.cp = 2;
  s.pp = 2;  // D = 1
  s.expertTp = 1;
  s.ep = 2;
  s.expertGtpRemat = 2;  // ED = 3
  checkAgainstGrid(s);
}

TEST(ProcessGroups, W8TwoDistOptInstancesMatchGrid) {
  ParallelSizes s;
  s.world = 8;
  s.tp = 2;
  s.pp = 2;
  s.distOptInstances = 2;
  checkAgainstGrid(s);
}

TEST(ProcessGroups, W8ExampleTpGroups) {
  const ParallelLayout layout(w8Example(2, 1, 1));
  std::vector<std::vector<int>> tpMembers(8);
  std::vector<int> tpRank(8, -1);
  std::vector<double> tpSum(8, 0);
  testing::runRanks(8, [&](RankContext& ctx) {
    ProcessGroups groups(ctx.comm, layout);
    const int r = ctx.comm.rank();
    EXPECT_EQ(&groups.world(), &ctx.comm);
    tpMembers[r] = groups.tp().globalRanks();
    tpRank[r] = groups.tp().rank();
    Tensor x = testing::tensorOf(ctx.compute, DType::kFloat32, {double(r)});
    groups.tp().allReduce(x.view())->wait();
    tpSum[r] = testing::valuesOf(ctx.compute, x)[0];
  });
  for (int r = 0; r < 8; ++r) {
    const int base = r - r % 2;  // TP groups [0,1] [2,3] [4,5] [6,7]
    EXPECT_EQ(tpMembers[r], (std::vector<int>{base, base + 1})) << "rank " << r;
    EXPECT_EQ(tpRank[r], r % 2) << "rank " << r;
    EXPECT_EQ(tpSum[r], 2 * base + 1) << "rank " << r;
  }
}

TEST(ProcessGroups, NamedAccessorsReturnTheirGroups) {
  const ParallelLayout layout(w8Example(1, 2, 2));
  testing::runRanks(8, [&](RankContext& ctx) {
    ProcessGroups g(ctx.comm, layout);
    const std::vector<std::pair<Collectives*, GroupId>> named = {
        {&g.tp(), GroupId::kTp},
        {&g.gtpRemat(), GroupId::kGtpRemat},
        {&g.dp(), GroupId::kDp},
        {&g.dpCp(), GroupId::kDpCp},
        {&g.dpGtp(), GroupId::kDpGtp},
        {&g.dpCpGtp(), GroupId::kDpCpGtp},
        {&g.modelParallel(), GroupId::kModelParallel},
        {&g.tpDp(), GroupId::kTpDp},
        {&g.expertTp(), GroupId::kExpertTp},
        {&g.ep(), GroupId::kEp},
        {&g.expertGtpRemat(), GroupId::kExpertGtpRemat},
        {&g.expertDp(), GroupId::kExpertDp},
        {&g.expertDpGtp(), GroupId::kExpertDpGtp},
        {&g.intraDistOpt(), GroupId::kIntraDistOpt},
    };
    ASSERT_EQ(int(named.size()), kNumGroupIds);
    for (const auto& [comm, id] : named) {
      EXPECT_EQ(comm, &g.group(id));
      EXPECT_EQ(comm->label(), groupSpec(id).label);
    }
    EXPECT_EQ(g.layout().expertDp(), 2);
  });
}

TEST(ProcessGroups, WorldSizeMustMatchLayout) {
  const ParallelLayout layout(w8Example(2, 1, 1));
  try {
    testing::runRanks(4, [&](RankContext& ctx) { ProcessGroups groups(ctx.comm, layout); });
    ADD_FAILURE() << "expected a WorldError";
  } catch (const WorldError& e) {
    ASSERT_EQ(e.rankErrors().size(), 4u);
    for (const std::string& message : e.rankErrors())
      EXPECT_NE(message.find("must have the layout's world size 8, got 4"), std::string::npos) << message;
  }
}

}  // namespace
}  // namespace tpsim
