// HostTensor: an unsharded tensor in host memory, as the tools read, generate, compare and save
// it. Values are doubles already rounded to the tensor's dtype (int64 ids are exact up to 2^53).
// The helpers cut a HostTensor into Megatron's shards, put shards back together, and move them
// to and from a backend. Not a tensor library: row-major, copies everywhere, sized for tools.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backends/compute.h"

namespace tpsim::tools {

struct HostTensor {
  std::vector<std::int64_t> shape;
  DType dtype = DType::kFloat32;
  std::vector<double> values;

  std::int64_t numel() const;
  std::string shapeStr() const;  // "(8, 2, 16)"
};

// a · b for sizes derived from flags or file headers. Throws InvalidArgument naming `what` (the
// flags or file they come from) when either is negative or the product does not fit in int64.
std::int64_t checkedMul(std::int64_t a, std::int64_t b, const std::string& what);

// Rounds every value to `dtype` (bf16/fp16/fp8e4m3 round to nearest even, fp8e4m3 saturates, int64
// must be integral, e8m0 must be a power of two).
HostTensor makeHost(std::vector<std::int64_t> shape, DType dtype, std::vector<double> values);

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

Tensor toBackend(Compute& compute, const HostTensor& t);
HostTensor fromBackend(Compute& compute, ConstView v);

}  // namespace tpsim::tools
