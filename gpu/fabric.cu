#include "gpu/fabric.h"

#include <algorithm>
#include <cstdint>

#include "backends/element_math.h"
#include "gpu/check.h"
#include "gpu/device.h"
#include "gpu/events.h"

namespace tpsim::gpu {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 4096;

// Every member's buffer, by group rank: passed by value in the kernel's parameters.
struct Members {
  const void* in[kMaxFabricRanks];
  void* out[kMaxFabricRanks];
};

int blocksFor(std::int64_t work) {
  return int(std::clamp<std::int64_t>((work + kThreads - 1) / kThreads, 1, kMaxBlocks));
}

// The simulator's rank-order sum for one storage type (sim/reduce.cc): Acc is the arithmetic
// type, every partial sum is stored (rounded) before the next rank is added.
struct F32 {
  using Storage = float;
  __device__ static float add(float a, float b) { return elem::reduceStep(a, b); }
  __device__ static float mean(float s, int n) { return elem::meanFinish(s, float(n)); }
};
struct F64 {
  using Storage = double;
  __device__ static double add(double a, double b) { return elem::reduceStep(a, b); }
  __device__ static double mean(double s, int n) { return elem::meanFinish(s, double(n)); }
};
struct I64 {
  using Storage = std::int64_t;
  __device__ static std::int64_t add(std::int64_t a, std::int64_t b) { return a + b; }
  __device__ static std::int64_t mean(std::int64_t s, int n) { return s / n; }
};
struct BF16 {
  using Storage = std::uint16_t;
  __device__ static std::uint16_t add(std::uint16_t a, std::uint16_t b) {
    return elem::floatToBf16(elem::reduceStep(elem::bf16ToFloat(a), elem::bf16ToFloat(b)));
  }
  __device__ static std::uint16_t mean(std::uint16_t s, int n) {
    return elem::floatToBf16(elem::meanFinish(elem::bf16ToFloat(s), float(n)));
  }
};
struct F16 {
  using Storage = std::uint16_t;
  __device__ static std::uint16_t add(std::uint16_t a, std::uint16_t b) {
    return elem::floatToHalf(elem::reduceStep(elem::halfToFloat(a), elem::halfToFloat(b)));
  }
  __device__ static std::uint16_t mean(std::uint16_t s, int n) {
    return elem::floatToHalf(elem::meanFinish(elem::halfToFloat(s), float(n)));
  }
};

// allReduce (scatter = false): every member's out[j] = Σ_r in_r[j]. reduceScatter: member q's
// out[j] = Σ_r in_r[q·count + j]. One thread per output element reads all its inputs before it
// writes, so in-place forms are safe: no other thread reads what it overwrites.
template <typename Rule>
__global__ void reduceKernel(Members m, int n, std::int64_t count, bool scatter, bool mean) {
  using S = typename Rule::Storage;
  const std::int64_t total = scatter ? count * n : count;
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < total;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    S acc = static_cast<const S*>(m.in[0])[i];
    for (int r = 1; r < n; ++r) acc = Rule::add(acc, static_cast<const S*>(m.in[r])[i]);
    if (mean) acc = Rule::mean(acc, n);
    if (scatter) {
      static_cast<S*>(m.out[i / count])[i % count] = acc;
    } else {
      for (int r = 0; r < n; ++r) static_cast<S*>(m.out[r])[i] = acc;
    }
  }
}

template <typename Rule>
__global__ void divideKernel(typename Rule::Storage* data, std::int64_t count, int n) {
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < count;
       i += std::int64_t(gridDim.x) * blockDim.x)
    data[i] = Rule::mean(data[i], n);
}

// Data movement in units U (1 to 16 bytes, chosen so every buffer and block is aligned to it).
// allGather: member r's out block q = member q's in (skipped where it already is, in place).
template <typename U>
__global__ void allGatherKernel(Members m, int n, std::int64_t units) {
  const std::int64_t total = std::int64_t(n) * n * units;
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < total;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    const int r = int(i / (std::int64_t(n) * units)), q = int(i / units % n);
    const std::int64_t j = i % units;
    U* dst = static_cast<U*>(m.out[r]) + q * units;
    const U* src = static_cast<const U*>(m.in[q]);
    if (dst != src) dst[j] = src[j];
  }
}

