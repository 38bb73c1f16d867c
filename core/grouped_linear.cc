#include "core/grouped_linear.h"

#include <algorithm>
#include <utility>

#include "backends/errors.h"
#include "core/attributes.h"
#include "core/gtp.h"
#include "core/init.h"
#include "core/linear.h"
#include "core/utils.h"

namespace tpsim {
namespace {

constexpr const char* kWhere = "GroupedParallelLinear";

}  // namespace

GroupedParallelLinear::GroupedParallelLinear(LayerContext ctx, const ModelParallelConfig& config,
                                             std::int64_t inputSize, std::int64_t outputSize,
                                             const InitMethod& initMethod, GroupedLinearOptions options)
    : ctx_(ctx), config_(config), options_(std::move(options)) {
  config_.validate();
  const int E = options_.numGemms, T = ctx_.tp.size();
  TPSIM_CHECK(E >= 1, kWhere, ": numGemms must be >= 1, got ", E);
  TPSIM_CHECK(options_.isExpert || T == 1, kWhere, ": a grouped linear does no TP communication, so with a TP "
              "group of size ", T, " it must be an expert layer (is_expert), whose token dispatcher communicates");
  TPSIM_CHECK(!ctx_.gtpActive() || ctx_.gtpReducer != nullptr, kWhere, ": a GTP_remat group of size ",
              ctx_.gtp->size(), " needs LayerContext::gtpReducer to reduce the weight gradients");
  const bool column = options_.parallelMode == GroupedParallelMode::kColumn;
  const int partitionDim = column ? 0 : 1;
  kLocal_ = column ? inputSize : divide(inputSize, T, "GroupedParallelLinear: input_size by the TP size");
  nLocal_ = column ? divide(outputSize, T, "GroupedParallelLinear: output_size by the TP size") : outputSize;
  addsBias_ = options_.bias && (column || ctx_.tp.rank() == 0);
  const bool expertPgs = config_.useExpertPgs(options_.isExpert);
  Compute& compute = ctx_.compute;

  weights_.resize(std::size_t(E));
  for (int i = 0; i < E; ++i) {
    Parameter& w = weights_[std::size_t(i)];
    w.name = detail::concat(options_.name, ".weight", i);
    w.data = compute.empty({nLocal_, kLocal_}, config_.paramsDtype);  // (N/T, K) or (N, K/T)
    if (config_.useCpuInitialization && config_.performInitialization) {
      TPSIM_CHECK(ctx_.cpuGenerator != nullptr, kWhere, ": use_cpu_initialization needs LayerContext::cpuGenerator");
      initializeAffineWeightCpu(compute, w, outputSize, inputSize, column ? nLocal_ : kLocal_, partitionDim,
                                initMethod, *ctx_.cpuGenerator, 1, false, config_.paramsDtype, ctx_.tp.rank(), T);
    } else if (config_.performInitialization) {
      TPSIM_CHECK(ctx_.rngTracker != nullptr, kWhere, ": GPU-style initialization needs LayerContext::rngTracker");
      initializeAffineWeightGpu(compute, w, initMethod, partitionDim, 1, options_.isExpert, *ctx_.rngTracker);
    } else {
      setTensorModelParallelAttributes(w.attrs, true, partitionDim, 1);
      compute.fill(w.data, 0.0);  // Megatron leaves torch.empty garbage; zeros keep runs reproducible
    }
    w.attrs.allreduce = !expertPgs;
    if (ctx_.gtpActive()) {
      wrapGtp(compute, w, *ctx_.gtp, config_.gtpPadForAlignment, ctx_.gtpReplica);
      w.attrs.expertIdx = i;
    }
  }
  if (ctx_.gtpActive()) {
    std::vector<Parameter*> batch;
    for (Parameter& w : weights_) batch.push_back(&w);
    weights_.front().attrs.weightList = std::move(batch);
  }
  if (options_.bias) {  // never GTP_remat-sharded; replicated over TP in row mode
    biases_.resize(std::size_t(E));
    for (int i = 0; i < E; ++i) {
      Parameter& b = biases_[std::size_t(i)];
      b.name = detail::concat(options_.name, ".bias", i);
      b.data = compute.zeros({nLocal_}, config_.paramsDtype);  // (N/T) or (N)
      if (column) setTensorModelParallelAttributes(b.attrs, true, 0, 1);
      b.attrs.allreduce = !expertPgs;
    }
  }
}

Parameter& GroupedParallelLinear::weight(int expert) {
  TPSIM_CHECK(expert >= 0 && expert < numGemms(), kWhere, "::weight: expert must be in [0, ", numGemms(), "), got ",
              expert);
  return weights_[std::size_t(expert)];
}

Parameter* GroupedParallelLinear::bias(int expert) {
  TPSIM_CHECK(expert >= 0 && expert < numGemms(), kWhere, "::bias: expert must be in [0, ", numGemms(), "), got ",
              expert);
  return biases_.empty() ? nullptr : &biases_[std::size_t(expert)];
}

// The batch of weight0's weight_list, rematerialized with ONE all-gather: the E local shards are
// packed expert-major (E·S, K), so rank g's block of the gather is [W_0 shard g, …, W_{E−1} shard g].
// Each expert's TP-local weight (dLog, K) is unpacked into its own buffer, its pad rows stripped.
std::vector<Tensor> GroupedParallelLinear::gatherWeights() {
  Compute& compute = ctx_.compute;
  const std::vector<Parameter*>& batch = *weights_.front().attrs.weightList;
  Collectives& group = **weights_.front().attrs.group;
  const std::int64_t E = std::int64_t(batch.size()), G = group.size();
  const std::int64_t S = weights_.front().data.shape()[0], cols = kLocal_;
  const std::int64_t dLog = nLocal_;  // GTP_remat cuts dim 0 in both modes (SPEC 4.2)
  const DType dtype = weights_.front().data.dtype();
  Tensor packed = compute.empty({E * S, cols}, dtype);  // (E·S, K)
  for (std::int64_t i = 0; i < E; ++i) {
    TPSIM_INTERNAL_ASSERT(batch[i]->data.shape() == weights_.front().data.shape(), batch[i]->name);
    compute.copy(batch[i]->data, packed.view().slice(0, i * S, (i + 1) * S));
  }
  Tensor gathered = compute.empty({G * E * S, cols}, dtype);  // (G·E·S, K)
  group.allGather(packed, gathered)->wait();
  ++coalescedGathers_;
  std::vector<Tensor> full;
  for (std::int64_t i = 0; i < E; ++i) {
    Tensor w = compute.empty({dLog, cols}, dtype);  // (dLog, K): rows [g·S, (g+1)·S) come from rank g
    for (std::int64_t g = 0; g < G && g * S < dLog; ++g) {
      const std::int64_t n = std::min(S, dLog - g * S), src = (g * E + i) * S;
      compute.copy(gathered.view().slice(0, src, src + n), w.view().slice(0, g * S, g * S + n));
    }
    full.push_back(std::move(w));
  }
  return full;
}

Tensor GroupedParallelLinear::forward(ConstView input, const std::vector<std::int64_t>& mSplits) {
  const int E = numGemms();
  TPSIM_CHECK(input.rank() == 2 && input.dim(1) == kLocal_, kWhere, "::forward: input must be (M, ",
              options_.parallelMode == GroupedParallelMode::kRow ? "K/T=" : "K=", kLocal_, "), got ", input.str());
  TPSIM_CHECK(int(mSplits.size()) == E, kWhere, "::forward: mSplits must have one count per GEMM (", E,
              "), got ", mSplits.size());
  std::vector<std::int64_t> offsets(std::size_t(E) + 1, 0);
  for (int i = 0; i < E; ++i) {
    TPSIM_CHECK(mSplits[i] >= 0, kWhere, "::forward: mSplits[", i, "] must be >= 0, got ", mSplits[i]);
    offsets[i + 1] = offsets[i] + mSplits[i];
  }
  TPSIM_CHECK(offsets.back() == input.dim(0), kWhere, "::forward: mSplits must sum to the input's M=",
              input.dim(0), ", got ", offsets.back());
  Compute& compute = ctx_.compute;
  const std::vector<Tensor> gathered = gtpBatched() ? gatherWeights() : std::vector<Tensor>();  // dropped after
  Tensor y = compute.empty({input.dim(0), nLocal_}, input.dtype());  // (M, N/T) or (M, N)
  for (int i = 0; i < E; ++i) {
    if (mSplits[i] == 0) continue;
    const ConstView w = gtpBatched() ? ConstView(gathered[i]) : ConstView(weights_[i].data);  // (N_local, K_local)
    const ConstView b = addsBias_ ? ConstView(biases_[i].data) : ConstView();
    Tensor yi = linearForward(compute, input.slice(0, offsets[i], offsets[i + 1]), w, b);  // (m_i, N_local)
    compute.copy(yi, y.view().slice(0, offsets[i], offsets[i + 1]));
  }
  input_ = input;
  offsets_ = std::move(offsets);
  return y;
}

Tensor GroupedParallelLinear::backward(ConstView dOutput) {
  TPSIM_CHECK(input_.has_value(), kWhere, "::backward: called before forward");
  const ConstView x = *input_;  // (M, K_local)
  TPSIM_CHECK(dOutput.shape() == Shape({x.dim(0), nLocal_}), kWhere, "::backward: dOutput must be (M=", x.dim(0),
              ", N=", nLocal_, ") like the forward output, got ", dOutput.str());
  const bool gtp = gtpBatched();
  for (const Parameter& w : weights_)
    TPSIM_CHECK(w.hasMainGrad() || !(gtp || config_.gradientAccumulationFusion), kWhere, "::backward: ", w.name,
                ".main_grad must be allocated before backward (", gtp ? "GTP_remat" : "gradient-accumulation fusion",
                " accumulates into it)");
  Compute& compute = ctx_.compute;
  Tensor dyStorage, xStorage;
  const ConstView dY = castTo(compute, dOutput, x.dtype(), dyStorage);  // (M, N_local)
  const ConstView xd = castTo(compute, x, x.dtype(), xStorage);         // (M, K_local)
  const std::vector<Tensor> gathered = gtp ? gatherWeights() : std::vector<Tensor>();  // again, for dgrad
  const int E = numGemms();
  std::vector<ConstView> xs, dys;  // per expert: (m_i, K_local), (m_i, N_local)
  Tensor dX = compute.empty(x.shape(), x.dtype());  // (M, K_local)
  for (int i = 0; i < E; ++i) {
    xs.push_back(xd.slice(0, offsets_[i], offsets_[i + 1]));
    dys.push_back(dY.slice(0, offsets_[i], offsets_[i + 1]));
    if (offsets_[i] == offsets_[i + 1]) continue;
    const ConstView w = gtp ? ConstView(gathered[i]) : ConstView(weights_[i].data);  // (N_local, K_local)
    compute.gemm(dys[i], w, dX.view().slice(0, offsets_[i], offsets_[i + 1]));      // (m,N)·(N,K) -> (m,K)
  }
  if (gtp)
    reduceScatterWgrads(xs, dys);
  else
    accumulateWgrads(xs, dys);
  for (std::size_t i = 0; i < biases_.size(); ++i) {
    Tensor db = compute.zeros({nLocal_}, x.dtype());  // (N_local); zero for an expert without tokens
    if (dys[i].dim(0) > 0) compute.sumRows(dys[i], db);
    accumulateGrad(compute, biases_[i], std::move(db));
  }
  input_.reset();
  return dX;
}

// Without GTP_remat: main_grad += dY_iᵀ·X_i under fusion (with the dummy of SPEC 3.15), else
// grad += dY_iᵀ·X_i, as autograd would apply it.
void GroupedParallelLinear::accumulateWgrads(const std::vector<ConstView>& xs, const std::vector<ConstView>& dys) {
  Compute& compute = ctx_.compute;
  for (std::size_t i = 0; i < weights_.size(); ++i) {
    Parameter& w = weights_[i];
    const DType dtype = xs[i].dtype();
    if (!config_.gradientAccumulationFusion) {
      Tensor dW = compute.zeros({nLocal_, kLocal_}, dtype);  // (N_local, K_local)
      if (xs[i].dim(0) > 0) wgradGemm(compute, dW, dys[i], xs[i]);
      accumulateGrad(compute, w, std::move(dW));
      continue;
    }
    const DType g = w.mainGrad.dtype();
    TPSIM_CHECK(g == DType::kFloat32 || g == dtype, kWhere, "::backward: main_grad of ", w.name,
                " must be fp32 or the activations' ", dtypeName(dtype), ", got ", dtypeName(g));
    if (xs[i].dim(0) > 0) compute.gemm(dys[i].t(), xs[i], w.mainGrad, 1.f, 1.f);  // (N,m)·(m,K), accumulated
    if (w.attrs.gradAddedToMainGrad.has_value()) {
      w.grad = dummyWgrad(compute, w, dtype);
      w.attrs.gradAddedToMainGrad = true;
    }
  }
}

// SPEC 4.5 for the whole batch with ONE reduce-scatter, synchronously: the batch finalizes before
// backward returns, like a chain head. Any reduce-scatter the rank's reducer still defers is
// finalized first, as the chain would before issuing this one, so no main_grad is left pending.
//
// Send buffer (G·E·S, K), rank-major: block (g, i) holds rows [g·S, (g+1)·S) of expert i's wgrad
// padded to S·G rows, so rank g receives [expert 0 rows g·S.., expert 1 rows g·S.., …] summed over
// the peers and adds block i into main_grad_i. Pad rows are sent as zeros and stay exact zeros.
void GroupedParallelLinear::reduceScatterWgrads(const std::vector<ConstView>& xs,
                                                const std::vector<ConstView>& dys) {
  Compute& compute = ctx_.compute;
  GtpGradReducer& reducer = *ctx_.gtpReducer;
  const std::vector<Parameter*>& batch = *weights_.front().attrs.weightList;
  Collectives& group = **weights_.front().attrs.group;
  const std::int64_t E = std::int64_t(batch.size()), G = group.size();
  const std::int64_t S = weights_.front().data.shape()[0], cols = kLocal_, dLog = nLocal_;
  // The wgrad is computed in main_grad's dtype when that is wider (SPEC 4.5): the wire dtype.
  const DType input = xs.front().dtype();
  const DType wire = weights_.front().mainGrad.dtype() == DType::kFloat32 ? DType::kFloat32 : input;
  Tensor send = compute.zeros({G * E * S, cols}, wire);  // (G·E·S, K)
  for (std::int64_t i = 0; i < E; ++i) {
    if (xs[i].dim(0) == 0) continue;
    Tensor dW = compute.empty({dLog, cols}, wire);  // (dLog, K): the logical wgrad of expert i
    wgradGemm(compute, dW, dys[i], xs[i]);
    for (std::int64_t g = 0; g < G && g * S < dLog; ++g) {
      const std::int64_t n = std::min(S, dLog - g * S), dst = (g * E + i) * S;
      compute.copy(dW.view().slice(0, g * S, g * S + n), send.view().slice(0, dst, dst + n));
    }
  }
  if (reducer.options().mean) compute.scale(send, 1.f / float(G));  // MEAN: pre-scale 1/G
  reducer.drain();
  Tensor received = compute.empty({E * S, cols}, wire);  // (E·S, K): block i is expert i's shard
  if (reducer.options().fp32AccumReduceScatter) {
    // One all-to-all for the whole batch, then the fp32 sums (SPEC 4.6); plain at G <= 2.
    if (reduceScatterWithFp32Accumulation(compute, group, send, received)) ++fp32AccumDispatches_;
  } else {
    group.reduceScatter(send, received)->wait();
  }
  ++coalescedReduceScatters_;
  for (std::int64_t i = 0; i < E; ++i) {
    Parameter& w = *batch[i];
    const DType g = w.mainGrad.dtype();
    TPSIM_CHECK(g == wire || g == DType::kFloat32 || g == DType::kFloat64, kWhere, ": main_grad of ", w.name, " (",
                dtypeName(g), ") cannot hold the ", dtypeName(wire), " reduce-scatter result");
    compute.axpy(1.f, received.view().slice(0, i * S, (i + 1) * S), w.mainGrad);
    if (w.attrs.gradAddedToMainGrad.has_value()) w.attrs.gradAddedToMainGrad = true;
    w.grad = dummyWgrad(compute, w, w.data.dtype());  // synchronous: the dummy goes to autograd
  }
}

}  // namespace tpsim
