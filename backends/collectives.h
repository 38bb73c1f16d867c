// Collectives: one rank's handle on one communication group, with asynchronous Work handles.
//
// The second interface between core/ and a backend (compute.h is the first). A Collectives object
// is what NCCL calls a communicator and c10d a ProcessGroup: a fixed, ordered set of global ranks
// seen from one of them. Every member must issue the same collectives on a group in the same
// order; backends match them by per-group sequence number and report a mismatch instead of
// hanging. Buffers are contiguous and flat: "along dim 0" below means the row-major element
// order, so a dim-0 concatenation is a concatenation of the flat buffers.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backends/errors.h"
#include "backends/tensor.h"
#include "backends/view.h"

namespace tpsim {

class Compute;

enum class ReduceOp : std::uint8_t { kSum, kMean };
const char* reduceOpName(ReduceOp op);

// 0 means "the communicator's default" (sim: WorldOptions::timeout).
using Timeout = std::chrono::milliseconds;

struct AllReduceOptions {
  ReduceOp op = ReduceOp::kSum;
  Timeout timeout{0};
};
struct ReduceScatterOptions {
  ReduceOp op = ReduceOp::kSum;
  Timeout timeout{0};
};
struct BroadcastOptions {
  int root = 0;  // rank within the group
  Timeout timeout{0};
};
struct CollectiveOptions {
  Timeout timeout{0};
};

// Why a collective failed. Every rank of the world sees the same kind and message.
enum class CollectiveFailure : std::uint8_t {
  kPeerFailed,   // another rank threw: "peer rank r failed: ..."
  kMismatch,     // ranks issued different collectives at the same sequence number
  kDeadlock,     // every live rank is blocked and none of the pending collectives can complete
  kTimeout,      // a collective waited longer than its timeout for a rank that never came
  kDroppedWork,  // a Work handle was destroyed without wait()
  kBackend,      // the communication library reported an error
  kStopped,      // the world's StopFlag was set (backends/stop.h)
};
const char* collectiveFailureName(CollectiveFailure kind);

class CollectiveError : public Error {
 public:
  CollectiveError(CollectiveFailure kind, const std::string& what) : Error(what), kind_(kind) {}
  CollectiveFailure kind() const { return kind_; }

 private:
  CollectiveFailure kind_;
};

// One in-flight collective. Ranks must issue collectives in the same order; backends match them
// by per-group sequence number (c10d ProcessGroupGloo collectiveCounter_).
class Work {
 public:
  virtual ~Work() = default;  // never throws; a Work destroyed before wait() is reported
  // Returns once work issued later on this rank may read the output. sim: parks this rank until
  // every member contributed. gpu: the compute stream waits on the communication event.
  // Throws CollectiveError on failure, mismatch, deadlock or timeout.
  virtual void wait() = 0;
  // Non-blocking poll: true once the result is ready or the collective failed.
  virtual bool isCompleted() = 0;
};

// Each op's in and out are disjoint or in its in-place form below; any other overlap is rejected,
// as NCCL and the DeviceFabric give it no defined result.
class Collectives {
 public:
  virtual ~Collectives() = default;

  virtual int rank() const = 0;  // rank within this group
  virtual int size() const = 0;
  // Global ranks of the members, indexed by group rank.
  virtual const std::vector<int>& globalRanks() const = 0;
  // Name given at creation ("world", "tp", ...), for messages and traces.
  virtual const std::string& label() const = 0;

  // out = Σ_r in_r (or the mean). in and out have the same dtype and element count; in-place if
  // in.data() == out.data().
  [[nodiscard]] virtual std::unique_ptr<Work> allReduce(ConstView in, View out,
                                                        const AllReduceOptions& opts = {}) = 0;
  // out = concat_0(in_0, ..., in_{n-1}): rank r's block is elements [r·c, (r+1)·c) of out, where
  // c = in.numel(). In-place if in.data() == out.data() + r·c.
  [[nodiscard]] virtual std::unique_ptr<Work> allGather(ConstView in, View out,
                                                        const CollectiveOptions& opts = {}) = 0;
  // allGather into a tensor of outShape (n·in.numel() elements, in's dtype) that its holders only
  // read, made by `compute`, the calling rank's. Members that share an address space may all get
  // one tensor (the simulator's ranks do): a copy a group instead of a copy a rank, so that what a
  // world gathers does not grow with its size. `out` is set before this returns and holds the
  // result once wait() has returned. Here: a tensor of the caller's own.
  [[nodiscard]] virtual std::unique_ptr<Work> allGatherShared(ConstView in, const Shape& outShape, Compute& compute,
                                                              SharedTensor& out, const CollectiveOptions& opts = {});
  // Rank r receives block r, elements [r·c, (r+1)·c) of Σ_q in_q, where c = out.numel() and
  // in.numel() = n·c. In-place if out.data() == in.data() + r·c.
  [[nodiscard]] virtual std::unique_ptr<Work> reduceScatter(ConstView in, View out,
                                                            const ReduceScatterOptions& opts = {}) = 0;
  // reduceScatter of an input the caller gives up (out must not lie in it): a backend may free it
  // once it has read it (the simulator adds the members' inputs up in rank order as they arrive), so
  // that a world's partial sums are not all held at once. Here: kept until wait() returns.
  [[nodiscard]] virtual std::unique_ptr<Work> reduceScatterConsuming(Tensor in, View out,
                                                                     const ReduceScatterOptions& opts = {});
  // out = in of the root on every rank; in is read on the root only. In-place if equal.
  [[nodiscard]] virtual std::unique_ptr<Work> broadcast(ConstView in, View out,
                                                        const BroadcastOptions& opts = {}) = 0;
  // Block q of rank r's out is block r of rank q's in; blocks are numel/n elements.
  [[nodiscard]] virtual std::unique_ptr<Work> allToAll(ConstView in, View out,
                                                       const CollectiveOptions& opts = {}) = 0;
  [[nodiscard]] virtual std::unique_ptr<Work> barrier(const CollectiveOptions& opts = {}) = 0;

  // Collective over this group (like ncclCommSplit / MPI_Comm_split): members with the same
  // color >= 0 form a new group ordered by (key, rank); color < 0 returns nullptr.
  virtual std::unique_ptr<Collectives> split(int color, int key, const std::string& label) = 0;

  // In-place forms.
  [[nodiscard]] std::unique_ptr<Work> allReduce(View inout, const AllReduceOptions& opts = {}) {
    return allReduce(inout, inout, opts);
  }

 protected:
  // reduceScatterConsuming's precondition: out lies outside the input given up.
  void checkOutsideConsumed(ConstView in, ConstView out) const;
};

}  // namespace tpsim
