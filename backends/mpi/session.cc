#include "backends/mpi/session.h"

#include <mpi.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <future>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "backends/errors.h"
#include "backends/world/rendezvous.h"
#include "sim/world.h"

namespace tpsim::mpi {

int processOf(int rank, int size, int processes) { return rank / (size / processes); }

std::string placementError(int size, int processes) {
  if (size % processes == 0) return "";
  return detail::concat("a world of ", size, " ranks cannot spread over ", processes,
                        " processes: expected a number of processes that divides ", size, " (each runs size / P ranks), got ",
                        processes);
}

bool Session::launched() {
  // Open MPI's mpirun, PMIx launchers (srun --mpi=pmix, prterun), PMI-2 launchers (srun --mpi=pmi2).
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK"})
    if (std::getenv(name)) return true;
  return false;
}

namespace {

using Clock = std::chrono::steady_clock;

// Message tags; every payload starts with the key of the run it belongs to.
enum Tag : int { kPart = 1, kFailed = 2, kFinished = 3 };

void putString(std::string& out, const std::string& s) {
  const auto size = std::uint32_t(s.size());
  out.append(reinterpret_cast<const char*>(&size), sizeof size);
  out += s;
}

// `body` behind its key, in body's own memory where it has room (a string grown by appends has).
std::string keyed(const std::string& key, std::string body) {
  std::string header;
  putString(header, key);
  body.insert(0, header);
  return body;
}

std::string getString(const std::string& in, std::size_t& at) {
  std::uint32_t size = 0;
  TPSIM_INTERNAL_ASSERT(at + sizeof size <= in.size(), "a peer's message is truncated");
  std::memcpy(&size, in.data() + at, sizeof size);
  at += sizeof size;
  TPSIM_INTERNAL_ASSERT(at + size <= in.size(), "a peer's message is truncated");
  at += size;
  return in.substr(at - size, size);
}

struct FailNotice {
  CollectiveFailure kind = CollectiveFailure::kPeerFailed;
  std::string message;
  int rank = -1;
  std::string rankError;
};

// The run a process's rendezvous has attached: where its exchanges, failures and finish go.
struct ActiveRun {
  std::string key;
  std::shared_ptr<world::PeerSink> sink;
  std::vector<int> peers;
  bool failureReported = false;
  bool finishReported = false;
};

}  // namespace

// The job's communicator and the one thread that calls MPI after MPI_Init (MPI_THREAD_SERIALIZED):
// it posts the sends the rendezvous queues, receives whatever arrives, in any order and ahead of
// the run it belongs to, and hands each run what it waits for. Nothing here blocks on a peer, so a
// peer that dies or hangs costs a timeout of the rendezvous, not a hang.
struct Session::Impl {
  MPI_Comm comm = MPI_COMM_NULL;
  int process = 0;
  int processes = 1;
  int nextWorld = 0;  // worlds made so far: a world's key, the same in every process
  int nextGather = 0;
  int nextBroadcast = 0;
  std::map<int, int> sentTo, receivedFrom;  // send and receive's parts, by peer
  int localProcess = 0;  // among the processes on this machine (MPI_COMM_TYPE_SHARED)
  int localProcesses = 1;

  std::mutex mu;
  std::deque<std::tuple<int, int, std::shared_ptr<std::string>>> outbox;  // (dest, tag, payload)
  std::map<std::string, std::map<int, std::string>> parts;                // exchange key -> process -> part
  std::map<std::string, std::vector<int>> awaited;                        // exchange key -> processes
  std::map<std::string, FailNotice> failures;                             // run key -> first notice
  std::map<std::string, std::set<int>> finished;                          // run key -> processes
  ActiveRun active;
  std::deque<std::packaged_task<void()>> tasks;  // Session::serialized's, run by the progress thread
  std::atomic<bool> stop{false};
  Clock::time_point stopDeadline;  // how long a stopping progress thread lets its sends complete
  std::thread progress;
  // Transfers a peer never completed before the process ended: MPI may still use their buffers.
  std::vector<std::shared_ptr<std::string>> abandoned;

