#include "backends/world/rendezvous.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>

#include "backends/stop.h"
#include "backends/threads.h"
#include "backends/wire.h"
#include "backends/world/fiber.h"

namespace tpsim::world {

const char* opName(OpKind kind) {
  switch (kind) {
    case OpKind::kAllReduce: return "allReduce";
    case OpKind::kAllGather: return "allGather";
    case OpKind::kReduceScatter: return "reduceScatter";
    case OpKind::kBroadcast: return "broadcast";
    case OpKind::kAllToAll: return "allToAll";
    case OpKind::kBarrier: return "barrier";
    case OpKind::kSplit: return "split";
  }
  return "unknown";
}

std::string rankList(const std::vector<int>& ranks) {
  std::string s;
  for (std::size_t i = 0; i < ranks.size();) {
    std::size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (!s.empty()) s += ",";
    s += std::to_string(ranks[i]);
    if (j > i) s += (j == i + 1 ? "," : "-") + std::to_string(ranks[j]);
    i = j + 1;
  }
  return s;
}

namespace {

using Clock = std::chrono::steady_clock;

// What must agree across the members of a collective for it to be "the same" collective.
struct Fingerprint {
  OpKind kind = OpKind::kBarrier;
  DType dtype = DType::kFloat32;
  std::int64_t inCount = 0;
  std::int64_t outCount = 0;
  ReduceOp reduce = ReduceOp::kSum;
  int root = 0;
  std::string label;  // split only

  bool operator==(const Fingerprint& o) const {
    return kind == o.kind && dtype == o.dtype && inCount == o.inCount && outCount == o.outCount &&
           reduce == o.reduce && root == o.root && label == o.label;
  }
  std::string str() const {
    const std::string t = std::string(dtypeName(dtype)) + " x";
    switch (kind) {
      case OpKind::kAllReduce:
        return detail::concat("allReduce(", reduceOpName(reduce), ", ", t, inCount, ")");
      case OpKind::kAllGather: return detail::concat("allGather(", t, inCount, " -> x", outCount, ")");
      case OpKind::kReduceScatter:
        return detail::concat("reduceScatter(", reduceOpName(reduce), ", ", t, inCount, " -> x", outCount, ")");
      case OpKind::kBroadcast: return detail::concat("broadcast(root ", root, ", ", t, outCount, ")");
      case OpKind::kAllToAll: return detail::concat("allToAll(", t, inCount, ")");
      // A barrier carries data only when an injected count or dtype fault gave it some.
      case OpKind::kBarrier:
        return inCount == 0 && dtype == DType::kFloat32 ? "barrier()" : detail::concat("barrier(", t, inCount, ")");
      case OpKind::kSplit: return detail::concat("split(\"", label, "\")");
    }
    return "unknown";
  }
};


struct GroupState {
  std::vector<int> globalRanks;  // by group rank
  std::string label;
  std::string id;                // the same in every process: "w" for the world, a split's "w.3.1"
  int localMembers = 0;          // members this process runs
  std::vector<int> peers;        // the other processes running members, ascending
  std::unordered_map<std::uint64_t, std::shared_ptr<struct Op>> pending;  // by sequence number
  std::string name() const { return label + "[" + rankList(globalRanks) + "]"; }
};

// One rank's place in one group: its group rank and the sequence number of its next collective.
struct Membership {
  std::shared_ptr<GroupState> group;
  int rank = 0;
  std::uint64_t nextSeq = 0;
};

// From g.globalRanks: how many members this process runs, and which other processes run the rest.
void place(GroupState& g, const Transport& transport) {
  g.localMembers = 0;
  g.peers.clear();
  for (int r : g.globalRanks) {
    const int p = transport.processOf(r);
    if (p == transport.process()) ++g.localMembers;
    else if (std::find(g.peers.begin(), g.peers.end(), p) == g.peers.end()) g.peers.push_back(p);
  }
  std::sort(g.peers.begin(), g.peers.end());
}

// What a rank with an injected op, count or dtype fault issues instead of fp on a group of n.
Fingerprint tampered(Fingerprint fp, FaultKind kind, int n) {
  const std::int64_t one = 1, many = n;
  switch (kind) {
    case FaultKind::kOp:
      switch (fp.kind) {
        case OpKind::kAllReduce: fp.kind = OpKind::kAllGather; fp.outCount = many * fp.inCount; break;
        case OpKind::kAllGather: fp.kind = OpKind::kAllReduce; fp.outCount = fp.inCount; break;
        case OpKind::kReduceScatter: fp.kind = OpKind::kAllGather; std::swap(fp.inCount, fp.outCount); break;
        default: fp.kind = OpKind::kAllReduce; fp.inCount = fp.outCount; fp.root = 0; break;
      }
      fp.reduce = ReduceOp::kSum;
      break;
    case FaultKind::kCount:
      fp.inCount += fp.kind == OpKind::kReduceScatter || fp.kind == OpKind::kAllToAll ? many : one;
      fp.outCount += fp.kind == OpKind::kAllGather || fp.kind == OpKind::kAllToAll ? many : one;
      break;
    case FaultKind::kDtype: fp.dtype = fp.dtype == DType::kFloat32 ? DType::kBFloat16 : DType::kFloat32; break;
    default: break;
  }
  return fp;
}

struct RankState;

struct Op {
  std::shared_ptr<GroupState> group;
  std::uint64_t seq = 0;
  Fingerprint fp;
  std::vector<Fingerprint> issued;  // per group rank, valid where arrived
  std::vector<char> arrived;        // per group rank
  int arrivedCount = 0;
  std::vector<ConstView> in;        // per group rank
  std::vector<View> out;
  std::vector<int> splitColor, splitKey;
  std::vector<std::pair<std::shared_ptr<GroupState>, int>> splitResult;  // per group rank
  bool done = false;
  bool faulty = false;              // a member's issue was altered by an injected fault: move no data
  bool exchanging = false;          // the local members have issued; the peer processes' parts are awaited
  bool agreed = false;              // every process's part arrived and matched (a transport carrying peer data)
  int abandonedBy = -1;             // a rank whose Work died during exception unwinding
  Clock::time_point firstArrival;
  Clock::duration timeout{};
  std::vector<RankState*> waiters;
  std::vector<TransportToken> tokens;  // per group rank: Transport::issued
  TransportToken doneToken;            // Transport::execute
  std::weak_ptr<Tensor> sharedOut;     // the output its allGatherShared members share
  // A reduction folded as its members arrive (Transport::fold): the inputs members gave up, by group
  // rank, each freed once it is in the sum of members [0, foldedCount).
  std::vector<Tensor> consumed;
  TransportToken folded;
  int foldedCount = 0;

