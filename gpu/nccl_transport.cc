#include "gpu/nccl_transport.h"

#include <cstring>
#include <memory>
#include <thread>

#include "gpu/check.h"
#include "gpu/device.h"
#include "gpu/events.h"
#include "gpu/fabric.h"

namespace tpsim::gpu {
namespace {

using Clock = std::chrono::steady_clock;

// Non-blocking communicators answer ncclInProgress while an operation completes in the background.
void checkIssued(ncclResult_t result, const char* call) {
  if (result == ncclSuccess || result == ncclInProgress) return;
  throw BackendError(tpsim::detail::concat(call, " failed: ", detail::ncclResultName(result), " (",
                                    ncclGetErrorString(result), ")"));
}

ncclDataType_t ncclTypeOf(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return ncclFloat32;
    case DType::kBFloat16: return ncclBfloat16;
    case DType::kFloat16: return ncclFloat16;
    case DType::kFloat64: return ncclFloat64;
    case DType::kInt64: return ncclInt64;
    case DType::kFloat8E4M3:
    case DType::kFloat8E8M0: return ncclUint8;  // moved as bytes, never reduced
  }
  TPSIM_INTERNAL_ASSERT(false, "unknown dtype ", int(dtype));
}

// The done events of one collective, one per member, on that member's NCCL stream.
struct DoneEvents {
  std::map<int, world::TransportToken> byGlobalRank;
};

// One ncclGroupStart/End. The group depth is per thread: an exception that left the group open
// would leave every later NCCL call of this thread queued in it, ncclCommAbort included, so
// unwinding ends it (launching what was queued; the failure aborts the communicators next).
class NcclGroup {
 public:
  NcclGroup() { checkIssued(ncclGroupStart(), "ncclGroupStart"); }
  ~NcclGroup() {
    if (open_) ncclGroupEnd();
  }
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;

  void end(const char* what) {
    open_ = false;
    checkIssued(ncclGroupEnd(), what);
  }

 private:
  bool open_ = true;
};

// A copy of an in-place member's input, freed on the stream that reads it once that has.
class StagedInput {
 public:
  StagedInput(int device, cudaStream_t stream, const void* in, std::size_t bytes) : device_(device), stream_(stream) {
    TPSIM_CUDA_CHECK(cudaSetDevice(device_));
    TPSIM_CUDA_CHECK(cudaMallocAsync(&data_, bytes, stream_));
    TPSIM_CUDA_CHECK(cudaMemcpyAsync(data_, in, bytes, cudaMemcpyDeviceToDevice, stream_));
  }
  ~StagedInput() {
    if (cudaSetDevice(device_) != cudaSuccess || cudaFreeAsync(data_, stream_) != cudaSuccess) cudaGetLastError();
  }
  StagedInput(const StagedInput&) = delete;
  StagedInput& operator=(const StagedInput&) = delete;

  const void* data() const { return data_; }

 private:
  int device_;
  cudaStream_t stream_;
  void* data_ = nullptr;
};

ncclConfig_t nonBlocking() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

}  // namespace

NcclSplitArgs ncclSplitArgs(const world::SplitPlace& place) {
  if (place.color < 0) return {NCCL_SPLIT_NOCOLOR, place.key};
  return {place.color, place.key};
}

ncclUniqueId shareUniqueId(int process, const std::function<std::string(const std::string&)>& broadcast,
                           const std::function<ncclUniqueId()>& make) {
  std::string bytes;
  if (process == 0) {
    const ncclUniqueId made = make();
    bytes.assign(made.internal, sizeof made.internal);
  }
  bytes = broadcast(bytes);
  ncclUniqueId id;
  TPSIM_INTERNAL_ASSERT(bytes.size() == sizeof id.internal, "the job's NCCL id has ", bytes.size(),
                        " bytes; expected ", sizeof id.internal);
  std::memcpy(id.internal, bytes.data(), sizeof id.internal);
  return id;
}

