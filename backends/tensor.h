// Tensor: owning, move-only memory of one backend, with a View into it.
//
// Made by Compute::empty (compute.h); the backend supplies the deleter (free for host memory,
// cudaFree on the GPU). A Tensor is always contiguous. It is not a lazy expression, not
// reference-counted and never copied implicitly: copy values with Compute::copy.
#pragma once

#include <memory>

#include "backends/view.h"

namespace tpsim {

class Tensor {
 public:
  using Deleter = void (*)(void*);

  Tensor() = default;
  Tensor(void* data, Shape shape, DType dtype, Device device, Deleter deleter)
      : storage_(data, deleter), view_(data, shape, dtype, device) {}
  Tensor(Tensor&&) noexcept = default;
  Tensor& operator=(Tensor&&) noexcept = default;
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;

  bool defined() const { return storage_ != nullptr; }
  View view() { return view_; }
  ConstView view() const { return view_; }
  operator View() { return view_; }             // NOLINT: a tensor is usable wherever a view is
  operator ConstView() const { return view_; }  // NOLINT
  const Shape& shape() const { return view_.shape(); }
  DType dtype() const { return view_.dtype(); }
  Device device() const { return view_.device(); }
  std::int64_t numel() const { return view_.numel(); }
  void* data() { return view_.data(); }
  const void* data() const { return view_.data(); }
  std::string str() const { return view_.str(); }

 private:
  std::unique_ptr<void, Deleter> storage_{nullptr, [](void*) {}};
  View view_;
};

// A tensor its holders only read, which several ranks may hold at once (Collectives::allGatherShared).
using SharedTensor = std::shared_ptr<const Tensor>;

}  // namespace tpsim
