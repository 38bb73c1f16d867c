// GpuCompute against SimCompute on a CUDA device: every op and dtype combination on dense, padded
// and transposed views (bitwise, but GeLU within a few ulp), gemm within its error bound for every
// dtype, layout and zero size, the argument checks, memory lifetime, and the deadline on host
// waits. Without a device these tests skip with the probe's reason; the probe and the environment
// checks run everywhere.
#include "gpu/gpu_compute.h"

#include <gtest/gtest.h>

#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "gpu/check.h"
#include "gpu/device.h"
#include "sim/sim_compute.h"
#include "tests/gpu_stuck_kernel.h"
#include "tests/gpu_test_util.h"

namespace tpsim::gpu {
namespace {

using gputest::Bytes;
using gputest::EnvGuard;
using gputest::Layout;
using gputest::StuckKernel;
using gputest::Twin;

const Probe& probed() {
  static const Probe p = probe();
  return p;
}

#define TPSIM_REQUIRE_DEVICE() \
  if (!probed().hasDevice()) GTEST_SKIP() << probed().reason

template <typename Fn>
void expectThrows(Fn&& fn, const std::string& expected) {
  try {
    fn();
    ADD_FAILURE() << "expected an error containing \"" << expected << "\"";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << "message: " << e.what();
  }
}

class GpuComputeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    TPSIM_REQUIRE_DEVICE();
    gpu_ = std::make_unique<GpuCompute>(0);
  }
  sim::SimCompute sim_;
  std::unique_ptr<GpuCompute> gpu_;
};

// ---- Probe and environment (every machine) --------------------------------------------------------

TEST(GpuProbe, ReportsDevicesOrWhyThereAreNone) {
  const Probe p = probe();
  std::printf("%s", p.str().c_str());
  EXPECT_GT(p.runtimeVersion, 0);
  EXPECT_GT(p.cublasLtVersion, 0u);
  EXPECT_GE(p.ncclVersion, 20000);
  EXPECT_EQ(p.hasDevice(), p.reason.empty()) << p.reason;
  if (!p.hasDevice()) {
    EXPECT_NE(p.reason.find("CUDA device"), std::string::npos) << p.reason;
    EXPECT_NE(p.reason.find("cuda"), std::string::npos) << "the reason names the CUDA error: " << p.reason;
  }
  for (const DeviceInfo& d : p.devices) {
    EXPECT_FALSE(d.name.empty());
    EXPECT_GT(d.smCount, 0);
    EXPECT_GT(d.totalMemory, 0u);
    EXPECT_GE(d.major, 1);
  }
}

TEST(GpuComputeEnvironment, BadSettingsAreRejectedBeforeTheDeviceIsTouched) {
  {
    EnvGuard env("TPSIM_GPU_TIMEOUT_MS", "soon");
    expectThrows([] { GpuCompute g(0); }, "TPSIM_GPU_TIMEOUT_MS must be a positive number of milliseconds, got 'soon'");
  }
  {
    EnvGuard env("TPSIM_GPU_SYNC", "yes");
    expectThrows([] { GpuCompute g(0); }, "TPSIM_GPU_SYNC must be 0 or 1, got 'yes'");
  }
  expectThrows([] { GpuCompute g(-1); }, "GpuCompute: device must be a CUDA device index >= 0, got -1");
}

