// tpsim: the command line. Subcommand first (`tpsim demo`, `tpsim bench`), then its options.
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <exception>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <string>
#include <vector>

#include "tools/lib/backend.h"
#include "tools/lib/job.h"
#include "tools/cli/cli.h"
#include "tools/lib/layout.h"
#include "tpsim_config.h"

namespace {

const char* kUsage =
    "tpsim " TPSIM_VERSION ": Megatron-Core tensor-parallel sharding, simulated\n"
    "\n"
    "usage: tpsim <command> [options]\n"
    "\n"
    "commands:\n"
    "  demo    an MLP block (column fc1, GeLU, row fc2) at TP=4 with sequence parallelism, verified\n"
    "  run     one layer sharded on your own tensors (.npy) or generated ones, verified\n"
    "  layout  every tensor of a layer drawn as the blocks each rank holds: padding, copies, partial\n"
    "          sums, pad counts and the duplicate filters' choice (text, or an SVG page with --svg)\n"
    "  bench   simulator overheads: tiny-collective latency, collective bandwidth, GEMM throughput;\n"
    "          with --backend gpu: the layers against cuBLASLt and PyTorch, DeviceFabric bandwidth;\n"
    "          under mpirun, --what mpi: collectives across the processes against MPI's own\n"
    "  checkpoint inspect DIR: the keys, shapes, chunks and writers of a `run --save-checkpoint`;\n"
    "          checkpoint consolidate DIR FILE.safetensors: its tensors unsharded in one file\n"
    "  devices the backends this build has (sim, gpu) and whether each can run here, with the reason\n"
    "\n"
    "'tpsim <command> --help' lists a command's options; 'tpsim --version' the build.\n"
    "\n";

// Freed memory stays in the process for the next allocation. A command allocates tensors of tens of
// MiB, frees them and allocates again, and a first touch of a fresh page costs 40-80x its reuse on
// a virtual machine (1.2-3.7 s a GiB against 0.04): large blocks come from the heap, not from mmaps
// of their own that free unmaps, and the heap is not trimmed. oneHeap: all threads share one heap,
// for run and demo, whose reference (on the calling thread) then reuses what the ranks' threads
// freed: its verification of docs/benchmarks.md's MLP takes 1.5 s instead of 2.4. The benchmarks
// keep a heap per thread, as tiny steps of many ranks contend for one (0.23 ms per T = 8 step of
// the 64 x 32 x 128 block becomes 0.39).
void keepFreedMemory(bool oneHeap) {
#if defined(__GLIBC__)
  mallopt(M_MMAP_MAX, 0);
  mallopt(M_TRIM_THRESHOLD, INT_MAX);
  if (oneHeap) mallopt(M_ARENA_MAX, 1);
#else
  (void)oneHeap;
#endif
}

// What a command prints is part of its result: output lost on stdout (a full disk, /dev/full) fails
// the command with exit 2, as an output file that cannot be written does, unless it already failed.
int checkStdout(const std::string& command, int code) {
  const bool flushed = std::fflush(stdout) == 0;
  const int error = errno;
  if (flushed && !std::ferror(stdout)) return code;
  const std::string prefix = tpsim::tools::isCommand(command) ? "tpsim " + command : "tpsim";
  std::fprintf(stderr, "%s: standard output: expected every line written, got '%s'\n", prefix.c_str(),
               flushed ? "an error on an earlier write" : std::strerror(error));
  return code == 0 ? 2 : code;
}

int runCommand(const std::string& command, const std::vector<std::string>& args) {
  keepFreedMemory(command == "run" || command == "demo");
  try {
    if (command == "demo") return tpsim::tools::demoMain(args);
    if (command == "bench") return tpsim::tools::benchMain(args);
    if (command == "run") return tpsim::tools::runMain(args);
    if (command == "layout") return tpsim::tools::layoutMain(args);
    if (command == "checkpoint") return tpsim::tools::checkpointMain(args);
    if (command == "devices") {
      if (args.size() == 1 && (args[0] == "--help" || args[0] == "-h")) {
        std::puts("tpsim devices: the backends this build has and whether each can run here (exit 0 either way)");
        return 0;
      }
      if (!args.empty()) throw tpsim::tools::UsageError{"devices takes no arguments, got '" + args[0] + "'"};
      std::fputs(tpsim::tools::backendReport().c_str(), stdout);
      return 0;
    }
    throw tpsim::tools::UsageError{"unknown command '" + command + "'"};
  } catch (...) {
    const tpsim::tools::CommandFailure failure = tpsim::tools::failureOf(command, std::current_exception());
    std::fputs(failure.text.c_str(), stderr);
    return failure.code;
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "-h" || args[0] == "--help" || args[0] == "help") {
    std::fputs(kUsage, args.empty() ? stderr : stdout);
    std::fputs(tpsim::tools::kExitCodes, args.empty() ? stderr : stdout);
    return checkStdout("", args.empty() ? 2 : 0);
  }
  if (args[0] == "--version") {  // what a benchmark figure or a bug report needs to know about this binary
    std::printf("tpsim %s\nisa: %s\ngpu backend: %s\n", TPSIM_VERSION, TPSIM_ISA,
                TPSIM_HAVE_GPU ? "built" : "not built");
    return checkStdout("", 0);
  }
  const std::string command = args[0];
  args.erase(args.begin());
  // Under an MPI launcher every process runs the command on its share of the ranks; process 0 alone
  // prints the report (docs/distributed.md). Errors still come from every process, on stderr.
  tpsim::tools::joinJob();
  if (tpsim::tools::jobProcess() != 0 && !std::freopen("/dev/null", "w", stdout)) return 2;
  return tpsim::tools::leaveJob(checkStdout(command, runCommand(command, args)));
}
