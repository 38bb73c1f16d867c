// Helpers for tests that run rank code on a sim::World: host <-> tensor copies and rank-built data.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "backends/compute.h"
#include "backends/rank_context.h"
#include "sim/world.h"

namespace tpsim::testing {

inline void runRanks(int n, const std::function<void(RankContext&)>& fn, int threads = 0) {
  sim::WorldOptions o;
  o.size = n;
  o.threads = threads;
  sim::World(o).run(fn);
}

// A tensor of `dtype` holding `values` (rounded once if 16-bit).
inline Tensor tensorOf(Compute& compute, DType dtype, const std::vector<double>& values, Shape shape = {}) {
  if (shape.rank() == 0) shape = Shape{std::int64_t(values.size())};
  Tensor t = compute.empty(shape, dtype);
  std::vector<char> host(values.size() * dtypeSize(dtype));
  for (std::size_t i = 0; i < values.size(); ++i) {
    char* p = host.data() + i * dtypeSize(dtype);
    switch (dtype) {
      case DType::kFloat32: { float v = float(values[i]); std::memcpy(p, &v, 4); break; }
      case DType::kFloat64: std::memcpy(p, &values[i], 8); break;
      case DType::kInt64: { std::int64_t v = std::int64_t(values[i]); std::memcpy(p, &v, 8); break; }
      case DType::kBFloat16: { std::uint16_t v = floatToBf16(float(values[i])); std::memcpy(p, &v, 2); break; }
      case DType::kFloat16: { std::uint16_t v = floatToHalf(float(values[i])); std::memcpy(p, &v, 2); break; }
    }
  }
  compute.upload(host.data(), t);
  return t;
}

// The values of any view, widened to double.
inline std::vector<double> valuesOf(Compute& compute, ConstView v) {
  std::vector<char> host(v.bytes());
  compute.download(v, host.data());
  std::vector<double> out(std::size_t(v.numel()));
  for (std::size_t i = 0; i < out.size(); ++i) {
    const char* p = host.data() + i * dtypeSize(v.dtype());
    switch (v.dtype()) {
      case DType::kFloat32: { float x; std::memcpy(&x, p, 4); out[i] = x; break; }
      case DType::kFloat64: std::memcpy(&out[i], p, 8); break;
      case DType::kInt64: { std::int64_t x; std::memcpy(&x, p, 8); out[i] = double(x); break; }
      case DType::kBFloat16: { std::uint16_t x; std::memcpy(&x, p, 2); out[i] = bf16ToFloat(x); break; }
      case DType::kFloat16: { std::uint16_t x; std::memcpy(&x, p, 2); out[i] = halfToFloat(x); break; }
    }
  }
  return out;
}

}  // namespace tpsim::testing