  void send(const std::vector<int>& to, Tag tag, std::string payload) {
    // One message each (MPI's counts are ints).
    if (payload.size() > std::size_t(std::numeric_limits<int>::max()))
      throw Error(detail::concat("mpi: a message of ", payload.size(), " bytes to another process; at most ",
                                 std::numeric_limits<int>::max(), " go in one"));
    auto shared = std::make_shared<std::string>(std::move(payload));
    std::lock_guard<std::mutex> lock(mu);
    for (int p : to) outbox.emplace_back(p, tag, shared);
  }

  // Caller holds mu. Drops what a run left behind once it ended.
  void forget(const std::string& runKey) {
    const std::string prefix = runKey + "/";
    for (auto it = parts.lower_bound(prefix); it != parts.end() && it->first.compare(0, prefix.size(), prefix) == 0;)
      it = parts.erase(it);
    for (auto it = awaited.lower_bound(prefix); it != awaited.end() && it->first.compare(0, prefix.size(), prefix) == 0;)
      it = awaited.erase(it);
    failures.erase(runKey);
    finished.erase(runKey);
  }

  void received(int source, int tag, std::string payload) {
    std::size_t at = 0;
    // A part keeps the payload's memory, the key cut off in place: a results part is most of a run.
    std::string key;
    if (tag == kPart) {
      key = getString(payload, at);
      payload.erase(0, at);
    }
    std::lock_guard<std::mutex> lock(mu);
    switch (tag) {
      case kPart: parts[key][source] = std::move(payload); break;
      case kFailed: {
        const std::string runKey = getString(payload, at);
        FailNotice notice;
        TPSIM_INTERNAL_ASSERT(at + 1 + sizeof(std::int32_t) <= payload.size(), "a peer's message is truncated");
        notice.kind = static_cast<CollectiveFailure>(payload[at]);
        std::int32_t rank = 0;
        std::memcpy(&rank, payload.data() + at + 1, sizeof rank);
        at += 1 + sizeof rank;
        notice.rank = rank;
        notice.message = getString(payload, at);
        notice.rankError = getString(payload, at);
        failures.emplace(runKey, std::move(notice));
        break;
      }
      case kFinished: finished[getString(payload, at)].insert(source); break;
      default: TPSIM_INTERNAL_ASSERT(false, "a message with unknown tag ", tag, " from process ", source);
    }
  }

  void progressLoop() {
    std::vector<std::pair<MPI_Request, std::shared_ptr<std::string>>> sending;
    // Receives are nonblocking too: the data of a matched message may never come (its sender died).
    struct Receive {
      MPI_Request request;
      int source, tag;
      std::shared_ptr<std::string> payload;
    };
    std::vector<Receive> receiving;
    int idle = 0;
    // Stops once told to and every queued send is posted: a failure's notice must leave.
    for (bool last = false; !last;) {
      last = stop.load();
      bool busy = false;
      std::deque<std::tuple<int, int, std::shared_ptr<std::string>>> queued;
      // A task runs after every send queued before it is posted: one may block in MPI until a peer
      // gets here, and the peer may wait for such a send (a run's finish).
      std::deque<std::packaged_task<void()>> due;
      {
        std::lock_guard<std::mutex> lock(mu);
        queued.swap(outbox);
        due.swap(tasks);
      }
      for (auto& [dest, tag, payload] : queued) {
        MPI_Request request;
        MPI_Isend(payload->data(), int(payload->size()), MPI_BYTE, dest, tag, comm, &request);
        sending.emplace_back(request, payload);
        busy = true;
      }
      for (std::size_t i = 0; i < sending.size();) {
        int done = 0;
        MPI_Test(&sending[i].first, &done, MPI_STATUS_IGNORE);
        if (done) {
          sending[i] = std::move(sending.back());
          sending.pop_back();
        } else {
          ++i;
        }
      }
      for (;;) {
        int ready = 0;
        MPI_Message message;
        MPI_Status status;
        MPI_Improbe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm, &ready, &message, &status);
        if (!ready) break;
        int bytes = 0;
        MPI_Get_count(&status, MPI_BYTE, &bytes);
        Receive r{MPI_REQUEST_NULL, status.MPI_SOURCE, status.MPI_TAG, std::make_shared<std::string>(std::size_t(bytes), '\0')};
        MPI_Imrecv(r.payload->data(), bytes, MPI_BYTE, &message, &r.request);
        receiving.push_back(std::move(r));
        busy = true;
      }
      for (std::size_t i = 0; i < receiving.size();) {
        int done = 0;
        MPI_Test(&receiving[i].request, &done, MPI_STATUS_IGNORE);
        if (done) {
          received(receiving[i].source, receiving[i].tag, std::move(*receiving[i].payload));
          receiving[i] = std::move(receiving.back());
          receiving.pop_back();
          busy = true;
        } else {
          ++i;
        }
      }
      busy = dispatch() || busy;
      for (auto& task : due) task();
      busy = busy || !due.empty();
      // Back off to a 1 ms poll when nothing moves and nothing is awaited: the processes may share
      // few cores. A large message moves only as both ends poll, so transfers in flight keep it short.
      bool inFlight = !sending.empty() || !receiving.empty();
      if (!inFlight) {
        std::lock_guard<std::mutex> lock(mu);
        inFlight = !awaited.empty();
      }
      idle = busy ? 0 : std::min(idle + 1, inFlight ? 100 : 1000);
      if (idle > 100) std::this_thread::sleep_for(std::chrono::microseconds(idle));
      else if (idle > 0) std::this_thread::yield();
    }
    // A large send completes only as its peer receives it: give the peers until the deadline, then
    // leave the rest to MPI (a peer that failed or died no longer listens).
    while (!sending.empty() && Clock::now() < stopDeadline) {
      int done = 0;
      MPI_Test(&sending.back().first, &done, MPI_STATUS_IGNORE);
      if (done) sending.pop_back();
      else std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    for (auto& s : sending) {
      MPI_Request_free(&s.first);
      abandoned.push_back(std::move(s.second));
    }
    for (Receive& r : receiving) {
      MPI_Request_free(&r.request);
      abandoned.push_back(std::move(r.payload));
    }
  }

