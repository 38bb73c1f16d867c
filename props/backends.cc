#include "props/backends.h"

#include <stdexcept>

#include "sim/world.h"
#include "tpsim_config.h"

namespace tpsim::props {
namespace {

std::vector<Backend> makeRegistry() {
  std::vector<Backend> all;
  Backend sim;
  sim.name = "sim";
  sim.usable = true;
  sim.runLayer = [](const tools::RunConfig& c, const tools::TensorMap& in) { return tools::runSharded(c, in); };
  sim.runRanks = [](int ranks, const std::function<void(RankContext&)>& fn) {
    WorldOptions o;
    o.size = ranks;
    sim::World(o).run(fn);
  };
  all.push_back(std::move(sim));

  Backend gpu;
  gpu.name = "gpu";
#if TPSIM_HAVE_GPU
  // The backend is built but has no runner here yet: say so, and let
  // Backends.EveryBuiltBackendIsUsableOrHasNoDevice fail until it is wired in.
  gpu.whyNot = "gpu backend built, but props/backends.cc has no runner for it yet";
#else
  gpu.whyNot = "gpu backend not built (TPSIM_HAVE_GPU = 0: CMake found no CUDA toolkit and NCCL)";
#endif
  all.push_back(std::move(gpu));
  return all;
}

}  // namespace

const std::vector<Backend>& backends() {
  static const std::vector<Backend> registry = makeRegistry();
  return registry;
}

std::vector<const Backend*> usableBackends() {
  std::vector<const Backend*> out;
  for (const Backend& b : backends())
    if (b.usable) out.push_back(&b);
  return out;
}

const Backend& backendNamed(const std::string& name) {
  for (const Backend& b : backends())
    if (b.name == name) return b;
  throw std::out_of_range("no backend named '" + name + "'");
}

}  // namespace tpsim::props
