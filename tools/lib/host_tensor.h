// HostTensor: an unsharded tensor in host memory, as the tools read, generate, compare and save
// it. Values are doubles already rounded to the tensor's dtype (int64 ids are exact up to 2^53).
// The helpers cut a HostTensor into Megatron's shards, put shards back together, and move them
// to and from a backend. Not a tensor library: row-major, copies everywhere, sized for tools.
#pragma once

#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "backends/compute.h"
#include "backends/dtype.h"
#include "core/placement.h"

namespace tpsim::tools {

struct HostTensor {
  std::vector<std::int64_t> shape;
  DType dtype = DType::kFloat32;
  std::vector<double> values;

  std::int64_t numel() const;
};

// A rank's tensor as its backend stored it: numel elements of dtype's size, read as doubles. What a
// run keeps of each rank's results, at 2 or 4 bytes an element rather than a HostTensor's 8.
struct StoredTensor {
  std::vector<std::int64_t> shape;
  DType dtype = DType::kFloat32;
  std::vector<char> bytes;

  std::int64_t numel() const;
  // fp32, the common case, inline: the verification reads every result element through here.
  double at(std::int64_t i) const {
    if (dtype == DType::kFloat32) {
      float f;
      std::memcpy(&f, bytes.data() + std::size_t(i) * 4, 4);
      return f;
    }
    return loadAsDouble(dtype, bytes.data() + std::size_t(i) * dtypeSize(dtype));
  }
};

// name -> tensor, named as a run's files name them: inputs (input, weight, bias, grad_output; the
// MLP's fc1.weight, ...) and results (output, input.grad, weight.grad, ...), each unsharded.
using TensorMap = std::map<std::string, HostTensor>;
// A run's inputs as it holds them: unsharded, each in its dtype's storage (2 or 4 bytes an element
// of a float tensor, not a HostTensor's 8), as the ranks receive them.
using InputMap = std::map<std::string, StoredTensor>;
// name -> shape of such tensors, where only their sizes matter.
using ShapeMap = std::map<std::string, std::vector<std::int64_t>>;

// a · b for sizes derived from flags or file headers. Throws InvalidArgument naming `what` (the
// flags or file they come from) when either is negative or the product does not fit in int64.
std::int64_t checkedMul(std::int64_t a, std::int64_t b, const std::string& what);

// v rounded to `dtype`, as makeHost rounds each value.
double roundedTo(DType dtype, double v);
// Rounds every value to `dtype` (bf16/fp16/fp8e4m3 round to nearest even, fp8e4m3 saturates, int64
// must be integral, e8m0 must be a power of two).
HostTensor makeHost(std::vector<std::int64_t> shape, DType dtype, std::vector<double> values);

// t in its dtype's storage; its values are already rounded to the dtype (makeHost).
StoredTensor storedOf(const HostTensor& t);
// n elements of `dtype` at `data` into n of `want` at `out`, each rounded to `want` as makeHost
// rounds (to nearest even): how a run takes the tensors it reads (--load's files, a checkpoint's
// parameters, the Python module's arrays).
void convertElements(DType dtype, const void* data, std::int64_t n, DType want, char* out);
InputMap storedOf(const TensorMap& tensors);
TensorMap hostOf(const InputMap& tensors);
// Elements [begin, begin + n) of t (flat) as doubles, into out.
void readDoubles(const StoredTensor& t, std::int64_t begin, std::int64_t n, double* out);

// Elements [begin, end) along `dim` (negative counts from the end).
HostTensor slice(const HostTensor& t, int dim, std::int64_t begin, std::int64_t end);
// Block `index` of `parts` equal blocks along `dim`.
HostTensor chunk(const HostTensor& t, int dim, int index, int parts);
HostTensor concat(const std::vector<HostTensor>& parts, int dim);
// Swaps dims 0 and 1: (b, s, h) <-> (s, b, h).
HostTensor swap01(const HostTensor& t);
// Elementwise sum of equally shaped tensors (finalize's reduction of replicated parameters over the
// GTP_remat peers).
HostTensor sum(const std::vector<HostTensor>& parts);

// Rank (t, g)'s tensor under `placement` (core/placement.h), cut from the global `full`: its blocks
// in local order, GTP_remat pad rows zero.
HostTensor shardOf(const TensorPlacement& placement, const HostTensor& full, int t, int g);
StoredTensor shardOf(const TensorPlacement& placement, const StoredTensor& full, int t, int g);
// n consecutive elements of a rank's tensor: the global tensor's from flat offset `from`, at the
// rank's tensor's flat offset `to`.
struct ShardRun {
  std::int64_t from = 0, to = 0, n = 0;
};
// What shardOf copies for rank (t, g), as runs in the order of `from`, runs that continue each
// other in both tensors merged; pad rows are in none.
std::vector<ShardRun> shardRuns(const TensorPlacement& placement, int t, int g);
// shardOf's inverse: the global tensor from the ranks' tensors local(t, g). A shard axis takes each
// element from its one holder, a replicate axis from its rank 0, and a partial axis adds its ranks'
// copies in rank order (the first assigned, so -0 stays -0); pad rows are dropped.
HostTensor assemble(const TensorPlacement& placement, const std::function<const HostTensor&(int t, int g)>& local);
HostTensor assemble(const TensorPlacement& placement, const std::function<const StoredTensor&(int t, int g)>& local);

// Rows [row, row + rows) and columns [col, col + cols) of a tensor seen as a (numel / last dim,
// last dim) matrix.
struct MatrixRect {
  std::int64_t row = 0, col = 0, rows = 0, cols = 0;
};
// r of assemble(placement, local), read from the ranks' tensors in place, into `value` (row-major,
// r.rows · r.cols); and into `farthest`, for each element, the copy farthest from it (a NaN
// farthest of all), the element itself where every copy equals it. Copies of a partial axis differ
// by design and are not compared, nor are pad rows. A replicated result a rank holds wrongly is
// then seen, whichever rank assemble read. A rank whose tensor has no shape and no data is another
// process's: r must lie in the ranks here. Returns whether any copy differs.
bool assembleRect(const TensorPlacement& placement, const std::function<const StoredTensor&(int t, int g)>& local,
                  const MatrixRect& r, std::vector<double>& value, std::vector<double>& farthest);

Tensor toBackend(Compute& compute, const HostTensor& t);
Tensor toBackend(Compute& compute, const StoredTensor& t);
HostTensor fromBackend(Compute& compute, ConstView v);
StoredTensor storedFromBackend(Compute& compute, ConstView v);
HostTensor hostOf(const StoredTensor& t);

}  // namespace tpsim::tools
