// VocabParallelEmbedding (SPEC 3.17): a word-embedding table split by vocabulary rows across the
// TP group, with explicit forward and backward.
//
// Rank t owns rows [t·V/T, (t+1)·V/T) of the (V, h) table; every rank looks up all ids, emits
// zero rows for ids it does not own, and the TP all-reduce (or the sequence-parallel
// reduce-scatter) completes the lookup. Under GTP_remat the table is a shard, materialized for the
// lookup; its gradient is reduce-scattered into main_grad (SPEC 4.9). Its sharded_state_dict is in
// core/checkpoint.h. One forward must be followed by its backward before the next forward.
#pragma once

#include <cstdint>
#include <string>

#include "backends/compute.h"
#include "backends/tensor.h"
#include "core/config.h"
#include "core/layers.h"
#include "core/parameter.h"
#include "core/random.h"
#include "core/utils.h"

namespace tpsim {

struct VocabParallelEmbeddingOptions {
  // Emit (s/T, b, h) through the sequence-parallel reduce-scatter instead of all-reducing (b, s, h).
  bool reduceScatterEmbeddings = false;
  std::string name = "embedding";
};

class VocabParallelEmbedding {
 public:
  // numEmbeddings V must be divisible by the TP size; the weight is (V/T, h) in params_dtype.
  VocabParallelEmbedding(LayerContext ctx, const ModelParallelConfig& config, std::int64_t numEmbeddings,
                         std::int64_t embeddingDim, const InitMethod& initMethod,
                         VocabParallelEmbeddingOptions options = {});

  // ids: int64 (b, s). Returns (b, s, h) in the weight's dtype, or (s/T, b, h) with
  // reduce_scatter_embeddings. At T = 1 every id must lie in [0, V).
  Tensor forward(ConstView ids);
  // dOutput: the output's dtype and shape. Adds the (V/T, h) weight gradient into weight().grad.
  void backward(ConstView dOutput);

  Parameter& weight() { return weight_; }
  std::int64_t numEmbeddings() const { return numEmbeddings_; }
  std::int64_t embeddingDim() const { return embeddingDim_; }
  std::int64_t numEmbeddingsPerPartition() const { return vocab_.last - vocab_.first; }
  std::int64_t vocabStartIndex() const { return vocab_.first; }
  std::int64_t vocabEndIndex() const { return vocab_.last; }
  const VocabParallelEmbeddingOptions& options() const { return options_; }

 private:
  LayerContext ctx_;
  VocabParallelEmbeddingOptions options_;
  std::int64_t numEmbeddings_, embeddingDim_;
  VocabRange vocab_{};
  Parameter weight_;
  // Saved by forward for backward.
  Tensor ids_;         // int64 (b, s), a contiguous copy
  Shape outputShape_;  // (b, s, h) or (s/T, b, h)
};

}  // namespace tpsim
