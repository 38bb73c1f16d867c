// The backends a tpsim build has and the World each runs: `--backend sim|gpu` for run, demo and
// bench. The only code in tpsim that names both sim::World and gpu::World; everything above it
// (the runner, the property suite) sees a tpsim::World.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "backends/world.h"

namespace tpsim::tools {

// "sim" and "gpu": the names --backend accepts.
bool isBackendName(const std::string& name);
// Why the named backend cannot run here ("gpu backend not built (...)", "no CUDA device: ..."),
// or "" when it can. The simulator always can.
std::string backendUnusableReason(const std::string& name);
// A world of `options.size` ranks on the named backend. Throws UsageError (exit 2) for a name
// that is not a backend or a backend that cannot run here, with the reason.
std::unique_ptr<World> makeWorld(const std::string& backend, const WorldOptions& options);
// world.run(fn), with a rank out of memory reported as what it is, std::bad_alloc (exit 2 in the
// CLI: too large a size), not as a failure of the world.
void runWorld(World& world, const std::function<void(RankContext&)>& fn);

// What `tpsim devices` prints: each backend, whether it can run here, and for the GPU backend the
// driver, runtime, cuBLASLt and NCCL versions and every device (or the reason there is none).
std::string backendReport();

// The relative rounding of one accumulation step of the backend's GEMMs: 2^-24 for the
// simulator's IEEE fp32 sums, 2^-23 on GPUs, whose tensor cores may truncate (docs/gpu.md).
double gemmAccumulationUnit(const std::string& backend);

}  // namespace tpsim::tools