  // Hands the active run what arrived for it, outside mu (the sink takes the rendezvous' lock,
  // under which the rendezvous calls send()).
  bool dispatch() {
    std::shared_ptr<world::PeerSink> sink;
    std::vector<std::pair<std::string, std::vector<std::string>>> complete;
    std::optional<FailNotice> failure;
    bool allFinished = false;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!active.sink) return false;
      sink = active.sink;
      auto f = failures.find(active.key);
      if (f != failures.end() && !active.failureReported) {
        failure = f->second;
        active.failureReported = true;
      }
      for (auto it = awaited.begin(); it != awaited.end();) {
        auto got = parts.find(it->first);
        bool all = got != parts.end();
        for (int p : it->second) all = all && got->second.count(p);
        if (!all) {
          ++it;
          continue;
        }
        std::vector<std::string> ordered;
        for (int p : it->second) ordered.push_back(std::move(got->second[p]));
        complete.emplace_back(it->first, std::move(ordered));
        parts.erase(got);
        it = awaited.erase(it);
      }
      if (!active.finishReported && finished[active.key].size() == active.peers.size()) {
        active.finishReported = allFinished = true;
      }
    }
    if (failure) sink->peerFailed(failure->kind, failure->message, failure->rank, failure->rankError);
    for (auto& [key, ordered] : complete) sink->delivered(key.substr(key.find('/') + 1), std::move(ordered));
    if (allFinished) sink->peersFinished();
    return failure || !complete.empty() || allFinished;
  }
};

namespace {

// A transport for the members this process runs (the simulator's host copies, NCCL), with the peers
// reached through the session.
class Spread final : public world::Transport {
 public:
  Spread(std::shared_ptr<Session::Impl> session, int size, std::shared_ptr<world::Transport> local)
      : session_(std::move(session)), size_(size), world_(session_->nextWorld++), local_(std::move(local)) {
    for (int p = 0; p < session_->processes; ++p)
      if (p != session_->process) peers_.push_back(p);
  }

  Device device() const override { return local_->device(); }
  bool sharesMemory() const override { return local_->sharesMemory(); }
  world::TransportToken issued(int globalRank) override { return local_->issued(globalRank); }
  world::TransportToken execute(const world::Collective& c) override { return local_->execute(c); }
  void split(const world::Collective& c) override { local_->split(c); }
  void completed(int globalRank, const world::TransportToken& done) override { local_->completed(globalRank, done); }
  void abort() override { local_->abort(); }
  bool carriesPeerData() const override { return local_->carriesPeerData(); }
  int processOf(int globalRank) const override { return mpi::processOf(globalRank, size_, session_->processes); }
  int process() const override { return session_->process; }

