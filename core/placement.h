// Placement: how each tensor of a layer (parameters, activations, gradients) maps onto the T x G
// ranks, as one small value per tensor and mesh axis (DTensor's Shard / Replicate / Partial, with
// Megatron's partition_stride and GTP_remat's padded second split of dim 0), and the one function
// that turns it into the blocks of the global tensor a rank (t, g) holds.
//
// Pure metadata: it reads the layers' attributes (tensor_model_parallel, partition_dim,
// partition_stride, is_gtp_weight_remat, group, pad_length) and options, never tensor values.
// GTP_remat peers are data parallel: they split the activations' batch dim between them.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/embedding.h"
#include "core/grouped_linear.h"
#include "core/layers.h"
#include "core/parameter.h"

namespace tpsim {

enum class AxisKind {
  kReplicate,  // every rank of the axis holds the whole (of what the other axis leaves it)
  kShard,      // cut along `dim`
  kPartial,    // every rank holds a same-shaped partial sum; the sum over the axis is the tensor
};

// One mesh axis (TP of size T, or GTP_remat of size G) of a tensor's placement.
struct AxisPlacement {
  AxisKind kind = AxisKind::kReplicate;
  int size = 1;
  int dim = 0;     // kShard: the dim cut (GTP_remat: of the TP-local tensor)
  // kShard over TP: rank t holds chunks t, t+T, ... of dim/(T·stride) (SPEC 3.11). kReplicate over
  // TP with stride > 1: the whole, gathered from such shards in rank order (gather_output), so dim
  // `dim` holds rank 0's chunks, then rank 1's, ...: not the logical order.
  int stride = 1;
  // kShard over GTP_remat: zero rows appended to the TP-local dim before the cut (SPEC 4.2).
  std::int64_t padLength = 0;
};

enum class TensorRole { kParameter, kInput, kOutput, kGradient };

struct TensorPlacement {
  std::string name;  // as tpsim run names results: "weight", "fc1.bias.grad", "output"
  TensorRole role = TensorRole::kInput;
  std::vector<std::int64_t> shape;  // global, logical (no padding)
  AxisPlacement tp, gtp;
  bool vocab = false;  // dim 0 is the embedding's vocabulary
  // kPartial: the reduction that completes it ("all-reduce over TP", "reduce-scatter over TP").
  std::string reduction;
  // Parameters and their gradients: Megatron's duplicate filters (SPEC 3.3, 3.5) count a
  // tensor_model_parallel tensor on every TP rank, others on TP rank 0; a GTP_remat shard on every
  // GTP_remat rank, others on GTP_remat rank 0.
  bool tensorModelParallel = false;
  bool gtpShard = false;

