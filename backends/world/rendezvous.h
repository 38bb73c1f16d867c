// Rendezvous: the part of a world that every backend shares; only the data movement differs.
//
// It runs one SPMD function on N ranks (each on a fiber, a few worker threads running whichever
// fibers are ready), matches the collectives they issue by per-group sequence number, and turns
// every failure (a mismatch, a deadlock, a failed rank, a timeout, a dropped Work, a transport
// error) into the same CollectiveError on every rank and a WorldError from run(). It moves no data:
// once every member of a collective has issued it, a Transport moves (or enqueues) the data.
// sim::World plugs in host copies and rank-order sums; gpu::World device kernels or NCCL.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backends/collectives.h"
#include "backends/compute.h"
#include "backends/world.h"

namespace tpsim::world {

enum class OpKind : std::uint8_t { kAllReduce, kAllGather, kReduceScatter, kBroadcast, kAllToAll,
                                   kBarrier, kSplit };
const char* opName(OpKind kind);

// Whatever a transport attaches to one rank's part of a collective (a CUDA event, say).
using TransportToken = std::shared_ptr<void>;

// Where a member of a split goes (kSplit only): the group of its color, ordered by (key, parent
// rank), or none for a negative color.
struct SplitPlace {
  int color = -1;
  int key = 0;
  std::string id;  // the new group's id; "" for none
  int rank = -1;   // the member's rank in it
  int size = 0;
};

// One collective that every member has issued, as its transport sees it. Vectors are indexed by
// group rank. Buffers follow collectives.h's contracts; the fingerprint checks guarantee that every
// member passed the same dtype, counts, reduce op and root.
struct Collective {
  OpKind kind = OpKind::kBarrier;
  DType dtype = DType::kFloat32;
  std::int64_t inCount = 0;   // elements of each member's input
  std::int64_t outCount = 0;  // elements of each member's output
  ReduceOp reduce = ReduceOp::kSum;
  int root = 0;
  std::vector<int> globalRanks;
  std::string group;          // "tp[0,1]"
  std::string id;             // the same in every process: "w" for the world, a split's "w.3.1"
  std::uint64_t seq = 0;
  std::vector<ConstView> in;
  std::vector<View> out;
  std::vector<TransportToken> issued;  // what Transport::issued returned for each member
  // A reduction begun with Transport::fold: the sum of members [0, foldedCount) (their inputs are
  // gone) in `folded`; the other members' inputs are in `in`.
  TransportToken folded;
  int foldedCount = 0;
  std::vector<SplitPlace> split;       // kSplit: where each member goes
};

// What a transport whose world spans processes reports back to the rendezvous, from its own thread.
class PeerSink {
 public:
  virtual ~PeerSink() = default;
  // Every peer process's part of exchange `key`, in the order of the processes exchange() named.
  virtual void delivered(const std::string& key, std::vector<std::string> parts) = 0;
  // A peer's world failed: kind, the message every rank's CollectiveError carries, and the failed
  // rank with its error when a rank's own exception was the cause (rank -1 otherwise).
  virtual void peerFailed(CollectiveFailure kind, const std::string& message, int rank,
                          const std::string& rankError) = 0;
  // Every peer process's ranks have returned from this run.
  virtual void peersFinished() = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;

