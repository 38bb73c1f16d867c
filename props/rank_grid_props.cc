// SPEC 6 item 20 over random grids of up to 64 ranks in random axis orders:
//   global rank <-> coordinates is a bijection;
//   every group token (any subset of axes, written in any order) partitions the world into groups
//     of the product of its axes' sizes, and groups(token)[groupIndex(r)][groupRank(r)] == r;
//   a group of token A and a group of a disjoint token B share exactly one rank when the two ranks
//     agree on every axis in neither token, and none otherwise (tp and gtp_remat meet once);
//   every named group of ParallelLayout, dense and expert, partitions the world.
#include <algorithm>
#include <numeric>
#include <set>

#include "core/rank_grid.h"
#include "props/generators.h"
#include "props/harness.h"

namespace tpsim::props {
namespace {

const std::vector<std::string> kAxes = {"tp", "gtp_remat", "cp", "ep", "dp", "pp"};

struct GridCase {
  std::vector<int> sizes;  // parallel to kAxes
  std::vector<int> order;  // a permutation of axis indices, fastest first
  int offset = 0;
};

void showValue(const GridCase& g, std::ostream& os) {
  os << "order";
  for (int a : g.order) os << " " << kAxes[std::size_t(a)] << "=" << g.sizes[std::size_t(a)];
  os << " offset " << g.offset;
}

rc::Gen<GridCase> genGrid() {
  return rc::gen::exec([] {
    GridCase g;
    int world = 1;
    for (std::size_t a = 0; a < kAxes.size(); ++a) {
      std::vector<int> fits;
      for (int s : {1, 2, 3, 4})
        if (world * s <= 64) fits.push_back(s);
      g.sizes.push_back(*pick(fits));
      world *= g.sizes.back();
    }
    g.order.resize(kAxes.size());
    std::iota(g.order.begin(), g.order.end(), 0);
    for (std::size_t i = g.order.size(); i-- > 1;)  // a Fisher-Yates shuffle, shrinking to no swaps
      std::swap(g.order[i], g.order[std::size_t(*pickIndex(int(i) + 1))]);
    g.offset = *pick<int>({0, 0, 8});
    return g;
  });
}

std::string orderString(const GridCase& g) {
  std::string s;
  for (int a : g.order) s += (s.empty() ? "" : "-") + kAxes[std::size_t(a)];
  return s;
}

RankGrid gridOf(const GridCase& g) {
  std::vector<AxisSize> sizes;
  for (std::size_t a = 0; a < kAxes.size(); ++a) sizes.push_back({kAxes[a], g.sizes[a]});
  return RankGrid(orderString(g), sizes, g.offset);
}

// A non-empty subset of axes as a token, written in a drawn order.
struct Token {
  std::vector<int> axes;
  std::string text;
};

rc::Gen<Token> genToken(std::vector<int> from) {
  return rc::gen::exec([from] {
    Token t;
    for (int a : from)
      if (*flag()) t.axes.push_back(a);
    if (t.axes.empty()) t.axes.push_back(from[std::size_t(*pickIndex(int(from.size())))]);
    std::vector<int> written = t.axes;
    std::reverse(written.begin(), written.end());
    if (*flag()) written = t.axes;
    for (int a : written) t.text += (t.text.empty() ? "" : "-") + kAxes[std::size_t(a)];
    return t;
  });
}

void showValue(const Token& t, std::ostream& os) { os << "'" << t.text << "'"; }

// Coordinates of `rank` by axis index of kAxes.
std::vector<int> coordsByAxis(const RankGrid& grid, int rank) {
  const std::vector<int> c = grid.coordinates(rank);
  std::vector<int> out(kAxes.size());
  for (std::size_t k = 0; k < grid.axes().size(); ++k)
    out[std::size_t(std::find(kAxes.begin(), kAxes.end(), grid.axes()[k]) - kAxes.begin())] = c[k];
  return out;
}

}  // namespace

TPSIM_PROP(RankGridLaws, CoordinatesAreABijectionAndEveryTokenPartitionsTheWorld, 2000) {
  const GridCase g = *genGrid();
  const RankGrid grid = gridOf(g);
  const Token token = *genToken({0, 1, 2, 3, 4, 5});
  std::set<std::vector<int>> seen;
  for (int r = g.offset; r < g.offset + grid.size(); ++r) {
    RC_ASSERT(grid.rankAt(grid.coordinates(r)) == r);
    seen.insert(grid.coordinates(r));
  }
  RC_ASSERT(int(seen.size()) == grid.size());
  int groupSize = 1;
  for (int a : token.axes) groupSize *= g.sizes[std::size_t(a)];
  const auto groups = grid.groups(token.text);
  std::multiset<int> members;
  for (const auto& group : groups) {
    RC_ASSERT(int(group.size()) == groupSize);
    members.insert(group.begin(), group.end());
  }
  std::multiset<int> world;
  for (int r = g.offset; r < g.offset + grid.size(); ++r) world.insert(r);
  RC_ASSERT(members == world);
  for (int r = g.offset; r < g.offset + grid.size(); ++r) {
    const auto& mine = groups[std::size_t(grid.groupIndex(token.text, r))];
    RC_ASSERT(mine[std::size_t(grid.groupRank(token.text, r))] == r);
    RC_ASSERT(grid.groupOf(token.text, r) == mine);
  }
}

TPSIM_PROP(RankGridLaws, GroupsOfDisjointTokensMeetOnceExactlyWhenTheOtherCoordinatesAgree, 3000) {
  const GridCase g = *genGrid();
  const RankGrid grid = gridOf(g);
  // Split the axes between A, B and neither; A and B non-empty and disjoint.
  std::vector<int> forA, forB, rest;
  for (int a = 0; a < int(kAxes.size()); ++a) {
    const int where = *pickIndex(3);
    (where == 0 ? forA : where == 1 ? forB : rest).push_back(a);
  }
  RC_PRE(!forA.empty() && !forB.empty());
  const Token a = *genToken(forA), b = *genToken(forB);
  const int r = g.offset + *uniform<int>(0, grid.size()), q = g.offset + *uniform<int>(0, grid.size());
  const std::vector<int> groupA = grid.groupOf(a.text, r), groupB = grid.groupOf(b.text, q);
  std::vector<int> common;
  for (int m : groupA)
    if (std::find(groupB.begin(), groupB.end(), m) != groupB.end()) common.push_back(m);
  const std::vector<int> cr = coordsByAxis(grid, r), cq = coordsByAxis(grid, q);
  bool agree = true;
  for (std::size_t k = 0; k < kAxes.size(); ++k) {
    const bool inA = std::find(a.axes.begin(), a.axes.end(), int(k)) != a.axes.end();
    const bool inB = std::find(b.axes.begin(), b.axes.end(), int(k)) != b.axes.end();
    if (!inA && !inB) agree = agree && cr[k] == cq[k];
  }
  RC_ASSERT(common.size() == (agree ? 1u : 0u));
}

TPSIM_PROP(RankGridLaws, EveryNamedGroupOfALayoutPartitionsTheWorld, 1500) {
  const Topology t = *genTopology(64);
  const ParallelLayout layout(sizesOf(t));
  for (const GroupSpec& spec : groupSpecs()) {
    std::multiset<int> members;
    for (const auto& group : layout.groups(spec.id)) members.insert(group.begin(), group.end());
    std::multiset<int> world;
    for (int r = 0; r < layout.world(); ++r) world.insert(r);
    RC_ASSERT(members == world);
  }
  RC_ASSERT(layout.dp() * t.tp * t.cp * t.pp == layout.world());
  RC_ASSERT(layout.expertDp() * t.expertTp * t.ep * t.pp == layout.world());
  for (const auto& instance : layout.groups(GroupId::kIntraDistOpt))
    RC_ASSERT(int(instance.size()) * t.distOptInstances == layout.world());
}

}  // namespace tpsim::props
