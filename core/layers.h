// ColumnParallelLinear and RowParallelLinear (SPEC 3.18, 3.19) with explicit forward and backward.
//
// Column splits W's output rows across the TP group: W_t (N/T, K), y_t = x·W_tᵀ + b_t. Row splits
// W's input columns: W_t (N, K/T), y = Σ_t x_t·W_tᵀ + b with the bias added once after the
// reduction. Each layer owns its Parameters; backward() applies the gradients the way autograd
// and Megatron's fused paths would: weight.grad += dW (or main_grad += dW under fusion), bias.grad
// += db. One forward must be followed by its backward before the next forward (one saved context).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "backends/collectives.h"
#include "backends/compute.h"
#include "core/config.h"
#include "core/gtp.h"
#include "core/linear.h"
#include "core/parameter.h"
#include "core/random.h"

namespace tpsim {

// What a layer's constructor needs from its rank besides the config.
struct LayerContext {
  Compute& compute;
  Collectives& tp;                 // the layer's TP group (the expert TP group for expert layers)
  RngTracker* rngTracker = nullptr;  // GPU-style initialization (use_cpu_initialization = false)
  Generator* cpuGenerator = nullptr;  // CPU initialization: the master weight's generator
  // GTP_remat (SPEC 4): the group the layer resolved (EGTP for expert layers; nullptr or size 1 =
  // off), the gtp-excluded replica group stamped for checkpoints, and the rank's wgrad reducer.
  Collectives* gtp = nullptr;
  Collectives* gtpReplica = nullptr;
  GtpGradReducer* gtpReducer = nullptr;

  bool gtpActive() const { return gtp != nullptr && gtp->size() > 1; }
};

struct LayerOutput {
  Tensor output;
  const Parameter* outputBias = nullptr;  // the bias, when skip_bias_add hands it to the caller
};

struct ColumnParallelOptions {
  bool bias = true;
  bool gatherOutput = false;
  int stride = 1;
  bool keepMasterWeightForTest = false;
  bool skipBiasAdd = false;
  bool skipWeightParamAllocation = false;
  std::vector<Tensor>* embeddingActivationBuffer = nullptr;  // wgrad deferral (3.20)
  std::vector<Tensor>* gradOutputBuffer = nullptr;
  bool isExpert = false;
  // No TP reduction of dX at all (T > 1): backward returns this rank's partial dY_t·W_t and the
  // caller reduces it. Rejected under sequence parallelism.
  bool disableGradReduce = false;
  std::optional<DType> outputDtype;
  std::string name = "column";
  std::string tpCommBufferName;  // Transformer Engine's userbuffer name: recorded, no effect here
};

class ColumnParallelLinear {
 public:
  ColumnParallelLinear(LayerContext ctx, const ModelParallelConfig& config, std::int64_t inputSize,
                       std::int64_t outputSize, const InitMethod& initMethod, ColumnParallelOptions options = {});

  // input: (…, K), or (s/T, b, K) under sequence parallelism. weight: replaces the layer's own
  // (N/T, K) weight for this call (required with skip_weight_param_allocation).
  // Returns (…, N/T), or (…, N) with gather_output (runtimeGatherOutput overrides it).
  LayerOutput forward(ConstView input, Parameter* weight = nullptr,
                      std::optional<bool> runtimeGatherOutput = std::nullopt);
  // dOutput: the output's shape. dOutputBias: the gradient of the returned bias under
  // skip_bias_add. Returns dInput, the input's shape.
  Tensor backward(ConstView dOutput, ConstView dOutputBias = ConstView());

  void backwardDw() {}  // delayed wgrad is not supported, as in Megatron
  // Megatron keeps an `_extra_state` key for Transformer Engine compatibility; its value is None.
  void setExtraState(const std::optional<std::string>&) {}
  std::optional<std::string> getExtraState() const { return std::nullopt; }
  std::string extraRepr() const;