  // Where collective buffers must live; checked when a rank issues.
  virtual Device device() const = 0;
  // Whether this process's members may all read one buffer: then the members of an allGatherShared
  // get one output tensor, made by the first to issue, and execute() sees that buffer as each
  // local member's out (a transport must tolerate outputs that alias each other).
  virtual bool sharesMemory() const { return false; }
  // Rank `globalRank` issues a collective; runs on its fiber. The token reaches execute().
  virtual TransportToken issued(int globalRank) {
    (void)globalRank;
    return nullptr;
  }
  // Whether a reduction's members may be added up as they arrive (fold()), so that an input a member
  // gave up (Collectives::reduceScatterConsuming) is freed once added, not when the last member
  // arrives: a world's partial sums are then not all held at once.
  virtual bool foldsReductions() const { return false; }
  // Adds member c.foldedCount's input c.in[c.foldedCount] to c.folded, the sum of the members before
  // it (null when it is the first), and returns the new sum. Runs under the rendezvous lock.
  virtual TransportToken fold(const Collective& c) {
    (void)c;
    return nullptr;
  }
  // Every member has issued c: move its data, or enqueue the movement after every member's issue
  // token. Runs once, under the rendezvous lock, on the last member's fiber. The token returned
  // reaches completed(). A throw fails the world with CollectiveFailure::kBackend.
  virtual TransportToken execute(const Collective& c) = 0;
  // c is complete and globalRank's wait() returns next, or the rank dropped its Work unwaited:
  // order the rank's later work after it. Never blocks (a Work's destructor may call it).
  virtual void completed(int globalRank, const TransportToken& done) {
    (void)globalRank;
    (void)done;
  }
  // Every member has issued split c (c.split says where each goes): make the transport's side of
  // the new groups (NCCL: their communicators). Runs like execute(); a throw fails the world.
  virtual void split(const Collective& c) { (void)c; }
  // The world failed: abandon transfers in flight (NCCL: abort the communicators) so that nothing
  // waits on them. Called once, under the rendezvous lock.
  virtual void abort() {}

  // A world spread over processes runs only this process's ranks here. A collective whose group
  // spans processes is matched among the local members, then each process of the group sends its
  // part (fingerprint, local inputs) to the others through exchange(); every process computes its
  // members' outputs from all the inputs with execute(), so results do not depend on the spread.
  virtual int processOf(int globalRank) const {
    (void)globalRank;
    return 0;
  }
  virtual int process() const { return 0; }
  // Whether the transport moves data between processes itself (NCCL, one rank per process). Then
  // exchanges carry fingerprints only, and once every process agreed, execute() (barriers included)
  // and split() get the collective with only this process's members' buffers (the others' views
  // are empty), in the order this process's ranks issued them (one rank per process: each
  // collective once its last local member issued it), so that every process enqueues them in one
  // order, as NCCL requires.
  virtual bool carriesPeerData() const { return false; }
  // One run() begins (a sink) or ends (null).
  virtual void attach(std::shared_ptr<PeerSink> sink) { (void)sink; }
  // Sends `part` to `processes` and delivers theirs under the same key. Never blocks.
  virtual void exchange(const std::string& key, const std::vector<int>& processes, std::string part) {
    (void)key;
    (void)processes;
    (void)part;
  }
  // This process's world failed (not on a peer's word): tell every peer. Never blocks.
  virtual void failed(CollectiveFailure kind, const std::string& message, int rank, const std::string& rankError) {
    (void)kind;
    (void)message;
    (void)rank;
    (void)rankError;
  }
  // Every rank of this process returned: tell every peer. Never blocks.
  virtual void finished() {}
};

// "0-3,5,7": a compact list of ranks, as the fabric names groups ("tp[0-3]") in its messages.
std::string rankList(const std::vector<int>& ranks);

class Rendezvous {
 public:
  // `name` prefixes the fabric's messages ("sim: deadlock: ..."). Validates the options.
  Rendezvous(std::string name, WorldOptions options);
  ~Rendezvous();
  Rendezvous(const Rendezvous&) = delete;
  Rendezvous& operator=(const Rendezvous&) = delete;

  const WorldOptions& options() const;

  // Runs fn on every rank r with computes[r] and a world communicator over `transport`; the
  // World::run contract (backends/world.h). Shared ownership: a rank abandoned after a failure
  // may still be using them when run() returns.
  void run(const std::function<void(RankContext&)>& fn, const std::vector<std::shared_ptr<Compute>>& computes,
           const std::shared_ptr<Transport>& transport);

  const std::vector<std::vector<TraceEvent>>& trace() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tpsim::world