template <typename U>
__global__ void broadcastKernel(Members m, int n, int root, std::int64_t units) {
  const U* src = static_cast<const U*>(m.in[root]);
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < n * units;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    U* dst = static_cast<U*>(m.out[i / units]);
    if (dst != src) dst[i % units] = src[i % units];
  }
}

// allToAll: block q of member r's out is block r of member q's in. Each thread swaps one element
// of the pair (r, q), r <= q, reading both before writing either, so in-place members are safe.
template <typename U>
__global__ void allToAllKernel(Members m, int n, std::int64_t units) {
  const std::int64_t total = std::int64_t(n) * n * units;
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < total;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    const int r = int(i / (std::int64_t(n) * units)), q = int(i / units % n);
    if (r > q) continue;
    const std::int64_t j = i % units;
    const U toR = static_cast<const U*>(m.in[q])[r * units + j];
    const U toQ = static_cast<const U*>(m.in[r])[q * units + j];
    static_cast<U*>(m.out[r])[q * units + j] = toR;
    static_cast<U*>(m.out[q])[r * units + j] = toQ;
  }
}

template <typename Rule>
void launchReduce(const Members& m, int n, std::int64_t count, bool scatter, bool mean, cudaStream_t stream) {
  reduceKernel<Rule><<<blocksFor(scatter ? count * n : count), kThreads, 0, stream>>>(m, n, count, scatter, mean);
  TPSIM_CUDA_CHECK_LAUNCH("DeviceFabric reduce");
}

void launchReduceFor(DType dtype, const Members& m, int n, std::int64_t count, bool scatter, bool mean,
                     cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat32: return launchReduce<F32>(m, n, count, scatter, mean, stream);
    case DType::kFloat64: return launchReduce<F64>(m, n, count, scatter, mean, stream);
    case DType::kInt64: return launchReduce<I64>(m, n, count, scatter, mean, stream);
    case DType::kBFloat16: return launchReduce<BF16>(m, n, count, scatter, mean, stream);
    case DType::kFloat16: return launchReduce<F16>(m, n, count, scatter, mean, stream);
    case DType::kFloat8E4M3:
    case DType::kFloat8E8M0: break;  // the rendezvous rejects reductions of fp8 when they are issued
  }
  TPSIM_INTERNAL_ASSERT(false, "DeviceFabric: cannot reduce ", dtypeName(dtype));
}

// The widest unit (<= 16 bytes) that divides the block size and every buffer's address.
int moveUnit(const world::Collective& c, std::size_t blockBytes) {
  std::uintptr_t bits = blockBytes | 16;
  for (std::size_t r = 0; r < c.in.size(); ++r)
    bits |= reinterpret_cast<std::uintptr_t>(c.in[r].data()) | reinterpret_cast<std::uintptr_t>(c.out[r].data());
  return int(bits & -bits);  // lowest set bit
}

template <typename U>
void launchMove(const world::Collective& c, const Members& m, int n, std::size_t blockBytes, cudaStream_t stream) {
  const std::int64_t units = std::int64_t(blockBytes / sizeof(U));
  switch (c.kind) {
    case world::OpKind::kAllGather:
      allGatherKernel<U><<<blocksFor(std::int64_t(n) * n * units), kThreads, 0, stream>>>(m, n, units);
      break;
    case world::OpKind::kBroadcast:
      broadcastKernel<U><<<blocksFor(std::int64_t(n) * units), kThreads, 0, stream>>>(m, n, c.root, units);
      break;
    case world::OpKind::kAllToAll:
      allToAllKernel<U><<<blocksFor(std::int64_t(n) * n * units), kThreads, 0, stream>>>(m, n, units);
      break;
    default: TPSIM_INTERNAL_ASSERT(false, "DeviceFabric: ", world::opName(c.kind), " moves no blocks");
  }
  TPSIM_CUDA_CHECK_LAUNCH(world::opName(c.kind));
}

void launchMoveFor(const world::Collective& c, const Members& m, int n, std::size_t blockBytes, cudaStream_t stream) {
  switch (moveUnit(c, blockBytes)) {
    case 16: return launchMove<uint4>(c, m, n, blockBytes, stream);
    case 8: return launchMove<std::uint64_t>(c, m, n, blockBytes, stream);
    case 4: return launchMove<std::uint32_t>(c, m, n, blockBytes, stream);
    case 2: return launchMove<std::uint16_t>(c, m, n, blockBytes, stream);
    default: return launchMove<std::uint8_t>(c, m, n, blockBytes, stream);
  }
}

}  // namespace

