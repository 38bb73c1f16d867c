// Integer helpers of Megatron's tensor_parallel/utils.py and core/utils.py: exact division
// (divide, SPEC 2.4) and the vocabulary partition of VocabUtility (SPEC 2.3).
//
// Pure host arithmetic: no tensors, no groups. The tensor splitters of utils.py
// (split_tensor_along_last_dim and the 1-D chunk split/gather) are not here; the split and
// gather primitives of mappings.h cover them.
#pragma once

#include <cstdint>

namespace tpsim {

// a / b, which must be exact (b > 0). `what` names the caller and the division, as in
// "ColumnParallelLinear: output_size by the TP size"; the error reads
// "<what>: <a> is not divisible by <b>".
std::int64_t divide(std::int64_t a, std::int64_t b, const char* what);

// A half-open range of vocabulary ids, [first, last).
struct VocabRange {
  std::int64_t first;
  std::int64_t last;
};

// The ids rank `rank` owns when every rank holds `perPartitionVocabSize` of them:
// [rank·p, rank·p + p). Megatron also takes the world size and ignores it; this port drops it.
VocabRange vocabRangeFromPerPartitionVocabSize(std::int64_t perPartitionVocabSize, int rank);

// The same with p = globalVocabSize / worldSize, which must be exact.
VocabRange vocabRangeFromGlobalVocabSize(std::int64_t globalVocabSize, int rank, int worldSize);

}  // namespace tpsim
