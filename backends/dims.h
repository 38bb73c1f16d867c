// Shapes and the letters every tpsim shape comment uses.
//
//   M tokens (s·b), K in-features, N out-features, V vocab, h hidden, s sequence, b micro-batch,
//   p (or T) TP size, r rank within a group, n group size, G GTP_remat size.
//
// Shape holds up to four modes of int64_t and prints as "(8, 1024)". Strides count elements, not
// bytes. Neither type knows about memory; see view.h.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <ostream>
#include <string>
#include <vector>

namespace tpsim {

// The one way tpsim writes a shape, as Python writes a tuple: "(8, 1024)", "(16,)", "()".
std::string shapeText(const std::int64_t* dims, std::size_t rank);
inline std::string shapeText(const std::vector<std::int64_t>& dims) { return shapeText(dims.data(), dims.size()); }

class Shape {
 public:
  static constexpr int kMaxRank = 4;

  Shape() = default;
  Shape(std::initializer_list<std::int64_t> dims);
  Shape(const std::int64_t* dims, int rank);

  int rank() const { return rank_; }
  std::int64_t operator[](int i) const { return dims_[i]; }
  std::int64_t& operator[](int i) { return dims_[i]; }
  std::int64_t numel() const;
  bool operator==(const Shape& o) const;
  bool operator!=(const Shape& o) const { return !(*this == o); }
  std::string str() const;  // "(8, 1024)"

  // Row-major (C order) strides of a contiguous tensor of this shape.
  Shape contiguousStrides() const;

 private:
  int rank_ = 0;
  std::array<std::int64_t, kMaxRank> dims_{};
};

using Strides = Shape;

inline std::ostream& operator<<(std::ostream& os, const Shape& s) { return os << s.str(); }

}  // namespace tpsim
