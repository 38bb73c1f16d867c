#include "backends/collectives.h"

#include "backends/compute.h"

namespace tpsim {

const char* reduceOpName(ReduceOp op) { return op == ReduceOp::kSum ? "sum" : "mean"; }

std::unique_ptr<Work> Collectives::allGatherShared(ConstView in, const Shape& outShape, Compute& compute,
                                                   SharedTensor& out, const CollectiveOptions& opts) {
  auto own = std::make_shared<Tensor>(compute.empty(outShape, in.dtype()));
  std::unique_ptr<Work> work = allGather(in, *own, opts);
  out = std::move(own);
  return work;
}

namespace {

// A collective's Work that keeps the input it was given until the collective is done.
class HoldingWork final : public Work {
 public:
  HoldingWork(std::unique_ptr<Work> inner, Tensor held) : held_(std::move(held)), inner_(std::move(inner)) {}
  void wait() override {
    inner_->wait();
    held_ = Tensor();
  }
  bool isCompleted() override { return inner_->isCompleted(); }

 private:
  Tensor held_;  // declared first: destroyed after inner_, which may still read it
  std::unique_ptr<Work> inner_;
};

}  // namespace

void Collectives::checkOutsideConsumed(ConstView in, ConstView out) const {
  const auto inBegin = reinterpret_cast<std::uintptr_t>(in.data());
  const auto outBegin = reinterpret_cast<std::uintptr_t>(out.data());
  const bool disjoint = in.bytes() == 0 || out.bytes() == 0 || inBegin + in.bytes() <= outBegin ||
                        outBegin + out.bytes() <= inBegin;
  TPSIM_CHECK(disjoint, "reduceScatterConsuming on ", label(), " (rank ", rank(),
              "): out must not lie in the input given up, got in ", in.str(), " and out ", out.str(),
              " overlapping");
}

std::unique_ptr<Work> Collectives::reduceScatterConsuming(Tensor in, View out, const ReduceScatterOptions& opts) {
  checkOutsideConsumed(in, out);
  std::unique_ptr<Work> work = reduceScatter(in, out, opts);
  return std::make_unique<HoldingWork>(std::move(work), std::move(in));
}

const char* collectiveFailureName(CollectiveFailure kind) {
  switch (kind) {
    case CollectiveFailure::kPeerFailed: return "peer failed";
    case CollectiveFailure::kMismatch: return "mismatch";
    case CollectiveFailure::kDeadlock: return "deadlock";
    case CollectiveFailure::kTimeout: return "timeout";
    case CollectiveFailure::kDroppedWork: return "dropped work";
    case CollectiveFailure::kBackend: return "backend";
    case CollectiveFailure::kStopped: return "stopped";
  }
  return "unknown";
}

}  // namespace tpsim
