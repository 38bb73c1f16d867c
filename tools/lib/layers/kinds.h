// The layer kinds of the table (tools/lib/layer_kind.h), one file each, and what the linear ones
// share.
#pragma once

#include "core/layers.h"
#include "core/random.h"
#include "tools/lib/layer_kind.h"

namespace tpsim::tools {

const LayerKind& columnLayerKind();     // linear.cc: ColumnParallelLinear
const LayerKind& rowLayerKind();        // linear.cc: RowParallelLinear
const LayerKind& embeddingLayerKind();  // embedding.cc: VocabParallelEmbedding
const LayerKind& mlpLayerKind();        // mlp.cc: fc1 column, exact GeLU, fc2 row
const LayerKind& groupedColumnLayerKind();  // grouped.cc: the experts' GroupedParallelLinear, column mode
const LayerKind& groupedRowLayerKind();     // grouped.cc: the same in row mode

// Bytes an element of an MXFP8 weight (--weight-format mxfp8) that the reference's making of its
// two quantized copies holds at its peak (mxfp8Weight: the weight in double, its TP ranks' shards
// quantized, put together), besides the first copy (measured on columns of 8M and 32M parameters,
// fp32 and bf16: 28 on an idle machine; beside other work the 8M column peaked 40 MiB higher, 0.99
// of the estimate at 28).
constexpr double kMxfp8ReferenceBytes = 32;

// The initializer a run's layers are built with: never called, as initialization is off (the run
// copies its tensors in).
InitMethod uninitialized();

// Forward and backward of a column or row layer as its caller uses it: a bias the layer returns
// (skip_bias_add) is added by the caller, so its gradient is the row sums of dy.
template <class Linear>
RankStep linearStep(Compute& compute, Linear& layer, ConstView x, ConstView dy, DType dtype,
                    const std::function<void()>& forwardDone) {
  LayerOutput out = layer.forward(x);
  Tensor db;
  if (out.outputBias) compute.addBias(out.outputBias->data, out.output);
  forwardDone();
  if (out.outputBias) {
    db = compute.empty({dy.dim(-1)}, dtype);
    compute.sumRows(dy, db);
  }
  Tensor dx = layer.backward(dy, db.defined() ? ConstView(db) : ConstView());
  return {std::move(out.output), std::move(dx)};
}

// Every parameter of `named` that the layer has (a bias may be absent).
std::vector<std::pair<std::string, Parameter*>> present(std::vector<std::pair<std::string, Parameter*>> named);

}  // namespace tpsim::tools