  Parameter* weight() { return weight_ ? &*weight_ : nullptr; }
  Parameter* bias() { return bias_ ? &*bias_ : nullptr; }
  // The fp32 master weight (N, K) with CPU initialization and keep_master_weight_for_test.
  const Tensor& masterWeight() const { return masterWeight_; }
  bool sequenceParallel() const { return sequenceParallel_; }
  bool allreduceDgrad() const { return allreduceDgrad_; }
  std::int64_t inputSize() const { return inputSize_; }
  std::int64_t outputSize() const { return outputSize_; }
  std::int64_t outputSizePerPartition() const { return outputSizePerPartition_; }
  const ColumnParallelOptions& options() const { return options_; }
  WeightFormat weightFormat() const { return config_.weightFormat; }
  Compute& compute() const { return ctx_.compute; }

 private:
  LayerContext ctx_;
  ModelParallelConfig config_;
  ColumnParallelOptions options_;
  std::int64_t inputSize_, outputSize_, outputSizePerPartition_;
  bool sequenceParallel_ = false;
  bool allreduceDgrad_ = false;
  bool explicitExpertComm_ = false;
  std::optional<Parameter> weight_, bias_;
  Tensor masterWeight_;
  // Saved by forward for backward.
  std::optional<LinearWithGradAccumulation> linear_;
  std::optional<LinearWithFrozenWeight> frozen_;
  Parameter* usedWeight_ = nullptr;
  bool gathered_ = false;
};

struct RowParallelOptions {
  bool bias = true;
  bool inputIsParallel = false;
  bool skipBiasAdd = false;
  int stride = 1;
  bool keepMasterWeightForTest = false;
  bool isExpert = false;
  std::string name = "row";
  std::string tpCommBufferName;  // as in ColumnParallelOptions
};

class RowParallelLinear {
 public:
  RowParallelLinear(LayerContext ctx, const ModelParallelConfig& config, std::int64_t inputSize,
                    std::int64_t outputSize, const InitMethod& initMethod, RowParallelOptions options = {});

  // input: (…, K/T) with input_is_parallel, else (…, K). Returns (…, N), or (s/T, b, N) under
  // sequence parallelism.
  LayerOutput forward(ConstView input);
  Tensor backward(ConstView dOutput, ConstView dOutputBias = ConstView());

  void backwardDw() {}
  void setExtraState(const std::optional<std::string>&) {}
  std::optional<std::string> getExtraState() const { return std::nullopt; }
  std::string extraRepr() const;

  Parameter& weight() { return weight_; }
  Parameter* bias() { return bias_ ? &*bias_ : nullptr; }
  const Tensor& masterWeight() const { return masterWeight_; }
  bool sequenceParallel() const { return sequenceParallel_; }
  std::int64_t inputSize() const { return inputSize_; }
  std::int64_t outputSize() const { return outputSize_; }
  std::int64_t inputSizePerPartition() const { return inputSizePerPartition_; }
  const RowParallelOptions& options() const { return options_; }
  WeightFormat weightFormat() const { return config_.weightFormat; }
  Compute& compute() const { return ctx_.compute; }

 private:
  LayerContext ctx_;
  ModelParallelConfig config_;
  RowParallelOptions options_;
  std::int64_t inputSize_, outputSize_, inputSizePerPartition_;
  bool sequenceParallel_ = false;
  bool explicitExpertComm_ = false;
  Parameter weight_;
  std::optional<Parameter> bias_;
  Tensor masterWeight_;
  std::optional<LinearWithGradAccumulation> linear_;
  std::optional<LinearWithFrozenWeight> frozen_;
  Tensor scatteredInput_;  // (…, K/T) when the layer split the input itself
};

// grad += g (or grad = g when there is none yet): how autograd applies a returned gradient.
void accumulateGrad(Compute& compute, Parameter& param, Tensor g);

}  // namespace tpsim
