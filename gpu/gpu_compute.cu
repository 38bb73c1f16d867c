#include "gpu/gpu_compute.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "backends/compute_checks.h"
#include "backends/errors.h"
#include "gpu/check.h"
#include "gpu/device.h"
#include "gpu/kernels.cuh"
#include "gpu/matmul.h"

namespace tpsim::gpu {

namespace detail {
// Where a rank's tensors are freed: `stream` becomes null when its GpuCompute is destroyed, and the
// tensors still alive are then freed on the legacy default stream, which never blocks the host (a
// cudaFree would wait for the whole device, forever if a kernel is stuck). That stream does not
// wait for the rank's own, so when that one did not drain (`stuck`) they are leaked instead: a
// kernel still running there may use them.
struct StreamOwner {
  int device;
  cudaStream_t stream;
  bool stuck;
};
}  // namespace detail

namespace {

// ---- Memory -------------------------------------------------------------------------------------

// Tensor's deleter is a plain function pointer, so the stream to free on is looked up by address.
class Allocations {
 public:
  static Allocations& instance() {
    static Allocations* registry = new Allocations;  // never destroyed: tensors may outlive static destruction
    return *registry;
  }

  void add(void* p, std::shared_ptr<detail::StreamOwner> owner) {
    std::lock_guard<std::mutex> lock(mu_);
    owners_.emplace(p, std::move(owner));
  }

  // The lock is held across the free so that the owner's stream cannot be destroyed meanwhile.
  void release(void* p) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = owners_.find(p);
    if (it == owners_.end()) return;
    const detail::StreamOwner owner = *it->second;
    owners_.erase(it);
    if (owner.stuck) return;
    int previous = 0;
    const bool restore = cudaGetDevice(&previous) == cudaSuccess;
    cudaError_t e = cudaSetDevice(owner.device);
    if (e == cudaSuccess) e = cudaFreeAsync(p, owner.stream ? owner.stream : cudaStreamLegacy);
    if (restore) cudaSetDevice(previous);
    // A deleter cannot throw. A failed free leaves nothing to undo, and a broken context fails the
    // next checked call anyway; clear the error so that it is not blamed on an unrelated launch.
    if (e != cudaSuccess) cudaGetLastError();
  }

  // Before the owner's stream is destroyed; `drained` says whether its work has finished.
  void orphan(detail::StreamOwner& owner, bool drained) {
    std::lock_guard<std::mutex> lock(mu_);
    owner.stream = nullptr;
    owner.stuck = !drained;
  }

 private:
  std::mutex mu_;
  std::unordered_map<void*, std::shared_ptr<detail::StreamOwner>> owners_;
};

void freeDevice(void* p) { Allocations::instance().release(p); }

// The GpuComputes alive on each device. When a device's last one goes, its default pool is trimmed
// (cudaMemPoolTrimTo does not wait): while ranks run, the pool keeps freed blocks for reuse (see the
// release threshold), but NCCL and cuBLASLt allocate outside it and would fail after a peak while
// it still holds them.
class DeviceUsers {
 public:
  static DeviceUsers& instance() {
    static DeviceUsers* users = new DeviceUsers;  // never destroyed, as Allocations
    return *users;
  }

  void add(int device) {
    std::lock_guard<std::mutex> lock(mu_);
    ++count_[device];
  }

  void remove(int device) {
    std::lock_guard<std::mutex> lock(mu_);
    if (--count_[device] > 0) return;
    cudaMemPool_t pool = nullptr;
    if (cudaDeviceGetDefaultMemPool(&pool, device) == cudaSuccess) cudaMemPoolTrimTo(pool, 0);
  }

 private:
  std::mutex mu_;
  std::unordered_map<int, int> count_;
};

// ---- Environment --------------------------------------------------------------------------------

bool syncFromEnv() {
  const char* s = std::getenv("TPSIM_GPU_SYNC");
  if (s == nullptr || *s == '\0' || std::strcmp(s, "0") == 0) return false;
  TPSIM_CHECK(std::strcmp(s, "1") == 0, "GpuCompute: TPSIM_GPU_SYNC must be 0 or 1, got '", s, "'");
  return true;
}

// ---- Checks (of arguments: compute_checks.h, shared with SimCompute) ----------------------------

// A value that copy or fill cannot store into an int64 or e8m0 output.
std::string unstorableMessage(const char* op, DType to, double v) {
  if (to == DType::kInt64)
    return tpsim::detail::concat(op, ": an int64 output must receive values in [-2^63, 2^63), got ", v);
  return tpsim::detail::concat(op, ": an e8m0 output must receive exact powers of two 2^e with e in [-127, 127], got ",
                               v);
}

}  // namespace

