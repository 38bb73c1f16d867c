// The backends the property suite runs on: a small registry of what this build has and what is
// usable at run time. The simulator is always built and usable; the GPU backend is listed with the
// reason it cannot run (not built, or no CUDA device), so that a cross-backend property skips with
// that reason instead of passing. Not a backend abstraction: each entry only knows how to run a
// `tpsim run` layer case and how to run rank code on a world of n ranks.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "backends/rank_context.h"
#include "tools/lib/runner.h"

namespace tpsim::props {

struct Backend {
  std::string name;          // "sim", "gpu"
  bool usable = false;
  std::string whyNot;        // when !usable: "gpu backend not built", "no CUDA device"
  // Runs one layer case sharded and reassembled (tools::runSharded on the simulator).
  std::function<tools::RunResult(const tools::RunConfig&, const tools::TensorMap&)> runLayer;
  // Runs fn on every rank of a world of `ranks` ranks and returns when all returned; rethrows the
  // first rank's error.
  std::function<void(int ranks, const std::function<void(RankContext&)>& fn)> runRanks;
};

// Every backend tpsim knows, usable or not, simulator first.
const std::vector<Backend>& backends();
// The usable ones; never empty (the simulator).
std::vector<const Backend*> usableBackends();
// The entry named `name`; throws std::out_of_range for an unknown name.
const Backend& backendNamed(const std::string& name);
// c as run on backend b: its backend sets the bound's accumulation unit and a failing case's replay line.
tools::RunConfig runConfigOn(tools::RunConfig c, const Backend& b);

// In a cross-backend law (a gtest body): `other`, the backend named `name`, or a skip naming why
// it is unusable, so that the law never passes without having run there.
#define TPSIM_REQUIRE_BACKEND(name)                                                  \
  const ::tpsim::props::Backend& other = ::tpsim::props::backendNamed(name);         \
  if (!other.usable) GTEST_SKIP() << name << " backend unusable: " << other.whyNot

}  // namespace tpsim::props