// Without a usable device (no driver here, or an index past the last device) construction throws
// BackendError naming the call and the CUDA error; it never hangs.
TEST(GpuComputeEnvironment, AMissingDeviceIsABackendError) {
  const int past = int(probed().devices.size());
  try {
    GpuCompute g(past);
    ADD_FAILURE() << "GpuCompute(" << past << ") should have thrown";
  } catch (const BackendError& e) {
    EXPECT_NE(std::string(e.what()).find("cudaSetDevice"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("cudaError"), std::string::npos) << e.what();
  }
}

// ---- Memory and transfers -----------------------------------------------------------------------

TEST_F(GpuComputeTest, EmptyIsCudaMemoryOnTheRanksDevice) {
  EXPECT_EQ(gpu_->device(), Device::kCuda);
  EXPECT_EQ(gpu_->deviceIndex(), 0);
  EXPECT_NE(gpu_->stream(), nullptr);
  for (DType d : gputest::kAllDTypes) {
    Tensor t = gpu_->empty({3, 5}, d);  // (3, 5)
    EXPECT_TRUE(t.defined());
    EXPECT_EQ(t.device(), Device::kCuda);
    EXPECT_EQ(t.shape(), Shape({3, 5}));
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(t.data()) % 16, 0u) << dtypeName(d);
    cudaPointerAttributes attr{};
    TPSIM_CUDA_CHECK(cudaPointerGetAttributes(&attr, t.data()));
    EXPECT_EQ(attr.type, cudaMemoryTypeDevice);
    EXPECT_EQ(attr.device, 0);
  }
  // More than any device holds: an allocation failure, as on the simulator, not a backend fault.
  EXPECT_THROW(gpu_->empty({std::int64_t(1) << 38}, DType::kFloat32), std::bad_alloc);  // 1 TiB
  Tensor none = gpu_->empty({0, 7}, DType::kFloat32);
  EXPECT_TRUE(none.defined());
  Tensor z = gpu_->zeros({4, 4}, DType::kBFloat16);  // (4, 4)
  std::vector<std::uint16_t> bits(16, 0xffff);
  gpu_->download(z, bits.data());
  for (std::size_t i = 0; i < bits.size(); ++i) EXPECT_EQ(bits[i], 0) << "mismatch at index " << i;
}

TEST_F(GpuComputeTest, UploadDownloadRoundTripAndChecks) {
  const std::vector<double> in = {1.5, -2.0, 3.25, 1e300, -0.0, 7.0};  // (2, 3)
  Tensor t = gpu_->empty({2, 3}, DType::kFloat64);
  gpu_->upload(in.data(), t);
  std::vector<double> out(6, 0.0);
  gpu_->download(t, out.data());
  for (std::size_t i = 0; i < in.size(); ++i) {
    EXPECT_EQ(out[i], in[i]) << "mismatch at index " << i;
    EXPECT_EQ(std::signbit(out[i]), std::signbit(in[i])) << "mismatch at index " << i;
  }
  gpu_->upload(nullptr, gpu_->empty({0}, DType::kFloat32));  // nothing to copy
  expectThrows([&] { gpu_->upload(in.data(), t.view().t()); },
               "upload: dst must be contiguous, got fp64 (3, 2) strides (1, 3)");
  expectThrows([&] { gpu_->download(t.view().t(), out.data()); }, "download: src must be contiguous");
  Tensor host = sim_.empty({2, 3}, DType::kFloat64);
  expectThrows([&] { gpu_->upload(in.data(), host); }, "upload: dst must be CUDA memory, got fp64 (2, 3) on host");
}

// ---- Elementwise ops against SimCompute ---------------------------------------------------------

TEST_F(GpuComputeTest, FillMatchesSimCompute) { gputest::checkFill(sim_, *gpu_); }
TEST_F(GpuComputeTest, CopyMatchesSimCompute) { gputest::checkCopy(sim_, *gpu_); }
TEST_F(GpuComputeTest, AxpyMatchesSimCompute) { gputest::checkAxpy(sim_, *gpu_); }
TEST_F(GpuComputeTest, ScaleMatchesSimCompute) { gputest::checkScale(sim_, *gpu_); }
TEST_F(GpuComputeTest, AddBiasMatchesSimCompute) { gputest::checkAddBias(sim_, *gpu_); }
TEST_F(GpuComputeTest, SumRowsMatchesSimCompute) { gputest::checkSumRows(sim_, *gpu_); }
TEST_F(GpuComputeTest, GeluIsWithinAFewUlpOfSimCompute) { gputest::checkGelu(sim_, *gpu_, /*bitwise=*/false); }
TEST_F(GpuComputeTest, GeluBackwardIsWithinAFewUlpOfSimCompute) {
  gputest::checkGeluBackward(sim_, *gpu_, /*bitwise=*/false);
}
TEST_F(GpuComputeTest, QuantizeMxfp8MatchesSimCompute) { gputest::checkQuantizeMxfp8(sim_, *gpu_); }
TEST_F(GpuComputeTest, DequantizeMxfp8MatchesSimCompute) { gputest::checkDequantizeMxfp8(sim_, *gpu_); }
TEST_F(GpuComputeTest, GatherRowsMatchesSimCompute) { gputest::checkGatherRows(sim_, *gpu_); }
TEST_F(GpuComputeTest, ScatterAddRowsMatchesSimCompute) { gputest::checkScatterAddRows(sim_, *gpu_); }

