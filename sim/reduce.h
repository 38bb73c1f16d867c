// The simulator's reduction rule, shared by allReduce and reduceScatter.
//
// out = in_0 + in_1 + ... + in_{n-1}, added in rank order, each partial sum rounded to the data's
// dtype (as a ring of NCCL kernels does for 16-bit data, but in a fixed order), so results are
// bitwise reproducible for any thread count. kMean divides the sum by n once, in fp32 (fp64 for
// fp64; truncating for int64). Not a general reduction library: sum and mean only.
#pragma once

#include <cstdint>
#include <vector>

#include "backends/collectives.h"
#include "backends/dtype.h"

namespace tpsim::sim {

// inputs[r] points at `count` elements of `dtype`; out must not overlap any input. The fp8 dtypes
// are not reducible (a sum of E4M3 values with their own block scales means nothing).
void reduceInRankOrder(DType dtype, ReduceOp op, const std::vector<const void*>& inputs, std::int64_t count,
                       void* out);

// The same sum built one member at a time, as the members arrive (HostTransport::fold): sum = in
// for the first, sum = sum + in for each next one in rank order; then finishSum divides by n for
// kMean. Bitwise reduceInRankOrder's result.
void foldIntoSum(DType dtype, const void* in, std::int64_t count, void* sum, bool first);
void finishSum(DType dtype, ReduceOp op, int n, std::int64_t count, void* sum);

}  // namespace tpsim::sim
