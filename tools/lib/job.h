// The MPI job a launcher (mpirun, srun) started this process in, where the build has MPI: `tpsim
// run` then spreads its world over the job's processes, and process 0 gathers the ranks' results,
// verifies, writes and prints (docs/distributed.md). Without a launcher: process 0 of 1.
#pragma once

#include <chrono>
#include <exception>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "backends/world.h"
#include "tools/lib/host_tensor.h"

namespace tpsim {
class CheckpointWriter;  // tools/lib/checkpoint_files.h
namespace mpi {
class Session;
}
namespace tools {
struct RankRecord;  // tools/lib/trace.h
}
}  // namespace tpsim

namespace tpsim::tools {

// Joins the job when a launcher started this process; once, from main, before any command.
void joinJob();
int jobProcess();
int jobProcesses();
// The job's processes on this machine (MPI_COMM_TYPE_SHARED), this one included.
int jobLocalProcesses();
// Whether this process runs rank `rank` of a world of `size` ranks spread over the job (makeJobWorld).
bool jobRuns(int rank, int size);
// The job's session (backends/mpi/session.h); nullptr without a launcher or without MPI in the build.
mpi::Session* jobSession();
// Ends this process's part of the job with the command's exit code, returned (mpi::Session::finish).
int leaveJob(int code);

// A failure another process of the job met before its world started, or after its ranks were done
// (agreeToRun): its exit code and its message, "process P: ...".
struct JobRefusal : std::runtime_error {
  JobRefusal(int exitCode, const std::string& message) : std::runtime_error(message), code(exitCode) {}
  int code;
};
// Every process's failure before its world starts (and after its ranks are done), agreed at the same
// point in each: `mine` is this process's (null for none), `code` and `message` its exit code and
// line. Where any process failed, each rethrows its own, and each that did not throws JobRefusal
// with the first failed process's. A process that failed alone (its machine's memory, a file only
// it reads) would otherwise leave the others waiting in the world's first collective until their
// timeout. Waits at most `timeout`: where another process never comes, this one rethrows its own
// failure, or throws the wait's.
void agreeToRun(std::exception_ptr mine, int code, const std::string& message, std::chrono::milliseconds timeout);

// Process 0 gets every process's `mine`, in process order; the others get nothing. Every process
// calls it at the same point; each waits at most `timeout`.
std::vector<std::string> gatherJob(std::string mine, std::chrono::milliseconds timeout);
// Every process gets every process's `mine`, in process order (gathered to process 0, then sent on).
std::vector<std::string> allGatherJob(std::string mine, std::chrono::milliseconds timeout);
// Sends `part` to process `to`; the next part process `from` sent this one, waited for at most
// `timeout` (parts from one process to another come in the order sent).
void sendToProcess(int to, std::string part);
std::string receiveFromProcess(int from, std::chrono::milliseconds timeout);

// Throws UsageError (exit 2) when a world of `size` ranks on `backend` does not fit this job: the
// simulator's ranks must spread evenly over the processes, the GPU backend's be one per process
// (under a launcher, even of one process).
void checkJobPlacement(const std::string& backend, int size);
// makeWorld, spread over the job's processes: the simulator's when there are several, the GPU
// backend's (one rank per process, one GPU each) under any launcher. Throws UsageError (exit 2)
// as checkJobPlacement does, and when the backend cannot run here.
std::unique_ptr<World> makeJobWorld(const std::string& backend, const WorldOptions& options);
// After a run on a makeJobWorld world: on process 0, every rank's results, trace and records (none
// when `records` is empty), which only the process that ran a rank filled, and with `checkpoint` the
// chunks every process's ranks added to theirs; elsewhere unchanged. Waits at most `timeout` for
// the processes.
void gatherRanks(std::vector<std::map<std::string, StoredTensor>>& results, std::vector<std::vector<TraceEvent>>& trace,
                 std::vector<RankRecord>& records, CheckpointWriter* checkpoint, std::chrono::milliseconds timeout);

}  // namespace tpsim::tools
