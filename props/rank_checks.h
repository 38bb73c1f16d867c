// What the properties that run rank code share: Problems (rank code cannot RC_ASSERT, so it records
// what it found wrong and the property fails afterwards, on the test's thread), bitwise comparison
// of results widened to double, the pad-row checks of GTP_remat shards, and the draws of
// pad_for_alignment and of zero-free data. Not generators of whole cases (generators.h) and not the
// harness (harness.h).
#pragma once

#include <rapidcheck.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "props/generators.h"

namespace tpsim::props {

using Values = std::vector<double>;

// What rank code found wrong, in arrival order; the property fails with the first.
struct Problems {
  std::mutex mu;
  std::vector<std::string> list;
  void add(const std::string& what) {
    std::lock_guard<std::mutex> lock(mu);
    list.push_back(what);
  }
  void check(bool ok, const std::string& what) {
    if (!ok) add(what);
  }
  void assertNone() {
    for (std::size_t i = 0; i < list.size() && i < 20; ++i) RC_LOG() << list[i] << "\n";
    if (!list.empty()) RC_FAIL(list.front() + (list.size() > 1 ? " (and " + std::to_string(list.size() - 1) +
                                                                   " more, logged above)"
                                                             : std::string()));
  }
};

// "[v0 v1 ... v23 ...]" with 9 significant digits.
inline std::string str(const Values& v, std::size_t max = 24) {
  std::ostringstream os;
  os.precision(9);
  os << "[";
  for (std::size_t i = 0; i < v.size() && i < max; ++i) os << (i ? " " : "") << v[i];
  return os.str() + (v.size() > max ? " ...]" : "]");
}

// Equal element for element, with the same sign of zero: the same bits for values of one dtype.
inline bool sameBits(const Values& a, const Values& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!(a[i] == b[i]) || std::signbit(a[i]) != std::signbit(b[i])) return false;
  return true;
}

// "" when a and b have the same bits, else where they first differ: "what: element 3 is 1.5, expected
// 1.25 (of 12)".
inline std::string firstDifference(const Values& got, const Values& want, const std::string& what) {
  std::ostringstream os;
  os.precision(9);
  if (got.size() != want.size()) {
    os << what << ": " << got.size() << " elements, expected " << want.size();
    return os.str();
  }
  for (std::size_t i = 0; i < got.size(); ++i)
    if (!(got[i] == want[i]) || std::signbit(got[i]) != std::signbit(want[i])) {
      os << what << ": element " << i << " of " << got.size() << " is " << got[i] << ", expected " << want[i]
         << "; got " << str(got) << ", expected " << str(want);
      return os.str();
    }
  return "";
}

// pad_for_alignment for a shard of these TP-local dim-0 sizes: 16 (the default) first, 0 only when
// every one divides by G (SPEC 4.2: a = 0 asserts divisibility).
inline rc::Gen<int> genPadForAlignment(const std::vector<std::int64_t>& dims, int G) {
  bool divisible = true;
  for (std::int64_t d : dims) divisible = divisible && d % G == 0;
  return divisible ? pick<int>({16, 0, 1, 0, 32}) : pick<int>({16, 1, 32});
}

// The first local row of GTP rank g's shard (S rows) that is padding: rows [g·S, (g+1)·S) of a
// padded buffer whose real rows are [0, dLog).
inline std::int64_t firstPadRow(std::int64_t dLog, std::int64_t rows, int g) {
  return std::clamp<std::int64_t>(dLog - std::int64_t(g) * rows, 0, rows);
}

// "" when every element of `v` (a (rows, ·) shard, row-major) from row `from` on is exactly zero.
inline std::string padRowsNonZero(const Values& v, std::int64_t rows, std::int64_t from, const std::string& what) {
  if (rows == 0) return "";
  const std::int64_t perRow = std::int64_t(v.size()) / rows;
  for (std::int64_t i = from * perRow; i < std::int64_t(v.size()); ++i)
    if (v[std::size_t(i)] != 0.0) {
      std::ostringstream os;
      os.precision(9);
      os << what << ": pad element " << i << " (local row " << i / perRow << ", pad rows from " << from << " of "
         << rows << ") is " << v[std::size_t(i)] << ", not 0";
      return os.str();
    }
  return "";
}

// Normal values, none exactly zero (so that a zero is always padding), from a seeded engine.
inline Values nonZeroNormals(std::uint64_t seed, std::int64_t count) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  Values v(static_cast<std::size_t>(count));
  for (double& x : v) {
    x = normal(rng);
    if (std::fabs(x) < 1e-3) x = 1.0;  // also keeps 16-bit values normal
  }
  return v;
}

// (dim0, trailing...) as a Shape, and the product of a list of extents.
inline Shape shapeOf(std::int64_t dim0, const std::vector<std::int64_t>& trailing) {
  std::vector<std::int64_t> dims{dim0};
  dims.insert(dims.end(), trailing.begin(), trailing.end());
  return Shape(dims.data(), int(dims.size()));
}

inline std::int64_t product(const std::vector<std::int64_t>& v) {
  std::int64_t p = 1;
  for (std::int64_t x : v) p *= x;
  return p;
}

}  // namespace tpsim::props