  std::string describe() const {
    return detail::concat(fp.str(), " on ", group->name(), " (seq ", seq, ")");
  }
};

// kStalled: an injected stall; to the fabric the rank is busy outside collectives (no deadlock).
// kRemote: a rank a peer process runs.
enum class RankStatus : std::uint8_t { kReady, kRunning, kParked, kStalled, kFinished, kRemote };

struct RankState {
  int rank = 0;
  int worker = 0;
  std::unique_ptr<Fiber> fiber;
  RankStatus status = RankStatus::kReady;
  Op* parkedOn = nullptr;
  std::string error;  // what this rank's body threw
  Compute* compute = nullptr;
  std::unique_ptr<Collectives> world;
  std::vector<std::shared_ptr<Membership>> groups;  // the world group first, then each split's
  std::int64_t collectives = 0;                     // issued so far, splits not counted
  std::string stallWhat;                            // under an injected stall: the collective held back
  Clock::time_point stallDeadline;
};

// The request a stalling rank's fiber hands its worker; any other request is the Op it waits on.
char kStallRequest;

struct Worker {
  std::deque<RankState*> ready;
  std::atomic<int> readyHint{0};  // ready.size(), readable without the lock for spinning
  std::condition_variable cv;
  int unfinished = 0;
};

// The world's lock is held for microseconds at a time; a contended std::mutex would put the
// waiter to sleep in the kernel and cost a wake-up several times that. Spin on try_lock first.
// Tells a hyper-threaded core that this thread is only polling, so its sibling runs at speed.
inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

void lockSpinning(std::unique_lock<std::mutex>& lock) {
  for (int i = 0; i < 2000; ++i) {
    if (lock.try_lock()) return;
    cpuRelax();
  }
  lock.lock();
}

// An idle worker polls this long before it sleeps: a peer's collective usually completes within
// microseconds, and a condition-variable wake-up across threads costs more than that.
constexpr auto kSpinBeforeSleep = std::chrono::microseconds(50);

// The longest a thread waits for an earlier member of a folded reduction (SimCollectives::awaitFold).
constexpr auto kFoldWait = std::chrono::milliseconds(500);

class SimCollectives;

// Everything one run() shares between its ranks, its workers and the watchdog. Held by
// shared_ptr so that abandoned worker threads keep it alive.
struct RunState {
  WorldOptions options;
  std::function<void(RankContext&)> fn;
  std::mutex mu;
  std::condition_variable doneCv;  // run() waits here
  std::vector<std::unique_ptr<RankState>> ranks;
  std::vector<Worker> workers;
  int unfinished = 0;
  int running = 0;
  int readyCount = 0;
  int parked = 0;
  int stalled = 0;
  std::vector<std::string> injected;  // each injected fault that fired, for the failure's message
  std::vector<std::string> misplaced;  // corrupt faults that name no bit of their result, under mu
  // The first failure; after it every collective throws on every rank.
  bool failed = false;
  CollectiveFailure failureKind = CollectiveFailure::kPeerFailed;
  std::string failureMessage;
  int failedRank = -1;  // the rank whose own exception caused a kPeerFailed failure
  Clock::time_point failTime;
  std::map<std::pair<GroupState*, std::uint64_t>, std::shared_ptr<Op>> pendingOps;  // for watchdog/deadlock
  Clock::duration minTimeout;
  std::vector<std::vector<TraceEvent>> trace;
  std::string name;       // message prefix: "sim", "gpu"
  const StopFlag* stop = nullptr;  // the flag run()'s caller obeys; its workers obey it too
  // Shared with the world that owns them, so that an abandoned rank never outlives its compute.
  std::vector<std::shared_ptr<Compute>> computes;
  std::shared_ptr<Transport> transport;
  // A world spread over processes: the collectives whose peers' parts are awaited, by exchange key;
  // when this process's ranks have all returned; and whether every peer's have.
  std::map<std::string, std::shared_ptr<Op>> exchanges;
  // A transport carrying peer data: the collectives that await a peer, or one ahead of them, in the
  // order this process's ranks completed their issue.
  std::deque<std::shared_ptr<Op>> inOrder;
  bool finishSent = false;
  Clock::time_point finishTime;
  bool peersDone = false;
  std::string peerRankError;  // a kPeerFailed failure of a peer's rank: its error

  CollectiveError failureFor(int rank) const {
    if (failureKind == CollectiveFailure::kPeerFailed && rank == failedRank)
      return CollectiveError(failureKind, "rank " + std::to_string(rank) + " already failed");
    return CollectiveError(failureKind, failureMessage);
  }

  // Caller holds mu. Cancels every pending collective and wakes every parked rank; tells the peer
  // processes unless the failure came from one.
  void fail(CollectiveFailure kind, std::string message, int rank = -1, bool fromPeer = false) {
    if (failed) return;
    failed = true;
    failureKind = kind;
    failureMessage = std::move(message);
    failedRank = rank;
    failTime = Clock::now();
    transport->abort();
    if (!fromPeer) transport->failed(kind, failureMessage, rank, rank >= 0 ? ranks[rank]->error : "");
    exchanges.clear();
    inOrder.clear();
    for (auto& r : ranks)
      if (r->status == RankStatus::kParked || r->status == RankStatus::kStalled) wake(r.get());
    for (auto& entry : pendingOps) entry.second->group->pending.clear();  // breaks group <-> op cycles
    pendingOps.clear();
    doneCv.notify_all();
  }

  // Caller holds mu.
  void wake(RankState* r) {
    if (r->status == RankStatus::kStalled) {
      --stalled;
    } else if (r->status == RankStatus::kParked) {
      r->parkedOn = nullptr;
      --parked;
    } else {
      return;
    }
    r->status = RankStatus::kReady;
    ++readyCount;
    Worker& w = workers[r->worker];
    w.ready.push_back(r);
    w.readyHint.store(int(w.ready.size()), std::memory_order_relaxed);
    w.cv.notify_one();
  }

  std::string rankActivity(int rank) const {
    const RankState& r = *ranks[rank];
    switch (r.status) {
      case RankStatus::kFinished: return "finished";
      case RankStatus::kParked: return "waits on " + r.parkedOn->describe();
      case RankStatus::kStalled: return "stalls (an injected fault) before issuing " + r.stallWhat;
      case RankStatus::kRemote:
        return detail::concat("runs in process ", transport->processOf(rank),
                              ", whose part of it has not been received");
      default: return "is running (outside collectives)";
    }
  }

  std::string missingRanks(const Op& op) const {
    std::string s;
    for (std::size_t i = 0; i < op.arrived.size(); ++i) {
      if (op.arrived[i]) continue;
      const int g = op.group->globalRanks[i];
      s += detail::concat("\n    rank ", g, " has not issued it: it ", rankActivity(g));
    }
    return s;
  }

  // Caller holds mu. Called whenever a rank stops running; reports a deadlock at once.
  void checkDeadlock() {
    if (failed || running > 0 || readyCount > 0 || stalled > 0 || parked == 0) return;
    // A peer process may still complete an exchange; a deadlock across processes ends in a timeout.
    for (auto& r : ranks)
      if (r->status == RankStatus::kParked && r->parkedOn->exchanging) return;
    std::string msg = name + ": deadlock: every live rank is blocked and no pending collective can complete";
    for (auto& r : ranks) {
      if (r->status == RankStatus::kParked)
        msg += detail::concat("\n  rank ", r->rank, " waits on ", r->parkedOn->describe(),
                              r->parkedOn->abandonedBy >= 0
                                  ? detail::concat("; rank ", r->parkedOn->abandonedBy,
                                                   " abandoned it while unwinding an exception")
                                  : missingRanks(*r->parkedOn));
      else if (r->status == RankStatus::kFinished)
        msg += detail::concat("\n  rank ", r->rank, " finished");
    }
    fail(CollectiveFailure::kDeadlock, msg);
  }

  // Caller holds mu. Runs on the watchdog; fails the world when a collective waited too long.
  void checkTimeouts(Clock::time_point now) {
    for (auto& [key, op] : pendingOps) {
      if (now - op->firstArrival <= op->timeout) continue;
      auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(op->timeout).count();
      fail(CollectiveFailure::kTimeout,
           detail::concat(name, ": timeout: ", op->describe(), " waited more than ", ms,
                          " ms for its members", missingRanks(*op),
                          "\n  (raise WorldOptions::timeout or the collective's timeout option if the "
                          "rank is merely slow)"));
      return;
    }
    for (auto& r : ranks) {
      if (r->status != RankStatus::kStalled || now <= r->stallDeadline) continue;
      fail(CollectiveFailure::kTimeout,
           detail::concat(name, ": timeout: rank ", r->rank, " stalled (an injected fault) for more than ",
                          options.timeout.count(), " ms before issuing ", r->stallWhat));
      return;
    }
  }

