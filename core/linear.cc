#include "core/linear.h"

#include <memory>
#include <utility>

#include "backends/errors.h"

namespace tpsim {
namespace {

Shape withLastDim(Shape s, std::int64_t n) {
  s[s.rank() - 1] = n;
  return s;
}

// v itself when it is dense, else a dense copy held in `storage`.
ConstView contiguous(Compute& compute, ConstView v, Tensor& storage) {
  if (v.isContiguous()) return v;
  storage = compute.empty(v.shape(), v.dtype());
  compute.copy(v, storage);
  return storage;
}


// AG along dim 0 over `tp`: (s/T, b, K) -> (s, b, K), asynchronously, into a tensor the group's
// members may share (the GEMMs only read it).
std::unique_ptr<Work> gatherSequence(Compute& compute, Collectives& tp, ConstView local, Tensor& storage,
                                     SharedTensor& out) {
  local = contiguous(compute, local, storage);
  Shape full = local.shape();
  full[0] *= tp.size();
  return tp.allGatherShared(local, full, compute, out);
}

// main_grad += dYᵀ·X with Megatron's kernel choice by main_grad's dtype (3.14.2 step 11).
void accumulateIntoMainGrad(Compute& compute, Parameter& weight, ConstView dY2, ConstView x2, const char* where) {
  const DType g = weight.mainGrad.dtype();
  TPSIM_CHECK(g == DType::kFloat32 || g == DType::kBFloat16 || g == DType::kFloat16, where,
              ": unsupported gradient type for gradient accumulation fusion: main_grad of ", weight.name,
              " must be fp32, bf16 or fp16, got ", dtypeName(g));
  TPSIM_CHECK(g == DType::kFloat32 || g == dY2.dtype(), where, ": a ", dtypeName(g), " main_grad of ",
              weight.name, " needs ", dtypeName(g), " activations (the 16-bit fused kernel), got ",
              dtypeName(dY2.dtype()));
  compute.gemm(dY2.t(), x2, weight.mainGrad, 1.f, 1.f);  // (N,M)·(M,K) -> (N,K), accumulated
}

}  // namespace

ConstView castTo(Compute& compute, ConstView v, DType dtype, Tensor& storage) {
  if (v.dtype() == dtype) return contiguous(compute, v, storage);
  storage = compute.empty(v.shape(), dtype);
  compute.copy(v, storage);
  return storage;
}

Tensor dummyWgrad(Compute& compute, const Parameter& weight, DType dtype) {
  Tensor dummy = compute.empty(weight.mainGrad.shape(), dtype);
  if (weight.attrs.zeroOutWgrad.value_or(false)) compute.fill(dummy, 0.0);
  return dummy;
}

Tensor linearForward(Compute& compute, ConstView x, ConstView weight, ConstView bias,
                     std::optional<DType> outputDtype) {
  TPSIM_CHECK(x.rank() >= 1, "linearForward: input must have at least one mode, got ", x.str());
  TPSIM_CHECK(weight.rank() == 2 && weight.dim(1) == x.dim(-1), "linearForward: weight must be (N, K=",
              x.dim(-1), "), got ", weight.str());
  TPSIM_CHECK(weight.dtype() == x.dtype(), "linearForward: weight dtype must match the input's ",
              dtypeName(x.dtype()), ", got ", dtypeName(weight.dtype()));
  const bool hasBias = bias.data() != nullptr;
  TPSIM_CHECK(!hasBias || (bias.rank() == 1 && bias.dim(0) == weight.dim(0)), "linearForward: bias must be (N=",
              weight.dim(0), ",), got ", bias.str());
  const DType outDtype = outputDtype.value_or(x.dtype());
  Tensor xStorage;
  ConstView x2 = contiguous(compute, x, xStorage).flattenTo2d();  // (M, K)
  Tensor y = compute.empty(withLastDim(x.shape(), weight.dim(0)), outDtype);
  View y2 = y.view().flattenTo2d();  // (M, N)
  // The GEMM writes y directly when y has the input's dtype or is the fp32 widening of 16-bit
  // inputs. A bias on a 16-bit y, or a y narrower than (or another 16-bit type than) the input,
  // goes through a wide accumulator: one rounding into y, as cuBLAS's epilogue does.
  const bool direct = outDtype == x.dtype() || (is16Bit(x.dtype()) && outDtype == DType::kFloat32);
  if (direct && !(hasBias && is16Bit(outDtype))) {
    compute.gemm(x2, weight.t(), y2);
    if (hasBias) compute.addBias(bias, y2);
    return y;
  }
  const DType wide = x.dtype() == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
  Tensor acc = compute.empty(y2.shape(), wide);  // (M, N)
  compute.gemm(x2, weight.t(), acc);
  if (hasBias) compute.addBias(bias, acc);
  compute.copy(acc, y2);
  return y;
}

void wgradGemm(Compute& compute, View out, ConstView dY, ConstView x) {
  TPSIM_CHECK(dY.rank() == 2 && x.rank() == 2 && dY.dim(0) == x.dim(0), "wgradGemm: grad_output (M, N) and ",
              "total_input (M, K) must share M, got ", dY.str(), " and ", x.str());
  TPSIM_CHECK(out.shape() == Shape({dY.dim(1), x.dim(1)}), "wgradGemm: out must be (N=", dY.dim(1), ", K=",
              x.dim(1), "), got ", out.str());
  compute.gemm(dY.t(), x, out);  // (N,M)·(M,K) -> (N,K)
}

LinearWithGradAccumulation::LinearWithGradAccumulation(Compute& compute, Collectives& tp, LinearOptions options)
    : compute_(compute), tp_(tp), options_(options) {
  TPSIM_CHECK(!(options_.sequenceParallel && options_.allreduceDgrad),
              "LinearWithGradAccumulation: sequence_parallel and allreduce_dgrad are mutually exclusive (the "
              "sequence-parallel reduce-scatter already reduces dX)");
  TPSIM_CHECK(!options_.gradientAccumulationFusion || kGradAccumFusionAvailable,
              "LinearWithGradAccumulation: gradient accumulation fusion is unavailable; turn it off");
  TPSIM_CHECK(options_.gradOutputBuffer == nullptr || options_.gradientAccumulationFusion,
              "LinearWithGradAccumulation: wgrad deferral (grad_output_buffer) needs gradient accumulation "
              "fusion: the drain accumulates into main_grad only");
  TPSIM_CHECK(options_.wgradDeferralLimit >= 0, "LinearWithGradAccumulation: wgrad_deferral_limit must be >= 0, got ",
              options_.wgradDeferralLimit);
}

Tensor LinearWithGradAccumulation::forward(ConstView input, Parameter& weight, const Parameter* bias) {
  const bool gtp = isGtpShard(weight);
  TPSIM_CHECK(!gtp || options_.gtpReducer != nullptr, "LinearWithGradAccumulation: ", weight.name,
              " is a GTP_remat shard and needs LinearOptions::gtpReducer");
  TPSIM_CHECK(!gtp || options_.gradOutputBuffer == nullptr, "LinearWithGradAccumulation: wgrad deferral "
              "(grad_output_buffer) cannot be used with the GTP_remat shard ", weight.name,
              ": its wgrad must be reduce-scattered in backward");
  // GTP_remat forces fusion off: the wgrad goes through the reduce-scatter into main_grad.
  TPSIM_CHECK(gtp || !options_.gradientAccumulationFusion || weight.hasMainGrad(),
              "LinearWithGradAccumulation: gradient accumulation fusion needs ", weight.name,
              ".main_grad allocated before forward");
  TPSIM_CHECK(!options_.sequenceParallel || input.rank() >= 2, "LinearWithGradAccumulation: sequence-parallel "
              "input must be (s/T, b, K), got ", input.str());
  input_ = input;
  weight_ = &weight;
  hasBias_ = bias != nullptr;
  const ConstView biasView = bias ? ConstView(bias->data) : ConstView();
  // The fprop operand (N, K); a GTP_remat or mxfp8 copy is dropped after the GEMM.
  const GemmWeight w = gemmWeight(compute_, weight, options_.weightFormat, GemmUse::kFprop, input.dtype());
  if (!options_.sequenceParallel) return linearForward(compute_, input, w.weight, biasView, options_.outputDtype);
  Tensor staging;
  SharedTensor total;  // (s, b, K)
  gatherSequence(compute_, tp_, input, staging, total)->wait();
  return linearForward(compute_, *total, w.weight, biasView, options_.outputDtype);
}

LinearGrads LinearWithGradAccumulation::backward(ConstView dYIn) {
  TPSIM_CHECK(weight_ != nullptr, "LinearWithGradAccumulation::backward: called before forward");
  Parameter& weight = *weight_;
  const bool gtp = isGtpShard(weight);
  // Rematerialized for dgrad, the forward's copy was not kept; columnwise blocks under mxfp8.
  GemmWeight dgradWeight = gemmWeight(compute_, weight, options_.weightFormat, GemmUse::kDgrad, input_.dtype());
  const ConstView w = dgradWeight.weight;  // (N, K)
  const std::int64_t n = w.dim(0), k = w.dim(1);
  Shape outShape = withLastDim(input_.shape(), n);
  if (options_.sequenceParallel) outShape[0] *= tp_.size();
  TPSIM_CHECK(dYIn.shape() == outShape, "LinearWithGradAccumulation::backward: grad_output must be ",
              outShape.str(), " like the forward output, got ", dYIn.str());
  Tensor dYStorage;
  const ConstView dY = castTo(compute_, dYIn, input_.dtype(), dYStorage);  // (…, N)

  bool wgradCompute = true;
  if (options_.gradOutputBuffer &&
      (options_.wgradDeferralLimit == 0 || int(options_.gradOutputBuffer->size()) < options_.wgradDeferralLimit)) {
    Tensor kept = compute_.empty(dY.shape(), dY.dtype());
    compute_.copy(dY, kept);
    options_.gradOutputBuffer->push_back(std::move(kept));
    wgradCompute = false;
  }

  Tensor staging;
  SharedTensor gathered;  // (s, b, K)
  std::unique_ptr<Work> gather;
  ConstView xTotal = input_;
  if (wgradCompute && options_.sequenceParallel) {
    gather = gatherSequence(compute_, tp_, input_, staging, gathered);  // overlaps the dgrad GEMM
    xTotal = *gathered;
  }

  LinearGrads grads;
  Tensor dX = compute_.empty(withLastDim(dY.shape(), k), dY.dtype());  // (…, K), partial over TP
  compute_.gemm(dY.flattenTo2d(), w, dX.view().flattenTo2d());
  // A rematerialized or dequantized copy of the weight is not needed past dgrad: released before
  // the wgrad allocates its (N, K) gradient and GTP_remat's reduce-scatter its buffers (a GPU frees
  // it in stream order, after the GEMM).
  dgradWeight.storage.reset();

  // The dgrad reduction is issued before the gather is awaited (the group sees the same order of
  // collectives): a rank gives its partial dX up as soon as it is made, so that the simulator's ranks,
  // which all reach the wait before any passes it, do not all hold theirs at once.
  std::unique_ptr<Work> dgradReduction;
  if (options_.allreduceDgrad) dgradReduction = tp_.allReduce(dX);  // overlaps the wgrad GEMM
  if (options_.sequenceParallel) {
    grads.dX = compute_.empty(input_.shape(), dY.dtype());               // (s/T, b, K)
    dgradReduction = tp_.reduceScatterConsuming(std::move(dX), grads.dX);  // overlaps the wgrad GEMM
  } else {
    grads.dX = std::move(dX);
  }
  if (gather) gather->wait();

  const ConstView dY2 = dY.flattenTo2d();  // (M, N)
  Tensor xStorage;
  if (gtp) {
    // The wgrad is computed in main_grad's dtype when that is wider (the wider GEMM epilogue),
    // which makes it the reduce-scatter's wire dtype (SPEC 4.5).
    const bool wider = weight.hasMainGrad() && weight.mainGrad.dtype() == DType::kFloat32;
    // Made in the reduce-scatter's padded send buffer (S·G, K), rows [0, N): no copy of it there.
    Tensor dW = options_.gtpReducer->paddedWgrad(weight, wider ? DType::kFloat32 : dY.dtype());
    wgradGemm(compute_, dW.view().slice(0, 0, n), dY2, contiguous(compute_, xTotal, xStorage).flattenTo2d());
    grads.dW = options_.gtpReducer->reduceScatterPadded(weight, std::move(dW));
    grads.dWIsDummy = grads.dW.defined();
  } else if (options_.gradientAccumulationFusion) {
    if (wgradCompute)
      accumulateIntoMainGrad(compute_, weight, dY2, contiguous(compute_, xTotal, xStorage).flattenTo2d(),
                             "LinearWithGradAccumulation::backward");
    if (weight.attrs.gradAddedToMainGrad.has_value()) {
      grads.dW = dummyWgrad(compute_, weight, dY.dtype());
      grads.dWIsDummy = true;
      weight.attrs.gradAddedToMainGrad = true;
    }
  } else {
    grads.dW = compute_.empty({n, k}, dY.dtype());
    wgradGemm(compute_, grads.dW, dY2, contiguous(compute_, xTotal, xStorage).flattenTo2d());
  }
  if (hasBias_) {
    grads.db = compute_.empty({n}, dY.dtype());
    compute_.sumRows(dY2, grads.db);
  }
  if (dgradReduction) dgradReduction->wait();
  return grads;
}

LinearWithFrozenWeight::LinearWithFrozenWeight(Compute& compute, Collectives& tp, LinearOptions options)
    : compute_(compute), tp_(tp), options_(options) {
  TPSIM_CHECK(options_.gradOutputBuffer == nullptr,
              "LinearWithFrozenWeight: grad_output_buffer must be None: a frozen weight has no wgrad to defer");
  TPSIM_CHECK(!(options_.sequenceParallel && options_.allreduceDgrad),
              "LinearWithFrozenWeight: sequence_parallel and allreduce_dgrad together would reduce dX twice; "
              "pass at most one");
}

Tensor LinearWithFrozenWeight::forward(ConstView input, const Parameter& weight, const Parameter* bias) {
  // Backward reads the weight the forward used. A frozen weight cannot change in between, so its
  // dgrad operand is derived here and kept privately (SPEC 8 item 10) and backward gathers nothing:
  // natively that is the fprop operand itself, under mxfp8 the separate columnwise copy.
  const bool native = options_.weightFormat == WeightFormat::kNative;
  GemmWeight fprop = gemmWeight(compute_, weight, options_.weightFormat, GemmUse::kFprop, input.dtype());  // (N, K)
  dgradWeight_ = native ? GemmWeight{}
                        : gemmWeight(compute_, weight, options_.weightFormat, GemmUse::kDgrad, input.dtype());
  inputShape_ = input.shape();
  inputDtype_ = input.dtype();
  hasBias_ = bias != nullptr;
  const ConstView biasView = bias ? ConstView(bias->data) : ConstView();
  Tensor y;
  if (!options_.sequenceParallel) {
    y = linearForward(compute_, input, fprop.weight, biasView, options_.outputDtype);
  } else {
    Tensor staging;
    SharedTensor total;  // (s, b, K)
    gatherSequence(compute_, tp_, input, staging, total)->wait();
    y = linearForward(compute_, *total, fprop.weight, biasView, options_.outputDtype);
  }
  if (native) dgradWeight_ = std::move(fprop);
  return y;
}

LinearGrads LinearWithFrozenWeight::backward(ConstView dYIn) {
  const ConstView weight = dgradWeight_.weight;  // (N, K)
  TPSIM_CHECK(weight.data() != nullptr, "LinearWithFrozenWeight::backward: called before forward");
  Tensor dYStorage;
  const ConstView dY = castTo(compute_, dYIn, inputDtype_, dYStorage);  // (…, N)
  TPSIM_CHECK(dY.dim(-1) == weight.dim(0), "LinearWithFrozenWeight::backward: grad_output must end in N=",
              weight.dim(0), ", got ", dY.str());
  LinearGrads grads;
  Tensor dX = compute_.empty(withLastDim(dY.shape(), weight.dim(1)), inputDtype_);  // (…, K)
  compute_.gemm(dY.flattenTo2d(), weight, dX.view().flattenTo2d());
  if (options_.allreduceDgrad) tp_.allReduce(dX)->wait();
  if (options_.sequenceParallel) {
    grads.dX = compute_.empty(inputShape_, inputDtype_);  // (s/T, b, K): backward of the SP gather
    tp_.reduceScatterConsuming(std::move(dX), grads.dX)->wait();
  } else {
    grads.dX = std::move(dX);
  }
  if (hasBias_) {
    grads.db = compute_.empty({weight.dim(0)}, inputDtype_);
    compute_.sumRows(dY.flattenTo2d(), grads.db);
  }
  return grads;
}

void drainEmbeddingWgrad(Compute& compute, Collectives& tp, bool sequenceParallel,
                         std::vector<Tensor>& activations, std::vector<Tensor>& gradOutputs, Parameter& weight) {
  TPSIM_CHECK(activations.size() == gradOutputs.size(), "drainEmbeddingWgrad: embedding_activation_buffer and ",
              "grad_output_buffer must have the same length, got ", activations.size(), " and ",
              gradOutputs.size());
  TPSIM_CHECK(activations.empty() || weight.hasMainGrad(), "drainEmbeddingWgrad: ", weight.name,
              ".main_grad must be allocated");
  // Double-buffered under SP: the gather of entry i+1 runs while entry i's GEMM does.
  Tensor staging[2];
  SharedTensor gathered[2];
  std::unique_ptr<Work> pending;
  auto startGather = [&](std::size_t i) {
    if (sequenceParallel) pending = gatherSequence(compute, tp, activations[i], staging[i % 2], gathered[i % 2]);
  };
  if (!activations.empty()) startGather(0);
  for (std::size_t i = 0; i < activations.size(); ++i) {
    if (pending) pending->wait();
    pending.reset();
    const ConstView x = sequenceParallel ? ConstView(*gathered[i % 2]) : ConstView(activations[i]);  // (s, b, K)
    if (i + 1 < activations.size()) startGather(i + 1);
    accumulateIntoMainGrad(compute, weight, gradOutputs[i].view().flattenTo2d(), x.flattenTo2d(),
                           "drainEmbeddingWgrad");
  }
  activations.clear();
  gradOutputs.clear();
}

}  // namespace tpsim
