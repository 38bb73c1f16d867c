// SPEC 6 invariant 20 over random configurations: rank <-> coordinates is a bijection, every group
// token partitions the world, and groups of disjoint tokens meet in exactly one rank when their
// other coordinates agree.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <set>

#include "core/rank_grid.h"

namespace tpsim {
namespace {

struct Config {
  int tp, gtp, cp, pp, dp;
};

rc::Gen<Config> genConfig() {
  auto axis = rc::gen::inRange(1, 5);
  return rc::gen::build<Config>(rc::gen::set(&Config::tp, axis), rc::gen::set(&Config::gtp, axis),
                                rc::gen::set(&Config::cp, rc::gen::inRange(1, 3)),
                                rc::gen::set(&Config::pp, rc::gen::inRange(1, 3)), rc::gen::set(&Config::dp, axis));
}

RC_GTEST_PROP(RankGridLaws, EveryTokenPartitionsTheWorldAndDisjointTokensMeetOnce, ()) {
  const Config c = *genConfig();
  ParallelSizes s;
  s.tp = c.tp;
  s.gtpRemat = c.gtp;
  s.cp = c.cp;
  s.pp = c.pp;
  s.world = c.tp * c.gtp * c.cp * c.pp * c.dp;
  const ParallelLayout layout(s);
  const RankGrid& grid = layout.dense();
  for (int r = 0; r < s.world; ++r) RC_ASSERT(grid.rankAt(grid.coordinates(r)) == r);
  const std::vector<std::string> tokens = {"tp", "gtp_remat", "dp", "cp-dp", "gtp_remat-dp", "tp-gtp_remat-pp"};
  for (const auto& token : tokens) {
    std::multiset<int> seen;
    for (const auto& g : grid.groups(token)) seen.insert(g.begin(), g.end());
    RC_ASSERT(int(seen.size()) == s.world);
    RC_ASSERT(int(std::set<int>(seen.begin(), seen.end()).size()) == s.world);
  }
  // tp and gtp_remat are disjoint: the tp group and the gtp_remat group of rank r meet only in r.
  const int r = *rc::gen::inRange(0, s.world);
  const auto tp = grid.groupOf("tp", r), gtp = grid.groupOf("gtp_remat", r);
  std::vector<int> common;
  for (int m : tp)
    if (std::find(gtp.begin(), gtp.end(), m) != gtp.end()) common.push_back(m);
  RC_ASSERT(common == std::vector<int>{r});
}

}  // namespace
}  // namespace tpsim