  void attach(std::shared_ptr<world::PeerSink> sink) override {
    Session::Impl& s = *session_;
    std::lock_guard<std::mutex> lock(s.mu);
    if (!sink) {
      s.forget(s.active.key);
      s.active = ActiveRun{};
      return;
    }
    s.active = ActiveRun{detail::concat("w", world_, ".", runs_++), std::move(sink), peers_, false, false};
  }

  void exchange(const std::string& key, const std::vector<int>& processes, std::string part) override {
    Session::Impl& s = *session_;
    std::string fullKey;
    {
      std::lock_guard<std::mutex> lock(s.mu);
      fullKey = s.active.key + "/" + key;
      s.awaited[fullKey] = processes;
    }
    s.send(processes, kPart, keyed(fullKey, std::move(part)));
  }

  void failed(CollectiveFailure kind, const std::string& message, int rank, const std::string& rankError) override {
    std::string payload;
    putString(payload, activeKey());
    payload += char(kind);
    const auto rank32 = std::int32_t(rank);
    payload.append(reinterpret_cast<const char*>(&rank32), sizeof rank32);
    putString(payload, message);
    putString(payload, rankError);
    session_->send(peers_, kFailed, std::move(payload));
  }

  void finished() override {
    std::string payload;
    putString(payload, activeKey());
    session_->send(peers_, kFinished, std::move(payload));
  }

 private:
  std::string activeKey() {
    std::lock_guard<std::mutex> lock(session_->mu);
    return session_->active.key;
  }

  std::shared_ptr<Session::Impl> session_;
  int size_;
  int world_;
  int runs_ = 0;
  std::vector<int> peers_;
  std::shared_ptr<world::Transport> local_;
};

}  // namespace

Session::Session() : impl_(std::make_shared<Impl>()) {
  int provided = 0;
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
  TPSIM_CHECK(provided >= MPI_THREAD_SERIALIZED, "mpi: the MPI library provides thread level ", provided,
              "; expected MPI_THREAD_SERIALIZED (", MPI_THREAD_SERIALIZED, ") or higher");
  MPI_Comm_dup(MPI_COMM_WORLD, &impl_->comm);
  // A peer that died shows as a timeout of the rendezvous, not as an abort inside MPI.
  MPI_Comm_set_errhandler(impl_->comm, MPI_ERRORS_RETURN);
  MPI_Comm_rank(impl_->comm, &impl_->process);
  MPI_Comm_size(impl_->comm, &impl_->processes);
  MPI_Comm node = MPI_COMM_NULL;
  MPI_Comm_split_type(impl_->comm, MPI_COMM_TYPE_SHARED, impl_->process, MPI_INFO_NULL, &node);
  MPI_Comm_rank(node, &impl_->localProcess);
  MPI_Comm_size(node, &impl_->localProcesses);
  MPI_Comm_free(&node);
  impl_->progress = std::thread([impl = impl_.get()] { impl->progressLoop(); });
}

