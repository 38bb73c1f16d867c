#include "core/gtp.h"

#include <algorithm>
#include <utility>

#include "backends/errors.h"
#include "core/linear.h"

namespace tpsim {
namespace {

struct ShardInfo {
  Collectives* group;
  std::int64_t rows, padLength, dLog;
};

ShardInfo shardInfo(const Parameter& shard, const char* where) {
  TPSIM_CHECK(isGtpShard(shard), where, ": ", shard.name, " must be a GTP_remat shard (wrapGtp)");
  Collectives* group = *shard.attrs.group;
  TPSIM_CHECK(group != nullptr, where, ": ", shard.name, " has no GTP_remat group");
  const std::int64_t rows = shard.data.shape()[0], pad = shard.attrs.padLength.value_or(0);
  return {group, rows, pad, rows * group->size() - pad};
}

Shape withDim0(Shape s, std::int64_t d0) {
  s[0] = d0;
  return s;
}

// out = the fp32 sum of the n blocks of `received` (n·m, ...), rounded once into out (m, ...).
void sumBlocksInFp32(Compute& compute, ConstView received, int n, View out) {
  const std::int64_t rows = out.shape()[0];
  Tensor acc = compute.zeros(out.shape(), DType::kFloat32);  // (m, ...)
  for (int q = 0; q < n; ++q) compute.axpy(1.f, received.slice(0, q * rows, (q + 1) * rows), acc);
  compute.copy(acc, out);
}

}  // namespace

bool reduceScatterWithFp32Accumulation(Compute& compute, Collectives& group, ConstView in, View out) {
  if (group.size() <= 2) {
    group.reduceScatter(in, out)->wait();
    return false;
  }
  Tensor received = compute.empty(in.shape(), in.dtype());  // (n·m, ...): block q from peer q
  group.allToAll(in, received)->wait();
  sumBlocksInFp32(compute, received, group.size(), out);
  return true;
}

GtpShardGeometry gtpRematShardDim0(std::int64_t dLog, int groupSize, int padForAlignment) {
  TPSIM_CHECK(groupSize >= 1, "gtpRematShardDim0: the GTP_remat size must be >= 1, got ", groupSize);
  TPSIM_CHECK(padForAlignment >= 0, "gtpRematShardDim0: pad_for_alignment must be >= 0, got ", padForAlignment);
  TPSIM_CHECK(dLog >= 0, "gtpRematShardDim0: dim 0 must be >= 0, got ", dLog);
  if (padForAlignment > 0) {
    const std::int64_t align = std::int64_t(padForAlignment) * groupSize;
    const std::int64_t pad = (align - dLog % align) % align;
    return {(dLog + pad) / groupSize, pad};
  }
  TPSIM_CHECK(dLog % groupSize == 0, "gtpRematShardDim0: with pad_for_alignment 0 the TP-local dim 0 (", dLog,
              ") must be divisible by the GTP_remat size ", groupSize, "; set pad_for_alignment > 0 to pad it");
  return {dLog / groupSize, 0};
}

bool isGtpShard(const Parameter& p) { return p.attrs.isGtpWeightRemat.value_or(false); }

void wrapGtp(Compute& compute, Parameter& weight, Collectives& group, int padForAlignment,
             Collectives* replicaGroup) {
  if (group.size() == 1 || !weight.data.defined() || isGtpShard(weight)) return;
  TPSIM_CHECK(!weight.hasGrad() && !weight.hasMainGrad(), "wrapGtp: ", weight.name,
              " must be wrapped before its gradients are allocated");
  const std::int64_t dLog = weight.data.shape()[0];
  const GtpShardGeometry geo = gtpRematShardDim0(dLog, group.size(), padForAlignment);
  Tensor shard = compute.zeros(withDim0(weight.data.shape(), geo.rows), weight.data.dtype());  // (S, ...)
  // Rows [g·S, (g+1)·S) of the padded weight; the part past dLog is padding and stays zero.
  const std::int64_t begin = std::min(group.rank() * geo.rows, dLog);
  const std::int64_t end = std::min((group.rank() + 1) * geo.rows, dLog);
  if (end > begin) compute.copy(weight.data.view().slice(0, begin, end), shard.view().slice(0, 0, end - begin));
  weight.data = std::move(shard);
  weight.attrs.padLength = int(geo.padLength);
  weight.attrs.isGtpWeightRemat = true;
  weight.attrs.group = &group;
  if (replicaGroup) weight.attrs.gtpReplicaGroup = replicaGroup;
}

Materialized materialize(Compute& compute, const Parameter& shard) {
  const ShardInfo info = shardInfo(shard, "materialize");
  Materialized m;
  info.group->allGatherShared(shard.data, withDim0(shard.data.shape(), info.rows * info.group->size()), compute,
                              m.gathered)->wait();
  m.weight = m.gathered->view().slice(0, 0, info.dLog);
  return m;
}

struct GtpGradReducer::Pending {
  Parameter* shard;
  Tensor padded;    // (S·G, ...) the pre-scaled, padded wgrad: the all-to-all's send buffer
  Tensor received;  // (S·G, ...) the all-to-all's chunks, fp32-accumulation variant only
  Tensor result;    // (S, ...)
  std::unique_ptr<Work> work;
};

GtpReduceOptions GtpReduceOptions::fromConfig(const ModelParallelConfig& config, bool async) {
  return {!config.calculatePerTokenLoss, config.gtpReduceScatterWithFp32Accumulation, async};
}

GtpGradReducer::GtpGradReducer(Compute& compute, GtpReduceOptions options) : compute_(compute), options_(options) {}

GtpGradReducer::~GtpGradReducer() = default;

Tensor GtpGradReducer::reduceScatter(Parameter& shard, View dW) {
  const ShardInfo info = shardInfo(shard, "GtpGradReducer::reduceScatter");
  TPSIM_CHECK(dW.shape() == withDim0(shard.data.shape(), info.dLog), "GtpGradReducer::reduceScatter: the wgrad of ",
              shard.name, " must be the logical TP-local shape ", withDim0(shard.data.shape(), info.dLog).str(),
              ", got ", dW.str());
  checkCanReduce(shard);
  if (options_.mean) compute_.scale(dW, 1.f / float(info.group->size()));
  Tensor padded = paddedWgrad(shard, dW.dtype());
  compute_.copy(dW, padded.view().slice(0, 0, info.dLog));
  return issue(shard, std::move(padded));
}

Tensor GtpGradReducer::paddedWgrad(const Parameter& shard, DType dtype) {
  const ShardInfo info = shardInfo(shard, "GtpGradReducer::paddedWgrad");
  const std::int64_t rows = info.rows * info.group->size();
  Tensor padded = compute_.empty(withDim0(shard.data.shape(), rows), dtype);
  if (rows > info.dLog) compute_.fill(padded.view().slice(0, info.dLog, rows), 0.0);
  return padded;
}

Tensor GtpGradReducer::reduceScatterPadded(Parameter& shard, Tensor padded) {
  const ShardInfo info = shardInfo(shard, "GtpGradReducer::reduceScatterPadded");
  const Shape want = withDim0(shard.data.shape(), info.rows * info.group->size());
  TPSIM_CHECK(padded.shape() == want, "GtpGradReducer::reduceScatterPadded: the padded wgrad of ", shard.name,
              " must have shape ", want.str(), ", got ", padded.shape().str());
  checkCanReduce(shard);
  if (options_.mean) compute_.scale(padded.view().slice(0, 0, info.dLog), 1.f / float(info.group->size()));
  return issue(shard, std::move(padded));
}

void GtpGradReducer::checkCanReduce(Parameter& shard) {
  TPSIM_CHECK(shard.hasMainGrad(), "GtpGradReducer::reduceScatter: ", shard.name,
              ".main_grad must be allocated before backward (GTP_remat accumulates into it)");
  // A weight used twice in one pass: its earlier reduction lands first.
  if (pending_ && pending_->shard == &shard) {
    finalize(*pending_);
    pending_.reset();
  }
}

Tensor GtpGradReducer::issue(Parameter& shard, Tensor padded) {
  Collectives& group = **shard.attrs.group;
  const int g = group.size();
  auto p = std::make_unique<Pending>();
  p->shard = &shard;
  p->padded = std::move(padded);
  p->result = compute_.empty(shard.data.shape(), p->padded.dtype());
  if (options_.fp32AccumReduceScatter && g > 2) {
    // Rank q receives chunk q of every peer, then sums them in fp32 and rounds once (4.6).
    p->received = compute_.empty(p->padded.shape(), p->padded.dtype());
    p->work = group.allToAll(p->padded, p->received);
    ++fp32Dispatches_;
  } else {
    // Given up: where the group's ranks share memory, each one's padded wgrad is added to the sum
    // and freed as it arrives, not held until the last peer's.
    p->work = group.reduceScatterConsuming(std::move(p->padded), p->result);
  }
  if (!options_.async) {
    finalize(*p);
    return dummyWgrad(compute_, shard, shard.data.dtype());
  }
  std::unique_ptr<Pending> previous = std::move(pending_);
  pending_ = std::move(p);
  if (previous) finalize(*previous);
  return Tensor();
}

void GtpGradReducer::drain() {
  if (!pending_) return;
  finalize(*pending_);
  pending_.reset();
}

void GtpGradReducer::finalize(Pending& p) {
  p.work->wait();
  if (p.received.defined()) sumBlocksInFp32(compute_, p.received, (*p.shard->attrs.group)->size(), p.result);
  Parameter& shard = *p.shard;
  TPSIM_CHECK(shard.mainGrad.dtype() == p.result.dtype() || shard.mainGrad.dtype() == DType::kFloat32 ||
                  shard.mainGrad.dtype() == DType::kFloat64,
              "GtpGradReducer: main_grad of ", shard.name, " (", dtypeName(shard.mainGrad.dtype()),
              ") cannot hold the ", dtypeName(p.result.dtype()), " reduce-scatter result");
  compute_.axpy(1.f, p.result, shard.mainGrad);
  if (shard.attrs.gradAddedToMainGrad.has_value()) shard.attrs.gradAddedToMainGrad = true;
}

}  // namespace tpsim
