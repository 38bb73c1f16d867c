#include "tools/lib/job.h"

#include <cstdio>
#include <cstring>
#include <sstream>

#include "backends/errors.h"
#include "backends/wire.h"
#include "tools/lib/backend.h"
#include "tools/lib/checkpoint_files.h"
#include "tools/lib/trace.h"
#include "tools/lib/usage_error.h"
#include "tpsim_config.h"
#if TPSIM_HAVE_MPI
#include "backends/mpi/session.h"
#endif
#if TPSIM_HAVE_MPI && TPSIM_HAVE_GPU
#include "gpu/world.h"
#endif

namespace tpsim::tools {

#if TPSIM_HAVE_MPI
namespace {

std::unique_ptr<mpi::Session>& session() {
  static std::unique_ptr<mpi::Session> s;
  return s;
}

void putRecord(std::string& out, const RankRecord& r) {
  wire::put(out, std::uint64_t(r.compute.size()));
  for (const ComputeRecord& c : r.compute) {
    wire::putString(out, c.name);
    wire::putString(out, c.dtype);
    for (std::int64_t x : {c.m, c.n, c.k}) wire::put(out, x);
    for (double x : {c.flops, c.bytes, c.start, c.end}) wire::put(out, x);
  }
  wire::put(out, std::uint64_t(r.comms.size()));
  for (const CommRecord& c : r.comms) {
    wire::putString(out, c.op);
    wire::putString(out, c.group);
    wire::put(out, c.seq);
    wire::putString(out, c.dtype);
    for (std::int64_t x : {c.inBytes, c.outBytes}) wire::put(out, x);
    wire::put(out, std::int32_t(c.size));
    for (double x : {c.issued, c.waitStart, c.completed}) wire::put(out, x);
  }
  wire::put(out, std::uint64_t(r.steps.size()));
  for (const auto& [step, index] : r.steps) {
    wire::put(out, step);
    wire::put(out, std::uint64_t(index));
  }
}

RankRecord getRecord(wire::Reader& in) {
  RankRecord r;
  r.compute.resize(in.get<std::uint64_t>());
  for (ComputeRecord& c : r.compute) {
    c.name = in.getString();
    c.dtype = in.getString();
    for (std::int64_t* x : {&c.m, &c.n, &c.k}) *x = in.get<std::int64_t>();
    for (double* x : {&c.flops, &c.bytes, &c.start, &c.end}) *x = in.get<double>();
  }
  r.comms.resize(in.get<std::uint64_t>());
  for (CommRecord& c : r.comms) {
    c.op = in.getString();
    c.group = in.getString();
    c.seq = in.get<std::uint64_t>();
    c.dtype = in.getString();
    for (std::int64_t* x : {&c.inBytes, &c.outBytes}) *x = in.get<std::int64_t>();
    c.size = in.get<std::int32_t>();
    for (double* x : {&c.issued, &c.waitStart, &c.completed}) *x = in.get<double>();
  }
  r.steps.resize(in.get<std::uint64_t>());
  for (auto& [step, index] : r.steps) {
    step = in.get<RankRecord::Step>();
    index = in.get<std::uint64_t>();
  }
  return r;
}
#if TPSIM_HAVE_GPU
// One rank per process, each on the GPU its place on the machine picks, NCCL between them.
std::unique_ptr<World> makeGpuJobWorld(const WorldOptions& options) {
  const std::string whyNot = backendUnusableReason("gpu");
  if (!whyNot.empty()) throw UsageError{"--backend gpu: cannot run here: " + whyNot};
  gpu::GpuWorldOptions gpuOptions = gpu::worldOptionsFromEnvironment();
  auto job = std::make_shared<gpu::ProcessJob>();
  job->process = jobProcess();
  job->processes = jobProcesses();
  job->localProcess = session()->localProcess();
  const std::chrono::milliseconds timeout = options.timeout;
  job->broadcast = [timeout](const std::string& bytes) { return session()->broadcast(bytes, timeout); };
  job->spread = [size = options.size](std::shared_ptr<world::Transport> local) {
    return session()->spread(std::move(local), size);
  };
  gpuOptions.job = std::move(job);
  if (jobProcess() == 0)
    std::fprintf(stderr, "tpsim: %d ranks over %d MPI processes, one GPU each (process p runs rank p)\n", options.size,
                 jobProcesses());
  try {
    return std::make_unique<gpu::World>(options, gpuOptions);
  } catch (const InvalidArgument& e) {
    throw UsageError{"--backend gpu: " + std::string(e.what())};
  } catch (const BackendError& e) {
    throw UsageError{"--backend gpu: cannot run here: " + std::string(e.what())};
  }
}
#endif

}  // namespace

void joinJob() {
  if (mpi::Session::launched()) session() = std::make_unique<mpi::Session>();
}
int jobProcess() { return session() ? session()->process() : 0; }
int jobProcesses() { return session() ? session()->processes() : 1; }
int jobLocalProcesses() { return session() ? session()->localProcesses() : 1; }
bool jobRuns(int rank, int size) { return mpi::processOf(rank, size, jobProcesses()) == jobProcess(); }
mpi::Session* jobSession() { return session().get(); }

int leaveJob(int code) {
  // The other processes wait for process 0, which may still verify and write a large run's results
  // (the job ends when one process leaves without the others); a failed process's peers fail within
  // their timeouts.
  if (session()) session()->finish(code, code == 0 ? std::chrono::hours(1) : std::chrono::minutes(1));
  return code;
}


void agreeToRun(std::exception_ptr mine, int code, const std::string& message, std::chrono::milliseconds timeout) {
  if (jobProcesses() > 1) {
    // Process 0 picks the first failure, "P CODE MESSAGE", and every process gets it.
    std::string agreed;
    try {
      const std::vector<std::string> parts =
          session()->gather(mine ? detail::concat(code, " ", message) : "", timeout);
      std::string first;
      for (std::size_t p = 0; p < parts.size() && first.empty(); ++p)
        if (!parts[p].empty()) first = detail::concat(p, " ", parts[p]);
      agreed = session()->broadcast(first, timeout);
    } catch (const Error&) {
      if (mine) std::rethrow_exception(mine);
      throw;
    }
    if (!agreed.empty() && !mine) {
      std::istringstream in(agreed);
      int process = 0, exitCode = 0;
      in >> process >> exitCode;
      in.get();
      std::string text;
      std::getline(in, text, '\0');
      throw JobRefusal(exitCode, detail::concat("process ", process, ": ", text));
    }
  }
  if (mine) std::rethrow_exception(mine);
}

std::vector<std::string> gatherJob(std::string mine, std::chrono::milliseconds timeout) {
  if (jobProcesses() == 1) return {std::move(mine)};
  return session()->gather(std::move(mine), timeout);
}

std::vector<std::string> allGatherJob(std::string mine, std::chrono::milliseconds timeout) {
  if (jobProcesses() == 1) return {std::move(mine)};
  std::string packed;
  for (const std::string& part : session()->gather(std::move(mine), timeout)) wire::putString(packed, part);
  const std::string all = session()->broadcast(std::move(packed), timeout);
  wire::Reader in(all, "the processes' gathered parts");
  std::vector<std::string> out;
  for (int p = 0; p < jobProcesses(); ++p) out.push_back(in.getString());
  return out;
}

void sendToProcess(int to, std::string part) { session()->send(to, std::move(part)); }

std::string receiveFromProcess(int from, std::chrono::milliseconds timeout) {
  return session()->receive(from, timeout);
}

void checkJobPlacement(const std::string& backend, int size) {
  if (!session()) return;
#if TPSIM_HAVE_GPU
  if (backend == "gpu") {
    const std::string error = gpu::processPlacementError(size, jobProcesses());
    if (!error.empty()) throw UsageError{"--backend gpu: " + error + " (--tp x --gtp-remat)"};
    return;
  }
#endif
  if (backend != "sim" || jobProcesses() == 1) return;  // makeJobWorld says what the backend lacks
  const std::string error = mpi::placementError(size, jobProcesses());
  if (!error.empty()) throw UsageError{"--tp x --gtp-remat: " + error};
}

std::unique_ptr<World> makeJobWorld(const std::string& backend, const WorldOptions& options) {
  checkJobPlacement(backend, options.size);
#if TPSIM_HAVE_GPU
  // Under a launcher, even a job of one process: its GPU is the one its place picks.
  if (session() && backend == "gpu") return makeGpuJobWorld(options);
#endif
  if (jobProcesses() == 1) return makeWorld(backend, options);
  if (backend != "sim")
    throw UsageError{"--backend " + backend + ": cannot run here: " + backendUnusableReason(backend)};
  if (jobProcess() == 0) {
    std::string map;
    for (int p = 0; p < jobProcesses(); ++p) {
      const int first = p * options.size / jobProcesses(), last = (p + 1) * options.size / jobProcesses() - 1;
      map += detail::concat(p == 0 ? "" : ", ", p, ": ", first, first == last ? "" : detail::concat("-", last));
    }
    // stderr: the report on stdout is the same as one process's.
    std::fprintf(stderr, "tpsim: %d ranks over %d MPI processes (process: ranks): %s\n", options.size,
                 jobProcesses(), map.c_str());
  }
  return session()->makeWorld(options);
}

void gatherRanks(std::vector<std::map<std::string, StoredTensor>>& results, std::vector<std::vector<TraceEvent>>& trace,
                 std::vector<RankRecord>& records, CheckpointWriter* checkpoint, std::chrono::milliseconds timeout) {
  if (jobProcesses() == 1) return;
  const int size = int(results.size());
  // Process 0 keeps its own; each other process sends its ranks' and lets them go as it packs them.
  std::string mine;
  for (int r = 0; r < size && jobProcess() != 0; ++r) {
    if (mpi::processOf(r, size, jobProcesses()) != jobProcess()) continue;
    wire::put(mine, std::uint64_t(results[std::size_t(r)].size()));
    for (const auto& [name, t] : results[std::size_t(r)]) {
      wire::putString(mine, name);
      wire::put(mine, t.dtype);
      wire::put(mine, std::uint64_t(t.shape.size()));
      for (std::int64_t d : t.shape) wire::put(mine, d);
      wire::putString(mine, std::string(t.bytes.begin(), t.bytes.end()));
    }
    results[std::size_t(r)].clear();
    wire::put(mine, std::uint64_t(trace[std::size_t(r)].size()));
    for (const TraceEvent& e : trace[std::size_t(r)]) {
      wire::putString(mine, e.op);
      wire::putString(mine, e.group);
      wire::put(mine, e.seq);
      wire::putString(mine, e.dtype);
      wire::put(mine, e.bytes);
    }
    if (!records.empty()) putRecord(mine, records[std::size_t(r)]);
  }
  if (checkpoint && jobProcess() != 0) wire::putString(mine, checkpoint->packed());
  std::vector<std::string> parts = session()->gather(std::move(mine), timeout);
  for (int p = 1; p < int(parts.size()); ++p) {
    wire::Reader in(parts[std::size_t(p)], "a process's gathered results");
    for (int r = 0; r < size; ++r) {
      if (mpi::processOf(r, size, jobProcesses()) != p) continue;
      std::map<std::string, StoredTensor>& map = results[std::size_t(r)];
      for (auto n = in.get<std::uint64_t>(); n > 0; --n) {
        const std::string name = in.getString();
        StoredTensor& t = map[name];
        t.dtype = in.get<DType>();
        t.shape.resize(in.get<std::uint64_t>());
        for (std::int64_t& d : t.shape) d = in.get<std::int64_t>();
        const std::string bytes = in.getString();
        t.bytes.assign(bytes.begin(), bytes.end());
      }
      auto& events = trace[std::size_t(r)];
      events.resize(in.get<std::uint64_t>());
      for (TraceEvent& e : events) {
        e.op = in.getString();
        e.group = in.getString();
        e.seq = in.get<std::uint64_t>();
        e.dtype = in.getString();
        e.bytes = in.get<std::int64_t>();
      }
      if (!records.empty()) records[std::size_t(r)] = getRecord(in);
    }
    if (checkpoint) checkpoint->addPacked(in.getString());
    std::string().swap(parts[std::size_t(p)]);  // unpacked
  }
}

#else

void joinJob() {}
void checkJobPlacement(const std::string&, int) {}
int jobProcess() { return 0; }
int jobProcesses() { return 1; }
int jobLocalProcesses() { return 1; }
bool jobRuns(int, int) { return true; }
mpi::Session* jobSession() { return nullptr; }
int leaveJob(int code) { return code; }
void agreeToRun(std::exception_ptr mine, int, const std::string&, std::chrono::milliseconds) {
  if (mine) std::rethrow_exception(mine);
}
std::vector<std::string> gatherJob(std::string mine, std::chrono::milliseconds) { return {std::move(mine)}; }
std::vector<std::string> allGatherJob(std::string mine, std::chrono::milliseconds) { return {std::move(mine)}; }
void sendToProcess(int to, std::string) { TPSIM_INTERNAL_ASSERT(false, "sendToProcess(", to, ") in one process"); }
std::string receiveFromProcess(int from, std::chrono::milliseconds) {
  TPSIM_INTERNAL_ASSERT(false, "receiveFromProcess(", from, ") in one process");
  return {};
}
std::unique_ptr<World> makeJobWorld(const std::string& backend, const WorldOptions& options) {
  return makeWorld(backend, options);
}
void gatherRanks(std::vector<std::map<std::string, StoredTensor>>&, std::vector<std::vector<TraceEvent>>&,
                 std::vector<RankRecord>&, CheckpointWriter*, std::chrono::milliseconds) {}

#endif

}  // namespace tpsim::tools
