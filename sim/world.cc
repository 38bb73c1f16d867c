#include "sim/world.h"

#include <algorithm>
#include <cstring>
#include <thread>

#include "backends/huge_pages.h"
#include "sim/reduce.h"
#include "sim/sim_compute.h"

namespace tpsim::sim {

world::TransportToken HostTransport::fold(const world::Collective& c) {
  // A sum of its own (several groups may fold at once), freed when the collective is done.
  std::shared_ptr<std::vector<char>> sum = std::static_pointer_cast<std::vector<char>>(c.folded);
  if (!sum) {
    sum = std::make_shared<std::vector<char>>();
    resizeFresh(*sum, std::size_t(c.inCount) * dtypeSize(c.dtype));
  }
  foldIntoSum(c.dtype, c.in[c.foldedCount].data(), c.inCount, sum->data(), c.foldedCount == 0);
  return sum;
}

// Every member has issued and none may touch its buffers until wait() returns, so reading and
// writing them here, under the rendezvous lock, is safe.
world::TransportToken HostTransport::execute(const world::Collective& c) {
  const int n = int(c.globalRanks.size());
  const std::size_t esize = dtypeSize(c.dtype);
  if (c.inCount == 0 && c.outCount == 0) return nullptr;  // barrier, empty buffers
  switch (c.kind) {
    case world::OpKind::kAllReduce:
    case world::OpKind::kReduceScatter: {
      char* sum = nullptr;
      std::shared_ptr<std::vector<char>> folded = std::static_pointer_cast<std::vector<char>>(c.folded);
      if (folded) {
        // Members [0, c.foldedCount) are in the sum already; the rest are added in rank order.
        sum = folded->data();
        for (int r = c.foldedCount; r < n; ++r) foldIntoSum(c.dtype, c.in[r].data(), c.inCount, sum, false);
        finishSum(c.dtype, c.reduce, n, c.inCount, sum);
      } else {
        std::vector<const void*> inputs(n);
        for (int r = 0; r < n; ++r) inputs[r] = c.in[r].data();
        // The scratch buffer only grows: a fresh multi-megabyte buffer per collective would
        // page-fault on every call.
        if (scratch_.size() < std::size_t(c.inCount) * esize) scratch_.resize(std::size_t(c.inCount) * esize);
        sum = scratch_.data();
        reduceInRankOrder(c.dtype, c.reduce, inputs, c.inCount, sum);
      }
      const std::size_t blockBytes = std::size_t(c.outCount) * esize;
      for (int r = 0; r < n; ++r) {
        const char* src = sum + (c.kind == world::OpKind::kReduceScatter ? r * blockBytes : 0);
        std::memcpy(c.out[r].data(), src, blockBytes);
      }
      break;
    }
    case world::OpKind::kAllGather: {
      const std::size_t blockBytes = std::size_t(c.inCount) * esize;
      for (int r = 0; r < n; ++r) {
        // Members of an allGatherShared hold one output: it is written once.
        bool written = false;
        for (int p = 0; p < r && !written; ++p) written = c.out[p].data() == c.out[r].data();
        if (written) continue;
        for (int q = 0; q < n; ++q) {
          char* dst = static_cast<char*>(c.out[r].data()) + q * blockBytes;
          if (dst != c.in[q].data()) std::memmove(dst, c.in[q].data(), blockBytes);
        }
      }
      break;
    }
    case world::OpKind::kBroadcast: {
      const void* src = c.in[c.root].data();
      for (int r = 0; r < n; ++r)
        if (c.out[r].data() != src) std::memmove(c.out[r].data(), src, std::size_t(c.outCount) * esize);
      break;
    }
    case world::OpKind::kAllToAll: {
      // An in-place exchange overwrites blocks other ranks still need: stage the inputs first.
      const std::size_t blockBytes = std::size_t(c.inCount / n) * esize;
      bool inPlace = false;
      for (int r = 0; r < n; ++r) inPlace = inPlace || c.in[r].data() == c.out[r].data();
      std::vector<const char*> src(n);
      for (int q = 0; q < n; ++q) src[q] = static_cast<const char*>(c.in[q].data());
      if (inPlace) {
        if (scratch_.size() < std::size_t(n) * n * blockBytes) scratch_.resize(std::size_t(n) * n * blockBytes);
        for (int q = 0; q < n; ++q) {
          std::memcpy(scratch_.data() + q * n * blockBytes, src[q], n * blockBytes);
          src[q] = scratch_.data() + q * n * blockBytes;
        }
      }
      for (int r = 0; r < n; ++r)
        for (int q = 0; q < n; ++q)
          std::memcpy(static_cast<char*>(c.out[r].data()) + q * blockBytes, src[q] + r * blockBytes, blockBytes);
      break;
    }
    case world::OpKind::kBarrier:
    case world::OpKind::kSplit: break;
  }
  return nullptr;
}

World::World(WorldOptions options) : World(options, std::make_shared<HostTransport>()) {}

World::World(WorldOptions options, std::shared_ptr<world::Transport> transport)
    : rendezvous_("sim", options), transport_(std::move(transport)) {
  const int threads =
      options.threads > 0 ? options.threads : std::max(1, int(std::thread::hardware_concurrency()));
  const int rankWorkers = rendezvous_.options().threads;  // min(threads, size)
  if (threads > rankWorkers) gemmPool_ = std::make_unique<HostPool>(threads - rankWorkers);
  // One SimCompute per rank keeps the rendezvous' contract uniform across backends.
  for (int r = 0; r < rendezvous_.options().size; ++r)
    computes_.push_back(std::make_shared<SimCompute>(gemmPool_.get()));
}

void World::run(const std::function<void(RankContext&)>& fn) {
  rendezvous_.run(fn, computes_, transport_);
  releaseCachedHostBlocks();  // the ranks' tensors are freed; their memory is the caller's again
}

}  // namespace tpsim::sim
