#include "sim/reduce.h"

#include <cstring>

#include "backends/element_math.h"
#include "backends/errors.h"

namespace tpsim::sim {
namespace {

template <typename T>
void reduceNative(ReduceOp op, const std::vector<const void*>& inputs, std::int64_t count, T* out) {
  const std::size_t n = inputs.size();
  std::memcpy(out, inputs[0], std::size_t(count) * sizeof(T));
  for (std::size_t r = 1; r < n; ++r) {
    const T* x = static_cast<const T*>(inputs[r]);
    for (std::int64_t i = 0; i < count; ++i) out[i] = elem::reduceStep(out[i], x[i]);
  }
  if (op == ReduceOp::kMean)
    for (std::int64_t i = 0; i < count; ++i) out[i] = elem::meanFinish(out[i], T(n));
}

template <float (*Load)(std::uint16_t), std::uint16_t (*Store)(float)>
void reduce16(ReduceOp op, const std::vector<const void*>& inputs, std::int64_t count, std::uint16_t* out) {
  const std::size_t n = inputs.size();
  std::memcpy(out, inputs[0], std::size_t(count) * sizeof(std::uint16_t));
  for (std::size_t r = 1; r < n; ++r) {
    const auto* x = static_cast<const std::uint16_t*>(inputs[r]);
    for (std::int64_t i = 0; i < count; ++i) out[i] = Store(elem::reduceStep(Load(out[i]), Load(x[i])));
  }
  if (op == ReduceOp::kMean)
    for (std::int64_t i = 0; i < count; ++i) out[i] = Store(elem::meanFinish(Load(out[i]), float(n)));
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
    case DType::kFloat8E4M3:
    case DType::kFloat8E8M0:
      break;  // the collectives reject them when issued
  }
  TPSIM_INTERNAL_ASSERT(false, "reduceInRankOrder: cannot reduce ", dtypeName(dtype));
}

}  // namespace tpsim::sim