// ---- Lifetime, streams and launches -------------------------------------------------------------

GpuCompute::GpuCompute(int device) : device_(device), timeoutMs_(deviceTimeoutMs()), sync_(syncFromEnv()) {
  TPSIM_CHECK(device >= 0, "GpuCompute: device must be a CUDA device index >= 0, got ", device);
  enter();
  int sms = 0;
  TPSIM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_));
  maxBlocks_ = std::max(sms, 1) * 8;  // 8 blocks of 256 threads fill an SM's 2048 threads
  // Keep freed blocks in the device's pool: with the default threshold (0) every synchronization
  // hands them back to the driver and the next cudaMallocAsync maps them again. The pool is
  // trimmed when the device's last GpuCompute goes (DeviceUsers).
  cudaMemPool_t pool = nullptr;
  TPSIM_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device_));
  std::uint64_t threshold = std::numeric_limits<std::uint64_t>::max();
  TPSIM_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
  TPSIM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  owner_ = std::make_shared<detail::StreamOwner>(detail::StreamOwner{device_, stream_, false});
  try {
    matmul_ = std::make_unique<Matmul>(device_, stream_);
  } catch (...) {
    cudaStreamDestroy(stream_);
    throw;
  }
  DeviceUsers::instance().add(device_);
}

// Never throws, never hangs: nothing here waits for the device or for another stream, and the
// stream gets the deadline to drain. The workspace's free is enqueued first, so that the drain
// completes it too and the trim can release it.
GpuCompute::~GpuCompute() {
  const bool current = cudaSetDevice(device_) == cudaSuccess;
  matmul_.reset();
  const bool drained = current && pollStream(stream_, deadlineIn(timeoutMs_)) == cudaSuccess;
  Allocations::instance().orphan(*owner_, drained);
  cudaStreamDestroy(stream_);  // returns at once; a stuck stream's resources go when its work ends
  DeviceUsers::instance().remove(device_);
  cudaGetLastError();
}

void GpuCompute::enter() { TPSIM_CUDA_CHECK(cudaSetDevice(device_)); }

void GpuCompute::synchronize(const char* op) {
  enter();
  const cudaError_t e = pollStream(stream_, deadlineIn(timeoutMs_));
  if (e == cudaErrorNotReady)
    throw BackendError(tpsim::detail::concat(op, ": the stream of cuda:", device_, " did not finish within ",
                                             timeoutMs_, " ms (TPSIM_GPU_TIMEOUT_MS); a kernel or a wait on another",
                                             " stream is stuck"));
  if (e != cudaSuccess) {
    cudaGetLastError();
    throw BackendError(tpsim::detail::concat(op, ": the stream of cuda:", device_, " failed: ", cudaGetErrorName(e),
                                             " (", cudaGetErrorString(e), ")"));
  }
}

void GpuCompute::finish(const char* op) {
  if (sync_) synchronize(op);
}

template <typename Fn>
void GpuCompute::launch(const char* op, const Fn& fn) {
  const std::int64_t n = fn.count();
  if (n <= 0) return;
  constexpr int kThreads = 256;
  const std::int64_t blocks = std::min<std::int64_t>((n + kThreads - 1) / kThreads, maxBlocks_);
  kern::forEachItem<<<static_cast<unsigned>(blocks), kThreads, 0, stream_>>>(fn, n);
  TPSIM_CUDA_CHECK_LAUNCH(op);
}

auto GpuCompute::onDevice() {
  return [this](const char* op, const auto& fn) { launch(op, fn); };
}

Tensor GpuCompute::contiguous(ConstView v) {
  Tensor t = empty(v.shape(), v.dtype());
  copy(v, t);
  return t;
}

void GpuCompute::checkStorable(const char* op, ConstView x, DType to) {
  if ((to != DType::kInt64 && to != DType::kFloat8E8M0) || x.numel() == 0) return;
  Tensor first = empty(Shape{1}, DType::kInt64);  // (1) least bad index; all ones = none
  TPSIM_CUDA_CHECK(cudaMemsetAsync(first.data(), 0xff, sizeof(unsigned long long), stream_));
  kern::runFindUnstorable(onDevice(), op, x, to, static_cast<unsigned long long*>(first.data()));
  unsigned long long bad = 0;
  download(first, &bad);
  if (bad == ~0ull) return;
  const char* at = kern::operandOf(x).at(kern::extentsOf(x.shape()).unravel(std::int64_t(bad)));
  alignas(8) unsigned char value[8] = {};
  download(ConstView(at, Shape{1}, x.dtype(), Device::kCuda), value);
  throw InvalidArgument(unstorableMessage(op, to, loadAsDouble(x.dtype(), value)));
}

