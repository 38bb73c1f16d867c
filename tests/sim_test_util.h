// Helpers for tests that run rank code on a sim::World: host <-> tensor copies and rank-built data.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "backends/compute.h"
#include "backends/rank_context.h"
#include "sim/world.h"

namespace tpsim::testing {

inline void runRanks(int n, const std::function<void(RankContext&)>& fn, int threads = 0) {
  WorldOptions o;
  o.size = n;
  o.threads = threads;
  sim::World(o).run(fn);
}

// A tensor of `dtype` holding `values` (rounded once if 16-bit).
inline Tensor tensorOf(Compute& compute, DType dtype, const std::vector<double>& values, Shape shape = {}) {
  if (shape.rank() == 0) shape = Shape{std::int64_t(values.size())};
  Tensor t = compute.empty(shape, dtype);
  std::vector<char> host(values.size() * dtypeSize(dtype));
  for (std::size_t i = 0; i < values.size(); ++i) storeFromDouble(dtype, values[i], host.data() + i * dtypeSize(dtype));
  compute.upload(host.data(), t);
  return t;
}

// The values of any view, widened to double.
inline std::vector<double> valuesOf(Compute& compute, ConstView v) {
  Tensor dense;
  if (!v.isContiguous()) {
    dense = compute.empty(v.shape(), v.dtype());
    compute.copy(v, dense);
    v = dense;
  }
  std::vector<char> host(v.bytes());
  compute.download(v, host.data());
  std::vector<double> out(std::size_t(v.numel()));
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = loadAsDouble(v.dtype(), host.data() + i * dtypeSize(v.dtype()));
  return out;
}

// Row-major host matrices for dense references: table(r, c, f) fills (r, c) with f(i, j);
// rows/columns cut a block out of a (·, cols) table.
inline std::vector<double> table(std::int64_t rows, std::int64_t cols,
                                 const std::function<double(std::int64_t, std::int64_t)>& f) {
  std::vector<double> v(static_cast<std::size_t>(rows * cols));
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) v[r * cols + c] = f(r, c);
  return v;
}
inline std::vector<double> rows(const std::vector<double>& m, std::int64_t cols, std::int64_t r0, std::int64_t r1) {
  return std::vector<double>(m.begin() + r0 * cols, m.begin() + r1 * cols);
}
inline std::vector<double> columns(const std::vector<double>& m, std::int64_t cols, std::int64_t c0,
                                   std::int64_t c1) {
  std::vector<double> out;
  for (std::size_t r = 0; r < m.size() / cols; ++r)
    for (std::int64_t c = c0; c < c1; ++c) out.push_back(m[r * cols + c]);
  return out;
}

// n samples of a smooth, sign-changing test signal; phase picks which.
inline std::vector<double> wave(std::int64_t n, double phase) {
  std::vector<double> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) v[i] = std::sin(phase + 0.37 * double(i));
  return v;
}

// max|a − b| / max|b|.
inline double maxRelError(const std::vector<double>& a, const std::vector<double>& b) {
  double err = 0, scale = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    err = std::max(err, std::fabs(a[i] - b[i]));
    scale = std::max(scale, std::fabs(b[i]));
  }
  return err / scale;
}

// The message of the InvalidArgument `f` throws, or "no error".
inline std::string errorOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace tpsim::testing
