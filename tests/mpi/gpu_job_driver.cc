// What a GPU world of one rank per MPI process computes on the host before any device work, in one
// process or under mpiexec (tests/mpi/mpi_test.sh), so that it is checked where there is no GPU:
//
//   gpu_job_driver local          "process P of N: local L of M" (the shared-memory communicator)
//   gpu_job_driver id             "id HEX": the NCCL id every process got from process 0 (a made-up one)
//   gpu_job_driver split SIZE [FAULT]
//                                 a world of SIZE ranks (one per process under mpiexec) splitting and
//                                 barriering over a transport that records, as NCCL's would see them:
//                                 "split ..." per member with its ncclCommSplit color and key, and
//                                 "process P order: ..." the order the process's collectives reached it;
//                                 FAULT is --inject's RANK:K:KIND
//
// A failure prints "process P: exit N: " and the error to stderr.
#include <chrono>
#include <cstdio>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "backends/collectives.h"
#include "backends/errors.h"
#include "backends/fault.h"
#include "backends/mpi/session.h"
#include "backends/world.h"
#include "gpu/nccl_transport.h"
#include "sim/world.h"

namespace {

using namespace tpsim;

constexpr std::chrono::milliseconds kTimeout(20'000);

// Moves no data (host buffers, barriers and splits only); records what NcclTransport would issue.
class Recorder final : public world::Transport {
 public:
  Recorder(int process, int processes, int size) : process_(process), processes_(processes), size_(size) {}

  Device device() const override { return Device::kHost; }
  bool carriesPeerData() const override { return true; }
  world::TransportToken execute(const world::Collective& c) override {
    record(world::opName(c.kind), c.group);
    return nullptr;
  }
  void split(const world::Collective& c) override {
    record("split", c.group);
    for (std::size_t i = 0; i < c.globalRanks.size(); ++i) {
      if (mpi::processOf(c.globalRanks[i], size_, processes_) != process_) continue;
      const world::SplitPlace& place = c.split[i];
      const gpu::NcclSplitArgs args = gpu::ncclSplitArgs(place);
      lines_.insert(detail::concat("split ", c.id, " rank ", c.globalRanks[i], ": color ", args.color, " key ",
                                   args.key, " -> ", place.id.empty() ? "none" : place.id, " rank ", place.rank,
                                   " of ", place.size));
    }
  }

  void print() const {
    for (const std::string& line : lines_) std::printf("%s\n", line.c_str());
    std::printf("process %d order:%s\n", process_, order_.c_str());
  }

 private:
  // Runs under the rendezvous lock.
  void record(const char* op, const std::string& group) {
    order_ += detail::concat(" ", op, "(", group.substr(0, group.find('[')), ")");
  }

  int process_, processes_, size_;
  std::set<std::string> lines_;
  std::string order_;
};

// Splits of the world and of a split, a rank that joins no group, keys that reverse the parent
// order, and two barriers that agree across processes in the opposite order to their issue (the
// last process is late to the first): every process must still see them in issue order.
void program(RankContext& ctx, int processes) {
  Collectives& world = ctx.comm;
  const int r = world.rank(), n = world.size();
  std::unique_ptr<Collectives> parity = world.split(r % 2, n - r, "parity");
  std::unique_ptr<Collectives> most = world.split(r == n - 1 ? -1 : 0, r, "most");
  std::unique_ptr<Collectives> pairs = parity->split(parity->rank() / 2, 0, "pairs");
  if (processes > 1 && r == n - 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  auto first = world.barrier();
  auto second = parity->barrier();
  second->wait();
  first->wait();
  (void)most;
  (void)pairs;
}

int run(const std::string& mode, int size, const std::string& fault, mpi::Session* session) {
  const int process = session ? session->process() : 0, processes = session ? session->processes() : 1;
  if (mode == "local") {
    std::printf("process %d of %d: local %d of %d\n", process, processes, session ? session->localProcess() : 0,
                session ? session->localProcesses() : 1);
  } else if (mode == "id") {
    const ncclUniqueId id = gpu::shareUniqueId(
        process,
        [&](const std::string& bytes) { return session ? session->broadcast(bytes, kTimeout) : bytes; },
        [] {
          ncclUniqueId made;
          for (std::size_t i = 0; i < sizeof made.internal; ++i) made.internal[i] = char(i * 7 + 13);
          return made;
        });
    std::printf("id ");
    for (char c : id.internal) std::printf("%02x", unsigned((unsigned char)c));
    std::printf("\n");
  } else if (mode == "split") {
    WorldOptions o;
    o.size = size;
    o.timeout = kTimeout;
    if (!fault.empty()) o.faults.push_back(parseFault(fault));
    auto recorder = std::make_shared<Recorder>(process, processes, size);
    sim::World world(o, session ? session->spread(recorder, size) : recorder);
    world.run([processes](RankContext& ctx) { program(ctx, processes); });
    recorder->print();
  } else {
    throw InvalidArgument("usage: gpu_job_driver local | id | split SIZE [FAULT]");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::unique_ptr<mpi::Session> session;
  int code = 0;
  try {
    if (mpi::Session::launched()) session = std::make_unique<mpi::Session>();
    const std::string mode = argc > 1 ? argv[1] : "";
    code = run(mode, argc > 2 ? std::stoi(argv[2]) : 0, argc > 3 ? argv[3] : "", session.get());
  } catch (const std::exception& e) {
    code = dynamic_cast<const InvalidArgument*>(&e) ? 2 : 3;
    std::fprintf(stderr, "process %d: exit %d: %s\n", session ? session->process() : 0, code, e.what());
  }
  std::fflush(stdout);
  if (session) session->finish(code, std::chrono::seconds(30));
  return code;
}