NcclTransport::NcclTransport(std::vector<GpuCompute*> ranks, std::chrono::milliseconds timeout,
                             const ncclUniqueId* worldId)
    : ranks_(std::move(ranks)), spread_(worldId != nullptr), timeout_(timeout), streamTimeoutMs_(deviceTimeoutMs()) {
  for (std::size_t r = 0; r < ranks_.size(); ++r) {
    TPSIM_INTERNAL_ASSERT(spread_ || local(int(r)), "NcclTransport: rank ", r, " has no compute in one process");
    if (!local(int(r))) {
      streams_.push_back(nullptr);
      continue;
    }
    for (std::size_t q = 0; q < r; ++q)
      TPSIM_CHECK(!local(int(q)) || deviceOf(int(q)) != deviceOf(int(r)), "NcclTransport: ranks ", q, " and ", r,
                  " are both on CUDA device ", deviceOf(int(r)),
                  "; NCCL needs one GPU per rank (the DeviceFabric transport shares one GPU)");
    TPSIM_CUDA_CHECK(cudaSetDevice(deviceOf(int(r))));
    cudaStream_t s = nullptr;
    TPSIM_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    streams_.push_back(s);
  }
  // Within one process NCCL reads and writes peers' user buffers directly. Those come from each
  // device's default pool, which cudaDeviceEnablePeerAccess does not open to other devices.
  for (std::size_t owner = 0; owner < ranks_.size(); ++owner) {
    if (!local(int(owner))) continue;
    cudaMemPool_t pool = nullptr;
    TPSIM_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, deviceOf(int(owner))));
    for (std::size_t user = 0; user < ranks_.size(); ++user) {
      if (user == owner || !local(int(user))) continue;
      int canAccess = 0;
      TPSIM_CUDA_CHECK(cudaDeviceCanAccessPeer(&canAccess, deviceOf(int(user)), deviceOf(int(owner))));
      if (!canAccess) continue;
      cudaMemAccessDesc access{};
      access.location.type = cudaMemLocationTypeDevice;
      access.location.id = deviceOf(int(user));
      access.flags = cudaMemAccessFlagsProtReadWrite;
      TPSIM_CUDA_CHECK(cudaMemPoolSetAccess(pool, &access, 1));
    }
  }
  if (!spread_) return;
  // The job's world: every process's ranks join it here, this process's in one group.
  const int n = int(ranks_.size());
  Communicators world;
  world.comms.assign(std::size_t(n), nullptr);
  for (int r = 0; r < n; ++r) world.members.push_back(r);
  ncclConfig_t config = nonBlocking();
  try {
    NcclGroup group;
    for (int r = 0; r < n; ++r) {
      if (!local(r)) continue;
      TPSIM_CUDA_CHECK(cudaSetDevice(deviceOf(r)));
      checkIssued(ncclCommInitRankConfig(&world.comms[std::size_t(r)], n, *worldId, r, &config), "ncclCommInitRankConfig");
    }
    group.end("ncclGroupEnd (world communicator init)");
    awaitComms(world.comms, "NCCL world communicator init");
  } catch (...) {
    for (ncclComm_t comm : world.comms)
      if (comm) ncclCommAbort(comm);
    throw;
  }
  add("w", std::move(world));
}

NcclTransport::~NcclTransport() {
  for (auto& [key, set] : comms_) {
    for (std::size_t i = 0; i < set.comms.size(); ++i) {
      if (!set.comms[i]) continue;
      cudaSetDevice(deviceOf(set.members[i]));
      if (aborted_) continue;  // ncclCommAbort already released them
      // Finalize flushes what is in flight; a communicator that cannot finish in time is aborted.
      ncclCommFinalize(set.comms[i]);
    }
    const auto deadline = Clock::now() + timeout_;
    for (ncclComm_t comm : set.comms) {
      if (!comm) continue;
      ncclResult_t state = ncclInProgress;
      while (!aborted_ && state == ncclInProgress && Clock::now() < deadline) {
        if (ncclCommGetAsyncError(comm, &state) != ncclSuccess) break;
        if (state == ncclInProgress) std::this_thread::yield();
      }
      if (!aborted_) state == ncclSuccess ? ncclCommDestroy(comm) : ncclCommAbort(comm);
    }
    for (std::size_t i = 0; i < set.barrierFloats.size(); ++i) {
      if (!set.barrierFloats[i]) continue;
      cudaSetDevice(deviceOf(set.members[i]));
      cudaFreeAsync(set.barrierFloats[i], streams_[set.members[i]]);
    }
  }
  // Members' frees may still wait on the streams' events. Streams that never drain are left
  // alone: their work would outlive them anyway, and blocking here would hang the teardown.
  if (drain(deadlineIn(streamTimeoutMs_)))
    for (std::size_t r = 0; r < streams_.size(); ++r) {
      if (!streams_[r]) continue;
      cudaSetDevice(deviceOf(int(r)));
      cudaStreamDestroy(streams_[r]);
    }
  cudaGetLastError();
}

bool NcclTransport::drain(std::chrono::steady_clock::time_point deadline) noexcept {
  bool drained = true;
  for (std::size_t r = 0; r < streams_.size(); ++r)
    if (streams_[r])
      drained = cudaSetDevice(deviceOf(int(r))) == cudaSuccess && pollStream(streams_[r], deadline) == cudaSuccess &&
                drained;
  cudaGetLastError();
  return drained;
}