  // The fault planned for `rank`'s k-th collective, or null.
  const Fault* faultAt(int rank, std::int64_t k) const {
    for (const Fault& f : options.faults)
      if (f.rank == rank && f.collective == k) return &f;
    return nullptr;
  }
};

// The members' split results (a rendezvous matter: no data moves). Caller holds mu.
void completeSplit(Op& op, const Transport& transport) {
  const int n = int(op.arrived.size());
  std::map<int, std::vector<int>> byColor;  // color -> parent ranks
  for (int r = 0; r < n; ++r)
    if (op.splitColor[r] >= 0) byColor[op.splitColor[r]].push_back(r);
  op.splitResult.assign(n, {nullptr, -1});
  for (auto& [color, members] : byColor) {
    std::stable_sort(members.begin(), members.end(),
                     [&](int a, int b) { return op.splitKey[a] < op.splitKey[b]; });
    auto group = std::make_shared<GroupState>();
    group->label = op.fp.label;
    group->id = detail::concat(op.group->id, ".", op.seq, ".", color);
    for (int m : members) group->globalRanks.push_back(op.group->globalRanks[m]);
    place(*group, transport);
    for (std::size_t i = 0; i < members.size(); ++i) op.splitResult[members[i]] = {group, int(i)};
  }
}

// What the transport sees of a collective every member has issued.
Collective collectiveOf(const Op& op) {
  Collective c;
  c.kind = op.fp.kind;
  c.dtype = op.fp.dtype;
  c.inCount = op.fp.inCount;
  c.outCount = op.fp.outCount;
  c.reduce = op.fp.reduce;
  c.root = op.fp.root;
  c.globalRanks = op.group->globalRanks;
  c.group = op.group->name();
  c.id = op.group->id;
  c.seq = op.seq;
  c.in = op.in;
  c.out = op.out;
  c.issued = op.tokens;
  c.folded = op.folded;
  c.foldedCount = op.foldedCount;
  for (std::size_t r = 0; r < op.splitResult.size(); ++r) {
    const auto& [group, rank] = op.splitResult[r];
    c.split.push_back(group ? SplitPlace{op.splitColor[r], op.splitKey[r], group->id, rank, int(group->globalRanks.size())}
                            : SplitPlace{op.splitColor[r], op.splitKey[r], "", -1, 0});
  }
  return c;
}

// Caller holds mu. op is done: its waiters run again in rank order, whatever order they parked in,
// so that they reach their next collective in about that order, the order a folded reduction adds
// inputs in (Transport::fold).
void wakeWaiters(RunState& run, Op& op) {
  std::sort(op.waiters.begin(), op.waiters.end(),
            [](const RankState* a, const RankState* b) { return a->rank < b->rank; });
  for (RankState* w : op.waiters) run.wake(w);
  op.waiters.clear();
}

// Caller holds mu. Adds the inputs members gave up to op's sum in rank order, from the first member
// not yet added while that member's input is given up, and frees each. False when the transport
// threw and the world failed.
bool foldArrived(RunState& run, Op& op) {
  const int n = int(op.arrived.size());
  while (op.foldedCount < n && op.consumed[std::size_t(op.foldedCount)].defined()) {
    try {
      op.folded = run.transport->fold(collectiveOf(op));
    } catch (const std::exception& e) {
      run.fail(CollectiveFailure::kBackend,
               detail::concat(run.name, ": ", op.describe(), " failed in the transport: ", e.what()));
      return false;
    }
    op.consumed[std::size_t(op.foldedCount)] = Tensor();
    op.in[std::size_t(op.foldedCount)] = ConstView();
    ++op.foldedCount;
  }
  return true;
}

// Caller holds mu. Every member of op issued it (and, spread over processes, every process agreed):
// make its split's groups, or have the transport move its data, then wake its waiters. False when
// the transport threw and the world failed.
bool executeOp(RunState& run, Op& op) {
  try {
    if (op.fp.kind == OpKind::kSplit) {
      completeSplit(op, *run.transport);
      run.transport->split(collectiveOf(op));
    } else if (!op.faulty) {  // every member agreed with a faulty issue: no fabric defines the data
      op.doneToken = run.transport->execute(collectiveOf(op));
    }
    op.folded.reset();
    op.consumed.clear();
  } catch (const std::exception& e) {
    run.fail(CollectiveFailure::kBackend,
             detail::concat(run.name, ": ", op.describe(), " failed in the transport: ", e.what()));
    return false;
  }
  op.done = true;
  op.exchanging = false;
  wakeWaiters(run, op);
  return true;
}

// Caller holds mu. A transport carrying peer data: executes the agreed collectives at the front of
// the process's order; one still awaiting a peer holds back every later one.
void executeInOrder(RunState& run) {
  while (!run.failed && !run.inOrder.empty() && run.inOrder.front()->agreed) {
    const std::shared_ptr<Op> op = run.inOrder.front();
    run.inOrder.pop_front();
    if (op->abandonedBy < 0 && !executeOp(run, *op)) return;
  }
}

// A process's part of an exchange: the fingerprint its members issued, whether a fault altered it,
// each member's group rank (and split color and key), then their inputs unless no data moves.
// Processes of one world share the machine's byte order (mpirun on one kind of node).
bool movesData(const Op& op) { return !op.faulty && op.fp.kind != OpKind::kSplit && op.fp.kind != OpKind::kBarrier; }

std::string exchangeKey(const Op& op) { return detail::concat(op.group->id, "#", op.seq); }

// Caller holds mu. Every local member of op has issued it: send this process's part to the peers.
void startExchange(RunState& run, Op& op) {
  std::string part;
  wire::put(part, op.fp.kind);
  wire::put(part, op.fp.dtype);
  wire::put(part, op.fp.inCount);
  wire::put(part, op.fp.outCount);
  wire::put(part, op.fp.reduce);
  wire::put(part, op.fp.root);
  wire::put(part, std::uint32_t(op.fp.label.size()));
  part += op.fp.label;
  wire::put(part, std::uint8_t(op.faulty));
  wire::put(part, std::uint32_t(op.group->localMembers));
  for (std::size_t r = 0; r < op.arrived.size(); ++r) {
    if (!op.arrived[r]) continue;
    wire::put(part, std::int32_t(r));
    wire::put(part, std::int32_t(op.splitColor[r]));
    wire::put(part, std::int32_t(op.splitKey[r]));
  }
  if (movesData(op) && !run.transport->carriesPeerData()) {
    wire::padToData(part);
    for (std::size_t r = 0; r < op.arrived.size(); ++r)
      if (op.arrived[r])
        part.append(static_cast<const char*>(op.in[r].data()), std::size_t(op.in[r].numel()) * dtypeSize(op.fp.dtype));
  }
  op.exchanging = true;
  const std::string key = exchangeKey(op);
  run.exchanges[key] = run.pendingOps.at({op.group.get(), op.seq});
  if (run.transport->carriesPeerData()) run.inOrder.push_back(run.exchanges[key]);
  run.transport->exchange(key, op.group->peers, std::move(part));
}

// Caller holds mu. Every peer's part of op arrived: check that all members issued the same
// collective, then compute the local members' outputs from every member's input, as one process would.
void completeExchange(RunState& run, Op& op, const std::vector<std::string>& parts) {
  const int n = int(op.arrived.size());
  std::vector<std::size_t> dataAt(parts.size());
  std::vector<int> partOf(n, -1);
  bool mismatch = false;
  for (std::size_t p = 0; p < parts.size(); ++p) {
    wire::Reader in(parts[p], "a peer's exchange part");
    Fingerprint fp;
    fp.kind = in.get<OpKind>();
    fp.dtype = in.get<DType>();
    fp.inCount = in.get<std::int64_t>();
    fp.outCount = in.get<std::int64_t>();
    fp.reduce = in.get<ReduceOp>();
    fp.root = in.get<int>();
    const auto labelSize = in.get<std::uint32_t>();
    fp.label.assign(in.take(labelSize), labelSize);
    const bool faulty = in.get<std::uint8_t>() != 0;
    op.faulty = op.faulty || faulty;
    const auto members = in.get<std::uint32_t>();
    for (std::uint32_t i = 0; i < members; ++i) {
      const int r = in.get<std::int32_t>();
      TPSIM_INTERNAL_ASSERT(r >= 0 && r < n && !op.arrived[r], "a peer's exchange part names a wrong member");
      op.arrived[r] = 1;
      op.issued[r] = fp;
      op.splitColor[r] = in.get<std::int32_t>();
      op.splitKey[r] = in.get<std::int32_t>();
      partOf[r] = int(p);
    }
    dataAt[p] = wire::alignedOffset(in.at());
    mismatch = mismatch || !(fp == op.fp);
  }
  if (mismatch) {
    std::string msg = detail::concat(run.name, ": collective mismatch on ", op.group->name(), " at seq ", op.seq, ":");
    for (int r = 0; r < n; ++r)
      msg += detail::concat("\n  rank ", op.group->globalRanks[r], " issued ", op.issued[r].str());
    msg += "\nevery member must issue the same collectives in the same order";
    run.fail(CollectiveFailure::kMismatch, msg);
    return;
  }
  run.pendingOps.erase({op.group.get(), op.seq});
  op.group->pending.erase(op.seq);
  if (run.transport->carriesPeerData()) {
    op.agreed = true;
    executeInOrder(run);
    return;
  }
  if (op.abandonedBy >= 0) return;
  if (op.fp.kind == OpKind::kSplit) {
    completeSplit(op, *run.transport);
    run.transport->split(collectiveOf(op));
  } else if (movesData(op)) {
    Collective c = collectiveOf(op);
    const std::size_t esize = dtypeSize(op.fp.dtype);
    // Peers' members' outputs are computed too (the transport's code is the one-process code) and dropped.
    std::vector<char> dropped(std::size_t(op.fp.outCount) * esize);
    for (int r = 0; r < n; ++r) {
      if (partOf[r] < 0) continue;
      std::size_t& at = dataAt[std::size_t(partOf[r])];
      const std::size_t bytes = std::size_t(op.fp.inCount) * esize;
      const std::string& part = parts[std::size_t(partOf[r])];
      TPSIM_INTERNAL_ASSERT(at + bytes <= part.size(), "a peer's exchange part is truncated");
      TPSIM_INTERNAL_ASSERT(reinterpret_cast<std::uintptr_t>(part.data() + at) % esize == 0,
                            "a peer's input is misaligned in its exchange part");
      c.in[r] = ConstView(part.data() + at, Shape{op.fp.inCount}, op.fp.dtype,
                          run.transport->device());
      c.out[r] = View(dropped.data(), Shape{op.fp.outCount}, op.fp.dtype, run.transport->device());
      at += bytes;
    }
    try {
      op.doneToken = run.transport->execute(c);
    } catch (const std::exception& e) {
      run.fail(CollectiveFailure::kBackend,
               detail::concat(run.name, ": ", op.describe(), " failed in the transport: ", e.what()));
      return;
    }
  }
  op.done = true;
  op.exchanging = false;
  wakeWaiters(run, op);
}

// The rendezvous' side of a transport whose world spans processes; outlives a run() it may call into.
class RunSink final : public PeerSink {
 public:
  explicit RunSink(std::shared_ptr<RunState> run) : run_(std::move(run)) {}

