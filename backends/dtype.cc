#include "backends/dtype.h"

#include <cmath>
#include <cstring>

#include "backends/errors.h"

namespace tpsim {

std::size_t dtypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 4;
    case DType::kBFloat16: return 2;
    case DType::kFloat16: return 2;
    case DType::kFloat64: return 8;
    case DType::kInt64: return 8;
    case DType::kFloat8E4M3: return 1;
    case DType::kFloat8E8M0: return 1;
  }
  TPSIM_INTERNAL_ASSERT(false, "unknown dtype ", int(dtype));
}

const char* dtypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "fp32";
    case DType::kBFloat16: return "bf16";
    case DType::kFloat16: return "fp16";
    case DType::kFloat64: return "fp64";
    case DType::kInt64: return "int64";
    case DType::kFloat8E4M3: return "fp8e4m3";
    case DType::kFloat8E8M0: return "e8m0";
  }
  return "unknown";
}

DType parseDType(const std::string& name) {
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat64, DType::kInt64,
                  DType::kFloat8E4M3, DType::kFloat8E8M0})
    if (name == dtypeName(d)) return d;
  TPSIM_CHECK(false, "dtype must be one of fp32, bf16, fp16, fp64, int64, fp8e4m3, e8m0, got '", name, "'");
}

double loadAsDouble(DType dtype, const void* p) {
  switch (dtype) {
    case DType::kFloat32: { float f; std::memcpy(&f, p, 4); return f; }
    case DType::kFloat64: { double d; std::memcpy(&d, p, 8); return d; }
    case DType::kInt64: { std::int64_t x; std::memcpy(&x, p, 8); return double(x); }
    case DType::kBFloat16: { std::uint16_t x; std::memcpy(&x, p, 2); return bf16ToFloat(x); }
    case DType::kFloat16: { std::uint16_t x; std::memcpy(&x, p, 2); return halfToFloat(x); }
    case DType::kFloat8E4M3: return e4m3ToFloat(*static_cast<const std::uint8_t*>(p));
    case DType::kFloat8E8M0: return e8m0ToFloat(*static_cast<const std::uint8_t*>(p));
  }
  TPSIM_INTERNAL_ASSERT(false, "unknown dtype ", int(dtype));
}

void storeFromDouble(DType dtype, double v, void* p) {
  switch (dtype) {
    case DType::kFloat32: { const float f = float(v); std::memcpy(p, &f, 4); return; }
    case DType::kFloat64: std::memcpy(p, &v, 8); return;
    case DType::kInt64: { const std::int64_t x = std::int64_t(v); std::memcpy(p, &x, 8); return; }
    case DType::kBFloat16: { const std::uint16_t x = floatToBf16(float(v)); std::memcpy(p, &x, 2); return; }
    case DType::kFloat16: { const std::uint16_t x = floatToHalf(float(v)); std::memcpy(p, &x, 2); return; }
    case DType::kFloat8E4M3: *static_cast<std::uint8_t*>(p) = toE4m3(v); return;
    case DType::kFloat8E8M0: *static_cast<std::uint8_t*>(p) = toE8m0(v); return;
  }
  TPSIM_INTERNAL_ASSERT(false, "unknown dtype ", int(dtype));
}

std::uint8_t toE8m0(double v) {
  if (std::isnan(v)) return 0xff;
  int e = 0;
  const double f = std::isfinite(v) && v > 0 ? std::frexp(v, &e) : 0.0;
  TPSIM_CHECK(f == 0.5 && e - 1 >= -127 && e - 1 <= 127, "e8m0: a value must be an exact power of two 2^e with e "
              "in [-127, 127], got ", v);
  return std::uint8_t(e - 1 + 127);
}

}  // namespace tpsim
