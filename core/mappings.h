// Megatron's mappings.py: the primitive collectives (SPEC 2.1) and the region mappings (SPEC 2.2)
// as explicit forward/backward pairs, each taking the rank's Compute and the group Γ.
// Not autograd and not global state: a layer calls xxxForward, then xxxBackward on the gradient,
// and resolving Megatron's "no group means the global TP group" is the caller's job. Results are
// new contiguous Tensors of the input's dtype, except the all-reduce pair, which works in place.
#pragma once

#include <cstdint>
#include <vector>

#include "backends/collectives.h"
#include "backends/compute.h"
#include "backends/tensor.h"
#include "backends/view.h"

namespace tpsim {

// Dim-0 extent of each group rank's block, indexed by group rank, for the uneven dim-0 gather and
// reduce-scatter. Empty means equal blocks (Megatron's None): a real list has |Γ| >= 1 entries.
using SplitSizes = std::vector<std::int64_t>;

// ---- Primitives (SPEC 2.1). n = |Γ|, r = rank in Γ. ---------------------------------------------
//
// With n == 1 Megatron returns the input tensor itself; these return a copy (the last-dim
// reduce-scatter copies in Megatron too), because a Tensor owns its memory and a ConstView input
// cannot be handed back as one. No collective is issued at n == 1, as in Megatron. Inputs may be
// strided; collectives see contiguous buffers only, so a strided input is copied first.

// x <- Σ_r x_r, in place: the caller's buffer is overwritten with the sum (SPEC 8 item 1; Megatron
// does so for contiguous x). A strided x is reduced through a contiguous copy and written back, so
// unlike Megatron the caller's view holds the sum whatever its strides. n == 1 leaves x as is.
void reduce(Compute& compute, Collectives& group, View x);

// Chunk r of the last dim, which must divide by n.  x: (..., c)  ->  (..., c/n)
Tensor splitAlongLastDim(Compute& compute, Collectives& group, ConstView x);
// Chunk r of dim 0, which must divide by n.  x: (d0, ...)  ->  (d0/n, ...)
Tensor splitAlongFirstDim(Compute& compute, Collectives& group, ConstView x);

// concat_{-1}(x_0, ..., x_{n-1}).  x: (..., c)  ->  (..., n·c). For a 1-D x this is the dim-0 gather.
Tensor gatherAlongLastDim(Compute& compute, Collectives& group, ConstView x);
// concat_0(x_0, ..., x_{n-1}).  x: (d0, ...)  ->  (n·d0, ...), or with outputSplitSizes s (rank q
// passes x_q: (s_q, ...)): (Σ_q s_q, ...).
Tensor gatherAlongFirstDim(Compute& compute, Collectives& group, ConstView x, const SplitSizes& outputSplitSizes = {});
// gatherAlongFirstDim (even split) into a tensor that its holders only read and the group's members
// may share (Collectives::allGatherShared): the backward of a sequence-parallel layer's output.
SharedTensor gatherAlongFirstDimShared(Compute& compute, Collectives& group, ConstView x);

// Rows [r·d0/n, (r+1)·d0/n) of Σ_q x_q; d0 must divide by n.  x: (d0, ...)  ->  (d0/n, ...).
// With inputSplitSizes s (Σ_q s_q = d0): rows [s_0 + ... + s_{r-1}, ... + s_r) of the sum, (s_r, ...).
Tensor reduceScatterAlongFirstDim(Compute& compute, Collectives& group, ConstView x,
                                  const SplitSizes& inputSplitSizes = {});
// reduceScatterAlongFirstDim (even split) of a contiguous x the caller gives up
// (Collectives::reduceScatterConsuming): the forward of a sequence-parallel row layer, whose
// ranks' partial outputs need not all be held at once.
Tensor reduceScatterAlongFirstDimConsuming(Compute& compute, Collectives& group, Tensor x);
// Columns [r·c/n, (r+1)·c/n) of Σ_q x_q; c must divide by n.  x: (..., c)  ->  (..., c/n)
Tensor reduceScatterAlongLastDim(Compute& compute, Collectives& group, ConstView x);

// ---- Region mappings (SPEC 2.2): Megatron's xxx_tensor_model_parallel_region (Tp) and
// xxx_sequence_parallel_region (Sp). Each Backward is the adjoint of its Forward (SPEC 6 item 3).

// copy_to: identity | dy <- AR(dy), in place.
void copyToTpRegionForward(Compute& compute, Collectives& group, View x);
void copyToTpRegionBackward(Compute& compute, Collectives& group, View dy);
// reduce_from: x <- AR(x), in place (overwrites the caller's x, SPEC 8 item 1) | identity.
void reduceFromTpRegionForward(Compute& compute, Collectives& group, View x);
void reduceFromTpRegionBackward(Compute& compute, Collectives& group, View dy);

// scatter_to (Tp): SPLIT^{-1} | AG^{-1}.
Tensor scatterToTpRegionForward(Compute& compute, Collectives& group, ConstView x);
Tensor scatterToTpRegionBackward(Compute& compute, Collectives& group, ConstView dy);
// gather_from (Tp): AG^{-1} | SPLIT^{-1}.
Tensor gatherFromTpRegionForward(Compute& compute, Collectives& group, ConstView x);
Tensor gatherFromTpRegionBackward(Compute& compute, Collectives& group, ConstView dy);

// scatter_to (Sp): SPLIT^0 | AG^0.
Tensor scatterToSpRegionForward(Compute& compute, Collectives& group, ConstView x);
Tensor scatterToSpRegionBackward(Compute& compute, Collectives& group, ConstView dy);
// gather_from (Sp): AG^0, optionally uneven | RS^0 with the same split sizes when the computation
// after the gather is tensor-parallel (tensorParallelOutputGrad, each rank holds a partial dY),
// else SPLIT^0 (every rank holds the full dY). Split sizes with tensorParallelOutputGrad == false
// are rejected by the backward, where Megatron asserts. Megatron's use_global_buffer is not
// offered: the result is always a fresh Tensor.
Tensor gatherFromSpRegionForward(Compute& compute, Collectives& group, ConstView x,
                                 const SplitSizes& outputSplitSizes = {});
Tensor gatherFromSpRegionBackward(Compute& compute, Collectives& group, ConstView dy,
                                  bool tensorParallelOutputGrad = true, const SplitSizes& outputSplitSizes = {});
// reduce_scatter_to (Sp): RS^0, optionally uneven | AG^0 with the same split sizes.
Tensor reduceScatterToSpRegionForward(Compute& compute, Collectives& group, ConstView x,
                                      const SplitSizes& inputSplitSizes = {});
Tensor reduceScatterToSpRegionBackward(Compute& compute, Collectives& group, ConstView dy,
                                       const SplitSizes& inputSplitSizes = {});

// all_gather_last_dim_from (Tp): AG^{-1} | RS^{-1}.
Tensor allGatherLastDimFromTpRegionForward(Compute& compute, Collectives& group, ConstView x);
Tensor allGatherLastDimFromTpRegionBackward(Compute& compute, Collectives& group, ConstView dy);
// reduce_scatter_last_dim_to (Tp): RS^{-1} | AG^{-1}.
Tensor reduceScatterLastDimToTpRegionForward(Compute& compute, Collectives& group, ConstView x);
Tensor reduceScatterLastDimToTpRegionBackward(Compute& compute, Collectives& group, ConstView dy);

}  // namespace tpsim
