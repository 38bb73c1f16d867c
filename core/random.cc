#include "core/random.h"

#include <cmath>
#include <utility>

#include "backends/errors.h"

namespace tpsim {

double Generator::uniform01() { return double(engine_() >> 11) * 0x1.0p-53; }

void Generator::normal(std::vector<float>& out, double mean, double std) {
  TPSIM_CHECK(std >= 0, "Generator::normal: std must be >= 0, got ", std);
  constexpr double kTwoPi = 6.283185307179586476925286766559;
  for (std::size_t i = 0; i < out.size(); i += 2) {
    const double radius = std::sqrt(-2.0 * std::log(1.0 - uniform01()));  // 1 − u ∈ (0, 1]: finite log
    const double angle = kTwoPi * uniform01();
    out[i] = float(mean + std * radius * std::cos(angle));
    if (i + 1 < out.size()) out[i + 1] = float(mean + std * radius * std::sin(angle));
  }
}

void Generator::uniform(std::vector<float>& out, double low, double high) {
  TPSIM_CHECK(low <= high, "Generator::uniform: low must be <= high, got low ", low, " and high ", high);
  for (float& x : out) x = float(low + (high - low) * uniform01());
}

InitMethod initMethodNormal(double sigma) {
  TPSIM_CHECK(sigma >= 0, "initMethodNormal: sigma must be >= 0, got ", sigma);
  return [sigma](Generator& generator, std::vector<float>& values) { generator.normal(values, 0.0, sigma); };
}

InitMethod initMethodUniform(double low, double high) {
  TPSIM_CHECK(low <= high, "initMethodUniform: low must be <= high, got low ", low, " and high ", high);
  return [low, high](Generator& generator, std::vector<float>& values) { generator.uniform(values, low, high); };
}

RngTracker::Fork::~Fork() { tracker_.forks_.pop_back(); }

void RngTracker::add(const std::string& name, std::uint64_t seed) {
  // Megatron's order: the seed is marked used before the name check (SPEC 8 item 29).
  TPSIM_CHECK(seeds_.insert(seed).second, "RngTracker::add: seed must be unused, got ", seed, " for '", name,
              "', which an earlier add already used (a rejected add uses its seed too)");
  TPSIM_CHECK(!has(name), "RngTracker::add: name must be new, got '", name, "', which already has a state");
  states_.emplace(name, Generator(seed));
}

RngTracker::Fork RngTracker::fork(const std::string& name) {
  auto it = states_.find(name);
  TPSIM_CHECK(it != states_.end(), "RngTracker::fork: name must have been added, got unknown '", name, "'");
  forks_.push_back(&it->second);
  return Fork(*this, it->second);
}

Generator& RngTracker::currentGenerator() { return forks_.empty() ? default_ : *forks_.back(); }

void RngTracker::reset() {
  TPSIM_CHECK(forks_.empty(), "RngTracker::reset: must be called outside any fork, got ", forks_.size(),
              " open");
  states_.clear();
  seeds_.clear();
}

void RngTracker::setStates(States states) {
  TPSIM_CHECK(forks_.empty(), "RngTracker::setStates: must be called outside any fork, got ", forks_.size(),
              " open");
  states_ = std::move(states);
}

void modelParallelManualSeed(RngTracker& tracker, std::uint64_t seed, const RankSeeds& ranks) {
  auto checkRank = [](const char* rankName, int rank, int size) {
    TPSIM_CHECK(rank >= 0 && rank < size, "modelParallelManualSeed: ", rankName, " must be in [0, ", size,
                "), got ", rank);
  };
  TPSIM_CHECK(ranks.tpRank >= 0, "modelParallelManualSeed: tpRank must be >= 0, got ", ranks.tpRank);
  TPSIM_CHECK(ranks.epRank >= 0, "modelParallelManualSeed: epRank must be >= 0, got ", ranks.epRank);
  TPSIM_CHECK(ranks.etpRank >= 0, "modelParallelManualSeed: etpRank must be >= 0, got ", ranks.etpRank);
  checkRank("gtpRank", ranks.gtpRank, ranks.gtpSize);
  checkRank("egtpRank", ranks.egtpRank, ranks.egtpSize);

  const std::uint64_t tpSeed = seed + 2718 + std::uint64_t(ranks.tpRank);
  const std::uint64_t expertSeed = seed + 1024 + 100 * std::uint64_t(ranks.epRank) + std::uint64_t(ranks.etpRank);
  tracker.reset();
  tracker.defaultGenerator().manualSeed(seed);
  tracker.add(kDataParallelRngName, seed);
  tracker.add(kModelParallelRngName, tpSeed);
  tracker.add(kExpertParallelRngName, expertSeed);
  // GTP peers get distinct streams, apart from every other tracker (SPEC 2.5, 4.10).
  if (ranks.gtpSize > 1) tracker.add(kGtpRematRngName, tpSeed + 65536 * (1 + std::uint64_t(ranks.gtpRank)));
  if (ranks.egtpSize > 1)
    tracker.add(kEgtpRematRngName, expertSeed + 32768 + 65536 * (1 + std::uint64_t(ranks.egtpRank)));
}

}  // namespace tpsim
