// How much memory a `tpsim run` will take at its peak, estimated from its configuration and input
// shapes before any tensor is allocated, and how much this machine has to give it.
//
// The estimate is a sum of what holds memory at the peak (the global tensors as doubles, every
// rank's copies and shards, the verifier's double-precision working set), each term's bytes per
// element measured so that it errs high: within 1.3 times the peak where the ranks' copies dominate
// (tests/memory_estimate_test.cc), not an accounting of every allocation (docs/memory.md).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "tools/lib/runner.h"

namespace tpsim::tools {

// What a --load-checkpoint reads into memory at once (CheckpointIndex): the chunks the pieces cut
// from its keys overlap (CheckpointIndex::chunkCacheBytes of pieces of kInputPieceElements), and its
// largest chunk, which each rank's load reads whole.
struct CheckpointBuffers {
  bool loaded = false;
  double cacheBytes = 0, chunkBytes = 0;
};

// What a run does besides its configuration that its memory depends on: whether its results are
// read once it ends (verified, saved or returned; in a world spread over processes, otherwise no
// rank keeps them), and, where its world is spread over an MPI job (docs/distributed.md), the job's
// processes and whether this process holds the whole inputs and every result (process 0, when the
// results are read) or only its ranks' shards, and the checkpoint it loads; and, where the
// kind's reference splits (LayerKind::partResults), whether every process verifies its part, and
// whether this process is the first, which also gathers the results that do not split. The
// default: a run in one process whose results are read, with no checkpoint.
struct RunScope {
  bool resultsRead = true;
  int processes = 1;
  bool whole = true;
  CheckpointBuffers checkpoint;
  bool part = false, first = true;
};

// The peak resident memory, in bytes, of runSharded plus verify(`verify`) on inputs of `shapes`, in
// a process that runs `scope`'s share of the ranks.
double estimateRunBytes(const RunConfig& config, const ShapeMap& shapes, VerifyMode verify,
                        const RunScope& scope = {});

// What the kernel can give this process: MemAvailable from /proc/meminfo, or what is left under
// the cgroup's memory limit when that is lower. nullopt where neither can be read.
struct AvailableMemory {
  std::int64_t bytes = 0;
  std::string source;  // "MemAvailable in /proc/meminfo", ...
};
std::optional<AvailableMemory> availableMemory();

// Throws InvalidArgument, naming the flags, the estimate and the limit, when the estimate exceeds
// the memory available or `maxMemory` (--max-memory). `inputs` says where the shapes come from:
// "" for generated data (the size flags), or the --load directory. `resultsRead` as RunScope's. In
// a job of several processes (tools/lib/job.h) the estimate of the largest process (process 0
// holds the whole inputs and every result when they are read) is checked against --max-memory, and
// the sum over this machine's processes against what is available. `checkpoint` and `part` as
// RunScope's.
void checkMemory(const RunConfig& config, const ShapeMap& shapes, VerifyMode verify,
                 std::optional<std::int64_t> maxMemory, const std::string& loadDir, bool resultsRead = true,
                 const CheckpointBuffers& checkpoint = {}, bool part = false);

// 1536 -> "1.5 KiB", 3221225472 -> "3.0 GiB": a size for a message.
std::string bytesText(double bytes);

}  // namespace tpsim::tools
