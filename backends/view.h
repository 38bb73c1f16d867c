// Non-owning, strided views of backend memory: View (writable) and ConstView (read-only).
//
// A view is {data, shape, strides, dtype, device}, passed by value like Eigen's Map or gloo's
// UnboundBuffer. Transposes and shards are views, not copies: w.t() swaps the two modes of a
// matrix, x.slice(0, r*m, (r+1)*m) is rank r's block of rows. Views never allocate and never free;
// Tensor (tensor.h) owns memory. Strides count elements.
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>

#include "backends/dims.h"
#include "backends/dtype.h"
#include "backends/errors.h"

namespace tpsim {

enum class Device : std::uint8_t { kHost, kCuda };
const char* deviceName(Device device);

template <typename T> constexpr DType dtypeOf();
template <> constexpr DType dtypeOf<float>() { return DType::kFloat32; }
template <> constexpr DType dtypeOf<double>() { return DType::kFloat64; }
template <> constexpr DType dtypeOf<std::int64_t>() { return DType::kInt64; }

template <typename Ptr>
class BasicView {
 public:
  BasicView() = default;
  BasicView(Ptr data, Shape shape, DType dtype, Device device = Device::kHost)
      : data_(data), shape_(shape), strides_(shape.contiguousStrides()), dtype_(dtype), device_(device) {}
  BasicView(Ptr data, Shape shape, Strides strides, DType dtype, Device device = Device::kHost)
      : data_(data), shape_(shape), strides_(strides), dtype_(dtype), device_(device) {}
  // View -> ConstView.
  template <typename Other, typename = std::enable_if_t<std::is_convertible_v<Other, Ptr>>>
  BasicView(const BasicView<Other>& o)  // NOLINT: implicit by design
      : data_(o.data()), shape_(o.shape()), strides_(o.strides()), dtype_(o.dtype()), device_(o.device()) {}

  Ptr data() const { return data_; }
  const Shape& shape() const { return shape_; }
  const Strides& strides() const { return strides_; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  int rank() const { return shape_.rank(); }
  std::int64_t dim(int i) const { return shape_[i < 0 ? i + rank() : i]; }
  std::int64_t stride(int i) const { return strides_[i < 0 ? i + rank() : i]; }
  std::int64_t numel() const { return shape_.numel(); }
  std::size_t bytes() const { return std::size_t(numel()) * dtypeSize(dtype_); }

  // Row-major dense: elements are laid out exactly as a C array of this shape.
  bool isContiguous() const {
    std::int64_t expect = 1;
    for (int i = rank() - 1; i >= 0; --i) {
      if (shape_[i] != 1 && strides_[i] != expect) return false;
      expect *= shape_[i];
    }
    return true;
  }

  // Element pointer with a dtype check: T must match dtype() (uint16_t for bf16/fp16).
  template <typename T>
  auto typed() const {
    using Out = std::conditional_t<std::is_const_v<std::remove_pointer_t<Ptr>>, const T*, T*>;
    if constexpr (std::is_same_v<T, std::uint16_t>)
      TPSIM_CHECK(is16Bit(dtype_), "View::typed<uint16_t>: view dtype must be bf16 or fp16, got ",
                  dtypeName(dtype_));
    else
      TPSIM_CHECK(dtypeOf<T>() == dtype_, "View::typed: view dtype is ", dtypeName(dtype_),
                  ", requested ", dtypeName(dtypeOf<T>()));
    return static_cast<Out>(data_);
  }

  // Pointer to element `offset` (in elements) from data().
  Ptr at(std::int64_t offset) const {
    using Byte = std::conditional_t<std::is_const_v<std::remove_pointer_t<Ptr>>, const char, char>;
    return static_cast<Ptr>(static_cast<Byte*>(data_) + offset * std::int64_t(dtypeSize(dtype_)));
  }

  BasicView transpose(int a, int b) const {
    TPSIM_CHECK(a >= 0 && a < rank() && b >= 0 && b < rank(), "View::transpose: modes (", a, ", ", b,
                ") must be in [0, ", rank(), ") for shape ", shape_.str());
    BasicView v = *this;
    std::swap(v.shape_[a], v.shape_[b]);
    std::swap(v.strides_[a], v.strides_[b]);
    return v;
  }
  // Matrix transpose: (R, C) -> (C, R) without copying.
  BasicView t() const {
    TPSIM_CHECK(rank() == 2, "View::t: expected a matrix (rank 2), got shape ", shape_.str());
    return transpose(0, 1);
  }

  // Elements [begin, end) along `dim`.
  BasicView slice(int dim, std::int64_t begin, std::int64_t end) const {
    if (dim < 0) dim += rank();
    TPSIM_CHECK(dim >= 0 && dim < rank(), "View::slice: dim must be in [0, ", rank(), "), got ", dim);
    TPSIM_CHECK(0 <= begin && begin <= end && end <= shape_[dim], "View::slice: range [", begin, ", ",
                end, ") must lie within [0, ", shape_[dim], "] of dim ", dim, " of ", shape_.str());
    BasicView v = *this;
    v.data_ = at(begin * strides_[dim]);
    v.shape_[dim] = end - begin;
    return v;
  }

  // Same elements, new shape; the view must be contiguous.
  BasicView reshape(Shape shape) const {
    TPSIM_CHECK(isContiguous(), "View::reshape: view ", str(), " must be contiguous");
    TPSIM_CHECK(shape.numel() == numel(), "View::reshape: new shape ", shape.str(), " must have ",
                numel(), " elements like ", shape_.str(), ", got ", shape.numel());
    return BasicView(data_, shape, dtype_, device_);
  }

  // Collapses all leading modes into one: (s, b, h) -> (s·b, h). Needs the leading modes dense.
  BasicView flattenTo2d() const {
    TPSIM_CHECK(rank() >= 1, "View::flattenTo2d: expected rank >= 1, got a scalar");
    if (rank() == 2) return *this;
    // Walk the leading modes inner to outer. A mode of extent 1 is never stepped, so its stride
    // says nothing: skip it. The row stride is that of the innermost mode of extent > 1.
    std::int64_t rows = 1, rowStride = shape_[rank() - 1], expect = 0;
    bool seen = false;
    for (int i = rank() - 2; i >= 0; --i) {
      if (shape_[i] == 1) continue;
      TPSIM_CHECK(!seen || strides_[i] == expect, "View::flattenTo2d: leading modes of ", str(),
                  " are not dense");
      if (!seen) rowStride = strides_[i];
      seen = true;
      expect = strides_[i] * shape_[i];
      rows *= shape_[i];
    }
    BasicView v = *this;
    v.shape_ = Shape{rows, shape_[rank() - 1]};
    v.strides_ = Strides{rowStride, strides_[rank() - 1]};
    return v;
  }

  // "bf16 (8, 1024)" plus strides when not contiguous; for error messages.
  std::string str() const {
    std::string s = std::string(dtypeName(dtype_)) + " " + shape_.str();
    if (!isContiguous()) s += " strides " + strides_.str();
    return s;
  }

 private:
  Ptr data_ = nullptr;
  Shape shape_;
  Strides strides_;
  DType dtype_ = DType::kFloat32;
  Device device_ = Device::kHost;
};

using View = BasicView<void*>;
using ConstView = BasicView<const void*>;

}  // namespace tpsim
