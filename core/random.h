// Random number generation for initialization: Generator, RngTracker and the seeding formula.
//
// Megatron keeps named CUDA generator states in a global tracker (SPEC 2.5). Here a Generator is a
// plain copyable value (its whole state is a std::mt19937_64 engine) and an RngTracker is an object
// the caller owns and passes around; there is no global RNG. The bit streams are not PyTorch's
// Philox streams: only the seed derivation and the sharing structure are reproduced (SPEC 2.5).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace tpsim {

// Tracker names (Megatron's _*_RNG_TRACKER_NAME).
inline constexpr const char* kDataParallelRngName = "data-parallel-rng";
inline constexpr const char* kModelParallelRngName = "model-parallel-rng";
inline constexpr const char* kExpertParallelRngName = "expert-parallel-rng";
inline constexpr const char* kGtpRematRngName = "gtp-remat-rng";
inline constexpr const char* kEgtpRematRngName = "egtp-remat-rng";

// A deterministic host generator. Two generators compare equal iff they draw the same future
// values; copying one forks an independent stream at the same position.
class Generator {
 public:
  Generator() = default;  // the engine's default seed
  explicit Generator(std::uint64_t seed) : engine_(seed) {}

  void manualSeed(std::uint64_t seed) { engine_.seed(seed); }

  // Fills all of `out` with draws from N(mean, std²), by Box-Muller from pairs of 53-bit uniforms;
  // an odd count drops the last pair's second value (no cached draw: the engine is the state).
  void normal(std::vector<float>& out, double mean, double std);
  // Fills all of `out` with draws from U[low, high).
  void uniform(std::vector<float>& out, double low, double high);

  friend bool operator==(const Generator& a, const Generator& b) { return a.engine_ == b.engine_; }
  friend bool operator!=(const Generator& a, const Generator& b) { return !(a == b); }

 private:
  double uniform01();  // [0, 1), 53 random bits

  std::mt19937_64 engine_;
};

// Fills a weight's values (row-major, as many as the vector holds) from a generator.
using InitMethod = std::function<void(Generator&, std::vector<float>&)>;
// Megatron's default init_method: normal(0, sigma).
InitMethod initMethodNormal(double sigma);
InitMethod initMethodUniform(double low, double high);

// A registry of named generator states (Megatron's CudaRNGStatesTracker) plus the default
// generator, which is the one drawn from outside any fork.
class RngTracker {
 public:
  using States = std::map<std::string, Generator>;

  // Not copyable or movable: open forks refer to it. Snapshot with getStates instead.
  RngTracker() = default;
  RngTracker(const RngTracker&) = delete;
  RngTracker& operator=(const RngTracker&) = delete;

  // A scope that draws from one named state (Megatron's `with tracker.fork(name)`). Draws go
  // straight to the registry entry, so the state is advanced in place and nested forks, even of
  // the same name, draw exactly what the same forks taken one after another would (SPEC 5.2 R3).
  // Neither copyable nor movable, so scopes close in reverse order of opening.
  class [[nodiscard]] Fork {
   public:
    ~Fork();
    Fork(const Fork&) = delete;
    Fork& operator=(const Fork&) = delete;

    Generator& generator() { return generator_; }

   private:
    friend class RngTracker;
    Fork(RngTracker& tracker, Generator& generator) : tracker_(tracker), generator_(generator) {}

    RngTracker& tracker_;
    Generator& generator_;
  };

  // Registers `name` seeded with `seed`. Throws InvalidArgument if `seed` was used by any earlier
  // add, then if `name` exists. Megatron's order is kept: the seed is recorded as used before the
  // name is checked, so an add rejected for its name still consumes its seed (SPEC 8 item 29).
  void add(const std::string& name, std::uint64_t seed);
  // Draws inside the scope come from `name`'s state. Throws InvalidArgument if `name` is unknown.
  Fork fork(const std::string& name = kModelParallelRngName);

  // The generator of the innermost open fork, or the default generator outside any fork.
  Generator& currentGenerator();
  Generator& defaultGenerator() { return default_; }

  bool has(const std::string& name) const { return states_.count(name) != 0; }
  // Forgets every state and every used seed. Throws InvalidArgument inside a fork.
  void reset();
  States getStates() const { return states_; }
  // Replaces the registry (used seeds are kept, as in Megatron). Throws InvalidArgument inside a fork.
  void setStates(States states);

 private:
  States states_;
  std::set<std::uint64_t> seeds_;
  Generator default_;
  std::vector<Generator*> forks_;  // open forks, innermost last; entries point into states_
};

// The ranks the seeding formula reads. Megatron defaults them to the caller's ranks in the global
// groups; here the caller supplies them (from the groups it resolved).
struct RankSeeds {
  int tpRank = 0;
  int epRank = 0;
  int etpRank = 0;
  int gtpRank = 0;
  int gtpSize = 1;
  int egtpRank = 0;
  int egtpSize = 1;
};

// SPEC 2.5 (model_parallel_cuda_manual_seed). Resets `tracker`, seeds its default generator with
// `seed` and adds, in this order:
//   data-parallel-rng    seed
//   model-parallel-rng   seed + 2718 + tpRank
//   expert-parallel-rng  seed + 1024 + 100·epRank + etpRank
//   gtp-remat-rng        seed + 2718 + tpRank + 65536·(1 + gtpRank)                      if gtpSize > 1
//   egtp-remat-rng       seed + 1024 + 100·epRank + etpRank + 32768 + 65536·(1 + egtpRank) if egtpSize > 1
// The seeds are not collision-proof (e.g. TP = expert when 100·epRank + etpRank − tpRank = 1694);
// a collision makes add throw, as in Megatron (SPEC 8 item 4), leaving the entries added before
// it. Throws InvalidArgument, before any change, on a negative rank or a rank outside its size.
void modelParallelManualSeed(RngTracker& tracker, std::uint64_t seed, const RankSeeds& ranks);

}  // namespace tpsim
