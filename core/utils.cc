#include "core/utils.h"

#include "backends/errors.h"

namespace tpsim {

std::int64_t divide(std::int64_t a, std::int64_t b, const char* what) {
  TPSIM_CHECK(b > 0, what, ": the divisor must be positive, got ", b);
  TPSIM_CHECK(a % b == 0, what, ": ", a, " is not divisible by ", b);
  return a / b;
}

VocabRange vocabRangeFromPerPartitionVocabSize(std::int64_t perPartitionVocabSize, int rank) {
  TPSIM_CHECK(perPartitionVocabSize >= 0,
              "vocabRangeFromPerPartitionVocabSize: perPartitionVocabSize must be >= 0, got ", perPartitionVocabSize);
  TPSIM_CHECK(rank >= 0, "vocabRangeFromPerPartitionVocabSize: rank must be >= 0, got ", rank);
  const std::int64_t first = rank * perPartitionVocabSize;
  return {first, first + perPartitionVocabSize};
}

VocabRange vocabRangeFromGlobalVocabSize(std::int64_t globalVocabSize, int rank, int worldSize) {
  TPSIM_CHECK(worldSize > 0, "vocabRangeFromGlobalVocabSize: worldSize must be positive, got ", worldSize);
  TPSIM_CHECK(rank >= 0 && rank < worldSize, "vocabRangeFromGlobalVocabSize: rank must be in [0, ", worldSize,
              "), got ", rank);
  return vocabRangeFromPerPartitionVocabSize(
      divide(globalVocabSize, worldSize, "vocabRangeFromGlobalVocabSize: globalVocabSize by worldSize"), rank);
}

}  // namespace tpsim