// Where SimCompute's store would throw (int64 out of range or NaN, e8m0 not a power of two),
// GpuCompute throws the same kind of error before writing anything.
TEST_F(GpuComputeTest, UnstorableValuesAreRejectedBeforeAnyWrite) {
  const std::vector<float> values = {1.f, 2.f, std::nanf(""), 4.f};  // (4)
  Tensor x = gpu_->empty({4}, DType::kFloat32);
  gpu_->upload(values.data(), x);
  Tensor ids = gpu_->empty({4}, DType::kInt64);
  gpu_->fill(ids, 7.0);
  expectThrows([&] { gpu_->copy(x, ids); }, "copy: an int64 output must receive values in [-2^63, 2^63), got nan");
  std::vector<std::int64_t> after(4);
  gpu_->download(ids, after.data());
  EXPECT_EQ(after, (std::vector<std::int64_t>{7, 7, 7, 7}));
  expectThrows([&] { gpu_->fill(ids, 1e19); }, "fill: an int64 output must receive values in [-2^63, 2^63), got 1e+19");

  Tensor scales = gpu_->empty({4}, DType::kFloat8E8M0);
  gpu_->fill(scales, 0.5);
  const std::vector<float> three = {2.f, 3.f, 0.25f, 1.f};  // (4)
  gpu_->upload(three.data(), x);
  expectThrows([&] { gpu_->copy(x, scales); }, "copy: an e8m0 output must receive exact powers of two");
  expectThrows([&] { gpu_->fill(scales, 3.0); }, "got 3");
  std::vector<std::uint8_t> codes(4);
  gpu_->download(scales, codes.data());
  EXPECT_EQ(codes, (std::vector<std::uint8_t>{126, 126, 126, 126}));
}

TEST_F(GpuComputeTest, ChecksNameTheArgumentAsSimComputeDoes) {
  Tensor host = sim_.empty({4}, DType::kFloat32);
  Tensor y = gpu_->empty({4}, DType::kFloat32), bf = gpu_->empty({4}, DType::kBFloat16);
  expectThrows([&] { gpu_->axpy(1.f, host, y); }, "axpy: x must be CUDA memory, got fp32 (4,) on host");
  expectThrows([&] { gpu_->axpy(1.f, y, bf); }, "axpy: y must have x's dtype fp32 or a wider one, got bf16 (4,)");
  expectThrows([&] { gpu_->copy(y, gpu_->empty({5}, DType::kFloat32)); },
               "copy: y must have x's shape (4,), got fp32 (5,)");
  Tensor a = gpu_->empty({2, 3}, DType::kFloat32), b = gpu_->empty({3, 4}, DType::kFloat32);
  Tensor c16 = gpu_->empty({2, 4}, DType::kBFloat16);
  expectThrows([&] { gpu_->gemm(a, b, c16); }, "gemm: c must have a's dtype fp32, got bf16 (2, 4)");
  expectThrows([&] { gpu_->gemm(a, a, c16); }, "gemm: b must be (K=3, N), got fp32 (2, 3)");
  Tensor q = gpu_->empty({2, 3}, DType::kFloat8E4M3), s = gpu_->empty({2, 2}, DType::kFloat8E8M0);
  expectThrows([&] { gpu_->quantizeMxfp8(a, q, s, 1); },
               "scales of rowwise (axis 1) blocks of a (2, 3) matrix must be (2, 1)");
  expectThrows([&] { gpu_->scale(q, 2.f); }, "fp8 is a storage type, dequantizeMxfp8 it first");
}

// ---- gemm ---------------------------------------------------------------------------------------

