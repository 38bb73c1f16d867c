#include "core/layers.h"

#include <utility>

#include "backends/errors.h"
#include "core/attributes.h"
#include "core/init.h"
#include "core/mappings.h"
#include "core/utils.h"

namespace tpsim {
namespace {

void checkGtp(const LayerContext& ctx, const char* where) {
  TPSIM_CHECK(!ctx.gtpActive() || ctx.gtpReducer != nullptr, where, ": a GTP_remat group of size ", ctx.gtp->size(),
              " needs LayerContext::gtpReducer to reduce the weight gradients");
}

// Megatron's three initialization paths (SPEC 3.18 step 4, 3.19 step 4). Returns the master weight
// when CPU initialization keeps it.
Tensor initializeWeight(LayerContext& ctx, const ModelParallelConfig& c, Parameter& w, std::int64_t outputSize,
                        std::int64_t inputSize, std::int64_t perPartition, int partitionDim, int stride,
                        const InitMethod& init, bool keepMaster, DType masterDtype, bool isExpert,
                        const char* where) {
  if (c.useCpuInitialization && c.performInitialization) {
    TPSIM_CHECK(ctx.cpuGenerator != nullptr, where, ": use_cpu_initialization needs LayerContext::cpuGenerator");
    return initializeAffineWeightCpu(ctx.compute, w, outputSize, inputSize, perPartition, partitionDim, init,
                                     *ctx.cpuGenerator, stride, keepMaster, masterDtype, ctx.tp.rank(),
                                     ctx.tp.size(), false);
  }
  if (c.performInitialization) {
    TPSIM_CHECK(ctx.rngTracker != nullptr, where, ": GPU-style initialization needs LayerContext::rngTracker");
    initializeAffineWeightGpu(ctx.compute, w, init, partitionDim, stride, isExpert, *ctx.rngTracker);
    return Tensor();
  }
  // No initialization: Megatron leaves torch.empty garbage; zeros keep runs reproducible.
  setTensorModelParallelAttributes(w.attrs, true, partitionDim, stride);
  ctx.compute.fill(w.data, 0.0);
  return Tensor();
}

Parameter makeParameter(Compute& compute, const std::string& name, Shape shape, DType dtype) {
  Parameter p;
  p.name = name;
  p.data = compute.empty(shape, dtype);
  return p;
}

// The weight gradient a linear function returned, applied as autograd would. A dummy stands for
// a wgrad already in main_grad: it replaces grad, which the DDP hook consumes and clears.
void applyWeightGrad(Compute& compute, Parameter& weight, LinearGrads& g) {
  if (!g.dW.defined()) return;
  if (g.dWIsDummy)
    weight.grad = std::move(g.dW);
  else
    accumulateGrad(compute, weight, std::move(g.dW));
}

Tensor copyOf(Compute& compute, ConstView v) {
  Tensor t = compute.empty(v.shape(), v.dtype());
  compute.copy(v, t);
  return t;
}

const char* pyBool(bool b) { return b ? "True" : "False"; }

}  // namespace

void accumulateGrad(Compute& compute, Parameter& param, Tensor g) {
  if (param.grad.defined()) {
    compute.axpy(1.f, g, param.grad);
  } else if (g.dtype() == param.data.dtype()) {
    param.grad = std::move(g);
  } else {
    param.grad = compute.empty(param.data.shape(), param.data.dtype());
    compute.copy(g, param.grad);
  }
}

// ---- ColumnParallelLinear -------------------------------------------------------------------

ColumnParallelLinear::ColumnParallelLinear(LayerContext ctx, const ModelParallelConfig& config,
                                           std::int64_t inputSize, std::int64_t outputSize,
                                           const InitMethod& initMethod, ColumnParallelOptions options)
    : ctx_(ctx), config_(config), options_(std::move(options)), inputSize_(inputSize), outputSize_(outputSize) {
  const char* where = "ColumnParallelLinear";
  config_.validate();
  checkGtp(ctx_, where);
  checkMxfp8Alignment(config_.weightFormat, ctx_.gtpActive() ? ctx_.gtp->size() : 1, config_.gtpPadForAlignment, where);
  const int T = ctx_.tp.size();
  outputSizePerPartition_ = divide(outputSize, T, "ColumnParallelLinear: output_size by the TP size");
  const bool expertParallel = config_.expertModelParallelSize > 1;
  explicitExpertComm_ = options_.isExpert && (T > 1 || expertParallel);
  const bool expertPgs = config_.useExpertPgs(options_.isExpert);
  Compute& compute = ctx_.compute;
  if (!options_.skipWeightParamAllocation) {
    weight_ = makeParameter(compute, options_.name + ".weight", {outputSizePerPartition_, inputSize},
                            config_.paramsDtype);
    // ColumnParallelLinear passes no params_dtype to CPU init: its master stays fp32 (SPEC 3.11).
    masterWeight_ = initializeWeight(ctx_, config_, *weight_, outputSize, inputSize, outputSizePerPartition_, 0,
                                     options_.stride, initMethod, options_.keepMasterWeightForTest,
                                     DType::kFloat32, options_.isExpert, where);
    weight_->attrs.allreduce = !expertPgs;
    if (ctx_.gtpActive()) wrapGtp(compute, *weight_, *ctx_.gtp, config_.gtpPadForAlignment, ctx_.gtpReplica);
  }
  if (options_.bias) {  // never GTP_remat-sharded
    bias_ = makeParameter(compute, options_.name + ".bias", {outputSizePerPartition_}, config_.paramsDtype);
    setTensorModelParallelAttributes(bias_->attrs, true, 0, options_.stride);
    compute.fill(bias_->data, 0.0);
    bias_->attrs.allreduce = !expertPgs;
  }
  // Megatron warns and turns sequence parallelism off on a group of one.
  sequenceParallel_ = config_.sequenceParallel && T > 1;
  allreduceDgrad_ = T > 1 && !sequenceParallel_ && !options_.disableGradReduce;
  // Megatron reduce-scatters dX under sequence parallelism whatever disable_grad_reduce says (the
  // (s/T, b, K) input gradient exists only as that reduction), so a caller that then reduces dX
  // itself, as the flag asks, would reduce it twice.
  TPSIM_CHECK(!(options_.disableGradReduce && sequenceParallel_ && !explicitExpertComm_), where,
              ": disable_grad_reduce = True with sequence_parallel = True: the input gradient would still be "
              "reduce-scattered over TP; turn sequence_parallel off in this layer's config (the caller gathers "
              "the sequence and reduces dX) or disable_grad_reduce off");
  if (config_.deferEmbeddingWgradCompute)
    TPSIM_CHECK(options_.embeddingActivationBuffer && options_.gradOutputBuffer, where,
                ": defer_embedding_wgrad_compute needs both embedding_activation_buffer and grad_output_buffer; ",
                options_.embeddingActivationBuffer ? "grad_output_buffer" : "embedding_activation_buffer",
                " is missing");
}

LayerOutput ColumnParallelLinear::forward(ConstView input, Parameter* weight, std::optional<bool> runtimeGatherOutput) {
  Parameter* w = weight ? weight : this->weight();
  TPSIM_CHECK(w != nullptr, "ColumnParallelLinear::forward: weight was not supplied, and "
              "skip_weight_param_allocation left the layer without one");
  TPSIM_CHECK(!ctx_.gtpActive() || isGtpShard(*w), "ColumnParallelLinear::forward: the supplied weight ", w->name,
              " is not a GTP_remat shard but the layer's GTP_remat group has size ", ctx_.gtp->size(),
              "; wrap it with wrapGtp or give the layer no GTP_remat group");
  TPSIM_CHECK(isGtpShard(*w) || w->data.shape() == Shape({outputSizePerPartition_, inputSize_}),
              "ColumnParallelLinear::forward: supplied weight must be (", outputSizePerPartition_, ", ", inputSize_,
              "), got ", w->data.str());
  TPSIM_CHECK(input.rank() >= 1 && input.dim(-1) == inputSize_, "ColumnParallelLinear::forward: input must end in K=",
              inputSize_, ", got ", input.str());
  usedWeight_ = w;
  const Parameter* biasIn = options_.skipBiasAdd ? nullptr : bias();
  // copy_to_tensor_model_parallel_region is reached only at T = 1, where both its passes are
  // identities (SPEC 8 item 15), so it is not called.
  const bool defer = config_.deferEmbeddingWgradCompute;
  if (defer && (config_.wgradDeferralLimit == 0 ||
                int(options_.embeddingActivationBuffer->size()) < config_.wgradDeferralLimit))
    options_.embeddingActivationBuffer->push_back(copyOf(ctx_.compute, input));
  LinearOptions lo;
  lo.gradientAccumulationFusion = config_.gradientAccumulationFusion;
  lo.allreduceDgrad = explicitExpertComm_ ? false : allreduceDgrad_;
  lo.sequenceParallel = explicitExpertComm_ ? false : sequenceParallel_;
  lo.gradOutputBuffer = defer ? options_.gradOutputBuffer : nullptr;
  lo.wgradDeferralLimit = config_.wgradDeferralLimit;
  lo.outputDtype = options_.outputDtype;
  lo.gtpReducer = ctx_.gtpReducer;
  lo.weightFormat = config_.weightFormat;
  Tensor outputParallel;  // (…, N/T), or (s, b, N/T) under sequence parallelism
  linear_.reset();
  frozen_.reset();
  if (w->requiresGrad) {
    linear_.emplace(ctx_.compute, ctx_.tp, lo);
    outputParallel = linear_->forward(input, *w, biasIn);
  } else {
    frozen_.emplace(ctx_.compute, ctx_.tp, lo);
    outputParallel = frozen_->forward(input, *w, biasIn);
  }
  gathered_ = runtimeGatherOutput.value_or(options_.gatherOutput);
  LayerOutput out;
  out.output = gathered_ ? gatherFromTpRegionForward(ctx_.compute, ctx_.tp, outputParallel) : std::move(outputParallel);
  out.outputBias = options_.skipBiasAdd ? bias() : nullptr;
  return out;
}

Tensor ColumnParallelLinear::backward(ConstView dOutput, ConstView dOutputBias) {
  TPSIM_CHECK(linear_ || frozen_, "ColumnParallelLinear::backward: called before forward");
  Tensor split;
  ConstView dLocal = dOutput;  // (…, N/T)
  if (gathered_) {
    split = gatherFromTpRegionBackward(ctx_.compute, ctx_.tp, dOutput);
    dLocal = split;
  }
  LinearGrads g = linear_ ? linear_->backward(dLocal) : frozen_->backward(dLocal);
  if (linear_) applyWeightGrad(ctx_.compute, *usedWeight_, g);
  if (bias_ && g.db.defined()) accumulateGrad(ctx_.compute, *bias_, std::move(g.db));
  if (bias_ && options_.skipBiasAdd && dOutputBias.data()) accumulateGrad(ctx_.compute, *bias_, copyOf(ctx_.compute, dOutputBias));
  linear_.reset();
  frozen_.reset();
  return std::move(g.dX);
}

std::string ColumnParallelLinear::extraRepr() const {
  return detail::concat("in_features=", inputSize_, ", out_features=", outputSize_, ", bias=", pyBool(bias_.has_value()),
                        ", TP=", outputSize_ / outputSizePerPartition_);
}

// ---- RowParallelLinear ----------------------------------------------------------------------

RowParallelLinear::RowParallelLinear(LayerContext ctx, const ModelParallelConfig& config, std::int64_t inputSize,
                                     std::int64_t outputSize, const InitMethod& initMethod, RowParallelOptions options)
    : ctx_(ctx), config_(config), options_(std::move(options)), inputSize_(inputSize), outputSize_(outputSize) {
  const char* where = "RowParallelLinear";
  config_.validate();
  checkGtp(ctx_, where);
  checkMxfp8Alignment(config_.weightFormat, ctx_.gtpActive() ? ctx_.gtp->size() : 1, config_.gtpPadForAlignment, where);
  TPSIM_CHECK(!config_.sequenceParallel || options_.inputIsParallel,
              "RowParallelLinear: sequence_parallel needs input_is_parallel = True");
  // The layer's own scatter hands rank t the contiguous columns [t·K/T, (t+1)·K/T), while a
  // stride-S weight holds interleaved chunks of them: Megatron would multiply mismatched columns.
  TPSIM_CHECK(options_.stride == 1 || options_.inputIsParallel || ctx_.tp.size() == 1,
              "RowParallelLinear: stride ", options_.stride,
              " needs input_is_parallel = True (the contiguous input scatter does not match the interleaved "
              "weight columns); split the input yourself or use stride 1");
  TPSIM_CHECK(kGradAccumFusionAvailable || !config_.gradientAccumulationFusion,
              "RowParallelLinear: gradient accumulation fusion is unavailable; turn it off");
  const int T = ctx_.tp.size();
  inputSizePerPartition_ = divide(inputSize, T, "RowParallelLinear: input_size by the TP size");
  explicitExpertComm_ = options_.isExpert && (T > 1 || config_.expertModelParallelSize > 1);
  const bool expertPgs = config_.useExpertPgs(options_.isExpert);
  Compute& compute = ctx_.compute;
  weight_ = makeParameter(compute, options_.name + ".weight", {outputSize, inputSizePerPartition_}, config_.paramsDtype);
  masterWeight_ = initializeWeight(ctx_, config_, weight_, outputSize, inputSize, inputSizePerPartition_, 1,
                                   options_.stride, initMethod, options_.keepMasterWeightForTest,
                                   config_.paramsDtype, options_.isExpert, where);
  weight_.attrs.allreduce = !expertPgs;
  if (ctx_.gtpActive()) wrapGtp(compute, weight_, *ctx_.gtp, config_.gtpPadForAlignment, ctx_.gtpReplica);
  if (options_.bias) {
    // Replicated: no TP attributes, so the duplicate filter counts it on TP rank 0 only.
    bias_ = makeParameter(compute, options_.name + ".bias", {outputSize}, config_.paramsDtype);
    compute.fill(bias_->data, 0.0);
    bias_->attrs.allreduce = !expertPgs;
    bias_->attrs.sequenceParallel = config_.sequenceParallel;
  }
  sequenceParallel_ = config_.sequenceParallel;
}

LayerOutput RowParallelLinear::forward(ConstView input) {
  const std::int64_t expectK = options_.inputIsParallel ? inputSizePerPartition_ : inputSize_;
  TPSIM_CHECK(input.rank() >= 1 && input.dim(-1) == expectK, "RowParallelLinear::forward: input must end in ",
              options_.inputIsParallel ? "K/T=" : "K=", expectK, ", got ", input.str());
  ConstView xLocal = input;  // (…, K/T)
  if (!options_.inputIsParallel) {
    scatteredInput_ = scatterToTpRegionForward(ctx_.compute, ctx_.tp, input);
    xLocal = scatteredInput_;
  }
  LinearOptions lo;  // no TP collective inside the linear function: the layer reduces the output
  lo.gradientAccumulationFusion = config_.gradientAccumulationFusion;
  lo.gtpReducer = ctx_.gtpReducer;
  lo.weightFormat = config_.weightFormat;
  Tensor partial;    // (…, N), partial over TP
  linear_.reset();
  frozen_.reset();
  if (weight_.requiresGrad) {
    linear_.emplace(ctx_.compute, ctx_.tp, lo);
    partial = linear_->forward(xLocal, weight_, nullptr);
  } else {
    frozen_.emplace(ctx_.compute, ctx_.tp, lo);
    partial = frozen_->forward(xLocal, weight_, nullptr);
  }
  LayerOutput out;
  if (explicitExpertComm_) {
    TPSIM_CHECK(options_.skipBiasAdd, "RowParallelLinear: expert layers with explicit expert communication need "
                "skip_bias_add = True");
    out.output = std::move(partial);
  } else if (sequenceParallel_) {
    out.output = reduceScatterAlongFirstDimConsuming(ctx_.compute, ctx_.tp, std::move(partial));  // (s/T, b, N)
  } else {
    reduceFromTpRegionForward(ctx_.compute, ctx_.tp, partial);  // all-reduce in place
    out.output = std::move(partial);
  }
  if (bias_ && !options_.skipBiasAdd)
    ctx_.compute.addBias(bias_->data, out.output);  // once, after the reduction
  else
    out.outputBias = bias();
  return out;
}

Tensor RowParallelLinear::backward(ConstView dOutput, ConstView dOutputBias) {
  TPSIM_CHECK(linear_ || frozen_, "RowParallelLinear::backward: called before forward");
  Compute& compute = ctx_.compute;
  if (bias_ && !options_.skipBiasAdd) {
    // Under sequence parallelism this is the rank's slice; finalize all-reduces it over TP.
    Tensor db = compute.empty({outputSize_}, bias_->data.dtype());
    compute.sumRows(dOutput, db);
    accumulateGrad(compute, *bias_, std::move(db));
  } else if (bias_ && dOutputBias.data()) {
    accumulateGrad(compute, *bias_, copyOf(compute, dOutputBias));
  }
  SharedTensor gathered;
  ConstView dPartial = dOutput;  // (…, N)
  if (!explicitExpertComm_ && sequenceParallel_) {
    gathered = gatherAlongFirstDimShared(compute, ctx_.tp, dOutput);  // (s, b, N): the reduce-scatter's backward
    dPartial = *gathered;
  }
  LinearGrads g = linear_ ? linear_->backward(dPartial) : frozen_->backward(dPartial);
  if (linear_) applyWeightGrad(compute, weight_, g);
  linear_.reset();
  frozen_.reset();
  if (options_.inputIsParallel) return std::move(g.dX);
  Tensor dX = scatterToTpRegionBackward(compute, ctx_.tp, g.dX);  // (…, K)
  scatteredInput_ = Tensor();
  return dX;
}

std::string RowParallelLinear::extraRepr() const {
  return detail::concat("in_features=", inputSize_, ", out_features=", outputSize_, ", bias=", pyBool(bias_.has_value()),
                        ", TP=", inputSize_ / inputSizePerPartition_);
}

}  // namespace tpsim
