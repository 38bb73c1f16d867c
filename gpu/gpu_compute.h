// GpuCompute: the gpu backend's Compute for one rank on one CUDA device.
//
// Elementwise ops run as kernels over the shared element math (kernels.cuh), bitwise equal to
// SimCompute but GeLU (device erf/exp, a few ulp); gemm runs on cuBLASLt and is checked against
// an error bound. It is not a collective transport and knows nothing of other ranks: gpu::World
// orders collectives against stream() with events.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "backends/compute.h"

namespace tpsim::gpu {

class Matmul;
namespace detail {
struct StreamOwner;  // the device and stream a tensor is freed on (gpu_compute.cu)
}

// What GpuCompute adds to compute.h and to SimCompute's rules (sim/sim_compute.h), which it
// follows with the same checks and messages (backends/compute_checks.h):
//  - Views are CUDA memory (Device::kCuda). Every op is enqueued on the rank's own non-blocking
//    stream and returns without waiting, except upload, download and the ops that must read
//    device data on the host first (scatterAddRows reads ids; copy or fill into int64 or e8m0
//    checks the values before writing any). Those waits poll against TPSIM_GPU_TIMEOUT_MS
//    (default 60000) and throw BackendError naming the op instead of hanging.
//  - TPSIM_GPU_SYNC=1 waits for and checks every op before it returns (for debugging).
//  - empty() is stream-ordered (cudaMallocAsync on stream()) and throws std::bad_alloc when the
//    device is out of memory, as SimCompute does on the host; the Tensor frees it on the same
//    stream, so work on other streams that uses it must be ordered before the free. A tensor may
//    outlive its GpuCompute; it is then freed on the legacy default stream, or leaked when that
//    GpuCompute's stream did not drain within the deadline.
//  - NaN results of arithmetic may carry other payloads than on the CPU; NaN stays NaN.
//  - gemm runs on cuBLASLt: fp32 (no TF32), bf16 and fp16 with fp32 accumulation, fp64 in fp64;
//    a 16-bit c is rounded once (with beta != 0, through an fp32 copy of c). Operands without a unit-stride mode go through a contiguous copy.
class GpuCompute final : public Compute {
 public:
  // Selects `device` (a CUDA device index) and creates the stream and the cuBLASLt workspace there,
  // with a handle from the device's pool. Throws BackendError when the device cannot be used.
  explicit GpuCompute(int device);
  ~GpuCompute() override;
  GpuCompute(const GpuCompute&) = delete;
  GpuCompute& operator=(const GpuCompute&) = delete;

  Device device() const override { return Device::kCuda; }
  int deviceIndex() const { return device_; }
  // Where this rank's work runs, for ordering collectives with events.
  cudaStream_t stream() const { return stream_; }
  // Waits until everything enqueued so far has finished (with the deadline); throws BackendError
  // on a timeout or an asynchronous error, naming `op`.
  void synchronize(const char* op = "synchronize");

  Tensor empty(Shape shape, DType dtype) override;

  void upload(const void* host, View dst) override;
  void download(ConstView src, void* host) override;

  void fill(View y, double value) override;
  void copy(ConstView x, View y) override;
  void axpy(float alpha, ConstView x, View y) override;
  void scale(View y, float alpha) override;

  void gemm(ConstView a, ConstView b, View c, float alpha = 1.f, float beta = 0.f) override;

  void addBias(ConstView bias, View y) override;
  void sumRows(ConstView y, View out, float beta = 0.f) override;

  void gelu(ConstView x, View y) override;
  void geluBackward(ConstView x, ConstView dy, View dx) override;

  void quantizeMxfp8(ConstView x, View data, View scales, int axis) override;
  void dequantizeMxfp8(ConstView data, ConstView scales, int axis, View y) override;

  void gatherRows(ConstView table, ConstView ids, std::int64_t first, View out) override;
  void scatterAddRows(ConstView grad, ConstView ids, std::int64_t first, View table) override;

 private:
  void enter();                 // makes device_ current on the calling thread
  void finish(const char* op);  // with TPSIM_GPU_SYNC=1: synchronize(op)
  // Runs fn's work items in one kernel on stream(); the grid is chosen here and nowhere else.
  template <typename Fn>
  void launch(const char* op, const Fn& fn);
  auto onDevice();  // launch() as the launcher that kern::run* take
  // Throws InvalidArgument naming the first element of x that `to` (int64, e8m0) cannot hold,
  // before anything is written: SimCompute's store would throw for it.
  void checkStorable(const char* op, ConstView x, DType to);
  // A contiguous copy of v, same dtype.
  Tensor contiguous(ConstView v);

  int device_ = 0;
  int maxBlocks_ = 0;  // grid size cap: a few blocks per SM keep every SM busy
  long long timeoutMs_ = 60000;
  bool sync_ = false;
  cudaStream_t stream_ = nullptr;
  std::shared_ptr<detail::StreamOwner> owner_;
  std::unique_ptr<Matmul> matmul_;
};

}  // namespace tpsim::gpu