Session::~Session() {
  if (impl_->progress.joinable()) finish(0, std::chrono::milliseconds(60'000));
}

int Session::process() const { return impl_->process; }
int Session::processes() const { return impl_->processes; }
int Session::localProcess() const { return impl_->localProcess; }
int Session::localProcesses() const { return impl_->localProcesses; }

std::unique_ptr<World> Session::makeWorld(const WorldOptions& options) {
  const std::string error = placementError(options.size, impl_->processes);
  if (!error.empty()) throw Error(error);
  return std::make_unique<sim::World>(options, spread(std::make_shared<sim::HostTransport>(), options.size));
}

std::shared_ptr<world::Transport> Session::spread(std::shared_ptr<world::Transport> local, int size) {
  return std::make_shared<Spread>(impl_, size, std::move(local));
}

std::string Session::broadcast(std::string fromProcess0, std::chrono::milliseconds timeout) {
  Impl& s = *impl_;
  const std::string key = detail::concat("b", s.nextBroadcast++);
  if (s.process == 0) {
    std::vector<int> others;
    for (int p = 1; p < s.processes; ++p) others.push_back(p);
    s.send(others, kPart, keyed(key, fromProcess0));
    return fromProcess0;
  }
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(s.mu);
      auto it = s.parts.find(key);
      if (it != s.parts.end() && it->second.count(0)) {
        std::string got = std::move(it->second[0]);
        s.parts.erase(it);
        return got;
      }
    }
    if (Clock::now() > deadline)
      throw Error(detail::concat("mpi: process ", s.process, " waited more than ", timeout.count(),
                                 " ms for process 0's broadcast"));
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

std::vector<std::string> Session::gather(std::string mine, std::chrono::milliseconds timeout) {
  Impl& s = *impl_;
  const std::string key = detail::concat("g", s.nextGather++);
  if (s.process != 0) {
    s.send({0}, kPart, keyed(key, std::move(mine)));
    return {};
  }
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(s.mu);
      auto it = s.parts.find(key);
      if (s.processes == 1 || (it != s.parts.end() && int(it->second.size()) == s.processes - 1)) {
        std::vector<std::string> all{std::move(mine)};
        for (int p = 1; p < s.processes; ++p) all.push_back(std::move(it->second[p]));
        if (it != s.parts.end()) s.parts.erase(it);
        return all;
      }
      if (Clock::now() > deadline) {
        std::string missing;
        for (int p = 1; p < s.processes; ++p)
          if (it == s.parts.end() || !it->second.count(p)) missing += (missing.empty() ? "" : ", ") + std::to_string(p);
        throw Error(detail::concat("mpi: process 0 waited more than ", timeout.count(),
                                   " ms for the ranks' results of process(es) ", missing));
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void Session::send(int to, std::string part) {
  Impl& s = *impl_;
  TPSIM_INTERNAL_ASSERT(to >= 0 && to < s.processes && to != s.process, "Session::send to process ", to);
  s.send({to}, kPart, keyed(detail::concat("s", s.sentTo[to]++), std::move(part)));
}

std::string Session::receive(int from, std::chrono::milliseconds timeout) {
  Impl& s = *impl_;
  TPSIM_INTERNAL_ASSERT(from >= 0 && from < s.processes && from != s.process, "Session::receive from process ", from);
  const std::string key = detail::concat("s", s.receivedFrom[from]++);
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(s.mu);
      auto it = s.parts.find(key);
      if (it != s.parts.end() && it->second.count(from)) {
        std::string got = std::move(it->second[from]);
        it->second.erase(from);
        if (it->second.empty()) s.parts.erase(it);
        return got;
      }
    }
    if (Clock::now() > deadline)
      throw Error(detail::concat("mpi: process ", s.process, " waited more than ", timeout.count(),
                                 " ms for process ", from, "'s part"));
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void Session::serialized(const std::function<void()>& fn) {
  TPSIM_INTERNAL_ASSERT(impl_->progress.joinable(), "Session::serialized after finish()");
  std::packaged_task<void()> task(fn);
  std::future<void> done = task.get_future();
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->tasks.push_back(std::move(task));
  }
  done.get();
}

void Session::finish(int exitCode, std::chrono::milliseconds timeout) {
  // After a failure a peer may never take a part sent to it; after success every part was taken but
  // the gathered results may still be on their way to process 0.
  impl_->stopDeadline = Clock::now() + (exitCode == 0 ? timeout : std::chrono::milliseconds(0));
  impl_->stop = true;
  impl_->progress.join();
  MPI_Request request;
  int status = MPI_Ibarrier(impl_->comm, &request);
  const auto deadline = Clock::now() + timeout;
  int done = 0;
  while (status == MPI_SUCCESS && !done && Clock::now() < deadline) {
    status = MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (status != MPI_SUCCESS || !done) {
    // A process never came, or MPI saw one die: MPI_Finalize would wait for it. Ending here makes
    // the launcher end the job (or, told to outlive failures, leaves the others their own timeouts).
    std::fflush(nullptr);
    std::_Exit(exitCode);
  }
  MPI_Comm_free(&impl_->comm);
  MPI_Finalize();
}

}  // namespace tpsim::mpi
