// Tests for core/random.h: Generator determinism, the tracker rows R1-R5 of SPEC 5.2 (adapted to
// host generators), nested forks, the seeding formula with its worked example, and seed collisions.
#include "core/random.h"

#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <vector>

#include "backends/errors.h"
#include "tests/sim_test_util.h"

namespace tpsim {
namespace {

std::vector<float> normals(Generator& g, std::size_t n) {
  std::vector<float> v(n);
  g.normal(v, 0.0, 1.0);
  return v;
}

TEST(Generator, SameSeedSameStreamAndCopiesFork) {
  Generator a(7), b(7), c(8);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  EXPECT_EQ(normals(a, 9), normals(b, 9));
  EXPECT_NE(normals(a, 9), normals(c, 9));
  Generator copy = a;
  EXPECT_EQ(normals(a, 5), normals(copy, 5));  // a copy continues from the same position
  a.manualSeed(8);
  Generator fresh(8);
  EXPECT_EQ(a, fresh);
}

// The whole state is the engine: two draws of n equal one draw of 2n when n is even.
TEST(Generator, CounterFree) {
  Generator a(3), b(3);
  std::vector<float> first = normals(a, 4), second = normals(a, 4), both = normals(b, 8);
  first.insert(first.end(), second.begin(), second.end());
  EXPECT_EQ(first, both);
  EXPECT_EQ(a, b);
}

TEST(Generator, DistributionsLookRight) {
  Generator g(11);
  std::vector<float> v(20000);
  g.normal(v, 2.0, 0.5);
  double mean = 0, var = 0;
  for (float x : v) mean += x;
  mean /= double(v.size());
  for (float x : v) var += (x - mean) * (x - mean);
  var /= double(v.size());
  EXPECT_NEAR(mean, 2.0, 0.02);
  EXPECT_NEAR(std::sqrt(var), 0.5, 0.02);
  g.uniform(v, -1.0, 3.0);
  for (float x : v) {
    EXPECT_GE(x, -1.0f);
    EXPECT_LE(x, 3.0f);
  }
  EXPECT_THROW(g.normal(v, 0.0, -1.0), InvalidArgument);
  EXPECT_THROW(g.uniform(v, 1.0, 0.0), InvalidArgument);
}

TEST(InitMethods, DrawFromTheGivenGenerator) {
  Generator a(5), b(5);
  std::vector<float> x(6), y(6);
  initMethodNormal(0.02)(a, x);
  b.normal(y, 0.0, 0.02);
  EXPECT_EQ(x, y);
  initMethodUniform(-0.5, 0.5)(a, x);
  b.uniform(y, -0.5, 0.5);
  EXPECT_EQ(x, y);
  EXPECT_THROW(initMethodNormal(-1.0), InvalidArgument);
}

// R1, R2.
TEST(RngTracker, SetGetResetAndAddErrors) {
  RngTracker tracker;
  tracker.setStates({{"state1", Generator(1234)}});
  EXPECT_EQ(tracker.getStates().at("state1"), Generator(1234));
  tracker.reset();
  EXPECT_TRUE(tracker.getStates().empty());

  tracker.add("state2", 1111);
  EXPECT_THROW(tracker.add("state3", 1111), InvalidArgument);  // seed already used
  EXPECT_THROW(tracker.add("state2", 111), InvalidArgument);   // name already used
  EXPECT_FALSE(tracker.has("state3"));
  // R2: the stored state is a generator freshly seeded with 1111.
  EXPECT_EQ(tracker.getStates().at("state2"), Generator(1111));
}

// SPEC 8 item 29: the add rejected for its name still consumed seed 111.
TEST(RngTracker, RejectedAddConsumesItsSeed) {
  RngTracker tracker;
  tracker.add("a", 1);
  EXPECT_THROW(tracker.add("a", 111), InvalidArgument);
  EXPECT_THROW(tracker.add("b", 111), InvalidArgument);
  EXPECT_FALSE(tracker.has("b"));
  tracker.reset();  // reset forgets used seeds
  tracker.add("b", 111);
  EXPECT_TRUE(tracker.has("b"));
}

TEST(RngTracker, ForkDrawsFromTheNamedStateAndAdvancesIt) {
  RngTracker tracker;
  tracker.add("s", 42);
  Generator expected(42);
  const Generator outside = tracker.defaultGenerator();
  {
    RngTracker::Fork fork = tracker.fork("s");
    EXPECT_EQ(&tracker.currentGenerator(), &fork.generator());
    EXPECT_EQ(normals(fork.generator(), 3), normals(expected, 3));
  }
  EXPECT_EQ(tracker.getStates().at("s"), expected);
  EXPECT_EQ(&tracker.currentGenerator(), &tracker.defaultGenerator());
  EXPECT_EQ(tracker.defaultGenerator(), outside);  // untouched by the fork
  EXPECT_THROW((void)tracker.fork("missing"), InvalidArgument);
  EXPECT_THROW((void)tracker.fork(), InvalidArgument);  // "model-parallel-rng" not added
}

// R3: state1 → state2 → state1 draws what sequential single forks draw, and ends in the same states.
TEST(RngTracker, NestedForksMatchSequentialForks) {
  auto draw = [](RngTracker& t) { return normals(t.currentGenerator(), 10); };
  RngTracker nested;
  nested.add("state1", 1234);
  nested.add("state2", 5678);
  std::vector<std::vector<float>> n1, n2;
  {
    auto f1 = nested.fork("state1");
    n1.push_back(draw(nested));
    {
      auto f2 = nested.fork("state2");
      n2.push_back(draw(nested));
      {
        auto f3 = nested.fork("state1");
        n1.push_back(draw(nested));
      }
      n2.push_back(draw(nested));
    }
    n1.push_back(draw(nested));
  }

  RngTracker single;
  single.add("state1", 1234);
  single.add("state2", 5678);
  std::vector<std::vector<float>> s1, s2;
  {
    auto f = single.fork("state1");
    for (int i = 0; i < 3; ++i) s1.push_back(draw(single));
  }
  {
    auto f = single.fork("state2");
    for (int i = 0; i < 2; ++i) s2.push_back(draw(single));
  }
  EXPECT_EQ(n1, s1);
  EXPECT_EQ(n2, s2);
  EXPECT_EQ(nested.getStates(), single.getStates());
}

TEST(RngTracker, RegistryChangesInsideAForkThrow) {
  RngTracker tracker;
  tracker.add("s", 1);
  auto fork = tracker.fork("s");
  EXPECT_THROW(tracker.reset(), InvalidArgument);
  EXPECT_THROW(tracker.setStates({}), InvalidArgument);
  tracker.add("t", 2);  // adding is allowed: the open fork's state stays where it is
  EXPECT_EQ(&tracker.currentGenerator(), &fork.generator());
}

// SPEC 2.5 worked example: seed 1234, tp 1, ep 0, etp 1, gtp 1 of 2, EG = 1.
TEST(ModelParallelManualSeed, WorkedExample) {
  RngTracker tracker;
  tracker.add("stale", 1);  // reset first
  modelParallelManualSeed(tracker, 1234, RankSeeds{1, 0, 1, 1, 2, 0, 1});
  const RngTracker::States states = tracker.getStates();
  EXPECT_EQ(states.size(), 4u);
  EXPECT_EQ(states.at(kDataParallelRngName), Generator(1234));
  EXPECT_EQ(states.at(kModelParallelRngName), Generator(3953));
  EXPECT_EQ(states.at(kExpertParallelRngName), Generator(2259));
  EXPECT_EQ(states.at(kGtpRematRngName), Generator(135025));
  EXPECT_EQ(states.count(kEgtpRematRngName), 0u);
  EXPECT_EQ(tracker.defaultGenerator(), Generator(1234));
}

// R5 adapted: with explicit GTP and EGTP sizes > 1 both remat entries exist, with the formula's seeds.
TEST(ModelParallelManualSeed, GtpEntriesWhenSizesAboveOne) {
  RngTracker tracker;
  modelParallelManualSeed(tracker, 7, RankSeeds{0, 2, 1, 1, 2, 1, 2});
  const RngTracker::States states = tracker.getStates();
  EXPECT_EQ(states.at(kGtpRematRngName), Generator(7 + 2718 + 0 + 65536 * 2));
  EXPECT_EQ(states.at(kEgtpRematRngName), Generator(7 + 1024 + 200 + 1 + 32768 + 65536 * 2));
  modelParallelManualSeed(tracker, 7, RankSeeds{});
  EXPECT_EQ(tracker.getStates().size(), 3u);  // G = EG = 1: neither
}

// R4 and the sharing structure (SPEC 2.5 consequence 1): world 8, T = 4, P = 2. The TP-seeded
// stream depends only on (seed, tp rank); GTP peers draw different remat streams.
TEST(ModelParallelManualSeed, SharingAcrossRanks) {
  std::vector<Generator> tpState(8), gtpState(8);
  testing::runRanks(8, [&](RankContext& ctx) {
    const int r = ctx.comm.rank();
    std::unique_ptr<Collectives> tp = ctx.comm.split(r / 4, r % 4, "tp");
    std::unique_ptr<Collectives> gtp = ctx.comm.split(r % 4, r / 4, "gtp");  // stand-in GTP axis
    RngTracker tracker;
    RankSeeds ranks;
    ranks.tpRank = tp->rank();
    ranks.gtpRank = gtp->rank();
    ranks.gtpSize = gtp->size();
    modelParallelManualSeed(tracker, 0, ranks);
    EXPECT_TRUE(tracker.has(kModelParallelRngName));
    tpState[r] = tracker.getStates().at(kModelParallelRngName);
    gtpState[r] = tracker.getStates().at(kGtpRematRngName);
  });
  for (int r = 0; r < 8; ++r)
    for (int q = 0; q < 8; ++q) {
      EXPECT_EQ(tpState[r] == tpState[q], r % 4 == q % 4) << r << " vs " << q;
      EXPECT_EQ(gtpState[r] == gtpState[q], r == q) << r << " vs " << q;
    }
}

// SPEC 8 item 4: TP seed == expert seed when 100·ep + etp − tp = 1694; the add throws.
TEST(ModelParallelManualSeed, CollisionThrows) {
  RngTracker tracker;
  EXPECT_THROW(modelParallelManualSeed(tracker, 5, RankSeeds{6, 17, 0, 0, 1, 0, 1}), InvalidArgument);
  EXPECT_NO_THROW(modelParallelManualSeed(tracker, 5, RankSeeds{5, 17, 0, 0, 1, 0, 1}));
}

TEST(ModelParallelManualSeed, BadRanksThrow) {
  RngTracker tracker;
  EXPECT_THROW(modelParallelManualSeed(tracker, 0, RankSeeds{-1, 0, 0, 0, 1, 0, 1}), InvalidArgument);
  EXPECT_THROW(modelParallelManualSeed(tracker, 0, RankSeeds{0, 0, 0, 2, 2, 0, 1}), InvalidArgument);
  EXPECT_THROW(modelParallelManualSeed(tracker, 0, RankSeeds{0, 0, 0, 0, 1, 0, 0}), InvalidArgument);
}

}  // namespace
}  // namespace tpsim