  void delivered(const std::string& key, std::vector<std::string> parts) override {
    std::lock_guard<std::mutex> lock(run_->mu);
    auto it = run_->exchanges.find(key);
    if (run_->failed || it == run_->exchanges.end()) return;
    const std::shared_ptr<Op> op = it->second;
    run_->exchanges.erase(it);
    try {
      completeExchange(*run_, *op, parts);
    } catch (const std::exception& e) {
      run_->fail(CollectiveFailure::kBackend,
                 detail::concat(run_->name, ": ", op->describe(), " failed in the exchange between processes: ", e.what()));
    }
  }

  void peerFailed(CollectiveFailure kind, const std::string& message, int rank, const std::string& rankError) override {
    std::lock_guard<std::mutex> lock(run_->mu);
    if (run_->failed) return;
    run_->peerRankError = rankError;
    run_->fail(kind, message, rank, true);
  }

  void peersFinished() override {
    std::lock_guard<std::mutex> lock(run_->mu);
    run_->peersDone = true;
    run_->doneCv.notify_all();
  }

 private:
  std::shared_ptr<RunState> run_;
};

class SimWork final : public Work {
 public:
  SimWork(RunState* run, std::shared_ptr<Op> op, RankState* self) : run_(run), op_(std::move(op)), self_(self) {}

  ~SimWork() override {
    if (waited_) return;
    std::unique_lock<std::mutex> lock(run_->mu);
    if (op_->doneToken) {
      // The transport already enqueued the collective (only executed ones carry a done token):
      // whatever the world's fate, the rank's later work, the frees of the buffers it is dropping
      // above all, must be ordered after it, as wait() would have.
      const TransportToken doneToken = op_->doneToken;
      lock.unlock();
      try {
        run_->transport->completed(self_->rank, doneToken);
      } catch (...) {
        // A destructor cannot throw; a transport that fails here fails its next call as well.
      }
      lock.lock();
    }
    if (run_->failed) return;
    if (std::uncaught_exceptions() > 0) {
      // The rank is unwinding and its buffers are going away: the collective must never touch
      // them. The rank's exception reaches the world next and fails it with the real message.
      if (!op_->done) op_->abandonedBy = self_->rank;
      return;
    }
    run_->fail(CollectiveFailure::kDroppedWork,
               detail::concat(run_->name, ": rank ", self_->rank, " destroyed the Work of ", op_->describe(),
                              " without wait(); wait on every Work before its buffers are reused"));
  }

  void wait() override {
    std::unique_lock<std::mutex> lock(run_->mu, std::defer_lock);
    lockSpinning(lock);
    for (;;) {
      if (op_->done) break;
      if (run_->failed) {
        waited_ = true;
        throw run_->failureFor(self_->rank);
      }
      lock.unlock();
      self_->fiber->suspend(op_.get());
      lockSpinning(lock);
    }
    waited_ = true;
    const TransportToken doneToken = op_->doneToken;
    lock.unlock();
    if (op_->fp.kind != OpKind::kSplit && !op_->faulty) run_->transport->completed(self_->rank, doneToken);
  }

  bool isCompleted() override {
    std::lock_guard<std::mutex> lock(run_->mu);
    return op_->done || run_->failed;
  }

  const Op& op() const { return *op_; }

 private:
  RunState* run_;
  std::shared_ptr<Op> op_;
  RankState* self_;
  bool waited_ = false;
};

// What a rank whose collective an injected fault skipped gets back: its output is left as is.
class SkippedWork final : public Work {
 public:
  void wait() override {}
  bool isCompleted() override { return true; }
};

// A collective whose result an injected fault corrupts on one rank: once it has completed, one bit
// of one element of the rank's output flips, through the rank's own Compute (any backend's memory).
class CorruptedWork final : public Work {
 public:
  CorruptedWork(std::unique_ptr<Work> inner, View out, Compute& compute, const Fault& fault, std::string what,
                RunState& run)
      : inner_(std::move(inner)), out_(out), compute_(compute), fault_(fault), what_(std::move(what)), run_(run) {}