struct GemmDTypes {
  DType ab, c;
};
const GemmDTypes kGemmDTypes[] = {{DType::kFloat32, DType::kFloat32},  {DType::kBFloat16, DType::kBFloat16},
                                  {DType::kFloat16, DType::kFloat16},  {DType::kFloat64, DType::kFloat64},
                                  {DType::kBFloat16, DType::kFloat32}, {DType::kFloat16, DType::kFloat32}};

// The matrix layouts of gputest plus one with no unit-stride mode, which gemm copies first.
std::vector<Layout> gemmLayouts(Shape shape, bool all) {
  std::vector<Layout> ls = gputest::layoutsOf(shape);
  if (!all) return {ls[0], ls[2]};  // dense and transposed
  ls.push_back(gputest::makeLayout("no unit stride", shape, Strides{2 * shape[1] + 1, 2}));
  return ls;
}

// Moderate values (no NaN or infinity) of both signs, exact in `d`.
Bytes gemmInput(DType d, std::int64_t n, gputest::Rng& rng) {
  Bytes out(std::size_t(n) * dtypeSize(d));
  for (std::int64_t i = 0; i < n; ++i)
    storeFromDouble(d, std::uniform_real_distribution<double>(-1, 1)(rng) * std::ldexp(1.0, int(i % 9) - 4),
                    &out[std::size_t(i) * dtypeSize(d)]);
  return out;
}

// Element (i, j) of a view with layout l that starts `offset` elements into the buffer b.
double elementAt(const Bytes& b, DType d, const Layout& l, std::int64_t offset, std::int64_t i, std::int64_t j) {
  return loadAsDouble(d, &b[std::size_t(offset + i * l.strides[0] + j * l.strides[1]) * dtypeSize(d)]);
}

// Per element, |c - exact| <= (K+2)·u·(|alpha|·Σ|a||b| + |beta·c_old|) + u_out·|exact| + half the
// output's smallest subnormal, with u = 2^-23 for fp32 accumulation (tensor cores may truncate
// while accumulating, GPU-NOTES §3), 2^-52 for fp64, and u_out the output's unit roundoff. The
// exact value is computed in long double from the operands as stored. Both backends must hold it;
// elements of c's buffer outside the view must not change. a, b and c start `offset` elements
// into their buffers.
void checkGemmCase(sim::SimCompute& sim, GpuCompute& gpu, std::int64_t m, std::int64_t k, std::int64_t n,
                   GemmDTypes dt, const Layout& la, const Layout& lb, const Layout& lc, float alpha, float beta,
                   gputest::Rng& rng, std::int64_t offset = 0) {
  const std::string what = "gemm M=" + std::to_string(m) + " K=" + std::to_string(k) + " N=" + std::to_string(n) +
                           " " + dtypeName(dt.ab) + "->" + dtypeName(dt.c) + " a " + la.name + ", b " + lb.name +
                           ", c " + lc.name + " alpha " + std::to_string(alpha) + " beta " + std::to_string(beta) +
                           " offset " + std::to_string(offset);
  Twin a(sim, gpu, dt.ab, offset + la.span, gemmInput(dt.ab, offset + la.span, rng));
  Twin b(sim, gpu, dt.ab, offset + lb.span, gemmInput(dt.ab, offset + lb.span, rng));
  Twin c(sim, gpu, dt.c, offset + lc.span, gemmInput(dt.c, offset + lc.span, rng));
  if (beta == 0.f) {  // beta == 0 must ignore the old c: NaN there must not leak
    sim.fill(c.sim(lc, offset), gputest::kNaN);
    gpu.fill(c.other(lc, offset), gputest::kNaN);
  }
  const Bytes ab = a.simBytes(), bb = b.simBytes(), cOld = c.simBytes();
  sim.gemm(a.sim(la, offset), b.sim(lb, offset), c.sim(lc, offset), alpha, beta);
  gpu.gemm(a.other(la, offset), b.other(lb, offset), c.other(lc, offset), alpha, beta);
  const Bytes cs = c.simBytes(), cg = c.otherBytes();

  const double u = dt.ab == DType::kFloat64 ? 0x1p-52 : 0x1p-23;
  const double uOut = dt.c == DType::kBFloat16 ? 0x1p-8 : dt.c == DType::kFloat16 ? 0x1p-11
                      : dt.c == DType::kFloat32 ? 0x1p-24 : 0x1p-53;
  const double tinyOut = gputest::ulpOf(dt.c, 0.0) / 2;
  std::vector<bool> inView(std::size_t(offset + lc.span), false);
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      long double dot = 0, mag = 0;
      for (std::int64_t p = 0; p < k; ++p) {
        const long double x = elementAt(ab, dt.ab, la, offset, i, p), y = elementAt(bb, dt.ab, lb, offset, p, j);
        dot += x * y;
        mag += std::fabs(x * y);
      }
      const double old = beta == 0.f ? 0.0 : elementAt(cOld, dt.c, lc, offset, i, j);
      const double exact = double(alpha * dot + beta * (long double)old);
      const double bound = double((k + 2) * u * (std::fabs(alpha) * mag + std::fabs(beta * old))) +
                           uOut * std::fabs(exact) + tinyOut;
      const double simV = elementAt(cs, dt.c, lc, offset, i, j), gpuV = elementAt(cg, dt.c, lc, offset, i, j);
      if (!(std::fabs(gpuV - exact) <= bound) || !(std::fabs(simV - exact) <= bound)) {
        ADD_FAILURE() << what << ": c(" << i << ", " << j << ") exact " << exact << ", gpu " << gpuV << ", sim "
                      << simV << ", bound " << bound;
        return;
      }
      inView[std::size_t(offset + i * lc.strides[0] + j * lc.strides[1])] = true;
    }
  const std::size_t size = dtypeSize(dt.c);
  for (std::size_t e = 0; e < inView.size(); ++e)
    if (!inView[e] && std::memcmp(&cg[e * size], &cOld[e * size], size) != 0) {
      ADD_FAILURE() << what << ": element " << e << " of c's buffer, outside the view, changed";
      return;
    }
}