void NcclTransport::awaitComms(const std::vector<ncclComm_t>& comms, const char* what) {
  const auto deadline = Clock::now() + timeout_;
  for (ncclComm_t comm : comms) {
    if (!comm) continue;
    for (;;) {
      ncclResult_t state = ncclSuccess;
      checkIssued(ncclCommGetAsyncError(comm, &state), "ncclCommGetAsyncError");
      if (state == ncclSuccess) break;
      if (state != ncclInProgress) {
        const std::string why = tpsim::detail::concat(what, ": NCCL reported ", detail::ncclResultName(state), " (",
                                               ncclGetErrorString(state), "): ", ncclGetLastError(comm));
        abort();
        throw BackendError(why);
      }
      if (Clock::now() > deadline) {
        abort();
        throw BackendError(tpsim::detail::concat(what, ": still in progress after ", timeout_.count(),
                                          " ms; the communicators were aborted"));
      }
      std::this_thread::yield();
    }
  }
}

NcclTransport::Communicators& NcclTransport::communicatorsFor(const world::Collective& c) {
  if (spread_) {
    auto found = comms_.find(c.id);
    TPSIM_INTERNAL_ASSERT(found != comms_.end(), "NcclTransport: no communicator for ", c.group, " (id ", c.id,
                          "); a job's groups come from splits");
    return found->second;
  }
  const std::vector<int>& members = c.globalRanks;
  const std::string key = world::rankList(members);
  auto found = comms_.find(key);
  if (found != comms_.end()) return found->second;
  const int n = int(members.size());
  Communicators set;
  set.members = members;
  set.comms.assign(n, nullptr);
  ncclUniqueId id;
  TPSIM_NCCL_CHECK(ncclGetUniqueId(&id));
  ncclConfig_t config = nonBlocking();
  try {
    // One thread initializes every member: the calls must sit in one group, or the first would
    // wait for peers that this same thread has not initialized yet.
    NcclGroup group;
    for (int i = 0; i < n; ++i) {
      TPSIM_CUDA_CHECK(cudaSetDevice(deviceOf(members[i])));
      checkIssued(ncclCommInitRankConfig(&set.comms[i], n, id, i, &config), "ncclCommInitRankConfig");
    }
    group.end("ncclGroupEnd (communicator init)");
    awaitComms(set.comms, "NCCL communicator init");
  } catch (...) {
    // abort() reaches only the sets in comms_; this one is not there yet.
    for (ncclComm_t comm : set.comms)
      if (comm) ncclCommAbort(comm);
    throw;
  }
  return add(key, std::move(set));
}

NcclTransport::Communicators& NcclTransport::add(const std::string& key, Communicators set) {
  auto& added = comms_.emplace(key, std::move(set)).first->second;
  added.barrierFloats.assign(added.members.size(), nullptr);
  for (std::size_t i = 0; i < added.members.size(); ++i) {
    const int g = added.members[i];
    if (!added.comms[i]) continue;
    TPSIM_CUDA_CHECK(cudaSetDevice(deviceOf(g)));
    TPSIM_CUDA_CHECK(cudaMallocAsync(&added.barrierFloats[i], sizeof(float), streams_[g]));
    TPSIM_CUDA_CHECK(cudaMemsetAsync(added.barrierFloats[i], 0, sizeof(float), streams_[g]));
  }
  return added;
}

void NcclTransport::split(const world::Collective& c) {
  // In one process each new member set makes its communicators on its first collective.
  if (!spread_) return;
  TPSIM_CHECK(!aborted_, "NcclTransport: the communicators were aborted after an earlier failure");
  Communicators& parent = communicatorsFor(c);
  const int n = int(c.globalRanks.size());
  std::vector<ncclComm_t> made(std::size_t(n), nullptr);  // by parent group rank
  ncclConfig_t config = nonBlocking();
  try {
    NcclGroup group;
    for (int i = 0; i < n; ++i) {
      if (!parent.comms[std::size_t(i)]) continue;
      const NcclSplitArgs args = ncclSplitArgs(c.split[std::size_t(i)]);
      TPSIM_CUDA_CHECK(cudaSetDevice(deviceOf(c.globalRanks[std::size_t(i)])));
      checkIssued(ncclCommSplit(parent.comms[std::size_t(i)], args.color, args.key, &made[std::size_t(i)], &config),
                  "ncclCommSplit");
    }
    group.end("ncclGroupEnd (ncclCommSplit)");
    awaitComms(made, "ncclCommSplit");
  } catch (...) {
    for (ncclComm_t comm : made)
      if (comm) ncclCommAbort(comm);
    throw;
  }
  // Each new group once, with this process's members in their places.
  std::map<std::string, Communicators> groups;
  for (int i = 0; i < n; ++i) {
    const world::SplitPlace& place = c.split[std::size_t(i)];
    if (!made[std::size_t(i)]) continue;
    Communicators& g = groups[place.id];
    if (g.members.empty()) {
      g.members.assign(std::size_t(place.size), -1);
      g.comms.assign(std::size_t(place.size), nullptr);
    }
    g.members[std::size_t(place.rank)] = c.globalRanks[std::size_t(i)];
    g.comms[std::size_t(place.rank)] = made[std::size_t(i)];
  }
  for (auto& [id, g] : groups) add(id, std::move(g));
}

