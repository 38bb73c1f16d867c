// Tests for core/rank_grid.h: the SPEC 1.4.3 worked example, the T = 4, P = 2 check, the
// bijection and partition laws of SPEC 6 item 20 over a sweep of factorizations, and every error.
#include "core/rank_grid.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <map>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "backends/errors.h"

namespace tpsim {
namespace {

using Groups = std::vector<std::vector<int>>;

// The SPEC 1.4.3 world: W = 8, T = 2, G = 2, D = 2, with the given expert sizes.
ParallelSizes w8Example(int expertTp = 2, int ep = 1, int expertGtpRemat = 1) {
  ParallelSizes s;
  s.world = 8;
  s.tp = 2;
  s.gtpRemat = 2;
  s.expertTp = expertTp;
  s.ep = ep;
  s.expertGtpRemat = expertGtpRemat;
  return s;
}

Groups singletons(int n) {
  Groups g;
  for (int r = 0; r < n; ++r) g.push_back({r});
  return g;
}

void expectInvalid(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "expected InvalidArgument containing \"" << needle << "\"";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message \"" << e.what() << "\" lacks \"" << needle << "\"";
  }
}

std::string joinToken(const std::vector<std::string>& axes) {
  std::string token;
  for (const auto& a : axes) token += (token.empty() ? "" : "-") + a;
  return token;
}

// Axes of `grid` selected by the bits of `mask`, in grid order.
std::vector<std::string> maskedAxes(const RankGrid& grid, unsigned mask) {
  std::vector<std::string> axes;
  for (std::size_t k = 0; k < grid.axes().size(); ++k)
    if (mask & (1u << k)) axes.push_back(grid.axes()[k]);
  return axes;
}

// SPEC 6 item 20 plus the listing rules of 1.4.2, for every token of `grid`. With
// `checkDisjointPairs`, also every pair of disjoint tokens.
void checkGridLaws(const RankGrid& grid, bool checkDisjointPairs) {
  SCOPED_TRACE(grid.str());
  const int n = grid.size();
  const int first = grid.rankOffset();
  const std::size_t axes = grid.axes().size();

  // Rank <-> coordinates is a bijection onto the coordinate box.
  std::vector<std::vector<int>> coords(n);
  for (int r = first; r < first + n; ++r) {
    coords[r - first] = grid.coordinates(r);
    ASSERT_EQ(coords[r - first].size(), axes);
    for (std::size_t k = 0; k < axes; ++k) {
      ASSERT_GE(coords[r - first][k], 0);
      ASSERT_LT(coords[r - first][k], grid.sizes()[k]);
    }
    ASSERT_EQ(grid.rankAt(coords[r - first]), r);
  }
  std::vector<std::vector<int>> sorted = coords;
  std::sort(sorted.begin(), sorted.end());
  ASSERT_EQ(std::unique(sorted.begin(), sorted.end()), sorted.end()) << "two ranks share coordinates";

  const unsigned masks = 1u << axes;
  // groupOfRank[mask][r - first] = groupIndex of rank r for that token.
  std::vector<std::vector<int>> groupOfRank(masks);
  std::vector<int> groupCount(masks);
  for (unsigned mask = 1; mask < masks; ++mask) {
    const std::string token = joinToken(maskedAxes(grid, mask));
    SCOPED_TRACE("token " + token);
    int groupSize = 1;
    for (std::size_t k = 0; k < axes; ++k)
      if (mask & (1u << k)) groupSize *= grid.sizes()[k];
    const Groups groups = grid.groups(token);
    ASSERT_EQ(int(groups.size()) * groupSize, n);
    groupCount[mask] = int(groups.size());

    std::vector<int> seen(n, 0);
    groupOfRank[mask].assign(n, -1);
    for (std::size_t gi = 0; gi < groups.size(); ++gi) {
      ASSERT_EQ(int(groups[gi].size()), groupSize);
      for (std::size_t i = 0; i < groups[gi].size(); ++i) {
        const int r = groups[gi][i];
        ASSERT_GE(r, first);
        ASSERT_LT(r, first + n);
        ++seen[r - first];
        groupOfRank[mask][r - first] = int(gi);
        EXPECT_EQ(grid.groupIndex(token, r), int(gi));
        EXPECT_EQ(grid.groupRank(token, r), int(i));
        EXPECT_EQ(grid.groupOf(token, r), groups[gi]);
        // Members agree on every unselected coordinate.
        for (std::size_t k = 0; k < axes; ++k) {
          if (mask & (1u << k)) continue;
          EXPECT_EQ(coords[r - first][k], coords[groups[gi][0] - first][k]);
        }
      }
    }
    for (int r = 0; r < n; ++r)
      ASSERT_EQ(seen[r], 1) << "rank " << first + r << " is in " << seen[r] << " groups";
  }

  if (!checkDisjointPairs) return;
  for (unsigned a = 1; a < masks; ++a) {
    for (unsigned b = 1; b < masks; ++b) {
      if (a & b) continue;
      const int groupsA = groupCount[a], groupsB = groupCount[b];
      std::vector<int> shared(std::size_t(groupsA) * groupsB, 0);
      std::vector<int> memberA(groupsA), memberB(groupsB);  // one member of each group
      for (int r = 0; r < n; ++r) {
        ++shared[std::size_t(groupOfRank[a][r]) * groupsB + groupOfRank[b][r]];
        memberA[groupOfRank[a][r]] = r;
        memberB[groupOfRank[b][r]] = r;
      }
      for (int ga = 0; ga < groupsA; ++ga) {
        for (int gb = 0; gb < groupsB; ++gb) {
          bool agree = true;
          for (std::size_t k = 0; k < axes; ++k)
            if (!((a | b) & (1u << k))) agree = agree && coords[memberA[ga]][k] == coords[memberB[gb]][k];
          ASSERT_EQ(shared[std::size_t(ga) * groupsB + gb], agree ? 1 : 0)
              << "tokens " << joinToken(maskedAxes(grid, a)) << " and " << joinToken(maskedAxes(grid, b))
              << ", groups " << ga << " and " << gb;
        }
      }
    }
  }
}

std::vector<int> divisors(int n) {
  std::vector<int> d;
  for (int i = 1; i <= n; ++i)
    if (n % i == 0) d.push_back(i);
  return d;
}

// ---- SPEC 1.4.3: W = 8, T = 2, G = 2, D = 2 ----

TEST(RankGridW8Example, DenseGridIsTpGtpCpEpDpPp) {
  ParallelLayout layout(w8Example());
  EXPECT_EQ(layout.dp(), 2);
  EXPECT_EQ(layout.dense().axes(), (std::vector<std::string>{"tp", "gtp_remat", "cp", "ep", "dp", "pp"}));
  EXPECT_EQ(layout.dense().sizes(), (std::vector<int>{2, 2, 1, 1, 2, 1}));
  // rank = t + 2g + 4d
  const int table[8][3] = {{0, 0, 0}, {1, 0, 0}, {0, 1, 0}, {1, 1, 0},
                           {0, 0, 1}, {1, 0, 1}, {0, 1, 1}, {1, 1, 1}};
  for (int r = 0; r < 8; ++r) {
    const std::vector<int> c = {table[r][0], table[r][1], 0, 0, table[r][2], 0};
    EXPECT_EQ(layout.dense().coordinates(r), c) << "rank " << r;
    EXPECT_EQ(layout.dense().rankAt(c), r);
  }
}

TEST(RankGridW8Example, DenseGroups) {
  ParallelLayout layout(w8Example());
  EXPECT_EQ(layout.groups(GroupId::kTp), (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(layout.groups(GroupId::kGtpRemat), (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(layout.groups(GroupId::kDp), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(layout.groups(GroupId::kDpCp), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(layout.groups(GroupId::kDpGtp), (Groups{{0, 2, 4, 6}, {1, 3, 5, 7}}));
  EXPECT_EQ(layout.groups(GroupId::kDpCpGtp), (Groups{{0, 2, 4, 6}, {1, 3, 5, 7}}));
  EXPECT_EQ(layout.groups(GroupId::kModelParallel), (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(layout.groups(GroupId::kTpDp), (Groups{{0, 1, 2, 3, 4, 5, 6, 7}}));
}

TEST(RankGridW8Example, GroupRanks) {
  ParallelLayout layout(w8Example());
  const RankGrid& g = layout.dense();
  EXPECT_EQ(g.groupRank("gtp_remat-dp", 6), 3);
  EXPECT_EQ(g.groupOf("gtp_remat-dp", 6), (std::vector<int>{0, 2, 4, 6}));
  for (int r = 0; r < 8; ++r) {
    const int t = r % 2, gg = (r / 2) % 2, d = r / 4;
    EXPECT_EQ(layout.groupRank(GroupId::kDpGtp, r), gg + 2 * d) << "rank " << r;
    EXPECT_EQ(layout.groupRank(GroupId::kTp, r), t);
    EXPECT_EQ(layout.groupRank(GroupId::kGtpRemat, r), gg);
    EXPECT_EQ(layout.groupRank(GroupId::kDp, r), d);
    EXPECT_EQ(layout.groupRank(GroupId::kModelParallel, r), t + 2 * gg);
    EXPECT_EQ(layout.groupRank(GroupId::kTpDp, r), r);
    EXPECT_EQ(layout.groupIndex(GroupId::kTp, r), gg + 2 * d);
    EXPECT_EQ(layout.groupIndex(GroupId::kDpGtp, r), t);
  }
}

TEST(RankGridW8Example, ExpertGridEt2E1Eg1) {
  ParallelLayout layout(w8Example(2, 1, 1));
  EXPECT_EQ(layout.expertDp(), 4);
  EXPECT_EQ(layout.expert().axes(), (std::vector<std::string>{"tp", "cp", "ep", "gtp_remat", "dp", "pp"}));
  EXPECT_EQ(layout.expert().sizes(), (std::vector<int>{2, 1, 1, 1, 4, 1}));
  EXPECT_EQ(layout.groups(GroupId::kExpertTp), (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(layout.groups(GroupId::kExpertGtpRemat), singletons(8));
  EXPECT_EQ(layout.groups(GroupId::kEp), singletons(8));
  EXPECT_EQ(layout.groups(GroupId::kExpertDp), (Groups{{0, 2, 4, 6}, {1, 3, 5, 7}}));
  EXPECT_EQ(layout.groups(GroupId::kExpertDpGtp), (Groups{{0, 2, 4, 6}, {1, 3, 5, 7}}));
}

TEST(RankGridW8Example, ExpertGridEt2E1Eg2) {
  ParallelLayout layout(w8Example(2, 1, 2));
  EXPECT_EQ(layout.expertDp(), 2);
  EXPECT_EQ(layout.groups(GroupId::kExpertTp), (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(layout.groups(GroupId::kExpertGtpRemat), (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(layout.groups(GroupId::kExpertDp), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(layout.groups(GroupId::kExpertDp), layout.groups(GroupId::kDp));
  EXPECT_EQ(layout.groups(GroupId::kExpertDpGtp), (Groups{{0, 2, 4, 6}, {1, 3, 5, 7}}));
}

TEST(RankGridW8Example, ExpertGridEt1E2Eg2) {
  ParallelLayout layout(w8Example(1, 2, 2));
  EXPECT_EQ(layout.expertDp(), 2);
  EXPECT_EQ(layout.expert().sizes(), (std::vector<int>{1, 1, 2, 2, 2, 1}));
  for (int r = 0; r < 8; ++r)  // rank = e + 2·eg + 4·ed
    EXPECT_EQ(layout.expert().coordinates(r), (std::vector<int>{0, 0, r % 2, (r / 2) % 2, r / 4, 0}));
  EXPECT_EQ(layout.groups(GroupId::kExpertTp), singletons(8));
  EXPECT_EQ(layout.groups(GroupId::kEp), (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(layout.groups(GroupId::kExpertGtpRemat), (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(layout.groups(GroupId::kExpertDp), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  // The dense grid does not depend on the expert sizes.
  EXPECT_EQ(layout.groups(GroupId::kTp), (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
}

TEST(RankGridW8Example, Tp4Pp2DefaultOrder) {
  ParallelSizes s;
  s.world = 8;
  s.tp = 4;
  s.pp = 2;
  ParallelLayout layout(s);
  EXPECT_EQ(layout.dp(), 1);
  EXPECT_EQ(layout.groups(GroupId::kTp), (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(layout.dense().groups("pp"), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(layout.groups(GroupId::kExpertTp), (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}}));
}

// ---- Distributed-optimizer instances ----

// G17: under GTP_remat the grad-stats group (the instance group) is the whole world, dense
// (T = 1, G = 2, D = 2) and MoE (E = 2, EG = 2, G = 2) alike. Megatron's recipe of ED consecutive
// "tp-ep-pp" groups would cover only half of the MoE world: those groups leave out the EGTP peers.
TEST(DistOptInstances, G17GradStatsGroupIsTheWorldUnderGtp) {
  ParallelSizes dense;
  dense.world = 4;
  dense.gtpRemat = 2;
  ParallelSizes moe = dense;
  moe.ep = 2;
  moe.expertGtpRemat = 2;
  for (const ParallelSizes& s : {dense, moe}) {
    const ParallelLayout layout(s);
    EXPECT_EQ(layout.groups(GroupId::kIntraDistOpt), (Groups{{0, 1, 2, 3}}));
    for (int r = 0; r < 4; ++r) {
      EXPECT_EQ(layout.groupOf(GroupId::kIntraDistOpt, r).size(), 4u);
      EXPECT_EQ(layout.groupRank(GroupId::kIntraDistOpt, r), r);
      EXPECT_EQ(layout.groupIndex(GroupId::kIntraDistOpt, r), 0);
    }
  }
  const ParallelLayout layout(moe);
  ASSERT_EQ(layout.expertDp(), 1);
  EXPECT_EQ(layout.expert().groups("tp-ep-pp"), (Groups{{0, 1}, {2, 3}}));
}

// Two instances of W = 8, T = 2, D = 4: ED/2 = 2 consecutive expert model-parallel groups each,
// as Megatron's parallel-state init builds them.
TEST(DistOptInstances, InstancesSplitTheDataParallelAxis) {
  ParallelSizes s;
  s.world = 8;
  s.tp = 2;
  s.distOptInstances = 2;
  const ParallelLayout layout(s);
  EXPECT_EQ(layout.groups(GroupId::kIntraDistOpt), (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  for (int r = 0; r < 8; ++r) {
    EXPECT_EQ(layout.groupIndex(GroupId::kIntraDistOpt, r), r / 4);
    EXPECT_EQ(layout.groupRank(GroupId::kIntraDistOpt, r), r % 4);
  }
  s.pp = 2;  // D = 2, ED = 2: an instance is one data-parallel index with both its stages
  const ParallelLayout staged(s);
  EXPECT_EQ(staged.groups(GroupId::kIntraDistOpt), (Groups{{0, 1, 4, 5}, {2, 3, 6, 7}}));
}

TEST(DistOptInstances, Errors) {
  ParallelSizes s;
  s.world = 8;
  s.tp = 2;
  s.distOptInstances = 0;
  expectInvalid([&] { ParallelLayout{s}; }, "num_distributed_optimizer_instances must be >= 1, got 0");
  s.distOptInstances = 3;
  expectInvalid([&] { ParallelLayout{s}; },
                "num_distributed_optimizer_instances (3) must divide the data-parallel size with context "
                "parallelism D·C = 4·1 = 4");
  s.distOptInstances = 2;
  s.gtpRemat = 2;
  expectInvalid([&] { ParallelLayout{s}; },
                "num_distributed_optimizer_instances must be 1 with GTP_remat (G = 2, EG = 1), got 2");
  s.gtpRemat = 1;
  s.expertGtpRemat = 2;
  expectInvalid([&] { ParallelLayout{s}; }, "(G = 1, EG = 2), got 2");
  s.expertGtpRemat = 1;
  s.expertTp = 1;
  s.ep = 8;  // ED = 1
  expectInvalid([&] { ParallelLayout{s}; },
                "num_distributed_optimizer_instances (2) must divide the expert data-parallel size ED = 1");
}

// ---- Grid rules ----

TEST(RankGrid, GroupSpecTable) {
  const std::map<GroupId, std::pair<std::string, std::string>> expected = {
      {GroupId::kTp, {"tp", "tp"}},
      {GroupId::kGtpRemat, {"gtp_remat", "gtp_remat"}},
      {GroupId::kDp, {"dp", "dp"}},
      {GroupId::kDpCp, {"dp-cp", "dp_cp"}},
      {GroupId::kDpGtp, {"gtp_remat-dp", "dp_gtp"}},
      {GroupId::kDpCpGtp, {"gtp_remat-dp-cp", "dp_cp_gtp"}},
      {GroupId::kModelParallel, {"tp-gtp_remat-pp", "mp"}},
      {GroupId::kTpDp, {"tp-gtp_remat-dp-cp", "tp_dp"}},
      {GroupId::kExpertTp, {"tp", "etp"}},
      {GroupId::kEp, {"ep", "ep"}},
      {GroupId::kExpertGtpRemat, {"gtp_remat", "egtp"}},
      {GroupId::kExpertDp, {"dp", "edp"}},
      {GroupId::kExpertDpGtp, {"gtp_remat-dp", "edp_egtp"}},
      {GroupId::kIntraDistOpt, {"tp-ep-gtp_remat-pp", "intra_dist_opt"}},
  };
  ASSERT_EQ(int(expected.size()), kNumGroupIds);
  for (int i = 0; i < kNumGroupIds; ++i) {
    const GroupSpec& spec = groupSpecs()[i];
    EXPECT_EQ(int(spec.id), i);
    EXPECT_EQ(&groupSpec(spec.id), &spec);
    EXPECT_EQ(spec.token, expected.at(spec.id).first);
    EXPECT_EQ(spec.label, expected.at(spec.id).second);
    EXPECT_EQ(spec.grid, i < int(GroupId::kExpertTp) ? GridKind::kDense : GridKind::kExpert);
  }
}

TEST(RankGrid, TokenOrderDoesNotMatter) {
  ParallelSizes s;
  s.world = 48;
  s.tp = 2;
  s.gtpRemat = 3;
  s.cp = 2;
  s.pp = 2;
  ParallelLayout layout(s);  // D = 2
  const RankGrid& g = layout.dense();
  EXPECT_EQ(g.groups("dp-gtp_remat"), g.groups("gtp_remat-dp"));
  for (unsigned mask = 1; mask < (1u << g.axes().size()); ++mask) {
    std::vector<std::string> axes = maskedAxes(g, mask);
    const std::string canonical = joinToken(axes);
    const Groups groups = g.groups(canonical);
    std::sort(axes.begin(), axes.end());
    do {
      const std::string token = joinToken(axes);
      ASSERT_EQ(g.groups(token), groups) << token << " vs " << canonical;
      for (int r = 0; r < g.size(); r += 7) {
        EXPECT_EQ(g.groupRank(token, r), g.groupRank(canonical, r)) << token;
        EXPECT_EQ(g.groupIndex(token, r), g.groupIndex(canonical, r)) << token;
        EXPECT_EQ(g.groupOf(token, r), g.groupOf(canonical, r)) << token;
      }
    } while (std::next_permutation(axes.begin(), axes.end()));
  }
}

TEST(RankGrid, MissingSizeOneAxesAreAppendedInSizesOrder) {
  RankGrid g("dp-tp", {{"tp", 2}, {"pp", 1}, {"dp", 3}, {"cp", 1}});
  EXPECT_EQ(g.axes(), (std::vector<std::string>{"dp", "tp", "pp", "cp"}));
  EXPECT_EQ(g.sizes(), (std::vector<int>{3, 2, 1, 1}));
  EXPECT_EQ(g.size(), 6);
  EXPECT_EQ(g.groups("tp"), (Groups{{0, 3}, {1, 4}, {2, 5}}));
  EXPECT_EQ(g.groups("pp"), singletons(6));
  EXPECT_EQ(g.axisSize("dp"), 3);
}

TEST(RankGrid, RankOffsetShiftsEveryRank) {
  RankGrid g("tp-dp", {{"tp", 2}, {"dp", 2}}, 4);
  EXPECT_EQ(g.groups("tp"), (Groups{{4, 5}, {6, 7}}));
  EXPECT_EQ(g.groups("dp"), (Groups{{4, 6}, {5, 7}}));
  EXPECT_EQ(g.coordinates(7), (std::vector<int>{1, 1}));
  EXPECT_EQ(g.groupRank("dp", 6), 1);
  checkGridLaws(g, true);
}

TEST(RankGrid, GtpRematPlacement) {
  ParallelSizes s;
  s.world = 8;
  s.tp = 2;
  s.gtpRemat = 2;
  s.ep = 2;
  s.expertTp = 1;
  s.expertGtpRemat = 2;
  s.order = "tp-cp-dp-ep-pp";  // ep slower than dp: the expert gtp_remat follows ep
  ParallelLayout custom(s);
  EXPECT_EQ(custom.dense().axes(), (std::vector<std::string>{"tp", "gtp_remat", "cp", "dp", "ep", "pp"}));
  EXPECT_EQ(custom.expert().axes(), (std::vector<std::string>{"tp", "cp", "dp", "ep", "gtp_remat", "pp"}));

  s.order = "gtp_remat-tp-cp-ep-dp-pp";  // an order that names gtp_remat keeps it where it is
  ParallelLayout named(s);
  EXPECT_EQ(named.dense().axes(), (std::vector<std::string>{"gtp_remat", "tp", "cp", "ep", "dp", "pp"}));
  EXPECT_EQ(named.expert().axes(), named.dense().axes());
  EXPECT_EQ(named.groups(GroupId::kGtpRemat), (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));

  ParallelSizes noTp;
  noTp.world = 4;
  noTp.gtpRemat = 2;
  noTp.order = "cp-dp-pp";  // without tp (or ep) gtp_remat goes first; tp and ep are appended
  ParallelLayout front(noTp);
  EXPECT_EQ(front.dense().axes(), (std::vector<std::string>{"gtp_remat", "cp", "dp", "pp", "tp", "ep"}));
  EXPECT_EQ(front.groups(GroupId::kGtpRemat), (Groups{{0, 1}, {2, 3}}));
}

TEST(RankGrid, GtpInclusiveGroupsEqualExcludedOnesWhenGIsOne) {
  ParallelSizes s;
  s.world = 16;
  s.tp = 2;
  s.cp = 2;
  s.ep = 2;
  ParallelLayout layout(s);
  EXPECT_EQ(layout.groups(GroupId::kDpGtp), layout.groups(GroupId::kDp));
  EXPECT_EQ(layout.groups(GroupId::kDpCpGtp), layout.groups(GroupId::kDpCp));
  EXPECT_EQ(layout.groups(GroupId::kExpertDpGtp), layout.groups(GroupId::kExpertDp));
  EXPECT_EQ(layout.groups(GroupId::kGtpRemat), singletons(16));
}

// ---- SPEC 6 item 20 over a sweep ----

TEST(RankGridLaws, DenseGridsOverFactorizations) {
  int layouts = 0;
  for (int world : {1, 2, 4, 6, 8, 12, 16}) {
    for (int tp : divisors(world))
      for (int gtp : divisors(world / tp))
        for (int cp : divisors(world / (tp * gtp)))
          for (int pp : divisors(world / (tp * gtp * cp))) {
            ParallelSizes s;
            s.world = world;
            s.tp = tp;
            s.gtpRemat = gtp;
            s.cp = cp;
            s.pp = pp;
            ParallelLayout layout(s);
            ASSERT_EQ(layout.dp() * tp * gtp * cp * pp, world);
            ASSERT_EQ(layout.dense().sizes(), (std::vector<int>{tp, gtp, cp, 1, layout.dp(), pp}));
            checkGridLaws(layout.dense(), true);
            ++layouts;
          }
  }
  EXPECT_GT(layouts, 100);
}

TEST(RankGridLaws, ExpertGridsOverFactorizations) {
  for (int world : {1, 2, 4, 6, 8, 12, 16}) {
    for (int etp : divisors(world))
      for (int ep : divisors(world / etp))
        for (int egtp : divisors(world / (etp * ep)))
          for (int pp : divisors(world / (etp * ep * egtp))) {
            ParallelSizes s;
            s.world = world;
            s.pp = pp;  // dense: T = 1, D = W / P
            s.expertTp = etp;
            s.ep = ep;
            s.expertGtpRemat = egtp;
            ParallelLayout layout(s);
            ASSERT_EQ(layout.expertDp() * etp * ep * egtp * pp, world);
            ASSERT_EQ(layout.expert().sizes(), (std::vector<int>{etp, 1, ep, egtp, layout.expertDp(), pp}));
            EXPECT_EQ(layout.dense().groups("pp"), layout.expert().groups("pp"));
            checkGridLaws(layout.expert(), true);
          }
  }
}

TEST(RankGridLaws, EveryAxisOrder) {
  std::vector<std::string> order = {"cp", "dp", "ep", "gtp_remat", "pp", "tp"};
  const std::vector<AxisSize> sizes = {{"tp", 2}, {"gtp_remat", 3}, {"cp", 1},
                                       {"ep", 2}, {"dp", 1},        {"pp", 2}};
  int orders = 0;
  do {
    RankGrid g(joinToken(order), sizes, orders % 3);
    ASSERT_EQ(g.axes(), order);
    checkGridLaws(g, orders % 60 == 0);
    ++orders;
  } while (std::next_permutation(order.begin(), order.end()));
  EXPECT_EQ(orders, 720);
}

// ---- Errors ----

TEST(RankGridErrors, DenseDpNotInteger) {
  ParallelSizes s = w8Example();
  s.gtpRemat = 3;
  expectInvalid([&] { ParallelLayout{s}; },
                "D = W/(T·P·C·G) must be an integer, got W = 8 and T·P·C·G = 2·1·1·3 = 6");
  s.gtpRemat = 1;
  s.tp = 1000000;
  s.pp = 1000000;
  s.cp = 1000000;
  expectInvalid([&] { ParallelLayout{s}; }, "T·P·C·G = 1000000·1000000·1000000·1 > 8");
}

TEST(RankGridErrors, ExpertDpNotInteger) {
  expectInvalid([&] { ParallelLayout{w8Example(2, 1, 3)}; },
                "ED = W/(ET·E·P·EG) must be an integer, got W = 8 and ET·E·P·EG = 2·1·1·3 = 6");
  expectInvalid([&] { ParallelLayout{w8Example(3, 1, 1)}; }, "ET·E·P·EG = 3·1·1·1 = 3");
}

TEST(RankGridErrors, WeightShards) {
  EXPECT_EQ(gtpRematSize(std::nullopt, 2), 1);
  EXPECT_EQ(gtpRematSize(2, 2), 1);
  EXPECT_EQ(gtpRematSize(8, 2), 4);
  EXPECT_EQ(expertGtpRematSize(6, 3), 2);
  expectInvalid([] { gtpRematSize(1, 2); },
                "gtpRematSize: tensor_parallel_num_weight_shards must be >= "
                "tensor_model_parallel_size (2), got 1");
  expectInvalid([] { gtpRematSize(6, 4); },
                "tensor_parallel_num_weight_shards must be a multiple of "
                "tensor_model_parallel_size (4), got 6");
  expectInvalid([] { expertGtpRematSize(4, 3); },
                "expert_tensor_parallel_num_weight_shards must be a multiple of "
                "expert_tensor_parallel_size (3)");
  expectInvalid([] { expertGtpRematSize(2, 3); }, "must be >= expert_tensor_parallel_size (3), got 2");
  expectInvalid([] { gtpRematSize(4, 0); }, "tensor_model_parallel_size must be >= 1, got 0");
}

TEST(RankGridErrors, MissingAxisOfSizeAboveOne) {
  expectInvalid([] { RankGrid("tp-dp", {{"tp", 2}, {"dp", 2}, {"pp", 2}}); },
                "RankGrid: axis 'pp' has size 2 and must appear in the order, got order 'tp-dp'");
  ParallelSizes s;
  s.world = 8;
  s.cp = 2;
  s.order = "tp-ep-dp-pp";
  expectInvalid([&] { ParallelLayout{s}; }, "axis 'cp' has size 2 and must appear in the order");
}

TEST(RankGridErrors, UnknownAxis) {
  expectInvalid([] { RankGrid("tp-xp", {{"tp", 2}, {"dp", 1}}); },
                "RankGrid: every axis in the order must be one of {tp, dp}, got 'xp' in order 'tp-xp'");
  RankGrid g("tp-dp", {{"tp", 2}, {"dp", 2}});
  expectInvalid([&] { g.groups("tp-foo"); },
                "RankGrid::groups: every axis in the token must be one of {tp, dp}, "
                "got 'foo' in token 'tp-foo'");
  expectInvalid([&] { g.groupRank("pp", 0); }, "RankGrid::groupRank: every axis in the token");
  expectInvalid([&] { g.groupIndex("", 0); }, "RankGrid::groupIndex: every axis in the token");
  expectInvalid([&] { g.groupOf("TP", 0); }, "got 'TP'");
  expectInvalid([&] { g.axisSize("pp"); }, "RankGrid::axisSize: axis must be one of {tp, dp}, got 'pp'");
  ParallelSizes s;
  s.order = "tp-cp-ep-dp-xp";
  expectInvalid([&] { ParallelLayout{s}; }, "got 'xp' in order 'tp-gtp_remat-cp-ep-dp-xp'");
}

TEST(RankGridErrors, MalformedOrdersAndTokens) {
  expectInvalid([] { RankGrid("tp--dp", {{"tp", 2}, {"dp", 1}}); }, "got '' in order 'tp--dp'");
  expectInvalid([] { RankGrid("tp-dp-tp", {{"tp", 2}, {"dp", 1}}); },
                "each axis may appear once in the order, got 'tp' twice in 'tp-dp-tp'");
  expectInvalid([] { RankGrid("tp", {{"tp", 2}, {"tp", 1}}); }, "each axis takes one size, got 'tp' twice");
  expectInvalid([] { RankGrid("tp", {{"t-p", 2}}); },
                "axis names must be non-empty and free of '-', got 't-p'");
  RankGrid g("tp-dp", {{"tp", 2}, {"dp", 2}});
  expectInvalid([&] { g.groups("dp-tp-dp"); }, "each axis may appear once in a token, got 'dp' twice");
}

TEST(RankGridErrors, BadSizesAndRanks) {
  expectInvalid([] { RankGrid("tp", {{"tp", 0}}); }, "RankGrid: size of axis 'tp' must be >= 1, got 0");
  expectInvalid([] { RankGrid("tp", {{"tp", 2}}, -1); }, "rank_offset must be >= 0, got -1");
  expectInvalid([] { RankGrid("a-b-c", {{"a", 65536}, {"b", 65536}, {"c", 2}}); },
                "must fit in an int, got a=65536-b=65536-c=2 (offset 0)");
  RankGrid g("tp-dp", {{"tp", 2}, {"dp", 2}}, 2);
  expectInvalid([&] { g.coordinates(1); }, "RankGrid::coordinates: global rank must be in [2, 6), got 1");
  expectInvalid([&] { g.coordinates(6); }, "got 6");
  expectInvalid([&] { g.rankAt({0}); }, "RankGrid::rankAt: expected 2 coordinates");
  expectInvalid([&] { g.rankAt({0, 2}); }, "coordinate 'dp' must be in [0, 2), got 2");

  const std::vector<std::pair<std::function<void(ParallelSizes&)>, std::string>> cases = {
      {[](ParallelSizes& s) { s.world = 0; }, "world size must be >= 1, got 0"},
      {[](ParallelSizes& s) { s.tp = 0; }, "tp (T) must be >= 1, got 0"},
      {[](ParallelSizes& s) { s.pp = -2; }, "pp (P) must be >= 1, got -2"},
      {[](ParallelSizes& s) { s.cp = 0; }, "cp (C) must be >= 1, got 0"},
      {[](ParallelSizes& s) { s.ep = 0; }, "ep (E) must be >= 1, got 0"},
      {[](ParallelSizes& s) { s.gtpRemat = 0; }, "gtp_remat (G) must be >= 1, got 0"},
      {[](ParallelSizes& s) { s.expertGtpRemat = 0; }, "expert gtp_remat (EG) must be >= 1, got 0"},
      {[](ParallelSizes& s) { s.expertTp = -1; },
       "expert tp (ET) must be >= 1, or 0 for the same as tp, got -1"},
  };
  for (const auto& [mutate, message] : cases) {
    ParallelSizes s = w8Example();
    mutate(s);
    expectInvalid([&] { ParallelLayout{s}; }, "ParallelLayout: " + message);
  }
}

TEST(RankGridErrors, PipelineGroupsMustMatchAcrossGrids) {
  ParallelSizes s;
  s.world = 8;
  s.tp = 2;
  s.pp = 2;
  s.expertTp = 1;
  s.order = "tp-pp-cp-ep-dp";  // dense pp stride 2, expert pp stride 1
  expectInvalid([&] { ParallelLayout{s}; }, "must give the same pp groups");
  s.expertTp = 2;  // same strides again
  ParallelLayout ok(s);
  EXPECT_EQ(ok.dense().groups("pp"), (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
}

}  // namespace
}  // namespace tpsim
