// A world of SIZE ranks running a fixed program of collectives, in one process or spread over the
// processes of an MPI job (tests/mpi/mpi_test.sh launches it with mpiexec).
//
//   world_driver SIZE [TIMEOUT_MS [FAULT...]]
//
// Each rank prints "rank R OP HASH" for the output of every collective it ran, so the lines of a
// spread run, whichever process printed them, must equal a one-process run's. FAULT is --inject's
// RANK:K:KIND, plus RANK:K:kill (the process running RANK dies by SIGKILL before its K-th
// collective) and RANK:K:exit (the rank's code throws there). A failed world prints
// "process P: exit 3: " and the WorldError to stderr and exits 3.
#include <signal.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backends/collectives.h"
#include "backends/errors.h"
#include "backends/world.h"
#include "backends/mpi/session.h"
#include "sim/world.h"

namespace {

using namespace tpsim;

// FNV-1a over a buffer's bytes: bitwise equality of outputs, in one short line.
std::uint64_t hashOf(const void* data, std::size_t bytes) {
  std::uint64_t h = 1469598103934665603ull;
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

// Rank-dependent values whose sums round differently in every order: any reduction that adds in
// another order than the simulator's shows in the hash.
template <class T>
std::vector<T> valuesFor(int rank, std::int64_t n, int salt) {
  std::vector<T> v(std::size_t(n), T{});
  std::uint64_t s = std::uint64_t(rank + 1) * 2654435761u + std::uint64_t(salt) * 40503u;
  for (auto& x : v) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    x = T(double(std::int64_t(s >> 40) - (1ll << 23)) / double(1 << (10 + (rank % 7))));
  }
  return v;
}

struct Printer {
  std::mutex mu;
  std::vector<std::string> lines;
  void put(int rank, const std::string& what, const void* data, std::size_t bytes) {
    char line[160];
    std::snprintf(line, sizeof line, "rank %d %s %016llx", rank, what.c_str(),
                  static_cast<unsigned long long>(hashOf(data, bytes)));
    std::lock_guard<std::mutex> lock(mu);
    lines.push_back(line);
  }
};

// Faults this driver adds to --inject's: the process dies, or the rank's own code throws.
struct Extra {
  int rank = -1;
  std::int64_t collective = 0;
  bool kill = false;
};

void program(RankContext& ctx, Printer& out, const std::vector<Extra>& extras) {
  Collectives& world = ctx.comm;
  const int r = world.rank(), n = world.size();
  std::int64_t issued = 0;
  auto before = [&] {
    ++issued;
    for (const Extra& e : extras)
      if (e.rank == r && e.collective == issued) {
        if (e.kill) raise(SIGKILL);
        throw Error(detail::concat("rank ", r, " throws before its collective ", issued));
      }
  };
  auto done = [&](const std::string& what, std::unique_ptr<Work> work, const auto& result) {
    work->wait();
    out.put(r, what, result.data(), result.size() * sizeof(result[0]));
  };
  const std::int64_t m = 48 * std::int64_t(n);  // divisible by every group size used below
  const auto um = std::size_t(m), un = std::size_t(n);

  // The world group: every op and dtype the simulator reduces or moves.
  {
    auto in = valuesFor<float>(r, m, 1);
    std::vector<float> sum(um), mean(um);
    before();
    done("allReduce.sum.fp32", world.allReduce(View(in.data(), Shape{m}, DType::kFloat32), View(sum.data(), Shape{m}, DType::kFloat32), {}), sum);
    before();
    AllReduceOptions meanOpts;
    meanOpts.op = ReduceOp::kMean;
    done("allReduce.mean.fp32", world.allReduce(View(in.data(), Shape{m}, DType::kFloat32), View(mean.data(), Shape{m}, DType::kFloat32), meanOpts), mean);
  }
  {
    auto in = valuesFor<double>(r, m, 2);
    std::vector<double> sum(um);
    before();
    done("allReduce.sum.fp64", world.allReduce(View(in.data(), Shape{m}, DType::kFloat64), View(sum.data(), Shape{m}, DType::kFloat64), {}), sum);
  }
  {
    // bf16: the rank-order rounding of every partial sum to 16 bits.
    auto wide = valuesFor<float>(r, m, 3);
    std::vector<std::uint16_t> in(um), sum(um);
    for (std::size_t i = 0; i < in.size(); ++i) {
      std::uint32_t bits;
      std::memcpy(&bits, &wide[i], 4);
      in[i] = std::uint16_t(bits >> 16);
    }
    before();
    done("allReduce.sum.bf16", world.allReduce(View(in.data(), Shape{m}, DType::kBFloat16), View(sum.data(), Shape{m}, DType::kBFloat16), {}), sum);
  }
  {
    auto in = valuesFor<float>(r, m, 4);
    std::vector<float> gathered(um * un), scattered(um / un), exchanged(um),
        broadcast(um);
    before();
    done("allGather.fp32", world.allGather(View(in.data(), Shape{m}, DType::kFloat32), View(gathered.data(), Shape{m * n}, DType::kFloat32), {}), gathered);
    before();
    done("reduceScatter.fp32", world.reduceScatter(View(in.data(), Shape{m}, DType::kFloat32), View(scattered.data(), Shape{m / n}, DType::kFloat32), {}), scattered);
    before();
    done("allToAll.fp32", world.allToAll(View(in.data(), Shape{m}, DType::kFloat32), View(exchanged.data(), Shape{m}, DType::kFloat32), {}), exchanged);
    BroadcastOptions bo;
    bo.root = n - 1;
    before();
    done("broadcast.fp32", world.broadcast(View(in.data(), Shape{m}, DType::kFloat32), View(broadcast.data(), Shape{m}, DType::kFloat32), bo), broadcast);
  }
  {
    auto in = valuesFor<std::int64_t>(r, m, 5);
    std::vector<std::int64_t> sum(um);
    before();
    done("allReduce.sum.int64", world.allReduce(View(in.data(), Shape{m}, DType::kInt64), View(sum.data(), Shape{m}, DType::kInt64), {}), sum);
  }
  before();
  world.barrier()->wait();

  // A tensor-parallel grid: tp groups of two consecutive ranks (within a process or across two),
  // dp groups of every other rank (across processes), collectives interleaved on both.
  const int tpSize = n % 2 == 0 ? 2 : 1;
  std::unique_ptr<Collectives> tp = world.split(r / tpSize, r, "tp");
  std::unique_ptr<Collectives> dp = world.split(r % tpSize, r, "dp");
  for (int step = 0; step < 3; ++step) {
    auto in = valuesFor<float>(r, m, 10 + step);
    std::vector<float> tpSum(um), dpGathered(um * std::size_t(dp->size()));
    before();
    auto tpWork = tp->allReduce(View(in.data(), Shape{m}, DType::kFloat32), View(tpSum.data(), Shape{m}, DType::kFloat32), {});
    before();
    auto dpWork = dp->allGather(View(in.data(), Shape{m}, DType::kFloat32), View(dpGathered.data(), Shape{m * dp->size()}, DType::kFloat32), {});
    done(detail::concat("tp.allReduce.", step), std::move(tpWork), tpSum);
    done(detail::concat("dp.allGather.", step), std::move(dpWork), dpGathered);
  }
}

int runDriver(int argc, char** argv) {
  if (argc < 2) {
    std::fputs("usage: world_driver SIZE [TIMEOUT_MS [FAULT...]]\n", stderr);
    return 2;
  }
  WorldOptions options;
  options.size = std::stoi(argv[1]);
  options.threads = 1;
  if (argc > 2) options.timeout = std::chrono::milliseconds(std::stoi(argv[2]));
  std::vector<Extra> extras;
  for (int i = 3; i < argc; ++i) {
    const std::string spec = argv[i];
    const std::size_t colon = spec.rfind(':');
    const std::string kind = spec.substr(colon + 1);
    if (kind == "kill" || kind == "exit") {
      Fault f = parseFault(spec.substr(0, colon) + ":skip");
      extras.push_back(Extra{f.rank, f.collective, kind == "kill"});
    } else {
      options.faults.push_back(parseFault(spec));
    }
  }

  std::unique_ptr<mpi::Session> session;
  std::unique_ptr<World> world;
  if (mpi::Session::launched()) {
    session = std::make_unique<mpi::Session>();
    const std::string error = mpi::placementError(options.size, session->processes());
    if (!error.empty()) {
      const std::string message = detail::concat("process ", session->process(), ": exit 2: ", error, "\n");
      std::fwrite(message.data(), 1, message.size(), stderr);
      session->finish(2, options.timeout);
      return 2;
    }
    world = session->makeWorld(options);
  } else {
    world = std::make_unique<sim::World>(options);
  }
  const int process = session ? session->process() : 0;
  Printer out;
  int code = 0;
  try {
    world->run([&](RankContext& ctx) { program(ctx, out, extras); });
  } catch (const WorldError& e) {
    // One write, so that the launcher does not interleave it with another process's.
    const std::string message = detail::concat("process ", process, ": exit 3: ", e.what(), "\n");
    std::fwrite(message.data(), 1, message.size(), stderr);
    code = 3;
  }
  std::string lines;
  for (const std::string& line : out.lines) lines += line + "\n";
  std::fwrite(lines.data(), 1, lines.size(), stdout);
  std::fflush(stdout);
  world.reset();
  if (session) session->finish(code, options.timeout);
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return runDriver(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "world_driver: %s\n", e.what());
    return 2;
  }
}
