// GTP_remat (SPEC 4): a TP-local weight sharded again along dim 0 over a GTP_remat group,
// rematerialized (all-gathered, padding stripped) before each GEMM, its weight gradient
// reduce-scattered back into the shard's main_grad.
//
// gtpRematShardDim0 is the padding rule (4.2), wrapGtp turns a layer's full TP-local weight into
// its shard (4.3), materialize is 4.4 and GtpGradReducer is 4.5-4.6. The sim runs every gather
// synchronously (no prefetch chain); reduce-scatters may be deferred by one weight, as Megatron's
// async reduction does, which changes when main_grad is written, never what it holds.
#pragma once

#include <memory>
#include <optional>

#include "backends/collectives.h"
#include "backends/compute.h"
#include "core/config.h"
#include "core/parameter.h"

namespace tpsim {

struct GtpShardGeometry {
  std::int64_t rows;        // S: rows per shard, padding included
  std::int64_t padLength;   // zero rows appended to the TP-local dim 0 before slicing
};

// gtp_remat_shard_dim0 (SPEC 4.2): with a > 0 pad dLog up to a multiple of a·G; with a = 0 dLog
// must divide by G.
GtpShardGeometry gtpRematShardDim0(std::int64_t dLog, int groupSize, int padForAlignment);

// Replaces weight.data, the full TP-local weight (dLog, ...), by this rank's shard (S, ...) of
// the padded weight, and stamps pad_length, is_gtp_weight_remat, group and gtp_replica_group
// (SPEC 4.3). requires_grad is kept (SPEC 8 item 24). A group of size 1 changes nothing.
void wrapGtp(Compute& compute, Parameter& weight, Collectives& group, int padForAlignment,
             Collectives* replicaGroup = nullptr);

bool isGtpShard(const Parameter& p);

// The TP-local weight (dLog, ...) behind a GTP shard: all-gather along dim 0 in GTP-rank order,
// strip the pad rows (SPEC 4.4). `weight` views the leading rows of `gathered`.
struct Materialized {
  SharedTensor gathered;  // (S·G, ...), which the GTP_remat group's members may share
  ConstView weight; // (dLog, ...)
};
Materialized materialize(Compute& compute, const Parameter& shard);

// reduce_scatter_with_fp32_accumulation (SPEC 4.6), on any group: rank r gets block r of Σ_q in_q,
// exchanged by an all-to-all in the wire dtype, summed in fp32 and rounded once. At group size <= 2
// it is the plain reduce-scatter (one addition rounds the same either way). in: (n·m, ...)
// out: (m, ...). Returns whether the fp32 path ran.
bool reduceScatterWithFp32Accumulation(Compute& compute, Collectives& group, ConstView in, View out);

struct GtpReduceOptions {
  bool mean = true;               // MEAN (pre-scale 1/G) unless calculate_per_token_loss: SUM
  bool fp32AccumReduceScatter = false;  // all-to-all + fp32 sum; bypassed at G <= 2 (4.6)
  bool async = false;             // defer each finalize to the next weight's reduce-scatter

  // The reduction the config asks for: SUM under calculate_per_token_loss, else MEAN, and the
  // fp32-accumulation variant under gtp_reduce_scatter_with_fp32_accumulation. `async` is the
  // caller's scheduling choice, not the config's.
  static GtpReduceOptions fromConfig(const ModelParallelConfig& config, bool async);
};

// The weight-gradient reduce-scatter of every GTP shard of one rank (SPEC 4.5). Call drain()
// before anything reads main_grad.
class GtpGradReducer {
 public:
  GtpGradReducer(Compute& compute, GtpReduceOptions options);
  ~GtpGradReducer();

  // dW: the logical wgrad (dLog, ...) in the wire dtype; it is pre-scaled in place under MEAN.
  // Returns the dummy gradient (param dtype, main_grad's shape, zeroed iff zero_out_wgrad) when
  // the reduction completed synchronously, and an undefined Tensor (None) when it was deferred.
  Tensor reduceScatter(Parameter& shard, View dW);
  // The tensor to make a wgrad of `shard` in, so that the reduce-scatter takes it as its send buffer
  // instead of a padded copy: (S·G, ...) in `dtype`, the rows past dLog zero; the wgrad goes in rows
  // [0, dLog).
  Tensor paddedWgrad(const Parameter& shard, DType dtype);
  // reduceScatter of a paddedWgrad holding the wgrad, which the caller gives up; its rows [0, dLog)
  // are pre-scaled in place under MEAN.
  Tensor reduceScatterPadded(Parameter& shard, Tensor padded);
  // Finalizes the reduce-scatter still in flight, if any.
  void drain();

  const GtpReduceOptions& options() const { return options_; }
  // How many reduce-scatters used the fp32-accumulation all-to-all (0 at G <= 2).
  int fp32AccumDispatches() const { return fp32Dispatches_; }

 private:
  struct Pending;
  // main_grad is there to reduce into, and an earlier reduction of the same shard has landed.
  void checkCanReduce(Parameter& shard);
  // Starts the reduction of a pre-scaled padded wgrad (finalized at once unless async).
  Tensor issue(Parameter& shard, Tensor padded);
  void finalize(Pending& p);

  Compute& compute_;
  GtpReduceOptions options_;
  std::unique_ptr<Pending> pending_;
  int fp32Dispatches_ = 0;
};

}  // namespace tpsim
