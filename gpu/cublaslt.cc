// cuBLASLt, loaded at its first call rather than at start-up: the cuBLASLt functions the gpu backend
// calls, each forwarding to the library dlopen()ed once. The library's own initialization costs
// about 0.35 s, which every tpsim command paid at start-up when it was linked, even those that
// never touch a GPU. Without the library every call fails cleanly: CUBLAS_STATUS_NOT_INITIALIZED,
// a status name that says why, version 0.
#include <cublasLt.h>
#include <dlfcn.h>

#include <string>
#include <type_traits>

namespace tpsim::gpu {
namespace {

std::string& loadError() {
  static std::string error;
  return error;
}

// The library by its soname (LD_LIBRARY_PATH, the executable's RUNPATH, the system's paths), else
// at the path the build found it; null when neither loads.
void* library() {
  static void* const handle = [] {
    const std::string soname = "libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR);
    void* h = dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) h = dlopen(TPSIM_CUBLASLT_LIBRARY, RTLD_NOW | RTLD_LOCAL);
    if (!h) loadError() = "cuBLASLt could not be loaded (" + soname + ", " + TPSIM_CUBLASLT_LIBRARY + ")";
    return h;
  }();
  return handle;
}

// What a call returns when the library is missing.
template <class R>
R missing() {
  if constexpr (std::is_same_v<R, cublasStatus_t>)
    return CUBLAS_STATUS_NOT_INITIALIZED;
  else if constexpr (std::is_same_v<R, const char*>)
    return loadError().c_str();
  else
    return R{};
}

// kDeclared(args...) in the loaded library: the function of the same name, resolved once.
template <auto kDeclared, class... Args>
auto forward(const char* name, Args... args) {
  using Fn = std::remove_pointer_t<decltype(kDeclared)>;
  static Fn* const real = library() ? reinterpret_cast<Fn*>(dlsym(library(), name)) : nullptr;
  using R = decltype(real(args...));
  return real ? real(args...) : missing<R>();
}

}  // namespace
}  // namespace tpsim::gpu

#define TPSIM_FORWARD(name, ...) ::tpsim::gpu::forward<&name>(#name, __VA_ARGS__)

extern "C" {

cublasStatus_t CUBLASWINAPI cublasLtCreate(cublasLtHandle_t* handle) { return TPSIM_FORWARD(cublasLtCreate, handle); }

const char* CUBLASWINAPI cublasLtGetStatusName(cublasStatus_t status) {
  return TPSIM_FORWARD(cublasLtGetStatusName, status);
}

const char* CUBLASWINAPI cublasLtGetStatusString(cublasStatus_t status) {
  return TPSIM_FORWARD(cublasLtGetStatusString, status);
}

size_t CUBLASWINAPI cublasLtGetVersion(void) { return ::tpsim::gpu::forward<&cublasLtGetVersion>("cublasLtGetVersion"); }

cublasStatus_t CUBLASWINAPI cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void* alpha,
                                           const void* a, cublasLtMatrixLayout_t aDesc, const void* b,
                                           cublasLtMatrixLayout_t bDesc, const void* beta, const void* c,
                                           cublasLtMatrixLayout_t cDesc, void* d, cublasLtMatrixLayout_t dDesc,
                                           const cublasLtMatmulAlgo_t* algo, void* workspace, size_t workspaceSize,
                                           cudaStream_t stream) {
  return TPSIM_FORWARD(cublasLtMatmul, handle, desc, alpha, a, aDesc, b, bDesc, beta, c, cDesc, d, dDesc, algo,
                       workspace, workspaceSize, stream);
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                                           cublasLtMatrixLayout_t aDesc, cublasLtMatrixLayout_t bDesc,
                                                           cublasLtMatrixLayout_t cDesc, cublasLtMatrixLayout_t dDesc,
                                                           cublasLtMatmulPreference_t preference, int requested,
                                                           cublasLtMatmulHeuristicResult_t results[], int* returned) {
  return TPSIM_FORWARD(cublasLtMatmulAlgoGetHeuristic, handle, desc, aDesc, bDesc, cDesc, dDesc, preference, requested,
                       results, returned);
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc, cublasComputeType_t computeType,
                                                     cudaDataType_t scaleType) {
  return TPSIM_FORWARD(cublasLtMatmulDescCreate, desc, computeType, scaleType);
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) {
  return TPSIM_FORWARD(cublasLtMatmulDescDestroy, desc);
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc,
                                                           cublasLtMatmulDescAttributes_t attr, const void* buf,
                                                           size_t size) {
  return TPSIM_FORWARD(cublasLtMatmulDescSetAttribute, desc, attr, buf, size);
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
  return TPSIM_FORWARD(cublasLtMatmulPreferenceCreate, pref);
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
  return TPSIM_FORWARD(cublasLtMatmulPreferenceDestroy, pref);
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                                 cublasLtMatmulPreferenceAttributes_t attr,
                                                                 const void* buf, size_t size) {
  return TPSIM_FORWARD(cublasLtMatmulPreferenceSetAttribute, pref, attr, buf, size);
}

cublasStatus_t CUBLASWINAPI cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType type,
                                                       uint64_t rows, uint64_t cols, int64_t ld) {
  return TPSIM_FORWARD(cublasLtMatrixLayoutCreate, layout, type, rows, cols, ld);
}

cublasStatus_t CUBLASWINAPI cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
  return TPSIM_FORWARD(cublasLtMatrixLayoutDestroy, layout);
}

}  // extern "C"
