#include "gpu/matmul.h"

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "gpu/check.h"

namespace tpsim::gpu {
namespace {

// A mode of extent <= 1 is never stepped along, so its stride does not matter.
bool unitStride(ConstView v, int mode) { return v.stride(mode) == 1 || v.dim(mode) <= 1; }

// v (R, C) stored column-major: rows x cols with leading dimension ld. A row-major v is stored as
// vᵀ (C, R), which `transposed` says. ld = 0 when v is neither.
struct ColumnMajor {
  std::int64_t rows = 0, cols = 0, ld = 0;
  bool transposed = false;
};

ColumnMajor columnMajor(ConstView v) {
  const std::int64_t r = v.dim(0), c = v.dim(1);
  if (unitStride(v, 1)) {
    const std::int64_t ld = r <= 1 ? std::max<std::int64_t>(c, 1) : v.stride(0);
    if (ld >= std::max<std::int64_t>(c, 1)) return {c, r, ld, true};
  }
  if (unitStride(v, 0)) {
    const std::int64_t ld = c <= 1 ? std::max<std::int64_t>(r, 1) : v.stride(1);
    if (ld >= std::max<std::int64_t>(r, 1)) return {r, c, ld, false};
  }
  return {};
}

// v as the operand op(X) = v, or op(X) = vᵀ when `wantTranspose`.
LtMatrix operand(ConstView v, bool wantTranspose) {
  const ColumnMajor cm = columnMajor(v);
  TPSIM_INTERNAL_ASSERT(cm.ld > 0, "mapGemm: operand ", v.str(), " has no cuBLASLt layout");
  LtMatrix m;
  m.data = v.data();
  m.dtype = v.dtype();
  m.rows = cm.rows;
  m.cols = cm.cols;
  m.ld = cm.ld;
  m.trans = cm.transposed != wantTranspose;
  return m;
}

cudaDataType_t cudaType(DType d) {
  switch (d) {
    case DType::kFloat32: return CUDA_R_32F;
    case DType::kBFloat16: return CUDA_R_16BF;
    case DType::kFloat16: return CUDA_R_16F;
    case DType::kFloat64: return CUDA_R_64F;
    default: break;
  }
  TPSIM_INTERNAL_ASSERT(false, "gemm: no cuBLASLt type for ", dtypeName(d));
}

// The largest power of two (up to 256) dividing the address: what cuBLASLt's MIN_ALIGNMENT
// preferences describe.
unsigned alignmentOf(const void* p) {
  const auto address = reinterpret_cast<std::uintptr_t>(p);
  unsigned a = 1;
  while (a < 256 && address % (2 * a) == 0) a *= 2;
  return a;
}

template <typename T>
void setAttr(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, T value) {
  TPSIM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof value));
}
template <typename T>
void setPref(cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr, T value) {
  TPSIM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof value));
}

// cuBLASLt handles by device, reused and never destroyed: cublasLtDestroy synchronizes the whole
// device, so one rank's teardown would wait for every other stream there (fabric, NCCL, other
// ranks), forever if one is stuck. A handle holds neither a stream nor a workspace (both are
// passed per call) and cuBLAS is thread safe even with a shared handle, so a handle may pass from
// one rank or thread to the next; the pool lends each to one Matmul at a time.
class HandlePool {
 public:
  static HandlePool& instance() {
    static HandlePool* pool = new HandlePool;  // never destroyed: handles stay valid until exit
    return *pool;
  }

  // A free handle of `device`, created when there is none; `device` must be current, as
  // cublasLtCreate ties the handle to it.
  cublasLtHandle_t take(int device) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      std::vector<cublasLtHandle_t>& free = free_[device];
      if (!free.empty()) {
        const cublasLtHandle_t handle = free.back();
        free.pop_back();
        return handle;
      }
    }
    cublasLtHandle_t handle = nullptr;
    TPSIM_CUBLAS_CHECK(cublasLtCreate(&handle));
    return handle;
  }

  void give(int device, cublasLtHandle_t handle) {
    std::lock_guard<std::mutex> lock(mu_);
    free_[device].push_back(handle);
  }

 private:
  std::mutex mu_;
  std::unordered_map<int, std::vector<cublasLtHandle_t>> free_;
};

}  // namespace

bool hasLtLayout(ConstView v) { return v.rank() == 2 && columnMajor(v).ld > 0; }

LtGemm mapGemm(ConstView a, ConstView b, View c) {  // (M, K) (K, N) (M, N)
  const ColumnMajor cm = columnMajor(c);
  TPSIM_INTERNAL_ASSERT(cm.ld > 0, "mapGemm: c ", c.str(), " has no cuBLASLt layout");
  LtGemm g;
  g.c = c.data();
  g.cType = c.dtype();
  g.ldc = cm.ld;
  g.k = a.dim(1);
  if (!cm.transposed) {  // D = c (M, N) = a·b
    g.a = operand(a, false);
    g.b = operand(b, false);
    g.m = c.dim(0);
    g.n = c.dim(1);
  } else {  // D = cᵀ (N, M) = bᵀ·aᵀ
    g.a = operand(b, true);
    g.b = operand(a, true);
    g.m = c.dim(1);
    g.n = c.dim(0);
  }
  return g;
}

// ---- Matmul -------------------------------------------------------------------------------------

struct Matmul::Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};

  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    // Destroying descriptors only frees host memory; nothing to report from a destructor.
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

