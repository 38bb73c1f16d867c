#include "core/mappings.h"

#include <algorithm>
#include <memory>
#include <vector>

#include "backends/errors.h"

namespace tpsim {
namespace {

Tensor copyOf(Compute& compute, ConstView x) {
  Tensor out = compute.empty(x.shape(), x.dtype());  // shape of x
  compute.copy(x, out);
  return out;
}

// x itself when contiguous (collectives take flat buffers), else a contiguous copy kept in storage.
ConstView contiguous(Compute& compute, ConstView x, Tensor& storage) {
  if (x.isContiguous()) return x;
  storage = copyOf(compute, x);
  return storage;
}

Shape withDim(Shape shape, int dim, std::int64_t extent) {
  shape[dim] = extent;
  return shape;
}

// Block q of a flat buffer of equal blocks shaped like `shape`: the dim-0 collective layout.
View block(View flat, int q, const Shape& shape) {
  const std::int64_t c = shape.numel();
  return flat.slice(0, q * c, (q + 1) * c).reshape(shape);
}

void checkHasDims(const char* where, ConstView x) {
  TPSIM_CHECK(x.rank() >= 1, where, ": x must have at least one dim, got a scalar");
}

// Extent per rank when dim `dim` of x is cut into |group| equal chunks.
std::int64_t perRank(const char* where, Collectives& group, ConstView x, int dim) {
  const int n = group.size();
  TPSIM_CHECK(x.dim(dim) % n == 0, where, ": ", dim == 0 ? "dim 0" : "the last dim",
              " of x must be divisible by the size ", n, " of group '", group.label(), "', got x ", x.shape().str());
  return x.dim(dim) / n;
}

// Checks an uneven split (one non-negative size per rank) and returns the n + 1 block offsets:
// block q is rows [offsets[q], offsets[q + 1]).
std::vector<std::int64_t> splitOffsets(const char* where, const char* arg, const SplitSizes& sizes,
                                       const Collectives& group) {
  TPSIM_CHECK(sizes.size() == std::size_t(group.size()), where, ": ", arg, " must have one entry per rank of group '",
              group.label(), "' (", group.size(), "), got ", sizes.size());
  std::vector<std::int64_t> offsets{0};
  for (std::size_t q = 0; q < sizes.size(); ++q) {
    TPSIM_CHECK(sizes[q] >= 0, where, ": ", arg, "[", q, "] must be >= 0, got ", sizes[q]);
    offsets.push_back(offsets.back() + sizes[q]);
  }
  return offsets;
}

// AG^0 with uneven blocks: rank q passes x_q (s_q, ...).
Tensor gatherUneven(Compute& compute, Collectives& group, ConstView x, const SplitSizes& sizes) {
  const char* where = "gatherAlongFirstDim";
  const std::vector<std::int64_t> offsets = splitOffsets(where, "outputSplitSizes", sizes, group);
  const int r = group.rank();
  TPSIM_CHECK(x.dim(0) == sizes[r], where, ": dim 0 of x must be outputSplitSizes[", r, "] = ", sizes[r], " on rank ",
              r, ", got x ", x.shape().str());
  if (group.size() == 1) return copyOf(compute, x);
  Tensor out = compute.empty(withDim(x.shape(), 0, offsets.back()), x.dtype());  // (Σ_q s_q, ...)
  // c10d gathers unequal blocks with one broadcast per rank (ProcessGroupNCCL::allgather), and so
  // do we: each block lands in place in out, with no padded staging buffer and no compaction copy.
  // All n broadcasts are issued before the first wait, as c10d coalesces them.
  Tensor storage;
  const ConstView own = contiguous(compute, x, storage);  // (s_r, ...)
  std::vector<std::unique_ptr<Work>> pending;
  for (int q = 0; q < group.size(); ++q) {
    const View dst = out.view().slice(0, offsets[q], offsets[q + 1]);  // (s_q, ...)
    pending.push_back(group.broadcast(q == r ? own : dst, dst, BroadcastOptions{q}));
  }
  for (auto& work : pending) work->wait();
  return out;
}

// RS^0 with uneven blocks: every rank passes x (Σ_q s_q, ...) and rank r gets block r of the sum.
Tensor reduceScatterUneven(Compute& compute, Collectives& group, ConstView x, const SplitSizes& sizes) {
  const char* where = "reduceScatterAlongFirstDim";
  const std::vector<std::int64_t> offsets = splitOffsets(where, "inputSplitSizes", sizes, group);
  TPSIM_CHECK(x.dim(0) == offsets.back(), where, ": dim 0 of x must be the sum ", offsets.back(),
              " of inputSplitSizes, got x ", x.shape().str());
  const int n = group.size();
  const int r = group.rank();
  if (n == 1) return copyOf(compute, x);
  // c10d reduce-scatters unequal blocks with one rooted reduce per rank, which Collectives lacks.
  // Instead every block is padded with zero rows to the longest one and a single reduceScatter
  // runs on the padded buffer: the zeros add nothing, and rank r keeps its first s_r rows.
  std::int64_t longest = 0;
  for (std::int64_t s : sizes) longest = std::max(longest, s);
  Tensor padded = compute.zeros(withDim(x.shape(), 0, n * longest), x.dtype());  // (n·max_q s_q, ...)
  for (int q = 0; q < n; ++q)
    compute.copy(x.slice(0, offsets[q], offsets[q + 1]), padded.view().slice(0, q * longest, q * longest + sizes[q]));
  const View mine = padded.view().slice(0, r * longest, (r + 1) * longest);  // (max_q s_q, ...)
  group.reduceScatter(padded, mine)->wait();
  return copyOf(compute, mine.slice(0, 0, sizes[r]));  // (s_r, ...)
}

}  // namespace

void reduce(Compute& compute, Collectives& group, View x) {
  if (group.size() == 1) return;
  if (x.isContiguous()) {
    group.allReduce(x)->wait();
    return;
  }
  Tensor sum = copyOf(compute, x);  // shape of x, contiguous
  group.allReduce(sum)->wait();
  compute.copy(sum, x);
}

Tensor splitAlongLastDim(Compute& compute, Collectives& group, ConstView x) {
  checkHasDims("splitAlongLastDim", x);
  const std::int64_t c = perRank("splitAlongLastDim", group, x, x.rank() - 1);
  const int r = group.rank();
  return copyOf(compute, x.slice(-1, r * c, (r + 1) * c));  // (..., c/n)
}

Tensor splitAlongFirstDim(Compute& compute, Collectives& group, ConstView x) {
  checkHasDims("splitAlongFirstDim", x);
  const std::int64_t m = perRank("splitAlongFirstDim", group, x, 0);
  const int r = group.rank();
  return copyOf(compute, x.slice(0, r * m, (r + 1) * m));  // (d0/n, ...)
}

Tensor gatherAlongLastDim(Compute& compute, Collectives& group, ConstView x) {
  checkHasDims("gatherAlongLastDim", x);
  const int n = group.size();
  if (n == 1) return copyOf(compute, x);
  // As Megatron: gather the n blocks along dim 0, then move block q to columns [q·c, (q+1)·c).
  Tensor storage;
  Tensor gathered = compute.empty(Shape{n * x.numel()}, x.dtype());  // (n·numel(x)): n blocks shaped like x
  group.allGather(contiguous(compute, x, storage), gathered)->wait();
  const std::int64_t c = x.dim(-1);
  Tensor out = compute.empty(withDim(x.shape(), x.rank() - 1, n * c), x.dtype());  // (..., n·c)
  for (int q = 0; q < n; ++q) compute.copy(block(gathered, q, x.shape()), out.view().slice(-1, q * c, (q + 1) * c));
  return out;
}

Tensor gatherAlongFirstDim(Compute& compute, Collectives& group, ConstView x, const SplitSizes& outputSplitSizes) {
  checkHasDims("gatherAlongFirstDim", x);
  if (!outputSplitSizes.empty()) return gatherUneven(compute, group, x, outputSplitSizes);
  const int n = group.size();
  if (n == 1) return copyOf(compute, x);
  Tensor storage;
  Tensor out = compute.empty(withDim(x.shape(), 0, n * x.dim(0)), x.dtype());  // (n·d0, ...)
  group.allGather(contiguous(compute, x, storage), out)->wait();
  return out;
}

SharedTensor gatherAlongFirstDimShared(Compute& compute, Collectives& group, ConstView x) {
  checkHasDims("gatherAlongFirstDimShared", x);
  if (group.size() == 1) return std::make_shared<Tensor>(copyOf(compute, x));
  Tensor storage;
  SharedTensor out;
  group.allGatherShared(contiguous(compute, x, storage), withDim(x.shape(), 0, group.size() * x.dim(0)), compute, out)
      ->wait();
  return out;
}

Tensor reduceScatterAlongFirstDim(Compute& compute, Collectives& group, ConstView x,
                                  const SplitSizes& inputSplitSizes) {
  checkHasDims("reduceScatterAlongFirstDim", x);
  if (!inputSplitSizes.empty()) return reduceScatterUneven(compute, group, x, inputSplitSizes);
  const std::int64_t m = perRank("reduceScatterAlongFirstDim", group, x, 0);
  if (group.size() == 1) return copyOf(compute, x);
  Tensor storage;
  Tensor out = compute.empty(withDim(x.shape(), 0, m), x.dtype());  // (d0/n, ...)
  group.reduceScatter(contiguous(compute, x, storage), out)->wait();
  return out;
}

Tensor reduceScatterAlongFirstDimConsuming(Compute& compute, Collectives& group, Tensor x) {
  checkHasDims("reduceScatterAlongFirstDimConsuming", x);
  const std::int64_t m = perRank("reduceScatterAlongFirstDimConsuming", group, x, 0);
  if (group.size() == 1) return x;
  Tensor out = compute.empty(withDim(x.shape(), 0, m), x.dtype());  // (d0/n, ...)
  group.reduceScatterConsuming(std::move(x), out)->wait();
  return out;
}

Tensor reduceScatterAlongLastDim(Compute& compute, Collectives& group, ConstView x) {
  checkHasDims("reduceScatterAlongLastDim", x);
  const std::int64_t c = perRank("reduceScatterAlongLastDim", group, x, x.rank() - 1);
  const int n = group.size();
  if (n == 1) return copyOf(compute, x);
  // As Megatron: stack the n column blocks along dim 0, then reduce-scatter along dim 0.
  const Shape blockShape = withDim(x.shape(), x.rank() - 1, c);
  Tensor stacked = compute.empty(Shape{x.numel()}, x.dtype());  // (numel(x)): block q = columns of rank q
  for (int q = 0; q < n; ++q) compute.copy(x.slice(-1, q * c, (q + 1) * c), block(stacked, q, blockShape));
  Tensor out = compute.empty(blockShape, x.dtype());  // (..., c/n)
  group.reduceScatter(stacked, out)->wait();
  return out;
}

// Identity halves: nothing moves. They exist so that every mapping reads as a forward/backward pair.
void copyToTpRegionForward(Compute&, Collectives&, View) {}
void copyToTpRegionBackward(Compute& compute, Collectives& group, View dy) { reduce(compute, group, dy); }
void reduceFromTpRegionForward(Compute& compute, Collectives& group, View x) { reduce(compute, group, x); }
void reduceFromTpRegionBackward(Compute&, Collectives&, View) {}

Tensor scatterToTpRegionForward(Compute& compute, Collectives& group, ConstView x) {
  return splitAlongLastDim(compute, group, x);
}
Tensor scatterToTpRegionBackward(Compute& compute, Collectives& group, ConstView dy) {
  return gatherAlongLastDim(compute, group, dy);
}
Tensor gatherFromTpRegionForward(Compute& compute, Collectives& group, ConstView x) {
  return gatherAlongLastDim(compute, group, x);
}
Tensor gatherFromTpRegionBackward(Compute& compute, Collectives& group, ConstView dy) {
  return splitAlongLastDim(compute, group, dy);
}

Tensor scatterToSpRegionForward(Compute& compute, Collectives& group, ConstView x) {
  return splitAlongFirstDim(compute, group, x);
}
Tensor scatterToSpRegionBackward(Compute& compute, Collectives& group, ConstView dy) {
  return gatherAlongFirstDim(compute, group, dy);
}
Tensor gatherFromSpRegionForward(Compute& compute, Collectives& group, ConstView x,
                                 const SplitSizes& outputSplitSizes) {
  return gatherAlongFirstDim(compute, group, x, outputSplitSizes);
}
Tensor gatherFromSpRegionBackward(Compute& compute, Collectives& group, ConstView dy, bool tensorParallelOutputGrad,
                                  const SplitSizes& outputSplitSizes) {
  if (tensorParallelOutputGrad) return reduceScatterAlongFirstDim(compute, group, dy, outputSplitSizes);
  // SPLIT^0 cuts equal chunks, which cannot undo an uneven gather: Megatron asserts, and so do we.
  TPSIM_CHECK(outputSplitSizes.empty(),
              "gatherFromSpRegionBackward: outputSplitSizes must be empty when "
              "tensorParallelOutputGrad is false, got ",
              outputSplitSizes.size(), " sizes");
  return splitAlongFirstDim(compute, group, dy);
}
Tensor reduceScatterToSpRegionForward(Compute& compute, Collectives& group, ConstView x,
                                      const SplitSizes& inputSplitSizes) {
  return reduceScatterAlongFirstDim(compute, group, x, inputSplitSizes);
}
Tensor reduceScatterToSpRegionBackward(Compute& compute, Collectives& group, ConstView dy,
                                       const SplitSizes& inputSplitSizes) {
  return gatherAlongFirstDim(compute, group, dy, inputSplitSizes);
}

Tensor allGatherLastDimFromTpRegionForward(Compute& compute, Collectives& group, ConstView x) {
  return gatherAlongLastDim(compute, group, x);
}
Tensor allGatherLastDimFromTpRegionBackward(Compute& compute, Collectives& group, ConstView dy) {
  return reduceScatterAlongLastDim(compute, group, dy);
}
Tensor reduceScatterLastDimToTpRegionForward(Compute& compute, Collectives& group, ConstView x) {
  return reduceScatterAlongLastDim(compute, group, x);
}
Tensor reduceScatterLastDimToTpRegionBackward(Compute& compute, Collectives& group, ConstView dy) {
  return gatherAlongLastDim(compute, group, dy);
}

}  // namespace tpsim
