// The linear functions of Megatron's tensor-parallel layers, with explicit backward passes.
//
// linearForward and wgradGemm are the GEMMs (SPEC 3.12, 3.13). LinearWithGradAccumulation is
// LinearWithGradAccumulationAndAsyncCommunication (3.14): one use of a linear in a forward pass,
// saving what its backward needs, with the sequence-parallel all-gather, the asynchronous dgrad
// all-reduce or reduce-scatter overlapped with the wgrad GEMM, gradient-accumulation fusion into
// main_grad, the dummy-gradient rule (3.15) and wgrad deferral (3.20). LinearWithFrozenWeight is
// 3.16. None of these owns parameters or applies gradients; the layers (core/layers.h) do.
// Inputs are views: the caller keeps a forward input alive until the matching backward, as
// autograd keeps saved tensors alive.
#pragma once

#include <optional>
#include <vector>

#include "backends/collectives.h"
#include "backends/compute.h"
#include "core/gtp.h"
#include "core/mxfp8.h"
#include "core/parameter.h"

namespace tpsim {

// Megatron's _grad_accum_fusion_available (SPEC 3.1): every tpsim backend has the fused
// wgrad-accumulate path (a GEMM with beta = 1 into main_grad).
inline constexpr bool kGradAccumFusionAvailable = true;

// y = x·Wᵀ + b over any leading dims (SPEC 3.12). x: (…, K)  weight: (N, K)  bias: (N) or empty.
// The output has outputDtype when given (one GEMM accumulating in fp32, rounded once, bias added
// in the epilogue), else x's dtype.
Tensor linearForward(Compute& compute, ConstView x, ConstView weight, ConstView bias,
                     std::optional<DType> outputDtype = std::nullopt);

// out = dYᵀ·X, written, not accumulated (SPEC 3.13). dY: (M, N)  X: (M, K)  out: (N, K), of dY's
// dtype or wider; the accumulator is never rounded to the input dtype.
void wgradGemm(Compute& compute, View out, ConstView dY, ConstView x);

// v converted to `dtype` and dense; v itself when it already is (SPEC 3.14.2 step 1: dY is cast to
// the input dtype).
ConstView castTo(Compute& compute, ConstView v, DType dtype, Tensor& storage);

// The dummy weight gradient that stands for a wgrad already added into main_grad (SPEC 3.15, 4.5
// step 6): main_grad's shape, `dtype`, zero-filled only when zero_out_wgrad is set.
Tensor dummyWgrad(Compute& compute, const Parameter& weight, DType dtype);

// What a backward returns for autograd to apply. A dummy weight gradient (3.15) stands for a
// wgrad already added into main_grad: it is handed on but carries no gradient information.
struct LinearGrads {
  Tensor dX;             // shaped like the forward input
  Tensor dW;             // undefined = None
  bool dWIsDummy = false;
  Tensor db;             // (N), undefined when there is no bias
};

struct LinearOptions {
  bool gradientAccumulationFusion = false;
  bool allreduceDgrad = false;
  bool sequenceParallel = false;
  // Wgrad deferral (3.20): dY of deferred micro-batches is appended here instead of running the
  // wgrad GEMM. Requires fusion.
  std::vector<Tensor>* gradOutputBuffer = nullptr;
  int wgradDeferralLimit = 0;
  std::optional<DType> outputDtype;
  // Reduces the wgrads of GTP_remat shards (SPEC 4.5); required when the weight is one.
  GtpGradReducer* gtpReducer = nullptr;
  // The weight operand of fprop and dgrad (core/mxfp8.h); the wgrad is never quantized.
  WeightFormat weightFormat = WeightFormat::kNative;
};

class LinearWithGradAccumulation {
 public:
  // tp: the TP group of the sequence-parallel gather and the dgrad reduction.
  LinearWithGradAccumulation(Compute& compute, Collectives& tp, LinearOptions options);

  // input: (…, K), or (s/T, b, K) under sequence parallelism.  weight: (N, K), or its GTP_remat
  // shard, materialized here and again in backward (gemmWeight: the fprop operand here, the dgrad
  // one there).  bias: (N) or nullptr. Returns (…, N), or (s, b, N) under sequence parallelism.
  Tensor forward(ConstView input, Parameter& weight, const Parameter* bias);
  // dY: the output's shape. Fusion adds the wgrad into weight.mainGrad here.
  LinearGrads backward(ConstView dY);

 private:
  Compute& compute_;
  Collectives& tp_;
  LinearOptions options_;
  ConstView input_;          // saved: (…, K) or (s/T, b, K)
  Parameter* weight_ = nullptr;
  bool hasBias_ = false;
};

class LinearWithFrozenWeight {
 public:
  // Frozen weights keep no wgrad state: gradient-accumulation fusion and deferral do not apply,
  // and sequence parallelism together with allreduceDgrad (a double reduction) is rejected.
  LinearWithFrozenWeight(Compute& compute, Collectives& tp, LinearOptions options);

  Tensor forward(ConstView input, const Parameter& weight, const Parameter* bias);
  // Returns dX and, unlike Megatron (SPEC 8 item 11), the bias gradient; dW stays None.
  LinearGrads backward(ConstView dY);

 private:
  Compute& compute_;
  Collectives& tp_;
  LinearOptions options_;
  GemmWeight dgradWeight_;   // (N, K); a GTP_remat or mxfp8 weight's private copy (SPEC 8 item 10)
  Shape inputShape_;
  DType inputDtype_ = DType::kFloat32;
  bool hasBias_ = false;
};

// Drains deferred embedding wgrads (3.20): pops (activation, dY) pairs FIFO and accumulates
// dYᵀ·X into weight.mainGrad, re-gathering each activation along the sequence under sequence
// parallelism. Both buffers must have the same length; they are empty afterwards.
void drainEmbeddingWgrad(Compute& compute, Collectives& tp, bool sequenceParallel,
                         std::vector<Tensor>& activations, std::vector<Tensor>& gradOutputs, Parameter& weight);

}  // namespace tpsim
