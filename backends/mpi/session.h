// mpi::Session: a world spread over the processes of an MPI job (mpirun -np P, srun -n P).
//
// Each process runs a contiguous block of the world's ranks on its own rendezvous (the simulator's:
// fibers, host memory). A collective whose group spans processes is matched among the local
// members; then each process of the group sends the others its part, the fingerprint its members
// issued and their inputs, and every process computes its members' outputs with the simulator's
// own code from all the inputs, so the results are bitwise those of one process. A failure in one
// process (a mismatch, a failed rank, a timeout) reaches every other one, and every process's
// run() throws the same WorldError. The GPU backend plugs NCCL in through spread(): one rank per
// process, the parts then carry fingerprints only and NCCL moves the data. docs/distributed.md.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backends/world.h"
#include "backends/world/rendezvous.h"

namespace tpsim::mpi {

// Which process runs `rank` of a world of `size` ranks spread over `processes`: contiguous blocks
// of size / processes ranks, process p running ranks [p·size/P, (p+1)·size/P).
int processOf(int rank, int size, int processes);
// Why a world of `size` ranks cannot spread over `processes` ("" when it can): each process needs
// the same number of ranks.
std::string placementError(int size, int processes);

class Session {
 public:
  // Whether an MPI launcher (mpirun, mpiexec, srun) started this process.
  static bool launched();

  // Joins the job (MPI_Init_thread). One per process, before any world, never remade.
  Session();
  // Finalizes MPI unless finish() ended the process already.
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  int process() const;
  int processes() const;
  // This process's place among the job's processes on its machine (MPI_COMM_TYPE_SHARED): which of
  // the machine's GPUs it takes.
  int localProcess() const;
  int localProcesses() const;

  // A world of options.size ranks over every process of the job; each process calls it in the same
  // order with the same options. Throws Error (placementError) when the ranks do not spread evenly.
  std::unique_ptr<World> makeWorld(const WorldOptions& options);
  // What a world of `size` ranks over every process of the job gives its rendezvous: `local` moves
  // the data of this process's members (makeWorld's: the simulator's host copies), the session
  // matches and fails across processes. Each process calls it in the same order.
  std::shared_ptr<world::Transport> spread(std::shared_ptr<world::Transport> local, int size);

  // Process 0 gets every process's `mine`, by process; the others send theirs and get nothing.
  // Every process calls it at the same point. Throws Error when a part has not come within `timeout`.
  std::vector<std::string> gather(std::string mine, std::chrono::milliseconds timeout);
  // Every process gets process 0's `fromProcess0` (the others' is ignored). Every process calls it
  // at the same point. Throws Error when it has not come within `timeout`.
  std::string broadcast(std::string fromProcess0, std::chrono::milliseconds timeout);

  // Sends `part` to process `to`, which takes it with receive(): parts from one process to another
  // are taken in the order sent. Returns at once; the session's thread sends it.
  void send(int to, std::string part);
  // The next part process `from` sent this one. Throws Error when it has not come within `timeout`.
  std::string receive(int from, std::chrono::milliseconds timeout);

  // Runs `fn` on the one thread that makes this process's MPI calls (MPI_THREAD_SERIALIZED), between
  // its polls, and returns once fn has, rethrowing what it threw: how a caller makes MPI calls of its
  // own, on a communicator other than the session's. While fn blocks in MPI, the session's messages
  // wait; call it between a world's runs.
  void serialized(const std::function<void()>& fn);

  // Ends the job from this process with `exitCode`: waits at most `timeout` for every process to
  // get here (none then ends while another still prints its report), finalizes MPI and returns.
  // When a process never comes (killed, hung), this one exits with exitCode without finalizing,
  // and Open MPI's launcher ends the job.
  void finish(int exitCode, std::chrono::milliseconds timeout);

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace tpsim::mpi
