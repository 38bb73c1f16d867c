#include "tools/lib/backend.h"

#include <atomic>
#include <new>

#include "sim/world.h"
#include "tools/lib/usage_error.h"
#include "tpsim_config.h"
#if TPSIM_HAVE_GPU
#include "gpu/device.h"
#include "gpu/world.h"
#endif

namespace tpsim::tools {

bool isBackendName(const std::string& name) { return name == "sim" || name == "gpu"; }

std::string backendUnusableReason(const std::string& name) {
  if (name == "sim") return "";
#if TPSIM_HAVE_GPU
  return gpu::unusableReason();
#else
  return "gpu backend not built (TPSIM_HAVE_GPU = 0: CMake found no CUDA toolkit with cuBLASLt and NCCL)";
#endif
}

void runWorld(World& world, const std::function<void(RankContext&)>& fn) {
  std::atomic<bool> outOfMemory{false};
  try {
    world.run([&](RankContext& ctx) {
      try {
        fn(ctx);
      } catch (const std::bad_alloc&) {
        outOfMemory = true;
        throw;
      }
    });
  } catch (const WorldError&) {
    if (outOfMemory) throw std::bad_alloc();
    throw;
  }
}

std::unique_ptr<World> makeWorld(const std::string& backend, const WorldOptions& options) {
  if (!isBackendName(backend)) throw UsageError{"--backend: expected sim or gpu, got '" + backend + "'"};
  const std::string whyNot = backendUnusableReason(backend);
  if (!whyNot.empty()) throw UsageError{"--backend " + backend + ": cannot run here: " + whyNot};
#if TPSIM_HAVE_GPU
  if (backend == "gpu") {
    const gpu::GpuWorldOptions gpuOptions = gpu::worldOptionsFromEnvironment();
    try {
      return std::make_unique<gpu::World>(options, gpuOptions);
    } catch (const BackendError& e) {
      // The probe only lists devices; one that is listed but refuses a context, a stream or memory
      // (exclusive-process mode held elsewhere, no memory left) cannot run here either.
      throw UsageError{"--backend gpu: cannot run here: " + std::string(e.what())};
    }
  }
#endif
  return std::make_unique<sim::World>(options);
}

std::string backendReport() {
  std::string s = "sim: usable (host memory, exact collectives, packed fp32 GEMMs)\n";
#if TPSIM_HAVE_GPU
  const std::string whyNot = gpu::unusableReason();
  s += whyNot.empty() ? "gpu: usable\n" : "gpu: not usable: " + whyNot + "\n";
  s += gpu::probe().str();
#else
  s += "gpu: not usable: " + backendUnusableReason("gpu") + "\n";
#endif
  return s;
}

double gemmAccumulationUnit(const std::string& backend) { return backend == "gpu" ? 0x1p-23 : 0x1p-24; }

}  // namespace tpsim::tools