// ---- Memory and transfers -----------------------------------------------------------------------

Tensor GpuCompute::empty(Shape shape, DType dtype) {
  enter();
  // Never 0 bytes, so that the Tensor stays defined (as SimCompute's).
  const std::size_t bytes = std::max<std::size_t>(std::size_t(shape.numel()) * dtypeSize(dtype), 1);
  void* p = nullptr;
  const cudaError_t allocated = cudaMallocAsync(&p, bytes, stream_);
  if (allocated == cudaErrorMemoryAllocation) {
    // An allocation failure, as SimCompute's: the caller's size is too large (the CLI exits 2).
    cudaGetLastError();
    throw std::bad_alloc();
  }
  TPSIM_CUDA_CHECK(allocated);
  Allocations::instance().add(p, owner_);
  finish("empty");
  return Tensor(p, shape, dtype, Device::kCuda, &freeDevice);
}

// Host memory is pageable: a copy may block the host until the stream is idle, so the stream is
// drained first (within the deadline), and the copy has finished when these return.
void GpuCompute::upload(const void* host, View dst) {
  compute_checks::checkUpload(Device::kCuda, dst);
  if (dst.bytes() == 0) return;
  synchronize("upload");
  TPSIM_CUDA_CHECK(cudaMemcpyAsync(dst.data(), host, dst.bytes(), cudaMemcpyHostToDevice, stream_));
  synchronize("upload");
}

void GpuCompute::download(ConstView src, void* host) {
  compute_checks::checkDownload(Device::kCuda, src);
  if (src.bytes() == 0) return;
  synchronize("download");
  TPSIM_CUDA_CHECK(cudaMemcpyAsync(host, src.data(), src.bytes(), cudaMemcpyDeviceToHost, stream_));
  synchronize("download");
}

// ---- Elementwise --------------------------------------------------------------------------------

void GpuCompute::fill(View y, double value) {
  compute_checks::checkFill(Device::kCuda, y);
  TPSIM_CHECK(kern::storable(value, y.dtype()), unstorableMessage("fill", y.dtype(), value));
  enter();
  kern::runFill(onDevice(), y, value);
  finish("fill");
}

void GpuCompute::copy(ConstView x, View y) {
  compute_checks::checkCopy(Device::kCuda, x, y);
  enter();
  if (x.dtype() == y.dtype() && x.isContiguous() && y.isContiguous()) {
    const std::size_t bytes = x.bytes();
    const char *from = static_cast<const char*>(x.data()), *to = static_cast<const char*>(y.data());
    if (bytes != 0 && from != to) {
      if (from < to + bytes && to < from + bytes) {  // overlapping: cudaMemcpy's result is undefined
        Tensor staging = empty(x.shape(), x.dtype());  // x's shape
        TPSIM_CUDA_CHECK(cudaMemcpyAsync(staging.data(), from, bytes, cudaMemcpyDeviceToDevice, stream_));
        TPSIM_CUDA_CHECK(cudaMemcpyAsync(y.data(), staging.data(), bytes, cudaMemcpyDeviceToDevice, stream_));
      } else {
        TPSIM_CUDA_CHECK(cudaMemcpyAsync(y.data(), from, bytes, cudaMemcpyDeviceToDevice, stream_));
      }
    }
    finish("copy");
    return;
  }
  if (x.dtype() != y.dtype()) checkStorable("copy", x, y.dtype());
  kern::runCopy(onDevice(), x, y);
  finish("copy");
}

void GpuCompute::axpy(float alpha, ConstView x, View y) {
  compute_checks::checkAxpy(Device::kCuda, x, y);
  enter();
  kern::runAxpy(onDevice(), alpha, x, y);
  finish("axpy");
}

void GpuCompute::scale(View y, float alpha) {
  compute_checks::checkScale(Device::kCuda, y);
  enter();
  kern::runScale(onDevice(), y, alpha);
  finish("scale");
}

// ---- gemm ---------------------------------------------------------------------------------------