  void wait() override {
    inner_->wait();
    if (flipped_) return;
    flipped_ = true;
    const int bit = fault_.bit >= 0 ? fault_.bit : topExponentBit(out_.dtype());
    const std::size_t size = dtypeSize(out_.dtype());
    if (fault_.element >= out_.numel() || std::size_t(bit) >= 8 * size) {  // bad input: run() reports it (exit 2)
      std::lock_guard<std::mutex> lock(run_.mu);
      run_.misplaced.push_back(detail::concat("injected fault ", fault_.str(), ": expected an element below ",
                                              out_.numel(), " and a bit below ", 8 * size, " of the result of ",
                                              what_, ", got element ", fault_.element, ", bit ", bit));
      return;
    }
    std::vector<unsigned char> bytes(std::size_t(out_.numel()) * size);
    compute_.download(out_, bytes.data());
    bytes[std::size_t(fault_.element) * size + std::size_t(bit / 8)] ^= static_cast<unsigned char>(1u << (bit % 8));
    compute_.upload(bytes.data(), out_);
  }
  bool isCompleted() override { return inner_->isCompleted(); }

 private:
  std::unique_ptr<Work> inner_;
  View out_;
  Compute& compute_;
  Fault fault_;
  std::string what_;
  RunState& run_;
  bool flipped_ = false;
};

class SimCollectives final : public Collectives {
 public:
  // Valid only inside the run() that made it: the run's state owns every rank's communicators.
  SimCollectives(RunState* run, std::shared_ptr<Membership> membership, RankState* self)
      : run_(run), membership_(std::move(membership)), group_(membership_->group), rank_(membership_->rank),
        self_(self) {}

  using Collectives::allReduce;
  int rank() const override { return rank_; }
  int size() const override { return int(group_->globalRanks.size()); }
  const std::vector<int>& globalRanks() const override { return group_->globalRanks; }
  const std::string& label() const override { return group_->label; }

  std::unique_ptr<Work> allReduce(ConstView in, View out, const AllReduceOptions& opts) override {
    checkBuffers("allReduce", in, out);
    checkOverlap("allReduce", in, out, 0, "in == out");
    checkReducible("allReduce", in);
    TPSIM_CHECK(in.numel() == out.numel(), where("allReduce"), ": out must have in's ", in.numel(),
                " elements, got ", out.str());
    Fingerprint fp{OpKind::kAllReduce, in.dtype(), in.numel(), out.numel(), opts.op, 0, {}};
    return issue(fp, in, out, opts.timeout);
  }

  std::unique_ptr<Work> allGather(ConstView in, View out, const CollectiveOptions& opts) override {
    checkBuffers("allGather", in, out);
    checkOverlap("allGather", in, out, rank_ * in.numel(), "in == out + r·in.numel(), this rank's block of out");
    TPSIM_CHECK(out.numel() == size() * in.numel(), where("allGather"), ": out must have n·in = ", size(),
                "·", in.numel(), " elements, got ", out.str());
    Fingerprint fp{OpKind::kAllGather, in.dtype(), in.numel(), out.numel(), ReduceOp::kSum, 0, {}};
    return issue(fp, in, out, opts.timeout);
  }

  std::unique_ptr<Work> allGatherShared(ConstView in, const Shape& outShape, Compute& compute, SharedTensor& out,
                                        const CollectiveOptions& opts) override {
    // A rank whose next collective carries an injected fault gets a copy of its own: a corrupted
    // result is that rank's alone.
    if (!run_->transport->sharesMemory() || run_->faultAt(self_->rank, self_->collectives + 1))
      return Collectives::allGatherShared(in, outShape, compute, out, opts);
    const View planned(nullptr, outShape, in.dtype(), run_->transport->device());
    checkBuffers("allGatherShared", in, planned);
    TPSIM_CHECK(outShape.numel() == size() * in.numel(), where("allGatherShared"), ": out must have n·in = ",
                size(), "·", in.numel(), " elements, got ", outShape.str());
    Fingerprint fp{OpKind::kAllGather, in.dtype(), in.numel(), outShape.numel(), ReduceOp::kSum, 0, {}};
    SharedOut shared{outShape, compute, out};
    return issue(fp, in, View(), opts.timeout, 0, 0, &shared);
  }

  std::unique_ptr<Work> reduceScatter(ConstView in, View out, const ReduceScatterOptions& opts) override {
    checkBuffers("reduceScatter", in, out);
    checkOverlap("reduceScatter", in, out, -rank_ * out.numel(), "out == in + r·out.numel(), this rank's block of in");
    checkReducible("reduceScatter", in);
    TPSIM_CHECK(in.numel() == size() * out.numel(), where("reduceScatter"), ": in must have n·out = ", size(),
                "·", out.numel(), " elements, got ", in.str(), "; in's dim 0 must divide by the group size");
    Fingerprint fp{OpKind::kReduceScatter, in.dtype(), in.numel(), out.numel(), opts.op, 0, {}};
    return issue(fp, in, out, opts.timeout);
  }

  std::unique_ptr<Work> reduceScatterConsuming(Tensor in, View out, const ReduceScatterOptions& opts) override {
    // Spread over processes, the peers are sent the inputs whole; a rank with a fault injected at
    // this collective keeps the plain path.
    if (!run_->transport->foldsReductions() || group_->localMembers != size() ||
        run_->faultAt(self_->rank, self_->collectives + 1))
      return Collectives::reduceScatterConsuming(std::move(in), out, opts);
    checkBuffers("reduceScatterConsuming", in, out);
    checkOutsideConsumed(in, out);
    checkReducible("reduceScatterConsuming", in);
    TPSIM_CHECK(in.numel() == size() * out.numel(), where("reduceScatterConsuming"), ": in must have n·out = ",
                size(), "·", out.numel(), " elements, got ", in.str(), "; in's dim 0 must divide by the group size");
    Fingerprint fp{OpKind::kReduceScatter, in.dtype(), in.numel(), out.numel(), opts.op, 0, {}};
    const ConstView view = in;
    return issue(fp, view, out, opts.timeout, 0, 0, nullptr, &in);
  }

  std::unique_ptr<Work> broadcast(ConstView in, View out, const BroadcastOptions& opts) override {
    TPSIM_CHECK(opts.root >= 0 && opts.root < size(), where("broadcast"), ": root must be in [0, ", size(),
                "), got ", opts.root);
    checkBuffers("broadcast", rank_ == opts.root ? in : ConstView(out), out);
    if (rank_ == opts.root) checkOverlap("broadcast", in, out, 0, "in == out");
    TPSIM_CHECK(rank_ != opts.root || in.numel() == out.numel(), where("broadcast"),
                ": out must have in's ", in.numel(), " elements, got ", out.str());
    Fingerprint fp{OpKind::kBroadcast, out.dtype(), out.numel(), out.numel(), ReduceOp::kSum, opts.root, {}};
    return issue(fp, rank_ == opts.root ? in : ConstView(out), out, opts.timeout);
  }

  std::unique_ptr<Work> allToAll(ConstView in, View out, const CollectiveOptions& opts) override {
    checkBuffers("allToAll", in, out);
    checkOverlap("allToAll", in, out, 0, "in == out");
    TPSIM_CHECK(in.numel() == out.numel() && in.numel() % size() == 0, where("allToAll"),
                ": in and out must have the same element count, divisible by the group size ", size(),
                ", got in ", in.str(), ", out ", out.str());
    Fingerprint fp{OpKind::kAllToAll, in.dtype(), in.numel(), out.numel(), ReduceOp::kSum, 0, {}};
    return issue(fp, in, out, opts.timeout);
  }

  std::unique_ptr<Work> barrier(const CollectiveOptions& opts) override {
    return issue(Fingerprint{}, ConstView(), View(), opts.timeout);
  }

  std::unique_ptr<Collectives> split(int color, int key, const std::string& label) override {
    Fingerprint fp;
    fp.kind = OpKind::kSplit;
    fp.label = label;
    auto work = issue(fp, ConstView(), View(), Timeout{0}, color, key);
    work->wait();
    auto [group, rank] = static_cast<SimWork&>(*work).op().splitResult[rank_];
    if (!group) return nullptr;
    auto membership = std::make_shared<Membership>(Membership{std::move(group), rank, 0});
    self_->groups.push_back(membership);
    return std::make_unique<SimCollectives>(run_, std::move(membership), self_);
  }