world::TransportToken NcclTransport::issued(int globalRank) {
  return recordEvent(deviceOf(globalRank), ranks_[globalRank]->stream());
}

world::TransportToken NcclTransport::execute(const world::Collective& c) {
  TPSIM_CHECK(!aborted_, "NcclTransport: the communicators were aborted after an earlier failure");
  const int n = int(c.globalRanks.size());
  Communicators& set = communicatorsFor(c);
  // In a job only this process's members issue here; NCCL joins the other processes'.
  for (int i = 0; i < n; ++i) {
    const int g = c.globalRanks[i];
    if (local(g)) streamWaitToken(deviceOf(g), streams_[g], c.issued[i]);
  }
  const ncclDataType_t type = ncclTypeOf(c.dtype);
  const bool empty = c.inCount == 0 && c.outCount == 0 && c.kind != world::OpKind::kBarrier;
  // ncclAlltoAll is per-peer sends and receives, which may overwrite a block of an in-place
  // member's input before it was sent: stage those inputs (the simulator stages every exchange).
  std::vector<std::unique_ptr<StagedInput>> staged(static_cast<std::size_t>(n));  // by group rank
  if (c.kind == world::OpKind::kAllToAll && !empty)
    for (int i = 0; i < n; ++i)
      if (local(c.globalRanks[i]) && c.in[i].data() == c.out[i].data()) {
        const int g = c.globalRanks[i];
        staged[i] = std::make_unique<StagedInput>(deviceOf(g), streams_[g], c.in[i].data(),
                                                  std::size_t(c.inCount) * dtypeSize(c.dtype));
      }
  if (!empty) {
    NcclGroup group;
    for (int i = 0; i < n; ++i) {
      if (!local(c.globalRanks[i])) continue;
      const cudaStream_t s = streams_[c.globalRanks[i]];
      const void* in = staged[i] ? staged[i]->data() : c.in[i].data();
      void* out = c.out[i].data();
      switch (c.kind) {
        case world::OpKind::kAllReduce:
          checkIssued(ncclAllReduce(in, out, std::size_t(c.inCount), type, ncclSum, set.comms[i], s), "ncclAllReduce");
          break;
        case world::OpKind::kReduceScatter:
          checkIssued(ncclReduceScatter(in, out, std::size_t(c.outCount), type, ncclSum, set.comms[i], s),
                      "ncclReduceScatter");
          break;
        case world::OpKind::kAllGather:
          checkIssued(ncclAllGather(in, out, std::size_t(c.inCount), type, set.comms[i], s), "ncclAllGather");
          break;
        case world::OpKind::kBroadcast:
          checkIssued(ncclBroadcast(in, out, std::size_t(c.outCount), type, c.root, set.comms[i], s), "ncclBroadcast");
          break;
        case world::OpKind::kAllToAll:
          checkIssued(ncclAlltoAll(in, out, std::size_t(c.inCount / n), type, set.comms[i], s), "ncclAlltoAll");
          break;
        case world::OpKind::kBarrier:
          checkIssued(ncclAllReduce(set.barrierFloats[i], set.barrierFloats[i], 1, ncclFloat32, ncclSum, set.comms[i], s),
                      "ncclAllReduce (barrier)");
          break;
        case world::OpKind::kSplit: break;
      }
    }
    group.end("ncclGroupEnd");
    awaitComms(set.comms, world::opName(c.kind));
  }
  auto done = std::make_shared<DoneEvents>();
  for (int i = 0; i < n; ++i) {
    const int g = c.globalRanks[i];
    if (!local(g)) continue;
    const bool mean = c.reduce == ReduceOp::kMean &&
                      (c.kind == world::OpKind::kAllReduce || c.kind == world::OpKind::kReduceScatter);
    if (mean && !empty) {
      TPSIM_CUDA_CHECK(cudaSetDevice(deviceOf(g)));
      divideOnDevice(c.dtype, c.out[i].data(), c.outCount, n, streams_[g]);
    }
    done->byGlobalRank[g] = recordEvent(deviceOf(g), streams_[g]);
  }
  return done;
}

void NcclTransport::completed(int globalRank, const world::TransportToken& done) {
  const auto& events = static_cast<const DoneEvents*>(done.get())->byGlobalRank;
  streamWaitToken(deviceOf(globalRank), ranks_[globalRank]->stream(), events.at(globalRank));
}

void NcclTransport::abort() {
  if (aborted_) return;
  aborted_ = true;
  for (auto& [key, set] : comms_)
    for (ncclComm_t comm : set.comms)
      if (comm) ncclCommAbort(comm);
}

}  // namespace tpsim::gpu
