#include "props/backends.h"

#include <stdexcept>

#include "tools/lib/backend.h"

namespace tpsim::props {
namespace {

// Each backend runs layer cases through the same runner as `tpsim run --backend NAME`.
Backend makeBackend(const std::string& name) {
  Backend b;
  b.name = name;
  b.whyNot = tools::backendUnusableReason(name);
  b.usable = b.whyNot.empty();
  b.runLayer = [name](const tools::RunConfig& c, const tools::TensorMap& in) {
    tools::RunConfig onBackend = c;
    onBackend.backend = name;
    return tools::runSharded(onBackend, tools::storedOf(in));
  };
  b.runRanks = [name](int ranks, const std::function<void(RankContext&)>& fn) {
    WorldOptions o;
    o.size = ranks;
    tools::makeWorld(name, o)->run(fn);
  };
  return b;
}

std::vector<Backend> makeRegistry() { return {makeBackend("sim"), makeBackend("gpu")}; }

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

tools::RunConfig runConfigOn(tools::RunConfig c, const Backend& b) {
  c.backend = b.name;
  return c;
}

const Backend& backendNamed(const std::string& name) {
  for (const Backend& b : backends())
    if (b.name == name) return b;
  throw std::out_of_range("no backend named '" + name + "'");
}

}  // namespace tpsim::props
