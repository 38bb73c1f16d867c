// tpsim bench --what mpi: mpi::Session's cross-process collectives against the MPI library's on the
// same processes, built only with MPI (tools/cli/bench_mpi.cc). Process 0's stdout shows the table.
#pragma once

namespace tpsim::tools {

// Prints, for allReduce, allGather, reduceScatter and broadcast, sizes from minBytes to maxBytes by
// factors of 4, each the median of `iters` timed iterations; every process of the job (2 or more)
// calls it. Returns the wrong output elements over every process.
long benchMpi(long long minBytes, long long maxBytes, int iters);

}  // namespace tpsim::tools
