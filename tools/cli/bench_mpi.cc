// tpsim bench --what mpi: the cross-process transport of mpi::Session against the MPI library's own
// collectives, on the same processes in the same run, under an MPI launcher (docs/distributed.md).
// Built only with MPI (tools/cli/bench_mpi.h).
#include "tools/cli/bench_mpi.h"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <vector>

#include "backends/errors.h"
#include "backends/mpi/session.h"
#include "tools/lib/backend.h"
#include "tools/lib/job.h"

namespace tpsim::tools {
namespace {

using Clock = std::chrono::steady_clock;

enum class Op { kAllReduce, kAllGather, kReduceScatter, kBroadcast };

struct Case {
  Op op;
  const char* name;
  const char* mpiName;
  double busFactor;  // busbw / algbw, nccl-tests' factors
};

struct Counts {
  std::int64_t in, out, block;
};

Counts countsOf(Op op, std::int64_t count, int p) {
  const std::int64_t block = count / p;
  return {op == Op::kAllGather ? block : count, op == Op::kReduceScatter ? block : count, block};
}

// Output elements that differ from the closed form: rank r's input is r + 1 everywhere, broadcast's
// root is rank 0.
long wrongOf(Op op, const float* y, const Counts& n, int p) {
  const float sum = float(p * (p + 1) / 2);
  long wrong = 0;
  for (std::int64_t i = 0; i < n.out; ++i) {
    const float expect = op == Op::kAllReduce || op == Op::kReduceScatter ? sum
                         : op == Op::kBroadcast                          ? 1.f
                                                                         : float(i / n.block + 1);
    wrong += y[i] != expect;
  }
  return wrong;
}

// Each process's times, iteration by iteration, made the slowest process's, then their median.
double medianOfSlowest(mpi::Session& session, std::vector<double> seconds) {
  session.serialized([&] {
    MPI_Allreduce(MPI_IN_PLACE, seconds.data(), int(seconds.size()), MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  });
  std::sort(seconds.begin(), seconds.end());
  const std::size_t n = seconds.size();
  return n % 2 ? seconds[n / 2] : (seconds[n / 2 - 1] + seconds[n / 2]) / 2;
}

struct Measured {
  double seconds = 0;  // median over iterations of the slowest process
  long wrong = 0;      // this process's wrong output elements
};

// One rank per process, so that every collective crosses processes. Each iteration: a barrier, then
// one collective timed until its output is ready.
Measured sessionCollective(mpi::Session& session, Op op, const Counts& n, int iters) {
  WorldOptions o;
  o.size = session.processes();
  o.threads = 1;
  std::unique_ptr<World> world = session.makeWorld(o);
  std::vector<double> seconds(std::size_t(iters), 0);
  Measured m;
  runWorld(*world, [&](RankContext& ctx) {
    Tensor in = ctx.compute.empty({n.in}, DType::kFloat32);
    Tensor out = ctx.compute.empty({n.out}, DType::kFloat32);
    ctx.compute.fill(in, ctx.comm.rank() + 1);
    auto issue = [&] {
      switch (op) {
        case Op::kAllReduce: return ctx.comm.allReduce(in, out);
        case Op::kAllGather: return ctx.comm.allGather(in, out);
        case Op::kReduceScatter: return ctx.comm.reduceScatter(in, out);
        case Op::kBroadcast: break;
      }
      return ctx.comm.broadcast(in, out);
    };
    issue()->wait();  // warm-up: pages in the buffers
    for (int i = 0; i < iters; ++i) {
      ctx.comm.barrier()->wait();
      const auto start = Clock::now();
      issue()->wait();
      seconds[std::size_t(i)] = std::chrono::duration<double>(Clock::now() - start).count();
    }
    m.wrong = wrongOf(op, out.view().typed<float>(), n, ctx.comm.size());
  });
  m.seconds = medianOfSlowest(session, std::move(seconds));
  return m;
}

// The same collective through the MPI library, on MPI_COMM_WORLD, the same way.
Measured mpiCollective(mpi::Session& session, Op op, const Counts& n, int iters) {
  std::vector<double> seconds(std::size_t(iters), 0);
  Measured m;
  session.serialized([&] {
    int rank = 0, p = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &p);
    std::vector<float> in(std::size_t(n.in), float(rank + 1)), out(std::size_t(n.out), float(rank + 1));
    auto issue = [&] {
      switch (op) {
        case Op::kAllReduce:
          MPI_Allreduce(in.data(), out.data(), int(n.out), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
          break;
        case Op::kAllGather:
          MPI_Allgather(in.data(), int(n.block), MPI_FLOAT, out.data(), int(n.block), MPI_FLOAT, MPI_COMM_WORLD);
          break;
        case Op::kReduceScatter:
          MPI_Reduce_scatter_block(in.data(), out.data(), int(n.block), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
          break;
        case Op::kBroadcast: MPI_Bcast(out.data(), int(n.out), MPI_FLOAT, 0, MPI_COMM_WORLD); break;
      }
    };
    issue();
    for (int i = 0; i < iters; ++i) {
      MPI_Barrier(MPI_COMM_WORLD);
      const auto start = Clock::now();
      issue();
      seconds[std::size_t(i)] = std::chrono::duration<double>(Clock::now() - start).count();
    }
    m.wrong = wrongOf(op, out.data(), n, p);
  });
  m.seconds = medianOfSlowest(session, std::move(seconds));
  return m;
}

// Every process's count, summed on every process.
long total(mpi::Session& session, long mine) {
  session.serialized([&] { MPI_Allreduce(MPI_IN_PLACE, &mine, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD); });
  return mine;
}

}  // namespace

long benchMpi(long long minBytes, long long maxBytes, int iters) {
  mpi::Session* session = jobSession();
  TPSIM_INTERNAL_ASSERT(session && session->processes() > 1, "benchMpi outside an MPI job");
  const int p = session->processes();
  std::printf("\n# Cross-process collectives on %d MPI processes, one rank each: mpi::Session (a simulated world\n", p);
  std::printf("# spread over them) against the MPI library's own collectives, same processes, same run\n");
  std::printf("# fp32; size = bytes of the larger buffer per rank; time = median of %d iterations, each a barrier\n",
              iters);
  std::printf("# then one collective, timed on every process, the slowest process's time counting\n");
  std::printf("# busbw (GB/s, 4 digits) = size / time · factor: 2(P-1)/P allReduce, (P-1)/P allGather and reduceScatter, 1 broadcast\n");
  std::printf("# ratio = session time / MPI time; #wrong: output elements (session and MPI) off the closed form\n");
  const Case cases[] = {{Op::kAllReduce, "allReduce", "MPI_Allreduce", 2.0 * (p - 1) / p},
                        {Op::kAllGather, "allGather", "MPI_Allgather", double(p - 1) / p},
                        {Op::kReduceScatter, "reduceScatter", "MPI_Reduce_scatter_block", double(p - 1) / p},
                        {Op::kBroadcast, "broadcast", "MPI_Bcast", 1.0}};
  long allWrong = 0;
  for (const Case& c : cases) {
    std::printf("# %s vs %s\n", c.name, c.mpiName);
    std::printf("#%12s %12s %6s %6s %12s %10s %12s %10s %8s %7s\n", "size", "count", "type", "redop", "session",
                "busbw", "mpi", "busbw", "ratio", "#wrong");
    std::printf("#%12s %12s %6s %6s %12s %10s %12s %10s %8s %7s\n", "(B)", "(elements)", "", "", "(us)", "(GB/s)",
                "(us)", "(GB/s)", "", "");
    const bool reduces = c.op == Op::kAllReduce || c.op == Op::kReduceScatter;
    for (long long bytes = minBytes; bytes <= maxBytes; bytes *= 4) {
      const std::int64_t count = bytes / 4 / p * p;  // divisible by P for the blocked collectives
      const Counts n = countsOf(c.op, count, p);
      const Measured ours = sessionCollective(*session, c.op, n, iters);
      const Measured theirs = mpiCollective(*session, c.op, n, iters);
      const long wrong = total(*session, ours.wrong + theirs.wrong);
      allWrong += wrong;
      const double size = double(count) * 4;
      auto busbw = [&](double seconds) { return size / seconds / 1e9 * c.busFactor; };
      std::printf(" %12.0f %12lld %6s %6s %12.1f %10.4g %12.1f %10.4g %7.2fx %7ld\n", size, (long long)count, "float",
                  reduces ? "sum" : "none", ours.seconds * 1e6, busbw(ours.seconds), theirs.seconds * 1e6,
                  busbw(theirs.seconds), ours.seconds / theirs.seconds, wrong);
      std::fflush(stdout);
    }
  }
  return allWrong;
}

}  // namespace tpsim::tools