// checkGemmCase for every shape (m, k, n), dtype pair, layout of a, b and c (every gemmLayout, or
// the dense and transposed ones) and (alpha, beta), each view `offset` elements into its buffer.
void checkGemmCases(sim::SimCompute& sim, GpuCompute& gpu, const std::vector<std::array<std::int64_t, 3>>& shapes,
                    const std::vector<GemmDTypes>& dtypes, bool allLayouts,
                    const std::vector<std::array<float, 2>>& scales, gputest::Rng& rng, std::int64_t offset = 0) {
  for (const auto& s : shapes)
    for (GemmDTypes dt : dtypes)
      for (const Layout& la : gemmLayouts(Shape{s[0], s[1]}, allLayouts))
        for (const Layout& lb : gemmLayouts(Shape{s[1], s[2]}, allLayouts))
          for (const Layout& lc : gemmLayouts(Shape{s[0], s[2]}, allLayouts))
            for (const auto& ab : scales)
              checkGemmCase(sim, gpu, s[0], s[1], s[2], dt, la, lb, lc, ab[0], ab[1], rng, offset);
}

TEST_F(GpuComputeTest, GemmIsWithinTheBoundForEveryDtypeAndLayout) {
  gputest::Rng rng(20);
  const std::vector<GemmDTypes> dtypes(std::begin(kGemmDTypes), std::end(kGemmDTypes));
  const std::vector<std::array<float, 2>> scales = {{1.f, 0.f}, {1.f, 1.f}, {0.75f, -0.5f}};  // (alpha, beta)
  checkGemmCases(sim_, *gpu_, {{7, 13, 5}, {3, 1, 4}, {1, 40, 1}, {6, 2, 1}}, dtypes, true, scales, rng);
  checkGemmCases(sim_, *gpu_, {{64, 128, 96}, {33, 257, 65}, {5, 1000, 3}, {128, 1, 64}}, dtypes, false, scales, rng);
}

