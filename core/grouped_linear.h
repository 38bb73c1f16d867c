// GroupedParallelLinear: the E local experts of an MoE layer as one grouped GEMM (Transformer
// Engine's GroupedLinear as Megatron's TEColumnParallelGroupedLinear / TERowParallelGroupedLinear
// use it), with EGTP_remat batching (SPEC 4.8).
//
// Expert i owns weight{i}, W_i: (N/T, K) in column mode, (N, K/T) in row mode. Tokens arrive sorted
// by expert with mSplits[i] rows each, and rows of expert i compute y = x·W_iᵀ + b_i. The layer does
// no TP communication: the token dispatcher moves tokens and reduces partial sums (explicit expert
// communication). Under a GTP_remat group of size > 1 every W_i becomes a GTP shard stamped with
// expert_idx = i, and weight0's weight_list names all E shards: that batch is gathered with one
// all-gather and its wgrads reduce-scattered with one reduce-scatter. Not an MoE router or
// dispatcher; every expert weight is trainable.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "backends/compute.h"
#include "core/config.h"
#include "core/layers.h"
#include "core/parameter.h"
#include "core/random.h"

namespace tpsim {

enum class GroupedParallelMode : std::uint8_t {
  kColumn,  // W_i: (N/T, K), y_i: (m_i, N/T)
  kRow,     // W_i: (N, K/T), y_i: (m_i, N), partial over TP
};

struct GroupedLinearOptions {
  int numGemms = 1;  // E: local experts, one GEMM each
  GroupedParallelMode parallelMode = GroupedParallelMode::kColumn;
  bool bias = true;
  bool isExpert = true;  // false only without TP (T = 1): a non-expert layer would need TP communication
  std::string name = "experts";
};

class GroupedParallelLinear {
 public:
  // ctx.tp is the expert TP group (size T); ctx.gtp the resolved EGTP_remat group. Each W_i is
  // initialized like a ColumnParallelLinear (CPU) or RowParallelLinear weight, one after another from
  // the same generator or tracker stream, so the experts differ.
  GroupedParallelLinear(LayerContext ctx, const ModelParallelConfig& config, std::int64_t inputSize,
                        std::int64_t outputSize, const InitMethod& initMethod, GroupedLinearOptions options = {});
  // weight0's weight_list points at the other experts' Parameters.
  GroupedParallelLinear(const GroupedParallelLinear&) = delete;
  GroupedParallelLinear& operator=(const GroupedParallelLinear&) = delete;

  // input: (M, K/T) in row mode, else (M, K), rows sorted by expert. mSplits: E counts summing to
  // M. Returns (M, N/T) in column mode, else (M, N). In row mode with T > 1 the output is partial
  // over TP, and only TP rank 0 adds the bias, so the caller's sum over TP adds it once. The
  // caller keeps input alive until backward.
  Tensor forward(ConstView input, const std::vector<std::int64_t>& mSplits);
  // dOutput: the output's shape. Returns dInput, the input's shape (partial over TP in column
  // mode). Adds each expert's wgrad into its main_grad (GTP_remat, or gradient-accumulation fusion)
  // or its grad, and each bias gradient into the bias's grad. Under GTP_remat the batch's
  // reduce-scatter is synchronous, and ctx.gtpReducer's deferred one, if any, is finalized first.
  Tensor backward(ConstView dOutput);

  int numGemms() const { return int(weights_.size()); }
  GroupedParallelMode parallelMode() const { return options_.parallelMode; }
  Collectives& tpGroup() const { return ctx_.tp; }  // the expert TP group it was built with
  Parameter& weight(int expert);
  Parameter* bias(int expert);
  std::int64_t inputSizePerPartition() const { return kLocal_; }
  std::int64_t outputSizePerPartition() const { return nLocal_; }
  // True when the weights are GTP_remat shards gathered and reduce-scattered as one batch.
  bool gtpBatched() const { return weights_.front().attrs.weightList.has_value(); }

  // Collectives issued for the batch: one all-gather per forward and per backward, one
  // reduce-scatter per backward, whatever E is. fp32AccumDispatches counts the reduce-scatters
  // that ran as the fp32-accumulation all-to-all (SPEC 4.6; none at G <= 2).
  int coalescedGathers() const { return coalescedGathers_; }
  int coalescedReduceScatters() const { return coalescedReduceScatters_; }
  int fp32AccumDispatches() const { return fp32AccumDispatches_; }

 private:
  std::vector<Tensor> gatherWeights();
  void reduceScatterWgrads(const std::vector<ConstView>& xs, const std::vector<ConstView>& dys);
  void accumulateWgrads(const std::vector<ConstView>& xs, const std::vector<ConstView>& dys);

  LayerContext ctx_;
  ModelParallelConfig config_;
  GroupedLinearOptions options_;
  std::int64_t kLocal_, nLocal_;
  bool addsBias_ = false;  // row mode: TP rank 0 only
  std::vector<Parameter> weights_;  // never resized: weight_list points into it
  std::vector<Parameter> biases_;
  // Saved by forward for backward.
  std::optional<ConstView> input_;  // (M, K_local)
  std::vector<std::int64_t> offsets_;  // E + 1 row offsets: expert i owns rows [offsets_[i], offsets_[i+1])
  int coalescedGathers_ = 0, coalescedReduceScatters_ = 0, fp32AccumDispatches_ = 0;
};

}  // namespace tpsim