  // The global tensor with every pad row placed (see blocksOf): shape with dim 0 grown by
  // padLength per TP slice (T slices when TP cuts dim 0, else one).
  std::vector<std::int64_t> layoutShape() const;
  // Whether the duplicate filters count rank (t, g)'s copy (parameters and their gradients).
  bool countedOn(int t, int g) const;
};

struct Range {
  std::int64_t begin = 0, end = 0;
  std::int64_t size() const { return end - begin; }
};

// A box of a rank's tensor: where it sits in the global tensor and in the rank's local tensor.
struct Block {
  bool pad = false;            // zero rows of GTP_remat's alignment padding
  std::vector<Range> global;   // per dim, logical coordinates; dim 0 is empty for a pad block
  std::vector<Range> layout;   // per dim, coordinates of layoutShape()
  std::vector<std::int64_t> local;  // per dim, offset in the rank's tensor
};

// The blocks rank (t, g) holds, in local order along each dim. TP cuts first, then GTP_remat cuts
// the TP-local tensor (its dim 0 padded). Layout coordinates put the pad rows of TP slice t right
// after slice t's last row; at stride 1 that is where the checkpoint saves them (SPEC 4.11.4: after
// each TP slice of a column weight, at the tail otherwise). Blocks of a kShard axis tile the tensor
// once over that axis; a kReplicate or kPartial axis gives each of its ranks the same blocks.
std::vector<Block> blocksOf(const TensorPlacement& placement, int t, int g);

// blocksOf's inverse: every rank holding the element at `layoutIndex` (coordinates of
// layoutShape()), with where it sits in that rank's tensor. One holder per copy: a kShard axis
// contributes one rank, a kReplicate or kPartial axis all of its ranks.
struct Holder {
  int t = 0, g = 0;
  std::vector<std::int64_t> local;  // index in the rank's tensor
  bool pad = false;
};
std::vector<Holder> holdersOf(const TensorPlacement& placement, const std::vector<std::int64_t>& layoutIndex);

// Along the GTP_remat dim of `placement` (kShard over GTP_remat): where logical index i sits in
// layoutShape() (behind the pad rows of every TP slice that ends before it), and which logical
// index a layout index holds (nullopt for a pad row). Row by row, what a checkpoint's saved global
// tensor holds.
std::int64_t layoutIndexOf(const TensorPlacement& placement, std::int64_t logical);
std::optional<std::int64_t> logicalIndexOf(const TensorPlacement& placement, std::int64_t layout);

// The rank's tensor shape: the extents of its blocks.
std::vector<std::int64_t> localShape(const TensorPlacement& placement, int t, int g);

// The elements of rank (t, g)'s tensor that are GTP_remat padding: its
// gtpLocalPadZeroCount(shard, 0, numel) (SPEC 3.6).
std::int64_t padZeroCount(const TensorPlacement& placement, int t, int g);

// The placement named `name` among `placements`; throws InvalidArgument naming it when absent.
const TensorPlacement& placementNamed(const std::vector<TensorPlacement>& placements, const std::string& name);

// `placement` without its GTP_remat axis: what each TP rank holds before GTP_remat cuts it again
// (the TP-local tensor).
TensorPlacement withoutGtp(const TensorPlacement& placement);

// A tensor partial over TP as a caller that keeps every partial sum sees it (disable_grad_reduce):
// the T partial sums stacked along a new dim 0, TP rank t's at index t.
TensorPlacement stackedPartials(const TensorPlacement& partial);

// A parameter's placement from its attributes and its shard's shape. tpSize and gtpSize are the
// layer's group sizes: a parameter records its GTP_remat group only when it is a shard, and never
// its TP group. Throws InvalidArgument when a shard's group size is not gtpSize.
TensorPlacement parameterPlacement(const Parameter& param, const std::string& name, int tpSize, int gtpSize);

// Every tensor of a constructed layer, on the (seq, batch) tokens it runs on: parameters, the
// input, partial sums before a TP reduction (T > 1), the output, the output's and input's
// gradients and the parameters' gradients (what the optimizer reads: the shard's main_grad under
// GTP_remat). Names are prefixed with `prefix` ("fc1.").
std::vector<TensorPlacement> layerPlacements(ColumnParallelLinear& layer, std::int64_t seq, std::int64_t batch,
                                             const std::string& prefix = "");
std::vector<TensorPlacement> layerPlacements(RowParallelLinear& layer, std::int64_t seq, std::int64_t batch,
                                             const std::string& prefix = "");
std::vector<TensorPlacement> layerPlacements(VocabParallelEmbedding& layer, std::int64_t seq, std::int64_t batch,
                                             const std::string& prefix = "");

// The local experts of an MoE layer on `tokens` routed tokens in all (rows sorted by expert; the
// GTP_remat peers, data parallel, hold tokens / G each): expert i's "weight<i>" and "bias<i>",
// the tokens' activations (M, ·) and every gradient. The token dispatcher, not the layer, sums the
// partial sums over the expert TP group.
std::vector<TensorPlacement> layerPlacements(GroupedParallelLinear& layer, std::int64_t tokens,
                                             const std::string& prefix = "");

const char* axisKindName(AxisKind kind);  // "replicate", "shard", "partial"

// Text for people, shared by tpsim layout, the demo's shard lines and checkpoint inspection.
// Both axes: "TP: shard dim 0; GTP_remat: shard dim 0 of the TP-local tensor, 16 pad rows per TP slice".
std::string placementText(const TensorPlacement& placement);
// What rank (t, g) holds, in global logical coordinates: "[0, 8) x [0, 16) + pad rows [8, 16) of its 16".
std::string holdsText(const TensorPlacement& placement, int t, int g);

}  // namespace tpsim