 private:
  std::string where(const char* op) const {
    return detail::concat(op, " on ", group_->name(), " (rank ", self_->rank, ")");
  }

  void checkBuffers(const char* op, ConstView in, ConstView out) const {
    TPSIM_CHECK(in.dtype() == out.dtype(), where(op), ": in and out must share a dtype, got ",
                dtypeName(in.dtype()), " and ", dtypeName(out.dtype()));
    TPSIM_CHECK(in.isContiguous(), where(op), ": in must be contiguous, got ", in.str());
    TPSIM_CHECK(out.isContiguous(), where(op), ": out must be contiguous, got ", out.str());
    const Device device = run_->transport->device();
    TPSIM_CHECK(in.device() == device && out.device() == device, where(op),
                ": buffers must be ", deviceName(device), " memory on this world, got ",
                deviceName(in.device()), " and ", deviceName(out.device()));
  }

  // NCCL and the DeviceFabric read and write the buffers from many threads at once, so buffers that
  // overlap in any other way than the documented in-place form (in starting inPlaceOffset elements
  // after out) have no defined result there; the simulator, which stages through scratch, would
  // hide that. Disjoint buffers always pass.
  void checkOverlap(const char* op, ConstView in, ConstView out, std::int64_t inPlaceOffset,
                    const char* inPlaceForm) const {
    const auto inBegin = reinterpret_cast<std::uintptr_t>(in.data());
    const auto outBegin = reinterpret_cast<std::uintptr_t>(out.data());
    const std::int64_t esize = std::int64_t(dtypeSize(in.dtype()));
    const std::uintptr_t inEnd = inBegin + std::uintptr_t(in.numel() * esize);
    const std::uintptr_t outEnd = outBegin + std::uintptr_t(out.numel() * esize);
    if (inBegin == inEnd || outBegin == outEnd || inEnd <= outBegin || outEnd <= inBegin) return;
    const std::int64_t offset = std::int64_t(inBegin - outBegin);  // negative when in starts first
    const std::int64_t distance = offset < 0 ? -offset : offset;
    TPSIM_CHECK(offset == inPlaceOffset * esize, where(op),
                ": in and out overlap; expected disjoint buffers or the in-place form ", inPlaceForm, ", got in = out ",
                offset < 0 ? "- " : "+ ", distance % esize == 0 ? distance / esize : distance,
                distance % esize == 0 ? " elements" : " bytes", " (in ", in.str(), ", out ", out.str(), ")");
  }

  // fp8 data is only moved: E4M3 values carry separate block scales, so their sum is meaningless.
  void checkReducible(const char* op, ConstView in) const {
    TPSIM_CHECK(!isFloat8(in.dtype()), where(op), ": cannot reduce ", dtypeName(in.dtype()),
                " data; expected fp32, bf16, fp16, fp64 or int64, got ", in.str(),
                "; fp8 tensors can be all-gathered, broadcast or exchanged, dequantize them to reduce");
  }

  // An allGatherShared's output: made by the first member to issue, handed to the others.
  struct SharedOut {
    const Shape& shape;
    Compute& compute;
    SharedTensor& out;
  };

  // shared: an allGatherShared's output; consumed: a reduceScatterConsuming's input, folded.
  std::unique_ptr<Work> issue(const Fingerprint& fp, ConstView in, View out, Timeout timeout,
                              int color = 0, int key = 0, SharedOut* shared = nullptr, Tensor* consumed = nullptr) {
    if (fp.kind == OpKind::kSplit) return issueOn(*membership_, fp, false, in, out, timeout, color, key);
    const std::int64_t k = ++self_->collectives;
    const Fault* fault = run_->faultAt(self_->rank, k);
    if (!fault) return issueOn(*membership_, fp, false, in, out, timeout, 0, 0, shared, consumed);
    TPSIM_INTERNAL_ASSERT(shared == nullptr && consumed == nullptr,
                          "a collective with an injected fault must take the plain path");
    RunState& run = *run_;
    const std::string what = detail::concat("its collective ", k, ", ", fp.str(), " on ", group_->name(), " (seq ",
                                            membership_->nextSeq, ")");
    Membership* other = nullptr;
    {
      std::unique_lock<std::mutex> lock(run.mu, std::defer_lock);
      lockSpinning(lock);
      if (run.failed) throw run.failureFor(self_->rank);
      run.injected.push_back(detail::concat("rank ", self_->rank, " ", fault->str(), ": ", what));
      switch (fault->kind) {
        case FaultKind::kSkip: return std::make_unique<SkippedWork>();
        case FaultKind::kStall: stall(lock, what); break;
        case FaultKind::kGroup:
          // The world group, or for a world collective the group the rank split off last.
          for (auto& m : self_->groups)
            if (m != membership_ && other != self_->groups[0].get()) other = m.get();
          break;
        default: break;
      }
    }
    switch (fault->kind) {
      case FaultKind::kThrow: throw Error(detail::concat("injected fault: rank ", self_->rank, " throws at ", what));
      case FaultKind::kGroup:
        if (!other)
          throw Error(detail::concat("injected fault: rank ", self_->rank, " is in no group but ", group_->name(),
                                     " to issue ", what, " on"));
        return issueOn(*other, fp, true, in, out, timeout);
      case FaultKind::kCorrupt:  // issued as asked: only the result the rank receives is wrong
        return std::make_unique<CorruptedWork>(issueOn(*membership_, fp, false, in, out, timeout), out,
                                               *self_->compute, *fault, what, run);
      default: return issueOn(*membership_, tampered(fp, fault->kind, size()), true, in, out, timeout);
    }
  }

  // An injected stall: the rank's fiber waits, counted as busy rather than blocked, until the
  // world fails (its timeout, at the latest), then throws like any collective of a failed world.
  void stall(std::unique_lock<std::mutex>& lock, const std::string& what) {
    RunState& run = *run_;
    self_->stallWhat = what;
    self_->stallDeadline = Clock::now() + run.options.timeout;
    run.minTimeout = std::min<Clock::duration>(run.minTimeout, run.options.timeout);
    while (!run.failed) {
      lock.unlock();
      self_->fiber->suspend(&kStallRequest);
      lockSpinning(lock);
    }
    throw run.failureFor(self_->rank);
  }