Matmul::Matmul(int device, cudaStream_t stream)
    : device_(device), stream_(stream), handle_(HandlePool::instance().take(device)) {
  try {
    // From the device's pool, in stream order. Like every CUDA allocation it is aligned to at least
    // 256 bytes, as cuBLASLt wants for its workspace.
    TPSIM_CUDA_CHECK(cudaMallocAsync(&workspace_, kWorkspaceBytes, stream_));
  } catch (...) {
    HandlePool::instance().give(device_, handle_);
    throw;
  }
}

Matmul::~Matmul() {
  plans_.clear();
  cudaFreeAsync(workspace_, stream_);
  HandlePool::instance().give(device_, handle_);
}

const Matmul::Plan& Matmul::plan(const LtGemm& g) {
  const unsigned alignA = alignmentOf(g.a.data), alignB = alignmentOf(g.b.data), alignC = alignmentOf(g.c);
  const Key key{g.m, g.n, g.k, g.a.ld, g.b.ld, g.ldc, int(g.a.trans), int(g.b.trans), int(g.a.dtype),
                int(g.b.dtype), int(g.cType), alignA, alignB, alignC};
  auto it = plans_.find(key);
  if (it != plans_.end()) return *it->second;
  if (plans_.size() >= kMaxPlans) plans_.clear();  // a training step uses a handful of shapes

  auto p = std::make_unique<Plan>();
  const bool fp64 = g.a.dtype == DType::kFloat64;
  TPSIM_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p->desc, fp64 ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F,
                                              fp64 ? CUDA_R_64F : CUDA_R_32F));
  setAttr<std::int32_t>(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, g.a.trans ? CUBLAS_OP_T : CUBLAS_OP_N);
  setAttr<std::int32_t>(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, g.b.trans ? CUBLAS_OP_T : CUBLAS_OP_N);
  TPSIM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->a, cudaType(g.a.dtype), std::uint64_t(g.a.rows),
                                                std::uint64_t(g.a.cols), g.a.ld));
  TPSIM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->b, cudaType(g.b.dtype), std::uint64_t(g.b.rows),
                                                std::uint64_t(g.b.cols), g.b.ld));
  TPSIM_CUBLAS_CHECK(
      cublasLtMatrixLayoutCreate(&p->c, cudaType(g.cType), std::uint64_t(g.m), std::uint64_t(g.n), g.ldc));

  cublasLtMatmulPreference_t pref = nullptr;
  TPSIM_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, cublasStatus_t (*)(cublasLtMatmulPreference_t)> prefGuard(
      pref, &cublasLtMatmulPreferenceDestroy);
  setPref<std::uint64_t>(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, kWorkspaceBytes);
  // Split-K partial sums may only be reduced in the compute type (fp32/fp64), in the workspace:
  // OUTPUT_TYPE and INPLACE both reduce in the output type (INPLACE in D itself, in a fixed order),
  // which would round a 16-bit D more than once. NONE (0) is listed for clarity: algorithms
  // without split-K are always eligible.
  setPref<std::uint32_t>(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                         CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE | CUBLASLT_REDUCTION_SCHEME_NONE);
  setPref<std::uint32_t>(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignA);
  setPref<std::uint32_t>(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignB);
  setPref<std::uint32_t>(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignC);
  setPref<std::uint32_t>(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignC);

  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  // NOT_SUPPORTED is the heuristic's way of saying that no algorithm fits, as found == 0 is.
  const cublasStatus_t searched =
      cublasLtMatmulAlgoGetHeuristic(handle_, p->desc, p->a, p->b, p->c, p->c, pref, 1, &result, &found);
  if (searched != CUBLAS_STATUS_SUCCESS && searched != CUBLAS_STATUS_NOT_SUPPORTED)
    detail::throwFailure("cublasLtMatmulAlgoGetHeuristic", cublasLtGetStatusName(searched),
                         cublasLtGetStatusString(searched), __FILE__, __LINE__);
  if (searched == CUBLAS_STATUS_NOT_SUPPORTED || found == 0 || result.state != CUBLAS_STATUS_SUCCESS)
    throw BackendError(tpsim::detail::concat(
        "gemm: cuBLASLt has no algorithm for m=", g.m, " n=", g.n, " k=", g.k, ", a ", dtypeName(g.a.dtype),
        g.a.trans ? " transposed" : "", " (ld ", g.a.ld, ", ", alignA, "-byte aligned), b ",
        dtypeName(g.b.dtype), g.b.trans ? " transposed" : "", " (ld ", g.b.ld, ", ", alignB,
        "-byte aligned), c ", dtypeName(g.cType), " (ld ", g.ldc, ", ", alignC, "-byte aligned) within a ",
        kWorkspaceBytes >> 20, " MiB workspace and compute-type split-K reduction"));
  p->algo = result.algo;
  return *plans_.emplace(key, std::move(p)).first->second;
}

void Matmul::run(const LtGemm& g, float alpha, float beta) {
  const Plan& p = plan(g);
  // The scale type is fp64 for fp64 operands, else fp32; alpha and beta are exact in both.
  const double alpha64 = alpha, beta64 = beta;
  const void* alphaPtr = g.a.dtype == DType::kFloat64 ? static_cast<const void*>(&alpha64) : &alpha;
  const void* betaPtr = g.a.dtype == DType::kFloat64 ? static_cast<const void*>(&beta64) : &beta;
  TPSIM_CUBLAS_CHECK(cublasLtMatmul(handle_, p.desc, alphaPtr, g.a.data, p.a, g.b.data, p.b, betaPtr, g.c, p.c,
                                    g.c, p.c, &p.algo, workspace_, kWorkspaceBytes, stream_));
}

}  // namespace tpsim::gpu
