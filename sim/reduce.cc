#include "sim/reduce.h"

#include <cstring>

#include "backends/element_math.h"
#include "backends/errors.h"

namespace tpsim::sim {
namespace {

template <typename T>
void foldNative(const void* in, std::int64_t count, T* sum) {
  const T* x = static_cast<const T*>(in);
  for (std::int64_t i = 0; i < count; ++i) sum[i] = elem::reduceStep(sum[i], x[i]);
}

template <typename T>
void meanNative(int n, std::int64_t count, T* sum) {
  for (std::int64_t i = 0; i < count; ++i) sum[i] = elem::meanFinish(sum[i], T(n));
}

template <float (*Load)(std::uint16_t), std::uint16_t (*Store)(float)>
void fold16(const void* in, std::int64_t count, std::uint16_t* sum) {
  const auto* x = static_cast<const std::uint16_t*>(in);
  for (std::int64_t i = 0; i < count; ++i) sum[i] = Store(elem::reduceStep(Load(sum[i]), Load(x[i])));
}

template <float (*Load)(std::uint16_t), std::uint16_t (*Store)(float)>
void mean16(int n, std::int64_t count, std::uint16_t* sum) {
  for (std::int64_t i = 0; i < count; ++i) sum[i] = Store(elem::meanFinish(Load(sum[i]), float(n)));
}

}  // namespace

void foldIntoSum(DType dtype, const void* in, std::int64_t count, void* sum, bool first) {
  if (count == 0) return;
  if (first) {
    std::memcpy(sum, in, std::size_t(count) * dtypeSize(dtype));
    return;
  }
  switch (dtype) {
    case DType::kFloat32: return foldNative(in, count, static_cast<float*>(sum));
    case DType::kFloat64: return foldNative(in, count, static_cast<double*>(sum));
    case DType::kInt64: return foldNative(in, count, static_cast<std::int64_t*>(sum));
    case DType::kBFloat16: return fold16<bf16ToFloat, floatToBf16>(in, count, static_cast<std::uint16_t*>(sum));
    case DType::kFloat16: return fold16<halfToFloat, floatToHalf>(in, count, static_cast<std::uint16_t*>(sum));
    case DType::kFloat8E4M3:
    case DType::kFloat8E8M0:
      break;  // the collectives reject them when issued
  }
  TPSIM_INTERNAL_ASSERT(false, "foldIntoSum: cannot reduce ", dtypeName(dtype));
}

void finishSum(DType dtype, ReduceOp op, int n, std::int64_t count, void* sum) {
  if (op != ReduceOp::kMean || count == 0) return;
  switch (dtype) {
    case DType::kFloat32: return meanNative(n, count, static_cast<float*>(sum));
    case DType::kFloat64: return meanNative(n, count, static_cast<double*>(sum));
    case DType::kInt64: return meanNative(n, count, static_cast<std::int64_t*>(sum));
    case DType::kBFloat16: return mean16<bf16ToFloat, floatToBf16>(n, count, static_cast<std::uint16_t*>(sum));
    case DType::kFloat16: return mean16<halfToFloat, floatToHalf>(n, count, static_cast<std::uint16_t*>(sum));
    case DType::kFloat8E4M3:
    case DType::kFloat8E8M0:
      break;
  }
  TPSIM_INTERNAL_ASSERT(false, "finishSum: cannot reduce ", dtypeName(dtype));
}

void reduceInRankOrder(DType dtype, ReduceOp op, const std::vector<const void*>& inputs, std::int64_t count,
                       void* out) {
  if (count == 0) return;
  for (std::size_t r = 0; r < inputs.size(); ++r) foldIntoSum(dtype, inputs[r], count, out, r == 0);
  finishSum(dtype, op, int(inputs.size()), count, out);
}

}  // namespace tpsim::sim