DeviceFabric::DeviceFabric(int device, std::vector<GpuCompute*> ranks)
    : device_(device), timeoutMs_(deviceTimeoutMs()), ranks_(std::move(ranks)) {
  TPSIM_CHECK(int(ranks_.size()) <= kMaxFabricRanks, "DeviceFabric: at most ", kMaxFabricRanks,
              " ranks share one GPU, got ", ranks_.size());
  for (GpuCompute* r : ranks_)
    TPSIM_INTERNAL_ASSERT(r->deviceIndex() == device_, "every fabric rank is on device ", device_);
  TPSIM_CUDA_CHECK(cudaSetDevice(device_));
  TPSIM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
}

DeviceFabric::~DeviceFabric() {
  // Members' frees may still wait on its events. A stream that never drains is left alone: its
  // work would outlive it anyway, and blocking here would hang the teardown with it.
  if (drain(deadlineIn(timeoutMs_))) cudaStreamDestroy(stream_);
  cudaGetLastError();
}

bool DeviceFabric::drain(std::chrono::steady_clock::time_point deadline) noexcept {
  const bool drained = cudaSetDevice(device_) == cudaSuccess && pollStream(stream_, deadline) == cudaSuccess;
  cudaGetLastError();
  return drained;
}

world::TransportToken DeviceFabric::issued(int globalRank) {
  return recordEvent(device_, ranks_[globalRank]->stream());
}

world::TransportToken DeviceFabric::execute(const world::Collective& c) {
  const int n = int(c.globalRanks.size());
  TPSIM_CUDA_CHECK(cudaSetDevice(device_));
  for (const world::TransportToken& ready : c.issued) TPSIM_CUDA_CHECK(cudaStreamWaitEvent(stream_, eventOf(ready), 0));
  Members m{};
  for (int r = 0; r < n; ++r) {
    m.in[r] = c.in[r].data();
    m.out[r] = c.out[r].data();
  }
  const std::size_t esize = dtypeSize(c.dtype);
  const bool empty = c.inCount == 0 && c.outCount == 0;
  if (!empty) {
    switch (c.kind) {
      case world::OpKind::kAllReduce:
      case world::OpKind::kReduceScatter:
        launchReduceFor(c.dtype, m, n, c.outCount, c.kind == world::OpKind::kReduceScatter, c.reduce == ReduceOp::kMean,
                        stream_);
        break;
      case world::OpKind::kAllGather: launchMoveFor(c, m, n, std::size_t(c.inCount) * esize, stream_); break;
      case world::OpKind::kBroadcast: launchMoveFor(c, m, n, std::size_t(c.outCount) * esize, stream_); break;
      case world::OpKind::kAllToAll: launchMoveFor(c, m, n, std::size_t(c.inCount / n) * esize, stream_); break;
      case world::OpKind::kBarrier:
      case world::OpKind::kSplit: break;
    }
  }
  return recordEvent(device_, stream_);
}

void DeviceFabric::completed(int globalRank, const world::TransportToken& done) {
  streamWaitToken(device_, ranks_[globalRank]->stream(), done);
}

void divideOnDevice(DType dtype, void* data, std::int64_t count, int n, cudaStream_t stream) {
  if (count == 0) return;
  const int blocks = blocksFor(count);
  switch (dtype) {
    case DType::kFloat32: divideKernel<F32><<<blocks, kThreads, 0, stream>>>(static_cast<float*>(data), count, n); break;
    case DType::kFloat64: divideKernel<F64><<<blocks, kThreads, 0, stream>>>(static_cast<double*>(data), count, n); break;
    case DType::kInt64:
      divideKernel<I64><<<blocks, kThreads, 0, stream>>>(static_cast<std::int64_t*>(data), count, n);
      break;
    case DType::kBFloat16:
      divideKernel<BF16><<<blocks, kThreads, 0, stream>>>(static_cast<std::uint16_t*>(data), count, n);
      break;
    case DType::kFloat16:
      divideKernel<F16><<<blocks, kThreads, 0, stream>>>(static_cast<std::uint16_t*>(data), count, n);
      break;
    default: TPSIM_INTERNAL_ASSERT(false, "divideOnDevice: cannot divide ", dtypeName(dtype));
  }
  TPSIM_CUDA_CHECK_LAUNCH("mean division");
}

}  // namespace tpsim::gpu
