#include "backends/dims.h"

#include "backends/errors.h"

namespace tpsim {

Shape::Shape(std::initializer_list<std::int64_t> dims) {
  TPSIM_CHECK(dims.size() <= std::size_t(kMaxRank), "Shape: at most ", kMaxRank,
              " modes are supported, got ", dims.size());
  for (std::int64_t d : dims) {
    TPSIM_CHECK(d >= 0, "Shape: every mode must be >= 0, got ", d);
    dims_[rank_++] = d;
  }
}

Shape::Shape(const std::int64_t* dims, int rank) {
  TPSIM_CHECK(rank >= 0 && rank <= kMaxRank, "Shape: rank must be in [0, ", kMaxRank, "], got ", rank);
  for (int i = 0; i < rank; ++i) {
    TPSIM_CHECK(dims[i] >= 0, "Shape: every mode must be >= 0, got ", dims[i]);
    dims_[rank_++] = dims[i];
  }
}

std::int64_t Shape::numel() const {
  std::int64_t n = 1;
  for (int i = 0; i < rank_; ++i) n *= dims_[i];
  return n;
}

bool Shape::operator==(const Shape& o) const {
  if (rank_ != o.rank_) return false;
  for (int i = 0; i < rank_; ++i)
    if (dims_[i] != o.dims_[i]) return false;
  return true;
}

std::string shapeText(const std::int64_t* dims, std::size_t rank) {
  std::string s = "(";
  for (std::size_t i = 0; i < rank; ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + (rank == 1 ? ",)" : ")");
}

std::string Shape::str() const { return shapeText(dims_.data(), std::size_t(rank_)); }

Shape Shape::contiguousStrides() const {
  Shape s = *this;
  std::int64_t stride = 1;
  for (int i = rank_ - 1; i >= 0; --i) {
    s.dims_[i] = stride;
    stride *= dims_[i];
  }
  return s;
}

}  // namespace tpsim