// Views one element into their buffers are only 2-byte (bf16) or 4-byte (fp32) aligned, below
// the allocations' 256: the plan must ask the heuristic for algorithms that take such pointers
// (the MIN_ALIGNMENT preferences), whatever the leading dimensions allow.
TEST_F(GpuComputeTest, GemmOnViewsLessAlignedThanTheirBuffersIsWithinTheBound) {
  gputest::Rng rng(23);
  checkGemmCases(sim_, *gpu_, {{7, 13, 5}, {64, 128, 96}, {33, 257, 65}},
                 {{DType::kBFloat16, DType::kBFloat16}, {DType::kFloat32, DType::kFloat32}}, false,
                 {{1.f, 0.f}, {0.75f, -0.5f}}, rng, /*offset=*/1);
}

// M = 0 or N = 0 do nothing; K = 0 leaves c = beta·c (0 for beta = 0, even over NaN).
TEST_F(GpuComputeTest, GemmHandlesZeroSizes) {
  gputest::Rng rng(21);
  const std::int64_t shapes[][3] = {{0, 4, 3}, {3, 4, 0}, {3, 0, 5}, {0, 0, 0}};
  for (const auto& s : shapes)
    for (GemmDTypes dt : kGemmDTypes)
      for (float beta : {0.f, 1.f, -0.5f}) {
        const Layout la = gputest::layoutsOf(Shape{s[0], s[1]})[0], lb = gputest::layoutsOf(Shape{s[1], s[2]})[0];
        for (const Layout& lc : gputest::layoutsOf(Shape{s[0], s[2]}))
          checkGemmCase(sim_, *gpu_, s[0], s[1], s[2], dt, la, lb, lc, 1.f, beta, rng);
      }
}

// The same gemm gives the same bits every time and on every rank: each rank has its own cuBLASLt
// workspace, and split-K may only reduce in the workspace, in a fixed order.
TEST_F(GpuComputeTest, GemmIsReproducibleAcrossCallsAndRanks) {
  gputest::Rng rng(22);
  GpuCompute other(0);
  for (GemmDTypes dt : kGemmDTypes) {
    const std::int64_t m = 96, k = 4096, n = 80;
    Tensor a = gpu_->empty({m, k}, dt.ab), b = gpu_->empty({k, n}, dt.ab);  // (M, K) (K, N)
    const Bytes ab = gemmInput(dt.ab, m * k, rng), bb = gemmInput(dt.ab, k * n, rng);
    gpu_->upload(ab.data(), a);
    gpu_->upload(bb.data(), b);
    std::vector<Bytes> results;
    for (int run = 0; run < 3; ++run) {
      GpuCompute& g = run == 2 ? other : *gpu_;
      Tensor ga = g.empty({m, k}, dt.ab), gb = g.empty({k, n}, dt.ab), c = g.empty({m, n}, dt.c);  // (M, N)
      g.upload(ab.data(), ga);
      g.upload(bb.data(), gb);
      g.gemm(ga, gb, c);
      results.emplace_back(c.view().bytes());
      g.download(c, results.back().data());
    }
    EXPECT_EQ(results[0], results[1]) << dtypeName(dt.ab) << " -> " << dtypeName(dt.c) << ": two calls differ";
    EXPECT_EQ(results[0], results[2]) << dtypeName(dt.ab) << " -> " << dtypeName(dt.c) << ": two ranks differ";
  }
}

// ---- Streams, deadlines and lifetime ------------------------------------------------------------

TEST(GpuComputeDeadline, HostWaitsTimeOutInsteadOfHanging) {
  TPSIM_REQUIRE_DEVICE();
  EnvGuard env("TPSIM_GPU_TIMEOUT_MS", "300");
  GpuCompute gpu(0);
  Tensor t = gpu.zeros({4}, DType::kFloat32);  // (4)
  StuckKernel stuck(gpu.stream());
  const auto start = std::chrono::steady_clock::now();
  std::vector<float> host(4);
  expectThrows([&] { gpu.download(t, host.data()); },
               "download: the stream of cuda:0 did not finish within 300 ms (TPSIM_GPU_TIMEOUT_MS)");
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  stuck.release();
  gpu.synchronize("test");  // released: the stream drains
  gpu.download(t, host.data());
  EXPECT_EQ(host, std::vector<float>(4, 0.f));
}

