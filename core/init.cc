#include "core/init.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "backends/errors.h"
#include "core/attributes.h"

namespace tpsim {
namespace {

void checkWeight(const char* where, const Parameter& weight) {
  TPSIM_CHECK(weight.data.defined(), where, ": weight '", weight.name, "' must be allocated, got an undefined tensor");
  TPSIM_CHECK(isFloating(weight.data.dtype()), where, ": weight '", weight.name, "' must be floating, got ",
              weight.data.str());
}

// Draws `count` values with initMethod into a new host vector.
std::vector<float> draw(const char* where, const InitMethod& initMethod, Generator& generator, std::int64_t count) {
  TPSIM_CHECK(bool(initMethod), where, ": initMethod must be callable, got an empty function");
  std::vector<float> values(std::size_t(count), 0.f);
  initMethod(generator, values);
  TPSIM_CHECK(std::int64_t(values.size()) == count, where, ": initMethod must keep the ", count,
              " values it is given, got ", values.size());
  return values;
}

// dst = host values, rounded once into dst's dtype.
void uploadRounded(Compute& compute, const std::vector<float>& host, View dst) {
  if (dst.dtype() == DType::kFloat32) {
    compute.upload(host.data(), dst);
    return;
  }
  Tensor staging = compute.empty(dst.shape(), DType::kFloat32);
  compute.upload(host.data(), staging);
  compute.copy(staging, dst);
}

}  // namespace

void initializeAffineWeightGpu(Compute& compute, Parameter& weight, const InitMethod& initMethod,
                               int partitionDim, int stride, bool isExpert, RngTracker& tracker) {
  constexpr const char* kWhere = "initializeAffineWeightGpu";
  checkWeight(kWhere, weight);
  ParamAttributes tagged = weight.attrs;
  setTensorModelParallelAttributes(tagged, true, partitionDim, stride);  // throws before any change

  std::vector<float> values;  // (weight shape), row-major: the local shard
  {
    RngTracker::Fork fork = tracker.fork(isExpert ? kExpertParallelRngName : kModelParallelRngName);
    values = draw(kWhere, initMethod, fork.generator(), weight.data.numel());
  }
  uploadRounded(compute, values, weight.data);
  weight.attrs = std::move(tagged);
}

Tensor initializeAffineWeightCpu(Compute& compute, Parameter& weight, std::int64_t outputSize,
                                 std::int64_t inputSize, std::int64_t perPartitionSize, int partitionDim,
                                 const InitMethod& initMethod, Generator& cpuGenerator, int stride,
                                 bool returnMasterWeight, DType paramsDtype, std::optional<int> rank,
                                 std::optional<int> worldSize, bool skipSetTensorParallelAttributes) {
  constexpr const char* kWhere = "initializeAffineWeightCpu";
  checkWeight(kWhere, weight);
  const Shape& shape = weight.data.shape();
  TPSIM_CHECK(shape.rank() == 2, kWhere, ": weight '", weight.name, "' must be a matrix, got shape ", shape.str());
  TPSIM_CHECK(outputSize >= 0 && inputSize >= 0, kWhere, ": outputSize and inputSize must be >= 0, got ",
              outputSize, " and ", inputSize);
  TPSIM_CHECK(partitionDim == 0 || partitionDim == 1, kWhere, ": partitionDim must be 0 or 1, got ", partitionDim);
  TPSIM_CHECK(stride >= 1, kWhere, ": stride must be >= 1, got ", stride);
  TPSIM_CHECK(perPartitionSize >= 1, kWhere, ": perPartitionSize must be >= 1, got ", perPartitionSize);
  TPSIM_CHECK(perPartitionSize % stride == 0, kWhere, ": perPartitionSize ", perPartitionSize,
              " must be divisible by stride ", stride);
  TPSIM_CHECK(isFloating(paramsDtype), kWhere, ": paramsDtype must be floating, got ", dtypeName(paramsDtype));

  const std::int64_t dimSize = partitionDim == 0 ? outputSize : inputSize;
  // Megatron falls back to the global TP rank and size; only the single-partition case has a
  // default without one. With rank but no size it would keep every chunk from `rank` on.
  TPSIM_CHECK(rank.has_value() == worldSize.has_value(), kWhere,
              ": rank and worldSize must be given together, got only ", rank ? "rank" : "worldSize");
  if (!rank) {
    TPSIM_CHECK(perPartitionSize == dimSize, kWhere, ": rank and worldSize are required when perPartitionSize (",
                perPartitionSize, ") is not the whole partitionDim (", dimSize,
                "), got neither; there is no global TP group to default to");
    rank = 0;
    worldSize = 1;
  }
  TPSIM_CHECK(*worldSize >= 1 && *rank >= 0 && *rank < *worldSize, kWhere, ": rank must be in [0, worldSize = ",
              *worldSize, "), got ", *rank);

  // Indices along partitionDim of chunks rank, rank + world, … (the last chunk may be short).
  const std::int64_t chunk = perPartitionSize / stride;
  std::vector<std::int64_t> keep;
  for (std::int64_t begin = std::int64_t(*rank) * chunk; begin < dimSize; begin += std::int64_t(*worldSize) * chunk)
    for (std::int64_t i = begin; i < std::min(begin + chunk, dimSize); ++i) keep.push_back(i);
  const std::int64_t kept = std::int64_t(keep.size());
  const std::int64_t xRows = partitionDim == 0 ? kept : outputSize;  // X: (xRows, xCols), TP-local
  const std::int64_t xCols = partitionDim == 0 ? inputSize : kept;

  // A GTP shard holds rows [g·S, (g+1)·S) of X padded to G·S rows (SPEC 4.2).
  const bool gtp = weight.attrs.isGtpWeightRemat.value_or(false);
  std::int64_t firstRow = 0;  // of X held by weight row 0
  if (gtp) {
    Collectives* group = weight.attrs.group.value_or(nullptr);
    TPSIM_CHECK(group != nullptr, kWhere, ": GTP shard '", weight.name, "' must carry attrs.group, got none");
    const std::int64_t pad = weight.attrs.padLength.value_or(0);
    TPSIM_CHECK(pad >= 0, kWhere, ": padLength of '", weight.name, "' must be >= 0, got ", pad);
    TPSIM_CHECK(shape[0] * group->size() == xRows + pad && shape[1] == xCols, kWhere, ": GTP shard '",
                weight.name, "' must be (S, ", xCols, ") with S·G = ", xRows, " rows + padLength ", pad,
                " for G = ", group->size(), ", got ", shape.str());
    firstRow = shape[0] * group->rank();
  } else {
    TPSIM_CHECK(shape == Shape({xRows, xCols}), kWhere, ": weight '", weight.name, "' must be the kept chunks' shape (",
                xRows, ", ", xCols, "), got ", shape.str());
  }
  ParamAttributes tagged = weight.attrs;
  if (!skipSetTensorParallelAttributes) setTensorModelParallelAttributes(tagged, true, partitionDim, stride);

  std::vector<float> master = draw(kWhere, initMethod, cpuGenerator, outputSize * inputSize);  // (N, K), fp32
  auto masterAt = [&](std::int64_t row, std::int64_t col) {  // M cast to paramsDtype
    return roundTo(paramsDtype, master[std::size_t(row * inputSize + col)]);
  };
  std::vector<float> local(std::size_t(shape.numel()), 0.f);  // (rows of X held here, xCols); pad rows stay 0
  for (std::int64_t r = 0; r < shape[0] && firstRow + r < xRows; ++r) {
    const std::int64_t xr = firstRow + r;
    for (std::int64_t c = 0; c < xCols; ++c)
      local[std::size_t(r * xCols + c)] = partitionDim == 0 ? masterAt(keep[std::size_t(xr)], c)
                                                             : masterAt(xr, keep[std::size_t(c)]);
  }
  uploadRounded(compute, local, weight.data);
  weight.attrs = std::move(tagged);

  if (!returnMasterWeight) return Tensor();
  Tensor out = compute.empty(Shape{outputSize, inputSize}, paramsDtype);  // (N, K)
  uploadRounded(compute, master, out);
  return out;
}

}  // namespace tpsim
