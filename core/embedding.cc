#include "core/embedding.h"

#include <utility>
#include <vector>

#include "backends/errors.h"
#include "core/attributes.h"
#include "core/init.h"
#include "core/mappings.h"

namespace tpsim {
namespace {

constexpr const char* kWhere = "VocabParallelEmbedding";

// Megatron indexes the table with unmasked ids at T = 1, so a bad id is a device fault there
// (SPEC 8 item 13); here it is an error naming the first bad id.
void checkIdsInRange(Compute& compute, const Tensor& ids /* int64 (b, s) */, std::int64_t vocabSize) {
  std::vector<std::int64_t> host(std::size_t(ids.numel()));  // (b·s)
  compute.download(ids, host.data());
  const std::int64_t s = ids.shape()[1];
  for (std::size_t i = 0; i < host.size(); ++i)
    TPSIM_CHECK(0 <= host[i] && host[i] < vocabSize, "VocabParallelEmbedding::forward: ids must lie in [0, V=",
                vocabSize, "), got id ", host[i], " at position (", std::int64_t(i) / s, ", ", std::int64_t(i) % s,
                ")");
}

}  // namespace

VocabParallelEmbedding::VocabParallelEmbedding(LayerContext ctx, const ModelParallelConfig& config,
                                               std::int64_t numEmbeddings, std::int64_t embeddingDim,
                                               const InitMethod& initMethod, VocabParallelEmbeddingOptions options)
    : ctx_(ctx), options_(std::move(options)), numEmbeddings_(numEmbeddings), embeddingDim_(embeddingDim) {
  config.validate();
  TPSIM_CHECK(!ctx_.gtpActive() || ctx_.gtpReducer != nullptr, kWhere, ": a GTP_remat group of size ",
              ctx_.gtp->size(), " needs LayerContext::gtpReducer to reduce the weight gradient");
  TPSIM_CHECK(numEmbeddings > 0, kWhere, ": num_embeddings must be positive, got ", numEmbeddings);
  TPSIM_CHECK(embeddingDim > 0, kWhere, ": embedding_dim must be positive, got ", embeddingDim);
  const int T = ctx_.tp.size();
  const int t = ctx_.tp.rank();
  TPSIM_CHECK(numEmbeddings % T == 0, kWhere, ": vocab_size ", numEmbeddings, " is not divisible by tp_size ", T,
              "; pad it to ", (numEmbeddings + T - 1) / T * T);
  vocab_ = vocabRangeFromGlobalVocabSize(numEmbeddings, t, T);
  const std::int64_t perPartition = vocab_.last - vocab_.first;

  Compute& compute = ctx_.compute;
  weight_.name = options_.name + ".weight";
  weight_.data = compute.empty({perPartition, embeddingDim}, config.paramsDtype);  // (V/T, h)
  if (config.useCpuInitialization && config.performInitialization) {
    TPSIM_CHECK(ctx_.cpuGenerator != nullptr, kWhere, ": use_cpu_initialization needs LayerContext::cpuGenerator");
    // Unlike ColumnParallelLinear, the embedding passes params_dtype: its master is in that dtype.
    initializeAffineWeightCpu(compute, weight_, numEmbeddings, embeddingDim, perPartition, 0, initMethod,
                              *ctx_.cpuGenerator, 1, false, config.paramsDtype, t, T, false);
  } else if (config.performInitialization) {
    TPSIM_CHECK(ctx_.rngTracker != nullptr, kWhere, ": GPU-style initialization needs LayerContext::rngTracker");
    // Always the dense tracker: an embedding is never an expert parameter.
    initializeAffineWeightGpu(compute, weight_, initMethod, 0, 1, false, *ctx_.rngTracker);
  } else {
    // No initialization: Megatron leaves torch.empty garbage; zeros keep runs reproducible.
    setTensorModelParallelAttributes(weight_.attrs, true, 0, 1);
    compute.fill(weight_.data, 0.0);
  }
  // The full TP-local table was initialized; GTP_remat now keeps this rank's rows (SPEC 4.9).
  if (ctx_.gtpActive()) wrapGtp(compute, weight_, *ctx_.gtp, config.gtpPadForAlignment, ctx_.gtpReplica);
}

Tensor VocabParallelEmbedding::forward(ConstView ids) {
  TPSIM_CHECK(ids.rank() == 2 && ids.dtype() == DType::kInt64, "VocabParallelEmbedding::forward: ids must be int64 "
              "(b, s), got ", ids.str());
  const std::int64_t b = ids.dim(0), s = ids.dim(1), h = embeddingDim_;
  const int T = ctx_.tp.size();
  TPSIM_CHECK(!options_.reduceScatterEmbeddings || s % T == 0, "VocabParallelEmbedding::forward: "
              "reduce_scatter_embeddings needs the sequence length s divisible by tp_size ", T, ", got s = ", s);
  Compute& compute = ctx_.compute;
  Tensor saved = compute.empty(ids.shape(), DType::kInt64);  // (b, s)
  compute.copy(ids, saved);
  if (T == 1) checkIdsInRange(compute, saved, numEmbeddings_);

  // Ids outside [first, last) belong to other ranks and give zero rows: Megatron's mask.
  Materialized full;  // the GTP_remat table, dropped after the lookup: backward needs no weight
  const ConstView table = isGtpShard(weight_) ? (full = materialize(compute, weight_)).weight
                                              : ConstView(weight_.data);  // (V/T, h)
  Tensor embedded = compute.empty({b, s, h}, weight_.data.dtype());  // (b, s, h)
  compute.gatherRows(table, saved.view().reshape({b * s}), vocab_.first, embedded.view().reshape({b * s, h}));

  Tensor out;
  if (options_.reduceScatterEmbeddings) {
    // The transposed (s, b, h) view is made contiguous by the mapping before the collective.
    out = reduceScatterToSpRegionForward(compute, ctx_.tp, embedded.view().transpose(0, 1));  // (s/T, b, h)
  } else {
    if (T > 1) reduceFromTpRegionForward(compute, ctx_.tp, embedded);  // all-reduce in place
    out = std::move(embedded);  // (b, s, h)
  }
  ids_ = std::move(saved);
  outputShape_ = out.shape();
  return out;
}

void VocabParallelEmbedding::backward(ConstView dOutput) {
  TPSIM_CHECK(ids_.defined(), "VocabParallelEmbedding::backward: called before forward");
  const DType dtype = weight_.data.dtype();
  TPSIM_CHECK(dOutput.dtype() == dtype && dOutput.shape() == outputShape_, "VocabParallelEmbedding::backward: "
              "dOutput must be ", dtypeName(dtype), " ", outputShape_.str(), " like the output, got ", dOutput.str());
  const std::int64_t b = ids_.shape()[0], s = ids_.shape()[1], h = embeddingDim_;
  Compute& compute = ctx_.compute;

  // The all-reduce's backward is the identity; the reduce-scatter's is the dim-0 all-gather.
  SharedTensor gathered;
  ConstView dEmbedded = dOutput;  // (b, s, h)
  if (options_.reduceScatterEmbeddings) {
    gathered = gatherAlongFirstDimShared(compute, ctx_.tp, dOutput);  // (s, b, h): the reduce-scatter's backward
    dEmbedded = gathered->view().transpose(0, 1);
  }
  Tensor dense;
  if (!dEmbedded.isContiguous()) {
    dense = compute.empty(dEmbedded.shape(), dtype);
    compute.copy(dEmbedded, dense);
    dEmbedded = dense;
  }

  // Repeated ids are summed in fp32 and rounded once, as PyTorch's embedding backward does for
  // 16-bit tables. Positions whose id another rank owns are skipped: the mask's zero gradient.
  // scatterAddRows adds in increasing position order, a fixed order, so the sum is deterministic
  // whatever deterministic_mode says, and both of Megatron's lookups give these values (SPEC 5.3 E2).
  const DType accumDtype = is16Bit(dtype) ? DType::kFloat32 : dtype;
  const Shape tableShape{numEmbeddingsPerPartition(), h};  // (V/T, h), the shard's logical table
  Tensor dWeight = compute.zeros(tableShape, accumDtype);
  compute.scatterAddRows(dEmbedded.reshape({b * s, h}), ids_.view().reshape({b * s}), vocab_.first, dWeight);
  if (accumDtype != dtype) {
    Tensor rounded = compute.empty(tableShape, dtype);
    compute.copy(dWeight, rounded);
    dWeight = std::move(rounded);
  }
  ids_ = Tensor();
  if (!isGtpShard(weight_)) {
    accumulateGrad(compute, weight_, std::move(dWeight));
    return;
  }
  // Under GTP_remat the table gradient, in the param dtype, is reduce-scattered into main_grad.
  // The embedding heads the chain: its reduction is synchronous and completes its successor's.
  Tensor dummy = ctx_.gtpReducer->reduceScatter(weight_, dWeight);
  ctx_.gtpReducer->drain();
  if (dummy.defined()) weight_.grad = std::move(dummy);
}

}  // namespace tpsim