  // Matches this rank's issue of `fp` on group m; `faulty` marks an issue an injected fault altered.
  std::unique_ptr<Work> issueOn(Membership& m, const Fingerprint& fp, bool faulty, ConstView in, View out,
                                Timeout timeout, int color = 0, int key = 0, SharedOut* shared = nullptr,
                                Tensor* consumed = nullptr) {
    RunState& run = *run_;
    GroupState* const group = m.group.get();
    // Outside the lock: a GPU transport records an event on this rank's stream here.
    TransportToken token = fp.kind == OpKind::kSplit ? nullptr : run.transport->issued(self_->rank);
    std::unique_lock<std::mutex> lock(run.mu, std::defer_lock);
    lockSpinning(lock);
    if (run.failed) throw run.failureFor(self_->rank);
    const std::uint64_t seq = m.nextSeq++;
    const int n = int(group->globalRanks.size());
    const int rank = m.rank;
    std::shared_ptr<Op>& slot = group->pending[seq];
    if (!slot) {
      slot = std::make_shared<Op>();
      slot->group = m.group;
      slot->seq = seq;
      slot->fp = fp;
      slot->issued.resize(n);
      slot->arrived.assign(n, 0);
      slot->in.resize(n);
      slot->out.resize(n);
      slot->splitColor.resize(n);
      slot->splitKey.resize(n);
      slot->tokens.resize(n);
      slot->consumed.resize(n);
      slot->firstArrival = Clock::now();
      slot->timeout = timeout.count() > 0 ? Clock::duration(timeout) : Clock::duration(run.options.timeout);
      run.minTimeout = std::min(run.minTimeout, slot->timeout);
      run.pendingOps[{group, seq}] = slot;
    }
    std::shared_ptr<Op> op = slot;
    if (shared) {
      // Allocated before the rank counts as arrived, so that a failed allocation fails only the rank.
      std::shared_ptr<Tensor> made = op->sharedOut.lock();
      if (!made || made->shape() != shared->shape || made->dtype() != fp.dtype) {
        made = std::make_shared<Tensor>(shared->compute.empty(shared->shape, fp.dtype));
        if (op->sharedOut.expired()) op->sharedOut = made;
      }
      shared->out = made;
      out = made->view();
    }
    op->faulty = op->faulty || faulty;
    op->issued[rank] = fp;
    op->arrived[rank] = 1;
    if (!(fp == op->fp)) {
      std::string msg = detail::concat(run.name, ": collective mismatch on ", group->name(), " at seq ", seq, ":");
      for (int r = 0; r < n; ++r)
        if (op->arrived[r])
          msg += detail::concat("\n  rank ", group->globalRanks[r], " issued ", op->issued[r].str());
      msg += "\nevery member must issue the same collectives in the same order";
      run.fail(CollectiveFailure::kMismatch, msg);
      throw run.failureFor(self_->rank);
    }
    ++op->arrivedCount;
    op->in[rank] = in;
    op->out[rank] = out;
    op->splitColor[rank] = color;
    op->splitKey[rank] = key;
    op->tokens[rank] = std::move(token);
    if (consumed) {
      op->consumed[rank] = std::move(*consumed);
      if (!foldArrived(run, *op)) throw run.failureFor(self_->rank);
    }
    const bool awaitsFold = consumed && op->foldedCount <= rank;
    if (run.options.trace)
      run.trace[self_->rank].push_back(
          TraceEvent{opName(fp.kind), group->name(), seq, dtypeName(fp.dtype),
                     fp.inCount * std::int64_t(dtypeSize(fp.dtype))});
    if (op->arrivedCount == n) {
      group->pending.erase(seq);
      run.pendingOps.erase({group, seq});
      if (run.transport->carriesPeerData() && !run.inOrder.empty()) {
        // Behind a collective that still awaits a peer: the transport gets both in issue order.
        op->agreed = op->exchanging = true;
        run.inOrder.push_back(op);
      } else if (op->abandonedBy < 0 && !executeOp(run, *op)) {
        throw run.failureFor(self_->rank);
      }
    } else if (op->arrivedCount == group->localMembers) {
      startExchange(run, *op);
    }
    if (awaitsFold && !op->done) awaitFold(lock, *op, rank);
    return std::make_unique<SimWork>(run_, op, self_);
  }

  // This rank gave its input up, but the member before it that was not added yet (the sum is built
  // in rank order) has not arrived. Were this thread to run its next rank now, that rank would make
  // and hold another partial sum, and threads that drift apart would hold many. While that member
  // runs on another thread, this one waits for it to arrive (and add both inputs), at most
  // kFoldWait: the threads reach the reduce-scatter in about rank order. Caller holds mu.
  void awaitFold(std::unique_lock<std::mutex>& lock, Op& op, int rank) {
    RunState& run = *run_;
    const auto deadline = Clock::now() + kFoldWait;
    while (!run.failed && !op.done && op.foldedCount <= rank && Clock::now() < deadline) {
      const RankState& first = *run.ranks[std::size_t(op.group->globalRanks[std::size_t(op.foldedCount)])];
      if (first.worker == self_->worker || first.status != RankStatus::kRunning) return;
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::microseconds(20));
      lockSpinning(lock);
    }
  }

  RunState* run_;
  std::shared_ptr<Membership> membership_;
  std::shared_ptr<GroupState> group_;
  int rank_;
  RankState* self_;
};

// Caller holds mu. Rank r has just stopped running: it finished, stalls, or it parks on the Op
// its fiber handed over as `request`.
void afterSwitch(RunState& run, RankState* r, void* request) {
  --run.running;
  Op* const op = request == &kStallRequest ? nullptr : static_cast<Op*>(request);
  if (!r->fiber) {
    r->status = RankStatus::kFinished;
    --run.unfinished;
    --run.workers[r->worker].unfinished;
    if (run.unfinished == 0) run.doneCv.notify_all();
  } else if (run.failed || (op && op->done)) {
    r->status = RankStatus::kReady;
    ++run.readyCount;
    Worker& w = run.workers[r->worker];
    w.ready.push_back(r);
    w.readyHint.store(int(w.ready.size()), std::memory_order_relaxed);
  } else if (!op) {
    r->status = RankStatus::kStalled;
    ++run.stalled;
  } else {
    r->status = RankStatus::kParked;
    r->parkedOn = op;
    ++run.parked;
    op->waiters.push_back(r);
  }
  run.checkDeadlock();
}

void workerLoop(std::shared_ptr<RunState> run, int index) {
  RunState& s = *run;
  const StopScope stopScope(s.stop);  // the ranks' compute polls it (a GEMM's blocks)
  Worker& w = s.workers[index];
  std::unique_lock<std::mutex> lock(s.mu);
  while (w.unfinished > 0) {
    if (w.ready.empty()) {
      lock.unlock();
      const auto until = Clock::now() + kSpinBeforeSleep;
      while (w.readyHint.load(std::memory_order_relaxed) == 0 && Clock::now() < until) cpuRelax();
      lockSpinning(lock);
      if (w.ready.empty() && w.unfinished > 0) w.cv.wait(lock);
      continue;
    }
    RankState* r = w.ready.front();
    w.ready.pop_front();
    w.readyHint.store(int(w.ready.size()), std::memory_order_relaxed);
    --s.readyCount;
    ++s.running;
    r->status = RankStatus::kRunning;
    lock.unlock();
    void* request = r->fiber->resume();
    if (r->fiber->finished()) r->fiber.reset();  // free the stack outside the lock
    lockSpinning(lock);
    afterSwitch(s, r, request);
  }
}

void rankBody(RunState& run, RankState& r) {
  try {
    RankContext ctx{*r.compute, *r.world};
    run.fn(ctx);
  } catch (const Stopped& e) {  // the rank's compute saw the flag before the watchdog did
    std::lock_guard<std::mutex> lock(run.mu);
    r.error = e.what();
    run.fail(CollectiveFailure::kStopped, run.name + ": stopped from outside");
  } catch (const std::exception& e) {
    std::lock_guard<std::mutex> lock(run.mu);
    r.error = e.what();
    run.fail(CollectiveFailure::kPeerFailed,
             detail::concat("peer rank ", r.rank, " failed: ", e.what()), r.rank);
  } catch (...) {
    std::lock_guard<std::mutex> lock(run.mu);
    r.error = "unknown exception";
    run.fail(CollectiveFailure::kPeerFailed,
             detail::concat("peer rank ", r.rank, " failed: unknown exception"), r.rank);
  }
}

}  // namespace

struct Rendezvous::Impl {
  std::string name;
  WorldOptions options;
  std::vector<std::vector<TraceEvent>> trace;
};

