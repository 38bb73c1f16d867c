#include "sim/reduce.h"

#include <cstring>

namespace tpsim::sim {
namespace {

template <typename T>
void reduceNative(ReduceOp op, const std::vector<const void*>& inputs, std::int64_t count, T* out) {
  const std::size_t n = inputs.size();
  std::vector<T> acc(static_cast<const T*>(inputs[0]), static_cast<const T*>(inputs[0]) + count);
  for (std::size_t r = 1; r < n; ++r) {
    const T* x = static_cast<const T*>(inputs[r]);
    for (std::int64_t i = 0; i < count; ++i) acc[i] += x[i];
  }
  if (op == ReduceOp::kMean)
    for (auto& v : acc) v /= T(n);
  std::memcpy(out, acc.data(), std::size_t(count) * sizeof(T));
}

template <float (*Load)(std::uint16_t), std::uint16_t (*Store)(float)>
void reduce16(ReduceOp op, const std::vector<const void*>& inputs, std::int64_t count, std::uint16_t* out) {
  const std::size_t n = inputs.size();
  std::vector<std::uint16_t> acc(static_cast<const std::uint16_t*>(inputs[0]),
                                 static_cast<const std::uint16_t*>(inputs[0]) + count);
  for (std::size_t r = 1; r < n; ++r) {
    const auto* x = static_cast<const std::uint16_t*>(inputs[r]);
    for (std::int64_t i = 0; i < count; ++i) acc[i] = Store(Load(acc[i]) + Load(x[i]));
  }
  if (op == ReduceOp::kMean)
    for (auto& v : acc) v = Store(Load(v) / float(n));
  std::memcpy(out, acc.data(), std::size_t(count) * sizeof(std::uint16_t));
}

}  // namespace

void reduceInRankOrder(DType dtype, ReduceOp op, const std::vector<const void*>& inputs, std::int64_t count,
                       void* out) {
  if (count == 0) return;
  switch (dtype) {
    case DType::kFloat32: return reduceNative(op, inputs, count, static_cast<float*>(out));
    case DType::kFloat64: return reduceNative(op, inputs, count, static_cast<double*>(out));
    case DType::kInt64: return reduceNative(op, inputs, count, static_cast<std::int64_t*>(out));
    case DType::kBFloat16:
      return reduce16<bf16ToFloat, floatToBf16>(op, inputs, count, static_cast<std::uint16_t*>(out));
    case DType::kFloat16:
      return reduce16<halfToFloat, floatToHalf>(op, inputs, count, static_cast<std::uint16_t*>(out));
  }
}

}  // namespace tpsim::sim
