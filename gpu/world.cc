#include "gpu/world.h"

#include <cstdlib>

#include "gpu/check.h"
#include "gpu/device.h"
#include "gpu/fabric.h"
#include "gpu/gpu_compute.h"
#include "gpu/nccl_transport.h"

namespace tpsim::gpu {
namespace {

// Rank code runs on fibers; CUDA and cuBLASLt calls need more stack than the simulator's 1 MiB
// default (the stack is reserved, not committed, so a larger one costs address space only).
constexpr std::size_t kGpuRankStack = std::size_t(8) << 20;

WorldOptions withGpuDefaults(WorldOptions o) {
  if (o.stackBytes == 0) o.stackBytes = kGpuRankStack;
  return o;
}

const Probe& cachedProbe() {
  static const Probe p = probe();
  return p;
}

}  // namespace

const char* transportName(TransportKind kind) {
  switch (kind) {
    case TransportKind::kAuto: return "auto";
    case TransportKind::kDeviceFabric: return "fabric";
    case TransportKind::kNccl: return "nccl";
  }
  return "unknown";
}

GpuWorldOptions worldOptionsFromEnvironment() {
  GpuWorldOptions o;
  if (const char* t = std::getenv("TPSIM_GPU_TRANSPORT"); t && *t) {
    const std::string v = t;
    if (v == "auto") o.transport = TransportKind::kAuto;
    else if (v == "fabric") o.transport = TransportKind::kDeviceFabric;
    else if (v == "nccl") o.transport = TransportKind::kNccl;
    else TPSIM_CHECK(false, "TPSIM_GPU_TRANSPORT: expected auto, fabric or nccl, got '", v, "'");
  }
  if (const char* d = std::getenv("TPSIM_GPU_DEVICE"); d && *d) {
    char* end = nullptr;
    const long v = std::strtol(d, &end, 10);
    TPSIM_CHECK(*end == '\0' && v >= 0 && v < 1024, "TPSIM_GPU_DEVICE: expected a CUDA device index, got '", d, "'");
    o.device = int(v);
  }
  return o;
}

std::string unusableReason() { return cachedProbe().reason; }

std::string processPlacementError(int size, int processes) {
  if (size == processes) return "";
  return tpsim::detail::concat("a GPU world in an MPI job runs one rank per process: expected a world of ", processes,
                               " rank(s), one for each of the ", processes, " processes, got ", size);
}

int deviceForLocalProcess(int localProcess, int devices) {
  TPSIM_CHECK(localProcess < devices, "gpu::World: the job's process ", localProcess,
              " on this machine (counted from 0) takes CUDA device ", localProcess, ", but the machine has ", devices,
              " device(s); run at most ", devices, " process(es) per machine");
  return localProcess;
}

World::World(WorldOptions options, GpuWorldOptions gpuOptions)
    : rendezvous_("gpu", withGpuDefaults(options)),
      transport_(gpuOptions.transport),
      timeoutMs_(deviceTimeoutMs()),
      job_(gpuOptions.job) {
  const int n = rendezvous_.options().size;
  if (job_) {
    const std::string error = processPlacementError(n, job_->processes);
    TPSIM_CHECK(error.empty(), "gpu::World: ", error);
    TPSIM_CHECK(transport_ != TransportKind::kDeviceFabric,
                "gpu::World: in an MPI job each process drives its rank on its own GPU through NCCL; "
                "expected TPSIM_GPU_TRANSPORT auto or nccl, got fabric");
  }
  const Probe& p = cachedProbe();
  if (!p.hasDevice()) throw BackendError("gpu::World: " + p.reason);
  const int devices = int(p.devices.size());
  if (job_) {
    const int device = deviceForLocalProcess(job_->localProcess, devices);
    transport_ = TransportKind::kNccl;
    computes_.resize(std::size_t(n));
    ranks_.assign(std::size_t(n), nullptr);
    auto c = std::make_shared<GpuCompute>(device);
    ranks_[std::size_t(job_->process)] = c.get();
    computes_[std::size_t(job_->process)] = std::move(c);
    deviceName_ = tpsim::detail::concat(p.devices[std::size_t(device)].name, " per process, ", n, " processes");
    makeTransport();
    return;
  }
  if (transport_ == TransportKind::kAuto)
    transport_ = devices >= n ? TransportKind::kNccl : TransportKind::kDeviceFabric;
  if (transport_ == TransportKind::kNccl) {
    TPSIM_CHECK(devices >= n, "gpu::World: the NCCL transport needs one GPU per rank: ", n, " ranks, ", devices,
                " CUDA device(s); NCCL refuses two ranks of a communicator on one GPU (use TPSIM_GPU_TRANSPORT=fabric)");
    for (int r = 0; r < n; ++r) {
      auto c = std::make_shared<GpuCompute>(r);
      ranks_.push_back(c.get());
      computes_.push_back(std::move(c));
    }
    deviceName_ = tpsim::detail::concat(n, " x ", p.devices[0].name);
  } else {
    TPSIM_CHECK(gpuOptions.device >= 0 && gpuOptions.device < devices, "gpu::World: device must be in [0, ", devices,
                "), got ", gpuOptions.device);
    TPSIM_CHECK(n <= kMaxFabricRanks, "gpu::World: the DeviceFabric transport runs at most ", kMaxFabricRanks,
                " ranks on one GPU, got ", n);
    for (int r = 0; r < n; ++r) {
      auto c = std::make_shared<GpuCompute>(gpuOptions.device);
      ranks_.push_back(c.get());
      computes_.push_back(std::move(c));
    }
    deviceName_ = p.devices[gpuOptions.device].name;
  }
  makeTransport();
}

void World::makeTransport() {
  if (job_) {
    const ncclUniqueId id = shareUniqueId(job_->process, job_->broadcast, [] {
      ncclUniqueId made;
      TPSIM_NCCL_CHECK(ncclGetUniqueId(&made));
      return made;
    });
    fabric_ = std::make_shared<NcclTransport>(ranks_, rendezvous_.options().timeout, &id);
    spread_ = job_->spread(fabric_);
    return;
  }
  if (transport_ == TransportKind::kNccl) fabric_ = std::make_shared<NcclTransport>(ranks_, rendezvous_.options().timeout);
  else fabric_ = std::make_shared<DeviceFabric>(ranks_.front()->deviceIndex(), ranks_);
  spread_ = fabric_;
}

World::~World() = default;

std::string World::description() const {
  return tpsim::detail::concat("gpu (", transport_ == TransportKind::kNccl ? "NCCL" : "DeviceFabric", ", ", deviceName_, ")");
}

GpuCompute& World::compute(int rank) {
  TPSIM_CHECK(computes_.at(std::size_t(rank)), "gpu::World::compute: rank ", rank, " runs in process ", rank,
              " of the job, not in this one");
  return static_cast<GpuCompute&>(*computes_[std::size_t(rank)]);
}

void World::run(const std::function<void(RankContext&)>& fn) {
  if (transportAborted_) {
    // Ranks abandoned by the failed run may still hold the old transport; it goes with the last.
    makeTransport();
    transportAborted_ = false;
  }
  try {
    rendezvous_.run(fn, computes_, spread_);
  } catch (...) {
    drain();
    transportAborted_ = transport_ == TransportKind::kNccl;  // the DeviceFabric has nothing to abort
    throw;
  }
  // A rank's last collective may still be in flight on the device when its function returns; the
  // results it downloaded were already waited for, but the next run must not race with it. A
  // fault in a collective's kernel first shows in the stream of whichever rank waits next.
  for (int r = 0; r < size(); ++r) {
    if (!ranks_[std::size_t(r)]) continue;  // a peer process's
    try {
      compute(r).synchronize("gpu::World::run");
    } catch (const BackendError& e) {
      drain();
      std::vector<std::string> rankErrors(computes_.size());
      rankErrors[std::size_t(r)] = e.what();
      throw WorldError(tpsim::detail::concat("gpu: the device work of rank ", r,
                                             " failed after its function returned: ", e.what()),
                       std::move(rankErrors), true, CollectiveFailure::kBackend);
    }
  }
}

void World::drain() noexcept {
  const auto deadline = deadlineIn(timeoutMs_);
  fabric_->drain(deadline);
  for (const GpuCompute* rank : ranks_) {
    if (!rank) continue;
    const GpuCompute& c = *rank;
    if (cudaSetDevice(c.deviceIndex()) == cudaSuccess) pollStream(c.stream(), deadline);
  }
  cudaGetLastError();
}

}  // namespace tpsim::gpu