Rendezvous::Rendezvous(std::string name, WorldOptions options) : impl_(std::make_unique<Impl>()) {
  const std::string where = name + "::World";
  TPSIM_CHECK(options.size >= 1, where, ": size must be >= 1, got ", options.size);
  TPSIM_CHECK(options.threads >= 0, where, ": threads must be >= 0 (0 = automatic), got ", options.threads);
  TPSIM_CHECK(options.timeout.count() > 0, where, ": timeout must be > 0 ms, got ", options.timeout.count());
  for (const Fault& f : options.faults) {
    TPSIM_CHECK(f.rank >= 0 && f.rank < options.size, where, ": faults: expected ranks in [0, ", options.size,
                "), got ", f.str());
    TPSIM_CHECK(f.collective >= 1, where, ": faults: expected K >= 1, got ", f.str());
    for (const Fault& g : options.faults)
      TPSIM_CHECK(&f == &g || f.rank != g.rank || f.collective != g.collective, where,
                  ": faults: expected one fault per rank and collective, got ", f.str(), " and ", g.str());
  }
  if (options.threads == 0)
    options.threads = std::max(1, std::min<int>(options.size, int(std::thread::hardware_concurrency())));
  options.threads = std::min(options.threads, options.size);
  if (options.stackBytes == 0) options.stackBytes = Fiber::defaultStackBytes();
  impl_->name = std::move(name);
  impl_->options = options;
}

Rendezvous::~Rendezvous() = default;

const WorldOptions& Rendezvous::options() const { return impl_->options; }

const std::vector<std::vector<TraceEvent>>& Rendezvous::trace() const { return impl_->trace; }

void Rendezvous::run(const std::function<void(RankContext&)>& fn,
                     const std::vector<std::shared_ptr<Compute>>& computes,
                     const std::shared_ptr<Transport>& transport) {
  const WorldOptions& o = impl_->options;
  TPSIM_INTERNAL_ASSERT(int(computes.size()) == o.size && transport, "one compute per rank and a transport");
  auto run = std::make_shared<RunState>();
  run->name = impl_->name;
  run->stop = currentStopFlag();
  run->computes = computes;
  run->transport = transport;
  run->options = o;
  run->fn = fn;
  run->minTimeout = o.timeout;
  run->trace.assign(o.size, {});
  run->workers = std::vector<Worker>(o.threads);
  auto worldGroup = std::make_shared<GroupState>();
  worldGroup->label = "world";
  worldGroup->id = "w";
  for (int r = 0; r < o.size; ++r) worldGroup->globalRanks.push_back(r);
  place(*worldGroup, *transport);
  const bool spread = !worldGroup->peers.empty();
  int local = 0;
  for (int r = 0; r < o.size; ++r) {
    auto state = std::make_unique<RankState>();
    RankState* s = state.get();
    s->rank = r;
    if (transport->processOf(r) != transport->process()) {
      s->status = RankStatus::kRemote;
      run->ranks.push_back(std::move(state));
      continue;
    }
    s->compute = computes[r].get();
    s->worker = local++ % o.threads;
    s->groups.push_back(std::make_shared<Membership>(Membership{worldGroup, r, 0}));
    s->world = std::make_unique<SimCollectives>(run.get(), s->groups[0], s);
    s->fiber = std::make_unique<Fiber>(o.stackBytes, [runPtr = run.get(), s] { rankBody(*runPtr, *s); });
    run->workers[s->worker].ready.push_back(s);
    ++run->workers[s->worker].unfinished;
    run->ranks.push_back(std::move(state));
  }
  run->unfinished = run->readyCount = local;
  if (spread) transport->attach(std::make_shared<RunSink>(run));

  std::vector<std::thread> threads =
      startThreads(o.threads, [run](int w) { workerLoop(run, w); }, "worker threads for the world's ranks (--threads)");

  bool abandoned = false;
  {
    std::unique_lock<std::mutex> lock(run->mu);
    // Spread over processes, a run ends when every process's ranks have returned or the world failed.
    auto sendFinish = [&] {
      if (!spread || run->unfinished > 0 || run->finishSent || run->failed) return;
      run->finishSent = true;
      run->finishTime = Clock::now();
      transport->finished();
    };
    while (run->unfinished > 0 || (spread && !run->failed && !run->peersDone)) {
      sendFinish();
      const auto tick = std::clamp<Clock::duration>(run->minTimeout / 4, std::chrono::milliseconds(1),
                                                    std::chrono::milliseconds(100));
      run->doneCv.wait_for(lock, tick);
      const auto now = Clock::now();
      if (!run->failed && stopRequested(run->stop))
        run->fail(CollectiveFailure::kStopped, run->name + ": stopped from outside");
      if (!run->failed) run->checkTimeouts(now);
      if (!run->failed && run->finishSent && !run->peersDone && now - run->finishTime > Clock::duration(o.timeout))
        run->fail(CollectiveFailure::kTimeout,
                  detail::concat(run->name, ": timeout: the ranks of process ", transport->process(),
                                 " returned, but those of its peers did not within ", o.timeout.count(), " ms"));
      if (run->failed && run->unfinished > 0 && now - run->failTime > Clock::duration(o.timeout)) {
        abandoned = true;
        break;
      }
    }
    sendFinish();  // when the peers had finished first
  }
  for (auto& t : threads) abandoned ? t.detach() : t.join();
  if (spread) transport->attach(nullptr);

  // Worker threads are gone (or detached); what follows reads state no running fiber writes,
  // except an abandoned rank's, which is read under the lock.
  std::lock_guard<std::mutex> lock(run->mu);
  impl_->trace = run->trace;
  std::vector<std::string> rankErrors(o.size);
  std::map<std::string, std::vector<int>> byMessage;  // ranks grouped by the error they ended with
  for (auto& r : run->ranks) {
    if (r->status == RankStatus::kRemote) continue;  // its process reports it
    if (r->status != RankStatus::kFinished)
      rankErrors[r->rank] = detail::concat("rank ", r->rank, " did not return within ", o.timeout.count(),
                                           " ms after the failure; its thread was abandoned");
    else
      rankErrors[r->rank] = r->error;
    if (!rankErrors[r->rank].empty()) byMessage[rankErrors[r->rank]].push_back(r->rank);
  }
  if (!run->failed) {
    TPSIM_CHECK(run->misplaced.empty(), impl_->name, ": ", run->misplaced.empty() ? "" : run->misplaced.front());
    for (const Fault& f : o.faults)
      TPSIM_CHECK(run->ranks[f.rank]->status == RankStatus::kRemote || run->ranks[f.rank]->collectives >= f.collective, impl_->name, ": injected fault ", f.str(),
                  " never fired: rank ", f.rank, " issued ", run->ranks[f.rank]->collectives,
                  " collectives (group splits not counted); expected K <= ", run->ranks[f.rank]->collectives);
    return;
  }
  // Every rank has returned (or was abandoned): nothing of the run goes on. A stop is no failure
  // of the world, and a rank's error after it is only how it stopped.
  if (run->failureKind == CollectiveFailure::kStopped) {
    const auto left = std::count_if(run->ranks.begin(), run->ranks.end(),
                                    [](const auto& r) { return r->status != RankStatus::kFinished; });
    throw Stopped(run->failureMessage + (left == 0 ? "" : detail::concat("; ", left, " ranks did not return within ",
                                                                        o.timeout.count(), " ms and were abandoned")));
  }
  const bool fromCollective = run->failureKind != CollectiveFailure::kPeerFailed;
  const RankState& failedRank = *run->ranks[std::max(run->failedRank, 0)];
  std::string cause = fromCollective ? run->failureMessage
                                     : detail::concat("rank ", run->failedRank, " failed: ",
                                                      failedRank.status == RankStatus::kRemote ? run->peerRankError
                                                                                               : failedRank.error);
  std::string summary;
  for (const auto& [message, ranks] : byMessage)
    summary += detail::concat(ranks.size() == 1 ? "\n  rank " : "\n  ranks ", rankList(ranks), ": ",
                              message == run->failureMessage ? "the error above" : message);
  std::string injected = run->injected.empty() ? "" : "\ninjected faults that fired:";
  for (const std::string& fault : run->injected) injected += "\n  " + fault;
  throw WorldError(cause + (summary.empty() ? "" : "\nwhat each rank ended with:" + summary) + injected,
                   std::move(rankErrors),
                   fromCollective, run->failureKind);
}

}  // namespace tpsim::world