// A bf16 product of zeros, with fp32 output, downloaded: every element 0.
void expectZeroProduct(GpuCompute& gpu) {
  Tensor a = gpu.zeros({8, 16}, DType::kBFloat16), b = gpu.zeros({16, 4}, DType::kBFloat16);
  Tensor c = gpu.empty({8, 4}, DType::kFloat32);  // (8, 4)
  gpu.gemm(a, b, c);
  std::vector<float> host(32, 1.f);
  gpu.download(c, host.data());
  EXPECT_EQ(host, std::vector<float>(32, 0.f));
}

// A new GpuCompute on device 0 allocates, fills and downloads.
void expectDeviceUsable() {
  GpuCompute again(0);
  Tensor u = again.zeros({4}, DType::kFloat64);  // (4)
  std::vector<double> host(4, 1.0);
  again.download(u, host.data());
  EXPECT_EQ(host, std::vector<double>(4, 0.0));
}

TEST(GpuComputeSync, SyncModeWaitsAfterEveryOp) {
  TPSIM_REQUIRE_DEVICE();
  EnvGuard env("TPSIM_GPU_SYNC", "1");
  GpuCompute gpu(0);
  sim::SimCompute sim;
  gputest::checkAxpy(sim, gpu);
  expectZeroProduct(gpu);
}

// A tensor may outlive the GpuCompute that made it; it is then freed on the legacy default stream.
TEST(GpuComputeLifetime, TensorsMayOutliveTheirGpuCompute) {
  TPSIM_REQUIRE_DEVICE();
  Tensor t;
  {
    GpuCompute gpu(0);
    t = gpu.empty({1024}, DType::kFloat32);
    gpu.fill(t, 2.0);
    gpu.synchronize("test");
  }
  t = Tensor();
  expectDeviceUsable();
}

// A rank's teardown waits for its own stream only: another rank's stuck kernel neither delays nor
// hangs it (nothing waits for the whole device), and the next rank reuses its cuBLASLt handle.
TEST(GpuComputeLifetime, RanksComeAndGoWhileAnotherStreamIsStuck) {
  TPSIM_REQUIRE_DEVICE();
  const auto gemmOnce = [] {
    GpuCompute rank(0);
    expectZeroProduct(rank);
  };
  gemmOnce();  // loads the kernels first: lazy module loading is not what this test is about
  GpuCompute other(0);
  StuckKernel stuck(other.stream());
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 3; ++i) gemmOnce();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  stuck.release();
  other.synchronize("test");
}

// A rank whose stream does not drain is destroyed within the deadline; its tensors that outlive it
// are leaked rather than freed under the running kernel, and the device stays usable.
TEST(GpuComputeLifetime, AStuckRankIsDestroyedWithinTheDeadline) {
  TPSIM_REQUIRE_DEVICE();
  EnvGuard env("TPSIM_GPU_TIMEOUT_MS", "300");
  auto rank = std::make_unique<GpuCompute>(0);
  Tensor t = rank->zeros({1024}, DType::kFloat32);  // (1024)
  StuckKernel stuck(rank->stream());
  const auto start = std::chrono::steady_clock::now();
  rank.reset();
  t = Tensor();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  stuck.release();
  expectDeviceUsable();
}

// Two ranks on one device run on their own streams; their results do not mix.
TEST(GpuComputeRanks, TwoRanksShareADevice) {
  TPSIM_REQUIRE_DEVICE();
  GpuCompute r0(0), r1(0);
  EXPECT_NE(r0.stream(), r1.stream());
  Tensor x0 = r0.empty({1 << 20}, DType::kFloat32), x1 = r1.empty({1 << 20}, DType::kFloat32);  // (1M)
  r0.fill(x0, 1.0);
  r1.fill(x1, 3.0);
  r0.scale(x0, 2.f);
  r1.scale(x1, 0.5f);
  std::vector<float> h0(1 << 20), h1(1 << 20);
  r0.download(x0, h0.data());
  r1.download(x1, h1.data());
  EXPECT_EQ(h0, std::vector<float>(1 << 20, 2.f));
  EXPECT_EQ(h1, std::vector<float>(1 << 20, 1.5f));
}

}  // namespace
}  // namespace tpsim::gpu