void GpuCompute::gemm(ConstView a, ConstView b, View c, float alpha, float beta) {
  compute_checks::checkGemm(Device::kCuda, a, b, c);
  const std::int64_t m = a.dim(0), k = a.dim(1), n = b.dim(1);
  enter();
  if (m == 0 || n == 0) return finish("gemm");
  if (k == 0) {  // c = beta·c, on the device; beta == 0 ignores the old c, NaN included
    if (beta == 0.f)
      fill(c, 0.0);
    else
      scale(c, beta);
    return finish("gemm");
  }
  Tensor aDense, bDense, cDense;  // (M, K) (K, N) (M, N): copies of operands cuBLASLt cannot read in place
  if (!hasLtLayout(a)) {
    aDense = contiguous(a);
    a = aDense;
  }
  if (!hasLtLayout(b)) {
    bDense = contiguous(b);
    b = bDense;
  }
  View out = c;  // (M, N)
  // A 16-bit c with beta != 0 goes through an fp32 copy: cuBLASLt 13.1 on an H200 rounded such a c
  // twice for some shapes (M=64 K=128 N=96, alpha = beta = 1: 0.72 ulp off, where beta = 0 and
  // fp32 outputs held the bound), although split-K may only reduce in fp32.
  const bool widen = beta != 0.f && is16Bit(c.dtype());
  if (!hasLtLayout(c) || widen) {
    cDense = empty(c.shape(), widen ? DType::kFloat32 : c.dtype());
    if (beta != 0.f) copy(c, cDense);
    out = cDense;
  }
  matmul_->run(mapGemm(a, b, out), alpha, beta);
  if (cDense.defined()) copy(cDense, c);
  finish("gemm");
}

// ---- Bias, reductions, activations ----------------------------------------------------------------

void GpuCompute::addBias(ConstView bias, View y) {
  compute_checks::checkAddBias(Device::kCuda, bias, y);
  enter();
  kern::runAddBias(onDevice(), bias, y);
  finish("addBias");
}

void GpuCompute::sumRows(ConstView y, View out, float beta) {
  compute_checks::checkSumRows(Device::kCuda, y, out);
  enter();
  kern::runSumRows(onDevice(), y, out, beta);
  finish("sumRows");
}

void GpuCompute::gelu(ConstView x, View y) {
  compute_checks::checkGelu(Device::kCuda, x, y);
  enter();
  kern::runGelu(onDevice(), x, y);
  finish("gelu");
}

void GpuCompute::geluBackward(ConstView x, ConstView dy, View dx) {
  compute_checks::checkGeluBackward(Device::kCuda, x, dy, dx);
  enter();
  kern::runGeluBackward(onDevice(), x, dy, dx);
  finish("geluBackward");
}

// ---- MXFP8 --------------------------------------------------------------------------------------

void GpuCompute::quantizeMxfp8(ConstView x, View data, View scales, int axis) {
  compute_checks::checkQuantizeMxfp8(Device::kCuda, x, data, scales, axis);
  enter();
  kern::runQuantizeMxfp8(onDevice(), x, data, scales, axis);
  finish("quantizeMxfp8");
}

void GpuCompute::dequantizeMxfp8(ConstView data, ConstView scales, int axis, View y) {
  compute_checks::checkDequantizeMxfp8(Device::kCuda, data, scales, axis, y);
  enter();
  kern::runDequantizeMxfp8(onDevice(), data, scales, axis, y);
  finish("dequantizeMxfp8");
}

// ---- Embedding rows -----------------------------------------------------------------------------

void GpuCompute::gatherRows(ConstView table, ConstView ids, std::int64_t first, View out) {
  compute_checks::checkGatherRows(Device::kCuda, table, ids, out);
  enter();
  Tensor idsDense;  // (n)
  if (!ids.isContiguous()) {
    idsDense = contiguous(ids);
    ids = idsDense;
  }
  kern::runGatherRows(onDevice(), table, static_cast<const std::int64_t*>(ids.data()), first, out);
  finish("gatherRows");
}

// The adds must happen in increasing i for every table element, as in SimCompute, whatever ids
// repeat: the ids are read on the host and planned there (kern::planScatter).
void GpuCompute::scatterAddRows(ConstView grad, ConstView ids, std::int64_t first, View table) {
  compute_checks::checkScatterAddRows(Device::kCuda, grad, ids, table);
  const std::int64_t vocab = table.dim(0), h = table.dim(1), n = ids.numel();
  enter();
  if (n == 0 || h == 0) return finish("scatterAddRows");
  std::vector<std::int64_t> flat(static_cast<std::size_t>(n));  // (n)
  if (ids.isContiguous()) {
    download(ids, flat.data());
  } else {
    const Tensor idsDense = contiguous(ids);  // (n)
    download(idsDense, flat.data());
  }
  const kern::ScatterPlan plan = kern::planScatter(flat, first, vocab);
  if (plan.owned == 0) return finish("scatterAddRows");
  Tensor buffer = empty(Shape{std::int64_t(plan.buffer.size())}, DType::kInt64);  // (2·segments + 1 + owned)
  upload(plan.buffer.data(), buffer);
  kern::runScatterAddRows(onDevice(), grad, plan, static_cast<const std::int64_t*>(buffer.data()), table);
  finish("scatterAddRows");
}

}  // namespace tpsim::gpu
